//! Pipeline-parallel training (PipeDream): the layers of an MLP split into stages across
//! workers by a profiled partitioner, 1F1B with weight stashing (optionally with vertical sync),
//! PipeDream-2BW's double-buffered weights or a flushing schedule, over the agents' TCP
//! transport.
//!
//! - [`profile`]: per-layer compute time, activation and parameter bytes on this machine;
//! - [`partition`]: the cost model, and the plan it predicts fastest for every worker count;
//! - [`calibration`]: the cost model fitted to what warm-up runs of the workers measured;
//! - [`schedule`]: the order of forward and backward passes of a stage replica, and when it
//!   steps (pure);
//! - [`stage`]: a stage replica at run time: compute, stashing, messages, weight sync;
//! - [`member`]: an agent's pipeline worker (plan from rank 0, final evaluation);
//! - [`local`]: a whole pipeline of workers on this machine (one runtime and one TCP endpoint
//!   per worker), for tests and benchmarks;
//! - [`processes`]: the same with every worker its own agent process.

pub mod calibration;
pub mod local;
pub mod member;
pub mod partition;
pub mod planning;
pub mod processes;
pub mod profile;
pub mod schedule;
pub mod stage;

use crate::error::{AgentError, Result};
use crate::transport::{Dec, Enc, Request};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

/// One stage of a plan: a contiguous run of layers and how many workers replicate it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StagePlan {
    pub layers: Range<usize>,
    pub replicas: u32,
}

/// Why a plan was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("a plan needs at least one stage")]
    Empty,
    #[error("stage {0} has no layers or does not start where the previous one ended")]
    Gap(usize),
    #[error("stage {0} has no replicas")]
    NoReplicas(usize),
    #[error("the stages cover {covered} of {layers} layers")]
    Uncovered { covered: usize, layers: usize },
}

/// Stages that tile the model's layers in order, each with at least one replica. Workers are
/// numbered stage by stage: stage 0's replicas first.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    stages: Vec<StagePlan>,
    /// The partitioner's objective for this plan: its slowest stage or link, in seconds per
    /// minibatch (see `partition::predicted_1f1b_secs` for the prediction with the 1F1B bound).
    pub predicted_secs: f64,
}

impl Plan {
    pub fn new(
        stages: Vec<StagePlan>,
        layers: usize,
        predicted_secs: f64,
    ) -> Result<Plan, PlanError> {
        if stages.is_empty() {
            return Err(PlanError::Empty);
        }
        let mut next = 0;
        for (i, s) in stages.iter().enumerate() {
            if s.layers.start != next || s.layers.end <= s.layers.start {
                return Err(PlanError::Gap(i));
            }
            if s.replicas == 0 {
                return Err(PlanError::NoReplicas(i));
            }
            next = s.layers.end;
        }
        if next != layers {
            return Err(PlanError::Uncovered {
                covered: next,
                layers,
            });
        }
        Ok(Plan {
            stages,
            predicted_secs,
        })
    }

    /// One stage of every layer on `workers` replicas: data parallelism.
    pub fn data_parallel(layers: usize, workers: u32, predicted_secs: f64) -> Plan {
        Plan {
            stages: vec![StagePlan {
                layers: 0..layers.max(1),
                replicas: workers.max(1),
            }],
            predicted_secs,
        }
    }

    pub fn stages(&self) -> &[StagePlan] {
        &self.stages
    }

    pub fn workers(&self) -> u32 {
        self.stages.iter().map(|s| s.replicas).sum()
    }

    /// The first worker of stage `s`.
    pub fn first_worker(&self, s: usize) -> u32 {
        self.stages[..s].iter().map(|s| s.replicas).sum()
    }

    /// (stage, replica) of worker `w`.
    pub fn role(&self, w: u32) -> Option<(usize, u32)> {
        let mut first = 0;
        for (i, s) in self.stages.iter().enumerate() {
            if w < first + s.replicas {
                return Some((i, w - first));
            }
            first += s.replicas;
        }
        None
    }

    /// The worker that runs minibatch `m` at stage `s` (round-robin over its replicas).
    pub fn worker_for(&self, s: usize, m: u64) -> u32 {
        let r = u64::from(self.stages[s].replicas);
        self.first_worker(s) + (m % r) as u32
    }

    /// Workers in stage `s` and the stages after it (for the 1F1B warm-up).
    pub fn workers_from(&self, s: usize) -> u32 {
        self.stages[s..].iter().map(|s| s.replicas).sum()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.stages.iter().enumerate() {
            if i > 0 {
                f.write_str(" | ")?;
            }
            write!(
                f,
                "stage {i}: layers {}..{} x{}",
                s.layers.start, s.layers.end, s.replicas
            )?;
        }
        write!(
            f,
            " (slowest stage or link: {:.2} ms/minibatch)",
            self.predicted_secs * 1e3
        )
    }
}

/// Plans for several worker counts as one flat list (the [`PipeMsg::Plans`] table): per plan,
/// its stage count, then (first layer, end layer, replicas) per stage, then its prediction.
pub fn encode_plans<'a>(plans: impl IntoIterator<Item = &'a Plan>) -> Vec<f32> {
    let mut out = Vec::new();
    for p in plans {
        out.push(p.stages().len() as f32);
        for s in p.stages() {
            out.extend([
                s.layers.start as f32,
                s.layers.end as f32,
                s.replicas as f32,
            ]);
        }
        out.push(p.predicted_secs as f32);
    }
    out
}

/// The plans of a table from [`encode_plans`], by worker count; `None` when it is not one.
pub fn decode_plans(flat: &[f32], layers: usize) -> Option<BTreeMap<u32, Plan>> {
    let mut plans = BTreeMap::new();
    let mut it = flat.iter().map(|&x| x as f64);
    while let Some(n) = it.next() {
        let mut stages = Vec::new();
        for _ in 0..n as usize {
            let (a, b, r) = (it.next()?, it.next()?, it.next()?);
            stages.push(StagePlan {
                layers: a as usize..b as usize,
                replicas: r as u32,
            });
        }
        let plan = Plan::new(stages, layers, it.next()?).ok()?;
        plans.insert(plan.workers(), plan);
    }
    Some(plans)
}

/// A tensor between stages: `rows × cols`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub rows: u32,
    pub cols: u32,
    pub data: Vec<f32>,
}

/// What pipeline stages send each other (one-way; the receiver acknowledges).
#[derive(Debug, Clone, PartialEq)]
pub enum PipeMsg {
    /// The output of stage `to_stage − 1` for minibatch `minibatch`, in segment `segment` (a
    /// minibatch is computed again in a later segment after a lost worker).
    Activation {
        segment: u32,
        to_stage: u32,
        minibatch: u64,
        tensor: Tensor,
    },
    /// The gradient with respect to stage `to_stage + 1`'s input, for `minibatch`.
    Gradient {
        segment: u32,
        to_stage: u32,
        minibatch: u64,
        tensor: Tensor,
    },
    /// One step of a ring all-reduce among the replicas of `stage`, for its `round`-th optimizer
    /// step.
    Reduce {
        stage: u32,
        round: u64,
        step: u32,
        data: Vec<f32>,
    },
    /// Re-planning: finish every minibatch below `at` and admit none from it on; then segment
    /// `segment + 1` starts at `at` without worker `evicted`.
    Drain { segment: u32, at: u64, evicted: u32 },
    /// Re-planning to fold in a worker: finish every minibatch below `at` and admit none from
    /// it on; then segment `segment + 1` starts at `at` on `members` (original worker numbers,
    /// in plan order), the joining worker last. `addrs` is the leader's address book (every
    /// worker's data address by number, the joining worker's included). Sent to the joining
    /// worker too.
    Grow {
        segment: u32,
        at: u64,
        members: Vec<u32>,
        addrs: Vec<String>,
    },
    /// A layer's weights and optimizer state, for its owner in segment `segment`.
    State {
        segment: u32,
        layer: u32,
        weights: Vec<f32>,
        velocity: Vec<f32>,
    },
    /// The plan for every worker count (see `member::encode_plans`), from rank 0.
    Plans { table: Vec<f32> },
    /// Original worker `worker` was warned: for the current leader, which drains and re-plans.
    Warn { worker: u32 },
    /// A worker outside the pipeline (a replacement) can train and is reachable at `addr`: sent
    /// to every worker it knows of, so that whoever leads folds it in (see [`PipeMsg::Grow`]).
    Ready { addr: String },
    /// A piece of a layer's snapshot: its weights and then its momentum, flattened (`total`
    /// floats, the first `weights_len` the weights), after every minibatch below `at`; this
    /// piece holds `data` from `offset`. From its stage's first replica to the snapshot's two
    /// keepers, in pieces in the transport's background lane, so that a worker lost without
    /// warning can be restored from it without the snapshot delaying the pipeline.
    Snapshot {
        at: u64,
        layer: u32,
        offset: u32,
        total: u32,
        weights_len: u32,
        data: Vec<f32>,
    },
    /// Worker `worker` stopped answering in segment `segment` (lost without warning): abandon
    /// the segment and wait for the first surviving member's [`PipeMsg::Restore`].
    Lost { segment: u32, worker: u32 },
    /// Segment `segment + 1` starts at `at`, without `lost`, from the snapshot at `at`; the
    /// sender (the first surviving member) sends every layer to its owner.
    Restore { segment: u32, at: u64, lost: u32 },
    /// Are you there? (A worker that has waited a while on this one; the acknowledgement is
    /// the answer.)
    Ping,
}

impl PipeMsg {
    /// The data-plane request that carries this message: its encoding, as the transport's
    /// opaque payload.
    pub fn to_request(&self) -> Request {
        let mut e = Enc(Vec::with_capacity(32 + self.payload_bytes()));
        self.encode(&mut e);
        Request::Opaque(e.0)
    }

    /// The message an opaque payload carries (see [`PipeMsg::to_request`]).
    pub fn from_payload(payload: &[u8]) -> Result<PipeMsg> {
        PipeMsg::decode(&mut Dec(payload))
    }

    /// Bytes of tensor payload, to size the encoding buffer once.
    fn payload_bytes(&self) -> usize {
        match self {
            PipeMsg::Activation { tensor, .. } | PipeMsg::Gradient { tensor, .. } => {
                tensor.data.len() * 4
            }
            PipeMsg::Reduce { data, .. } => data.len() * 4,
            PipeMsg::Snapshot { data, .. } => data.len() * 4,
            PipeMsg::Lost { .. } | PipeMsg::Restore { .. } | PipeMsg::Ping => 0,
            PipeMsg::Drain { .. } | PipeMsg::Warn { .. } => 0,
            PipeMsg::Grow { members, addrs, .. } => {
                members.len() * 4 + addrs.iter().map(|a| a.len() + 4).sum::<usize>()
            }
            PipeMsg::Ready { addr } => addr.len() + 4,
            PipeMsg::Plans { table } => table.len() * 4,
            PipeMsg::State {
                weights, velocity, ..
            } => (weights.len() + velocity.len()) * 4,
        }
    }

    fn encode(&self, e: &mut Enc) {
        match self {
            PipeMsg::Activation {
                segment,
                to_stage,
                minibatch,
                tensor,
            }
            | PipeMsg::Gradient {
                segment,
                to_stage,
                minibatch,
                tensor,
            } => {
                e.u8(if matches!(self, PipeMsg::Activation { .. }) {
                    1
                } else {
                    2
                });
                e.u32(*segment);
                e.u32(*to_stage);
                e.u64(*minibatch);
                e.u32(tensor.rows);
                e.u32(tensor.cols);
                e.f32s(&tensor.data);
            }
            PipeMsg::Reduce {
                stage,
                round,
                step,
                data,
            } => {
                e.u8(3);
                e.u32(*stage);
                e.u64(*round);
                e.u32(*step);
                e.f32s(data);
            }
            PipeMsg::Drain {
                segment,
                at,
                evicted,
            } => {
                e.u8(4);
                e.u32(*segment);
                e.u64(*at);
                e.u32(*evicted);
            }
            PipeMsg::State {
                segment,
                layer,
                weights,
                velocity,
            } => {
                e.u8(5);
                e.u32(*segment);
                e.u32(*layer);
                e.f32s(weights);
                e.f32s(velocity);
            }
            PipeMsg::Plans { table } => {
                e.u8(6);
                e.f32s(table);
            }
            PipeMsg::Warn { worker } => {
                e.u8(7);
                e.u32(*worker);
            }
            PipeMsg::Grow {
                segment,
                at,
                members,
                addrs,
            } => {
                e.u8(8);
                e.u32(*segment);
                e.u64(*at);
                e.u32s(members);
                e.u32(addrs.len() as u32);
                for a in addrs {
                    e.str(a);
                }
            }
            PipeMsg::Ready { addr } => {
                e.u8(9);
                e.str(addr);
            }
            PipeMsg::Snapshot {
                at,
                layer,
                offset,
                total,
                weights_len,
                data,
            } => {
                e.u8(10);
                e.u64(*at);
                e.u32(*layer);
                e.u32(*offset);
                e.u32(*total);
                e.u32(*weights_len);
                e.f32s(data);
            }
            PipeMsg::Lost { segment, worker } => {
                e.u8(11);
                e.u32(*segment);
                e.u32(*worker);
            }
            PipeMsg::Restore { segment, at, lost } => {
                e.u8(12);
                e.u32(*segment);
                e.u64(*at);
                e.u32(*lost);
            }
            PipeMsg::Ping => e.u8(13),
        }
    }

    fn decode(d: &mut Dec) -> Result<PipeMsg> {
        let tag = d.u8()?;
        Ok(match tag {
            1 | 2 => {
                let segment = d.u32()?;
                let to_stage = d.u32()?;
                let minibatch = d.u64()?;
                let rows = d.u32()?;
                let cols = d.u32()?;
                let data = d.f32s()?;
                if data.len() as u64 != u64::from(rows) * u64::from(cols) {
                    return Err(AgentError::Frame(format!(
                        "tensor of {rows}x{cols} carries {} values",
                        data.len()
                    )));
                }
                let tensor = Tensor { rows, cols, data };
                if tag == 1 {
                    PipeMsg::Activation {
                        segment,
                        to_stage,
                        minibatch,
                        tensor,
                    }
                } else {
                    PipeMsg::Gradient {
                        segment,
                        to_stage,
                        minibatch,
                        tensor,
                    }
                }
            }
            3 => PipeMsg::Reduce {
                stage: d.u32()?,
                round: d.u64()?,
                step: d.u32()?,
                data: d.f32s()?,
            },
            4 => PipeMsg::Drain {
                segment: d.u32()?,
                at: d.u64()?,
                evicted: d.u32()?,
            },
            5 => PipeMsg::State {
                segment: d.u32()?,
                layer: d.u32()?,
                weights: d.f32s()?,
                velocity: d.f32s()?,
            },
            6 => PipeMsg::Plans { table: d.f32s()? },
            7 => PipeMsg::Warn { worker: d.u32()? },
            8 => {
                let (segment, at, members) = (d.u32()?, d.u64()?, d.u32s()?);
                let n = d.u32()?;
                // Every address takes at least its 4-byte length: a count the frame cannot
                // hold is refused before anything is allocated for it.
                if (n as usize).saturating_mul(4) > d.0.len() {
                    return Err(AgentError::Frame(format!("{n} addresses exceed the frame")));
                }
                let addrs = (0..n).map(|_| d.str()).collect::<Result<_>>()?;
                PipeMsg::Grow {
                    segment,
                    at,
                    members,
                    addrs,
                }
            }
            9 => PipeMsg::Ready { addr: d.str()? },
            10 => {
                let (at, layer, offset, total, weights_len) =
                    (d.u64()?, d.u32()?, d.u32()?, d.u32()?, d.u32()?);
                let data = d.f32s()?;
                let end = u64::from(offset) + data.len() as u64;
                if weights_len > total || end > u64::from(total) {
                    return Err(AgentError::Frame(format!(
                        "a snapshot piece of {} floats at {offset} of {total} ({weights_len} \
                         weights) does not fit its layer",
                        data.len()
                    )));
                }
                PipeMsg::Snapshot {
                    at,
                    layer,
                    offset,
                    total,
                    weights_len,
                    data,
                }
            }
            11 => PipeMsg::Lost {
                segment: d.u32()?,
                worker: d.u32()?,
            },
            12 => PipeMsg::Restore {
                segment: d.u32()?,
                at: d.u64()?,
                lost: d.u32()?,
            },
            13 => PipeMsg::Ping,
            t => return Err(AgentError::Frame(format!("unknown pipeline message {t}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_must_tile_the_layers() {
        let s = |a, b, r| StagePlan {
            layers: a..b,
            replicas: r,
        };
        assert!(Plan::new(vec![s(0, 2, 2), s(2, 4, 1)], 4, 0.0).is_ok());
        assert_eq!(Plan::new(vec![], 4, 0.0), Err(PlanError::Empty));
        assert_eq!(
            Plan::new(vec![s(0, 2, 1), s(3, 4, 1)], 4, 0.0),
            Err(PlanError::Gap(1))
        );
        assert_eq!(
            Plan::new(vec![s(0, 4, 0)], 4, 0.0),
            Err(PlanError::NoReplicas(0))
        );
        assert_eq!(
            Plan::new(vec![s(0, 3, 1)], 4, 0.0),
            Err(PlanError::Uncovered {
                covered: 3,
                layers: 4
            })
        );
        let p = Plan::new(vec![s(0, 2, 2), s(2, 3, 1), s(3, 4, 1)], 4, 0.0).unwrap();
        assert_eq!(p.workers(), 4);
        assert_eq!(p.role(1), Some((0, 1)));
        assert_eq!(p.role(3), Some((2, 0)));
        assert_eq!(p.role(4), None);
        assert_eq!(p.worker_for(0, 5), 1);
        assert_eq!(p.worker_for(1, 5), 2);
        assert_eq!(p.workers_from(0), 4);
    }

    #[test]
    fn messages_roundtrip_and_reject_bad_shapes() {
        let msgs = [
            PipeMsg::Activation {
                segment: 3,
                to_stage: 1,
                minibatch: 7,
                tensor: Tensor {
                    rows: 2,
                    cols: 2,
                    data: vec![1.0, 2.0, 3.0, 4.0],
                },
            },
            PipeMsg::Gradient {
                segment: 0,
                to_stage: 0,
                minibatch: 9,
                tensor: Tensor {
                    rows: 1,
                    cols: 1,
                    data: vec![-1.0],
                },
            },
            PipeMsg::Reduce {
                stage: 0,
                round: 3,
                step: 2,
                data: vec![0.5; 5],
            },
            PipeMsg::Drain {
                segment: 1,
                at: 40,
                evicted: 2,
            },
            PipeMsg::State {
                segment: 2,
                layer: 1,
                weights: vec![1.0, 2.0],
                velocity: vec![0.0, -1.0],
            },
            PipeMsg::Plans {
                table: vec![1.0, 0.0, 3.0, 4.0, 0.5],
            },
            PipeMsg::Warn { worker: 3 },
            PipeMsg::Grow {
                segment: 2,
                at: 64,
                members: vec![0, 2, 3, 4],
                addrs: vec![
                    "a:1".into(),
                    String::new(),
                    "c:3".into(),
                    "d:4".into(),
                    "e:5".into(),
                ],
            },
            PipeMsg::Ready {
                addr: "10.0.0.7:7000".into(),
            },
            PipeMsg::Snapshot {
                at: 128,
                layer: 2,
                offset: 1,
                total: 4,
                weights_len: 2,
                data: vec![-2.0, 0.5, 0.0],
            },
            PipeMsg::Lost {
                segment: 1,
                worker: 3,
            },
            PipeMsg::Restore {
                segment: 1,
                at: 96,
                lost: 3,
            },
            PipeMsg::Ping,
        ];
        for m in msgs {
            let mut e = Enc::default();
            m.encode(&mut e);
            assert_eq!(PipeMsg::decode(&mut Dec(&e.0)).unwrap(), m);
            for cut in 0..e.0.len() {
                assert!(PipeMsg::decode(&mut Dec(&e.0[..cut])).is_err());
            }
        }
        let mut e = Enc::default();
        PipeMsg::Activation {
            segment: 0,
            to_stage: 1,
            minibatch: 0,
            tensor: Tensor {
                rows: 3,
                cols: 3,
                data: vec![1.0],
            },
        }
        .encode(&mut e);
        assert!(PipeMsg::decode(&mut Dec(&e.0)).is_err());
        // A snapshot piece that reaches past its layer, or says the layer has more weights
        // than floats, is refused.
        for (offset, total, weights_len) in [(3, 4, 2), (0, 4, 5)] {
            let mut e = Enc::default();
            PipeMsg::Snapshot {
                at: 8,
                layer: 0,
                offset,
                total,
                weights_len,
                data: vec![1.0, 2.0],
            }
            .encode(&mut e);
            assert!(PipeMsg::decode(&mut Dec(&e.0)).is_err(), "{offset} {total}");
        }
    }

    #[test]
    fn messages_travel_as_request_tag_10_followed_by_their_encoding() {
        // The data plane's bytes from when the transport encoded pipeline messages itself.
        let activation = PipeMsg::Activation {
            segment: 2,
            to_stage: 1,
            minibatch: 7,
            tensor: Tensor {
                rows: 1,
                cols: 1,
                data: vec![1.0],
            },
        };
        let activation_bytes = vec![
            10, 1, 2, 0, 0, 0, 1, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0x80, 0x3f,
        ];
        let warn = PipeMsg::Warn { worker: 3 };
        for (msg, bytes) in [
            (activation, activation_bytes),
            (warn, vec![10, 7, 3, 0, 0, 0]),
        ] {
            let mut e = Enc::default();
            msg.to_request().encode(&mut e);
            assert_eq!(e.0, bytes);
            let Request::Opaque(payload) = Request::decode(&mut Dec(&e.0)).unwrap() else {
                panic!("a pipeline message decodes as an opaque request");
            };
            assert_eq!(PipeMsg::from_payload(&payload).unwrap(), msg);
        }
    }
}
