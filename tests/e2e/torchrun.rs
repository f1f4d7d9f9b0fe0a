//! `launcher = "torchrun"` end to end with real torch (PyPI's wheel, on CPU with gloo): a
//! data-parallel MLP on the digits (`examples/command/torch_train.py`) on three instances of
//! the sim cloud — the reliable one hosts the c10d rendezvous — one spot node warned mid-run
//! with `proteus interrupt`. The warned node leaves the rendezvous, the survivors re-form
//! without it and go on from their last checkpoint, a replacement joins the same rendezvous,
//! and the job completes.
//!
//! Needs the torch virtualenv: `scripts/test` builds it (`torch/venv`, cached under
//! `$PROTEUS_CACHE_DIR`) and exports `PROTEUS_TEST_TORCH_VENV`; an explicit
//! `PROTEUS_TEST_TORCH=0` leaves the test out of the run (libtest's `--skip`).

use proteus_e2e::{BrokerProcess, fresh_pg_database, proteus, write_c3_trace};
use std::time::Duration;

const STEPS: u64 = 400;
const CHECKPOINT_EVERY: u64 = 5;

fn program() -> String {
    proteus_e2e::example_program("torch_train.py")
}

/// The numbers after `key` (e.g. `"world="`) on lines starting with `prefix`.
fn field(text: &str, prefix: &str, key: &str) -> Vec<u64> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.split(key).nth(1))
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok())
        })
        .collect()
}

/// Steps printed in a world of `world` workers.
fn steps_in_world(text: &str, world: u64) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("step "))
        .filter(|rest| rest.contains(&format!(" world={world} ")))
        .filter_map(|rest| rest.split(' ').next().and_then(|n| n.parse().ok()))
        .collect()
}

async fn tails(broker: &BrokerProcess, id: i64) -> Vec<(String, String)> {
    let v = broker.client().get(&format!("/v1/jobs/{id}/logs")).await;
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["instance_id"].as_str().unwrap().to_string(),
                t["output"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The job's event history, one line per event, for failure messages.
async fn events(broker: &BrokerProcess, id: i64) -> String {
    let v = broker.client().get(&format!("/v1/jobs/{id}/events")).await;
    v.as_array()
        .map(|events| {
            events
                .iter()
                .map(|e| {
                    format!(
                        "{} {} {} {}",
                        e["time"].as_str().unwrap_or(""),
                        e["instance_id"].as_str().unwrap_or("-"),
                        e["kind"].as_str().unwrap_or(""),
                        e["detail"].as_str().unwrap_or("")
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_else(|| v.to_string())
}

fn story(tails: &[(String, String)]) -> String {
    tails
        .iter()
        .map(|(i, t)| format!("==> {i}\n{t}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchrun_survivors_reform_after_a_warned_node_leaves_and_the_job_completes() {
    // `scripts/test` installs torch and sets it; `PROTEUS_TEST_TORCH=0` leaves this test out
    // of the run (`--skip torchrun::`) rather than letting it pass without running.
    let venv = std::env::var("PROTEUS_TEST_TORCH_VENV").expect(
        "no torch virtualenv: run the suite through scripts/test (it installs torch, ~2.6 GB, \
         once, under $PROTEUS_CACHE_DIR)",
    );
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(dir.path(), None);
    let db = fresh_pg_database().await;
    // At 60x a two-minute notice is 2 s: give the warned node 20 real seconds, as EC2's 120 s
    // leave a real one enough time to save and leave.
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &[
            "--trace",
            &trace,
            "--on-demand",
            &od,
            "--min-notice-secs",
            "20",
        ],
    )
    .await;
    let path = format!(
        "{venv}/bin:{}",
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    );
    let spec = format!(
        "name = \"torchrun-digits\"\napp = \"command\"\npolicy = \"bidbrain\"\n\
         [limits]\nmax_instances = 3\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 1.0\ninstance_types = [\"c3.xlarge\"]\nstartup_minutes = 1.0\n\
         [command]\nrun = [\"python3\", \"{}\"]\nlauncher = \"torchrun\"\n\
         checkpoint_interval_secs = 1\nkill_margin_secs = 5\n\
         [command.env]\nPATH = \"{path}\"\nSTEPS = \"{STEPS}\"\nSTEP_SECS = \"0.05\"\n\
         CHECKPOINT_EVERY = \"{CHECKPOINT_EVERY}\"\nOMP_NUM_THREADS = \"1\"\n",
        program()
    );
    let sub = dir.path().join("job");
    std::fs::create_dir_all(&sub).unwrap();
    let id = broker.submit_file(&sub, &spec);
    let api = broker.client();

    // All three train together (world 3), some way into the run.
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let job = loop {
        let job = api.get(&format!("/v1/jobs/{id}")).await;
        let t = tails(&broker, id).await;
        let in_three = t
            .iter()
            .filter(|(_, o)| steps_in_world(o, 3).last().is_some_and(|&s| s >= 40))
            .count();
        if in_three == 3 {
            break job;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the three never trained together: {job}\n{}",
            story(&t)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let instances = job["instances"].as_array().unwrap();
    let workers: Vec<&serde_json::Value> = instances
        .iter()
        .filter(|i| i["worker_rank"].is_u64())
        .collect();
    assert_eq!(workers.len(), 3, "{job}");
    let host = workers
        .iter()
        .find(|i| i["tier"] == "reliable")
        .unwrap_or_else(|| panic!("no reliable worker to host the rendezvous: {job}"))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let victim = workers
        .iter()
        .find(|i| i["tier"] == "transient")
        .unwrap_or_else(|| panic!("no spot worker: {job}"))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let originals: Vec<String> = workers
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect();

    let interrupted_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let (code, _, err) = proteus(None, &["interrupt", &victim], &broker.user_env());
    assert_eq!(code, 0, "proteus interrupt failed: {err}");

    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    let done = loop {
        let job = api.get(&format!("/v1/jobs/{id}")).await;
        if job["state"] != "running" && job["state"] != "pending" {
            break job;
        }
        if std::time::Instant::now() > deadline {
            panic!(
                "the torchrun job did not finish: {job}\n{}",
                story(&tails(&broker, id).await)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["progress"].as_f64(), Some(1.0), "{done}");
    let t = tails(&broker, id).await;
    let of = |iid: &str| {
        t.iter()
            .find(|(i, _)| i == iid)
            .map(|(_, o)| o.clone())
            .unwrap_or_else(|| panic!("no output of {iid}:\n{}", story(&t)))
    };

    // The warned node got the notice, saved, and left the rendezvous without closing it.
    let warned = of(&victim);
    assert!(warned.contains("notice delivered (SIGTERM)"), "{warned}");
    assert!(
        warned.contains("[proteus-torchrun] left the rendezvous"),
        "{warned}"
    );
    let last_warned = *steps_in_world(&warned, 3).last().unwrap();

    // Nothing ran on the warned node after its interruption notice (an earlier notice may be a
    // rendezvous move's: the move writes the notice file too, and torchrun starts again).
    let interruption = warned
        .lines()
        .rfind(|l| l.contains("notice delivered") && l.contains("spot instance"))
        .unwrap_or_else(|| panic!("no interruption notice:\n{warned}"));
    let after_notice = &warned[warned.rfind(interruption).unwrap()..];
    assert!(!after_notice.contains("\nstart "), "{warned}");

    // The survivors re-formed without it (in a world of 2, or of 3 when the replacement was
    // already waiting), from no further back than one checkpoint interval, and trained on;
    // the rendezvous was never closed and its host's torchrun never restarted.
    for s in originals.iter().filter(|i| **i != victim) {
        let out = of(s);
        // The program stamps its start lines with the wall clock (one machine).
        let reformed = out
            .lines()
            .position(|l| {
                l.starts_with("start ")
                    && l.rsplit(" t=")
                        .next()
                        .and_then(|t| t.parse::<f64>().ok())
                        .is_some_and(|t| t > interrupted_at)
            })
            .unwrap_or_else(|| panic!("{s} never re-formed:\n{}", story(&t)));
        let line = out.lines().nth(reformed).unwrap();
        let from = field(line, "start ", "resumed_from=")[0];
        assert!(
            from + CHECKPOINT_EVERY >= last_warned && from <= last_warned + 1,
            "{s} resumed from {from}, the warned node was at {last_warned}:\n{out}"
        );
        // It trains on from where a start after the notice resumed it: the first re-formed
        // world, or a later one (under load the replacement may join right after the survivors
        // re-formed, and torchrun re-forms again, from the newest checkpoint of any rank).
        let lines: Vec<&str> = out.lines().skip(reformed).collect();
        let trained = lines.iter().enumerate().any(|(k, l)| {
            l.starts_with("start ")
                && field(l, "start ", "resumed_from=")
                    .first()
                    .is_some_and(|r| {
                        *r >= from
                            && lines[k + 1..]
                                .iter()
                                .any(|m| m.starts_with(&format!("step {} ", r + 1)))
                    })
        });
        assert!(trained, "{s} did not train after re-forming:\n{out}");
        assert!(
            !out.contains("RendezvousClosedError") && !out.contains("rendezvous is closed"),
            "{out}"
        );
        if *s == host {
            assert_eq!(
                out.matches("[proteus-agent] starting ").count(),
                1,
                "the rendezvous host restarted torchrun:\n{out}"
            );
        }
    }

    // A replacement joined the same rendezvous (world 3 again), took the warned node's Proteus
    // rank (one holder at a time: it waited for the warned node to leave), restored that rank's
    // own checkpoint as the contract says, and started from the survivors' state, not from
    // scratch. The policy may retire or lose another instance while the job runs (an hour is a
    // wall minute here): every newcomer then holds one rank for its whole life and restores
    // that rank's checkpoint, and the warned node's rank is among theirs.
    let victim_rank = field(&warned, "start ", "proteus_rank=")
        .last()
        .copied()
        .unwrap_or_else(|| panic!("the warned node never started:\n{warned}"));
    let history = events(&broker, id).await;
    let newcomers: Vec<&(String, String)> = t
        .iter()
        .filter(|(i, o)| !originals.contains(i) && o.contains("start rank="))
        .collect();
    assert!(
        !newcomers.is_empty(),
        "no replacement joined:\n{}\n{history}",
        story(&t)
    );
    for (i, out) in &newcomers {
        let held = field(out, "start ", "proteus_rank=");
        assert!(
            held.windows(2).all(|w| w[0] == w[1]),
            "{i} changed rank: {held:?}\n{}\n{history}",
            story(&t)
        );
        assert!(
            out.contains(&format!("restored the checkpoint of rank {}", held[0])),
            "{i} holds rank {} but did not restore its checkpoint:\n{}\n{history}",
            held[0],
            story(&t)
        );
    }
    let replacement = newcomers
        .iter()
        .find(|(_, o)| field(o, "start ", "proteus_rank=").first() == Some(&victim_rank))
        .unwrap_or_else(|| {
            panic!(
                "no replacement took the warned node's rank {victim_rank}:\n{}\n{history}",
                story(&t)
            )
        });
    let resumed = field(&replacement.1, "start ", "resumed_from=");
    assert!(
        resumed
            .first()
            .is_some_and(|&r| r + CHECKPOINT_EVERY >= last_warned),
        "{}",
        replacement.1
    );
    assert!(
        !steps_in_world(&replacement.1, 3).is_empty(),
        "{}",
        replacement.1
    );
    // The loss curve is continuous across the eviction: the first loss the survivors print
    // after re-forming is close to their last before it, far below the untrained model's.
    let losses = |text: &str| -> Vec<(u64, f64)> {
        text.lines()
            .filter_map(|l| l.strip_prefix("step "))
            .filter_map(|rest| {
                let step = rest.split(' ').next()?.parse().ok()?;
                let loss = rest.split("loss=").nth(1)?.trim().parse().ok()?;
                Some((step, loss))
            })
            .collect()
    };
    for s in originals.iter().filter(|i| **i != victim) {
        let curve = losses(&of(s));
        let first = curve.first().map(|c| c.1).unwrap_or(f64::NAN);
        let before = curve
            .iter()
            .filter(|(step, _)| *step + 10 > last_warned && *step <= last_warned)
            .map(|c| c.1)
            .fold(f64::NAN, f64::max);
        let after = curve
            .iter()
            .filter(|(step, _)| *step > last_warned && *step <= last_warned + 10)
            .map(|c| c.1)
            .fold(f64::NAN, f64::min);
        assert!(
            after.is_finite() && before.is_finite() && after <= before * 1.5 + 0.05,
            "{s}: the loss jumped from {before} to {after} across the eviction (first {first})"
        );
        assert!(
            after < first * 0.95,
            "{s}: the loss after the eviction ({after}) is back at the untrained {first}"
        );
    }
    let host_out = of(&host);
    let acc: Vec<&str> = host_out
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("done step={STEPS} accuracy=")))
        .collect();
    let acc: f64 = acc
        .first()
        .unwrap_or_else(|| panic!("the host did not finish:\n{host_out}"))
        .parse()
        .unwrap();
    assert!(acc > 0.8, "accuracy {acc} after {STEPS} steps");
}
