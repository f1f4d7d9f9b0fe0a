//! A restarted broker continues each job's engine where it was: the engine's state saved with
//! the job, its instances rebuilt from the store. Two live brokers on the simulated cloud run
//! the same job from the same market time; one is stopped in the middle (after evictions, with
//! instances running) and a new broker on the same database and the same cloud takes over. Both
//! make the same decisions and charge the same.

use crate::api::TOKEN;
use crate::support::TestDb;
use proteus_broker::clock::{Clock, ManualClock};
use proteus_broker::cloud::Cloud;
use proteus_broker::market::Timestamp;
use proteus_broker::service::spec::JobSpec;
use proteus_broker::service::{Broker, Pacing};
use proteus_broker::startup::{ServeArgs, StartOptions, start_with};
use proteus_wire::JobId;
use std::sync::Arc;

const START: &str = "2015-05-01T00:00:00Z";

async fn broker(
    db: &TestDb,
    clock: &ManualClock,
    cloud: Option<Arc<dyn Cloud>>,
) -> (Arc<Broker>, tokio::task::JoinHandle<()>) {
    let mut args = ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.start = Some(START.into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    start_with(
        db.store.clone(),
        args,
        listener,
        StartOptions {
            clock: Some(Arc::new(clock.clone())),
            pacing: Some(Pacing::Modelled),
            cloud,
        },
    )
    .await
    .expect("broker starts")
    .serve_api()
}

/// One market step: a tick, then the clock onto the next instant the broker acts at (at most an
/// hour on). Returns whether the job is over.
async fn step(broker: &Broker, clock: &ManualClock, job: JobId) -> bool {
    broker.tick().await.expect("tick");
    let view = broker.job_view(job).await.expect("job view");
    if view.state != "pending" && view.state != "running" {
        return true;
    }
    let now = clock.now();
    let next = broker
        .next_event_after(now)
        .await
        .expect("next event")
        .unwrap_or(now.plus_secs(3600.0))
        .min(now.plus_secs(3600.0));
    clock.set(next);
    false
}

/// What the broker decided (launch times, markets, bids, ends) and what it charged.
async fn outcome(broker: &Broker, job: JobId) -> (String, f64, String, Option<String>) {
    let rows = broker.store().instances_of_job(job).await.unwrap();
    let digest = proteus_broker::engine::digest::of_stored(&rows);
    let view = broker.job_view(job).await.unwrap();
    (digest, view.spend_usd.get(), view.state, view.state_reason)
}

fn spec() -> JobSpec {
    serde_json::from_value(serde_json::json!({
        "name": "restart",
        "app": "mlr",
        "policy": "bidbrain",
        "limits": {"max_instances": 8, "max_reliable_instances": 1},
        "work": {"total_work": 24.0}
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_broker_continues_the_jobs_engine_where_it_was() {
    // Uninterrupted.
    let db = TestDb::postgres().await;
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let (a, api) = broker(&db, &clock, None).await;
    let job = JobId(a.submit(spec()).await.unwrap().id);
    let mut steps = 0;
    while !step(&a, &clock, job).await {
        steps += 1;
        assert!(steps < 5_000, "the job did not end");
    }
    let reference = outcome(&a, job).await;
    let ended_at = clock.now();
    api.abort();
    assert_eq!(reference.2, "succeeded", "{reference:?}");

    // Stopped half way through, with instances running and evictions behind it.
    let db = TestDb::postgres().await;
    let start = Timestamp::parse(START).unwrap();
    let clock = ManualClock::new(start);
    let (first, api) = broker(&db, &clock, None).await;
    let cloud = first.cloud().clone();
    let job = JobId(first.submit(spec()).await.unwrap().id);
    let half_way = start.plus_secs(ended_at.secs_since(start) / 2.0);
    while clock.now() < half_way {
        assert!(
            !step(&first, &clock, job).await,
            "the job ended before the restart"
        );
    }
    let rows = first.store().instances_of_job(job).await.unwrap();
    let warned = rows.iter().filter(|i| i.warned.is_some()).count();
    let running = rows
        .iter()
        .filter(|i| i.state == proteus_broker::store::InstanceState::Running)
        .count();
    assert!(
        warned >= 1 && running >= 1,
        "the restart comes with evictions behind and instances running: {warned} warned, \
         {running} running"
    );
    let stopped_at = clock.now();
    let saved = db.store.job(job).await.unwrap().unwrap().engine_state;
    assert!(saved.is_some(), "the engine's state was saved with the job");
    api.abort();
    drop(first);

    // A new broker on the same database and cloud (the instances kept running) takes over.
    let (second, api) = broker(&db, &clock, Some(cloud)).await;
    assert_eq!(clock.now(), stopped_at);
    let mut steps = 0;
    while !step(&second, &clock, job).await {
        steps += 1;
        assert!(steps < 5_000, "the job did not end after the restart");
    }
    let restarted = outcome(&second, job).await;
    api.abort();
    // The same decisions, the same end, the same bill to the cent (sums of the same amounts in
    // another order may differ in the last bit).
    let cents = |usd: f64| (usd * 100.0).round();
    assert_eq!(
        (&restarted.0, cents(restarted.1), &restarted.2, &restarted.3),
        (&reference.0, cents(reference.1), &reference.2, &reference.3),
        "the restarted broker decided or charged otherwise (stopped at {stopped_at})"
    );
}
