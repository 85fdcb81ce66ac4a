//! Every setting, from command-line flags or `RAGSCOPE_*` environment variables; the
//! OpenTelemetry SDK reads the standard `OTEL_*` variables itself (see `telemetry`).
//! Each module's settings are one struct, flattened into the subcommands that need it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
pub use llm::settings::{GeneratorArgs, SnapshotArgs};
pub use rag::settings::{FaultArgs, ModelArgs, PipelineArgs, StoreArgs, TenantArgs};
pub use telemetry::TelemetryArgs;

#[derive(Debug, Parser)]
#[command(name = "ragscope", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Every subcommand starts telemetry, so these are global: given before or after the
    /// subcommand, and listed in every subcommand's help.
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
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
    /// Where the latency went: per-stage self/inclusive time, shares, critical path, residual.
    Attribute(AttributeArgs),
    /// Re-run a failure snapshot's generation and report the first position where tokens or
    /// KV-cache digests differ (exit 0 identical, 1 diverged, 2 error).
    Replay(ReplayArgs),
    /// Inspect the embedded store's files (stop the server first).
    Store {
        #[command(subcommand)]
        action: StoreAction,
    },
}

#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Snapshot files (from `<data-dir>/snapshots/` or `GET /debug/snapshots/{id}`).
    #[arg(required = true)]
    pub snapshots: Vec<PathBuf>,
    /// Where models are unpacked (one directory per model).
    #[arg(long, env = "RAGSCOPE_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Generator: a manifest name or a directory holding a GGUF file (and tokenizer.json).
    #[arg(
        long,
        env = "RAGSCOPE_GEN_MODEL",
        default_value = "SmolLM2-135M-Instruct"
    )]
    pub gen_model: String,
    /// Diagnostic: add DELTA to element INDEX (row-major) of a GGUF tensor before replaying,
    /// as `TENSOR:INDEX:DELTA` (e.g. `blk.3.attn_k.weight:100:0.5`); a quantised tensor's block
    /// holding the element is requantised. Repeatable.
    #[arg(long)]
    pub perturb_weight: Vec<String>,
    /// Print each report as one JSON object per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum StoreAction {
    /// Print every document's chunks, the shard's disk use and any inconsistency, as JSON
    /// (exit 1 when inconsistent). What the crash loop checks after each SIGKILL.
    Audit(StoreAuditArgs),
}

#[derive(Debug, Clone, Args)]
pub struct StoreAuditArgs {
    /// The data directory the server ran on.
    #[arg(long, env = "RAGSCOPE_DATA_DIR", default_value = "data")]
    pub data_dir: PathBuf,
    #[arg(long, env = "RAGSCOPE_COLLECTION", default_value = "ragscope")]
    pub collection: String,
    /// The collection's vector dimension (the embedder's: 384 for all-MiniLM-L6-v2).
    #[arg(long, default_value_t = 384)]
    pub dimension: usize,
}

#[derive(Debug, Subcommand)]
pub enum ModelsAction {
    /// Download, verify and unpack every model in models/manifest.json.
    Fetch(ModelArgs),
    /// Check every model file against its sha256.
    Verify(ModelArgs),
}

/// `--queue-wait-headroom`: a share from 0 to 0.9.
fn headroom(v: &str) -> Result<f64, String> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|h| (0.0..=0.9).contains(h))
        .ok_or_else(|| format!("{v:?}: expected a share from 0 to 0.9"))
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
    /// Longest a request may be expected to wait for a model worker (milliseconds, predicted
    /// from measured service times); a request that would wait longer is refused with 429 and
    /// Retry-After before any work. 0: only the queue capacity and the request timeout bound it.
    #[arg(long, env = "RAGSCOPE_MAX_QUEUE_WAIT_MS", default_value_t = 10_000)]
    pub max_queue_wait_ms: u64,
    /// Share of `--max-queue-wait-ms` kept back for the wait prediction's error (0 to 0.9): a
    /// request is admitted only if its predicted wait fits the rest, 8 s of a 10 s limit at the
    /// default. Under 4× overload the service slows after admission in episodes the prediction
    /// cannot see, and with no headroom 5% of admitted requests waited past the limit.
    #[arg(long, env = "RAGSCOPE_QUEUE_WAIT_HEADROOM", default_value_t = 0.2, value_parser = headroom)]
    pub queue_wait_headroom: f64,
    /// On SIGTERM or Ctrl-C: seconds to let requests in flight (streams included) finish while
    /// new ones get 503, before the server exits anyway.
    #[arg(long, env = "RAGSCOPE_SHUTDOWN_GRACE_S", default_value_t = 30)]
    pub shutdown_grace_s: u64,
    #[command(flatten)]
    pub connections: ConnectionArgs,
    #[command(flatten)]
    pub snapshots: SnapshotArgs,
}

/// How the HTTP and gRPC servers manage their connections: HTTP/2 keepalive pings, and a maximum
/// age after which a connection is closed gracefully (HTTP/1 finishes its response in flight then
/// closes, HTTP/2 sends GOAWAY and finishes its streams) so clients reconnect, as a load balancer
/// in front of replicas needs. Unset: no pings, connections live forever. `Default` is the
/// flags' defaults (what an embedded server without a command line gets).
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Seconds between HTTP/2 PINGs the servers send on each HTTP/2 connection (gRPC, h2c).
    #[arg(long, env = "RAGSCOPE_HTTP2_KEEPALIVE_INTERVAL_S", value_parser = parse_seconds)]
    pub http2_keepalive_interval_s: Option<Duration>,
    /// Seconds to wait for a PING's answer before closing the connection (needs the interval).
    #[arg(long, env = "RAGSCOPE_HTTP2_KEEPALIVE_TIMEOUT_S", value_parser = parse_seconds, requires = "http2_keepalive_interval_s")]
    pub http2_keepalive_timeout_s: Option<Duration>,
    /// Seconds after which a connection is closed once its requests finish (HTTP/2: GOAWAY).
    /// The HTTP server draws each connection's age within ±10% of it, so connections opened
    /// together do not all close together.
    #[arg(long, env = "RAGSCOPE_MAX_CONNECTION_AGE_S", value_parser = parse_seconds)]
    pub max_connection_age_s: Option<Duration>,
    /// Seconds a connection past its age may still take to finish its calls before it is cut.
    #[arg(long, env = "RAGSCOPE_MAX_CONNECTION_AGE_GRACE_S", value_parser = parse_seconds, requires = "max_connection_age_s")]
    pub max_connection_age_grace_s: Option<Duration>,
    /// Seconds an HTTP/1 client has to send a request's headers, counted from when the server
    /// starts waiting for them (a new connection, or the end of the previous response on a
    /// kept-alive one); a connection that takes longer is closed, so clients that trickle
    /// headers (or hold idle connections) cannot pile up.
    #[arg(long, env = "RAGSCOPE_HEADER_READ_TIMEOUT_S", value_parser = parse_seconds, default_value = HEADER_READ_TIMEOUT_S)]
    pub header_read_timeout_s: Duration,
    /// Open connections each listener (HTTP, gRPC) keeps at most. Past it a new HTTP
    /// connection is answered 503 `too_many_connections` with `Retry-After` and closed, a new
    /// gRPC one is closed at accept (the client sees UNAVAILABLE); both are counted. Bounds
    /// the file descriptors and memory idle or abandoned clients can hold.
    #[arg(long, env = "RAGSCOPE_MAX_CONNECTIONS", default_value_t = MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
}

/// `--max-connections`' default.
const MAX_CONNECTIONS: u32 = 1024;

/// `--header-read-timeout-s`'s default, shared by the flag and [`ConnectionArgs::default`].
const HEADER_READ_TIMEOUT_S: &str = "30";

impl Default for ConnectionArgs {
    fn default() -> Self {
        ConnectionArgs {
            http2_keepalive_interval_s: None,
            http2_keepalive_timeout_s: None,
            max_connection_age_s: None,
            max_connection_age_grace_s: None,
            header_read_timeout_s: parse_seconds(HEADER_READ_TIMEOUT_S).expect("a valid default"),
            max_connections: MAX_CONNECTIONS,
        }
    }
}

impl ServerArgs {
    pub fn max_queue_wait(&self) -> Duration {
        Duration::from_millis(self.max_queue_wait_ms)
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_s)
    }
}

/// API keys (see `api::auth`): off unless at least one is given. Each key is `SECRET` (user
/// scope: queries, chat, embeddings, rerank) or `admin:SECRET` (also document writes and
/// deletes, `/admin/*`, `/debug/*`).
#[derive(Clone, Default, Args)]
pub struct AuthArgs {
    /// An API key clients send as `Authorization: Bearer <key>`; `admin:KEY` gives it the admin
    /// scope. Repeatable; the variable takes a comma-separated list.
    #[arg(
        long = "api-key",
        env = "RAGSCOPE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line in the same syntax (`#` comments and blank lines
    /// skipped).
    #[arg(long, env = "RAGSCOPE_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
}

/// Keys are secrets: a debug print shows how many there are, never what they are.
impl std::fmt::Debug for AuthArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthArgs")
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("api_key_file", &self.api_key_file)
            .finish()
    }
}

/// What loading the models, the store and the pipeline reads, each crate's own settings side
/// by side: what `serve`, `eval` and the lab's benchmarks share.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub generator: GeneratorArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    #[command(flatten)]
    pub sampling: llm::SamplingArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub faults: FaultArgs,
    #[command(flatten)]
    pub ui: UiArgs,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub tenants: TenantArgs,
}

/// Links out of the waterfall page (`GET /`) to the same trace and profile in other tools.
/// Each is a base URL, given the tool's usual path, or a template with `{trace_id}`,
/// `{span_id}`, `{service}`, `{from}` and `{until}` (Unix seconds) filled in by the page.
#[derive(Debug, Clone, Default, Args)]
pub struct UiArgs {
    /// Jaeger's UI, e.g. http://localhost:16686 (the page links to /trace/{trace_id}).
    #[arg(long, env = "RAGSCOPE_UI_JAEGER_URL")]
    pub ui_jaeger_url: Option<String>,
    /// Tempo, e.g. http://localhost:3200 (links to /api/traces/{trace_id}), or a Grafana
    /// Explore URL template with {trace_id}.
    #[arg(long, env = "RAGSCOPE_UI_TEMPO_URL")]
    pub ui_tempo_url: Option<String>,
    /// Pyroscope's UI, e.g. http://localhost:4040 (links to the CPU profile of one span:
    /// service_name and span_id labels, around the trace's time).
    #[arg(long, env = "RAGSCOPE_UI_PYROSCOPE_URL")]
    pub ui_pyroscope_url: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct IngestArgs {
    /// Files or directories (text, Markdown, HTML).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub generator: GeneratorArgs,
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
    /// API key sent as `Authorization: Bearer <key>` (when the server has keys).
    #[arg(long, env = "RAGSCOPE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
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
    /// Also write every answer, one JSON object a line, to this file: the question, the
    /// expected facts, the context passages as the prompt got them, the answer, whether it
    /// carries a fact, its token counts and finish reason (to read why an answer missed).
    #[arg(long, value_name = "FILE")]
    pub dump: Option<PathBuf>,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub load: LoadArgs,
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
    /// A report written earlier with --json: say which stage's change is significant (a
    /// bootstrap interval of its per-request difference that excludes zero) and explains the
    /// end-to-end change.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Split the requests into windows of this many seconds (by start time) and name, per
    /// window, the stage that owns its SLO violations (see --slo-ms).
    #[arg(long)]
    pub window: Option<f64>,
    /// The end-to-end SLO for --window, in milliseconds: requests slower than this violate it.
    #[arg(long, default_value_t = 5000.0)]
    pub slo_ms: f64,
    /// A Prometheus that scrapes the Qdrant peers' /metrics (e.g. http://127.0.0.1:9090): set
    /// Qdrant's own time for the calls it answered beside the `retrieval` spans' time, for the
    /// window the traces cover.
    #[arg(long)]
    pub prometheus: Option<String>,
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

pub use telemetry::settings::parse_seconds;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::collections::BTreeSet;
    use std::path::Path;

    /// The text of `source` outside `#[cfg(test)]` items. A small lexer: it knows comments,
    /// strings, raw strings and char literals, so a brace inside one doesn't end an item.
    fn outside_test_items(source: &str) -> String {
        let s: Vec<char> = source.chars().collect();
        let test_attr: Vec<char> = "#[cfg(test)]".chars().collect();
        let find = |from: usize, what: &str| {
            let what: Vec<char> = what.chars().collect();
            (from..s.len())
                .find(|&j| s[j..].starts_with(&what))
                .map_or(s.len(), |j| j + what.len())
        };
        let mut kept = String::new();
        let (mut i, mut depth) = (0, 0i64);
        // While in a test item: the depth it began at, and whether its body opened.
        let mut item: Option<(i64, bool)> = None;
        while i < s.len() {
            let (start, was_in_item) = (i, item.is_some());
            let next = s.get(i + 1).copied();
            let after_ident = i > 0 && (s[i - 1].is_alphanumeric() || s[i - 1] == '_');
            match s[i] {
                '/' if next == Some('/') => i = find(i, "\n"),
                '/' if next == Some('*') => i = find(i + 2, "*/"),
                '"' => {
                    i += 1;
                    while i < s.len() && s[i] != '"' {
                        i += if s[i] == '\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                'r' if !after_ident && matches!(next, Some('"' | '#')) => {
                    let hashes = s[i + 1..].iter().take_while(|&&c| c == '#').count();
                    if s.get(i + 1 + hashes) == Some(&'"') {
                        i = find(i + 2 + hashes, &format!("\"{}", "#".repeat(hashes)));
                    } else {
                        i += 1;
                    }
                }
                '\'' if next == Some('\\') => i = find(i + 3, "'"),
                '\'' if s.get(i + 2) == Some(&'\'') => i += 3,
                '#' if item.is_none() && s[i..].starts_with(&test_attr) => {
                    item = Some((depth, false));
                    i += test_attr.len();
                }
                '{' => {
                    depth += 1;
                    i += 1;
                    if let Some((_, opened)) = item.as_mut() {
                        *opened = true;
                    }
                }
                '}' => {
                    depth -= 1;
                    i += 1;
                    if item.is_some_and(|(base, opened)| opened && depth == base) {
                        item = None;
                    }
                }
                ';' => {
                    i += 1;
                    if item.is_some_and(|(base, opened)| !opened && depth == base) {
                        item = None;
                    }
                }
                _ => i += 1,
            }
            if !was_in_item && item.is_none() {
                kept.extend(&s[start..i.min(s.len())]);
            }
        }
        assert!(item.is_none() && depth == 0, "unbalanced braces");
        kept
    }

    /// The `RAGSCOPE_*` names `source` mentions (code, strings or comments) outside tests.
    fn settings_named_in(source: &str) -> BTreeSet<String> {
        let text = outside_test_items(source);
        let mut names = BTreeSet::new();
        for (at, _) in text.match_indices("RAGSCOPE_") {
            let tail = &text[at + "RAGSCOPE_".len()..];
            let len = tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            let name = tail[..len].trim_end_matches('_');
            if !name.is_empty() {
                names.insert(format!("RAGSCOPE_{name}"));
            }
        }
        names
    }

    fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("source directory") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                rust_files(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }

    #[test]
    fn test_items_are_left_out_of_the_scan() {
        let source = r##"
            const A: &str = "RAGSCOPE_KEPT"; // and RAGSCOPE_ALSO_KEPT=1
            #[cfg(test)]
            fn helper() -> String {
                std::env::var("RAGSCOPE_TEST_FN").unwrap()
            }
            /// `RAGSCOPE_*` is no name.
            fn real() { let _ = "RAGSCOPE_AFTER"; }
            #[cfg(test)]
            use crate::names::RAGSCOPE_TEST_USE;
            #[cfg(test)]
            mod tests {
                #[test]
                fn t() { if true { let _ = ("{\"a\": ", '{', r#"}"#, "RAGSCOPE_TEST_MOD"); } }
            }
            const B: &str = "RAGSCOPE_LAST";
        "##;
        let names: Vec<String> = settings_named_in(source).into_iter().collect();
        assert_eq!(
            names,
            [
                "RAGSCOPE_AFTER",
                "RAGSCOPE_ALSO_KEPT",
                "RAGSCOPE_KEPT",
                "RAGSCOPE_LAST"
            ]
        );
    }

    /// Every `RAGSCOPE_*` variable the code names outside tests is a flag: `serve --help`
    /// lists the ones named outside the settings modules (read or set elsewhere, so easy to miss) and
    /// the telemetry ones; the others are in the help of the subcommand they belong to.
    #[test]
    fn serve_help_lists_every_setting_the_code_names() {
        // At run time first: the cached target dir is shared between checkouts.
        let crates = std::env::var_os("CARGO_MANIFEST_DIR")
            .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
            .join("..");
        // The crates the server links: each defines its settings in `settings.rs` (the
        // server's own and the flattening of the others' in `config.rs`).
        let mut files = Vec::new();
        for name in ["telemetry", "llm", "rag", "server"] {
            let src = crates.join(name).join("src");
            if src.is_dir() {
                rust_files(&src, &mut files);
            }
        }
        let (mut here, mut elsewhere) = (BTreeSet::new(), BTreeSet::new());
        for file in &files {
            let name = file.file_name().and_then(|n| n.to_str());
            if name == Some("testing.rs") {
                continue; // test support, compiled only for tests
            }
            let source = std::fs::read_to_string(file).expect("source file");
            let names = settings_named_in(&source);
            if matches!(name, Some("config.rs" | "settings.rs")) {
                here.extend(names);
            } else {
                elsewhere.extend(names);
            }
        }
        let telemetry = [
            "RAGSCOPE_PYROSCOPE_URL",
            "RAGSCOPE_PYROSCOPE_SAMPLE_RATE",
            "RAGSCOPE_PYROSCOPE_UPLOAD_INTERVAL",
            "RAGSCOPE_BAGGAGE_ATTRIBUTES",
            "RAGSCOPE_STAGE_SERVICES",
            "RAGSCOPE_TRACE_BUFFER",
        ];
        for name in telemetry {
            assert!(here.contains(name), "the scan missed {name}");
        }
        let mut cli = Cli::command();
        cli.build();
        let help_of = |path: &[&str]| {
            let mut cmd = cli.clone();
            for name in path {
                cmd = cmd.find_subcommand(name).expect("subcommand").clone();
            }
            cmd.render_long_help().to_string()
        };
        let lists = |help: &str, name: &str| {
            help.contains(&format!("[env: {name}=")) || help.contains(&format!("[env: {name}]"))
        };
        let serve = help_of(&["serve"]);
        let missing: Vec<&str> = elsewhere
            .iter()
            .map(String::as_str)
            .chain(telemetry)
            .filter(|name| !lists(&serve, name))
            .collect();
        assert!(missing.is_empty(), "not in `serve --help`: {missing:?}");
        assert!(lists(&serve, "PYROSCOPE_SERVER_ADDRESS"), "{serve}");
        let every_help: String = [
            &["serve"][..],
            &["ingest"],
            &["query"],
            &["eval"],
            &["attribute"],
            &["models", "fetch"],
            &["models", "verify"],
        ]
        .iter()
        .map(|path| help_of(path))
        .collect();
        let unlisted: Vec<&String> = here.iter().filter(|n| !lists(&every_help, n)).collect();
        assert!(unlisted.is_empty(), "in no subcommand's help: {unlisted:?}");
    }

    #[test]
    fn telemetry_flags_go_before_or_after_the_subcommand() {
        let telemetry = |argv: &[&str]| Cli::try_parse_from(argv).map(|c| c.telemetry);
        let defaults = telemetry(&["ragscope", "serve"]).unwrap();
        assert_eq!(defaults.trace_buffer, 4096);
        assert_eq!(defaults.pyroscope_sample_rate, 100);
        assert_eq!(defaults.pyroscope_upload_interval, Duration::from_secs(10));
        assert!(!defaults.stage_services);
        assert_eq!(defaults.pyroscope_server(), None);
        assert!(defaults.baggage_keys().is_empty());
        for argv in [
            &[
                "ragscope",
                "--trace-buffer",
                "7",
                "--stage-services",
                "1",
                "serve",
            ][..],
            &[
                "ragscope",
                "serve",
                "--trace-buffer",
                "7",
                "--stage-services",
                "true",
            ],
        ] {
            let t = telemetry(argv).unwrap();
            assert_eq!(t.trace_buffer, 7, "{argv:?}");
            assert!(t.stage_services, "{argv:?}");
        }
        let t = telemetry(&[
            "ragscope",
            "query",
            "why?",
            "--baggage-attributes",
            "tenant, colour,,",
            "--pyroscope-server-address",
            "http://p:4040",
            "--pyroscope-upload-interval",
            "2.5",
        ])
        .unwrap();
        assert_eq!(t.baggage_keys(), ["tenant", "colour"]);
        assert_eq!(t.pyroscope_server(), Some("http://p:4040"));
        assert_eq!(t.pyroscope_upload_interval, Duration::from_millis(2500));
        let both = telemetry(&[
            "ragscope",
            "serve",
            "--pyroscope-url",
            "http://ours:4040",
            "--pyroscope-server-address",
            "http://theirs:4040",
        ])
        .unwrap();
        assert_eq!(both.pyroscope_server(), Some("http://ours:4040"));
        let err = telemetry(&["ragscope", "serve", "--stage-services", "yes"]).unwrap_err();
        assert!(err.to_string().contains("give true, 1"), "{err}");
    }

    #[test]
    fn api_keys_repeat_split_on_commas_and_stay_out_of_debug_output() {
        let argv = [
            "ragscope",
            "serve",
            "--api-key",
            "k1,admin:zq9-secret",
            "--api-key",
            "k3",
        ];
        let Command::Serve(serve) = Cli::try_parse_from(argv).unwrap().command else {
            unreachable!()
        };
        assert_eq!(serve.auth.api_keys, ["k1", "admin:zq9-secret", "k3"]);
        let printed = format!("{serve:?}");
        assert!(
            !printed.contains("zq9-secret") && printed.contains("3 redacted"),
            "{printed}"
        );
    }

    #[test]
    fn connection_defaults_are_the_flags_defaults() {
        let Command::Serve(serve) = Cli::try_parse_from(["ragscope", "serve"]).unwrap().command
        else {
            unreachable!()
        };
        assert_eq!(
            format!("{:?}", serve.server.connections),
            format!("{:?}", ConnectionArgs::default())
        );
    }

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
