//! Work accounting: the units of work a job's instances deliver while they work.
//!
//! An instance works for the job from when it is ready (its agent joined; under modelled
//! pacing, start-up after launch) until it is warned, ended or released, at its type's rate in
//! the job's units per hour. AgileML's stage rule applies on top: while the transient:reliable
//! ratio is at stage 3, reliable machines hold only backup shards and train nothing
//! ([`Stage::reliable_machines_train`]).

use crate::job::JobModel;
use crate::market::Timestamp;
use crate::store::InstanceRow;
use proteus_wire::Tier;
use proteus_wire::agent_api::{Stage, StageThresholds};

/// One instance's working time for the job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkingSpan {
    pub tier: Tier,
    /// The job's units per hour on this instance's type.
    pub units_per_hour: f64,
    pub from: Timestamp,
    /// `None`: still working.
    pub until: Option<Timestamp>,
}

impl WorkingSpan {
    /// The span of a stored instance, from its recorded readiness until it was warned or ended;
    /// `None` if it never became ready or the job does not run on its type.
    pub fn of_instance(row: &InstanceRow, job: &JobModel) -> Option<WorkingSpan> {
        let from = row.ready?;
        let units_per_hour = job.rate(&row.market.instance_type)?;
        let until = [row.warned, row.ended].into_iter().flatten().min();
        Some(WorkingSpan {
            tier: row.tier,
            units_per_hour,
            from,
            until,
        })
    }
}

/// Units of work the spans delivered in `[since, until)`. With `stages`, AgileML's stage rule
/// decides at every instant whether reliable instances count; without, every span counts
/// (a checkpoint/restart job has no parameter-server tiers).
pub fn work_between(
    spans: &[WorkingSpan],
    stages: Option<&StageThresholds>,
    since: Timestamp,
    until: Timestamp,
) -> f64 {
    if until <= since {
        return 0.0;
    }
    let clip = |t: Timestamp| t.max(since).min(until);
    let mut cuts: Vec<Timestamp> = vec![since, until];
    for s in spans {
        cuts.push(clip(s.from));
        cuts.push(clip(s.until.unwrap_or(until)));
    }
    cuts.sort();
    cuts.dedup();
    cuts.windows(2)
        .map(|w| rate_at(spans, stages, w[0]) * w[1].secs_since(w[0]) / 3600.0)
        .sum()
}

/// Units per hour the spans deliver at `at`, under the stage rule when `stages` is given.
pub fn rate_at(spans: &[WorkingSpan], stages: Option<&StageThresholds>, at: Timestamp) -> f64 {
    rate_of(
        spans
            .iter()
            .filter(|s| s.from <= at && s.until.is_none_or(|u| u > at))
            .map(|s| (s.tier, s.units_per_hour)),
        stages,
    )
}

/// Units per hour that instances working now (tier and rate each) deliver, under the stage
/// rule when `stages` is given.
pub fn rate_of(
    working: impl Iterator<Item = (Tier, f64)>,
    stages: Option<&StageThresholds>,
) -> f64 {
    let (mut transient, mut reliable) = (0usize, 0usize);
    let (mut t_rate, mut r_rate) = (0.0, 0.0);
    for (tier, units_per_hour) in working {
        match tier {
            Tier::Transient => {
                transient += 1;
                t_rate += units_per_hour;
            }
            Tier::Reliable => {
                reliable += 1;
                r_rate += units_per_hour;
            }
        }
    }
    let reliable_trains =
        stages.is_none_or(|t| Stage::for_counts(transient, reliable, t).reliable_machines_train());
    t_rate + if reliable_trains { r_rate } else { 0.0 }
}

/// The work a live job has received up to `until`: every instance's working span, under the
/// stage rule (the agents always run AgileML's tiers).
pub fn received(instances: &[InstanceRow], job: &JobModel, until: Timestamp) -> f64 {
    let spans: Vec<WorkingSpan> = instances
        .iter()
        .filter_map(|i| WorkingSpan::of_instance(i, job))
        .collect();
    let since = spans.iter().map(|s| s.from).min().unwrap_or(until);
    work_between(&spans, Some(&job.stages), since, until)
}

/// The units of total work a job needs, re-estimated from what it measured: `done` units
/// brought it `fraction` of the way. `None` until there is enough to go on (no progress yet,
/// or less than [`MIN_FRACTION_TO_REESTIMATE`]).
pub fn reestimate_total(done: f64, fraction: f64) -> Option<f64> {
    ((MIN_FRACTION_TO_REESTIMATE..=1.0).contains(&fraction) && done > 0.0).then(|| done / fraction)
}

/// Below this fraction of progress the measured rate is mostly start-up noise.
pub const MIN_FRACTION_TO_REESTIMATE: f64 = 0.05;

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_millis(secs * 1000)
    }

    fn span(tier: Tier, rate: f64, from: i64, until: Option<i64>) -> WorkingSpan {
        WorkingSpan {
            tier,
            units_per_hour: rate,
            from: t(from),
            until: until.map(t),
        }
    }

    #[test]
    fn spans_add_rate_times_time_inside_the_window() {
        let spans = [
            span(Tier::Transient, 2.0, 0, Some(3600)),
            span(Tier::Transient, 1.0, 1800, None),
        ];
        // 2 units from the first, 0.5 from the second in its first half hour.
        let w = work_between(&spans, None, t(0), t(3600));
        assert!((w - 2.5).abs() < 1e-12, "{w}");
        // Clipped to the window.
        let w = work_between(&spans, None, t(1800), t(5400));
        assert!((w - (1.0 + 1.0)).abs() < 1e-12, "{w}");
        assert_eq!(work_between(&spans, None, t(10), t(10)), 0.0);
    }

    #[test]
    fn at_stage_three_reliable_machines_do_not_train() {
        let stages = StageThresholds {
            stage2_ratio: 1.0,
            stage3_ratio: 2.0,
        };
        // One reliable all hour; one transient all hour (stage 1/2: reliable trains); a second
        // transient joins at half time (ratio 2: stage 3, reliable idles).
        let spans = [
            span(Tier::Reliable, 4.0, 0, None),
            span(Tier::Transient, 1.0, 0, None),
            span(Tier::Transient, 1.0, 1800, None),
        ];
        let w = work_between(&spans, Some(&stages), t(0), t(3600));
        assert!((w - (0.5 * 5.0 + 0.5 * 2.0)).abs() < 1e-12, "{w}");
        let w = work_between(&spans, None, t(0), t(3600));
        assert!((w - (5.0 + 0.5)).abs() < 1e-12, "{w}");
    }

    #[test]
    fn reestimates_only_with_enough_progress() {
        assert_eq!(reestimate_total(1.0, 0.0), None);
        assert_eq!(reestimate_total(1.0, 0.01), None);
        assert_eq!(reestimate_total(0.0, 0.5), None);
        assert_eq!(reestimate_total(0.5, 0.5), Some(1.0));
    }
}
