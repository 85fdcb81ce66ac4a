//! What both Qdrant backends store and ask for, written once: the point id of a chunk, the
//! chunk's payload and its way back, the payload fields that get a keyword index, and our
//! [`Filter`] lowered to Qdrant's model (a `must` list of field conditions on payload paths).
//!
//! The embedded engine and the server take the same concepts in different Rust types (the
//! engine's segment types, the client's protobuf messages); each backend only maps these
//! values to its types, so ids, payloads and filter semantics cannot drift apart.

use serde_json::{Map, Value};

use super::{Chunk, Filter, FilterField, MatchValue, StoreError};

/// Payload fields with a keyword index: the filters the API exposes first.
pub const INDEXED_KEYWORDS: [&str; 2] = ["doc_id", "source"];

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
    use crate::retrieve::Condition;

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
