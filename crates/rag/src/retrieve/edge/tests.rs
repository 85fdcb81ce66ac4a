//! The embedded store against its promises: durable writes, filters, lexical search, deletes and the damage a crash can leave.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tempfile::TempDir;

use super::*;

const DIM: usize = 8;

fn stage() -> Stage {
    Stage::root("test")
}

/// Chunk `position` of `doc_id`, its id a UUID derived from its text.
fn chunk(doc_id: &str, position: u32) -> Chunk {
    let text = format!("{doc_id} chunk {position}");
    Chunk {
        id: uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, text.as_bytes()).to_string(),
        doc_id: doc_id.into(),
        text,
        source: "gen".into(),
        position,
        metadata: Default::default(),
    }
}

/// One-hot-ish vectors: chunk `i` points along axis `i % DIM`, with a small tilt so that
/// no two vectors are identical.
fn axis_vector(i: usize) -> Vec<f32> {
    let mut v = vec![0.01 * i as f32; DIM];
    v[i % DIM] = 1.0;
    v
}

fn random_vectors(rng: &mut StdRng, n: usize, dim: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|_| (0..dim).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        .collect()
}

/// Three documents: a (3 chunks), b (2), c (1); chunk `i` points along axis `i`.
fn sample() -> (Vec<Chunk>, Vec<Vec<f32>>) {
    let chunks: Vec<Chunk> = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("c", 0)]
        .into_iter()
        .map(|(doc, position)| chunk(doc, position))
        .collect();
    let vectors = (0..chunks.len()).map(axis_vector).collect();
    (chunks, vectors)
}

// What every store must do (search, filters, ids, deletes, bad input, reopening) is the
// conformance suite's, in crates/server/tests/api/store_conformance.rs; these tests are about the engine.

/// Chunk `position` of `doc_id` with the given text.
fn text_chunk(doc_id: &str, position: u32, text: &str) -> Chunk {
    Chunk {
        text: text.into(),
        ..chunk(doc_id, position)
    }
}

/// Four chunks about git; the one that answers "undo add" points away from the query.
fn git_sample() -> (Vec<Chunk>, Vec<Vec<f32>>) {
    let chunks = vec![
        text_chunk(
            "rm",
            0,
            "git rm removes files from the working tree and the index",
        ),
        text_chunk(
            "add",
            0,
            "git add stages the content of files for the next commit",
        ),
        text_chunk(
            "commit",
            0,
            "git commit records the staged changes in the repository",
        ),
        text_chunk(
            "reset",
            0,
            "Undo add: after git add frotz.c, git reset unstages it",
        ),
    ];
    // Toward the query (axis 0) in this order; "reset" at right angles to it.
    let vectors = vec![
        vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        vec![0.8, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        vec![0.6, 0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    ];
    (chunks, vectors)
}

#[test]
fn lexical_search_finds_the_rare_word_the_vectors_miss() {
    let dir = TempDir::new().unwrap();
    let store = EdgeStore::open(dir.path(), "lex", DIM).unwrap();
    let (chunks, vectors) = git_sample();
    store.upsert(&chunks, &vectors, &stage()).unwrap();
    let question = "How do I undo git add?";
    let query = vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    for indexed in [false, true] {
        if indexed {
            store.build_index().unwrap();
        }
        let dense = store.search(&query, 2, None, &stage()).unwrap();
        assert!(dense.iter().all(|h| h.chunk.doc_id != "reset"), "{dense:?}");
        let lexical = store
            .search_lexical(&lexical::query(question), &query, 2, None, &stage())
            .unwrap();
        let docs: Vec<&str> = lexical.iter().map(|h| h.chunk.doc_id.as_str()).collect();
        assert!(docs.contains(&"reset"), "indexed {indexed}: {docs:?}");
        // Scored by cosine, like the dense hits.
        let reset = lexical.iter().find(|h| h.chunk.doc_id == "reset").unwrap();
        let cosine = |a: &[f32], b: &[f32]| {
            let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
            dot / (norm(a) * norm(b))
        };
        assert!(
            (reset.score - cosine(&query, &vectors[3])).abs() < 1e-4,
            "{reset:?}"
        );

        let found =
            super::super::hybrid_search(&store, question, &query, 2, 2, None, &stage()).unwrap();
        assert_eq!((found.dense, found.lexical), (2, 2), "{found:?}");
        let ids: HashSet<&str> = found.hits.iter().map(|h| h.chunk.id.as_str()).collect();
        assert_eq!(ids.len(), found.hits.len(), "each chunk once");
        assert_eq!(found.hits.len(), 2 + found.lexical_added);
        assert!(found.hits.windows(2).all(|w| w[0].score >= w[1].score));
        assert!(found.hits.iter().any(|h| h.chunk.doc_id == "reset"));
    }
    // A filter applies to the lexical matches too.
    let only_rm = Filter {
        conditions: vec![super::super::Condition {
            field: super::super::FilterField::DocId,
            matches: MatchValue::Keyword("rm".into()),
        }],
    };
    let filtered = store
        .search_lexical(
            &lexical::query(question),
            &query,
            4,
            Some(&only_rm),
            &stage(),
        )
        .unwrap();
    assert!(
        filtered.iter().all(|h| h.chunk.doc_id == "rm"),
        "{filtered:?}"
    );
}

/// A shard written before hybrid retrieval (dense vectors only) gets its lexical vectors
/// at the next open, and keeps every point.
#[test]
fn an_older_shard_gets_its_lexical_vectors_at_open() {
    let dir = TempDir::new().unwrap();
    let (chunks, vectors) = git_sample();
    {
        let path = dir.path().join("old");
        fs::create_dir_all(&path).unwrap();
        let old = EdgeConfig::builder()
            .vector(
                DEFAULT_VECTOR_NAME,
                EdgeVectorParams::builder(DIM, Distance::Cosine).build(),
            )
            .optimizers(optimizers_config())
            .build();
        let shard = EdgeShard::new(&path, old).unwrap();
        let points: Vec<PointStructPersisted> = chunks
            .iter()
            .zip(&vectors)
            .map(|(c, v)| {
                let key = PointKey::for_chunk(&c.id).unwrap();
                let p = Value::Object(payload::chunk_payload(c));
                PointStruct::new(to_point_id(key), v.clone(), p).into()
            })
            .collect();
        shard
            .update(UpdateOperation::PointOperation(
                PointOperations::UpsertPoints(PointInsertOperations::PointsList(points)),
            ))
            .unwrap();
        shard.flush();
    }
    for round in 0..2 {
        let store = EdgeStore::open(dir.path(), "old", DIM).unwrap();
        assert_eq!(store.count().unwrap(), chunks.len() + round);
        let best = |words: &str| {
            store
                .search_lexical(&lexical::query(words), &axis_vector(0), 1, None, &stage())
                .unwrap()
        };
        let lexical = best("undo add");
        assert_eq!(lexical.len(), 1, "{lexical:?}");
        assert_eq!(lexical[0].chunk.doc_id, "reset");
        // New writes carry both vectors.
        store
            .upsert(
                &[text_chunk("stash", 0, "git stash pop applies the stash")],
                &[axis_vector(5)],
                &stage(),
            )
            .unwrap();
        let pop = best("stash pop");
        assert_eq!(pop[0].chunk.doc_id, "stash");
    }
}

#[test]
fn info_names_the_engine_and_counts_points() {
    let dir = TempDir::new().unwrap();
    let store = EdgeStore::open(dir.path(), "test", DIM).unwrap();
    let (chunks, vectors) = sample();
    store.upsert(&chunks, &vectors, &stage()).unwrap();
    let info = store.info();
    assert_eq!(info.system, "qdrant-edge");
    assert_eq!(info.collection, "test");
    assert_eq!(info.index, "plain");
    assert_eq!(info.points, chunks.len());
    assert!(info.server.is_none());
    store.upsert(&chunks, &vectors, &stage()).unwrap();
    assert_eq!(store.info().points, chunks.len(), "same ids, same points");
}

/// The keyword indexes are made with the shard and are still there when it is reopened.
#[test]
fn keyword_indexes_survive_reopen() {
    let dir = TempDir::new().unwrap();
    let (chunks, vectors) = sample();
    EdgeStore::open(dir.path(), "keep", DIM)
        .unwrap()
        .upsert(&chunks, &vectors, &stage())
        .unwrap();
    let store = EdgeStore::open(dir.path(), "keep", DIM).unwrap();
    let schema = store.shard.info().payload_schema;
    for field in INDEXED_KEYWORDS {
        assert!(
            schema.contains_key(&payload_path(field).unwrap()),
            "{field} indexed"
        );
    }
}

/// What a crash leaves: the files as they are on disk when `upsert` and `delete_document`
/// return, copied while the store is still open (so the engine's flush-on-drop never ran
/// for them). Everything acknowledged must be in the copy.
#[test]
fn acknowledged_writes_are_on_disk_before_drop() {
    let dir = TempDir::new().unwrap();
    let (chunks, vectors) = sample();
    let store = EdgeStore::open(dir.path(), "live", DIM).unwrap();
    let b_ids: Vec<String> = chunks[3..5].iter().map(|c| c.id.clone()).collect();

    store.upsert(&chunks, &vectors, &stage()).unwrap();
    copy_dir(&dir.path().join("live"), &dir.path().join("after-upsert"));
    let copy = EdgeStore::open(dir.path(), "after-upsert", DIM).unwrap();
    assert_eq!(copy.count().unwrap(), chunks.len());
    assert_eq!(
        copy.search(&vectors[5], 1, None, &stage()).unwrap()[0].chunk,
        chunks[5]
    );

    assert_eq!(store.delete_document("b", &stage()).unwrap(), 2);
    copy_dir(&dir.path().join("live"), &dir.path().join("after-delete"));
    let copy = EdgeStore::open(dir.path(), "after-delete", DIM).unwrap();
    assert_eq!(copy.count().unwrap(), chunks.len() - 2);
    assert!(copy.existing(&b_ids, &stage()).unwrap().is_empty());
}

/// `EdgeShard::flush` panics if another thread is inside `update`; the writer lock must
/// keep concurrent upserts, deletes and index builds apart.
#[test]
fn concurrent_writers_do_not_collide() {
    let dir = TempDir::new().unwrap();
    let store = Arc::new(EdgeStore::open(dir.path(), "busy", DIM).unwrap());
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let store = store.clone();
            thread::spawn(move || {
                for round in 0..40u32 {
                    let doc = format!("w{w}-r{round}");
                    let chunks: Vec<Chunk> = (0..5).map(|p| chunk(&doc, p)).collect();
                    let vectors: Vec<Vec<f32>> = (0..5).map(|p| axis_vector(w * 5 + p)).collect();
                    store.upsert(&chunks, &vectors, &stage()).unwrap();
                    if round % 2 == 1 {
                        assert_eq!(store.delete_document(&doc, &stage()).unwrap(), 5);
                    }
                    if w == 0 && round % 10 == 0 {
                        store.build_index().unwrap();
                    }
                    store.search(&vectors[0], 3, None, &stage()).unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().expect("a writer panicked");
    }
    // 4 writers x 20 kept rounds x 5 chunks.
    assert_eq!(store.count().unwrap(), 400);
}

/// The same shard cannot be opened twice: the engine locks its WAL.
#[test]
fn second_open_of_a_live_shard_is_refused() {
    let dir = TempDir::new().unwrap();
    let _store = EdgeStore::open(dir.path(), "busy", DIM).unwrap();
    let err = EdgeStore::open(dir.path(), "busy", DIM)
        .err()
        .expect("a second open must fail");
    assert!(err.to_string().contains("in use"), "{err}");
}

/// Another process's open shard keeps its WAL: the trim takes the engine's lock first.
#[test]
fn a_locked_wal_is_not_trimmed() {
    let dir = TempDir::new().unwrap();
    let wal = dir.path().join("wal");
    fs::create_dir_all(&wal).unwrap();
    for start in [1, 5, 9] {
        fs::write(wal.join(format!("closed-{start}")), b"x").unwrap();
    }
    let holder = fs::File::open(&wal).unwrap();
    holder.try_lock().unwrap();
    let err = trim_wal(&wal).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock, "{err}");
    assert_eq!(fs::read_dir(&wal).unwrap().count(), 3, "nothing removed");
    drop(holder);
    assert_eq!(
        trim_wal(&wal).unwrap().files,
        2,
        "unlocked, all but the newest go"
    );
}

/// Trimming the WAL at open frees its old segments and loses nothing: writes made after a
/// trim are still applied and still there after the next start (the engine skips
/// operations numbered below a segment's version, so renumbering from 0 would drop them).
#[test]
fn wal_trimmed_at_open_keeps_every_write() {
    const BIG_DIM: usize = 384;
    let dir = TempDir::new().unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let wal = dir.path().join("w").join(WAL_DIR);
    let closed = || {
        fs::read_dir(&wal)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("closed-"))
            .count()
    };
    let mut expected = 0;
    {
        let store = EdgeStore::open(dir.path(), "w", BIG_DIM).unwrap();
        // ~1.6 KB of WAL per point: 6,000 points fill two 4 MiB segments and start a third.
        for round in 0..24 {
            let chunks: Vec<Chunk> = (0..250).map(|p| chunk(&format!("d{round}"), p)).collect();
            let vectors = random_vectors(&mut rng, chunks.len(), BIG_DIM);
            store.upsert(&chunks, &vectors, &stage()).unwrap();
            expected += chunks.len();
        }
    }
    assert!(closed() >= 2, "the ingest closed {} WAL segments", closed());
    let before = allocated_bytes(&wal);
    let store = EdgeStore::open(dir.path(), "w", BIG_DIM).unwrap();
    assert_eq!(closed(), 1, "only the newest closed segment is kept");
    let after = store.disk_usage().wal_bytes;
    assert!(after < before, "WAL {before} -> {after} bytes");
    assert_eq!(store.count().unwrap(), expected);
    let late: Vec<Chunk> = (0..3).map(|p| chunk("late", p)).collect();
    store
        .upsert(&late, &random_vectors(&mut rng, 3, BIG_DIM), &stage())
        .unwrap();
    assert_eq!(store.delete_document("d0", &stage()).unwrap(), 250);
    drop(store);
    let store = EdgeStore::open(dir.path(), "w", BIG_DIM).unwrap();
    assert_eq!(store.count().unwrap(), expected - 250 + 3);
    let ids: Vec<String> = late.iter().map(|c| c.id.clone()).collect();
    assert_eq!(store.existing(&ids, &stage()).unwrap().len(), 3);
}

/// `delete_stale` removes a document's other chunks and keeps the listed ones and every
/// other document's.
#[test]
fn delete_stale_keeps_the_listed_chunks() {
    let dir = TempDir::new().unwrap();
    let store = EdgeStore::open(dir.path(), "s", DIM).unwrap();
    let (chunks, vectors) = sample();
    store.upsert(&chunks, &vectors, &stage()).unwrap();
    let keep = vec![chunks[1].id.clone(), "not-a-uuid".to_string()];
    assert_eq!(store.delete_stale("a", &keep, &stage()).unwrap(), 2);
    assert_eq!(store.count().unwrap(), chunks.len() - 2);
    assert_eq!(store.existing(&keep, &stage()).unwrap().len(), 1);
    assert_eq!(store.delete_stale("b", &[], &stage()).unwrap(), 2);
    assert_eq!(store.delete_stale("zzz", &[], &stage()).unwrap(), 0);
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn reopen_with_other_dimension_is_refused() {
    let dir = TempDir::new().unwrap();
    {
        let store = EdgeStore::open(dir.path(), "dims", DIM).unwrap();
        let (chunks, vectors) = sample();
        store.upsert(&chunks, &vectors, &stage()).unwrap();
    }
    let err = EdgeStore::open(dir.path(), "dims", DIM * 2)
        .err()
        .expect("dimension mismatch must be refused");
    let message = err.to_string();
    assert!(
        message.contains(&format!("{DIM}-dimensional")) && message.contains(&(DIM * 2).to_string()),
        "message names both dimensions: {message}"
    );
    // Another collection in the same directory is independent.
    assert!(EdgeStore::open(dir.path(), "other", DIM * 2).is_ok());
}

/// Searches run while the HNSW index is built, and the index survives a restart.
#[test]
fn search_during_build_index() {
    const N: usize = 3000;
    const BIG_DIM: usize = 384;
    let dir = TempDir::new().unwrap();
    let store = Arc::new(EdgeStore::open(dir.path(), "big", BIG_DIM).unwrap());
    let mut rng = StdRng::seed_from_u64(42);
    let vectors = random_vectors(&mut rng, N, BIG_DIM);
    let chunks: Vec<Chunk> = (0..N)
        .map(|i| chunk(&format!("doc{}", i / 10), (i % 10) as u32))
        .collect();
    store.upsert(&chunks, &vectors, &stage()).unwrap();
    assert_eq!(store.info().index, "plain");

    let done = Arc::new(AtomicBool::new(false));
    let completed = Arc::new(AtomicUsize::new(0));
    let searcher = {
        let (store, done, completed) = (store.clone(), done.clone(), completed.clone());
        let queries = vectors[..50].to_vec();
        let expected: Vec<String> = chunks[..50].iter().map(|c| c.id.clone()).collect();
        thread::spawn(move || {
            let mut spans = Vec::new();
            while !done.load(Ordering::Acquire) {
                let i = spans.len() % queries.len();
                let began = Instant::now();
                let hits = store.search(&queries[i], 5, None, &stage()).unwrap();
                spans.push((began, Instant::now()));
                completed.fetch_add(1, Ordering::Release);
                // A stored vector is its own nearest neighbour, before, during and after.
                assert_eq!(hits[0].chunk.id, expected[i]);
            }
            spans
        })
    };
    while completed.load(Ordering::Acquire) == 0 {
        thread::yield_now();
    }

    let started = Instant::now();
    store.build_index().unwrap();
    let ended = Instant::now();
    done.store(true, Ordering::Release);
    let spans = searcher.join().unwrap();

    // Searches that began after the build started and finished in its first half. If
    // `optimize` blocked queries for its whole duration, such a search could finish only
    // near the build's end, never here. (A search already running when the build was
    // called does not count: it may have been what the build waited for.)
    let half = started + (ended - started) / 2;
    let in_first_half = spans
        .iter()
        .filter(|&&(began, finished)| began > started && finished < half)
        .count();
    let during = spans
        .iter()
        .filter(|&&(began, finished)| began > started && finished < ended)
        .count();
    eprintln!(
        "build_index took {:?}; {during} searches finished during it, {in_first_half} in \
         its first half, {} in all",
        ended - started,
        spans.len()
    );
    assert!(
        in_first_half > 0,
        "no search both began and finished in the first half of the index build"
    );
    assert_eq!(store.info().index, "hnsw");
    assert_eq!(store.count().unwrap(), N);

    let queries = random_vectors(&mut rng, 5, BIG_DIM);
    let results = |store: &EdgeStore| -> Vec<Vec<String>> {
        queries
            .iter()
            .map(|q| {
                let hits = store.search(q, 5, None, &stage()).unwrap();
                hits.into_iter().map(|h| h.chunk.id).collect()
            })
            .collect()
    };
    let before = results(&store);
    assert_eq!(
        Arc::strong_count(&store),
        1,
        "the searcher released the store"
    );
    drop(store);

    let store = EdgeStore::open(dir.path(), "big", BIG_DIM).unwrap();
    assert_eq!(
        store.info().index,
        "hnsw",
        "index state read back from the segments"
    );
    assert_eq!(store.count().unwrap(), N);
    assert_eq!(results(&store), before);
}
