//! A job cancelled while the cloud is still answering one of its launches: the instance that
//! launch creates must not outlive the job. (CI caught this on LocalStack, whose RunInstances
//! takes long enough: the cancel ended the row that had no cloud id yet, the launch then
//! recorded its instance into an ended row, and nobody terminated it.)
//!
//! The simulated cloud is wrapped in one whose launch waits at a gate the test opens, so the
//! cancel lands exactly inside the launch; the market clock is stepped by the test.

use crate::api::TOKEN;
use crate::support::TestDb;
use async_trait::async_trait;
use proteus_broker::clock::ManualClock;
use proteus_broker::cloud::sim::SimCloud;
use proteus_broker::cloud::{Cloud, CloudError, CloudEvent, CloudInstance, LaunchSpec};
use proteus_broker::market::{Region, Timestamp};
use proteus_broker::service::Pacing;
use proteus_broker::startup::{ServeArgs, StartOptions, start_with};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};

const START: &str = "2015-05-01T00:00:00Z";

/// A cloud whose launches, while the gate is shut, wait until the test lets one through.
#[derive(Debug)]
struct GatedCloud {
    inner: SimCloud,
    shut: AtomicBool,
    entered: Notify,
    passes: Semaphore,
}

#[async_trait]
impl Cloud for GatedCloud {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        if self.shut.load(Ordering::SeqCst) {
            self.entered.notify_one();
            self.passes
                .acquire()
                .await
                .expect("the gate's semaphore is never closed")
                .forget();
        }
        self.inner.launch(spec).await
    }
    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError> {
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

pub(crate) fn sim_cloud(clock: &ManualClock) -> SimCloud {
    use proteus_broker::data;
    use proteus_broker::prices::files;
    let raw = files::decompress_if_gzipped(data::TRACE_2015.to_vec()).expect("built-in trace");
    let rows = files::parse_spot_bytes(Path::new(data::TRACE_2015_NAME), &raw).expect("trace");
    let offers = files::parse_on_demand_bytes(
        Path::new(data::ON_DEMAND_2015_NAME),
        data::ON_DEMAND_2015,
        &Region::parse("us-east-1").expect("region"),
    )
    .expect("on-demand prices");
    let history = proteus_broker::sim::inputs::history_from_rows(rows, offers);
    SimCloud::new(
        Arc::new(history),
        Arc::new(clock.clone()),
        Duration::from_secs(120),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cancelled_during_a_launch_leaves_no_instance_running() {
    let db = TestDb::postgres().await;
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let cloud = Arc::new(GatedCloud {
        inner: sim_cloud(&clock),
        shut: AtomicBool::new(true),
        entered: Notify::new(),
        passes: Semaphore::new(0),
    });
    let mut args = ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.start = Some(START.into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (broker, api) = start_with(
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
        "name": "cancel-during-launch",
        "app": "mlr",
        "policy": "bidbrain",
        "limits": {"max_instances": 2, "max_reliable_instances": 1},
        "work": {"total_work": 8.0}
    }))
    .unwrap();
    let job = proteus_wire::JobId(broker.submit(spec).await.expect("submit").id);

    // A tick decides to launch; its first launch waits at the gate.
    let ticking = {
        let broker = broker.clone();
        tokio::spawn(async move { broker.tick().await })
    };
    tokio::time::timeout(Duration::from_secs(60), cloud.entered.notified())
        .await
        .expect("the tick reaches a launch");

    // The user cancels while the cloud is answering.
    let cancelled = tokio::time::timeout(Duration::from_secs(30), broker.cancel(job))
        .await
        .expect("a cancel does not wait for the cloud's answer")
        .expect("cancel");
    assert_eq!(cancelled.state, "cancelled");

    // The cloud answers: the launch goes through.
    cloud.shut.store(false, Ordering::SeqCst);
    cloud.passes.add_permits(64);
    tokio::time::timeout(Duration::from_secs(60), ticking)
        .await
        .expect("the tick ends once the cloud answers")
        .expect("tick task")
        .expect("tick");

    let launched = cloud.inner.describe().await.expect("describe");
    assert!(
        !launched.is_empty(),
        "the gated launch created an instance (else this test tests nothing)"
    );
    // A few market steps: the terminations are applied, the job winds down.
    for _ in 0..5 {
        clock.advance_secs(60.0);
        broker.tick().await.expect("tick");
    }
    let running: Vec<_> = cloud
        .inner
        .describe()
        .await
        .expect("describe")
        .into_iter()
        .filter(|c| !c.state.is_gone())
        .collect();
    assert!(
        running.is_empty(),
        "instances of the cancelled job still running in the cloud: {running:?}"
    );
    let rows = broker.store().instances_of_job(job).await.unwrap();
    assert!(
        rows.iter().all(|r| r.state.is_final()),
        "every instance row ended: {rows:?}"
    );
    let launched_row = rows
        .iter()
        .find(|r| r.cloud_id.is_some())
        .expect("the launched instance is recorded with its cloud id");
    assert!(
        launched_row.ended.is_some() && launched_row.launched.is_some(),
        "{launched_row:?}"
    );
    assert!(
        broker.membership().lease(job).is_none(),
        "the wound-down job's lease is given up"
    );
    api.abort();
}
