//! Ingest and delete: idempotent re-ingest, durable across restart, deletion.

use serde_json::json;

use crate::helpers::{fixtures, spawn_app, spawn_app_in};

#[tokio::test]
async fn reingesting_the_same_documents_adds_nothing() {
    let app = spawn_app().await;
    let first = app.ingest_fixtures().await;
    let docs = first["documents"].as_array().unwrap();
    assert_eq!(docs.len(), 3);
    assert!(
        docs.iter()
            .all(|d| d["status"] == "created" && d["chunks"].as_u64().unwrap() >= 1),
        "{first}"
    );
    let (_, ready) = app.get("/ready").await;
    let points = ready["store"]["points"].as_u64().unwrap();

    let second = app.ingest_fixtures().await;
    assert!(
        second["documents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["status"] == "unchanged"),
        "{second}"
    );
    let (_, ready) = app.get("/ready").await;
    assert_eq!(ready["store"]["points"].as_u64().unwrap(), points);

    // A changed document replaces its old chunks instead of adding to them.
    let changed = app
        .ingest(json!([{"id": "zorbia", "text": "Zorbia moved its capital to Vell in 2025."}]))
        .await;
    assert_eq!(changed["documents"][0]["status"], "replaced");
    let (_, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "capital of Zorbia", "max_tokens": 2, "filter": {"doc_id": "zorbia"}}),
        )
        .await;
    let sources = body["sources"].as_array().unwrap();
    assert_eq!(sources.len(), 1, "{body}");
    assert!(sources[0]["text"].as_str().unwrap().contains("Vell"));
}

#[tokio::test]
async fn documents_survive_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let app = spawn_app_in(tmp.path(), &[]).await;
    app.ingest_fixtures().await;
    let (_, before) = app.get("/ready").await;
    app.stop().await;

    let app = spawn_app_in(tmp.path(), &[]).await;
    let (_, after) = app.get("/ready").await;
    assert_eq!(after["store"]["points"], before["store"]["points"]);
    let (status, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 24}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["sources"][0]["doc_id"], "zorbia");
    assert!(body["answer"].as_str().unwrap().contains("Quenta"));
    let again = app.ingest(fixtures()).await;
    assert!(again["documents"]
        .as_array()
        .unwrap()
        .iter()
        .all(|d| d["status"] == "unchanged"));
    app.stop().await;
}

#[tokio::test]
async fn deleting_a_document_removes_its_chunks() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let r = app
        .client
        .delete(app.url("/v1/documents/flumox"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["deleted_chunks"].as_u64().unwrap() >= 1);
    let r = app
        .client
        .delete(app.url("/v1/documents/flumox"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let (_, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "Who invented the flumox?", "max_tokens": 2}),
        )
        .await;
    assert!(body["sources"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["doc_id"] != "flumox"));
}
