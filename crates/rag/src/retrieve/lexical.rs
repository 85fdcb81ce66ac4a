//! The lexical half of hybrid retrieval: each chunk is stored with a sparse vector of BM25
//! term weights beside its dense embedding, and a query's words search those over the whole
//! collection, with the engine's IDF modifier supplying the inverse document frequency.
//!
//! Dense MiniLM vectors rank a chunk that shares the question's rare words below one that is
//! merely about the same topic: for "How do I undo git add?" git-reset's "Undo add" example
//! scores 0.56 against the query while git-rm's SEE ALSO line scores 0.73, so no number of
//! dense candidates brings it into the prompt. A lexical search over every chunk finds it.
//!
//! Documents and queries go through the same tokenizer (Qdrant's own, so a Qdrant server's
//! BM25 would agree): lower-cased words, English stopwords removed, Snowball-stemmed.
//! Term ids are hashes of the tokens, so the vocabulary needs no storage.

use std::sync::OnceLock;

use qdrant_edge::bm25_embed::{EdgeBm25, EdgeBm25Config};
use qdrant_edge::external::ordered_float::NotNan;

/// Name of the sparse vector holding a chunk's BM25 term weights, in both backends.
pub const LEXICAL_VECTOR: &str = "bm25";

/// A sparse vector: `values[i]` is the weight of term `indices[i]` (indices are unique).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Terms {
    pub indices: Vec<u32>,
    pub values: Vec<f32>,
}

impl Terms {
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// Mean length, in tokens after stopword removal, that BM25's length normalisation takes as
/// average. A chunk holds at most 200 embedder tokens, about 130 words of which about 100 are
/// left after stopwords; a chunk shorter than this is credited more per matching term.
const AVERAGE_CHUNK_TERMS: f64 = 100.0;

fn model() -> &'static EdgeBm25 {
    static MODEL: OnceLock<EdgeBm25> = OnceLock::new();
    MODEL.get_or_init(|| {
        let config = EdgeBm25Config {
            avg_len: NotNan::new(AVERAGE_CHUNK_TERMS).expect("a number"),
            ..EdgeBm25Config::default()
        };
        EdgeBm25::new(config).expect("the default English BM25 configuration is valid")
    })
}

/// A chunk's term weights: BM25's saturated term frequency, length-normalised. The IDF factor
/// is applied at search time from the collection's statistics.
pub fn document(text: &str) -> Terms {
    let v = model().embed_document(text);
    Terms {
        indices: v.indices,
        values: v.values,
    }
}

/// A query's terms, each weighted 1 (repeated words count once).
pub fn query(text: &str) -> Terms {
    let v = model().embed_query(text);
    Terms {
        indices: v.indices,
        values: v.values,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stopwords_and_inflections_meet() {
        let q = query("How do I undo the additions?");
        let d = document("Undo an addition of files to the index");
        assert_eq!(q.indices.len(), 2, "{q:?}");
        assert!(
            q.indices.iter().all(|i| d.indices.contains(i)),
            "{q:?} {d:?}"
        );
        assert!(q.values.iter().all(|&v| v == 1.0));
    }

    #[test]
    fn repeated_terms_weigh_more_in_documents() {
        let once = document("stash pop applies a stash");
        let twice = document("stash pop applies a stash, then pop drops it");
        let pop = query("pop").indices[0];
        let weight = |t: &Terms| t.values[t.indices.iter().position(|&i| i == pop).unwrap()];
        assert!(weight(&twice) > weight(&once), "{once:?} {twice:?}");
        assert!(query("the of and").is_empty());
    }
}
