//! The `proteus-agent` command line.
//!
//! Exit codes: 0 stopped or handed over after an interruption warning; 1 error (message on
//! stderr); 2 bad command line.

use crate::agent;
use crate::session::AgentOptions;
use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Elastic AgileML parameter server and worker for Proteus.
#[derive(Debug, Parser)]
#[command(
    version,
    after_help = "Examples:\n  \
proteus-agent --broker http://10.0.0.5:8080 --token $TOKEN\n  \
proteus-agent --broker http://127.0.0.1:8080 --token t1 --instance-id sim-1 \\\n      \
--imds-endpoint http://127.0.0.1:9001 --data-dir data/ml --listen 127.0.0.1:0\n\n\
Every flag can also be given by environment variable (shown in brackets)."
)]
pub struct Cli {
    /// Base URL of the broker's agent API, or several brokers' URLs separated by commas: the
    /// agent moves to the next when one cannot be reached or says another broker runs the job.
    #[arg(long, env = "PROTEUS_BROKER_URL")]
    broker: String,
    /// PEM CA certificate(s) to verify the broker's HTTPS against, instead of the system roots.
    #[arg(long, env = "PROTEUS_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Per-instance bearer token issued by the broker. Prefer `--token-file`: a token in the
    /// environment stays in `/proc/<pid>/environ` for the process's life.
    #[arg(
        long,
        env = "PROTEUS_AGENT_TOKEN",
        hide_env_values = true,
        required_unless_present = "token_file",
        conflicts_with = "token_file"
    )]
    token: Option<String>,
    /// A file holding the token (readable by the agent's user only, e.g. mode 0600): the
    /// token then appears in no process's environment or arguments.
    #[arg(long, env = "PROTEUS_AGENT_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Instance id; read from instance metadata (`instance-id`) when absent.
    #[arg(long, env = "PROTEUS_AGENT_INSTANCE_ID")]
    instance_id: Option<String>,
    /// Instance metadata (IMDSv2) base URL; `off` disables interruption polling.
    #[arg(
        long,
        env = "PROTEUS_AGENT_IMDS_ENDPOINT",
        default_value = "http://169.254.169.254"
    )]
    imds_endpoint: String,
    /// How often to poll instance metadata for interruption notices, in milliseconds.
    #[arg(long, env = "PROTEUS_AGENT_IMDS_POLL_MS", default_value_t = 2000)]
    imds_poll_ms: u64,
    /// Directory holding the data sets (MNIST, digits, ratings).
    #[arg(long, env = "PROTEUS_AGENT_DATA_DIR", default_value = "data/ml")]
    data_dir: PathBuf,
    /// Address for peer (data-plane) TCP connections; port 0 picks a free one.
    #[arg(long, env = "PROTEUS_AGENT_LISTEN", default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// `host:port` peers should dial. Default: the bound address; with a wildcard bind, the
    /// instance's `local-ipv4` from metadata.
    #[arg(long, env = "PROTEUS_AGENT_ADVERTISE")]
    advertise: Option<String>,
    /// Leave at the latest this many seconds before an interruption's action time.
    #[arg(long, env = "PROTEUS_AGENT_EXIT_MARGIN_SECS", default_value_t = 10)]
    exit_margin_secs: u64,
    /// Make this agent's worker a persistent straggler, this many times slower (tests and
    /// benchmarks; 1 = normal). Adds to the job's own straggler injection.
    #[arg(long, env = "PROTEUS_AGENT_SLOWDOWN", default_value_t = 1.0)]
    slowdown: f64,
    /// Command jobs: each instance's working directory, checkpoint directory, notice and
    /// progress files go under this directory. Default: the system's temporary directory.
    #[arg(long, env = "PROTEUS_AGENT_SCRATCH_DIR")]
    scratch_dir: Option<PathBuf>,
    /// Command jobs: run the user's program as this (unprivileged) user. Needs the agent to be
    /// root; the program then cannot read the agent's memory, environment or files. Default for
    /// a root agent: `proteus-job`, created (a system user without a home or a login shell) if
    /// missing. A program never runs as root.
    #[arg(long, env = "PROTEUS_AGENT_RUN_AS")]
    run_as: Option<String>,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "PROTEUS_AGENT_LOG", default_value = "info")]
    log: String,
}

/// Runs the agent with these command-line arguments (the first is the program name). Used by
/// the `proteus-agent` binary and by `proteus agent`, so that a single `proteus` binary can be
/// its own agent where instances are local processes.
pub fn main_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    // One worker of a pipeline run of worker processes, driven over stdin and stdout by its
    // launcher (`pipeline::processes`; benchmarks and tests), not a broker.
    if args
        .get(1)
        .is_some_and(|a| a == crate::pipeline::processes::WORKER_COMMAND)
    {
        return crate::pipeline::processes::worker_main();
    }
    let cli = Cli::parse_from(args);
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("proteus-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    hide_secrets();
    if !(cli.slowdown.is_finite() && cli.slowdown >= 1.0) {
        anyhow::bail!("--slowdown must be a number >= 1 (got {})", cli.slowdown);
    }
    let token = match (cli.token.clone(), &cli.token_file) {
        (Some(t), _) => t,
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("reading the agent token from {}", file.display()))?
            .trim()
            .to_string(),
        (None, None) => anyhow::bail!("give the agent's token: --token-file FILE (or --token)"),
    };
    if token.is_empty() {
        anyhow::bail!("the agent token is empty");
    }
    let opts = AgentOptions {
        broker: cli.broker,
        token,
        token_file: cli.token_file,
        ca_file: cli.ca_file,
        instance_id: cli.instance_id,
        imds_endpoint: (cli.imds_endpoint != "off").then_some(cli.imds_endpoint),
        imds_poll: Duration::from_millis(cli.imds_poll_ms.max(10)),
        data_dir: cli.data_dir,
        listen: cli.listen,
        advertise: cli.advertise,
        vcpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        exit_margin: Duration::from_secs(cli.exit_margin_secs),
        slowdown: cli.slowdown,
        scratch_dir: cli
            .scratch_dir
            .unwrap_or_else(|| std::env::temp_dir().join("proteus-agent")),
        run_as: cli.run_as.filter(|u| !u.is_empty()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    let outcome = runtime.block_on(agent::run(opts)).context("agent failed")?;
    tracing::info!(?outcome, "done");
    // Background tasks (long polls, peer connections) must not hold the process open.
    runtime.shutdown_timeout(Duration::from_millis(200));
    Ok(())
}

/// Keeps the agent's token from the processes it starts: the variable leaves the environment
/// (children inherit nothing of it), and the process becomes non-dumpable, which makes its
/// `/proc/<pid>/environ` and memory unreadable to other processes of the same user (the kernel
/// gives those files to root). Must run before any thread starts.
fn hide_secrets() {
    // SAFETY: called from `run` before the tokio runtime (or any other thread) exists, so no
    // other thread reads the environment concurrently.
    unsafe { std::env::remove_var("PROTEUS_AGENT_TOKEN") };
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(PR_SET_DUMPABLE) only changes this process's own dumpable flag.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0);
    }
}
