//! Synchronisation models: how far a worker may run ahead of the slowest update.

use proteus_wire::agent_api::SyncModel;

/// The worker-side rule of a [`SyncModel`]. New models (SSP's slack, FlexRR) add variants here
/// and in the wire enum; the worker only asks [`SyncPolicy::needed_clock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    Bsp,
}

impl From<SyncModel> for SyncPolicy {
    fn from(m: SyncModel) -> Self {
        match m {
            SyncModel::Bsp => SyncPolicy::Bsp,
        }
    }
}

impl SyncPolicy {
    /// The clock whose updates must all be in before a worker starts `clock` (None: nothing to
    /// wait for).
    pub fn needed_clock(self, clock: u64) -> Option<u64> {
        match self {
            SyncPolicy::Bsp => clock.checked_sub(1),
        }
    }
}
