//! How likely an instance is to be taken away: the market model the policies consult.
//!
//! Two models sit behind one trait, [`MarketModel`]:
//!
//! - [`PriceDrivenModel`] for the 2015 market, where a spot instance ran while its bid was at
//!   least the price and was evicted at the first price change above it. It replays the
//!   market's own history: from many start times inside a look-back window before the decision
//!   time, "had I bid the price then plus `delta`, when would I have been evicted?". Only start
//!   times whose whole horizon lies before the decision time count, so no estimate ever depends
//!   on a price the decision could not have seen.
//! - [`HazardModel`] for today's market, where interruptions follow capacity, not price: a
//!   per-pool (availability zone × instance type) interruption rate with a configurable prior,
//!   updated from the interruptions the broker observes ([`MarketModel::observe`]).
//!
//! - [`learned::LearnedModel`] for the 2015 market too: logistic regression on features a
//!   broker has at launch (the replay's estimate among them), fitted on earlier launches'
//!   outcomes and loaded from a file.
//!
//! All answer the same question, [`MarketModel::eviction`]: for an instance in `market` whose
//! bid is `bid_delta` above the current price, the probability of eviction within a horizon and
//! the expected time it keeps running within that horizon.

pub mod availability;
mod hazard;
pub mod learned;
pub mod pool_book;
mod price;

pub use hazard::{HazardModel, HazardPrior};
pub use price::{MarketState, PriceDrivenModel, PriceModelConfig, replay_once, state_start_times};

use crate::market::{Market, Timestamp};
use serde::Serialize;
use thiserror::Error;

/// What a model expects of one instance over a horizon starting at the decision time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvictionEstimate {
    /// Probability that the instance is evicted within the horizon.
    pub probability: f64,
    /// Expected running time within the horizon, `E[min(time to eviction, horizon)]`, seconds.
    pub expected_secs: f64,
    /// The horizon both figures refer to, seconds.
    pub horizon_secs: f64,
    /// How many historical start times (price-driven) the estimate averages; 0 for a prior.
    pub samples: u32,
}

impl EvictionEstimate {
    /// An instance that cannot be evicted (on-demand).
    pub fn never(horizon_secs: f64) -> Self {
        EvictionEstimate {
            probability: 0.0,
            expected_secs: horizon_secs,
            horizon_secs,
            samples: 0,
        }
    }

    /// The constant eviction rate (per second) that gives the same probability over the
    /// horizon. Used to scale an estimate to a shorter window.
    pub fn hazard_per_sec(&self) -> f64 {
        if self.probability <= 0.0 || self.horizon_secs <= 0.0 {
            0.0
        } else if self.probability >= 1.0 {
            f64::INFINITY
        } else {
            -(1.0 - self.probability).ln() / self.horizon_secs
        }
    }

    /// The estimate for a window of `secs` (at most the horizon), assuming a constant eviction
    /// rate inside the horizon. BidBrain uses it for the rest of an instance's billing hour.
    pub fn within(&self, secs: f64) -> EvictionEstimate {
        let secs = secs.clamp(0.0, self.horizon_secs.max(0.0));
        if secs >= self.horizon_secs {
            return *self;
        }
        let rate = self.hazard_per_sec();
        let (probability, expected_secs) = if rate == 0.0 {
            (0.0, secs)
        } else if rate.is_infinite() {
            // Certain eviction within the horizon: spread it as the original expectation does.
            let frac = if self.horizon_secs > 0.0 {
                secs / self.horizon_secs
            } else {
                1.0
            };
            (1.0, (self.expected_secs * frac).min(secs))
        } else {
            let p = 1.0 - (-rate * secs).exp();
            (p, p / rate)
        };
        EvictionEstimate {
            probability,
            expected_secs,
            horizon_secs: secs,
            samples: self.samples,
        }
    }
}

/// An event the broker saw, fed to the model so that it learns (the hazard model does; the
/// price-driven model learns from prices alone and ignores these).
#[derive(Debug, Clone, Copy)]
pub enum Observation<'a> {
    /// An instance in `market` ran for `hours` (report each stretch once).
    Ran { market: &'a Market, hours: f64 },
    /// The provider interrupted an instance in `market` at `at`.
    Interrupted { market: &'a Market, at: Timestamp },
}

/// Which kind of model answers; policies use it to decide whether bids matter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// Evictions follow the price: the bid (and so the bid delta) matters.
    PriceDriven,
    /// Evictions follow capacity: any bid at or above the price is as safe as any other.
    Hazard,
}

/// Why a model could not answer.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ModelError {
    #[error("market {0} has no price history")]
    UnknownMarket(String),
    #[error(
        "market {market} has only {samples} usable start times in the look-back window before {now} \
         (need {needed})"
    )]
    NotEnoughHistory {
        market: String,
        now: Timestamp,
        samples: u32,
        needed: u32,
    },
    #[error("horizon of {0} s is not positive and finite")]
    BadHorizon(f64),
    #[error(
        "market {0} has no on-demand price, so bid deltas (fractions of on-demand) are undefined"
    )]
    NoOnDemandPrice(String),
}

/// The interface every policy uses to judge eviction risk. Implementations are deterministic:
/// the same observations and the same `now` give the same answer.
pub trait MarketModel: Send + Sync {
    fn kind(&self) -> ModelKind;

    /// Eviction risk over `horizon_secs` from `now` for an instance in `market` whose bid is
    /// `bid_delta_usd` (USD/h, ≥ 0) above the price in force at `now`. Must use nothing that
    /// happened after `now`.
    fn eviction(
        &self,
        market: &Market,
        bid_delta_usd: f64,
        horizon_secs: f64,
        now: Timestamp,
    ) -> Result<EvictionEstimate, ModelError>;

    /// [`MarketModel::eviction`] for several deltas of one market (appends to `out`). The
    /// price-driven model overrides it to find the market's index once.
    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        now: Timestamp,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        for &d in bid_deltas_usd {
            out.push(self.eviction(market, d, horizon_secs, now)?);
        }
        Ok(())
    }

    /// Learns from an observation. The default ignores it.
    fn observe(&mut self, _observation: Observation<'_>) {}

    /// A fresh copy with the same configuration and what it has learned so far; the simulator
    /// gives every run its own copy so that runs do not learn from each other.
    fn boxed_clone(&self) -> Box<dyn MarketModel>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_scales_a_constant_hazard() {
        let e = EvictionEstimate {
            probability: 0.5,
            expected_secs: 3600.0 * 0.5 / 2f64.ln(),
            horizon_secs: 3600.0,
            samples: 10,
        };
        let half = e.within(1800.0);
        assert!((half.probability - (1.0 - 0.5f64.sqrt())).abs() < 1e-12);
        assert!(half.expected_secs < 1800.0 && half.expected_secs > 1500.0);
        assert_eq!(e.within(7200.0), e);
        let never = EvictionEstimate::never(3600.0).within(60.0);
        assert_eq!((never.probability, never.expected_secs), (0.0, 60.0));
    }
}
