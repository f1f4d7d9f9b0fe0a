//! The simulated world's side of evictions: when the market really takes an instance away.
//!
//! This is the simulator's ground truth and may look at the whole trace; policies never see it.
//!
//! - Price-driven (2015): an instance is warned at the first price change strictly above its bid
//!   (found in O(log n) with a max segment tree over each series).
//! - Hazard (today): each pool (zone × type) has a true interruption rate; interruptions arrive
//!   as a Poisson process per pool and reclaim a share of the job's instances there. The true
//!   rates are drawn, per pool and per seed, from a mix of AWS Spot Advisor's "frequency of
//!   interruption" buckets ([`HazardTruth`]); the policies' [`crate::market_model::HazardModel`]
//!   does not know them and must learn.
//!   Prices still matter: an instance whose bid falls below the price is also evicted.

use crate::market::{Market, Timestamp};
use crate::prices::PriceSeries;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::HashMap;

/// A max segment tree over one series' prices: the first change after a time above a limit.
#[derive(Debug, Clone)]
pub struct MaxTree {
    size: usize,
    n: usize,
    tree: Vec<f64>,
}

impl MaxTree {
    pub fn new(values: &[f64]) -> Self {
        let n = values.len();
        let size = n.next_power_of_two().max(1);
        let mut tree = vec![f64::NEG_INFINITY; 2 * size];
        tree[size..size + n].copy_from_slice(values);
        for i in (1..size).rev() {
            tree[i] = tree[2 * i].max(tree[2 * i + 1]);
        }
        MaxTree { size, n, tree }
    }

    /// The first index `≥ from` whose value is strictly above `limit`.
    pub fn first_above(&self, from: usize, limit: f64) -> Option<usize> {
        if from >= self.n {
            return None;
        }
        self.descend(1, 0, self.size, from, limit)
    }

    fn descend(&self, node: usize, lo: usize, hi: usize, from: usize, limit: f64) -> Option<usize> {
        if hi <= from || self.tree[node] <= limit {
            return None;
        }
        if hi - lo == 1 {
            return Some(lo);
        }
        let mid = (lo + hi) / 2;
        self.descend(2 * node, lo, mid, from, limit)
            .or_else(|| self.descend(2 * node + 1, mid, hi, from, limit))
    }
}

/// First time in `(after, ∞)` that `series` is strictly above `limit`, via its tree.
pub fn first_above(
    series: &PriceSeries,
    tree: &MaxTree,
    after: Timestamp,
    limit: f64,
) -> Option<Timestamp> {
    let from = series.times().partition_point(|&t| t <= after);
    tree.first_above(from, limit).map(|i| series.times()[i])
}

/// The true interruption behaviour of today's market, for the simulator.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HazardTruth {
    /// Spot Advisor buckets: (share of pools, monthly interruption frequency of the bucket).
    pub buckets: Vec<(f64, f64)>,
    /// Multiplies every rate (stress tests: 10 = a market ten times as hostile).
    pub scale: f64,
    /// Share of the job's instances in a pool that one interruption event reclaims.
    pub bulk_fraction: f64,
}

impl Default for HazardTruth {
    /// The buckets are `<5%`, `5–10%`, `10–15%`, `15–20%` and `>20%` of instances interrupted per
    /// month, at their midpoints (25% for the open bucket), weighted 40/25/15/10/10: an assumed
    /// mix for c5/m5/r5 in us-east-1, not a measurement. One event reclaims every instance of
    /// the job in the pool (capacity is reclaimed in bulk).
    fn default() -> Self {
        HazardTruth {
            buckets: vec![
                (0.40, 0.025),
                (0.25, 0.075),
                (0.15, 0.125),
                (0.10, 0.175),
                (0.10, 0.25),
            ],
            scale: 1.0,
            bulk_fraction: 1.0,
        }
    }
}

impl HazardTruth {
    /// The pool's true interruption events per hour (an event reclaims `bulk_fraction` of the
    /// job's instances there, so the per-instance hazard is this times `bulk_fraction`).
    pub fn pool_rate_per_hour(&self, market: &Market, seed: u64) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ stable_hash(&market.to_string()) ^ 0x9e37_79b9_7f4a_7c15,
        );
        let total: f64 = self.buckets.iter().map(|(w, _)| w.max(0.0)).sum();
        let mut pick = rng.random::<f64>() * total;
        let mut monthly = self.buckets.last().map_or(0.0, |b| b.1);
        for &(w, f) in &self.buckets {
            if pick < w {
                monthly = f;
                break;
            }
            pick -= w;
        }
        let per_instance = -(1.0 - monthly.clamp(0.0, 0.999_999)).ln() / 730.0;
        per_instance * self.scale / self.bulk_fraction.clamp(1e-9, 1.0)
    }
}

/// Interruption events of every pool for one run, generated lazily and deterministically.
#[derive(Debug)]
pub struct HazardWorld {
    truth: HazardTruth,
    seed: u64,
    /// Every pool's process starts here (the run's start), so that every policy simulated from
    /// the same start time meets the same interruptions.
    origin: Timestamp,
    pools: HashMap<Market, Pool>,
}

#[derive(Debug)]
struct Pool {
    rate_per_ms: f64,
    rng: ChaCha8Rng,
    events: Vec<Timestamp>,
}

impl HazardWorld {
    pub fn new(truth: HazardTruth, seed: u64, origin: Timestamp) -> Self {
        HazardWorld {
            truth,
            seed,
            origin,
            pools: HashMap::new(),
        }
    }

    /// When an instance launched in `market` at `launch` is interrupted: the first pool event
    /// after launch that picks it (`instance_draw` decides, per event, whether it is among the
    /// reclaimed share), or `None` before `until`.
    pub fn interruption(
        &mut self,
        market: &Market,
        launch: Timestamp,
        until: Timestamp,
        instance_rng: &mut ChaCha8Rng,
    ) -> Option<Timestamp> {
        let seed = self.seed;
        let origin = self.origin;
        let truth = &self.truth;
        let pool = self.pools.entry(market.clone()).or_insert_with(|| {
            let rate = truth.pool_rate_per_hour(market, seed) / 3_600_000.0;
            Pool {
                rate_per_ms: rate,
                rng: ChaCha8Rng::seed_from_u64(seed ^ stable_hash(&market.to_string())),
                events: Vec::new(),
            }
        });
        if pool.rate_per_ms <= 0.0 {
            return None;
        }
        let mut i = pool.events.partition_point(|&t| t <= launch);
        loop {
            while i >= pool.events.len() {
                let last = pool.events.last().copied().unwrap_or(origin);
                if last > until {
                    return None;
                }
                let u: f64 = pool.rng.random::<f64>();
                let gap = -(1.0 - u).ln() / pool.rate_per_ms;
                pool.events.push(Timestamp::from_millis(
                    last.millis() + gap.ceil().max(1.0) as i64,
                ));
            }
            let t = pool.events[i];
            if t > until {
                return None;
            }
            if self.truth.bulk_fraction >= 1.0
                || instance_rng.random::<f64>() < self.truth.bulk_fraction
            {
                return Some(t);
            }
            i += 1;
        }
    }
}

/// FNV-1a: a hash that is the same on every run and platform (std's is randomised).
pub fn stable_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::UsdPerHour;

    #[test]
    fn tree_matches_a_scan() {
        let values: Vec<f64> = (0..37).map(|i| ((i * 7919) % 23) as f64).collect();
        let tree = MaxTree::new(&values);
        for from in 0..40 {
            for limit in [-1.0, 0.0, 5.0, 15.0, 21.0, 22.0, 30.0] {
                let scan = values
                    .iter()
                    .enumerate()
                    .skip(from)
                    .find(|(_, v)| **v > limit)
                    .map(|(i, _)| i);
                assert_eq!(
                    tree.first_above(from, limit),
                    scan,
                    "from {from} limit {limit}"
                );
            }
        }
        let m = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let s = PriceSeries::new(
            m,
            [(10, 1.0), (20, 5.0), (30, 1.0), (40, 6.0)]
                .iter()
                .map(|&(t, p)| (Timestamp::from_millis(t), UsdPerHour::new(p).unwrap()))
                .collect(),
        );
        let t = MaxTree::new(s.prices());
        for (after, limit) in [(10, 2.0), (20, 2.0), (0, 5.0), (40, 0.0)] {
            assert_eq!(
                first_above(&s, &t, Timestamp::from_millis(after), limit),
                s.first_above(Timestamp::from_millis(after), limit, Timestamp::MAX)
            );
        }
    }

    #[test]
    fn hazard_is_deterministic_and_near_its_rate() {
        let truth = HazardTruth {
            buckets: vec![(1.0, 0.5)],
            scale: 10.0,
            bulk_fraction: 1.0,
        };
        let m = Market::parse("us-east-1a/c5.xlarge").unwrap();
        let rate = truth.pool_rate_per_hour(&m, 1);
        assert!((rate - 10.0 * 2f64.ln() / 730.0).abs() < 1e-12);
        let mut a = HazardWorld::new(truth.clone(), 7, Timestamp::from_millis(0));
        let mut b = HazardWorld::new(truth, 7, Timestamp::from_millis(0));
        let mut r = ChaCha8Rng::seed_from_u64(0);
        let until = Timestamp::from_millis(1_000 * 3_600_000);
        let xs: Vec<_> = (0..50)
            .map(|k| a.interruption(&m, Timestamp::from_millis(k * 3_600_000), until, &mut r))
            .collect();
        let ys: Vec<_> = (0..50)
            .map(|k| b.interruption(&m, Timestamp::from_millis(k * 3_600_000), until, &mut r))
            .collect();
        assert_eq!(xs, ys);
        let events = a.pools[&m].events.len() as f64;
        let expected = rate * 1_000.0;
        assert!(
            (events - expected).abs() < 4.0 * expected.sqrt() + 2.0,
            "{events} vs {expected}"
        );
    }
}
