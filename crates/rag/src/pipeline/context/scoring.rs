//! Choosing the context: sentence scores (lexical, and combined with the dense ones), and the
//! selection of sentences or whole passages within the token budget.

use std::collections::{HashMap, HashSet};

use super::kinds::ContextMethod;
use super::passage::SplitPassage;
use super::{ContextPassage, Selection};
use llm::GenerateError;

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
pub(super) fn term_costs(
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
