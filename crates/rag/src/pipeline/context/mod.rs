//! The context stage: from the reranked passages, the text that goes into the prompt. A small
//! generator answers short extractive questions when its context is short and on point, and a
//! shorter prompt is also a faster prefill, so instead of whole passages the prompt gets the
//! passages' sentences that best match the question, up to a token budget counted with the
//! generator's tokenizer.
//!
//! Each kept sentence stays under its passage (the passage's `title › section` line first, its
//! sentences in their original order), so the prompt's `[n]` markers still attribute every
//! sentence to the source it came from. `passages` keeps whole passages best-first within the
//! budget instead; `off` hands every passage on whole, as the prompt had them before this stage.
//!
//! Entry terms (`--context-terms`): a manual's option and variable lists are entries that
//! begin with what they define (`--depth <depth> Create a shallow clone…`,
//! `core.hooksPath By default…`), and an entry's later sentences do not repeat it. A kept
//! passage's header names the term of the entry its best sentence belongs to
//! (`git-clone(1) › OPTIONS › --depth <depth>`), so the answer can name the option even when
//! the sentence that does is not kept; the small generator often copies the header.
//!
//! Order (`--context-order`): `best-last` lists the passages so that the one holding the
//! best-scoring sentence comes last, nearest the question at the prompt's end; `rank` lists
//! them in rerank order. Either way each keeps its source's `[n]` marker.
//!
//! Scoring (`--context-method`): `dense` is the cosine of the query's vector with each
//! sentence's (one embedder call for all sentences), `lexical` the IDF-weighted overlap of
//! their words, `hybrid` the sum of both after scaling each to [0, 1] over the request's
//! sentences. docs/CONTEXT.md has the measurements the defaults come from.

use super::PipelineArgs;
use super::PipelineError;
use crate::embed::cache::VectorCache;
use crate::embed::Embedder;
use llm::{GenerateError, Generator};
use telemetry::span::Stage;

pub mod kinds;
pub mod passage;
mod scoring;
#[cfg(test)]
mod tests;

pub use kinds::{ContextMethod, ContextMode, ContextOrder};
pub use passage::{entry_term, split_passage, SplitPassage};
pub use scoring::{
    combine, lexical_scores, select_passages, select_sentences, terms, MAX_TERM_TOKENS,
};
use scoring::{term_costs, Unit};

/// A request's context settings, resolved against the server's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContextSettings {
    pub mode: ContextMode,
    pub method: ContextMethod,
    /// Tokens of passage text (headers and sentences, counted with the generator's tokenizer).
    pub budget: usize,
    pub order: ContextOrder,
    /// Headers name the entry term of their passage's best sentence (`sentences` mode).
    pub terms: bool,
    /// A sentence that starts the entry the question names, or belongs to the example it asks
    /// for, scores above every other (`sentences` mode; [`super::lookup`]).
    pub lookup: bool,
}

/// A passage of the context: which reranked passage it came from and its text for the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextPassage {
    /// Index into the reranked passages.
    pub source: usize,
    pub text: String,
    /// How well it answers, for [`ContextOrder::listing`]: the score of its best kept sentence
    /// (whole passages: minus their rank, so the best-ranked is the highest).
    pub best: f32,
}

/// What the stage chose, and the counts its span reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub passages: Vec<ContextPassage>,
    pub sentences_in: usize,
    pub sentences_out: usize,
    /// Sentences whose vectors came from the sentence cache.
    pub sentences_cached: usize,
    pub tokens_in: usize,
    pub tokens_out: usize,
    /// Passages whose header names an entry term, and the tokens those names take (not in
    /// `tokens_out`, which the budget bounds).
    pub terms_named: usize,
    pub term_tokens: usize,
    /// Sentences that start the entry the question names or belong to the example it asks
    /// for, scored above the rest ([`ContextSettings::lookup`]).
    pub entries_looked_up: usize,
}

impl ContextOrder {
    /// The order in which the prompt lists `passages` (indices into them). Ties keep the
    /// better-ranked passage nearer the question.
    pub fn listing(self, passages: &[ContextPassage]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..passages.len()).collect();
        if self == ContextOrder::BestLast {
            order.sort_by(|&a, &b| {
                passages[a]
                    .best
                    .total_cmp(&passages[b].best)
                    .then(b.cmp(&a))
            });
        }
        order
    }
}

/// What a request asked of the context stage, before validation.
#[derive(Debug, Clone, Default)]
pub struct ContextAsked {
    pub mode: Option<String>,
    pub budget: Option<usize>,
    pub method: Option<String>,
    pub order: Option<String>,
    pub terms: Option<bool>,
}

impl ContextSettings {
    /// The server's defaults for a request that keeps `rerank_top_n` passages: the budget is
    /// `--context-budget` tokens per passage, so a request that asks for more passages gets
    /// a longer context (the load generator's context-length gradient relies on this).
    pub fn defaults(args: &PipelineArgs, rerank_top_n: usize) -> ContextSettings {
        ContextSettings {
            mode: args.context,
            method: args.context_method,
            budget: args.context_budget * rerank_top_n.max(1),
            order: args.context_order,
            terms: args.context_terms,
            lookup: args.entry_lookup,
        }
    }

    /// The order in which the prompt lists the stage's `passages`: the settings' order, except
    /// that `off` hands the passages on as they came.
    pub fn listing(&self, passages: &[ContextPassage]) -> Vec<usize> {
        match self.mode {
            ContextMode::Off => ContextOrder::Rank.listing(passages),
            _ => self.order.listing(passages),
        }
    }

    /// A request's settings over the defaults; an error names the field at fault.
    pub fn resolve(
        asked: &ContextAsked,
        args: &PipelineArgs,
        rerank_top_n: usize,
        window: usize,
    ) -> Result<ContextSettings, (&'static str, String)> {
        let mut settings = ContextSettings::defaults(args, rerank_top_n);
        if let Some(m) = &asked.mode {
            settings.mode = ContextMode::parse(m).ok_or_else(|| {
                (
                    "context",
                    format!("must be one of off, sentences, passages; got {m:?}"),
                )
            })?;
        }
        if let Some(m) = &asked.method {
            settings.method = ContextMethod::parse(m).ok_or_else(|| {
                (
                    "context_method",
                    format!("must be one of dense, lexical, hybrid; got {m:?}"),
                )
            })?;
        }
        if let Some(o) = &asked.order {
            settings.order = ContextOrder::parse(o).ok_or_else(|| {
                (
                    "context_order",
                    format!("must be one of rank, best-last; got {o:?}"),
                )
            })?;
            if settings.mode == ContextMode::Off {
                return Err((
                    "context_order",
                    "has no effect with context \"off\" (the passages go to the prompt as \
                     retrieved)"
                        .into(),
                ));
            }
        }
        if let Some(t) = asked.terms {
            if settings.mode != ContextMode::Sentences {
                return Err((
                    "context_terms",
                    format!(
                        "applies to context \"sentences\" only (headers of kept sentences); \
                         context is \"{}\"",
                        settings.mode.as_str()
                    ),
                ));
            }
            settings.terms = t;
        }
        if let Some(b) = asked.budget {
            if !(1..=window).contains(&b) {
                return Err((
                    "context_budget",
                    format!("must be between 1 and {window} (context window), got {b}"),
                ));
            }
            settings.budget = b;
        }
        Ok(settings)
    }
}

/// Each text's vector from `cache`, the missing ones embedded in one embedder call (its spans
/// under `stage`) and cached; also how many were cached.
fn cached_vectors(
    texts: &[&str],
    embedder: &dyn Embedder,
    cache: &VectorCache,
    stage: &Stage,
) -> Result<(Vec<Vec<f32>>, usize), PipelineError> {
    let mut found = cache.get_all(texts);
    let missing: Vec<usize> = (0..texts.len()).filter(|&i| found[i].is_none()).collect();
    let cached = texts.len() - missing.len();
    if !missing.is_empty() {
        let batch: Vec<&str> = missing.iter().map(|&i| texts[i]).collect();
        let vectors = embedder.embed(&batch, stage)?;
        for (&i, v) in missing.iter().zip(vectors) {
            cache.put(texts[i], v.clone());
            found[i] = Some(v);
        }
    }
    Ok((found.into_iter().flatten().collect(), cached))
}

/// What the context stage reads besides the passages: the models, and the cache of sentence
/// vectors.
pub struct Models<'a> {
    pub generator: &'a dyn Generator,
    pub embedder: &'a dyn Embedder,
    pub sentences: &'a VectorCache,
}

/// Chooses the context for `question` from the reranked passages `texts`, counting tokens with
/// the generator's tokenizer and, for the dense and hybrid methods, scoring every sentence by
/// its vector: from the sentence cache, the rest embedded in one embedder call (its spans go
/// under `stage`).
pub fn select(
    settings: ContextSettings,
    question: &str,
    query_vector: &[f32],
    texts: &[&str],
    models: &Models<'_>,
    stage: &Stage,
) -> Result<Selection, PipelineError> {
    let generator = models.generator;
    let count = |t: &str| generator.tokenizer().count_tokens(t);
    match settings.mode {
        ContextMode::Off | ContextMode::Passages => {
            let tokens = texts
                .iter()
                .map(|t| count(t.trim()))
                .collect::<Result<Vec<_>, _>>()?;
            let budget = match settings.mode {
                ContextMode::Off => usize::MAX,
                _ => settings.budget,
            };
            Ok(select_passages(texts, &tokens, budget))
        }
        ContextMode::Sentences => {
            let split: Vec<SplitPassage> = texts.iter().map(|t| split_passage(t)).collect();
            let header_tokens = split
                .iter()
                .map(|p| p.header.as_deref().map_or(Ok(0), count))
                .collect::<Result<Vec<_>, _>>()?;
            let flat: Vec<(usize, usize, &str)> = split
                .iter()
                .enumerate()
                .flat_map(|(p, s)| {
                    s.sentences
                        .iter()
                        .enumerate()
                        .map(move |(i, t)| (p, i, t.as_str()))
                })
                .collect();
            let sentence_texts: Vec<&str> = flat.iter().map(|&(_, _, t)| t).collect();
            let lexical = lexical_scores(question, &sentence_texts);
            let mut sentences_cached = 0;
            let dense = if settings.method.needs_vectors() && !sentence_texts.is_empty() {
                let (vectors, cached) =
                    cached_vectors(&sentence_texts, models.embedder, models.sentences, stage)?;
                sentences_cached = cached;
                Some(super::cosines(query_vector, &vectors))
            } else {
                None
            };
            let mut scores = combine(settings.method, dense.as_deref(), &lexical);
            let entries_looked_up = if settings.lookup {
                super::lookup::promote_sentences(question, &split, &mut scores)
            } else {
                0
            };
            let term_tokens = split
                .iter()
                .zip(&header_tokens)
                .map(|(p, &header)| term_costs(p, header, settings.terms, &count))
                .collect::<Result<Vec<_>, _>>()?;
            let units = flat
                .iter()
                .zip(scores)
                .map(|(&(passage, index, text), score)| {
                    Ok(Unit {
                        passage,
                        index,
                        tokens: count(text)?,
                        score,
                        term_tokens: term_tokens[passage][index],
                    })
                })
                .collect::<Result<Vec<_>, GenerateError>>()?;
            Ok(Selection {
                sentences_cached,
                entries_looked_up,
                ..select_sentences(&split, &header_tokens, &units, settings.budget)
            })
        }
    }
}
