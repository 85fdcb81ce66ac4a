//! OpenInference beside the GenAI conventions: what Arize Phoenix (and the UIs built on
//! OpenInference) need to show a trace as a RAG pipeline: each span's kind (set on every span
//! where it starts, [`names::openinference_kind`]), the documents a retriever returned and a
//! reranker reordered, and the LLM's model and token counts. Ids and scores are not content
//! and always go on; a document's text and metadata only with content capture.

use opentelemetry::KeyValue;

use crate::names::{self, attr};

/// One document of a retriever's or reranker's list.
#[derive(Debug, Clone, PartialEq)]
pub struct Document<'a> {
    pub id: String,
    pub score: f64,
    /// The text, with content capture on.
    pub content: Option<&'a str>,
    /// A JSON object, with content capture on.
    pub metadata: Option<String>,
}

/// `{list}.{i}.document.{id,score,content,metadata}` for each document in order, where `list`
/// is [`attr::RETRIEVAL_DOCUMENTS`], [`attr::RERANKER_INPUT_DOCUMENTS`] or
/// [`attr::RERANKER_OUTPUT_DOCUMENTS`].
pub fn documents<'a>(list: &str, docs: impl IntoIterator<Item = Document<'a>>) -> Vec<KeyValue> {
    let mut out = Vec::new();
    for (i, doc) in docs.into_iter().enumerate() {
        let key = |field: &str| format!("{list}.{i}.{field}");
        out.push(KeyValue::new(key(attr::DOC_ID), doc.id));
        out.push(KeyValue::new(key(attr::DOC_SCORE), doc.score));
        if let Some(text) = doc.content {
            out.push(KeyValue::new(key(attr::DOC_CONTENT), text.to_string()));
        }
        if let Some(metadata) = doc.metadata {
            out.push(KeyValue::new(key(attr::DOC_METADATA), metadata));
        }
    }
    out
}

/// `input.value` or `output.value` with its mime type (`text/plain`): content, so only with
/// content capture.
pub fn text(value_key: &'static str, text: &str) -> [KeyValue; 2] {
    let mime = if value_key == attr::INPUT_VALUE {
        attr::INPUT_MIME_TYPE
    } else {
        attr::OUTPUT_MIME_TYPE
    };
    [
        KeyValue::new(value_key, text.to_string()),
        KeyValue::new(mime, "text/plain"),
    ]
}

/// The kind attribute of a span named `name`.
pub fn kind(name: &str) -> KeyValue {
    KeyValue::new(
        attr::OPENINFERENCE_SPAN_KIND,
        names::openinference_kind(name),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_numbered_and_content_is_optional() {
        let kvs = documents(
            attr::RETRIEVAL_DOCUMENTS,
            [
                Document {
                    id: "git-stash.html#3".into(),
                    score: 0.75,
                    content: None,
                    metadata: None,
                },
                Document {
                    id: "git-clone.html#0".into(),
                    score: 0.5,
                    content: Some("git clone --depth 1"),
                    metadata: Some("{\"doc_id\":\"git-clone.html\"}".into()),
                },
            ],
        );
        let keys: Vec<String> = kvs.iter().map(|kv| kv.key.to_string()).collect();
        assert_eq!(
            keys,
            [
                "retrieval.documents.0.document.id",
                "retrieval.documents.0.document.score",
                "retrieval.documents.1.document.id",
                "retrieval.documents.1.document.score",
                "retrieval.documents.1.document.content",
                "retrieval.documents.1.document.metadata",
            ]
        );
        assert_eq!(kind("rerank m").value.as_str(), "RERANKER");
        assert_eq!(
            text(attr::OUTPUT_VALUE, "a")[1].key.as_str(),
            attr::OUTPUT_MIME_TYPE
        );
    }
}
