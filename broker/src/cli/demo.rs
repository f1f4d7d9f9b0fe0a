//! `proteus demo`: the system working end to end with nothing but this binary.

use super::GlobalArgs;
use crate::data;
use crate::market::Region;
use crate::output::OutputFormat;
use crate::prices::files;
use crate::store::MarketFilter;
use anyhow::{Context, Result};
use clap::Args;
use std::path::Path;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

pub async fn run(global: &GlobalArgs, args: DemoArgs) -> Result<ExitCode> {
    let store = global.open_store().await?;
    eprintln!("database: {}", store.url());
    let region = Region::parse("us-east-1").context("region")?;
    let raw = files::decompress_if_gzipped(data::TRACE_2015.to_vec()).context("embedded trace")?;
    let rows = files::parse_spot_bytes(Path::new(data::TRACE_2015_NAME), &raw)?;
    let offers = files::parse_on_demand_bytes(
        Path::new(data::ON_DEMAND_2015_NAME),
        data::ON_DEMAND_2015,
        &region,
    )?;
    let od = store.ingest_on_demand(&offers).await?;
    let counts = store.ingest_spot_prices(&rows).await?;
    eprintln!(
        "ingested {}: {} rows read, {} inserted, {} already present; on-demand: {} types",
        data::TRACE_2015_NAME,
        counts.read,
        counts.inserted,
        counts.already_present,
        od.read
    );
    let stats = super::prices::compute_stats(&store, &MarketFilter::default(), None, None).await?;
    crate::output::emit(args.output, &stats, || super::prices::stats_table(&stats))?;
    Ok(ExitCode::SUCCESS)
}
