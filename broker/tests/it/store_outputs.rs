//! Program output tails in the database (`store::outputs`), on both backends: concurrent sends
//! of one instance all succeed and one of them is kept whole, each job reads only its own, and
//! a stale owner's write is refused.

use crate::on_both_backends;
use crate::support::TestDb;
use proteus_broker::market::Timestamp;
use proteus_broker::store::{NewJob, Store, StoreError};
use proteus_wire::JobId;
use std::sync::Arc;

on_both_backends!(
    concurrent_output_writes_of_one_instance_all_succeed_and_one_is_kept_whole,
    a_stale_owners_output_is_refused_and_each_job_reads_its_own,
);

const LEASE: i64 = 10_000;

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

async fn concurrent_output_writes_of_one_instance_all_succeed_and_one_is_kept_whole(db: TestDb) {
    let s = Arc::new(db.store.clone());
    let j = job(&s, "out").await;
    let lease = s.grant_lease(j, "a", LEASE).await.unwrap().unwrap();
    for round in 0..3 {
        let texts: Vec<String> = (0..30)
            .map(|i| format!("round {round} writer {i:02}\n").repeat(400 + i))
            .collect();
        let writes: Vec<_> = texts
            .iter()
            .cloned()
            .map(|text| {
                let s = s.clone();
                tokio::spawn(async move { s.put_output(Some(&lease), j, "i-0", &text).await })
            })
            .collect();
        for (i, w) in writes.into_iter().enumerate() {
            if let Err(e) = w.await.unwrap() {
                panic!("round {round}: write {i} failed: {e}");
            }
        }
        let outputs = s.outputs_of_job(j).await.unwrap();
        assert_eq!(
            outputs.len(),
            1,
            "{:?}",
            outputs.iter().map(|o| &o.0).collect::<Vec<_>>()
        );
        assert!(
            texts.contains(&outputs[0].1),
            "round {round}: the kept output ({} bytes) is none of the writes whole",
            outputs[0].1.len()
        );
    }
}

async fn a_stale_owners_output_is_refused_and_each_job_reads_its_own(db: TestDb) {
    let s = &db.store;
    let (a, b) = (job(s, "a").await, job(s, "b").await);
    let old = s.grant_lease(a, "x", LEASE).await.unwrap().unwrap();
    s.put_output(Some(&old), a, "i-1", "first\n").await.unwrap();
    s.put_output(None, b, "i-9", "b's\n").await.unwrap();
    // x stalls past its lease; y takes the job over: x's send is refused, y's replaces the tail.
    s.execute_admin(&format!(
        "UPDATE jobs SET lease_expires_ms = 0 WHERE id = {}",
        a.0
    ))
    .await
    .unwrap();
    let new = s.claim_expired("y", LEASE, 10, false, true).await.unwrap();
    let new = new.into_iter().find(|l| l.job() == a).expect("y claims a");
    match s.put_output(Some(&old), a, "i-1", "stale\n").await {
        Err(StoreError::Fenced { job }) => assert_eq!(job, a),
        other => panic!("a stale owner's output was taken: {other:?}"),
    }
    s.put_output(Some(&new), a, "i-2", "second\n")
        .await
        .unwrap();
    assert_eq!(
        s.outputs_of_job(a).await.unwrap(),
        vec![
            ("i-1".to_string(), "first\n".to_string()),
            ("i-2".to_string(), "second\n".to_string())
        ]
    );
    assert_eq!(
        s.outputs_of_job(b).await.unwrap(),
        vec![("i-9".to_string(), "b's\n".to_string())]
    );
}
