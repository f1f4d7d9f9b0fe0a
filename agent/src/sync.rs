//! Synchronisation models: how far a worker may run ahead of the slowest update, and whether
//! workers help each other (FlexRR's RapidReassignment, in [`crate::reassign`]).

use proteus_wire::agent_api::SyncModel;

/// The worker-side rule of a [`SyncModel`]; the worker asks [`SyncPolicy::needed_clock`] before
/// each clock and [`SyncPolicy::helper_group`] whether to reassign work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncPolicy(pub SyncModel);

impl From<SyncModel> for SyncPolicy {
    fn from(m: SyncModel) -> Self {
        SyncPolicy(m)
    }
}

impl SyncPolicy {
    /// The clock whose updates must all be in before a worker starts `clock` (None: nothing to
    /// wait for): `clock - slack - 1`, so BSP (slack 0) waits for the previous clock.
    pub fn needed_clock(self, clock: u64) -> Option<u64> {
        clock.checked_sub(u64::from(self.0.slack()) + 1)
    }

    pub fn slack(self) -> u32 {
        self.0.slack()
    }

    /// Helper-group size when RapidReassignment is on.
    pub fn helper_group(self) -> Option<u32> {
        self.0.helper_group()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needed_clock_follows_slack() {
        let bsp = SyncPolicy(SyncModel::Bsp);
        assert_eq!(bsp.needed_clock(0), None);
        assert_eq!(bsp.needed_clock(5), Some(4));
        let ssp = SyncPolicy(SyncModel::Ssp { slack: 2 });
        assert_eq!(ssp.needed_clock(2), None);
        assert_eq!(ssp.needed_clock(3), Some(0));
        assert_eq!(ssp.needed_clock(10), Some(7));
        let f = SyncPolicy(SyncModel::Flexrr {
            slack: 0,
            helpers: 2,
        });
        assert_eq!(f.needed_clock(5), Some(4));
        assert_eq!(f.helper_group(), Some(2));
    }
}
