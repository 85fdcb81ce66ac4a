//! One line of `requests.jsonl`: what was scheduled, what was sent, what came back and when.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::schedule::Phase;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RequestRecord {
    /// Order of sending within the command, from 0.
    pub id: u64,
    pub phase: Phase,
    /// Knee finder: the step this request belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    /// The open-loop rate offered when this request was scheduled (absent in closed loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered_rps: Option<f64>,
    /// Closed loop: the user who sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<usize>,
    /// Seconds from the start of the command at which the schedule wanted it sent (open loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_s: Option<f64>,
    /// Seconds from the start of the command at which it was sent.
    pub sent_s: f64,
    /// Seconds from the start of the command at which it finished (answered, failed or timed out).
    pub done_s: f64,
    /// Wall-clock send time, milliseconds since the Unix epoch (to find it in a trace UI).
    pub sent_unix_ms: u64,
    /// Popularity rank of the query (0 = most popular) and the context it asked for.
    pub query_rank: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerank_top_n: Option<usize>,
    /// The trace id sent in `traceparent`: search for it in Jaeger or Tempo.
    pub trace_id: String,
    pub ok: bool,
    /// HTTP status, when a response arrived.
    pub status: Option<u16>,
    /// Error kind: `http_<status>`, `timeout`, `connect`, `request`, `stream`, `dropped`.
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_detail: Option<String>,
    /// Send to first token.
    pub ttft_ms: Option<f64>,
    /// Mean gap between tokens after the first.
    pub tpot_ms: Option<f64>,
    /// Send to the end of the stream.
    pub e2e_ms: Option<f64>,
    /// Completion tokens (the server's count when it reported one, else token events).
    pub tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// The server's own per-stage milliseconds from the `done` event (`timings`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_timings: Option<BTreeMap<String, f64>>,
    /// The question as sent (what `run --replay` sends again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// The `filter` sent, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<serde_json::Value>,
    /// What the query mix made of this request: `hot` (from the query set), `cold` (a variant
    /// never sent before) or `no_match` (a filter that matches no document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_kind: Option<QueryKind>,
    /// The perturbation applied to the question (`typo:swap@12`, `template:3`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perturbation: Option<String>,
    /// The server said the query's vector came from its query-embedding cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_cached: Option<bool>,
    /// Prompt tokens the server took from its prefix KV cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// Sentence vectors the server's context stage looked up, and of those the ones its
    /// sentence cache held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sentences: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sentences_cached: Option<u64>,
    /// Sent a second time because its connection refused the first (`--retry-refused`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retried: bool,
}

/// What the query mix drew for a request.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum QueryKind {
    Hot,
    Cold,
    NoMatch,
}

impl QueryKind {
    pub const ALL: [QueryKind; 3] = [QueryKind::Hot, QueryKind::Cold, QueryKind::NoMatch];

    pub fn name(self) -> &'static str {
        match self {
            QueryKind::Hot => "hot",
            QueryKind::Cold => "cold",
            QueryKind::NoMatch => "no_match",
        }
    }
}

pub fn write_jsonl(path: &Path, records: &[RequestRecord]) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for r in records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

pub fn read_jsonl(path: &Path) -> anyhow::Result<Vec<RequestRecord>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).with_context(|| format!("{}:{}", path.display(), i + 1))?,
        );
    }
    Ok(out)
}
