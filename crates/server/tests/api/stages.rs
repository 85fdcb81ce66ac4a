//! Every route's stages carry the same instrumentation, from the one stage runner: model
//! attributes, `error.type` on the span that failed, faults where the plan puts them.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::fakes::{DownStore, FakeGenerator};
use crate::helpers::{spawn_fake_app_with, spawn_fake_app_with_store, TestApp};

/// Spans go to the server's recent-trace buffer (`/debug/traces`), as when it serves.
pub fn record_spans() {
    opentelemetry::global::set_tracer_provider(telemetry::tracer_provider(
        opentelemetry_sdk::trace::InMemorySpanExporter::default(),
        telemetry::resource(),
    ));
}

/// The spans of the most recent trace the server kept.
pub async fn last_trace(app: &TestApp) -> Vec<Value> {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (_, traces) = app.get("/debug/traces?limit=1").await;
    traces["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

pub fn span<'a>(spans: &'a [Value], prefix: &str) -> &'a Value {
    spans
        .iter()
        .find(|s| s["name"].as_str().unwrap().starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} span in {spans:#?}"))
}

pub fn attr(span: &Value, key: &str) -> Option<Value> {
    span["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| a["value"].clone())
}

#[tokio::test]
async fn a_failing_store_marks_the_retrieval_span() {
    record_spans();
    let app = spawn_fake_app_with_store(FakeGenerator::new(3), Arc::new(DownStore)).await;
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .json(&json!({"query": "Zorbia?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "{:?}", r.text().await);
    let spans = last_trace(&app).await;
    let retrieval = span(&spans, "retrieval down");
    assert_eq!(
        attr(retrieval, "error.type"),
        Some(json!({"stringValue": "store"}))
    );
    assert_eq!(retrieval["status"]["code"], json!(2), "{retrieval:#}");
    // The stage before it succeeded and says so.
    assert_eq!(attr(span(&spans, "embeddings"), "error.type"), None);
    app.stop().await;
}

#[tokio::test]
async fn the_embeddings_route_runs_the_same_stage_as_a_query() {
    record_spans();
    let app = spawn_fake_app_with(
        FakeGenerator::new(3),
        &["--faults", "true", "--fault-header", "true"],
    )
    .await;
    let r = app
        .client
        .post(app.url("/v1/embeddings"))
        .header("x-ragscope-fault", r#"{"embeddings": {"delay_ms": 2}}"#)
        .json(&json!({"model": "fake-embedder", "input": ["a", "b"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let spans = last_trace(&app).await;
    let embed = span(&spans, "embeddings");
    assert_eq!(
        attr(embed, "gen_ai.operation.name"),
        Some(json!({"stringValue": "embeddings"}))
    );
    assert_eq!(
        attr(embed, "gen_ai.request.model"),
        Some(json!({"stringValue": "fake-embedder"}))
    );
    assert_eq!(
        attr(embed, "rag.fault.delay_ms"),
        Some(json!({"doubleValue": 2.0}))
    );
    app.stop().await;
}
