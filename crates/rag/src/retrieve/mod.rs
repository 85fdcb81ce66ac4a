//! Vector retrieval: the store trait every backend implements, the chunk payload it stores, and
//! the payload filter a query may carry.
//!
//! The pipeline talks to a `dyn VectorStore`; the default backend is the in-process Qdrant Edge
//! engine ([`edge`]), the other a Qdrant server over gRPC ([`remote`]). Both store the same
//! points and lower filters the same way ([`payload`]). Calls are synchronous: the pipeline runs
//! them on a model-worker thread (an embedded search takes well under a millisecond; the remote
//! store bridges to its own async runtime), never on the HTTP server's async threads.

pub mod audit;
pub mod cluster;
mod damage;
pub mod edge;
pub mod lexical;
pub mod payload;
pub mod remote;

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use lexical::Terms;
use telemetry::span::Stage;

/// One chunk of an ingested document, as stored with its vector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chunk {
    /// UUID derived from the document id and the chunk text, so re-ingesting adds nothing.
    pub id: String,
    pub doc_id: String,
    pub text: String,
    /// Where the document came from (file path, URL, or what the client said).
    pub source: String,
    /// Index of the chunk within its document, from 0.
    pub position: u32,
    /// Client metadata: a flat object of strings, numbers and booleans.
    pub metadata: Map<String, Value>,
}

#[derive(Debug, Clone)]
pub struct ScoredChunk {
    pub chunk: Chunk,
    /// Cosine similarity to the query (vectors are unit length).
    pub score: f32,
}

/// A conjunction of conditions on payload fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    pub conditions: Vec<Condition>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub field: FilterField,
    pub matches: MatchValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FilterField {
    DocId,
    Source,
    /// A key inside `metadata`.
    Metadata(String),
}

#[derive(Debug, Clone, PartialEq)]
pub enum MatchValue {
    Keyword(String),
    /// Any of these keywords.
    AnyKeyword(Vec<String>),
    Integer(i64),
    Bool(bool),
}

impl FilterField {
    /// The payload key the field is stored under.
    pub fn payload_key(&self) -> String {
        match self {
            FilterField::DocId => "doc_id".into(),
            FilterField::Source => "source".into(),
            FilterField::Metadata(key) => format!("metadata.{key}"),
        }
    }
}

impl Filter {
    /// Parses the API's filter object: `{"doc_id": "a"}`, `{"source": {"any": ["x", "y"]}}`,
    /// `{"metadata.lang": "en"}`. The error names the offending field.
    pub fn from_json(value: &Value) -> Result<Filter, String> {
        let Value::Object(fields) = value else {
            return Err("filter: must be an object of field conditions".into());
        };
        let mut conditions = Vec::with_capacity(fields.len());
        for (name, wanted) in fields {
            let field = match name.as_str() {
                "doc_id" => FilterField::DocId,
                "source" => FilterField::Source,
                other => match other.strip_prefix("metadata.") {
                    Some(key) if valid_metadata_key(key) => FilterField::Metadata(key.to_string()),
                    _ => {
                        return Err(format!(
                            "filter.{name}: unknown filter field (known: doc_id, source, metadata.<key>)"
                        ))
                    }
                },
            };
            let matches = match wanted {
                Value::String(s) => MatchValue::Keyword(s.clone()),
                Value::Bool(b) => MatchValue::Bool(*b),
                Value::Number(n) => match n.as_i64() {
                    Some(i) => MatchValue::Integer(i),
                    None => {
                        return Err(format!(
                            "filter.{name}: only integer numbers can be matched"
                        ))
                    }
                },
                Value::Object(o) if o.len() == 1 && o.contains_key("any") => {
                    let items = o["any"]
                        .as_array()
                        .filter(|a| !a.is_empty())
                        .ok_or_else(|| {
                            format!("filter.{name}.any: must be a non-empty array of strings")
                        })?;
                    let words = items
                        .iter()
                        .map(|v| v.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| format!("filter.{name}.any: must contain only strings"))?;
                    MatchValue::AnyKeyword(words)
                }
                _ => {
                    return Err(format!(
                        "filter.{name}: expected a string, integer, boolean or {{\"any\": [..]}}"
                    ))
                }
            };
            conditions.push(Condition { field, matches });
        }
        Ok(Filter { conditions })
    }
}

/// What hybrid retrieval found ([`hybrid_search`]).
#[derive(Debug, Clone, Default)]
pub struct Retrieved {
    /// The dense candidates and the lexical ones they lacked, by cosine, best first.
    pub hits: Vec<ScoredChunk>,
    /// How many the dense search returned.
    pub dense: usize,
    /// How many the lexical search returned, and how many of those the dense ones lacked.
    pub lexical: usize,
    pub lexical_added: usize,
}

/// The `top_k` nearest chunks to `vector` joined by the `lexical_top_k` best BM25 matches of
/// `query`'s words over the whole collection (0: dense only), each once, ordered by cosine.
/// The reranker then decides between them: a lexical match usually has a lower cosine than
/// every dense candidate, which is why the dense search alone never returned it.
pub fn hybrid_search(
    store: &dyn VectorStore,
    query: &str,
    vector: &[f32],
    top_k: usize,
    lexical_top_k: usize,
    filter: Option<&Filter>,
    stage: &Stage,
) -> Result<Retrieved, StoreError> {
    let mut hits = store.search(vector, top_k, filter, stage)?;
    let dense = hits.len();
    let lexical_hits = if lexical_top_k > 0 {
        store.search_lexical(&lexical::query(query), vector, lexical_top_k, filter, stage)?
    } else {
        Vec::new()
    };
    let lexical = lexical_hits.len();
    let seen: HashSet<String> = hits.iter().map(|h| h.chunk.id.clone()).collect();
    hits.extend(
        lexical_hits
            .into_iter()
            .filter(|h| !seen.contains(&h.chunk.id)),
    );
    let lexical_added = hits.len() - dense;
    hits.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(Retrieved {
        hits,
        dense,
        lexical,
        lexical_added,
    })
}

fn valid_metadata_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 64
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// What a backend says about itself, for spans (`db.*`, `server.*`) and `/ready`. Cheap: the
/// pipeline asks for it on every query, so a remote backend answers from what it last saw.
#[derive(Debug, Clone, Serialize)]
pub struct StoreInfo {
    /// `db.system.name`: `qdrant-edge` in process, `qdrant` for a server.
    pub system: &'static str,
    pub collection: String,
    /// `plain` (exact scan) until the HNSW index is built, then `hnsw`; `unknown` while a
    /// remote server has not been reached.
    pub index: &'static str,
    pub points: usize,
    /// `server.address` / `server.port` of a remote store; `None` in process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerAddress>,
    /// A remote store's layout, consistency, timeout and retries; `None` in process.
    #[serde(skip)]
    pub cluster: Option<cluster::Cluster>,
}

/// Where a remote store lives, as the OpenTelemetry `server.*` attributes name it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerAddress {
    pub address: String,
    pub port: u16,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("vector has {got} dimensions, the collection has {want}")]
    Dimension { got: usize, want: usize },
    /// The store could not be reached (a remote server down or unreachable): a condition of
    /// the deployment, not of the request, so the API answers 503 and stays up.
    #[error("vector store unavailable: {0}")]
    Unavailable(String),
    #[error("vector store: {0}")]
    Backend(String),
}

/// A vector store holding chunks and their embeddings. Implementations are shared between
/// threads; writes and searches may run concurrently.
///
/// The calls a request makes take the caller's `stage` (the retrieval or ingest span): a remote
/// backend sends its trace context along, so the server's work joins the request's trace.
/// Callers run these on worker or blocking threads, never on an async executor's threads.
pub trait VectorStore: Send + Sync {
    fn info(&self) -> StoreInfo;

    /// Inserts or replaces chunks; `vectors[i]` belongs to `chunks[i]`. Durable on return.
    fn upsert(
        &self,
        chunks: &[Chunk],
        vectors: &[Vec<f32>],
        stage: &Stage,
    ) -> Result<(), StoreError>;

    /// The `top_k` nearest chunks to `vector` that pass `filter`, best first.
    fn search(
        &self,
        vector: &[f32],
        top_k: usize,
        filter: Option<&Filter>,
        stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError>;

    /// The `top_k` chunks that pass `filter` and best match `terms` by BM25 over the whole
    /// collection (IDF from the collection's statistics), each scored by its cosine to
    /// `vector` and ordered by it, as [`search`](Self::search) scores. A collection without
    /// the lexical vector finds nothing.
    fn search_lexical(
        &self,
        terms: &Terms,
        vector: &[f32],
        top_k: usize,
        filter: Option<&Filter>,
        stage: &Stage,
    ) -> Result<Vec<ScoredChunk>, StoreError>;

    /// Which of these chunk ids are already stored (lets ingest skip re-embedding).
    fn existing(&self, ids: &[String], stage: &Stage) -> Result<HashSet<String>, StoreError>;

    /// Removes every chunk of a document; returns how many were removed.
    fn delete_document(&self, doc_id: &str, stage: &Stage) -> Result<usize, StoreError>;

    /// Removes the chunks of a document whose ids are not in `keep`; returns how many. A
    /// replaced document's new chunks are written first and its old ones removed by this
    /// after, so a crash in between leaves one whole version (or both), never neither.
    fn delete_stale(
        &self,
        doc_id: &str,
        keep: &[String],
        stage: &Stage,
    ) -> Result<usize, StoreError>;

    /// Number of stored chunks.
    fn count(&self) -> Result<usize, StoreError>;

    /// Builds the approximate-nearest-neighbour index. Searches keep being served while it runs.
    fn build_index(&self) -> Result<(), StoreError>;
}
