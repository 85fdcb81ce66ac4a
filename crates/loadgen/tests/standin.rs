//! The load generator against a tiny in-process stand-in speaking ragscope's streaming protocols
//! (`/v1/rag/query` SSE and `/v1/chat/completions` chunks). The stand-in is deliberate: these tests
//! are about the load generator (counts, phases, traceparent, error kinds, outputs), not the server.
//! Its answers depend only on arrival order, so every count asserted here is exact.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use futures::StreamExt;
use ragscope_loadgen::cli::Cli;
use ragscope_loadgen::commands;
use ragscope_loadgen::record::{read_jsonl, RequestRecord};
use serde_json::{json, Value};

#[derive(Default)]
struct StandIn {
    arrived: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    traceparents: Mutex<Vec<String>>,
    bodies: Mutex<Vec<Value>>,
    /// From this arrival on, every request gets a 500 (for the knee finder).
    fail_from: Option<u64>,
    /// Arrival n gets 429 when n % 10 == 3, 500 when 7, a mid-stream `error` event when 5.
    mixed_errors: bool,
}

/// What arrival `n` gets.
enum Answer {
    Status(StatusCode),
    StreamError,
    Tokens,
}

impl StandIn {
    fn arrive(&self, headers: &HeaderMap, body: Value) -> Answer {
        let n = self.arrived.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            self.traceparents.lock().unwrap().push(tp.to_string());
        }
        self.bodies.lock().unwrap().push(body);
        if self.fail_from.is_some_and(|f| n >= f) {
            return Answer::Status(StatusCode::INTERNAL_SERVER_ERROR);
        }
        match (self.mixed_errors, n % 10) {
            (true, 3) => Answer::Status(StatusCode::TOO_MANY_REQUESTS),
            (true, 7) => Answer::Status(StatusCode::INTERNAL_SERVER_ERROR),
            (true, 5) => Answer::StreamError,
            _ => Answer::Tokens,
        }
    }
}

/// Yields `events` a millisecond apart, then marks the request finished.
fn paced(
    state: Arc<StandIn>,
    events: Vec<Event>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let n = events.len();
    Sse::new(
        futures::stream::iter(events.into_iter().enumerate()).then(move |(i, e)| {
            let state = Arc::clone(&state);
            async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                if i + 1 == n {
                    state.in_flight.fetch_sub(1, Ordering::SeqCst);
                }
                Ok(e)
            }
        }),
    )
}

fn refuse(state: &StandIn, status: StatusCode) -> Response {
    state.in_flight.fetch_sub(1, Ordering::SeqCst);
    let body = json!({"error": {"message": "stand-in refusal", "type": "server_error"}});
    (status, Json(body)).into_response()
}

async fn rag(
    State(s): State<Arc<StandIn>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let mut events = vec![Event::default().event("sources").data("[]")];
    match s.arrive(&headers, body) {
        Answer::Status(code) => return refuse(&s, code),
        Answer::StreamError => {
            events.push(Event::default().event("token").data(r#"{"text":"a"}"#));
            events.push(
                Event::default()
                    .event("error")
                    .data(r#"{"error":{"message":"the request timed out after 5 ms"}}"#),
            );
        }
        Answer::Tokens => {
            for t in ["Use", " git", " stash"] {
                events.push(
                    Event::default()
                        .event("token")
                        .data(json!({"text": t}).to_string()),
                );
            }
            let done = json!({
                "usage": {"prompt_tokens": 120, "completion_tokens": 3, "total_tokens": 123},
                "timings": {"queue_ms": 0.5, "embed_ms": 8.0, "retrieve_ms": 1.0, "rerank_ms": 0.0,
                            "prompt_ms": 0.2, "prefill_ms": 300.0, "decode_ms": 60.0,
                            "ttft_ms": 310.0, "total_ms": 370.0},
                "finish_reason": "stop"});
            events.push(Event::default().event("done").data(done.to_string()));
        }
    }
    paced(Arc::clone(&s), events).into_response()
}

async fn chat(
    State(s): State<Arc<StandIn>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    if let Answer::Status(code) = s.arrive(&headers, body) {
        return refuse(&s, code);
    }
    let chunk = |delta: Value, usage: Option<Value>| {
        let mut c = json!({"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
        if let Some(u) = usage {
            c["usage"] = u;
        }
        Event::default().data(c.to_string())
    };
    let events = vec![
        chunk(json!({"role": "assistant", "content": ""}), None),
        chunk(json!({"content": "Use"}), None),
        chunk(json!({"content": " pop"}), None),
        chunk(
            json!({}),
            Some(json!({"prompt_tokens": 50, "completion_tokens": 2})),
        ),
        Event::default().data("[DONE]"),
    ];
    paced(Arc::clone(&s), events).into_response()
}

async fn spawn_standin(state: StandIn) -> (String, Arc<StandIn>) {
    let state = Arc::new(state);
    let app = Router::new()
        .route("/v1/rag/query", post(rag))
        .route("/v1/chat/completions", post(chat))
        .with_state(Arc::clone(&state));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, state)
}

fn queries_path() -> String {
    // At run time first: the cached target dir is shared between checkouts.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(
            || env!("CARGO_MANIFEST_DIR").into(),
            std::path::PathBuf::from,
        )
        .join("../../eval/questions.jsonl")
        .to_string_lossy()
        .into_owned()
}

/// Runs the load generator; true for exit status 0.
async fn loadgen(args: &[&str]) -> bool {
    let mut argv = vec!["ragscope-loadgen"];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(argv).expect("valid flags");
    commands::dispatch(cli.command).await.expect("command runs") == 0
}

/// Validates a notebook against the nbformat 4 schema with Python's `nbformat` (scripts/test
/// installs it in a venv and sets RAGSCOPE_NOTEBOOK_PYTHON; required with RAGSCOPE_REQUIRE_NBFORMAT).
fn validate_notebook(path: &Path) {
    let python = std::env::var_os("RAGSCOPE_NOTEBOOK_PYTHON")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            let venv = std::path::PathBuf::from(std::env::var_os("HOME")?)
                .join(".cache/ragscope/venv-notebook/bin/python");
            venv.exists().then_some(venv)
        });
    let Some(python) = python else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_NBFORMAT").is_none(),
            "nbformat's Python not found (RAGSCOPE_NOTEBOOK_PYTHON)"
        );
        println!(
            "SKIPPED the notebook validation: no Python with nbformat (scripts/test installs it)"
        );
        return;
    };
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import sys, nbformat; nb = nbformat.read(sys.argv[1], as_version=4); nbformat.validate(nb); \
             print(len(nb.cells), sum(c.cell_type == 'code' for c in nb.cells))",
        ])
        .arg(path)
        .output()
        .expect("running Python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} is not a valid notebook: {stdout}{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let counts: Vec<usize> = stdout
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    assert!(
        counts.len() == 2 && counts[1] >= 6,
        "cells, code cells: {stdout}"
    );
}

fn summary(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn trace_id_of(traceparent: &str) -> String {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[3], "01", "sampled flag set");
    parts[1].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_counts_requests_errors_by_kind_and_traces() {
    let (url, standin) = spawn_standin(StandIn {
        mixed_errors: true,
        ..StandIn::default()
    })
    .await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("run");
    let q = queries_path();
    let ok = loadgen(&[
        "run",
        "--url",
        &url,
        "--queries",
        &q,
        "--out",
        dir.to_str().unwrap(),
        "--rate",
        "150",
        "--burst-rate",
        "5",
        "--burst-size",
        "4",
        "--duration",
        "60",
        "--requests",
        "40",
        "--seed",
        "11",
        "--max-tokens",
        "16",
        "--gradient",
        "rank",
        "--top-k",
        "4:20",
        "--rerank-top-n",
        "2:8",
        "--quiet",
    ])
    .await;
    assert!(ok);
    assert_eq!(standin.arrived.load(Ordering::SeqCst), 40);

    let records: Vec<RequestRecord> = read_jsonl(&dir.join("requests.jsonl")).unwrap();
    assert_eq!(records.len(), 40);
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    for r in &records {
        *kinds
            .entry(r.error.clone().unwrap_or("ok".into()))
            .or_default() += 1;
        assert_eq!(r.phase, ragscope_loadgen::schedule::Phase::Steady);
        if r.ok {
            assert_eq!(r.status, Some(200));
            assert_eq!(r.tokens, 3);
            let (ttft, e2e) = (r.ttft_ms.unwrap(), r.e2e_ms.unwrap());
            assert!(ttft <= e2e);
            assert!(r.tpot_ms.is_some());
            assert_eq!(r.server_timings.as_ref().unwrap()["prefill_ms"], 300.0);
        } else {
            assert!(r.e2e_ms.is_none());
        }
        // The gradient: rarer queries asked for more passages, never fewer than the popular ones.
        let (k, n) = (r.top_k.unwrap(), r.rerank_top_n.unwrap());
        assert!((4..=20).contains(&k) && (2..=8).contains(&n) && n <= k);
        if r.query_rank == 0 {
            assert_eq!((k, n), (4, 2));
        }
    }
    let expected: BTreeMap<String, u64> =
        [("ok", 28), ("http_429", 4), ("http_500", 4), ("stream", 4)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
    assert_eq!(kinds, expected);
    assert!(records
        .iter()
        .filter(|r| r.error.as_deref() == Some("http_429"))
        .all(|r| r.status == Some(429)));

    // Every request carried a sampled traceparent whose trace id is on its line.
    let sent: BTreeSet<String> = standin
        .traceparents
        .lock()
        .unwrap()
        .iter()
        .map(|tp| trace_id_of(tp))
        .collect();
    let recorded: BTreeSet<String> = records.iter().map(|r| r.trace_id.clone()).collect();
    assert_eq!(sent.len(), 40);
    assert_eq!(sent, recorded);

    // The bodies were streaming RAG queries with the requested context.
    for b in standin.bodies.lock().unwrap().iter() {
        assert_eq!(b["stream"], true);
        assert_eq!(b["max_tokens"], 16);
        assert!(b["query"].as_str().is_some_and(|q| !q.is_empty()));
    }

    let s = summary(&dir);
    let steady = &s["steady"];
    assert_eq!(steady["requests"], 40);
    assert_eq!(steady["ok"], 28);
    assert_eq!(steady["errors_by_kind"]["http_429"], 4);
    assert_eq!(steady["errors_by_kind"]["http_500"], 4);
    assert_eq!(steady["errors_by_kind"]["stream"], 4);
    assert!((steady["error_rate"].as_f64().unwrap() - 0.3).abs() < 1e-9);
    assert_eq!(steady["offered_rps"], 170.0);
    for key in ["p50", "p90", "p95", "p99", "p99.9"] {
        assert!(steady["ttft_ms"][key].as_f64().is_some(), "{key}");
        assert!(steady["tpot_ms"][key].as_f64().is_some(), "{key}");
        assert!(steady["e2e_ms"][key].as_f64().is_some(), "{key}");
    }
    assert_eq!(steady["server_stages_ms"]["decode_ms"]["p50"], 60.0);
    // Stopped by the request bound: the throughput window stays open until the last answer,
    // so every successful request is counted in it.
    let window = steady["achieved_window_s"].as_f64().unwrap();
    assert!(window > 0.0);
    assert_eq!(
        (steady["achieved_rps"].as_f64().unwrap() * window).round(),
        28.0
    );
    assert!(records.iter().all(|r| r.done_s >= r.sent_s));

    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(html.contains("Latency CDF"));
    assert!(html.contains("Latency by send time"));
    assert!(html.contains("Server stage time per request"));
    assert!(!html.contains("<script"));
    assert!(html.matches("<svg").count() >= 3);
    // Every percentile with its interval; 28 requests cannot support a P99.
    assert!(html.contains("95% bootstrap confidence intervals"));
    assert!(html.contains("p99 rests on"));
    assert!(html.contains("<h2>Isolation"));
    assert!(steady["ttft_ms"]["ci"]["p99"]["hi"].as_f64().is_some());
    validate_notebook(&dir.join("report.ipynb"));

    // `report --from` rebuilds the page, adding the attribution when given.
    let attribution = out.path().join("attribution.json");
    std::fs::write(
        &attribution,
        json!({"traces": 28, "end_to_end_ms": {"p50": 370, "p95": 380, "p99": 390},
            "stages": [{"stage": "chat", "count": 28, "self_ms": {"p50": 360, "p95": 370, "p99": 375},
                "inclusive_ms": {"p50": 360, "p95": 370, "p99": 375}, "share": 0.97, "critical_path_share": 0.97}],
            "residual_ms": {"p50": 1, "p95": 2, "p99": 3}})
        .to_string(),
    )
    .unwrap();
    std::fs::remove_file(dir.join("report.html")).unwrap();
    assert!(
        loadgen(&[
            "report",
            "--from",
            dir.to_str().unwrap(),
            "--attribution",
            attribution.to_str().unwrap(),
        ])
        .await
    );
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(html.contains("Self time per stage (attribution)"));
    assert!(html.contains("unattributed residual"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_split_by_schedule_and_only_steady_is_summarised() {
    let (url, _standin) = spawn_standin(StandIn::default()).await;
    let out = tempfile::tempdir().unwrap();
    let q = queries_path();
    let run = |seed: &'static str, dir: std::path::PathBuf| {
        let (url, q) = (url.clone(), q.clone());
        async move {
            loadgen(&[
                "run",
                "--url",
                &url,
                "--queries",
                &q,
                "--out",
                dir.to_str().unwrap(),
                "--rate",
                "60",
                "--warmup",
                "0.5",
                "--duration",
                "0.5",
                "--cooldown",
                "0.5",
                "--seed",
                seed,
                "--quiet",
            ])
            .await;
            read_jsonl(&dir.join("requests.jsonl")).unwrap()
        }
    };
    let a = run("5", out.path().join("a")).await;
    let b = run("5", out.path().join("b")).await;
    // The same seed replays the same schedule and query draws.
    let offsets = |rs: &[RequestRecord]| -> Vec<f64> {
        rs.iter()
            .map(|r| r.scheduled_s.unwrap() - rs[0].scheduled_s.unwrap())
            .collect()
    };
    let ranks = |rs: &[RequestRecord]| rs.iter().map(|r| r.query_rank).collect::<Vec<_>>();
    assert_eq!(ranks(&a), ranks(&b));
    let (oa, ob) = (offsets(&a), offsets(&b));
    assert_eq!(oa.len(), ob.len());
    assert!(oa.iter().zip(&ob).all(|(x, y)| (x - y).abs() < 1e-9));
    let count = |p| a.iter().filter(|r| r.phase == p).count() as u64;
    use ragscope_loadgen::schedule::Phase;
    let (w, s, c) = (
        count(Phase::Warmup),
        count(Phase::Steady),
        count(Phase::Cooldown),
    );
    assert!(w > 0 && s > 0 && c > 0, "{w} {s} {c}");
    let summary = summary(&out.path().join("a"));
    assert_eq!(summary["steady"]["requests"].as_u64().unwrap(), s);
    assert_eq!(summary["requests_by_phase"]["warmup"].as_u64().unwrap(), w);
    assert_eq!(
        summary["requests_by_phase"]["cooldown"].as_u64().unwrap(),
        c
    );
    assert!(a.iter().all(|r| r.ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_keeps_at_most_users_in_flight() {
    let (url, standin) = spawn_standin(StandIn::default()).await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("closed");
    let q = queries_path();
    assert!(
        loadgen(&[
            "run",
            "--url",
            &url,
            "--queries",
            &q,
            "--out",
            dir.to_str().unwrap(),
            "--mode",
            "closed",
            "--users",
            "3",
            "--think-ms",
            "1",
            "--requests",
            "15",
            "--duration",
            "60",
            "--quiet",
        ])
        .await
    );
    let records = read_jsonl(&dir.join("requests.jsonl")).unwrap();
    assert_eq!(records.len(), 15);
    assert_eq!(standin.arrived.load(Ordering::SeqCst), 15);
    assert!(standin.max_in_flight.load(Ordering::SeqCst) <= 3);
    assert!(records
        .iter()
        .all(|r| r.user.is_some_and(|u| u < 3) && r.ok));
    assert!(summary(&dir)["steady"]["offered_rps"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_stream_endpoint_is_timed_too() {
    let (url, standin) = spawn_standin(StandIn::default()).await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("chat");
    let q = queries_path();
    assert!(
        loadgen(&[
            "run",
            "--url",
            &url,
            "--queries",
            &q,
            "--out",
            dir.to_str().unwrap(),
            "--endpoint",
            "openai",
            "--model",
            "ragscope",
            "--rate",
            "50",
            "--requests",
            "6",
            "--quiet",
        ])
        .await
    );
    let records = read_jsonl(&dir.join("requests.jsonl")).unwrap();
    assert_eq!(records.len(), 6);
    assert!(records
        .iter()
        .all(|r| r.ok && r.tokens == 2 && r.ttft_ms.is_some()));
    let bodies = standin.bodies.lock().unwrap();
    assert_eq!(bodies[0]["model"], "ragscope");
    assert_eq!(bodies[0]["stream"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused_counts_as_connect_errors() {
    // Bind then drop: nothing listens on this port any more.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("down");
    let q = queries_path();
    let url = format!("http://127.0.0.1:{port}");
    loadgen(&[
        "run",
        "--url",
        &url,
        "--queries",
        &q,
        "--out",
        dir.to_str().unwrap(),
        "--rate",
        "100",
        "--requests",
        "5",
        "--quiet",
    ])
    .await;
    let s = summary(&dir);
    assert_eq!(s["steady"]["errors_by_kind"]["connect"], 5);
    assert_eq!(s["steady"]["ok"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn knee_finder_stops_at_the_first_failing_step() {
    use ragscope_loadgen::schedule::Arrivals;
    use rand::SeedableRng;
    // The schedule is seeded, so the requests of steps 0 and 1 are known in advance:
    // the stand-in fails everything after them.
    let per_step = |rate: f64, seed: u64| {
        Arrivals {
            rate,
            burst_rate: 0.0,
            burst_size: 0,
        }
        .times(0.5, &mut rand::rngs::StdRng::seed_from_u64(seed))
        .len() as u64
    };
    let good = per_step(20.0, 3) + per_step(40.0, 4);
    let (url, standin) = spawn_standin(StandIn {
        fail_from: Some(good),
        ..StandIn::default()
    })
    .await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("knee");
    let q = queries_path();
    assert!(
        loadgen(&[
            "knee",
            "--url",
            &url,
            "--queries",
            &q,
            "--out",
            dir.to_str().unwrap(),
            "--start-rate",
            "20",
            "--factor",
            "2",
            "--step-duration",
            "0.5",
            "--max-steps",
            "6",
            "--max-error-rate",
            "0.1",
            "--max-p95-ttft-ms",
            "600000",
            "--seed",
            "3",
            "--quiet",
        ])
        .await
    );
    let s = summary(&dir);
    let steps = s["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3, "{steps:?}");
    assert_eq!(steps[2]["error_rate"], 1.0);
    assert_eq!(s["knee"]["found"], true);
    assert_eq!(s["knee"]["last_good_rps"], 40.0);
    assert_eq!(s["knee"]["knee_rps"], 80.0);
    assert_eq!(
        standin.arrived.load(Ordering::SeqCst),
        good + per_step(80.0, 5)
    );
    let records = read_jsonl(&dir.join("requests.jsonl")).unwrap();
    assert!(records.iter().all(|r| r.step.is_some()));
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(html.contains("Latency vs offered load"));
    assert!(html.contains("Throughput vs offered load"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_passes_within_thresholds_and_fails_on_a_regression() {
    let (url, _standin) = spawn_standin(StandIn {
        mixed_errors: true,
        ..StandIn::default()
    })
    .await;
    let out = tempfile::tempdir().unwrap();
    let q = queries_path();
    // 120 requests, 84 of them successful: enough for a p95's 95% upper bound (72).
    let baseline = |p95: f64, name: &str| {
        let path = out.path().join(name);
        let b = json!({
            "comment": "test baseline",
            "load": ["--rate", "200", "--requests", "120", "--duration", "60", "--seed", "2"],
            "expected": {"p95_ttft_ms": p95, "rps": 0.001, "error_rate": 0.6},
            "thresholds": {"p95_ttft_max_ratio": 1.0, "rps_min_ratio": 0.5, "error_rate_max_increase": 0.05}
        });
        std::fs::write(&path, b.to_string()).unwrap();
        path
    };
    let generous = baseline(600_000.0, "generous.json");
    let dir = out.path().join("gate-pass");
    assert!(
        loadgen(&[
            "gate",
            "--baseline",
            generous.to_str().unwrap(),
            "--url",
            &url,
            "--queries",
            &q,
            "--out",
            dir.to_str().unwrap(),
            "--quiet",
        ])
        .await
    );
    let s = summary(&dir);
    assert_eq!(s["command"], "gate");
    assert_eq!(s["gate"].as_array().unwrap().len(), 3);
    // A TTFT no real exchange can beat: the gate reports a regression.
    let strict = baseline(0.000_001, "strict.json");
    let dir = out.path().join("gate-fail");
    assert!(
        !loadgen(&[
            "gate",
            "--baseline",
            strict.to_str().unwrap(),
            "--url",
            &url,
            "--queries",
            &q,
            "--out",
            dir.to_str().unwrap(),
            "--quiet",
        ])
        .await
    );
    let rows = summary(&dir)["gate"].clone();
    assert_eq!(rows[0]["ok"], false);
    assert_eq!(rows[0]["decision"], "regression");
    assert_eq!(rows[1]["ok"], true);
    assert_eq!(rows[2]["ok"], true);
    // The generous limits on 20 requests (14 successful): too few for any upper bound of the
    // p95, so the gate says so (exit 3) instead of passing.
    let small = out.path().join("small.json");
    let mut b: Value = serde_json::from_str(&std::fs::read_to_string(&generous).unwrap()).unwrap();
    b["load"] = json!([
        "--rate",
        "100",
        "--requests",
        "20",
        "--duration",
        "60",
        "--seed",
        "2"
    ]);
    std::fs::write(&small, b.to_string()).unwrap();
    let dir = out.path().join("gate-small");
    let argv = [
        "ragscope-loadgen",
        "gate",
        "--baseline",
        small.to_str().unwrap(),
        "--url",
        &url,
        "--queries",
        &q,
        "--out",
        dir.to_str().unwrap(),
        "--quiet",
    ];
    let cli = Cli::try_parse_from(argv).unwrap();
    let status = commands::dispatch(cli.command).await.unwrap();
    assert_eq!(status, commands::EXIT_INCONCLUSIVE);
    let rows = summary(&dir)["gate"].clone();
    assert_eq!(rows[0]["decision"], "inconclusive");
    assert!(
        rows[0]["more_requests"].as_u64().unwrap() >= 72 - 14,
        "{rows}"
    );
    // The isolation check ran alongside (the stand-in is this process: no server pid).
    assert!(summary(&dir)["isolation"]["cpus"].as_u64().unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_ends_a_long_run_early_and_keeps_what_was_sent() {
    use ragscope_loadgen::cli::Command;
    use ragscope_loadgen::runner::{Plan, Runner};
    let q = queries_path();
    for mode in ["open", "closed"] {
        let (url, standin) = spawn_standin(StandIn::default()).await;
        let cli = Cli::try_parse_from([
            "ragscope-loadgen",
            "run",
            "--url",
            &url,
            "--queries",
            &q,
            "--mode",
            mode,
            "--rate",
            "20",
            "--users",
            "2",
            "--think-ms",
            "20",
            "--duration",
            "600",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("parsed as run")
        };
        let queries = ragscope_loadgen::schedule::load_queries(Path::new(&q)).unwrap();
        let runner = Runner::new(args.target.clone(), queries).unwrap();
        let plan = Plan::from_shape(&args.shape, 1);
        let (r, s) = (Arc::clone(&runner), Arc::clone(&standin));
        tokio::spawn(async move {
            while s.arrived.load(Ordering::SeqCst) < 3 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            r.stop();
        });
        // Without the stop this plan would run for ten minutes.
        let ran = runner.run(&plan, String::new()).await;
        assert!(ran.stopped_early, "{mode}");
        assert!(ran.steady_s < 600.0, "{mode}");
        assert!(ran.records.len() >= 3, "{mode}");
        assert!(ran.records.iter().all(|r| r.ok), "{mode}");
        assert_eq!(
            ran.records.len() as u64,
            standin.arrived.load(Ordering::SeqCst),
            "{mode}: every request sent is recorded"
        );
    }
}
