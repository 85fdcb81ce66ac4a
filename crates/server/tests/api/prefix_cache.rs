//! Prefix KV reuse as a client sees it: a repeated question reports its cached prompt tokens in
//! the OpenAI, native and gRPC usage, on the `chat` and `prefill` spans, and in the metrics.

use ragscope::api::grpc::proto::query_event::Event;
use ragscope::api::grpc::proto::QueryRequest;
use serde_json::{json, Value};

use crate::helpers::{spawn_app, spawn_app_with, TestApp};
use crate::stages::{attr, last_trace, record_spans, span};

const BLOCK: u64 = 16;

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {usage}"))
}

async fn chat(app: &TestApp) -> Value {
    let body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of Zorbia?"}],
        "max_tokens": 8,
    });
    let (status, body) = app.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// An int attribute of the last trace's first span named `prefix…`.
async fn last_trace_int(app: &TestApp, prefix: &str, key: &str) -> Option<i64> {
    let spans = last_trace(app).await;
    attr(span(&spans, prefix), key)?["intValue"]
        .as_str()?
        .parse()
        .ok()
}

#[tokio::test]
async fn a_repeated_question_reads_its_prompt_from_the_prefix_cache() {
    record_spans();
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let first = chat(&app).await;
    assert_eq!(cached(&first["usage"]), 0, "nothing cached yet");
    let rate = "rag.prefill.tokens_per_second";
    assert!(attr(span(&last_trace(&app).await, "prefill"), rate).is_some());
    let second = chat(&app).await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(first["usage"]["prompt_tokens"].as_u64(), Some(prompt));
    // The whole prompt was cached with its end: nothing is prefilled again.
    assert_eq!(cached(&second["usage"]), prompt);
    assert_eq!(
        first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"],
        "greedy: the same answer from the cache"
    );
    let hit = cached(&second["usage"]) as i64;
    assert_eq!(
        last_trace_int(&app, "chat", "gen_ai.usage.cache_read.input_tokens").await,
        Some(hit)
    );
    assert_eq!(
        last_trace_int(&app, "prefill", "rag.prefill.cached_tokens").await,
        Some(hit)
    );
    assert_eq!(
        last_trace_int(&app, "prefill", "rag.prefill.computed_tokens").await,
        Some(prompt as i64 - hit)
    );
    // Nothing computed, so no rate (0 would read as a stalled prefill).
    assert_eq!(attr(span(&last_trace(&app).await, "prefill"), rate), None);

    // The native endpoint and gRPC report it too (the same question: the same prompt).
    let (status, native) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, 200, "{native}");
    assert!(cached(&native["usage"]) >= BLOCK, "{native}");
    let mut client = app.rag_client().await;
    let request = QueryRequest {
        query: "What is the capital of Zorbia?".into(),
        max_tokens: Some(8),
        ..Default::default()
    };
    let mut stream = client.query(request).await.unwrap().into_inner();
    let mut usage = None;
    while let Some(e) = stream.message().await.unwrap() {
        if let Some(Event::Done(done)) = e.event {
            usage = done.usage;
        }
    }
    let usage = usage.expect("a done event");
    assert!(usage.cached_tokens as u64 >= BLOCK, "{usage:?}");
    assert!(usage.cached_tokens <= usage.prompt_tokens);

    let metrics = app.metrics_text().await;
    let value = |name: &str| -> f64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in\n{metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("ragscope_prefix_cache_lookups_total") >= 4.0);
    assert!(value("ragscope_prefix_cache_hits_total") >= 3.0);
    assert!(value("ragscope_prefix_cache_hit_tokens_total") >= hit as f64);
    assert!(value("ragscope_prefix_cache_bytes") > 0.0);
    assert_eq!(value("ragscope_prefix_cache_evictions_total"), 0.0);
}

#[tokio::test]
async fn a_zero_budget_turns_the_prefix_cache_off() {
    let app = spawn_app_with(&["--prefix-cache-mb", "0"]).await;
    app.ingest_fixtures().await;
    chat(&app).await;
    let second = chat(&app).await;
    assert_eq!(cached(&second["usage"]), 0);
}
