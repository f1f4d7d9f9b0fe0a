//! The hindsight optimum of a one-instance job with a deadline on availability traces of one or
//! several zones: the cheapest schedule that finishes in time *knowing the whole trace*. A lower
//! bound for every policy, not a policy (`proteus simulate --availability F … --optimal`).
//!
//! The schedule is chosen tick by tick (availability only changes at ticks). In each tick the
//! job is idle, on on-demand, or on spot in one zone (only while that zone has capacity).
//! Entering on-demand or spot costs the restart overhead before work resumes; an overhead longer
//! than a tick carries into the next, and leaving a mode forfeits what is left of its overhead.
//! Billing is today's:
//!
//! - every second on on-demand or spot is charged, the last tick only up to the second the work
//!   is done;
//! - a spot life that EC2 interrupts within its first hour is free. The optimum takes such a
//!   "free ride" whole: it launches at a tick whose zone's capacity ends within the hour, and it
//!   gets the work done between the end of the overhead and the interruption at no cost.
//!
//! Dynamic programming over (tick, mode, overhead still owed, progress), on the traces' own
//! ticks from the one holding the start. Progress is counted in quanta that divide both the tick
//! and the restart overhead (e.g. 24 s for 10-minute ticks and a 72-s overhead), so the overhead
//! is exact. What still favours the optimum, so that the figure stays a lower bound on what the
//! simulator charges any policy (which acts at any second, not only at ticks):
//!
//! - the start's tick and the deadline's tick count whole;
//! - every spot stint a drop ends gets the 2-minute notice's work on top, free;
//! - a ride is free when its interruption comes within an hour plus the notice plus one tick of
//!   the tick it entered (a policy entering late in that tick can still be inside the hour).
//!
//! An overhead no quantum up to a thousandth of a tick divides is rounded down to one (the figure
//! says so: [`Solution::overhead_rounded`]).

use crate::engine::NOTICE_SECS;

/// One case.
#[derive(Debug, Clone)]
pub struct OptimalCase<'a> {
    /// Capacity per tick from the tick holding the start on (0: no spot), one slice per zone;
    /// the zones' slices are of the same period.
    pub capacity: Vec<&'a [u32]>,
    /// How far into its tick the job starts, seconds (the deadline is that much further into
    /// the traces' ticks).
    pub offset_secs: f64,
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

/// The optimum and how exactly it was computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Solution {
    pub optimum: Optimum,
    /// Progress quanta per tick.
    pub quanta_per_tick: usize,
    /// The overhead was rounded down to whole quanta (no quantum divides it exactly).
    pub overhead_rounded: bool,
}

/// A spot life EC2 ends within this many seconds is free.
const FREE_SECS: f64 = crate::billing::FREE_INTERRUPTION_MS as f64 / 1000.0;

/// A ride of spot entered at a tick is free when its capacity ends fewer than this many ticks
/// later: an hour plus the notice, plus the tick itself (a policy may enter at its last second).
/// Generous on purpose: the figure must stay a bound.
fn free_ride_ticks(gap_secs: f64) -> usize {
    ((FREE_SECS + NOTICE_SECS) / gap_secs + 1e-9).floor() as usize + 2
}

/// Ticks from the one holding the start to the one holding the deadline, both counted whole.
fn window_ticks(case: &OptimalCase<'_>) -> usize {
    ((case.offset_secs + case.deadline_secs) / case.gap_secs - 1e-9)
        .ceil()
        .max(0.0) as usize
}

/// Largest number of quanta a tick is cut into.
const MAX_QUANTA_PER_TICK: usize = 1000;

/// Quanta per tick: the fewest that make the overhead (and, where one can, the notice) a whole
/// number of quanta. A notice that is not one is rounded up (the figure stays a bound).
fn quanta(gap_secs: f64, overhead_secs: f64) -> (usize, bool) {
    let whole = |secs: f64, k: usize| {
        let x = secs * k as f64 / gap_secs;
        (x - x.round()).abs() < 1e-6
    };
    let overhead_secs = overhead_secs.max(0.0);
    for wanted in [true, false] {
        if let Some(k) = (1..=MAX_QUANTA_PER_TICK)
            .find(|&k| whole(overhead_secs, k) && (!wanted || whole(NOTICE_SECS, k)))
        {
            return (k, false);
        }
    }
    (MAX_QUANTA_PER_TICK, true)
}

/// Solves one case. Cost O(ticks × progress quanta × zones).
pub fn optimum(case: &OptimalCase<'_>) -> Optimum {
    solve(case).optimum
}

/// [`optimum`], with how it was computed.
pub fn solve(case: &OptimalCase<'_>) -> Solution {
    let g = case.gap_secs;
    let (k, overhead_rounded) = quanta(g, case.overhead_secs);
    let q = g / k as f64;
    let done = |optimum| Solution {
        optimum,
        quanta_per_tick: k,
        overhead_rounded,
    };
    let need = (case.work_secs / q - 1e-9).ceil().max(0.0) as usize;
    if need == 0 {
        return done(Optimum::Cost(0.0));
    }
    let len = case.capacity.iter().map(|c| c.len()).min().unwrap_or(0);
    let ticks = window_ticks(case).min(len);
    let tick = k;
    let overhead = (case.overhead_secs / q + 1e-9).floor() as usize;
    // Overhead still owed at the start of a tick: 0, or what an overhead longer than a tick
    // leaves after 1, 2, … ticks.
    let owed_levels: Vec<usize> = std::iter::once(0)
        .chain(
            (1..)
                .map(|j| overhead.saturating_sub(j * tick))
                .take_while(|&w| w > 0),
        )
        .collect();
    let levels = owed_levels.len();
    let level_of = |w: usize| owed_levels.iter().position(|&x| x == w).unwrap_or(0);
    let zones = case.capacity.len();
    // Modes: 0 idle, 1 on-demand, 2.. spot in zone z.
    let modes = 2 + zones;
    let price = |mode: usize| -> f64 {
        let per_hour = if mode == 1 {
            case.on_demand_usd_per_hour
        } else {
            case.spot_usd_per_hour
        };
        per_hour * g / 3600.0
    };
    // State index: (progress, mode, owed level); idle has only level 0.
    let stride = modes * levels;
    let at = |p: usize, m: usize, l: usize| p * stride + m * levels + l;
    let mut now = vec![f64::INFINITY; need * stride];
    now[at(0, 0, 0)] = 0.0;
    let mut next = vec![f64::INFINITY; need * stride];
    let mut best = f64::INFINITY;
    // The first tick at or after t without capacity, per zone.
    let next_drop: Vec<Vec<usize>> = case
        .capacity
        .iter()
        .map(|cap| {
            let mut d = vec![len; len + 1];
            for t in (0..len).rev() {
                d[t] = if cap[t] == 0 { t } else { d[t + 1] };
            }
            d
        })
        .collect();
    let free_ticks = free_ride_ticks(g);
    // The notice's work, in quanta (rounded up: a bound), earned by a stint a drop ends.
    let notice = (NOTICE_SECS / q - 1e-9).ceil() as usize;
    // Whether zone z drops after tick t (has capacity at t, none at t + 1).
    let drops = |z: usize, t: usize| {
        case.capacity[z][t] > 0 && (t + 1 >= len || case.capacity[z][t + 1] == 0)
    };
    // Progress the notices can add on top of the ticks' (for the pruning below).
    let bonus = notice
        * (0..ticks)
            .filter(|&t| (0..zones).any(|z| drops(z, t)))
            .count();
    // Free rides land idle at a later tick: by tick, the cheapest cost per progress.
    let mut arrivals: std::collections::BTreeMap<usize, Vec<f64>> = Default::default();
    let mut per_mode = vec![f64::INFINITY; modes];
    // Ticks index several arrays (capacity and next drop per zone, arrivals): a range reads best.
    #[allow(clippy::needless_range_loop)]
    for t in 0..ticks {
        if let Some(landed) = arrivals.remove(&t) {
            for (p, c) in landed.into_iter().enumerate() {
                let i = at(p, 0, 0);
                if c < now[i] {
                    now[i] = c;
                }
            }
        }
        // Only progress that can still finish in time, and that t ticks can have made.
        let lo = need.saturating_sub((ticks - t) * tick + bonus);
        let hi = (t * tick + bonus).min(need - 1);
        let next_lo = need.saturating_sub((ticks - t - 1) * tick + bonus);
        let next_hi = ((t + 1) * tick + bonus).min(need - 1);
        if next_lo <= next_hi {
            next[next_lo * stride..(next_hi + 1) * stride].fill(f64::INFINITY);
        }
        let up: Vec<bool> = (0..zones).map(|z| case.capacity[z][t] > 0).collect();
        for p in lo..(hi + 1).max(lo) {
            // The cheapest way to be at p in each mode (any owed level), and the two best modes.
            let mut b1 = (f64::INFINITY, usize::MAX);
            let mut b2 = f64::INFINITY;
            for (m, slot) in per_mode.iter_mut().enumerate() {
                let c = (0..levels)
                    .map(|l| now[at(p, m, l)])
                    .fold(f64::INFINITY, f64::min);
                *slot = c;
                if c < b1.0 {
                    b2 = b1.0;
                    b1 = (c, m);
                } else if c < b2 {
                    b2 = c;
                }
            }
            if !b1.0.is_finite() {
                continue;
            }
            // Idle: stopping is free (what is left of an overhead is forfeited).
            let i = at(p, 0, 0);
            next[i] = next[i].min(b1.0);
            for y in 1..modes {
                if y >= 2 && !up[y - 2] {
                    continue;
                }
                let tick_cost = price(y);
                let dropping = y >= 2 && drops(y - 2, t);
                // Entering y from another mode: the whole overhead.
                let enter = if b1.1 == y { b2 } else { b1.0 };
                // Staying in y, with what it still owes.
                let stays = (0..levels).map(|l| (now[at(p, y, l)], owed_levels[l]));
                for (c, owed) in std::iter::once((enter, overhead)).chain(stays) {
                    if !c.is_finite() {
                        continue;
                    }
                    let paid = owed.min(tick);
                    let gain = tick - paid;
                    if p + gain >= need {
                        // Done inside this tick: billed to the second the work is done.
                        let used = paid + (need - p);
                        best = best.min(c + tick_cost * used as f64 / tick as f64);
                        continue;
                    }
                    // Spot that drops after this tick works through the notice, free.
                    let gain = if dropping {
                        gain + notice.saturating_sub(owed - paid)
                    } else {
                        gain
                    };
                    if p + gain >= need {
                        best = best.min(c + tick_cost);
                        continue;
                    }
                    let j = at(p + gain, y, level_of(owed - paid));
                    next[j] = next[j].min(c + tick_cost);
                }
                // A free ride: spot entered now in a zone whose capacity ends within the hour
                // (from spot in that zone too: a new instance in place of the one held).
                let ride_from = b1.0;
                if y >= 2 && ride_from.is_finite() {
                    let end = next_drop[y - 2][t];
                    if end < len && end - t < free_ticks && end <= ticks {
                        let gain = ((end - t) * tick + notice).saturating_sub(overhead);
                        if p + gain >= need {
                            best = best.min(ride_from);
                        } else {
                            let landed = arrivals
                                .entry(end)
                                .or_insert_with(|| vec![f64::INFINITY; need]);
                            if ride_from < landed[p + gain] {
                                landed[p + gain] = ride_from;
                            }
                        }
                    }
                }
            }
        }
        std::mem::swap(&mut now, &mut next);
    }
    if best.is_finite() {
        done(Optimum::Cost(best))
    } else {
        done(Optimum::Infeasible)
    }
}

/// A lower bound for an elastic job of `instances` instances (each doing its share of the
/// work, `case.work_secs` being the work at full width) on `case`'s zones. A relaxation, not a
/// schedule: every instance-tick is priced on its own, the cheapest first —
///
/// - free: an instance-tick on a capacity level that ends within the hour (+ the notice and a
///   tick): the simulator interrupts the newest instances first, so at most `cap(t) − min cap
///   over the next hour` instances alive at `t` can end in a free first hour; and the notice of
///   every instance a drop interrupts;
/// - paid spot: the rest of the zones' capacity;
/// - on-demand: the slots left, up to `instances` per tick —
///
/// and restart overheads are left out. So it is at or below what any policy pays.
pub fn elastic_bound(case: &OptimalCase<'_>, instances: u32) -> Optimum {
    let g = case.gap_secs;
    let n = instances.max(1) as f64;
    let need = case.work_secs * n / g;
    if need <= 0.0 {
        return Optimum::Cost(0.0);
    }
    let len = case.capacity.iter().map(|c| c.len()).min().unwrap_or(0);
    let ticks = window_ticks(case).min(len);
    let window = free_ride_ticks(g);
    let (mut free, mut paid, mut od) = (0.0, 0.0, 0.0);
    for t in 0..ticks {
        let mut f = 0.0;
        let mut p = 0.0;
        for cap in &case.capacity {
            let now = f64::from(cap[t]);
            let low = cap[t..(t + window).min(len)]
                .iter()
                .copied()
                .min()
                .map_or(0.0, f64::from);
            f += now - low.min(now);
            p += low.min(now);
        }
        let f = f.min(n);
        let p = p.min(n - f);
        // Instances a drop after this tick interrupts work through their notice.
        let dropped: f64 = case
            .capacity
            .iter()
            .map(|cap| f64::from(cap[t].saturating_sub(cap.get(t + 1).copied().unwrap_or(0))))
            .sum();
        free += f + dropped.min(n) * NOTICE_SECS / g;
        paid += p;
        od += n - f - p;
    }
    if need > free + paid + od + 1e-9 {
        return Optimum::Infeasible;
    }
    let tick = |per_hour: f64| per_hour * g / 3600.0;
    let on_spot = (need - free).clamp(0.0, paid);
    let on_od = (need - free - paid).max(0.0);
    Optimum::Cost(
        on_spot * tick(case.spot_usd_per_hour) + on_od * tick(case.on_demand_usd_per_hour),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case_in<'a>(
        zones: &[&'a [u32]],
        work_h: f64,
        deadline_h: f64,
        overhead_h: f64,
    ) -> OptimalCase<'a> {
        OptimalCase {
            capacity: zones.to_vec(),
            offset_secs: 0.0,
            gap_secs: 600.0,
            work_secs: work_h * 3600.0,
            deadline_secs: deadline_h * 3600.0,
            overhead_secs: overhead_h * 3600.0,
            spot_usd_per_hour: 1.0,
            on_demand_usd_per_hour: 3.0,
        }
    }

    fn case(capacity: &[u32], work_h: f64, deadline_h: f64, overhead_h: f64) -> OptimalCase<'_> {
        case_in(&[capacity], work_h, deadline_h, overhead_h)
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
        // Spot for 50 minutes, then none: 40 minutes of work and the 2-minute notice's are free
        // (interrupted within the hour), the other 78 minutes on on-demand with its start: 88
        // minutes at $3/h.
        let mut short = vec![1; 5];
        short.extend(vec![0; 55]);
        assert!((cost(optimum(&case(&short, 2.0, 8.0, 1.0 / 6.0))) - 4.4).abs() < 1e-9);
    }

    #[test]
    fn a_ride_of_a_whole_hour_of_ticks_is_free() {
        // Spot for exactly 60 minutes, then none. A policy that enters a little after the tick
        // is ended by EC2 inside its first hour: free in the simulator, so free here too, or the
        // figure is no bound. 52 minutes of work free (with the notice's), the other 68 on
        // on-demand with its start: 78 minutes at $3/h. (Rides of five ticks only would leave
        // 88 minutes: $4.40.)
        let hour: Vec<u32> = [vec![1; 6], vec![0; 54]].concat();
        assert!((cost(optimum(&case(&hour, 2.0, 8.0, 1.0 / 6.0))) - 3.9).abs() < 1e-9);
        // Seven ticks too: a policy entering in the tick's last minutes is inside the hour.
        let longer: Vec<u32> = [vec![1; 7], vec![0; 53]].concat();
        assert!((cost(optimum(&case(&longer, 2.0, 8.0, 1.0 / 6.0))) - 3.4).abs() < 1e-9);
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

    #[test]
    fn a_short_overhead_is_exact_and_the_last_tick_is_billed_to_the_second() {
        // 72 s on 10-minute ticks: 24-s quanta, not rounded to nothing.
        let always = vec![1; 60];
        let s = solve(&case(&always, 2.0, 5.0, 0.02));
        assert_eq!((s.quanta_per_tick, s.overhead_rounded), (25, false));
        // 2 h of work + 72 s, every second at $1/h.
        assert!((cost(s.optimum) - (2.0 + 0.02)).abs() < 1e-9, "{s:?}");
        // An overhead longer than a tick (12 min on 10): carried into the next tick.
        let s = solve(&case(&always, 2.0, 5.0, 0.2));
        assert_eq!(s.quanta_per_tick, 5);
        assert!((cost(s.optimum) - 2.2).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn a_start_inside_a_tick_counts_its_tick_and_its_deadlines_tick_whole() {
        // 2 h of work and a 10-minute start on on-demand need 13 ticks; a 2-h deadline from a
        // tick's start gives 12, from 5 minutes into one it touches 13.
        let none = vec![0; 60];
        assert_eq!(
            optimum(&case(&none, 2.0, 2.0, 1.0 / 6.0)),
            Optimum::Infeasible
        );
        let mut inside = case(&none, 2.0, 2.0, 1.0 / 6.0);
        inside.offset_secs = 300.0;
        assert!((cost(optimum(&inside)) - 6.5).abs() < 1e-9);
    }

    #[test]
    fn spot_a_drop_ends_works_through_the_notice() {
        // Spot for 2 h, then none, 3 h of work, no overhead: 50 minutes of paid spot, then a
        // free ride of the last 70 minutes and the notice's 2, then 58 minutes on on-demand.
        let a: Vec<u32> = [vec![1; 12], vec![0; 48]].concat();
        let got = cost(optimum(&case(&a, 3.0, 8.0, 0.0)));
        assert!(
            (got - (50.0 / 60.0 + 58.0 / 60.0 * 3.0)).abs() < 1e-9,
            "{got}"
        );
    }

    #[test]
    fn the_elastic_bound_prices_free_then_spot_then_on_demand_slots() {
        // Two instances, 1 h of work at full width (2 instance-hours) in 3 h. Zone a: capacity
        // 2 for 30 minutes then none (a free first hour for both); zone b: 1 for good.
        let a: Vec<u32> = [vec![2; 3], vec![0; 57]].concat();
        let b = vec![1u32; 60];
        let c = case_in(&[&a, &b], 1.0, 3.0, 0.1);
        // Free: 2 × 30 min and both notices (2 × 2 min); zone b is paid (it never drops): the
        // other 56 minutes at $1/h.
        let got = cost(elastic_bound(&c, 2));
        assert!((got - 56.0 / 60.0).abs() < 1e-9, "{got}");
        // Only zone b: 1 h of paid spot on one slot is not enough in 0.5 h; with 3 h, 1 slot
        // of spot for 2 h would do, so $2.
        let only_b = case_in(&[&b], 1.0, 3.0, 0.1);
        assert!((cost(elastic_bound(&only_b, 2)) - 2.0).abs() < 1e-9);
        // 1 h of work at full width in 30 minutes cannot be done.
        let short = case_in(&[&b], 1.0, 0.5, 0.1);
        assert_eq!(elastic_bound(&short, 2), Optimum::Infeasible);
        // One instance: never above the exact optimum.
        let one = case_in(&[&a, &b], 1.0, 3.0, 0.1);
        assert!(cost(elastic_bound(&one, 1)) <= cost(optimum(&one)) + 1e-9);
    }

    #[test]
    fn several_zones_let_the_optimum_move_where_spot_is_and_pay_the_move() {
        // Zone a: spot for 2 h, then none; zone b: none for 2 h, then spot. 4 h of work.
        let a: Vec<u32> = [vec![1; 12], vec![0; 48]].concat();
        let b: Vec<u32> = [vec![0; 12], vec![1; 48]].concat();
        let one = cost(optimum(&case_in(&[&a], 4.0, 6.0, 0.1)));
        let both = cost(optimum(&case_in(&[&a, &b], 4.0, 6.0, 0.1)));
        // Both zones, all spot: 2 h on a, then 2 h on b with a second 6-minute start costs
        // $4.20; better still, a's last 50 minutes are a free ride (left and entered again).
        assert!(both <= 4.2 + 1e-9, "{both}");
        // One zone: a, then on-demand at $3/h for what is left.
        assert!(both + 2.0 < one, "{both} vs {one}");
        // The order of the zones does not matter.
        let swapped = cost(optimum(&case_in(&[&b, &a], 4.0, 6.0, 0.1)));
        assert!((swapped - both).abs() < 1e-9);
    }
}
