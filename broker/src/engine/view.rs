//! The market as a policy sees it, in the simulator and the live scheduler alike: a price
//! history up to the decision time (the live scheduler's history is the store's, refreshed as
//! prices arrive), with the market model's eviction estimates.

use crate::market::{Market, Timestamp, UsdPerHour};
use crate::market_model::pool_book::PoolBook;
use crate::market_model::{EvictionEstimate, MarketModel, ModelError, ModelKind};
use crate::policy::{MarketView, ViewError};
use crate::prices::{PriceHistory, PriceSeries};
use std::collections::HashMap;
use std::sync::Arc;

/// The markets of a trace with what every view needs precomputed: on-demand prices by market
/// and the first price time of each (a market "exists" for a view only from then on).
#[derive(Debug, Clone)]
pub struct TraceMarkets {
    history: Arc<PriceHistory>,
    markets: Vec<Market>,
    first: Vec<Timestamp>,
    on_demand: HashMap<Market, UsdPerHour>,
}

impl TraceMarkets {
    pub fn new(history: Arc<PriceHistory>) -> Self {
        let mut markets = Vec::new();
        let mut first = Vec::new();
        let mut on_demand = HashMap::new();
        for s in history.series() {
            let Some(t) = s.first_time() else { continue };
            markets.push(s.market().clone());
            first.push(t);
            if let Some(o) = history.on_demand().for_market(s.market()) {
                on_demand.insert(s.market().clone(), o.on_demand);
            }
        }
        TraceMarkets {
            history,
            markets,
            first,
            on_demand,
        }
    }

    pub fn history(&self) -> &Arc<PriceHistory> {
        &self.history
    }

    pub fn series(&self, market: &Market) -> Option<&PriceSeries> {
        self.history.get(market)
    }

    pub fn on_demand(&self, market: &Market) -> Option<UsdPerHour> {
        self.on_demand.get(market).copied()
    }

    /// Instance types that have a market and an on-demand price: what a job may use by
    /// default.
    pub fn usable_types(&self) -> Vec<crate::market::InstanceType> {
        let mut types: Vec<crate::market::InstanceType> = self
            .markets()
            .iter()
            .filter(|m| self.on_demand(m).is_some())
            .map(|m| m.instance_type.clone())
            .collect();
        types.sort();
        types.dedup();
        types
    }

    pub fn markets(&self) -> &[Market] {
        &self.markets
    }
}

/// What a read of the future does: fail (production behaviour) or panic (tests that prove the
/// policies never try).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FutureReads {
    #[default]
    Refuse,
    Panic,
}

/// A [`MarketView`] over a trace at `now`.
pub struct TraceView<'a> {
    now: Timestamp,
    markets: &'a TraceMarkets,
    model: &'a dyn MarketModel,
    future: FutureReads,
    book: Option<&'a PoolBook>,
}

impl<'a> TraceView<'a> {
    pub fn new(
        now: Timestamp,
        markets: &'a TraceMarkets,
        model: &'a dyn MarketModel,
        future: FutureReads,
    ) -> Self {
        TraceView {
            now,
            markets,
            model,
            future,
            book: None,
        }
    }

    /// The view with the fleet's pool book (a fleet of jobs run together).
    pub fn with_book(mut self, book: Option<&'a PoolBook>) -> Self {
        self.book = book;
        self
    }

    fn guard(&self, market: &Market, at: Timestamp) -> Result<(), ViewError> {
        if at <= self.now {
            return Ok(());
        }
        let err = ViewError::Future {
            market: market.to_string(),
            requested: at,
            now: self.now,
        };
        match self.future {
            FutureReads::Refuse => Err(err),
            FutureReads::Panic => panic!("policy read the future: {err}"),
        }
    }
}

impl MarketView for TraceView<'_> {
    fn now(&self) -> Timestamp {
        self.now
    }

    fn pool_book(&self) -> Option<&PoolBook> {
        self.book
    }

    fn markets(&self) -> Vec<&Market> {
        self.markets
            .markets
            .iter()
            .zip(&self.markets.first)
            .filter(|(_, first)| **first <= self.now)
            .map(|(m, _)| m)
            .collect()
    }

    fn spot_price(&self, market: &Market) -> Option<UsdPerHour> {
        self.markets.series(market)?.price_at(self.now)
    }

    fn spot_price_at(
        &self,
        market: &Market,
        at: Timestamp,
    ) -> Result<Option<UsdPerHour>, ViewError> {
        self.guard(market, at)?;
        Ok(self.markets.series(market).and_then(|s| s.price_at(at)))
    }

    fn mean_spot_price(
        &self,
        market: &Market,
        since: Timestamp,
    ) -> Result<Option<UsdPerHour>, ViewError> {
        self.guard(market, since)?;
        let Some(series) = self.markets.series(market) else {
            return Ok(None);
        };
        Ok(series.time_weighted_mean(since, self.now))
    }

    fn on_demand_price(&self, market: &Market) -> Option<UsdPerHour> {
        self.markets.on_demand(market)
    }

    fn model_kind(&self) -> ModelKind {
        self.model.kind()
    }

    fn eviction(
        &self,
        market: &Market,
        bid_delta_usd: f64,
        horizon_secs: f64,
    ) -> Result<EvictionEstimate, ModelError> {
        self.model
            .eviction(market, bid_delta_usd, horizon_secs, self.now)
    }

    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        self.model
            .eviction_many(market, bid_deltas_usd, horizon_secs, self.now, out)
    }
}
