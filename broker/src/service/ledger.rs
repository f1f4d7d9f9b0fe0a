//! The cost ledger: every instance billed under the job's billing model from the stored prices,
//! and what the same work would have cost under the baselines on the same prices.
//!
//! An instance's lines are recomputed from its whole life each time (launch, end, who ended
//! it), so the ledger cannot drift from the instance records; a live instance is billed as if
//! the user ended it now, which under `hourly-2015` charges the hour it is in — what the user
//! has committed to.

use super::MarketData;
use crate::billing::{BillingModel, EndedBy, LineItem, PriceSource};
use crate::job::JobModel;
use crate::market::{Timestamp, Usd};
use crate::sim::{RunOptions, Scenario, World};
use crate::store::{InstanceRow, LedgerLine};
use proteus_wire::Tier;
use serde::{Deserialize, Serialize};

/// Bills one instance up to `now` (or its end).
pub fn bill_instance(
    row: &InstanceRow,
    now: Timestamp,
    billing: BillingModel,
    data: &MarketData,
) -> Result<Vec<LedgerLine>, String> {
    let Some(launch) = row.launched else {
        return Ok(Vec::new());
    };
    let (end, ended_by) = match row.ended {
        Some(t) => (
            t.max(launch),
            if row.ended_by_provider {
                EndedBy::Provider
            } else {
                EndedBy::User
            },
        ),
        None => (now.max(launch), EndedBy::User),
    };
    let items: Vec<LineItem> = match row.tier {
        Tier::Reliable => {
            let offer = data
                .history
                .on_demand()
                .for_market(&row.market)
                .ok_or_else(|| format!("no on-demand price for {}", row.market.instance_type))?;
            billing.bill(launch, end, ended_by, PriceSource::Fixed(offer.on_demand))
        }
        Tier::Transient => {
            let series = data
                .history
                .get(&row.market)
                .ok_or_else(|| format!("no spot prices for {}", row.market))?;
            billing.bill(launch, end, ended_by, PriceSource::Spot(series))
        }
    }
    .map_err(|e| e.to_string())?;
    Ok(items
        .into_iter()
        .map(|i| LedgerLine {
            instance_id: row.id.clone(),
            start: i.start,
            end: i.end,
            usd_per_hour: i.price_usd_per_hour,
            amount_usd: i.amount_usd,
            free: i.free,
        })
        .collect())
}

/// What the job's work would have cost under a baseline policy, on the same prices.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Counterfactual {
    pub policy: String,
    /// `None` when the simulation could not run (e.g. it would outlast the known prices).
    #[schema(value_type = Option<f64>)]
    pub cost_usd: Option<Usd>,
    pub runtime_hours: Option<f64>,
    pub evictions: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Simulates the baselines doing `work_units` of the job's work from `start`, with the same
/// price history the job ran on.
pub fn counterfactuals(
    data: &MarketData,
    job: &JobModel,
    work_units: f64,
    billing: BillingModel,
    start: Timestamp,
) -> Vec<Counterfactual> {
    ["on-demand", "standard-bidding"]
        .into_iter()
        .map(|name| simulate_baseline(data, job, work_units, billing, start, name))
        .collect()
}

fn simulate_baseline(
    data: &MarketData,
    job: &JobModel,
    work_units: f64,
    billing: BillingModel,
    start: Timestamp,
    name: &str,
) -> Counterfactual {
    let failed = |note: String| Counterfactual {
        policy: name.to_string(),
        cost_usd: None,
        runtime_hours: None,
        evictions: None,
        note: Some(note),
    };
    if work_units <= 0.0 {
        return Counterfactual {
            policy: name.to_string(),
            cost_usd: Some(Usd::ZERO),
            runtime_hours: Some(0.0),
            evictions: Some(0),
            note: Some("no work done yet".into()),
        };
    }
    let path = crate::policy::policies_dir().join(format!("{name}.toml"));
    let mut policy = match crate::policy::load_policy_file(&path) {
        Ok(p) => p,
        Err(e) => return failed(e.to_string()),
    };
    let mut model = job.clone();
    model.total_work = work_units;
    let market_model = data
        .model
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .boxed_clone();
    let scenario = match Scenario::new(
        data.history.clone(),
        model,
        billing,
        World::Price,
        market_model,
    ) {
        Ok(s) => s,
        Err(e) => return failed(e.to_string()),
    };
    match crate::sim::run(&scenario, policy.as_mut(), start, &RunOptions::default()) {
        Ok(r) => Counterfactual {
            policy: name.to_string(),
            cost_usd: Some(r.cost_usd),
            runtime_hours: Some(r.runtime_hours),
            evictions: Some(r.evictions),
            note: None,
        },
        Err(e) => failed(e.to_string()),
    }
}
