//! EC2 instance metadata (IMDSv2): instance id, spot interruption notices, rebalance
//! recommendations.

use crate::error::{AgentError, Result};
use std::time::Duration;
use tokio::sync::mpsc;

const TOKEN_TTL_SECS: &str = "21600";

/// A notice read from IMDS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// `spot/instance-action`: the instance goes away at `time` (RFC 3339).
    Interruption { action: String, time: String },
    /// `events/recommendations/rebalance`.
    Rebalance { notice_time: Option<String> },
}

/// IMDSv2 client: a session token first (PUT), then GETs carrying it.
pub struct Imds {
    http: reqwest::Client,
    endpoint: String,
    token: Option<String>,
}

#[derive(serde::Deserialize)]
struct InstanceAction {
    action: String,
    time: String,
}

#[derive(serde::Deserialize)]
struct Rebalance {
    #[serde(rename = "noticeTime", default)]
    notice_time: Option<String>,
}

impl Imds {
    pub fn new(endpoint: &str) -> Result<Imds> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| AgentError::Imds(e.to_string()))?;
        Ok(Imds {
            http,
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: None,
        })
    }

    async fn refresh_token(&mut self) -> Result<String> {
        let resp = self
            .http
            .put(format!("{}/latest/api/token", self.endpoint))
            .header("x-aws-ec2-metadata-token-ttl-seconds", TOKEN_TTL_SECS)
            .send()
            .await
            .map_err(|e| AgentError::Imds(format!("token: {e}")))?;
        if !resp.status().is_success() {
            return Err(AgentError::Imds(format!("token: HTTP {}", resp.status())));
        }
        let token = resp
            .text()
            .await
            .map_err(|e| AgentError::Imds(format!("token: {e}")))?;
        self.token = Some(token.clone());
        Ok(token)
    }

    /// GET a metadata path; `None` on 404 (IMDS's way of saying "nothing").
    pub async fn get(&mut self, path: &str) -> Result<Option<String>> {
        for _ in 0..2 {
            let token = match &self.token {
                Some(t) => t.clone(),
                None => self.refresh_token().await?,
            };
            let resp = self
                .http
                .get(format!("{}/latest/{path}", self.endpoint))
                .header("x-aws-ec2-metadata-token", token)
                .send()
                .await
                .map_err(|e| AgentError::Imds(format!("{path}: {e}")))?;
            match resp.status().as_u16() {
                404 => return Ok(None),
                401 => {
                    self.token = None; // expired: get a new one and try once more
                    continue;
                }
                s if (200..300).contains(&s) => {
                    return resp
                        .text()
                        .await
                        .map(Some)
                        .map_err(|e| AgentError::Imds(format!("{path}: {e}")));
                }
                s => return Err(AgentError::Imds(format!("{path}: HTTP {s}"))),
            }
        }
        Err(AgentError::Imds(format!("{path}: token refused")))
    }

    pub async fn instance_id(&mut self) -> Result<String> {
        self.get("meta-data/instance-id")
            .await?
            .map(|s| s.trim().to_string())
            .ok_or_else(|| AgentError::Imds("no instance-id".into()))
    }

    /// One poll of both notices.
    pub async fn poll(&mut self) -> Result<Vec<Notice>> {
        let mut out = Vec::new();
        if let Some(body) = self.get("meta-data/spot/instance-action").await? {
            let a: InstanceAction = serde_json::from_str(&body)
                .map_err(|e| AgentError::Imds(format!("spot/instance-action `{body}`: {e}")))?;
            out.push(Notice::Interruption {
                action: a.action,
                time: a.time,
            });
        }
        if let Some(body) = self
            .get("meta-data/events/recommendations/rebalance")
            .await?
        {
            let r: Rebalance =
                serde_json::from_str(&body).unwrap_or(Rebalance { notice_time: None });
            out.push(Notice::Rebalance {
                notice_time: r.notice_time,
            });
        }
        Ok(out)
    }
}

/// Poll every `interval`, sending each kind of notice once. Errors are logged, never fatal: a
/// flaky metadata service must not kill training.
pub async fn watch(mut imds: Imds, interval: Duration, tx: mpsc::UnboundedSender<Notice>) {
    let (mut warned, mut rebalanced, mut failing) = (false, false, false);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match imds.poll().await {
            Ok(notices) => {
                if failing {
                    tracing::info!("instance metadata reachable again");
                    failing = false;
                }
                for n in notices {
                    let first = match &n {
                        Notice::Interruption { .. } => !std::mem::replace(&mut warned, true),
                        Notice::Rebalance { .. } => !std::mem::replace(&mut rebalanced, true),
                    };
                    if first && tx.send(n).is_err() {
                        return;
                    }
                }
            }
            Err(e) if !failing => {
                tracing::warn!(error = %e, "cannot poll instance metadata; will keep trying");
                failing = true;
            }
            Err(_) => {}
        }
    }
}
