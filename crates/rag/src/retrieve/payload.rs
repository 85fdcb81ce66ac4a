//! What both Qdrant backends store, ask for and refuse, written once: the checks on a
//! collection and on each call's arguments, the point id of a chunk, the chunk's payload and its
//! way back, the payload fields that get a keyword index, and our [`Filter`] lowered to Qdrant's
//! model (a `must` list of field conditions on payload paths).
//!
//! The embedded engine and the server take the same concepts in different Rust types (the
//! engine's segment types, the client's protobuf messages); each backend only maps these
//! values to its types, so ids, payloads, errors and filter semantics cannot drift apart.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::{Mutex, MutexGuard};

use serde_json::{Map, Value};

use super::lexical::{self, Terms};
use super::{Chunk, Condition, Filter, FilterField, MatchValue, StoreError};

/// Payload fields with a keyword index: the filters the API exposes first, and the page title
/// that entry lookup searches within (`pipeline::lookup`; without the index that search
/// read every payload, ~15 ms over the git-doc corpus).
pub const INDEXED_KEYWORDS: [&str; 3] = ["doc_id", "source", "metadata.title"];

/// Points per write: keeps each request (a WAL record in the engine, a gRPC message to the
/// server) and each segment write-lock hold small.
pub const UPSERT_BATCH: usize = 256;

/// Refuses to open a collection for vectors of no dimension.
pub fn check_positive_dimension(collection: &str, dimension: usize) -> Result<(), StoreError> {
    if dimension == 0 {
        return Err(StoreError::Backend(format!(
            "collection `{collection}`: vector dimension must be positive"
        )));
    }
    Ok(())
}

/// Refuses an existing collection whose vectors could not be compared with the embedder's.
/// `vector` is the size and distance of its unnamed dense vector (`None`: it has none);
/// `collection` names it in the messages and `remove` says what a user would delete to start
/// over.
pub fn check_compatible<D: Debug + PartialEq>(
    collection: &str,
    remove: &str,
    vector: Option<(u64, D)>,
    cosine: D,
    dimension: usize,
) -> Result<(), StoreError> {
    let Some((size, distance)) = vector else {
        return Err(StoreError::Backend(format!(
            "{collection} has no unnamed dense vector: not a ragscope collection"
        )));
    };
    if size != dimension as u64 {
        return Err(StoreError::Backend(format!(
            "{collection} holds {size}-dimensional vectors but the embedder produces {dimension}; \
             use another collection name or delete {remove} and re-ingest"
        )));
    }
    if distance != cosine {
        return Err(StoreError::Backend(format!(
            "{collection} uses {distance:?} distance, ragscope needs cosine"
        )));
    }
    Ok(())
}

/// A query or stored vector must have the collection's dimension.
fn check_dimension(vector: &[f32], dimension: usize) -> Result<(), StoreError> {
    if vector.len() != dimension {
        return Err(StoreError::Dimension {
            got: vector.len(),
            want: dimension,
        });
    }
    Ok(())
}

/// Checks a search's arguments: `Ok(false)` when it can find nothing (`top_k` is 0), so the
/// backend need not ask. The vector is checked even then, so a wrong one fails alike always.
pub fn search_needed(vector: &[f32], top_k: usize, dimension: usize) -> Result<bool, StoreError> {
    check_dimension(vector, dimension)?;
    Ok(top_k > 0)
}

/// Checks an upsert's arguments and builds the backend's points, each by `point` from the
/// chunk's point id, its vector, its text's lexical term weights and its payload. Nothing is
/// built, so nothing is written, unless every chunk has a vector of the right dimension and a
/// storable id.
pub fn upsert_points<P>(
    chunks: &[Chunk],
    vectors: &[Vec<f32>],
    dimension: usize,
    mut point: impl FnMut(PointKey, Vec<f32>, Terms, Map<String, Value>) -> P,
) -> Result<Vec<P>, StoreError> {
    if chunks.len() != vectors.len() {
        return Err(StoreError::Backend(format!(
            "upsert: {} chunks but {} vectors",
            chunks.len(),
            vectors.len()
        )));
    }
    chunks
        .iter()
        .zip(vectors)
        .map(|(chunk, vector)| {
            check_dimension(vector, dimension)?;
            let key = PointKey::for_chunk(&chunk.id)?;
            let terms = lexical::document(&chunk.text);
            Ok(point(key, vector.clone(), terms, chunk_payload(chunk)))
        })
        .collect()
}

/// `points` in writes of at most [`UPSERT_BATCH`], in order.
pub fn batches<P>(points: Vec<P>) -> impl Iterator<Item = Vec<P>> {
    let mut points = points.into_iter().peekable();
    std::iter::from_fn(move || {
        points.peek()?;
        Some(points.by_ref().take(UPSERT_BATCH).collect())
    })
}

/// Which of `ids` are stored, in the caller's spelling (a backend prints UUIDs in canonical
/// form). `lookup` gets the distinct point ids and returns those it found; an id that is not
/// a valid point id cannot have been stored, so it is never looked up.
pub fn stored_ids(
    ids: &[String],
    lookup: impl FnOnce(Vec<PointKey>) -> Result<Vec<PointKey>, StoreError>,
) -> Result<HashSet<String>, StoreError> {
    let wanted: HashMap<PointKey, &String> = ids
        .iter()
        .filter_map(|id| PointKey::parse(id).map(|key| (key, id)))
        .collect();
    if wanted.is_empty() {
        return Ok(HashSet::new());
    }
    let found = lookup(wanted.keys().copied().collect())?;
    Ok(found
        .iter()
        .filter_map(|key| wanted.get(key).map(|id| (*id).clone()))
        .collect())
}

/// The filter that selects every chunk of one document (what `delete_document` removes).
pub fn document_filter(doc_id: &str) -> Filter {
    Filter {
        conditions: vec![Condition {
            field: FilterField::DocId,
            matches: MatchValue::Keyword(doc_id.to_string()),
        }],
    }
}

/// Serialises a store's writes. It guards no data, so a writer that panicked leaves nothing
/// inconsistent behind it: the lock is taken even when poisoned.
#[derive(Debug, Default)]
pub struct WriteLock(Mutex<()>);

impl WriteLock {
    pub fn hold(&self) -> MutexGuard<'_, ()> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A point id as Qdrant accepts it: an unsigned integer or a UUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PointKey {
    Num(u64),
    Uuid(uuid::Uuid),
}

impl PointKey {
    /// The point id of a chunk id; `None` if Qdrant could not store it (so it was never stored).
    pub fn parse(id: &str) -> Option<PointKey> {
        if let Ok(num) = id.parse::<u64>() {
            return Some(PointKey::Num(num));
        }
        uuid::Uuid::parse_str(id).ok().map(PointKey::Uuid)
    }

    /// Like [`parse`](Self::parse), for ids about to be written.
    pub fn for_chunk(id: &str) -> Result<PointKey, StoreError> {
        Self::parse(id).ok_or_else(|| StoreError::Backend(format!("chunk id `{id}` is not a UUID")))
    }
}

impl std::fmt::Display for PointKey {
    /// The spelling Qdrant uses in responses (hyphenated lower-case UUIDs).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PointKey::Num(n) => write!(f, "{n}"),
            PointKey::Uuid(u) => write!(f, "{}", u.hyphenated()),
        }
    }
}

/// The payload stored with a chunk's vector.
pub fn chunk_payload(chunk: &Chunk) -> Map<String, Value> {
    let mut payload = Map::with_capacity(5);
    payload.insert("doc_id".into(), Value::String(chunk.doc_id.clone()));
    payload.insert("text".into(), Value::String(chunk.text.clone()));
    payload.insert("source".into(), Value::String(chunk.source.clone()));
    payload.insert("position".into(), Value::from(chunk.position));
    payload.insert("metadata".into(), Value::Object(chunk.metadata.clone()));
    payload
}

/// The chunk back from a stored point; `id` is the point id as the backend prints it.
pub fn chunk_from_payload(
    id: String,
    mut payload: Map<String, Value>,
) -> Result<Chunk, StoreError> {
    let mut text_field = |name: &str| match payload.remove(name) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(StoreError::Backend(format!(
            "point {id}: payload field `{name}` is missing or not a string"
        ))),
    };
    let doc_id = text_field("doc_id")?;
    let text = text_field("text")?;
    let source = text_field("source")?;
    let position = payload
        .get("position")
        .and_then(Value::as_u64)
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| {
            StoreError::Backend(format!(
                "point {id}: payload field `position` is missing or not a u32"
            ))
        })?;
    let metadata = match payload.remove("metadata") {
        Some(Value::Object(map)) => map,
        _ => Map::new(),
    };
    Ok(Chunk {
        id,
        doc_id,
        text,
        source,
        position,
        metadata,
    })
}

/// The payload path a filter field reads, in Qdrant's JSON-path syntax. A metadata key is
/// quoted so that a key with `.` or `[` stays one key instead of a deeper path.
pub fn field_path(field: &FilterField) -> Result<String, StoreError> {
    match field {
        FilterField::Metadata(key) => {
            if key.is_empty() || key.contains(['"', '\\']) {
                return Err(StoreError::Backend(format!(
                    "metadata key `{key}` cannot be used in a filter"
                )));
            }
            Ok(format!("metadata.\"{key}\""))
        }
        other => Ok(other.payload_key()),
    }
}

/// Our conjunction as Qdrant's `must` list, each condition built by the backend's `make` from
/// the payload path and the value to match; `None` for an empty filter, which is no filter.
pub fn must_conditions<C>(
    filter: &Filter,
    mut make: impl FnMut(String, &MatchValue) -> Result<C, StoreError>,
) -> Result<Option<Vec<C>>, StoreError> {
    if filter.conditions.is_empty() {
        return Ok(None);
    }
    filter
        .conditions
        .iter()
        .map(|condition| make(field_path(&condition.field)?, &condition.matches))
        .collect::<Result<Vec<C>, StoreError>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn point_keys_accept_what_qdrant_accepts() {
        let u = "A1A2A3A4-B1B2-C1C2-D1D2-D3D4D5D6D7D8";
        let key = PointKey::parse(u).unwrap();
        assert_eq!(key.to_string(), u.to_lowercase(), "canonical spelling");
        assert_eq!(PointKey::parse("42"), Some(PointKey::Num(42)));
        assert_eq!(PointKey::parse("not-a-uuid"), None);
        assert!(PointKey::for_chunk("-1").is_err());
    }

    #[test]
    fn payload_round_trips() {
        let chunk = Chunk {
            id: "x".into(),
            doc_id: "d".into(),
            text: "t".into(),
            source: "s".into(),
            position: 3,
            metadata: json!({"lang": "en", "n": 2, "f": 0.5, "b": true})
                .as_object()
                .cloned()
                .unwrap(),
        };
        let back = chunk_from_payload("x".into(), chunk_payload(&chunk)).unwrap();
        assert_eq!(back, chunk);
        let mut broken = chunk_payload(&chunk);
        broken.remove("text");
        let err = chunk_from_payload("x".into(), broken).unwrap_err();
        assert!(err.to_string().contains("`text`"), "{err}");
    }

    #[test]
    fn filters_lower_to_paths_and_values() {
        let filter = Filter {
            conditions: vec![
                Condition {
                    field: FilterField::Source,
                    matches: MatchValue::Keyword("wiki".into()),
                },
                Condition {
                    field: FilterField::Metadata("a.b".into()),
                    matches: MatchValue::Integer(7),
                },
            ],
        };
        let lowered = must_conditions(&filter, |path, m| Ok((path, m.clone()))).unwrap();
        assert_eq!(
            lowered,
            Some(vec![
                ("source".to_string(), MatchValue::Keyword("wiki".into())),
                ("metadata.\"a.b\"".to_string(), MatchValue::Integer(7)),
            ])
        );
        assert_eq!(
            must_conditions(&Filter::default(), |p, _| Ok(p)).unwrap(),
            None
        );
        let quote = Filter {
            conditions: vec![Condition {
                field: FilterField::Metadata("a\"b".into()),
                matches: MatchValue::Bool(true),
            }],
        };
        assert!(must_conditions(&quote, |p, _| Ok(p)).is_err());
    }
}
