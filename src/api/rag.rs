//! `POST /v1/rag/query` (JSON or SSE) and `POST /v1/rerank`, and the request validation the
//! gRPC `Query` and `Rerank` share with them.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::Stream;
use opentelemetry::KeyValue;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::json::ValidJson;
use super::{AppState, RequestStage};
use crate::generate::{ChatMessage, Sampling};
use crate::pipeline::{Event, Pipeline, RagAnswer, RagRequest};
use crate::retrieve::Filter;
use crate::telemetry::clock;
use crate::telemetry::span::Stage;

pub const MAX_QUERY_CHARS: usize = 4096;
pub const MAX_TOP_K: usize = 100;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryBody {
    pub query: String,
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub filter: Option<Value>,
    #[serde(default)]
    pub stream: bool,
}

/// What the RAG and chat endpoints were asked, before validation.
pub struct Asked {
    pub query: String,
    pub history: Vec<ChatMessage>,
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub filter: Option<Value>,
}

/// Validates a request into what the pipeline runs. Errors name the field.
pub fn rag_request(
    pipeline: &Pipeline,
    state: &AppState,
    asked: Asked,
) -> Result<RagRequest, ApiError> {
    let Asked {
        query,
        history,
        top_k,
        rerank_top_n,
        max_tokens,
        temperature,
        top_p,
        seed,
        filter,
    } = asked;
    let defaults = &pipeline.defaults;
    if query.trim().is_empty() {
        return Err(ApiError::field("query", "must not be empty"));
    }
    let chars = query.chars().count();
    if chars > MAX_QUERY_CHARS {
        return Err(ApiError::field(
            "query",
            format!("too long: {chars} characters, at most {MAX_QUERY_CHARS}"),
        ));
    }
    let top_k = top_k.unwrap_or(defaults.top_k);
    if !(1..=MAX_TOP_K).contains(&top_k) {
        return Err(ApiError::field(
            "top_k",
            format!("must be between 1 and {MAX_TOP_K}, got {top_k}"),
        ));
    }
    let rerank_top_n = rerank_top_n.unwrap_or(defaults.rerank_top_n.min(top_k));
    if !(1..=top_k).contains(&rerank_top_n) {
        return Err(ApiError::field(
            "rerank_top_n",
            format!("must be between 1 and top_k ({top_k}), got {rerank_top_n}"),
        ));
    }
    let window = pipeline.generator.context_window();
    // Leave room for at least the template, the system prompt and a short question.
    let max_allowed = window.saturating_sub(128);
    let max_tokens = max_tokens.unwrap_or(defaults.max_tokens);
    if !(1..=max_allowed).contains(&max_tokens) {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::field(
                "max_tokens",
                format!("must be between 1 and {max_allowed} (context window {window}), got {max_tokens}"),
            )
        });
    }
    let temperature = temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::field(
            "temperature",
            format!("must be between 0 and 2, got {temperature}"),
        ));
    }
    if let Some(p) = top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::field(
                "top_p",
                format!("must be in (0, 1], got {p}"),
            ));
        }
    }
    let filter = match filter.as_ref() {
        None | Some(Value::Null) => None,
        Some(v) => Some(Filter::from_json(v).map_err(|m| {
            let param = m.split(':').next().unwrap_or("filter").to_string();
            ApiError {
                param: Some(param),
                ..ApiError::field("filter", "")
            }
            .with_message(m)
        })?),
    };
    Ok(RagRequest {
        query,
        history,
        top_k,
        rerank_top_n,
        max_tokens,
        sampling: Sampling {
            temperature,
            top_p,
            seed: seed.unwrap_or(0),
        },
        filter,
        deadline: clock::now() + state.request_timeout,
        faults: Arc::default(),
    })
}

impl ApiError {
    fn with_message(mut self, message: String) -> ApiError {
        self.message = message;
        self
    }
}

pub async fn query(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: HeaderMap,
    ValidJson(body): ValidJson<QueryBody>,
) -> Result<Response, ApiError> {
    let pipeline = state.pipeline()?;
    let mut req = rag_request(
        &pipeline,
        &state,
        Asked {
            query: body.query,
            history: Vec::new(),
            top_k: body.top_k,
            rerank_top_n: body.rerank_top_n,
            max_tokens: body.max_tokens,
            temperature: body.temperature,
            top_p: body.top_p,
            seed: body.seed,
            filter: body.filter,
        },
    )?;
    req.faults = super::admin::request_faults(&state, &headers, &stage)?;
    if pipeline.defaults.capture_content {
        stage.set(KeyValue::new("rag.query.text", req.query.clone()));
    }
    if !body.stream {
        let answer = pipeline.start_query(req, &stage, None)?.await?;
        return Ok(super::respond_json(&stage, answer.finished_at, &answer));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let answer = pipeline.start_query(req, &stage, Some(tx))?;
    let writing = stage.child("stream");
    Ok(Sse::new(rag_events(rx, answer, stage, writing))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// SSE events: `sources`, then `token`s, then `done` (usage, timings) or `error`.
fn rag_events(
    mut rx: mpsc::UnboundedReceiver<Event>,
    answer: impl std::future::Future<Output = Result<RagAnswer, crate::pipeline::PipelineError>>
        + Send
        + 'static,
    stage: RequestStage,
    writing: Stage,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    async_stream::stream! {
        let mut tokens = 0i64;
        while let Some(event) = rx.recv().await {
            match event {
                Event::Sources(sources) => {
                    yield Ok(SseEvent::default().event("sources").json_data(&sources).unwrap_or_default());
                }
                Event::Token(text) => {
                    tokens += 1;
                    yield Ok(SseEvent::default().event("token").json_data(json!({"text": text})).unwrap_or_default());
                }
            }
        }
        writing.set(KeyValue::new("rag.stream.events", tokens));
        match answer.await {
            Ok(a) => {
                let done = json!({"usage": a.usage, "timings": a.timings, "finish_reason": a.finish_reason});
                yield Ok(SseEvent::default().event("done").json_data(done).unwrap_or_default());
            }
            Err(e) => {
                let e = ApiError::from(e);
                stage.fail("stream_error", e.message.clone());
                yield Ok(SseEvent::default().event("error").json_data(e.body()).unwrap_or_default());
            }
        }
        crate::telemetry::metrics::metrics().stage("stream", writing.end());
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RerankBody {
    pub query: String,
    pub documents: Vec<String>,
    pub top_n: Option<usize>,
    pub model: Option<String>,
    #[serde(default)]
    pub return_documents: bool,
}

pub const MAX_RERANK_DOCUMENTS: usize = 256;

/// Checks a rerank request (HTTP and gRPC); returns how many results to give back.
pub fn check_rerank(
    query: &str,
    documents: &[String],
    top_n: Option<usize>,
) -> Result<usize, ApiError> {
    if query.trim().is_empty() {
        return Err(ApiError::field("query", "must not be empty"));
    }
    if documents.is_empty() || documents.len() > MAX_RERANK_DOCUMENTS {
        return Err(ApiError::field(
            "documents",
            format!(
                "must hold 1 to {MAX_RERANK_DOCUMENTS} strings, got {}",
                documents.len()
            ),
        ));
    }
    if let Some(i) = documents.iter().position(|d| d.trim().is_empty()) {
        return Err(ApiError::field(
            &format!("documents[{i}]"),
            "must not be empty",
        ));
    }
    let top_n = top_n.unwrap_or(documents.len());
    if top_n == 0 {
        return Err(ApiError::field("top_n", "must be at least 1"));
    }
    Ok(top_n)
}

/// The reranker's model id, or `none` when the pipeline keeps retrieval order.
pub fn rerank_model(pipeline: &Pipeline) -> String {
    pipeline
        .reranker
        .as_ref()
        .map_or("none".to_string(), |r| r.model_id().to_string())
}

pub async fn rerank(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    ValidJson(body): ValidJson<RerankBody>,
) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    let model = rerank_model(&pipeline);
    if let Some(m) = &body.model {
        if *m != model {
            return Err(ApiError::field(
                "model",
                format!("unknown model {m:?}; this server reranks with {model:?}"),
            )
            .with_code("model_not_found"));
        }
    }
    let top_n = check_rerank(&body.query, &body.documents, body.top_n)?;
    let pipeline = Arc::clone(&pipeline);
    let scores = pipeline
        .rerank(body.query, body.documents.clone(), &stage)
        .await?;
    let results: Vec<Value> = crate::rerank::ranking(&scores)
        .into_iter()
        .take(top_n)
        .map(|i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if body.return_documents {
                r["document"] = json!({"text": body.documents[i]});
            }
            r
        })
        .collect();
    Ok(Json(json!({"model": model, "results": results})))
}
