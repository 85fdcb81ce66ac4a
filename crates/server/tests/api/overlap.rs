//! The retrieval–generation overlap as a client and a trace see it: an overlapped request's
//! `warm_prefill` runs beside `embeddings` and `retrieval`, nests in the request, and its head
//! is the prompt's prefix-cache hit; the greedy answer is the sequential one; the `overlap`
//! field is checked, overrides `--overlap`, and works over gRPC.

use ragscope::api::grpc::proto::query_event::Event;
use ragscope::api::grpc::proto::QueryRequest;
use serde_json::{json, Value};

use crate::helpers::{spawn_app, spawn_app_with, TestApp};
use crate::stages::{attr, last_trace, record_spans, span};

const QUESTION: &str = "What is the capital of Zorbia?";

/// A number the OTLP JSON may write as a string.
fn number(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

fn nanos(span: &Value, key: &str) -> u64 {
    number(&span[key]).unwrap_or_else(|| panic!("{key} of {span}"))
}

fn int(span: &Value, key: &str) -> i64 {
    let value = attr(span, key).unwrap_or_else(|| panic!("no {key} on {span}"));
    number(&value["intValue"]).unwrap_or_else(|| panic!("{key} = {value}")) as i64
}

async fn ask(app: &TestApp, body: Value) -> Value {
    let (status, out) = app.post("/v1/rag/query", &body).await;
    assert_eq!(status, 200, "{out}");
    out
}

fn warm_spans(spans: &[Value]) -> Vec<&Value> {
    spans
        .iter()
        .filter(|s| s["name"] == "warm_prefill")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlapped_request_prefills_its_head_beside_retrieval_with_the_same_answer() {
    record_spans();
    let app = spawn_app_with(&["--faults", "true", "--fault-header", "true"]).await;
    app.ingest_fixtures().await;
    let body = json!({"query": QUESTION, "max_tokens": 8, "overlap": true});
    // Retrieval held 300 ms, so the warm's thread gets its prefill turn before the prompt is
    // built even on a busy machine (without it the request's own prefill sometimes came first
    // under a parallel test run, and the warm was called off).
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .header("x-ragscope-fault", r#"{"retrieval": {"delay_ms": 300}}"#)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let overlapped: Value = r.json().await.unwrap();
    let spans = last_trace(&app).await;
    let root = span(&spans, "POST /v1/rag/query");
    let warm = span(&spans, "warm_prefill");
    let (embed, retrieval) = (span(&spans, "embeddings"), span(&spans, "retrieval"));
    assert_eq!(warm["parentSpanId"], root["spanId"]);
    assert!(nanos(warm, "startTimeUnixNano") >= nanos(root, "startTimeUnixNano"));
    assert!(nanos(warm, "endTimeUnixNano") <= nanos(root, "endTimeUnixNano"));
    // Concurrent on the shared clock: it starts before retrieval ends, ends after embedding starts.
    assert!(nanos(warm, "startTimeUnixNano") <= nanos(embed, "startTimeUnixNano"));
    assert!(nanos(warm, "startTimeUnixNano") < nanos(retrieval, "endTimeUnixNano"));
    assert!(nanos(warm, "endTimeUnixNano") > nanos(embed, "startTimeUnixNano"));
    assert_eq!(
        attr(warm, "rag.overlap.outcome"),
        Some(json!({"stringValue": "prefilled"}))
    );
    // A fresh server: the head was computed by the warm and is all the prompt's prefill reused.
    let head = int(warm, "gen_ai.usage.input_tokens");
    assert!(head >= 16 && head % 16 == 0, "{warm}");
    assert_eq!(int(warm, "rag.prefill.cached_tokens"), 0);
    let cached = &overlapped["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert_eq!(cached.as_i64(), Some(head), "{overlapped}");
    assert_eq!(
        int(span(&spans, "prefill"), "rag.prefill.cached_tokens"),
        head
    );

    // The sequential answer from a server that computes every prompt whole, `--overlap on`
    // overridden by the request; the same server's default is the warm, which has nothing
    // to do without a prefix cache.
    let whole = spawn_app_with(&["--prefix-cache-mb", "0", "--overlap", "on"]).await;
    whole.ingest_fixtures().await;
    let sequential = ask(
        &whole,
        json!({"query": QUESTION, "max_tokens": 8, "overlap": false}),
    )
    .await;
    assert!(warm_spans(&last_trace(&whole).await).is_empty());
    assert_eq!(
        overlapped["answer"], sequential["answer"],
        "greedy: the same answer"
    );
    assert_eq!(
        overlapped["usage"]["prompt_tokens"],
        sequential["usage"]["prompt_tokens"]
    );
    ask(&whole, json!({"query": QUESTION, "max_tokens": 4})).await;
    let spans = last_trace(&whole).await;
    assert_eq!(
        attr(span(&spans, "warm_prefill"), "rag.overlap.outcome"),
        Some(json!({"stringValue": "skipped"}))
    );

    // gRPC takes the field too; the head is cached now, so the warm computes one position.
    // Retrieval held as above, so the warm gets its turn before the prompt is built.
    let mut client = app.rag_client().await;
    let mut request = tonic::Request::new(QueryRequest {
        query: QUESTION.into(),
        max_tokens: Some(4),
        overlap: Some(true),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "x-ragscope-fault",
        r#"{"retrieval": {"delay_ms": 300}}"#.parse().unwrap(),
    );
    let mut stream = client.query(request).await.unwrap().into_inner();
    let mut done = false;
    while let Some(e) = stream.message().await.unwrap() {
        done |= matches!(e.event, Some(Event::Done(_)));
    }
    assert!(done);
    let spans = last_trace(&app).await;
    let warm = span(&spans, "warm_prefill");
    assert_eq!(int(warm, "rag.prefill.cached_tokens"), head);
    assert_eq!(int(warm, "rag.prefill.computed_tokens"), 1);
}

#[tokio::test]
async fn the_overlap_field_must_be_a_boolean() {
    let app = spawn_app().await;
    for (path, body) in [
        (
            "/v1/rag/query",
            json!({"query": QUESTION, "overlap": "yes"}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "x", "messages": [{"role": "user", "content": QUESTION}], "overlap": 1}),
        ),
    ] {
        let (status, out) = app.post(path, &body).await;
        assert_eq!(status, 400, "{path}: {out}");
        let message = out["error"]["message"].as_str().unwrap_or_default();
        assert!(
            out["error"]["param"] == "overlap" || message.contains("overlap"),
            "{path}: {out}"
        );
    }
    // Legacy completions have no retrieval to overlap: the field is refused by name.
    let (status, out) = app
        .post(
            "/v1/completions",
            &json!({"model": "x", "prompt": "Hi", "overlap": true}),
        )
        .await;
    assert_eq!(status, 400, "{out}");
    assert!(out.to_string().contains("overlap"), "{out}");
}
