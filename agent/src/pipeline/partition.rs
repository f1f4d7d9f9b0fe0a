//! Choosing a plan: which layers form each stage and how many workers replicate it, for every
//! worker count up to the job's (so that re-planning after a worker is lost is a lookup).
//!
//! **The cost model** (one, used both to choose and to predict). For layers `l` with forward
//! and backward times `F_l`, `B_l`, optimizer step `U_l`, output activation bytes `a_l` and
//! parameter bytes `w_l`, and a link of `B` bytes/s (both directions of a connection share it)
//! and latency `L`:
//!
//! - a stage of layers `i..j` on one worker takes `Σ F_l + Σ B_l + Σ U_l + H_ij` per minibatch
//!   (under 1F1B it steps after every minibatch), where `H_ij = h · 2 (a_{i−1} + a_j)` is the
//!   processor time of handling the activations and gradients it sends and receives, at `h`
//!   seconds per byte (0 unless calibrated: [`super::calibration`]);
//! - replicated on `r` workers, each replica runs its own minibatch and the replicas then sum
//!   their gradients with a bucketed ring all-reduce that overlaps the backward pass:
//!   `T(i..j, r) = (Σ F_l + max(Σ B_l, S) + Σ U_l + H_ij) / r` with `S = d · 2 (r − 1) Σ w_l / (B r) + 2 (r − 1) L`
//!   (each replica sends and receives `2 (r − 1) / r` of the weights in `2 (r − 1)` steps that
//!   each pay the latency; `d = 2` for two replicas, whose one connection carries both
//!   directions, else 1: a longer ring sends on one connection and receives on another);
//! - the link after layer `k` carries an activation and its gradient per minibatch: `2 a_k / B`;
//! - under 1F1B a stage admits at most `warm-up + 1` minibatches per replica before a backward
//!   pass returns, and a minibatch's round trip from stage `s` takes every later stage's compute
//!   plus, per link after it, an activation and a gradient at half the link and two latencies:
//!   [`round_trip_bound_secs`];
//! - a plan's time per minibatch is the largest of these ([`predicted_1f1b_secs`]).
//!
//! **The search** minimises exactly that prediction over every plan (split points and replica
//! counts), as long as there are few enough plans to enumerate (every job this agent trains has:
//! 8 layers on 4 workers is 120 plans); beyond that it falls back to PipeDream's dynamic
//! program over the same stage and link costs without the round-trip bound,
//! `A(j, m) = min over k < j, 1 ≤ r < m of max(A(k, m − r), T(k+1..j, r), 2 a_k / B)` with the
//! base case `A(j, m) = T(1..j, m)` (PAPERS.md §3), and predicts its plan with the full model.
//! Data parallelism on `M` workers is one stage of every layer replicated `M` times.

use super::profile::Profile;
use super::{Plan, StagePlan};

/// The link between two workers, as the cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second of a connection, both directions together (`f64::INFINITY`: no limit).
    pub bytes_per_sec: f64,
    /// One-way delay of a message, in seconds.
    pub latency_secs: f64,
}

impl Link {
    pub fn new(bytes_per_sec: f64, latency_secs: f64) -> Self {
        Link {
            bytes_per_sec,
            latency_secs: latency_secs.max(0.0),
        }
    }

    /// No limit and no latency.
    pub fn free() -> Self {
        Link::new(f64::INFINITY, 0.0)
    }

    /// Transmission time of `bytes` (without the latency).
    fn secs(&self, bytes: f64) -> f64 {
        if self.bytes_per_sec.is_infinite() {
            0.0
        } else {
            bytes / self.bytes_per_sec
        }
    }
}

/// Plans enumerated per worker count at most; beyond, the dynamic program.
const MAX_ENUMERATED_PLANS: u64 = 200_000;

#[derive(Debug, Clone, Copy)]
enum Choice {
    /// One stage of all layers so far, replicated on all workers.
    Whole,
    /// Layers `k..j` form the last stage, replicated `r` times; the first `k` layers use the
    /// other workers.
    Split { k: usize, r: usize },
}

/// The solved table: the best plan for each worker count.
#[derive(Debug, Clone)]
pub struct Partitioner {
    /// `exact[m]`: the best plan that uses exactly `m` workers (index 0 unused).
    exact: Vec<Plan>,
}

/// Prefix sums for O(1) stage costs.
struct Sums {
    f: Vec<f64>,
    b: Vec<f64>,
    u: Vec<f64>,
    w: Vec<f64>,
    a: Vec<f64>,
    /// Seconds per byte of a message a stage sends or receives.
    h: f64,
}

impl Sums {
    fn new(p: &Profile) -> Self {
        let prefix = |x: &dyn Fn(&super::profile::LayerProfile) -> f64| {
            let mut v = vec![0.0];
            for l in &p.layers {
                v.push(v.last().copied().unwrap_or(0.0) + x(l));
            }
            v
        };
        Sums {
            f: prefix(&|l| l.forward_secs),
            b: prefix(&|l| l.backward_secs),
            u: prefix(&|l| l.update_secs),
            w: prefix(&|l| l.param_bytes as f64),
            a: p.layers.iter().map(|l| l.activation_bytes as f64).collect(),
            h: p.message_secs_per_byte.max(0.0),
        }
    }

    fn compute(&self, k: usize, j: usize) -> f64 {
        self.f[j] - self.f[k] + self.b[j] - self.b[k] + self.u[j] - self.u[k] + self.handling(k, j)
    }

    /// `H_kj`: handling the activation and gradient across each boundary of layers `k..j`.
    fn handling(&self, k: usize, j: usize) -> f64 {
        let before = if k > 0 { self.a[k - 1] } else { 0.0 };
        let after = if j < self.a.len() { self.a[j - 1] } else { 0.0 };
        self.h * 2.0 * (before + after)
    }
}

/// `T(layers k..j, r)`: a stage's time per minibatch.
pub fn stage_secs(p: &Profile, link: Link, layers: std::ops::Range<usize>, r: usize) -> f64 {
    let s = Sums::new(p);
    stage_cost(&s, link, layers.start, layers.end, r)
}

fn stage_cost(s: &Sums, link: Link, k: usize, j: usize, r: usize) -> f64 {
    if r <= 1 {
        return s.compute(k, j);
    }
    let rf = r as f64;
    // Two replicas exchange over one connection (both directions on one link); a longer ring
    // sends over one connection and receives over another.
    let directions = if r == 2 { 2.0 } else { 1.0 };
    let sync = directions * 2.0 * (rf - 1.0) * link.secs(s.w[j] - s.w[k]) / rf
        + 2.0 * (rf - 1.0) * link.latency_secs;
    (s.f[j] - s.f[k] + (s.b[j] - s.b[k]).max(sync) + s.u[j] - s.u[k] + s.handling(k, j)) / rf
}

/// Time per minibatch the model predicts for data parallelism on `m` workers.
pub fn data_parallel_secs(p: &Profile, link: Link, m: usize) -> f64 {
    stage_secs(p, link, 0..p.layers.len(), m.max(1))
}

/// The slowest stage or link of `plan` (the dynamic program's objective).
pub fn plan_secs(p: &Profile, link: Link, stages: &[StagePlan]) -> f64 {
    let s = Sums::new(p);
    let mut worst: f64 = 0.0;
    for (i, st) in stages.iter().enumerate() {
        worst = worst.max(stage_cost(
            &s,
            link,
            st.layers.start,
            st.layers.end,
            st.replicas as usize,
        ));
        if i > 0 {
            worst = worst.max(2.0 * link.secs(s.a[st.layers.start - 1]));
        }
    }
    worst
}

/// The 1F1B round-trip bound on a plan's time per minibatch. Stage `s` admits at most
/// `warm-up + 1` minibatches per replica before it needs a backward pass back, and a minibatch's
/// round trip from stage `s` takes the compute of every later stage plus one activation and one
/// gradient transfer per link after it (each at half the link, which carries both directions at
/// once in steady state): `max over s of RT_s / (r_s (warm-up_s + 1))`. The recurrence above does
/// not see this; it binds when links, not stages, are the bottleneck.
pub fn round_trip_bound_secs(p: &Profile, link: Link, stages: &[StagePlan]) -> f64 {
    let s = Sums::new(p);
    let later = |i: usize| stages[i..].iter().map(|x| x.replicas).sum::<u32>();
    let mut worst: f64 = 0.0;
    for (i, st) in stages.iter().enumerate() {
        let mut rt = 0.0;
        for (j, t) in stages.iter().enumerate().skip(i) {
            rt += s.compute(t.layers.start, t.layers.end);
            if j > i {
                rt += 2.0 * 2.0 * link.secs(s.a[t.layers.start - 1]) + 2.0 * link.latency_secs;
            }
        }
        let inflight =
            f64::from(st.replicas) * (super::schedule::warmup(later(i), st.replicas) + 1) as f64;
        worst = worst.max(rt / inflight);
    }
    worst
}

/// The predicted time per minibatch of running `stages` under 1F1B: the slowest stage or link
/// or the round-trip bound, whichever is larger. This is what [`Partitioner::solve`] minimises.
pub fn predicted_1f1b_secs(p: &Profile, link: Link, stages: &[StagePlan]) -> f64 {
    plan_secs(p, link, stages).max(round_trip_bound_secs(p, link, stages))
}

impl Partitioner {
    /// The plan with the lowest [`predicted_1f1b_secs`] for each of 1..=`max_workers` workers
    /// (by enumeration; see the module's note for the fallback), its prediction as
    /// `predicted_secs`.
    pub fn solve(p: &Profile, link: Link, max_workers: usize) -> Partitioner {
        let recurrence = Partitioner::solve_recurrence(p, link, max_workers);
        let n = p.layers.len();
        let mut exact = vec![recurrence.exact[0].clone()];
        for m in 1..=max_workers.max(1) {
            let plan = if plan_count(n, m) <= MAX_ENUMERATED_PLANS {
                best_enumerated(p, link, m)
            } else {
                None
            };
            let plan = plan.unwrap_or_else(|| {
                let mut plan = recurrence.exact[m].clone();
                plan.predicted_secs = predicted_1f1b_secs(p, link, plan.stages());
                plan
            });
            exact.push(plan);
        }
        Partitioner { exact }
    }

    /// PipeDream's dynamic program on its own objective ([`plan_secs`], without the 1F1B
    /// round-trip bound), for 1..=`max_workers` workers; `predicted_secs` is that objective.
    // The recurrence reads as written in the paper with explicit indices.
    #[allow(clippy::needless_range_loop)]
    pub fn solve_recurrence(p: &Profile, link: Link, max_workers: usize) -> Partitioner {
        let n = p.layers.len();
        let big_m = max_workers.max(1);
        let s = Sums::new(p);
        // a[j][m] for j in 1..=n, m in 1..=M.
        let mut a = vec![vec![f64::INFINITY; big_m + 1]; n + 1];
        let mut choice = vec![vec![Choice::Whole; big_m + 1]; n + 1];
        for j in 1..=n {
            for m in 1..=big_m {
                let mut best = stage_cost(&s, link, 0, j, m);
                let mut pick = Choice::Whole;
                for k in 1..j {
                    let comm = 2.0 * link.secs(s.a[k - 1]);
                    for r in 1..m {
                        let v = a[k][m - r].max(stage_cost(&s, link, k, j, r)).max(comm);
                        if v < best {
                            best = v;
                            pick = Choice::Split { k, r };
                        }
                    }
                }
                a[j][m] = best;
                choice[j][m] = pick;
            }
        }
        let mut exact = vec![Plan::data_parallel(n.max(1), 1, 0.0)];
        for m in 1..=big_m {
            let mut stages = Vec::new();
            let (mut j, mut mm) = (n, m);
            while j > 0 {
                match choice[j][mm] {
                    Choice::Whole => {
                        stages.push(StagePlan {
                            layers: 0..j,
                            replicas: mm as u32,
                        });
                        j = 0;
                    }
                    Choice::Split { k, r } => {
                        stages.push(StagePlan {
                            layers: k..j,
                            replicas: r as u32,
                        });
                        j = k;
                        mm -= r;
                    }
                }
            }
            stages.reverse();
            // The table only builds well-formed plans; fall back to data parallelism if not.
            let plan = Plan::new(stages, n, a[n][m])
                .unwrap_or_else(|_| Plan::data_parallel(n, m as u32, a[n][m]));
            exact.push(plan);
        }
        Partitioner { exact }
    }

    /// The best plan using exactly `m` workers.
    pub fn exact(&self, m: usize) -> Option<&Plan> {
        self.exact.get(m).filter(|_| m > 0)
    }

    /// The best plan using at most `m` workers (replication does not always pay; the others
    /// idle).
    pub fn best(&self, m: usize) -> Option<&Plan> {
        (1..=m.min(self.exact.len().saturating_sub(1)))
            .filter_map(|k| self.exact(k))
            .min_by(|x, y| x.predicted_secs.total_cmp(&y.predicted_secs))
    }

    pub fn max_workers(&self) -> usize {
        self.exact.len().saturating_sub(1)
    }
}

fn binomial(n: u64, k: u64) -> u64 {
    if k > n {
        return 0;
    }
    (0..k).fold(1u64, |acc, i| acc.saturating_mul(n - i) / (i + 1))
}

/// Plans of `n` layers on exactly `m` workers: `Σ_s C(n − 1, s − 1) C(m − 1, s − 1)`.
fn plan_count(n: usize, m: usize) -> u64 {
    let (n, m) = (n as u64, m as u64);
    (1..=n.min(m)).fold(0u64, |acc, s| {
        acc.saturating_add(binomial(n - 1, s - 1).saturating_mul(binomial(m - 1, s - 1)))
    })
}

/// Every plan of `p`'s layers on exactly `m` workers, the one with the lowest prediction (on a
/// tie, the first found: fewer, longer leading stages).
fn best_enumerated(p: &Profile, link: Link, m: usize) -> Option<Plan> {
    fn go(
        p: &Profile,
        link: Link,
        start: usize,
        left: usize,
        acc: &mut Vec<StagePlan>,
        best: &mut Option<(f64, Vec<StagePlan>)>,
    ) {
        let n = p.layers.len();
        if start == n {
            if left == 0 {
                let v = predicted_1f1b_secs(p, link, acc);
                if best.as_ref().is_none_or(|(b, _)| v < *b) {
                    *best = Some((v, acc.clone()));
                }
            }
            return;
        }
        for end in (start + 1..=n).rev() {
            for r in (1..=left).rev() {
                acc.push(StagePlan {
                    layers: start..end,
                    replicas: r as u32,
                });
                go(p, link, end, left - r, acc, best);
                acc.pop();
            }
        }
    }
    let mut best = None;
    go(p, link, 0, m, &mut Vec::new(), &mut best);
    let (secs, stages) = best?;
    Plan::new(stages, p.layers.len(), secs).ok()
}

#[cfg(test)]
mod tests {
    use super::super::profile::LayerProfile;
    use super::*;
    use rand::{Rng, SeedableRng};

    type Cost = fn(&Profile, Link, &[StagePlan]) -> f64;

    /// Every split into consecutive stages and every replica assignment summing to `m`: the
    /// lowest `cost`, and how many plans there were.
    fn brute_with(p: &Profile, link: Link, m: usize, cost: Cost) -> (f64, u64) {
        fn go(
            p: &Profile,
            link: Link,
            start: usize,
            left: usize,
            acc: &mut Vec<StagePlan>,
            cost: Cost,
            count: &mut u64,
        ) -> f64 {
            let n = p.layers.len();
            if start == n {
                return if left == 0 {
                    *count += 1;
                    cost(p, link, acc)
                } else {
                    f64::INFINITY
                };
            }
            let mut best = f64::INFINITY;
            for end in start + 1..=n {
                for r in 1..=left {
                    acc.push(StagePlan {
                        layers: start..end,
                        replicas: r as u32,
                    });
                    best = best.min(go(p, link, end, left - r, acc, cost, count));
                    acc.pop();
                }
            }
            best
        }
        let mut count = 0;
        let best = go(p, link, 0, m, &mut Vec::new(), cost, &mut count);
        (best, count)
    }

    fn brute(p: &Profile, link: Link, m: usize) -> f64 {
        brute_with(p, link, m, plan_secs).0
    }

    fn random_profile(rng: &mut impl Rng, n: usize) -> Profile {
        Profile {
            batch: 32,
            layers: (0..n)
                .map(|_| LayerProfile {
                    forward_secs: rng.random_range(0.001..0.02),
                    backward_secs: rng.random_range(0.001..0.04),
                    update_secs: rng.random_range(0.0..0.005),
                    activation_bytes: rng.random_range(1_000..400_000),
                    param_bytes: rng.random_range(1_000..4_000_000),
                })
                .collect(),
            message_secs_per_byte: 0.0,
        }
    }

    #[test]
    fn the_search_minimises_the_prediction_and_never_loses_to_the_recurrence() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut strictly_better = 0;
        for case in 0..60 {
            let n = 1 + case % 6;
            let p = random_profile(&mut rng, n);
            let link = Link::new(
                [1e6, 2e7, 1e9, f64::INFINITY][case % 4],
                [0.0, 0.005][case % 2],
            );
            let part = Partitioner::solve(&p, link, 5);
            let rec = Partitioner::solve_recurrence(&p, link, 5);
            for m in 1..=5 {
                let plan = part.exact(m).unwrap();
                let (want, count) = brute_with(&p, link, m, predicted_1f1b_secs);
                assert_eq!(count, plan_count(n, m), "case {case}, {m} workers");
                assert!(
                    (plan.predicted_secs - want).abs() <= 1e-12 * want.max(1.0),
                    "case {case}, {m} workers: search {} vs brute {want}",
                    plan.predicted_secs
                );
                assert_eq!(plan.workers(), m as u32);
                assert!(
                    (predicted_1f1b_secs(&p, link, plan.stages()) - plan.predicted_secs).abs()
                        < 1e-12
                );
                let theirs = predicted_1f1b_secs(&p, link, rec.exact(m).unwrap().stages());
                assert!(plan.predicted_secs <= theirs + 1e-12);
                if plan.predicted_secs < theirs - 1e-9 {
                    strictly_better += 1;
                }
            }
        }
        // The round-trip bound matters: the recurrence, blind to it, sometimes picks worse.
        assert!(strictly_better > 0);
    }

    /// Four layers of 30 ms (10 forward, 20 backward) with 100 KB activations and 1 KB of
    /// parameters, and the plan of one layer per stage.
    fn four_equal_stages() -> (LayerProfile, Profile, Vec<StagePlan>) {
        let layer = LayerProfile {
            forward_secs: 0.01,
            backward_secs: 0.02,
            update_secs: 0.0,
            activation_bytes: 100_000,
            param_bytes: 1_000,
        };
        let p = Profile {
            batch: 64,
            layers: vec![layer; 4],
            message_secs_per_byte: 0.0,
        };
        let stages = (0..4)
            .map(|i| StagePlan {
                layers: i..i + 1,
                replicas: 1,
            })
            .collect();
        (layer, p, stages)
    }

    #[test]
    fn latency_slows_round_trips_and_all_reduces_but_not_a_links_throughput() {
        let (layer, p, stages) = four_equal_stages();
        let (fast, late) = (Link::new(1e7, 0.0), Link::new(1e7, 0.01));
        assert_eq!(plan_secs(&p, fast, &stages), plan_secs(&p, late, &stages));
        // Three links after stage 0, two latencies each, over 4 minibatches in flight.
        let extra =
            round_trip_bound_secs(&p, late, &stages) - round_trip_bound_secs(&p, fast, &stages);
        assert!((extra - 3.0 * 2.0 * 0.01 / 4.0).abs() < 1e-12, "{extra}");
        // Data parallelism on 4, F + max(B, S) over 4 minibatches: the all-reduce (60 ms) hides
        // under the backward pass (80 ms); 6 latencies (60 ms) more and it outlasts it.
        let p1 = Profile {
            batch: 64,
            layers: vec![
                LayerProfile {
                    param_bytes: 100_000,
                    ..layer
                };
                4
            ],
            message_secs_per_byte: 0.0,
        };
        let s_fast = 2.0 * 3.0 * 400_000.0 / 1e7 / 4.0;
        let want_fast = (0.04 + f64::max(0.08, s_fast)) / 4.0;
        assert!((data_parallel_secs(&p1, fast, 4) - want_fast).abs() < 1e-12);
        let want_late = (0.04 + f64::max(0.08, s_fast + 0.06)) / 4.0;
        assert!((data_parallel_secs(&p1, late, 4) - want_late).abs() < 1e-12);
        assert!(want_late > want_fast);
    }

    #[test]
    fn partitioner_equals_brute_force_on_small_cases() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for case in 0..60 {
            let n = 1 + case % 5;
            let p = random_profile(&mut rng, n);
            let link = Link::new([1e6, 2e7, 1e9, f64::INFINITY][case % 4], 0.0);
            let part = Partitioner::solve_recurrence(&p, link, 5);
            for m in 1..=5 {
                let plan = part.exact(m).unwrap();
                let want = brute(&p, link, m);
                assert!(
                    (plan.predicted_secs - want).abs() <= 1e-12 * want.max(1.0),
                    "case {case}, {m} workers: dp {} vs brute {want}",
                    plan.predicted_secs
                );
                // The reconstructed plan is what the table claims.
                assert_eq!(plan.workers(), m as u32);
                assert!((plan_secs(&p, link, plan.stages()) - plan.predicted_secs).abs() < 1e-12);
            }
            let best = part.best(5).unwrap().predicted_secs;
            let min = (1..=5)
                .map(|m| brute(&p, link, m))
                .fold(f64::INFINITY, f64::min);
            assert!((best - min).abs() < 1e-12);
        }
    }

    #[test]
    fn round_trip_bound_binds_only_when_links_dominate() {
        let (_, p, stages) = four_equal_stages();
        // Free links: four stages of 30 ms each, 4 in flight over a 120 ms round trip.
        let free = Link::free();
        assert!((round_trip_bound_secs(&p, free, &stages) - 0.03).abs() < 1e-12);
        assert!((predicted_1f1b_secs(&p, free, &stages) - 0.03).abs() < 1e-12);
        // 10 ms per transfer at 1e7 B/s: 2 a / B = 20 ms per link and minibatch (below the
        // stages), but the round trip gains 3 links × 40 ms: (120 + 120) / 4 = 60 ms.
        let slow = Link::new(1e7, 0.0);
        assert!((plan_secs(&p, slow, &stages) - 0.03).abs() < 1e-12);
        assert!((predicted_1f1b_secs(&p, slow, &stages) - 0.06).abs() < 1e-12);
    }

    #[test]
    fn slow_links_favour_pipelines_and_fast_links_data_parallelism() {
        let layer = |act: u64, params: u64| LayerProfile {
            forward_secs: 0.01,
            backward_secs: 0.02,
            update_secs: 0.0,
            activation_bytes: act,
            param_bytes: params,
        };
        let p = Profile {
            batch: 64,
            layers: vec![layer(100_000, 4_000_000); 4],
            message_secs_per_byte: 0.0,
        };
        let slow = Partitioner::solve(&p, Link::new(1e7, 0.0), 4);
        let plan = slow.exact(4).unwrap();
        assert_eq!(plan.stages().len(), 4, "{plan}");
        assert!(plan.predicted_secs < data_parallel_secs(&p, Link::new(1e7, 0.0), 4));
        let fast = Partitioner::solve(&p, Link::free(), 4);
        assert_eq!(fast.exact(4).unwrap().stages().len(), 1);
        assert!((fast.exact(4).unwrap().predicted_secs - 0.12 / 4.0).abs() < 1e-12);
    }
}
