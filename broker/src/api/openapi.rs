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
        super::agent_checkpoint_put,
        super::agent_checkpoint_get,
        super::agent_output,
        super::job_logs,
        super::download_agent,
        super::download_data,
    ),
    components(schemas(super::error::ErrorBody, crate::service::spec::JobSpec)),
    modifiers(&Security)
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

pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// The document as JSON text (for `proteus openapi`, and tests).
pub fn json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}
