//! Run-time switches for experiments: the fault plan (`/admin/faults`, bearer token) and the
//! per-request `x-ragscope-fault` header; telemetry's run-time settings (`/admin/telemetry`:
//! the trace sampling ratio, decode-step spans, content capture); plus the recent-trace buffer
//! that `ragscope attribute` reads (`/debug/traces`) and the failure snapshots that `ragscope
//! replay` re-runs (`/debug/snapshots`).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::json;

use super::auth::{Caller, Scope};
use super::error::ApiError;
use super::json::ValidJson;
use super::AppState;
use llm::schedule::StepSpans;
use opentelemetry::KeyValue;
use rag::fault::FaultPlan;
use telemetry::controls;
use telemetry::names::{attr, span};
use telemetry::span::Stage;

/// `GET /admin/faults`: the server's current plan.
#[utoipa::path(get, path = "/admin/faults", tag = "debug",
    responses((status = 200, description = "The fault plan", body = serde_json::Value)))]
pub async fn get_faults(
    State(state): State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = authorize(&state, caller, &headers) {
        return e.into_response();
    }
    Json(state.faults.current().as_ref()).into_response()
}

/// `PUT /admin/faults`: replaces the plan every request runs (the body is the plan).
#[utoipa::path(put, path = "/admin/faults", tag = "debug",
    request_body(content = serde_json::Value, description = "The plan (JSON or YAML text)", content_type = "application/json"),
    responses((status = 200, description = "The plan now in force", body = serde_json::Value)))]
pub async fn put_faults(
    State(state): State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    if let Err(e) = authorize(&state, caller, &headers) {
        return e.into_response();
    }
    match FaultPlan::parse(&body) {
        Ok(plan) => {
            tracing::warn!(plan = %body.trim(), "fault plan replaced");
            state.faults.replace(plan);
            Json(state.faults.current().as_ref()).into_response()
        }
        Err(e) => ApiError::field("body", e).into_response(),
    }
}

/// `DELETE /admin/faults`: stops injecting.
#[utoipa::path(delete, path = "/admin/faults", tag = "debug",
    responses((status = 204, description = "No plan any more")))]
pub async fn clear_faults(
    State(state): State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = authorize(&state, caller, &headers) {
        return e.into_response();
    }
    state.faults.replace(FaultPlan::default());
    tracing::warn!("fault plan cleared");
    StatusCode::NO_CONTENT.into_response()
}

/// The fault admin token, or (with API keys on, which the auth layer checked already) an admin
/// API key: the one `Authorization` header cannot carry both.
fn authorize(
    state: &AppState,
    caller: Option<Extension<Caller>>,
    headers: &HeaderMap,
) -> Result<(), ApiError> {
    let Some(token) = state
        .faults
        .admin_token
        .as_deref()
        .filter(|_| state.faults.enabled)
    else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "path: /admin/faults is off (start the server with --faults true --fault-admin-token …)",
        )
        .with_code("not_found"));
    };
    if caller.is_some_and(|Extension(c)| c == Caller(Scope::Admin)) {
        return Ok(());
    }
    bearer(headers, token, "admin token")
}

/// `Authorization: Bearer <token>`, or a 401 naming what is asked for (`what`).
fn bearer(headers: &HeaderMap, token: &str, what: &str) -> Result<(), ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
        return Ok(());
    }
    let mut e = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        format!("authorization: a valid `Bearer <{what}>` is required"),
    );
    e.param = Some("authorization".into());
    Err(e)
}

/// What `/admin/telemetry` changes; each field left out stays as it is.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TelemetryChange {
    /// Share of new traces sampled, 0 to 1 (a request with a sampled `traceparent` is traced
    /// whatever it is).
    trace_sampling_ratio: Option<f64>,
    /// Batched decode steps that become spans: `all`, `off` or `sampled:N`.
    decode_step_spans: Option<String>,
    /// Questions, answers and documents' text on spans.
    capture_content: Option<bool>,
}

fn telemetry_settings() -> serde_json::Value {
    json!({
        "trace_sampling_ratio": controls::sampling_ratio(),
        "decode_step_spans": llm::schedule::step_spans().to_string(),
        "capture_content": controls::capture_content(),
    })
}

/// Admin-scope API key, or the `--telemetry-admin-token` bearer; without either configured
/// the route does not exist (404).
fn authorize_telemetry(
    caller: Option<Extension<Caller>>,
    headers: &HeaderMap,
) -> Result<(), ApiError> {
    if caller.is_some_and(|Extension(c)| c == Caller(Scope::Admin)) {
        return Ok(());
    }
    let Some(token) = controls::admin_token() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "path: /admin/telemetry is off (start the server with --telemetry-admin-token …, or use an admin API key)",
        )
        .with_code("not_found"));
    };
    bearer(headers, token, "telemetry admin token")
}

/// `GET /admin/telemetry`: the telemetry settings in force.
#[utoipa::path(get, path = "/admin/telemetry", tag = "debug",
    responses((status = 200, description = "trace_sampling_ratio, decode_step_spans, capture_content", body = serde_json::Value)))]
pub async fn get_telemetry(caller: Option<Extension<Caller>>, headers: HeaderMap) -> Response {
    match authorize_telemetry(caller, &headers) {
        Ok(()) => Json(telemetry_settings()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `PUT /admin/telemetry`: changes the trace sampling ratio, the decode-step spans and content
/// capture from the next request (or step) on, without a restart. Each change is logged and
/// recorded as a `telemetry_change` event (`rag.telemetry.{setting,from,to}`) on a
/// `telemetry_change` span; the answer is the settings
/// now in force. Nothing changes unless every field is valid. (The change's span, a root of
/// its own, is sampled like any trace: a change from 0 to 0 leaves only the log line.)
#[utoipa::path(put, path = "/admin/telemetry", tag = "debug",
    request_body = TelemetryChange,
    responses((status = 200, description = "The settings now in force", body = serde_json::Value)))]
pub async fn put_telemetry(
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    ValidJson(change): ValidJson<TelemetryChange>,
) -> Response {
    if let Err(e) = authorize_telemetry(caller, &headers) {
        return e.into_response();
    }
    if let Some(r) = change
        .trace_sampling_ratio
        .filter(|r| !(0.0..=1.0).contains(r))
    {
        return ApiError::field(
            "trace_sampling_ratio",
            format!("must be a number from 0 to 1, got {r}"),
        )
        .into_response();
    }
    let spans = match change
        .decode_step_spans
        .as_deref()
        .map(str::parse::<StepSpans>)
    {
        Some(Err(e)) => return ApiError::field("decode_step_spans", e).into_response(),
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let before = telemetry_settings();
    // The change's own span starts while sampling is on: before a change to 0, after one from 0.
    let change_span = || {
        Stage::detached_at(
            span::TELEMETRY_CHANGE,
            Some(telemetry::names::LIFECYCLE_SERVICE),
            telemetry::clock::now(),
        )
    };
    let early = (controls::sampling_ratio() > 0.0).then(change_span);
    if let Some(r) = change.trace_sampling_ratio {
        let _ = controls::set_sampling_ratio(r);
    }
    if let Some(s) = spans {
        llm::schedule::set_step_spans(s);
    }
    if let Some(on) = change.capture_content {
        controls::set_capture_content(on);
    }
    let after = telemetry_settings();
    let stage = early.unwrap_or_else(change_span);
    for key in [
        "trace_sampling_ratio",
        "decode_step_spans",
        "capture_content",
    ] {
        if before[key] != after[key] {
            tracing::warn!(setting = key, from = %before[key], to = %after[key], "telemetry setting changed");
            stage.event(
                span::TELEMETRY_CHANGE,
                vec![
                    KeyValue::new(attr::TELEMETRY_SETTING, key),
                    KeyValue::new(attr::TELEMETRY_FROM, before[key].to_string()),
                    KeyValue::new(attr::TELEMETRY_TO, after[key].to_string()),
                ],
            );
        }
    }
    Json(after).into_response()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TracesQuery {
    /// Most recent traces to return (default all that are buffered).
    limit: Option<usize>,
}

/// `GET /debug/traces?limit=N`: the most recent finished traces, as OTLP JSON
/// (`{"resourceSpans": [...]}`), the same format the collector's file exporter writes.
#[utoipa::path(get, path = "/debug/traces", tag = "debug", params(TracesQuery),
    responses((status = 200, description = "OTLP JSON", body = super::schema::OtlpTraces)))]
pub async fn recent_traces(
    query: Result<Query<TracesQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let limit = match query {
        Ok(Query(q)) => q.limit,
        Err(e) => return ApiError::field("limit", e.body_text()).into_response(),
    };
    match telemetry::buffer::recent() {
        Some(buffer) => Json(buffer.otlp_json(limit)).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "path: the recent-trace buffer is off (RAGSCOPE_TRACE_BUFFER=0 or OTEL_SDK_DISABLED)",
        )
        .with_code("not_found")
        .into_response(),
    }
}

/// `DELETE /debug/traces`: empties the buffer (between the runs of an experiment).
#[utoipa::path(delete, path = "/debug/traces", tag = "debug",
    responses((status = 200, description = "Emptied", body = super::schema::Cleared)))]
pub async fn clear_traces() -> Response {
    if let Some(buffer) = telemetry::buffer::recent() {
        buffer.clear();
    }
    (StatusCode::OK, Json(json!({"cleared": true}))).into_response()
}

/// The generator's snapshot store: 503 while models load, 404 with `--snapshots off`.
fn snapshot_store(state: &AppState) -> Result<Arc<llm::snapshot::SnapshotStore>, ApiError> {
    let pipeline = state.pipeline()?;
    pipeline.snapshots.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "path: failure snapshots are off on this server (--snapshots off)",
        )
        .with_code("not_found")
    })
}

/// `GET /debug/snapshots`: the failure snapshots on disk, oldest first (summaries).
#[utoipa::path(get, path = "/debug/snapshots", tag = "debug",
    responses((status = 200, description = "The snapshot directory and a summary of each snapshot in it", body = serde_json::Value)))]
pub async fn list_snapshots(State(state): State<AppState>) -> Response {
    match snapshot_store(&state) {
        Ok(store) => Json(json!({
            "dir": store.dir().display().to_string(),
            "snapshots": store.list(),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /debug/snapshots/{id}`: one snapshot file as written (what `ragscope replay` reads).
#[utoipa::path(get, path = "/debug/snapshots/{id}", tag = "debug",
    params(("id" = String, Path, description = "A snapshot id from GET /debug/snapshots")),
    responses((status = 200, description = "The snapshot file", body = serde_json::Value)))]
pub async fn get_snapshot(
    State(state): State<AppState>,
    super::json::ValidPath(id): super::json::ValidPath,
) -> Response {
    let store = match snapshot_store(&state) {
        Ok(store) => store,
        Err(e) => return e.into_response(),
    };
    // Ids are digits, hex and dashes: nothing that could name another file.
    if id.is_empty() || id.len() > 64 || !id.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
        return ApiError::field("id", "must be a snapshot id from GET /debug/snapshots")
            .into_response();
    }
    let read = tokio::task::spawn_blocking(move || store.get(&id).ok_or(id)).await;
    match read {
        Ok(Ok(bytes)) => ([(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Ok(Err(id)) => {
            let mut e = ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("id: no snapshot {id} (evicted, or never written)"),
            )
            .with_code("not_found");
            e.param = Some("id".into());
            e.into_response()
        }
        Err(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "reading the snapshot failed",
        )
        .into_response(),
    }
}
