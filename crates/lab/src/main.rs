//! `ragscope-lab`: the benchmarks and experiments beside the server, not inside it. Each
//! subcommand measures one thing on this machine and prints numbers (a table, or JSON for the
//! scripts that compare us with peers); none of them asserts anything. The server's own
//! settings (`--models-dir`, `--data-dir`, the pipeline's defaults…) are taken as `serve` takes
//! them, so a measurement runs the configuration a user would.
//!
//! - [`stages`]: the speed of every stage (embed, retrieve, prefill, decode, a whole request).
//! - [`overhead`]: what telemetry costs a server under load.
//! - [`peers`]: the fixed inputs of the comparison with llama.cpp and PyTorch
//!   (`scripts/bench-peers`), and the decode-stream, prefill-interference and prefill-only
//!   measurements on the same inputs ([`streams`], [`interference`]); and the RAG-answer
//!   decode workload of the same comparison ([`rag_answers`]).
//! - [`speculation`]: RAG answers' decode with and without speculative decoding from the
//!   prompt, through the whole pipeline on the evaluation questions.
//! - [`micro`]: one piece of compute at a time: the decode kernels, one decode step, the
//!   embedder's forwards against each other.

mod interference;
mod micro;
mod overhead;
mod peers;
mod rag_answers;
mod speculation;
mod stages;
mod streams;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use llm::settings::prefill_chunk_tokens;
use ragscope::config::{LoadArgs, ServerArgs};
use telemetry::names::span;
use telemetry::span::Stage;
use telemetry::TelemetryArgs;

#[derive(Debug, Parser)]
#[command(
    name = "ragscope-lab",
    version,
    about = "Benchmarks and experiments for ragscope"
)]
struct Cli {
    #[command(subcommand)]
    command: Experiment,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

#[derive(Debug, Subcommand)]
enum Experiment {
    /// The speed of every stage on this machine, as a table (the prefix cache off, so every
    /// prefill computes its whole prompt).
    Stages(StagesArgs),
    /// What telemetry costs: the same load against three `ragscope serve` processes (telemetry
    /// off, spans and metrics exported, profiling too), in rounds of a fresh random order,
    /// caches off (or equally warm): each cost with its 95% interval.
    Overhead(OverheadArgs),
    /// Generation and embedding on the fixed inputs of the comparison with llama.cpp and
    /// PyTorch (`scripts/bench-peers`), built into `DIR/inputs.json` first if absent; with
    /// `--rag-answers`, greedy decode of the default RAG prompts instead.
    Peers(PeersCompareArgs),
    /// On the peer inputs: decode with this many concurrent streams at once and report the
    /// aggregate decode tokens/s and time per output token.
    Streams(StreamsArgs),
    /// On the peer inputs: a decoding stream's time per output token while a second stream
    /// prefills the peer prompt, for each prefill chunk size (medians of interleaved rounds).
    Interference(InterferenceArgs),
    /// On the peer inputs: the peer prompt's prefill alone, each round and the median: for
    /// comparing builds and for profiling the prefill.
    Prefill(PeersArgs),
    /// The decode matmul kernels on a synthetic 92,160 × 576 matrix, in Q4_1 and Q8_0, for 1 to
    /// 16 activation rows: ms per multiply and GB/s of weights read; then each prefill
    /// projection shape at 588 rows on candle's F32 GEMM and on the int8 GEMM. Needs no model.
    Kernels,
    /// One CPU decode step of the generator at 600-650 positions of context (and at 10-60), and
    /// its layer matmuls and output head alone; then the same for a step of four rows (a token
    /// and three drafts to verify).
    DecodeStep(Setup),
    /// RAG answers to the evaluation questions under each `--speculation` setting (the first
    /// is the baseline), every question under every setting in a rotating order: decode
    /// tokens/s, the speed-up with its 95% interval, acceptance, and answers that stayed the
    /// same.
    Speculation(SpeculationArgs),
    /// The embedder's forwards (candle's, the CPU one in F32 and, with AVX-512 BF16, in BF16) in
    /// interleaved rounds on the peer inputs: batch-32 sentences/s and single-query p50 ms.
    EmbedAb(EmbedAbArgs),
}

/// What every measurement loads: the server's own settings, and how many rounds to run.
#[derive(Debug, Clone, Args)]
pub struct Setup {
    /// Repetitions per measurement.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub load: LoadArgs,
}

#[derive(Debug, Clone, Args)]
struct StagesArgs {
    /// Synthetic chunks for the large retrieval measurement (0: none).
    #[arg(long, default_value_t = 100_000)]
    synthetic_chunks: usize,
    #[command(flatten)]
    setup: Setup,
}

#[derive(Debug, Clone, Args)]
struct OverheadArgs {
    /// Requests per variant per round (the same questions for each variant in a round).
    #[arg(long, default_value_t = 24)]
    requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// How the servers' caches stand: `off` (each request does all its work) or `warm` (every
    /// question sent to every server first).
    #[arg(long, value_enum, default_value = "off")]
    caches: overhead::Caches,
    /// Seed of each round's variant order.
    #[arg(long, default_value_t = 17)]
    seed: u64,
    /// Question files (JSON lines with a `question`), asked in turn.
    #[arg(
        long,
        value_name = "FILE",
        default_values = ["eval/questions.jsonl", "eval/heldout.jsonl", "eval/howto.jsonl", "eval/named.jsonl"]
    )]
    questions: Vec<PathBuf>,
    /// The server binary to measure (default: `ragscope` beside this binary).
    #[arg(long, value_name = "FILE")]
    server_binary: Option<PathBuf>,
    #[command(flatten)]
    setup: Setup,
}

#[derive(Debug, Clone, Args)]
struct PeersArgs {
    /// Where the peer inputs are (`inputs.json`, written first if absent).
    #[arg(long, value_name = "DIR")]
    inputs: PathBuf,
    /// Print the result as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    setup: Setup,
}

#[derive(Debug, Clone, Args)]
struct PeersCompareArgs {
    /// Instead of the fixed inputs: for each evaluation question, the prompt the default
    /// pipeline builds, decoded greedily for as many tokens as our greedy answer to it has,
    /// with speculation off and as `--speculation` sets it (`DIR/rag-inputs.json`, written
    /// first if absent).
    #[arg(long)]
    rag_answers: bool,
    /// With `--rag-answers`: the first this many questions (0: all) when `rag-inputs.json` is
    /// built.
    #[arg(long, default_value_t = 0, requires = "rag_answers")]
    limit: usize,
    #[command(flatten)]
    peers: PeersArgs,
}

#[derive(Debug, Clone, Args)]
struct StreamsArgs {
    /// Concurrent streams to measure, e.g. `1,2,4,8,16`.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    streams: Vec<usize>,
    /// Tokens each stream decodes.
    #[arg(long, default_value_t = 64)]
    stream_tokens: usize,
    #[command(flatten)]
    peers: PeersArgs,
}

#[derive(Debug, Clone, Args)]
struct InterferenceArgs {
    /// Prefill chunk sizes to measure (multiples of 32, at most 512).
    #[arg(long, value_delimiter = ',', default_value = "512,256,128,64", value_parser = prefill_chunk_tokens)]
    prefill_chunks: Vec<usize>,
    #[command(flatten)]
    peers: PeersArgs,
}

#[derive(Debug, Clone, Args)]
struct EmbedAbArgs {
    /// The directory holding the peer inputs' `inputs.json`.
    #[arg(long, value_name = "DIR", default_value = "data/bench-peers/inputs")]
    inputs: PathBuf,
    /// Only the forwards whose name contains this (e.g. `Bf16`), for profiling.
    #[arg(long, value_name = "NAME")]
    ab_only: Option<String>,
    #[command(flatten)]
    setup: Setup,
}

#[derive(Debug, Clone, Args)]
struct SpeculationArgs {
    /// Settings to compare, the first the baseline (`--speculation`'s values).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "off,prompt-lookup:4:3,prompt-lookup:8:3"
    )]
    settings: Vec<llm::speculate::Speculation>,
    /// Question files (JSON lines with a `question`), asked in turn.
    #[arg(
        long,
        value_name = "FILE",
        default_values = ["eval/questions.jsonl", "eval/heldout.jsonl", "eval/howto.jsonl", "eval/named.jsonl"]
    )]
    questions: Vec<PathBuf>,
    /// At most this many questions (0: all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Questions asked at once (their decode steps batched together).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    #[command(flatten)]
    setup: Setup,
}

impl Experiment {
    /// The server settings the measurement loads with, if it loads any.
    fn setup(&self) -> Option<&Setup> {
        match self {
            Experiment::Stages(a) => Some(&a.setup),
            Experiment::Overhead(a) => Some(&a.setup),
            Experiment::Peers(a) => Some(&a.peers.setup),
            Experiment::Prefill(a) => Some(&a.setup),
            Experiment::Streams(a) => Some(&a.peers.setup),
            Experiment::Interference(a) => Some(&a.peers.setup),
            Experiment::DecodeStep(setup) => Some(setup),
            Experiment::EmbedAb(a) => Some(&a.setup),
            Experiment::Speculation(a) => Some(&a.setup),
            Experiment::Kernels => None,
        }
    }
}

fn main() -> Result<()> {
    // As the server does: before any thread exists, the heap keeps what models free.
    llm::device::keep_freed_memory();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run())
}

async fn run() -> Result<()> {
    let args = Cli::parse();
    let _telemetry = telemetry::init(&args.telemetry)?;
    // Every measurement runs the kernels at the level `--cpu-level` asks for, as `serve` does.
    if let Some(setup) = args.command.setup() {
        llm::cpu::set_cap(setup.load.generator.cpu_level).map_err(anyhow::Error::msg)?;
    }
    eprintln!("{}", llm::cpu::describe());
    let blocking = |f: Box<dyn FnOnce() -> Result<()> + Send>| tokio::task::spawn_blocking(f);
    match args.command {
        Experiment::Stages(a) => {
            let handle = tokio::runtime::Handle::current();
            blocking(Box::new(move || {
                stages::run(&a.setup, a.synthetic_chunks, &handle)
            }))
            .await?
        }
        Experiment::Overhead(a) => {
            let plan = overhead::Plan {
                requests: a.requests,
                concurrency: a.concurrency,
                caches: a.caches,
                seed: a.seed,
                questions: a.questions,
                binary: a.server_binary,
            };
            overhead::run(&a.setup, plan).await
        }
        Experiment::Peers(a) if a.rag_answers => {
            let handle = tokio::runtime::Handle::current();
            blocking(Box::new(move || {
                rag_answers::run(&a.peers, a.limit, &handle)
            }))
            .await?
        }
        Experiment::Peers(a) => {
            blocking(Box::new(move || peers::run(&a.peers, peers::Mode::Compare))).await?
        }
        Experiment::Prefill(a) => {
            blocking(Box::new(move || peers::run(&a, peers::Mode::Prefill))).await?
        }
        Experiment::Streams(a) => {
            let mode = peers::Mode::Streams {
                streams: a.streams,
                tokens: a.stream_tokens,
            };
            blocking(Box::new(move || peers::run(&a.peers, mode))).await?
        }
        Experiment::Interference(a) => {
            let mode = peers::Mode::Interference {
                chunks: a.prefill_chunks,
            };
            blocking(Box::new(move || peers::run(&a.peers, mode))).await?
        }
        Experiment::Kernels => blocking(Box::new(micro::kernels)).await?,
        Experiment::DecodeStep(setup) => {
            blocking(Box::new(move || micro::decode_step(&setup))).await?
        }
        Experiment::Speculation(a) => {
            let handle = tokio::runtime::Handle::current();
            let plan = speculation::Plan {
                settings: a.settings,
                questions: a.questions,
                limit: a.limit,
                concurrency: a.concurrency,
            };
            blocking(Box::new(move || speculation::run(&a.setup, &plan, &handle))).await?
        }
        Experiment::EmbedAb(a) => {
            blocking(Box::new(move || {
                micro::embed_ab(&a.setup, &a.inputs, a.ab_only.as_deref())
            }))
            .await?
        }
    }
}

/// The root stage of a measurement (no request span above it).
fn stage() -> Stage {
    Stage::root(span::BENCH)
}

/// p-th percentile (0..=100) of durations, in milliseconds, interpolated between the nearest
/// ranks as the load generator's are; NaN for none. Sorts `samples` in place.
fn percentile(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let ms: Vec<f64> = samples
        .iter()
        .map(|d| telemetry::clock::millis(*d))
        .collect();
    measure::stats::percentile(&ms, p / 100.0)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
