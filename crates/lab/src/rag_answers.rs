//! `ragscope-lab peers --inputs DIR --rag-answers`: the RAG-answer decode workload of the
//! comparison with llama.cpp (`scripts/bench-peers --rag-answers`). The prompts are the ones
//! the default pipeline builds for the evaluation questions (retrieval, context, prompt
//! builder), and each prompt's answer length n is our own greedy answer's, to its
//! end-of-sequence. Both sides then decode exactly n greedy tokens per prompt (end-of-sequence
//! never picked), ours with speculation off and on, and report the tokens after each first
//! token over the decode time, summed over the prompts.
//!
//! `rag-inputs.json` is built once (the whole pipeline answers every question; its prompt is
//! read back from the pipeline's prompt memory) and kept, like `inputs.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{stage, PeersArgs, Setup};
use llm::llama::Llama;
use llm::speculate::{Speculation, Tally};
use llm::{FinishReason, Flow, GenerateRequest, Generator, KvDtype};
use rag::pipeline::RagRequest;
use ragscope::app;
use telemetry::clock;
use telemetry::span::Stage;

const QUESTIONS: &str = "eval/questions.jsonl";

/// What both sides are given; `rag-inputs.json` in the peer-inputs directory.
#[derive(Debug, Serialize, Deserialize)]
pub struct RagInputs {
    /// The GGUF file both generators load.
    pub gguf: PathBuf,
    pub questions_file: PathBuf,
    /// Questions asked when the file was built (the first `limit`, or all).
    pub questions_asked: usize,
    /// Token ids that end a generation; both sides never pick them while measuring.
    pub eos_tokens: Vec<u32>,
    /// Our greedy answers' cap: the pipeline's default `max_tokens`, which the prompt builder
    /// left room for.
    pub max_tokens: usize,
    /// The prompts measured (answers of at least two tokens).
    pub prompts: Vec<RagPrompt>,
    /// Questions left out: their greedy answer had fewer than two tokens, so no decode to time.
    pub excluded: Vec<RagPrompt>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RagPrompt {
    pub question: String,
    /// The exact prompt the default pipeline built for the question.
    pub prompt_tokens: Vec<u32>,
    /// n: our greedy answer's length, end-of-sequence not counted.
    pub answer_tokens: usize,
    /// `stop` (ended at end-of-sequence) or `length` (reached `max_tokens`).
    pub finish: String,
    /// The default pipeline's own answer (its sampling, stop strings and citations), for the
    /// reader: the workload is the greedy answer, not this text.
    pub pipeline_answer: String,
}

/// One speculation setting's totals over every prompt.
#[derive(Debug, Default, Serialize)]
pub struct SettingReport {
    pub speculation: String,
    /// Tokens after each prompt's first, over the time from its first token to its end.
    pub decode_tok_s: f64,
    pub decode_tokens: usize,
    pub decode_s: f64,
    pub prefill_ms_total: f64,
    pub drafted: usize,
    pub accepted: usize,
    pub draft_steps: usize,
    /// Per prompt, decode tok/s.
    pub per_prompt_tok_s: Vec<f64>,
    /// Per prompt, the tokens generated.
    pub generated_ids: Vec<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct RagReport {
    pub system: &'static str,
    pub workload: &'static str,
    pub threads: usize,
    pub cpu: String,
    pub weight_format: String,
    pub prefill_precision: &'static str,
    pub kv_cache_dtype: &'static str,
    pub prompts: usize,
    pub answer_tokens: Vec<usize>,
    pub off: SettingReport,
    pub on: SettingReport,
    /// Prompts whose tokens are the same with speculation off and on (it must be all).
    pub identical_off_on: usize,
}

pub fn run(peers: &PeersArgs, limit: usize, handle: &tokio::runtime::Handle) -> Result<()> {
    let (args, dir) = (&peers.setup, peers.inputs.as_path());
    let on = args.load.generator.speculation;
    if !on.is_on() {
        bail!("--rag-answers compares speculation off with --speculation's setting: give one that drafts");
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join("rag-inputs.json");
    let inputs: RagInputs = if path.exists() {
        let inputs: RagInputs = serde_json::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("reading {}", path.display()))?;
        if limit > 0 && inputs.questions_asked != limit {
            bail!(
                "{} was built for {} questions, not --limit {limit}: remove it to rebuild",
                path.display(),
                inputs.questions_asked
            );
        }
        inputs
    } else {
        let prompts = pipeline_prompts(args, limit, handle)?;
        let device = llm::device::device(&args.load.generator.device)?;
        let (generator, gen_dir) = crate::peers::load_generator(args, &device)?;
        let inputs = answer_lengths(args, &generator, &gen_dir, prompts)?;
        std::fs::write(&path, serde_json::to_string_pretty(&inputs)?)?;
        eprintln!(
            "wrote {}: {} prompts, {} left out",
            path.display(),
            inputs.prompts.len(),
            inputs.excluded.len()
        );
        inputs
    };
    if inputs.prompts.is_empty() {
        bail!("{} holds no prompt to measure", path.display());
    }

    let device = llm::device::device(&args.load.generator.device)?;
    let (generator, _) = crate::peers::load_generator(args, &device)?;
    let report = measure(&generator, &inputs.prompts, on)?;
    if peers.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print(&report, &path);
    }
    Ok(())
}

/// Each question through the whole default pipeline; the prompt it built, read back from its
/// prompt memory (where admission keeps each question's last prompt), with its answer.
fn pipeline_prompts(
    args: &Setup,
    limit: usize,
    handle: &tokio::runtime::Handle,
) -> Result<Vec<(String, Vec<u32>, String)>> {
    let pipeline = app::load_with_corpus(&args.load, &args.server)?;
    if pipeline.prompts.capacity() == 0 {
        bail!("--query-cache 0 leaves the pipeline no prompt memory to read the prompts from");
    }
    let mut questions: Vec<String> = ragscope::eval::load_questions(Path::new(QUESTIONS))?
        .into_iter()
        .map(|q| q.question)
        .collect();
    if limit > 0 {
        questions.truncate(limit);
    }
    let mut out = Vec::with_capacity(questions.len());
    for (i, q) in questions.into_iter().enumerate() {
        let root = Arc::new(Stage::root("rag_answers"));
        let req = RagRequest::with_defaults(q.clone(), &pipeline, args.server.request_timeout);
        let answer = handle.block_on(pipeline.start_query(req, &root, None)?)?;
        let Some(prompt) = pipeline.prompts.get(&q) else {
            bail!("the pipeline kept no prompt for {q:?}");
        };
        if prompt.len() != answer.usage.prompt_tokens {
            bail!(
                "the remembered prompt of {q:?} has {} tokens, the answer's usage {}",
                prompt.len(),
                answer.usage.prompt_tokens
            );
        }
        out.push((q, prompt.to_vec(), answer.answer));
        eprintln!(
            "rag answers: prompt {} built ({} tokens)",
            i + 1,
            prompt.len()
        );
    }
    Ok(out)
}

/// n for each prompt: our greedy answer's length, up to end-of-sequence or the pipeline's
/// default `max_tokens`.
fn answer_lengths(
    args: &Setup,
    generator: &Llama,
    gen_dir: &Path,
    prompts: Vec<(String, Vec<u32>, String)>,
) -> Result<RagInputs> {
    let max_tokens = args.load.pipeline.max_tokens;
    let (mut kept, mut excluded) = (Vec::new(), Vec::new());
    for (question, prompt_tokens, pipeline_answer) in prompts {
        let mut req = GenerateRequest::benchmark(&prompt_tokens, max_tokens);
        req.ignore_eos = false;
        let out = generator.generate(req, &stage(), &mut |_| Flow::Continue)?;
        let prompt = RagPrompt {
            question,
            answer_tokens: out.tokens.len(),
            finish: out.finish.as_str().to_string(),
            prompt_tokens,
            pipeline_answer,
        };
        if out.tokens.len() >= 2 && matches!(out.finish, FinishReason::Stop | FinishReason::Length)
        {
            kept.push(prompt);
        } else {
            excluded.push(prompt);
        }
    }
    Ok(RagInputs {
        gguf: std::path::absolute(app::gguf_in(gen_dir)?)?,
        questions_file: PathBuf::from(QUESTIONS),
        questions_asked: kept.len() + excluded.len(),
        eos_tokens: crate::peers::eos_tokens(generator),
        max_tokens,
        prompts: kept,
        excluded,
    })
}

/// Every prompt decoded n tokens under both settings, the two one after the other and in
/// turns (off first for even prompts, on first for odd ones), so both see the box alike.
fn measure(generator: &Llama, prompts: &[RagPrompt], on: Speculation) -> Result<RagReport> {
    let settings = [Speculation::OFF, on];
    // Warm-up: pages the weights in and starts the thread pool.
    generator.set_speculation(Speculation::OFF);
    generator.generate(
        GenerateRequest::benchmark(&prompts[0].prompt_tokens, 4),
        &stage(),
        &mut |_| Flow::Continue,
    )?;
    let mut reports: [SettingReport; 2] = Default::default();
    let mut tallies = [Tally::default(); 2];
    let mut seconds = [0.0f64; 2];
    for (i, p) in prompts.iter().enumerate() {
        for k in 0..2 {
            let s = (i + k) % 2;
            generator.set_speculation(settings[s]);
            let out = generator.generate(
                GenerateRequest::benchmark(&p.prompt_tokens, p.answer_tokens),
                &stage(),
                &mut |_| Flow::Continue,
            )?;
            let end = clock::now();
            let first = out.first_token_at.context("no token was generated")?;
            let decode = end.saturating_duration_since(first).as_secs_f64();
            let n = out.tokens.len();
            if n != p.answer_tokens {
                bail!(
                    "prompt {i}: {n} tokens generated, {} asked",
                    p.answer_tokens
                );
            }
            let r = &mut reports[s];
            r.decode_tokens += n - 1;
            seconds[s] += decode;
            r.prefill_ms_total += clock::millis(out.prefill);
            r.per_prompt_tok_s.push((n - 1) as f64 / decode);
            r.generated_ids.push(out.tokens);
            tallies[s] = tallies[s] + out.speculation;
        }
    }
    generator.set_speculation(Speculation::OFF);
    for ((r, s), (t, secs)) in reports
        .iter_mut()
        .zip(settings)
        .zip(tallies.iter().zip(seconds))
    {
        r.speculation = s.to_string();
        r.decode_s = secs;
        r.decode_tok_s = r.decode_tokens as f64 / secs;
        r.drafted = t.drafted;
        r.accepted = t.accepted;
        r.draft_steps = t.steps;
    }
    let [off, on] = reports;
    let identical_off_on = off
        .generated_ids
        .iter()
        .zip(&on.generated_ids)
        .filter(|(a, b)| a == b)
        .count();
    Ok(RagReport {
        system: "ragscope",
        workload: "rag-answers",
        threads: candle_core::utils::get_num_threads(),
        cpu: llm::cpu::model(),
        weight_format: format!("{:?}", generator.weight_format()),
        prefill_precision: generator.prefill_kind().name(),
        kv_cache_dtype: generator.kv_dtype().unwrap_or(KvDtype::F32).name(),
        prompts: prompts.len(),
        answer_tokens: prompts.iter().map(|p| p.answer_tokens).collect(),
        off,
        on,
        identical_off_on,
    })
}

fn print(r: &RagReport, path: &Path) {
    println!(
        "ragscope-lab peers --rag-answers on {}: {} prompts, {} answer tokens, {} threads, {}",
        path.display(),
        r.prompts,
        r.answer_tokens.iter().sum::<usize>(),
        r.threads,
        r.weight_format
    );
    println!(
        "{:<24} {:>10} {:>14} {:>10}",
        "speculation", "decode/s", "decode tokens", "accepted"
    );
    for s in [&r.off, &r.on] {
        let accepted = if s.drafted > 0 {
            format!("{:.0}%", 100.0 * s.accepted as f64 / s.drafted as f64)
        } else {
            "-".into()
        };
        println!(
            "{:<24} {:>10.1} {:>14} {:>10}",
            s.speculation, s.decode_tok_s, s.decode_tokens, accepted
        );
    }
    println!(
        "same tokens with speculation off and on: {}/{}",
        r.identical_off_on, r.prompts
    );
}
