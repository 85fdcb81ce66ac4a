//! ragscope-llm, the generator layer: a causal language model from a GGUF file, run by our own
//! CPU kernels (or candle's CUDA ops), with a KV cache per request, a prefix cache shared by
//! requests, batched decode steps and failure snapshots.
//!
//! A generation prefills the prompt once (from the longest cached prefix on), then decodes one
//! token per step against a KV cache owned by that request. The implementation records `prefill`
//! and `decode` child stages under the `chat {model}` stage the caller hands it, and one event
//! (or span) per token. [`llama::Llama`] is the implementation, split by role (its module doc
//! lists the parts). A failed generation leaves a snapshot that `ragscope replay` re-runs
//! ([`snapshot`]).
//!
//! Besides the generator: [`kernels`], the CPU compute kernels the BERT embedder shares, and
//! [`cpu`], the instruction-set level they run at;
//! [`device`], the one place that picks the CPU or a GPU; [`models`], the model manifest and
//! fetching and verifying weights.

pub mod cpu;
pub(crate) mod cpu_decode;
mod cpu_prefill;
pub mod device;
mod forward;
mod generation;
mod generator;
mod host_kv;
pub mod kernels;
mod kv_cache;
pub mod llama;
pub mod models;
mod prefix_cache;
pub mod probe;
mod sampler;
pub mod schedule;
mod score;
pub mod settings;
pub mod snapshot;
pub mod speculate;
mod stop;
mod template;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;
mod warm;
mod weights;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use telemetry::span::Stage;

pub use host_kv::KvDtype;
pub use prefix_cache::DEFAULT_MB as PREFIX_CACHE_DEFAULT_MB;
pub use sampler::{Sampling, SamplingArgs};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// Most alternatives per position [`GenerateRequest::logprobs`] may ask for (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability and the most likely alternatives at its position,
/// from the log-softmax of the model's raw logits: before penalties, temperature and top-p,
/// so they are the model's distribution (what OpenAI returns), not the sampler's.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// The token's bytes (a token may hold part of a UTF-8 character).
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The `k` most likely tokens, most likely first.
    pub top: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub id: u32,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// Serialized as `{token, id, logprob, bytes, top_logprobs: [{token, id, logprob, bytes}]}`,
/// OpenAI's shape plus the token id; `token` is the bytes as text (U+FFFD for a partial
/// character).
impl Serialize for TokenLogprob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(5))?;
        m.serialize_entry("token", &String::from_utf8_lossy(&self.bytes))?;
        m.serialize_entry("id", &self.id)?;
        m.serialize_entry("logprob", &self.logprob)?;
        m.serialize_entry("bytes", &self.bytes)?;
        m.serialize_entry("top_logprobs", &self.top)?;
        m.end()
    }
}

impl Serialize for TopLogprob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("token", &String::from_utf8_lossy(&self.bytes))?;
        m.serialize_entry("id", &self.id)?;
        m.serialize_entry("logprob", &self.logprob)?;
        m.serialize_entry("bytes", &self.bytes)?;
        m.end()
    }
}

/// What the generator hands its consumer each time text completes: the text, and the
/// log-probabilities of the tokens whose text ends in it (empty unless asked for).
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    pub text: &'a str,
    pub logprobs: &'a [TokenLogprob],
}

/// How decode steps show up in the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenTrace {
    /// One `token` event per generated token on the `decode` span (index, token id, time).
    #[default]
    Events,
    /// One `decode_step` child span per token.
    Spans,
    /// Only the `decode` span's totals.
    Off,
}

pub struct GenerateRequest<'a> {
    pub prompt: &'a [u32],
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub token_trace: TokenTrace,
    /// Generation stops with [`FinishReason::Timeout`] once this passes.
    pub deadline: Option<Instant>,
    /// Never pick an end-of-sequence token (as llama.cpp's `--ignore-eos`), so exactly
    /// `max_tokens` are generated: benchmarks compare equal amounts of work.
    pub ignore_eos: bool,
    /// Stop strings: generation ends with [`FinishReason::Stop`] where the text first contains
    /// one (across token boundaries), and neither it nor anything after it is in the text.
    pub stop: &'a [String],
    /// Also end, as at a stop string, at the first finished paragraph: a blank line after a
    /// sentence's end or a closed code block, outside code (a RAG answer's natural end).
    pub end_at_paragraph: bool,
    /// `Some(k)`: each generated token's log-probability and its `k` (at most
    /// [`MAX_TOP_LOGPROBS`]) most likely alternatives.
    pub logprobs: Option<usize>,
    /// The tokens of the prompt's context passages, which [`Sampling::context_bias`] favours,
    /// the copy bias continues and the n-gram block allows as often as they hold an n-gram
    /// (empty: none).
    pub context_tokens: &'a [u32],
}

impl<'a> GenerateRequest<'a> {
    /// What the benchmarks measure: greedy, no token trace, exactly `max_tokens` tokens
    /// (end-of-sequence never picked), nothing else asked.
    pub fn benchmark(prompt: &'a [u32], max_tokens: usize) -> GenerateRequest<'a> {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: Sampling::default(),
            token_trace: TokenTrace::Off,
            deadline: None,
            ignore_eos: true,
            stop: &[],
            end_at_paragraph: false,
            logprobs: None,
            context_tokens: &[],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached (or the context window filled).
    Length,
    /// The consumer asked to stop (client went away).
    Cancelled,
    Timeout,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Timeout => "timeout",
        }
    }
}

/// What the token callback tells the generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
    /// Fail the generation with [`GenerateError::Aborted`] (an injected mid-answer fault).
    Fail,
}

#[derive(Debug, Clone)]
pub struct Generated {
    /// The streamed pieces, concatenated.
    pub text: String,
    /// Every generated token, a stop string's too (they were computed; usage counts them).
    pub tokens: Vec<u32>,
    /// With [`GenerateRequest::logprobs`]: one per token whose text is (at least partly) in
    /// `text`, in order, as streamed with the pieces.
    pub logprobs: Vec<TokenLogprob>,
    /// With logprobs, when the model ended by producing its end-of-sequence token: that token's
    /// (not in `text` or `tokens`). Legacy completions list it last, where a loglikelihood
    /// client such as lm-eval expects one generated entry.
    pub end_logprob: Option<TokenLogprob>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache, not computed.
    pub cached_tokens: usize,
    pub prefill: Duration,
    pub decode: Duration,
    /// When the first token was produced, on the shared clock.
    pub first_token_at: Option<Instant>,
    /// Speculative drafts verified and accepted ([`speculate`]).
    pub speculation: speculate::Tally,
}

/// What [`Generator::warm`] prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warmed {
    /// Head tokens now in the prefix cache (its whole blocks).
    pub head_tokens: usize,
    /// Of those, the ones that were cached already.
    pub cached_tokens: usize,
    /// Positions computed.
    pub computed_tokens: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("prompt has {prompt} tokens; with max_tokens {max_tokens} it exceeds the context window of {window}")]
    ContextOverflow {
        prompt: usize,
        max_tokens: usize,
        window: usize,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    #[error("model file: {0}")]
    Load(String),
    /// The consumer answered [`Flow::Fail`].
    #[error("the generation was failed by its consumer")]
    Aborted,
}

/// A generator's tokenizer as prompts and clients use it: text to ids and back, the chat
/// template, and the vocabulary.
pub trait ChatTokenizer: Send + Sync {
    fn count_tokens(&self, text: &str) -> Result<usize, GenerateError>;

    /// Renders the chat template (with the assistant generation prompt) and tokenizes it.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, GenerateError>;

    /// The tokenizer as clients use it (`/tokenize`): with `parse_special`, control-token text
    /// such as `<|im_start|>` becomes that control token, else it stays plain text.
    fn tokenize(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, GenerateError>;

    /// Token ids back to text, control tokens written as their text. Ids must be below
    /// [`ChatTokenizer::vocab_size`].
    fn detokenize(&self, tokens: &[u32]) -> Result<String, GenerateError>;

    /// The raw bytes of one token's text (a control token's own text); a piece of a UTF-8
    /// character when a character spans tokens.
    fn token_bytes(&self, token: u32) -> Vec<u8>;

    /// Number of token ids.
    fn vocab_size(&self) -> usize;
}

/// The prefix cache as the pipeline uses it: filled ahead of a prompt, and asked how much of
/// one it holds.
pub trait PrefixReuse: Send + Sync {
    /// Prefills `head`, the start of a prompt still being built, into the prefix cache and
    /// generates nothing, so the prompt's own prefill starts from a hit (the pipeline's
    /// retrieval–generation overlap). `proceed` is asked once the prefill turn is held: `false`
    /// (the request's own prefill got there first, or the request failed) skips the work.
    /// `None`: nothing was prefilled (a head shorter than a block, skipped).
    fn warm(
        &self,
        head: &[u32],
        stage: &Stage,
        proceed: &dyn Fn() -> bool,
    ) -> Result<Option<Warmed>, GenerateError>;

    /// How many leading tokens of `prompt` a prefill would find in the cache now; uses nothing
    /// and counts nothing.
    fn cached(&self, prompt: &[u32]) -> usize;
}

/// A causal language model with a chat template: its tokenizer and prefix cache are
/// components of their own, so a stand-in implements only what it changes.
pub trait Generator: Send + Sync {
    /// Model name as clients see it, e.g. `SmolLM2-135M-Instruct`.
    fn model_id(&self) -> &str;

    /// Maximum prompt + generated tokens per request.
    fn context_window(&self) -> usize;

    fn tokenizer(&self) -> &dyn ChatTokenizer;

    /// The prefix cache, when there is one (`--prefix-cache-mb` above 0).
    fn prefix_cache(&self) -> Option<&dyn PrefixReuse> {
        None
    }

    /// Drafts as `speculation` says from the next request on; false when this generator never
    /// drafts.
    fn set_speculation(&self, _speculation: speculate::Speculation) -> bool {
        false
    }

    /// Scores a prompt: entry `i` is the log-probability of `prompt[i + 1]` after
    /// `prompt[..=i]`, with the `top` most likely tokens at that position (at most
    /// [`MAX_TOP_LOGPROBS`]). Records a `prefill` stage under `stage`.
    fn score(
        &self,
        prompt: &[u32],
        top: usize,
        stage: &Stage,
    ) -> Result<Vec<TokenLogprob>, GenerateError>;

    /// Generates up to `req.max_tokens` tokens. `on_token` receives each new piece of text as
    /// soon as it is complete UTF-8 and cannot be the start of a stop string, and may stop the
    /// generation.
    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<Generated, GenerateError>;
}

/// Runs one request per choice at once, each on its own thread (the first on the caller's), so
/// a model that batches decode steps runs the choices' steps together; `on_token` receives each
/// piece with the index of its choice. Every choice ends before this returns; the first error
/// is returned.
pub fn generate_choices(
    generator: &dyn Generator,
    reqs: Vec<GenerateRequest<'_>>,
    stage: &Stage,
    on_token: &(dyn Fn(usize, Piece<'_>) -> Flow + Sync),
) -> Result<Vec<Generated>, GenerateError> {
    let mut reqs = reqs.into_iter();
    let Some(first) = reqs.next() else {
        return Ok(Vec::new());
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = reqs
            .enumerate()
            .map(|(i, req)| {
                scope.spawn(move || generator.generate(req, stage, &mut |p| on_token(i + 1, p)))
            })
            .collect();
        let mut all = vec![generator.generate(first, stage, &mut |p| on_token(0, p))];
        all.extend(others.into_iter().map(|h| {
            h.join().unwrap_or_else(|_| {
                Err(GenerateError::Model(candle_core::Error::Msg(
                    "a choice's generation panicked".into(),
                )))
            })
        }));
        all.into_iter().collect()
    })
}
