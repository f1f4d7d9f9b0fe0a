//! `proteus-loadgen`: the load generators behind the broker's API benchmarks (`bench/api-*`).
//!
//! - `get-job`: `GET /v1/jobs/{id}` against a running broker: throughput and latency at a rate;
//! - `heartbeats`: N simulated agents heartbeating once a second against an in-process broker;
//! - `decisions`: scheduler decision latency, the control loop driven tick by tick;
//! - `agent-identity`: an instance with a known agent token, for fuzzing the agent endpoints.
//!
//! Each prints its figures (p50/p99, and the ratio to the target) on stdout, progress on stderr,
//! and exits 0 when the target is met, 1 when it is missed, 2 when the run itself failed.
//! Every run is bounded in time and in requests.

mod agent_identity;
mod decisions;
mod get_job;
mod heartbeats;
mod inproc;
mod load;
mod stats;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "proteus-loadgen",
    about = "Load generators for the broker's API benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The broker's logging flags, read from the environment only.
#[derive(Parser)]
struct Logging {
    #[command(flatten)]
    global: proteus_broker::cli::GlobalArgs,
}

#[derive(Subcommand)]
enum Command {
    /// GET /v1/jobs/{id} on a running broker.
    GetJob(get_job::Args),
    /// Simulated agents heartbeating against an in-process broker.
    Heartbeats(heartbeats::Args),
    /// Scheduler decision latency over the 2015 trace's markets.
    Decisions(decisions::Args),
    /// Store an instance of a job with a known agent token; print `<cloud id> <token>`.
    AgentIdentity(agent_identity::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The in-process brokers log as `proteus serve` does, to stderr: PROTEUS_LOG (the scripts
    // set it), PROTEUS_LOG_FORMAT.
    match Logging::try_parse_from(["proteus-loadgen"]) {
        Ok(l) => proteus_broker::cli::init_tracing(&l.global),
        Err(e) => eprintln!("logging not set up: {e}"),
    }
    let outcome = match cli.command {
        Command::GetJob(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers())
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(get_job::run(args))),
        Command::Heartbeats(args) => heartbeats::run(args),
        Command::Decisions(args) => decisions::run(args),
        Command::AgentIdentity(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(agent_identity::run(args))),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Load-generator threads for `get-job`: `PROTEUS_LOADGEN_THREADS`, default 1 (the broker and
/// the database need the other cores more than the client does).
fn workers() -> usize {
    std::env::var("PROTEUS_LOADGEN_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}
