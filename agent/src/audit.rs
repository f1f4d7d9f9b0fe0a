//! The audit hook: what workers, shards and RapidReassignment report about the work as it
//! happens (clocks started, items processed and why, pushes applied, offers answered), so that
//! tests can check that every item of every clock was computed and applied exactly once.

use proteus_wire::InstanceId;
use std::sync::Arc;

/// What tests learn about the work (the `audit` hook of workers and shards).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuditEvent {
    /// `worker` starts `clock` (its pulls for it are answered).
    Started { worker: InstanceId, clock: u64 },
    /// `worker` computed the update of `partitions` at `clock`.
    Processed {
        worker: InstanceId,
        clock: u64,
        partitions: Vec<u32>,
        how: How,
    },
    /// A shard applied a push (recorded before the pusher hears of it).
    Applied {
        shard: u32,
        clock: u64,
        partitions: Vec<u32>,
    },
    /// `owner` answered an offer for `split..end` of `clock`.
    Offer {
        owner: InstanceId,
        clock: u64,
        split: u32,
        end: u32,
        accepted: bool,
    },
}

/// Why a worker processed some items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum How {
    /// Its own range.
    Own,
    /// A chunk taken over from a slower worker.
    Helped { owner: InstanceId },
    /// A range handed over by a warned worker.
    Delegated,
    /// Recomputed because a shard lacked it (lost push, inherited partition).
    Resent,
}

/// A hook told of every [`AuditEvent`].
pub type Audit = Arc<dyn Fn(AuditEvent) + Send + Sync>;
