//! One conformance suite for every `VectorStore` backend, written against `Arc<dyn VectorStore>`:
//! always the embedded Qdrant Edge engine, and a Qdrant server when `QDRANT_URL` is set
//! (`QDRANT_URL=http://host:6334`, optional `QDRANT_API_KEY`; the test command starts a real one
//! and sets `RAGSCOPE_REQUIRE_QDRANT`, under which a missing server fails the suite).
//! Every test runs in a fresh collection; server collections are dropped afterwards.
//!
//! These are plain (not async) tests: the stores are synchronous and the remote one drives its
//! own runtime, which must not be entered from inside another.

use std::collections::HashSet;
use std::sync::Arc;

use rag::retrieve::edge::EdgeStore;
use rag::retrieve::lexical;
use rag::retrieve::remote::RemoteStore;
use rag::retrieve::{
    Chunk, Condition, Filter, FilterField, MatchValue, ScoredChunk, StoreError, VectorStore,
};
use serde_json::{json, Value};
use telemetry::span::Stage;
use tempfile::TempDir;

const DIM: usize = 8;

/// Where a test's collection lives; reopening gives a new handle on the same data.
enum Target {
    Embedded(TempDir),
    Server {
        url: String,
        api_key: Option<String>,
        collection: String,
    },
}

impl Target {
    fn name(&self) -> &'static str {
        match self {
            Target::Embedded(_) => "embedded qdrant-edge",
            Target::Server { .. } => "qdrant server",
        }
    }

    fn open_with(&self, dimension: usize) -> Result<Arc<dyn VectorStore>, StoreError> {
        Ok(match self {
            Target::Embedded(dir) => Arc::new(EdgeStore::open(dir.path(), "conf", dimension)?),
            Target::Server {
                url,
                api_key,
                collection,
            } => Arc::new(RemoteStore::open(
                url,
                api_key.as_deref(),
                collection,
                dimension,
            )?),
        })
    }

    fn open(&self) -> Arc<dyn VectorStore> {
        self.open_with(DIM)
            .unwrap_or_else(|e| panic!("{}: open failed: {e}", self.name()))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Target::Server {
            url,
            api_key,
            collection,
        } = self
        {
            let client = qdrant_client::Qdrant::from_url(url)
                .api_key(api_key.clone())
                .skip_compatibility_check()
                .build();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            if let Ok(client) = client {
                let _ = runtime.block_on(client.delete_collection(collection.clone()));
            }
        }
    }
}

/// The backends this run covers, each with a fresh collection.
fn targets() -> Vec<Target> {
    let mut targets = vec![Target::Embedded(TempDir::new().unwrap())];
    match std::env::var("QDRANT_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    {
        Some(url) => targets.push(Target::Server {
            url,
            api_key: std::env::var("QDRANT_API_KEY")
                .ok()
                .filter(|k| !k.is_empty()),
            collection: format!("ragscope-conformance-{}", uuid::Uuid::new_v4()),
        }),
        None => {
            assert!(
                std::env::var_os("RAGSCOPE_REQUIRE_QDRANT").is_none(),
                "QDRANT_URL is not set, and RAGSCOPE_REQUIRE_QDRANT asks for a Qdrant server \
                 (scripts/test starts one from ../shared/qdrant)"
            );
            eprintln!(
                "store_conformance: QDRANT_URL is not set, so only the embedded engine is tested; \
                 the Qdrant server backend is SKIPPED (set QDRANT_URL=http://host:6334 to run it)"
            )
        }
    }
    targets
}

fn stage() -> Stage {
    Stage::root("conformance")
}

fn chunk(doc_id: &str, position: u32, source: &str, metadata: Value) -> Chunk {
    let text = format!("{doc_id} chunk {position}");
    Chunk {
        id: uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, text.as_bytes()).to_string(),
        doc_id: doc_id.into(),
        text,
        source: source.into(),
        position,
        metadata: metadata.as_object().cloned().unwrap_or_default(),
    }
}

/// Chunk `i` points along axis `i % DIM`, tilted a little so no two vectors are equal.
fn axis_vector(i: usize) -> Vec<f32> {
    let mut v = vec![0.01 * i as f32; DIM];
    v[i % DIM] = 1.0;
    v
}

/// Three documents: a (3 chunks, "my docs.txt", lang en), b (2, wiki, lang de), c (1, web).
fn sample() -> (Vec<Chunk>, Vec<Vec<f32>>) {
    let en = json!({"lang": "en", "year": 2024, "draft": false, "score-x": 0.25});
    let chunks = vec![
        chunk("a", 0, "my docs.txt", en.clone()),
        chunk("a", 1, "my docs.txt", en.clone()),
        chunk(
            "a",
            2,
            "my docs.txt",
            json!({"lang": "en", "year": 2023, "draft": true}),
        ),
        chunk("b", 0, "wiki", json!({"lang": "de", "year": 2024})),
        chunk("b", 1, "wiki", json!({"lang": "de", "year": 2022})),
        chunk("c", 0, "web", json!({})),
    ];
    let vectors = (0..chunks.len()).map(axis_vector).collect();
    (chunks, vectors)
}

fn filled(target: &Target) -> (Arc<dyn VectorStore>, Vec<Chunk>, Vec<Vec<f32>>) {
    let store = target.open();
    let (chunks, vectors) = sample();
    store.upsert(&chunks, &vectors, &stage()).unwrap();
    (store, chunks, vectors)
}

fn filter(field: FilterField, matches: MatchValue) -> Filter {
    Filter {
        conditions: vec![Condition { field, matches }],
    }
}

fn sorted_doc_ids(hits: &[ScoredChunk]) -> Vec<String> {
    let mut ids: Vec<String> = hits.iter().map(|h| h.chunk.doc_id.clone()).collect();
    ids.sort();
    ids
}

#[test]
fn search_orders_by_similarity_and_round_trips_payloads() {
    for target in targets() {
        let (store, chunks, vectors) = filled(&target);
        let who = target.name();
        for (i, vector) in vectors.iter().enumerate() {
            let hits = store.search(vector, 3, None, &stage()).unwrap();
            assert_eq!(hits.len(), 3, "{who}");
            // A stored vector is its own nearest neighbour, with the whole chunk intact.
            assert_eq!(hits[0].chunk, chunks[i], "{who}: payload round trip");
            assert!(
                (hits[0].score - 1.0).abs() < 1e-4,
                "{who}: cosine of itself"
            );
            assert!(
                hits.windows(2).all(|w| w[0].score >= w[1].score),
                "{who}: best first"
            );
        }
        assert_eq!(store.count().unwrap(), chunks.len(), "{who}: exact count");
        // `info` is what every query's span reads, so a server answers it from statistics it
        // refreshes in the background (Qdrant's own collection info is cached for ~2 s too):
        // it converges on the count rather than following each write.
        assert_eq!(
            eventually(|| store.info().points, chunks.len()),
            chunks.len(),
            "{who}: info counts points"
        );
    }
}

/// Polls `read` until it returns `want` or ten seconds pass; returns the last value read.
fn eventually<T: PartialEq>(read: impl Fn() -> T, want: T) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let got = read();
        if got == want || std::time::Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Hybrid retrieval's lexical half: BM25 over every chunk's words (IDF from the collection)
/// finds the chunk that shares the query's rare word, whatever its vector; it comes back with
/// its cosine to the query vector, a filter applies, and a query of stopwords finds nothing.
#[test]
fn lexical_search_matches_words_and_scores_by_cosine() {
    for target in targets() {
        let store = target.open();
        let who = target.name();
        let texts = [
            "git add stages file contents for the next commit",
            "git commit records staged changes",
            "git stash pop applies a stashed change and drops it",
            "git log shows the commit history",
        ];
        let chunks: Vec<Chunk> = texts
            .iter()
            .enumerate()
            .map(|(i, text)| Chunk {
                text: text.to_string(),
                ..chunk(&format!("d{i}"), 0, "lex", json!({}))
            })
            .collect();
        let vectors: Vec<Vec<f32>> = (0..chunks.len()).map(axis_vector).collect();
        store.upsert(&chunks, &vectors, &stage()).unwrap();
        let query = axis_vector(0);
        let hits = store
            .search_lexical(
                &lexical::query("What does stash pop do?"),
                &query,
                2,
                None,
                &stage(),
            )
            .unwrap();
        assert_eq!(
            hits.first().map(|h| h.chunk.doc_id.as_str()),
            Some("d2"),
            "{who}: {hits:?}"
        );
        let dot: f32 = query.iter().zip(&vectors[2]).map(|(a, b)| a * b).sum();
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(
            (hits[0].score - dot / (norm(&query) * norm(&vectors[2]))).abs() < 1e-4,
            "{who}: scored by cosine: {hits:?}"
        );
        let only_d0 = filter(FilterField::DocId, MatchValue::Keyword("d0".into()));
        let filtered = store
            .search_lexical(
                &lexical::query("stash pop"),
                &query,
                2,
                Some(&only_d0),
                &stage(),
            )
            .unwrap();
        assert!(
            filtered.is_empty(),
            "{who}: the filter applies: {filtered:?}"
        );
        let none = store
            .search_lexical(&lexical::query("what is the"), &query, 2, None, &stage())
            .unwrap();
        assert!(none.is_empty(), "{who}: stopwords only: {none:?}");
    }
}

#[test]
fn top_k_bounds_the_result() {
    for target in targets() {
        let (store, _, vectors) = filled(&target);
        let who = target.name();
        assert!(store
            .search(&vectors[0], 0, None, &stage())
            .unwrap()
            .is_empty());
        assert_eq!(
            store.search(&vectors[0], 1, None, &stage()).unwrap().len(),
            1,
            "{who}"
        );
        assert_eq!(
            store.search(&vectors[0], 4, None, &stage()).unwrap().len(),
            4,
            "{who}"
        );
        assert_eq!(
            store
                .search(&vectors[0], 100, None, &stage())
                .unwrap()
                .len(),
            6,
            "{who}: no more than stored"
        );
    }
}

#[test]
fn every_filter_kind() {
    for target in targets() {
        let (store, _, vectors) = filled(&target);
        let who = target.name();
        let search = |f: &Filter| store.search(&vectors[3], 10, Some(f), &stage()).unwrap();

        // doc_id keyword: the query is closest to a chunk of `b`, but only `a` may come back.
        let hits = search(&filter(FilterField::DocId, MatchValue::Keyword("a".into())));
        assert_eq!(sorted_doc_ids(&hits), ["a", "a", "a"], "{who}: doc_id");

        // A keyword with a space matches exactly (not as full text).
        let hits = search(&filter(
            FilterField::Source,
            MatchValue::Keyword("my docs.txt".into()),
        ));
        assert_eq!(hits.len(), 3, "{who}: source keyword with a space");
        let partial = search(&filter(
            FilterField::Source,
            MatchValue::Keyword("docs".into()),
        ));
        assert!(partial.is_empty(), "{who}: keywords match whole values");

        // Any of several keywords.
        let hits = search(&filter(
            FilterField::Source,
            MatchValue::AnyKeyword(vec!["wiki".into(), "web".into()]),
        ));
        assert_eq!(sorted_doc_ids(&hits), ["b", "b", "c"], "{who}: source any");

        // Metadata: keyword, integer, boolean, and a key with a dash.
        let lang_de = filter(
            FilterField::Metadata("lang".into()),
            MatchValue::Keyword("de".into()),
        );
        assert_eq!(sorted_doc_ids(&search(&lang_de)), ["b", "b"], "{who}: lang");
        let year = filter(
            FilterField::Metadata("year".into()),
            MatchValue::Integer(2024),
        );
        assert_eq!(search(&year).len(), 3, "{who}: year");
        let drafts = search(&filter(
            FilterField::Metadata("draft".into()),
            MatchValue::Bool(true),
        ));
        assert_eq!(drafts.len(), 1, "{who}: draft");
        assert_eq!(
            (drafts[0].chunk.doc_id.as_str(), drafts[0].chunk.position),
            ("a", 2)
        );
        let langs = search(&filter(
            FilterField::Metadata("lang".into()),
            MatchValue::AnyKeyword(vec!["de".into(), "fr".into()]),
        ));
        assert_eq!(langs.len(), 2, "{who}: metadata any");
        let absent = search(&filter(
            FilterField::Metadata("no-such-key".into()),
            MatchValue::Keyword("x".into()),
        ));
        assert!(absent.is_empty(), "{who}: missing key matches nothing");

        // Conditions are a conjunction.
        let both = Filter {
            conditions: vec![
                Condition {
                    field: FilterField::Source,
                    matches: MatchValue::Keyword("my docs.txt".into()),
                },
                lang_de.conditions[0].clone(),
            ],
        };
        assert!(search(&both).is_empty(), "{who}: conjunction");
        let en_2024 = Filter {
            conditions: vec![
                Condition {
                    field: FilterField::Metadata("lang".into()),
                    matches: MatchValue::Keyword("en".into()),
                },
                year.conditions[0].clone(),
            ],
        };
        assert_eq!(search(&en_2024).len(), 2, "{who}: conjunction");

        // An empty filter is no filter.
        assert_eq!(search(&Filter::default()).len(), 6, "{who}: empty filter");

        // The same filters as the API parses them.
        let parsed = Filter::from_json(&json!({"doc_id": "b", "metadata.year": 2022})).unwrap();
        let hits = search(&parsed);
        assert_eq!(hits.len(), 1, "{who}: parsed filter");
        assert_eq!(hits[0].chunk.position, 1);
    }
}

#[test]
fn existing_reports_only_stored_ids_in_the_callers_spelling() {
    for target in targets() {
        let (store, chunks, _) = filled(&target);
        let who = target.name();
        let upper = chunks[2].id.to_uppercase();
        let asked = vec![
            chunks[1].id.clone(),
            uuid::Uuid::new_v4().to_string(),
            "not-a-uuid".into(),
            upper.clone(),
            chunks[5].id.clone(),
        ];
        let found = store.existing(&asked, &stage()).unwrap();
        let expected: HashSet<String> = [chunks[1].id.clone(), upper, chunks[5].id.clone()].into();
        assert_eq!(found, expected, "{who}");
        assert!(store.existing(&[], &stage()).unwrap().is_empty(), "{who}");
    }
}

#[test]
fn delete_document_counts_and_removes() {
    for target in targets() {
        let (store, chunks, vectors) = filled(&target);
        let who = target.name();
        assert_eq!(store.delete_document("a", &stage()).unwrap(), 3, "{who}");
        assert_eq!(store.count().unwrap(), 3, "{who}");
        let a_ids: Vec<String> = chunks[..3].iter().map(|c| c.id.clone()).collect();
        assert!(
            store.existing(&a_ids, &stage()).unwrap().is_empty(),
            "{who}"
        );
        let hits = store.search(&vectors[0], 10, None, &stage()).unwrap();
        assert_eq!(sorted_doc_ids(&hits), ["b", "b", "c"], "{who}: a is gone");
        assert_eq!(
            store.delete_document("a", &stage()).unwrap(),
            0,
            "{who}: twice"
        );
        assert_eq!(store.delete_document("nope", &stage()).unwrap(), 0, "{who}");
    }
}

#[test]
fn count_follows_writes() {
    for target in targets() {
        let store = target.open();
        let who = target.name();
        assert_eq!(store.count().unwrap(), 0, "{who}: new collection is empty");
        let (chunks, vectors) = sample();
        store.upsert(&chunks[..4], &vectors[..4], &stage()).unwrap();
        assert_eq!(store.count().unwrap(), 4, "{who}");
        store.upsert(&chunks[4..], &vectors[4..], &stage()).unwrap();
        assert_eq!(store.count().unwrap(), 6, "{who}");
        store.upsert(&[], &[], &stage()).unwrap();
        assert_eq!(store.count().unwrap(), 6, "{who}: empty upsert");
        store.build_index().unwrap();
        assert_eq!(store.count().unwrap(), 6, "{who}: after build_index");
    }
}

#[test]
fn wrong_dimension_and_bad_input_are_refused() {
    for target in targets() {
        let store = target.open();
        let who = target.name();
        let (chunks, vectors) = sample();
        assert!(
            matches!(
                store.upsert(&chunks[..1], &[vec![1.0; DIM - 1]], &stage()),
                Err(StoreError::Dimension { got, want }) if got == DIM - 1 && want == DIM
            ),
            "{who}: upsert"
        );
        assert!(
            matches!(
                store.search(&[1.0; DIM + 1], 3, None, &stage()),
                Err(StoreError::Dimension { got, want }) if got == DIM + 1 && want == DIM
            ),
            "{who}: search"
        );
        assert!(
            store.upsert(&chunks[..2], &vectors[..1], &stage()).is_err(),
            "{who}"
        );
        let mut bad = chunks[0].clone();
        bad.id = "not-a-uuid".into();
        assert!(
            store.upsert(&[bad], &vectors[..1], &stage()).is_err(),
            "{who}"
        );
        assert_eq!(store.count().unwrap(), 0, "{who}: nothing was written");
    }
}

#[test]
fn reupsert_is_idempotent_and_replaces_payloads() {
    for target in targets() {
        let (store, mut chunks, vectors) = filled(&target);
        let who = target.name();
        store.upsert(&chunks, &vectors, &stage()).unwrap();
        assert_eq!(
            store.count().unwrap(),
            chunks.len(),
            "{who}: same ids, same count"
        );
        chunks[0].text = "replaced".into();
        chunks[0].metadata.insert("lang".into(), json!("fr"));
        store.upsert(&chunks[..1], &vectors[..1], &stage()).unwrap();
        assert_eq!(store.count().unwrap(), chunks.len(), "{who}");
        let hits = store.search(&vectors[0], 1, None, &stage()).unwrap();
        assert_eq!(hits[0].chunk, chunks[0], "{who}: payload replaced");
        let fr = filter(
            FilterField::Metadata("lang".into()),
            MatchValue::Keyword("fr".into()),
        );
        let hits = store.search(&vectors[0], 10, Some(&fr), &stage()).unwrap();
        assert_eq!(hits.len(), 1, "{who}: filters see the new payload");
    }
}

#[test]
fn data_persists_across_reopen_and_dimension_is_checked() {
    for target in targets() {
        let who = target.name();
        let (chunks, vectors) = sample();
        let lang_en = filter(
            FilterField::Metadata("lang".into()),
            MatchValue::Keyword("en".into()),
        );
        let results = |store: &dyn VectorStore| -> Vec<Vec<(String, f32)>> {
            vectors
                .iter()
                .flat_map(|q| {
                    [
                        store.search(q, 4, None, &stage()),
                        store.search(q, 4, Some(&lang_en), &stage()),
                    ]
                })
                .map(|hits| {
                    hits.unwrap()
                        .into_iter()
                        .map(|h| (h.chunk.id, h.score))
                        .collect()
                })
                .collect()
        };
        let before = {
            let store = target.open();
            store.upsert(&chunks, &vectors, &stage()).unwrap();
            results(store.as_ref())
        };
        let store = target.open();
        assert_eq!(store.count().unwrap(), chunks.len(), "{who}");
        assert_eq!(
            results(store.as_ref()),
            before,
            "{who}: same results after reopen"
        );
        let hits = store.search(&vectors[4], 1, None, &stage()).unwrap();
        assert_eq!(hits[0].chunk, chunks[4], "{who}: payload survives reopen");
        drop(store);

        let err = target
            .open_with(DIM * 2)
            .err()
            .unwrap_or_else(|| panic!("{who}: another dimension must be refused"));
        let message = err.to_string();
        assert!(
            message.contains(&format!("{DIM}-dimensional"))
                && message.contains(&(DIM * 2).to_string()),
            "{who}: message names both dimensions: {message}"
        );
    }
}
