//! Price history in memory: what the statistics, the market model and the simulator read.
//!
//! A series is a step function: each point is a price change, and the price holds until the
//! next point. Everything that asks "what did it cost at time t" goes through [`PriceSeries::price_at`]
//! so that the step semantics live in one place.

use crate::market::{InstanceType, Market, Region, Timestamp, UsdPerHour};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// The price changes of one market, sorted by time, one per timestamp.
#[derive(Debug, Clone)]
pub struct PriceSeries {
    market: Market,
    times: Vec<Timestamp>,
    prices: Vec<f64>,
}

impl PriceSeries {
    /// Builds a series from changes in any order; for duplicate timestamps the first one wins,
    /// as in the store (where a second ingest of the same instant is "already present").
    pub fn new(market: Market, mut points: Vec<(Timestamp, UsdPerHour)>) -> Self {
        points.sort_by_key(|(t, _)| *t);
        points.dedup_by_key(|(t, _)| *t);
        let (times, prices) = points.into_iter().map(|(t, p)| (t, p.get())).unzip();
        PriceSeries {
            market,
            times,
            prices,
        }
    }

    pub fn market(&self) -> &Market {
        &self.market
    }
    pub fn len(&self) -> usize {
        self.times.len()
    }
    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }
    pub fn times(&self) -> &[Timestamp] {
        &self.times
    }
    pub fn prices(&self) -> &[f64] {
        &self.prices
    }
    pub fn first_time(&self) -> Option<Timestamp> {
        self.times.first().copied()
    }
    pub fn last_time(&self) -> Option<Timestamp> {
        self.times.last().copied()
    }

    /// Index of the change in force at `t`: the last one at or before `t`.
    pub fn index_at(&self, t: Timestamp) -> Option<usize> {
        let after = self.times.partition_point(|&x| x <= t);
        after.checked_sub(1)
    }

    /// The price in force at `t`, or `None` before the first recorded change.
    pub fn price_at(&self, t: Timestamp) -> Option<UsdPerHour> {
        self.index_at(t)
            .map(|i| UsdPerHour::validated(self.prices[i]))
    }

    /// The first time in `(after, until]` at which the price is strictly above `limit`, or `None`.
    ///
    /// This is the eviction rule of the 2015 market: a spot instance runs while its bid is at
    /// least the price and is reclaimed at the first change that crosses the bid.
    pub fn first_above(&self, after: Timestamp, limit: f64, until: Timestamp) -> Option<Timestamp> {
        let start = self.times.partition_point(|&x| x <= after);
        self.times[start..]
            .iter()
            .zip(&self.prices[start..])
            .take_while(|(t, _)| **t <= until)
            .find(|(_, p)| **p > limit)
            .map(|(t, _)| *t)
    }

    /// The changes whose time lies in `[from, to)`.
    pub fn window(&self, from: Timestamp, to: Timestamp) -> (&[Timestamp], &[f64]) {
        let a = self.times.partition_point(|&x| x < from);
        let b = self.times.partition_point(|&x| x < to);
        (&self.times[a..b], &self.prices[a..b])
    }

    /// The time-weighted mean price over `[from, to]`, from the first known price on (`None`
    /// if none is known by `to`); for an empty window, the price in force at `to`. What a
    /// policy reads as a market's mean and what `prices stats` reports.
    pub fn time_weighted_mean(&self, from: Timestamp, to: Timestamp) -> Option<UsdPerHour> {
        if to <= from {
            return self.price_at(to);
        }
        let mut i = match self.index_at(from) {
            Some(i) => i,
            None => {
                if self.first_time()? > to {
                    return None;
                }
                0
            }
        };
        let start = from.max(self.times[i]);
        let (mut integral, mut t) = (0.0, start);
        while i < self.times.len() && self.times[i] <= to {
            let until = self.times.get(i + 1).copied().unwrap_or(to).min(to);
            integral += self.prices[i] * (until.millis() - t.millis()) as f64;
            t = until;
            i += 1;
        }
        let span = (to.millis() - start.millis()) as f64;
        if span <= 0.0 {
            self.price_at(to)
        } else {
            // A mean of prices is a price.
            Some(UsdPerHour::validated(integral / span))
        }
    }
}

/// What a type is and what it costs on-demand in a region.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceOffer {
    pub region: Region,
    pub instance_type: InstanceType,
    pub vcpus: Option<u32>,
    pub memory_gib: Option<f64>,
    pub on_demand: UsdPerHour,
}

/// On-demand prices by region and instance type.
#[derive(Debug, Clone, Default)]
pub struct OnDemandCatalog {
    offers: HashMap<(Region, InstanceType), InstanceOffer>,
}

impl OnDemandCatalog {
    pub fn new(offers: impl IntoIterator<Item = InstanceOffer>) -> Self {
        OnDemandCatalog {
            offers: offers
                .into_iter()
                .map(|o| ((o.region.clone(), o.instance_type.clone()), o))
                .collect(),
        }
    }

    pub fn get(&self, region: &Region, instance_type: &InstanceType) -> Option<&InstanceOffer> {
        self.offers.get(&(region.clone(), instance_type.clone()))
    }

    /// The on-demand price of the type a spot market sells, in the market's region.
    pub fn for_market(&self, market: &Market) -> Option<&InstanceOffer> {
        self.get(&market.region(), &market.instance_type)
    }

    pub fn offers(&self) -> impl Iterator<Item = &InstanceOffer> {
        self.offers.values()
    }

    pub fn is_empty(&self) -> bool {
        self.offers.is_empty()
    }
}

/// Every series of a trace plus the on-demand prices they are compared against.
#[derive(Debug, Clone, Default)]
pub struct PriceHistory {
    series: BTreeMap<Market, PriceSeries>,
    on_demand: OnDemandCatalog,
}

impl PriceHistory {
    pub fn new(series: impl IntoIterator<Item = PriceSeries>, on_demand: OnDemandCatalog) -> Self {
        PriceHistory {
            series: series
                .into_iter()
                .filter(|s| !s.is_empty())
                .map(|s| (s.market.clone(), s))
                .collect(),
            on_demand,
        }
    }

    pub fn series(&self) -> impl Iterator<Item = &PriceSeries> {
        self.series.values()
    }
    pub fn get(&self, market: &Market) -> Option<&PriceSeries> {
        self.series.get(market)
    }
    pub fn markets(&self) -> impl Iterator<Item = &Market> {
        self.series.keys()
    }
    pub fn on_demand(&self) -> &OnDemandCatalog {
        &self.on_demand
    }
    pub fn is_empty(&self) -> bool {
        self.series.is_empty()
    }
    pub fn row_count(&self) -> usize {
        self.series.values().map(PriceSeries::len).sum()
    }

    /// The span the trace observes: from its first change to its last change in any market.
    /// Beyond the last change nothing is known, so analyses stop there.
    pub fn span(&self) -> Option<(Timestamp, Timestamp)> {
        let first = self.series.values().filter_map(|s| s.first_time()).min()?;
        let last = self.series.values().filter_map(|s| s.last_time()).max()?;
        Some((first, last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(points: &[(i64, f64)]) -> PriceSeries {
        PriceSeries::new(
            Market::parse("us-east-1a/c3.xlarge").unwrap(),
            points
                .iter()
                .map(|&(t, p)| (Timestamp::from_millis(t), UsdPerHour::new(p).unwrap()))
                .collect(),
        )
    }

    #[test]
    fn mean_is_time_weighted_and_starts_at_the_first_price() {
        let s = series(&[(10, 1.0), (20, 3.0)]);
        let mean = |from, to| {
            s.time_weighted_mean(Timestamp::from_millis(from), Timestamp::from_millis(to))
                .map(UsdPerHour::get)
        };
        assert_eq!(mean(10, 30), Some(2.0));
        assert_eq!(mean(0, 30), Some(2.0), "from the first known price");
        assert_eq!(mean(15, 20), Some(1.0));
        assert_eq!(mean(0, 5), None, "nothing known yet");
        assert_eq!(
            mean(25, 25),
            Some(3.0),
            "an empty window: the price at its end"
        );
    }

    #[test]
    fn price_holds_until_the_next_change() {
        let s = series(&[(30, 3.0), (10, 1.0), (20, 2.0), (20, 9.0)]);
        assert_eq!(s.len(), 3, "duplicate timestamp kept once");
        assert_eq!(s.price_at(Timestamp::from_millis(5)), None);
        assert_eq!(
            s.price_at(Timestamp::from_millis(10)).map(UsdPerHour::get),
            Some(1.0)
        );
        assert_eq!(
            s.price_at(Timestamp::from_millis(19)).map(UsdPerHour::get),
            Some(1.0)
        );
        assert_eq!(
            s.price_at(Timestamp::from_millis(20)).map(UsdPerHour::get),
            Some(2.0)
        );
        assert_eq!(
            s.price_at(Timestamp::from_millis(1000))
                .map(UsdPerHour::get),
            Some(3.0)
        );
    }

    #[test]
    fn first_above_looks_strictly_after_and_up_to_until() {
        let s = series(&[(10, 1.0), (20, 5.0), (30, 1.0), (40, 6.0)]);
        assert_eq!(
            s.first_above(Timestamp::from_millis(10), 2.0, Timestamp::from_millis(100)),
            Some(Timestamp::from_millis(20))
        );
        assert_eq!(
            s.first_above(Timestamp::from_millis(20), 2.0, Timestamp::from_millis(100)),
            Some(Timestamp::from_millis(40))
        );
        assert_eq!(
            s.first_above(Timestamp::from_millis(20), 2.0, Timestamp::from_millis(39)),
            None
        );
        assert_eq!(
            s.first_above(Timestamp::from_millis(0), 5.0, Timestamp::from_millis(100)),
            Some(Timestamp::from_millis(40))
        );
    }
}
