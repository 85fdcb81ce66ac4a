//! One RAG request, top to bottom: embed the query → retrieve candidates → rerank → build the
//! prompt → generate, streaming tokens as they come. Each step is a stage (a span on the shared
//! clock) under the request's span, and the same durations are returned to the client as
//! `timings`. The whole path runs on a model-worker thread, after one `queue` stage.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::PipelineArgs;
use crate::embed::cache::QueryCache;
use crate::embed::{EmbedError, Embedder};
use crate::fault::{FaultPlan, FaultStage, Injected};
use crate::generate::{
    ChatMessage, FinishReason, Flow, GenerateError, GenerateRequest, Generator, Sampling,
};
use crate::ingest::chunk::ChunkerConfig;
use crate::ingest::{Document, IngestError, IngestOutcome};
use crate::prompt;
use crate::rerank::{Candidate, RerankError, Reranker};
use crate::retrieve::{Filter, ScoredChunk, StoreError, VectorStore};
use crate::telemetry::clock::{self, millis};
use crate::telemetry::profile;
use crate::telemetry::span::Stage;
use crate::worker::{QueueFull, Workers};

/// Everything a request needs, shared by all requests.
pub struct Pipeline {
    pub embedder: Arc<dyn Embedder>,
    pub store: Arc<dyn VectorStore>,
    /// `None` keeps retrieval order.
    pub reranker: Option<Arc<dyn Reranker>>,
    pub generator: Arc<dyn Generator>,
    pub workers: Workers,
    pub defaults: PipelineArgs,
    pub chunker: ChunkerConfig,
    pub query_cache: QueryCache,
}

#[derive(Debug, Clone)]
pub struct RagRequest {
    pub query: String,
    /// Earlier chat turns (OpenAI-compatible endpoint); empty for `/v1/rag/query`.
    pub history: Vec<ChatMessage>,
    pub top_k: usize,
    pub rerank_top_n: usize,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub filter: Option<Filter>,
    pub deadline: Instant,
    /// Faults to inject (empty unless the server allows injection).
    pub faults: Arc<FaultPlan>,
}

impl RagRequest {
    /// A question with the server's default settings (evaluation, benchmarks).
    pub fn with_defaults(query: String, defaults: &PipelineArgs, timeout: Duration) -> RagRequest {
        RagRequest {
            query,
            history: Vec::new(),
            top_k: defaults.top_k,
            rerank_top_n: defaults.rerank_top_n,
            max_tokens: defaults.max_tokens,
            sampling: Sampling::default(),
            filter: None,
            deadline: clock::now() + timeout,
            faults: Arc::default(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Source {
    pub id: String,
    pub doc_id: String,
    /// Relevance after reranking (the retrieval score when no reranker runs).
    pub score: f32,
    pub retrieval_score: f32,
    pub text: String,
    pub source: String,
    pub metadata: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// Milliseconds per stage, equal to the durations of the stage spans.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timings {
    pub queue_ms: f64,
    pub embed_ms: f64,
    pub retrieve_ms: f64,
    pub rerank_ms: f64,
    pub prompt_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RagAnswer {
    pub answer: String,
    pub sources: Vec<Source>,
    pub usage: Usage,
    pub timings: Timings,
    pub finish_reason: FinishReason,
    /// When the worker finished, on the shared clock: the `respond` stage starts here.
    #[serde(skip)]
    pub finished_at: Instant,
}

/// What a streaming request sees, in order: sources once, then tokens.
#[derive(Debug, Clone)]
pub enum Event {
    Sources(Vec<Source>),
    Token(String),
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("the server is at capacity; retry shortly")]
    QueueFull,
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

impl From<QueueFull> for PipelineError {
    fn from(_: QueueFull) -> Self {
        PipelineError::QueueFull
    }
}

impl PipelineError {
    /// The `error.type` recorded on the failing span.
    pub fn kind(&self) -> &'static str {
        match self {
            PipelineError::QueueFull => "queue_full",
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

impl Pipeline {
    /// Answers a question. With `events`, sources and tokens are sent as they are ready, and a
    /// closed receiver (the client went away) stops the generation.
    ///
    /// The job is queued before this returns, so a full queue is reported at once (the API
    /// turns it into 429 before any byte of a stream is sent); the future yields the answer.
    pub fn start_query(
        self: &Arc<Self>,
        req: RagRequest,
        request: &Arc<Stage>,
        events: Option<UnboundedSender<Event>>,
    ) -> Result<
        impl Future<Output = Result<RagAnswer, PipelineError>> + Send + 'static,
        PipelineError,
    > {
        let this = self.clone();
        let stage = request.clone();
        let rx = self
            .workers
            .submit(request, move || this.answer(&req, &stage, events.as_ref()))?;
        Ok(async move { rx.await.map_err(|_| PipelineError::WorkerGone)? })
    }

    /// Embeds texts for the embeddings endpoint.
    pub async fn embed(
        self: &Arc<Self>,
        texts: Vec<String>,
        request: &Arc<Stage>,
    ) -> Result<Vec<Vec<f32>>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(request, move || {
            let embed = stage.child(format!("embeddings {}", this.embedder.model_id()));
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            Ok(this.embedder.embed(&refs, &embed)?)
        })
        .await
    }

    /// Scores passages against a query for the rerank endpoint.
    pub async fn rerank(
        self: &Arc<Self>,
        query: String,
        passages: Vec<String>,
        request: &Arc<Stage>,
    ) -> Result<Vec<f32>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(request, move || {
            let refs: Vec<&str> = passages.iter().map(String::as_str).collect();
            let retrieval = this.dense_scores(&query, &refs, &stage)?;
            let candidates: Vec<Candidate> = refs
                .iter()
                .zip(&retrieval)
                .map(|(text, &retrieval_score)| Candidate {
                    text,
                    retrieval_score,
                })
                .collect();
            match &this.reranker {
                Some(r) => {
                    let rerank = stage.child(format!("rerank {}", r.model_id()));
                    Ok(r.score(&query, &candidates, &rerank)?)
                }
                None => Ok(retrieval),
            }
        })
        .await
    }

    /// Ingests documents (each one durable before the next starts).
    pub async fn ingest(
        self: &Arc<Self>,
        docs: Vec<Document>,
        request: &Arc<Stage>,
    ) -> Result<Vec<IngestOutcome>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(request, move || {
            docs.iter()
                .map(|doc| {
                    let s = stage.child("ingest");
                    s.set(KeyValue::new("rag.document.id", doc.id.clone()));
                    crate::ingest::ingest_document(
                        doc,
                        this.embedder.as_ref(),
                        this.store.as_ref(),
                        this.chunker,
                        &s,
                    )
                    .map_err(PipelineError::from)
                })
                .collect()
        })
        .await
    }

    async fn run_on_worker<T: Send + 'static>(
        &self,
        request: &Stage,
        work: impl FnOnce() -> Result<T, PipelineError> + Send + 'static,
    ) -> Result<T, PipelineError> {
        let rx = self.workers.submit(request, work)?;
        rx.await.map_err(|_| PipelineError::WorkerGone)?
    }

    /// The RAG path itself, on a worker thread.
    fn answer(
        &self,
        req: &RagRequest,
        request: &Stage,
        events: Option<&UnboundedSender<Event>>,
    ) -> Result<RagAnswer, PipelineError> {
        let mut timings = Timings {
            queue_ms: millis(request.elapsed()),
            ..Timings::default()
        };
        self.check_deadline(req, request)?;

        // 1. Embed the query.
        let stage = request.child(format!("embeddings {}", self.embedder.model_id()));
        stage.set_all(model_attributes("embeddings", self.embedder.model_id()));
        req.faults.apply(FaultStage::Embeddings, &stage)?;
        let vector = match self.query_cache.get(&req.query) {
            Some(vector) => {
                stage.set(KeyValue::new("rag.cache.hit", true));
                vector
            }
            None => {
                stage.set(KeyValue::new("rag.cache.hit", false));
                let profiled = profile::label(&stage);
                let vector = self.embedder.embed(&[&req.query], &stage)?.remove(0);
                drop(profiled);
                self.query_cache.put(&req.query, vector.clone());
                vector
            }
        };
        timings.embed_ms = millis(stage.end());

        // 2. Retrieve candidates.
        let info = self.store.info();
        let stage = request.child(format!("retrieval {}", info.collection));
        if let Some(server) = &info.server {
            stage.set_all([
                KeyValue::new("server.address", server.address.clone()),
                KeyValue::new("server.port", i64::from(server.port)),
            ]);
        }
        stage.set_all([
            KeyValue::new("db.system.name", info.system),
            KeyValue::new("db.collection.name", info.collection.clone()),
            KeyValue::new("db.operation.name", "query"),
            KeyValue::new("gen_ai.data_source.id", info.collection),
            KeyValue::new("rag.retrieval.top_k", req.top_k as i64),
            KeyValue::new("rag.retrieval.index", info.index),
            KeyValue::new("rag.retrieval.filtered", req.filter.is_some()),
        ]);
        req.faults.apply(FaultStage::Retrieval, &stage)?;
        let hits = self
            .store
            .search(&vector, req.top_k, req.filter.as_ref(), &stage)?;
        stage.set(KeyValue::new(
            "db.response.returned_rows",
            hits.len() as i64,
        ));
        timings.retrieve_ms = millis(stage.end());

        // 3. Rerank and keep the best `rerank_top_n`.
        let mut ranked = self.rank(req, hits, request, &mut timings)?;
        ranked.truncate(req.rerank_top_n);
        if let Some(tx) = events {
            let _ = tx.send(Event::Sources(ranked.clone()));
        }
        self.check_deadline(req, request)?;

        // 4. Build the prompt within the context window.
        let stage = request.child("prompt");
        req.faults.apply(FaultStage::Prompt, &stage)?;
        let passages: Vec<&str> = ranked.iter().map(|s| s.text.as_str()).collect();
        let built = prompt::build(
            self.generator.as_ref(),
            &req.history,
            &req.query,
            &passages,
            req.max_tokens,
        );
        let built = match built {
            Ok(p) => p,
            Err(e) => {
                stage.fail("context_overflow", e.to_string());
                return Err(e.into());
            }
        };
        stage.set_all([
            KeyValue::new("rag.prompt.passages_kept", built.kept.len() as i64),
            KeyValue::new("rag.prompt.passages_dropped", built.dropped as i64),
            KeyValue::new("rag.prompt.truncated", built.truncated),
            KeyValue::new("gen_ai.usage.input_tokens", built.tokens.len() as i64),
        ]);
        timings.prompt_ms = millis(stage.end());
        let sources: Vec<Source> = built.kept.iter().map(|&i| ranked[i].clone()).collect();

        // 5. Generate, streaming each piece of text as it completes.
        let model = self.generator.model_id();
        let stage = request.child(format!("chat {model}"));
        stage.set_all(model_attributes("chat", model));
        stage.set_all([
            KeyValue::new("gen_ai.request.max_tokens", req.max_tokens as i64),
            KeyValue::new("gen_ai.request.temperature", req.sampling.temperature),
            KeyValue::new("gen_ai.request.seed", req.sampling.seed as i64),
            KeyValue::new("gen_ai.request.stream", events.is_some()),
        ]);
        if let Some(p) = req.sampling.top_p {
            stage.set(KeyValue::new("gen_ai.request.top_p", p));
        }
        req.faults.apply(FaultStage::Chat, &stage)?;
        let profiled = profile::label(&stage);
        let token_delay = req.faults.token_delay();
        let mut delayed_tokens = 0;
        let mut on_token = |piece: &str| {
            if let Some(d) = token_delay {
                std::thread::sleep(d);
                delayed_tokens += 1;
            }
            match events {
                Some(tx) if tx.send(Event::Token(piece.to_string())).is_err() => Flow::Stop,
                _ => Flow::Continue,
            }
        };
        let generated = self.generator.generate(
            GenerateRequest {
                prompt: &built.tokens,
                max_tokens: req.max_tokens,
                sampling: req.sampling,
                token_trace: self.defaults.token_trace,
                deadline: Some(req.deadline),
                ignore_eos: false,
            },
            &stage,
            &mut on_token,
        )?;
        drop(profiled);
        if let Some(d) = token_delay {
            stage.set_all([
                KeyValue::new("rag.fault.token_delay_ms", millis(d)),
                KeyValue::new("rag.fault.delayed_tokens", delayed_tokens as i64),
            ]);
            crate::fault::count(FaultStage::Chat, "token_delay");
        }
        let ttft = generated
            .first_token_at
            .map(|t| millis(t.saturating_duration_since(request.started())));
        stage.set_all([
            KeyValue::new("gen_ai.response.model", model.to_string()),
            KeyValue::new("gen_ai.response.finish_reasons", generated.finish.as_str()),
            KeyValue::new("gen_ai.usage.input_tokens", generated.prompt_tokens as i64),
            KeyValue::new("gen_ai.usage.output_tokens", generated.tokens.len() as i64),
        ]);
        if let Some(ttft) = ttft {
            stage.set(KeyValue::new(
                "gen_ai.server.time_to_first_token",
                ttft / 1e3,
            ));
        }
        if self.defaults.capture_content {
            stage.set(KeyValue::new("rag.answer.text", generated.text.clone()));
        }
        stage.end();
        timings.prefill_ms = millis(generated.prefill);
        timings.decode_ms = millis(generated.decode);
        timings.ttft_ms = ttft.unwrap_or_default();
        timings.total_ms = millis(request.elapsed());
        record_metrics(&timings, &generated);

        Ok(RagAnswer {
            answer: generated.text.trim().to_string(),
            sources,
            usage: Usage {
                prompt_tokens: generated.prompt_tokens,
                completion_tokens: generated.tokens.len(),
                total_tokens: generated.prompt_tokens + generated.tokens.len(),
            },
            timings,
            finish_reason: generated.finish,
            finished_at: clock::now(),
        })
    }

    /// Reorders candidates by the reranker's scores (or keeps retrieval order without one).
    fn rank(
        &self,
        req: &RagRequest,
        hits: Vec<ScoredChunk>,
        request: &Stage,
        timings: &mut Timings,
    ) -> Result<Vec<Source>, PipelineError> {
        let scores = match &self.reranker {
            Some(reranker) if !hits.is_empty() => {
                let stage = request.child(format!("rerank {}", reranker.model_id()));
                stage.set_all([
                    KeyValue::new("gen_ai.request.model", reranker.model_id().to_string()),
                    KeyValue::new("gen_ai.rerank.candidate.count", hits.len() as i64),
                ]);
                let candidates: Vec<Candidate> = hits
                    .iter()
                    .map(|h| Candidate {
                        text: &h.chunk.text,
                        retrieval_score: h.score,
                    })
                    .collect();
                req.faults.apply(FaultStage::Rerank, &stage)?;
                let profiled = profile::label(&stage);
                let scores = reranker.score(&req.query, &candidates, &stage)?;
                drop(profiled);
                timings.rerank_ms = millis(stage.end());
                scores
            }
            _ => hits.iter().map(|h| h.score).collect(),
        };
        let order = crate::rerank::ranking(&scores);
        Ok(order
            .into_iter()
            .map(|i| {
                let hit = &hits[i];
                Source {
                    id: hit.chunk.id.clone(),
                    doc_id: hit.chunk.doc_id.clone(),
                    score: scores[i],
                    retrieval_score: hit.score,
                    text: hit.chunk.text.clone(),
                    source: hit.chunk.source.clone(),
                    metadata: hit.chunk.metadata.clone(),
                }
            })
            .collect())
    }

    /// Cosine scores of passages against a query (for `/v1/rerank`'s fusion input).
    fn dense_scores(
        &self,
        query: &str,
        passages: &[&str],
        request: &Stage,
    ) -> Result<Vec<f32>, PipelineError> {
        let stage = request.child(format!("embeddings {}", self.embedder.model_id()));
        let mut texts = vec![query];
        texts.extend_from_slice(passages);
        let vectors = self.embedder.embed(&texts, &stage)?;
        let q = &vectors[0];
        Ok(vectors[1..]
            .iter()
            .map(|v| v.iter().zip(q).map(|(a, b)| a * b).sum())
            .collect())
    }

    fn check_deadline(&self, req: &RagRequest, request: &Stage) -> Result<(), PipelineError> {
        if clock::now() >= req.deadline {
            return Err(PipelineError::Timeout(millis(request.elapsed())));
        }
        Ok(())
    }
}

/// Stage durations, time to first token, time per output token and token usage.
fn record_metrics(t: &Timings, generated: &crate::generate::Generated) {
    let m = crate::telemetry::metrics::metrics();
    let secs = |ms: f64| std::time::Duration::from_secs_f64(ms.max(0.0) / 1e3);
    for (stage, ms) in [
        ("queue", t.queue_ms),
        ("embed", t.embed_ms),
        ("retrieve", t.retrieve_ms),
        ("rerank", t.rerank_ms),
        ("prompt", t.prompt_ms),
        ("prefill", t.prefill_ms),
        ("decode", t.decode_ms),
    ] {
        m.stage(stage, secs(ms));
    }
    if generated.first_token_at.is_some() {
        m.time_to_first_token.record(t.ttft_ms / 1e3, &[]);
    }
    if generated.tokens.len() > 1 {
        let per_token = t.decode_ms / 1e3 / (generated.tokens.len() - 1) as f64;
        m.time_per_output_token.record(per_token, &[]);
    }
    m.tokens.add(
        generated.prompt_tokens as u64,
        &[KeyValue::new("gen_ai.token.type", "input")],
    );
    m.tokens.add(
        generated.tokens.len() as u64,
        &[KeyValue::new("gen_ai.token.type", "output")],
    );
}

/// The GenAI attributes every model stage carries.
pub fn model_attributes(operation: &'static str, model: &str) -> [KeyValue; 3] {
    [
        KeyValue::new("gen_ai.operation.name", operation),
        KeyValue::new("gen_ai.provider.name", "ragscope"),
        KeyValue::new("gen_ai.request.model", model.to_string()),
    ]
}
