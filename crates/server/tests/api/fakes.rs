//! Stand-in stages for tests about telemetry and serving, not about models: they take a fixed,
//! short time so a thousand requests run in seconds.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llm::schedule::{Batcher, StepEngine, StepInput, StepTrace};
use llm::{
    ChatMessage, ChatTokenizer, FinishReason, Flow, GenerateError, GenerateRequest, Generated,
    Generator, Piece, TokenLogprob, TopLogprob,
};
use opentelemetry::KeyValue;
use rag::embed::{EmbedError, Embedder};
use rag::retrieve::lexical::Terms;
use rag::retrieve::{Chunk, Filter, ScoredChunk, StoreError, StoreInfo, VectorStore};
use telemetry::{clock, span::Stage};

/// Busy-waits: sleeping would hand the core to other tests and blur the timings.
fn spin(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

pub struct FakeEmbedder;

impl Embedder for FakeEmbedder {
    fn model_id(&self) -> &str {
        "fake-embedder"
    }
    fn dimension(&self) -> usize {
        4
    }
    fn max_tokens(&self) -> usize {
        256
    }
    fn count_tokens(&self, text: &str) -> Result<usize, EmbedError> {
        Ok(text.split_whitespace().count())
    }
    fn embed(&self, texts: &[&str], stage: &Stage) -> Result<Vec<Vec<f32>>, EmbedError> {
        let t = stage.child("tokenize");
        spin(Duration::from_micros(200));
        t.end();
        let f = stage.child("forward");
        spin(Duration::from_millis(1));
        f.end();
        Ok(texts.iter().map(|_| vec![0.5; 4]).collect())
    }
}

#[derive(Default)]
pub struct FakeStore {
    chunks: Mutex<Vec<Chunk>>,
}

impl VectorStore for FakeStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            system: "fake",
            collection: "fake".into(),
            index: "plain",
            points: self.chunks.lock().unwrap().len(),
            server: None,
            cluster: None,
        }
    }
    fn upsert(
        &self,
        chunks: &[Chunk],
        _vectors: &[Vec<f32>],
        _stage: &Stage,
    ) -> Result<(), StoreError> {
        self.chunks.lock().unwrap().extend_from_slice(chunks);
        Ok(())
    }
    fn search(
        &self,
        _v: &[f32],
        top_k: usize,
        _f: Option<&Filter>,
        _stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        spin(Duration::from_micros(300));
        let chunks = self.chunks.lock().unwrap();
        Ok(chunks
            .iter()
            .take(top_k)
            .map(|c| ScoredChunk {
                chunk: c.clone(),
                score: 0.5,
            })
            .collect())
    }
    /// The fake keeps no term index: retrieval through it is dense-only.
    fn search_lexical(
        &self,
        _terms: &Terms,
        _v: &[f32],
        _top_k: usize,
        _f: Option<&Filter>,
        _stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        Ok(Vec::new())
    }
    fn existing(&self, ids: &[String], _stage: &Stage) -> Result<HashSet<String>, StoreError> {
        let chunks = self.chunks.lock().unwrap();
        Ok(ids
            .iter()
            .filter(|id| chunks.iter().any(|c| &c.id == *id))
            .cloned()
            .collect())
    }
    fn delete_document(&self, doc_id: &str, _stage: &Stage) -> Result<usize, StoreError> {
        let mut chunks = self.chunks.lock().unwrap();
        let before = chunks.len();
        chunks.retain(|c| c.doc_id != doc_id);
        Ok(before - chunks.len())
    }
    fn delete_stale(
        &self,
        doc_id: &str,
        keep: &[String],
        _stage: &Stage,
    ) -> Result<usize, StoreError> {
        let mut chunks = self.chunks.lock().unwrap();
        let before = chunks.len();
        chunks.retain(|c| c.doc_id != doc_id || keep.contains(&c.id));
        Ok(before - chunks.len())
    }
    fn count(&self) -> Result<usize, StoreError> {
        Ok(self.chunks.lock().unwrap().len())
    }
    fn build_index(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Generates `tokens` words, one per `token_us` µs, after a 2 ms "prefill".
pub struct FakeGenerator {
    pub tokens: usize,
    pub token_us: u64,
}

impl FakeGenerator {
    pub fn new(tokens: usize) -> Self {
        FakeGenerator {
            tokens,
            token_us: 300,
        }
    }
}

/// One token per word: a word's id is its length, and id `t` reads back as ` w{t}`.
pub struct WordTokenizer;

impl ChatTokenizer for WordTokenizer {
    fn count_tokens(&self, text: &str) -> Result<usize, GenerateError> {
        Ok(text.split_whitespace().count())
    }
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, GenerateError> {
        let words: usize = messages
            .iter()
            .map(|m| m.content.split_whitespace().count() + 4)
            .sum();
        Ok(vec![7; words])
    }
    fn tokenize(&self, text: &str, _parse_special: bool) -> Result<Vec<u32>, GenerateError> {
        Ok(text.split_whitespace().map(|w| w.len() as u32).collect())
    }
    fn detokenize(&self, tokens: &[u32]) -> Result<String, GenerateError> {
        Ok(tokens.iter().map(|&t| format!(" w{t}")).collect())
    }
    fn token_bytes(&self, token: u32) -> Vec<u8> {
        format!(" w{token}").into_bytes()
    }
    fn vocab_size(&self) -> usize {
        1024
    }
}

impl Generator for FakeGenerator {
    fn model_id(&self) -> &str {
        "fake-generator"
    }
    fn context_window(&self) -> usize {
        4096
    }
    fn tokenizer(&self) -> &dyn ChatTokenizer {
        &WordTokenizer
    }
    /// Every token gets probability 1/2, its only alternative itself.
    fn score(
        &self,
        prompt: &[u32],
        _top: usize,
        _stage: &Stage,
    ) -> Result<Vec<TokenLogprob>, GenerateError> {
        Ok(prompt
            .iter()
            .skip(1)
            .map(|&id| TokenLogprob {
                id,
                bytes: WordTokenizer.token_bytes(id),
                logprob: -std::f32::consts::LN_2,
                top: vec![TopLogprob {
                    id,
                    bytes: WordTokenizer.token_bytes(id),
                    logprob: -std::f32::consts::LN_2,
                }],
            })
            .collect())
    }
    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<Generated, GenerateError> {
        let prefill = stage.child("prefill");
        spin(Duration::from_millis(2));
        let prefill_took = prefill.end();
        let decode = stage.child("decode");
        let mut text = String::new();
        let mut tokens = Vec::new();
        let mut first = None;
        let mut finish = FinishReason::Length;
        for i in 0..self.tokens.min(req.max_tokens) {
            spin(Duration::from_micros(self.token_us));
            let now = clock::now();
            first.get_or_insert(now);
            decode.event_at(
                "token",
                now,
                vec![KeyValue::new("gen_ai.token.index", i as i64)],
            );
            tokens.push(i as u32);
            let piece = format!(" w{i}");
            text.push_str(&piece);
            let delivered = Piece {
                text: &piece,
                logprobs: &[],
            };
            if on_token(delivered) == Flow::Stop {
                finish = FinishReason::Cancelled;
                break;
            }
        }
        Ok(Generated {
            text,
            tokens,
            logprobs: Vec::new(),
            end_logprob: None,
            finish,
            prompt_tokens: req.prompt.len(),
            cached_tokens: 0,
            prefill: prefill_took,
            decode: decode.end(),
            first_token_at: first,
            speculation: Default::default(),
        })
    }
}

/// A store whose every call fails as an unreachable server does.
pub struct DownStore;

impl VectorStore for DownStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            system: "fake",
            collection: "down".into(),
            index: "plain",
            points: 0,
            server: None,
            cluster: None,
        }
    }
    fn upsert(&self, _: &[Chunk], _: &[Vec<f32>], _: &Stage) -> Result<(), StoreError> {
        Err(StoreError::Unavailable("test store is down".into()))
    }
    fn search(
        &self,
        _: &[f32],
        _: usize,
        _: Option<&Filter>,
        _: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        Err(StoreError::Unavailable("test store is down".into()))
    }
    fn search_lexical(
        &self,
        _: &Terms,
        _: &[f32],
        _: usize,
        _: Option<&Filter>,
        _: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        Err(StoreError::Unavailable("test store is down".into()))
    }
    fn existing(&self, _: &[String], _: &Stage) -> Result<HashSet<String>, StoreError> {
        Err(StoreError::Unavailable("test store is down".into()))
    }
    fn delete_document(&self, _: &str, _: &Stage) -> Result<usize, StoreError> {
        Err(StoreError::Unavailable("test store is down".into()))
    }
    fn delete_stale(&self, _: &str, _: &[String], _: &Stage) -> Result<usize, StoreError> {
        Err(StoreError::Unavailable("test store is down".into()))
    }
    fn count(&self) -> Result<usize, StoreError> {
        Ok(0)
    }
    fn build_index(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A decode step that busy-waits `base` plus `per_seq` for each sequence in it: the stand-in
/// for the CPU decoder behind a real decode batcher. Counts its steps and the time inside them.
pub struct FakeStep {
    pub base: Duration,
    pub per_seq: Duration,
    pub steps: AtomicU64,
    pub busy_ns: AtomicU64,
}

impl StepEngine for FakeStep {
    type Seq = ();
    fn vocab(&self) -> usize {
        4
    }
    fn check(&self, _: &(), _pos: usize, _tokens: &[u32]) -> candle_core::Result<()> {
        Ok(())
    }
    fn step(&self, seqs: &mut [StepInput<'_, ()>], logits: &mut [f32]) -> candle_core::Result<()> {
        let started = Instant::now();
        spin(self.base + self.per_seq * seqs.len() as u32);
        logits.fill(0.0);
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.busy_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// [`FakeGenerator`]'s words, each decode step taken through a real decode batcher over
/// [`FakeStep`], so requests decoding at the same time share steps as on the CPU model.
pub struct BatchedFakeGenerator {
    words: FakeGenerator,
    pub engine: Arc<FakeStep>,
    batcher: Batcher<FakeStep>,
}

impl BatchedFakeGenerator {
    pub fn new(tokens: usize, trace: StepTrace) -> Self {
        let engine = Arc::new(FakeStep {
            base: Duration::from_micros(400),
            per_seq: Duration::from_micros(100),
            steps: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
        });
        BatchedFakeGenerator {
            words: FakeGenerator::new(tokens),
            batcher: Batcher::new(engine.clone(), trace),
            engine,
        }
    }
}

impl Generator for BatchedFakeGenerator {
    fn model_id(&self) -> &str {
        self.words.model_id()
    }
    fn context_window(&self) -> usize {
        self.words.context_window()
    }
    fn tokenizer(&self) -> &dyn ChatTokenizer {
        self.words.tokenizer()
    }
    fn score(
        &self,
        prompt: &[u32],
        top: usize,
        stage: &Stage,
    ) -> Result<Vec<TokenLogprob>, GenerateError> {
        self.words.score(prompt, top, stage)
    }
    /// The first token comes from the prefill, every later one from a batched step.
    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<Generated, GenerateError> {
        let prefill = stage.child("prefill");
        spin(Duration::from_millis(2));
        let prefill_took = prefill.end();
        let decode = stage.child("decode");
        let mut session = self.batcher.session(&decode);
        let (mut text, mut tokens, mut logits) = (String::new(), Vec::new(), Vec::new());
        let mut first = None;
        for i in 0..self.words.tokens.min(req.max_tokens) {
            if i > 0 {
                session
                    .step(&mut (), req.prompt.len() + i, &[i as u32], &mut logits)
                    .map_err(GenerateError::Model)?;
            }
            first.get_or_insert(clock::now());
            tokens.push(i as u32);
            let piece = format!(" w{i}");
            text.push_str(&piece);
            on_token(Piece {
                text: &piece,
                logprobs: &[],
            });
        }
        session.finish(&decode);
        Ok(Generated {
            text,
            tokens,
            logprobs: Vec::new(),
            end_logprob: None,
            finish: FinishReason::Length,
            prompt_tokens: req.prompt.len(),
            cached_tokens: 0,
            prefill: prefill_took,
            decode: decode.end(),
            first_token_at: first,
            speculation: Default::default(),
        })
    }
}
