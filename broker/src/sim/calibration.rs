//! How well the market model's eviction estimates match what happened: for every spot instance
//! of a run, the probability the model gave at launch that the provider would end it within its
//! first hour, against whether it did.
//!
//! An instance the user ended before it had been held for [`OBSERVED_SECS`] without an eviction
//! says nothing about its first hour (a release at its hour's end, the job's end): it is
//! *censored* and left out. Every other spot instance is an outcome: evicted within the hour (1)
//! or not (0). The figures are the Brier score of the estimates, the Brier score of a forecaster
//! that always says the observed rate (the climatology: the estimates are worth something only
//! below it), and a reliability table: outcomes binned by estimate, each bin's mean estimate
//! against its observed rate.

use super::InstanceRecord;
use crate::billing::EndedBy;
use serde::Serialize;

/// The horizon the estimates are for, seconds.
pub const HORIZON_SECS: f64 = 3600.0;
/// Held this long without an eviction, an instance counts as not evicted within its hour (BidBrain
/// releases a few minutes before its boundary).
pub const OBSERVED_SECS: f64 = 0.9 * HORIZON_SECS;

/// One bin of the reliability table: estimates in `[from, to)` (the last bin includes 1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bin {
    pub from: f64,
    pub to: f64,
    pub count: usize,
    pub mean_estimate: f64,
    pub observed_rate: f64,
}

/// The calibration of one set of estimates (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// Spot instances with an estimate that count as outcomes.
    pub outcomes: usize,
    /// Spot instances left out because the user ended them early (see [`OBSERVED_SECS`]).
    pub censored: usize,
    pub mean_estimate: f64,
    pub observed_rate: f64,
    /// Mean squared error of the estimates (0 is perfect).
    pub brier: f64,
    /// The same for the constant forecast `observed_rate`.
    pub climatology_brier: f64,
    pub bins: Vec<Bin>,
}

/// The outcome of one instance: `Some(true)` evicted within its hour, `Some(false)` held through
/// it, `None` censored or without an estimate.
fn outcome(i: &InstanceRecord) -> Option<(f64, bool)> {
    Some((i.predicted_probability?, observed(i)?))
}

/// Whether an instance was evicted within its first hour: `None` when censored (see the module
/// documentation).
fn observed(i: &InstanceRecord) -> Option<bool> {
    let held = i.end.secs_since(i.launch);
    match i.ended_by {
        EndedBy::Provider => Some(held <= HORIZON_SECS),
        EndedBy::User if held >= OBSERVED_SECS => Some(false),
        EndedBy::User => None,
    }
}

/// Calibration over `instances` with `bins` equal bins of the estimate (at least one).
pub fn calibrate<'a>(
    instances: impl IntoIterator<Item = &'a InstanceRecord>,
    bins: usize,
) -> Calibration {
    let bins = bins.max(1);
    let (mut pairs, mut censored) = (Vec::new(), 0);
    for i in instances {
        match (i.predicted_probability, outcome(i)) {
            (_, Some(o)) => pairs.push(o),
            (Some(_), None) => censored += 1,
            (None, None) => {}
        }
    }
    let n = pairs.len();
    let mean = |v: &mut dyn Iterator<Item = f64>| {
        if n == 0 {
            f64::NAN
        } else {
            v.sum::<f64>() / n as f64
        }
    };
    let hit = |e: bool| if e { 1.0 } else { 0.0 };
    let mean_estimate = mean(&mut pairs.iter().map(|(p, _)| *p));
    let observed_rate = mean(&mut pairs.iter().map(|(_, e)| hit(*e)));
    let brier = mean(&mut pairs.iter().map(|(p, e)| (p - hit(*e)).powi(2)));
    let climatology_brier = mean(&mut pairs.iter().map(|(_, e)| (observed_rate - hit(*e)).powi(2)));
    let width = 1.0 / bins as f64;
    let table = (0..bins)
        .map(|b| {
            let (from, to) = (b as f64 * width, (b + 1) as f64 * width);
            let inside: Vec<&(f64, bool)> = pairs
                .iter()
                .filter(|(p, _)| *p >= from && (*p < to || (b + 1 == bins && *p <= 1.0)))
                .collect();
            let k = inside.len();
            let avg = |f: &dyn Fn(&(f64, bool)) -> f64| {
                if k == 0 {
                    f64::NAN
                } else {
                    inside.iter().map(|x| f(x)).sum::<f64>() / k as f64
                }
            };
            Bin {
                from,
                to,
                count: k,
                mean_estimate: avg(&|(p, _)| *p),
                observed_rate: avg(&|(_, e)| hit(*e)),
            }
        })
        .collect();
    Calibration {
        outcomes: n,
        censored,
        mean_estimate,
        observed_rate,
        brier,
        climatology_brier,
        bins: table,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::{Timestamp, Usd, UsdPerHour};
    use proteus_wire::Tier;

    fn inst(p: Option<f64>, held_min: f64, by: EndedBy) -> InstanceRecord {
        InstanceRecord {
            market: "us-east-1a/c3.xlarge".into(),
            tier: Tier::Transient,
            bid: Some(UsdPerHour::new(0.1).unwrap()),
            launch: Timestamp::from_millis(0),
            end: Timestamp::from_millis((held_min * 60_000.0) as i64),
            ended_by: by,
            price_at_launch: None,
            predicted_probability: p,
            predicted_secs: None,
            cost_usd: Usd::ZERO,
        }
    }

    #[test]
    fn outcomes_censoring_and_the_hour_boundary() {
        use EndedBy::*;
        let c = calibrate(
            &[
                inst(Some(0.9), 30.0, Provider), // evicted inside its hour
                inst(Some(0.9), 60.0, Provider), // evicted at the boundary: inside
                inst(Some(0.1), 61.0, Provider), // evicted after its hour: held through it
                inst(Some(0.1), 57.0, User),     // released at 57 min: held through it
                inst(Some(0.5), 20.0, User),     // released at 20 min: censored
                inst(None, 20.0, Provider),      // no estimate (on-demand): not counted
            ],
            2,
        );
        assert_eq!((c.outcomes, c.censored), (4, 1));
        assert_eq!(c.observed_rate, 0.5);
        assert_eq!(c.mean_estimate, 0.5);
        // (0.1² + 0.1² + 0.1² + 0.1²) / 4
        assert!((c.brier - 0.01).abs() < 1e-12, "{}", c.brier);
        assert!((c.climatology_brier - 0.25).abs() < 1e-12);
        assert_eq!(c.bins[0].count, 2);
        assert_eq!(c.bins[0].observed_rate, 0.0);
        assert_eq!(c.bins[1].count, 2);
        assert_eq!(c.bins[1].observed_rate, 1.0);
        assert!((c.bins[1].mean_estimate - 0.9).abs() < 1e-12);
    }

    #[test]
    fn an_estimate_of_one_falls_in_the_last_bin_and_no_outcome_gives_no_figures() {
        let c = calibrate(&[inst(Some(1.0), 10.0, EndedBy::Provider)], 4);
        assert_eq!(c.bins[3].count, 1);
        assert_eq!(c.bins.iter().map(|b| b.count).sum::<usize>(), 1);
        let none = calibrate(&[], 4);
        assert_eq!(none.outcomes, 0);
        assert!(none.brier.is_nan() && none.bins.iter().all(|b| b.count == 0));
    }
}
