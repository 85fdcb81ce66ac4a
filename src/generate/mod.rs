//! Answer generation: the generator trait, sampling settings and what a generation returns.
//!
//! A generation prefills the whole prompt once, then decodes one token per step against a KV
//! cache owned by that request. The implementation records `prefill` and `decode` child stages
//! under the `chat {model}` stage the pipeline hands it, and one event (or span) per token.
//! [`llama::Llama`] is the implementation, split by role (its module doc lists the parts).

pub(crate) mod cpu_decode;
mod forward;
mod generation;
pub mod kernels;
mod kv_cache;
pub mod llama;
mod sampler;
mod schedule;
mod score;
mod template;
#[cfg(test)]
mod testing;
pub mod tokenizer;
mod weights;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::telemetry::span::Stage;

pub use score::{logprobs_at, TokenLogprob, MAX_TOP_LOGPROBS};

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

/// How the next token is chosen. `temperature <= 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: None,
            seed: 0,
        }
    }
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token.
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
}

#[derive(Debug, Clone)]
pub struct Generated {
    pub text: String,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub decode: Duration,
    /// When the first token was produced, on the shared clock.
    pub first_token_at: Option<Instant>,
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
}

/// A causal language model with a chat template.
pub trait Generator: Send + Sync {
    /// Model name as clients see it, e.g. `SmolLM2-135M-Instruct`.
    fn model_id(&self) -> &str;

    /// Maximum prompt + generated tokens per request.
    fn context_window(&self) -> usize;

    fn count_tokens(&self, text: &str) -> Result<usize, GenerateError>;

    /// Renders the chat template (with the assistant generation prompt) and tokenizes it.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, GenerateError>;

    /// The tokenizer as clients use it (`/tokenize`): with `parse_special`, control-token text
    /// such as `<|im_start|>` becomes that control token, else it stays plain text.
    fn tokenize(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, GenerateError>;

    /// Token ids back to text, control tokens written as their text. Ids must be below
    /// [`Generator::vocab_size`].
    fn detokenize(&self, tokens: &[u32]) -> Result<String, GenerateError>;

    /// The raw bytes of one token's text (a control token's own text); a piece of a UTF-8
    /// character when a character spans tokens.
    fn token_bytes(&self, token: u32) -> Vec<u8>;

    /// Number of token ids.
    fn vocab_size(&self) -> usize;

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
    /// soon as it is complete UTF-8, and may stop the generation.
    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(&str) -> Flow,
    ) -> Result<Generated, GenerateError>;
}
