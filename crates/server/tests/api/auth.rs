//! API keys over real sockets (stand-in model stages: these tests are about who may call what):
//! no key or a wrong one gets OpenAI's 401, a user key queries but may not write, delete or
//! read traces (403), an admin key may, the probes stay open, and gRPC checks the
//! `authorization` metadata the same way.

use ragscope::api::grpc::proto::{Document, IngestRequest, QueryRequest};
use serde_json::{json, Value};
use tonic::{Code, Request};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_fake_app_with, TestApp};

const USER: &str = "user-key-3f9a1c";
const ADMIN: &str = "admin-key-7be2d0";

async fn keyed_app() -> TestApp {
    let admin = format!("admin:{ADMIN}");
    spawn_fake_app_with(
        FakeGenerator::new(4),
        &["--api-key", USER, "--api-key", &admin],
    )
    .await
}

/// Status and JSON body of `method path` with an optional bearer key.
async fn call(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = app.client.request(method, app.url(path));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn query() -> Option<Value> {
    Some(json!({"query": "What is the capital of Zorbia?", "max_tokens": 4}))
}

fn doc(id: &str) -> Option<Value> {
    Some(json!({"documents": [{"id": id, "text": "Zorbia's capital is Quenta."}]}))
}

#[tokio::test]
async fn without_a_known_key_protected_routes_answer_openai_shaped_401() {
    let app = keyed_app().await;
    use reqwest::Method;
    for key in [None, Some("not-a-key"), Some(&USER[..USER.len() - 1])] {
        let (status, body) = call(&app, Method::POST, "/v1/rag/query", key, query()).await;
        assert_eq!(status, 401, "{key:?}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("authorization: "));
        if let Some(k) = key {
            assert!(!body.to_string().contains(k), "the key is echoed: {body}");
        }
    }
    let (status, _) = call(&app, Method::GET, "/v1/models", None, None).await;
    assert_eq!(status, 401);
    // A key sent without the Bearer scheme is not a key.
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .header("authorization", USER)
        .json(&query())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // Probes and the scrape stay open.
    for path in ["/health", "/ready", "/metrics"] {
        let r = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let metrics = app.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ragscope_auth_rejected_total{")
                && l.contains("reason=\"invalid\"")),
        "{metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_user_key_queries_but_only_an_admin_key_writes_deletes_and_reads_traces() {
    let app = keyed_app().await;
    use reqwest::Method;
    let (status, body) = call(&app, Method::POST, "/v1/rag/query", Some(USER), query()).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["answer"].is_string(), "{body}");
    let chat = json!({"model": "fake-generator", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, body) = call(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(USER),
        Some(chat),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    let forbidden = [
        (Method::POST, "/v1/documents", doc("a")),
        (Method::DELETE, "/v1/documents/a", None),
        (Method::GET, "/debug/traces?limit=1", None),
        (Method::DELETE, "/debug/traces", None),
        (Method::GET, "/admin/faults", None),
    ];
    for (method, path, body) in forbidden {
        let (status, answer) = call(&app, method.clone(), path, Some(USER), body).await;
        assert_eq!(status, 403, "{method} {path}: {answer}");
        assert_eq!(answer["error"]["code"], "insufficient_scope", "{answer}");
    }

    let (status, body) = call(&app, Method::POST, "/v1/documents", Some(ADMIN), doc("a")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["documents"][0]["status"], "created", "{body}");
    let (status, body) = call(&app, Method::DELETE, "/v1/documents/a", Some(ADMIN), None).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = call(&app, Method::POST, "/v1/rag/query", Some(ADMIN), query()).await;
    assert_eq!(status, 200, "{body}");
    // Traces are readable with the admin key, and no key is on any span.
    let (status, traces) = call(&app, Method::GET, "/debug/traces", Some(ADMIN), None).await;
    assert!(status == 200 || status == 404, "{status} {traces}");
    let text = traces.to_string();
    assert!(
        !text.contains(USER) && !text.contains(ADMIN),
        "a key is on a span"
    );
    let (status, _) = call(&app, Method::DELETE, "/debug/traces", Some(ADMIN), None).await;
    assert_eq!(status, 200);
    app.stop().await;
}

#[tokio::test]
async fn keys_can_come_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys");
    std::fs::write(&file, format!("# ragscope keys\n\n{USER}\nadmin:{ADMIN}\n")).unwrap();
    let app = spawn_fake_app_with(
        FakeGenerator::new(2),
        &["--api-key-file", file.to_str().unwrap()],
    )
    .await;
    use reqwest::Method;
    let (status, _) = call(&app, Method::POST, "/v1/rag/query", None, query()).await;
    assert_eq!(status, 401);
    let (status, _) = call(&app, Method::POST, "/v1/documents", Some(USER), doc("b")).await;
    assert_eq!(status, 403);
    let (status, body) = call(&app, Method::POST, "/v1/documents", Some(ADMIN), doc("b")).await;
    assert_eq!(status, 200, "{body}");
    app.stop().await;
}

fn with_key<T>(message: T, key: Option<&str>) -> Request<T> {
    let mut r = Request::new(message);
    if let Some(k) = key {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {k}").parse().unwrap());
    }
    r
}

#[tokio::test]
async fn grpc_checks_the_authorization_metadata() {
    let app = keyed_app().await;
    let mut client = app.rag_client().await;
    let ask = || QueryRequest {
        query: "What is the capital of Zorbia?".into(),
        max_tokens: Some(3),
        ..Default::default()
    };
    for key in [None, Some("not-a-key")] {
        let status = client.query(with_key(ask(), key)).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{key:?}: {status:?}");
        assert_eq!(
            status.metadata().get("ragscope-error-code").unwrap(),
            "invalid_api_key"
        );
    }
    let mut stream = client
        .query(with_key(ask(), Some(USER)))
        .await
        .unwrap()
        .into_inner();
    let mut messages = 0;
    while stream.message().await.unwrap().is_some() {
        messages += 1;
    }
    assert!(messages >= 2, "{messages} messages");

    let ingest = || IngestRequest {
        documents: vec![Document {
            id: Some("g".into()),
            text: "Zorbia's capital is Quenta.".into(),
            ..Default::default()
        }],
    };
    let status = client
        .ingest(with_key(ingest(), Some(USER)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let done = client
        .ingest(with_key(ingest(), Some(ADMIN)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.documents[0].status, "created");

    // The health service stays open, like /health.
    let mut health = HealthClient::new(app.grpc_channel().await);
    let r = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(r.is_ok(), "{r:?}");
    app.stop().await;
}
