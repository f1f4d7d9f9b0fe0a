//! The broker's own eviction path, end to end, on a hand-made trace: a price spike in the sim
//! cloud warns the spot instances, the scheduler records the warning, the launcher delivers
//! the notice through each instance's metadata endpoint, the agents hand their shards over, the
//! ledger bills the hour as provider-ended (free under `hourly-2015`), and the job completes.
//! Nothing here posts a notice by hand.

use proteus_e2e::{BrokerProcess, fresh_pg_database, sim_minutes, write_c3_trace};
use std::time::Duration;

/// Market minutes after the start when both c3.xlarge spot markets spike above any bid, and
/// how long the spike lasts. The tests hold the market a minute before it (`--hold-at`) until
/// what the spike must find is there (agents training, a program past its first checkpoint),
/// and then lift the hold: the spike comes a market minute later, whatever this machine's speed.
pub(crate) const SPIKE_AT_MIN: i64 = 15;
pub(crate) const SPIKE_MIN: i64 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_price_spike_warns_agents_that_hand_over_and_the_job_completes() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(dir.path(), Some((SPIKE_AT_MIN, SPIKE_MIN)));
    let db = fresh_pg_database().await;
    // Held one market second before the spike (a sixtieth of a wall second at this speed), so
    // that the market itself adds no wall time between the hold's lift and the spike.
    let hold = (chrono::DateTime::parse_from_rfc3339(&sim_minutes(SPIKE_AT_MIN))
        .expect("RFC 3339")
        - chrono::Duration::seconds(1))
    .to_rfc3339();
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &[
            "--trace",
            &trace,
            "--on-demand",
            &od,
            "--billing",
            "hourly-2015",
            "--hold-at",
            &hold,
        ],
    )
    .await;
    // BidBrain with one reliable instance for the backups and two spot ones; stage 2 at a
    // 2:1 ratio puts the active shards on the spot instances, so a warning must move them.
    // Each worker trains at most 20,000 samples a second: the 60 epochs of 60,000 samples take
    // at least a minute of wall time on three workers however fast this machine is, so the
    // spike's notice (a scheduler tick and a metadata poll, about a second) finds them still
    // training. Unpaced, a release build finished before the notice arrived.
    let id = broker.submit_file(
        dir.path(),
        "name = \"spike\"\napp = \"mlr\"\ndataset = \"mnist\"\npolicy = \"bidbrain\"\n\
         [stop]\nepochs = 60\n[limits]\nmax_instances = 3\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 2.0\ninstance_types = [\"c3.xlarge\"]\nstartup_minutes = 1.0\n\
         [training]\nnum_shards = 2\nstage2_ratio = 1.0\nstage3_ratio = 10.0\nseed = 11\npace_samples_per_sec = 20000.0\n",
    );
    // The market waits a second before the spike until the job is in stage 2 and training:
    // then the spike finds the active shards on the spot instances. (Seen past half its
    // training, the job could end before the spike: that fails here, not later.)
    let api = broker.client();
    let seen = api
        .wait_for(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(180),
            "the job training in stage 2 before the spike",
            |j| j["stage"] == 2 && j["progress"].as_f64().unwrap_or(0.0) > 0.0,
        )
        .await;
    assert!(
        seen["progress"].as_f64().unwrap_or(1.0) < 0.5,
        "the job was past half its training when it reached stage 2: {seen}"
    );
    api.lift_hold().await;
    let job = broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(400),
            "the job to finish",
        )
        .await;
    assert!(
        job["metric"]["value"].as_f64().unwrap() > 0.85,
        "training went on after the spike: {job}"
    );

    // The job's end releases its instances; their ends (an eviction for a warned one) are
    // recorded when the cloud reports them, a tick or two later.
    let job = api
        .wait_for(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(60),
            "every instance's end recorded",
            |j| {
                j["instances"]
                    .as_array()
                    .is_some_and(|a| a.iter().all(|i| i["ended"].is_string()))
            },
        )
        .await;
    let events = api.get(&format!("/v1/jobs/{id}/events")).await;
    let events = events.as_array().unwrap();
    let cost = api.get(&format!("/v1/jobs/{id}/cost")).await;
    let lines = cost["lines"].as_array().unwrap();
    let mut stories = Vec::new();
    let mut through_the_path = 0;
    for inst in job["instances"].as_array().unwrap() {
        let iid = inst["id"].as_str().unwrap();
        let kinds: Vec<&str> = events
            .iter()
            .filter(|e| e["instance_id"] == iid)
            .map(|e| e["kind"].as_str().unwrap())
            .collect();
        stories.push(format!("{iid} {}: {}", inst["tier"], kinds.join(" ")));
        let first = |k: &str| kinds.iter().position(|x| *x == k);
        let last = |k: &str| kinds.iter().rposition(|x| *x == k);
        let (Some(warned), Some(notice), Some(handover), Some(gone)) = (
            first("interruption_warning"),
            first("agent_interruption_notice"),
            last("handover_complete"),
            first("evicted"),
        ) else {
            continue;
        };
        assert!(
            warned < notice && notice < handover && handover < gone,
            "{iid}: out of order: {kinds:?}"
        );
        assert_eq!(inst["tier"], "transient");
        let mut own: Vec<&serde_json::Value> =
            lines.iter().filter(|l| l["instance_id"] == iid).collect();
        // RFC 3339 in one format: ordered as text.
        own.sort_by_key(|l| l["start"].as_str().unwrap().to_string());
        assert_eq!(
            own.last().map(|l| &l["free"]),
            Some(&serde_json::json!(true)),
            "{iid}: the provider ended it inside its hour, which is free: {own:?}"
        );
        through_the_path += 1;
    }
    assert!(
        through_the_path >= 1,
        "no instance went warning → notice → hand-over → eviction:\n{}",
        stories.join("\n")
    );
    assert!(cost["evictions"].as_u64().unwrap() >= 1, "{cost}");
    assert!(cost["free_hours"].as_f64().unwrap() > 0.0, "{cost}");
}
