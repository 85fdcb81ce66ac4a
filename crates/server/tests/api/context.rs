//! The context stage of a real query: its span between rerank and prompt with its counts, its
//! `timings` field equal to the span, the request fields that steer it, and `off` giving the
//! prompt of whole passages.

use serde_json::{json, Value};

use crate::helpers::{models_dir, spawn_app, spawn_app_with, TestApp};

/// Spans go to the server's recent-trace buffer (`/debug/traces`), as when it serves.
fn record_spans() {
    opentelemetry::global::set_tracer_provider(telemetry::tracer_provider(
        opentelemetry_sdk::trace::InMemorySpanExporter::default(),
        telemetry::resource(),
    ));
}

async fn last_trace(app: &TestApp) -> Vec<Value> {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (_, traces) = app.get("/debug/traces?limit=1").await;
    traces["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn span<'a>(spans: &'a [Value], prefix: &str) -> &'a Value {
    spans
        .iter()
        .find(|s| s["name"].as_str().unwrap().starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} span in {spans:#?}"))
}

fn nanos(span: &Value, key: &str) -> u64 {
    let v = &span[key];
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("{key} of {span}"))
}

fn int(span: &Value, key: &str) -> i64 {
    let value = span["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["key"] == key)
        .unwrap_or_else(|| panic!("no {key} on {span}"))["value"]
        .clone();
    value["intValue"]
        .as_i64()
        .or_else(|| value["intValue"].as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("{key} = {value}"))
}

fn attribute<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

fn string(span: &Value, key: &str) -> Option<String> {
    attribute(span, key).map(|v| v["stringValue"].as_str().unwrap().to_string())
}

fn boolean(span: &Value, key: &str) -> Option<bool> {
    attribute(span, key).map(|v| v["boolValue"].as_bool().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_stage_runs_between_rerank_and_prompt_and_its_timing_is_its_span() {
    record_spans();
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let (status, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 24, "rerank_top_n": 3}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let spans = last_trace(&app).await;
    let root = span(&spans, "POST /v1/rag/query");
    let (rerank, context, prompt) = (
        span(&spans, "rerank"),
        span(&spans, "context"),
        span(&spans, "prompt"),
    );
    for s in [rerank, context, prompt] {
        assert_eq!(s["parentSpanId"], root["spanId"], "{}", s["name"]);
    }
    assert!(nanos(context, "startTimeUnixNano") >= nanos(rerank, "endTimeUnixNano"));
    assert!(nanos(context, "endTimeUnixNano") <= nanos(prompt, "startTimeUnixNano"));
    // The sentence embeddings are the context stage's own work, under its span.
    assert!(spans.iter().any(|s| {
        let name = s["name"].as_str().unwrap();
        s["parentSpanId"] == context["spanId"]
            && (name.starts_with("forward") || name.starts_with("tokenize"))
    }));

    assert_eq!(
        string(context, "rag.context.mode").as_deref(),
        Some("sentences")
    );
    assert_eq!(
        string(context, "rag.context.method").as_deref(),
        Some("hybrid")
    );
    assert_eq!(
        string(context, "rag.context.order").as_deref(),
        Some("best-last")
    );
    let budget = int(context, "rag.context.budget");
    let (s_in, s_out) = (
        int(context, "rag.context.sentences_in"),
        int(context, "rag.context.sentences_out"),
    );
    let (t_in, t_out) = (
        int(context, "rag.context.tokens_in"),
        int(context, "rag.context.tokens_out"),
    );
    assert!(s_in >= s_out && s_out >= 1, "{s_in} {s_out}");
    assert!(t_in >= t_out && t_out >= 1, "{t_in} {t_out}");
    // The budget follows the passages asked for: the default per-passage budget × 3.
    assert_eq!(budget % 3, 0, "{budget}");
    assert!(
        t_out <= budget || s_out == 1,
        "{t_out} tokens over a budget of {budget}"
    );
    assert_eq!(
        int(context, "rag.context.passages_out") as usize,
        body["sources"].as_array().unwrap().len()
    );

    let span_ms =
        (nanos(context, "endTimeUnixNano") - nanos(context, "startTimeUnixNano")) as f64 / 1e6;
    let timing = body["timings"]["context_ms"].as_f64().unwrap();
    assert!(
        (timing - span_ms).abs() < 0.01,
        "timings.context_ms {timing} vs span {span_ms}"
    );
    // The answer still carries the fact from the kept sentence, attributed to its source.
    assert!(
        body["answer"].as_str().unwrap().contains("Quenta"),
        "{body}"
    );
    assert_eq!(body["sources"][0]["doc_id"], "zorbia");
}

#[tokio::test]
async fn context_off_gives_the_prompt_of_whole_passages() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let question = "Who invented the flumox?";
    let (status, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": question, "max_tokens": 4, "rerank_top_n": 3, "context": "off"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let sources: Vec<&str> = body["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["text"].as_str().unwrap())
        .collect();
    assert_eq!(sources.len(), 3, "every passage is kept: {body}");
    // The prompt is the one the prompt builder makes of the whole passages.
    let generator = ragscope::app::load_generator(
        &models_dir().join("SmolLM2-135M-Instruct"),
        &candle_core::Device::Cpu,
        2048,
    )
    .unwrap();
    let expected = rag::prompt::build(&generator, &[], question, &sources, 4).unwrap();
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        expected.tokens.len()
    );

    // With sentences the prompt is shorter than that.
    let (_, short) = app
        .post(
            "/v1/rag/query",
            &json!({"query": question, "max_tokens": 4, "rerank_top_n": 3, "context_budget": 24}),
        )
        .await;
    assert!(
        short["usage"]["prompt_tokens"].as_u64().unwrap() < expected.tokens.len() as u64,
        "{short}"
    );
}

#[tokio::test]
async fn the_context_order_lists_passages_but_keeps_the_sources_in_rank_order() {
    record_spans();
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let mut seen = Vec::new();
    for order in ["rank", "best-last"] {
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": "What is the capital of Zorbia?", "max_tokens": 4,
                        "rerank_top_n": 3, "context": "passages", "context_budget": 2000,
                        "context_order": order, "seed": 1}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let context = last_trace(&app).await;
        assert_eq!(
            string(span(&context, "context"), "rag.context.order").as_deref(),
            Some(order)
        );
        let ids: Vec<String> = body["sources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].to_string())
            .collect();
        assert_eq!(ids.len(), 3, "{body}");
        let scores: Vec<f64> = body["sources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["score"].as_f64().unwrap())
            .collect();
        assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
        seen.push((ids, body["usage"]["prompt_tokens"].clone()));
    }
    // The same passages, listed differently: the same sources in the same (rank) order, and
    // the same number of prompt tokens.
    assert_eq!(seen[0], seen[1]);
}

#[tokio::test]
async fn a_header_names_the_option_whose_entry_holds_the_best_sentence() {
    record_spans();
    let app = spawn_app().await;
    // A manual-style option list: the sentence that answers is the second of its entry and
    // does not repeat the option.
    let page = "# frob(1)\n\n## OPTIONS\n\n--zap-level <n> Sets the zap level of frob. Higher \
                levels burn the toast faster and louder.\n\n--quiet Suppress all output of frob.\n";
    app.ingest(json!([{"id": "frob", "text": page, "format": "markdown"}]))
        .await;
    let mut prompts = Vec::new();
    for terms in [true, false] {
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": "What makes frob burn the toast faster and louder?",
                        "max_tokens": 1, "rerank_top_n": 1, "context_budget": 16,
                        "context_terms": terms}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let spans = last_trace(&app).await;
        let context = span(&spans, "context");
        let named = int(context, "rag.context.terms_named");
        assert_eq!(named, i64::from(terms), "{context}");
        // The name rides on top of the budget, and the span says how much it took.
        assert_eq!(
            int(context, "rag.context.term_tokens") > 0,
            terms,
            "{context}"
        );
        assert_eq!(boolean(context, "rag.context.terms"), Some(terms));
        // Only the best sentence fits 16 tokens; with terms its header also names the option.
        assert_eq!(int(context, "rag.context.sentences_out"), 1);
        prompts.push(body["usage"]["prompt_tokens"].as_i64().unwrap());
    }
    assert!(prompts[0] > prompts[1], "{prompts:?}");
}

#[tokio::test]
async fn a_question_naming_an_entry_gets_its_definition_first() {
    record_spans();
    // A manual page whose EXAMPLES echo the question, so the nearest chunk is not the entry.
    let page = "# frob(1)\n\n## COMMANDS\n\nburn [<level>] Sets fire to the toast at the given \
                level.\n\nzap [<n>] Cools the toast down by n degrees.\n\n## EXAMPLES\n\nWhat \
                does frob zap do? Run frob zap and see what frob zap does.\n";
    for lookup in ["true", "false"] {
        let app = spawn_app_with(&["--entry-lookup", lookup]).await;
        app.ingest(json!([{"id": "frob", "text": page, "format": "markdown"}]))
            .await;
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": "What does frob zap do?", "max_tokens": 1, "top_k": 1}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let spans = last_trace(&app).await;
        let retrieval = span(&spans, "retrieval");
        let (rerank, context) = (span(&spans, "rerank"), span(&spans, "context"));
        let texts: Vec<&str> = body["sources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["text"].as_str().unwrap())
            .collect();
        if lookup == "true" {
            // The one nearest chunk is the EXAMPLES; lookup fetches the COMMANDS chunk that
            // defines `zap`, ranks it first and makes its `zap` sentence the context's best.
            assert_eq!(
                int(retrieval, "rag.retrieval.lookup.added"),
                1,
                "{retrieval}"
            );
            assert_eq!(int(retrieval, "db.response.returned_rows"), 2);
            assert!(texts[0].contains("zap [<n>] Cools"), "{body}");
            assert_eq!(int(rerank, "rag.rerank.entries_looked_up"), 1, "{rerank}");
            assert_eq!(
                int(context, "rag.context.entries_looked_up"),
                1,
                "{context}"
            );
        } else {
            assert_eq!(attribute(retrieval, "rag.retrieval.lookup.added"), None);
            assert_eq!(attribute(rerank, "rag.rerank.entries_looked_up"), None);
            assert_eq!(
                int(context, "rag.context.entries_looked_up"),
                0,
                "{context}"
            );
            assert!(texts.iter().all(|t| !t.contains("Cools")), "{body}");
        }
    }
}

#[tokio::test]
async fn a_question_saying_an_example_title_gets_that_example_from_any_page() {
    record_spans();
    // The task's example sits on a page the question does not name; an FAQ that echoes the
    // question is the nearest chunk.
    let page = "# toaster(1)\n\n## DESCRIPTION\n\nThe toaster browns bread.\n\n## EXAMPLES\n\n\
                Undo a burn\n$ toaster scrape --gently\nScrapes the black layer off.\n";
    let faq = "# Kitchen FAQ\n\nHow do I undo a burn? Many people ask how to undo a burn, and \
               how to undo a burn quickly.\n";
    for lookup in ["true", "false"] {
        let app = spawn_app_with(&["--entry-lookup", lookup]).await;
        app.ingest(json!([
            {"id": "toaster", "text": page, "format": "markdown"},
            {"id": "faq", "text": faq, "format": "markdown"}
        ]))
        .await;
        let ask = |query: &'static str| {
            let app = &app;
            async move {
                let body = json!({"query": query, "max_tokens": 1, "top_k": 1});
                let (status, body) = app.post("/v1/rag/query", &body).await;
                assert_eq!(status, 200, "{body}");
                let first = body["sources"][0]["text"].as_str().unwrap().to_string();
                (first, last_trace(app).await)
            }
        };
        let (first, spans) = ask("How do I undo a burn?").await;
        let retrieval = span(&spans, "retrieval");
        if lookup == "true" {
            assert_eq!(
                int(retrieval, "rag.retrieval.lookup.added"),
                1,
                "{retrieval}"
            );
            assert!(first.contains("Undo a burn $ toaster scrape"), "{first}");
            assert_eq!(
                int(span(&spans, "rerank"), "rag.rerank.entries_looked_up"),
                1
            );
            let context = span(&spans, "context");
            assert_eq!(int(context, "rag.context.entries_looked_up"), 1);
            // A question missing one of the title's words asks for no example.
            let (_, spans) = ask("How do I undo a toast?").await;
            let retrieval = span(&spans, "retrieval");
            assert_eq!(
                int(retrieval, "rag.retrieval.lookup.added"),
                0,
                "{retrieval}"
            );
            assert_eq!(
                int(span(&spans, "rerank"), "rag.rerank.entries_looked_up"),
                0
            );
        } else {
            assert_eq!(attribute(retrieval, "rag.retrieval.lookup.added"), None);
            assert!(first.contains("Kitchen FAQ"), "{first}");
        }
    }
}

#[tokio::test]
async fn bad_context_fields_are_refused_by_name() {
    let app = spawn_app().await;
    for (body, field) in [
        (json!({"query": "q", "context": "all"}), "context"),
        (
            json!({"query": "q", "context_method": "magic"}),
            "context_method",
        ),
        (json!({"query": "q", "context_budget": 0}), "context_budget"),
        (
            json!({"query": "q", "context_order": "best_last"}),
            "context_order",
        ),
        (
            json!({"query": "q", "context": "off", "context_order": "rank"}),
            "context_order",
        ),
        (
            json!({"query": "q", "context": "passages", "context_terms": true}),
            "context_terms",
        ),
        (
            json!({"query": "q", "context_terms": "yes"}),
            "context_terms",
        ),
    ] {
        let (status, error) = app.post("/v1/rag/query", &body).await;
        assert_eq!(status, 400, "{error}");
        assert!(error.to_string().contains(field), "{error}");
    }
    let (status, error) = app
        .post(
            "/v1/chat/completions",
            &json!({"model": "ragscope", "messages": [{"role": "user", "content": "q"}], "context": "nope"}),
        )
        .await;
    assert_eq!(status, 400, "{error}");
    assert!(error.to_string().contains("context"), "{error}");
}
