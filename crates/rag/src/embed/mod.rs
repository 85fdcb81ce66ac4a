//! Query and passage embedding: the embedder trait and its error type.
//!
//! Embedding is compute: the trait is synchronous and runs on a model-worker thread. An
//! implementation records `tokenize` and `forward` child stages under the `embeddings {model}`
//! stage the caller passes in.

pub mod bert;
pub mod cache;
pub mod cpu_bert;

use telemetry::span::Stage;

#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    #[error("model file: {0}")]
    Load(String),
}

/// A sentence embedder producing unit-length vectors (cosine = dot product).
pub trait Embedder: Send + Sync {
    /// Model name as clients see it, e.g. `all-MiniLM-L6-v2`.
    fn model_id(&self) -> &str;
    fn dimension(&self) -> usize;
    /// Longest input in tokens; longer inputs are truncated.
    fn max_tokens(&self) -> usize;
    /// Tokens `text` takes, without special tokens (used by the chunker).
    fn count_tokens(&self, text: &str) -> Result<usize, EmbedError>;
    /// One vector per text, in order.
    fn embed(&self, texts: &[&str], stage: &Stage) -> Result<Vec<Vec<f32>>, EmbedError>;
}
