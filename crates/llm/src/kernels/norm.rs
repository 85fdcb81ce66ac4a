//! LayerNorm over each row (with an optional BF16 copy for the next BF16 layer), and the
//! 16-lane sums it and the softmax reduce with.

use super::bf16::to_bf16;
use super::{avx512_bf16, LANES};

/// LayerNorm of each `width`-long row of `input` into `out` (and, if given, its BF16 copy).
pub fn layer_norm(
    input: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
    out: &mut [f32],
    out_bf16: Option<&mut [u16]>,
) {
    #[cfg(target_arch = "x86_64")]
    if avx512_bf16() {
        // SAFETY: the CPU has the features the wrapper is compiled for.
        return unsafe { x86::layer_norm(input, gamma, beta, eps, out, out_bf16) };
    }
    layer_norm_body(input, gamma, beta, eps, out, out_bf16)
}

#[inline(always)]
pub(super) fn layer_norm_body(
    input: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
    out: &mut [f32],
    mut out_bf16: Option<&mut [u16]>,
) {
    let width = gamma.len();
    assert_eq!(input.len(), out.len());
    assert_eq!(input.len() % width, 0);
    for (r, (x, y)) in input
        .chunks_exact(width)
        .zip(out.chunks_exact_mut(width))
        .enumerate()
    {
        let mean = sum(x) / width as f32;
        for (y, x) in y.iter_mut().zip(x) {
            *y = x - mean;
        }
        let var = sum_squares(y) / width as f32;
        let scale = 1.0 / (var + eps).sqrt();
        for ((y, g), b) in y.iter_mut().zip(gamma).zip(beta) {
            *y = *y * scale * g + b;
        }
        if let Some(bf) = out_bf16.as_deref_mut() {
            for (d, s) in bf[r * width..(r + 1) * width].iter_mut().zip(y.iter()) {
                *d = to_bf16(*s);
            }
        }
    }
}

/// Sums in 16 lanes, so the loop vectorises without reassociation licence.
#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[inline(always)]
fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 build of the portable body. Each `unsafe fn` here may only be called once
    //! `avx512_bf16()` holds.

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub unsafe fn layer_norm(
        input: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        out: &mut [f32],
        out_bf16: Option<&mut [u16]>,
    ) {
        super::layer_norm_body(input, gamma, beta, eps, out, out_bf16)
    }
}
