//! A dry run of a submission (`POST /v1/jobs/dry-run`, `proteus submit --dry-run`): the first
//! decision the job's engine would take now — the same engine, policy, limits, budget and
//! market view the scheduler would use — with every launch answered as if the cloud accepted
//! it, and nothing stored or launched.

use super::spec::JobSpec;
use super::{Broker, ServiceError};
use crate::engine::job_engine::{Command, Input, price_now};
use crate::market::Market;
use crate::policy::Purchase;
use proteus_wire::{InstanceId, Tier};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What a job would buy if it were submitted now.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DryRun {
    pub name: String,
    pub policy: String,
    /// The instance types the job may run on (its `resources` or `work.instance_types`, else
    /// every type the broker has prices for).
    pub instance_types: Vec<String>,
    /// The market time of the decision (RFC 3339): on the simulated cloud, the trace's clock.
    pub market_time: String,
    /// One line per market and purchase option, in the order the policy asked.
    pub purchases: Vec<DryRunPurchase>,
    /// Why the policy's asks were cut short, if they were (budget, the broker's instance cap).
    pub held: Option<String>,
    /// What the purchases cost per hour at today's prices, USD.
    pub usd_per_hour: f64,
    /// The job's units of work per hour on them.
    pub units_per_hour: f64,
    /// `usd_per_hour / units_per_hour`: the price of a unit of work at this footprint.
    pub usd_per_unit: Option<f64>,
    /// The job's units of work (its spec's estimate).
    pub total_work: f64,
    /// Start-up plus `total_work / units_per_hour`, hours.
    pub expected_hours: Option<f64>,
    /// `market_time` plus `expected_hours` (RFC 3339).
    pub expected_finish: Option<String>,
    /// Every purchase billed for `expected_hours` under the job's billing model, USD.
    pub expected_cost_usd: Option<f64>,
    /// What the expectations assume.
    pub assumptions: String,
}

/// Instances of one market bought one way.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DryRunPurchase {
    pub market: String,
    pub zone: String,
    pub instance_type: String,
    /// `reliable` (on-demand) or `transient` (spot).
    pub tier: String,
    /// `on-demand` or `spot`.
    pub purchase: String,
    /// The spot bid, USD per hour.
    pub bid_usd_per_hour: Option<f64>,
    pub count: u32,
    /// The price now, USD per hour, each.
    pub usd_per_hour: f64,
    /// The job's units of work per hour on one of them.
    pub units_per_hour: f64,
}

impl Broker {
    /// The first decision `spec`'s engine would take now. Checks the spec as a submission does
    /// (the same errors), and stores and launches nothing.
    pub async fn dry_run(&self, mut spec: JobSpec) -> Result<DryRun, ServiceError> {
        let now = self.clock.now();
        let (valid, _) = self.validate_submission(&mut spec, now)?;
        let (name, policy, billing) = (valid.name.clone(), valid.policy.clone(), valid.billing);
        let checked = valid.clone();
        let mut runtime = self.build_runtime(valid, now, None)?;
        super::jobs::deadline_is_reachable(&spec, &checked, runtime.engine.job(), now)?;
        let cooled = self.cooled(now).await?;
        let cap = u64::from(self.settings.instance_cap);
        let held_by_all = self.store.count_live_instances().await?;
        let data = self.market_data();
        let mut bought: Vec<(Market, Purchase, u32)> = Vec::new();
        let mut launched = 0u64;
        let mut input = Input::Tick;
        loop {
            let commands = self.step_engine(&mut runtime.engine, now, input, &cooled)?;
            let Some((market, purchase)) = commands.into_iter().find_map(|c| match c {
                Command::Launch { market, purchase } => Some((market, purchase)),
                _ => None,
            }) else {
                break;
            };
            input = if held_by_all + launched >= cap {
                Input::LaunchHeld {
                    reason: format!(
                        "the broker holds {} instances across all jobs, its cap \
                         (`proteus serve --instance-cap {cap}`)",
                        held_by_all + launched
                    ),
                }
            } else {
                launched += 1;
                match bought
                    .iter_mut()
                    .find(|(m, p, _)| *m == market && *p == purchase)
                {
                    Some((_, _, n)) => *n += 1,
                    None => bought.push((market, purchase, 1)),
                }
                Input::Launched {
                    id: InstanceId(format!("dry-run-{launched}")),
                    at: now,
                }
            };
        }
        let job = runtime.engine.job();
        let purchases: Vec<DryRunPurchase> = bought
            .iter()
            .map(|(market, purchase, count)| DryRunPurchase {
                market: market.to_string(),
                zone: market.zone.to_string(),
                instance_type: market.instance_type.to_string(),
                tier: match purchase.tier() {
                    Tier::Reliable => "reliable",
                    Tier::Transient => "transient",
                }
                .to_string(),
                purchase: match purchase {
                    Purchase::OnDemand => "on-demand",
                    Purchase::Spot { .. } => "spot",
                }
                .to_string(),
                bid_usd_per_hour: purchase.bid().map(|b| b.get()),
                count: *count,
                usd_per_hour: price_now(&data.markets, market, purchase.tier(), now).get(),
                units_per_hour: job.rate(&market.instance_type).unwrap_or(0.0),
            })
            .collect();
        let usd_per_hour: f64 = purchases
            .iter()
            .map(|p| p.usd_per_hour * f64::from(p.count))
            .sum();
        let units_per_hour: f64 = purchases
            .iter()
            .map(|p| p.units_per_hour * f64::from(p.count))
            .sum();
        let expected_hours = (units_per_hour > 0.0)
            .then(|| job.startup_secs / 3600.0 + job.total_work / units_per_hour);
        Ok(DryRun {
            name,
            policy,
            instance_types: job.rates().map(|(t, _)| t.to_string()).collect(),
            market_time: now.to_string(),
            held: runtime.engine.held().map(str::to_string),
            usd_per_unit: (units_per_hour > 0.0).then(|| usd_per_hour / units_per_hour),
            expected_finish: expected_hours.map(|h| now.plus_secs(h * 3600.0).to_string()),
            expected_cost_usd: expected_hours
                .map(|h| usd_per_hour * billing.billed_hours(h * 3600.0)),
            expected_hours,
            total_work: job.total_work,
            usd_per_hour,
            units_per_hour,
            purchases,
            assumptions: format!(
                "at the prices in force at {now}, with {billing} billing, if nothing is evicted \
                 and every instance bought works at its type's rate from start-up ({:.0} s) to \
                 the end; the policy's later decisions may differ",
                job.startup_secs
            ),
        })
    }
}
