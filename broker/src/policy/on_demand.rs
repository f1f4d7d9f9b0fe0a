//! On-demand only: the whole job on reliable instances of the cheapest type per unit of work.
//! The baseline every saving is measured against. It ignores `max_reliable_instances` (which
//! bounds the reliable tier of mixed policies): everything here is reliable.

use super::{
    Acquisition, Decision, DecisionContext, Policy, PolicyError, PolicyKind, Purchase,
    cheapest_on_demand,
};
use crate::job::{EvictionCost, JobModel};
use crate::market::InstanceType;
use serde::{Deserialize, Serialize};

/// The keys of a `kind = "on-demand"` policy file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnDemandConfig {
    #[serde(default)]
    pub name: Option<String>,
    /// Use this type instead of the cheapest per unit of work (must be one of the job's).
    #[serde(default)]
    pub instance_type: Option<String>,
}

/// The on-demand policy.
pub struct OnDemandPolicy {
    name: String,
    instance_type: Option<InstanceType>,
}

impl OnDemandPolicy {
    pub fn new(name: String, config: OnDemandConfig) -> Result<Self, (String, String, String)> {
        let instance_type = config
            .instance_type
            .as_deref()
            .map(|t| {
                InstanceType::parse(t).map_err(|e| {
                    (
                        "instance_type".to_string(),
                        e.to_string(),
                        "an instance type of the job".into(),
                    )
                })
            })
            .transpose()?;
        Ok(OnDemandPolicy {
            name,
            instance_type,
        })
    }
}

impl Policy for OnDemandPolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::OnDemand
    }

    fn eviction_cost(&self, job: &JobModel) -> EvictionCost {
        job.eviction_cost
    }

    fn named_instance_types(&self) -> Vec<InstanceType> {
        self.instance_type.iter().cloned().collect()
    }

    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        let now = ctx.now();
        let mut decision = Decision {
            wake_at: Some(now + std::time::Duration::from_secs(3600)),
            ..Decision::default()
        };
        if ctx.progress.remaining() <= 0.0 {
            return Ok(decision);
        }
        let active = ctx.footprint.iter().filter(|i| i.is_active()).count();
        let want = (ctx.job.max_instances as usize).saturating_sub(active);
        if want == 0 {
            return Ok(decision);
        }
        let (market, _, _) = cheapest_on_demand(ctx.market, ctx.job, self.instance_type.as_ref())
            .ok_or_else(|| PolicyError::NoMarket {
            types: ctx
                .job
                .rates()
                .map(|(t, _)| t.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            now,
        })?;
        decision.acquire.push(Acquisition {
            market: market.clone(),
            purchase: Purchase::OnDemand,
            count: want as u32,
        });
        Ok(decision)
    }
}
