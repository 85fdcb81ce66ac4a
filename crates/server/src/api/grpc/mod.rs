//! The gRPC API (`proto/ragscope.proto`): `Query` streams sources, tokens and a closing `done`,
//! `Ingest`, `Embed` and `Rerank` answer once. It serves the same [`AppState`] as HTTP: the same
//! pipeline, the same checks and answer stream ([`super::ask`]), errors mapped once in
//! [`super::error`]. Beside it: the standard health service, SERVING only once the pipeline is
//! ready, and server reflection for tools like grpcurl. [`trace`] gives each call its server span.

pub mod trace;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use serde_json::{Map, Number, Value};
use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use super::ask::{self, AnswerEvent, Asked, DocumentBody};
use super::decoding::Decoding;
use super::error::ApiError;
use super::limit::ConnectionLimit;
use super::{AppState, Readiness, RequestStage};
use rag::ingest::Format;
use rag::pipeline::context::ContextAsked;
use rag::pipeline::RagAnswer;
use telemetry::span::Stage;

pub use super::proto;

use proto::query_event::Event as QueryEventKind;
use proto::rag_server::{Rag, RagServer};
use proto::{
    Done, EmbedRequest, EmbedResponse, IngestRequest, IngestResponse, QueryEvent, QueryRequest,
    RerankRequest, RerankResponse, Sources, Timings, Token, Usage,
};

/// Serves the gRPC API, health and reflection on `listener` until `shutdown` resolves; calls in
/// flight (streams included) are drained first.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    max_message_bytes: usize,
    connections: &crate::config::ConnectionArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    report_readiness(state.readiness.clone(), reporter.clone()).await;
    report_draining(state.readiness.clone(), reporter.clone());
    let shutdown = async move {
        shutdown.await;
        stop_reporting(reporter).await;
    };
    // Both reflection versions: grpcurl speaks v1, while Python's grpcio-reflection (and older
    // grpcurl and grpcui) speak only v1alpha and would get UNIMPLEMENTED without it.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let valid = "the descriptors generated at build time are valid";
    let reflection_v1alpha = reflection().build_v1alpha().expect(valid);
    let reflection = reflection().build_v1().expect(valid);
    let readiness = state.readiness.clone();
    let interceptor = super::auth::grpc_interceptor(state.auth.clone(), readiness.clone());
    let tenants = crate::api::tenant::TenantLayer {
        tenants: state.tenants.clone(),
        keys: state.auth.clone(),
    };
    let rag = RagServer::new(RagService { state })
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes);
    let rag = tonic::service::interceptor::InterceptedService::new(rag, interceptor);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let incoming =
        ConnectionLimit::new(connections.max_connections as usize, "grpc").limit(incoming);
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(connections.http2_keepalive_interval_s)
        .http2_keepalive_timeout(connections.http2_keepalive_timeout_s);
    if let Some(age) = connections.max_connection_age_s {
        server = server.max_connection_age(age);
    }
    if let Some(grace) = connections.max_connection_age_grace_s {
        server = server.max_connection_age_grace(grace);
    }
    server
        .layer(trace::TraceLayer { readiness })
        .layer(tenants)
        .add_service(rag)
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// Sets the health statuses (the server's, `""`, and `ragscope.v1.Rag`) from the readiness
/// now, and, while still loading, follows it until it is ready (SERVING) or has failed (stays
/// NOT_SERVING, as `/ready` answers 503).
async fn report_readiness(readiness: Arc<Readiness>, reporter: HealthReporter) {
    if readiness.is_ready() {
        set_health(&reporter, ServingStatus::Serving).await;
        return;
    }
    set_health(&reporter, ServingStatus::NotServing).await;
    tokio::spawn(async move {
        loop {
            // Registered before the check, so a change in between still wakes it.
            let changed = readiness.changed.notified();
            if readiness.is_ready() {
                set_health(&reporter, ServingStatus::Serving).await;
                return;
            }
            if readiness.has_failed() {
                return;
            }
            changed.await;
        }
    });
}

/// NOT_SERVING as soon as shutdown begins, while calls in flight drain.
fn report_draining(readiness: Arc<Readiness>, reporter: HealthReporter) {
    tokio::spawn(async move {
        loop {
            let changed = readiness.changed.notified();
            if readiness.is_draining() {
                set_health(&reporter, ServingStatus::NotServing).await;
                return;
            }
            changed.await;
        }
    });
}

/// On shutdown: NOT_SERVING, then the statuses are removed, which ends every `Watch` stream;
/// a watcher would otherwise hold the graceful shutdown open forever.
async fn stop_reporting(mut reporter: HealthReporter) {
    set_health(&reporter, ServingStatus::NotServing).await;
    reporter.clear_service_status("").await;
    reporter.clear_service_status(RAG_SERVICE).await;
}

const RAG_SERVICE: &str = <RagServer<RagService> as NamedService>::NAME;

/// Sets the server's status (`""`) and the RAG service's.
async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    reporter.set_service_status(RAG_SERVICE, status).await;
}

/// The `ragscope.v1.Rag` service over the server's shared state.
pub struct RagService {
    state: AppState,
}

impl RagService {
    /// The faults a call runs under; the `x-ragscope-fault` metadata works like the HTTP header.
    fn faults<T>(
        &self,
        request: &Request<T>,
        stage: &RequestStage,
    ) -> Result<Arc<rag::fault::FaultPlan>, Status> {
        let headers = request.metadata().clone().into_headers();
        Ok(super::ask::request_faults(&self.state, &headers, stage)?)
    }
}

/// The call's server span, left in the request by [`trace::TraceLayer`].
fn request_stage<T>(request: &Request<T>) -> RequestStage {
    request
        .extensions()
        .get::<RequestStage>()
        .cloned()
        // Only without the layer (never as served): an untraced root keeps the pipeline going.
        .unwrap_or_else(|| Arc::new(Stage::root(telemetry::names::span::GRPC)))
}

type QueryStream = Pin<Box<dyn Stream<Item = Result<QueryEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Rag for RagService {
    type QueryStream = QueryStream;

    async fn query(&self, request: Request<QueryRequest>) -> Result<Response<QueryStream>, Status> {
        let stage = request_stage(&request);
        let pipeline = self.state.pipeline()?;
        // The `x-ragscope-fault` metadata works like the HTTP header.
        let headers = request.metadata().clone().into_headers();
        let r = request.into_inner();
        let asked = Asked {
            decoding: Decoding::from_query(&r),
            query: r.query,
            history: Vec::new(),
            top_k: r.top_k.map(|v| v as usize),
            rerank_top_n: r.rerank_top_n.map(|v| v as usize),
            max_tokens: r.max_tokens.map(|v| v as usize),
            filter: r.filter.map(|f| Value::Object(struct_to_json(f))),
            n: None,
            logprobs: r.logprobs.map(|k| k as usize),
            context: ContextAsked {
                mode: r.context,
                budget: r.context_budget.map(|v| v as usize),
                method: r.context_method,
                order: r.context_order,
                terms: r.context_terms,
            },
            overlap: r.overlap,
        };
        let req = ask::prepare(&self.state, &pipeline, &stage, &headers, asked)?;
        let events = ask::answer_stream(&pipeline, req, &stage)?;
        Ok(Response::new(Box::pin(events.map(query_event))))
    }

    async fn ingest(
        &self,
        request: Request<IngestRequest>,
    ) -> Result<Response<IngestResponse>, Status> {
        let stage = request_stage(&request);
        let caller = request.extensions().get::<super::auth::Caller>();
        self.state.auth.require_admin(caller)?;
        let pipeline = self.state.pipeline()?;
        let faults = self.faults(&request, &stage)?;
        let bodies = request
            .into_inner()
            .documents
            .into_iter()
            .map(|d| DocumentBody {
                format: match d.format() {
                    proto::Format::Unspecified | proto::Format::Text => Format::Text,
                    proto::Format::Markdown => Format::Markdown,
                    proto::Format::Html => Format::Html,
                },
                id: d.id,
                text: d.text,
                source: d.source,
                metadata: d.metadata.map(struct_to_json).unwrap_or_default(),
            })
            .collect();
        let outcomes = pipeline
            .ingest(ask::documents(bodies)?, faults, &stage)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(IngestResponse {
            documents: outcomes
                .into_iter()
                .map(|o| proto::ingest_response::Outcome {
                    id: o.id,
                    chunks: o.chunks as u32,
                    status: o.status.as_str().to_string(),
                })
                .collect(),
        }))
    }

    async fn embed(
        &self,
        request: Request<EmbedRequest>,
    ) -> Result<Response<EmbedResponse>, Status> {
        let stage = request_stage(&request);
        let pipeline = self.state.pipeline()?;
        let faults = self.faults(&request, &stage)?;
        let texts = request.into_inner().inputs;
        ask::check_embed_inputs("inputs", &texts)?;
        // Counted after admission: a refused request costs no tokenisation.
        let vectors = pipeline
            .embed(texts.clone(), faults, &stage)
            .await
            .map_err(ApiError::from)?;
        let tokens = ask::embed_tokens(&pipeline, &texts);
        Ok(Response::new(EmbedResponse {
            model: pipeline.embedder.model_id().to_string(),
            embeddings: vectors
                .into_iter()
                .map(|values| proto::embed_response::Embedding { values })
                .collect(),
            prompt_tokens: tokens as u32,
        }))
    }

    async fn rerank(
        &self,
        request: Request<RerankRequest>,
    ) -> Result<Response<RerankResponse>, Status> {
        let stage = request_stage(&request);
        let pipeline = self.state.pipeline()?;
        let faults = self.faults(&request, &stage)?;
        let r = request.into_inner();
        let top_n = ask::check_rerank(&r.query, &r.documents, r.top_n.map(|n| n as usize))?;
        let scores = pipeline
            .rerank(r.query, r.documents, faults, &stage)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(RerankResponse {
            model: ask::rerank_model(&pipeline),
            results: rag::rerank::ranking(&scores)
                .into_iter()
                .take(top_n)
                .map(|i| proto::rerank_response::Result {
                    index: i as u32,
                    relevance_score: scores[i],
                })
                .collect(),
        }))
    }
}

/// `sources`, then `token`s, then `done`; a pipeline error ends the stream with its status.
/// Dropping the stream (the client cancelled) stops the generation.
fn query_event(event: AnswerEvent) -> Result<QueryEvent, Status> {
    let event = match event {
        AnswerEvent::Sources(sources) => QueryEventKind::Sources(Sources {
            sources: sources.into_iter().map(source).collect(),
        }),
        AnswerEvent::Token(piece) => QueryEventKind::Token(Token {
            text: piece.text,
            logprobs: piece.logprobs.into_iter().map(token_logprob).collect(),
        }),
        AnswerEvent::Done(a) => QueryEventKind::Done(done(&a)),
        AnswerEvent::Failed(e) => return Err(Status::from(e)),
    };
    Ok(QueryEvent { event: Some(event) })
}

fn token_logprob(lp: llm::TokenLogprob) -> proto::TokenLogprob {
    proto::TokenLogprob {
        id: lp.id,
        bytes: lp.bytes,
        logprob: lp.logprob,
        top: lp
            .top
            .into_iter()
            .map(|t| proto::TopLogprob {
                id: t.id,
                bytes: t.bytes,
                logprob: t.logprob,
            })
            .collect(),
    }
}

fn source(s: rag::pipeline::Source) -> proto::Source {
    proto::Source {
        id: s.id,
        doc_id: s.doc_id,
        score: s.score,
        retrieval_score: s.retrieval_score,
        text: s.text,
        source: s.source,
        metadata: Some(json_to_struct(s.metadata)),
    }
}

fn done(a: &RagAnswer) -> Done {
    let t = &a.timings;
    Done {
        usage: Some(Usage {
            prompt_tokens: a.usage.prompt_tokens as u32,
            completion_tokens: a.usage.completion_tokens as u32,
            total_tokens: a.usage.total_tokens as u32,
            cached_tokens: a.usage.prompt_tokens_details.cached_tokens as u32,
        }),
        timings: Some(Timings {
            queue_ms: t.queue_ms,
            embed_ms: t.embed_ms,
            retrieve_ms: t.retrieve_ms,
            rerank_ms: t.rerank_ms,
            context_ms: t.context_ms,
            prompt_ms: t.prompt_ms,
            prefill_ms: t.prefill_ms,
            decode_ms: t.decode_ms,
            ttft_ms: t.ttft_ms,
            total_ms: t.total_ms,
        }),
        finish_reason: a.finish_reason.as_str().to_string(),
        query_embedding_cached: a.cache.query_embedding,
    }
}

/// A protobuf `Struct` as the JSON object the HTTP API takes. Protobuf has only double numbers:
/// integral ones become JSON integers, so `{"metadata.year": 2024}` filters as it does over HTTP.
pub fn struct_to_json(s: prost_types::Struct) -> Map<String, Value> {
    s.fields
        .into_iter()
        .map(|(k, v)| (k, value_to_json(v)))
        .collect()
}

fn value_to_json(v: prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::StringValue(s)) => Value::String(s),
        // Exactly representable integers only (|n| <= 2^53).
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() <= 9_007_199_254_740_992.0 => {
            Value::Number(Number::from(n as i64))
        }
        Some(Kind::NumberValue(n)) => Number::from_f64(n).map_or(Value::Null, Value::Number),
        Some(Kind::StructValue(s)) => Value::Object(struct_to_json(s)),
        Some(Kind::ListValue(l)) => Value::Array(l.values.into_iter().map(value_to_json).collect()),
    }
}

/// A JSON object as a protobuf `Struct` (chunk metadata in `Source`).
pub fn json_to_struct(map: Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: map
            .into_iter()
            .map(|(k, v)| (k, json_to_value(v)))
            .collect(),
    }
}

fn json_to_value(v: Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        Value::String(s) => Kind::StringValue(s),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.into_iter().map(json_to_value).collect(),
        }),
        Value::Object(map) => Kind::StructValue(json_to_struct(map)),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn structs_round_trip_with_integral_numbers_as_integers() {
        let Value::Object(original) = json!({
            "topic": "tools", "year": 2024, "ratio": 0.5, "ok": true, "none": null,
            "nested": {"list": [1, "a"]}
        }) else {
            unreachable!()
        };
        let back = struct_to_json(json_to_struct(original.clone()));
        assert_eq!(Value::Object(back.clone()), Value::Object(original));
        assert!(back["year"].is_i64(), "{:?}", back["year"]);
        assert!(back["ratio"].is_f64());
    }
}
