//! Two brokers on one Postgres database pass a job back and forth through its lease, and the
//! broker that gets a job back runs what the last owner saved, never a copy of its own from
//! before it lost the job.
//!
//! CI caught the bug this pins (the three-broker failover test, once in many runs): a broker
//! woken from a pause answered an agent's request that had passed its lease check just before
//! the heartbeat found the lease gone, and the request rebuilt the job in memory from the store
//! as it was at that instant. When the broker later took the job back, it ran that copy instead
//! of the other owner's saved state; its coordinator was behind the agents' command cursors and
//! gave them nothing more, and the job stopped at 19%.
//!
//! Leases expire here by a write to their expiry, not by waiting: the brokers' own lease period
//! is an hour, so only the test moves a job.

use crate::api::TOKEN;
use crate::support::TestDb;
use proteus_broker::clock::ManualClock;
use proteus_broker::cloud::Cloud;
use proteus_broker::market::Timestamp;
use proteus_broker::service::{Broker, Pacing, ServiceError};
use proteus_broker::startup::{ServeArgs, StartOptions, start_with};
use proteus_wire::JobId;
use std::sync::Arc;

const START: &str = "2015-05-01T00:00:00Z";

pub(crate) async fn broker(
    db: &TestDb,
    dir: &std::path::Path,
    clock: &ManualClock,
    cloud: &Arc<dyn Cloud>,
) -> Arc<Broker> {
    let mut args = ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.start = Some(START.into());
    args.state_dir = Some(dir.to_path_buf());
    args.lease_secs = 3600.0;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    start_with(
        db.store.clone(),
        args,
        listener,
        StartOptions {
            clock: Some(Arc::new(clock.clone())),
            pacing: Some(Pacing::Modelled),
            cloud: Some(cloud.clone()),
        },
    )
    .await
    .expect("broker starts")
    .broker
}

/// The job's lease runs out now, as when its owner stalls past it.
pub(crate) async fn expire(pool: &sqlx::PgPool, job: JobId) {
    sqlx::query("UPDATE jobs SET lease_expires_ms = 0 WHERE id = $1")
        .bind(job.0)
        .execute(pool)
        .await
        .unwrap();
}

fn decisions(b: &Broker, job: JobId) -> u32 {
    let rt = b.runtime(job).expect("the owner runs the job");
    let rt = rt.lock().unwrap();
    rt.engine.counts().decisions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_taken_back_runs_the_last_owners_state_not_a_copy_from_before_it_was_lost() {
    let db = TestDb::postgres().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let cloud: Arc<dyn Cloud> = Arc::new(crate::cancel_during_launch::sim_cloud(&clock));
    let dirs = tempfile::tempdir().unwrap();
    let a = broker(&db, &dirs.path().join("a"), &clock, &cloud).await;
    let b = broker(&db, &dirs.path().join("b"), &clock, &cloud).await;
    let spec = serde_json::from_value(serde_json::json!({
        "name": "taken-back",
        "app": "mlr",
        "policy": "bidbrain",
        "limits": {"max_instances": 4, "max_reliable_instances": 1},
        "work": {"total_work": 40.0}
    }))
    .unwrap();
    let job = JobId(a.submit(spec).await.expect("submit").id);
    assert!(a.membership().lease(job).is_some(), "a took its own submit");
    clock.advance_secs(60.0);
    a.tick().await.unwrap();
    let row = a.store().job(job).await.unwrap().unwrap();
    let at_a = decisions(&a, job);

    // a stalls past its lease; b takes the job over.
    expire(&pool, job).await;
    b.tick().await.unwrap();
    assert!(b.membership().lease(job).is_some(), "b took the job over");

    // a wakes: its heartbeat finds the lease gone, and a request that passed its lease check
    // before that asks for the job's runtime. It is refused and leaves nothing behind.
    a.renew_leases().await.unwrap();
    assert!(a.membership().lease(job).is_none());
    match a.ensure_runtime(&row) {
        Err(ServiceError::NotOwner { job: j }) => assert_eq!(j, job),
        Err(e) => panic!("expected NotOwner, got {e}"),
        Ok(_) => panic!("a rebuilt a job it no longer owns"),
    }
    assert!(a.runtime(job).is_none(), "a holds a copy of b's job");

    // b runs the job for a few market hours (BidBrain decides again as billing hours end),
    // then stalls in turn; a takes it back and runs b's state.
    for _ in 0..6 {
        clock.advance_secs(1200.0);
        b.tick().await.unwrap();
    }
    let at_b = decisions(&b, job);
    assert!(at_b > at_a, "b decided on: {at_a} → {at_b}");
    expire(&pool, job).await;
    a.tick().await.unwrap();
    assert!(a.membership().lease(job).is_some(), "a took the job back");
    assert!(
        decisions(&a, job) >= at_b,
        "a resumed from {} decisions, b had made {at_b}",
        decisions(&a, job)
    );

    // Once more, without the heartbeat in between: a stalls while it still has the job in
    // memory, b takes it and runs it, and a claims it back without ever having seen it go.
    let before = decisions(&a, job);
    expire(&pool, job).await;
    b.tick().await.unwrap();
    assert!(
        b.membership().lease(job).is_some(),
        "b took the job over again"
    );
    for _ in 0..6 {
        clock.advance_secs(1200.0);
        b.tick().await.unwrap();
    }
    let at_b = decisions(&b, job);
    assert!(at_b > before, "b decided on: {before} → {at_b}");
    expire(&pool, job).await;
    a.tick().await.unwrap();
    assert!(
        decisions(&a, job) >= at_b,
        "a ran its own copy ({} decisions) instead of b's state ({at_b})",
        decisions(&a, job)
    );
}
