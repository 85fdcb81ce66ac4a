//! The remote store against a REAL Qdrant server (`../shared/qdrant`, started by this test on
//! ports of its own): when the server dies or hangs, the API answers a 503 the client can
//! retry, naming no address and no Qdrant text, within the store's call timeout; when the
//! server comes back on its storage, the next request works, with nothing acknowledged lost.
//! The stand-in of `qdrant_wire.rs` keeps only what a real server cannot show.
//! The cluster's faults are `scripts/qdrant-faults` (see `qdrant_cluster.rs`).

use std::net::TcpListener as StdListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rag::retrieve::cluster::Cluster;
use rag::retrieve::remote::RemoteStore;
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{repo_dir, send_for_retry, spawn_fake_app_with_store, TestApp};

/// `../shared/qdrant` beside the checkout, or `RAGSCOPE_QDRANT_DIR`.
pub fn qdrant_dir() -> PathBuf {
    std::env::var_os("RAGSCOPE_QDRANT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_dir().join("../shared/qdrant"))
}

/// Whether a Qdrant server can be started here; without one a test says SKIPPED, or fails
/// when `RAGSCOPE_REQUIRE_QDRANT` is set (as `scripts/test` sets it).
pub fn qdrant_available(test: &str) -> bool {
    if qdrant_dir().join("start").exists() && qdrant_dir().join("qdrant").exists() {
        return true;
    }
    assert!(
        std::env::var_os("RAGSCOPE_REQUIRE_QDRANT").is_none(),
        "{test}: no Qdrant server at {} and RAGSCOPE_REQUIRE_QDRANT is set",
        qdrant_dir().display()
    );
    eprintln!(
        "{test}: SKIPPED, no Qdrant server at {}",
        qdrant_dir().display()
    );
    false
}

/// A base port with the 30 ports above it free (peer i uses base + 10·i + 0..2).
pub fn free_port_block() -> u16 {
    for _ in 0..200 {
        let base = 21000 + (rand_u16() % 2000) * 10;
        if (0..30).all(|i| StdListener::bind(("127.0.0.1", base + i)).is_ok()) {
            return base;
        }
    }
    panic!("no block of 30 free ports on 127.0.0.1");
}

fn rand_u16() -> u16 {
    (uuid::Uuid::new_v4().as_u128() & 0xffff) as u16
}

/// Qdrant peers started into a temporary directory; stopped when dropped.
pub struct Peers {
    pub dir: tempfile::TempDir,
    pub grpc: Vec<String>,
    /// REST URLs (and `/metrics`), peer by peer.
    pub rest: Vec<String>,
    pub pids: Vec<i32>,
}

impl Peers {
    pub fn start(peers: usize) -> Peers {
        let dir = tempfile::tempdir().unwrap();
        let base = free_port_block();
        let out = Command::new(qdrant_dir().join("start"))
            .args(["--peers", &peers.to_string(), "--port", &base.to_string()])
            .arg("--dir")
            .arg(dir.path())
            .output()
            .expect("../shared/qdrant/start runs");
        assert!(
            out.status.success(),
            "qdrant did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut peers = Peers {
            dir,
            grpc: Vec::new(),
            rest: Vec::new(),
            pids: Vec::new(),
        };
        peers.read_env();
        peers
    }

    /// URLs and pids from the `peers.env` that `start` writes (again on every restart).
    fn read_env(&mut self) {
        let env = std::fs::read_to_string(self.dir.path().join("peers.env")).unwrap();
        let list = |key: &str| -> Vec<String> {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("{key}=")))
                .unwrap_or_else(|| panic!("{key} in {env}"))
                .trim_matches('"')
                .split_whitespace()
                .map(str::to_string)
                .collect()
        };
        self.grpc = list("QDRANT_GRPC_URLS");
        self.rest = list("QDRANT_REST_URLS");
        self.pids = list("QDRANT_PIDS")
            .iter()
            .map(|p| p.parse().unwrap())
            .collect();
    }

    pub fn signal(&self, peer: usize, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pids[peer].to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} peer {peer}");
    }

    /// SIGKILL, and wait until the process is gone.
    pub fn kill(&self, peer: usize) {
        self.signal(peer, "KILL");
        let proc = PathBuf::from(format!("/proc/{}", self.pids[peer]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc.exists() && Instant::now() < deadline {
            // A zombie until `start`'s shell reaps it; its ports are closed already.
            if std::fs::read_to_string(proc.join("stat")).is_ok_and(|s| s.contains(") Z ")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts `peer` again on its storage and ports.
    pub fn restart(&mut self, peer: usize) {
        let out = Command::new(qdrant_dir().join("start"))
            .args(["--restart", &peer.to_string(), "--dir"])
            .arg(self.dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.read_env();
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        for pid in &self.pids {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
        let _ = Command::new(qdrant_dir().join("start"))
            .arg("--stop")
            .arg(self.dir.path())
            .status();
    }
}

pub async fn open(url: &str, timeout: Duration) -> Result<Arc<RemoteStore>, String> {
    let url = url.to_string();
    let cluster = Cluster {
        timeout,
        ..Cluster::default()
    };
    tokio::task::spawn_blocking(move || {
        RemoteStore::open_with(&url, None, "down", 4, cluster)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap()
}

/// A query's status, `Retry-After` header and body.
async fn query(app: &TestApp) -> (u16, Option<String>, Value) {
    let request = app.client.post(app.url("/v1/rag/query"));
    send_for_retry(request.json(&json!({"query": "find?", "stream": false}))).await
}

/// A 503 the client can act on, and nothing of the deployment in it.
fn assert_clear_503(what: &str, (status, retry, body): &(u16, Option<String>, Value)) {
    assert_eq!(*status, 503, "{what}: {body}");
    assert_eq!(body["error"]["code"], "store_unavailable", "{what}: {body}");
    assert_eq!(retry.as_deref(), Some("5"), "{what}: Retry-After");
    let text = body.to_string();
    for leak in ["127.0.0.1", "Qdrant", "qdrant", "tcp", "Internal"] {
        assert!(
            !text.contains(leak),
            "{what}: the body says {leak:?}: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_hung_qdrant_is_a_clear_503_and_its_return_needs_no_restart() {
    if !qdrant_available("a_dead_or_hung_qdrant_is_a_clear_503") {
        return;
    }
    let mut peers = Peers::start(1);
    let timeout = Duration::from_millis(1500);
    let store = open(&peers.grpc[0], timeout).await.unwrap();
    let app = spawn_fake_app_with_store(FakeGenerator::new(3), store).await;
    app.ingest(json!([{"id": "d", "text": "Some text to find."}]))
        .await;

    // Dead: refused connections, answered at once.
    peers.kill(0);
    assert_clear_503("query, server dead", &query(&app).await);
    let (status, _) = app
        .post(
            "/v1/documents",
            &json!({"documents": [{"id": "e", "text": "More text."}]}),
        )
        .await;
    assert_eq!(status, 503, "ingest too");
    let (status, _) = app.get("/health").await;
    assert_eq!(status, 200, "the API is still up");
    let (status, ready) = app.get("/ready").await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["store"]["system"], "qdrant");

    // Back on its storage: the next query works, and finds what was acknowledged before.
    peers.restart(0);
    let (status, _, body) = query(&app).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["sources"][0]["doc_id"], "d", "{body}");

    // Hung (SIGSTOP): the connection is open and nothing answers. The request must end as a
    // 503 once the call's timeout is spent, not hang, and not once per retry.
    peers.signal(0, "STOP");
    let began = Instant::now();
    let answer = query(&app).await;
    let took = began.elapsed();
    peers.signal(0, "CONT");
    assert_clear_503("query, server hung", &answer);
    assert!(
        took >= timeout && took < timeout * 2 + Duration::from_secs(1),
        "a hung server cost {took:?}, the call timeout is {timeout:?}"
    );
    let (status, _, body) = query(&app).await;
    assert_eq!(status, 200, "after SIGCONT: {body}");
    app.stop().await;

    // A URL nobody answers at fails to open, with a clear error.
    let url = peers.grpc[0].clone();
    drop(peers);
    let err = open(&url, timeout)
        .await
        .err()
        .expect("nothing listens now");
    assert!(err.contains("unavailable") && err.contains(&url), "{err}");
}

/// `attribute --prometheus`: a real Prometheus scrapes a real Qdrant while requests run, and
/// the report sets Qdrant's own search time beside the retrieval spans of those requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribute_sets_qdrants_own_time_beside_the_retrieval_spans() {
    const REQUESTS: usize = 20;
    if !qdrant_available("attribute_sets_qdrants_own_time") {
        return;
    }
    let Some(binary) = crate::metrics::prometheus() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_QDRANT").is_none(),
            "no prometheus binary (scripts/test unpacks Debian's)"
        );
        eprintln!("attribute_sets_qdrants_own_time: SKIPPED, no prometheus binary");
        return;
    };
    let peers = Peers::start(1);
    let target = peers.rest[0].trim_start_matches("http://").to_string();
    let prometheus = crate::metrics::Prometheus::start(&binary, &[target], &[]).await;
    // Spans go to the trace buffer that /debug/traces reads.
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = telemetry::tracer_provider(exporter, telemetry::resource());
    opentelemetry::global::set_tracer_provider(provider);
    let store = open(&peers.grpc[0], Duration::from_secs(10)).await.unwrap();
    let app = spawn_fake_app_with_store(FakeGenerator::new(3), store).await;
    app.ingest(json!([{"id": "d", "text": "Some text to find."}]))
        .await;
    // A scrape between the ingest and the first request, so the window holds queries only.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let r = app.client.delete(app.url("/debug/traces")).send().await;
    assert_eq!(r.unwrap().status(), 200);
    for i in 0..REQUESTS {
        let (status, body) = app
            .post(
                "/v1/rag/query",
                &json!({"query": format!("find {i}?"), "max_tokens": 4}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (_, traces) = app.get("/debug/traces").await;
    let spans = ragscope::attribute::source::parse_otlp(&traces).unwrap();
    // And one after the last.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let side = ragscope::attribute::store_side::measure(&prometheus.url, &spans)
        .await
        .unwrap()
        .expect("retrieval spans");
    eprintln!("{}", ragscope::attribute::store_side::table(&side));
    assert_eq!(side.retrievals, REQUESTS);
    let query = side
        .endpoints
        .iter()
        .find(|e| e.endpoint == "/qdrant.Points/Query")
        .expect("Qdrant answered queries in the window");
    assert!(
        query.calls >= REQUESTS as f64 && query.calls <= 3.0 * REQUESTS as f64,
        "{side:?}"
    );
    assert!(
        side.endpoints
            .iter()
            .all(|e| e.endpoint != "/qdrant.Points/Upsert"),
        "the ingest was before the window: {side:?}"
    );
    // Qdrant's time is inside the span's: it cannot be longer.
    assert!(
        side.server_ms_per_retrieval > 0.0 && side.server_ms_per_retrieval < side.retrieval_mean_ms,
        "{side:?}"
    );
    app.stop().await;
}
