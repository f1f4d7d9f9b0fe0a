//! The OpenAPI document, generated from the handlers' annotations and the types' schemas.

use axum::Json;
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "Proteus broker API", description = "ML training on spot capacity: jobs, their cost, markets, and the agents' control protocol."),
    paths(
        super::healthz,
        super::metrics,
        super::submit_job,
        super::dry_run_job,
        super::list_jobs,
        super::get_job,
        super::cancel_job,
        super::interrupt_instance,
        super::sim_clock,
        super::hold_sim_clock,
        super::job_cost,
        super::job_events,
        super::dashboard::job_chart,
        super::dashboard::markets_chart,
        super::list_markets,
        super::list_prices,
        super::agent_bootstrap,
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
    modifiers(&Security, &FrameworkAnswers, &Policies)
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
        // The one-time token in an instance's user data (`pb_…`).
        components.add_security_scheme("bootstrap", bearer());
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

/// `DELETE /v1/jobs/{id}` cancels (the job stays readable), which is not what a `DELETE`
/// promises: it is kept for older clients, marked deprecated in favour of
/// `POST /v1/jobs/{id}/cancel`.
/// A job's `policy` is one of the files in the broker's policies directory: the document lists
/// them, so that it says which names the broker takes (the bare schema says: a file stem).
struct Policies;

impl Modify for Policies {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::Schema;
        let mut names: Vec<String> = std::fs::read_dir(crate::policy::policies_dir())
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| {
                        let name = e.file_name().to_str()?.strip_suffix(".toml")?.to_string();
                        crate::service::spec::valid_policy_name(&name).then_some(name)
                    })
                    .collect()
            })
            .unwrap_or_default();
        if names.is_empty() {
            return;
        }
        names.sort();
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        if let Some(RefOr::T(Schema::Object(spec))) = components.schemas.get_mut("JobSpec")
            && let Some(RefOr::T(Schema::Object(policy))) = spec.properties.get_mut("policy")
        {
            policy.enum_values = Some(names.into_iter().map(Into::into).collect());
        }
    }
}

pub async fn document() -> Json<Value> {
    Json(value())
}

/// The document as JSON text (for `proteus openapi`, and tests).
pub fn json() -> String {
    serde_json::to_string_pretty(&value()).unwrap_or_default()
}

/// The document: the derived one with the rules between a job spec's fields added.
fn value() -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or(Value::Null);
    spec_rules(&mut doc);
    doc
}

/// Rules between a job spec's fields, which the derived schemas cannot say: each is a check
/// `JobSpec::validate` makes (refusing, with the field named, what breaks it), written here so
/// that every request the document allows is one the broker takes. (JSON Schema has no
/// implication: "if `app` is X then …" is written "`app` is not X, or …".)
/// `MODEL` or `MODEL:COUNT` as `ResourcesSpec::accelerators` reads it: a GPU model of the
/// catalog's in any letter case, a count from 1 to 16 without sign or leading zero.
fn accelerators_pattern() -> String {
    let any_case = |name: &str| -> String {
        name.chars()
            .map(|c| {
                if c.is_ascii_alphabetic() {
                    format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase())
                } else {
                    c.to_string()
                }
            })
            .collect()
    };
    let models: Vec<String> = crate::prices::catalog::accelerator_names()
        .iter()
        .map(|n| any_case(n))
        .collect();
    format!("^({})(:([1-9]|1[0-6]))?$", models.join("|"))
}

fn spec_rules(doc: &mut Value) {
    // Not empty, no `/` or backslash, no leading `.`, no control character.
    const RATINGS_FILE: &str = r"^[^./\\\x00-\x1f\x7f-\x9f][^/\\\x00-\x1f\x7f-\x9f]*$";
    const NAME: &str = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$";
    // An argument vector: a program that is not blank, then any arguments; no NUL anywhere.
    const PROGRAM: &str = r"^[^\x00]*[^\s\x00][^\x00]*$";
    const NO_NUL: &str = r"^[^\x00]*$";
    let schemas = &mut doc["components"]["schemas"];
    if !schemas.is_object() {
        return;
    }
    let absent = json!({"type": "null"});
    let app_in = |apps: &[&str]| json!({"properties": {"app": {"enum": apps}}});
    // Fields of `training` that only some apps take (absent or null for the others).
    let training_without = |fields: &[&str]| {
        let fields_absent: serde_json::Map<String, Value> = fields
            .iter()
            .map(|f| (f.to_string(), absent.clone()))
            .collect();
        json!({"properties": {"training": {"anyOf": [absent, {"properties": fields_absent}]}}})
    };
    let either = |a: Value, b: Value| json!({"anyOf": [a, b]});
    schemas["JobSpec"]["allOf"] = json!([
        // A command job has a `command` table and none of the built-in apps' fields.
        either(
            app_in(&["mlr", "mf", "mlp"]),
            json!({
                "required": ["command"],
                "properties": {
                    "command": {"$ref": "#/components/schemas/CommandSpec"},
                    "dataset": absent, "stop": absent, "training": absent
                }
            })
        ),
        // `command` is a command job's only.
        either(
            app_in(&["command"]),
            json!({"properties": {"command": absent}})
        ),
        // The multilayer perceptron's fields.
        either(
            app_in(&["mlp"]),
            training_without(&[
                "parallelism",
                "layers",
                "batch",
                "momentum",
                "link_mbit_per_sec",
                "link_latency_ms",
                "pipeline"
            ])
        ),
        // Matrix factorisation's rank.
        either(app_in(&["mf"]), training_without(&["rank"])),
        // Pacing: for the parameter-server apps.
        either(
            app_in(&["mlr", "mf"]),
            training_without(&["pace_samples_per_sec"])
        ),
        // The image data sets of `mlr` and `mlp`.
        either(
            app_in(&["mf", "command"]),
            json!({"properties": {"dataset": {"enum": [null, "mnist", "digits"]}}})
        ),
        // `mf`'s ratings file: a bare name in the agents' data directory.
        either(
            app_in(&["mlr", "mlp", "command"]),
            json!({"properties": {"dataset": {"anyOf": [
                absent,
                {"type": "string", "pattern": RATINGS_FILE}
            ]}}})
        ),
    ]);
    // A pipeline's options are for a pipeline; slack for the stale synchronous models,
    // helpers for FlexRR.
    schemas["TrainingSpec"]["allOf"] = json!([
        either(
            json!({"properties": {"pipeline": absent}}),
            json!({"properties": {"parallelism": {"enum": [null, "pipeline"]}}})
        ),
        either(
            json!({"properties": {"slack": absent}}),
            json!({"required": ["sync"], "properties": {"sync": {"enum": ["ssp", "flexrr"]}}})
        ),
        either(
            json!({"properties": {"helpers": absent}}),
            json!({"required": ["sync"], "properties": {"sync": {"enum": ["flexrr"]}}})
        ),
    ]);
    merge(
        &mut schemas["TrainingSpec"]["properties"]["sync"],
        json!({"enum": [null, "bsp", "ssp", "flexrr"]}),
    );
    // Exactly one way to stop.
    schemas["StopSpec"]["allOf"] = json!([either(
        json!({"required": ["epochs"], "properties": {"epochs": {"type": "integer"}, "clocks": absent}}),
        json!({"required": ["clocks"], "properties": {"clocks": {"type": "integer"}, "epochs": absent}})
    )]);
    // A deadline as a time or in hours, not both.
    schemas["Limits"]["allOf"] = json!([either(
        json!({"properties": {"deadline": absent}}),
        json!({"properties": {"deadline_hours": absent}})
    )]);
    merge(
        &mut schemas["JobSpec"]["properties"]["billing"],
        json!({"enum": [null, "hourly-2015", "per-second"]}),
    );
    // A command job's program and set-up: argument vectors; its environment: variable names,
    // none of the contract's or a credential's.
    for argv in ["run", "setup"] {
        merge(
            &mut schemas["CommandSpec"]["properties"][argv],
            json!({
                "prefixItems": [{"type": "string", "pattern": PROGRAM}],
                "items": {"type": "string", "pattern": NO_NUL}
            }),
        );
    }
    merge(
        &mut schemas["CommandSpec"]["properties"]["env"],
        json!({
            "propertyNames": {"allOf": [
                {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                {"not": {"pattern": "^PROTEUS_"}},
                {"not": {"enum": crate::service::spec::SECRET_VARS}}
            ]},
            "additionalProperties": {"type": "string", "pattern": NO_NUL}
        }),
    );
    // A working directory: an absolute path, or one gzipped tar object in S3 under a plain key
    // (no empty, `.` or `..` segment, no control character).
    const SEGMENT: &str = r"(?:[^/.\x00-\x1f\x7f-\x9f][^/\x00-\x1f\x7f-\x9f]*|\.[^/.\x00-\x1f\x7f-\x9f][^/\x00-\x1f\x7f-\x9f]*|\.\.[^/\x00-\x1f\x7f-\x9f]+)";
    let workdir = format!(
        r"^(?:/[^\x00]*|s3://[a-z0-9.-]{{3,63}}/(?:{SEGMENT}/)*[^/\x00-\x1f\x7f-\x9f]*\.(?:tar\.gz|tgz))$"
    );
    merge(
        &mut schemas["CommandSpec"]["properties"]["workdir"],
        json!({"pattern": workdir}),
    );
    // An instance type as `InstanceType::parse` reads it: `family.size`, no whitespace or
    // control character inside, whitespace around it trimmed.
    const WS: &str = r"\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000";
    const NOT_WS_OR_CONTROL: &str =
        r" \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\x00-\x1f\x7f-\x9f";
    let instance_type = json!({"type": "string", "pattern": format!(
        "^[{WS}]*[^.{NOT_WS_OR_CONTROL}]+\\.[^{NOT_WS_OR_CONTROL}]+[{WS}]*$"
    )});
    merge(
        &mut schemas["WorkSpec"]["properties"]["instance_types"],
        json!({"items": instance_type}),
    );
    merge(
        &mut schemas["WorkSpec"]["properties"]["reference_type"],
        json!({"pattern": instance_type["pattern"]}),
    );
    // A name: 1–200 characters, not all blank, no control character.
    merge(
        &mut schemas["JobSpec"]["properties"]["name"],
        json!({"maxLength": 200, "pattern": NAME}),
    );
    // GPUs: a model of the catalog's, in any case, and a count from 1 to 16.
    merge(
        &mut schemas["ResourcesSpec"]["properties"]["accelerators"],
        json!({"pattern": accelerators_pattern()}),
    );
    // Vertical sync is 1F1B's.
    schemas["PipelineOptions"]["allOf"] = json!([either(
        json!({"properties": {"vertical_sync": {"enum": [null, false]}}}),
        json!({"properties": {"schedule": {"enum": [null, "1f1b"]}}})
    )]);
}

/// Adds `extra`'s keys to the object schema `schema`.
fn merge(schema: &mut Value, extra: Value) {
    if let (Some(to), Value::Object(from)) = (schema.as_object_mut(), extra) {
        to.extend(from);
    }
}
