//! The server's own recent-trace buffer: the last `--trace-buffer` finished spans
//! (`RAGSCOPE_TRACE_BUFFER`, default 4096, 0 turns it off), served as OTLP JSON at
//! `GET /debug/traces` so `ragscope attribute --server URL` works without a collector.
//! Recording a span here is one short lock and a push; the oldest spans fall off the end.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use crate::clock::unix_nanos;
use crate::names::{attr, span};
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceId};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};
use opentelemetry_sdk::Resource;
use serde_json::{json, Value as Json};

/// Spans kept when [`configure`] was never called (unit and router tests).
pub const DEFAULT_CAPACITY: usize = 4096;

/// Finished spans, oldest first, each with the `service.name` it was exported under.
pub struct TraceBuffer {
    capacity: usize,
    spans: Mutex<VecDeque<(Arc<str>, SpanData)>>,
}

static RECENT: OnceLock<Option<Arc<TraceBuffer>>> = OnceLock::new();

fn buffer_of(capacity: usize) -> Option<Arc<TraceBuffer>> {
    (capacity > 0).then(|| Arc::new(TraceBuffer::new(capacity)))
}

/// Sizes the process's buffer (0 turns it off). Only the first size holds: `false` when the
/// buffer already exists, because something asked for it before telemetry started.
pub fn configure(capacity: usize) -> bool {
    RECENT.set(buffer_of(capacity)).is_ok()
}

/// The process's buffer, unless it is turned off.
pub fn recent() -> Option<Arc<TraceBuffer>> {
    RECENT.get_or_init(|| buffer_of(DEFAULT_CAPACITY)).clone()
}

/// A span processor feeding the buffer, for one tracer provider.
pub fn processor() -> Option<BufferProcessor> {
    recent().map(|buffer| BufferProcessor {
        buffer,
        service: Arc::from(super::SERVICE_NAME),
    })
}

impl TraceBuffer {
    pub fn new(capacity: usize) -> TraceBuffer {
        TraceBuffer {
            capacity,
            spans: Mutex::new(VecDeque::with_capacity(capacity.min(65_536))),
        }
    }

    pub fn push(&self, service: Arc<str>, span: SpanData) {
        let mut spans = self.spans.lock().expect("trace buffer lock");
        if spans.len() == self.capacity {
            spans.pop_front();
        }
        spans.push_back((service, span));
    }

    /// The spans of one trace, oldest finished first.
    pub fn trace(&self, id: opentelemetry::trace::TraceId) -> Vec<SpanData> {
        let spans = self.spans.lock().expect("trace buffer lock");
        spans
            .iter()
            .filter(|(_, s)| s.span_context.trace_id() == id)
            .map(|(_, s)| s.clone())
            .collect()
    }

    pub fn clear(&self) {
        self.spans.lock().expect("trace buffer lock").clear();
    }

    /// The spans of the `limit` most recently finished request traces (all spans when `None`),
    /// as OTLP JSON. A batched decode step is a trace of its own (`decode_step`, serving several
    /// requests): steps never count towards the limit, and those that ran while a chosen trace
    /// did come with it, so the latest request arrives with the steps it was batched in.
    pub fn otlp_json(&self, limit: Option<usize>) -> Json {
        let spans = self.spans.lock().expect("trace buffer lock").clone();
        let Some(n) = limit else {
            return otlp_json(spans.iter().map(|(service, s)| (service.as_ref(), s)));
        };
        // Each request trace's first start and last end.
        let mut extent: HashMap<TraceId, (SystemTime, SystemTime)> = HashMap::new();
        for (_, s) in spans.iter().filter(|(_, s)| !is_step(s)) {
            let e = extent
                .entry(s.span_context.trace_id())
                .or_insert((s.start_time, s.end_time));
            e.0 = e.0.min(s.start_time);
            e.1 = e.1.max(s.end_time);
        }
        let mut traces: Vec<_> = extent.into_iter().collect();
        traces.sort_by_key(|&(_, (_, end))| std::cmp::Reverse(end));
        traces.truncate(n);
        let during = |s: &SpanData| {
            traces
                .iter()
                .any(|(_, (start, end))| s.start_time <= *end && s.end_time >= *start)
        };
        let keep: HashSet<TraceId> = traces.iter().map(|(id, _)| *id).collect();
        let chosen = spans.iter().filter(|(_, s)| {
            if is_step(s) {
                during(s)
            } else {
                keep.contains(&s.span_context.trace_id())
            }
        });
        otlp_json(chosen.map(|(service, s)| (service.as_ref(), s)))
    }
}

/// Whether a span is a batched decode step, the root of a trace of its own.
fn is_step(s: &SpanData) -> bool {
    s.parent_span_id == SpanId::INVALID && s.name == span::DECODE_STEP
}

/// Spans as an OTLP/JSON `ExportTraceServiceRequest`, one resource per service name.
pub fn otlp_json<'a>(spans: impl IntoIterator<Item = (&'a str, &'a SpanData)>) -> Json {
    let mut by_service: Vec<(&str, Vec<Json>)> = Vec::new();
    for (service, span) in spans {
        let encoded = span_json(span);
        match by_service.iter_mut().find(|(s, _)| *s == service) {
            Some((_, list)) => list.push(encoded),
            None => by_service.push((service, vec![encoded])),
        }
    }
    let resource_spans: Vec<Json> = by_service
        .into_iter()
        .map(|(service, spans)| {
            json!({
                "resource": {"attributes": [attribute(&KeyValue::new(attr::SERVICE_NAME, service.to_string()))]},
                "scopeSpans": [{"scope": {"name": super::span::SCOPE}, "spans": spans}],
            })
        })
        .collect();
    json!({ "resourceSpans": resource_spans })
}

fn span_json(s: &SpanData) -> Json {
    let parent = if s.parent_span_id == SpanId::INVALID {
        String::new()
    } else {
        s.parent_span_id.to_string()
    };
    let (code, message) = match &s.status {
        Status::Unset => (0, String::new()),
        Status::Ok => (1, String::new()),
        Status::Error { description } => (2, description.to_string()),
    };
    json!({
        "traceId": s.span_context.trace_id().to_string(),
        "spanId": s.span_context.span_id().to_string(),
        "parentSpanId": parent,
        "name": s.name,
        "kind": kind_number(&s.span_kind),
        "startTimeUnixNano": unix_nanos(s.start_time).to_string(),
        "endTimeUnixNano": unix_nanos(s.end_time).to_string(),
        "attributes": s.attributes.iter().map(attribute).collect::<Vec<_>>(),
        "events": s.events.iter().map(|e| json!({
            "name": e.name,
            "timeUnixNano": unix_nanos(e.timestamp).to_string(),
            "attributes": e.attributes.iter().map(attribute).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "links": s.links.iter().map(|l| json!({
            "traceId": l.span_context.trace_id().to_string(),
            "spanId": l.span_context.span_id().to_string(),
            "attributes": l.attributes.iter().map(attribute).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "droppedLinksCount": s.links.dropped_count,
        "status": {"code": code, "message": message},
    })
}

fn kind_number(kind: &SpanKind) -> u8 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// One attribute in OTLP/JSON form (64-bit integers as strings, as the mapping says).
fn attribute(kv: &KeyValue) -> Json {
    let value = match &kv.value {
        Value::Bool(b) => json!({"boolValue": b}),
        Value::I64(i) => json!({"intValue": i.to_string()}),
        Value::F64(f) => json!({"doubleValue": f}),
        Value::Array(opentelemetry::Array::String(items)) => json!({"arrayValue": {"values":
            items.iter().map(|s| json!({"stringValue": s.as_str()})).collect::<Vec<_>>()}}),
        Value::Array(opentelemetry::Array::I64(items)) => json!({"arrayValue": {"values":
            items.iter().map(|i| json!({"intValue": i.to_string()})).collect::<Vec<_>>()}}),
        other => json!({"stringValue": other.to_string()}),
    };
    json!({"key": kv.key.as_str(), "value": value})
}

/// Feeds finished spans into the buffer.
#[derive(Debug)]
pub struct BufferProcessor {
    buffer: Arc<TraceBuffer>,
    service: Arc<str>,
}

impl std::fmt::Debug for TraceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceBuffer")
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl SpanProcessor for BufferProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.buffer.push(self.service.clone(), span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Some(name) = resource.get(&opentelemetry::Key::from_static_str("service.name")) {
            self.service = Arc::from(name.to_string());
        }
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use std::time::UNIX_EPOCH;

    fn span(trace: u128, id: u64, parent: u64, end_s: u64) -> SpanData {
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(trace),
                SpanId::from(id),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::from(parent),
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: format!("span {id}").into(),
            start_time: UNIX_EPOCH + Duration::from_secs(end_s - 1),
            end_time: UNIX_EPOCH + Duration::from_secs(end_s),
            attributes: vec![KeyValue::new("n", 7i64)],
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: Default::default(),
        }
    }

    #[test]
    fn a_limited_answer_brings_the_steps_that_ran_during_its_traces_and_their_links() {
        let buffer = TraceBuffer::new(16);
        let step = |trace: u128, id: u64, end_s: u64| {
            let mut s = span(trace, id, 0, end_s);
            s.name = span::DECODE_STEP.into();
            s.attributes = vec![KeyValue::new(
                attr::DECODE_MEMBERS_TOKENS,
                Value::Array(vec![1i64, 3].into()),
            )];
            buffer.push(Arc::from("svc"), s);
        };
        step(10, 100, 5); // before every request
        let mut decode = span(1, 2, 1, 9);
        decode.links.links.push(opentelemetry::trace::Link::new(
            SpanContext::new(
                TraceId::from(11u128),
                SpanId::from(101u64),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            vec![KeyValue::new(attr::DECODE_BATCH_SIZE, 2i64)],
            0,
        ));
        buffer.push(Arc::from("svc"), span(1, 1, 0, 10));
        buffer.push(Arc::from("svc"), decode);
        step(11, 101, 9); // during trace 1
        step(12, 102, 30); // after it, and newer than any request
        let latest = buffer.otlp_json(Some(1));
        let spans = latest["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        let ids: Vec<&str> = spans
            .iter()
            .map(|s| s["spanId"].as_str().unwrap())
            .collect();
        assert_eq!(
            ids,
            ["0000000000000001", "0000000000000002", "0000000000000065"],
            "the request (not the newest step trace) and the step that ran during it"
        );
        let link = &spans[1]["links"][0];
        assert_eq!(link["spanId"], "0000000000000065");
        assert_eq!(link["attributes"][0]["value"]["intValue"], "2");
        assert_eq!(
            spans[2]["attributes"][0]["value"]["arrayValue"]["values"][1]["intValue"],
            "3"
        );
        let all = buffer.otlp_json(None);
        assert_eq!(
            all["resourceSpans"][0]["scopeSpans"][0]["spans"]
                .as_array()
                .unwrap()
                .len(),
            5
        );
    }

    #[test]
    fn keeps_the_newest_spans_and_the_latest_traces() {
        let buffer = TraceBuffer::new(3);
        for (trace, id, end) in [(1, 1, 10), (1, 2, 11), (2, 3, 20), (3, 4, 30)] {
            buffer.push(Arc::from("svc"), span(trace, id, 0, end));
        }
        let all = buffer.otlp_json(None);
        let spans = all["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        assert_eq!(spans.len(), 3, "the oldest span fell off");
        let latest = buffer.otlp_json(Some(1));
        let spans = latest["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0]["spanId"], "0000000000000004");
        assert_eq!(spans[0]["parentSpanId"], "");
        assert_eq!(spans[0]["endTimeUnixNano"], "30000000000");
        assert_eq!(spans[0]["attributes"][0]["value"]["intValue"], "7");
    }
}
