//! Hit and miss, per cache: the server says per request whether its query-embedding cache
//! answered (`done.cache.query_embedding`) and how many prompt tokens came from its prefix KV
//! cache (`usage.prompt_tokens_details.cached_tokens`). This splits TTFT by hit and miss for
//! each cache, and names the stage whose server-side time grows most on a miss: where a cold
//! request's extra latency comes from. It also splits by what the query mix drew (hot, cold,
//! no-match), which is what the client intended, against what the caches did.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::{QueryKind, RequestRecord};
use measure::stats::{percentile, Percentiles};

/// The caches a request can hit: its query's vector, its context's sentence vectors, its
/// prompt's prefix KV, and its whole prompt (the prefix cache held all of it: no prefill).
pub const QUERY_EMBEDDING: &str = "query_embedding";
pub const SENTENCE_VECTORS: &str = "sentence_vectors";
pub const PREFIX_KV: &str = "prefix_kv";
pub const WHOLE_PROMPT: &str = "whole_prompt";

/// Server timing keys that sum other stages (not a stage of their own).
const AGGREGATES: [&str; 2] = ["ttft_ms", "total_ms"];

/// One cache's hit rate and its hits' and misses' TTFT.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CacheRow {
    pub cache: String,
    /// Successful requests whose response said hit or miss for this cache.
    pub known: usize,
    pub hits: usize,
    pub hit_rate: f64,
    pub hit_ttft_ms: Option<Percentiles>,
    pub miss_ttft_ms: Option<Percentiles>,
    /// Per server stage: median on a miss minus median on a hit, milliseconds.
    pub miss_minus_hit_ms: BTreeMap<String, f64>,
    /// The stage with the largest growth on a miss: the one that missed.
    pub missed_stage: Option<String>,
    /// For a cache of many items per request (sentences, prompt tokens): the share of all
    /// items looked up that it held, over the run, and what the items are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item_share: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<String>,
}

/// Requests of one kind the mix drew.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KindRow {
    pub kind: QueryKind,
    pub requests: usize,
    pub ok: usize,
    pub ttft_ms: Option<Percentiles>,
    pub e2e_ms: Option<Percentiles>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CacheReport {
    pub caches: Vec<CacheRow>,
    pub kinds: Vec<KindRow>,
}

/// A prefix-cache hit: most of the prompt came from the cache. Every RAG prompt shares the
/// system head, so "any cached token" would count nearly every request as a hit.
pub fn prefix_hit(r: &RequestRecord) -> Option<bool> {
    let cached = r.cached_tokens?;
    let prompt = r.prompt_tokens?;
    Some(cached * 2 > prompt)
}

pub fn embedding_hit(r: &RequestRecord) -> Option<bool> {
    r.embedding_cached
}

/// A sentence-cache hit: most of the context's sentence vectors came from the cache. `None`
/// when the context looked up none (passage mode, or a server that does not say).
pub fn sentence_hit(r: &RequestRecord) -> Option<bool> {
    let (looked_up, held) = (r.sentences?, r.sentences_cached?);
    (looked_up > 0).then_some(held * 2 > looked_up)
}

/// A whole-prompt hit: every prompt token came from the prefix cache, so nothing was prefilled.
pub fn whole_prompt_hit(r: &RequestRecord) -> Option<bool> {
    let (cached, prompt) = (r.cached_tokens?, r.prompt_tokens?);
    (prompt > 0).then_some(cached >= prompt)
}

/// Items held over items looked up, over `ok` records, for the caches of many items per request.
fn item_share(name: &str, ok: &[&RequestRecord]) -> Option<(f64, &'static str)> {
    let (held, looked_up, items) = match name {
        SENTENCE_VECTORS => (
            ok.iter().filter_map(|r| r.sentences_cached).sum::<u64>(),
            ok.iter().filter_map(|r| r.sentences).sum::<u64>(),
            "sentences",
        ),
        PREFIX_KV => (
            ok.iter()
                .filter(|r| r.prompt_tokens.is_some())
                .filter_map(|r| r.cached_tokens)
                .sum::<u64>(),
            ok.iter()
                .filter(|r| r.cached_tokens.is_some())
                .filter_map(|r| r.prompt_tokens)
                .sum::<u64>(),
            "prompt tokens",
        ),
        _ => return None,
    };
    (looked_up > 0).then(|| (held as f64 / looked_up as f64, items))
}

impl CacheReport {
    /// `None` when no record carries a cache outcome or a query kind (an older server, a run
    /// without the mix against one).
    pub fn of(records: &[&RequestRecord]) -> Option<CacheReport> {
        let ok: Vec<&RequestRecord> = records.iter().copied().filter(|r| r.ok).collect();
        let caches: Vec<CacheRow> = [
            (
                QUERY_EMBEDDING,
                embedding_hit as fn(&RequestRecord) -> Option<bool>,
            ),
            (SENTENCE_VECTORS, sentence_hit),
            (PREFIX_KV, prefix_hit),
            (WHOLE_PROMPT, whole_prompt_hit),
        ]
        .into_iter()
        .filter_map(|(name, hit)| row(name, &ok, hit))
        .collect();
        let kinds: Vec<KindRow> = QueryKind::ALL
            .into_iter()
            .filter_map(|kind| {
                let of: Vec<&RequestRecord> = records
                    .iter()
                    .copied()
                    .filter(|r| r.query_kind == Some(kind))
                    .collect();
                (!of.is_empty()).then(|| KindRow {
                    kind,
                    requests: of.len(),
                    ok: of.iter().filter(|r| r.ok).count(),
                    ttft_ms: Percentiles::of(of.iter().filter(|r| r.ok).filter_map(|r| r.ttft_ms)),
                    e2e_ms: Percentiles::of(of.iter().filter_map(|r| r.e2e_ms)),
                })
            })
            .collect();
        (!caches.is_empty() || !kinds.is_empty()).then_some(CacheReport { caches, kinds })
    }

    /// The run's cache state at a glance: each cache's hit rate (and for the caches of many
    /// items, the share of items it held), and whether that makes the run hot, cold or mixed:
    /// a run's latencies mean little without it (a second run of the same questions finds its
    /// prompts cached and looks several times faster).
    pub fn state(&self) -> Option<String> {
        if self.caches.is_empty() {
            return None;
        }
        let parts: Vec<String> = self
            .caches
            .iter()
            .map(|c| match (c.item_share, &c.items) {
                (Some(share), Some(items)) => format!(
                    "{} {:.0}% of requests ({:.0}% of {items})",
                    c.cache,
                    c.hit_rate * 100.0,
                    share * 100.0
                ),
                _ => format!("{} {:.0}%", c.cache, c.hit_rate * 100.0),
            })
            .collect();
        let rate = |name: &str| {
            self.caches
                .iter()
                .find(|c| c.cache == name)
                .map(|c| c.hit_rate)
        };
        let heaviest = rate(PREFIX_KV).or(rate(QUERY_EMBEDDING)).unwrap_or(0.0);
        let highest = self.caches.iter().map(|c| c.hit_rate).fold(0.0, f64::max);
        let verdict = if heaviest >= 0.5 {
            "a hot run: most prompts were served from the caches"
        } else if highest <= 0.1 {
            "a cold run: nearly every request did all its work"
        } else {
            "a mixed run"
        };
        Some(format!("cache state: {}; {verdict}", parts.join(", ")))
    }

    /// Console lines: one per cache, one per kind.
    pub fn lines(&self) -> Vec<String> {
        let p = |p: &Option<Percentiles>| {
            p.map_or("–".into(), |p| {
                format!(
                    "n {} p50 {:.0} [{:.0}, {:.0}] p99 {:.0} [{:.0}, {:.0}]",
                    p.count, p.p50, p.ci.p50.lo, p.ci.p50.hi, p.p99, p.ci.p99.lo, p.ci.p99.hi
                )
            })
        };
        let mut out = Vec::new();
        for c in &self.caches {
            out.push(format!(
                "{} cache: hit rate {:.1}% ({}/{}); TTFT ms hit {}; miss {}{}",
                c.cache,
                c.hit_rate * 100.0,
                c.hits,
                c.known,
                p(&c.hit_ttft_ms),
                p(&c.miss_ttft_ms),
                c.missed_stage.as_ref().map_or(String::new(), |s| format!(
                    "; a miss costs most in {s} (+{:.0} ms at the median)",
                    c.miss_minus_hit_ms[s]
                ))
            ));
        }
        for k in &self.kinds {
            out.push(format!(
                "{} queries: {} sent, {} ok; TTFT ms {}",
                k.kind.name(),
                k.requests,
                k.ok,
                p(&k.ttft_ms)
            ));
        }
        out
    }
}

fn row(
    name: &str,
    ok: &[&RequestRecord],
    hit: fn(&RequestRecord) -> Option<bool>,
) -> Option<CacheRow> {
    let (hits, misses): (Vec<&RequestRecord>, Vec<&RequestRecord>) = ok
        .iter()
        .copied()
        .filter(|r| hit(r).is_some())
        .partition(|r| hit(r) == Some(true));
    let known = hits.len() + misses.len();
    if known == 0 {
        return None;
    }
    let ttft = |rs: &[&RequestRecord]| Percentiles::of(rs.iter().filter_map(|r| r.ttft_ms));
    let hit_medians = stage_medians(&hits);
    let miss_minus_hit: BTreeMap<String, f64> = stage_medians(&misses)
        .into_iter()
        .filter_map(|(stage, miss)| Some((stage.clone(), miss - hit_medians.get(&stage)?)))
        .collect();
    let missed_stage = miss_minus_hit
        .iter()
        .filter(|(_, d)| **d > 0.0)
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(s, _)| s.clone());
    let share = item_share(name, ok);
    Some(CacheRow {
        item_share: share.map(|s| s.0),
        items: share.map(|s| s.1.to_string()),
        cache: name.into(),
        known,
        hits: hits.len(),
        hit_rate: hits.len() as f64 / known as f64,
        hit_ttft_ms: ttft(&hits),
        miss_ttft_ms: ttft(&misses),
        miss_minus_hit_ms: miss_minus_hit,
        missed_stage,
    })
}

/// The median of each server stage's milliseconds over `records`.
fn stage_medians(records: &[&RequestRecord]) -> BTreeMap<String, f64> {
    let mut by: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for t in records.iter().filter_map(|r| r.server_timings.as_ref()) {
        for (k, v) in t {
            if !AGGREGATES.contains(&k.as_str()) {
                by.entry(k.clone()).or_default().push(*v);
            }
        }
    }
    by.into_iter()
        .map(|(k, mut v)| {
            v.sort_by(f64::total_cmp);
            (k, percentile(&v, 0.5))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::schedule::Phase;

    /// A successful steady record with the given TTFT and cache outcomes.
    pub fn rec(id: u64, ttft: f64, embed_hit: bool, cached: u64, kind: QueryKind) -> RequestRecord {
        let embed = if embed_hit { 0.1 } else { 8.0 };
        let prefill = if cached > 200 { 20.0 } else { 900.0 };
        RequestRecord {
            id,
            phase: Phase::Steady,
            step: None,
            offered_rps: None,
            user: Some(0),
            scheduled_s: None,
            sent_s: id as f64,
            done_s: id as f64 + 1.0,
            sent_unix_ms: 0,
            query_rank: 0,
            top_k: None,
            rerank_top_n: None,
            trace_id: String::new(),
            ok: true,
            status: Some(200),
            error: None,
            error_detail: None,
            ttft_ms: Some(ttft),
            tpot_ms: None,
            e2e_ms: Some(ttft + 5.0),
            tokens: 1,
            prompt_tokens: Some(400),
            server_timings: Some(BTreeMap::from([
                ("embed_ms".to_string(), embed),
                ("prefill_ms".to_string(), prefill),
                ("rerank_ms".to_string(), 50.0),
                ("ttft_ms".to_string(), ttft),
            ])),
            query: Some("q".into()),
            filter: None,
            query_kind: Some(kind),
            perturbation: None,
            embedding_cached: Some(embed_hit),
            cached_tokens: Some(cached),
            sentences: Some(20),
            sentences_cached: Some(if embed_hit { 20 } else { 0 }),
            retried: false,
        }
    }

    #[test]
    fn misses_are_split_out_and_blamed_on_the_stage_that_grew() {
        let mut rs = Vec::new();
        for i in 0..95 {
            rs.push(rec(i, 100.0 + i as f64 % 7.0, true, 390, QueryKind::Hot));
        }
        for i in 95..100 {
            rs.push(rec(i, 1000.0 + i as f64, false, 40, QueryKind::Cold));
        }
        let refs: Vec<&RequestRecord> = rs.iter().collect();
        let r = CacheReport::of(&refs).unwrap();
        let emb = &r.caches[0];
        assert_eq!(emb.cache, QUERY_EMBEDDING);
        assert_eq!((emb.hits, emb.known), (95, 100));
        assert!((emb.hit_rate - 0.95).abs() < 1e-9);
        assert!(emb.hit_ttft_ms.unwrap().p99 < 110.0);
        assert!(emb.miss_ttft_ms.unwrap().p50 > 1000.0);
        // Embedding grows by 7.9 ms, prefill by 880 ms: prefill is where a miss costs.
        assert_eq!(emb.missed_stage.as_deref(), Some("prefill_ms"));
        assert!((emb.miss_minus_hit_ms["embed_ms"] - 7.9).abs() < 1e-9);
        assert_eq!(emb.miss_minus_hit_ms["rerank_ms"], 0.0);
        assert!(!emb.miss_minus_hit_ms.contains_key("ttft_ms"));
        let sentences = &r.caches[1];
        assert_eq!(sentences.cache, SENTENCE_VECTORS);
        assert_eq!(sentences.item_share, Some(0.95));
        let pre = &r.caches[2];
        assert_eq!(pre.cache, PREFIX_KV);
        assert_eq!(pre.hits, 95);
        // 95 × 390 + 5 × 40 of 100 × 400 prompt tokens.
        assert!((pre.item_share.unwrap() - 37_250.0 / 40_000.0).abs() < 1e-9);
        let whole = &r.caches[3];
        assert_eq!((whole.cache.as_str(), whole.hits), (WHOLE_PROMPT, 0));
        let state = r.state().unwrap();
        assert!(
            state.contains("prefix_kv 95% of requests (93% of prompt tokens)")
                && state.contains("whole_prompt 0%")
                && state.ends_with("a hot run: most prompts were served from the caches"),
            "{state}"
        );
        assert_eq!(r.kinds.len(), 2);
        assert_eq!(r.kinds[1].kind, QueryKind::Cold);
        assert_eq!(r.kinds[1].requests, 5);
        assert!(
            r.lines()[0].contains("hit rate 95.0% (95/100)"),
            "{:?}",
            r.lines()
        );
    }

    #[test]
    fn a_prefix_hit_needs_most_of_the_prompt() {
        let r = rec(0, 1.0, true, 200, QueryKind::Hot);
        assert_eq!(prefix_hit(&r), Some(false));
        let r = rec(0, 1.0, true, 201, QueryKind::Hot);
        assert_eq!(prefix_hit(&r), Some(true));
        let mut r = rec(0, 1.0, true, 201, QueryKind::Hot);
        r.cached_tokens = None;
        assert_eq!(prefix_hit(&r), None);
        assert!(CacheReport::of(&[]).is_none());
        // Every token cached: a whole-prompt hit; a context without sentence vectors says nothing.
        let mut r = rec(0, 1.0, true, 400, QueryKind::Hot);
        assert_eq!(whole_prompt_hit(&r), Some(true));
        r.sentences = Some(0);
        assert_eq!(sentence_hit(&r), None);
        // Cold: no cache held anything.
        let cold: Vec<RequestRecord> = (0..10)
            .map(|i| {
                let mut r = rec(i, 900.0, false, 0, QueryKind::Cold);
                r.sentences_cached = Some(0);
                r
            })
            .collect();
        let refs: Vec<&RequestRecord> = cold.iter().collect();
        let state = CacheReport::of(&refs).unwrap().state().unwrap();
        assert!(
            state.ends_with("a cold run: nearly every request did all its work"),
            "{state}"
        );
    }
}
