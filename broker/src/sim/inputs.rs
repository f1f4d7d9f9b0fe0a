//! Building a simulation's inputs from files, with errors that say which file and key is wrong.

use crate::job::JobModel;
use crate::market::{Market, Region};
use crate::prices::files::{self, FileError, SpotPriceRow};
use crate::prices::{InstanceOffer, OnDemandCatalog, PriceHistory, PriceSeries};
use crate::sim::sweep::PolicyEntry;
use std::collections::BTreeMap;
use std::path::Path;
use thiserror::Error;

/// Groups price rows into series and pairs them with on-demand prices.
pub fn history_from_rows(rows: Vec<SpotPriceRow>, offers: Vec<InstanceOffer>) -> PriceHistory {
    let mut by_market: BTreeMap<Market, Vec<_>> = BTreeMap::new();
    for row in rows {
        by_market
            .entry(row.market)
            .or_default()
            .push((row.time, row.price));
    }
    PriceHistory::new(
        by_market
            .into_iter()
            .map(|(m, points)| PriceSeries::new(m, points)),
        OnDemandCatalog::new(offers),
    )
}

/// Reads a spot trace and an on-demand table.
pub fn load_history(
    trace: &Path,
    on_demand: &Path,
    region: &Region,
) -> Result<PriceHistory, FileError> {
    let offers = files::read_on_demand_file(on_demand, region)?;
    let rows = files::read_spot_file(trace)?;
    Ok(history_from_rows(rows, offers))
}

/// A policy that asks for something the trace or the job does not have.
#[derive(Debug, Error)]
pub enum InputError {
    #[error(
        "{file}: key `{key}`: market {market} has no price rows in {trace} \
         (markets with prices: {available})"
    )]
    MarketWithoutPrices {
        file: String,
        key: &'static str,
        market: String,
        trace: String,
        available: String,
    },
    #[error(
        "{file}: key `{key}`: instance type {instance_type} is not one of the job's ({job_types})"
    )]
    TypeNotInJob {
        file: String,
        key: &'static str,
        instance_type: String,
        job_types: String,
    },
    #[error("{0}")]
    Policy(String),
}

/// Checks that every market and type a policy file names exists in the trace and the job.
pub fn check_policy(
    entry: &PolicyEntry,
    history: &PriceHistory,
    job: &JobModel,
    trace_name: &str,
) -> Result<(), InputError> {
    let policy = entry
        .build()
        .map_err(|e| InputError::Policy(e.to_string()))?;
    for market in policy.named_markets() {
        if history.get(&market).is_none_or(PriceSeries::is_empty) {
            let available: Vec<String> = history.markets().map(Market::to_string).collect();
            return Err(InputError::MarketWithoutPrices {
                file: entry.file.clone(),
                key: "markets",
                market: market.to_string(),
                trace: trace_name.to_string(),
                available: available.join(", "),
            });
        }
        if job.rate(&market.instance_type).is_none() {
            return Err(type_not_in_job(
                entry,
                "markets",
                market.instance_type.to_string(),
                job,
            ));
        }
    }
    for t in policy.named_instance_types() {
        if job.rate(&t).is_none() {
            let key = match entry.kind {
                crate::policy::PolicyKind::BidBrain => "reliable.instance_type",
                crate::policy::PolicyKind::OnDemand => "instance_type",
                crate::policy::PolicyKind::StandardBidding => "instance_types",
                // Neither names a type.
                crate::policy::PolicyKind::SkypilotDefault
                | crate::policy::PolicyKind::UniformProgress => "instance_type",
            };
            return Err(type_not_in_job(entry, key, t.to_string(), job));
        }
    }
    Ok(())
}

fn type_not_in_job(
    entry: &PolicyEntry,
    key: &'static str,
    instance_type: String,
    job: &JobModel,
) -> InputError {
    InputError::TypeNotInJob {
        file: entry.file.clone(),
        key,
        instance_type,
        job_types: job
            .rates()
            .map(|(t, _)| t.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    }
}
