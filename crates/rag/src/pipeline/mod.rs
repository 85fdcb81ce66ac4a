//! One RAG request, top to bottom: embed the query → retrieve candidates → rerank → select the
//! context (the sentences or passages the prompt gets, `context`) → build the prompt →
//! generate, streaming tokens as they come. Each step is a stage (a span on the shared clock)
//! under the request's span, run by the one [`StageRunner`], and the same durations are
//! returned to the client as `timings`. The whole path runs on a model-worker thread, after one
//! `queue` stage. The other routes (embeddings, rerank, ingest) run their stages the same way.

pub mod context;
pub mod events;
pub mod lookup;
pub mod overlap;
mod plain;
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
use crate::fault::{FaultPlan, FaultStage};
use crate::ingest::chunk::ChunkerConfig;
use crate::ingest::{Document, IngestOutcome};
use crate::prompt::{self, Prompt};
use crate::rerank::{Candidate, Reranker};
use crate::retrieve::{ScoredChunk, VectorStore};
use crate::worker::{Admission, JobKind, Warmth, Workers};
use context::{ContextMode, ContextPassage};
use llm::{Flow, GenerateRequest, Generated, Generator, Piece};
use telemetry::clock::{self, millis};
use telemetry::metrics::metrics;
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

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

    /// The RAG path itself, on a worker thread.
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
        let (vector, cache) = self.embed_query(&mut run, req)?;
        let hits = self.retrieve(&mut run, req, &vector)?;
        let retrieved_at = std::time::Instant::now();
        let mut ranked = self.rank(&mut run, &req.query, hits)?;
        ranked.truncate(req.rerank_top_n);
        let context = self.select_context(&mut run, req, &vector, &ranked)?;
        // The sources are the passages the context kept, in the order of the prompt's markers.
        let kept: Vec<Source> = context.iter().map(|c| ranked[c.source].clone()).collect();
        if let Some(tx) = events {
            let _ = tx.send(Event::Sources(kept.clone()));
        }
        check_deadline(req, request)?;

        let texts: Vec<&str> = context.iter().map(|c| c.text.as_str()).collect();
        let listing = req.context.listing(&context);
        let built = self.build_prompt(&mut run, req, &texts, &listing)?;
        self.prompts
            .replace(&req.query, built.tokens.as_slice().into());
        let sources: Vec<Source> = built.kept.iter().map(|&i| kept[i].clone()).collect();
        if let Some(warm) = warm {
            warm.finish();
        }
        let gap = retrieved_at.elapsed();
        let s = &req.sampling;
        // What the prompt holds of the context: passages it dropped or cut to fit are not
        // there for the answer to copy.
        let favoured = if s.reads_context() {
            self.generator
                .tokenizer()
                .tokenize(&built.texts.join("\n"), false)?
        } else {
            Vec::new()
        };
        // The template's own labels end an answer: a small model that starts a new
        // "Question:" is past the end of its answer.
        let stop: Vec<String> = req
            .stop
            .iter()
            .cloned()
            .chain(prompt::ANSWER_ENDS.iter().map(|s| s.to_string()))
            .collect();
        let generated = self.generate(
            &mut run,
            req,
            &built.tokens,
            &favoured,
            &stop,
            req.end_at_paragraph,
            events,
        )?;
        let window = self.generator.context_window();
        record_quality(request, &Quality::of(&generated[0], &sources, gap, window));
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
            Ok(hits)
        })
    }

    /// 3. Candidates reordered by the reranker's scores (retrieval order without one).
    fn rank(
        &self,
        run: &mut StageRunner,
        query: &str,
        hits: Vec<ScoredChunk>,
    ) -> Result<Vec<Source>, PipelineError> {
        let scores = match &self.reranker {
            Some(reranker) if !hits.is_empty() => {
                let texts: Vec<&str> = hits.iter().map(|h| h.chunk.text.as_str()).collect();
                let retrieval: Vec<f32> = hits.iter().map(|h| h.score).collect();
                let lookup = self.defaults.entry_lookup;
                self.rerank_stage(run, reranker.as_ref(), query, &texts, &retrieval, lookup)?
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

    /// 5. The prompt within the context window.
    fn build_prompt(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        passages: &[&str],
        listing: &[usize],
    ) -> Result<Prompt, PipelineError> {
        run.run(StageSpec::new(StageKind::Prompt), |stage| {
            let built = prompt::build_listed(
                self.generator.as_ref(),
                self.defaults.prompt_template,
                &req.history,
                &req.query,
                passages,
                listing,
                req.max_tokens,
            )?;
            stage.set_all([
                KeyValue::new(attr::PROMPT_PASSAGES_KEPT, built.kept.len() as i64),
                KeyValue::new(attr::PROMPT_PASSAGES_DROPPED, built.dropped as i64),
                KeyValue::new(attr::PROMPT_TRUNCATED, built.truncated),
                KeyValue::new(attr::GEN_AI_USAGE_INPUT_TOKENS, built.tokens.len() as i64),
            ]);
            Ok(built)
        })
    }

    /// 6. The answer, one per choice (generated side by side), each piece of text streamed
    ///    as it completes; ending at its first finished paragraph when `end_at_paragraph`.
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        prompt: &[u32],
        context_tokens: &[u32],
        stop: &[String],
        end_at_paragraph: bool,
        events: Option<&EventSender>,
    ) -> Result<Vec<Generated>, PipelineError> {
        let model = self.generator.model_id();
        let s = &req.sampling;
        let mut attributes = s.attributes();
        attributes.extend([
            KeyValue::new(attr::GEN_AI_REQUEST_MAX_TOKENS, req.max_tokens as i64),
            KeyValue::new(attr::GEN_AI_REQUEST_STREAM, events.is_some()),
        ]);
        if !req.stop.is_empty() {
            let stops = req.stop.iter().map(|s| s.clone().into()).collect();
            attributes.push(KeyValue::new(
                attr::GEN_AI_REQUEST_STOP_SEQUENCES,
                opentelemetry::Value::Array(opentelemetry::Array::String(stops)),
            ));
        }
        if req.choices != 1 {
            attributes.push(KeyValue::new(
                attr::GEN_AI_REQUEST_CHOICE_COUNT,
                req.choices as i64,
            ));
        }
        let started = run.request().started();
        let spec = StageSpec::model(StageKind::Generate, model).with(attributes);
        run.run(spec, |stage| {
            let token_delay = req.faults.token_delay();
            let delayed_tokens = std::sync::atomic::AtomicUsize::new(0);
            // An injected mid-answer failure fires at its piece of each choice.
            let mid_answer = req.faults.mid_answer();
            let pieces: Vec<_> = (0..req.choices.max(1))
                .map(|_| std::sync::atomic::AtomicUsize::new(0))
                .collect();
            let stalled_ms = std::sync::atomic::AtomicU64::new(0);
            let on_token = |choice: usize, piece: Piece<'_>| {
                if let Some(fault) = mid_answer {
                    let n = pieces[choice].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if n + 1 >= fault.at {
                        return fault.fire(stage);
                    }
                }
                if let Some(d) = token_delay {
                    std::thread::sleep(d);
                    delayed_tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let streamed = || Streamed {
                    choice,
                    text: piece.text.to_string(),
                    logprobs: piece.logprobs.to_vec(),
                };
                match events.map(|tx| tx.send(Event::Token(streamed()))) {
                    Some(Err(SendError::Closed)) => Flow::Stop,
                    Some(Err(SendError::Stalled(waited))) => {
                        let ms = (waited.as_millis() as u64).max(1);
                        stalled_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
                        Flow::Stop
                    }
                    _ => Flow::Continue,
                }
            };
            let requests = (0..req.choices.max(1))
                .map(|i| GenerateRequest {
                    prompt,
                    max_tokens: req.max_tokens,
                    sampling: llm::Sampling {
                        seed: s.seed.wrapping_add(i as u64),
                        ..*s
                    },
                    token_trace: self.defaults.token_trace,
                    deadline: Some(req.deadline),
                    ignore_eos: false,
                    stop,
                    end_at_paragraph,
                    logprobs: req.logprobs,
                    context_tokens,
                })
                .collect();
            let generated =
                llm::generate_choices(self.generator.as_ref(), requests, stage, &on_token)
                    .map_err(|e| match e {
                        llm::GenerateError::Aborted => {
                            PipelineError::Injected(crate::fault::Injected(FaultStage::Chat))
                        }
                        e => e.into(),
                    })?;
            let stalled = stalled_ms.load(std::sync::atomic::Ordering::Relaxed);
            if stalled > 0 {
                // The client stopped reading: say so on the span, since the finish reason
                // (`cancelled`) is the same as for a client that went away.
                stage.set(KeyValue::new(attr::STREAM_STALLED_MS, stalled as i64));
                metrics().stream_stalls.add(1, &[]);
            }
            if let Some(d) = token_delay {
                let delayed = delayed_tokens.load(std::sync::atomic::Ordering::Relaxed);
                stage.set_all([
                    KeyValue::new(attr::FAULT_TOKEN_DELAY_MS, millis(d)),
                    KeyValue::new(attr::FAULT_DELAYED_TOKENS, delayed as i64),
                ]);
                crate::fault::count(FaultStage::Chat, "token_delay");
            }
            let finishes: Vec<&str> = generated.iter().map(|g| g.finish.as_str()).collect();
            let output: usize = generated.iter().map(|g| g.tokens.len()).sum();
            stage.set_all([
                KeyValue::new(attr::GEN_AI_RESPONSE_MODEL, model.to_string()),
                KeyValue::new(attr::GEN_AI_RESPONSE_FINISH_REASONS, finishes.join(",")),
                KeyValue::new(
                    attr::GEN_AI_USAGE_INPUT_TOKENS,
                    generated[0].prompt_tokens as i64,
                ),
                KeyValue::new(attr::GEN_AI_USAGE_OUTPUT_TOKENS, output as i64),
            ]);
            if let Some(ttft) = time_to_first_token(&generated[0], started) {
                stage.set(KeyValue::new(
                    attr::GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
                    ttft / 1e3,
                ));
            }
            if self.defaults.capture_content {
                stage.set(KeyValue::new(attr::ANSWER_TEXT, generated[0].text.clone()));
            }
            Ok(generated)
        })
    }

    /// 7. The answer with its timings (the first choice's); generation's metrics recorded.
    fn finish(
        &self,
        run: StageRunner,
        sources: Vec<Source>,
        generated: Vec<Generated>,
    ) -> RagAnswer {
        let request = run.request();
        let first = &generated[0];
        let mut timings = run.timings();
        timings.record(StageKind::Prefill, millis(first.prefill));
        timings.record(StageKind::Decode, millis(first.decode));
        timings.ttft_ms = time_to_first_token(first, request.started()).unwrap_or_default();
        timings.total_ms = millis(request.elapsed());
        record_generation(&timings, first);
        for g in &generated[1..] {
            metrics().tokens.add(
                g.tokens.len() as u64,
                &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, "output")],
            );
        }
        let prompt_tokens = first.prompt_tokens;
        // The prompt is counted once however many choices share it.
        let cached_tokens = first.cached_tokens;
        let completion_tokens = generated.iter().map(|g| g.tokens.len()).sum();
        crate::tenant::charge(prompt_tokens + completion_tokens);
        let choices: Vec<Choice> = generated
            .into_iter()
            .map(|g| Choice {
                text: g.text.trim().to_string(),
                finish_reason: g.finish,
                completion_tokens: g.tokens.len(),
                logprobs: g.logprobs,
                end_logprob: g.end_logprob,
            })
            .collect();
        let first = &choices[0];
        RagAnswer {
            answer: first.text.clone(),
            sources,
            usage: Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
                prompt_tokens_details: PromptTokensDetails { cached_tokens },
            },
            timings,
            cache: CacheUse::default(),
            finish_reason: first.finish_reason,
            logprobs: first.logprobs.clone(),
            choices,
            context: Vec::new(),
            finished_at: clock::now(),
        }
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
            match &this.reranker {
                Some(r) => {
                    this.rerank_stage(&mut run, r.as_ref(), &query, &texts, &retrieval, false)
                }
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
        texts: &[&str],
        retrieval: &[f32],
        lookup: bool,
    ) -> Result<Vec<f32>, PipelineError> {
        let spec = StageSpec::model(StageKind::Rerank, reranker.model_id()).with([KeyValue::new(
            attr::GEN_AI_RERANK_CANDIDATE_COUNT,
            texts.len() as i64,
        )]);
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

/// Milliseconds from the request's start to the first generated token.
fn time_to_first_token(generated: &Generated, started: std::time::Instant) -> Option<f64> {
    generated
        .first_token_at
        .map(|t| millis(t.saturating_duration_since(started)))
}

/// Dot products of unit vectors with the query's: their cosine similarity.
pub(crate) fn cosines(query: &[f32], vectors: &[Vec<f32>]) -> Vec<f32> {
    vectors
        .iter()
        .map(|v| v.iter().zip(query).map(|(a, b)| a * b).sum())
        .collect()
}

/// Generation's metrics: its two stages, time to first token, time per output token, tokens.
/// What one RAG answer was made of (issue #17's per-request metrics).
#[derive(Debug, Clone, PartialEq)]
struct Quality {
    output_tokens: usize,
    /// Prompt plus answer tokens over the context window.
    context_fill: f64,
    /// Prompt tokens from the prefix cache over all prompt tokens.
    prefix_hit_ratio: f64,
    /// End of retrieval to the start of generation (rerank, context, prompt).
    retrieval_gap: std::time::Duration,
    /// Mean retrieval score (cosine similarity) of the passages the prompt kept; none kept: none.
    context_relevance: Option<f64>,
    /// Mean log-probability of the answer's tokens; only when the request asked for logprobs.
    answer_confidence: Option<f64>,
}

impl Quality {
    fn of(
        g: &Generated,
        kept: &[Source],
        retrieval_gap: std::time::Duration,
        window: usize,
    ) -> Quality {
        let mean = |v: &mut dyn Iterator<Item = f64>| {
            let (sum, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
            (n > 0).then(|| sum / n as f64)
        };
        Quality {
            output_tokens: g.tokens.len(),
            context_fill: (g.prompt_tokens + g.tokens.len()) as f64 / window.max(1) as f64,
            prefix_hit_ratio: g.cached_tokens as f64 / g.prompt_tokens.max(1) as f64,
            retrieval_gap,
            context_relevance: mean(&mut kept.iter().map(|s| f64::from(s.retrieval_score))),
            answer_confidence: mean(&mut g.logprobs.iter().map(|l| f64::from(l.logprob))),
        }
    }
}

/// Writes the quality figures on the request span and into their histograms.
fn record_quality(request: &Stage, q: &Quality) {
    let m = &metrics().quality;
    let gap_ms = millis(q.retrieval_gap);
    request.set_all([
        KeyValue::new(attr::QUALITY_OUTPUT_TOKENS, q.output_tokens as i64),
        KeyValue::new(attr::QUALITY_CONTEXT_FILL_RATIO, q.context_fill),
        KeyValue::new(attr::QUALITY_PREFIX_CACHE_HIT_RATIO, q.prefix_hit_ratio),
        KeyValue::new(attr::QUALITY_RETRIEVAL_TO_GENERATION_GAP_MS, gap_ms),
    ]);
    m.output_tokens.record(q.output_tokens as f64, &[]);
    m.context_fill.record(q.context_fill, &[]);
    m.prefix_hit_ratio.record(q.prefix_hit_ratio, &[]);
    m.retrieval_gap.record(q.retrieval_gap.as_secs_f64(), &[]);
    if let Some(r) = q.context_relevance {
        request.set(KeyValue::new(attr::QUALITY_CONTEXT_RELEVANCE, r));
        m.context_relevance.record(r, &[]);
    }
    if let Some(c) = q.answer_confidence {
        request.set(KeyValue::new(attr::QUALITY_ANSWER_CONFIDENCE, c));
        m.answer_confidence.record(c, &[]);
    }
}

fn record_generation(t: &Timings, generated: &Generated) {
    let m = metrics();
    m.stage(StageKind::Prefill, generated.prefill);
    m.stage(StageKind::Decode, generated.decode);
    if generated.first_token_at.is_some() {
        m.time_to_first_token.record(t.ttft_ms / 1e3, &[]);
    }
    if generated.tokens.len() > 1 {
        let per_token = t.decode_ms / 1e3 / (generated.tokens.len() - 1) as f64;
        m.time_per_output_token.record(per_token, &[]);
    }
    m.tokens.add(
        generated.prompt_tokens as u64,
        &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, "input")],
    );
    m.tokens.add(
        generated.tokens.len() as u64,
        &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, "output")],
    );
}
