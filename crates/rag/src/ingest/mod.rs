//! Ingest: documents (text, Markdown, HTML) → sections → chunks → vectors in the store.
//!
//! Chunk ids are UUIDv5 of the document id and the chunk text, so ingesting the same document
//! twice adds nothing and skips the embedding work; a changed document replaces its old chunks.

pub mod chunk;
pub mod corpus;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use opentelemetry::KeyValue;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::embed::{EmbedError, Embedder};
use crate::retrieve::{Chunk, StoreError, VectorStore};
use chunk::{ChunkerConfig, Section};
use telemetry::names::{attr, StageKind};
use telemetry::span::{model_attributes, Stage};

/// Namespace for chunk ids (a fixed random UUID: ids stay stable across versions).
const CHUNK_NAMESPACE: uuid::Uuid = uuid::uuid!("6f1c3e52-9a0b-4d7e-8c21-5b3a9e4f0d17");

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Text,
    Markdown,
    Html,
}

impl Format {
    pub fn from_path(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "txt" | "text" | "rst" | "adoc" => Some(Format::Text),
            "md" | "markdown" => Some(Format::Markdown),
            "html" | "htm" | "xhtml" => Some(Format::Html),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Document {
    pub id: String,
    pub text: String,
    pub source: String,
    pub format: Format,
    pub metadata: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IngestStatus {
    Created,
    Unchanged,
    Replaced,
}

impl IngestStatus {
    /// The name the APIs report (as serialised).
    pub fn as_str(self) -> &'static str {
        match self {
            IngestStatus::Created => "created",
            IngestStatus::Unchanged => "unchanged",
            IngestStatus::Replaced => "replaced",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct IngestOutcome {
    pub id: String,
    pub chunks: usize,
    pub status: IngestStatus,
}

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("document {0}: no text left after extraction")]
    Empty(String),
    #[error(transparent)]
    Embed(#[from] EmbedError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Read(String),
}

/// Plain text, with Markdown-style `#` headings, and the title.
pub fn extract(doc: &Document) -> (String, Vec<Section>) {
    match doc.format {
        Format::Html => {
            let title = html_title(&doc.text).unwrap_or_default();
            let text = html2text::config::plain_no_decorate()
                .string_from_read(doc.text.as_bytes(), 10_000)
                .unwrap_or_default();
            (title, chunk::sections(&text))
        }
        Format::Markdown => {
            let title = doc
                .text
                .lines()
                .find_map(|l| l.strip_prefix("# "))
                .map(str::trim)
                .unwrap_or_default()
                .to_string();
            (title, chunk::sections(&doc.text))
        }
        Format::Text => (
            String::new(),
            vec![Section {
                heading: None,
                text: doc.text.clone(),
            }],
        ),
    }
}

fn html_title(html: &str) -> Option<String> {
    let lower = html.to_ascii_lowercase();
    let start = lower.find("<title")?;
    let open_end = start + lower[start..].find('>')? + 1;
    let close = open_end + lower[open_end..].find("</title>")?;
    let title = html[open_end..close].split_whitespace().collect::<Vec<_>>();
    Some(title.join(" ")).filter(|t| !t.is_empty())
}

/// The chunks a document becomes, with content-derived ids.
pub fn plan_chunks(
    doc: &Document,
    embedder: &dyn Embedder,
    cfg: ChunkerConfig,
) -> Result<Vec<Chunk>, IngestError> {
    let (title, sections) = extract(doc);
    let count = |s: &str| embedder.count_tokens(s).unwrap_or(s.len() / 3);
    let texts = chunk::chunk(&title, &sections, cfg, &count);
    let mut seen: HashMap<String, usize> = HashMap::new();
    let chunks: Vec<Chunk> = texts
        .into_iter()
        .enumerate()
        .map(|(position, c)| {
            // Identical text twice in one document still gets two ids.
            let n = seen.entry(c.text.clone()).or_insert(0);
            let key = format!("{}\u{0}{}\u{0}{}", doc.id, n, c.text);
            *n += 1;
            let mut metadata = doc.metadata.clone();
            if let Some(section) = &c.section {
                metadata
                    .entry("section")
                    .or_insert_with(|| Value::String(section.clone()));
            }
            if !title.is_empty() {
                metadata
                    .entry("title")
                    .or_insert_with(|| Value::String(title.clone()));
            }
            Chunk {
                id: uuid::Uuid::new_v5(&CHUNK_NAMESPACE, key.as_bytes()).to_string(),
                doc_id: doc.id.clone(),
                text: c.text,
                source: doc.source.clone(),
                position: position as u32,
                metadata,
            }
        })
        .collect();
    if chunks.is_empty() {
        return Err(IngestError::Empty(doc.id.clone()));
    }
    Ok(chunks)
}

/// Embeds and stores a document. Runs on a model-worker thread; durable when it returns.
pub fn ingest_document(
    doc: &Document,
    embedder: &dyn Embedder,
    store: &dyn VectorStore,
    cfg: ChunkerConfig,
    stage: &Stage,
) -> Result<IngestOutcome, IngestError> {
    let chunks = plan_chunks(doc, embedder, cfg)?;
    let ids: Vec<String> = chunks.iter().map(|c| c.id.clone()).collect();
    let existing = store.existing(&ids, stage)?;
    stage.set(KeyValue::new(attr::INGEST_CHUNKS, chunks.len() as i64));
    if existing.len() == ids.len() {
        // Every chunk is stored already; chunks of an older version left by a replace that
        // crashed before its clean-up go now.
        let stale = store.delete_stale(&doc.id, &ids, stage)?;
        return Ok(IngestOutcome {
            id: doc.id.clone(),
            chunks: chunks.len(),
            status: if stale > 0 {
                IngestStatus::Replaced
            } else {
                IngestStatus::Unchanged
            },
        });
    }
    let embed_stage = stage.child(StageKind::Embed.span_name(Some(embedder.model_id())));
    embed_stage.set_all(model_attributes(StageKind::Embed, embedder.model_id()));
    let texts: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
    let vectors = embedder.embed(&texts, &embed_stage)?;
    embed_stage.end();
    // New chunks first, old ones after: a crash between the two leaves the whole old version
    // or the whole new one readable (both, until the clean-up runs), never neither. (Deleting
    // first lost a replaced document outright when the crash came between the two writes.)
    store.upsert(&chunks, &vectors, stage)?;
    let removed = store.delete_stale(&doc.id, &ids, stage)?;
    Ok(IngestOutcome {
        id: doc.id.clone(),
        chunks: chunks.len(),
        status: if removed > 0 || !existing.is_empty() {
            IngestStatus::Replaced
        } else {
            IngestStatus::Created
        },
    })
}

/// Reads files and directories (recursively) into documents; the document id is the path
/// relative to the directory given, or the file name for a single file.
pub fn read_paths(paths: &[PathBuf]) -> Result<Vec<Document>, IngestError> {
    let mut docs = Vec::new();
    for root in paths {
        if root.is_dir() {
            let mut files = Vec::new();
            walk(root, &mut files)
                .map_err(|e| IngestError::Read(format!("{}: {e}", root.display())))?;
            files.sort();
            for file in files {
                let id = file
                    .strip_prefix(root)
                    .unwrap_or(&file)
                    .to_string_lossy()
                    .into_owned();
                docs.push(read_file(&file, id)?);
            }
        } else {
            let id = root
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| root.display().to_string());
            docs.push(read_file(root, id)?);
        }
    }
    Ok(docs)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if Format::from_path(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

fn read_file(path: &Path, id: String) -> Result<Document, IngestError> {
    let format = Format::from_path(path).unwrap_or_default();
    let bytes =
        std::fs::read(path).map_err(|e| IngestError::Read(format!("{}: {e}", path.display())))?;
    Ok(Document {
        id,
        text: String::from_utf8_lossy(&bytes).into_owned(),
        source: path.display().to_string(),
        format,
        metadata: Map::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_becomes_titled_sections() {
        let doc = Document {
            id: "x.html".into(),
            text: "<html><head><title>git-stash(1)</title></head><body><h2>NAME</h2><p>git-stash - Stash the changes</p><h2>OPTIONS</h2><dl><dt>-p</dt><dd>Interactively select hunks.</dd></dl></body></html>".into(),
            source: "x.html".into(),
            format: Format::Html,
            metadata: Map::new(),
        };
        let (title, sections) = extract(&doc);
        assert_eq!(title, "git-stash(1)");
        let headings: Vec<_> = sections.iter().filter_map(|s| s.heading.clone()).collect();
        assert_eq!(headings, ["NAME", "OPTIONS"]);
        assert!(sections[1].text.contains("Interactively select hunks."));
    }

    #[test]
    fn formats_come_from_extensions() {
        assert_eq!(Format::from_path(Path::new("a/b.HTML")), Some(Format::Html));
        assert_eq!(Format::from_path(Path::new("r.md")), Some(Format::Markdown));
        assert_eq!(Format::from_path(Path::new("bin.so")), None);
    }
}
