//! The OpenAPI document, generated from the handlers' annotations and the types' schemas.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "Proteus broker API", description = "ML training on spot capacity: jobs, their cost, markets, and the agents' control protocol."),
    paths(
        super::healthz,
        super::metrics,
        super::submit_job,
        super::list_jobs,
        super::get_job,
        super::cancel_job,
        super::interrupt_instance,
        super::job_cost,
        super::job_events,
        super::dashboard::job_chart,
        super::dashboard::markets_chart,
        super::list_markets,
        super::list_prices,
        super::agent_register,
        super::agent_heartbeat,
        super::agent_commands,
        super::agent_event,
        super::agent_checkpoint,
        super::agent_workdir,
        super::agent_checkpoint_put,
        super::agent_checkpoint_get,
        super::agent_output,
        super::job_logs,
        super::download_agent,
        super::download_data,
    ),
    components(schemas(super::error::ErrorBody, crate::service::spec::JobSpec)),
    modifiers(&Security, &FrameworkAnswers)
)]
pub struct ApiDoc;

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let bearer =
            || SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build());
        components.add_security_scheme("bearer", bearer());
        components.add_security_scheme("agent", bearer());
    }
}

/// Documents the answers every operation of a kind gives before its handler runs, so that each
/// handler's annotation lists only what it decides itself and none can forget these:
/// - an operation that needs a token answers 401 without a valid one;
/// - an operation with a JSON body answers 415 without `content-type: application/json`, 400
///   when the body is not JSON, and 422 when it is JSON of the wrong shape ([`super::error::ApiJson`]);
/// - an operation with query parameters answers 400 when the query string does not parse into
///   them ([`super::error::ApiQuery`]).
struct FrameworkAnswers;

impl Modify for FrameworkAnswers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::path::ParameterIn;
        use utoipa::openapi::{Content, Ref, ResponseBuilder};
        let error = |text: &str| {
            ResponseBuilder::new()
                .description(text)
                .content(
                    "application/json",
                    Content::new(Some(Ref::from_schema_name("ErrorBody"))),
                )
                .build()
        };
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for op in operations.into_iter().flatten() {
                let mut add = |status: &str, text: &str| {
                    op.responses
                        .responses
                        .entry(status.to_string())
                        .or_insert_with(|| error(text).into());
                };
                let secured = op.security.as_ref().is_some_and(|s| !s.is_empty());
                let json_body = op
                    .request_body
                    .as_ref()
                    .is_some_and(|b| b.content.contains_key("application/json"));
                let query = op.parameters.as_ref().is_some_and(|ps| {
                    ps.iter()
                        .any(|p| matches!(p.parameter_in, ParameterIn::Query))
                });
                if secured {
                    add("401", "missing or invalid credentials");
                }
                if json_body {
                    add("400", "the body is not JSON");
                    add("415", "the body is not declared `application/json`");
                    add("422", "the JSON body does not have the expected shape");
                }
                if query {
                    add("400", "the query string does not parse");
                }
            }
        }
    }
}

pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// The document as JSON text (for `proteus openapi`, and tests).
pub fn json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}
