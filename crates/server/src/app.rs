//! Building the server from its configuration: load the stages, assemble the pipeline, and
//! serve HTTP and gRPC on bound listeners until one shutdown future resolves. `serve` binds
//! first and loads in the background, so `/health`, `/ready` and the gRPC health service answer
//! while models load and the corpus ingests.

use std::future::Future;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::net::TcpListener;

use crate::api::{self, AppState, Readiness};
use crate::config::{GeneratorArgs, LoadArgs, ModelArgs, ServeArgs, ServerArgs, StoreArgs};
use llm::llama::{Llama, WeightFormat};
use llm::models;
use llm::tokenizer;
use llm::Generator;
use opentelemetry::KeyValue;
use rag::embed::bert::BertEmbedder;
use rag::embed::Embedder;
use rag::ingest::chunk::ChunkerConfig;
use rag::ingest::{corpus, ingest_document};
use rag::pipeline::Pipeline;
use rag::rerank::cross_encoder::CrossEncoder;
use rag::rerank::fusion::FusionReranker;
use rag::rerank::Reranker;
use rag::retrieve::edge::EdgeStore;
use rag::retrieve::remote::RemoteStore;
use rag::retrieve::VectorStore;
use rag::worker::Workers;
use telemetry::names::{attr, span, StageKind};
use telemetry::span::Stage;

/// The three model stages, loaded.
pub struct Models {
    pub embedder: Arc<dyn Embedder>,
    pub generator: Arc<dyn Generator>,
    pub reranker: Option<Arc<dyn Reranker>>,
}

/// Loads the embedder, generator and reranker named in `args`, fetching manifest models when
/// allowed.
pub fn load_models(args: &ModelArgs, generator: &GeneratorArgs) -> Result<Models> {
    load_models_with(args, generator, None)
}

/// [`load_models`], with a generator that leaves failure snapshots in `snapshots`.
pub fn load_models_with(
    args: &ModelArgs,
    g: &GeneratorArgs,
    snapshots: Option<Arc<llm::snapshot::SnapshotStore>>,
) -> Result<Models> {
    llm::cpu::set_cap(g.cpu_level).map_err(anyhow::Error::msg)?;
    tracing::info!("{}", llm::cpu::describe());
    let device = llm::device::device(&g.device)?;
    telemetry::gpu::set_decode_sample_every(g.gpu_decode_sample);
    llm::schedule::set_step_trace(llm::schedule::StepTrace {
        spans: g.decode_step_spans,
        links: g.decode_step_links,
    });
    let embed_dir = models::resolve(
        &args.embed_model,
        &args.models_dir,
        &["config.json", "tokenizer.json", "model.safetensors"],
        args.fetch_models,
    )?;
    let embed_id = model_name(&args.embed_model);
    let embedder = BertEmbedder::load(&embed_dir, &embed_id, &device)
        .with_context(|| format!("loading embedder from {}", embed_dir.display()))?;
    let gen_dir = models::resolve(&g.gen_model, &args.models_dir, &[], args.fetch_models)?;
    let format = g
        .weight_format
        .unwrap_or_else(|| WeightFormat::for_device(&device));
    let generator = load_generator_as(&gen_dir, &device, g.max_context, format)
        .with_context(|| format!("loading generator from {}", gen_dir.display()))?
        .with_prefill_chunk(g.prefill_chunk_tokens)
        .with_prefix_cache(g.prefix_cache_mb)
        .with_speculation(g.speculation)
        .with_snapshots(snapshots);
    let generator = match g.kv_cache_dtype {
        Some(dtype) => generator.with_kv_dtype(dtype)?,
        None => generator,
    };
    let reranker: Option<Arc<dyn Reranker>> = match args.reranker.as_str() {
        "none" => None,
        "fusion" => Some(Arc::new(FusionReranker::default())),
        spec => {
            let dir = models::resolve(
                spec,
                &args.models_dir,
                &CrossEncoder::FILES,
                args.fetch_models,
            )?;
            Some(Arc::new(
                CrossEncoder::load(&dir, &model_name(spec), &device)
                    .with_context(|| format!("loading cross-encoder from {}", dir.display()))?,
            ))
        }
    };
    Ok(Models {
        embedder: Arc::new(embedder),
        generator: Arc::new(generator),
        reranker,
    })
}

/// The GGUF file in a generator's model directory.
pub fn gguf_in(dir: &Path) -> Result<std::path::PathBuf> {
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "gguf"))
        .with_context(|| format!("no .gguf file in {}", dir.display()))
}

/// The GGUF file in `dir`, with `tokenizer.json` beside it when there is one (written by
/// `models fetch`), else the tokenizer rebuilt from the GGUF metadata.
pub fn load_generator(
    dir: &Path,
    device: &candle_core::Device,
    max_context: usize,
) -> Result<Llama> {
    load_generator_as(dir, device, max_context, WeightFormat::for_device(device))
}

/// [`load_generator`] in an explicit weight format (`--weight-format`).
pub fn load_generator_as(
    dir: &Path,
    device: &candle_core::Device,
    max_context: usize,
    format: WeightFormat,
) -> Result<Llama> {
    let gguf = gguf_in(dir)?;
    let tokenizer_json = dir.join("tokenizer.json");
    let tokenizer = if tokenizer_json.exists() {
        tokenizer::load(&tokenizer_json)?
    } else {
        tokenizer::from_gguf_file(&gguf)?
    };
    Ok(Llama::load_with_format(
        &gguf,
        tokenizer,
        device,
        max_context,
        format,
    )?)
}

/// The last path component of a model spec: what clients call the model.
fn model_name(spec: &str) -> String {
    spec.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(spec)
        .to_string()
}

/// The Qdrant server at `--qdrant-url` when one is given, else the embedded engine.
/// Blocking: call it from a blocking or worker thread, not from async code.
pub fn open_store(args: &StoreArgs, dimension: usize) -> Result<Arc<dyn VectorStore>> {
    if let Some(url) = args.qdrant_url.as_deref().filter(|u| !u.trim().is_empty()) {
        let store = RemoteStore::open_with(
            url,
            args.qdrant_api_key.as_deref(),
            &args.collection,
            dimension,
            args.cluster(),
        )
        .with_context(|| format!("opening collection `{}` on {url}", args.collection))?;
        return Ok(Arc::new(store));
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let store = EdgeStore::open(&args.data_dir, &args.collection, dimension)
        .with_context(|| format!("opening the store in {}", args.data_dir.display()))?;
    Ok(Arc::new(store))
}

pub fn chunker(args: &StoreArgs) -> ChunkerConfig {
    ChunkerConfig {
        max_tokens: args.chunk_tokens,
        overlap_tokens: args.chunk_overlap,
    }
}

/// Everything loaded and assembled.
pub fn load_pipeline(load: &LoadArgs, server: &ServerArgs) -> Result<Pipeline> {
    load_pipeline_under(load, server, None)
}

/// [`load_pipeline`], its model load and store open as `load_models` and `open_store` spans
/// under `startup` when given (the server's `startup` trace).
pub fn load_pipeline_under(
    load: &LoadArgs,
    server: &ServerArgs,
    startup: Option<&Stage>,
) -> Result<Pipeline> {
    let (store, pipeline) = (&load.store, &load.pipeline);
    let snapshots = llm::snapshot::SnapshotStore::open(&server.snapshots, &store.data_dir)?;
    let loading = startup.map(|s| s.child(span::LOAD_MODELS));
    let Models {
        embedder,
        generator,
        reranker,
    } = on_span(
        loading,
        load_models_with(&load.models, &load.generator, snapshots.clone()),
    )?;
    let opening = startup.map(|s| s.child(span::OPEN_STORE));
    let store_handle = on_span(opening, open_store(store, embedder.dimension()))?;
    // What `--metrics-compat vllm` labels its series with, and the KV positions the workers
    // could hold at once (the denominator of its cache usage).
    telemetry::compat::model_loaded(generator.model_id());
    // Content capture starts as configured; `/admin/telemetry` may change it later.
    telemetry::controls::set_capture_content(pipeline.capture_content);
    telemetry::metrics::KV_CACHE.capacity_tokens.store(
        (server.workers.max(1) * load.generator.max_context) as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    Ok(Pipeline {
        snapshots,
        embedder,
        store: store_handle,
        reranker,
        generator,
        workers: Workers::new(server.workers, server.queue_capacity)
            .with_max_wait(server.max_queue_wait(), server.queue_wait_headroom),
        defaults: pipeline.clone(),
        sampling: load.sampling.defaults(),
        chunker: chunker(store),
        query_cache: rag::embed::cache::QueryCache::new(pipeline.query_cache),
        sentence_cache: rag::embed::cache::VectorCache::named(
            "sentence_embedding",
            pipeline.sentence_cache,
        ),
        prompts: rag::embed::cache::PromptMemory::uncounted(pipeline.query_cache),
    })
}

/// The pipeline with the configured corpus ingested (evaluation, benchmarks).
pub fn load_with_corpus(load: &LoadArgs, server: &ServerArgs) -> Result<Arc<Pipeline>> {
    let loaded = Arc::new(load_pipeline(load, server)?);
    ingest_corpus(
        &loaded,
        &server.corpus,
        &load.store.data_dir,
        &Readiness::default(),
        None,
    )?;
    Ok(loaded)
}

/// Ends `span` (if any) with `result`'s outcome, and passes the result on.
fn on_span<T>(span: Option<Stage>, result: Result<T>) -> Result<T> {
    if let (Some(span), Err(e)) = (&span, &result) {
        span.fail("startup", format!("{e:#}"));
    }
    result
}

/// Ingests the named corpus unless it was fully ingested before, reporting progress, then
/// builds the vector index. Under `startup` (the server's start) it is an `ingest_corpus` span
/// with each document's `ingest` and the `build_index` under it; otherwise each document's
/// `ingest` is a root of its own.
pub fn ingest_corpus(
    pipeline: &Pipeline,
    name: &str,
    data_dir: &Path,
    readiness: &Readiness,
    startup: Option<&Stage>,
) -> Result<()> {
    if name == "none" {
        return Ok(());
    }
    let corpus_span = startup.map(|s| s.child(span::INGEST_CORPUS));
    let result = ingest_corpus_in(pipeline, name, data_dir, readiness, corpus_span.as_ref());
    on_span(corpus_span, result)
}

fn ingest_corpus_in(
    pipeline: &Pipeline,
    name: &str,
    data_dir: &Path,
    readiness: &Readiness,
    parent: Option<&Stage>,
) -> Result<()> {
    let marker = data_dir.join("corpus").join(format!("{name}.ingested"));
    let docs = corpus::load(name, data_dir)?;
    readiness.corpus_total.store(docs.len(), Ordering::Relaxed);
    if let Some(p) = parent {
        p.set(KeyValue::new(attr::CORPUS_DOCUMENTS, docs.len() as i64));
    }
    if marker.exists() && pipeline.store.count()? > 0 {
        readiness.corpus_done.store(docs.len(), Ordering::Relaxed);
        if let Some(p) = parent {
            p.set(KeyValue::new(attr::CORPUS_ALREADY_INGESTED, true));
        }
        tracing::info!(corpus = name, "corpus already ingested");
        return Ok(());
    }
    let started = Instant::now();
    let mut chunks = 0;
    for (i, doc) in docs.iter().enumerate() {
        let stage = match parent {
            Some(p) => p.child(StageKind::Ingest.span_prefix()),
            None => Stage::root(StageKind::Ingest.span_prefix()),
        };
        let outcome = ingest_document(
            doc,
            pipeline.embedder.as_ref(),
            pipeline.store.as_ref(),
            pipeline.chunker,
            &stage,
        );
        match outcome {
            Ok(o) => chunks += o.chunks,
            Err(e) => tracing::warn!(doc = %doc.id, error = %e, "skipping document"),
        }
        readiness.corpus_done.store(i + 1, Ordering::Relaxed);
        if (i + 1) % 20 == 0 || i + 1 == docs.len() {
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "corpus {name}: {}/{} documents, {chunks} chunks, {:.0} chunks/s",
                i + 1,
                docs.len(),
                chunks as f64 / secs.max(1e-3)
            );
        }
    }
    tracing::info!("building the vector index");
    let index = parent.map(|p| p.child(span::BUILD_INDEX));
    on_span(
        index,
        pipeline.store.build_index().map_err(anyhow::Error::from),
    )?;
    std::fs::write(
        &marker,
        format!("{} documents, {chunks} chunks\n", docs.len()),
    )?;
    Ok(())
}

/// The sockets the server answers on, bound by the caller (tests bind port 0).
pub struct Listeners {
    pub http: TcpListener,
    /// `None`: no gRPC API (`--grpc-listen off`).
    pub grpc: Option<TcpListener>,
}

impl Listeners {
    /// Binds the configured addresses.
    pub async fn bind(args: &ServerArgs) -> Result<Listeners> {
        let http = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let grpc = match args.grpc_listen.0 {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding {addr} (--grpc-listen)"))?,
            ),
            None => None,
        };
        Ok(Listeners { http, grpc })
    }
}

/// Raises the open-file soft limit towards the hard one when it is below `wanted` (Go's runtime
/// raises it at start the same way), and warns when even the hard limit is short: a listener
/// out of descriptors fails its accepts instead of answering `too_many_connections`.
fn ensure_open_files(wanted: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit for the call to fill in.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur >= wanted
    {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: wanted.min(limit.rlim_max),
        rlim_max: limit.rlim_max,
    };
    // SAFETY: a soft limit no higher than the hard one, which the process may always set.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        limit = raised;
    }
    if limit.rlim_cur < wanted {
        tracing::warn!(
            open_files = limit.rlim_cur,
            wanted,
            "the open-file limit is below what --max-connections on both listeners needs; lower the flag or raise `ulimit -n`"
        );
    }
}

/// Serves `state` over HTTP and gRPC until `shutdown` resolves, then drains: new requests get
/// 503 (`/ready` and the gRPC health service say not ready) while the ones in flight, streams
/// included, finish, for up to `state.shutdown_grace`; then both servers stop. Whatever is
/// still running after the grace is cut off unanswered, so nothing is acknowledged that was not
/// done (an ingest answers only once its documents are durable).
pub async fn run(
    listeners: Listeners,
    state: AppState,
    max_body_bytes: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let connections = crate::config::ConnectionArgs::default();
    run_with(listeners, state, max_body_bytes, connections, shutdown).await
}

/// [`run`], with connection management (HTTP/2 keepalive, maximum connection age) for both the
/// HTTP and the gRPC server.
pub async fn run_with(
    listeners: Listeners,
    state: AppState,
    max_body_bytes: usize,
    connections: crate::config::ConnectionArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use futures::FutureExt;
    // Both listeners full, plus the store's files, the telemetry sockets and the refusals.
    ensure_open_files(2 * u64::from(connections.max_connections) + 256);
    let (readiness, grace) = (state.readiness.clone(), state.shutdown_grace);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop = async move {
        let mut rx = stop_rx;
        let _ = rx.wait_for(|stopped| *stopped).await;
    }
    .boxed()
    .shared();
    let drain = async move {
        shutdown.await;
        readiness.start_draining();
        tracing::info!(
            in_flight = readiness.in_flight(),
            grace_s = grace.as_secs_f64(),
            "shutting down: refusing new requests, draining the ones in flight"
        );
        let drained = tokio::time::timeout(grace, readiness.idle()).await.is_ok();
        if !drained {
            tracing::warn!(
                in_flight = readiness.in_flight(),
                "shutdown grace period over with requests still in flight; stopping anyway"
            );
        }
        let _ = stop_tx.send(true);
        drained
    };
    let http = api::http::serve(
        listeners.http,
        api::router(state.clone(), max_body_bytes),
        &connections,
        stop.clone(),
    );
    let grpc_connections = connections.clone();
    let grpc = async move {
        match listeners.grpc {
            Some(listener) => {
                api::grpc::serve(listener, state, max_body_bytes, &grpc_connections, stop)
                    .await
                    .map_err(std::io::Error::other)
            }
            None => Ok(()),
        }
    };
    let serving = async { tokio::try_join!(http, grpc).map(|_| ()) };
    tokio::pin!(serving);
    tokio::select! {
        result = &mut serving => result,
        drained = drain => {
            // Drained, the connections left are idle and close at once (a moment for the last
            // bytes to leave); past the grace, the stragglers are cut.
            let linger = if drained { Duration::from_secs(2) } else { Duration::from_millis(100) };
            tokio::time::timeout(linger, serving).await.unwrap_or(Ok(()))
        }
    }
}

/// State for a server whose pipeline is already loaded (tests, benchmarks).
pub fn ready_state(pipeline: Pipeline, request_timeout: std::time::Duration) -> AppState {
    let state = AppState {
        pipeline: Arc::new(OnceLock::new()),
        readiness: Arc::new(Readiness::default()),
        request_timeout,
        faults: Arc::default(),
        ui: Arc::default(),
        auth: Arc::default(),
        shutdown_grace: Duration::from_secs(30),
        tenants: Arc::default(),
    };
    let _ = state.pipeline.set(Arc::new(pipeline));
    state.readiness.set_ready();
    state
}

/// `ragscope serve`: bind, answer health checks at once, load and ingest in the background.
pub async fn serve(
    args: ServeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let auth = Arc::new(api::auth::ApiKeys::from_args(&args.auth)?);
    let tenants =
        rag::tenant::Tenants::new(&args.tenants, &auth.tenants()).map_err(anyhow::Error::msg)?;
    let listeners = Listeners::bind(&args.server).await?;
    tracing::info!("listening on http://{}", listeners.http.local_addr()?);
    if let Some(grpc) = &listeners.grpc {
        tracing::info!("gRPC API on {}", grpc.local_addr()?);
    }
    warn_if_open(&listeners, &auth)?;
    let state = AppState {
        pipeline: Arc::new(OnceLock::new()),
        readiness: Arc::new(Readiness::default()),
        request_timeout: args.server.request_timeout,
        faults: Arc::new(rag::fault::Faults::from_args(&args.faults)?),
        ui: Arc::new(crate::api::page::UiLinks::from_args(&args.ui)),
        auth,
        shutdown_grace: args.server.shutdown_grace(),
        tenants: Arc::new(tenants),
    };
    let loading = state.clone();
    let max_body_bytes = args.server.max_body_bytes;
    let connections = args.server.connections.clone();
    // An embedded store that cannot be opened (damaged files, another process holding it)
    // will not get better by waiting: the server stops and exits non-zero. A remote store
    // may come back, so then the server stays up and `/ready` reports the failure.
    let fatal = Arc::new((tokio::sync::Notify::new(), OnceLock::<String>::new()));
    let embedded = args
        .load
        .store
        .qdrant_url
        .as_deref()
        .is_none_or(|u| u.trim().is_empty());
    let on_fatal = fatal.clone();
    tokio::task::spawn_blocking(move || {
        // The `startup` trace: where start-up time goes (models, store, corpus, index).
        let startup = Stage::detached_at(
            span::STARTUP,
            Some(telemetry::names::LIFECYCLE_SERVICE),
            telemetry::clock::now(),
        );
        let result = load_pipeline_under(&args.load, &args.server, Some(&startup)).and_then(|p| {
            let p = Arc::new(p);
            let _ = loading.pipeline.set(p.clone());
            ingest_corpus(
                &p,
                &args.server.corpus,
                &args.load.store.data_dir,
                &loading.readiness,
                Some(&startup),
            )
        });
        if let Err(e) = &result {
            startup.fail("startup", format!("{e:#}"));
        }
        drop(startup);
        match result {
            Ok(()) => {
                loading.readiness.set_ready();
                tracing::info!("ready");
            }
            Err(e) => {
                tracing::error!("start-up failed: {e:#}");
                loading.readiness.set_failed(format!("{e:#}"));
                let store = e
                    .chain()
                    .any(|c| c.downcast_ref::<rag::retrieve::StoreError>().is_some());
                if embedded && store {
                    let _ = on_fatal.1.set(format!("{e:#}"));
                    on_fatal.0.notify_one();
                }
            }
        }
    });
    let loaded = state.pipeline.clone();
    let stop = {
        let fatal = fatal.clone();
        async move {
            tokio::select! {
                _ = shutdown => {}
                _ = fatal.0.notified() => {}
            }
        }
    };
    run_with(listeners, state, max_body_bytes, connections, stop).await?;
    if let Some(e) = fatal.1.get() {
        anyhow::bail!("start-up failed: {e}");
    }
    // The process exits next: a job still on a model worker after the grace period is abandoned
    // unanswered, not joined (dropping the workers would wait for it).
    if let Some(pipeline) = loaded.get() {
        std::mem::forget(pipeline.clone());
    }
    Ok(())
}

/// Without API keys the server trusts whoever reaches it: fine on loopback, loud elsewhere.
fn warn_if_open(listeners: &Listeners, auth: &api::auth::ApiKeys) -> std::io::Result<()> {
    if auth.is_on() {
        tracing::info!("API keys required (Authorization: Bearer)");
        return Ok(());
    }
    let mut exposed = vec![listeners.http.local_addr()?];
    if let Some(grpc) = &listeners.grpc {
        exposed.push(grpc.local_addr()?);
    }
    for addr in exposed.iter().filter(|a| !a.ip().is_loopback()) {
        tracing::warn!(
            "!!! {addr} is not a loopback address and no API key is set: anyone who can reach it \
             can query, ingest, delete every document and read recent traces. Set --api-key / \
             RAGSCOPE_API_KEYS (see README, Security) !!!"
        );
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
