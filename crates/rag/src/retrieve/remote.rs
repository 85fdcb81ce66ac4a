//! A Qdrant server as the vector store, over gRPC with `qdrant-client`: what lets several
//! stateless ragscope replicas share one collection (or a Qdrant cluster).
//!
//! Same points as the embedded engine (chunk UUID as id, one unnamed cosine vector, the BM25
//! sparse vector of [`lexical`](super::lexical) with the IDF modifier, the chunk as payload,
//! keyword indexes on `doc_id`, `source` and `metadata.title`) and the same filter lowering, both from
//! [`payload`](super::payload). The trait is synchronous and runs on model-worker or blocking
//! threads; each call is driven on a small tokio runtime this store owns, so no caller ever
//! blocks an executor thread. Every call a request makes carries the caller's W3C trace
//! context (`traceparent`, `tracestate`, `baggage`) as gRPC metadata.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qdrant_client::qdrant::point_id::PointIdOptions;
use qdrant_client::qdrant::r#match::MatchValue as QdrantMatch;
use qdrant_client::qdrant::vectors_config::Config as VectorsConfig;
use qdrant_client::qdrant::{
    CollectionInfo, Condition as QdrantCondition, CountPointsBuilder, CreateCollectionBuilder,
    CreateFieldIndexCollectionBuilder, DeletePointsBuilder, Distance, FieldType,
    Filter as QdrantFilter, GetPointsBuilder, Modifier, NamedVectors, PointId, PointStruct,
    PrefetchQueryBuilder, Query, QueryPointsBuilder, RepeatedStrings, ScoredPoint,
    SparseVectorParamsBuilder, SparseVectorsConfigBuilder, UpsertPointsBuilder, Vector,
    VectorInput, VectorParamsBuilder, Vectors,
};
use qdrant_client::{Payload, Qdrant, QdrantError};
use serde_json::Map;
use tokio::runtime::Runtime;
use tonic::Code;

use super::cluster::Cluster;
use super::lexical::{Terms, LEXICAL_VECTOR};
use super::payload::{self, chunk_from_payload, PointKey, WriteLock, INDEXED_KEYWORDS};
use super::{
    Chunk, Filter, MatchValue, ScoredChunk, ServerAddress, StoreError, StoreInfo, VectorStore,
};
use opentelemetry::KeyValue;
use telemetry::names::attr;
use telemetry::span::Stage;

/// Longest wait for a TCP/TLS connection to the server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How old the point count and index state in [`VectorStore::info`] may get.
const STATS_MAX_AGE: Duration = Duration::from_secs(2);

/// A collection on a Qdrant server.
pub struct RemoteStore {
    client: Qdrant,
    /// Drives every call; `None` only while dropping (see `Drop`).
    runtime: Option<Runtime>,
    url: String,
    server: ServerAddress,
    collection: String,
    dimension: usize,
    /// Whether the collection has the lexical sparse vector: those made by this version do;
    /// an older one is served dense-only (a warning at start says so), and its points are
    /// written without it, which the server would refuse.
    lexical: bool,
    /// Point count and index state, refreshed in the background: `info` runs per query and on
    /// async threads, so it must never wait for the server.
    stats: Arc<Mutex<Stats>>,
    /// Serialises this process's writes, so that `delete_document`'s count is the number it
    /// removed. (Replicas sharing the collection are not serialised with each other.)
    writer: WriteLock,
    /// Layout, consistency, timeout and retries ([`Cluster`]).
    cluster: Cluster,
}

#[derive(Debug, Clone)]
struct Stats {
    points: usize,
    index: &'static str,
    refreshed: Option<Instant>,
    refreshing: bool,
}

impl Drop for RemoteStore {
    fn drop(&mut self) {
        // The last handle may go away on an async thread (server shutdown), where dropping a
        // runtime would block and panic; calls in flight have all returned by now.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl RemoteStore {
    /// Connects to the server at `url` (gRPC, e.g. `http://qdrant:6334`) and makes sure the
    /// collection and its payload indexes exist, creating what is missing.
    ///
    /// Fails if the server cannot be reached ([`StoreError::Unavailable`]), or if the
    /// collection exists with another dimension or distance than this embedder's.
    pub fn open(
        url: &str,
        api_key: Option<&str>,
        collection: &str,
        dimension: usize,
    ) -> Result<RemoteStore, StoreError> {
        RemoteStore::open_with(url, api_key, collection, dimension, Cluster::default())
    }

    /// [`RemoteStore::open`] with the cluster settings `cluster` (a collection it creates gets
    /// their layout).
    pub fn open_with(
        url: &str,
        api_key: Option<&str>,
        collection: &str,
        dimension: usize,
        cluster: Cluster,
    ) -> Result<RemoteStore, StoreError> {
        payload::check_positive_dimension(collection, dimension)?;
        let server = server_address(url)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("qdrant-client")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend(format!("starting the Qdrant client runtime: {e}")))?;
        let client = Qdrant::from_url(url)
            .api_key(api_key.map(str::to_string))
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(cluster.timeout)
            .skip_compatibility_check()
            .build()
            .map_err(|e| StoreError::Backend(format!("Qdrant URL {url}: {e}")))?;
        let mut store = RemoteStore {
            client,
            runtime: Some(runtime),
            url: url.to_string(),
            server,
            collection: collection.to_string(),
            dimension,
            lexical: false,
            stats: Arc::new(Mutex::new(Stats {
                points: 0,
                index: "unknown",
                refreshed: None,
                refreshing: false,
            })),
            writer: WriteLock::default(),
            cluster,
        };
        let info = store.ensure_collection()?;
        store.lexical = info
            .config
            .as_ref()
            .and_then(|c| c.params.as_ref())
            .and_then(|p| p.sparse_vectors_config.as_ref())
            .is_some_and(|s| s.map.contains_key(LEXICAL_VECTOR));
        if !store.lexical {
            tracing::warn!(collection = %collection, url = %url,
                "the collection has no `{LEXICAL_VECTOR}` sparse vector (made by an older ragscope): \
                 retrieval is dense-only; re-create it under a new --collection and re-ingest for hybrid retrieval");
        }
        store.record_stats(&info);
        Ok(store)
    }

    /// The vector dimension this collection holds.
    pub fn dimension(&self) -> usize {
        self.dimension
    }

    /// Creates the collection if missing, checks it fits, creates missing payload indexes.
    fn ensure_collection(&self) -> Result<CollectionInfo, StoreError> {
        let info = match self.collection_info()? {
            Some(info) => info,
            None => {
                let name = self.collection.clone();
                let dim = self.dimension as u64;
                let mut sparse = SparseVectorsConfigBuilder::default();
                sparse.add_named_vector_params(
                    LEXICAL_VECTOR,
                    SparseVectorParamsBuilder::default().modifier(Modifier::Idf),
                );
                let mut create = CreateCollectionBuilder::new(name)
                    .vectors_config(VectorParamsBuilder::new(dim, Distance::Cosine))
                    .sparse_vectors_config(sparse)
                    .replication_factor(self.cluster.replication_factor)
                    .write_consistency_factor(self.cluster.write_consistency_factor);
                if let Some(shards) = self.cluster.shards {
                    create = create.shard_number(shards);
                }
                let created = self.run(
                    None,
                    create,
                    |c, r| async move { c.create_collection(r).await },
                );
                match (created, self.collection_info()?) {
                    (_, Some(info)) => info, // ours, or another replica's that won the race
                    (Err(e), None) => return Err(self.fail("creating the collection", e)),
                    (Ok(_), None) => {
                        return Err(StoreError::Backend(format!(
                            "collection `{}` on {} was created but cannot be read back",
                            self.collection, self.url
                        )))
                    }
                }
            }
        };
        self.check_compatible(&info)?;
        self.warn_on_other_layout(&info);
        for field in INDEXED_KEYWORDS {
            if info.payload_schema.contains_key(field) {
                continue;
            }
            let name = self.collection.clone();
            let index = CreateFieldIndexCollectionBuilder::new(name, field, FieldType::Keyword)
                .wait(true)
                .ordering(self.cluster.write_ordering.to_qdrant());
            self.run(
                None,
                index,
                |c, r| async move { c.create_field_index(r).await },
            )
            .map_err(|e| self.fail(&format!("creating the keyword index on `{field}`"), e))?;
        }
        Ok(info)
    }

    /// The collection's info, `None` if it does not exist.
    fn collection_info(&self) -> Result<Option<CollectionInfo>, StoreError> {
        let name = self.collection.clone();
        match self.run(None, name, |c, r| async move { c.collection_info(r).await }) {
            Ok(response) => Ok(response.result),
            Err(QdrantError::ResponseError { status }) if status.code() == Code::NotFound => {
                Ok(None)
            }
            Err(e) => Err(self.fail("reading the collection", e)),
        }
    }

    fn check_compatible(&self, info: &CollectionInfo) -> Result<(), StoreError> {
        let vectors = info
            .config
            .as_ref()
            .and_then(|c| c.params.as_ref())
            .and_then(|p| p.vectors_config.as_ref())
            .and_then(|v| v.config.as_ref());
        let vector = match vectors {
            Some(VectorsConfig::Params(params)) => Some((
                params.size,
                Distance::try_from(params.distance).unwrap_or(Distance::UnknownDistance),
            )),
            _ => None,
        };
        payload::check_compatible(
            &format!("collection `{}` on {}", self.collection, self.url),
            "the collection",
            vector,
            Distance::Cosine,
            self.dimension,
        )
    }

    /// The layout settings apply only to a collection this store creates: an existing one
    /// keeps its own, and the log says where it differs from what was asked.
    fn warn_on_other_layout(&self, info: &CollectionInfo) {
        let Some(params) = info.config.as_ref().and_then(|c| c.params.as_ref()) else {
            return;
        };
        let asked = [
            (
                "--qdrant-shards",
                self.cluster.shards,
                Some(params.shard_number),
            ),
            (
                "--qdrant-replication-factor",
                Some(self.cluster.replication_factor),
                params.replication_factor,
            ),
            (
                "--qdrant-write-consistency",
                Some(self.cluster.write_consistency_factor),
                params.write_consistency_factor,
            ),
        ];
        for (flag, want, has) in asked {
            if let (Some(want), Some(has)) = (want, has) {
                if want != has {
                    tracing::warn!(collection = %self.collection,
                        "{flag} is {want}, but the existing collection has {has}: the setting \
                         applies when ragscope creates a collection; change an existing one \
                         with Qdrant's own API");
                }
            }
        }
    }

    fn record_stats(&self, info: &CollectionInfo) {
        store_stats(&self.stats, info);
    }

    /// Runs one client call (`call` with `request`, cloned for each try) on this store's
    /// runtime, with `stage`'s trace context as metadata.
    /// The call has [`Cluster::timeout`] in all: a call that finds the server or a peer
    /// unreachable is tried again, up to [`Cluster::retries`] times after growing pauses
    /// (every call here is idempotent), while the time left allows; a server that does not
    /// answer at all (a hung peer) costs the timeout once, never once per try. The tries
    /// beyond the first go on the stage as `rag.qdrant.retried`.
    fn run<R, T, F, Fut>(
        &self,
        stage: Option<&Stage>,
        request: R,
        call: F,
    ) -> Result<T, QdrantError>
    where
        R: Clone,
        F: Fn(Qdrant, R) -> Fut,
        Fut: Future<Output = Result<T, QdrantError>>,
    {
        let mut client = self.client.clone();
        if let Some(stage) = stage {
            client
                .config
                .custom_headers
                .extend(telemetry::inject_context(stage.context()));
        }
        let runtime = self.runtime.as_ref().expect("the runtime lives until drop");
        let deadline = Instant::now() + self.cluster.timeout;
        let mut retried = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // The timer is made inside the runtime: it needs the runtime's clock.
            let attempt = call(client.clone(), request.clone());
            let result = runtime
                .block_on(async { tokio::time::timeout(left, attempt).await })
                .unwrap_or_else(|_| {
                    Err(QdrantError::ResponseError {
                        status: tonic::Status::deadline_exceeded(format!(
                            "no answer within {} ms",
                            self.cluster.timeout.as_millis()
                        )),
                    })
                });
            let pause = Cluster::backoff(retried + 1);
            let again = matches!(&result, Err(QdrantError::ResponseError { status })
                    if unreachable(status) && status.code() != Code::DeadlineExceeded)
                && retried < self.cluster.retries
                && Instant::now() + pause < deadline;
            if !again {
                if let Some(stage) = stage.filter(|_| retried > 0) {
                    stage.set(KeyValue::new(attr::QDRANT_RETRIED, i64::from(retried)));
                }
                return result;
            }
            retried += 1;
            std::thread::sleep(pause);
        }
    }

    /// What a failed call means for the caller: unreachable servers are `Unavailable` (503).
    fn fail(&self, doing: &str, e: QdrantError) -> StoreError {
        // A common slip: the REST port answers HTTP/1, so gRPC fails in confusing ways there.
        let doing = if self.server.port == 6333 {
            format!("{doing}; note 6333 is Qdrant's REST port, its gRPC port is 6334")
        } else {
            doing.to_string()
        };
        match e {
            QdrantError::ResponseError { status } if unreachable(&status) => {
                StoreError::Unavailable(format!(
                    "Qdrant at {} did not answer ({doing}): {}",
                    self.url,
                    status.message()
                ))
            }
            QdrantError::ResourceExhaustedError {
                status,
                retry_after_seconds,
            } => StoreError::Unavailable(format!(
                "Qdrant at {} is overloaded ({doing}), retry after {retry_after_seconds} s: {}",
                self.url,
                status.message()
            )),
            QdrantError::ResponseError { status }
                if matches!(
                    status.code(),
                    Code::Unauthenticated | Code::PermissionDenied
                ) =>
            {
                StoreError::Backend(format!(
                    "Qdrant at {} refused the request ({doing}); check --qdrant-api-key: {}",
                    self.url,
                    status.message()
                ))
            }
            QdrantError::ResponseError { status } => StoreError::Backend(format!(
                "{doing} on Qdrant at {}: {:?}: {}",
                self.url,
                status.code(),
                status.message()
            )),
            other => StoreError::Backend(format!("{doing} on Qdrant at {}: {other}", self.url)),
        }
    }

    /// Counts and deletes the points `filter` selects (a document's chunks), under the
    /// writer lock so the number returned is the number removed.
    fn delete_matching(
        &self,
        filter: QdrantFilter,
        doc_id: &str,
        stage: &Stage,
    ) -> Result<usize, StoreError> {
        let _writer = self.writer.hold();
        let name = self.collection.clone();
        let count_filter = filter.clone();
        let count = CountPointsBuilder::new(name)
            .filter(count_filter)
            .exact(true)
            .read_consistency(self.cluster.read_consistency.to_qdrant());
        let removed = self
            .run(Some(stage), count, |c, r| async move { c.count(r).await })
            .map_err(|e| self.fail(&format!("counting chunks of `{doc_id}`"), e))?
            .result
            .map_or(0, |r| r.count as usize);
        if removed == 0 {
            return Ok(0);
        }
        let name = self.collection.clone();
        let delete = DeletePointsBuilder::new(name)
            .points(filter)
            .wait(true)
            .ordering(self.cluster.write_ordering.to_qdrant());
        self.run(Some(stage), delete, |c, r| async move {
            c.delete_points(r).await
        })
        .map_err(|e| self.fail(&format!("deleting chunks of `{doc_id}`"), e))?;
        Ok(removed)
    }
}

impl VectorStore for RemoteStore {
    fn info(&self) -> StoreInfo {
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let stale = stats
            .refreshed
            .is_none_or(|at| at.elapsed() > STATS_MAX_AGE);
        if stale && !stats.refreshing {
            // Refreshed in the background: this may run on an async thread, and a query
            // should not wait for a second round trip.
            stats.refreshing = true;
            let (client, name, shared) = (
                self.client.clone(),
                self.collection.clone(),
                self.stats.clone(),
            );
            if let Some(runtime) = &self.runtime {
                runtime.spawn(async move {
                    let result = client.collection_info(name).await;
                    match result.ok().and_then(|r| r.result) {
                        Some(info) => store_stats(&shared, &info),
                        None => {
                            let mut stats = shared.lock().unwrap_or_else(|e| e.into_inner());
                            stats.refreshing = false;
                            stats.refreshed = Some(Instant::now());
                        }
                    }
                });
            }
        }
        StoreInfo {
            system: "qdrant",
            collection: self.collection.clone(),
            index: stats.index,
            points: stats.points,
            server: Some(self.server.clone()),
            cluster: Some(self.cluster),
        }
    }

    fn upsert(
        &self,
        chunks: &[Chunk],
        vectors: &[Vec<f32>],
        stage: &Stage,
    ) -> Result<(), StoreError> {
        let points =
            payload::upsert_points(chunks, vectors, self.dimension, |key, vector, terms, p| {
                let vectors: Vectors = if self.lexical {
                    NamedVectors::default()
                        .add_vector("", Vector::new_dense(vector))
                        .add_vector(
                            LEXICAL_VECTOR,
                            Vector::new_sparse(terms.indices, terms.values),
                        )
                        .into()
                } else {
                    vector.into()
                };
                PointStruct::new(to_point_id(key), vectors, Payload::from(p))
            })?;
        let _writer = self.writer.hold();
        for batch in payload::batches(points) {
            let name = self.collection.clone();
            // `wait`: the call returns once the server has applied and logged the batch.
            let upsert = UpsertPointsBuilder::new(name, batch)
                .wait(true)
                .ordering(self.cluster.write_ordering.to_qdrant());
            self.run(Some(stage), upsert, |c, r| async move {
                c.upsert_points(r).await
            })
            .map_err(|e| self.fail("upserting points", e))?;
        }
        Ok(())
    }

    fn search(
        &self,
        vector: &[f32],
        top_k: usize,
        filter: Option<&Filter>,
        stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        if !payload::search_needed(vector, top_k, self.dimension)? {
            return Ok(Vec::new());
        }
        let mut query = QueryPointsBuilder::new(self.collection.clone())
            .query(vector.to_vec())
            .limit(top_k as u64)
            .with_payload(true)
            .read_consistency(self.cluster.read_consistency.to_qdrant());
        if let Some(filter) = filter.map(to_qdrant_filter).transpose()?.flatten() {
            query = query.filter(filter);
        }
        let response = self
            .run(Some(stage), query, |c, r| async move { c.query(r).await })
            .map_err(|e| self.fail("searching", e))?;
        scored_chunks(response.result)
    }

    fn search_lexical(
        &self,
        terms: &Terms,
        vector: &[f32],
        top_k: usize,
        filter: Option<&Filter>,
        stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError> {
        if !payload::search_needed(vector, top_k, self.dimension)?
            || terms.is_empty()
            || !self.lexical
        {
            return Ok(Vec::new());
        }
        let filter = filter.map(to_qdrant_filter).transpose()?.flatten();
        // As in the embedded store: BM25 matches from a prefetch, rescored by the dense query.
        let mut lexical = PrefetchQueryBuilder::default()
            .query(Query::new_nearest(VectorInput::new_sparse(
                terms.indices.clone(),
                terms.values.clone(),
            )))
            .using(LEXICAL_VECTOR)
            .limit(top_k as u64);
        let mut query = QueryPointsBuilder::new(self.collection.clone());
        if let Some(filter) = filter {
            lexical = lexical.filter(filter.clone());
            query = query.filter(filter);
        }
        let query = query
            .add_prefetch(lexical)
            .query(vector.to_vec())
            .limit(top_k as u64)
            .with_payload(true)
            .read_consistency(self.cluster.read_consistency.to_qdrant());
        let response = self
            .run(Some(stage), query, |c, r| async move { c.query(r).await })
            .map_err(|e| self.fail("searching by terms", e))?;
        scored_chunks(response.result)
    }

    fn existing(&self, ids: &[String], stage: &Stage) -> Result<HashSet<String>, StoreError> {
        payload::stored_ids(ids, |keys| {
            let point_ids: Vec<PointId> = keys.into_iter().map(to_point_id).collect();
            let name = self.collection.clone();
            let get = GetPointsBuilder::new(name, point_ids)
                .with_payload(false)
                .with_vectors(false)
                .read_consistency(self.cluster.read_consistency.to_qdrant());
            let response = self
                .run(
                    Some(stage),
                    get,
                    |c, r| async move { c.get_points(r).await },
                )
                .map_err(|e| self.fail("looking up ids", e))?;
            Ok(response
                .result
                .iter()
                .filter_map(|point| PointKey::parse(&point_id_string(point.id.as_ref()).ok()?))
                .collect())
        })
    }

    fn delete_document(&self, doc_id: &str, stage: &Stage) -> Result<usize, StoreError> {
        let filter = to_qdrant_filter(&payload::document_filter(doc_id))?
            .expect("a filter with a condition");
        self.delete_matching(filter, doc_id, stage)
    }

    fn delete_stale(
        &self,
        doc_id: &str,
        keep: &[String],
        stage: &Stage,
    ) -> Result<usize, StoreError> {
        let mut filter = to_qdrant_filter(&payload::document_filter(doc_id))?
            .expect("a filter with a condition");
        let kept: Vec<PointId> = keep
            .iter()
            .filter_map(|id| PointKey::parse(id).map(to_point_id))
            .collect();
        if !kept.is_empty() {
            filter.must_not = vec![QdrantCondition::has_id(kept)];
        }
        self.delete_matching(filter, doc_id, stage)
    }

    fn count(&self) -> Result<usize, StoreError> {
        let count = CountPointsBuilder::new(self.collection.clone())
            .exact(true)
            .read_consistency(self.cluster.read_consistency.to_qdrant());
        let response = self
            .run(None, count, |c, r| async move { c.count(r).await })
            .map_err(|e| self.fail("counting points", e))?;
        Ok(response.result.map_or(0, |r| r.count as usize))
    }

    /// Nothing to do: the server's optimizers build HNSW in the background by themselves, for
    /// every segment that outgrows the collection's indexing threshold (Qdrant's default,
    /// about 6.5k MiniLM vectors); below it an exact scan is as fast. There is no call that
    /// forces an index build.
    fn build_index(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

fn store_stats(shared: &Mutex<Stats>, info: &CollectionInfo) {
    let mut stats = shared.lock().unwrap_or_else(|e| e.into_inner());
    stats.points = info.points_count.unwrap_or(0) as usize;
    // Sparse (lexical) vectors count as indexed from the start, one a point, as in the
    // embedded engine: HNSW is what is indexed beyond them.
    stats.index = if info.indexed_vectors_count.unwrap_or(0) as usize > stats.points {
        "hnsw"
    } else {
        "plain"
    };
    stats.refreshed = Some(Instant::now());
    stats.refreshing = false;
}

/// Connection failures and timeouts: the server is down or unreachable, not the request wrong.
/// On a cluster the peer that takes a call may itself fail to reach the peer holding a shard;
/// it answers `Internal` ("1 of 1 read operations failed: … tcp connect error …"), which is a
/// dead peer, not a bug.
fn unreachable(status: &tonic::Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => true,
        Code::Internal => {
            let m = status.message();
            // The client reports a failed connect as `Internal`, too.
            m.starts_with("Failed to connect")
                || m.contains("operations failed")
                || m.contains("connect error")
                || m.contains("transport error")
                || m.contains("No active replica")
        }
        _ => false,
    }
}

/// `server.address` and `server.port` from the URL (the scheme's port when none is given).
fn server_address(url: &str) -> Result<ServerAddress, StoreError> {
    let uri: tonic::transport::Uri = url
        .parse()
        .map_err(|e| StoreError::Backend(format!("Qdrant URL `{url}` is not a URL: {e}")))?;
    let address = uri
        .host()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| {
            StoreError::Backend(format!(
                "Qdrant URL `{url}` has no host (expected e.g. http://qdrant:6334)"
            ))
        })?
        .trim_matches(['[', ']'])
        .to_string();
    let port = match (uri.port_u16(), uri.scheme_str()) {
        (Some(port), _) => port,
        (None, Some("https")) => 443,
        (None, Some("http")) => 80,
        _ => {
            return Err(StoreError::Backend(format!(
                "Qdrant URL `{url}` needs http:// or https://"
            )))
        }
    };
    Ok(ServerAddress { address, port })
}

/// The server's answer to a query as chunks with their scores, best first.
fn scored_chunks(points: Vec<ScoredPoint>) -> Result<Vec<ScoredChunk>, StoreError> {
    points
        .into_iter()
        .map(|point| {
            let payload: Map<String, serde_json::Value> = point
                .payload
                .into_iter()
                .map(|(k, v)| (k, v.into_json()))
                .collect();
            Ok(ScoredChunk {
                chunk: chunk_from_payload(point_id_string(point.id.as_ref())?, payload)?,
                score: point.score,
            })
        })
        .collect()
}

fn to_point_id(key: PointKey) -> PointId {
    match key {
        PointKey::Num(n) => PointId::from(n),
        PointKey::Uuid(u) => PointId::from(u.hyphenated().to_string()),
    }
}

fn point_id_string(id: Option<&PointId>) -> Result<String, StoreError> {
    match id.and_then(|id| id.point_id_options.as_ref()) {
        Some(PointIdOptions::Num(n)) => Ok(n.to_string()),
        // Normalised, so both backends spell ids alike whatever the server sends.
        Some(PointIdOptions::Uuid(u)) => {
            Ok(PointKey::parse(u).map_or(u.clone(), |k| k.to_string()))
        }
        None => Err(StoreError::Backend(
            "a point came back without an id".into(),
        )),
    }
}

/// Our conjunction becomes the server's `must`; an empty filter is no filter. Strings match
/// as keywords (exact), never as full text, as in the embedded engine.
fn to_qdrant_filter(filter: &Filter) -> Result<Option<QdrantFilter>, StoreError> {
    let must = payload::must_conditions(filter, |path, matches| {
        let matches = match matches {
            MatchValue::Keyword(word) => QdrantMatch::Keyword(word.clone()),
            MatchValue::AnyKeyword(words) => QdrantMatch::Keywords(RepeatedStrings {
                strings: words.clone(),
            }),
            MatchValue::Integer(i) => QdrantMatch::Integer(*i),
            MatchValue::Bool(b) => QdrantMatch::Boolean(*b),
        };
        Ok(QdrantCondition::matches(path, matches))
    })?;
    Ok(must.map(QdrantFilter::must))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retrieve::{Condition, FilterField};

    #[test]
    fn server_address_from_url() {
        let a = server_address("http://qdrant:6334").unwrap();
        assert_eq!((a.address.as_str(), a.port), ("qdrant", 6334));
        let a = server_address("https://x.cloud.example").unwrap();
        assert_eq!((a.address.as_str(), a.port), ("x.cloud.example", 443));
        let a = server_address("http://[::1]:6334").unwrap();
        assert_eq!(a.address, "::1");
        assert!(server_address("qdrant").is_err());
        assert!(server_address("not a url").is_err());
    }

    #[test]
    fn strings_match_as_keywords_even_with_spaces() {
        let filter = Filter {
            conditions: vec![
                Condition {
                    field: FilterField::Source,
                    matches: MatchValue::Keyword("my docs.txt".into()),
                },
                Condition {
                    field: FilterField::Metadata("lang".into()),
                    matches: MatchValue::AnyKeyword(vec!["en".into(), "de".into()]),
                },
            ],
        };
        let lowered = to_qdrant_filter(&filter).unwrap().unwrap();
        assert_eq!(
            lowered,
            QdrantFilter::must([
                QdrantCondition::matches("source", QdrantMatch::Keyword("my docs.txt".into())),
                QdrantCondition::matches(
                    "metadata.\"lang\"",
                    QdrantMatch::Keywords(RepeatedStrings {
                        strings: vec!["en".into(), "de".into()]
                    })
                ),
            ])
        );
        assert_eq!(to_qdrant_filter(&Filter::default()).unwrap(), None);
    }

    #[test]
    fn dead_server_is_unavailable() {
        // A port that was just free: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let err = RemoteStore::open(&url, None, "c", 4)
            .err()
            .expect("no server: open fails");
        assert!(
            matches!(&err, StoreError::Unavailable(m) if m.contains(&url)),
            "{err}"
        );
    }
}
