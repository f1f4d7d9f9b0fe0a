//! Brokers and job leases (`store::leases`), on both backends: a new job's lease, renewal by
//! heartbeat, takeover only after expiry (or when forced by a broker that is alone), the
//! fencing token that refuses the old owner's writes, release, and the live-broker list the
//! fair share and a new job's owner come from.

use crate::on_both_backends;
use crate::support::TestDb;
use proteus_broker::market::{Market, Timestamp, Usd, UsdPerHour};
use proteus_broker::policy::Purchase;
use proteus_broker::store::{
    IDLE_IN_TRANSACTION_TIMEOUT, InstanceRow, JobState, LedgerLine, NewJob, Store, StoreError,
};
use proteus_wire::JobId;
use std::time::{Duration, Instant};

on_both_backends!(
    a_new_job_is_granted_once_and_renewed_by_its_owners_heartbeat,
    an_expired_lease_moves_and_fences_the_old_owner_out,
    claims_take_only_expired_leases_up_to_the_asked_number,
    a_claim_without_unowned_leaves_new_jobs_to_their_grant,
    a_new_job_is_its_submitters_to_grant_until_its_grant_window_ends,
    a_released_lease_is_claimable_at_once_and_an_over_job_is_not,
    live_brokers_are_listed_fewest_jobs_first,
);

const LEASE: i64 = 10_000;

/// The job's lease runs out, as when its owner stalls past it: its expiry (on the database's
/// clock, as every lease time is) is moved two lease periods back, before the database's now.
async fn lapse(s: &Store, job: JobId) {
    s.execute_admin(&format!(
        "UPDATE jobs SET lease_expires_ms = lease_expires_ms - {} WHERE id = {}",
        2 * LEASE,
        job.0
    ))
    .await
    .unwrap();
}

async fn job(store: &Store, name: &str) -> JobId {
    store
        .create_job(&NewJob {
            name: name.into(),
            spec: "{}".into(),
            policy: "bidbrain".into(),
            billing: "per-second".into(),
            budget_usd: None,
            deadline: None,
            created: Timestamp::from_millis(1),
            grant_window_ms: 0,
        })
        .await
        .unwrap()
}

fn intent(id: &str, job: JobId) -> InstanceRow {
    InstanceRow::intent(
        id.into(),
        job,
        Market::parse("us-east-1a/c4.large").unwrap(),
        Purchase::Spot {
            bid: UsdPerHour::new(0.3).unwrap(),
        },
        format!("hash-{id}"),
        Timestamp::from_millis(10),
    )
}

fn fenced<T: std::fmt::Debug>(r: Result<T, StoreError>, job: JobId) {
    match r {
        Err(StoreError::Fenced { job: j }) => assert_eq!(j, job),
        other => panic!("expected the write to be fenced out, got {other:?}"),
    }
}

async fn a_new_job_is_granted_once_and_renewed_by_its_owners_heartbeat(db: TestDb) {
    let s = &db.store;
    s.register_broker("a", "http://a", 1).await.unwrap();
    let j = job(s, "j").await;
    let lease = s.grant_lease(j, "a", LEASE).await.unwrap().unwrap();
    assert_eq!((lease.job(), lease.token()), (j, 1));
    // A second grant (another broker's submit racing a claim) does not replace the owner.
    assert!(s.grant_lease(j, "b", LEASE).await.unwrap().is_none());
    assert_eq!(
        s.job(j).await.unwrap().unwrap().lease_owner.as_deref(),
        Some("a")
    );
    // Past its expiry with nobody claiming it yet, a's heartbeat renews it, and no claim
    // takes it then.
    lapse(s, j).await;
    let renewed = s.heartbeat("a", LEASE).await.unwrap();
    assert_eq!(renewed, vec![lease]);
    let claimed = s.claim_expired("b", LEASE, 10, false, true).await.unwrap();
    assert!(claimed.is_empty(), "{claimed:?}");
    // The owner writes with its lease.
    s.insert_instance(Some(&lease), &intent("i-1", j))
        .await
        .unwrap();
}

async fn an_expired_lease_moves_and_fences_the_old_owner_out(db: TestDb) {
    let s = &db.store;
    let j = job(s, "j").await;
    let old = s.grant_lease(j, "a", LEASE).await.unwrap().unwrap();
    s.insert_instance(Some(&old), &intent("i-1", j))
        .await
        .unwrap();
    s.mark_launched(Some(&old), "i-1", "cloud-1", Timestamp::from_millis(20))
        .await
        .unwrap();
    s.insert_instance(Some(&old), &intent("i-3", j))
        .await
        .unwrap();
    // While a holds it, b's claim takes nothing; a stalls past its lease, and b claims the job,
    // with a newer token.
    assert!(
        s.claim_expired("b", LEASE, 10, false, true)
            .await
            .unwrap()
            .is_empty()
    );
    lapse(s, j).await;
    let claimed = s.claim_expired("b", LEASE, 10, false, true).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let new = claimed[0];
    assert_eq!((new.job(), new.token()), (j, old.token() + 1));
    // a wakes up: its heartbeat no longer lists the job, and every write it tries is refused
    // and changes nothing.
    assert!(s.heartbeat("a", LEASE).await.unwrap().is_empty());
    fenced(s.insert_instance(Some(&old), &intent("i-2", j)).await, j);
    assert!(
        s.instance("i-2").await.unwrap().is_none(),
        "a fenced launch intent was stored"
    );
    fenced(s.mark_terminating(Some(&old), "i-1", "stale").await, j);
    fenced(
        s.mark_ready(Some(&old), "i-1", Timestamp::from_millis(25))
            .await,
        j,
    );
    fenced(
        s.mark_warned(Some(&old), "i-1", Timestamp::from_millis(26), None)
            .await,
        j,
    );
    fenced(
        s.set_local_agent(Some(&old), "i-1", "127.0.0.1:9", Some(9))
            .await,
        j,
    );
    fenced(
        s.mark_launch_failed(Some(&old), "i-3", "stale", Timestamp::from_millis(27))
            .await,
        j,
    );
    let events = s.events_of_job(j).await.unwrap().len();
    fenced(
        s.add_event(
            Some(&old),
            Some(j),
            Some("i-1"),
            Timestamp::from_millis(28),
            "launched",
            "stale",
        )
        .await,
        j,
    );
    assert_eq!(
        s.events_of_job(j).await.unwrap().len(),
        events,
        "a fenced event was recorded"
    );
    fenced(
        s.mark_ended(
            Some(&old),
            "i-1",
            Timestamp::from_millis(30),
            "stale",
            false,
            None,
        )
        .await,
        j,
    );
    fenced(
        s.set_job_state(
            Some(&old),
            j,
            JobState::Failed,
            Some("stale"),
            Timestamp::from_millis(30),
        )
        .await,
        j,
    );
    fenced(s.save_engine_state(Some(&old), j, "{}").await, j);
    fenced(
        s.save_owner_figures(Some(&old), j, "{\"stage\":1}").await,
        j,
    );
    let line = LedgerLine {
        instance_id: "i-1".into(),
        start: Timestamp::from_millis(20),
        end: Timestamp::from_millis(3_600_020),
        usd_per_hour: UsdPerHour::new(1.0).unwrap(),
        amount_usd: Usd::new(1.0).unwrap(),
        free: false,
    };
    fenced(
        s.replace_ledger_lines(Some(&old), j, "i-1", std::slice::from_ref(&line))
            .await,
        j,
    );
    let row = s.instance("i-1").await.unwrap().unwrap();
    assert_eq!(
        row.state.as_str(),
        "running",
        "the old owner's writes changed the instance"
    );
    assert_eq!(
        (row.ready, row.warned, row.metadata_addr, row.agent_pid),
        (None, None, None, None),
        "the old owner's writes changed the instance"
    );
    let row = s.instance("i-3").await.unwrap().unwrap();
    assert_eq!(row.state.as_str(), "requested", "{row:?}");
    let job_row = s.job(j).await.unwrap().unwrap();
    assert_eq!(job_row.state, JobState::Pending);
    assert_eq!(job_row.lease_owner.as_deref(), Some("b"));
    assert_eq!(job_row.owner_figures, None);
    assert!(s.ledger_of_job(j).await.unwrap().is_empty());
    // The new owner's writes go through.
    assert!(
        s.mark_terminating(Some(&new), "i-1", "taken over")
            .await
            .unwrap()
    );
    s.replace_ledger_lines(Some(&new), j, "i-1", &[line])
        .await
        .unwrap();
    assert_eq!(s.ledger_of_job(j).await.unwrap().len(), 1);
    s.save_owner_figures(Some(&new), j, "{\"stage\":2}")
        .await
        .unwrap();
    let job_row = s.job(j).await.unwrap().unwrap();
    assert_eq!(job_row.owner_figures.as_deref(), Some("{\"stage\":2}"));
}

/// A broker at its fair share claims only expired leases: a job that never had an owner is its
/// submitter's to give (to the broker with the fewest jobs), and the grant still finds it free.
async fn a_claim_without_unowned_leaves_new_jobs_to_their_grant(db: TestDb) {
    let s = &db.store;
    let orphan = job(s, "of-a-dead-broker").await;
    assert!(
        s.grant_lease(orphan, "dead", LEASE)
            .await
            .unwrap()
            .is_some()
    );
    lapse(s, orphan).await;
    let new = job(s, "just-submitted").await;
    let claimed = s.claim_expired("b", LEASE, 10, false, false).await.unwrap();
    assert_eq!(
        claimed.iter().map(|l| l.job()).collect::<Vec<_>>(),
        vec![orphan],
        "the expired lease only"
    );
    let granted = s.grant_lease(new, "c", LEASE).await.unwrap();
    assert!(granted.is_some(), "the new job was left for its grant");
}

/// Between storing a new job and granting it, its submitter may be slow (a busy machine):
/// another broker under its fair share does not take the job in that window, so the job goes
/// where its submitter gives it; once the window is over (the submitter died before its grant)
/// the job is anyone's.
async fn a_new_job_is_its_submitters_to_grant_until_its_grant_window_ends(db: TestDb) {
    let s = &db.store;
    let new = |name: &'static str| NewJob {
        name: name.into(),
        spec: "{}".into(),
        policy: "bidbrain".into(),
        billing: "per-second".into(),
        budget_usd: None,
        deadline: None,
        created: Timestamp::from_millis(1),
        grant_window_ms: LEASE,
    };
    let slow = s.create_job(&new("slow-submitter")).await.unwrap();
    let orphan = s.create_job(&new("dead-submitter")).await.unwrap();
    assert!(
        s.claim_expired("b", LEASE, 10, false, true)
            .await
            .unwrap()
            .is_empty(),
        "a claim took a job inside its submitter's grant window"
    );
    let granted = s.grant_lease(slow, "a", LEASE).await.unwrap();
    assert!(
        granted.is_some(),
        "the submitter's grant found its job free"
    );
    lapse(s, orphan).await;
    let claimed = s.claim_expired("b", LEASE, 10, false, true).await.unwrap();
    assert_eq!(
        claimed.iter().map(|l| l.job()).collect::<Vec<_>>(),
        vec![orphan],
        "after the window only the job nobody granted is claimed"
    );
}

async fn claims_take_only_expired_leases_up_to_the_asked_number(db: TestDb) {
    let s = &db.store;
    let jobs = [job(s, "1").await, job(s, "2").await, job(s, "3").await];
    // Never granted (a submit that died before the grant): claimable at once.
    let first = s.claim_expired("b", LEASE, 2, false, true).await.unwrap();
    assert_eq!(
        first.iter().map(|l| l.job()).collect::<Vec<_>>(),
        vec![jobs[0], jobs[1]],
        "oldest first, at most the asked number"
    );
    let rest = s.claim_expired("c", LEASE, 10, false, true).await.unwrap();
    assert_eq!(
        rest.iter().map(|l| l.job()).collect::<Vec<_>>(),
        vec![jobs[2]]
    );
    // Live leases are not taken, and a broker does not claim its own.
    assert!(
        s.claim_expired("c", LEASE, 10, false, true)
            .await
            .unwrap()
            .is_empty()
    );
    lapse(s, jobs[2]).await;
    assert!(
        s.claim_expired("b", LEASE, 10, false, true)
            .await
            .unwrap()
            .len()
            == 1
    );
    // A broker alone on its database (forced) takes live leases of a previous process.
    let forced = s.claim_expired("d", LEASE, 10, true, true).await.unwrap();
    assert_eq!(forced.len(), 3);
    assert!(forced.iter().all(|l| l.token() == 2 || l.token() == 3));
}

async fn a_released_lease_is_claimable_at_once_and_an_over_job_is_not(db: TestDb) {
    let s = &db.store;
    let running = job(s, "running").await;
    let over = job(s, "over").await;
    let l1 = s.grant_lease(running, "a", LEASE).await.unwrap().unwrap();
    let l2 = s.grant_lease(over, "a", LEASE).await.unwrap().unwrap();
    s.set_job_state(
        Some(&l2),
        over,
        JobState::Cancelled,
        None,
        Timestamp::from_millis(5),
    )
    .await
    .unwrap();
    // a dies while winding the over job down: its lease is claimable (instances to release).
    lapse(s, running).await;
    lapse(s, over).await;
    let claimed = s.claim_expired("b", LEASE, 10, false, true).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let l2b = claimed.iter().find(|l| l.job() == over).copied().unwrap();
    // b releases both (graceful stop of b); only the unfinished one is claimable then.
    assert!(s.release_lease(&l2b).await.unwrap());
    assert!(
        !s.release_lease(&l1).await.unwrap(),
        "a stale lease released a job"
    );
    s.leave("b").await.unwrap();
    let again = s.claim_expired("c", LEASE, 10, false, true).await.unwrap();
    assert_eq!(
        again.iter().map(|l| l.job()).collect::<Vec<_>>(),
        vec![running]
    );
}

async fn live_brokers_are_listed_fewest_jobs_first(db: TestDb) {
    let s = &db.store;
    s.register_broker("a", "http://a", 11).await.unwrap();
    s.register_broker("b", "http://b", 12).await.unwrap();
    s.register_broker("dead", "http://dead", 13).await.unwrap();
    // Its last heartbeat was a minute ago (on the database's clock).
    s.execute_admin("UPDATE brokers SET heartbeat_ms = heartbeat_ms - 60000 WHERE id = 'dead'")
        .await
        .unwrap();
    for name in ["1", "2"] {
        let j = job(s, name).await;
        s.grant_lease(j, "a", LEASE).await.unwrap().unwrap();
    }
    let j = job(s, "3").await;
    s.grant_lease(j, "b", LEASE).await.unwrap().unwrap();
    let live = s.live_brokers(LEASE).await.unwrap();
    let got: Vec<(&str, i64)> = live.iter().map(|b| (b.id.as_str(), b.jobs)).collect();
    assert_eq!(got, vec![("b", 1), ("a", 2)]);
    assert_eq!(live[1].url, "http://a");
    assert_eq!(live[1].pid, 11);
    // Leaving removes the row.
    s.leave("b").await.unwrap();
    let live = s.live_brokers(LEASE).await.unwrap();
    assert_eq!(live.len(), 1);
}

/// A broker paused inside a transaction (SIGSTOP, a frozen VM, a starved runtime) holds the
/// rows it touched. Other brokers' claims skip such a row rather than wait on it, so every other
/// expired job still moves; and Postgres ends the paused session after
/// `IDLE_IN_TRANSACTION_TIMEOUT`, so the held job moves soon after too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_paused_inside_a_transaction_holds_up_no_takeover_for_long() {
    let db = TestDb::postgres().await;
    let a = &db.store;
    let b = Store::connect(&db.url).await.unwrap();
    a.register_broker("a", "http://a", 1).await.unwrap();
    b.register_broker("b", "http://b", 2).await.unwrap();
    let held = job(a, "held").await;
    let free = job(a, "free").await;
    for j in [held, free] {
        a.grant_lease(j, "a", LEASE).await.unwrap().unwrap();
        lapse(a, j).await;
    }
    // Broker a stops between two statements of a transaction on `held`'s row (as a ledger
    // update does, which takes the row first): its session is left idle in the transaction.
    a.execute_admin(&format!(
        "BEGIN; UPDATE jobs SET lease_token = lease_token WHERE id = {}",
        held.0
    ))
    .await
    .unwrap();

    let claimed = tokio::time::timeout(
        IDLE_IN_TRANSACTION_TIMEOUT / 2,
        b.claim_expired("b", LEASE, 10, false, true),
    )
    .await
    .expect("the claim waited on the row the paused broker holds")
    .unwrap();
    assert_eq!(
        claimed.iter().map(|l| l.job()).collect::<Vec<_>>(),
        vec![free]
    );

    let paused = Instant::now();
    let bound = IDLE_IN_TRANSACTION_TIMEOUT + Duration::from_secs(10);
    loop {
        let claimed = b.claim_expired("b", LEASE, 10, false, true).await.unwrap();
        if let Some(lease) = claimed.first() {
            assert_eq!((lease.job(), claimed.len()), (held, 1));
            break;
        }
        assert!(
            paused.elapsed() < bound,
            "the paused broker's transaction still holds job {held:?} after {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    b.close().await;
}
