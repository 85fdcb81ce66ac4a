//! Overload and shutdown. A burst far above capacity against stand-in stages with a fixed
//! service time (so the bound is known): admitted requests wait about the configured maximum
//! at most, the rest are refused at once with 429 and `Retry-After` (gRPC `RESOURCE_EXHAUSTED`
//! with `retry-after`), and nothing else goes wrong. Then the real binary as a child process:
//! SIGTERM while a stream is open lets the stream finish, refuses new requests with 503 and
//! exits 0 within the grace period.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ragscope::api::grpc::proto::QueryRequest;
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{fake_pipeline, models_dir, serve_state};

/// The stand-in generator's time per request: 20 tokens × 10 ms.
const SERVICE: Duration = Duration::from_millis(200);
const MAX_WAIT: Duration = Duration::from_millis(500);

struct Outcome {
    status: u16,
    took: Duration,
    retry_after: Option<u64>,
    body: Value,
}

async fn ask(client: &reqwest::Client, url: &str) -> Outcome {
    let started = Instant::now();
    let r = client
        .post(url)
        .json(&json!({"query": "What is the capital of Zorbia?", "max_tokens": 20}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body = r.json().await.unwrap_or(Value::Null);
    Outcome {
        status,
        took: started.elapsed(),
        retry_after,
        body,
    }
}

#[tokio::test]
async fn a_burst_far_above_capacity_is_refused_fast_and_the_admitted_wait_within_the_limit() {
    // `/metrics` needs a meter provider (the helpers' apps install one the same way).
    if let Some(provider) = telemetry::metrics::ensure_provider() {
        std::mem::forget(provider);
    }
    let mut pipeline = fake_pipeline(FakeGenerator {
        tokens: 20,
        token_us: 10_000,
    });
    pipeline.workers = rag::worker::Workers::new(1, 64).with_max_wait(MAX_WAIT, 0.0);
    let state = ragscope::app::ready_state(pipeline, Duration::from_secs(30));
    let app = serve_state(state, 1 << 20, None).await;
    let url = app.url("/v1/rag/query");
    // Teach the service-time estimate.
    for _ in 0..3 {
        let o = ask(&app.client, &url).await;
        assert_eq!(o.status, 200, "{}", o.body);
    }
    // Connected beforehand, so the calls arrive with the burst.
    let mut grpc_clients = Vec::new();
    for _ in 0..6 {
        grpc_clients.push(app.rag_client().await);
    }
    // 60 requests at once: 5 per second fit; about three are within 500 ms of waiting.
    let http: Vec<_> = (0..60)
        .map(|_| {
            let (client, url) = (app.client.clone(), url.clone());
            tokio::spawn(async move { ask(&client, &url).await })
        })
        .collect();
    let grpc: Vec<_> = grpc_clients
        .into_iter()
        .map(|mut client| {
            tokio::spawn(async move {
                let asked = QueryRequest {
                    query: "What is the capital of Zorbia?".into(),
                    max_tokens: Some(20),
                    ..Default::default()
                };
                match client.query(asked).await {
                    Ok(stream) => {
                        let mut s = stream.into_inner();
                        while s.message().await.unwrap().is_some() {}
                        Ok(())
                    }
                    Err(status) => Err(status),
                }
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for h in http {
        outcomes.push(h.await.unwrap());
    }
    let (admitted, refused): (Vec<&Outcome>, Vec<&Outcome>) =
        outcomes.iter().partition(|o| o.status == 200);
    for o in &refused {
        assert_eq!(o.status, 429, "only 200 or 429: {}", o.body);
        assert_eq!(o.body["error"]["type"], "rate_limit_error", "{}", o.body);
        let code = o.body["error"]["code"].as_str().unwrap();
        assert!(code == "queue_wait" || code == "queue_full", "{}", o.body);
        assert!(o.retry_after.is_some_and(|s| s >= 1), "{}", o.body);
    }
    assert!(admitted.len() >= 2, "{} admitted", admitted.len());
    assert!(refused.len() >= 40, "{} refused", refused.len());
    // Admitted: the wait allowed, its own service time, and slack for a shared machine.
    let bound = MAX_WAIT + SERVICE + Duration::from_millis(1500);
    let slowest = admitted.iter().map(|o| o.took).max().unwrap();
    assert!(slowest <= bound, "an admitted request took {slowest:?}");
    // Refused before any work: far quicker than one service time.
    let mut refused_took: Vec<Duration> = refused.iter().map(|o| o.took).collect();
    refused_took.sort();
    let median = refused_took[refused_took.len() / 2];
    assert!(median < SERVICE, "refusals took {median:?} at the median");

    let mut grpc_refused = 0;
    for h in grpc {
        if let Err(status) = h.await.unwrap() {
            assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
            assert!(status.message().contains("retry after"), "{status:?}");
            let retry_after = status.metadata().get("retry-after").unwrap();
            assert!(retry_after.to_str().unwrap().parse::<u64>().unwrap() >= 1);
            grpc_refused += 1;
        }
    }
    let (_, ready) = app.get("/ready").await;
    assert!(
        grpc_refused >= 1,
        "no gRPC call was refused ({} HTTP admitted, {} refused; {})",
        admitted.len(),
        refused.len(),
        ready["queue"]
    );
    let metrics = app.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ragscope_admission_rejected_total{")
                && l.contains("reason=\"queue_wait\"")),
        "{metrics}"
    );
    // Once the queue has drained, requests are admitted again.
    tokio::time::sleep(MAX_WAIT + SERVICE).await;
    let o = ask(&app.client, &url).await;
    assert_eq!(o.status, 200, "{}", o.body);
    app.stop().await;
}

/// A `ragscope serve` child process on port 0 with the real models.
pub(crate) struct Child {
    process: std::process::Child,
    base: String,
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Child {
    pub(crate) fn spawn(data_dir: &std::path::Path, extra: &[&str]) -> Child {
        let mut process = Command::new(env!("CARGO_BIN_EXE_ragscope"))
            .args(["serve", "--corpus", "none", "--fetch-models", "false"])
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "off"])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--models-dir")
            .arg(models_dir())
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("OTEL_SDK_DISABLED", "false")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the ragscope binary starts");
        let stderr = process.stderr.take().unwrap();
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let log = log.clone();
            // Keeps reading, so the child never blocks on a full pipe.
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stderr)
                    .lines()
                    .map_while(Result::ok)
                {
                    if let Some(at) = line.find("listening on http://") {
                        let addr = line[at + "listening on ".len()..]
                            .split_whitespace()
                            .next()
                            .unwrap()
                            .to_string();
                        let _ = tx.send(addr);
                    }
                    log.lock().unwrap().push(line);
                }
            });
        }
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server logs its address");
        Child { process, base, log }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

#[tokio::test]
async fn sigterm_finishes_the_open_stream_refuses_new_requests_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Child::spawn(
        dir.path(),
        &[
            "--faults",
            "true",
            "--fault-header",
            "true",
            "--shutdown-grace-s",
            "30",
        ],
    );
    let client = reqwest::Client::new();
    let started = Instant::now();
    loop {
        let r = client.get(child.url("/ready")).send().await;
        if r.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "not ready:\n{}",
            child.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = client
        .post(child.url("/v1/documents"))
        .json(&json!({"documents": [{"id": "z", "text": "The capital of Zorbia is Quenta."}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A stream held open for 2 s by an injected retrieval delay, then a short answer.
    let stream = client
        .post(child.url("/v1/rag/query"))
        .header("x-ragscope-fault", r#"{"retrieval": {"delay_ms": 2000}}"#)
        .json(&json!({"query": "What is the capital of Zorbia?", "max_tokens": 8, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let reading = tokio::spawn(async move { stream.text().await });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let pid = child.process.id() as libc::pid_t;
    let signalled = Instant::now();
    // SAFETY: signals the child this test started and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = client.get(child.url("/ready")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let ready: Value = r.json().await.unwrap();
    assert_eq!(ready["status"], "draining", "{ready}");
    assert_eq!(ready["in_flight"], 1, "{ready}");
    let r = client
        .post(child.url("/v1/rag/query"))
        .json(&json!({"query": "And its currency?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let refused: Value = r.json().await.unwrap();
    assert_eq!(refused["error"]["code"], "shutting_down", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{refused}"
    );
    let health = client.get(child.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200, "liveness stays up while draining");

    let body = reading.await.unwrap().expect("the stream completes");
    let events: Vec<String> = crate::query::sse_events(&body)
        .into_iter()
        .map(|(event, _)| event)
        .collect();
    assert_eq!(
        events.first().map(String::as_str),
        Some("sources"),
        "{body}"
    );
    assert_eq!(events.last().map(String::as_str), Some("done"), "{body}");
    let status = loop {
        if let Some(status) = child.process.try_wait().unwrap() {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(30),
            "still running after the grace period:\n{}",
            child.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}\n{}", child.log());
    // Drained, it exits at once rather than at the end of the grace period.
    assert!(
        signalled.elapsed() < Duration::from_secs(15),
        "exited {:?} after SIGTERM",
        signalled.elapsed()
    );
}

#[tokio::test]
async fn a_client_that_stops_reading_a_stream_does_not_hold_the_worker() {
    let mut pipeline = fake_pipeline(FakeGenerator {
        tokens: 400,
        token_us: 1000,
    });
    pipeline.workers = rag::worker::Workers::new(1, 4);
    let app = serve_state(
        ragscope::app::ready_state(pipeline, Duration::from_secs(30)),
        1 << 20,
        None,
    )
    .await;
    // Opened, then never read: its 400 events (a few dozen bytes each) fit the socket buffers,
    // so generation runs to its end instead of waiting on the reader.
    let stalled = app
        .client
        .post(app.url("/v1/rag/query"))
        .json(&json!({"query": "Zorbia?", "max_tokens": 400, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(stalled.status(), 200);
    let started = Instant::now();
    let o = ask(&app.client, &app.url("/v1/rag/query")).await;
    assert_eq!(o.status, 200, "{}", o.body);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the next request waited {:?} behind a stalled reader",
        started.elapsed()
    );
    drop(stalled);
    app.stop().await;
}
