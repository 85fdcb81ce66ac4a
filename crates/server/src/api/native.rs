//! `POST /v1/rag/query` (JSON or SSE) and `POST /v1/rerank`: this server's own HTTP dialect,
//! a mapping of its JSON bodies onto [`super::ask`].

use std::convert::Infallible;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::ask::{self, AnswerEvent, Asked};
use super::decoding::Decoding;
use super::error::ApiError;
use super::fields::refuse_unhonoured;
use super::json::ValidJson;
use super::{AppState, RequestStage};
use llm::{FinishReason, TokenLogprob};
use rag::pipeline::context::ContextAsked;
use rag::pipeline::{CacheUse, RagAnswer, Source, Timings, Usage};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct QueryBody {
    pub query: String,
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub max_tokens: Option<usize>,
    #[schema(value_type = Option<Object>)]
    pub filter: Option<Value>,
    #[serde(default)]
    pub stream: bool,
    /// Each answer token's log-probability with this many likeliest alternatives (0 to 20).
    pub logprobs: Option<usize>,
    /// The context stage: `off`, `sentences` or `passages`; its token budget; its method; the
    /// order the prompt lists its passages in (`best-last` or `rank`); whether headers name
    /// the entry term of their best sentence (`sentences` only).
    pub context: Option<String>,
    pub context_budget: Option<usize>,
    pub context_method: Option<String>,
    pub context_order: Option<String>,
    pub context_terms: Option<bool>,
    /// Prefill the prompt's head while retrieving (unset: the server's `--overlap`).
    pub overlap: Option<bool>,
    /// Temperature, top-p, seed, stop strings, penalties and biases.
    #[serde(flatten)]
    pub decoding: Decoding,
    /// Everything else, refused by name.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// A RAG answer with its sources; with `stream: true`, server-sent events `sources`,
/// `token`…, then `done` or `error`.
#[utoipa::path(post, path = "/v1/rag/query", tag = "rag", request_body = QueryBody,
    responses((status = 200, description = "The answer, or its events", content(
        (AnswerBody = "application/json"),
        (super::schema::RagEvent = "text/event-stream")))))]
pub async fn query(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: HeaderMap,
    ValidJson(body): ValidJson<QueryBody>,
) -> Result<Response, ApiError> {
    refuse_unhonoured(&body.extra, &[])?;
    let pipeline = state.pipeline()?;
    let asked = Asked {
        query: body.query,
        history: Vec::new(),
        top_k: body.top_k,
        rerank_top_n: body.rerank_top_n,
        max_tokens: body.max_tokens,
        filter: body.filter,
        decoding: body.decoding,
        n: None,
        logprobs: body.logprobs,
        context: ContextAsked {
            mode: body.context,
            budget: body.context_budget,
            method: body.context_method,
            order: body.context_order,
            terms: body.context_terms,
        },
        overlap: body.overlap,
    };
    let req = ask::prepare(&state, &pipeline, &stage, &headers, asked)?;
    if !body.stream {
        let answer = ask::answer(&pipeline, req, &stage).await?;
        return Ok(super::respond_json(
            &stage,
            answer.finished_at,
            &AnswerBody::of(&answer),
        ));
    }
    let events = ask::answer_stream(&pipeline, req, &stage)?;
    Ok(Sse::new(sse_events(events, stage))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `/v1/rag/query`'s JSON answer: the pipeline's [`RagAnswer`] as clients see it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = RagAnswer)]
pub struct AnswerBody<'a> {
    /// The first choice's text.
    #[schema(value_type = String)]
    pub answer: &'a str,
    #[schema(value_type = Vec<Source>)]
    pub sources: &'a [Source],
    /// Completion tokens of every choice.
    pub usage: Usage,
    pub timings: Timings,
    pub cache: CacheUse,
    #[schema(value_type = super::schema::FinishReason)]
    pub finish_reason: FinishReason,
    /// The first choice's log-probabilities, when asked for.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    #[schema(value_type = Vec<super::schema::TokenLogprob>, required = false)]
    pub logprobs: &'a [TokenLogprob],
}

impl<'a> AnswerBody<'a> {
    pub fn of(a: &'a RagAnswer) -> AnswerBody<'a> {
        AnswerBody {
            answer: &a.answer,
            sources: &a.sources,
            usage: a.usage,
            timings: a.timings,
            cache: a.cache,
            finish_reason: a.finish_reason,
            logprobs: &a.logprobs,
        }
    }
}

/// SSE events: `sources`, then `token`s, then `done` (usage, timings, cache) or `error`.
fn sse_events(
    events: impl Stream<Item = AnswerEvent> + Send + 'static,
    stage: RequestStage,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    events.map(move |event| {
        let sse = match event {
            AnswerEvent::Sources(sources) => {
                SseEvent::default().event("sources").json_data(&sources)
            }
            AnswerEvent::Token(piece) => {
                let mut data = json!({"text": piece.text});
                if !piece.logprobs.is_empty() {
                    data["logprobs"] = json!(piece.logprobs);
                }
                SseEvent::default().event("token").json_data(data)
            }
            AnswerEvent::Done(a) => SseEvent::default().event("done").json_data(
                json!({"usage": a.usage, "timings": a.timings, "cache": a.cache, "finish_reason": a.finish_reason}),
            ),
            AnswerEvent::Failed(e) => {
                super::stream_failed(&stage, &e);
                SseEvent::default().event("error").json_data(e.body())
            }
        };
        Ok(sse.unwrap_or_default())
    })
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RerankBody {
    pub query: String,
    pub documents: Vec<String>,
    pub top_n: Option<usize>,
    pub model: Option<String>,
    #[serde(default)]
    pub return_documents: bool,
}

/// Scores documents against a query, best first.
#[utoipa::path(post, path = "/v1/rerank", tag = "rag", request_body = RerankBody,
    responses((status = 200, description = "The ranking", body = super::schema::RerankResponse)))]
pub async fn rerank(
    State(state): State<AppState>,
    Extension(stage): Extension<RequestStage>,
    headers: HeaderMap,
    ValidJson(body): ValidJson<RerankBody>,
) -> Result<Json<Value>, ApiError> {
    let pipeline = state.pipeline()?;
    let model = ask::rerank_model(&pipeline);
    if let Some(m) = &body.model {
        if *m != model {
            return Err(ApiError::field(
                "model",
                format!("unknown model {m:?}; this server reranks with {model:?}"),
            )
            .with_code("model_not_found"));
        }
    }
    let top_n = ask::check_rerank(&body.query, &body.documents, body.top_n)?;
    let faults = super::ask::request_faults(&state, &headers, &stage)?;
    let scores = pipeline
        .rerank(body.query, body.documents.clone(), faults, &stage)
        .await?;
    let results: Vec<Value> = rag::rerank::ranking(&scores)
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
