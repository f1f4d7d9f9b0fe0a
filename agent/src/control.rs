//! HTTP client of the broker's agent API (see `proteus_wire::agent_api`).

use crate::error::{AgentError, Result};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{
    AgentEvent, ApiError, BootstrapRequest, BootstrapResponse, CheckpointOp, CheckpointQuery,
    CheckpointTransfer, CommandEnvelope, CommandsQuery, Heartbeat, PROTOCOL_VERSION,
    RegisterRequest, RegisterResponse, paths,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Makes `builder` verify HTTPS servers against the PEM CA certificates in `ca_file` only (a
/// private CA, e.g. `proteus serve --tls-ca`), or against the system roots when `None`. Shared by
/// the agent and the `proteus` CLI, so both trust a broker the same way.
pub fn trust(
    builder: reqwest::ClientBuilder,
    ca_file: Option<&std::path::Path>,
) -> std::result::Result<reqwest::ClientBuilder, String> {
    let Some(path) = ca_file else {
        return Ok(builder);
    };
    let pem = std::fs::read(path).map_err(|e| format!("--ca-file {}: {e}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("--ca-file {}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "--ca-file {}: no certificate in it (expected `-----BEGIN CERTIFICATE-----`)",
            path.display()
        ));
    }
    Ok(builder.tls_certs_only(certs))
}

/// The broker as seen from one agent: one URL, or several brokers of one deployment, tried in
/// turn. The agent stays with the one that answers; it moves to the next when that one cannot
/// be reached or says the job is another broker's (421), which is how it follows its job when
/// the broker that owned it dies and another takes it over.
///
/// A broker that did not answer the last time it was asked (down, or paused and accepting
/// connections it never serves) is asked last in a search, so that finding the job's new
/// owner costs at most one wait on it, not one per pass over the brokers.
#[derive(Clone)]
pub struct Broker {
    http: reqwest::Client,
    bases: Arc<Vec<String>>,
    current: Arc<AtomicUsize>,
    /// Per base: it did not answer the last request sent to it (no connection, or no answer
    /// within the request's timeout).
    unanswered: Arc<Vec<AtomicBool>>,
    token: String,
}

/// How long a heartbeat waits for its answer.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

/// The answer of a broker that does not run the agent's job.
const NOT_OWNER: u16 = 421;

/// Whether a failure is worth retrying.
pub fn is_transient(e: &AgentError) -> bool {
    match e {
        AgentError::Broker(_) => true,
        AgentError::BrokerStatus { status, .. } => {
            *status >= 500 || *status == 429 || *status == NOT_OWNER
        }
        _ => false,
    }
}

/// Whether another broker may answer what this one could not: it was unreachable (the request
/// never reached a handler) or said the job is another broker's.
fn elsewhere(e: &AgentError) -> bool {
    matches!(
        e,
        AgentError::Broker(_)
            | AgentError::BrokerStatus {
                status: NOT_OWNER,
                ..
            }
    )
}

/// Whether, in a search for the job's owner, the brokers not yet asked should be: `e` is
/// [`elsewhere`], or the broker's lease on the job lapsed (503) — it cannot say whether the job
/// is still its own, and another broker may have taken it over while it was stalled.
fn maybe_elsewhere(e: &AgentError) -> bool {
    elsewhere(e) || matches!(e, AgentError::BrokerStatus { status: 503, .. })
}

/// Whether `ev` is the one that ends the job when the broker records it.
fn ends_the_job(ev: &AgentEvent) -> bool {
    matches!(
        ev,
        AgentEvent::TrainingComplete { .. }
            | AgentEvent::ProgramExited {
                completes: true,
                ..
            }
    )
}

impl Broker {
    /// `bases`: one broker URL, or several separated by commas. `ca_file`: see [`trust`].
    pub fn new(bases: &str, token: &str, ca_file: Option<&std::path::Path>) -> Result<Broker> {
        let builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
        let http = trust(builder, ca_file)
            .map_err(AgentError::Config)?
            .build()
            .map_err(|e| AgentError::Broker(e.to_string()))?;
        let bases: Vec<String> = bases
            .split(',')
            .map(|b| b.trim().trim_end_matches('/').to_string())
            .filter(|b| !b.is_empty())
            .collect();
        if bases.is_empty() {
            return Err(AgentError::Config(
                "--broker: give the broker's URL (or several, separated by commas)".into(),
            ));
        }
        Ok(Broker {
            http,
            unanswered: Arc::new(bases.iter().map(|_| AtomicBool::new(false)).collect()),
            bases: Arc::new(bases),
            current: Arc::new(AtomicUsize::new(0)),
            token: token.to_string(),
        })
    }

    /// The broker URL in use now.
    pub fn url(&self) -> String {
        self.base_at(self.current.load(Ordering::Relaxed))
    }

    fn base_at(&self, i: usize) -> String {
        self.bases[i % self.bases.len()].clone()
    }

    /// Moves on from the broker at `used` to the next one (once, however many requests saw it
    /// fail at the same time).
    fn next_broker(&self, used: usize) {
        if self.bases.len() > 1
            && self
                .current
                .compare_exchange(used, used + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::info!(from = %self.base_at(used), to = %self.base_at(used + 1), "trying the next broker");
        }
    }

    /// Sends the request built for the current broker's URL by `build`; moves on to the next
    /// broker when this one cannot be reached or says the job is another's.
    async fn send<T: DeserializeOwned>(
        &self,
        build: impl FnOnce(&str) -> reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<Option<T>> {
        let used = self.current.load(Ordering::Relaxed);
        let answer = self.send_at(used, build, timeout).await;
        if answer.as_ref().is_err_and(elsewhere) {
            self.next_broker(used);
        }
        answer
    }

    /// Sends the request built by `build` to the broker at `i` (modulo their number), and
    /// remembers whether it answered.
    async fn send_at<T: DeserializeOwned>(
        &self,
        i: usize,
        build: impl FnOnce(&str) -> reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<Option<T>> {
        let base = self.base_at(i);
        let unanswered = &self.unanswered[i % self.bases.len()];
        let resp = match build(&base)
            .bearer_auth(&self.token)
            .timeout(timeout)
            .send()
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                if e.is_connect() || e.is_timeout() {
                    unanswered.store(true, Ordering::Relaxed);
                }
                return Err(AgentError::Broker(format!("{base}: {}", error_chain(&e))));
            }
        };
        unanswered.store(false, Ordering::Relaxed);
        let status = resp.status();
        if status.is_success() {
            if status == reqwest::StatusCode::NO_CONTENT {
                return Ok(None);
            }
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| AgentError::Broker(e.to_string()))?;
            if bytes.is_empty() {
                return Ok(None);
            }
            return serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| AgentError::Broker(format!("unexpected answer: {e}")));
        }
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<ApiError>(&text)
            .map(|e| e.message)
            .unwrap_or(text);
        Err(AgentError::BrokerStatus {
            status: status.as_u16(),
            message,
        })
    }

    /// The order in which to look for the job's owner, from the broker at `from`: that one,
    /// then the others in turn, those that did not answer when last asked at the end.
    fn search_order(&self, from: usize) -> Vec<usize> {
        let n = self.bases.len();
        let (mut answered, unanswered): (Vec<usize>, Vec<usize>) =
            (from + 1..from + n).partition(|i| !self.unanswered[i % n].load(Ordering::Relaxed));
        answered.insert(0, from);
        answered.extend(unanswered);
        answered
    }

    /// [`Self::send`], asked of each broker of the deployment in turn (see
    /// [`Self::search_order`]) while the one asked cannot be reached, says another broker runs
    /// the job or that its own lease on the job lapsed: a heartbeat, a checkpoint or an output
    /// tail is not lost because the job was moving between brokers when it was sent. The agent
    /// stays with the broker that took it; when none did, with the first that answered with
    /// something other than "not mine" (it may own the job), or else the next in turn.
    async fn send_to_owner<T: DeserializeOwned>(
        &self,
        build: impl Fn(&str) -> reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<Option<T>> {
        let used = self.current.load(Ordering::Relaxed);
        let mut kept: Option<(usize, AgentError)> = None;
        let mut last = None;
        for i in self.search_order(used) {
            match self.send_at(i, &build, timeout).await {
                Err(e) if maybe_elsewhere(&e) => {
                    tracing::debug!(error = %e, "asking the next broker");
                    if !elsewhere(&e) && kept.is_none() {
                        kept = Some((i, e));
                    } else {
                        last = Some(e);
                    }
                }
                answer => {
                    self.stay_with(used, i);
                    return answer;
                }
            }
        }
        if let Some((i, e)) = kept {
            self.stay_with(used, i);
            return Err(e);
        }
        self.next_broker(used);
        Err(last.unwrap_or_else(|| AgentError::Broker("no broker URL to ask".into())))
    }

    /// Makes the broker at `to` the current one, unless another request moved on from `used`
    /// in the meantime.
    fn stay_with(&self, used: usize, to: usize) {
        let to = to % self.bases.len();
        if to != used % self.bases.len()
            && self
                .current
                .compare_exchange(used, to, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::info!(from = %self.base_at(used), to = %self.base_at(to), "following the job to another broker");
        }
    }

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<Option<T>> {
        let http = &self.http;
        self.send(
            |base| http.post(format!("{base}{path}")).json(body),
            Duration::from_secs(15),
        )
        .await
    }

    /// Register, retrying with capped exponential backoff while the broker is unreachable or
    /// failing; refusals (4xx) are returned at once.
    pub async fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse> {
        let r: RegisterResponse = self
            .post_retrying(paths::REGISTER, req, "registration")
            .await?;
        if r.protocol_version != PROTOCOL_VERSION {
            return Err(AgentError::ProtocolMismatch {
                agent: PROTOCOL_VERSION,
                broker: r.protocol_version,
            });
        }
        Ok(r)
    }

    /// The first contact of an agent whose token is its instance's bootstrap token (this
    /// client's): trades it for the agent token, retried as registration is. The bootstrap
    /// token is good for one exchange only.
    pub async fn bootstrap(&self, req: &BootstrapRequest) -> Result<String> {
        let r: BootstrapResponse = self
            .post_retrying(paths::BOOTSTRAP, req, "the bootstrap token exchange")
            .await?;
        Ok(r.token)
    }

    /// `POST`, retrying with capped exponential backoff while the broker is unreachable,
    /// failing or not the job's owner; refusals (4xx) are returned at once.
    async fn post_retrying<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        what: &str,
    ) -> Result<T> {
        let mut delay = Duration::from_millis(250);
        loop {
            match self.post::<_, T>(path, body).await {
                Ok(Some(r)) => return Ok(r),
                Ok(None) => return Err(AgentError::Broker(format!("empty answer to {what}"))),
                Err(e) if is_transient(&e) => {
                    tracing::warn!(broker = %self.url(), error = %e, retry_in_ms = delay.as_millis() as u64,
                        "broker unreachable; retrying {what}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One heartbeat, sent on to the other brokers in the same call while the one asked is not
    /// the job's owner ([`Self::send_to_owner`]): an agent whose job moved finds its new owner
    /// within one heartbeat, not one broker per heartbeat interval. Each broker asked gets 5 s
    /// at most: one that accepts connections but does not answer (paused, overloaded) must not
    /// keep the agent silent past its dead-member timeout (10 s by default) while another
    /// broker has taken its job over; and it is asked last in later searches.
    pub async fn heartbeat(&self, id: &InstanceId, hb: &Heartbeat) -> Result<()> {
        let http = &self.http;
        let path = paths::heartbeat(id);
        self.send_to_owner::<serde_json::Value>(
            |base| http.post(format!("{base}{path}")).json(hb),
            HEARTBEAT_TIMEOUT,
        )
        .await
        .map(|_| ())
    }

    /// Send an event, retrying transient failures for up to a minute (events matter: a lost
    /// warning delays the hand-over until the member times out; the minute covers a broker's
    /// failover, whose lease is 10 s by default). The event that ends the job (training
    /// complete; the program exited and completed it) is retried until a broker takes it: were
    /// it dropped during a long database outage, the job would run on for ever with its work
    /// done. A broker that no longer knows the instance answers with a client error, which
    /// ends the retries.
    pub async fn event(&self, id: &InstanceId, ev: &AgentEvent) -> Result<()> {
        let mut delay = Duration::from_millis(100);
        let deadline =
            (!ends_the_job(ev)).then(|| std::time::Instant::now() + Duration::from_secs(60));
        loop {
            match self
                .post::<_, serde_json::Value>(&paths::events(id), ev)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e)
                    if is_transient(&e)
                        && deadline.is_none_or(|d| std::time::Instant::now() < d) =>
                {
                    tracing::warn!(error = %e, "event not delivered; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One long poll.
    pub async fn commands(
        &self,
        id: &InstanceId,
        after: u64,
        wait_ms: u64,
    ) -> Result<Vec<CommandEnvelope>> {
        let q = CommandsQuery { after, wait_ms };
        let http = &self.http;
        let timeout = Duration::from_millis(wait_ms) + Duration::from_secs(10);
        Ok(self
            .send::<Vec<CommandEnvelope>>(
                |base| http.get(format!("{base}{}", paths::commands(id))).query(&q),
                timeout,
            )
            .await?
            .unwrap_or_default())
    }

    /// Where to upload or fetch `rank`'s checkpoint (a presigned URL or the broker's store).
    pub async fn checkpoint_transfer(
        &self,
        id: &InstanceId,
        rank: u32,
        op: CheckpointOp,
    ) -> Result<CheckpointTransfer> {
        let http = &self.http;
        self.send_to_owner::<CheckpointTransfer>(
            |base| {
                http.get(format!("{base}{}", paths::checkpoint(id)))
                    .query(&CheckpointQuery { rank, op })
            },
            Duration::from_secs(15),
        )
        .await?
        .ok_or_else(|| AgentError::Broker("empty checkpoint answer".into()))
    }

    /// Where to fetch the job's `s3://` working directory (a presigned `GET`).
    pub async fn workdir_transfer(&self, id: &InstanceId) -> Result<CheckpointTransfer> {
        let http = &self.http;
        self.send_to_owner::<CheckpointTransfer>(
            |base| http.get(format!("{base}{}", paths::workdir(id))),
            Duration::from_secs(15),
        )
        .await?
        .ok_or_else(|| AgentError::Broker("empty working-directory answer".into()))
    }

    /// A transfer's URL: absolute (presigned), or a path on the broker (its own store).
    fn transfer_url(&self, t: &CheckpointTransfer) -> String {
        if t.url.starts_with('/') {
            format!("{}{}", self.url(), t.url)
        } else {
            t.url.clone()
        }
    }

    /// `PUT` an archive where `t` says. Large bodies get a generous timeout.
    pub async fn put_archive(&self, t: &CheckpointTransfer, body: Vec<u8>) -> Result<()> {
        let timeout = Duration::from_secs(60 + body.len() as u64 / 1_000_000);
        let mut req = self
            .http
            .put(self.transfer_url(t))
            .body(body)
            .timeout(timeout);
        if t.bearer {
            req = req.bearer_auth(&self.token);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| AgentError::Broker(format!("checkpoint upload: {e}")))?;
        if resp.status().is_success() {
            return Ok(());
        }
        let status = resp.status().as_u16();
        Err(AgentError::BrokerStatus {
            status,
            message: format!(
                "checkpoint upload: {}",
                resp.text().await.unwrap_or_default()
            ),
        })
    }

    /// `GET` an archive where `t` says; `None` when there is none yet (404).
    pub async fn get_archive(&self, t: &CheckpointTransfer) -> Result<Option<bytes::Bytes>> {
        let mut req = self
            .http
            .get(self.transfer_url(t))
            .timeout(Duration::from_secs(600));
        if t.bearer {
            req = req.bearer_auth(&self.token);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| AgentError::Broker(format!("checkpoint download: {e}")))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(AgentError::BrokerStatus {
                status: status.as_u16(),
                message: format!(
                    "checkpoint download: {}",
                    resp.text().await.unwrap_or_default()
                ),
            });
        }
        resp.bytes()
            .await
            .map(Some)
            .map_err(|e| AgentError::Broker(format!("checkpoint download: {e}")))
    }

    /// Send the newest tail of a command job's output.
    pub async fn output(&self, id: &InstanceId, tail: String) -> Result<()> {
        let http = &self.http;
        self.send_to_owner::<serde_json::Value>(
            |base| {
                http.post(format!("{base}{}", paths::output(id)))
                    .header("content-type", "text/plain; charset=utf-8")
                    .body(tail.clone())
            },
            Duration::from_secs(15),
        )
        .await
        .map(|_| ())
    }
}

/// An error with its causes (`reqwest` says only "error sending request"; the cause says, e.g.,
/// that the certificate is not trusted).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A broker that answers every request with `status` and `body`; returns its URL and how
    /// many requests it answered.
    async fn broker_answering(
        status: &'static str,
        body: impl Into<String>,
    ) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        broker_switching(Arc::new(std::sync::Mutex::new((status, body.into())))).await
    }

    #[tokio::test]
    async fn a_checkpoint_asked_of_a_broker_that_no_longer_runs_the_job_is_asked_of_the_next() {
        let (old, old_asked) = broker_answering(
            "421 Misdirected Request",
            r#"{"code":"not_owner","message":"job 1 is run by another broker"}"#,
        )
        .await;
        let (new, new_asked) = broker_answering("200 OK", r#"{"url":"/v1/x","bearer":true}"#).await;
        let broker = Broker::new(&format!("{old},{new}"), "t", None).unwrap();
        let id = InstanceId("pi-1-a".into());
        let t = broker
            .checkpoint_transfer(&id, 0, CheckpointOp::Upload)
            .await
            .expect("the next broker answers within the same call");
        assert_eq!(t.url, "/v1/x");
        assert_eq!(old_asked.load(Ordering::SeqCst), 1);
        assert_eq!(new_asked.load(Ordering::SeqCst), 1);
        // With one broker only, the refusal is the answer (no loop).
        let alone = Broker::new(&old, "t", None).unwrap();
        let e = alone
            .checkpoint_transfer(&id, 0, CheckpointOp::Upload)
            .await
            .unwrap_err();
        assert!(
            matches!(e, AgentError::BrokerStatus { status: 421, .. }),
            "{e}"
        );
    }

    /// A broker that accepts connections and never answers (a paused process): returns its
    /// URL and how many connections it took.
    async fn broker_not_answering() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::SeqCst);
                held.push(conn);
            }
        });
        (url, count)
    }

    /// A broker whose answer (status line, body) can be changed while it runs.
    async fn broker_switching(
        answer: Arc<std::sync::Mutex<(&'static str, String)>>,
    ) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                seen.fetch_add(1, Ordering::SeqCst);
                let (status, body) = answer.lock().unwrap().clone();
                let reply = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            }
        });
        (url, count)
    }

    const OK: (&str, &str) = ("200 OK", "{}");

    fn reply((status, body): (&'static str, &str)) -> (&'static str, String) {
        (status, body.to_string())
    }
    const NOT_MINE: (&str, &str) = (
        "421 Misdirected Request",
        r#"{"code":"not_owner","message":"job 1 is run by another broker"}"#,
    );

    /// The broker that ran the job is paused (it takes connections and never answers) and
    /// another took the job over: one heartbeat finds the new owner, waiting once on the
    /// paused broker; and when the job moves again, the search asks the paused broker last and
    /// does not wait on it.
    #[tokio::test]
    async fn a_heartbeat_follows_its_job_past_a_paused_broker_within_one_call() {
        let (paused, paused_asked) = broker_not_answering().await;
        let first = Arc::new(std::sync::Mutex::new(reply(NOT_MINE)));
        let (moved, moved_asked) = broker_switching(first.clone()).await;
        let second = Arc::new(std::sync::Mutex::new(reply(OK)));
        let (owner, owner_asked) = broker_switching(second.clone()).await;
        let broker = Broker::new(&format!("{paused},{moved},{owner}"), "t", None).unwrap();
        let id = InstanceId("pi-1-a".into());
        let hb = Heartbeat::default();

        let started = std::time::Instant::now();
        broker
            .heartbeat(&id, &hb)
            .await
            .expect("the owner takes it");
        let took = started.elapsed();
        assert!(
            took >= HEARTBEAT_TIMEOUT,
            "it waited on the paused broker: {took:?}"
        );
        assert!(took < 2 * HEARTBEAT_TIMEOUT, "it waited once: {took:?}");
        let asked = |c: &Arc<AtomicUsize>| c.load(Ordering::SeqCst);
        assert_eq!(
            (
                asked(&paused_asked),
                asked(&moved_asked),
                asked(&owner_asked)
            ),
            (1, 1, 1)
        );
        assert_eq!(broker.url(), owner, "the agent stays with the owner");

        // The next heartbeat goes straight to the owner.
        broker.heartbeat(&id, &hb).await.unwrap();
        assert_eq!(
            (
                asked(&paused_asked),
                asked(&moved_asked),
                asked(&owner_asked)
            ),
            (1, 1, 2)
        );

        // The job moves to the second broker: the paused one, asked last, is not waited on.
        *second.lock().unwrap() = reply(NOT_MINE);
        *first.lock().unwrap() = reply(OK);
        let started = std::time::Instant::now();
        broker
            .heartbeat(&id, &hb)
            .await
            .expect("the new owner takes it");
        assert!(
            started.elapsed() < HEARTBEAT_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            (
                asked(&paused_asked),
                asked(&moved_asked),
                asked(&owner_asked)
            ),
            (1, 2, 3)
        );
        assert_eq!(broker.url(), moved);

        // A broker whose lease lapsed (503) may have lost the job: the others are asked; with
        // none taking it, the agent stays with the one that may own it, and the 503 is the
        // answer.
        let lapsed_answer = Arc::new(std::sync::Mutex::new(reply((
            "503 Service Unavailable",
            r#"{"code":"lease_lapsed","message":"lease lapsed"}"#,
        ))));
        let (lapsed, _) = broker_switching(lapsed_answer).await;
        let (other, other_asked) = broker_answering(NOT_MINE.0, NOT_MINE.1).await;
        let broker = Broker::new(&format!("{lapsed},{other}"), "t", None).unwrap();
        let e = broker.heartbeat(&id, &hb).await.unwrap_err();
        assert!(
            matches!(e, AgentError::BrokerStatus { status: 503, .. }),
            "{e}"
        );
        assert_eq!(asked(&other_asked), 1);
        assert_eq!(broker.url(), lapsed);
    }

    #[tokio::test]
    async fn a_broker_of_another_protocol_version_is_refused_at_the_hello_naming_both() {
        use proteus_wire::agent_api::{AppConfig, TrainingConfig};
        use proteus_wire::{JobId, Tier};
        let answer = |version: u32| {
            serde_json::to_string(&RegisterResponse {
                job_id: JobId(1),
                instance_id: InstanceId("i-1".into()),
                tier: Tier::Reliable,
                training: TrainingConfig::new(AppConfig::Synthetic { model_len: 1 }),
                heartbeat_interval_ms: 1000,
                command_wait_ms: 1000,
                data_secret: None,
                protocol_version: version,
            })
            .unwrap()
        };
        let req = RegisterRequest {
            instance_id: InstanceId("i-1".into()),
            data_addr: "127.0.0.1:1".into(),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: PROTOCOL_VERSION,
        };
        for other in [0, PROTOCOL_VERSION + 1] {
            let (url, asked) = broker_answering("200 OK", answer(other)).await;
            let e = Broker::new(&url, "t", None)
                .unwrap()
                .register(&req)
                .await
                .unwrap_err();
            assert!(
                matches!(e, AgentError::ProtocolMismatch { agent, broker }
                    if agent == PROTOCOL_VERSION && broker == other),
                "{e}"
            );
            let text = e.to_string();
            assert!(
                text.contains(&format!("agent protocol {PROTOCOL_VERSION}"))
                    && text.contains(&format!("the broker {other}")),
                "{text}"
            );
            assert_eq!(asked.load(Ordering::SeqCst), 1, "refused, not retried");
        }
        // A broker that refuses this agent's version: its answer is final, not retried.
        let (url, asked) = broker_answering(
            "409 Conflict",
            r#"{"code":"protocol_mismatch","message":"this agent speaks agent protocol 9 and this broker 1"}"#,
        )
        .await;
        let e = Broker::new(&url, "t", None)
            .unwrap()
            .register(&req)
            .await
            .unwrap_err();
        assert!(
            matches!(e, AgentError::BrokerStatus { status: 409, .. }),
            "{e}"
        );
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        let (url, _) = broker_answering("200 OK", answer(PROTOCOL_VERSION)).await;
        let r = Broker::new(&url, "t", None).unwrap().register(&req).await;
        assert!(r.is_ok(), "{r:?}");
    }
}
