//! What the server's caches did for each stage, read from the spans: the query-vector cache
//! (`rag.cache.hit` on `embeddings`), the sentence cache (`rag.context.sentences_cached` of
//! `rag.context.sentences_in` on `context`) and the prefix KV cache (`rag.prefill.cached_tokens`
//! and `computed_tokens` on `prefill`). Two runs of the same questions can differ by a whole
//! prefill because the second found its prompts cached; `attribute --baseline` uses this to say
//! so instead of blaming the stage's code.

use serde::{Deserialize, Serialize};
use telemetry::names::attr;

/// The caches a span can report on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cache {
    QueryVectors,
    SentenceVectors,
    PrefixKv,
}

impl Cache {
    /// The cache, as a sentence names it.
    pub fn name(self) -> &'static str {
        match self {
            Cache::QueryVectors => "query-vector cache",
            Cache::SentenceVectors => "sentence cache",
            Cache::PrefixKv => "prefix cache",
        }
    }

    /// What it holds, counted.
    pub fn items(self) -> &'static str {
        match self {
            Cache::QueryVectors => "query vectors",
            Cache::SentenceVectors => "sentence vectors",
            Cache::PrefixKv => "prompt tokens",
        }
    }
}

/// One span's use of a cache: items looked up and how many of them the cache held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanCache {
    pub cache: Cache,
    pub looked_up: u64,
    pub held: u64,
}

/// The cache use a span's attributes (key, value as text) report, if any.
pub fn from_attributes<'a>(attrs: impl Iterator<Item = (&'a str, String)>) -> Option<SpanCache> {
    let (mut hit, mut sentences, mut sentences_cached, mut cached, mut computed) =
        (None, None, None, None, None);
    for (key, value) in attrs {
        let number = || value.trim_matches('"').parse::<u64>().ok();
        match key {
            attr::CACHE_HIT => hit = Some(value == "true"),
            attr::CONTEXT_SENTENCES_IN => sentences = number(),
            attr::CONTEXT_SENTENCES_CACHED => sentences_cached = number(),
            attr::PREFILL_CACHED_TOKENS => cached = number(),
            attr::PREFILL_COMPUTED_TOKENS => computed = number(),
            _ => {}
        }
    }
    if let Some(hit) = hit {
        return Some(SpanCache {
            cache: Cache::QueryVectors,
            looked_up: 1,
            held: u64::from(hit),
        });
    }
    if let (Some(cached), Some(computed)) = (cached, computed) {
        return Some(SpanCache {
            cache: Cache::PrefixKv,
            looked_up: cached + computed,
            held: cached,
        });
    }
    // A context that needed no sentence vectors looked none up (and says 0 cached).
    match (sentences, sentences_cached) {
        (Some(n), Some(held)) if held > 0 || n > 0 => Some(SpanCache {
            cache: Cache::SentenceVectors,
            looked_up: n,
            held: held.min(n),
        }),
        _ => None,
    }
}

/// A stage's cache use over a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageCache {
    pub cache: Cache,
    pub looked_up: u64,
    pub held: u64,
    /// Requests in which the stage looked anything up, and those in which the cache held all of
    /// it (a query-vector hit; a whole prompt from the prefix cache: nothing prefilled).
    pub requests: usize,
    pub whole: usize,
}

impl StageCache {
    /// Adds one request's use (the sum of its spans at this stage).
    pub fn add(slot: &mut Option<StageCache>, used: SpanCache) {
        let s = slot.get_or_insert(StageCache {
            cache: used.cache,
            looked_up: 0,
            held: 0,
            requests: 0,
            whole: 0,
        });
        s.looked_up += used.looked_up;
        s.held += used.held;
        s.requests += 1;
        s.whole += usize::from(used.looked_up > 0 && used.held == used.looked_up);
    }

    /// Share of the items looked up that the cache held.
    pub fn rate(&self) -> f64 {
        if self.looked_up == 0 {
            0.0
        } else {
            self.held as f64 / self.looked_up as f64
        }
    }
}

/// How far a cache's share must move between two runs to count as a different cache state.
pub const SHIFT: f64 = 0.10;

/// A stage's cache state in a run against its baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheShift {
    pub cache: Cache,
    pub baseline: StageCache,
    pub run: StageCache,
    /// The stage's time moved the way the cache moved: faster where the cache held more,
    /// slower where it held less.
    pub coincides: bool,
}

impl CacheShift {
    /// The shift between the two runs' use of one cache at a stage whose owned p50 moved by
    /// `delta_ms`; `None` when the share held moved less than [`SHIFT`].
    pub fn between(
        baseline: Option<StageCache>,
        run: Option<StageCache>,
        delta_ms: f64,
    ) -> Option<CacheShift> {
        let (baseline, run) = (baseline?, run?);
        if baseline.cache != run.cache {
            return None;
        }
        let moved = run.rate() - baseline.rate();
        (moved.abs() >= SHIFT).then_some(CacheShift {
            cache: run.cache,
            coincides: delta_ms * moved < 0.0,
            baseline,
            run,
        })
    }

    /// "2884 of 2884 prompt tokens (100%) came from the prefix cache in this run, 0 of 2884
    /// (0%) in the baseline; 14 of 14 requests were whole-prompt hits (0 of 14)".
    pub fn sentence(&self) -> String {
        let (b, r) = (&self.baseline, &self.run);
        let mut s = format!(
            "{} of {} {} ({:.0}%) came from the {} in this run, {} of {} ({:.0}%) in the baseline",
            r.held,
            r.looked_up,
            self.cache.items(),
            r.rate() * 100.0,
            self.cache.name(),
            b.held,
            b.looked_up,
            b.rate() * 100.0
        );
        if self.cache == Cache::PrefixKv {
            s.push_str(&format!(
                "; {} of {} requests were whole-prompt hits ({} of {} in the baseline)",
                r.whole, r.requests, b.whole, b.requests
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(pairs: &[(&'static str, &str)]) -> Option<SpanCache> {
        from_attributes(pairs.iter().map(|(k, v)| (*k, v.to_string())))
    }

    #[test]
    fn spans_say_what_their_cache_held() {
        let hit = attrs(&[(attr::CACHE_HIT, "true")]).unwrap();
        assert_eq!(
            (hit.cache, hit.looked_up, hit.held),
            (Cache::QueryVectors, 1, 1)
        );
        let prefill = attrs(&[
            (attr::PREFILL_CACHED_TOKENS, "16"),
            (attr::PREFILL_COMPUTED_TOKENS, "190"),
        ])
        .unwrap();
        assert_eq!((prefill.looked_up, prefill.held), (206, 16));
        let context = attrs(&[
            (attr::CONTEXT_SENTENCES_IN, "40"),
            (attr::CONTEXT_SENTENCES_CACHED, "\"30\""),
        ])
        .unwrap();
        assert_eq!(context.cache, Cache::SentenceVectors);
        assert_eq!((context.looked_up, context.held), (40, 30));
        assert!(attrs(&[("rag.retrieval.top_k", "8")]).is_none());
    }

    #[test]
    fn a_shift_needs_a_real_move_and_knows_its_direction() {
        let mut cold = None;
        let mut hot = None;
        for _ in 0..14 {
            StageCache::add(
                &mut cold,
                SpanCache {
                    cache: Cache::PrefixKv,
                    looked_up: 206,
                    held: 0,
                },
            );
            StageCache::add(
                &mut hot,
                SpanCache {
                    cache: Cache::PrefixKv,
                    looked_up: 206,
                    held: 206,
                },
            );
        }
        // Faster with more held: it coincides; slower with more held: it does not.
        let shift = CacheShift::between(cold, hot, -199.0).unwrap();
        assert!(shift.coincides);
        assert!(!CacheShift::between(cold, hot, 5.0).unwrap().coincides);
        assert!(CacheShift::between(hot, hot, -199.0).is_none());
        assert_eq!(
            shift.sentence(),
            "2884 of 2884 prompt tokens (100%) came from the prefix cache in this run, 0 of 2884 \
             (0%) in the baseline; 14 of 14 requests were whole-prompt hits (0 of 14 in the \
             baseline)"
        );
    }
}
