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

/// Zones of ten-minute ticks, `1` where spot can be had.
fn world(zones: &[(&str, &str)]) -> Arc<Availability> {
    let traces = zones
        .iter()
        .map(|(zone, ticks)| {
            let data: Vec<String> = ticks.chars().map(|c| c.to_string()).collect();
            let text = format!(
                "{{\"metadata\": {{\"gap_seconds\": 600}}, \"data\": [{}]}}",
                data.join(",")
            );
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
    let sc = Scenario::new(
        history,
        job,
        BillingModel::PerSecond,
        World::Availability(a.clone()),
        Box::new(HazardModel::new(HazardPrior::default())),
    )
    .unwrap();
    let mut p = parse_policy(&format!("{policy}.toml"), &format!("kind = \"{policy}\"\n")).unwrap();
    let options = RunOptions {
        deadline: Some(Deadline::After(deadline_h * H)),
        record_decisions: true,
        ..RunOptions::default()
    };
    run(&sc, p.as_mut(), Timestamp::from_millis(0), &options).unwrap()
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
    // With slack to spare it moves to spot once spot is back, and pays less than on-demand.
    let relaxed = simulate(&a, "uniform-progress", 4.0, 14.0);
    assert_eq!(
        relaxed.outcome,
        Outcome::Completed,
        "{}",
        relaxed.end_reason
    );
    assert!(relaxed.instance_hours_transient > 0.0, "{relaxed:?}");
    let od = simulate(&a, "on-demand", 4.0, 6.0);
    assert_eq!(od.outcome, Outcome::Completed);
    assert!(
        (od.cost_usd.get() - OD * (4.0 + 0.1)).abs() < 0.01,
        "{}",
        od.cost_usd.get()
    );
    assert!(relaxed.cost_usd.get() < od.cost_usd.get());
}

#[test]
fn simulate_availability_prints_the_documented_keys_and_explains_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("us-west-2a_v100_1.json");
    let mut data = vec!["1"; 600];
    for d in data.iter_mut().skip(100).take(50) {
        *d = "0";
    }
    std::fs::write(
        &file,
        format!(
            "{{\"metadata\": {{\"gap_seconds\": 600}}, \"data\": [{}]}}",
            data.join(",")
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(["simulate", "--availability"])
        .arg(&file)
        .args([
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
            "--output",
            "json",
        ])
        .env("PROTEUS_LOG", "warn")
        .env_remove("PROTEUS_POLICIES_DIR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
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
    assert!(!gap.exists());
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
        capacity: &capacity,
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
