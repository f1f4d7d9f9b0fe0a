//! FlexRR's RapidReassignment: idle workers take over a contiguous chunk of a slower peer's
//! unprocessed input range of a clock, and a warned worker hands its unprocessed range to its
//! helpers at once.
//!
//! Pull protocol (as FlexPS's `rapid_reassignment` does it): a worker that has finished its own
//! range of a clock asks the workers it helps for their [`RangeProgress`] (clock, next item,
//! end), picks the one with the most unstarted items in a clock it may compute (one it is at or
//! past, so its parameters are fresh enough), and *offers* to take the tail `split..end`. The
//! owner *confirms* only if it has not yet started item `split` and its range still ends at
//! `end` (no one else took that tail meanwhile); otherwise it *cancels*. Both steps happen
//! under the owner's [`Board`] lock, so an item is started by exactly one of them. Items are
//! input partitions of the clock, which is also the unit the parameter servers apply once: a
//! split range is pushed as two disjoint partition sets, and the shard's apply-once rule holds
//! unchanged.

use crate::audit::{Audit, AuditEvent};
use crate::transport::{Handler, RangeProgress, Request, Response};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::ClusterView;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;

#[derive(Debug, Clone)]
struct Current {
    clock: u64,
    start: u32,
    next: u32,
    end: u32,
}

#[derive(Debug, Clone)]
struct Given {
    clock: u64,
    range: Range<u32>,
    to: InstanceId,
}

#[derive(Debug, Default)]
struct BoardState {
    current: Option<Current>,
    /// An interruption warning arrived: start nothing more, hand the rest over.
    leaving: bool,
    /// The unprocessed part of the current clock at the warning.
    left_over: Option<(u64, Range<u32>)>,
    /// The worker has handed everything over (or there was nothing to hand over).
    released: bool,
    /// Chunks taken by helpers whose push is not known to be applied yet: not to be recomputed
    /// while their helper is alive (once applied, a shard that lost them needs them again).
    given: Vec<Given>,
    /// Offers answered (confirmed, cancelled), for logs.
    confirmed: u64,
    cancelled: u64,
}

/// One worker's range in the current clock, shared by the worker loop and the data-plane
/// handler that answers its helpers.
#[derive(Debug, Default)]
pub struct Board {
    state: Mutex<BoardState>,
    released: Notify,
}

impl Board {
    pub fn new() -> Arc<Board> {
        Arc::new(Board::default())
    }

    fn lock(&self) -> MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The worker starts `start..end` of `clock`. False if it is leaving: the whole range is
    /// then left over for its helpers.
    pub fn begin(&self, clock: u64, start: u32, end: u32) -> bool {
        let mut s = self.lock();
        if s.leaving {
            if s.left_over.is_none() && !s.released {
                s.left_over = Some((clock, start..end));
            }
            s.current = None;
            return false;
        }
        s.current = Some(Current {
            clock,
            start,
            next: start,
            end,
        });
        true
    }

    /// The next up to `max` items to start (None: nothing left, or leaving).
    pub fn take(&self, max: u32) -> Option<Range<u32>> {
        let mut s = self.lock();
        let c = s.current.as_mut()?;
        if c.next >= c.end {
            return None;
        }
        let r = c.next..(c.next.saturating_add(max.max(1))).min(c.end);
        c.next = r.end;
        Some(r)
    }

    /// The worker is done with its range: what it processed.
    pub fn finish(&self) -> Range<u32> {
        let mut s = self.lock();
        match s.current.take() {
            Some(c) => c.start..c.next,
            None => 0..0,
        }
    }

    /// What helpers see.
    pub fn progress(&self) -> Option<RangeProgress> {
        let s = self.lock();
        if s.leaving {
            return None;
        }
        s.current.as_ref().map(|c| RangeProgress {
            clock: c.clock,
            next: c.next,
            end: c.end,
        })
    }

    /// Step two of a hand-off: confirm (and stop at `split`) only if the range still ends at
    /// `end` and item `split` is not started yet.
    pub fn offer(&self, clock: u64, split: u32, end: u32, by: InstanceId) -> bool {
        let mut s = self.lock();
        let ok = !s.leaving
            && s.current.as_ref().is_some_and(|c| {
                c.clock == clock && c.end == end && c.next <= split && split < end
            });
        if ok {
            if let Some(c) = s.current.as_mut() {
                c.end = split;
            }
            s.given.push(Given {
                clock,
                range: split..end,
                to: by,
            });
            // Keep what a resend check can still ask about (a few clocks back).
            s.given.retain(|g| g.clock + 64 >= clock);
            s.confirmed += 1;
        } else {
            s.cancelled += 1;
        }
        ok
    }

    /// The helper's push of `start..end` of `clock` was applied.
    pub fn settle(&self, clock: u64, start: u32, end: u32) {
        self.lock()
            .given
            .retain(|g| !(g.clock == clock && g.range == (start..end)));
    }

    /// Whether partition `p` of `clock` was taken by a helper that is still a worker in `view`
    /// and has not reported its push applied (it is on the way; recomputing it would process it
    /// twice).
    pub fn given_away(&self, clock: u64, p: u32, view: &ClusterView) -> bool {
        self.lock()
            .given
            .iter()
            .any(|g| g.clock == clock && g.range.contains(&p) && view.worker(&g.to).is_some())
    }

    /// Offers confirmed and cancelled so far.
    pub fn offers(&self) -> (u64, u64) {
        let s = self.lock();
        (s.confirmed, s.cancelled)
    }

    /// An interruption warning: start nothing more. The unprocessed rest of the current clock
    /// (now, or of the next clock the worker begins) is to be handed to the helpers.
    pub fn leave(&self) {
        let mut guard = self.lock();
        let s = &mut *guard;
        s.leaving = true;
        if let Some(c) = s.current.as_mut()
            && s.left_over.is_none()
        {
            s.left_over = Some((c.clock, c.next..c.end));
            c.end = c.next;
        }
    }

    pub fn is_leaving(&self) -> bool {
        self.lock().leaving
    }

    /// The range left over at the warning, once (the worker hands it over).
    pub fn take_left_over(&self) -> Option<(u64, Range<u32>)> {
        self.lock().left_over.take()
    }

    /// A worker (re)starts on this board: a warning from now on waits for it again.
    pub fn rearm(&self) {
        self.lock().released = false;
    }

    /// The worker has handed everything over (or stopped): the agent may tell the broker.
    pub fn release(&self) {
        self.lock().released = true;
        self.released.notify_waiters();
    }

    /// Wait until [`Board::release`] or `timeout`; true if released.
    pub async fn wait_released(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.released.notified();
            if self.lock().released {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.lock().released;
            }
        }
    }
}

fn host(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// The helper group of worker `of`: `size` peers taken in rank order after it (wrapping), those
/// on other hosts first, so a machine's trouble does not slow its helpers too. Fixed for a view.
pub fn helper_group(view: &ClusterView, of: &InstanceId, size: u32) -> Vec<InstanceId> {
    let n = view.workers.len();
    let Some(pos) = view.workers.iter().position(|w| &w.instance_id == of) else {
        return Vec::new();
    };
    let my_host = view.data_addr(of).map(host).unwrap_or("");
    let mut ring: Vec<(bool, usize, &InstanceId)> = (1..n)
        .map(|k| {
            let w = &view.workers[(pos + k) % n].instance_id;
            let same = view.data_addr(w).map(host) == Some(my_host);
            (same, k, w)
        })
        .collect();
    ring.sort_by_key(|(same, k, _)| (*same, *k));
    ring.into_iter()
        .take(size as usize)
        .map(|(_, _, w)| w.clone())
        .collect()
}

/// The workers `me` helps: those whose helper group contains it.
pub fn helpees(view: &ClusterView, me: &InstanceId, size: u32) -> Vec<InstanceId> {
    view.workers
        .iter()
        .map(|w| &w.instance_id)
        .filter(|w| *w != me && helper_group(view, w, size).contains(me))
        .cloned()
        .collect()
}

/// How many of `remaining` unstarted items a helper offers to take from a worker with `group`
/// helpers: an even share among the owner and its helpers, so that several helpers taking
/// turns end close to together instead of one of them taking half and finishing last.
pub fn chunk(remaining: u32, group: u32) -> u32 {
    remaining.div_ceil(group + 1).max(1).min(remaining)
}

/// What a worker does for its [`Node`]: compute a range a warned peer hands it.
pub trait Delegate: Send + Sync + 'static {
    /// Compute `partitions` of `clock` and push their update; true once applied.
    fn run_delegated(
        &self,
        clock: u64,
        partitions: Vec<u32>,
    ) -> Pin<Box<dyn Future<Output = bool> + Send>>;
}

/// The data-plane handler of an agent: RapidReassignment requests go to its worker's
/// [`Board`] (and a delegated range to the worker itself), every other request to the handler
/// it wraps (the agent's parameter-server shards).
pub struct Node {
    ps: Arc<dyn Handler>,
    board: Arc<Board>,
    me: InstanceId,
    worker: Mutex<Option<Arc<dyn Delegate>>>,
    audit: Option<Audit>,
}

impl Node {
    pub fn new(
        me: InstanceId,
        ps: Arc<dyn Handler>,
        board: Arc<Board>,
        audit: Option<Audit>,
    ) -> Arc<Node> {
        Arc::new(Node {
            ps,
            board,
            me,
            worker: Mutex::new(None),
            audit,
        })
    }

    /// The worker delegated ranges are computed by (set when the worker starts).
    pub fn set_worker(&self, worker: impl Delegate) {
        *self.worker.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(worker));
    }

    fn worker(&self) -> Option<Arc<dyn Delegate>> {
        self.worker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Handler for Node {
    fn handle(self: Arc<Self>, req: Request) -> Pin<Box<dyn Future<Output = Response> + Send>> {
        Box::pin(async move {
            match req {
                Request::Progress => Response::Progress(self.board.progress()),
                Request::Offer {
                    clock,
                    split,
                    end,
                    by,
                } => {
                    let accepted = self.board.offer(clock, split, end, InstanceId(by));
                    if let Some(a) = &self.audit {
                        a(AuditEvent::Offer {
                            owner: self.me.clone(),
                            clock,
                            split,
                            end,
                            accepted,
                        });
                    }
                    Response::Offer(accepted)
                }
                Request::ChunkPushed { clock, start, end } => {
                    self.board.settle(clock, start, end);
                    Response::Ack
                }
                Request::Delegate { clock, partitions } => {
                    let Some(worker) = self.worker().filter(|_| !self.board.is_leaving()) else {
                        return Response::Busy;
                    };
                    if worker.run_delegated(clock, partitions).await {
                        Response::Ack
                    } else {
                        Response::Busy
                    }
                }
                other => self.ps.clone().handle(other).await,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proteus_wire::Tier;
    use proteus_wire::agent_api::{MemberInfo, PartitionRange, Stage, WorkerAssignment};

    fn view(hosts: &[&str]) -> ClusterView {
        let id = |i: usize| InstanceId(format!("w{i}"));
        ClusterView {
            epoch: 1,
            stage: Stage::Stage1,
            founders: Vec::new(),
            pipeline: None,
            profiler: None,
            members: hosts
                .iter()
                .enumerate()
                .map(|(i, h)| MemberInfo {
                    instance_id: id(i),
                    tier: Tier::Transient,
                    data_addr: format!("{h}:{}", 1000 + i),
                    draining: false,
                })
                .collect(),
            shards: Vec::new(),
            workers: (0..hosts.len())
                .map(|i| WorkerAssignment {
                    instance_id: id(i),
                    rank: i as u32,
                    partitions: PartitionRange {
                        start: i as u32 * 4,
                        end: i as u32 * 4 + 4,
                    },
                })
                .collect(),
            num_partitions: hosts.len() as u32 * 4,
            model_len: 1,
        }
    }

    #[test]
    fn helper_groups_prefer_other_hosts_and_are_fixed_size() {
        let v = view(&["a", "a", "b", "c"]);
        let w = |i: usize| InstanceId(format!("w{i}"));
        // w0 is on host a with w1: w2 and w3 come first.
        assert_eq!(helper_group(&v, &w(0), 2), vec![w(2), w(3)]);
        assert_eq!(helper_group(&v, &w(0), 3), vec![w(2), w(3), w(1)]);
        assert_eq!(helper_group(&v, &w(3), 1), vec![w(0)]);
        // Everyone is helped by someone; groups never include the worker itself.
        for i in 0..4 {
            assert!(!helper_group(&v, &w(i), 3).contains(&w(i)));
            assert!(!helpees(&v, &w(i), 2).is_empty());
        }
    }

    #[test]
    fn offers_confirm_only_before_the_split_point() {
        let b = Board::new();
        let h = InstanceId("h".into());
        assert!(b.begin(3, 0, 8));
        assert_eq!(b.take(1), Some(0..1));
        assert_eq!(b.take(1), Some(1..2));
        // The owner has started item 1: a split at 1 is cancelled, one at 5 confirmed.
        assert!(!b.offer(3, 1, 8, h.clone()));
        assert!(b.offer(3, 5, 8, h.clone()));
        // The tail moved: an offer computed against the old end is cancelled.
        assert!(!b.offer(3, 6, 8, h.clone()));
        assert!(!b.offer(2, 3, 5, h.clone()), "another clock");
        let mut started = vec![0..1, 1..2];
        while let Some(r) = b.take(2) {
            started.push(r);
        }
        assert_eq!(started.last(), Some(&(4..5)));
        assert_eq!(b.finish(), 0..5);
        assert_eq!(b.offers(), (1, 3));
        // Taken chunks are not recomputed while their helper is alive and its push pending.
        let mut v = view(&["a", "b"]);
        v.workers[1].instance_id = h.clone();
        assert!(b.given_away(3, 6, &v));
        v.workers[1].instance_id = InstanceId("other".into());
        assert!(!b.given_away(3, 6, &v), "helper gone");
        v.workers[1].instance_id = h.clone();
        b.settle(3, 5, 8);
        assert!(!b.given_away(3, 6, &v), "push applied");
    }

    #[test]
    fn leaving_leaves_the_unstarted_rest_over() {
        let b = Board::new();
        assert!(b.begin(7, 4, 12));
        assert_eq!(b.take(1), Some(4..5));
        b.leave();
        assert_eq!(b.take(1), None);
        assert_eq!(b.progress(), None, "a leaving worker is not offered to");
        assert_eq!(b.take_left_over(), Some((7, 5..12)));
        assert_eq!(b.finish(), 4..5);
        // Warned between clocks: the next clock's whole range is left over.
        let b = Board::new();
        b.leave();
        assert!(!b.begin(8, 0, 4));
        assert_eq!(b.take_left_over(), Some((8, 0..4)));
    }

    #[test]
    fn chunks_share_the_rest_evenly() {
        assert_eq!(chunk(8, 3), 2);
        assert_eq!(chunk(1, 3), 1);
        assert_eq!(chunk(7, 1), 4);
    }
}
