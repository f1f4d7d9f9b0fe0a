//! `proteus simulate` through the real binary: output contract and bad input.

use crate::support::{ON_DEMAND_2015, TRACE_2015, data};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn proteus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(args)
        .env("PROTEUS_LOG", "warn")
        .env_remove("PROTEUS_POLICIES_DIR")
        .output()
        .expect("run proteus")
}

/// `proteus simulate --trace T --on-demand O --job J`, then `rest`.
fn simulate(trace: &str, on_demand: &str, job: &str, rest: &[&str]) -> Output {
    let mut args = vec![
        "simulate",
        "--trace",
        trace,
        "--on-demand",
        on_demand,
        "--job",
        job,
    ];
    args.extend_from_slice(rest);
    proteus(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn repo(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .display()
        .to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn trace_2015() -> String {
    data(TRACE_2015).display().to_string()
}
fn on_demand_2015() -> String {
    data(ON_DEMAND_2015).display().to_string()
}

#[test]
fn compare_prints_one_json_object_per_policy_with_the_contract_fields() {
    let (trace, od, job) = (
        trace_2015(),
        on_demand_2015(),
        repo("examples/jobs/reference-2015.toml"),
    );
    let out = simulate(
        &trace,
        &od,
        &job,
        &[
            "--compare",
            "bidbrain",
            "standard-bidding",
            "on-demand",
            "--starts",
            "3",
            "--seed",
            "7",
            "--output",
            "json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = rows.as_array().expect("an array");
    assert_eq!(rows.len(), 3);
    for row in rows {
        for field in [
            "policy",
            "runs",
            "median_cost_usd",
            "median_runtime_hours",
            "median_evictions",
            "cost_ratio_vs_on_demand",
            "cost_ratio_vs_standard",
        ] {
            assert!(
                row.get(field).is_some_and(|v| !v.is_null()),
                "{field} missing in {row}"
            );
        }
        assert_eq!(row["runs"], 3);
    }
    let od_row = rows.iter().find(|r| r["policy"] == "on-demand").unwrap();
    assert_eq!(od_row["cost_ratio_vs_on_demand"], 1.0);
    let bb = rows.iter().find(|r| r["policy"] == "bidbrain").unwrap();
    assert!(
        bb["cost_ratio_vs_on_demand"].as_f64().unwrap() < 0.5,
        "{bb}"
    );
}

#[test]
fn csv_has_plain_numbers_where_the_table_shows_dollars_and_percentages() {
    let (trace, od, job) = (
        trace_2015(),
        on_demand_2015(),
        repo("examples/jobs/reference-2015.toml"),
    );
    let run = |output: &str| {
        let out = simulate(
            &trace,
            &od,
            &job,
            &[
                "--compare",
                "bidbrain",
                "on-demand",
                "--starts",
                "2",
                "--seed",
                "7",
                "--output",
                output,
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let table = run("table");
    assert!(table.contains('$') && table.contains('%'), "{table}");
    let csv = run("csv");
    assert!(!csv.contains('$') && !csv.contains('%'), "{csv}");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    // The columns are the JSON's fields, named as there.
    let json: serde_json::Value = serde_json::from_str(&run("json")).unwrap();
    for field in &header {
        assert!(
            json[0].get(*field).is_some(),
            "CSV column {field} is not a field of the JSON: {}",
            json[0]
        );
    }
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (cost, vs_od) = (col("median_cost_usd"), col("cost_ratio_vs_on_demand"));
    for line in lines.filter(|l| !l.is_empty()) {
        let cells: Vec<&str> = line.split(',').collect();
        let usd: f64 = cells[cost]
            .parse()
            .unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(usd > 0.0, "{line}");
        // A fraction, as in the JSON (the table shows it as a percentage).
        let ratio: f64 = cells[vs_od]
            .parse()
            .unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(ratio > 0.0 && ratio < 5.0, "{line}");
    }
}

#[test]
fn help_shows_examples() {
    let out = proteus(&["simulate", "--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Examples:") && text.contains("--compare bidbrain"),
        "{text}"
    );
}

#[test]
fn a_policy_naming_a_market_without_prices_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let policy = write(
        dir.path(),
        "narrow.toml",
        "kind = \"standard-bidding\"\nmarkets = [\"us-east-1d/c3.xlarge\"]\n\
         [checkpoint]\ninterval_minutes = 60\ncheckpoint_minutes = 2\nrestart_minutes = 3\n",
    );
    let (trace, od, job) = (
        trace_2015(),
        on_demand_2015(),
        repo("examples/jobs/reference-2015.toml"),
    );
    let out = simulate(&trace, &od, &job, &["--policy", &policy, "--starts", "2"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("narrow.toml: key `markets`: market us-east-1d/c3.xlarge has no price rows"),
        "{err}"
    );
    assert!(
        err.contains("us-east-1b/c3.xlarge"),
        "lists the markets that do have prices: {err}"
    );
}

#[test]
fn a_policy_file_with_a_bad_value_names_file_key_and_allowed_values() {
    let dir = tempfile::tempdir().unwrap();
    let policy = write(
        dir.path(),
        "bb.toml",
        "kind = \"bidbrain\"\nbid_deltas = [0.1, -0.5]\n",
    );
    let job = repo("examples/jobs/reference-2015.toml");
    let out = proteus(&[
        "simulate", "--job", &job, "--policy", &policy, "--starts", "2",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("bb.toml: key `bid_deltas`") && err.contains("allowed: fractions ≥ 0"),
        "{err}"
    );
    let out = proteus(&["simulate", "--job", &job, "--policy", "no-such-policy"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no policy named `no-such-policy`"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_job_naming_an_unknown_instance_type_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let job = write(
        dir.path(),
        "job.toml",
        "total_work = 100.0\nreference_type = \"c3.xlarge\"\ninstance_types = [\"c3.xlarge\", \"c9.huge\"]\nmax_instances = 8\n",
    );
    let (trace, od) = (trace_2015(), on_demand_2015());
    let out = simulate(&trace, &od, &job, &["--policy", "bidbrain"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("job.toml: key `instance_types`: unknown instance type `c9.huge`"),
        "{err}"
    );
}

#[test]
fn a_trace_shorter_than_the_job_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv =
        String::from("timestamp,availability_zone,instance_type,product_description,spot_price\n");
    for k in 0..36 {
        csv.push_str(&format!(
            "2015-04-01T{:02}:{:02}:00Z,us-east-1a,c3.xlarge,Linux/UNIX,0.03\n",
            k / 6,
            (k % 6) * 10
        ));
    }
    let trace = write(dir.path(), "short.csv", &csv);
    let od = on_demand_2015();
    let job = repo("examples/jobs/reference-2015.toml");
    let out = simulate(&trace, &od, &job, &["--policy", "on-demand"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("covers 0.2 days") && err.contains("use a longer trace"),
        "{err}"
    );
    // A single start inside it: the run itself finds the end.
    let out = simulate(
        &trace,
        &od,
        &job,
        &["--policy", "on-demand", "--start", "2015-04-01T01:00:00Z"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("the trace ends at 2015-04-01T05:50:00Z, before the job"),
        "{err}"
    );
}

#[test]
fn optimal_on_the_2015_market_is_a_lower_bound_and_its_gap_adds_up() {
    let (trace, od, job) = (
        trace_2015(),
        on_demand_2015(),
        repo("examples/jobs/reference-2015.toml"),
    );
    let dir = tempfile::tempdir().unwrap();
    let gap = dir.path().join("gap.json");
    let chart = dir.path().join("gap.svg");
    let gap_arg = gap.display().to_string();
    let chart_arg = chart.display().to_string();
    let out = simulate(
        &trace,
        &od,
        &job,
        &[
            "--compare",
            "bidbrain",
            "standard-bidding",
            "--starts",
            "3",
            "--seed",
            "7",
            "--optimal",
            "--gap",
            &gap_arg,
            "--gap-chart",
            &chart_arg,
            "--output",
            "json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let row = |p: &str| {
        rows.iter()
            .find(|r| r["policy"] == p)
            .unwrap_or_else(|| panic!("no {p} row in {rows:?}"))
    };
    let optimal = row("hindsight-optimal");
    assert_eq!(optimal["completed_runs"], 3, "{optimal}");
    // Held to standard bidding's runtime, it costs no more than standard bidding on any start.
    assert!(optimal["cost_ratio_vs_standard"].as_f64().unwrap() <= 1.0 + 1e-9);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&gap).unwrap()).unwrap();
    for p in report["policies"].as_array().unwrap() {
        for s in p["starts"].as_array().unwrap() {
            // A lower bound on every start a policy finished in the optimum's time (standard
            // bidding's own), and the parts explain the whole gap.
            let gap_usd = s["gap_usd"].as_f64().unwrap();
            let hours = |who: &str| s[who]["runtime_hours"].as_f64().unwrap();
            if hours("policy") <= hours("optimum") + 1e-6 {
                assert!(gap_usd >= -1e-6, "{s}");
            }
            let sum: f64 = s["parts"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_f64().unwrap())
                .sum();
            assert!((sum - gap_usd).abs() < 1e-6, "{s}");
        }
    }
    assert!(
        std::fs::read_to_string(&chart)
            .unwrap()
            .contains("free hours")
    );
    // Under the interruption-hazard model nobody foresees an eviction: refused, with the reason.
    let out = simulate(
        &trace,
        &od,
        &job,
        &[
            "--policy",
            "bidbrain",
            "--optimal",
            "--billing",
            "per-second",
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("hourly-2015"), "{}", stderr(&out));
    // Held to a policy that is not compared: refused with the name.
    let out = simulate(
        &trace,
        &od,
        &job,
        &[
            "--compare",
            "bidbrain",
            "standard-bidding",
            "--starts",
            "1",
            "--optimal",
            "--optimal-held-to",
            "uniform-progress",
        ],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--optimal-held-to uniform-progress"),
        "{}",
        stderr(&out)
    );
    // The frontier: given 1.25 × standard bidding's runtime, the optimum costs no more than at
    // 1.00 on the same starts (and so no more than standard bidding).
    let median_at = |factor: &str| -> f64 {
        let out = simulate(
            &trace,
            &od,
            &job,
            &[
                "--compare",
                "standard-bidding",
                "--starts",
                "3",
                "--seed",
                "7",
                "--optimal",
                "--optimal-runtime-factor",
                factor,
                "--output",
                "json",
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        let opt = rows
            .iter()
            .find(|r| r["policy"] == "hindsight-optimal")
            .unwrap();
        assert_eq!(opt["completed_runs"], 3, "{opt}");
        opt["median_cost_usd"].as_f64().unwrap()
    };
    let (tight, loose) = (median_at("1.0"), median_at("1.25"));
    assert!(loose <= tight + 1e-9, "{loose} > {tight}");
    // A factor below 1 or past 10: refused, saying what it must be.
    for bad in ["0.9", "11", "NaN"] {
        let out = simulate(
            &trace,
            &od,
            &job,
            &[
                "--compare",
                "standard-bidding",
                "--optimal",
                "--optimal-runtime-factor",
                bad,
            ],
        );
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains("--optimal-runtime-factor") && stderr(&out).contains("1.0 to 10"),
            "{bad}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn calibration_scores_each_policys_eviction_estimates_against_what_happened() {
    let (trace, od, job) = (
        trace_2015(),
        on_demand_2015(),
        repo("examples/jobs/reference-2015.toml"),
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("calibration.json");
    let runs = dir.path().join("runs.jsonl");
    let out = simulate(
        &trace,
        &od,
        &job,
        &[
            "--compare",
            "bidbrain",
            "standard-bidding",
            "--starts",
            "2",
            "--seed",
            "7",
            "--calibration",
            &file.display().to_string(),
            "--runs-out",
            &runs.display().to_string(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("bidbrain's eviction estimates: "),
        "{}",
        stderr(&out)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(v["horizon_hours"], 1.0);
    let policies = v["policies"].as_array().unwrap();
    // On-demand buys no spot: it has nothing to score.
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["bidbrain", "standard-bidding"], "{v}");
    for p in policies {
        let outcomes = p["outcomes"].as_u64().unwrap();
        assert!(outcomes > 0, "{p}");
        let bins = p["bins"].as_array().unwrap();
        assert_eq!(bins.len(), 10);
        assert_eq!(
            bins.iter()
                .map(|b| b["count"].as_u64().unwrap())
                .sum::<u64>(),
            outcomes,
            "{p}"
        );
        for key in [
            "brier",
            "climatology_brier",
            "observed_rate",
            "mean_estimate",
        ] {
            let x = p[key].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{key} {x}: {p}");
        }
    }
    // The decisions it needed are not written unless asked for.
    let first = std::fs::read_to_string(&runs).unwrap();
    let run: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    assert!(run.get("decisions").is_none() && run.get("instances").is_none());
}

/// `--fit-eviction` on March–April's replayed launches writes a model file that
/// `--eviction-model` loads on May–June, where `--calibration` scores it; a file of the wrong shape, or for other
/// markets, is refused saying what and where.
#[test]
fn an_eviction_model_fitted_on_march_april_is_loaded_and_scored_on_may_june() {
    let (trace, od, job) = (
        trace_2015(),
        on_demand_2015(),
        repo("examples/jobs/reference-2015.toml"),
    );
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("eviction.json");
    let model_arg = model.display().to_string();
    let out = simulate(
        &trace,
        &od,
        &job,
        &[
            "--policy",
            "bidbrain",
            "--starts-from",
            "2015-04-28",
            "--starts-until",
            "2015-05-01",
            "--fit-eviction",
            &model_arg,
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("fitted the eviction model on"),
        "{}",
        stderr(&out)
    );
    // It ran no policy: no summary on stdout.
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&model).unwrap()).unwrap();
    assert_eq!(v["kind"], "proteus-eviction-model");
    assert!(v["samples"].as_u64().unwrap() >= 100, "{}", v["samples"]);
    // Learned from March–April only: every launch's hour ended by May.
    let may = 1_430_438_400_000i64; // 2015-05-01T00:00:00Z
    assert!(v["trained_to"].as_i64().unwrap() + 3_600_000 <= may);
    let features = v["features"].as_array().unwrap().len();
    assert_eq!(v["coefficients"].as_array().unwrap().len(), features);
    assert!(!v["markets"].as_array().unwrap().is_empty());

    // Loaded on May–June: the estimates scored are the learned model's, not the replay's.
    let score = |extra: &[&str]| {
        let cal = dir.path().join("calibration.json");
        let cal_arg = cal.display().to_string();
        let args = [
            &[
                "--policy",
                "bidbrain",
                "--starts",
                "1",
                "--seed",
                "3",
                "--starts-from",
                "2015-05-01",
                "--calibration",
                &cal_arg,
            ][..],
            extra,
        ]
        .concat();
        let out = simulate(&trace, &od, &job, &args);
        assert!(out.status.success(), "{}", stderr(&out));
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cal).unwrap()).unwrap();
        c["policies"][0].clone()
    };
    let learned = score(&["--eviction-model", &model_arg]);
    let replay = score(&[]);
    assert!(learned["outcomes"].as_u64().unwrap() > 0, "{learned}");
    let brier = learned["brier"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&brier), "{learned}");
    assert_ne!(learned["mean_estimate"], replay["mean_estimate"]);

    // A file of the wrong shape: one coefficient short.
    let refused = |file: &serde_json::Value, name: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, file.to_string()).unwrap();
        let out = simulate(
            &trace,
            &od,
            &job,
            &[
                "--policy",
                "bidbrain",
                "--starts",
                "1",
                "--eviction-model",
                &path.display().to_string(),
            ],
        );
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains(name), "{err}");
        err
    };
    let mut short = v.clone();
    short["coefficients"].as_array_mut().unwrap().pop();
    let err = refused(&short, "short.json");
    assert!(err.contains("coefficients"), "{err}");
    // A field of the wrong type is named by its path.
    let mut wrong = v.clone();
    wrong["intercept"] = serde_json::json!("high");
    let err = refused(&wrong, "wrong.json");
    assert!(err.contains("intercept"), "{err}");
    // Fitted for other markets: the trace's are named.
    let mut other = v.clone();
    let n = other["markets"].as_array().unwrap().len();
    let renamed: Vec<String> = (0..n).map(|i| format!("us-west-9{i}:c9.large")).collect();
    other["features"] = serde_json::json!(
        other["features"].as_array().unwrap()[..features - n]
            .iter()
            .cloned()
            .chain(
                renamed
                    .iter()
                    .map(|m| serde_json::json!(format!("market={m}")))
            )
            .collect::<Vec<_>>()
    );
    other["markets"] = serde_json::json!(renamed);
    let err = refused(&other, "other.json");
    assert!(err.contains("does not know"), "{err}");
}
