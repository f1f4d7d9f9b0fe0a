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
use crate::sim::availability::Availability;
use crate::sim::{Deadline, RunOptions, Scenario, World};
use crate::store::{InstanceRow, LedgerLine};
use proteus_wire::Tier;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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

/// What the job's work would have cost under a baseline policy, on the same prices (and, on an
/// availability market, the same capacity).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Counterfactual {
    pub policy: String,
    /// `None` when the simulation could not run (e.g. it would outlast the known prices).
    #[schema(value_type = Option<f64>)]
    pub cost_usd: Option<Usd>,
    pub runtime_hours: Option<f64>,
    pub evictions: Option<u32>,
    /// With the job's deadline: whether the baseline met it (`None` without a deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_met: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The world a counterfactual replays: the job's deadline, and the capacity the simulated cloud
/// plays on an availability market (`None`: the 2015 price market).
#[derive(Debug, Clone, Default)]
pub struct Replay {
    pub deadline: Option<Timestamp>,
    pub availability: Option<Arc<Availability>>,
}

/// Simulates the baselines doing `work_units` of the job's work from `start`, with the same
/// price history the job ran on. On an availability market every baseline plays the same
/// capacity (refusals and interruptions included), and the baselines are those users run
/// today (on-demand, Uniform Progress, skypilot-default); on the 2015 market, on-demand and
/// standard bidding.
pub fn counterfactuals(
    data: &MarketData,
    job: &JobModel,
    work_units: f64,
    billing: BillingModel,
    start: Timestamp,
    replay: &Replay,
) -> Vec<Counterfactual> {
    let baselines: &[&str] = match replay.availability {
        Some(_) => &["on-demand", "uniform-progress", "skypilot-default"],
        None => &["on-demand", "standard-bidding"],
    };
    baselines
        .iter()
        .map(|name| simulate_baseline(data, job, work_units, billing, start, replay, name))
        .collect()
}

fn simulate_baseline(
    data: &MarketData,
    job: &JobModel,
    work_units: f64,
    billing: BillingModel,
    start: Timestamp,
    replay: &Replay,
    name: &str,
) -> Counterfactual {
    let failed = |note: String| Counterfactual {
        policy: name.to_string(),
        cost_usd: None,
        runtime_hours: None,
        evictions: None,
        deadline_met: None,
        note: Some(note),
    };
    if work_units <= 0.0 {
        return Counterfactual {
            policy: name.to_string(),
            cost_usd: Some(Usd::ZERO),
            runtime_hours: Some(0.0),
            evictions: Some(0),
            deadline_met: None,
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
    let world = match &replay.availability {
        Some(a) => World::Availability(a.clone()),
        None => World::Price,
    };
    let scenario = match Scenario::new(data.history.clone(), model, billing, world, market_model) {
        Ok(s) => s,
        Err(e) => return failed(e.to_string()),
    };
    let options = RunOptions {
        deadline: replay.deadline.map(Deadline::At),
        ..RunOptions::default()
    };
    match crate::sim::run(&scenario, policy.as_mut(), start, &options) {
        Ok(r) => Counterfactual {
            policy: name.to_string(),
            cost_usd: Some(r.cost_usd),
            runtime_hours: Some(r.runtime_hours),
            evictions: Some(r.evictions),
            deadline_met: replay
                .deadline
                .map(|_| r.outcome == crate::engine::job_engine::Outcome::Completed),
            note: None,
        },
        Err(e) => failed(e.to_string()),
    }
}
