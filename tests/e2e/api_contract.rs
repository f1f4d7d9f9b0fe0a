//! The OpenAPI document is what the server does: schemathesis (pinned, every check, seed 3, 30
//! examples per operation, every phase) against a real broker on Postgres finds nothing.
//!
//! Needs the schemathesis virtualenv: `scripts/test` builds it (`tests/schemathesis/venv`,
//! cached under `$PROTEUS_CACHE_DIR`) and exports `PROTEUS_TEST_SCHEMATHESIS_VENV`.
//! `scripts/api-contract` runs the same by hand, with other seeds.

use proteus_e2e::{BrokerProcess, TOKEN, fresh_pg_database, wait_bounded};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_with_every_check_finds_nothing_the_document_does_not_say() {
    let venv = std::env::var("PROTEUS_TEST_SCHEMATHESIS_VENV").expect(
        "no schemathesis virtualenv: run the suite through scripts/test (it installs \
         schemathesis once, under $PROTEUS_CACHE_DIR)",
    );
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    // No local agents: the jobs schemathesis submits are planned and billed, not trained.
    let broker = BrokerProcess::start_sim(dir.path(), &db, "1", &["--local-agents", "false"]).await;
    let scratch = dir.path().join("schemathesis");
    std::fs::create_dir_all(&scratch).unwrap();
    let out_path = scratch.join("output.txt");
    let out = std::fs::File::create(&out_path).unwrap();
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemathesis/run");
    let child = Command::new(run)
        .args([venv.as_str(), broker.url.as_str(), TOKEN])
        .current_dir(&scratch)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("run tests/schemathesis/run");
    let (code, _) = wait_bounded(child, Duration::from_secs(600), "schemathesis");
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    assert_eq!(
        code,
        0,
        "schemathesis found what the document does not say:\n{output}\n--- broker log ---\n{}",
        broker.log_text()
    );
    // It ran: every operation tested, cases generated and passed (not a run that tested nothing).
    assert!(
        output.contains("passed") && !output.contains("Tested: 0"),
        "{output}"
    );
}
