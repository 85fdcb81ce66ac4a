//! `/metrics` after real traffic: the server's metric names are there, and Prometheus's own
//! `promtool check metrics` accepts the exposition (scripts/test unpacks promtool).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::json;

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
