//! Activation rows quantised to 8 bits per block of 32 (ggml's Q8_1 rounding), as every
//! quantised kernel reads them: the blocks-as-shipped kernel of [`super::matmul`] and the panel
//! kernel of [`super::panels`].

use super::{scale_stride, Isa, BLOCK};
use crate::kernels::Shared;

/// Below this many activation blocks (about 60 µs of rounding on one core), [`QActs::quantize`]
/// stays on the calling thread: a decode step's rows, not a prefill chunk's.
pub(super) const PARALLEL_QUANTIZE_BLOCKS: usize = 4096;

/// Activation rows quantised to 8 bits per block of 32; buffers are reused step after step.
#[derive(Default)]
pub struct QActs {
    pub(super) rows: usize,
    pub(super) cols: usize,
    q: Vec<i8>,
    /// Per block: the scale d_a (rows padded with zeros as the weights' scales).
    d: Vec<f32>,
    /// Per block: d_a · Σ q_a (for the Q4_1 minimums), laid out as `d`.
    s: Vec<f32>,
    /// Per block: Σ q_a (for the offset of the Q8_0 panels), laid out as `d`.
    sum: Vec<i32>,
}

impl QActs {
    /// Quantises the row-major `(rows, cols)` activations `x`: a prefill's many blocks over
    /// candle's thread pool, a decode step's few on the calling thread.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        assert_eq!(x.len(), rows * cols);
        assert!(cols.is_multiple_of(BLOCK));
        self.rows = rows;
        self.cols = cols;
        let (nb, stride) = (cols / BLOCK, scale_stride(cols));
        self.q.resize(rows * cols, 0);
        self.d.clear();
        self.d.resize(rows * stride, 0.0);
        self.s.clear();
        self.s.resize(rows * stride, 0.0);
        self.sum.clear();
        self.sum.resize(rows * stride, 0);
        let blocks = rows * nb;
        let (q, d, s, sum) = (
            Shared::new(&mut self.q),
            Shared::new(&mut self.d),
            Shared::new(&mut self.s),
            Shared::new(&mut self.sum),
        );
        let quantize = |blocks: std::ops::Range<usize>| {
            for j in blocks {
                let i = j / nb * stride + j % nb;
                // SAFETY: block j's values and scales are written by this call alone.
                unsafe {
                    let q = q.part(j * BLOCK..(j + 1) * BLOCK);
                    let x = &x[j * BLOCK..(j + 1) * BLOCK];
                    let (dj, sumj) = quantize_block(x, q.try_into().expect("a block"));
                    d.part(i..i + 1)[0] = dj;
                    s.part(i..i + 1)[0] = dj * sumj as f32;
                    sum.part(i..i + 1)[0] = sumj;
                }
            }
        };
        if blocks < PARALLEL_QUANTIZE_BLOCKS {
            quantize(0..blocks);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(blocks, quantize);
        }
    }

    pub(super) fn row(&self, r: usize) -> ActRow<'_> {
        let stride = scale_stride(self.cols);
        ActRow {
            q: &self.q[r * self.cols..(r + 1) * self.cols],
            d: &self.d[r * stride..(r + 1) * stride],
            s: &self.s[r * stride..(r + 1) * stride],
            sum: &self.sum[r * stride..(r + 1) * stride],
        }
    }
}

/// One block: ggml's Q8_1 rounding (d = max|x| / 127, q = round(x / d), halves away from
/// zero); returns d and Σq. On x86 with AVX2 it runs in vector instructions, the same
/// results bit for bit (the portable loop is a libm `round` and a saturating cast per value:
/// ~0.3 ms per decode step, and 8% of a 588-token prefill on the int8 GEMM).
pub(super) fn quantize_block(x: &[f32], q: &mut [i8; BLOCK]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() != Isa::Portable {
        // SAFETY: `Isa::detect` saw avx2 and fma on this CPU.
        return unsafe { quantize_block_avx2(x.try_into().expect("a block"), q) };
    }
    quantize_block_body(x, q)
}

/// [`quantize_block_body`] in eight-lane registers: round half away from zero as truncation
/// plus a step away from zero where the dropped fraction is at least one half (exact for
/// |y| < 2²³, and here |y| ≤ 127).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_block_avx2(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    use std::arch::x86_64::*;
    // SAFETY: every load and store is within the two 32-element arrays.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
        let abs = |v: __m256| _mm256_andnot_ps(sign, v);
        let m = _mm256_max_ps(
            _mm256_max_ps(abs(v[0]), abs(v[1])),
            _mm256_max_ps(abs(v[2]), abs(v[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let ints: [__m256i; 4] = std::array::from_fn(|i| {
            let y = _mm256_mul_ps(v[i], id);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let away = _mm256_cmp_ps::<_CMP_GE_OQ>(abs(_mm256_sub_ps(y, t)), half);
            let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(y, sign), one));
            _mm256_cvttps_epi32(_mm256_add_ps(t, step))
        });
        let total = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let t = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256(total, 1),
        );
        let t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b01_00_11_10));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b10_11_00_01));
        let sum = _mm_cvtsi128_si32(t);
        // Packing narrows within each 128-bit half; the permute puts the four-value groups
        // back in order.
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
        (d, sum)
    }
}

#[inline(always)]
pub(super) fn quantize_block_body(x: &[f32], q: &mut [i8; BLOCK]) -> (f32, i32) {
    let x: &[f32; BLOCK] = x.try_into().expect("a block");
    let amax = x.iter().fold(0f32, |a, x| a.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &x) in q.iter_mut().zip(x) {
        *q = (x * id).round() as i8;
        sum += *q as i32;
    }
    (d, sum)
}

#[derive(Clone, Copy)]
pub(super) struct ActRow<'a> {
    pub(super) q: &'a [i8],
    pub(super) d: &'a [f32],
    pub(super) s: &'a [f32],
    pub(super) sum: &'a [i32],
}
