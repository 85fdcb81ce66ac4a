//! The generator as clients outside RAG use it: `/tokenize` and `/detokenize` (llama.cpp's and
//! vLLM's shapes), gRPC reflection v1alpha beside v1, plain chat (no retrieval stages), and
//! `/v1/completions` with echoed prompt logprobs, as lm-eval's loglikelihood tasks send it.

use serde_json::{json, Value};
use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1alpha::ServerReflectionRequest;

use crate::helpers::{spawn_app, TestApp};

const MODEL: &str = "SmolLM2-135M-Instruct";

async fn tokenize(app: &TestApp, body: Value) -> Value {
    let (status, out) = app.post("/tokenize", &body).await;
    assert_eq!(status, 200, "{body} → {out}");
    out
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_in_both_dialects() {
    let app = spawn_app().await;
    let text = "Héllo wörld, 2026 — naïve café";
    // llama.cpp: `content` in, `tokens` out; back through `/detokenize` as `content`.
    let out = tokenize(&app, json!({"content": text})).await;
    let tokens = ids(&out["tokens"]);
    assert!(tokens.len() > 5, "{out}");
    let (status, back) = app.post("/detokenize", &json!({"tokens": tokens})).await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["content"], text);
    // Digits are split one by one, as SmolLM2's own tokenizer does.
    let digits = tokenize(&app, json!({"content": "2026"})).await;
    assert_eq!(digits["tokens"].as_array().unwrap().len(), 4);

    // Pieces concatenate to the text; a character split across tokens comes as bytes.
    let out = tokenize(&app, json!({"content": text, "with_pieces": true})).await;
    let mut bytes = Vec::new();
    for t in out["tokens"].as_array().unwrap() {
        assert!(t["id"].is_u64(), "{t}");
        match &t["piece"] {
            Value::String(s) => bytes.extend_from_slice(s.as_bytes()),
            Value::Array(b) => bytes.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
            other => panic!("piece {other}"),
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    assert_eq!(
        out["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        tokens
    );

    // Control-token text is the control token only with `parse_special` (the default).
    let special = tokenize(&app, json!({"content": "<|im_start|>user"})).await;
    let plain = tokenize(
        &app,
        json!({"content": "<|im_start|>user", "parse_special": false}),
    )
    .await;
    let special = ids(&special["tokens"]);
    assert_eq!(special.len(), 2, "{special:?}");
    assert!(ids(&plain["tokens"]).len() > 3);
    let (_, back) = app.post("/detokenize", &json!({"tokens": special})).await;
    assert_eq!(back["content"], "<|im_start|>user");

    // vLLM: `model` + `prompt` → count, max_model_len, tokens; the same ids as llama.cpp's.
    let out = tokenize(&app, json!({"model": MODEL, "prompt": text})).await;
    assert_eq!(ids(&out["tokens"]), tokens);
    assert_eq!(out["count"].as_u64(), Some(tokens.len() as u64));
    assert_eq!(out["max_model_len"], 2048);
    let out = tokenize(
        &app,
        json!({"model": MODEL, "prompt": "a cat", "return_token_strs": true}),
    )
    .await;
    assert_eq!(out["token_strs"], json!(["a", " cat"]));
    let (status, back) = app
        .post(
            "/detokenize",
            &json!({"model": MODEL, "tokens": ids(&out["tokens"])}),
        )
        .await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["prompt"], "a cat");

    // vLLM `messages`: the chat template as the generator renders it.
    let out = tokenize(
        &app,
        json!({"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}]}),
    )
    .await;
    let (_, rendered) = app
        .post("/detokenize", &json!({"tokens": out["tokens"]}))
        .await;
    assert_eq!(
        rendered["content"],
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    app.stop().await;
}

#[tokio::test]
async fn tokenize_refuses_bad_input_by_field() {
    let app = spawn_app().await;
    let cases = [
        ("/detokenize", json!({"tokens": [1, 99999999]}), "tokens[1]"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens[0]"),
        ("/detokenize", json!({"tokens": "hi"}), "tokens"),
        (
            "/detokenize",
            json!({"tokens": [1], "skip_special_tokens": true}),
            "skip_special_tokens",
        ),
        ("/tokenize", json!({}), "content"),
        ("/tokenize", json!({"content": 3}), "content"),
        (
            "/tokenize",
            json!({"content": "x", "prompt": "y"}),
            "prompt",
        ),
        (
            "/tokenize",
            json!({"model": MODEL, "content": "x"}),
            "content",
        ),
        (
            "/tokenize",
            json!({"model": MODEL, "prompt": "x", "with_pieces": true}),
            "with_pieces",
        ),
        ("/tokenize", json!({"model": MODEL}), "prompt"),
        (
            "/tokenize",
            json!({"model": MODEL, "prompt": "x", "messages": []}),
            "messages",
        ),
        (
            "/tokenize",
            json!({"model": MODEL, "messages": []}),
            "messages",
        ),
        (
            "/tokenize",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            "/tokenize",
            json!({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            "/tokenize",
            json!({"content": "x", "chat_template": "t"}),
            "chat_template",
        ),
    ];
    for (path, body, param) in cases {
        let (status, out) = app.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body} → {out}");
        assert_eq!(out["error"]["param"], param, "{path} {body} → {out}");
        let message = out["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(param), "{message}");
    }
    let (status, out) = app
        .post("/tokenize", &json!({"model": "gpt-4", "prompt": "x"}))
        .await;
    assert_eq!(status, 404, "{out}");
    assert_eq!(out["error"]["param"], "model");
    // The server is still up.
    let out = tokenize(&app, json!({"content": "still here"})).await;
    assert!(!out["tokens"].as_array().unwrap().is_empty());
    app.stop().await;
}

/// Python's grpcio-reflection (and older grpcurl) speak only v1alpha: it lists our service and
/// resolves its descriptors.
#[tokio::test]
async fn reflection_v1alpha_lists_and_describes_the_service() {
    let app = spawn_app().await;
    let mut client = ServerReflectionClient::new(app.grpc_channel().await);
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("ragscope.v1.Rag".into()),
    ]
    .map(|m| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    });
    let mut responses = client
        .server_reflection_info(futures::stream::iter(requests))
        .await
        .expect("v1alpha is served")
        .into_inner();
    let first = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = first.message_response else {
        panic!("not a service list: {first:?}");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"ragscope.v1.Rag"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    let second = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(files)) = second.message_response else {
        panic!("not descriptors: {second:?}");
    };
    let file = files.file_descriptor_proto.first().expect("one file");
    let file = <prost_types::FileDescriptorProto as prost::Message>::decode(file.as_slice())
        .expect("a file descriptor");
    assert_eq!(file.package(), "ragscope.v1");
    assert!(file.service.iter().any(|s| s.name() == "Rag"));
    app.stop().await;
}

/// Token ids of `text` from the server's own tokenizer.
async fn token_ids(app: &TestApp, text: &str) -> Vec<u64> {
    ids(&tokenize(app, json!({"content": text})).await["tokens"])
}

async fn complete(app: &TestApp, body: Value) -> Value {
    let (status, out) = app.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{body} → {out}");
    assert_eq!(out["object"], "text_completion");
    assert!(out["id"].as_str().unwrap().starts_with("cmpl-"));
    out
}

fn logprob_sum(choice: &Value, from: usize) -> f64 {
    choice["logprobs"]["token_logprobs"].as_array().unwrap()[from..]
        .iter()
        .map(|v| v.as_f64().unwrap())
        .sum()
}

/// lm-eval's loglikelihood request: context and continuation as token ids, `echo`,
/// `logprobs: 1`, nothing generated. The continuation's logprobs are the scoring pass's, the
/// likely continuation scores higher, and a string prompt scores as its ids do.
#[tokio::test]
async fn echo_logprobs_score_the_prompt_as_lm_eval_asks() {
    let app = spawn_app().await;
    let context = token_ids(&app, "The capital of France is").await;
    let likely = [context.clone(), token_ids(&app, " Paris").await].concat();
    let unlikely = [context.clone(), token_ids(&app, " Banana").await].concat();
    let out = complete(
        &app,
        json!({"model": MODEL, "prompt": [likely, unlikely], "echo": true, "logprobs": 1,
               "max_tokens": 0}),
    )
    .await;
    let choices = out["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, (c, prompt)) in choices.iter().zip([&likely, &unlikely]).enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        let lp = &c["logprobs"];
        let n = prompt.len();
        assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
        assert_eq!(lp["token_logprobs"][0], Value::Null);
        assert_eq!(lp["top_logprobs"][0], Value::Null);
        for k in 1..n {
            let chosen = lp["token_logprobs"][k].as_f64().unwrap();
            assert!(chosen <= 0.0, "{chosen}");
            let top = lp["top_logprobs"][k].as_object().unwrap();
            assert_eq!(top.len(), 1, "{top:?}");
            // The best alternative is at least as likely as the actual token.
            assert!(top.values().next().unwrap().as_f64().unwrap() >= chosen - 1e-6);
        }
        // `text` is the prompt; `text_offset` points at each token's text in it.
        let text: Vec<char> = c["text"].as_str().unwrap().chars().collect();
        let tokens = lp["tokens"].as_array().unwrap();
        for (k, offset) in lp["text_offset"].as_array().unwrap().iter().enumerate() {
            let at = offset.as_u64().unwrap() as usize;
            let token: String = tokens[k].as_str().unwrap().into();
            let here: String = text[at..].iter().take(token.chars().count()).collect();
            assert_eq!(here, token, "token {k}");
        }
    }
    let ctx = context.len();
    let (paris, banana) = (logprob_sum(&choices[0], ctx), logprob_sum(&choices[1], ctx));
    assert!(paris > banana + 2.0, "Paris {paris} vs Banana {banana}");

    // The same numbers from the scoring function itself, in this process.
    let llama = llm::llama::Llama::from_gguf(
        &crate::helpers::models_dir()
            .join(MODEL)
            .join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        &candle_core::Device::Cpu,
        2048,
    )
    .unwrap();
    let ids32: Vec<u32> = likely.iter().map(|&t| t as u32).collect();
    let stage = telemetry::span::Stage::root("test");
    let direct: f64 = llm::Generator::score(&llama, &ids32, 1, &stage).unwrap()[ctx - 1..]
        .iter()
        .map(|s| f64::from(s.logprob))
        .sum();
    assert!(
        (direct - paris).abs() < 1e-3,
        "direct {direct} vs served {paris}"
    );

    // A string prompt that tokenizes to the same ids scores the same.
    let text = complete(
        &app,
        json!({"model": MODEL, "prompt": "The capital of France is Paris", "echo": true,
               "logprobs": 0, "max_tokens": 0}),
    )
    .await;
    assert_eq!(
        token_ids(&app, "The capital of France is Paris").await,
        likely
    );
    let c = &text["choices"][0];
    assert_eq!(c["text"], "The capital of France is Paris");
    assert!((logprob_sum(c, ctx) - paris).abs() < 1e-4);
    assert_eq!(c["logprobs"]["top_logprobs"][1], json!({}));
    app.stop().await;
}

#[tokio::test]
async fn completions_generate_from_the_prompt_as_written() {
    let app = spawn_app().await;
    let prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n";
    let out = complete(
        &app,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 8}),
    )
    .await;
    let c = &out["choices"][0];
    let text = c["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    assert_eq!(c["logprobs"], Value::Null);
    let u = &out["usage"];
    // The prompt is tokenized as written, control tokens included: no template, no passages.
    let n_prompt = token_ids(&app, prompt).await.len() as u64;
    assert_eq!(u["prompt_tokens"].as_u64(), Some(n_prompt));
    assert!(u["completion_tokens"].as_u64().unwrap() <= 8);

    // `echo` prepends the prompt; the same greedy text follows.
    let echoed = complete(
        &app,
        json!({"model": format!("{MODEL}-plain"), "prompt": prompt, "max_tokens": 8, "echo": true}),
    )
    .await;
    assert_eq!(echoed["choices"][0]["text"], format!("{prompt}{text}"));

    // Streaming gives the same text in `text_completion` chunks, then usage, then [DONE].
    let chunks = completion_chunks(
        &app,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": true,
               "stream_options": {"include_usage": true}}),
    )
    .await;
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["prompt_tokens"].as_u64(), Some(n_prompt));
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, &c["finish_reason"]);

    // A list of prompts, n choices each, `index` ordered; a seed makes each choice repeatable.
    let body = json!({"model": MODEL, "prompt": ["Once upon a time", "The weather today"],
                      "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 7});
    let a = complete(&app, body.clone()).await;
    let b = complete(&app, body).await;
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["text"].as_str().unwrap().to_string()
            })
            .collect()
    };
    assert_eq!(texts(&a).len(), 4);
    assert_eq!(texts(&a), texts(&b));
    assert_eq!(
        a["usage"]["prompt_tokens"].as_u64(),
        Some(
            (token_ids(&app, "Once upon a time").await.len()
                + token_ids(&app, "The weather today").await.len()) as u64
        )
    );
    app.stop().await;
}

/// The streamed chunks of a completion, `[DONE]` checked and dropped.
async fn completion_chunks(app: &TestApp, body: Value) -> Vec<Value> {
    app.openai_stream("/v1/completions", &body).await
}

/// The streamed text of choice `index`.
fn streamed_text(chunks: &[Value], index: usize) -> String {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .filter(|c| c["index"] == index)
        .filter_map(|c| c["text"].as_str())
        .collect()
}

/// lm-eval 0.4.13's loglikelihood request exactly (`max_tokens: 1`, `echo`, `logprobs: 1`,
/// `temperature: 0`, `seed`): the prompt's token logprobs, then the generated token's; what
/// lm-eval sums (`token_logprobs[ctxlen:-1]`) is the scoring pass's, as with `max_tokens: 0`.
#[tokio::test]
async fn lm_eval_loglikelihood_request_gets_prompt_and_generated_logprobs() {
    let app = spawn_app().await;
    let context = token_ids(&app, "The capital of France is").await;
    let prompt = [context.clone(), token_ids(&app, " Paris").await].concat();
    let ask = |max_tokens: usize| {
        json!({"model": format!("{MODEL}-plain"), "prompt": [prompt.clone()], "temperature": 0,
               "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": true})
    };
    let out = complete(&app, ask(1)).await;
    let c = &out["choices"][0];
    let lp = &c["logprobs"];
    let n = prompt.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n + 1, "{lp}");
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(out["usage"]["completion_tokens"], 1);
    // The generated token is greedy: it is its position's best alternative.
    let last = lp["token_logprobs"][n].as_f64().unwrap();
    let top = lp["top_logprobs"][n].as_object().unwrap();
    assert_eq!(top.len(), 1);
    assert!((top.values().next().unwrap().as_f64().unwrap() - last).abs() < 1e-6);
    let generated = lp["tokens"][n].as_str().unwrap();
    let text = c["text"].as_str().unwrap();
    assert!(text.ends_with(generated), "{text:?} / {generated:?}");
    assert_eq!(
        lp["text_offset"][n].as_u64().unwrap() as usize,
        text.chars().count() - generated.chars().count()
    );
    let continuation = |v: &Value, to: usize| -> f64 {
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[context.len()..to]
            .iter()
            .map(|v| v.as_f64().unwrap())
            .sum()
    };
    let scored_only = complete(&app, ask(0)).await;
    assert!((continuation(&out, n) - continuation(&scored_only, n)).abs() < 1e-4);
    app.stop().await;
}

/// Generated tokens' logprobs in the legacy shape, stop strings cut the text before them,
/// and `n` choices are seeded per choice, streamed and not.
#[tokio::test]
async fn completions_honour_logprobs_stop_and_n_while_generating() {
    let app = spawn_app().await;
    let prompt =
        "<|im_start|>user\nDescribe the sea in one sentence.<|im_end|>\n<|im_start|>assistant\n";
    let base = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12});
    let with = |extra: Value| {
        let mut b = base.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let out = complete(&app, with(json!({"logprobs": 3}))).await;
    let c = &out["choices"][0];
    let text = c["text"].as_str().unwrap().to_string();
    let lp = &c["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(
        tokens.len() as u64,
        out["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, text);
    let mut at = 0;
    for k in 0..tokens.len() {
        assert_eq!(lp["text_offset"][k].as_u64().unwrap() as usize, at);
        at += tokens[k].as_str().unwrap().chars().count();
        let chosen = lp["token_logprobs"][k].as_f64().unwrap();
        let top = lp["top_logprobs"][k].as_object().unwrap();
        assert!((1..=3).contains(&top.len()), "{top:?}");
        // Greedy: the best alternative is the chosen token.
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (best - chosen).abs() < 1e-6,
            "token {k}: {chosen} vs {top:?}"
        );
    }
    // Streamed: the same tokens and offsets, spread over the chunks.
    let chunks = completion_chunks(&app, with(json!({"logprobs": 3, "stream": true}))).await;
    assert_eq!(streamed_text(&chunks, 0), text);
    let streamed: Vec<(Value, Value)> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .flat_map(|c| {
            let l = &c["choices"][0]["logprobs"];
            let t = l["tokens"].as_array().unwrap().clone();
            let o = l["text_offset"].as_array().unwrap().clone();
            t.into_iter().zip(o)
        })
        .collect();
    let expected: Vec<(Value, Value)> = tokens
        .iter()
        .cloned()
        .zip(lp["text_offset"].as_array().unwrap().iter().cloned())
        .collect();
    assert_eq!(streamed, expected);

    // A stop string from the middle of the free text: the text ends before it.
    let words: Vec<&str> = text.split(' ').collect();
    assert!(words.len() > 3, "{text:?}");
    let stop = format!(" {}", words[words.len() / 2]);
    let expected = &text[..text.find(&stop).unwrap()];
    for stops in [json!(stop), json!(["never-said", stop])] {
        let cut = complete(&app, with(json!({"stop": stops, "echo": true}))).await;
        assert_eq!(cut["choices"][0]["text"], format!("{prompt}{expected}"));
        assert_eq!(cut["choices"][0]["finish_reason"], "stop");
        let chunks = completion_chunks(&app, with(json!({"stop": stops, "stream": true}))).await;
        assert_eq!(streamed_text(&chunks, 0), expected);
        let finish = chunks
            .iter()
            .rev()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("stop"));
    }

    // n choices in one job: choice i is what n = 1 gives with seed + i; streamed under its
    // own index, each finishing once.
    let sampled = with(json!({"n": 3, "temperature": 1.0, "seed": 21, "max_tokens": 8}));
    let a = complete(&app, sampled.clone()).await;
    let texts: Vec<String> = (0..3)
        .map(|i| {
            assert_eq!(a["choices"][i]["index"], i);
            a["choices"][i]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    let third = complete(
        &app,
        with(json!({"temperature": 1.0, "seed": 23, "max_tokens": 8})),
    )
    .await;
    assert_eq!(third["choices"][0]["text"], texts[2]);
    let mut streamed = sampled.clone();
    streamed["stream"] = json!(true);
    streamed["echo"] = json!(true);
    let chunks = completion_chunks(&app, streamed).await;
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(streamed_text(&chunks, i), format!("{prompt}{t}"));
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
async fn completions_refuse_what_they_do_not_honour_by_name() {
    let app = spawn_app().await;
    let base = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 4});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    let cases = [
        (with("suffix", json!("!")), "suffix"),
        (with("best_of", json!(2)), "best_of"),
        (with("logit_bias", json!({"1": 5})), "logit_bias"),
        (with("frobnicate", json!(true)), "frobnicate"),
        (with("n", json!(0)), "n"),
        (with("logprobs", json!(50)), "logprobs"),
        (with("prompt", json!([])), "prompt"),
        (with("prompt", json!("")), "prompt"),
        (with("prompt", json!([[1, 99999999]])), "prompt[0]"),
        (with("prompt", json!([1, -3])), "prompt[1]"),
        (with("prompt", json!(["a", 5])), "prompt[1]"),
        (with("stop", json!(["a", "b", "c", "d", "e"])), "stop"),
        (with("stop", json!([""])), "stop[0]"),
        (with("max_tokens", json!(5000)), "prompt"),
        (with("temperature", json!(3)), "temperature"),
        (with("echo", json!("yes")), "echo"),
    ];
    for (body, param) in cases {
        let (status, out) = app.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body} → {out}");
        assert!(
            out["error"]["param"].as_str().unwrap().starts_with(param),
            "{body} → {out}"
        );
    }
    let (status, out) = app
        .post("/v1/completions", &with("model", json!("davinci-002")))
        .await;
    assert_eq!(status, 404, "{out}");
    // Neutral values of unsupported fields are accepted.
    let out = complete(
        &app,
        json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "best_of": 1, "suffix": null,
               "logit_bias": {}, "user": "me"}),
    )
    .await;
    assert_eq!(out["choices"].as_array().unwrap().len(), 1);
    app.stop().await;
}

/// Spans go to the server's recent-trace buffer (`/debug/traces`), as when it serves.
fn record_spans() {
    opentelemetry::global::set_tracer_provider(telemetry::tracer_provider(
        opentelemetry_sdk::trace::InMemorySpanExporter::default(),
        telemetry::resource(),
    ));
}

/// Posts `body` and returns the response and the span names of its trace, found by the
/// response's `x-trace-id` (other tests' traces share the buffer).
async fn traced(app: &TestApp, path: &str, body: Value) -> (Value, Vec<String>) {
    let r = app
        .client
        .post(app.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let trace_id = r.headers()["x-trace-id"].to_str().unwrap().to_string();
    let out: Value = r.json().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (_, traces) = app.get("/debug/traces?limit=50").await;
    let mut names = Vec::new();
    for rs in traces["resourceSpans"].as_array().unwrap() {
        for ss in rs["scopeSpans"].as_array().unwrap() {
            for span in ss["spans"].as_array().unwrap() {
                if span["traceId"] == trace_id.as_str() {
                    names.push(span["name"].as_str().unwrap().to_string());
                }
            }
        }
    }
    (out, names)
}

fn assert_plain(names: &[String]) {
    let has = |p: &str| names.iter().any(|n| n.starts_with(p));
    assert!(has(&format!("chat {MODEL}")), "{names:?}");
    assert!(has("queue"), "{names:?}");
    assert!(has("prefill"), "{names:?}");
    for stage in ["embeddings", "retrieval", "rerank", "prompt"] {
        assert!(!has(stage), "{stage} in a plain trace: {names:?}");
    }
}

/// The plain path runs only the generator: its trace has `chat` and `prefill` and none of the
/// retrieval stages; scoring an echoed prompt is a `prefill` without `decode`.
#[tokio::test]
async fn plain_requests_trace_no_retrieval_stages() {
    record_spans();
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let (_, names) = traced(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 3}),
    )
    .await;
    assert_plain(&names);
    assert!(names.iter().any(|n| n == "decode"), "{names:?}");
    assert!(
        names.iter().any(|n| n == "POST /v1/completions"),
        "{names:?}"
    );

    let (_, names) = traced(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hello there", "max_tokens": 0, "echo": true, "logprobs": 2}),
    )
    .await;
    assert_plain(&names);
    assert!(!names.iter().any(|n| n == "decode"), "{names:?}");

    // Chat with the plain model id: the messages as given, through the chat template only.
    let (status, models) = app.get("/v1/models").await;
    assert_eq!(status, 200);
    let plain = format!("{MODEL}-plain");
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == plain.as_str()));
    let messages = json!([{"role": "user", "content": "What is the capital of Zorbia?"}]);
    let (out, names) = traced(
        &app,
        "/v1/chat/completions",
        json!({"model": plain, "messages": messages, "max_tokens": 4}),
    )
    .await;
    assert_eq!(out["object"], "chat.completion");
    assert!(out["choices"][0]["message"]["content"].is_string());
    let counted = tokenize(&app, json!({"model": MODEL, "messages": messages})).await;
    assert_eq!(out["usage"]["prompt_tokens"], counted["count"]);
    assert_plain(&names);
    assert!(
        names.iter().any(|n| n == "POST /v1/chat/completions"),
        "{names:?}"
    );
    // The same question to the RAG model retrieves.
    let (_, names) = traced(
        &app,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "max_tokens": 4}),
    )
    .await;
    assert!(
        names.iter().any(|n| n.starts_with("retrieval")),
        "{names:?}"
    );
    // Retrieval settings mean nothing to the plain model, nor do the context stage's: each is
    // refused by name.
    for (field, value) in [
        ("top_k", json!(3)),
        ("context_order", json!("rank")),
        ("context_terms", json!(false)),
    ] {
        let mut body = json!({"model": plain, "messages": messages});
        body[field] = value;
        let (status, out) = app.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["param"], field);
    }
    app.stop().await;
}
