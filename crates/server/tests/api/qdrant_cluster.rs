//! The cluster fault run's short form: `scripts/qdrant-faults` starts a real 3-peer Qdrant
//! cluster (`../shared/qdrant`) and two real ragscope replicas on it, SIGKILLs and restarts a
//! peer, then hangs another past the call timeout, under a mixed load through both replicas;
//! no invariant may break (no acknowledged write lost, only 200s or clear 503s, counts that
//! converge, every replica reading what Qdrant stores).

use std::process::Command;

use serde_json::Value;

use crate::crash::python;
use crate::helpers::{models_dir, repo_dir};
use crate::qdrant_server::{qdrant_available, qdrant_dir};

#[test]
fn a_killed_and_a_hung_peer_lose_no_acknowledged_write() {
    if !qdrant_available("a_killed_and_a_hung_peer_lose_no_acknowledged_write") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let summary = dir.path().join("summary.json");
    let output = Command::new(python())
        .arg(repo_dir().join("scripts/qdrant-faults"))
        .args(["--binary", env!("CARGO_BIN_EXE_ragscope")])
        .arg("--qdrant-dir")
        .arg(qdrant_dir())
        .args(["--phase-s", "4", "--hang-s", "4", "--timeout-ms", "2000"])
        .arg("--json")
        .arg(&summary)
        .env("RAGSCOPE_MODELS_DIR", models_dir())
        .output()
        .expect("python3 runs scripts/qdrant-faults");
    let log = String::from_utf8_lossy(&output.stderr);
    let text = std::fs::read_to_string(&summary)
        .unwrap_or_else(|_| panic!("no summary ({}): {log}", output.status));
    let summary: Value = serde_json::from_str(&text).unwrap();
    eprintln!("{text}");
    assert_eq!(summary["violations"], Value::Array(vec![]), "{log}");
    assert_eq!(summary["losses"], 0);
    assert!(output.status.success(), "{log}");
    assert!(!summary["converge_s"].is_null(), "{summary}");
    let counts = &summary["counts"];
    // Both replicas acknowledged writes, and every phase was under load.
    for key in ["acked_on_A", "acked_on_B", "acked_ingests", "queries"] {
        assert!(counts[key].as_u64().unwrap_or(0) > 0, "{key}: {counts}");
    }
    for phase in ["before", "killed", "restarted", "hung", "after"] {
        let requests = summary["phases"][phase]["requests"].as_u64().unwrap_or(0);
        assert!(requests > 0, "no request in phase {phase}: {summary}");
    }
}
