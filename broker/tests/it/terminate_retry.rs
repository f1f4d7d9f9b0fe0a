//! A termination the cloud refuses (throttled, failing) is asked again by the job's owner until
//! the cloud accepts it: the instance does not run on, billed, after its job ended. (Found by
//! bench/chaos: a job that ended while EC2 answered 5xx kept its two instances running, its
//! lease held, until a restart reconciled them.)

use crate::api::TOKEN;
use crate::cancel_during_launch::sim_cloud;
use crate::support::TestDb;
use async_trait::async_trait;
use proteus_broker::clock::ManualClock;
use proteus_broker::cloud::sim::SimCloud;
use proteus_broker::cloud::{Cloud, CloudError, CloudEvent, CloudInstance, LaunchSpec};
use proteus_broker::market::Timestamp;
use proteus_broker::service::Pacing;
use proteus_broker::startup::{ServeArgs, StartOptions, start_with};
use proteus_broker::store::InstanceState;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const START: &str = "2015-05-01T00:00:00Z";

/// A cloud whose first `failures` terminate calls fail as EC2's do when it throttles.
#[derive(Debug)]
struct RefusingCloud {
    inner: SimCloud,
    failures: AtomicU32,
    calls: AtomicU32,
}

#[async_trait]
impl Cloud for RefusingCloud {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        self.inner.launch(spec).await
    }
    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(CloudError::Call {
                operation: "TerminateInstances",
                message: "RequestLimitExceeded: Request limit exceeded.".into(),
            });
        }
        self.inner.terminate(cloud_ids).await
    }
    async fn describe(&self) -> Result<Vec<CloudInstance>, CloudError> {
        self.inner.describe().await
    }
    async fn events(&self) -> Result<Vec<CloudEvent>, CloudError> {
        self.inner.events().await
    }
    fn next_event_after(&self, now: Timestamp) -> Option<Timestamp> {
        self.inner.next_event_after(now)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_termination_at_a_jobs_end_is_asked_again_until_the_cloud_accepts() {
    let db = TestDb::postgres().await;
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let cloud = Arc::new(RefusingCloud {
        inner: sim_cloud(&clock),
        failures: AtomicU32::new(0),
        calls: AtomicU32::new(0),
    });
    let mut args = ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.start = Some(START.into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (broker, _api) = start_with(
        db.store.clone(),
        args,
        listener,
        StartOptions {
            clock: Some(Arc::new(clock.clone())),
            pacing: Some(Pacing::Modelled),
            cloud: Some(cloud.clone() as Arc<dyn Cloud>),
        },
    )
    .await
    .expect("broker starts")
    .serve_api();
    let spec = serde_json::from_value(serde_json::json!({
        "name": "terminate-retry",
        "app": "mlr",
        "policy": "on-demand",
        "limits": {"max_instances": 2, "max_reliable_instances": 2},
        "work": {"total_work": 8.0}
    }))
    .unwrap();
    let job = proteus_wire::JobId(broker.submit(spec).await.expect("submit").id);
    broker.tick().await.expect("tick");
    let live = |rows: &[proteus_broker::store::InstanceRow]| {
        rows.iter().filter(|r| !r.state.is_final()).count()
    };
    let rows = db.store.instances_of_job(job).await.unwrap();
    assert!(live(&rows) >= 1, "the job has instances: {rows:?}");

    // The job ends while the cloud refuses terminations (twice: the first call and one retry).
    cloud.failures.store(2, Ordering::SeqCst);
    broker.cancel(job).await.expect("cancel");
    broker.tick().await.expect("tick");
    let rows = db.store.instances_of_job(job).await.unwrap();
    assert!(
        rows.iter().any(|r| r.state == InstanceState::Terminating),
        "the refused termination leaves them terminating: {rows:?}"
    );

    // The owner asks again (every 5 s) until the cloud accepts; then they end.
    let started = Instant::now();
    loop {
        broker.tick().await.expect("tick");
        let rows = db.store.instances_of_job(job).await.unwrap();
        if live(&rows) == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "still running 30 s after the job's end: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        cloud.calls.load(Ordering::SeqCst) >= 3,
        "refused twice, then accepted"
    );
    let listed = cloud.describe().await.unwrap();
    assert!(
        listed.iter().all(|i| i.state.is_gone()),
        "the cloud lists every instance gone: {listed:?}"
    );
    let view = db.store.job(job).await.unwrap().unwrap();
    assert!(view.state.is_over());
}
