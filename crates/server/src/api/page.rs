//! The waterfall page (`GET /`, `/ui`): ask a question and watch its answer, its sources and
//! its stages arrive on one timeline; below, the recent requests from the trace buffer with
//! per-stage p50/p95, each opening its own waterfall. Plain HTML, CSS, SVG and a little
//! JavaScript from `page/`, embedded in the binary: no build step, no third-party assets.
//!
//! What feeds it, usable by any client: the stage-event stream (`GET /debug/stages?trace_id=…`,
//! SSE, from [`stage_events`]), the trace buffer as the same events
//! (`/ui/traces/{trace_id}`) and as a per-request summary (`/ui/traces`), and `/ui/config`:
//! one colour per per-stage `service.name`, so the page and the tracing backends agree, and the
//! configured links out to Jaeger, Tempo and Pyroscope.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use opentelemetry::trace::TraceId;
use serde::Serialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::AppState;
use crate::attribute::{self, SpanRecord};
use crate::config::UiArgs;
use telemetry::names::{stage_services, StageKind};
use telemetry::stage_events::{self, StageEvent};
use telemetry::{buffer, clock};

const INDEX: &str = include_str!("page/index.html");
const SCRIPT: &str = include_str!("page/app.js");
const STYLE: &str = include_str!("page/style.css");

/// One colour per per-stage service, in [`stage_services`] order (queue, embed, retrieve,
/// rerank, context, prompt, generate, respond); spans outside any stage get [`OTHER_COLOUR`].
const PALETTE: [&str; 8] = [
    "#9aa5b8", "#4e79a7", "#59a14f", "#e2b93b", "#b07aa1", "#f28e2b", "#5fb3ad", "#9c755f",
];
const OTHER_COLOUR: &str = "#6b7280";

/// Recent requests listed by default, and at most.
const DEFAULT_RECENT: usize = 50;
const MAX_RECENT: usize = 500;

/// The page's routes, none of them traced: looking must not add requests to the trace buffer.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/ui", get(index))
        .route("/ui/app.js", get(|| asset("text/javascript", SCRIPT)))
        .route("/ui/style.css", get(|| asset("text/css", STYLE)))
        .route("/ui/config", get(config))
        .route("/ui/traces", get(recent))
        .route("/ui/traces/{trace_id}", get(one_trace))
        .route("/debug/stages", get(stage_stream))
}

async fn index() -> Response {
    asset("text/html", INDEX).await
}

async fn asset(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, format!("{kind}; charset=utf-8")),
            (header::CACHE_CONTROL, "no-cache".to_string()),
        ],
        body,
    )
        .into_response()
}

/// Where the page links out to, as URL templates (see [`UiArgs`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct UiLinks {
    pub jaeger: Option<String>,
    pub tempo: Option<String>,
    pub pyroscope: Option<String>,
}

impl UiLinks {
    pub fn from_args(args: &UiArgs) -> UiLinks {
        let link = |url: &Option<String>, path: &str| {
            let url = url.as_deref()?.trim();
            if url.is_empty() {
                None
            } else if url.contains('{') {
                Some(url.to_string())
            } else {
                Some(format!("{}{path}", url.trim_end_matches('/')))
            }
        };
        UiLinks {
            jaeger: link(&args.ui_jaeger_url, "/trace/{trace_id}"),
            tempo: link(&args.ui_tempo_url, "/api/traces/{trace_id}"),
            pyroscope: link(
                &args.ui_pyroscope_url,
                "/?query=process_cpu%3Acpu%3Ananoseconds%3Acpu%3Ananoseconds%7Bservice_name%3D%22{service}%22%2Cspan_id%3D%22{span_id}%22%7D&from={from}&until={until}",
            ),
        }
    }
}

/// The colour of each per-stage service.
fn colours() -> BTreeMap<&'static str, &'static str> {
    stage_services()
        .into_iter()
        .zip(PALETTE.iter().cycle().copied())
        .collect()
}

/// `GET /ui/config`: colours, stages, links, and whether requests may bring a fault plan.
async fn config(State(state): State<AppState>) -> Json<Value> {
    let stages: Vec<Value> = StageKind::ALL
        .iter()
        .map(|k| json!({"stage": k.span_prefix(), "service": k.service()}))
        .collect();
    Json(json!({
        "service_name": telemetry::service_name(),
        "services": stage_services(),
        "colours": colours(),
        "other_colour": OTHER_COLOUR,
        "stages": stages,
        "links": state.ui.as_ref(),
        "fault_header": state.faults.enabled && state.faults.allow_header,
        "trace_buffer": buffer::recent().is_some(),
    }))
}

/// Refuses query parameters other than `allowed`, by name.
fn only(params: &HashMap<String, String>, allowed: &[&str]) -> Result<(), ApiError> {
    match params.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::field(
            k,
            format!(
                "unknown parameter; this endpoint takes {}",
                allowed.join(", ")
            ),
        )
        .with_code("unknown_parameter")),
        None => Ok(()),
    }
}

type Params = Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>;

fn params(query: Params) -> Result<HashMap<String, String>, ApiError> {
    query
        .map(|Query(p)| p)
        .map_err(|e| ApiError::field("query", e.body_text()))
}

/// A W3C trace id: 32 lowercase hex digits, not all zero.
fn trace_id(text: Option<&str>) -> Result<TraceId, ApiError> {
    let text = text.ok_or_else(|| ApiError::field("trace_id", "is required"))?;
    let valid = text.len() == 32 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    match TraceId::from_hex(text) {
        Ok(id) if valid && id != TraceId::INVALID => Ok(id),
        _ => Err(ApiError::field(
            "trace_id",
            format!("must be 32 lowercase hex digits, not all zero, got {text:?}"),
        )),
    }
}

fn buffer_off() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "path: the recent-trace buffer is off (RAGSCOPE_TRACE_BUFFER=0 or OTEL_SDK_DISABLED)",
    )
    .with_code("not_found")
}

/// `GET /debug/stages?trace_id=…`: the stage-event stream of one trace, as SSE. It opens with
/// `subscribed` (the server's clock now, so a client can grow open bars), then carries every
/// span change of the trace from that moment, and ends after `trace_end`, or with `timeout`
/// when nothing came for `--request-timeout`. Send the request with a `traceparent` naming
/// this trace after `subscribed` arrived.
async fn stage_stream(State(state): State<AppState>, query: Params) -> Result<Response, ApiError> {
    let params = params(query)?;
    only(&params, &["trace_id"])?;
    let trace = trace_id(params.get("trace_id").map(String::as_str))?;
    let mut subscription = stage_events::subscribe(trace).map_err(|e| ApiError {
        retry_after_s: Some(1),
        ..ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("trace_id: {e}"),
        )
        .with_code("too_many_subscribers")
    })?;
    let idle = state.request_timeout;
    let events = async_stream::stream! {
        let now_ms = clock::anchor_millis(clock::to_wall(clock::now()));
        yield sse("subscribed", &json!({"type": "subscribed", "trace_id": trace.to_string(), "now_ms": now_ms}));
        loop {
            match tokio::time::timeout(idle, subscription.recv()).await {
                Ok(Some(event)) => {
                    let last = matches!(event, StageEvent::TraceEnd { .. });
                    yield sse(event.kind(), &event);
                    if last {
                        break;
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    let body = json!({
                        "type": "timeout",
                        "trace_id": trace.to_string(),
                        "idle_ms": clock::millis(idle),
                        "dropped": subscription.dropped(),
                    });
                    yield sse("timeout", &body);
                    break;
                }
            }
        }
    };
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn sse(name: &'static str, data: &impl Serialize) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default()
        .event(name)
        .json_data(data)
        .unwrap_or_default())
}

/// `GET /ui/traces/{trace_id}`: a finished trace from the buffer, as the events the stream
/// would have sent (`{trace_id, events}`).
async fn one_trace(
    super::json::ValidPath(id): super::json::ValidPath,
) -> Result<Json<Value>, ApiError> {
    let trace = trace_id(Some(&id))?;
    let buffer = buffer::recent().ok_or_else(buffer_off)?;
    let spans = buffer.trace(trace);
    if spans.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("trace_id: no span of trace {id} is in the recent-trace buffer"),
        )
        .with_code("not_found"));
    }
    Ok(Json(json!({
        "trace_id": id,
        "events": stage_events::replay(&spans),
    })))
}

/// One finished request in the buffer.
#[derive(Debug, Serialize, PartialEq)]
struct RecentRequest {
    trace_id: String,
    /// The root span's name (`POST /v1/rag/query`, `ragscope.v1.Rag/Query`, `ingest`).
    name: String,
    start_unix_nano: String,
    duration_ms: f64,
    status: Option<i64>,
    /// Per stage (span name prefix), its spans' total duration.
    stages: BTreeMap<&'static str, f64>,
    /// `rag.fault.*` attributes seen on its spans, as `key=value`.
    faults: Vec<String>,
}

#[derive(Debug, Serialize, PartialEq)]
struct StageStats {
    stage: &'static str,
    count: usize,
    p50_ms: f64,
    p95_ms: f64,
}

/// The finished requests among `spans` (newest first) and per-stage p50/p95 over them. A trace
/// whose root has not ended yet (only its stages are in the buffer) is left out.
fn summarise(spans: &[SpanRecord]) -> (Vec<RecentRequest>, Vec<StageStats>, Value) {
    let mut by_trace: HashMap<&str, Vec<&SpanRecord>> = HashMap::new();
    for s in spans {
        by_trace.entry(s.trace_id.as_str()).or_default().push(s);
    }
    let mut requests = Vec::new();
    for (trace, spans) in by_trace {
        let ids: std::collections::HashSet<&str> =
            spans.iter().map(|s| s.span_id.as_str()).collect();
        let root = spans
            .iter()
            .filter(|s| !ids.contains(s.parent_id.as_str()))
            .filter(|s| s.parent_id.is_empty() || StageKind::of_span_name(&s.name).is_none())
            .min_by_key(|s| s.start_ns);
        // A batched decode step is a trace of its own, not a request.
        let Some(root) = root.filter(|r| r.step.is_none()) else {
            continue;
        };
        let mut stages: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut faults = Vec::new();
        for s in &spans {
            if let Some(kind) =
                StageKind::of_span_name(&s.name).filter(|_| s.span_id != root.span_id)
            {
                *stages.entry(kind.span_prefix()).or_default() +=
                    (s.end_ns - s.start_ns) as f64 / 1e6;
            }
            faults.extend(s.faults.iter().map(|(k, v)| format!("{k}={v}")));
        }
        faults.sort();
        faults.dedup();
        requests.push(RecentRequest {
            trace_id: trace.to_string(),
            name: root.name.clone(),
            start_unix_nano: root.start_ns.to_string(),
            duration_ms: (root.end_ns - root.start_ns) as f64 / 1e6,
            status: root.status_code,
            stages,
            faults,
        });
    }
    requests.sort_by(|a, b| {
        let start = |r: &RecentRequest| r.start_unix_nano.parse::<i128>().unwrap_or(0);
        start(b).cmp(&start(a))
    });
    // Figures of answered requests only: a failed request or a bad-input probe answered in
    // 0.1 ms would pull a percentile of answers down. Each route and status has its own row.
    let answered = |r: &&RecentRequest| r.status.is_none_or(|s| s < 400);
    let stats = StageKind::ALL
        .iter()
        .filter_map(|kind| {
            let values: Vec<f64> = requests
                .iter()
                .filter(answered)
                .filter_map(|r| r.stages.get(kind.span_prefix()).copied())
                .collect();
            (!values.is_empty()).then(|| {
                let p = attribute::Percentiles::of(&values);
                StageStats {
                    stage: kind.span_prefix(),
                    count: values.len(),
                    p50_ms: p.p50,
                    p95_ms: p.p95,
                }
            })
        })
        .collect();
    let figures = |totals: &[f64]| {
        let p = attribute::Percentiles::of(totals);
        json!({"count": totals.len(), "p50_ms": p.p50, "p95_ms": p.p95})
    };
    let totals: Vec<f64> = requests
        .iter()
        .filter(answered)
        .map(|r| r.duration_ms)
        .collect();
    let mut groups: BTreeMap<(String, Option<i64>), Vec<f64>> = BTreeMap::new();
    for r in &requests {
        groups
            .entry((r.name.clone(), r.status))
            .or_default()
            .push(r.duration_ms);
    }
    let groups: Vec<Value> = groups
        .into_iter()
        .map(|((name, status), totals)| {
            let mut g = figures(&totals);
            g["request"] = json!(name);
            g["status"] = json!(status);
            g
        })
        .collect();
    let mut end_to_end = figures(&totals);
    end_to_end["by_route_and_status"] = json!(groups);
    (requests, stats, end_to_end)
}

/// `GET /ui/traces?limit=N`: the `N` most recent finished requests (default 50, at most 500)
/// with their per-stage durations, per-stage and end-to-end p50/p95 over the answered ones
/// (status below 400), and end-to-end p50/p95 per route and status.
async fn recent(query: Params) -> Result<Json<Value>, ApiError> {
    let params = params(query)?;
    only(&params, &["limit"])?;
    let limit = match params.get("limit") {
        None => DEFAULT_RECENT,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_RECENT).contains(n))
            .ok_or_else(|| {
                ApiError::field(
                    "limit",
                    format!("must be between 1 and {MAX_RECENT}, got {v:?}"),
                )
            })?,
    };
    let buffer = buffer::recent().ok_or_else(buffer_off)?;
    let spans = attribute::source::parse_otlp(&buffer.otlp_json(Some(limit))).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("{e:#}"),
        )
    })?;
    let (requests, stages, end_to_end) = summarise(&spans);
    Ok(Json(json!({
        "requests": requests,
        "stages": stages,
        "end_to_end": end_to_end,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(trace: &str, id: &str, parent: &str, name: &str, start: i128, end: i128) -> SpanRecord {
        SpanRecord {
            trace_id: trace.into(),
            span_id: id.into(),
            parent_id: parent.into(),
            name: name.into(),
            start_ns: start,
            end_ns: end,
            faults: Vec::new(),
            status_code: None,
            step: None,
            cache: None,
        }
    }

    #[test]
    fn every_stage_service_has_its_own_colour() {
        let colours = colours();
        assert_eq!(colours.len(), stage_services().len());
        let distinct: std::collections::BTreeSet<_> = colours.values().collect();
        assert_eq!(distinct.len(), colours.len(), "{colours:?}");
        assert!(!distinct.contains(&OTHER_COLOUR));
    }

    #[test]
    fn links_take_a_base_url_or_a_template() {
        let links = UiLinks::from_args(&UiArgs {
            ui_jaeger_url: Some("http://127.0.0.1:16686/".into()),
            ui_tempo_url: Some("http://g:3000/explore?q={trace_id}".into()),
            ui_pyroscope_url: Some(" ".into()),
        });
        assert_eq!(
            links.jaeger.as_deref(),
            Some("http://127.0.0.1:16686/trace/{trace_id}")
        );
        assert_eq!(
            links.tempo.as_deref(),
            Some("http://g:3000/explore?q={trace_id}")
        );
        assert_eq!(links.pyroscope, None);
    }

    #[test]
    fn bad_input_probes_are_not_pooled_with_answers() {
        let request = |trace: &str, name: &str, status: i64, ms: i128| {
            let mut root = span(trace, "r", "", name, 0, ms * 1_000_000);
            root.status_code = Some(status);
            root
        };
        let mut spans = vec![
            request("a", "POST /v1/rag/query", 200, 400),
            request("b", "POST /v1/rag/query", 200, 600),
        ];
        for i in 0..28 {
            // Answered in well under a millisecond: refused at the door.
            let mut probe = request(&format!("p{i}"), "POST /v1/rag/query", 400, 0);
            probe.end_ns = 100_000;
            spans.push(probe);
        }
        let (requests, _, end_to_end) = summarise(&spans);
        assert_eq!(requests.len(), 30);
        assert_eq!(end_to_end["count"], 2);
        assert_eq!(end_to_end["p50_ms"], 500.0);
        let groups = end_to_end["by_route_and_status"].as_array().unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(
            (&groups[0]["status"], &groups[0]["count"]),
            (&json!(200), &json!(2))
        );
        assert_eq!(
            (&groups[1]["status"], &groups[1]["count"]),
            (&json!(400), &json!(28))
        );
        assert!(groups[1]["p50_ms"].as_f64().unwrap() < 1.0);
    }

    #[test]
    fn trace_ids_are_checked() {
        assert!(trace_id(Some("4bf92f3577b34da6a3ce929d0e0e4736")).is_ok());
        for bad in [
            "",
            "4BF92F3577B34DA6A3CE929D0E0E4736",
            "00000000000000000000000000000000",
            "4bf9",
        ] {
            let e = trace_id(Some(bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("trace_id"), "{bad}");
        }
        assert!(trace_id(None)
            .unwrap_err()
            .message
            .starts_with("trace_id: "));
    }

    #[test]
    fn requests_are_summarised_per_stage_and_unfinished_ones_left_out() {
        let ms = 1_000_000;
        let mut spans = Vec::new();
        for (t, offset, retrieval) in [("a", 0, 10), ("b", 1000, 30), ("c", 2000, 20)] {
            let trace = format!("{t}0");
            let start = offset * ms;
            spans.push(span(
                &trace,
                "r",
                "remote",
                "POST /v1/rag/query",
                start,
                start + 100 * ms,
            ));
            spans.push(span(
                &trace,
                "q",
                "r",
                "retrieval git",
                start + 5 * ms,
                start + (5 + retrieval) * ms,
            ));
            spans.push(span(
                &trace,
                "c",
                "r",
                "chat m",
                start + 40 * ms,
                start + 90 * ms,
            ));
            spans.push(span(
                &trace,
                "d",
                "c",
                "decode",
                start + 50 * ms,
                start + 90 * ms,
            ));
        }
        spans[1]
            .faults
            .push(("rag.fault.delay_ms".into(), "5".into()));
        // A request still running: its stage ended, the request span did not.
        spans.push(span("d0", "q", "r", "retrieval git", 9000 * ms, 9010 * ms));
        let (requests, stages, end_to_end) = summarise(&spans);
        let ids: Vec<&str> = requests.iter().map(|r| r.trace_id.as_str()).collect();
        assert_eq!(
            ids,
            ["c0", "b0", "a0"],
            "newest first, the unfinished one left out"
        );
        assert_eq!(requests[2].stages["retrieval"], 10.0);
        assert_eq!(requests[2].stages["decode"], 40.0);
        assert_eq!(requests[2].faults, ["rag.fault.delay_ms=5"]);
        let retrieval = stages.iter().find(|s| s.stage == "retrieval").unwrap();
        assert_eq!((retrieval.count, retrieval.p50_ms), (3, 20.0));
        assert!((retrieval.p95_ms - 29.0).abs() < 1e-9, "{retrieval:?}");
        assert_eq!(end_to_end["p50_ms"], 100.0);
        let order: Vec<&str> = stages.iter().map(|s| s.stage).collect();
        assert_eq!(order, ["retrieval", "chat", "decode"], "pipeline order");
    }
}
