//! The order in which a stage replica runs forward and backward passes: pure functions.
//!
//! - **1F1B** (PipeDream): admit `warm-up` forward passes, then alternate one forward and one
//!   backward, then drain the backwards. The optimizer steps after every backward pass.
//! - **Flushing** (GPipe): run the forward passes of a group of minibatches, then their backward
//!   passes, then one optimizer step with the group's summed gradients; the pipeline drains at
//!   every group, so every forward pass of a group sees the same weights and training equals
//!   single-process SGD on the group's samples.
//! - **2BW** (PipeDream-2BW, Narayanan et al., ICML 2021): 1F1B's order, but the optimizer steps
//!   once per group of minibatches with their accumulated gradients. With a group of at least
//!   `(warm-up + 1) × replicas` minibatches at every stage, the minibatches in flight when a step
//!   lands all ran on the version before it, so a stage holds two weight versions at most (the
//!   double buffer) instead of 1F1B's warm-up + 1, and nothing flushes.

/// One step of a stage replica's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Forward(u64),
    Backward(u64),
    /// Flushing and 2BW: the optimizer step of a group (after this replica's last backward of
    /// it).
    Flush {
        group: u64,
    },
    /// 1F1B only: take part in the replicas' last step with no minibatch of one's own (a replica
    /// with one minibatch fewer than its peers when the count does not divide evenly).
    Sync,
}

/// Which schedule a pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// PipeDream's 1F1B with weight stashing.
    OneFOneB,
    /// GPipe-style: groups of `group` minibatches, a flush after each.
    Flushing { group: u64 },
    /// PipeDream-2BW: 1F1B order, one optimizer step per group of `group` minibatches (across
    /// the stage's replicas), two weight versions per stage (see [`two_bw_group`]; a run raises
    /// the group to that minimum on a plan that needs more, as one grown by a join may).
    TwoBW { group: u64 },
}

/// The smallest 2BW group under which no stage of `plan` ever holds more than two weight
/// versions: every stage's `(warm-up + 1) × replicas`, at its largest.
pub fn two_bw_group(plan: &super::Plan) -> u64 {
    (0..plan.stages().len())
        .map(|s| {
            let r = plan.stages()[s].replicas;
            (warmup(plan.workers_from(s), r) as u64 + 1) * u64::from(r)
        })
        .max()
        .unwrap_or(1)
}

/// PipeDream's warm-up: `(workers in this and later stages − 1) / replicas of this stage`.
pub fn warmup(workers_here_and_later: u32, replicas: u32) -> usize {
    (workers_here_and_later.saturating_sub(1) / replicas.max(1)) as usize
}

/// The minibatches replica `replica` of a stage with `replicas` replicas runs, in order:
/// round-robin, so minibatch `m` goes to replica `m % replicas` at every stage and its backward
/// pass runs where its forward pass ran.
pub fn local_minibatches(total: u64, replicas: u32, replica: u32) -> Vec<u64> {
    (u64::from(replica)..total)
        .step_by(replicas.max(1) as usize)
        .collect()
}

/// 1F1B over `minibatches` (in order) with `warmup` forward passes admitted first.
pub fn one_f_one_b(minibatches: &[u64], warmup: usize) -> Vec<Op> {
    let n = minibatches.len();
    let w = warmup.min(n);
    let mut ops = Vec::with_capacity(2 * n);
    ops.extend(minibatches[..w].iter().map(|&m| Op::Forward(m)));
    for i in w..n {
        ops.push(Op::Forward(minibatches[i]));
        ops.push(Op::Backward(minibatches[i - w]));
    }
    ops.extend(minibatches[n - w..].iter().map(|&m| Op::Backward(m)));
    ops
}

/// Flushing over `minibatches`, grouped by `m / group`; every group ends with a flush, including
/// groups in which this replica has no minibatch (replicas must take the same steps).
pub fn flushing(minibatches: &[u64], group: u64, total: u64) -> Vec<Op> {
    let group = group.max(1);
    let groups = total.div_ceil(group);
    let mut ops = Vec::new();
    for g in 0..groups {
        let mine: Vec<u64> = minibatches
            .iter()
            .copied()
            .filter(|m| m / group == g)
            .collect();
        ops.extend(mine.iter().map(|&m| Op::Forward(m)));
        ops.extend(mine.iter().map(|&m| Op::Backward(m)));
        ops.push(Op::Flush { group: g });
    }
    ops
}

/// 2BW over `minibatches`: [`one_f_one_b`]'s order with the optimizer step of each group of
/// `group` minibatches (by `m / group`) after this replica's last backward pass in it; a group in
/// which this replica has no minibatch (the last, when `total` is not a multiple) still gets
/// its step, at the end, so that replicas take the same steps.
pub fn two_bw(minibatches: &[u64], warmup: usize, group: u64, total: u64) -> Vec<Op> {
    let group = group.max(1);
    let last_in = |g: u64| minibatches.iter().rev().find(|&&m| m / group == g).copied();
    let mut ops = Vec::with_capacity(2 * minibatches.len() + total.div_ceil(group) as usize);
    let mut stepped = 0;
    for op in one_f_one_b(minibatches, warmup) {
        ops.push(op);
        if let Op::Backward(m) = op
            && last_in(m / group) == Some(m)
        {
            ops.push(Op::Flush { group: m / group });
            stepped = m / group + 1;
        }
    }
    ops.extend((stepped..total.div_ceil(group)).map(|group| Op::Flush { group }));
    ops
}

/// The schedule of one replica.
pub fn ops(
    kind: ScheduleKind,
    total: u64,
    replicas: u32,
    replica: u32,
    workers_here_and_later: u32,
) -> Vec<Op> {
    let mine = local_minibatches(total, replicas, replica);
    match kind {
        ScheduleKind::OneFOneB => {
            let mut ops = one_f_one_b(&mine, warmup(workers_here_and_later, replicas));
            let most = total.div_ceil(u64::from(replicas.max(1))) as usize;
            ops.extend((mine.len()..most).map(|_| Op::Sync));
            ops
        }
        ScheduleKind::Flushing { group } => flushing(&mine, group, total),
        ScheduleKind::TwoBW { group } => two_bw(
            &mine,
            warmup(workers_here_and_later, replicas),
            group,
            total,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};

    #[test]
    fn one_f_one_b_order_for_stage_and_replica_counts() {
        // Four stages of one replica each: warm-ups 3, 2, 1, 0.
        assert_eq!(warmup(4, 1), 3);
        assert_eq!(
            ops(ScheduleKind::OneFOneB, 6, 1, 0, 4),
            [
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                B(3),
                B(4),
                B(5)
            ]
        );
        assert_eq!(
            ops(ScheduleKind::OneFOneB, 4, 1, 0, 1),
            [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]
        );
        // A first stage of two replicas ahead of two single stages: (4 − 1) / 2 = 1.
        assert_eq!(warmup(4, 2), 1);
        assert_eq!(
            ops(ScheduleKind::OneFOneB, 8, 2, 0, 4),
            [F(0), F(2), B(0), F(4), B(2), F(6), B(4), B(6)]
        );
        assert_eq!(
            ops(ScheduleKind::OneFOneB, 8, 2, 1, 4),
            [F(1), F(3), B(1), F(5), B(3), F(7), B(5), B(7)]
        );
        // Three replicas of a first stage of 5 workers: (5 − 1) / 3 = 1; replica 2 of 7.
        assert_eq!(
            ops(ScheduleKind::OneFOneB, 7, 3, 2, 5),
            [F(2), F(5), B(2), B(5), Op::Sync]
        );
        // Fewer minibatches than the warm-up: all forwards, then all backwards.
        assert_eq!(one_f_one_b(&[0, 1], 3), [F(0), F(1), B(0), B(1)]);
    }

    #[test]
    fn flushing_groups_forward_then_backward_then_step() {
        assert_eq!(
            ops(ScheduleKind::Flushing { group: 4 }, 6, 2, 1, 3),
            [
                F(1),
                F(3),
                B(1),
                B(3),
                Op::Flush { group: 0 },
                F(5),
                B(5),
                Op::Flush { group: 1 }
            ]
        );
    }

    #[test]
    fn two_bw_is_one_f_one_b_with_a_step_per_group() {
        // A first stage of four (warm-up 3), groups of 4: steps after B(3) and B(7).
        assert_eq!(
            ops(ScheduleKind::TwoBW { group: 4 }, 8, 1, 0, 4),
            [
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                F(6),
                B(3),
                Op::Flush { group: 0 },
                F(7),
                B(4),
                B(5),
                B(6),
                B(7),
                Op::Flush { group: 1 }
            ]
        );
        // Two replicas, 5 minibatches in groups of 4: replica 1 has none of group 1 (minibatch
        // 4) and still steps with it, at the end.
        assert_eq!(
            ops(ScheduleKind::TwoBW { group: 4 }, 5, 2, 1, 2),
            [
                F(1),
                B(1),
                F(3),
                B(3),
                Op::Flush { group: 0 },
                Op::Flush { group: 1 }
            ]
        );
        let p = |stages: &[(usize, usize, u32)]| {
            let stages = stages
                .iter()
                .map(|&(a, b, r)| crate::pipeline::StagePlan {
                    layers: a..b,
                    replicas: r,
                })
                .collect();
            crate::pipeline::Plan::new(stages, 4, 0.0).unwrap()
        };
        assert_eq!(
            two_bw_group(&p(&[(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)])),
            4
        );
        // (3 − 1) / 2 + 1 = 2 per replica of the first stage, times 2 replicas.
        assert_eq!(two_bw_group(&p(&[(0, 2, 2), (2, 4, 1)])), 4);
        assert_eq!(two_bw_group(&p(&[(0, 4, 3)])), 3);
    }

    /// Run every replica's schedule against the others with the pipeline's dependencies (a
    /// forward needs the previous stage's forward of the minibatch, a backward the next stage's
    /// backward, replicas synchronise after each step) and check that it never deadlocks and that
    /// no replica holds more than warm-up + 1 minibatches between forward and backward.
    fn simulate(kind: ScheduleKind, replicas: &[u32], total: u64) {
        let stages = replicas.len();
        let later = |s: usize| replicas[s..].iter().sum::<u32>();
        let sched: Vec<Vec<Vec<Op>>> = (0..stages)
            .map(|s| {
                (0..replicas[s])
                    .map(|k| ops(kind, total, replicas[s], k, later(s)))
                    .collect()
            })
            .collect();
        let mut pc = vec![vec![0usize; 8]; stages];
        let mut fwd = vec![std::collections::HashSet::new(); stages];
        let mut bwd = vec![std::collections::HashSet::new(); stages];
        // Steps (backward in 1F1B, flush in flushing) completed per replica.
        let mut steps = vec![vec![0usize; 8]; stages];
        loop {
            let mut progressed = false;
            for s in 0..stages {
                for k in 0..replicas[s] as usize {
                    let Some(&op) = sched[s][k].get(pc[s][k]) else {
                        continue;
                    };
                    // A replica whose last step is not matched by all its peers waits.
                    let min_steps = (0..replicas[s] as usize)
                        .map(|j| steps[s][j])
                        .min()
                        .unwrap();
                    if steps[s][k] > min_steps {
                        continue;
                    }
                    let ready = match op {
                        Op::Forward(m) => s == 0 || fwd[s - 1].contains(&m),
                        Op::Backward(m) => {
                            fwd[s].contains(&m) && (s + 1 == stages || bwd[s + 1].contains(&m))
                        }
                        Op::Flush { .. } | Op::Sync => true,
                    };
                    if !ready {
                        continue;
                    }
                    match op {
                        Op::Forward(m) => {
                            fwd[s].insert(m);
                            let mine = sched[s][k][..=pc[s][k]]
                                .iter()
                                .filter(|o| matches!(o, Op::Forward(_)))
                                .count()
                                - sched[s][k][..pc[s][k]]
                                    .iter()
                                    .filter(|o| matches!(o, Op::Backward(_)))
                                    .count();
                            if !matches!(kind, ScheduleKind::Flushing { .. }) {
                                assert!(mine <= warmup(later(s), replicas[s]) + 1);
                            }
                        }
                        Op::Backward(m) => {
                            bwd[s].insert(m);
                            if kind == ScheduleKind::OneFOneB {
                                steps[s][k] += 1;
                            }
                        }
                        Op::Flush { .. } | Op::Sync => steps[s][k] += 1,
                    }
                    pc[s][k] += 1;
                    progressed = true;
                }
            }
            if !progressed {
                break;
            }
        }
        for s in 0..stages {
            assert_eq!(
                bwd[s].len() as u64,
                total,
                "stage {s} deadlocked at {:?}",
                pc[s]
            );
            for k in 0..replicas[s] as usize {
                assert_eq!(pc[s][k], sched[s][k].len(), "stage {s} replica {k} stuck");
            }
        }
    }

    #[test]
    fn schedules_never_deadlock() {
        for replicas in [
            vec![1],
            vec![4],
            vec![1, 1, 1, 1],
            vec![2, 1, 1],
            vec![1, 2, 1],
            vec![3, 1],
            vec![2, 2],
        ] {
            for total in [1, 5, 12] {
                simulate(ScheduleKind::OneFOneB, &replicas, total);
                simulate(ScheduleKind::Flushing { group: 4 }, &replicas, total);
                let stages = replicas
                    .iter()
                    .scan(0, |at, &r| {
                        *at += 1;
                        Some(crate::pipeline::StagePlan {
                            layers: *at - 1..*at,
                            replicas: r,
                        })
                    })
                    .collect();
                let plan = crate::pipeline::Plan::new(stages, replicas.len(), 0.0).unwrap();
                let group = two_bw_group(&plan);
                simulate(ScheduleKind::TwoBW { group }, &replicas, total);
                simulate(ScheduleKind::TwoBW { group: group + 3 }, &replicas, total);
            }
        }
    }
}
