//! Training applications and the input partitioning they share.
//!
//! A clock's work is defined by the input, not by the workers: clock `c` processes chunk
//! `c % clocks_per_epoch` of every partition, and the update of a set of partitions is the sum
//! of their per-partition updates computed against the same parameters. So the trajectory of a
//! job does not depend on how many workers it has or how its partitions move between them; only
//! float summation order does.

pub mod mf;
pub mod mlp;
pub mod mlr;

use crate::data;
use crate::error::{AgentError, Result};
use proteus_wire::agent_api::{AppConfig, ImageDataset, Metric, TrainingConfig};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use std::ops::Range;
use std::path::Path;

/// Which input items belong to which partition, and which of them a clock processes.
#[derive(Debug, Clone)]
pub struct Partitioner {
    parts: Vec<Vec<u32>>,
    clocks_per_epoch: u64,
    seed: u64,
}

impl Partitioner {
    /// Deal `n_items` (after a seeded shuffle) round-robin into `num_partitions` partitions.
    pub fn new(n_items: usize, num_partitions: u32, clocks_per_epoch: u32, seed: u64) -> Self {
        let mut order: Vec<u32> = (0..n_items as u32).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let n = num_partitions.max(1) as usize;
        let mut parts = vec![Vec::new(); n];
        for (k, item) in order.into_iter().enumerate() {
            parts[k % n].push(item);
        }
        Partitioner {
            parts,
            clocks_per_epoch: u64::from(clocks_per_epoch.max(1)),
            seed,
        }
    }

    pub fn num_partitions(&self) -> u32 {
        self.parts.len() as u32
    }

    fn chunk(&self, len: usize, clock: u64) -> Range<usize> {
        let k = (clock % self.clocks_per_epoch) as usize;
        let cpe = self.clocks_per_epoch as usize;
        (k * len / cpe)..((k + 1) * len / cpe)
    }

    /// The items partition `p` processes at `clock`, in a per-epoch shuffled order.
    pub fn batch(&self, p: u32, clock: u64) -> Vec<u32> {
        let Some(items) = self.parts.get(p as usize) else {
            return Vec::new();
        };
        let epoch = clock / self.clocks_per_epoch;
        let mut order = items.clone();
        let mix = self.seed ^ (u64::from(p) << 32) ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(mix));
        order[self.chunk(items.len(), clock)].to_vec()
    }

    /// Number of items all partitions together process at `clock`.
    pub fn global_batch(&self, clock: u64) -> usize {
        self.parts
            .iter()
            .map(|items| self.chunk(items.len(), clock).len())
            .sum()
    }
}

/// What a worker computed for some partitions at one clock.
#[derive(Debug, Clone, Default)]
pub struct Update {
    /// To be added to the parameters (already scaled by the learning rate).
    pub delta: Vec<f32>,
    pub samples: usize,
    pub loss_sum: f64,
}

/// A loaded application.
#[derive(Debug)]
pub enum App {
    Mlr(mlr::Mlr),
    Mf(mf::Mf),
    /// Benchmarks: a model of zeros that never changes.
    Synthetic {
        model_len: usize,
    },
    /// Trained by the pipeline runtime; the parameter server only sees its size.
    Mlp(std::sync::Arc<mlp::MlpJob>),
}

impl App {
    /// Load the data `cfg.app` names from `data_dir`.
    pub fn load(cfg: &TrainingConfig, data_dir: &Path) -> Result<App> {
        let parts = |n| Partitioner::new(n, cfg.num_partitions, cfg.clocks_per_epoch, cfg.seed);
        Ok(match &cfg.app {
            AppConfig::Mlr {
                dataset,
                learning_rate,
                l2,
            } => {
                let (train, test) = match dataset {
                    ImageDataset::Mnist => data::load_mnist(data_dir)?,
                    ImageDataset::Digits => data::load_digits(data_dir)?,
                };
                let p = parts(train.len());
                App::Mlr(mlr::Mlr::new(train, test, p, *learning_rate, *l2))
            }
            AppConfig::Mf {
                ratings_file,
                rank,
                learning_rate,
                l2,
                holdout_fraction,
            } => {
                let set = data::load_ratings(&data_dir.join(ratings_file))?;
                let (train, test) = data::split_by_user_time(&set, *holdout_fraction);
                if train.is_empty() || test.is_empty() {
                    return Err(AgentError::Data(format!(
                        "{ratings_file}: split left no train or no held-out ratings"
                    )));
                }
                let p = parts(train.len());
                let hyper = mf::Hyper {
                    rank: *rank as usize,
                    learning_rate: *learning_rate,
                    l2: *l2,
                    seed: cfg.seed,
                };
                App::Mf(mf::Mf::new(
                    set.num_users,
                    set.num_items,
                    train,
                    test,
                    p,
                    hyper,
                ))
            }
            AppConfig::Command(_) => {
                return Err(AgentError::Config(
                    "a command job runs the user's program, not a built-in app".into(),
                ));
            }
            AppConfig::Mlp {
                dataset,
                layers,
                batch,
                learning_rate,
                momentum,
                parallelism,
                link_mbit_per_sec,
                link_latency_ms,
                pipeline,
            } => {
                let (train, test) = match dataset {
                    ImageDataset::Mnist => data::load_mnist(data_dir)?,
                    ImageDataset::Digits => data::load_digits(data_dir)?,
                };
                let mut widths = vec![train.dim];
                widths.extend(layers.iter().map(|&w| w as usize));
                let shape =
                    mlp::MlpShape::new(widths).map_err(|e| AgentError::Config(e.to_string()))?;
                App::Mlp(std::sync::Arc::new(mlp::MlpJob {
                    shape,
                    train: std::sync::Arc::new(train),
                    test,
                    batch: *batch as usize,
                    lr: mlp::LrSchedule::constant(*learning_rate),
                    momentum: *momentum,
                    parallelism: *parallelism,
                    pipeline: pipeline.clone(),
                    link_bytes_per_sec: link_mbit_per_sec.map(|b| b * 1e6 / 8.0),
                    link_latency: link_latency_ms
                        .filter(|ms| *ms > 0.0)
                        .map(|ms| std::time::Duration::from_secs_f64(ms / 1e3)),
                }))
            }
            AppConfig::Synthetic { model_len } => App::Synthetic {
                model_len: usize::try_from(*model_len)
                    .map_err(|_| AgentError::Config("synthetic model_len too large".into()))?,
            },
        })
    }

    /// The data-plane frame bound of a job training this app with `cfg` (see
    /// [`crate::transport::frame_bound`]): parameter-server messages carry at most the whole
    /// model (a shard's values, an update, a snapshot); pipeline messages at most
    /// [`mlp::MlpShape::max_message_floats`].
    pub fn max_frame(&self, cfg: &TrainingConfig) -> usize {
        let floats = match self {
            App::Mlp(job) => job.shape.max_message_floats(job.batch),
            _ => self.model_len(),
        };
        crate::transport::frame_bound(floats, cfg.num_partitions, cfg.sync.slack())
    }

    pub fn model_len(&self) -> usize {
        match self {
            App::Mlr(a) => a.model_len(),
            App::Mf(a) => a.model_len(),
            App::Synthetic { model_len } => *model_len,
            App::Mlp(a) => a.shape.params(),
        }
    }

    /// Initial values of the keys `range`; the same on every agent.
    pub fn init(&self, range: Range<usize>) -> Vec<f32> {
        match self {
            App::Mlr(_) | App::Mlp(_) => vec![0.0; range.len()],
            App::Mf(a) => range.map(|k| a.init_value(k)).collect(),
            App::Synthetic { .. } => range.map(|k| (k % 1024) as f32).collect(),
        }
    }

    /// The update of `partitions` at `clock` against `params` (the whole model).
    pub fn compute(&self, params: &[f32], partitions: &[u32], clock: u64) -> Update {
        match self {
            App::Mlr(a) => a.compute(params, partitions, clock),
            App::Mf(a) => a.compute(params, partitions, clock),
            App::Synthetic { model_len } => Update {
                delta: vec![0.0; *model_len],
                samples: 0,
                loss_sum: 0.0,
            },
            App::Mlp(a) => Update {
                delta: vec![0.0; a.shape.params()],
                samples: 0,
                loss_sum: 0.0,
            },
        }
    }

    /// Held-out evaluation of `params`.
    pub fn evaluate(&self, params: &[f32], clock: u64) -> Option<Metric> {
        match self {
            App::Mlr(a) => Some(a.evaluate(params, clock)),
            App::Mf(a) => Some(a.evaluate(params, clock)),
            App::Synthetic { .. } | App::Mlp(_) => None,
        }
    }

    /// Train in this process alone, with the same clock semantics as a distributed run: the
    /// reference that distributed runs are compared against. Returns the final metric.
    pub fn train_local(&self, total_clocks: u64, num_partitions: u32) -> Option<Metric> {
        let mut params = self.init(0..self.model_len());
        let all: Vec<u32> = (0..num_partitions).collect();
        for clock in 0..total_clocks {
            let u = self.compute(&params, &all, clock);
            for (p, d) in params.iter_mut().zip(&u.delta) {
                *p += d;
            }
        }
        self.evaluate(&params, total_clocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_mlp_job_brings_its_links_and_schedule_to_the_agent() {
        use proteus_wire::agent_api::{Parallelism, PipelineOptions, PipelineSchedule};
        let dir = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data/ml"));
        let pipeline = PipelineOptions {
            schedule: PipelineSchedule::TwoBW,
            vertical_sync: false,
            snapshot_every: 7,
            profile: None,
        };
        let cfg = TrainingConfig::new(AppConfig::Mlp {
            dataset: ImageDataset::Digits,
            layers: vec![32, 10],
            batch: 16,
            learning_rate: 0.05,
            momentum: 0.9,
            parallelism: Parallelism::Pipeline,
            link_mbit_per_sec: Some(80.0),
            link_latency_ms: Some(2.5),
            pipeline: pipeline.clone(),
        });
        cfg.validate().expect("valid");
        let App::Mlp(job) = App::load(&cfg, &dir).expect("digits load") else {
            panic!("an mlp job loads as one");
        };
        assert_eq!(job.link_bytes_per_sec, Some(10e6));
        assert_eq!(
            job.link_latency,
            Some(std::time::Duration::from_micros(2500))
        );
        assert_eq!(job.pipeline, pipeline);
        // No latency is none, not a zero delay line.
        let mut none = cfg.clone();
        if let AppConfig::Mlp {
            link_latency_ms, ..
        } = &mut none.app
        {
            *link_latency_ms = Some(0.0);
        }
        let App::Mlp(job) = App::load(&none, &dir).expect("digits load") else {
            panic!("an mlp job loads as one");
        };
        assert_eq!(job.link_latency, None);
        // Out of range is refused by the configuration's check, naming the field.
        for bad in [-1.0, f64::NAN, 20_000.0] {
            let mut c = cfg.clone();
            if let AppConfig::Mlp {
                link_latency_ms, ..
            } = &mut c.app
            {
                *link_latency_ms = Some(bad);
            }
            let e = c.validate().expect_err("out of range");
            assert!(e.contains("link_latency_ms"), "{e}");
        }
    }

    #[test]
    fn partitions_cover_every_item_once_per_epoch() {
        let p = Partitioner::new(1003, 7, 5, 42);
        let mut seen = vec![0u32; 1003];
        for part in 0..7 {
            for clock in 5..10 {
                for i in p.batch(part, clock) {
                    seen[i as usize] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        assert_eq!((5..10).map(|c| p.global_batch(c)).sum::<usize>(), 1003);
    }
}
