//! The digest of a run's decisions: what was bought, where, at what bid, and how each instance
//! ended, with market times. Two runs that made the same decisions at the same instants print
//! the same digest, whichever driver ran them (the simulator from its own records, the live
//! broker from its store), so `proteus demo` and `proteus simulate` can be compared by it.

use crate::market::{Market, Timestamp};
use proteus_wire::Tier;
use sha2::{Digest, Sha256};

/// One launched instance, as both drivers know it. Ids are left out: they are the driver's own
/// (random in the broker).
#[derive(Debug, Clone, PartialEq)]
pub struct Launched<'a> {
    /// When the policy's launch was made.
    pub at: Timestamp,
    pub market: &'a Market,
    pub tier: Tier,
    /// The spot bid, USD per hour.
    pub bid: Option<f64>,
    /// `None`: still running.
    pub ended: Option<Timestamp>,
    pub ended_by_provider: bool,
}

/// [`decisions_digest`] of a live job's stored instances (those that were launched).
pub fn of_stored(rows: &[crate::store::InstanceRow]) -> String {
    decisions_digest(
        rows.iter()
            .filter(|i| i.launched.is_some())
            .map(|i| Launched {
                at: i.requested,
                market: &i.market,
                tier: i.tier,
                bid: i.bid.map(|b| b.get()),
                ended: i.ended,
                ended_by_provider: i.ended_by_provider,
            }),
    )
}

/// The first 8 bytes of SHA-256 over the instances' lines, sorted (instances launched at the
/// same instant may be listed in any order), in hex.
pub fn decisions_digest<'a>(instances: impl IntoIterator<Item = Launched<'a>>) -> String {
    let mut lines: Vec<String> = instances
        .into_iter()
        .map(|i| {
            format!(
                "{} {} {:?} {:?} {:?} {}\n",
                i.at.millis(),
                i.market,
                i.tier,
                i.bid,
                i.ended.map(|t| t.millis()),
                i.ended_by_provider
            )
        })
        .collect();
    lines.sort();
    let mut hasher = Sha256::new();
    for line in &lines {
        hasher.update(line.as_bytes());
    }
    hex::encode(&hasher.finalize()[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_does_not_matter_and_every_field_does() {
        let m: Market = "us-east-1a/c3.xlarge".parse().expect("market");
        let a = Launched {
            at: Timestamp::from_millis(1000),
            market: &m,
            tier: Tier::Transient,
            bid: Some(0.1),
            ended: Some(Timestamp::from_millis(5000)),
            ended_by_provider: true,
        };
        let b = Launched {
            at: Timestamp::from_millis(2000),
            tier: Tier::Reliable,
            bid: None,
            ..a.clone()
        };
        let d = decisions_digest([a.clone(), b.clone()]);
        assert_eq!(d, decisions_digest([b.clone(), a.clone()]));
        assert_eq!(d.len(), 16);
        let c = Launched {
            ended_by_provider: false,
            ..a.clone()
        };
        assert_ne!(d, decisions_digest([c, b.clone()]));
        let e = Launched {
            ended: Some(Timestamp::from_millis(5001)),
            ..a
        };
        assert_ne!(d, decisions_digest([e, b]));
    }
}
