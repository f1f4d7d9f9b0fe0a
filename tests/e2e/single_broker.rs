//! The embedded database and a state directory belong to one broker: a second `proteus serve`
//! on either is refused before it writes anything, and the first one's job goes on untouched.

use proteus_e2e::{BrokerProcess, TOKEN, bin, free_port, fresh_pg_database, wait_bounded};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs `proteus serve` with `db` and `state`, which must exit (refused) within 30 s; returns
/// its exit code and stderr. A broker that is not refused is killed and fails the test.
fn second_serve(db: &str, state: &Path) -> (i32, String) {
    let child = Command::new(bin("proteus"))
        .args(["serve", "--cloud", "sim", "--listen"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .arg("--state-dir")
        .arg(state)
        .env("PROTEUS_DATABASE_URL", db)
        .env("PROTEUS_TOKEN", TOKEN)
        .env("PROTEUS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a second proteus serve");
    let what = format!("a second broker on {db} / {}", state.display());
    wait_bounded(child, Duration::from_secs(30), &what)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_the_embedded_database_or_state_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db_file = dir.path().join("proteus.db");
    let db = format!("sqlite://{}", db_file.display());
    let mut first = BrokerProcess::start_sim(dir.path(), &db, "300", &[]).await;
    let pid = first.child.as_ref().expect("running").id();
    let spec = "name = \"one-broker\"\napp = \"mlr\"\ndataset = \"digits\"\npolicy = \"standard-bidding\"\n\
         [stop]\nepochs = 30\n[limits]\nmax_instances = 2\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 2.0\n[training]\nseed = 5\n";
    let id = first.submit_file(dir.path(), spec);
    let who = format!("PID {pid}, listening on {}", first.url);

    // The same database and state directory (two brokers with the defaults): refused on the
    // state directory, naming the running broker.
    let (code, err) = second_serve(&db, &first.state_dir);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("another broker is running on state directory"),
        "{err}"
    );
    assert!(err.contains(&who), "{err}");

    // Its own state directory, the same database: refused on the database.
    let (code, err) = second_serve(&db, &dir.path().join("state-2"));
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("another broker is running on database"),
        "{err}"
    );
    assert!(err.contains(&who), "{err}");

    // The same state directory, a new database: refused before the database is even created.
    let other = dir.path().join("other.db");
    let (code, err) = second_serve(&format!("sqlite://{}", other.display()), &first.state_dir);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains(&who), "{err}");
    assert!(!other.exists(), "the refused broker created its database");

    // The first broker's job went on untouched: it completes and is billed.
    let job = first
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(240),
            "the first broker's job",
        )
        .await;
    let cost = first.client().get(&format!("/v1/jobs/{id}/cost")).await;
    assert!(
        cost["total_usd"].as_f64().is_some_and(|c| c > 0.0),
        "{cost}\n{job}"
    );

    // `kill -9` frees the locks (its agents, still running, do not hold them): a broker on the
    // same database and state directory starts.
    first.kill9();
    first.spawn(&[]).await;
    let again = first.client().get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(again["state"], "succeeded", "{again}");

    // The simulated market resumes where the database's history ends (it does not start over
    // at --start): a job submitted after the restart is newer than everything recorded before.
    let time = |v: &serde_json::Value| {
        chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or_default())
            .unwrap_or_else(|e| panic!("an RFC 3339 time, not {v}: {e}"))
    };
    let last_event = first.client().get(&format!("/v1/jobs/{id}/events")).await;
    let last_event = last_event.as_array().unwrap().last().unwrap()["time"].clone();
    let next = first.submit_file(dir.path(), spec);
    let next = first.client().get(&format!("/v1/jobs/{next}")).await;
    assert!(
        time(&next["created"]) > time(&again["finished"])
            && time(&next["created"]) > time(&last_event),
        "a job submitted after the restart was created at {}, before the first job's end \
         ({}) or last event ({last_event})",
        next["created"],
        again["finished"]
    );
}

/// The simulated cloud lives inside one broker, so on it a Postgres database stays one
/// broker's (brokers share a database on EC2: `failover.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sim_broker_on_one_postgres_database_is_refused_until_the_first_dies() {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let mut first = BrokerProcess::start_sim(dir.path(), &db, "300", &[]).await;
    let pid = first.child.as_ref().expect("running").id();

    // Its own state directory, the same Postgres database: refused, naming the running broker.
    let (code, err) = second_serve(&db, &dir.path().join("state-2"));
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("another broker is running on the Postgres database"),
        "{err}"
    );
    assert!(
        err.contains(&format!("proteus serve pid={pid} 127.0.0.1:{}", first.port)),
        "{err}"
    );

    // `kill -9` ends its session and so its lock: the next broker starts (and answers).
    first.kill9();
    first.spawn(&[]).await;
}
