//! End to end against a third-party receiver: the release server binary exports over OTLP gRPC
//! and HTTP to `rotel` (a Rust OpenTelemetry collector, installed from PyPI by scripts/test) on
//! 127.0.0.1, and we read back what rotel printed it received.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

/// Kills a child process when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `ROTEL_AGENT`, or rotel in the venv scripts/test makes, or on PATH.
fn rotel_agent() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ROTEL_AGENT") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    let venv = home.join(".cache/ragscope/venv/lib");
    let found = std::fs::read_dir(&venv)
        .ok()?
        .filter_map(|e| e.ok())
        .find_map(|e| {
            let p = e.path().join("site-packages/rotel/rotel-agent");
            p.exists().then_some(p)
        });
    found.or_else(|| {
        Command::new("rotel-agent").arg("--version").output().ok()?;
        Some(PathBuf::from("rotel-agent"))
    })
}

#[derive(Debug, Default, Clone)]
struct RotelSpan {
    trace: String,
    parent: String,
    id: String,
    name: String,
    start: u128,
    end: u128,
}

/// Parses rotel's detailed debug log of spans.
fn parse_spans(log: &str) -> Vec<RotelSpan> {
    let mut spans = Vec::new();
    let mut current: Option<RotelSpan> = None;
    for line in log.lines() {
        let line = line.trim();
        if line.starts_with("Span #") {
            spans.extend(current.take());
            current = Some(RotelSpan::default());
            continue;
        }
        let Some(span) = current.as_mut() else {
            continue;
        };
        let value = |l: &str| {
            l.split_once(':')
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        if line.starts_with("Trace ID") {
            span.trace = value(line);
        } else if line.starts_with("Parent ID") {
            span.parent = value(line);
        } else if line.starts_with("ID ") {
            span.id = value(line);
        } else if line.starts_with("Name ") {
            span.name = value(line);
        } else if line.starts_with("Start time:") {
            span.start = value(line).parse().unwrap_or(0);
        } else if line.starts_with("End time:") {
            span.end = value(line).parse().unwrap_or(0);
        } else if line.starts_with("ResourceSpans") || line.starts_with("ResourceMetrics") {
            spans.extend(current.take());
        }
    }
    spans.extend(current);
    spans
}

async fn exports_to_rotel(protocol: &str) {
    let Some(agent) = rotel_agent() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_ROTEL").is_none(),
            "rotel-agent not found, and scripts/test requires it"
        );
        println!("SKIPPED: rotel-agent not installed (scripts/test installs it)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (grpc, http, api) = (free_port(), free_port(), free_port());
    let log_path = tmp.path().join("rotel.log");
    let _rotel = Running(
        Command::new(&agent)
            .args([
                "start",
                "--otlp-grpc-endpoint",
                &format!("127.0.0.1:{grpc}"),
            ])
            .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http}")])
            .args([
                "--exporter",
                "blackhole",
                "--debug-log",
                "traces",
                "--debug-log-verbosity",
                "detailed",
            ])
            .stdout(std::fs::File::create(&log_path).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting rotel-agent"),
    );
    let endpoint = match protocol {
        "grpc" => format!("http://127.0.0.1:{grpc}"),
        _ => format!("http://127.0.0.1:{http}"),
    };
    let models = crate::helpers::models_dir();
    let _server = Running(
        Command::new(env!("CARGO_BIN_EXE_ragscope"))
            .args(["serve", "--corpus", "none", "--fetch-models", "false"])
            .args([
                "--listen",
                &format!("127.0.0.1:{api}"),
                "--grpc-listen",
                "off",
            ])
            .arg("--data-dir")
            .arg(tmp.path().join("data"))
            .arg("--models-dir")
            .arg(models)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
            .env("OTEL_SERVICE_NAME", "ragscope-e2e")
            .env("OTEL_BSP_SCHEDULE_DELAY", "200")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the server"),
    );
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{api}");
    let started = Instant::now();
    while client
        .get(format!("{base}/ready"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .ok()
        != Some(200)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "server not ready"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = client
        .post(format!("{base}/v1/documents"))
        .json(&json!({"documents": [{"id": "zorbia", "text": "The capital of Zorbia is Quenta."}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let r = client
        .post(format!("{base}/v1/rag/query"))
        .header("traceparent", format!("00-{trace_id}-b7ad6b7169203331-01"))
        .json(&json!({"query": "What is the capital of Zorbia?", "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let want = [
        "POST /v1/rag/query",
        "queue",
        "embeddings all-MiniLM-L6-v2",
        "retrieval ragscope",
        "rerank rrf-dense-bm25",
        "prompt",
        "chat SmolLM2-135M-Instruct",
        "prefill",
        "decode",
        "respond",
    ];
    let mut spans = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        spans = parse_spans(&log)
            .into_iter()
            .filter(|s| s.trace == trace_id)
            .collect();
        if want.iter().all(|w| spans.iter().any(|s| s.name == *w)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    for w in want {
        assert!(
            names.contains(&w),
            "rotel did not receive {w} over {protocol}: {names:?}"
        );
    }
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        log.contains("service.name: Str(ragscope-e2e)"),
        "OTEL_SERVICE_NAME not on the resource"
    );
    let by_id: HashMap<&str, &RotelSpan> = spans.iter().map(|s| (s.id.as_str(), s)).collect();
    let root = spans
        .iter()
        .find(|s| s.name == "POST /v1/rag/query")
        .unwrap();
    assert_eq!(root.parent, "b7ad6b7169203331");
    for s in &spans {
        if let Some(p) = by_id.get(s.parent.as_str()) {
            assert!(
                s.start >= p.start && s.end <= p.end,
                "{} escapes {}",
                s.name,
                p.name
            );
        } else {
            assert_eq!(s.id, root.id, "{} has no parent in the trace", s.name);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_binary_exports_to_rotel_over_grpc() {
    exports_to_rotel("grpc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_binary_exports_to_rotel_over_http() {
    exports_to_rotel("http/protobuf").await;
}
