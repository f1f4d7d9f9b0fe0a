//! Cloud drivers: where instances come from.
//!
//! The scheduler speaks only this trait, so the same decisions run on EC2 (real or LocalStack)
//! and on the simulated cloud that replays a spot trace. Every instance carries the broker's own
//! instance id as a tag; that tag, not the cloud's answer to a launch call, is how a restarted
//! broker finds what it bought.

#[cfg(feature = "ec2")]
pub mod ec2;
pub mod faults;
pub mod sim;

use crate::market::{Market, Timestamp, UsdPerHour};
use async_trait::async_trait;
use proteus_wire::{JobId, Tier};
use std::fmt;
use thiserror::Error;

/// Tag keys put on every resource.
pub mod tags {
    /// The broker's id of the instance (also the launch's idempotency token).
    pub const INSTANCE_ID: &str = "proteus:instance-id";
    pub const JOB_ID: &str = "proteus:job-id";
    /// Present on everything Proteus launched, valued with the broker's deployment name:
    /// what reconciliation lists.
    pub const MANAGED: &str = "proteus:managed";
    pub const TIER: &str = "proteus:tier";
}

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The broker's id: tag and idempotency token.
    pub instance_id: String,
    pub job_id: JobId,
    pub market: Market,
    pub tier: Tier,
    /// Spot max price; `None` for on-demand.
    pub bid: Option<UsdPerHour>,
    /// The per-instance agent token, delivered in the launch data.
    pub bootstrap_token: String,
}

/// The cloud's view of an instance.
#[derive(Debug, Clone, PartialEq)]
pub struct CloudInstance {
    pub cloud_id: String,
    /// From the `proteus:instance-id` tag.
    pub instance_id: Option<String>,
    pub job_id: Option<JobId>,
    pub state: CloudState,
    pub launched: Option<Timestamp>,
    /// The provider ended it (spot reclaim), as opposed to a user's terminate call.
    pub ended_by_provider: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloudState {
    Pending,
    Running,
    ShuttingDown,
    Terminated,
}

impl CloudState {
    pub fn is_gone(self) -> bool {
        matches!(self, CloudState::ShuttingDown | CloudState::Terminated)
    }
}

/// Something the provider did to an instance.
#[derive(Debug, Clone, PartialEq)]
pub enum CloudEvent {
    /// The two-minute notice: the instance will be reclaimed at `action_time`.
    Warning {
        cloud_id: String,
        at: Timestamp,
        action_time: Timestamp,
    },
    /// The instance is gone.
    Ended {
        cloud_id: String,
        at: Timestamp,
        by_provider: bool,
    },
}

/// Why a launch or call failed. The capacity-type errors make the scheduler avoid the market for
/// a cool-down instead of retrying it at once.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum CloudError {
    #[error("InsufficientInstanceCapacity in {market}: {message}")]
    InsufficientCapacity { market: String, message: String },
    #[error("MaxSpotInstanceCountExceeded: {message}")]
    SpotQuotaExceeded { message: String },
    #[error("bid too low in {market}: {message}")]
    PriceTooLow { market: String, message: String },
    /// A launch's ClientToken was used before with other parameters (EC2's
    /// `IdempotentParameterMismatch`): a relaunch that is not the same launch.
    #[error("IdempotentParameterMismatch: {message}")]
    IdempotentParameterMismatch { message: String },
    #[error("{operation} failed: {message}")]
    Call {
        operation: &'static str,
        message: String,
    },
}

impl CloudError {
    /// The short reason shown in status and events.
    pub fn reason(&self) -> &'static str {
        match self {
            CloudError::InsufficientCapacity { .. } => "insufficient-capacity",
            CloudError::SpotQuotaExceeded { .. } => "spot-quota-exceeded",
            CloudError::PriceTooLow { .. } => "price-too-low",
            CloudError::IdempotentParameterMismatch { .. } => "idempotent-parameter-mismatch",
            CloudError::Call { .. } => "cloud-error",
        }
    }

    /// Whether the market should be avoided for a while rather than retried.
    pub fn cools_down_market(&self) -> bool {
        !matches!(
            self,
            CloudError::Call { .. } | CloudError::IdempotentParameterMismatch { .. }
        )
    }
}

/// The driver interface.
#[async_trait]
pub trait Cloud: Send + Sync + fmt::Debug {
    /// `sim` or `ec2`.
    fn kind(&self) -> &'static str;

    /// Launches one instance. Implementations must tag it with [`tags`] so that a crash between
    /// this call and the broker recording its answer is recoverable by [`Cloud::describe`].
    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError>;

    /// Asks for instances to be terminated (idempotent: unknown or gone ids are fine).
    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError>;

    /// Every instance Proteus launched that the cloud still knows about.
    async fn describe(&self) -> Result<Vec<CloudInstance>, CloudError>;

    /// What the provider did since the last call (warnings, reclaims). Clouds whose warnings
    /// reach only the instance itself (EC2) report terminations here and warnings via the agent.
    async fn events(&self) -> Result<Vec<CloudEvent>, CloudError>;

    /// The next market time after `now` at which this cloud reports something of its own
    /// accord (a warning, a reclaim), when it knows in advance (the simulated cloud does), so
    /// that a driver stepping market time itself can land on it.
    fn next_event_after(&self, now: Timestamp) -> Option<Timestamp> {
        let _ = now;
        None
    }

    /// Interrupts a spot instance now, as the provider would when the price crossed its bid:
    /// the two-minute warning, then the reclaim. This is what AWS Fault Injection Service's
    /// `aws:ec2:send-spot-instance-interruptions` action does, and it exists for the same
    /// reason: to try a job's eviction handling at a moment of one's choosing. Clouds that
    /// cannot do it say so.
    async fn send_interruption(&self, cloud_id: &str) -> Result<(), CloudError> {
        Err(CloudError::Call {
            operation: "SendSpotInstanceInterruptions",
            message: format!(
                "the {} cloud does not interrupt instances on request (on AWS, run a Fault \
                 Injection Service experiment with aws:ec2:send-spot-instance-interruptions \
                 against {cloud_id})",
                self.kind()
            ),
        })
    }
}
