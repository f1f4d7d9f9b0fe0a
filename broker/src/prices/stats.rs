//! Per-market statistics of a price history: how often and how far prices move, and how much of
//! the time spot was dearer than on-demand (the spells when bidding the on-demand price fails).

use crate::market::{Market, Timestamp, UsdPerHour};
use crate::prices::history::PriceSeries;
use serde::Serialize;

/// Statistics of one market over a window.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MarketStats {
    pub market: String,
    /// Price changes whose time lies in the window.
    pub changes: usize,
    pub first: Option<Timestamp>,
    pub last: Option<Timestamp>,
    /// Over the prices in force during the window (the one carried in at its start, if any,
    /// and every change inside it), each counted once.
    pub min_usd: UsdPerHour,
    pub median_usd: UsdPerHour,
    pub max_usd: UsdPerHour,
    /// The step function's integral over the window divided by its length.
    pub time_weighted_mean_usd: UsdPerHour,
    pub on_demand_usd: Option<UsdPerHour>,
    /// Share of the window's time with the spot price strictly above on-demand.
    pub fraction_above_on_demand: Option<f64>,
    /// Maximal intervals with the spot price strictly above on-demand.
    pub spells_above_on_demand: Option<usize>,
    /// Hours covered: from the first known price in the window to its end.
    pub hours: f64,
}

/// Computes statistics for `series` over `[from, to)`. The price carried into the window is the
/// last change before `from`; the window's effective start is `from` or, if the series starts
/// later, its first change. Returns `None` when no price is known inside the window.
pub fn market_stats(
    series: &PriceSeries,
    from: Timestamp,
    to: Timestamp,
    on_demand: Option<UsdPerHour>,
) -> Option<MarketStats> {
    let on_demand_usd = on_demand;
    let on_demand = on_demand.map(UsdPerHour::get);
    if to <= from {
        return None;
    }
    let (times, prices) = series.window(from, to);
    let carried = series
        .index_at(from)
        .filter(|&i| series.times()[i] < from)
        .map(|i| series.prices()[i]);
    let start = if carried.is_some() {
        from
    } else {
        *times.first()?
    };

    let mut steps: Vec<(Timestamp, f64)> = Vec::with_capacity(times.len() + 1);
    if let Some(p) = carried {
        steps.push((from, p));
    }
    steps.extend(times.iter().copied().zip(prices.iter().copied()));

    let mut values: Vec<f64> = steps.iter().map(|(_, p)| *p).collect();
    values.sort_by(f64::total_cmp);
    let median = if values.len() % 2 == 1 {
        values[values.len() / 2]
    } else {
        (values[values.len() / 2 - 1] + values[values.len() / 2]) / 2.0
    };

    let total_ms = (to.millis() - start.millis()) as f64;
    let mut above_ms = 0.0;
    let mut spells = 0;
    let mut was_above = false;
    for (i, &(t, p)) in steps.iter().enumerate() {
        let until = steps.get(i + 1).map_or(to, |s| s.0);
        let held = (until.millis() - t.millis()) as f64;
        let above = on_demand.is_some_and(|od| p > od);
        if above {
            above_ms += held;
            if !was_above {
                spells += 1;
            }
        }
        was_above = above;
    }

    Some(MarketStats {
        market: series.market().to_string(),
        changes: times.len(),
        first: times.first().copied(),
        last: times.last().copied(),
        // Minima, medians and means of a series' prices are prices.
        min_usd: UsdPerHour::validated(values[0]),
        median_usd: UsdPerHour::validated(median),
        max_usd: UsdPerHour::validated(values[values.len() - 1]),
        time_weighted_mean_usd: series.time_weighted_mean(start, to)?,
        on_demand_usd,
        fraction_above_on_demand: on_demand.map(|_| {
            if total_ms > 0.0 {
                above_ms / total_ms
            } else {
                0.0
            }
        }),
        spells_above_on_demand: on_demand.map(|_| spells),
        hours: total_ms / 3_600_000.0,
    })
}

/// The label used in tables for a market.
pub fn market_label(market: &Market) -> String {
    market.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::UsdPerHour;

    fn series(points: &[(i64, f64)]) -> PriceSeries {
        PriceSeries::new(
            Market::parse("us-east-1a/c3.xlarge").unwrap(),
            points
                .iter()
                .map(|&(t, p)| {
                    (
                        Timestamp::from_millis(t * 1000),
                        UsdPerHour::new(p).unwrap(),
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn hand_computed_window() {
        // price 1 for 10 s, 3 for 20 s, 1 for 10 s, 5 for 10 s, window [0 s, 50 s)
        let s = series(&[(0, 1.0), (10, 3.0), (30, 1.0), (40, 5.0)]);
        let st = market_stats(
            &s,
            Timestamp::from_millis(0),
            Timestamp::from_millis(50_000),
            Some(UsdPerHour::new(2.0).unwrap()),
        )
        .unwrap();
        assert_eq!(st.changes, 4);
        assert!(
            (st.time_weighted_mean_usd.get() - (10.0 + 60.0 + 10.0 + 50.0) / 50.0).abs() < 1e-12
        );
        assert!((st.fraction_above_on_demand.unwrap() - 30.0 / 50.0).abs() < 1e-12);
        assert_eq!(st.spells_above_on_demand, Some(2));
        assert_eq!(
            (st.min_usd.get(), st.median_usd.get(), st.max_usd.get()),
            (1.0, 2.0, 5.0)
        );
    }

    #[test]
    fn carried_in_price_counts_from_the_window_start() {
        let s = series(&[(0, 4.0), (100, 2.0)]);
        let st = market_stats(
            &s,
            Timestamp::from_millis(50_000),
            Timestamp::from_millis(150_000),
            None,
        )
        .unwrap();
        assert_eq!(st.changes, 1);
        assert!((st.time_weighted_mean_usd.get() - 3.0).abs() < 1e-12);
        assert_eq!(st.fraction_above_on_demand, None);
        assert!(
            market_stats(
                &s,
                Timestamp::from_millis(-10_000),
                Timestamp::from_millis(-1),
                None
            )
            .is_none()
        );
    }
}
