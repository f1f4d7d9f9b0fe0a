//! What is measured is what runs: `proteus demo` (a real broker on the simulated cloud, real
//! agents training, the trace's spikes evicting them through their metadata endpoints) and
//! `proteus simulate` on the same job file, start and policy make the same decisions at the
//! same market instants (the same `decisions_digest`) and cost the same to the cent.

use proteus_e2e::{fresh_pg_database, proteus};
use serde_json::Value;

fn demo_job() -> String {
    format!("{}/../examples/jobs/demo.toml", env!("CARGO_MANIFEST_DIR"))
}

/// `proteus simulate --start`: (digest, cost, evictions) of the asked policy's one run.
fn simulate(policy: &str, start: &str) -> (String, f64, u64) {
    let job = demo_job();
    let (code, stdout, stderr) = proteus(
        None,
        &[
            "simulate", "--job", &job, "--start", start, "--policy", policy, "--output", "json",
        ],
        &[],
    );
    assert_eq!(code, 0, "simulate failed: {stderr}");
    let rows: Vec<Value> = serde_json::from_str(&stdout).unwrap();
    let row = rows
        .iter()
        .find(|r| r["policy"] == policy)
        .unwrap_or_else(|| panic!("no {policy} row: {stdout}"));
    assert_eq!(row["runs"], 1, "{row}");
    (
        row["decisions_digest"].as_str().unwrap().to_string(),
        row["median_cost_usd"].as_f64().unwrap(),
        row["median_evictions"].as_f64().unwrap() as u64,
    )
}

/// `proteus demo --start` against a fresh Postgres database: its JSON result.
async fn demo(policy: String, start: String) -> Value {
    let db = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let job = demo_job();
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        proteus(
            Some(&db),
            &[
                "demo", "--job", &job, "--start", &start, "--policy", &policy, "--output", "json",
                "--out", &out,
            ],
            &[],
        )
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "the demo failed: {stderr}\n{stdout}");
    serde_json::from_str(&stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_and_simulate_make_the_same_decisions_and_cost_the_same() {
    // BidBrain on two starts with evictions (50 and 20 in simulation), standard bidding and
    // on-demand on starts without; two demos at a time, so that the agents' wall-clock timing
    // varies with the load too.
    let cases = [
        ("bidbrain", "2015-05-01T00:00:00Z"),
        ("standard-bidding", "2015-05-08T00:00:00Z"),
        ("bidbrain", "2015-05-15T12:00:00Z"),
        ("on-demand", "2015-06-02T00:00:00Z"),
    ];
    let mut evictions = 0;
    for pair in cases.chunks(2) {
        let runs: Vec<_> = pair
            .iter()
            .map(|(p, s)| tokio::spawn(demo(p.to_string(), s.to_string())))
            .collect();
        for ((policy, start), run) in pair.iter().zip(runs) {
            let live = run.await.unwrap();
            let (digest, cost, sim_evictions) = simulate(policy, start);
            let what = format!("{policy} from {start}");
            assert_eq!(live["job"]["state"], "succeeded", "{what}: {live}");
            assert_eq!(live["cost"]["pacing"], "modelled", "{what}");
            assert_eq!(
                live["decisions_digest"].as_str().unwrap(),
                digest,
                "{what}: the demo decided otherwise than the simulator"
            );
            let live_cost = live["cost"]["total_usd"].as_f64().unwrap();
            assert_eq!(
                (live_cost * 100.0).round(),
                (cost * 100.0).round(),
                "{what}: demo ${live_cost} vs simulate ${cost}"
            );
            assert_eq!(
                live["cost"]["evictions"].as_u64().unwrap(),
                sim_evictions,
                "{what}"
            );
            evictions += sim_evictions;
        }
    }
    assert!(evictions > 0, "no case had an eviction");
}

/// One drawn case of [`fifty_drawn_cases_decide_and_cost_the_same_live_and_simulated`].
#[derive(Debug, Clone)]
struct Case {
    policy: &'static str,
    start: String,
    seed: u64,
    max_instances: u32,
    budget_usd: Option<f64>,
    deadline_hours: Option<f64>,
    /// The job's one instance type, if not the demo job's default set.
    instance_type: Option<&'static str>,
}

impl Case {
    /// The demo job with this case's limits.
    fn job_file(&self, dir: &std::path::Path, i: usize) -> String {
        let base = std::fs::read_to_string(demo_job()).unwrap();
        let mut limits = format!(
            "[limits]\nmax_instances = {}\nmax_reliable_instances = 1\n",
            self.max_instances
        );
        if let Some(b) = self.budget_usd {
            limits.push_str(&format!("budget_usd = {b:.2}\n"));
        }
        if let Some(h) = self.deadline_hours {
            limits.push_str(&format!("deadline_hours = {h:.2}\n"));
        }
        let table = "[limits]\nmax_instances = 8\nmax_reliable_instances = 1\n";
        assert!(base.contains(table), "the demo job's [limits] table moved");
        let mut job = base.replace(table, &limits);
        if let Some(t) = self.instance_type {
            let work = "total_work = 24.0\n";
            assert!(job.contains(work), "the demo job's total_work moved");
            job = job.replace(work, &format!("{work}instance_types = [\"{t}\"]\n"));
        }
        let path = dir.join(format!("case-{i}.toml"));
        std::fs::write(&path, job).unwrap();
        path.display().to_string()
    }
}

/// splitmix64: a fixed, dependency-free stream for drawing the cases.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Market times at which standard bidding (bid = the on-demand price) is evicted on the demo
/// job restricted to one instance type, found on the trace by `proteus simulate --policy
/// standard-bidding --starts 60 --seed 5 --starts-from 2015-05-01 --runs-out FILE` with
/// `instance_types = ["r3.large"]` (3 of 60 starts) and `["g2.2xlarge"]` (2 of 60); on the
/// default types no start in 300 has an eviction under standard bidding.
const STANDARD_BIDDING_EVICTIONS: [(&str, &str); 5] = [
    ("2015-05-07T20:54:29Z", "r3.large"),
    ("2015-06-12T16:28:29Z", "r3.large"),
    ("2015-06-19T17:10:14Z", "r3.large"),
    ("2015-05-04T19:16:01Z", "g2.2xlarge"),
    ("2015-05-15T13:30:02Z", "g2.2xlarge"),
];

/// 51 cases, drawn once from a fixed seed: the three policies in turn; starts anywhere in May
/// and June 2015 (not on the hour), and for half the standard-bidding cases up to a quarter of
/// an hour before one of [`STANDARD_BIDDING_EVICTIONS`]; 2–8 instances; and, for every policy,
/// one case in six each with a tight budget (which ends the job), a loose one (which may only
/// hold launches back) and a deadline of 1–4 h.
fn drawn_cases() -> Vec<Case> {
    let mut d = Draw(2015);
    let policies = ["bidbrain", "standard-bidding", "on-demand"];
    let format = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%dT%H:%M:%SZ").to_string();
    let parse = |s: &str| chrono::DateTime::parse_from_rfc3339(s).unwrap().to_utc();
    (0..51)
        .map(|i| {
            let policy = policies[i % 3];
            let (start, instance_type) = if policy == "standard-bidding" && d.below(2) == 0 {
                let (at, t) = STANDARD_BIDDING_EVICTIONS[d.below(5) as usize];
                let back = chrono::Duration::seconds(d.below(15 * 60) as i64);
                (format(parse(at) - back), Some(t))
            } else {
                // Up to 2015-06-25: the slowest case still finishes inside the trace.
                let secs = d.below(55 * 86_400) as i64;
                (
                    format(parse("2015-05-01T00:00:00Z") + chrono::Duration::seconds(secs)),
                    None,
                )
            };
            let (budget_usd, deadline_extra) = match d.below(6) {
                0 => (Some(0.10 + d.below(50) as f64 / 100.0), None),
                1 => (Some(1.0 + d.below(200) as f64 / 100.0), None),
                2 => (None, Some(d.below(300) as f64 / 100.0)),
                _ => (None, None),
            };
            let seed = d.below(1000);
            let max_instances = 2 + d.below(7) as u32;
            // A deadline the broker accepts: the demo job's 24 units at full width (a unit is
            // a reference-type hour, and no type is slower) and its start-up, then up to 3 h
            // more. Tight ones end the job; looser ones pace it.
            let deadline_hours = deadline_extra.map(|x| 24.0 / f64::from(max_instances) + 0.25 + x);
            Case {
                policy,
                start,
                seed,
                max_instances,
                budget_usd,
                deadline_hours,
                instance_type,
            }
        })
        .collect()
}

/// `proteus simulate` on one case: its one run's summary row.
fn simulate_case(job: &str, case: &Case) -> Value {
    let seed = case.seed.to_string();
    let (code, stdout, stderr) = proteus(
        None,
        &[
            "simulate",
            "--job",
            job,
            "--start",
            &case.start,
            "--policy",
            case.policy,
            "--seed",
            &seed,
            "--output",
            "json",
        ],
        &[],
    );
    assert_eq!(code, 0, "simulate failed on {case:?}: {stderr}");
    let rows: Vec<Value> = serde_json::from_str(&stdout).unwrap();
    rows.into_iter()
        .find(|r| r["policy"] == case.policy)
        .unwrap_or_else(|| panic!("no {} row: {stdout}", case.policy))
}

/// `proteus demo --no-agents` on one case, against a fresh Postgres database: the live broker on
/// the simulated cloud, market time stepped onto every instant the broker acts at.
async fn live_case(job: String, case: Case) -> Value {
    let db = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        let seed = case.seed.to_string();
        proteus(
            Some(&db),
            &[
                "demo",
                "--no-agents",
                "--job",
                &job,
                "--start",
                &case.start,
                "--policy",
                case.policy,
                "--seed",
                &seed,
                "--step-secs",
                "3600",
                "--output",
                "json",
                "--out",
                &out,
            ],
            &[],
        )
    })
    .await
    .unwrap();
    // A job ended by its budget or deadline fails, and the demo says so by its exit code.
    assert!(
        code == 0 || code == 1,
        "the demo broke: {code}: {stderr}\n{stdout}"
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_drawn_cases_decide_and_cost_the_same_live_and_simulated() {
    let cases = drawn_cases();
    let dir = tempfile::tempdir().unwrap();
    let (mut evicted, mut by_budget, mut by_deadline, mut held_only) = (0, 0, 0, 0);
    let mut policies_with_evictions = std::collections::BTreeSet::new();
    // Two at a time (the machine has two cores).
    for (pair_index, pair) in cases.chunks(2).enumerate() {
        let runs: Vec<_> = pair
            .iter()
            .enumerate()
            .map(|(j, case)| {
                let job = case.job_file(dir.path(), pair_index * 2 + j);
                (job.clone(), tokio::spawn(live_case(job, case.clone())))
            })
            .collect();
        for (j, (case, (job, run))) in pair.iter().zip(runs).enumerate() {
            let live = run.await.unwrap();
            let sim = simulate_case(&job, case);
            let what = format!("{case:?}");
            assert_eq!(live["cost"]["pacing"], "modelled", "{what}");
            assert_eq!(
                live["decisions_digest"].as_str().unwrap(),
                sim["decisions_digest"].as_str().unwrap(),
                "{what}: the live broker decided otherwise than the simulator"
            );
            let live_cost = live["cost"]["total_usd"].as_f64().unwrap();
            let sim_cost = sim["median_cost_usd"].as_f64().unwrap();
            assert_eq!(
                (live_cost * 100.0).round(),
                (sim_cost * 100.0).round(),
                "{what}: live ${live_cost} vs simulated ${sim_cost}"
            );
            let evictions = live["cost"]["evictions"].as_u64().unwrap();
            assert_eq!(
                evictions as f64,
                sim["median_evictions"].as_f64().unwrap(),
                "{what}"
            );
            // The same end, for the same reason.
            let state = live["job"]["state"].as_str().unwrap();
            let reason = live["job"]["state_reason"].as_str().unwrap_or("");
            let (budget_end, deadline_end) =
                (sim["ended_by_budget"] == 1, sim["ended_by_deadline"] == 1);
            match (budget_end, deadline_end) {
                (true, _) => {
                    assert_eq!(state, "failed", "{what}: {reason}");
                    assert!(reason.starts_with("budget"), "{what}: {reason}");
                    by_budget += 1;
                }
                (_, true) => {
                    assert_eq!(state, "failed", "{what}: {reason}");
                    assert!(reason.starts_with("deadline"), "{what}: {reason}");
                    by_deadline += 1;
                }
                _ => {
                    assert_eq!(state, "succeeded", "{what}: {reason}");
                    assert_eq!(sim["completed_runs"], 1, "{what}");
                    if case.budget_usd.is_some() {
                        held_only += 1;
                    }
                }
            }
            if evictions > 0 {
                evicted += 1;
                policies_with_evictions.insert(case.policy);
            }
            eprintln!(
                "case {:>2}: {:<16} {} {:<10} seed {:>3} max {} budget {:>5} deadline {:>5} → \
                 {state} ${live_cost:.4}, {evictions} evictions, digest {}",
                pair_index * 2 + j,
                case.policy,
                case.start,
                case.instance_type.unwrap_or("default"),
                case.seed,
                case.max_instances,
                case.budget_usd.map_or("-".into(), |b| format!("{b:.2}")),
                case.deadline_hours
                    .map_or("-".into(), |h| format!("{h:.2}")),
                live["decisions_digest"].as_str().unwrap(),
            );
        }
    }
    // The draw covers what it is meant to: evictions under both bidding policies, a budget that
    // ends the job and one that does not, a deadline that ends it.
    assert!(evicted >= 5, "only {evicted} cases had evictions");
    assert!(
        policies_with_evictions.contains("bidbrain")
            && policies_with_evictions.contains("standard-bidding"),
        "{policies_with_evictions:?}"
    );
    assert!(by_budget >= 1, "no case ended at its budget");
    assert!(held_only >= 1, "no budgeted case completed");
    assert!(by_deadline >= 1, "no case ended at its deadline");
}
