//! What one RAG answer was made of, on its request span and in histograms: output tokens, how
//! full the context window was, the prefix cache's share of the prompt, the gap from retrieval
//! to generation, the kept passages' relevance and the answer's confidence.

use opentelemetry::KeyValue;

use super::Source;
use llm::Generated;
use telemetry::clock::millis;
use telemetry::metrics::metrics;
use telemetry::names::attr;
use telemetry::span::Stage;

/// What one RAG answer was made of (issue #17's per-request metrics).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Quality {
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
    pub(super) fn of(
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
pub(super) fn record(request: &Stage, q: &Quality) {
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
