//! One attention head over one sequence: scaled dot-product scores, softmax and the
//! probability-weighted sum of values. AVX-512 keeps a query's scores and context row in
//! registers for head widths of whole registers; other widths take the portable body.

use super::activation::exp;
use super::norm::sum;
use super::{avx512_bf16, LANES};

/// One attention head over one sequence, no mask (every position is a real token).
/// `qkv` holds the sequence's `len` rows at stride `ld`; the head's query, key and value
/// columns start at `q`, `k` and `v` and are `out.len() / len` wide. Writes the context rows,
/// `[len, d]`, to `out`; `scratch` is reused between calls.
#[allow(clippy::too_many_arguments)]
pub fn attention_head(
    qkv: &[f32],
    ld: usize,
    len: usize,
    (q, k, v): (usize, usize, usize),
    scale: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    if avx512_bf16() {
        // SAFETY: the CPU has the features the wrapper is compiled for.
        return unsafe { x86::attention_head(qkv, ld, len, (q, k, v), scale, out, scratch) };
    }
    attention_head_body(qkv, ld, len, (q, k, v), scale, out, scratch)
}

#[inline(always)]
pub(super) fn attention_head_body(
    qkv: &[f32],
    ld: usize,
    len: usize,
    (q, k, v): (usize, usize, usize),
    scale: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let d = out.len() / len;
    assert_eq!(out.len(), len * d);
    assert!(qkv.len() >= (len - 1) * ld + q.max(k).max(v) + d);
    // Keys transposed to [d, padded], so a query's scores are d multiply-adds over whole
    // 16-lane rows (the padding is zero and its scores are dropped): a sequence of 30 tokens
    // would otherwise spend most of its time in scalar remainder loops.
    let padded = len.next_multiple_of(LANES);
    scratch.clear();
    scratch.resize(d * padded + padded, 0.0);
    let (kt, scores) = scratch.split_at_mut(d * padded);
    for j in 0..len {
        for (e, x) in qkv[j * ld + k..j * ld + k + d].iter().enumerate() {
            kt[e * padded + j] = *x;
        }
    }
    for i in 0..len {
        let query = &qkv[i * ld + q..i * ld + q + d];
        scores.fill(0.0);
        for (e, qe) in query.iter().enumerate() {
            let qe = qe * scale;
            let keys = kt[e * padded..(e + 1) * padded].chunks_exact(LANES);
            for (s, kv) in scores.chunks_exact_mut(LANES).zip(keys) {
                for (s, kv) in s.iter_mut().zip(kv) {
                    *s += qe * kv;
                }
            }
        }
        let scores = &mut scores[..len];
        let max = max(scores);
        for s in scores.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / sum(scores);
        let ctx = &mut out[i * d..(i + 1) * d];
        ctx.fill(0.0);
        for (j, p) in scores.iter().enumerate() {
            let p = p * inv;
            let value = &qkv[j * ld + v..j * ld + v + d];
            let mut chunks = ctx.chunks_exact_mut(LANES);
            for (c, x) in (&mut chunks).zip(value.chunks_exact(LANES)) {
                for (c, x) in c.iter_mut().zip(x) {
                    *c += p * x;
                }
            }
            let tail = chunks.into_remainder();
            let rest = &value[d - tail.len()..];
            for (c, x) in tail.iter_mut().zip(rest) {
                *c += p * x;
            }
        }
    }
}

#[inline(always)]
fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = l.max(*v);
        }
    }
    lanes.iter().fold(tail, |a, &b| a.max(b))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 bodies. Each `unsafe fn` here may only be called once `avx512_bf16()` holds.

    use std::arch::x86_64::*;

    use crate::embed::kernels::activation::x86::exp_ps;

    /// Head widths that are whole registers (16 to 64) take [`head`]; others the portable body.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub unsafe fn attention_head(
        qkv: &[f32],
        ld: usize,
        len: usize,
        columns: (usize, usize, usize),
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let (q, k, v) = columns;
        let d = out.len() / len;
        assert_eq!(out.len(), len * d);
        assert!(qkv.len() >= (len - 1) * ld + q.max(k).max(v) + d);
        // SAFETY: the asserts above bound every row and column `head` reads.
        unsafe {
            match d {
                16 => head::<1>(qkv, ld, len, columns, scale, out, scratch),
                32 => head::<2>(qkv, ld, len, columns, scale, out, scratch),
                48 => head::<3>(qkv, ld, len, columns, scale, out, scratch),
                64 => head::<4>(qkv, ld, len, columns, scale, out, scratch),
                _ => super::attention_head_body(qkv, ld, len, columns, scale, out, scratch),
            }
        }
    }

    /// [`super::attention_head_body`] for a head of `16 × V` columns, with the scores of a
    /// query and its context row kept in registers.
    ///
    /// # Safety
    /// As `attention_head` asserts: `len` rows at stride `ld` hold the three column ranges.
    // Register arrays indexed in lockstep read clearer as `for c in 0..V` than as zips.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    unsafe fn head<const V: usize>(
        qkv: &[f32],
        ld: usize,
        len: usize,
        (q, k, v): (usize, usize, usize),
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let d = 16 * V;
        let padded = len.next_multiple_of(16);
        let blocks = padded / 16;
        scratch.clear();
        scratch.resize(d * padded + padded, 0.0);
        let (kt, scores) = scratch.split_at_mut(d * padded);
        for j in 0..len {
            for (e, x) in qkv[j * ld + k..j * ld + k + d].iter().enumerate() {
                kt[e * padded + j] = *x;
            }
        }
        let last: __mmask16 = if len.is_multiple_of(16) {
            0xffff
        } else {
            (1 << (len % 16)) - 1
        };
        let (kt, scores) = (kt.as_ptr(), scores.as_mut_ptr());
        let zero = _mm512_setzero_ps();
        // SAFETY (whole body): kt is [d, padded] and scores [padded]; qkv reads are bounded by
        // the caller's assert; out is [len, d].
        unsafe {
            for i in 0..len {
                let query = qkv.as_ptr().add(i * ld + q);
                for b in 0..blocks {
                    // Four partial sums hide the FMA latency of one long chain.
                    let mut acc = [zero; 4];
                    for e in 0..d {
                        let qe = _mm512_set1_ps(*query.add(e) * scale);
                        let keys = _mm512_loadu_ps(kt.add(e * padded + 16 * b));
                        acc[e % 4] = _mm512_fmadd_ps(qe, keys, acc[e % 4]);
                    }
                    let s =
                        _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                    _mm512_storeu_ps(scores.add(16 * b), s);
                }
                let mask = |b: usize| if b + 1 == blocks { last } else { 0xffff };
                let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
                for b in 0..blocks {
                    let s = _mm512_loadu_ps(scores.add(16 * b));
                    max = _mm512_mask_max_ps(max, mask(b), max, s);
                }
                let max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
                let mut total = zero;
                for b in 0..blocks {
                    let s = _mm512_loadu_ps(scores.add(16 * b));
                    let p = _mm512_maskz_mov_ps(mask(b), exp_ps(_mm512_sub_ps(s, max)));
                    _mm512_storeu_ps(scores.add(16 * b), p);
                    total = _mm512_add_ps(total, p);
                }
                let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(total));
                // Two sets of accumulators, even and odd keys, for the same reason.
                let mut even = [zero; V];
                let mut odd = [zero; V];
                let mut j = 0;
                while j + 1 < len {
                    let (p0, p1) = (
                        _mm512_set1_ps(*scores.add(j)),
                        _mm512_set1_ps(*scores.add(j + 1)),
                    );
                    let (v0, v1) = (
                        qkv.as_ptr().add(j * ld + v),
                        qkv.as_ptr().add((j + 1) * ld + v),
                    );
                    for c in 0..V {
                        even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0.add(16 * c)), even[c]);
                        odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1.add(16 * c)), odd[c]);
                    }
                    j += 2;
                }
                if j < len {
                    let p = _mm512_set1_ps(*scores.add(j));
                    let v0 = qkv.as_ptr().add(j * ld + v);
                    for c in 0..V {
                        even[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v0.add(16 * c)), even[c]);
                    }
                }
                let row = out.as_mut_ptr().add(i * d);
                for c in 0..V {
                    let ctx = _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inv);
                    _mm512_storeu_ps(row.add(16 * c), ctx);
                }
            }
        }
    }
}
