//! Today's market model: a per-pool interruption hazard learned from what the broker observes.
//!
//! Since late 2017 the spot price no longer decides who is interrupted; capacity does, and it
//! is not published. What the broker can know is its own experience: how many instance-hours
//! it ran in each pool (availability zone × instance type) and how many of those instances the
//! provider interrupted. The model is the conjugate (Gamma–Poisson) estimate of a constant
//! interruption rate per pool: a prior worth `weight_instance_hours` of experience at
//! `interruptions_per_instance_hour`, plus the observations of that pool. With no observations
//! every pool gets the prior; a pool that interrupts more than the prior quickly looks worse.

use super::{EvictionEstimate, MarketModel, ModelError, ModelKind, Observation};
use crate::market::{Market, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The prior belief about every pool, before the broker has seen it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HazardPrior {
    /// Interruptions per instance-hour. The default, 1.3e-4 (about 9% of instances interrupted
    /// over a 730-hour month), is the middle of AWS Spot Advisor's "frequency of interruption"
    /// buckets for general-purpose types; an assumption, not a measurement.
    pub interruptions_per_instance_hour: f64,
    /// How many instance-hours of experience the prior is worth. Default 2,000: two jobs'
    /// worth of observations outweigh it.
    pub weight_instance_hours: f64,
}

impl Default for HazardPrior {
    fn default() -> Self {
        HazardPrior {
            interruptions_per_instance_hour: 1.3e-4,
            weight_instance_hours: 2_000.0,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct PoolStats {
    interruptions: f64,
    hours: f64,
}

/// Per-pool interruption rates; see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct HazardModel {
    prior: HazardPrior,
    pools: HashMap<Market, PoolStats>,
}

impl HazardModel {
    pub fn new(prior: HazardPrior) -> Self {
        HazardModel {
            prior,
            pools: HashMap::new(),
        }
    }

    pub fn prior(&self) -> HazardPrior {
        self.prior
    }

    /// The posterior mean interruption rate of `market`, per instance-hour.
    pub fn rate_per_hour(&self, market: &Market) -> f64 {
        let seen = self.pools.get(market).copied().unwrap_or_default();
        let w = self.prior.weight_instance_hours.max(0.0);
        let prior_events = self.prior.interruptions_per_instance_hour.max(0.0) * w;
        let exposure = w + seen.hours;
        if exposure <= 0.0 {
            return if seen.interruptions > 0.0 {
                f64::INFINITY
            } else {
                0.0
            };
        }
        (prior_events + seen.interruptions) / exposure
    }

    /// What the model has seen of `market`: (interruptions, instance-hours).
    pub fn observed(&self, market: &Market) -> (f64, f64) {
        let s = self.pools.get(market).copied().unwrap_or_default();
        (s.interruptions, s.hours)
    }
}

impl MarketModel for HazardModel {
    fn kind(&self) -> ModelKind {
        ModelKind::Hazard
    }

    fn eviction(
        &self,
        market: &Market,
        _bid_delta_usd: f64,
        horizon_secs: f64,
        _now: Timestamp,
    ) -> Result<EvictionEstimate, ModelError> {
        if !(horizon_secs.is_finite() && horizon_secs > 0.0) {
            return Err(ModelError::BadHorizon(horizon_secs));
        }
        let rate = self.rate_per_hour(market) / 3600.0;
        let (probability, expected_secs) = if rate <= 0.0 {
            (0.0, horizon_secs)
        } else if rate.is_infinite() {
            (1.0, 0.0)
        } else {
            let p = 1.0 - (-rate * horizon_secs).exp();
            (p, p / rate)
        };
        Ok(EvictionEstimate {
            probability,
            expected_secs,
            horizon_secs,
            samples: 0,
        })
    }

    fn observe(&mut self, observation: Observation<'_>) {
        match observation {
            Observation::Ran { market, hours } if hours.is_finite() && hours > 0.0 => {
                self.pools.entry(market.clone()).or_default().hours += hours;
            }
            Observation::Interrupted { market, .. } => {
                self.pools.entry(market.clone()).or_default().interruptions += 1.0;
            }
            Observation::Ran { .. } => {}
        }
    }

    fn boxed_clone(&self) -> Box<dyn MarketModel> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prior_then_learning() {
        let m = Market::parse("us-east-1a/c5.xlarge").unwrap();
        let other = Market::parse("us-east-1b/c5.xlarge").unwrap();
        let mut model = HazardModel::new(HazardPrior {
            interruptions_per_instance_hour: 0.01,
            weight_instance_hours: 100.0,
        });
        assert!((model.rate_per_hour(&m) - 0.01).abs() < 1e-15);
        let e = model
            .eviction(&m, 0.0, 3600.0, Timestamp::from_millis(0))
            .unwrap();
        assert!((e.probability - (1.0 - (-0.01f64).exp())).abs() < 1e-12);
        // 100 more hours with 9 interruptions: (1 + 9) / (100 + 100) = 0.05 per hour.
        model.observe(Observation::Ran {
            market: &m,
            hours: 100.0,
        });
        for _ in 0..9 {
            model.observe(Observation::Interrupted {
                market: &m,
                at: Timestamp::from_millis(0),
            });
        }
        assert!((model.rate_per_hour(&m) - 0.05).abs() < 1e-12);
        assert!(
            (model.rate_per_hour(&other) - 0.01).abs() < 1e-15,
            "pools learn separately"
        );
        let later = model
            .eviction(&m, 0.0, 3600.0, Timestamp::from_millis(0))
            .unwrap();
        assert!(later.probability > e.probability);
        assert!(later.expected_secs < 3600.0 && later.expected_secs > 3000.0);
        // A bid does not change anything in this market.
        assert_eq!(
            later,
            model
                .eviction(&m, 5.0, 3600.0, Timestamp::from_millis(0))
                .unwrap()
        );
    }
}
