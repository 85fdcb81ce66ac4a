//! BF16: rounding f32 to BF16 (ties to even), the panel layout BF16 weights are packed into at
//! load, and the AVX-512 BF16 tile kernel (`vdpbf16ps`, F32 accumulation) that multiplies
//! rows against those panels.

use super::{avx512_bf16, PANEL};

/// `x` rounded to the nearest BF16 (ties to even), as its bits.
pub fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `dst[i] = to_bf16(src[i])`.
pub fn convert_to_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if avx512_bf16() {
        // SAFETY: the CPU has the features `x86::convert` is compiled for.
        return unsafe { x86::convert(src, dst) };
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = to_bf16(*s);
    }
}

/// `weight` (row-major `[n, k]`, `n` a multiple of [`PANEL`], `k` even) in the panel layout
/// of `Weights::Bf16`.
pub(super) fn pack_panels(weight: &[f32], n: usize, k: usize) -> Vec<u16> {
    let mut packed = vec![0u16; n * k];
    let pairs = k / 2;
    for (i, p) in packed.iter_mut().enumerate() {
        let e = i % 2;
        let c = (i / 2) % PANEL;
        let pair = (i / (2 * PANEL)) % pairs;
        let panel = i / (2 * PANEL * pairs);
        *p = to_bf16(weight[(panel * PANEL + c) * k + 2 * pair + e]);
    }
    packed
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! The AVX-512 BF16 bodies. Each `unsafe fn` here may only be called once `avx512_bf16()`
    //! holds.

    use std::arch::x86_64::*;
    use std::mem::transmute;
    use std::ops::Range;

    use crate::kernels::activation::x86::gelu_ps;
    use crate::kernels::{Epilogue, PANEL};

    /// Rows per register tile: 6 rows × 64 columns is 24 of the 32 zmm registers as
    /// accumulators, leaving room for the 4 weight vectors and the broadcast input pair.
    /// One thread runs the model's four shapes at 210-230 GFLOP/s on Zen 4 (27 or 960 rows),
    /// about one `vdpbf16ps` per cycle, so the tile is not what bounds the forward.
    const TILE_ROWS: usize = 6;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub unsafe fn convert(src: &[f32], dst: &mut [u16]) {
        let n = src.len() / 32 * 32;
        for i in (0..n).step_by(32) {
            // SAFETY: i + 32 ≤ len for both slices.
            unsafe {
                let lo = _mm512_loadu_ps(src.as_ptr().add(i));
                let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
                let packed: __m512i = transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), packed);
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = super::to_bf16(*s);
        }
    }

    /// See `Linear::forward_columns`; `packed` is the panel layout of `Weights::Bf16`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub unsafe fn gemm_bf16(
        a: &[u16],
        m: usize,
        k: usize,
        packed: &[u16],
        bias: &[f32],
        n: usize,
        out: *mut f32,
        cols: Range<usize>,
        epilogue: Epilogue<'_>,
    ) {
        let pairs = k / 2;
        for panel in cols.start / PANEL..cols.end / PANEL {
            let c0 = panel * PANEL;
            let w = &packed[panel * pairs * PANEL * 2..(panel + 1) * pairs * PANEL * 2];
            let bias = &bias[c0..c0 + PANEL];
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(TILE_ROWS);
                let a = &a[r * k..(r + rows) * k];
                // SAFETY: rows r..r+rows, columns c0..c0+64 of `out` are ours (caller's contract).
                let c = unsafe { out.add(r * n + c0) };
                let res = match epilogue {
                    Epilogue::Add(res) => Some(&res[r * n + c0..(r + rows - 1) * n + c0 + PANEL]),
                    _ => None,
                };
                let gelu = matches!(epilogue, Epilogue::Gelu);
                // SAFETY: as above; slices are bounds-checked to cover the tile.
                unsafe {
                    match rows {
                        6 => tile::<6>(a, k, w, bias, c, n, res, gelu),
                        5 => tile::<5>(a, k, w, bias, c, n, res, gelu),
                        4 => tile::<4>(a, k, w, bias, c, n, res, gelu),
                        3 => tile::<3>(a, k, w, bias, c, n, res, gelu),
                        2 => tile::<2>(a, k, w, bias, c, n, res, gelu),
                        _ => tile::<1>(a, k, w, bias, c, n, res, gelu),
                    }
                }
                r += rows;
            }
        }
    }

    /// `R` rows × one 64-column panel, over all of `k`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    unsafe fn tile<const R: usize>(
        a: &[u16],
        k: usize,
        w: &[u16],
        bias: &[f32],
        c: *mut f32,
        ldc: usize,
        residual: Option<&[f32]>,
        gelu: bool,
    ) {
        assert!(a.len() >= R * k && w.len() >= k * PANEL && bias.len() >= PANEL);
        let a = a.as_ptr();
        let w = w.as_ptr();
        // SAFETY (whole body): reads stay inside the slices asserted above; writes go to the
        // caller's tile.
        unsafe {
            let b = [0, 16, 32, 48].map(|j| _mm512_loadu_ps(bias.as_ptr().add(j)));
            let mut acc = [b; R];
            for pair in 0..k / 2 {
                let wp = w.add(pair * PANEL * 2);
                let wv: [__m512bh; 4] =
                    [0, 32, 64, 96].map(|j| transmute(_mm512_loadu_si512(wp.add(j).cast())));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = a.add(r * k + 2 * pair).cast::<i32>().read_unaligned();
                    let x: __m512bh = transmute(_mm512_set1_epi32(x));
                    for (acc, wv) in acc.iter_mut().zip(wv) {
                        *acc = _mm512_dpbf16_ps(*acc, x, wv);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (j, &v) in acc.iter().enumerate() {
                    let mut v = v;
                    if let Some(res) = residual {
                        v = _mm512_add_ps(v, _mm512_loadu_ps(res.as_ptr().add(r * ldc + 16 * j)));
                    }
                    if gelu {
                        v = gelu_ps(v);
                    }
                    _mm512_storeu_ps(c.add(r * ldc + 16 * j), v);
                }
            }
        }
    }
}
