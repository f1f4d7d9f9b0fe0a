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
    Policy, PolicyError, PolicyEvent, Purchase, ReplaceAt,
};
use proteus_wire::{InstanceId, Tier};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, VecDeque};
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

/// How far ahead (market seconds, at least) the engine looks when it checks a job's budget,
/// and, under `per-second` billing, how often it checks. The job ends at the first look at
/// which the spend plus what the next `BUDGET_LOOK_SECS` would add passes the budget. Looks
/// come at instants the engine fixes, whatever else wakes a driver, so that every driver looks
/// at the same instants: under `hourly-2015` just before each instance's next billing hour
/// (`BUDGET_LOOK_SECS` before it: only a new hour can take the spend past the budget), under
/// `per-second` on a grid every `BUDGET_LOOK_SECS` from the job's start.
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
    /// Whether the job's spec estimates its work (`work.total_work`). Under
    /// [`Pacing::Measured`], a job without an estimate holds at most [`PROBE_INSTANCES`]
    /// until its work is measured, rather than sizing a large footprint on a default guess.
    pub estimated: bool,
}

/// Instances at most, under [`Pacing::Measured`], of a job whose spec gives no work estimate,
/// until its total is re-estimated from measured progress (see [`work::reestimate_total`]).
pub const PROBE_INSTANCES: u32 = 2;

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
    /// Being replaced by this instance (make before break, [`Decision::replace`]): it works on
    /// until that one is ready, and is released then; meanwhile it does not count against the
    /// limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_by: Option<InstanceId>,
}

impl Member {
    /// Not warned, not being released: it works once ready, and the policy sees it.
    fn is_held(&self) -> bool {
        self.warned.is_none() && !self.releasing
    }

    /// Held against the limits: held, and not being replaced.
    fn counts(&self) -> bool {
        self.is_held() && self.replaced_by.is_none()
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
    /// When the budget was last checked.
    budget_looked_at: Option<Timestamp>,
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
    lost: Vec<InstanceId>,
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
    /// A launch the budget held back: what was committed then, and what it would have added.
    budget_hold: Option<(Usd, Usd)>,
    awaiting: Option<Awaiting>,
    /// Instances the round's launches replace, in order ([`Decision::replace`]).
    replacing: VecDeque<InstanceId>,
    /// When they go ([`Decision::replace_at`]).
    replace_at: ReplaceAt,
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
    /// Markets whose refusal the policy has been told of at this instant: a refusal in a
    /// consultation about a refusal is told only if its market is new, so a policy can fail
    /// over through several pools at one instant but cannot make the engine spin.
    told: (Option<Timestamp>, BTreeSet<Market>),
    decisions: Vec<(Timestamp, Decision)>,
    /// How the policy sees the footprint: every instance not being released.
    footprint: Vec<InstanceView>,
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
            budget_looked_at: None,
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
            told: (None, BTreeSet::new()),
            decisions: Vec::new(),
            footprint: Vec::new(),
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
        // From +0.0: an empty sum is -0.0, which would print as "$-0.00".
        Usd::ZERO + ended + live
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
        let mut next: Option<Timestamp> = None;
        let mut consider = |t: Option<Timestamp>| {
            if let Some(t) = t.filter(|&t| t > now) {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        consider(s.next_decision);
        consider(self.next_budget_look(now));
        consider(self.terms.deadline);
        if self.config.pacing == Pacing::Modelled {
            // A readiness due now (an instance launched at this instant that starts at once)
            // is a wake-up now: until the instant is opened again it would count as neither
            // working nor starting.
            let ready_now = s
                .members
                .iter()
                .any(|m| m.ready.is_none() && !m.releasing && self.ready_at(m) == now);
            if ready_now {
                return Some(now);
            }
            for m in s
                .members
                .iter()
                .filter(|m| m.ready.is_none() && !m.releasing)
            {
                consider(Some(self.ready_at(m)));
            }
            consider(s.work.next_change(now));
            consider(s.work.completion(now, self.working_rate(now), s.total_work));
        }
        next
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
                let replaces = self
                    .round
                    .as_mut()
                    .and_then(|r| Some((r.replacing.pop_front()?, r.replace_at)));
                if let Some((old, when)) = replaces
                    && let Some(m) = self
                        .state
                        .members
                        .iter_mut()
                        .find(|m| m.id == old && m.is_held() && m.replaced_by.is_none())
                {
                    match when {
                        ReplaceAt::Ready => m.replaced_by = Some(id.clone()),
                        ReplaceAt::Launch => {
                            m.releasing = true;
                            out.push(Command::Release { id: old });
                            if self.config.pacing == Pacing::Modelled {
                                self.state.work.released(at);
                            }
                        }
                    }
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
                    replaced_by: None,
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
            if self.config.pacing == Pacing::Measured {
                // The last re-estimate, at the whole work: the total is what was done.
                self.reestimate(now, out);
            }
            self.finish(now, Outcome::Completed, reason, out);
            return;
        }
        let work_done = self.config.pacing == Pacing::Modelled
            && self.state.work.is_complete(self.state.total_work);
        // 3. What arrived: ends, warnings, readiness.
        let (evicted, lost) = self.apply_ends(ctx, out);
        let mut events = InstantEvents {
            evicted,
            lost,
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
            lost,
            ready,
        } = events;
        for (ids, event) in [
            (
                warned,
                PolicyEvent::Warned as fn(Vec<InstanceId>) -> PolicyEvent,
            ),
            (evicted, PolicyEvent::Evicted),
            (lost, PolicyEvent::Lost),
            (ready, PolicyEvent::Ready),
        ] {
            if !ids.is_empty() {
                self.agenda.push_back(Some(event(ids)));
            }
        }
        // The wake-up is judged after the events' answers set it, as the drivers always did.
        self.agenda.push_back(None);
    }

    /// Units per hour the footprint delivers now (0 while the job is down). Between two
    /// instants the footprint is constant: drivers step onto every change.
    fn working_rate(&self, _at: Timestamp) -> f64 {
        self.state.work.working_rate_of(
            self.state
                .members
                .iter()
                .filter(|m| m.works())
                .map(|m| (m.purchase.tier(), m.rate)),
            &self.job.stages,
        )
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

    fn ready_at(&self, m: &Member) -> Timestamp {
        m.launched_at.plus_secs(self.job.startup_secs)
    }

    /// Ends that arrived: billed, observed, gone from the footprint. Returns the ids the
    /// provider took, and those that ended unasked otherwise (terminated by someone else,
    /// failed, gone from the cloud's list): the policy hears of both at once, so that the
    /// footprint they leave short is made up now, not at the next scheduled decision.
    fn apply_ends(
        &mut self,
        ctx: &Ctx<'_>,
        out: &mut Vec<Command>,
    ) -> (Vec<InstanceId>, Vec<InstanceId>) {
        let mut evicted = Vec::new();
        let mut lost = Vec::new();
        for (id, at, by_provider) in std::mem::take(&mut self.state.arrived.ended) {
            let Some(i) = self.state.members.iter().position(|m| m.id == id) else {
                continue;
            };
            let m = self.state.members.remove(i);
            // Its replacement is gone before it was ready: the instance it was to replace stays.
            self.keep_replaced(&m.id);
            let end = at.max(m.launched_at);
            // A warned instance that ends was reclaimed, whatever ended it during its notice.
            let by = if by_provider || m.warned.is_some() {
                EndedBy::Provider
            } else {
                EndedBy::User
            };
            match by {
                _ if m.releasing => {}
                EndedBy::Provider => evicted.push(m.id.clone()),
                EndedBy::User => lost.push(m.id.clone()),
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
            // Up to the readiness as the clock has it (to the millisecond), as the work counts.
            o.startup += m.rate * (end.min(ready_at).secs_since(m.launched_at) / 3600.0).max(0.0);
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
        (evicted, lost)
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
            let releasing = m.releasing;
            self.keep_replaced(&id);
            let Some(m) = self.state.members.iter_mut().find(|m| m.id == id) else {
                continue;
            };
            if releasing {
                // Warned while its release is on its way: it no longer works for the job, so the
                // warning costs no work and is not the policy's business; it is only billed as
                // reclaimed (its last partial hour free).
                continue;
            }
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
        // Make before break: an instance whose replacement is ready goes now.
        let mut released_any = false;
        for new in &events.ready {
            for m in self.state.members.iter_mut() {
                if m.replaced_by.as_ref() == Some(new) && m.is_held() {
                    m.releasing = true;
                    released_any = true;
                    out.push(Command::Release { id: m.id.clone() });
                }
            }
        }
        if released_any && self.config.pacing == Pacing::Modelled {
            self.state.work.released(now);
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

    fn budget_ahead(&self) -> f64 {
        self.config.budget_lookahead_secs.max(BUDGET_LOOK_SECS)
    }

    /// The first budget look after `after` (see [`BUDGET_LOOK_SECS`]).
    fn next_budget_look(&self, after: Timestamp) -> Option<Timestamp> {
        self.terms.budget?;
        match self.terms.billing {
            BillingModel::Hourly2015 => {
                let ahead = self.budget_ahead();
                self.state
                    .members
                    .iter()
                    .filter(|m| !m.releasing)
                    .map(|m| {
                        let hour = self
                            .terms
                            .billing
                            .period_end(m.launched_at, after.plus_secs(ahead));
                        Timestamp::from_millis(hour.millis() - (ahead * 1000.0) as i64)
                    })
                    .min()
            }
            BillingModel::PerSecond => {
                let since = after.secs_since(self.terms.started_at);
                let n = if since < 0.0 {
                    0.0
                } else {
                    (since / BUDGET_LOOK_SECS).floor() + 1.0
                };
                Some(self.terms.started_at.plus_secs(n * BUDGET_LOOK_SECS))
            }
        }
    }

    /// At a budget look: why the job must end, if it must.
    fn budget_end(&mut self, now: Timestamp, ctx: &Ctx<'_>) -> Option<String> {
        let budget = self.terms.budget?;
        let since = self
            .state
            .budget_looked_at
            .unwrap_or(Timestamp::from_millis(self.terms.started_at.millis() - 1));
        if self.next_budget_look(since).is_none_or(|look| look > now) {
            return None;
        }
        self.state.budget_looked_at = Some(now);
        let spent = self.spend(now, ctx.markets);
        // A millisecond past the horizon: the hour that starts right at it counts (a look comes
        // exactly `ahead` before an hour boundary).
        let ahead = self.budget_ahead() + 0.001;
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
                // A job that holds nothing and cannot afford what it asks for would wait for
                // ever: it ends at its budget.
                if let (Some((committed, period)), Some(budget)) =
                    (round.budget_hold, self.terms.budget)
                    && !self.state.members.iter().any(|m| !m.releasing)
                {
                    let reason = format!(
                        "budget too small to go on: ${:.2} spent of ${:.2}, the job holds no \
                         instance, and the launch asked for would commit ${:.2} more",
                        committed.get(),
                        budget.get(),
                        period.get()
                    );
                    self.finish(now, Outcome::Budget, reason, out);
                    return Ok(());
                }
                if self.told.0 != Some(now) {
                    self.told = (Some(now), BTreeSet::new());
                }
                let any_refused = !round.refused.is_empty();
                let fresh: Vec<(Market, String)> = round
                    .refused
                    .into_iter()
                    .filter(|(m, _)| !round.retry || self.told.1.insert(m.clone()))
                    .collect();
                if round.retry && fresh.is_empty() {
                    if any_refused && let Some(next) = self.state.next_decision {
                        self.state.next_decision = Some(super::after_refusal(now, next));
                    }
                } else {
                    // The policy hears of each refusal once, before anything else.
                    for (market, reason) in fresh.into_iter().rev() {
                        self.told.1.insert(market.clone());
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
            // What the policy expected of each thing it does, in the job's history.
            for reason in &decision.reasons {
                out.push(Command::Record {
                    kind: "decision",
                    detail: format!("{}: {reason}", self.policy.name()),
                });
            }
            self.release(now, &decision, out);
            let committed = match self.terms.budget {
                Some(_) => self.spend(now, ctx.markets),
                None => Usd::ZERO,
            };
            self.state.held = None;
            let replacing = decision
                .replace
                .iter()
                .filter(|id| {
                    self.state
                        .members
                        .iter()
                        .any(|m| m.id == **id && m.is_held() && m.replaced_by.is_none())
                })
                .cloned()
                .collect();
            self.round = Some(Round {
                retry,
                acquisitions: decision.acquire.into_iter().collect(),
                refused: Vec::new(),
                committed,
                budget_hold: None,
                awaiting: None,
                replacing,
                replace_at: decision.replace_at,
            });
        }
    }

    fn ask(
        &mut self,
        now: Timestamp,
        ctx: &Ctx<'_>,
        event: Option<&PolicyEvent>,
    ) -> Result<Decision, EngineError> {
        self.footprint();
        let dctx = DecisionContext {
            market: ctx.view,
            job: &self.job,
            progress: JobProgress {
                done_work: self.done_work(),
                total_work: self.state.total_work,
                started_at: self.terms.started_at,
                deadline: self.terms.deadline,
            },
            footprint: &self.footprint,
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
    fn footprint(&mut self) {
        let views = self.state.members.iter().filter(|m| !m.releasing).map(|m| {
            let state = match (m.terminate_at, m.ready) {
                (Some(terminate_at), _) => InstanceState::Warned { terminate_at },
                (None, Some(_)) => InstanceState::Running,
                (None, None) => InstanceState::Starting {
                    ready_at: m.launched_at.plus_secs(self.job.startup_secs),
                },
            };
            (m, state)
        });
        // Kept between consultations (a policy is asked far more often than the footprint
        // changes): rebuilt only when it no longer matches, which costs no allocation to check.
        let current = views.clone().count() == self.footprint.len()
            && views
                .clone()
                .zip(&self.footprint)
                .all(|((m, state), v)| v.id == m.id && v.state == state);
        if !current {
            self.footprint = views
                .map(|(m, state)| InstanceView {
                    id: m.id.clone(),
                    market: m.market.clone(),
                    purchase: m.purchase,
                    launched_at: m.launched_at,
                    state,
                })
                .collect();
        }
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
        let probing = self.probing();
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
            if probing && held.instances >= PROBE_INSTANCES {
                self.state.held = Some(format!(
                    "launches held: at most {PROBE_INSTANCES} instances until the job's work is \
                     measured (its spec gives no `work.total_work`)"
                ));
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
                        round.budget_hold = Some((round.committed, period));
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

    /// Whether the job is still sizing itself on a default estimate ([`PROBE_INSTANCES`]).
    fn probing(&self) -> bool {
        self.config.pacing == Pacing::Measured
            && !self.terms.estimated
            && self.state.total_work == self.state.submitted_work
    }

    /// The replacement `id` will not come: the instance it was to replace counts again.
    fn keep_replaced(&mut self, id: &InstanceId) {
        for m in self.state.members.iter_mut() {
            if m.replaced_by.as_ref() == Some(id) {
                m.replaced_by = None;
            }
        }
    }

    /// What counts against the limits: held instances, but not those being replaced, nor those
    /// this round's next launches are to replace.
    fn held_footprint(&self) -> Held {
        let mut held = Held::default();
        let pending = self.round.as_ref().map(|r| &r.replacing);
        for m in self
            .state
            .members
            .iter()
            .filter(|m| m.counts() && !pending.is_some_and(|p| p.contains(&m.id)))
        {
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

#[cfg(test)]
mod tests {
    //! The engine's rules, each pinned by a driver written here: a scripted policy (it answers
    //! with queued decisions, or keeps a number of instances in a market, and records every
    //! question) over a two-market trace with constant prices.

    use super::*;
    use crate::engine::view::{FutureReads, TraceView};
    use crate::engine::{NOTICE_SECS, RETRY_AFTER_REFUSAL_SECS};
    use crate::job::{EvictionCost, WorkModelSpec};
    use crate::market::{InstanceType, Region};
    use crate::market_model::{MarketModel, PriceDrivenModel, PriceModelConfig};
    use crate::policy::PolicyKind;
    use crate::prices::{InstanceOffer, OnDemandCatalog, PriceHistory, PriceSeries};
    use std::sync::{Arc, Mutex};

    /// 2015-01-01T00:00:00Z.
    const T0_MS: i64 = 1_420_070_400_000;
    const A: &str = "us-east-1a/c3.xlarge";
    const B: &str = "us-east-1b/c3.xlarge";
    const SPOT_A: f64 = 0.05;
    const SPOT_B: f64 = 0.06;
    const ON_DEMAND: f64 = 0.21;

    fn t0() -> Timestamp {
        Timestamp::from_millis(T0_MS)
    }

    /// `secs` after [`t0`].
    fn at(secs: f64) -> Timestamp {
        t0().plus_secs(secs)
    }

    fn market(name: &str) -> Market {
        Market::parse(name).unwrap()
    }

    fn usd(v: f64) -> Usd {
        Usd::new(v).unwrap()
    }

    fn spot(bid: f64) -> Purchase {
        Purchase::Spot {
            bid: UsdPerHour::new(bid).unwrap(),
        }
    }

    fn acquire(name: &str, purchase: Purchase, count: u32) -> Acquisition {
        Acquisition {
            market: market(name),
            purchase,
            count,
        }
    }

    fn id(n: u32) -> InstanceId {
        InstanceId(format!("i-{n}"))
    }

    /// Two c3.xlarge markets whose spot prices never change (A at 0.05, B at 0.06), priced
    /// from a day before [`t0`].
    struct World {
        markets: TraceMarkets,
        model: Box<dyn MarketModel>,
    }

    impl World {
        fn new() -> Self {
            let since = Timestamp::from_millis(T0_MS - 86_400_000);
            let series = [(A, SPOT_A), (B, SPOT_B)]
                .into_iter()
                .map(|(m, p)| {
                    PriceSeries::new(market(m), vec![(since, UsdPerHour::new(p).unwrap())])
                })
                .collect::<Vec<_>>();
            let od = OnDemandCatalog::new([InstanceOffer {
                region: Region::parse("us-east-1").unwrap(),
                instance_type: InstanceType::parse("c3.xlarge").unwrap(),
                vcpus: None,
                memory_gib: None,
                on_demand: UsdPerHour::new(ON_DEMAND).unwrap(),
            }]);
            let history = Arc::new(PriceHistory::new(series, od));
            World {
                markets: TraceMarkets::new(history.clone()),
                model: Box::new(PriceDrivenModel::new(history, PriceModelConfig::default())),
            }
        }

        /// One step, with the view at `now` (built as the simulator builds it).
        fn step(
            &self,
            engine: &mut JobEngine<'_>,
            now: Timestamp,
            input: Input,
        ) -> Result<Vec<Command>, EngineError> {
            let view = TraceView::new(now, &self.markets, self.model.as_ref(), FutureReads::Panic);
            let ctx = Ctx {
                view: &view,
                markets: &self.markets,
            };
            engine.step(now, input, &ctx)
        }

        /// Feeds `input`, then answers every launch with `answer`; every command, in order.
        fn feed(
            &self,
            engine: &mut JobEngine<'_>,
            now: Timestamp,
            input: Input,
            answer: &mut dyn FnMut(Timestamp, &Market, Purchase) -> Input,
        ) -> Vec<Command> {
            let mut out = Vec::new();
            let mut next = Some(input);
            while let Some(input) = next.take() {
                let commands = self.step(engine, now, input).unwrap();
                assert!(
                    commands
                        .iter()
                        .position(|c| matches!(c, Command::Launch { .. }))
                        .is_none_or(|i| i + 1 == commands.len()),
                    "a launch is always the last command: {commands:?}"
                );
                if let Some(Command::Launch { market, purchase }) = commands.last() {
                    next = Some(answer(now, market, *purchase));
                }
                out.extend(commands);
            }
            out
        }

        /// What the simulator does once the job ended: every instance it holds ends, by the user.
        fn end_all(&self, engine: &mut JobEngine<'_>, now: Timestamp) {
            let ids: Vec<InstanceId> = engine.members().iter().map(|m| m.id.clone()).collect();
            for id in ids {
                self.step(
                    engine,
                    now,
                    Input::Ended {
                        id,
                        at: now,
                        by_provider: false,
                    },
                )
                .unwrap();
            }
        }
    }

    /// Answers every launch: running, as `i-1`, `i-2`, … from `next`.
    fn accept_from(mut next: u32) -> impl FnMut(Timestamp, &Market, Purchase) -> Input {
        move |now, _, _| {
            next += 1;
            Input::Launched {
                id: id(next - 1),
                at: now,
            }
        }
    }

    fn accept() -> impl FnMut(Timestamp, &Market, Purchase) -> Input {
        accept_from(1)
    }

    fn launches(commands: &[Command]) -> Vec<Market> {
        commands
            .iter()
            .filter_map(|c| match c {
                Command::Launch { market, .. } => Some(market.clone()),
                _ => None,
            })
            .collect()
    }

    fn ends(commands: &[Command]) -> Vec<JobEnd> {
        commands
            .iter()
            .filter_map(|c| match c {
                Command::End(e) => Some(e.clone()),
                _ => None,
            })
            .collect()
    }

    /// One question the policy was asked.
    #[derive(Debug, Clone)]
    struct Asked {
        at: Timestamp,
        event: Option<PolicyEvent>,
        footprint: Vec<InstanceView>,
    }

    #[derive(Default)]
    struct Script {
        /// Answered first, in order.
        queue: VecDeque<Decision>,
        /// Once the queue is empty: keep this many active instances in the market (what the
        /// real policies do: they ask for what they want given the footprint).
        keep: Option<(Market, Purchase, u32)>,
        /// The wake-up every answer from `keep` (or an empty queue) asks for.
        wake_at: Option<Timestamp>,
        asked: Vec<Asked>,
    }

    /// A policy whose answers the test writes; clones share the script.
    #[derive(Clone, Default)]
    struct Scripted(Arc<Mutex<Script>>);

    impl Scripted {
        fn push(&self, decision: Decision) {
            self.0.lock().unwrap().queue.push_back(decision);
        }

        fn keep(&self, name: &str, purchase: Purchase, n: u32, wake_at: Option<Timestamp>) {
            let mut s = self.0.lock().unwrap();
            s.keep = Some((market(name), purchase, n));
            s.wake_at = wake_at;
        }

        fn asked(&self) -> Vec<Asked> {
            self.0.lock().unwrap().asked.clone()
        }

        fn answer(&self, ctx: &DecisionContext<'_>, event: Option<&PolicyEvent>) -> Decision {
            let mut s = self.0.lock().unwrap();
            s.asked.push(Asked {
                at: ctx.now(),
                event: event.cloned(),
                footprint: ctx.footprint.to_vec(),
            });
            if let Some(d) = s.queue.pop_front() {
                return d;
            }
            let mut d = Decision {
                wake_at: s.wake_at,
                ..Decision::default()
            };
            if let Some((m, purchase, n)) = s.keep.clone() {
                let active = ctx
                    .footprint
                    .iter()
                    .filter(|i| i.is_active() && i.market == m)
                    .count() as u32;
                if active < n {
                    d.acquire.push(Acquisition {
                        market: m,
                        purchase,
                        count: n - active,
                    });
                }
            }
            d
        }
    }

    impl Policy for Scripted {
        fn name(&self) -> &str {
            "scripted"
        }
        fn kind(&self) -> PolicyKind {
            PolicyKind::BidBrain
        }
        fn eviction_cost(&self, job: &JobModel) -> EvictionCost {
            job.eviction_cost
        }
        fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
            Ok(self.answer(ctx, None))
        }
        fn on_event(
            &mut self,
            ctx: &DecisionContext<'_>,
            event: &PolicyEvent,
        ) -> Result<Decision, PolicyError> {
            Ok(self.answer(ctx, Some(event)))
        }
    }

    /// A c3.xlarge job (one unit per instance-hour unless `extra` sets a throughput).
    fn job(
        w: &World,
        total_work: f64,
        max_instances: u32,
        startup_minutes: f64,
        extra: &str,
    ) -> JobModel {
        let spec = format!(
            "total_work = {total_work}\nreference_type = \"c3.xlarge\"\n\
             instance_types = [\"c3.xlarge\"]\nmax_instances = {max_instances}\n\
             startup_minutes = {startup_minutes}\n{extra}"
        );
        WorkModelSpec::parse("job.toml", &spec)
            .unwrap()
            .resolve(
                "job.toml",
                w.markets.history().on_demand(),
                &Region::parse("us-east-1").unwrap(),
            )
            .unwrap()
    }

    fn terms(budget: Option<f64>, deadline: Option<Timestamp>) -> JobTerms {
        JobTerms {
            estimated: true,
            billing: BillingModel::Hourly2015,
            budget: budget.map(usd),
            deadline,
            started_at: t0(),
        }
    }

    fn engine(job: JobModel, policy: &Scripted, terms: JobTerms) -> JobEngine<'static> {
        JobEngine::new(
            job,
            Box::new(policy.clone()),
            EngineConfig::new(Pacing::Modelled),
            terms,
        )
    }

    /// Ticks at every wake-up after `*now` up to `until` (or the job's end), answering launches;
    /// every tick's time and commands.
    fn run_until(
        w: &World,
        e: &mut JobEngine<'_>,
        now: &mut Timestamp,
        until: Timestamp,
        answer: &mut dyn FnMut(Timestamp, &Market, Purchase) -> Input,
    ) -> Vec<(Timestamp, Vec<Command>)> {
        let mut ticks = Vec::new();
        while e.end().is_none() {
            let Some(t) = e.next_wake(*now) else { break };
            if t > until {
                break;
            }
            assert!(t > *now, "a wake-up after now: {t} after {now}");
            *now = t;
            ticks.push((t, w.feed(e, t, Input::Tick, answer)));
        }
        ticks
    }

    // ---- 1. launches are answered first ----

    #[test]
    fn a_launch_must_be_answered_before_anything_else() {
        let w = World::new();
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 2)],
            ..Decision::default()
        });
        let mut e = engine(job(&w, 100.0, 8, 5.0, ""), &policy, terms(None, None));
        // Nothing asked yet: an answer is unexpected, whichever it is.
        for answer in [
            Input::Launched {
                id: id(9),
                at: t0(),
            },
            Input::LaunchRefused {
                reason: "no".into(),
            },
            Input::LaunchHeld {
                reason: "no".into(),
            },
        ] {
            assert!(
                matches!(
                    w.step(&mut e, t0(), answer.clone()),
                    Err(EngineError::UnexpectedAnswer(_))
                ),
                "{answer:?} with nothing asked"
            );
        }
        assert!(e.members().is_empty());

        let out = w.step(&mut e, t0(), Input::Tick).unwrap();
        assert_eq!(launches(&out), vec![market(A)], "one launch at a time");
        assert!(
            matches!(out.last(), Some(Command::Launch { .. })),
            "{out:?}"
        );
        // Anything but the answer is refused, and changes nothing.
        for input in [
            Input::Tick,
            Input::Warned {
                id: id(9),
                at: t0(),
                terminate_at: at(NOTICE_SECS),
            },
            Input::Ended {
                id: id(9),
                at: t0(),
                by_provider: true,
            },
            Input::TrainingFailed {
                reason: "boom".into(),
            },
        ] {
            assert!(
                matches!(
                    w.step(&mut e, t0(), input.clone()),
                    Err(EngineError::Unanswered(_))
                ),
                "{input:?} while a launch is asked"
            );
        }
        assert!(e.end().is_none(), "the refused failure did not end the job");
        // The answer still goes through, and the next launch follows.
        let out = w
            .step(
                &mut e,
                t0(),
                Input::Launched {
                    id: id(1),
                    at: t0(),
                },
            )
            .unwrap();
        assert_eq!(launches(&out), vec![market(A)]);
        let out = w
            .step(
                &mut e,
                t0(),
                Input::Launched {
                    id: id(2),
                    at: t0(),
                },
            )
            .unwrap();
        assert!(launches(&out).is_empty(), "{out:?}");
        assert_eq!(e.members().len(), 2);
        assert_eq!(e.counts().launches, 2);
        // Answered twice: the second answer is unexpected.
        assert!(matches!(
            w.step(
                &mut e,
                t0(),
                Input::Launched {
                    id: id(3),
                    at: t0()
                }
            ),
            Err(EngineError::UnexpectedAnswer(_))
        ));
        assert_eq!(e.members().len(), 2);
        assert_eq!(e.counts().launches, 2);
    }

    // ---- 2. limits ----

    #[test]
    fn without_an_estimate_a_measured_job_holds_two_instances_until_its_work_is_measured() {
        let w = World::new();
        let policy = Scripted::default();
        let ask = || Decision {
            acquire: vec![acquire(A, spot(0.10), 5)],
            ..Decision::default()
        };
        policy.push(ask());
        let unestimated = JobTerms {
            estimated: false,
            ..terms(None, None)
        };
        let mut e = JobEngine::new(
            job(&w, 100.0, 8, 5.0, ""),
            Box::new(policy.clone()),
            EngineConfig::new(Pacing::Measured),
            unestimated,
        );
        let out = w.feed(&mut e, t0(), Input::Tick, &mut accept());
        assert_eq!(launches(&out).len(), 2, "{out:?}");
        assert_eq!(e.members().len(), 2);
        assert!(
            e.held()
                .is_some_and(|h| h.contains("until the job's work is measured")),
            "{:?}",
            e.held()
        );
        // Both agents join; an hour later a tenth of the job is done: the total is measured.
        for n in 1..=2 {
            w.step(
                &mut e,
                at(60.0),
                Input::Ready {
                    id: id(n),
                    at: at(60.0),
                },
            )
            .unwrap();
        }
        w.step(&mut e, at(3600.0), Input::Progress { fraction: 0.1 })
            .unwrap();
        policy.push(ask());
        let out = w.feed(&mut e, at(3600.0), Input::Tick, &mut accept_from(3));
        assert_ne!(e.total_work(), 100.0, "re-estimated from the measured rate");
        assert!(!launches(&out).is_empty(), "no longer held back: {out:?}");
        assert!(e.members().len() > 2);

        // With an estimate in the spec, the policy's footprint is bought at once.
        let policy = Scripted::default();
        policy.push(ask());
        let mut e = JobEngine::new(
            job(&w, 100.0, 8, 5.0, ""),
            Box::new(policy.clone()),
            EngineConfig::new(Pacing::Measured),
            terms(None, None),
        );
        let out = w.feed(&mut e, t0(), Input::Tick, &mut accept());
        assert_eq!(launches(&out).len(), 5, "{out:?}");
    }

    #[test]
    fn max_instances_bounds_the_launches_of_a_decision() {
        let w = World::new();
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 5)],
            ..Decision::default()
        });
        let mut e = engine(job(&w, 100.0, 3, 5.0, ""), &policy, terms(None, None));
        let mut out = w.step(&mut e, t0(), Input::Tick).unwrap();
        for n in 1..=3 {
            assert_eq!(launches(&out), vec![market(A)], "launch {n}: {out:?}");
            out = w
                .step(
                    &mut e,
                    t0(),
                    Input::Launched {
                        id: id(n),
                        at: t0(),
                    },
                )
                .unwrap();
        }
        assert!(launches(&out).is_empty(), "a fourth launch: {out:?}");
        assert_eq!(e.members().len(), 3);
        assert_eq!(e.counts().launches, 3);
        assert_eq!(e.counts().failed_launches, 0, "a limit is not a refusal");

        // The next consultation asks for five more: the footprint is full.
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 5)],
            ..Decision::default()
        });
        let asked = policy.asked().len();
        let out = w.feed(&mut e, at(200.0), Input::Tick, &mut accept_from(4));
        let out2 = w.feed(&mut e, at(600.0), Input::Tick, &mut accept_from(4));
        assert!(policy.asked().len() > asked, "the policy was asked again");
        assert!(launches(&out).is_empty() && launches(&out2).is_empty());
        assert_eq!(e.members().len(), 3);

        // A warned instance is leaving: it no longer holds a place, so one replacement fits.
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 5)],
            ..Decision::default()
        });
        w.step(
            &mut e,
            at(700.0),
            Input::Warned {
                id: id(1),
                at: at(700.0),
                terminate_at: at(700.0 + NOTICE_SECS),
            },
        )
        .unwrap();
        let out = w.feed(&mut e, at(700.0), Input::Tick, &mut accept_from(4));
        assert_eq!(launches(&out), vec![market(A)], "{out:?}");
        assert_eq!(e.members().len(), 4, "three held and one warned");
    }

    // ---- 3. refusals ----

    /// A decision for 3 × A then 1 × B; A refuses. The answer to the refusal (one B, waking in
    /// three hours) is refused if `refuse_retry`; then the policy, told of B's refusal (a pool it
    /// had not heard of at this instant), asks for B again, and that is refused too. Returns
    /// the engine and its policy.
    fn refusal(w: &World, refuse_retry: bool) -> (JobEngine<'static>, Scripted, Vec<Command>) {
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 3), acquire(B, spot(0.10), 1)],
            ..Decision::default()
        });
        policy.push(Decision {
            acquire: vec![acquire(B, spot(0.10), 1)],
            wake_at: Some(at(3.0 * 3600.0)),
            ..Decision::default()
        });
        if refuse_retry {
            policy.push(Decision {
                acquire: vec![acquire(B, spot(0.10), 1)],
                wake_at: Some(at(3.0 * 3600.0)),
                ..Decision::default()
            });
        }
        // Start-up takes half an hour: readiness is no early wake-up.
        let mut e = engine(job(w, 100.0, 8, 30.0, ""), &policy, terms(None, None));
        let mut all = Vec::new();
        let out = w.step(&mut e, t0(), Input::Tick).unwrap();
        assert_eq!(launches(&out), vec![market(A)]);
        all.extend(out);
        let out = w
            .step(
                &mut e,
                t0(),
                Input::LaunchRefused {
                    reason: "no capacity in A".into(),
                },
            )
            .unwrap();
        assert_eq!(
            launches(&out),
            vec![market(B)],
            "A is not asked again in this decision; B still launches"
        );
        all.extend(out);
        let out = w
            .step(
                &mut e,
                t0(),
                Input::Launched {
                    id: id(1),
                    at: t0(),
                },
            )
            .unwrap();
        assert_eq!(launches(&out), vec![market(B)], "the answer to the refusal");
        all.extend(out);
        let answer = if refuse_retry {
            Input::LaunchRefused {
                reason: "no capacity in B".into(),
            }
        } else {
            Input::Launched {
                id: id(2),
                at: t0(),
            }
        };
        let mut out = w.step(&mut e, t0(), answer).unwrap();
        if refuse_retry {
            assert_eq!(
                launches(&out),
                vec![market(B)],
                "B again, told of its refusal"
            );
            all.extend(out);
            out = w
                .step(
                    &mut e,
                    t0(),
                    Input::LaunchRefused {
                        reason: "no capacity in B".into(),
                    },
                )
                .unwrap();
        }
        assert!(launches(&out).is_empty(), "{out:?}");
        all.extend(out);
        (e, policy, all)
    }

    #[test]
    fn a_refused_market_is_skipped_each_new_refusal_told_once_and_retried_soon() {
        let w = World::new();
        let (mut e, policy, all) = refusal(&w, true);
        assert_eq!(
            launches(&all),
            vec![market(A), market(B), market(B), market(B)],
            "the rest of A's count was skipped"
        );
        assert_eq!(e.counts().failed_launches, 3);
        assert_eq!(e.counts().launches, 1);
        let asked = policy.asked();
        assert_eq!(asked.len(), 3, "{asked:?}");
        assert_eq!(
            asked[2].event,
            Some(PolicyEvent::LaunchFailed {
                market: market(B),
                reason: "no capacity in B".into()
            }),
            "B's refusal is news at this instant: told, so the policy can fail over"
        );
        assert_eq!(asked[0].event, None);
        assert_eq!(
            asked[1].event,
            Some(PolicyEvent::LaunchFailed {
                market: market(A),
                reason: "no capacity in A".into()
            })
        );
        assert_eq!(
            asked[1].footprint.iter().map(|i| &i.id).collect::<Vec<_>>(),
            vec![&id(1)],
            "told after the rest of the decision was applied"
        );
        // Its answer was a pool already refused at this instant, refused again: not told twice,
        // it is asked again within the retry interval, not at the three hours it asked for (nor
        // at the instance's readiness, half an hour on).
        let wake = e.next_wake(t0()).unwrap();
        assert!(
            wake > t0() && wake <= at(RETRY_AFTER_REFUSAL_SECS),
            "{wake}"
        );
        // Then it is consulted on its own: the refusals are not told again.
        let out = w.feed(&mut e, wake, Input::Tick, &mut accept_from(2));
        assert!(launches(&out).is_empty());
        let asked = policy.asked();
        assert_eq!(asked.len(), 4);
        assert_eq!(asked[3].event, None, "a consultation on its own");
        let told = asked
            .iter()
            .filter(|a| matches!(a.event, Some(PolicyEvent::LaunchFailed { .. })))
            .count();
        assert_eq!(told, 2, "each pool's refusal is told once an instant");
    }

    #[test]
    fn an_accepted_retry_keeps_the_policys_wake_up() {
        // The control of the test above: the wake-up moves forward only because the answer
        // to the refusal was refused too.
        let w = World::new();
        let (e, policy, _) = refusal(&w, false);
        assert_eq!(policy.asked().len(), 2);
        assert_eq!(
            e.next_wake(t0()),
            Some(at(1800.0)),
            "the readiness comes first"
        );
    }

    // ---- 4. budget ----

    #[test]
    fn a_launch_whose_first_period_would_pass_the_budget_is_held() {
        let w = World::new();
        // (a) The first period alone (an hour at 0.05) passes a 0.04 budget.
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 1)],
            ..Decision::default()
        });
        let mut e = engine(job(&w, 100.0, 8, 5.0, ""), &policy, terms(Some(0.04), None));
        let out = w.feed(&mut e, t0(), Input::Tick, &mut accept());
        assert!(launches(&out).is_empty(), "{out:?}");
        assert!(
            e.held().is_some_and(|h| h.contains("launches held")),
            "{:?}",
            e.held()
        );
        assert_eq!(e.counts().launches, 0);
        assert_eq!(e.counts().failed_launches, 0, "held is not refused");
        assert_eq!(policy.asked().len(), 1, "nor told as a refusal");

        // (b) Launches already made count: 0.12 holds two hours of A, not three.
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 3)],
            ..Decision::default()
        });
        let mut e = engine(job(&w, 100.0, 8, 5.0, ""), &policy, terms(Some(0.12), None));
        let out = w.feed(&mut e, t0(), Input::Tick, &mut accept());
        assert_eq!(launches(&out).len(), 2, "{out:?}");
        assert!(e.held().is_some());
        assert_eq!(e.members().len(), 2);
        assert!(
            e.end().is_none(),
            "a held launch does not end a job that holds instances"
        );
    }

    /// Two A instances launched `launch_secs` after the start under a 0.25 budget: each hour
    /// of both costs 0.10, so the third hour (from launch + 2 h) would pass it.
    fn budget_run(launch_secs: f64) -> (Timestamp, JobEnd, Usd, Vec<Ended>) {
        let w = World::new();
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 2)],
            ..Decision::default()
        });
        let mut e = engine(job(&w, 100.0, 8, 5.0, ""), &policy, terms(Some(0.25), None));
        let mut now = at(launch_secs);
        let mut accept = accept();
        let out = w.feed(&mut e, now, Input::Tick, &mut accept);
        assert_eq!(launches(&out).len(), 2);
        let ticks = run_until(&w, &mut e, &mut now, at(10.0 * 3600.0), &mut accept);
        let end = e.end().cloned().expect("the budget ended the job");
        let (last, out) = ticks.last().unwrap();
        assert_eq!(*last, end.at);
        assert_eq!(ends(out), vec![end.clone()], "one End, at the last tick");
        assert!(
            ticks[..ticks.len() - 1]
                .iter()
                .all(|(_, o)| ends(o).is_empty())
        );
        assert!(e.members().iter().all(|m| m.releasing));
        w.end_all(&mut e, end.at);
        assert!(e.members().is_empty());
        let spend = e.spend(end.at, &w.markets);
        (at(launch_secs), end, spend, e.ended().to_vec())
    }

    #[test]
    fn the_budget_ends_the_job_at_the_last_look_before_the_period_that_would_pass_it() {
        let (launch, end, spend, ended) = budget_run(30.0);
        assert_eq!(end.outcome, Outcome::Budget, "{end:?}");
        let boundary = launch.plus_secs(2.0 * 3600.0);
        assert!(end.at < boundary, "ended at {} ≥ {boundary}", end.at);
        let billed: Usd = ended.iter().map(|e| e.cost).sum();
        assert!((billed.get() - spend.get()).abs() < 1e-12);
        assert!(spend <= usd(0.25), "{spend}");
        assert!(
            (billed.get() - 4.0 * SPOT_A).abs() < 1e-9,
            "two hours each: {billed}"
        );
        // Where the looks are under hourly billing: `BUDGET_LOOK_SECS` before each instance's
        // next hour, so the job ends exactly that long before the boundary.
        assert_eq!(
            boundary.secs_since(end.at),
            BUDGET_LOOK_SECS,
            "the look just before the boundary: {}",
            end.at
        );
    }

    #[test]
    fn a_launch_at_the_start_ends_a_look_before_the_hour_boundary() {
        // Launched at the start: the look falls `BUDGET_LOOK_SECS` before the instances' second
        // hour, and sees that hour coming (the hour starting right at the horizon counts).
        let (launch, end, spend, _) = budget_run(0.0);
        assert_eq!(end.outcome, Outcome::Budget);
        let boundary = launch.plus_secs(2.0 * 3600.0);
        assert_eq!(boundary.secs_since(end.at), BUDGET_LOOK_SECS, "{}", end.at);
        assert!(spend <= usd(0.25), "{spend}");
    }

    // ---- 5. deadline ----

    #[test]
    fn the_deadline_wakes_the_engine_and_ends_the_job_then() {
        let w = World::new();
        let deadline = at(2.0 * 3600.0 + 17.0);
        let policy = Scripted::default();
        // Keeps one instance and asks to be woken only well after the deadline.
        policy.keep(A, spot(0.10), 1, Some(deadline.plus_secs(3600.0)));
        let mut e = engine(
            job(&w, 100.0, 8, 5.0, ""),
            &policy,
            terms(None, Some(deadline)),
        );
        assert_eq!(e.next_wake(t0()), Some(deadline), "before anything else");
        let mut now = t0();
        let mut accept = accept();
        let out = w.feed(&mut e, now, Input::Tick, &mut accept);
        assert_eq!(launches(&out).len(), 1);
        let ticks = run_until(
            &w,
            &mut e,
            &mut now,
            deadline.plus_secs(7200.0),
            &mut accept,
        );
        assert!(ticks.iter().all(|(t, _)| *t <= deadline), "{ticks:?}");
        let (last, out) = ticks.last().unwrap();
        assert_eq!(*last, deadline, "ticked at the deadline: it was a wake-up");
        let end = e.end().cloned().unwrap();
        assert_eq!(end.outcome, Outcome::Deadline);
        assert_eq!(end.at, deadline);
        assert_eq!(ends(out), vec![end]);
        assert!(launches(out).is_empty());
        assert_eq!(e.next_wake(deadline), None);

        // After the end the policy is not asked again and nothing is launched, although it
        // would replace the instance that ends.
        let asked = policy.asked().len();
        w.end_all(&mut e, deadline);
        let out = w.feed(&mut e, deadline.plus_secs(600.0), Input::Tick, &mut accept);
        assert!(launches(&out).is_empty(), "{out:?}");
        assert_eq!(policy.asked().len(), asked);
        assert_eq!(e.counts().launches, 1);
        assert_eq!(e.ended().len(), 1);
    }

    // ---- 6. billing ----

    #[test]
    fn a_warned_instance_ended_by_the_user_is_billed_as_provider_ended() {
        let w = World::new();
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 2)],
            ..Decision::default()
        });
        let mut e = engine(job(&w, 100.0, 8, 5.0, ""), &policy, terms(None, None));
        w.feed(&mut e, t0(), Input::Tick, &mut accept());
        let warned = at(5400.0);
        w.step(
            &mut e,
            warned,
            Input::Warned {
                id: id(1),
                at: warned,
                terminate_at: warned.plus_secs(NOTICE_SECS),
            },
        )
        .unwrap();
        w.feed(&mut e, warned, Input::Tick, &mut accept_from(3));
        // Both end by the user's hand during i-1's notice.
        let gone = warned.plus_secs(30.0);
        for n in [1, 2] {
            w.step(
                &mut e,
                gone,
                Input::Ended {
                    id: id(n),
                    at: gone,
                    by_provider: false,
                },
            )
            .unwrap();
        }
        w.feed(&mut e, gone, Input::Tick, &mut accept_from(3));
        let ended = e.ended();
        assert_eq!(ended.len(), 2);
        let of = |n: u32| ended.iter().find(|x| x.member.id == id(n)).unwrap();
        assert_eq!(of(1).by, EndedBy::Provider, "warned: reclaimed");
        assert!(
            (of(1).cost.get() - SPOT_A).abs() < 1e-12,
            "its last partial hour is free: {}",
            of(1).cost
        );
        assert_eq!(of(2).by, EndedBy::User);
        assert!(
            (of(2).cost.get() - 2.0 * SPOT_A).abs() < 1e-12,
            "{}",
            of(2).cost
        );

        // The same rule when a restarted broker adopts an instance that ended while it was
        // down.
        let mut e = engine(job(&w, 100.0, 8, 5.0, ""), &policy, terms(None, None));
        let member = Member {
            id: id(7),
            market: market(A),
            purchase: spot(0.10),
            launched_at: t0(),
            rate: 1.0,
            ready: Some(at(300.0)),
            warned: Some(warned),
            terminate_at: Some(warned.plus_secs(NOTICE_SECS)),
            releasing: false,
            replaced_by: None,
        };
        e.adopt(member, Some((gone, false)), &w.markets);
        assert_eq!(e.ended()[0].by, EndedBy::Provider);
        assert!((e.ended()[0].cost.get() - SPOT_A).abs() < 1e-12);
    }

    // ---- 7. restore ----

    /// What the live driver's `reconcile` builds from a stored instance.
    fn as_stored(job: &JobModel, m: &Member) -> Member {
        Member {
            id: m.id.clone(),
            rate: job.rate(&m.market.instance_type).unwrap_or(0.0),
            market: m.market.clone(),
            purchase: m.purchase,
            launched_at: m.launched_at,
            ready: m.ready,
            warned: m.warned,
            terminate_at: m.warned.map(|w| w.plus_secs(NOTICE_SECS)),
            releasing: m.releasing,
            replaced_by: None,
        }
    }

    #[test]
    fn an_instance_ended_unasked_is_replaced_at_once_not_at_the_next_decision() {
        let w = World::new();
        let job = job(&w, 5.0, 4, 5.0, "");
        let policy = Scripted::default();
        // The policy would next look on its own three hours in.
        policy.keep(A, spot(0.10), 1, Some(at(3.0 * 3600.0)));
        let mut e = engine(job, &policy, terms(Some(5.0), None));
        let out = w.feed(&mut e, t0(), Input::Tick, &mut accept());
        assert_eq!(launches(&out).len(), 1);
        // Terminated by someone else (an operator, a failure): not the policy's release, not
        // the provider's reclaim.
        let gone = at(600.0);
        w.step(
            &mut e,
            gone,
            Input::Ended {
                id: id(1),
                at: gone,
                by_provider: false,
            },
        )
        .unwrap();
        let out = w.feed(&mut e, gone, Input::Tick, &mut accept_from(2));
        assert_eq!(launches(&out), vec![market(A)], "replaced at once: {out:?}");
        let asked = policy.asked();
        assert_eq!(
            asked.last().map(|a| a.event.clone()),
            Some(Some(PolicyEvent::Lost(vec![id(1)])))
        );
        assert_eq!(e.counts().evictions, 0, "not counted as an eviction");
        assert_eq!(
            e.ended()[0].by,
            EndedBy::User,
            "billed as ended by the user"
        );
    }

    #[test]
    fn a_restored_engine_continues_exactly_as_the_original() {
        let w = World::new();
        let job = job(&w, 5.0, 4, 5.0, "");
        let keep = |p: &Scripted| p.keep(A, spot(0.10), 2, None);
        let policy = Scripted::default();
        keep(&policy);
        let mut original = engine(job.clone(), &policy, terms(Some(5.0), None));
        let mut now = t0();
        let mut accept_a = accept();
        w.feed(&mut original, now, Input::Tick, &mut accept_a);
        run_until(&w, &mut original, &mut now, at(700.0), &mut accept_a);
        // i-1 is warned and taken; a replacement (i-3) launches during its notice.
        let warned = at(900.0);
        w.step(
            &mut original,
            warned,
            Input::Warned {
                id: id(1),
                at: warned,
                terminate_at: warned.plus_secs(NOTICE_SECS),
            },
        )
        .unwrap();
        let out = w.feed(&mut original, warned, Input::Tick, &mut accept_a);
        assert_eq!(launches(&out).len(), 1);
        let gone = warned.plus_secs(NOTICE_SECS);
        w.step(
            &mut original,
            gone,
            Input::Ended {
                id: id(1),
                at: gone,
                by_provider: true,
            },
        )
        .unwrap();
        now = gone;
        w.feed(&mut original, now, Input::Tick, &mut accept_a);
        assert_eq!(original.members().len(), 2);
        assert_eq!(original.ended().len(), 1);
        assert!(original.end().is_none());

        // Saved between instants, restored, and the store's instances adopted.
        let json = serde_json::to_string(original.state()).unwrap();
        let policy_b = Scripted::default();
        keep(&policy_b);
        let state: EngineState = serde_json::from_str(&json).unwrap();
        let mut restored = JobEngine::restore(
            job.clone(),
            Box::new(policy_b.clone()),
            EngineConfig::new(Pacing::Modelled),
            terms(Some(5.0), None),
            state,
        );
        for x in original.ended() {
            restored.adopt(
                as_stored(&job, &x.member),
                Some((x.end, x.by == EndedBy::Provider)),
                &w.markets,
            );
        }
        for m in original.members() {
            restored.adopt(as_stored(&job, m), None, &w.markets);
        }
        assert_eq!(restored.members(), original.members());
        assert_eq!(restored.ended(), original.ended());
        assert_eq!(restored.next_wake(now), original.next_wake(now));

        // The same world for both from here on: i-2 is warned and taken, launches succeed.
        let asked_before = policy.asked().len();
        let mut accept_b = accept_from(4);
        let mut accept_a = accept_from(4);
        let warn_2 = at(2000.0);
        let mut steps = 0;
        while original.end().is_none() {
            steps += 1;
            assert!(steps < 1000, "no end");
            let wake = original.next_wake(now);
            assert_eq!(restored.next_wake(now), wake, "next wake after {now}");
            let world = [warn_2, warn_2.plus_secs(NOTICE_SECS)]
                .into_iter()
                .find(|&t| t > now);
            let t = [wake, world].into_iter().flatten().min().unwrap();
            now = t;
            let mut inputs = Vec::new();
            if t == warn_2 {
                inputs.push(Input::Warned {
                    id: id(2),
                    at: t,
                    terminate_at: t.plus_secs(NOTICE_SECS),
                });
            }
            if t == warn_2.plus_secs(NOTICE_SECS) {
                inputs.push(Input::Ended {
                    id: id(2),
                    at: t,
                    by_provider: true,
                });
            }
            inputs.push(Input::Tick);
            for input in inputs {
                let a = w.feed(&mut original, t, input.clone(), &mut accept_a);
                let b = w.feed(&mut restored, t, input.clone(), &mut accept_b);
                assert_eq!(a, b, "{input:?} at {t}");
            }
        }
        assert_eq!(restored.end(), original.end());
        assert_eq!(original.end().unwrap().outcome, Outcome::Completed);
        assert_eq!(restored.members(), original.members());
        assert_eq!(restored.ended(), original.ended());
        assert_eq!(restored.counts(), original.counts());
        assert_eq!(
            serde_json::to_string(restored.state()).unwrap(),
            serde_json::to_string(original.state()).unwrap()
        );
        // Both policies were asked the same questions after the save.
        let after: Vec<_> = policy.asked()[asked_before..]
            .iter()
            .map(|a| (a.at, a.event.clone(), a.footprint.clone()))
            .collect();
        let restored_asked: Vec<_> = policy_b
            .asked()
            .iter()
            .map(|a| (a.at, a.event.clone(), a.footprint.clone()))
            .collect();
        assert!(after.len() > 2, "{after:?}");
        assert_eq!(restored_asked, after);
    }

    // ---- a warning for an instance the policy already released ----

    #[test]
    fn a_warning_for_a_released_instance_costs_no_work() {
        let w = World::new();
        let job = job(
            &w,
            100.0,
            4,
            5.0,
            "[eviction_cost]\nmodel = \"agileml\"\nsync_interval_minutes = 2\n\
             rebalance_seconds = 0\n",
        );
        let policy = Scripted::default();
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 2)],
            ..Decision::default()
        });
        let mut e = engine(job, &policy, terms(None, None));
        let mut accept = accept();
        w.feed(&mut e, t0(), Input::Tick, &mut accept);
        let mut now = t0();
        run_until(&w, &mut e, &mut now, at(900.0), &mut accept);
        // The policy releases i-1 at its next look; its end is on its way (a live termination
        // takes a while), and the provider's warning arrives first.
        let released = e.next_wake(now).unwrap();
        policy.push(Decision {
            release: vec![id(1)],
            ..Decision::default()
        });
        let out = w.feed(&mut e, released, Input::Tick, &mut accept);
        assert!(out.contains(&Command::Release { id: id(1) }), "{out:?}");
        assert_eq!(e.lost_work(), 0.0);
        let warned = released.plus_secs(30.0);
        w.step(
            &mut e,
            warned,
            Input::Warned {
                id: id(1),
                at: warned,
                terminate_at: warned.plus_secs(NOTICE_SECS),
            },
        )
        .unwrap();
        w.feed(&mut e, warned, Input::Tick, &mut accept);
        assert_eq!(
            e.lost_work(),
            0.0,
            "i-1 did no work for the job after its release, so its warning loses none"
        );
        assert_eq!(
            e.counts().evictions,
            0,
            "a released instance is not an eviction"
        );
        let ended = warned.plus_secs(60.0);
        w.end_all(&mut e, ended);
        w.feed(&mut e, ended, Input::Tick, &mut accept);
        let billed = e.ended().iter().find(|x| x.member.id == id(1)).unwrap();
        assert_eq!(billed.by, EndedBy::Provider, "billed as reclaimed");
    }

    // ---- 8. modelled pacing ----

    #[test]
    fn modelled_instances_are_ready_after_startup_and_the_job_completes_on_the_millisecond() {
        let w = World::new();
        let rate = 3.0;
        let total = 1.234;
        let job = job(
            &w,
            total,
            1,
            5.0,
            "[throughput]\n\"c3.xlarge\" = 3.0\n\
             [eviction_cost]\nmodel = \"agileml\"\nrebalance_seconds = 0\n",
        );
        assert_eq!(job.rate(&market(A).instance_type), Some(rate));
        let policy = Scripted::default();
        policy.keep(A, spot(0.10), 1, None);
        let mut e = engine(job, &policy, terms(None, None));
        let mut accept = accept();
        let out = w.feed(&mut e, t0(), Input::Tick, &mut accept);
        assert_eq!(launches(&out).len(), 1);
        assert!(!out.iter().any(|c| matches!(c, Command::MarkReady { .. })));
        let ready = at(300.0);
        assert_eq!(e.next_wake(t0()), Some(ready), "woken at the readiness");
        // A look during the start-up finds it still starting.
        let out = w.feed(&mut e, at(120.0), Input::Tick, &mut accept);
        assert!(
            !out.iter().any(|c| matches!(c, Command::MarkReady { .. })),
            "{out:?}"
        );
        assert_eq!(e.members()[0].ready, None);
        assert_eq!(e.next_wake(at(120.0)), Some(ready));
        let out = w.feed(&mut e, ready, Input::Tick, &mut accept);
        assert!(
            out.contains(&Command::MarkReady {
                id: id(1),
                at: ready
            }),
            "{out:?}"
        );
        // Looks in between (the policy's, and one at an odd millisecond) change nothing.
        w.feed(
            &mut e,
            Timestamp::from_millis(T0_MS + 1_000_123),
            Input::Tick,
            &mut accept,
        );
        let mut now = Timestamp::from_millis(T0_MS + 1_000_123);
        let expected =
            Timestamp::from_millis(ready.millis() + (total / rate * 3_600_000.0).round() as i64);
        assert_eq!(expected.millis() - T0_MS, 1_780_800);
        let ticks = run_until(&w, &mut e, &mut now, at(3.0 * 3600.0), &mut accept);
        let end = e.end().cloned().expect("completed");
        assert_eq!(end.outcome, Outcome::Completed);
        assert_eq!(end.at, expected, "{} vs {expected}", end.at);
        assert_eq!(
            ticks.last().unwrap().0,
            expected,
            "the completion was a wake-up"
        );
        assert_eq!(ends(&ticks.last().unwrap().1), vec![end]);
        assert_eq!(e.fraction(), 1.0);
        assert!(e.work_complete());
    }

    // ---- make before break ----

    /// Pushes `decision` and steps to the engine's next look, where the policy answers with it.
    fn decide_next(
        w: &World,
        e: &mut JobEngine<'_>,
        policy: &Scripted,
        now: &mut Timestamp,
        decision: Decision,
        answer: &mut dyn FnMut(Timestamp, &Market, Purchase) -> Input,
    ) -> Vec<Command> {
        policy.push(decision);
        let t = e.next_wake(*now).expect("a next look");
        *now = t;
        let out = w.feed(e, t, Input::Tick, answer);
        assert_eq!(policy.asked().iter().filter(|a| a.at == t).count(), 1);
        out
    }

    /// A one-instance job moves from on-demand to spot without a gap: the spot launch replaces
    /// the on-demand instance, which does not count against `max_instances` meanwhile, works on
    /// while the spot instance starts, and is released the moment it is ready. A replacement
    /// refused, or warned before it is ready, leaves the instance where it was.
    #[test]
    fn a_replacement_is_launched_beside_what_it_replaces_and_takes_over_when_ready() {
        let w = World::new();
        let job = job(
            &w,
            100.0,
            1,
            5.0,
            "[eviction_cost]\nmodel = \"agileml\"\nsync_interval_minutes = 2\n\
             rebalance_seconds = 0\n",
        );
        let policy = Scripted::default();
        // Every other answer asks to look again in ten minutes.
        policy.0.lock().unwrap().wake_at = None;
        let look = |t: Timestamp| Some(t.plus_secs(600.0));
        policy.push(Decision {
            acquire: vec![acquire(A, Purchase::OnDemand, 1)],
            wake_at: look(t0()),
            ..Decision::default()
        });
        let mut e = engine(job, &policy, terms(None, None));
        let mut accept = accept();
        w.feed(&mut e, t0(), Input::Tick, &mut accept);
        let mut now = t0();
        // The on-demand instance starts (five minutes) and works.
        let ready = t0().plus_secs(300.0);
        let until = |e: &JobEngine<'_>, now: Timestamp| e.next_wake(now).unwrap();
        while until(&e, now) <= ready {
            let t = until(&e, now);
            policy.push(Decision {
                wake_at: look(t),
                ..Decision::default()
            });
            now = t;
            w.feed(&mut e, t, Input::Tick, &mut accept);
        }

        // Without `replace`, the limit of one instance holds the spot launch back.
        let out = decide_next(
            &w,
            &mut e,
            &policy,
            &mut now,
            Decision {
                acquire: vec![acquire(A, spot(0.10), 1)],
                wake_at: Some(ready.plus_secs(900.0)),
                ..Decision::default()
            },
            &mut accept,
        );
        assert!(launches(&out).is_empty(), "{out:?}");

        // A refused replacement: the on-demand instance stays, and counts again.
        let mut refuse = |_: Timestamp, _: &Market, _: Purchase| Input::LaunchRefused {
            reason: "InsufficientInstanceCapacity".into(),
        };
        policy.push(Decision {
            acquire: vec![acquire(A, spot(0.10), 1)],
            replace: vec![id(1)],
            wake_at: look(now),
            ..Decision::default()
        });
        let t = e.next_wake(now).unwrap();
        now = t;
        // Its answer to the refusal: nothing more.
        policy.push(Decision {
            wake_at: look(t),
            ..Decision::default()
        });
        let out = w.feed(&mut e, t, Input::Tick, &mut refuse);
        assert_eq!(launches(&out), vec![market(A)], "{out:?}");
        assert!(!out.iter().any(|c| matches!(c, Command::Release { .. })));
        assert_eq!(e.members().len(), 1);
        assert!(e.members()[0].replaced_by.is_none());

        // Granted: both run; the on-demand instance works on while the spot one starts.
        let mut accept = accept_from(2);
        let far = now.plus_secs(3000.0);
        let out = decide_next(
            &w,
            &mut e,
            &policy,
            &mut now,
            Decision {
                acquire: vec![acquire(A, spot(0.10), 1)],
                replace: vec![id(1)],
                wake_at: Some(far),
                ..Decision::default()
            },
            &mut accept,
        );
        assert_eq!(launches(&out), vec![market(A)], "{out:?}");
        assert_eq!(e.members().len(), 2);
        assert_eq!(e.members()[0].replaced_by, Some(id(2)));
        let launched = now;
        let before = e.done_work();
        // The spot instance is ready five minutes later: the on-demand one goes then, not before.
        let spot_ready = launched.plus_secs(300.0);
        let t = e.next_wake(now).unwrap();
        assert_eq!(t, spot_ready, "the readiness is the next wake-up");
        policy.push(Decision {
            wake_at: Some(spot_ready.plus_secs(3000.0)),
            ..Decision::default()
        });
        now = t;
        let out = w.feed(&mut e, t, Input::Tick, &mut accept);
        assert!(out.contains(&Command::Release { id: id(1) }), "{out:?}");
        // No gap: the work went on at one instance's rate through the switch.
        let expected = before + 300.0 / 3600.0;
        assert!(
            (e.done_work() - expected).abs() < 1e-6,
            "{} vs {expected}",
            e.done_work()
        );

        // A replacement warned before it is ready: the instance it was to replace stays.
        let mut accept = accept_from(3);
        let far = now.plus_secs(3600.0);
        decide_next(
            &w,
            &mut e,
            &policy,
            &mut now,
            Decision {
                acquire: vec![acquire(B, spot(0.10), 1)],
                replace: vec![id(2)],
                wake_at: Some(far),
                ..Decision::default()
            },
            &mut accept,
        );
        let two = |e: &JobEngine<'_>| e.members().iter().find(|m| m.id == id(2)).cloned().unwrap();
        assert_eq!(two(&e).replaced_by, Some(id(3)));
        let warned = now.plus_secs(60.0);
        w.step(
            &mut e,
            warned,
            Input::Warned {
                id: id(3),
                at: warned,
                terminate_at: warned.plus_secs(NOTICE_SECS),
            },
        )
        .unwrap();
        policy.push(Decision {
            wake_at: Some(warned.plus_secs(3600.0)),
            ..Decision::default()
        });
        w.feed(&mut e, warned, Input::Tick, &mut accept);
        assert!(
            two(&e).replaced_by.is_none() && !two(&e).releasing,
            "{:?}",
            two(&e)
        );
        // Its readiness comes and goes: i-2 is not released for a warned replacement.
        let mut now = warned;
        let ticks = run_until(&w, &mut e, &mut now, warned.plus_secs(600.0), &mut accept);
        assert!(
            !ticks
                .iter()
                .flat_map(|(_, c)| c)
                .any(|c| *c == Command::Release { id: id(2) }),
            "{ticks:?}"
        );
    }
}
