//! Prefill on the CPU in plain loops over the request's host KV cache, for the formats whose
//! decode runs on the [`CpuDecoder`]. Per layer: RMSNorm, the prefill projections
//! ([`Proj::prefill_rows`](super::weights::Proj::prefill_rows), BF16 or F32, with the residual
//! adds fused into the output and down projections), RoPE, the keys and values written straight
//! into the cache, causal attention by (head, block of queries) on the embedder's attention
//! kernel over candle's thread pool, and SiLU. On candle's ops the same layer was ~25 ops, each
//! allocating its output, and its attention (scores over a copy of the cache, an additive mask,
//! a softmax on libm's exp) took half of a 588-token prefill.

use std::cell::RefCell;

use super::cpu_decode::{rms_norm_rows, CpuDecoder, Dims, HostKv};
use super::host_kv::KvLayer;
use super::schedule::Scheduler;
use super::weights::Weights;
use crate::kernels::{
    attention_head_over, silu_mul, transpose_keys, Head, HeadRows, KeysT, Shared,
};

/// Queries per attention work item: few enough that the causal triangle splits evenly over
/// threads, enough that each key loaded serves several queries.
const QUERY_BLOCK: usize = 32;

thread_local! {
    /// Each pool thread's attention scratch (transposed keys and scores) and context rows.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `tokens` at positions `pos..` through every layer, writing their keys and values into
/// `kv`; returns the last layer's hidden states `(t, hidden)`, before the final norm. Each
/// layer runs in its own turn on the cores ([`Scheduler::compute_turn`]).
pub(super) fn hidden(
    weights: &Weights,
    decoder: &CpuDecoder,
    tokens: &[u32],
    kv: &mut HostKv,
    pos: usize,
    schedule: &Scheduler,
) -> candle_core::Result<Vec<f32>> {
    let dims = decoder.dims;
    let Dims {
        n_head: nh,
        n_kv_head: nkv,
        head_dim: hd,
        ffn,
        rms_eps,
    } = dims;
    let (t, hidden) = (tokens.len(), nh * hd);
    let qkv_width = (nh + 2 * nkv) * hd;
    if t == 0 {
        candle_core::bail!("no tokens to prefill");
    }
    let mut x = vec![0f32; t * hidden];
    for (i, (&token, row)) in tokens.iter().zip(x.chunks_exact_mut(hidden)).enumerate() {
        decoder.check(kv, pos + i, token)?;
        decoder.embed.dequantize_row(token as usize, row);
    }
    let mut h = vec![0f32; t * hidden];
    let mut qkv = vec![0f32; t * qkv_width];
    let mut y = vec![0f32; t * hidden];
    let mut next = vec![0f32; t * hidden];
    let mut gate_up = vec![0f32; t * 2 * ffn];
    let mut act = vec![0f32; t * ffn];
    // An F16 cache's keys and values up to the last query, as F32 `(n_kv_head, len, head_dim)`:
    // converted once per layer, so attention reads the same rounded values decode will.
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    // Each KV head's keys transposed once per layer, for all its query heads and blocks.
    let mut keys_t = vec![Vec::new(); nkv];
    let (cap, len) = (kv.capacity, pos + t);
    for (li, (layer, norms)) in weights.layers.iter().zip(&decoder.layers).enumerate() {
        let _turn = schedule.compute_turn();
        by_rows(&mut h, hidden, QUERY_BLOCK, |r0, h| {
            rms_norm_rows(&x[r0 * hidden..][..h.len()], &norms.attn_norm, rms_eps, h)
        });
        layer.qkv.prefill_rows(&h, t, &mut qkv, None)?;
        for (i, row) in qkv.chunks_exact_mut(qkv_width).enumerate() {
            decoder.rope_and_cache(row, pos + i, kv, li);
        }
        match kv.layer(li) {
            KvLayer::F32(k, v) => attend(&qkv, (k, v), dims, (pos, t, cap), &mut keys_t, &mut y),
            KvLayer::F16(..) => {
                keys.clear();
                values.clear();
                for g in 0..nkv {
                    kv.read(
                        li,
                        g * cap * hd..(g * cap + len) * hd,
                        &mut keys,
                        &mut values,
                    );
                }
                attend(
                    &qkv,
                    (&keys, &values),
                    dims,
                    (pos, t, len),
                    &mut keys_t,
                    &mut y,
                );
            }
        }
        layer.attn_out.prefill_rows(&y, t, &mut next, Some(&x))?;
        std::mem::swap(&mut x, &mut next);

        by_rows(&mut h, hidden, QUERY_BLOCK, |r0, h| {
            rms_norm_rows(&x[r0 * hidden..][..h.len()], &norms.ffn_norm, rms_eps, h)
        });
        layer.gate_up.prefill_rows(&h, t, &mut gate_up, None)?;
        by_rows(&mut act, ffn, QUERY_BLOCK, |r0, act| {
            silu_rows(&gate_up[2 * r0 * ffn..][..2 * act.len()], ffn, act)
        });
        layer.down.prefill_rows(&act, t, &mut next, Some(&x))?;
        std::mem::swap(&mut x, &mut next);
    }
    Ok(x)
}

/// Causal attention of the `t` query rows in `qkv` (positions `pos..pos + t`, after RoPE) over
/// the layer's keys and values `(n_kv_head, cap, head_dim)` up to each query's own position,
/// into `y` `(t, n_head * head_dim)`. Work items are (query head, block of [`QUERY_BLOCK`]
/// queries), taken by the pool's threads from a shared cursor; a query's result does not depend
/// on the block it is in, so any chunking of the prompt gives the same rows. Each KV head's keys
/// are first transposed into `keys_t` (one item per KV head), once for all its items.
fn attend(
    qkv: &[f32],
    (k, v): (&[f32], &[f32]),
    dims: Dims,
    (pos, t, cap): (usize, usize, usize),
    keys_t: &mut [Vec<f32>],
    y: &mut [f32],
) {
    let (nh, nkv, hd) = (dims.n_head, dims.n_kv_head, dims.head_dim);
    let (qkv_width, hidden, n_rep) = ((nh + 2 * nkv) * hd, nh * hd, nh / nkv);
    let len = pos + t;
    let padded = len.next_multiple_of(32);
    let pool = candle_core::utils::barrier_pool();
    {
        let shared = Shared::new(keys_t);
        pool.execute_chunked(nkv, |groups| {
            for g in groups {
                // SAFETY: each item takes its own KV head's buffer.
                let out = &mut unsafe { shared.part(g..g + 1) }[0];
                transpose_keys(group(k, g, cap, hd), len, hd, out);
            }
        });
    }
    let keys_t = &*keys_t;
    let blocks = t.div_ceil(QUERY_BLOCK);
    let scale = 1.0 / (hd as f32).sqrt();
    let out = Shared::new(y);
    let item = |i: usize| {
        let (h, b) = (i / blocks, i % blocks);
        let (r0, r1) = (b * QUERY_BLOCK, ((b + 1) * QUERY_BLOCK).min(t));
        let g = h / n_rep;
        let head = Head {
            q: HeadRows {
                data: &qkv[r0 * qkv_width..r1 * qkv_width],
                stride: qkv_width,
                offset: h * hd,
            },
            k: group(k, g, cap, hd),
            v: group(v, g, cap, hd),
            queries: r1 - r0,
            keys: pos + r1,
            causal: true,
        };
        SCRATCH.with(|s| {
            let (scratch, ctx) = &mut *s.borrow_mut();
            ctx.resize((r1 - r0) * hd, 0.0);
            let kt = KeysT {
                data: &keys_t[g],
                keys: len,
                padded,
            };
            attention_head_over(&head, kt, scale, ctx, scratch);
            for (r, row) in (r0..r1).zip(ctx.chunks_exact(hd)) {
                let at = r * hidden + h * hd;
                // SAFETY: rows r0..r1 of head h's columns are this item's alone.
                unsafe { out.part(at..at + hd) }.copy_from_slice(row);
            }
        });
    };
    pool.execute_chunked(nh * blocks, |items| items.for_each(item));
}

/// KV head `g`'s rows of a layer's cache `(n_kv_head, cap, head_dim)`.
fn group(cache: &[f32], g: usize, cap: usize, hd: usize) -> HeadRows<'_> {
    HeadRows {
        data: &cache[g * cap * hd..(g + 1) * cap * hd],
        stride: hd,
        offset: 0,
    }
}

/// `f(first_row, rows)` for blocks of `block` rows of `out` (rows `width` wide), over the pool:
/// the row-wise steps between the projections would otherwise leave a core idle.
pub(super) fn by_rows<T: Send>(
    out: &mut [T],
    width: usize,
    block: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let rows = out.len() / width;
    let shared = Shared::new(out);
    candle_core::utils::barrier_pool().execute_chunked(rows.div_ceil(block), |blocks| {
        for b in blocks {
            let (r0, r1) = (b * block, ((b + 1) * block).min(rows));
            // SAFETY: each block takes only its own rows.
            f(r0, unsafe { shared.part(r0 * width..r1 * width) });
        }
    });
}

/// `act = silu(gate) * up` row by row, `gate_up` holding each row's gate then up halves.
fn silu_rows(gate_up: &[f32], ffn: usize, act: &mut [f32]) {
    for (gu, out) in gate_up.chunks_exact(2 * ffn).zip(act.chunks_exact_mut(ffn)) {
        let (gate, up) = gu.split_at(ffn);
        silu_mul(gate, up, out);
    }
}
