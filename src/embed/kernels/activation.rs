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
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r / 720.0)))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
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
    pub(in crate::embed::kernels) fn gelu_ps(x: __m512) -> __m512 {
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

    /// [`super::exp`], 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(in crate::embed::kernels) fn exp_ps(x: __m512) -> __m512 {
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

    #[cfg(test)]
    pub fn gelu16(x: [f32; 16]) -> [f32; 16] {
        assert!(crate::embed::kernels::avx512_bf16());
        // SAFETY: checked just above.
        unsafe { transmute(gelu_ps(transmute::<[f32; 16], __m512>(x))) }
    }
}
