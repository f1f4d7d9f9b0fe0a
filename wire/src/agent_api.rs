//! The agent control protocol: what `proteus-agent` and the broker say to each other over HTTP.
//!
//! The agent always initiates (it may sit behind NAT), so every exchange is a request from the
//! agent:
//!
//! | method | path (see [`paths`]) | body | answer |
//! |---|---|---|---|
//! | `POST` | `/v1/agents/register` | [`RegisterRequest`] | [`RegisterResponse`] |
//! | `POST` | `/v1/agents/{instance_id}/heartbeat` | [`Heartbeat`] | `204` |
//! | `GET`  | `/v1/agents/{instance_id}/commands?after=<seq>&wait_ms=<n>` | — | `Vec<`[`CommandEnvelope`]`>` (empty on timeout) |
//! | `POST` | `/v1/agents/{instance_id}/events` | [`AgentEvent`] | `204` |
//! | `GET`  | `/v1/agents/{instance_id}/checkpoint?rank=<r>&op=upload\|download` | — | [`CheckpointTransfer`] |
//! | `PUT`/`GET` | `/v1/agents/{instance_id}/checkpoint-data/{rank}` | archive | `204` / archive (broker's directory store) |
//! | `GET`  | `/v1/agents/{instance_id}/workdir` | — | [`CheckpointTransfer`] (a command job's `s3://` working directory, to `GET`) |
//! | `POST` | `/v1/agents/{instance_id}/output` | text (the tail of the program's output) | `204` |
//!
//! Every request carries `Authorization: Bearer <per-instance token>`. Errors are JSON
//! [`ApiError`] with status 401 (token missing or unknown), 403 (token belongs to another
//! instance), 404 (unknown instance), 409 (the job is over), 400 (malformed body).
//!
//! All enums are tagged `{"type": "...", ...}` in `snake_case`; every optional field has a
//! `#[serde(default)]` so an older peer that omits it still parses.

use crate::ids::{InstanceId, JobId, Tier};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Header carrying the per-instance bearer token.
pub const AUTHORIZATION: &str = "authorization";

/// URL paths of the agent API, written once for the broker's router and the agent's client.
pub mod paths {
    use crate::ids::InstanceId;

    /// `POST`: an agent announces itself.
    pub const REGISTER: &str = "/v1/agents/register";
    /// `POST` [`super::BootstrapRequest`], authenticated by the instance's one-time bootstrap
    /// token: the agent's first contact, which trades that token for its agent token.
    pub const BOOTSTRAP: &str = "/v1/agents/bootstrap";
    /// The axum route pattern for [`heartbeat`].
    pub const HEARTBEAT_ROUTE: &str = "/v1/agents/{instance_id}/heartbeat";
    /// The axum route pattern for [`commands`].
    pub const COMMANDS_ROUTE: &str = "/v1/agents/{instance_id}/commands";
    /// The axum route pattern for [`events`].
    pub const EVENTS_ROUTE: &str = "/v1/agents/{instance_id}/events";

    /// `POST`: progress report, also the liveness signal.
    pub fn heartbeat(id: &InstanceId) -> String {
        format!("/v1/agents/{id}/heartbeat")
    }

    /// `GET` with query [`super::CommandsQuery`]: long poll for commands.
    pub fn commands(id: &InstanceId) -> String {
        format!("/v1/agents/{id}/commands")
    }

    /// `POST`: something happened on the agent (warning, exit, ...).
    pub fn events(id: &InstanceId) -> String {
        format!("/v1/agents/{id}/events")
    }

    /// The axum route pattern for [`checkpoint`].
    pub const CHECKPOINT_ROUTE: &str = "/v1/agents/{instance_id}/checkpoint";
    /// The axum route pattern for [`checkpoint_data`].
    pub const CHECKPOINT_DATA_ROUTE: &str = "/v1/agents/{instance_id}/checkpoint-data/{rank}";
    /// The axum route pattern for [`output`].
    pub const OUTPUT_ROUTE: &str = "/v1/agents/{instance_id}/output";
    /// The axum route pattern for [`workdir`].
    pub const WORKDIR_ROUTE: &str = "/v1/agents/{instance_id}/workdir";

    /// `GET`: where to fetch the job's `s3://` working directory (a gzipped tar).
    pub fn workdir(id: &InstanceId) -> String {
        format!("/v1/agents/{id}/workdir")
    }

    /// `GET` with query [`super::CheckpointQuery`]: where to put or fetch a rank's checkpoint.
    pub fn checkpoint(id: &InstanceId) -> String {
        format!("/v1/agents/{id}/checkpoint")
    }

    /// `PUT` / `GET`: a rank's checkpoint archive in the broker's own (directory) store.
    pub fn checkpoint_data(id: &InstanceId, rank: u32) -> String {
        format!("/v1/agents/{id}/checkpoint-data/{rank}")
    }

    /// `POST` (text body): the newest tail of a command job's output on this instance.
    pub fn output(id: &InstanceId) -> String {
        format!("/v1/agents/{id}/output")
    }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints of command jobs
// ---------------------------------------------------------------------------------------------

/// Which way a checkpoint moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CheckpointOp {
    Upload,
    Download,
}

/// Query of [`paths::checkpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointQuery {
    /// The rank whose checkpoint it is.
    pub rank: u32,
    pub op: CheckpointOp,
}

/// Where the agent sends (`PUT`) or fetches (`GET`) one rank's checkpoint archive (a gzipped
/// tar of `PROTEUS_CHECKPOINT_DIR`). The agent needs no cloud SDK: the broker hands it either a
/// presigned S3 URL or its own directory store's URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointTransfer {
    /// `PUT` for uploads, `GET` for downloads; a `GET` answered 404 means "no checkpoint yet".
    pub url: String,
    /// Send the agent's bearer token (the broker's own store). A presigned URL carries its
    /// authorisation in the query and must not get a second one.
    #[serde(default)]
    pub bearer: bool,
    /// Seconds the URL stays valid.
    #[serde(default)]
    pub expires_in_secs: u64,
}

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------

/// First message of an agent. The broker already knows the instance's tier (it bought it), so
/// the agent does not claim one. The agent learns what to train from the answer, loads its data
/// and then sends [`AgentEvent::Ready`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterRequest {
    /// The cloud's name for this VM (from `--instance-id` or IMDS `instance-id`).
    pub instance_id: InstanceId,
    /// `host:port` on which this agent accepts data-plane TCP from its peers.
    pub data_addr: String,
    /// CPUs the agent may use; lets the broker weigh work per machine.
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// `proteus-agent` version, for the broker's logs.
    #[serde(default)]
    pub agent_version: String,
    /// The agent protocol the agent speaks ([`PROTOCOL_VERSION`]); 0: an agent from before
    /// the protocol had a version.
    #[serde(default)]
    pub protocol_version: u32,
}

/// How a bootstrap token begins: the one-time token an instance's user data carries, good for
/// its downloads and for one [`paths::BOOTSTRAP`] exchange, never for the agent API.
pub const BOOTSTRAP_TOKEN_PREFIX: &str = "pb_";

/// The agent's first contact when its token is a bootstrap token ([`BOOTSTRAP_TOKEN_PREFIX`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BootstrapRequest {
    /// The instance the agent runs on, as its metadata says: the bootstrap token is good only
    /// for that instance.
    pub instance_id: InstanceId,
}

/// The agent token, in exchange for the bootstrap token (which is then dead). Its `Debug`
/// does not print the token.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BootstrapResponse {
    /// The agent token for every later call of the agent API.
    pub token: String,
}

impl std::fmt::Debug for BootstrapResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BootstrapResponse { token: .. }")
    }
}

/// The version of the protocol between a broker and its agents: what the agent API's messages
/// and the data plane mean. A broker and an agent of different versions refuse each other at
/// the hello (the registration), each naming both versions, rather than misreading each
/// other later. Raised with any change an older peer would misread.
/// Version 2: an instance's user data carries a bootstrap token, exchanged at the agent's first
/// contact ([`paths::BOOTSTRAP`]).
/// Version 3: an MLP job's plans come from the broker in the view ([`ClusterView::pipeline`]);
/// the member it names ([`ClusterView::profiler`]) sends its profile
/// ([`AgentEvent::PipelineProfile`]).
pub const PROTOCOL_VERSION: u32 = 3;

fn default_vcpus() -> u32 {
    1
}

/// What the broker tells a newly registered agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterResponse {
    pub job_id: JobId,
    pub instance_id: InstanceId,
    /// The tier the broker bought this instance in.
    pub tier: Tier,
    /// What to train and how.
    pub training: TrainingConfig,
    /// How often to send [`Heartbeat`]s; silence for `training.dead_member_timeout_ms` is death.
    #[serde(default = "default_heartbeat_interval_ms")]
    pub heartbeat_interval_ms: u64,
    /// Longest `wait_ms` the broker honours on the commands long poll.
    #[serde(default = "default_command_wait_ms")]
    pub command_wait_ms: u64,
    /// The job's data-plane secret: every connection between this job's agents proves it knows
    /// it (see `proteus_agent::transport`). Absent only from a broker that predates it, which
    /// the agent refuses.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub data_secret: Option<DataSecret>,
    /// The agent protocol the broker speaks ([`PROTOCOL_VERSION`]); 0: a broker from before
    /// the protocol had a version.
    #[serde(default)]
    pub protocol_version: u32,
}

/// A job's data-plane secret: 32 random bytes, hex on the wire.
///
/// It only crosses the authenticated (and, off loopback, TLS) control channel, and its `Debug`
/// and `Display` print `DataSecret(..)`, so that logging a [`RegisterResponse`] or a saved
/// coordinator at any level cannot leak it. The bytes are reachable only through
/// [`DataSecret::expose`], which the data plane's HMAC calls.
#[derive(Clone, PartialEq, Eq)]
pub struct DataSecret([u8; DataSecret::LEN]);

impl DataSecret {
    pub const LEN: usize = 32;

    /// Wraps bytes the caller drew from a cryptographic random source.
    pub fn from_bytes(bytes: [u8; DataSecret::LEN]) -> Self {
        DataSecret(bytes)
    }

    /// The key bytes, for the HMAC and nothing else.
    pub fn expose(&self) -> &[u8; DataSecret::LEN] {
        &self.0
    }
}

impl fmt::Debug for DataSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataSecret(..)")
    }
}

impl fmt::Display for DataSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataSecret(..)")
    }
}

impl Serialize for DataSecret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(2 * DataSecret::LEN);
        for b in self.0 {
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
        s.serialize_str(&out)
    }
}

impl<'de> Deserialize<'de> for DataSecret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        };
        let raw = text.as_bytes();
        if raw.len() != 2 * DataSecret::LEN {
            // Neither the value nor its prefix goes into the message.
            return Err(serde::de::Error::custom(format!(
                "a data secret is {} hex digits, got {}",
                2 * DataSecret::LEN,
                raw.len()
            )));
        }
        let mut bytes = [0u8; DataSecret::LEN];
        for (i, pair) in raw.chunks_exact(2).enumerate() {
            match (digit(pair[0]), digit(pair[1])) {
                (Some(h), Some(l)) => bytes[i] = (h << 4) | l,
                _ => return Err(serde::de::Error::custom("a data secret is hex digits only")),
            }
        }
        Ok(DataSecret(bytes))
    }
}

pub fn default_heartbeat_interval_ms() -> u64 {
    1_000
}
pub fn default_command_wait_ms() -> u64 {
    20_000
}

// ---------------------------------------------------------------------------------------------
// Training configuration
// ---------------------------------------------------------------------------------------------

/// Everything the agents of one job must agree on to train together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TrainingConfig {
    /// The application, its data set and hyperparameters.
    pub app: AppConfig,
    /// When training ends.
    #[serde(default)]
    pub stop: StopCondition,
    /// How workers wait for each other.
    #[serde(default)]
    pub sync: SyncModel,
    /// Number of parameter-server shards the model is split into (by key range).
    #[serde(default = "default_num_shards")]
    pub num_shards: u32,
    /// Number of input partitions; workers get contiguous runs of them. Fixed for the job so
    /// that a partition's data (and so the training trajectory) does not depend on how many
    /// workers there are.
    #[serde(default = "default_num_partitions")]
    pub num_partitions: u32,
    /// Clocks (BSP iterations) per pass over the input; one clock processes 1/`clocks_per_epoch`
    /// of every partition.
    #[serde(default = "default_clocks_per_epoch")]
    pub clocks_per_epoch: u32,
    /// How often an ActivePS copies its shards to their BackupPS. Work lost to a crash without
    /// warning is bounded by this.
    #[serde(default = "default_backup_sync_interval_ms")]
    pub backup_sync_interval_ms: u64,
    /// AgileML stage thresholds on transient:reliable.
    #[serde(default)]
    pub stages: StageThresholds,
    /// A member silent for this long is declared dead.
    #[serde(default = "default_dead_member_timeout_ms")]
    pub dead_member_timeout_ms: u64,
    /// Training starts once this many workers are placed; shards are placed before that.
    #[serde(default = "default_min_workers")]
    pub min_workers: u32,
    /// Seed for initialisation and data shuffling: same seed, same trajectory.
    #[serde(default)]
    pub seed: u64,
    /// Evaluate the test metric every this many epochs (0: only at the end).
    #[serde(default = "default_eval_every_epochs")]
    pub eval_every_epochs: u32,
    /// Evaluate every this many clocks instead, when non-zero (a benchmark's curve against wall
    /// time needs more points than one per epoch). See [`TrainingConfig::eval_interval_clocks`].
    #[serde(default)]
    pub eval_every_clocks: u32,
    /// Injected slowness and pacing of workers, for tests and benchmarks (none by default).
    #[serde(default)]
    pub stragglers: StragglerInjection,
}

pub fn default_num_shards() -> u32 {
    2
}
pub fn default_num_partitions() -> u32 {
    32
}
pub fn default_clocks_per_epoch() -> u32 {
    20
}
pub fn default_backup_sync_interval_ms() -> u64 {
    1_000
}
pub fn default_dead_member_timeout_ms() -> u64 {
    10_000
}
pub fn default_min_workers() -> u32 {
    1
}
pub fn default_eval_every_epochs() -> u32 {
    1
}

impl TrainingConfig {
    /// A configuration with every default, for `app`.
    pub fn new(app: AppConfig) -> Self {
        TrainingConfig {
            app,
            stop: StopCondition::default(),
            sync: SyncModel::default(),
            num_shards: default_num_shards(),
            num_partitions: default_num_partitions(),
            clocks_per_epoch: default_clocks_per_epoch(),
            backup_sync_interval_ms: default_backup_sync_interval_ms(),
            stages: StageThresholds::default(),
            dead_member_timeout_ms: default_dead_member_timeout_ms(),
            min_workers: default_min_workers(),
            seed: 0,
            eval_every_epochs: default_eval_every_epochs(),
            eval_every_clocks: 0,
            stragglers: StragglerInjection::default(),
        }
    }

    /// Clocks between evaluations of the test metric (0: only at the end):
    /// `eval_every_clocks` when set, else `eval_every_epochs` epochs.
    pub fn eval_interval_clocks(&self) -> u64 {
        if self.eval_every_clocks > 0 {
            u64::from(self.eval_every_clocks)
        } else {
            u64::from(self.eval_every_epochs) * u64::from(self.clocks_per_epoch)
        }
    }

    /// Total number of clocks the job runs.
    pub fn total_clocks(&self) -> u64 {
        match self.stop {
            StopCondition::Epochs { epochs } => {
                u64::from(epochs) * u64::from(self.clocks_per_epoch)
            }
            StopCondition::Clocks { clocks } => clocks,
        }
    }

    /// Reject configurations that would divide by zero or place nothing.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_shards == 0 {
            return Err("num_shards must be at least 1".into());
        }
        if self.num_partitions == 0 {
            return Err("num_partitions must be at least 1".into());
        }
        if self.clocks_per_epoch == 0 {
            return Err("clocks_per_epoch must be at least 1".into());
        }
        if self.total_clocks() == 0 {
            return Err("the stop condition allows no training at all".into());
        }
        if self
            .stages
            .stage2_ratio
            .partial_cmp(&self.stages.stage3_ratio)
            == Some(std::cmp::Ordering::Greater)
            || self.stages.stage2_ratio.is_nan()
            || self.stages.stage3_ratio.is_nan()
        {
            return Err(format!(
                "stage2_ratio ({}) must not exceed stage3_ratio ({})",
                self.stages.stage2_ratio, self.stages.stage3_ratio
            ));
        }
        self.sync.validate()?;
        self.stragglers.validate()?;
        self.app.validate()
    }
}

/// The training application. Data files are looked up in the agent's `--data-dir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AppConfig {
    /// Multinomial (softmax) logistic regression on image data, minibatch SGD.
    Mlr {
        #[serde(default)]
        dataset: ImageDataset,
        /// Step size applied to the minibatch-mean gradient.
        #[serde(default = "default_mlr_learning_rate")]
        learning_rate: f32,
        /// L2 penalty on the weights (not the biases).
        #[serde(default)]
        l2: f32,
    },
    /// Matrix factorisation with biases, trained by SGD on rating data.
    Mf {
        /// Ratings file (`user,item,rating,timestamp`, gzip or plain).
        #[serde(default = "default_ratings_file")]
        ratings_file: String,
        /// Latent factors per user and item.
        #[serde(default = "default_mf_rank")]
        rank: u32,
        #[serde(default = "default_mf_learning_rate")]
        learning_rate: f32,
        #[serde(default = "default_mf_l2")]
        l2: f32,
        /// Fraction of each user's ratings, latest by time, held out for evaluation.
        #[serde(default = "default_holdout_fraction")]
        holdout_fraction: f32,
    },
    /// No learning: a dense model of `model_len` floats whose workers push zeros. For
    /// benchmarks of the parameter server and of hand-over.
    Synthetic { model_len: u64 },
    /// A multilayer perceptron on image data (ReLU, softmax cross-entropy, SGD with momentum),
    /// trained across the job's workers pipeline-parallel (PipeDream: profiled partitioner, 1F1B,
    /// weight stashing, re-planned when a worker is warned) or data-parallel (ring all-reduce).
    /// The stop condition counts epochs, or minibatches as clocks.
    Mlp {
        #[serde(default)]
        dataset: ImageDataset,
        /// Widths of the hidden layers and the output (the input width is the data set's).
        #[serde(default = "default_mlp_layers")]
        layers: Vec<u32>,
        /// Minibatch per worker.
        #[serde(default = "default_mlp_batch")]
        batch: u32,
        #[serde(default = "default_mlp_learning_rate")]
        learning_rate: f32,
        #[serde(default = "default_mlp_momentum")]
        momentum: f32,
        #[serde(default)]
        parallelism: Parallelism,
        /// Emulated link bandwidth per connection between agents, Mbit/s (none when absent).
        #[serde(default)]
        link_mbit_per_sec: Option<f64>,
        /// Emulated one-way latency per message between agents, ms (none when absent).
        #[serde(default)]
        link_latency_ms: Option<f64>,
        /// The pipeline's schedule and vertical sync (`parallelism = "pipeline"`).
        #[serde(default)]
        pipeline: PipelineOptions,
    },
    /// The user's own program, run by the agent under the contract of `docs/command-jobs.md`.
    Command(CommandConfig),
}

/// A command job: what to run on each working instance and how (see `docs/command-jobs.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommandConfig {
    /// The program and its arguments (no shell: `["python3", "train.py"]`).
    pub run: Vec<String>,
    /// Run once per instance before `run` (installing dependencies, fetching data); empty: none.
    #[serde(default)]
    pub setup: Vec<String>,
    /// Extra environment variables for `setup` and `run`.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// The program's working directory: a local directory (local launcher), or an `s3://` URL
    /// fetched before `setup` on EC2. Default: a fresh directory per instance.
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub launcher: CommandLauncher,
    /// Failed runs (non-zero exit not caused by a notice) the job survives; one more fails it.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// How often the checkpoint directory is uploaded while the program runs, seconds.
    #[serde(default = "default_checkpoint_interval_secs")]
    pub checkpoint_interval_secs: u64,
    /// SIGKILL this many seconds before a notice's deadline if the program is still running,
    /// leaving that long to upload its checkpoint.
    #[serde(default = "default_kill_margin_secs")]
    pub kill_margin_secs: u64,
    /// When Proteus itself stops the program (a policy release, a scale-down, the job's end, a
    /// cancel): seconds between the notice and SIGKILL. Its final checkpoint is uploaded after
    /// it, and only then is the instance ended.
    #[serde(default = "default_grace_seconds")]
    pub grace_seconds: u64,
    /// `torchrun` only: the most nodes of the elastic rendezvous (`--nnodes=1:MAX`), the job's
    /// `limits.max_instances`.
    #[serde(default = "default_max_nodes")]
    pub max_nodes: u32,
}

/// How the agent starts a command job's program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CommandLauncher {
    /// `run` as given, once per working instance.
    #[default]
    Plain,
    /// `torchrun --nnodes=1:MAX --rdzv-backend=c10d ... <run>` (elastic), one worker per
    /// instance, the rendezvous hosted by [`ClusterView::rendezvous_host`].
    Torchrun,
}

pub fn default_max_restarts() -> u32 {
    3
}
pub fn default_checkpoint_interval_secs() -> u64 {
    60
}
pub fn default_kill_margin_secs() -> u64 {
    10
}
pub fn default_grace_seconds() -> u64 {
    30
}
/// The bounds of `command.grace_seconds`, seconds.
pub const GRACE_SECONDS_BOUNDS: std::ops::RangeInclusive<u64> = 1..=600;
pub fn default_max_nodes() -> u32 {
    1
}

/// `{"done": x, "total": y}` as a command job's program writes it to `PROTEUS_PROGRESS_FILE`
/// (any units).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProgramProgress {
    pub done: f64,
    pub total: f64,
}

impl ProgramProgress {
    /// `done / total` in `[0, 1]`; `None` unless both are finite and `total > 0`.
    pub fn fraction(&self) -> Option<f64> {
        (self.done.is_finite() && self.total.is_finite() && self.total > 0.0)
            .then(|| (self.done / self.total).clamp(0.0, 1.0))
    }
}

/// How an MLP job uses its workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Parallelism {
    /// Consecutive layers form stages on different workers (PipeDream).
    #[default]
    Pipeline,
    /// Every worker holds the whole model; gradients are all-reduced every step.
    Data,
}

/// How a pipeline schedules its forward and backward passes (`training.pipeline` of a spec).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PipelineOptions {
    #[serde(default)]
    pub schedule: PipelineSchedule,
    /// PipeDream's vertical sync: every stage runs a minibatch on the weight version the input
    /// stage had when it entered, so each minibatch sees one consistent model (1F1B only; the
    /// later stages keep older weight versions for it).
    #[serde(default)]
    pub vertical_sync: bool,
    /// Every stage sends its layers to the pipeline's leader and the next member every this
    /// many minibatches (rounded up to the plan's step), so that the pipeline restarts without
    /// a worker lost without warning from the newest snapshot, computing at most about this
    /// many minibatches again. 0: no snapshots, and such a loss ends the job.
    #[serde(default = "default_snapshot_every")]
    pub snapshot_every: u32,
    /// A pinned profile, one `{forward_ms, backward_ms, update_ms}` per layer of `layers`
    /// (milliseconds for one minibatch, each in [0, 3600000]): the broker plans from these
    /// times instead of a member's measurement (PipeDream's profile file), so every run of the
    /// job, and every job given the same profile, trains the same plans. Absent: one founder (a
    /// reliable one when there is one) profiles the model on its machine and sends the profile
    /// to the broker, which plans from it (the job's `pipeline_profile` event gives it in this
    /// form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<Vec<LayerTiming>>,
}

/// One layer's times in a pinned pipeline profile (`training.pipeline.profile`), milliseconds
/// for one minibatch of the job's size. Activation and parameter bytes follow from the layers'
/// widths.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LayerTiming {
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// One optimizer step of the layer.
    pub update_ms: f64,
}

impl PipelineOptions {
    /// A pinned profile fits a model of `layers` layers (one entry each), and its times are
    /// real durations, not all zero.
    pub fn check_profile(&self, layers: usize) -> Result<(), String> {
        match &self.profile {
            Some(profile) => LayerTiming::check_profile(profile, layers),
            None => Ok(()),
        }
    }
}

impl LayerTiming {
    /// A profile fits a model of `layers` layers (one entry each), and its times are real
    /// durations, not all zero: a pinned one, or one a member measured.
    pub fn check_profile(profile: &[LayerTiming], layers: usize) -> Result<(), String> {
        if profile.len() != layers {
            return Err(format!(
                "mlp pipeline profile has {} entries but the model {layers} layers (one entry \
                 per width of `layers`)",
                profile.len()
            ));
        }
        for (l, t) in profile.iter().enumerate() {
            t.check(l)?;
        }
        let total: f64 = profile
            .iter()
            .map(|t| t.forward_ms + t.backward_ms + t.update_ms)
            .sum();
        if total <= 0.0 {
            return Err("mlp pipeline profile takes no time at all".into());
        }
        Ok(())
    }

    fn check(&self, layer: usize) -> Result<(), String> {
        for (name, v) in [
            ("forward_ms", self.forward_ms),
            ("backward_ms", self.backward_ms),
            ("update_ms", self.update_ms),
        ] {
            if !(v.is_finite() && (0.0..=3_600_000.0).contains(&v)) {
                return Err(format!(
                    "mlp pipeline profile[{layer}].{name} must be in [0, 3600000] ms, got {v}"
                ));
            }
        }
        Ok(())
    }
}

fn default_snapshot_every() -> u32 {
    100
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            schedule: PipelineSchedule::default(),
            vertical_sync: false,
            snapshot_every: default_snapshot_every(),
            profile: None,
        }
    }
}

/// The order of a pipeline's passes and when it steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum PipelineSchedule {
    /// PipeDream's 1F1B with weight stashing: a step after every backward pass, up to warm-up + 1
    /// weight versions per stage.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// PipeDream-2BW: 1F1B's order with one step per group of minibatches (gradients
    /// accumulated), two weight versions per stage.
    #[serde(rename = "2bw")]
    TwoBW,
}

pub fn default_mlp_layers() -> Vec<u32> {
    vec![512, 512, 512, 10]
}
pub fn default_mlp_batch() -> u32 {
    64
}
pub fn default_mlp_learning_rate() -> f32 {
    0.02
}
pub fn default_mlp_momentum() -> f32 {
    0.9
}

pub fn default_mlr_learning_rate() -> f32 {
    0.5
}
pub fn default_ratings_file() -> String {
    "movietweetings-100k.csv.gz".into()
}
pub fn default_mf_rank() -> u32 {
    10
}
pub fn default_mf_learning_rate() -> f32 {
    0.01
}
pub fn default_mf_l2() -> f32 {
    0.05
}
pub fn default_holdout_fraction() -> f32 {
    0.1
}

/// Finite and above zero (NaN is neither).
fn positive(x: f32) -> bool {
    x.is_finite() && x > 0.0
}

fn non_negative(x: f32) -> bool {
    x.is_finite() && x >= 0.0
}

impl AppConfig {
    fn validate(&self) -> Result<(), String> {
        match self {
            AppConfig::Mlr {
                learning_rate, l2, ..
            } => {
                if !positive(*learning_rate) || !non_negative(*l2) {
                    return Err("mlr needs learning_rate > 0 and l2 >= 0".into());
                }
            }
            AppConfig::Mf {
                rank,
                learning_rate,
                l2,
                holdout_fraction,
                ..
            } => {
                if *rank == 0 || !positive(*learning_rate) || !non_negative(*l2) {
                    return Err("mf needs rank >= 1, learning_rate > 0 and l2 >= 0".into());
                }
                if !(0.0..1.0).contains(holdout_fraction) {
                    return Err("mf holdout_fraction must be in [0, 1)".into());
                }
            }
            AppConfig::Synthetic { model_len } => {
                if *model_len == 0 {
                    return Err("synthetic model_len must be at least 1".into());
                }
            }
            AppConfig::Mlp {
                layers,
                batch,
                learning_rate,
                momentum,
                link_mbit_per_sec,
                link_latency_ms,
                parallelism,
                pipeline,
                ..
            } => {
                if link_latency_ms
                    .is_some_and(|l| !(l.is_finite() && (0.0..=10_000.0).contains(&l)))
                {
                    return Err("mlp link_latency_ms must be in [0, 10000]".into());
                }
                if pipeline.vertical_sync && pipeline.schedule != PipelineSchedule::OneFOneB {
                    return Err(
                        "mlp pipeline vertical_sync applies to the 1f1b schedule only".into(),
                    );
                }
                if *pipeline != PipelineOptions::default() && *parallelism != Parallelism::Pipeline
                {
                    return Err("mlp pipeline options apply to parallelism = pipeline only".into());
                }
                if layers.is_empty() || layers.contains(&0) || *batch == 0 {
                    return Err("mlp needs at least one layer, widths >= 1 and batch >= 1".into());
                }
                pipeline.check_profile(layers.len())?;
                if !(positive(*learning_rate) && non_negative(*momentum) && *momentum < 1.0) {
                    return Err("mlp needs learning_rate > 0 and momentum in [0, 1)".into());
                }
                if link_mbit_per_sec.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
                    return Err("mlp link_mbit_per_sec must be > 0".into());
                }
            }
            AppConfig::Command(c) => {
                if c.run.first().is_none_or(|p| p.is_empty()) {
                    return Err("command needs a program to run".into());
                }
                if c.checkpoint_interval_secs == 0 {
                    return Err("command checkpoint_interval_secs must be at least 1".into());
                }
            }
        }
        Ok(())
    }

    /// Short name for logs and status pages.
    pub fn name(&self) -> &'static str {
        match self {
            AppConfig::Mlr { .. } => "mlr",
            AppConfig::Mf { .. } => "mf",
            AppConfig::Synthetic { .. } => "synthetic",
            AppConfig::Mlp { .. } => "mlp",
            AppConfig::Command(_) => "command",
        }
    }
}

/// Image data sets shipped in `data/ml`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ImageDataset {
    /// 60,000 training and 10,000 test images of 28×28.
    #[default]
    Mnist,
    /// 1,797 images of 8×8; the last 20% (by file order) are the test set.
    Digits,
}

impl ImageDataset {
    /// Pixels per image: an MLP's input width.
    pub fn input_width(self) -> u32 {
        match self {
            ImageDataset::Mnist => 28 * 28,
            ImageDataset::Digits => 8 * 8,
        }
    }
}

/// When a job's training is finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StopCondition {
    /// Passes over the training input.
    Epochs { epochs: u32 },
    /// Raw clock count, for tests and benchmarks.
    Clocks { clocks: u64 },
}

impl Default for StopCondition {
    fn default() -> Self {
        StopCondition::Epochs { epochs: 5 }
    }
}

/// How far workers may run ahead of each other, and whether they help each other.
///
/// JSON: `{"type": "bsp"}`, `{"type": "ssp", "slack": 1}`,
/// `{"type": "flexrr", "slack": 1, "helpers": 3}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SyncModel {
    /// Bulk synchronous: nobody starts clock `c` before every update of clock `c - 1` is in.
    Bsp,
    /// Stale synchronous with slack `s`: a worker at clock `c` may start once every update of
    /// clock `c - s - 1` is in (the slowest worker has finished clock `c - s - 1`, i.e. is at
    /// `c - s` or later); its reads include every update of clocks `<= c - s - 1`. `s = 0` is BSP.
    Ssp { slack: u32 },
    /// FlexRR: SSP with `slack` plus RapidReassignment. Each worker has a fixed helper group of
    /// `helpers` peers (the next ones in rank order); an idle helper takes a contiguous chunk
    /// of a slower peer's unprocessed input range of a clock, and a warned worker hands its
    /// unprocessed range to its helpers at once.
    Flexrr {
        #[serde(default = "default_flexrr_slack")]
        slack: u32,
        #[serde(default = "default_helper_group")]
        helpers: u32,
    },
}

/// Largest slack accepted: beyond this the model is asynchronous in all but name.
pub const MAX_SLACK: u32 = 64;
/// Largest helper group accepted.
pub const MAX_HELPER_GROUP: u32 = 16;

/// FlexRR's default slack: 0, i.e. BSP's semantics (and trajectory) with RapidReassignment
/// doing the balancing. See [`SyncModel::default`].
pub fn default_flexrr_slack() -> u32 {
    0
}
/// SSP's slack when a job spec names `ssp` without one.
pub fn default_ssp_slack() -> u32 {
    1
}
pub fn default_helper_group() -> u32 {
    3
}

impl Default for SyncModel {
    /// FlexRR with slack 0 and helper groups of 3, from `bench/straggler` (docs/sync-models.md):
    /// as fast as BSP without stragglers, within 10% of a perfectly balanced schedule with
    /// them (BSP: 2x slower), and with slack 0 the same updates as BSP, so the same accuracy;
    /// slack 1 bought a few percent more speed but moved the final accuracy by up to ±0.01.
    fn default() -> Self {
        SyncModel::Flexrr {
            slack: default_flexrr_slack(),
            helpers: default_helper_group(),
        }
    }
}

impl SyncModel {
    /// The slack `s` (0 for BSP).
    pub fn slack(self) -> u32 {
        match self {
            SyncModel::Bsp => 0,
            SyncModel::Ssp { slack } | SyncModel::Flexrr { slack, .. } => slack,
        }
    }

    /// Size of each worker's helper group under RapidReassignment (None: no reassignment).
    pub fn helper_group(self) -> Option<u32> {
        match self {
            SyncModel::Flexrr { helpers, .. } => Some(helpers),
            _ => None,
        }
    }

    /// `bsp`, `ssp` or `flexrr`.
    pub fn name(self) -> &'static str {
        match self {
            SyncModel::Bsp => "bsp",
            SyncModel::Ssp { .. } => "ssp",
            SyncModel::Flexrr { .. } => "flexrr",
        }
    }

    fn validate(self) -> Result<(), String> {
        if self.slack() > MAX_SLACK {
            return Err(format!("sync slack must be at most {MAX_SLACK}"));
        }
        if let Some(h) = self.helper_group()
            && !(1..=MAX_HELPER_GROUP).contains(&h)
        {
            return Err(format!(
                "flexrr helpers must be between 1 and {MAX_HELPER_GROUP}"
            ));
        }
        Ok(())
    }
}

impl fmt::Display for SyncModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncModel::Bsp => f.write_str("bsp"),
            SyncModel::Ssp { slack } => write!(f, "ssp (slack {slack})"),
            SyncModel::Flexrr { slack, helpers } => {
                write!(f, "flexrr (slack {slack}, helper groups of {helpers})")
            }
        }
    }
}

/// Slowness injected into workers, for tests and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StragglerInjection {
    #[serde(default)]
    pub pattern: StragglerPattern,
    /// Pace every worker at this many training samples per second (a fixed rate well below a
    /// core, so that a slowed worker's idle CPU does not speed the others up). None: as fast as
    /// the CPU allows; a slowdown then sleeps in proportion to the compute time.
    #[serde(default)]
    pub pace_samples_per_sec: Option<f64>,
}

/// Which workers are slowed, and when.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StragglerPattern {
    #[default]
    None,
    /// The worker of rank `rank` is always `slowdown` times slower (2: half speed).
    Persistent { rank: u32, slowdown: f64 },
    /// Each clock, each worker is independently `slowdown` times slower with `probability`
    /// (drawn from the job's seed, the worker's rank and the clock).
    Transient { probability: f64, slowdown: f64 },
}

impl StragglerInjection {
    fn validate(&self) -> Result<(), String> {
        if let Some(r) = self.pace_samples_per_sec
            && !positive_f64(r)
        {
            return Err("stragglers.pace_samples_per_sec must be a positive number".into());
        }
        match self.pattern {
            StragglerPattern::None => Ok(()),
            StragglerPattern::Persistent { slowdown, .. } if slowdown_ok(slowdown) => Ok(()),
            StragglerPattern::Transient {
                probability,
                slowdown,
            } if slowdown_ok(slowdown) && (0.0..=1.0).contains(&probability) => Ok(()),
            _ => Err("stragglers: slowdown must be in [1, 1000] and probability in [0, 1]".into()),
        }
    }
}

fn positive_f64(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn slowdown_ok(x: f64) -> bool {
    x.is_finite() && (1.0..=1000.0).contains(&x)
}

/// Switch points between the AgileML stages, on the ratio transient:reliable members.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StageThresholds {
    /// At or above this ratio, active shards move to transient machines (stage 2).
    #[serde(default = "default_stage2_ratio")]
    pub stage2_ratio: f64,
    /// At or above this ratio, reliable machines hold only backups and do no work (stage 3).
    #[serde(default = "default_stage3_ratio")]
    pub stage3_ratio: f64,
}

pub fn default_stage2_ratio() -> f64 {
    1.0
}
pub fn default_stage3_ratio() -> f64 {
    15.0
}

impl Default for StageThresholds {
    fn default() -> Self {
        StageThresholds {
            stage2_ratio: default_stage2_ratio(),
            stage3_ratio: default_stage3_ratio(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Heartbeats and progress
// ---------------------------------------------------------------------------------------------

/// Periodic report of an agent; its arrival is also what keeps the agent alive in the view.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Heartbeat {
    /// The newest [`ClusterView::epoch`] the agent has applied.
    #[serde(default)]
    pub applied_epoch: u64,
    #[serde(default)]
    pub progress: Progress,
}

/// Training progress as seen by one agent (its worker, if it has one).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Progress {
    /// Clocks this worker has completed; the next clock it works on.
    #[serde(default)]
    pub clock: u64,
    /// Fractional passes over the input at `clock`.
    #[serde(default)]
    pub epoch: f64,
    /// Training samples processed by this agent since it started.
    #[serde(default)]
    pub samples_processed: u64,
    /// Mean training loss over this agent's last clock.
    #[serde(default)]
    pub loss: Option<f64>,
    /// Latest evaluation on held-out data, if this agent made one.
    #[serde(default)]
    pub metric: Option<Metric>,
    /// Training samples per second over the last few clocks.
    #[serde(default)]
    pub samples_per_sec: f64,
    /// Parameter-server shards this agent serves (active) and holds (backup).
    #[serde(default)]
    pub active_shards: Vec<u32>,
    #[serde(default)]
    pub backup_shards: Vec<u32>,
    /// Command jobs: what the program last wrote to its progress file.
    #[serde(default)]
    pub program: Option<ProgramProgress>,
}

/// A held-out evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Metric {
    pub kind: MetricKind,
    /// NaN when the model diverged. JSON has no NaN: a non-finite value travels as `null` and
    /// is read back as NaN, so a diverged job still reports (and completes) instead of having
    /// every heartbeat refused.
    #[serde(with = "non_finite_as_null")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<f64>))]
    pub value: f64,
    /// The same metric for a trivial predictor (majority class; global mean rating), so a
    /// reader can tell whether the model learned anything.
    #[serde(default)]
    pub baseline: Option<f64>,
    /// Clock of the model that was evaluated.
    #[serde(default)]
    pub clock: u64,
}

/// A float that may be non-finite, as JSON can carry it: `null` for NaN and infinities.
mod non_finite_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// What [`Metric::value`] measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum MetricKind {
    /// Fraction of test samples classified correctly (higher is better).
    Accuracy,
    /// Root mean squared error of held-out ratings (lower is better).
    Rmse,
}

impl fmt::Display for MetricKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MetricKind::Accuracy => "accuracy",
            MetricKind::Rmse => "rmse",
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------------------------

/// Query of the commands long poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommandsQuery {
    /// Return only commands with `seq > after` (0 for "everything").
    #[serde(default)]
    pub after: u64,
    /// Hold the request up to this long when there is nothing new.
    #[serde(default)]
    pub wait_ms: u64,
}

/// A command with its per-agent sequence number (strictly increasing, starting at 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommandEnvelope {
    pub seq: u64,
    pub command: Command,
}

/// What the control plane asks an agent to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Command {
    /// Adopt this layout. A newer epoch supersedes older ones entirely; an agent absent from
    /// `members` hands over whatever it holds and exits.
    Configure(ClusterView),
    /// Leave: training is done or the job was cancelled.
    Stop { reason: String },
}

/// AgileML stage (see PAPERS.md §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Few transient machines: all shards on reliable machines, workers everywhere.
    Stage1,
    /// Active shards on transient machines, backups on reliable ones, workers everywhere.
    Stage2,
    /// Reliable machines hold only backups; only transient machines work.
    Stage3,
}

impl Stage {
    /// AgileML's stage for a footprint of `transient` and `reliable` working machines: the
    /// transient:reliable ratio against the job's thresholds. The one definition of the rule:
    /// the coordinator lays shards out by it, and the broker's work accounting credits
    /// reliable machines with training work only when [`Stage::reliable_machines_train`].
    pub fn for_counts(transient: usize, reliable: usize, thresholds: &StageThresholds) -> Stage {
        let ratio = match (transient, reliable) {
            (0, _) => 0.0,
            (_, 0) => f64::INFINITY,
            (t, r) => t as f64 / r as f64,
        };
        if ratio >= thresholds.stage3_ratio {
            Stage::Stage3
        } else if ratio >= thresholds.stage2_ratio {
            Stage::Stage2
        } else {
            Stage::Stage1
        }
    }

    /// Whether reliable machines run workers in this stage (in stage 3 they hold only backups).
    pub fn reliable_machines_train(self) -> bool {
        self != Stage::Stage3
    }

    pub fn number(self) -> u8 {
        match self {
            Stage::Stage1 => 1,
            Stage::Stage2 => 2,
            Stage::Stage3 => 3,
        }
    }
}

/// Half-open range `[start, end)` of flattened model indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KeyRange {
    pub start: u64,
    pub end: u64,
}

impl KeyRange {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// Half-open range `[start, end)` of input partition numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PartitionRange {
    pub start: u32,
    pub end: u32,
}

impl PartitionRange {
    pub fn len(&self) -> u32 {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    pub fn contains(&self, p: u32) -> bool {
        self.start <= p && p < self.end
    }
    pub fn iter(&self) -> std::ops::Range<u32> {
        self.start..self.end
    }
}

/// One member of the job in a view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemberInfo {
    pub instance_id: InstanceId,
    pub tier: Tier,
    /// Where peers reach it over TCP.
    pub data_addr: String,
    /// A rebalance recommendation was received: it keeps working but holds no shard.
    #[serde(default)]
    pub draining: bool,
}

/// Where the active owner of a shard gets the shard's state when it does not hold it yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ShardSource {
    /// A new job: initialise from the application's seed.
    Fresh,
    /// The previous active owner is alive and pushes its final state; if it does not arrive in
    /// time, restore from `fallback` (a backup holder) instead.
    Handover {
        from: InstanceId,
        #[serde(default)]
        fallback: Option<InstanceId>,
    },
    /// The previous owner is gone without hand-over: the copy held by `from` (a BackupPS, or the
    /// new owner itself) is promoted; updates after its last background sync are lost.
    Restore { from: InstanceId },
    /// The owner died and there was no backup: the shard is re-initialised (logged loudly).
    Lost,
}

/// Placement of one shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ShardPlacement {
    pub shard: u32,
    pub keys: KeyRange,
    /// The ActivePS: serves pulls and pushes.
    pub active: InstanceId,
    /// The BackupPS, kept current in the background; none in stage 1.
    #[serde(default)]
    pub backup: Option<InstanceId>,
    /// How `active` obtains the state if it does not have it (unchanged while `active` is).
    pub source: ShardSource,
}

/// One worker's share of the input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkerAssignment {
    pub instance_id: InstanceId,
    /// Position among the workers (0-based); rank 0 evaluates the test metric during training.
    pub rank: u32,
    pub partitions: PartitionRange,
}

/// The whole layout of a job at one epoch. Every agent gets the same view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterView {
    /// Strictly increasing; a change of anything below gives a new epoch.
    pub epoch: u64,
    pub stage: Stage,
    /// Members in instance-id order. Members that were warned are no longer here.
    pub members: Vec<MemberInfo>,
    /// One placement per shard, in shard order; key ranges tile `[0, model_len)`.
    pub shards: Vec<ShardPlacement>,
    /// Workers in rank order; partition ranges tile `[0, num_partitions)`. Empty until
    /// `min_workers` are available.
    pub workers: Vec<WorkerAssignment>,
    pub num_partitions: u32,
    pub model_len: u64,
    /// MLP jobs: the workers of the job's first layout, in rank order, for the job's whole life.
    /// They are the pipeline's (or data parallelism's) founding workers and keep their numbers
    /// (positions here) across re-plans; a worker not listed joined later and is folded in by
    /// the pipeline's leader. Empty for other jobs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    pub founders: Vec<InstanceId>,
    /// MLP jobs: the plans the broker computed for the founders, one per worker count; absent
    /// until it has them. Every member trains these plans (re-planning is a lookup here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelinePlans>,
    /// MLP pipeline jobs without a pinned profile, while the plans are absent: the founder
    /// asked to profile the model and send it ([`AgentEvent::PipelineProfile`]) — a reliable
    /// one whenever there is one, so the measurement is not lost with a spot instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub profiler: Option<InstanceId>,
}

/// The broker's plans for an MLP job: one per worker count `1..=plans.len()` (the founders'),
/// in that order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PipelinePlans {
    /// What the plans were computed from.
    pub source: PlanSource,
    pub plans: Vec<PipelinePlan>,
}

/// Where an MLP job's plans come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PlanSource {
    /// Data parallelism: every worker computes every layer; no profile needed.
    DataParallel,
    /// The job's pinned profile (`training.pipeline.profile`).
    Pinned,
    /// A profile one member measured.
    Measured {
        #[cfg_attr(feature = "openapi", schema(value_type = String))]
        by: InstanceId,
        profile: Vec<LayerTiming>,
    },
}

/// One plan: consecutive stages covering every layer, each on `replicas` workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PipelinePlan {
    pub stages: Vec<PipelineStagePlan>,
    /// The cost model's seconds per minibatch.
    pub predicted_secs: f64,
}

/// A stage of a plan: layers `first_layer..end_layer` on `replicas` workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PipelineStagePlan {
    pub first_layer: u32,
    pub end_layer: u32,
    pub replicas: u32,
}

impl PipelinePlan {
    /// Workers the plan occupies.
    pub fn workers(&self) -> u32 {
        self.stages.iter().map(|s| s.replicas).sum()
    }
}

impl ClusterView {
    pub fn member(&self, id: &InstanceId) -> Option<&MemberInfo> {
        self.members.iter().find(|m| &m.instance_id == id)
    }
    pub fn worker(&self, id: &InstanceId) -> Option<&WorkerAssignment> {
        self.workers.iter().find(|w| &w.instance_id == id)
    }
    pub fn shard(&self, shard: u32) -> Option<&ShardPlacement> {
        self.shards.iter().find(|s| s.shard == shard)
    }
    /// Who works on partition `p`.
    pub fn partition_owner(&self, p: u32) -> Option<&InstanceId> {
        self.workers
            .iter()
            .find(|w| w.partitions.contains(p))
            .map(|w| &w.instance_id)
    }
    pub fn data_addr(&self, id: &InstanceId) -> Option<&str> {
        self.member(id).map(|m| m.data_addr.as_str())
    }
    /// Who hosts a `torchrun` job's rendezvous (torch's TCPStore, at its `data_addr`): the
    /// first working member of the reliable tier, so the rendezvous outlives any spot node;
    /// the first worker when no reliable member works. Every agent reads the same view, so all
    /// agree; the host changes only when it leaves the layout.
    pub fn rendezvous_host(&self) -> Option<&MemberInfo> {
        let works = |m: &&MemberInfo| self.worker(&m.instance_id).is_some();
        self.members
            .iter()
            .filter(works)
            .find(|m| m.tier == Tier::Reliable && !m.draining)
            .or_else(|| {
                self.workers
                    .first()
                    .and_then(|w| self.member(&w.instance_id))
            })
    }
}

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------

/// Something that happened on an agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentEvent {
    /// IMDS announced that the instance will be stopped/terminated at `action_time`.
    InterruptionWarning {
        /// `terminate`, `stop` or `hibernate`, as IMDS said.
        action: String,
        /// RFC 3339, as IMDS said.
        action_time: String,
    },
    /// IMDS published a rebalance recommendation: the instance is at elevated risk.
    RebalanceRecommendation {
        #[serde(default)]
        notice_time: Option<String>,
    },
    /// This agent finished moving `shard` to `to` (its state up to `seq`).
    HandoverComplete {
        shard: u32,
        to: InstanceId,
        seq: u64,
    },
    /// The agent loaded its data and can take roles. Until then it is registered but gets no
    /// role. `model_len` is the number of f32 parameters of the model it computed from the data:
    /// every agent of a job must agree (else 400); the coordinator splits this key space into
    /// shards.
    Ready { model_len: u64 },
    /// A worker completed the last clock and evaluated the final model.
    TrainingComplete { metric: Metric },
    /// Pipeline jobs: after a re-plan (a stage was warned or lost, or a worker joined), this
    /// worker took its first optimizer step on the plan for `workers` workers, `pause_ms` after
    /// the pipeline drained; the plan starts at minibatch `from` (after a lost worker, the
    /// snapshot it restarted from). `segment` counts the plans the run has had (1 after the
    /// first re-plan).
    PipelineResumed {
        segment: u32,
        #[serde(default)]
        from: u64,
        workers: u32,
        pause_ms: u64,
    },
    /// MLP pipeline jobs: the profile the view's `profiler` measured on its machine, one entry
    /// per layer; the broker plans from it. Taken only from the profiler, once.
    PipelineProfile { layers: Vec<LayerTiming> },
    /// The agent is about to exit.
    Exit { reason: ExitReason },
    /// A command job's agent applied layout `epoch`, which gives it no rank, and runs no
    /// program: the broker may move its rank (see the coordinator's rank rules). Sent whenever
    /// such a layout arrives while no program runs, so an agent that skipped the layouts in
    /// between (a slow long poll sees only the newest) still says so.
    ProgramIdle { epoch: u64 },
    /// A command job's program ended (see `docs/command-jobs.md` for how this maps to the
    /// job's state).
    ProgramExited {
        /// Exit code, when it exited on its own.
        #[serde(default)]
        code: Option<i32>,
        /// The signal that ended it, otherwise.
        #[serde(default)]
        signal: Option<i32>,
        /// It ended after an interruption notice (or because the instance left the layout):
        /// never counts as a failure.
        #[serde(default)]
        after_notice: bool,
        /// This exit completes the job (0 with `done >= total`, or rank 0 without progress).
        #[serde(default)]
        completes: bool,
    },
}

/// Why an agent leaves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExitReason {
    /// It received [`Command::Stop`].
    Stopped,
    /// It handed over after an interruption warning.
    Interrupted,
    /// Something broke; the message says what (at most [`MAX_FAILURE_MESSAGE`] characters,
    /// no control characters but line breaks and tabs: the broker refuses others).
    Failed { message: String },
}

/// The longest failure message an [`ExitReason::Failed`] may carry.
pub const MAX_FAILURE_MESSAGE: usize = 1024;

impl ExitReason {
    /// A failure whose message is cut to what the broker accepts.
    pub fn failed(message: &str) -> ExitReason {
        let message = message
            .chars()
            .filter(|c| !c.is_control() || *c == '\n' || *c == '\t')
            .take(MAX_FAILURE_MESSAGE)
            .collect();
        ExitReason::Failed { message }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// JSON body of every non-2xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiError {
    /// Machine-readable: `unauthorized`, `forbidden`, `not_found`, `job_over`, `bad_request`.
    pub code: String,
    /// Human-readable explanation.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluation_every_n_clocks_overrides_every_n_epochs() {
        let mut cfg = TrainingConfig::new(AppConfig::Synthetic { model_len: 8 });
        cfg.clocks_per_epoch = 20;
        cfg.eval_every_epochs = 2;
        assert_eq!(cfg.eval_interval_clocks(), 40);
        cfg.eval_every_clocks = 3;
        assert_eq!(cfg.eval_interval_clocks(), 3);
        cfg.eval_every_clocks = 0;
        cfg.eval_every_epochs = 0;
        assert_eq!(cfg.eval_interval_clocks(), 0, "0: only at the end");
        // Older job specs and agents without the field read it as 0.
        let mut json = serde_json::to_value(&cfg).expect("serialises");
        json.as_object_mut().map(|o| o.remove("eval_every_clocks"));
        let back: TrainingConfig = serde_json::from_value(json).expect("reads");
        assert_eq!(back.eval_every_clocks, 0);
    }

    #[test]
    fn a_diverged_metric_travels_as_null_and_comes_back_as_nan() {
        let diverged = Metric {
            kind: MetricKind::Rmse,
            value: f64::NAN,
            baseline: Some(1.8),
            clock: 12,
        };
        // The event an agent sends when its model diverged, and the progress in its heartbeats:
        // both must still be JSON the broker can read (serde_json refuses NaN otherwise).
        let event = serde_json::to_string(&AgentEvent::TrainingComplete { metric: diverged })
            .expect("serialises");
        assert!(event.contains(r#""value":null"#), "{event}");
        let back: AgentEvent = serde_json::from_str(&event).expect("reads back");
        let AgentEvent::TrainingComplete { metric } = back else {
            panic!("{back:?}")
        };
        assert!(metric.value.is_nan());
        assert_eq!(
            (metric.kind, metric.baseline, metric.clock),
            (MetricKind::Rmse, Some(1.8), 12)
        );
        let progress = Progress {
            metric: Some(Metric {
                value: f64::INFINITY,
                ..diverged
            }),
            ..Progress::default()
        };
        let json = serde_json::to_string(&progress).expect("serialises");
        let back: Progress = serde_json::from_str(&json).expect("reads back");
        assert!(back.metric.is_some_and(|m| m.value.is_nan()));
        // A finite value is untouched.
        let fine = Metric {
            value: 0.9125,
            ..diverged
        };
        let back: Metric = serde_json::from_str(&serde_json::to_string(&fine).expect("serialises"))
            .expect("reads");
        assert_eq!(back, fine);
    }

    #[test]
    fn failure_messages_are_cut_to_what_the_broker_takes() {
        let long = format!("{}\u{0}", "é".repeat(MAX_FAILURE_MESSAGE + 5));
        let ExitReason::Failed { message } = ExitReason::failed(&long) else {
            unreachable!()
        };
        assert_eq!(message.chars().count(), MAX_FAILURE_MESSAGE);
        let ExitReason::Failed { message } = ExitReason::failed("a\u{7}b\n\tc") else {
            unreachable!()
        };
        assert_eq!(message, "ab\n\tc");
    }

    #[test]
    fn training_config_fills_defaults_from_minimal_json() {
        let cfg: TrainingConfig = serde_json::from_str(r#"{"app":{"type":"mlr"}}"#).unwrap();
        assert_eq!(cfg.num_shards, 2);
        assert_eq!(cfg.sync, SyncModel::default());
        assert_eq!(cfg.stop, StopCondition::Epochs { epochs: 5 });
        assert_eq!(
            cfg.app,
            AppConfig::Mlr {
                dataset: ImageDataset::Mnist,
                learning_rate: 0.5,
                l2: 0.0
            }
        );
        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.total_clocks(), 100);
    }

    #[test]
    fn commands_are_tagged_snake_case() {
        let c = Command::Stop {
            reason: "done".into(),
        };
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(s, r#"{"type":"stop","reason":"done"}"#);
        let e = AgentEvent::InterruptionWarning {
            action: "terminate".into(),
            action_time: "2026-01-01T00:00:00Z".into(),
        };
        let s = serde_json::to_value(&e).unwrap();
        assert_eq!(s["type"], "interruption_warning");
    }

    #[test]
    fn paths_embed_instance_id() {
        let id = InstanceId("i-1".into());
        assert_eq!(paths::heartbeat(&id), "/v1/agents/i-1/heartbeat");
        assert_eq!(paths::commands(&id), "/v1/agents/i-1/commands");
        assert_eq!(paths::events(&id), "/v1/agents/i-1/events");
    }

    #[test]
    fn sync_models_are_tagged_and_validated() {
        let cfg: TrainingConfig =
            serde_json::from_str(r#"{"app":{"type":"mlr"},"sync":{"type":"ssp","slack":2}}"#)
                .unwrap();
        assert_eq!(cfg.sync, SyncModel::Ssp { slack: 2 });
        let f: SyncModel = serde_json::from_str(r#"{"type":"flexrr"}"#).unwrap();
        assert_eq!(
            f,
            SyncModel::Flexrr {
                slack: 0,
                helpers: 3
            }
        );
        assert_eq!(SyncModel::default(), f);
        let mut cfg = TrainingConfig::new(AppConfig::Synthetic { model_len: 10 });
        cfg.sync = SyncModel::Flexrr {
            slack: 0,
            helpers: 0,
        };
        assert!(cfg.validate().is_err());
        cfg.sync = SyncModel::Ssp { slack: 65 };
        assert!(cfg.validate().is_err());
        cfg.sync = SyncModel::Bsp;
        cfg.stragglers.pattern = StragglerPattern::Transient {
            probability: 1.5,
            slowdown: 4.0,
        };
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn validation_rejects_inverted_stage_thresholds() {
        let mut cfg = TrainingConfig::new(AppConfig::Synthetic { model_len: 10 });
        cfg.stages.stage2_ratio = 5.0;
        cfg.stages.stage3_ratio = 2.0;
        assert!(cfg.validate().is_err());
    }
}
