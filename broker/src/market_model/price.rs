//! The 2015 market model: eviction risk from replaying a market's own price history.
//!
//! For a market, a bid delta `d` and a horizon `H`, each historical start time `s` gives one
//! outcome: with the bid set to the price at `s` plus `d`, the instance is evicted at the first
//! price change in `(s, s + H]` that is strictly above the bid (the rule of
//! [`PriceSeries::first_above`]), or survives the horizon. The estimate at a decision time `now`
//! averages the outcomes of the start times `s` with `now − lookback ≤ s` and `s + H ≤ now`: a
//! start time whose horizon reaches past `now` would need prices from the future, so it is not
//! used.
//!
//! Which start times? Two sets, both built only from the past of each decision:
//!
//! - **Unconditional**: a regular grid (every `sample_every_secs`), the paper's replay.
//! - **State-matched** (on by default, [`PriceModelConfig::match_state`]): the 2015 prices move
//!   in small steps every few minutes and revert: right after a *fall*, a bid at the price is
//!   evicted by the next rise within minutes (about 90% within the hour, after ~10 minutes on
//!   c3.xlarge); right after a *rise* it survives half an hour on average. So the replay uses
//!   start times in the same state as the market at `now`: the last change in the same
//!   direction (rise or fall), and about as long ago (under 2, 2–5, 5–10, or over 10 minutes).
//!   Each historical change contributes start times at those ages. When a state has fewer than
//!   `min_samples` start times in the window, the unconditional grid answers.
//!
//! Replaying per query would cost milliseconds; instead, the outcome of every start time is
//! computed once per market, for a grid of deltas expressed as fractions of the type's
//! on-demand price, into prefix sums; a query is two binary searches and a subtraction. Deltas
//! between grid points are interpolated linearly; other horizons are replayed directly (slow
//! path, same answer as a brute-force replay of the same start times).

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
    /// Spacing of the unconditional start-time grid, seconds. Default 15 minutes.
    pub sample_every_secs: f64,
    /// Fewer usable start times than this in the window is an error (unconditional) or a
    /// fallback to the unconditional grid (state-matched).
    pub min_samples: u32,
    /// Bid deltas precomputed, as fractions of the market's on-demand price, ascending from 0.
    pub delta_grid: Vec<f64>,
    /// Replay only start times in the market's current state (see the module documentation).
    pub match_state: bool,
}

impl Default for PriceModelConfig {
    fn default() -> Self {
        PriceModelConfig {
            lookback_secs: 7.0 * 86_400.0,
            horizon_secs: 3_600.0,
            sample_every_secs: 900.0,
            min_samples: 24,
            delta_grid: vec![
                0.0, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
            ],
            match_state: true,
        }
    }
}

/// Upper ends of the age buckets of the market state, ms (the last is open).
const AGE_BUCKETS_MS: [i64; 3] = [120_000, 300_000, 600_000];
/// The ages at which a change contributes start times to each bucket, ms. The open bucket gets
/// a start time every 15 minutes while the price holds (at most 8).
const AGE_REPRESENTATIVES_MS: [i64; 3] = [60_000, 210_000, 450_000];
const OPEN_BUCKET_STEP_MS: i64 = 900_000;
const OPEN_BUCKET_MAX: i64 = 8;
const CLASSES: usize = 2 * (AGE_BUCKETS_MS.len() + 1);

/// The state of a market at a time: the direction of its last change and how long ago it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarketState {
    pub rose: bool,
    pub age_bucket: usize,
}

impl MarketState {
    /// The state at `t`, if the series has two changes at or before it.
    pub fn at(series: &PriceSeries, t: Timestamp) -> Option<MarketState> {
        Self::from_changes(series.times(), series.prices(), t)
    }

    fn from_changes(times: &[Timestamp], prices: &[f64], t: Timestamp) -> Option<MarketState> {
        let i = times.partition_point(|&x| x <= t).checked_sub(1)?;
        let prev = i.checked_sub(1)?;
        let age = t.millis() - times[i].millis();
        Some(MarketState {
            rose: prices[i] > prices[prev],
            age_bucket: AGE_BUCKETS_MS.partition_point(|&b| b <= age),
        })
    }

    fn class(self) -> usize {
        usize::from(self.rose) * (AGE_BUCKETS_MS.len() + 1) + self.age_bucket
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

/// Outcomes of a sorted set of start times, as prefix sums per grid delta.
///
/// Laid out by position then delta (`sums[k * grid + g]`), so that a query touches two short
/// runs of memory rather than two entries in each of `2 × grid` arrays.
#[derive(Debug, Default)]
struct Samples {
    /// Start times, ms, ascending.
    times: Vec<i64>,
    grid: usize,
    /// `sums[k * grid + g]`: over the first `k` samples, for grid delta `g`, the number evicted
    /// within the horizon and Σ min(time to eviction, H) in whole seconds (saturating; a class
    /// would need over a million samples in one look-back window to saturate).
    sums: Vec<[u32; 2]>,
}

impl Samples {
    fn new(grid: usize) -> Self {
        Samples {
            times: Vec::new(),
            grid,
            sums: vec![[0, 0]; grid],
        }
    }

    fn push(&mut self, t: i64, outcomes: &[(u32, u64)]) {
        self.times.push(t);
        let base = self.sums.len() - self.grid;
        for (g, &(ev, secs)) in outcomes.iter().enumerate() {
            let [e, s] = self.sums[base + g];
            let secs = u32::try_from(secs).unwrap_or(u32::MAX);
            self.sums.push([e + ev, s.saturating_add(secs)]);
        }
    }

    /// (evicted, survived seconds) over samples `lo..hi` for grid delta `g`.
    fn between(&self, lo: usize, hi: usize, g: usize) -> (u32, u32) {
        let [e1, s1] = self.sums[hi * self.grid + g];
        let [e0, s0] = self.sums[lo * self.grid + g];
        (e1 - e0, s1 - s0)
    }

    /// Samples with `from ≤ t ≤ to`, as a range of indices.
    fn range(&self, from: i64, to: i64) -> (usize, usize) {
        let lo = self.times.partition_point(|&t| t < from);
        let hi = self.times.partition_point(|&t| t <= to);
        (lo, hi.max(lo))
    }
}

/// Precomputed outcomes of one market's start times.
#[derive(Debug)]
struct MarketIndex {
    /// On-demand price, USD/h: the unit of the delta grid.
    on_demand: f64,
    grid: Samples,
    classes: Vec<Samples>,
    /// The series' changes, kept here so that finding the state at a decision time does not
    /// look the market up in the history again (a hot path: every candidate of every decision).
    times: Vec<Timestamp>,
    prices: Vec<f64>,
}

/// The start times a query averages: a set, and the index range inside it.
struct Window<'a> {
    samples: &'a Samples,
    lo: usize,
    hi: usize,
    h_ms: i64,
    on_demand: f64,
}

impl Window<'_> {
    fn count(&self) -> u32 {
        (self.hi - self.lo) as u32
    }
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

    fn series(&self, market: &Market) -> Result<&PriceSeries, ModelError> {
        self.history
            .get(market)
            .ok_or_else(|| ModelError::UnknownMarket(market.to_string()))
    }

    fn build(&self, market: &Market) -> Result<MarketIndex, ModelError> {
        let series = self.series(market)?;
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
            .map_or(Timestamp::from_millis(0), |(_, last)| {
                Timestamp::from_millis(last.millis() + lookback_ms)
            });
        Ok(build_index(series, on_demand, &self.config, until))
    }

    /// The start times that answer a query at `now` for `horizon_secs`.
    fn window(
        &self,
        market: &Market,
        horizon_secs: f64,
        now: Timestamp,
    ) -> Result<Window<'_>, ModelError> {
        if !(horizon_secs.is_finite() && horizon_secs > 0.0) {
            return Err(ModelError::BadHorizon(horizon_secs));
        }
        let idx = self.index(market)?;
        let h_ms = (horizon_secs * 1000.0).round() as i64;
        let lookback_ms = (self.config.lookback_secs * 1000.0) as i64;
        let (from, to) = (now.millis() - lookback_ms, now.millis() - h_ms);
        let needed = self.config.min_samples.max(1);
        let state = if self.config.match_state {
            MarketState::from_changes(&idx.times, &idx.prices, now)
        } else {
            None
        };
        if let Some(state) = state {
            let samples = &idx.classes[state.class()];
            let (lo, hi) = samples.range(from, to);
            if (hi - lo) as u32 >= needed {
                return Ok(Window {
                    samples,
                    lo,
                    hi,
                    h_ms,
                    on_demand: idx.on_demand,
                });
            }
        }
        let (lo, hi) = idx.grid.range(from, to);
        let w = Window {
            samples: &idx.grid,
            lo,
            hi,
            h_ms,
            on_demand: idx.on_demand,
        };
        if w.count() < needed {
            return Err(ModelError::NotEnoughHistory {
                market: market.to_string(),
                now,
                samples: w.count(),
                needed,
            });
        }
        Ok(w)
    }

    fn at_delta(
        &self,
        market: &Market,
        w: &Window<'_>,
        bid_delta_usd: f64,
    ) -> Result<EvictionEstimate, ModelError> {
        let horizon_secs = w.h_ms as f64 / 1000.0;
        let samples = w.count();
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
        if w.h_ms != fast_horizon_ms {
            return self.replay_window(market, w, bid_delta_usd);
        }
        let frac = bid_delta_usd / w.on_demand;
        let grid = &self.config.delta_grid;
        let s = w.samples;
        let at = |g: usize| {
            let (ev, secs) = s.between(w.lo, w.hi, g);
            (
                f64::from(ev) / f64::from(samples),
                f64::from(secs) / f64::from(samples),
            )
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

    /// The slow path: replays the window's start times with any horizon and delta.
    fn replay_window(
        &self,
        market: &Market,
        w: &Window<'_>,
        delta_usd: f64,
    ) -> Result<EvictionEstimate, ModelError> {
        let series = self.series(market)?;
        let (mut evicted, mut survived_ms) = (0u64, 0i64);
        for &s in &w.samples.times[w.lo..w.hi] {
            match replay_once(series, Timestamp::from_millis(s), delta_usd, w.h_ms) {
                None => {}
                Some(Some(after)) => {
                    evicted += 1;
                    survived_ms += after;
                }
                Some(None) => survived_ms += w.h_ms,
            }
        }
        let n = f64::from(w.count().max(1));
        Ok(EvictionEstimate {
            probability: evicted as f64 / n,
            expected_secs: survived_ms as f64 / 1000.0 / n,
            horizon_secs: w.h_ms as f64 / 1000.0,
            samples: w.count(),
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
        let w = self.window(market, horizon_secs, now)?;
        self.at_delta(market, &w, bid_delta_usd)
    }

    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        now: Timestamp,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        let w = self.window(market, horizon_secs, now)?;
        for &d in bid_deltas_usd {
            out.push(self.at_delta(market, &w, d)?);
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
            .first_above(
                start,
                p0.get() + delta_usd,
                Timestamp::from_millis(start.millis() + horizon_ms),
            )
            .map(|t| t.millis() - start.millis()),
    )
}

/// The state-matched start times of a series: for every change with a predecessor, start times
/// at the bucket ages while the price holds, with the class they belong to.
pub fn state_start_times(series: &PriceSeries, until: Timestamp) -> Vec<(Timestamp, usize)> {
    let (times, prices) = (series.times(), series.prices());
    let mut out = Vec::with_capacity(times.len() * 3);
    for i in 1..times.len() {
        let next = times.get(i + 1).map_or(until.millis(), |t| t.millis());
        let rose = prices[i] > prices[i - 1];
        let mut push = |age: i64, bucket: usize| {
            if times[i].millis() + age < next {
                let class = MarketState {
                    rose,
                    age_bucket: bucket,
                }
                .class();
                out.push((Timestamp::from_millis(times[i].millis() + age), class));
            }
        };
        for (b, &age) in AGE_REPRESENTATIVES_MS.iter().enumerate() {
            push(age, b);
        }
        for k in 1..=OPEN_BUCKET_MAX {
            push(k * OPEN_BUCKET_STEP_MS, AGE_BUCKETS_MS.len());
        }
    }
    out
}

fn ceil_div(a: i64, b: i64) -> i64 {
    a.div_euclid(b) + i64::from(a.rem_euclid(b) != 0)
}

/// Outcomes of a start time for every grid delta (ascending, in USD), into `out`.
fn outcomes(
    series: &PriceSeries,
    i: usize,
    s: i64,
    h_ms: i64,
    grid_usd: &[f64],
    breaks: &mut Vec<(f64, i64)>,
    out: &mut Vec<(u32, u64)>,
) {
    let (times, prices) = (series.times(), series.prices());
    // Running-maximum breakpoints of the price after `s`: (excess over p0, ms after s).
    breaks.clear();
    let p0 = prices[i];
    let mut max = p0;
    let mut j = i + 1;
    while j < times.len() && times[j].millis() <= s + h_ms {
        if prices[j] > max {
            max = prices[j];
            breaks.push((max - p0, times[j].millis() - s));
        }
        j += 1;
    }
    // Grid ascending, breakpoints ascending in excess: one pointer walks both.
    out.clear();
    let mut b = 0usize;
    for &d in grid_usd {
        while b < breaks.len() && breaks[b].0 <= d {
            b += 1;
        }
        out.push(match breaks.get(b) {
            Some(&(_, after)) => (1, (after / 1000) as u64),
            None => (0, (h_ms / 1000) as u64),
        });
    }
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
    let mut index = MarketIndex {
        on_demand,
        grid: Samples::new(grid_usd.len()),
        classes: (0..CLASSES).map(|_| Samples::new(grid_usd.len())).collect(),
        times: series.times().to_vec(),
        prices: series.prices().to_vec(),
    };
    let times = series.times();
    let Some(first) = series.first_time() else {
        return index;
    };
    let (mut breaks, mut out) = (Vec::with_capacity(64), Vec::with_capacity(grid_usd.len()));
    // The unconditional grid: multiples of the step from the first change to `until`.
    let mut s = ceil_div(first.millis(), step_ms) * step_ms;
    let mut i = 0usize; // the change in force at s
    while s <= until.millis() {
        while i + 1 < times.len() && times[i + 1].millis() <= s {
            i += 1;
        }
        outcomes(series, i, s, h_ms, &grid_usd, &mut breaks, &mut out);
        index.grid.push(s, &out);
        s += step_ms;
    }
    if config.match_state {
        let mut i = 0usize;
        for (t, class) in state_start_times(series, until) {
            while i + 1 < times.len() && times[i + 1] <= t {
                i += 1;
            }
            outcomes(
                series,
                i,
                t.millis(),
                h_ms,
                &grid_usd,
                &mut breaks,
                &mut out,
            );
            index.classes[class].push(t.millis(), &out);
        }
    }
    index
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
                .map(|&(m, p)| (Timestamp::from_millis(m * M), UsdPerHour::new(p).unwrap()))
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
            match_state: false,
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
            let in_window = s >= now_min - lookback_min && s + horizon_min <= now_min;
            if let Some(p0) = price_at(s as f64).filter(|_| in_window) {
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
                    .eviction(&market, delta, 3600.0, Timestamp::from_millis(now * M))
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
        let now = Timestamp::from_millis(600 * M);
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
                .eviction(&market, delta, 3600.0, Timestamp::from_millis(now * M))
                .unwrap();
            let b = model2
                .eviction(&market, delta, 3600.0, Timestamp::from_millis(now * M))
                .unwrap();
            assert_eq!(a, b, "delta {delta}");
        }
    }

    #[test]
    fn state_matched_estimates_equal_a_brute_force_replay_of_same_state_start_times() {
        let points = trace();
        let (h, market) = history(&points);
        let config = PriceModelConfig {
            match_state: true,
            min_samples: 2,
            ..small_config()
        };
        let model = PriceDrivenModel::new(h.clone(), config);
        let series = h.get(&market).unwrap();
        let mut checked = 0;
        for now_min in [200, 265, 300, 333, 404, 480, 523, 560] {
            let now = Timestamp::from_millis(now_min * M);
            let state = MarketState::at(series, now).unwrap();
            // Brute force: every change with a predecessor, at each age, if the state is the same
            // as now's and the price still holds; then the window rule.
            let mut starts = Vec::new();
            for k in 1..points.len() {
                let next = points.get(k + 1).map_or(i64::MAX, |p| p.0 * M);
                for age_min in [
                    1.0, 3.5, 7.5, 15.0, 30.0, 45.0, 60.0, 75.0, 90.0, 105.0, 120.0,
                ] {
                    let s = points[k].0 * M + (age_min * 60_000.0) as i64;
                    if s >= next {
                        continue;
                    }
                    let st = MarketState::at(series, Timestamp::from_millis(s)).unwrap();
                    if st == state && s >= now.millis() - 360 * M && s + 60 * M <= now.millis() {
                        starts.push(s);
                    }
                }
            }
            if starts.len() < 2 {
                continue;
            }
            checked += 1;
            for delta in [0.0, 0.05, 0.3] {
                let (mut ev, mut secs) = (0.0, 0.0);
                for &s in &starts {
                    match replay_once(series, Timestamp::from_millis(s), delta, 60 * M).unwrap() {
                        Some(ms) => {
                            ev += 1.0;
                            secs += (ms / 1000) as f64;
                        }
                        None => secs += 3600.0,
                    }
                }
                let n = starts.len() as f64;
                let e = model.eviction(&market, delta, 3600.0, now).unwrap();
                assert_eq!(
                    e.samples as usize,
                    starts.len(),
                    "now {now_min} state {state:?}"
                );
                assert!(
                    (e.probability - ev / n).abs() < 1e-12,
                    "now {now_min} delta {delta}"
                );
                assert!(
                    (e.expected_secs - secs / n).abs() < 1e-9,
                    "now {now_min} delta {delta}"
                );
            }
        }
        assert!(
            checked >= 3,
            "only {checked} decision times had state-matched samples"
        );
    }

    #[test]
    fn state_is_direction_and_age_of_the_last_change() {
        let (h, market) = history(&trace());
        let s = h.get(&market).unwrap();
        assert_eq!(
            MarketState::at(s, Timestamp::from_millis(5 * M)),
            None,
            "one change: no direction yet"
        );
        assert_eq!(
            MarketState::at(s, Timestamp::from_millis(18 * M)),
            Some(MarketState {
                rose: true,
                age_bucket: 0
            })
        );
        assert_eq!(
            MarketState::at(s, Timestamp::from_millis(41 * M + 4 * 60_000)),
            Some(MarketState {
                rose: false,
                age_bucket: 1
            })
        );
        assert_eq!(
            MarketState::at(s, Timestamp::from_millis(100 * M)),
            Some(MarketState {
                rose: false,
                age_bucket: 3
            })
        );
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
            .eviction(&market, 0.0, 3600.0, Timestamp::from_millis(90 * M))
            .unwrap_err();
        assert!(
            matches!(err, ModelError::NotEnoughHistory { samples: 4, .. }),
            "{err}"
        );
        let other = Market::parse("us-east-1b/c3.xlarge").unwrap();
        assert!(matches!(
            model.eviction(&other, 0.0, 3600.0, Timestamp::from_millis(600 * M)),
            Err(ModelError::UnknownMarket(_))
        ));
    }
}
