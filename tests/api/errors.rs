//! Bad input gets a 4xx JSON error naming the field, the server stays up, nothing stored is lost.

use serde_json::{json, Value};

use crate::helpers::{spawn_app, spawn_app_with};

fn assert_error(status: u16, body: &Value, want_status: u16, field: &str) {
    assert_eq!(status, want_status, "{body}");
    let err = &body["error"];
    let message = err["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(field),
        "message {message:?} should name {field:?}"
    );
    assert!(err["type"].is_string(), "{body}");
}

#[tokio::test]
async fn every_bad_input_gets_a_4xx_naming_the_field_and_loses_nothing() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let (_, ready) = app.get("/ready").await;
    let points = ready["store"]["points"].clone();

    let q = "/v1/rag/query";
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (q, b"{\"query\": ".to_vec(), 400, "body"),
        (q, b"not json".to_vec(), 400, "body"),
        (q, b"".to_vec(), 400, "body"),
        (q, b"{\"query\": \"caf\xc3\x28\"}".to_vec(), 400, "body"),
        (q, br#"{"query": 42}"#.to_vec(), 400, "query"),
        (q, br#"{"query": "x", "top_k": "ten"}"#.to_vec(), 400, "top_k"),
        (q, br#"{"query": "x", "top_k": -1}"#.to_vec(), 400, "top_k"),
        (q, br#"{"query": "   "}"#.to_vec(), 400, "query"),
        (q, br#"{}"#.to_vec(), 400, "body"),
        (q, br#"{"query": "x", "top_k": 0}"#.to_vec(), 400, "top_k"),
        (q, br#"{"query": "x", "top_k": 100000}"#.to_vec(), 400, "top_k"),
        (q, br#"{"query": "x", "rerank_top_n": 50, "top_k": 5}"#.to_vec(), 400, "rerank_top_n"),
        (q, br#"{"query": "x", "max_tokens": 0}"#.to_vec(), 400, "max_tokens"),
        (q, br#"{"query": "x", "max_tokens": 1000000}"#.to_vec(), 400, "max_tokens"),
        (q, br#"{"query": "x", "temperature": 9}"#.to_vec(), 400, "temperature"),
        (q, br#"{"query": "x", "top_p": 0}"#.to_vec(), 400, "top_p"),
        (q, br#"{"query": "x", "filter": {"colour": "red"}}"#.to_vec(), 400, "filter.colour"),
        (q, br#"{"query": "x", "filter": {"doc_id": 1.5}}"#.to_vec(), 400, "filter.doc_id"),
        (q, br#"{"query": "x", "filter": []}"#.to_vec(), 400, "filter"),
        (q, br#"{"query": "x", "tok_k": 3}"#.to_vec(), 400, "tok_k"),
        ("/v1/chat/completions", br#"{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}"#.to_vec(), 404, "model"),
        ("/v1/chat/completions", br#"{"model": "SmolLM2-135M-Instruct", "messages": []}"#.to_vec(), 400, "messages"),
        ("/v1/chat/completions", br#"{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "hi"}]}"#.to_vec(), 400, "messages[0].role"),
        ("/v1/chat/completions", br#"{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": ""}]}"#.to_vec(), 400, "messages[0].content"),
        ("/v1/chat/completions", br#"{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}"#.to_vec(), 400, "max_tokens"),
        ("/v1/embeddings", br#"{"model": "nope", "input": "x"}"#.to_vec(), 404, "model"),
        ("/v1/embeddings", br#"{"model": "all-MiniLM-L6-v2", "input": []}"#.to_vec(), 400, "input"),
        ("/v1/embeddings", br#"{"model": "all-MiniLM-L6-v2", "input": ["ok", 7]}"#.to_vec(), 400, "input[1]"),
        ("/v1/embeddings", br#"{"model": "all-MiniLM-L6-v2", "input": "x", "encoding_format": "hex"}"#.to_vec(), 400, "encoding_format"),
        ("/v1/documents", br#"{"documents": []}"#.to_vec(), 400, "documents"),
        ("/v1/documents", br#"{"documents": [{"text": ""}]}"#.to_vec(), 400, "documents[0].text"),
        ("/v1/documents", br#"{"documents": [{"text": "x", "metadata": {"a": {"b": 1}}}]}"#.to_vec(), 400, "documents[0].metadata.a"),
        ("/v1/documents", br#"{"documents": [{"text": "x", "format": "pdf"}]}"#.to_vec(), 400, "documents[0].format"),
        ("/v1/rerank", br#"{"query": "x", "documents": []}"#.to_vec(), 400, "documents"),
    ];
    for (path, body, status, field) in cases {
        let shown = String::from_utf8_lossy(&body).into_owned();
        let (got, response) = app.post_raw(path, body).await;
        assert!(response["error"].is_object(), "{path} {shown}: {response}");
        assert_error(got, &response, status, field);
    }

    let long = "why ".repeat(2000);
    let (status, body) = app.post(q, &json!({"query": long})).await;
    assert_error(status, &body, 400, "query");

    // Unknown routes and methods are JSON too.
    let (status, body) = app.get("/v1/nothing").await;
    assert_eq!(status, 404);
    assert!(body["error"]["message"].is_string());

    // Still up, nothing lost.
    let (status, ready) = app.get("/ready").await;
    assert_eq!(status, 200);
    assert_eq!(ready["store"]["points"], points);
    let (status, body) = app
        .post(
            q,
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 16}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(body["answer"].as_str().unwrap().contains("Quenta"));
}

#[tokio::test]
async fn an_oversized_body_is_refused_with_413() {
    let app = spawn_app_with(&["--max-body-bytes", "4096"]).await;
    let big = json!({"documents": [{"text": "word ".repeat(5000)}]});
    let (status, body) = app.post("/v1/documents", &big).await;
    assert_eq!(status, 413, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("body"));
    let (status, _) = app.get("/health").await;
    assert_eq!(status, 200);
}
