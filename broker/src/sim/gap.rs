//! Where the money goes: a policy's cost against the foresight optimum's, split into what
//! causes the difference (`proteus simulate --job … --optimal --gap FILE`).
//!
//! A cost is a price per paid unit-hour of capacity times the unit-hours paid. The gap between a
//! policy `P` and the optimum `O` on one start is split exactly:
//!
//! ```text
//! cost_P − cost_O = (price_P − price_O) × paid_O              "price"
//!                 + price_P × (paid_P − paid_O)
//! paid = held − free + unused billed
//! held = work + lost work + start-up + hand-over + stalled + idle + residual
//! ```
//!
//! so every unit-hour the policy holds or pays beyond the optimum's is valued at the policy's
//! own price per paid unit-hour: free hours it did not get, work it lost to evictions, start-up,
//! hand-over in the notice, pauses (rebalancing, restarts), an idle reliable tier, charged hours
//! it did not use. Hours spent waiting (below full speed) cost no money; they are reported as
//! time.

use super::RunResult;
use super::foresight::ForesightSchedule;
use serde::Serialize;

/// The components, in dollars (positive: the policy pays more than the optimum for it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GapParts {
    /// Paying more per paid unit-hour (markets, hours, bids).
    pub price: f64,
    /// Fewer free (evicted) partial hours.
    pub free_hours: f64,
    /// Work lost to evictions and done again.
    pub lost_work: f64,
    /// Instances starting (billed, not working).
    pub startup: f64,
    /// Warned instances handing over in the notice.
    pub handover: f64,
    /// Ready instances paused: rebalancing, restarts, checkpoints.
    pub stalled: f64,
    /// Reliable instances holding only backup shards.
    pub idle: f64,
    /// Charged hours not used after a release.
    pub unused_billed: f64,
    /// What the accounts above do not explain (rounding).
    pub other: f64,
}

impl GapParts {
    pub const NAMES: [&'static str; 9] = [
        "price",
        "free_hours",
        "lost_work",
        "startup",
        "handover",
        "stalled",
        "idle",
        "unused_billed",
        "other",
    ];

    pub fn values(&self) -> [f64; 9] {
        [
            self.price,
            self.free_hours,
            self.lost_work,
            self.startup,
            self.handover,
            self.stalled,
            self.idle,
            self.unused_billed,
            self.other,
        ]
    }

    fn from_values(v: [f64; 9]) -> Self {
        GapParts {
            price: v[0],
            free_hours: v[1],
            lost_work: v[2],
            startup: v[3],
            handover: v[4],
            stalled: v[5],
            idle: v[6],
            unused_billed: v[7],
            other: v[8],
        }
    }

    pub fn sum(&self) -> f64 {
        self.values().iter().sum()
    }

    fn plus(&self, o: &GapParts) -> GapParts {
        let (a, b) = (self.values(), o.values());
        GapParts::from_values(std::array::from_fn(|i| a[i] + b[i]))
    }
}

/// One policy's figures on one start, in the units the decomposition uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Account {
    pub cost_usd: f64,
    pub runtime_hours: f64,
    /// Capacity held, units of work × hours.
    pub held_unit_hours: f64,
    pub paid_unit_hours: f64,
    pub free_unit_hours: f64,
    pub work: f64,
    pub lost_work: f64,
    pub startup_unit_hours: f64,
    pub handover_unit_hours: f64,
    pub stalled_unit_hours: f64,
    pub idle_unit_hours: f64,
    pub unused_billed_unit_hours: f64,
    /// Hours the job ran below full speed: runtime less the work at full capacity.
    pub waiting_hours: f64,
    pub evictions: f64,
}

impl Account {
    /// A simulated run's account; `capacity` is the job's units per hour at full speed.
    pub fn of_run(r: &RunResult, capacity: f64) -> Account {
        Account {
            cost_usd: r.cost_usd.get(),
            runtime_hours: r.runtime_hours,
            held_unit_hours: r.capacity_units,
            paid_unit_hours: r.paid_capacity_units,
            free_unit_hours: r.free_capacity_units,
            work: r.done_work,
            lost_work: r.lost_work,
            startup_unit_hours: r.overheads.startup,
            handover_unit_hours: r.overheads.warned,
            stalled_unit_hours: r.overheads.stalled,
            idle_unit_hours: r.overheads.idle,
            unused_billed_unit_hours: r.overheads.unused_billed,
            waiting_hours: (r.runtime_hours - r.done_work / capacity).max(0.0),
            evictions: f64::from(r.evictions),
        }
    }

    /// The optimum's account; it runs to `deadline_hours` at most.
    pub fn of_optimum(s: &ForesightSchedule, work: f64, capacity: f64, hours: f64) -> Account {
        Account {
            cost_usd: s.cost_usd,
            runtime_hours: hours,
            held_unit_hours: s.held_unit_hours,
            paid_unit_hours: s.paid_unit_hours,
            free_unit_hours: s.free_unit_hours,
            work,
            lost_work: 0.0,
            startup_unit_hours: s.startup_unit_hours,
            handover_unit_hours: s.handover_unit_hours,
            stalled_unit_hours: 0.0,
            idle_unit_hours: 0.0,
            unused_billed_unit_hours: s.unused_billed_unit_hours,
            waiting_hours: (hours - work / capacity).max(0.0),
            evictions: s.evictions,
        }
    }

    fn usd_per_paid_unit_hour(&self) -> f64 {
        if self.paid_unit_hours > 1e-9 {
            self.cost_usd / self.paid_unit_hours
        } else {
            0.0
        }
    }
}

/// Splits `p.cost − o.cost` (see the module's text). The parts sum to the gap exactly.
pub fn split(p: &Account, o: &Account) -> GapParts {
    let price_p = p.usd_per_paid_unit_hour();
    let price_o = o.usd_per_paid_unit_hour();
    let mut parts = GapParts {
        price: (price_p - price_o) * o.paid_unit_hours,
        free_hours: price_p * (o.free_unit_hours - p.free_unit_hours),
        lost_work: price_p * (p.lost_work - o.lost_work),
        startup: price_p * (p.startup_unit_hours - o.startup_unit_hours),
        handover: price_p * (p.handover_unit_hours - o.handover_unit_hours),
        stalled: price_p * (p.stalled_unit_hours - o.stalled_unit_hours),
        idle: price_p * (p.idle_unit_hours - o.idle_unit_hours),
        unused_billed: price_p * (p.unused_billed_unit_hours - o.unused_billed_unit_hours),
        other: 0.0,
    };
    // Work differs only if a run ended early; it and the residuals go to "other", with the
    // difference between paid and held − free + unused in each account.
    parts.other = (p.cost_usd - o.cost_usd) - parts.sum();
    parts
}

/// The decomposition over many starts: per start and summed.
#[derive(Debug, Clone, Serialize)]
pub struct GapReport {
    pub policy: String,
    pub starts: Vec<GapRow>,
    pub total: GapTotal,
}

#[derive(Debug, Clone, Serialize)]
pub struct GapRow {
    pub start: crate::market::Timestamp,
    pub policy: Account,
    pub optimum: Account,
    pub gap_usd: f64,
    pub parts: GapParts,
}

#[derive(Debug, Clone, Serialize)]
pub struct GapTotal {
    pub policy: Account,
    pub optimum: Account,
    pub gap_usd: f64,
    pub parts: GapParts,
    /// Each part's share of the gap.
    pub shares: GapParts,
}

/// The report of `policy` against the optimum over every start.
pub fn report(policy: &str, pairs: &[(crate::market::Timestamp, Account, Account)]) -> GapReport {
    let mut rows = Vec::with_capacity(pairs.len());
    let mut parts = GapParts::default();
    let mut p_sum = Account::default();
    let mut o_sum = Account::default();
    for (start, p, o) in pairs {
        let split = split(p, o);
        parts = parts.plus(&split);
        add(&mut p_sum, p);
        add(&mut o_sum, o);
        rows.push(GapRow {
            start: *start,
            policy: *p,
            optimum: *o,
            gap_usd: p.cost_usd - o.cost_usd,
            parts: split,
        });
    }
    let gap = p_sum.cost_usd - o_sum.cost_usd;
    let shares = GapParts::from_values(
        parts
            .values()
            .map(|v| if gap.abs() > 1e-12 { v / gap } else { 0.0 }),
    );
    GapReport {
        policy: policy.to_string(),
        starts: rows,
        total: GapTotal {
            policy: p_sum,
            optimum: o_sum,
            gap_usd: gap,
            parts,
            shares,
        },
    }
}

fn add(sum: &mut Account, a: &Account) {
    sum.cost_usd += a.cost_usd;
    sum.runtime_hours += a.runtime_hours;
    sum.held_unit_hours += a.held_unit_hours;
    sum.paid_unit_hours += a.paid_unit_hours;
    sum.free_unit_hours += a.free_unit_hours;
    sum.work += a.work;
    sum.lost_work += a.lost_work;
    sum.startup_unit_hours += a.startup_unit_hours;
    sum.handover_unit_hours += a.handover_unit_hours;
    sum.stalled_unit_hours += a.stalled_unit_hours;
    sum.idle_unit_hours += a.idle_unit_hours;
    sum.unused_billed_unit_hours += a.unused_billed_unit_hours;
    sum.waiting_hours += a.waiting_hours;
    sum.evictions += a.evictions;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(cost: f64, paid: f64, free: f64, lost: f64, startup: f64) -> Account {
        let work = 100.0;
        Account {
            cost_usd: cost,
            paid_unit_hours: paid,
            free_unit_hours: free,
            held_unit_hours: work + lost + startup,
            work,
            lost_work: lost,
            startup_unit_hours: startup,
            ..Account::default()
        }
    }

    #[test]
    fn the_parts_sum_to_the_gap_and_land_where_the_difference_is() {
        // The optimum: 60 paid unit-hours at $0.02, 45 free. The policy: 100 paid at $0.03,
        // 10 free, 5 units of work lost, 5 of start-up.
        let o = account(1.2, 60.0, 45.0, 0.0, 5.0);
        let p = account(3.0, 100.0, 10.0, 5.0, 5.0);
        let s = split(&p, &o);
        assert!((s.sum() - 1.8).abs() < 1e-12, "{s:?}");
        assert!(s.other.abs() < 1e-12, "{s:?}");
        // Price: $0.01 more on the optimum's 60 paid hours.
        assert!((s.price - 0.6).abs() < 1e-12);
        // 35 fewer free unit-hours and 5 lost, at the policy's $0.03.
        assert!((s.free_hours - 1.05).abs() < 1e-12);
        assert!((s.lost_work - 0.15).abs() < 1e-12);
        assert!(s.startup.abs() < 1e-12);
    }

    #[test]
    fn a_free_optimum_puts_the_whole_cost_in_quantities() {
        let o = account(0.0, 0.0, 105.0, 0.0, 5.0);
        let p = account(2.1, 105.0, 0.0, 0.0, 5.0);
        let s = split(&p, &o);
        assert!(s.price.abs() < 1e-12);
        assert!((s.free_hours - 2.1).abs() < 1e-12, "{s:?}");
        assert!(s.other.abs() < 1e-12, "{s:?}");
        let r = report("p", &[(crate::market::Timestamp::from_secs(0), p, o)]);
        assert!((r.total.shares.sum() - 1.0).abs() < 1e-12);
    }
}
