//! Timing one piece of the generator's compute at a time, for the lab (`ragscope-lab kernels`
//! and `ragscope-lab decode-step`): the decode matmul kernels on synthetic weights, and one CPU
//! decode step of a real model with its layer matmuls and output head alone. They reach into the
//! decoder's internals, which is why they live in this crate; the lab prints what they return.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::cpu_decode::{merge, HostKv, Partial, SeqStep, ATTENTION_CHUNK};
use crate::host_kv::KvLayer;
use crate::kernels::quant::{matmul, QActs, QMatrix};
use crate::llama::{Llama, Prefill};
use crate::weights::Bf16Proj;
use crate::KvDtype;

/// One decode matmul: the weights' format, activation rows, time and weight bytes read per second.
#[derive(Debug, Clone)]
pub struct KernelTiming {
    pub format: String,
    pub rows: usize,
    pub ms: f64,
    pub gb_per_s: f64,
}

/// The decode kernels on one 3072·30 × 576 matrix (the rows of the default generator's gate
/// and up projections over its 30 layers), in Q4_1 and Q8_0 as shipped and in panels on each
/// panel body the CPU runs (Q4_1 from AVX2, Q8_0 with VNNI), for 1 to 16 activation rows.
pub fn kernels() -> Result<Vec<KernelTiming>> {
    let (rows, cols) = (3072 * 30, 576);
    let dense: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let t = Tensor::from_vec(dense.clone(), (rows, cols), &Device::Cpu)?;
    let q4 = QMatrix::from_qtensors(&[&QTensor::quantize(&t, GgmlDType::Q4_1)?])?;
    let q8 = QMatrix::quantize_q8(&dense, rows, cols);
    let mut timings = Vec::new();
    let mut time = |format: String, bytes: usize, multiply: &dyn Fn(&QActs, &mut [f32])| {
        for n in [1, 2, 4, 8, 16] {
            let mut acts = QActs::default();
            acts.quantize(&dense[..n * cols], n, cols);
            let mut out = vec![0f32; n * rows];
            multiply(&acts, &mut out);
            let (reps, t0) = (10, Instant::now());
            for _ in 0..reps {
                multiply(&acts, &mut out);
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            timings.push(KernelTiming {
                format: format.clone(),
                rows: n,
                ms: s * 1e3,
                gb_per_s: bytes as f64 / s / 1e9,
            });
        }
    };
    for w in [&q4, &q8] {
        time(format!("{:?}", w.format()), w.size_in_bytes(), &|a, o| {
            matmul(w, a, o)
        });
    }
    #[cfg(target_arch = "x86_64")]
    for w in [&q4, &q8] {
        use crate::kernels::quant::{panels::Panels, Isa};
        // Each panel body this CPU runs for the format.
        let bodies: Vec<Isa> = [Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|&isa| Panels::runs(w.format(), isa) && isa.runs_here())
            .collect();
        if bodies.is_empty() {
            continue;
        }
        let panels = Panels::pack(w);
        for isa in bodies {
            let name = format!("{:?} panels {}", w.format(), isa.name());
            time(name, panels.size_in_bytes(), &|a, o| {
                panels.matmul_with(isa, a, o, None)
            });
        }
    }
    Ok(timings)
}

/// One prefill projection's multiply: the layer shape, and each path's median time.
#[derive(Debug, Clone)]
pub struct PrefillGemmTiming {
    /// `(n, k)`: output columns, inputs.
    pub shape: (usize, usize),
    pub rows: usize,
    /// Dense F32 on candle's GEMM ([`crate::llama::Prefill::F32`]).
    pub f32_ms: f64,
    /// The Q4_1 × 8-bit GEMM ([`crate::llama::Prefill::Int8`]); `None` without AVX2.
    pub int8_ms: Option<f64>,
    /// BF16 on AVX-512 BF16 ([`crate::llama::Prefill::Bf16`]); `None` without it.
    pub bf16_ms: Option<f64>,
    /// BF16 on AMX tiles ([`crate::llama::Prefill::Amx`]); `None` without them.
    pub amx_ms: Option<f64>,
}

/// The prefill projections of the default generator's layer shapes (q, k and v stacked; the
/// output; gate and up stacked; down) on synthetic Q4_1 weights, `rows` activation rows, each
/// path timed in turn round after round (medians of `rounds`).
pub fn prefill_gemms(rows: usize, rounds: usize) -> Result<Vec<PrefillGemmTiming>> {
    let mut timings = Vec::new();
    for (n, k) in [(960, 576), (576, 576), (3072, 576), (576, 1536)] {
        let dense: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let t = Tensor::from_vec(dense, (n, k), &Device::Cpu)?;
        let q = QTensor::quantize(&t, GgmlDType::Q4_1)?;
        let f32 = candle_core::quantized::QMatMul::Tensor(q.dequantize(&Device::Cpu)?);
        #[cfg(target_arch = "x86_64")]
        let mut int8 = if crate::kernels::avx2() {
            let p = crate::kernels::quant::panels::Panels::pack(&QMatrix::from_qtensors(&[&q])?);
            Some((p, vec![0f32; rows * n]))
        } else {
            None
        };
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 104_729) % 2000) as f32 / 1000.0 - 1.0)
            .collect();
        let xt = Tensor::from_slice(&x, (rows, k), &Device::Cpu)?;
        // The BF16 projections the default format builds, on each kernel the CPU runs.
        let dense = q.dequantize(&Device::Cpu)?;
        let bf16_proj = |prefill: Prefill, runs: bool| -> Result<_> {
            if !runs {
                return Ok(None);
            }
            Ok(Some((
                Bf16Proj::new(&dense, prefill)?,
                vec![0f32; rows * n],
            )))
        };
        let mut bf16 = bf16_proj(Prefill::Bf16, crate::kernels::avx512_bf16())?;
        let mut amx = bf16_proj(Prefill::Amx, crate::kernels::amx())?;
        let (mut bf16_ms, mut amx_ms) = (Vec::new(), Vec::new());
        let (mut f32_ms, mut int8_ms) = (Vec::new(), Vec::new());
        for round in 0..=rounds {
            for (proj, ms) in [(&mut bf16, &mut bf16_ms), (&mut amx, &mut amx_ms)] {
                if let Some((proj, out)) = proj {
                    let t0 = Instant::now();
                    proj.forward_rows(&x, rows, out, None)?;
                    if round > 0 {
                        ms.push(t0.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            let t0 = Instant::now();
            candle_core::Module::forward(&f32, &xt)?;
            let f = t0.elapsed().as_secs_f64() * 1e3;
            #[cfg(target_arch = "x86_64")]
            if let Some((p, out)) = &mut int8 {
                let t0 = Instant::now();
                p.forward_rows(&x, rows, out, None);
                if round > 0 {
                    int8_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            // Round 0 warms up.
            if round > 0 {
                f32_ms.push(f);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied()
        };
        timings.push(PrefillGemmTiming {
            shape: (n, k),
            rows,
            f32_ms: median(&mut f32_ms).unwrap_or(f64::NAN),
            int8_ms: median(&mut int8_ms),
            bf16_ms: median(&mut bf16_ms),
            amx_ms: median(&mut amx_ms),
        });
    }
    Ok(timings)
}

/// Milliseconds of one sequence's CPU decode step and of its parts, for one row (a plain step)
/// and for [`VERIFY_ROWS`] rows (a step that verifies three drafted tokens).
#[derive(Debug, Clone, Copy)]
pub struct DecodeStep {
    /// At 600-650 positions of context.
    pub step_ms: f64,
    /// At 10-60 positions: the difference is mostly attention over the cache.
    pub short_step_ms: f64,
    /// Every layer's matmuls alone: what the step would cost if it only read the weights.
    pub layer_matmuls_ms: f64,
    pub output_head_ms: f64,
    /// One row's attention over 620 positions in every layer, on one thread (the step
    /// spreads it over the pool): median of five.
    pub attention_ms: f64,
    /// [`VERIFY_ROWS`] rows of one sequence at 600-650 positions.
    pub verify_step_ms: f64,
    pub verify_layer_matmuls_ms: f64,
    pub verify_output_head_ms: f64,
}

/// Rows of the verify step [`decode_step`] times: a token and the default's three drafts.
pub const VERIFY_ROWS: usize = 4;

/// One decode step of the GGUF at `path` on the CPU decoder, with a KV cache in `dtype`.
pub fn decode_step(path: &Path, dtype: KvDtype) -> Result<DecodeStep> {
    let model = Llama::from_gguf(path, &Device::Cpu, 2048).context("loading the generator")?;
    let d = model
        .transformer
        .weights
        .decoder
        .clone()
        .context("this model's format has no CPU decoder")?;
    let mut kv = HostKv::new(
        d.layers.len(),
        d.dims.n_kv_head,
        d.dims.head_dim,
        1024,
        dtype,
    );
    let mut logits = vec![0f32; VERIFY_ROWS * d.vocab()];
    let mut time_steps = |positions: std::ops::Range<usize>, rows: usize| -> Result<f64> {
        let (n, t) = (positions.len(), Instant::now());
        for pos in positions {
            let tokens: Vec<u32> = (0..rows).map(|j| (100 + pos + j) as u32).collect();
            let seq = SeqStep {
                kv: &mut kv,
                pos,
                tokens: &tokens,
            };
            d.step(&mut [seq], &mut logits[..rows * d.vocab()])?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3 / n as f64)
    };
    time_steps(0..10, 1)?;
    let short_step_ms = time_steps(10..60, 1)?;
    time_steps(60..600, 1)?;
    let step_ms = time_steps(600..650, 1)?;
    let verify_step_ms = time_steps(600..650, VERIFY_ROWS)?;
    // One row's attention alone, on this thread: the step's positions 0..650 are in the cache.
    let (nh, nkv, hd) = (d.dims.n_head, d.dims.n_kv_head, d.dims.head_dim);
    let q: Vec<f32> = (0..nh * hd).map(|i| (i as f32 * 0.37).sin()).collect();
    let len: usize = 620;
    let mut parts: Vec<Partial> = (0..len.div_ceil(ATTENTION_CHUNK))
        .map(|_| Partial::default())
        .collect();
    let mut y = vec![0f32; nh * hd];
    let scale = 1.0 / (hd as f32).sqrt();
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for layer in 0..d.layers.len() {
            for (i, part) in parts.iter_mut().enumerate() {
                let range = i * ATTENTION_CHUNK..((i + 1) * ATTENTION_CHUNK).min(len);
                let dims = (nh, nkv, kv.capacity, hd);
                match kv.layer(layer) {
                    KvLayer::F32(k, v) => part.attend(&q, (k, v), dims, range, scale),
                    KvLayer::F16(k, v) => part.attend(&q, (k, v), dims, range, scale),
                }
            }
            merge(&parts, nh, hd, &mut y);
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let attention_ms = times[times.len() / 2];
    let hidden = d.dims.n_head * d.dims.head_dim;
    let mut parts = |rows: usize| {
        let mut acts = QActs::default();
        let x = vec![0.5f32; rows * d.dims.ffn];
        let mut out = vec![0f32; rows * 2 * d.dims.ffn];
        let t = Instant::now();
        for _ in 0..20 {
            for l in &d.layers {
                acts.quantize(&x[..rows * hidden], rows, hidden);
                l.qkv.matmul(&acts, &mut out[..rows * l.qkv.rows()]);
                l.attn_out.matmul(&acts, &mut out[..rows * hidden]);
                l.gate_up.matmul(&acts, &mut out[..rows * 2 * d.dims.ffn]);
                acts.quantize(&x, rows, d.dims.ffn);
                l.down.matmul(&acts, &mut out[..rows * hidden]);
            }
        }
        let layers_ms = t.elapsed().as_secs_f64() * 1e3 / 20.0;
        acts.quantize(&x[..rows * hidden], rows, hidden);
        let t = Instant::now();
        for _ in 0..20 {
            d.head_matmul(&acts, &mut logits[..rows * d.vocab()]);
        }
        (layers_ms, t.elapsed().as_secs_f64() * 1e3 / 20.0)
    };
    let (layer_matmuls_ms, output_head_ms) = parts(1);
    let (verify_layer_matmuls_ms, verify_output_head_ms) = parts(VERIFY_ROWS);
    Ok(DecodeStep {
        step_ms,
        short_step_ms,
        layer_matmuls_ms,
        output_head_ms,
        attention_ms,
        verify_step_ms,
        verify_layer_matmuls_ms,
        verify_output_head_ms,
    })
}
