//! A job's progress under its eviction-cost model: the work done, what evictions lose, and when
//! the job cannot work (AgileML rebalancing; checkpoint/restart writing checkpoints, stopped
//! after an eviction, restarting).
//!
//! The [`JobEngine`](super::JobEngine) drives it under
//! [`Pacing::Modelled`](super::job_engine::Pacing::Modelled), for both drivers. It calls it in
//! the same order at each instant — [`JobWork::accrue`] up to now, then
//! [`JobWork::warned`] per warning, [`JobWork::after_warnings`], [`JobWork::rebalance`] on a
//! membership change, [`JobWork::milestones`], and [`JobWork::released`] when the policy
//! releases — so the same events give the same progress to the millisecond.

use super::work::{self, WorkingSpan};
use crate::job::EvictionCost;
use crate::market::Timestamp;
use proteus_wire::agent_api::StageThresholds;

/// Below this many units short of the total a job counts as done (floating-point sums of
/// rate × time reach the total only up to rounding).
pub const DONE_TOLERANCE_UNITS: f64 = 1e-9;

/// See [`JobWork::completion`].
pub const COMPLETION_SLACK_MS: f64 = 1e-3;

/// The work state of one job.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JobWork {
    cost: EvictionCost,
    /// Units done so far (work lost to evictions taken off).
    done: f64,
    /// Units lost to evictions (and to be redone).
    lost: f64,
    /// Checkpoint/restart: units safe in the last checkpoint.
    committed: f64,
    /// Checkpoint/restart: stopped after an eviction or a coordinated shrink.
    down: bool,
    restart_at: Option<Timestamp>,
    next_checkpoint: Option<Timestamp>,
    checkpoint_done: Option<Timestamp>,
    /// No work before this (rebalancing, checkpoint writing).
    stall_until: Timestamp,
    /// AgileML: the pauses of the last sync interval, so that a warned instance loses only the
    /// work it did since its last sync, not the time it was paused (counted as stalled).
    #[serde(default)]
    recent_stalls: Vec<(Timestamp, Timestamp)>,
}

/// Where ready capacity did no work while [`JobWork::accrue`] counted, in units.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Idle {
    /// Paused: rebalancing, writing checkpoints, down.
    pub stalled: f64,
    /// Reliable instances holding only backups (AgileML stage 3).
    pub backups_only: f64,
}

impl JobWork {
    pub fn new(cost: EvictionCost, start: Timestamp) -> Self {
        JobWork {
            cost,
            done: 0.0,
            lost: 0.0,
            committed: 0.0,
            down: false,
            restart_at: None,
            next_checkpoint: None,
            checkpoint_done: None,
            stall_until: start,
            recent_stalls: Vec::new(),
        }
    }

    pub fn cost(&self) -> EvictionCost {
        self.cost
    }

    /// Units done so far.
    pub fn done(&self) -> f64 {
        self.done
    }

    /// Units lost to evictions so far.
    pub fn lost(&self) -> f64 {
        self.lost
    }

    pub fn is_complete(&self, total: f64) -> bool {
        self.done >= total - DONE_TOLERANCE_UNITS
    }

    /// Marks the job done (its last instant's rounding included).
    pub fn complete(&mut self, total: f64) {
        self.done = self.done.max(total);
    }

    /// The units per hour `spans` deliver at `at` for this job: AgileML's stage rule applies
    /// only to AgileML jobs (a checkpoint/restart job has no backup tiers), nothing while down.
    pub fn working_rate(
        &self,
        spans: &[WorkingSpan],
        stages: &StageThresholds,
        at: Timestamp,
    ) -> f64 {
        self.working_rate_of(
            spans
                .iter()
                .filter(|s| s.from <= at && s.until.is_none_or(|u| u > at))
                .map(|s| (s.tier, s.units_per_hour)),
            stages,
        )
    }

    /// [`working_rate`](Self::working_rate) of the instances working now (tier and rate each).
    pub fn working_rate_of(
        &self,
        working: impl Iterator<Item = (proteus_wire::Tier, f64)>,
        stages: &StageThresholds,
    ) -> f64 {
        if self.down {
            return 0.0;
        }
        let stages = matches!(self.cost, EvictionCost::AgileMl { .. }).then_some(stages);
        work::rate_of(working, stages)
    }

    /// Counts the work from `now` to `t` at `working` units per hour (constant in between: the
    /// drivers call this at every change); `ready` is the rate of every ready instance, for
    /// the idle figures.
    pub fn accrue(&mut self, now: Timestamp, t: Timestamp, working: f64, ready: f64) -> Idle {
        if t <= now {
            return Idle::default();
        }
        let from = now.max(self.stall_until).min(t);
        let hours = |a: Timestamp, b: Timestamp| (b.millis() - a.millis()) as f64 / 3_600_000.0;
        self.done += working * hours(from, t);
        if self.down {
            Idle {
                stalled: ready * hours(now, t),
                backups_only: 0.0,
            }
        } else {
            Idle {
                stalled: working * hours(now, from),
                backups_only: (ready - working) * hours(now, t),
            }
        }
    }

    /// An instance of `units_per_hour` was warned at `now`, ready since `ready_at` (if it was).
    /// AgileML loses its work since its last background sync. Returns whether the membership
    /// of the job changed (the caller then [`rebalance`](Self::rebalance)s).
    pub fn warned(
        &mut self,
        now: Timestamp,
        ready_at: Option<Timestamp>,
        units_per_hour: f64,
    ) -> bool {
        let EvictionCost::AgileMl {
            sync_interval_secs, ..
        } = self.cost
        else {
            return false;
        };
        if let Some(ready_at) = ready_at {
            let since_ready = (now.millis() - ready_at.millis()) as f64 / 1000.0;
            let unsynced = since_ready % sync_interval_secs;
            // Paused time in the unsynced window did no work, so none of it is lost.
            let window = (now.millis() - (unsynced * 1000.0) as i64, now.millis());
            let paused_ms: i64 = self
                .recent_stalls
                .iter()
                .map(|(a, b)| (b.millis().min(window.1) - a.millis().max(window.0)).max(0))
                .sum();
            let worked = (unsynced - paused_ms as f64 / 1000.0).max(0.0);
            let lost = (units_per_hour * worked / 3600.0).min(self.done);
            self.done -= lost;
            self.lost += lost;
        }
        true
    }

    /// After the warnings of one instant: a checkpoint/restart job stops and falls back to its
    /// last checkpoint.
    pub fn after_warnings(&mut self) {
        if matches!(self.cost, EvictionCost::Checkpoint { .. }) {
            self.go_down(true);
        }
    }

    /// AgileML pauses every worker while partitions are re-split.
    pub fn rebalance(&mut self, now: Timestamp) {
        if let EvictionCost::AgileMl {
            rebalance_secs,
            sync_interval_secs,
        } = self.cost
        {
            let until = Timestamp::from_millis(now.millis() + (rebalance_secs * 1000.0) as i64);
            // The pause runs from the later of now and the current pause's end.
            let from = now.max(self.stall_until);
            self.stall_until = self.stall_until.max(until);
            if from < self.stall_until {
                self.recent_stalls.push((from, self.stall_until));
            }
            let keep_after = now.millis() - (sync_interval_secs * 1000.0) as i64;
            self.recent_stalls.retain(|(_, b)| b.millis() > keep_after);
        }
    }

    /// The policy released instances at `now`.
    pub fn released(&mut self, now: Timestamp) {
        match self.cost {
            EvictionCost::AgileMl { .. } => self.rebalance(now),
            // A coordinated shrink: no work lost, but the job restarts on the new set.
            EvictionCost::Checkpoint { .. } => {
                if !self.down {
                    self.committed = self.done;
                }
                self.go_down(false);
            }
        }
    }

    fn go_down(&mut self, lose: bool) {
        if lose {
            let lost = (self.done - self.committed).max(0.0);
            self.lost += lost;
            self.done = self.committed;
        }
        self.down = true;
        self.restart_at = None;
        self.next_checkpoint = None;
        self.checkpoint_done = None;
    }

    /// Checkpoint/restart milestones at `now`: restart once the replacements are up, save
    /// checkpoints on schedule. `any_ready`: an instance works (ready, not warned);
    /// `any_starting`: one is still starting.
    pub fn milestones(&mut self, now: Timestamp, any_ready: bool, any_starting: bool) {
        let EvictionCost::Checkpoint {
            interval_secs,
            checkpoint_secs,
            restart_secs,
        } = self.cost
        else {
            return;
        };
        let after = |secs: f64| Timestamp::from_millis(now.millis() + (secs * 1000.0) as i64);
        if self.down {
            match self.restart_at {
                Some(r) if r <= now => {
                    self.down = false;
                    self.restart_at = None;
                    self.next_checkpoint = Some(after(interval_secs));
                }
                Some(_) => {}
                None if any_ready && !any_starting => self.restart_at = Some(after(restart_secs)),
                None => {}
            }
            return;
        }
        if self.checkpoint_done.is_some_and(|d| d <= now) {
            self.committed = self.done;
            self.checkpoint_done = None;
            self.next_checkpoint = Some(after(interval_secs));
        }
        if self.next_checkpoint.is_some_and(|c| c <= now) {
            self.next_checkpoint = None;
            self.checkpoint_done = Some(after(checkpoint_secs));
            self.stall_until = self.stall_until.max(after(checkpoint_secs));
        }
        if self.next_checkpoint.is_none() && self.checkpoint_done.is_none() && any_ready {
            self.next_checkpoint = Some(after(interval_secs));
        }
    }

    /// The next instant after `now` at which this state changes on its own (a milestone, the
    /// end of a stall), if any.
    pub fn next_change(&self, now: Timestamp) -> Option<Timestamp> {
        [self.restart_at, self.next_checkpoint, self.checkpoint_done]
            .into_iter()
            .flatten()
            .chain((self.stall_until > now).then_some(self.stall_until))
            .min()
    }

    /// When the job completes if it keeps working at `working` units per hour from `now`, to
    /// the millisecond. The same completion estimated from any instant in between gives the
    /// same millisecond: a remainder within [`COMPLETION_SLACK_MS`] above a whole millisecond
    /// is rounding in the sums, not work left.
    pub fn completion(&self, now: Timestamp, working: f64, total: f64) -> Option<Timestamp> {
        (working > 0.0).then(|| {
            let from = now.max(self.stall_until);
            let ms = (total - self.done).max(0.0) / working * 3_600_000.0;
            Timestamp::from_millis(
                from.millis() + (ms - COMPLETION_SLACK_MS).ceil().max(0.0) as i64,
            )
        })
    }
}
