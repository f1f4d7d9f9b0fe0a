//! `proteus demo`: the whole system on one machine with nothing but this binary (and the agent
//! binary built beside it).
//!
//! An embedded database receives the 2015 spot trace; a broker with the simulated cloud serves
//! the real API on loopback; a job is submitted over HTTP; the local launcher starts one real
//! `proteus-agent` per instance; the trace's price spikes evict spot instances with the
//! two-minute warning delivered through each instance's metadata endpoint; the agents hand their
//! state over and training goes on. The demo steps market time itself (see
//! [`Pacing::Modelled`]) so that the same seed gives the same decisions and the same cost.

use super::DatabaseArgs;
use crate::chart::Format;
use crate::clock::{Clock, ManualClock, SharedClock};
use crate::market::Timestamp;
use crate::output::{OutputFormat, pct};
use crate::service::Pacing;
use crate::service::jobs::{CostReport, JobView};
use crate::service::spec::{App, JobSpec, StopSpec, TrainingSpec, WorkSpec};
use crate::startup::{ServeArgs, StartOptions, start_with};
use crate::store::Store;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which spot market the demo plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoMarket {
    /// The papers' market: the 2015 us-east-1 price trace, where bids decide evictions,
    /// billed per started hour.
    #[value(name = "2015")]
    Y2015,
    /// Today's: real 2023 availability traces of up to 16 p3.2xlarge in us-west-2a and
    /// us-west-2c (docs/today.md). Launches are refused without capacity, instances interrupted when a
    /// pool shrinks, billing per second with an interrupted first hour free; the job runs on
    /// p3.2xlarge with a deadline of twice its work at full speed, and may hold every instance
    /// on-demand when the deadline needs it.
    Today,
}

/// Where the today market's traces are: data/spot/skypilot-spot-traces, the 16-node set (up to
/// 16 instances at once per zone), its two us-west-2 zones (a broker prices in one region).
const TODAY_TRACES: &str = "skypilot-spot-traces/availability/16-node/aws-08-27-2023";
const TODAY_ZONES: [&str; 2] = ["us-west-2a", "us-west-2c"];
/// A day into the traces.
const TODAY_START: &str = "2023-08-28T00:00:00Z";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoApp {
    /// Multinomial logistic regression on MNIST (test accuracy).
    Mlr,
    /// Matrix factorisation on MovieTweetings (held-out RMSE).
    Mf,
}

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    proteus demo\n  \
    proteus demo --policy standard-bidding --seed 7\n  \
    proteus demo --app mf --start 2015-06-01T00:00:00Z --speed 4000\n  \
    proteus demo --output json > demo.json\n  \
    proteus demo --job examples/jobs/demo.toml --policy on-demand --start 2015-05-03T00:00:00Z\n  \
    proteus demo --keep-serving   # then open the printed dashboard URL\n  \
    proteus demo --no-agents --job examples/jobs/demo.toml --step-secs 3600 --output json\n  \
    proteus demo --market today   # 2023 availability traces, a deadline, per-second billing")]
pub struct DemoArgs {
    /// Database URL. Default: a fresh SQLite file in the demo's output directory.
    #[arg(long, env = "PROTEUS_DATABASE_URL")]
    pub database_url: Option<String>,
    /// The job (a job spec, as `proteus submit` and `proteus simulate --job` take it).
    /// Default: the repository's examples/jobs/demo.toml. The flags below override its fields.
    #[arg(long, value_name = "FILE")]
    pub job: Option<PathBuf>,
    /// The policy that buys capacity: bidbrain, on-demand, standard-bidding. Default: the job's.
    #[arg(long)]
    pub policy: Option<String>,
    /// Default: the job's.
    #[arg(long, value_enum)]
    pub app: Option<DemoApp>,
    /// The spot market: `2015` (the papers') or `today` (real 2023 availability traces).
    #[arg(long, value_enum, default_value_t = DemoMarket::Y2015)]
    pub market: DemoMarket,
    /// Market time where the job starts. Default: 2015-05-01 (2015), 2023-08-28 (today).
    #[arg(long)]
    pub start: Option<String>,
    /// Market seconds per wall second, at most (the demo also waits for the agents' training).
    #[arg(long, default_value_t = 2400.0)]
    pub speed: f64,
    /// Market seconds per scheduling step.
    #[arg(long, default_value_t = 60.0)]
    pub step_secs: f64,
    /// Seeds the training (initialisation and data order): same seed, same run.
    /// Default: the job's.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Work of the job, in c3.xlarge-hours: what the policy plans with and the cost is for.
    /// Default: the job's.
    #[arg(long)]
    pub work: Option<f64>,
    /// Default: the job's.
    #[arg(long)]
    pub max_instances: Option<u32>,
    /// Passes over the training data. Default: the job's.
    #[arg(long)]
    pub epochs: Option<u32>,
    /// Where the chart and the demo's database go. Default: ./proteus-demo (or a temporary
    /// directory if the current one is not writable).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
    /// After the report, keep the broker and its dashboard up (printing their URL and token)
    /// until Ctrl-C.
    #[arg(long)]
    pub keep_serving: bool,
    /// Run the broker without agents: its decisions, evictions and bill only (no training; the
    /// job ends when its modelled work is done, or at its budget or deadline). Market time
    /// then moves as fast as the broker decides. What `proteus simulate` predicts for the same
    /// job, start and policy, run through the live broker.
    #[arg(long)]
    pub no_agents: bool,
}

/// What the demo prints at the end (and `--output json`).
#[derive(Debug, Serialize)]
pub struct DemoResult {
    pub job: JobView,
    pub cost: CostReport,
    pub chart: PathBuf,
    pub wall_seconds: f64,
    pub market_hours: f64,
    /// A digest of every decision (launches, releases, evictions with their market times):
    /// two runs with the same seed print the same digest.
    pub decisions_digest: String,
}

pub async fn run(args: DemoArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let out = output_dir(args.out.clone())?;
    let database = DatabaseArgs {
        database_url: args.database_url.clone(),
    };
    let (store, db_note) = open_store(&database, &out).await?;
    let start = Timestamp::parse(&start_of(&args)).context("--start")?;
    if !(args.speed > 0.0 && args.step_secs > 0.0) {
        bail!("--speed and --step-secs must be positive");
    }
    let quiet = args.output == OutputFormat::Json;
    let spec = job_spec(&args)?;
    if !quiet {
        eprintln!(
            "proteus demo: database {db_note}; market opens at {start}; policy {}",
            spec.policy
        );
    }

    let clock = ManualClock::new(start);
    let shared: SharedClock = Arc::new(clock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the API")?;
    let token = crate::api::auth::new_token("pt_");
    let serve = serve_args(&out, &token, &args);
    let server = start_with(
        store,
        serve,
        listener,
        StartOptions {
            clock: Some(shared),
            pacing: Some(Pacing::Modelled),
            ..Default::default()
        },
    )
    .await?;
    let url = format!("http://{}", server.addr);
    let (broker, api) = server.serve_api();

    let remote = super::client::Remote {
        url: url.clone(),
        token: Some(token.clone()),
        ca_file: None,
    };
    let client = super::client::Client::new(&remote)?;
    let job: JobView = client
        .post("/v1/jobs", &spec)
        .await
        .context("submitting the demo job")?;
    if !quiet {
        eprintln!(
            "submitted job {} over {url}/v1/jobs; agents log to {}",
            job.id,
            out.join("state/agents").display()
        );
    }

    let bar = progress_bar(quiet);
    let step = Duration::from_secs_f64(args.step_secs / args.speed);
    let id = proteus_wire::JobId(job.id);
    // Market time moves in steps of at most `--step-secs`, and onto every instant at which
    // something happens (the broker says when), so that the broker decides at the instants
    // the simulator does: same job, start and policy, same decisions as `proteus simulate`.
    let mut waited_at_completion = false;
    let market_end = loop {
        let tick_started = Instant::now();
        broker.tick().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        let view = broker
            .job_view(id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        update_bar(&bar, &view, clock.now());
        if view.state != "pending" && view.state != "running" {
            let end = clock.now();
            settle(&broker, id).await;
            break end;
        }
        wait_for_handovers(&broker, id, &bar).await;
        if keep_pace_with_training(&broker, id, &bar).await && !waited_at_completion {
            // The modelled work is done and the agents have now finished too: the job ends
            // at this instant, as in the simulator.
            waited_at_completion = true;
            continue;
        }
        if !args.no_agents
            && let Some(rest) = step.checked_sub(tick_started.elapsed())
        {
            tokio::time::sleep(rest).await;
        }
        let now = clock.now();
        let next = broker
            .next_event_after(now)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .unwrap_or(now.plus_secs(args.step_secs))
            .min(now.plus_secs(args.step_secs));
        clock.set(next);
        if clock.now().secs_since(start) > 14.0 * 86_400.0 {
            broker
                .cancel(id)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            bail!("the demo job did not finish within two weeks of market time; cancelled it");
        }
    };
    bar.finish_and_clear();

    let job: JobView = client.get(&format!("/v1/jobs/{}", job.id)).await?;
    let cost: CostReport = client.get(&format!("/v1/jobs/{}/cost", job.id)).await?;
    let instances = broker.store().instances_of_job(id).await?;
    let chart_path = out.join("proteus-demo.svg");
    let title = format!(
        "Proteus demo: job {} ({}), policy {}",
        job.id, job.name, job.policy
    );
    for (format, path) in [
        (Format::Svg, &chart_path),
        (Format::Png, &chart_path.with_extension("png")),
    ] {
        let bytes = crate::chart::job_chart(
            format,
            &title,
            &broker.market_data().history,
            broker.settings().availability.as_deref(),
            &instances,
            start,
            market_end,
        )?;
        std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    let digest = decisions_digest(broker.store(), id).await?;
    if let Some(launcher) = &broker.launcher() {
        launcher.stop_all(Duration::from_secs(2)).await;
    }

    let result = DemoResult {
        wall_seconds: started.elapsed().as_secs_f64(),
        market_hours: market_end.secs_since(start) / 3600.0,
        chart: chart_path,
        decisions_digest: digest,
        job,
        cost,
    };
    match args.output {
        OutputFormat::Json => {
            crate::output::emit(OutputFormat::Json, &result, crate::output::Table::default)?
        }
        _ => print!("{}", summary(&result)),
    }
    if args.keep_serving {
        // The report is on stdout; where to look goes to stderr so that `--output json` stays
        // one document.
        eprintln!(
            "\nthe broker keeps serving (Ctrl-C stops it):\n  dashboard: {url}/\n  token:     {token}\n  \
             CLI:       PROTEUS_URL={url} PROTEUS_TOKEN={token} proteus status"
        );
        tokio::signal::ctrl_c()
            .await
            .context("waiting for Ctrl-C")?;
    }
    api.abort();
    Ok(if result.job.state == "succeeded" {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn output_dir(flag: Option<PathBuf>) -> Result<PathBuf> {
    let dir = match flag {
        Some(d) => d,
        None => {
            let here = PathBuf::from("proteus-demo");
            if std::fs::create_dir_all(&here).is_ok() && tempfile_writable(&here) {
                here
            } else {
                std::env::temp_dir().join("proteus-demo")
            }
        }
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(std::path::absolute(&dir).unwrap_or(dir))
}

fn tempfile_writable(dir: &std::path::Path) -> bool {
    let probe = dir.join(".write-test");
    let ok = std::fs::write(&probe, b"").is_ok();
    let _ = std::fs::remove_file(probe);
    ok
}

/// The demo's own database: a fresh SQLite file each run (so runs are comparable), unless
/// `--database-url` names one.
async fn open_store(database: &DatabaseArgs, out: &std::path::Path) -> Result<(Store, String)> {
    if database.database_url.is_some() {
        let store = database.open_store().await?;
        let url = store.url().to_string();
        return Ok((store, url));
    }
    let path = out.join("demo.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let url = format!("sqlite://{}", path.display());
    let store = Store::open(&url)
        .await
        .with_context(|| format!("opening {url}"))?;
    Ok((store, format!("{} (fresh)", path.display())))
}

fn start_of(args: &DemoArgs) -> String {
    args.start.clone().unwrap_or_else(|| {
        match args.market {
            DemoMarket::Y2015 => "2015-05-01T00:00:00Z",
            DemoMarket::Today => TODAY_START,
        }
        .to_string()
    })
}

fn serve_args(out: &std::path::Path, token: &str, args: &DemoArgs) -> ServeArgs {
    let base = ServeArgs {
        token: Some(token.to_string()),
        speed: args.speed,
        start: Some(start_of(args)),
        local_agents: Some(!args.no_agents),
        state_dir: Some(out.join("state")),
        // Market time decides evictions; the demo itself waits for warned agents to hand over.
        min_notice_secs: 0.0,
        ..ServeArgs::sim_defaults()
    };
    match args.market {
        DemoMarket::Y2015 => base,
        DemoMarket::Today => {
            let dir = crate::data::data_dir().join("spot").join(TODAY_TRACES);
            ServeArgs {
                availability: TODAY_ZONES
                    .iter()
                    .map(|z| dir.join(format!("{z}_v100_1.json")))
                    .collect(),
                region: "us-west-2".into(),
                billing: Some(crate::billing::BillingModel::PerSecond),
                market_model: Some(crate::service::ModelChoice::Hazard),
                ..base
            }
        }
    }
}

/// The demo's job: the `--job` file (default examples/jobs/demo.toml) with the flags' overrides.
fn job_spec(args: &DemoArgs) -> Result<JobSpec> {
    let path = args.job.clone().unwrap_or_else(default_job_file);
    let file = path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {file}"))?;
    let mut spec = JobSpec::parse_file(&file, &text).map_err(anyhow::Error::msg)?;
    if let Some(policy) = &args.policy {
        spec.policy = policy.clone();
    }
    if let Some(app) = args.app {
        let (app, dataset) = match app {
            DemoApp::Mlr => (App::Mlr, "mnist"),
            DemoApp::Mf => (App::Mf, "movietweetings-100k.csv.gz"),
        };
        spec.app = app;
        spec.dataset = Some(dataset.into());
        spec.name = Some(format!(
            "demo-{}",
            dataset.split('-').next().unwrap_or(dataset)
        ));
    }
    if let Some(epochs) = args.epochs {
        spec.stop = Some(StopSpec {
            epochs: Some(epochs),
            clocks: None,
        });
    }
    if let Some(n) = args.max_instances {
        spec.limits.max_instances = n;
    }
    if let Some(work) = args.work {
        spec.work.get_or_insert_with(WorkSpec::default).total_work = Some(work);
    }
    if let Some(seed) = args.seed {
        spec.training.get_or_insert_with(TrainingSpec::default).seed = Some(seed);
    }
    if args.market == DemoMarket::Today {
        // The only type, so the reference type: a unit is a p3.2xlarge-hour.
        let work = spec.work.get_or_insert_with(WorkSpec::default);
        work.instance_types = Some(vec!["p3.2xlarge".into()]);
        let total = work.total_work.unwrap_or(24.0);
        let full_speed = f64::from(spec.limits.max_instances.max(1));
        if spec.limits.deadline.is_none() && spec.limits.deadline_hours.is_none() {
            spec.limits.deadline_hours = Some(2.0 * total / full_speed);
        }
        // A deadline on today's market needs room for on-demand when spot is not there.
        spec.limits.max_reliable_instances = Some(spec.limits.max_instances);
    }
    Ok(spec)
}

/// The repository's examples/jobs/demo.toml.
fn default_job_file() -> PathBuf {
    crate::data::project_dir("examples", None, "jobs/demo.toml")
        .join("jobs")
        .join("demo.toml")
}

fn progress_bar(hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(1000);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30.cyan/blue}] {percent:>3}% work | {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn update_bar(bar: &ProgressBar, view: &JobView, now: Timestamp) {
    bar.set_position((view.progress * 1000.0) as u64);
    let metric = view
        .metric
        .as_ref()
        .and_then(|m| {
            Some(format!(
                "{} {:.3}",
                m["kind"].as_str()?,
                m["value"].as_f64()?
            ))
        })
        .unwrap_or_else(|| "-".into());
    bar.set_message(format!(
        "{} | spent {} | reliable {}, transient {}{} | evictions {} | {metric}",
        now.to_datetime().format("%m-%d %H:%M"),
        view.spend_usd,
        view.instances_by_tier.get("reliable").copied().unwrap_or(0),
        view.instances_by_tier
            .get("transient")
            .copied()
            .unwrap_or(0),
        super::client::leaving_text(&view.leaving_by_tier),
        view.evictions,
    ));
}

/// Lets warned agents hand their state over (bounded) before market time moves on, as the two
/// minutes of a real notice would.
async fn wait_for_handovers(
    broker: &crate::service::Broker,
    job: proteus_wire::JobId,
    bar: &ProgressBar,
) {
    let Some(launcher) = &broker.launcher() else {
        return;
    };
    // A hand-over takes well under a second on an idle machine; a loaded one gets a minute.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let warned = match broker.store().instances_of_job(job).await {
            Ok(rows) => rows
                .into_iter()
                .filter(|i| {
                    i.state == crate::store::InstanceState::Warned && launcher.is_running(&i.id)
                })
                .count(),
            Err(_) => 0,
        };
        if warned == 0 || Instant::now() > deadline {
            return;
        }
        bar.tick();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// After the job ends: a few more ticks at the same market time, so that the terminations it
/// asked for are seen and billed.
async fn settle(broker: &crate::service::Broker, job: proteus_wire::JobId) {
    for _ in 0..20 {
        let live = broker
            .store()
            .instances_of_job(job)
            .await
            .map(|rows| rows.iter().filter(|i| !i.state.is_final()).count())
            .unwrap_or(0);
        if live == 0 {
            return;
        }
        if broker.tick().await.is_err() {
            return;
        }
    }
}

/// Waits (bounded) until the agents' training has caught up with the work the market clock has
/// credited, so that market time does not race ahead of real training.
/// Returns whether the modelled work is complete and the training has finished.
async fn keep_pace_with_training(
    broker: &crate::service::Broker,
    job: proteus_wire::JobId,
    bar: &ProgressBar,
) -> bool {
    let Some(runtime) = broker.runtime(job) else {
        return false;
    };
    let fraction = {
        let rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
        rt.engine.fraction()
    };
    let Some(control) = broker.control().get(job) else {
        return false;
    };
    // Agents that fall behind are waited for as long as they keep making progress: on a
    // loaded machine they may need longer than a fixed bound, and stepping the market on
    // without them would end the job at another instant than the simulator does. Only a
    // stall (no clock finished for this long) stops the wait.
    let stall = Duration::from_secs(if fraction >= 1.0 { 120 } else { 15 });
    let mut deadline = Instant::now() + stall;
    let mut last_clock = None;
    loop {
        let status = control.read(|c| c.status());
        let total = status.progress.total_clocks.max(1);
        let wanted = ((fraction * total as f64).ceil() as u64).min(total);
        let caught_up = status.progress.clock >= wanted;
        let done = status.state == proteus_wire::coordinator::JobState::Completed;
        if last_clock != Some(status.progress.clock) {
            last_clock = Some(status.progress.clock);
            deadline = Instant::now() + stall;
        }
        if caught_up || done || Instant::now() > deadline || status.members.is_empty() {
            return fraction >= 1.0 && done;
        }
        bar.tick();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Launches, releases and evictions with their market times and markets, hashed by the
/// engine's one digest ([`crate::engine::digest`]), which `proteus simulate` prints too.
async fn decisions_digest(store: &Store, job: proteus_wire::JobId) -> Result<String> {
    let rows = store.instances_of_job(job).await?;
    Ok(crate::engine::digest::of_stored(&rows))
}

fn summary(r: &DemoResult) -> String {
    let mut out = String::new();
    let metric = r
        .job
        .metric
        .as_ref()
        .and_then(|m| {
            Some(format!(
                "{} {:.4}",
                m["kind"].as_str()?,
                m["value"].as_f64()?
            ))
        })
        .unwrap_or_else(|| "no evaluation".into());
    out.push_str(&format!(
        "\njob {} {} ({}) in {:.1} market hours ({:.0} s of wall time); final test {metric}\n\n",
        r.job.id,
        r.job.state,
        r.job.state_reason.as_deref().unwrap_or(""),
        r.market_hours,
        r.wall_seconds
    ));
    out.push_str(&super::client::cost_text(&r.cost));
    if r.cost.pacing == "modelled" {
        out.push_str(
            "(the demo paces work by the work model on market time while the agents train for \
             real, so the estimate and the measured work agree by construction, up to the work \
             evictions lose and is redone)\n",
        );
    }
    // Against every baseline the report replayed (on today's market: the same capacity, by the
    // job's deadline).
    let mut vs = Vec::new();
    for c in &r.cost.counterfactuals {
        let label = match c.policy.as_str() {
            "standard-bidding" => "standard bidding",
            other => other,
        };
        let missed = if c.deadline_met == Some(false) {
            " (which missed the deadline)"
        } else {
            ""
        };
        match r.cost.savings.get(&c.policy) {
            Some(s) if *s >= 0.0 => vs.push(format!("{} cheaper than {label}{missed}", pct(*s))),
            Some(s) => vs.push(format!("{} dearer than {label}{missed}", pct(-*s))),
            None => {}
        }
    }
    if !vs.is_empty() {
        out.push_str(&format!("\n{}: {}\n", r.job.policy, vs.join(", ")));
    }
    out.push_str(&format!(
        "chart: {} (and .png)\ndecisions digest: {} (same seed, same digest)\n",
        r.chart.display(),
        r.decisions_digest
    ));
    out
}
