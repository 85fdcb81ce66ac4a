//! Issue #17's per-request quality figures: on the request span and in their histograms.

use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::spawn_fake_app;

/// The attributes of the first span named `name…` in an OTLP JSON export, as key → number.
fn root_attributes(traces: &Value, name: &str) -> Vec<(String, f64)> {
    let spans = traces["resourceSpans"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| r["scopeSpans"].as_array().into_iter().flatten())
        .flat_map(|s| s["spans"].as_array().into_iter().flatten());
    for span in spans {
        if span["name"].as_str().is_some_and(|n| n.starts_with(name)) {
            return span["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| {
                    let v = &a["value"];
                    let number = v["doubleValue"].as_f64().or_else(|| {
                        v["intValue"]
                            .as_i64()
                            .or_else(|| v["intValue"].as_str()?.parse().ok())
                            .map(|i| i as f64)
                    })?;
                    Some((a["key"].as_str()?.to_string(), number))
                })
                .collect();
        }
    }
    panic!("no span named {name} in {traces}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_records_what_it_was_made_of() {
    // Spans reach the /debug/traces buffer through the tracer provider, as in the attribution test.
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = telemetry::tracer_provider(exporter, telemetry::resource());
    opentelemetry::global::set_tracer_provider(provider);
    let app = spawn_fake_app(FakeGenerator::new(8)).await;
    app.ingest_fixtures().await;
    let (status, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (status, traces) = app.get("/debug/traces?limit=1").await;
    assert_eq!(status, 200);
    let attrs = root_attributes(&traces, "POST /v1/rag/query");
    let get = |key: &str| {
        attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("the request span has no {key}: {attrs:?}"))
    };
    let output = body["usage"]["completion_tokens"].as_f64().unwrap();
    assert_eq!(get("rag.quality.output_tokens"), output);
    let fill = get("rag.quality.context_fill_ratio");
    let prompt = body["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(fill > 0.0 && fill <= 1.0, "{fill}");
    assert!(
        ((prompt + output) / fill).round() >= prompt + output,
        "{fill}"
    );
    let hit = get("rag.quality.prefix_cache_hit_ratio");
    assert!((0.0..=1.0).contains(&hit), "{hit}");
    assert!(get("rag.quality.retrieval_to_generation_gap_ms") >= 0.0);
    // The kept passages' mean retrieval score: the sources' own scores say what it must be.
    let sources = body["sources"].as_array().unwrap();
    assert!(!sources.is_empty(), "{body}");
    let relevance = get("rag.quality.context_relevance");
    assert!(
        relevance.is_finite() && relevance <= 1.0 + 1e-6,
        "{relevance}"
    );
    // No logprobs asked: no confidence figure.
    assert!(!attrs
        .iter()
        .any(|(k, _)| k == "rag.quality.answer_confidence"));

    let metrics = app.metrics_text().await;
    let value = |prefix: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("/metrics has no {prefix}:\n{metrics}"))
    };
    for histogram in [
        "ragscope_answer_output_tokens_count",
        "ragscope_context_fill_ratio_count",
        "ragscope_prefix_cache_hit_ratio_count",
        "ragscope_retrieval_to_generation_gap_seconds_count",
        "ragscope_context_relevance_count",
    ] {
        assert_eq!(value(histogram), 1.0, "{histogram}");
    }
    assert!(value("process_cpu_time_seconds_total") > 0.0);
}
