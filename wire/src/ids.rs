//! Identifiers and the reliability tier, shared by every message.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A job, as numbered by the broker's store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct JobId(pub i64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An instance as the cloud names it (`i-0abc…` on EC2, `sim-…` in the simulated cloud).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct InstanceId(pub String);

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How reliable a machine is. AgileML places state according to this, not to instance types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// On-demand: the provider never takes it back.
    Reliable,
    /// Spot: revocable, in bulk, with a two-minute warning.
    Transient,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Reliable => "reliable",
            Tier::Transient => "transient",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Tier {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reliable" | "on-demand" | "on_demand" => Ok(Tier::Reliable),
            "transient" | "spot" => Ok(Tier::Transient),
            other => Err(format!(
                "unknown tier `{other}` (expected `reliable` or `transient`)"
            )),
        }
    }
}
