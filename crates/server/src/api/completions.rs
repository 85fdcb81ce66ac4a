//! `POST /v1/completions`, OpenAI's legacy text completions: the generator alone on the prompt
//! as written (the plain path, [`Pipeline::start_plain`]), or RAG over it with the RAG model
//! id. `stop`, `n` (one job per prompt whose choices decode side by side), the penalties and
//! `logprobs` (top-k per generated position, in the legacy shape) are honoured; `echo` with
//! `logprobs` adds the prompt's own token logprobs (the first one null), from one scoring
//! pass ([`Pipeline::score_prompt`]): what lm-eval's loglikelihood tasks send (`echo: true,
//! logprobs: 1, max_tokens: 0 or 1`, the prompt as token ids). Fields that would change the
//! answer and are not implemented are refused by name.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::ask::{self, Asked};
use super::decoding::Decoding;
use super::error::ApiError;
use super::fields::{is_empty, refuse_unhonoured, unix_now, Unsupported};
use super::json::ValidJson;
use super::openai::{check_model, StreamOptions, RAG_MODEL_ALIASES};
use super::tokenize::{check_token_ids, model_error};
use super::{AppState, RequestStage};
use llm::tokenizer::Utf8Stream;
use llm::{Generator, Sampling, TokenLogprob};
use rag::pipeline::{Pipeline, PipelineError, RagAnswer, RagRequest, Usage};

/// Suffix of the plain model id (`SmolLM2-135M-Instruct-plain`): the generator alone, listed in
/// `/v1/models` so that clients which can only choose a model (benchmarks, lm-eval) can ask
/// for generation without retrieval.
pub const PLAIN_SUFFIX: &str = "-plain";

/// The plain model id of this server's generator.
pub fn plain_model(pipeline: &Pipeline) -> String {
    format!("{}{PLAIN_SUFFIX}", pipeline.generator.model_id())
}

/// Most prompts one request may hold.
const MAX_PROMPTS: usize = 64;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct CompletionBody {
    pub model: String,
    /// A string, a list of strings, a list of token ids, or a list of such lists.
    #[schema(value_type = super::schema::Prompt)]
    pub prompt: Value,
    pub max_tokens: Option<usize>,
    /// Choices per prompt, 1 to [`ask::MAX_CHOICES`]; choice `i` samples with `seed + i`.
    pub n: Option<usize>,
    /// How many alternatives per position, 0 to [`llm::MAX_TOP_LOGPROBS`].
    pub logprobs: Option<usize>,
    #[serde(default)]
    pub echo: bool,
    #[serde(default)]
    pub stream: bool,
    /// With `include_usage`, a last chunk with `usage` and no choices.
    pub stream_options: Option<StreamOptions>,
    /// Accepted and ignored: labels the request, cannot change the answer.
    pub user: Option<String>,
    /// Temperature, top-p, seed, stop strings, penalties and biases (for the plain model only
    /// what the request asks; no RAG defaults).
    #[serde(flatten)]
    pub decoding: Decoding,
    /// Everything else, refused by [`refuse_unhonoured`] with [`COMPLETION_UNSUPPORTED`].
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// Completion fields that would change the answer; refused unless their value is neutral.
const COMPLETION_UNSUPPORTED: &[Unsupported] = &[
    ("suffix", "null or empty", is_empty),
    ("best_of", "1", |v| v.as_f64() == Some(1.0)),
    ("logit_bias", "empty", is_empty),
];

/// One prompt: its tokens, and its text for `echo`.
struct Prompt {
    tokens: Vec<u32>,
    text: String,
}

/// The prompts of a request; errors name `prompt` or `prompt[i]`.
fn prompts(
    generator: &dyn Generator,
    pipeline: &Pipeline,
    v: &Value,
) -> Result<Vec<Prompt>, ApiError> {
    let from_text = |param: &str, text: &str| -> Result<Prompt, ApiError> {
        if text.is_empty() {
            return Err(ApiError::field(param, "must not be empty"));
        }
        Ok(Prompt {
            tokens: generator
                .tokenizer()
                .tokenize(text, true)
                .map_err(model_error)?,
            text: text.to_string(),
        })
    };
    let from_ids = |param: &str, ids: &[Value]| -> Result<Prompt, ApiError> {
        let tokens = ids
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| ApiError::field(&format!("{param}[{i}]"), "must be a token id"))
            })
            .collect::<Result<Vec<u32>, _>>()?;
        if tokens.is_empty() {
            return Err(ApiError::field(param, "must not be empty"));
        }
        check_token_ids(pipeline, param, &tokens)?;
        let text = generator
            .tokenizer()
            .detokenize(&tokens)
            .map_err(model_error)?;
        Ok(Prompt { tokens, text })
    };
    let list =
        match v {
            Value::String(s) => return Ok(vec![from_text("prompt", s)?]),
            Value::Array(items) if items.first().is_some_and(Value::is_number) => {
                return Ok(vec![from_ids("prompt", items)?])
            }
            Value::Array(items) if !items.is_empty() && items.len() <= MAX_PROMPTS => items,
            Value::Array(items) if !items.is_empty() => {
                return Err(ApiError::field(
                    "prompt",
                    format!("at most {MAX_PROMPTS} prompts, got {}", items.len()),
                ))
            }
            _ => return Err(ApiError::field(
                "prompt",
                "must be a string, a list of strings, a list of token ids or a list of such lists",
            )),
        };
    list.iter()
        .enumerate()
        .map(|(i, item)| {
            let param = format!("prompt[{i}]");
            match item {
                Value::String(s) => from_text(&param, s),
                Value::Array(ids) => from_ids(&param, ids),
                _ => Err(ApiError::field(
                    &param,
                    "must be a string or a list of token ids",
                )),
            }
        })
        .collect()
}

/// One token of a choice's `logprobs`: its bytes, its logprob (`None` for the first prompt
/// token, which nothing predicts) and the alternatives.
struct Scored {
    bytes: Vec<u8>,
    logprob: Option<f32>,
    top: Vec<(Vec<u8>, f32)>,
}

impl Scored {
    fn from_logprob(t: &TokenLogprob) -> Scored {
        Scored {
            bytes: t.bytes.clone(),
            logprob: Some(t.logprob),
            top: t.top.iter().map(|a| (a.bytes.clone(), a.logprob)).collect(),
        }
    }
}

/// The prompt's tokens scored: the first with no logprob, then the scoring pass's.
fn scored_prompt(
    generator: &dyn Generator,
    prompt: &[u32],
    scores: &[TokenLogprob],
) -> Vec<Scored> {
    let first = Scored {
        bytes: generator.tokenizer().token_bytes(prompt[0]),
        logprob: None,
        top: Vec::new(),
    };
    std::iter::once(first)
        .chain(scores.iter().map(Scored::from_logprob))
        .collect()
}

/// OpenAI's legacy `logprobs` object: `tokens`, `token_logprobs`, `top_logprobs` (a map from
/// token text to logprob, null where the logprob is) and `text_offset` (characters into the
/// choice's text, counted from `offset`).
fn legacy_logprobs(scored: &[Scored], offset: usize) -> Value {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let mut stream = Utf8Stream::new();
    let mut at = offset;
    let mut text_offset = Vec::with_capacity(scored.len());
    for s in scored {
        text_offset.push(at);
        at += stream.push(&s.bytes).chars().count();
    }
    json!({
        "tokens": scored.iter().map(|s| text(&s.bytes)).collect::<Vec<_>>(),
        "token_logprobs": scored.iter().map(|s| s.logprob).collect::<Vec<_>>(),
        "top_logprobs": scored
            .iter()
            .map(|s| match s.logprob {
                None => Value::Null,
                Some(_) => Value::Object(
                    s.top.iter().map(|(b, lp)| (text(b), json!(lp))).collect(),
                ),
            })
            .collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// What every choice of the request shares, validated.
struct Plan {
    model: String,
    rag: bool,
    prompts: Vec<Prompt>,
    n: usize,
    max_tokens: usize,
    logprobs: Option<usize>,
    echo: bool,
    include_usage: bool,
    /// The request's decoding settings, checked.
    decoding: Decoding,
}

fn plan(pipeline: &Pipeline, body: &CompletionBody) -> Result<Plan, ApiError> {
    refuse_unhonoured(&body.extra, COMPLETION_UNSUPPORTED)?;
    check_model(pipeline, &body.model)?;
    let rag = RAG_MODEL_ALIASES.contains(&body.model.as_str());
    let generator = pipeline.generator.as_ref();
    let prompts = prompts(generator, pipeline, &body.prompt)?;
    ask::check_choices(body.n, body.logprobs)?;
    // Checked here, for the error to come before any work; resolved per prompt.
    body.decoding.resolve(llm::Sampling::default())?;
    if body.logprobs.is_some() && rag {
        return Err(ApiError::field(
            "logprobs",
            format!("only with the plain model {:?}", plain_model(pipeline)),
        )
        .with_code("unsupported_parameter"));
    }
    let max_tokens = body.max_tokens.unwrap_or(pipeline.defaults.max_tokens);
    let window = generator.context_window();
    for (i, p) in prompts.iter().enumerate() {
        if !rag && p.tokens.len() + max_tokens > window {
            let param = if prompts.len() == 1 && !body.prompt.is_array() {
                "prompt".to_string()
            } else {
                format!("prompt[{i}]")
            };
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::field(
                    &param,
                    format!(
                        "{} tokens; with max_tokens {max_tokens} that exceeds the context window of {window}",
                        p.tokens.len()
                    ),
                )
            });
        }
    }
    if rag && max_tokens == 0 {
        return Err(ApiError::field(
            "max_tokens",
            "must be at least 1 with the RAG model",
        ));
    }
    Ok(Plan {
        model: body.model.clone(),
        rag,
        prompts,
        n: body.n.unwrap_or(1),
        max_tokens,
        logprobs: body.logprobs,
        echo: body.echo,
        include_usage: body
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        decoding: body.decoding.clone(),
    })
}

/// What one prompt got: its scored tokens (with `echo` and `logprobs`) and its generated
/// choices (none with `max_tokens: 0`).
struct Completed {
    scores: Option<Vec<TokenLogprob>>,
    answer: Option<RagAnswer>,
}

use super::openai::openai_finish as finish_reason;

/// OpenAI legacy completions on the generator alone (RAG with `model: "ragscope"`); JSON, or
/// with `stream: true` server-sent chunks ending in `data: [DONE]`.
#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionBody,
    responses((status = 200, description = "The completion, or its chunks", content(
        (super::schema::Completion = "application/json"),
        (super::schema::CompletionStreamEvent = "text/event-stream")))))]
pub async fn completions(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: axum::http::HeaderMap,
    ValidJson(body): ValidJson<CompletionBody>,
) -> Result<Response, ApiError> {
    let pipeline = state.pipeline()?;
    let plan = plan(&pipeline, &body)?;
    let mut base = generation_request(&state, &pipeline, &plan)?;
    base.faults = super::ask::request_faults(&state, &headers, &stage)?;
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    if body.stream {
        if plan.prompts.len() > 1 {
            return Err(ApiError::field("prompt", "streaming takes one prompt")
                .with_code("unsupported_parameter"));
        }
        let scores = score(&pipeline, &stage, &plan, &plan.prompts[0], &base).await?;
        return stream(&state, &pipeline, &stage, plan, scores, base, id);
    }
    // Every prompt is started at once, so free workers take them side by side; a prompt's `n`
    // choices are one job whose choices decode together.
    let completed = futures::future::try_join_all(plan.prompts.iter().map(|prompt| {
        let (state, pipeline, stage, plan, req) = (&state, &pipeline, &stage, &plan, base.clone());
        async move {
            let scores = score(pipeline, stage, plan, prompt, &req).await?;
            let answer = match plan.max_tokens {
                0 => None,
                _ => Some(start(state, pipeline, stage, plan, prompt, req, None)?.await?),
            };
            Ok::<_, ApiError>(Completed { scores, answer })
        }
    }))
    .await?;
    let generator = pipeline.generator.as_ref();
    let mut choices = Vec::new();
    let mut usage = Usage::default();
    let mut finished_at = None;
    for (pi, (prompt, done)) in plan.prompts.iter().zip(&completed).enumerate() {
        match &done.answer {
            Some(a) => {
                usage.prompt_tokens += a.usage.prompt_tokens;
                usage.completion_tokens += a.usage.completion_tokens;
                finished_at = Some(a.finished_at);
            }
            None => usage.prompt_tokens += prompt.tokens.len(),
        }
        for j in 0..plan.n {
            let choice = done.answer.as_ref().map(|a| &a.choices[j]);
            let echoed = if plan.echo { prompt.text.as_str() } else { "" };
            let (generated, finish) = match choice {
                Some(c) => (c.text.as_str(), finish_reason(c.finish_reason)),
                None => ("", "length"),
            };
            let logprobs = plan.logprobs.map(|_| {
                let mut scored = match &done.scores {
                    Some(s) => scored_prompt(generator, &prompt.tokens, s),
                    None => Vec::new(),
                };
                if let Some(c) = choice {
                    scored.extend(c.logprobs.iter().map(Scored::from_logprob));
                    scored.extend(c.end_logprob.iter().map(Scored::from_logprob));
                }
                legacy_logprobs(&scored, 0)
            });
            choices.push(json!({
                "index": pi * plan.n + j,
                "text": format!("{echoed}{generated}"),
                "logprobs": logprobs,
                "finish_reason": finish,
            }));
        }
    }
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
    let body = json!({
        "id": id,
        "object": "text_completion",
        "created": unix_now(),
        "model": plan.model,
        "choices": choices,
        "usage": usage,
    });
    Ok(super::respond_json(
        &stage,
        finished_at.unwrap_or_else(telemetry::clock::now),
        &body,
    ))
}

/// The prompt's own token logprobs when `echo` and `logprobs` ask for them.
async fn score(
    pipeline: &Arc<Pipeline>,
    stage: &RequestStage,
    plan: &Plan,
    prompt: &Prompt,
    req: &RagRequest,
) -> Result<Option<Vec<TokenLogprob>>, ApiError> {
    let (true, Some(k)) = (plan.echo, plan.logprobs) else {
        return Ok(None);
    };
    let scores = pipeline
        .score_prompt(prompt.tokens.clone(), k, req.faults.clone(), stage)
        .await?;
    Ok(Some(scores))
}

/// Queues one prompt's choices: the plain path on its tokens, or RAG over its text.
fn start(
    state: &AppState,
    pipeline: &Arc<Pipeline>,
    stage: &RequestStage,
    plan: &Plan,
    prompt: &Prompt,
    req: RagRequest,
    events: Option<rag::pipeline::EventSender>,
) -> Result<BoxFuture<'static, Result<RagAnswer, PipelineError>>, ApiError> {
    if !plan.rag {
        return Ok(pipeline
            .start_plain(req, prompt.tokens.clone(), stage, events)?
            .boxed());
    }
    let rag = rag_request(state, pipeline, plan, prompt, req)?;
    Ok(pipeline.start_query(rag, stage, events)?.boxed())
}

/// The RAG request for a prompt: its text is the question; generation settings from `req`
/// and the plan's decoding (the server's RAG decoding defaults where it gives none).
fn rag_request(
    state: &AppState,
    pipeline: &Pipeline,
    plan: &Plan,
    prompt: &Prompt,
    req: RagRequest,
) -> Result<RagRequest, ApiError> {
    let asked = Asked {
        query: prompt.text.clone(),
        history: Vec::new(),
        top_k: None,
        rerank_top_n: None,
        max_tokens: Some(req.max_tokens),
        filter: None,
        decoding: plan.decoding.clone(),
        n: Some(plan.n),
        logprobs: None,
        context: Default::default(),
        overlap: None,
    };
    let rag = ask::rag_request(pipeline, state, asked).map_err(|e| match e.param.as_deref() {
        Some("query") => ApiError {
            param: Some("prompt".into()),
            message: e.message.replacen("query", "prompt", 1),
            ..e
        },
        _ => e,
    })?;
    Ok(RagRequest {
        faults: req.faults,
        ..rag
    })
}

/// Generation settings of a completion for the generator alone: what the request asks for
/// and otherwise neutral (no server RAG defaults), so it compares with other servers.
fn generation_request(
    state: &AppState,
    pipeline: &Pipeline,
    plan: &Plan,
) -> Result<RagRequest, ApiError> {
    let decoded = plan.decoding.resolve(Sampling::default())?;
    let mut req = RagRequest::with_defaults(String::new(), pipeline, state.request_timeout);
    req.max_tokens = plan.max_tokens;
    req.sampling = decoded.sampling;
    req.stop = decoded.stop;
    req.end_at_paragraph = decoded.end_at_paragraph.unwrap_or(false);
    req.logprobs = plan.logprobs;
    req.choices = plan.n;
    Ok(req)
}

/// Streams one prompt's `n` choices as `text_completion` chunks (`index` per choice): the
/// echoed prompt first, then each piece of text as it comes, each choice's finish reason,
/// `usage` if asked for, then `[DONE]`.
fn stream(
    state: &AppState,
    pipeline: &Arc<Pipeline>,
    stage: &RequestStage,
    plan: Plan,
    prompt_scores: Option<Vec<TokenLogprob>>,
    req: RagRequest,
    id: String,
) -> Result<Response, ApiError> {
    let generator = pipeline.generator.clone();
    let prompt = &plan.prompts[0];
    let (tx, rx) = pipeline.event_channel();
    let answer = if plan.max_tokens == 0 {
        drop(tx);
        None
    } else {
        Some(start(state, pipeline, stage, &plan, prompt, req, Some(tx))?)
    };
    let events = ask::stream_events(stage, rx, answer);
    let created = unix_now();
    let model = plan.model.clone();
    let chunk = move |index: usize, text: &str, logprobs: Value, finish: Value| {
        json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        })
    };
    let n = plan.n;
    let mut first = Vec::new();
    let mut offsets = vec![0; n];
    if plan.echo {
        let logprobs = match &prompt_scores {
            Some(s) => {
                let scored = scored_prompt(generator.as_ref(), &prompt.tokens, s);
                legacy_logprobs(&scored, 0)
            }
            None => Value::Null,
        };
        offsets = vec![prompt.text.chars().count(); n];
        first.extend((0..n).map(|j| chunk(j, &prompt.text, logprobs.clone(), Value::Null)));
    }
    let prompt_tokens = prompt.tokens.len();
    let (want_logprobs, include_usage) = (plan.logprobs.is_some(), plan.include_usage);
    let stage = stage.clone();
    let body = async_stream::stream! {
        for c in first {
            yield c;
        }
        futures::pin_mut!(events);
        let mut usage = Usage { prompt_tokens, completion_tokens: 0, total_tokens: prompt_tokens, prompt_tokens_details: Default::default() };
        let mut finishes = vec!["length"; n];
        while let Some(event) = events.next().await {
            match event {
                ask::AnswerEvent::Sources(_) => {}
                ask::AnswerEvent::Token(piece) => {
                    let Some(offset) = offsets.get_mut(piece.choice) else { continue };
                    let logprobs = if want_logprobs {
                        let scored: Vec<Scored> = piece.logprobs.iter().map(Scored::from_logprob).collect();
                        legacy_logprobs(&scored, *offset)
                    } else {
                        Value::Null
                    };
                    *offset += piece.text.chars().count();
                    yield chunk(piece.choice, &piece.text, logprobs, Value::Null);
                }
                ask::AnswerEvent::Done(a) => {
                    usage = a.usage;
                    for (f, c) in finishes.iter_mut().zip(&a.choices) {
                        *f = finish_reason(c.finish_reason);
                    }
                }
                ask::AnswerEvent::Failed(e) => {
                    super::stream_failed(&stage, &e);
                    yield e.body();
                    return;
                }
            }
        }
        for (j, finish) in finishes.into_iter().enumerate() {
            yield chunk(j, "", Value::Null, json!(finish));
        }
        if include_usage {
            let mut last = chunk(0, "", Value::Null, Value::Null);
            last["choices"] = json!([]);
            last["usage"] = json!(usage);
            yield last;
        }
    };
    let sse = body
        .map(|data| Ok::<_, Infallible>(SseEvent::default().json_data(data).unwrap_or_default()))
        .chain(futures::stream::once(futures::future::ready(Ok(
            SseEvent::default().data("[DONE]"),
        ))));
    Ok(Sse::new(sse)
        .keep_alive(KeepAlive::default())
        .into_response())
}
