//! The RAG query endpoint: grounded answers with sources, streaming, filters, backpressure.

use serde_json::{json, Value};

use crate::helpers::{spawn_app, spawn_app_with};

#[tokio::test]
async fn answers_are_grounded_in_the_ingested_passages() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let (status, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 32}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let answer = body["answer"].as_str().unwrap();
    assert!(answer.contains("Quenta"), "answer: {answer}");
    let sources = body["sources"].as_array().unwrap();
    assert_eq!(sources[0]["doc_id"], "zorbia", "{body}");
    assert!(sources[0]["text"].as_str().unwrap().contains("Quenta"));
    assert_eq!(sources[0]["metadata"]["topic"], "geography");
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 20);
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    let t = &body["timings"];
    for key in [
        "embed_ms",
        "retrieve_ms",
        "prompt_ms",
        "prefill_ms",
        "decode_ms",
        "ttft_ms",
        "total_ms",
    ] {
        assert!(t[key].as_f64().unwrap() >= 0.0, "{key}: {t}");
    }
    assert!(t["total_ms"].as_f64().unwrap() >= t["ttft_ms"].as_f64().unwrap());
}

/// Splits an SSE body into (event, data) pairs.
pub fn sse_events(body: &str) -> Vec<(String, String)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .filter_map(|event| {
            let mut name = "message".to_string();
            let mut data = String::new();
            for line in event.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = n.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                }
            }
            (!data.is_empty()).then_some((name, data))
        })
        .collect()
}

#[tokio::test]
async fn streaming_sends_sources_then_tokens_then_done_and_matches_the_json_answer() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let q = json!({"query": "Who invented the flumox?", "max_tokens": 24, "stream": true});
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .json(&q)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events[0].0, "sources");
    let sources: Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(sources[0]["doc_id"], "flumox");
    let tokens: Vec<&(String, String)> = events.iter().filter(|(n, _)| n == "token").collect();
    assert!(!tokens.is_empty());
    let (last, done) = events.last().unwrap();
    assert_eq!(last, "done");
    let done: Value = serde_json::from_str(done).unwrap();
    assert!(done["usage"]["completion_tokens"].as_u64().unwrap() as usize >= tokens.len());
    let streamed: String = tokens
        .iter()
        .map(|(_, d)| {
            serde_json::from_str::<Value>(d).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();

    let mut plain = q.clone();
    plain["stream"] = json!(false);
    let (_, body) = app.post("/v1/rag/query", &plain).await;
    assert_eq!(
        streamed.trim(),
        body["answer"].as_str().unwrap(),
        "greedy decoding is deterministic"
    );
    assert!(streamed.contains("Lindqvist"), "{streamed}");
}

#[tokio::test]
async fn filters_restrict_the_sources() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    for (filter, doc) in [
        (json!({"doc_id": "flumox"}), "flumox"),
        (json!({"metadata.topic": "git"}), "gitdoc"),
        (
            json!({"source": {"any": ["atlas/zorbia.md", "nowhere"]}}),
            "zorbia",
        ),
    ] {
        let (status, body) = app
            .post("/v1/rag/query", &json!({"query": "What is the capital of Zorbia?", "max_tokens": 4, "filter": filter}))
            .await;
        assert_eq!(status, 200, "{body}");
        let sources = body["sources"].as_array().unwrap();
        assert!(!sources.is_empty());
        assert!(
            sources.iter().all(|s| s["doc_id"] == doc),
            "{filter}: {body}"
        );
    }
}

#[tokio::test]
async fn a_full_queue_answers_429_with_retry_after_and_recovers() {
    let app = spawn_app_with(&["--workers", "1", "--queue-capacity", "1"]).await;
    app.ingest_fixtures().await;
    let q = json!({"query": "Describe Zorbia in detail.", "max_tokens": 48});
    let requests = (0..6).map(|_| app.client.post(app.url("/v1/rag/query")).json(&q).send());
    let responses = futures::future::join_all(requests).await;
    let mut statuses: Vec<u16> = Vec::new();
    for r in responses {
        let r = r.unwrap();
        let status = r.status().as_u16();
        if status == 429 {
            // Computed from the queue: whole seconds, at least 1.
            let retry_after: u64 = r.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(retry_after >= 1);
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"]["type"], "rate_limit_error");
        }
        statuses.push(status);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    let (status, _) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "Zorbia?", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn rerank_endpoint_orders_passages_by_relevance() {
    let app = spawn_app().await;
    let (status, body) = app
        .post(
            "/v1/rerank",
            &json!({"query": "create a shallow clone with --depth", "documents": [
                "bake the bread for forty minutes",
                "git clone --depth 1 creates a shallow clone with a truncated history",
                "git log shows commit logs"
            ], "return_documents": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results[0]["index"], 1, "{body}");
    assert!(results[0]["document"]["text"]
        .as_str()
        .unwrap()
        .contains("--depth"));
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
}

#[tokio::test]
async fn health_and_ready_report_the_loaded_server() {
    let app = spawn_app().await;
    let (status, body) = app.get("/health").await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));
    let (status, body) = app.get("/ready").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["models"]["generator"], "SmolLM2-135M-Instruct");
    assert_eq!(body["store"]["system"], "qdrant-edge");
}

#[tokio::test]
async fn a_client_that_goes_away_mid_stream_stops_its_generation() {
    // 3,000 stand-in tokens take 9 s; the worker is free again long before that.
    let app = crate::helpers::spawn_fake_app(crate::fakes::FakeGenerator {
        tokens: 3000,
        token_us: 3000,
    })
    .await;
    app.ingest_fixtures().await;
    let q = json!({"query": "long", "max_tokens": 3000, "stream": true});
    let mut r = app
        .client
        .post(app.url("/v1/rag/query"))
        .json(&q)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.chunk().await.unwrap().expect("first event");
    drop(r);
    let (status, body) = app
        .post("/v1/rag/query", &json!({"query": "short", "max_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{body}");
    let queued = body["timings"]["queue_ms"].as_f64().unwrap();
    assert!(
        queued < 2000.0,
        "waited {queued} ms behind an abandoned generation"
    );
}
