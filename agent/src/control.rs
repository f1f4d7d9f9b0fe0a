//! HTTP client of the broker's agent API (see `proteus_wire::agent_api`).

use crate::error::{AgentError, Result};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{
    AgentEvent, ApiError, CheckpointOp, CheckpointQuery, CheckpointTransfer, CommandEnvelope,
    CommandsQuery, Heartbeat, RegisterRequest, RegisterResponse, paths,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
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

/// The broker as seen from one agent.
#[derive(Clone)]
pub struct Broker {
    http: reqwest::Client,
    base: String,
    token: String,
}

/// Whether a failure is worth retrying.
pub fn is_transient(e: &AgentError) -> bool {
    match e {
        AgentError::Broker(_) => true,
        AgentError::BrokerStatus { status, .. } => *status >= 500 || *status == 429,
        _ => false,
    }
}

impl Broker {
    /// `ca_file`: see [`trust`].
    pub fn new(base: &str, token: &str, ca_file: Option<&std::path::Path>) -> Result<Broker> {
        let builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
        let http = trust(builder, ca_file)
            .map_err(AgentError::Config)?
            .build()
            .map_err(|e| AgentError::Broker(e.to_string()))?;
        Ok(Broker {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    async fn send<T: DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<Option<T>> {
        let resp = req
            .bearer_auth(&self.token)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| AgentError::Broker(format!("{}: {}", self.base, error_chain(&e))))?;
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

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<Option<T>> {
        let req = self.http.post(format!("{}{path}", self.base)).json(body);
        self.send(req, Duration::from_secs(15)).await
    }

    /// Register, retrying with capped exponential backoff while the broker is unreachable or
    /// failing; refusals (4xx) are returned at once.
    pub async fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse> {
        let mut delay = Duration::from_millis(250);
        loop {
            match self.post::<_, RegisterResponse>(paths::REGISTER, req).await {
                Ok(Some(r)) => return Ok(r),
                Ok(None) => return Err(AgentError::Broker("empty registration answer".into())),
                Err(e) if is_transient(&e) => {
                    tracing::warn!(broker = %self.base, error = %e, retry_in_ms = delay.as_millis() as u64,
                        "broker unreachable; retrying registration");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn heartbeat(&self, id: &InstanceId, hb: &Heartbeat) -> Result<()> {
        self.post::<_, serde_json::Value>(&paths::heartbeat(id), hb)
            .await
            .map(|_| ())
    }

    /// Send an event, retrying transient failures a few times (events matter: a lost warning
    /// delays the hand-over until the member times out).
    pub async fn event(&self, id: &InstanceId, ev: &AgentEvent) -> Result<()> {
        let mut delay = Duration::from_millis(100);
        for attempt in 0.. {
            match self
                .post::<_, serde_json::Value>(&paths::events(id), ev)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if is_transient(&e) && attempt < 5 => {
                    tracing::warn!(error = %e, "event not delivered; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One long poll.
    pub async fn commands(
        &self,
        id: &InstanceId,
        after: u64,
        wait_ms: u64,
    ) -> Result<Vec<CommandEnvelope>> {
        let q = CommandsQuery { after, wait_ms };
        let req = self
            .http
            .get(format!("{}{}", self.base, paths::commands(id)))
            .query(&q);
        let timeout = Duration::from_millis(wait_ms) + Duration::from_secs(10);
        Ok(self
            .send::<Vec<CommandEnvelope>>(req, timeout)
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
        let req = self
            .http
            .get(format!("{}{}", self.base, paths::checkpoint(id)))
            .query(&CheckpointQuery { rank, op });
        self.send::<CheckpointTransfer>(req, Duration::from_secs(15))
            .await?
            .ok_or_else(|| AgentError::Broker("empty checkpoint answer".into()))
    }

    /// Where to fetch the job's `s3://` working directory (a presigned `GET`).
    pub async fn workdir_transfer(&self, id: &InstanceId) -> Result<CheckpointTransfer> {
        let req = self
            .http
            .get(format!("{}{}", self.base, paths::workdir(id)));
        self.send::<CheckpointTransfer>(req, Duration::from_secs(15))
            .await?
            .ok_or_else(|| AgentError::Broker("empty working-directory answer".into()))
    }

    /// A transfer's URL: absolute (presigned), or a path on the broker (its own store).
    fn transfer_url(&self, t: &CheckpointTransfer) -> String {
        if t.url.starts_with('/') {
            format!("{}{}", self.base, t.url)
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
        let req = self
            .http
            .post(format!("{}{}", self.base, paths::output(id)))
            .header("content-type", "text/plain; charset=utf-8")
            .body(tail);
        self.send::<serde_json::Value>(req, Duration::from_secs(15))
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
