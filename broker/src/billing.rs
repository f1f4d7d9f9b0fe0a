//! How an instance's life turns into money: the two billing models of AWS, as line items.
//!
//! Both the simulator and the live cost ledger call [`BillingModel::bill`], so a reported cost
//! never depends on which of the two produced it.
//!
//! - [`BillingModel::Hourly2015`]: the spot market of the papers (until October 2017). Every
//!   *started* instance-hour, counted from launch, is billed in full at the price in force at
//!   the start of that hour. If the provider ends the instance (an eviction), the last, partial
//!   hour is free; if the user ends it, the partial hour is charged in full. An hour that ran to
//!   its end is always charged.
//! - [`BillingModel::PerSecond`]: today's Linux billing. Every second is billed at the price in
//!   force during it, with a minimum of 60 seconds per instance, with one exception: a spot
//!   instance the provider interrupts within its first hour is not charged at all (AWS EC2 User
//!   Guide, "Billing for interrupted Spot Instances": "If Amazon EC2 interrupts your Spot
//!   Instance in the first instance hour, you are not charged"). An instance the user ends, or
//!   one the provider interrupts after its first hour, pays every second it ran.
//!
//! On-demand instances are billed by the same rules with a fixed price ([`PriceSource::Fixed`]);
//! the provider never ends them, so the free partial hour does not arise in practice.

use crate::market::{Timestamp, Usd, UsdPerHour};
use crate::prices::PriceSeries;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// One hour in milliseconds.
pub const HOUR_MS: i64 = 3_600_000;
/// The per-second model's minimum charge per instance, in milliseconds.
pub const PER_SECOND_MINIMUM_MS: i64 = 60_000;
/// Under `per-second`, a spot instance the provider interrupts before it has run this long is
/// not charged (the first instance hour).
pub const FREE_INTERRUPTION_MS: i64 = HOUR_MS;

/// A billing model, named in files and on the command line as `hourly-2015` or `per-second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BillingModel {
    /// Per started hour at the price at the hour's start; the partial hour is free when the
    /// provider ends the instance.
    #[value(name = "hourly-2015")]
    #[serde(rename = "hourly-2015")]
    Hourly2015,
    /// Per second at the price in force, 60 s minimum; free when the provider interrupts the
    /// instance within its first hour.
    PerSecond,
}

impl BillingModel {
    pub const ALL: [BillingModel; 2] = [BillingModel::Hourly2015, BillingModel::PerSecond];

    pub fn as_str(self) -> &'static str {
        match self {
            BillingModel::Hourly2015 => "hourly-2015",
            BillingModel::PerSecond => "per-second",
        }
    }

    /// Whether the provider ending an instance that ran `secs` makes billed time free: the
    /// partial hour under `hourly-2015` (always some time free), the whole life under
    /// `per-second` if that life was under an hour. This is the lever BidBrain pulls: an
    /// allocation likely to be evicted early is cheap in expectation.
    pub fn provider_end_is_free(self, secs: f64) -> bool {
        match self {
            BillingModel::Hourly2015 => true,
            BillingModel::PerSecond => secs < FREE_INTERRUPTION_MS as f64 / 1000.0,
        }
    }

    /// Hours charged for an instance the user runs for `secs` and then ends: every started
    /// hour (at least one) under `hourly-2015`; the seconds, with the 60 s minimum, under
    /// `per-second`. `billed_hours(0.0)` is what a launch commits to before it can be released.
    /// Policies and drivers price plans with this rather than re-deriving the rules.
    pub fn billed_hours(self, secs: f64) -> f64 {
        match self {
            BillingModel::Hourly2015 => (secs / 3600.0).ceil().max(1.0),
            BillingModel::PerSecond => secs.max(PER_SECOND_MINIMUM_MS as f64 / 1000.0) / 3600.0,
        }
    }

    /// What keeping an instance (launched at `launch`, at `usd_per_hour`) running from `now`
    /// for `secs` more adds to its bill: under `hourly-2015` a whole hour if that crosses an
    /// hour boundary, else nothing; under `per-second`, the seconds. What a budget must be
    /// checked against before the next period starts, not after.
    pub fn cost_of_running_on(
        self,
        usd_per_hour: UsdPerHour,
        launch: Timestamp,
        now: Timestamp,
        secs: f64,
    ) -> Usd {
        let ran = now.secs_since(launch).max(0.0);
        usd_per_hour.for_hours(self.billed_hours(ran + secs.max(0.0)) - self.billed_hours(ran))
    }

    /// The end of the billing period that contains `now` for an instance launched at `launch`:
    /// the next hour boundary (counted from launch) under `hourly-2015`; under `per-second`,
    /// `now` itself, or the end of the 60 s minimum if that is later. A user who ends the
    /// instance at or before this time pays for the period anyway, so a policy releases just
    /// before it.
    pub fn period_end(self, launch: Timestamp, now: Timestamp) -> Timestamp {
        match self {
            BillingModel::Hourly2015 => {
                let elapsed = (now.millis() - launch.millis()).max(0);
                Timestamp::from_millis(launch.millis() + (elapsed / HOUR_MS + 1) * HOUR_MS)
            }
            BillingModel::PerSecond => {
                Timestamp::from_millis(now.millis().max(launch.millis() + PER_SECOND_MINIMUM_MS))
            }
        }
    }

    /// The start of the billing period that contains `now` (the last hour boundary under
    /// `hourly-2015`; `now` under `per-second`).
    pub fn period_start(self, launch: Timestamp, now: Timestamp) -> Timestamp {
        match self {
            BillingModel::Hourly2015 => {
                let elapsed = (now.millis() - launch.millis()).max(0);
                Timestamp::from_millis(launch.millis() + (elapsed / HOUR_MS) * HOUR_MS)
            }
            BillingModel::PerSecond => now,
        }
    }

    /// Bills one instance: launched at `launch`, ended at `end` by `ended_by`, priced by `price`.
    /// Returns the line items in time order. An instance that never ran (`end <= launch`) has
    /// none, except under `per-second`, whose 60 s minimum applies to any launched instance
    /// the user ends (`end == launch` still pays a minute); under `per-second` an instance the
    /// provider ends within its first hour gets its segments, each free.
    pub fn bill(
        self,
        launch: Timestamp,
        end: Timestamp,
        ended_by: EndedBy,
        price: PriceSource<'_>,
    ) -> Result<Vec<LineItem>, BillingError> {
        if end < launch {
            return Err(BillingError::EndsBeforeLaunch { launch, end });
        }
        match self {
            BillingModel::Hourly2015 => bill_hourly(launch, end, ended_by, price),
            BillingModel::PerSecond => {
                let mut items = bill_per_second(launch, end, price)?;
                if ended_by == EndedBy::Provider
                    && end.millis() - launch.millis() < FREE_INTERRUPTION_MS
                {
                    for item in &mut items {
                        item.billed_seconds = 0.0;
                        item.amount_usd = Usd::ZERO;
                        item.free = true;
                    }
                }
                Ok(items)
            }
        }
    }
}

impl fmt::Display for BillingModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BillingModel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "hourly-2015" => Ok(BillingModel::Hourly2015),
            "per-second" => Ok(BillingModel::PerSecond),
            other => Err(format!(
                "unknown billing model `{other}` (allowed: hourly-2015, per-second)"
            )),
        }
    }
}

/// Who ended an instance. Under `hourly-2015` only the provider's ending makes the partial
/// hour free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndedBy {
    /// The cloud reclaimed the instance (a spot eviction or interruption).
    Provider,
    /// The user (or the broker on the user's behalf) terminated it.
    User,
}

/// Where the price of an instance comes from.
#[derive(Debug, Clone, Copy)]
pub enum PriceSource<'a> {
    /// A price that never changes: on-demand.
    Fixed(UsdPerHour),
    /// The spot price of the instance's market, a step function of time.
    Spot(&'a PriceSeries),
}

impl PriceSource<'_> {
    fn at(&self, t: Timestamp) -> Result<UsdPerHour, BillingError> {
        match self {
            PriceSource::Fixed(p) => Ok(*p),
            PriceSource::Spot(series) => series.price_at(t).ok_or_else(|| BillingError::NoPrice {
                market: series.market().to_string(),
                at: t,
            }),
        }
    }
}

/// One billed segment of an instance's life.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LineItem {
    /// When the segment starts (an hour boundary counted from launch, or a price change).
    pub start: Timestamp,
    /// When the instance's use of the segment ends (the hour's end, a price change or the
    /// instance's end). Under `hourly-2015` a partial last hour ends before `start + 1h`.
    pub end: Timestamp,
    /// The price the segment is billed at, USD per instance-hour.
    pub price_usd_per_hour: UsdPerHour,
    /// Seconds charged: 3600 for every charged hour of `hourly-2015` (even a partial one), the
    /// segment's length under `per-second` (topped up to the 60 s minimum), 0 when free.
    pub billed_seconds: f64,
    /// `price × billed_seconds / 3600`, never negative.
    pub amount_usd: Usd,
    /// Not charged: the provider ended the instance inside this hour (`hourly-2015`) or within
    /// its first hour (`per-second`).
    pub free: bool,
}

impl LineItem {
    /// The instance-hours the segment covers (what the instance actually ran).
    pub fn used_hours(&self) -> f64 {
        self.end.secs_since(self.start) / 3600.0
    }
}

/// Why an instance could not be billed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum BillingError {
    #[error("no spot price is known for {market} at {at} (the trace starts later)")]
    NoPrice { market: String, at: Timestamp },
    #[error("an instance cannot end ({end}) before it was launched ({launch})")]
    EndsBeforeLaunch { launch: Timestamp, end: Timestamp },
}

/// Sums the amounts of line items.
pub fn total_usd(items: &[LineItem]) -> Usd {
    items.iter().map(|i| i.amount_usd).sum()
}

fn bill_hourly(
    launch: Timestamp,
    end: Timestamp,
    ended_by: EndedBy,
    price: PriceSource<'_>,
) -> Result<Vec<LineItem>, BillingError> {
    let mut items = Vec::with_capacity(((end.millis() - launch.millis()) / HOUR_MS + 1) as usize);
    let mut start = launch;
    while start < end {
        let full_end = Timestamp::from_millis(start.millis() + HOUR_MS);
        let seg_end = full_end.min(end);
        let partial = seg_end < full_end;
        let free = partial && ended_by == EndedBy::Provider;
        let p = price.at(start)?;
        let billed_seconds = if free { 0.0 } else { 3600.0 };
        items.push(LineItem {
            start,
            end: seg_end,
            price_usd_per_hour: p,
            billed_seconds,
            amount_usd: p.for_secs(billed_seconds),
            free,
        });
        start = full_end;
    }
    Ok(items)
}

fn bill_per_second(
    launch: Timestamp,
    end: Timestamp,
    price: PriceSource<'_>,
) -> Result<Vec<LineItem>, BillingError> {
    // Segment boundaries: launch, every price change strictly inside (launch, end), end.
    let mut cuts = vec![launch];
    if let PriceSource::Spot(series) = price {
        let (times, _) = series.window(Timestamp::from_millis(launch.millis() + 1), end);
        cuts.extend_from_slice(times);
    }
    cuts.push(end);
    cuts.dedup();
    let mut items = Vec::with_capacity(cuts.len());
    if cuts.len() == 1 {
        // Launched and ended at the same instant: a zero-length use, billed the minimum.
        let p = price.at(launch)?;
        items.push(segment(launch, end, p, 0.0));
    } else {
        for w in cuts.windows(2) {
            let p = price.at(w[0])?;
            items.push(segment(
                w[0],
                w[1],
                p,
                (w[1].millis() - w[0].millis()) as f64 / 1000.0,
            ));
        }
    }
    let used_ms = end.millis() - launch.millis();
    if used_ms < PER_SECOND_MINIMUM_MS {
        // The top-up to the minimum is charged at the last segment's price.
        if let Some(last) = items.last_mut() {
            last.billed_seconds += (PER_SECOND_MINIMUM_MS - used_ms) as f64 / 1000.0;
            last.amount_usd = last.price_usd_per_hour.for_secs(last.billed_seconds);
        }
    }
    Ok(items)
}

fn segment(start: Timestamp, end: Timestamp, price: UsdPerHour, secs: f64) -> LineItem {
    LineItem {
        start,
        end,
        price_usd_per_hour: price,
        billed_seconds: secs,
        amount_usd: price.for_secs(secs),
        free: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::Market;

    const H: i64 = HOUR_MS;
    const M: i64 = 60_000;

    fn usd(v: f64) -> UsdPerHour {
        UsdPerHour::new(v).unwrap()
    }

    /// Prices: 0.10 from t=0, 0.30 from 0:30, 0.20 from 1:10, 0.50 from 2:00 exactly.
    fn series() -> PriceSeries {
        PriceSeries::new(
            Market::parse("us-east-1a/c3.xlarge").unwrap(),
            vec![
                (Timestamp::from_millis(0), usd(0.10)),
                (Timestamp::from_millis(30 * M), usd(0.30)),
                (Timestamp::from_millis(70 * M), usd(0.20)),
                (Timestamp::from_millis(2 * H), usd(0.50)),
            ],
        )
    }

    #[test]
    fn models_are_named_as_in_files_and_free_evictions_are_as_documented() {
        for (model, name, free) in [
            (BillingModel::Hourly2015, "hourly-2015", [true, true, true]),
            (BillingModel::PerSecond, "per-second", [true, true, false]),
        ] {
            assert_eq!((model.as_str(), model.to_string()), (name, name.into()));
            assert_eq!(name.parse::<BillingModel>(), Ok(model));
            assert_eq!(
                serde_json::to_string(&model).unwrap(),
                format!("\"{name}\"")
            );
            let lives = [0.0, 3599.999, 3600.0];
            assert_eq!(lives.map(|l| model.provider_end_is_free(l)), free, "{name}");
        }
        assert!(
            "hourly"
                .parse::<BillingModel>()
                .unwrap_err()
                .contains("hourly-2015, per-second")
        );
    }

    #[test]
    fn running_on_costs_an_hour_only_across_an_hour_boundary() {
        let launch = Timestamp::from_millis(0);
        let at = |secs: i64| Timestamp::from_millis(secs * 1000);
        let h = BillingModel::Hourly2015;
        assert_eq!(
            h.cost_of_running_on(usd(0.21), launch, at(600), 60.0).get(),
            0.0
        );
        assert!(
            (h.cost_of_running_on(usd(0.21), launch, at(3570), 60.0)
                .get()
                - 0.21)
                .abs()
                < 1e-12
        );
        assert!(
            (h.cost_of_running_on(usd(0.21), launch, at(7170), 60.0)
                .get()
                - 0.21)
                .abs()
                < 1e-12
        );
        let p = BillingModel::PerSecond;
        // Inside the 60 s minimum nothing more is owed; after it, the seconds.
        assert_eq!(
            p.cost_of_running_on(usd(3.6), launch, at(0), 30.0).get(),
            0.0
        );
        assert!((p.cost_of_running_on(usd(3.6), launch, at(600), 60.0).get() - 0.06).abs() < 1e-12);
    }

    #[test]
    fn billed_hours_is_what_billing_charges_a_user_ended_instance() {
        for model in BillingModel::ALL {
            for secs in [1.0, 59.0, 60.0, 61.5, 3599.0, 3600.0, 3601.0, 9000.0] {
                let end = Timestamp::from_millis((secs * 1000.0) as i64);
                let items = model
                    .bill(
                        Timestamp::from_millis(0),
                        end,
                        EndedBy::User,
                        PriceSource::Fixed(usd(0.5)),
                    )
                    .unwrap();
                let billed = total_usd(&items).get();
                let planned = 0.5 * model.billed_hours(secs);
                assert!(
                    (billed - planned).abs() < 1e-9,
                    "{model} {secs}s: billed {billed}, planned {planned}"
                );
            }
        }
    }

    fn amounts(items: &[LineItem]) -> Vec<(f64, bool)> {
        items
            .iter()
            .map(|i| ((i.amount_usd.get() * 1e6).round() / 1e6, i.free))
            .collect()
    }

    #[test]
    fn hourly_bills_each_started_hour_at_its_start_price() {
        let s = series();
        // Launched at 0:00, user ends at 2:15: hours start at 0:00 (0.10), 1:00 (0.30), 2:00 (0.50).
        let items = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(2 * H + 15 * M),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(
            amounts(&items),
            vec![(0.10, false), (0.30, false), (0.50, false)]
        );
        assert_eq!(items[2].end, Timestamp::from_millis(2 * H + 15 * M));
        assert!((total_usd(&items).get() - 0.90).abs() < 1e-12);
    }

    #[test]
    fn hourly_partial_hour_is_free_only_when_the_provider_ends_it() {
        let s = series();
        let evicted = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(2 * H + 15 * M),
                EndedBy::Provider,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(
            amounts(&evicted),
            vec![(0.10, false), (0.30, false), (0.0, true)]
        );
        assert_eq!(evicted[2].billed_seconds, 0.0);
        assert!((evicted[2].used_hours() - 0.25).abs() < 1e-12);
        // Evicted inside the first hour: the whole life is free.
        let early = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(59 * M + 59_000),
                EndedBy::Provider,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(amounts(&early), vec![(0.0, true)]);
    }

    #[test]
    fn hourly_an_hour_that_ran_to_its_end_is_charged_even_on_eviction() {
        let s = series();
        let items = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(2 * H),
                EndedBy::Provider,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(amounts(&items), vec![(0.10, false), (0.30, false)]);
        // One millisecond into the third hour: that started hour is free when evicted...
        let items = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(2 * H + 1),
                EndedBy::Provider,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(
            amounts(&items),
            vec![(0.10, false), (0.30, false), (0.0, true)]
        );
        // ...and charged in full, at 2:00's price, when the user ends it.
        let items = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(2 * H + 1),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(
            amounts(&items),
            vec![(0.10, false), (0.30, false), (0.50, false)]
        );
    }

    #[test]
    fn hourly_hours_count_from_launch_not_the_clock() {
        let s = series();
        // Launched at 0:20: hours start at 0:20 (0.10), 1:20 (0.20); ended by user at 1:30.
        let items = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(20 * M),
                Timestamp::from_millis(90 * M),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(amounts(&items), vec![(0.10, false), (0.20, false)]);
        assert_eq!(items[1].start, Timestamp::from_millis(80 * M));
        assert_eq!(
            BillingModel::Hourly2015.period_end(
                Timestamp::from_millis(20 * M),
                Timestamp::from_millis(90 * M)
            ),
            Timestamp::from_millis(140 * M)
        );
        assert_eq!(
            BillingModel::Hourly2015.period_start(
                Timestamp::from_millis(20 * M),
                Timestamp::from_millis(90 * M)
            ),
            Timestamp::from_millis(80 * M)
        );
        // Exactly at a boundary, the new hour has started.
        assert_eq!(
            BillingModel::Hourly2015
                .period_end(Timestamp::from_millis(0), Timestamp::from_millis(H)),
            Timestamp::from_millis(2 * H)
        );
        // Ten minutes into the first hour of an instance launched at :50.
        let (launch, now) = (
            Timestamp::from_millis(50 * M),
            Timestamp::from_millis(60 * M),
        );
        assert_eq!(
            BillingModel::Hourly2015.period_end(launch, now),
            Timestamp::from_millis(110 * M)
        );
        assert_eq!(BillingModel::Hourly2015.period_start(launch, now), launch);
        // Per second: the period is the instant, but never ends inside the first minute.
        for (now_s, end_s) in [(3_030, 3_060), (3_090, 3_090)] {
            let now = Timestamp::from_millis(now_s * 1000);
            assert_eq!(
                BillingModel::PerSecond.period_end(Timestamp::from_millis(3_000_000), now),
                Timestamp::from_millis(end_s * 1000),
                "{now_s}"
            );
            assert_eq!(
                BillingModel::PerSecond.period_start(Timestamp::from_millis(3_000_000), now),
                now
            );
        }
    }

    #[test]
    fn hourly_zero_length_life_costs_nothing_and_on_demand_is_fixed() {
        let s = series();
        assert!(
            BillingModel::Hourly2015
                .bill(
                    Timestamp::from_millis(5),
                    Timestamp::from_millis(5),
                    EndedBy::User,
                    PriceSource::Spot(&s)
                )
                .unwrap()
                .is_empty()
        );
        let od = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(3 * H - 1),
                EndedBy::User,
                PriceSource::Fixed(usd(0.21)),
            )
            .unwrap();
        assert_eq!(od.len(), 3);
        assert!((total_usd(&od).get() - 0.63).abs() < 1e-12);
    }

    #[test]
    fn per_second_segments_at_price_changes() {
        let s = series();
        // 0:20 → 1:20: 10 min at 0.10, 40 min at 0.30, 10 min at 0.20.
        let items = BillingModel::PerSecond
            .bill(
                Timestamp::from_millis(20 * M),
                Timestamp::from_millis(80 * M),
                EndedBy::Provider,
                PriceSource::Spot(&s),
            )
            .unwrap();
        let secs: Vec<f64> = items.iter().map(|i| i.billed_seconds).collect();
        assert_eq!(secs, vec![600.0, 2400.0, 600.0]);
        let expected = 0.10 / 6.0 + 0.30 * 40.0 / 60.0 + 0.20 / 6.0;
        assert!((total_usd(&items).get() - expected).abs() < 1e-12);
        assert!(
            items.iter().all(|i| !i.free),
            "an interruption at the end of the first hour is charged"
        );
        // Launched a millisecond after a price change: that change is in the past, not a cut.
        let items = BillingModel::PerSecond
            .bill(
                Timestamp::from_millis(30 * M + 1),
                Timestamp::from_millis(40 * M),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(items.len(), 1, "{items:?}");
        assert_eq!(
            (
                items[0].start,
                items[0].price_usd_per_hour,
                items[0].billed_seconds
            ),
            (Timestamp::from_millis(30 * M + 1), usd(0.30), 599.999)
        );
    }

    #[test]
    fn per_second_an_interruption_within_the_first_hour_is_free_and_after_it_is_not() {
        let s = series();
        let bill = |end_ms: i64, by: EndedBy| {
            BillingModel::PerSecond
                .bill(
                    Timestamp::from_millis(0),
                    Timestamp::from_millis(end_ms),
                    by,
                    PriceSource::Spot(&s),
                )
                .unwrap()
        };
        // Interrupted one millisecond before the first hour ends: every segment free.
        let items = bill(H - 1, EndedBy::Provider);
        assert_eq!(items.len(), 2, "{items:?}");
        assert!(items.iter().all(|i| i.free && i.billed_seconds == 0.0));
        assert_eq!(total_usd(&items), Usd::ZERO);
        // The same life ended by the user pays every second.
        let user = total_usd(&bill(H - 1, EndedBy::User)).get();
        assert!((user - (0.10 * 1800.0 + 0.30 * 1799.999) / 3600.0).abs() < 1e-12);
        // Interrupted at exactly one hour, or later: every second charged, as a user's end.
        for end in [H, 90 * M] {
            let provider = bill(end, EndedBy::Provider);
            assert!(provider.iter().all(|i| !i.free));
            assert_eq!(total_usd(&provider), total_usd(&bill(end, EndedBy::User)));
        }
        // An interruption right after launch: free, not the 60 s minimum.
        let early = bill(10_000, EndedBy::Provider);
        assert_eq!(total_usd(&early), Usd::ZERO);
        assert!(early.iter().all(|i| i.free));
        // On-demand is never ended by the provider in practice, but the rule is the same.
        let od = BillingModel::PerSecond
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(2 * H),
                EndedBy::User,
                PriceSource::Fixed(usd(3.06)),
            )
            .unwrap();
        assert!((total_usd(&od).get() - 6.12).abs() < 1e-12);
    }

    #[test]
    fn per_second_has_a_sixty_second_minimum() {
        let s = series();
        let items = BillingModel::PerSecond
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(10_000),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].billed_seconds, 60.0);
        assert!((items[0].amount_usd.get() - 0.10 / 60.0).abs() < 1e-15);
        // A minimum straddling a price change: 20 s at 0.10, then 10 s at 0.30 topped up by 30 s.
        let items = BillingModel::PerSecond
            .bill(
                Timestamp::from_millis(30 * M - 20_000),
                Timestamp::from_millis(30 * M + 10_000),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap();
        let secs: Vec<f64> = items.iter().map(|i| i.billed_seconds).collect();
        assert_eq!(secs, vec![20.0, 40.0]);
        let zero = BillingModel::PerSecond
            .bill(
                Timestamp::from_millis(0),
                Timestamp::from_millis(0),
                EndedBy::User,
                PriceSource::Fixed(usd(0.36)),
            )
            .unwrap();
        assert!((total_usd(&zero).get() - 0.006).abs() < 1e-15);
    }

    #[test]
    fn errors_are_clear() {
        let s = series();
        let err = BillingModel::Hourly2015
            .bill(
                Timestamp::from_millis(-H),
                Timestamp::from_millis(0),
                EndedBy::User,
                PriceSource::Spot(&s),
            )
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("no spot price is known for us-east-1a/c3.xlarge"),
            "{err}"
        );
        assert!(
            BillingModel::PerSecond
                .bill(
                    Timestamp::from_millis(10),
                    Timestamp::from_millis(0),
                    EndedBy::User,
                    PriceSource::Spot(&s)
                )
                .is_err()
        );
        assert_eq!(
            "per-second".parse::<BillingModel>(),
            Ok(BillingModel::PerSecond)
        );
        assert!(
            "hourly"
                .parse::<BillingModel>()
                .unwrap_err()
                .contains("allowed: hourly-2015, per-second")
        );
    }
}
