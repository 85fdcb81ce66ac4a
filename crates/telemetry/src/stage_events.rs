//! The stage-event stream: the spans of one trace as they start, change and end, for the
//! waterfall page (`GET /`) and any other client (`GET /debug/stages?trace_id=…`, SSE).
//!
//! [`Stage`](super::span::Stage) calls the hooks here where its span starts, gets attributes or
//! events, fails and ends. With nobody subscribed a hook costs one relaxed atomic load. Each
//! subscriber has a bounded channel, keyed by the trace it watches; a hook never waits for it:
//! when the channel is full the event is dropped and counted (per subscriber, reported in its
//! `trace_end`, and in `ragscope.stage_events.dropped`). One slot is kept for `trace_end`, so
//! a slow subscriber still learns that the trace is over.
//!
//! Times are readings of the shared clock twice over: `*_ms`, milliseconds since the clock's
//! anchor (one number line per server process: subtract the request span's `start_ms`), and
//! `*_unix_nano`, the span's exported OTLP timestamps (decimal strings, as in OTLP/JSON).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Instant, SystemTime};

use opentelemetry::trace::{SpanId, Status, TraceContextExt, TraceId};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_sdk::trace::SpanData;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{Map, Value as Json};
use tokio::sync::mpsc;

use super::clock;
use super::names::{attr, StageKind};

/// Streams open at once, all traces together; beyond that, subscribing is refused.
pub const MAX_SUBSCRIBERS: usize = 64;
/// Events a subscriber may fall behind by before the stream drops them.
pub const CHANNEL_CAPACITY: usize = 1024;
/// Longest string attribute value sent; longer ones are cut and end in `…`.
const MAX_STRING_CHARS: usize = 256;

/// One change to a span of the watched trace. Serialised with a `type` field whose value is
/// also the SSE event name.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StageEvent {
    /// A span started. `stage` is the span name's [`StageKind`] prefix (`embeddings`,
    /// `decode`) when it has one; `service` the per-stage `service.name` it is coloured by
    /// (its own or its parent stage's; `null` outside any stage, e.g. the request span).
    SpanStart {
        trace_id: String,
        span_id: String,
        /// Empty for a span started with no parent.
        parent_span_id: String,
        name: String,
        stage: Option<&'static str>,
        service: Option<&'static str>,
        start_ms: f64,
        start_unix_nano: String,
        attributes: Map<String, Json>,
    },
    /// Attributes set on a running span (faults, token counts, `error.type`); `error` is the
    /// status message of a span that failed.
    SpanUpdate {
        trace_id: String,
        span_id: String,
        attributes: Map<String, Json>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A point in time inside a span: `token` on `decode`, one per generated token.
    SpanEvent {
        trace_id: String,
        span_id: String,
        name: String,
        at_ms: f64,
        at_unix_nano: String,
        attributes: Map<String, Json>,
    },
    /// A span ended; it repeats what `span_start` said, so a late subscriber can still draw it.
    SpanEnd {
        trace_id: String,
        span_id: String,
        parent_span_id: String,
        name: String,
        stage: Option<&'static str>,
        service: Option<&'static str>,
        start_ms: f64,
        end_ms: f64,
        duration_ms: f64,
        start_unix_nano: String,
        end_unix_nano: String,
    },
    /// The span that began the trace in this server (the request span) ended: nothing more
    /// will come. `dropped` counts the events this subscriber lost to a full channel.
    TraceEnd {
        trace_id: String,
        span_id: String,
        dropped: u64,
    },
}

impl StageEvent {
    /// The SSE event name, the same as the `type` field.
    pub fn kind(&self) -> &'static str {
        match self {
            StageEvent::SpanStart { .. } => "span_start",
            StageEvent::SpanUpdate { .. } => "span_update",
            StageEvent::SpanEvent { .. } => "span_event",
            StageEvent::SpanEnd { .. } => "span_end",
            StageEvent::TraceEnd { .. } => "trace_end",
        }
    }
}

struct Subscriber {
    tx: mpsc::Sender<StageEvent>,
    dropped: AtomicU64,
}

/// Open subscriptions; the hooks' one atomic check.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Events dropped for slow subscribers since start.
static DROPPED: AtomicU64 = AtomicU64::new(0);
static SUBSCRIBERS: LazyLock<Mutex<HashMap<TraceId, Vec<Arc<Subscriber>>>>> =
    LazyLock::new(Default::default);

/// Whether anyone watches any trace. Hooks check this first, so an unwatched server pays one
/// relaxed load per span change.
#[inline]
pub fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// Events dropped for slow subscribers since the process started.
pub fn dropped_total() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Subscribing was refused: [`MAX_SUBSCRIBERS`] streams are open.
#[derive(Debug, thiserror::Error)]
#[error("{} stage-event streams are open already", MAX_SUBSCRIBERS)]
pub struct TooManySubscribers;

/// One client's view of one trace. Dropping it unsubscribes.
pub struct Subscription {
    trace: TraceId,
    me: Arc<Subscriber>,
    rx: mpsc::Receiver<StageEvent>,
}

/// Watches `trace` from now on: events of its spans that start, change or end after this call.
pub fn subscribe(trace: TraceId) -> Result<Subscription, TooManySubscribers> {
    let mut subscribers = SUBSCRIBERS.lock();
    if ACTIVE.load(Ordering::Relaxed) >= MAX_SUBSCRIBERS {
        return Err(TooManySubscribers);
    }
    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    let me = Arc::new(Subscriber {
        tx,
        dropped: AtomicU64::new(0),
    });
    subscribers.entry(trace).or_default().push(me.clone());
    ACTIVE.fetch_add(1, Ordering::Relaxed);
    Ok(Subscription { trace, me, rx })
}

impl Subscription {
    /// The next event; `None` never comes while subscribed (the sender lives in the registry).
    pub async fn recv(&mut self) -> Option<StageEvent> {
        self.rx.recv().await
    }

    /// Events this subscription lost to a full channel.
    pub fn dropped(&self) -> u64 {
        self.me.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut subscribers = SUBSCRIBERS.lock();
        if let Some(list) = subscribers.get_mut(&self.trace) {
            list.retain(|s| !Arc::ptr_eq(s, &self.me));
            if list.is_empty() {
                subscribers.remove(&self.trace);
            }
        }
        ACTIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Hands an event to every subscriber of `trace`, built only if there is one. Sends happen
/// under the registry lock, so the slot kept for `trace_end` cannot be raced away.
fn publish(trace: TraceId, make: impl FnOnce() -> StageEvent) {
    let subscribers = SUBSCRIBERS.lock();
    let Some(list) = subscribers.get(&trace) else {
        return;
    };
    let event = make();
    for s in list {
        // The last slot is `trace_end`'s.
        if s.tx.capacity() <= 1 || s.tx.try_send(event.clone()).is_err() {
            s.dropped.fetch_add(1, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The trace of the span in `cx` while it records (sampled and not yet ended): only such spans
/// reach the trace buffer and exporters, so only they are streamed.
pub(crate) fn watched(cx: &Context) -> Option<TraceId> {
    let span = cx.span();
    span.is_recording().then(|| span.span_context().trace_id())
}

fn hex_or_empty(id: SpanId) -> String {
    if id == SpanId::INVALID {
        String::new()
    } else {
        id.to_string()
    }
}

/// Attributes as a JSON object: numbers and booleans as themselves, everything else as a
/// string cut at [`MAX_STRING_CHARS`].
fn attributes_json<'a>(kvs: impl IntoIterator<Item = &'a KeyValue>) -> Map<String, Json> {
    kvs.into_iter()
        .map(|kv| {
            let value = match &kv.value {
                Value::Bool(b) => Json::Bool(*b),
                Value::I64(i) => Json::from(*i),
                Value::F64(f) => serde_json::Number::from_f64(*f)
                    .map_or_else(|| Json::String(f.to_string()), Json::Number),
                other => {
                    let text = other.to_string();
                    Json::String(match text.char_indices().nth(MAX_STRING_CHARS) {
                        Some((cut, _)) => format!("{}…", &text[..cut]),
                        None => text,
                    })
                }
            };
            (kv.key.as_str().to_string(), value)
        })
        .collect()
}

fn stage_of(name: &str) -> Option<&'static str> {
    StageKind::of_span_name(name).map(StageKind::span_prefix)
}

fn times(wall: SystemTime) -> (f64, String) {
    (
        clock::anchor_millis(wall),
        clock::unix_nanos(wall).to_string(),
    )
}

/// What a span's start and end events say about it.
pub(crate) struct SpanFacts<'a> {
    pub span: SpanId,
    /// `SpanId::INVALID` for a span started with no parent.
    pub parent: SpanId,
    pub name: &'a str,
    pub service: Option<&'static str>,
}

impl SpanFacts<'_> {
    fn start_event(
        &self,
        trace: TraceId,
        start: SystemTime,
        attributes: Map<String, Json>,
    ) -> StageEvent {
        let (start_ms, start_unix_nano) = times(start);
        StageEvent::SpanStart {
            trace_id: trace.to_string(),
            span_id: self.span.to_string(),
            parent_span_id: hex_or_empty(self.parent),
            name: self.name.to_string(),
            stage: stage_of(self.name),
            service: self.service,
            start_ms,
            start_unix_nano,
            attributes,
        }
    }

    fn end_event(&self, trace: TraceId, start: SystemTime, end: SystemTime) -> StageEvent {
        let (start_ms, start_unix_nano) = times(start);
        let (end_ms, end_unix_nano) = times(end);
        StageEvent::SpanEnd {
            trace_id: trace.to_string(),
            span_id: self.span.to_string(),
            parent_span_id: hex_or_empty(self.parent),
            name: self.name.to_string(),
            stage: stage_of(self.name),
            service: self.service,
            start_ms,
            end_ms,
            duration_ms: clock::millis(end.duration_since(start).unwrap_or_default()),
            start_unix_nano,
            end_unix_nano,
        }
    }
}

/// Hook: the span `facts` describe (in `cx`) started at `at` with `attributes`.
pub(crate) fn span_started(
    cx: &Context,
    facts: &SpanFacts<'_>,
    at: Instant,
    attributes: &[KeyValue],
) {
    let Some(trace) = watched(cx) else {
        return;
    };
    publish(trace, || {
        facts.start_event(trace, clock::to_wall(at), attributes_json(attributes))
    });
}

/// Hook: attributes set on a running span, and the status message when it failed.
pub(crate) fn span_changed(cx: &Context, attributes: &[KeyValue], error: Option<&str>) {
    let Some(trace) = watched(cx) else {
        return;
    };
    let span = cx.span().span_context().span_id();
    publish(trace, || StageEvent::SpanUpdate {
        trace_id: trace.to_string(),
        span_id: span.to_string(),
        attributes: attributes_json(attributes),
        error: error.map(str::to_string),
    });
}

/// Hook: an event inside a span.
pub(crate) fn span_event(cx: &Context, name: &str, at: Instant, attributes: &[KeyValue]) {
    let Some(trace) = watched(cx) else {
        return;
    };
    let span = cx.span().span_context().span_id();
    publish(trace, || {
        let (at_ms, at_unix_nano) = times(clock::to_wall(at));
        StageEvent::SpanEvent {
            trace_id: trace.to_string(),
            span_id: span.to_string(),
            name: name.to_string(),
            at_ms,
            at_unix_nano,
            attributes: attributes_json(attributes),
        }
    });
}

/// Hook: a span of `trace` (from [`watched`], read just before it ended) ended. When it began
/// the trace in this process (`root`), every subscriber also gets `trace_end`, in the slot kept
/// for it.
pub(crate) fn span_ended(
    trace: TraceId,
    facts: &SpanFacts<'_>,
    started: Instant,
    ended: Instant,
    root: bool,
) {
    publish(trace, || {
        facts.end_event(trace, clock::to_wall(started), clock::to_wall(ended))
    });
    if !root {
        return;
    }
    let subscribers = SUBSCRIBERS.lock();
    for s in subscribers.get(&trace).into_iter().flatten() {
        let end = StageEvent::TraceEnd {
            trace_id: trace.to_string(),
            span_id: facts.span.to_string(),
            dropped: s.dropped.load(Ordering::Relaxed),
        };
        if s.tx.try_send(end).is_err() {
            s.dropped.fetch_add(1, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A finished trace's spans (from the recent-trace buffer) as the events the stream would have
/// sent: per span, in start order, `span_start` with its final attributes, its events,
/// `span_update` with the error of a failed span, and `span_end`. Services follow the span
/// names up the parent chain, as they do live, whatever the spans were exported under.
pub fn replay(spans: &[SpanData]) -> Vec<StageEvent> {
    let by_id: HashMap<SpanId, &SpanData> = spans
        .iter()
        .map(|s| (s.span_context.span_id(), s))
        .collect();
    let mut ordered: Vec<&SpanData> = spans.iter().collect();
    ordered.sort_by_key(|s| s.start_time);
    let mut events = Vec::with_capacity(spans.len() * 3);
    for s in ordered {
        let trace = s.span_context.trace_id();
        let facts = SpanFacts {
            span: s.span_context.span_id(),
            parent: s.parent_span_id,
            name: &s.name,
            service: service_of(s, &by_id),
        };
        events.push(facts.start_event(trace, s.start_time, attributes_json(&s.attributes)));
        for e in s.events.iter() {
            let (at_ms, at_unix_nano) = times(e.timestamp);
            events.push(StageEvent::SpanEvent {
                trace_id: trace.to_string(),
                span_id: s.span_context.span_id().to_string(),
                name: e.name.to_string(),
                at_ms,
                at_unix_nano,
                attributes: attributes_json(&e.attributes),
            });
        }
        if let Status::Error { description } = &s.status {
            let error_type = s
                .attributes
                .iter()
                .filter(|kv| kv.key.as_str() == attr::ERROR_TYPE);
            events.push(StageEvent::SpanUpdate {
                trace_id: trace.to_string(),
                span_id: s.span_context.span_id().to_string(),
                attributes: attributes_json(error_type),
                error: Some(description.to_string()),
            });
        }
        events.push(facts.end_event(trace, s.start_time, s.end_time));
    }
    events
}

/// The per-stage service of a stored span: its own stage's, else the nearest ancestor's.
fn service_of<'a>(
    span: &'a SpanData,
    by_id: &HashMap<SpanId, &'a SpanData>,
) -> Option<&'static str> {
    let mut current = span;
    loop {
        if let Some(service) = StageKind::of_span_name(&current.name).and_then(StageKind::service) {
            return Some(service);
        }
        current = by_id.get(&current.parent_span_id).copied()?;
    }
}

/// Registers `ragscope.stage_events.dropped` on `meter`.
pub(crate) fn register(meter: &opentelemetry::metrics::Meter) {
    let _dropped = meter
        .u64_observable_counter(super::names::metric::STAGE_EVENTS_DROPPED)
        .with_unit("{event}")
        .with_description("Stage-stream events dropped because a subscriber fell behind")
        .with_callback(|o| o.observe(dropped_total(), &[]))
        .build();
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanKind, TraceFlags, TraceState};
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use std::time::{Duration, UNIX_EPOCH};

    fn facts(span: u64) -> SpanFacts<'static> {
        SpanFacts {
            span: SpanId::from(span),
            parent: SpanId::INVALID,
            name: "retrieval docs",
            service: Some("ragscope-retrieve"),
        }
    }

    #[tokio::test]
    async fn a_full_channel_drops_and_counts_but_trace_end_gets_through() {
        let trace = TraceId::from(0xfeed_u128);
        let mut slow = subscribe(trace).unwrap();
        assert!(active());
        let before = dropped_total();
        let now = clock::now();
        let extra = 10;
        for _ in 0..CHANNEL_CAPACITY + extra {
            span_ended(trace, &facts(7), now, now, false);
        }
        span_ended(trace, &facts(1), now, now, true);
        let mut ends = 0;
        let last = loop {
            match slow.recv().await.unwrap() {
                StageEvent::SpanEnd { .. } => ends += 1,
                other => break other,
            }
        };
        assert_eq!(ends, CHANNEL_CAPACITY - 1, "one slot is kept for trace_end");
        let lost = (extra + 2) as u64;
        match last {
            StageEvent::TraceEnd {
                dropped, span_id, ..
            } => {
                assert_eq!(dropped, lost);
                assert_eq!(span_id, SpanId::from(1).to_string());
            }
            other => panic!("expected trace_end, got {other:?}"),
        }
        assert_eq!(slow.dropped(), lost);
        assert!(dropped_total() >= before + lost);
    }

    #[tokio::test]
    async fn only_the_watched_trace_is_delivered_and_dropping_unsubscribes() {
        let (watched, other) = (TraceId::from(0xa1_u128), TraceId::from(0xb2_u128));
        let mut sub = subscribe(watched).unwrap();
        let now = clock::now();
        span_ended(other, &facts(2), now, now, true);
        span_ended(
            watched,
            &facts(3),
            now,
            now + Duration::from_millis(5),
            false,
        );
        match sub.recv().await.unwrap() {
            StageEvent::SpanEnd {
                trace_id,
                duration_ms,
                service,
                stage,
                ..
            } => {
                assert_eq!(trace_id, watched.to_string());
                assert!((duration_ms - 5.0).abs() < 1e-6, "{duration_ms}");
                assert_eq!(service, Some("ragscope-retrieve"));
                assert_eq!(stage, Some("retrieval"));
            }
            other => panic!("{other:?}"),
        }
        drop(sub);
        assert!(SUBSCRIBERS.lock().get(&watched).is_none());
    }

    fn span(id: u64, parent: u64, name: &str, start_ms: u64, end_ms: u64) -> SpanData {
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(9_u128),
                SpanId::from(id),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::from(parent),
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: name.to_string().into(),
            start_time: UNIX_EPOCH + Duration::from_millis(start_ms),
            end_time: UNIX_EPOCH + Duration::from_millis(end_ms),
            attributes: vec![KeyValue::new("rag.fault.delay_ms", 5_i64)],
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: Default::default(),
        }
    }

    #[test]
    fn a_stored_trace_replays_in_start_order_with_inherited_services() {
        let mut decode = span(3, 2, "decode", 30, 90);
        decode.events.events.push(opentelemetry::trace::Event::new(
            "token",
            UNIX_EPOCH + Duration::from_millis(40),
            vec![KeyValue::new(attr::GEN_AI_TOKEN_INDEX, 0_i64)],
            0,
        ));
        let mut chat = span(2, 1, "chat m", 20, 95);
        chat.status = Status::error("boom");
        chat.attributes
            .push(KeyValue::new(attr::ERROR_TYPE, "generate"));
        let spans = [decode, chat, span(1, 0, "POST /v1/rag/query", 0, 100)];
        let events = replay(&spans);
        let kinds: Vec<&str> = events.iter().map(StageEvent::kind).collect();
        assert_eq!(
            kinds,
            [
                "span_start",
                "span_end", // the request
                "span_start",
                "span_update",
                "span_end", // chat, failed
                "span_start",
                "span_event",
                "span_end", // decode, one token
            ]
        );
        let service_of = |name: &str| {
            events.iter().find_map(|e| match e {
                StageEvent::SpanEnd {
                    name: n, service, ..
                } if n == name => Some(*service),
                _ => None,
            })
        };
        assert_eq!(service_of("POST /v1/rag/query"), Some(None));
        assert_eq!(service_of("decode"), Some(Some("ragscope-generate")));
        match &events[3] {
            StageEvent::SpanUpdate {
                error, attributes, ..
            } => {
                assert_eq!(error.as_deref(), Some("boom"));
                assert_eq!(attributes[attr::ERROR_TYPE], "generate");
            }
            other => panic!("{other:?}"),
        }
        match &events[0] {
            StageEvent::SpanStart {
                attributes,
                parent_span_id,
                ..
            } => {
                assert_eq!(attributes["rag.fault.delay_ms"], 5);
                assert_eq!(parent_span_id, "", "no parent");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn long_strings_are_cut() {
        let long = "é".repeat(MAX_STRING_CHARS + 5);
        let kvs = [KeyValue::new("k", long), KeyValue::new("n", 1.5)];
        let json = attributes_json(&kvs);
        let cut = json["k"].as_str().unwrap();
        assert_eq!(cut.chars().count(), MAX_STRING_CHARS + 1);
        assert!(cut.ends_with('…'));
        assert_eq!(json["n"], 1.5);
    }
}
