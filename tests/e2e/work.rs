//! Cost reports from the work a live job actually received, not from the estimate it was
//! submitted with: a job whose estimate is several times what its training needs.

use proteus_e2e::{BrokerProcess, fresh_pg_database, proteus};
use std::time::Duration;

fn at(v: &serde_json::Value) -> Option<chrono::DateTime<chrono::Utc>> {
    v.as_str().map(|s| {
        chrono::DateTime::parse_from_rfc3339(s)
            .expect("RFC 3339")
            .to_utc()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_prices_the_measured_work_not_the_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(dir.path(), &db, "300", &[]).await;
    // Two on-demand c3.xlarge (1 unit per hour each: the reference type), per-second billing,
    // and an estimate of 20 units for ten epochs of MNIST, which take well under an hour of market
    // time on two instances.
    // Twenty: training needs about 1 unit on an idle machine, and took 4.6 on a first run after
    // a build (cold caches at 300× market speed); a third of the estimate leaves room for both.
    const ESTIMATE: f64 = 20.0;
    const STARTUP_MINUTES: f64 = 5.0;
    let id = broker.submit_file(
        dir.path(),
        &format!(
            "name = \"overestimated\"\napp = \"mlr\"\ndataset = \"mnist\"\npolicy = \"on-demand\"\n\
             billing = \"per-second\"\n[stop]\nepochs = 10\n[limits]\nmax_instances = 2\nmax_reliable_instances = 2\n\
             [work]\ntotal_work = {ESTIMATE}\nreference_type = \"c3.xlarge\"\n\
             instance_types = [\"c3.xlarge\"]\nstartup_minutes = {STARTUP_MINUTES}\n\
             [training]\nseed = 5\n"
        ),
    );
    let env = broker.user_env();
    broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(240),
            "the job to finish",
        )
        .await;

    // The work, computed here from the instances' working intervals: ready → warned or ended,
    // at 1 unit per hour (every instance is the reference type, all reliable: stage 1).
    // The cloud reports the terminations the job's end asked for a moment later.
    let job = broker
        .client()
        .wait_for(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(30),
            "every instance to be ended",
            |j| {
                j["instances"]
                    .as_array()
                    .is_some_and(|is| is.iter().all(|i| !i["ended"].is_null()))
            },
        )
        .await;
    assert_eq!(job["state"], "succeeded");
    // Work stops with the job: instances still shutting down after it finished do none.
    let finished = at(&job["finished"]).expect("a finished job has a finish time");
    let instances = job["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 2, "{job}");
    let mut work = 0.0;
    for i in instances {
        let ready = at(&i["ready"]).unwrap_or_else(|| panic!("never ready: {i}"));
        let ended = at(&i["ended"]).unwrap_or_else(|| panic!("not ended: {i}"));
        let stop = at(&i["warned"])
            .map_or(ended, |w| w.min(ended))
            .min(finished);
        work += (stop - ready).num_milliseconds() as f64 / 3_600_000.0;
    }
    assert!(
        work > 0.0 && work < ESTIMATE / 3.0,
        "the premise: the estimate ({ESTIMATE}) is far above the work training needed ({work})"
    );

    let (code, out, err) = proteus(None, &["report", &id.to_string(), "--output", "json"], &env);
    assert_eq!(code, 0, "{err}");
    let cost: serde_json::Value = serde_json::from_str(&out).unwrap();
    let measured = cost["work_units"].as_f64().unwrap();
    // The API shows times to the second; the broker counts milliseconds.
    let rounding = instances.len() as f64 * 2.0 / 3600.0;
    assert!(
        (measured - work).abs() <= rounding,
        "report {measured} vs intervals {work}: {cost}"
    );
    assert_eq!(cost["pacing"], "measured", "{cost}");
    assert!(
        (cost["estimated_work_units"].as_f64().unwrap() - ESTIMATE).abs() < 1e-9,
        "a finished job's estimate is the submitted one: {cost}"
    );
    assert!(
        cost["work_note"]
            .as_str()
            .is_some_and(|n| n.contains("estimate")),
        "a 20%+ disagreement is called out: {cost}"
    );

    // On-demand doing that work, by hand: two c3.xlarge at $0.21/h from the job's start, ready
    // after start-up, paused 10 s while AgileML splits the input between them (the job's
    // default rebalance time), then 2 units per hour; per-second billing of both.
    let hours = STARTUP_MINUTES / 60.0 + 10.0 / 3600.0 + measured / 2.0;
    let by_hand = 2.0 * 0.21 * hours;
    let on_demand = cost["counterfactuals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["policy"] == "on-demand")
        .unwrap_or_else(|| panic!("no on-demand counterfactual: {cost}"));
    let cf = on_demand["cost_usd"].as_f64().unwrap();
    assert!(
        (cf - by_hand).abs() < 1e-4,
        "on-demand counterfactual ${cf} vs ${by_hand} by hand for {measured} units: {cost}"
    );
    let savings = cost["savings"]["on-demand"].as_f64().unwrap();
    let total = cost["total_usd"].as_f64().unwrap();
    assert!((savings - (1.0 - total / cf)).abs() < 1e-9, "{cost}");

    // The plan learned: the total was re-estimated from the measured rate, and said so.
    let events = broker.client().get(&format!("/v1/jobs/{id}/events")).await;
    let reestimates: Vec<&serde_json::Value> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "work_reestimated")
        .collect();
    assert!(!reestimates.is_empty(), "no re-estimate event: {events}");
    let expected = job["work"]["expected_units"].as_f64().unwrap();
    assert!(
        expected < ESTIMATE / 3.0
            && (expected - job["work"]["done_units"].as_f64().unwrap()).abs() < 0.05 * expected,
        "at completion the re-estimate is the work done: {job}"
    );
    let (code, table, _) = proteus(None, &["report", &id.to_string()], &env);
    assert_eq!(code, 0);
    assert!(
        table.contains("note:") && table.contains("units received"),
        "{table}"
    );

    // Machine output: CSV columns are named after the JSON's fields (dotted paths into it) and
    // hold the same values as plain numbers; the text says which clock and that the cost is
    // final.
    let id_text = id.to_string();
    for (args, json_args) in [
        (
            vec!["status", id_text.as_str(), "--output", "csv"],
            vec!["status", id_text.as_str(), "--output", "json"],
        ),
        (
            vec!["report", "--all", "--output", "csv"],
            vec!["report", "--all", "--output", "json"],
        ),
    ] {
        let (code, csv, err) = proteus(None, &args, &env);
        assert_eq!(code, 0, "{args:?}: {err}");
        let (code, json, err) = proteus(None, &json_args, &env);
        assert_eq!(code, 0, "{json_args:?}: {err}");
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        let row = match &json {
            serde_json::Value::Array(rows) => rows[0].clone(),
            one => one.clone(),
        };
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let values: Vec<&str> = lines.next().unwrap().split(',').collect();
        let mut matched = 0;
        for (field, value) in header.iter().zip(&values) {
            // `leaving` sums leaving_by_tier; every other column is a field of the JSON.
            if *field == "leaving" {
                continue;
            }
            let got = field
                .split('.')
                .try_fold(&row, |v, k| v.get(k))
                .unwrap_or_else(|| panic!("{args:?}: column {field} is not in the JSON: {row}"));
            if let Some(n) = got.as_f64() {
                let v: f64 = value
                    .parse()
                    .unwrap_or_else(|e| panic!("{field}: {value} is not a plain number: {e}"));
                assert!(
                    (v - n).abs() <= 1e-9 * n.abs().max(1.0),
                    "{field}: {v} vs {n}"
                );
                matched += 1;
            } else if let Some(t) = got.as_str() {
                assert_eq!(*value, t, "{field}");
                matched += 1;
            } else {
                assert!(
                    got.is_null() && value.is_empty(),
                    "{args:?}: column {field} is {value:?} where the JSON has {got}"
                );
            }
        }
        assert!(matched >= 8, "{args:?}: {csv}");
    }
    let (code, text, _) = proteus(None, &["status", &id_text], &env);
    assert_eq!(code, 0);
    assert!(
        text.contains("(final)") && text.contains("times in simulated market time"),
        "{text}"
    );
    assert!(text.contains(" reliable (on-demand), "), "{text}");
}
