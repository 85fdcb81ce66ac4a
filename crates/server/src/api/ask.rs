//! What a client asks, whatever the transport: the checks every request goes through (errors
//! name the field), and the answer of a RAG request as one stream of events — sources, tokens,
//! then done or failed — that owns the `stream` stage. The HTTP dialects (`rag`, `openai`,
//! `documents`) and gRPC are thin mappings of their wire formats onto this.

use std::future::Future;
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use futures::Stream;
use opentelemetry::KeyValue;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::decoding::Decoding;
use super::error::ApiError;
use super::{AppState, RequestStage};
use llm::{ChatMessage, MAX_TOP_LOGPROBS};
use rag::fault::{FaultPlan, HEADER};
use rag::ingest::{Document, Format};
use rag::pipeline::context::{ContextAsked, ContextSettings};
use rag::pipeline::{
    Event, EventReceiver, Pipeline, PipelineError, RagAnswer, RagRequest, Source, Streamed,
};
use rag::retrieve::Filter;
use telemetry::clock;
use telemetry::metrics::metrics;
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

const MAX_EMBED_INPUTS: usize = 256;
const MAX_DOCUMENTS: usize = 256;
const MAX_ID_CHARS: usize = 256;

pub const MAX_QUERY_CHARS: usize = 4096;
pub const MAX_TOP_K: usize = 100;
/// Most independent answers one request may ask for: each is a whole generation.
pub const MAX_CHOICES: usize = 8;

/// What the RAG and chat endpoints were asked, before validation.
pub struct Asked {
    pub query: String,
    pub history: Vec<ChatMessage>,
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub max_tokens: Option<usize>,
    pub filter: Option<Value>,
    /// Temperature, top-p, seed, stop strings, penalties and biases.
    pub decoding: Decoding,
    /// Independent answers (`n`).
    pub n: Option<usize>,
    /// Alternatives per token with each token's log-probability (`None`: no log-probabilities).
    pub logprobs: Option<usize>,
    /// `context`, `context_budget`, `context_method`, `context_order`, `context_terms`.
    pub context: ContextAsked,
    /// Prefill the prompt's head beside retrieval; unset: the server's `--overlap`.
    pub overlap: Option<bool>,
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
        filter,
        decoding,
        n,
        logprobs,
        context,
        overlap,
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
    // The server's decoding defaults (`--repetition-penalty`, `--copy-bias`, …) where the
    // request leaves a setting out.
    let decoded = decoding.resolve(pipeline.sampling)?;
    check_choices(n, logprobs)?;
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
    let context = ContextSettings::resolve(&context, defaults, rerank_top_n, window)
        .map_err(|(field, message)| ApiError::field(field, message))?;
    Ok(RagRequest {
        query,
        history,
        top_k,
        rerank_top_n,
        max_tokens,
        context,
        sampling: decoded.sampling,
        stop: decoded.stop,
        logprobs,
        choices: n.unwrap_or(1),
        filter,
        deadline: clock::now() + state.request_timeout,
        faults: Arc::default(),
        overlap: overlap.unwrap_or(defaults.overlap.on()),
        end_at_paragraph: decoded
            .end_at_paragraph
            .unwrap_or(defaults.end_at_paragraph),
    })
}

/// Checks `n` (1 to [`MAX_CHOICES`]) and the alternatives per token asked with `logprobs`.
pub fn check_choices(n: Option<usize>, logprobs: Option<usize>) -> Result<(), ApiError> {
    if let Some(n) = n.filter(|n| !(1..=MAX_CHOICES).contains(n)) {
        return Err(ApiError::field(
            "n",
            format!("must be between 1 and {MAX_CHOICES}, got {n}"),
        ));
    }
    if let Some(k) = logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
        return Err(ApiError::field(
            "logprobs",
            format!("at most {MAX_TOP_LOGPROBS} alternatives per token, got {k}"),
        ));
    }
    Ok(())
}

impl ApiError {
    fn with_message(mut self, message: String) -> ApiError {
        self.message = message;
        self
    }
}

/// The plan a request runs: its own from the header when the server allows that, else the
/// server's. Records which one on the request span when it injects anything.
pub fn request_faults(
    state: &AppState,
    headers: &HeaderMap,
    request: &Stage,
) -> Result<Arc<FaultPlan>, ApiError> {
    let faults = &state.faults;
    let (plan, source) = match headers.get(HEADER) {
        Some(value) => {
            if !(faults.enabled && faults.allow_header) {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "invalid_request_error",
                    format!("{HEADER}: per-request faults are off on this server (start it with --faults true --fault-header true)"),
                )
                .with_code("faults_disabled"));
            }
            let text = value
                .to_str()
                .map_err(|_| ApiError::field(HEADER, "must be ASCII JSON"))?;
            let plan = FaultPlan::parse(text).map_err(|e| ApiError::field(HEADER, e))?;
            (Arc::new(plan), "header")
        }
        None if faults.enabled => (faults.current(), "server"),
        None => return Ok(Arc::default()),
    };
    if !plan.is_empty() {
        request.set(KeyValue::new(attr::FAULT_PLAN, source));
    }
    Ok(plan)
}

/// Validates a RAG request, attaches the faults it runs under (the server's plan or its own
/// `x-ragscope-fault` header) and records the query text when content capture is on.
pub fn prepare(
    state: &AppState,
    pipeline: &Pipeline,
    stage: &RequestStage,
    headers: &HeaderMap,
    asked: Asked,
) -> Result<RagRequest, ApiError> {
    let mut req = rag_request(pipeline, state, asked)?;
    req.faults = request_faults(state, headers, stage)?;
    if telemetry::controls::capture_content() {
        stage.set(KeyValue::new(attr::QUERY_TEXT, req.query.clone()));
        stage.set_all(telemetry::openinference::text(
            attr::INPUT_VALUE,
            &req.query,
        ));
    }
    Ok(req)
}

/// Answers a prepared request at once.
pub async fn answer(
    pipeline: &Arc<Pipeline>,
    req: RagRequest,
    stage: &RequestStage,
) -> Result<RagAnswer, ApiError> {
    Ok(pipeline.start_query(req, stage, None)?.await?)
}

/// What a streamed answer sends, in order: sources once, tokens, then one of done or failed.
pub enum AnswerEvent {
    Sources(Vec<Source>),
    Token(Streamed),
    Done(RagAnswer),
    Failed(ApiError),
}

/// Starts a prepared request and streams its answer. The job is queued before this returns, so
/// a full queue is an error here (429 before any byte is sent); after that every outcome is an
/// event. The `stream` stage runs from here to the last event; dropping the stream (the
/// client went away) stops the generation.
pub fn answer_stream(
    pipeline: &Arc<Pipeline>,
    req: RagRequest,
    stage: &RequestStage,
) -> Result<impl Stream<Item = AnswerEvent> + Send + 'static, ApiError> {
    let (tx, rx) = pipeline.event_channel();
    let answer = pipeline.start_query(req, stage, Some(tx))?;
    Ok(stream_events(stage, rx, Some(answer)))
}

/// The events of an answer started with `rx`'s sender, as [`answer_stream`] describes, for
/// every path that streams (RAG, plain). `None`: nothing is generated (a completion with
/// `max_tokens: 0`), so no `Done` comes.
pub fn stream_events(
    stage: &RequestStage,
    mut rx: EventReceiver,
    answer: Option<impl Future<Output = Result<RagAnswer, PipelineError>> + Send + 'static>,
) -> impl Stream<Item = AnswerEvent> + Send + 'static {
    let writing = stage.child(StageKind::Stream.span_prefix());
    async_stream::stream! {
        let mut tokens = 0i64;
        while let Some(event) = rx.recv().await {
            match event {
                Event::Sources(sources) => yield AnswerEvent::Sources(sources),
                Event::Token(piece) => {
                    tokens += 1;
                    yield AnswerEvent::Token(piece);
                }
            }
        }
        writing.set(KeyValue::new(attr::STREAM_EVENTS, tokens));
        if let Some(answer) = answer {
            match answer.await {
                Ok(a) => yield AnswerEvent::Done(a),
                Err(e) => yield AnswerEvent::Failed(ApiError::from(e)),
            }
        }
        let span = writing.span_context();
        metrics().stage(StageKind::Stream, writing.end(), Some(&span));
    }
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

/// Checks texts to embed (HTTP and gRPC); errors name `param` (`input` over HTTP, `inputs`
/// over gRPC) or one of its items.
pub fn check_embed_inputs(param: &str, texts: &[String]) -> Result<(), ApiError> {
    if texts.is_empty() {
        return Err(ApiError::field(param, "must not be empty"));
    }
    if texts.len() > MAX_EMBED_INPUTS {
        return Err(ApiError::field(
            param,
            format!("at most {MAX_EMBED_INPUTS} inputs, got {}", texts.len()),
        ));
    }
    if let Some(i) = texts.iter().position(|t| t.is_empty()) {
        return Err(ApiError::field(
            &format!("{param}[{i}]"),
            "must not be empty",
        ));
    }
    Ok(())
}

/// Tokens the embedder reads for `texts` (truncated inputs count up to the model's limit,
/// plus the two special tokens).
pub fn embed_tokens(pipeline: &Pipeline, texts: &[String]) -> usize {
    texts
        .iter()
        .map(|t| {
            pipeline
                .embedder
                .count_tokens(t)
                .unwrap_or(0)
                .min(pipeline.embedder.max_tokens())
                + 2
        })
        .sum()
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentBody {
    pub id: Option<String>,
    pub text: String,
    pub source: Option<String>,
    #[serde(default)]
    #[schema(value_type = super::schema::DocumentFormat)]
    pub format: Format,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub metadata: Map<String, Value>,
}

pub fn check_id(param: &str, id: &str) -> Result<(), ApiError> {
    if id.trim().is_empty() || id.chars().count() > MAX_ID_CHARS || id.chars().any(char::is_control)
    {
        return Err(ApiError::field(
            param,
            format!("must be 1 to {MAX_ID_CHARS} printable characters"),
        ));
    }
    Ok(())
}

/// Checks documents to ingest (HTTP and gRPC) and fills in ids and sources. Errors name the
/// field, e.g. `documents[2].text`.
pub fn documents(bodies: Vec<DocumentBody>) -> Result<Vec<Document>, ApiError> {
    if bodies.is_empty() || bodies.len() > MAX_DOCUMENTS {
        return Err(ApiError::field(
            "documents",
            format!(
                "must hold 1 to {MAX_DOCUMENTS} documents, got {}",
                bodies.len()
            ),
        ));
    }
    let mut docs = Vec::with_capacity(bodies.len());
    for (i, d) in bodies.into_iter().enumerate() {
        if d.text.trim().is_empty() {
            return Err(ApiError::field(
                &format!("documents[{i}].text"),
                "must not be empty",
            ));
        }
        let id = match d.id {
            Some(id) => {
                check_id(&format!("documents[{i}].id"), &id)?;
                id
            }
            None => uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, d.text.as_bytes()).to_string(),
        };
        for (key, value) in &d.metadata {
            if value.is_object() || value.is_array() || value.is_null() {
                return Err(ApiError::field(
                    &format!("documents[{i}].metadata.{key}"),
                    "metadata values must be strings, numbers or booleans",
                ));
            }
        }
        docs.push(Document {
            source: d.source.unwrap_or_else(|| format!("api:{id}")),
            id,
            text: d.text,
            format: d.format,
            metadata: d.metadata,
        });
    }
    Ok(docs)
}
