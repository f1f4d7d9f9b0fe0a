//! The live broker's tables — jobs, instances, agents, events, the ledger, market cool-downs and
//! the API token — function by function on both backends (SQLite is what `serve` and `demo` use
//! by default). Each check names the store function it guards and fails if that function wrote
//! the wrong row, returned the wrong order, lost a filter, lost an update or half-applied a
//! change that must be all-or-nothing.

use crate::on_both_backends;
use crate::support::TestDb;
use proteus_broker::market::{Market, Timestamp, Usd, UsdPerHour, Zone};
use proteus_broker::policy::Purchase;
use proteus_broker::store::{
    Backend, Cooldown, CooldownScope, EventRecord, InstanceRow, InstanceState, JobRow, JobState,
    LedgerLine, NewJob, Store, WorkRecord,
};
use proteus_wire::{JobId, Tier};

on_both_backends!(
    create_job_and_job_round_trip_every_field,
    jobs_are_newest_first_and_active_only_filters,
    set_job_state_stamps_start_once_and_final_states_are_final,
    a_racing_cancel_and_completion_leave_exactly_one_winner,
    set_job_progress_keeps_the_metric_when_none_is_given,
    save_control_state_touches_only_its_job,
    insert_instance_and_instance_round_trip_and_refuse_duplicates,
    instances_of_job_and_live_instances_filter_and_order,
    mark_launched_runs_a_requested_instance_and_keeps_the_first_launch,
    mark_ready_only_once_and_only_while_it_runs,
    tokens_metadata_and_cloud_ids_find_the_right_instance,
    mark_launch_failed_only_from_requested,
    mark_warned_records_its_event_once_and_atomically,
    mark_terminating_only_from_live_states,
    mark_ended_first_end_wins_and_its_event_is_atomic,
    agents_register_reregister_and_heartbeat,
    events_of_job_are_the_jobs_in_insertion_order,
    latest_recorded_time_is_the_latest_submission_or_event,
    replace_ledger_lines_replaces_one_instance_all_or_nothing,
    ledger_of_job_and_spend_of_job_are_per_job,
    job_status_reads_what_job_instances_and_spend_read_in_one_query,
    non_finite_money_in_a_row_is_refused_where_it_is_read,
    cooldowns_upsert_and_expire,
    a_spot_refusal_does_not_narrow_a_running_whole_market_cooldown,
    the_first_api_token_hash_stays,
);

const T0: i64 = 1_700_000_000_000;

fn t(secs: i64) -> Timestamp {
    Timestamp::from_millis(T0 + secs * 1000)
}

fn new_job(name: &str, created: Timestamp) -> NewJob {
    NewJob {
        name: name.to_string(),
        spec: format!("{{\"name\":\"{name}\"}}"),
        policy: "bidbrain".to_string(),
        billing: "per-second".to_string(),
        budget_usd: Some(Usd::new(12.5).unwrap()),
        deadline: Some(Timestamp::from_millis(created.millis() + 86_400_000)),
        created,
        grant_window_ms: 0,
    }
}

fn market(text: &str) -> Market {
    Market::parse(text).unwrap()
}

fn spot(bid: f64) -> Purchase {
    Purchase::Spot {
        bid: UsdPerHour::new(bid).unwrap(),
    }
}

async fn job_of(store: &Store, name: &str) -> JobId {
    store.create_job(&new_job(name, t(0))).await.unwrap()
}

async fn get_job(store: &Store, id: JobId) -> JobRow {
    store.job(id).await.unwrap().expect("job stored")
}

async fn get_instance(store: &Store, id: &str) -> InstanceRow {
    store.instance(id).await.unwrap().expect("instance stored")
}

/// Stores a launch intent `id` for `job`, requested at `at` seconds.
async fn intent(store: &Store, id: &str, job: JobId, at: i64) -> InstanceRow {
    let row = InstanceRow::intent(
        id.to_string(),
        job,
        market("us-east-1a/c4.large"),
        spot(0.25),
        format!("hash-{id}"),
        t(at),
    );
    store.insert_instance(None, &row).await.unwrap();
    row
}

/// A running instance: intent, then launched as `cloud-{id}`.
async fn running(store: &Store, id: &str, job: JobId, at: i64) {
    intent(store, id, job, at).await;
    store
        .mark_launched(None, id, &format!("cloud-{id}"), t(at + 1))
        .await
        .unwrap();
}

fn line(instance: &str, start: i64, end: i64, rate: f64, free: bool) -> LedgerLine {
    LedgerLine {
        instance_id: instance.to_string(),
        start: t(start),
        end: t(end),
        usd_per_hour: UsdPerHour::new(rate).unwrap(),
        amount_usd: if free {
            Usd::ZERO
        } else {
            UsdPerHour::new(rate)
                .unwrap()
                .for_secs((end - start) as f64)
        },
        free,
    }
}

async fn create_job_and_job_round_trip_every_field(db: TestDb) {
    let s = &db.store;
    let a = s.create_job(&new_job("alpha", t(5))).await.unwrap();
    let mut bare = new_job("beta", t(6));
    bare.budget_usd = None;
    bare.deadline = None;
    let b = s.create_job(&bare).await.unwrap();
    assert_ne!(a, b);
    assert!(b.0 > a.0, "ids grow: {a:?} then {b:?}");

    let ja = get_job(s, a).await;
    assert_eq!(ja.id, a);
    assert_eq!(ja.name, "alpha");
    assert_eq!(ja.spec, "{\"name\":\"alpha\"}");
    assert_eq!(ja.policy, "bidbrain");
    assert_eq!(ja.billing, "per-second");
    assert_eq!(ja.state, JobState::Pending);
    assert_eq!(ja.state_reason, None);
    assert_eq!(ja.budget_usd.map(Usd::get), Some(12.5));
    assert_eq!(
        ja.deadline,
        Some(Timestamp::from_millis(t(5).millis() + 86_400_000))
    );
    assert_eq!(ja.progress, 0.0);
    assert_eq!(ja.metric, None);
    assert_eq!(ja.control_state, None);
    assert_eq!(ja.created, t(5));
    assert_eq!((ja.started, ja.finished), (None, None));
    assert_eq!(ja.work, WorkRecord::default());

    let jb = get_job(s, b).await;
    assert_eq!(jb.name, "beta");
    assert_eq!((jb.budget_usd, jb.deadline), (None, None));
    assert_eq!(jb.created, t(6));

    assert!(s.job(JobId(b.0 + 1000)).await.unwrap().is_none());
}

async fn jobs_are_newest_first_and_active_only_filters(db: TestDb) {
    let s = &db.store;
    let mut ids = Vec::new();
    for name in ["p", "r", "ok", "bad", "gone"] {
        ids.push(job_of(s, name).await);
    }
    s.set_job_state(None, ids[1], JobState::Running, None, t(1))
        .await
        .unwrap();
    for (i, state) in [
        (2, JobState::Succeeded),
        (3, JobState::Failed),
        (4, JobState::Cancelled),
    ] {
        assert!(
            s.set_job_state(None, ids[i], state, None, t(2))
                .await
                .unwrap()
        );
    }
    let all: Vec<JobId> = s.jobs(false).await.unwrap().iter().map(|j| j.id).collect();
    let newest_first: Vec<JobId> = ids.iter().rev().copied().collect();
    assert_eq!(all, newest_first);
    let active: Vec<(JobId, JobState)> = s
        .jobs(true)
        .await
        .unwrap()
        .iter()
        .map(|j| (j.id, j.state))
        .collect();
    assert_eq!(
        active,
        vec![(ids[1], JobState::Running), (ids[0], JobState::Pending)]
    );
}

async fn set_job_state_stamps_start_once_and_final_states_are_final(db: TestDb) {
    let s = &db.store;
    let id = job_of(s, "life").await;
    let other = job_of(s, "bystander").await;

    assert!(
        s.set_job_state(None, id, JobState::Running, Some("launched"), t(10))
            .await
            .unwrap()
    );
    let j = get_job(s, id).await;
    assert_eq!(j.state, JobState::Running);
    assert_eq!(j.state_reason.as_deref(), Some("launched"));
    assert_eq!((j.started, j.finished), (Some(t(10)), None));

    // Running again (a resumed broker) keeps the first start and, given no reason, the reason.
    assert!(
        s.set_job_state(None, id, JobState::Running, None, t(20))
            .await
            .unwrap()
    );
    let j = get_job(s, id).await;
    assert_eq!(j.started, Some(t(10)));
    assert_eq!(j.state_reason.as_deref(), Some("launched"));

    assert!(
        s.set_job_state(None, id, JobState::Succeeded, Some("done"), t(30))
            .await
            .unwrap()
    );
    let j = get_job(s, id).await;
    assert_eq!(j.state, JobState::Succeeded);
    assert_eq!(j.state_reason.as_deref(), Some("done"));
    assert_eq!((j.started, j.finished), (Some(t(10)), Some(t(30))));

    // A finished job is never reopened nor re-finished.
    for state in [JobState::Running, JobState::Cancelled, JobState::Pending] {
        assert!(
            !s.set_job_state(None, id, state, Some("late"), t(40))
                .await
                .unwrap(),
            "{state} after success must not apply"
        );
    }
    let j = get_job(s, id).await;
    assert_eq!(j.state, JobState::Succeeded);
    assert_eq!(j.state_reason.as_deref(), Some("done"));
    assert_eq!(j.finished, Some(t(30)));

    // Only the named job moved; an unknown id changes nothing.
    let b = get_job(s, other).await;
    assert_eq!(
        (b.state, b.started, b.finished),
        (JobState::Pending, None, None)
    );
    assert!(
        !s.set_job_state(None, JobId(other.0 + 1000), JobState::Running, None, t(1))
            .await
            .unwrap()
    );

    // Failing straight from pending stamps the end, not a start.
    assert!(
        s.set_job_state(None, other, JobState::Failed, Some("no capacity"), t(50))
            .await
            .unwrap()
    );
    let b = get_job(s, other).await;
    assert_eq!(
        (b.state, b.started, b.finished),
        (JobState::Failed, None, Some(t(50)))
    );
}

/// A user's cancel and the scheduler's completion arriving together: exactly one applies, and
/// the stored state is the one that was told it applied.
async fn a_racing_cancel_and_completion_leave_exactly_one_winner(db: TestDb) {
    let s = &db.store;
    for round in 0..20 {
        let id = job_of(s, &format!("race-{round}")).await;
        s.set_job_state(None, id, JobState::Running, None, t(1))
            .await
            .unwrap();
        let (a, b) = (s.clone(), s.clone());
        let cancel = tokio::spawn(async move {
            a.set_job_state(None, id, JobState::Cancelled, Some("user"), t(2))
                .await
                .unwrap()
        });
        let finish = tokio::spawn(async move {
            b.set_job_state(None, id, JobState::Succeeded, Some("done"), t(3))
                .await
                .unwrap()
        });
        let (cancelled, finished) = (cancel.await.unwrap(), finish.await.unwrap());
        assert!(
            cancelled ^ finished,
            "round {round}: cancel applied {cancelled}, completion applied {finished}"
        );
        let j = get_job(s, id).await;
        let (state, reason, at) = if cancelled {
            (JobState::Cancelled, "user", t(2))
        } else {
            (JobState::Succeeded, "done", t(3))
        };
        assert_eq!(j.state, state, "round {round}");
        assert_eq!(j.state_reason.as_deref(), Some(reason), "round {round}");
        assert_eq!(j.finished, Some(at), "round {round}");
    }
}

async fn set_job_progress_keeps_the_metric_when_none_is_given(db: TestDb) {
    let s = &db.store;
    let id = job_of(s, "learn").await;
    let other = job_of(s, "idle").await;
    let metric = r#"{"kind":"accuracy","value":0.91}"#;
    let work = WorkRecord {
        done_units: 12.5,
        expected_units: Some(100.0),
    };
    s.set_job_progress(None, id, 0.125, Some(metric), work)
        .await
        .unwrap();
    let j = get_job(s, id).await;
    assert_eq!(j.progress, 0.125);
    assert_eq!(j.metric.as_deref(), Some(metric));
    assert_eq!(j.work, work);

    // No new metric: the last one stands, while progress and work move (expected back to None).
    let later = WorkRecord {
        done_units: 50.0,
        expected_units: None,
    };
    s.set_job_progress(None, id, 0.5, None, later)
        .await
        .unwrap();
    let j = get_job(s, id).await;
    assert_eq!(j.progress, 0.5);
    assert_eq!(j.metric.as_deref(), Some(metric));
    assert_eq!(j.work, later);

    let b = get_job(s, other).await;
    assert_eq!(
        (b.progress, b.metric, b.work),
        (0.0, None, WorkRecord::default())
    );
}

async fn save_control_state_touches_only_its_job(db: TestDb) {
    let s = &db.store;
    let id = job_of(s, "ctl").await;
    let other = job_of(s, "other").await;
    s.save_control_state(None, id, r#"{"layout":1}"#)
        .await
        .unwrap();
    s.save_control_state(None, id, r#"{"layout":2}"#)
        .await
        .unwrap();
    assert_eq!(
        get_job(s, id).await.control_state.as_deref(),
        Some(r#"{"layout":2}"#)
    );
    assert_eq!(get_job(s, other).await.control_state, None);
}

async fn insert_instance_and_instance_round_trip_and_refuse_duplicates(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "fleet").await;
    let spot_row = InstanceRow::intent(
        "i-spot".into(),
        job,
        market("us-east-1b/r3.large"),
        spot(0.3125),
        "hash-spot".into(),
        t(7),
    );
    s.insert_instance(None, &spot_row).await.unwrap();
    let od_row = InstanceRow::intent(
        "i-od".into(),
        job,
        market("us-east-1c/m3.medium/Windows"),
        Purchase::OnDemand,
        "hash-od".into(),
        t(8),
    );
    s.insert_instance(None, &od_row).await.unwrap();

    let got = get_instance(s, "i-spot").await;
    assert_eq!(got.id, "i-spot");
    assert_eq!(got.job_id, job);
    assert_eq!(got.cloud_id, None);
    assert_eq!(got.market, market("us-east-1b/r3.large"));
    assert_eq!(got.tier, Tier::Transient);
    assert_eq!(got.bid, Some(UsdPerHour::new(0.3125).unwrap()));
    assert_eq!(got.state, InstanceState::Requested);
    assert_eq!(got.token_hash, "hash-spot");
    assert_eq!(got.requested, t(7));
    assert_eq!(
        (got.launched, got.ready, got.warned, got.ended),
        (None, None, None, None)
    );
    assert_eq!(
        (got.end_reason, got.launch_error, got.metadata_addr),
        (None, None, None)
    );
    assert!(!got.ended_by_provider);

    let od = get_instance(s, "i-od").await;
    assert_eq!(od.market, market("us-east-1c/m3.medium/Windows"));
    assert_eq!((od.tier, od.bid), (Tier::Reliable, None));
    assert!(s.instance("i-none").await.unwrap().is_none());

    // The intent is the idempotency token: the same id twice is refused, not duplicated.
    assert!(s.insert_instance(None, &spot_row).await.is_err());
    assert_eq!(s.instances_of_job(job).await.unwrap().len(), 2);
    // An instance must belong to a stored job.
    let mut orphan = spot_row.clone();
    orphan.id = "i-orphan".into();
    orphan.job_id = JobId(job.0 + 1000);
    assert!(s.insert_instance(None, &orphan).await.is_err());
    assert!(s.instance("i-orphan").await.unwrap().is_none());
}

async fn instances_of_job_and_live_instances_filter_and_order(db: TestDb) {
    let s = &db.store;
    let a = job_of(s, "a").await;
    let b = job_of(s, "b").await;
    // Requested out of id order, and two at the same instant (ordered by id then).
    intent(s, "i-3", a, 30).await;
    intent(s, "i-1", a, 10).await;
    intent(s, "i-2b", a, 20).await;
    intent(s, "i-2a", a, 20).await;
    intent(s, "i-b", b, 15).await;
    intent(s, "i-failed", b, 5).await;

    let ids = |rows: Vec<InstanceRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        ids(s.instances_of_job(a).await.unwrap()),
        ["i-1", "i-2a", "i-2b", "i-3"]
    );
    assert_eq!(
        ids(s.instances_of_job(b).await.unwrap()),
        ["i-failed", "i-b"]
    );

    s.mark_ended(None, "i-2a", t(40), "done", false, None)
        .await
        .unwrap();
    s.mark_launch_failed(None, "i-failed", "no capacity", t(6))
        .await
        .unwrap();
    s.mark_terminating(None, "i-3", "scale down").await.unwrap();
    s.mark_launched(None, "i-b", "cloud-b", t(16))
        .await
        .unwrap();
    s.mark_warned(None, "i-b", t(50), None).await.unwrap();
    // Ended ones leave the live set; terminating and warned ones stay until they end.
    assert_eq!(
        ids(s.live_instances().await.unwrap()),
        ["i-1", "i-b", "i-2b", "i-3"]
    );
    // A job's list keeps its ended instances.
    assert_eq!(s.instances_of_job(a).await.unwrap().len(), 4);
}

async fn mark_launched_runs_a_requested_instance_and_keeps_the_first_launch(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "launch").await;
    intent(s, "i-a", job, 0).await;
    intent(s, "i-b", job, 0).await;
    s.mark_launched(None, "i-a", "cloud-a", t(3)).await.unwrap();
    let a = get_instance(s, "i-a").await;
    assert_eq!(a.state, InstanceState::Running);
    assert_eq!(
        (a.cloud_id.as_deref(), a.launched),
        (Some("cloud-a"), Some(t(3)))
    );
    // The other intent is untouched.
    let b = get_instance(s, "i-b").await;
    assert_eq!(
        (b.state, b.cloud_id, b.launched),
        (InstanceState::Requested, None, None)
    );

    // Reconciliation recording the launch again keeps the first launch time.
    s.mark_launched(None, "i-a", "cloud-a", t(9)).await.unwrap();
    assert_eq!(get_instance(s, "i-a").await.launched, Some(t(3)));

    // A launch learnt after the instance ended (a crash between the two) does not revive it.
    s.mark_ended(None, "i-b", t(4), "cancelled", false, None)
        .await
        .unwrap();
    s.mark_launched(None, "i-b", "cloud-b", t(5)).await.unwrap();
    let b = get_instance(s, "i-b").await;
    assert_eq!(b.state, InstanceState::Terminated);
    assert_eq!(b.cloud_id.as_deref(), Some("cloud-b"));

    // Cloud ids are unique: a second instance cannot claim the same one.
    intent(s, "i-c", job, 0).await;
    assert!(s.mark_launched(None, "i-c", "cloud-a", t(6)).await.is_err());
    assert_eq!(get_instance(s, "i-c").await.state, InstanceState::Requested);
}

async fn mark_ready_only_once_and_only_while_it_runs(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "ready").await;
    intent(s, "i-req", job, 0).await;
    assert!(
        !s.mark_ready(None, "i-req", t(1)).await.unwrap(),
        "not launched yet"
    );
    assert_eq!(get_instance(s, "i-req").await.ready, None);

    running(s, "i-run", job, 0).await;
    assert!(s.mark_ready(None, "i-run", t(5)).await.unwrap());
    assert!(
        !s.mark_ready(None, "i-run", t(9)).await.unwrap(),
        "second time"
    );
    assert_eq!(get_instance(s, "i-run").await.ready, Some(t(5)));

    // Warned while still starting: it still becomes ready (the simulator's rule, so the policy
    // hears of it in both drivers), once.
    running(s, "i-warned", job, 0).await;
    s.mark_warned(None, "i-warned", t(2), None).await.unwrap();
    assert!(s.mark_ready(None, "i-warned", t(3)).await.unwrap());
    assert!(
        !s.mark_ready(None, "i-warned", t(4)).await.unwrap(),
        "second time"
    );
    assert_eq!(get_instance(s, "i-warned").await.ready, Some(t(3)));
    // Ended before it was ready: never.
    running(s, "i-ended", job, 0).await;
    s.mark_ended(None, "i-ended", t(2), "terminated", false, None)
        .await
        .unwrap();
    assert!(!s.mark_ready(None, "i-ended", t(3)).await.unwrap());
    assert_eq!(get_instance(s, "i-ended").await.ready, None);
    assert!(!s.mark_ready(None, "i-none", t(3)).await.unwrap());
}

async fn tokens_metadata_and_cloud_ids_find_the_right_instance(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "tokens").await;
    running(s, "i-a", job, 0).await;
    running(s, "i-b", job, 0).await;

    let by_hash =
        |h: &'static str| async move { s.instance_by_token_hash(h).await.unwrap().map(|r| r.id) };
    assert_eq!(by_hash("hash-i-a").await.as_deref(), Some("i-a"));
    assert_eq!(by_hash("hash-i-b").await.as_deref(), Some("i-b"));
    assert_eq!(by_hash("hash-unknown").await, None);

    // Rotation: the old hash stops working, the new one finds the same instance, the other
    // instance keeps its own.
    s.set_token_hash(None, "i-a", "hash-rotated").await.unwrap();
    assert_eq!(by_hash("hash-i-a").await, None);
    assert_eq!(by_hash("hash-rotated").await.as_deref(), Some("i-a"));
    assert_eq!(by_hash("hash-i-b").await.as_deref(), Some("i-b"));
    assert_eq!(get_instance(s, "i-a").await.token_hash, "hash-rotated");

    s.set_local_agent(None, "i-b", "127.0.0.1:40123", Some(4242))
        .await
        .unwrap();
    assert_eq!(
        get_instance(s, "i-b").await.metadata_addr.as_deref(),
        Some("127.0.0.1:40123")
    );
    assert_eq!(get_instance(s, "i-b").await.agent_pid, Some(4242));
    assert_eq!(get_instance(s, "i-a").await.metadata_addr, None);

    let found = s.instance_by_cloud_id("cloud-i-b").await.unwrap();
    assert_eq!(found.map(|r| r.id).as_deref(), Some("i-b"));
    assert!(
        s.instance_by_cloud_id("cloud-none")
            .await
            .unwrap()
            .is_none()
    );
}

async fn mark_launch_failed_only_from_requested(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "fail").await;
    intent(s, "i-req", job, 0).await;
    running(s, "i-run", job, 0).await;
    s.mark_launch_failed(None, "i-req", "InsufficientInstanceCapacity", t(2))
        .await
        .unwrap();
    let f = get_instance(s, "i-req").await;
    assert_eq!(f.state, InstanceState::Failed);
    assert_eq!(
        f.launch_error.as_deref(),
        Some("InsufficientInstanceCapacity")
    );
    assert_eq!(f.ended, Some(t(2)));
    assert_eq!(f.end_reason.as_deref(), Some("launch failed"));

    // A running instance did launch: a late failure report must not rewrite it.
    s.mark_launch_failed(None, "i-run", "late", t(3))
        .await
        .unwrap();
    let r = get_instance(s, "i-run").await;
    assert_eq!(
        (r.state, r.launch_error, r.ended),
        (InstanceState::Running, None, None)
    );
}

async fn mark_warned_records_its_event_once_and_atomically(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "warn").await;
    running(s, "i-a", job, 0).await;
    running(s, "i-b", job, 0).await;
    let warning = EventRecord {
        job: Some(job),
        kind: "interruption_warning",
        detail: "two minutes",
    };
    assert!(
        s.mark_warned(None, "i-a", t(60), Some(warning))
            .await
            .unwrap()
    );
    let a = get_instance(s, "i-a").await;
    assert_eq!((a.state, a.warned), (InstanceState::Warned, Some(t(60))));
    assert_eq!(get_instance(s, "i-b").await.state, InstanceState::Running);

    // Warned again (the cloud repeats itself): no change and no second event.
    assert!(
        !s.mark_warned(None, "i-a", t(70), Some(warning))
            .await
            .unwrap()
    );
    assert_eq!(get_instance(s, "i-a").await.warned, Some(t(60)));
    let events = s.events_of_job(job).await.unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e.job_id, Some(job));
    assert_eq!(e.instance_id.as_deref(), Some("i-a"));
    assert_eq!(
        (e.time, e.kind.as_str(), e.detail.as_str()),
        (t(60), "interruption_warning", "two minutes")
    );

    // An ended instance is not warned.
    s.mark_ended(None, "i-b", t(80), "done", false, None)
        .await
        .unwrap();
    assert!(
        !s.mark_warned(None, "i-b", t(90), Some(warning))
            .await
            .unwrap()
    );
    assert_eq!(
        get_instance(s, "i-b").await.state,
        InstanceState::Terminated
    );
    assert_eq!(s.events_of_job(job).await.unwrap().len(), 1);

    // All or nothing: when the event cannot be stored (its job does not exist), the warning is
    // not stored either, so a retry will warn and tell.
    running(s, "i-c", job, 0).await;
    let broken = EventRecord {
        job: Some(JobId(job.0 + 1000)),
        ..warning
    };
    assert!(
        s.mark_warned(None, "i-c", t(100), Some(broken))
            .await
            .is_err()
    );
    let c = get_instance(s, "i-c").await;
    assert_eq!((c.state, c.warned), (InstanceState::Running, None));
    assert!(
        s.mark_warned(None, "i-c", t(101), Some(warning))
            .await
            .unwrap()
    );
    assert_eq!(s.events_of_job(job).await.unwrap().len(), 2);
}

async fn mark_terminating_only_from_live_states(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "term").await;
    intent(s, "i-req", job, 0).await;
    running(s, "i-run", job, 0).await;
    running(s, "i-warn", job, 0).await;
    running(s, "i-end", job, 0).await;
    s.mark_warned(None, "i-warn", t(5), None).await.unwrap();
    s.mark_ended(None, "i-end", t(6), "evicted", true, None)
        .await
        .unwrap();

    for id in ["i-req", "i-run", "i-warn"] {
        assert!(
            s.mark_terminating(None, id, "job finished").await.unwrap(),
            "{id}"
        );
        let r = get_instance(s, id).await;
        assert_eq!(r.state, InstanceState::Terminating, "{id}");
        assert_eq!(r.end_reason.as_deref(), Some("job finished"), "{id}");
    }
    // The first reason stands.
    assert!(!s.mark_terminating(None, "i-run", "again").await.unwrap());
    assert_eq!(
        get_instance(s, "i-run").await.end_reason.as_deref(),
        Some("job finished")
    );
    // An ended instance stays ended with its own reason.
    assert!(
        !s.mark_terminating(None, "i-end", "job finished")
            .await
            .unwrap()
    );
    let e = get_instance(s, "i-end").await;
    assert_eq!(
        (e.state, e.end_reason.as_deref()),
        (InstanceState::Terminated, Some("evicted"))
    );
}

async fn mark_ended_first_end_wins_and_its_event_is_atomic(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "end").await;
    running(s, "i-a", job, 0).await;
    running(s, "i-b", job, 0).await;
    let evicted = EventRecord {
        job: Some(job),
        kind: "evicted",
        detail: "price above bid",
    };
    assert!(
        s.mark_ended(None, "i-a", t(120), "evicted", true, Some(evicted))
            .await
            .unwrap()
    );
    let a = get_instance(s, "i-a").await;
    assert_eq!(a.state, InstanceState::Terminated);
    assert_eq!(
        (a.ended, a.end_reason.as_deref()),
        (Some(t(120)), Some("evicted"))
    );
    assert!(a.ended_by_provider);
    assert_eq!(get_instance(s, "i-b").await.state, InstanceState::Running);

    // A later end (the broker's own terminate finishing) changes nothing and says nothing.
    assert!(
        !s.mark_ended(None, "i-a", t(200), "terminated", false, Some(evicted))
            .await
            .unwrap()
    );
    let a = get_instance(s, "i-a").await;
    assert_eq!(
        (a.ended, a.end_reason.as_deref()),
        (Some(t(120)), Some("evicted"))
    );
    assert!(a.ended_by_provider, "who ended it first is kept");
    let events = s.events_of_job(job).await.unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].instance_id.as_deref(), events[0].time),
        (Some("i-a"), t(120))
    );

    // After a terminate request, the end keeps the request's reason.
    s.mark_terminating(None, "i-b", "scale down").await.unwrap();
    assert!(
        s.mark_ended(None, "i-b", t(130), "terminated", false, None)
            .await
            .unwrap()
    );
    let b = get_instance(s, "i-b").await;
    assert_eq!(
        (b.state, b.end_reason.as_deref()),
        (InstanceState::Terminated, Some("scale down"))
    );
    assert!(!b.ended_by_provider);

    // A warned instance the job's end caught during its notice: the provider's end is the
    // reason on record, as in every report.
    running(s, "i-w", job, 0).await;
    s.mark_warned(None, "i-w", t(140), None).await.unwrap();
    s.mark_terminating(None, "i-w", "job succeeded")
        .await
        .unwrap();
    assert!(
        s.mark_ended(None, "i-w", t(150), "evicted", true, None)
            .await
            .unwrap()
    );
    let w = get_instance(s, "i-w").await;
    assert_eq!(
        (w.state, w.end_reason.as_deref(), w.ended_by_provider),
        (InstanceState::Terminated, Some("evicted"), true)
    );

    // A failed launch is already final.
    intent(s, "i-f", job, 0).await;
    s.mark_launch_failed(None, "i-f", "quota", t(1))
        .await
        .unwrap();
    assert!(
        !s.mark_ended(None, "i-f", t(2), "x", true, None)
            .await
            .unwrap()
    );
    assert_eq!(get_instance(s, "i-f").await.state, InstanceState::Failed);

    // All or nothing, as for warnings.
    running(s, "i-c", job, 0).await;
    let broken = EventRecord {
        job: Some(JobId(job.0 + 1000)),
        ..evicted
    };
    assert!(
        s.mark_ended(None, "i-c", t(140), "evicted", true, Some(broken))
            .await
            .is_err()
    );
    let c = get_instance(s, "i-c").await;
    assert_eq!(
        (c.state, c.ended, c.ended_by_provider),
        (InstanceState::Running, None, false)
    );
    assert_eq!(s.events_of_job(job).await.unwrap().len(), 1);
}

/// The agents table has no reader in the product (it is the broker's record for operators), so
/// the check reads it directly.
async fn agent_row(
    db: &TestDb,
    instance: &str,
) -> Option<(i64, String, i64, i64, Option<i64>, Option<f64>)> {
    let sql = "SELECT job_id, data_addr, vcpus, registered_ms, last_heartbeat_ms, samples_per_sec \
               FROM agents WHERE instance_id = $1";
    if db.url.starts_with("sqlite:") {
        let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
        let row = sqlx::query_as(sql)
            .bind(instance)
            .fetch_optional(&pool)
            .await
            .unwrap();
        pool.close().await;
        row
    } else {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        let row = sqlx::query_as(sql)
            .bind(instance)
            .fetch_optional(&pool)
            .await
            .unwrap();
        pool.close().await;
        row
    }
}

async fn agents_register_reregister_and_heartbeat(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "agents").await;
    running(s, "i-a", job, 0).await;
    running(s, "i-b", job, 0).await;
    s.upsert_agent("i-a", job, "127.0.0.1:7001", 4, t(10))
        .await
        .unwrap();
    s.upsert_agent("i-b", job, "127.0.0.1:7002", 8, t(11))
        .await
        .unwrap();
    assert_eq!(
        agent_row(&db, "i-a").await,
        Some((
            job.0,
            "127.0.0.1:7001".into(),
            4,
            t(10).millis(),
            Some(t(10).millis()),
            None
        ))
    );

    s.touch_agent("i-a", t(20), 1234.5).await.unwrap();
    assert_eq!(
        agent_row(&db, "i-a").await,
        Some((
            job.0,
            "127.0.0.1:7001".into(),
            4,
            t(10).millis(),
            Some(t(20).millis()),
            Some(1234.5)
        ))
    );
    // The other agent's heartbeat is its own.
    assert_eq!(
        agent_row(&db, "i-b").await,
        Some((
            job.0,
            "127.0.0.1:7002".into(),
            8,
            t(11).millis(),
            Some(t(11).millis()),
            None
        ))
    );

    // A restarted agent registers again: one row, with its new address and registration, and
    // the last heartbeat kept.
    s.upsert_agent("i-a", job, "127.0.0.1:7101", 2, t(30))
        .await
        .unwrap();
    assert_eq!(
        agent_row(&db, "i-a").await,
        Some((
            job.0,
            "127.0.0.1:7101".into(),
            2,
            t(30).millis(),
            Some(t(20).millis()),
            Some(1234.5)
        ))
    );
    // An agent needs its instance.
    assert!(
        s.upsert_agent("i-none", job, "127.0.0.1:1", 1, t(1))
            .await
            .is_err()
    );
    assert_eq!(agent_row(&db, "i-none").await, None);
}

async fn events_of_job_are_the_jobs_in_insertion_order(db: TestDb) {
    let s = &db.store;
    let a = job_of(s, "a").await;
    let b = job_of(s, "b").await;
    running(s, "i-a", a, 0).await;
    // Times out of order: the history is in the order things were recorded.
    s.add_event(None, Some(a), Some("i-a"), t(30), "launched", "first")
        .await
        .unwrap();
    s.add_event(None, Some(b), None, t(1), "submitted", "b's")
        .await
        .unwrap();
    s.add_event(None, Some(a), None, t(10), "progress", "second")
        .await
        .unwrap();
    s.add_event(None, None, None, t(5), "broker_started", "no job")
        .await
        .unwrap();
    s.add_event(None, Some(a), Some("i-a"), t(20), "evicted", "third")
        .await
        .unwrap();

    let events = s.events_of_job(a).await.unwrap();
    let got: Vec<(&str, Option<&str>, Timestamp, &str)> = events
        .iter()
        .map(|e| {
            (
                e.kind.as_str(),
                e.instance_id.as_deref(),
                e.time,
                e.detail.as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("launched", Some("i-a"), t(30), "first"),
            ("progress", None, t(10), "second"),
            ("evicted", Some("i-a"), t(20), "third"),
        ]
    );
    assert!(events.iter().all(|e| e.job_id == Some(a)));
    assert!(events.windows(2).all(|w| w[0].id < w[1].id));
    let bs = s.events_of_job(b).await.unwrap();
    assert_eq!(bs.len(), 1);
    assert_eq!(bs[0].detail, "b's");
}

async fn latest_recorded_time_is_the_latest_submission_or_event(db: TestDb) {
    let s = &db.store;
    assert_eq!(s.latest_recorded_time().await.unwrap(), None);
    let a = s.create_job(&new_job("a", t(40))).await.unwrap();
    assert_eq!(s.latest_recorded_time().await.unwrap(), Some(t(40)));
    // Events recorded out of time order: the latest time counts, not the latest row.
    s.add_event(None, Some(a), None, t(90), "progress", "")
        .await
        .unwrap();
    s.add_event(None, None, None, t(60), "broker_started", "")
        .await
        .unwrap();
    assert_eq!(s.latest_recorded_time().await.unwrap(), Some(t(90)));
    s.create_job(&new_job("b", t(120))).await.unwrap();
    assert_eq!(s.latest_recorded_time().await.unwrap(), Some(t(120)));
}

async fn replace_ledger_lines_replaces_one_instance_all_or_nothing(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "bill").await;
    running(s, "i-a", job, 0).await;
    running(s, "i-b", job, 0).await;
    let a1 = vec![line("i-a", 0, 3600, 0.10, false)];
    s.replace_ledger_lines(None, job, "i-a", &a1).await.unwrap();
    let b1 = vec![
        line("i-b", 0, 3600, 0.20, false),
        line("i-b", 3600, 5400, 0.20, true),
    ];
    s.replace_ledger_lines(None, job, "i-b", &b1).await.unwrap();

    // Billing recomputed from the instance's whole life replaces its lines, and only its own.
    let a2 = vec![
        line("i-a", 0, 3600, 0.10, false),
        line("i-a", 3600, 7200, 0.12, false),
    ];
    s.replace_ledger_lines(None, job, "i-a", &a2).await.unwrap();
    let ledger = s.ledger_of_job(job).await.unwrap();
    assert_eq!(
        ledger,
        vec![a2[0].clone(), b1[0].clone(), a2[1].clone(), b1[1].clone()]
    );

    // A rewrite that fails part-way (two lines for the same hour break the ledger's unique key)
    // leaves the previous lines whole: none deleted, none half-written.
    let bad = vec![
        line("i-a", 0, 3600, 9.0, false),
        line("i-a", 7200, 10800, 9.0, false),
        line("i-a", 7200, 10800, 9.0, false),
    ];
    assert!(
        s.replace_ledger_lines(None, job, "i-a", &bad)
            .await
            .is_err()
    );
    assert_eq!(s.ledger_of_job(job).await.unwrap(), ledger);

    // No lines: the instance is billed nothing.
    s.replace_ledger_lines(None, job, "i-b", &[]).await.unwrap();
    assert_eq!(s.ledger_of_job(job).await.unwrap(), a2);
}

/// The money columns are bare floating-point numbers, which can hold what `Usd` refuses
/// (Postgres stores `Infinity`, SQLite `1e999`): such a row is an error that says which row
/// and why, where it is read, rather than an amount that poisons every sum made from it.
async fn non_finite_money_in_a_row_is_refused_where_it_is_read(db: TestDb) {
    let s = &db.store;
    let job = job_of(s, "a").await;
    running(s, "i-a", job, 0).await;
    s.replace_ledger_lines(None, job, "i-a", &[line("i-a", 0, 3600, 0.25, false)])
        .await
        .unwrap();
    let inf = match s.backend() {
        Backend::Postgres => "'Infinity'::float8",
        Backend::Sqlite => "1e999",
    };
    s.execute_admin(&format!("UPDATE ledger_lines SET amount_usd = {inf}"))
        .await
        .unwrap();
    let err = s.ledger_of_job(job).await.unwrap_err().to_string();
    assert!(
        err.contains("ledger line of instance i-a")
            && err.contains("not a finite number of dollars"),
        "{err}"
    );
    let err = s.spend_of_job(job).await.unwrap_err().to_string();
    assert!(
        err.contains(&format!("spend of job {job}")) && err.contains("not a finite number"),
        "{err}"
    );
    s.execute_admin(&format!("UPDATE jobs SET budget_usd = -{inf}"))
        .await
        .unwrap();
    let err = s.job(job).await.unwrap_err().to_string();
    assert!(
        err.contains(&format!("stored job {job}: budget")) && err.contains("not a finite number"),
        "{err}"
    );
}

async fn ledger_of_job_and_spend_of_job_are_per_job(db: TestDb) {
    let s = &db.store;
    let a = job_of(s, "a").await;
    let b = job_of(s, "b").await;
    let empty = job_of(s, "empty").await;
    running(s, "i-a2", a, 0).await;
    running(s, "i-a1", a, 0).await;
    running(s, "i-b", b, 0).await;
    s.replace_ledger_lines(
        None,
        a,
        "i-a2",
        &[
            line("i-a2", 0, 3600, 0.25, false),
            line("i-a2", 3600, 4000, 0.25, true),
        ],
    )
    .await
    .unwrap();
    s.replace_ledger_lines(None, a, "i-a1", &[line("i-a1", 0, 1800, 0.50, false)])
        .await
        .unwrap();
    s.replace_ledger_lines(None, b, "i-b", &[line("i-b", 0, 3600, 4.0, false)])
        .await
        .unwrap();

    let ledger = s.ledger_of_job(a).await.unwrap();
    let order: Vec<(&str, Timestamp, bool)> = ledger
        .iter()
        .map(|l| (l.instance_id.as_str(), l.start, l.free))
        .collect();
    // By start, then instance.
    assert_eq!(
        order,
        vec![
            ("i-a1", t(0), false),
            ("i-a2", t(0), false),
            ("i-a2", t(3600), true)
        ]
    );
    assert_eq!(ledger[1].end, t(3600));
    assert_eq!(ledger[1].usd_per_hour.get(), 0.25);

    let spend_a = s.spend_of_job(a).await.unwrap();
    assert!(
        (spend_a.get() - (0.25 + 0.25)).abs() < 1e-12,
        "spend of a: {spend_a}"
    );
    assert!((s.spend_of_job(b).await.unwrap().get() - 4.0).abs() < 1e-12);
    assert_eq!(s.spend_of_job(empty).await.unwrap(), Usd::ZERO);
    assert!(s.ledger_of_job(empty).await.unwrap().is_empty());
}

async fn cooldowns_upsert_and_expire(db: TestDb) {
    let s = &db.store;
    let cd = |zone: &str, itype: &str, until: i64, reason: &str| Cooldown {
        zone: Zone::parse(zone).unwrap(),
        instance_type: proteus_broker::market::InstanceType::parse(itype).unwrap(),
        until: t(until),
        reason: reason.to_string(),
        scope: CooldownScope::WholeMarket,
    };
    s.set_cooldown(&cd("us-east-1a", "c4.large", 100, "capacity"), t(0))
        .await
        .unwrap();
    s.set_cooldown(&cd("us-east-1b", "c4.large", 50, "quota"), t(0))
        .await
        .unwrap();
    // Same market again: the newer refusal replaces the old one.
    s.set_cooldown(&cd("us-east-1a", "c4.large", 300, "price too low"), t(0))
        .await
        .unwrap();

    let mut now = s.cooldowns(t(10)).await.unwrap();
    now.sort_by(|x, y| x.zone.as_str().cmp(y.zone.as_str()));
    assert_eq!(
        now,
        vec![
            cd("us-east-1a", "c4.large", 300, "price too low"),
            cd("us-east-1b", "c4.large", 50, "quota")
        ]
    );
    // A cool-down is over at its end.
    assert_eq!(
        s.cooldowns(t(50)).await.unwrap(),
        vec![cd("us-east-1a", "c4.large", 300, "price too low")]
    );
    assert!(s.cooldowns(t(300)).await.unwrap().is_empty());
}

async fn a_spot_refusal_does_not_narrow_a_running_whole_market_cooldown(db: TestDb) {
    let s = &db.store;
    let cd = |until: i64, scope: CooldownScope| Cooldown {
        zone: Zone::parse("us-west-2a").unwrap(),
        instance_type: proteus_broker::market::InstanceType::parse("p3.2xlarge").unwrap(),
        until: t(until),
        reason: "insufficient-capacity".to_string(),
        scope,
    };
    let scope_at = |now: i64| async move {
        let all = s.cooldowns(t(now)).await.unwrap();
        assert!(all.len() <= 1, "{all:?}");
        all.first().map(|c| (c.scope, c.until))
    };
    // A spot refusal cools down the spot offer only.
    s.set_cooldown(&cd(100, CooldownScope::SpotOffer), t(0))
        .await
        .unwrap();
    assert_eq!(scope_at(1).await, Some((CooldownScope::SpotOffer, t(100))));
    // An on-demand refusal widens it to the whole market.
    s.set_cooldown(&cd(200, CooldownScope::WholeMarket), t(50))
        .await
        .unwrap();
    assert_eq!(
        scope_at(51).await,
        Some((CooldownScope::WholeMarket, t(200)))
    );
    // A spot refusal while that runs extends it, still whole.
    s.set_cooldown(&cd(300, CooldownScope::SpotOffer), t(150))
        .await
        .unwrap();
    assert_eq!(
        scope_at(151).await,
        Some((CooldownScope::WholeMarket, t(300)))
    );
    // Once it is over, a spot refusal is a spot one again.
    s.set_cooldown(&cd(500, CooldownScope::SpotOffer), t(400))
        .await
        .unwrap();
    assert_eq!(
        scope_at(401).await,
        Some((CooldownScope::SpotOffer, t(500)))
    );
}

async fn the_first_api_token_hash_stays(db: TestDb) {
    let s = &db.store;
    assert_eq!(s.api_token_hash("user").await.unwrap(), None);
    assert_eq!(
        s.init_api_token_hash("user", "h1", t(0)).await.unwrap(),
        "h1"
    );
    // A later start with a freshly generated token keeps the stored one.
    assert_eq!(
        s.init_api_token_hash("user", "h2", t(1)).await.unwrap(),
        "h1"
    );
    assert_eq!(
        s.api_token_hash("user").await.unwrap().as_deref(),
        Some("h1")
    );
    assert_eq!(s.api_token_hash("other").await.unwrap(), None);

    // Two brokers starting together on one database agree on one token.
    let (a, b) = (s.clone(), s.clone());
    let x = tokio::spawn(async move { a.init_api_token_hash("race", "hx", t(2)).await.unwrap() });
    let y = tokio::spawn(async move { b.init_api_token_hash("race", "hy", t(2)).await.unwrap() });
    let (x, y) = (x.await.unwrap(), y.await.unwrap());
    assert_eq!(x, y);
    assert_eq!(s.api_token_hash("race").await.unwrap(), Some(x));
}

async fn job_status_reads_what_job_instances_and_spend_read_in_one_query(db: TestDb) {
    let s = &db.store;
    let a = job_of(s, "a").await;
    let b = job_of(s, "b").await;
    let empty = job_of(s, "empty").await;
    running(s, "i-a2", a, 5).await;
    running(s, "i-a1", a, 0).await;
    intent(s, "i-a3", a, 9).await;
    running(s, "i-b", b, 0).await;
    s.mark_ended(None, "i-a1", t(100), "evicted", true, None)
        .await
        .unwrap();
    s.set_local_agent(None, "i-a2", "127.0.0.1:1234", Some(77))
        .await
        .unwrap();
    s.replace_ledger_lines(None, a, "i-a2", &[line("i-a2", 0, 3600, 0.25, false)])
        .await
        .unwrap();
    s.replace_ledger_lines(None, a, "i-a1", &[line("i-a1", 0, 1800, 0.50, false)])
        .await
        .unwrap();
    s.replace_ledger_lines(None, b, "i-b", &[line("i-b", 0, 3600, 4.0, false)])
        .await
        .unwrap();
    for id in [a, b, empty] {
        let (job, instances, spend) = s.job_status(id).await.unwrap().expect("the job");
        assert_eq!(json(&job), json(&get_job(s, id).await), "job {id}");
        assert_eq!(
            json(&instances),
            json(&s.instances_of_job(id).await.unwrap()),
            "instances of job {id}, in launch order, every column"
        );
        assert_eq!(
            spend,
            s.spend_of_job(id).await.unwrap(),
            "spend of job {id}"
        );
    }
    let (_, instances, _) = s.job_status(a).await.unwrap().unwrap();
    assert_eq!(instances.len(), 3);
    assert_eq!(instances[1].agent_pid, Some(77));
    assert!(instances[0].ended_by_provider);
    assert!(s.job_status(JobId(9_999)).await.unwrap().is_none());
}

/// A row as JSON, to compare rows whole.
fn json<T: serde::Serialize>(row: &T) -> serde_json::Value {
    serde_json::to_value(row).expect("rows serialise")
}
