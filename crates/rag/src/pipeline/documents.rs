//! The documents a request's retrieval returned and its rerank reordered, as OpenInference
//! document lists on the stages' spans ([`telemetry::openinference`]): what Phoenix shows as a
//! RETRIEVER's and a RERANKER's documents. Ids and scores always; text and metadata only with
//! content capture (`--capture-content`).

use opentelemetry::KeyValue;
use serde_json::{json, Value};
use telemetry::names::attr;
use telemetry::openinference::{documents, Document};

use crate::retrieve::Chunk;

/// A chunk's id on a span: its document and its place in it (`git-stash.html#3`), which a
/// reader can find; the chunk's UUID is in the metadata.
pub fn id(chunk: &Chunk) -> String {
    format!("{}#{}", chunk.doc_id, chunk.position)
}

fn metadata(chunk: &Chunk) -> String {
    let mut m = chunk.metadata.clone();
    m.insert("chunk_id".into(), Value::from(chunk.id.clone()));
    m.insert("doc_id".into(), Value::from(chunk.doc_id.clone()));
    m.insert("source".into(), Value::from(chunk.source.clone()));
    m.insert("position".into(), json!(chunk.position));
    Value::Object(m).to_string()
}

fn document(chunk: &Chunk, score: f32, capture: bool) -> Document<'_> {
    Document {
        id: id(chunk),
        score: f64::from(score),
        content: capture.then_some(chunk.text.as_str()),
        metadata: capture.then(|| metadata(chunk)),
    }
}

/// `retrieval.documents.*`: the chunks retrieval returned, in its order, with its scores.
pub fn retrieved<'a>(
    hits: impl IntoIterator<Item = (&'a Chunk, f32)>,
    capture: bool,
) -> Vec<KeyValue> {
    documents(
        attr::RETRIEVAL_DOCUMENTS,
        hits.into_iter().map(|(c, s)| document(c, s, capture)),
    )
}

/// What a rerank read and wrote: the candidates with their retrieval scores, the `top_n` it
/// kept in its order with its own scores, and `reranker.top_k`. `chunks` names the candidates
/// (`None` for bare passages, `/v1/rerank`: then they are numbered).
pub struct Reranked<'a> {
    pub chunks: Option<&'a [&'a Chunk]>,
    pub texts: &'a [&'a str],
    pub retrieval: &'a [f32],
    pub scores: &'a [f32],
    pub top_n: usize,
    pub capture: bool,
}

impl Reranked<'_> {
    pub fn attributes(&self, order: &[usize]) -> Vec<KeyValue> {
        let doc = |i: usize, score: f32| match self.chunks {
            Some(chunks) => document(chunks[i], score, self.capture),
            None => Document {
                id: i.to_string(),
                score: f64::from(score),
                content: self.capture.then_some(self.texts[i]),
                metadata: None,
            },
        };
        let mut kvs = documents(
            attr::RERANKER_INPUT_DOCUMENTS,
            (0..self.texts.len()).map(|i| doc(i, self.retrieval[i])),
        );
        kvs.extend(documents(
            attr::RERANKER_OUTPUT_DOCUMENTS,
            order
                .iter()
                .take(self.top_n)
                .map(|&i| doc(i, self.scores[i])),
        ));
        kvs.push(KeyValue::new(attr::RERANKER_TOP_K, self.top_n as i64));
        kvs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(doc: &str, position: u32) -> Chunk {
        Chunk {
            id: format!("uuid-{doc}-{position}"),
            doc_id: doc.into(),
            text: format!("text of {doc}"),
            source: "corpus".into(),
            position,
            metadata: Default::default(),
        }
    }

    #[test]
    fn reranked_documents_keep_the_order_and_the_top_n() {
        let (a, b, c) = (chunk("a", 0), chunk("b", 2), chunk("c", 1));
        let chunks = [&a, &b, &c];
        let texts: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
        let r = Reranked {
            chunks: Some(&chunks),
            texts: &texts,
            retrieval: &[0.9, 0.8, 0.7],
            scores: &[0.1, 0.9, 0.5],
            top_n: 2,
            capture: false,
        };
        let kvs = r.attributes(&[1, 2, 0]);
        let get = |k: &str| {
            kvs.iter()
                .find(|kv| kv.key.as_str() == k)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(
            get("reranker.input_documents.2.document.id").as_deref(),
            Some("c#1")
        );
        assert_eq!(
            get("reranker.output_documents.0.document.id").as_deref(),
            Some("b#2")
        );
        assert_eq!(
            get("reranker.output_documents.1.document.score").as_deref(),
            Some("0.5")
        );
        assert!(get("reranker.output_documents.2.document.id").is_none());
        assert!(get("reranker.input_documents.0.document.content").is_none());
        assert_eq!(get("reranker.top_k").as_deref(), Some("2"));
        let captured = retrieved([(&a, 0.25)], true);
        let meta = captured
            .iter()
            .find(|kv| kv.key.as_str().ends_with("document.metadata"))
            .unwrap();
        let meta: Value = serde_json::from_str(meta.value.as_str().as_ref()).unwrap();
        assert_eq!(meta["chunk_id"], "uuid-a-0");
        assert_eq!(meta["position"], 0);
    }
}
