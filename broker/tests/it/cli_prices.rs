//! `proteus prices …` through the real binary, as a user runs it.

use crate::on_both_backends;
use crate::support::{ON_DEMAND_2015, TRACE_2015, TestDb, data};
use std::io::Write;
use std::process::{Command, Output};

on_both_backends!(
    a_missing_file_states_its_cause_once,
    a_bad_row_refuses_the_whole_file_and_names_its_line,
    stats_prints_every_market_as_json,
    aws_cli_json_is_ingested,
    an_ingest_killed_mid_write_leaves_no_row_of_the_file,
);

fn proteus(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(args)
        .env("PROTEUS_DATABASE_URL", &db.url)
        .env("PROTEUS_LOG", "warn")
        .output()
        .expect("run proteus")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write_csv(
    dir: &std::path::Path,
    name: &str,
    rows: usize,
    bad_at: Option<(usize, &str)>,
) -> String {
    let path = dir.join(name);
    let mut f = std::fs::File::create(&path).unwrap();
    writeln!(
        f,
        "timestamp,availability_zone,instance_type,product_description,spot_price"
    )
    .unwrap();
    for i in 0..rows {
        // data line i is file line i + 2
        match bad_at {
            Some((line, text)) if line == i + 2 => writeln!(f, "{text}").unwrap(),
            _ => writeln!(
                f,
                "2016-01-01T00:{:02}:{:02}Z,us-east-1a,c4.large,Linux/UNIX,0.0{}",
                i / 60,
                i % 60,
                i % 10 + 1
            )
            .unwrap(),
        }
    }
    path.display().to_string()
}

async fn a_missing_file_states_its_cause_once(db: TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.csv").display().to_string();
    let out = proteus(&db, &["prices", "ingest", "--file", &missing]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains(&format!("{missing}: cannot read")), "{err}");
    assert_eq!(
        err.matches("No such file or directory").count(),
        1,
        "the cause once: {err}"
    );
    assert_eq!(db.store.price_row_count().await.unwrap(), 0);
}

async fn an_ingest_killed_mid_write_leaves_no_row_of_the_file(db: TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let good = write_csv(dir.path(), "good.csv", 100, None);
    assert!(
        proteus(&db, &["prices", "ingest", "--file", &good])
            .status
            .success()
    );
    // 3000 rows: on SQLite the point is reached after the first of three batches.
    let big = dir.path().join("big.csv");
    let mut f = std::fs::File::create(&big).unwrap();
    writeln!(
        f,
        "timestamp,availability_zone,instance_type,product_description,spot_price"
    )
    .unwrap();
    for i in 0..3000 {
        writeln!(
            f,
            "2016-03-{:02}T{:02}:{:02}:00Z,us-east-1b,m4.large,Linux/UNIX,0.0{}",
            1 + i / 1440,
            i / 60 % 24,
            i % 60,
            i % 9 + 1
        )
        .unwrap();
    }
    drop(f);
    let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(["prices", "ingest", "--file", &big.display().to_string()])
        .env("PROTEUS_DATABASE_URL", &db.url)
        .env("PROTEUS_LOG", "warn")
        .env("PROTEUS_FAILPOINTS", "ingest-mid-write")
        .output()
        .expect("run proteus");
    assert_eq!(out.status.code(), Some(137), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("failpoint `ingest-mid-write` reached"),
        "the point was reached: {}",
        stderr(&out)
    );
    assert_eq!(
        db.store.price_row_count().await.unwrap(),
        100,
        "no row of the interrupted file is stored"
    );
    let markets = db.store.markets(&Default::default()).await.unwrap();
    assert!(
        markets
            .iter()
            .all(|m| m.market.to_string() != "us-east-1b/m4.large"),
        "nor its market: {markets:?}"
    );
    // The same file, without the failpoint, goes in whole.
    let out = proteus(
        &db,
        &["prices", "ingest", "--file", &big.display().to_string()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.store.price_row_count().await.unwrap(), 3100);
}

async fn a_bad_row_refuses_the_whole_file_and_names_its_line(db: TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let good = write_csv(dir.path(), "good.csv", 100, None);
    let out = proteus(
        &db,
        &["prices", "ingest", "--file", &good, "--output", "json"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.store.price_row_count().await.unwrap(), 100);

    for (bad_text, field) in [
        (
            "2016-02-01T00:00:00Z,us-east-1a,c4.large,Linux/UNIX,-0.5",
            "spot_price",
        ),
        (
            "2016-02-01T00:00:00Z,us-east-1a,c4.large,Linux/UNIX,lots",
            "spot_price",
        ),
        (
            "02/01/2016 00:00,us-east-1a,c4.large,Linux/UNIX,0.5",
            "timestamp",
        ),
        (
            "2016-02-01T00:00:00Z,,c4.large,Linux/UNIX,0.5",
            "availability_zone",
        ),
        (
            "2016-02-01T00:00:00Z,us-east-1a,,Linux/UNIX,0.5",
            "instance_type",
        ),
    ] {
        let bad = write_csv(dir.path(), "bad.csv", 1000, Some((501, bad_text)));
        let out = proteus(&db, &["prices", "ingest", "--file", &bad]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "bad file must fail: {}",
            stdout(&out)
        );
        let err = stderr(&out);
        assert!(
            err.contains(&format!("bad.csv:501: field `{field}`")),
            "message must name line and field: {err}"
        );
        assert_eq!(
            db.store.price_row_count().await.unwrap(),
            100,
            "nothing from the bad file is stored"
        );
    }

    // Line 301 gives 00:04:59 a price; line 501 gives the same market and instant another.
    let twice = write_csv(
        dir.path(),
        "twice.csv",
        1000,
        Some((
            501,
            "2016-01-01T00:04:59Z,us-east-1a,c4.large,Linux/UNIX,0.99",
        )),
    );
    let out = proteus(&db, &["prices", "ingest", "--file", &twice]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("twice.csv:501:") && err.contains("on line 301") && err.contains("$0.9900/h"),
        "the message names both lines and the price: {err}"
    );
    assert_eq!(db.store.price_row_count().await.unwrap(), 100);

    let missing = dir.path().join("nope.csv");
    let out = proteus(
        &db,
        &["prices", "ingest", "--file", &missing.display().to_string()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("nope.csv: cannot read"),
        "{}",
        stderr(&out)
    );
}

async fn stats_prints_every_market_as_json(db: TestDb) {
    let out = proteus(
        &db,
        &[
            "prices",
            "ingest",
            "--file",
            &data(TRACE_2015).display().to_string(),
            "--on-demand",
            &data(ON_DEMAND_2015).display().to_string(),
            "--output",
            "json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let reports: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(reports[1]["inserted"], 156_005);

    let out = proteus(&db, &["prices", "stats", "--output", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stats: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(stats.len(), 15);
    let changes: u64 = stats.iter().map(|s| s["changes"].as_u64().unwrap()).sum();
    assert_eq!(
        changes, 156_005,
        "every stored change falls in the default window"
    );
    for s in &stats {
        assert!(s["on_demand_usd"].as_f64().is_some(), "{s}");
    }

    let out = proteus(
        &db,
        &[
            "prices",
            "stats",
            "--instance-type",
            "c3.xlarge",
            "--az",
            "us-east-1b",
            "--from",
            "2015-04-01",
            "--to",
            "2015-05-01",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert_eq!(
        table.lines().count(),
        3,
        "header, rule and one market:\n{table}"
    );
    assert!(table.contains("us-east-1b/c3.xlarge"));

    let out = proteus(&db, &["prices", "stats", "--from", "last tuesday"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--from"), "{}", stderr(&out));
}

async fn aws_cli_json_is_ingested(db: TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("history.json");
    std::fs::write(
        &path,
        r#"{"SpotPriceHistory": [
  {"AvailabilityZone": "us-east-1a", "InstanceType": "c5.large", "ProductDescription": "Linux/UNIX",
   "SpotPrice": "0.034000", "Timestamp": "2021-05-30T12:00:00+00:00"},
  {"AvailabilityZone": "us-east-1a", "InstanceType": "c5.large", "ProductDescription": "Linux/UNIX",
   "SpotPrice": "0.035000", "Timestamp": "2021-05-30T13:00:00.000Z"}
]}"#,
    )
    .unwrap();
    let p = path.display().to_string();
    let out = proteus(&db, &["prices", "ingest", "--file", &p]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.store.price_row_count().await.unwrap(), 2);
    let out = proteus(&db, &["prices", "ingest", "--file", &p, "--output", "csv"]);
    assert!(out.status.success());
    assert!(
        stdout(&out).contains(",2,0,0,2,"),
        "second ingest reports 2 already present: {}",
        stdout(&out)
    );
}
