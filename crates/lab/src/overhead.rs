//! `ragscope-lab overhead`: the same load against three `ragscope serve` processes that
//! differ only in telemetry: off, spans + metrics exported over OTLP, and spans + metrics +
//! CPU profiling at 100 Hz. Rounds are interleaved (A B C A B C …) so drift on the box hits
//! every variant alike; exports go to a local sink that accepts and discards them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::json;
use tokio::net::TcpListener;

use crate::{percentile, Setup};

struct Variant {
    name: &'static str,
    env: Vec<(&'static str, String)>,
}

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Accepts OTLP/HTTP and Pyroscope pushes and throws them away.
async fn sink() -> Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = axum::Router::new().fallback(|| async { Vec::<u8>::new() });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn start(variant: &Variant, binary: &Path, args: &Setup, data: &Path) -> Result<Server> {
    let port = free_port()?;
    let mut cmd = Command::new(binary);
    cmd.args([
        "serve",
        "--corpus",
        "none",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--grpc-listen",
        "off",
    ])
    .arg("--data-dir")
    .arg(data.join(variant.name.replace(['+', ' '], "_")))
    .arg("--models-dir")
    .arg(&args.load.models.models_dir)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    for key in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "RAGSCOPE_PYROSCOPE_URL",
        "PYROSCOPE_SERVER_ADDRESS",
    ] {
        cmd.env_remove(key);
    }
    cmd.envs(variant.env.iter().map(|(k, v)| (k, v)));
    let server = Server {
        child: cmd.spawn().context("starting a server")?,
        base: format!("http://127.0.0.1:{port}"),
    };
    let client = reqwest::Client::new();
    let started = Instant::now();
    loop {
        if let Ok(r) = client.get(format!("{}/ready", server.base)).send().await {
            if r.status().is_success() {
                break;
            }
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!("{} did not become ready", variant.name);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let docs = json!({"documents": [
        {"id": "stash", "text": "git stash saves local modifications away and reverts the working directory to match HEAD. git stash pop applies the most recent stash and removes it from the list."},
        {"id": "clone", "text": "git clone --depth 1 creates a shallow clone with a history truncated to the last commit."},
        {"id": "amend", "text": "git commit --amend replaces the tip of the current branch with a new commit."}
    ]});
    let r = client
        .post(format!("{}/v1/documents", server.base))
        .json(&docs)
        .send()
        .await?;
    if !r.status().is_success() {
        bail!("ingest failed: {}", r.status());
    }
    Ok(server)
}

const QUESTIONS: [&str; 4] = [
    "What does git stash pop do?",
    "How do I make a shallow clone?",
    "How do I change the last commit?",
    "How do I save my local changes away?",
];

/// Sends `n` requests, `concurrency` at a time; returns per-request latencies and wall time.
async fn drive(base: &str, n: usize, concurrency: usize) -> Result<(Vec<Duration>, Duration)> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let results: Vec<Result<Duration>> = futures::stream::iter(0..n)
        .map(|i| {
            let client = client.clone();
            let url = format!("{base}/v1/rag/query");
            async move {
                let t = Instant::now();
                let body = json!({"query": QUESTIONS[i % QUESTIONS.len()], "max_tokens": 32});
                let r = client.post(url).json(&body).send().await?;
                if !r.status().is_success() {
                    bail!("request failed: {}", r.status());
                }
                r.bytes().await?;
                Ok(t.elapsed())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let latencies = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((latencies, started.elapsed()))
}

/// `requests` per variant per round, `concurrency` in flight, against `binary` (default: the
/// `ragscope` beside this binary).
pub async fn run(
    args: &Setup,
    requests: usize,
    concurrency: usize,
    binary: Option<PathBuf>,
) -> Result<()> {
    let binary = match binary {
        Some(b) => b,
        None => std::env::current_exe()?.with_file_name("ragscope"),
    };
    if !binary.exists() {
        bail!(
            "no server binary at {} (build it: cargo build --release -p ragscope)",
            binary.display()
        );
    }
    let sink = sink().await?;
    let exported = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", sink.clone()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY", "1000".to_string()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "5000".to_string()),
    ];
    let mut profiled = exported.clone();
    profiled.push(("RAGSCOPE_PYROSCOPE_URL", sink.clone()));
    profiled.push(("RAGSCOPE_PYROSCOPE_SAMPLE_RATE", "100".to_string()));
    let variants = [
        Variant {
            name: "telemetry off",
            env: vec![("OTEL_SDK_DISABLED", "true".to_string())],
        },
        Variant {
            name: "spans + metrics",
            env: exported,
        },
        Variant {
            name: "spans + metrics + profiling",
            env: profiled,
        },
    ];
    let data = tempfile::tempdir()?;
    let mut servers = Vec::new();
    for v in &variants {
        servers.push(start(v, &binary, args, data.path()).await?);
    }
    // Warm-up: one pass each, not counted.
    for s in &servers {
        drive(&s.base, concurrency, concurrency).await?;
    }
    let mut latencies: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
    let mut throughput: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..args.rounds.max(1) {
        for (i, s) in servers.iter().enumerate() {
            let (mut l, wall) = drive(&s.base, requests, concurrency).await?;
            throughput[i].push(l.len() as f64 / wall.as_secs_f64());
            latencies[i].append(&mut l);
        }
        eprintln!(
            "telemetry overhead: round {}/{} done",
            round + 1,
            args.rounds.max(1)
        );
    }
    println!(
        "telemetry overhead: {} rounds x {} requests per variant, concurrency {}, max_tokens 32",
        args.rounds.max(1),
        requests,
        concurrency
    );
    println!(
        "{:<30} {:>10} {:>10} {:>10} {:>10}",
        "variant", "req/s", "vs off", "p50 ms", "p99 ms"
    );
    let median = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    let base = median(&mut throughput[0].clone());
    for (i, v) in variants.iter().enumerate() {
        let rps = median(&mut throughput[i]);
        println!(
            "{:<30} {:>10.3} {:>9.1}% {:>10.0} {:>10.0}",
            v.name,
            rps,
            (rps / base - 1.0) * 100.0,
            percentile(&mut latencies[i], 50.0),
            percentile(&mut latencies[i], 99.0)
        );
    }
    Ok(())
}
