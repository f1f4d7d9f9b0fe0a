//! The job spec users submit (`POST /v1/jobs`, `proteus submit FILE`), and its validation into
//! what the broker runs: the agents' training configuration, the policy's work model, limits.
//!
//! ```json
//! {
//!   "name": "mnist-lr",
//!   "app": "mlr", "dataset": "mnist",
//!   "stop": {"epochs": 5},
//!   "policy": "bidbrain",
//!   "limits": {"max_instances": 8, "max_reliable_instances": 1, "budget_usd": 20.0, "deadline_hours": 12},
//!   "billing": "hourly-2015",
//!   "work": {"total_work": 20, "instance_types": ["c3.xlarge", "r3.large"]},
//!   "training": {"learning_rate": 0.5, "num_shards": 2, "seed": 7, "sync": "flexrr", "slack": 1}
//! }
//! ```
//! Unknown fields are refused, so a typo is an error rather than a silently ignored setting.

use crate::billing::BillingModel;
use crate::job::WorkModelSpec;
use crate::market::{InstanceType, Timestamp, Usd};
use proteus_wire::agent_api::{
    AppConfig, CommandConfig, CommandLauncher, ImageDataset, MAX_HELPER_GROUP, MAX_SLACK,
    Parallelism, PipelineOptions, PipelineSchedule, StopCondition, SyncModel, TrainingConfig,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// Names of credentials a job's `env` may not set: a job spec is stored and shown to every API
/// user, and the broker's own secrets must never reach a program by name either.
pub(crate) const SECRET_VARS: [&str; 8] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "DATABASE_URL",
];

/// Serde would take a struct from a sequence of its fields in order (`"work": [1.0, …]`): a
/// spec's tables are tables only, as its schema says.
mod table {
    use serde::de::value::MapAccessDeserializer;
    use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
    use std::fmt;
    use std::marker::PhantomData;

    struct Table<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for Table<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a table (an object)")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            T::deserialize(MapAccessDeserializer::new(map))
        }
    }

    struct Optional<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for Optional<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a table (an object) or null")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
            required(d).map(Some)
        }
    }

    pub fn required<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
        d.deserialize_map(Table(PhantomData))
    }

    pub fn optional<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        d.deserialize_option(Optional(PhantomData))
    }
}

/// A training job as submitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// A label for lists and reports. Default: `<app>-<dataset>`.
    #[serde(default)]
    pub name: Option<String>,
    /// `mlr` (multinomial logistic regression), `mf` (matrix factorisation), `mlp` (a
    /// multilayer perceptron, pipeline- or data-parallel; see docs/pipeline.md) or `command`
    /// (your own program, see docs/command-jobs.md and the `command` table).
    pub app: App,
    /// `mnist` or `digits` for `mlr` and `mlp`; a ratings file in the agents' data directory for `mf`
    /// (default `movietweetings-100k.csv.gz`).
    #[serde(default)]
    pub dataset: Option<String>,
    /// When training ends. Default: 5 epochs.
    #[serde(default, deserialize_with = "table::optional")]
    pub stop: Option<StopSpec>,
    /// A policy in the broker's policies directory: `bidbrain`, `on-demand`, `standard-bidding`.
    #[schema(min_length = 1, max_length = 64, pattern = "^[a-z0-9_-]+$")]
    pub policy: String,
    #[serde(deserialize_with = "table::required")]
    pub limits: Limits,
    /// `hourly-2015` or `per-second`. Default: the broker's (`--billing`).
    #[serde(default)]
    pub billing: Option<String>,
    /// The work estimate the policy plans with; see [`WorkSpec`].
    #[serde(default, deserialize_with = "table::optional")]
    pub work: Option<WorkSpec>,
    /// What each instance must have, as SkyPilot users write it: the job runs on the types the
    /// broker has prices for that have all of it (among `work.instance_types` when given too).
    /// The types chosen are stored with the job and shown at submission.
    #[serde(default, deserialize_with = "table::optional")]
    pub resources: Option<ResourcesSpec>,
    /// Training hyperparameters and AgileML settings.
    #[serde(default, deserialize_with = "table::optional")]
    pub training: Option<TrainingSpec>,
    /// `app = "command"` only: the program to run.
    #[serde(default, deserialize_with = "table::optional")]
    pub command: Option<CommandSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum App {
    Mlr,
    Mf,
    Mlp,
    Command,
}

/// A command job's program (see docs/command-jobs.md for the contract it runs under).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// The program and its arguments, no shell: `["python3", "train.py", "--lr", "0.1"]`.
    #[schema(min_items = 1)]
    pub run: Vec<String>,
    /// Run once per instance before `run` (e.g. `["pip", "install", "-r", "req.txt"]`).
    #[serde(default)]
    #[schema(min_items = 1)]
    pub setup: Option<Vec<String>>,
    /// Extra environment variables (names `PROTEUS_*` are the contract's and refused).
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    /// The working directory: an absolute local path (local agents), or one gzipped tar object
    /// `s3://bucket/path/name.tar.gz` (or `.tgz`) under a plain key. Default: a fresh directory
    /// per instance.
    #[serde(default)]
    pub workdir: Option<String>,
    /// `plain` (default): `run` once per working instance.
    #[serde(default)]
    pub launcher: Option<CommandLauncher>,
    /// Failed runs the job survives (0–100, default 3).
    #[serde(default)]
    #[schema(minimum = 0, maximum = 100)]
    pub max_restarts: Option<u32>,
    /// Seconds between checkpoint uploads while the program runs (1–86400, default 60).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 86400)]
    pub checkpoint_interval_secs: Option<u64>,
    /// SIGKILL this many seconds before a notice's deadline (0–600, default 10).
    #[serde(default)]
    #[schema(minimum = 0, maximum = 600)]
    pub kill_margin_secs: Option<u64>,
    /// When Proteus stops the program itself (a release, a scale-down, the job's end, a
    /// cancel): seconds from the notice to SIGKILL; the final checkpoint is uploaded after it,
    /// and only then is the instance ended (1–600, default 30).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 600)]
    pub grace_seconds: Option<u64>,
}

impl CommandSpec {
    /// `max_instances`: the job's limit, the most nodes of a `torchrun` rendezvous.
    fn config(&self, max_instances: u32) -> Result<CommandConfig, FieldError> {
        let argv = |field: &str, v: &[String]| -> Result<(), FieldError> {
            if v.first().is_none_or(|p| p.trim().is_empty()) {
                return Err(bad(
                    field,
                    "must name a program, e.g. [\"python3\", \"train.py\"]",
                ));
            }
            if let Some(i) = v.iter().position(|a| a.contains('\0')) {
                return Err(bad(
                    &format!("{field}[{i}]"),
                    "must not contain a NUL character",
                ));
            }
            Ok(())
        };
        argv("command.run", &self.run)?;
        if let Some(setup) = &self.setup {
            argv("command.setup", setup)?;
        }
        let env = self.env.clone().unwrap_or_default();
        for (k, v) in &env {
            let valid = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(bad(
                    &format!("command.env.{k}"),
                    "an environment variable name: letters, digits and `_`, not starting with a digit",
                ));
            }
            if k.starts_with("PROTEUS_") {
                return Err(bad(
                    &format!("command.env.{k}"),
                    "`PROTEUS_*` variables are set by the agent (see docs/command-jobs.md)",
                ));
            }
            if SECRET_VARS.contains(&k.as_str()) {
                return Err(bad(
                    &format!("command.env.{k}"),
                    "credentials do not belong in a job spec (it is stored and shown to every \
                     API user): give the program an instance role or its own secret store",
                ));
            }
            if v.contains('\0') {
                return Err(bad(
                    &format!("command.env.{k}"),
                    "must not contain a NUL character",
                ));
            }
        }
        if let Some(w) = &self.workdir {
            if w.starts_with("s3://") {
                let (_, key) =
                    crate::checkpoint::parse_s3_url(w).map_err(|e| bad("command.workdir", e))?;
                if !(key.ends_with(".tar.gz") || key.ends_with(".tgz")) {
                    return Err(bad(
                        "command.workdir",
                        "an s3:// working directory is one gzipped tar object: \
                         `s3://bucket/path/name.tar.gz` (or `.tgz`)",
                    ));
                }
                // One spelling per object: no `a//b`, `./a` or `a/../b`, which S3 would take
                // literally but readers of the spec (and of the broker's checks) would not.
                if key
                    .split('/')
                    .any(|seg| seg.is_empty() || seg == "." || seg == "..")
                    || key.chars().any(char::is_control)
                {
                    return Err(bad(
                        "command.workdir",
                        "the object key must be a plain path: no empty, `.` or `..` segments, \
                         no control characters",
                    ));
                }
            } else if !w.starts_with('/') || w.contains('\0') {
                return Err(bad(
                    "command.workdir",
                    "must be an absolute path or an `s3://bucket/name.tar.gz` URL",
                ));
            }
        }
        let launcher = self.launcher.unwrap_or_default();
        let max_restarts = self
            .max_restarts
            .unwrap_or(proteus_wire::agent_api::default_max_restarts());
        if max_restarts > 100 {
            return Err(bad("command.max_restarts", "must be between 0 and 100"));
        }
        let interval = self
            .checkpoint_interval_secs
            .unwrap_or(proteus_wire::agent_api::default_checkpoint_interval_secs());
        if !(1..=86_400).contains(&interval) {
            return Err(bad(
                "command.checkpoint_interval_secs",
                "must be between 1 and 86400",
            ));
        }
        let margin = self
            .kill_margin_secs
            .unwrap_or(proteus_wire::agent_api::default_kill_margin_secs());
        if margin > 600 {
            return Err(bad("command.kill_margin_secs", "must be between 0 and 600"));
        }
        let bounds = proteus_wire::agent_api::GRACE_SECONDS_BOUNDS;
        let grace = self
            .grace_seconds
            .unwrap_or(proteus_wire::agent_api::default_grace_seconds());
        if !bounds.contains(&grace) {
            return Err(bad(
                "command.grace_seconds",
                format!(
                    "must be between {} and {} (got {grace})",
                    bounds.start(),
                    bounds.end()
                ),
            ));
        }
        Ok(CommandConfig {
            run: self.run.clone(),
            setup: self.setup.clone().unwrap_or_default(),
            env,
            workdir: self.workdir.clone(),
            launcher,
            max_restarts,
            checkpoint_interval_secs: interval,
            kill_margin_secs: margin,
            grace_seconds: grace,
            max_nodes: max_instances,
        })
    }
}

/// Exactly one of the two.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StopSpec {
    /// Passes over the training data.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
    pub epochs: Option<u32>,
    /// Training iterations (BSP clocks).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100000000)]
    pub clocks: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Most instances at once, reliable ones included (1–1000).
    #[schema(minimum = 1, maximum = 1000)]
    pub max_instances: u32,
    /// Most on-demand (reliable) instances; at least 1, for the backup parameter servers, and
    /// at most `max_instances`. Default: an eighth of `max_instances`, at least 1.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000)]
    pub max_reliable_instances: Option<u32>,
    /// Most capacity at once, in work units per hour (instance-hours of the reference type per
    /// hour) summed over the instances held.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0)]
    pub max_capacity: Option<f64>,
    /// Stop the job (and its spending) once the ledger reaches this many dollars.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0)]
    pub budget_usd: Option<f64>,
    /// Stop the job at this market time (RFC 3339) ...
    #[serde(default)]
    #[schema(schema_with = crate::market::nullable_time_schema)]
    pub deadline: Option<String>,
    /// ... or this many market hours after submission. Policies pace the job against it. A
    /// deadline that `work.total_work` cannot meet even on on-demand at full width (every
    /// instance of the fastest type, after one start-up) is refused at submission, with the
    /// arithmetic.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 8760.0)]
    pub deadline_hours: Option<f64>,
}

/// What each instance of a job must have.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    /// GPUs per instance, `MODEL:COUNT` or `MODEL` (one), e.g. `V100:1`, `K520:4`, `T4`: the
    /// types with exactly that many of that model (K520, K80, V100, T4, A10G; any case). The
    /// count is 1 to 16.
    #[serde(default)]
    #[schema(example = "V100:1")]
    pub accelerators: Option<String>,
    /// At least this many vCPUs per instance.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1024, example = 8)]
    pub vcpus: Option<u32>,
    /// At least this much memory per instance, GiB.
    #[serde(default)]
    #[schema(minimum = 0.5, maximum = 24576, example = 16)]
    pub memory_gib: Option<f64>,
}

/// [`ResourcesSpec`], checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Resources {
    /// GPU model (as the catalog spells it) and count.
    pub accelerator: Option<(String, u32)>,
    pub vcpus: Option<u32>,
    pub memory_gib: Option<f64>,
}

impl Resources {
    fn parse(spec: &ResourcesSpec) -> Result<Resources, FieldError> {
        let accelerator = match &spec.accelerators {
            None => None,
            Some(text) => {
                let (name, count) = text.split_once(':').unwrap_or((text, "1"));
                // Decimal digits, no sign, no leading zero: what the document's pattern says.
                let count: u32 = Some(count)
                    .filter(|c| c.bytes().all(|b| b.is_ascii_digit()) && !c.starts_with('0'))
                    .and_then(|c| c.parse().ok())
                    .filter(|c| (1..=16).contains(c))
                    .ok_or_else(|| {
                        bad(
                            "resources.accelerators",
                            format!(
                                "`{text}`: the count after `:` must be a whole number from 1 to 16"
                            ),
                        )
                    })?;
                let known = crate::prices::catalog::accelerator_names();
                let Some(model) = known.iter().find(|k| k.eq_ignore_ascii_case(name)) else {
                    return Err(bad(
                        "resources.accelerators",
                        format!(
                            "`{text}`: unknown GPU model `{name}` (known: {}); write MODEL:COUNT, e.g. V100:1",
                            known.join(", ")
                        ),
                    ));
                };
                Some((model.to_string(), count))
            }
        };
        if let Some(v) = spec.vcpus
            && !(1..=1024).contains(&v)
        {
            return Err(bad("resources.vcpus", "must be between 1 and 1024"));
        }
        if let Some(m) = spec.memory_gib
            && !(m.is_finite() && (0.5..=24_576.0).contains(&m))
        {
            return Err(bad(
                "resources.memory_gib",
                "must be between 0.5 and 24576 GiB",
            ));
        }
        Ok(Resources {
            accelerator,
            vcpus: spec.vcpus,
            memory_gib: spec.memory_gib,
        })
    }

    /// Whether instances of `t` have all of it (a type the catalog does not know has none).
    pub fn admits(&self, t: &InstanceType) -> bool {
        let Some(k) = crate::prices::catalog::lookup(t) else {
            return false;
        };
        let gpus = match (&self.accelerator, k.accelerator) {
            (None, _) => true,
            (Some((name, count)), Some(a)) => a.name == name && a.count == *count,
            (Some(_), None) => false,
        };
        gpus && self.vcpus.is_none_or(|v| k.vcpus >= v)
            && self.memory_gib.is_none_or(|m| k.memory_gib >= m)
    }

    /// `V100:1, ≥ 8 vCPUs, ≥ 16 GiB`, for messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some((name, count)) = &self.accelerator {
            parts.push(format!("{name}:{count}"));
        }
        if let Some(v) = self.vcpus {
            parts.push(format!("≥ {v} vCPUs"));
        }
        if let Some(m) = self.memory_gib {
            parts.push(format!("≥ {m} GiB"));
        }
        parts.join(", ")
    }
}

/// The policy's work model. Work is counted in instance-hours of `reference_type`; throughput
/// of other types is proportional to vCPUs. Progress is measured by the agents; this estimate
/// only sizes the footprint the policy buys.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkSpec {
    /// Units of work for the whole job. Default: 1 per epoch (or per 100 clocks).
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1e9)]
    pub total_work: Option<f64>,
    /// Default: the first of `instance_types` with 4 vCPUs, else the first.
    #[serde(default)]
    pub reference_type: Option<String>,
    /// Types the job may run on. Default: every type the broker has prices for.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub instance_types: Option<Vec<String>>,
    /// Minutes from launch to useful work. Default 5 (on a real cloud) — the broker's
    /// `--startup-minutes` overrides the default for simulated clouds.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 600.0)]
    pub startup_minutes: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 100.0)]
    pub learning_rate: Option<f32>,
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 100.0)]
    pub l2: Option<f32>,
    /// `mf` only.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000)]
    pub rank: Option<u32>,
    /// `mlp` only: `pipeline` (default) or `data`.
    #[serde(default)]
    pub parallelism: Option<Parallelism>,
    /// `mlp` only: widths of the hidden layers and the output. Default `[512, 512, 512, 10]`.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub layers: Option<Vec<u32>>,
    /// `mlp` only: minibatch per worker. Default 64.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub batch: Option<u32>,
    /// `mlp` only. Default 0.9.
    #[serde(default)]
    #[schema(minimum = 0.0, exclusive_maximum = 1.0)]
    pub momentum: Option<f32>,
    /// `mlp` only: emulate links of this many Mbit/s between agents.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0)]
    pub link_mbit_per_sec: Option<f64>,
    /// `mlp` only: emulate this one-way latency (ms, 0–10000) on every message between agents.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 10000.0)]
    pub link_latency_ms: Option<f64>,
    /// `mlp` pipelines only: `schedule` = `1f1b` (PipeDream, default) or `2bw` (PipeDream-2BW:
    /// two weight versions per stage), `vertical_sync` (1F1B only), and `snapshot_every`
    /// (minibatches between the snapshots a pipeline restarts from when a worker is lost
    /// without warning; default 100, 0 for none), e.g. `pipeline = { schedule = "2bw" }`. See
    /// docs/pipeline.md.
    #[serde(default, deserialize_with = "table::optional")]
    pub pipeline: Option<PipelineOptions>,
    /// Training starts once this many workers are placed (an `mlp` pipeline is planned for
    /// them). Default 1.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000)]
    pub min_workers: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 64)]
    pub num_shards: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 10, maximum = 3600000)]
    pub backup_sync_interval_ms: Option<u64>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
    pub clocks_per_epoch: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 0.0)]
    pub stage2_ratio: Option<f64>,
    #[serde(default)]
    #[schema(minimum = 0.0)]
    pub stage3_ratio: Option<f64>,
    #[serde(default)]
    pub seed: Option<u64>,
    /// How workers synchronise: `bsp`, `ssp` (stale synchronous, with `slack`) or `flexrr`
    /// (SSP with `slack` plus RapidReassignment within helper groups of `helpers`). Default:
    /// the agents' default, see `SyncModel::default`.
    #[serde(default)]
    pub sync: Option<String>,
    /// `ssp` and `flexrr`: how many clocks a worker may run ahead of the slowest (0–64;
    /// default 1 for `ssp`, 0 for `flexrr`).
    #[serde(default)]
    #[schema(minimum = 0, maximum = 64)]
    pub slack: Option<u32>,
    /// `flexrr`: size of each worker's helper group (1–16, default 3).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 16)]
    pub helpers: Option<u32>,
    /// `mlr` and `mf`: train each worker at no more than this many samples per second (a
    /// ceiling, not a target; default none: as fast as the CPU allows). For demonstrations and
    /// tests that need training to last, whatever the machine's speed.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0)]
    pub pace_samples_per_sec: Option<f64>,
}

impl TrainingSpec {
    /// `training.sync` with its `slack` and `helpers`, each error naming its field.
    pub fn sync_model(&self) -> Result<Option<SyncModel>, FieldError> {
        let slack = match self.slack {
            Some(s) if s > MAX_SLACK => {
                return Err(bad(
                    "training.slack",
                    format!("must be between 0 and {MAX_SLACK}"),
                ));
            }
            s => s,
        };
        let helpers = match self.helpers {
            Some(h) if !(1..=MAX_HELPER_GROUP).contains(&h) => {
                return Err(bad(
                    "training.helpers",
                    format!("must be between 1 and {MAX_HELPER_GROUP}"),
                ));
            }
            h => h,
        };
        let Some(name) = self.sync.as_deref() else {
            if slack.is_some() || helpers.is_some() {
                return Err(bad(
                    if slack.is_some() {
                        "training.slack"
                    } else {
                        "training.helpers"
                    },
                    "needs `training.sync` (`ssp` or `flexrr`)",
                ));
            }
            return Ok(None);
        };
        let model = match name {
            "bsp" => SyncModel::Bsp,
            "ssp" => SyncModel::Ssp {
                slack: slack.unwrap_or(proteus_wire::agent_api::default_ssp_slack()),
            },
            "flexrr" => SyncModel::Flexrr {
                slack: slack.unwrap_or(proteus_wire::agent_api::default_flexrr_slack()),
                helpers: helpers.unwrap_or(proteus_wire::agent_api::default_helper_group()),
            },
            other => {
                return Err(bad(
                    "training.sync",
                    format!("`{other}` is not a sync model (allowed: bsp, ssp, flexrr)"),
                ));
            }
        };
        if slack.is_some() && model == SyncModel::Bsp {
            return Err(bad(
                "training.slack",
                "applies to `ssp` and `flexrr` only (bsp has no slack)",
            ));
        }
        if helpers.is_some() && model.helper_group().is_none() {
            return Err(bad("training.helpers", "applies to `flexrr` only"));
        }
        Ok(Some(model))
    }
}

/// A spec that passed validation, in the broker's own types.
#[derive(Debug, Clone)]
pub struct ValidJob {
    pub name: String,
    pub policy: String,
    pub billing: BillingModel,
    pub training: TrainingConfig,
    pub max_instances: u32,
    pub max_reliable_instances: u32,
    pub max_capacity: Option<f64>,
    pub budget_usd: Option<Usd>,
    pub deadline: Option<Timestamp>,
    pub work: WorkSpec,
    pub resources: Option<Resources>,
}

impl ValidJob {
    /// The job's work model in file form, as the simulator reads it too (so that a job file
    /// simulates as it runs): `usable` instance types are the default ones (those with a spot
    /// market and an on-demand price), `default_startup_minutes` the default start-up.
    pub fn work_model_spec(
        &self,
        usable: &[InstanceType],
        default_startup_minutes: f64,
    ) -> Result<WorkModelSpec, FieldError> {
        let work: &WorkSpec = &self.work;
        let mut types: Vec<String> = match &work.instance_types {
            Some(t) => t.clone(),
            None => usable.iter().map(|t| t.to_string()).collect(),
        };
        if let Some(resources) = &self.resources {
            types.retain(|t| {
                InstanceType::parse(t).is_ok_and(|t| usable.contains(&t) && resources.admits(&t))
            });
            if types.is_empty() {
                let gpus: Vec<String> = usable
                    .iter()
                    .filter_map(|t| {
                        let a = crate::prices::catalog::lookup(t)?.accelerator?;
                        Some(format!("{t} has {}:{}", a.name, a.count))
                    })
                    .collect();
                return Err(unmet(
                    "resources",
                    format!(
                        "no instance type {} has {} (GPU types here: {})",
                        if work.instance_types.is_some() {
                            "in `work.instance_types` with prices here"
                        } else {
                            "with prices here"
                        },
                        resources.describe(),
                        if gpus.is_empty() {
                            "none".to_string()
                        } else {
                            gpus.join(", ")
                        }
                    ),
                ));
            }
        }
        if types.is_empty() {
            return Err(unmet(
                "work.instance_types",
                "the broker has no market with an on-demand price: ingest prices first",
            ));
        }
        for (i, t) in types.iter().enumerate() {
            if !usable.iter().any(|u| u.as_str() == t) {
                return Err(unmet(
                    &format!("work.instance_types[{i}]"),
                    format!(
                        "`{t}` has no spot market with an on-demand price here (available: {})",
                        usable
                            .iter()
                            .map(|u| u.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
        let reference = match &work.reference_type {
            Some(r) => r.clone(),
            None => types
                .iter()
                .find(|t| {
                    InstanceType::parse(t)
                        .ok()
                        .and_then(|t| crate::prices::catalog::lookup(&t))
                        .is_some_and(|k| k.vcpus == 4)
                })
                .unwrap_or(&types[0])
                .clone(),
        };
        let total_work = work.total_work.unwrap_or(match self.training.stop {
            StopCondition::Epochs { epochs } => f64::from(epochs),
            StopCondition::Clocks { clocks } => (clocks as f64 / 100.0).max(0.01),
        });
        Ok(WorkModelSpec {
            name: Some(self.name.clone()),
            total_work,
            reference_type: reference,
            instance_types: types,
            throughput: Default::default(),
            max_instances: self.max_instances,
            max_reliable_instances: Some(self.max_reliable_instances),
            max_capacity: self.max_capacity,
            startup_minutes: work.startup_minutes.unwrap_or(default_startup_minutes),
            eviction_cost: Default::default(),
            stages: self.training.stages,
            stop_seconds: match &self.training.app {
                AppConfig::Command(c) => {
                    (c.grace_seconds + crate::job::STOP_UPLOAD_ALLOWANCE_SECS) as f64
                }
                _ => 0.0,
            },
        })
    }
}

/// A field that is not acceptable, by its dotted path.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
    /// The value is valid, but this broker cannot take it as things stand (its markets, its
    /// clock, its settings): another broker, or this one later, might.
    pub unmet: bool,
}

fn bad(field: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_string(),
        message: message.into(),
        unmet: false,
    }
}

/// A valid value this broker cannot take as things stand (see [`FieldError::unmet`]).
fn unmet(field: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        unmet: true,
        ..bad(field, message)
    }
}

/// Policy names are file stems in the policies directory; anything else could name a file
/// outside it.
pub fn valid_policy_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

impl JobSpec {
    /// Checks every field; `now` (market time) anchors a relative deadline.
    pub fn validate(
        &self,
        default_billing: BillingModel,
        now: Timestamp,
    ) -> Result<ValidJob, FieldError> {
        let app = self.app_config()?;
        let stop = match self.stop {
            None => StopCondition::Epochs { epochs: 5 },
            Some(StopSpec {
                epochs: Some(e),
                clocks: None,
            }) if (1..=10_000).contains(&e) => StopCondition::Epochs { epochs: e },
            Some(StopSpec {
                epochs: None,
                clocks: Some(c),
            }) if (1..=100_000_000).contains(&c) => StopCondition::Clocks { clocks: c },
            Some(_) => {
                return Err(bad(
                    "stop",
                    "give exactly one of `epochs` (1–10000) or `clocks` (1–100000000)",
                ));
            }
        };
        if !valid_policy_name(&self.policy) {
            return Err(bad(
                "policy",
                "a policy name: lowercase letters, digits, `-` and `_` (e.g. `bidbrain`)",
            ));
        }
        let limits = &self.limits;
        if !(1..=1000).contains(&limits.max_instances) {
            return Err(bad("limits.max_instances", "must be between 1 and 1000"));
        }
        let max_reliable = limits
            .max_reliable_instances
            .unwrap_or((limits.max_instances / 8).max(1));
        if max_reliable == 0 || max_reliable > limits.max_instances {
            return Err(bad(
                "limits.max_reliable_instances",
                format!(
                    "must be between 1 and max_instances ({})",
                    limits.max_instances
                ),
            ));
        }
        if let Some(c) = limits.max_capacity
            && !(c.is_finite() && c > 0.0)
        {
            return Err(bad(
                "limits.max_capacity",
                "must be a positive number of work units per hour",
            ));
        }
        // Checked here rather than by `Usd`'s own deserialisation, so that an infinite budget
        // (TOML has `inf`) gets the same message, with the field, as a negative one.
        let budget_usd = match limits.budget_usd {
            None => None,
            Some(b) => match Usd::new(b) {
                Ok(b) if b > Usd::ZERO => Some(b),
                _ => {
                    return Err(bad(
                        "limits.budget_usd",
                        "must be a positive number of dollars",
                    ));
                }
            },
        };
        let deadline = match (&limits.deadline, limits.deadline_hours) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "limits.deadline",
                    "give `deadline` or `deadline_hours`, not both",
                ));
            }
            (Some(text), None) => Some(
                Timestamp::parse(text)
                    .map_err(|e| bad("limits.deadline", e.to_string()))
                    .and_then(|t| {
                        if t > now {
                            Ok(t)
                        } else {
                            Err(unmet(
                                "limits.deadline",
                                format!("{t} is not after now ({now})"),
                            ))
                        }
                    })?,
            ),
            (None, Some(h)) if h.is_finite() && h > 0.0 && h <= 24.0 * 365.0 => {
                Some(now.plus_secs(h * 3600.0))
            }
            (None, Some(_)) => {
                return Err(bad(
                    "limits.deadline_hours",
                    "must be between 0 and 8760 hours",
                ));
            }
            (None, None) => None,
        };
        let billing = match &self.billing {
            None => default_billing,
            Some(b) => b.parse().map_err(|e: String| bad("billing", e))?,
        };
        let training = self.training_config(app, stop)?;
        let work = self.work.clone().unwrap_or(WorkSpec {
            total_work: None,
            reference_type: None,
            instance_types: None,
            startup_minutes: None,
        });
        if let Some(w) = work.total_work
            && !(w.is_finite() && w > 0.0 && w <= 1e9)
        {
            return Err(bad("work.total_work", "must be a positive number of units"));
        }
        if let Some(m) = work.startup_minutes
            && !(m.is_finite() && (0.0..=600.0).contains(&m))
        {
            return Err(bad("work.startup_minutes", "must be between 0 and 600"));
        }
        if let Some(types) = &work.instance_types {
            if types.is_empty() {
                return Err(bad(
                    "work.instance_types",
                    "must name at least one instance type",
                ));
            }
            for (i, t) in types.iter().enumerate() {
                crate::market::InstanceType::parse(t)
                    .map_err(|e| bad(&format!("work.instance_types[{i}]"), e.to_string()))?;
            }
        }
        let name = match &self.name {
            Some(n)
                if n.trim().is_empty()
                    || n.chars().count() > 200
                    || n.chars().any(char::is_control) =>
            {
                return Err(bad(
                    "name",
                    "must be 1–200 characters, none of them a control character",
                ));
            }
            Some(n) => n.trim().to_string(),
            None => format!("{}-{}", training.app.name(), self.dataset_name()),
        };
        Ok(ValidJob {
            name,
            policy: self.policy.clone(),
            billing,
            training,
            max_instances: limits.max_instances,
            max_reliable_instances: max_reliable,
            max_capacity: limits.max_capacity,
            budget_usd,
            deadline,
            work,
            resources: self.resources.as_ref().map(Resources::parse).transpose()?,
        })
    }

    fn dataset_name(&self) -> String {
        self.dataset.clone().unwrap_or_else(|| match self.app {
            App::Mlr | App::Mlp => "mnist".into(),
            App::Mf => "movietweetings".into(),
            App::Command => self
                .command
                .as_ref()
                .and_then(|c| c.run.first())
                .and_then(|p| p.rsplit('/').next())
                .unwrap_or("program")
                .to_string(),
        })
    }

    /// The image data set of an `mlr` or `mlp` job (which take no `training.rank`).
    fn image_dataset(&self) -> Result<ImageDataset, FieldError> {
        let dataset = match self.dataset.as_deref() {
            None | Some("mnist") => ImageDataset::Mnist,
            Some("digits") => ImageDataset::Digits,
            Some(other) => {
                return Err(bad(
                    "dataset",
                    format!("`{other}` is not an image data set (allowed: mnist, digits)"),
                ));
            }
        };
        if self.training.as_ref().and_then(|t| t.rank).is_some() {
            return Err(bad("training.rank", "applies to `mf` only"));
        }
        Ok(dataset)
    }

    fn app_config(&self) -> Result<AppConfig, FieldError> {
        if self.app == App::Command {
            if self.dataset.is_some() {
                return Err(bad("dataset", "applies to built-in apps, not `command`"));
            }
            if self.stop.is_some() {
                return Err(bad(
                    "stop",
                    "applies to built-in apps; a `command` job ends when its program completes",
                ));
            }
            if self.training.is_some() {
                return Err(bad(
                    "training",
                    "applies to built-in apps; a `command` job is configured in `command`",
                ));
            }
            let command = self.command.as_ref().ok_or_else(|| {
                bad(
                    "command",
                    "an `app = \"command\"` job needs a `command` table with `run`",
                )
            })?;
            return command
                .config(self.limits.max_instances)
                .map(AppConfig::Command);
        }
        if self.command.is_some() {
            return Err(bad("command", "applies to `app = \"command\"` only"));
        }
        let t = self.training.as_ref();
        let lr = t.and_then(|t| t.learning_rate);
        let l2 = t.and_then(|t| t.l2);
        if let Some(v) = lr
            && !(v.is_finite() && v > 0.0 && v <= 100.0)
        {
            return Err(bad("training.learning_rate", "must be in (0, 100]"));
        }
        if let Some(v) = l2
            && !(v.is_finite() && (0.0..=100.0).contains(&v))
        {
            return Err(bad("training.l2", "must be in [0, 100]"));
        }
        let mlp_only = t.is_some_and(|t| {
            t.parallelism.is_some()
                || t.layers.is_some()
                || t.batch.is_some()
                || t.momentum.is_some()
                || t.link_mbit_per_sec.is_some()
                || t.link_latency_ms.is_some()
                || t.pipeline.is_some()
        });
        if mlp_only && self.app != App::Mlp {
            return Err(bad(
                "training",
                "parallelism, layers, batch, momentum, link_mbit_per_sec, link_latency_ms and \
                 pipeline apply to `mlp` only",
            ));
        }
        let pipeline = t.and_then(|t| t.pipeline.clone()).unwrap_or_default();
        if pipeline.vertical_sync && pipeline.schedule != PipelineSchedule::OneFOneB {
            return Err(bad(
                "training.pipeline.vertical_sync",
                "applies to schedule = \"1f1b\" only (2BW keeps two weight versions per stage; \
                 vertical sync needs more)",
            ));
        }
        if t.is_some_and(|t| t.pipeline.is_some())
            && t.and_then(|t| t.parallelism).unwrap_or_default() != Parallelism::Pipeline
        {
            return Err(bad(
                "training.pipeline",
                "applies to parallelism = \"pipeline\" only",
            ));
        }
        match self.app {
            App::Command => Err(bad(
                "command",
                "an `app = \"command\"` job needs a `command` table",
            )),
            App::Mlp => {
                let dataset = self.image_dataset()?;
                let app = AppConfig::Mlp {
                    dataset,
                    layers: t
                        .and_then(|t| t.layers.clone())
                        .unwrap_or_else(proteus_wire::agent_api::default_mlp_layers),
                    batch: t
                        .and_then(|t| t.batch)
                        .unwrap_or(proteus_wire::agent_api::default_mlp_batch()),
                    learning_rate: lr
                        .unwrap_or(proteus_wire::agent_api::default_mlp_learning_rate()),
                    momentum: t
                        .and_then(|t| t.momentum)
                        .unwrap_or(proteus_wire::agent_api::default_mlp_momentum()),
                    parallelism: t.and_then(|t| t.parallelism).unwrap_or_default(),
                    link_mbit_per_sec: t.and_then(|t| t.link_mbit_per_sec),
                    link_latency_ms: t.and_then(|t| t.link_latency_ms),
                    pipeline,
                };
                if let AppConfig::Mlp {
                    layers, pipeline, ..
                } = &app
                {
                    pipeline
                        .check_profile(layers.len())
                        .map_err(|e| bad("training.pipeline.profile", e))?;
                }
                Ok(app)
            }
            App::Mlr => {
                let dataset = self.image_dataset()?;
                Ok(AppConfig::Mlr {
                    dataset,
                    learning_rate: lr
                        .unwrap_or(proteus_wire::agent_api::default_mlr_learning_rate()),
                    l2: l2.unwrap_or(0.0),
                })
            }
            App::Mf => {
                let file = self
                    .dataset
                    .clone()
                    .unwrap_or_else(proteus_wire::agent_api::default_ratings_file);
                // A bare file name inside the agents' data directory, nothing else.
                if file.is_empty()
                    || file.contains('/')
                    || file.contains('\\')
                    || file.starts_with('.')
                    || file.chars().any(char::is_control)
                {
                    return Err(bad(
                        "dataset",
                        "a ratings file name in the agents' data directory",
                    ));
                }
                let rank = t
                    .and_then(|t| t.rank)
                    .unwrap_or(proteus_wire::agent_api::default_mf_rank());
                if !(1..=1000).contains(&rank) {
                    return Err(bad("training.rank", "must be between 1 and 1000"));
                }
                Ok(AppConfig::Mf {
                    ratings_file: file,
                    rank,
                    learning_rate: lr
                        .unwrap_or(proteus_wire::agent_api::default_mf_learning_rate()),
                    l2: l2.unwrap_or(proteus_wire::agent_api::default_mf_l2()),
                    holdout_fraction: proteus_wire::agent_api::default_holdout_fraction(),
                })
            }
        }
    }

    fn training_config(
        &self,
        app: AppConfig,
        stop: StopCondition,
    ) -> Result<TrainingConfig, FieldError> {
        let mut cfg = TrainingConfig::new(app);
        cfg.stop = stop;
        if let AppConfig::Command(c) = &cfg.app {
            // No model to shard: one key on one shard keeps the control plane's layout valid.
            cfg.num_shards = 1;
            if c.launcher == CommandLauncher::Torchrun {
                // The rendezvous lives on a reliable machine that runs torchrun itself, so
                // reliable machines always work (never AgileML's stage 3).
                cfg.stages.stage3_ratio = f64::MAX;
            }
        }
        if let Some(t) = &self.training {
            if let Some(n) = t.num_shards {
                if !(1..=64).contains(&n) {
                    return Err(bad("training.num_shards", "must be between 1 and 64"));
                }
                cfg.num_shards = n;
            }
            if let Some(ms) = t.backup_sync_interval_ms {
                if !(10..=3_600_000).contains(&ms) {
                    return Err(bad(
                        "training.backup_sync_interval_ms",
                        "must be between 10 and 3600000",
                    ));
                }
                cfg.backup_sync_interval_ms = ms;
            }
            if let Some(c) = t.clocks_per_epoch {
                if !(1..=10_000).contains(&c) {
                    return Err(bad(
                        "training.clocks_per_epoch",
                        "must be between 1 and 10000",
                    ));
                }
                cfg.clocks_per_epoch = c;
            }
            for (field, value, slot) in [
                (
                    "training.stage2_ratio",
                    t.stage2_ratio,
                    &mut cfg.stages.stage2_ratio,
                ),
                (
                    "training.stage3_ratio",
                    t.stage3_ratio,
                    &mut cfg.stages.stage3_ratio,
                ),
            ] {
                if let Some(v) = value {
                    if !(v.is_finite() && v >= 0.0) {
                        return Err(bad(field, "must be a non-negative number"));
                    }
                    *slot = v;
                }
            }
            if let Some(seed) = t.seed {
                cfg.seed = seed;
            }
            if let Some(sync) = t.sync_model()? {
                cfg.sync = sync;
            }
            if let Some(n) = t.min_workers {
                if !(1..=1000).contains(&n) {
                    return Err(bad("training.min_workers", "must be between 1 and 1000"));
                }
                cfg.min_workers = n;
            }
            if let Some(rate) = t.pace_samples_per_sec {
                if matches!(cfg.app, AppConfig::Mlp { .. } | AppConfig::Command(_)) {
                    return Err(bad(
                        "training.pace_samples_per_sec",
                        "applies to `mlr` and `mf` only",
                    ));
                }
                if !(rate.is_finite() && rate > 0.0) {
                    return Err(bad(
                        "training.pace_samples_per_sec",
                        "must be a positive number",
                    ));
                }
                cfg.stragglers.pace_samples_per_sec = Some(rate);
            }
        }
        cfg.validate().map_err(|e| bad("training", e))?;
        Ok(cfg)
    }

    /// Reads a spec file: JSON, or TOML (anything not starting with `{`).
    pub fn parse_file(file: &str, text: &str) -> Result<JobSpec, String> {
        if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| format!("{file}: {e}"))
        } else {
            toml::from_str(text).map_err(|e| format!("{file}: {}", e.to_string().trim_end()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_resolve_to_the_types_that_have_them() {
        let usable: Vec<InstanceType> = ["c3.xlarge", "g2.2xlarge", "d2.8xlarge", "m3.medium"]
            .iter()
            .map(|t| InstanceType::parse(t).unwrap())
            .collect();
        let types = |resources: &str| {
            let s = spec(&format!(
                r#"{{"app":"mlr","policy":"x","limits":{{"max_instances":4}},"resources":{resources}}}"#
            ));
            s.validate(BillingModel::PerSecond, NOW)
                .and_then(|v| v.work_model_spec(&usable, 5.0))
                .map(|w| w.instance_types)
        };
        assert_eq!(
            types(r#"{"accelerators":"K520:1"}"#).unwrap(),
            ["g2.2xlarge"]
        );
        assert_eq!(
            types(r#"{"accelerators":"k520"}"#).unwrap(),
            ["g2.2xlarge"],
            "one GPU when no count is given; the model's case does not matter"
        );
        assert_eq!(
            types(r#"{"vcpus":8}"#).unwrap(),
            ["g2.2xlarge", "d2.8xlarge"]
        );
        assert_eq!(
            types(r#"{"vcpus":4,"memory_gib":30}"#).unwrap(),
            ["d2.8xlarge"]
        );
        // Exactly the count asked: g2.2xlarge has one K520, not four.
        let e = types(r#"{"accelerators":"K520:4"}"#).unwrap_err();
        assert_eq!(e.field, "resources");
        assert!(e.message.contains("g2.2xlarge has K520:1"), "{}", e.message);
        let e = types(r#"{"accelerators":"V100:1"}"#).unwrap_err();
        assert!(e.message.contains("V100:1"), "{}", e.message);
        for (bad, field) in [
            (r#"{"accelerators":"H900:1"}"#, "resources.accelerators"),
            (r#"{"accelerators":"V100:0"}"#, "resources.accelerators"),
            (r#"{"accelerators":"V100:x"}"#, "resources.accelerators"),
            (r#"{"accelerators":"V100:01"}"#, "resources.accelerators"),
            (r#"{"accelerators":"V100:+1"}"#, "resources.accelerators"),
            (r#"{"accelerators":"V100:17"}"#, "resources.accelerators"),
            (r#"{"accelerators":" V100"}"#, "resources.accelerators"),
            (r#"{"vcpus":0}"#, "resources.vcpus"),
            (r#"{"memory_gib":-1}"#, "resources.memory_gib"),
        ] {
            assert_eq!(types(bad).unwrap_err().field, field, "{bad}");
        }
        // With `work.instance_types` too: only those of them that qualify.
        let s = spec(
            r#"{"app":"mlr","policy":"x","limits":{"max_instances":4},"resources":{"vcpus":8},
                "work":{"instance_types":["c3.xlarge","d2.8xlarge"]}}"#,
        );
        let w = s
            .validate(BillingModel::PerSecond, NOW)
            .unwrap()
            .work_model_spec(&usable, 5.0)
            .unwrap();
        assert_eq!(w.instance_types, ["d2.8xlarge"]);
    }

    #[test]
    fn mlp_jobs_choose_their_parallelism() {
        let s = spec(
            r#"{"app":"mlp","policy":"x","limits":{"max_instances":4},
                "training":{"parallelism":"data","layers":[128,10],"min_workers":4}}"#,
        );
        let v = s.validate(BillingModel::PerSecond, NOW).unwrap();
        assert_eq!(v.training.min_workers, 4);
        match v.training.app {
            AppConfig::Mlp {
                parallelism,
                layers,
                ..
            } => {
                assert_eq!(parallelism, Parallelism::Data);
                assert_eq!(layers, [128, 10]);
            }
            other => panic!("{other:?}"),
        }
        let e = spec(r#"{"app":"mlr","policy":"x","limits":{"max_instances":4},"training":{"parallelism":"pipeline"}}"#)
            .validate(BillingModel::PerSecond, NOW)
            .unwrap_err();
        assert_eq!(e.field, "training");
    }

    #[test]
    fn mlp_pipelines_choose_their_schedule_and_vertical_sync() {
        let pipeline_of = |training: &str| {
            let s = spec(&format!(
                r#"{{"app":"mlp","policy":"x","limits":{{"max_instances":4}},"training":{training}}}"#
            ));
            match s
                .validate(BillingModel::PerSecond, NOW)
                .map(|v| v.training.app)
            {
                Ok(AppConfig::Mlp { pipeline, .. }) => Ok(pipeline),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e),
            }
        };
        assert_eq!(pipeline_of("{}").unwrap(), PipelineOptions::default());
        assert_eq!(
            pipeline_of(r#"{"pipeline":{"schedule":"2bw"}}"#).unwrap(),
            PipelineOptions {
                schedule: PipelineSchedule::TwoBW,
                vertical_sync: false,
                ..PipelineOptions::default()
            }
        );
        assert_eq!(
            pipeline_of(r#"{"pipeline":{"vertical_sync":true}}"#).unwrap(),
            PipelineOptions {
                schedule: PipelineSchedule::OneFOneB,
                vertical_sync: true,
                ..PipelineOptions::default()
            }
        );
        assert_eq!(PipelineOptions::default().snapshot_every, 100);
        assert_eq!(
            pipeline_of(r#"{"pipeline":{"snapshot_every":0}}"#)
                .unwrap()
                .snapshot_every,
            0
        );
        // A pinned profile reaches the agents; one that does not fit the model is refused.
        let timing = r#"{"forward_ms":1.5,"backward_ms":3,"update_ms":0.5}"#;
        let pinned = pipeline_of(&format!(
            r#"{{"layers":[64,10],"pipeline":{{"profile":[{timing},{timing}]}}}}"#
        ))
        .unwrap();
        let profile = pinned.profile.expect("the pinned profile");
        assert_eq!(profile.len(), 2);
        assert_eq!(
            (
                profile[1].forward_ms,
                profile[1].backward_ms,
                profile[1].update_ms
            ),
            (1.5, 3.0, 0.5)
        );
        let e = pipeline_of(&format!(
            r#"{{"layers":[64,32,10],"pipeline":{{"profile":[{timing},{timing}]}}}}"#
        ))
        .unwrap_err();
        assert_eq!(e.field, "training.pipeline.profile");
        assert!(
            e.message.contains("2 entries but the model 3 layers"),
            "{e:?}"
        );
        let e = pipeline_of(&format!(
            r#"{{"layers":[64,10],"pipeline":{{"profile":[{timing},{{"forward_ms":-1,"backward_ms":3,"update_ms":0.5}}]}}}}"#
        ))
        .unwrap_err();
        assert_eq!(e.field, "training.pipeline.profile");
        assert!(e.message.contains("profile[1].forward_ms"), "{e:?}");
        let zero = r#"{"forward_ms":0,"backward_ms":0,"update_ms":0}"#;
        let e = pipeline_of(&format!(
            r#"{{"layers":[10],"pipeline":{{"profile":[{zero}]}}}}"#
        ))
        .unwrap_err();
        assert!(e.message.contains("no time"), "{e:?}");
        let bad_key = serde_json::from_str::<JobSpec>(
            r#"{"app":"mlp","policy":"x","limits":{"max_instances":4},"training":{"layers":[10],"pipeline":{"profile":[{"forward_ms":1,"backward_ms":1,"update":1}]}}}"#,
        )
        .unwrap_err();
        assert!(bad_key.to_string().contains("update"), "{bad_key}");
        let e = pipeline_of(r#"{"pipeline":{"schedule":"2bw","vertical_sync":true}}"#).unwrap_err();
        assert_eq!(e.field, "training.pipeline.vertical_sync");
        let e = pipeline_of(r#"{"parallelism":"data","pipeline":{"schedule":"2bw"}}"#).unwrap_err();
        assert_eq!(e.field, "training.pipeline");
        // Link emulation reaches the agents' configuration; a bad latency is refused.
        let s = spec(
            r#"{"app":"mlp","policy":"x","limits":{"max_instances":4},"training":{"link_mbit_per_sec":100,"link_latency_ms":2}}"#,
        );
        match s
            .validate(BillingModel::PerSecond, NOW)
            .unwrap()
            .training
            .app
        {
            AppConfig::Mlp {
                link_mbit_per_sec,
                link_latency_ms,
                ..
            } => assert_eq!(
                (link_mbit_per_sec, link_latency_ms),
                (Some(100.0), Some(2.0))
            ),
            other => panic!("{other:?}"),
        }
        let e = spec(
            r#"{"app":"mlp","policy":"x","limits":{"max_instances":4},"training":{"link_latency_ms":-3}}"#,
        )
        .validate(BillingModel::PerSecond, NOW)
        .unwrap_err();
        assert_eq!(e.field, "training");
        assert!(e.message.contains("link_latency_ms"), "{e:?}");
        let e = spec(
            r#"{"app":"mlr","policy":"x","limits":{"max_instances":4},"training":{"link_latency_ms":2}}"#,
        )
        .validate(BillingModel::PerSecond, NOW)
        .unwrap_err();
        assert_eq!(e.field, "training");
        // An unknown schedule or key is refused when the spec is read, naming it.
        let bad = serde_json::from_str::<JobSpec>(
            r#"{"app":"mlp","policy":"x","limits":{"max_instances":4},"training":{"pipeline":{"schedule":"gpipe"}}}"#,
        )
        .unwrap_err();
        assert!(bad.to_string().contains("gpipe"), "{bad}");
        let bad = serde_json::from_str::<JobSpec>(
            r#"{"app":"mlp","policy":"x","limits":{"max_instances":4},"training":{"pipeline":{"vertcal_sync":true}}}"#,
        )
        .unwrap_err();
        assert!(bad.to_string().contains("vertcal_sync"), "{bad}");
    }

    fn spec(json: &str) -> JobSpec {
        serde_json::from_str(json).unwrap()
    }

    const NOW: Timestamp = Timestamp::from_millis(1_426_000_000_000);

    #[test]
    fn command_jobs_are_checked_field_by_field() {
        let ok = spec(
            r#"{"app":"command","policy":"x","limits":{"max_instances":1},
                "command":{"run":["python3","t.py"],"env":{"LR":"0.1"},"max_restarts":2}}"#,
        )
        .validate(BillingModel::PerSecond, NOW)
        .unwrap();
        assert_eq!(ok.name, "command-python3");
        assert_eq!(ok.training.num_shards, 1);
        match ok.training.app {
            AppConfig::Command(c) => {
                assert_eq!(c.max_restarts, 2);
                assert_eq!(c.checkpoint_interval_secs, 60);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ok.training.stages.stage3_ratio, 15.0);
        let torchrun = spec(
            r#"{"app":"command","policy":"x","limits":{"max_instances":3},
                "command":{"run":["python3","t.py"],"launcher":"torchrun"}}"#,
        )
        .validate(BillingModel::PerSecond, NOW)
        .unwrap();
        match &torchrun.training.app {
            AppConfig::Command(c) => {
                assert_eq!(c.launcher, CommandLauncher::Torchrun);
                assert_eq!(c.max_nodes, 3, "the rendezvous admits up to max_instances");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            torchrun.training.stages.stage3_ratio,
            f64::MAX,
            "reliable machines (the rendezvous host) always work"
        );
        let fetched = spec(
            r#"{"app":"command","policy":"x","limits":{"max_instances":1},
                "command":{"run":["python3","t.py"],"workdir":"s3://my-bucket/prog/t.tar.gz"}}"#,
        )
        .validate(BillingModel::PerSecond, NOW)
        .unwrap();
        match &fetched.training.app {
            AppConfig::Command(c) => {
                assert_eq!(c.workdir.as_deref(), Some("s3://my-bucket/prog/t.tar.gz"));
            }
            other => panic!("{other:?}"),
        }
        for (json, field) in [
            (r#""command":{"run":[]}"#, "command.run"),
            (
                r#""command":{"run":["p"],"env":{"AWS_SECRET_ACCESS_KEY":"x"}}"#,
                "command.env.AWS_SECRET_ACCESS_KEY",
            ),
            (
                r#""command":{"run":["p"],"env":{"DATABASE_URL":"postgres://u:p@h/d"}}"#,
                "command.env.DATABASE_URL",
            ),
            (
                r#""command":{"run":["p"],"env":{"PROTEUS_RANK":"3"}}"#,
                "command.env.PROTEUS_RANK",
            ),
            (
                r#""command":{"run":["p"],"workdir":"s3://b/k"}"#,
                "command.workdir",
            ),
            (
                r#""command":{"run":["p"],"workdir":"s3://my-bucket/prog/"}"#,
                "command.workdir",
            ),
            (
                r#""command":{"run":["p"],"workdir":"relative/dir"}"#,
                "command.workdir",
            ),
            (
                r#""command":{"run":["p"],"workdir":"s3://my-bucket/a//b.tar.gz"}"#,
                "command.workdir",
            ),
            (
                r#""command":{"run":["p"],"workdir":"s3://my-bucket/ck/../job-1/rank-0.tar.gz"}"#,
                "command.workdir",
            ),
            (
                r#""command":{"run":["p"],"workdir":"s3://my-bucket//ck/job-1/rank-0.tar.gz"}"#,
                "command.workdir",
            ),
            (
                r#""command":{"run":["p"],"max_restarts":1000}"#,
                "command.max_restarts",
            ),
            (r#""stop":{"epochs":1},"command":{"run":["p"]}"#, "stop"),
            (r#""dataset":"mnist""#, "dataset"),
        ] {
            let text = format!(
                r#"{{"app":"command","policy":"x","limits":{{"max_instances":1}},{json}}}"#
            );
            let e = spec(&text)
                .validate(BillingModel::PerSecond, NOW)
                .unwrap_err();
            assert_eq!(e.field, field, "{text}: {}", e.message);
        }
        let e = spec(
            r#"{"app":"mlr","policy":"x","limits":{"max_instances":1},"command":{"run":["p"]}}"#,
        )
        .validate(BillingModel::PerSecond, NOW)
        .unwrap_err();
        assert_eq!(e.field, "command");
    }

    #[test]
    fn a_minimal_spec_gets_defaults() {
        let s = spec(r#"{"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": 8}}"#);
        let v = s.validate(BillingModel::Hourly2015, NOW).unwrap();
        assert_eq!(v.name, "mlr-mnist");
        assert_eq!(v.max_reliable_instances, 1);
        assert_eq!(v.training.stop, StopCondition::Epochs { epochs: 5 });
        assert_eq!(v.billing, BillingModel::Hourly2015);
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            (
                r#"{"app":"mlr","policy":"bidbrain","limits":{"max_instances":0}}"#,
                "limits.max_instances",
            ),
            (
                r#"{"app":"mlr","policy":"../etc","limits":{"max_instances":2}}"#,
                "policy",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2,"max_reliable_instances":3}}"#,
                "limits.max_reliable_instances",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2,"budget_usd":-1}}"#,
                "limits.budget_usd",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2,"max_capacity":0}}"#,
                "limits.max_capacity",
            ),
            (
                r#"{"app":"mlr","policy":"x","dataset":"cifar","limits":{"max_instances":2}}"#,
                "dataset",
            ),
            (
                r#"{"app":"mf","policy":"x","dataset":"../x.csv","limits":{"max_instances":2}}"#,
                "dataset",
            ),
            // Postgres cannot store a NUL character: refused here rather than a 500 there.
            (
                r#"{"app":"mf","policy":"x","dataset":"a\u0000.csv","limits":{"max_instances":2}}"#,
                "dataset",
            ),
            (
                r#"{"name":"a\u0000b","app":"mlr","policy":"x","limits":{"max_instances":2}}"#,
                "name",
            ),
            (
                r#"{"app":"mlr","policy":"x","stop":{"epochs":1,"clocks":3},"limits":{"max_instances":2}}"#,
                "stop",
            ),
            (
                r#"{"app":"mlr","policy":"x","billing":"monthly","limits":{"max_instances":2}}"#,
                "billing",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2,"deadline":"2000-01-01"}}"#,
                "limits.deadline",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"num_shards":0}}"#,
                "training.num_shards",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"work":{"instance_types":["bogus"]}}"#,
                "work.instance_types[0]",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"sync":"async"}}"#,
                "training.sync",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"sync":"bsp","slack":2}}"#,
                "training.slack",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"sync":"ssp","slack":100}}"#,
                "training.slack",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"sync":"ssp","helpers":2}}"#,
                "training.helpers",
            ),
            (
                r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"sync":"flexrr","helpers":0}}"#,
                "training.helpers",
            ),
        ];
        for (json, field) in cases {
            let err = spec(json)
                .validate(BillingModel::PerSecond, NOW)
                .unwrap_err();
            assert_eq!(err.field, field, "{json}: {}", err.message);
        }
    }

    #[test]
    fn sync_models_parse_from_the_training_section() {
        let v = JobSpec::parse_file(
            "job.toml",
            "app = \"mlr\"\npolicy = \"x\"\n[limits]\nmax_instances = 4\n[training]\nsync = \"flexrr\"\nslack = 2\nhelpers = 2\n",
        )
        .unwrap()
        .validate(BillingModel::PerSecond, NOW)
        .unwrap();
        assert_eq!(
            v.training.sync,
            SyncModel::Flexrr {
                slack: 2,
                helpers: 2
            }
        );
        let v = spec(r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"training":{"sync":"ssp","slack":0}}"#)
            .validate(BillingModel::PerSecond, NOW)
            .unwrap();
        assert_eq!(v.training.sync, SyncModel::Ssp { slack: 0 });
        let v = spec(r#"{"app":"mlr","policy":"x","limits":{"max_instances":2}}"#)
            .validate(BillingModel::PerSecond, NOW)
            .unwrap();
        assert_eq!(v.training.sync, SyncModel::default());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_str::<JobSpec>(
            r#"{"app":"mlr","policy":"x","limits":{"max_instances":2},"colour":"red"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `colour`"), "{err}");
    }

    #[test]
    fn toml_files_parse() {
        let s = JobSpec::parse_file(
            "job.toml",
            "app = \"mf\"\npolicy = \"on-demand\"\n[limits]\nmax_instances = 4\n[stop]\nepochs = 2\n",
        )
        .unwrap();
        let v = s.validate(BillingModel::PerSecond, NOW).unwrap();
        assert_eq!(v.training.app.name(), "mf");
        assert_eq!(v.training.stop, StopCondition::Epochs { epochs: 2 });
    }
}
