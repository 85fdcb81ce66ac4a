//! CPU profiles cut by span: an in-process Pyroscope push receiver decodes what the agent
//! uploads and finds samples labelled with the span id of a stage in the exported trace, with
//! candle's frames in that stage's stacks. A dead profiler costs no request.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use opentelemetry::trace::SpanId;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use prost::Message;
use pyroscope::encode::gen::google::Profile;
use pyroscope::encode::gen::push::PushRequest;
use serde_json::json;
use telemetry::profile::{self, ProfileSettings};
use tokio::net::TcpListener;

use crate::helpers::{spawn_app, spawn_app_with, TestApp};

/// Starts a Pyroscope push endpoint; returns its URL and what it receives.
pub(crate) async fn receiver() -> (String, Arc<Mutex<Vec<PushRequest>>>) {
    let pushes: Arc<Mutex<Vec<PushRequest>>> = Arc::default();
    let kept = pushes.clone();
    let app = axum::Router::new().route(
        "/push.v1.PusherService/Push",
        axum::routing::post(move |body: Bytes| async move {
            let mut raw = Vec::new();
            flate2::read::GzDecoder::new(&body[..])
                .read_to_end(&mut raw)
                .unwrap();
            kept.lock()
                .unwrap()
                .push(PushRequest::decode(&raw[..]).unwrap());
            Vec::<u8>::new()
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, pushes)
}

/// Spans to an in-memory exporter and CPU profiles at 100 Hz to an in-process receiver,
/// uploaded every second: what it receives, the spans, and what to stop and flush at the end.
async fn profiling() -> (
    Arc<Mutex<Vec<PushRequest>>>,
    InMemorySpanExporter,
    SdkTracerProvider,
    profile::ProfilerGuard,
) {
    let (url, pushes) = receiver().await;
    let (exporter, tracer, guard) = profiling_to(Some(url), None);
    (pushes, exporter, tracer, guard)
}

/// Spans to an in-memory exporter, and CPU profiles at 100 Hz sent every second to a Pyroscope
/// `url` and/or an OTLP profiles endpoint: the spans, and what to stop and flush at the end.
pub(crate) fn profiling_to(
    url: Option<String>,
    otlp_endpoint: Option<String>,
) -> (
    InMemorySpanExporter,
    SdkTracerProvider,
    profile::ProfilerGuard,
) {
    let exporter = InMemorySpanExporter::default();
    let tracer = telemetry::tracer_provider(exporter.clone(), telemetry::resource());
    opentelemetry::global::set_tracer_provider(tracer.clone());
    let guard = profile::start(&ProfileSettings {
        url,
        otlp_endpoint,
        application: "ragscope-test".into(),
        sample_rate: 100,
        upload_interval: Duration::from_secs(1),
    })
    .unwrap();
    (exporter, tracer, guard)
}

/// Three questions through the real pipeline, then stops the profiler (which sends what it
/// holds) and flushes the spans.
pub(crate) async fn ask_three_and_stop(
    app: &TestApp,
    tracer: SdkTracerProvider,
    guard: profile::ProfilerGuard,
) {
    for q in [
        "What is the capital of Zorbia?",
        "Who invented the flumox?",
        "What does git stash pop do?",
    ] {
        let (status, body) = app
            .post("/v1/rag/query", &json!({"query": q, "max_tokens": 48}))
            .await;
        assert_eq!(status, 200, "{body}");
    }
    tokio::task::spawn_blocking(move || {
        drop(guard);
        tracer.force_flush().unwrap();
    })
    .await
    .unwrap();
}

/// span_id label → (samples, whether any stack holds a candle frame).
fn samples_by_span(pushes: &[PushRequest]) -> HashMap<String, (i64, bool)> {
    let mut out: HashMap<String, (i64, bool)> = HashMap::new();
    for push in pushes {
        for series in &push.series {
            for raw in &series.samples {
                let p = Profile::decode(&raw.raw_profile[..]).unwrap();
                let s = |i: i64| p.string_table[i as usize].as_str();
                let functions: HashMap<u64, &str> =
                    p.function.iter().map(|f| (f.id, s(f.name))).collect();
                let locations: HashMap<u64, Vec<&str>> = p
                    .location
                    .iter()
                    .map(|l| {
                        (
                            l.id,
                            l.line
                                .iter()
                                .filter_map(|line| functions.get(&line.function_id).copied())
                                .collect(),
                        )
                    })
                    .collect();
                for sample in &p.sample {
                    let Some(span) = sample
                        .label
                        .iter()
                        .find(|l| s(l.key) == "span_id")
                        .map(|l| s(l.str).to_string())
                    else {
                        continue;
                    };
                    let candle = sample
                        .location_id
                        .iter()
                        .filter_map(|id| locations.get(id))
                        .flatten()
                        .any(|f| f.contains("candle"));
                    let entry = out.entry(span).or_default();
                    entry.0 += sample.value.first().copied().unwrap_or(1);
                    entry.1 |= candle;
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_samples_carry_the_span_ids_of_the_stages_that_ran() {
    let (pushes, exporter, tracer, guard) = profiling().await;
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    ask_three_and_stop(&app, tracer, guard).await;

    let pushes = pushes.lock().unwrap().clone();
    assert!(!pushes.is_empty(), "the agent uploaded nothing");
    let labels = &pushes[0].series[0].labels;
    assert!(
        labels
            .iter()
            .any(|l| l.name == "service_name" && l.value == "ragscope-test"),
        "{labels:?}"
    );
    let by_span = samples_by_span(&pushes);
    let spans = exporter.get_finished_spans().unwrap();
    let profiled: HashMap<String, String> = spans
        .iter()
        .filter(|s| {
            s.attributes
                .iter()
                .any(|a| a.key.as_str() == "pyroscope.profile.id")
        })
        .map(|s| (s.span_context.span_id().to_string(), s.name.to_string()))
        .collect();
    let chat: HashSet<&String> = profiled
        .iter()
        .filter(|(_, n)| n.starts_with("chat "))
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        chat.len(),
        3,
        "every chat span is marked as profiled: {profiled:?}"
    );
    let mut by_name: HashMap<String, i64> = HashMap::new();
    for (id, (n, _)) in &by_span {
        *by_name
            .entry(profiled.get(id).cloned().unwrap_or_default())
            .or_default() += n;
    }
    println!("samples by span name: {by_name:?}");
    let matched: Vec<(&String, &(i64, bool))> =
        by_span.iter().filter(|(id, _)| chat.contains(id)).collect();
    assert!(
        !matched.is_empty(),
        "no samples labelled with a chat span id; labels seen: {:?}",
        by_span.keys()
    );
    assert!(
        matched.iter().any(|(_, (_, candle))| *candle),
        "chat samples lack candle frames: {matched:?}"
    );
    // Every labelled sample belongs to a span that exists in the trace.
    for id in by_span.keys() {
        assert!(
            profiled.contains_key(id),
            "samples labelled with unknown span {id}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_profiler_costs_no_request() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let guard = profile::start(&ProfileSettings {
        url: Some(format!("http://{dead}")),
        otlp_endpoint: None,
        application: "ragscope-test".into(),
        sample_rate: 100,
        upload_interval: Duration::from_millis(500),
    })
    .unwrap();
    twenty_queries_answered().await;
    assert!(profile::enabled());
    tokio::task::spawn_blocking(move || drop(guard))
        .await
        .unwrap();
}

/// Twenty queries to a server with a fake generator, every one answered.
pub(crate) async fn twenty_queries_answered() {
    let app = crate::helpers::spawn_fake_app(crate::fakes::FakeGenerator::new(200)).await;
    app.ingest_fixtures().await;
    for i in 0..20 {
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": format!("q{i}"), "max_tokens": 200}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
}

/// Four real queries decoding side by side with every batched step a span: CPU samples taken
/// while a step ran carry that step's span id (the batcher labels its own thread and the compute
/// pools with it), so each step has its own flame graph, and the step span says it is profiled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn samples_taken_in_a_batched_step_carry_the_steps_span_id() {
    let (pushes, exporter, tracer, guard) = profiling().await;
    let app = spawn_app_with(&["--decode-step-spans", "all"]).await;
    app.ingest_fixtures().await;
    let asks = [
        "What is the capital of Zorbia?",
        "Who invented the flumox?",
        "What does git stash pop do?",
        "How do I undo git add?",
    ]
    .map(|q| {
        let (client, url) = (app.client.clone(), app.url("/v1/rag/query"));
        async move {
            let body = json!({"query": q, "max_tokens": 16});
            let r = client.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        }
    });
    futures::future::join_all(asks).await;
    tokio::task::spawn_blocking(move || {
        drop(guard); // stops the agent, uploading what it holds
        tracer.force_flush().unwrap();
    })
    .await
    .unwrap();

    let by_span = samples_by_span(&pushes.lock().unwrap());
    let spans = exporter.get_finished_spans().unwrap();
    let steps: HashMap<String, i64> = spans
        .iter()
        .filter(|s| s.name == "decode_step" && s.parent_span_id == SpanId::INVALID)
        .map(|s| {
            let batch = s
                .attributes
                .iter()
                .find(|a| a.key.as_str() == "rag.decode.batch_size")
                .and_then(|a| match a.value {
                    opentelemetry::Value::I64(b) => Some(b),
                    _ => None,
                })
                .unwrap_or(0);
            (s.span_context.span_id().to_string(), batch)
        })
        .collect();
    assert!(!steps.is_empty(), "no batched step spans");
    let profiled: HashSet<String> = spans
        .iter()
        .filter(|s| {
            s.attributes
                .iter()
                .any(|a| a.key.as_str() == "pyroscope.profile.id")
        })
        .map(|s| s.span_context.span_id().to_string())
        .collect();
    assert!(
        steps.keys().all(|id| profiled.contains(id)),
        "every step span says it is profiled"
    );
    let in_steps: Vec<(&String, i64)> = by_span
        .iter()
        .filter(|(id, _)| steps.contains_key(*id))
        .map(|(id, (n, _))| (id, *n))
        .collect();
    // How many steps ran batched depends on how prefills and decodes interleaved on this box.
    let batched = in_steps.iter().filter(|(id, _)| steps[*id] > 1).count();
    println!(
        "{} step spans ({} batched); {} have samples ({} of the batched ones), {:.0} ms of CPU in them",
        steps.len(),
        steps.values().filter(|b| **b > 1).count(),
        in_steps.len(),
        batched,
        in_steps.iter().map(|(_, n)| *n as f64).sum::<f64>() / 1e6
    );
    assert!(
        !in_steps.is_empty(),
        "no sample labelled with a step's span id; labels seen: {:?}",
        by_span.keys()
    );
    for id in by_span.keys() {
        assert!(
            profiled.contains(id),
            "samples labelled with unknown span {id}"
        );
    }
}
