//! Launches are idempotent as EC2 defines them: a launch's ClientToken (the broker's instance
//! id) and everything it asks for — market, tier, bid, the user data with the agent token — are
//! stored with the intent before the cloud is called, and every retry and every relaunch after
//! a takeover sends them unchanged. The simulated cloud answers a reused token with other
//! parameters with `IdempotentParameterMismatch`, as EC2 does, so a relaunch that is not the
//! same launch shows here.

use crate::cancel_during_launch::sim_cloud;
use crate::support::TestDb;
use crate::takeover::{broker, expire};
use async_trait::async_trait;
use proteus_broker::clock::ManualClock;
use proteus_broker::cloud::sim::SimCloud;
use proteus_broker::cloud::{Cloud, CloudError, CloudEvent, CloudInstance, LaunchSpec};
use proteus_broker::market::{Market, Timestamp, UsdPerHour};
use proteus_wire::{JobId, Tier};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

const START: &str = "2015-05-01T00:00:00Z";

#[tokio::test]
async fn a_reused_client_token_with_other_parameters_is_refused_as_on_ec2() {
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let cloud = sim_cloud(&clock);
    let spec = LaunchSpec {
        instance_id: "pi-1-0000abcd".into(),
        job_id: JobId(1),
        market: Market::parse("us-east-1a/c3.xlarge").unwrap(),
        tier: Tier::Transient,
        bid: Some(UsdPerHour::new(2.0).unwrap()),
        bootstrap_token: "pa_first".into(),
    };
    let first = cloud.launch(&spec).await.unwrap();
    let again = cloud.launch(&spec).await.unwrap();
    assert_eq!(
        first.cloud_id, again.cloud_id,
        "the same launch, one instance"
    );
    let other_token = LaunchSpec {
        bootstrap_token: "pa_second".into(),
        ..spec.clone()
    };
    let other_bid = LaunchSpec {
        bid: Some(UsdPerHour::new(2.5).unwrap()),
        ..spec.clone()
    };
    for other in [other_token, other_bid] {
        match cloud.launch(&other).await {
            Err(CloudError::IdempotentParameterMismatch { .. }) => {}
            got => panic!("a reused token with other parameters: {got:?}"),
        }
    }
    assert_eq!(cloud.describe().await.unwrap().len(), 1);
}

/// The broker whose launch this is: the cloud call reaches the cloud, and the broker freezes
/// before it hears the answer (a paused process, a dead one).
#[derive(Debug)]
struct FrozenAfterTheCall {
    inner: Arc<SimCloud>,
    reached: Notify,
}

#[async_trait]
impl Cloud for FrozenAfterTheCall {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        let _ = self.inner.launch(spec).await;
        self.reached.notify_one();
        std::future::pending().await
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
}

/// The broker that takes over: its DescribeInstances does not list the instances named in
/// `unlisted` yet (EC2's lists are eventually consistent: a just-launched instance can be
/// missing for a while).
#[derive(Debug)]
struct NotListedYet {
    inner: Arc<SimCloud>,
    unlisted: Mutex<HashSet<String>>,
}

#[async_trait]
impl Cloud for NotListedYet {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        self.inner.launch(spec).await
    }
    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError> {
        self.inner.terminate(cloud_ids).await
    }
    async fn describe(&self) -> Result<Vec<CloudInstance>, CloudError> {
        let unlisted = self.unlisted.lock().unwrap().clone();
        Ok(self
            .inner
            .describe()
            .await?
            .into_iter()
            .filter(|c| !c.instance_id.as_ref().is_some_and(|i| unlisted.contains(i)))
            .collect())
    }
    async fn events(&self) -> Result<Vec<CloudEvent>, CloudError> {
        self.inner.events().await
    }
}

/// A broker freezes after its launch reached the cloud, before recording the answer; the
/// broker that takes the job over does not see the instance listed yet and launches the intent
/// again: with the same token and parameters, so the cloud answers with the instance the first
/// call made (EC2 would refuse a relaunch with a fresh agent token as a mismatch, and the
/// intent would fail while its instance ran unrecorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaunch_after_a_takeover_is_the_same_launch_and_gets_the_same_instance() {
    let db = TestDb::postgres().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let sim = Arc::new(sim_cloud(&clock));
    let frozen = Arc::new(FrozenAfterTheCall {
        inner: sim.clone(),
        reached: Notify::new(),
    });
    let not_listed = Arc::new(NotListedYet {
        inner: sim.clone(),
        unlisted: Mutex::new(HashSet::new()),
    });
    let dirs = tempfile::tempdir().unwrap();
    let a = broker(
        &db,
        &dirs.path().join("a"),
        &clock,
        &(frozen.clone() as Arc<dyn Cloud>),
    )
    .await;
    let b = broker(
        &db,
        &dirs.path().join("b"),
        &clock,
        &(not_listed.clone() as Arc<dyn Cloud>),
    )
    .await;
    let spec = serde_json::from_value(serde_json::json!({
        "name": "relaunched",
        "app": "mlr",
        "policy": "bidbrain",
        "limits": {"max_instances": 2, "max_reliable_instances": 1},
        "work": {"total_work": 8.0}
    }))
    .unwrap();
    let job = JobId(a.submit(spec).await.expect("submit").id);
    assert!(a.membership().lease(job).is_some(), "a took its own submit");
    let ticking = {
        let a = a.clone();
        tokio::spawn(async move { a.tick().await })
    };
    tokio::time::timeout(Duration::from_secs(60), frozen.reached.notified())
        .await
        .expect("a's tick reaches a launch");
    let made = sim.describe().await.unwrap();
    assert_eq!(made.len(), 1, "{made:?}");
    let (cloud_id, id) = (
        made[0].cloud_id.clone(),
        made[0].instance_id.clone().expect("tagged"),
    );
    not_listed.unlisted.lock().unwrap().insert(id.clone());

    // a stalls past its lease; b takes the job over and recovers it.
    expire(&pool, job).await;
    b.tick().await.unwrap();
    assert!(b.membership().lease(job).is_some(), "b took the job over");
    let row = b.store().instance(&id).await.unwrap().expect("the intent");
    assert_eq!(
        (row.state.as_str(), row.cloud_id.as_deref()),
        ("running", Some(cloud_id.as_str())),
        "the relaunch got the first call's instance: {row:?}\n{:?}",
        b.store().events_of_job(job).await.unwrap()
    );
    assert_eq!(
        row.launch_token, None,
        "kept only until the launch is recorded"
    );
    let same: Vec<_> = sim
        .describe()
        .await
        .unwrap()
        .into_iter()
        .filter(|c| c.instance_id.as_deref() == Some(id.as_str()))
        .collect();
    assert_eq!(same.len(), 1, "{same:?}");
    let failed: Vec<_> = b
        .store()
        .events_of_job(job)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "launch_failed")
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    ticking.abort();
}
