//! The web dashboard: a login page, one page of plain HTML and vanilla JavaScript (embedded in
//! the binary; no build step), and the two chart endpoints it shows.
//!
//! The page reads the same `/v1/…` endpoints as the CLI, authenticated by the session cookie
//! that `POST /login` sets (see [`super::auth`]); its pictures are the broker's own charts
//! ([`crate::chart`]), so the demo's file, the CLI and the page draw with one implementation.
//! Without a session `/` is the login form and every data endpoint answers 401.

use super::auth::{CSRF_HEADER, NewSession};
use super::error::{ApiError, ApiQuery};
use super::guard::{Peer, UserRead};
use super::{AppState, job_id};
use crate::chart::{self, Format};
use crate::market::{Market, Timestamp};
use axum::Router;
use axum::extract::rejection::FormRejection;
use axum::extract::{Form, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

const LOGIN_HTML: &str = include_str!("dashboard/login.html");
const APP_HTML: &str = include_str!("dashboard/app.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const APP_CSS: &str = include_str!("dashboard/app.css");

/// Pages load only their own scripts, styles and images, and cannot be framed.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Most markets one price chart compares.
const MAX_CHART_MARKETS: usize = 8;

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/login", post(login).get(|| async { redirect_home() }))
        .route("/logout", post(logout))
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript", APP_JS) }),
        )
        .route("/ui/app.css", get(|| async { asset("text/css", APP_CSS) }))
        .route("/v1/jobs/{id}/chart", get(job_chart))
        .route("/v1/markets/chart", get(markets_chart))
}

/// The dashboard for a live session, the login form otherwise.
async fn index(State(s): State<AppState>, headers: HeaderMap) -> Response {
    match s.auth.session_csrf(&headers) {
        Some(csrf) => page(
            StatusCode::OK,
            APP_HTML
                .replace("{{csrf}}", &csrf)
                .replace("{{csrf_header}}", CSRF_HEADER),
        ),
        None => login_page(StatusCode::OK, ""),
    }
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

/// `POST /login` (a form): the user token opens a session and goes to the dashboard; a wrong
/// one gets the form again with a message and a 401.
///
/// After [`FREE_LOGIN_FAILURES`](super::auth::FREE_LOGIN_FAILURES) wrong tokens from one
/// address, that address waits before its next attempt (429 with `Retry-After`), twice as long
/// after each further failure (see [`super::auth::LoginLimiter`]).
async fn login(
    State(s): State<AppState>,
    Peer(peer): Peer,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    let token = form.map(|Form(f)| f.token).unwrap_or_default();
    if token.trim().is_empty() {
        return login_page(StatusCode::UNAUTHORIZED, "Enter the broker's user token.");
    }
    match s.auth.login_from(peer, &token, std::time::Instant::now()) {
        Ok(NewSession { id, .. }) => {
            let mut resp = redirect_home();
            if let Ok(v) = HeaderValue::from_str(&s.auth.cookie(Some(&id))) {
                resp.headers_mut().insert(header::SET_COOKIE, v);
            }
            resp
        }
        Err(Some(wait)) => {
            // Whole seconds, rounded up: never tells a client to come back too early.
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            let mut resp = login_page(
                StatusCode::TOO_MANY_REQUESTS,
                &format!("Too many failed logins from your address: try again in {secs} seconds."),
            );
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            resp
        }
        Err(None) => login_page(
            StatusCode::UNAUTHORIZED,
            "That token is not valid for this broker.",
        ),
    }
}

async fn logout(State(s): State<AppState>, headers: HeaderMap) -> Response {
    s.auth.logout(&headers);
    let mut resp = redirect_home();
    if let Ok(v) = HeaderValue::from_str(&s.auth.cookie(None)) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

fn redirect_home() -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response()
}

fn login_page(status: StatusCode, message: &str) -> Response {
    let message = if message.is_empty() {
        String::new()
    } else {
        format!(
            r#"<p class="error" id="login-error" role="alert">{}</p>"#,
            escape(message)
        )
    };
    page(status, LOGIN_HTML.replace("{{message}}", &message))
}

fn page(status: StatusCode, html: String) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        html,
    )
        .into_response()
}

/// The page's script and style: code, no data, so they need no session (the login page uses
/// the style too).
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct ChartQuery {
    /// `svg` (default) or `png`.
    #[param(inline, value_type = Option<ChartFormat>)]
    format: Option<String>,
}

/// Shortest and longest window `hours` may ask for: 3.6 s (a shorter one rounds to nothing at
/// the store's millisecond), ten years.
const MIN_CHART_HOURS: f64 = 0.001;
const MAX_CHART_HOURS: f64 = 87_840.0;

/// What a chart can be drawn as (the schema of the `format` query parameter).
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)] // a schema only: the handlers parse the text with `Format::parse`
pub(super) enum ChartFormat {
    Svg,
    Png,
}

/// Exactly `svg` or `png`, as the document's enum says.
fn chart_format(raw: Option<&str>) -> Result<Format, ApiError> {
    raw.map_or(Ok(Format::Svg), |f| {
        Format::parse(f)
            .filter(|_| matches!(f, "svg" | "png"))
            .ok_or_else(|| ApiError::invalid("format", format!("`{f}` is not svg or png")))
    })
}

fn chart_response(format: Format, bytes: Vec<u8>) -> Response {
    (
        [
            (header::CONTENT_TYPE, format.content_type()),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        bytes,
    )
        .into_response()
}

/// `GET /v1/jobs/{id}/chart[?format=png]`: the job's spot prices, bids and instances per tier
/// from its start to its end (or now), as the demo draws it.
#[utoipa::path(get, path = "/v1/jobs/{id}/chart", params(("id" = i64, Path), ChartQuery),
    responses((status = 200, description = "the chart (image/svg+xml or image/png)"), (status = 401, body = super::error::ErrorBody),
        (status = 404, body = super::error::ErrorBody),
        (status = 422, body = super::error::ErrorBody, description = "the format is not svg or png")), security(("bearer" = [])))]
pub(super) async fn job_chart(
    _: UserRead,
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ChartQuery>,
) -> Result<Response, ApiError> {
    let format = chart_format(q.format.as_deref())?;
    let id = job_id(&id)?;
    let job = s
        .broker
        .store()
        .job(id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("job {id} does not exist")))?;
    let instances = s.broker.store().instances_of_job(id).await?;
    let from = job.started.unwrap_or(job.created);
    let to = job.finished.unwrap_or_else(|| s.broker.clock().now());
    let title = format!("job {} ({}), policy {}", job.id, job.name, job.policy);
    let data = s.broker.market_data();
    let availability = s.broker.settings().availability.clone();
    let bytes = tokio::task::spawn_blocking(move || {
        chart::job_chart(
            format,
            &title,
            &data.history,
            availability.as_deref(),
            &instances,
            from,
            to,
        )
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(ApiError::internal)?;
    Ok(chart_response(format, bytes))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct MarketsChartQuery {
    /// Markets as `zone/type`, comma-separated, e.g. `us-east-1a/c3.xlarge,us-east-1b/c3.xlarge`.
    #[param(
        min_length = 1,
        pattern = r"^[ \t\n\r\f\v]*[^\s/,\x00-\x1f\x7f-\x9f]+[a-z]/[^\s/.,\x00-\x1f\x7f-\x9f]+\.[^\s/,\x00-\x1f\x7f-\x9f]+[ \t\n\r\f\v]*(,[ \t\n\r\f\v]*[^\s/,\x00-\x1f\x7f-\x9f]+[a-z]/[^\s/.,\x00-\x1f\x7f-\x9f]+\.[^\s/,\x00-\x1f\x7f-\x9f]+[ \t\n\r\f\v]*){0,7}$"
    )]
    market: String,
    /// RFC 3339 or YYYY-MM-DD, before `to` (the window is [`from`, `to`)); default: `hours`
    /// before `to`.
    #[param(schema_with = crate::market::time_schema)]
    from: Option<String>,
    /// RFC 3339 or YYYY-MM-DD; default: now (market time).
    #[param(schema_with = crate::market::time_schema)]
    to: Option<String>,
    /// The window's length when `from` is not given; default 168 (a week).
    #[param(minimum = 0.001, maximum = 87840.0)]
    hours: Option<f64>,
    /// `svg` (default) or `png`.
    #[param(inline, value_type = Option<ChartFormat>)]
    format: Option<String>,
}

/// `GET /v1/markets/chart?market=…[&from=…&to=…|&hours=…][&format=png]`: spot price history
/// of up to eight markets over a window.
#[utoipa::path(get, path = "/v1/markets/chart", params(MarketsChartQuery),
    responses((status = 200, description = "the chart (image/svg+xml or image/png)"), (status = 401, body = super::error::ErrorBody),
        (status = 404, body = super::error::ErrorBody, description = "no prices for a market in the window"),
        (status = 422, body = super::error::ErrorBody)), security(("bearer" = [])))]
pub(super) async fn markets_chart(
    _: UserRead,
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<MarketsChartQuery>,
) -> Result<Response, ApiError> {
    let format = chart_format(q.format.as_deref())?;
    let markets = q
        .market
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(|m| Market::parse(m).map_err(|e| ApiError::invalid("market", e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    if markets.is_empty() || markets.len() > MAX_CHART_MARKETS {
        return Err(ApiError::invalid(
            "market",
            format!(
                "name between 1 and {MAX_CHART_MARKETS} markets (`zone/type`, comma-separated)"
            ),
        ));
    }
    let time = |field: &str, v: &Option<String>| {
        v.as_deref()
            .map(Timestamp::parse)
            .transpose()
            .map_err(|e| ApiError::invalid(field, e.to_string()))
    };
    let to = time("to", &q.to)?.unwrap_or_else(|| s.broker.clock().now());
    if let Some(h) = q.hours
        && !(MIN_CHART_HOURS..=MAX_CHART_HOURS).contains(&h)
    {
        return Err(ApiError::invalid(
            "hours",
            format!("must be between {MIN_CHART_HOURS} (3.6 s) and {MAX_CHART_HOURS} (ten years)"),
        ));
    }
    let from = match time("from", &q.from)? {
        Some(from) => from,
        None => to.plus_secs(-q.hours.unwrap_or(168.0) * 3600.0),
    };
    if from >= to {
        return Err(ApiError::invalid(
            "from",
            format!("{from} is not before {to}"),
        ));
    }
    let data = s.broker.market_data();
    if let Some(unknown) = markets.iter().find(|m| data.history.get(m).is_none()) {
        return Err(ApiError::not_found(format!(
            "no prices for market {unknown}"
        )));
    }
    let title = if markets.len() == 1 {
        format!("spot price of {}", markets[0])
    } else {
        format!("spot prices of {} markets", markets.len())
    };
    let bytes = tokio::task::spawn_blocking(move || {
        chart::price_chart(format, &title, &data.history, &markets, from, to)
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(ApiError::internal)?;
    Ok(chart_response(format, bytes))
}
