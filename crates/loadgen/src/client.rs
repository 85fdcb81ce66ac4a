//! One streaming request, timed on the client: time to first token (the first token event),
//! time per output token (mean gap after the first) and end to end (send to the last event).
//! Failures are sorted into kinds: `http_<status>`, `timeout`, `connect`, `request`, `stream`.
//! With `retry`, a request its connection refused (closed under it before any response: a
//! server's maximum connection age) is sent once more, timed from the first attempt.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::Rng;
use serde_json::{json, Value};

use crate::cli::Endpoint;
use measure::sse::{SseEvent, SseParser};

/// What one request asks.
#[derive(Debug, Clone)]
pub struct Ask {
    pub query: String,
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub max_tokens: Option<usize>,
    /// The `filter` object (`/v1/rag/query` and chat's extension).
    pub filter: Option<Value>,
}

/// What came back.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub status: Option<u16>,
    pub error: Option<String>,
    pub error_detail: Option<String>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub tokens: u64,
    pub prompt_tokens: Option<u64>,
    pub server_timings: Option<BTreeMap<String, f64>>,
    /// `done.cache.query_embedding`: the server's query-embedding cache answered.
    pub embedding_cached: Option<bool>,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens from the prefix KV cache.
    pub cached_tokens: Option<u64>,
    /// `done.cache.sentences` and `.sentences_cached`: sentence vectors the context stage
    /// looked up, and how many of them the sentence cache held.
    pub sentences: Option<(u64, u64)>,
    /// The connection refused the first attempt; this is the second.
    pub retried: bool,
}

impl Outcome {
    pub(crate) fn fail(&mut self, kind: impl Into<String>, detail: impl Into<String>) {
        if self.error.is_none() {
            self.error = Some(kind.into());
            self.error_detail = Some(detail.into());
        }
    }

    /// Cleared for the second attempt at a refused request.
    pub(crate) fn retry(&mut self) {
        *self = Outcome {
            retried: true,
            ..Outcome::default()
        };
    }
}

/// Whether an attempt's connection refused it (so a retry may go out on a fresh one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    Refused,
    Done,
}

/// A fresh W3C `traceparent` with the sampled flag, and its trace id.
pub fn traceparent() -> (String, String) {
    let mut rng = rand::rng();
    let trace: u128 = rng.random_range(1..=u128::MAX);
    let span: u64 = rng.random_range(1..=u64::MAX);
    let trace_id = format!("{trace:032x}");
    (format!("00-{trace_id}-{span:016x}-01"), trace_id)
}

/// The JSON body for `endpoint`.
pub fn body(endpoint: Endpoint, model: &str, ask: &Ask) -> Value {
    let mut b = match endpoint {
        Endpoint::Rag | Endpoint::Grpc => json!({"query": ask.query, "stream": true}),
        Endpoint::Openai => json!({
            "model": model,
            "messages": [{"role": "user", "content": ask.query}],
            "stream": true,
            // The usage chunk gives the completion tokens the report counts.
            "stream_options": {"include_usage": true},
        }),
    };
    if let Some(k) = ask.top_k {
        b["top_k"] = json!(k);
    }
    if let Some(n) = ask.rerank_top_n {
        b["rerank_top_n"] = json!(n);
    }
    if let Some(m) = ask.max_tokens {
        b["max_tokens"] = json!(m);
    }
    if let Some(f) = &ask.filter {
        b["filter"] = f.clone();
    }
    b
}

pub fn path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Rag => "/v1/rag/query",
        Endpoint::Openai => "/v1/chat/completions",
        Endpoint::Grpc => "/ragscope.v1.Rag/Query",
    }
}

/// One HTTP request: where it goes, what it carries.
pub struct HttpRequest<'a> {
    pub http: &'a reqwest::Client,
    pub base_url: &'a str,
    pub endpoint: Endpoint,
    pub model: &'a str,
    pub traceparent: &'a str,
    /// Send it again, once, if its connection refuses it.
    pub retry: bool,
}

/// Sends one request and reads its stream to the end, within `timeout`.
pub async fn send(r: &HttpRequest<'_>, ask: &Ask, timeout: Duration) -> Outcome {
    let mut out = Outcome::default();
    let start = Instant::now();
    let mut timing = Timing::default();
    let url = format!("{}{}", r.base_url.trim_end_matches('/'), path(r.endpoint));
    let body = body(r.endpoint, r.model, ask);
    let attempts = async {
        let first = exchange(r, &url, body.clone(), start, &mut out, &mut timing).await;
        if first == Attempt::Refused && r.retry {
            out.retry();
            exchange(r, &url, body, start, &mut out, &mut timing).await;
        }
    };
    if tokio::time::timeout(timeout, attempts).await.is_err() {
        out.fail(
            "timeout",
            format!("no end of stream within {:.1} s", timeout.as_secs_f64()),
        );
    }
    conclude(&mut out, &timing, start);
    out
}

/// The client-side times of a finished exchange: TTFT, time per output token, end to end.
pub(crate) fn conclude(out: &mut Outcome, timing: &Timing, start: Instant) {
    out.ttft_ms = timing.first.map(ms);
    if timing.events >= 2 {
        if let (Some(first), Some(last)) = (timing.first, timing.last) {
            out.tpot_ms = Some(ms(last - first) / (timing.events - 1) as f64);
        }
    }
    if out.tokens == 0 {
        out.tokens = timing.events;
    }
    if out.error.is_none() {
        out.e2e_ms = Some(ms(start.elapsed()));
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Token event times, relative to the send.
#[derive(Debug, Default)]
pub(crate) struct Timing {
    first: Option<Duration>,
    last: Option<Duration>,
    events: u64,
}

impl Timing {
    pub(crate) fn token(&mut self, at: Duration) {
        self.first.get_or_insert(at);
        self.last = Some(at);
        self.events += 1;
    }
}

async fn exchange(
    r: &HttpRequest<'_>,
    url: &str,
    body: Value,
    start: Instant,
    out: &mut Outcome,
    timing: &mut Timing,
) -> Attempt {
    let response = r
        .http
        .post(url)
        .header("traceparent", r.traceparent)
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await;
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            let kind = if e.is_connect() {
                "connect"
            } else if e.is_timeout() {
                "timeout"
            } else {
                "request"
            };
            out.fail(kind, error_chain(&e));
            return if kind == "request" && closed_under(&e) {
                Attempt::Refused
            } else {
                Attempt::Done
            };
        }
    };
    let endpoint = r.endpoint;
    let status = response.status();
    out.status = Some(status.as_u16());
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        out.fail(format!("http_{}", status.as_u16()), message);
        return Attempt::Done;
    }
    let mut parser = SseParser::new();
    let mut stream = response.bytes_stream();
    let mut finished = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                out.fail("stream", error_chain(&e));
                return Attempt::Done;
            }
        };
        for event in parser.push(&chunk) {
            let at = start.elapsed();
            let step = match endpoint {
                Endpoint::Openai => chat_event(&event, out),
                Endpoint::Rag | Endpoint::Grpc => rag_event(&event, out),
            };
            match step {
                Step::Token => timing.token(at),
                Step::Done => finished = true,
                Step::Other => {}
                Step::Failed => return Attempt::Done,
            }
        }
    }
    if !finished {
        out.fail("stream", "the stream ended before its final event");
    }
    Attempt::Done
}

/// The connection closed under the request before any response: a pooled keep-alive
/// connection the server shut (its maximum age) just as the request went out on it.
fn closed_under(e: &reqwest::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        if let Some(h) = inner.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_canceled() {
                return true;
            }
        }
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::{BrokenPipe, ConnectionReset};
            if matches!(io.kind(), ConnectionReset | BrokenPipe) {
                return true;
            }
        }
        source = inner.source();
    }
    false
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// What an event meant for the request.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Token,
    Done,
    Other,
    Failed,
}

/// `/v1/rag/query` events: `sources`, `token`, then `done` (usage, timings) or `error`.
pub fn rag_event(event: &SseEvent, out: &mut Outcome) -> Step {
    match event.event.as_str() {
        "token" => Step::Token,
        "done" => {
            let v: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
            usage(&v["usage"], out);
            out.embedding_cached = v["cache"]["query_embedding"].as_bool();
            let cache = &v["cache"];
            out.sentences = cache["sentences"]
                .as_u64()
                .zip(cache["sentences_cached"].as_u64());
            if let Some(t) = v["timings"].as_object() {
                out.server_timings = Some(
                    t.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                        .collect(),
                );
            }
            Step::Done
        }
        "error" => {
            out.fail("stream", error_message(&event.data));
            Step::Failed
        }
        _ => Step::Other,
    }
}

/// OpenAI chunks: a token is a chunk whose delta has non-empty content; `[DONE]` ends it.
pub fn chat_event(event: &SseEvent, out: &mut Outcome) -> Step {
    if event.data.trim() == "[DONE]" {
        return Step::Done;
    }
    let v: Value = match serde_json::from_str(&event.data) {
        Ok(v) => v,
        Err(_) => {
            out.fail("stream", format!("not JSON: {:.200}", event.data));
            return Step::Failed;
        }
    };
    if v.get("error").is_some() {
        out.fail("stream", error_message(&event.data));
        return Step::Failed;
    }
    usage(&v["usage"], out);
    let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
    if content.is_empty() {
        Step::Other
    } else {
        Step::Token
    }
}

fn usage(u: &Value, out: &mut Outcome) {
    if let Some(c) = u["completion_tokens"].as_u64() {
        out.tokens = c;
    }
    if let Some(p) = u["prompt_tokens"].as_u64() {
        out.prompt_tokens = Some(p);
    }
    if let Some(c) = u["prompt_tokens_details"]["cached_tokens"].as_u64() {
        out.cached_tokens = Some(c);
    }
}

fn error_message(data: &str) -> String {
    serde_json::from_str::<Value>(data)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| data.chars().take(200).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_w3c_and_sampled() {
        let (tp, id) = traceparent();
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0], "00");
        assert_eq!(parts[1], id);
        assert_eq!(parts[1].len(), 32);
        assert_eq!(parts[2].len(), 16);
        assert_eq!(parts[3], "01");
        assert!(parts[1]
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(parts[1], "0".repeat(32));
        assert_ne!(traceparent().1, id);
    }

    #[test]
    fn rag_done_carries_usage_and_server_timings() {
        let mut out = Outcome::default();
        assert_eq!(
            rag_event(&SseEvent::new("sources", "[]"), &mut out),
            Step::Other
        );
        assert_eq!(
            rag_event(&SseEvent::new("token", "{\"text\":\"a\"}"), &mut out),
            Step::Token
        );
        let done = r#"{"usage":{"prompt_tokens":300,"completion_tokens":7,"total_tokens":307,
            "prompt_tokens_details":{"cached_tokens":288}},
            "cache":{"query_embedding":true,"sentences":40,"sentences_cached":30},
            "timings":{"queue_ms":1.5,"embed_ms":9.0,"decode_ms":120.0},"finish_reason":"stop"}"#;
        assert_eq!(
            rag_event(&SseEvent::new("done", done), &mut out),
            Step::Done
        );
        assert_eq!(out.tokens, 7);
        assert_eq!(out.cached_tokens, Some(288));
        assert_eq!(out.embedding_cached, Some(true));
        assert_eq!(out.sentences, Some((40, 30)));
        assert_eq!(out.prompt_tokens, Some(300));
        let t = out.server_timings.unwrap();
        assert_eq!(t["embed_ms"], 9.0);
        assert_eq!(t.len(), 3);
        assert!(out.error.is_none());
    }

    #[test]
    fn rag_error_event_is_a_stream_error() {
        let mut out = Outcome::default();
        let step = rag_event(
            &SseEvent::new(
                "error",
                r#"{"error":{"message":"the request timed out after 5 ms"}}"#,
            ),
            &mut out,
        );
        assert_eq!(step, Step::Failed);
        assert_eq!(out.error.as_deref(), Some("stream"));
        assert!(out.error_detail.unwrap().contains("timed out"));
    }

    #[test]
    fn chat_chunks_count_content_and_end_at_done() {
        let mut out = Outcome::default();
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        let tok = r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
        let last = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2}}"#;
        assert_eq!(
            chat_event(&SseEvent::new("message", role), &mut out),
            Step::Other
        );
        assert_eq!(
            chat_event(&SseEvent::new("message", tok), &mut out),
            Step::Token
        );
        assert_eq!(
            chat_event(&SseEvent::new("message", last), &mut out),
            Step::Other
        );
        assert_eq!(
            chat_event(&SseEvent::new("message", "[DONE]"), &mut out),
            Step::Done
        );
        assert_eq!(out.tokens, 2);
        let mut bad = Outcome::default();
        let err = r#"{"error":{"message":"boom"}}"#;
        assert_eq!(
            chat_event(&SseEvent::new("message", err), &mut bad),
            Step::Failed
        );
        assert_eq!(bad.error.as_deref(), Some("stream"));
    }

    #[test]
    fn bodies_carry_the_requested_context() {
        let ask = Ask {
            query: "q".into(),
            top_k: Some(8),
            rerank_top_n: Some(3),
            max_tokens: Some(16),
            filter: Some(json!({"doc_id": "none"})),
        };
        let rag = body(Endpoint::Rag, "m", &ask);
        assert_eq!(rag["query"], "q");
        assert_eq!(rag["stream"], true);
        assert_eq!(rag["top_k"], 8);
        assert_eq!(rag["rerank_top_n"], 3);
        assert_eq!(rag["max_tokens"], 16);
        assert_eq!(rag["filter"]["doc_id"], "none");
        let chat = body(Endpoint::Openai, "m", &ask);
        assert_eq!(chat["messages"][0]["content"], "q");
        assert_eq!(chat["model"], "m");
        let bare = body(
            Endpoint::Rag,
            "m",
            &Ask {
                top_k: None,
                rerank_top_n: None,
                max_tokens: None,
                filter: None,
                ..ask
            },
        );
        assert!(bare.get("top_k").is_none());
        assert!(bare.get("filter").is_none());
    }
}
