//! The crash loop's short form: `scripts/crash-loop` drives the real binary through five
//! SIGKILL cycles (ingest, replace, re-send, delete and query over HTTP, and gRPC where the
//! client venv has grpcio) and checks the invariants after each; none may break.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::helpers::{models_dir, repo_dir};

/// The Python with grpcio that `scripts/test` sets up, else the system's (HTTP clients only).
pub fn python() -> PathBuf {
    let cache = std::env::var_os("RAGSCOPE_CACHE").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ragscope"),
        PathBuf::from,
    );
    let venv = cache.join("venv/bin/python3");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

#[test]
fn five_sigkills_lose_no_acknowledged_write() {
    let dir = tempfile::tempdir().unwrap();
    let summary = dir.path().join("summary.json");
    let output = Command::new(python())
        .arg(repo_dir().join("scripts/crash-loop"))
        .args(["--binary", env!("CARGO_BIN_EXE_ragscope"), "--cycles", "5"])
        .args(["--min-run", "0.5", "--max-run", "2"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--json")
        .arg(&summary)
        .env("RAGSCOPE_MODELS_DIR", models_dir())
        .output()
        .expect("python3 runs scripts/crash-loop");
    let log = String::from_utf8_lossy(&output.stderr);
    let text = std::fs::read_to_string(&summary)
        .unwrap_or_else(|_| panic!("no summary ({}): {log}", output.status));
    let summary: Value = serde_json::from_str(&text).unwrap();
    eprintln!("{}", String::from_utf8_lossy(&output.stdout));
    assert_eq!(summary["violations"], Value::Array(vec![]), "{log}");
    assert_eq!(summary["losses"], 0);
    assert_eq!(summary["cycles"], 5);
    assert!(output.status.success(), "{log}");
    // The loop really wrote, and the kills really cut writes short now and then is not
    // guaranteed in five cycles; what must hold is that writes were acknowledged and read back.
    assert!(
        summary["acknowledged_writes"].as_u64().unwrap() > 0,
        "{summary}"
    );
    assert!(
        summary["acknowledged"]["acked_creates"].as_u64().unwrap() > 0,
        "{summary}"
    );
    assert_eq!(
        summary["restart_s"]["n"], 5,
        "every cycle's restart was timed"
    );
}
