//! Decode steps on the CPU in plain loops over reused buffers, for one or many sequences at once.
//!
//! A decode step is one token per sequence through every layer. On candle's ops that is ~20
//! tensor ops per layer, each allocating its output and waking the thread pool, around matmuls
//! that read requantised Q8_0 weights. Here the step is a fixed sequence of calls over buffers
//! allocated once: RMS norm, the [`kernels`](crate::kernels::quant) matmuls on the GGUF's own Q4_1
//! blocks (batched: a step for B sequences reads the weights once), RoPE, attention of each
//! sequence over its own KV cache, SiLU. Prefill has its own loops
//! ([`cpu_prefill`](super::cpu_prefill): dense BF16 or F32 GEMMs win there) and writes the same
//! KV buffers this reads.

use std::sync::Mutex;

use candle_core::quantized::QTensor;

pub(crate) use super::host_kv::HostKv;
use super::host_kv::KvLayer;
use crate::kernels::quant::{DecodeMatrix, QActs, QMatrix};
use crate::kernels::silu_mul;

mod attention;

pub(super) use attention::{merge, Partial, ATTENTION_CHUNK, PARALLEL_ATTENTION_MIN_LEN};

/// The model's dimensions, as the decoder needs them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f32,
}

/// One sequence's share of a step: its cache, the position its first token goes to, and its
/// tokens, at `pos`, `pos + 1`, … (one, or more when the step verifies a speculative draft:
/// each row attends to the cache up to its own position, so row `j` sees rows `0..j` of the
/// same step and nothing after them).
pub(crate) struct SeqStep<'a> {
    pub kv: &'a mut HostKv,
    pub pos: usize,
    pub tokens: &'a [u32],
}

pub(crate) struct Layer {
    pub(super) attn_norm: Vec<f32>,
    /// q, k and v stacked row-wise.
    pub(crate) qkv: DecodeMatrix,
    pub(crate) attn_out: DecodeMatrix,
    pub(super) ffn_norm: Vec<f32>,
    /// gate and up stacked row-wise.
    pub(crate) gate_up: DecodeMatrix,
    pub(crate) down: DecodeMatrix,
}

/// The decode weights (read-only, shared by all requests) and the step's scratch buffers.
pub(crate) struct CpuDecoder {
    pub(crate) dims: Dims,
    pub(crate) layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// Token embedding; also the output head when the model ties them, so it is kept in the
    /// head's layout (the panels on VNNI CPUs) and looked up from there.
    pub(super) embed: DecodeMatrix,
    head: Option<DecodeMatrix>,
    /// RoPE tables `(positions, head_dim / 2)`.
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
    scratch: Mutex<Scratch>,
}

/// Buffers reused step after step (sized for the largest batch seen so far).
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    y: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    acts: QActs,
    /// Each row of the step: its sequence and position.
    rows: Vec<(usize, usize)>,
    /// Attention work items: (row, position range), and each one's result.
    items: Vec<(usize, std::ops::Range<usize>)>,
    parts: Vec<Partial>,
}

/// The GGUF tensors of one layer, in the order [`CpuDecoder::new`] takes them.
pub(super) struct RawLayer<'a> {
    pub attn_norm: &'a QTensor,
    pub q: &'a QTensor,
    pub k: &'a QTensor,
    pub v: &'a QTensor,
    pub o: &'a QTensor,
    pub ffn_norm: &'a QTensor,
    pub gate: &'a QTensor,
    pub up: &'a QTensor,
    pub down: &'a QTensor,
}

fn vector(t: &QTensor) -> candle_core::Result<Vec<f32>> {
    t.dequantize(&candle_core::Device::Cpu)?.to_vec1::<f32>()
}

impl CpuDecoder {
    /// `cos`/`sin`: the RoPE tables `(positions, head_dim / 2)` the prefill uses too.
    pub(super) fn new(
        dims: Dims,
        layers: &[RawLayer<'_>],
        embed: &QTensor,
        output: Option<&QTensor>,
        final_norm: &QTensor,
        (cos, sin): (Vec<f32>, Vec<f32>),
    ) -> candle_core::Result<CpuDecoder> {
        let layers = layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    attn_norm: vector(l.attn_norm)?,
                    qkv: DecodeMatrix::new(QMatrix::from_qtensors(&[l.q, l.k, l.v])?),
                    attn_out: DecodeMatrix::new(QMatrix::from_qtensors(&[l.o])?),
                    ffn_norm: vector(l.ffn_norm)?,
                    gate_up: DecodeMatrix::new(QMatrix::from_qtensors(&[l.gate, l.up])?),
                    down: DecodeMatrix::new(QMatrix::from_qtensors(&[l.down])?),
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(CpuDecoder {
            dims,
            layers,
            final_norm: vector(final_norm)?,
            embed: DecodeMatrix::new(QMatrix::from_qtensors(&[embed])?),
            head: output
                .map(|o| QMatrix::from_qtensors(&[o]).map(DecodeMatrix::new))
                .transpose()?,
            cos,
            sin,
            scratch: Mutex::default(),
        })
    }

    fn head(&self) -> &DecodeMatrix {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// The output head alone: `logits` from the final-normed, quantised activations.
    pub fn head_matmul(&self, acts: &QActs, logits: &mut [f32]) {
        self.head().matmul(acts, logits);
    }

    pub fn vocab(&self) -> usize {
        self.head().rows()
    }

    /// Bytes one step reads for one sequence: every projection, the head and the norms.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_in_bytes()
                    + l.attn_out.size_in_bytes()
                    + l.gate_up.size_in_bytes()
                    + l.down.size_in_bytes()
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
            })
            .sum();
        layers + self.head().size_in_bytes() + 4 * self.final_norm.len()
    }

    /// Whether `token` can run at `pos` of `kv`.
    pub fn check(&self, kv: &HostKv, pos: usize, token: u32) -> candle_core::Result<()> {
        let half = self.dims.head_dim / 2;
        if pos >= kv.capacity || pos >= self.cos.len() / half {
            candle_core::bail!("position {pos} is past the cache of {}", kv.capacity);
        }
        if token as usize >= self.embed.rows() {
            candle_core::bail!("token id {token} is outside the vocabulary");
        }
        if kv.n_layers() != self.layers.len() {
            candle_core::bail!(
                "a cache of {} layers for {}",
                kv.n_layers(),
                self.layers.len()
            );
        }
        Ok(())
    }

    /// Rotates the query and key heads of one `[q | k | v]` row for position `pos` and writes
    /// its keys and values into layer `layer` of `kv` at that position.
    pub(super) fn rope_and_cache(
        &self,
        row: &mut [f32],
        pos: usize,
        kv: &mut HostKv,
        layer: usize,
    ) {
        let Dims {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
            ..
        } = self.dims;
        let half = hd / 2;
        let (cos, sin) = (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        );
        let (qk, v) = row.split_at_mut((nh + nkv) * hd);
        for head in qk.chunks_exact_mut(hd) {
            rope_interleaved(head, cos, sin);
        }
        let cap = kv.capacity;
        for g in 0..nkv {
            let at = (g * cap + pos) * hd;
            kv.write(
                layer,
                at,
                &qk[(nh + g) * hd..(nh + g + 1) * hd],
                &v[g * hd..(g + 1) * hd],
            );
        }
    }

    /// Runs each sequence's tokens at their positions, writing their keys and values into its
    /// cache; `logits` receives one row of `vocab` per token, sequence after sequence. A row's
    /// logits are the same bits whatever else runs in the step (other sequences, or more rows
    /// of its own): the matmuls treat each row alone, and attention splits a row's positions
    /// by their number only.
    pub fn step(&self, seqs: &mut [SeqStep<'_>], logits: &mut [f32]) -> candle_core::Result<()> {
        let Dims {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
            ffn,
            rms_eps,
        } = self.dims;
        let b: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let hidden = nh * hd;
        let qkv_width = (nh + 2 * nkv) * hd;
        if logits.len() != b * self.vocab() {
            candle_core::bail!("logits buffer of {} for {b} rows", logits.len());
        }
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                candle_core::bail!("a sequence with no token to run");
            }
            for (j, &token) in s.tokens.iter().enumerate() {
                self.check(s.kv, s.pos + j, token)?;
            }
        }
        let mut guard = self.scratch.lock().expect("no panics while held");
        let sc = &mut *guard;
        sc.rows.clear();
        for (i, s) in seqs.iter().enumerate() {
            sc.rows.extend((0..s.tokens.len()).map(|j| (i, s.pos + j)));
        }
        sc.x.resize(b * hidden, 0.0);
        sc.h.resize(b * hidden, 0.0);
        sc.qkv.resize(b * qkv_width, 0.0);
        sc.y.resize(b * hidden, 0.0);
        sc.proj.resize(b * hidden, 0.0);
        sc.gate_up.resize(b * 2 * ffn, 0.0);
        sc.act.resize(b * ffn, 0.0);
        let tokens = seqs.iter().flat_map(|s| s.tokens.iter());
        for (&token, x) in tokens.zip(sc.x.chunks_exact_mut(hidden)) {
            self.embed.dequantize_row(token as usize, x);
        }

        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm_rows(&sc.x, &layer.attn_norm, rms_eps, &mut sc.h);
            sc.acts.quantize(&sc.h, b, hidden);
            layer.qkv.matmul(&sc.acts, &mut sc.qkv);
            for (&(i, pos), row) in sc.rows.iter().zip(sc.qkv.chunks_exact_mut(qkv_width)) {
                self.rope_and_cache(row, pos, seqs[i].kv, li);
            }
            self.attend(seqs, li, sc);
            sc.acts.quantize(&sc.y, b, hidden);
            layer.attn_out.matmul(&sc.acts, &mut sc.proj);
            add_into(&mut sc.x, &sc.proj);

            rms_norm_rows(&sc.x, &layer.ffn_norm, rms_eps, &mut sc.h);
            sc.acts.quantize(&sc.h, b, hidden);
            layer.gate_up.matmul(&sc.acts, &mut sc.gate_up);
            for (gu, out) in sc
                .gate_up
                .chunks_exact(2 * ffn)
                .zip(sc.act.chunks_exact_mut(ffn))
            {
                let (gate, up) = gu.split_at(ffn);
                silu_mul(gate, up, out);
            }
            sc.acts.quantize(&sc.act, b, ffn);
            layer.down.matmul(&sc.acts, &mut sc.proj);
            add_into(&mut sc.x, &sc.proj);
        }
        rms_norm_rows(&sc.x, &self.final_norm, rms_eps, &mut sc.h);
        sc.acts.quantize(&sc.h, b, hidden);
        self.head_matmul(&sc.acts, logits);
        Ok(())
    }

    /// Attention of each row's query heads (in `sc.qkv`) over its sequence's cache up to and
    /// including its position, into `sc.y`. Work items are (row, position range): long
    /// contexts are split into fixed chunks spread over the threads, as flash-decoding does.
    /// The chunks depend on the context length alone, never on the batch or the thread count,
    /// so a row's logits are bit-identical whatever it is batched with: greedy tokens do not
    /// change when another request joins the step, or when a draft is verified beside them.
    fn attend(&self, seqs: &[SeqStep<'_>], layer: usize, sc: &mut Scratch) {
        let Dims {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
            ..
        } = self.dims;
        let qkv_width = (nh + 2 * nkv) * hd;
        let items = &mut sc.items;
        items.clear();
        for (r, &(_, pos)) in sc.rows.iter().enumerate() {
            let len = pos + 1;
            let chunk = if len >= PARALLEL_ATTENTION_MIN_LEN {
                ATTENTION_CHUNK
            } else {
                len
            };
            for start in (0..len).step_by(chunk) {
                items.push((r, start..len.min(start + chunk)));
            }
        }
        if sc.parts.len() < items.len() {
            sc.parts.resize_with(items.len(), Partial::default);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let parts_addr = sc.parts.as_mut_ptr() as usize;
        let (qkv, rows) = (&sc.qkv, &sc.rows);
        let work = |range: std::ops::Range<usize>| {
            for item in range {
                let (r, ref positions) = items[item];
                let s = &seqs[rows[r].0];
                let q = &qkv[r * qkv_width..r * qkv_width + nh * hd];
                // SAFETY: each item writes only its own slot, and `parts` outlives this call.
                let part = unsafe { &mut *(parts_addr as *mut Partial).add(item) };
                let dims = (nh, nkv, s.kv.capacity, hd);
                match s.kv.layer(layer) {
                    KvLayer::F32(k, v) => part.attend(q, (k, v), dims, positions.clone(), scale),
                    KvLayer::F16(k, v) => part.attend(q, (k, v), dims, positions.clone(), scale),
                }
            }
        };
        if items.len() == 1 {
            work(0..1);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(items.len(), work);
        }
        let mut item = 0;
        for (r, y) in sc.y.chunks_exact_mut(nh * hd).enumerate() {
            let start = item;
            while item < items.len() && items[item].0 == r {
                item += 1;
            }
            merge(&sc.parts[start..item], nh, hd, y);
        }
    }
}

/// Dot product in eight independent lanes, so the compiler can vectorise it (a plain float
/// sum must keep its order and stays scalar).
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        let (x, y): (&[f32; 8], &[f32; 8]) = (x.try_into().unwrap(), y.try_into().unwrap());
        for ((acc, x), y) in acc.iter_mut().zip(x).zip(y) {
            *acc += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out = x / sqrt(mean(x²) + eps) * weight`, row by row.
pub(super) fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (x, out) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mean = dot(x, x) / n as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, &x), &w) in out.iter_mut().zip(x).zip(weight) {
            *o = x * inv * w;
        }
    }
}

/// RoPE on one head, pairs (2i, 2i + 1) rotated by angle i (GGUF llama's interleaved layout).
fn rope_interleaved(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * c - b * s;
        pair[1] = a * s + b * c;
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (x, y) in x.iter_mut().zip(y) {
        *x += y;
    }
}
