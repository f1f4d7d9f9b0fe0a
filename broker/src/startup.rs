//! Building the broker from its configuration: clock, cloud, launcher, prices, recovery and
//! the API router, bound to a listener — what `proteus serve`, `proteus demo`, the benchmarks'
//! in-process brokers and the tests all start (the model: zero-to-production's `startup.rs`,
//! mini-redis's `server::run`). The configuration is [`ServeArgs`], which `proteus serve`
//! reads from its flags and the others build with [`ServeArgs::sim_defaults`].

use crate::api::auth::{UserAuth, hash_token, new_token};
use crate::api::server::{self, ConnLimits};
use crate::api::tls::{self, ReloadingCert, TlsFiles};
use crate::api::{AppState, router};
use crate::billing::BillingModel;
use crate::checkpoint::{CheckpointStore, ProgramStorage};
use crate::clock::{DatabaseClock, SharedClock, SimClock};
use crate::cloud::Cloud;
use crate::cloud::faults::FaultyCloud;
use crate::cloud::sim::SimCloud;
use crate::data;
use crate::launcher::{LauncherConfig, LocalLauncher};
use crate::market::{Region, Timestamp};
use crate::prices::{PriceHistory, files};
use crate::service::{Broker, ModelChoice, Settings};
use crate::store::{MarketFilter, Store};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CloudKind {
    /// A spot market replaying a trace on an accelerated clock.
    Sim,
    /// Amazon EC2 (or LocalStack through AWS_ENDPOINT_URL).
    Ec2,
}

#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  \
    proteus serve                                     # simulated cloud on the 2015 trace, 60x speed\n  \
    proteus serve --cloud sim --speed 600 --start 2015-04-10T00:00:00Z\n  \
    PROTEUS_DATABASE_URL=postgres://… proteus serve --cloud ec2 --region us-east-1 --ami ami-0abc… \\\n      \
      --subnet subnet-… --security-group sg-… --instance-profile proteus-agent\n  \
    proteus serve --cloud ec2 --dry-run               # check the account's permissions and exit")]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "PROTEUS_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The URL agents use to reach this broker. Default: http://<listen>, or https://<listen>
    /// with --tls-cert. With several brokers behind a load balancer, the load balancer's URL
    /// (see docs/operations.md).
    #[arg(long, env = "PROTEUS_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Seconds a job's lease lasts without renewal (renewed every quarter of it): how long the
    /// jobs of a broker that died wait before another broker on the same Postgres database
    /// takes them over.
    #[arg(long, env = "PROTEUS_LEASE_SECS", default_value_t = 10.0)]
    pub lease_secs: f64,
    /// Serve HTTPS with this PEM certificate chain (leaf first). Reloaded on SIGHUP and when
    /// the file changes. Without it the API is plain HTTP: for loopback and the demo only.
    #[arg(long, env = "PROTEUS_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "PROTEUS_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// A PEM CA certificate that agents should trust for this broker (a private CA): passed to
    /// local agents as --ca-file and written onto VMs by the user data. Default: agents use the
    /// system roots.
    #[arg(long, env = "PROTEUS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Seconds between checks of the certificate files for a replacement; 0: reload on SIGHUP
    /// only.
    #[arg(long, env = "PROTEUS_TLS_RELOAD_POLL_SECS", default_value_t = 2)]
    pub tls_reload_poll_secs: u64,
    #[arg(long, env = "PROTEUS_CLOUD", value_enum, default_value_t = CloudKind::Sim)]
    pub cloud: CloudKind,
    #[arg(long, env = "PROTEUS_REGION", default_value = "us-east-1")]
    pub region: String,
    /// The user API token, at least 32 characters. Default: generated on first start, printed
    /// once, its hash stored.
    #[arg(long, env = "PROTEUS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// sim: spot trace (CSV/JSON, .gz ok). Default: the 2015 us-east-1 trace built into proteus.
    #[arg(long, env = "PROTEUS_TRACE")]
    pub trace: Option<PathBuf>,
    /// sim: on-demand price table. Default: the 2015 table built into proteus.
    #[arg(long, env = "PROTEUS_ON_DEMAND")]
    pub on_demand: Option<PathBuf>,
    /// sim: today's market from availability traces instead of a price trace (one file per
    /// zone, as `proteus simulate --availability`; see docs/today.md): spot launches refused
    /// without capacity, notices when a pool shrinks, $0.918/h spot and $3.06/h on-demand.
    /// Use with `--billing per-second`.
    #[arg(long, value_name = "FILE", num_args = 1.., conflicts_with_all = ["trace", "on_demand"])]
    pub availability: Vec<PathBuf>,
    /// sim with --availability: the instance type the traces are of.
    #[arg(long, default_value = "p3.2xlarge")]
    pub availability_instance_type: String,
    /// sim: market seconds per wall second.
    #[arg(long, env = "PROTEUS_SPEED", default_value_t = 60.0)]
    pub speed: f64,
    /// sim: the market time the clock starts at. Default: eight days into the trace (so the
    /// market model has a week of history to learn from).
    #[arg(long, env = "PROTEUS_SIM_START")]
    pub start: Option<String>,
    /// sim: hold the market at this instant (RFC 3339): it runs there and stops until the hold
    /// is lifted or moved (`POST /v1/sim/clock`), so that you, or a test, decide when the
    /// market passes a moment of the trace.
    #[arg(long, value_name = "TIME")]
    pub hold_at: Option<String>,
    /// Billing for jobs that do not choose. Default: hourly-2015 on sim, per-second on ec2.
    #[arg(long, env = "PROTEUS_BILLING")]
    pub billing: Option<BillingModel>,
    /// Market model. Default: price on sim, hazard on ec2.
    #[arg(long, env = "PROTEUS_MARKET_MODEL", value_enum)]
    pub market_model: Option<ModelChoice>,
    /// Control-loop period, milliseconds of wall time.
    #[arg(long, env = "PROTEUS_TICK_MS", default_value_t = 1000)]
    pub tick_ms: u64,
    /// Start a local `proteus-agent` process per instance (where instances do not boot: sim,
    /// LocalStack). Default: on for sim, on for ec2 when AWS_ENDPOINT_URL is set.
    #[arg(long, env = "PROTEUS_LOCAL_AGENTS")]
    pub local_agents: Option<bool>,
    /// The agent binary for local agents. Default: `proteus-agent` next to this binary.
    #[arg(long, env = "PROTEUS_AGENT_BIN")]
    pub agent_bin: Option<PathBuf>,
    /// The agent binary served at /v1/downloads/proteus-agent to VMs booting with the user-data
    /// script (build it for the VMs' platform). Default: `proteus-agent` next to this binary.
    #[arg(long, env = "PROTEUS_AGENT_DOWNLOAD")]
    pub agent_download: Option<PathBuf>,
    /// Data sets for local agents, also served at /v1/downloads/data/. Default: the project's
    /// data/ml.
    #[arg(long, env = "PROTEUS_AGENT_DATA_DIR")]
    pub agent_data_dir: Option<PathBuf>,
    /// Log filter of local agents (tracing `EnvFilter` syntax).
    #[arg(
        long,
        env = "PROTEUS_LOCAL_AGENT_LOG",
        default_value = "warn,proteus_agent=info"
    )]
    pub agent_log: String,
    /// PID files and agent logs of local agents. Default: <user data dir>/proteus/state.
    #[arg(long, env = "PROTEUS_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Where command jobs' checkpoints go: `s3://bucket/prefix` (presigned URLs; credentials
    /// and endpoint from the AWS environment), or a directory. Default:
    /// `<state dir>/checkpoints`, served to agents by the broker itself.
    #[arg(long, env = "PROTEUS_CHECKPOINT_STORE")]
    pub checkpoint_store: Option<String>,
    /// Local agents (`--local-agents`): the unprivileged user they run command jobs' programs
    /// as when the broker runs as root (the agents' `--run-as`), so a program cannot read the
    /// agent's token or memory. Default: the agents' own, `proteus-job` (created if missing);
    /// a program never runs as root.
    #[arg(long, env = "PROTEUS_AGENT_RUN_AS")]
    pub agent_run_as: Option<String>,
    /// Buckets (comma-separated) whose objects command jobs may name as `s3://` working
    /// directories, which the broker signs downloads of with its credentials. Besides these:
    /// the checkpoint store's own bucket, outside its checkpoint prefix.
    #[arg(long, env = "PROTEUS_WORKDIR_BUCKETS", value_delimiter = ',')]
    pub workdir_buckets: Vec<String>,
    /// Events a job keeps at most; agents' events past it are refused (429).
    #[arg(long, env = "PROTEUS_MAX_JOB_EVENTS", default_value_t = crate::service::DEFAULT_MAX_JOB_EVENTS)]
    pub max_job_events: u32,
    /// Largest checkpoint archive (one rank's upload) the broker's directory store accepts:
    /// bytes, or with a unit (`512MiB`, `8GiB`). A larger upload is refused with 413.
    #[arg(long, env = "PROTEUS_CHECKPOINT_MAX_ARCHIVE", default_value = "8GiB", value_parser = crate::checkpoint::parse_size)]
    pub checkpoint_max_archive: u64,
    /// Disk one job's checkpoints may take in the broker's directory store: the newest archive
    /// of each of its ranks, an upload in progress counted in place of the archive it
    /// replaces. An upload that would go over it is refused with 507.
    #[arg(long, env = "PROTEUS_CHECKPOINT_JOB_QUOTA", default_value = "64GiB", value_parser = crate::checkpoint::parse_size)]
    pub checkpoint_job_quota: u64,
    /// Most instances this broker holds at once, across all its jobs. A job whose
    /// `limits.max_instances` is above it is refused at submission.
    #[arg(long, env = "PROTEUS_INSTANCE_CAP", default_value_t = 100)]
    pub instance_cap: u32,
    /// The budget (USD) of a job whose spec sets none (`limits.budget_usd`); 0: no budget.
    #[arg(long, env = "PROTEUS_DEFAULT_BUDGET_USD", default_value_t = 100.0)]
    pub default_budget_usd: f64,
    /// Seconds a client has to send a request's line and headers, counted from when its
    /// connection is ready for a request: an HTTP/1.1 connection kept open without a next
    /// request is closed after it too.
    #[arg(long, env = "PROTEUS_HEADER_READ_TIMEOUT_SECS", default_value_t = 10.0)]
    pub header_read_timeout_secs: f64,
    /// Seconds a connection with no request in flight and no traffic stays open.
    #[arg(long, env = "PROTEUS_IDLE_TIMEOUT_SECS", default_value_t = 60.0)]
    pub idle_timeout_secs: f64,
    /// Seconds a request's body may send nothing before the request fails.
    #[arg(long, env = "PROTEUS_BODY_READ_TIMEOUT_SECS", default_value_t = 30.0)]
    pub body_read_timeout_secs: f64,
    /// Connections the API serves at once (HTTP or HTTPS); more wait to be accepted. Keep it
    /// below the process's open-file limit (`ulimit -n`).
    #[arg(long, env = "PROTEUS_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Minutes from launch to useful work assumed by policies when a job does not say.
    #[arg(long, env = "PROTEUS_STARTUP_MINUTES")]
    pub startup_minutes: Option<f64>,
    /// Market seconds a market that refused a launch is skipped.
    #[arg(long, env = "PROTEUS_COOLDOWN_SECS", default_value_t = 600.0)]
    pub cooldown_secs: f64,
    /// Simulated cloud: wall seconds every interruption notice lasts at least, however fast
    /// market time runs (at 60x the two market minutes are two wall seconds, too short for a
    /// program to save its state). On EC2 the provider's two minutes stand.
    #[arg(long, env = "PROTEUS_MIN_NOTICE_SECS", default_value_t = 20.0)]
    pub min_notice_secs: f64,
    /// Fail chosen launches as EC2 would, e.g. `us-east-1a/c3.xlarge=insufficient-capacity:2`.
    #[arg(long, env = "PROTEUS_INJECT_LAUNCH_FAULTS", hide = true)]
    pub inject_launch_faults: Option<String>,
    #[command(flatten)]
    pub ec2: Ec2Args,
}

/// EC2 launch settings.
#[derive(Debug, Clone, Args)]
pub struct Ec2Args {
    /// AMI for agent instances.
    #[arg(long, env = "PROTEUS_AMI", default_value = "ami-00000000000000000")]
    pub ami: String,
    #[arg(long, env = "PROTEUS_SUBNET")]
    pub subnet: Option<String>,
    #[arg(long, env = "PROTEUS_SECURITY_GROUP")]
    pub security_group: Vec<String>,
    /// Instance profile (name) giving agents their role.
    #[arg(long, env = "PROTEUS_INSTANCE_PROFILE")]
    pub instance_profile: Option<String>,
    #[arg(long, env = "PROTEUS_KEY_NAME")]
    pub key_name: Option<String>,
    /// Use RequestSpotInstances instead of RunInstances market options for spot.
    #[arg(long, env = "PROTEUS_SPOT_REQUESTS")]
    pub spot_requests: bool,
    /// Check the account's permissions with DryRun calls, print what is missing, and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Name of this broker's deployment: the value of the `proteus:managed` tag it puts on
    /// instances and the only instances it lists, adopts or terminates as leaks.
    #[arg(long, env = "PROTEUS_DEPLOYMENT", default_value = "default")]
    pub deployment: String,
}

impl ServeArgs {
    /// The defaults of `proteus serve` (simulated cloud on the built-in trace), for callers
    /// that build a broker in-process: the demo and the tests.
    pub fn sim_defaults() -> ServeArgs {
        ServeArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_url: None,
            lease_secs: 10.0,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_reload_poll_secs: 2,
            cloud: CloudKind::Sim,
            region: "us-east-1".into(),
            token: None,
            trace: None,
            on_demand: None,
            availability: Vec::new(),
            availability_instance_type: "p3.2xlarge".into(),
            speed: 60.0,
            start: None,
            hold_at: None,
            billing: None,
            market_model: None,
            tick_ms: 1000,
            local_agents: None,
            agent_bin: None,
            agent_download: None,
            agent_data_dir: None,
            agent_log: "warn,proteus_agent=info".into(),
            state_dir: None,
            checkpoint_store: None,
            agent_run_as: None,
            workdir_buckets: Vec::new(),
            max_job_events: crate::service::DEFAULT_MAX_JOB_EVENTS,
            checkpoint_max_archive: crate::checkpoint::DirLimits::default().max_archive_bytes,
            checkpoint_job_quota: crate::checkpoint::DirLimits::default().job_quota_bytes,
            instance_cap: 100,
            default_budget_usd: 100.0,
            header_read_timeout_secs: 10.0,
            idle_timeout_secs: 60.0,
            body_read_timeout_secs: 30.0,
            max_connections: 1024,
            startup_minutes: None,
            cooldown_secs: 600.0,
            min_notice_secs: 20.0,
            inject_launch_faults: None,
            ec2: Ec2Args {
                ami: "ami-00000000000000000".into(),
                subnet: None,
                security_group: Vec::new(),
                instance_profile: None,
                key_name: None,
                spot_requests: false,
                dry_run: false,
                deployment: "default".into(),
            },
        }
    }
}
/// A started broker: API listener bound, state recovered, scheduler not yet running.
pub struct Application {
    pub broker: Arc<Broker>,
    pub addr: SocketAddr,
    pub token: Option<String>,
    /// The certificate in service when the API is HTTPS.
    pub tls: Option<Arc<ReloadingCert>>,
    /// How often its files are checked for a replacement (`None`: on SIGHUP only).
    tls_poll: Option<Duration>,
    /// Timeouts and the connection cap of the API's listener.
    limits: ConnLimits,
    app: axum::Router,
    listener: tokio::net::TcpListener,
}

impl Application {
    /// Serves the API only; the caller drives the scheduler with [`Broker::tick`].
    pub fn serve_api(self) -> (Arc<Broker>, tokio::task::JoinHandle<()>) {
        let broker = self.broker.clone();
        tokio::spawn(broker.clone().run_lease_keeper(std::future::pending()));
        let task = tokio::spawn(self.serve(std::future::pending()));
        (broker, task)
    }

    /// The API over HTTPS (with the certificate watched for replacement) or plain HTTP, until
    /// `stop` resolves.
    async fn serve(self, stop: impl std::future::Future<Output = ()> + Send + 'static) {
        match self.tls {
            Some(cert) => {
                let config = match cert.server_config() {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::error!(error = %e, "TLS configuration failed");
                        return;
                    }
                };
                let watcher = tokio::spawn(tls::watch(cert, self.tls_poll));
                server::serve(self.listener, self.app, Some(config), self.limits, stop).await;
                watcher.abort();
            }
            None => server::serve(self.listener, self.app, None, self.limits, stop).await,
        }
    }

    /// Serves the API and runs the scheduler until `shutdown` resolves.
    pub async fn run_until(self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let broker = self.broker.clone();
        let mut rx2 = rx.clone();
        let scheduler = tokio::spawn(broker.clone().run_scheduler(async move {
            let _ = rx2.wait_for(|stop| *stop).await;
        }));
        let mut rx4 = rx.clone();
        let keeper = tokio::spawn(broker.clone().run_lease_keeper(async move {
            let _ = rx4.wait_for(|stop| *stop).await;
        }));
        let mut rx3 = rx.clone();
        let server = tokio::spawn(self.serve(async move {
            let _ = rx3.wait_for(|stop| *stop).await;
        }));
        shutdown.await;
        let _ = tx.send(true);
        let _ = scheduler.await;
        let _ = keeper.await;
        // The other brokers take this one's jobs over at once rather than after the lease.
        match broker.leave().await {
            Ok(()) => tracing::info!("released this broker's job leases"),
            Err(e) => tracing::warn!(error = %e, "cannot release the job leases; they expire"),
        }
        // Long polls may hold connections for a while; do not wait for them forever.
        let _ = tokio::time::timeout(Duration::from_secs(3), server).await;
    }
}

/// Builds the broker from flags: clock, cloud, launcher, prices, recovery, API router.
pub async fn start(
    store: Store,
    args: ServeArgs,
    listener: tokio::net::TcpListener,
) -> Result<Application> {
    start_with(store, args, listener, StartOptions::default()).await
}

/// What `proteus demo` changes about a broker: a clock it steps itself, and progress from the
/// work model so that a replay is deterministic.
#[derive(Default)]
pub struct StartOptions {
    pub clock: Option<SharedClock>,
    pub pacing: Option<crate::service::Pacing>,
    /// A simulated cloud that outlives the broker, as EC2 does (tests that restart a broker on
    /// the simulated cloud). Default: a new one.
    pub cloud: Option<Arc<dyn Cloud>>,
}

pub async fn start_with(
    store: Store,
    args: ServeArgs,
    listener: tokio::net::TcpListener,
    options: StartOptions,
) -> Result<Application> {
    let addr = listener.local_addr().context("listener address")?;
    // Certificate problems stop the start, before anything is recovered or launched.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            ReloadingCert::load(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            })
            .context("--tls-cert/--tls-key")?,
        ),
        (None, None) => None,
        _ => bail!("--tls-cert and --tls-key go together"),
    };
    if let Some(ca) = &args.tls_ca {
        crate::api::tls::read_ca_pem(ca).context("--tls-ca")?;
    }
    let limits = conn_limits(&args)?;
    let default_budget = match args.default_budget_usd {
        0.0 => None,
        b => Some(
            crate::market::Usd::new(b)
                .ok()
                .filter(|b| *b > crate::market::Usd::ZERO)
                .with_context(|| {
                    format!("--default-budget-usd {b}: a positive number of dollars, or 0 for none")
                })?,
        ),
    };
    if args.instance_cap == 0 {
        bail!("--instance-cap must be at least 1");
    }
    let region = Region::parse(&args.region).context("--region")?;
    let mut availability = None;
    // The simulated market's clock, which the API can hold (none on EC2, nor under the demo's
    // own clock).
    let mut sim_clock: Option<Arc<SimClock>> = None;
    if args.hold_at.is_some() && args.cloud != CloudKind::Sim {
        bail!("--hold-at holds the simulated market's clock: it needs --cloud sim");
    }
    let (history, clock): (Arc<PriceHistory>, SharedClock) = match args.cloud {
        CloudKind::Sim => {
            let history = if args.availability.is_empty() {
                Arc::new(load_sim_trace(&store, &args, &region).await?)
            } else {
                let (history, a) = load_availability(&store, &args).await?;
                let regions: std::collections::BTreeSet<String> =
                    a.markets().map(|m| m.region().to_string()).collect();
                if !regions.contains(&region.to_string()) {
                    bail!(
                        "--region {region}: the --availability pools are in {} (jobs are priced \
                         in the broker's region): pass --region {}",
                        regions.iter().cloned().collect::<Vec<_>>().join(", "),
                        regions.iter().next().cloned().unwrap_or_default()
                    );
                }
                availability = Some(a);
                Arc::new(history)
            };
            let (first, last) = history.span().context("the trace has no prices")?;
            let start = match &args.start {
                Some(s) => Timestamp::parse(s).context("--start")?,
                None => first.plus_secs(8.0 * 86_400.0).min(last),
            };
            if start < first || start >= last {
                bail!("--start {start} is outside the trace ({first} to {last})");
            }
            // A restarted broker resumes the market where its database's history ends: the
            // simulated time never runs backwards under the jobs and events already recorded.
            let latest = match options.clock {
                Some(_) => None,
                None => store
                    .latest_recorded_time()
                    .await
                    .context("reading where the database's history ends")?,
            };
            let start = match latest {
                Some(latest) if latest >= start => {
                    let resume = latest.plus_secs(1.0);
                    if resume >= last {
                        bail!(
                            "this database's history ends at {latest}, at or past the end of the \
                             trace ({last}): the simulated market cannot resume there; serve a \
                             longer trace or start on a fresh database"
                        );
                    }
                    tracing::info!(%resume, requested = %start,
                        "the simulated market resumes where this database's history ends");
                    resume
                }
                _ => start,
            };
            if !(args.speed.is_finite() && args.speed > 0.0) {
                bail!("--speed must be a positive number");
            }
            let clock: SharedClock = match options.clock.clone() {
                Some(c) => c,
                None => {
                    let c = Arc::new(SimClock::new(start, args.speed));
                    if let Some(h) = &args.hold_at {
                        let h = Timestamp::parse(h).context("--hold-at")?;
                        c.hold_at(Some(h));
                        tracing::info!(%h, "the simulated market is held there until POST /v1/sim/clock lifts it");
                    }
                    sim_clock = Some(c.clone());
                    c
                }
            };
            (history, clock)
        }
        CloudKind::Ec2 => {
            let filter = MarketFilter {
                region: Some(region.clone()),
                ..Default::default()
            };
            let history = store.load_history(&filter, None, None).await?;
            if history.is_empty() {
                tracing::warn!(
                    "no stored price history for {region}: run `proteus prices ingest --from-ec2` first"
                );
            }
            (Arc::new(history), database_clock(&store).await)
        }
    };
    let cloud: Arc<dyn Cloud> = match (args.cloud, options.cloud.clone()) {
        (CloudKind::Sim, Some(cloud)) => cloud,
        (CloudKind::Sim, None) => {
            let cloud = SimCloud::new(
                history.clone(),
                clock.clone(),
                Duration::from_secs_f64(args.min_notice_secs.max(0.0)),
            );
            Arc::new(match availability.clone() {
                Some(a) => cloud.with_availability(a),
                None => cloud,
            })
        }
        (CloudKind::Ec2, _) => ec2_cloud(&args, &region, addr).await?,
    };
    let cloud: Arc<dyn Cloud> = match &args.inject_launch_faults {
        Some(rules) => Arc::new(FaultyCloud::new(
            cloud,
            FaultyCloud::parse_rules(rules).map_err(anyhow::Error::msg)?,
        )),
        None => cloud,
    };
    let advertise = advertise_url(&args, addr);
    let local_agents = args
        .local_agents
        .unwrap_or(args.cloud == CloudKind::Sim || std::env::var_os("AWS_ENDPOINT_URL").is_some());
    let launcher = if local_agents {
        let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
        let (agent_bin, agent_prefix) = match &args.agent_bin {
            Some(bin) => (bin.clone(), Vec::new()),
            None => LauncherConfig::default_agent_command(),
        };
        let config = LauncherConfig {
            agent_bin,
            agent_prefix,
            data_dir: args
                .agent_data_dir
                .clone()
                .unwrap_or_else(|| data::data_dir().join("ml")),
            state_dir,
            imds_poll_ms: 500,
            exit_margin_secs: 1,
            agent_log: args.agent_log.clone(),
            ca_file: args.tls_ca.clone(),
            run_as: args.agent_run_as.clone(),
        };
        Some(Arc::new(LocalLauncher::new(config)?))
    } else {
        None
    };
    let sim = args.cloud == CloudKind::Sim;
    let settings = Settings {
        region,
        default_billing: args.billing.unwrap_or(if sim {
            BillingModel::Hourly2015
        } else {
            BillingModel::PerSecond
        }),
        model: args.market_model.unwrap_or(if sim {
            ModelChoice::Price
        } else {
            ModelChoice::Hazard
        }),
        tick: Duration::from_millis(args.tick_ms.max(10)),
        default_startup_minutes: args
            .startup_minutes
            .unwrap_or(crate::job::DEFAULT_STARTUP_MINUTES),
        cooldown_secs: args.cooldown_secs,
        min_notice: Duration::from_secs_f64(args.min_notice_secs.max(0.0)),
        pacing: options.pacing.unwrap_or(crate::service::Pacing::Measured),
        workdir: crate::service::programs::WorkdirPolicy::new(
            args.checkpoint_store.as_deref(),
            &args.workdir_buckets,
        )
        .map_err(anyhow::Error::msg)
        .context("--workdir-buckets/--checkpoint-store")?,
        max_job_events: args.max_job_events,
        instance_cap: args.instance_cap,
        availability: availability.clone(),
        default_budget,
    };
    let (auth, token) = user_auth(&store, args.token.as_deref(), clock.now()).await?;
    // A session cookie set over HTTPS must never travel back over plain HTTP.
    let auth = auth.with_secure_cookies(tls.is_some());
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    let broker_id = crate::service::membership::broker_id_of(&state_dir)
        .with_context(|| format!("this broker's id in {}", state_dir.display()))?;
    if !(args.lease_secs.is_finite() && (1.0..=3600.0).contains(&args.lease_secs)) {
        bail!("--lease-secs must be between 1 and 3600");
    }
    let membership = crate::service::membership::Membership::new(
        broker_id,
        advertise.clone(),
        Duration::from_secs_f64(args.lease_secs),
        // On the embedded database a broker is alone (it holds the file's lock).
        store.backend() == crate::store::Backend::Sqlite,
    );
    let broker = Broker::new(store, clock, cloud, launcher, history, settings, membership);
    let checkpoints = match &args.checkpoint_store {
        Some(spec) => spec.clone(),
        // Brokers that share a database take each other's jobs over: a replacement must find
        // its rank's checkpoint whichever broker took it, so this broker's own disk will not do.
        // (The simulated cloud cannot be shared: such a broker is alone on its database.)
        None if broker.store().backend() == crate::store::Backend::Postgres
            && broker.cloud().kind() != "sim" =>
        {
            bail!(
                "brokers on a shared database need a checkpoint store every broker reaches: set \
                 --checkpoint-store s3://BUCKET/PREFIX (or a directory every broker mounts, such \
                 as EFS); the default, {}, is this broker's own disk, and a job taken over by \
                 another broker would find none of its checkpoints",
                state_dir.join("checkpoints").display()
            )
        }
        None => state_dir.join("checkpoints").display().to_string(),
    };
    let dir_limits = crate::checkpoint::DirLimits {
        max_archive_bytes: args.checkpoint_max_archive,
        job_quota_bytes: args.checkpoint_job_quota,
    };
    let checkpoints = CheckpointStore::open(&checkpoints, dir_limits)
        .await
        .with_context(|| format!("--checkpoint-store {checkpoints}"))?;
    tracing::info!(store = %checkpoints.describe(), "command-job checkpoints");
    broker.set_program_storage(ProgramStorage::new(checkpoints));
    broker
        .recover()
        .await
        .context("recovering state after start")?;
    let downloads = crate::api::Downloads {
        agent_binary: args.agent_download.clone().or_else(|| {
            let exe = std::env::current_exe().ok()?;
            exe.parent()
                .map(|d| d.join("proteus-agent"))
                .filter(|p| p.is_file())
        }),
        data_dir: Some(
            args.agent_data_dir
                .clone()
                .unwrap_or_else(|| data::data_dir().join("ml")),
        ),
    };
    let app = router(AppState {
        broker: broker.clone(),
        auth,
        downloads,
        sim_clock,
    })
    .layer(tower_http::trace::TraceLayer::new_for_http());
    Ok(Application {
        broker,
        addr,
        token,
        tls,
        tls_poll: (args.tls_reload_poll_secs > 0)
            .then(|| Duration::from_secs(args.tls_reload_poll_secs)),
        limits,
        app,
        listener,
    })
}

/// The listener's timeouts and connection cap, from their flags.
fn conn_limits(args: &ServeArgs) -> Result<ConnLimits> {
    let secs = |flag: &str, v: f64| {
        if v.is_finite() && v > 0.0 && v <= 86_400.0 {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(anyhow::anyhow!(
                "--{flag} {v}: a positive number of seconds, at most a day"
            ))
        }
    };
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    Ok(ConnLimits {
        header_read_timeout: secs("header-read-timeout-secs", args.header_read_timeout_secs)?,
        idle_timeout: secs("idle-timeout-secs", args.idle_timeout_secs)?,
        body_read_timeout: secs("body-read-timeout-secs", args.body_read_timeout_secs)?,
        max_connections: args.max_connections,
    })
}

/// Wall time on the database's clock (see [`DatabaseClock`]): measured now, and again every
/// [`CLOCK_SYNC_EVERY`] for as long as the clock is in use.
async fn database_clock(store: &Store) -> SharedClock {
    let clock = Arc::new(DatabaseClock::default());
    match sync_clock(store, &clock).await {
        Ok(()) if clock.offset_ms().abs() >= 1000 => tracing::warn!(
            offset_secs = clock.offset_ms() as f64 / 1000.0,
            "this machine's clock is off the database's: the broker keeps the database's time \
             (set the machine's clock right: NTP, chrony)"
        ),
        Ok(()) => {}
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the database's clock yet; using this machine's")
        }
    }
    let (store, weak) = (store.clone(), Arc::downgrade(&clock));
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(CLOCK_SYNC_EVERY).await;
            let Some(clock) = weak.upgrade() else {
                return;
            };
            if let Err(e) = sync_clock(&store, &clock).await {
                tracing::debug!(error = %e, "cannot read the database's clock; keeping the last offset");
            }
        }
    });
    clock
}

/// How often a broker measures its clock against the database's.
const CLOCK_SYNC_EVERY: Duration = Duration::from_secs(10);

/// Sets `clock`'s offset from one reading of the database's clock, taken as the midpoint of
/// the round trip; a reading whose round trip took over a second is not trusted.
async fn sync_clock(store: &Store, clock: &DatabaseClock) -> Result<()> {
    let before = Timestamp::now().millis();
    let db = store
        .db_now_ms()
        .await
        .context("reading the database's clock")?;
    let after = Timestamp::now().millis();
    if after - before <= 1000 {
        clock.set_offset_ms(db - (before + after) / 2);
    }
    Ok(())
}

/// What agents call: the flag's URL, or this listener's with the scheme it serves.
fn advertise_url(args: &ServeArgs, addr: SocketAddr) -> String {
    args.advertise_url.clone().unwrap_or_else(|| {
        let scheme = if args.tls_cert.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{addr}")
    })
}

/// The user token: the flag's, or the stored hash, or a new one (printed once).
async fn user_auth(
    store: &Store,
    flag: Option<&str>,
    now: Timestamp,
) -> Result<(UserAuth, Option<String>)> {
    if let Some(token) = flag {
        crate::api::auth::check_user_token(token).map_err(anyhow::Error::msg)?;
        return Ok((UserAuth::from_token(token), None));
    }
    if let Some(hash) = store.api_token_hash("user").await? {
        return Ok((UserAuth::from_hash(hash), None));
    }
    let token = new_token("pt_");
    let hash = store
        .init_api_token_hash("user", &hash_token(&token), now)
        .await?;
    if hash == hash_token(&token) {
        eprintln!(
            "generated the API token (shown once; the broker keeps only its hash):\n  export PROTEUS_TOKEN={token}"
        );
        Ok((UserAuth::from_hash(hash), Some(token)))
    } else {
        Ok((UserAuth::from_hash(hash), None))
    }
}

pub fn default_state_dir() -> PathBuf {
    crate::data::user_dir().join("state")
}

/// The sim trace: the file given, or the one built in. It is also ingested into the store so
/// that the markets and prices endpoints show what the simulated cloud sells.
/// `--availability`: the pools and their constant prices, stored as a price trace would be.
async fn load_availability(
    store: &Store,
    args: &ServeArgs,
) -> Result<(PriceHistory, Arc<crate::sim::availability::Availability>)> {
    use crate::sim::availability::{
        Availability, AvailabilityTrace, P3_2XLARGE_ON_DEMAND_USD_PER_HOUR, Reading,
        TRACE_SPOT_USD_PER_HOUR, origin_of,
    };
    let instance_type = crate::market::InstanceType::parse(&args.availability_instance_type)
        .map_err(|e| anyhow::anyhow!("--availability-instance-type: {e}"))?;
    let mut traces = Vec::new();
    for path in &args.availability {
        traces.push(AvailabilityTrace::load(path, Reading::Available)?);
    }
    let origin = origin_of(&args.availability[0]);
    let availability = Arc::new(Availability::new(traces, instance_type, origin)?);
    let spot = crate::market::UsdPerHour::new(TRACE_SPOT_USD_PER_HOUR).context("spot price")?;
    let on_demand = crate::market::UsdPerHour::new(P3_2XLARGE_ON_DEMAND_USD_PER_HOUR)
        .context("on-demand price")?;
    let history = availability.price_history(spot, on_demand);
    let rows: Vec<files::SpotPriceRow> = history
        .series()
        .flat_map(|s| {
            s.times()
                .iter()
                .zip(s.prices())
                .map(|(&time, &price)| files::SpotPriceRow {
                    market: s.market().clone(),
                    time,
                    price: crate::market::UsdPerHour::new(price).unwrap_or(spot),
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let offers: Vec<_> = history.on_demand().offers().cloned().collect();
    store_prices(store, &offers, &rows, "the availability pools' prices").await?;
    Ok((history, availability))
}

async fn load_sim_trace(store: &Store, args: &ServeArgs, region: &Region) -> Result<PriceHistory> {
    let rows = match &args.trace {
        Some(path) => files::read_spot_file(path)?,
        None => {
            let raw = files::decompress_if_gzipped(data::TRACE_2015.to_vec())
                .context("built-in trace")?;
            files::parse_spot_bytes(Path::new(data::TRACE_2015_NAME), &raw)?
        }
    };
    let offers = match &args.on_demand {
        Some(path) => files::read_on_demand_file(path, region)?,
        None => files::parse_on_demand_bytes(
            Path::new(data::ON_DEMAND_2015_NAME),
            data::ON_DEMAND_2015,
            region,
        )?,
    };
    store_prices(store, &offers, &rows, "the trace").await?;
    Ok(crate::sim::inputs::history_from_rows(rows, offers))
}

/// The sim cloud's prices into the store, where the API and the dashboard read them.
async fn store_prices(
    store: &Store,
    offers: &[crate::prices::InstanceOffer],
    rows: &[crate::prices::SpotPriceRow],
    spot_what: &str,
) -> Result<()> {
    store
        .ingest_on_demand(offers)
        .await
        .context("storing on-demand prices")?;
    store
        .ingest_spot_prices(rows)
        .await
        .with_context(|| format!("storing {spot_what}"))?;
    Ok(())
}

#[cfg(feature = "ec2")]
pub(crate) fn ec2_config(
    args: &ServeArgs,
    region: &Region,
    addr: SocketAddr,
) -> crate::cloud::ec2::Ec2Config {
    crate::cloud::ec2::Ec2Config {
        region: region.clone(),
        ami: args.ec2.ami.clone(),
        subnet: args.ec2.subnet.clone(),
        security_groups: args.ec2.security_group.clone(),
        instance_profile: args.ec2.instance_profile.clone(),
        key_name: args.ec2.key_name.clone(),
        spot_requests: args.ec2.spot_requests,
        broker_url: advertise_url(args, addr),
        // Checked readable at start.
        ca_pem: args
            .tls_ca
            .as_deref()
            .and_then(|p| crate::api::tls::read_ca_pem(p).ok()),
        deployment: args.ec2.deployment.clone(),
    }
}

#[cfg(feature = "ec2")]
async fn ec2_cloud(args: &ServeArgs, region: &Region, addr: SocketAddr) -> Result<Arc<dyn Cloud>> {
    Ok(Arc::new(
        crate::cloud::ec2::Ec2Cloud::new(ec2_config(args, region, addr)).await,
    ))
}

/// `serve --cloud ec2 --dry-run`: every EC2 action the broker uses, checked with `DryRun`.
#[cfg(not(feature = "ec2"))]
async fn ec2_cloud(_: &ServeArgs, _: &Region, _: SocketAddr) -> Result<Arc<dyn Cloud>> {
    bail!("this build of proteus has no EC2 support (built without the `ec2` feature)")
}
