//! Failure snapshots on the real server and `ragscope replay` on the real model: an injected
//! mid-answer error leaves a snapshot (listed, served, named on its span) that replays
//! identically, also the four of an `n: 4` completion whose choices decode side by side (how
//! many steps were batched depends on timing: the test prints the largest batch; each choice
//! fails at its 5th piece, which all four reach with this seed before an end token); a perturbed
//! embedding row makes replay name the first position that reads it; the directory's bound
//! evicts the oldest.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::{models_dir, spawn_app_with, TestApp};

const PLAIN: &str = "SmolLM2-135M-Instruct-plain";

/// A completion whose every choice fails with an injected error at its `at`th piece (the
/// response is the first failure; the other choices run on and fail after it). The prompt is a
/// count, which no sampled choice ends before its `at`th piece whatever the prefill's
/// arithmetic (a question's answer could, and then nothing fails).
async fn failing_completion(app: &TestApp, n: usize, at: usize) {
    let r = app
        .client
        .post(app.url("/v1/completions"))
        .header(
            "x-ragscope-fault",
            json!({"chat": {"error_after_tokens": at}}).to_string(),
        )
        .json(&json!({
            "model": PLAIN,
            "prompt": "Counting: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
            "max_tokens": 16, "n": n, "temperature": 0.8, "seed": 7,
        }))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 500, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("fault injected into the chat stage"),
        "{body}"
    );
}

/// The listed snapshot ids, oldest first, once there are `want` (bounded wait: the writer
/// works off the request path).
async fn snapshot_ids(app: &TestApp, want: usize) -> Vec<String> {
    let mut listed = Value::Null;
    for _ in 0..100 {
        let (status, body) = app.get("/debug/snapshots").await;
        assert_eq!(status, 200, "{body}");
        listed = body;
        let ids: Vec<String> = listed["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect();
        if ids.len() >= want {
            return ids;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fewer than {want} snapshots listed: {listed}");
}

/// Downloads a snapshot into `dir` and returns its path and content.
async fn fetch(app: &TestApp, id: &str, dir: &Path) -> (PathBuf, Value) {
    let (status, snapshot) = app.get(&format!("/debug/snapshots/{id}")).await;
    assert_eq!(status, 200, "{snapshot}");
    let path = dir.join(format!("{id}.json"));
    std::fs::write(&path, snapshot.to_string()).unwrap();
    (path, snapshot)
}

/// `ragscope replay` on `files`: exit code and standard output.
fn replay(files: &[&Path], extra: &[String]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ragscope"))
        .arg("replay")
        .args(files)
        .arg("--models-dir")
        .arg(models_dir())
        .args(extra)
        .output()
        .expect("run ragscope replay");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_generation_is_snapshotted_replayed_and_bounded() {
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    opentelemetry::global::set_tracer_provider(telemetry::tracer_provider(
        exporter,
        telemetry::resource(),
    ));
    let app = spawn_app_with(&[
        "--faults",
        "true",
        "--fault-header",
        "true",
        "--snapshot-max-count",
        "5",
    ])
    .await;
    let tmp = tempfile::tempdir().unwrap();

    // One failure: listed, served, and named on the failing chat span.
    failing_completion(&app, 1, 5).await;
    let ids = snapshot_ids(&app, 1).await;
    let (first, snap) = fetch(&app, &ids[0], tmp.path()).await;
    assert_eq!(snap["reason"], "injected_error");
    assert!(snap["generated"].as_array().unwrap().len() >= 5, "{snap}");
    let kv_len = snap["kv"]["len"].as_u64().unwrap() as usize;
    let prompt: Vec<u64> = snap["prompt"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(
        kv_len,
        prompt.len() + snap["generated"].as_array().unwrap().len() - 1
    );
    assert_eq!(snap["kv"]["positions"].as_array().unwrap().len(), kv_len);
    assert_eq!(snap["model"]["weights_sha256"].as_str().unwrap().len(), 64);
    let (_, traces) = app.get("/debug/traces?limit=1").await;
    let spans = traces["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .unwrap()
        .clone();
    let chat = spans
        .iter()
        .find(|s| s["name"].as_str().unwrap().starts_with("chat "))
        .expect("a chat span");
    assert!(
        chat["attributes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| { a["key"] == "rag.snapshot.id" && a["value"]["stringValue"] == snap["id"] }),
        "{chat}"
    );
    assert!(
        chat["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "snapshot"),
        "{chat}"
    );
    let (status, missing) = app.get("/debug/snapshots/0000000000000-000000-0000").await;
    assert_eq!(status, 404, "{missing}");
    let (status, bad) = app.get("/debug/snapshots/..%2Fetc").await;
    assert_eq!((status, bad["error"]["param"].as_str()), (400, Some("id")));

    // Four choices decode side by side and fail; each replays alone.
    failing_completion(&app, 4, 5).await;
    let ids = snapshot_ids(&app, 5).await;
    let mut files = vec![first.clone()];
    let mut batched = 0;
    for id in &ids[1..] {
        let (path, s) = fetch(&app, id, tmp.path()).await;
        let sizes = s["decode_batch_sizes"].as_array().unwrap();
        batched = batched.max(sizes.iter().map(|b| b.as_u64().unwrap()).max().unwrap_or(0));
        files.push(path);
    }
    eprintln!("largest decode batch among the four: {batched}");
    let paths: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let (code, out) = replay(&paths, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.matches(": identical: ").count(), 5, "{out}");

    // A changed embedding row: positions before its token's first use agree, that one not.
    let token = prompt[6];
    let at = prompt.iter().position(|&t| t == token).unwrap();
    let width = snap["model"]["embedding_length"].as_u64().unwrap();
    let perturb = format!("token_embd.weight:{}:0.5", token * width + 1);
    let (code, out) = replay(&[&first], &["--perturb-weight".into(), perturb]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "diverged at position {at} (prompt token {at}, id {token}): layer 0 KV digest"
        )),
        "{out}"
    );
    let (code, out) = replay(&[&tmp.path().join("none.json")], &[]);
    assert_eq!(code, 2, "{out}");

    // A sixth snapshot evicts the oldest.
    failing_completion(&app, 1, 2).await;
    let mut now = snapshot_ids(&app, 5).await;
    for _ in 0..100 {
        if now.len() == 5 && now[0] != ids[0] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        now = snapshot_ids(&app, 5).await;
    }
    assert_eq!(now.len(), 5, "{now:?}");
    assert_eq!(now[..4], ids[1..], "the oldest went first");
    let (status, _) = app.get(&format!("/debug/snapshots/{}", ids[0])).await;
    assert_eq!(status, 404);
    app.stop().await;
}
