//! `ragscope bench --kernels | --decode-step | --embed-ab`: one piece of compute at a time, for
//! work on that piece rather than for the stage table. `--kernels` times the decode matmuls on
//! synthetic weights, `--decode-step` one CPU decode step of the generator, and `--embed-ab`
//! the embedder's forwards against each other on the peer benchmark's inputs.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::peers::PeerInputs;
use super::stage;
use crate::config::BenchArgs;
use crate::embed::bert::{Backend, BertEmbedder};
use crate::embed::kernels::Precision;
use crate::embed::Embedder;
use crate::generate::cpu_decode::{HostKv, SeqStep};
use crate::generate::kernels::{matmul, QActs, QMatrix};

/// Where `--embed-ab` looks for `inputs.json` without `--peer-inputs`.
const DEFAULT_PEER_INPUTS: &str = "data/bench-peers/inputs";

/// Runs each mode `args` asks for, in order.
pub fn run(args: &BenchArgs) -> Result<()> {
    if args.kernels {
        kernels()?;
    }
    if args.decode_step {
        decode_step(args)?;
    }
    if args.embed_ab {
        embed_ab(args)?;
    }
    Ok(())
}

/// The decode kernels on one 3072·30 × 576 matrix (the rows of the default generator's gate
/// and up projections over its 30 layers), in Q4_1 and Q8_0, for 1 to 16 activation rows.
fn kernels() -> Result<()> {
    let (rows, cols) = (3072 * 30, 576);
    let dense: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let t = Tensor::from_vec(dense.clone(), (rows, cols), &Device::Cpu)?;
    let q4 = QMatrix::from_qtensors(&[&QTensor::quantize(&t, GgmlDType::Q4_1)?])?;
    let q8 = QMatrix::quantize_q8(&dense, rows, cols);
    for w in [&q4, &q8] {
        for n in [1, 2, 4, 8, 16] {
            let mut acts = QActs::default();
            acts.quantize(&dense[..n * cols], n, cols);
            let mut out = vec![0f32; n * rows];
            matmul(w, &acts, &mut out);
            let t0 = Instant::now();
            let reps = 10;
            for _ in 0..reps {
                matmul(w, &acts, &mut out);
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{:?} n={n}: {:.2} ms, {:.1} GB/s",
                w.format(),
                s * 1e3,
                w.size_in_bytes() as f64 / s / 1e9,
            );
        }
    }
    Ok(())
}

/// One sequence's decode step at 10-60 and at 600-650 positions of context (the difference is
/// mostly attention over the cache), and the layer matmuls and the output head alone (what the
/// step would cost if it were only reading weights).
fn decode_step(args: &BenchArgs) -> Result<()> {
    let m = &args.models;
    let dir = crate::models::resolve(&m.gen_model, &m.models_dir, &[], m.fetch_models)?;
    let path = crate::app::gguf_in(&dir)?;
    let (d, _) = crate::generate::llama::decoder_for_bench(&path);
    let dtype = m.kv_cache_dtype.unwrap_or_default();
    let mut kv = HostKv::new(
        d.layers.len(),
        d.dims.n_kv_head,
        d.dims.head_dim,
        1024,
        dtype,
    );
    let mut logits = vec![0f32; d.vocab()];
    let mut step = |pos: usize| {
        let seq = SeqStep {
            kv: &mut kv,
            pos,
            token: 100 + pos as u32,
        };
        d.step(&mut [seq], &mut logits)
    };
    let mut time_steps = |positions: std::ops::Range<usize>| -> Result<f64> {
        let (n, t) = (positions.len(), Instant::now());
        for pos in positions {
            step(pos)?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3 / n as f64)
    };
    time_steps(0..10)?;
    let short = time_steps(10..60)?;
    time_steps(60..600)?;
    let per_step = time_steps(600..650)?;
    let mut acts = QActs::default();
    let x = vec![0.5f32; d.dims.ffn];
    let mut out = vec![0f32; 2 * d.dims.ffn];
    let hidden = d.dims.n_head * d.dims.head_dim;
    let t = Instant::now();
    for _ in 0..20 {
        for l in &d.layers {
            acts.quantize(&x[..hidden], 1, hidden);
            matmul(&l.qkv, &acts, &mut out[..l.qkv.rows()]);
            matmul(&l.attn_out, &acts, &mut out[..hidden]);
            matmul(&l.gate_up, &acts, &mut out[..2 * d.dims.ffn]);
            acts.quantize(&x, 1, d.dims.ffn);
            matmul(&l.down, &acts, &mut out[..hidden]);
        }
    }
    let layers = t.elapsed().as_secs_f64() * 1e3 / 20.0;
    acts.quantize(&x[..hidden], 1, hidden);
    let t = Instant::now();
    for _ in 0..20 {
        d.head_matmul(&acts, &mut logits);
    }
    let head = t.elapsed().as_secs_f64() * 1e3 / 20.0;
    println!(
        "step {per_step:.2} ms (at 10-60 positions {short:.2} ms), layer matmuls {layers:.2} ms, \
         output head {head:.2} ms"
    );
    Ok(())
}

/// Candle's forward against the CPU one (F32, and BF16 where the CPU has it), interleaved
/// round by round so drift in the machine's speed hits every forward alike: batch-32
/// sentences/s and single-query p50 ms, each the median of the rounds.
fn embed_ab(args: &BenchArgs) -> Result<()> {
    let inputs_dir = args
        .peer_inputs
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PEER_INPUTS));
    let path = inputs_dir.join("inputs.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (`ragscope bench --peer-inputs {}` writes it)",
            path.display(),
            inputs_dir.display()
        )
    })?;
    let inputs: PeerInputs =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    let sentences: Vec<&str> = inputs.sentences.iter().map(String::as_str).collect();
    let queries = &inputs.queries;

    let m = &args.models;
    let dir = crate::models::resolve(
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
    if let Some(only) = &args.ab_only {
        backends.retain(|b| format!("{b:?}").contains(only.as_str()));
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
            single[i].push(super::median(&mut times));
        }
    }
    for (i, b) in backends.iter().enumerate() {
        println!(
            "{:<12} batch 32: {:>7.1} sentences/s   one query p50: {:>6.2} ms",
            format!("{b:?}"),
            super::median(&mut batch[i]),
            super::median(&mut single[i])
        );
    }
    Ok(())
}
