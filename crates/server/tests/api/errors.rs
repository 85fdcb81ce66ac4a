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
    // The corpus is a file so that scripts/chaos tries the very same cases.
    let corpus: Value = serde_json::from_str(include_str!("bad_inputs.json")).unwrap();
    let cases = corpus["cases"].as_array().unwrap();
    assert!(cases.len() >= 34, "the corpus lost cases: {}", cases.len());
    for case in cases {
        let path = case["path"].as_str().unwrap();
        let body: Vec<u8> = match case["body_hex"].as_str() {
            Some(hex) => (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect(),
            None => case["body"].as_str().unwrap().as_bytes().to_vec(),
        };
        let status = case["status"].as_u64().unwrap() as u16;
        let field = case["field"].as_str().unwrap();
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
