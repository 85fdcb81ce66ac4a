//! `/metrics` after real traffic: the server's metric names are there, and Prometheus's own
//! `promtool check metrics` accepts the exposition (scripts/test unpacks promtool).

use std::io::Write;
use std::net::TcpListener as StdListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::spawn_app;

pub(crate) fn promtool() -> Option<PathBuf> {
    prometheus_tool("promtool", "PROMTOOL")
}

/// The Prometheus server from the same package.
pub(crate) fn prometheus() -> Option<PathBuf> {
    prometheus_tool("prometheus", "PROMETHEUS")
}

/// `$VAR`, else the binary `scripts/test` unpacked from Debian's package, else one on PATH.
fn prometheus_tool(name: &str, var: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    let home = PathBuf::from(std::env::var_os("HOME")?);
    let unpacked = home.join(".cache/ragscope/prometheus/usr/bin").join(name);
    if unpacked.exists() {
        return Some(unpacked);
    }
    Command::new(name).arg("--version").output().ok()?;
    Some(PathBuf::from(name))
}

#[tokio::test]
async fn metrics_after_traffic_pass_promtool() {
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    let (status, _) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "What is the capital of Zorbia?", "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, 200);
    let r = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = r.text().await.unwrap();
    for name in [
        "gen_ai_server_request_duration_seconds_bucket",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "ragscope_stage_duration_seconds_bucket{rag_stage=\"prefill\"",
        "ragscope_token_usage_total{gen_ai_token_type=\"output\"}",
        "ragscope_queue_depth",
        "ragscope_requests_in_flight",
        "ragscope_spans_dropped_total",
        "ragscope_build_info",
        "ragscope_kv_cache_bytes",
        "ragscope_kv_cache_tokens",
        "ragscope_cache_requests_total{cache=\"query_embedding\",result=\"miss\"}",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics:\n{text}");
    }
    let Some(promtool) = promtool() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_PROMTOOL").is_none(),
            "promtool not found"
        );
        println!("SKIPPED the promtool check: promtool not installed (scripts/test unpacks it)");
        return;
    };
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Prometheus scraping `targets` every second, stopped when dropped.
pub(crate) struct Prometheus {
    child: std::process::Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// `extra`: more flags, e.g. `--enable-feature=exemplar-storage`.
    pub async fn start(binary: &std::path::Path, targets: &[String], extra: &[&str]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: scraped\n    \
                 static_configs: [{{targets: [{}]}}]\n",
                targets.join(", ")
            ),
        )
        .unwrap();
        let port = StdListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("prometheus starts");
        let url = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = client.get(format!("{url}/-/ready")).send().await;
            if ready.is_ok_and(|r| r.status() == 200) {
                break;
            }
            assert!(Instant::now() < deadline, "prometheus not ready in 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Its scrape manager takes up new targets every 5 s: wait for the first scrape.
        loop {
            let up = client
                .get(format!("{url}/api/v1/query?query=up"))
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap();
            if up["data"]["result"][0]["value"][1] == "1" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus did not scrape in 30 s: {up}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Prometheus {
            child,
            url,
            _dir: dir,
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Exemplars end to end: a real Prometheus (Debian's, `--enable-feature=exemplar-storage`)
/// scrapes the server, which answers it in OpenMetrics; each request's trace id, sent by the
/// client as its `traceparent`, comes back from Prometheus' `/api/v1/query_exemplars` on the
/// request-duration and time-to-first-token buckets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_stores_each_requests_trace_as_an_exemplar() {
    let Some(binary) = prometheus() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_QDRANT").is_none(),
            "no prometheus binary (scripts/test unpacks Debian's)"
        );
        eprintln!("a_real_prometheus_stores_each_requests_trace: SKIPPED, no prometheus binary");
        return;
    };
    // Spans must exist for their ids to be exemplars: a provider, exporting nowhere.
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = telemetry::tracer_provider(exporter, telemetry::resource());
    opentelemetry::global::set_tracer_provider(provider);
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    // The plain format stays the default, without exemplars.
    let plain = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert!(plain.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let target = app.base.trim_start_matches("http://").to_string();
    let prometheus =
        Prometheus::start(&binary, &[target], &["--enable-feature=exemplar-storage"]).await;
    let client = reqwest::Client::new();
    for (i, question) in ["What is the capital of Zorbia?", "Who founded Zorbia?"]
        .iter()
        .enumerate()
    {
        let trace = format!("{:032x}", 0x5eed_0000_u128 + i as u128);
        let r = app
            .client
            .post(app.url("/v1/rag/query"))
            .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
            .json(&json!({"query": question, "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // The next scrapes carry it: wait until Prometheus has it on both histograms.
        let deadline = Instant::now() + Duration::from_secs(30);
        for series in [
            "gen_ai_server_request_duration_seconds_bucket",
            "gen_ai_server_time_to_first_token_seconds_bucket",
        ] {
            loop {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64();
                let found: Value = client
                    .get(format!("{}/api/v1/query_exemplars", prometheus.url))
                    .query(&[
                        ("query", series.to_string()),
                        ("start", format!("{}", now - 120.0)),
                        ("end", format!("{}", now + 5.0)),
                    ])
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                let traces: Vec<&str> = found["data"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|s| s["exemplars"].as_array().into_iter().flatten())
                    .filter_map(|e| e["labels"]["trace_id"].as_str())
                    .collect();
                if traces.contains(&trace.as_str()) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{series}: Prometheus has no exemplar of trace {trace} in 30 s: {found}"
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
}

/// `--metrics-compat vllm`: every vLLM family its dashboards read, queried the way they query
/// it, returns series from a real Prometheus scraping the real server
/// (`scripts/vllm-dashboard-check`; vLLM's own dashboards are checked with the same script
/// from vLLM's repository, docs/TELEMETRY.md).
#[test]
fn vllm_named_series_answer_their_dashboards_queries() {
    let Some(prometheus) = prometheus() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_QDRANT").is_none(),
            "no prometheus binary (scripts/test unpacks Debian's)"
        );
        eprintln!("vllm_named_series: SKIPPED, no prometheus binary");
        return;
    };
    let m = "{model_name=\"$model_name\"}";
    let mut queries = String::new();
    for h in [
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "iteration_tokens_total",
    ] {
        queries += &format!(
            "histogram_quantile(0.9, sum by(le) (rate(vllm:{h}_bucket{m}[$__rate_interval])))\n\
             rate(vllm:{h}_sum{m}[$__rate_interval]) / rate(vllm:{h}_count{m}[$__rate_interval])\n"
        );
    }
    for c in [
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ] {
        queries += &format!("rate(vllm:{c}{m}[$__rate_interval])\n");
    }
    queries += &format!(
        "sum by(finished_reason) (increase(vllm:request_success_total{m}[$__rate_interval]))\n\
         vllm:num_requests_running{m}\nvllm:num_requests_waiting{m}\nvllm:kv_cache_usage_perc{m}\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("queries.promql");
    std::fs::write(&file, &queries).unwrap();
    let summary = dir.path().join("summary.json");
    let output = Command::new(crate::crash::python())
        .arg(crate::helpers::repo_dir().join("scripts/vllm-dashboard-check"))
        .args(["--binary", env!("CARGO_BIN_EXE_ragscope")])
        .arg("--prometheus")
        .arg(&prometheus)
        .arg("--queries")
        .arg(&file)
        .arg("--json")
        .arg(&summary)
        .env("RAGSCOPE_MODELS_DIR", crate::helpers::models_dir())
        .output()
        .expect("python3 runs scripts/vllm-dashboard-check");
    let out = String::from_utf8_lossy(&output.stdout);
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{out}\n{log}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(summary["empty"], 0, "{out}");
    assert_eq!(summary["queries"], 30, "{out}");
    assert_eq!(summary["model_name"], "SmolLM2-135M-Instruct");
}
