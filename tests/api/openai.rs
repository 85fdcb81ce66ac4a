//! The OpenAI-compatible endpoints answer in OpenAI's shapes.

use base64::Engine;
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_app, spawn_fake_app, TestApp};
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

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "fake-generator",
        "messages": [{"role": "user", "content": "What is the capital of Zorbia?"}],
        "max_tokens": 4,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

async fn assert_refused(app: &TestApp, path: &str, body: &Value, param: &str, code: &str) {
    let (status, response) = app.post(path, body).await;
    assert_eq!(status, 400, "{body}: {response}");
    let err = &response["error"];
    assert_eq!(err["param"], param, "{body}: {response}");
    assert_eq!(err["code"], code, "{body}: {response}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{param}: ")),
        "{response}"
    );
}

#[tokio::test]
async fn chat_fields_that_would_change_the_answer_are_refused_by_name_unless_neutral() {
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    let asking = json!({
        "stop": ["."], "n": 5, "logprobs": true, "top_logprobs": 3,
        "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"50256": -100},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
        "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": true,
        "response_format": {"type": "json_object"}, "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
        "web_search_options": {},
    });
    for (field, value) in asking.as_object().unwrap() {
        let body = chat(json!({ field: value }));
        assert_refused(
            &app,
            "/v1/chat/completions",
            &body,
            field,
            "unsupported_parameter",
        )
        .await;
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        assert_refused(
            &app,
            "/v1/chat/completions",
            &streamed,
            field,
            "unsupported_parameter",
        )
        .await;
    }
    assert_refused(
        &app,
        "/v1/chat/completions",
        &chat(json!({"frobnicate": 1})),
        "frobnicate",
        "unknown_parameter",
    )
    .await;
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat(json!({"stream": true, "stream_options": {"include_usage": true, "foo": 1}})),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "stream_options.foo", "{body}");

    let neutral = json!({
        "n": 1, "stop": null, "logprobs": false, "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "modalities": ["text"], "top_logprobs": null,
        "user": "u-1", "metadata": {"run": "a"}, "store": false, "service_tier": "auto",
    });
    let (status, body) = app
        .post("/v1/chat/completions", &chat(neutral.clone()))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"].as_array().unwrap().len(), 1);

    let mut streamed = chat(neutral);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = app
        .client
        .post(app.url("/v1/chat/completions"))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert!(
        last["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "{last}"
    );
    app.stop().await;
}

#[tokio::test]
async fn embeddings_refuse_unknown_fields_by_name_and_ignore_user() {
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    let body = json!({"model": "fake-embedder", "input": "hello", "user": "u-1"});
    let (status, response) = app.post("/v1/embeddings", &body).await;
    assert_eq!(status, 200, "{response}");
    assert_eq!(
        response["data"][0]["embedding"].as_array().unwrap().len(),
        4
    );
    let mut unknown = body.clone();
    unknown["input_type"] = json!("query");
    assert_refused(
        &app,
        "/v1/embeddings",
        &unknown,
        "input_type",
        "unknown_parameter",
    )
    .await;
    app.stop().await;
}
