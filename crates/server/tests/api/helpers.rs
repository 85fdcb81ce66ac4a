//! `spawn_app`: a real server (real models, a fresh embedded store) on 127.0.0.1:0, HTTP and
//! gRPC each on a port of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Parser;
use ragscope::config::{Cli, Command, ServeArgs};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct TestApp {
    pub base: String,
    /// The gRPC API's URL (`http://127.0.0.1:PORT`).
    pub grpc: String,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<std::io::Result<()>>>,
}

/// The repository this test runs in (the crate is `crates/server` in it): cargo and nextest set `CARGO_MANIFEST_DIR` when they run
/// a test, while `env!` would give the checkout the binary was built in (the cached target dir
/// is shared between checkouts).
pub fn repo_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../..")
}

pub fn models_dir() -> PathBuf {
    std::env::var_os("RAGSCOPE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_dir().join("models"))
}

/// Parses `serve` flags the way the binary does, on top of test defaults.
pub fn serve_args(data_dir: &Path, extra: &[&str]) -> ServeArgs {
    let mut argv = vec![
        "ragscope".to_string(),
        "serve".into(),
        "--corpus".into(),
        "none".into(),
        "--fetch-models".into(),
        "false".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--data-dir".into(),
        data_dir.display().to_string(),
        "--models-dir".into(),
        models_dir().display().to_string(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    match Cli::try_parse_from(argv).expect("valid test flags").command {
        Command::Serve(args) => args,
        _ => unreachable!(),
    }
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(&[]).await
}

pub async fn spawn_app_with(extra: &[&str]) -> TestApp {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().to_path_buf();
    start(&path, extra, Some(tmp)).await
}

/// A server over an existing data directory (to test restarts).
pub async fn spawn_app_in(data_dir: &Path, extra: &[&str]) -> TestApp {
    start(data_dir, extra, None).await
}

/// `tmp`, if given, moves into the server task, so the directory outlives the store in it.
async fn start(data_dir: &Path, extra: &[&str], tmp: Option<tempfile::TempDir>) -> TestApp {
    // `/metrics` needs a meter provider; tests that export telemetry install their own first.
    if let Some(provider) = telemetry::metrics::ensure_provider() {
        std::mem::forget(provider);
    }
    let args = serve_args(data_dir, extra);
    let pipeline = tokio::task::spawn_blocking({
        let args = args.clone();
        move || ragscope::app::load_pipeline(&args.load, &args.server)
    })
    .await
    .unwrap()
    .expect("pipeline loads");
    serve(pipeline, &args, tmp).await
}

/// A server over stand-in stages (for tests about telemetry and serving, not models).
pub async fn spawn_fake_app(generator: crate::fakes::FakeGenerator) -> TestApp {
    spawn_fake_app_with(generator, &[]).await
}

/// The same, with extra `serve` flags.
pub async fn spawn_fake_app_with(
    generator: crate::fakes::FakeGenerator,
    extra: &[&str],
) -> TestApp {
    fake_app(
        generator,
        Arc::new(crate::fakes::FakeStore::default()),
        extra,
    )
    .await
}

/// Stand-in model stages over a given store (4-dimensional vectors).
pub async fn spawn_fake_app_with_store(
    generator: crate::fakes::FakeGenerator,
    store: Arc<dyn rag::retrieve::VectorStore>,
) -> TestApp {
    fake_app(generator, store, &[]).await
}

/// The same, with extra `serve` flags.
pub async fn spawn_fake_app_with_store_and(
    generator: crate::fakes::FakeGenerator,
    store: Arc<dyn rag::retrieve::VectorStore>,
    extra: &[&str],
) -> TestApp {
    fake_app(generator, store, extra).await
}

async fn fake_app(
    generator: crate::fakes::FakeGenerator,
    store: Arc<dyn rag::retrieve::VectorStore>,
    extra: &[&str],
) -> TestApp {
    if let Some(provider) = telemetry::metrics::ensure_provider() {
        std::mem::forget(provider);
    }
    let args = serve_args(Path::new("unused"), extra);
    serve(fake_pipeline_over(generator, store, extra), &args, None).await
}

/// A pipeline over stand-in stages.
pub fn fake_pipeline(generator: crate::fakes::FakeGenerator) -> rag::pipeline::Pipeline {
    fake_pipeline_over(generator, Arc::new(crate::fakes::FakeStore::default()), &[])
}

fn fake_pipeline_over(
    generator: crate::fakes::FakeGenerator,
    store: Arc<dyn rag::retrieve::VectorStore>,
    extra: &[&str],
) -> rag::pipeline::Pipeline {
    let args = serve_args(Path::new("unused"), extra);
    rag::pipeline::Pipeline {
        embedder: Arc::new(crate::fakes::FakeEmbedder),
        store,
        reranker: Some(Arc::new(rag::rerank::fusion::FusionReranker::default())),
        generator: Arc::new(generator),
        workers: rag::worker::Workers::new(1, 64),
        defaults: args.load.pipeline.clone(),
        sampling: args.load.sampling.defaults(),
        chunker: ragscope::app::chunker(&args.load.store),
        query_cache: rag::embed::cache::QueryCache::new(0),
        sentence_cache: rag::embed::cache::VectorCache::named("sentence_embedding", 0),
        prompts: rag::embed::cache::PromptMemory::uncounted(0),
        snapshots: None,
    }
}

async fn serve(
    pipeline: rag::pipeline::Pipeline,
    args: &ServeArgs,
    tmp: Option<tempfile::TempDir>,
) -> TestApp {
    let mut state = ragscope::app::ready_state(pipeline, args.server.request_timeout);
    state.faults = Arc::new(rag::fault::Faults::from_args(&args.faults).expect("fault flags"));
    state.ui = Arc::new(ragscope::api::page::UiLinks::from_args(&args.ui));
    state.auth = Arc::new(ragscope::api::auth::ApiKeys::from_args(&args.auth).expect("key flags"));
    state.tenants = Arc::new(
        rag::tenant::Tenants::new(&args.tenants, &state.auth.tenants()).expect("tenant flags"),
    );
    state.shutdown_grace = args.server.shutdown_grace();
    let connections = args.server.connections.clone();
    serve_state_with(state, args.server.max_body_bytes, connections, tmp).await
}

/// Serves `state` over HTTP and gRPC, each on a port 0 of its own.
pub async fn serve_state(
    state: ragscope::api::AppState,
    max_body_bytes: usize,
    tmp: Option<tempfile::TempDir>,
) -> TestApp {
    serve_state_with(state, max_body_bytes, Default::default(), tmp).await
}

/// [`serve_state`] with the gRPC server's connection settings (keepalive, maximum age).
pub async fn serve_state_with(
    state: ragscope::api::AppState,
    max_body_bytes: usize,
    connections: ragscope::config::ConnectionArgs,
    tmp: Option<tempfile::TempDir>,
) -> TestApp {
    let listeners = ragscope::app::Listeners {
        http: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        grpc: Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
    };
    let base = format!("http://{}", listeners.http.local_addr().unwrap());
    let grpc = format!(
        "http://{}",
        listeners.grpc.as_ref().unwrap().local_addr().unwrap()
    );
    let (tx, rx) = oneshot::channel();
    let server = tokio::spawn(async move {
        let _tmp = tmp;
        ragscope::app::run_with(listeners, state, max_body_bytes, connections, async {
            let _ = rx.await;
        })
        .await
    });
    TestApp {
        base,
        grpc,
        client: reqwest::Client::new(),
        shutdown: Some(tx),
        server: Some(server),
    }
}

impl TestApp {
    /// A connection to the gRPC server, for any of its services.
    pub async fn grpc_channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(self.grpc.clone())
            .unwrap()
            .connect()
            .await
            .expect("gRPC connects")
    }

    /// A client of the gRPC API.
    pub async fn rag_client(
        &self,
    ) -> ragscope::api::grpc::proto::rag_client::RagClient<tonic::transport::Channel> {
        ragscope::api::grpc::proto::rag_client::RagClient::connect(self.grpc.clone())
            .await
            .expect("gRPC connects")
    }

    /// The Prometheus exposition at `/metrics`.
    pub async fn metrics_text(&self) -> String {
        let r = self.client.get(self.url("/metrics")).send().await.unwrap();
        r.text().await.unwrap()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// The JSON chunks of an OpenAI-style stream from `POST path`, after checking the status
    /// is 200 and that `[DONE]` ends it (dropped).
    pub async fn openai_stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let events = crate::query::sse_events(&r.text().await.unwrap());
        assert_eq!(events.last().unwrap().1, "[DONE]");
        events[..events.len() - 1]
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect()
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Ingests documents and asserts success.
    pub async fn ingest(&self, docs: Value) -> Value {
        let (status, body) = self
            .post("/v1/documents", &json!({"documents": docs}))
            .await;
        assert_eq!(status, 200, "{body}");
        body
    }

    /// Ingests the small fictional corpus most tests ask about.
    pub async fn ingest_fixtures(&self) -> Value {
        self.ingest(fixtures()).await
    }

    /// Stops the server, waiting for in-flight requests (graceful shutdown).
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.unwrap().unwrap();
        }
    }
}

/// Facts no model can know beforehand, so a right answer proves the passage was used.
pub fn fixtures() -> Value {
    json!([
        {
            "id": "zorbia",
            "text": "# Zorbia\n\nZorbia is a small island nation in the Quillon Sea. The capital of Zorbia is Quenta, a port city famous for its blue lighthouses. Zorbia's currency is the zorbic mark.",
            "format": "markdown",
            "source": "atlas/zorbia.md",
            "metadata": {"topic": "geography", "year": 2024}
        },
        {
            "id": "flumox",
            "text": "The flumox is a garden tool invented by Petra Lindqvist in 1931. It is used to aerate clay soil. A flumox has three curved tines and an ash-wood handle.",
            "source": "tools/flumox.txt",
            "metadata": {"topic": "tools"}
        },
        {
            "id": "gitdoc",
            "text": "<html><head><title>git-stash(1)</title></head><body><h2>NAME</h2><p>git-stash - Stash the changes in a dirty working directory away</p><h2>COMMANDS</h2><p>pop: Remove a single stashed state from the stash list and apply it on top of the current working tree state.</p></body></html>",
            "format": "html",
            "source": "git-doc/git-stash.html",
            "metadata": {"topic": "git"}
        }
    ])
}

/// Sends `request`: its status, `Retry-After` header and JSON body (null if none).
pub async fn send_for_retry(request: reqwest::RequestBuilder) -> (u16, Option<String>, Value) {
    let r = request.send().await.unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, retry, r.json().await.unwrap_or(Value::Null))
}
