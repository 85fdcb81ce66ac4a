//! Speculative decoding from the prompt, as a client and a trace see it: the same answers with
//! and without it (the RAG defaults and seeded sampling; beside chunked prefill and from the
//! prefix cache), the drafts on each request's `decode` span, and the counters under our names
//! and vLLM's.

use serde_json::{json, Value};

use crate::helpers::{spawn_app_with, TestApp};
use crate::stages::{attr, last_trace, record_spans};

const QUESTIONS: &[&str] = &[
    "What is the capital of Zorbia?",
    "Who invented the flumox and what is it used for?",
    "What does git stash pop do?",
];

/// Each question's RAG answer, then a seeded sampled chat answer; and the drafts each RAG
/// answer's `decode` span recorded: (method, drafted, accepted).
async fn answers(app: &TestApp) -> (Vec<String>, Vec<(String, i64, i64)>) {
    let mut texts = Vec::new();
    let mut drafts = Vec::new();
    let int = |span: &Value, key: &str| {
        attr(span, key)
            .and_then(|v| v["intValue"].as_str()?.parse::<i64>().ok())
            .unwrap_or(0)
    };
    for q in QUESTIONS {
        let (status, body) = app
            .post("/v1/rag/query", &json!({"query": q, "max_tokens": 48}))
            .await;
        assert_eq!(status, 200, "{body}");
        texts.push(body["answer"].as_str().unwrap().to_string());
        let spans = last_trace(app).await;
        // The request's own `decode` span, not a batched `decode_step` kept beside it.
        let decode = spans
            .iter()
            .find(|s| s["name"] == "decode")
            .unwrap_or_else(|| panic!("no decode span in {spans:#?}"));
        let method = attr(decode, "rag.spec.method").map(|v| v["stringValue"].to_string());
        drafts.push((
            method.unwrap_or_default(),
            int(decode, "rag.spec.drafted_tokens"),
            int(decode, "rag.spec.accepted_tokens"),
        ));
    }
    let chat = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Quote the passage: The flumox has three curved tines and an ash-wood handle."}],
        "max_tokens": 40,
        "temperature": 0.7,
        "seed": 11,
    });
    let (status, body) = app.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{body}");
    texts.push(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
    );
    (texts, drafts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_change_no_answer_and_show_on_the_decode_span_and_the_metrics() {
    record_spans();
    // What `--metrics-compat vllm` does at start (the in-process servers start no telemetry).
    telemetry::compat::choose(telemetry::compat::MetricsCompat::Vllm);
    let plain = spawn_app_with(&["--speculation", "off", "--prefix-cache-mb", "0"]).await;
    plain.ingest_fixtures().await;
    let (expected, none) = answers(&plain).await;
    plain.stop().await;
    assert!(
        none.iter().all(|(m, d, _)| m.is_empty() && *d == 0),
        "nothing drafted when off: {none:?}"
    );

    // Drafting beside chunked prefill and the prefix cache: the second round's prompts come
    // from the cache whole.
    let app = spawn_app_with(&[
        "--speculation",
        "prompt-lookup:6:3",
        "--prefill-chunk-tokens",
        "64",
    ])
    .await;
    app.ingest_fixtures().await;
    let (got, drafts) = answers(&app).await;
    assert_eq!(got, expected, "drafting changed an answer");
    let (cached, _) = answers(&app).await;
    assert_eq!(
        cached, expected,
        "drafting after a prefix-cache hit changed an answer"
    );
    let drafted: i64 = drafts.iter().map(|d| d.1).sum();
    let accepted: i64 = drafts.iter().map(|d| d.2).sum();
    assert!(
        accepted > 0 && accepted <= drafted,
        "accepted {accepted} of {drafted}: {drafts:?}"
    );
    assert!(
        drafts.iter().all(|(m, _, _)| m == "\"prompt_lookup\""),
        "{drafts:?}"
    );

    let metrics = app.metrics_text().await;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // The chat request drafts too, so the counters hold at least the RAG answers' drafts.
    assert!(
        value("ragscope_spec_tokens_total{kind=\"accepted\"") >= accepted as f64,
        "{metrics}"
    );
    let vllm_accepted = value("vllm:spec_decode_num_accepted_tokens_total");
    let vllm_drafted = value("vllm:spec_decode_num_draft_tokens_total");
    assert!(vllm_accepted >= accepted as f64 && vllm_drafted >= drafted as f64);
    assert_eq!(
        vllm_accepted,
        value("ragscope_spec_tokens_total{kind=\"accepted\""),
        "the two names agree"
    );
    assert!(value("vllm:spec_decode_num_drafts_total") >= 1.0);
}
