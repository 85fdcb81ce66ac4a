//! One RAG request, top to bottom: embed the query → retrieve candidates → rerank → select the
//! context (the sentences or passages the prompt gets, `context`) → build the prompt →
//! generate, streaming tokens as they come. Each step is a stage (a span on the shared clock)
//! under the request's span, run by the one [`StageRunner`], and the same durations are
//! returned to the client as `timings`. The whole path runs on a model-worker thread, after one
//! `queue` stage. The other routes (embeddings, rerank, ingest) run their stages the same way.

pub mod cite;
pub mod context;
mod documents;
pub mod events;
mod generate;
pub mod lookup;
pub mod overlap;
mod plain;
mod quality;
mod request;
pub mod runner;

use std::future::Future;
use std::sync::Arc;

use opentelemetry::KeyValue;

pub use crate::settings::PipelineArgs;
pub use events::{EventReceiver, EventSender, SendError};
pub use overlap::Overlap;
pub use request::{
    CacheUse, Choice, Event, PipelineError, PromptTokensDetails, RagAnswer, RagRequest, Source,
    Streamed, Timings, Usage,
};
pub use runner::{StageRunner, StageSpec};

use crate::embed::cache::{PromptMemory, QueryCache, VectorCache};
use crate::embed::Embedder;
use crate::fault::FaultPlan;
use crate::ingest::chunk::ChunkerConfig;
use crate::ingest::{Document, IngestOutcome};
use crate::prompt::{self, Prompt};
use crate::rerank::{Candidate, Reranker};
use crate::retrieve::{ScoredChunk, VectorStore};
use crate::worker::{Admission, JobKind, Warmth, Workers};
use context::{ContextMode, ContextPassage};
use llm::Generator;
use telemetry::clock::{self, millis};
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

/// What a rerank reorders: the passages, their retrieval scores, the chunks they are (none for
/// `/v1/rerank`'s bare passages) and how many of the best the request keeps.
struct Candidates<'a> {
    texts: &'a [&'a str],
    retrieval: &'a [f32],
    chunks: Option<&'a [&'a crate::retrieve::Chunk]>,
    top_n: usize,
}

/// Everything a request needs, shared by all requests.
pub struct Pipeline {
    pub embedder: Arc<dyn Embedder>,
    pub store: Arc<dyn VectorStore>,
    /// `None` keeps retrieval order.
    pub reranker: Option<Arc<dyn Reranker>>,
    pub generator: Arc<dyn Generator>,
    pub workers: Workers,
    pub defaults: PipelineArgs,
    /// The decoding a RAG answer gets for what its request leaves out (`--repetition-penalty`,
    /// `--copy-bias`, …: the sampler's flags).
    pub sampling: llm::Sampling,
    pub chunker: ChunkerConfig,
    pub query_cache: QueryCache,
    /// Sentence vectors of the context stage.
    pub sentence_cache: VectorCache,
    /// Each recent question's last prompt, for admission's guess at whether the prefix cache
    /// holds it ([`Pipeline::warmth_of`]).
    pub prompts: PromptMemory,
    /// Where the generator leaves failure snapshots (`GET /debug/snapshots`), if anywhere.
    pub snapshots: Option<Arc<llm::snapshot::SnapshotStore>>,
}

impl Pipeline {
    /// The channel a streamed answer's events go through, bounded by `--stream-buffer` and
    /// `--stream-stall-timeout-ms` (see [`events`]).
    pub fn event_channel(&self) -> (EventSender, EventReceiver) {
        events::channel(
            self.defaults.stream_buffer,
            std::time::Duration::from_millis(self.defaults.stream_stall_timeout_ms),
        )
    }

    /// Answers a question. With `events`, sources and tokens are sent as they are ready, and a
    /// closed receiver (the client went away) stops the generation.
    ///
    /// The job is queued before this returns, so a full queue is reported at once (the API
    /// turns it into 429 before any byte of a stream is sent); the future yields the answer.
    pub fn start_query(
        self: &Arc<Self>,
        req: RagRequest,
        request: &Arc<Stage>,
        events: Option<EventSender>,
    ) -> Result<
        impl Future<Output = Result<RagAnswer, PipelineError>> + Send + 'static,
        PipelineError,
    > {
        self.start_job(req, request, events, Pipeline::answer)
    }

    /// Queues `job` (a whole answer: RAG or plain) on a model worker, admitted by `req`'s
    /// deadline; the future yields what it returns.
    fn start_job(
        self: &Arc<Self>,
        req: RagRequest,
        request: &Arc<Stage>,
        events: Option<EventSender>,
        job: impl FnOnce(
                &Pipeline,
                &RagRequest,
                &Stage,
                Option<&EventSender>,
            ) -> Result<RagAnswer, PipelineError>
            + Send
            + 'static,
    ) -> Result<
        impl Future<Output = Result<RagAnswer, PipelineError>> + Send + 'static,
        PipelineError,
    > {
        let this = self.clone();
        let stage = request.clone();
        let admission = Admission::new(JobKind::Query)
            .by(req.deadline)
            .warmth(self.warmth_of(&req.query));
        let rx = self.workers.submit(admission, request, move || {
            job(&this, &req, &stage, events.as_ref())
        })?;
        Ok(async move { rx.await.map_err(|_| PipelineError::WorkerGone)? })
    }

    /// Whether `question`'s prompt is expected to find its prefix cached: its last prompt, if
    /// it was asked recently, mostly in the prefix cache now. A question not asked recently has
    /// a prompt to compute. Costs a hash lookup and a block-hash walk, no tokenisation.
    fn warmth_of(&self, question: &str) -> Warmth {
        if self.prompts.capacity() == 0 {
            return Warmth::Unknown;
        }
        match self.prompts.get(question) {
            Some(prompt) if 2 * self.cached_prefix(&prompt) >= prompt.len() => Warmth::Warm,
            _ => Warmth::Cold,
        }
    }

    /// How many leading tokens of `prompt` the generator's prefix cache holds now (0 without).
    fn cached_prefix(&self, prompt: &[u32]) -> usize {
        self.generator
            .prefix_cache()
            .map_or(0, |cache| cache.cached(prompt))
    }

    /// The RAG path itself, on a worker thread: each step a stage of its own, below.
    fn answer(
        &self,
        req: &RagRequest,
        request: &Stage,
        events: Option<&EventSender>,
    ) -> Result<RagAnswer, PipelineError> {
        let mut run = StageRunner::new(request, &req.faults);
        run.timings_mut().queue_ms = millis(request.elapsed());
        check_deadline(req, request)?;

        // Dropped on an early return: a warm that has not started computing is called off.
        let warm = self.start_warm(req, request);
        let (vector, mut cache) = self.embed_query(&mut run, req)?;
        let hits = self.retrieve(&mut run, req, &vector)?;
        let retrieved_at = std::time::Instant::now();
        let mut ranked = self.rank(&mut run, &req.query, hits, req.rerank_top_n)?;
        ranked.truncate(req.rerank_top_n);
        let context = self.select_context(&mut run, req, &vector, &ranked, &mut cache)?;
        // The sources are the passages the context kept, in the order of the prompt's markers.
        let kept: Vec<Source> = context.iter().map(|c| ranked[c.source].clone()).collect();
        if let Some(tx) = events {
            let _ = tx.send(Event::Sources(kept.clone()));
        }
        check_deadline(req, request)?;

        let built = self.build_prompt(&mut run, req, &context)?;
        let sources: Vec<Source> = built.kept.iter().map(|&i| kept[i].clone()).collect();
        if let Some(warm) = warm {
            warm.finish();
        }
        let gap = retrieved_at.elapsed();
        let generated = self.answer_prompt(&mut run, req, &built, events)?;
        let window = self.generator.context_window();
        quality::record(
            request,
            &quality::Quality::of(&generated[0], &sources, gap, window),
        );
        let mut answer = self.finish(run, sources, generated);
        answer.cache = cache;
        answer.context = built.texts;
        Ok(answer)
    }

    /// 0. With `overlap`: the prompt head's prefill, started beside embedding and retrieval
    ///    ([`overlap`]). A head that cannot be built is left to the prompt stage to report.
    fn start_warm(&self, req: &RagRequest, request: &Stage) -> Option<overlap::Warm> {
        if !req.overlap {
            return None;
        }
        let template = self.defaults.prompt_template;
        let generator = self.generator.as_ref();
        let head = prompt::head(generator, template, &req.history, &req.query).ok()?;
        overlap::Warm::start(self.generator.clone(), head, request, req.deadline)
    }

    /// 1. The query's vector, from the query cache or the embedder, and whether the cache had it.
    fn embed_query(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
    ) -> Result<(Vec<f32>, CacheUse), PipelineError> {
        let cached = self.query_cache.get(&req.query);
        let cache = CacheUse {
            query_embedding: cached.is_some(),
            ..CacheUse::default()
        };
        let spec = StageSpec::model(StageKind::Embed, self.embedder.model_id())
            .with([KeyValue::new(attr::CACHE_HIT, cached.is_some())])
            .profiled(cached.is_none());
        let vector = run.run(spec, |stage| match cached {
            Some(vector) => Ok(vector),
            None => {
                let vector = self.embedder.embed(&[&req.query], stage)?.remove(0);
                self.query_cache.put(&req.query, vector.clone());
                Ok(vector)
            }
        })?;
        Ok((vector, cache))
    }

    /// 2. The `top_k` nearest chunks, joined by the best BM25 matches over the whole collection
    ///    (`--lexical-top-k`, at most `top_k`).
    fn retrieve(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        vector: &[f32],
    ) -> Result<Vec<ScoredChunk>, PipelineError> {
        let info = self.store.info();
        let mut attributes = vec![
            KeyValue::new(attr::DB_SYSTEM_NAME, info.system),
            KeyValue::new(attr::DB_COLLECTION_NAME, info.collection.clone()),
            KeyValue::new(attr::DB_OPERATION_NAME, "query"),
            KeyValue::new(attr::GEN_AI_DATA_SOURCE_ID, info.collection.clone()),
            KeyValue::new(attr::RETRIEVAL_TOP_K, req.top_k as i64),
            KeyValue::new(attr::RETRIEVAL_INDEX, info.index),
            KeyValue::new(attr::RETRIEVAL_FILTERED, req.filter.is_some()),
        ];
        if let Some(server) = &info.server {
            attributes.push(KeyValue::new(attr::SERVER_ADDRESS, server.address.clone()));
            attributes.push(KeyValue::new(attr::SERVER_PORT, i64::from(server.port)));
        }
        if let Some(cluster) = &info.cluster {
            attributes.extend(cluster.attributes());
        }
        let lexical_top_k = self.defaults.lexical_top_k.min(req.top_k);
        attributes.push(KeyValue::new(
            attr::RETRIEVAL_LEXICAL_TOP_K,
            lexical_top_k as i64,
        ));
        let spec = StageSpec::new(StageKind::Retrieve)
            .on(info.collection)
            .with(attributes);
        run.run(spec, |stage| {
            let found = crate::retrieve::hybrid_search(
                self.store.as_ref(),
                &req.query,
                vector,
                req.top_k,
                lexical_top_k,
                req.filter.as_ref(),
                stage,
            )?;
            let mut hits = found.hits;
            // Entries are looked up where the request did not say where to look, and only
            // for a reranker, which puts them first (without one they would fall behind).
            let unfiltered = req.filter.as_ref().is_none_or(|f| f.conditions.is_empty());
            if self.defaults.entry_lookup && unfiltered && self.reranker.is_some() {
                let store = self.store.as_ref();
                // An extra: a failed search costs the lookup, not the request.
                let added = lookup::fetch(store, &req.query, vector, &mut hits, stage)
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "entry lookup's search failed");
                        0
                    });
                stage.set(KeyValue::new(attr::RETRIEVAL_LOOKUP_ADDED, added as i64));
            }
            stage.set_all([
                KeyValue::new(attr::DB_RESPONSE_RETURNED_ROWS, hits.len() as i64),
                KeyValue::new(attr::RETRIEVAL_LEXICAL_HITS, found.lexical as i64),
                KeyValue::new(attr::RETRIEVAL_LEXICAL_ADDED, found.lexical_added as i64),
            ]);
            stage.set_all(documents::retrieved(
                hits.iter().map(|h| (&h.chunk, h.score)),
                telemetry::controls::capture_content(),
            ));
            Ok(hits)
        })
    }

    /// 3. Candidates reordered by the reranker's scores (retrieval order without one).
    fn rank(
        &self,
        run: &mut StageRunner,
        query: &str,
        hits: Vec<ScoredChunk>,
        top_n: usize,
    ) -> Result<Vec<Source>, PipelineError> {
        let scores = match &self.reranker {
            Some(reranker) if !hits.is_empty() => {
                let texts: Vec<&str> = hits.iter().map(|h| h.chunk.text.as_str()).collect();
                let retrieval: Vec<f32> = hits.iter().map(|h| h.score).collect();
                let chunks: Vec<&crate::retrieve::Chunk> = hits.iter().map(|h| &h.chunk).collect();
                let candidates = Candidates {
                    texts: &texts,
                    retrieval: &retrieval,
                    chunks: Some(&chunks),
                    top_n,
                };
                let lookup = self.defaults.entry_lookup;
                self.rerank_stage(run, reranker.as_ref(), query, &candidates, lookup)?
            }
            _ => hits.iter().map(|h| h.score).collect(),
        };
        let order = crate::rerank::ranking(&scores);
        Ok(order
            .into_iter()
            .map(|i| Source::ranked(&hits[i], scores[i]))
            .collect())
    }

    /// 4. The context: the sentences (or whole passages) of the reranked passages that
    ///    the prompt gets, within the request's token budget.
    fn select_context(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        vector: &[f32],
        ranked: &[Source],
        cache: &mut CacheUse,
    ) -> Result<Vec<ContextPassage>, PipelineError> {
        let settings = req.context;
        let embeds = settings.mode == ContextMode::Sentences && settings.method.needs_vectors();
        let mut attributes = vec![KeyValue::new(attr::CONTEXT_MODE, settings.mode.as_str())];
        if settings.mode != ContextMode::Off {
            attributes.push(KeyValue::new(attr::CONTEXT_BUDGET, settings.budget as i64));
        }
        if settings.mode == ContextMode::Sentences {
            attributes.push(KeyValue::new(
                attr::CONTEXT_METHOD,
                settings.method.as_str(),
            ));
            attributes.push(KeyValue::new(attr::CONTEXT_TERMS, settings.terms));
        }
        if settings.mode != ContextMode::Off {
            attributes.push(KeyValue::new(attr::CONTEXT_ORDER, settings.order.as_str()));
        }
        let spec = StageSpec::new(StageKind::Context)
            .with(attributes)
            .profiled(embeds);
        run.run(spec, |stage| {
            let texts: Vec<&str> = ranked.iter().map(|s| s.text.as_str()).collect();
            let models = context::Models {
                generator: self.generator.as_ref(),
                embedder: self.embedder.as_ref(),
                sentences: &self.sentence_cache,
            };
            let chosen = context::select(settings, &req.query, vector, &texts, &models, stage)?;
            if embeds {
                cache.sentences = chosen.sentences_in;
                cache.sentences_cached = chosen.sentences_cached;
            }
            stage.set_all([
                KeyValue::new(attr::CONTEXT_SENTENCES_IN, chosen.sentences_in as i64),
                KeyValue::new(attr::CONTEXT_SENTENCES_OUT, chosen.sentences_out as i64),
                KeyValue::new(
                    attr::CONTEXT_SENTENCES_CACHED,
                    chosen.sentences_cached as i64,
                ),
                KeyValue::new(attr::CONTEXT_TOKENS_IN, chosen.tokens_in as i64),
                KeyValue::new(attr::CONTEXT_TOKENS_OUT, chosen.tokens_out as i64),
                KeyValue::new(attr::CONTEXT_PASSAGES_OUT, chosen.passages.len() as i64),
            ]);
            if settings.mode == ContextMode::Sentences {
                stage.set_all([
                    KeyValue::new(attr::CONTEXT_TERMS_NAMED, chosen.terms_named as i64),
                    KeyValue::new(attr::CONTEXT_TERM_TOKENS, chosen.term_tokens as i64),
                    KeyValue::new(
                        attr::CONTEXT_ENTRIES_LOOKED_UP,
                        chosen.entries_looked_up as i64,
                    ),
                ]);
            }
            Ok(chosen.passages)
        })
    }

    /// 5. The prompt within the context window, listing the context's passages in the
    ///    request's order; remembered as the question's last prompt for admission.
    fn build_prompt(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        context: &[ContextPassage],
    ) -> Result<Prompt, PipelineError> {
        let passages: Vec<&str> = context.iter().map(|c| c.text.as_str()).collect();
        let listing = req.context.listing(context);
        let built = run.run(StageSpec::new(StageKind::Prompt), |stage| {
            let built = prompt::build_listed(
                self.generator.as_ref(),
                self.defaults.prompt_template,
                &req.history,
                &req.query,
                &passages,
                &listing,
                req.max_tokens,
            )?;
            stage.set_all([
                KeyValue::new(attr::PROMPT_PASSAGES_KEPT, built.kept.len() as i64),
                KeyValue::new(attr::PROMPT_PASSAGES_DROPPED, built.dropped as i64),
                KeyValue::new(attr::PROMPT_TRUNCATED, built.truncated),
                KeyValue::new(attr::GEN_AI_USAGE_INPUT_TOKENS, built.tokens.len() as i64),
            ]);
            Ok(built)
        })?;
        self.prompts
            .replace(&req.query, built.tokens.as_slice().into());
        Ok(built)
    }

    /// Embeds texts for the embeddings endpoint.
    pub async fn embed(
        self: &Arc<Self>,
        texts: Vec<String>,
        faults: Arc<FaultPlan>,
        request: &Arc<Stage>,
    ) -> Result<Vec<Vec<f32>>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(JobKind::Embed, request, move || {
            let mut run = StageRunner::new(&stage, &faults);
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let spec = StageSpec::model(StageKind::Embed, this.embedder.model_id());
            run.run(spec, |stage| Ok(this.embedder.embed(&refs, stage)?))
        })
        .await
    }

    /// Scores passages against a query for the rerank endpoint: their cosine to the query, then
    /// the reranker's scores (the cosines themselves without a reranker).
    pub async fn rerank(
        self: &Arc<Self>,
        query: String,
        passages: Vec<String>,
        faults: Arc<FaultPlan>,
        request: &Arc<Stage>,
    ) -> Result<Vec<f32>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(JobKind::Rerank, request, move || {
            let mut run = StageRunner::new(&stage, &faults);
            let texts: Vec<&str> = passages.iter().map(String::as_str).collect();
            let spec = StageSpec::model(StageKind::Embed, this.embedder.model_id());
            let retrieval = run.run(spec, |stage| {
                let mut all = vec![query.as_str()];
                all.extend_from_slice(&texts);
                let vectors = this.embedder.embed(&all, stage)?;
                Ok(cosines(&vectors[0], &vectors[1..]))
            })?;
            let candidates = Candidates {
                texts: &texts,
                retrieval: &retrieval,
                chunks: None,
                top_n: texts.len(),
            };
            match &this.reranker {
                Some(r) => this.rerank_stage(&mut run, r.as_ref(), &query, &candidates, false),
                None => Ok(retrieval),
            }
        })
        .await
    }

    /// The `rerank` stage over passages and their retrieval scores; with `lookup`, the passages
    /// defining the entry the query names come first ([`lookup`]).
    fn rerank_stage(
        &self,
        run: &mut StageRunner,
        reranker: &dyn Reranker,
        query: &str,
        passages: &Candidates<'_>,
        lookup: bool,
    ) -> Result<Vec<f32>, PipelineError> {
        let capture = telemetry::controls::capture_content();
        let (texts, retrieval) = (passages.texts, passages.retrieval);
        let mut attributes = vec![
            KeyValue::new(attr::GEN_AI_RERANK_CANDIDATE_COUNT, texts.len() as i64),
            KeyValue::new(attr::RERANKER_MODEL_NAME, reranker.model_id().to_string()),
        ];
        if capture {
            attributes.push(KeyValue::new(attr::RERANKER_QUERY, query.to_string()));
        }
        let spec = StageSpec::model(StageKind::Rerank, reranker.model_id()).with(attributes);
        run.run(spec, |stage| {
            let candidates: Vec<Candidate> = texts
                .iter()
                .zip(retrieval)
                .map(|(text, &retrieval_score)| Candidate {
                    text,
                    retrieval_score,
                })
                .collect();
            let mut scores = reranker.score(query, &candidates, stage)?;
            if lookup {
                let raised = lookup::promote(query, texts, &mut scores);
                stage.set(KeyValue::new(attr::RERANK_ENTRIES_LOOKED_UP, raised as i64));
            }
            let reranked = documents::Reranked {
                chunks: passages.chunks,
                texts,
                retrieval,
                scores: &scores,
                top_n: passages.top_n,
                capture,
            };
            stage.set_all(reranked.attributes(&crate::rerank::ranking(&scores)));
            Ok(scores)
        })
    }

    /// Ingests documents (each one durable before the next starts).
    pub async fn ingest(
        self: &Arc<Self>,
        docs: Vec<Document>,
        faults: Arc<FaultPlan>,
        request: &Arc<Stage>,
    ) -> Result<Vec<IngestOutcome>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(JobKind::Ingest, request, move || {
            let mut run = StageRunner::new(&stage, &faults);
            docs.iter()
                .map(|doc| {
                    let spec = StageSpec::new(StageKind::Ingest)
                        .with([KeyValue::new(attr::DOCUMENT_ID, doc.id.clone())]);
                    run.run(spec, |stage| {
                        Ok(crate::ingest::ingest_document(
                            doc,
                            this.embedder.as_ref(),
                            this.store.as_ref(),
                            this.chunker,
                            stage,
                        )?)
                    })
                })
                .collect()
        })
        .await
    }

    async fn run_on_worker<T: Send + 'static>(
        &self,
        kind: JobKind,
        request: &Stage,
        work: impl FnOnce() -> Result<T, PipelineError> + Send + 'static,
    ) -> Result<T, PipelineError> {
        let rx = self.workers.submit(Admission::new(kind), request, work)?;
        rx.await.map_err(|_| PipelineError::WorkerGone)?
    }
}

fn check_deadline(req: &RagRequest, request: &Stage) -> Result<(), PipelineError> {
    if clock::now() >= req.deadline {
        return Err(PipelineError::Timeout(millis(request.elapsed())));
    }
    Ok(())
}

/// Dot products of unit vectors with the query's: their cosine similarity.
pub(crate) fn cosines(query: &[f32], vectors: &[Vec<f32>]) -> Vec<f32> {
    vectors
        .iter()
        .map(|v| v.iter().zip(query).map(|(a, b)| a * b).sum())
        .collect()
}
