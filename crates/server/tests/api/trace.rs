//! A real request's trace and metrics, exported over OTLP (gRPC and HTTP) to an in-process
//! receiver: names, attributes, parent links, exact nesting and coverage of the request span.

use std::collections::HashMap;

use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde_json::json;

use crate::helpers::spawn_app;
use crate::receiver::{self, hex, Received};

pub const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
pub const CLIENT_SPAN: &str = "00f067aa0ba902b7";

pub fn providers(protocol: Protocol, endpoint: &str) -> (SdkTracerProvider, SdkMeterProvider) {
    let resource = telemetry::resource();
    let (spans, metrics) = match protocol {
        Protocol::Grpc => (
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .unwrap(),
            opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .unwrap(),
        ),
        _ => (
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(protocol)
                .with_endpoint(format!("{endpoint}/v1/traces"))
                .build()
                .unwrap(),
            opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_protocol(protocol)
                .with_endpoint(format!("{endpoint}/v1/metrics"))
                .build()
                .unwrap(),
        ),
    };
    let tracer = telemetry::tracer_provider(spans, resource.clone());
    let meter = SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(telemetry::metrics::scrape_reader())
        .with_periodic_exporter(metrics)
        .build();
    opentelemetry::global::set_tracer_provider(tracer.clone());
    opentelemetry::global::set_meter_provider(meter.clone());
    (tracer, meter)
}

pub fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a AnyValue> {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

pub fn int_attr(span: &Span, key: &str) -> Option<i64> {
    match attr(span, key)? {
        AnyValue::IntValue(i) => Some(*i),
        _ => None,
    }
}

pub fn str_attr<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match attr(span, key)? {
        AnyValue::StringValue(s) => Some(s),
        _ => None,
    }
}

/// Fraction of `parent`'s interval covered by the union of its children's intervals.
pub fn coverage(parent: &Span, children: &[&Span]) -> f64 {
    let mut intervals: Vec<(u64, u64)> = children
        .iter()
        .map(|c| (c.start_time_unix_nano, c.end_time_unix_nano))
        .collect();
    intervals.sort();
    let mut covered = 0u64;
    let mut reach = parent.start_time_unix_nano;
    for (start, end) in intervals {
        let start = start.max(reach);
        if end > start {
            covered += end - start;
            reach = end;
        }
    }
    covered as f64 / (parent.end_time_unix_nano - parent.start_time_unix_nano) as f64
}

async fn a_streamed_request_is_traced_end_to_end(protocol: Protocol) {
    let received = Received::default();
    let endpoint = match protocol {
        Protocol::Grpc => receiver::grpc(received.clone()).await,
        _ => receiver::http(received.clone()).await,
    };
    let (tracer, meter) = providers(protocol, &endpoint);
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let response = app
        .client
        .post(app.url("/v1/rag/query"))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .json(&json!({"query": "What is the capital of Zorbia?", "max_tokens": 12, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-trace-id"], CLIENT_TRACE);
    let body = response.text().await.unwrap();
    assert!(body.contains("event: done"), "{body}");
    // Flushing blocks on the exporters, which need the runtime's other threads.
    tokio::task::spawn_blocking(move || {
        tracer.force_flush().unwrap();
        meter.force_flush().unwrap();
    })
    .await
    .unwrap();

    let with_service: Vec<(String, Span)> = received.spans_of(CLIENT_TRACE);
    for (service, span) in &with_service {
        assert!(
            service.contains("\"ragscope\""),
            "{} exported under {service:?}",
            span.name
        );
    }
    let spans: Vec<Span> = with_service.into_iter().map(|(_, s)| s).collect();
    let by_id: HashMap<String, &Span> = spans.iter().map(|s| (hex(&s.span_id), s)).collect();
    let children = |parent: &Span| -> Vec<&Span> {
        spans
            .iter()
            .filter(|s| s.parent_span_id == parent.span_id)
            .collect()
    };
    let root = spans
        .iter()
        .find(|s| s.name == "POST /v1/rag/query")
        .expect("server span");
    assert_eq!(
        hex(&root.parent_span_id),
        CLIENT_SPAN,
        "parented to the caller's span"
    );
    assert_eq!(root.kind, 2, "SERVER");
    assert_eq!(int_attr(root, "http.response.status_code"), Some(200));
    assert_eq!(str_attr(root, "http.route"), Some("/v1/rag/query"));

    let stages: Vec<&str> = children(root).iter().map(|s| s.name.as_str()).collect();
    for want in [
        "queue",
        "embeddings all-MiniLM-L6-v2",
        "retrieval ragscope",
        "rerank rrf-dense-bm25",
        "prompt",
        "chat SmolLM2-135M-Instruct",
        "stream",
    ] {
        assert!(stages.contains(&want), "missing {want} in {stages:?}");
    }
    let named = |name: &str| *children(root).iter().find(|s| s.name == name).unwrap();
    let embed: Vec<String> = children(named("embeddings all-MiniLM-L6-v2"))
        .iter()
        .map(|s| s.name.clone())
        .collect();
    assert_eq!(embed, ["tokenize", "forward"]);
    let retrieval = named("retrieval ragscope");
    assert_eq!(str_attr(retrieval, "db.system.name"), Some("qdrant-edge"));
    assert!(int_attr(retrieval, "db.response.returned_rows").unwrap() >= 1);
    let chat = named("chat SmolLM2-135M-Instruct");
    assert_eq!(str_attr(chat, "gen_ai.operation.name"), Some("chat"));
    let output_tokens = int_attr(chat, "gen_ai.usage.output_tokens").unwrap();
    assert!(output_tokens >= 1);
    let gen: Vec<&Span> = children(chat);
    let decode = gen
        .iter()
        .find(|s| s.name == "decode")
        .expect("decode span");
    assert!(gen.iter().any(|s| s.name == "prefill"));
    let indices: Vec<i64> = decode
        .events
        .iter()
        .filter(|e| e.name == "token")
        .filter_map(|e| e.attributes.iter().find(|a| a.key == "gen_ai.token.index"))
        .filter_map(|a| match a.value.as_ref()?.value.as_ref()? {
            AnyValue::IntValue(i) => Some(*i),
            _ => None,
        })
        .collect();
    // One event per sampled token, in order; a final end-of-sequence token gets one too.
    assert_eq!(indices, (0..indices.len() as i64).collect::<Vec<_>>());
    assert!(
        (output_tokens..=output_tokens + 1).contains(&(indices.len() as i64)),
        "{indices:?} vs {output_tokens}"
    );
    for e in &decode.events {
        assert!(
            e.time_unix_nano >= decode.start_time_unix_nano
                && e.time_unix_nano <= decode.end_time_unix_nano
        );
    }

    // Exact nesting: every span lies inside its parent.
    for s in &spans {
        if let Some(parent) = by_id.get(&hex(&s.parent_span_id)) {
            assert!(
                s.start_time_unix_nano >= parent.start_time_unix_nano
                    && s.end_time_unix_nano <= parent.end_time_unix_nano,
                "{} escapes {}",
                s.name,
                parent.name
            );
        }
    }
    let covered = coverage(root, &children(root));
    assert!(
        covered >= 0.98,
        "stages cover {:.4} of the request",
        covered
    );

    let names = received.metric_names();
    for want in [
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "ragscope.stage.duration",
        "ragscope.token.usage",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "metric {want} not received: {names:?}"
        );
    }
    let scrape = app.metrics_text().await;
    assert!(
        scrape.contains("gen_ai_server_request_duration_seconds_bucket"),
        "{scrape}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_is_traced_over_grpc() {
    a_streamed_request_is_traced_end_to_end(Protocol::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_is_traced_over_http() {
    a_streamed_request_is_traced_end_to_end(Protocol::HttpBinary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_costs_counted_spans_not_requests() {
    // An address nobody listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(format!("http://{dead}"))
        .with_timeout(std::time::Duration::from_millis(500))
        .build()
        .unwrap();
    let provider = telemetry::tracer_provider(exporter, telemetry::resource());
    opentelemetry::global::set_tracer_provider(provider.clone());
    let app = crate::helpers::spawn_fake_app(crate::fakes::FakeGenerator::new(4)).await;
    app.ingest_fixtures().await;
    for i in 0..50 {
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": format!("q{i}"), "max_tokens": 4}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let _ = tokio::task::spawn_blocking(move || provider.force_flush())
        .await
        .unwrap();
    let stats = telemetry::export_stats();
    assert!(stats.dropped() >= 50 * 10, "dropped {}", stats.dropped());
    let scrape = app.metrics_text().await;
    let line = scrape
        .lines()
        .find(|l| l.starts_with("ragscope_spans_dropped_total{reason=\"export_failed\"}"))
        .unwrap_or_else(|| panic!("no dropped-span counter in {scrape}"));
    let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(value >= 500.0, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_can_be_exported_as_services_of_their_own_with_parentage_intact() {
    let received = Received::default();
    let endpoint = receiver::grpc(received.clone()).await;
    let exporter = || {
        Ok(opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .build()?)
    };
    let (tracer, _meter) = providers(Protocol::Grpc, &endpoint);
    let stage_providers = telemetry::install_stage_services(exporter).unwrap();
    let app = crate::helpers::spawn_fake_app(crate::fakes::FakeGenerator::new(3)).await;
    app.ingest_fixtures().await;
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .json(&json!({"query": "colours", "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    tokio::task::spawn_blocking(move || {
        tracer.force_flush().unwrap();
        for p in stage_providers {
            p.force_flush().unwrap();
        }
    })
    .await
    .unwrap();
    let spans: Vec<(String, Span)> = received.spans_of(CLIENT_TRACE);
    let service_of = |name: &str| -> String {
        spans
            .iter()
            .find(|(_, s)| s.name == name)
            .map(|(svc, _)| svc.clone())
            .unwrap_or_default()
    };
    assert!(
        service_of("POST /v1/rag/query").contains("\"ragscope\""),
        "{spans:?}"
    );
    assert!(service_of("embeddings fake-embedder").contains("ragscope-embed"));
    assert!(
        service_of("tokenize").contains("ragscope-embed"),
        "children keep their stage's service"
    );
    assert!(service_of("retrieval fake").contains("ragscope-retrieve"));
    assert!(service_of("chat fake-generator").contains("ragscope-generate"));
    assert!(service_of("decode").contains("ragscope-generate"));
    let root = spans
        .iter()
        .find(|(_, s)| s.name == "POST /v1/rag/query")
        .unwrap()
        .1
        .clone();
    let embed = spans
        .iter()
        .find(|(_, s)| s.name == "embeddings fake-embedder")
        .unwrap()
        .1
        .clone();
    assert_eq!(
        embed.parent_span_id, root.span_id,
        "parentage crosses services"
    );
}
