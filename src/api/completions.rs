//! `POST /v1/completions`, OpenAI's legacy text completions: the generator alone on the prompt
//! as written (the plain path, [`Pipeline::start_plain`]), or RAG over it with the RAG model
//! id. `echo` with `logprobs` returns the prompt's own token logprobs (the first one null),
//! from one scoring pass ([`Pipeline::score_prompt`]): what lm-eval's loglikelihood tasks send
//! (`echo: true, logprobs: 1, max_tokens: 0 or 1`, the prompt as token ids). Fields that would
//! change the answer and are not implemented are refused by name.

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
use super::error::ApiError;
use super::json::ValidJson;
use super::openai::{
    check_model, is_empty, is_zero, refuse_unhonoured, unix_now, StreamOptions, Unsupported,
    RAG_MODEL_ALIASES,
};
use super::tokenize::{check_token_ids, model_error};
use super::{AppState, RequestStage};
use crate::generate::tokenizer::Utf8Stream;
use crate::generate::{Generator, Sampling, TokenLogprob, MAX_TOP_LOGPROBS};
use crate::pipeline::{Pipeline, PipelineError, RagAnswer, RagRequest, Usage};

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
/// Most choices per prompt.
const MAX_N: usize = 16;

#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    pub model: String,
    /// A string, a list of strings, a list of token ids, or a list of such lists.
    pub prompt: Value,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub n: Option<usize>,
    /// A string or a list of up to 4 strings.
    pub stop: Option<Value>,
    /// How many alternatives per position, 0 to [`MAX_TOP_LOGPROBS`].
    pub logprobs: Option<usize>,
    #[serde(default)]
    pub echo: bool,
    #[serde(default)]
    pub stream: bool,
    /// With `include_usage`, a last chunk with `usage` and no choices.
    pub stream_options: Option<StreamOptions>,
    /// Accepted and ignored: labels the request, cannot change the answer.
    pub user: Option<String>,
    /// Everything else, refused by [`refuse_unhonoured`] with [`COMPLETION_UNSUPPORTED`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Completion fields that would change the answer; refused unless their value is neutral.
const COMPLETION_UNSUPPORTED: &[Unsupported] = &[
    ("suffix", "null or empty", is_empty),
    ("best_of", "1", |v| v.as_f64() == Some(1.0)),
    ("logit_bias", "empty", is_empty),
    ("presence_penalty", "0", is_zero),
    ("frequency_penalty", "0", is_zero),
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
            tokens: generator.tokenize(text, true).map_err(model_error)?,
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
        let text = generator.detokenize(&tokens).map_err(model_error)?;
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

/// `stop` as a list of strings (OpenAI allows up to 4).
fn stop_strings(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::field(&format!("stop[{i}]"), "must be a string"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::field(
                "stop",
                "must be a string or a list of strings",
            ))
        }
    };
    if list.len() > 4 {
        return Err(ApiError::field(
            "stop",
            format!("at most 4 strings, got {}", list.len()),
        ));
    }
    if let Some(i) = list.iter().position(String::is_empty) {
        return Err(ApiError::field(&format!("stop[{i}]"), "must not be empty"));
    }
    Ok(list)
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
        bytes: generator.token_bytes(prompt[0]),
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
}

fn plan(pipeline: &Pipeline, body: &CompletionBody) -> Result<Plan, ApiError> {
    refuse_unhonoured(&body.extra, COMPLETION_UNSUPPORTED)?;
    check_model(pipeline, &body.model)?;
    let rag = RAG_MODEL_ALIASES.contains(&body.model.as_str());
    let generator = pipeline.generator.as_ref();
    let prompts = prompts(generator, pipeline, &body.prompt)?;
    let n = body.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::field(
            "n",
            format!("must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    if let Some(k) = body.logprobs {
        if k > MAX_TOP_LOGPROBS {
            return Err(ApiError::field(
                "logprobs",
                format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
        if rag {
            return Err(ApiError::field(
                "logprobs",
                format!("only with the plain model {:?}", plain_model(pipeline)),
            )
            .with_code("unsupported_parameter"));
        }
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
    let stop = stop_strings(&body.stop)?;
    if !stop.is_empty() {
        return Err(
            ApiError::field("stop", "not supported yet; leave it out or send []")
                .with_code("unsupported_parameter"),
        );
    }
    if body.logprobs.is_some() && max_tokens > 0 {
        return Err(ApiError::field(
            "logprobs",
            "only for the echoed prompt yet: send max_tokens 0 with echo",
        )
        .with_code("unsupported_parameter"));
    }
    Ok(Plan {
        model: body.model.clone(),
        rag,
        prompts,
        n,
        max_tokens,
        logprobs: body.logprobs,
        echo: body.echo,
        include_usage: body
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// The generated tokens of an answer, scored.
fn generated_logprobs(_generator: &dyn Generator, _a: &RagAnswer) -> Vec<Scored> {
    Vec::new()
}

use super::openai::openai_finish as finish_reason;

pub async fn completions(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: axum::http::HeaderMap,
    ValidJson(body): ValidJson<CompletionBody>,
) -> Result<Response, ApiError> {
    let pipeline = state.pipeline()?;
    let plan = plan(&pipeline, &body)?;
    let mut base = generation_request(&state, &pipeline, &plan, &body)?;
    base.faults = super::admin::request_faults(&state, &headers, &stage)?;
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    if body.stream {
        if plan.prompts.len() > 1 {
            return Err(ApiError::field("prompt", "streaming takes one prompt")
                .with_code("unsupported_parameter"));
        }
        if plan.n > 1 {
            return Err(
                ApiError::field("n", "streaming takes n = 1").with_code("unsupported_parameter")
            );
        }
        let scores = match (plan.echo, plan.logprobs) {
            (true, Some(k)) => Some(
                pipeline
                    .score_prompt(
                        plan.prompts[0].tokens.clone(),
                        k,
                        base.faults.clone(),
                        &stage,
                    )
                    .await?,
            ),
            _ => None,
        };
        return stream(&pipeline, &stage, plan, scores, base, id);
    }
    let generator = pipeline.generator.as_ref();
    let mut choices = Vec::new();
    let mut usage = Usage::default();
    let mut finished_at = None;
    for (pi, prompt) in plan.prompts.iter().enumerate() {
        let scores = match (plan.echo, plan.logprobs) {
            (true, Some(k)) => Some(
                pipeline
                    .score_prompt(prompt.tokens.clone(), k, base.faults.clone(), &stage)
                    .await?,
            ),
            _ => None,
        };
        usage.prompt_tokens += prompt.tokens.len();
        let answers: Vec<Option<RagAnswer>> = if plan.max_tokens == 0 {
            vec![None; plan.n]
        } else {
            // Every choice is queued at once, so free workers generate them side by side.
            let mut started = Vec::with_capacity(plan.n);
            for j in 0..plan.n {
                let mut req = base.clone();
                req.sampling.seed = base.sampling.seed.wrapping_add(j as u64);
                started.push(start(&state, &pipeline, &stage, &plan, prompt, req)?);
            }
            futures::future::try_join_all(started)
                .await?
                .into_iter()
                .map(Some)
                .collect()
        };
        for (j, answer) in answers.into_iter().enumerate() {
            let echoed = if plan.echo { prompt.text.as_str() } else { "" };
            let (generated, finish) = match &answer {
                Some(a) => {
                    usage.completion_tokens += a.usage.completion_tokens;
                    finished_at = Some(a.finished_at);
                    (a.answer.as_str(), finish_reason(a.finish_reason))
                }
                None => ("", "length"),
            };
            let logprobs = plan.logprobs.map(|_| {
                let mut scored = match &scores {
                    Some(s) => scored_prompt(generator, &prompt.tokens, s),
                    None => Vec::new(),
                };
                if let Some(a) = &answer {
                    scored.extend(generated_logprobs(generator, a));
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
        finished_at.unwrap_or_else(crate::telemetry::clock::now),
        &body,
    ))
}

/// Queues one choice: the plain path on the prompt's tokens, or RAG over its text.
fn start(
    state: &AppState,
    pipeline: &Arc<Pipeline>,
    stage: &RequestStage,
    plan: &Plan,
    prompt: &Prompt,
    req: RagRequest,
) -> Result<BoxFuture<'static, Result<RagAnswer, PipelineError>>, ApiError> {
    if !plan.rag {
        return Ok(pipeline
            .start_plain(req, prompt.tokens.clone(), stage, None)?
            .boxed());
    }
    Ok(pipeline
        .start_query(rag_request(state, pipeline, prompt, req)?, stage, None)?
        .boxed())
}

/// The RAG request for a prompt: its text is the question; generation settings from `req`.
fn rag_request(
    state: &AppState,
    pipeline: &Pipeline,
    prompt: &Prompt,
    req: RagRequest,
) -> Result<RagRequest, ApiError> {
    let asked = Asked {
        query: prompt.text.clone(),
        history: Vec::new(),
        top_k: None,
        rerank_top_n: None,
        max_tokens: Some(req.max_tokens),
        temperature: Some(req.sampling.temperature),
        top_p: req.sampling.top_p,
        seed: Some(req.sampling.seed),
        filter: None,
        decoding: ask::Decoding::default(),
        context: Default::default(),
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

/// Generation settings of a completion, checked; errors name the field.
fn generation_request(
    state: &AppState,
    pipeline: &Pipeline,
    plan: &Plan,
    body: &CompletionBody,
) -> Result<RagRequest, ApiError> {
    sampling_request(
        state,
        pipeline,
        plan.max_tokens,
        body.temperature,
        body.top_p,
        body.seed,
    )
}

/// A plain request's generation settings, checked; errors name the field.
fn sampling_request(
    state: &AppState,
    pipeline: &Pipeline,
    max_tokens: usize,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
) -> Result<RagRequest, ApiError> {
    let temperature = ask::check_sampling(temperature, top_p)?;
    let mut req =
        RagRequest::with_defaults(String::new(), &pipeline.defaults, state.request_timeout);
    req.max_tokens = max_tokens;
    req.sampling = Sampling {
        temperature,
        top_p,
        seed: seed.unwrap_or(0),
        ..Sampling::default()
    };
    Ok(req)
}

/// Streams one choice as `text_completion` chunks: the echoed prompt first, then each piece
/// of text, a last chunk with the finish reason, `usage` if asked for, then `[DONE]`.
fn stream(
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
        None
    } else {
        Some(pipeline.start_plain(req, prompt.tokens.clone(), stage, Some(tx))?)
    };
    let events = ask::stream_events(stage, rx, answer);
    let created = unix_now();
    let model = plan.model.clone();
    let chunk = move |text: &str, logprobs: Value, finish: Value| {
        json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        })
    };
    let mut first = Vec::new();
    let mut offset = 0;
    if plan.echo {
        let logprobs = match &prompt_scores {
            Some(s) => {
                let scored = scored_prompt(generator.as_ref(), &prompt.tokens, s);
                legacy_logprobs(&scored, 0)
            }
            None => Value::Null,
        };
        offset = prompt.text.chars().count();
        first.push(chunk(&prompt.text, logprobs, Value::Null));
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
        let mut finish = "length";
        while let Some(event) = events.next().await {
            match event {
                ask::AnswerEvent::Sources(_) => {}
                ask::AnswerEvent::Token(piece) => {
                    let text = piece.text;
                    let logprobs = if want_logprobs { legacy_logprobs(&[], offset) } else { Value::Null };
                    offset += text.chars().count();
                    yield chunk(&text, logprobs, Value::Null);
                }
                ask::AnswerEvent::Done(a) => {
                    usage = a.usage;
                    finish = finish_reason(a.finish_reason);
                }
                ask::AnswerEvent::Failed(e) => {
                    super::stream_failed(&stage, &e);
                    yield e.body();
                    return;
                }
            }
        }
        yield chunk("", Value::Null, json!(finish));
        if include_usage {
            let mut last = chunk("", Value::Null, Value::Null);
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
