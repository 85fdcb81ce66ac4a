//! The OpenAI-compatible endpoints answer in OpenAI's shapes.

use base64::Engine;
use serde_json::{json, Value};

use crate::helpers::spawn_app;
use crate::query::sse_events;

#[tokio::test]
async fn chat_completions_answer_in_openai_shape_streamed_and_not() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let req = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of Zorbia?"}
        ],
        "max_tokens": 24,
        "temperature": 0
    });
    let (status, body) = app.post("/v1/chat/completions", &req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("Quenta"), "{content}");
    assert!(["stop", "length"].contains(&body["choices"][0]["finish_reason"].as_str().unwrap()));
    let u = &body["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );

    let mut stream_req = req.clone();
    stream_req["stream"] = json!(true);
    let r = app
        .client
        .post(app.url("/v1/chat/completions"))
        .json(&stream_req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text.trim(), content);
    assert!(chunks.last().unwrap()["choices"][0]["finish_reason"].is_string());
}

#[tokio::test]
async fn embeddings_come_as_floats_or_base64_of_the_same_vector() {
    let app = spawn_app().await;
    let (status, body) = app
        .post(
            "/v1/embeddings",
            &json!({"model": "all-MiniLM-L6-v2", "input": ["hello world", "git stash"]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["index"], 1);
    let floats: Vec<f32> = data[0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(floats.len(), 384);
    let norm: f32 = floats.iter().map(|x| x * x).sum();
    assert!((norm - 1.0).abs() < 1e-3);
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    let (_, b64) = app
        .post("/v1/embeddings", &json!({"model": "all-MiniLM-L6-v2", "input": "hello world", "encoding_format": "base64"}))
        .await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for (a, b) in decoded.iter().zip(&floats) {
        assert!((a - b).abs() < 1e-5);
    }
}

#[tokio::test]
async fn models_lists_what_the_server_runs() {
    let app = spawn_app().await;
    let (status, body) = app.get("/v1/models").await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(
        ids.contains(&"SmolLM2-135M-Instruct") && ids.contains(&"all-MiniLM-L6-v2"),
        "{ids:?}"
    );
    assert!(body["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["object"] == "model"));
}
