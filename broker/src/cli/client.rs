//! The user commands that talk to a running broker: `submit`, `status`, `report`, `cancel`.

use crate::market::Usd;
use crate::output::{Cell, OutputFormat, Table, duration, emit, pct};
use crate::service::dry_run::DryRun;
use crate::service::jobs::{CostReport, JobView};
use crate::service::spec::JobSpec;
use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::PathBuf;
use std::process::ExitCode;

/// Where the broker is and how to authenticate.
#[derive(Debug, Clone, Args)]
pub struct Remote {
    /// The broker's root URL: scheme, host and port, no path (http://host:8080, or https://
    /// for a broker that serves TLS).
    #[arg(long, env = "PROTEUS_URL", default_value = "http://127.0.0.1:8080", value_parser = broker_url)]
    pub url: String,
    /// The user API token (printed by `proteus serve` on first start).
    #[arg(long, env = "PROTEUS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM CA certificate(s) to verify an https:// broker against, instead of the system roots.
    #[arg(long, env = "PROTEUS_CA_FILE")]
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Every field of a job spec: docs/job-spec.md (or `proteus openapi --job-spec`).\n\n\
Examples:\n  proteus submit examples/jobs/mnist.toml\n  proteus submit job.json --output json\n  \
proteus submit examples/jobs/mnist.toml --follow   # its events, status and output until it ends\n  \
proteus submit examples/jobs/mnist.toml --dry-run  # what it would buy now, without launching"
)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// A job spec, TOML or JSON (see examples/jobs/mnist.toml and docs/job-spec.md).
    pub file: PathBuf,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
    /// Then follow the job until it ends: its events, status changes and (command jobs) its
    /// programs' output. Exit 0 if it succeeded, 1 if not; Ctrl-C stops following and leaves
    /// the job running.
    #[arg(long)]
    pub follow: bool,
    /// Check the spec and show what the job would buy if submitted now — its policy's first
    /// decision (markets, tiers, counts, bids, prices) and the expected cost per unit of work
    /// and finish at today's prices — without submitting or launching anything.
    #[arg(long, conflicts_with = "follow")]
    pub dry_run: bool,
    #[command(flatten)]
    pub every: Every,
}

/// How often a followed job is polled.
#[derive(Debug, Clone, Args)]
pub struct Every {
    /// Milliseconds between two polls of a followed job.
    #[arg(long = "interval-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub interval_ms: u64,
}

impl Every {
    fn duration(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.interval_ms)
    }
}

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  proteus status\n  proteus status 3 --output json\n  proteus status 3 --watch"
)]
pub struct StatusArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// A job id; without it, every job.
    pub id: Option<i64>,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
    /// Watch the job until it ends: a line per change of state, progress, spend, instances or
    /// evictions, and its events. Exit 0 if it succeeded, 1 if not; Ctrl-C stops watching.
    #[arg(long, short = 'w', requires = "id")]
    pub watch: bool,
    #[command(flatten)]
    pub every: Every,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  proteus report 3\n  proteus report 3 --output csv > ledger.csv\n  proteus report --all"
)]
pub struct ReportArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// A job id.
    #[arg(required_unless_present = "all")]
    pub id: Option<i64>,
    /// Every job, one line each.
    #[arg(long, conflicts_with = "id")]
    pub all: bool,
    /// `table` (summary), `csv` (ledger lines), `json` (everything).
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// The job's id (as `proteus status` lists it).
    pub id: i64,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
#[command(
    after_help = "The instance then gets the two-minute warning through its metadata, hands over and is \
reclaimed; `proteus status JOB` lists instance ids.\n\nExamples:\n  proteus interrupt pi-3-0f1e2d3c\n  proteus interrupt pi-3-0f1e2d3c --output json"
)]
pub struct InterruptArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// The broker's instance id (as `proteus status JOB` shows it).
    pub instance: String,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  proteus logs 4\n  proteus logs 4 -f                  # until the job ends\n  \
proteus logs 4 -f --output json    # a JSON object per new chunk of output"
)]
pub struct LogsArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// The command job's id.
    pub id: i64,
    /// Follow the output as the programs print it, until the job ends (exit 0 if it
    /// succeeded, 1 if not); Ctrl-C stops following and leaves the job running.
    #[arg(long, short = 'f')]
    pub follow: bool,
    #[command(flatten)]
    pub every: Every,
    /// Only this instance's output.
    #[arg(long)]
    pub instance: Option<String>,
    /// `table` prints each instance's tail under a header; `json` the API's answer.
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// Why a request got no answer, for the person at the terminal. A certificate this client
/// refuses is a TLS set-up problem (the broker is up and answered the handshake), not a broker
/// that is down, so it is not reported as "is `proteus serve` running?".
fn no_answer(e: reqwest::Error, what: &str, base: &str) -> anyhow::Error {
    let message = match certificate_problem(&e) {
        Some(problem) if problem.contains("CaUsedAsEndEntity") => format!(
            "{what}: the broker at {base} presents a CA certificate as its own, which TLS clients \
             refuse (a certificate problem, not a connection one): start `proteus serve` with a \
             leaf certificate signed by that CA as --tls-cert, and keep the CA for --ca-file \
             (docs/aws.md, section 6 \"HTTPS for the API\")"
        ),
        Some(problem) => format!(
            "{what}: the broker at {base} answered, but its TLS certificate was refused ({problem}): \
             a certificate problem, not a connection one; check that --ca-file / PROTEUS_CA_FILE \
             holds the CA that signed the broker's certificate and that the certificate names \
             this host (docs/aws.md, section 6 \"HTTPS for the API\")"
        ),
        None => format!("{what}: cannot reach the broker at {base} (is `proteus serve` running?)"),
    };
    anyhow::Error::new(e).context(message)
}

/// The reason a TLS handshake refused the server's certificate, found in `e`'s chain of causes
/// (rustls' error sits inside an `io::Error`, whose `source` skips it).
fn certificate_problem(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(e);
    while let Some(err) = next {
        let inner = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|i| i as &(dyn std::error::Error + 'static));
        for candidate in std::iter::once(err).chain(inner) {
            if let Some(rustls::Error::InvalidCertificate(c)) =
                candidate.downcast_ref::<rustls::Error>()
            {
                return Some(format!("{c:?}"));
            }
            // Another rustls build than the broker's own would not downcast; its text does.
            let text = candidate.to_string();
            if let Some(at) = text.find("invalid peer certificate: ") {
                return Some(text[at + "invalid peer certificate: ".len()..].to_string());
            }
        }
        next = err.source();
    }
    None
}

/// Checks `--url`: an http(s) URL of the broker's root, and says what to write instead.
fn broker_url(text: &str) -> Result<String, String> {
    let text = text.trim();
    let Some((scheme, rest)) = text.split_once("://") else {
        return Err(format!(
            "`{text}` has no scheme: write http://{text} (or https://{text} for a broker that \
             serves TLS)"
        ));
    };
    if scheme != "http" && scheme != "https" {
        return Err(format!(
            "`{text}`: the broker speaks http:// or https://, not {scheme}://"
        ));
    }
    let url = reqwest::Url::parse(text).map_err(|e| format!("`{text}` is not a URL: {e}"))?;
    let root = format!(
        "{scheme}://{}",
        rest.split(['/', '?', '#']).next().unwrap_or_default()
    );
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!(
            "`{text}` names no host: write e.g. {scheme}://127.0.0.1:8080"
        ));
    }
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "`{text}`: give the broker's root URL, without a path (the API's /v1/... is added): \
             write {root}"
        ));
    }
    Ok(text.trim_end_matches('/').to_string())
}

/// A thin JSON client of the broker's API.
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    pub fn new(remote: &Remote) -> Result<Client> {
        Ok(Client {
            base: remote.url.trim_end_matches('/').to_string(),
            token: remote.token.clone(),
            http: proteus_agent::control::trust(
                reqwest::Client::builder().timeout(std::time::Duration::from_secs(60)),
                remote.ca_file.as_deref(),
            )
            .map_err(anyhow::Error::msg)?
            .build()
            .context("building the HTTP client")?,
        })
    }

    async fn send<T: DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
        what: &str,
    ) -> Result<T> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let resp = req
            .send()
            .await
            .map_err(|e| no_answer(e, what, &self.base))?;
        let status = resp.status();
        let body = resp
            .text()
            .await
            .with_context(|| format!("{what}: reading the answer"))?;
        if !status.is_success() {
            let detail = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .map(|v| match (v["field"].as_str(), v["message"].as_str()) {
                    (Some(f), Some(m)) => format!("{f}: {m}"),
                    (None, Some(m)) => m.to_string(),
                    _ => body.clone(),
                })
                .unwrap_or(body);
            if status.as_u16() == 401 && self.token.is_none() {
                bail!(
                    "{what}: HTTP 401: {detail} (set PROTEUS_TOKEN to the token `proteus serve` printed)"
                );
            }
            bail!("{what}: HTTP {}: {detail}", status.as_u16());
        }
        serde_json::from_str(&body).with_context(|| format!("{what}: unexpected answer: {body}"))
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.send(
            self.http.get(format!("{}{path}", self.base)),
            &format!("GET {path}"),
        )
        .await
    }

    pub async fn post<T: DeserializeOwned, B: Serialize>(&self, path: &str, body: &B) -> Result<T> {
        self.send(
            self.http.post(format!("{}{path}", self.base)).json(body),
            &format!("POST {path}"),
        )
        .await
    }

    /// A `POST` of an action that takes no body (`/v1/jobs/{id}/cancel`).
    pub async fn post_action<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.send(
            self.http.post(format!("{}{path}", self.base)),
            &format!("POST {path}"),
        )
        .await
    }
}

pub async fn submit(args: SubmitArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("{}: cannot read", args.file.display()))?;
    let spec =
        JobSpec::parse_file(&args.file.display().to_string(), &text).map_err(anyhow::Error::msg)?;
    let lines = match args.follow {
        true => Some(super::follow::lines_for(args.output)?),
        false => None,
    };
    let client = Client::new(&args.remote)?;
    if args.dry_run {
        let plan: DryRun = client.post("/v1/jobs/dry-run", &spec).await?;
        if args.output == OutputFormat::Table {
            print!("{}", dry_run_text(&plan));
        } else {
            emit(args.output, &plan, || dry_run_table(&plan))?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let job: JobView = client.post("/v1/jobs", &spec).await?;
    if let Some(lines) = lines {
        if lines == super::follow::Lines::Text {
            println!(
                "submitted job {} ({}) with policy {}; following it (Ctrl-C leaves it running)",
                job.id, job.name, job.policy
            );
        }
        let show = super::follow::Show {
            status: true,
            events: true,
            output: true,
            instance: None,
        };
        return super::follow::follow(&client, job.id, show, lines, args.every.duration()).await;
    }
    if args.output == OutputFormat::Table {
        println!(
            "submitted job {} ({}) with policy {}",
            job.id, job.name, job.policy
        );
        if !job.instance_types.is_empty() {
            println!("on {}", job.instance_types.join(", "));
        }
        println!(
            "follow it with `proteus status {}`; its cost with `proteus report {}`",
            job.id, job.id
        );
        return Ok(ExitCode::SUCCESS);
    }
    emit(args.output, &job, || jobs_table(std::slice::from_ref(&job)))?;
    Ok(ExitCode::SUCCESS)
}

/// One row per purchase.
fn dry_run_table(plan: &DryRun) -> Table {
    let mut t = Table::new(&[
        "market",
        "tier",
        "purchase",
        "bid $/h",
        "count",
        "price $/h",
        "units/h each",
    ])
    .fields(&[
        "market",
        "tier",
        "purchase",
        "bid_usd_per_hour",
        "count",
        "usd_per_hour",
        "units_per_hour",
    ]);
    for p in &plan.purchases {
        t.push([
            Cell::from(p.market.clone()),
            Cell::from(p.tier.clone()),
            Cell::from(p.purchase.clone()),
            Cell::or_unknown(p.bid_usd_per_hour, |b| Cell {
                shown: format!("{b:.4}"),
                plain: b.to_string(),
            }),
            Cell::from(p.count.to_string()),
            Cell {
                shown: format!("{:.4}", p.usd_per_hour),
                plain: p.usd_per_hour.to_string(),
            },
            Cell {
                shown: format!("{:.2}", p.units_per_hour),
                plain: p.units_per_hour.to_string(),
            },
        ]);
    }
    t
}

fn dry_run_text(plan: &DryRun) -> String {
    let mut out = format!(
        "dry run of {} with policy {} at {} (nothing submitted, nothing launched)\n\
         instance types: {}\n\n",
        plan.name,
        plan.policy,
        plan.market_time,
        plan.instance_types.join(", ")
    );
    if plan.purchases.is_empty() {
        out.push_str("the policy would buy nothing now\n");
    } else {
        out.push_str(&dry_run_table(plan).render());
    }
    if let Some(held) = &plan.held {
        out.push_str(&format!("held back: {held}\n"));
    }
    out.push_str(&format!(
        "\n${:.4}/h for {:.2} units/h",
        plan.usd_per_hour, plan.units_per_hour
    ));
    if let Some(u) = plan.usd_per_unit {
        out.push_str(&format!(" = ${u:.4} per unit of work"));
    }
    out.push('\n');
    if let (Some(h), Some(finish), Some(cost)) = (
        plan.expected_hours,
        &plan.expected_finish,
        plan.expected_cost_usd,
    ) {
        out.push_str(&format!(
            "{:.2} units of work: about {h:.2} h, done by {finish}, ${cost:.4}\n",
            plan.total_work
        ));
    }
    out.push_str(&format!("({})\n", plan.assumptions));
    out
}

pub async fn status(args: StatusArgs) -> Result<ExitCode> {
    let client = Client::new(&args.remote)?;
    if let (true, Some(id)) = (args.watch, args.id) {
        let lines = super::follow::lines_for(args.output)?;
        let show = super::follow::Show {
            status: true,
            events: true,
            output: false,
            instance: None,
        };
        return super::follow::follow(&client, id, show, lines, args.every.duration()).await;
    }
    match args.id {
        Some(id) => {
            let job: JobView = client.get(&format!("/v1/jobs/{id}")).await?;
            if args.output == OutputFormat::Table {
                print!("{}", job_detail(&job));
            } else {
                emit(args.output, &job, || jobs_table(std::slice::from_ref(&job)))?;
            }
        }
        None => {
            let jobs: Vec<JobView> = client.get("/v1/jobs").await?;
            emit(args.output, &jobs, || jobs_table(&jobs))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn cancel(args: CancelArgs) -> Result<ExitCode> {
    let job: JobView = Client::new(&args.remote)?
        .post_action(&format!("/v1/jobs/{}/cancel", args.id))
        .await?;
    if args.output == OutputFormat::Table {
        println!(
            "job {} {}: {}",
            job.id,
            job.state,
            job.state_reason.as_deref().unwrap_or("")
        );
    } else {
        emit(args.output, &job, || jobs_table(std::slice::from_ref(&job)))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn interrupt(args: InterruptArgs) -> Result<ExitCode> {
    let sent: crate::service::jobs::InterruptionSent = Client::new(&args.remote)?
        .post(
            &format!("/v1/instances/{}/interruption", args.instance),
            &serde_json::json!({}),
        )
        .await?;
    if args.output == OutputFormat::Table {
        println!(
            "interruption sent to {} ({}) of job {} at {}",
            sent.instance_id, sent.cloud_id, sent.job_id, sent.sent
        );
    } else {
        emit(args.output, &sent, || {
            let mut t = Table::new(&["instance", "cloud id", "job", "sent"]);
            t.push(vec![
                sent.instance_id.clone(),
                sent.cloud_id.clone(),
                sent.job_id.to_string(),
                sent.sent.clone(),
            ]);
            t
        })?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `proteus logs JOB`: the newest output of a command job's program on each instance.
pub async fn logs(args: LogsArgs) -> Result<ExitCode> {
    if args.follow {
        let lines = super::follow::lines_for(args.output)?;
        let show = super::follow::Show {
            status: false,
            events: false,
            output: true,
            instance: args.instance.clone(),
        };
        let client = Client::new(&args.remote)?;
        return super::follow::follow(&client, args.id, show, lines, args.every.duration()).await;
    }
    let tails: Vec<serde_json::Value> = Client::new(&args.remote)?
        .get(&format!("/v1/jobs/{}/logs", args.id))
        .await?;
    let tails: Vec<serde_json::Value> = tails
        .into_iter()
        .filter(|t| {
            args.instance
                .as_deref()
                .is_none_or(|i| t["instance_id"].as_str() == Some(i))
        })
        .collect();
    if args.output != OutputFormat::Table {
        return emit(args.output, &tails, || {
            let mut t = Table::new(&["instance_id", "output"]);
            for tail in &tails {
                t.push(vec![
                    tail["instance_id"].as_str().unwrap_or("").to_string(),
                    tail["output"].as_str().unwrap_or("").to_string(),
                ]);
            }
            t
        })
        .map(|()| ExitCode::SUCCESS);
    }
    if tails.is_empty() {
        eprintln!(
            "no output yet for job {} (only command jobs have one)",
            args.id
        );
    }
    for t in &tails {
        println!("==> {} <==", t["instance_id"].as_str().unwrap_or("?"));
        print!("{}", t["output"].as_str().unwrap_or(""));
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn report(args: ReportArgs) -> Result<ExitCode> {
    let client = Client::new(&args.remote)?;
    if args.all {
        let jobs: Vec<JobView> = client.get("/v1/jobs").await?;
        let mut reports = Vec::new();
        for j in &jobs {
            let r: CostReport = client.get(&format!("/v1/jobs/{}/cost", j.id)).await?;
            reports.push((j.clone(), r));
        }
        let rows: Vec<serde_json::Value> = reports
            .iter()
            .map(|(j, r)| serde_json::json!({"job": j.id, "name": j.name, "state": j.state, "cost": r}))
            .collect();
        emit(args.output, &rows, || all_table(&reports))?;
        return Ok(ExitCode::SUCCESS);
    }
    let id = args.id.context("give a job id or --all")?;
    let r: CostReport = client.get(&format!("/v1/jobs/{id}/cost")).await?;
    match args.output {
        OutputFormat::Table => print!("{}", cost_text(&r)),
        OutputFormat::Json => emit(OutputFormat::Json, &r, Table::default)?,
        OutputFormat::Csv => {
            let mut t = Table::new(&[
                "instance_id",
                "start",
                "end",
                "usd_per_hour",
                "amount_usd",
                "free",
            ]);
            for l in &r.lines {
                t.push(vec![
                    l.instance_id.clone(),
                    l.start.to_string(),
                    l.end.to_string(),
                    format!("{}", l.usd_per_hour.get()),
                    format!("{}", l.amount_usd.get()),
                    l.free.to_string(),
                ]);
            }
            print!("{}", t.to_csv());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn metric_text(m: &Option<serde_json::Value>) -> String {
    match m {
        Some(v) => format!(
            "{} {:.4}",
            v["kind"].as_str().unwrap_or("metric"),
            v["value"].as_f64().unwrap_or(f64::NAN)
        ),
        None => "-".into(),
    }
}

fn jobs_table(jobs: &[JobView]) -> Table {
    let mut t = Table::new(&[
        "id",
        "name",
        "state",
        "policy",
        "progress",
        "metric",
        "reliable",
        "transient",
        "leaving",
        "evictions",
        "spend",
        "submitted",
        "duration",
    ])
    .fields(&[
        "id",
        "name",
        "state",
        "policy",
        "progress",
        "metric.value",
        "instances_by_tier.reliable",
        "instances_by_tier.transient",
        "leaving",
        "evictions",
        "spend_usd",
        "created",
        "duration_s",
    ]);
    for j in jobs {
        let count = |n: u32| Cell::from(n.to_string());
        t.push([
            Cell::from(j.id.to_string()),
            j.name.as_str().into(),
            j.state.as_str().into(),
            j.policy.as_str().into(),
            Cell::pct(j.progress),
            Cell {
                shown: metric_text(&j.metric),
                plain: j
                    .metric
                    .as_ref()
                    .and_then(|m| m["value"].as_f64())
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            },
            count(j.instances_by_tier.get("reliable").copied().unwrap_or(0)),
            count(j.instances_by_tier.get("transient").copied().unwrap_or(0)),
            count(j.leaving_by_tier.values().sum::<u32>()),
            count(j.evictions),
            Cell::usd(j.spend_usd),
            j.created.as_str().into(),
            j.duration_s.map_or_else(|| Cell::from("-"), Cell::duration),
        ]);
    }
    t
}

/// Why the spend shown may differ from the final cost: the part of it a provider interruption
/// would make free; `(final)` once the job is over and nothing runs.
pub(crate) fn spend_note(j: &JobView) -> String {
    let running = j.instances.iter().any(|i| i.ended.is_none());
    if super::follow::is_over(&j.state) && !running {
        " (final)".into()
    } else if j.spend_provisional_usd > Usd::ZERO {
        format!(
            "; {} of it is provisional: free if the provider interrupts the spot instances now \
             running, so the final cost can be lower",
            j.spend_provisional_usd
        )
    } else {
        String::new()
    }
}

/// ` (+3 leaving)` when instances were warned and still run; empty otherwise.
pub(crate) fn leaving_text(leaving_by_tier: &std::collections::BTreeMap<String, u32>) -> String {
    match leaving_by_tier.values().sum::<u32>() {
        0 => String::new(),
        n => format!(" (+{n} leaving)"),
    }
}

fn job_detail(j: &JobView) -> String {
    let mut out = format!(
        "job {} ({}): {}{}\npolicy {}, billing {}, stage {}, sync {}\nprogress {}, {}\n{} {}{}{}\ninstances: {} reliable (on-demand), {} transient (spot){}; {} evictions\n",
        j.id,
        j.name,
        j.state,
        j.state_reason
            .as_deref()
            .map(|r| format!(" — {r}"))
            .unwrap_or_default(),
        j.policy,
        j.billing,
        j.stage.map_or("-".into(), |s| s.to_string()),
        j.sync,
        pct(j.progress),
        metric_text(&j.metric),
        if super::follow::is_over(&j.state) {
            "cost"
        } else {
            "spend"
        },
        j.spend_usd,
        j.budget_usd.map(|b| format!(" of {b}")).unwrap_or_default(),
        spend_note(j),
        j.instances_by_tier.get("reliable").copied().unwrap_or(0),
        j.instances_by_tier.get("transient").copied().unwrap_or(0),
        leaving_text(&j.leaving_by_tier),
        j.evictions,
    );
    out.push_str(&format!(
        "submitted {}{}{}; times in {}\n",
        j.created,
        j.started
            .as_deref()
            .map(|t| format!(", started {t}"))
            .unwrap_or_default(),
        match (&j.finished, j.duration_s) {
            (Some(f), Some(d)) => format!(", finished {f} after {}", duration(d)),
            (None, Some(d)) => format!(", running for {}", duration(d)),
            (Some(f), None) => format!(", ended {f} before starting"),
            (None, None) => String::new(),
        },
        j.clock.describe(),
    ));
    out.push_str(&format!(
        "work: {:.3} units received{}{}\n",
        j.work.done_units,
        j.work
            .expected_units
            .map(|e| format!(", {e:.3} expected in all (re-estimated from the measured rate)"))
            .unwrap_or_default(),
        j.work
            .eta
            .as_deref()
            .map(|e| format!(", ETA {e}"))
            .unwrap_or_default(),
    ));
    if let Some(d) = &j.deadline {
        let slack = j
            .work
            .deadline_slack_hours
            .map(|s| format!(", {s:.1} h of slack at full speed"))
            .unwrap_or_default();
        let risk = match j.work.deadline_at_risk {
            Some(true) => " — at risk: the ETA at the capacity held now is later",
            Some(false) => " — on track",
            None => "",
        };
        out.push_str(&format!("deadline {d}{slack}{risk}\n"));
    }
    if let Some(h) = &j.held {
        out.push_str(&format!("held: {h}\n"));
    }
    for u in &j.unavailable_markets {
        out.push_str(&format!("unavailable: {u}\n"));
    }
    let mut t = Table::new(&[
        "instance", "market", "tier", "bid", "state", "rank", "launched", "ended",
    ]);
    for i in &j.instances {
        t.push(vec![
            i.id.clone(),
            i.market.clone(),
            i.tier.clone(),
            // An hour at the bid, printed like the other money columns.
            i.bid_usd
                .map(|b| b.for_hours(1.0).to_string())
                .unwrap_or_else(|| "-".into()),
            i.state.clone(),
            i.worker_rank.map_or("-".into(), |r| r.to_string()),
            i.launched.clone().unwrap_or_default(),
            match (&i.ended, &i.end_reason) {
                (Some(e), Some(r)) => format!("{e} ({r})"),
                (Some(e), None) => e.clone(),
                _ => String::new(),
            },
        ]);
    }
    out.push_str(&t.render());
    out
}

/// The cost report for people.
pub fn cost_text(r: &CostReport) -> String {
    let mut out = format!(
        "job {} cost {} ({} billing): reliable (on-demand) {}, transient (spot) {}; {} evictions, {:.2} free instance-hours\n",
        r.job_id,
        r.total_usd,
        r.billing,
        r.by_tier.get("reliable").copied().unwrap_or(Usd::ZERO),
        r.by_tier.get("transient").copied().unwrap_or(Usd::ZERO),
        r.evictions,
        r.free_hours
    );
    let mut t = Table::new(&["market", "tier", "instances", "instance-hours", "cost"]);
    for m in &r.by_market {
        t.push(vec![
            m.market.clone(),
            m.tier.clone(),
            m.instances.to_string(),
            format!("{:.2}", m.instance_hours),
            m.usd.to_string(),
        ]);
    }
    out.push_str(&t.render());
    out.push_str(&format!(
        "\nwork: {:.3} units received ({} pacing); the submitted estimate expected {:.3} for this progress\n",
        r.work_units, r.pacing, r.estimated_work_units
    ));
    if let Some(note) = &r.work_note {
        out.push_str(&format!("note: {note}\n"));
    }
    let with_deadline = r.counterfactuals.iter().any(|c| c.deadline_met.is_some());
    out.push_str(&format!(
        "\nthe same work ({:.3} units) on the same prices{}:\n",
        r.work_units,
        if with_deadline {
            " and capacity, by the job's deadline"
        } else {
            ""
        }
    ));
    let mut head = vec!["baseline", "cost", "runtime h", "evictions", "savings"];
    if with_deadline {
        head.push("deadline");
    }
    let mut t = Table::new(&head);
    for c in &r.counterfactuals {
        let mut row = vec![
            c.policy.clone(),
            c.cost_usd
                .map(|c| c.to_string())
                .unwrap_or_else(|| "n/a".into()),
            c.runtime_hours
                .map(|h| format!("{h:.2}"))
                .unwrap_or_else(|| "-".into()),
            c.evictions
                .map(|e| e.to_string())
                .unwrap_or_else(|| "-".into()),
            r.savings
                .get(&c.policy)
                .map(|s| pct(*s))
                .unwrap_or_else(|| c.note.clone().unwrap_or_else(|| "-".into())),
        ];
        if with_deadline {
            row.push(match c.deadline_met {
                Some(true) => "met".into(),
                Some(false) => "missed".into(),
                None => "-".into(),
            });
        }
        t.push(row);
    }
    out.push_str(&t.render());
    out
}

fn all_table(reports: &[(JobView, CostReport)]) -> Table {
    let mut t = Table::new(&[
        "id",
        "name",
        "state",
        "cost",
        "reliable",
        "transient",
        "evictions",
        "vs on-demand",
        "vs standard",
    ])
    .fields(&[
        "job",
        "name",
        "state",
        "cost.total_usd",
        "cost.by_tier.reliable",
        "cost.by_tier.transient",
        "cost.evictions",
        "cost.savings.on-demand",
        "cost.savings.standard-bidding",
    ]);
    for (j, r) in reports {
        let saving = |k: &str| Cell::or_unknown(r.savings.get(k).copied(), Cell::pct);
        let tier = |k: &str| Cell::usd(r.by_tier.get(k).copied().unwrap_or(Usd::ZERO));
        t.push([
            Cell::from(j.id.to_string()),
            j.name.as_str().into(),
            j.state.as_str().into(),
            Cell::usd(r.total_usd),
            tier("reliable"),
            tier("transient"),
            Cell::from(r.evictions.to_string()),
            saving("on-demand"),
            saving("standard-bidding"),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_broker_url_is_a_root_url_and_a_wrong_one_says_what_to_write() {
        for ok in [
            "http://127.0.0.1:8080",
            "http://127.0.0.1:8080/",
            "https://broker.example.com",
            "http://[::1]:8080",
        ] {
            assert_eq!(broker_url(ok).unwrap(), ok.trim_end_matches('/'), "{ok}");
        }
        let err = |u: &str| broker_url(u).unwrap_err();
        assert!(
            err("127.0.0.1:8080").contains("write http://127.0.0.1:8080"),
            "{}",
            err("127.0.0.1:8080")
        );
        assert!(err("localhost").contains("write http://localhost"));
        let e = err("http://host:8080/v1");
        assert!(
            e.contains("without a path") && e.ends_with("write http://host:8080"),
            "{e}"
        );
        let e = err("http://host/?x=1");
        assert!(e.ends_with("write http://host"), "{e}");
        assert!(err("ftp://host").contains("not ftp://"));
        assert!(err("http://").contains("http://"));
    }

    /// A broker-like HTTPS server presenting `cert` (DER) with `key` (PKCS#8 DER); its URL.
    async fn https_server(
        cert: rustls::pki_types::CertificateDer<'static>,
        key: Vec<u8>,
    ) -> String {
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.into()),
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "https://127.0.0.1:{}",
            listener.local_addr().unwrap().port()
        );
        let app = axum::Router::new().route("/healthz", axum::routing::get(|| async { "{}" }));
        tokio::spawn(crate::api::server::serve(
            listener,
            app,
            Some(Arc::new(config)),
            crate::api::server::ConnLimits::default(),
            std::future::pending(),
        ));
        url
    }

    fn client(url: &str, ca_file: Option<PathBuf>) -> Client {
        Client::new(&Remote {
            url: url.to_string(),
            token: None,
            ca_file,
        })
        .unwrap()
    }

    /// Issue 23 item 15: a broker that serves its CA certificate as its own is a certificate
    /// problem, and the CLI says so (and how to fix it), not "is `proteus serve` running?".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ca_served_as_the_leaf_is_reported_as_a_certificate_problem() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress([127, 0, 0, 1].into()));
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca.pem()).unwrap();
        let url = https_server(ca.der().clone(), key.serialize_der()).await;
        let e = client(&url, Some(ca_file.clone()))
            .get::<serde_json::Value>("/healthz")
            .await
            .unwrap_err();
        let text = format!("{e:#}");
        assert!(
            text.contains("presents a CA certificate as its own")
                && text.contains("certificate problem")
                && text.contains("docs/aws.md"),
            "{text}"
        );
        assert!(!text.contains("is `proteus serve` running?"), "{text}");

        // Another certificate problem (a leaf from an issuer this client does not trust) is
        // one too.
        let other = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
        let other_url =
            https_server(other.cert.der().clone(), other.signing_key.serialize_der()).await;
        let e = client(&other_url, Some(ca_file))
            .get::<serde_json::Value>("/healthz")
            .await
            .unwrap_err();
        let text = format!("{e:#}");
        assert!(
            text.contains("TLS certificate was refused") && text.contains("--ca-file"),
            "{text}"
        );
        assert!(!text.contains("is `proteus serve` running?"), "{text}");

        // Nobody listening is still "is `proteus serve` running?".
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let e = client(&format!("http://127.0.0.1:{port}"), None)
            .get::<serde_json::Value>("/healthz")
            .await
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("is `proteus serve` running?"),
            "{e:#}"
        );
    }
}
