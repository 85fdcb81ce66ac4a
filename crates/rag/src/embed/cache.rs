//! Small LRU caches of embeddings: popular questions (a load test's Zipf head, a demo's
//! repeated query) skip the BERT forward for the query, and the passages such questions keep
//! retrieving skip it for the context stage's sentence vectors. Hits and misses are counted
//! (`ragscope.cache.requests{cache="query_embedding"|"sentence_embedding"}`); the query cache's
//! are also marked on the `embeddings` span. The same LRU, uncounted, remembers each recent
//! question's prompt tokens, so admission can tell a prompt the prefix cache holds from one it
//! must compute ([`PromptMemory`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use opentelemetry::KeyValue;
use telemetry::names::attr;

/// Text → value, least recently used first out, at most `capacity` entries.
pub struct TextCache<V = Vec<f32>> {
    /// The `cache` label of its hit/miss counter; `None`: not counted.
    name: Option<&'static str>,
    capacity: usize,
    inner: Mutex<Lru<V>>,
}

/// Text → embedding.
pub type VectorCache = TextCache<Vec<f32>>;

/// The query cache.
pub type QueryCache = VectorCache;

/// Question → the token ids of the last prompt built for it.
pub type PromptMemory = TextCache<std::sync::Arc<[u32]>>;

struct Lru<V> {
    /// Each entry with the tick of its last use.
    map: HashMap<String, (V, u64)>,
    /// Last-use tick → key, oldest first.
    order: BTreeMap<u64, String>,
    tick: u64,
}

impl<V> Default for Lru<V> {
    fn default() -> Self {
        Lru {
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
        }
    }
}

impl<V: Clone> Lru<V> {
    fn touch(&mut self, key: &str) -> Option<V> {
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
}

impl<V: Clone> TextCache<V> {
    /// A cache counted under `name`; `capacity` 0 turns caching off.
    pub fn named(name: &'static str, capacity: usize) -> TextCache<V> {
        TextCache {
            name: Some(name),
            ..TextCache::uncounted(capacity)
        }
    }

    /// A cache whose hits and misses are not counted (an internal memory, not a cache a
    /// request is served from).
    pub fn uncounted(capacity: usize) -> TextCache<V> {
        TextCache {
            name: None,
            capacity,
            inner: Mutex::new(Lru::default()),
        }
    }

    /// Entries it may hold; 0: it holds nothing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn get(&self, text: &str) -> Option<V> {
        if self.capacity == 0 {
            return None;
        }
        let hit = self.inner.lock().expect("vector cache lock").touch(text);
        self.count(hit.is_some(), 1);
        hit
    }

    /// Every text's vector, `None` where it is not cached; the hits and misses are counted.
    pub fn get_all(&self, texts: &[&str]) -> Vec<Option<V>> {
        if self.capacity == 0 {
            return vec![None; texts.len()];
        }
        let found: Vec<Option<V>> = {
            let mut lru = self.inner.lock().expect("vector cache lock");
            texts.iter().map(|t| lru.touch(t)).collect()
        };
        let hits = found.iter().filter(|v| v.is_some()).count();
        self.count(true, hits as u64);
        self.count(false, (texts.len() - hits) as u64);
        found
    }

    fn count(&self, hit: bool, n: u64) {
        let Some(name) = self.name.filter(|_| n > 0) else {
            return;
        };
        telemetry::metrics::metrics().cache_requests.add(
            n,
            &[
                KeyValue::new(attr::CACHE, name),
                KeyValue::new(attr::RESULT, if hit { "hit" } else { "miss" }),
            ],
        );
    }

    /// Caches `value` for `text`, unless `text` is cached already.
    pub fn put(&self, text: &str, value: V) {
        self.insert(text, value, false);
    }

    /// Caches `value` for `text`, replacing what `text` had.
    pub fn replace(&self, text: &str, value: V) {
        self.insert(text, value, true);
    }

    fn insert(&self, text: &str, vector: V, replace: bool) {
        if self.capacity == 0 {
            return;
        }
        let mut lru = self.inner.lock().expect("vector cache lock");
        if lru.map.contains_key(text) {
            if !replace {
                return;
            }
            if let Some((_, used)) = lru.map.remove(text) {
                lru.order.remove(&used);
            }
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
    fn a_replaced_entry_holds_the_new_value_and_is_the_most_recent() {
        let c = PromptMemory::uncounted(2);
        c.put("a", vec![1u32].into());
        c.put("b", vec![2u32].into());
        c.put("a", vec![9u32].into());
        assert_eq!(
            c.get("a").as_deref(),
            Some(&[1u32][..]),
            "put keeps the first"
        );
        c.replace("b", vec![3u32].into());
        c.put("c", vec![4u32].into()); // evicts a: b was replaced after a was used
        assert_eq!(c.get("a"), None);
        assert_eq!(c.get("b").as_deref(), Some(&[3u32][..]));
    }

    #[test]
    fn capacity_zero_caches_nothing() {
        let c = QueryCache::new(0);
        c.put("a", vec![1.0]);
        assert_eq!(c.get("a"), None);
    }
}
