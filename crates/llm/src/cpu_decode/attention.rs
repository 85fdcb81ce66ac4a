//! Attention of one decode row over its sequence's KV cache, in position ranges that the
//! step spreads over the threads (as flash-decoding does) and [`merge`] joins: a body for heads
//! of 64 on AVX-512 and one on AVX2, each loading a key row once for the query heads that share
//! it, and the portable loops for everything else. The prefill's chunks use it too
//! ([`crate::forward`]).

use super::dot;
use crate::host_kv::KvElem;
use crate::kernels::exp;

/// Below this many positions one thread is faster than waking the others.
pub(crate) const PARALLEL_ATTENTION_MIN_LEN: usize = 128;
/// Positions per attention work item from [`PARALLEL_ATTENTION_MIN_LEN`] on: small enough to
/// balance one long context over the threads, large enough that merging the items is cheap.
pub(crate) const ATTENTION_CHUNK: usize = 64;

/// Softmax-weighted values of one position range, not yet normalised.
#[derive(Default)]
pub(crate) struct Partial {
    /// Per head: the largest score in the range, and the sum of exp(score - max).
    max: Vec<f32>,
    sum: Vec<f32>,
    /// Per head: sum of exp(score - max) * value.
    out: Vec<f32>,
    scores: Vec<f32>,
    /// One key or value row as F32 (the portable body's conversion buffer).
    row: Vec<f32>,
}

impl Partial {
    /// Attends all heads of `q` `(n_head, head_dim)` over `range` of the caches
    /// `(n_kv_head, cap, head_dim)`. The query heads sharing a kv head are done together, so
    /// every key and value row is read once.
    pub fn attend<T: KvElem>(
        &mut self,
        q: &[f32],
        kv: (&[T], &[T]),
        dims: (usize, usize, usize, usize),
        range: std::ops::Range<usize>,
        scale: f32,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::quant::Isa;
            let (nh, nkv, _, hd) = dims;
            // The body for heads of 64 monomorphised for this many query heads per kv head.
            macro_rules! per_group {
                ($body:ident) => {
                    match nh / nkv {
                        1 => return unsafe { self.$body::<1, T>(q, kv, dims, range, scale) },
                        2 => return unsafe { self.$body::<2, T>(q, kv, dims, range, scale) },
                        3 => return unsafe { self.$body::<3, T>(q, kv, dims, range, scale) },
                        4 => return unsafe { self.$body::<4, T>(q, kv, dims, range, scale) },
                        _ => {}
                    }
                };
            }
            let heads_of_64 = hd == 64 && nh % nkv == 0;
            if Isa::detect() == Isa::Avx512Vnni && heads_of_64 {
                // SAFETY: `Isa::detect` saw avx512f, avx512vl, avx2 and fma on this CPU.
                per_group!(attend_avx512);
            }
            if Isa::detect() != Isa::Portable {
                if heads_of_64 {
                    // SAFETY: `Isa::detect` saw avx2, fma and f16c on this CPU.
                    per_group!(attend_avx2_64);
                }
                // SAFETY: `Isa::detect` saw avx2 and fma on this CPU.
                return unsafe { self.attend_avx2(q, kv, dims, range, scale) };
            }
        }
        self.attend_body(q, kv, dims, range, scale)
    }

    /// Empty per-head results for `nh` heads of `hd`, and room for `scores` scores.
    fn reset(&mut self, nh: usize, hd: usize, scores: usize) {
        self.max.clear();
        self.max.resize(nh, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(nh, 0.0);
        self.out.clear();
        self.out.resize(nh * hd, 0.0);
        self.scores.resize(scores, 0.0);
    }

    /// [`Partial::attend`] for heads of 64 (four 512-bit registers) and `R` query heads per kv
    /// head: each key row is loaded once for the `R` scores, and each value row once into the
    /// `R` context rows, which stay in registers for the whole range (the portable loops read
    /// and write them in memory per key). Scores are taken four keys at a time, the four dot
    /// products summed across their lanes together ([`sum4`]: a quarter of the shuffles of four
    /// separate reductions), and the softmax runs 16 scores at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and VL, AVX2 and FMA; `q` is `(n_head, 64)` and the caches hold
    /// `range` of every kv head (as [`Partial::attend`]'s callers guarantee).
    // Register arrays indexed in lockstep read clearer as `for c in 0..4` than as zips.
    #[allow(clippy::needless_range_loop)]
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn attend_avx512<const R: usize, T: KvElem>(
        &mut self,
        q: &[f32],
        (k, v): (&[T], &[T]),
        (nh, nkv, cap, hd): (usize, usize, usize, usize),
        range: std::ops::Range<usize>,
        scale: f32,
    ) {
        use std::arch::x86_64::*;

        use crate::kernels::exp_ps;
        let n = range.len();
        self.reset(nh, hd, R * n);
        assert!(q.len() >= nh * hd && k.len() >= nkv * cap * hd && v.len() >= nkv * cap * hd);
        assert!(range.end <= cap);
        let scores = self.scores.as_mut_ptr();
        // SAFETY (whole body): q rows h < nh, cache rows (g, range) and score slots r * n + j
        // are in bounds by the asserts above; `out` is `nh * 64`.
        unsafe {
            let load4 =
                |p: *const T| -> [__m512; 4] { std::array::from_fn(|c| T::load16(p.add(16 * c))) };
            let dot = |q: &[__m512; 4], key: &[__m512; 4]| -> __m512 {
                let mut acc = _mm512_mul_ps(q[0], key[0]);
                for c in 1..4 {
                    acc = _mm512_fmadd_ps(q[c], key[c], acc);
                }
                acc
            };
            let (scale4, zero) = (_mm_set1_ps(scale), _mm512_setzero_ps());
            for g in 0..nkv {
                let h0 = g * R;
                let qs: [[__m512; 4]; R] = std::array::from_fn(|r| {
                    let row = q.as_ptr().add((h0 + r) * hd);
                    std::array::from_fn(|c| _mm512_loadu_ps(row.add(16 * c)))
                });
                let key_row = |j: usize| k.as_ptr().add((g * cap + range.start + j) * hd);
                let mut j = 0;
                while j + 4 <= n {
                    let keys: [[__m512; 4]; 4] = std::array::from_fn(|i| load4(key_row(j + i)));
                    for r in 0..R {
                        let sums = sum4(std::array::from_fn(|i| dot(&qs[r], &keys[i])));
                        _mm_storeu_ps(scores.add(r * n + j), _mm_mul_ps(sums, scale4));
                    }
                    j += 4;
                }
                for j in j..n {
                    let key = load4(key_row(j));
                    for r in 0..R {
                        *scores.add(r * n + j) = _mm512_reduce_add_ps(dot(&qs[r], &key)) * scale;
                    }
                }
                for r in 0..R {
                    let row = scores.add(r * n);
                    let mask = |i: usize| -> __mmask16 {
                        if i + 16 <= n {
                            0xffff
                        } else {
                            (1 << (n - i)) - 1
                        }
                    };
                    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
                    for i in (0..n).step_by(16) {
                        max = _mm512_mask_max_ps(max, mask(i), max, _mm512_loadu_ps(row.add(i)));
                    }
                    let max = _mm512_reduce_max_ps(max);
                    let (top, mut sum) = (_mm512_set1_ps(max), zero);
                    for i in (0..n).step_by(16) {
                        let m = mask(i);
                        let s = _mm512_maskz_loadu_ps(m, row.add(i));
                        let p = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(s, top)));
                        _mm512_mask_storeu_ps(row.add(i), m, p);
                        sum = _mm512_add_ps(sum, p);
                    }
                    self.max[h0 + r] = max;
                    self.sum[h0 + r] = _mm512_reduce_add_ps(sum);
                }
                let mut ctx = [[zero; 4]; R];
                for j in 0..n {
                    let value = load4(v.as_ptr().add((g * cap + range.start + j) * hd));
                    for r in 0..R {
                        let w = _mm512_set1_ps(*scores.add(r * n + j));
                        for c in 0..4 {
                            ctx[r][c] = _mm512_fmadd_ps(w, value[c], ctx[r][c]);
                        }
                    }
                }
                for r in 0..R {
                    let out = self.out.as_mut_ptr().add((h0 + r) * hd);
                    for c in 0..4 {
                        _mm512_storeu_ps(out.add(16 * c), ctx[r][c]);
                    }
                }
            }
        }
    }

    /// [`Partial::attend`] on AVX2 for heads of 64 and `R` query heads per kv head, the
    /// AVX-512 body's plan at eight lanes within sixteen registers: scores go four keys at a
    /// time for at most two query heads per pass ([`scores_avx2`]), and the context rows stay
    /// in registers a quarter (16 columns) at a time, each value row loaded once for the `R`
    /// heads. Every accumulator fits the sixteen registers: with three heads per pass, or
    /// halves of 32 columns, the compiler kept some on the stack, and each multiply-add waited
    /// on a store and a reload (4.0 ms of one thread for one row over 620 positions and 30
    /// layers, against 1.6 ms now). The portable loops, which this replaces on AVX2, widen
    /// every row into memory, reduce every score alone, and read and write the context rows
    /// in memory for every key.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `q` is `(n_head, 64)` and the caches hold `range` of
    /// every kv head (as [`Partial::attend`]'s callers guarantee).
    #[allow(clippy::needless_range_loop)]
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend_avx2_64<const R: usize, T: KvElem>(
        &mut self,
        q: &[f32],
        (k, v): (&[T], &[T]),
        (nh, nkv, cap, hd): (usize, usize, usize, usize),
        range: std::ops::Range<usize>,
        scale: f32,
    ) {
        use std::arch::x86_64::*;

        let n = range.len();
        self.reset(nh, hd, R * n);
        assert!(hd == 64 && nh == R * nkv);
        assert!(q.len() >= nh * hd && k.len() >= nkv * cap * hd && v.len() >= nkv * cap * hd);
        assert!(range.end <= cap);
        let scores = self.scores.as_mut_ptr();
        // SAFETY (whole body): q rows h < nh, cache rows (g, range) and score slots r * n + j
        // are in bounds by the asserts above; `out` is `nh * 64`.
        unsafe {
            let zero = _mm256_setzero_ps();
            for g in 0..nkv {
                let h0 = g * R;
                let keys = k.as_ptr().add((g * cap + range.start) * hd);
                let query = |r: usize| q.as_ptr().add((h0 + r) * hd);
                let mut r = 0;
                while r < R {
                    if r + 2 <= R {
                        let qs = [query(r), query(r + 1)];
                        scores_avx2::<2, T>(qs, keys, n, scores.add(r * n), n, scale);
                        r += 2;
                    } else {
                        scores_avx2::<1, T>([query(r)], keys, n, scores.add(r * n), n, scale);
                        r += 1;
                    }
                }
                for r in 0..R {
                    let row = std::slice::from_raw_parts_mut(scores.add(r * n), n);
                    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    for s in row.iter_mut() {
                        *s = exp(*s - max);
                    }
                    self.max[h0 + r] = max;
                    self.sum[h0 + r] = lanes_sum(row);
                }
                for quarter in 0..4 {
                    let mut ctx = [[zero; 2]; R];
                    for j in 0..n {
                        let row = v
                            .as_ptr()
                            .add((g * cap + range.start + j) * hd + 16 * quarter);
                        let w: [__m256; R] =
                            std::array::from_fn(|r| _mm256_set1_ps(*scores.add(r * n + j)));
                        for c in 0..2 {
                            let value = T::load8(row.add(8 * c));
                            for r in 0..R {
                                ctx[r][c] = _mm256_fmadd_ps(w[r], value, ctx[r][c]);
                            }
                        }
                    }
                    for r in 0..R {
                        let out = self.out.as_mut_ptr().add((h0 + r) * hd + 16 * quarter);
                        for c in 0..2 {
                            _mm256_storeu_ps(out.add(8 * c), ctx[r][c]);
                        }
                    }
                }
            }
        }
    }

    /// The same loops compiled for AVX2: eight lanes per instruction instead of SSE2's four
    /// (same arithmetic in the same order, so the same results).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn attend_avx2<T: KvElem>(
        &mut self,
        q: &[f32],
        kv: (&[T], &[T]),
        dims: (usize, usize, usize, usize),
        range: std::ops::Range<usize>,
        scale: f32,
    ) {
        self.attend_body(q, kv, dims, range, scale)
    }

    #[inline(always)]
    fn attend_body<T: KvElem>(
        &mut self,
        q: &[f32],
        (k, v): (&[T], &[T]),
        (nh, nkv, cap, hd): (usize, usize, usize, usize),
        range: std::ops::Range<usize>,
        scale: f32,
    ) {
        let n_rep = nh / nkv;
        let n = range.len();
        self.reset(nh, hd, n_rep * n);
        self.row.resize(hd, 0.0);
        let (scores, row) = (&mut self.scores, &mut self.row);
        for g in 0..nkv {
            let heads = g * n_rep..(g + 1) * n_rep;
            let (lo, hi) = ((g * cap + range.start) * hd, (g * cap + range.end) * hd);
            for (j, key) in k[lo..hi].chunks_exact(hd).enumerate() {
                let key = T::as_f32(key, row);
                for (r, h) in heads.clone().enumerate() {
                    let s = dot(&q[h * hd..(h + 1) * hd], key) * scale;
                    scores[r * n + j] = s;
                    self.max[h] = self.max[h].max(s);
                }
            }
            for (r, h) in heads.clone().enumerate() {
                let mut sum = 0f32;
                for s in &mut scores[r * n..(r + 1) * n] {
                    *s = exp(*s - self.max[h]);
                    sum += *s;
                }
                self.sum[h] = sum;
            }
            for (j, value) in v[lo..hi].chunks_exact(hd).enumerate() {
                let value = T::as_f32(value, row);
                for (r, h) in heads.clone().enumerate() {
                    let w = scores[r * n + j];
                    for (o, &x) in self.out[h * hd..(h + 1) * hd].iter_mut().zip(value) {
                        *o += w * x;
                    }
                }
            }
        }
    }
}

/// Scaled scores of `P` query heads of 64 (`qs`) against the `n` key rows from `keys`, into
/// `scores` (head p's at `p * stride`): four keys at a time, each key chunk loaded once for the
/// `P` heads, the `4P` dot products summed across their lanes four at a time ([`sum4_avx2`]).
/// Each score is the same sum in the same order whatever `P` is.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `qs` point to 64 values each, `keys` to `n` rows of 64,
/// and `scores` to `P` rows of `n` at `stride`.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_avx2<const P: usize, T: KvElem>(
    qs: [*const f32; P],
    keys: *const T,
    n: usize,
    scores: *mut f32,
    stride: usize,
    scale: f32,
) {
    use std::arch::x86_64::*;
    // SAFETY (whole body): the caller's contract.
    unsafe {
        let zero = _mm256_setzero_ps();
        let key_row = |j: usize| keys.add(j * 64);
        let mut j = 0;
        while j + 4 <= n {
            let mut acc = [[zero; 4]; P];
            for c in 0..8 {
                let q: [__m256; P] = std::array::from_fn(|p| _mm256_loadu_ps(qs[p].add(8 * c)));
                for i in 0..4 {
                    let key = T::load8(key_row(j + i).add(8 * c));
                    for p in 0..P {
                        acc[p][i] = _mm256_fmadd_ps(q[p], key, acc[p][i]);
                    }
                }
            }
            for p in 0..P {
                let sums = _mm_mul_ps(sum4_avx2(acc[p]), _mm_set1_ps(scale));
                _mm_storeu_ps(scores.add(p * stride + j), sums);
            }
            j += 4;
        }
        for j in j..n {
            let mut acc = [zero; P];
            for c in 0..8 {
                let key = T::load8(key_row(j).add(8 * c));
                for p in 0..P {
                    let q = _mm256_loadu_ps(qs[p].add(8 * c));
                    acc[p] = _mm256_fmadd_ps(q, key, acc[p]);
                }
            }
            for p in 0..P {
                let sums = sum4_avx2([acc[p], zero, zero, zero]);
                *scores.add(p * stride + j) = _mm_cvtss_f32(sums) * scale;
            }
        }
    }
}

/// The lane sums of four vectors, as one: quarters of each pair side by side and added, then
/// the pairs' halves, then within each quarter (15 shuffles and adds for the four, against 32
/// for four `_mm512_reduce_add_ps`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn sum4(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // [a0.q0, a0.q1, a1.q0, a1.q1] + [a0.q2, a0.q3, a1.q2, a1.q3], and likewise a2 and a3.
    let pair = |x, y| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    };
    let (p01, p23) = (pair(a[0], a[1]), pair(a[2], a[3]));
    // Quarter i now holds four partial sums of a_i.
    let v = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(p01, p23),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(p01, p23),
    );
    let v = _mm512_add_ps(v, _mm512_permute_ps::<0b10_11_00_01>(v));
    let v = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
    let firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, v))
}

/// The lane sums of four 8-lane vectors, as one: pairs of lanes, then pairs of pairs within
/// each 128-bit half, then the halves (three horizontal adds and one add for the four).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn sum4_avx2(a: [std::arch::x86_64::__m256; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // [a0 01, a0 23, a1 01, a1 23 | a0 45, a0 67, a1 45, a1 67], likewise a2 and a3.
    let (p01, p23) = (_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    // [a0 0-3, a1 0-3, a2 0-3, a3 0-3 | a0 4-7, a1 4-7, a2 4-7, a3 4-7]
    let q = _mm256_hadd_ps(p01, p23);
    _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q))
}

/// A sum in eight independent lanes, so the compiler can vectorise it.
#[inline(always)]
fn lanes_sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Rescales every range to the overall max of its head, then normalises, into `out`
/// `(n_head * head_dim)`.
pub(crate) fn merge(parts: &[Partial], nh: usize, hd: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (h, out) in out.chunks_exact_mut(hd).enumerate().take(nh) {
        let max = parts
            .iter()
            .map(|p| p.max[h])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for p in parts {
            let w = (p.max[h] - max).exp();
            sum += w * p.sum[h];
            for (o, &x) in out.iter_mut().zip(&p.out[h * hd..(h + 1) * hd]) {
                *o += w * x;
            }
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|o| *o *= inv);
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;

    /// Four vectors of `W` lanes of small integers (every order of their sums is exact), and
    /// each one's lane sum.
    #[cfg(target_arch = "x86_64")]
    fn four_vectors<const W: usize>() -> ([[f32; W]; 4], [f32; 4]) {
        let xs: [[f32; W]; 4] =
            std::array::from_fn(|v| std::array::from_fn(|l| (v * 100 + l * l) as f32));
        (xs, xs.map(|x| x.iter().sum::<f32>()))
    }

    /// The AVX-512 helpers alone (the test command runs them only where the CPU has them).
    #[cfg(target_arch = "x86_64")]
    mod needs_avx512 {
        use super::super::sum4;
        use crate::cpu::Level;

        #[test]
        fn sum4_gives_each_vectors_lane_sum() {
            crate::cpu::require(Level::Avx512);
            let (xs, want) = super::four_vectors::<16>();
            let mut got = [0f32; 4];
            // SAFETY: the CPU runs AVX-512 (required above); every pointer covers what it is
            // read or written for.
            unsafe {
                use std::arch::x86_64::*;
                _mm_storeu_ps(
                    got.as_mut_ptr(),
                    sum4(xs.map(|x| _mm512_loadu_ps(x.as_ptr()))),
                );
            }
            assert_eq!(got, want);
        }
    }

    /// The AVX2 helper alone (the test command runs it only where the CPU has AVX2).
    #[cfg(target_arch = "x86_64")]
    mod needs_avx2 {
        use super::super::sum4_avx2;
        use crate::cpu::Level;

        #[test]
        fn sum4_avx2_gives_each_vectors_lane_sum() {
            crate::cpu::require(Level::Avx2);
            let (xs, want) = super::four_vectors::<8>();
            let mut got = [0f32; 4];
            // SAFETY: as in `needs_avx512`, for AVX2.
            unsafe {
                use std::arch::x86_64::*;
                let vs = xs.map(|x| _mm256_loadu_ps(x.as_ptr()));
                _mm_storeu_ps(got.as_mut_ptr(), sum4_avx2(vs));
            }
            assert_eq!(got, want);
        }
    }

    /// Attention over an F16 cache is attention over the same values widened to F32: the
    /// AVX-512 and AVX2 bodies load them with `vcvtph2ps`, the portable body converts each row first,
    /// and both then do the F32 arithmetic of the F32 cache, bit for bit.
    #[test]
    fn attention_over_f16_rows_is_attention_over_their_f32_values() {
        // One to four query heads per kv head: each register plan of the vector bodies.
        for (nh, nkv) in [(3, 3), (6, 3), (9, 3), (8, 2)] {
            let (hd, cap) = (64, 200);
            let wave = |i: usize, f: f32| (i as f32 * f).sin() * 2.0;
            let q: Vec<f32> = (0..nh * hd).map(|i| wave(i, 0.37)).collect();
            let k16: Vec<f16> = (0..nkv * cap * hd)
                .map(|i| f16::from_f32(wave(i, 0.11)))
                .collect();
            let v16: Vec<f16> = (0..nkv * cap * hd)
                .map(|i| f16::from_f32(wave(i, 0.23)))
                .collect();
            let widen = |x: &[f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let (k32, v32) = (widen(&k16), widen(&v16));
            let dims = (nh, nkv, cap, hd);
            for range in [0..1, 0..130, 64..200, 17..81] {
                let what = format!("{nh} heads on {nkv}, {range:?}");
                let (mut a, mut b, mut c) =
                    (Partial::default(), Partial::default(), Partial::default());
                a.attend(&q, (&k16[..], &v16[..]), dims, range.clone(), 0.125);
                b.attend(&q, (&k32[..], &v32[..]), dims, range.clone(), 0.125);
                c.attend_body(&q, (&k16[..], &v16[..]), dims, range.clone(), 0.125);
                let (mut ya, mut yb, mut yc) = (
                    vec![0f32; nh * hd],
                    vec![0f32; nh * hd],
                    vec![0f32; nh * hd],
                );
                merge(std::slice::from_ref(&a), nh, hd, &mut ya);
                merge(std::slice::from_ref(&b), nh, hd, &mut yb);
                merge(std::slice::from_ref(&c), nh, hd, &mut yc);
                assert_eq!(ya, yb, "{what}: dispatched body, F16 against F32 rows");
                // The portable body sums in another order than the AVX-512 and AVX2 ones.
                let diff = yc
                    .iter()
                    .zip(&yb)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(diff < 1e-5, "{what}: portable body differs by {diff}");
            }
        }
    }
}
