//! The context stage's choices as values: what it does with the passages, how it scores
//! sentences, and the order the prompt lists passages in. The settings name them, so they sit
//! apart from the stage.

use serde::{Deserialize, Serialize};

/// What the context stage does with the reranked passages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContextMode {
    /// Every passage whole, no budget (the prompt trims to the context window as before).
    Off,
    /// The best-scoring sentences of the passages within the budget.
    #[default]
    Sentences,
    /// Whole passages, best-first, within the budget (at least one).
    Passages,
}

impl ContextMode {
    pub const fn as_str(self) -> &'static str {
        match self {
            ContextMode::Off => "off",
            ContextMode::Sentences => "sentences",
            ContextMode::Passages => "passages",
        }
    }

    /// Parses a request's `context` field.
    pub fn parse(s: &str) -> Option<ContextMode> {
        [
            ContextMode::Off,
            ContextMode::Sentences,
            ContextMode::Passages,
        ]
        .into_iter()
        .find(|m| m.as_str() == s)
    }
}

/// How sentences are scored against the question.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContextMethod {
    /// Cosine of the embedder's sentence vectors with the query's.
    Dense,
    /// IDF-weighted word overlap with the question.
    Lexical,
    /// Dense plus lexical, each scaled to [0, 1] over the request's sentences.
    #[default]
    Hybrid,
}

impl ContextMethod {
    pub const fn as_str(self) -> &'static str {
        match self {
            ContextMethod::Dense => "dense",
            ContextMethod::Lexical => "lexical",
            ContextMethod::Hybrid => "hybrid",
        }
    }

    pub const fn needs_vectors(self) -> bool {
        matches!(self, ContextMethod::Dense | ContextMethod::Hybrid)
    }
}

/// In what order the prompt lists the context's passages. Every passage keeps the marker of
/// its source (`[n]` for the answer's `n`-th source) whatever its place in the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContextOrder {
    /// Rerank order: the best-ranked passage first.
    Rank,
    /// The passage holding the best-scoring sentence last, nearest the question, the others
    /// before it from the least relevant up (whole passages: the best-ranked last). The small
    /// generator copies the passage nearest the question more often than any other, so this
    /// is the one it should copy (docs/CONTEXT.md).
    #[default]
    BestLast,
}

impl ContextOrder {
    pub const fn as_str(self) -> &'static str {
        match self {
            ContextOrder::Rank => "rank",
            ContextOrder::BestLast => "best-last",
        }
    }

    /// Parses a request's `context_order` field.
    pub fn parse(s: &str) -> Option<ContextOrder> {
        [ContextOrder::Rank, ContextOrder::BestLast]
            .into_iter()
            .find(|o| o.as_str() == s)
    }
}

impl ContextMethod {
    /// Parses a request's `context_method` field.
    pub fn parse(s: &str) -> Option<ContextMethod> {
        [
            ContextMethod::Dense,
            ContextMethod::Lexical,
            ContextMethod::Hybrid,
        ]
        .into_iter()
        .find(|m| m.as_str() == s)
    }
}
