//! A small LRU cache of query embeddings: popular questions (a load test's Zipf head, a demo's
//! repeated query) skip the BERT forward. Hits and misses are counted
//! (`ragscope.cache.requests{cache="query_embedding"}`) and marked on the `embeddings` span.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::telemetry::names::attr;
use opentelemetry::KeyValue;

pub struct QueryCache {
    capacity: usize,
    inner: Mutex<Lru>,
}

#[derive(Default)]
struct Lru {
    map: HashMap<String, Vec<f32>>,
    /// Keys from least to most recently used.
    order: VecDeque<String>,
}

impl QueryCache {
    /// `capacity` 0 turns caching off.
    pub fn new(capacity: usize) -> QueryCache {
        QueryCache {
            capacity,
            inner: Mutex::new(Lru::default()),
        }
    }

    pub fn get(&self, query: &str) -> Option<Vec<f32>> {
        if self.capacity == 0 {
            return None;
        }
        let mut lru = self.inner.lock().expect("query cache lock");
        let hit = lru.map.get(query).cloned();
        if hit.is_some() {
            if let Some(pos) = lru.order.iter().position(|k| k == query) {
                let key = lru.order.remove(pos).expect("position is in range");
                lru.order.push_back(key);
            }
        }
        let result = if hit.is_some() { "hit" } else { "miss" };
        crate::telemetry::metrics::metrics().cache_requests.add(
            1,
            &[
                KeyValue::new(attr::CACHE, "query_embedding"),
                KeyValue::new(attr::RESULT, result),
            ],
        );
        hit
    }

    pub fn put(&self, query: &str, vector: Vec<f32>) {
        if self.capacity == 0 {
            return;
        }
        let mut lru = self.inner.lock().expect("query cache lock");
        if lru.map.insert(query.to_string(), vector).is_none() {
            lru.order.push_back(query.to_string());
            while lru.order.len() > self.capacity {
                if let Some(old) = lru.order.pop_front() {
                    lru.map.remove(&old);
                }
            }
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
    fn capacity_zero_caches_nothing() {
        let c = QueryCache::new(0);
        c.put("a", vec![1.0]);
        assert_eq!(c.get("a"), None);
    }
}
