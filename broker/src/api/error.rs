//! The API's one error type: every failure is JSON `{"code", "message", "field"?}` with a 4xx
//! for anything the caller can fix. Internal errors are logged with their cause and answered
//! with a 500 that reveals nothing.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use utoipa::ToSchema;

/// The body of every error answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorBody {
    /// Machine-readable: `bad_request`, `invalid_field`, `unauthorized`, `forbidden`,
    /// `not_found`, `conflict`, `quota_exceeded`, `internal`.
    pub code: &'static str,
    pub message: String,
    /// The offending field, as a dotted path (`limits.max_instances`), when one is at fault.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
}

impl ApiError {
    /// An answer with this status and machine-readable code.
    pub fn with_status(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self::new(status, code, message)
    }
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            body: ErrorBody {
                code,
                message: message.into(),
                field: None,
            },
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    /// A well-formed request with a value that is not acceptable.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", message);
        e.body.field = Some(field.to_string());
        e
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    /// A valid request this broker cannot take as things stand, naming the field (`409`,
    /// `unmet`): another broker, or this one later, might.
    pub fn unmet(field: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::CONFLICT, "unmet", message);
        e.body.field = Some(field.to_string());
        e
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }
    /// Logs the cause; the caller learns only that it was not their fault.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error answering a request");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; the broker's log has the details",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body)).into_response()
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        ApiError::internal(e)
    }
}

/// `Json<T>` whose rejections are API errors naming the field at fault.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(mut value) = axum::Json::<serde_json::Value>::from_request(req, state)
            .await
            .map_err(json_rejection)?;
        // Every body of this API is an object; serde would take a struct from an array too.
        if !value.is_object() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_body",
                "the body must be a JSON object",
            ));
        }
        integral_numbers_as_integers(&mut value);
        serde_path_to_error::deserialize(value)
            .map(ApiJson)
            .map_err(|e| {
                let path = e.path().to_string();
                let problem = e.inner().to_string();
                let field = match path.as_str() {
                    "." => unknown_field_name(&problem),
                    _ => Some(path),
                };
                let mut err =
                    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", problem);
                err.body.field = field;
                err
            })
    }
}

/// JSON Schema counts a number with no fraction an integer (`389.0` is a valid `integer`);
/// serde does not. Such numbers become integers before a body is read into its type (a field
/// of floating-point type takes an integer just as well). Only those a double holds exactly.
fn integral_numbers_as_integers(v: &mut serde_json::Value) {
    use serde_json::Value;
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    match v {
        Value::Number(n) if n.is_f64() => {
            if let Some(f) = n.as_f64()
                && f.fract() == 0.0
                && f.abs() <= EXACT
            {
                *n = if f < 0.0 {
                    (f as i64).into()
                } else {
                    (f as u64).into()
                };
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_numbers_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(integral_numbers_as_integers),
        _ => {}
    }
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::JsonSyntaxError(e) => {
            let text =
                std::error::Error::source(&e).map_or_else(|| e.body_text(), |s| s.to_string());
            ApiError::bad_request(format!("malformed JSON: {text}"))
        }
        JsonRejection::MissingJsonContentType(_) => {
            let mut e =
                ApiError::bad_request("expected a JSON body with `Content-Type: application/json`");
            e.status = StatusCode::UNSUPPORTED_MEDIA_TYPE;
            e
        }
        other => ApiError::bad_request(other.body_text()),
    }
}

/// serde's "unknown field `x`, expected ..." names the field only in the message.
fn unknown_field_name(text: &str) -> Option<String> {
    let rest = text.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}

/// `Query<T>` whose rejections are API errors.
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => Err(ApiError::bad_request(
                format!("bad query string: {}", e.body_text()),
            )),
            Err(other) => Err(ApiError::bad_request(other.body_text())),
        }
    }
}

/// A path parameter that failed to parse is the caller's mistake (404 for ids that cannot exist).
pub fn path_rejection(e: axum::extract::rejection::PathRejection) -> ApiError {
    ApiError::not_found(format!("no such resource: {}", e.body_text()))
}
