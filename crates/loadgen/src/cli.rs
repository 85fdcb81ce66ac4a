//! The command line: `run` (one load), `knee` (step the rate up), `gate` (compare with a baseline)
//! and `report` (rebuild the HTML from an output directory). Flags shared by the load-driving
//! commands live in [`Target`] and [`Shape`].

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::schedule::{GradientKind, Range};

#[derive(Debug, Parser)]
#[command(
    name = "ragscope-loadgen",
    version,
    about = "Load generator, knee finder and perf gate for a ragscope server"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one load (open or closed loop) and write requests.jsonl, summary.json and report.html.
    Run(RunArgs),
    /// Step the offered open-loop rate up until p95 TTFT or the error rate passes its threshold.
    Knee(KneeArgs),
    /// Run the small fixed load of a baseline file and fail on a regression beyond its thresholds.
    Gate(GateArgs),
    /// Rebuild report.html from an existing output directory.
    Report(ReportArgs),
    /// Experiments that show a measurement trap on a real server.
    #[command(subcommand)]
    Experiment(Experiment),
    /// Replicas and Qdrant a target rps at a p95 TTFT SLO needs, from a knee run (docs/SCALING.md).
    Plan(crate::plan::PlanArgs),
}

#[derive(Debug, Subcommand)]
pub enum Experiment {
    /// Inject exponential and Pareto(α=1.5) delays of the same mean into one stage and compare
    /// the measured P99 (with its interval) with what light-tailed assumptions predict.
    Tails(TailsArgs),
    /// A share of cold requests (caches miss) among hot ones, at each `--cold-share`, against
    /// an all-hot baseline: the P99 amplification and the stage that missed.
    Cold(ColdArgs),
    /// The same load (gRPC or HTTP) against servers with different maximum connection ages
    /// (or other connection settings), in interleaved rounds, with and without the client's
    /// retry of refused requests: what forced reconnects do to P99.
    Reconnect(ReconnectArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ColdArgs {
    #[command(flatten)]
    pub target: Target,
    /// Cold shares to run, comma-separated (an all-hot arm at 0 runs first as the baseline).
    #[arg(long, value_delimiter = ',', default_value = "0.01,0.1")]
    pub cold_shares: Vec<f64>,
    /// Requests per arm.
    #[arg(long, default_value_t = 300)]
    pub requests: u64,
    /// Concurrent closed-loop users.
    #[arg(long, default_value_t = 1)]
    pub users: usize,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    /// Output directory: one run per arm under it, and cold.json.
    #[arg(long, default_value = "loadgen-cold")]
    pub out: PathBuf,
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ReconnectArgs {
    #[command(flatten)]
    pub target: Target,
    /// An arm: `NAME=URL` of a server (started with the connection setting the name stands
    /// for, e.g. `100ms=http://127.0.0.1:50053`): its gRPC address with `--endpoint grpc`, its
    /// HTTP one otherwise. Repeat for each arm.
    #[arg(long = "arm", required = true)]
    pub arms: Vec<String>,
    /// Also run every arm with `--retry-refused`, as `NAME+retry`, next to it (after it in
    /// even rounds, before it in odd ones, so neither always finds the other's caches warm).
    #[arg(long)]
    pub with_retry: bool,
    /// Rounds; each round runs every arm once, in turn, so drift on the box hits all arms alike.
    /// Even with `--with-retry`, so each of a pair goes first (on the colder caches) as often.
    #[arg(long, default_value_t = 4)]
    pub rounds: usize,
    /// Requests per arm and round.
    #[arg(long, default_value_t = 100)]
    pub requests: u64,
    /// Concurrent closed-loop users (over gRPC they share one HTTP/2 connection; over HTTP
    /// each holds a keep-alive connection of the pool).
    #[arg(long, default_value_t = 4)]
    pub users: usize,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    #[arg(long, default_value = "loadgen-reconnect")]
    pub out: PathBuf,
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args)]
pub struct TailsArgs {
    #[command(flatten)]
    pub target: Target,
    /// The stage the delays go into (its time is read from the server's `done` timings).
    #[arg(long, default_value = "retrieval", value_parser = ["embeddings", "retrieval", "rerank", "prompt"])]
    pub stage: String,
    /// Mean of both injected delays, milliseconds.
    #[arg(long, default_value_t = 100.0)]
    pub mean_ms: f64,
    /// Requests per distribution (a P99 needs ≥ 1000 to rest on 10 samples beyond it).
    #[arg(long, default_value_t = 500)]
    pub requests: u64,
    /// Concurrent closed-loop users.
    #[arg(long, default_value_t = 1)]
    pub users: usize,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    /// Output directory: one run per distribution under it, and tails.json.
    #[arg(long, default_value = "loadgen-tails")]
    pub out: PathBuf,
    #[arg(long)]
    pub quiet: bool,
}

/// Which streaming API the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST /v1/rag/query` with `stream: true` (events sources, token, done, error).
    Rag,
    /// `POST /v1/chat/completions` with `stream: true` (OpenAI chunks, then `[DONE]`).
    Openai,
    /// gRPC `ragscope.v1.Rag/Query` (server-streaming) at `--url` (the `--grpc-listen` address).
    Grpc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Requests arrive on a schedule whatever the server does (Poisson plus bursts).
    Open,
    /// `--users` users each send, wait for the answer, think, and send again.
    Closed,
}

/// Where requests go and what they ask.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct Target {
    /// Base URL of the server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// API key sent as `Authorization: Bearer <key>` (a server started with `--api-key`).
    /// Never written to the outputs.
    #[arg(long, env = "RAGSCOPE_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// The streaming API to drive.
    #[arg(long, value_enum, default_value = "rag")]
    pub endpoint: Endpoint,
    /// The `model` sent to /v1/chat/completions.
    #[arg(long, default_value = "ragscope")]
    pub model: String,
    /// JSON-lines query set; each line's `question` (or `query`). Line order is popularity rank.
    #[arg(long, default_value = "eval/questions.jsonl")]
    pub queries: PathBuf,
    /// Zipf exponent of query popularity (0 = uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf_alpha: f64,
    /// `max_tokens` of every request (unset: the server's default). Small values make runs short.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// What the requested context grows with: none, popularity rank, or time.
    #[arg(long, value_enum, default_value = "none")]
    pub gradient: GradientKind,
    /// `top_k` (retrieved passages): N, or MIN:MAX along the gradient. Unset: server default.
    #[arg(long)]
    pub top_k: Option<Range>,
    /// `rerank_top_n` (passages in the prompt): N, or MIN:MAX along the gradient.
    #[arg(long)]
    pub rerank_top_n: Option<Range>,
    /// Per-request limit in seconds, headers to last event; past it the request counts as `timeout`.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// Seed of the schedule, query draws and gradient (trace ids stay random so runs don't collide).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Open loop: requests in flight beyond this are not sent and count as `dropped`.
    #[arg(long, default_value_t = 512)]
    pub max_in_flight: usize,
    /// A fault plan sent with every request as the `x-ragscope-fault` header (JSON, as in the
    /// README's "Fault and latency injection"; the server needs `--faults true --fault-header true`).
    #[arg(long)]
    pub fault: Option<String>,
    /// Share of requests that are cold: a variant of the drawn question never sent before, so
    /// the server's query-embedding and prefix KV caches miss.
    #[arg(long, default_value_t = 0.0)]
    pub cold_share: f64,
    /// Share of requests whose `filter` matches no document.
    #[arg(long, default_value_t = 0.0)]
    pub no_match_share: f64,
    /// Share of requests whose question gets a typo or a paraphrase template (seeded, recorded
    /// per request as `perturbation`).
    #[arg(long, default_value_t = 0.0)]
    pub perturb_rate: f64,
    /// Mirror every request to this second server (same endpoint kind); its answers go to
    /// `shadow.jsonl` and never hold up or enter the primary's figures.
    #[arg(long)]
    pub shadow: Option<String>,
    /// Send a request again, once, when its connection refused it before any response came
    /// back (gRPC `Cancelled`/`Unavailable` on a channel that had its GOAWAY; HTTP: a pooled
    /// connection closed under the request). Recorded per request as `retried`; its times
    /// count from the first attempt.
    #[arg(long)]
    #[serde(default)]
    pub retry_refused: bool,
    /// Before measuring, send every question of the query set once, one at a time (not
    /// recorded): the run then meets the server's caches the way a second run would, so a run
    /// and its baseline compare warm against warm instead of a cold first run against a hot
    /// second one.
    #[arg(long)]
    #[serde(default)]
    pub warm: bool,
}

/// How the load arrives and how long it lasts.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct Shape {
    #[arg(long, value_enum, default_value = "open")]
    pub mode: Mode,
    /// Open loop: Poisson arrivals per second.
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// Open loop: bursts per second (a Poisson process of bursts); 0 = none.
    #[arg(long, default_value_t = 0.0)]
    pub burst_rate: f64,
    /// Open loop: requests per burst, all sent at the same instant.
    #[arg(long, default_value_t = 0)]
    pub burst_size: usize,
    /// Closed loop: concurrent users.
    #[arg(long, default_value_t = 1)]
    pub users: usize,
    /// Closed loop: mean think time between a user's answer and its next request (exponential); 0 = none.
    #[arg(long, default_value_t = 0.0)]
    pub think_ms: f64,
    /// Warm-up seconds (sent, recorded, not summarised).
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,
    /// Steady seconds: the phase the summary counts.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Cool-down seconds (sent, recorded, not summarised).
    #[arg(long, default_value_t = 0.0)]
    pub cooldown: f64,
    /// Stop after sending this many requests in all (whichever bound comes first).
    #[arg(long)]
    pub requests: Option<u64>,
}

/// The isolation check: who else used the CPU during the run, and keeping the client apart.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct IsolationArgs {
    /// The server's pid, when it runs on this machine under another port owner (unset: found
    /// from the listening port of a local --url; a remote server's `/metrics` otherwise).
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Pin the load generator's threads to these CPUs (a taskset list: `3`, `2-3`); pin the
    /// server to the others with `taskset -c`. Needs cores to spare: on 2 cores the check flags
    /// the client's share instead.
    #[arg(long)]
    pub pin_client: Option<String>,
    /// Flag the run when the client or the other processes took more than this share of the
    /// box's CPU capacity.
    #[arg(long, default_value_t = 0.10)]
    pub isolation_threshold: f64,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub target: Target,
    #[command(flatten)]
    pub shape: Shape,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    /// Output directory (created): requests.jsonl, summary.json, report.html.
    #[arg(long, default_value = "loadgen-out")]
    pub out: PathBuf,
    /// Attribution JSON (`ragscope attribute --json FILE`) to add a per-stage breakdown to the report.
    #[arg(long)]
    pub attribution: Option<PathBuf>,
    /// Replay a recorded `requests.jsonl`: the same questions, filters and context sizes, sent
    /// at the recorded offsets (the original inter-arrival times). `--perturb-rate` still applies.
    #[arg(long, conflicts_with_all = ["mode", "rate", "users", "burst_rate", "burst_size", "think_ms", "cold_share", "no_match_share", "requests"])]
    pub replay: Option<PathBuf>,
    /// No progress line on stderr.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args, Serialize)]
pub struct KneeArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub target: Target,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    /// Offered rate of the first step, requests per second.
    #[arg(long, default_value_t = 0.25)]
    pub start_rate: f64,
    /// Each step multiplies the rate by this (unless --step is given).
    #[arg(long, default_value_t = 1.5)]
    pub factor: f64,
    /// Each step adds this many requests per second instead of multiplying.
    #[arg(long)]
    pub step: Option<f64>,
    /// Steady seconds per step.
    #[arg(long, default_value_t = 20.0)]
    pub step_duration: f64,
    /// Warm-up seconds at the start of each step (not counted).
    #[arg(long, default_value_t = 0.0)]
    pub step_warmup: f64,
    /// Give up after this many steps.
    #[arg(long, default_value_t = 12)]
    pub max_steps: usize,
    /// Never offer more than this rate.
    #[arg(long, default_value_t = 1000.0)]
    pub max_rate: f64,
    /// A step fails when its p95 TTFT exceeds this (milliseconds).
    #[arg(long, default_value_t = 5000.0)]
    pub max_p95_ttft_ms: f64,
    /// A step fails when its error rate exceeds this fraction.
    #[arg(long, default_value_t = 0.05)]
    pub max_error_rate: f64,
    /// Output directory.
    #[arg(long, default_value = "loadgen-knee")]
    pub out: PathBuf,
    #[arg(long)]
    pub attribution: Option<PathBuf>,
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args)]
pub struct GateArgs {
    /// Baseline file: the fixed load (as `run` flags), the expected figures and the thresholds.
    #[arg(long, default_value = "perf/baseline.json")]
    pub baseline: PathBuf,
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Query set, relative to where the command runs.
    #[arg(long, default_value = "eval/questions.jsonl")]
    pub queries: PathBuf,
    /// Output directory of the gate's load run.
    #[arg(long, default_value = "loadgen-gate")]
    pub out: PathBuf,
    /// Confidence of the gate's decisions: "regression" and "no regression" each need at least
    /// this; between the two the gate says "inconclusive" and how many more requests would do.
    #[arg(long, default_value_t = 0.95)]
    pub confidence: f64,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// An output directory of `run`, `knee` or `gate`.
    #[arg(long)]
    pub from: PathBuf,
    #[arg(long)]
    pub attribution: Option<PathBuf>,
}
