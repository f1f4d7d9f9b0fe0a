//! PipeDream's partitioner: a dynamic program over split points and replica counts that
//! minimises the slowest stage's time per minibatch (PAPERS.md §3, as the open PipeDream code
//! writes it).
//!
//! For layers `l` with compute time `T_l` (forward + backward), output activation bytes `a_l` and
//! parameter bytes `w_l`, and link bandwidth `B` (bytes/s):
//!
//! - a stage of layers `i..j` replicated `r` times costs
//!   `T(i..j, r) = (Σ T_l + 4 (r − 1) Σ w_l / (B r)) / r` (compute plus the weight
//!   synchronisation of its replicas, amortised over the `r` minibatches it runs at once);
//! - `A(j, m) = min over k < j, 1 ≤ r < m of max(A(k, m − r), T(k+1..j, r), 2 a_k / B)`, with the
//!   base case `A(j, m) = T(1..j, m)` (one stage replicated on all `m` workers);
//! - data parallelism on `M` workers is the base case on all layers:
//!   `(T + 4 (M − 1) W / (B M)) / M`.
//!
//! The table gives the best plan for *every* worker count up to `N`, so re-planning after a
//! worker is lost is a lookup.

use super::profile::Profile;
use super::{Plan, StagePlan};

/// The partitioner's inputs besides the profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second of a link between two workers (`f64::INFINITY`: no limit).
    pub bytes_per_sec: f64,
}

impl Link {
    fn secs(&self, bytes: f64) -> f64 {
        if self.bytes_per_sec.is_infinite() {
            0.0
        } else {
            bytes / self.bytes_per_sec
        }
    }
}

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
    t: Vec<f64>,
    w: Vec<f64>,
    a: Vec<f64>,
}

impl Sums {
    fn new(p: &Profile) -> Self {
        let mut t = vec![0.0];
        let mut w = vec![0.0];
        for l in &p.layers {
            t.push(t.last().copied().unwrap_or(0.0) + l.compute_secs());
            w.push(w.last().copied().unwrap_or(0.0) + l.param_bytes as f64);
        }
        let a = p.layers.iter().map(|l| l.activation_bytes as f64).collect();
        Sums { t, w, a }
    }
}

/// `T(layers k..j, r)`: a stage's time per minibatch.
pub fn stage_secs(p: &Profile, link: Link, layers: std::ops::Range<usize>, r: usize) -> f64 {
    let s = Sums::new(p);
    stage_cost(&s, link, layers.start, layers.end, r)
}

fn stage_cost(s: &Sums, link: Link, k: usize, j: usize, r: usize) -> f64 {
    let r = r as f64;
    let compute = s.t[j] - s.t[k];
    let sync = 4.0 * (r - 1.0) * link.secs(s.w[j] - s.w[k]) / r;
    (compute + sync) / r
}

/// Time per minibatch the model predicts for data parallelism on `m` workers.
pub fn data_parallel_secs(p: &Profile, link: Link, m: usize) -> f64 {
    stage_secs(p, link, 0..p.layers.len(), m.max(1))
}

/// Time per minibatch the model predicts for `plan` (its slowest stage or link).
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
            rt += s.t[t.layers.end] - s.t[t.layers.start];
            if j > i {
                rt += 2.0 * 2.0 * link.secs(s.a[t.layers.start - 1]);
            }
        }
        let inflight =
            f64::from(st.replicas) * (super::schedule::warmup(later(i), st.replicas) + 1) as f64;
        worst = worst.max(rt / inflight);
    }
    worst
}

/// The predicted time per minibatch of running `stages` under 1F1B: the slowest stage or link
/// (the recurrence's objective) or the round-trip bound, whichever is larger.
pub fn predicted_1f1b_secs(p: &Profile, link: Link, stages: &[StagePlan]) -> f64 {
    plan_secs(p, link, stages).max(round_trip_bound_secs(p, link, stages))
}

impl Partitioner {
    /// Solve for 1..=`max_workers` workers.
    // The recurrence reads as written in the paper with explicit indices.
    #[allow(clippy::needless_range_loop)]
    pub fn solve(p: &Profile, link: Link, max_workers: usize) -> Partitioner {
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

#[cfg(test)]
mod tests {
    use super::super::profile::LayerProfile;
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every split into consecutive stages and every replica assignment summing to `m`.
    fn brute(p: &Profile, link: Link, m: usize) -> f64 {
        fn go(p: &Profile, link: Link, start: usize, left: usize, acc: &mut Vec<StagePlan>) -> f64 {
            let n = p.layers.len();
            if start == n {
                return if left == 0 {
                    plan_secs(p, link, acc)
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
                    best = best.min(go(p, link, end, left - r, acc));
                    acc.pop();
                }
            }
            best
        }
        go(p, link, 0, m, &mut Vec::new())
    }

    fn random_profile(rng: &mut impl Rng, n: usize) -> Profile {
        Profile {
            batch: 32,
            layers: (0..n)
                .map(|_| LayerProfile {
                    forward_secs: rng.random_range(0.001..0.02),
                    backward_secs: rng.random_range(0.001..0.04),
                    activation_bytes: rng.random_range(1_000..400_000),
                    param_bytes: rng.random_range(1_000..4_000_000),
                })
                .collect(),
        }
    }

    #[test]
    fn partitioner_equals_brute_force_on_small_cases() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for case in 0..60 {
            let n = 1 + case % 5;
            let p = random_profile(&mut rng, n);
            let link = Link {
                bytes_per_sec: [1e6, 2e7, 1e9, f64::INFINITY][case % 4],
            };
            let part = Partitioner::solve(&p, link, 5);
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
        let layer = LayerProfile {
            forward_secs: 0.01,
            backward_secs: 0.02,
            activation_bytes: 100_000,
            param_bytes: 1_000,
        };
        let p = Profile {
            batch: 64,
            layers: vec![layer; 4],
        };
        let stages: Vec<StagePlan> = (0..4)
            .map(|i| StagePlan {
                layers: i..i + 1,
                replicas: 1,
            })
            .collect();
        // Free links: four stages of 30 ms each, 4 in flight over a 120 ms round trip.
        let free = Link {
            bytes_per_sec: f64::INFINITY,
        };
        assert!((round_trip_bound_secs(&p, free, &stages) - 0.03).abs() < 1e-12);
        assert!((predicted_1f1b_secs(&p, free, &stages) - 0.03).abs() < 1e-12);
        // 10 ms per transfer at 1e7 B/s: 2 a / B = 20 ms per link and minibatch (below the
        // stages), but the round trip gains 3 links × 40 ms: (120 + 120) / 4 = 60 ms.
        let slow = Link { bytes_per_sec: 1e7 };
        assert!((plan_secs(&p, slow, &stages) - 0.03).abs() < 1e-12);
        assert!((predicted_1f1b_secs(&p, slow, &stages) - 0.06).abs() < 1e-12);
    }

    #[test]
    fn slow_links_favour_pipelines_and_fast_links_data_parallelism() {
        let layer = |act: u64, params: u64| LayerProfile {
            forward_secs: 0.01,
            backward_secs: 0.02,
            activation_bytes: act,
            param_bytes: params,
        };
        let p = Profile {
            batch: 64,
            layers: vec![layer(100_000, 4_000_000); 4],
        };
        let slow = Partitioner::solve(&p, Link { bytes_per_sec: 1e7 }, 4);
        let plan = slow.exact(4).unwrap();
        assert_eq!(plan.stages().len(), 4, "{plan}");
        assert!(plan.predicted_secs < data_parallel_secs(&p, Link { bytes_per_sec: 1e7 }, 4));
        let fast = Partitioner::solve(
            &p,
            Link {
                bytes_per_sec: f64::INFINITY,
            },
            4,
        );
        assert_eq!(fast.exact(4).unwrap().stages().len(), 1);
        assert!((fast.exact(4).unwrap().predicted_secs - 0.12 / 4.0).abs() < 1e-12);
    }
}
