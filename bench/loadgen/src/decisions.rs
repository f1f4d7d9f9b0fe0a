//! Scheduler decision latency: one job over every market of the built-in 2015 trace, the
//! control loop driven tick by tick (`Broker::tick`, the same code `proteus serve` runs every
//! second) on the simulated cloud with an accelerated clock, so that the ticks see prices move,
//! instances launched, evicted and replaced.
//!
//! Each decision's time is the broker's own measurement: the increase of the
//! `proteus_decision_seconds` histogram's sum (what `GET /metrics` exports) over one tick that
//! made exactly one decision (the scheduler consults the policy on events and at its wake-up
//! time, so many ticks make none; they are timed as ticks only).

use crate::inproc;
use crate::stats::Samples;
use anyhow::{Context, Result, anyhow, bail};
use proteus_broker::api::auth::new_token;
use proteus_broker::service::spec::JobSpec;
use proteus_wire::JobId;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The database (Postgres URL); migrated if needed.
    #[arg(long, env = "PROTEUS_DATABASE_URL")]
    pub database_url: String,
    /// Ticks (decisions) to measure.
    #[arg(long, default_value_t = 2000)]
    pub ticks: usize,
    /// Stop measuring after this many seconds even if fewer ticks were made.
    #[arg(long, default_value_t = 60.0)]
    pub max_secs: f64,
    /// Market seconds per wall second.
    #[arg(long, default_value_t = 3600.0)]
    pub speed: f64,
    #[arg(long, default_value = "bidbrain")]
    pub policy: String,
    #[arg(long, default_value_t = 16)]
    pub max_instances: u32,
    #[arg(long, default_value_t = 5.0)]
    pub target_p99_ms: f64,
}

pub fn run(args: Args) -> Result<bool> {
    let rt = inproc::runtime(2, "broker")?;
    rt.block_on(measure(&args))
}

/// `(count, sum)` of the decision histogram, from the broker's metrics text.
fn decisions(broker: &proteus_broker::service::Broker) -> Result<(u64, f64)> {
    let mut text = String::new();
    broker.metrics().render(&mut text);
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .ok_or_else(|| anyhow!("no `{name}` in the metrics"))
    };
    Ok((
        value("proteus_decision_seconds_count")?.parse()?,
        value("proteus_decision_seconds_sum")?.parse()?,
    ))
}

async fn measure(args: &Args) -> Result<bool> {
    let token = new_token("pt_");
    let speed = args.speed.to_string();
    let server = inproc::build(
        &args.database_url,
        &[
            "--cloud",
            "sim",
            "--local-agents",
            "false",
            "--token",
            &token,
            "--speed",
            &speed,
            // A market day of a 16-instance job: no default budget ends it early.
            "--default-budget-usd",
            "0",
        ],
    )
    .await?;
    let broker = server.broker.clone();
    let spec: JobSpec = serde_json::from_value(serde_json::json!({
        "name": "bench-decisions",
        "app": "mlr",
        "dataset": "mnist",
        "stop": {"epochs": 10000},
        "policy": args.policy,
        "limits": {"max_instances": args.max_instances},
        "work": {"total_work": 1000000.0},
    }))?;
    let view = broker
        .submit(spec)
        .await
        .map_err(|e| anyhow!("submitting the job: {e}"))?;
    let job = JobId(view.id);
    let data = broker.market_data();
    let runtime = broker.runtime(job).context("the job's runtime")?;
    let (types, markets) = {
        let r = runtime.lock().unwrap_or_else(|e| e.into_inner());
        let types: Vec<String> = r.engine.job().rates().map(|(t, _)| t.to_string()).collect();
        let markets = data
            .markets
            .markets()
            .iter()
            .filter(|m| types.iter().any(|t| t == m.instance_type.as_str()))
            .count();
        (types, markets)
    };
    drop(runtime);
    eprintln!(
        "job {job}: policy {}, {} instance types ({}), {markets} markets",
        args.policy,
        types.len(),
        types.join(", ")
    );

    let mut decision = Samples::default();
    let mut tick = Samples::default();
    let (mut count, mut sum) = decisions(&broker)?;
    let started = Instant::now();
    let market_start = broker.clock().now();
    while decision.count() < args.ticks as u64
        && started.elapsed() < Duration::from_secs_f64(args.max_secs)
    {
        let t = Instant::now();
        broker
            .tick()
            .await
            .map_err(|e| anyhow!("tick failed: {e}"))?;
        tick.record(t.elapsed());
        let (c, s) = decisions(&broker)?;
        match c - count {
            1 => decision.record(Duration::from_secs_f64((s - sum).max(0.0))),
            // The scheduler consults the policy on events and when the policy asked to be
            // woken, not on every tick: a tick without a decision is timed as a tick only.
            0 => {}
            n => eprintln!("a tick made {n} decisions; not counted"),
        }
        (count, sum) = (c, s);
    }
    if decision.count() == 0 {
        let state = broker.store().job(job).await?.map(|j| j.state.to_string());
        bail!(
            "no tick made exactly one decision in {} ticks (job state {state:?})",
            tick.count()
        );
    }
    let market_end = broker.clock().now();
    let instances = broker.store().instances_of_job(job).await?;
    let evicted = instances.iter().filter(|i| i.ended_by_provider).count();
    broker.store().close().await;

    let d = decision.summary();
    let t = tick.summary();
    let mean_ms = decision.micros.iter().sum::<u64>() as f64 / decision.count().max(1) as f64 / 1e3;
    eprintln!(
        "market time {market_start} to {market_end}: {} instances launched, {evicted} evicted",
        instances.iter().filter(|i| i.launched.is_some()).count()
    );
    println!(
        "whole control-loop tick (store reads/writes, cloud, ledger, decision): p50 {:.2} ms, p99 {:.2} ms over {} ticks",
        t.p50_ms, t.p99_ms, t.count
    );
    println!(
        "scheduler decision, {} policy, job over {markets} markets: {} decisions, mean {mean_ms:.3} ms, \
         p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms — target p99 < {:.0} ms: {:.3} of budget",
        args.policy,
        d.count,
        d.p50_ms,
        d.p99_ms,
        d.max_ms,
        args.target_p99_ms,
        d.p99_ms / args.target_p99_ms
    );
    Ok(d.p99_ms < args.target_p99_ms && markets >= 15)
}
