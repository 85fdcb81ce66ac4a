//! The HTTP surface (and, in [`grpc`], the gRPC one over the same state). Every request gets a
//! server span (`{method} {route}`) whose trace context comes from the caller's `traceparent`;
//! handlers hand that span to the pipeline, and it ends only when the response body has been
//! written, so streamed answers are timed to the last byte.

pub mod admin;
pub mod ask;
pub mod auth;
pub mod completions;
pub mod decoding;
pub mod documents;
pub mod error;
pub mod fields;
pub mod grpc;
pub mod http;
pub mod json;
pub mod limit;
pub mod native;
pub mod openai;
pub mod openapi;
pub mod page;
pub mod proto;
pub mod schema;
pub mod tenant;
pub mod tokenize;

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use futures::Stream;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde_json::json;

use error::ApiError;
use rag::pipeline::Pipeline;
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

/// Shared by all handlers.
#[derive(Clone)]
pub struct AppState {
    /// Set once models are loaded; until then model endpoints answer 503.
    pub pipeline: Arc<OnceLock<Arc<Pipeline>>>,
    pub readiness: Arc<Readiness>,
    pub request_timeout: Duration,
    /// Fault injection settings and the current plan (off by default).
    pub faults: Arc<rag::fault::Faults>,
    /// Where the waterfall page links out to (Jaeger, Tempo, Pyroscope).
    pub ui: Arc<page::UiLinks>,
    /// API keys; none configured: every route is open.
    pub auth: Arc<auth::ApiKeys>,
    /// How long a shutdown lets the requests in flight finish.
    pub shutdown_grace: Duration,
    /// Tenants and their quotas; none configured: everyone is `default`, unlimited.
    pub tenants: Arc<rag::tenant::Tenants>,
}

/// What `/ready` and the gRPC health service report while the server starts.
#[derive(Default)]
pub struct Readiness {
    pub corpus_total: std::sync::atomic::AtomicUsize,
    pub corpus_done: std::sync::atomic::AtomicUsize,
    pub ready: std::sync::atomic::AtomicBool,
    pub failed: std::sync::Mutex<Option<String>>,
    /// Woken when `ready`, `failed` or `draining` is set, so the health service need not poll.
    pub changed: tokio::sync::Notify,
    /// Shutdown began: new requests get 503 and `/ready` says so, while those in flight finish.
    pub draining: std::sync::atomic::AtomicBool,
    /// HTTP requests and gRPC calls being served, until their last byte (what a shutdown waits for).
    pub in_flight: std::sync::atomic::AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    idle: tokio::sync::Notify,
}

impl Readiness {
    /// Models loaded and corpus ingested: the server takes requests.
    pub fn set_ready(&self) {
        self.ready.store(true, std::sync::atomic::Ordering::Relaxed);
        self.changed.notify_waiters();
    }

    /// Start-up failed for good.
    pub fn set_failed(&self, error: String) {
        *self.failed.lock().expect("readiness lock") = Some(error);
        self.changed.notify_waiters();
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn has_failed(&self) -> bool {
        self.failed.lock().expect("readiness lock").is_some()
    }

    /// Stops admitting: from now on new requests are refused with 503.
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Resolves once no request is in flight.
    pub async fn idle(&self) {
        loop {
            // Registered before the check, so a request ending in between still wakes it.
            let woken = self.idle.notified();
            if self.in_flight() == 0 {
                return;
            }
            woken.await;
        }
    }
}

impl AppState {
    pub fn pipeline(&self) -> Result<Arc<Pipeline>, ApiError> {
        self.pipeline.get().cloned().ok_or_else(ApiError::not_ready)
    }
}

pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    let (draining, keyed) = (state.clone(), state.clone());
    Router::new()
        .route("/v1/rag/query", post(native::query))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/rerank", post(native::rerank))
        .route("/v1/documents", post(documents::create))
        .route("/v1/documents/{id}", delete(documents::remove))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), trace_request))
        // Experiment controls are not traced either: they are not part of the system under test.
        .route(
            "/admin/faults",
            get(admin::get_faults)
                .put(admin::put_faults)
                .delete(admin::clear_faults),
        )
        .route(
            "/admin/telemetry",
            get(admin::get_telemetry).put(admin::put_telemetry),
        )
        .route(
            "/debug/traces",
            get(admin::recent_traces).delete(admin::clear_traces),
        )
        .route("/debug/snapshots", get(admin::list_snapshots))
        .route("/debug/snapshots/{id}", get(admin::get_snapshot))
        // Probes and scrapes are not traced: they would bury the requests people look for.
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(prometheus_metrics))
        .route("/openapi.json", get(openapi::openapi_json))
        // The waterfall page and the stage-event stream; untraced like the other debug views.
        .merge(page::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost first: refused while shutting down, then the API key, then the route, run
        // as its tenant's.
        .layer(crate::api::tenant::TenantLayer {
            tenants: state.tenants.clone(),
            keys: state.auth.clone(),
        })
        .layer(middleware::from_fn_with_state(keyed, auth::require_key))
        .layer(middleware::from_fn_with_state(
            draining,
            refuse_while_draining,
        ))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            panic_response,
        ))
        .with_state(state)
}

/// Once shutdown began, every route but the probes and the scrape answers 503.
async fn refuse_while_draining(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let open = auth::scope_for(req.method(), req.uri().path()).is_none();
    if state.readiness.is_draining() && !open {
        telemetry::metrics::metrics()
            .admission_rejected
            .add(1, &[KeyValue::new(attr::REASON, "draining")]);
        return ApiError::draining().into_response();
    }
    next.run(req).await
}

/// Liveness.
#[utoipa::path(get, path = "/health", tag = "probes",
    responses((status = 200, description = "Up", body = schema::Health)))]
async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// Readiness: models, store, corpus progress, queue and its admission outlook; 503 while
/// loading, after a failed start or once shutdown began.
#[utoipa::path(get, path = "/ready", tag = "probes",
    responses((status = 200, description = "Ready", body = schema::Readiness),
        (status = 503, description = "Loading, failed or draining", body = schema::Readiness)))]
async fn ready(State(state): State<AppState>) -> Response {
    use std::sync::atomic::Ordering::Relaxed;
    let r = &state.readiness;
    let corpus = json!({"documents_total": r.corpus_total.load(Relaxed), "documents_done": r.corpus_done.load(Relaxed)});
    if r.is_draining() {
        let body = json!({"status": "draining", "in_flight": r.in_flight()});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    if let Some(failure) = r.failed.lock().expect("readiness lock").clone() {
        let body = json!({"status": "failed", "error": failure, "corpus": corpus});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    let Some(pipeline) = state.pipeline.get().filter(|_| r.ready.load(Relaxed)) else {
        let body = json!({"status": "loading", "corpus": corpus});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    };
    let store = pipeline.store.info();
    Json(json!({
        "status": "ready",
        "models": {
            "embedder": pipeline.embedder.model_id(),
            "generator": pipeline.generator.model_id(),
            "reranker": pipeline.reranker.as_ref().map(|r| r.model_id().to_string()),
        },
        "store": store,
        "corpus": corpus,
        "queue": {
            "depth": pipeline.workers.depth(),
            "capacity": pipeline.workers.capacity(),
            "admission": pipeline.workers.outlook(),
        },
    }))
    .into_response()
}

/// Prometheus text exposition of the server's metrics.
#[utoipa::path(get, path = "/metrics", tag = "probes",
    responses((status = 200, description = "Prometheus text format 0.0.4; OpenMetrics 1.0 with exemplars (trace and span ids on the latency buckets) when the Accept header asks for application/openmetrics-text", body = String, content_type = "text/plain")))]
async fn prometheus_metrics(headers: axum::http::HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let (content_type, body) = if openmetrics {
        (
            telemetry::metrics::OPENMETRICS,
            telemetry::metrics::render_openmetrics(),
        )
    } else {
        (
            "text/plain; version=0.0.4; charset=utf-8",
            telemetry::metrics::render_prometheus(),
        )
    };
    ([(axum::http::header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("path: no route for {} {}", req.method(), req.uri().path()),
    )
    .with_code("not_found")
}

/// A known path with a method it does not serve: the JSON error shape, as for any refusal.
async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method: {} is not served on {}",
            req.method(),
            req.uri().path()
        ),
    )
    .with_param("method")
    .with_code("method_not_allowed")
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "internal error",
    )
    .into_response()
}

/// The request's server span, available to handlers as an extension.
pub type RequestStage = Arc<Stage>;

/// A stage a handler leaves in its response's extensions to be ended when the body has been
/// written (`respond`: from the worker's last step to the last byte).
#[derive(Clone)]
pub struct ResponseStage(pub Arc<Stage>);

/// Marks the request span of a streamed answer that failed after the response had started
/// (its status line already said 200).
fn stream_failed(request: &Stage, e: &ApiError) {
    request.fail("stream_error", e.message.clone());
}

/// Wraps a JSON answer with a `respond` stage that starts when the worker finished.
pub fn respond_json<T: serde::Serialize>(
    request: &Stage,
    finished_at: std::time::Instant,
    body: &T,
) -> Response {
    let respond = request.child_at(StageKind::Respond.span_prefix(), finished_at);
    let mut response = Json(body).into_response();
    response
        .extensions_mut()
        .insert(ResponseStage(Arc::new(respond)));
    response
}

async fn trace_request(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let parent = telemetry::extract_context(req.headers());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    let method = req.method().as_str().to_string();
    let request_id = uuid::Uuid::new_v4().to_string();
    let mut inherited = vec![KeyValue::new(attr::REQUEST_ID, request_id.clone())];
    inherited.extend(telemetry::baggage_attributes(&parent));
    let stage = Arc::new(Stage::start(
        format!("{method} {route}"),
        SpanKind::Server,
        &parent,
        inherited,
    ));
    stage.set_all([
        KeyValue::new(attr::HTTP_REQUEST_METHOD, method),
        KeyValue::new(attr::HTTP_ROUTE, route.clone()),
        KeyValue::new(attr::URL_PATH, req.uri().path().to_string()),
    ]);
    req.extensions_mut().insert(stage.clone());
    let in_flight = InFlight::start(state.readiness.clone());
    let mut response = next.run(req).await;
    let status = response.status();
    stage.set(KeyValue::new(
        attr::HTTP_RESPONSE_STATUS_CODE,
        status.as_u16() as i64,
    ));
    if status.is_server_error() {
        stage.fail("http_error", status.to_string());
    }
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", v);
    }
    if let Some(trace_id) = stage.trace_id() {
        if let Ok(v) = HeaderValue::from_str(&trace_id) {
            response.headers_mut().insert("x-trace-id", v);
        }
    }
    // The span ends when the body has been sent (or dropped by a client that went away).
    let respond = response.extensions_mut().remove::<ResponseStage>();
    let (parts, body) = response.into_parts();
    let guarded = Guarded {
        inner: body.into_data_stream(),
        respond,
        attributes: vec![
            KeyValue::new(attr::HTTP_ROUTE, route),
            KeyValue::new(attr::HTTP_RESPONSE_STATUS_CODE, status.as_u16() as i64),
        ],
        stage,
        _in_flight: in_flight,
    };
    Response::from_parts(parts, Body::from_stream(guarded))
}

/// Counts a request in the in-flight gauge and in its server's count (what a shutdown drains)
/// until dropped (HTTP and gRPC).
pub(crate) struct InFlight(Arc<Readiness>);

impl InFlight {
    pub(crate) fn start(readiness: Arc<Readiness>) -> InFlight {
        telemetry::metrics::metrics().requests_in_flight.add(1, &[]);
        readiness
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(readiness)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        telemetry::metrics::metrics()
            .requests_in_flight
            .add(-1, &[]);
        let before = self
            .0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if before == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A body stream that keeps the request span alive until the body is done, then records the
/// request's duration.
struct Guarded<S> {
    inner: S,
    respond: Option<ResponseStage>,
    stage: RequestStage,
    attributes: Vec<KeyValue>,
    _in_flight: InFlight,
}

impl<S> Drop for Guarded<S> {
    fn drop(&mut self) {
        // The child ends before its parent; both end now, whoever still holds them.
        if let Some(respond) = self.respond.take() {
            let span = respond.0.span_context();
            telemetry::metrics::metrics().stage(
                StageKind::Respond,
                respond.0.finish_now(),
                Some(&span),
            );
        }
        let span = self.stage.span_context();
        let took = self.stage.finish_now();
        telemetry::metrics::metrics().request_duration.record(
            took.as_secs_f64(),
            &self.attributes,
            Some(&span),
        );
    }
}

impl<S: Stream + Unpin> Stream for Guarded<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<S::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}
