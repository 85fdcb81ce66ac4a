//! The HTTP server's connection management (`--max-connection-age-s`): a keep-alive client's
//! connection is closed once past its age, after the response in flight, busy or idle, and the
//! client's next request goes out on a new connection. Connections are counted where the
//! client opens them (a layer on reqwest's connector), so nothing on the server is trusted.
//! A client that never finishes its headers is closed at `--header-read-timeout-s`, and one past
//! `--max-connections` is turned away at accept.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::fakes::FakeGenerator;
use crate::helpers::spawn_fake_app_with;

/// Counts the connections a client opens.
#[derive(Clone)]
struct CountConnections(Arc<AtomicUsize>);

impl<S> tower::Layer<S> for CountConnections {
    type Service = Counted<S>;
    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            opened: self.0.clone(),
        }
    }
}

#[derive(Clone)]
struct Counted<S> {
    inner: S,
    opened: Arc<AtomicUsize>,
}

impl<S: tower::Service<R>, R> tower::Service<R> for Counted<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, request: R) -> S::Future {
        self.opened.fetch_add(1, Ordering::SeqCst);
        self.inner.call(request)
    }
}

#[tokio::test]
async fn an_aged_connection_finishes_its_answer_then_the_client_reconnects() {
    // 15 stand-in tokens of 100 ms: an answer started at once is still streaming when its
    // connection's age (1 s ± 10%) passes.
    let app = spawn_fake_app_with(
        FakeGenerator {
            tokens: 15,
            token_us: 100_000,
        },
        &["--max-connection-age-s", "1"],
    )
    .await;
    app.ingest_fixtures().await;
    let opened = Arc::new(AtomicUsize::new(0));
    let client = reqwest::Client::builder()
        .connector_layer(CountConnections(opened.clone()))
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let health = || async {
        let r = client.get(app.url("/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    };

    let first_opened = Instant::now();
    health().await;
    assert_eq!(opened.load(Ordering::SeqCst), 1);
    let answer = client
        .post(app.url("/v1/rag/query"))
        .json(&json!({"query": "What is the capital of Zorbia?", "max_tokens": 15, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let body = answer.text().await.expect("the answer completes");
    let took = first_opened.elapsed();
    let events: Vec<String> = crate::query::sse_events(&body)
        .into_iter()
        .map(|(event, _)| event)
        .collect();
    assert_eq!(events.last().map(String::as_str), Some("done"), "{body}");
    assert!(
        took > Duration::from_millis(1200),
        "the answer ended after {took:?}, before the connection's age could pass"
    );
    assert_eq!(
        opened.load(Ordering::SeqCst),
        1,
        "the answer went out on the first connection"
    );

    // Past its age, the server closed that connection once the answer was out.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second_opened = Instant::now();
    health().await;
    assert_eq!(opened.load(Ordering::SeqCst), 2, "a new connection");

    // An idle connection is closed at its age too.
    tokio::time::sleep(Duration::from_millis(1400).saturating_sub(second_opened.elapsed())).await;
    health().await;
    assert_eq!(opened.load(Ordering::SeqCst), 3, "the idle one was closed");
    app.stop().await;
}

#[tokio::test]
async fn without_an_age_a_keep_alive_connection_is_kept() {
    let app = spawn_fake_app_with(FakeGenerator::new(2), &[]).await;
    let opened = Arc::new(AtomicUsize::new(0));
    let client = reqwest::Client::builder()
        .connector_layer(CountConnections(opened.clone()))
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = client.get(app.url("/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(opened.load(Ordering::SeqCst), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_client_that_trickles_its_headers_is_closed_while_others_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = spawn_fake_app_with(FakeGenerator::new(2), &["--header-read-timeout-s", "1"]).await;
    let addr = app.base.trim_start_matches("http://").to_string();
    // A request line and one header, then nothing: the rest of the headers never come.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    // Meanwhile a whole request on its own connection is answered.
    let r = reqwest::get(app.url("/health")).await.unwrap();
    assert_eq!(r.status(), 200);
    let mut read = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut read)).await;
    let waited = started.elapsed();
    assert!(closed.is_ok(), "still open after {waited:?}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "closed after {waited:?}"
    );
    // Closed without an answer to the half-sent request, or with a 408 at most.
    let text = String::from_utf8_lossy(&read);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );
    app.stop().await;
}

/// Past `--max-connections` a new HTTP connection gets one 503 naming the cap and is closed,
/// and a new gRPC connection is closed at accept; the connections already open are still
/// served, and a slot a closing connection frees goes to the next client.
#[tokio::test]
async fn connections_past_the_cap_are_turned_away_while_the_open_ones_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    const GET: &[u8] = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    let app = spawn_fake_app_with(FakeGenerator::new(2), &["--max-connections", "2"]).await;
    let addr = app.base.trim_start_matches("http://").to_string();
    // Two kept-alive connections take both slots (each answered once, so both were accepted).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(GET).await.unwrap();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
        held.push(s);
    }
    let mut third = TcpStream::connect(&addr).await.unwrap();
    third.write_all(GET).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut answer))
        .await
        .expect("the refused connection is closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(
        answer.contains("\"code\":\"too_many_connections\""),
        "{answer}"
    );
    // The open ones are still served.
    held[0].write_all(GET).await.unwrap();
    let mut buf = [0u8; 512];
    let n = held[0].read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    // Closing one frees its slot for a new client (once the server has seen the close).
    drop(held.pop());
    let freed = Instant::now();
    loop {
        let r = reqwest::Client::new()
            .get(app.url("/health"))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(
            freed.elapsed() < Duration::from_secs(5),
            "the slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // gRPC: two connections that have said nothing yet hold both slots.
    let grpc = app.grpc.trim_start_matches("http://").to_string();
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(TcpStream::connect(&grpc).await.unwrap());
    }
    let mut third = TcpStream::connect(&grpc).await.unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the third gRPC connection was kept open");
    assert!(
        rest.is_empty(),
        "a refused gRPC connection got {} bytes",
        rest.len()
    );
    drop(idle.pop());
    let freed = Instant::now();
    loop {
        let channel = tonic::transport::Endpoint::from_shared(app.grpc.clone()).unwrap();
        let called = match channel.connect().await {
            Ok(c) => tonic_health::pb::health_client::HealthClient::new(c)
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await
                .is_ok(),
            Err(_) => false,
        };
        if called {
            break;
        }
        assert!(
            freed.elapsed() < Duration::from_secs(5),
            "the gRPC slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(idle);
    let metrics = app.metrics_text().await;
    for listener in ["http", "grpc"] {
        let line = format!("ragscope_connections_rejected_total{{listener=\"{listener}\"");
        assert!(metrics.contains(&line), "no {line} in:\n{metrics}");
    }
    app.stop().await;
}
