//! The fleet's observations of spot pools: an append-only log that every broker folds into its
//! pool book ([`crate::market_model::pool_book`]).

use super::{Context, Store, StoreError, with_db};
use crate::market::{Market, Timestamp};
use crate::market_model::pool_book::{PoolObservation, Seen};

fn seen_text(seen: Seen) -> &'static str {
    match seen {
        Seen::Granted => "granted",
        Seen::Refused => "refused",
        Seen::Interrupted => "interrupted",
        Seen::Released => "released",
    }
}

fn seen_of(text: &str) -> Option<Seen> {
    Some(match text {
        "granted" => Seen::Granted,
        "refused" => Seen::Refused,
        "interrupted" => Seen::Interrupted,
        "released" => Seen::Released,
        _ => return None,
    })
}

impl Store {
    /// Appends one observation to the log.
    pub async fn add_pool_observation(&self, o: &PoolObservation) -> Result<(), StoreError> {
        with_db!(self, |pool| {
            sqlx::query("INSERT INTO pool_observations (market, at_ms, seen) VALUES ($1, $2, $3)")
                .bind(o.market.to_string())
                .bind(o.at.millis())
                .bind(seen_text(o.seen))
                .execute(pool)
                .await
                .context("recording an observation of a spot pool")?;
        });
        Ok(())
    }

    /// Observations with an id above `after`, in id order, at most `limit`, each with its id.
    pub async fn pool_observations_after(
        &self,
        after: i64,
        limit: i64,
    ) -> Result<Vec<(i64, PoolObservation)>, StoreError> {
        let rows: Vec<(i64, String, i64, String)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT id, market, at_ms, seen FROM pool_observations WHERE id > $1 \
                 ORDER BY id LIMIT $2",
            )
            .bind(after)
            .bind(limit)
            .fetch_all(pool)
            .await
            .context("reading observations of spot pools")?
        });
        rows.into_iter()
            .map(|(id, market, at, seen)| {
                let bad = |what: String| {
                    StoreError::Invalid(format!("stored pool observation {id}: {what}"))
                };
                Ok((
                    id,
                    PoolObservation {
                        market: Market::parse(&market).map_err(|e| bad(e.to_string()))?,
                        at: Timestamp::from_millis(at),
                        seen: seen_of(&seen)
                            .ok_or_else(|| bad(format!("`{seen}` is no observation")))?,
                    },
                ))
            })
            .collect()
    }
}
