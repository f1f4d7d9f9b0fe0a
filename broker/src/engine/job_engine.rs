//! [`JobEngine`]: everything decided about one job, as a pure, deterministic state machine.
//!
//! The engine consults the job's policy, holds the footprint to its [`Limits`], its budget and
//! its deadline, counts the work its instances deliver ([`JobWork`]), bills every instance
//! under the job's billing model, and decides when the job ends and why. It never awaits,
//! reads a clock or touches the store or the cloud: every call takes `now`, what the world did
//! comes in as [`Input`]s, and what the engine wants done goes out as [`Command`]s.
//!
//! Two thin drivers run it. The simulator ([`crate::sim`]) feeds it the trace's world in time
//! order; the live scheduler ([`crate::service`]) feeds it what the store, the cloud and the
//! agents report, executes its commands, and saves its [`EngineState`] so that a restarted
//! broker continues the job where it was.
//!
//! ## One instant
//!
//! A driver calls [`JobEngine::step`] with [`Input::Tick`] whenever it looks at the job (at
//! least at every [`JobEngine::next_wake`]). At a new instant the engine, in this order:
//! counts the work since the last instant (the footprint was constant in between: drivers
//! step onto every change), completes the job if its work is done, applies what arrived since
//! (ends, warnings, readiness), checks the budget and the deadline, and then consults the
//! policy about each kind of event (warned, evicted, ready) and on its own when its wake-up
//! time has come.
//!
//! ## Launches
//!
//! A launch is answered before the engine goes on: a step returns at most one
//! [`Command::Launch`], always last, and the driver feeds back [`Input::Launched`],
//! [`Input::LaunchRefused`] or [`Input::LaunchHeld`] at the same `now`. The limits and the
//! budget are checked before each instance, with the ones already launched counted; a market
//! that refused is not asked again in the same decision, and the policy then hears of each
//! refusal once ([`PolicyEvent::LaunchFailed`]). What it asks then is applied, and refusals of
//! that bring its next consultation forward ([`super::after_refusal`]).

use super::limits::{Budget, Held, Limits};
use super::progress::JobWork;
use super::view::TraceMarkets;
use super::work::{self, WorkingSpan};
use crate::billing::{BillingModel, EndedBy, PriceSource};
use crate::job::JobModel;
use crate::market::{Market, Timestamp, Usd, UsdPerHour};
use crate::policy::{
    Acquisition, Decision, DecisionContext, InstanceState, InstanceView, JobProgress, MarketView,
    Policy, PolicyError, PolicyEvent, Purchase,
};
use proteus_wire::{InstanceId, Tier};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use thiserror::Error;

/// Where a job's progress comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pacing {
    /// From the agents' training clocks; an instance is ready once its agent registered.
    /// What a real deployment does.
    Measured,
    /// From the work model (units per instance-hour of every ready, unwarned instance, minus
    /// what evictions lose), on market time only; an instance is ready `startup` after launch.
    /// With a stepped clock this makes a replay deterministic: the same trace, seed and policy
    /// give the same decisions at the same market times, whatever the machine's speed. The
    /// simulator always runs this way.
    Modelled,
}

/// How often (market seconds) the engine looks at a job's budget, and how far ahead: the job
/// ends at the first look at which the spend plus what the next look's interval would add
/// passes the budget. Looks are on a grid from the job's start, so that every driver looks at
/// the same instants.
pub const BUDGET_LOOK_SECS: f64 = 60.0;

/// How a driver runs the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    pub pacing: Pacing,
    /// Under [`Pacing::Modelled`]: the job ends only once real training also reported its end
    /// ([`Input::TrainingComplete`]), as well as the modelled work (the demo's agents).
    pub await_training: bool,
    /// How far ahead the budget is checked (market seconds; at least [`BUDGET_LOOK_SECS`]). A
    /// live broker whose ticks are further apart in market time looks further ahead.
    pub budget_lookahead_secs: f64,
    /// Keep every decision ([`JobEngine::decisions`]); tests and debugging.
    pub record_decisions: bool,
}

impl EngineConfig {
    pub fn new(pacing: Pacing) -> Self {
        EngineConfig {
            pacing,
            await_training: false,
            budget_lookahead_secs: BUDGET_LOOK_SECS,
            record_decisions: false,
        }
    }
}

/// What the job was submitted with that bounds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobTerms {
    pub billing: BillingModel,
    pub budget: Option<Usd>,
    pub deadline: Option<Timestamp>,
    /// When the job started (its policy plans from here; the budget's grid starts here).
    pub started_at: Timestamp,
}

/// What the engine reads about the market at an instant: the policy's view (the live driver's
/// hides markets in a cool-down) and the prices it bills with.
pub struct Ctx<'a> {
    pub view: &'a dyn MarketView,
    pub markets: &'a TraceMarkets,
}

/// What happened, as a driver reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// The driver looks at the job (time passed, or something arrived).
    Tick,
    /// The answer to [`Command::Launch`]: it runs, under this id, since `at`.
    Launched { id: InstanceId, at: Timestamp },
    /// The answer to [`Command::Launch`]: the cloud refused the market.
    LaunchRefused { reason: String },
    /// The answer to [`Command::Launch`]: the driver holds launches back (e.g. a broker-wide
    /// instance cap); the rest of this acquisition is not tried.
    LaunchHeld { reason: String },
    /// [`Pacing::Measured`]: the instance's agent joined the training at `at`.
    Ready { id: InstanceId, at: Timestamp },
    /// The provider will reclaim the instance at `terminate_at`.
    Warned {
        id: InstanceId,
        at: Timestamp,
        terminate_at: Timestamp,
    },
    /// The instance is gone since `at`. Whoever reports it, an instance that was warned was
    /// reclaimed by the provider (billed under the provider-ended rule).
    Ended {
        id: InstanceId,
        at: Timestamp,
        by_provider: bool,
    },
    /// [`Pacing::Measured`]: the fraction of the training done, as the job reports it.
    Progress { fraction: f64 },
    /// The training ended well (the reason is shown to the user).
    TrainingComplete { reason: String },
    /// The training failed.
    TrainingFailed { reason: String },
}

/// What the engine wants done.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Launch one instance; answer with [`Input::Launched`], [`Input::LaunchRefused`] or
    /// [`Input::LaunchHeld`] before the next step.
    Launch { market: Market, purchase: Purchase },
    /// End an instance (by the user); its end comes back as [`Input::Ended`].
    Release { id: InstanceId },
    /// [`Pacing::Modelled`]: the instance started working for the job at `at`.
    MarkReady { id: InstanceId, at: Timestamp },
    /// Tell the market model what an instance did.
    Observe(MarketObservation),
    /// Record an event in the job's history.
    Record { kind: &'static str, detail: String },
    /// The job is over: end every instance it holds.
    End(JobEnd),
}

/// An observation for the market model ([`crate::market_model::Observation`], owned).
#[derive(Debug, Clone, PartialEq)]
pub enum MarketObservation {
    Ran { market: Market, hours: f64 },
    Interrupted { market: Market, at: Timestamp },
}

impl MarketObservation {
    pub fn as_observation(&self) -> crate::market_model::Observation<'_> {
        use crate::market_model::Observation;
        match self {
            MarketObservation::Ran { market, hours } => Observation::Ran {
                market,
                hours: *hours,
            },
            MarketObservation::Interrupted { market, at } => {
                Observation::Interrupted { market, at: *at }
            }
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// Its work is done.
    Completed,
    /// Its budget would have been passed.
    Budget,
    /// Its deadline passed first.
    Deadline,
    /// Its training failed.
    Failed,
}

impl Outcome {
    pub fn succeeded(self) -> bool {
        self == Outcome::Completed
    }
}

/// The end of a job: how, why (for the user) and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEnd {
    pub outcome: Outcome,
    pub reason: String,
    pub at: Timestamp,
}

/// Why the engine could not go on.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("policy `{policy}` at {at}: {source}")]
    Policy {
        policy: String,
        at: Timestamp,
        #[source]
        source: PolicyError,
    },
    #[error("{0} was answered while no launch was asked")]
    UnexpectedAnswer(&'static str),
    #[error("a launch was asked and not answered before {0}")]
    Unanswered(&'static str),
}

/// Capacity that did no useful work, in units (rate × hours).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Overheads {
    /// Starting instances (billed, not yet working).
    pub startup: f64,
    /// Warned instances handing over their work before termination.
    pub warned: f64,
    /// Ready instances paused: rebalancing, writing checkpoints, waiting for a restart.
    pub stalled: f64,
    /// Reliable instances holding only backup shards (AgileML stage 3).
    pub idle: f64,
    /// Billed but unused: the rest of each charged hour after a user ended the instance.
    pub unused_billed: f64,
}

/// One instance the job holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub id: InstanceId,
    pub market: Market,
    pub purchase: Purchase,
    pub launched_at: Timestamp,
    /// The job's units per hour on its type.
    pub rate: f64,
    /// When it started working for the job.
    pub ready: Option<Timestamp>,
    pub warned: Option<Timestamp>,
    pub terminate_at: Option<Timestamp>,
    /// Released by the policy (or at the job's end); its end is on its way.
    pub releasing: bool,
}

impl Member {
    /// Held against the limits: not warned, not being released.
    fn is_held(&self) -> bool {
        self.warned.is_none() && !self.releasing
    }

    /// Working for the job at this instant.
    fn works(&self) -> bool {
        self.ready.is_some() && self.is_held()
    }

    fn span(&self, until: Option<Timestamp>) -> Option<WorkingSpan> {
        Some(WorkingSpan {
            tier: self.purchase.tier(),
            units_per_hour: self.rate,
            from: self.ready?,
            until: [self.warned, until].into_iter().flatten().min(),
        })
    }
}

/// An instance that has ended, billed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ended {
    pub member: Member,
    pub end: Timestamp,
    pub by: EndedBy,
    pub cost: Usd,
}

/// Counts the simulator reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    /// Instances warned (taken away) by the provider.
    pub evictions: u32,
    /// Distinct instants at which the provider warned instances.
    pub eviction_events: u32,
    pub launches: u32,
    pub failed_launches: u32,
    /// Times the policy was asked.
    pub decisions: u32,
}

/// Everything the engine knows about a job that is not its policy: what a restarted broker
/// needs to continue the job. Saved between instants (a launch being answered is never saved).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineState {
    /// The last instant the work was counted up to.
    now: Option<Timestamp>,
    /// Units of work the job needs (re-estimated from measured progress).
    total_work: f64,
    /// Units of work the job was submitted with.
    submitted_work: f64,
    /// The last re-estimate recorded as an event.
    announced_work: Option<f64>,
    work: JobWork,
    /// Rebuilt from the store's instances when an engine is restored ([`JobEngine::adopt`]).
    #[serde(skip)]
    members: Vec<Member>,
    #[serde(skip)]
    ended: Vec<Ended>,
    next_decision: Option<Timestamp>,
    next_budget_look: Option<Timestamp>,
    /// [`Pacing::Measured`]: the last reported fraction.
    fraction: f64,
    training_complete: Option<String>,
    /// Warned, ended and readied since the last instant.
    #[serde(skip)]
    arrived: Arrivals,
    /// Why acquisitions were last held back.
    held: Option<String>,
    overheads: Overheads,
    counts: Counts,
    end: Option<JobEnd>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Arrivals {
    ended: Vec<(InstanceId, Timestamp, bool)>,
    warned: Vec<(InstanceId, Timestamp, Timestamp)>,
    ready: Vec<(InstanceId, Timestamp)>,
}

/// The policy events of this instant, gathered from what arrived.
#[derive(Debug, Default)]
struct InstantEvents {
    warned: Vec<InstanceId>,
    evicted: Vec<InstanceId>,
    ready: Vec<InstanceId>,
}

/// One decision being applied.
#[derive(Debug)]
struct Round {
    /// A consultation about a refused launch: its own refusals are not told again.
    retry: bool,
    acquisitions: VecDeque<Acquisition>,
    refused: Vec<(Market, String)>,
    /// Spent, or committed by this decision's launches (only with a budget).
    committed: Usd,
    awaiting: Option<Awaiting>,
}

#[derive(Debug)]
struct Awaiting {
    market: Market,
    purchase: Purchase,
    rate: f64,
    period: Usd,
}

/// One job's engine. See the [module](self) documentation.
pub struct JobEngine<'p> {
    job: JobModel,
    policy: Box<dyn Policy + 'p>,
    config: EngineConfig,
    terms: JobTerms,
    limits: Limits,
    state: EngineState,
    /// Consultations still to make at this instant.
    agenda: VecDeque<Option<PolicyEvent>>,
    round: Option<Round>,
    decisions: Vec<(Timestamp, Decision)>,
}

impl<'p> JobEngine<'p> {
    pub fn new(
        job: JobModel,
        policy: Box<dyn Policy + 'p>,
        config: EngineConfig,
        terms: JobTerms,
    ) -> Self {
        let work = JobWork::new(policy.eviction_cost(&job), terms.started_at);
        let state = EngineState {
            now: None,
            total_work: job.total_work,
            submitted_work: job.total_work,
            announced_work: None,
            work,
            members: Vec::new(),
            ended: Vec::new(),
            next_decision: None,
            next_budget_look: terms.budget.map(|_| terms.started_at),
            fraction: 0.0,
            training_complete: None,
            arrived: Arrivals::default(),
            held: None,
            overheads: Overheads::default(),
            counts: Counts::default(),
            end: None,
        };
        JobEngine::restore(job, policy, config, terms, state)
    }

    /// An engine that continues from a saved state.
    pub fn restore(
        job: JobModel,
        policy: Box<dyn Policy + 'p>,
        config: EngineConfig,
        terms: JobTerms,
        state: EngineState,
    ) -> Self {
        let limits = Limits::of(&job, policy.kind());
        let mut job = job;
        job.total_work = state.total_work;
        JobEngine {
            job,
            policy,
            config,
            terms,
            limits,
            state,
            agenda: VecDeque::new(),
            round: None,
            decisions: Vec::new(),
        }
    }

    // ---- what a driver reads ----

    pub fn state(&self) -> &EngineState {
        &self.state
    }

    pub fn policy(&self) -> &(dyn Policy + 'p) {
        self.policy.as_ref()
    }

    pub fn job(&self) -> &JobModel {
        &self.job
    }

    pub fn terms(&self) -> &JobTerms {
        &self.terms
    }

    /// The job's end, once decided.
    pub fn end(&self) -> Option<&JobEnd> {
        self.state.end.as_ref()
    }

    /// The instances the job holds (warned and releasing ones included).
    pub fn members(&self) -> &[Member] {
        &self.state.members
    }

    /// The instances that have ended, with their bills.
    pub fn ended(&self) -> &[Ended] {
        &self.state.ended
    }

    pub fn counts(&self) -> Counts {
        self.state.counts
    }

    pub fn overheads(&self) -> Overheads {
        self.state.overheads
    }

    /// Units of work done so far (modelled; under measured pacing the reported fraction of
    /// the total).
    pub fn done_work(&self) -> f64 {
        match self.config.pacing {
            Pacing::Modelled => self.state.work.done(),
            Pacing::Measured => self.state.fraction * self.state.total_work,
        }
    }

    pub fn lost_work(&self) -> f64 {
        self.state.work.lost()
    }

    pub fn total_work(&self) -> f64 {
        self.state.total_work
    }

    /// Units of work the job was submitted with.
    pub fn submitted_work(&self) -> f64 {
        self.state.submitted_work
    }

    /// An instance the engine has not heard of: a restarted broker finds it in its store
    /// (launched after the engine's state was last saved, or ended, to be billed). It joins the
    /// footprint (or the ended, billed) as it is, without an event for the policy.
    pub fn adopt(
        &mut self,
        member: Member,
        ended: Option<(Timestamp, bool)>,
        markets: &TraceMarkets,
    ) {
        let known = self.state.members.iter().any(|m| m.id == member.id)
            || self.state.ended.iter().any(|e| e.member.id == member.id);
        match ended {
            _ if known => {
                // Ended while the engine was not running: its end arrives like any other.
                if let Some((at, by_provider)) = ended
                    && self.state.members.iter().any(|m| m.id == member.id)
                    && !self
                        .state
                        .arrived
                        .ended
                        .iter()
                        .any(|(id, ..)| *id == member.id)
                {
                    self.state.arrived.ended.push((member.id, at, by_provider));
                }
            }
            None => self.state.members.push(member),
            Some((at, by_provider)) => {
                let end = at.max(member.launched_at);
                let by = if by_provider || member.warned.is_some() {
                    EndedBy::Provider
                } else {
                    EndedBy::User
                };
                let cost = self.bill(&member, end, by, markets);
                self.state.ended.push(Ended {
                    member,
                    end,
                    by,
                    cost,
                });
            }
        }
    }

    /// The fraction of the job done.
    pub fn fraction(&self) -> f64 {
        match self.config.pacing {
            Pacing::Measured => self.state.fraction,
            Pacing::Modelled if self.state.work.is_complete(self.state.total_work) => 1.0,
            Pacing::Modelled => (self.state.work.done() / self.state.total_work).min(1.0),
        }
    }

    /// Whether the job's work is done (it may wait for its training to report its end).
    pub fn work_complete(&self) -> bool {
        match self.config.pacing {
            Pacing::Modelled => self.state.work.is_complete(self.state.total_work),
            Pacing::Measured => self.state.training_complete.is_some(),
        }
    }

    /// The work the job's instances delivered up to `until`, every working span under
    /// AgileML's stage rule (what the agents run), and the re-estimated total when there is one.
    pub fn received_work(&self, until: Timestamp) -> f64 {
        let spans: Vec<WorkingSpan> = self
            .state
            .ended
            .iter()
            .filter_map(|e| e.member.span(Some(e.end)))
            .chain(self.state.members.iter().filter_map(|m| m.span(None)))
            .collect();
        let since = spans.iter().map(|s| s.from).min().unwrap_or(until);
        work::work_between(&spans, Some(&self.job.stages), since, until)
    }

    /// Why acquisitions were last held back, if they were.
    pub fn held(&self) -> Option<&str> {
        self.state.held.as_deref()
    }

    /// Every decision with its time (with [`EngineConfig::record_decisions`]).
    pub fn take_decisions(&mut self) -> Vec<(Timestamp, Decision)> {
        std::mem::take(&mut self.decisions)
    }

    /// The spend so far: ended instances as billed, live ones as if the user ended them now.
    pub fn spend(&self, now: Timestamp, markets: &TraceMarkets) -> Usd {
        let ended: Usd = self.state.ended.iter().map(|e| e.cost).sum();
        let live: Usd = self
            .state
            .members
            .iter()
            .map(|m| self.bill(m, now.max(m.launched_at), EndedBy::User, markets))
            .sum();
        ended + live
    }

    /// The next instant after `now` at which the engine acts on its own: the policy's wake-up,
    /// a modelled instance's readiness, a stall's or milestone's end, the modelled work's
    /// completion, a budget look, the deadline. What the world does (warnings, ends) the
    /// driver knows.
    pub fn next_wake(&self, now: Timestamp) -> Option<Timestamp> {
        if self.state.end.is_some() {
            return None;
        }
        let s = &self.state;
        let mut times: Vec<Timestamp> = Vec::new();
        times.extend(s.next_decision);
        times.extend(s.next_budget_look);
        times.extend(self.terms.deadline);
        if self.config.pacing == Pacing::Modelled {
            times.extend(
                s.members
                    .iter()
                    .filter(|m| m.ready.is_none() && !m.releasing)
                    .map(|m| self.ready_at(m)),
            );
            times.extend(s.work.next_change(now));
            times.extend(s.work.completion(now, self.working_rate(now), s.total_work));
        }
        times.into_iter().filter(|&t| t > now).min()
    }

    // ---- the one entry point ----

    /// Applies `input` at `now` and returns what to do, in order. A [`Command::Launch`] is
    /// always last and must be answered (at the same `now`) before anything else is fed.
    pub fn step(
        &mut self,
        now: Timestamp,
        input: Input,
        ctx: &Ctx<'_>,
    ) -> Result<Vec<Command>, EngineError> {
        let mut out = Vec::new();
        let awaiting = self.round.as_ref().is_some_and(|r| r.awaiting.is_some());
        match input {
            Input::Launched { id, at } => {
                let a = self.answer("a launch")?;
                self.state.counts.launches += 1;
                if let Some(round) = &mut self.round {
                    round.committed += a.period;
                }
                self.state.members.push(Member {
                    id,
                    market: a.market,
                    purchase: a.purchase,
                    launched_at: at,
                    rate: a.rate,
                    ready: None,
                    warned: None,
                    terminate_at: None,
                    releasing: false,
                });
            }
            Input::LaunchRefused { reason } => {
                let a = self.answer("a refusal")?;
                self.state.counts.failed_launches += 1;
                if let Some(round) = &mut self.round {
                    round.refused.push((a.market, reason));
                }
            }
            Input::LaunchHeld { reason } => {
                self.answer("a hold")?;
                self.state.held = Some(reason);
                if let Some(round) = &mut self.round {
                    round.acquisitions.pop_front();
                }
            }
            other if awaiting => {
                return Err(EngineError::Unanswered(match other {
                    Input::Tick => "a tick",
                    Input::Ready { .. } => "a readiness",
                    Input::Warned { .. } => "a warning",
                    Input::Ended { .. } => "an end",
                    Input::Progress { .. } => "a progress report",
                    Input::TrainingComplete { .. } | Input::TrainingFailed { .. } => {
                        "the training's end"
                    }
                    _ => "another input",
                }));
            }
            Input::Ready { id, at } => self.state.arrived.ready.push((id, at)),
            Input::Warned {
                id,
                at,
                terminate_at,
            } => self.state.arrived.warned.push((id, at, terminate_at)),
            Input::Ended {
                id,
                at,
                by_provider,
            } => self.state.arrived.ended.push((id, at, by_provider)),
            Input::Progress { fraction } => {
                if self.config.pacing == Pacing::Measured {
                    self.state.fraction = fraction.clamp(0.0, 1.0).max(self.state.fraction);
                }
            }
            Input::TrainingComplete { reason } => {
                self.state.training_complete = Some(reason);
            }
            Input::TrainingFailed { reason } => {
                self.finish(now, Outcome::Failed, reason, &mut out);
            }
            Input::Tick => {
                self.open_instant(now, ctx, &mut out);
            }
        }
        if self.state.end.is_some() {
            // Ends that arrive after the job's end are still billed.
            self.apply_ends(ctx, &mut out);
            self.agenda.clear();
            self.round = None;
            return Ok(out);
        }
        self.drive(now, ctx, &mut out)?;
        Ok(out)
    }

    fn answer(&mut self, what: &'static str) -> Result<Awaiting, EngineError> {
        self.round
            .as_mut()
            .and_then(|r| r.awaiting.take())
            .ok_or(EngineError::UnexpectedAnswer(what))
    }

    // ---- an instant ----

    fn open_instant(&mut self, now: Timestamp, ctx: &Ctx<'_>, out: &mut Vec<Command>) {
        if self.state.end.is_some() {
            return;
        }
        let last = self.state.now.unwrap_or(now);
        let now = now.max(last);
        // 1. The work since the last instant, at the rate that held all along.
        if self.config.pacing == Pacing::Modelled && self.state.now.is_some() {
            let working = self.working_rate(last);
            let ready = self.ready_rate();
            let completion = self
                .state
                .work
                .completion(last, working, self.state.total_work);
            let idle = self.state.work.accrue(last, now, working, ready);
            self.state.overheads.stalled += idle.stalled;
            self.state.overheads.idle += idle.backups_only;
            if completion.is_some_and(|c| now >= c)
                || self.state.work.is_complete(self.state.total_work)
            {
                self.state.work.complete(self.state.total_work);
            }
        }
        self.state.now = Some(now);
        // 2. Completion: nothing more happens to the work once it is done.
        let complete = match self.config.pacing {
            Pacing::Modelled => {
                self.state.work.is_complete(self.state.total_work)
                    && (!self.config.await_training || self.state.training_complete.is_some())
            }
            Pacing::Measured => self.state.training_complete.is_some(),
        };
        if complete {
            let reason = self
                .state
                .training_complete
                .clone()
                .unwrap_or_else(|| "work complete".to_string());
            self.apply_ends(ctx, out);
            self.finish(now, Outcome::Completed, reason, out);
            return;
        }
        let work_done = self.config.pacing == Pacing::Modelled
            && self.state.work.is_complete(self.state.total_work);
        // 3. What arrived: ends, warnings, readiness.
        let mut events = InstantEvents {
            evicted: self.apply_ends(ctx, out),
            ..InstantEvents::default()
        };
        self.apply_warnings(now, &mut events, out, work_done);
        self.apply_readiness(now, &mut events, out, work_done);
        if self.config.pacing == Pacing::Measured {
            self.reestimate(now, out);
        }
        // 4. Budget and deadline.
        if let Some(end) = self.budget_end(now, ctx) {
            self.finish(now, Outcome::Budget, end, out);
            return;
        }
        if let Some(deadline) = self.terms.deadline
            && now >= deadline
        {
            self.finish(
                now,
                Outcome::Deadline,
                format!("deadline {deadline} passed before training completed"),
                out,
            );
            return;
        }
        // 5. The policy: nothing more is bought once the modelled work is done (the job waits
        // for its training to report its end).
        if work_done {
            return;
        }
        let InstantEvents {
            warned,
            evicted,
            ready,
        } = events;
        for (ids, event) in [
            (
                warned,
                PolicyEvent::Warned as fn(Vec<InstanceId>) -> PolicyEvent,
            ),
            (evicted, PolicyEvent::Evicted),
            (ready, PolicyEvent::Ready),
        ] {
            if !ids.is_empty() {
                self.agenda.push_back(Some(event(ids)));
            }
        }
        // The wake-up is judged after the events' answers set it, as the drivers always did.
        self.agenda.push_back(None);
    }

    /// Units per hour the footprint delivers at `at` (0 while the job is down).
    fn working_rate(&self, at: Timestamp) -> f64 {
        let spans = self.current_spans(at);
        self.state.work.working_rate(&spans, &self.job.stages, at)
    }

    /// Units per hour of every ready instance that is held.
    fn ready_rate(&self) -> f64 {
        self.state
            .members
            .iter()
            .filter(|m| m.works())
            .map(|m| m.rate)
            .sum()
    }

    fn current_spans(&self, at: Timestamp) -> Vec<WorkingSpan> {
        self.state
            .members
            .iter()
            .filter(|m| m.works())
            .map(|m| WorkingSpan {
                tier: m.purchase.tier(),
                units_per_hour: m.rate,
                from: at,
                until: None,
            })
            .collect()
    }

    fn ready_at(&self, m: &Member) -> Timestamp {
        m.launched_at.plus_secs(self.job.startup_secs)
    }

    /// Ends that arrived: billed, observed, gone from the footprint. Returns the ids the
    /// provider took.
    fn apply_ends(&mut self, ctx: &Ctx<'_>, out: &mut Vec<Command>) -> Vec<InstanceId> {
        let mut evicted = Vec::new();
        for (id, at, by_provider) in std::mem::take(&mut self.state.arrived.ended) {
            let Some(i) = self.state.members.iter().position(|m| m.id == id) else {
                continue;
            };
            let m = self.state.members.remove(i);
            let end = at.max(m.launched_at);
            // A warned instance that ends was reclaimed, whatever ended it during its notice.
            let by = if by_provider || m.warned.is_some() {
                EndedBy::Provider
            } else {
                EndedBy::User
            };
            if by == EndedBy::Provider && !m.releasing {
                evicted.push(m.id.clone());
            }
            let hours = end.secs_since(m.launched_at) / 3600.0;
            if by == EndedBy::Provider && m.warned.is_none() {
                // Taken without a notice: the interruption is its end.
                out.push(Command::Observe(MarketObservation::Interrupted {
                    market: m.market.clone(),
                    at: end,
                }));
            }
            out.push(Command::Observe(MarketObservation::Ran {
                market: m.market.clone(),
                hours,
            }));
            let ready_at = m.ready.unwrap_or(self.ready_at(&m));
            let o = &mut self.state.overheads;
            o.startup += m.rate * hours.min(self.job.startup_secs / 3600.0);
            if let Some(warned) = m.warned {
                let from = warned.max(ready_at);
                o.warned += m.rate * (end.secs_since(from) / 3600.0).max(0.0);
            }
            let cost = self.bill(&m, end, by, ctx.markets);
            self.state.ended.push(Ended {
                member: m,
                end,
                by,
                cost,
            });
        }
        evicted
    }

    fn apply_warnings(
        &mut self,
        now: Timestamp,
        events: &mut InstantEvents,
        out: &mut Vec<Command>,
        work_done: bool,
    ) {
        let arrived = std::mem::take(&mut self.state.arrived.warned);
        let mut membership_changed = false;
        for (id, at, terminate_at) in arrived {
            let Some(m) = self
                .state
                .members
                .iter_mut()
                .find(|m| m.id == id && m.warned.is_none())
            else {
                continue;
            };
            m.warned = Some(at);
            m.terminate_at = Some(terminate_at);
            let (ready, rate) = (m.ready, m.rate);
            out.push(Command::Observe(MarketObservation::Interrupted {
                market: m.market.clone(),
                at,
            }));
            events.warned.push(id);
            self.state.counts.evictions += 1;
            if !work_done {
                membership_changed |= self.state.work.warned(now, ready, rate);
            }
        }
        if !events.warned.is_empty() {
            self.state.counts.eviction_events += 1;
            if !work_done {
                self.state.work.after_warnings();
            }
        }
        if membership_changed {
            self.state.work.rebalance(now);
        }
    }

    fn apply_readiness(
        &mut self,
        now: Timestamp,
        events: &mut InstantEvents,
        out: &mut Vec<Command>,
        work_done: bool,
    ) {
        let arrived = std::mem::take(&mut self.state.arrived.ready);
        let startup = self.job.startup_secs;
        for m in self.state.members.iter_mut() {
            if m.ready.is_some() || m.releasing {
                continue;
            }
            let at = match self.config.pacing {
                Pacing::Modelled => Some(m.launched_at.plus_secs(startup)).filter(|&t| t <= now),
                Pacing::Measured => arrived
                    .iter()
                    .find(|(id, _)| *id == m.id)
                    .map(|(_, at)| *at),
            };
            if let Some(at) = at {
                // A warned instance still starts up; it works for nothing, its span having
                // ended at the warning.
                m.ready = Some(at);
                events.ready.push(m.id.clone());
                if self.config.pacing == Pacing::Modelled {
                    out.push(Command::MarkReady {
                        id: m.id.clone(),
                        at,
                    });
                }
            }
        }
        if work_done {
            return;
        }
        if !events.ready.is_empty() {
            self.state.work.rebalance(now);
        }
        let any_ready = self.state.members.iter().any(|m| m.works());
        let any_starting = self
            .state
            .members
            .iter()
            .any(|m| m.ready.is_none() && m.is_held());
        self.state.work.milestones(now, any_ready, any_starting);
    }

    /// [`Pacing::Measured`]: the total work re-estimated from the measured rate, recorded when
    /// it moved by more than 10% since the last one recorded.
    fn reestimate(&mut self, now: Timestamp, out: &mut Vec<Command>) {
        let done = self.received_work(now);
        let Some(total) = work::reestimate_total(done, self.state.fraction) else {
            return;
        };
        self.state.total_work = total;
        self.job.total_work = total;
        let moved = self
            .state
            .announced_work
            .is_none_or(|last| (total - last).abs() > 0.1 * last);
        if moved {
            self.state.announced_work = Some(total);
            out.push(Command::Record {
                kind: "work_reestimated",
                detail: format!(
                    "remaining work re-estimated from the measured rate: {total:.3} units in all \
                     (submitted estimate {:.3})",
                    self.state.submitted_work
                ),
            });
        }
    }

    /// At a budget look: why the job must end, if it must.
    fn budget_end(&mut self, now: Timestamp, ctx: &Ctx<'_>) -> Option<String> {
        let budget = self.terms.budget?;
        let look = self.state.next_budget_look?;
        if now < look {
            return None;
        }
        // The next look on the grid from the start.
        let since = now.secs_since(self.terms.started_at).max(0.0);
        let n = (since / BUDGET_LOOK_SECS).floor() + 1.0;
        self.state.next_budget_look = Some(self.terms.started_at.plus_secs(n * BUDGET_LOOK_SECS));
        let spent = self.spend(now, ctx.markets);
        let ahead = self.config.budget_lookahead_secs.max(BUDGET_LOOK_SECS);
        let running_on: Usd = self
            .state
            .members
            .iter()
            .filter(|m| !m.releasing)
            .map(|m| {
                let price = price_now(ctx.markets, &m.market, m.purchase.tier(), now);
                self.terms
                    .billing
                    .cost_of_running_on(price, m.launched_at, now, ahead)
            })
            .sum();
        Budget(budget).ends_job(spent, running_on)
    }

    fn finish(&mut self, now: Timestamp, outcome: Outcome, reason: String, out: &mut Vec<Command>) {
        if self.state.end.is_some() {
            return;
        }
        for m in self.state.members.iter_mut() {
            m.releasing = true;
        }
        let end = JobEnd {
            outcome,
            reason,
            at: now,
        };
        self.state.end = Some(end.clone());
        self.agenda.clear();
        self.round = None;
        out.push(Command::End(end));
    }

    // ---- consultations ----

    /// Works through the agenda until a launch must be answered or nothing is left.
    fn drive(
        &mut self,
        now: Timestamp,
        ctx: &Ctx<'_>,
        out: &mut Vec<Command>,
    ) -> Result<(), EngineError> {
        loop {
            if let Some(round) = &mut self.round {
                if round.awaiting.is_some() {
                    return Ok(());
                }
                if let Some(cmd) = self.next_launch(now, ctx) {
                    out.push(cmd);
                    return Ok(());
                }
                let Some(round) = self.round.take() else {
                    continue;
                };
                if round.retry {
                    if !round.refused.is_empty()
                        && let Some(next) = self.state.next_decision
                    {
                        self.state.next_decision = Some(super::after_refusal(now, next));
                    }
                } else {
                    // The policy hears of each refusal once, before anything else.
                    for (market, reason) in round.refused.into_iter().rev() {
                        self.agenda
                            .push_front(Some(PolicyEvent::LaunchFailed { market, reason }));
                    }
                }
                continue;
            }
            let Some(event) = self.agenda.pop_front() else {
                return Ok(());
            };
            let retry = matches!(event, Some(PolicyEvent::LaunchFailed { .. }));
            if event.is_none() && self.state.next_decision.is_some_and(|t| now < t) {
                continue;
            }
            let decision = self.ask(now, ctx, event.as_ref())?;
            self.state.next_decision = Some(super::next_decision(now, decision.wake_at));
            self.release(now, &decision, out);
            let committed = match self.terms.budget {
                Some(_) => self.spend(now, ctx.markets),
                None => Usd::ZERO,
            };
            self.state.held = None;
            self.round = Some(Round {
                retry,
                acquisitions: decision.acquire.into_iter().collect(),
                refused: Vec::new(),
                committed,
                awaiting: None,
            });
        }
    }

    fn ask(
        &mut self,
        now: Timestamp,
        ctx: &Ctx<'_>,
        event: Option<&PolicyEvent>,
    ) -> Result<Decision, EngineError> {
        let footprint = self.footprint();
        let dctx = DecisionContext {
            market: ctx.view,
            job: &self.job,
            progress: JobProgress {
                done_work: self.done_work(),
                total_work: self.state.total_work,
                started_at: self.terms.started_at,
            },
            footprint: &footprint,
            billing: self.terms.billing,
        };
        self.state.counts.decisions += 1;
        let result = match event {
            None => self.policy.decide(&dctx),
            Some(e) => self.policy.on_event(&dctx, e),
        };
        let decision = result.map_err(|source| EngineError::Policy {
            policy: self.policy.name().to_string(),
            at: now,
            source,
        })?;
        if self.config.record_decisions {
            self.decisions.push((now, decision.clone()));
        }
        Ok(decision)
    }

    /// How the policy sees the footprint: every instance not being released.
    fn footprint(&self) -> Vec<InstanceView> {
        self.state
            .members
            .iter()
            .filter(|m| !m.releasing)
            .map(|m| InstanceView {
                id: m.id.clone(),
                market: m.market.clone(),
                purchase: m.purchase,
                launched_at: m.launched_at,
                state: match (m.terminate_at, m.ready) {
                    (Some(terminate_at), _) => InstanceState::Warned { terminate_at },
                    (None, Some(_)) => InstanceState::Running,
                    (None, None) => InstanceState::Starting {
                        ready_at: self.ready_at(m),
                    },
                },
            })
            .collect()
    }

    fn release(&mut self, now: Timestamp, decision: &Decision, out: &mut Vec<Command>) {
        let mut released_any = false;
        for id in &decision.release {
            if let Some(m) = self
                .state
                .members
                .iter_mut()
                .find(|m| &m.id == id && m.is_held())
            {
                m.releasing = true;
                released_any = true;
                out.push(Command::Release { id: id.clone() });
            }
        }
        if released_any && self.config.pacing == Pacing::Modelled {
            self.state.work.released(now);
        }
    }

    /// The next instance of the round's acquisitions that fits, or `None` when the round is
    /// done.
    fn next_launch(&mut self, now: Timestamp, ctx: &Ctx<'_>) -> Option<Command> {
        let held = self.held_footprint();
        let round = self.round.as_mut()?;
        loop {
            let acq = round.acquisitions.front_mut()?;
            if acq.count == 0 || round.refused.iter().any(|(m, _)| *m == acq.market) {
                round.acquisitions.pop_front();
                continue;
            }
            let rate = self.job.rate(&acq.market.instance_type);
            if self.limits.room(&held, acq.tier(), rate.unwrap_or(0.0), 1) == 0 {
                round.acquisitions.pop_front();
                continue;
            }
            let Some(rate) = rate else {
                self.state.counts.failed_launches += 1;
                let reason = format!("the job does not run on {}", acq.market.instance_type);
                round.refused.push((acq.market.clone(), reason));
                round.acquisitions.pop_front();
                continue;
            };
            let period = match self.terms.budget {
                Some(budget) => {
                    let period = price_now(ctx.markets, &acq.market, acq.tier(), now)
                        .for_hours(self.terms.billing.billed_hours(0.0));
                    if let Some(reason) = Budget(budget).holds_launch(round.committed, period) {
                        self.state.held = Some(reason);
                        round.acquisitions.pop_front();
                        continue;
                    }
                    period
                }
                None => Usd::ZERO,
            };
            acq.count -= 1;
            let (market, purchase) = (acq.market.clone(), acq.purchase);
            round.awaiting = Some(Awaiting {
                market: market.clone(),
                purchase,
                rate,
                period,
            });
            return Some(Command::Launch { market, purchase });
        }
    }

    fn held_footprint(&self) -> Held {
        let mut held = Held::default();
        for m in self.state.members.iter().filter(|m| m.is_held()) {
            held.add(m.purchase.tier(), m.rate);
        }
        held
    }

    fn bill(&self, m: &Member, end: Timestamp, by: EndedBy, markets: &TraceMarkets) -> Usd {
        let source = match m.purchase {
            Purchase::OnDemand => markets.on_demand(&m.market).map(PriceSource::Fixed),
            Purchase::Spot { .. } => markets.series(&m.market).map(PriceSource::Spot),
        };
        let Some(source) = source else {
            return Usd::ZERO;
        };
        self.terms
            .billing
            .bill(m.launched_at, end, by, source)
            .map(|items| items.iter().map(|i| i.amount_usd).sum())
            .unwrap_or(Usd::ZERO)
    }
}

/// What an hour of `market` on `tier` costs at `now`: its on-demand price, or the spot price.
pub fn price_now(
    markets: &TraceMarkets,
    market: &Market,
    tier: Tier,
    now: Timestamp,
) -> UsdPerHour {
    match tier {
        Tier::Reliable => markets.on_demand(market),
        Tier::Transient => markets.series(market).and_then(|s| s.price_at(now)),
    }
    .unwrap_or(UsdPerHour::ZERO)
}
