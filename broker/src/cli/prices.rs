//! `proteus prices …`: ingest price history and summarise it.

use super::DatabaseArgs;
use crate::market::{InstanceType, Region, Timestamp, UsdPerHour, Zone};
use crate::output::{Cell, OutputFormat, Table, emit};
use crate::prices::{MarketStats, files, stats};
use crate::store::{IngestCounts, MarketFilter, Store};
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Debug, Subcommand)]
pub enum PricesCommand {
    /// Load spot price history (CSV or DescribeSpotPriceHistory JSON, plain or .gz), on-demand
    /// prices, or live history from EC2. Idempotent; all-or-nothing per file.
    #[command(after_help = "Examples:\n  \
        proteus prices ingest --file data/spot/aws-us-east-1-2015-03-to-06.csv.gz\n  \
        proteus prices ingest --on-demand data/spot/on-demand-us-east-1-2015.csv --region us-east-1\n  \
        aws ec2 describe-spot-price-history > h.json && proteus prices ingest --file h.json\n  \
        proteus prices ingest --from-ec2 --region us-east-1 --instance-types c5.large,m5.large")]
    Ingest(IngestArgs),
    /// Per-market statistics: changes, min/median/max, time-weighted mean, time above on-demand.
    #[command(after_help = "Examples:\n  \
        proteus prices stats\n  \
        proteus prices stats --instance-type c3.xlarge --az us-east-1a --from 2015-04-01 --to 2015-05-01\n  \
        proteus prices stats --output json")]
    Stats(StatsArgs),
    /// List stored markets and how much history each has.
    Markets(MarketsArgs),
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Spot price file(s): CSV with columns timestamp, availability_zone, instance_type,
    /// product_description, spot_price; or the JSON of `aws ec2 describe-spot-price-history`.
    #[arg(long = "file", value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// On-demand price table(s): instance_type, on_demand_usd_per_hour and optionally vcpus,
    /// memory_gib, region.
    #[arg(long = "on-demand", value_name = "FILE")]
    pub on_demand: Vec<PathBuf>,
    /// Fetch history from EC2 (default credential chain; AWS_ENDPOINT_URL for LocalStack),
    /// resuming from the newest stored change of each market.
    #[arg(long)]
    pub from_ec2: bool,
    /// Region for --from-ec2 and for on-demand rows without a region column.
    #[arg(long, env = "PROTEUS_REGION", default_value = "us-east-1")]
    pub region: String,
    /// Instance types to fetch with --from-ec2 (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub instance_types: Vec<String>,
    /// With --from-ec2: fetch from this time (RFC 3339 or YYYY-MM-DD) instead of resuming.
    #[arg(long)]
    pub since: Option<String>,
    /// With --from-ec2: price changes per DescribeSpotPriceHistory page (5–1000).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(5..=1000))]
    pub page_size: u32,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Instance type, e.g. c3.xlarge. Default: every type.
    #[arg(long)]
    pub instance_type: Option<String>,
    /// Availability zone, e.g. us-east-1a.
    #[arg(long)]
    pub az: Option<String>,
    /// Region, e.g. us-east-1. Default: every region.
    #[arg(long)]
    pub region: Option<String>,
    /// Window start (RFC 3339 or YYYY-MM-DD). Default: the first stored change.
    #[arg(long)]
    pub from: Option<String>,
    /// Window end, exclusive. Default: just after the last stored change in any market.
    #[arg(long)]
    pub to: Option<String>,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct MarketsArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Instance type, e.g. c3.xlarge. Default: every type.
    #[arg(long)]
    pub instance_type: Option<String>,
    /// Region, e.g. us-east-1. Default: every region.
    #[arg(long)]
    pub region: Option<String>,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

pub async fn run(cmd: PricesCommand) -> Result<ExitCode> {
    // Ingestion opens the store itself, so that parsing overlaps the connection.
    match cmd {
        PricesCommand::Ingest(args) => ingest(args).await,
        PricesCommand::Stats(args) => stats(&args.database.open_store().await?, args).await,
        PricesCommand::Markets(args) => markets(&args.database.open_store().await?, args).await,
    }
}

async fn stats(store: &Store, args: StatsArgs) -> Result<ExitCode> {
    let filter = filter(
        args.region.as_deref(),
        args.az.as_deref(),
        args.instance_type.as_deref(),
    )?;
    let from = parse_time("--from", args.from.as_deref())?;
    let to = parse_time("--to", args.to.as_deref())?;
    let rows = compute_stats(store, &filter, from, to).await?;
    if rows.is_empty() {
        eprintln!("no price history matches; ingest some with `proteus prices ingest`");
    }
    emit(args.output, &rows, || stats_table(&rows))?;
    Ok(ExitCode::SUCCESS)
}

async fn markets(store: &Store, args: MarketsArgs) -> Result<ExitCode> {
    let filter = filter(args.region.as_deref(), None, args.instance_type.as_deref())?;
    let markets = store.markets(&filter).await?;
    emit(args.output, &markets, || {
        let mut t = Table::new(&["market", "region", "price changes", "first", "last"]);
        for m in &markets {
            t.push(vec![
                m.market.to_string(),
                m.region.to_string(),
                m.price_rows.to_string(),
                m.first.map(|t| t.to_string()).unwrap_or_default(),
                m.last.map(|t| t.to_string()).unwrap_or_default(),
            ]);
        }
        t
    })?;
    Ok(ExitCode::SUCCESS)
}

fn parse_time(flag: &str, value: Option<&str>) -> Result<Option<Timestamp>> {
    value
        .map(|v| Timestamp::parse(v).with_context(|| flag.to_string()))
        .transpose()
}

fn filter(region: Option<&str>, zone: Option<&str>, itype: Option<&str>) -> Result<MarketFilter> {
    Ok(MarketFilter {
        region: region.map(Region::parse).transpose().context("--region")?,
        zone: zone.map(Zone::parse).transpose().context("--az")?,
        instance_type: itype
            .map(InstanceType::parse)
            .transpose()
            .context("--instance-type")?,
    })
}

/// Statistics of every matching market, computed from the stored history.
pub async fn compute_stats(
    store: &Store,
    filter: &MarketFilter,
    from: Option<Timestamp>,
    to: Option<Timestamp>,
) -> Result<Vec<MarketStats>> {
    let history = store.load_history(filter, from, to).await?;
    let end = match to {
        Some(t) => t,
        None => match store.latest_price_time().await? {
            Some(t) => t + std::time::Duration::from_millis(1),
            None => return Ok(Vec::new()),
        },
    };
    let start = from.unwrap_or(Timestamp::MIN);
    Ok(history
        .series()
        .filter_map(|s| {
            let od = history
                .on_demand()
                .for_market(s.market())
                .map(|o| o.on_demand);
            stats::market_stats(s, start, end, od)
        })
        .collect())
}

pub(super) fn stats_table(rows: &[MarketStats]) -> Table {
    let mut t = Table::new(&[
        "market",
        "changes",
        "first",
        "last",
        "min",
        "median",
        "max",
        "tw-mean",
        "on-demand",
        "above od",
        "spells",
    ]);
    for s in rows {
        t.push([
            Cell::from(s.market.clone()),
            Cell::from(s.changes.to_string()),
            Cell::from(s.first.map(|t| t.to_string()).unwrap_or_default()),
            Cell::from(s.last.map(|t| t.to_string()).unwrap_or_default()),
            hour(s.min_usd),
            hour(s.median_usd),
            hour(s.max_usd),
            hour(s.time_weighted_mean_usd),
            Cell::or_unknown(s.on_demand_usd, hour),
            Cell::or_unknown(s.fraction_above_on_demand, Cell::pct),
            Cell::or_unknown(s.spells_above_on_demand, |n| Cell::from(n.to_string())),
        ]);
    }
    t
}

/// One source's outcome, as printed.
#[derive(Debug, Serialize)]
pub struct IngestReport {
    pub source: String,
    #[serde(flatten)]
    pub counts: IngestCounts,
    /// Reading and validating the source.
    pub parse_seconds: f64,
    /// Writing to the database.
    pub store_seconds: f64,
    pub seconds: f64,
}

async fn ingest(args: IngestArgs) -> Result<ExitCode> {
    if args.files.is_empty() && args.on_demand.is_empty() && !args.from_ec2 {
        bail!("nothing to ingest: give --file, --on-demand or --from-ec2 (see --help)");
    }
    let region = Region::parse(&args.region).context("--region")?;
    // Spot files are read and parsed on a thread of their own while the database connects and
    // earlier files are written: parsing and writing overlap. One file ahead at most.
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let paths = args.files.clone();
    let parser = std::thread::spawn(move || {
        for path in paths {
            let started = Instant::now();
            let rows = files::read_spot_file(&path);
            if tx.send((started, Instant::now(), rows)).is_err() {
                return;
            }
        }
    });
    let store = args.database.open_store().await?;
    let store = &store;
    let mut reports = Vec::new();
    for path in &args.on_demand {
        let started = Instant::now();
        let offers = files::read_on_demand_file(path, &region)?;
        let parsed = Instant::now();
        let counts = store
            .ingest_on_demand(&offers)
            .await
            .with_context(|| format!("storing {}", path.display()))?;
        reports.push(report(path.display().to_string(), counts, started, parsed));
    }
    for path in &args.files {
        let (started, parsed, rows) = rx.recv().context("the parsing thread stopped")?;
        let rows = rows?;
        let counts = store
            .ingest_spot_prices(&rows)
            .await
            .with_context(|| format!("storing {}", path.display()))?;
        reports.push(report(path.display().to_string(), counts, started, parsed));
    }
    drop(rx);
    let _ = parser.join();
    if args.from_ec2 {
        reports.push(ingest_from_ec2(store, &region, &args).await?);
    }
    emit(args.output, &reports, || {
        let mut t = Table::new(&[
            "source",
            "read",
            "inserted",
            "updated",
            "already present",
            "seconds",
        ]);
        for r in &reports {
            t.push(vec![
                r.source.clone(),
                r.counts.read.to_string(),
                r.counts.inserted.to_string(),
                r.counts.updated.to_string(),
                r.counts.already_present.to_string(),
                format!("{:.2}", r.seconds),
            ]);
        }
        t
    })?;
    Ok(ExitCode::SUCCESS)
}

fn report(source: String, counts: IngestCounts, started: Instant, parsed: Instant) -> IngestReport {
    let seconds = started.elapsed().as_secs_f64();
    let parse_seconds = parsed.duration_since(started).as_secs_f64();
    tracing::info!(%source, read = counts.read, inserted = counts.inserted, parse_seconds, seconds, "ingested");
    IngestReport {
        source,
        counts,
        parse_seconds,
        store_seconds: seconds - parse_seconds,
        seconds,
    }
}

#[cfg(feature = "ec2")]
async fn ingest_from_ec2(
    store: &Store,
    region: &Region,
    args: &IngestArgs,
) -> Result<IngestReport> {
    use crate::prices::ec2;
    let started = Instant::now();
    let instance_types = args
        .instance_types
        .iter()
        .map(|t| InstanceType::parse(t))
        .collect::<Result<Vec<_>, _>>()
        .context("--instance-types")?;
    let since = match parse_time("--since", args.since.as_deref())? {
        Some(t) => t,
        None => {
            // Resume from the oldest of the newest stored changes of the requested markets, so
            // that no market misses anything; rows already stored are skipped on insert.
            let newest = store.newest_price_times(region).await?;
            newest
                .iter()
                .filter(|(m, _)| {
                    instance_types.is_empty() || instance_types.contains(&m.instance_type)
                })
                .map(|(_, t)| *t)
                .min()
                .unwrap_or_else(|| Timestamp::now() - std::time::Duration::from_secs(90 * 86_400))
        }
    };
    let client = ec2::client(region).await;
    let request = ec2::FetchRequest {
        region: region.clone(),
        instance_types,
        product: crate::market::Product::linux(),
        since,
        page_size: ec2::PageSize::new(args.page_size).map_err(anyhow::Error::msg)?,
    };
    let fetched = ec2::fetch(&client, &request).await?;
    let parsed = Instant::now();
    let counts = store
        .ingest_spot_prices(&fetched.rows)
        .await
        .context("storing EC2 price history")?;
    Ok(report(
        format!("ec2:{region} since {since} ({} pages)", fetched.pages),
        counts,
        started,
        parsed,
    ))
}

#[cfg(not(feature = "ec2"))]
async fn ingest_from_ec2(_: &Store, _: &Region, _: &IngestArgs) -> Result<IngestReport> {
    bail!("this build of proteus has no EC2 support (built without the `ec2` feature)")
}

/// A price as what an hour of it costs, printed like every amount (the columns are per hour).
/// An hour at price `p`, as dollars (USD per hour).
fn hour(p: UsdPerHour) -> Cell {
    Cell::usd(p.for_hours(1.0))
}
