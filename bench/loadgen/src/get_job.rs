//! `GET /v1/jobs/{id}` against a running broker (a separate `proteus serve` process).
//!
//! Submits a job, waits until it has instances (so the view has something to show), then runs
//! `rounds` closed-loop rounds (throughput) and `rounds` fixed-rate rounds at `--rate`
//! (latency at the target rate), and prints the medians over rounds.
//!
//! With `--jobs FIRST-LAST` it submits nothing and reads those (already stored) jobs instead,
//! spread so that consecutive requests name far-apart jobs: with more jobs than the broker's
//! status cache holds, or than it can read again within the cache's life, nearly every read
//! misses the cache and goes to the database.

use crate::load::{client_trusting, closed_loop, fixed_rate};
use crate::stats::{Samples, median};
use anyhow::{Context, Result, bail};
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The broker, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub url: String,
    /// The user token.
    #[arg(long, env = "PROTEUS_TOKEN", hide_env_values = true)]
    pub token: String,
    /// PEM CA to verify an https:// broker against (as `proteus --ca-file`).
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Connections of the throughput rounds.
    #[arg(long, default_value_t = 16)]
    pub connections: usize,
    /// Requests per second of the latency rounds.
    #[arg(long, default_value_t = 5000.0)]
    pub rate: f64,
    /// Senders of the latency rounds (each at rate / senders).
    #[arg(long, default_value_t = 50)]
    pub senders: usize,
    /// Seconds per round.
    #[arg(long, default_value_t = 5.0)]
    pub secs: f64,
    /// Rounds of each kind.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Most instances of the job whose view is read.
    #[arg(long, default_value_t = 8)]
    pub max_instances: u32,
    /// Targets, for the ratios printed.
    #[arg(long, default_value_t = 5000.0)]
    pub target_rps: f64,
    #[arg(long, default_value_t = 20.0)]
    pub target_p99_ms: f64,
    /// Read these stored jobs (`FIRST-LAST`, inclusive) instead of submitting one.
    #[arg(long, value_parser = parse_range)]
    pub jobs: Option<(i64, i64)>,
    /// Also run the latency rounds, at the same rate with the same senders, on this path of
    /// the same broker (e.g. `/v1/sim/clock`: authenticated, a few bytes of JSON, no job view):
    /// the floor that the machine, the load generator, HTTP and authentication set, printed
    /// beside the job view's figure. Not a target.
    #[arg(long)]
    pub floor_path: Option<String>,
}

fn parse_range(text: &str) -> Result<(i64, i64), String> {
    let (a, b) = text
        .split_once('-')
        .ok_or_else(|| format!("`{text}` is not FIRST-LAST"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<i64>()
            .map_err(|e| format!("`{v}` in `{text}`: {e}"))
    };
    let (a, b) = (parse(a)?, parse(b)?);
    if b < a {
        return Err(format!("`{text}`: LAST is below FIRST"));
    }
    Ok((a, b))
}

pub async fn run(args: Args) -> Result<bool> {
    let client = || client_trusting(args.ca_file.as_deref());
    let http = client()?;
    let auth = format!("Bearer {}", args.token);
    let (first, count, what) = match args.jobs {
        Some((first, last)) => {
            let count = (last - first + 1) as u64;
            let url = format!("{}/v1/jobs/{first}", args.url);
            let view = get_view(&http, &url, &auth).await?;
            eprintln!(
                "jobs {first}-{last}: {count} stored jobs; job {first}: state {}, {} instances",
                view["state"],
                view["instances"].as_array().map_or(0, Vec::len)
            );
            (first, count, format!("{count} jobs, read in spread order"))
        }
        None => (submit(&http, &args, &auth).await?, 1, "one job".to_string()),
    };
    // Request k of the run reads job first + (k * STRIDE mod count): STRIDE is odd and large,
    // so over `count` requests every job is read once and neighbours in time are far apart.
    const STRIDE: u64 = 7_919 * 2_654_435_761;
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stride = if count > 1 && gcd(STRIDE % count, count) == 1 {
        STRIDE % count
    } else {
        (1..count).rev().find(|s| gcd(*s, count) == 1).unwrap_or(1)
    };
    let job_url = {
        let base = args.url.clone();
        move |k: u64| {
            format!(
                "{base}/v1/jobs/{}",
                first + ((k % count) * stride % count) as i64
            )
        }
    };

    let clients: Vec<reqwest::Client> = (0..args.connections.max(args.senders))
        .map(|_| client())
        .collect::<Result<_>>()?;
    let request = {
        let (clients, auth, next) = (clients.clone(), auth.clone(), next.clone());
        move |worker: usize, _seq: u64| {
            let http = clients[worker % clients.len()].clone();
            let url = job_url(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let auth = auth.clone();
            async move { get_ok(&http, &url, &auth).await }
        }
    };

    let secs = Duration::from_secs_f64(args.secs);
    // Warm-up: connections open, caches filled.
    let _ = closed_loop(
        args.connections,
        Duration::from_secs(1),
        u64::MAX,
        request.clone(),
    )
    .await;

    let mut all = Samples::default();
    let mut rates = Vec::new();
    let mut closed_p50 = Vec::new();
    let mut closed_p99 = Vec::new();
    for round in 1..=args.rounds {
        let (samples, took) = closed_loop(args.connections, secs, 5_000_000, request.clone()).await;
        let rps = samples.count() as f64 / took.as_secs_f64();
        let s = samples.summary();
        eprintln!(
            "throughput round {round}: {rps:.0} req/s with {} connections; {s}; {} errors",
            args.connections, samples.errors
        );
        rates.push(rps);
        closed_p50.push(s.p50_ms);
        closed_p99.push(s.p99_ms);
        all.merge(samples);
    }
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    let mut achieved = Vec::new();
    let interval = Duration::from_secs_f64(args.senders as f64 / args.rate);
    for round in 1..=args.rounds {
        let (samples, took) = fixed_rate(args.senders, interval, secs, request.clone()).await;
        let s = samples.summary();
        let rps = samples.count() as f64 / took.as_secs_f64();
        eprintln!(
            "latency round {round}: {rps:.0} req/s offered at {:.0}; {s}; {} errors",
            args.rate, samples.errors
        );
        p50s.push(s.p50_ms);
        p99s.push(s.p99_ms);
        achieved.push(rps);
        all.merge(samples);
    }
    let floor = match &args.floor_path {
        Some(path) => Some(floor_rounds(&args, &clients, &auth, path).await),
        None => None,
    };
    for e in &all.first_errors {
        eprintln!("error: {e}");
    }

    let rps = median(&rates);
    let p99 = median(&p99s);
    println!(
        "GET /v1/jobs/{{id}} on Postgres over {what}, throughput ({} connections, {} x {:.0} s): median {rps:.0} req/s \
         (p50 {:.2} ms, p99 {:.2} ms) — target >= {:.0} req/s: ratio {:.2}x",
        args.connections,
        args.rounds,
        args.secs,
        median(&closed_p50),
        median(&closed_p99),
        args.target_rps,
        rps / args.target_rps
    );
    println!(
        "GET /v1/jobs/{{id}} on Postgres over {what}, latency at {:.0} req/s offered ({} x {:.0} s, {:.0} req/s achieved): \
         median p50 {:.2} ms, median p99 {p99:.2} ms — target p99 < {:.0} ms: {:.2} of budget",
        args.rate,
        args.rounds,
        args.secs,
        median(&achieved),
        median(&p50s),
        args.target_p99_ms,
        p99 / args.target_p99_ms
    );
    if let (Some(path), Some((p50, p99_floor, errors))) = (&args.floor_path, floor) {
        println!(
            "floor, GET {path} on the same broker at {:.0} req/s offered ({} x {:.0} s): median p50 {p50:.2} ms, \
             median p99 {p99_floor:.2} ms ({errors} errors); the job view's p99 is {:.2}x the floor's",
            args.rate,
            args.rounds,
            args.secs,
            p99 / p99_floor
        );
    }
    println!("requests: {} answered, {} errors", all.count(), all.errors);
    Ok(rps >= args.target_rps && p99 < args.target_p99_ms && all.errors == 0)
}

/// The latency rounds on `path` instead of the job view: (median p50, median p99, errors).
async fn floor_rounds(
    args: &Args,
    clients: &[reqwest::Client],
    auth: &str,
    path: &str,
) -> (f64, f64, u64) {
    let url = format!("{}{path}", args.url);
    let request = {
        let (clients, auth) = (clients.to_vec(), auth.to_string());
        move |worker: usize, _seq: u64| {
            let http = clients[worker % clients.len()].clone();
            let (url, auth) = (url.clone(), auth.clone());
            async move { get_ok(&http, &url, &auth).await }
        }
    };
    let interval = Duration::from_secs_f64(args.senders as f64 / args.rate);
    let secs = Duration::from_secs_f64(args.secs);
    let (mut p50s, mut p99s, mut errors) = (Vec::new(), Vec::new(), 0);
    for round in 1..=args.rounds {
        let (samples, _) = fixed_rate(args.senders, interval, secs, request.clone()).await;
        let s = samples.summary();
        eprintln!(
            "floor round {round} ({path}): {s}; {} errors",
            samples.errors
        );
        p50s.push(s.p50_ms);
        p99s.push(s.p99_ms);
        errors += samples.errors;
    }
    (median(&p50s), median(&p99s), errors)
}

/// One `GET` that must answer 200 (its body read whole); otherwise what went wrong.
async fn get_ok(http: &reqwest::Client, url: &str, auth: &str) -> Result<(), String> {
    let resp = http
        .get(url)
        .header("authorization", auth)
        .send()
        .await
        .map_err(|e| format!("transport: {e}"))?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| format!("body: {e}"))?;
    if status.as_u16() != 200 {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
    }
    Ok(())
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

async fn get_view(http: &reqwest::Client, url: &str, auth: &str) -> Result<serde_json::Value> {
    let resp = http
        .get(url)
        .header("authorization", auth)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = resp.status();
    let view: serde_json::Value = resp
        .json()
        .await
        .with_context(|| format!("GET {url}: the body"))?;
    if status.as_u16() != 200 {
        bail!("GET {url} answered {status}: {view}");
    }
    Ok(view)
}

/// Submits the job to read and waits until the scheduler bought it instances, so the view
/// lists some; its id.
async fn submit(http: &reqwest::Client, args: &Args, auth: &str) -> Result<i64> {
    let spec = serde_json::json!({
        "name": "bench-get-job",
        "app": "mlr",
        "dataset": "digits",
        "policy": "bidbrain",
        "limits": {"max_instances": args.max_instances, "max_reliable_instances": 1},
    });
    let resp = http
        .post(format!("{}/v1/jobs", args.url))
        .header("authorization", auth)
        .json(&spec)
        .send()
        .await
        .context("submitting the job")?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.context("the submit answer")?;
    if status.as_u16() != 201 {
        bail!("submit answered {status}: {body}");
    }
    let id = body["id"].as_i64().context("the job id")?;
    let url = format!("{}/v1/jobs/{id}", args.url);
    let mut view = serde_json::Value::Null;
    for _ in 0..100 {
        view = get_view(http, &url, auth).await?;
        if view["instances"].as_array().is_some_and(|a| !a.is_empty()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body_len = serde_json::to_vec(&view)?.len();
    eprintln!(
        "job {id}: state {}, {} instances, view of {body_len} bytes",
        view["state"],
        view["instances"].as_array().map_or(0, Vec::len)
    );
    Ok(id)
}
