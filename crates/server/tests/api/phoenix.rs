//! The server exporting to a real Arize Phoenix (`scripts/phoenix-check`, in a network
//! namespace of its own): Phoenix must show each question as a CHAIN with EMBEDDING,
//! RETRIEVER (document ids and scores), RERANKER and LLM children, count exactly the requests
//! sent as the project's traces, and keep the batched decode steps in a project of their own.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::crash::python;
use crate::helpers::{models_dir, repo_dir};

fn phoenix_venv(test: &str) -> Option<PathBuf> {
    let venv = std::env::var_os("RAGSCOPE_PHOENIX_VENV").map(PathBuf::from);
    if let Some(v) = venv.filter(|v| v.join("bin/phoenix").exists()) {
        return Some(v);
    }
    assert!(
        std::env::var_os("RAGSCOPE_REQUIRE_PHOENIX").is_none(),
        "{test}: RAGSCOPE_REQUIRE_PHOENIX is set, but RAGSCOPE_PHOENIX_VENV holds no Phoenix"
    );
    eprintln!("{test}: SKIPPED, no Phoenix (RAGSCOPE_PHOENIX_VENV; scripts/test installs one)");
    None
}

#[test]
fn phoenix_shows_a_question_as_a_rag_chain_and_counts_only_requests() {
    let Some(venv) =
        phoenix_venv("phoenix_shows_a_question_as_a_rag_chain_and_counts_only_requests")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let summary = dir.path().join("summary.json");
    let output = Command::new(python())
        .arg(repo_dir().join("scripts/phoenix-check"))
        .args(["--binary", env!("CARGO_BIN_EXE_ragscope")])
        .arg("--venv")
        .arg(&venv)
        .args(["--questions", "2"])
        .arg("--json")
        .arg(&summary)
        .env("RAGSCOPE_MODELS_DIR", models_dir())
        .output()
        .expect("python3 runs scripts/phoenix-check");
    let log = String::from_utf8_lossy(&output.stderr);
    let text = std::fs::read_to_string(&summary)
        .unwrap_or_else(|_| panic!("no summary ({}): {log}", output.status));
    let summary: Value = serde_json::from_str(&text).unwrap();
    eprintln!("{text}");
    assert_eq!(summary["failures"], Value::Array(vec![]), "{log}");
    assert!(output.status.success(), "{log}");
    // One ingest and two questions: three traces, the requests' own.
    assert_eq!(summary["requests_sent"], 3);
    assert_eq!(summary["project"]["traceCount"], 3);
    for q in summary["questions"].as_array().unwrap() {
        let children: Vec<&str> = q["children"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for kind in ["(EMBEDDING)", "(RETRIEVER)", "(RERANKER)", "(LLM)"] {
            assert!(children.iter().any(|c| c.ends_with(kind)), "{children:?}");
        }
        assert!(!q["retrieved"].as_array().unwrap().is_empty(), "{q}");
    }
    // The decode steps were traced (every step, for this run) but not among the requests.
    assert!(summary["steps"].as_u64().unwrap() > 0, "{summary}");
}
