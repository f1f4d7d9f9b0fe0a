//! Two ways of putting load on a server, both bounded in time and count.
//!
//! - [`closed_loop`]: `workers` connections, each sending its next request as soon as the last
//!   answer is in: the most the server can answer (throughput).
//! - [`fixed_rate`]: `streams` senders, each on its own schedule (one request every `interval`,
//!   phases spread evenly): latency at a given rate. A request held up by a slow previous answer
//!   is timed from when it was *due*, so a server that falls behind is charged for the wait (no
//!   coordinated omission).

use crate::stats::Samples;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// One request: `Ok` if the answer was the expected one, else a description of what came back.
pub trait Request: Fn(usize, u64) -> Self::Fut + Clone + Send + Sync + 'static {
    type Fut: Future<Output = Result<(), String>> + Send;
}

impl<F, Fut> Request for F
where
    F: Fn(usize, u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    type Fut = Fut;
}

/// Runs `workers` request loops for `duration` (at most `max_requests` in all); returns the
/// samples and the time the run took. Worker `w` makes requests `w`, `w + workers`, … (the second
/// argument of `request` is that global index).
pub async fn closed_loop<R: Request>(
    workers: usize,
    duration: Duration,
    max_requests: u64,
    request: R,
) -> (Samples, Duration) {
    let start = Instant::now();
    let end = start + duration;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let request = request.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Samples::default();
            let mut index = w as u64;
            while index < max_requests && Instant::now() < end {
                let t = Instant::now();
                let outcome = request(w, index).await;
                samples.record(t.elapsed());
                if let Err(e) = outcome {
                    samples.error(e);
                }
                index = index.saturating_add(workers as u64);
            }
            samples
        }));
    }
    let mut all = Samples::default();
    for t in tasks {
        if let Ok(s) = t.await {
            all.merge(s);
        }
    }
    (all, start.elapsed())
}

/// Runs `streams` senders, each sending one request every `interval` for `duration`; stream
/// `i` starts `i * interval / streams` after the others, so the load is even. Returns the
/// samples and the time from the first request due to the last answer.
pub async fn fixed_rate<R: Request>(
    streams: usize,
    interval: Duration,
    duration: Duration,
    request: R,
) -> (Samples, Duration) {
    let start = Instant::now() + Duration::from_millis(20);
    let end = start + duration;
    let mut tasks = Vec::new();
    for s in 0..streams {
        let request = request.clone();
        let phase = interval.mul_f64(s as f64 / streams as f64);
        tasks.push(tokio::spawn(async move {
            let mut samples = Samples::default();
            let mut seq: u64 = 0;
            let mut last_done = start;
            loop {
                let due = start + phase + interval * seq as u32;
                if due >= end {
                    break;
                }
                tokio::time::sleep_until(due).await;
                // Late because the previous answer came after `due`: the server's fault, so
                // counted. Late only because timers fire on millisecond ticks: not counted.
                let from = if last_done > due { due } else { Instant::now() };
                let outcome = request(s, seq).await;
                last_done = Instant::now();
                samples.record(last_done.saturating_duration_since(from));
                if let Err(e) = outcome {
                    samples.error(e);
                }
                seq += 1;
            }
            samples
        }));
    }
    let mut all = Samples::default();
    for t in tasks {
        if let Ok(s) = t.await {
            all.merge(s);
        }
    }
    // Until the last answer: a server that fell behind took longer than `duration`.
    (
        all,
        Instant::now()
            .saturating_duration_since(start)
            .max(duration),
    )
}

/// A client keeping its connections alive; requests time out after 10 s.
pub fn client() -> reqwest::Client {
    client_with_timeout(Duration::from_secs(10))
}

/// [`client`], verifying HTTPS against `ca_file` when given (the way the `proteus` CLI does).
pub fn client_trusting(ca_file: Option<&std::path::Path>) -> anyhow::Result<reqwest::Client> {
    let builder = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(10))
        .tcp_nodelay(true);
    proteus_agent::control::trust(builder, ca_file)
        .map_err(anyhow::Error::msg)?
        .build()
        .map_err(anyhow::Error::from)
}

pub fn client_with_timeout(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(timeout)
        .tcp_nodelay(true)
        .build()
        .expect("an HTTP client")
}
