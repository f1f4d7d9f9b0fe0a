//! The hindsight optimum of a one-instance job with a deadline on one zone's availability trace:
//! the cheapest schedule that finishes in time *knowing the whole trace*. A lower bound for
//! every policy, not a policy (`proteus simulate --availability F --optimal`).
//!
//! The schedule is chosen tick by tick (availability only changes at ticks). In each tick the
//! job is idle, on on-demand, or on spot (only while the zone has capacity). Entering on-demand
//! or spot costs the restart overhead before work resumes. Billing is today's:
//!
//! - every second on on-demand or spot is charged;
//! - a spot life that EC2 interrupts within its first hour is free. The optimum takes such a
//!   "free ride" whole: it launches at a tick whose capacity ends within the hour, and it gets
//!   the work done between the end of the overhead and the interruption at no cost.
//!
//! Dynamic programming over (tick, mode, progress). Progress is counted in quanta of a quarter
//! tick. Each rounding favours the optimum: overheads are rounded down, the deadline's last
//! partial tick counts whole, the 2-minute notice is worked through, and the last tick is billed
//! whole. So the figure stays a lower bound on what the simulator charges any policy.

/// One case.
#[derive(Debug, Clone)]
pub struct OptimalCase<'a> {
    /// Capacity per tick from the start's tick on (0: no spot).
    pub capacity: &'a [u32],
    pub gap_secs: f64,
    /// Work to do, seconds on one instance.
    pub work_secs: f64,
    pub deadline_secs: f64,
    pub overhead_secs: f64,
    pub spot_usd_per_hour: f64,
    pub on_demand_usd_per_hour: f64,
}

/// The optimum, or why there is none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimum {
    /// The cheapest schedule's cost, USD.
    Cost(f64),
    /// Not even on-demand from the start finishes in time.
    Infeasible,
}

const QUANTA_PER_TICK: usize = 4;
const IDLE: usize = 0;
const OD: usize = 1;
const SPOT: usize = 2;

/// Solves one case. Cost O(ticks × progress quanta).
pub fn optimum(case: &OptimalCase<'_>) -> Optimum {
    let g = case.gap_secs;
    let q = g / QUANTA_PER_TICK as f64;
    let need = (case.work_secs / q).ceil().max(0.0) as usize;
    if need == 0 {
        return Optimum::Cost(0.0);
    }
    let ticks = ((case.deadline_secs / g).ceil() as usize).min(case.capacity.len());
    let tick_gain = QUANTA_PER_TICK as i64;
    let overhead = (case.overhead_secs / q).floor() as i64;
    let spot_tick = case.spot_usd_per_hour * g / 3600.0;
    let od_tick = case.on_demand_usd_per_hour * g / 3600.0;
    // Progress is stored shifted by the overhead, so that a tick spent starting (progress
    // below where it began) stays representable; it never goes below the shift.
    let shift = overhead.max(0) as usize;
    let width = need + shift + 1;
    let idx = |p: i64| -> usize { (p + shift as i64).clamp(0, (need + shift) as i64) as usize };
    let done = need + shift;
    let mut now = vec![[f64::INFINITY; 3]; width];
    now[shift][IDLE] = 0.0;
    // Free rides end at a later tick: kept here until that tick comes.
    let mut arrivals: Vec<Vec<(usize, f64)>> = vec![Vec::new(); ticks + 1];
    let mut best = f64::INFINITY;
    // The first tick at or after t without capacity, for every t.
    let mut next_drop = vec![case.capacity.len(); case.capacity.len() + 1];
    for t in (0..case.capacity.len()).rev() {
        next_drop[t] = if case.capacity[t] == 0 {
            t
        } else {
            next_drop[t + 1]
        };
    }
    let free_ticks = (3600.0 / g).ceil() as usize;
    for t in 0..ticks {
        for &(p, c) in &arrivals[t] {
            if c < now[p][IDLE] {
                now[p][IDLE] = c;
            }
        }
        let mut next = vec![[f64::INFINITY; 3]; width];
        let spot_now = case.capacity[t] > 0;
        for (p, modes) in now.iter().enumerate() {
            for (m, &c) in modes.iter().enumerate() {
                if !c.is_finite() {
                    continue;
                }
                if p == done {
                    best = best.min(c);
                    continue;
                }
                let at = p as i64 - shift as i64;
                // Idle.
                let slot = &mut next[p][IDLE];
                *slot = slot.min(c);
                // On-demand.
                let gain = tick_gain - if m == OD { 0 } else { overhead };
                let to = idx(at + gain);
                next[to][OD] = next[to][OD].min(c + od_tick);
                if spot_now {
                    // Spot, paid by the second.
                    let gain = tick_gain - if m == SPOT { 0 } else { overhead };
                    let to = idx(at + gain);
                    next[to][SPOT] = next[to][SPOT].min(c + spot_tick);
                    // A free ride to an interruption within the hour.
                    let end = next_drop[t];
                    if m != SPOT && end < case.capacity.len() && end - t < free_ticks {
                        let gain = ((end - t) as i64 * tick_gain - overhead).max(0);
                        let to = idx(at.max(0) + gain);
                        if end <= ticks {
                            arrivals[end].push((to, c));
                        }
                    }
                }
            }
        }
        now = next;
    }
    for &(p, c) in &arrivals[ticks] {
        if c < now[p][IDLE] {
            now[p][IDLE] = c;
        }
    }
    for cell in &now[done] {
        best = best.min(*cell);
    }
    if best.is_finite() {
        Optimum::Cost(best)
    } else {
        Optimum::Infeasible
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(capacity: &[u32], work_h: f64, deadline_h: f64, overhead_h: f64) -> OptimalCase<'_> {
        OptimalCase {
            capacity,
            gap_secs: 600.0,
            work_secs: work_h * 3600.0,
            deadline_secs: deadline_h * 3600.0,
            overhead_secs: overhead_h * 3600.0,
            spot_usd_per_hour: 1.0,
            on_demand_usd_per_hour: 3.0,
        }
    }

    fn cost(o: Optimum) -> f64 {
        match o {
            Optimum::Cost(c) => c,
            Optimum::Infeasible => panic!("infeasible"),
        }
    }

    #[test]
    fn no_spot_means_on_demand_and_a_short_deadline_is_infeasible() {
        let none = vec![0; 60];
        // 2 h of work plus a 10 min start: 13 ticks of on-demand at $0.50.
        assert!((cost(optimum(&case(&none, 2.0, 5.0, 1.0 / 6.0))) - 6.5).abs() < 1e-9);
        assert_eq!(
            optimum(&case(&none, 2.0, 2.0, 1.0 / 6.0)),
            Optimum::Infeasible
        );
    }

    #[test]
    fn spot_that_lasts_is_paid_and_a_short_spot_window_is_a_free_ride() {
        let always = vec![1; 60];
        // Spot throughout: 2 h of work + 10 min start = 13 ticks at $1/h.
        assert!((cost(optimum(&case(&always, 2.0, 5.0, 1.0 / 6.0))) - 13.0 / 6.0).abs() < 1e-9);
        // Spot for 50 minutes, then none: the first 40 minutes of work are free (interrupted
        // within the hour), the remaining 80 minutes on-demand with its start: 9 ticks at $0.50.
        let mut short = vec![1; 5];
        short.extend(vec![0; 55]);
        assert!((cost(optimum(&case(&short, 2.0, 8.0, 1.0 / 6.0))) - 4.5).abs() < 1e-9);
    }

    #[test]
    fn waiting_for_spot_is_chosen_when_the_deadline_allows_it() {
        // No spot for 3 h, then spot: with a loose deadline the optimum waits.
        let mut late = vec![0; 18];
        late.extend(vec![1; 60]);
        let loose = cost(optimum(&case(&late, 2.0, 12.0, 1.0 / 6.0)));
        assert!((loose - 13.0 / 6.0).abs() < 1e-9, "{loose}");
        // With a tight deadline it must use on-demand for part of the work.
        let tight = cost(optimum(&case(&late, 2.0, 2.5, 1.0 / 6.0)));
        assert!(tight > loose && tight <= 6.5 + 1e-9, "{tight}");
    }
}
