//! `ragscope-lab kernels | decode-step | embed-ab`: one piece of compute at a time, for work on
//! that piece rather than for the stage table. `kernels` times the decode matmuls on synthetic
//! weights, `decode-step` one CPU decode step of the generator, and `embed-ab` the embedder's
//! forwards against each other on the peer benchmark's inputs.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;

use crate::peers::PeerInputs;
use crate::{median, stage, Setup};
use llm::kernels::Precision;
use rag::embed::bert::{Backend, BertEmbedder};
use rag::embed::Embedder;

/// The decode kernels' timings, one line each.
pub fn kernels() -> Result<()> {
    for k in llm::probe::kernels()? {
        println!(
            "{} n={}: {:.2} ms, {:.1} GB/s",
            k.format, k.rows, k.ms, k.gb_per_s
        );
    }
    let rows = 588;
    println!("prefill projections at {rows} rows (ms, median of 10):");
    for p in llm::probe::prefill_gemms(rows, 10)? {
        let (n, k) = p.shape;
        let gflops = |ms: f64| 2.0 * (rows * n * k) as f64 / ms / 1e6;
        let against_f32 = |ms: Option<f64>| {
            ms.map_or("-".to_string(), |ms| {
                format!("{ms:.2} ({:.0} GFLOP/s, {:.2}x)", gflops(ms), p.f32_ms / ms)
            })
        };
        println!(
            "  {n:>5} x {k:<5} f32 {:.2} ({:.0} GFLOP/s)  int8 {}  bf16 {}  bf16-amx {}",
            p.f32_ms,
            gflops(p.f32_ms),
            against_f32(p.int8_ms),
            against_f32(p.bf16_ms),
            against_f32(p.amx_ms)
        );
    }
    Ok(())
}

/// One CPU decode step of the generator and its parts.
pub fn decode_step(args: &Setup) -> Result<()> {
    let (m, g) = (&args.load.models, &args.load.generator);
    let dir = llm::models::resolve(&g.gen_model, &m.models_dir, &[], m.fetch_models)?;
    let path = ragscope::app::gguf_in(&dir)?;
    let s = llm::probe::decode_step(&path, g.kv_cache_dtype.unwrap_or_default())?;
    println!(
        "step {:.2} ms (at 10-60 positions {:.2} ms), layer matmuls {:.2} ms, output head {:.2} ms",
        s.step_ms, s.short_step_ms, s.layer_matmuls_ms, s.output_head_ms
    );
    println!(
        "one row's attention over 620 positions, every layer, one thread: {:.2} ms",
        s.attention_ms
    );
    println!(
        "{}-row verify step {:.2} ms, layer matmuls {:.2} ms, output head {:.2} ms",
        llm::probe::VERIFY_ROWS,
        s.verify_step_ms,
        s.verify_layer_matmuls_ms,
        s.verify_output_head_ms
    );
    Ok(())
}

/// Candle's forward against the CPU one (F32, and BF16 where the CPU has it), interleaved
/// round by round so drift in the machine's speed hits every forward alike: batch-32
/// sentences/s and single-query p50 ms, each the median of the rounds.
pub fn embed_ab(args: &Setup, inputs_dir: &Path, only: Option<&str>) -> Result<()> {
    let path = inputs_dir.join("inputs.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (`ragscope-lab peers --inputs {}` writes it)",
            path.display(),
            inputs_dir.display()
        )
    })?;
    let inputs: PeerInputs =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    let sentences: Vec<&str> = inputs.sentences.iter().map(String::as_str).collect();
    let queries = &inputs.queries;

    let m = &args.load.models;
    let dir = llm::models::resolve(
        &m.embed_model,
        &m.models_dir,
        &["config.json", "tokenizer.json", "model.safetensors"],
        m.fetch_models,
    )?;
    let rounds = args.rounds.max(1);
    let mut backends = vec![Backend::Candle, Backend::Cpu(Precision::F32)];
    if Precision::best() == Precision::Bf16 {
        backends.push(Backend::Cpu(Precision::Bf16));
    }
    if let Some(only) = only {
        backends.retain(|b| format!("{b:?}").contains(only));
    }
    let embedders: Vec<BertEmbedder> = backends
        .iter()
        .map(|&b| BertEmbedder::load_with(&dir, &m.embed_model, &Device::Cpu, b))
        .collect::<Result<_, _>>()
        .with_context(|| format!("loading embedder from {}", dir.display()))?;
    for e in &embedders {
        e.embed(&sentences[..32], &stage())?;
    }
    let mut batch = vec![Vec::new(); embedders.len()];
    let mut single = vec![Vec::new(); embedders.len()];
    for _ in 0..rounds {
        for (i, e) in embedders.iter().enumerate() {
            let t = Instant::now();
            e.embed(&sentences, &stage())?;
            batch[i].push(sentences.len() as f64 / t.elapsed().as_secs_f64());
            let mut times = queries
                .iter()
                .map(|q| {
                    let t = Instant::now();
                    e.embed(&[q], &stage())?;
                    Ok(t.elapsed().as_secs_f64() * 1e3)
                })
                .collect::<Result<Vec<f64>>>()?;
            single[i].push(median(&mut times));
        }
    }
    for (i, b) in backends.iter().enumerate() {
        println!(
            "{:<12} batch 32: {:>7.1} sentences/s   one query p50: {:>6.2} ms",
            format!("{b:?}"),
            median(&mut batch[i]),
            median(&mut single[i])
        );
    }
    Ok(())
}
