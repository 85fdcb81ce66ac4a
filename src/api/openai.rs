//! The OpenAI-compatible endpoints: `/v1/chat/completions` (RAG over the last user turn, JSON
//! or SSE chunks), `/v1/embeddings` (float or base64) and `/v1/models`. Every request field is
//! either honoured, accepted and ignored because it cannot change the answer (`user`,
//! `metadata`, …), or refused with a 400 naming it: a client must never believe that `stop`,
//! `n` or `tools` was honoured when it was dropped.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::ask::{self, AnswerEvent, Asked};
use super::error::ApiError;
use super::json::ValidJson;
use super::{AppState, RequestStage};
use crate::generate::ChatMessage;
use crate::pipeline::context::ContextAsked;
use crate::pipeline::{Pipeline, RagAnswer};

/// Model ids `/v1/chat/completions` answers to besides the generator's own.
const RAG_MODEL_ALIASES: &[&str] = &["ragscope"];

#[derive(Debug, Deserialize)]
pub struct ChatBody {
    pub model: String,
    pub messages: Vec<ChatMessageBody>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    /// Extension: retrieval settings and filter.
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub filter: Option<Value>,
    pub context: Option<String>,
    pub context_budget: Option<usize>,
    pub context_method: Option<String>,
    /// Accepted and ignored: they label or route the request but cannot change the answer.
    pub user: Option<String>,
    pub metadata: Option<Map<String, Value>>,
    pub store: Option<bool>,
    pub service_tier: Option<String>,
    /// Accepted; the last chunk carries `usage` whatever `include_usage` says.
    pub stream_options: Option<StreamOptions>,
    /// Everything else, refused by [`refuse_unhonoured`] with [`CHAT_UNSUPPORTED`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// An OpenAI field this server does not implement: its name, the values that ask for nothing
/// (besides `null`, which always does) in words for the error, and the test for them.
type Unsupported = (&'static str, &'static str, fn(&Value) -> bool);

/// Chat fields that would change the answer; each is refused unless its value is neutral.
const CHAT_UNSUPPORTED: &[Unsupported] = &[
    ("stop", "null or empty", is_empty),
    ("n", "1", |v| v.as_f64() == Some(1.0)),
    ("logprobs", "false", |v| v.as_bool() == Some(false)),
    ("top_logprobs", "0", is_zero),
    ("presence_penalty", "0", is_zero),
    ("frequency_penalty", "0", is_zero),
    ("logit_bias", "empty", is_empty),
    ("tools", "empty", is_empty),
    ("tool_choice", "\"none\"", |v| *v == "none"),
    ("functions", "empty", is_empty),
    ("function_call", "\"none\"", |v| *v == "none"),
    ("parallel_tool_calls", "null", |_| false),
    ("response_format", "{\"type\": \"text\"}", |v| {
        *v == json!({"type": "text"})
    }),
    ("modalities", "[\"text\"]", |v| *v == json!(["text"])),
    ("audio", "null", |_| false),
    ("prediction", "null", |_| false),
    ("reasoning_effort", "null", |_| false),
    ("web_search_options", "null", |_| false),
];

fn is_empty(v: &Value) -> bool {
    match v {
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

/// Refuses, naming it, the first field of `extra` (what the body's struct did not take): an
/// unsupported field with a value that asks for something, or a field nobody knows.
fn refuse_unhonoured(
    extra: &Map<String, Value>,
    unsupported: &[Unsupported],
) -> Result<(), ApiError> {
    for (name, value) in extra {
        match unsupported.iter().find(|(n, _, _)| n == name) {
            Some((_, _, neutral)) if value.is_null() || neutral(value) => {}
            Some((_, neutral, _)) => {
                return Err(ApiError::field(
                    name,
                    format!("not supported by this server; leave it out or send {neutral}"),
                )
                .with_code("unsupported_parameter"))
            }
            None => {
                return Err(ApiError::field(name, "unknown field").with_code("unknown_parameter"))
            }
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageBody {
    pub role: String,
    pub content: Option<Value>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Text of a message's content: a string, or the text parts of a content array.
fn content_text(i: usize, content: &Option<Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err(ApiError::field(
                        &format!("messages[{i}].content"),
                        "only text content parts are supported",
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.join("\n")),
        Some(_) => Err(ApiError::field(
            &format!("messages[{i}].content"),
            "must be a string or an array of content parts",
        )),
    }
}

fn check_model(pipeline: &Pipeline, model: &str) -> Result<(), ApiError> {
    if model == pipeline.generator.model_id() || RAG_MODEL_ALIASES.contains(&model) {
        return Ok(());
    }
    Err(ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        code: Some("model_not_found"),
        ..ApiError::field(
            "model",
            format!(
                "the model {model:?} does not exist; use {:?}",
                pipeline.generator.model_id()
            ),
        )
    })
}

pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: axum::http::HeaderMap,
    ValidJson(body): ValidJson<ChatBody>,
) -> Result<Response, ApiError> {
    refuse_unhonoured(&body.extra, CHAT_UNSUPPORTED)?;
    let pipeline = state.pipeline()?;
    check_model(&pipeline, &body.model)?;
    if body.messages.is_empty() {
        return Err(ApiError::field(
            "messages",
            "must hold at least one message",
        ));
    }
    let mut history = Vec::with_capacity(body.messages.len());
    for (i, m) in body.messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::field(
                &format!("messages[{i}].role"),
                format!("unknown role {:?}", m.role),
            ));
        }
        history.push(ChatMessage::new(&m.role, content_text(i, &m.content)?));
    }
    let last = history.pop().expect("messages is not empty");
    if last.role != "user" {
        return Err(ApiError::field(
            &format!("messages[{}].role", body.messages.len() - 1),
            "the last message must come from the user",
        ));
    }
    // Our own system prompt frames the passages; the client's system turns are kept as context.
    let last_index = body.messages.len() - 1;
    let asked = Asked {
        query: last.content,
        history,
        top_k: body.top_k,
        rerank_top_n: body.rerank_top_n,
        max_tokens: body.max_completion_tokens.or(body.max_tokens),
        temperature: body.temperature,
        top_p: body.top_p,
        seed: body.seed,
        filter: body.filter,
        context: ContextAsked {
            mode: body.context,
            budget: body.context_budget,
            method: body.context_method,
        },
    };
    let req = ask::prepare(&state, &pipeline, &stage, &headers, asked).map_err(|e| {
        match e.param.as_deref() {
            Some("query") => ApiError {
                param: Some(format!("messages[{last_index}].content")),
                message: e
                    .message
                    .replacen("query", &format!("messages[{last_index}].content"), 1),
                ..e
            },
            _ => e,
        }
    })?;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let model = pipeline.generator.model_id().to_string();
    if !body.stream {
        let a = ask::answer(&pipeline, req, &stage).await?;
        let body = json!({
            "id": id,
            "object": "chat.completion",
            "created": unix_now(),
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": a.answer},
                "finish_reason": openai_finish(&a),
                "logprobs": null,
            }],
            "usage": a.usage,
            "sources": a.sources,
            "timings": a.timings,
        });
        return Ok(super::respond_json(&stage, a.finished_at, &body));
    }
    let events = ask::answer_stream(&pipeline, req, &stage)?;
    Ok(Sse::new(chunks(events, id, model, stage))
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn openai_finish(a: &RagAnswer) -> &'static str {
    match a.finish_reason.as_str() {
        "stop" | "cancelled" => "stop",
        _ => "length",
    }
}

/// `chat.completion.chunk` events, then `[DONE]`.
fn chunks(
    events: impl Stream<Item = AnswerEvent> + Send + 'static,
    id: String,
    model: String,
    stage: RequestStage,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let created = unix_now();
    let chunk = move |delta: Value, finish: Value| {
        json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
        })
    };
    let first = chunk(json!({"role": "assistant", "content": ""}), Value::Null);
    let body = events.filter_map(move |event| {
        let data = match event {
            AnswerEvent::Sources(_) => None,
            AnswerEvent::Token(text) => Some(chunk(json!({"content": text}), Value::Null)),
            AnswerEvent::Done(a) => {
                let mut last = chunk(json!({}), json!(openai_finish(&a)));
                last["usage"] = json!(a.usage);
                Some(last)
            }
            AnswerEvent::Failed(e) => {
                super::stream_failed(&stage, &e);
                Some(e.body())
            }
        };
        futures::future::ready(data)
    });
    futures::stream::once(futures::future::ready(first))
        .chain(body)
        .map(|data| Ok(SseEvent::default().json_data(data).unwrap_or_default()))
        .chain(futures::stream::once(futures::future::ready(Ok(
            SseEvent::default().data("[DONE]"),
        ))))
}

#[derive(Debug, Deserialize)]
pub struct EmbeddingsBody {
    pub model: String,
    pub input: Value,
    pub encoding_format: Option<String>,
    pub dimensions: Option<usize>,
    /// Accepted and ignored, as for chat.
    pub user: Option<String>,
    /// Everything else, refused by name.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

pub async fn embeddings(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: axum::http::HeaderMap,
    ValidJson(body): ValidJson<EmbeddingsBody>,
) -> Result<Json<Value>, ApiError> {
    refuse_unhonoured(&body.extra, &[])?;
    let pipeline = state.pipeline()?;
    let model = pipeline.embedder.model_id().to_string();
    if body.model != model {
        return Err(ApiError {
            status: axum::http::StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..ApiError::field(
                "model",
                format!("the model {:?} does not exist; use {model:?}", body.model),
            )
        });
    }
    let base64 = match body.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::field(
                "encoding_format",
                format!("must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    if let Some(d) = body.dimensions {
        if d != pipeline.embedder.dimension() {
            return Err(ApiError::field(
                "dimensions",
                format!(
                    "this model only produces {} dimensions",
                    pipeline.embedder.dimension()
                ),
            ));
        }
    }
    let texts: Vec<String> = match &body.input {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::field(
                        &format!("input[{i}]"),
                        "must be a string (token arrays are not supported)",
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(ApiError::field(
                "input",
                "must be a non-empty string or array of strings",
            ))
        }
    };
    ask::check_embed_inputs("input", &texts)?;
    let tokens = ask::embed_tokens(&pipeline, &texts);
    let faults = super::admin::request_faults(&state, &headers, &stage)?;
    let vectors = pipeline.embed(texts, faults, &stage).await?;
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })))
}

pub async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    let created = unix_now();
    let mut ids = vec![
        pipeline.generator.model_id().to_string(),
        pipeline.embedder.model_id().to_string(),
    ];
    ids.extend(RAG_MODEL_ALIASES.iter().map(|s| s.to_string()));
    if let Some(r) = &pipeline.reranker {
        ids.push(r.model_id().to_string());
    }
    let data: Vec<Value> = ids
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": created, "owned_by": "ragscope"}))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}
