//! Small LRU caches of embeddings: popular questions (a load test's Zipf head, a demo's
//! repeated query) skip the BERT forward for the query, and the passages such questions keep
//! retrieving skip it for the context stage's sentence vectors. Hits and misses are counted
//! (`ragscope.cache.requests{cache="query_embedding"|"sentence_embedding"}`); the query cache's
//! are also marked on the `embeddings` span.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::telemetry::names::attr;
use opentelemetry::KeyValue;

/// Text → embedding, least recently used first out, at most `capacity` entries.
pub struct VectorCache {
    /// The `cache` label of its hit/miss counter.
    name: &'static str,
    capacity: usize,
    inner: Mutex<Lru>,
}

/// The query cache.
pub type QueryCache = VectorCache;

#[derive(Default)]
struct Lru {
    /// Each entry with the tick of its last use.
    map: HashMap<String, (Vec<f32>, u64)>,
    /// Last-use tick → key, oldest first.
    order: BTreeMap<u64, String>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, key: &str) -> Option<Vec<f32>> {
        self.tick += 1;
        let tick = self.tick;
        let (vector, used) = self.map.get_mut(key)?;
        let old = std::mem::replace(used, tick);
        let vector = vector.clone();
        if let Some(k) = self.order.remove(&old) {
            self.order.insert(tick, k);
        }
        Some(vector)
    }
}

impl VectorCache {
    /// The query-embedding cache; `capacity` 0 turns caching off.
    pub fn new(capacity: usize) -> VectorCache {
        VectorCache::named("query_embedding", capacity)
    }

    /// A cache counted under `name`; `capacity` 0 turns caching off.
    pub fn named(name: &'static str, capacity: usize) -> VectorCache {
        VectorCache {
            name,
            capacity,
            inner: Mutex::new(Lru::default()),
        }
    }

    pub fn get(&self, text: &str) -> Option<Vec<f32>> {
        if self.capacity == 0 {
            return None;
        }
        let hit = self.inner.lock().expect("vector cache lock").touch(text);
        self.count(hit.is_some(), 1);
        hit
    }

    /// Every text's vector, `None` where it is not cached; the hits and misses are counted.
    pub fn get_all(&self, texts: &[&str]) -> Vec<Option<Vec<f32>>> {
        if self.capacity == 0 {
            return vec![None; texts.len()];
        }
        let found: Vec<Option<Vec<f32>>> = {
            let mut lru = self.inner.lock().expect("vector cache lock");
            texts.iter().map(|t| lru.touch(t)).collect()
        };
        let hits = found.iter().filter(|v| v.is_some()).count();
        self.count(true, hits as u64);
        self.count(false, (texts.len() - hits) as u64);
        found
    }

    fn count(&self, hit: bool, n: u64) {
        if n == 0 {
            return;
        }
        crate::telemetry::metrics::metrics().cache_requests.add(
            n,
            &[
                KeyValue::new(attr::CACHE, self.name),
                KeyValue::new(attr::RESULT, if hit { "hit" } else { "miss" }),
            ],
        );
    }

    pub fn put(&self, text: &str, vector: Vec<f32>) {
        if self.capacity == 0 {
            return;
        }
        let mut lru = self.inner.lock().expect("vector cache lock");
        if lru.map.contains_key(text) {
            return;
        }
        lru.tick += 1;
        let tick = lru.tick;
        lru.map.insert(text.to_string(), (vector, tick));
        lru.order.insert(tick, text.to_string());
        while lru.map.len() > self.capacity {
            let Some((_, old)) = lru.order.pop_first() else {
                break;
            };
            lru.map.remove(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_recently_used_entries() {
        let c = QueryCache::new(2);
        c.put("a", vec![1.0]);
        c.put("b", vec![2.0]);
        assert_eq!(c.get("a"), Some(vec![1.0])); // a is now the most recent
        c.put("c", vec![3.0]); // evicts b
        assert_eq!(c.get("b"), None);
        assert_eq!(c.get("a"), Some(vec![1.0]));
        assert_eq!(c.get("c"), Some(vec![3.0]));
    }

    #[test]
    fn a_batch_lookup_finds_the_cached_texts_and_refreshes_them() {
        let c = VectorCache::named("sentence_embedding", 2);
        c.put("a", vec![1.0]);
        c.put("b", vec![2.0]);
        assert_eq!(
            c.get_all(&["b", "x", "a"]),
            [Some(vec![2.0]), None, Some(vec![1.0])]
        );
        // "a" was used last: "c" evicts "b".
        c.put("c", vec![3.0]);
        assert_eq!(
            c.get_all(&["a", "b", "c"]),
            [Some(vec![1.0]), None, Some(vec![3.0])]
        );
    }

    #[test]
    fn capacity_zero_caches_nothing() {
        let c = QueryCache::new(0);
        c.put("a", vec![1.0]);
        assert_eq!(c.get("a"), None);
    }
}
