//! Stage spans: a thin layer over the OpenTelemetry API whose every timestamp comes from
//! [`clock`](super::clock).
//!
//! We start and end OpenTelemetry spans ourselves instead of going through
//! `tracing-opentelemetry`, because that bridge stamps spans with its own `SystemTime::now()`
//! calls; here a stage's start, end and events are explicit readings of the shared clock, and the
//! duration a stage reports to the client (`timings`) is the same number its span carries.
//! A [`Stage`] owns an OpenTelemetry [`Context`], so it can be moved to a model-worker thread and
//! its children created there keep their parent.
//!
//! Every start, attribute change, event, failure and end also goes to the stage-event stream
//! ([`stage_events`](super::stage_events)) when a client watches the trace; unwatched, that is
//! one atomic load per call.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};

use super::clock;
use super::names::{attr, StageKind, PROVIDER};
use super::stage_events::{self, SpanFacts};

/// The instrumentation scope every span of ours is created under.
pub const SCOPE: &str = "ragscope";

/// One timed stage of a request, exported as a span when it ends (explicitly or on drop).
pub struct Stage {
    name: Cow<'static, str>,
    cx: Context,
    started: Instant,
    /// Attributes copied onto every descendant (request id, baggage colours).
    inherited: Arc<[KeyValue]>,
    /// The `service.name` this stage and its children are exported under when per-stage
    /// services are on (`RAGSCOPE_STAGE_SERVICES`).
    service: Option<&'static str>,
    /// Set once the span has ended; a shared stage (`Arc<Stage>`) may be ended by one holder
    /// while others still hold it.
    ended: AtomicBool,
    /// The parent's span id (`INVALID` for none), for the stage-event stream.
    parent: SpanId,
    /// Whether this span began its trace in this process (no parent, or a remote one): its
    /// end ends the trace's stage-event stream.
    root: bool,
}

impl Stage {
    /// Starts a span under `parent` (which may hold a remote span from `traceparent`, or nothing).
    pub fn start(
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        parent: &Context,
        inherited: Vec<KeyValue>,
    ) -> Stage {
        Self::start_at(name, kind, parent, inherited.into(), clock::now(), None)
    }

    /// A stage with no parent, for work outside any request: corpus ingest at start-up,
    /// benchmarks, evaluation, tests.
    pub fn root(name: impl Into<Cow<'static, str>>) -> Stage {
        Self::start(name, SpanKind::Internal, &Context::new(), Vec::new())
    }

    /// The root of a trace of its own, started at `at`, for work done for several requests at
    /// once (a batched decode step): it belongs to none of them, so each request's span links
    /// to it instead ([`Stage::link`]). Exported under `service` when per-stage services are on.
    pub fn detached_at(
        name: impl Into<Cow<'static, str>>,
        service: Option<&'static str>,
        at: Instant,
    ) -> Stage {
        Self::start_at(
            name,
            SpanKind::Internal,
            &Context::new(),
            Arc::from(Vec::new()),
            at,
            service,
        )
    }

    fn start_at(
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        parent: &Context,
        inherited: Arc<[KeyValue]>,
        started: Instant,
        parent_service: Option<&'static str>,
    ) -> Stage {
        let name = name.into();
        let service = stage_service(&name).or(parent_service);
        let (parent_id, root) = {
            let span = parent.span();
            let sc = span.span_context();
            (sc.span_id(), !sc.is_valid() || sc.is_remote())
        };
        // Its OpenInference kind goes on every span (not inherited: each span has its own).
        let openinference = super::openinference::kind(&name);
        let builder = |tracer_name: Cow<'static, str>| {
            opentelemetry::trace::SpanBuilder::from_name(tracer_name)
                .with_kind(kind.clone())
                .with_start_time(clock::to_wall(started))
                .with_attributes(inherited.iter().cloned().chain([openinference.clone()]))
        };
        let cx = match service.and_then(super::stage_tracer) {
            Some(tracer) => {
                parent.with_span(tracer.build_with_context(builder(name.clone()), parent))
            }
            None => {
                let tracer = opentelemetry::global::tracer(SCOPE);
                parent.with_span(tracer.build_with_context(builder(name.clone()), parent))
            }
        };
        let stage = Stage {
            name,
            cx,
            started,
            inherited,
            service,
            ended: AtomicBool::new(false),
            parent: parent_id,
            root,
        };
        if stage_events::active() {
            stage_events::span_started(&stage.cx, &stage.facts(), started, &stage.inherited);
        }
        stage
    }

    fn facts(&self) -> SpanFacts<'_> {
        SpanFacts {
            span: self.cx.span().span_context().span_id(),
            parent: self.parent,
            name: &self.name,
            service: self.service,
        }
    }

    /// Starts a child stage now.
    pub fn child(&self, name: impl Into<Cow<'static, str>>) -> Stage {
        self.child_at(name, clock::now())
    }

    /// Starts a child stage at an earlier reading of the clock (e.g. the `queue` stage, which
    /// begins when a job is submitted but is only known to exist once it is picked up). Clamped
    /// to this stage's own start so the child can never begin before its parent.
    pub fn child_at(&self, name: impl Into<Cow<'static, str>>, at: Instant) -> Stage {
        Self::start_at(
            name,
            SpanKind::Internal,
            &self.cx,
            self.inherited.clone(),
            at.max(self.started),
            self.service,
        )
    }

    pub fn set(&self, kv: KeyValue) {
        if stage_events::active() {
            stage_events::span_changed(&self.cx, std::slice::from_ref(&kv), None);
        }
        self.cx.span().set_attribute(kv);
    }

    pub fn set_all(&self, kvs: impl IntoIterator<Item = KeyValue>) {
        let span = self.cx.span();
        if stage_events::active() {
            let kvs: Vec<KeyValue> = kvs.into_iter().collect();
            stage_events::span_changed(&self.cx, &kvs, None);
            for kv in kvs {
                span.set_attribute(kv);
            }
            return;
        }
        for kv in kvs {
            span.set_attribute(kv);
        }
    }

    /// Links this span to another one (an OpenTelemetry span link), e.g. a request's `decode`
    /// to the batched steps it took part in. The SDK keeps at most 128 links per span; callers
    /// bound theirs below that.
    pub fn link(&self, to: SpanContext, attributes: Vec<KeyValue>) {
        self.cx.span().add_link(to, attributes);
    }

    /// This span's context (invalid when tracing is off), the target of a link.
    pub fn span_context(&self) -> SpanContext {
        self.cx.span().span_context().clone()
    }

    /// Records a point in time inside this stage.
    pub fn event(&self, name: impl Into<Cow<'static, str>>, attributes: Vec<KeyValue>) {
        self.event_at(name, clock::now(), attributes);
    }

    pub fn event_at(
        &self,
        name: impl Into<Cow<'static, str>>,
        at: Instant,
        attributes: Vec<KeyValue>,
    ) {
        let name: Cow<'static, str> = name.into();
        if stage_events::active() {
            stage_events::span_event(&self.cx, &name, at, &attributes);
        }
        self.cx
            .span()
            .add_event_with_timestamp(name, clock::to_wall(at), attributes);
    }

    /// Marks the stage failed with the OpenTelemetry `error.type` convention.
    pub fn fail(&self, error_type: &'static str, message: impl Into<Cow<'static, str>>) {
        let span = self.cx.span();
        let error_type = KeyValue::new(attr::ERROR_TYPE, error_type);
        let message: Cow<'static, str> = message.into();
        if stage_events::active() {
            stage_events::span_changed(
                &self.cx,
                std::slice::from_ref(&error_type),
                Some(message.as_ref()),
            );
        }
        span.set_attribute(error_type);
        span.set_status(Status::error(message));
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn context(&self) -> &Context {
        &self.cx
    }

    pub fn started(&self) -> Instant {
        self.started
    }

    /// Time since this stage started, on the shared clock.
    pub fn elapsed(&self) -> Duration {
        clock::now().saturating_duration_since(self.started)
    }

    /// Hex trace id, or `None` when tracing is off (the span context is invalid).
    pub fn trace_id(&self) -> Option<String> {
        let sc = self.cx.span().span_context().clone();
        sc.is_valid().then(|| sc.trace_id().to_string())
    }

    pub fn span_id(&self) -> Option<String> {
        let sc = self.cx.span().span_context().clone();
        sc.is_valid().then(|| sc.span_id().to_string())
    }

    /// An attribute this stage inherited from its request (`rag.request.id`, baggage), as text.
    pub fn inherited(&self, key: &str) -> Option<String> {
        self.inherited
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str().into_owned())
    }

    /// Ends the stage now and returns how long it lasted.
    pub fn end(self) -> Duration {
        self.end_at(clock::now())
    }

    /// Ends the stage at a given reading of the clock (never before it started).
    pub fn end_at(self, at: Instant) -> Duration {
        self.finish(at)
    }

    /// Ends a shared stage now, whoever else still holds it (the request span ends when its
    /// response body is done, not when the last worker lets go of it). Later calls do nothing.
    pub fn finish_now(&self) -> Duration {
        self.finish(clock::now())
    }

    fn finish(&self, at: Instant) -> Duration {
        let at = at.max(self.started);
        if !self.ended.swap(true, Ordering::AcqRel) {
            // Read while the span still records; published once it is in the trace buffer.
            let watched = stage_events::active()
                .then(|| stage_events::watched(&self.cx))
                .flatten();
            self.cx.span().end_with_timestamp(clock::to_wall(at));
            if let Some(trace) = watched {
                stage_events::span_ended(trace, &self.facts(), self.started, at, self.root);
            }
        }
        at - self.started
    }
}

/// The per-stage `service.name` of a pipeline stage, from its span name; children inherit
/// their parent's. Tracing backends colour services apart, so each stage gets its own colour.
pub fn stage_service(name: &str) -> Option<&'static str> {
    StageKind::of_span_name(name)?.service()
}

/// The GenAI attributes every model stage carries: the operation and provider where the
/// conventions name one, and the model; and the model under its OpenInference name
/// (`llm.model_name`, `embedding.model_name`) where OpenInference has one.
pub fn model_attributes(kind: StageKind, model: &str) -> Vec<KeyValue> {
    let mut attributes = Vec::with_capacity(4);
    if let Some(operation) = kind.operation() {
        attributes.push(KeyValue::new(attr::GEN_AI_OPERATION_NAME, operation));
        attributes.push(KeyValue::new(attr::GEN_AI_PROVIDER_NAME, PROVIDER));
    }
    attributes.push(KeyValue::new(attr::GEN_AI_REQUEST_MODEL, model.to_string()));
    match kind {
        StageKind::Generate => {
            attributes.push(KeyValue::new(attr::LLM_MODEL_NAME, model.to_string()));
        }
        StageKind::Embed => {
            attributes.push(KeyValue::new(attr::EMBEDDING_MODEL_NAME, model.to_string()));
        }
        _ => {}
    }
    attributes
}

impl Drop for Stage {
    fn drop(&mut self) {
        self.finish(clock::now());
    }
}
