//! Fault injection: off unless configured, switched at run time with a token, per request
//! through a header only when allowed, and always recorded on the span it hit.

use serde_json::json;

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_fake_app, spawn_fake_app_with};

#[tokio::test]
async fn faults_are_off_by_default() {
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    app.ingest_fixtures().await;
    let (status, body) = app.get("/admin/faults").await;
    assert_eq!(status, 404, "{body}");
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .header("x-ragscope-fault", r#"{"retrieval": {"delay_ms": 5}}"#)
        .json(&json!({"query": "Zorbia?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("x-ragscope-fault:"),
        "{body}"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_admin_endpoint_needs_the_token_and_a_valid_plan() {
    let app = spawn_fake_app_with(
        FakeGenerator::new(4),
        &["--faults", "true", "--fault-admin-token", "s3cret"],
    )
    .await;
    let put = |token: &str, body: &str| {
        app.client
            .put(app.url("/admin/faults"))
            .bearer_auth(token)
            .body(body.to_string())
            .send()
    };
    assert_eq!(put("wrong", "{}").await.unwrap().status(), 401);
    let r = put("s3cret", r#"{"retrieval": {"error_rate": 3}}"#)
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("retrieval.error_rate"),
        "{body}"
    );
    let r = put("s3cret", r#"{"chat": {"error_rate": 1}}"#)
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    app.ingest_fixtures().await;
    // Every request now fails in chat, with a message saying it was injected.
    let (status, body) = app
        .post("/v1/rag/query", &json!({"query": "Zorbia?"}))
        .await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(
        body["error"]["message"],
        "fault injected into the chat stage"
    );
    let r = app
        .client
        .delete(app.url("/admin/faults"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let (status, _) = app
        .post("/v1/rag/query", &json!({"query": "Zorbia?"}))
        .await;
    assert_eq!(status, 200, "the server stays up and serves again");
    let metrics = app.metrics_text().await;
    let counted = metrics.lines().find(|l| {
        l.starts_with("ragscope_faults_injected_total{")
            && l.contains(r#"kind="error""#)
            && l.contains(r#"rag_stage="chat""#)
    });
    assert!(counted.is_some_and(|l| l.ends_with(" 1")), "{metrics}");
    app.stop().await;
}

#[tokio::test]
async fn a_header_plan_is_recorded_on_the_spans_it_hit() {
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    opentelemetry::global::set_tracer_provider(telemetry::tracer_provider(
        exporter,
        telemetry::resource(),
    ));
    let app = spawn_fake_app_with(
        FakeGenerator::new(4),
        &["--faults", "true", "--fault-header", "true"],
    )
    .await;
    app.ingest_fixtures().await;
    app.client
        .delete(app.url("/debug/traces"))
        .send()
        .await
        .unwrap();
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .header(
            "x-ragscope-fault",
            r#"{"embeddings": {"delay_ms": 3, "cpu_burn_ms": 2}, "chat": {"token_delay_ms": 1}}"#,
        )
        .json(&json!({"query": "Zorbia?", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (_, traces) = app.get("/debug/traces?limit=1").await;
    let spans = &traces["resourceSpans"][0]["scopeSpans"][0]["spans"];
    let attr = |span_prefix: &str, key: &str| {
        spans
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["name"].as_str().unwrap().starts_with(span_prefix))
            .flat_map(|s| s["attributes"].as_array().unwrap().clone())
            .find(|a| a["key"] == key)
            .map(|a| a["value"].clone())
    };
    assert_eq!(
        attr("embeddings", "rag.fault.delay_ms"),
        Some(json!({"doubleValue": 3.0}))
    );
    assert_eq!(
        attr("embeddings", "rag.fault.cpu_burn_ms"),
        Some(json!({"doubleValue": 2.0}))
    );
    assert_eq!(
        attr("chat", "rag.fault.delayed_tokens"),
        Some(json!({"intValue": "4"}))
    );
    assert_eq!(
        attr("POST", "rag.fault.plan"),
        Some(json!({"stringValue": "header"}))
    );
    assert_eq!(attr("retrieval", "rag.fault.delay_ms"), None);
    let bad = app
        .client
        .post(app.url("/v1/rag/query"))
        .header(
            "x-ragscope-fault",
            r#"{"embeddings": {"delay": {"dist": "gamma"}}}"#,
        )
        .json(&json!({"query": "Zorbia?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    app.stop().await;
}
