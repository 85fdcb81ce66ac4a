//! What goes into a request and what comes out: the validated request, the answer with its
//! sources, usage and per-stage timings, the events a stream sees, and the one error type
//! every stage folds into.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Map, Value};

use super::context::ContextSettings;
use super::Pipeline;
use crate::embed::EmbedError;
use crate::fault::{FaultPlan, Injected};
use crate::ingest::IngestError;
use crate::rerank::RerankError;
use crate::retrieve::{Filter, ScoredChunk, StoreError};
use crate::worker::Refused;
use llm::{ChatMessage, FinishReason, GenerateError, Sampling, TokenLogprob};
use telemetry::clock;
use telemetry::names::StageKind;

#[derive(Debug, Clone)]
pub struct RagRequest {
    pub query: String,
    /// Earlier chat turns (OpenAI-compatible endpoint); empty for `/v1/rag/query`.
    pub history: Vec<ChatMessage>,
    pub top_k: usize,
    pub rerank_top_n: usize,
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Stop strings: the answer ends before the first one.
    pub stop: Vec<String>,
    /// `Some(k)`: each answer token's log-probability with its `k` likeliest alternatives.
    pub logprobs: Option<usize>,
    /// Independent answers to generate (chat's `n`); choice `i` samples with seed `seed + i`.
    pub choices: usize,
    pub filter: Option<Filter>,
    /// What the context stage keeps of the reranked passages.
    pub context: ContextSettings,
    pub deadline: Instant,
    /// Faults to inject (empty unless the server allows injection).
    pub faults: Arc<FaultPlan>,
    /// Prefill the prompt's head while embedding and retrieving (`--overlap`).
    pub overlap: bool,
    /// The answer ends at its first finished paragraph (`--end-at-paragraph`).
    pub end_at_paragraph: bool,
}

impl RagRequest {
    /// A question with `pipeline`'s default settings (evaluation, benchmarks).
    pub fn with_defaults(query: String, pipeline: &Pipeline, timeout: Duration) -> RagRequest {
        let defaults = &pipeline.defaults;
        RagRequest {
            query,
            history: Vec::new(),
            top_k: defaults.top_k,
            rerank_top_n: defaults.rerank_top_n,
            max_tokens: defaults.max_tokens,
            sampling: pipeline.sampling,
            stop: Vec::new(),
            logprobs: None,
            choices: 1,
            filter: None,
            context: ContextSettings::defaults(defaults, defaults.rerank_top_n),
            deadline: clock::now() + timeout,
            faults: Arc::default(),
            overlap: defaults.overlap.on(),
            end_at_paragraph: defaults.end_at_paragraph,
        }
    }
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Source {
    pub id: String,
    pub doc_id: String,
    /// Relevance after reranking (the retrieval score when no reranker runs).
    pub score: f32,
    pub retrieval_score: f32,
    pub text: String,
    pub source: String,
    #[schema(value_type = Object)]
    pub metadata: Map<String, Value>,
}

impl Source {
    /// A retrieved chunk as a source, with its score after ranking.
    pub fn ranked(hit: &ScoredChunk, score: f32) -> Source {
        Source {
            id: hit.chunk.id.clone(),
            doc_id: hit.chunk.doc_id.clone(),
            score,
            retrieval_score: hit.score,
            text: hit.chunk.text.clone(),
            source: hit.chunk.source.clone(),
            metadata: hit.chunk.metadata.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, utoipa::ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// As OpenAI spells it, which benchmark clients read.
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, Serialize, utoipa::ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
}

/// Which per-request caches answered (the prefix cache's share is `usage.prompt_tokens_details`),
/// so a load generator can split its latencies by hit and miss.
#[derive(Debug, Clone, Copy, Default, Serialize, utoipa::ToSchema)]
pub struct CacheUse {
    /// The query's vector came from the query-embedding cache (the embedder did not run).
    pub query_embedding: bool,
    /// Sentences whose vectors the context stage looked up in the sentence cache (0 when the
    /// context needed no sentence vectors).
    pub sentences: usize,
    /// Of those, the ones the cache held (the rest were embedded).
    pub sentences_cached: usize,
}

/// Milliseconds per stage, equal to the durations of the stage spans.
#[derive(Debug, Clone, Copy, Default, Serialize, utoipa::ToSchema)]
pub struct Timings {
    pub queue_ms: f64,
    pub embed_ms: f64,
    pub retrieve_ms: f64,
    pub rerank_ms: f64,
    pub context_ms: f64,
    pub prompt_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
}

impl Timings {
    /// Sets the field of a stage that has one (generation's time is its prefill and decode).
    pub fn record(&mut self, kind: StageKind, ms: f64) {
        let field = match kind {
            StageKind::Queue => &mut self.queue_ms,
            StageKind::Embed => &mut self.embed_ms,
            StageKind::Retrieve => &mut self.retrieve_ms,
            StageKind::Rerank => &mut self.rerank_ms,
            StageKind::Context => &mut self.context_ms,
            StageKind::Prompt => &mut self.prompt_ms,
            StageKind::Prefill => &mut self.prefill_ms,
            StageKind::Decode => &mut self.decode_ms,
            StageKind::Generate | StageKind::Stream | StageKind::Respond | StageKind::Ingest => {
                return
            }
        };
        *field = ms;
    }
}

/// A RAG request's answer: the first choice's text and log-probabilities, the sources the
/// prompt kept, usage and per-stage timings, and every choice. The API puts it on the wire.
#[derive(Debug, Clone)]
pub struct RagAnswer {
    /// The first choice's text.
    pub answer: String,
    pub sources: Vec<Source>,
    /// Completion tokens of every choice.
    pub usage: Usage,
    pub timings: Timings,
    pub cache: CacheUse,
    pub finish_reason: FinishReason,
    /// The first choice's log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Every choice, the first one included (the chat endpoint's `n`).
    pub choices: Vec<Choice>,
    /// The context passages' text as the prompt got it (RAG answers; `ragscope eval` reads it).
    pub context: Vec<String>,
    /// When the worker finished, on the shared clock: the `respond` stage starts here.
    pub finished_at: Instant,
    /// Speculative drafts of every choice: steps, draft tokens verified, accepted.
    pub speculation: llm::speculate::Tally,
}

/// One of a request's independent answers.
#[derive(Debug, Clone)]
pub struct Choice {
    pub text: String,
    pub finish_reason: FinishReason,
    pub logprobs: Vec<TokenLogprob>,
    /// The end-of-sequence token's log-probability when the choice ended on it (with logprobs).
    pub end_logprob: Option<TokenLogprob>,
    pub completion_tokens: usize,
}

/// What a streaming request sees, in order: sources once, then tokens.
#[derive(Debug, Clone)]
pub enum Event {
    Sources(Vec<Source>),
    Token(Streamed),
}

/// A piece of one choice's answer, with the log-probabilities of the tokens it completes.
#[derive(Debug, Clone, Default)]
pub struct Streamed {
    pub choice: usize,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Refused at admission, before any work (a full queue, or a wait too long).
    #[error("{0}")]
    Overloaded(Refused),
    #[error("the request timed out after {0:.0} ms")]
    Timeout(f64),
    #[error("the model worker stopped before answering")]
    WorkerGone,
    #[error(transparent)]
    Embed(#[from] EmbedError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Rerank(#[from] RerankError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Ingest(#[from] IngestError),
    #[error(transparent)]
    Injected(#[from] Injected),
}

impl From<Refused> for PipelineError {
    fn from(r: Refused) -> Self {
        PipelineError::Overloaded(r)
    }
}

impl PipelineError {
    /// The `error.type` recorded on the failing span.
    pub fn kind(&self) -> &'static str {
        match self {
            PipelineError::Overloaded(r) => r.reason.as_str(),
            PipelineError::Timeout(_) => "timeout",
            PipelineError::WorkerGone => "worker_gone",
            PipelineError::Embed(_) => "embed",
            PipelineError::Store(_) => "store",
            PipelineError::Rerank(_) => "rerank",
            PipelineError::Generate(GenerateError::ContextOverflow { .. }) => "context_overflow",
            PipelineError::Generate(_) => "generate",
            PipelineError::Ingest(_) => "ingest",
            PipelineError::Injected(_) => "injected_fault",
        }
    }
}
