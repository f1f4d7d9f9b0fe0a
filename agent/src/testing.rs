//! Stand-ins for the broker and for EC2 instance metadata, to run real agents on one machine.
//!
//! [`TestCoordinator`] serves the agent API of `proteus_wire::agent_api` around the very
//! [`Coordinator`] the broker uses; [`ImdsMock`] answers IMDSv2 like EC2 and can announce an
//! interruption or a rebalance recommendation.

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use proteus_wire::agent_api::{
    AgentEvent, ApiError, CommandsQuery, Heartbeat, RegisterRequest, TrainingConfig, paths,
};
use proteus_wire::coordinator::{Coordinator, JobStatus};
use proteus_wire::{InstanceId, JobId, Tier};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

struct CoordState {
    coordinator: Mutex<Coordinator>,
    /// token → (instance, tier)
    tokens: HashMap<String, (InstanceId, Tier)>,
    changed: Notify,
    epoch: Instant,
}

impl CoordState {
    fn lock(&self) -> MutexGuard<'_, Coordinator> {
        self.coordinator.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Runs `f` on the coordinator, plans an MLP job as the broker does once it can (see
    /// [`crate::pipeline::planning::plan_if_due`]), and wakes the long polls.
    fn update<R>(&self, f: impl FnOnce(&mut Coordinator) -> R) -> R {
        let r = {
            let mut c = self.lock();
            let r = f(&mut c);
            if let Some(Err(e)) = crate::pipeline::planning::plan_if_due(&mut c) {
                tracing::error!("planning the pipeline: {e}");
            }
            r
        };
        self.changed.notify_waiters();
        r
    }
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// A coordinator HTTP server on loopback. Dropping it stops the server.
pub struct TestCoordinator {
    state: Arc<CoordState>,
    addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

fn api_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(ApiError {
            code: code.into(),
            message: message.into(),
        }),
    )
        .into_response()
}

fn coord_error(e: proteus_wire::coordinator::CoordinatorError) -> Response {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(e.to_api_error())).into_response()
}

/// The instance a bearer token belongs to; 401 without a known token, 403 for another instance.
fn authorize(
    st: &CoordState,
    headers: &HeaderMap,
    claimed: Option<&InstanceId>,
) -> Result<(InstanceId, Tier), Box<Response>> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            Box::new(api_error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing bearer token",
            ))
        })?;
    let (id, tier) = st.tokens.get(token).cloned().ok_or_else(|| {
        Box::new(api_error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "unknown token",
        ))
    })?;
    if let Some(c) = claimed
        && *c != id
    {
        let msg = format!("token is not for instance {c}");
        return Err(Box::new(api_error(StatusCode::FORBIDDEN, "forbidden", msg)));
    }
    Ok((id, tier))
}

async fn register(
    State(st): State<Arc<CoordState>>,
    headers: HeaderMap,
    Json(req): Json<RegisterRequest>,
) -> Response {
    let (_, tier) = match authorize(&st, &headers, Some(&req.instance_id)) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let now = st.now_ms();
    let result = st.update(|c| c.register(req, tier, now));
    match result {
        Ok(r) => Json(r).into_response(),
        Err(e) => coord_error(e),
    }
}

async fn heartbeat(
    State(st): State<Arc<CoordState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(hb): Json<Heartbeat>,
) -> Response {
    let id = InstanceId(id);
    if let Err(r) = authorize(&st, &headers, Some(&id)) {
        return *r;
    }
    let now = st.now_ms();
    match st.lock().heartbeat(&id, hb, now) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => coord_error(e),
    }
}

async fn event(
    State(st): State<Arc<CoordState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(ev): Json<AgentEvent>,
) -> Response {
    let id = InstanceId(id);
    if let Err(r) = authorize(&st, &headers, Some(&id)) {
        return *r;
    }
    let now = st.now_ms();
    let result = st.update(|c| c.event(&id, ev, now));
    match result {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => coord_error(e),
    }
}

async fn commands(
    State(st): State<Arc<CoordState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Query(q): Query<CommandsQuery>,
) -> Response {
    let id = InstanceId(id);
    if let Err(r) = authorize(&st, &headers, Some(&id)) {
        return *r;
    }
    let deadline = Instant::now() + Duration::from_millis(q.wait_ms.min(30_000));
    loop {
        let notified = st.changed.notified();
        let found = st.lock().commands_after(&id, q.after);
        match found {
            Ok(c) if !c.is_empty() => return Json(c).into_response(),
            Ok(_) => {}
            Err(e) => return coord_error(e),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Json(Vec::<()>::new()).into_response();
        }
        let _ = tokio::time::timeout(left, notified).await;
    }
}

impl TestCoordinator {
    /// Serve on `127.0.0.1:0`. `agents` lists each agent's token, instance id and tier.
    pub async fn start(
        training: TrainingConfig,
        agents: &[(&str, &str, Tier)],
    ) -> std::io::Result<TestCoordinator> {
        Self::start_at(training, agents, "127.0.0.1:0".parse().expect("an address")).await
    }

    /// Serve on `addr` (e.g. a port agents were already told about).
    pub async fn start_at(
        training: TrainingConfig,
        agents: &[(&str, &str, Tier)],
        addr: std::net::SocketAddr,
    ) -> std::io::Result<TestCoordinator> {
        let coordinator = Coordinator::new(JobId(1), training)
            .map_err(|e| std::io::Error::other(e.to_string()))?
            .with_intervals(300, 5_000)
            .with_data_secret(proteus_wire::agent_api::DataSecret::from_bytes(
                rand::random(),
            ));
        let tokens = agents
            .iter()
            .map(|(t, id, tier)| (t.to_string(), (InstanceId(id.to_string()), *tier)))
            .collect();
        let state = Arc::new(CoordState {
            coordinator: Mutex::new(coordinator),
            tokens,
            changed: Notify::new(),
            epoch: Instant::now(),
        });
        let app = Router::new()
            .route(paths::REGISTER, post(register))
            .route(paths::HEARTBEAT_ROUTE, post(heartbeat))
            .route(paths::COMMANDS_ROUTE, get(commands))
            .route(paths::EVENTS_ROUTE, post(event))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        // The dead-member clock: a real broker ticks from its scheduler loop.
        let ticker_state = state.clone();
        let ticker = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let now = ticker_state.now_ms();
                let dead = ticker_state.lock().tick(now);
                if !dead.is_empty() {
                    tracing::warn!(?dead, "members declared dead");
                    ticker_state.update(|_| ());
                }
            }
        });
        Ok(TestCoordinator {
            state,
            addr,
            tasks: vec![server, ticker],
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn status(&self) -> JobStatus {
        self.state.lock().status()
    }

    /// Run `f` on the coordinator (and wake long polls afterwards).
    pub fn with<R>(&self, f: impl FnOnce(&mut Coordinator) -> R) -> R {
        self.state.update(f)
    }

    /// The cloud says the instance is gone.
    pub fn remove(&self, id: &str, reason: &str) {
        let now = self.state.now_ms();
        self.with(|c| c.remove(&InstanceId(id.into()), reason, now));
    }

    /// Wait until `pred(status)` holds, or `timeout`.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&JobStatus) -> bool,
    ) -> Option<JobStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.status();
            if pred(&st) {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for TestCoordinator {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// IMDS
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct ImdsState {
    instance_id: String,
    action: Mutex<Option<String>>,
    rebalance: Mutex<Option<String>>,
    token: String,
}

/// An IMDSv2 endpoint on loopback. Dropping it stops the server.
pub struct ImdsMock {
    state: Arc<ImdsState>,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

fn check_token(st: &ImdsState, headers: &HeaderMap) -> bool {
    headers
        .get("x-aws-ec2-metadata-token")
        .and_then(|v| v.to_str().ok())
        == Some(st.token.as_str())
}

async fn imds_token(State(st): State<Arc<ImdsState>>, headers: HeaderMap) -> Response {
    let Some(ttl) = headers.get("x-aws-ec2-metadata-token-ttl-seconds").cloned() else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut h = HeaderMap::new();
    h.insert("x-aws-ec2-metadata-token-ttl-seconds", ttl);
    (h, st.token.clone()).into_response()
}

async fn imds_get(
    State(st): State<Arc<ImdsState>>,
    Path(path): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !check_token(&st, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let lock = |m: &Mutex<Option<String>>| m.lock().map(|g| g.clone()).unwrap_or(None);
    let body = match path.as_str() {
        "instance-id" => Some(st.instance_id.clone()),
        "spot/instance-action" => lock(&st.action),
        "events/recommendations/rebalance" => lock(&st.rebalance),
        _ => None,
    };
    match body {
        Some(b) => b.into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

impl ImdsMock {
    pub async fn start(instance_id: &str) -> std::io::Result<ImdsMock> {
        let state = Arc::new(ImdsState {
            instance_id: instance_id.into(),
            token: format!("tok-{instance_id}"),
            ..Default::default()
        });
        let app = Router::new()
            .route("/latest/api/token", put(imds_token))
            .route("/latest/meta-data/{*path}", get(imds_get))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(ImdsMock { state, addr, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Announce a spot interruption `in_secs` from now (EC2 gives two minutes).
    pub fn announce_interruption(&self, in_secs: u64) {
        let t = std::time::SystemTime::now() + Duration::from_secs(in_secs);
        let body = format!(r#"{{"action":"terminate","time":"{}"}}"#, rfc3339(t));
        if let Ok(mut a) = self.state.action.lock() {
            *a = Some(body);
        }
    }

    pub fn announce_rebalance(&self) {
        let body = format!(
            r#"{{"noticeTime":"{}"}}"#,
            rfc3339(std::time::SystemTime::now())
        );
        if let Ok(mut r) = self.state.rebalance.lock() {
            *r = Some(body);
        }
    }
}

impl Drop for ImdsMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ`, as IMDS writes a notice's time.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let millis = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    proteus_wire::time::format_millis(millis)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_roundtrips_with_parser() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_796_034_900);
        let s = super::rfc3339(t);
        assert_eq!(s, "2026-11-30T10:35:00Z");
        assert_eq!(proteus_wire::time::parse_millis(&s), Ok(1_796_034_900_000));
    }
}
