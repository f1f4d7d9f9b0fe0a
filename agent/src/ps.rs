//! The parameter-server side of an agent: the ActivePS shards it serves, the BackupPS copies it
//! holds, background sync, hand-over and promotion.

use crate::apps::App;
use crate::reassign::{Audit, AuditEvent};
use crate::transport::{ClockState, Handler, Peers, PushOutcome, Request, Response, Snapshot};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{ClusterView, ShardSource};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};

/// How long a new owner waits for the departing owner's hand-over before restoring a backup.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(10);
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Applies pushes exactly once per (clock, partition).
#[derive(Debug, Clone)]
pub struct ClockBook {
    num_partitions: u32,
    /// The sync model's slack: a push for clock `c` proves that clock `c - slack - 1` was
    /// complete when its worker started.
    slack: u32,
    done: Option<u64>,
    partial: BTreeMap<u64, BTreeSet<u32>>,
}

impl ClockBook {
    pub fn new(num_partitions: u32) -> Self {
        ClockBook {
            num_partitions,
            slack: 0,
            done: None,
            partial: BTreeMap::new(),
        }
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
    /// complete from every shard. A push for `c` while `c - s - 1` is incomplete here therefore
    /// means this shard was restored from a backup older than the job: the clocks up to there
    /// are lost for good, so the shard fast-forwards instead of waiting for updates nobody will
    /// send. Clocks after `c - s - 1` may legitimately still be filling in.
    pub fn record(&mut self, clock: u64, partitions: &[u32]) -> PushOutcome {
        if let Some(prev) = clock.checked_sub(u64::from(self.slack) + 1)
            && !self.is_complete(prev)
        {
            self.done = Some(prev);
            self.partial.retain(|c, _| *c > prev);
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
            clocks: ClockBook::from_state(num_partitions, &s.clocks),
            values: Arc::new(s.values),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            start: self.start,
            seq: self.seq,
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
}

/// Everything this agent holds of one shard.
#[derive(Debug, Default)]
struct Slot {
    active: Option<Active>,
    /// This agent was told it owns the shard and is waiting for its state.
    acquiring: bool,
    backup: Option<ShardState>,
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
        })
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
        self.slots().entry(shard).or_default().active = Some(Active {
            state,
            moving: false,
            backup_addr: None,
            synced_seq: None,
        });
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
                        _ if !slot.acquiring => {
                            slot.acquiring = true;
                            to_acquire.push((
                                p.shard,
                                p.keys.start,
                                p.keys.end,
                                p.source.clone(),
                                backup_addr,
                            ));
                        }
                        _ => {}
                    }
                } else if let Some(a) = &mut slot.active
                    && !a.moving
                {
                    a.moving = true;
                    let keep_as_backup = p.backup.as_ref() == Some(&self.me);
                    to_hand_over.push((p.shard, p.active.clone(), keep_as_backup));
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
            self.spawn_handover(shard, to, addr, keep);
        }
        for (shard, start, end, source, backup_addr) in to_acquire {
            let addrs: HashMap<InstanceId, String> = view
                .members
                .iter()
                .map(|m| (m.instance_id.clone(), m.data_addr.clone()))
                .collect();
            let node = self.clone();
            tokio::spawn(async move {
                node.acquire(shard, start, end, source, addrs, backup_addr)
                    .await
            });
        }
    }

    fn spawn_handover(
        self: &Arc<Self>,
        shard: u32,
        to: InstanceId,
        addr: Option<String>,
        keep: bool,
    ) {
        *self.handovers.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let node = self.clone();
        tokio::spawn(async move {
            let snapshot = node
                .slots()
                .get(&shard)
                .and_then(|s| s.active.as_ref().map(|a| a.state.snapshot()));
            if let (Some(snapshot), Some(addr)) = (snapshot, addr) {
                let seq = snapshot.seq;
                let t = Instant::now();
                let req = Request::Handover { shard, snapshot };
                let mut delivered = false;
                for attempt in 0..5 {
                    match node.peers.call(&addr, &req, CALL_TIMEOUT).await {
                        Ok(Response::Ack) => {
                            delivered = true;
                            break;
                        }
                        other => {
                            tracing::warn!(shard, to = %to, attempt, ?other, "hand-over not accepted yet");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
                if delivered {
                    tracing::info!(shard, to = %to, seq, ms = t.elapsed().as_millis() as u64, "handed shard over");
                    let _ = node.events.send(PsEvent::HandedOver {
                        shard,
                        to: to.clone(),
                        seq,
                    });
                } else {
                    tracing::error!(shard, to = %to, "hand-over failed; the new owner restores from backup");
                }
            }
            {
                let mut slots = node.slots();
                if let Some(slot) = slots.get_mut(&shard)
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
        start: u64,
        end: u64,
        source: ShardSource,
        addrs: HashMap<InstanceId, String>,
        backup_addr: Option<String>,
    ) {
        let t = Instant::now();
        let restore_from = match &source {
            ShardSource::Fresh | ShardSource::Lost => None,
            ShardSource::Handover { fallback, .. } => {
                if self.wait_for_handover(shard).await {
                    tracing::info!(
                        shard,
                        ms = t.elapsed().as_millis() as u64,
                        "serving shard (hand-over)"
                    );
                    return;
                }
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
        }
        let state = state.unwrap_or_else(|| {
            let values = self.app.init(start as usize..end as usize);
            let mut st = ShardState::fresh(start, values, self.num_partitions);
            st.clocks = st.clocks.with_slack(self.slack);
            st
        });
        let seq = state.seq;
        let done = state.clocks.done().map_or(-1, |d| d as i64);
        {
            let mut slots = self.slots();
            let slot = slots.entry(shard).or_default();
            slot.acquiring = false;
            if slot.active.is_none() {
                slot.active = Some(Active {
                    state,
                    moving: false,
                    backup_addr,
                    synced_seq: None,
                });
            }
        }
        self.changed.notify_waiters();
        tracing::info!(
            shard,
            seq,
            done,
            ms = t.elapsed().as_millis() as u64,
            ?source,
            "serving shard"
        );
        // The layout may have moved on while we were fetching (another backup, or another
        // owner altogether): catch up with the newest view.
        let latest = self
            .latest_view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(v) = latest {
            self.reconcile(&v);
        }
    }

    async fn wait_for_handover(&self, shard: u32) -> bool {
        let deadline = Instant::now() + HANDOVER_WAIT;
        loop {
            let notified = self.changed.notified();
            if self.slots().get(&shard).is_some_and(|s| s.active.is_some()) {
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
        let work: Vec<(u32, String, Snapshot)> = {
            let slots = self.slots();
            slots
                .iter()
                .filter_map(|(k, s)| {
                    let a = s.active.as_ref()?;
                    let addr = a.backup_addr.clone()?;
                    (a.synced_seq != Some(a.state.seq)).then(|| (*k, addr, a.state.snapshot()))
                })
                .collect()
        };
        for (shard, addr, snapshot) in work {
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
                    tracing::debug!(shard, seq, "backup synced");
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
                    _ if slot.acquiring => return Response::Busy,
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
            _ if slot.acquiring => Response::Busy,
            _ => Response::NotOwner,
        };
        drop(slots);
        if matches!(resp, Response::Pushed(PushOutcome::Applied)) {
            self.changed.notify_waiters();
        }
        resp
    }

    fn install(&self, shard: u32, snapshot: Snapshot, as_active: bool) -> Response {
        let state = self.state_from(snapshot);
        {
            let mut slots = self.slots();
            let slot = slots.entry(shard).or_default();
            if as_active {
                slot.active = Some(Active {
                    state,
                    moving: false,
                    backup_addr: None,
                    synced_seq: None,
                });
                slot.acquiring = false;
            } else if slot.backup.as_ref().is_none_or(|b| b.seq <= state.seq) {
                slot.backup = Some(state);
            }
        }
        self.changed.notify_waiters();
        Response::Ack
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
                Request::BackupSync { shard, snapshot } => self.install(shard, snapshot, false),
                Request::Handover { shard, snapshot } => {
                    // A hand-over may arrive before our view says we own the shard; keep a
                    // backup-slot copy in that case too, so nothing is lost either way.
                    self.install(shard, snapshot, true)
                }
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
                Request::Pipe(_) => Response::Error("this agent runs no pipeline stage".into()),
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
        assert_eq!(b.record(5, &[0]), PushOutcome::Applied);
        assert!(b.is_complete(4));
        assert_eq!(b.missing(5), vec![1, 2, 3]);
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
        // A push two clocks ahead of an incomplete one (more than the slack) fast-forwards.
        assert_eq!(b.record(4, &[0]), PushOutcome::Applied);
        assert!(b.is_complete(2) && !b.is_complete(3));
    }
}
