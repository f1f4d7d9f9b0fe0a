//! Several brokers on one Postgres database, sharing one EC2 deployment (LocalStack) with real
//! agents started by the local launcher: the jobs are spread over the brokers, a broker killed
//! with `kill -9` mid-training (again and again, for a bounded time), or paused past its lease
//! and woken up, has its jobs taken over by the others (its agents following them), and at the end every job has finished with no duplicate launch, no leaked
//! instance, a ledger that bills each instance's life once, and the training's result intact.
//!
//! The simulated cloud lives inside one broker process, so brokers can share only a cloud that
//! outlives them: LocalStack's EC2 here, as EC2 in production.

use crate::localstack::{ec2_database, start_ec2_broker_on};
use proteus_e2e::{
    BrokerProcess, broker_id, job_over as over, job_views, localstack_ec2, localstack_instances,
    mlr_job, skewed_clock, start_ec2_broker_with, unique,
};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Short, so that the test's takeovers are quick; the default (10 s) is what `bench/failover`
/// measures.
const LEASE_SECS: f64 = 4.0;
const BROKERS: usize = 3;
const JOBS: usize = 6;
/// Kills at most this many times, and only while jobs still train.
const KILLS: usize = 3;

/// Long enough to be killed mid-training a few times (about a minute on two cores).
const EPOCHS: u32 = 60;

/// Every job's view, by id, from whichever broker answers.
async fn views(brokers: &[BrokerProcess], alive: &[bool]) -> BTreeMap<i64, Value> {
    let v = job_views(brokers, alive).await;
    assert!(!v.is_empty(), "no broker answers");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_brokers_share_jobs_and_a_killed_brokers_jobs_move_without_duplicates_or_leaks() {
    let root = tempfile::tempdir().unwrap();
    let deployment = unique("fo");
    let db = ec2_database(root.path()).await;
    let lease = LEASE_SECS.to_string();
    let mut brokers = Vec::new();
    for i in 0..BROKERS {
        let dir = root.path().join(format!("broker-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        brokers.push(start_ec2_broker_on(&dir, &db, &deployment, &["--lease-secs", &lease]).await);
    }
    let mut alive = vec![true; BROKERS];
    // Every job submitted through the first broker: they are spread by the fewest-jobs rule.
    let api = brokers[0].client();
    let mut ids = Vec::new();
    for n in 0..JOBS {
        let v = api
            .post("/v1/jobs", mlr_job(&format!("fo-{n}"), EPOCHS))
            .await;
        ids.push(v["id"].as_i64().unwrap());
    }
    // Broker ids, by URL order, from the jobs' owners once each broker picked its jobs up.
    let deadline = Instant::now() + Duration::from_secs(30);
    let owners = loop {
        let v = views(&brokers, &alive).await;
        let owners: Vec<String> = ids
            .iter()
            .filter_map(|id| v[id]["broker"].as_str().map(str::to_string))
            .collect();
        let mut per: HashMap<&str, usize> = HashMap::new();
        for o in &owners {
            *per.entry(o.as_str()).or_default() += 1;
        }
        if owners.len() == JOBS && per.len() == BROKERS {
            assert!(
                per.values().all(|n| *n == JOBS / BROKERS),
                "spread: {per:?}"
            );
            break owners;
        }
        assert!(
            Instant::now() < deadline,
            "jobs not spread over the brokers: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let broker_ids: Vec<String> = {
        let mut distinct: Vec<String> = owners.clone();
        distinct.sort();
        distinct.dedup();
        distinct
    };
    // Which process is which broker id: each process's state directory names it.
    for b in &brokers {
        assert!(
            broker_ids.contains(&broker_id(b)),
            "{} owns nothing",
            broker_id(b)
        );
    }

    // Any broker answers for any job as its owner does, including what only the owner
    // computes (the stage of its layout, the ETA, the worker ranks): the owner saves them.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut agreed = 0;
        let mut last = Vec::new();
        for id in &ids {
            let mut seen = Vec::new();
            for b in &brokers {
                let v = b.client().get(&format!("/v1/jobs/{id}")).await;
                let ranks: Vec<Value> = v["instances"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i["worker_rank"].clone())
                    .collect();
                seen.push((v["stage"].clone(), v["work"]["eta"].clone(), ranks));
            }
            if !seen[0].0.is_null() && !seen[0].1.is_null() && seen.iter().all(|s| *s == seen[0]) {
                agreed += 1;
            }
            last.push((*id, seen));
        }
        if agreed == JOBS {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the brokers show different stages, ETAs or ranks for a job: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Kill the broker that owns the most jobs still training, wait for its jobs to move, bring
    // it back (it rejoins with no jobs), and again.
    let mut takeovers = Vec::new();
    let mut paused = None;
    let kill_window = Instant::now() + Duration::from_secs(240);
    while takeovers.len() < KILLS && Instant::now() < kill_window {
        let v = views(&brokers, &alive).await;
        let training = |owner: &str| {
            v.values()
                .filter(|j| {
                    !over(j) && j["broker"] == owner && j["progress"].as_f64().unwrap_or(0.0) > 0.0
                })
                .count()
        };
        let Some(victim) = (0..BROKERS)
            .filter(|i| alive[*i] && training(&broker_id(&brokers[*i])) > 0)
            .max_by_key(|i| training(&broker_id(&brokers[*i])))
        else {
            // Nothing trains yet (agents starting) or any more: look again, within the window.
            if v.values().all(over) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        let victim_id = broker_id(&brokers[victim]);
        let moved: Vec<i64> = v
            .values()
            .filter(|j| !over(j) && j["broker"] == victim_id.as_str())
            .map(|j| j["id"].as_i64().unwrap())
            .collect();
        // The second time, the broker is paused (SIGSTOP) instead: it wakes up after its jobs
        // moved, still believing it owns them, and must not act on them.
        let pause = takeovers.len() == 1;
        let pid = brokers[victim].child.as_ref().map(|c| c.id()).unwrap() as i32;
        if pause {
            // SAFETY: signalling a process this test started.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
        } else {
            brokers[victim].kill9();
        }
        alive[victim] = false;
        let killed = Instant::now();
        let deadline = killed + Duration::from_secs(60);
        loop {
            let v = views(&brokers, &alive).await;
            let pending: Vec<&i64> = moved
                .iter()
                .filter(|id| !over(&v[id]) && v[id]["broker"] == victim_id.as_str())
                .collect();
            if pending.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "jobs {pending:?} of the {} broker {victim_id} not taken over within 60 s\n{}",
                if pause { "paused" } else { "killed" },
                brokers
                    .iter()
                    .map(|b| b.log_text())
                    .collect::<Vec<_>>()
                    .join("\n----\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        takeovers.push(killed.elapsed().as_secs_f64());
        if pause {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            paused = Some(victim);
        } else {
            brokers[victim].spawn(&[]).await;
        }
        alive[victim] = true;
    }
    assert!(
        !takeovers.is_empty(),
        "no broker was killed while it had jobs training"
    );
    for t in &takeovers {
        assert!(
            *t < LEASE_SECS + 10.0,
            "a takeover took {t:.1} s with a {LEASE_SECS} s lease: {takeovers:?}"
        );
    }

    // Every job finishes, with the training's result intact through the moves.
    let deadline = Instant::now() + Duration::from_secs(600);
    let done = loop {
        let v = views(&brokers, &alive).await;
        if ids
            .iter()
            .all(|id| over(&v[id]) && v[id]["broker"].is_null())
        {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "jobs not finished and released: {:?}\n{}",
            ids.iter()
                .map(|id| (id, &v[id]["state"], &v[id]["progress"], &v[id]["broker"]))
                .collect::<Vec<_>>(),
            brokers
                .iter()
                .map(|b| b.log_text())
                .collect::<Vec<_>>()
                .join("\n----\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    for id in &ids {
        let j = &done[id];
        assert_eq!(j["state"], "succeeded", "{j}");
        let accuracy = j["metric"]["value"].as_f64().unwrap_or(0.0);
        assert!(accuracy > 0.8, "job {id} lost training on the way: {j}");
    }

    // The cloud and the store agree: nothing runs, no intent was launched twice, every record
    // with a cloud id names an instance the cloud has under the same tag.
    let ec2 = localstack_ec2().await;
    let seen = localstack_instances(&ec2, &deployment).await;
    let running: Vec<_> = seen
        .iter()
        .filter(|s| s.state == "running" || s.state == "pending")
        .collect();
    assert!(running.is_empty(), "leaked instances: {running:?}");
    let mut launches: HashMap<&str, usize> = HashMap::new();
    for s in &seen {
        *launches.entry(s.proteus_id.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = launches.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "launched more than once: {twice:?}");
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    type Row = (
        String,
        i64,
        Option<String>,
        String,
        Option<i64>,
        Option<i64>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, job_id, cloud_id, state, launched_ms, ended_ms FROM instances ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(!rows.is_empty());
    for (id, _, cloud_id, state, _, _) in &rows {
        assert!(
            state == "terminated" || state == "failed",
            "{id} still {state} after every job ended"
        );
        if let Some(c) = cloud_id {
            assert!(
                seen.iter().any(|s| &s.cloud_id == c && &s.proteus_id == id),
                "{id} records {c}, which the cloud does not have under its tag"
            );
        }
    }
    // Each ledger line bills part of one instance's life; an instance's lines do not overlap.
    let lines: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT instance_id, start_ms, end_ms FROM ledger_lines ORDER BY instance_id, start_ms",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let life: HashMap<&str, (Option<i64>, Option<i64>)> = rows
        .iter()
        .map(|(id, _, _, _, l, e)| (id.as_str(), (*l, *e)))
        .collect();
    for w in lines.windows(2) {
        if w[0].0 == w[1].0 {
            assert!(w[0].2 <= w[1].1, "overlapping ledger lines: {w:?}");
        }
    }
    for (instance, start, end) in &lines {
        let (launched, ended) = life[instance.as_str()];
        assert!(start < end, "{instance}: a line ends before it starts");
        assert!(
            launched.is_some_and(|l| *start >= l) && ended.is_some_and(|e| *end <= e),
            "{instance}: line {start}..{end} outside its life {launched:?}..{ended:?}"
        );
    }
    // Each job's spend is its ledger's total, and the moves are in its history.
    let api = brokers[0].client();
    let mut taken_over = 0;
    for id in &ids {
        let cost = api.get(&format!("/v1/jobs/{id}/cost")).await;
        let total: f64 = sqlx::query_scalar::<_, f64>(
            "SELECT COALESCE(SUM(amount_usd), 0) FROM ledger_lines WHERE job_id = $1",
        )
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            (cost["total_usd"].as_f64().unwrap() - total).abs() < 1e-6,
            "job {id}: {cost} vs ledger {total}"
        );
        let events = api.get(&format!("/v1/jobs/{id}/events")).await;
        let events = events.as_array().unwrap();
        taken_over += events
            .iter()
            .filter(|e| e["kind"] == "broker_takeover")
            .count();
        // The agents followed their job to its new broker: none was given up as lost.
        let lost: Vec<_> = events
            .iter()
            .filter(|e| e["kind"] == "agent_lost")
            .collect();
        assert!(
            lost.is_empty(),
            "job {id}: agents lost in a move: {lost:?}\ntakeovers (s): {takeovers:?}\n{}",
            brokers
                .iter()
                .map(|b| b.log_text())
                .collect::<Vec<_>>()
                .join("\n----\n")
        );
    }
    assert!(
        taken_over >= takeovers.len(),
        "{taken_over} takeovers recorded"
    );
    // The paused broker found out, on waking, that its jobs had moved, and let them go.
    if let Some(p) = paused {
        let log = brokers[p].log_text();
        assert!(
            log.contains("lost the lease on a job to another broker")
                || log.contains("another broker took the job over"),
            "the paused broker did not notice its jobs moved:\n{log}"
        );
    }
    eprintln!("takeovers (s): {takeovers:?}");
}

/// A broker dies between launching an instance and recording it (and, separately, between
/// recording the intent and launching): the other broker takes the job over, finds the
/// instance by its tag (or launches the intent, once), and the job runs with no orphan and no
/// twin in the cloud.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_dying_mid_launch_leaves_no_orphan_after_another_takes_its_job_over() {
    for failpoint in ["launch-after-cloud", "launch-after-intent"] {
        let root = tempfile::tempdir().unwrap();
        let deployment = unique("fo-launch");
        let db = ec2_database(root.path()).await;
        let lease = LEASE_SECS.to_string();
        let (dir_a, dir_b) = (root.path().join("a"), root.path().join("b"));
        std::fs::create_dir_all(&dir_a).unwrap();
        std::fs::create_dir_all(&dir_b).unwrap();
        let mut a = start_ec2_broker_on(&dir_a, &db, &deployment, &["--lease-secs", &lease]).await;
        a.kill9();
        a.spawn(&[("PROTEUS_FAILPOINTS", failpoint)]).await;
        let b = start_ec2_broker_on(&dir_b, &db, &deployment, &["--lease-secs", &lease]).await;
        // Both have no job: the one submitted to takes it, and dies launching for it.
        let (status, answer) = a
            .client()
            .call(
                reqwest::Method::POST,
                "/v1/jobs",
                Some(mlr_job("mid-launch", EPOCHS)),
            )
            .await;
        assert!(
            status == 201 || status == 0,
            "POST /v1/jobs: {status} {answer}"
        );
        let exit = a.wait_exit(Duration::from_secs(30)).await;
        assert_eq!(
            exit.and_then(|s| s.code()),
            Some(137),
            "{failpoint}: {}",
            a.log_text()
        );
        let api = b.client();
        let jobs = api.get("/v1/jobs").await;
        let id = jobs[0]["id"].as_i64().unwrap();
        let path = format!("/v1/jobs/{id}");
        let running = |v: &Value| {
            v["instances"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|i| i["state"] == "running")
                .count()
        };
        let view = api
            .wait_for(
                &path,
                Duration::from_secs(60),
                "the other broker to run the job on 2 instances",
                |v| {
                    v["broker"].is_string() && running(v) == 2 && v["progress"].as_f64() > Some(0.0)
                },
            )
            .await;
        assert_ne!(
            view["broker"].as_str(),
            std::fs::read_to_string(a.state_dir.join("broker-id"))
                .ok()
                .as_deref()
                .map(str::trim),
            "{view}"
        );
        // A few ticks more: a twin would show up as an extra instance.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let ec2 = localstack_ec2().await;
        let seen = localstack_instances(&ec2, &deployment).await;
        let alive: Vec<_> = seen.iter().filter(|s| s.state != "terminated").collect();
        assert_eq!(
            alive.len(),
            2,
            "{failpoint}: one cloud instance per intent: {seen:?}"
        );
        let view = api.get(&path).await;
        for s in &alive {
            assert!(
                view["instances"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|i| i["cloud_id"] == s.cloud_id.as_str()
                        && i["id"] == s.proteus_id.as_str()),
                "{failpoint}: {} runs without a record: {view}",
                s.cloud_id
            );
        }
        // The dead broker comes back (it owns nothing now) and is asked to cancel the job: it
        // records the cancel, and the owner releases the instances.
        a.spawn(&[]).await;
        let cancelled = a.client().cancel(id).await;
        assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
        api.wait_for(
            &path,
            Duration::from_secs(60),
            "the cancelled job's release",
            |v| v["broker"].is_null(),
        )
        .await;
        let seen = localstack_instances(&ec2, &deployment).await;
        let still: Vec<_> = seen
            .iter()
            .filter(|s| s.state == "running" || s.state == "pending")
            .collect();
        assert!(
            still.is_empty(),
            "{failpoint}: not released after the cancel: {still:?}"
        );
    }
}

/// Waits (polling, up to `within`) until `done` holds; the failure names `what`.
async fn until(within: Duration, what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A broker stops (SIGSTOP, as a frozen VM or a long pause) between recording a launch's
/// intent and calling the cloud. The other broker takes the job over and launches that intent
/// itself. Woken afterwards, the first broker must not launch: its lease went unrenewed past its
/// local deadline, so it asks the cloud for nothing, and then learns that the job moved.
/// LocalStack ignores EC2's ClientToken, so a launch from the woken broker would show as a twin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_paused_mid_launch_and_woken_after_the_takeover_launches_no_twin() {
    let root = tempfile::tempdir().unwrap();
    let deployment = unique("fo-pause");
    let db = ec2_database(root.path()).await;
    let lease = LEASE_SECS.to_string();
    let (dir_a, dir_b) = (root.path().join("a"), root.path().join("b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let mut a = start_ec2_broker_on(&dir_a, &db, &deployment, &["--lease-secs", &lease]).await;
    a.kill9();
    a.spawn(&[("PROTEUS_FAILPOINTS", "launch-after-intent=stop")])
        .await;
    let mut b = start_ec2_broker_on(&dir_b, &db, &deployment, &["--lease-secs", &lease]).await;
    // Both have no job: the one submitted to takes it, and stops launching for it (maybe before
    // it answers the submit: the answer is awaited once it is woken).
    let client = a.client();
    let submit = tokio::spawn(async move {
        client
            .call(
                reqwest::Method::POST,
                "/v1/jobs",
                Some(mlr_job("paused-launch", EPOCHS)),
            )
            .await
    });
    until(
        Duration::from_secs(30),
        "the broker to stop at the failpoint",
        async || a.is_stopped(),
    )
    .await;
    let api = b.client();
    let id = loop {
        if let Some(id) = api.get("/v1/jobs").await[0]["id"].as_i64() {
            break id;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let path = format!("/v1/jobs/{id}");
    let a_id = broker_id(&a);
    let running = |v: &Value| {
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["state"] == "running")
            .count()
    };
    api.wait_for(
        &path,
        Duration::from_secs(60),
        "the other broker to run the job on 2 instances",
        |v| {
            v["broker"].is_string()
                && v["broker"] != a_id.as_str()
                && running(v) == 2
                && v["progress"].as_f64() > Some(0.0)
        },
    )
    .await;

    // Woken, it finds its lease lapsed (or, had its keeper run first, lost) and drops the job.
    // SAFETY: signalling a process this test started.
    unsafe { libc::kill(a.pid(), libc::SIGCONT) };
    until(
        Duration::from_secs(30),
        "the woken broker to let the job go",
        async || {
            let log = a.log_text();
            log.contains("lost the lease on a job to another broker")
                || log.contains("another broker took the job over")
        },
    )
    .await;
    let (status, answer) = submit.await.unwrap();
    assert!(
        status == 201 || status == 0,
        "POST /v1/jobs: {status} {answer}"
    );
    assert_eq!(
        a.metric("proteus_launches_total").await,
        0.0,
        "the woken broker launched:\n{}",
        a.log_text()
    );
    let ec2 = localstack_ec2().await;
    let seen = localstack_instances(&ec2, &deployment).await;
    let alive: Vec<_> = seen.iter().filter(|s| s.state != "terminated").collect();
    let view = api.get(&path).await;
    assert_eq!(
        alive.len(),
        2,
        "one cloud instance per intent: {seen:?}\n{view}"
    );
    for s in &alive {
        assert!(
            view["instances"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["cloud_id"] == s.cloud_id.as_str() && i["id"] == s.proteus_id.as_str()),
            "{} runs without a record: {view}",
            s.cloud_id
        );
    }
    let cancelled = api.cancel(id).await;
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    api.wait_for(
        &path,
        Duration::from_secs(60),
        "the cancelled job's release",
        |v| v["broker"].is_null(),
    )
    .await;
    a.kill9();
    b.kill9();
}

/// Three brokers whose wall clocks disagree by two minutes (one a minute fast, one a minute
/// slow, through libfaketime) share jobs. Lease expiry is the database's to judge, so the fast
/// one takes no live job, and when brokers die the slow one takes their jobs over as quickly as
/// a broker with the right time would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_whose_clocks_are_a_minute_off_take_over_only_expired_leases_and_in_time() {
    let root = tempfile::tempdir().unwrap();
    let began_ms = chrono::Utc::now().timestamp_millis();
    let deployment = unique("fo-skew");
    let db = ec2_database(root.path()).await;
    let lease = LEASE_SECS.to_string();
    let mut brokers = Vec::new();
    for (i, skew) in ["+0s", "+60s", "-60s"].into_iter().enumerate() {
        let dir = root.path().join(format!("broker-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let env = skewed_clock(skew);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        brokers.push(
            start_ec2_broker_with(&dir, &db, &deployment, &["--lease-secs", &lease], &env).await,
        );
    }
    let (right, fast, slow) = (0, 1, 2);
    let mut alive = vec![true; 3];
    let api = brokers[right].client();
    let mut ids = Vec::new();
    for n in 0..3 {
        let v = api
            .post("/v1/jobs", mlr_job(&format!("skew-{n}"), 4 * EPOCHS))
            .await;
        ids.push(v["id"].as_i64().unwrap());
    }
    // Spread one each, and training.
    let deadline = Instant::now() + Duration::from_secs(60);
    let owners: HashMap<i64, String> = loop {
        let v = views(&brokers, &alive).await;
        let owners: HashMap<i64, String> = ids
            .iter()
            .filter_map(|id| Some((*id, v[id]["broker"].as_str()?.to_string())))
            .collect();
        let distinct: std::collections::HashSet<&String> = owners.values().collect();
        if distinct.len() == 3 && ids.iter().all(|id| v[id]["progress"].as_f64() > Some(0.0)) {
            break owners;
        }
        assert!(
            Instant::now() < deadline,
            "jobs not spread and training: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // Every broker stamps on the database's clock, whatever its machine's says: each instance's
    // request time, written by its job's owner, lies between this test's start and now (a
    // minute off otherwise, and a job taken over by the slow broker billed a minute less).
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let stamps: Vec<(String, i64)> = sqlx::query_as("SELECT id, requested_ms FROM instances")
        .fetch_all(&pool)
        .await
        .unwrap();
    let now_ms = chrono::Utc::now().timestamp_millis();
    assert!(!stamps.is_empty());
    for (id, t) in &stamps {
        assert!(
            (began_ms - 2_000..=now_ms + 2_000).contains(t),
            "instance {id} stamped {} s from the true time",
            if *t > now_ms {
                t - now_ms
            } else {
                t - began_ms
            } as f64
                / 1000.0
        );
    }
    pool.close().await;
    // Every broker claims at each tick: over ten ticks of each (a few lease periods), no job
    // moves while its owner lives. (A claim judged on the fast broker's clock would take every
    // lease within its first tick: each looks a minute expired to it.)
    let mut start = Vec::new();
    for b in &brokers {
        start.push(b.metric("proteus_scheduler_ticks_total").await);
    }
    for (i, b) in brokers.iter().enumerate() {
        until(
            Duration::from_secs(60),
            "ten ticks of each broker",
            async || b.metric("proteus_scheduler_ticks_total").await >= start[i] + 10.0,
        )
        .await;
    }
    let v = views(&brokers, &alive).await;
    for id in &ids {
        assert!(
            over(&v[id]) || v[id]["broker"] == owners[id].as_str(),
            "job {id} moved from its live owner {}: {}\n{}",
            owners[id],
            v[id],
            brokers[fast].log_text()
        );
    }
    // The right and the fast broker die: the slow one takes their jobs within the same bound
    // as the failover test's (lease + 10 s), not a minute later.
    let slow_id = broker_id(&brokers[slow]);
    for victim in [fast, right] {
        let victim_id = broker_id(&brokers[victim]);
        brokers[victim].kill9();
        alive[victim] = false;
        let killed = Instant::now();
        let bound = Duration::from_secs_f64(LEASE_SECS + 10.0);
        loop {
            let v = views(&brokers, &alive).await;
            let pending: Vec<&i64> = ids
                .iter()
                .filter(|id| !over(&v[id]) && v[id]["broker"] == victim_id.as_str())
                .collect();
            if pending.is_empty() {
                break;
            }
            assert!(
                killed.elapsed() < bound,
                "jobs {pending:?} not taken over within {bound:?} by the broker whose clock is \
                 a minute slow\n{}",
                brokers[slow].log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let v = views(&brokers, &alive).await;
    for id in &ids {
        assert!(
            over(&v[id]) || v[id]["broker"] == slow_id.as_str(),
            "job {id}: {}",
            v[id]
        );
    }
    // Released, so that no instance outlives the test.
    for id in &ids {
        let path = format!("/v1/jobs/{id}");
        let _ = brokers[slow]
            .client()
            .call(reqwest::Method::POST, &format!("{path}/cancel"), None)
            .await;
        brokers[slow]
            .client()
            .wait_for(&path, Duration::from_secs(60), "the job's release", |v| {
                v["broker"].is_null()
            })
            .await;
    }
}

/// The step a run of `examples/command/train.py` resumed from (its `start … resumed_from=N`).
fn resumed_from(tail: &str) -> Option<u64> {
    tail.lines()
        .filter_map(|l| l.split("resumed_from=").nth(1))
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .next_back()
}

/// Two brokers on one database with LocalStack's EC2 and S3. The broker that runs a command job
/// dies (`kill -9`); the other takes the job over; the job's instance then ends, and the
/// replacement the new owner launches restores the program's checkpoint from the store both
/// brokers share (nothing of it was on the dead broker's disk). The output of both instances —
/// the first one's sent to the dead broker — is readable through either broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_takeover_a_command_jobs_replacement_finds_its_checkpoint_and_any_broker_shows_every_output()
 {
    let root = tempfile::tempdir().unwrap();
    let deployment = unique("fo-cmd");
    let db = ec2_database(root.path()).await;
    let lease = LEASE_SECS.to_string();
    let mut brokers = Vec::new();
    for name in ["a", "b"] {
        let dir = root.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        brokers.push(start_ec2_broker_on(&dir, &db, &deployment, &["--lease-secs", &lease]).await);
    }
    let spec = serde_json::json!({
        "name": "command-takeover",
        "app": "command",
        "policy": "bidbrain",
        "limits": {"max_instances": 1, "max_reliable_instances": 1},
        "work": {"total_work": 1.0, "instance_types": ["c5.large"], "startup_minutes": 0.0},
        "command": {
            "run": ["python3", proteus_e2e::example_program("train.py")],
            "checkpoint_interval_secs": 1,
            "env": {"STEPS": "400", "STEP_SECS": "0.2", "CHECKPOINT_EVERY": "5"}
        }
    });
    let id = brokers[0].client().post("/v1/jobs", spec).await["id"]
        .as_i64()
        .unwrap();
    let path = format!("/v1/jobs/{id}");
    // Past a few checkpoints, on its first instance.
    let view = brokers[0]
        .client()
        .wait_for(
            &path,
            Duration::from_secs(180),
            "the program past its checkpoints",
            |v| v["progress"].as_f64().unwrap_or(0.0) >= 20.0 / 400.0,
        )
        .await;
    let owner = view["broker"].as_str().unwrap().to_string();
    let (dead, alive) = if broker_id(&brokers[0]) == owner {
        (0, 1)
    } else {
        (1, 0)
    };
    let first = view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["state"] == "running")
        .expect("a running instance")
        .clone();
    brokers[dead].kill9();
    let survivor = brokers[alive].client();
    let survivor_id = broker_id(&brokers[alive]);
    survivor
        .wait_for(
            &path,
            Duration::from_secs(60),
            "the other broker to take the job over",
            |v| v["broker"] == survivor_id.as_str(),
        )
        .await;
    // The job's instance ends; the new owner replaces it.
    let ec2 = localstack_ec2().await;
    ec2.terminate_instances()
        .instance_ids(first["cloud_id"].as_str().unwrap())
        .send()
        .await
        .expect("TerminateInstances on LocalStack");
    let deadline = Instant::now() + Duration::from_secs(240);
    let (replacement, from) = loop {
        let t = crate::command::logs(&brokers[alive], id).await;
        if let Some((i, tail)) = t
            .iter()
            .find(|(i, tail)| *i != first["id"].as_str().unwrap() && tail.contains("resumed_from="))
        {
            break (i.clone(), resumed_from(tail).unwrap_or(0));
        }
        assert!(
            Instant::now() < deadline,
            "no replacement ran the program within 240 s: {t:?}\n{}",
            brokers[alive].log_text()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let first_tail = crate::command::logs(&brokers[alive], id)
        .await
        .into_iter()
        .find(|(i, _)| i == first["id"].as_str().unwrap())
        .map(|(_, t)| t)
        .unwrap_or_else(|| panic!("the first instance's output is not shown by the survivor"));
    assert!(
        from >= 5,
        "the replacement {replacement} started from step {from}, not from the first instance's \
         checkpoint:\n{first_tail}"
    );
    // The dead broker comes back: it shows the same output of the first instance.
    brokers[dead].spawn(&[]).await;
    let again = crate::command::logs(&brokers[dead], id).await;
    assert!(
        again
            .iter()
            .any(|(i, t)| i == first["id"].as_str().unwrap() && *t == first_tail),
        "the restarted broker shows other output: {again:?}"
    );
    assert!(again.iter().any(|(i, _)| *i == replacement), "{again:?}");
    let _ = survivor
        .call(reqwest::Method::POST, &format!("{path}/cancel"), None)
        .await;
    survivor
        .wait_for(&path, Duration::from_secs(60), "the job's release", |v| {
            v["broker"].is_null()
        })
        .await;
}
