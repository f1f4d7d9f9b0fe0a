//! The simulated cloud: a spot market that replays a price trace on the broker's clock.
//!
//! A spot instance runs while its bid is at least the market price. When the trace's price
//! crosses the bid, the provider issues the two-minute warning and reclaims the instance two
//! market minutes later, exactly as EC2 did in 2015. Because the clock may run hundreds of times
//! faster than wall time, two market minutes can be a fraction of a wall second; the reclaim is
//! therefore also held back until `min_notice` of *wall* time has passed since the warning, so
//! that real agents get a real chance to hand over. Billing still uses the market time.
//!
//! With availability traces ([`SimCloud::with_availability`], today's market) the bid decides
//! nothing: a spot launch into a pool without spare capacity is refused as EC2 refuses it
//! (`InsufficientInstanceCapacity`), and when a pool's capacity falls below what is held there,
//! the newest instances get the notice at the first look after the drop.

use super::{Cloud, CloudError, CloudEvent, CloudInstance, CloudState, LaunchSpec};
use crate::clock::SharedClock;
use crate::market::{Market, Timestamp, UsdPerHour};
use crate::prices::PriceHistory;
use crate::sim::availability::Availability;
use async_trait::async_trait;
use proteus_wire::{JobId, Tier};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A launch's parameters as EC2 compares them for a reused ClientToken (the user data included:
/// it carries the bootstrap token).
#[derive(Debug, Clone, PartialEq)]
struct LaunchParameters {
    job_id: JobId,
    market: Market,
    tier: Tier,
    bid: Option<UsdPerHour>,
    user_data: String,
}

impl LaunchParameters {
    fn of(spec: &LaunchSpec) -> LaunchParameters {
        LaunchParameters {
            job_id: spec.job_id,
            market: spec.market.clone(),
            tier: spec.tier,
            bid: spec.bid,
            user_data: spec.bootstrap_token.clone(),
        }
    }
}

#[derive(Debug)]
struct SimInstance {
    instance_id: String,
    /// What the launch asked for besides its ClientToken (the instance id): a later launch with
    /// the same token must ask for the same, as on EC2.
    asked: LaunchParameters,
    job_id: JobId,
    market: Market,
    launched: Timestamp,
    spot: bool,
    /// When the provider warns: the trace's price crosses the bid, or an interruption was sent
    /// (spot only).
    warn_at: Option<Timestamp>,
    warned_wall: Option<Instant>,
    ended: Option<(Timestamp, bool)>,
    ended_reported: bool,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    instances: BTreeMap<String, SimInstance>,
}

/// A cloud whose spot market is a trace.
#[derive(Debug, Clone)]
pub struct SimCloud {
    trace: Arc<PriceHistory>,
    availability: Option<Arc<Availability>>,
    clock: SharedClock,
    min_notice: Duration,
    state: Arc<Mutex<State>>,
}

impl SimCloud {
    pub fn new(trace: Arc<PriceHistory>, clock: SharedClock, min_notice: Duration) -> Self {
        SimCloud {
            trace,
            availability: None,
            clock,
            min_notice,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    pub fn trace(&self) -> &Arc<PriceHistory> {
        &self.trace
    }

    /// Today's market: capacity from availability traces decides launches and notices.
    pub fn with_availability(mut self, availability: Arc<Availability>) -> Self {
        self.availability = Some(availability);
        self
    }

    /// Spot instances held in `market` that are neither ended nor warned, oldest first.
    fn held<'s>(state: &'s State, market: &Market) -> Vec<(&'s String, &'s SimInstance)> {
        let mut held: Vec<_> = state
            .instances
            .iter()
            .filter(|(_, i)| {
                i.spot && &i.market == market && i.ended.is_none() && i.warn_at.is_none()
            })
            .collect();
        held.sort_by_key(|(id, i)| (i.launched, (*id).clone()));
        held
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn price_now(&self, market: &Market, now: Timestamp) -> Result<UsdPerHour, CloudError> {
        self.trace
            .get(market)
            .and_then(|s| s.price_at(now))
            .ok_or_else(|| CloudError::Call {
                operation: "RunInstances",
                message: format!("the simulated market {market} has no price at {now}"),
            })
    }
}

#[async_trait]
impl Cloud for SimCloud {
    fn kind(&self) -> &'static str {
        "sim"
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        let now = self.clock.now();
        let price = self.price_now(&spec.market, now)?;
        let warn_at = match (spec.tier, spec.bid) {
            (Tier::Reliable, _) => None,
            (Tier::Transient, None) => {
                return Err(CloudError::Call {
                    operation: "RunInstances",
                    message: "a spot launch needs a bid".into(),
                });
            }
            (Tier::Transient, Some(bid)) => {
                if bid < price {
                    return Err(CloudError::PriceTooLow {
                        market: spec.market.to_string(),
                        message: format!("bid {bid} is below the spot price {price}"),
                    });
                }
                match &self.availability {
                    Some(_) => None,
                    // Priced above, so the market has a series.
                    None => self
                        .trace
                        .get(&spec.market)
                        .and_then(|series| series.first_above(now, bid.get(), Timestamp::MAX)),
                }
            }
        };
        let mut state = self.lock();
        if let (Some(a), Tier::Transient) = (&self.availability, spec.tier) {
            let capacity = a.capacity(&spec.market, now) as usize;
            let held = Self::held(&state, &spec.market).len();
            let again = state
                .instances
                .values()
                .any(|i| i.instance_id == spec.instance_id);
            if held >= capacity && !again {
                return Err(CloudError::InsufficientCapacity {
                    market: spec.market.to_string(),
                    message: format!(
                        "no spare spot capacity in {} ({capacity} available, {held} held)",
                        spec.market.zone
                    ),
                });
            }
        }
        // Idempotent like EC2's ClientToken: the same broker id with the same parameters
        // returns the same instance; with other parameters it is refused.
        if let Some((cloud_id, i)) = state
            .instances
            .iter()
            .find(|(_, i)| i.instance_id == spec.instance_id)
        {
            if i.asked != LaunchParameters::of(spec) {
                return Err(CloudError::IdempotentParameterMismatch {
                    message: format!(
                        "client token {} was used for a launch with other parameters ({cloud_id})",
                        spec.instance_id
                    ),
                });
            }
            return Ok(describe_one(cloud_id, i));
        }
        state.next += 1;
        let cloud_id = format!("sim-{:08x}", state.next);
        let instance = SimInstance {
            instance_id: spec.instance_id.clone(),
            asked: LaunchParameters::of(spec),
            job_id: spec.job_id,
            market: spec.market.clone(),
            launched: now,
            spot: spec.tier == Tier::Transient,
            warn_at,
            warned_wall: None,
            ended: None,
            ended_reported: false,
        };
        let described = describe_one(&cloud_id, &instance);
        state.instances.insert(cloud_id, instance);
        Ok(described)
    }

    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError> {
        let now = self.clock.now();
        let mut state = self.lock();
        for id in cloud_ids {
            if let Some(i) = state.instances.get_mut(id)
                && i.ended.is_none()
            {
                i.ended = Some((now, false));
            }
        }
        Ok(())
    }

    async fn describe(&self) -> Result<Vec<CloudInstance>, CloudError> {
        let state = self.lock();
        Ok(state
            .instances
            .iter()
            .map(|(id, i)| describe_one(id, i))
            .collect())
    }

    async fn events(&self) -> Result<Vec<CloudEvent>, CloudError> {
        let now = self.clock.now();
        let wall = Instant::now();
        let mut state = self.lock();
        if let Some(a) = &self.availability {
            // Where a pool now sells fewer instances than are held there, the newest go.
            let pools: std::collections::BTreeSet<Market> = state
                .instances
                .values()
                .filter(|i| i.spot && i.ended.is_none() && i.warn_at.is_none())
                .map(|i| i.market.clone())
                .collect();
            for market in pools {
                let capacity = a.capacity(&market, now) as usize;
                let excess: Vec<String> = Self::held(&state, &market)
                    .iter()
                    .rev()
                    .take(Self::held(&state, &market).len().saturating_sub(capacity))
                    .map(|(id, _)| (*id).clone())
                    .collect();
                for id in excess {
                    if let Some(i) = state.instances.get_mut(&id) {
                        i.warn_at = Some(now);
                    }
                }
            }
        }
        let mut events = Vec::new();
        for (cloud_id, i) in state.instances.iter_mut() {
            if i.ended.is_none()
                && let Some(warn_at) = i.warn_at
                && warn_at <= now
            {
                let action_time = warn_at.plus_secs(crate::engine::NOTICE_SECS);
                let warned_wall = match i.warned_wall {
                    Some(w) => w,
                    None => {
                        i.warned_wall = Some(wall);
                        events.push(CloudEvent::Warning {
                            cloud_id: cloud_id.clone(),
                            at: warn_at,
                            action_time,
                        });
                        wall
                    }
                };
                if action_time <= now && wall.duration_since(warned_wall) >= self.min_notice {
                    i.ended = Some((action_time, true));
                }
            }
            if let Some((at, by_provider)) = i.ended
                && !i.ended_reported
            {
                i.ended_reported = true;
                events.push(CloudEvent::Ended {
                    cloud_id: cloud_id.clone(),
                    at,
                    by_provider,
                });
            }
        }
        Ok(events)
    }

    fn next_event_after(&self, now: Timestamp) -> Option<Timestamp> {
        let state = self.lock();
        state
            .instances
            .values()
            .filter(|i| i.ended.is_none())
            .filter_map(|i| {
                let warn_at = i.warn_at?;
                Some(match i.warned_wall {
                    None => warn_at,
                    Some(_) => warn_at.plus_secs(crate::engine::NOTICE_SECS),
                })
            })
            .filter(|&t| t > now)
            .chain(self.availability.as_ref().and_then(|a| {
                state
                    .instances
                    .values()
                    .filter(|i| i.spot && i.ended.is_none() && i.warn_at.is_none())
                    .filter_map(|i| a.next_change(&i.market, now))
                    .min()
            }))
            .min()
    }

    async fn send_interruption(&self, cloud_id: &str) -> Result<(), CloudError> {
        let now = self.clock.now();
        let refuse = |message: String| CloudError::Call {
            operation: "SendSpotInstanceInterruptions",
            message,
        };
        let mut state = self.lock();
        let i = state
            .instances
            .get_mut(cloud_id)
            .ok_or_else(|| refuse(format!("no instance {cloud_id}")))?;
        if i.ended.is_some() {
            return Err(refuse(format!("{cloud_id} has already ended")));
        }
        // Only spot instances have a warning time; on-demand ones are never interrupted.
        match i.warn_at {
            None if !i.spot => Err(refuse(format!(
                "{cloud_id} is an on-demand instance; only spot instances are interrupted"
            ))),
            Some(at) if at <= now => Ok(()),
            _ => {
                i.warn_at = Some(now);
                Ok(())
            }
        }
    }
}

fn describe_one(cloud_id: &str, i: &SimInstance) -> CloudInstance {
    CloudInstance {
        cloud_id: cloud_id.to_string(),
        instance_id: Some(i.instance_id.clone()),
        job_id: Some(i.job_id),
        state: if i.ended.is_some() {
            CloudState::Terminated
        } else {
            CloudState::Running
        },
        launched: Some(i.launched),
        ended_by_provider: i.ended.is_some_and(|(_, p)| p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::market::UsdPerHour;
    use crate::prices::{OnDemandCatalog, PriceSeries};

    fn cloud(clock: &ManualClock) -> SimCloud {
        let m = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let p = |v| UsdPerHour::new(v).unwrap();
        let series = PriceSeries::new(
            m,
            vec![
                (Timestamp::from_millis(0), p(0.05)),
                (Timestamp::from_millis(3_600_000), p(0.5)),
                (Timestamp::from_millis(7_200_000), p(0.05)),
            ],
        );
        let trace = PriceHistory::new(vec![series], OnDemandCatalog::default());
        SimCloud::new(Arc::new(trace), Arc::new(clock.clone()), Duration::ZERO)
    }

    fn spec(id: &str, tier: Tier, bid: Option<f64>) -> LaunchSpec {
        LaunchSpec {
            instance_id: id.into(),
            job_id: JobId(1),
            market: Market::parse("us-east-1a/c3.xlarge").unwrap(),
            tier,
            bid: bid.map(|b| UsdPerHour::new(b).unwrap()),
            bootstrap_token: "t".into(),
        }
    }

    #[tokio::test]
    async fn with_availability_capacity_refuses_launches_and_a_shrinking_pool_warns_the_newest() {
        use crate::sim::availability::{Availability, AvailabilityTrace, Reading};
        // Ten-minute ticks: two instances for 20 minutes, one for 10, then none.
        let trace = AvailabilityTrace::parse(
            std::path::Path::new("us-east-1a_x.json"),
            "{\"metadata\": {\"gap_seconds\": 600}, \"data\": [2, 2, 1, 0, 0]}",
            Reading::Available,
        )
        .unwrap();
        let a = Arc::new(
            Availability::new(
                vec![trace],
                crate::market::InstanceType::parse("c3.xlarge").unwrap(),
                Timestamp::from_millis(0),
            )
            .unwrap(),
        );
        let clock = ManualClock::new(Timestamp::from_millis(60_000));
        let cloud = cloud(&clock).with_availability(a);
        let first = cloud
            .launch(&spec("a", Tier::Transient, Some(0.1)))
            .await
            .unwrap();
        clock.set(Timestamp::from_millis(120_000));
        let second = cloud
            .launch(&spec("b", Tier::Transient, Some(0.1)))
            .await
            .unwrap();
        let refused = cloud
            .launch(&spec("c", Tier::Transient, Some(0.1)))
            .await
            .unwrap_err();
        assert!(
            matches!(refused, CloudError::InsufficientCapacity { .. }),
            "{refused:?}"
        );
        // The same instance id again is the same instance, not a third one.
        assert_eq!(
            cloud
                .launch(&spec("b", Tier::Transient, Some(0.1)))
                .await
                .unwrap()
                .cloud_id,
            second.cloud_id
        );
        // On-demand is not capacity-bound; the price no longer evicts spot (the 0.5 at 1 h).
        cloud
            .launch(&spec("d", Tier::Reliable, None))
            .await
            .unwrap();
        assert_eq!(
            cloud.next_event_after(Timestamp::from_millis(120_000)),
            Some(Timestamp::from_millis(1_200_000)),
            "the next change of the pool"
        );
        clock.set(Timestamp::from_millis(1_200_000));
        assert_eq!(
            cloud.events().await.unwrap(),
            vec![CloudEvent::Warning {
                cloud_id: second.cloud_id.clone(),
                at: Timestamp::from_millis(1_200_000),
                action_time: Timestamp::from_millis(1_320_000)
            }],
            "one instance too many: the newest goes"
        );
        clock.set(Timestamp::from_millis(1_800_000));
        let ev = cloud.events().await.unwrap();
        assert!(
            ev.contains(&CloudEvent::Warning {
                cloud_id: first.cloud_id.clone(),
                at: Timestamp::from_millis(1_800_000),
                action_time: Timestamp::from_millis(1_920_000)
            }),
            "{ev:?}"
        );
    }

    #[tokio::test]
    async fn spot_is_warned_then_reclaimed_when_the_price_crosses_the_bid() {
        let clock = ManualClock::new(Timestamp::from_millis(60_000));
        let cloud = cloud(&clock);
        let spot = cloud
            .launch(&spec("a", Tier::Transient, Some(0.1)))
            .await
            .unwrap();
        let od = cloud
            .launch(&spec("b", Tier::Reliable, None))
            .await
            .unwrap();
        assert_eq!(
            cloud
                .launch(&spec("a", Tier::Transient, Some(0.1)))
                .await
                .unwrap()
                .cloud_id,
            spot.cloud_id
        );
        assert!(cloud.events().await.unwrap().is_empty());

        clock.set(Timestamp::from_millis(3_600_000));
        let ev = cloud.events().await.unwrap();
        assert_eq!(
            ev,
            vec![CloudEvent::Warning {
                cloud_id: spot.cloud_id.clone(),
                at: Timestamp::from_millis(3_600_000),
                action_time: Timestamp::from_millis(3_720_000)
            }]
        );
        clock.set(Timestamp::from_millis(3_720_000));
        let ev = cloud.events().await.unwrap();
        assert_eq!(
            ev,
            vec![CloudEvent::Ended {
                cloud_id: spot.cloud_id.clone(),
                at: Timestamp::from_millis(3_720_000),
                by_provider: true
            }]
        );
        assert!(cloud.events().await.unwrap().is_empty(), "reported once");

        cloud
            .terminate(std::slice::from_ref(&od.cloud_id))
            .await
            .unwrap();
        let ev = cloud.events().await.unwrap();
        assert_eq!(
            ev,
            vec![CloudEvent::Ended {
                cloud_id: od.cloud_id.clone(),
                at: Timestamp::from_millis(3_720_000),
                by_provider: false
            }]
        );
    }

    #[tokio::test]
    async fn the_reclaim_waits_for_the_minimum_wall_notice() {
        let clock = ManualClock::new(Timestamp::from_millis(60_000));
        let m = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let p = |v| UsdPerHour::new(v).unwrap();
        let series = PriceSeries::new(
            m,
            vec![
                (Timestamp::from_millis(0), p(0.05)),
                (Timestamp::from_millis(3_600_000), p(0.5)),
            ],
        );
        let trace = PriceHistory::new(vec![series], OnDemandCatalog::default());
        let cloud = SimCloud::new(
            Arc::new(trace),
            Arc::new(clock.clone()),
            Duration::from_millis(100),
        );
        let spot = cloud
            .launch(&spec("a", Tier::Transient, Some(0.1)))
            .await
            .unwrap();
        clock.set(Timestamp::from_millis(7_200_000));
        let ev = cloud.events().await.unwrap();
        assert_eq!(ev.len(), 1, "only the warning: {ev:?}");
        assert!(
            cloud.events().await.unwrap().is_empty(),
            "held back by the wall notice"
        );
        tokio::time::sleep(Duration::from_millis(120)).await;
        let ev = cloud.events().await.unwrap();
        assert_eq!(
            ev,
            vec![CloudEvent::Ended {
                cloud_id: spot.cloud_id,
                at: Timestamp::from_millis(3_720_000),
                by_provider: true
            }]
        );
    }

    #[tokio::test]
    async fn a_sent_interruption_warns_a_spot_instance_now_and_never_an_on_demand_one() {
        let clock = ManualClock::new(Timestamp::from_millis(60_000));
        let cloud = cloud(&clock);
        let spot = cloud
            .launch(&spec("a", Tier::Transient, Some(0.1)))
            .await
            .unwrap();
        let od = cloud
            .launch(&spec("b", Tier::Reliable, None))
            .await
            .unwrap();
        clock.set(Timestamp::from_millis(600_000));
        assert!(cloud.events().await.unwrap().is_empty(), "calm prices");
        cloud.send_interruption(&spot.cloud_id).await.unwrap();
        assert_eq!(
            cloud.events().await.unwrap(),
            vec![CloudEvent::Warning {
                cloud_id: spot.cloud_id.clone(),
                at: Timestamp::from_millis(600_000),
                action_time: Timestamp::from_millis(720_000)
            }],
            "warned at once, reclaimed two minutes later"
        );
        clock.set(Timestamp::from_millis(720_000));
        assert_eq!(
            cloud.events().await.unwrap(),
            vec![CloudEvent::Ended {
                cloud_id: spot.cloud_id.clone(),
                at: Timestamp::from_millis(720_000),
                by_provider: true
            }]
        );
        let err = cloud.send_interruption(&od.cloud_id).await.unwrap_err();
        assert!(err.to_string().contains("on-demand"), "{err}");
        let err = cloud.send_interruption(&spot.cloud_id).await.unwrap_err();
        assert!(err.to_string().contains("already ended"), "{err}");
        assert!(cloud.send_interruption("sim-nope").await.is_err());
    }

    #[tokio::test]
    async fn a_bid_below_the_price_is_refused() {
        let clock = ManualClock::new(Timestamp::from_millis(3_700_000));
        let cloud = cloud(&clock);
        let err = cloud
            .launch(&spec("a", Tier::Transient, Some(0.1)))
            .await
            .unwrap_err();
        assert_eq!(err.reason(), "price-too-low");
        assert!(err.cools_down_market());
    }
}
