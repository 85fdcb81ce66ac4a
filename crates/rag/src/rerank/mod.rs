//! Reranking: re-scores the retrieved candidates against the query before the prompt is built.
//!
//! Two backends: [`fusion`], the offline default, fuses the dense retrieval rank with a lexical
//! (BM25) rank over the candidates; [`cross_encoder`] runs a BERT cross-encoder (query and
//! passage in one input, a classification head on top) loaded from a path or a hub id.

pub mod cross_encoder;
pub mod fusion;

use telemetry::span::Stage;

#[derive(Debug, thiserror::Error)]
pub enum RerankError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    #[error("model file: {0}")]
    Load(String),
}

/// One candidate passage and the score retrieval gave it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub text: &'a str,
    pub retrieval_score: f32,
}

pub trait Reranker: Send + Sync {
    /// Name as clients and spans see it.
    fn model_id(&self) -> &str;

    /// A relevance score per candidate, in input order; higher is more relevant. Candidates
    /// arrive in retrieval order.
    fn score(
        &self,
        query: &str,
        candidates: &[Candidate<'_>],
        stage: &Stage,
    ) -> Result<Vec<f32>, RerankError>;
}

/// Indices of `scores` from best to worst (stable: ties keep input order).
pub fn ranking(scores: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranking_is_descending_and_stable() {
        assert_eq!(super::ranking(&[0.1, 0.9, 0.5, 0.9]), [1, 3, 2, 0]);
    }
}
