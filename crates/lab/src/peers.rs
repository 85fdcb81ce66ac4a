//! `ragscope-lab peers --inputs DIR [--json]`: our side of the comparison with llama.cpp and
//! PyTorch (`scripts/bench-peers` runs both and interleaves them). One process measures, after
//! loading, the time to first token of a fixed RAG prompt, decode speed over 128 greedy tokens,
//! embedding throughput at batch 32 and single-query embedding latency, on inputs that the
//! peers read from the same `inputs.json`.
//!
//! The inputs are built once, deterministically, from the bundled corpus with our own prompt
//! builder, and kept: later runs (and the peers) read them back, so every round sees the same.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{percentile, stage, PeersArgs};
use llm::llama::{Llama, WeightFormat};
use llm::{
    ChatTokenizer, Flow, GenerateError, GenerateRequest, Generated, Generator, KvDtype, Piece,
    TokenLogprob,
};
use rag::embed::bert::BertEmbedder;
use rag::embed::Embedder;
use rag::ingest::{self, chunk};
use ragscope::app;
use telemetry::{clock, span::Stage};

/// Prompt budget, in generator tokens: a typical RAG prompt of about 600 tokens.
const PROMPT_TOKENS: usize = 600;
/// Greedy tokens generated, end-of-sequence ignored.
const GEN_TOKENS: usize = 128;
const SENTENCES: usize = 256;
/// Sentences of this many words are kept (the corpus also has one-word lines and long tables).
const SENTENCE_WORDS: std::ops::RangeInclusive<usize> = 8..=60;
const EMBED_FILES: [&str; 3] = ["config.json", "tokenizer.json", "model.safetensors"];

/// What both sides are given; `inputs.json` in the peer-inputs directory.
#[derive(Debug, Serialize, Deserialize)]
pub struct PeerInputs {
    /// The GGUF file both generators load.
    pub gguf: PathBuf,
    /// The embedding model directory (config.json, tokenizer.json, model.safetensors).
    pub embed_dir: PathBuf,
    /// The RAG prompt as token ids (what both generators are fed) and as ChatML text (for
    /// checking the other tokenizer).
    pub prompt_tokens: Vec<u32>,
    pub prompt_text: String,
    pub question: String,
    pub source_doc: String,
    pub max_tokens: usize,
    /// Token ids that end a generation; both sides never pick them.
    pub eos_tokens: Vec<u32>,
    /// Embedded in batches of 32.
    pub sentences: Vec<String>,
    /// Embedded one at a time.
    pub queries: Vec<String>,
}

/// What one run measured (printed as JSON for the driver).
#[derive(Debug, Serialize)]
pub struct PeerReport {
    pub system: &'static str,
    pub threads: usize,
    pub weight_format: String,
    /// How the prefill projections multiplied (`bf16`, `f32`), and the prefill chunk size.
    pub prefill_precision: &'static str,
    pub prefill_chunk_tokens: usize,
    /// How the decoder's KV cache stores keys and values (`f16`, `f32`; `f32` for candle's
    /// device tensors).
    pub kv_cache_dtype: &'static str,
    /// The embedder's forward pass, e.g. `Cpu(Bf16)` (see `BertEmbedder::backend`).
    pub embed_backend: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt forward pass, from the start of the request to the last position's logits.
    pub prefill_ms: f64,
    /// Request start to the first generated token.
    pub ttft_ms: f64,
    /// Tokens after the first, over the time from the first token to the end.
    pub decode_tok_s: f64,
    pub decode_weight_bytes: usize,
    pub embed_batch32_sentences_per_s: f64,
    pub embed_single_p50_ms: f64,
    pub embed_single_queries: usize,
    pub generated_ids: Vec<u32>,
    pub generated_text: String,
    /// The sentences' vectors, little-endian f32, row after row.
    pub embeddings_file: PathBuf,
    pub embedding_dimension: usize,
}

/// Our generator behind a smaller context window, so the prompt builder fills (and trims the
/// last passage to) exactly the budget a real request of that size would get.
struct Budget<'a> {
    inner: &'a Llama,
    window: usize,
}

impl Generator for Budget<'_> {
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
    fn context_window(&self) -> usize {
        self.window
    }
    fn tokenizer(&self) -> &dyn ChatTokenizer {
        self.inner
    }
    fn score(
        &self,
        prompt: &[u32],
        top: usize,
        stage: &Stage,
    ) -> Result<Vec<TokenLogprob>, GenerateError> {
        self.inner.score(prompt, top, stage)
    }
    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<Generated, GenerateError> {
        self.inner.generate(req, stage, on_token)
    }
}

/// What to measure on the peer inputs.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Our side of the comparison: time to first token, decode, embedding.
    Compare,
    /// The prompt's prefill alone, round by round.
    Prefill,
    /// Decode with each number of concurrent streams.
    Streams { streams: Vec<usize>, tokens: usize },
    /// A stream's time per output token beside a second stream's prefill, per chunk size.
    Interference { chunks: Vec<usize> },
}

pub fn run(peers: &PeersArgs, mode: Mode) -> Result<()> {
    let (args, dir) = (&peers.setup, peers.inputs.as_path());
    let m = &args.load.models;
    let device = llm::device::device(&args.load.generator.device)?;
    let embed_dir =
        llm::models::resolve(&m.embed_model, &m.models_dir, &EMBED_FILES, m.fetch_models)?;
    let embedder = BertEmbedder::load(&embed_dir, &m.embed_model, &device)
        .with_context(|| format!("loading embedder from {}", embed_dir.display()))?;
    let (generator, gen_dir) = load_generator(args, &device)?;

    std::fs::create_dir_all(dir)?;
    let path = dir.join("inputs.json");
    let inputs: PeerInputs = if path.exists() {
        serde_json::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("reading {}", path.display()))?
    } else {
        let inputs = build_inputs(args, &gen_dir, &embed_dir, &generator, &embedder)?;
        std::fs::write(&path, serde_json::to_string_pretty(&inputs)?)?;
        inputs
    };

    match mode {
        Mode::Compare => {}
        Mode::Prefill => {
            return prefill_only(&generator, &inputs.prompt_tokens, args.rounds, peers.json)
        }
        Mode::Interference { chunks } => {
            let prompt = &inputs.prompt_tokens;
            let points = crate::interference::measure(&generator, prompt, &chunks, args.rounds)?;
            if peers.json {
                println!("{}", serde_json::to_string(&points)?);
            } else {
                crate::interference::print(prompt.len(), &points);
            }
            return Ok(());
        }
        Mode::Streams { streams, tokens } => {
            let prompt = &inputs.prompt_tokens;
            let points = crate::streams::measure(&generator, prompt, &streams, tokens)?;
            if peers.json {
                println!("{}", serde_json::to_string(&points)?);
            } else {
                let n = prompt.len();
                println!("ragscope-lab streams: {n}-token prompt, {tokens} tokens per stream");
                crate::streams::print(&points);
            }
            return Ok(());
        }
    }
    let report = measure(&inputs, &generator, &embedder, dir)?;
    if peers.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("ragscope-lab peers on {}", path.display());
        println!(
            "{:<44} {:>12}",
            "weight format",
            format!(
                "{} ({} prefill)",
                report.weight_format, report.prefill_precision
            )
        );
        println!("{:<44} {:>12.1} ms", "time to first token", report.ttft_ms);
        println!("{:<44} {:>12.1} ms", "prefill", report.prefill_ms);
        println!(
            "{:<44} {:>9.1} tok/s",
            format!("decode ({} tokens)", report.generated_tokens),
            report.decode_tok_s
        );
        println!(
            "{:<44} {:>12.1} /s",
            "embed batch 32, sentences/s", report.embed_batch32_sentences_per_s
        );
        println!(
            "{:<44} {:>12.2} ms",
            "embed one query, p50", report.embed_single_p50_ms
        );
    }
    Ok(())
}

/// The generator as the comparison runs it: the server's weight format, prefill chunk and KV
/// cache settings, no prefix cache (every prompt is computed) and speculation off until set.
pub(crate) fn load_generator(
    args: &crate::Setup,
    device: &candle_core::Device,
) -> Result<(Llama, PathBuf)> {
    let (m, g) = (&args.load.models, &args.load.generator);
    let gen_dir = llm::models::resolve(&g.gen_model, &m.models_dir, &[], m.fetch_models)?;
    let format = g
        .weight_format
        .unwrap_or_else(|| WeightFormat::for_device(device));
    let generator = app::load_generator_as(&gen_dir, device, g.max_context, format)
        .with_context(|| format!("loading generator from {}", gen_dir.display()))?
        .with_prefill_chunk(g.prefill_chunk_tokens);
    let generator = match g.kv_cache_dtype {
        Some(dtype) => generator.with_kv_dtype(dtype)?,
        None => generator,
    };
    Ok((generator, gen_dir))
}

/// The token ids that end a generation: the ones both sides never pick in the benchmarks.
pub(crate) fn eos_tokens(generator: &Llama) -> Vec<u32> {
    ["<|im_end|>", "<|endoftext|>"]
        .iter()
        .filter_map(|t| generator.hf_tokenizer().token_to_id(t))
        .collect()
}

/// `--prefill-only`: `rounds` prefills of `prompt` for one token each, after a warm-up.
fn prefill_only(generator: &Llama, prompt: &[u32], rounds: usize, json: bool) -> Result<()> {
    let prefill = || -> Result<Duration> {
        let out =
            generator.generate(GenerateRequest::benchmark(prompt, 1), &stage(), &mut |_| {
                Flow::Continue
            })?;
        Ok(out.prefill)
    };
    prefill()?;
    let mut times = (0..rounds.max(1))
        .map(|_| prefill())
        .collect::<Result<Vec<_>>>()?;
    let ms: Vec<f64> = times.iter().map(|d| clock::millis(*d)).collect();
    let median_ms = percentile(&mut times, 50.0);
    if json {
        let report = serde_json::json!({
            "weight_format": format!("{:?}", generator.weight_format()),
            "prefill_precision": generator.prefill_kind().name(),
            "prompt_tokens": prompt.len(),
            "prefill_ms": ms,
            "median_ms": median_ms,
        });
        println!("{report}");
    } else {
        let rounds: Vec<String> = ms.iter().map(|m| format!("{m:.1}")).collect();
        println!(
            "prefill of {} tokens ({} prefill): median {median_ms:.1} ms, rounds {}",
            prompt.len(),
            generator.prefill_kind().name(),
            rounds.join(" ")
        );
    }
    Ok(())
}

/// The fixed inputs: the first evaluation question with its source page's chunks as passages
/// (prompt builder, 600-token budget), 256 corpus sentences spread over every page, and every
/// evaluation question as a single query.
fn build_inputs(
    args: &crate::Setup,
    gen_dir: &Path,
    embed_dir: &Path,
    generator: &Llama,
    embedder: &BertEmbedder,
) -> Result<PeerInputs> {
    let questions = ragscope::eval::load_questions(Path::new("eval/questions.jsonl"))?;
    let Some(first) = questions.first() else {
        bail!("eval/questions.jsonl has no questions");
    };
    let mut docs = ingest::corpus::load(&args.server.corpus, &args.load.store.data_dir)?;
    docs.sort_by(|a, b| a.id.cmp(&b.id));
    let Some(doc) = docs.iter().find(|d| d.id == first.doc) else {
        bail!(
            "the corpus has no {} (the first question's page)",
            first.doc
        );
    };
    let chunks = ingest::plan_chunks(doc, embedder, app::chunker(&args.load.store))?;
    let passages: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
    let prompt = rag_prompt(generator, &first.question, &passages)?;
    let prompt_text = generator
        .hf_tokenizer()
        .decode(&prompt, false)
        .map_err(|e| anyhow::anyhow!("decoding the prompt: {e}"))?;

    let texts: Vec<String> = docs
        .iter()
        .flat_map(|d| ingest::extract(d).1)
        .map(|s| s.text)
        .collect();
    let sentences = pick_sentences(texts.iter().map(String::as_str), SENTENCES);
    if sentences.len() < SENTENCES {
        bail!("the corpus has only {} usable sentences", sentences.len());
    }

    let gguf = app::gguf_in(gen_dir)?;
    let eos_tokens = eos_tokens(generator);
    Ok(PeerInputs {
        gguf: std::path::absolute(gguf)?,
        embed_dir: std::path::absolute(embed_dir)?,
        prompt_tokens: prompt,
        prompt_text,
        question: first.question.clone(),
        source_doc: first.doc.clone(),
        max_tokens: GEN_TOKENS,
        eos_tokens,
        sentences,
        queries: questions.into_iter().map(|q| q.question).collect(),
    })
}

/// The prompt builder's rendering of `question` and `passages` within [`PROMPT_TOKENS`]: the
/// passages are kept in order while they fit and the last one is cut to the room left.
fn rag_prompt(generator: &Llama, question: &str, passages: &[&str]) -> Result<Vec<u32>> {
    let budget = Budget {
        inner: generator,
        window: PROMPT_TOKENS + GEN_TOKENS,
    };
    Ok(rag::prompt::build(&budget, &[], question, passages, GEN_TOKENS)?.tokens)
}

/// `n` distinct sentences of [`SENTENCE_WORDS`] words, spread evenly over all of `texts`' (fewer
/// if there are not that many).
fn pick_sentences<'a>(texts: impl Iterator<Item = &'a str>, n: usize) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut candidates = Vec::new();
    for text in texts {
        for sentence in chunk::sentences(text) {
            let words = sentence.split_whitespace().count();
            if SENTENCE_WORDS.contains(&words) && seen.insert(sentence.clone()) {
                candidates.push(sentence);
            }
        }
    }
    if candidates.len() <= n {
        return candidates;
    }
    (0..n)
        .map(|i| candidates[i * candidates.len() / n].clone())
        .collect()
}

fn measure(
    inputs: &PeerInputs,
    generator: &Llama,
    embedder: &BertEmbedder,
    dir: &Path,
) -> Result<PeerReport> {
    let generate = |max_tokens: usize| {
        let start = clock::now();
        let out = generator.generate(
            GenerateRequest::benchmark(&inputs.prompt_tokens, max_tokens),
            &stage(),
            &mut |_| Flow::Continue,
        );
        (start, out, clock::now())
    };
    // Warm-up: pages the weights in and starts the thread pool, as the peers' first call does.
    generate(4).1?;
    let (start, out, end) = generate(inputs.max_tokens);
    let out = out?;
    let first = out.first_token_at.context("no token was generated")?;
    let n = out.tokens.len();
    let decode = end.saturating_duration_since(first);

    let sentences: Vec<&str> = inputs.sentences.iter().map(String::as_str).collect();
    embedder.embed(&sentences[..32.min(sentences.len())], &stage())?;
    for q in inputs.queries.iter().take(5) {
        embedder.embed(&[q], &stage())?;
    }
    // All sentences in one call: the embedder sorts them by length and runs batches of 32,
    // as sentence-transformers' encode(batch_size=32) does.
    let t = clock::now();
    let vectors = embedder.embed(&sentences, &stage())?;
    let batch_time = t.elapsed();
    let mut single: Vec<Duration> = Vec::with_capacity(inputs.queries.len());
    for q in &inputs.queries {
        let t = clock::now();
        embedder.embed(&[q], &stage())?;
        single.push(t.elapsed());
    }

    let embeddings_file = dir.join("ours-embeddings.f32");
    let bytes: Vec<u8> = vectors
        .iter()
        .flatten()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    std::fs::write(&embeddings_file, bytes)?;

    Ok(PeerReport {
        system: "ragscope",
        threads: candle_core::utils::get_num_threads(),
        weight_format: format!("{:?}", generator.weight_format()),
        prefill_precision: generator.prefill_kind().name(),
        prefill_chunk_tokens: generator.prefill_chunk(),
        kv_cache_dtype: generator.kv_dtype().unwrap_or(KvDtype::F32).name(),
        embed_backend: format!("{:?}", embedder.backend()),
        prompt_tokens: inputs.prompt_tokens.len(),
        generated_tokens: n,
        prefill_ms: clock::millis(out.prefill),
        ttft_ms: clock::millis(first.saturating_duration_since(start)),
        decode_tok_s: n.saturating_sub(1) as f64 / decode.as_secs_f64(),
        decode_weight_bytes: generator.decode_weight_bytes(),
        embed_batch32_sentences_per_s: sentences.len() as f64 / batch_time.as_secs_f64(),
        embed_single_p50_ms: percentile(&mut single, 50.0),
        embed_single_queries: single.len(),
        generated_ids: out.tokens,
        generated_text: out.text,
        embeddings_file: std::path::absolute(embeddings_file)?,
        embedding_dimension: embedder.dimension(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_are_distinct_in_range_and_spread_over_the_texts() {
        let texts: Vec<String> = (0..40)
            .map(|d| {
                (0..10)
                    .map(|i| format!("Document {d} sentence {i} has exactly eight words."))
                    .chain(["Too short.".to_string()])
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        let texts_ref = || texts.iter().map(String::as_str);
        let picked = pick_sentences(texts_ref(), 32);
        assert_eq!(picked.len(), 32);
        assert_eq!(picked.iter().collect::<HashSet<_>>().len(), 32);
        assert!(picked.iter().all(|s| !s.starts_with("Too short")));
        assert!(picked[0].starts_with("Document 0 "));
        assert!(picked[31].starts_with("Document 38 "), "{}", picked[31]);
        assert_eq!(picked, pick_sentences(texts_ref(), 32));
        // Fewer candidates than asked for: all of them.
        assert_eq!(pick_sentences(texts_ref().take(2), 32).len(), 20);
    }

    #[test]
    fn rag_prompt_fills_the_budget_without_passing_it() {
        let Some(path) = llm::testing::model_path() else {
            return;
        };
        let model = Llama::from_gguf(&path, &candle_core::Device::Cpu, 2048).unwrap();
        let passage = "git stash saves your local modifications away and reverts the working \
                       directory to match the HEAD commit, so that you can switch branches. "
            .repeat(12);
        let passages = vec![passage.as_str(); 6];
        let tokens = rag_prompt(&model, "What does git stash do?", &passages).unwrap();
        assert!(tokens.len() <= PROMPT_TOKENS, "{}", tokens.len());
        assert!(tokens.len() > PROMPT_TOKENS - 64, "{}", tokens.len());
        let text = model.hf_tokenizer().decode(&tokens, false).unwrap();
        assert!(text.starts_with("<|im_start|>system\n"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        assert!(text.contains("Question: What does git stash do?"));
    }
}
