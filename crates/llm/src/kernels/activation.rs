//! The element-wise functions of the forward: the exact-erf GELU of BERT's feed-forward (fused
//! into the matrix multiply's epilogue) and the exp it and the softmax use, as polynomials so
//! loops over them vectorise; scalar here, 16 lanes at a time in `x86`.

// Abramowitz & Stegun 7.1.26: erf(z) = 1 - (a1 t + … + a5 t⁵) e^(-z²), t = 1 / (1 + p z), for
// z ≥ 0, absolute error below 1.5e-7 — far under what BF16 rounding of the result adds.
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [
    0.254_829_6,
    -0.284_496_72,
    1.421_413_8,
    -1.453_152_1,
    1.061_405_4,
];

/// `x Φ(x) = x (1 + erf(x / √2)) / 2`, the GELU of BERT's `hidden_act = "gelu"`.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let u = x * std::f32::consts::FRAC_1_SQRT_2;
    let z = u.abs();
    let t = 1.0 / (1.0 + ERF_P * z);
    let poly = t * (ERF_A[0] + t * (ERF_A[1] + t * (ERF_A[2] + t * (ERF_A[3] + t * ERF_A[4]))));
    let erf = (1.0 - poly * exp(-z * z)).copysign(u);
    0.5 * x * (1.0 + erf)
}

const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `e^x` without a libm call (so loops over it vectorise): `2^n e^r` with `|r| ≤ ln2 / 2` and a
/// degree-6 Taylor polynomial, relative error about 2e-7; inputs below -87 give ~0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Ties to even, as the 16-lane version rounds: one instruction where SSE4.1 is enabled.
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r / 720.0)))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `out[i] = silu(gate[i]) · up[i]`, with `silu(x) = x / (1 + e^-x)`: a llama MLP's gated
/// activation.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512_bf16() {
            // SAFETY: the CPU has the features `x86::silu_mul` is compiled for.
            return unsafe { x86::silu_mul(gate, up, out) };
        }
        if super::avx2() {
            // SAFETY: as above, for `silu_mul_avx2`.
            return unsafe { silu_mul_avx2(gate, up, out) };
        }
    }
    silu_mul_body(gate, up, out)
}

/// `x = gelu(x)` for each element: the AMX kernel's epilogue, 16 lanes at a time where the CPU
/// has the AVX-512 kernels (every AMX CPU does).
pub(super) fn gelu_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx512_bf16() {
        // SAFETY: the CPU has the features `x86::gelu_in_place` is compiled for.
        return unsafe { x86::gelu_in_place(xs) };
    }
    for x in xs {
        *x = gelu(*x);
    }
}

/// `x = gelu(x)` for each element, the same bits as [`gelu`] element by element: the F32
/// GEMM's epilogue. Where the CPU has AVX2 the loop is compiled for it, so `exp`'s rounding is
/// one instruction and the loop vectorises; on baseline x86-64 it is a libm `rintf` call per
/// element (perf on an AVX2-only EPYC: 2.7% of a peer benchmark run, all of it in the
/// embedder's F32 forward).
pub(super) fn gelu_exact_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { gelu_exact_avx2(xs) };
    }
    gelu_exact_body(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_exact_avx2(xs: &mut [f32]) {
    gelu_exact_body(xs)
}

#[inline(always)]
fn gelu_exact_body(xs: &mut [f32]) {
    for x in xs {
        *x = gelu(*x);
    }
}

/// The portable loop compiled for AVX2, where `exp`'s rounding is one instruction and the
/// loop vectorises (on baseline x86-64 it is a libm call per element).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_body(gate, up, out)
}

#[inline(always)]
pub(super) fn silu_mul_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! The AVX-512 bodies, called from the other kernels' AVX-512 code, which is compiled with
    //! the same features.

    use std::arch::x86_64::*;
    #[cfg(test)]
    use std::mem::transmute;

    use super::{ERF_A, ERF_P, LN2_HI, LN2_LO};

    /// [`super::gelu`], 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(in crate::kernels) fn gelu_ps(x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        let u = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
        let z = _mm512_abs_ps(u);
        let t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(ERF_P), z, one));
        let mut poly = _mm512_set1_ps(ERF_A[4]);
        for a in ERF_A[..4].iter().rev() {
            poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(*a));
        }
        poly = _mm512_mul_ps(poly, t);
        let e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z)));
        let erf_abs = _mm512_fnmadd_ps(poly, e, one);
        let sign = _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(i32::MIN));
        let erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(erf_abs), sign));
        _mm512_mul_ps(
            _mm512_mul_ps(_mm512_set1_ps(0.5), x),
            _mm512_add_ps(one, erf),
        )
    }

    /// [`super::exp`], 16 lanes at a time (AVX-512 F alone: the decoder's attention, compiled
    /// without BF16, calls it too).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp_ps(x: __m512) -> __m512 {
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
            _mm512_set1_ps(88.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// [`super::gelu_in_place`], 16 lanes at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(in crate::kernels) unsafe fn gelu_in_place(xs: &mut [f32]) {
        let n = xs.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ len.
            unsafe {
                let p = xs.as_mut_ptr().add(i);
                _mm512_storeu_ps(p, gelu_ps(_mm512_loadu_ps(p)));
            }
        }
        for x in &mut xs[n..] {
            *x = super::gelu(*x);
        }
    }

    /// [`super::silu_mul`], 16 lanes at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(in crate::kernels) unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = gate.len() / 16 * 16;
        let one = _mm512_set1_ps(1.0);
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ every slice's length (the caller checked they are equal).
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                let e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
                let silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(silu, u));
            }
        }
        for ((o, &g), &u) in out[n..].iter_mut().zip(&gate[n..]).zip(&up[n..]) {
            *o = g / (1.0 + super::exp(-g)) * u;
        }
    }

    #[cfg(test)]
    pub fn gelu16(x: [f32; 16]) -> [f32; 16] {
        assert!(crate::kernels::avx512_bf16());
        // SAFETY: checked just above.
        unsafe { transmute(gelu_ps(transmute::<[f32; 16], __m512>(x))) }
    }
}
