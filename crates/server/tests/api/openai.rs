//! The OpenAI-compatible endpoints answer in OpenAI's shapes.

use base64::Engine;
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_app, spawn_fake_app, TestApp};

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

    let chunks = chat_chunks(&app, &req).await;
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
        "logit_bias": {"50256": -100},
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
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = chat_chunks(&app, &streamed).await;
    let last = chunks.last().unwrap();
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

/// The chunks of a streamed chat request, without `[DONE]` (which must end it).
async fn chat_chunks(app: &TestApp, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    app.openai_stream("/v1/chat/completions", &body).await
}

/// The streamed text of choice `index`.
fn streamed_text(chunks: &[Value], index: usize) -> String {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .filter(|c| c["index"] == index)
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect()
}

async fn chat_ok(app: &TestApp, body: &Value) -> Value {
    let (status, response) = app.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{body}: {response}");
    response
}

fn zorbia(extra: Value) -> Value {
    let mut body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me about Zorbia and its capital."}],
        "max_tokens": 40,
        "temperature": 0,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn chat_stop_strings_end_the_answer_before_them_streamed_and_not() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let free = chat_ok(&app, &zorbia(json!({}))).await;
    let text = free["choices"][0]["message"]["content"].as_str().unwrap();
    // A word from the middle of the free answer, with the space before it.
    let words: Vec<&str> = text.split(' ').collect();
    assert!(words.len() > 4, "{text}");
    let stop = format!(" {}", words[words.len() / 2]);
    let expected = text[..text.find(&stop).unwrap()].trim();
    for stops in [json!(stop), json!(["never-said", stop])] {
        let body = zorbia(json!({"stop": stops}));
        let cut = chat_ok(&app, &body).await;
        assert_eq!(
            cut["choices"][0]["message"]["content"], expected,
            "{stop:?}"
        );
        assert_eq!(cut["choices"][0]["finish_reason"], "stop");
        let chunks = chat_chunks(&app, &body).await;
        assert_eq!(streamed_text(&chunks, 0).trim(), expected);
        assert!(!streamed_text(&chunks, 0).contains(&stop));
        let last = &chunks.last().unwrap()["choices"][0];
        assert_eq!(last["finish_reason"], "stop", "{last}");
    }
    app.stop().await;
}

#[tokio::test]
async fn chat_n_gives_independent_seeded_choices() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let body = zorbia(json!({"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 16}));
    let a = chat_ok(&app, &body).await;
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{a}");
    let texts: Vec<&str> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i);
            assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
            c["message"]["content"].as_str().unwrap()
        })
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    // Same seed, same choices; choice i is what n = 1 gives with seed + i.
    let again = chat_ok(&app, &body).await;
    assert_eq!(again["choices"], a["choices"]);
    let third = chat_ok(
        &app,
        &zorbia(json!({"temperature": 1.0, "seed": 13, "max_tokens": 16})),
    )
    .await;
    assert_eq!(third["choices"][0]["message"]["content"], texts[2]);
    // Usage counts every choice's tokens.
    let u = &a["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );
    let alone = third["usage"]["completion_tokens"].as_u64().unwrap();
    let all = u["completion_tokens"].as_u64().unwrap();
    assert!(
        all >= alone + texts[..2].iter().filter(|t| !t.is_empty()).count() as u64,
        "{u}"
    );
    // Streamed, each choice arrives under its own index and finishes on its own.
    let chunks = chat_chunks(&app, &body).await;
    for (i, text) in texts.iter().enumerate() {
        assert_eq!(streamed_text(&chunks, i).trim(), *text);
        let finishes = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == i && c["finish_reason"].is_string())
            .count();
        assert_eq!(finishes, 1);
    }
    app.stop().await;
}

#[tokio::test]
async fn chat_logprobs_come_in_openai_shape_streamed_and_not() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let body = zorbia(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 12}));
    let a = chat_ok(&app, &body).await;
    let content = a["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        a["usage"]["completion_tokens"].as_u64().unwrap(),
        "one entry per generated token"
    );
    let mut text = String::new();
    for entry in content {
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0);
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        text.push_str(&String::from_utf8_lossy(&bytes));
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"], "{entry}");
        assert_eq!(top[0]["logprob"], entry["logprob"]);
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
    }
    let answer = a["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.trim(), answer);
    // Without logprobs asked for, none come.
    let plain = chat_ok(&app, &zorbia(json!({"max_tokens": 12}))).await;
    assert!(plain["choices"][0]["logprobs"].is_null());
    assert_eq!(plain["choices"][0]["message"]["content"], answer);
    // Streamed: the same entries, spread over the chunks.
    let chunks = chat_chunks(&app, &body).await;
    let streamed: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&streamed, content);
    app.stop().await;
}

#[tokio::test]
async fn chat_penalties_change_the_text_of_a_looping_answer() {
    let app = spawn_app().await;
    // The generator alone (the `-plain` model): a RAG answer about the fixtures copies its
    // passage and ends, so it has no loop to break, while the model on its own, asked this,
    // writes the same line again and again. Each setting is compared on its own against
    // decoding with no penalty at all.
    let ask = |extra: Value| {
        zorbia(json!({
            "model": "SmolLM2-135M-Instruct-plain",
            "messages": [{"role": "user", "content": "List ten facts about Zorbia, one per line."}],
            "max_tokens": 64,
        }))
        .as_object()
        .cloned()
        .map(|mut b| {
            b.extend(extra.as_object().unwrap().clone());
            Value::Object(b)
        })
        .unwrap()
    };
    let greedy = chat_ok(&app, &ask(json!({}))).await;
    let greedy = greedy["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let lines: Vec<&str> = greedy
        .lines()
        .map(|l| l.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.'))
        .collect();
    assert!(
        (1..lines.len()).any(|i| lines[..i].contains(&lines[i])),
        "the unpenalised answer does not loop: {greedy:?}"
    );
    for penalty in [
        json!({"frequency_penalty": 1.5}),
        json!({"presence_penalty": 2.0}),
        json!({"repetition_penalty": 1.5}),
        json!({"no_repeat_ngram_size": 3}),
    ] {
        let out = chat_ok(&app, &ask(penalty.clone())).await;
        let text = out["choices"][0]["message"]["content"].as_str().unwrap();
        assert_ne!(text, greedy, "{penalty} changed nothing");
    }
    app.stop().await;
}

#[tokio::test]
async fn chat_include_usage_adds_one_usage_chunk_and_only_then() {
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    let body = chat(json!({"stream_options": {"include_usage": true}}));
    let chunks = chat_chunks(&app, &body).await;
    let (last, rest) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    assert_eq!(last["usage"]["completion_tokens"], 4, "{last}");
    assert!(rest
        .iter()
        .all(|c| c["usage"].is_null() && c.get("usage").is_some()));
    for options in [
        json!({}),
        json!({"stream_options": {"include_usage": false}}),
    ] {
        let chunks = chat_chunks(&app, &chat(options)).await;
        assert!(
            chunks.iter().all(|c| c.get("usage").is_none()),
            "{chunks:?}"
        );
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn chat_decoding_fields_out_of_range_are_refused_by_name() {
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    for (extra, param) in [
        (json!({"n": 0}), "n"),
        (json!({"n": 9}), "n"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (json!({"stop": [".", 3]}), "stop[1]"),
        (json!({"stop": ["", "."]}), "stop[0]"),
        (json!({"stop": 7}), "stop"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"no_repeat_ngram_size": 99}), "no_repeat_ngram_size"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"top_logprobs": 2}), "top_logprobs"),
    ] {
        let body = chat(extra.clone());
        let (status, response) = app.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{extra}: {response}");
        assert_eq!(response["error"]["param"], param, "{extra}: {response}");
    }
    // The fake generator honours none of it, but the request is taken.
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat(json!({"n": 2, "stop": "x", "presence_penalty": 1, "logprobs": true})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    app.stop().await;
}

#[tokio::test]
async fn rag_query_takes_stop_and_logprobs() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let ask = |extra: Value| {
        let mut b = json!({"query": "What is the capital of Zorbia?", "max_tokens": 24});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, free) = app.post("/v1/rag/query", &ask(json!({}))).await;
    assert_eq!(status, 200, "{free}");
    assert!(free.get("logprobs").is_none());
    let answer = free["answer"].as_str().unwrap();
    let at = answer.find("Quenta").expect("the answer names the capital");
    let (status, cut) = app
        .post(
            "/v1/rag/query",
            &ask(json!({"stop": ["Quenta"], "logprobs": 2})),
        )
        .await;
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["answer"], answer[..at].trim());
    assert_eq!(cut["finish_reason"], "stop");
    let logprobs = cut["logprobs"].as_array().unwrap();
    assert!(!logprobs.is_empty());
    assert!(logprobs
        .iter()
        .all(|l| l["top_logprobs"].as_array().unwrap().len() == 2 && l["id"].is_u64()));
    let (status, err) = app
        .post("/v1/rag/query", &ask(json!({"logprobs": 21})))
        .await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["param"], "logprobs");
    app.stop().await;
}

#[tokio::test]
async fn the_chat_span_records_the_decoding_request() {
    use crate::stages::{attr, last_trace, record_spans, span};
    record_spans();
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    let body = chat(json!({
        "n": 2, "stop": ["x", "y"], "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "seed": 9,
    }));
    let (status, response) = app.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{response}");
    let spans = last_trace(&app).await;
    let chat = span(&spans, "chat ");
    let stops = json!({"arrayValue": {"values": [{"stringValue": "x"}, {"stringValue": "y"}]}});
    for (key, value) in [
        ("gen_ai.request.stop_sequences", stops),
        (
            "gen_ai.request.presence_penalty",
            json!({"doubleValue": 0.5}),
        ),
        (
            "gen_ai.request.frequency_penalty",
            json!({"doubleValue": -0.25}),
        ),
        ("gen_ai.request.choice.count", json!({"intValue": "2"})),
        ("gen_ai.request.seed", json!({"intValue": "9"})),
        ("rag.request.no_repeat_ngram_size", json!({"intValue": "3"})),
    ] {
        assert_eq!(attr(chat, key), Some(value), "{key} in {chat:#}");
    }
    let r = attr(chat, "rag.request.repetition_penalty").unwrap();
    assert!(
        (r["doubleValue"].as_f64().unwrap() - 1.2).abs() < 1e-6,
        "{r}"
    );
    // Neutral settings are left out.
    let (status, _) = app.post("/v1/chat/completions", &chat_body_plain()).await;
    assert_eq!(status, 200);
    let spans = last_trace(&app).await;
    let chat = span(&spans, "chat ");
    assert_eq!(attr(chat, "gen_ai.request.stop_sequences"), None);
    assert_eq!(attr(chat, "gen_ai.request.choice.count"), None);
    app.stop().await;
}

fn chat_body_plain() -> Value {
    chat(json!({}))
}

/// A chat body whose `messages` are `messages`.
fn chat_with_messages(messages: Value) -> Value {
    let mut body = chat(json!({}));
    body["messages"] = messages;
    body
}

/// Fields inside `messages[]` that would change the answer, unknown ones and roles this
/// server does not serve are refused with the path of the field; neutral values pass.
#[tokio::test]
async fn message_fields_are_refused_by_path_unless_harmless() {
    let app = spawn_fake_app(FakeGenerator::new(4)).await;
    let user = json!({"role": "user", "content": "What is the capital of Zorbia?"});
    let with = |extra: Value| {
        let mut m = user.clone();
        m.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        m
    };
    let call = json!([{"id": "c1", "type": "function",
                       "function": {"name": "f", "arguments": "{}"}}]);
    let image = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}});
    let cases = [
        // (messages, param, code)
        (
            json!([{"role": "assistant", "content": null, "tool_calls": call}, user]),
            "messages[0].tool_calls",
            "unsupported_parameter",
        ),
        (
            json!([{"role": "tool", "tool_call_id": "c1", "content": "4"}, user]),
            "messages[0].tool_call_id",
            "unsupported_parameter",
        ),
        (
            json!([{"role": "tool", "content": "4"}, user]),
            "messages[0].role",
            "unsupported_parameter",
        ),
        (
            json!([{"role": "function", "name": "f", "content": "4"}, user]),
            "messages[0].role",
            "unsupported_parameter",
        ),
        (
            json!([{"role": "assistant", "content": null,
                    "function_call": {"name": "f", "arguments": "{}"}}, user]),
            "messages[0].function_call",
            "unsupported_parameter",
        ),
        (
            json!([{"role": "assistant", "content": null, "audio": {"id": "a1"}}, user]),
            "messages[0].audio",
            "unsupported_parameter",
        ),
        (
            json!([{"role": "assistant", "content": "", "refusal": "I can't."}, user]),
            "messages[0].refusal",
            "unsupported_parameter",
        ),
        (
            json!([with(
                json!({"content": [{"type": "text", "text": "Look:"}, image]})
            )]),
            "messages[0].content[1].type",
            "unsupported_parameter",
        ),
        (
            json!([with(json!({"content": [{"type": "input_audio",
                                             "input_audio": {"data": "AA==", "format": "wav"}}]}))]),
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            json!([with(
                json!({"content": [{"type": "text", "text": "x", "detail": "high"}]})
            )]),
            "messages[0].content[0].detail",
            "unknown_parameter",
        ),
        (
            json!([with(json!({"weight": 2}))]),
            "messages[0].weight",
            "unknown_parameter",
        ),
        (
            json!([{"role": "narrator", "content": "Once"}, user]),
            "messages[0].role",
            "invalid_request_error",
        ),
        (
            json!([{"role": "system"}, user]),
            "messages[0].content",
            "invalid_request_error",
        ),
    ];
    for (messages, param, code) in cases {
        let (status, response) = app
            .post(
                "/v1/chat/completions",
                &chat_with_messages(messages.clone()),
            )
            .await;
        assert_eq!(status, 400, "{messages}: {response}");
        let err = &response["error"];
        assert_eq!(err["param"], param, "{messages}: {response}");
        if code != "invalid_request_error" {
            assert_eq!(err["code"], code, "{messages}: {response}");
        }
        assert!(
            err["message"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{param}: ")),
            "{response}"
        );
    }
    // Harmless: a `name`, neutral tool fields, a developer turn, text parts.
    let fine = json!([
        {"role": "developer", "content": "Answer briefly.", "name": "ops"},
        {"role": "assistant", "content": "Hello.", "tool_calls": [], "refusal": null},
        with(json!({"name": "ada", "content": [{"type": "text", "text": "Capital?"}]})),
    ]);
    let (status, response) = app
        .post("/v1/chat/completions", &chat_with_messages(fine))
        .await;
    assert_eq!(status, 200, "{response}");
    app.stop().await;
}

/// What the accepted message fields do to the prompt, read back from `/tokenize` with
/// `messages` (the prompt chat renders): text parts are joined by newlines, `developer`
/// renders as `system`, and `name` changes nothing.
#[tokio::test]
async fn message_text_parts_developer_and_name_render_as_documented() {
    let app = spawn_app().await;
    let tokens = |messages: Value| {
        let app = &app;
        async move {
            let body = json!({"model": "SmolLM2-135M-Instruct", "messages": messages});
            let (status, out) = app.post("/tokenize", &body).await;
            assert_eq!(status, 200, "{body} → {out}");
            out["tokens"].clone()
        }
    };
    let plain = tokens(json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour.\nOne word."},
    ]))
    .await;
    let dressed = tokens(json!([
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}], "name": "ops"},
        {"role": "user", "name": "ada", "content": [
            {"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]},
    ]))
    .await;
    assert!(plain.as_array().is_some_and(|t| !t.is_empty()));
    assert_eq!(plain, dressed);
    app.stop().await;
}
