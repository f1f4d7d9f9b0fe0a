//! The pool book live: every spot launch a broker's job makes is written to the store's log of
//! pool observations, and every broker on the database — and a broker started later, as after a
//! restart — folds the same book from it at its tick.

use crate::support::TestDb;
use crate::takeover::broker;
use proteus_broker::clock::{Clock, ManualClock};
use proteus_broker::cloud::Cloud;
use proteus_broker::market::{Market, Timestamp};
use proteus_broker::market_model::pool_book::{PoolObservation, Seen};
use std::sync::Arc;

const START: &str = "2015-05-01T00:00:00Z";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broker_on_the_database_folds_the_same_pool_book_and_a_restarted_one_too() {
    let db = TestDb::postgres().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let cloud: Arc<dyn Cloud> = Arc::new(crate::cancel_during_launch::sim_cloud(&clock));
    let dirs = tempfile::tempdir().unwrap();
    let a = broker(&db, &dirs.path().join("a"), &clock, &cloud).await;
    let b = broker(&db, &dirs.path().join("b"), &clock, &cloud).await;
    let spec = serde_json::from_value(serde_json::json!({
        "name": "pools",
        "app": "mlr",
        "policy": "bidbrain",
        "limits": {"max_instances": 4, "max_reliable_instances": 1},
        "work": {"total_work": 40.0}
    }))
    .unwrap();
    a.submit(spec).await.expect("submit");
    clock.advance_secs(60.0);
    a.tick().await.unwrap();

    // Every spot instance a's job launched is a `granted` row.
    let spot: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM instances WHERE tier = 'transient' AND cloud_id IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let granted: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pool_observations WHERE seen = 'granted'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(spot > 0, "the job launched no spot instance");
    assert_eq!(granted, spot);

    // Another broker's job met a pool without capacity, and one of its instances was warned:
    // written to the log as its scheduler writes them.
    let other: Market = "us-east-1d/c4.xlarge".parse().unwrap();
    let now = clock.now();
    for seen in [Seen::Granted, Seen::Interrupted, Seen::Refused] {
        db.store
            .add_pool_observation(&PoolObservation {
                market: other.clone(),
                at: now,
                seen,
            })
            .await
            .unwrap();
    }
    a.tick().await.unwrap();
    b.tick().await.unwrap();
    let now = clock.now();
    let seen_by_a = a.pool_summary(now);
    assert!(!seen_by_a.is_empty());
    assert_eq!(
        seen_by_a,
        b.pool_summary(now),
        "a and b fold different books"
    );
    let o = seen_by_a
        .iter()
        .find(|p| p.market == other.to_string())
        .expect("the other broker's pool is in the book");
    assert_eq!((o.observations, o.held, o.up.ends), (3, 0, 1.0), "{o:?}");
    assert!(o.p_up < 0.5, "{o:?}");
    let held: u32 = seen_by_a.iter().map(|p| p.held).sum();
    assert_eq!(i64::from(held), spot, "{seen_by_a:?}");

    // A broker started now (a restart) folds the same book from the log.
    let c = broker(&db, &dirs.path().join("c"), &clock, &cloud).await;
    c.tick().await.unwrap();
    assert_eq!(c.pool_summary(now), seen_by_a);
}
