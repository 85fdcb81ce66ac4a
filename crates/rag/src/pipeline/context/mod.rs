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

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::PipelineArgs;
use super::PipelineError;
use crate::embed::cache::VectorCache;
use crate::embed::Embedder;
use crate::ingest::chunk::sentences;
use llm::{GenerateError, Generator};
use telemetry::span::Stage;

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

/// One passage split for selection: its first line (the chunk's `title › section`) and the
/// sentences of the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPassage {
    pub header: Option<String>,
    pub sentences: Vec<String>,
}

impl SplitPassage {
    /// For each sentence, the term of the entry it belongs to: the leading option or variable
    /// of the nearest sentence at or before it that starts with one ([`entry_term`]). Entries
    /// that began in an earlier chunk have none here.
    pub fn entry_terms(&self) -> Vec<Option<&str>> {
        let mut current = None;
        self.sentences
            .iter()
            .map(|s| {
                current = entry_term(s).or(current);
                current
            })
            .collect()
    }
}

/// The option(s) or configuration variable a manual entry starts with, if `sentence` starts
/// one: a run of options with their argument placeholders (`-p --patch`,
/// `--depth <depth>`, `--[no-]verify`), or a dotted lowercase-led variable
/// (`core.hooksPath`, `mergetool.<tool>.path`). Prose, including a sentence that merely
/// mentions an option later on, has none.
pub fn entry_term(sentence: &str) -> Option<&str> {
    let mut end = 0;
    for (i, word) in sentence.split_whitespace().enumerate() {
        let option = word.starts_with('-')
            && word
                .trim_start_matches('-')
                .starts_with(|c: char| c.is_alphanumeric() || c == '[');
        let placeholder = i > 0 && (word.starts_with('<') || word.starts_with('['));
        let variable = i == 0 && is_variable(word.trim_end_matches([',', ':']));
        if !(option || placeholder || variable) {
            break;
        }
        // The word's place: its first occurrence after the previous word's end.
        let start = sentence[end..].find(word).map_or(end, |at| end + at);
        end = start + word.len();
    }
    let term = sentence[..end].trim().trim_end_matches([',', ':']);
    (!term.is_empty()).then_some(term)
}

/// `section.key`, `section.<name>.key`: at least two dot-separated parts, the first all
/// lowercase ASCII letters, none empty, and no sentence-ending dot.
fn is_variable(word: &str) -> bool {
    let parts: Vec<&str> = word.split('.').collect();
    parts.len() >= 2
        && parts.iter().all(|p| !p.is_empty())
        && parts[0].chars().all(|c| c.is_ascii_lowercase())
}

/// Splits a chunk's text: a first line without sentence punctuation is its header (the chunker
/// starts every chunk with `title › section`), the rest goes through the chunker's sentence
/// splitter, so the sentences are the units the chunk was packed from.
pub fn split_passage(text: &str) -> SplitPassage {
    let text = text.trim();
    let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
    let is_header = !rest.trim().is_empty()
        && !first.trim_end().ends_with(['.', '!', '?'])
        && first.chars().count() <= 120;
    if is_header {
        SplitPassage {
            header: Some(first.trim().to_string()),
            sentences: sentences(rest),
        }
    } else {
        SplitPassage {
            header: None,
            sentences: sentences(text),
        }
    }
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

/// Word-like terms of a text, lowercased: runs of letters, digits, `-` and `_` (so `--depth`
/// and `git-stash` stay whole), without the most common English words.
pub fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_'))
        .map(|w| w.trim_matches('-').to_lowercase())
        .filter(|w| w.len() >= 2 && !STOPWORDS.contains(&w.as_str()))
        .collect()
}

const STOPWORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "can", "do", "does", "for", "from",
    "how", "i", "if", "in", "into", "is", "it", "its", "me", "my", "no", "not", "of", "on", "or",
    "so", "that", "the", "their", "then", "there", "this", "to", "was", "what", "when", "which",
    "while", "who", "why", "will", "with", "you", "your", "git", "instead", "also", "one",
];

/// Two terms match when equal or when both are at least five characters long and share their
/// first five (a crude stem: `rename`, `renamed`, `renames`).
fn same_term(a: &str, b: &str) -> bool {
    a == b || (a.len() >= 5 && b.len() >= 5 && a.as_bytes()[..5] == b.as_bytes()[..5])
}

/// IDF-weighted overlap of each sentence's terms with the question's, the IDF taken over these
/// sentences (a word in every sentence says nothing about which one answers).
pub fn lexical_scores(question: &str, sentences: &[&str]) -> Vec<f32> {
    let query: Vec<String> = {
        let mut seen = HashSet::new();
        terms(question)
            .into_iter()
            .filter(|t| seen.insert(t.clone()))
            .collect()
    };
    let per_sentence: Vec<Vec<String>> = sentences.iter().map(|s| terms(s)).collect();
    let n = sentences.len().max(1) as f32;
    let mut df: HashMap<&str, usize> = HashMap::new();
    for q in &query {
        let count = per_sentence
            .iter()
            .filter(|words| words.iter().any(|w| same_term(q, w)))
            .count();
        df.insert(q.as_str(), count);
    }
    per_sentence
        .iter()
        .map(|words| {
            query
                .iter()
                .filter(|q| words.iter().any(|w| same_term(q, w)))
                .map(|q| (1.0 + n / df[q.as_str()].max(1) as f32).ln())
                .sum()
        })
        .collect()
}

/// Scales scores to [0, 1] (all equal: all 0).
fn unit_scale(scores: &[f32]) -> Vec<f32> {
    let (lo, hi) = scores
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &s| {
            (lo.min(s), hi.max(s))
        });
    // Also covers an empty list and NaN scores (no ordering between them).
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return vec![0.0; scores.len()];
    }
    scores.iter().map(|s| (s - lo) / (hi - lo)).collect()
}

/// Combines the scores the method asks for: `dense` (one per sentence) may be absent for the
/// lexical method.
pub fn combine(method: ContextMethod, dense: Option<&[f32]>, lexical: &[f32]) -> Vec<f32> {
    match (method, dense) {
        (ContextMethod::Lexical, _) | (_, None) => lexical.to_vec(),
        (ContextMethod::Dense, Some(d)) => d.to_vec(),
        (ContextMethod::Hybrid, Some(d)) => unit_scale(d)
            .iter()
            .zip(unit_scale(lexical))
            .map(|(a, b)| a + b)
            .collect(),
    }
}

/// Tokens the prompt template adds per passage (its `[n] ` marker and blank line), counted
/// against the budget so that many short passages cost what they do.
const PASSAGE_OVERHEAD: usize = 4;

/// Whole passages, best-first, while they fit the budget (the first always).
pub fn select_passages(texts: &[&str], tokens: &[usize], budget: usize) -> Selection {
    let mut used = 0;
    let mut passages = Vec::new();
    for (i, (&text, &n)) in texts.iter().zip(tokens).enumerate() {
        if !passages.is_empty() && used + n + PASSAGE_OVERHEAD > budget {
            continue;
        }
        used += n + PASSAGE_OVERHEAD;
        passages.push(ContextPassage {
            source: i,
            text: text.trim().to_string(),
            best: -(i as f32),
        });
    }
    let tokens_out = passages.iter().map(|p| tokens[p.source]).sum();
    Selection {
        sentences_in: 0,
        sentences_out: 0,
        sentences_cached: 0,
        tokens_in: tokens.iter().sum(),
        tokens_out,
        passages,
        terms_named: 0,
        term_tokens: 0,
        entries_looked_up: 0,
    }
}

/// A sentence to choose, with its place and cost.
#[derive(Debug, Clone, Copy)]
pub struct Unit {
    pub passage: usize,
    pub index: usize,
    pub tokens: usize,
    pub score: f32,
    /// The tokens ` › term` adds to its passage's header if this, the passage's best kept
    /// sentence, has its entry term named; 0 without a term, with terms off, or with a term
    /// over [`MAX_TERM_TOKENS`]. Not charged against the budget (see [`select_sentences`]).
    pub term_tokens: usize,
}

/// The best sentences within the budget: taken by score (ties: the better-ranked passage,
/// then the earlier sentence), each passage's header and marker paid for when its first
/// sentence comes in, a sentence that does not fit skipped for smaller ones behind it. The
/// best sentence is always kept. Output groups sentences under their passage, passages in
/// rank order, sentences in text order. The first sentence a passage takes is its best, and
/// its entry term, when it has a cost ([`Unit::term_tokens`]), is named in the header.
///
/// The budget bounds headers and sentences; a named term comes on top (at most
/// [`MAX_TERM_TOKENS`] a passage) and is counted apart. Charged against the budget it cost
/// a sentence often enough to give back what it won (docs/CONTEXT.md).
pub fn select_sentences(
    split: &[SplitPassage],
    header_tokens: &[usize],
    units: &[Unit],
    budget: usize,
) -> Selection {
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by(|&a, &b| {
        let (ua, ub) = (&units[a], &units[b]);
        ub.score
            .total_cmp(&ua.score)
            .then(ua.passage.cmp(&ub.passage))
            .then(ua.index.cmp(&ub.index))
    });
    // Each passage's first (best) kept sentence.
    let mut opener: Vec<Option<usize>> = vec![None; split.len()];
    let mut kept = vec![false; units.len()];
    let mut used = 0;
    for (taken, &u) in order.iter().enumerate() {
        let unit = &units[u];
        let open_cost = match opener[unit.passage] {
            Some(_) => 0,
            None => header_tokens[unit.passage] + PASSAGE_OVERHEAD,
        };
        let cost = unit.tokens + open_cost;
        if taken > 0 && used + cost > budget {
            continue;
        }
        used += cost;
        opener[unit.passage].get_or_insert(u);
        kept[u] = true;
    }
    let mut passages = Vec::new();
    let mut sentences_out = 0;
    let mut tokens_out = 0;
    let mut terms_named = 0;
    let mut term_tokens = 0;
    for (p, passage) in split.iter().enumerate() {
        let mut chosen: Vec<(usize, usize, f32)> = units
            .iter()
            .zip(&kept)
            .filter(|(u, &k)| k && u.passage == p)
            .map(|(u, _)| (u.index, u.tokens, u.score))
            .collect();
        if chosen.is_empty() {
            continue;
        }
        let best = chosen
            .iter()
            .map(|&(_, _, score)| score)
            .fold(f32::NEG_INFINITY, f32::max);
        chosen.sort_unstable_by_key(|&(index, _, _)| index);
        sentences_out += chosen.len();
        tokens_out += header_tokens[p] + chosen.iter().map(|(_, t, _)| t).sum::<usize>();
        let body: Vec<&str> = chosen
            .iter()
            .map(|&(i, _, _)| passage.sentences[i].as_str())
            .collect();
        let term = opener[p]
            .map(|u| &units[u])
            .filter(|u| u.term_tokens > 0)
            .and_then(|u| Some((passage.entry_terms()[u.index]?, u.term_tokens)));
        let text = match (&passage.header, term) {
            (Some(h), Some((term, cost))) => {
                terms_named += 1;
                term_tokens += cost;
                format!("{h}{TERM_SEPARATOR}{term}\n{}", body.join(" "))
            }
            (Some(h), None) => format!("{h}\n{}", body.join(" ")),
            (None, _) => body.join(" "),
        };
        passages.push(ContextPassage {
            source: p,
            text,
            best,
        });
    }
    Selection {
        passages,
        sentences_in: units.len(),
        sentences_out,
        sentences_cached: 0,
        tokens_in: header_tokens.iter().sum::<usize>()
            + units.iter().map(|u| u.tokens).sum::<usize>(),
        tokens_out,
        terms_named,
        term_tokens,
        entries_looked_up: 0,
    }
}

/// What naming each sentence's entry term would add to `passage`'s header of `header`
/// tokens ([`Unit::term_tokens`]); each term is counted once.
fn term_costs(
    passage: &SplitPassage,
    header: usize,
    terms: bool,
    count: &dyn Fn(&str) -> Result<usize, GenerateError>,
) -> Result<Vec<usize>, GenerateError> {
    let Some(h) = passage.header.as_deref().filter(|_| terms) else {
        return Ok(vec![0; passage.sentences.len()]);
    };
    let mut last: Option<(&str, usize)> = None;
    passage
        .entry_terms()
        .into_iter()
        .map(|term| {
            let Some(term) = term else { return Ok(0) };
            let cost = match last {
                Some((t, cost)) if t == term => cost,
                _ => count(&format!("{h}{TERM_SEPARATOR}{term}"))?.saturating_sub(header),
            };
            last = Some((term, cost));
            Ok(if cost <= MAX_TERM_TOKENS { cost } else { 0 })
        })
        .collect()
}

/// Joins a header and the entry term it names, as the chunker joins title and section.
const TERM_SEPARATOR: &str = " › ";

/// The longest entry term a header names, in generator tokens with its separator.
pub const MAX_TERM_TOKENS: usize = 16;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_splits_into_its_header_and_sentences() {
        let s = split_passage(
            "git-clone(1) › OPTIONS\n--depth <depth> Create a shallow clone. It is truncated to \
             the given number of commits. --bare Make a bare repository.",
        );
        assert_eq!(s.header.as_deref(), Some("git-clone(1) › OPTIONS"));
        assert_eq!(
            s.sentences,
            [
                "--depth <depth> Create a shallow clone.",
                "It is truncated to the given number of commits.",
                "--bare Make a bare repository."
            ]
        );
        // A first line that is a sentence of its own is not a header.
        let plain = split_passage("Zorbia is a country.\nIts capital is Quenta.");
        assert_eq!(plain.header, None);
        assert_eq!(
            plain.sentences,
            ["Zorbia is a country.", "Its capital is Quenta."]
        );
    }

    #[test]
    fn terms_keep_options_whole_and_drop_common_words() {
        assert_eq!(
            terms("How do I use --depth with git-clone's shallow clones?"),
            ["use", "depth", "git-clone", "shallow", "clones"]
        );
    }

    #[test]
    fn lexical_scores_favour_rare_question_words() {
        let sentences = [
            "The repository is cloned.",
            "A shallow clone has a truncated history.",
            "The repository has a history.",
        ];
        let s = lexical_scores("shallow clone of a repository", &sentences);
        assert!(s[1] > s[0] && s[1] > s[2], "{s:?}");
        assert_eq!(lexical_scores("unrelated words", &sentences), [0.0; 3]);
    }

    #[test]
    fn hybrid_scores_add_scaled_parts() {
        let dense = [0.2, 0.4, 0.3];
        let lexical = [0.0, 0.0, 2.0];
        let h = combine(ContextMethod::Hybrid, Some(&dense), &lexical);
        for (got, want) in h.iter().zip([0.0, 1.0, 1.5]) {
            assert!((got - want).abs() < 1e-6, "{h:?}");
        }
        assert_eq!(combine(ContextMethod::Dense, Some(&dense), &lexical), dense);
        assert_eq!(
            combine(ContextMethod::Lexical, Some(&dense), &lexical),
            lexical
        );
    }

    fn unit(passage: usize, index: usize, tokens: usize, score: f32) -> Unit {
        Unit {
            passage,
            index,
            tokens,
            score,
            term_tokens: 0,
        }
    }

    #[test]
    fn an_entry_term_is_the_leading_option_run_or_variable() {
        let cases = [
            (
                "--depth <depth> Create a shallow clone.",
                Some("--depth <depth>"),
            ),
            ("-p --patch Interactively choose hunks.", Some("-p --patch")),
            ("--[no-]verify Bypass the hooks.", Some("--[no-]verify")),
            (
                "--ignore-revs-file <file> Ignore revisions.",
                Some("--ignore-revs-file <file>"),
            ),
            (
                "core.hooksPath By default Git looks in hooks.",
                Some("core.hooksPath"),
            ),
            (
                "mergetool.<tool>.path: Override the path.",
                Some("mergetool.<tool>.path"),
            ),
            // Prose, a sentence that mentions an option later, a dash and a number.
            ("With --no-ff, create a merge commit.", None),
            ("The default is 2.weeks.ago.", None),
            ("- a list item.", None),
            ("-1 Show one commit.", Some("-1")),
            ("e.g. this is prose.", None),
            ("", None),
        ];
        for (sentence, want) in cases {
            assert_eq!(entry_term(sentence), want, "{sentence:?}");
        }
    }

    #[test]
    fn a_sentence_belongs_to_the_entry_above_it() {
        let p = split_passage(
            "git-commit(1) › OPTIONS\nThe first line is prose. --amend Replace the tip of the \
             current branch. The recorded tree is prepared as usual. --no-edit Keep the message.",
        );
        assert_eq!(
            p.entry_terms(),
            [None, Some("--amend"), Some("--amend"), Some("--no-edit")]
        );
    }

    #[test]
    fn a_header_names_the_entry_term_of_its_best_sentence_on_top_of_the_budget() {
        let split = vec![split_passage(
            "git-commit(1) › OPTIONS\n--amend Replace the tip. The tree is prepared as usual. \
             --no-edit Keep the message.",
        )];
        let units = [
            Unit {
                term_tokens: 3,
                ..unit(0, 0, 10, 0.2)
            },
            // The best sentence says no option itself; its entry's term is --amend.
            Unit {
                term_tokens: 3,
                ..unit(0, 1, 10, 0.9)
            },
            Unit {
                term_tokens: 4,
                ..unit(0, 2, 10, 0.5)
            },
        ];
        // Header 5 + marker 4 + 10 = 19, then 10 more is 29: the term is not charged.
        let s = select_sentences(&split, &[5], &units, 29);
        assert_eq!(
            s.passages[0].text,
            "git-commit(1) › OPTIONS › --amend\n\
             The tree is prepared as usual. --no-edit Keep the message."
        );
        assert_eq!((s.sentences_out, s.tokens_out), (2, 25));
        assert_eq!((s.terms_named, s.term_tokens), (1, 3));
        // Without a term cost (terms off), the header is the chunk's own.
        let off: Vec<Unit> = units
            .iter()
            .map(|u| Unit {
                term_tokens: 0,
                ..*u
            })
            .collect();
        let s = select_sentences(&split, &[5], &off, 29);
        assert_eq!(
            s.passages[0].text,
            "git-commit(1) › OPTIONS\nThe tree is prepared as usual. --no-edit Keep the message."
        );
        assert_eq!((s.sentences_out, s.tokens_out), (2, 25));
        assert_eq!((s.terms_named, s.term_tokens), (0, 0));
    }

    #[test]
    fn sentences_are_chosen_by_score_within_the_budget_and_grouped_by_passage() {
        let split = vec![
            SplitPassage {
                header: Some("a(1) › X".into()),
                sentences: vec!["A0.".into(), "A1.".into(), "A2.".into()],
            },
            SplitPassage {
                header: None,
                sentences: vec!["B0.".into(), "B1.".into()],
            },
        ];
        let headers = [3, 0];
        let units = [
            unit(0, 0, 10, 0.1),
            unit(0, 1, 10, 0.5),
            unit(0, 2, 10, 0.9),
            unit(1, 0, 10, 0.8),
            unit(1, 1, 50, 0.7),
        ];
        // 0.9 (10 + header 3 + marker 4), 0.8 (10 + 4), 0.7 does not fit, 0.5 (10): 41.
        let s = select_sentences(&split, &headers, &units, 45);
        assert_eq!(
            s.passages,
            [
                ContextPassage {
                    source: 0,
                    text: "a(1) › X\nA1. A2.".into(),
                    best: 0.9,
                },
                ContextPassage {
                    source: 1,
                    text: "B0.".into(),
                    best: 0.8,
                },
            ]
        );
        assert_eq!((s.sentences_in, s.sentences_out), (5, 3));
        assert_eq!((s.tokens_in, s.tokens_out), (93, 33));
        // The best sentence is kept even when alone it is over the budget.
        let tiny = select_sentences(&split, &headers, &units, 1);
        assert_eq!(tiny.sentences_out, 1);
        assert_eq!(tiny.passages[0].text, "a(1) › X\nA2.");
    }

    #[test]
    fn whole_passages_fill_the_budget_best_first() {
        let texts = ["first", "second", "third"];
        let s = select_passages(&texts, &[50, 100, 30], 90);
        let kept: Vec<usize> = s.passages.iter().map(|p| p.source).collect();
        assert_eq!(kept, [0, 2]);
        assert_eq!((s.tokens_in, s.tokens_out), (180, 80));
        // The first passage is kept whatever the budget.
        assert_eq!(select_passages(&texts, &[50, 100, 30], 1).passages.len(), 1);
    }

    #[test]
    fn best_last_lists_the_passage_with_the_best_sentence_nearest_the_question() {
        let passage = |source, best| ContextPassage {
            source,
            text: String::new(),
            best,
        };
        let passages = [passage(0, 0.6), passage(1, 0.9), passage(2, 0.4)];
        assert_eq!(ContextOrder::Rank.listing(&passages), [0, 1, 2]);
        assert_eq!(ContextOrder::BestLast.listing(&passages), [2, 0, 1]);
        // A tie keeps the better-ranked passage nearer the question.
        let tied = [passage(0, 0.5), passage(1, 0.5)];
        assert_eq!(ContextOrder::BestLast.listing(&tied), [1, 0]);
        // Whole passages: the best-ranked last.
        let whole = select_passages(&["a", "b", "c"], &[1, 1, 1], 100);
        assert_eq!(ContextOrder::BestLast.listing(&whole.passages), [2, 1, 0]);
    }

    #[test]
    fn modes_parse_from_their_names() {
        for m in [
            ContextMode::Off,
            ContextMode::Sentences,
            ContextMode::Passages,
        ] {
            assert_eq!(ContextMode::parse(m.as_str()), Some(m));
        }
        assert_eq!(ContextMode::parse("all"), None);
        for o in [ContextOrder::Rank, ContextOrder::BestLast] {
            assert_eq!(ContextOrder::parse(o.as_str()), Some(o));
        }
        assert_eq!(ContextOrder::parse("best_last"), None);
    }
}
