//! `ragscope store audit`: what an embedded shard holds, read straight from its files, and
//! the checks that hold for any state a crash can leave.
//!
//! The crash loop (`scripts/crash-loop`) runs this on the data directory a SIGKILL left and
//! compares the documents with the writes the server acknowledged; the checks here need no
//! such log: the engine's count against a full scroll, each document's payload-filtered count
//! against its scrolled chunks, and searches with stored vectors against the stored points.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::edge::{DiskUsage, EdgeStore};
use super::{payload, Chunk, StoreError, VectorStore};
use telemetry::span::Stage;

/// A stored vector searched for itself scores this or more (cosine of unit vectors).
const SELF_SCORE: f32 = 0.999;

#[derive(Debug, Serialize)]
pub struct AuditReport {
    /// Points a full scroll returned.
    pub points: usize,
    /// The engine's exact count.
    pub count: usize,
    pub documents: BTreeMap<String, DocumentReport>,
    /// Searches made (two per document: unfiltered and filtered by `doc_id`).
    pub searches: usize,
    /// What is inconsistent; empty when every check held.
    pub problems: Vec<String>,
    pub disk: DiskUsage,
}

#[derive(Debug, Serialize)]
pub struct DocumentReport {
    /// By position (ties by id): a document whose replacement crashed half-way holds both
    /// versions' chunks, which the caller tells apart by their metadata.
    pub chunks: Vec<ChunkReport>,
    /// `count` with the `doc_id` filter (the keyword payload index).
    pub filtered_count: usize,
}

#[derive(Debug, Serialize)]
pub struct ChunkReport {
    pub id: String,
    pub position: u32,
    pub text: String,
    pub metadata: serde_json::Map<String, Value>,
}

/// Reads every point and checks what must hold in any state.
pub fn audit(store: &EdgeStore) -> Result<AuditReport, StoreError> {
    let stage = Stage::root("audit");
    let points = store.points()?;
    let count = store.count()?;
    let mut problems = Vec::new();
    if count != points.len() {
        problems.push(format!(
            "the engine counts {count} points, a scroll returned {}",
            points.len()
        ));
    }
    let stored: BTreeMap<&str, &Chunk> = points.iter().map(|(c, _)| (c.id.as_str(), c)).collect();
    let mut by_doc: BTreeMap<&str, Vec<&(Chunk, Vec<f32>)>> = BTreeMap::new();
    for point in &points {
        by_doc
            .entry(point.0.doc_id.as_str())
            .or_default()
            .push(point);
    }

    let mut documents = BTreeMap::new();
    let mut searches = 0;
    for (doc_id, mut chunks) in by_doc {
        chunks.sort_by(|a, b| (a.0.position, &a.0.id).cmp(&(b.0.position, &b.0.id)));
        let filter = payload::document_filter(doc_id);
        let filtered_count = store.count_matching(&filter)?;
        if filtered_count != chunks.len() {
            problems.push(format!(
                "document {doc_id:?}: the doc_id filter counts {filtered_count}, a scroll found {}",
                chunks.len()
            ));
        }
        // One search per document for its first chunk's own vector, unfiltered, and one
        // filtered to the document asking for all of its chunks.
        let (first, vector) = (&chunks[0].0, &chunks[0].1);
        searches += 2;
        match store.search(vector, 1, None, &stage)?.first() {
            None => problems.push(format!("search for point {} found nothing", first.id)),
            Some(hit) => {
                if hit.score < SELF_SCORE {
                    problems.push(format!(
                        "search for point {}'s own vector: best score {} (want >= {SELF_SCORE})",
                        first.id, hit.score
                    ));
                }
                if stored.get(hit.chunk.id.as_str()) != Some(&&hit.chunk) {
                    problems.push(format!(
                        "search returned point {} whose payload differs from the scroll's",
                        hit.chunk.id
                    ));
                }
            }
        }
        let hits = store.search(vector, chunks.len(), Some(&filter), &stage)?;
        if hits.len() != chunks.len() {
            problems.push(format!(
                "document {doc_id:?}: a filtered search for all {} chunks returned {}",
                chunks.len(),
                hits.len()
            ));
        }
        for hit in &hits {
            if hit.chunk.doc_id != doc_id || stored.get(hit.chunk.id.as_str()) != Some(&&hit.chunk)
            {
                problems.push(format!(
                    "document {doc_id:?}: filtered search returned point {} of {:?} or with \
                     another payload",
                    hit.chunk.id, hit.chunk.doc_id
                ));
            }
        }
        let chunks = chunks
            .into_iter()
            .map(|(c, _)| ChunkReport {
                id: c.id.clone(),
                position: c.position,
                text: c.text.clone(),
                metadata: c.metadata.clone(),
            })
            .collect();
        documents.insert(
            doc_id.to_string(),
            DocumentReport {
                chunks,
                filtered_count,
            },
        );
    }
    Ok(AuditReport {
        points: points.len(),
        count,
        documents,
        searches,
        problems,
        disk: store.disk_usage(),
    })
}

#[cfg(test)]
mod tests {
    use tempfile::TempDir;

    use super::*;

    fn chunk(doc: &str, position: u32) -> Chunk {
        let text = format!("{doc} {position}");
        Chunk {
            id: uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, text.as_bytes()).to_string(),
            doc_id: doc.into(),
            text,
            source: "t".into(),
            position,
            metadata: Default::default(),
        }
    }

    #[test]
    fn a_consistent_shard_has_no_problems_and_lists_its_documents() {
        let dir = TempDir::new().unwrap();
        let store = EdgeStore::open(dir.path(), "a", 4).unwrap();
        let chunks = vec![chunk("x", 0), chunk("x", 1), chunk("y", 0)];
        let vectors = vec![
            vec![1.0, 0.0, 0.0, 0.0],
            vec![0.0, 1.0, 0.0, 0.0],
            vec![0.0, 0.0, 1.0, 0.0],
        ];
        store.upsert(&chunks, &vectors, &Stage::root("t")).unwrap();
        let report = audit(&store).unwrap();
        assert_eq!(report.problems, Vec::<String>::new());
        assert_eq!((report.points, report.count, report.searches), (3, 3, 4));
        let x = &report.documents["x"];
        assert_eq!(x.filtered_count, 2);
        let positions: Vec<u32> = x.chunks.iter().map(|c| c.position).collect();
        assert_eq!(positions, [0, 1]);
        assert!(report.disk.total_bytes >= report.disk.wal_bytes);
        assert!(report.disk.wal_segments >= 1);
    }
}
