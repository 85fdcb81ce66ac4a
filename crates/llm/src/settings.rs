//! The generator's settings, flattened by the binary into the commands that load a model:
//! which model and where it runs, its context, caches and weight format, how its decode steps
//! show on the trace, and its failure snapshots. Every flag has a `RAGSCOPE_*` variable.

use clap::Args;

/// The generator: which one, on what device, and how it runs.
#[derive(Debug, Clone, Args)]
pub struct GeneratorArgs {
    /// Generator: a manifest name or a directory holding a GGUF file and tokenizer.json.
    #[arg(
        long,
        env = "RAGSCOPE_GEN_MODEL",
        default_value = "SmolLM2-135M-Instruct"
    )]
    pub gen_model: String,
    /// Where models run: cpu, cuda, cuda:N or auto.
    #[arg(long, env = "RAGSCOPE_DEVICE", default_value = "cpu")]
    pub device: String,
    /// The highest instruction-set level the CPU kernels may use: `portable`, `avx2`, `avx512`,
    /// `avx512bf16` or `amx`; unset: the best this CPU has. Lower levels give the same answers
    /// within the tolerances the tests hold them to, slower: for testing the fallbacks.
    #[arg(long, env = "RAGSCOPE_CPU_LEVEL", value_enum)]
    pub cpu_level: Option<crate::cpu::Level>,
    /// On a GPU, time every Nth decode step with CUDA events (a `gpu decode_step` span; 0: none,
    /// 1: every step). Each timed step waits for the device once more than it would anyway.
    #[arg(long, env = "RAGSCOPE_GPU_DECODE_SAMPLE", default_value_t = 8)]
    pub gpu_decode_sample: usize,
    /// Batched decode steps (CPU) as spans of their own, each the root of its own trace and
    /// linked from its members' `decode` spans: `all`, `sampled:N` (one step in N, carrying the
    /// totals of the steps since the previous one) or `off`.
    #[arg(long, env = "RAGSCOPE_DECODE_STEP_SPANS", default_value_t = crate::schedule::StepTrace::DEFAULT.spans)]
    pub decode_step_spans: crate::schedule::StepSpans,
    /// Links a request's `decode` span keeps to the step spans it took part in (the first
    /// ones; the rest are counted in `rag.decode.step_links.dropped`).
    #[arg(long, env = "RAGSCOPE_DECODE_STEP_LINKS", default_value_t = crate::schedule::StepTrace::DEFAULT.links, value_parser = step_links)]
    pub decode_step_links: usize,
    /// Upper bound on prompt + generated tokens per request.
    #[arg(long, env = "RAGSCOPE_MAX_CONTEXT", default_value_t = 2048)]
    pub max_context: usize,
    /// MiB of prompt-prefix keys and values kept for later prompts to start from (LRU; 0: off).
    #[arg(long, env = "RAGSCOPE_PREFIX_CACHE_MB", default_value_t = crate::PREFIX_CACHE_DEFAULT_MB)]
    pub prefix_cache_mb: usize,
    /// Tokens per prefill chunk (a multiple of 32, 32-512). Between chunks, as between layers,
    /// other requests' batched decode steps run, so a smaller chunk bounds their time per
    /// output token while a long prompt prefills, at some cost to that prefill.
    #[arg(long, env = "RAGSCOPE_PREFILL_CHUNK_TOKENS", default_value_t = crate::forward::PREFILL_CHUNK, value_parser = prefill_chunk_tokens)]
    pub prefill_chunk_tokens: usize,
    /// The generator's weight format (`WeightFormat`'s names, e.g. `Bf16PrefillQ4Decode`);
    /// unset: the device's default (`Bf16PrefillQ4Decode` on the CPU: BF16 prefill where the
    /// CPU has AVX-512 BF16, F32 elsewhere).
    #[arg(long, env = "RAGSCOPE_WEIGHT_FORMAT", value_parser = weight_format)]
    pub weight_format: Option<crate::weights::WeightFormat>,
    /// How the CPU decoder's KV cache stores keys and values: `f16` (what unset means there:
    /// half the bytes a decode step reads from the cache, as llama.cpp's default cache) or
    /// `f32` (the values exactly as computed). On a GPU the cache is F32 tensors, and `f16` is
    /// refused at start.
    #[arg(long, env = "RAGSCOPE_KV_CACHE_DTYPE", value_enum)]
    pub kv_cache_dtype: Option<crate::KvDtype>,
    /// Speculative decoding from the prompt: `off`, or `prompt-lookup[:DRAFT[:NGRAM]]` (draft
    /// up to DRAFT tokens, from 1 to 16, by matching the answer's last NGRAM tokens, at least
    /// 2, in the prompt; each step verifies its draft in one pass). The output is the same
    /// token for token; only the CPU decoder drafts.
    #[arg(long, env = "RAGSCOPE_SPECULATION", default_value_t = crate::speculate::Speculation::DEFAULT)]
    pub speculation: crate::speculate::Speculation,
}

/// Failure snapshots (`<data-dir>/snapshots/`, `GET /debug/snapshots`, `ragscope replay`).
#[derive(Debug, Clone, Args)]
pub struct SnapshotArgs {
    /// Write a snapshot of every failed generation (error, timeout, injected fault, panic):
    /// on or off.
    #[arg(long, env = "RAGSCOPE_SNAPSHOTS", default_value = "on", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub snapshots: bool,
    /// Most snapshots kept; the oldest are removed first.
    #[arg(long, env = "RAGSCOPE_SNAPSHOT_MAX_COUNT", default_value_t = 32)]
    pub snapshot_max_count: usize,
    /// Most MiB the snapshot files may take together; the oldest are removed first.
    #[arg(long, env = "RAGSCOPE_SNAPSHOT_MAX_MB", default_value_t = 64)]
    pub snapshot_max_mb: u64,
    /// Also snapshot a generation stopped because its client went away.
    #[arg(long, env = "RAGSCOPE_SNAPSHOT_ON_CANCEL", default_value_t = false, value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub snapshot_on_cancel: bool,
}

/// `--prefill-chunk-tokens`: a multiple of 32 (the split the prefill is invariant to) up to
/// the generator's largest.
pub fn prefill_chunk_tokens(v: &str) -> Result<usize, String> {
    let max = crate::forward::PREFILL_CHUNK;
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| (32..=max).contains(n) && n.is_multiple_of(32))
        .ok_or_else(|| format!("{v:?}: expected a multiple of 32 from 32 to {max}"))
}

/// `--weight-format`: one of `WeightFormat::ALL` by name.
fn weight_format(v: &str) -> Result<crate::weights::WeightFormat, String> {
    use crate::weights::WeightFormat;
    WeightFormat::named(v.trim()).ok_or_else(|| {
        let names: Vec<String> = WeightFormat::ALL.iter().map(|f| format!("{f:?}")).collect();
        format!("{v:?}: expected one of {}", names.join(", "))
    })
}

/// `--decode-step-links`: within the 128 links the OpenTelemetry SDK keeps per span.
fn step_links(v: &str) -> Result<usize, String> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| *n <= 128)
        .ok_or_else(|| format!("{v:?}: expected a number of links from 0 to 128"))
}
