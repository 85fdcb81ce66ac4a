//! One attention head: scaled dot-product scores, softmax and the probability-weighted sum of
//! values, either every query against every key (BERT) or causal (a decoder's prefill, each
//! query seeing the keys up to its own position). AVX-512 and AVX2 score a tile of queries
//! against each key vector loaded and keep a query's context row in registers, for head widths
//! of whole registers; other widths and CPUs take the portable body (compiled for AVX2 where
//! the CPU has it).

use super::activation::exp;
use super::norm::sum;
use super::{avx512_bf16, LANES};

/// One head's rows in a row-major buffer: row `i` is `data[i * stride + offset..][..width]`.
#[derive(Clone, Copy)]
pub struct HeadRows<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
}

impl<'a> HeadRows<'a> {
    #[inline(always)]
    fn row(&self, i: usize, width: usize) -> &'a [f32] {
        &self.data[i * self.stride + self.offset..][..width]
    }

    fn covers(&self, rows: usize, width: usize) -> bool {
        rows == 0 || self.data.len() >= (rows - 1) * self.stride + self.offset + width
    }
}

/// One attention head: `queries` query rows against `keys` key and value rows.
#[derive(Clone, Copy)]
pub struct Head<'a> {
    pub q: HeadRows<'a>,
    pub k: HeadRows<'a>,
    pub v: HeadRows<'a>,
    pub queries: usize,
    pub keys: usize,
    /// The queries are the last `queries` of the `keys` positions, and each sees the keys up to
    /// and including its own (a decoder's causal mask). Otherwise every query sees every key.
    pub causal: bool,
}

impl Head<'_> {
    /// How many keys (from the first) query `i` attends to.
    #[inline(always)]
    fn visible(&self, i: usize) -> usize {
        if self.causal {
            self.keys - self.queries + i + 1
        } else {
            self.keys
        }
    }

    /// The head width `out` implies, after checking every row the kernels read is there.
    fn width(&self, out: &[f32]) -> usize {
        assert!(self.queries > 0 && self.keys > 0, "an empty attention head");
        assert!(
            !self.causal || self.queries <= self.keys,
            "more queries than causal keys"
        );
        let d = out.len() / self.queries;
        assert_eq!(out.len(), self.queries * d, "out is not [queries, d]");
        assert!(self.q.covers(self.queries, d), "query rows out of bounds");
        assert!(self.k.covers(self.keys, d), "key rows out of bounds");
        assert!(self.v.covers(self.keys, d), "value rows out of bounds");
        d
    }
}

/// One head's keys transposed to `[d, padded]`, the layout the kernels score against: row `e`
/// holds dimension `e` of every key, `padded` (a whole number of 32-key pairs) columns, the
/// padding zero. Built once by [`transpose_keys`], it serves every query head that shares these
/// keys (grouped-query attention) and every block of queries, where [`attention_head`]
/// transposes the keys it sees on every call.
#[derive(Clone, Copy)]
pub struct KeysT<'a> {
    pub data: &'a [f32],
    pub keys: usize,
    pub padded: usize,
}

/// Transposes the first `keys` rows of `k` (each `d` wide) into `out` as [`KeysT`] expects;
/// returns `padded`. Goes 16 keys at a time, so each output row is written a cache line at once.
pub fn transpose_keys(k: HeadRows<'_>, keys: usize, d: usize, out: &mut Vec<f32>) -> usize {
    assert!(k.covers(keys, d), "key rows out of bounds");
    let padded = keys.next_multiple_of(32);
    out.clear();
    out.resize(d * padded, 0.0);
    for j0 in (0..keys).step_by(LANES) {
        let n = LANES.min(keys - j0);
        let rows: [&[f32]; LANES] =
            std::array::from_fn(|i| if i < n { k.row(j0 + i, d) } else { &[] });
        for e in 0..d {
            let line = &mut out[e * padded + j0..][..n];
            for (x, row) in line.iter_mut().zip(&rows[..n]) {
                *x = row[e];
            }
        }
    }
    padded
}

/// Attention of one head: writes the context rows, `[queries, d]`, to `out` (`d` is
/// `out.len() / queries`); `scratch` is reused between calls. A query's result depends only on
/// its own row and the keys it sees, never on which other queries share the call.
pub fn attention_head(head: &Head<'_>, scale: f32, out: &mut [f32], scratch: &mut Vec<f32>) {
    dispatch(head, None, scale, out, scratch)
}

/// [`attention_head`] against keys already transposed (`keys_t` holds `head.k`'s rows, at
/// least `head.keys` of them); `head.k` is not read. The same results, bit for bit.
pub fn attention_head_over(
    head: &Head<'_>,
    keys_t: KeysT<'_>,
    scale: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    assert!(
        keys_t.keys >= head.keys
            && keys_t.padded >= keys_t.keys.next_multiple_of(32)
            && keys_t.padded.is_multiple_of(32)
            && keys_t.data.len() >= keys_t.padded * (out.len() / head.queries.max(1)),
        "transposed keys do not cover the head"
    );
    dispatch(head, Some(keys_t), scale, out, scratch)
}

fn dispatch(
    head: &Head<'_>,
    keys_t: Option<KeysT<'_>>,
    scale: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512_bf16() {
            // SAFETY: the CPU has the features the wrapper is compiled for.
            return unsafe { x86::attention_head(head, keys_t, scale, out, scratch) };
        }
        if super::avx2() {
            // SAFETY: as above.
            return unsafe { avx2::attention_head(head, keys_t, scale, out, scratch) };
        }
    }
    attention_head_body(head, keys_t, scale, out, scratch)
}

/// The portable body compiled for AVX2: eight lanes per instruction, the same arithmetic in the
/// same order (no multiply-add is fused), so the same results; for the head widths that
/// [`avx2::attention_head`] does not tile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attention_head_avx2(
    head: &Head<'_>,
    keys_t: Option<KeysT<'_>>,
    scale: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    attention_head_body(head, keys_t, scale, out, scratch)
}

/// A call's transposed keys and per-query score rows: `keys_t`'s keys, or `head.k`'s
/// transposed into `scratch`, then `rows` score rows of `padded` each, zeroed, after them.
/// Returns the keys `[d, padded]`, `padded` and the score rows.
fn keys_and_scores<'a>(
    head: &Head<'_>,
    keys_t: Option<KeysT<'a>>,
    d: usize,
    rows: usize,
    scratch: &'a mut Vec<f32>,
) -> (&'a [f32], usize, &'a mut [f32]) {
    match keys_t {
        Some(t) => {
            scratch.clear();
            scratch.resize(rows * t.padded, 0.0);
            (t.data, t.padded, scratch)
        }
        None => {
            let padded = transpose_keys(head.k, head.keys, d, scratch);
            scratch.resize(d * padded + rows * padded, 0.0);
            let (kt, scores) = scratch.split_at_mut(d * padded);
            (kt, padded, scores)
        }
    }
}

#[inline(always)]
pub(super) fn attention_head_body(
    head: &Head<'_>,
    keys_t: Option<KeysT<'_>>,
    scale: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let d = head.width(out);
    // Keys transposed to [d, padded], so a query's scores are d multiply-adds over whole
    // 16-lane rows (the padding is zero and its scores are dropped): a sequence of 30 tokens
    // would otherwise spend most of its time in scalar remainder loops.
    let (kt, padded, scores) = keys_and_scores(head, keys_t, d, 1, scratch);
    for i in 0..head.queries {
        let len = head.visible(i);
        let width = len.next_multiple_of(LANES);
        let query = head.q.row(i, d);
        let scores = &mut scores[..width];
        scores.fill(0.0);
        for (e, qe) in query.iter().enumerate() {
            let qe = qe * scale;
            let keys = kt[e * padded..e * padded + width].chunks_exact(LANES);
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
            let value = head.v.row(j, d);
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
mod avx2 {
    //! The AVX2 bodies (eight lanes). Each `unsafe fn` here may only be called once `avx2()`
    //! holds. The portable body compiled for AVX2 scores one query at a time, loading every
    //! key vector once per query, and adds without fusing: a 588-token prefill spent twice as
    //! long in attention as in its projections.

    use std::arch::x86_64::*;

    use super::{exp, sum, Head, KeysT};

    /// Queries per scoring tile: each key vector loaded feeds this many queries.
    const TILE: usize = 4;

    /// Head widths of two to eight registers (16 to 64) take [`head_body`]; others the portable
    /// body.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn attention_head(
        head: &Head<'_>,
        keys_t: Option<KeysT<'_>>,
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let d = head.width(out);
        // SAFETY: `width` checked that every row `head` reads is in bounds.
        unsafe {
            match d {
                16 => head_body::<2>(head, keys_t, scale, out, scratch),
                32 => head_body::<4>(head, keys_t, scale, out, scratch),
                48 => head_body::<6>(head, keys_t, scale, out, scratch),
                64 => head_body::<8>(head, keys_t, scale, out, scratch),
                _ => super::attention_head_avx2(head, keys_t, scale, out, scratch),
            }
        }
    }

    /// A head of `8 × V` columns, [`TILE`] queries at a time.
    ///
    /// # Safety
    /// As `Head::width` asserts: the query, key and value rows are in bounds.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn head_body<const V: usize>(
        head: &Head<'_>,
        keys_t: Option<KeysT<'_>>,
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let d = 8 * V;
        // Keys transposed to [d, padded] (a multiple of 32 keys, the padding zero).
        let (kt, padded, scores) = super::keys_and_scores(head, keys_t, d, TILE, scratch);
        let mut i = 0;
        while i < head.queries {
            let n = (head.queries - i).min(TILE);
            // SAFETY: the caller's contract; kt and scores are sized above.
            unsafe {
                match n {
                    4 => tile::<V, 4>(head, i, scale, kt, padded, scores, out),
                    3 => tile::<V, 3>(head, i, scale, kt, padded, scores, out),
                    2 => tile::<V, 2>(head, i, scale, kt, padded, scores, out),
                    _ => tile::<V, 1>(head, i, scale, kt, padded, scores, out),
                }
            }
            i += n;
        }
    }

    /// Queries `i0..i0 + R`: scores against blocks of 16 keys (two key loads feed `2R`
    /// multiply-adds), each query's softmax over the keys it sees, then its context row, `V`
    /// registers, over the value rows it sees. A query's arithmetic is the same whichever tile
    /// it is in: its scores are the same sums, and the keys past it are neither weighed nor
    /// added.
    ///
    /// # Safety
    /// As [`head_body`]; `kt` is `[8 V, padded]`, `scores` `[TILE, padded]`.
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const V: usize, const R: usize>(
        head: &Head<'_>,
        i0: usize,
        scale: f32,
        kt: &[f32],
        padded: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let d = 8 * V;
        let lens: [usize; R] = std::array::from_fn(|r| head.visible(i0 + r));
        let longest = lens.iter().copied().max().unwrap_or(0);
        let mut qs = [[0f32; 64]; R];
        for (r, q) in qs.iter_mut().enumerate() {
            for (s, x) in q.iter_mut().zip(head.q.row(i0 + r, d)) {
                *s = x * scale;
            }
        }
        assert!(longest <= padded && kt.len() >= d * padded && scores.len() >= R * padded);
        let zero = _mm256_setzero_ps();
        let (ktp, sp, v) = (kt.as_ptr(), scores.as_mut_ptr(), head.v);
        // SAFETY: kt is [d, padded] and padded ≥ 16 · blocks (a multiple of 32 ≥ longest);
        // scores is [TILE, padded]; the value rows below each query's length are in bounds
        // (the caller's contract); out rows i0..i0 + R are in [queries, d].
        unsafe {
            for b in 0..longest.div_ceil(16) {
                let mut acc = [[zero; 2]; R];
                for e in 0..d {
                    let k0 = _mm256_loadu_ps(ktp.add(e * padded + 16 * b));
                    let k1 = _mm256_loadu_ps(ktp.add(e * padded + 16 * b + 8));
                    for r in 0..R {
                        let q = _mm256_set1_ps(qs[r][e]);
                        acc[r][0] = _mm256_fmadd_ps(q, k0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(q, k1, acc[r][1]);
                    }
                }
                for r in 0..R {
                    _mm256_storeu_ps(sp.add(r * padded + 16 * b), acc[r][0]);
                    _mm256_storeu_ps(sp.add(r * padded + 16 * b + 8), acc[r][1]);
                }
            }
            for r in 0..R {
                let len = lens[r];
                let row = &mut scores[r * padded..r * padded + len];
                let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                for s in row.iter_mut() {
                    *s = exp(*s - max);
                }
                let inv = _mm256_set1_ps(1.0 / sum(row));
                let mut ctx = [zero; V];
                for (j, &p) in row.iter().enumerate() {
                    let value = v.data.as_ptr().add(j * v.stride + v.offset);
                    let p = _mm256_set1_ps(p);
                    for c in 0..V {
                        ctx[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value.add(8 * c)), ctx[c]);
                    }
                }
                let o = out.as_mut_ptr().add((i0 + r) * d);
                for c in 0..V {
                    _mm256_storeu_ps(o.add(8 * c), _mm256_mul_ps(ctx[c], inv));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 bodies. Each `unsafe fn` here may only be called once `avx512_bf16()` holds.

    use std::arch::x86_64::*;

    use super::{Head, KeysT};
    use crate::kernels::activation::x86::exp_ps;

    /// Head widths that are whole registers (16 to 64) take [`head`]; others the portable body.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub unsafe fn attention_head(
        head: &Head<'_>,
        keys_t: Option<KeysT<'_>>,
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let d = head.width(out);
        // SAFETY: `width` checked that every row `head` reads is in bounds.
        unsafe {
            match d {
                16 => head_body::<1>(head, keys_t, scale, out, scratch),
                32 => head_body::<2>(head, keys_t, scale, out, scratch),
                48 => head_body::<3>(head, keys_t, scale, out, scratch),
                64 => head_body::<4>(head, keys_t, scale, out, scratch),
                _ => super::attention_head_body(head, keys_t, scale, out, scratch),
            }
        }
    }

    /// Queries per register tile: each key vector loaded is used by this many queries, and
    /// each value row by as many context rows.
    const TILE: usize = 4;

    /// [`super::attention_head_body`] for a head of `16 × V` columns, [`TILE`] queries at a
    /// time with their scores and context rows in registers.
    ///
    /// # Safety
    /// As `Head::width` asserts: the query, key and value rows are in bounds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    unsafe fn head_body<const V: usize>(
        head: &Head<'_>,
        keys_t: Option<KeysT<'_>>,
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let d = 16 * V;
        // Keys transposed to [d, padded]; whole pairs of 16-key blocks, the padding zero.
        let (kt, padded, scores) = super::keys_and_scores(head, keys_t, d, TILE, scratch);
        let mut i = 0;
        while i < head.queries {
            let n = (head.queries - i).min(TILE);
            // SAFETY: the caller's contract; kt and scores are sized above.
            unsafe {
                match n {
                    4 => tile::<V, 4>(head, i, scale, kt, padded, scores, out),
                    3 => tile::<V, 3>(head, i, scale, kt, padded, scores, out),
                    2 => tile::<V, 2>(head, i, scale, kt, padded, scores, out),
                    _ => tile::<V, 1>(head, i, scale, kt, padded, scores, out),
                }
            }
            i += n;
        }
    }

    /// Queries `i0..i0 + R`: scores against pairs of 16-key blocks (two key loads feed `2R`
    /// multiply-adds), each query's softmax over the keys it sees (the keys past them scored
    /// zero), then every value row weighted into the `R` context rows. A query's arithmetic is
    /// the same whichever tile it is in: the extra keys of a longer neighbour add exact zeros.
    ///
    /// # Safety
    /// As [`head_body`]; `kt` is `[16 V, padded]`, `scores` `[TILE, padded]`.
    // Register arrays indexed in lockstep read clearer as `for c in 0..V` than as zips.
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    unsafe fn tile<const V: usize, const R: usize>(
        head: &Head<'_>,
        i0: usize,
        scale: f32,
        kt: &[f32],
        padded: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let d = 16 * V;
        let lens: [usize; R] = std::array::from_fn(|r| head.visible(i0 + r));
        let longest = lens.iter().copied().max().unwrap_or(0);
        let pairs = longest.div_ceil(32);
        let mut qs = [[0f32; 64]; R];
        for (r, q) in qs.iter_mut().enumerate() {
            for (s, x) in q.iter_mut().zip(head.q.row(i0 + r, d)) {
                *s = x * scale;
            }
        }
        let zero = _mm512_setzero_ps();
        let (kt, scores, (v, out)) = (kt.as_ptr(), scores.as_mut_ptr(), (head.v, out.as_mut_ptr()));
        // SAFETY (whole body): kt is [d, padded] with padded ≥ 32 · pairs, scores is
        // [TILE, padded]; value rows below `longest ≤ keys` are in bounds (caller); out rows
        // i0..i0 + R are in [queries, d].
        unsafe {
            for b in 0..pairs {
                let mut acc = [[zero; 2]; R];
                for e in 0..d {
                    let k0 = _mm512_loadu_ps(kt.add(e * padded + 32 * b));
                    let k1 = _mm512_loadu_ps(kt.add(e * padded + 32 * b + 16));
                    for r in 0..R {
                        let q = _mm512_set1_ps(qs[r][e]);
                        acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
                    }
                }
                for r in 0..R {
                    _mm512_storeu_ps(scores.add(r * padded + 32 * b), acc[r][0]);
                    _mm512_storeu_ps(scores.add(r * padded + 32 * b + 16), acc[r][1]);
                }
            }
            let mut inv = [zero; R];
            for r in 0..R {
                let row = scores.add(r * padded);
                let len = lens[r];
                let blocks = len.div_ceil(16);
                let mask = |b: usize| -> __mmask16 {
                    if b + 1 < blocks || len.is_multiple_of(16) {
                        0xffff
                    } else {
                        (1 << (len % 16)) - 1
                    }
                };
                let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
                for b in 0..blocks {
                    let s = _mm512_loadu_ps(row.add(16 * b));
                    max = _mm512_mask_max_ps(max, mask(b), max, s);
                }
                let max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
                let mut total = zero;
                for b in 0..blocks {
                    let s = _mm512_loadu_ps(row.add(16 * b));
                    let p = _mm512_maskz_mov_ps(mask(b), exp_ps(_mm512_sub_ps(s, max)));
                    _mm512_storeu_ps(row.add(16 * b), p);
                    total = _mm512_add_ps(total, p);
                }
                // The keys this query does not see, up to the tile's longest, weigh zero.
                for b in blocks..longest.div_ceil(16) {
                    _mm512_storeu_ps(row.add(16 * b), zero);
                }
                inv[r] = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(total));
            }
            let mut ctx = [[zero; V]; R];
            for j in 0..longest {
                let value = v.data.as_ptr().add(j * v.stride + v.offset);
                let vs: [__m512; V] = std::array::from_fn(|c| _mm512_loadu_ps(value.add(16 * c)));
                for r in 0..R {
                    let p = _mm512_set1_ps(*scores.add(r * padded + j));
                    for c in 0..V {
                        ctx[r][c] = _mm512_fmadd_ps(p, vs[c], ctx[r][c]);
                    }
                }
            }
            for r in 0..R {
                let row = out.add((i0 + r) * d);
                for c in 0..V {
                    _mm512_storeu_ps(row.add(16 * c), _mm512_mul_ps(ctx[r][c], inv[r]));
                }
            }
        }
    }
}
