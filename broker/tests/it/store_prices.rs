//! The price store on both backends: ingestion counts, idempotence, reads, and statistics
//! checked against an independent computation.

use crate::on_both_backends;
use crate::support::{ON_DEMAND_2015, TRACE_2015, TestDb, data};
use proteus_broker::market::{InstanceType, Market, Region, Timestamp, UsdPerHour};
use proteus_broker::prices::files::{self, SpotPriceRow};
use proteus_broker::prices::stats;
use proteus_broker::store::MarketFilter;
use std::io::Read;

on_both_backends!(
    the_2015_trace_is_stored_once,
    stats_match_an_independent_time_weighted_mean,
    on_demand_prices_are_upserted,
    history_windows_carry_the_price_in_force,
    newest_times_are_per_market,
    overlapping_ingests_insert_only_new_rows,
);

fn region() -> Region {
    Region::parse("us-east-1").unwrap()
}

async fn ingest_2015(db: &TestDb) {
    let offers = files::read_on_demand_file(&data(ON_DEMAND_2015), &region()).unwrap();
    db.store.ingest_on_demand(&offers).await.unwrap();
    let rows = files::read_spot_file(&data(TRACE_2015)).unwrap();
    db.store.ingest_spot_prices(&rows).await.unwrap();
}

async fn the_2015_trace_is_stored_once(db: TestDb) {
    let rows = files::read_spot_file(&data(TRACE_2015)).unwrap();
    assert_eq!(rows.len(), 156_005);
    let first = db.store.ingest_spot_prices(&rows).await.unwrap();
    assert_eq!(
        (first.read, first.inserted, first.already_present),
        (156_005, 156_005, 0)
    );
    assert_eq!(db.store.price_row_count().await.unwrap(), 156_005);
    let markets = db.store.markets(&MarketFilter::default()).await.unwrap();
    assert_eq!(markets.len(), 15);
    assert_eq!(markets.iter().map(|m| m.price_rows).sum::<i64>(), 156_005);

    let again = db.store.ingest_spot_prices(&rows).await.unwrap();
    assert_eq!(
        (again.read, again.inserted, again.already_present),
        (156_005, 0, 156_005)
    );
    assert_eq!(db.store.price_row_count().await.unwrap(), 156_005);
}

/// The time-weighted mean of a market, computed straight from the gzipped CSV with no code
/// from the broker: each price holds until the market's next change, and the last one until
/// the end of the trace (its last change in any market).
fn independent_mean(zone: &str, itype: &str) -> (f64, usize) {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(data(TRACE_2015)).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    let mut mine: Vec<(i64, f64)> = Vec::new();
    let mut end = i64::MIN;
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let t = chrono::DateTime::parse_from_rfc3339(f[0])
            .unwrap()
            .timestamp_millis();
        end = end.max(t);
        if f[1] == zone && f[2] == itype {
            mine.push((t, f[4].parse().unwrap()));
        }
    }
    mine.sort_by_key(|p| p.0);
    let end = end + 1;
    let mut area = 0.0;
    for (i, (t, p)) in mine.iter().enumerate() {
        let next = mine.get(i + 1).map_or(end, |n| n.0);
        area += p * (next - t) as f64;
    }
    (area / (end - mine[0].0) as f64, mine.len())
}

async fn stats_match_an_independent_time_weighted_mean(db: TestDb) {
    ingest_2015(&db).await;
    let history = db
        .store
        .load_history(&MarketFilter::default(), None, None)
        .await
        .unwrap();
    let end = Timestamp::from_millis(
        db.store
            .latest_price_time()
            .await
            .unwrap()
            .unwrap()
            .millis()
            + 1,
    );
    for (zone, itype) in [("us-east-1a", "c3.xlarge"), ("us-east-1e", "r3.large")] {
        let market = Market::parse(&format!("{zone}/{itype}")).unwrap();
        let series = history.get(&market).expect("market loaded");
        let od = history.on_demand().for_market(&market).unwrap().on_demand;
        let s = stats::market_stats(series, Timestamp::MIN, end, Some(od)).unwrap();
        let (expected, changes) = independent_mean(zone, itype);
        assert_eq!(s.changes, changes);
        assert!(
            (s.time_weighted_mean_usd.get() - expected).abs() < 1e-9,
            "{market}: store says {}, independent computation {expected}",
            s.time_weighted_mean_usd
        );
        assert!(s.min_usd <= s.median_usd && s.median_usd <= s.max_usd);
        let frac = s.fraction_above_on_demand.unwrap();
        assert!((0.0..=1.0).contains(&frac));
        assert_eq!(frac > 0.0, s.spells_above_on_demand.unwrap() > 0);
    }
}

async fn on_demand_prices_are_upserted(db: TestDb) {
    let offers = files::read_on_demand_file(&data(ON_DEMAND_2015), &region()).unwrap();
    let first = db.store.ingest_on_demand(&offers).await.unwrap();
    assert_eq!((first.read, first.inserted, first.updated), (5, 5, 0));
    let again = db.store.ingest_on_demand(&offers).await.unwrap();
    assert_eq!(
        (again.inserted, again.updated, again.already_present),
        (0, 0, 5)
    );
    let mut changed = offers.clone();
    changed[0].on_demand = UsdPerHour::new(9.0).unwrap();
    let third = db.store.ingest_on_demand(&changed).await.unwrap();
    assert_eq!(
        (third.inserted, third.updated, third.already_present),
        (0, 1, 4)
    );
    let catalog = db.store.on_demand_catalog().await.unwrap();
    let c3 = catalog
        .get(&region(), &InstanceType::parse("c3.xlarge").unwrap())
        .unwrap();
    assert_eq!(c3.vcpus, Some(4), "vCPUs filled from the built-in catalog");
    let changed_type = &changed[0].instance_type;
    assert_eq!(
        catalog
            .get(&region(), changed_type)
            .unwrap()
            .on_demand
            .get(),
        9.0
    );
}

fn row(market: &str, t: i64, p: f64) -> SpotPriceRow {
    SpotPriceRow {
        market: Market::parse(market).unwrap(),
        time: Timestamp::from_millis(t),
        price: UsdPerHour::new(p).unwrap(),
    }
}

async fn history_windows_carry_the_price_in_force(db: TestDb) {
    let rows = vec![
        row("us-east-1a/c3.xlarge", 1000, 1.0),
        row("us-east-1a/c3.xlarge", 2000, 2.0),
        row("us-east-1a/c3.xlarge", 3000, 3.0),
        row("us-east-1b/c3.xlarge", 500, 7.0),
        row("us-east-1b/m3.medium", 2500, 0.5),
    ];
    db.store.ingest_spot_prices(&rows).await.unwrap();
    let all = MarketFilter::default();
    let h = db
        .store
        .load_history(
            &all,
            Some(Timestamp::from_millis(2500)),
            Some(Timestamp::from_millis(3000)),
        )
        .await
        .unwrap();
    let a = h
        .get(&Market::parse("us-east-1a/c3.xlarge").unwrap())
        .unwrap();
    assert_eq!(
        a.times(),
        &[Timestamp::from_millis(2000)],
        "only the change in force at 2500; 3000 is past the end"
    );
    let b = h
        .get(&Market::parse("us-east-1b/c3.xlarge").unwrap())
        .unwrap();
    assert_eq!(
        b.price_at(Timestamp::from_millis(2500))
            .map(UsdPerHour::get),
        Some(7.0)
    );
    let m = h
        .get(&Market::parse("us-east-1b/m3.medium").unwrap())
        .unwrap();
    assert_eq!(m.times(), &[Timestamp::from_millis(2500)]);

    let only_m3 = MarketFilter {
        instance_type: Some(InstanceType::parse("m3.medium").unwrap()),
        ..Default::default()
    };
    let h = db.store.load_history(&only_m3, None, None).await.unwrap();
    assert_eq!(h.markets().count(), 1);
    let zone_b = MarketFilter {
        zone: Some("us-east-1b".parse().unwrap()),
        ..Default::default()
    };
    assert_eq!(db.store.markets(&zone_b).await.unwrap().len(), 2);
}

async fn newest_times_are_per_market(db: TestDb) {
    let rows = vec![
        row("us-east-1a/c3.xlarge", 1000, 1.0),
        row("us-east-1a/c3.xlarge", 4000, 2.0),
        row("us-east-1b/c3.xlarge", 3000, 7.0),
    ];
    db.store.ingest_spot_prices(&rows).await.unwrap();
    let newest = db.store.newest_price_times(&region()).await.unwrap();
    assert_eq!(newest.len(), 2);
    assert_eq!(
        newest[&Market::parse("us-east-1a/c3.xlarge").unwrap()],
        Timestamp::from_millis(4000)
    );
    assert_eq!(
        newest[&Market::parse("us-east-1b/c3.xlarge").unwrap()],
        Timestamp::from_millis(3000)
    );
    assert!(
        db.store
            .newest_price_times(&Region::parse("eu-west-1").unwrap())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn both_backends_build_the_same_schema() {
    let pg = TestDb::postgres().await;
    let lite = TestDb::sqlite().await;
    let a = pg.store.schema().await.unwrap();
    let b = lite.store.schema().await.unwrap();
    // The description is rich enough to tell the backends apart if they drifted.
    assert!(a.columns.iter().any(|c| c.table == "spot_prices"
        && c.column == "usd_per_hour"
        && c.kind == "real"
        && !c.nullable));
    assert!(
        a.columns
            .iter()
            .any(|c| c.table == "instances" && c.column == "ready_ms" && c.nullable)
    );
    assert!(
        a.indexes
            .iter()
            .any(|i| i.table == "ledger_lines" && i.unique),
        "{:?}",
        a.indexes
    );
    assert!(a.indexes.iter().any(|i| !i.unique), "{:?}", a.indexes);
    assert!(
        a.primary_keys
            .iter()
            .any(|(t, k)| t == "jobs" && k == &["id"])
    );
    let differ = |what: &str, x: &dyn std::fmt::Debug, y: &dyn std::fmt::Debug| {
        format!("{what} differ:\nPostgres: {x:#?}\nSQLite:   {y:#?}")
    };
    for (ca, cb) in a.columns.iter().zip(&b.columns) {
        assert_eq!(ca, cb, "{}", differ("columns", ca, cb));
    }
    assert_eq!(
        a.columns.len(),
        b.columns.len(),
        "{}",
        differ("columns", &a.columns, &b.columns)
    );
    assert_eq!(
        a.primary_keys,
        b.primary_keys,
        "{}",
        differ("primary keys", &a.primary_keys, &b.primary_keys)
    );
    assert_eq!(
        a.indexes,
        b.indexes,
        "{}",
        differ("indexes", &a.indexes, &b.indexes)
    );
}

async fn overlapping_ingests_insert_only_new_rows(db: TestDb) {
    let first = vec![
        row("us-east-1a/c3.xlarge", 1000, 1.0),
        row("us-east-1a/c3.xlarge", 2000, 2.0),
    ];
    db.store.ingest_spot_prices(&first).await.unwrap();
    // An existing market with one old and one new change, a new market, and a duplicate row.
    let second = vec![
        row("us-east-1a/c3.xlarge", 2000, 2.0),
        row("us-east-1a/c3.xlarge", 3000, 3.0),
        row("us-east-1b/r3.large", 1500, 0.5),
        row("us-east-1b/r3.large", 1500, 0.5),
    ];
    let counts = db.store.ingest_spot_prices(&second).await.unwrap();
    assert_eq!(
        (counts.read, counts.inserted, counts.already_present),
        (4, 2, 2)
    );
    assert_eq!(db.store.price_row_count().await.unwrap(), 4);
    let h = db
        .store
        .load_history(&MarketFilter::default(), None, None)
        .await
        .unwrap();
    let a = h
        .get(&Market::parse("us-east-1a/c3.xlarge").unwrap())
        .unwrap();
    assert_eq!(a.prices(), &[1.0, 2.0, 3.0]);
}
