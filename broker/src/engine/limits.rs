//! The limits a job's footprint is held to, the same in the simulator and the live scheduler:
//! instances at once, reliable (on-demand) instances at once, and capacity in work units per
//! hour. A job's [`Budget`] is judged here too, on the spend and on what its instances' next
//! billing periods add, both of which the [`JobEngine`](super::JobEngine) computes.
//!
//! What counts as held: every instance that is not warned and not gone. A warned instance is
//! leaving (it hands its work over and is taken at its deadline), so its replacement may be
//! bought during the notice — the point of a two-minute warning.

use crate::job::JobModel;
use crate::market::Usd;
use crate::policy::PolicyKind;
use proteus_wire::Tier;

/// A job's footprint limits under one policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub max_instances: u32,
    /// `None` for the on-demand baseline, whose whole footprint is the reliable tier
    /// (`max_reliable_instances` bounds the reliable tier of mixed policies).
    pub max_reliable: Option<u32>,
    /// Units of work per hour, summed over held instances.
    pub max_capacity: Option<f64>,
}

impl Limits {
    pub fn of(job: &JobModel, policy: PolicyKind) -> Limits {
        Limits {
            max_instances: job.max_instances,
            max_reliable: (policy != PolicyKind::OnDemand).then_some(job.max_reliable_instances),
            max_capacity: job.max_capacity,
        }
    }

    /// How many of `want` more instances of `tier` at `units_per_hour` each fit beside `held`.
    pub fn room(&self, held: &Held, tier: Tier, units_per_hour: f64, want: u32) -> u32 {
        let mut n = want.min(self.max_instances.saturating_sub(held.instances));
        if tier == Tier::Reliable
            && let Some(cap) = self.max_reliable
        {
            n = n.min(cap.saturating_sub(held.reliable));
        }
        if let Some(cap) = self.max_capacity
            && units_per_hour > 0.0
        {
            // A small tolerance, so that a cap that is an exact multiple of the rate admits it.
            let fits = ((cap - held.capacity) / units_per_hour + 1e-9)
                .floor()
                .max(0.0);
            n = n.min(fits.min(f64::from(u32::MAX)) as u32);
        }
        n
    }
}

/// What a footprint holds against its [`Limits`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Held {
    pub instances: u32,
    pub reliable: u32,
    pub capacity: f64,
}

impl Held {
    pub fn add(&mut self, tier: Tier, units_per_hour: f64) {
        self.instances += 1;
        if tier == Tier::Reliable {
            self.reliable += 1;
        }
        self.capacity += units_per_hour;
    }
}

/// What a job may spend. The job ends *before* the billing period that would take its spend
/// past the budget (the driver may not look again until some market time has passed), and a
/// launch is held back when its first billing period would.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget(pub Usd);

impl Budget {
    /// Why the job must end now, if it must: `spent` reaches the budget, or keeping its
    /// instances on would pass it (`running_on`: what their next billing periods add).
    pub fn ends_job(self, spent: Usd, running_on: Usd) -> Option<String> {
        let budget = self.0.get();
        if spent >= self.0 {
            Some(format!(
                "budget exhausted: spent ${:.2} of ${budget:.2}",
                spent.get()
            ))
        } else if spent + running_on > self.0 {
            Some(format!(
                "budget reached: spent ${:.2} of ${budget:.2}; the next billing period would add ${:.2}",
                spent.get(),
                running_on.get()
            ))
        } else {
            None
        }
    }

    /// Why a launch whose first billing period costs `period` is held back, if it is: beside
    /// what is spent or already committed to other launches, it would pass the budget.
    pub fn holds_launch(self, committed: Usd, period: Usd) -> Option<String> {
        (committed + period > self.0).then(|| {
            format!(
                "launches held: ${:.2} spent or committed of a ${:.2} budget",
                committed.get(),
                self.0.get()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(reliable: Option<u32>, capacity: Option<f64>) -> Limits {
        Limits {
            max_instances: 10,
            max_reliable: reliable,
            max_capacity: capacity,
        }
    }

    #[test]
    fn every_limit_bounds_the_room() {
        let mut held = Held::default();
        held.add(Tier::Reliable, 2.0);
        held.add(Tier::Transient, 4.0);
        let l = limits(Some(2), None);
        assert_eq!(l.room(&held, Tier::Transient, 1.0, 20), 8, "instances");
        assert_eq!(l.room(&held, Tier::Reliable, 1.0, 20), 1, "reliable cap");
        assert_eq!(limits(None, None).room(&held, Tier::Reliable, 1.0, 20), 8);
        let l = limits(None, Some(12.0));
        assert_eq!(
            l.room(&held, Tier::Transient, 2.0, 20),
            3,
            "capacity 6 + 3 × 2"
        );
        assert_eq!(
            l.room(&held, Tier::Transient, 2.5, 20),
            2,
            "whole instances only"
        );
        assert_eq!(l.room(&held, Tier::Transient, 7.0, 20), 0);
        assert_eq!(
            l.room(&held, Tier::Transient, 2.0, 1),
            1,
            "never more than asked"
        );
    }

    #[test]
    fn a_budget_ends_the_job_before_the_period_that_would_pass_it() {
        let usd = |v: f64| Usd::new(v).unwrap();
        let b = Budget(usd(10.0));
        assert_eq!(
            b.ends_job(usd(9.0), usd(1.0)),
            None,
            "exactly the budget is allowed"
        );
        assert_eq!(b.ends_job(usd(9.0), usd(0.5)), None);
        assert_eq!(
            b.ends_job(usd(9.0), usd(1.5)).as_deref(),
            Some("budget reached: spent $9.00 of $10.00; the next billing period would add $1.50")
        );
        for spent in [10.0, 12.0] {
            assert_eq!(
                b.ends_job(usd(spent), Usd::ZERO).as_deref(),
                Some(format!("budget exhausted: spent ${spent:.2} of $10.00").as_str())
            );
        }
    }

    #[test]
    fn a_launch_is_held_when_its_first_period_would_pass_the_budget() {
        let usd = |v: f64| Usd::new(v).unwrap();
        let b = Budget(usd(10.0));
        assert_eq!(
            b.holds_launch(usd(9.5), usd(0.5)),
            None,
            "exactly the budget fits"
        );
        assert_eq!(b.holds_launch(usd(2.0), usd(0.5)), None);
        assert_eq!(
            b.holds_launch(usd(9.5), usd(0.75)).as_deref(),
            Some("launches held: $9.50 spent or committed of a $10.00 budget")
        );
    }

    #[test]
    fn held_counts_every_instance_and_the_reliable_ones_apart() {
        let mut held = Held::default();
        held.add(Tier::Transient, 1.5);
        held.add(Tier::Transient, 1.5);
        held.add(Tier::Reliable, 0.5);
        assert_eq!(
            held,
            Held {
                instances: 3,
                reliable: 1,
                capacity: 3.5
            }
        );
    }

    #[test]
    fn a_type_without_a_rate_is_not_held_to_the_capacity() {
        // It adds no capacity, so even a footprint at (or past) the cap has room for it; only
        // the instance count bounds it.
        let mut held = Held::default();
        held.add(Tier::Transient, 6.0);
        for cap in [6.0, 5.0] {
            let l = limits(None, Some(cap));
            assert_eq!(l.room(&held, Tier::Transient, 0.0, 3), 3, "cap {cap}");
            assert_eq!(l.room(&held, Tier::Transient, 1.0, 3), 0, "cap {cap}");
        }
    }

    #[test]
    fn only_mixed_policies_cap_the_reliable_tier() {
        use crate::market::{InstanceType, Region, UsdPerHour};
        use crate::prices::{InstanceOffer, OnDemandCatalog};
        let region = Region::parse("us-east-1").unwrap();
        let od = OnDemandCatalog::new([InstanceOffer {
            region: region.clone(),
            instance_type: InstanceType::parse("c3.xlarge").unwrap(),
            vcpus: None,
            memory_gib: None,
            on_demand: UsdPerHour::new(0.21).unwrap(),
        }]);
        let spec = r#"
            total_work = 10.0
            reference_type = "c3.xlarge"
            instance_types = ["c3.xlarge"]
            max_instances = 6
            max_reliable_instances = 2
            max_capacity = 5.0
        "#;
        let job = crate::job::WorkModelSpec::parse("j.toml", spec)
            .unwrap()
            .resolve("j.toml", &od, &region)
            .unwrap();
        for kind in [PolicyKind::BidBrain, PolicyKind::StandardBidding] {
            let l = Limits::of(&job, kind);
            assert_eq!(
                (l.max_instances, l.max_reliable, l.max_capacity),
                (6, Some(2), Some(5.0)),
                "{kind:?}"
            );
        }
        let l = Limits::of(&job, PolicyKind::OnDemand);
        assert_eq!(
            (l.max_instances, l.max_reliable, l.max_capacity),
            (6, None, Some(5.0)),
            "the on-demand baseline's whole footprint is reliable"
        );
    }
}
