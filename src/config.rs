//! Every setting, from command-line flags or `RAGSCOPE_*` environment variables; the
//! OpenTelemetry SDK reads the standard `OTEL_*` variables itself (see `telemetry`).
//! Each module's settings are one struct, flattened into the subcommands that need it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::generate::TokenTrace;

#[derive(Debug, Parser)]
#[command(name = "ragscope", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP server (fetches models and ingests the corpus on first start).
    Serve(ServeArgs),
    /// Ingest files or directories into the store (stop the server first; or POST /v1/documents).
    Ingest(IngestArgs),
    /// Ask a running server a question and stream the answer.
    Query(QueryArgs),
    /// Measure retrieval, reranking and answers on the evaluation questions.
    Eval(EvalArgs),
    /// Fetch or verify model weights.
    Models {
        #[command(subcommand)]
        action: ModelsAction,
    },
    /// Print speed figures for every stage.
    Bench(BenchArgs),
    /// Where the latency went: per-stage self/inclusive time, shares, critical path, residual.
    Attribute(AttributeArgs),
}

#[derive(Debug, Subcommand)]
pub enum ModelsAction {
    /// Download, verify and unpack every model in models/manifest.json.
    Fetch(ModelArgs),
    /// Check every model file against its sha256.
    Verify(ModelArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Where models are unpacked (one directory per model).
    #[arg(long, env = "RAGSCOPE_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Embedder: a manifest name, a local directory, or a model-hub id.
    #[arg(long, env = "RAGSCOPE_EMBED_MODEL", default_value = "all-MiniLM-L6-v2")]
    pub embed_model: String,
    /// Generator: a manifest name or a directory holding a GGUF file and tokenizer.json.
    #[arg(
        long,
        env = "RAGSCOPE_GEN_MODEL",
        default_value = "SmolLM2-135M-Instruct"
    )]
    pub gen_model: String,
    /// Reranker: `fusion` (dense + BM25 rank fusion, offline), `none`, or a cross-encoder given
    /// as a directory or hub id (e.g. cross-encoder/ms-marco-MiniLM-L-6-v2).
    #[arg(long, env = "RAGSCOPE_RERANKER", default_value = "fusion")]
    pub reranker: String,
    /// Where models run: cpu, cuda, cuda:N or auto.
    #[arg(long, env = "RAGSCOPE_DEVICE", default_value = "cpu")]
    pub device: String,
    /// On a GPU, time every Nth decode step with CUDA events (a `gpu decode_step` span; 0: none,
    /// 1: every step). Each timed step waits for the device once more than it would anyway.
    #[arg(long, env = "RAGSCOPE_GPU_DECODE_SAMPLE", default_value_t = 8)]
    pub gpu_decode_sample: usize,
    /// Upper bound on prompt + generated tokens per request.
    #[arg(long, env = "RAGSCOPE_MAX_CONTEXT", default_value_t = 2048)]
    pub max_context: usize,
    /// Fetch missing models on start.
    #[arg(long, env = "RAGSCOPE_FETCH_MODELS", default_value_t = true, action = clap::ArgAction::Set)]
    pub fetch_models: bool,
}

#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Where the embedded store and the downloaded corpus live.
    #[arg(long, env = "RAGSCOPE_DATA_DIR", default_value = "data")]
    pub data_dir: PathBuf,
    /// Collection: one Qdrant Edge shard directory under the data dir, or the collection on
    /// the Qdrant server.
    #[arg(long, env = "RAGSCOPE_COLLECTION", default_value = "ragscope")]
    pub collection: String,
    /// A Qdrant server's gRPC URL (e.g. http://qdrant:6334) to store vectors in instead of the
    /// embedded engine; unset = embedded Qdrant Edge in the data dir.
    #[arg(long, env = "RAGSCOPE_QDRANT_URL")]
    pub qdrant_url: Option<String>,
    /// API key for the Qdrant server, sent as `api-key` metadata.
    #[arg(long, env = "RAGSCOPE_QDRANT_API_KEY", hide_env_values = true)]
    pub qdrant_api_key: Option<String>,
    /// Largest chunk, in embedder tokens.
    #[arg(long, env = "RAGSCOPE_CHUNK_TOKENS", default_value_t = 200)]
    pub chunk_tokens: usize,
    /// Tokens each chunk repeats from the end of the previous one.
    #[arg(long, env = "RAGSCOPE_CHUNK_OVERLAP", default_value_t = 40)]
    pub chunk_overlap: usize,
}

#[derive(Debug, Clone, Args)]
pub struct PipelineArgs {
    /// Candidates retrieved per query unless the request says otherwise.
    #[arg(long, env = "RAGSCOPE_TOP_K", default_value_t = 20)]
    pub top_k: usize,
    /// Passages kept after reranking unless the request says otherwise.
    #[arg(long, env = "RAGSCOPE_RERANK_TOP_N", default_value_t = 4)]
    pub rerank_top_n: usize,
    /// Tokens generated unless the request says otherwise.
    #[arg(long, env = "RAGSCOPE_MAX_TOKENS", default_value_t = 128)]
    pub max_tokens: usize,
    /// How decode steps appear in traces: events, spans or off.
    #[arg(long, env = "RAGSCOPE_TOKEN_TRACE", value_enum, default_value_t = TokenTrace::Events)]
    pub token_trace: TokenTrace,
    /// Query embeddings kept in an LRU cache (0 turns it off).
    #[arg(long, env = "RAGSCOPE_QUERY_CACHE", default_value_t = 1024)]
    pub query_cache: usize,
    /// Record query and answer text on spans (off by default: content may be sensitive).
    #[arg(long, env = "RAGSCOPE_CAPTURE_CONTENT", default_value_t = false, action = clap::ArgAction::Set)]
    pub capture_content: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Address to listen on.
    #[arg(long, env = "RAGSCOPE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Address the gRPC API listens on, or `off`.
    #[arg(long, env = "RAGSCOPE_GRPC_LISTEN", default_value = "127.0.0.1:50051")]
    pub grpc_listen: OptionalAddr,
    /// Model-worker threads (each runs one request's model stages at a time). On the CPU the
    /// requests that are decoding at once share batched decode steps, so several workers
    /// raise throughput; each also prefills on the same cores, which is what lengthens TTFT.
    #[arg(long, env = "RAGSCOPE_WORKERS", default_value_t = 4)]
    pub workers: usize,
    /// Requests that may wait for a worker; beyond that the server answers 429.
    #[arg(long, env = "RAGSCOPE_QUEUE_CAPACITY", default_value_t = 32)]
    pub queue_capacity: usize,
    /// Longest a request may take, queueing included (seconds).
    #[arg(long, env = "RAGSCOPE_REQUEST_TIMEOUT", default_value = "120", value_parser = parse_seconds)]
    pub request_timeout: Duration,
    /// Largest request body in bytes.
    #[arg(long, env = "RAGSCOPE_MAX_BODY_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Corpus ingested on first start: git-doc (Debian's Git manuals) or none.
    #[arg(long, env = "RAGSCOPE_CORPUS", default_value = "git-doc")]
    pub corpus: String,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    #[command(flatten)]
    pub faults: FaultArgs,
}

/// Fault and latency injection (see `fault`): all off unless `--faults true`.
#[derive(Debug, Clone, Default, Args)]
pub struct FaultArgs {
    /// Allow fault and latency injection at all.
    #[arg(long, env = "RAGSCOPE_FAULTS", default_value_t = false, action = clap::ArgAction::Set)]
    pub faults: bool,
    /// The plan injected into every request from the start: JSON, or @file.
    #[arg(long, env = "RAGSCOPE_FAULT_PLAN")]
    pub fault_plan: Option<String>,
    /// Bearer token that `GET|PUT|DELETE /admin/faults` require; without it that endpoint is off.
    #[arg(long, env = "RAGSCOPE_FAULT_ADMIN_TOKEN", hide_env_values = true)]
    pub fault_admin_token: Option<String>,
    /// Let a request bring its own plan in the `x-ragscope-fault` header.
    #[arg(long, env = "RAGSCOPE_FAULT_HEADER", default_value_t = false, action = clap::ArgAction::Set)]
    pub fault_header: bool,
}

#[derive(Debug, Clone, Args)]
pub struct IngestArgs {
    /// Files or directories (text, Markdown, HTML).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct QueryArgs {
    /// The question.
    pub query: String,
    /// Server to ask.
    #[arg(long, env = "RAGSCOPE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Print the whole JSON response instead of streaming tokens.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct EvalArgs {
    /// Questions, one JSON object per line.
    #[arg(long, default_value = "eval/questions.jsonl")]
    pub questions: PathBuf,
    /// Cut-offs for recall@k.
    #[arg(long, value_delimiter = ',', default_value = "1,4,10")]
    pub k: Vec<usize>,
    /// Also generate answers and score them (slow: one generation per question).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub answers: bool,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Repetitions per measurement.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Synthetic chunks for the large retrieval measurement.
    #[arg(long, default_value_t = 100_000)]
    pub synthetic_chunks: usize,
    /// Instead of the stage figures, measure what telemetry costs: throughput and latency with
    /// telemetry off, with spans and metrics, and with profiling too, in interleaved rounds.
    #[arg(long)]
    pub telemetry_overhead: bool,
    /// Requests per variant per round (telemetry overhead).
    #[arg(long, default_value_t = 24)]
    pub requests: usize,
    /// Requests in flight at once (telemetry overhead).
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Instead of the stage figures, measure generation and embedding on the fixed inputs of
    /// the comparison with llama.cpp and PyTorch (`scripts/bench-peers`), read from this
    /// directory's `inputs.json`, which is built and written first if absent.
    #[arg(long, value_name = "DIR")]
    pub peer_inputs: Option<PathBuf>,
    /// With --peer-inputs: print the result as one JSON object instead of a table.
    #[arg(long, requires = "peer_inputs")]
    pub json: bool,
    /// With --peer-inputs: instead, decode with this many concurrent streams at once (e.g.
    /// `1,2,4,8,16`) and report aggregate decode tokens/s and time per output token.
    #[arg(long, requires = "peer_inputs", value_delimiter = ',')]
    pub streams: Vec<usize>,
    /// Tokens each stream decodes (with --streams).
    #[arg(long, default_value_t = 64)]
    pub stream_tokens: usize,
    /// Instead of the stage figures, time the decode matmul kernels on a synthetic 92,160 × 576
    /// matrix, in Q4_1 and Q8_0, for 1 to 16 activation rows: ms per multiply and GB/s of
    /// weights read. Needs no model.
    #[arg(long)]
    pub kernels: bool,
    /// Instead of the stage figures, time one CPU decode step of the generator's GGUF at 600-650
    /// positions of context, and its layer matmuls alone.
    #[arg(long)]
    pub decode_step: bool,
    /// Instead of the stage figures, run the embedder's forwards (candle's, the CPU one in F32
    /// and, with AVX-512 BF16, in BF16) in interleaved rounds on the peer benchmark's inputs
    /// (`inputs.json` in --peer-inputs, default data/bench-peers/inputs, which `ragscope bench
    /// --peer-inputs DIR` writes): batch-32 sentences/s and single-query p50 ms, each the
    /// median of --rounds rounds.
    #[arg(long)]
    pub embed_ab: bool,
    /// With --embed-ab: only the forwards whose name contains this (e.g. `Bf16`), for profiling.
    #[arg(long, requires = "embed_ab", value_name = "NAME")]
    pub ab_only: Option<String>,
    /// Instead of the stage figures, measure the generator's prefill and decode speed on the CPU
    /// in each weight format (a ~600-token prompt, then 128 greedy tokens, medians of 3), or
    /// only in those listed, e.g. `Q8_0,F32PrefillQ8Decode`. Run it on an idle machine.
    #[arg(long, value_name = "FORMATS", value_delimiter = ',', num_args = 0..)]
    pub weight_formats: Option<Vec<String>>,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

#[derive(Debug, Clone, Args)]
pub struct AttributeArgs {
    /// A server's recent-trace buffer (`GET /debug/traces`), e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub server: Option<String>,
    /// OTLP JSON files (the collector's file exporter: one export request per line).
    #[arg(long)]
    pub file: Vec<PathBuf>,
    /// A Jaeger query API, e.g. http://127.0.0.1:16686.
    #[arg(long)]
    pub jaeger: Option<String>,
    /// A Tempo HTTP API, e.g. http://127.0.0.1:3200.
    #[arg(long)]
    pub tempo: Option<String>,
    /// Service whose traces to fetch from Jaeger or Tempo.
    #[arg(long, default_value = "ragscope")]
    pub service: String,
    /// Most traces to fetch.
    #[arg(long, default_value_t = 1000)]
    pub limit: usize,
    /// How far back Jaeger searches (Jaeger's duration syntax).
    #[arg(long, default_value = "1h")]
    pub lookback: String,
    /// Analyse traces whose root span name starts with one of these (all roots if none given).
    #[arg(long, default_values_t = ["POST /v1/rag/query".to_string(), "POST /v1/chat/completions".to_string()])]
    pub root: Vec<String>,
    /// Also write the report as JSON (the load generator's report reads it).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A report written earlier with --json: say which stage explains the change.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
}

/// A socket address, or `off` for a listener that is not started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalAddr(pub Option<SocketAddr>);

impl std::str::FromStr for OptionalAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("off") {
            return Ok(OptionalAddr(None));
        }
        s.parse()
            .map(|a| OptionalAddr(Some(a)))
            .map_err(|e| format!("{s:?}: {e}; give host:port, e.g. 127.0.0.1:50051, or off"))
    }
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{s:?} is not a positive number of seconds"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_listen_is_an_address_or_off() {
        let serve = |extra: &[&str]| {
            let mut argv = vec!["ragscope", "serve"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(Command::Serve(s)) => Ok(s.server.grpc_listen),
                Ok(_) => unreachable!(),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(
            serve(&[]).unwrap().0,
            Some("127.0.0.1:50051".parse().unwrap())
        );
        assert_eq!(serve(&["--grpc-listen", "off"]).unwrap().0, None);
        assert_eq!(
            serve(&["--grpc-listen", "0.0.0.0:9000"]).unwrap().0,
            Some("0.0.0.0:9000".parse().unwrap())
        );
        let err = serve(&["--grpc-listen", "nowhere"]).unwrap_err();
        assert!(err.contains("or off"), "{err}");
    }
}
