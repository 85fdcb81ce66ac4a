//! Proof that attribution is right: inject a known delay into one stage of a server over
//! stand-in stages, read the spans back from the server's own trace buffer, and check that
//! `ragscope attribute`'s analysis puts +X ms on that stage's p50 (± max(1 ms, 5%)) and
//! leaves the others alone; and that a heavy-tailed delay is named as the p99 driver.

use ragscope::attribute::{analyse, compare, source, Report};
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_fake_app_with, TestApp};

const TOKEN: &str = "test-admin-token";
const REQUESTS: usize = 60;

async fn set_plan(app: &TestApp, plan: Value) {
    let r = app
        .client
        .put(app.url("/admin/faults"))
        .bearer_auth(TOKEN)
        .body(plan.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

/// Runs `n` requests and analyses exactly their traces.
async fn run(app: &TestApp, n: usize) -> Report {
    let r = app
        .client
        .delete(app.url("/debug/traces"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for i in 0..n {
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": format!("question {i}"), "max_tokens": 8}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    // The request span ends when the body is written: give the last one a moment.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (status, traces) = app.get("/debug/traces").await;
    assert_eq!(status, 200);
    let spans = source::parse_otlp(&traces).unwrap();
    let report = analyse(&spans, &["POST /v1/rag/query".to_string()]);
    assert_eq!(report.traces, n, "every request's trace is in the buffer");
    report
}

async fn app() -> TestApp {
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = ragscope::telemetry::tracer_provider(exporter, ragscope::telemetry::resource());
    opentelemetry::global::set_tracer_provider(provider);
    let app = spawn_fake_app_with(
        FakeGenerator::new(8),
        &["--faults", "true", "--fault-admin-token", TOKEN],
    )
    .await;
    app.ingest_fixtures().await;
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribution_recovers_an_injected_delay_on_its_stage() {
    let app = app().await;
    run(&app, 5).await; // warm-up
    let baseline = run(&app, REQUESTS).await;
    for x in [20.0, 100.0] {
        set_plan(&app, json!({"retrieval": {"delay_ms": x}})).await;
        let slowed = run(&app, REQUESTS).await;
        let c = compare(&baseline, &slowed);
        eprintln!("{}", ragscope::attribute::table(&slowed));
        let tolerance = f64::max(1.0, 0.05 * x);
        for s in &c.stages {
            let want = if s.stage == "retrieval" { x } else { 0.0 };
            // "No significant change" elsewhere: within the same bound.
            let bound = tolerance;
            assert!(
                (s.self_p50_delta_ms - want).abs() <= bound,
                "+{x} ms into retrieval: {} moved {:+.3} ms at p50 (want {want:+} ± {bound})",
                s.stage,
                s.self_p50_delta_ms
            );
        }
        assert_eq!(c.explained_by.as_deref(), Some("retrieval"), "{c:?}");
        assert!((c.end_to_end_p50_delta_ms - x).abs() <= tolerance, "{c:?}");
        let retrieval = slowed
            .stages
            .iter()
            .find(|s| s.stage == "retrieval")
            .unwrap();
        assert_eq!(retrieval.faults.get("rag.fault.delay_ms"), Some(&REQUESTS));
        eprintln!(
            "+{x} ms injected: retrieval p50 {:+.3} ms, end-to-end p50 {:+.3} ms",
            c.stages
                .iter()
                .find(|s| s.stage == "retrieval")
                .unwrap()
                .self_p50_delta_ms,
            c.end_to_end_p50_delta_ms
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribution_names_the_stage_behind_a_heavy_tail() {
    let app = app().await;
    set_plan(
        &app,
        json!({"rerank": {"delay": {"dist": "pareto", "scale_ms": 5, "shape": 1.2}, "probability": 0.1}}),
    )
    .await;
    let report = run(&app, 200).await;
    let tail = report.tail.expect("a tail");
    assert_eq!(tail.stage, "rerank", "{tail:?}");
    assert!(tail.excess_ms > 0.5 * tail.end_to_end_excess_ms, "{tail:?}");
    app.stop().await;
}
