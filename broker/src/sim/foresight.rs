//! The foresight optimum of the 2015 market: the cheapest way to do a job's work by a deadline
//! *knowing the whole price trace*, under the simulator's rules. A lower bound for every policy,
//! not a policy (`proteus simulate --job … --optimal`).
//!
//! The rules it keeps: `hourly-2015` billing (every started hour at the price at its start; the
//! partial hour free when the provider ends the instance), eviction at the first price change
//! above the bid, the job's start-up time before an instance works, no work during the
//! two-minute notice (AgileML hands over), and the job's capacity (`max_capacity`, units of work
//! per hour at once). Knowing the trace, a launch at time `t` in a market can be made to end
//! where the optimum wants: at any hour boundary (the user releases it; the bid is above every
//! price until then), or at any *record* after `t` — a price change above every price since `t`
//! (a bid just below it). An eviction within the first hour makes the whole life free.
//!
//! What it relaxes, each in its favour, so that the figure stays below what the simulator can
//! charge any policy: no work is lost to an eviction (no sync interval), membership changes do
//! not pause the job, the instance count limit is dropped (only the capacity binds), instances
//! are fractional (the linear-programming relaxation), and a replacement starts when its
//! predecessor is warned. Launches are on a one-minute grid and an allocation's end is moved
//! back to the grid minute at or before it for the next launch; that grid is the only rounding
//! against it (under a minute per allocation).
//!
//! How it is solved: per unit of capacity, a schedule is a chain of non-overlapping allocations
//! (one at a time per lane); with the same capacity at every moment, the interval constraints of
//! the relaxation are totally unimodular, so for a price `λ` on work the cheapest
//! `cost − λ·work` over the whole capacity is `capacity ×` that of the best single chain (a
//! dynamic programme over the grid). The optimum is the Lagrangian dual, maximised over `λ` by
//! bisection; the two chains either side of the optimal `λ`, mixed to do exactly the job's work,
//! give the schedule whose figures are reported (dollars, paid and free hours, start-ups).

use super::Scenario;
use super::world::MaxTree;
use crate::market::Timestamp;

const HOUR: f64 = 3600.0;

/// One spot market, as the optimum sees it.
#[derive(Debug, Clone, Copy)]
pub struct ForesightMarket<'a> {
    pub times: &'a [Timestamp],
    pub prices: &'a [f64],
    pub tree: &'a MaxTree,
    /// The job's units of work per instance-hour on this market's type.
    pub units_per_instance: f64,
}

/// One case: a job from `start`, to be done by `deadline`.
#[derive(Debug, Clone)]
pub struct ForesightCase<'a> {
    pub markets: Vec<ForesightMarket<'a>>,
    /// The cheapest on-demand price per unit of work over the job's types, USD per unit-hour.
    pub on_demand_usd_per_unit_hour: f64,
    pub start: Timestamp,
    pub deadline: Timestamp,
    /// Units of work to do.
    pub work: f64,
    /// Units of work per hour the job may run at, at most.
    pub capacity: f64,
    pub startup_secs: f64,
    pub notice_secs: f64,
    /// The launch grid, seconds (60 by default).
    pub grid_secs: f64,
}

/// The optimum's schedule, in the units the simulator reports (capacity is units of work per
/// hour; `…_unit_hours` are units × hours of capacity).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ForesightSchedule {
    pub cost_usd: f64,
    /// Capacity held from launch to termination.
    pub held_unit_hours: f64,
    /// Capacity inside charged hours (a charged partial hour in full).
    pub paid_unit_hours: f64,
    /// Capacity inside free partial hours.
    pub free_unit_hours: f64,
    /// Capacity spent starting up.
    pub startup_unit_hours: f64,
    /// Capacity in the two-minute notices (hand-over).
    pub handover_unit_hours: f64,
    /// Capacity charged after the work was done (the last hour's remainder).
    pub unused_billed_unit_hours: f64,
    /// Allocations ended by the provider, in instances of one unit per hour.
    pub evictions: f64,
    /// Allocations, in instances of one unit per hour.
    pub launches: f64,
    /// The Lagrangian bound: no schedule under these rules costs less.
    pub lower_bound_usd: f64,
}

/// The optimum, or why there is none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Foresight {
    Schedule(ForesightSchedule),
    /// Not even holding the whole capacity from the start does the work by the deadline.
    Infeasible,
}

/// One allocation a lane can hold, from grid index `from` to grid index `to`.
#[derive(Debug, Clone, Copy)]
struct Ride {
    from: u32,
    to: u32,
    cost: f64,
    /// Useful hours (per lane of one unit per hour: units of work).
    work: f64,
    held: f64,
    paid: f64,
    free: f64,
    startup: f64,
    handover: f64,
    unused: f64,
    eviction: bool,
}

/// A chain's totals.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    cost: f64,
    work: f64,
    held: f64,
    paid: f64,
    free: f64,
    startup: f64,
    handover: f64,
    unused: f64,
    evictions: f64,
    launches: f64,
}

impl Totals {
    fn plus(mut self, r: &Ride) -> Totals {
        self.cost += r.cost;
        self.work += r.work;
        self.held += r.held;
        self.paid += r.paid;
        self.free += r.free;
        self.startup += r.startup;
        self.handover += r.handover;
        self.unused += r.unused;
        self.evictions += f64::from(u8::from(r.eviction));
        self.launches += 1.0;
        self
    }

    fn mix(a: &Totals, b: &Totals, theta: f64) -> Totals {
        let m = |x: f64, y: f64| theta * x + (1.0 - theta) * y;
        Totals {
            cost: m(a.cost, b.cost),
            work: m(a.work, b.work),
            held: m(a.held, b.held),
            paid: m(a.paid, b.paid),
            free: m(a.free, b.free),
            startup: m(a.startup, b.startup),
            handover: m(a.handover, b.handover),
            unused: m(a.unused, b.unused),
            evictions: m(a.evictions, b.evictions),
            launches: m(a.launches, b.launches),
        }
    }
}

/// Solves one case.
pub fn foresight(case: &ForesightCase<'_>) -> Foresight {
    let target = case.work / case.capacity;
    if target <= 0.0 {
        return Foresight::Schedule(ForesightSchedule {
            cost_usd: 0.0,
            held_unit_hours: 0.0,
            paid_unit_hours: 0.0,
            free_unit_hours: 0.0,
            startup_unit_hours: 0.0,
            handover_unit_hours: 0.0,
            unused_billed_unit_hours: 0.0,
            evictions: 0.0,
            launches: 0.0,
            lower_bound_usd: 0.0,
        });
    }
    let rides = rides(case);
    let slots = grid_len(case);
    let best = |lambda: f64| best_chain(&rides, slots, lambda);
    // The most work a lane can do: with work priced far above any cost.
    let hi_lambda = 1e4;
    let most = best(hi_lambda);
    if most.work + 1e-9 < target {
        return Foresight::Infeasible;
    }
    let (mut lo, mut hi) = (0.0_f64, hi_lambda);
    let mut chain_lo = best(lo);
    let mut chain_hi = most;
    let mut bound = f64::NEG_INFINITY;
    let dual = |lambda: f64, t: &Totals| lambda * target + (t.cost - lambda * t.work);
    if chain_lo.work >= target {
        chain_hi = chain_lo;
    } else {
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            let c = best(mid);
            bound = bound.max(dual(mid, &c));
            if c.work >= target {
                hi = mid;
                chain_hi = c;
            } else {
                lo = mid;
                chain_lo = c;
            }
            if hi - lo < 1e-9 {
                break;
            }
        }
    }
    let t = if chain_hi.work > target && chain_lo.work >= target {
        // The cheapest chain already does more than the work (free rides to spare): run it on
        // only the share of the capacity the work needs.
        Totals::mix(&chain_hi, &Totals::default(), target / chain_hi.work)
    } else {
        let theta = if chain_hi.work - chain_lo.work > 1e-12 {
            ((target - chain_lo.work) / (chain_hi.work - chain_lo.work)).clamp(0.0, 1.0)
        } else {
            1.0
        };
        Totals::mix(&chain_hi, &chain_lo, theta)
    };
    let scale = case.capacity;
    Foresight::Schedule(ForesightSchedule {
        cost_usd: t.cost * scale,
        held_unit_hours: t.held * scale,
        paid_unit_hours: t.paid * scale,
        free_unit_hours: t.free * scale,
        startup_unit_hours: t.startup * scale,
        handover_unit_hours: t.handover * scale,
        unused_billed_unit_hours: t.unused * scale,
        evictions: t.evictions * scale,
        launches: t.launches * scale,
        lower_bound_usd: bound.max(0.0).min(t.cost) * scale,
    })
}

impl Scenario {
    /// The foresight optimum of the scenario's job from `start`, done by `deadline`: every
    /// spot market of the job's types, the cheapest on-demand type, the job's capacity
    /// (`max_capacity`, else its full speed), start-up and the provider's notice.
    pub fn foresight(&self, start: Timestamp, deadline: Timestamp) -> Foresight {
        let history = self.history();
        let mut markets = Vec::new();
        let mut on_demand = f64::INFINITY;
        for series in history.series() {
            let Some(rate) = self.job.rate(&series.market().instance_type) else {
                continue;
            };
            if rate <= 0.0 {
                continue;
            }
            if let Some(offer) = history.on_demand().for_market(series.market()) {
                on_demand = on_demand.min(offer.on_demand.get() / rate);
            }
            if let Some(tree) = self.trees.get(series.market()) {
                markets.push(ForesightMarket {
                    times: series.times(),
                    prices: series.prices(),
                    tree,
                    units_per_instance: rate,
                });
            }
        }
        foresight(&ForesightCase {
            markets,
            on_demand_usd_per_unit_hour: on_demand,
            start,
            deadline,
            work: self.job.total_work,
            capacity: self
                .job
                .max_capacity
                .unwrap_or_else(|| self.job.full_speed()),
            startup_secs: self.job.startup_secs,
            notice_secs: self.warning_secs,
            grid_secs: 60.0,
        })
    }
}

fn grid_len(case: &ForesightCase<'_>) -> usize {
    (case.deadline.secs_since(case.start) / case.grid_secs)
        .floor()
        .max(0.0) as usize
}

/// The best chain of rides for work priced at `lambda`: minimum `cost − lambda × work`, ties to
/// more work.
fn best_chain(rides: &[Ride], slots: usize, lambda: f64) -> Totals {
    let mut value = vec![0.0_f64; slots + 1];
    let mut totals = vec![Totals::default(); slots + 1];
    let better = |v: f64, w: f64, cur_v: f64, cur_w: f64| {
        v < cur_v - 1e-12 || (v <= cur_v + 1e-12 && w > cur_w)
    };
    let mut next = 0;
    for a in 0..=slots {
        if a > 0 && better(value[a - 1], totals[a - 1].work, value[a], totals[a].work) {
            value[a] = value[a - 1];
            totals[a] = totals[a - 1];
        }
        while next < rides.len() && rides[next].from as usize == a {
            let r = &rides[next];
            next += 1;
            let to = r.to as usize;
            let v = value[a] + r.cost - lambda * r.work;
            let w = totals[a].work + r.work;
            if better(v, w, value[to], totals[to].work) {
                value[to] = v;
                totals[to] = totals[a].plus(r);
            }
        }
    }
    totals[slots]
}

/// Every allocation worth considering, sorted by launch slot.
fn rides(case: &ForesightCase<'_>) -> Vec<Ride> {
    let slots = grid_len(case);
    let g = case.grid_secs;
    let horizon = case.deadline.secs_since(case.start);
    let mut out = Vec::new();
    for a in 0..slots {
        let t = a as f64 * g;
        let launch = case.start.plus_secs(t);
        let left = horizon - t;
        let hours = (left / HOUR).ceil() as usize;
        // Per market: the price of each started hour per unit of work, summed.
        let mut paid_hours: Vec<Vec<f64>> = Vec::with_capacity(case.markets.len());
        // User-ended: the cheapest k started hours over every market and on-demand.
        let mut cheapest = vec![f64::INFINITY; hours + 1];
        for (k, c) in cheapest.iter_mut().enumerate() {
            *c = case.on_demand_usd_per_unit_hour * k as f64;
        }
        for m in &case.markets {
            let mut sums = Vec::with_capacity(hours + 1);
            sums.push(0.0);
            let mut known = true;
            for h in 0..hours {
                let at = launch.plus_secs(h as f64 * HOUR);
                let i = m.times.partition_point(|&x| x <= at);
                if i == 0 {
                    known = false;
                    break;
                }
                let s = sums[h] + m.prices[i - 1] / m.units_per_instance;
                sums.push(s);
            }
            if known {
                for (c, s) in cheapest.iter_mut().zip(&sums) {
                    *c = c.min(*s);
                }
            }
            paid_hours.push(if known { sums } else { Vec::new() });
        }
        for (k, &cost) in cheapest.iter().enumerate().skip(1) {
            let life = (k as f64 * HOUR).min(left);
            let work = (life - case.startup_secs) / HOUR;
            if work <= 0.0 || !cost.is_finite() {
                continue;
            }
            out.push(Ride {
                from: a as u32,
                to: ((t + life) / g).floor() as u32,
                cost,
                work,
                held: life / HOUR,
                paid: k as f64,
                free: 0.0,
                startup: case.startup_secs / HOUR,
                handover: 0.0,
                unused: k as f64 - life / HOUR,
                eviction: false,
            });
        }
        // Provider-ended: at each record after the launch, before the deadline.
        for (m, sums) in case.markets.iter().zip(&paid_hours) {
            if sums.is_empty() {
                continue;
            }
            let mut from = m.times.partition_point(|&x| x <= launch);
            let mut max = m.prices[from - 1];
            while let Some(j) = m.tree.first_above(from, max) {
                let warned = m.times[j];
                let worked = warned.secs_since(launch);
                if worked >= left {
                    break;
                }
                max = m.prices[j];
                from = j + 1;
                let work = (worked - case.startup_secs) / HOUR;
                if work <= 0.0 {
                    continue;
                }
                let life = worked + case.notice_secs;
                let charged = ((life / HOUR).floor() as usize).min(sums.len() - 1);
                out.push(Ride {
                    from: a as u32,
                    to: ((t + worked) / g).floor() as u32,
                    cost: sums[charged],
                    work,
                    held: life / HOUR,
                    paid: charged as f64,
                    free: life / HOUR - charged as f64,
                    startup: case.startup_secs / HOUR,
                    handover: case.notice_secs / HOUR,
                    unused: 0.0,
                    eviction: true,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_000_000;

    fn at(mins: f64) -> Timestamp {
        Timestamp::from_secs(T0).plus_secs(mins * 60.0)
    }

    struct Trace {
        times: Vec<Timestamp>,
        prices: Vec<f64>,
        tree: MaxTree,
    }

    fn trace(points: &[(f64, f64)]) -> Trace {
        let times: Vec<Timestamp> = points.iter().map(|(m, _)| at(*m)).collect();
        let prices: Vec<f64> = points.iter().map(|(_, p)| *p).collect();
        let tree = MaxTree::new(&prices);
        Trace {
            times,
            prices,
            tree,
        }
    }

    fn case<'a>(t: &'a Trace, work: f64, deadline_mins: f64) -> ForesightCase<'a> {
        ForesightCase {
            markets: vec![ForesightMarket {
                times: &t.times,
                prices: &t.prices,
                tree: &t.tree,
                units_per_instance: 1.0,
            }],
            on_demand_usd_per_unit_hour: 1.0,
            start: at(0.0),
            deadline: at(deadline_mins),
            work,
            capacity: 1.0,
            startup_secs: 300.0,
            notice_secs: 120.0,
            grid_secs: 60.0,
        }
    }

    fn schedule(f: Foresight) -> ForesightSchedule {
        match f {
            Foresight::Schedule(s) => s,
            Foresight::Infeasible => panic!("infeasible"),
        }
    }

    #[test]
    fn a_flat_market_is_paid_by_the_hour_with_one_start_up() {
        // $0.10 throughout: 2 h 55 min of work by 3 h leaves one way, one instance from the
        // start for three started hours at $0.10; one start-up.
        let t = trace(&[(-10.0, 0.1)]);
        let s = schedule(foresight(&case(&t, 2.0 + 55.0 / 60.0, 180.0)));
        assert!((s.cost_usd - 0.3).abs() < 1e-9, "{s:?}");
        assert!((s.startup_unit_hours - 300.0 / 3600.0).abs() < 1e-9);
        assert!(s.free_unit_hours.abs() < 1e-12);
        assert!((s.launches - 1.0).abs() < 1e-9);
        assert!(s.lower_bound_usd <= s.cost_usd + 1e-9);
    }

    #[test]
    fn rises_within_the_hour_give_free_rides() {
        // The price rises to a new record every 50 minutes: launched just after each rise, an
        // allocation can be evicted by the next one before its hour is up, so every 45 minutes
        // of work (50 minus the start-up) are free.
        let mut points = vec![(-10.0, 0.1)];
        for i in 1..20 {
            points.push((f64::from(i) * 50.0, 0.1 + 0.01 * f64::from(i)));
        }
        let t = trace(&points);
        // 3 h of work by 16 h: four free rides of 45 minutes.
        let s = schedule(foresight(&case(&t, 3.0, 960.0)));
        assert!(s.cost_usd.abs() < 1e-9, "{s:?}");
        assert!(s.evictions >= 4.0 - 1e-9, "{s:?}");
        assert!((s.free_unit_hours - s.held_unit_hours).abs() < 1e-9);
        // Free rides to spare: the schedule does the work, not every free ride there is.
        let work = s.held_unit_hours - s.startup_unit_hours - s.handover_unit_hours;
        assert!((work - 3.0).abs() < 1e-9, "{s:?}");
        // The same work by 3 h 10 min leaves no room to wait: it pays.
        let tight = schedule(foresight(&case(&t, 3.0, 190.0)));
        assert!(tight.cost_usd > 0.0, "{tight:?}");
    }

    #[test]
    fn more_work_than_the_deadline_holds_is_infeasible() {
        let t = trace(&[(-10.0, 0.1)]);
        assert_eq!(foresight(&case(&t, 2.0, 120.0)), Foresight::Infeasible);
    }

    #[test]
    fn the_lp_mixes_two_chains_to_do_exactly_the_work() {
        // Capacity 10 units/h, 15 units by 2 h: one flat market at $0.10/unit-h.
        let t = trace(&[(-10.0, 0.1)]);
        let mut c = case(&t, 15.0, 120.0);
        c.capacity = 10.0;
        let s = schedule(foresight(&c));
        // Each lane needs 1.5 h of work. The cheapest per unit of work is a lane held to the
        // deadline (1 h 55 min of work for two hours at $0.10), so the relaxation runs such
        // lanes on 1.5 / (115 / 60) of the capacity and none on the rest: a lane of one hour
        // (55 minutes for $0.10) is dearer per unit.
        let share = 1.5 / (115.0 / 60.0);
        assert!((s.cost_usd - 10.0 * 0.2 * share).abs() < 1e-6, "{s:?}");
        assert!(
            (s.held_unit_hours - 10.0 * 2.0 * share).abs() < 1e-6,
            "{s:?}"
        );
    }
}
