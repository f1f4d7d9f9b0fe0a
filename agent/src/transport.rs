//! Data plane between agents: TCP, length-delimited frames, tensors as raw little-endian f32.
//!
//! One connection per peer pair, used in both directions: each side may send requests on it, so
//! a connection accepted from a peer is reused when we need to call that peer. Every frame is
//!
//! ```text
//! u32 LE  length of the rest
//! u8      kind (0 hello, 1 request, 2 response)
//! u64 LE  request id (0 for hello)
//! ...     body (see Request / Response encode)
//! ```
//!
//! **Authentication.** Before any frame, both ends prove that they know the job's
//! [`DataSecret`] (which the broker hands each agent in its registration answer, over the
//! authenticated control channel): a challenge–response with HMAC-SHA256 over both sides'
//! random nonces, each direction under its own label so that one side's proof can never be
//! replayed or reflected as the other's:
//!
//! ```text
//! initiator → acceptor   "PRTSDP01" ‖ nonce_i (32 bytes)
//! acceptor → initiator   nonce_a (32) ‖ HMAC(secret, "proteus-dp1 acceptor" ‖ nonce_i ‖ nonce_a)
//! initiator → acceptor   HMAC(secret, "proteus-dp1 initiator" ‖ nonce_i ‖ nonce_a)
//! ```
//!
//! Every message has a fixed size and the whole exchange a deadline, so a peer that fails it
//! (wrong secret, wrong protocol, silence) is dropped before a single frame is read from it. A
//! shared-key MAC was chosen over mutual TLS with per-job certificates: the secret already
//! travels over the broker's TLS channel, so there is no certificate authority to run or
//! certificates to issue and expire, and the tensor stream is not encrypted and decrypted on
//! every clock (see `docs/aws.md` for what this does and does not protect against).
//!
//! **Frame bound.** A frame may declare at most the job's bound (see [`frame_bound`]): what its
//! model and batch sizes can legitimately need, not a global gigabyte. A larger declared length
//! closes the connection before anything is allocated for it.

use crate::error::{AgentError, Result};
use hmac::{KeyInit, Mac};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::DataSecret;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

/// The ceiling of every job's frame bound (see [`frame_bound`]).
pub const MAX_FRAME: usize = 1 << 30;

/// Room in every frame bound for what is not a tensor: frame header, ids, strings, small lists.
const FRAME_OVERHEAD: usize = 64 << 10;

/// The largest frame a job's agents can legitimately send each other: its largest tensor
/// (`tensor_floats` f32s: a shard's parameters, an update, a snapshot, an activation), its
/// partition lists (a push names at most `num_partitions`; a snapshot lists at most a few clocks
/// of them beyond the `slack` a worker may run ahead), and a fixed allowance for the rest.
pub fn frame_bound(tensor_floats: usize, num_partitions: u32, slack: u32) -> usize {
    let lists = (slack as usize + 8).saturating_mul(12 + 4 * num_partitions as usize);
    FRAME_OVERHEAD
        .saturating_add(lists)
        .saturating_add(tensor_floats.saturating_mul(4))
        .min(MAX_FRAME)
}

/// What a connection must satisfy on this agent's data plane: the job's secret (proved in the
/// hello) and its frame bound; optionally an emulated link speed.
#[derive(Clone, Debug)]
pub struct DataPlane {
    secret: DataSecret,
    max_frame: usize,
    link_limit: Option<f64>,
    link_latency: Option<Duration>,
    /// Off only in benchmarks measuring what the hello costs (feature `testing`).
    hello: bool,
}

impl DataPlane {
    /// `max_frame` from [`frame_bound`] (capped at [`MAX_FRAME`]).
    pub fn new(secret: DataSecret, max_frame: usize) -> Self {
        DataPlane {
            secret,
            max_frame: max_frame.min(MAX_FRAME),
            link_limit: None,
            link_latency: None,
            hello: true,
        }
    }

    /// Benchmarks only: connections skip the hello, to measure what it costs. Never in a build
    /// without the `testing` feature (the agent binary has none).
    #[cfg(feature = "testing")]
    pub fn without_hello_for_benchmarks(mut self) -> Self {
        self.hello = false;
        self
    }

    /// Every connection (accepted or opened) limited to `bytes_per_sec`, shared by its two
    /// directions; `None` is no limit.
    pub fn with_link_limit(mut self, bytes_per_sec: Option<f64>) -> Self {
        self.link_limit = bytes_per_sec.filter(|b| b.is_finite() && *b > 0.0);
        self
    }

    /// Every message arrives `latency` after its last byte was sent (an emulated propagation
    /// delay, on top of [`Self::with_link_limit`]'s transmission time); `None` or zero is none.
    pub fn with_link_latency(mut self, latency: Option<Duration>) -> Self {
        self.link_latency = latency.filter(|l| !l.is_zero());
        self
    }

    pub fn max_frame(&self) -> usize {
        self.max_frame
    }
}

const HELLO_MAGIC: &[u8; 8] = b"PRTSDP01";
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
/// The whole hello must be over within this; a silent peer does not hold a task for longer.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const LABEL_ACCEPTOR: &[u8] = b"proteus-dp1 acceptor";
const LABEL_INITIATOR: &[u8] = b"proteus-dp1 initiator";

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn hello_mac(secret: &DataSecret, label: &[u8], initiator: &[u8], acceptor: &[u8]) -> HmacSha256 {
    // A 32-byte key is always accepted by HMAC.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret.expose())
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(label);
    mac.update(initiator);
    mac.update(acceptor);
    mac
}

fn refused(message: &str) -> AgentError {
    AgentError::Handshake(message.to_string())
}

/// The initiator's side of the hello (see the module documentation).
pub async fn hello_as_initiator<S>(stream: &mut S, secret: &DataSecret) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let exchange = async {
        let mine: [u8; NONCE_LEN] = rand::random();
        let mut first = Vec::with_capacity(HELLO_MAGIC.len() + NONCE_LEN);
        first.extend_from_slice(HELLO_MAGIC);
        first.extend_from_slice(&mine);
        stream.write_all(&first).await?;
        let mut answer = [0u8; NONCE_LEN + MAC_LEN];
        stream.read_exact(&mut answer).await?;
        let (theirs, proof) = answer.split_at(NONCE_LEN);
        hello_mac(secret, LABEL_ACCEPTOR, &mine, theirs)
            .verify_slice(proof)
            .map_err(|_| refused("the peer does not know this job's secret"))?;
        let reply = hello_mac(secret, LABEL_INITIATOR, &mine, theirs)
            .finalize()
            .into_bytes();
        stream.write_all(&reply).await?;
        Ok(())
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange).await {
        Ok(r) => r,
        Err(_) => Err(refused("hello timed out")),
    }
}

/// The acceptor's side of the hello: `Ok` only for a peer that proved the secret.
pub async fn hello_as_acceptor<S>(stream: &mut S, secret: &DataSecret) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let exchange = async {
        let mut first = [0u8; HELLO_MAGIC.len() + NONCE_LEN];
        stream.read_exact(&mut first).await?;
        let (magic, theirs) = first.split_at(HELLO_MAGIC.len());
        if magic != HELLO_MAGIC {
            return Err(refused("not a Proteus data-plane hello"));
        }
        let mine: [u8; NONCE_LEN] = rand::random();
        let proof = hello_mac(secret, LABEL_ACCEPTOR, theirs, &mine)
            .finalize()
            .into_bytes();
        let mut answer = Vec::with_capacity(NONCE_LEN + MAC_LEN);
        answer.extend_from_slice(&mine);
        answer.extend_from_slice(&proof);
        stream.write_all(&answer).await?;
        let mut reply = [0u8; MAC_LEN];
        stream.read_exact(&mut reply).await?;
        hello_mac(secret, LABEL_INITIATOR, theirs, &mine)
            .verify_slice(&reply)
            .map_err(|_| refused("the peer does not know this job's secret"))
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange).await {
        Ok(r) => r,
        Err(_) => Err(refused("hello timed out")),
    }
}

const KIND_HELLO: u8 = 0;
const KIND_REQUEST: u8 = 1;
const KIND_RESPONSE: u8 = 2;

/// Bookkeeping of which partitions of which clocks a shard has applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClockState {
    /// Highest clock for which every partition's update is in (None: none yet).
    pub done: Option<u64>,
    /// Clocks after `done` with some partitions in.
    pub partial: Vec<(u64, Vec<u32>)>,
}

/// Where a shard's state comes from, as far as its clocks are concerned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Lineage {
    /// Every update the job's workers were told is in is in: a fresh shard, or one handed over
    /// in full from its previous owner. A push that breaks the sync model's staleness bound is
    /// refused ([`PushOutcome::BeyondBound`]).
    #[default]
    Continuous,
    /// Restored from a backup (or re-initialised after the shard was lost): it may lag behind
    /// the clocks the workers have already seen complete, so it fast-forwards over them instead
    /// of refusing, until a clock completes on it by its own pushes.
    Restored,
}

/// A shard's full state: what a backup holds and what a hand-over moves.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub start: u64,
    /// Number of updates applied since the shard was created; a copy at `seq` holds exactly
    /// updates `1..=seq`.
    pub seq: u64,
    /// Whether the shard may still lag behind the job's clocks (see [`Lineage`]).
    pub lineage: Lineage,
    pub clocks: ClockState,
    pub values: Vec<f32>,
}

/// A request between agents.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Parameters of `shard` once clock `need` is complete there (no wait when `None`).
    Pull {
        shard: u32,
        need: Option<u64>,
        wait_ms: u32,
    },
    /// The summed update of `partitions` at `clock`, for this shard's key range.
    Push {
        shard: u32,
        clock: u64,
        partitions: Vec<u32>,
        delta: Vec<f32>,
    },
    /// Background copy from the ActivePS to the BackupPS.
    BackupSync { shard: u32, snapshot: Snapshot },
    /// Final state from a departing ActivePS to the new one. Fenced: the receiver serves it only
    /// while it is acquiring `shard` from `from` in an ownership that `epoch` belongs to;
    /// otherwise it is at most kept as a backup copy (see `ps::judge_handover`).
    Handover {
        shard: u32,
        /// The epoch of the view in which `from` was told to hand the shard over.
        epoch: u64,
        /// The departing owner.
        from: InstanceId,
        snapshot: Snapshot,
    },
    /// Ask a BackupPS for its copy (the new active owner restores from it).
    FetchBackup { shard: u32 },
    /// RapidReassignment: where is the worker in its current clock?
    Progress,
    /// RapidReassignment, step one: a helper offers to take partitions `split..end` of the
    /// worker's current range at `clock`. Answered with [`Response::Offer`].
    Offer {
        clock: u64,
        split: u32,
        end: u32,
        /// The helper's instance id (the worker remembers who took what).
        by: String,
    },
    /// The helper's push of the chunk `start..end` of `clock` it took over was applied: the
    /// owner may recompute it again should a shard lose it.
    ChunkPushed { clock: u64, start: u32, end: u32 },
    /// A warned worker hands `partitions` of `clock` to a helper, which answers
    /// [`Response::Ack`] once it has pushed their update (anything else: not taken).
    Delegate { clock: u64, partitions: Vec<u32> },
    /// An application's own message, which the transport neither reads nor writes: the bytes
    /// its sender encoded, carried as the rest of the frame body (tag 10). The receiving
    /// handler decodes them and answers a malformed one with [`Response::Error`].
    Opaque(Vec<u8>),
}

/// A worker's position within a clock, for RapidReassignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeProgress {
    pub clock: u64,
    /// The next partition the worker will start; `next..end` is not started yet.
    pub next: u32,
    pub end: u32,
}

/// Outcome of a push.
#[derive(Debug, Clone, PartialEq)]
pub enum PushOutcome {
    Applied,
    /// Every partition of it was already in (or the clock is complete): ignored.
    Duplicate,
    /// Some partitions were in already: nothing applied; resend the others alone.
    Conflict {
        already: Vec<u32>,
    },
    /// Nothing applied: the push's clock is further ahead of this shard's complete clocks than
    /// the sync model's slack allows, and the shard is not one restored from a backup (which
    /// would fast-forward instead). Retry once the earlier clocks are in.
    BeyondBound {
        /// The shard's highest complete clock.
        done: Option<u64>,
    },
}

/// An answer between agents.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    Params {
        seq: u64,
        done: Option<u64>,
        values: Arc<Vec<f32>>,
    },
    /// Clock `need` is still incomplete; these partitions are missing.
    NotReady {
        missing: Vec<u32>,
    },
    Pushed(PushOutcome),
    /// This agent does not serve that shard (any more): refresh the view.
    NotOwner,
    /// This agent is becoming the shard's owner: retry shortly.
    Busy,
    Ack,
    Snapshot(Option<Snapshot>),
    Error(String),
    /// The worker's position (None: not in a clock, or leaving).
    Progress(Option<RangeProgress>),
    /// RapidReassignment, step two: `true` confirms the hand-off (the worker will stop at the
    /// split point), `false` cancels it (the worker had already passed it, or moved on).
    Offer(bool),
    /// A hand-over this agent does not await and never will (an older epoch, another sender,
    /// or a shard it already serves): not installed, and not worth retrying.
    Superseded,
}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

/// Append-only little-endian writer.
#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            None => self.u8(0),
            Some(x) => {
                self.u8(1);
                self.u64(x);
            }
        }
    }
    pub(crate) fn u32s(&mut self, v: &[u32]) {
        self.u32(v.len() as u32);
        for x in v {
            self.u32(*x);
        }
    }
    pub(crate) fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// Raw little-endian f32 array with a u64 count.
    pub fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        let start = self.0.len();
        // Resize then fill fixed-size chunks: this compiles to a straight copy on little-endian
        // machines, several times faster than pushing element by element.
        self.0.resize(start + v.len() * 4, 0);
        for (out, x) in self.0[start..].chunks_exact_mut(4).zip(v) {
            out.copy_from_slice(&x.to_le_bytes());
        }
    }
    fn snapshot(&mut self, s: &Snapshot) {
        self.u64(s.start);
        self.u64(s.seq);
        self.u8(match s.lineage {
            Lineage::Continuous => 0,
            Lineage::Restored => 1,
        });
        self.opt_u64(s.clocks.done);
        self.u32(s.clocks.partial.len() as u32);
        for (c, parts) in &s.clocks.partial {
            self.u64(*c);
            self.u32s(parts);
        }
        self.f32s(&s.values);
    }
}

/// Little-endian reader over a frame body; every read checks bounds.
pub struct Dec<'a>(pub &'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(AgentError::Frame(format!(
                "truncated: wanted {n} bytes, have {}",
                self.0.len()
            )));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn opt_u64(&mut self) -> Result<Option<u64>> {
        Ok(match self.u8()? {
            0 => None,
            _ => Some(self.u64()?),
        })
    }
    fn len(&mut self, elem: usize) -> Result<usize> {
        let n = self.u64_or_u32(elem)?;
        if n.saturating_mul(elem) > self.0.len() {
            return Err(AgentError::Frame(format!("array of {n} exceeds frame")));
        }
        Ok(n)
    }
    fn u64_or_u32(&mut self, elem: usize) -> Result<usize> {
        // f32 arrays carry a u64 count, the small u32 arrays a u32 count.
        if elem == 4 {
            Ok(self.u64()? as usize)
        } else {
            Ok(self.u32()? as usize)
        }
    }
    pub(crate) fn u32s(&mut self) -> Result<Vec<u32>> {
        let n = self.u32()? as usize;
        if n.saturating_mul(4) > self.0.len() {
            return Err(AgentError::Frame(format!("array of {n} exceeds frame")));
        }
        (0..n).map(|_| self.u32()).collect()
    }
    pub(crate) fn str(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| AgentError::Frame("string is not UTF-8".into()))
    }
    /// Everything not read yet (an opaque payload runs to the end of its frame).
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.len(4)?;
        let b = self.take(n * 4)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn snapshot(&mut self) -> Result<Snapshot> {
        let start = self.u64()?;
        let seq = self.u64()?;
        let lineage = match self.u8()? {
            0 => Lineage::Continuous,
            1 => Lineage::Restored,
            t => return Err(AgentError::Frame(format!("unknown lineage {t}"))),
        };
        let done = self.opt_u64()?;
        let n = self.u32()?;
        let mut partial = Vec::new();
        for _ in 0..n {
            let c = self.u64()?;
            partial.push((c, self.u32s()?));
        }
        let values = self.f32s()?;
        Ok(Snapshot {
            start,
            seq,
            lineage,
            clocks: ClockState { done, partial },
            values,
        })
    }
}

impl Request {
    /// Bytes of tensor payload, to size the frame buffer once.
    fn payload_bytes(&self) -> usize {
        match self {
            Request::Push {
                delta, partitions, ..
            } => delta.len() * 4 + partitions.len() * 4,
            Request::BackupSync { snapshot, .. } | Request::Handover { snapshot, .. } => {
                snapshot.values.len() * 4
            }
            Request::Opaque(bytes) => bytes.len(),
            _ => 0,
        }
    }

    pub fn encode(&self, e: &mut Enc) {
        match self {
            Request::Pull {
                shard,
                need,
                wait_ms,
            } => {
                e.u8(1);
                e.u32(*shard);
                e.opt_u64(*need);
                e.u32(*wait_ms);
            }
            Request::Push {
                shard,
                clock,
                partitions,
                delta,
            } => {
                e.u8(2);
                e.u32(*shard);
                e.u64(*clock);
                e.u32s(partitions);
                e.f32s(delta);
            }
            Request::BackupSync { shard, snapshot } => {
                e.u8(3);
                e.u32(*shard);
                e.snapshot(snapshot);
            }
            Request::Handover {
                shard,
                epoch,
                from,
                snapshot,
            } => {
                e.u8(4);
                e.u32(*shard);
                e.u64(*epoch);
                e.str(&from.0);
                e.snapshot(snapshot);
            }
            Request::FetchBackup { shard } => {
                e.u8(5);
                e.u32(*shard);
            }
            Request::Progress => e.u8(6),
            Request::Offer {
                clock,
                split,
                end,
                by,
            } => {
                e.u8(7);
                e.u64(*clock);
                e.u32(*split);
                e.u32(*end);
                e.str(by);
            }
            Request::Delegate { clock, partitions } => {
                e.u8(8);
                e.u64(*clock);
                e.u32s(partitions);
            }
            Request::ChunkPushed { clock, start, end } => {
                e.u8(9);
                e.u64(*clock);
                e.u32(*start);
                e.u32(*end);
            }
            Request::Opaque(bytes) => {
                e.u8(10);
                e.0.extend_from_slice(bytes);
            }
        }
    }

    pub fn decode(d: &mut Dec) -> Result<Request> {
        Ok(match d.u8()? {
            1 => Request::Pull {
                shard: d.u32()?,
                need: d.opt_u64()?,
                wait_ms: d.u32()?,
            },
            2 => Request::Push {
                shard: d.u32()?,
                clock: d.u64()?,
                partitions: d.u32s()?,
                delta: d.f32s()?,
            },
            3 => Request::BackupSync {
                shard: d.u32()?,
                snapshot: d.snapshot()?,
            },
            4 => Request::Handover {
                shard: d.u32()?,
                epoch: d.u64()?,
                from: InstanceId(d.str()?),
                snapshot: d.snapshot()?,
            },
            5 => Request::FetchBackup { shard: d.u32()? },
            6 => Request::Progress,
            7 => Request::Offer {
                clock: d.u64()?,
                split: d.u32()?,
                end: d.u32()?,
                by: d.str()?,
            },
            8 => Request::Delegate {
                clock: d.u64()?,
                partitions: d.u32s()?,
            },
            9 => Request::ChunkPushed {
                clock: d.u64()?,
                start: d.u32()?,
                end: d.u32()?,
            },
            10 => Request::Opaque(d.rest().to_vec()),
            t => return Err(AgentError::Frame(format!("unknown request tag {t}"))),
        })
    }
}

impl Response {
    fn payload_bytes(&self) -> usize {
        match self {
            Response::Params { values, .. } => values.len() * 4,
            Response::Snapshot(Some(s)) => s.values.len() * 4,
            _ => 0,
        }
    }

    pub fn encode(&self, e: &mut Enc) {
        match self {
            Response::Params { seq, done, values } => {
                e.u8(1);
                e.u64(*seq);
                e.opt_u64(*done);
                e.f32s(values);
            }
            Response::NotReady { missing } => {
                e.u8(2);
                e.u32s(missing);
            }
            Response::Pushed(o) => {
                e.u8(3);
                match o {
                    PushOutcome::Applied => e.u8(0),
                    PushOutcome::Duplicate => e.u8(1),
                    PushOutcome::Conflict { already } => {
                        e.u8(2);
                        e.u32s(already);
                    }
                    PushOutcome::BeyondBound { done } => {
                        e.u8(3);
                        e.opt_u64(*done);
                    }
                }
            }
            Response::NotOwner => e.u8(4),
            Response::Busy => e.u8(5),
            Response::Ack => e.u8(6),
            Response::Snapshot(s) => {
                e.u8(7);
                match s {
                    None => e.u8(0),
                    Some(s) => {
                        e.u8(1);
                        e.snapshot(s);
                    }
                }
            }
            Response::Error(m) => {
                e.u8(8);
                e.str(m);
            }
            Response::Progress(p) => {
                e.u8(9);
                match p {
                    None => e.u8(0),
                    Some(p) => {
                        e.u8(1);
                        e.u64(p.clock);
                        e.u32(p.next);
                        e.u32(p.end);
                    }
                }
            }
            Response::Offer(ok) => {
                e.u8(10);
                e.u8(u8::from(*ok));
            }
            Response::Superseded => e.u8(11),
        }
    }

    pub fn decode(d: &mut Dec) -> Result<Response> {
        Ok(match d.u8()? {
            1 => Response::Params {
                seq: d.u64()?,
                done: d.opt_u64()?,
                values: Arc::new(d.f32s()?),
            },
            2 => Response::NotReady { missing: d.u32s()? },
            3 => Response::Pushed(match d.u8()? {
                0 => PushOutcome::Applied,
                1 => PushOutcome::Duplicate,
                2 => PushOutcome::Conflict { already: d.u32s()? },
                3 => PushOutcome::BeyondBound { done: d.opt_u64()? },
                t => return Err(AgentError::Frame(format!("unknown push outcome {t}"))),
            }),
            4 => Response::NotOwner,
            5 => Response::Busy,
            6 => Response::Ack,
            7 => Response::Snapshot(match d.u8()? {
                0 => None,
                _ => Some(d.snapshot()?),
            }),
            8 => Response::Error(d.str()?),
            9 => Response::Progress(match d.u8()? {
                0 => None,
                _ => Some(RangeProgress {
                    clock: d.u64()?,
                    next: d.u32()?,
                    end: d.u32()?,
                }),
            }),
            10 => Response::Offer(d.u8()? != 0),
            11 => Response::Superseded,
            t => return Err(AgentError::Frame(format!("unknown response tag {t}"))),
        })
    }
}

/// A frame's body, decoded. A malformed message inside a well-formed frame is kept as its
/// error (the caller answers it); a frame whose header is unreadable ends the connection.
#[derive(Debug)]
pub enum Frame {
    /// The opener's data address (so that we reuse its connection to call it).
    Hello(Result<String>),
    Request {
        id: u64,
        req: Result<Request>,
    },
    Response {
        id: u64,
        resp: Result<Response>,
    },
}

/// Decodes one frame body (what [`read_frame`] returned).
pub fn decode_frame(body: &[u8]) -> Result<Frame> {
    let mut d = Dec(body);
    let kind = d.u8()?;
    let id = d.u64()?;
    Ok(match kind {
        KIND_HELLO => Frame::Hello(d.str()),
        KIND_REQUEST => Frame::Request {
            id,
            req: Request::decode(&mut d),
        },
        KIND_RESPONSE => Frame::Response {
            id,
            resp: Response::decode(&mut d),
        },
        k => return Err(AgentError::Frame(format!("unknown frame kind {k}"))),
    })
}

fn frame(kind: u8, id: u64, size_hint: usize, body: impl FnOnce(&mut Enc)) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(64 + size_hint));
    e.u32(0);
    e.u8(kind);
    e.u64(id);
    body(&mut e);
    let len = (e.0.len() - 4) as u32;
    e.0[..4].copy_from_slice(&len.to_le_bytes());
    e.0
}

// ---------------------------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------------------------

/// Serves requests that arrive from peers.
pub trait Handler: Send + Sync + 'static {
    fn handle(self: Arc<Self>, req: Request) -> Pin<Box<dyn Future<Output = Response> + Send>>;
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Response>>>>;

/// Which of a connection's two queues a request waits in (see [`Peers::call_background`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Urgent,
    Background,
}

struct Conn {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    /// Frames written only while `tx` has none waiting.
    background: mpsc::UnboundedSender<Vec<u8>>,
    pending: Pending,
    /// The emulated link's budget, charged by both directions of this connection.
    limit: Option<Arc<TokenBucket>>,
}

/// A token bucket of `rate` bytes per second that emulates a slow link: senders (and readers)
/// take tokens for the bytes they move and wait when the bucket is in debt.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, std::time::Instant)>,
}

/// Bytes moved per token-bucket charge: small enough that a large frame streams at the limit
/// instead of arriving in one late burst.
const LIMIT_CHUNK: usize = 32 << 10;

/// How late a token-bucket waiter may wake (tokio's timer works in milliseconds), with margin.
const TIMER_SLACK: Duration = Duration::from_millis(4);

impl TokenBucket {
    /// `rate` in bytes per second. The bucket holds one chunk, or what the link moves in
    /// [`TIMER_SLACK`] if that is more: a waiter wakes up to a millisecond late (the timer's
    /// resolution), and the bytes the link moved meanwhile must not be lost to the cap, or a
    /// fast link would run at a chunk per millisecond (32 MB/s) whatever its rate.
    pub fn new(rate: f64) -> Self {
        let rate = rate.max(1.0);
        let burst = (LIMIT_CHUNK as f64).max(rate * TIMER_SLACK.as_secs_f64());
        TokenBucket {
            rate,
            burst,
            state: Mutex::new((burst, std::time::Instant::now())),
        }
    }

    /// Charge `n` bytes at `now`: how long the caller must wait before moving them (the bucket
    /// refills at `rate` up to `burst`; a charge beyond the tokens left is debt to wait off).
    pub fn debit(&self, n: usize, now: std::time::Instant) -> Duration {
        let Ok(mut g) = self.state.lock() else {
            return Duration::ZERO;
        };
        let refill = now.saturating_duration_since(g.1).as_secs_f64() * self.rate;
        g.0 = (g.0 + refill).min(self.burst) - n as f64;
        g.1 = g.1.max(now);
        if g.0 < 0.0 {
            Duration::from_secs_f64(-g.0 / self.rate)
        } else {
            Duration::ZERO
        }
    }

    /// Take `n` bytes' worth of tokens, waiting as long as the link needs to move them.
    pub async fn take(&self, n: usize) {
        let wait = self.debit(n, std::time::Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// The agent's connections to its peers, keyed by the peer's data address.
pub struct Peers {
    my_addr: String,
    conns: Mutex<HashMap<String, Arc<Conn>>>,
    next_id: AtomicU64,
    handler: Mutex<Option<Arc<dyn Handler>>>,
    /// The job's secret; `None` once revoked (the job is over), which refuses every hello.
    secret: Mutex<Option<DataSecret>>,
    max_frame: usize,
    hello: bool,
    /// Bytes per second per connection (both directions together), to emulate slow links.
    link_limit: Option<f64>,
    link_latency: Option<Duration>,
}

impl Peers {
    /// `my_addr` is what peers use to reach us; it is sent in the hello so that they reuse the
    /// connection we opened instead of opening a second one. Every connection, opened or
    /// accepted, must pass `plane`'s hello and keep to its frame bound.
    pub fn new(my_addr: String, plane: DataPlane) -> Arc<Peers> {
        Arc::new(Peers {
            my_addr,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            handler: Mutex::new(None),
            secret: Mutex::new(Some(plane.secret)),
            max_frame: plane.max_frame,
            hello: plane.hello,
            link_limit: plane.link_limit,
            link_latency: plane.link_latency,
        })
    }

    /// Forget the job's secret and every connection: from now on no hello succeeds, in either
    /// direction. Called when the job is over for this agent.
    pub fn revoke(&self) {
        if let Ok(mut s) = self.secret.lock() {
            *s = None;
        }
        if let Ok(mut c) = self.conns.lock() {
            c.clear();
        }
    }

    fn secret(&self) -> Result<DataSecret> {
        self.secret
            .lock()
            .ok()
            .and_then(|s| s.clone())
            .ok_or_else(|| refused("this agent's data plane is closed (the job is over)"))
    }

    pub fn set_handler(&self, h: Arc<dyn Handler>) {
        if let Ok(mut g) = self.handler.lock() {
            *g = Some(h);
        }
    }

    fn handler(&self) -> Option<Arc<dyn Handler>> {
        self.handler.lock().ok().and_then(|g| g.clone())
    }

    /// Accept peer connections until the listener fails.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            match listener.accept().await {
                Ok((mut stream, from)) => {
                    let _ = stream.set_nodelay(true);
                    let peers = self.clone();
                    tokio::spawn(async move {
                        let hello = match peers.secret() {
                            Ok(_) if !peers.hello => Ok(()),
                            Ok(secret) => hello_as_acceptor(&mut stream, &secret).await,
                            Err(e) => Err(e),
                        };
                        match hello {
                            Ok(()) => peers.run_conn(stream, None).await,
                            // Dropped here: nothing of it was read as a frame.
                            Err(e) => {
                                tracing::warn!(peer = %from, error = %e, "refused a data-plane connection")
                            }
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Call `addr` and wait up to `timeout` for the answer.
    pub async fn call(
        self: &Arc<Self>,
        addr: &str,
        req: &Request,
        timeout: Duration,
    ) -> Result<Response> {
        self.call_in(Lane::Urgent, addr, req, timeout).await
    }

    /// [`Peers::call`] in the background lane: the request is written to the connection only
    /// while no urgent frame waits, so bulk traffic (a pipeline's snapshots) fills the link's
    /// spare capacity instead of delaying what the computation waits for. Keep such requests
    /// small: an urgent frame still waits for the background frame being written.
    pub async fn call_background(
        self: &Arc<Self>,
        addr: &str,
        req: &Request,
        timeout: Duration,
    ) -> Result<Response> {
        self.call_in(Lane::Background, addr, req, timeout).await
    }

    async fn call_in(
        self: &Arc<Self>,
        lane: Lane,
        addr: &str,
        req: &Request,
        timeout: Duration,
    ) -> Result<Response> {
        let conn = self.connect(addr).await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = conn.pending.lock() {
            p.insert(id, tx);
        }
        let bytes = frame(KIND_REQUEST, id, req.payload_bytes(), |e| req.encode(e));
        let peer_err = |m: &str| AgentError::Peer {
            peer: addr.to_string(),
            message: m.to_string(),
        };
        if bytes.len() - 4 > self.max_frame {
            // The peer would drop the connection: say why here instead.
            if let Ok(mut p) = conn.pending.lock() {
                p.remove(&id);
            }
            return Err(peer_err(&format!(
                "a request of {} bytes exceeds this job's frame bound of {} bytes",
                bytes.len() - 4,
                self.max_frame
            )));
        }
        let queued = match lane {
            Lane::Urgent => conn.tx.send(bytes),
            Lane::Background => conn.background.send(bytes),
        };
        if queued.is_err() {
            self.forget(addr, &conn);
            return Err(peer_err("connection closed"));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(_)) => {
                self.forget(addr, &conn);
                Err(peer_err("connection lost"))
            }
            Err(_) => {
                if let Ok(mut p) = conn.pending.lock() {
                    p.remove(&id);
                }
                Err(peer_err("timed out"))
            }
        }
    }

    fn forget(&self, addr: &str, conn: &Arc<Conn>) {
        if let Ok(mut c) = self.conns.lock()
            && c.get(addr).is_some_and(|x| Arc::ptr_eq(x, conn))
        {
            c.remove(addr);
        }
    }

    async fn connect(self: &Arc<Self>, addr: &str) -> Result<Arc<Conn>> {
        if let Some(c) = self.conns.lock().ok().and_then(|c| c.get(addr).cloned()) {
            return Ok(c);
        }
        let secret = self.secret()?;
        let mut stream = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr))
            .await
            .map_err(|_| AgentError::Peer {
                peer: addr.into(),
                message: "connect timed out".into(),
            })?
            .map_err(|e| AgentError::Peer {
                peer: addr.into(),
                message: format!("connect: {e}"),
            })?;
        let _ = stream.set_nodelay(true);
        if self.hello {
            hello_as_initiator(&mut stream, &secret)
                .await
                .map_err(|e| AgentError::Peer {
                    peer: addr.into(),
                    message: e.to_string(),
                })?;
        }
        let (conn, reader) = self.attach(stream, Some(addr.to_string()));
        let hello = frame(KIND_HELLO, 0, 0, |e| e.str(&self.my_addr));
        let _ = conn.tx.send(hello);
        let peers = self.clone();
        let key = addr.to_string();
        let c2 = conn.clone();
        tokio::spawn(async move { peers.read_loop(reader, c2, Some(key)).await });
        Ok(conn)
    }

    /// Split a stream into a registered connection (writer task running) and its read half.
    fn attach(
        self: &Arc<Self>,
        stream: TcpStream,
        key: Option<String>,
    ) -> (Arc<Conn>, OwnedReadHalf) {
        let (r, w) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let (background, background_rx) = mpsc::unbounded_channel();
        let limit = self.link_limit.map(|b| Arc::new(TokenBucket::new(b)));
        tokio::spawn(write_loop(w, rx, background_rx, limit.clone()));
        let conn = Arc::new(Conn {
            tx,
            background,
            pending: Arc::new(Mutex::new(HashMap::new())),
            limit,
        });
        if let Some(k) = key
            && let Ok(mut c) = self.conns.lock()
        {
            c.entry(k).or_insert_with(|| conn.clone());
        }
        (conn, r)
    }

    async fn run_conn(self: Arc<Self>, stream: TcpStream, key: Option<String>) {
        let (conn, reader) = self.attach(stream, key.clone());
        self.read_loop(reader, conn, key).await;
    }

    async fn read_loop(
        self: Arc<Self>,
        reader: OwnedReadHalf,
        conn: Arc<Conn>,
        mut key: Option<String>,
    ) {
        let mut reader = BufReader::with_capacity(1 << 16, reader);
        match self.link_latency {
            None => {
                while let Some(body) = self.next_frame(&mut reader, &conn, key.as_deref()).await {
                    if !self.on_frame(body, &conn, &mut key) {
                        break;
                    }
                }
            }
            Some(latency) => {
                // An emulated propagation delay: a frame is handled `latency` after its last
                // byte arrived, while the next frames keep arriving (a delay line, not a pause
                // of the link).
                let (tx, mut rx) = mpsc::unbounded_channel();
                let peers = self.clone();
                let (c2, k2) = (conn.clone(), key.clone());
                let reading = tokio::spawn(async move {
                    while let Some(body) = peers.next_frame(&mut reader, &c2, k2.as_deref()).await {
                        let due = tokio::time::Instant::now() + latency;
                        if tx.send((due, body)).is_err() {
                            break;
                        }
                    }
                });
                while let Some((due, body)) = rx.recv().await {
                    tokio::time::sleep_until(due).await;
                    if !self.on_frame(body, &conn, &mut key) {
                        break;
                    }
                }
                reading.abort();
            }
        }
        // Fail every call still waiting on this connection, and stop offering it.
        if let Ok(mut p) = conn.pending.lock() {
            p.clear();
        }
        if let Some(k) = key {
            self.forget(&k, &conn);
        }
    }

    /// The next frame's body, or `None` when the connection is over (or sent a bad frame).
    async fn next_frame(
        &self,
        reader: &mut BufReader<OwnedReadHalf>,
        conn: &Conn,
        key: Option<&str>,
    ) -> Option<Vec<u8>> {
        match read_frame(reader, conn.limit.as_deref(), self.max_frame).await {
            Ok(b) => Some(b),
            Err(AgentError::Frame(e)) => {
                tracing::warn!(peer = key.unwrap_or("?"), error = %e, "dropping a data-plane connection");
                None
            }
            Err(_) => None,
        }
    }

    /// Handles one frame; false when the connection must close.
    fn on_frame(
        self: &Arc<Self>,
        body: Vec<u8>,
        conn: &Arc<Conn>,
        key: &mut Option<String>,
    ) -> bool {
        let Ok(decoded) = decode_frame(&body) else {
            return false;
        };
        match decoded {
            Frame::Hello(addr) => {
                if let Ok(addr) = addr
                    && let Ok(mut c) = self.conns.lock()
                {
                    c.entry(addr.clone()).or_insert_with(|| conn.clone());
                    *key = Some(addr);
                }
            }
            Frame::Response { id, resp } => {
                let resp = resp.unwrap_or_else(|e| Response::Error(e.to_string()));
                let waiter = conn.pending.lock().ok().and_then(|mut p| p.remove(&id));
                if let Some(w) = waiter {
                    let _ = w.send(resp);
                }
            }
            Frame::Request { id, req } => {
                let handler = self.handler();
                let tx = conn.tx.clone();
                let max_frame = self.max_frame;
                tokio::spawn(async move {
                    let resp = match (req, handler) {
                        (Ok(req), Some(h)) => h.handle(req).await,
                        (Err(e), _) => Response::Error(e.to_string()),
                        (_, None) => Response::Busy,
                    };
                    let mut bytes =
                        frame(KIND_RESPONSE, id, resp.payload_bytes(), |e| resp.encode(e));
                    if bytes.len() - 4 > max_frame {
                        let refusal = Response::Error(format!(
                            "an answer of {} bytes exceeds this job's frame bound of {max_frame} bytes",
                            bytes.len() - 4
                        ));
                        bytes = frame(KIND_RESPONSE, id, 0, |e| refusal.encode(e));
                    }
                    let _ = tx.send(bytes);
                });
            }
        }
        true
    }
}

async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    mut background: mpsc::UnboundedReceiver<Vec<u8>>,
    limit: Option<Arc<TokenBucket>>,
) {
    loop {
        // Urgent frames first; a background frame only when none waits.
        let buf = tokio::select! {
            biased;
            Some(buf) = rx.recv() => buf,
            Some(buf) = background.recv() => buf,
            else => break,
        };
        let ok = match &limit {
            None => w.write_all(&buf).await.is_ok(),
            Some(bucket) => {
                let mut ok = true;
                for chunk in buf.chunks(LIMIT_CHUNK) {
                    bucket.take(chunk.len()).await;
                    if w.write_all(chunk).await.is_err() {
                        ok = false;
                        break;
                    }
                }
                ok
            }
        };
        if !ok {
            break;
        }
    }
    let _ = w.shutdown().await;
}

/// One frame's body. A declared length over `max_frame` is an error before any allocation.
pub async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    limit: Option<&TokenBucket>,
    max_frame: usize,
) -> Result<Vec<u8>> {
    let len = r.read_u32_le().await? as usize;
    if len > max_frame {
        return Err(AgentError::Frame(format!(
            "a frame of {len} bytes exceeds this job's bound of {max_frame} bytes"
        )));
    }
    // Read into spare capacity: no zeroing pass over multi-megabyte tensors.
    let mut body = Vec::with_capacity(len);
    match limit {
        None => {
            (&mut *r).take(len as u64).read_to_end(&mut body).await?;
        }
        Some(bucket) => {
            // The receiving end pays too: a link carries both directions within its budget.
            while body.len() < len {
                let want = (len - body.len()).min(LIMIT_CHUNK);
                let got = (&mut *r).take(want as u64).read_to_end(&mut body).await?;
                if got == 0 {
                    break;
                }
                bucket.take(got).await;
            }
        }
    }
    if body.len() != len {
        return Err(AgentError::Frame(format!(
            "connection closed after {} of {len} bytes",
            body.len()
        )));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip_req(r: Request) {
        let mut e = Enc::default();
        r.encode(&mut e);
        assert_eq!(Request::decode(&mut Dec(&e.0)).unwrap(), r);
    }

    #[test]
    fn messages_roundtrip() {
        roundtrip_req(Request::Pull {
            shard: 3,
            need: Some(7),
            wait_ms: 100,
        });
        roundtrip_req(Request::Push {
            shard: 1,
            clock: 9,
            partitions: vec![1, 2],
            delta: vec![1.5, -0.25],
        });
        let snapshot = Snapshot {
            start: 10,
            seq: 4,
            lineage: Lineage::Restored,
            clocks: ClockState {
                done: Some(3),
                partial: vec![(4, vec![0, 5])],
            },
            values: vec![0.5; 3],
        };
        roundtrip_req(Request::Handover {
            shard: 0,
            epoch: 12,
            from: InstanceId("t1".into()),
            snapshot: snapshot.clone(),
        });
        roundtrip_req(Request::Progress);
        roundtrip_req(Request::Offer {
            clock: 3,
            split: 5,
            end: 8,
            by: "t2".into(),
        });
        roundtrip_req(Request::Delegate {
            clock: 3,
            partitions: vec![4, 5],
        });
        roundtrip_req(Request::ChunkPushed {
            clock: 3,
            start: 5,
            end: 8,
        });
        roundtrip_req(Request::Opaque(vec![7, 3, 0, 0, 0]));
        roundtrip_req(Request::Opaque(Vec::new()));
        for resp in [
            Response::Params {
                seq: 1,
                done: None,
                values: Arc::new(vec![1.0, 2.0]),
            },
            Response::Pushed(PushOutcome::Conflict { already: vec![3] }),
            Response::Pushed(PushOutcome::BeyondBound { done: Some(6) }),
            Response::Pushed(PushOutcome::BeyondBound { done: None }),
            Response::Superseded,
            Response::Snapshot(Some(snapshot)),
            Response::Error("x".into()),
            Response::Progress(Some(RangeProgress {
                clock: 4,
                next: 2,
                end: 9,
            })),
            Response::Progress(None),
            Response::Offer(true),
            Response::Offer(false),
        ] {
            let mut e = Enc::default();
            resp.encode(&mut e);
            assert_eq!(Response::decode(&mut Dec(&e.0)).unwrap(), resp);
        }
    }

    #[test]
    fn truncated_frames_are_errors_not_panics() {
        let mut e = Enc::default();
        Request::Push {
            shard: 1,
            clock: 9,
            partitions: vec![1, 2],
            delta: vec![1.5; 100],
        }
        .encode(&mut e);
        for cut in 0..e.0.len() {
            assert!(Request::decode(&mut Dec(&e.0[..cut])).is_err());
        }
    }

    #[tokio::test]
    async fn a_fast_link_moves_bytes_at_its_rate_despite_the_timers_resolution() {
        // 125 MB/s (1 Gbit/s): a 32 KB chunk takes 0.26 ms, well under the timer's 1 ms.
        let rate = 125e6;
        let b = TokenBucket::new(rate);
        let total = 16 << 20;
        let t = std::time::Instant::now();
        for _ in 0..total / LIMIT_CHUNK {
            b.take(LIMIT_CHUNK).await;
        }
        let secs = t.elapsed().as_secs_f64();
        let ideal = total as f64 / rate;
        assert!(
            secs > 0.8 * ideal && secs < 1.25 * ideal,
            "{} MB took {secs:.3} s at {} MB/s (ideal {ideal:.3} s)",
            total >> 20,
            rate / 1e6
        );
    }

    #[test]
    fn token_bucket_paces_bytes_at_its_rate() {
        let b = TokenBucket::new(1_000_000.0);
        let t0 = std::time::Instant::now();
        // The first chunk is covered by the initial tokens; each further one costs its bytes/rate.
        assert_eq!(b.debit(LIMIT_CHUNK, t0), Duration::ZERO);
        let w = b.debit(100_000, t0).as_secs_f64();
        assert!((w - 0.1).abs() < 1e-6, "{w}");
        // Debt accumulates for concurrent callers (both directions of a connection).
        let w = b.debit(100_000, t0).as_secs_f64();
        assert!((w - 0.2).abs() < 1e-6, "{w}");
        // Time pays it off; idle time refills at most one burst.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(b.debit(LIMIT_CHUNK, later), Duration::ZERO);
        assert!(b.debit(1, later) > Duration::ZERO);
    }

    fn secret(b: u8) -> DataSecret {
        DataSecret::from_bytes([b; DataSecret::LEN])
    }

    struct Answer;
    impl Handler for Answer {
        fn handle(self: Arc<Self>, _: Request) -> Pin<Box<dyn Future<Output = Response> + Send>> {
            Box::pin(async { Response::Progress(None) })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn link_latency_delays_each_message_without_pausing_the_link() {
        let latency = Duration::from_millis(60);
        let plane = DataPlane::new(secret(3), 1 << 20).with_link_latency(Some(latency));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = Peers::new(addr.clone(), plane.clone());
        server.set_handler(Arc::new(Answer));
        tokio::spawn(server.clone().serve(listener));
        let client = Peers::new("client".into(), plane);
        let ask = || client.call(&addr, &Request::Progress, Duration::from_secs(10));
        ask().await.expect("the connection comes up");
        // One call: the request and the answer each wait out the latency.
        let t = std::time::Instant::now();
        ask().await.unwrap();
        let one = t.elapsed();
        assert!(one >= 2 * latency, "one round trip took {one:?}");
        // Ten calls at once overlap on the link: far less than ten round trips.
        let t = std::time::Instant::now();
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let (client, addr) = (client.clone(), addr.clone());
            calls.spawn(async move {
                client
                    .call(&addr, &Request::Progress, Duration::from_secs(10))
                    .await
            });
        }
        let answers = calls.join_all().await;
        let ten = t.elapsed();
        assert!(answers.iter().all(|a| a.is_ok()), "{answers:?}");
        assert!(
            ten >= 2 * latency && ten < 5 * 2 * latency,
            "ten concurrent round trips took {ten:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_urgent_call_overtakes_background_calls_queued_on_a_slow_link() {
        // 1 MB/s: twenty background requests of 50 kB take about a second to move.
        let plane = DataPlane::new(secret(4), 1 << 20).with_link_limit(Some(1e6));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = Peers::new(addr.clone(), plane.clone());
        server.set_handler(Arc::new(Answer));
        tokio::spawn(server.clone().serve(listener));
        let client = Peers::new("client".into(), plane);
        client
            .call(&addr, &Request::Progress, Duration::from_secs(10))
            .await
            .expect("the connection comes up");
        let t = std::time::Instant::now();
        let mut bulk = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (client, addr) = (client.clone(), addr.clone());
            bulk.spawn(async move {
                let req = Request::Opaque(vec![7u8; 50_000]);
                client
                    .call_background(&addr, &req, Duration::from_secs(30))
                    .await
                    .map(|_| t.elapsed())
            });
        }
        // Let every background request reach the connection's queue first.
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        client
            .call(&addr, &Request::Progress, Duration::from_secs(10))
            .await
            .expect("the urgent call is answered");
        let urgent = t.elapsed();
        let done: Vec<Duration> = bulk
            .join_all()
            .await
            .into_iter()
            .map(|r| r.expect("every background call is answered"))
            .collect();
        let last = done.iter().max().copied().unwrap_or_default();
        let before = done.iter().filter(|d| **d < urgent).count();
        assert!(
            before <= 5 && last > Duration::from_millis(700),
            "the urgent call took {urgent:?}; {before} of 20 background calls were answered \
             before it; the last after {last:?}"
        );
    }

    #[tokio::test]
    async fn the_hello_passes_with_the_job_secret_and_fails_without_it() {
        // Same secret: both sides pass.
        let (one, two) = (secret(1), secret(2));
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (i, r) = tokio::join!(
            hello_as_initiator(&mut a, &one),
            hello_as_acceptor(&mut b, &one)
        );
        assert!(i.is_ok() && r.is_ok(), "{i:?} {r:?}");
        // Different secrets: the initiator refuses the acceptor's proof (and sends none), so
        // the acceptor fails too.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (i, r) = tokio::join!(
            async {
                let r = hello_as_initiator(&mut a, &one).await;
                drop(a);
                r
            },
            hello_as_acceptor(&mut b, &two)
        );
        assert!(matches!(i, Err(AgentError::Handshake(_))), "{i:?}");
        assert!(r.is_err());
        // Not our protocol at all (a raw frame where the hello belongs): refused on the magic.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let raw = frame(KIND_REQUEST, 1, 0, |e| Request::Progress.encode(e));
        let mut junk = raw.clone();
        junk.resize(64, 0);
        a.write_all(&junk).await.unwrap();
        let r = hello_as_acceptor(&mut b, &one).await;
        assert!(
            matches!(&r, Err(AgentError::Handshake(m)) if m.contains("not a Proteus")),
            "{r:?}"
        );
    }

    #[tokio::test]
    async fn a_peer_that_replays_a_proof_is_refused() {
        // A rogue that saw an honest exchange replays the initiator's proof on a new connection:
        // the acceptor's fresh nonce makes it worthless.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (mut tap_a, mut tap_b) = (Vec::new(), Vec::new());
        let s = secret(3);
        let acceptor = tokio::spawn({
            let s = s.clone();
            async move { hello_as_acceptor(&mut b, &s).await }
        });
        // Honest initiator, recording what it sends.
        let mine: [u8; NONCE_LEN] = rand::random();
        tap_a.extend_from_slice(HELLO_MAGIC);
        tap_a.extend_from_slice(&mine);
        a.write_all(&tap_a).await.unwrap();
        let mut answer = [0u8; NONCE_LEN + MAC_LEN];
        a.read_exact(&mut answer).await.unwrap();
        let proof = hello_mac(&s, LABEL_INITIATOR, &mine, &answer[..NONCE_LEN])
            .finalize()
            .into_bytes();
        tap_b.extend_from_slice(&proof);
        a.write_all(&tap_b).await.unwrap();
        assert!(acceptor.await.unwrap().is_ok());
        // Replay both messages to a new acceptor.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let acceptor = tokio::spawn({
            let s = s.clone();
            async move { hello_as_acceptor(&mut b, &s).await }
        });
        a.write_all(&tap_a).await.unwrap();
        a.read_exact(&mut answer).await.unwrap();
        a.write_all(&tap_b).await.unwrap();
        assert!(acceptor.await.unwrap().is_err());
        // Reflection: the acceptor's own proof sent back as the initiator's is refused too.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let acceptor = tokio::spawn({
            let s = s.clone();
            async move { hello_as_acceptor(&mut b, &s).await }
        });
        a.write_all(&tap_a).await.unwrap();
        a.read_exact(&mut answer).await.unwrap();
        a.write_all(&answer[NONCE_LEN..]).await.unwrap();
        assert!(acceptor.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn a_frame_over_the_bound_is_refused_before_its_body_is_read() {
        // Only the 4-byte header exists: a decoder that allocated and read the body would fail
        // on the missing bytes instead, with another message.
        let bound = frame_bound(1000, 4, 0);
        let header = ((bound + 1) as u32).to_le_bytes();
        let err = read_frame(&mut &header[..], None, bound).await.unwrap_err();
        assert!(
            err.to_string().contains("exceeds this job's bound"),
            "{err}"
        );
        // At the bound it is read (here it is cut short, which is another error).
        let header = (bound as u32).to_le_bytes();
        let err = read_frame(&mut &header[..], None, bound).await.unwrap_err();
        assert!(
            err.to_string().contains("connection closed after 0"),
            "{err}"
        );
    }

    #[test]
    fn the_frame_bound_fits_the_largest_legitimate_message() {
        // A push of a whole model with every partition named fits; four times the model does not.
        let (floats, parts) = (250_000usize, 64u32);
        let bound = frame_bound(floats, parts, 2);
        let push = frame(KIND_REQUEST, 1, 0, |e| {
            Request::Push {
                shard: 0,
                clock: 1,
                partitions: (0..parts).collect(),
                delta: vec![0.5; floats],
            }
            .encode(e)
        });
        assert!(push.len() - 4 <= bound);
        assert!(4 * floats * 4 > bound);
        assert!(bound < 2 << 20, "{bound}");
        assert_eq!(frame_bound(usize::MAX, u32::MAX, u32::MAX), MAX_FRAME);
    }

    #[test]
    fn tensors_are_raw_little_endian() {
        let mut e = Enc::default();
        e.f32s(&[1.0]);
        assert_eq!(e.0, [1, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x00, 0x80, 0x3f]);
    }
}
