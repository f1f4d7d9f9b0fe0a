//! The 2015 market model: eviction risk from replaying a market's own price history.
//!
//! For a market, a bid delta `d` and a horizon `H`, each historical start time `s` gives one
//! outcome: with the bid set to the price at `s` plus `d`, the instance is evicted at the first
//! price change in `(s, s + H]` that is strictly above the bid (the rule of
//! [`PriceSeries::first_above`]), or survives the horizon. The estimate at a decision time `now`
//! averages the outcomes of every start time `s` on a regular grid with
//! `now − lookback ≤ s` and `s + H ≤ now`: a start time whose horizon reaches past `now` would
//! need prices from the future, so it is not used.
//!
//! Replaying per query would cost milliseconds; instead, the outcome of every start time is
//! computed once per market (for a grid of deltas, expressed as fractions of the type's
//! on-demand price) into prefix sums, and a query is two binary-search-free index computations
//! and a subtraction. Deltas between grid points are interpolated linearly; other horizons are
//! replayed directly (slow path, same answer as a brute-force replay).

use super::{EvictionEstimate, MarketModel, ModelError, ModelKind};
use crate::market::{Market, Timestamp};
use crate::prices::{PriceHistory, PriceSeries};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Settings of the price-driven model.
#[derive(Debug, Clone, PartialEq)]
pub struct PriceModelConfig {
    /// How far back from the decision time start times are taken, seconds. Default 7 days: long
    /// enough for hundreds of samples, short enough to follow the 2015 market's regime changes.
    pub lookback_secs: f64,
    /// The horizon the fast path serves, seconds. Default one hour: the billing period of
    /// `hourly-2015`, over which BidBrain weighs each allocation.
    pub horizon_secs: f64,
    /// Spacing of the start-time grid, seconds. Default 15 minutes (672 samples per week).
    pub sample_every_secs: f64,
    /// Fewer usable start times than this in the window is an error, not a guess.
    pub min_samples: u32,
    /// Bid deltas precomputed, as fractions of the market's on-demand price, ascending from 0.
    pub delta_grid: Vec<f64>,
}

impl Default for PriceModelConfig {
    fn default() -> Self {
        PriceModelConfig {
            lookback_secs: 7.0 * 86_400.0,
            horizon_secs: 3_600.0,
            sample_every_secs: 900.0,
            min_samples: 24,
            delta_grid: vec![
                0.0, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 1.5, 2.0, 3.0, 5.0,
            ],
        }
    }
}

/// Eviction risk from price history. Cheap to clone (the history and the per-market indexes are
/// shared), and safe to share between threads (indexes are built once, on first use).
#[derive(Clone)]
pub struct PriceDrivenModel {
    history: Arc<PriceHistory>,
    config: Arc<PriceModelConfig>,
    indexes: Arc<HashMap<Market, OnceLock<Result<MarketIndex, ModelError>>>>,
}

/// Precomputed outcomes of one market's start times.
#[derive(Debug)]
struct MarketIndex {
    /// Time of sample 0, ms (a multiple of the step, so samples do not depend on anything but
    /// the step).
    origin_ms: i64,
    step_ms: i64,
    /// On-demand price, USD/h: the unit of the delta grid.
    on_demand: f64,
    /// `valid[k]`: samples before `k` that had a price (prefix count).
    valid: Vec<u32>,
    /// Per grid delta, prefix counts of evicted samples.
    evicted: Vec<Vec<u32>>,
    /// Per grid delta, prefix sums of `min(time to eviction, H)` in whole seconds.
    survived_secs: Vec<Vec<u64>>,
}

impl PriceDrivenModel {
    pub fn new(history: Arc<PriceHistory>, config: PriceModelConfig) -> Self {
        let indexes = history
            .markets()
            .map(|m| (m.clone(), OnceLock::new()))
            .collect();
        PriceDrivenModel {
            history,
            config: Arc::new(config),
            indexes: Arc::new(indexes),
        }
    }

    pub fn config(&self) -> &PriceModelConfig {
        &self.config
    }

    /// Builds every market's index now rather than on first use (benchmarks, parallel sweeps).
    pub fn warm_up(&self) {
        for (market, cell) in self.indexes.iter() {
            cell.get_or_init(|| self.build(market));
        }
    }

    fn index(&self, market: &Market) -> Result<&MarketIndex, ModelError> {
        let cell = self
            .indexes
            .get(market)
            .ok_or_else(|| ModelError::UnknownMarket(market.to_string()))?;
        cell.get_or_init(|| self.build(market))
            .as_ref()
            .map_err(Clone::clone)
    }

    fn build(&self, market: &Market) -> Result<MarketIndex, ModelError> {
        let series = self
            .history
            .get(market)
            .ok_or_else(|| ModelError::UnknownMarket(market.to_string()))?;
        let on_demand = self
            .history
            .on_demand()
            .for_market(market)
            .map(|o| o.on_demand.get())
            .filter(|p| *p > 0.0)
            .ok_or_else(|| ModelError::NoOnDemandPrice(market.to_string()))?;
        // Samples run a look-back past the end of the whole trace: a quiet market holds its last
        // price, and a live broker decides after its newest stored change.
        let lookback_ms = (self.config.lookback_secs * 1000.0) as i64;
        let until = self
            .history
            .span()
            .map_or(Timestamp(0), |(_, last)| Timestamp(last.0 + lookback_ms));
        Ok(build_index(series, on_demand, &self.config, until))
    }

    /// The sample range `[lo, hi)` usable at `now` for horizon `h_ms`.
    fn sample_range(&self, idx: &MarketIndex, now: Timestamp, h_ms: i64) -> (usize, usize) {
        let n = idx.valid.len() - 1;
        let lookback_ms = (self.config.lookback_secs * 1000.0) as i64;
        let first = now.0 - lookback_ms - idx.origin_ms;
        let last = now.0 - h_ms - idx.origin_ms; // s_k + H <= now  ⇔  k <= last / step
        let lo = ceil_div(first, idx.step_ms).clamp(0, n as i64) as usize;
        let hi = if last < 0 {
            0
        } else {
            (last / idx.step_ms + 1).clamp(0, n as i64) as usize
        };
        (lo, hi.max(lo))
    }

    /// The index and the usable sample range of `market` at `now` for `horizon_secs`.
    fn window(
        &self,
        market: &Market,
        horizon_secs: f64,
        now: Timestamp,
    ) -> Result<(&MarketIndex, usize, usize, u32, i64), ModelError> {
        if !(horizon_secs.is_finite() && horizon_secs > 0.0) {
            return Err(ModelError::BadHorizon(horizon_secs));
        }
        let idx = self.index(market)?;
        let h_ms = (horizon_secs * 1000.0).round() as i64;
        let (lo, hi) = self.sample_range(idx, now, h_ms);
        let samples = idx.valid[hi] - idx.valid[lo];
        if samples < self.config.min_samples.max(1) {
            return Err(ModelError::NotEnoughHistory {
                market: market.to_string(),
                now,
                samples,
                needed: self.config.min_samples.max(1),
            });
        }
        Ok((idx, lo, hi, samples, h_ms))
    }

    #[allow(clippy::too_many_arguments)]
    fn at_delta(
        &self,
        market: &Market,
        idx: &MarketIndex,
        lo: usize,
        hi: usize,
        samples: u32,
        h_ms: i64,
        bid_delta_usd: f64,
    ) -> Result<EvictionEstimate, ModelError> {
        let horizon_secs = h_ms as f64 / 1000.0;
        if bid_delta_usd < 0.0 {
            // A bid below the current price is not fulfilled; treat it as evicted at once.
            return Ok(EvictionEstimate {
                probability: 1.0,
                expected_secs: 0.0,
                horizon_secs,
                samples,
            });
        }
        let fast_horizon_ms = (self.config.horizon_secs * 1000.0).round() as i64;
        if h_ms != fast_horizon_ms {
            return self.replay_range(market, idx, lo, hi, bid_delta_usd, h_ms, samples);
        }
        let frac = bid_delta_usd / idx.on_demand;
        let grid = &self.config.delta_grid;
        let at = |g: usize| {
            let ev = idx.evicted[g][hi] - idx.evicted[g][lo];
            let secs = idx.survived_secs[g][hi] - idx.survived_secs[g][lo];
            (ev as f64 / samples as f64, secs as f64 / samples as f64)
        };
        // Position of `frac` in the grid: the last grid point at or below it.
        let j = grid.partition_point(|&g| g <= frac).saturating_sub(1);
        let (p, e) = if j + 1 >= grid.len() || grid[j] == frac {
            at(j)
        } else {
            let (p0, e0) = at(j);
            let (p1, e1) = at(j + 1);
            let w = (frac - grid[j]) / (grid[j + 1] - grid[j]);
            (p0 + w * (p1 - p0), e0 + w * (e1 - e0))
        };
        Ok(EvictionEstimate {
            probability: p,
            expected_secs: e,
            horizon_secs,
            samples,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn replay_range(
        &self,
        market: &Market,
        idx: &MarketIndex,
        lo: usize,
        hi: usize,
        delta_usd: f64,
        h_ms: i64,
        samples: u32,
    ) -> Result<EvictionEstimate, ModelError> {
        let series = self
            .history
            .get(market)
            .ok_or_else(|| ModelError::UnknownMarket(market.to_string()))?;
        let (mut evicted, mut survived_ms) = (0u64, 0i64);
        for k in lo..hi {
            let s = Timestamp(idx.origin_ms + k as i64 * idx.step_ms);
            match replay_once(series, s, delta_usd, h_ms) {
                None => {}
                Some(Some(after)) => {
                    evicted += 1;
                    survived_ms += after;
                }
                Some(None) => survived_ms += h_ms,
            }
        }
        Ok(EvictionEstimate {
            probability: evicted as f64 / samples as f64,
            expected_secs: survived_ms as f64 / 1000.0 / samples as f64,
            horizon_secs: h_ms as f64 / 1000.0,
            samples,
        })
    }
}

impl MarketModel for PriceDrivenModel {
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
        let (idx, lo, hi, samples, h_ms) = self.window(market, horizon_secs, now)?;
        self.at_delta(market, idx, lo, hi, samples, h_ms, bid_delta_usd)
    }

    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        now: Timestamp,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        let (idx, lo, hi, samples, h_ms) = self.window(market, horizon_secs, now)?;
        for &d in bid_deltas_usd {
            out.push(self.at_delta(market, idx, lo, hi, samples, h_ms, d)?);
        }
        Ok(())
    }

    fn boxed_clone(&self) -> Box<dyn MarketModel> {
        Box::new(self.clone())
    }
}

/// One replay: with a bid of `price_at(start) + delta_usd`, when is the instance evicted?
/// `None` if the market has no price at `start`; `Some(None)` if it survives `horizon_ms`;
/// `Some(Some(ms))` if it is evicted `ms` after `start`. This is the definition; the index
/// and the tests are checked against it.
pub fn replay_once(
    series: &PriceSeries,
    start: Timestamp,
    delta_usd: f64,
    horizon_ms: i64,
) -> Option<Option<i64>> {
    let p0 = series.price_at(start)?;
    Some(
        series
            .first_above(start, p0 + delta_usd, Timestamp(start.0 + horizon_ms))
            .map(|t| t.0 - start.0),
    )
}

fn ceil_div(a: i64, b: i64) -> i64 {
    a.div_euclid(b) + i64::from(a.rem_euclid(b) != 0)
}

fn build_index(
    series: &PriceSeries,
    on_demand: f64,
    config: &PriceModelConfig,
    until: Timestamp,
) -> MarketIndex {
    let step_ms = ((config.sample_every_secs * 1000.0).round() as i64).max(1);
    let h_ms = (config.horizon_secs * 1000.0).round() as i64;
    let grid_usd: Vec<f64> = config.delta_grid.iter().map(|f| f * on_demand).collect();
    let times = series.times();
    let prices = series.prices();
    let (Some(first), Some(last)) = (
        series.first_time(),
        series.last_time().map(|l| l.max(until)),
    ) else {
        return MarketIndex {
            origin_ms: 0,
            step_ms,
            on_demand,
            valid: vec![0],
            evicted: vec![vec![0]; grid_usd.len()],
            survived_secs: vec![vec![0]; grid_usd.len()],
        };
    };
    let origin_ms = ceil_div(first.0, step_ms) * step_ms;
    // Start times up to the trace's end; a decision after it has nothing to decide anyway.
    let n = if last.0 < origin_ms {
        0
    } else {
        ((last.0 - origin_ms) / step_ms + 1) as usize
    };
    let mut valid = Vec::with_capacity(n + 1);
    let mut evicted: Vec<Vec<u32>> = grid_usd.iter().map(|_| Vec::with_capacity(n + 1)).collect();
    let mut survived: Vec<Vec<u64>> = grid_usd.iter().map(|_| Vec::with_capacity(n + 1)).collect();
    valid.push(0u32);
    for g in 0..grid_usd.len() {
        evicted[g].push(0);
        survived[g].push(0);
    }
    // Running-maximum breakpoints of the price after a start time: (excess over p0, ms after s).
    let mut breaks: Vec<(f64, i64)> = Vec::with_capacity(64);
    let mut i = 0usize; // index of the change in force at s
    for k in 0..n {
        let s = origin_ms + k as i64 * step_ms;
        while i + 1 < times.len() && times[i + 1].0 <= s {
            i += 1;
        }
        let has_price = times[i].0 <= s;
        let v = *valid.last().unwrap_or(&0) + u32::from(has_price);
        valid.push(v);
        breaks.clear();
        if has_price {
            let p0 = prices[i];
            let mut max = p0;
            let mut j = i + 1;
            while j < times.len() && times[j].0 <= s + h_ms {
                if prices[j] > max {
                    max = prices[j];
                    breaks.push((max - p0, times[j].0 - s));
                }
                j += 1;
            }
        }
        // Grid ascending, breakpoints ascending in excess: one pointer walks both.
        let mut b = 0usize;
        for (g, &d) in grid_usd.iter().enumerate() {
            let (ev, secs) = if !has_price {
                (0, 0)
            } else {
                while b < breaks.len() && breaks[b].0 <= d {
                    b += 1;
                }
                match breaks.get(b) {
                    Some(&(_, after)) => (1, (after / 1000) as u64),
                    None => (0, (h_ms / 1000) as u64),
                }
            };
            let e = evicted[g].last().copied().unwrap_or(0) + ev;
            evicted[g].push(e);
            let t = survived[g].last().copied().unwrap_or(0) + secs;
            survived[g].push(t);
        }
    }
    MarketIndex {
        origin_ms,
        step_ms,
        on_demand,
        valid,
        evicted,
        survived_secs: survived,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::{InstanceType, Region, UsdPerHour};
    use crate::prices::{InstanceOffer, OnDemandCatalog};

    const M: i64 = 60_000;

    /// A hand-made market: on-demand 1.00; the price wanders in minutes.
    fn history(points: &[(i64, f64)]) -> (Arc<PriceHistory>, Market) {
        let market = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let series = PriceSeries::new(
            market.clone(),
            points
                .iter()
                .map(|&(m, p)| (Timestamp(m * M), UsdPerHour::new(p).unwrap()))
                .collect(),
        );
        let od = OnDemandCatalog::new([InstanceOffer {
            region: Region::parse("us-east-1").unwrap(),
            instance_type: InstanceType::parse("c3.xlarge").unwrap(),
            vcpus: Some(4),
            memory_gib: None,
            on_demand: UsdPerHour::new(1.0).unwrap(),
        }]);
        (Arc::new(PriceHistory::new([series], od)), market)
    }

    fn small_config() -> PriceModelConfig {
        PriceModelConfig {
            lookback_secs: 6.0 * 3600.0,
            horizon_secs: 3600.0,
            sample_every_secs: 600.0,
            min_samples: 1,
            delta_grid: vec![0.0, 0.05, 0.1, 0.3, 1.0],
        }
    }

    fn trace() -> Vec<(i64, f64)> {
        vec![
            (0, 0.20),
            (17, 0.22),
            (41, 0.21),
            (65, 0.35),
            (70, 0.20),
            (130, 0.20),
            (131, 0.26),
            (200, 0.19),
            (260, 0.50),
            (262, 0.18),
            (330, 0.24),
            (400, 0.18),
            (470, 0.30),
            (520, 0.25),
        ]
    }

    /// The brute force: every grid start time in the window, replayed by a plain scan.
    fn brute(
        points: &[(i64, f64)],
        now_min: i64,
        delta: f64,
        lookback_min: i64,
        horizon_min: i64,
    ) -> (f64, f64, u32) {
        let price_at = |t: f64| {
            points
                .iter()
                .rev()
                .find(|(m, _)| (*m as f64) <= t)
                .map(|p| p.1)
        };
        let (mut n, mut ev, mut secs) = (0u32, 0u32, 0.0);
        let mut s = 0i64;
        while s <= now_min {
            if s >= now_min - lookback_min && s + horizon_min <= now_min {
                if let Some(p0) = price_at(s as f64) {
                    n += 1;
                    let hit = points
                        .iter()
                        .find(|(m, p)| *m > s && *m <= s + horizon_min && *p > p0 + delta);
                    match hit {
                        Some((m, _)) => {
                            ev += 1;
                            secs += ((m - s) * 60) as f64;
                        }
                        None => secs += (horizon_min * 60) as f64,
                    }
                }
            }
            s += 10;
        }
        (ev as f64 / n as f64, secs / n as f64, n)
    }

    #[test]
    fn grid_estimates_equal_a_brute_force_replay() {
        let points = trace();
        let (h, market) = history(&points);
        let model = PriceDrivenModel::new(h, small_config());
        for now in [70, 125, 200, 299, 360, 480, 600] {
            for delta in [0.0, 0.05, 0.1, 0.3, 1.0] {
                let e = model
                    .eviction(&market, delta, 3600.0, Timestamp(now * M))
                    .unwrap();
                let (p, secs, n) = brute(&points, now, delta, 360, 60);
                assert_eq!(e.samples, n, "now={now} delta={delta}");
                assert!(
                    (e.probability - p).abs() < 1e-12,
                    "now={now} delta={delta}: {} vs {p}",
                    e.probability
                );
                assert!(
                    (e.expected_secs - secs).abs() < 1e-9,
                    "now={now} delta={delta}: {} vs {secs}",
                    e.expected_secs
                );
            }
        }
    }

    #[test]
    fn other_horizons_replay_and_off_grid_deltas_interpolate() {
        let points = trace();
        let (h, market) = history(&points);
        let model = PriceDrivenModel::new(h, small_config());
        let now = Timestamp(600 * M);
        let e = model.eviction(&market, 0.02, 1800.0, now).unwrap();
        let (p, secs, n) = brute(&points, 600, 0.02, 360, 30);
        assert_eq!(e.samples, n);
        assert!((e.probability - p).abs() < 1e-12 && (e.expected_secs - secs).abs() < 1e-9);
        let a = model.eviction(&market, 0.05, 3600.0, now).unwrap();
        let b = model.eviction(&market, 0.1, 3600.0, now).unwrap();
        let mid = model.eviction(&market, 0.075, 3600.0, now).unwrap();
        assert!((mid.probability - (a.probability + b.probability) / 2.0).abs() < 1e-12);
        assert!(
            a.probability >= b.probability,
            "a higher bid is never evicted more often"
        );
    }

    #[test]
    fn estimates_ignore_everything_after_the_decision_time() {
        let points = trace();
        let (h, market) = history(&points);
        let model = PriceDrivenModel::new(h, small_config());
        let now = 300;
        let mut altered = points.clone();
        for p in altered.iter_mut().filter(|(m, _)| *m > now) {
            p.1 = 9.0;
        }
        altered.push((now + 1, 0.01));
        let (h2, _) = history(&altered);
        let model2 = PriceDrivenModel::new(h2, small_config());
        for delta in [0.0, 0.01, 0.05, 0.2, 2.0] {
            let a = model
                .eviction(&market, delta, 3600.0, Timestamp(now * M))
                .unwrap();
            let b = model2
                .eviction(&market, delta, 3600.0, Timestamp(now * M))
                .unwrap();
            assert_eq!(a, b, "delta {delta}");
        }
    }

    #[test]
    fn too_little_history_is_an_error() {
        let (h, market) = history(&trace());
        let model = PriceDrivenModel::new(
            h,
            PriceModelConfig {
                min_samples: 5,
                ..small_config()
            },
        );
        let err = model
            .eviction(&market, 0.0, 3600.0, Timestamp(90 * M))
            .unwrap_err();
        assert!(
            matches!(err, ModelError::NotEnoughHistory { samples: 4, .. }),
            "{err}"
        );
        let other = Market::parse("us-east-1b/c3.xlarge").unwrap();
        assert!(matches!(
            model.eviction(&other, 0.0, 3600.0, Timestamp(600 * M)),
            Err(ModelError::UnknownMarket(_))
        ));
    }
}
