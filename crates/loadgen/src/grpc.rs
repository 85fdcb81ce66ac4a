//! One `ragscope.v1.Rag/Query` call, timed like an HTTP stream: TTFT at the first `token`
//! event, time per output token after it, end to end at `done`. All calls share one channel
//! (one HTTP/2 connection, multiplexed), which is what a server's maximum connection age
//! closes: a call sent on the channel after the server's GOAWAY and before it has reconnected
//! fails at once (`grpc_cancelled`, or `grpc_unavailable`), and tonic does not retry it. With
//! `retry` such a call is sent once more, on the channel reconnected by then.

use std::time::{Duration, Instant};

use serde_json::Value;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use crate::client::{conclude, Ask, Attempt, Outcome, Timing};

/// The code generated from the server's `proto/ragscope.proto` (client only).
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ragscope.v1");
}

use proto::query_event::Event;
use proto::rag_client::RagClient;

/// A lazily connecting channel to `url` (`http://host:port`).
pub fn channel(url: &str) -> anyhow::Result<Channel> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| anyhow::anyhow!("--url {url}: not a gRPC address: {e}"))?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true);
    Ok(endpoint.connect_lazy())
}

/// Metadata every call carries: the API key and the fault plan, as the HTTP client sends them.
#[derive(Debug, Clone, Default)]
pub struct Headers {
    pub api_key: Option<String>,
    pub fault: Option<String>,
    /// Send a call again, once, when its connection refused it.
    pub retry: bool,
}

/// Sends one query and reads its stream to the end, within `timeout`.
pub async fn send(
    channel: &Channel,
    headers: &Headers,
    ask: &Ask,
    traceparent: &str,
    timeout: Duration,
) -> Outcome {
    let mut out = Outcome::default();
    let start = Instant::now();
    let mut timing = Timing::default();
    let call = async {
        // A refused first attempt is sent once more when the client retries.
        for attempt in 0..2 {
            if attempt > 0 {
                out.retry();
            }
            let sent = exchange(
                channel,
                headers,
                ask,
                traceparent,
                start,
                &mut out,
                &mut timing,
            )
            .await;
            if sent != Attempt::Refused || !headers.retry {
                break;
            }
        }
    };
    if tokio::time::timeout(timeout, call).await.is_err() {
        out.fail(
            "timeout",
            format!("no end of stream within {:.1} s", timeout.as_secs_f64()),
        );
    }
    conclude(&mut out, &timing, start);
    out
}

/// The request message of `ask`.
pub fn request(ask: &Ask) -> proto::QueryRequest {
    proto::QueryRequest {
        query: ask.query.clone(),
        top_k: ask.top_k.map(|k| k as u32),
        rerank_top_n: ask.rerank_top_n.map(|n| n as u32),
        max_tokens: ask.max_tokens.map(|m| m as u32),
        filter: ask.filter.as_ref().and_then(|f| match to_value(f) {
            prost_types::value::Kind::StructValue(s) => Some(s),
            _ => None,
        }),
        ..Default::default()
    }
}

async fn exchange(
    channel: &Channel,
    headers: &Headers,
    ask: &Ask,
    traceparent: &str,
    start: Instant,
    out: &mut Outcome,
    timing: &mut Timing,
) -> Attempt {
    let mut call = tonic::Request::new(request(ask));
    let meta = call.metadata_mut();
    let value = |s: &str| MetadataValue::try_from(s).ok();
    if let Some(v) = value(traceparent) {
        meta.insert("traceparent", v);
    }
    if let Some(v) = headers
        .api_key
        .as_deref()
        .and_then(|k| value(&format!("Bearer {k}")))
    {
        meta.insert("authorization", v);
    }
    if let Some(v) = headers.fault.as_deref().and_then(value) {
        meta.insert("x-ragscope-fault", v);
    }
    let mut client = RagClient::new(channel.clone());
    let mut stream = match client.query(call).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            fail(out, &status);
            return refused(&status);
        }
    };
    out.status = Some(200);
    loop {
        match stream.message().await {
            Ok(Some(event)) => match event.event {
                Some(Event::Token(_)) => timing.token(start.elapsed()),
                Some(Event::Done(done)) => {
                    finished(out, done);
                    return Attempt::Done;
                }
                Some(Event::Sources(_)) | None => {}
            },
            Ok(None) => {
                out.fail("stream", "the stream ended before its final event");
                return Attempt::Done;
            }
            Err(status) => {
                fail(out, &status);
                return Attempt::Done;
            }
        }
    }
}

/// A call its connection refused before any response: `Cancelled` is what hyper answers for a
/// call sent on a connection that had its GOAWAY, `Unavailable` for one whose connection closed
/// or could not open. Such a status is made from a transport error, its source; one the server
/// sent (a draining server's `Unavailable` too) has none and is an answer, not retried.
fn refused(status: &tonic::Status) -> Attempt {
    let transport = std::error::Error::source(status).is_some();
    match status.code() {
        tonic::Code::Cancelled | tonic::Code::Unavailable if transport => Attempt::Refused,
        _ => Attempt::Done,
    }
}

/// A failed call: `grpc_<code>` (`grpc_unavailable`, `grpc_resource_exhausted`, …).
fn fail(out: &mut Outcome, status: &tonic::Status) {
    let code = format!("{:?}", status.code());
    let mut kind = String::from("grpc_");
    for (i, c) in code.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            kind.push('_');
        }
        kind.push(c.to_ascii_lowercase());
    }
    out.fail(kind, status.message().to_string());
}

/// What `done` says: usage, the prefix and embedding caches, the server's stage timings.
fn finished(out: &mut Outcome, done: proto::Done) {
    if let Some(u) = done.usage {
        out.tokens = u64::from(u.completion_tokens);
        out.prompt_tokens = Some(u64::from(u.prompt_tokens));
        out.cached_tokens = Some(u64::from(u.cached_tokens));
    }
    out.embedding_cached = Some(done.query_embedding_cached);
    if let Some(t) = done.timings {
        out.server_timings = Some(
            [
                ("queue_ms", t.queue_ms),
                ("embed_ms", t.embed_ms),
                ("retrieve_ms", t.retrieve_ms),
                ("rerank_ms", t.rerank_ms),
                ("context_ms", t.context_ms),
                ("prompt_ms", t.prompt_ms),
                ("prefill_ms", t.prefill_ms),
                ("decode_ms", t.decode_ms),
                ("ttft_ms", t.ttft_ms),
                ("total_ms", t.total_ms),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        );
    }
}

/// A JSON value as a protobuf `Value` (what the `filter` Struct holds).
fn to_value(v: &Value) -> prost_types::value::Kind {
    use prost_types::value::Kind;
    match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a
                .iter()
                .map(|v| prost_types::Value {
                    kind: Some(to_value(v)),
                })
                .collect(),
        }),
        Value::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        prost_types::Value {
                            kind: Some(to_value(v)),
                        },
                    )
                })
                .collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_request_carries_the_ask_and_its_filter() {
        let ask = Ask {
            query: "q".into(),
            top_k: Some(8),
            rerank_top_n: None,
            max_tokens: Some(4),
            filter: Some(json!({"doc_id": "x", "source": {"any": ["a", "b"]}})),
        };
        let r = request(&ask);
        assert_eq!(r.query, "q");
        assert_eq!(r.top_k, Some(8));
        assert_eq!(r.rerank_top_n, None);
        assert_eq!(r.max_tokens, Some(4));
        let f = r.filter.unwrap();
        assert_eq!(
            f.fields["doc_id"].kind,
            Some(prost_types::value::Kind::StringValue("x".into()))
        );
        assert!(matches!(
            f.fields["source"].kind,
            Some(prost_types::value::Kind::StructValue(_))
        ));
        assert!(request(&Ask {
            filter: None,
            ..ask
        })
        .filter
        .is_none());
    }

    #[test]
    fn only_a_status_from_the_transport_counts_as_refused() {
        let sent = tonic::Status::unavailable("the server is shutting down");
        assert_eq!(refused(&sent), Attempt::Done);
        let mut io = tonic::Status::cancelled("operation was canceled");
        io.set_source(std::sync::Arc::new(std::io::Error::other(
            "connection closing",
        )));
        assert_eq!(refused(&io), Attempt::Refused);
        let mut exhausted = tonic::Status::resource_exhausted("queue full");
        exhausted.set_source(std::sync::Arc::new(std::io::Error::other("x")));
        assert_eq!(refused(&exhausted), Attempt::Done);
    }

    #[test]
    fn status_codes_become_snake_case_error_kinds() {
        let mut out = Outcome::default();
        fail(&mut out, &tonic::Status::resource_exhausted("queue full"));
        assert_eq!(out.error.as_deref(), Some("grpc_resource_exhausted"));
        let mut out = Outcome::default();
        fail(&mut out, &tonic::Status::unavailable("goaway"));
        assert_eq!(out.error.as_deref(), Some("grpc_unavailable"));
        assert_eq!(out.error_detail.as_deref(), Some("goaway"));
    }
}
