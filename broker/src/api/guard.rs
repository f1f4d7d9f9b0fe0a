//! Authentication as extractors, so that it comes first: axum runs a handler's extractors in
//! the order of its arguments, and every handler takes one of these before its path, query and
//! body. A request without valid credentials is answered 401 (or 403) before any of the rest
//! is parsed, so it learns nothing about what the API expects, and its body is never read.

use super::auth::{Access, bearer};
use super::error::ApiError;
use super::{AppState, authorize};
use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;

/// The user's read rights: the user token, or a dashboard session.
pub struct UserRead;

/// The user's rights to change something: the user token, or a dashboard session with its CSRF
/// header.
pub struct UserWrite;

impl FromRequestParts<AppState> for UserRead {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        authorize(s, &parts.headers, Access::Read).await?;
        Ok(UserRead)
    }
}

impl FromRequestParts<AppState> for UserWrite {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        authorize(s, &parts.headers, Access::Write).await?;
        Ok(UserWrite)
    }
}

/// An agent's token, checked against the `{instance_id}` of the path when the route has one
/// (the handler's service call checks it again, from the broker's cache), or else against
/// every live instance (registration names its instance in the body, checked after parsing).
pub struct AgentAuth;

impl FromRequestParts<AppState> for AgentAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        let token = bearer(&parts.headers).map(str::to_string);
        let token = token.as_deref();
        // A path that does not decode names no instance: the token is judged on its own.
        let instance = RawPathParams::from_request_parts(parts, s)
            .await
            .ok()
            .and_then(|params| {
                params
                    .iter()
                    .find(|(name, _)| *name == "instance_id")
                    .map(|(_, value)| value.to_string())
            });
        match instance {
            Some(id) => {
                s.broker.authenticate_agent(token, &id).await?;
            }
            None => s.broker.authenticate_agent_token(token).await?,
        }
        Ok(AgentAuth)
    }
}

/// What a booting instance presents for its downloads: its agent token, or its bootstrap token
/// until that is traded.
pub struct DownloadAuth;

impl FromRequestParts<AppState> for DownloadAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        s.broker
            .authenticate_download(bearer(&parts.headers))
            .await?;
        Ok(DownloadAuth)
    }
}

/// A bootstrap token some instance was issued (used or not: the exchange itself tells a second
/// use apart and records it), checked before the exchange's body is read.
pub struct BootstrapAuth;

impl FromRequestParts<AppState> for BootstrapAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        s.broker
            .authenticate_bootstrap(bearer(&parts.headers))
            .await?;
        Ok(BootstrapAuth)
    }
}

/// The client's address, when the server recorded it (`ConnectInfo`): what the dashboard's
/// login counts failures by. Behind a reverse proxy it is the proxy's.
pub struct Peer(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Peer(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        ))
    }
}
