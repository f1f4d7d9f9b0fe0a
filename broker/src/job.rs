//! A training job's work model: how much work it is, how fast each instance type does it, and
//! what the job loses when an instance is taken away.
//!
//! Work is counted in *units*: instance-hours of the job's reference type (for the reference
//! job, c3.xlarge-hours). An instance of another type does `throughput[type]` units per hour,
//! by default in proportion to its vCPUs (a c3.xlarge has 4, so an m3.medium does 0.25 and a
//! d2.8xlarge 9), overridable by measured rates.
//!
//! The file form is [`WorkModelSpec`] (TOML or JSON, `examples/jobs/*.toml`); the live API
//! accepts the same fields inside a job spec. [`WorkModelSpec::resolve`] checks it against the
//! on-demand catalog and gives a [`JobModel`], which is what policies and the simulator use.
//!
//! ```toml
//! name = "reference-2015"
//! total_work = 1000.0              # units (reference-type instance-hours)
//! reference_type = "c3.xlarge"
//! instance_types = ["c3.xlarge", "d2.8xlarge", "g2.2xlarge", "m3.medium", "r3.large"]
//! max_instances = 64
//! max_reliable_instances = 8
//! startup_minutes = 5.0
//! [throughput]                     # optional overrides, units per instance-hour
//! "g2.2xlarge" = 1.6
//! [eviction_cost]
//! model = "agileml"                # or "checkpoint"
//! sync_interval_minutes = 2.0
//! rebalance_seconds = 10.0
//! ```

use crate::market::{InstanceType, Region};
use crate::prices::OnDemandCatalog;
use crate::prices::catalog;
use proteus_wire::agent_api::StageThresholds;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use thiserror::Error;

/// The job work model as written in a file or a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkModelSpec {
    /// A label for reports.
    #[serde(default)]
    pub name: Option<String>,
    /// Total work, in units (instance-hours of `reference_type`). Must be positive.
    pub total_work: f64,
    /// The type whose instance-hour is one unit. Must have a known vCPU count unless every type
    /// has a `throughput` override.
    pub reference_type: String,
    /// The instance types the job may run on. Each must have an on-demand price.
    pub instance_types: Vec<String>,
    /// Units per instance-hour per type, overriding the vCPU-proportional default.
    #[serde(default)]
    pub throughput: BTreeMap<String, f64>,
    /// Most instances the job can use at once (its parallelism), reliable ones included.
    pub max_instances: u32,
    /// Most on-demand (reliable) instances. Default: an eighth of `max_instances`, at least 1.
    #[serde(default)]
    pub max_reliable_instances: Option<u32>,
    /// Most capacity at once, in units of work per hour summed over the instances held, so
    /// that policies buying larger types cannot run faster than ones that cannot. Default: no
    /// cap beyond `max_instances`.
    #[serde(default)]
    pub max_capacity: Option<f64>,
    /// From launch until a new instance does useful work (request fulfilment, boot, join, load
    /// input), minutes. Default 5. It is billed and does no work.
    #[serde(default = "default_startup_minutes")]
    pub startup_minutes: f64,
    /// What an eviction costs the job. Default: AgileML.
    #[serde(default)]
    pub eviction_cost: EvictionCostSpec,
    /// AgileML stage switch points (transient:reliable ratios). At or above `stage3_ratio`,
    /// reliable instances hold only backup parameter-server shards and do no work.
    #[serde(default)]
    pub stages: StageThresholds,
    /// How long, at most, from Proteus asking an instance to stop until it ends, seconds: a
    /// command job's `grace_seconds` plus [`STOP_UPLOAD_ALLOWANCE_SECS`]. Policies ask that much
    /// earlier for a stop that must end by a time (a billing-hour boundary). Default 0: the
    /// instance ends when asked.
    #[serde(default)]
    pub stop_seconds: f64,
}

/// From launch to useful work, minutes, for jobs that do not say.
pub const DEFAULT_STARTUP_MINUTES: f64 = 5.0;

fn default_startup_minutes() -> f64 {
    DEFAULT_STARTUP_MINUTES
}

/// The eviction-cost model in file form; see [`EvictionCost`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "model", rename_all = "kebab-case", deny_unknown_fields)]
pub enum EvictionCostSpec {
    /// AgileML: a warned instance hands its state to backups; the job loses the work that
    /// instance did since the last background sync, and all workers pause briefly while input
    /// partitions are re-split.
    #[serde(rename = "agileml")]
    AgileMl {
        #[serde(default = "default_sync_minutes")]
        sync_interval_minutes: f64,
        #[serde(default = "default_rebalance_seconds")]
        rebalance_seconds: f64,
    },
    /// Checkpoint/restart: the job stalls `checkpoint_minutes` every `interval_minutes` to save
    /// a checkpoint; after an eviction it loses all work since the last checkpoint and waits
    /// for replacements plus `restart_minutes` to reload it.
    Checkpoint {
        interval_minutes: f64,
        checkpoint_minutes: f64,
        restart_minutes: f64,
    },
}

fn default_sync_minutes() -> f64 {
    2.0
}
fn default_rebalance_seconds() -> f64 {
    10.0
}

impl Default for EvictionCostSpec {
    fn default() -> Self {
        EvictionCostSpec::AgileMl {
            sync_interval_minutes: default_sync_minutes(),
            rebalance_seconds: default_rebalance_seconds(),
        }
    }
}

/// What an eviction costs the job, in seconds. The simulator applies it; the live scheduler
/// reports progress under it. A policy chooses it ([`crate::policy::Policy::eviction_cost`]):
/// BidBrain runs AgileML, standard bidding runs checkpoint/restart.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "model", rename_all = "kebab-case")]
pub enum EvictionCost {
    /// See [`EvictionCostSpec::AgileMl`].
    #[serde(rename = "agileml")]
    AgileMl {
        sync_interval_secs: f64,
        rebalance_secs: f64,
    },
    /// See [`EvictionCostSpec::Checkpoint`].
    Checkpoint {
        interval_secs: f64,
        checkpoint_secs: f64,
        restart_secs: f64,
    },
}

impl EvictionCost {
    /// Checks and converts a file form; `key` prefixes the field names in errors.
    pub fn from_spec(spec: &EvictionCostSpec) -> Result<EvictionCost, (String, String)> {
        let positive = |k: &str, v: f64| -> Result<f64, (String, String)> {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err((k.to_string(), format!("{v} must be a positive number")))
            }
        };
        let non_negative = |k: &str, v: f64| -> Result<f64, (String, String)> {
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err((k.to_string(), format!("{v} must be zero or positive")))
            }
        };
        Ok(match *spec {
            EvictionCostSpec::AgileMl {
                sync_interval_minutes,
                rebalance_seconds,
            } => EvictionCost::AgileMl {
                sync_interval_secs: positive("sync_interval_minutes", sync_interval_minutes)?
                    * 60.0,
                rebalance_secs: non_negative("rebalance_seconds", rebalance_seconds)?,
            },
            EvictionCostSpec::Checkpoint {
                interval_minutes,
                checkpoint_minutes,
                restart_minutes,
            } => EvictionCost::Checkpoint {
                interval_secs: positive("interval_minutes", interval_minutes)? * 60.0,
                checkpoint_secs: non_negative("checkpoint_minutes", checkpoint_minutes)? * 60.0,
                restart_secs: non_negative("restart_minutes", restart_minutes)? * 60.0,
            },
        })
    }

    /// Expected work-seconds lost per evicted instance (per instance of its rate), as a policy
    /// estimates it: half a sync interval for AgileML; half a checkpoint interval plus the
    /// restart for checkpoint/restart (which also stops every other instance).
    pub fn expected_loss_secs(&self) -> f64 {
        match *self {
            EvictionCost::AgileMl {
                sync_interval_secs, ..
            } => sync_interval_secs / 2.0,
            EvictionCost::Checkpoint {
                interval_secs,
                restart_secs,
                ..
            } => interval_secs / 2.0 + restart_secs,
        }
    }
}

/// A job work model checked against a price catalog: every type known, every rate positive.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobModel {
    pub name: String,
    /// Units of work to do.
    pub total_work: f64,
    pub reference_type: InstanceType,
    /// Units per instance-hour of each type the job may use (the job's types, sorted).
    rates: BTreeMap<InstanceType, f64>,
    pub max_instances: u32,
    pub max_reliable_instances: u32,
    /// Units of work per hour the footprint may hold at once (see [`crate::engine::limits`]).
    pub max_capacity: Option<f64>,
    /// Seconds from launch to useful work.
    pub startup_secs: f64,
    /// The job's own eviction-cost model (a policy may run it differently).
    pub eviction_cost: EvictionCost,
    pub stages: StageThresholds,
    /// See [`WorkModelSpec::stop_seconds`].
    pub stop_secs: f64,
}

/// How long after a graceful stop's grace Proteus still waits for the final checkpoint's upload
/// and the agent's exit before it ends the instance anyway, seconds.
pub const STOP_UPLOAD_ALLOWANCE_SECS: u64 = 60;

/// A work model that cannot be used, with the field at fault.
#[derive(Debug, Error)]
pub enum JobError {
    /// The cause is in the message, not also a `source()` (see `prices::files::FileError`).
    #[error("{file}: cannot read: {cause}")]
    Io { file: String, cause: std::io::Error },
    #[error("{file}: {problem}")]
    Syntax { file: String, problem: String },
    #[error("{file}: key `{key}`: {problem}")]
    Field {
        file: String,
        key: String,
        problem: String,
    },
}

impl WorkModelSpec {
    /// Reads a TOML or JSON file (JSON if the first non-blank character is `{`).
    pub fn load(path: &Path) -> Result<WorkModelSpec, JobError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|cause| JobError::Io {
            file: file.clone(),
            cause,
        })?;
        Self::parse(&file, &text)
    }

    /// Parses TOML or JSON text; `file` names the source in errors.
    pub fn parse(file: &str, text: &str) -> Result<WorkModelSpec, JobError> {
        let syntax = |problem: String| JobError::Syntax {
            file: file.to_string(),
            problem,
        };
        if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| syntax(e.to_string()))
        } else {
            toml::from_str(text).map_err(|e| syntax(e.to_string().trim_end().to_string()))
        }
    }

    /// Checks every field and resolves throughputs against `on_demand` (and the built-in
    /// catalog for vCPUs the price table lacks). `file` names the source in errors.
    pub fn resolve(
        &self,
        file: &str,
        on_demand: &OnDemandCatalog,
        region: &Region,
    ) -> Result<JobModel, JobError> {
        let field = |key: &str, problem: String| JobError::Field {
            file: file.to_string(),
            key: key.to_string(),
            problem,
        };
        if !(self.total_work.is_finite() && self.total_work > 0.0) {
            return Err(field(
                "total_work",
                format!("{} must be a positive number of units", self.total_work),
            ));
        }
        if self.max_instances == 0 {
            return Err(field("max_instances", "must be at least 1".into()));
        }
        if !(self.startup_minutes.is_finite() && self.startup_minutes >= 0.0) {
            return Err(field(
                "startup_minutes",
                format!("{} must be zero or positive", self.startup_minutes),
            ));
        }
        let known_types = || {
            let mut names: Vec<String> = on_demand
                .offers()
                .filter(|o| &o.region == region)
                .map(|o| o.instance_type.to_string())
                .collect();
            names.sort();
            names.join(", ")
        };
        let vcpus_of = |t: &InstanceType| {
            on_demand
                .get(region, t)
                .and_then(|o| o.vcpus)
                .or_else(|| catalog::lookup(t).map(|k| k.vcpus))
        };
        let reference_type = InstanceType::parse(&self.reference_type)
            .map_err(|e| field("reference_type", e.to_string()))?;
        let reference_vcpus = vcpus_of(&reference_type);
        if self.instance_types.is_empty() {
            return Err(field(
                "instance_types",
                "must name at least one instance type".into(),
            ));
        }
        for name in self.throughput.keys() {
            if !self.instance_types.iter().any(|t| t.trim() == name.trim()) {
                return Err(field(
                    &format!("throughput.\"{name}\""),
                    format!(
                        "`{name}` is not one of instance_types ({})",
                        self.instance_types.join(", ")
                    ),
                ));
            }
        }
        let mut rates = BTreeMap::new();
        for name in &self.instance_types {
            let t =
                InstanceType::parse(name).map_err(|e| field("instance_types", e.to_string()))?;
            if on_demand.get(region, &t).is_none() {
                return Err(field(
                    "instance_types",
                    format!(
                        "unknown instance type `{t}`: no on-demand price for it in {region} (known types: {})",
                        known_types()
                    ),
                ));
            }
            let rate = match self.throughput.get(name) {
                Some(&r) if r.is_finite() && r > 0.0 => r,
                Some(&r) => {
                    return Err(field(
                        &format!("throughput.\"{name}\""),
                        format!("{r} must be a positive number"),
                    ));
                }
                None => {
                    let (Some(v), Some(rv)) = (vcpus_of(&t), reference_vcpus) else {
                        return Err(field(
                            &format!("throughput.\"{name}\""),
                            format!(
                                "the vCPU count of `{t}` or of the reference type `{reference_type}` is unknown; \
                                 give its throughput explicitly"
                            ),
                        ));
                    };
                    f64::from(v) / f64::from(rv)
                }
            };
            if rates.insert(t.clone(), rate).is_some() {
                return Err(field("instance_types", format!("`{t}` is listed twice")));
            }
        }
        let eviction_cost = EvictionCost::from_spec(&self.eviction_cost)
            .map_err(|(k, p)| field(&format!("eviction_cost.{k}"), p))?;
        let max_reliable = self
            .max_reliable_instances
            .unwrap_or((self.max_instances / 8).max(1));
        if max_reliable > self.max_instances {
            return Err(field(
                "max_reliable_instances",
                format!(
                    "{max_reliable} exceeds max_instances ({})",
                    self.max_instances
                ),
            ));
        }
        if let Some(c) = self.max_capacity
            && !(c.is_finite() && c > 0.0)
        {
            return Err(field(
                "max_capacity",
                format!("{c} must be a positive number of units per hour"),
            ));
        }
        if !(self.stop_seconds.is_finite() && (0.0..=3600.0).contains(&self.stop_seconds)) {
            return Err(field(
                "stop_seconds",
                format!("{} must be between 0 and 3600", self.stop_seconds),
            ));
        }
        if !(self.stages.stage3_ratio.is_finite() && self.stages.stage3_ratio > 0.0) {
            return Err(field(
                "stages.stage3_ratio",
                "must be a positive number".into(),
            ));
        }
        Ok(JobModel {
            name: self.name.clone().unwrap_or_else(|| file.to_string()),
            total_work: self.total_work,
            reference_type,
            rates,
            max_instances: self.max_instances,
            max_reliable_instances: max_reliable,
            max_capacity: self.max_capacity,
            startup_secs: self.startup_minutes * 60.0,
            eviction_cost,
            stages: self.stages,
            stop_secs: self.stop_seconds,
        })
    }
}

impl JobModel {
    /// Units per instance-hour of `instance_type`, or `None` if the job does not run on it.
    pub fn rate(&self, instance_type: &InstanceType) -> Option<f64> {
        self.rates.get(instance_type).copied()
    }

    /// The job's instance types with their rates, sorted by type name.
    pub fn rates(&self) -> impl Iterator<Item = (&InstanceType, f64)> {
        self.rates.iter().map(|(t, r)| (t, *r))
    }

    /// The highest rate of any of the job's types.
    pub fn max_rate(&self) -> f64 {
        self.rates.values().copied().fold(0.0, f64::max)
    }

    /// Units per hour at full parallelism on the reference type: the speed a job owner expects
    /// from `max_instances` (BidBrain's default capacity target).
    pub fn full_speed(&self) -> f64 {
        f64::from(self.max_instances) * self.rate(&self.reference_type).unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::UsdPerHour;
    use crate::prices::InstanceOffer;

    fn catalog() -> (OnDemandCatalog, Region) {
        let region = Region::parse("us-east-1").unwrap();
        let offer = |t: &str, p: f64| InstanceOffer {
            region: region.clone(),
            instance_type: InstanceType::parse(t).unwrap(),
            vcpus: None,
            memory_gib: None,
            on_demand: UsdPerHour::new(p).unwrap(),
        };
        (
            OnDemandCatalog::new([
                offer("c3.xlarge", 0.21),
                offer("m3.medium", 0.067),
                offer("d2.8xlarge", 5.52),
            ]),
            region,
        )
    }

    const BASE: &str = r#"
        total_work = 1000.0
        reference_type = "c3.xlarge"
        instance_types = ["c3.xlarge", "m3.medium", "d2.8xlarge"]
        max_instances = 64
    "#;

    #[test]
    fn defaults_are_vcpu_proportional() {
        let (od, region) = catalog();
        let job = WorkModelSpec::parse("j.toml", BASE)
            .unwrap()
            .resolve("j.toml", &od, &region)
            .unwrap();
        let c3 = InstanceType::parse("c3.xlarge").unwrap();
        assert_eq!(job.rate(&c3), Some(1.0));
        assert_eq!(
            job.rate(&InstanceType::parse("m3.medium").unwrap()),
            Some(0.25)
        );
        assert_eq!(
            job.rate(&InstanceType::parse("d2.8xlarge").unwrap()),
            Some(9.0)
        );
        assert_eq!(job.max_reliable_instances, 8);
        assert_eq!(job.startup_secs, 300.0);
        assert_eq!(job.full_speed(), 64.0);
        assert!(matches!(
            job.eviction_cost,
            EvictionCost::AgileMl {
                sync_interval_secs: 120.0,
                ..
            }
        ));
        assert_eq!(job.stages.stage3_ratio, 15.0);
    }

    #[test]
    fn overrides_and_checkpoint_model() {
        let (od, region) = catalog();
        let text = format!(
            "{BASE}\n[throughput]\n\"m3.medium\" = 0.3\n[eviction_cost]\nmodel = \"checkpoint\"\n\
             interval_minutes = 60\ncheckpoint_minutes = 2\nrestart_minutes = 3\n"
        );
        let job = WorkModelSpec::parse("j.toml", &text)
            .unwrap()
            .resolve("j.toml", &od, &region)
            .unwrap();
        assert_eq!(
            job.rate(&InstanceType::parse("m3.medium").unwrap()),
            Some(0.3)
        );
        assert_eq!(
            job.eviction_cost,
            EvictionCost::Checkpoint {
                interval_secs: 3600.0,
                checkpoint_secs: 120.0,
                restart_secs: 180.0
            }
        );
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let (od, region) = catalog();
        let resolve = |text: &str| {
            WorkModelSpec::parse("j.toml", text)
                .and_then(|s| s.resolve("j.toml", &od, &region))
                .unwrap_err()
                .to_string()
        };
        let err = resolve(&BASE.replace("\"m3.medium\"", "\"c9.huge\""));
        assert!(
            err.starts_with("j.toml: key `instance_types`: unknown instance type `c9.huge`"),
            "{err}"
        );
        assert!(
            err.contains("known types: c3.xlarge, d2.8xlarge, m3.medium"),
            "{err}"
        );
        let err = resolve(&BASE.replace("1000.0", "-5"));
        assert!(err.contains("key `total_work`"), "{err}");
        let err = resolve(&format!("{BASE}\nmax_cpus = 3\n"));
        assert!(err.contains("unknown field `max_cpus`"), "{err}");
        let err = resolve(&format!("{BASE}\n[eviction_cost]\nmodel = \"magic\"\n"));
        assert!(
            err.contains("unknown variant `magic`") && err.contains("agileml"),
            "{err}"
        );
        let err = resolve(&format!("{BASE}\n[throughput]\n\"r3.large\" = 2.0\n"));
        assert!(err.contains("key `throughput.\"r3.large\"`"), "{err}");
    }

    #[test]
    fn json_is_accepted() {
        let (od, region) = catalog();
        let json = r#"{"total_work": 10, "reference_type": "c3.xlarge", "instance_types": ["c3.xlarge"],
                       "max_instances": 4, "max_reliable_instances": 1}"#;
        let job = WorkModelSpec::parse("j.json", json)
            .unwrap()
            .resolve("j.json", &od, &region)
            .unwrap();
        assert_eq!(job.max_reliable_instances, 1);
    }
}
