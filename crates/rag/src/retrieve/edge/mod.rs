//! The default vector store: Qdrant's own engine (segments, HNSW, payload indexes) embedded
//! in-process through `qdrant-edge`, one shard per collection under the data directory.
//!
//! `qdrant-edge` is pinned to 0.7.2 because 0.8 and 0.9 use `std::debug_assert_matches`, which
//! is stable only from rustc 1.96, and this project builds with 1.95.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use qdrant_edge::{
    Condition as QdrantCondition, CountRequest, CreateIndex, CreateVectorName, Distance,
    EdgeConfig, EdgeOptimizersConfig, EdgeShard, EdgeSparseVectorParamsBuilder, EdgeVectorParams,
    FieldCondition, FieldIndexOperations, Filter as QdrantFilter, HasIdCondition,
    HasVectorCondition, JsonPath, Match, Modifier, NamedQuery, OperationError, PayloadFieldSchema,
    PayloadSchemaType, PointId, PointInsertOperations, PointOperations, PointStruct,
    PointStructPersisted, PointVectorsPersisted, Prefetch, QueryEnum, QueryRequest, Record,
    ScoringQuery, ScrollRequest, SparseVector, UpdateOperation, UpdateVectorsOp, Vector,
    VectorInternal, VectorNameConfig, VectorNameOperations, VectorOperations, VectorPersisted,
    VectorStructPersisted, Vectors, WalOptions, WithPayloadInterface, WithVector,
    DEFAULT_VECTOR_NAME,
};
use serde_json::Value;

use super::lexical::{self, Terms, LEXICAL_VECTOR};
use super::payload::{self, chunk_from_payload, PointKey, WriteLock, INDEXED_KEYWORDS};
use super::{Chunk, Filter, MatchValue, ScoredChunk, StoreError, StoreInfo, VectorStore};
use telemetry::span::Stage;

/// A collection stored in an embedded Qdrant Edge shard at `<dir>/<collection>`.
///
/// Points use the chunk UUID as id, the default (unnamed) dense vector with cosine distance,
/// a sparse vector of BM25 term weights ([`LEXICAL_VECTOR`], IDF applied by the engine), and
/// the chunk fields as payload. Searches are exact scans until [`VectorStore::build_index`]
/// builds HNSW.
pub struct EdgeStore {
    /// Dropped by hand in `Drop`, see there.
    shard: std::mem::ManuallyDrop<EdgeShard>,
    collection: String,
    dimension: usize,
    path: PathBuf,
    /// Serialises every call that writes or flushes. `EdgeShard::flush` panics (`try_lock().expect`)
    /// if the WAL mutex is held by a concurrent `update`, or the segment holder is write-locked by
    /// `optimize` while it swaps segments; holding this around update+flush and around optimize
    /// makes that impossible. Searches never take it.
    writer: WriteLock,
}

impl Drop for EdgeStore {
    fn drop(&mut self) {
        // `EdgeShard`'s own Drop flushes with `expect()`. Every acknowledged write was already
        // flushed, so a failing final flush (its directory removed, a full disk) must not turn
        // shutdown into a panic, or an abort when the thread is already unwinding.
        // SAFETY: `shard` is not used after this.
        let shard = unsafe { std::mem::ManuallyDrop::take(&mut self.shard) };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(shard))).is_err() {
            tracing::warn!(path = %self.path.display(), "final flush of the vector store failed");
        }
    }
}

impl EdgeStore {
    /// Opens the collection's shard, creating it if `dir/<collection>` is absent or empty.
    ///
    /// Fails if an existing shard was created with another dimension or distance, since its
    /// vectors could not be compared with this embedder's.
    pub fn open(dir: &Path, collection: &str, dimension: usize) -> Result<EdgeStore, StoreError> {
        payload::check_positive_dimension(collection, dimension)?;
        let path = dir.join(collection);
        let shard = if is_empty_or_absent(&path)? {
            fs::create_dir_all(&path).map_err(|e| {
                StoreError::Backend(format!("creating shard dir {}: {e}", path.display()))
            })?;
            EdgeShard::new(&path, shard_config(dimension))
                .map_err(backend(&format!("creating shard at {}", path.display())))?
        } else {
            super::damage::check_shard_files(&path)?;
            let freed = trim_wal(&path.join(WAL_DIR)).map_err(|e| {
                StoreError::Backend(format!("trimming the WAL of {}: {e}", path.display()))
            })?;
            if freed.files > 0 {
                tracing::info!(path = %path.display(), files = freed.files, bytes = freed.bytes,
                    "removed write-ahead-log segments the engine never reads back");
            }
            // The engine panics on some damaged files it does not check; a start-up error
            // that names the shard is the answer, not a panic.
            let loaded =
                std::panic::catch_unwind(|| EdgeShard::load(&path, None)).map_err(|p| {
                    let why = p
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| p.downcast_ref::<&str>().copied())
                        .unwrap_or("a panic");
                    StoreError::Backend(format!(
                        "loading shard at {}: a file in it is damaged (the engine failed: {why})",
                        path.display()
                    ))
                })?;
            let shard = loaded.map_err(|e| {
                // The engine flocks its WAL; say what that error means.
                let hint = if e.to_string().contains("WouldBlock") {
                    " (in use by another process or another open store)"
                } else {
                    ""
                };
                StoreError::Backend(format!("loading shard at {}{hint}: {e}", path.display()))
            })?;
            check_compatible(&shard, &path, dimension)?;
            // An existing shard with other optimizer settings gets ours, so that
            // `build_index` means the same everywhere.
            let wanted = optimizers_config();
            // Bound first: the config read guard must be gone before the write below.
            let current = shard.config().optimizers.clone();
            if current != wanted {
                shard
                    .set_optimizers_config(wanted)
                    .map_err(backend("updating optimizer config"))?;
            }
            shard
        };

        let store = EdgeStore {
            shard: std::mem::ManuallyDrop::new(shard),
            collection: collection.to_string(),
            dimension,
            path,
            writer: WriteLock::default(),
        };
        store.ensure_payload_indexes()?;
        store.ensure_lexical_vectors()?;
        Ok(store)
    }

    /// Where the shard lives on disk.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The vector dimension this collection holds.
    pub fn dimension(&self) -> usize {
        self.dimension
    }

    /// Every stored point: its chunk and its (normalised) vector, in id order. For audits
    /// (`ragscope store audit`), not for serving: it reads the whole collection.
    pub fn points(&self) -> Result<Vec<(Chunk, Vec<f32>)>, StoreError> {
        let mut out = Vec::new();
        self.scroll_pages(None, true, |records| {
            for record in records {
                let id = record.id.to_string();
                let vector = record
                    .vector
                    .as_ref()
                    .and_then(|v| v.get(DEFAULT_VECTOR_NAME))
                    .and_then(|v| <&[f32]>::try_from(v).ok())
                    .map(<[f32]>::to_vec)
                    .ok_or_else(|| {
                        StoreError::Backend(format!("point {id} has no dense vector"))
                    })?;
                let payload = record.payload.map(|p| p.0).unwrap_or_default();
                out.push((chunk_from_payload(id, payload)?, vector));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Hands `page` the points `filter` selects (all: `None`), with their payloads and, if
    /// `with_vector`, their vectors, [`payload::UPSERT_BATCH`] at a time, in id order.
    fn scroll_pages(
        &self,
        filter: Option<QdrantFilter>,
        with_vector: bool,
        mut page: impl FnMut(Vec<Record>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut offset = None;
        loop {
            let (records, next) = self
                .shard
                .scroll(ScrollRequest {
                    offset,
                    limit: Some(payload::UPSERT_BATCH),
                    filter: filter.clone(),
                    with_payload: Some(WithPayloadInterface::Bool(true)),
                    with_vector: WithVector::Bool(with_vector),
                    order_by: None,
                })
                .map_err(backend(&format!("scrolling `{}`", self.collection)))?;
            page(records)?;
            match next {
                Some(next) => offset = Some(next),
                None => return Ok(()),
            }
        }
    }

    /// The exact number of points that pass `filter`, counted by the engine's payload index.
    pub fn count_matching(&self, filter: &Filter) -> Result<usize, StoreError> {
        self.shard
            .count(CountRequest {
                filter: to_qdrant_filter(filter)?,
                exact: true,
            })
            .map_err(backend(&format!("counting in `{}`", self.collection)))
    }

    /// Bytes the shard occupies on disk (allocated blocks, so a preallocated sparse WAL
    /// segment counts what it really holds), the WAL's share and its segment files.
    pub fn disk_usage(&self) -> DiskUsage {
        let wal = self.path.join(WAL_DIR);
        DiskUsage {
            total_bytes: allocated_bytes(&self.path),
            wal_bytes: allocated_bytes(&wal),
            wal_segments: fs::read_dir(&wal)
                .map_or(0, |d| d.flatten().filter(is_wal_segment).count()),
        }
    }

    /// Counts and deletes the points `filter` selects (a document's chunks). Under the writer
    /// lock: no upsert can slip in between, so the number returned is the number removed.
    fn delete_matching(&self, filter: QdrantFilter, doc_id: &str) -> Result<usize, StoreError> {
        let _writer = self.writer.hold();
        let removed = self
            .shard
            .count(CountRequest {
                filter: Some(filter.clone()),
                exact: true,
            })
            .map_err(backend(&format!("counting chunks of `{doc_id}`")))?;
        if removed == 0 {
            return Ok(0);
        }
        self.shard
            .update(UpdateOperation::PointOperation(
                PointOperations::DeletePointsByFilter(filter),
            ))
            .map_err(backend(&format!("deleting chunks of `{doc_id}`")))?;
        self.shard.flush();
        Ok(removed)
    }

    /// The `top_k` points nearest to `vector` that pass `filter`, among those `prefetches`
    /// select (all points: none), best first; `doing` names the call in errors.
    fn nearest(
        &self,
        prefetches: Vec<Prefetch>,
        vector: &[f32],
        top_k: usize,
        filter: Option<QdrantFilter>,
        doing: &str,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        let request = QueryRequest {
            prefetches,
            query: Some(ScoringQuery::Vector(QueryEnum::Nearest(
                NamedQuery::default_dense(vector.to_vec()),
            ))),
            filter,
            score_threshold: None,
            limit: top_k,
            offset: 0,
            params: None,
            with_vector: WithVector::Bool(false),
            with_payload: WithPayloadInterface::Bool(true),
        };
        let points = self
            .shard
            .query(request)
            .map_err(backend(&format!("{doing} `{}`", self.collection)))?;
        scored_chunks(points)
    }

    /// Gives a shard made before hybrid retrieval its lexical vectors: declares the sparse
    /// vector, then writes the term weights of every point that lacks them (each start looks,
    /// so a start killed half-way finishes the job at the next).
    fn ensure_lexical_vectors(&self) -> Result<(), StoreError> {
        let _writer = self.writer.hold();
        let declared = self
            .shard
            .config()
            .sparse_vectors
            .contains_key(LEXICAL_VECTOR);
        if !declared {
            // The wrapper types of a vector's config are not exported; their serde form is.
            let config: VectorNameConfig =
                serde_json::from_value(serde_json::json!({"sparse": {"modifier": "idf"}}))
                    .map_err(|e| StoreError::Backend(format!("the lexical vector config: {e}")))?;
            self.shard
                .update(UpdateOperation::VectorNameOperation(
                    VectorNameOperations::CreateVectorName(CreateVectorName {
                        vector_name: LEXICAL_VECTOR.into(),
                        config,
                    }),
                ))
                .map_err(backend(&format!(
                    "adding the lexical vector to `{}`",
                    self.collection
                )))?;
            self.shard.flush();
        }
        let mut lacking = QdrantFilter::new();
        lacking.must_not = Some(vec![QdrantCondition::HasVector(HasVectorCondition::from(
            LEXICAL_VECTOR.to_string(),
        ))]);
        let mut filled = 0usize;
        self.scroll_pages(Some(lacking), false, |records| {
            let mut points = Vec::with_capacity(records.len());
            for record in records {
                let id = record.id;
                let payload = record.payload.map(|p| p.0).unwrap_or_default();
                let chunk = chunk_from_payload(id.to_string(), payload)?;
                let terms = lexical::document(&chunk.text);
                points.push(PointVectorsPersisted {
                    id,
                    vector: VectorStructPersisted::Named(
                        [(LEXICAL_VECTOR.to_string(), sparse_persisted(terms))].into(),
                    ),
                });
            }
            filled += points.len();
            if !points.is_empty() {
                self.shard
                    .update(UpdateOperation::VectorOperation(
                        VectorOperations::UpdateVectors(UpdateVectorsOp {
                            points,
                            update_filter: None,
                        }),
                    ))
                    .map_err(backend(&format!(
                        "writing lexical vectors into `{}`",
                        self.collection
                    )))?;
            }
            Ok(())
        })?;
        if filled > 0 {
            self.shard.flush();
            tracing::info!(path = %self.path.display(), chunks = filled,
                "wrote the lexical (BM25) vectors of chunks stored before hybrid retrieval");
        }
        Ok(())
    }

    fn ensure_payload_indexes(&self) -> Result<(), StoreError> {
        let existing = self.shard.info().payload_schema;
        let _writer = self.writer.hold();
        let mut created = false;
        for field in INDEXED_KEYWORDS {
            let key = payload_path(field)?;
            if existing.contains_key(&key) {
                continue;
            }
            let op = UpdateOperation::FieldIndexOperation(FieldIndexOperations::CreateIndex(
                CreateIndex {
                    field_name: key,
                    field_schema: Some(PayloadFieldSchema::FieldType(PayloadSchemaType::Keyword)),
                },
            ));
            self.shard
                .update(op)
                .map_err(backend(&format!("creating keyword index on `{field}`")))?;
            created = true;
        }
        if created {
            self.shard.flush();
        }
        Ok(())
    }
}

impl VectorStore for EdgeStore {
    fn info(&self) -> StoreInfo {
        let info = self.shard.info();
        StoreInfo {
            system: "qdrant-edge",
            collection: self.collection.clone(),
            // Only segments that went through `optimize` carry HNSW; this reads the segments
            // themselves, so it stays right after a restart. The engine counts every point's
            // sparse (lexical) vector as indexed in any segment, so HNSW shows as the count
            // beyond one a point.
            index: if info.indexed_vectors_count > info.points_count {
                "hnsw"
            } else {
                "plain"
            },
            points: info.points_count,
            server: None,
            cluster: None,
        }
    }

    fn upsert(
        &self,
        chunks: &[Chunk],
        vectors: &[Vec<f32>],
        _stage: &Stage,
    ) -> Result<(), StoreError> {
        let points = payload::upsert_points(
            chunks,
            vectors,
            self.dimension,
            |key, vector, terms, p| -> PointStructPersisted {
                let vectors = Vectors::new_named([
                    (DEFAULT_VECTOR_NAME, Vector::new_dense(vector)),
                    (LEXICAL_VECTOR, Vector(sparse_internal(terms))),
                ]);
                PointStruct::new(to_point_id(key), vectors, Value::Object(p)).into()
            },
        )?;
        if points.is_empty() {
            return Ok(());
        }
        let _writer = self.writer.hold();
        for batch in payload::batches(points) {
            let op = UpdateOperation::PointOperation(PointOperations::UpsertPoints(
                PointInsertOperations::PointsList(batch),
            ));
            self.shard
                .update(op)
                .map_err(backend(&format!("upserting into `{}`", self.collection)))?;
        }
        // Edge 0.7.2 never replays its WAL on load: an update is durable only once the
        // segments are flushed, so acknowledge after the flush.
        self.shard.flush();
        Ok(())
    }

    fn search(
        &self,
        vector: &[f32],
        top_k: usize,
        filter: Option<&Filter>,
        _stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        if !payload::search_needed(vector, top_k, self.dimension)? {
            return Ok(Vec::new());
        }
        let filter = filter.map(to_qdrant_filter).transpose()?.flatten();
        self.nearest(Vec::new(), vector, top_k, filter, "searching")
    }

    fn search_lexical(
        &self,
        terms: &Terms,
        vector: &[f32],
        top_k: usize,
        filter: Option<&Filter>,
        _stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        if !payload::search_needed(vector, top_k, self.dimension)? || terms.is_empty() {
            return Ok(Vec::new());
        }
        let filter = filter.map(to_qdrant_filter).transpose()?.flatten();
        // The BM25 matches are fetched by a prefetch and rescored by the dense query, so every
        // candidate carries its cosine, as the dense ones do.
        let lexical = Prefetch {
            prefetches: Vec::new(),
            query: Some(ScoringQuery::Vector(QueryEnum::Nearest(NamedQuery {
                query: sparse_internal(terms.clone()),
                using: Some(LEXICAL_VECTOR.to_string()),
            }))),
            limit: top_k,
            params: None,
            filter: filter.clone(),
            score_threshold: None,
        };
        self.nearest(vec![lexical], vector, top_k, filter, "searching by terms")
    }

    fn existing(&self, ids: &[String], _stage: &Stage) -> Result<HashSet<String>, StoreError> {
        payload::stored_ids(ids, |keys| {
            let point_ids: Vec<PointId> = keys.into_iter().map(to_point_id).collect();
            let records = self
                .shard
                .retrieve(
                    &point_ids,
                    Some(WithPayloadInterface::Bool(false)),
                    Some(WithVector::Bool(false)),
                )
                .map_err(backend(&format!("looking up ids in `{}`", self.collection)))?;
            Ok(records
                .into_iter()
                .map(|record| from_point_id(record.id))
                .collect())
        })
    }

    fn delete_document(&self, doc_id: &str, _stage: &Stage) -> Result<usize, StoreError> {
        let filter = to_qdrant_filter(&payload::document_filter(doc_id))?
            .expect("a filter with a condition");
        self.delete_matching(filter, doc_id)
    }

    fn delete_stale(
        &self,
        doc_id: &str,
        keep: &[String],
        _stage: &Stage,
    ) -> Result<usize, StoreError> {
        let mut filter = to_qdrant_filter(&payload::document_filter(doc_id))?
            .expect("a filter with a condition");
        let kept: Vec<PointId> = keep
            .iter()
            .filter_map(|id| PointKey::parse(id).map(to_point_id))
            .collect();
        if !kept.is_empty() {
            let kept: HasIdCondition = kept.into_iter().collect();
            filter.must_not = Some(vec![QdrantCondition::HasId(kept)]);
        }
        self.delete_matching(filter, doc_id)
    }

    fn count(&self) -> Result<usize, StoreError> {
        self.shard
            .count(CountRequest {
                filter: None,
                exact: true,
            })
            .map_err(backend(&format!("counting `{}`", self.collection)))
    }

    /// Runs the engine's optimizers, which build HNSW for every segment holding vectors.
    ///
    /// `optimize` wraps the segments in proxies under a brief write lock, builds the new
    /// segment with no shard-wide lock held, then swaps it in under another brief write lock,
    /// so searches keep being served. Upserts and deletes wait for the build to finish (see
    /// the `writer` field for why).
    fn build_index(&self) -> Result<(), StoreError> {
        let _writer = self.writer.hold();
        self.shard.optimize().map_err(backend(&format!(
            "building the index of `{}`",
            self.collection
        )))?;
        self.shard.flush();
        Ok(())
    }
}

/// The config of a new shard: one unnamed cosine vector, the lexical sparse vector with the
/// IDF modifier, and our optimizer settings.
fn shard_config(dimension: usize) -> EdgeConfig {
    EdgeConfig::builder()
        .vector(
            DEFAULT_VECTOR_NAME,
            EdgeVectorParams::builder(dimension, Distance::Cosine).build(),
        )
        .sparse_vector(
            LEXICAL_VECTOR,
            EdgeSparseVectorParamsBuilder::new()
                .modifier(Modifier::Idf)
                .build(),
        )
        .optimizers(optimizers_config())
        .wal_options(WalOptions {
            segment_capacity: WAL_SEGMENT_BYTES,
            ..WalOptions::default()
        })
        .build()
}

/// WAL segment size of new shards (the engine's default is 32 MiB). The WAL is trimmed to its
/// newest closed segment at each start ([`trim_wal`]), so this sets the granularity of what a
/// start can free; an existing shard keeps the size it was made with.
const WAL_SEGMENT_BYTES: usize = 4 * 1024 * 1024;

/// Optimizer settings: the engine indexes only segments above 10 MB of vectors by default
/// (~6.5k MiniLM vectors), so a smaller corpus would stay plain after `build_index`. The
/// threshold is consulted only when `optimize` runs, which we call only on request, so
/// 1 KB means "index whatever is there when asked".
fn optimizers_config() -> EdgeOptimizersConfig {
    EdgeOptimizersConfig {
        indexing_threshold: Some(1),
        ..EdgeOptimizersConfig::default()
    }
}

fn check_compatible(shard: &EdgeShard, path: &Path, dimension: usize) -> Result<(), StoreError> {
    let config = shard.config();
    let vector = config
        .vectors
        .get(DEFAULT_VECTOR_NAME)
        .map(|params| (params.size as u64, params.distance));
    payload::check_compatible(
        &format!("collection at {}", path.display()),
        "the directory",
        vector,
        Distance::Cosine,
        dimension,
    )
}

/// The engine's write-ahead-log directory inside a shard.
const WAL_DIR: &str = "wal";

/// What a shard holds on disk (see [`EdgeStore::disk_usage`]).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct DiskUsage {
    pub total_bytes: u64,
    pub wal_bytes: u64,
    pub wal_segments: usize,
}

/// WAL segment files removed by [`trim_wal`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Trimmed {
    pub files: usize,
    pub bytes: u64,
}

fn is_wal_segment(entry: &fs::DirEntry) -> bool {
    let name = entry.file_name();
    let name = name.to_string_lossy();
    name.starts_with("open-") || name.starts_with("closed-")
}

/// Removes every closed WAL segment but the newest, before the shard is loaded.
///
/// qdrant-edge 0.7.2 appends every update to its WAL and never truncates it (nothing calls
/// the WAL's `ack`), and it never replays it either: a shard's state is its flushed
/// segments, and every write here is flushed (WAL first, then segments) before it is
/// acknowledged. So the closed segments are dead weight that grows with every write ever
/// made. The newest one stays because the WAL numbers operations from its segments' names:
/// were all removed, numbering would restart at 0 and the segments, which skip operations
/// older than their own version, would silently ignore new writes. Removing a prefix of
/// closed segments is what the WAL's own truncation does.
///
/// The engine flocks the WAL directory while the shard is open; this takes the same lock for
/// the trim, so the WAL of a shard another process has open is left alone (`WouldBlock`).
pub fn trim_wal(wal: &Path) -> std::io::Result<Trimmed> {
    let _lock = match fs::File::open(wal) {
        Ok(dir) => {
            dir.try_lock().map_err(|e| match e {
                fs::TryLockError::WouldBlock => std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    "in use by another process or another open store",
                ),
                fs::TryLockError::Error(e) => e,
            })?;
            dir
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Trimmed::default()),
        Err(e) => return Err(e),
    };
    let mut closed: Vec<(u64, PathBuf)> = match fs::read_dir(wal) {
        Ok(entries) => entries
            .flatten()
            .filter_map(|e| {
                let start = e
                    .file_name()
                    .to_str()?
                    .strip_prefix("closed-")?
                    .parse()
                    .ok()?;
                Some((start, e.path()))
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Trimmed::default()),
        Err(e) => return Err(e),
    };
    closed.sort();
    closed.pop();
    let mut trimmed = Trimmed::default();
    for (_, path) in closed {
        trimmed.bytes += allocated_bytes(&path);
        fs::remove_file(&path)?;
        trimmed.files += 1;
    }
    Ok(trimmed)
}

/// Allocated bytes of a file, or of a directory's files recursively.
fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = fs::symlink_metadata(path) else {
        return 0;
    };
    if meta.is_dir() {
        fs::read_dir(path).map_or(0, |d| d.flatten().map(|e| allocated_bytes(&e.path())).sum())
    } else {
        meta.blocks() * 512
    }
}

fn is_empty_or_absent(path: &Path) -> Result<bool, StoreError> {
    match fs::read_dir(path) {
        Ok(mut entries) => Ok(entries.next().is_none()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(StoreError::Backend(format!(
            "reading shard dir {}: {e}",
            path.display()
        ))),
    }
}

/// Wraps an engine error with what we were doing.
fn backend(context: &str) -> impl FnOnce(OperationError) -> StoreError + '_ {
    move |e| StoreError::Backend(format!("{context}: {e}"))
}

/// The engine's answer to a query as chunks with their scores, best first.
fn scored_chunks(points: Vec<qdrant_edge::ScoredPoint>) -> Result<Vec<ScoredChunk>, StoreError> {
    points
        .into_iter()
        .map(|point| {
            let payload = point.payload.map(|p| p.0).unwrap_or_default();
            Ok(ScoredChunk {
                chunk: chunk_from_payload(point.id.to_string(), payload)?,
                score: point.score,
            })
        })
        .collect()
}

fn sparse(terms: Terms) -> SparseVector {
    SparseVector {
        indices: terms.indices,
        values: terms.values,
    }
}

fn sparse_internal(terms: Terms) -> VectorInternal {
    VectorInternal::Sparse(sparse(terms))
}

fn sparse_persisted(terms: Terms) -> VectorPersisted {
    VectorPersisted::Sparse(sparse(terms))
}

fn to_point_id(key: PointKey) -> PointId {
    match key {
        PointKey::Num(n) => PointId::NumId(n),
        PointKey::Uuid(u) => PointId::Uuid(u),
    }
}

fn from_point_id(id: PointId) -> PointKey {
    match id {
        PointId::NumId(n) => PointKey::Num(n),
        PointId::Uuid(u) => PointKey::Uuid(u),
    }
}

fn payload_path(key: &str) -> Result<JsonPath, StoreError> {
    key.parse::<JsonPath>()
        .map_err(|()| StoreError::Backend(format!("`{key}` is not a valid payload path")))
}

/// Our conjunction becomes the engine's `must`; an empty filter is no filter.
fn to_qdrant_filter(filter: &Filter) -> Result<Option<QdrantFilter>, StoreError> {
    let must = payload::must_conditions(filter, |path, matches| {
        let matches = match matches {
            MatchValue::Keyword(word) => Match::from(word.clone()),
            MatchValue::AnyKeyword(words) => Match::from(words.clone()),
            MatchValue::Integer(i) => Match::from(*i),
            MatchValue::Bool(b) => Match::from(*b),
        };
        Ok(QdrantCondition::Field(FieldCondition::new_match(
            payload_path(&path)?,
            matches,
        )))
    })?;
    Ok(must.map(|must| {
        let mut qdrant = QdrantFilter::new();
        qdrant.must = Some(must);
        qdrant
    }))
}

#[cfg(test)]
mod tests;
