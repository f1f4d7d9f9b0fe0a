//! The `proteus` command line: argument parsing and one handler per command.
//!
//! Every flag can also come from a `PROTEUS_*` environment variable, so the same settings work
//! in a shell, a systemd unit and CI.

pub mod client;
mod demo;
mod follow;
mod prices;
pub mod serve;
mod simulate;
mod simulate_today;

use crate::store::{Store, default_database_url};
use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::process::ExitCode;

/// Proteus: ML training on cloud spot capacity at the lowest cost per unit of work.
#[derive(Debug, Parser)]
#[command(
    name = "proteus",
    version,
    about,
    after_help = "Examples:\n  \
      proteus demo                                   # the whole system on an embedded database\n  \
      proteus prices ingest --file data/spot/aws-us-east-1-2015-03-to-06.csv.gz \\\n      \
        --on-demand data/spot/on-demand-us-east-1-2015.csv\n  \
      proteus prices stats --instance-type c3.xlarge --output json\n  \
      proteus simulate --job examples/jobs/reference-2015.toml --compare bidbrain standard-bidding on-demand\n  \
      PROTEUS_DATABASE_URL=postgres://localhost/proteus proteus db migrate"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Log format on stderr.
    #[arg(long, env = "PROTEUS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// Log filter, e.g. `info`, `proteus_broker=debug` (RUST_LOG syntax). Default:
    /// `warn,proteus_broker=info` (`warn` for the demo, whose progress bar says it all).
    #[arg(long, env = "PROTEUS_LOG", global = true)]
    pub log: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the system working end to end on an embedded database.
    Demo(demo::DemoArgs),
    /// Database maintenance.
    #[command(subcommand)]
    Db(DbCommand),
    /// Submit a training job to a running broker.
    Submit(client::SubmitArgs),
    /// Show jobs: state, progress, instances per tier, spend.
    Status(client::StatusArgs),
    /// A job's cost: spend by tier and market, evictions, free hours, savings.
    Report(client::ReportArgs),
    /// Cancel a job: every instance released, ledger closed.
    Cancel(client::CancelArgs),
    /// Interrupt a spot instance now, as a price spike would (simulated cloud), to try a job's
    /// eviction handling.
    Interrupt(client::InterruptArgs),
    /// The newest output of a command job's program, per instance.
    Logs(client::LogsArgs),
    /// Print the REST API's OpenAPI document (or, with --job-spec, the job spec reference).
    Openapi(OpenapiArgs),
    /// Run the broker service (REST API, scheduler, cloud driver).
    Serve(Box<ServeCommand>),
    /// Spot and on-demand price history.
    #[command(subcommand)]
    Prices(prices::PricesCommand),
    /// Replay a spot price trace against a job and policies; compare cost and runtime.
    Simulate(Box<simulate::SimulateArgs>),
}

impl Command {
    /// Whether this command is a client whose output goes to a reader (a terminal, a pipe)
    /// and nothing else: everything but the long-running `serve` and `demo`.
    pub fn prints_for_a_reader(&self) -> bool {
        !matches!(self, Command::Serve(_) | Command::Demo(_))
    }
}

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  proteus openapi > openapi.json\n  proteus openapi --job-spec > docs/job-spec.md"
)]
pub struct OpenapiArgs {
    /// Print the job spec reference (Markdown, as docs/job-spec.md) instead: every field with
    /// its type, bounds, an example and what it means, from the same schema.
    #[arg(long)]
    pub job_spec: bool,
}

#[derive(Debug, Subcommand)]
pub enum DbCommand {
    /// Apply pending schema migrations.
    Migrate(MigrateArgs),
}

/// The database, for the commands that open it (not the clients of a running broker).
#[derive(Debug, Clone, Default, Args)]
pub struct DatabaseArgs {
    /// Database URL (`postgres://…` or `sqlite://…`). Default: a SQLite file under your data
    /// directory (e.g. ~/.local/share/proteus/proteus.db).
    #[arg(long, env = "PROTEUS_DATABASE_URL")]
    pub database_url: Option<String>,
}

/// `proteus serve`'s flags: its database and the broker's own.
#[derive(Debug, Args)]
pub struct ServeCommand {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub serve: serve::ServeArgs,
}

/// `proteus db migrate`'s flags.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
}

impl DatabaseArgs {
    pub fn database_url(&self) -> String {
        self.database_url
            .clone()
            .unwrap_or_else(default_database_url)
    }

    /// Opens the store and applies pending migrations.
    pub async fn open_store(&self) -> Result<Store> {
        let url = self.database_url();
        Store::open(&url)
            .await
            .with_context(|| format!("opening the database {}", crate::store::redact(&url)))
    }
}

/// Logs to stderr with the default filter of an ordinary command.
pub fn init_tracing(global: &GlobalArgs) {
    init_tracing_with_default(global, "warn,proteus_broker=info");
}

/// Logs to stderr with the default filter suited to `command`.
pub fn init_tracing_for(global: &GlobalArgs, command: &Command) {
    let default = match command {
        Command::Demo(_) => "warn",
        _ => "warn,proteus_broker=info",
    };
    init_tracing_with_default(global, default);
}

fn init_tracing_with_default(global: &GlobalArgs, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(global.log.as_deref().unwrap_or(default))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a terminal: logs sent to a file or a collector stay plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = match global.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Runs a parsed command line. Exit codes: 0 success, 1 failure (the message says why),
/// 2 bad usage (printed by clap).
pub async fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Demo(args) => demo::run(args).await,
        Command::Db(DbCommand::Migrate(args)) => {
            let store = args.database.open_store().await?;
            println!("migrations applied to {}", store.url());
            Ok(ExitCode::SUCCESS)
        }
        Command::Prices(cmd) => prices::run(cmd).await,
        Command::Serve(cmd) => serve::run(cmd.database, cmd.serve).await,
        Command::Submit(args) => client::submit(args).await,
        Command::Openapi(args) => {
            match args.job_spec {
                true => print!("{}", crate::api::spec_doc::job_spec_reference()),
                false => println!("{}", crate::api::openapi_json()),
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status(args) => client::status(args).await,
        Command::Report(args) => client::report(args).await,
        Command::Cancel(args) => client::cancel(args).await,
        Command::Interrupt(args) => client::interrupt(args).await,
        Command::Logs(args) => client::logs(args).await,
        Command::Simulate(args) => simulate::run(*args),
    }
}
