//! A server span per gRPC call, as `trace_request` does for HTTP: named
//! `{rpc.service}/{rpc.method}`, its parent taken from the W3C `traceparent`/`tracestate`/
//! `baggage` metadata, handed to the handler in the request's extensions so the pipeline's
//! stages nest under it, and ended when the response body is done (a streamed `Query` is timed
//! to its last message), with `rpc.grpc.status_code` from the trailers. Health checks and
//! reflection are not traced, like HTTP probes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use tower::{Layer, Service};

use crate::api::{InFlight, Readiness, RequestStage};
use telemetry::names::attr;
use telemetry::span::Stage;

/// Services whose calls get no span: probes and tooling.
const UNTRACED: [&str; 2] = ["grpc.health.", "grpc.reflection."];

/// Status codes that mark a server span failed (the OpenTelemetry RPC conventions: the server's
/// fault, not the caller's).
const SERVER_FAULTS: [tonic::Code; 6] = [
    tonic::Code::Unknown,
    tonic::Code::DeadlineExceeded,
    tonic::Code::Unimplemented,
    tonic::Code::Internal,
    tonic::Code::Unavailable,
    tonic::Code::DataLoss,
];

/// Wraps the gRPC router so every call is traced, and counted in the server's in-flight
/// requests (what a shutdown waits for).
#[derive(Clone, Default)]
pub struct TraceLayer {
    pub readiness: Arc<Readiness>,
}

impl<S> Layer<S> for TraceLayer {
    type Service = Traced<S>;

    fn layer(&self, inner: S) -> Traced<S> {
        Traced {
            inner,
            readiness: self.readiness.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Traced<S> {
    inner: S,
    readiness: Arc<Readiness>,
}

impl<S, B, ResBody> Service<Request<B>> for Traced<S>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body + Unpin + Send + 'static,
{
    type Response = Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let call = Call::start(&mut req, &self.readiness);
        let response = self.inner.call(req);
        Box::pin(async move {
            let mut response = response.await?;
            let call = call.map(|mut c| {
                c.respond(response.headers_mut());
                c
            });
            Ok(response.map(|inner| TracedBody {
                inner: Some(inner),
                call,
            }))
        })
    }
}

/// One traced call, from its request to the end of its response body.
struct Call {
    stage: RequestStage,
    request_id: String,
    attributes: Vec<KeyValue>,
    /// From the response headers (a call that failed at once) or trailers.
    status: Option<tonic::Status>,
    _in_flight: InFlight,
}

impl Call {
    /// Starts the span of a call to `/{service}/{method}` and leaves it in the request.
    fn start<B>(req: &mut Request<B>, readiness: &Arc<Readiness>) -> Option<Call> {
        let (service, method) = req.uri().path().strip_prefix('/')?.split_once('/')?;
        if UNTRACED.iter().any(|s| service.starts_with(s)) {
            return None;
        }
        let (service, method) = (service.to_string(), method.to_string());
        let parent = telemetry::extract_context(req.headers());
        let request_id = uuid::Uuid::new_v4().to_string();
        let mut inherited = vec![KeyValue::new(attr::REQUEST_ID, request_id.clone())];
        inherited.extend(telemetry::baggage_attributes(&parent));
        let stage = Arc::new(Stage::start(
            format!("{service}/{method}"),
            SpanKind::Server,
            &parent,
            inherited,
        ));
        let attributes = vec![
            KeyValue::new(attr::RPC_SYSTEM, "grpc"),
            KeyValue::new(attr::RPC_SERVICE, service),
            KeyValue::new(attr::RPC_METHOD, method),
        ];
        stage.set_all(attributes.iter().cloned());
        req.extensions_mut().insert(stage.clone());
        Some(Call {
            stage,
            request_id,
            attributes,
            status: None,
            _in_flight: InFlight::start(readiness.clone()),
        })
    }

    /// Reads a status already in the headers and adds the request and trace ids to them.
    fn respond(&mut self, headers: &mut HeaderMap) {
        self.status = tonic::Status::from_header_map(headers);
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            headers.insert("x-request-id", v);
        }
        if let Some(v) = self
            .stage
            .trace_id()
            .and_then(|t| HeaderValue::from_str(&t).ok())
        {
            headers.insert("x-trace-id", v);
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // No status at all: the client cancelled, or the connection broke, before the end.
        let (code, message) = match &self.status {
            Some(s) => (s.code(), s.message().to_string()),
            None => (tonic::Code::Cancelled, "the call ended early".to_string()),
        };
        let code_attribute = KeyValue::new(attr::RPC_GRPC_STATUS_CODE, code as i64);
        self.stage.set(code_attribute.clone());
        if SERVER_FAULTS.contains(&code) {
            self.stage.fail(code_name(code), message);
        }
        let span = self.stage.span_context();
        let took = self.stage.finish_now();
        self.attributes.push(code_attribute);
        telemetry::metrics::metrics().request_duration.record(
            took.as_secs_f64(),
            &self.attributes,
            Some(&span),
        );
    }
}

/// A response body that ends its call's span when it is done or dropped.
pub struct TracedBody<B> {
    inner: Option<B>,
    call: Option<Call>,
}

impl<B> TracedBody<B> {
    fn end(&mut self) {
        // The body (and any stage it holds) goes first, so children end before the call.
        drop(self.inner.take());
        drop(self.call.take());
    }
}

impl<B> Drop for TracedBody<B> {
    fn drop(&mut self) {
        self.end();
    }
}

impl<B: Body + Unpin> Body for TracedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(trailers), Some(call)) = (frame.trailers_ref(), this.call.as_mut()) {
                    if let Some(status) = tonic::Status::from_header_map(trailers) {
                        call.status = Some(status);
                    }
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(call) = this.call.as_mut() {
                    call.status
                        .get_or_insert_with(|| tonic::Status::unknown("response body failed"));
                }
            }
            Poll::Ready(None) => this.end(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// The status code's name, as `error.type`.
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
