//! A learned eviction model for the 2015 market: the probability that a spot instance is evicted
//! within its first hour, by logistic regression on features a broker has at launch, fitted on
//! what happened to launches in a training period ([`replayed_launches`]: every market every 10
//! minutes at the policy's bid deltas; `proteus simulate --fit-eviction FILE`) and loaded from
//! that file (`--eviction-model FILE`).
//!
//! **Features** (all from prices at or before the launch; [`FEATURES`]):
//!
//! - the price-driven replay's own estimate ([`super::PriceDrivenModel`], state-matched), as a
//!   logit: the model learns how far to trust it;
//! - the bid above the price, as a fraction of on-demand (and its log), and the price as a
//!   fraction of on-demand;
//! - the market's recent volatility: price changes in the last 1, 6 and 24 hours, and the spread
//!   of the price (highest − lowest, over on-demand) over the same windows;
//! - the market's state: minutes since its last change and whether that change was a rise;
//! - time of day and of week (as points on a circle);
//! - the market (one indicator per market of the training set; a market it has none for is
//!   answered as the average market, every indicator at its training mean:
//!   [`LearnedModel::unknown_markets`]).
//!
//! Where the allocation sits in its billing hour is not a feature: every estimate the policy
//! records (and every outcome scored) is at launch, where it is always the hour's start.
//!
//! Standardised features (the training set's means and spreads, kept in the file), then
//! L2-regularised logistic regression (`linfa-logistic`). For a horizon other than an hour the
//! hour's probability is converted at a constant hazard.

use super::{EvictionEstimate, MarketModel, ModelError, ModelKind};
use crate::market::{Market, Timestamp};
use crate::prices::PriceHistory;
use chrono::{Datelike, Timelike};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;

/// The horizon the model is fitted for, seconds.
pub const HORIZON_SECS: f64 = 3600.0;

/// What the file says it is.
const FILE_KIND: &str = "proteus-eviction-model";
const FILE_VERSION: u32 = 1;

/// The features before the market indicators, in order.
pub const FEATURES: [&str; 16] = [
    "replay_logit",
    "bid_delta_of_on_demand",
    "log_bid_delta",
    "price_of_on_demand",
    "changes_1h",
    "changes_6h",
    "changes_24h",
    "spread_1h",
    "spread_6h",
    "spread_24h",
    "log_minutes_since_change",
    "last_change_rise",
    "hour_sin",
    "hour_cos",
    "weekday_sin",
    "weekday_cos",
];

/// The model file (`--fit-eviction` writes it, `--eviction-model` reads it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvictionModelFile {
    pub kind: String,
    pub version: u32,
    pub horizon_secs: f64,
    /// The launches it was fitted on: first and last launch time, count, and the share evicted.
    pub trained_from: Timestamp,
    pub trained_to: Timestamp,
    pub samples: usize,
    pub evicted_rate: f64,
    /// Markets it knows (one indicator each).
    pub markets: Vec<String>,
    /// [`FEATURES`], then `market=<market>` for each market.
    pub features: Vec<String>,
    pub means: Vec<f64>,
    pub scales: Vec<f64>,
    pub intercept: f64,
    pub coefficients: Vec<f64>,
}

/// Why a model file or a fit was refused.
#[derive(Debug, thiserror::Error)]
pub enum LearnedError {
    #[error("the eviction model file {file}: {what}")]
    File { file: String, what: String },
    #[error("fitting the eviction model: {0}")]
    Fit(String),
}

/// One launch and what happened to it within its first hour.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub market: Market,
    pub at: Timestamp,
    /// The bid above the price at launch, USD/h.
    pub bid_delta_usd: f64,
    pub evicted: bool,
}

/// The launches a fit learns from: every market of `history`, every `step_secs` from `from` to
/// `to` (each launch's hour inside it), at each bid `delta` (a fraction of the market's
/// on-demand price) above the price then, each labelled by the 2015 market's own rule: evicted
/// if the price rises above the bid within the hour (what the simulator's world does). A
/// regular grid rather than one policy's launches, so that the model has seen every market and
/// state a policy may launch into, not only those its training-time estimates favoured.
pub fn replayed_launches(
    history: &PriceHistory,
    from: Timestamp,
    to: Timestamp,
    step_secs: f64,
    deltas: &[f64],
) -> Vec<Launch> {
    let mut out = Vec::new();
    let step = (step_secs.max(1.0) * 1000.0) as i64;
    for series in history.series() {
        let market = series.market();
        let Some(od) = history
            .on_demand()
            .for_market(market)
            .map(|o| o.on_demand.get())
        else {
            continue;
        };
        let mut t = from.millis();
        while t + (HORIZON_SECS * 1000.0) as i64 <= to.millis() {
            let at = Timestamp::from_millis(t);
            if let Some(price) = series.price_at(at) {
                for d in deltas {
                    let bid = price.get() + d * od;
                    out.push(Launch {
                        market: market.clone(),
                        at,
                        bid_delta_usd: d * od,
                        evicted: series
                            .first_above(at, bid, at.plus_secs(HORIZON_SECS))
                            .is_some(),
                    });
                }
            }
            t += step;
        }
    }
    out
}

fn feature_names(markets: &[String]) -> Vec<String> {
    FEATURES
        .iter()
        .map(|s| s.to_string())
        .chain(markets.iter().map(|m| format!("market={m}")))
        .collect()
}

/// What the features of a launch in `market` at `now` share whatever the bid: the market's
/// on-demand price and every feature but the first three.
struct MarketNow {
    on_demand: f64,
    features: [f64; FEATURES.len()],
}

fn market_now(
    history: &PriceHistory,
    market: &Market,
    now: Timestamp,
) -> Result<MarketNow, ModelError> {
    let series = history
        .get(market)
        .ok_or_else(|| ModelError::UnknownMarket(market.to_string()))?;
    let od = history
        .on_demand()
        .for_market(market)
        .map(|o| o.on_demand.get())
        .filter(|p| *p > 0.0)
        .ok_or_else(|| ModelError::NoOnDemandPrice(market.to_string()))?;
    let price = series
        .price_at(now)
        .map(|p| p.get())
        .ok_or_else(|| ModelError::UnknownMarket(market.to_string()))?;
    let mut out = [0.0; FEATURES.len()];
    out[3] = price / od;
    for (k, hours) in [1.0, 6.0, 24.0].into_iter().enumerate() {
        let from = now.plus_secs(-hours * 3600.0);
        // Changes strictly after `from` and at or before `now`; the price in force at `from`
        // counts towards the spread.
        let (_, prices) = series.window(from.plus_secs(0.001), now.plus_secs(0.001));
        let start = series.price_at(from).map(|p| p.get()).unwrap_or(price);
        let (lo, hi) = prices
            .iter()
            .fold((start, start), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        out[4 + k] = (prices.len() as f64).ln_1p();
        out[7 + k] = (hi - lo) / od;
    }
    let (since, rise) = match series.index_at(now) {
        Some(i) if i > 0 => (
            now.secs_since(series.times()[i]) / 60.0,
            if series.prices()[i] > series.prices()[i - 1] {
                1.0
            } else {
                -1.0
            },
        ),
        Some(i) => (now.secs_since(series.times()[i]) / 60.0, 0.0),
        None => (0.0, 0.0),
    };
    out[10] = since.max(0.0).ln_1p();
    out[11] = rise;
    let t = now.to_datetime();
    let day = f64::from(t.num_seconds_from_midnight()) / 86_400.0;
    let week = (f64::from(t.weekday().num_days_from_monday()) + day) / 7.0;
    let tau = std::f64::consts::TAU;
    out[12] = (tau * day).sin();
    out[13] = (tau * day).cos();
    out[14] = (tau * week).sin();
    out[15] = (tau * week).cos();
    Ok(MarketNow {
        on_demand: od,
        features: out,
    })
}

impl MarketNow {
    /// The features of a launch with its bid `bid_delta_usd` above the price, given the replay's
    /// estimate for it.
    fn with_bid(&self, bid_delta_usd: f64, replay: &EvictionEstimate) -> [f64; FEATURES.len()] {
        let mut out = self.features;
        let p = replay.probability.clamp(0.01, 0.99);
        let delta = bid_delta_usd.max(0.0) / self.on_demand;
        out[0] = (p / (1.0 - p)).ln();
        out[1] = delta;
        out[2] = (1.0 + 1000.0 * delta).ln();
        out
    }
}

/// The features of an instance of `market` launched at `now` with its bid `bid_delta_usd`
/// above the price, without the market indicators.
fn base_features(
    history: &PriceHistory,
    replay: &dyn MarketModel,
    market: &Market,
    bid_delta_usd: f64,
    now: Timestamp,
) -> Result<[f64; FEATURES.len()], ModelError> {
    let state = market_now(history, market, now)?;
    let r = replay.eviction(market, bid_delta_usd.max(0.0), HORIZON_SECS, now)?;
    Ok(state.with_bid(bid_delta_usd, &r))
}

/// Fits a model on `launches` (prices from `history`, the replay estimate from `replay`).
pub fn fit(
    history: &PriceHistory,
    replay: &dyn MarketModel,
    launches: &[Launch],
) -> Result<EvictionModelFile, LearnedError> {
    use linfa::prelude::*;
    // A launch the replay has too little history for has no estimate at launch: left out, as a
    // broker could not have judged it either.
    let mut kept: Vec<(&Launch, [f64; FEATURES.len()])> = Vec::with_capacity(launches.len());
    for l in launches {
        match base_features(history, replay, &l.market, l.bid_delta_usd, l.at) {
            Ok(f) => kept.push((l, f)),
            Err(ModelError::NotEnoughHistory { .. }) => {}
            Err(e) => {
                return Err(LearnedError::Fit(format!(
                    "the launch at {}: {e}",
                    l.at.to_datetime()
                )));
            }
        }
    }
    if kept.len() < 100 {
        return Err(LearnedError::Fit(format!(
            "{} launches with an outcome and an estimate at launch; at least 100 are needed",
            kept.len()
        )));
    }
    let evicted = kept.iter().filter(|(l, _)| l.evicted).count();
    if evicted == 0 || evicted == kept.len() {
        return Err(LearnedError::Fit(format!(
            "all {} launches had the same outcome (evicted: {})",
            kept.len(),
            evicted > 0
        )));
    }
    let mut markets: Vec<String> = kept.iter().map(|(l, _)| l.market.to_string()).collect();
    markets.sort();
    markets.dedup();
    let index: HashMap<&str, usize> = markets
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let width = FEATURES.len() + markets.len();
    let mut rows = Vec::with_capacity(kept.len() * width);
    for (l, base) in &kept {
        rows.extend_from_slice(base);
        let m = index.get(l.market.to_string().as_str()).copied();
        rows.extend((0..markets.len()).map(|i| if Some(i) == m { 1.0 } else { 0.0 }));
    }
    let n = kept.len();
    let mut x = ndarray_linfa::Array2::from_shape_vec((n, width), rows)
        .map_err(|e| LearnedError::Fit(e.to_string()))?;
    let mut means = Vec::with_capacity(width);
    let mut scales = Vec::with_capacity(width);
    for mut col in x.columns_mut() {
        let mean = col.sum() / n as f64;
        let var = col.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
        // A constant column (one market only) is left at zero.
        let scale = if var > 1e-18 { var.sqrt() } else { 1.0 };
        col.mapv_inplace(|v| (v - mean) / scale);
        means.push(mean);
        scales.push(scale);
    }
    let y = ndarray_linfa::Array1::from_iter(kept.iter().map(|(l, _)| l.evicted));
    let data = Dataset::new(x, y);
    let fitted = linfa_logistic::LogisticRegression::default()
        .alpha(1.0)
        .max_iterations(500)
        .fit(&data)
        .map_err(|e| LearnedError::Fit(e.to_string()))?;
    let sign = if fitted.labels().pos.class { 1.0 } else { -1.0 };
    let (from, to) = kept
        .iter()
        .fold((Timestamp::MAX, Timestamp::MIN), |(a, b), (l, _)| {
            (a.min(l.at), b.max(l.at))
        });
    Ok(EvictionModelFile {
        kind: FILE_KIND.into(),
        version: FILE_VERSION,
        horizon_secs: HORIZON_SECS,
        trained_from: from,
        trained_to: to,
        samples: n,
        evicted_rate: evicted as f64 / n as f64,
        features: feature_names(&markets),
        markets,
        means,
        scales,
        // linfa's positive class is the first label it met, not `true`: turn the model round
        // when it learned the odds of staying.
        intercept: sign * fitted.intercept(),
        coefficients: fitted.params().iter().map(|c| sign * c).collect(),
    })
}

impl EvictionModelFile {
    /// Reads and checks a model file.
    pub fn read(path: &std::path::Path) -> Result<EvictionModelFile, LearnedError> {
        let bad = |what: String| LearnedError::File {
            file: path.display().to_string(),
            what,
        };
        let text = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let de = &mut serde_json::Deserializer::from_slice(&text);
        let f: EvictionModelFile = serde_path_to_error::deserialize(de)
            .map_err(|e| bad(format!("at {}: {}", e.path(), e.inner())))?;
        f.check().map_err(bad)?;
        Ok(f)
    }

    /// The shape and values a model of this version has.
    pub fn check(&self) -> Result<(), String> {
        if self.kind != FILE_KIND || self.version != FILE_VERSION {
            return Err(format!(
                "kind {:?} version {}; this build reads {FILE_KIND:?} version {FILE_VERSION}",
                self.kind, self.version
            ));
        }
        if self.horizon_secs != HORIZON_SECS {
            return Err(format!(
                "horizon_secs is {}; the model is fitted for {HORIZON_SECS}",
                self.horizon_secs
            ));
        }
        let want = feature_names(&self.markets);
        if self.features != want {
            let at = self
                .features
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(self.features.len().min(want.len()));
            return Err(format!(
                "features: {} listed where this build computes {} (first difference at index \
                 {at}: {:?} for {:?})",
                self.features.len(),
                want.len(),
                self.features.get(at),
                want.get(at)
            ));
        }
        for (name, v) in [
            ("means", &self.means),
            ("scales", &self.scales),
            ("coefficients", &self.coefficients),
        ] {
            if v.len() != want.len() {
                return Err(format!(
                    "{name}: {} values for {} features",
                    v.len(),
                    want.len()
                ));
            }
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(format!("{name}[{i}] is not a finite number"));
            }
        }
        if let Some(i) = self.scales.iter().position(|s| *s <= 0.0) {
            return Err(format!("scales[{i}] is not positive"));
        }
        if !self.intercept.is_finite() {
            return Err("intercept is not a finite number".into());
        }
        Ok(())
    }

    /// The probability of eviction within the hour for these features.
    fn probability(&self, base: &[f64; FEATURES.len()], market: Option<usize>) -> f64 {
        let mut z = self.intercept;
        for (i, c) in self.coefficients.iter().enumerate() {
            let x = match market {
                _ if i < FEATURES.len() => base[i],
                // An unknown market: every indicator at its training mean (the average market).
                None => self.means[i],
                Some(m) if i - FEATURES.len() == m => 1.0,
                Some(_) => 0.0,
            };
            z += c * (x - self.means[i]) / self.scales[i];
        }
        1.0 / (1.0 + (-z).exp())
    }
}

/// The learned model as a [`MarketModel`]: the replay for its feature, the file for the answer.
pub struct LearnedModel {
    history: Arc<PriceHistory>,
    replay: Box<dyn MarketModel>,
    file: Arc<EvictionModelFile>,
    markets: Arc<HashMap<String, usize>>,
}

impl LearnedModel {
    /// `file` over `history`; refused when `history` has a market the file does not know.
    pub fn new(
        history: Arc<PriceHistory>,
        replay: Box<dyn MarketModel>,
        file: EvictionModelFile,
        source: &std::path::Path,
    ) -> Result<LearnedModel, LearnedError> {
        file.check().map_err(|what| LearnedError::File {
            file: source.display().to_string(),
            what,
        })?;
        let markets: HashMap<String, usize> = file
            .markets
            .iter()
            .enumerate()
            .map(|(i, m)| (m.clone(), i))
            .collect();
        let priced: Vec<String> = history.series().map(|s| s.market().to_string()).collect();
        if !priced.iter().any(|m| markets.contains_key(m)) {
            return Err(LearnedError::File {
                file: source.display().to_string(),
                what: format!(
                    "fitted for {} but the prices are of {}: it does not know one of them",
                    file.markets.join(", "),
                    priced.join(", ")
                ),
            });
        }
        Ok(LearnedModel {
            history,
            replay,
            file: Arc::new(file),
            markets: Arc::new(markets),
        })
    }

    /// Markets of the prices the file has no indicator for (nothing was launched there in its
    /// training period): they are answered as the average market.
    pub fn unknown_markets(&self) -> Vec<String> {
        self.history
            .series()
            .map(|s| s.market().to_string())
            .filter(|m| !self.markets.contains_key(m))
            .collect()
    }
}

impl MarketModel for LearnedModel {
    fn kind(&self) -> ModelKind {
        ModelKind::PriceDriven
    }

    fn eviction(
        &self,
        market: &Market,
        bid_delta_usd: f64,
        horizon_secs: f64,
        now: Timestamp,
    ) -> Result<EvictionEstimate, ModelError> {
        let mut out = Vec::with_capacity(1);
        self.eviction_many(market, &[bid_delta_usd], horizon_secs, now, &mut out)?;
        out.pop().ok_or(ModelError::BadHorizon(horizon_secs))
    }

    /// The market's state once, then each delta's replay estimate and answer.
    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        now: Timestamp,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        if !(horizon_secs.is_finite() && horizon_secs > 0.0) {
            return Err(ModelError::BadHorizon(horizon_secs));
        }
        let state = market_now(&self.history, market, now)?;
        let deltas: Vec<f64> = bid_deltas_usd.iter().map(|d| d.max(0.0)).collect();
        let mut replays = Vec::with_capacity(deltas.len());
        self.replay
            .eviction_many(market, &deltas, HORIZON_SECS, now, &mut replays)?;
        let m = self.markets.get(&market.to_string()).copied();
        for (d, r) in deltas.iter().zip(&replays) {
            let hour = self
                .file
                .probability(&state.with_bid(*d, r), m)
                .clamp(1e-6, 1.0 - 1e-6);
            // A constant hazard through the hour, and beyond it for a longer horizon.
            let rate = -(1.0 - hour).ln() / HORIZON_SECS;
            let probability = 1.0 - (-rate * horizon_secs).exp();
            out.push(EvictionEstimate {
                probability,
                expected_secs: probability / rate,
                horizon_secs,
                samples: r.samples,
            });
        }
        Ok(())
    }

    fn boxed_clone(&self) -> Box<dyn MarketModel> {
        Box::new(LearnedModel {
            history: self.history.clone(),
            replay: self.replay.boxed_clone(),
            file: self.file.clone(),
            markets: self.markets.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::{InstanceType, Region, UsdPerHour};
    use crate::market_model::{PriceDrivenModel, PriceModelConfig};
    use crate::prices::{InstanceOffer, OnDemandCatalog, PriceSeries};
    use rand::{Rng, SeedableRng};

    const MIN: i64 = 60_000;

    /// Forty days of a market whose price steps up or down a cent every 5–15 minutes, between
    /// 0.10 and 0.40 (on-demand 1.00): near the top a bid at the price is seldom passed.
    fn market() -> (Arc<PriceHistory>, Market) {
        let market = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (mut t, mut p, mut points) = (0i64, 0.2f64, Vec::new());
        while t < 40 * 1440 * MIN {
            points.push((Timestamp::from_millis(t), UsdPerHour::new(p).unwrap()));
            t += rng.random_range(5..15) * MIN;
            p = if rng.random_bool(0.5) {
                (p + 0.01).min(0.4)
            } else {
                (p - 0.01).max(0.1)
            };
        }
        let series = PriceSeries::new(market.clone(), points);
        let od = OnDemandCatalog::new([InstanceOffer {
            region: Region::parse("us-east-1").unwrap(),
            instance_type: InstanceType::parse("c3.xlarge").unwrap(),
            vcpus: Some(4),
            memory_gib: None,
            on_demand: UsdPerHour::new(1.0).unwrap(),
        }]);
        (Arc::new(PriceHistory::new([series], od)), market)
    }

    fn replay(history: &Arc<PriceHistory>) -> PriceDrivenModel {
        PriceDrivenModel::new(
            history.clone(),
            PriceModelConfig {
                lookback_secs: 2.0 * 86_400.0,
                ..PriceModelConfig::default()
            },
        )
    }

    /// Launches every 30 minutes from day 3 to day 38 at a few bids, each evicted or not by the
    /// price's own path (the 2015 rule: the first change above the bid within the hour).
    fn launches(history: &PriceHistory, market: &Market) -> Vec<Launch> {
        let series = history.get(market).unwrap();
        let mut out = Vec::new();
        let mut t = 3 * 1440 * MIN;
        while t < 38 * 1440 * MIN {
            let at = Timestamp::from_millis(t);
            let price = series.price_at(at).unwrap().get();
            for delta in [0.0, 0.005, 0.02] {
                let evicted = series
                    .first_above(at, price + delta, at.plus_secs(HORIZON_SECS))
                    .is_some();
                out.push(Launch {
                    market: market.clone(),
                    at,
                    bid_delta_usd: delta,
                    evicted,
                });
            }
            t += 30 * MIN;
        }
        out
    }

    #[test]
    fn a_fitted_model_is_calibrated_in_the_large_and_beats_a_constant_forecast() {
        let (history, market) = market();
        let replay = replay(&history);
        let all = launches(&history, &market);
        let (train, test): (Vec<Launch>, Vec<Launch>) = all
            .into_iter()
            .partition(|l| l.at < Timestamp::from_millis(30 * 1440 * MIN));
        let file = fit(&history, &replay, &train).expect("fits");
        assert!(file.check().is_ok());
        // The same launches with the first outcome the other one: the same model (the
        // learning crate takes the first label it meets as its positive class).
        let mut swapped = train.clone();
        let k = swapped
            .iter()
            .position(|l| l.evicted != swapped[0].evicted)
            .expect("both outcomes");
        swapped.swap(0, k);
        let again = fit(&history, &replay, &swapped).expect("fits");
        for (a, b) in again.coefficients.iter().zip(&file.coefficients) {
            assert!((a - b).abs() < 0.01 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert!((again.intercept - file.intercept).abs() < 0.01 * (1.0 + file.intercept.abs()));
        assert_eq!(file.markets, vec![market.to_string()]);
        let model = LearnedModel::new(
            history.clone(),
            Box::new(replay.clone()),
            file.clone(),
            std::path::Path::new("mem"),
        )
        .expect("loads");
        assert!(model.unknown_markets().is_empty());
        // Out of sample: the learned estimates score better than the training rate said always.
        let (mut brier, mut constant, mut mean_p, mut rate) = (0.0, 0.0, 0.0, 0.0);
        for l in &test {
            let e = model
                .eviction(&l.market, l.bid_delta_usd, HORIZON_SECS, l.at)
                .expect("an estimate");
            assert!(e.probability > 0.0 && e.probability < 1.0);
            assert!(e.expected_secs > 0.0 && e.expected_secs <= HORIZON_SECS);
            let y = if l.evicted { 1.0 } else { 0.0 };
            brier += (e.probability - y).powi(2);
            constant += (file.evicted_rate - y).powi(2);
            mean_p += e.probability;
            rate += y;
        }
        let n = test.len() as f64;
        assert!(brier < constant, "Brier {brier} against {constant}");
        assert!(
            (mean_p / n - rate / n).abs() < 0.1,
            "{} vs {}",
            mean_p / n,
            rate / n
        );
        // A shorter horizon is less likely to see an eviction.
        let l = &test[0];
        let hour = model.eviction(&l.market, 0.0, HORIZON_SECS, l.at).unwrap();
        let minutes = model.eviction(&l.market, 0.0, 600.0, l.at).unwrap();
        assert!(minutes.probability < hour.probability);
    }

    #[test]
    fn a_model_file_of_the_wrong_shape_or_for_other_markets_is_refused() {
        let (history, market) = market();
        let replay = replay(&history);
        let file = fit(&history, &replay, &launches(&history, &market)).expect("fits");
        let mut short = file.clone();
        short.means.pop();
        assert!(short.check().unwrap_err().contains("means"));
        let mut renamed = file.clone();
        renamed.features[0] = "replay".into();
        assert!(renamed.check().unwrap_err().contains("index 0"));
        let mut old = file.clone();
        old.version = 0;
        assert!(old.check().unwrap_err().contains("version"));
        let mut other = file.clone();
        other.markets = vec!["us-west-2a/m4.large".into()];
        other.features = feature_names(&other.markets);
        let e = LearnedModel::new(
            history,
            Box::new(replay),
            other,
            std::path::Path::new("x.json"),
        )
        .err()
        .expect("refused");
        assert!(
            e.to_string().contains("x.json") && e.to_string().contains("c3.xlarge"),
            "{e}"
        );
        // Too few launches to fit.
        let (history, market) = self::market();
        let few: Vec<Launch> = launches(&history, &market).into_iter().take(20).collect();
        assert!(fit(&history, &self::replay(&history), &few).is_err());
    }
}
