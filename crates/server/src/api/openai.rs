//! The OpenAI-compatible endpoints: `/v1/chat/completions` (RAG over the last user turn, JSON
//! or SSE chunks, `n` choices, stop strings, penalties, log-probabilities), `/v1/embeddings`
//! (float or base64) and `/v1/models`. Every request field is either honoured, accepted and
//! ignored because it cannot change the answer (`user`, `metadata`, …), or refused with a 400
//! naming it: a client must never believe that `tools` or `logit_bias` was honoured when it
//! was dropped.

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::ask::{self, AnswerEvent, Asked};
use super::decoding::Decoding;
use super::error::ApiError;
use super::fields::{is_empty, refuse_unhonoured, refuse_unhonoured_in, unix_now, Unsupported};
use super::json::ValidJson;
use super::{AppState, RequestStage};
use llm::{ChatMessage, FinishReason, TokenLogprob, MAX_TOP_LOGPROBS};
use rag::pipeline::context::ContextAsked;
use rag::pipeline::Pipeline;

/// Model ids `/v1/chat/completions` answers to besides the generator's own.
pub(super) const RAG_MODEL_ALIASES: &[&str] = &["ragscope"];

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ChatBody {
    pub model: String,
    pub messages: Vec<ChatMessageBody>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    /// Independent choices, 1 to [`ask::MAX_CHOICES`]; choice `i` samples with `seed + i`.
    pub n: Option<usize>,
    pub logprobs: Option<bool>,
    /// 0 to 20 alternatives per token; needs `logprobs: true`.
    pub top_logprobs: Option<usize>,
    /// Extension: retrieval settings and filter.
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    #[schema(value_type = Option<Object>)]
    pub filter: Option<Value>,
    pub context: Option<String>,
    pub context_budget: Option<usize>,
    pub context_method: Option<String>,
    pub context_order: Option<String>,
    pub context_terms: Option<bool>,
    /// Extension: prefill the prompt's head while retrieving (unset: the server's `--overlap`).
    pub overlap: Option<bool>,
    /// Accepted and ignored: they label or route the request but cannot change the answer.
    pub user: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    pub store: Option<bool>,
    pub service_tier: Option<String>,
    /// `include_usage: true` adds a last chunk with `usage` and no choices, as OpenAI does.
    pub stream_options: Option<StreamOptions>,
    /// OpenAI's temperature, top-p, seed, stop, presence and frequency penalties, and the
    /// extensions: the repetition penalty, the n-gram block, the copy bias and the paragraph
    /// end (for the plain model only what the request asks; no RAG defaults).
    #[serde(flatten)]
    pub decoding: Decoding,
    /// Everything else, refused by [`refuse_unhonoured`] with [`CHAT_UNSUPPORTED`].
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Chat fields that would change the answer; each is refused unless its value is neutral.
const CHAT_UNSUPPORTED: &[Unsupported] = &[
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

/// One of `messages`. `role` and `content` make the turn; `name` is accepted and ignored (a
/// participant's label, which the chat template has no place for).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ChatMessageBody {
    pub role: String,
    #[schema(value_type = Option<super::schema::MessageContent>)]
    pub content: Option<Value>,
    pub name: Option<String>,
    /// Everything else, refused by name (`messages[2].tool_calls`) with [`MESSAGE_UNSUPPORTED`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Message fields that would change the answer (a tool exchange, audio, a refusal that the
/// model would not see); each is refused unless its value is neutral.
const MESSAGE_UNSUPPORTED: &[Unsupported] = &[
    ("tool_calls", "empty", is_empty),
    ("tool_call_id", "null", |_| false),
    ("function_call", "null", |_| false),
    ("audio", "null", |_| false),
    ("refusal", "null", |_| false),
];

/// The conversation of a request's `messages`, roles and fields checked; errors name
/// `messages[i]` and the field. `developer` (OpenAI's newer name for the system turn) is
/// rendered as `system`, the role the model was trained with; tool and function turns are
/// refused: this server calls no tools.
pub(super) fn chat_messages(bodies: &[ChatMessageBody]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::with_capacity(bodies.len());
    for (i, m) in bodies.iter().enumerate() {
        let path = format!("messages[{i}]");
        refuse_unhonoured_in(&path, &m.extra, MESSAGE_UNSUPPORTED)?;
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" | "function" => {
                return Err(ApiError::field(
                    &format!("{path}.role"),
                    format!(
                        "{:?} turns are not supported: this server calls no tools",
                        m.role
                    ),
                )
                .with_code("unsupported_parameter"))
            }
            other => {
                return Err(ApiError::field(
                    &format!("{path}.role"),
                    format!("unknown role {other:?}; use system, developer, user or assistant"),
                ))
            }
        };
        if m.content.as_ref().is_none_or(Value::is_null) && role != "assistant" {
            return Err(ApiError::field(&format!("{path}.content"), "must be given"));
        }
        messages.push(ChatMessage::new(role, content_text(&path, &m.content)?));
    }
    Ok(messages)
}

/// Text of a message's content: a string, or the text parts of a content array joined by
/// newlines. Other parts (images, audio, files) are refused by index.
fn content_text(path: &str, content: &Option<Value>) -> Result<String, ApiError> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(ApiError::field(
                &format!("{path}.content"),
                "must be a string or an array of content parts",
            ))
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{path}.content[{j}]");
        let Some(fields) = part.as_object() else {
            return Err(ApiError::field(&at, "must be a content part object"));
        };
        match fields.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some(kind @ ("image_url" | "input_audio" | "file" | "refusal")) => {
                return Err(ApiError::field(
                    &format!("{at}.type"),
                    format!("{kind:?} parts are not supported: this model reads text only"),
                )
                .with_code("unsupported_parameter"))
            }
            _ => return Err(ApiError::field(&format!("{at}.type"), "must be \"text\"")),
        }
        if let Some(key) = fields
            .keys()
            .find(|k| !matches!(k.as_str(), "type" | "text"))
        {
            return Err(ApiError::field(&format!("{at}.{key}"), "unknown field")
                .with_code("unknown_parameter"));
        }
        match fields.get("text").and_then(Value::as_str) {
            Some(t) => texts.push(t),
            None => return Err(ApiError::field(&format!("{at}.text"), "must be a string")),
        }
    }
    Ok(texts.join("\n"))
}

pub(super) fn check_model(pipeline: &Pipeline, model: &str) -> Result<(), ApiError> {
    if model == pipeline.generator.model_id()
        || RAG_MODEL_ALIASES.contains(&model)
        || model == super::completions::plain_model(pipeline)
    {
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

/// OpenAI chat completions, RAG over the last user turn (or the generator alone with the
/// `…-plain` model); JSON, or with `stream: true` server-sent chunks ending in `data: [DONE]`.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatBody,
    responses((status = 200, description = "The completion, or its chunks", content(
        (super::schema::ChatCompletion = "application/json"),
        (super::schema::ChatStreamEvent = "text/event-stream")))))]
pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: axum::http::HeaderMap,
    ValidJson(body): ValidJson<ChatBody>,
) -> Result<Response, ApiError> {
    refuse_unhonoured(&body.extra, CHAT_UNSUPPORTED)?;
    let pipeline = state.pipeline()?;
    check_model(&pipeline, &body.model)?;
    // The plain model: the generator alone on the conversation as given (chat template, no
    // retrieval), with every generation setting below honoured the same way.
    let plain = body.model == super::completions::plain_model(&pipeline);
    if plain {
        refuse_retrieval_settings(&body)?;
    }
    if body.messages.is_empty() {
        return Err(ApiError::field(
            "messages",
            "must hold at least one message",
        ));
    }
    let mut history = chat_messages(&body.messages)?;
    let plain_prompt = if plain {
        let prompt = pipeline
            .generator
            .tokenizer()
            .chat_prompt(&history)
            .map_err(super::tokenize::model_error)?;
        Some(prompt)
    } else {
        None
    };
    let last = history.pop().expect("messages is not empty");
    if !plain && last.role != "user" {
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
        filter: body.filter.clone(),
        decoding: body.decoding.clone(),
        n: body.n,
        logprobs: top_logprobs(body.logprobs, body.top_logprobs)?,
        context: ContextAsked {
            mode: body.context.clone(),
            budget: body.context_budget,
            method: body.context_method.clone(),
            order: body.context_order.clone(),
            terms: body.context_terms,
        },
        overlap: body.overlap,
    };
    let with_logprobs = body.logprobs == Some(true);
    let include_usage = body
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let mut req = ask::prepare(&state, &pipeline, &stage, &headers, asked).map_err(|e| match e
        .param
        .as_deref()
    {
        Some("query") => ApiError {
            param: Some(format!("messages[{last_index}].content")),
            message: e
                .message
                .replacen("query", &format!("messages[{last_index}].content"), 1),
            ..e
        },
        _ => e,
    })?;
    if plain {
        // The generator alone compares with other servers on the same prompt: the RAG
        // decoding defaults do not apply, only what the request asks for.
        let decoded = body.decoding.resolve(llm::Sampling::default())?;
        req.sampling = decoded.sampling;
        req.end_at_paragraph = decoded.end_at_paragraph.unwrap_or(false);
    }
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let model = if plain {
        body.model.clone()
    } else {
        pipeline.generator.model_id().to_string()
    };
    if !body.stream {
        let a = match plain_prompt {
            Some(prompt) => pipeline.start_plain(req, prompt, &stage, None)?.await?,
            None => ask::answer(&pipeline, req, &stage).await?,
        };
        let choices: Vec<Value> = a
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": openai_finish(c.finish_reason),
                    "logprobs": logprobs_json(with_logprobs, &c.logprobs),
                })
            })
            .collect();
        let body = json!({
            "id": id,
            "object": "chat.completion",
            "created": unix_now(),
            "model": model,
            "choices": choices,
            "usage": a.usage,
            "sources": a.sources,
            "timings": a.timings,
        });
        return Ok(super::respond_json(&stage, a.finished_at, &body));
    }
    let n = body.n.unwrap_or(1);
    let events = match plain_prompt {
        Some(prompt) => {
            let (tx, rx) = pipeline.event_channel();
            let answer = pipeline.start_plain(req, prompt, &stage, Some(tx))?;
            ask::stream_events(&stage, rx, Some(answer)).boxed()
        }
        None => ask::answer_stream(&pipeline, req, &stage)?.boxed(),
    };
    let shape = ChunkShape {
        id,
        model,
        created: unix_now(),
        with_logprobs,
        include_usage,
    };
    Ok(Sse::new(chunks(events, shape, n, stage))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The plain model retrieves nothing, so a retrieval setting is refused by name, not dropped.
fn refuse_retrieval_settings(body: &ChatBody) -> Result<(), ApiError> {
    for (name, set) in [
        ("top_k", body.top_k.is_some()),
        ("rerank_top_n", body.rerank_top_n.is_some()),
        ("filter", body.filter.as_ref().is_some_and(|f| !f.is_null())),
        ("context", body.context.is_some()),
        ("context_budget", body.context_budget.is_some()),
        ("context_method", body.context_method.is_some()),
        ("context_order", body.context_order.is_some()),
        ("context_terms", body.context_terms.is_some()),
    ] {
        if set {
            return Err(ApiError::field(
                name,
                "a retrieval setting; the plain model retrieves nothing",
            )
            .with_code("unsupported_parameter"));
        }
    }
    Ok(())
}

/// `logprobs` and `top_logprobs` as the generator's one setting: how many alternatives, or
/// none. `top_logprobs` without `logprobs: true` is refused, as OpenAI does.
fn top_logprobs(logprobs: Option<bool>, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    if let Some(k) = top {
        if k > MAX_TOP_LOGPROBS {
            return Err(ApiError::field(
                "top_logprobs",
                format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
    }
    match (logprobs, top) {
        (Some(true), k) => Ok(Some(k.unwrap_or(0))),
        (_, Some(k)) if k > 0 => Err(ApiError::field("top_logprobs", "needs \"logprobs\": true")),
        _ => Ok(None),
    }
}

/// OpenAI's `finish_reason`: a client that went away or a timeout still reads as one of the
/// two it knows.
pub(super) fn openai_finish(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length | FinishReason::Timeout => "length",
    }
}

/// A choice's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}` when asked for.
fn logprobs_json(asked: bool, logprobs: &[TokenLogprob]) -> Value {
    if !asked {
        return Value::Null;
    }
    let entry = |bytes: &[u8], logprob: f32| {
        json!({
            "token": String::from_utf8_lossy(bytes),
            "logprob": logprob,
            "bytes": bytes,
        })
    };
    let content: Vec<Value> = logprobs
        .iter()
        .map(|lp| {
            let mut e = entry(&lp.bytes, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|t| entry(&t.bytes, t.logprob)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// What every chunk of one response shares.
struct ChunkShape {
    id: String,
    model: String,
    created: u64,
    with_logprobs: bool,
    include_usage: bool,
}

impl ChunkShape {
    fn chunk(&self, choices: Value) -> Value {
        let mut c = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices,
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn choice(
        &self,
        index: usize,
        delta: Value,
        finish: Value,
        logprobs: &[TokenLogprob],
    ) -> Value {
        let logprobs = if self.with_logprobs && !logprobs.is_empty() {
            logprobs_json(true, logprobs)
        } else {
            Value::Null
        };
        self.chunk(json!([{
            "index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs,
        }]))
    }
}

/// `chat.completion.chunk` events: each choice's role, the choices' pieces as they come, each
/// choice's finish, the usage chunk when asked for, then `[DONE]`.
fn chunks(
    events: impl Stream<Item = AnswerEvent> + Send + 'static,
    shape: ChunkShape,
    n: usize,
    stage: RequestStage,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let first: Vec<Value> = (0..n)
        .map(|i| {
            shape.choice(
                i,
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                &[],
            )
        })
        .collect();
    let body = events.flat_map(move |event| {
        let data = match event {
            AnswerEvent::Sources(_) => Vec::new(),
            AnswerEvent::Token(piece) => vec![shape.choice(
                piece.choice,
                json!({"content": piece.text}),
                Value::Null,
                &piece.logprobs,
            )],
            AnswerEvent::Done(a) => {
                let mut last: Vec<Value> = a
                    .choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        shape.choice(i, json!({}), json!(openai_finish(c.finish_reason)), &[])
                    })
                    .collect();
                if shape.include_usage {
                    let mut usage = shape.chunk(json!([]));
                    usage["usage"] = json!(a.usage);
                    last.push(usage);
                }
                last
            }
            AnswerEvent::Failed(e) => {
                super::stream_failed(&stage, &e);
                vec![e.body()]
            }
        };
        futures::stream::iter(data)
    });
    futures::stream::iter(first)
        .chain(body)
        .map(|data| Ok(SseEvent::default().json_data(data).unwrap_or_default()))
        .chain(futures::stream::once(futures::future::ready(Ok(
            SseEvent::default().data("[DONE]"),
        ))))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingsBody {
    pub model: String,
    #[schema(value_type = super::schema::EmbeddingInput)]
    pub input: Value,
    pub encoding_format: Option<String>,
    pub dimensions: Option<usize>,
    /// Accepted and ignored, as for chat.
    pub user: Option<String>,
    /// Everything else, refused by name.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// OpenAI embeddings (L2-normalised), floats or base64.
#[utoipa::path(post, path = "/v1/embeddings", tag = "openai", request_body = EmbeddingsBody,
    responses((status = 200, description = "One vector per input", body = super::schema::EmbeddingList)))]
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
    let faults = super::ask::request_faults(&state, &headers, &stage)?;
    // Counted after admission: a refused request costs no tokenisation.
    let vectors = pipeline.embed(texts.clone(), faults, &stage).await?;
    let tokens = ask::embed_tokens(&pipeline, &texts);
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

/// The models this server answers to.
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "OpenAI's model list", body = super::schema::ModelList)))]
pub async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    let created = unix_now();
    let mut ids = vec![
        pipeline.generator.model_id().to_string(),
        pipeline.embedder.model_id().to_string(),
    ];
    ids.extend(RAG_MODEL_ALIASES.iter().map(|s| s.to_string()));
    ids.push(super::completions::plain_model(&pipeline));
    if let Some(r) = &pipeline.reranker {
        ids.push(r.model_id().to_string());
    }
    let data: Vec<Value> = ids
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": created, "owned_by": "ragscope"}))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}
