//! The broker's pool book: what every job, of every broker on the database, saw of each spot
//! pool. Observations go to the store as they happen (a spot launch granted or refused for
//! capacity, an interruption notice, a spot instance its job let go); every tick folds the
//! rows not yet folded into the book, which every job's decisions then read
//! ([`crate::market_model::pool_book`]). The log is the truth: a restarted broker, or another
//! on the same database, folds the same book from it.

use super::Broker;
use crate::market::{Market, Timestamp};
use crate::market_model::pool_book::{PoolBook, PoolObservation, PoolSummary, Seen};
use std::collections::BTreeSet;

/// Rows read per query; a tick reads until it has caught up.
const BATCH: i64 = 1_000;
/// Ids below the highest folded by more than this are taken as settled. Postgres hands out ids
/// in insertion order but commits need not follow it: a row may appear after one with a higher
/// id, so a window below the highest is read again and rows already folded are skipped.
const REREAD_WINDOW: i64 = 256;

/// The book and which rows it holds.
pub(crate) struct Pools {
    book: PoolBook,
    folded: BTreeSet<i64>,
}

impl Pools {
    pub(crate) fn new() -> Self {
        Pools {
            // The prior BidBrain plans with; a policy on another model ignores the book.
            book: PoolBook::new(crate::policy::TodayConfig::default().availability, true),
            folded: BTreeSet::new(),
        }
    }

    pub(crate) fn book(&self) -> &PoolBook {
        &self.book
    }

    fn low_water(&self) -> i64 {
        self.folded
            .last()
            .map_or(0, |&max| (max - REREAD_WINDOW).max(0))
    }
}

impl Broker {
    /// Records what was seen of a spot pool. A failure to record loses one observation, never
    /// the action that made it: it is logged.
    pub(crate) async fn saw_pool(&self, market: &Market, at: Timestamp, seen: Seen) {
        let o = PoolObservation {
            market: market.clone(),
            at,
            seen,
        };
        if let Err(e) = self.store.add_pool_observation(&o).await {
            tracing::warn!(%market, ?seen, error = %e, "cannot record an observation of the pool");
        }
    }

    /// Folds the observations not yet in the book, in id order.
    pub(crate) async fn refresh_pools(&self) {
        loop {
            let after = self
                .pools
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .low_water();
            let rows = match self.store.pool_observations_after(after, BATCH).await {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the pools' observations; next tick");
                    return;
                }
            };
            let full = rows.len() as i64 == BATCH;
            let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
            let before = pools.folded.len();
            for (id, o) in rows {
                if pools.folded.insert(id) {
                    pools.book.observe(&o);
                }
            }
            let low = pools.low_water();
            pools.folded.retain(|&id| id >= low);
            if !full || pools.folded.len() == before {
                return;
            }
        }
    }

    /// What the fleet has seen of each pool, at `now`.
    pub fn pool_summary(&self, now: Timestamp) -> Vec<PoolSummary> {
        self.pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .book()
            .summary(now)
    }
}
