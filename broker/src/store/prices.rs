//! Price history in the store: idempotent bulk ingestion and the reads behind stats, the market
//! model and the simulator.

use super::{Context, Db, Store, StoreError, with_db};
use crate::market::{InstanceType, Market, Product, Region, Timestamp, UsdPerHour, Zone};
use crate::prices::files::SpotPriceRow;
use crate::prices::history::{InstanceOffer, OnDemandCatalog, PriceHistory, PriceSeries};
use serde::Serialize;
use sqlx::AssertSqlSafe;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

/// What an ingestion did: every row read is either inserted or was already stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IngestCounts {
    pub read: u64,
    pub inserted: u64,
    /// On-demand rows whose price or size changed.
    pub updated: u64,
    pub already_present: u64,
}

impl std::ops::AddAssign for IngestCounts {
    fn add_assign(&mut self, o: Self) {
        self.read += o.read;
        self.inserted += o.inserted;
        self.updated += o.updated;
        self.already_present += o.already_present;
    }
}

/// Narrows reads to some markets; `None` fields match everything.
#[derive(Debug, Clone, Default)]
pub struct MarketFilter {
    pub region: Option<Region>,
    pub zone: Option<Zone>,
    pub instance_type: Option<InstanceType>,
}

/// A stored market and how much history it has.
#[derive(Debug, Clone, Serialize)]
pub struct MarketRow {
    pub id: i64,
    pub market: Market,
    pub region: Region,
    pub price_rows: i64,
    pub first: Option<Timestamp>,
    pub last: Option<Timestamp>,
}

/// Markets per multi-row INSERT (4 parameters each).
const MARKET_BATCH: usize = 500;

fn insert_markets_sql(n: usize) -> String {
    let mut sql = String::from(
        "INSERT INTO markets (region, availability_zone, instance_type, product) VALUES ",
    );
    for i in 0..n {
        let p = 4 * i;
        let _ = write!(
            sql,
            "{}(${}, ${}, ${}, ${})",
            if i == 0 { "" } else { "," },
            p + 1,
            p + 2,
            p + 3,
            p + 4
        );
    }
    sql.push_str(" ON CONFLICT (availability_zone, instance_type, product) DO NOTHING");
    sql
}
const SELECT_MARKET_IDS: &str = "SELECT id, availability_zone, instance_type, product FROM markets";

/// Makes sure every market exists and returns the id of each. Expanded per backend so that it can
/// run inside the caller's transaction.
macro_rules! upsert_markets {
    ($conn:expr, $markets:expr) => {{
        let all: Vec<&Market> = $markets.iter().copied().collect();
        for chunk in all.chunks(MARKET_BATCH) {
            let mut query = sqlx::query(AssertSqlSafe(insert_markets_sql(chunk.len())));
            for m in chunk {
                query = query
                    .bind(m.region().as_str().to_string())
                    .bind(m.zone.as_str())
                    .bind(m.instance_type.as_str())
                    .bind(m.product.as_str());
            }
            query
                .execute(&mut *$conn)
                .await
                .context("creating markets")?;
        }
        let rows: Vec<(i64, String, String, String)> = sqlx::query_as(SELECT_MARKET_IDS)
            .fetch_all(&mut *$conn)
            .await
            .context("reading market ids")?;
        rows_to_market_ids(rows)
    }};
}

fn rows_to_market_ids(
    rows: Vec<(i64, String, String, String)>,
) -> Result<HashMap<Market, i64>, StoreError> {
    rows.into_iter()
        .map(|(id, zone, itype, product)| Ok((market_from_columns(&zone, &itype, &product)?, id)))
        .collect()
}

fn market_from_columns(zone: &str, itype: &str, product: &str) -> Result<Market, StoreError> {
    let bad = |e| {
        StoreError::Invalid(format!(
            "stored market {zone}/{itype}/{product} is invalid: {e}"
        ))
    };
    Ok(Market::new(
        Zone::parse(zone).map_err(bad)?,
        InstanceType::parse(itype).map_err(bad)?,
        Product::parse(product).map_err(bad)?,
    ))
}

/// id, region, zone, type, product, price rows, first and last change.
type MarketTuple = (
    i64,
    String,
    String,
    String,
    String,
    i64,
    Option<i64>,
    Option<i64>,
);
/// region, type, vCPUs, memory, on-demand price.
type OfferTuple = (String, String, Option<i64>, Option<f64>, f64);

/// Rows per multi-row INSERT on SQLite: 3 parameters each, well under its 32,766 limit.
const SQLITE_BATCH: usize = 1000;

impl Store {
    /// Stores price changes in one transaction: either all new rows are stored or none.
    /// A row whose market and timestamp are already stored counts as already present.
    pub async fn ingest_spot_prices(
        &self,
        rows: &[SpotPriceRow],
    ) -> Result<IngestCounts, StoreError> {
        let markets: BTreeSet<&Market> = rows.iter().map(|r| &r.market).collect();
        let inserted = match &self.db {
            Db::Postgres(pool) => {
                let mut tx = pool.begin().await.context("starting ingestion")?;
                let ids = upsert_markets!(tx, &markets)?;
                let n = copy_prices_pg(&mut tx, rows, &ids).await?;
                // The file is written, uncommitted: dying here must leave none of it.
                crate::failpoint::hit("ingest-mid-write");
                tx.commit().await.context("committing ingestion")?;
                n
            }
            Db::Sqlite(pool) => {
                let mut tx = pool.begin().await.context("starting ingestion")?;
                let ids = upsert_markets!(tx, &markets)?;
                let mut n = 0;
                for chunk in rows.chunks(SQLITE_BATCH) {
                    n += insert_prices_batch(&mut tx, chunk, &ids).await?;
                    // Part of the file is written, uncommitted: dying here must leave none of it.
                    crate::failpoint::hit("ingest-mid-write");
                }
                tx.commit().await.context("committing ingestion")?;
                n
            }
        };
        let read = rows.len() as u64;
        Ok(IngestCounts {
            read,
            inserted,
            updated: 0,
            already_present: read - inserted,
        })
    }

    /// Stores on-demand offers, updating a type's price or size when it changed.
    pub async fn ingest_on_demand(
        &self,
        offers: &[InstanceOffer],
    ) -> Result<IngestCounts, StoreError> {
        let mut counts = IngestCounts {
            read: offers.len() as u64,
            ..Default::default()
        };
        with_db!(self, |pool| {
            let mut tx = pool.begin().await.context("starting on-demand ingestion")?;
            for o in offers {
                let existing: Option<(Option<i64>, Option<f64>, f64)> = sqlx::query_as(
                    "SELECT vcpus, memory_gib, on_demand_usd_per_hour FROM instance_types \
                     WHERE region = $1 AND instance_type = $2",
                )
                .bind(o.region.as_str())
                .bind(o.instance_type.as_str())
                .fetch_optional(&mut *tx)
                .await
                .context("reading on-demand prices")?;
                let wanted = (o.vcpus.map(i64::from), o.memory_gib, o.on_demand.get());
                let sql = match existing {
                    Some(row) if row == wanted => {
                        counts.already_present += 1;
                        continue;
                    }
                    Some(_) => {
                        counts.updated += 1;
                        "UPDATE instance_types SET vcpus = $3, memory_gib = $4, on_demand_usd_per_hour = $5 \
                         WHERE region = $1 AND instance_type = $2"
                    }
                    None => {
                        counts.inserted += 1;
                        "INSERT INTO instance_types (region, instance_type, vcpus, memory_gib, on_demand_usd_per_hour) \
                         VALUES ($1, $2, $3, $4, $5)"
                    }
                };
                sqlx::query(sql)
                    .bind(o.region.as_str())
                    .bind(o.instance_type.as_str())
                    .bind(wanted.0)
                    .bind(wanted.1)
                    .bind(wanted.2)
                    .execute(&mut *tx)
                    .await
                    .context("writing on-demand prices")?;
            }
            tx.commit().await.context("committing on-demand prices")?;
        });
        Ok(counts)
    }

    /// Every stored market matching the filter, with the extent of its history.
    pub async fn markets(&self, filter: &MarketFilter) -> Result<Vec<MarketRow>, StoreError> {
        let rows: Vec<MarketTuple> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT m.id, m.region, m.availability_zone, m.instance_type, m.product, \
                        COUNT(p.ts_ms), MIN(p.ts_ms), MAX(p.ts_ms) \
                 FROM markets m LEFT JOIN spot_prices p ON p.market_id = m.id \
                 WHERE (CAST($1 AS TEXT) IS NULL OR m.region = $1) \
                   AND (CAST($2 AS TEXT) IS NULL OR m.availability_zone = $2) \
                   AND (CAST($3 AS TEXT) IS NULL OR m.instance_type = $3) \
                 GROUP BY m.id, m.region, m.availability_zone, m.instance_type, m.product \
                 ORDER BY m.instance_type, m.availability_zone, m.product",
            )
            .bind(filter.region.as_ref().map(Region::as_str))
            .bind(filter.zone.as_ref().map(Zone::as_str))
            .bind(filter.instance_type.as_ref().map(InstanceType::as_str))
            .fetch_all(pool)
            .await
            .context("listing markets")?
        });
        rows.into_iter()
            .map(|(id, region, zone, itype, product, n, first, last)| {
                Ok(MarketRow {
                    id,
                    market: market_from_columns(&zone, &itype, &product)?,
                    region: Region::parse(&region)
                        .map_err(|e| StoreError::Invalid(format!("stored region: {e}")))?,
                    price_rows: n,
                    first: first.map(Timestamp::from_millis),
                    last: last.map(Timestamp::from_millis),
                })
            })
            .collect()
    }

    /// Ids of the matching markets, without counting their history.
    async fn market_ids(&self, filter: &MarketFilter) -> Result<HashMap<i64, Market>, StoreError> {
        let rows: Vec<(i64, String, String, String)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT id, availability_zone, instance_type, product FROM markets \
                 WHERE (CAST($1 AS TEXT) IS NULL OR region = $1) \
                   AND (CAST($2 AS TEXT) IS NULL OR availability_zone = $2) \
                   AND (CAST($3 AS TEXT) IS NULL OR instance_type = $3)",
            )
            .bind(filter.region.as_ref().map(Region::as_str))
            .bind(filter.zone.as_ref().map(Zone::as_str))
            .bind(filter.instance_type.as_ref().map(InstanceType::as_str))
            .fetch_all(pool)
            .await
            .context("listing markets")?
        });
        rows.into_iter()
            .map(|(id, zone, itype, product)| {
                Ok((id, market_from_columns(&zone, &itype, &product)?))
            })
            .collect()
    }

    /// The number of stored price changes.
    pub async fn price_row_count(&self) -> Result<i64, StoreError> {
        with_db!(self, |pool| {
            sqlx::query_scalar("SELECT COUNT(*) FROM spot_prices")
                .fetch_one(pool)
                .await
                .context("counting prices")
        })
    }

    /// The newest stored change of each market in a region: where an incremental fetch resumes.
    pub async fn newest_price_times(
        &self,
        region: &Region,
    ) -> Result<HashMap<Market, Timestamp>, StoreError> {
        let rows: Vec<(String, String, String, Option<i64>)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT m.availability_zone, m.instance_type, m.product, MAX(p.ts_ms) \
                 FROM markets m JOIN spot_prices p ON p.market_id = m.id WHERE m.region = $1 \
                 GROUP BY m.id, m.availability_zone, m.instance_type, m.product",
            )
            .bind(region.as_str())
            .fetch_all(pool)
            .await
            .context("reading newest prices")?
        });
        rows.into_iter()
            .filter_map(|(z, t, p, ts)| ts.map(|ts| (z, t, p, ts)))
            .map(|(z, t, p, ts)| Ok((market_from_columns(&z, &t, &p)?, Timestamp::from_millis(ts))))
            .collect()
    }

    /// The latest stored price change in any market: where observation of the market ends.
    pub async fn latest_price_time(&self) -> Result<Option<Timestamp>, StoreError> {
        let ts: Option<i64> = with_db!(self, |pool| {
            // Per market through the primary key, instead of scanning every row.
            sqlx::query_scalar(
                "SELECT MAX(newest) FROM (SELECT (SELECT MAX(p.ts_ms) FROM spot_prices p WHERE p.market_id = m.id) \
                 AS newest FROM markets m) AS per_market",
            )
                .fetch_one(pool)
                .await
                .context("reading the latest price time")?
        });
        Ok(ts.map(Timestamp::from_millis))
    }

    /// Every stored on-demand offer.
    pub async fn on_demand_catalog(&self) -> Result<OnDemandCatalog, StoreError> {
        let rows: Vec<OfferTuple> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT region, instance_type, vcpus, memory_gib, on_demand_usd_per_hour FROM instance_types",
            )
            .fetch_all(pool)
            .await
            .context("reading on-demand prices")?
        });
        let offers = rows
            .into_iter()
            .map(|(region, itype, vcpus, memory_gib, price)| {
                let bad =
                    |e| StoreError::Invalid(format!("stored on-demand row {region}/{itype}: {e}"));
                Ok(InstanceOffer {
                    region: Region::parse(&region).map_err(bad)?,
                    instance_type: InstanceType::parse(&itype).map_err(bad)?,
                    vcpus: vcpus.and_then(|v| u32::try_from(v).ok()),
                    memory_gib,
                    on_demand: UsdPerHour::new(price).map_err(bad)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(OnDemandCatalog::new(offers))
    }

    /// Loads the history of matching markets over `[from, to)`, plus, for each market, the
    /// change in force at `from` (so the price at every instant of the window is known).
    pub async fn load_history(
        &self,
        filter: &MarketFilter,
        from: Option<Timestamp>,
        to: Option<Timestamp>,
    ) -> Result<PriceHistory, StoreError> {
        let markets = self.market_ids(filter).await?;
        let from_ms = from.map_or(i64::MIN, |t| t.millis());
        let to_ms = to.map_or(i64::MAX, |t| t.millis());
        let mut rows: Vec<(i64, i64, f64)> = match &self.db {
            // One row per market with its changes as arrays: a tenth of the rows to decode. No
            // ORDER BY inside the aggregates: both see the group's rows in the same order (so
            // times and prices stay paired), and `PriceSeries::new` sorts, which is cheaper
            // than two sorts on the server.
            Db::Postgres(pool) => {
                let per_market: Vec<(i64, Vec<i64>, Vec<f64>)> = sqlx::query_as(
                    "SELECT market_id, array_agg(ts_ms), array_agg(usd_per_hour) \
                     FROM spot_prices WHERE ts_ms >= $1 AND ts_ms < $2 GROUP BY market_id",
                )
                .bind(from_ms)
                .bind(to_ms)
                .fetch_all(pool)
                .await
                .context("loading price history")?;
                per_market
                    .into_iter()
                    .flat_map(|(m, ts, ps)| ts.into_iter().zip(ps).map(move |(t, p)| (m, t, p)))
                    .collect()
            }
            Db::Sqlite(pool) => sqlx::query_as(
                "SELECT market_id, ts_ms, usd_per_hour FROM spot_prices \
                 WHERE ts_ms >= $1 AND ts_ms < $2 ORDER BY market_id, ts_ms",
            )
            .bind(from_ms)
            .bind(to_ms)
            .fetch_all(pool)
            .await
            .context("loading price history")?,
        };
        if from.is_some() {
            let carried: Vec<(i64, i64, f64)> = with_db!(self, |pool| {
                sqlx::query_as(
                    "SELECT p.market_id, p.ts_ms, p.usd_per_hour FROM spot_prices p \
                     JOIN (SELECT market_id, MAX(ts_ms) AS ts FROM spot_prices WHERE ts_ms < $1 \
                           GROUP BY market_id) c ON c.market_id = p.market_id AND c.ts = p.ts_ms",
                )
                .bind(from_ms)
                .fetch_all(pool)
                .await
                .context("loading prices in force at the window start")?
            });
            rows.extend(carried);
        }
        let mut points: HashMap<i64, Vec<(Timestamp, UsdPerHour)>> = HashMap::new();
        for (id, ts, price) in rows {
            if markets.contains_key(&id) {
                let price = UsdPerHour::new(price)
                    .map_err(|e| StoreError::Invalid(format!("stored price: {e}")))?;
                points
                    .entry(id)
                    .or_default()
                    .push((Timestamp::from_millis(ts), price));
            }
        }
        let series = points
            .into_iter()
            .map(|(id, pts)| PriceSeries::new(markets[&id].clone(), pts));
        Ok(PriceHistory::new(series, self.on_demand_catalog().await?))
    }
}

/// Bulk-loads rows with `COPY`, the one fast path that needs Postgres's own protocol.
///
/// Rows are sorted by (market, time) first, so the primary-key index grows at its right edge
/// instead of being updated at random. Markets with no stored rows yet (a first ingestion) are
/// copied straight into `spot_prices`; the rest go through a staging table and an
/// `ON CONFLICT DO NOTHING` insert, which is what makes a repeated ingestion insert nothing.
async fn copy_prices_pg(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    rows: &[SpotPriceRow],
    ids: &HashMap<Market, i64>,
) -> Result<u64, StoreError> {
    let mut keyed: Vec<(i64, i64, f64)> = rows
        .iter()
        .map(|r| (ids[&r.market], r.time.millis(), r.price.get()))
        .collect();
    keyed.sort_by_key(|&(m, t, _)| (m, t));
    keyed.dedup_by_key(|&mut (m, t, _)| (m, t));
    let file_markets: Vec<i64> = {
        let mut v: Vec<i64> = keyed.iter().map(|r| r.0).collect();
        v.dedup();
        v
    };
    let stored: Vec<i64> =
        sqlx::query_scalar("SELECT DISTINCT market_id FROM spot_prices WHERE market_id = ANY($1)")
            .bind(&file_markets)
            .fetch_all(&mut **tx)
            .await
            .context("checking which markets have history")?;
    let (fresh, existing): (Vec<_>, Vec<_>) =
        keyed.into_iter().partition(|r| !stored.contains(&r.0));

    let mut inserted = copy_rows(
        tx,
        "COPY spot_prices (market_id, ts_ms, usd_per_hour) FROM STDIN",
        &fresh,
    )
    .await?;
    if !existing.is_empty() {
        sqlx::query(
            "CREATE TEMP TABLE incoming_prices (market_id BIGINT, ts_ms BIGINT, usd_per_hour DOUBLE PRECISION) \
             ON COMMIT DROP",
        )
        .execute(&mut **tx)
        .await
        .context("creating the staging table")?;
        copy_rows(
            tx,
            "COPY incoming_prices (market_id, ts_ms, usd_per_hour) FROM STDIN",
            &existing,
        )
        .await?;
        let done = sqlx::query(
            "INSERT INTO spot_prices (market_id, ts_ms, usd_per_hour) \
             SELECT market_id, ts_ms, usd_per_hour FROM incoming_prices ORDER BY market_id, ts_ms \
             ON CONFLICT DO NOTHING",
        )
        .execute(&mut **tx)
        .await
        .context("moving staged prices")?;
        inserted += done.rows_affected();
    }
    Ok(inserted)
}

/// Streams rows in COPY's binary format: no number formatting on our side and no parsing on the
/// server's, which is most of the cost of a text COPY of narrow numeric rows.
async fn copy_rows(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    statement: &str,
    rows: &[(i64, i64, f64)],
) -> Result<u64, StoreError> {
    if rows.is_empty() {
        return Ok(0);
    }
    let statement = format!("{statement} WITH (FORMAT binary)");
    let mut copy = tx.copy_in_raw(&statement).await.context("starting COPY")?;
    const CHUNK: usize = 1 << 20;
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK + 64);
    // Signature, flags, header-extension length.
    buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
    buf.extend_from_slice(&0i32.to_be_bytes());
    buf.extend_from_slice(&0i32.to_be_bytes());
    for (market, ts, price) in rows {
        buf.extend_from_slice(&3i16.to_be_bytes());
        for field in [market.to_be_bytes(), ts.to_be_bytes(), price.to_be_bytes()] {
            buf.extend_from_slice(&8i32.to_be_bytes());
            buf.extend_from_slice(&field);
        }
        if buf.len() >= CHUNK {
            copy.send(buf.as_slice())
                .await
                .context("sending COPY data")?;
            buf.clear();
        }
    }
    buf.extend_from_slice(&(-1i16).to_be_bytes());
    copy.send(buf.as_slice())
        .await
        .context("sending COPY data")?;
    copy.finish().await.context("finishing COPY")
}

async fn insert_prices_batch(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    rows: &[SpotPriceRow],
    ids: &HashMap<Market, i64>,
) -> Result<u64, StoreError> {
    let mut sql = String::from("INSERT INTO spot_prices (market_id, ts_ms, usd_per_hour) VALUES ");
    for i in 0..rows.len() {
        let _ = write!(
            sql,
            "{}(${}, ${}, ${})",
            if i == 0 { "" } else { "," },
            3 * i + 1,
            3 * i + 2,
            3 * i + 3
        );
    }
    sql.push_str(" ON CONFLICT DO NOTHING");
    let mut query = sqlx::query(AssertSqlSafe(sql));
    for row in rows {
        query = query
            .bind(ids[&row.market])
            .bind(row.time.millis())
            .bind(row.price.get());
    }
    let done = query.execute(&mut **tx).await.context("inserting prices")?;
    Ok(done.rows_affected())
}
