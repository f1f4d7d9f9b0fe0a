//! The REST API (axum): jobs and their cost for users, markets and prices, the agents' control
//! protocol, health, metrics and the OpenAPI document.
//!
//! [`router`] builds the whole app from a [`Broker`]; tests serve it on `127.0.0.1:0` and talk
//! to it over real HTTP.

pub mod auth;
mod dashboard;
pub mod error;
mod guard;
mod openapi;
pub mod server;
pub mod spec_doc;
pub mod tls;

use crate::market::{Market, Timestamp, UsdPerHour};
use crate::service::jobs::{CostReport, JobView};
use crate::service::spec::JobSpec;
use crate::service::{Broker, ServiceError};
use crate::store::MarketFilter;
use auth::{Access, UserAuth, bearer};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use error::{ApiError, ApiJson, ApiQuery};
use guard::{AgentAuth, UserRead, UserWrite};
use proteus_wire::JobId;
use proteus_wire::agent_api::{
    AgentEvent, BootstrapRequest, BootstrapResponse, CheckpointQuery, CheckpointTransfer,
    CommandEnvelope, CommandsQuery, Heartbeat, RegisterRequest, RegisterResponse, paths,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use utoipa::ToSchema;

/// The OpenAPI document as JSON text.
pub fn openapi_json() -> String {
    openapi::json()
}

/// What every handler sees.
#[derive(Clone)]
pub struct AppState {
    pub broker: Arc<Broker>,
    pub auth: UserAuth,
    /// What `GET /v1/downloads/…` serves to agents on real VMs (see `docs/aws.md`).
    pub downloads: Downloads,
    /// The simulated market's clock (`/v1/sim/clock`); none on EC2.
    pub sim_clock: Option<Arc<crate::clock::SimClock>>,
}

/// Files agents fetch at boot: their binary and the data sets.
#[derive(Clone, Debug, Default)]
pub struct Downloads {
    pub agent_binary: Option<std::path::PathBuf>,
    pub data_dir: Option<std::path::PathBuf>,
}

/// The whole API.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi::document))
        .route("/v1/jobs", post(submit_job).get(list_jobs))
        .route("/v1/jobs/dry-run", post(dry_run_job))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/jobs/{id}/cost", get(job_cost))
        .route("/v1/jobs/{id}/events", get(job_events))
        .route("/v1/instances/{id}/interruption", post(interrupt_instance))
        .route("/v1/sim/clock", get(sim_clock).post(hold_sim_clock))
        .route("/v1/markets", get(list_markets))
        .route("/v1/prices", get(list_prices))
        .route("/v1/downloads/proteus-agent", get(download_agent))
        .route("/v1/downloads/data/{name}", get(download_data))
        .route(paths::BOOTSTRAP, post(agent_bootstrap))
        .route(paths::REGISTER, post(agent_register))
        .route(paths::HEARTBEAT_ROUTE, post(agent_heartbeat))
        .route(paths::COMMANDS_ROUTE, get(agent_commands))
        .route(paths::EVENTS_ROUTE, post(agent_event))
        .route(paths::CHECKPOINT_ROUTE, get(agent_checkpoint))
        .route(paths::OUTPUT_ROUTE, post(agent_output))
        .route(paths::WORKDIR_ROUTE, get(agent_workdir))
        .route("/v1/jobs/{id}/logs", get(job_logs))
        .merge(dashboard::routes())
        .layer(tower_http::limit::RequestBodyLimitLayer::new(1 << 20))
        // Checkpoint archives are large: the store enforces its own per-upload limit and the
        // job's quota, with messages that say which (413, 507).
        .route(
            paths::CHECKPOINT_DATA_ROUTE,
            put(agent_checkpoint_put).get(agent_checkpoint_get),
        )
        .fallback(|| async { ApiError::not_found("no such endpoint; see /v1/openapi.json") })
        .with_state(state)
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::Invalid { field, message } => ApiError::invalid(&field, message),
            ServiceError::Unmet { field, message } => ApiError::unmet(&field, message),
            ServiceError::NoSuchJob(id) => ApiError::not_found(format!("job {id} does not exist")),
            ServiceError::JobOver(id) => ApiError::conflict(format!("job {id} is already over")),
            ServiceError::NoSuchInstance(id) => {
                ApiError::not_found(format!("instance {id} does not exist"))
            }
            ServiceError::Refused(message) => ApiError::conflict(message),
            ServiceError::BadRequest(message) => ApiError::bad_request(message),
            ServiceError::Unauthenticated(message) => ApiError::unauthorized(message),
            ServiceError::Forbidden(message) => ApiError::forbidden(message),
            ServiceError::NotFound(message) => ApiError::not_found(message),
            ServiceError::TooLarge(message) => {
                ApiError::with_status(StatusCode::PAYLOAD_TOO_LARGE, "bad_request", message)
            }
            ServiceError::TooMany(message) => {
                ApiError::with_status(StatusCode::TOO_MANY_REQUESTS, "too_many", message)
            }
            ServiceError::InsufficientStorage(message) => {
                ApiError::with_status(StatusCode::INSUFFICIENT_STORAGE, "quota_exceeded", message)
            }
            ServiceError::Unavailable(message) => {
                ApiError::with_status(StatusCode::SERVICE_UNAVAILABLE, "bad_request", message)
            }
            // The agent API's own mapping, shared with every other user of the coordinator.
            ServiceError::Coordinator(e) => ApiError::with_status(
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST),
                e.code(),
                e.to_string(),
            ),
            ServiceError::NotOwner { job }
            | ServiceError::Store(crate::store::StoreError::Fenced { job }) => {
                ApiError::with_status(
                    StatusCode::MISDIRECTED_REQUEST,
                    "not_owner",
                    format!(
                        "job {job} is run by another broker of this deployment: ask the next \
                         broker URL (agents do so on their own)"
                    ),
                )
            }
            // Retried by agents (a 5xx), on this broker: it answers again once renewed.
            e @ ServiceError::LeaseLapsed { .. } => ApiError::with_status(
                StatusCode::SERVICE_UNAVAILABLE,
                "lease_lapsed",
                e.to_string(),
            ),
            other => ApiError::internal(other),
        }
    }
}

/// Job ids in paths: anything that is not one cannot name a job.
fn job_id(raw: &str) -> Result<JobId, ApiError> {
    raw.parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .map(JobId)
        .ok_or_else(|| ApiError::not_found(format!("job `{raw}` does not exist")))
}

/// The user's rights (the user token, or a dashboard session and, for a change, its CSRF
/// header), with a distinct 403 for an agent's token. Handlers ask through [`guard::UserRead`]
/// and [`guard::UserWrite`], before anything else of the request is read.
pub(crate) async fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    access: Access,
) -> Result<(), ApiError> {
    match state.auth.check_user(headers, access) {
        Ok(()) => Ok(()),
        Err(e) => {
            if let Some(t) = bearer(headers)
                && state
                    .broker
                    .store()
                    .instance_by_token_hash(&auth::hash_token(t))
                    .await?
                    .is_some()
            {
                return Err(ApiError::forbidden("agent tokens cannot use the job API"));
            }
            Err(e)
        }
    }
}

#[derive(Serialize, ToSchema)]
struct Health {
    status: &'static str,
    cloud: &'static str,
    database: &'static str,
}

#[utoipa::path(get, path = "/healthz", responses((status = 200, body = Health)))]
async fn healthz(State(s): State<AppState>) -> Response {
    let db_ok = s.broker.store().price_row_count().await.is_ok();
    let body = Health {
        status: if db_ok { "ok" } else { "degraded" },
        cloud: s.broker.cloud().kind(),
        database: if db_ok { "ok" } else { "unreachable" },
    };
    let status = if db_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

/// The broker's metrics for Prometheus, behind the user token (they show what each job spent):
/// a scrape job sends it with `authorization: {type: Bearer, credentials_file: …}` (see the
/// README). Also at `/v1/metrics`.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "OpenMetrics text format (Prometheus)", content_type = "application/openmetrics-text")),
    security(("bearer" = [])))]
async fn metrics(_: UserRead, State(s): State<AppState>) -> Result<Response, ApiError> {
    let text = crate::service::metrics_text(&s.broker).await?;
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    Ok(([("content-type", content_type)], text).into_response())
}

#[utoipa::path(post, path = "/v1/jobs", request_body = JobSpec,
    responses((status = 201, body = JobView), (status = 400, body = error::ErrorBody), (status = 401, body = error::ErrorBody),
        (status = 409, body = error::ErrorBody, description = "`unmet`: valid, but this broker cannot take it as things stand (an instance type it has no market for, a deadline past or out of reach, its instance cap)"),
        (status = 422, body = error::ErrorBody)), security(("bearer" = [])))]
async fn submit_job(
    _: UserWrite,
    State(s): State<AppState>,
    ApiJson(spec): ApiJson<JobSpec>,
) -> Result<Response, ApiError> {
    let view = s.broker.submit(spec).await?;
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

/// What the job would buy if it were submitted now: its engine's first decision (markets, tiers,
/// counts, bids, prices) with the expected cost per unit of work and finish at today's prices.
/// Checks the spec as a submission does; stores and launches nothing.
#[utoipa::path(post, path = "/v1/jobs/dry-run", request_body = JobSpec,
    responses((status = 200, body = crate::service::dry_run::DryRun),
        (status = 409, body = error::ErrorBody, description = "`unmet`: valid, but this broker cannot take it as things stand"),
        (status = 422, body = error::ErrorBody)),
    security(("bearer" = [])))]
async fn dry_run_job(
    _: UserRead,
    State(s): State<AppState>,
    ApiJson(spec): ApiJson<JobSpec>,
) -> Result<Json<crate::service::dry_run::DryRun>, ApiError> {
    Ok(Json(s.broker.dry_run(spec).await?))
}

#[utoipa::path(get, path = "/v1/jobs", responses((status = 200, body = Vec<JobView>), (status = 401, body = error::ErrorBody)),
    security(("bearer" = [])))]
async fn list_jobs(_: UserRead, State(s): State<AppState>) -> Result<Json<Vec<JobView>>, ApiError> {
    Ok(Json(s.broker.job_views().await?))
}

#[utoipa::path(get, path = "/v1/jobs/{id}", params(("id" = i64, Path)),
    responses((status = 200, body = JobView), (status = 404, body = error::ErrorBody)), security(("bearer" = [])))]
async fn get_job(
    _: UserRead,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    Ok(Json(s.broker.job_view(job_id(&id)?).await?))
}

/// Cancels a job: its instances are released and its ledger closed. The job stays: `GET
/// /v1/jobs/{id}`, its cost, events and logs keep answering, with the state `cancelled`.
#[utoipa::path(post, path = "/v1/jobs/{id}/cancel", params(("id" = i64, Path)),
    responses((status = 200, body = JobView, description = "the cancelled job"), (status = 404, body = error::ErrorBody),
        (status = 409, body = error::ErrorBody, description = "the job is already over")),
    security(("bearer" = [])))]
async fn cancel_job(
    _: UserWrite,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    Ok(Json(s.broker.cancel(job_id(&id)?).await?))
}

/// Interrupts a spot instance now, as a price spike would (the simulated cloud; on AWS, Fault
/// Injection Service does this): the job's events then show the warning, the agent's notice,
/// the hand-over and the eviction.
#[utoipa::path(post, path = "/v1/instances/{id}/interruption", params(("id" = String, Path)),
    responses((status = 202, body = crate::service::jobs::InterruptionSent),
        (status = 404, body = error::ErrorBody), (status = 409, body = error::ErrorBody)),
    security(("bearer" = [])))]
async fn interrupt_instance(
    _: UserWrite,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<crate::service::jobs::InterruptionSent>), ApiError> {
    let sent = s.broker.interrupt_instance(&id).await?;
    Ok((StatusCode::ACCEPTED, Json(sent)))
}

/// The simulated market's clock: market time now, its speed, and the instant it is held at.
#[derive(Serialize, ToSchema)]
struct SimClockView {
    /// Market time now (RFC 3339).
    now: String,
    /// Market seconds per wall second while it runs.
    speed: f64,
    /// The market runs up to this instant and stops there (RFC 3339); none: it runs.
    held_at: Option<String>,
}

/// A new hold of the simulated market's clock.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct SimClockHold {
    /// Hold the market at this instant (RFC 3339): it runs there and stops (at once when it is
    /// past). Absent or null: lift the hold, and the market runs on from where it stands.
    #[serde(default)]
    #[schema(schema_with = crate::market::nullable_time_schema)]
    hold_at: Option<String>,
}

fn sim_clock_of(s: &AppState) -> Result<&crate::clock::SimClock, ApiError> {
    s.sim_clock.as_deref().ok_or_else(|| {
        ApiError::conflict(
            "this broker's clock is not the simulated market's (EC2 runs on wall time, the \
             demo steps its own): it cannot be read or held here",
        )
    })
}

fn sim_clock_view(c: &crate::clock::SimClock) -> SimClockView {
    use crate::clock::Clock;
    SimClockView {
        now: c.now().to_string(),
        speed: c.speed(),
        held_at: c.held_at().map(|t| t.to_string()),
    }
}

/// The simulated market's clock.
#[utoipa::path(get, path = "/v1/sim/clock",
    responses((status = 200, body = SimClockView), (status = 409, body = error::ErrorBody)),
    security(("bearer" = [])))]
async fn sim_clock(_: UserRead, State(s): State<AppState>) -> Result<Json<SimClockView>, ApiError> {
    Ok(Json(sim_clock_view(sim_clock_of(&s)?)))
}

/// Holds the simulated market at an instant, or lifts the hold (`proteus serve --hold-at` sets
/// one at the start): whoever watches a moment of the trace decides when the market passes it,
/// not the machine's speed. Market time never runs backwards.
#[utoipa::path(post, path = "/v1/sim/clock", request_body = SimClockHold,
    responses((status = 200, body = SimClockView), (status = 409, body = error::ErrorBody)),
    security(("bearer" = [])))]
async fn hold_sim_clock(
    _: UserWrite,
    State(s): State<AppState>,
    ApiJson(hold): ApiJson<SimClockHold>,
) -> Result<Json<SimClockView>, ApiError> {
    let clock = sim_clock_of(&s)?;
    let at = match &hold.hold_at {
        Some(t) => {
            Some(Timestamp::parse(t).map_err(|e| ApiError::invalid("hold_at", e.to_string()))?)
        }
        None => None,
    };
    clock.hold_at(at);
    tracing::info!(held_at = ?at.map(|t| t.to_string()), "simulated market clock hold changed");
    Ok(Json(sim_clock_view(clock)))
}

#[utoipa::path(get, path = "/v1/jobs/{id}/cost", params(("id" = i64, Path)),
    responses((status = 200, body = CostReport), (status = 404, body = error::ErrorBody)), security(("bearer" = [])))]
async fn job_cost(
    _: UserRead,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<CostReport>, ApiError> {
    let id = job_id(&id)?;
    Ok(Json(s.broker.cost_report(id).await?))
}

#[derive(Serialize, ToSchema)]
struct EventView {
    id: i64,
    time: String,
    instance_id: Option<String>,
    kind: String,
    detail: String,
}

/// Events per page of `GET /v1/jobs/{id}/events` unless `limit` says otherwise.
pub const DEFAULT_EVENTS_PAGE: u32 = 1000;
/// The largest `limit` of `GET /v1/jobs/{id}/events`.
pub const MAX_EVENTS_PAGE: u32 = 5000;

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Only events with an id above this one: the last id of the previous page (default 0,
    /// from the first event).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// Events per page: 1 to 5000, default 1000.
    #[param(minimum = 1, maximum = 5000)]
    limit: Option<u32>,
}

/// A job's events, oldest first, a page at a time: a full page comes with a `Link` header
/// (`rel="next"`) to the next one; a page shorter than `limit` is the last for now.
#[utoipa::path(get, path = "/v1/jobs/{id}/events", params(("id" = i64, Path), EventsQuery),
    responses((status = 200, body = Vec<EventView>,
            headers(("link" = String, description = "`</v1/jobs/{id}/events?after=…&limit=…>; rel=\"next\"` when the page is full"))),
        (status = 404, body = error::ErrorBody),
        (status = 422, body = error::ErrorBody, description = "`after` or `limit` is out of range")),
    security(("bearer" = [])))]
async fn job_events(
    _: UserRead,
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    let id = job_id(&id)?;
    let after = q.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError::invalid("after", "must be an event id, 0 or more"));
    }
    let limit = q.limit.unwrap_or(DEFAULT_EVENTS_PAGE);
    if !(1..=MAX_EVENTS_PAGE).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            format!("must be between 1 and {MAX_EVENTS_PAGE}"),
        ));
    }
    if s.broker.store().job(id).await?.is_none() {
        return Err(ApiError::not_found(format!("job {id} does not exist")));
    }
    let events = s
        .broker
        .store()
        .events_of_job_page(id, after, limit)
        .await?;
    let next = (events.len() == limit as usize)
        .then(|| events.last().map(|e| e.id))
        .flatten();
    let page: Vec<EventView> = events
        .into_iter()
        .map(|e| EventView {
            id: e.id,
            time: e.time.to_string(),
            instance_id: e.instance_id,
            kind: e.kind,
            detail: e.detail,
        })
        .collect();
    let mut resp = Json(page).into_response();
    if let Some(last) = next
        && let Ok(link) = axum::http::HeaderValue::from_str(&format!(
            "</v1/jobs/{id}/events?after={last}&limit={limit}>; rel=\"next\""
        ))
    {
        resp.headers_mut().insert(axum::http::header::LINK, link);
    }
    Ok(resp)
}

#[derive(Serialize, ToSchema)]
struct MarketView {
    market: String,
    region: String,
    availability_zone: String,
    instance_type: String,
    product: String,
    price_changes: i64,
    first: Option<String>,
    last: Option<String>,
    /// The price in force now (market time), if known.
    #[schema(value_type = Option<f64>)]
    spot_usd: Option<UsdPerHour>,
    #[schema(value_type = Option<f64>)]
    on_demand_usd: Option<UsdPerHour>,
}

#[utoipa::path(get, path = "/v1/markets", responses((status = 200, body = Vec<MarketView>)), security(("bearer" = [])))]
async fn list_markets(
    _: UserRead,
    State(s): State<AppState>,
) -> Result<Json<Vec<MarketView>>, ApiError> {
    let rows = s.broker.store().markets(&MarketFilter::default()).await?;
    let data = s.broker.market_data();
    let now = s.broker.clock().now();
    Ok(Json(
        rows.into_iter()
            .map(|r| MarketView {
                spot_usd: data.history.get(&r.market).and_then(|x| x.price_at(now)),
                on_demand_usd: data
                    .history
                    .on_demand()
                    .for_market(&r.market)
                    .map(|o| o.on_demand),
                market: r.market.to_string(),
                region: r.region.to_string(),
                availability_zone: r.market.zone.to_string(),
                instance_type: r.market.instance_type.to_string(),
                product: r.market.product.to_string(),
                price_changes: r.price_rows,
                first: r.first.map(|t| t.to_string()),
                last: r.last.map(|t| t.to_string()),
            })
            .collect(),
    ))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct PricesQuery {
    /// `zone/type`, e.g. `us-east-1a/c3.xlarge` (or `zone/type/product`).
    #[param(
        min_length = 1,
        pattern = r"^[^\s/\x00-\x1f\x7f-\x9f]+[a-z]/[^\s/.\x00-\x1f\x7f-\x9f]+\.[^\s/\x00-\x1f\x7f-\x9f]+(/[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*)?$"
    )]
    market: String,
    /// RFC 3339 or YYYY-MM-DD.
    #[param(schema_with = crate::market::time_schema)]
    from: Option<String>,
    /// RFC 3339 or YYYY-MM-DD.
    #[param(schema_with = crate::market::time_schema)]
    to: Option<String>,
}

#[derive(Serialize, ToSchema)]
struct PricePoint {
    time: String,
    #[schema(value_type = f64)]
    usd_per_hour: UsdPerHour,
}

#[utoipa::path(get, path = "/v1/prices", params(PricesQuery),
    responses((status = 200, body = Vec<PricePoint>), (status = 400, body = error::ErrorBody),
        (status = 422, body = error::ErrorBody, description = "the market or a time does not parse")), security(("bearer" = [])))]
async fn list_prices(
    _: UserRead,
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<PricesQuery>,
) -> Result<Json<Vec<PricePoint>>, ApiError> {
    let market =
        Market::parse(&q.market).map_err(|e| ApiError::invalid("market", e.to_string()))?;
    let time = |field: &str, v: &Option<String>| {
        v.as_deref()
            .map(Timestamp::parse)
            .transpose()
            .map_err(|e| ApiError::invalid(field, e.to_string()))
    };
    let (from, to) = (time("from", &q.from)?, time("to", &q.to)?);
    let filter = MarketFilter {
        region: None,
        zone: Some(market.zone.clone()),
        instance_type: Some(market.instance_type.clone()),
    };
    let history = s.broker.store().load_history(&filter, from, to).await?;
    let points = history
        .get(&market)
        .map(|series| {
            series
                .times()
                .iter()
                .zip(series.prices())
                .map(|(t, p)| PricePoint {
                    time: t.to_string(),
                    usd_per_hour: UsdPerHour::validated(*p),
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Json(points))
}

fn agent_token(headers: &HeaderMap) -> Option<&str> {
    bearer(headers)
}

/// An agent's first contact: the one-time bootstrap token from its instance's user data (the
/// bearer) for its agent token. Only for the instance it was issued to, and only once: a second
/// exchange is refused and recorded in the job's events (`bootstrap_refused`).
#[utoipa::path(post, path = "/v1/agents/bootstrap", request_body = BootstrapRequest,
    responses((status = 200, body = BootstrapResponse), (status = 401, body = error::ErrorBody),
        (status = 403, body = error::ErrorBody, description = "already exchanged, another instance's, or the instance has ended"),
        (status = 421, body = error::ErrorBody, description = "another broker owns the job: try the next broker URL"),
        (status = 503, body = error::ErrorBody, description = "the instance's launch is not recorded yet: ask again shortly")),
    security(("bootstrap" = [])))]
async fn agent_bootstrap(
    _: guard::BootstrapAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<BootstrapRequest>,
) -> Result<Json<BootstrapResponse>, ApiError> {
    Ok(Json(
        s.broker.agent_bootstrap(agent_token(&headers), req).await?,
    ))
}

#[utoipa::path(post, path = "/v1/agents/register", request_body = RegisterRequest,
    responses((status = 200, body = RegisterResponse), (status = 401, body = error::ErrorBody), (status = 403, body = error::ErrorBody),
        (status = 409, body = error::ErrorBody, description = "the job is over (`job_over`)")),
    security(("agent" = [])))]
async fn agent_register(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> Result<Response, ApiError> {
    let resp = s.broker.agent_register(agent_token(&headers), req).await?;
    Ok(Json(resp).into_response())
}

#[utoipa::path(post, path = "/v1/agents/{instance_id}/heartbeat", request_body = Heartbeat, params(("instance_id" = String, Path)),
    responses((status = 204), (status = 401, body = error::ErrorBody), (status = 403, body = error::ErrorBody),
        (status = 404, body = error::ErrorBody, description = "the instance is not a member of its job"),
        (status = 409, body = error::ErrorBody, description = "the job is over (`job_over`)")), security(("agent" = [])))]
async fn agent_heartbeat(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(hb): ApiJson<Heartbeat>,
) -> Result<StatusCode, ApiError> {
    s.broker
        .agent_heartbeat(agent_token(&headers), &id, hb)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/agents/{instance_id}/commands", params(("instance_id" = String, Path), ("after" = Option<u64>, Query),
    ("wait_ms" = Option<u64>, Query)),
    responses((status = 200, body = Vec<CommandEnvelope>), (status = 401, body = error::ErrorBody),
        (status = 404, body = error::ErrorBody, description = "the instance is not a member of its job"),
        (status = 409, body = error::ErrorBody, description = "the job is over (`job_over`)")), security(("agent" = [])))]
async fn agent_commands(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<CommandsQuery>,
) -> Result<Response, ApiError> {
    let commands = s
        .broker
        .agent_commands(agent_token(&headers), &id, q.after, q.wait_ms)
        .await?;
    Ok(Json(commands).into_response())
}

#[utoipa::path(post, path = "/v1/agents/{instance_id}/events", request_body = AgentEvent, params(("instance_id" = String, Path)),
    responses((status = 204), (status = 401, body = error::ErrorBody),
        (status = 404, body = error::ErrorBody, description = "the instance is not a member of its job"),
        (status = 409, body = error::ErrorBody, description = "the job is over (`job_over`)")), security(("agent" = [])))]
async fn agent_event(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(event): ApiJson<AgentEvent>,
) -> Result<StatusCode, ApiError> {
    s.broker
        .agent_event(agent_token(&headers), &id, event)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/agents/{instance_id}/checkpoint", params(("instance_id" = String, Path), ("rank" = u32, Query),
    ("op" = inline(proteus_wire::agent_api::CheckpointOp), Query, description = "`upload` or `download`")),
    responses((status = 200, body = CheckpointTransfer), (status = 401, body = error::ErrorBody), (status = 503, body = error::ErrorBody),
        (status = 422, body = error::ErrorBody, description = "the rank is out of range")),
    security(("agent" = [])))]
async fn agent_checkpoint(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<CheckpointQuery>,
) -> Result<Json<CheckpointTransfer>, ApiError> {
    Ok(Json(
        s.broker
            .agent_checkpoint_transfer(agent_token(&headers), &id, q.rank, q.op)
            .await?,
    ))
}

#[utoipa::path(get, path = "/v1/agents/{instance_id}/workdir", params(("instance_id" = String, Path)),
    responses((status = 200, body = CheckpointTransfer, description = "a presigned `GET` of the job's `s3://` working directory"),
        (status = 401, body = error::ErrorBody), (status = 403, body = error::ErrorBody),
        (status = 404, body = error::ErrorBody, description = "the job has no `s3://` working directory, or the instance is not known"),
        (status = 503, body = error::ErrorBody, description = "this broker has no S3 checkpoint store to sign with")),
    security(("agent" = [])))]
async fn agent_workdir(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<CheckpointTransfer>, ApiError> {
    Ok(Json(
        s.broker
            .agent_workdir_transfer(agent_token(&headers), &id)
            .await?,
    ))
}

fn rank_of(raw: &str) -> Result<u32, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::invalid("rank", format!("`{raw}` is not a rank")))
}

#[utoipa::path(put, path = "/v1/agents/{instance_id}/checkpoint-data/{rank}", params(("instance_id" = String, Path), ("rank" = u32, Path)),
    request_body(content = Vec<u8>, description = "a gzipped tar of the checkpoint directory", content_type = "application/octet-stream"),
    responses((status = 204), (status = 401, body = error::ErrorBody),
        (status = 413, body = error::ErrorBody, description = "the archive is over the broker's per-upload limit (`serve --checkpoint-max-archive`)"),
        (status = 422, body = error::ErrorBody, description = "the rank is not a number, or the body is empty"),
        (status = 507, body = error::ErrorBody, description = "the job's checkpoints would go over its disk quota (`serve --checkpoint-job-quota`)")),
    security(("agent" = [])))]
async fn agent_checkpoint_put(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((id, rank)): Path<(String, String)>,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let rank = rank_of(&rank)?;
    // A checkpoint is a gzipped tar, never empty: a request that declares no body at all (no
    // length, or length 0, and not chunked) would store an archive no restore can open.
    let declared = |name: axum::http::HeaderName| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let chunked = declared(axum::http::header::TRANSFER_ENCODING)
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let length =
        declared(axum::http::header::CONTENT_LENGTH).and_then(|v| v.trim().parse::<u64>().ok());
    if !chunked && length.unwrap_or(0) == 0 {
        return Err(ApiError::invalid(
            "body",
            "empty: a checkpoint is a gzipped tar of the checkpoint directory".to_string(),
        ));
    }
    let bytes = s
        .broker
        .agent_checkpoint_put(
            agent_token(&headers),
            &id,
            rank,
            length.filter(|_| !chunked),
            body.into_data_stream(),
        )
        .await?;
    tracing::debug!(instance = %id, rank, bytes, "checkpoint stored");
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/agents/{instance_id}/checkpoint-data/{rank}", params(("instance_id" = String, Path), ("rank" = u32, Path)),
    responses((status = 200, description = "the rank's newest checkpoint archive"), (status = 404, body = error::ErrorBody),
        (status = 422, body = error::ErrorBody, description = "the rank is not a number")),
    security(("agent" = [])))]
async fn agent_checkpoint_get(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((id, rank)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let rank = rank_of(&rank)?;
    match s
        .broker
        .agent_checkpoint_file(agent_token(&headers), &id, rank)
        .await?
    {
        Some(path) => send_file(&path, "application/gzip").await,
        None => Err(ApiError::not_found(format!(
            "no checkpoint of rank {rank} yet"
        ))),
    }
}

#[utoipa::path(post, path = "/v1/agents/{instance_id}/output", params(("instance_id" = String, Path)),
    request_body(content = Option<String>, description = "the newest tail of the program's output (empty when it printed nothing)", content_type = "text/plain"),
    responses((status = 204), (status = 401, body = error::ErrorBody)), security(("agent" = [])))]
async fn agent_output(
    _: AgentAuth,
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    text: String,
) -> Result<StatusCode, ApiError> {
    s.broker
        .agent_output(agent_token(&headers), &id, &text)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/jobs/{id}/logs", params(("id" = i64, Path)),
    responses((status = 200, body = Vec<crate::service::programs::OutputView>), (status = 404, body = error::ErrorBody)),
    security(("bearer" = [])))]
async fn job_logs(
    _: UserRead,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Vec<crate::service::programs::OutputView>>, ApiError> {
    Ok(Json(s.broker.job_outputs(job_id(&id)?).await?))
}

/// A file as the answer, streamed from disk as the client takes it (checkpoint archives and
/// the agent binary are large; many agents fetch at once).
async fn send_file(
    path: &std::path::Path,
    content_type: &'static str,
) -> Result<Response, ApiError> {
    send_named_file(path, content_type, "the file").await
}

/// [`send_file`]; a failure names only `what` (as the client asked for it), never where the
/// broker keeps it, which goes to the log.
async fn send_named_file(
    path: &std::path::Path,
    content_type: &'static str,
    what: &str,
) -> Result<Response, ApiError> {
    let file = tokio::fs::File::open(path).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            tracing::debug!(path = %path.display(), "{what} asked for, not here");
            ApiError::not_found(format!("{what} is not available here"))
        } else {
            tracing::error!(path = %path.display(), error = %e, "cannot read {what}");
            ApiError::internal(format!("cannot read {what}"))
        }
    })?;
    let length = file
        .metadata()
        .await
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    let body =
        axum::body::Body::from_stream(tokio_util::io::ReaderStream::with_capacity(file, 64 * 1024));
    let mut response = ([("content-type", content_type)], body).into_response();
    if let Some(length) = length {
        response
            .headers_mut()
            .insert(axum::http::header::CONTENT_LENGTH, length.into());
    }
    Ok(response)
}

#[utoipa::path(get, path = "/v1/downloads/proteus-agent",
    responses((status = 200, description = "the agent binary"), (status = 401, body = error::ErrorBody), (status = 404, body = error::ErrorBody)),
    security(("agent" = []), ("bootstrap" = [])))]
/// Downloads need a live instance's token (or its bootstrap token until traded): only the
/// broker's own VMs may fetch.
async fn download_agent(
    _: guard::DownloadAuth,
    State(s): State<AppState>,
) -> Result<Response, ApiError> {
    let path = s.downloads.agent_binary.clone().ok_or_else(|| {
        ApiError::not_found("this broker serves no agent binary (see --agent-download)")
    })?;
    send_named_file(&path, "application/octet-stream", "the agent binary").await
}

#[utoipa::path(get, path = "/v1/downloads/data/{name}", params(("name" = String, Path)),
    responses((status = 200, description = "a data set file"), (status = 401, body = error::ErrorBody), (status = 404, body = error::ErrorBody)),
    security(("agent" = []), ("bootstrap" = [])))]
async fn download_data(
    _: guard::DownloadAuth,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    // A plain file name inside the data directory, nothing else.
    let plain = !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !plain {
        return Err(ApiError::not_found(format!("no data set `{name}`")));
    }
    let dir = s
        .downloads
        .data_dir
        .clone()
        .ok_or_else(|| ApiError::not_found("this broker serves no data sets"))?;
    send_named_file(
        &dir.join(&name),
        "application/octet-stream",
        &format!("data set `{name}`"),
    )
    .await
}
