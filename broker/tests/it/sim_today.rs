//! Today's market from availability traces: refusals, notices, per-second billing with the free
//! first hour, the baseline policies, and `proteus simulate --availability` through the binary.

use proteus_broker::billing::BillingModel;
use proteus_broker::engine::job_engine::Outcome;
use proteus_broker::job::WorkModelSpec;
use proteus_broker::market::{InstanceType, Market, Region, Timestamp, UsdPerHour};
use proteus_broker::market_model::{HazardModel, HazardPrior};
use proteus_broker::policy::parse_policy;
use proteus_broker::sim::availability::{Availability, AvailabilityTrace, Reading};
use proteus_broker::sim::{Deadline, RunOptions, RunResult, Scenario, World, run};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const H: f64 = 3600.0;
const SPOT: f64 = 0.918;
const OD: f64 = 3.06;

/// An availability file's text: ten-minute ticks, `true` where spot can be had.
fn trace_text(up: impl IntoIterator<Item = bool>) -> String {
    let data: Vec<&str> = up.into_iter().map(|u| if u { "1" } else { "0" }).collect();
    format!(
        "{{\"metadata\": {{\"gap_seconds\": 600}}, \"data\": [{}]}}",
        data.join(",")
    )
}

/// Zones of ten-minute ticks, `1` where spot can be had.
fn world(zones: &[(&str, &str)]) -> Arc<Availability> {
    let traces = zones
        .iter()
        .map(|(zone, ticks)| {
            let text = trace_text(ticks.chars().map(|c| c == '1'));
            AvailabilityTrace::parse(
                Path::new(&format!("{zone}_v100_1.json")),
                &text,
                Reading::Available,
            )
            .unwrap()
        })
        .collect();
    Arc::new(
        Availability::new(
            traces,
            InstanceType::parse("p3.2xlarge").unwrap(),
            Timestamp::from_millis(0),
        )
        .unwrap(),
    )
}

fn simulate(a: &Arc<Availability>, policy: &str, work_hours: f64, deadline_h: f64) -> RunResult {
    simulate_file(
        a,
        policy,
        &format!("kind = \"{policy}\"\n"),
        work_hours,
        deadline_h,
    )
}

/// [`simulate`] with the policy file's text.
fn simulate_file(
    a: &Arc<Availability>,
    policy: &str,
    toml: &str,
    work_hours: f64,
    deadline_h: f64,
) -> RunResult {
    let sc = scenario(a, work_hours);
    let mut p = parse_policy(&format!("{policy}.toml"), toml).unwrap();
    let options = RunOptions {
        deadline: Some(Deadline::After(deadline_h * H)),
        record_decisions: true,
        ..RunOptions::default()
    };
    run(&sc, p.as_mut(), Timestamp::from_millis(0), &options).unwrap()
}

/// A one-instance p3.2xlarge job of `work_hours` (6-minute start-up) on the availability world.
fn scenario(a: &Arc<Availability>, work_hours: f64) -> Scenario {
    let history =
        Arc::new(a.price_history(UsdPerHour::new(SPOT).unwrap(), UsdPerHour::new(OD).unwrap()));
    let spec = "name = \"t\"\ntotal_work = WORK\nreference_type = \"p3.2xlarge\"\n\
                instance_types = [\"p3.2xlarge\"]\nmax_instances = 1\nmax_reliable_instances = 1\n\
                startup_minutes = 6\n[eviction_cost]\nmodel = \"agileml\"\n\
                sync_interval_minutes = 0.5\nrebalance_seconds = 1.0\n"
        .replace("WORK", &work_hours.to_string());
    let region = Region::parse("us-west-2").unwrap();
    let job = WorkModelSpec::parse("t", &spec)
        .unwrap()
        .resolve("t", history.on_demand(), &region)
        .unwrap();
    Scenario::new(
        history,
        job,
        BillingModel::PerSecond,
        World::Availability(a.clone()),
        Box::new(HazardModel::new(HazardPrior::default())),
    )
    .unwrap()
}

fn spot_cost(hours: f64) -> f64 {
    SPOT * hours
}

#[test]
fn a_capacity_drop_warns_the_instance_refusals_fail_over_and_only_the_first_hour_is_free() {
    // us-west-2a: spot for 2 h, none for 1 h, then back; us-west-2b: never.
    let a = world(&[
        (
            "us-west-2a",
            &format!("{}{}{}", "1".repeat(12), "0".repeat(6), "1".repeat(60)),
        ),
        ("us-west-2b", &"0".repeat(78)),
    ]);
    let r = simulate(&a, "skypilot-default", 3.0, 12.0);
    assert_eq!(r.outcome, Outcome::Completed, "{}", r.end_reason);
    assert_eq!(r.evictions, 1, "the drop at 2 h takes the one instance");
    assert!(
        r.failed_launches >= 2,
        "both pools refuse while 2a is empty: {}",
        r.failed_launches
    );
    let m = Market::parse("us-west-2a/p3.2xlarge").unwrap().to_string();
    assert!(
        r.instances.iter().all(|i| i.market == m),
        "{:?}",
        r.instances
    );
    let first = &r.instances[0];
    // The notice comes at the tick where capacity drops (2 h); the instance goes 2 min later.
    assert_eq!(first.end.millis(), (2.0 * H * 1000.0) as i64 + 120_000);
    // Interrupted after its first hour: every second is charged.
    assert!(
        (first.cost_usd.get() - spot_cost(first.end.secs_since(first.launch) / H)).abs() < 1e-9
    );
    // The replacement waits for capacity (3 h) and runs the rest: 3 h of work, 1 h 52 min
    // done before the notice less what the notice and a sync lost, 6 min start-up.
    let second = &r.instances[1];
    assert!(
        second.launch.millis() >= (3.0 * H * 1000.0) as i64,
        "{second:?}"
    );
    assert!(
        r.instances
            .iter()
            .all(|i| i.tier == proteus_broker::policy::Tier::Transient)
    );
    let total: f64 = r.instances.iter().map(|i| i.cost_usd.get()).sum();
    assert!((r.cost_usd.get() - total).abs() < 1e-9);

    // The same drop 40 minutes after launch: that life is free.
    let a = world(&[(
        "us-west-2a",
        &format!("{}{}{}", "1".repeat(4), "0".repeat(2), "1".repeat(60)),
    )]);
    let r = simulate(&a, "skypilot-default", 3.0, 12.0);
    assert_eq!(r.outcome, Outcome::Completed, "{}", r.end_reason);
    assert_eq!(r.evictions, 1);
    assert_eq!(r.instances[0].cost_usd.get(), 0.0, "{:?}", r.instances[0]);
    assert!(r.cost_usd.get() > 0.0);
}

#[test]
fn uniform_progress_falls_back_to_on_demand_when_behind_and_skypilot_misses_the_deadline() {
    // No spot for the first 5 h, then spot for good.
    let a = world(&[(
        "us-west-2a",
        &format!("{}{}", "0".repeat(30), "1".repeat(60)),
    )]);
    let up = simulate(&a, "uniform-progress", 4.0, 6.0);
    assert_eq!(up.outcome, Outcome::Completed, "{}", up.end_reason);
    assert!(
        up.instance_hours_reliable > 0.0,
        "behind the line without spot: on-demand"
    );
    let sky = simulate(&a, "skypilot-default", 4.0, 6.0);
    assert_eq!(
        sky.outcome,
        Outcome::Deadline,
        "spot only, no deadline awareness"
    );
    assert_eq!(sky.instance_hours_reliable, 0.0);
    let od = simulate(&a, "on-demand", 4.0, 6.0);
    assert_eq!(od.outcome, Outcome::Completed);
    assert!(
        (od.cost_usd.get() - OD * (4.0 + 0.1)).abs() < 0.01,
        "{}",
        od.cost_usd.get()
    );
    // With slack to spare it still starts on on-demand (behind the line at the first look) and,
    // as published, leaves it only for spot: 4 h of work are done on on-demand before spot is
    // back at 5 h; 8 h of work move to spot then, and pay less than on-demand.
    let relaxed = simulate(&a, "uniform-progress", 4.0, 14.0);
    assert_eq!(relaxed.outcome, Outcome::Completed);
    assert_eq!(
        relaxed.instance_hours_transient, 0.0,
        "{:?}",
        relaxed.instances
    );
    let longer = simulate(&a, "uniform-progress", 8.0, 14.0);
    assert_eq!(longer.outcome, Outcome::Completed, "{}", longer.end_reason);
    assert!(
        longer.instance_hours_transient > 0.0,
        "{:?}",
        longer.instances
    );
    let od_longer = simulate(&a, "on-demand", 8.0, 14.0);
    assert!(longer.cost_usd.get() < od_longer.cost_usd.get());
}

/// Uniform Progress as published (§5.2.2): on on-demand it leaves only for spot, so a refused
/// try keeps on-demand running (the hysteresis is done long before spot is back); the
/// on-demand instance goes when the spot launch is granted, and the switch pays the restart.
/// The make-before-break variant keeps on-demand working until the spot instance is ready.
#[test]
fn uniform_progress_keeps_on_demand_through_refused_tries_and_switches_when_spot_is_granted() {
    // No spot for 3 h, then spot for good; 4 h of work in 6 h: behind the line from the start.
    let a = world(&[(
        "us-west-2a",
        &format!("{}{}", "0".repeat(18), "1".repeat(60)),
    )]);
    let back = (3.0 * H * 1000.0) as i64;
    let od_market = |r: &RunResult| -> Vec<(i64, i64)> {
        r.instances
            .iter()
            .filter(|i| i.tier == proteus_broker::policy::Tier::Reliable)
            .map(|i| (i.launch.millis(), i.end.millis()))
            .collect()
    };
    let spot_launches = |r: &RunResult| -> Vec<i64> {
        r.instances
            .iter()
            .filter(|i| i.tier == proteus_broker::policy::Tier::Transient)
            .map(|i| i.launch.millis())
            .collect()
    };
    let up = simulate(&a, "uniform-progress", 4.0, 6.0);
    assert_eq!(up.outcome, Outcome::Completed, "{}", up.end_reason);
    // The hysteresis is done at 0.7 h (cp >= ep(t + 2d)); from then on it tries spot at every
    // look, refused for 2.3 h.
    assert!(up.failed_launches > 100, "{}", up.failed_launches);
    let od = od_market(&up);
    assert_eq!(od.len(), 1, "one on-demand instance throughout: {od:?}");
    let spot = spot_launches(&up);
    assert_eq!(spot.len(), 1, "{:?}", up.instances);
    assert!(spot[0] >= back, "spot only once it is back: {spot:?}");
    assert_eq!(
        od[0].1, spot[0],
        "on-demand goes when the spot launch is granted"
    );

    let mbb = simulate_file(
        &a,
        "uniform-progress-mbb",
        "kind = \"uniform-progress\"\nmake_before_break = true\n",
        4.0,
        6.0,
    );
    assert_eq!(mbb.outcome, Outcome::Completed, "{}", mbb.end_reason);
    let (od, spot) = (od_market(&mbb), spot_launches(&mbb));
    assert_eq!((od.len(), spot.len()), (1, 1), "{:?}", mbb.instances);
    // The spot instance starts for 6 minutes beside the on-demand one, which then goes.
    assert_eq!(od[0].1, spot[0] + 360_000, "{:?}", mbb.instances);
    assert!(mbb.runtime_hours < up.runtime_hours, "{mbb:?} vs {up:?}");
}

/// Exploitation (§3.3): once on spot, the job stays there until it is preempted — the safety
/// net applies off spot only, so a tight deadline does not make it leave a running spot
/// instance for on-demand.
#[test]
fn uniform_progress_stays_on_spot_when_the_slack_falls_below_the_safety_net() {
    // Spot throughout; 4 h of work in 4.25 h. After the 6-minute start the time left (4.15 h)
    // is below the compute left plus two restarts and a look (4.21 h).
    let a = world(&[("us-west-2a", &"1".repeat(60))]);
    let up = simulate(&a, "uniform-progress", 4.0, 4.25);
    assert_eq!(up.outcome, Outcome::Completed, "{}", up.end_reason);
    assert_eq!(up.instance_hours_reliable, 0.0, "{:?}", up.instances);
    assert_eq!(up.instances.len(), 1, "{:?}", up.instances);
}

/// `proteus simulate --availability FILE ARGS --output json` with the shipped policies: it must
/// succeed; its report.
fn simulate_json(file: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(["simulate", "--availability"])
        .arg(file)
        .args(args)
        .args(["--output", "json"])
        .env("PROTEUS_LOG", "warn")
        .env_remove("PROTEUS_POLICIES_DIR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn simulate_availability_prints_the_documented_keys_and_explains_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("us-west-2a_v100_1.json");
    std::fs::write(
        &file,
        trace_text((0..600).map(|i| !(100..150).contains(&i))),
    )
    .unwrap();
    let v = simulate_json(
        &file,
        &[
            "--instance-type",
            "p3.2xlarge",
            "--instances",
            "1",
            "--work-hours",
            "10",
            "--deadline-hours",
            "14",
            "--restart-overhead-hours",
            "0.2",
            "--policy",
            "uniform-progress",
            "--starts",
            "5",
            "--seed",
            "3",
        ],
    );
    for key in ["deadline_met_rate", "cost_vs_on_demand", "median_cost_usd"] {
        assert!(v[key].is_number(), "{key} missing: {v}");
    }
    assert_eq!(v["starts"].as_array().unwrap().len(), 5);
    let od = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == "on-demand")
        .unwrap();
    assert_eq!(od["cost_vs_on_demand"], 1.0);
    assert!(v["cost_vs_on_demand"].as_f64().unwrap() < 1.0, "{v}");

    // `simulate --availability FILE ARGS` must fail: its stderr.
    let refused = |file: &std::path::Path, args: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
            .args(["simulate", "--availability"])
            .arg(file)
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A broken file: named, with the place.
    let broken = dir.path().join("us-west-2b_x.json");
    std::fs::write(&broken, "{\"data\": [1]}").unwrap();
    let err = refused(&broken, &["--work-hours", "1", "--deadline-hours", "2"]);
    assert!(
        err.contains("us-west-2b_x.json") && err.contains("metadata"),
        "{err}"
    );
    // No work given.
    let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(["simulate", "--availability"])
        .arg(&file)
        .args(["--deadline-hours", "2"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--work-hours"));
    // The gap split and the calibration are for the 2015 market's price trace: refused here,
    // saying so, and no file.
    let gap = dir.path().join("gap.json");
    let gap_arg = gap.display().to_string();
    let work = ["--work-hours", "1", "--deadline-hours", "2"];
    let err = refused(
        &file,
        &[&work[..], &["--optimal", "--gap", &gap_arg]].concat(),
    );
    assert!(
        err.contains("--gap") && err.contains("--availability"),
        "{err}"
    );
    assert!(!gap.exists());
    let err = refused(&file, &[&work[..], &["--calibration", &gap_arg]].concat());
    assert!(err.contains("--calibration is for a price trace"), "{err}");
    assert!(!gap.exists());
    // A fleet of no jobs, or of more than a broker would plan together.
    for k in ["0", "65"] {
        let err = refused(&file, &[&work[..], &["--fleet", k]].concat());
        assert!(
            err.contains(&format!("--fleet {k}")) || err.contains("--fleet must"),
            "{err}"
        );
    }

    // A fleet: every job of every fleet is reported, staggered a deadline ÷ K apart, with what
    // the first fleet's book learned of the pool.
    let v = simulate_json(
        &file,
        &[
            "--work-hours",
            "10",
            "--deadline-hours",
            "14",
            "--restart-overhead-hours",
            "0.2",
            "--compare",
            "bidbrain",
            "uniform-progress",
            "--fleet",
            "4",
            "--starts",
            "2",
        ],
    );
    let starts: Vec<Timestamp> = serde_json::from_value(v["starts"].clone()).unwrap();
    assert_eq!(starts.len(), 8, "{v}");
    for fleet in starts.chunks(4) {
        for pair in fleet.windows(2) {
            assert!(
                (pair[1].secs_since(pair[0]) - 3.5 * H).abs() < 1.0,
                "{fleet:?}"
            );
        }
    }
    assert_eq!(v["fleet"]["jobs"], 4);
    let pools = v["fleet"]["first_fleet_pools"]["bidbrain"]
        .as_array()
        .unwrap();
    assert_eq!(pools.len(), 1, "{v}");
    assert!(pools[0]["observations"].as_u64().unwrap() > 0, "{v}");
    for p in v["policies"].as_array().unwrap() {
        assert_eq!(p["runs_by_start"].as_array().unwrap().len(), 8, "{p}");
    }
}

/// `--optimal` through the binary for every family: several zones (a move between zones pays
/// the restart), an elastic job (a relaxation), each at or below every policy on every start
/// that finished in time; files of different periods are refused, naming both.
#[test]
fn the_optimum_covers_every_zone_and_elastic_jobs_and_stays_below_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    let period = dir.path().join("aws-02-15-2023");
    std::fs::create_dir(&period).unwrap();
    // 3 days of 10-minute ticks.
    let write_ticks = |dir: &std::path::Path, zone: &str, up: &dyn Fn(usize) -> bool| {
        let file = dir.join(format!("{zone}_v100_1.json"));
        std::fs::write(&file, trace_text((0..432).map(up))).unwrap();
        file
    };
    // Two zones whose outages alternate.
    let write = |dir: &std::path::Path, zone: &str, phase: usize| {
        write_ticks(dir, zone, &|i| (i / 18 + phase).is_multiple_of(2))
    };
    let a = write(&period, "us-east-1a", 0);
    let b = write(&period, "us-east-1b", 1);
    let run = |files: &[&std::path::Path], args: &[&str]| -> serde_json::Value {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_proteus"));
        cmd.arg("simulate");
        for f in files {
            cmd.arg("--availability").arg(f);
        }
        let out = cmd
            .args([
                "--work-hours",
                "12",
                "--deadline-hours",
                "20",
                "--restart-overhead-hours",
                "0.02",
                "--starts",
                "6",
                "--seed",
                "2",
                "--output",
                "json",
            ])
            .args(args)
            .env("PROTEUS_LOG", "warn")
            .env_remove("PROTEUS_POLICIES_DIR")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let costs = |v: &serde_json::Value, policy: &str| -> Vec<(bool, f64)> {
        v["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["policy"] == policy)
            .unwrap_or_else(|| panic!("no {policy}: {v}"))["runs_by_start"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["deadline_met"].as_bool().unwrap(),
                    r["cost_usd"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let policies = [
        "bidbrain",
        "uniform-progress-all-zones",
        "uniform-progress-all-zones-mbb",
        "skypilot-default",
    ];
    for instances in ["1", "3"] {
        let both = run(&[&a, &b], &["--instances", instances, "--optimal"]);
        let bound = costs(&both, "hindsight-optimal");
        assert!(bound.iter().all(|(met, _)| *met), "{both}");
        let ran = run(
            &[&a, &b],
            &[&["--instances", instances, "--compare"][..], &policies[..]].concat(),
        );
        for policy in policies {
            for (i, ((_, best), (met, paid))) in bound.iter().zip(costs(&ran, policy)).enumerate() {
                assert!(
                    !met || *best <= paid + 1e-6,
                    "{instances} instance(s), start {i}: the bound ${best} is above {policy}'s \
                     ${paid}"
                );
            }
        }
        if instances == "1" {
            // One zone alone: never cheaper than with both to move between.
            let one = run(&[&a], &["--optimal"]);
            for ((_, two), (_, single)) in bound.iter().zip(costs(&one, "hindsight-optimal")) {
                assert!(*two <= single + 1e-9, "{two} vs {single}");
            }
            assert!(
                bound
                    .iter()
                    .zip(costs(&one, "hindsight-optimal"))
                    .any(|((_, two), (_, single))| *two < single - 1.0),
                "moving between zones saves on some start"
            );
        }
    }
    // A pool with one-tick outages between runs of 5 h and of 40 minutes (as the 2022
    // us-west-2b file has): every policy there collects free rides and notices at the outages,
    // which starts inside a tick must not hide from the bound.
    let flaky = write_ticks(&period, "us-east-1c", &|i| !matches!(i % 36, 30 | 35));
    let bound = costs(&run(&[&flaky], &["--optimal"]), "hindsight-optimal");
    let single = ["bidbrain", "uniform-progress", "skypilot-default"];
    let ran = run(&[&flaky], &[&["--compare"][..], &single[..]].concat());
    for policy in single {
        for (i, ((_, best), (met, paid))) in bound.iter().zip(costs(&ran, policy)).enumerate() {
            assert!(
                !met || *best <= paid + 1e-6,
                "one-tick outages, start {i}: the bound ${best} is above {policy}'s ${paid}"
            );
        }
    }
    // A file of another period: refused, naming both files.
    let other = dir.path().join("aws-10-26-2022");
    std::fs::create_dir(&other).unwrap();
    let c = write(&other, "us-west-2a", 0);
    let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(["simulate", "--availability"])
        .arg(&a)
        .arg("--availability")
        .arg(&c)
        .args(["--work-hours", "1", "--deadline-hours", "2", "--optimal"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("aws-10-26-2022")
            && err.contains("us-east-1a_v100_1.json")
            && err.contains("same period"),
        "{err}"
    );
}

#[test]
fn bidbrain_paces_against_the_deadline_on_spot_and_buys_on_demand_only_when_it_must() {
    // Spot for 2 h, none for 2 h, then spot again.
    let a = world(&[(
        "us-west-2a",
        &format!("{}{}{}", "1".repeat(12), "0".repeat(12), "1".repeat(60)),
    )]);
    let od = simulate(&a, "on-demand", 4.0, 9.0);
    // A loose deadline: it waits out the gap on spot.
    let loose = simulate(&a, "bidbrain", 4.0, 9.0);
    assert_eq!(loose.outcome, Outcome::Completed, "{}", loose.end_reason);
    assert!(loose.instance_hours_transient > 0.0, "{loose:?}");
    assert!(loose.cost_usd.get() < od.cost_usd.get() / 2.0, "{loose:?}");
    // A tight one: behind the line in the gap, it buys on-demand and still finishes in time.
    let tight = simulate(&a, "bidbrain", 4.0, 4.6);
    assert_eq!(tight.outcome, Outcome::Completed, "{}", tight.end_reason);
    assert!(tight.instance_hours_reliable > 0.0, "{tight:?}");
    assert!(tight.instance_hours_transient > 0.0, "{tight:?}");
    // No spot at all: the safety net and the line put the whole job on on-demand in time.
    let none = world(&[("us-west-2a", &"0".repeat(84))]);
    let forced = simulate(&none, "bidbrain", 4.0, 5.0);
    assert_eq!(forced.outcome, Outcome::Completed, "{}", forced.end_reason);
    assert_eq!(forced.instance_hours_transient, 0.0);
    // The hindsight optimum is below every policy's cost on the same trace.
    let capacity: Vec<u32> = format!("{}{}{}", "1".repeat(12), "0".repeat(12), "1".repeat(60))
        .chars()
        .map(|c| c.to_digit(10).unwrap())
        .collect();
    let best = proteus_broker::sim::optimal::optimum(&proteus_broker::sim::optimal::OptimalCase {
        capacity: vec![&capacity],
        offset_secs: 0.0,
        gap_secs: 600.0,
        work_secs: 4.0 * H,
        deadline_secs: 4.6 * H,
        overhead_secs: 0.1 * H,
        spot_usd_per_hour: SPOT,
        on_demand_usd_per_hour: OD,
    });
    let proteus_broker::sim::optimal::Optimum::Cost(best) = best else {
        panic!("feasible")
    };
    for r in [&tight, &od] {
        assert!(
            best <= r.cost_usd.get() + 1e-9,
            "{best} vs {}",
            r.cost_usd.get()
        );
    }
}

/// Where BidBrain's deadline plan and Uniform Progress part: a short outage with hours of slack
/// behind the line is waited out (Uniform Progress buys on-demand for it and pays its restart
/// twice), and on-demand bought in a long outage is left for spot only once spot has lasted,
/// without losing the restart (the spot instance starts beside it).
#[test]
fn the_deadline_plan_waits_out_a_short_outage_and_leaves_on_demand_without_a_gap() {
    // Up 30 min, down 30 min (a short outage), then up for good: behind the line in the outage.
    let short = world(&[(
        "us-west-2a",
        &format!("{}{}{}", "1".repeat(3), "0".repeat(3), "1".repeat(90)),
    )]);
    let up = simulate(&short, "uniform-progress", 8.0, 10.0);
    let bb = simulate(&short, "bidbrain", 8.0, 10.0);
    for r in [&up, &bb] {
        assert_eq!(
            r.outcome,
            Outcome::Completed,
            "{}: {}",
            r.policy,
            r.end_reason
        );
    }
    assert!(up.instance_hours_reliable > 0.0, "{up:?}");
    assert_eq!(bb.instance_hours_reliable, 0.0, "{bb:?}");
    assert!(bb.cost_usd.get() < up.cost_usd.get(), "{bb:?} vs {up:?}");

    // Down 4 h (on-demand is bought), then up for good, with little slack: both policies end on
    // spot, but the plan moves there with the on-demand instance still working, so it needs no
    // more on-demand time than Uniform Progress does.
    let long = world(&[(
        "us-west-2a",
        &format!("{}{}", "0".repeat(24), "1".repeat(90)),
    )]);
    let up = simulate(&long, "uniform-progress", 8.0, 9.0);
    let bb = simulate(&long, "bidbrain", 8.0, 9.0);
    for r in [&up, &bb] {
        assert_eq!(
            r.outcome,
            Outcome::Completed,
            "{}: {}",
            r.policy,
            r.end_reason
        );
        assert!(
            r.instance_hours_reliable > 0.0 && r.instance_hours_transient > 0.0,
            "{r:?}"
        );
    }
    assert!(
        bb.instance_hours_reliable <= up.instance_hours_reliable + 0.2,
        "{bb:?} vs {up:?}"
    );
    assert!(
        bb.cost_usd.get() <= up.cost_usd.get() + 0.5,
        "{bb:?} vs {up:?}"
    );
    // Every BidBrain decision on the way says what the plan expected of it.
    let planned = bb
        .decisions
        .iter()
        .flat_map(|(_, d)| &d.reasons)
        .filter(|r| r.rule.starts_with("deadline plan:"))
        .count();
    assert!(planned > 0, "{:?}", bb.decisions);
}

/// The chance of the pool being up that a BidBrain decision's rule states ("pool up with
/// probability 0.76").
fn stated_p_up(r: &RunResult) -> f64 {
    let rule = r
        .decisions
        .iter()
        .flat_map(|(_, d)| &d.reasons)
        .map(|x| x.rule.as_str())
        .find(|x| x.contains("pool up with probability"))
        .unwrap_or_else(|| panic!("no plan decision in {:?}", r.decisions));
    let tail = &rule[rule.find("probability ").unwrap() + "probability ".len()..];
    tail[..4].parse().unwrap_or_else(|e| panic!("{rule}: {e}"))
}

fn fleet(
    sc: &Scenario,
    starts_h: &[f64],
    deadline_h: f64,
    learn: bool,
) -> proteus_broker::sim::fleet::FleetResult {
    let jobs = starts_h
        .iter()
        .map(|&h| {
            (
                parse_policy("bidbrain.toml", "kind = \"bidbrain\"\n").unwrap(),
                Timestamp::from_millis((h * H * 1000.0) as i64),
            )
        })
        .collect();
    let options: Vec<RunOptions> = starts_h
        .iter()
        .map(|_| RunOptions {
            deadline: Some(Deadline::After(deadline_h * H)),
            record_decisions: true,
            ..RunOptions::default()
        })
        .collect();
    proteus_broker::sim::fleet::run_fleet(
        sc,
        jobs,
        &options,
        proteus_broker::policy::TodayConfig::default().availability,
        learn,
    )
    .unwrap()
}

#[test]
fn a_job_of_a_fleet_knows_what_another_jobs_interruption_said_of_the_pool() {
    // Up 3 h, then down 6 h, then up for good. Job A starts at 0 and runs on spot until the
    // pool goes at 3 h; job B starts at 3 h 5 min.
    let a = world(&[(
        "us-west-2a",
        &format!("{}{}{}", "1".repeat(18), "0".repeat(36), "1".repeat(200)),
    )]);
    let sc = scenario(&a, 4.0);
    let alone = fleet(&sc, &[3.0 + 5.0 / 60.0], 12.0, false);
    let together = fleet(&sc, &[0.0, 3.0 + 5.0 / 60.0], 12.0, false);
    for r in alone.runs.iter().chain(&together.runs) {
        assert_eq!(r.outcome, Outcome::Completed, "{}", r.end_reason);
    }
    // Alone, B knows nothing of the pool: the model's long-run mix, mostly up. In the fleet it
    // knows the pool went down five minutes ago: a fresh outage.
    let b_alone = stated_p_up(&alone.runs[0]);
    let b_fleet = stated_p_up(&together.runs[1]);
    assert!(b_alone > 0.6, "alone: {b_alone}");
    assert!(b_fleet < 0.4, "in the fleet: {b_fleet}");
    // The book saw both jobs: A's launch and interruption, B's tries.
    let pool = &together.pools[0];
    let launches: u32 = together
        .runs
        .iter()
        .map(|r| r.launches + r.failed_launches)
        .sum();
    assert!(pool.observations >= 2 && pool.up.ends >= 1.0, "{pool:?}");
    assert!(
        pool.observations <= u64::from(launches) * 2,
        "{pool:?} from {launches} launches"
    );
}

#[test]
fn a_fleet_learns_a_pool_whose_up_runs_outlast_the_prior() {
    // Up 12 h, down 20 min, over and over: the prior (fitted on 2022 pools whose up runs last
    // 3–4 h) expects several ends per run. Four jobs, 8 h of work, 12 h deadlines, 6 h apart.
    let cycle = format!("{}{}", "1".repeat(72), "0".repeat(2));
    let a = world(&[("us-west-2a", &cycle.repeat(20))]);
    let sc = scenario(&a, 8.0);
    let starts = [0.0, 6.0, 12.0, 18.0, 24.0, 30.0, 36.0, 42.0];
    let learned = fleet(&sc, &starts, 12.0, true);
    let fixed = fleet(&sc, &starts, 12.0, false);
    for r in learned.runs.iter().chain(&fixed.runs) {
        assert_eq!(r.outcome, Outcome::Completed, "{}", r.end_reason);
    }
    let pool = &learned.pools[0];
    assert!(pool.up.ends >= 2.0, "{pool:?}");
    assert!(
        pool.up.expected > pool.up.ends,
        "the prior expected more ends than were seen: {pool:?}"
    );
    assert!(pool.up_multiplier < 1.0, "{pool:?}");
    assert!(pool.up_share > fixed.pools[0].up_share, "{pool:?}");
    assert_eq!(fixed.pools[0].up_multiplier, 1.0);
}
