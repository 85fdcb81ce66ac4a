//! The gRPC API over a real socket (port 0) with a tonic client: streamed answers from the real
//! models, ingest, embeddings, rerank, field-named errors, health, and the call's server span.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry_otlp::Protocol;
use opentelemetry_proto::tonic::trace::v1::Span;
use ragscope::api::grpc::json_to_struct;
use ragscope::api::grpc::proto::query_event::Event;
use ragscope::api::grpc::proto::{
    self, Document, EmbedRequest, IngestRequest, QueryRequest, RerankRequest,
};
use serde_json::{json, Value};
use tonic::{Code, Request};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::helpers::{spawn_app, spawn_fake_app, TestApp};
use crate::receiver::{self, hex, Received};
use crate::trace::{int_attr, providers, str_attr, CLIENT_SPAN, CLIENT_TRACE};

/// What a streamed `Query` sent, in order.
struct Streamed {
    events: Vec<Event>,
    answer: String,
}

async fn query(app: &TestApp, request: QueryRequest) -> Result<Streamed, tonic::Status> {
    let mut client = app.rag_client().await;
    let mut stream = client.query(request).await?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.message().await? {
        events.push(e.event.expect("every message holds an event"));
    }
    let answer = events
        .iter()
        .filter_map(|e| match e {
            Event::Token(t) => Some(t.text.as_str()),
            _ => None,
        })
        .collect();
    Ok(Streamed { events, answer })
}

fn object(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

#[tokio::test]
async fn query_streams_sources_then_tokens_then_usage() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let streamed = query(
        &app,
        QueryRequest {
            query: "What is the capital of Zorbia?".into(),
            max_tokens: Some(32),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let events = &streamed.events;
    let Event::Sources(sources) = &events[0] else {
        panic!("first event is not the sources: {:?}", events[0]);
    };
    let top = &sources.sources[0];
    assert_eq!(top.doc_id, "zorbia");
    assert!(top.text.contains("Quenta"));
    let topic = &top.metadata.as_ref().unwrap().fields["topic"];
    assert_eq!(
        topic.kind,
        Some(prost_types::value::Kind::StringValue("geography".into()))
    );
    let Some(Event::Done(done)) = events.last() else {
        panic!("last event is not done: {:?}", events.last());
    };
    let tokens = &events[1..events.len() - 1];
    assert!(!tokens.is_empty());
    assert!(
        tokens.iter().all(|e| matches!(e, Event::Token(_))),
        "only tokens between sources and done"
    );
    assert!(
        streamed.answer.contains("Quenta"),
        "answer: {}",
        streamed.answer
    );
    let usage = done.usage.unwrap();
    assert!(usage.prompt_tokens > 20);
    assert!(usage.completion_tokens >= 1);
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    let t = done.timings.unwrap();
    assert!(t.total_ms >= t.ttft_ms && t.ttft_ms > 0.0, "{t:?}");
    assert!(["stop", "length"].contains(&done.finish_reason.as_str()));
}

#[tokio::test]
async fn ingested_documents_are_found_by_query_with_struct_filters() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let mut client = app.rag_client().await;
    let doc = Document {
        id: Some("vell".into()),
        text: "# The river Vell\n\nThe river Vell flows north through the town of Ardmoor. Its source is Lake Tarnish.".into(),
        source: Some("atlas/vell.md".into()),
        format: proto::Format::Markdown as i32,
        metadata: Some(json_to_struct(object(json!({"topic": "rivers", "year": 1999})))),
    };
    let outcome = client
        .ingest(IngestRequest {
            documents: vec![doc.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome.documents.len(), 1);
    assert_eq!(outcome.documents[0].id, "vell");
    assert_eq!(outcome.documents[0].status, "created");
    assert!(outcome.documents[0].chunks >= 1);
    let again = client
        .ingest(IngestRequest {
            documents: vec![doc],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.documents[0].status, "unchanged");

    // The year arrives as a protobuf double and still matches the integer stored over gRPC.
    let streamed = query(
        &app,
        QueryRequest {
            query: "Which town does the river Vell flow through?".into(),
            max_tokens: Some(24),
            filter: Some(json_to_struct(object(json!({"metadata.year": 1999})))),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let Event::Sources(sources) = &streamed.events[0] else {
        panic!("no sources first");
    };
    let docs: Vec<&str> = sources.sources.iter().map(|s| s.doc_id.as_str()).collect();
    assert_eq!(docs, ["vell"], "the filter keeps only the new document");
    assert_eq!(sources.sources[0].source, "atlas/vell.md");
    assert!(
        streamed.answer.contains("Ardmoor"),
        "answer: {}",
        streamed.answer
    );
}

#[tokio::test]
async fn embed_returns_normalised_384_dimension_vectors_equal_to_http_ones() {
    let app = spawn_app().await;
    let mut client = app.rag_client().await;
    let texts = ["hello world", "git stash"];
    let r = client
        .embed(EmbedRequest {
            inputs: texts.iter().map(|t| t.to_string()).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.model, "all-MiniLM-L6-v2");
    assert_eq!(r.embeddings.len(), 2);
    assert!(r.prompt_tokens > 0);
    for e in &r.embeddings {
        assert_eq!(e.values.len(), 384);
        let norm: f32 = e.values.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-3, "norm {norm}");
    }
    assert_ne!(r.embeddings[0].values, r.embeddings[1].values);
    let (status, body) = app
        .post(
            "/v1/embeddings",
            &json!({"model": "all-MiniLM-L6-v2", "input": texts}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    for (i, e) in r.embeddings.iter().enumerate() {
        let http: Vec<f32> = body["data"][i]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let cosine: f32 = http.iter().zip(&e.values).map(|(a, b)| a * b).sum();
        assert!(cosine > 0.9999, "input {i}: cosine {cosine}");
    }
}

#[tokio::test]
async fn rerank_returns_documents_best_first() {
    let app = spawn_app().await;
    let mut client = app.rag_client().await;
    let r = client
        .rerank(RerankRequest {
            query: "create a shallow clone with --depth".into(),
            documents: vec![
                "bake the bread for forty minutes".into(),
                "git clone --depth 1 creates a shallow clone with a truncated history".into(),
                "git log shows commit logs".into(),
            ],
            top_n: Some(2),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.model, "rrf-dense-bm25");
    assert_eq!(r.results.len(), 2, "top_n is honoured");
    assert_eq!(r.results[0].index, 1, "{:?}", r.results);
    assert!(r.results[0].relevance_score >= r.results[1].relevance_score);
}

/// The status of a call that must fail.
fn failed<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> tonic::Status {
    r.expect_err("the call must fail")
}

fn assert_names_field(status: &tonic::Status, field: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with(&format!("{field}: ")),
        "{field}: {:?}",
        status.message()
    );
}

#[tokio::test]
async fn invalid_input_is_invalid_argument_naming_the_field() {
    // About validation, not answers: stand-in stages.
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(4)).await;
    let mut client = app.rag_client().await;
    let ask = |q: QueryRequest| {
        let mut client = client.clone();
        async move { client.query(q).await.map(|_| ()) }
    };
    let base = || QueryRequest {
        query: "a question".into(),
        ..Default::default()
    };
    for (request, field) in [
        (
            QueryRequest {
                query: "  ".into(),
                ..base()
            },
            "query",
        ),
        (
            QueryRequest {
                top_k: Some(0),
                ..base()
            },
            "top_k",
        ),
        (
            QueryRequest {
                top_k: Some(5),
                rerank_top_n: Some(6),
                ..base()
            },
            "rerank_top_n",
        ),
        (
            QueryRequest {
                temperature: Some(3.0),
                ..base()
            },
            "temperature",
        ),
        (
            QueryRequest {
                context_order: Some("sideways".into()),
                ..base()
            },
            "context_order",
        ),
        (
            QueryRequest {
                context: Some("off".into()),
                context_terms: Some(true),
                ..base()
            },
            "context_terms",
        ),
        (
            QueryRequest {
                filter: Some(json_to_struct(object(json!({"colour": "blue"})))),
                ..base()
            },
            "filter.colour",
        ),
    ] {
        assert_names_field(&failed(ask(request).await), field);
    }
    let overflow = failed(
        ask(QueryRequest {
            max_tokens: Some(1_000_000),
            ..base()
        })
        .await,
    );
    assert_names_field(&overflow, "max_tokens");
    assert_eq!(
        overflow.metadata().get("ragscope-error-code").unwrap(),
        "context_length_exceeded"
    );

    let ingest = |documents: Vec<Document>| {
        let mut client = client.clone();
        async move { client.ingest(IngestRequest { documents }).await }
    };
    assert_names_field(&failed(ingest(vec![]).await), "documents");
    let blank = Document {
        text: "fine".into(),
        ..Default::default()
    };
    assert_names_field(
        &failed(
            ingest(vec![
                blank.clone(),
                Document {
                    text: " ".into(),
                    ..Default::default()
                },
            ])
            .await,
        ),
        "documents[1].text",
    );
    assert_names_field(
        &failed(
            ingest(vec![Document {
                metadata: Some(json_to_struct(object(json!({"tags": ["a"]})))),
                ..blank
            }])
            .await,
        ),
        "documents[0].metadata.tags",
    );

    let embed = |inputs: Vec<&str>| {
        let mut client = client.clone();
        let inputs = inputs.into_iter().map(String::from).collect();
        async move { client.embed(EmbedRequest { inputs }).await }
    };
    assert_names_field(&failed(embed(vec![]).await), "inputs");
    assert_names_field(&failed(embed(vec!["a", ""]).await), "inputs[1]");

    let rerank = |query: &str, documents: Vec<&str>, top_n: Option<u32>| {
        let mut client = client.clone();
        let request = RerankRequest {
            query: query.into(),
            documents: documents.into_iter().map(String::from).collect(),
            top_n,
        };
        async move { client.rerank(request).await }
    };
    assert_names_field(&failed(rerank("", vec!["a"], None).await), "query");
    assert_names_field(&failed(rerank("q", vec![], None).await), "documents");
    assert_names_field(
        &failed(rerank("q", vec!["a", " "], None).await),
        "documents[1]",
    );
    assert_names_field(&failed(rerank("q", vec!["a"], Some(0)).await), "top_n");

    // A valid call on the same channel still works.
    let ok = client
        .embed(EmbedRequest {
            inputs: vec!["fine".into()],
        })
        .await
        .unwrap();
    assert_eq!(ok.into_inner().embeddings.len(), 1);
}

async fn health_of(app: &TestApp, service: &str) -> ServingStatus {
    let mut health = HealthClient::new(app.grpc_channel().await);
    let r = health
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner();
    r.status()
}

#[tokio::test]
async fn health_reports_serving_only_once_the_pipeline_is_ready() {
    let state = ragscope::api::AppState {
        pipeline: Arc::new(std::sync::OnceLock::new()),
        readiness: Arc::new(ragscope::api::Readiness::default()),
        request_timeout: Duration::from_secs(30),
        faults: Arc::default(),
        ui: Arc::default(),
        auth: Arc::default(),
        shutdown_grace: Duration::from_secs(30),
        tenants: Arc::default(),
    };
    let app = crate::helpers::serve_state(state.clone(), 1 << 20, None).await;
    for service in ["", "ragscope.v1.Rag"] {
        assert_eq!(
            health_of(&app, service).await,
            ServingStatus::NotServing,
            "{service:?} while loading"
        );
    }
    let mut client = app.rag_client().await;
    let early = failed(
        client
            .embed(EmbedRequest {
                inputs: vec!["x".into()],
            })
            .await,
    );
    assert_eq!(early.code(), Code::Unavailable, "{early:?}");

    // Watch the status, then finish "loading" the way `serve` does.
    let mut health = HealthClient::new(app.grpc_channel().await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "ragscope.v1.Rag".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::NotServing);
    let _ = state.pipeline.set(Arc::new(crate::helpers::fake_pipeline(
        crate::fakes::FakeGenerator::new(2),
    )));
    state.readiness.set_ready();
    // A guard against hanging, not a timing assertion.
    let next = tokio::time::timeout(Duration::from_secs(60), watch.message())
        .await
        .expect("a status change")
        .unwrap()
        .unwrap();
    assert_eq!(next.status(), ServingStatus::Serving);
    assert_eq!(health_of(&app, "").await, ServingStatus::Serving);
    // Shutting down ends the watch (NOT_SERVING first), so draining does not wait on it forever.
    let stopping = tokio::spawn(app.stop());
    let mut last = ServingStatus::Serving;
    while let Ok(Some(m)) = watch.message().await {
        last = m.status();
    }
    assert_eq!(last, ServingStatus::NotServing);
    tokio::time::timeout(Duration::from_secs(60), stopping)
        .await
        .expect("graceful shutdown finishes with a watcher connected")
        .unwrap();
}

#[tokio::test]
async fn unknown_health_services_are_not_found() {
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(2)).await;
    assert_eq!(health_of(&app, "").await, ServingStatus::Serving);
    let mut health = HealthClient::new(app.grpc_channel().await);
    let status = failed(
        health
            .check(HealthCheckRequest {
                service: "no.such.Service".into(),
            })
            .await,
    );
    assert_eq!(status.code(), Code::NotFound);
}

async fn flush(tracer: &opentelemetry_sdk::trace::SdkTracerProvider) {
    let tracer = tracer.clone();
    // Flushing blocks on the exporter, which needs the runtime's other threads.
    tokio::task::spawn_blocking(move || tracer.force_flush().unwrap())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceparent_metadata_parents_the_server_span_and_its_stages() {
    let received = Received::default();
    let endpoint = receiver::grpc(received.clone()).await;
    let (tracer, _meter) = providers(Protocol::Grpc, &endpoint);
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(4)).await;
    app.ingest_fixtures().await;
    let mut client = app.rag_client().await;
    let mut request = Request::new(QueryRequest {
        query: "colours".into(),
        max_tokens: Some(4),
        ..Default::default()
    });
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    let response = client.query(request).await.unwrap();
    assert_eq!(response.metadata().get("x-trace-id").unwrap(), CLIENT_TRACE);
    let mut stream = response.into_inner();
    while stream.message().await.unwrap().is_some() {}
    // A rejected call is traced too, with its status code; health checks are not.
    let mut rejected = Request::new(EmbedRequest { inputs: vec![] });
    rejected
        .metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    assert_eq!(
        failed(client.embed(rejected).await).code(),
        Code::InvalidArgument
    );
    health_of(&app, "").await;
    flush(&tracer).await;

    let spans: Vec<Span> = received
        .spans_of(CLIENT_TRACE)
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    let root = spans
        .iter()
        .find(|s| s.name == "ragscope.v1.Rag/Query")
        .unwrap_or_else(|| {
            panic!(
                "no server span in {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(hex(&root.parent_span_id), CLIENT_SPAN);
    assert_eq!(root.kind, 2, "SERVER");
    assert_eq!(str_attr(root, "rpc.system"), Some("grpc"));
    assert_eq!(str_attr(root, "rpc.service"), Some("ragscope.v1.Rag"));
    assert_eq!(str_attr(root, "rpc.method"), Some("Query"));
    assert_eq!(int_attr(root, "rpc.grpc.status_code"), Some(0));
    let children: Vec<&str> = spans
        .iter()
        .filter(|s| s.parent_span_id == root.span_id)
        .map(|s| s.name.as_str())
        .collect();
    for want in [
        "queue",
        "embeddings fake-embedder",
        "retrieval fake",
        "prompt",
        "chat fake-generator",
        "stream",
    ] {
        assert!(children.contains(&want), "missing {want} in {children:?}");
    }
    // Every span of the call descends from the server span and lies inside it.
    let by_id: HashMap<Vec<u8>, &Span> = spans.iter().map(|s| (s.span_id.clone(), s)).collect();
    for s in spans.iter().filter(|s| s.trace_id == root.trace_id) {
        let mut at = s;
        while at.span_id != root.span_id {
            match by_id.get(&at.parent_span_id) {
                Some(parent) => at = parent,
                None => break,
            }
        }
        if s.name == "ragscope.v1.Rag/Embed" {
            continue;
        }
        assert_eq!(at.span_id, root.span_id, "{} is not under the call", s.name);
        assert!(
            s.start_time_unix_nano >= root.start_time_unix_nano
                && s.end_time_unix_nano <= root.end_time_unix_nano,
            "{} escapes the call",
            s.name
        );
    }
    let embed = spans
        .iter()
        .find(|s| s.name == "ragscope.v1.Rag/Embed")
        .expect("the rejected call's span");
    assert_eq!(
        int_attr(embed, "rpc.grpc.status_code"),
        Some(Code::InvalidArgument as i64)
    );
    assert!(
        !received
            .spans()
            .iter()
            .any(|(_, s)| s.name.starts_with("grpc.health")),
        "health checks are not traced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_query_stops_its_generation() {
    let received = Received::default();
    let endpoint = receiver::grpc(received.clone()).await;
    let (tracer, _meter) = providers(Protocol::Grpc, &endpoint);
    // 3,000 stand-in tokens would take 9 s; cancelling must end the generation long before.
    let app = spawn_fake_app(crate::fakes::FakeGenerator {
        tokens: 3000,
        token_us: 3000,
    })
    .await;
    app.ingest_fixtures().await;
    let mut client = app.rag_client().await;
    let mut request = Request::new(QueryRequest {
        query: "long".into(),
        max_tokens: Some(3000),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
            .parse()
            .unwrap(),
    );
    let mut stream = client.query(request).await.unwrap().into_inner();
    loop {
        match stream.message().await.unwrap().unwrap().event {
            Some(Event::Token(_)) => break,
            _ => continue,
        }
    }
    drop(stream);
    // Wait for the generation's span to end, however it ends, then see why it ended.
    let mut polls = 0;
    let chat = loop {
        polls += 1;
        assert!(polls < 600, "the generation's span never ended");
        flush(&tracer).await;
        let spans = received.spans_of(CLIENT_TRACE);
        if let Some((_, chat)) = spans
            .into_iter()
            .find(|(_, s)| s.name == "chat fake-generator")
        {
            break chat;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        str_attr(&chat, "gen_ai.response.finish_reasons"),
        Some("cancelled")
    );
    assert!(int_attr(&chat, "gen_ai.usage.output_tokens").unwrap() < 3000);
    let server = received
        .spans_of(CLIENT_TRACE)
        .into_iter()
        .map(|(_, s)| s)
        .find(|s| s.name == "ragscope.v1.Rag/Query")
        .expect("server span");
    assert_eq!(
        int_attr(&server, "rpc.grpc.status_code"),
        Some(Code::Cancelled as i64)
    );
}

#[tokio::test]
async fn query_takes_stop_strings_penalties_and_logprobs() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let ask = |extra: QueryRequest| QueryRequest {
        query: "What is the capital of Zorbia?".into(),
        max_tokens: Some(24),
        ..extra
    };
    let free = query(&app, ask(QueryRequest::default())).await.unwrap();
    let at = free
        .answer
        .find("Quenta")
        .expect("the answer names the capital");
    let cut = query(
        &app,
        ask(QueryRequest {
            stop: vec!["Quenta".into()],
            logprobs: Some(2),
            presence_penalty: Some(0.0),
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    assert_eq!(cut.answer, free.answer[..at]);
    let Some(Event::Done(done)) = cut.events.last() else {
        panic!("no done event")
    };
    assert_eq!(done.finish_reason, "stop");
    let logprobs: Vec<&proto::TokenLogprob> = cut
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Token(t) => Some(t.logprobs.iter()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(!logprobs.is_empty());
    assert!(logprobs
        .iter()
        .all(|l| l.top.len() == 2 && l.logprob <= 0.0));
    let err = query(
        &app,
        ask(QueryRequest {
            frequency_penalty: Some(3.0),
            ..Default::default()
        }),
    )
    .await
    .err()
    .expect("out of range");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("frequency_penalty: "), "{err:?}");
    app.stop().await;
}
