//! N simulated agents heartbeating once a second against a broker built in this process.
//!
//! The broker runs as `proteus serve --cloud sim --local-agents false` would (API, scheduler and
//! simulated cloud, on a runtime of its own) on the database given. Before it serves, a job is
//! submitted (policy `on-demand`, `max_instances` = N, so the scheduler buys nothing more) and N
//! on-demand instances are launched in the simulated cloud with agent tokens made here, stored
//! as the scheduler stores its own (`insert_instance`, `mark_launched`). Then each simulated agent
//! does over HTTP what `proteus-agent` does: registers, reports `ready`, keeps a command long poll
//! open, and heartbeats once a second. Heartbeat latency is what is measured.

use crate::inproc;
use crate::load::{client, client_with_timeout, closed_loop};
use crate::stats::{Samples, Summary};
use anyhow::{Context, Result, anyhow, bail};
use proteus_broker::api::auth::{hash_token, new_token};
use proteus_broker::cloud::LaunchSpec;
use proteus_broker::policy::Purchase;
use proteus_broker::service::spec::JobSpec;
use proteus_broker::store::InstanceRow;
use proteus_wire::agent_api::{AgentEvent, Heartbeat, Progress, RegisterRequest};
use proteus_wire::{InstanceId, JobId, Tier};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The database (Postgres URL); migrated if needed.
    #[arg(long, env = "PROTEUS_DATABASE_URL")]
    pub database_url: String,
    #[arg(long, default_value_t = 500)]
    pub agents: usize,
    /// Seconds of heartbeating measured.
    #[arg(long, default_value_t = 30.0)]
    pub secs: f64,
    /// HTTP clients the agents share for heartbeats (each keeps its own connections).
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// Worker threads of the broker's runtime.
    #[arg(long, default_value_t = 2)]
    pub broker_threads: usize,
    /// Worker threads of the load generator's runtime.
    #[arg(long, default_value_t = 1)]
    pub load_threads: usize,
    /// Do not send `ready` (members stay joining, no layout is computed).
    #[arg(long)]
    pub no_ready: bool,
    /// Do not keep a command long poll open per agent.
    #[arg(long)]
    pub no_long_poll: bool,
    #[arg(long, default_value_t = 50.0)]
    pub target_p99_ms: f64,
}

struct Agent {
    cloud_id: String,
    token: String,
}

pub fn run(args: Args) -> Result<bool> {
    let broker_rt = inproc::runtime(args.broker_threads, "broker")?;
    let user_token = new_token("pt_");
    let (server, agents) = broker_rt.block_on(setup(&args, &user_token))?;
    let base = format!("http://{}", server.addr);
    let broker = server.broker.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = broker_rt.spawn(server.run_until(async move {
        let _ = stop_rx.await;
    }));

    let load_rt = inproc::runtime(args.load_threads, "loadgen")?;
    let outcome = load_rt.block_on(drive(&args, &base, Arc::new(agents)));
    let _ = stop_tx.send(());
    let _ = broker_rt.block_on(serving);
    let job_state = broker_rt.block_on(async {
        let jobs = broker.store().jobs(false).await.ok()?;
        Some(jobs.first()?.state.to_string())
    });
    drop(broker);
    load_rt.shutdown_timeout(Duration::from_secs(2));
    broker_rt.shutdown_timeout(Duration::from_secs(5));
    let (hb, registration) = outcome?;
    let s = hb.summary();
    report(&args, &hb, &s, &registration, job_state.as_deref());
    Ok(s.p99_ms < args.target_p99_ms && hb.errors == 0)
}

fn report(args: &Args, hb: &Samples, s: &Summary, registration: &Summary, job: Option<&str>) {
    for e in &hb.first_errors {
        eprintln!("error: {e}");
    }
    println!(
        "agent registration ({} agents, 16 at a time): p50 {:.2} ms, p99 {:.2} ms",
        args.agents, registration.p50_ms, registration.p99_ms
    );
    println!(
        "{} agents heartbeating once a second for {:.0} s{}{}: {} heartbeats ({:.0}/s), {} errors; \
         p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms — target p99 < {:.0} ms: {:.2} of budget; job {}",
        args.agents,
        args.secs,
        if args.no_ready { "" } else { ", all ready" },
        if args.no_long_poll {
            ""
        } else {
            ", each with a command long poll open"
        },
        s.count,
        s.count as f64 / args.secs,
        hb.errors,
        s.p50_ms,
        s.p99_ms,
        s.max_ms,
        args.target_p99_ms,
        s.p99_ms / args.target_p99_ms,
        job.unwrap_or("?")
    );
}

/// Builds the broker, submits the job and launches the agents' instances.
async fn setup(
    args: &Args,
    user_token: &str,
) -> Result<(proteus_broker::startup::Application, Vec<Agent>)> {
    // The broker-wide limits (instance cap, default budget, connection cap) sized for N
    // agents, so that they measure what they did before those limits existed.
    let cap = args.agents.to_string();
    let connections = (4 * args.agents + 64).to_string();
    let server = inproc::build(
        &args.database_url,
        &[
            "--cloud",
            "sim",
            "--local-agents",
            "false",
            "--token",
            user_token,
            "--instance-cap",
            &cap,
            "--default-budget-usd",
            "0",
            "--max-connections",
            &connections,
        ],
    )
    .await?;
    let broker = server.broker.clone();
    let n = args.agents as u32;
    let spec: JobSpec = serde_json::from_value(serde_json::json!({
        "name": "bench-heartbeats",
        "app": "mlr",
        "dataset": "digits",
        "policy": "on-demand",
        "limits": {"max_instances": n, "max_reliable_instances": n},
    }))?;
    let job = broker
        .submit(spec)
        .await
        .map_err(|e| anyhow!("submitting the job: {e}"))?;
    let job = JobId(job.id);
    let data = broker.market_data();
    let market = data
        .markets
        .markets()
        .iter()
        .find(|m| data.markets.on_demand(m).is_some())
        .cloned()
        .context("a market with an on-demand price")?;
    let now = broker.clock().now();
    let mut agents = Vec::with_capacity(args.agents);
    for i in 0..args.agents {
        let token = new_token("pa_");
        let row = InstanceRow::intent(
            format!("pi-{}-bench{i:04}", job.0),
            job,
            market.clone(),
            Purchase::OnDemand,
            hash_token(&token),
            now,
        );
        broker.store().insert_instance(None, &row).await?;
        let launched = broker
            .cloud()
            .launch(&LaunchSpec {
                instance_id: row.id.clone(),
                job_id: job,
                market: market.clone(),
                tier: Tier::Reliable,
                bid: None,
                bootstrap_token: token.clone(),
            })
            .await
            .map_err(|e| anyhow!("launching in the simulated cloud: {e}"))?;
        broker
            .store()
            .mark_launched(
                None,
                &row.id,
                &launched.cloud_id,
                launched.launched.unwrap_or(now),
            )
            .await?;
        agents.push(Agent {
            cloud_id: launched.cloud_id,
            token,
        });
    }
    eprintln!(
        "job {job}: {} on-demand instances in {market}, broker on {}",
        agents.len(),
        server.addr
    );
    Ok((server, agents))
}

/// Registers every agent and starts its heartbeats at once (as `proteus-agent` does: a member
/// silent for 10 s is declared dead), makes it ready, opens its long poll, and then measures
/// `secs` seconds of heartbeats.
async fn drive(args: &Args, base: &str, agents: Arc<Vec<Agent>>) -> Result<(Samples, Summary)> {
    let t0 = std::time::Instant::now();
    let note = |what: String| eprintln!("[{:6.1} s] {what}", t0.elapsed().as_secs_f64());
    let clients: Arc<Vec<reqwest::Client>> =
        Arc::new((0..args.clients.max(1)).map(|_| client()).collect());
    let base: Arc<str> = base.into();

    // Registration, 16 agents at a time.
    let register = {
        let (clients, base, agents) = (clients.clone(), base.clone(), agents.clone());
        move |_worker: usize, index: u64| {
            let (clients, base, agents) = (clients.clone(), base.clone(), agents.clone());
            async move {
                let i = index as usize;
                let a = &agents[i];
                let http = &clients[i % clients.len()];
                let req = RegisterRequest {
                    instance_id: InstanceId(a.cloud_id.clone()),
                    data_addr: format!("127.0.0.1:{}", 20_000 + i),
                    vcpus: 4,
                    agent_version: "loadgen".into(),
                    protocol_version: proteus_wire::agent_api::PROTOCOL_VERSION,
                };
                post(
                    http,
                    &format!("{base}/v1/agents/register"),
                    &a.token,
                    &req,
                    200,
                )
                .await
            }
        }
    };
    let (reg, _) = closed_loop(16, Duration::from_secs(120), agents.len() as u64, register).await;
    if reg.errors > 0 {
        bail!("registration failed: {:?}", reg.first_errors);
    }
    let registration = reg.summary();
    note(format!(
        "registered {} agents: {registration}",
        agents.len()
    ));

    // Heartbeats from now on, once a second per agent, phases spread over the second; only
    // those due after `measure` is set count.
    let measure: Arc<OnceLock<Instant>> = Arc::new(OnceLock::new());
    let secs = Duration::from_secs_f64(args.secs);
    let start = Instant::now() + Duration::from_millis(10);
    // Setup (making every agent ready) may take minutes; bench/api-heartbeats allows 12.
    let give_up = start + Duration::from_secs(660);
    let mut beaters = Vec::new();
    for i in 0..agents.len() {
        let (clients, base, agents, measure) = (
            clients.clone(),
            base.clone(),
            agents.clone(),
            measure.clone(),
        );
        let phase = Duration::from_secs_f64(i as f64 / agents.len() as f64);
        beaters.push(tokio::spawn(async move {
            let a = &agents[i];
            let http = &clients[i % clients.len()];
            let url = format!("{base}/v1/agents/{}/heartbeat", a.cloud_id);
            let (mut measured, mut before) = (Samples::default(), Samples::default());
            let mut last_done = start;
            for k in 0u64.. {
                let due = start + phase + Duration::from_secs(k);
                if due >= measure.get().map_or(give_up, |m| *m + secs) {
                    break;
                }
                tokio::time::sleep_until(due).await;
                // Late because the previous answer came after `due`: the server's fault, so
                // counted. Late only because timers fire on millisecond ticks: not counted.
                let from = if last_done > due { due } else { Instant::now() };
                let hb = Heartbeat {
                    applied_epoch: 1,
                    progress: Progress {
                        clock: k,
                        epoch: k as f64 / 20.0,
                        samples_processed: k * 640,
                        loss: Some(0.5),
                        metric: None,
                        samples_per_sec: 640.0,
                        active_shards: vec![],
                        backup_shards: vec![],
                        program: None,
                    },
                };
                let outcome = post(http, &url, &a.token, &hb, 204).await;
                last_done = Instant::now();
                if measure.get().is_some_and(|m| due >= *m) {
                    measured.record(last_done.saturating_duration_since(from));
                    if let Err(e) = outcome {
                        measured.error(e);
                    }
                } else if let Err(e) = outcome {
                    before.error(format!("before measuring: {e}"));
                }
            }
            (measured, before)
        }));
    }

    if !args.no_ready {
        let t = std::time::Instant::now();
        for (i, a) in agents.iter().enumerate() {
            let http = &clients[i % clients.len()];
            post(
                http,
                &format!("{base}/v1/agents/{}/events", a.cloud_id),
                &a.token,
                &AgentEvent::Ready { model_len: 1_000 },
                204,
            )
            .await
            .map_err(|e| anyhow!("ready: {e}"))?;
        }
        note(format!(
            "{} agents ready (one `ready` event after another) in {:.2} s",
            agents.len(),
            t.elapsed().as_secs_f64()
        ));
    }

    // One long poll per agent, each on its own connection, as the real agent keeps it.
    let stop = Arc::new(AtomicBool::new(false));
    let polls = Arc::new(AtomicU64::new(0));
    let poll_errors = Arc::new(AtomicU64::new(0));
    let first_errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut pollers = Vec::new();
    if !args.no_long_poll {
        for a in agents.iter() {
            // The broker holds a poll up to 20 s.
            let http = client_with_timeout(Duration::from_secs(40));
            let url = format!("{base}/v1/agents/{}/commands", a.cloud_id);
            let auth = format!("Bearer {}", a.token);
            let (stop, polls, poll_errors) = (stop.clone(), polls.clone(), poll_errors.clone());
            let first_errors = first_errors.clone();
            pollers.push(tokio::spawn(async move {
                let mut after = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let resp = http
                        .get(&url)
                        .query(&[("after", after), ("wait_ms", 20_000)])
                        .header("authorization", &auth)
                        .send()
                        .await;
                    polls.fetch_add(1, Ordering::Relaxed);
                    let outcome = match resp {
                        Ok(r) if r.status().is_success() => r
                            .json::<serde_json::Value>()
                            .await
                            .map_err(|e| format!("body: {e}")),
                        Ok(r) => Err(format!(
                            "{}: {}",
                            r.status(),
                            r.text().await.unwrap_or_default()
                        )),
                        Err(e) => Err(format!("transport: {e}")),
                    };
                    match outcome {
                        Ok(v) => {
                            for c in v.as_array().into_iter().flatten() {
                                after = after.max(c["seq"].as_u64().unwrap_or(0));
                            }
                        }
                        Err(e) => {
                            poll_errors.fetch_add(1, Ordering::Relaxed);
                            {
                                let mut f = first_errors.lock().unwrap_or_else(|e| e.into_inner());
                                if f.len() < 3 {
                                    f.push(e);
                                }
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
            }));
        }
        // Let the first round of polls (which fetch the current layout) settle.
        tokio::time::sleep(Duration::from_secs(2)).await;
        note(format!("{} long polls open", pollers.len()));
    }

    let _ = measure.set(Instant::now());
    note(format!("measuring {:.0} s of heartbeats", args.secs));
    let mut samples = Samples::default();
    let mut before = Samples::default();
    for b in beaters {
        if let Ok((m, w)) = b.await {
            samples.merge(m);
            before.merge(w);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for p in pollers {
        p.abort();
    }
    note(format!(
        "done; long polls: {} answered, {} failed; heartbeats before measuring: {} failed",
        polls.load(Ordering::Relaxed),
        poll_errors.load(Ordering::Relaxed),
        before.errors
    ));
    for e in first_errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .chain(&before.first_errors)
    {
        eprintln!("error: {e}");
    }
    // Failures before the measurement or of long polls are failures of the run all the same.
    samples.errors += before.errors + poll_errors.load(Ordering::Relaxed);
    Ok((samples, registration))
}

async fn post<T: serde::Serialize>(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    body: &T,
    expect: u16,
) -> Result<(), String> {
    let resp = http
        .post(url)
        .header("authorization", format!("Bearer {token}"))
        .json(body)
        .send()
        .await
        .map_err(|e| format!("transport: {e}"))?;
    let status = resp.status();
    let text = resp.bytes().await.map_err(|e| format!("body: {e}"))?;
    if status.as_u16() != expect {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&text)));
    }
    Ok(())
}
