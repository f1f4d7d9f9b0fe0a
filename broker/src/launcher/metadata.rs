//! An instance-metadata endpoint (IMDSv2) for an instance that does not really boot.
//!
//! It answers the paths `proteus-agent` and AWS tools read — a session token first (`PUT
//! /latest/api/token`, echoing the TTL header as EC2 does), then `instance-id`,
//! `spot/instance-action` (404 until a notice exists) and the rebalance recommendation — so an
//! interruption reaches the agent exactly as it would on EC2. Two extra routes under
//! `/_proteus/` let the broker (simulated cloud) or a test announce a notice.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const TOKEN_TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";

/// What the endpoint knows about its instance.
#[derive(Debug, Clone, Default)]
pub struct InstanceFacts {
    pub instance_id: String,
    pub instance_type: String,
    pub availability_zone: String,
    /// `spot` or `on-demand`.
    pub lifecycle: String,
}

#[derive(Debug, Default)]
struct Notices {
    /// (action, RFC 3339 time)
    action: Option<(String, String)>,
    rebalance: Option<String>,
}

#[derive(Debug, Clone)]
struct Shared {
    facts: Arc<InstanceFacts>,
    token: Arc<String>,
    notices: Arc<Mutex<Notices>>,
}

/// A running metadata endpoint. Dropping it stops the server.
#[derive(Debug)]
pub struct MetadataServer {
    addr: SocketAddr,
    shared: Shared,
    task: JoinHandle<()>,
}

impl Drop for MetadataServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MetadataServer {
    /// Serves on `addr` (port 0 for any); reusing a recorded address lets a restarted broker
    /// come back where its agents already look.
    pub async fn start(addr: SocketAddr, facts: InstanceFacts) -> std::io::Result<MetadataServer> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let token = format!("imds-{:016x}", rand::random::<u64>());
        let shared = Shared {
            facts: Arc::new(facts),
            token: Arc::new(token),
            notices: Arc::new(Mutex::new(Notices::default())),
        };
        let app = router(shared.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "metadata endpoint stopped");
            }
        });
        Ok(MetadataServer { addr, shared, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Announces that the instance will be reclaimed at `time` (RFC 3339).
    pub fn announce_interruption(&self, time: &str) {
        self.notices().action = Some(("terminate".to_string(), time.to_string()));
    }

    pub fn announce_rebalance(&self, time: &str) {
        self.notices().rebalance = Some(time.to_string());
    }

    fn notices(&self) -> std::sync::MutexGuard<'_, Notices> {
        self.shared
            .notices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

fn router(shared: Shared) -> Router {
    Router::new()
        .route("/latest/api/token", put(token))
        .route(
            "/latest/meta-data/instance-id",
            get(|s, h| fact(s, h, |f| f.instance_id.clone())),
        )
        .route(
            "/latest/meta-data/instance-type",
            get(|s, h| fact(s, h, |f| f.instance_type.clone())),
        )
        .route(
            "/latest/meta-data/placement/availability-zone",
            get(|s, h| fact(s, h, |f| f.availability_zone.clone())),
        )
        .route(
            "/latest/meta-data/instance-life-cycle",
            get(|s, h| fact(s, h, |f| f.lifecycle.clone())),
        )
        .route(
            "/latest/meta-data/spot/instance-action",
            get(instance_action),
        )
        .route(
            "/latest/meta-data/events/recommendations/rebalance",
            get(rebalance),
        )
        .route("/_proteus/interrupt", post(control_interrupt))
        .route("/_proteus/rebalance", post(control_rebalance))
        .with_state(shared)
}

async fn token(State(s): State<Shared>, headers: HeaderMap) -> Response {
    match headers.get(TOKEN_TTL_HEADER) {
        Some(ttl) => {
            let ttl = ttl.clone();
            ([(TOKEN_TTL_HEADER, ttl)], s.token.as_str().to_string()).into_response()
        }
        None => (
            StatusCode::BAD_REQUEST,
            "missing x-aws-ec2-metadata-token-ttl-seconds",
        )
            .into_response(),
    }
}

/// IMDSv2 only: a request without the session token is refused, as on EC2 with v1 disabled.
fn authorised(s: &Shared, headers: &HeaderMap) -> bool {
    headers
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t == s.token.as_str())
}

async fn fact(
    State(s): State<Shared>,
    headers: HeaderMap,
    pick: impl Fn(&InstanceFacts) -> String,
) -> Response {
    if !authorised(&s, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    pick(&s.facts).into_response()
}

async fn instance_action(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !authorised(&s, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let notices = s.notices.lock().unwrap_or_else(|e| e.into_inner());
    match &notices.action {
        Some((action, time)) => {
            Json(serde_json::json!({"action": action, "time": time})).into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn rebalance(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !authorised(&s, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let notices = s.notices.lock().unwrap_or_else(|e| e.into_inner());
    match &notices.rebalance {
        Some(time) => Json(serde_json::json!({"noticeTime": time})).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[derive(Deserialize)]
struct InterruptBody {
    #[serde(default = "default_action")]
    action: String,
    /// RFC 3339; default: two minutes from now.
    time: Option<String>,
}

fn default_action() -> String {
    "terminate".into()
}

async fn control_interrupt(State(s): State<Shared>, Json(body): Json<InterruptBody>) -> StatusCode {
    let time = body.time.unwrap_or_else(|| {
        (chrono::Utc::now() + chrono::Duration::seconds(120))
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    });
    s.notices.lock().unwrap_or_else(|e| e.into_inner()).action = Some((body.action, time));
    StatusCode::NO_CONTENT
}

async fn control_rebalance(State(s): State<Shared>) -> StatusCode {
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    s.notices
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .rebalance = Some(now);
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn imdsv2_session_then_notice() {
        let facts = InstanceFacts {
            instance_id: "i-1".into(),
            lifecycle: "spot".into(),
            ..Default::default()
        };
        let server = MetadataServer::start("127.0.0.1:0".parse().unwrap(), facts)
            .await
            .unwrap();
        let http = reqwest::Client::new();
        let base = server.url();
        let resp = http
            .put(format!("{base}/latest/api/token"))
            .header(TOKEN_TTL_HEADER, "21600")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()[TOKEN_TTL_HEADER], "21600");
        let token = resp.text().await.unwrap();
        let get = |path: &str| {
            http.get(format!("{base}/latest/meta-data/{path}"))
                .header(TOKEN_HEADER, token.clone())
                .send()
        };
        assert_eq!(
            get("instance-id").await.unwrap().text().await.unwrap(),
            "i-1"
        );
        assert_eq!(get("spot/instance-action").await.unwrap().status(), 404);
        let unauth = http
            .get(format!("{base}/latest/meta-data/instance-id"))
            .send()
            .await
            .unwrap();
        assert_eq!(unauth.status(), 401);

        server.announce_interruption("2026-11-30T12:00:00Z");
        let notice: serde_json::Value = get("spot/instance-action")
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            notice,
            serde_json::json!({"action": "terminate", "time": "2026-11-30T12:00:00Z"})
        );

        let r = http
            .post(format!("{base}/_proteus/rebalance"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
        assert_eq!(
            get("events/recommendations/rebalance")
                .await
                .unwrap()
                .status(),
            200
        );
    }
}
