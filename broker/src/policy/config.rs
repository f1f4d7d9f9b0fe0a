//! Policy files: `policies/*.toml`, one policy each, selected by `kind`.
//!
//! ```toml
//! kind = "bidbrain"            # bidbrain | on-demand | standard-bidding | skypilot-default
//!                              # | uniform-progress
//! name = "bidbrain"            # optional; default: the file's stem
//! # …the kind's keys: see BidBrainConfig, OnDemandConfig, StandardBiddingConfig
//! ```
//!
//! Unknown keys are refused (a typo must not silently fall back to a default). Errors name the
//! file, the key and the allowed values.

use super::{
    BidBrain, BidBrainConfig, OnDemandConfig, OnDemandPolicy, Policy, PolicyKind, SkypilotConfig,
    SkypilotDefault, StandardBidding, StandardBiddingConfig, UniformProgress,
    UniformProgressConfig,
};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The parsed content of a policy file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind")]
pub enum PolicySpec {
    #[serde(rename = "bidbrain")]
    BidBrain(BidBrainConfig),
    #[serde(rename = "on-demand")]
    OnDemand(OnDemandConfig),
    #[serde(rename = "standard-bidding")]
    StandardBidding(StandardBiddingConfig),
    #[serde(rename = "skypilot-default")]
    SkypilotDefault(SkypilotConfig),
    #[serde(rename = "uniform-progress")]
    UniformProgress(UniformProgressConfig),
}

impl PolicySpec {
    pub fn kind(&self) -> PolicyKind {
        match self {
            PolicySpec::BidBrain(_) => PolicyKind::BidBrain,
            PolicySpec::OnDemand(_) => PolicyKind::OnDemand,
            PolicySpec::StandardBidding(_) => PolicyKind::StandardBidding,
            PolicySpec::SkypilotDefault(_) => PolicyKind::SkypilotDefault,
            PolicySpec::UniformProgress(_) => PolicyKind::UniformProgress,
        }
    }

    /// Builds the policy; `default_name` is used when the file has no `name`.
    pub fn build(self, file: &str, default_name: &str) -> Result<Box<dyn Policy>, PolicyLoadError> {
        let field = |(key, problem, allowed): (String, String, String)| PolicyLoadError::Field {
            file: file.to_string(),
            key,
            problem,
            allowed,
        };
        let name = |n: &Option<String>| n.clone().unwrap_or_else(|| default_name.to_string());
        Ok(match self {
            PolicySpec::BidBrain(c) => Box::new(BidBrain::new(name(&c.name), c).map_err(field)?),
            PolicySpec::OnDemand(c) => {
                Box::new(OnDemandPolicy::new(name(&c.name), c).map_err(field)?)
            }
            PolicySpec::StandardBidding(c) => {
                Box::new(StandardBidding::new(name(&c.name), c).map_err(field)?)
            }
            PolicySpec::SkypilotDefault(c) => {
                Box::new(SkypilotDefault::new(name(&c.name), c).map_err(field)?)
            }
            PolicySpec::UniformProgress(c) => {
                Box::new(UniformProgress::new(name(&c.name), c).map_err(field)?)
            }
        })
    }
}

/// Why a policy file could not be used.
#[derive(Debug, Error)]
pub enum PolicyLoadError {
    /// The cause is in the message, not also a `source()` (see `prices::files::FileError`).
    #[error("{file}: cannot read: {cause}")]
    Io { file: String, cause: std::io::Error },
    #[error("{file}: {problem}")]
    Syntax { file: String, problem: String },
    #[error("{file}: key `{key}`: {problem} (allowed: {allowed})")]
    Field {
        file: String,
        key: String,
        problem: String,
        allowed: String,
    },
    #[error("no policy named `{name}`: {path} does not exist (policies there: {available})")]
    NotFound {
        name: String,
        path: String,
        available: String,
    },
}

/// Parses policy text; `file` names it in errors and its stem is the default name.
pub fn parse_policy(file: &str, text: &str) -> Result<Box<dyn Policy>, PolicyLoadError> {
    let spec: PolicySpec = toml::from_str(text).map_err(|e| PolicyLoadError::Syntax {
        file: file.to_string(),
        problem: explain_toml_error(e),
    })?;
    let stem = Path::new(file)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| file.to_string());
    spec.build(file, &stem)
}

/// serde's messages for the internally tagged `kind` do not list the kinds; add them.
fn explain_toml_error(e: toml::de::Error) -> String {
    let msg = e.message().to_string();
    let mut out = e.to_string().trim_end().to_string();
    if msg.contains("missing field `kind`")
        || msg.contains("unknown variant") && msg.contains("kind")
    {
        out.push_str(&format!(" (key `kind`, allowed: {})", PolicyKind::ALLOWED));
    }
    out
}

/// Reads and builds a policy file.
pub fn load_policy_file(path: &Path) -> Result<Box<dyn Policy>, PolicyLoadError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|cause| PolicyLoadError::Io {
        file: file.clone(),
        cause,
    })?;
    parse_policy(&file, &text)
}

/// The repository's `policies/` directory: `$PROTEUS_POLICIES_DIR`, else a `policies/` beside
/// or above the running binary (an installed tree), else the one in the source tree.
pub fn policies_dir() -> PathBuf {
    crate::data::project_dir("policies", Some("PROTEUS_POLICIES_DIR"), "bidbrain.toml")
}

/// A policy argument as a path: an existing file, anything that looks like a path (has a `/`
/// or ends in `.toml`), or a bare name (`bidbrain`) looked up in [`policies_dir`].
pub fn resolve_policy_path(arg: &str) -> Result<PathBuf, PolicyLoadError> {
    let as_path = Path::new(arg);
    if as_path.is_file() || arg.contains('/') || arg.ends_with(".toml") {
        return Ok(as_path.to_path_buf());
    }
    let dir = policies_dir();
    let path = dir.join(format!("{arg}.toml"));
    if path.is_file() {
        return Ok(path);
    }
    let mut available: Vec<String> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let p = e.path();
                    if p.extension()? != "toml" {
                        return None;
                    }
                    Some(p.file_stem()?.to_string_lossy().into_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    available.sort();
    Err(PolicyLoadError::NotFound {
        name: arg.to_string(),
        path: path.display().to_string(),
        available: if available.is_empty() {
            "none".into()
        } else {
            available.join(", ")
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_defaults() {
        let p = parse_policy("p/bb.toml", "kind = \"bidbrain\"\n").unwrap();
        assert_eq!((p.name(), p.kind()), ("bb", PolicyKind::BidBrain));
        let p = parse_policy("od.toml", "kind = \"on-demand\"\nname = \"all-od\"\n").unwrap();
        assert_eq!((p.name(), p.kind()), ("all-od", PolicyKind::OnDemand));
        let p = parse_policy(
            "sb.toml",
            "kind = \"standard-bidding\"\n[checkpoint]\ninterval_minutes = 60\ncheckpoint_minutes = 2\nrestart_minutes = 3\n",
        )
        .unwrap();
        assert_eq!(p.kind(), PolicyKind::StandardBidding);
    }

    #[test]
    fn errors_name_file_key_and_allowed_values() {
        let err = |text: &str| {
            parse_policy("x.toml", text)
                .err()
                .expect("should fail")
                .to_string()
        };
        let e = err("kind = \"magic\"\n");
        assert!(e.starts_with("x.toml: "), "{e}");
        assert!(
            e.contains("bidbrain") && e.contains("standard-bidding"),
            "{e}"
        );
        let e = err("name = \"x\"\n");
        assert!(e.contains("kind") && e.contains("on-demand"), "{e}");
        let e = err("kind = \"bidbrain\"\nbid_delta = [0.1]\n");
        assert!(
            e.contains("unknown field `bid_delta`") && e.contains("bid_deltas"),
            "{e}"
        );
        let e = err("kind = \"bidbrain\"\nbid_deltas = [0.1, -1.0]\n");
        assert!(
            e.contains("key `bid_deltas`") && e.contains("allowed: fractions ≥ 0"),
            "{e}"
        );
        let e = err("kind = \"bidbrain\"\n[reliable]\ninstance_type = \"cheapest\"\n");
        assert!(e.contains("cheapest-per-work"), "{e}");
        let e = err("kind = \"bidbrain\"\nmarkets = [\"us-east-1\"]\n");
        assert!(e.contains("key `markets`"), "{e}");
        let e = err(
            "kind = \"standard-bidding\"\n[checkpoint]\ninterval_minutes = 0\ncheckpoint_minutes = 2\nrestart_minutes = 3\n",
        );
        assert!(e.contains("key `checkpoint.interval_minutes`"), "{e}");
        let e = err(
            "kind = \"standard-bidding\"\nrank_by = \"vibes\"\n[checkpoint]\ninterval_minutes = 1\ncheckpoint_minutes = 2\nrestart_minutes = 3\n",
        );
        assert!(
            e.contains("lookback-mean") && e.contains("current-price"),
            "{e}"
        );
    }

    /// `policies/bidbrain.toml` says it shows the defaults: it does, for the availability model
    /// fitted on the tuning set too.
    #[test]
    fn the_shipped_bidbrain_file_states_the_defaults() {
        let path = resolve_policy_path("bidbrain").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let shipped: crate::policy::BidBrainConfig = toml::from_str(
            &text
                .lines()
                .filter(|l| !l.starts_with("kind"))
                .collect::<Vec<_>>()
                .join("\n"),
        )
        .unwrap();
        let defaults: crate::policy::BidBrainConfig = toml::from_str("").unwrap();
        assert_eq!(shipped.today, defaults.today);
        assert_eq!(
            crate::policy::BidBrainConfig {
                name: None,
                ..shipped
            },
            defaults,
            "policies/bidbrain.toml differs from BidBrainConfig's defaults"
        );
    }

    #[test]
    fn the_shipped_policies_load() {
        for name in ["bidbrain", "on-demand", "standard-bidding"] {
            let path = resolve_policy_path(name).unwrap();
            let p = load_policy_file(&path).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(p.kind().as_str(), name);
        }
        let err = resolve_policy_path("no-such-policy")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bidbrain") && err.contains("standard-bidding"),
            "{err}"
        );
    }
}
