//! The parameter-server side of an agent: the ActivePS shards it serves, the BackupPS copies it
//! holds, background sync, hand-over and promotion.

use crate::apps::App;
use crate::audit::{Audit, AuditEvent};
use crate::transport::{
    ClockState, Handler, Lineage, Peers, PushOutcome, Request, Response, Snapshot,
};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{ClusterView, KeyRange, ShardSource};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};

/// How long a departing owner keeps trying to deliver one hand-over: every attempt (each call's
/// timeout is cut to what is left of it) and every pause between attempts end within it.
pub const HANDOVER_SEND_BUDGET: Duration = Duration::from_secs(20);
/// How much longer than the sender's whole budget the new owner waits: the two learn of the move
/// from their own copies of the view, which may reach them a little apart, and the last attempt
/// may still be on the wire when the sender's budget ends.
pub const HANDOVER_WAIT_MARGIN: Duration = Duration::from_secs(5);
/// How long a new owner waits for the departing owner's hand-over before restoring a backup.
/// Derived from the sender's budget so that a hand-over the sender is still retrying is never
/// overtaken by a restore from an older backup (which would lose every update after that
/// backup). A hand-over arriving later still is fenced off (see [`judge_handover`]): it never
/// replaces what the new owner serves by then.
pub const HANDOVER_WAIT: Duration = HANDOVER_SEND_BUDGET.saturating_add(HANDOVER_WAIT_MARGIN);
const _: () = assert!(
    HANDOVER_WAIT.as_millis() > HANDOVER_SEND_BUDGET.as_millis(),
    "the receiver must wait longer than the sender retries"
);
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The two sides' hand-over timing; the receiver's wait is always derived from the sender's
/// budget (see [`HANDOVER_WAIT`]). Tests shorten both together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandoverTiming {
    send_budget: Duration,
    wait: Duration,
}

impl HandoverTiming {
    /// The sender retries for `send_budget`; the receiver waits `margin` longer (at least a
    /// millisecond: never as long or shorter).
    pub const fn from_send_budget(send_budget: Duration, margin: Duration) -> Self {
        let margin = if margin.is_zero() {
            Duration::from_millis(1)
        } else {
            margin
        };
        HandoverTiming {
            send_budget,
            wait: send_budget.saturating_add(margin),
        }
    }

    /// How long the departing owner keeps trying to deliver one hand-over.
    pub fn send_budget(&self) -> Duration {
        self.send_budget
    }

    /// How long the new owner waits for it before restoring a backup.
    pub fn wait(&self) -> Duration {
        self.wait
    }
}

impl Default for HandoverTiming {
    fn default() -> Self {
        Self::from_send_budget(HANDOVER_SEND_BUDGET, HANDOVER_WAIT_MARGIN)
    }
}

/// An agent that was told it owns a shard but does not serve it yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquisition {
    /// Tells this acquisition from a later one of the same shard.
    id: u64,
    /// The departing owner whose hand-over is awaited (`None`: the state comes from a backup or
    /// is initialised here, and no hand-over is accepted).
    pub from: Option<InstanceId>,
    /// The earliest epoch this ownership can have begun in, as far as this agent can tell: the
    /// one after the newest view in which it saw the shard owned by another agent. The sender
    /// tags its hand-over with the epoch of the view that told it to leave, which is never
    /// earlier; a hand-over tagged earlier belongs to a previous ownership. (The sender's and
    /// the receiver's first view of the move need not be the same one: an agent is sent only
    /// the newest view, so either may skip some.)
    pub since: u64,
}

/// Which hand-over a serving shard was installed from, to recognise it if it comes again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandoverTag {
    pub from: InstanceId,
    pub epoch: u64,
    pub seq: u64,
}

/// What a receiver does with a hand-over (see [`judge_handover`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoverVerdict {
    /// The awaited hand-over: serve it.
    Install,
    /// The very hand-over the shard was installed from, sent again (the first answer was
    /// lost): acknowledge it and change nothing.
    AlreadyInstalled,
    /// Not awaited, but it may be once this agent sees the view the sender acts on: the sender
    /// should retry. `keep`: hold it as the backup copy (newer than the one held).
    NotYet { keep: bool },
    /// Not awaited and never will be (an older epoch, another sender, or a shard served here
    /// already): the sender should stop. `keep`: hold it as the backup copy.
    Superseded { keep: bool },
}

/// The receiver's side of hand-over fencing, without I/O. A hand-over is installed only while
/// this agent is acquiring the shard from its sender in an ownership its epoch belongs to;
/// anything else never touches the serving state and is at most kept as the backup copy, if its
/// seq is higher than that copy's.
///
/// `serving`: the shard is active here and not being handed away; `installed`: the hand-over
/// it was installed from, if so; `backup_seq`: the seq of the backup copy held;
/// `latest_epoch`: the newest view applied here.
pub fn judge_handover(
    acquiring: Option<&Acquisition>,
    serving: bool,
    installed: Option<&HandoverTag>,
    backup_seq: Option<u64>,
    latest_epoch: u64,
    msg: &HandoverTag,
) -> HandoverVerdict {
    if !serving
        && let Some(a) = acquiring
        && a.from.as_ref() == Some(&msg.from)
        && msg.epoch >= a.since
    {
        return HandoverVerdict::Install;
    }
    if serving && installed == Some(msg) {
        return HandoverVerdict::AlreadyInstalled;
    }
    let keep = backup_seq.is_none_or(|b| msg.seq > b);
    if !serving && acquiring.is_none() && msg.epoch > latest_epoch {
        HandoverVerdict::NotYet { keep }
    } else {
        HandoverVerdict::Superseded { keep }
    }
}

/// Applies pushes exactly once per (clock, partition).
#[derive(Debug, Clone)]
pub struct ClockBook {
    num_partitions: u32,
    /// The sync model's slack: a push for clock `c` proves that clock `c - slack - 1` was
    /// complete when its worker started.
    slack: u32,
    /// Whether a push beyond the staleness bound fast-forwards (a restored shard) or is refused.
    lineage: Lineage,
    done: Option<u64>,
    partial: BTreeMap<u64, BTreeSet<u32>>,
}

impl ClockBook {
    pub fn new(num_partitions: u32) -> Self {
        ClockBook {
            num_partitions,
            slack: 0,
            lineage: Lineage::Continuous,
            done: None,
            partial: BTreeMap::new(),
        }
    }

    /// The same book with `lineage`.
    pub fn with_lineage(mut self, lineage: Lineage) -> Self {
        self.lineage = lineage;
        self
    }

    pub fn lineage(&self) -> Lineage {
        self.lineage
    }

    /// The same book under a sync model with slack `s`.
    pub fn with_slack(mut self, slack: u32) -> Self {
        self.slack = slack;
        self
    }

    pub fn from_state(num_partitions: u32, s: &ClockState) -> Self {
        ClockBook {
            num_partitions,
            slack: 0,
            lineage: Lineage::Continuous,
            done: s.done,
            partial: s
                .partial
                .iter()
                .map(|(c, p)| (*c, p.iter().copied().collect()))
                .collect(),
        }
    }

    pub fn state(&self) -> ClockState {
        ClockState {
            done: self.done,
            partial: self
                .partial
                .iter()
                .map(|(c, p)| (*c, p.iter().copied().collect()))
                .collect(),
        }
    }

    pub fn done(&self) -> Option<u64> {
        self.done
    }

    /// Whether workers waiting for `clock` may proceed. Clocks below `done` that never completed
    /// (lost with a crashed owner) count as complete: their updates are gone for good.
    pub fn is_complete(&self, clock: u64) -> bool {
        self.done.is_some_and(|d| d >= clock)
    }

    pub fn missing(&self, clock: u64) -> Vec<u32> {
        if self.is_complete(clock) {
            return Vec::new();
        }
        let have = self.partial.get(&clock);
        (0..self.num_partitions)
            .filter(|p| !have.is_some_and(|h| h.contains(p)))
            .collect()
    }

    /// Decide whether a push may be applied, and record it if so.
    ///
    /// Under slack `s` (0: BSP) a worker pushes clock `c` only after pulling clock `c - s - 1`
    /// complete from every shard. A push for `c` while `c - s - 1` is incomplete here breaks
    /// that staleness bound. On a [`Lineage::Restored`] shard it means the shard was restored
    /// from a backup older than the job: the clocks up to there are lost for good, so the shard
    /// fast-forwards instead of waiting for updates nobody will send. On a
    /// [`Lineage::Continuous`] shard nothing was lost, so the push is refused
    /// ([`PushOutcome::BeyondBound`]): fast-forwarding would silently drop the updates of
    /// those clocks still on their way. Clocks after `c - s - 1` may legitimately still be
    /// filling in.
    ///
    /// A restored shard becomes continuous once a clock completes on it by its own pushes:
    /// every partition of that clock was then pushed here, so every worker had moved to this
    /// shard before its next pull, and any later push proves a clock complete *here*.
    pub fn record(&mut self, clock: u64, partitions: &[u32]) -> PushOutcome {
        if let Some(prev) = clock.checked_sub(u64::from(self.slack) + 1)
            && !self.is_complete(prev)
        {
            match self.lineage {
                Lineage::Continuous => return PushOutcome::BeyondBound { done: self.done },
                Lineage::Restored => {
                    self.done = Some(prev);
                    self.partial.retain(|c, _| *c > prev);
                }
            }
        }
        if self.is_complete(clock) {
            return PushOutcome::Duplicate;
        }
        let have = self.partial.entry(clock).or_default();
        let already: Vec<u32> = partitions
            .iter()
            .copied()
            .filter(|p| have.contains(p))
            .collect();
        if !already.is_empty() {
            if already.len() == partitions.len() {
                return PushOutcome::Duplicate;
            }
            return PushOutcome::Conflict { already };
        }
        have.extend(
            partitions
                .iter()
                .copied()
                .filter(|&p| p < self.num_partitions),
        );
        // Under slack a later clock may fill up before an earlier one (a helper's chunk of a
        // slow worker's clock can arrive after that worker's next clock): `done` advances only
        // over complete clocks in a row, so "clock c complete" always means every clock <= c.
        let mut next = self.done.map_or(0, |d| d + 1);
        while self
            .partial
            .get(&next)
            .is_some_and(|h| h.len() as u32 >= self.num_partitions)
        {
            self.done = Some(next);
            self.lineage = Lineage::Continuous;
            next += 1;
        }
        if let Some(done) = self.done {
            self.partial.retain(|c, _| *c > done);
        }
        PushOutcome::Applied
    }
}

/// A shard's state: values, applied-update count and clock bookkeeping.
#[derive(Debug, Clone)]
pub struct ShardState {
    pub start: u64,
    /// Shared with pulls being encoded: a pull takes a reference, not a copy, and a push copies
    /// only if a pull is still reading (copy-on-write).
    pub values: Arc<Vec<f32>>,
    pub seq: u64,
    pub clocks: ClockBook,
}

impl ShardState {
    pub fn fresh(start: u64, values: Vec<f32>, num_partitions: u32) -> Self {
        ShardState {
            start,
            values: Arc::new(values),
            seq: 0,
            clocks: ClockBook::new(num_partitions),
        }
    }

    pub fn from_snapshot(s: Snapshot, num_partitions: u32) -> Self {
        ShardState {
            start: s.start,
            seq: s.seq,
            clocks: ClockBook::from_state(num_partitions, &s.clocks).with_lineage(s.lineage),
            values: Arc::new(s.values),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            start: self.start,
            seq: self.seq,
            lineage: self.clocks.lineage(),
            clocks: self.clocks.state(),
            values: Vec::clone(&self.values),
        }
    }

    /// Apply a push; the outcome says whether it counted.
    pub fn push(
        &mut self,
        clock: u64,
        partitions: &[u32],
        delta: &[f32],
    ) -> Result<PushOutcome, String> {
        if delta.len() != self.values.len() {
            return Err(format!(
                "delta of {} for a shard of {}",
                delta.len(),
                self.values.len()
            ));
        }
        let outcome = self.clocks.record(clock, partitions);
        if outcome == PushOutcome::Applied {
            for (v, d) in Arc::make_mut(&mut self.values).iter_mut().zip(delta) {
                *v += d;
            }
            self.seq += 1;
        }
        Ok(outcome)
    }
}

/// An ActivePS shard on this agent.
#[derive(Debug)]
struct Active {
    state: ShardState,
    /// Set when the shard is being handed over: requests get NotOwner.
    moving: bool,
    backup_addr: Option<String>,
    synced_seq: Option<u64>,
    /// The hand-over this state was installed from, if it was.
    installed_from: Option<HandoverTag>,
}

impl Active {
    fn new(state: ShardState, backup_addr: Option<String>) -> Self {
        Active {
            state,
            moving: false,
            backup_addr,
            synced_seq: None,
            installed_from: None,
        }
    }
}

/// Everything this agent holds of one shard.
#[derive(Debug, Default)]
struct Slot {
    active: Option<Active>,
    /// This agent was told it owns the shard and is waiting for its state.
    acquiring: Option<Acquisition>,
    backup: Option<ShardState>,
    /// The newest view epoch in which this agent saw the shard owned by another agent (0: none).
    not_owner_at: u64,
}

impl Slot {
    /// Active here and not being handed away.
    fn serving(&self) -> bool {
        self.active.as_ref().is_some_and(|a| !a.moving)
    }
}

/// Things the PS reports to the agent's control loop.
#[derive(Debug, Clone)]
pub enum PsEvent {
    HandedOver {
        shard: u32,
        to: InstanceId,
        seq: u64,
    },
}

/// The PS role(s) of one agent.
pub struct PsNode {
    me: InstanceId,
    app: Arc<App>,
    num_partitions: u32,
    peers: Arc<Peers>,
    slots: Mutex<HashMap<u32, Slot>>,
    changed: Notify,
    events: mpsc::UnboundedSender<PsEvent>,
    /// Hand-overs in flight (the agent may exit only when this is zero).
    handovers: Mutex<usize>,
    /// The newest view applied, so that an acquisition that finishes after the shard moved on
    /// passes it along instead of serving a stale copy.
    latest_view: Mutex<Option<Arc<ClusterView>>>,
    /// The sync model's slack, for every shard's [`ClockBook`].
    slack: u32,
    /// Tests: told of every applied push.
    audit: Mutex<Option<Audit>>,
    /// The hand-over budget (as a sender) and wait (as a receiver).
    timing: Mutex<HandoverTiming>,
    /// Numbers acquisitions (see [`Acquisition`]).
    next_acquisition: std::sync::atomic::AtomicU64,
}

impl PsNode {
    /// A node for BSP (slack 0).
    pub fn new(
        me: InstanceId,
        app: Arc<App>,
        num_partitions: u32,
        peers: Arc<Peers>,
        events: mpsc::UnboundedSender<PsEvent>,
    ) -> Arc<PsNode> {
        Self::with_slack(me, app, num_partitions, 0, peers, events)
    }

    /// A node whose shards follow a sync model with `slack`.
    pub fn with_slack(
        me: InstanceId,
        app: Arc<App>,
        num_partitions: u32,
        slack: u32,
        peers: Arc<Peers>,
        events: mpsc::UnboundedSender<PsEvent>,
    ) -> Arc<PsNode> {
        Arc::new(PsNode {
            me,
            app,
            num_partitions,
            slack,
            audit: Mutex::new(None),
            peers,
            slots: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            events,
            handovers: Mutex::new(0),
            latest_view: Mutex::new(None),
            timing: Mutex::new(HandoverTiming::default()),
            next_acquisition: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// Tests: shorter hand-over timing (the receiver's wait still derived from the budget).
    pub fn set_handover_timing(&self, timing: HandoverTiming) {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner()) = timing;
    }

    fn timing(&self) -> HandoverTiming {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn latest_epoch(&self) -> u64 {
        self.latest_view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, |v| v.epoch)
    }

    /// Tests: report every applied push to `audit` (before the pusher hears of it).
    pub fn set_audit(&self, audit: Audit) {
        *self.audit.lock().unwrap_or_else(|e| e.into_inner()) = Some(audit);
    }

    fn state_from(&self, s: Snapshot) -> ShardState {
        let mut st = ShardState::from_snapshot(s, self.num_partitions);
        st.clocks = st.clocks.with_slack(self.slack);
        st
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<u32, Slot>> {
        // A panic while holding the lock would be a bug in this module; keep serving regardless.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shards served and held, for heartbeats.
    pub fn roles(&self) -> (Vec<u32>, Vec<u32>) {
        let slots = self.slots();
        let mut a: Vec<u32> = slots
            .iter()
            .filter(|(_, s)| s.active.is_some())
            .map(|(k, _)| *k)
            .collect();
        let mut b: Vec<u32> = slots
            .iter()
            .filter(|(_, s)| s.backup.is_some())
            .map(|(k, _)| *k)
            .collect();
        a.sort_unstable();
        b.sort_unstable();
        (a, b)
    }

    pub fn handovers_in_flight(&self) -> usize {
        *self.handovers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Install a shard as active directly (tests and benchmarks).
    pub fn install_active(&self, shard: u32, state: ShardState) {
        self.slots().entry(shard).or_default().active = Some(Active::new(state, None));
        self.changed.notify_waiters();
    }

    /// The backup copy held for `shard`, if any (tests).
    pub fn backup_copy(&self, shard: u32) -> Option<ShardState> {
        self.slots().get(&shard).and_then(|s| s.backup.clone())
    }

    /// The active state of `shard`, if served here (tests).
    pub fn active_copy(&self, shard: u32) -> Option<ShardState> {
        self.slots()
            .get(&shard)
            .and_then(|s| s.active.as_ref().map(|a| a.state.clone()))
    }

    /// Reconcile with a new view: start serving, hand over, keep or drop copies.
    pub fn apply_view(self: &Arc<Self>, view: &ClusterView) {
        *self.latest_view.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(view.clone()));
        self.reconcile(view);
    }

    fn reconcile(self: &Arc<Self>, view: &ClusterView) {
        let mut to_acquire = Vec::new();
        let mut to_hand_over = Vec::new();
        {
            let mut slots = self.slots();
            for p in &view.shards {
                let slot = slots.entry(p.shard).or_default();
                let backup_addr = p
                    .backup
                    .as_ref()
                    .filter(|b| **b != self.me)
                    .and_then(|b| view.data_addr(b))
                    .map(str::to_string);
                if p.active == self.me {
                    match &mut slot.active {
                        Some(a) if !a.moving && a.backup_addr != backup_addr => {
                            a.backup_addr = backup_addr;
                            a.synced_seq = None;
                        }
                        Some(a) if !a.moving => {}
                        _ if slot.acquiring.is_none() => {
                            let from = match &p.source {
                                ShardSource::Handover { from, .. } => Some(from.clone()),
                                _ => None,
                            };
                            let acquisition = Acquisition {
                                id: self
                                    .next_acquisition
                                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                                from,
                                since: slot.not_owner_at + 1,
                            };
                            to_acquire.push((
                                p.shard,
                                acquisition.id,
                                p.keys,
                                p.source.clone(),
                                backup_addr,
                            ));
                            slot.acquiring = Some(acquisition);
                        }
                        _ => {}
                    }
                } else {
                    slot.not_owner_at = slot.not_owner_at.max(view.epoch);
                    if let Some(a) = &mut slot.active
                        && !a.moving
                    {
                        a.moving = true;
                        let keep_as_backup = p.backup.as_ref() == Some(&self.me);
                        to_hand_over.push((p.shard, p.active.clone(), keep_as_backup));
                    }
                }
                let referenced = p.backup.as_ref() == Some(&self.me)
                    || matches!(&p.source, ShardSource::Restore { from } if *from == self.me)
                    || matches!(&p.source, ShardSource::Handover { fallback: Some(f), .. } if *f == self.me);
                if !referenced && p.active != self.me {
                    slot.backup = None;
                }
            }
        }
        self.changed.notify_waiters();
        for (shard, to, keep) in to_hand_over {
            let addr = view.data_addr(&to).map(str::to_string);
            self.spawn_handover(shard, view.epoch, to, addr, keep);
        }
        for (shard, id, keys, source, backup_addr) in to_acquire {
            let addrs: HashMap<InstanceId, String> = view
                .members
                .iter()
                .map(|m| (m.instance_id.clone(), m.data_addr.clone()))
                .collect();
            let node = self.clone();
            tokio::spawn(async move {
                node.acquire(shard, id, keys, source, addrs, backup_addr)
                    .await
            });
        }
    }

    /// Hand `shard` over to `to`, told so by the view of `epoch`: retried within the sender's
    /// budget until the new owner acknowledges it or says it is superseded.
    fn spawn_handover(
        self: &Arc<Self>,
        shard: u32,
        epoch: u64,
        to: InstanceId,
        addr: Option<String>,
        keep: bool,
    ) {
        *self.handovers.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let node = self.clone();
        let budget = self.timing().send_budget();
        tokio::spawn(async move {
            let snapshot = node.slots().get(&shard).and_then(|s| {
                s.active
                    .as_ref()
                    .filter(|a| a.moving)
                    .map(|a| a.state.snapshot())
            });
            if let (Some(snapshot), Some(addr)) = (snapshot, addr) {
                let seq = snapshot.seq;
                let t = Instant::now();
                let deadline = t + budget;
                let req = Request::Handover {
                    shard,
                    epoch,
                    from: node.me.clone(),
                    snapshot,
                };
                let mut delivered = false;
                let mut attempt = 0u32;
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        tracing::error!(shard, to = %to, epoch, "hand-over not delivered within its budget; the new owner restores from backup");
                        break;
                    }
                    match node.peers.call(&addr, &req, left.min(CALL_TIMEOUT)).await {
                        Ok(Response::Ack) => {
                            delivered = true;
                            break;
                        }
                        Ok(Response::Superseded) => {
                            tracing::error!(shard, to = %to, epoch, "the new owner no longer awaits this hand-over");
                            break;
                        }
                        other => {
                            tracing::warn!(shard, to = %to, attempt, ?other, "hand-over not accepted yet");
                            let left = deadline.saturating_duration_since(Instant::now());
                            tokio::time::sleep(left.min(Duration::from_millis(200))).await;
                        }
                    }
                    attempt += 1;
                }
                if delivered {
                    tracing::info!(shard, to = %to, seq, epoch, ms = t.elapsed().as_millis() as u64, "handed shard over");
                    let _ = node.events.send(PsEvent::HandedOver {
                        shard,
                        to: to.clone(),
                        seq,
                    });
                }
            }
            {
                let mut slots = node.slots();
                // Only the state being handed away: a newer one may have been installed since.
                if let Some(slot) = slots.get_mut(&shard)
                    && slot.active.as_ref().is_some_and(|a| a.moving)
                    && let Some(a) = slot.active.take()
                    && keep
                {
                    slot.backup = Some(a.state);
                }
            }
            node.changed.notify_waiters();
            *node.handovers.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        });
    }

    async fn acquire(
        self: Arc<Self>,
        shard: u32,
        id: u64,
        keys: KeyRange,
        source: ShardSource,
        addrs: HashMap<InstanceId, String>,
        backup_addr: Option<String>,
    ) {
        let t = Instant::now();
        let restore_from = match &source {
            ShardSource::Fresh | ShardSource::Lost => None,
            ShardSource::Handover { fallback, .. } => {
                if self.wait_for_handover(shard, id).await {
                    tracing::info!(
                        shard,
                        ms = t.elapsed().as_millis() as u64,
                        "serving shard (hand-over)"
                    );
                    self.catch_up();
                    return;
                }
                tracing::warn!(
                    shard,
                    ms = t.elapsed().as_millis() as u64,
                    ?fallback,
                    "no hand-over in time; restoring"
                );
                fallback.clone()
            }
            ShardSource::Restore { from } => Some(from.clone()),
        };
        let mut state = None;
        if let Some(from) = restore_from {
            state = self.restore(shard, &from, addrs.get(&from)).await;
            if state.is_none() {
                tracing::error!(shard, from = %from, "could not restore the backup; re-initialising the shard");
            }
        } else if matches!(source, ShardSource::Lost) {
            tracing::error!(
                shard,
                "shard lost with its owner and no backup; re-initialising it"
            );
        } else if !matches!(source, ShardSource::Fresh) {
            tracing::error!(
                shard,
                "no hand-over and no backup to fall back on; re-initialising the shard"
            );
        }
        let state = state.unwrap_or_else(|| {
            let values = self.app.init(keys.start as usize..keys.end as usize);
            let mut st = ShardState::fresh(keys.start, values, self.num_partitions);
            st.clocks = st.clocks.with_slack(self.slack);
            st
        });
        // Anything but a new job's shard may lag behind the clocks the workers have seen
        // complete (a backup, or nothing at all): it fast-forwards over them.
        let lineage = match source {
            ShardSource::Fresh => Lineage::Continuous,
            _ => Lineage::Restored,
        };
        let mut state = state;
        state.clocks = state.clocks.with_lineage(lineage);
        let seq = state.seq;
        let done = state.clocks.done().map_or(-1, |d| d as i64);
        let installed = {
            let mut slots = self.slots();
            let slot = slots.entry(shard).or_default();
            // Still ours to finish (a hand-over may have completed it meanwhile)?
            let ours = slot.acquiring.as_ref().is_some_and(|a| a.id == id);
            if ours {
                slot.acquiring = None;
                if !slot.serving() {
                    slot.active = Some(Active::new(state, backup_addr));
                }
            }
            ours
        };
        self.changed.notify_waiters();
        if installed {
            tracing::info!(
                shard,
                seq,
                done,
                ms = t.elapsed().as_millis() as u64,
                ?source,
                "serving shard"
            );
        }
        self.catch_up();
    }

    /// The layout may have moved on while a shard was being acquired (another backup, or
    /// another owner altogether): reconcile with the newest view.
    fn catch_up(self: &Arc<Self>) {
        let latest = self
            .latest_view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(v) = latest {
            self.reconcile(&v);
        }
    }

    /// Wait for the acquisition `id` of `shard` to be completed by a hand-over; false when the
    /// wait (longer than the sender's whole budget) is over first.
    async fn wait_for_handover(&self, shard: u32, id: u64) -> bool {
        let deadline = Instant::now() + self.timing().wait();
        loop {
            let notified = self.changed.notified();
            let pending = self
                .slots()
                .get(&shard)
                .and_then(|s| s.acquiring.as_ref())
                .is_some_and(|a| a.id == id);
            if !pending {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), notified).await;
        }
    }

    /// The copy held by `from` (here, or fetched over the network).
    async fn restore(
        &self,
        shard: u32,
        from: &InstanceId,
        addr: Option<&String>,
    ) -> Option<ShardState> {
        if *from == self.me {
            return self.slots().get_mut(&shard).and_then(|s| s.backup.clone());
        }
        let addr = addr?;
        for _ in 0..5 {
            match self
                .peers
                .call(addr, &Request::FetchBackup { shard }, CALL_TIMEOUT)
                .await
            {
                Ok(Response::Snapshot(Some(s))) => {
                    return Some(self.state_from(s));
                }
                Ok(Response::Snapshot(None)) => return None,
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        None
    }

    /// Copy every active shard whose backup is behind to its backup. Called periodically and, on
    /// an interruption warning, at once (the flush).
    pub async fn sync_backups(&self) {
        let work: Vec<(u32, String, Snapshot, i64)> = {
            let slots = self.slots();
            slots
                .iter()
                .filter_map(|(k, s)| {
                    let a = s.active.as_ref()?;
                    let addr = a.backup_addr.clone()?;
                    let done = a.state.clocks.done().map_or(-1, |d| d as i64);
                    (a.synced_seq != Some(a.state.seq))
                        .then(|| (*k, addr, a.state.snapshot(), done))
                })
                .collect()
        };
        for (shard, addr, snapshot, done) in work {
            let seq = snapshot.seq;
            match self
                .peers
                .call(
                    &addr,
                    &Request::BackupSync { shard, snapshot },
                    CALL_TIMEOUT,
                )
                .await
            {
                Ok(Response::Ack) => {
                    if let Some(a) = self.slots().get_mut(&shard).and_then(|s| s.active.as_mut()) {
                        a.synced_seq = Some(seq);
                    }
                    // The backup now holds every clock up to `done`: what a crash of this
                    // owner can no longer lose.
                    tracing::debug!(shard, seq, done, "backup synced");
                }
                other => tracing::warn!(shard, ?other, "backup sync failed"),
            }
        }
    }

    async fn pull(&self, shard: u32, need: Option<u64>, wait_ms: u32) -> Response {
        let deadline = Instant::now() + Duration::from_millis(u64::from(wait_ms));
        loop {
            let notified = self.changed.notified();
            let missing = {
                let slots = self.slots();
                let Some(slot) = slots.get(&shard) else {
                    return Response::NotOwner;
                };
                match &slot.active {
                    Some(a) if !a.moving => {
                        if need.is_none_or(|c| a.state.clocks.is_complete(c)) {
                            return Response::Params {
                                seq: a.state.seq,
                                done: a.state.clocks.done(),
                                values: Arc::clone(&a.state.values),
                            };
                        }
                        need.map(|c| a.state.clocks.missing(c)).unwrap_or_default()
                    }
                    _ if slot.acquiring.is_some() => return Response::Busy,
                    _ => return Response::NotOwner,
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Response::NotReady { missing };
            }
            let _ = tokio::time::timeout(left, notified).await;
        }
    }

    fn push(&self, shard: u32, clock: u64, partitions: &[u32], delta: &[f32]) -> Response {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(&shard) else {
            return Response::NotOwner;
        };
        let resp = match &mut slot.active {
            Some(a) if !a.moving => match a.state.push(clock, partitions, delta) {
                Ok(o) => {
                    if o == PushOutcome::Applied
                        && let Some(audit) = self
                            .audit
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .as_ref()
                    {
                        audit(AuditEvent::Applied {
                            shard,
                            clock,
                            partitions: partitions.to_vec(),
                        });
                    }
                    Response::Pushed(o)
                }
                Err(e) => Response::Error(e),
            },
            _ if slot.acquiring.is_some() => Response::Busy,
            _ => Response::NotOwner,
        };
        drop(slots);
        if matches!(resp, Response::Pushed(PushOutcome::Applied)) {
            self.changed.notify_waiters();
        }
        resp
    }

    /// A background copy from the active owner: kept unless an equally new one is held.
    fn install_backup(&self, shard: u32, snapshot: Snapshot) -> Response {
        let state = self.state_from(snapshot);
        {
            let mut slots = self.slots();
            let slot = slots.entry(shard).or_default();
            if slot.backup.as_ref().is_none_or(|b| b.seq <= state.seq) {
                slot.backup = Some(state);
            }
        }
        self.changed.notify_waiters();
        Response::Ack
    }

    /// A departing owner's final state: served only if it is the awaited one
    /// ([`judge_handover`]); otherwise at most kept as the backup copy.
    fn receive_handover(
        &self,
        shard: u32,
        epoch: u64,
        from: InstanceId,
        snapshot: Snapshot,
    ) -> Response {
        let latest_epoch = self.latest_epoch();
        let tag = HandoverTag {
            from,
            epoch,
            seq: snapshot.seq,
        };
        let verdict = {
            let mut slots = self.slots();
            let slot = slots.entry(shard).or_default();
            let verdict = judge_handover(
                slot.acquiring.as_ref(),
                slot.serving(),
                slot.active.as_ref().and_then(|a| a.installed_from.as_ref()),
                slot.backup.as_ref().map(|b| b.seq),
                latest_epoch,
                &tag,
            );
            match verdict {
                HandoverVerdict::Install => {
                    let mut active = Active::new(self.state_from(snapshot), None);
                    active.installed_from = Some(tag.clone());
                    slot.active = Some(active);
                    slot.acquiring = None;
                }
                HandoverVerdict::NotYet { keep: true }
                | HandoverVerdict::Superseded { keep: true } => {
                    slot.backup = Some(self.state_from(snapshot));
                }
                HandoverVerdict::AlreadyInstalled
                | HandoverVerdict::NotYet { keep: false }
                | HandoverVerdict::Superseded { keep: false } => {}
            }
            verdict
        };
        match verdict {
            HandoverVerdict::Install => {
                tracing::info!(shard, from = %tag.from, epoch, seq = tag.seq, "hand-over installed");
                self.changed.notify_waiters();
                Response::Ack
            }
            HandoverVerdict::AlreadyInstalled => Response::Ack,
            HandoverVerdict::NotYet { keep } => {
                tracing::info!(shard, from = %tag.from, epoch, latest_epoch, kept_as_backup = keep, "hand-over ahead of this agent's view; not installed yet");
                Response::Busy
            }
            HandoverVerdict::Superseded { keep } => {
                tracing::warn!(shard, from = %tag.from, epoch, seq = tag.seq, latest_epoch, kept_as_backup = keep, "stale hand-over refused; the serving state is untouched");
                Response::Superseded
            }
        }
    }
}

impl Handler for PsNode {
    fn handle(self: Arc<Self>, req: Request) -> Pin<Box<dyn Future<Output = Response> + Send>> {
        Box::pin(async move {
            match req {
                Request::Pull {
                    shard,
                    need,
                    wait_ms,
                } => self.pull(shard, need, wait_ms).await,
                Request::Push {
                    shard,
                    clock,
                    partitions,
                    delta,
                } => self.push(shard, clock, &partitions, &delta),
                Request::BackupSync { shard, snapshot } => self.install_backup(shard, snapshot),
                Request::Handover {
                    shard,
                    epoch,
                    from,
                    snapshot,
                } => self.receive_handover(shard, epoch, from, snapshot),
                Request::Progress
                | Request::Offer { .. }
                | Request::Delegate { .. }
                | Request::ChunkPushed { .. } => Response::Error("this node runs no worker".into()),
                Request::FetchBackup { shard } => {
                    let slots = self.slots();
                    let copy = slots.get(&shard).and_then(|s| {
                        s.backup
                            .as_ref()
                            .map(|b| b.snapshot())
                            .or_else(|| s.active.as_ref().map(|a| a.state.snapshot()))
                    });
                    Response::Snapshot(copy)
                }
                Request::Opaque(_) => Response::Error("this agent runs no pipeline stage".into()),
            }
        })
    }
}

/// Periodic background sync until the node is dropped.
pub async fn run_backup_sync(node: Arc<PsNode>, interval: Duration) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        node.sync_backups().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_book_applies_each_partition_once() {
        let mut b = ClockBook::new(4);
        assert_eq!(b.record(0, &[0, 1]), PushOutcome::Applied);
        assert_eq!(b.record(0, &[0, 1]), PushOutcome::Duplicate);
        assert_eq!(
            b.record(0, &[1, 2]),
            PushOutcome::Conflict { already: vec![1] }
        );
        assert_eq!(b.missing(0), vec![2, 3]);
        assert_eq!(b.record(0, &[2, 3]), PushOutcome::Applied);
        assert!(b.is_complete(0));
        assert_eq!(b.record(0, &[3]), PushOutcome::Duplicate);
        // A shard restored from an old backup sees the job's current clock and skips ahead.
        let mut b = b.with_lineage(Lineage::Restored);
        assert_eq!(b.record(5, &[0]), PushOutcome::Applied);
        assert!(b.is_complete(4));
        assert_eq!(b.missing(5), vec![1, 2, 3]);
    }

    #[test]
    fn a_continuous_shard_refuses_a_push_beyond_the_staleness_bound() {
        let mut b = ClockBook::new(2);
        assert_eq!(b.record(0, &[0, 1]), PushOutcome::Applied);
        assert_eq!(b.record(1, &[0]), PushOutcome::Applied);
        // BSP: clock 2 needs clock 1 complete; partition 1's update of clock 1 is still on its
        // way. Refused, and nothing recorded: clock 1 stays open for it.
        assert_eq!(
            b.record(2, &[0]),
            PushOutcome::BeyondBound { done: Some(0) }
        );
        assert_eq!(b.missing(1), vec![1]);
        assert_eq!(b.record(1, &[1]), PushOutcome::Applied);
        assert_eq!(b.record(2, &[0]), PushOutcome::Applied);
        // Under slack 1 the bound is one clock further.
        let mut b = ClockBook::new(1).with_slack(1);
        assert_eq!(b.record(1, &[0]), PushOutcome::Applied);
        assert_eq!(b.record(2, &[0]), PushOutcome::BeyondBound { done: None });
        assert_eq!(b.lineage(), Lineage::Continuous);
    }

    #[test]
    fn a_restored_shard_fast_forwards_until_a_clock_completes_by_its_own_pushes() {
        let mut b = ClockBook::new(2).with_lineage(Lineage::Restored);
        // Restored at nothing; the workers are at clock 7.
        assert_eq!(b.record(7, &[0]), PushOutcome::Applied);
        assert!(b.is_complete(6));
        assert_eq!(b.lineage(), Lineage::Restored);
        assert_eq!(b.record(7, &[1]), PushOutcome::Applied);
        assert!(b.is_complete(7));
        // Clock 7 completed here: from now on the bound holds.
        assert_eq!(b.lineage(), Lineage::Continuous);
        assert_eq!(b.record(8, &[0]), PushOutcome::Applied);
        assert_eq!(
            b.record(9, &[0]),
            PushOutcome::BeyondBound { done: Some(7) }
        );
        // The flag travels with a snapshot (a hand-over of a shard still catching up).
        let st = ShardState {
            start: 0,
            values: Arc::new(vec![0.0]),
            seq: 0,
            clocks: ClockBook::new(2).with_lineage(Lineage::Restored),
        };
        let back = ShardState::from_snapshot(st.snapshot(), 2);
        assert_eq!(back.clocks.lineage(), Lineage::Restored);
    }

    fn tag(from: &str, epoch: u64, seq: u64) -> HandoverTag {
        HandoverTag {
            from: InstanceId(from.into()),
            epoch,
            seq,
        }
    }

    fn acquiring(from: &str, since: u64) -> Acquisition {
        Acquisition {
            id: 1,
            from: Some(InstanceId(from.into())),
            since,
        }
    }

    #[test]
    fn only_the_awaited_handover_is_installed() {
        use HandoverVerdict::*;
        let acq = acquiring("a", 4);
        // From the awaited sender in this ownership (also from a view newer than ours).
        assert_eq!(
            judge_handover(Some(&acq), false, None, None, 4, &tag("a", 4, 9)),
            Install
        );
        assert_eq!(
            judge_handover(Some(&acq), false, None, None, 4, &tag("a", 5, 9)),
            Install
        );
        // An older epoch (a previous ownership), or another sender: never installed.
        assert_eq!(
            judge_handover(Some(&acq), false, None, None, 4, &tag("a", 3, 9)),
            Superseded { keep: true }
        );
        assert_eq!(
            judge_handover(Some(&acq), false, None, Some(20), 4, &tag("x", 4, 9)),
            Superseded { keep: false }
        );
        // Nothing awaited from anyone: not installed, whatever it carries.
        let restoring = Acquisition {
            from: None,
            ..acq.clone()
        };
        assert_eq!(
            judge_handover(Some(&restoring), false, None, None, 4, &tag("a", 4, 9)),
            Superseded { keep: true }
        );
        // A shard served here already is never replaced...
        assert_eq!(
            judge_handover(None, true, None, Some(3), 4, &tag("a", 4, 9)),
            Superseded { keep: true }
        );
        // ... not even by an awaited-looking one while it serves, nor by one from the future.
        assert_eq!(
            judge_handover(Some(&acq), true, None, None, 4, &tag("a", 4, 9)),
            Superseded { keep: true }
        );
        assert_eq!(
            judge_handover(None, true, None, Some(9), 4, &tag("a", 8, 9)),
            Superseded { keep: false }
        );
        // The one it was installed from, again: acknowledged, nothing to do.
        assert_eq!(
            judge_handover(None, true, Some(&tag("a", 4, 9)), None, 4, &tag("a", 4, 9)),
            AlreadyInstalled
        );
        // Ahead of our view and nothing held: the sender should retry.
        assert_eq!(
            judge_handover(None, false, None, Some(9), 4, &tag("a", 5, 9)),
            NotYet { keep: false }
        );
        assert_eq!(
            judge_handover(None, false, None, Some(8), 4, &tag("a", 4, 9)),
            Superseded { keep: true }
        );
    }

    #[test]
    fn the_receiver_waits_longer_than_the_sender_retries() {
        let t = HandoverTiming::default();
        assert!(t.wait() > t.send_budget());
        assert_eq!(t.wait(), HANDOVER_WAIT);
        let short = HandoverTiming::from_send_budget(Duration::from_millis(50), Duration::ZERO);
        assert!(short.wait() > short.send_budget());
    }

    #[test]
    fn clock_book_under_slack_waits_for_earlier_clocks() {
        let mut b = ClockBook::new(2).with_slack(1);
        assert_eq!(b.record(0, &[0]), PushOutcome::Applied);
        // Clock 1 may fill while clock 0 is partial (slack 1): no fast-forward...
        assert_eq!(b.record(1, &[0, 1]), PushOutcome::Applied);
        assert!(!b.is_complete(0) && !b.is_complete(1));
        // ... and completing clock 0 completes both.
        assert_eq!(b.record(0, &[1]), PushOutcome::Applied);
        assert!(b.is_complete(1));
        // A push two clocks ahead of an incomplete one (more than the slack) is refused...
        assert_eq!(
            b.record(4, &[0]),
            PushOutcome::BeyondBound { done: Some(1) }
        );
        // ... unless the shard was restored from a backup: then it fast-forwards.
        let mut b = b.with_lineage(Lineage::Restored);
        assert_eq!(b.record(4, &[0]), PushOutcome::Applied);
        assert!(b.is_complete(2) && !b.is_complete(3));
    }
}
