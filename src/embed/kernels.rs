//! Compute kernels for the CPU BERT forward ([`super::cpu_bert`]): a matrix multiply against
//! weights packed once at load, in BF16 on AVX-512 BF16 (`vdpbf16ps`, F32 accumulation) or in
//! F32 through the `gemm` crate anywhere else, and the row-wise pieces around it (LayerNorm,
//! exact-erf GELU, attention with softmax). The x86 paths are chosen at run time, so one binary
//! runs on any x86-64 or aarch64 CPU.

use std::ops::Range;

/// Output columns per packed weight panel; a thread's share of a matrix multiply is whole panels.
pub const PANEL: usize = 64;

/// What the linear layers multiply in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Weights and activations rounded to BF16, products accumulated in F32 (AVX-512 BF16 only).
    Bf16,
    /// F32 throughout, on any CPU.
    F32,
}

impl Precision {
    /// BF16 where the CPU has AVX-512 BF16 (twice the multiply rate of F32 FMA on Zen 4), else F32.
    pub fn best() -> Precision {
        if avx512_bf16() {
            Precision::Bf16
        } else {
            Precision::F32
        }
    }
}

/// Whether the AVX-512 paths (BF16 dot products and the vectorised row kernels) can run here.
pub fn avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512dq")
            && std::is_x86_feature_detected!("avx512bf16")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

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

/// The input rows of a matrix multiply, in the precision of the layer's weights.
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

/// Applied to each output element after the bias.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    None,
    /// `gelu(x)` with the exact erf form BERT was trained with.
    Gelu,
    /// `x + residual[same row, same column]` (same shape as the output).
    Add(&'a [f32]),
}

/// A linear layer `y = x Wᵀ + b` with `W` of shape `[n, k]` (PyTorch's layout), its weights
/// prepared once for the kernel that will run it.
pub struct Linear {
    n: usize,
    k: usize,
    bias: Vec<f32>,
    weights: Weights,
}

enum Weights {
    /// Panels of [`PANEL`] output columns; in a panel, for each pair of inputs `2i, 2i+1`, the
    /// panel's columns in order, each as the BF16 pair `(W[c][2i], W[c][2i+1])`: one 64-byte
    /// load feeds `vdpbf16ps` for 16 columns.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Bf16(Vec<u16>),
    /// `W` as it came, row-major `[n, k]`.
    F32(Vec<f32>),
}

impl Linear {
    /// `weight` is row-major `[n, k]`. BF16 needs AVX-512 BF16, `n` a multiple of [`PANEL`] and
    /// `k` even (true of every BERT layer); otherwise the layer is F32.
    pub fn new(weight: &[f32], bias: &[f32], n: usize, k: usize, precision: Precision) -> Linear {
        assert_eq!(weight.len(), n * k, "weight is not [{n}, {k}]");
        assert_eq!(bias.len(), n, "bias is not [{n}]");
        let bf16 = precision == Precision::Bf16
            && avx512_bf16()
            && n.is_multiple_of(PANEL)
            && k.is_multiple_of(2);
        let weights = if bf16 {
            let mut packed = vec![0u16; n * k];
            let pairs = k / 2;
            for (i, p) in packed.iter_mut().enumerate() {
                let e = i % 2;
                let c = (i / 2) % PANEL;
                let pair = (i / (2 * PANEL)) % pairs;
                let panel = i / (2 * PANEL * pairs);
                *p = to_bf16(weight[(panel * PANEL + c) * k + 2 * pair + e]);
            }
            Weights::Bf16(packed)
        } else {
            Weights::F32(weight.to_vec())
        };
        Linear {
            n,
            k,
            bias: bias.to_vec(),
            weights,
        }
    }

    pub fn precision(&self) -> Precision {
        match self.weights {
            Weights::Bf16(_) => Precision::Bf16,
            Weights::F32(_) => Precision::F32,
        }
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    /// `out[r][c] = epilogue(Σ_i rows[r][i] W[c][i] + b[c])` for the `m` rows of `rows` and the
    /// columns `c` in `cols` (whole panels, as [`column_share`] gives), `out` being `[m, n]`.
    /// `rows` must be in this layer's [`Self::precision`].
    ///
    /// # Safety
    /// `out` points to `m * n` writable f32, and while this runs nothing else reads or writes
    /// columns `cols` of it (other threads may write other columns).
    pub unsafe fn forward_columns(
        &self,
        rows: Rows<'_>,
        m: usize,
        out: *mut f32,
        cols: Range<usize>,
        epilogue: Epilogue<'_>,
    ) {
        let (n, k) = (self.n, self.k);
        assert!(cols.end <= n && cols.start <= cols.end);
        if let Epilogue::Add(residual) = epilogue {
            assert_eq!(residual.len(), m * n);
        }
        if m == 0 || cols.is_empty() {
            return;
        }
        match (&self.weights, rows) {
            #[cfg(target_arch = "x86_64")]
            (Weights::Bf16(packed), Rows::Bf16(a)) => {
                assert_eq!(a.len(), m * k);
                assert!(cols.start.is_multiple_of(PANEL) && cols.end.is_multiple_of(PANEL));
                // `new` packs BF16 only where the CPU has it; the check is one atomic load.
                assert!(avx512_bf16(), "BF16 weights on a CPU without AVX-512 BF16");
                // SAFETY: the features are there; `out` is the caller's contract.
                unsafe { x86::gemm_bf16(a, m, k, packed, &self.bias, n, out, cols, epilogue) }
            }
            (Weights::F32(w), Rows::F32(a)) => {
                assert_eq!(a.len(), m * k);
                unsafe { gemm_f32(a, m, k, w, &self.bias, n, out, cols, epilogue) }
            }
            _ => panic!("input rows are not in the layer's precision"),
        }
    }
}

/// Part `part` of `parts` of the `n` output columns, in whole panels.
pub fn column_share(n: usize, part: usize, parts: usize) -> Range<usize> {
    let panels = n.div_ceil(PANEL);
    let start = panels * part / parts * PANEL;
    let end = panels * (part + 1) / parts * PANEL;
    start.min(n)..end.min(n)
}

/// The portable path: the `gemm` crate on this thread, then bias and epilogue.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_f32(
    a: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    bias: &[f32],
    n: usize,
    out: *mut f32,
    cols: Range<usize>,
    epilogue: Epilogue<'_>,
) {
    let width = cols.len();
    for r in 0..m {
        // SAFETY: row r, columns `cols` of `out` are ours (the caller's contract).
        let row = unsafe { std::slice::from_raw_parts_mut(out.add(r * n + cols.start), width) };
        row.copy_from_slice(&bias[cols.clone()]);
        if let Epilogue::Add(residual) = epilogue {
            for (y, x) in row.iter_mut().zip(&residual[r * n + cols.start..]) {
                *y += x;
            }
        }
    }
    // SAFETY: dst is [m, width] at row stride n inside `out`; lhs is [m, k] row-major; rhs is
    // [k, width] read from W's rows `cols` (element (i, c) at c * k + i).
    unsafe {
        gemm::gemm(
            m,
            width,
            k,
            out.add(cols.start),
            1,
            n as isize,
            true,
            a.as_ptr(),
            1,
            k as isize,
            w.as_ptr().add(cols.start * k),
            k as isize,
            1,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    if let Epilogue::Gelu = epilogue {
        for r in 0..m {
            // SAFETY: as above.
            let row = unsafe { std::slice::from_raw_parts_mut(out.add(r * n + cols.start), width) };
            for y in row {
                *y = gelu(*y);
            }
        }
    }
}

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
fn layer_norm_body(
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

/// One AVX-512 register of f32.
const LANES: usize = 16;

/// Sums in 16 lanes, so the loop vectorises without reassociation licence.
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
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
fn attention_head_body(
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
    use std::mem::transmute;
    use std::ops::Range;

    use super::{Epilogue, ERF_A, ERF_P, LN2_HI, LN2_LO, PANEL};

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

    /// [`super::gelu`], 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    fn gelu_ps(x: __m512) -> __m512 {
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
    fn exp_ps(x: __m512) -> __m512 {
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
        assert!(super::avx512_bf16());
        // SAFETY: checked just above.
        unsafe { transmute(gelu_ps(transmute::<[f32; 16], __m512>(x))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn naive(a: &[f32], w: &[f32], bias: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            for c in 0..n {
                out[r * n + c] = f64::from(bias[c])
                    + (0..k)
                        .map(|i| f64::from(a[r * k + i]) * f64::from(w[c * k + i]))
                        .sum::<f64>();
            }
        }
        out
    }

    fn gelu_f64(x: f64) -> f64 {
        // Beyond 5.5, x Φ(x) is within 1e-7 of max(x, 0); below, erf by its Taylor series,
        // which f64 sums with ~1e-10 to spare.
        if x.abs() > 5.5 {
            return x.max(0.0);
        }
        let z = x / std::f64::consts::SQRT_2;
        let mut term = z;
        let mut erf = z;
        for n in 1..200 {
            term *= -z * z / n as f64;
            erf += term / (2 * n + 1) as f64;
        }
        0.5 * x * (1.0 + erf * 2.0 / std::f64::consts::PI.sqrt())
    }

    /// Runs `layer` over `a` in `parts` column shares, as the forward's threads do.
    fn run(layer: &Linear, a: &[f32], m: usize, epilogue: Epilogue<'_>, parts: usize) -> Vec<f32> {
        let n = layer.out_features();
        let mut out = vec![f32::NAN; m * n];
        let bf;
        let rows = match layer.precision() {
            Precision::Bf16 => {
                bf = a.iter().map(|&x| to_bf16(x)).collect::<Vec<_>>();
                Rows::Bf16(&bf)
            }
            Precision::F32 => Rows::F32(a),
        };
        for part in 0..parts {
            let cols = column_share(n, part, parts);
            // SAFETY: out is [m, n] and only this call touches it.
            unsafe { layer.forward_columns(rows, m, out.as_mut_ptr(), cols, epilogue) };
        }
        out
    }

    fn check_linear(precision: Precision, m: usize, n: usize, k: usize) {
        let a = values(m * k, 1);
        let w = values(n * k, 2);
        let bias = values(n, 3);
        let layer = Linear::new(&w, &bias, n, k, precision);
        assert_eq!(layer.precision(), precision);
        let residual = values(m * n, 4);
        // The exact answer for the operands the kernel sees: BF16-rounded in BF16 mode.
        let round = |v: &[f32]| -> Vec<f32> {
            match precision {
                Precision::Bf16 => v.iter().map(|&x| from_bf16(to_bf16(x))).collect(),
                Precision::F32 => v.to_vec(),
            }
        };
        let want = naive(&round(&a), &round(&w), &bias, m, n, k);
        let tol = 1e-5 * k as f64;
        for parts in [1, 2, 3] {
            let plain = run(&layer, &a, m, Epilogue::None, parts);
            let added = run(&layer, &a, m, Epilogue::Add(&residual), parts);
            let gelu = run(&layer, &a, m, Epilogue::Gelu, parts);
            for i in 0..m * n {
                let (r, c) = (i / n, i % n);
                let at = format!("{precision:?} m={m} n={n} k={k} parts={parts} [{r},{c}]");
                assert!(
                    (f64::from(plain[i]) - want[i]).abs() < tol,
                    "{at}: {} vs {}",
                    plain[i],
                    want[i]
                );
                let sum = want[i] + f64::from(residual[i]);
                assert!(
                    (f64::from(added[i]) - sum).abs() < tol,
                    "{at}: {} vs {sum}",
                    added[i]
                );
                let g = gelu_f64(want[i]);
                assert!(
                    (f64::from(gelu[i]) - g).abs() < tol,
                    "{at}: {} vs {g}",
                    gelu[i]
                );
            }
        }
    }

    #[test]
    fn f32_linear_matches_a_naive_product() {
        for (m, n, k) in [(1, 64, 2), (7, 128, 30), (13, 192, 384), (3, 100, 17)] {
            check_linear(Precision::F32, m, n, k);
        }
    }

    #[test]
    fn bf16_linear_matches_a_naive_product_of_the_rounded_operands() {
        if !avx512_bf16() {
            eprintln!("skipping: this CPU has no AVX-512 BF16");
            return;
        }
        // Every tile height (1..=6 rows and a tail), one and several panels, short and long k.
        for (m, n, k) in [
            (1, 64, 2),
            (5, 128, 30),
            (6, 64, 384),
            (13, 192, 384),
            (27, 384, 1536),
        ] {
            check_linear(Precision::Bf16, m, n, k);
        }
    }

    #[test]
    fn bf16_needs_whole_panels_and_even_k_else_stays_f32() {
        let w = values(100 * 3, 5);
        let b = values(100, 6);
        assert_eq!(
            Linear::new(&w, &b, 100, 3, Precision::Bf16).precision(),
            Precision::F32
        );
    }

    #[test]
    fn column_shares_cover_the_columns_once_in_whole_panels() {
        for (n, parts) in [(384, 2), (1152, 2), (1536, 3), (100, 2), (64, 2)] {
            let mut next = 0;
            for part in 0..parts {
                let share = column_share(n, part, parts);
                assert_eq!(share.start, next, "n={n} parts={parts}");
                assert!(share.start.is_multiple_of(PANEL));
                next = share.end;
            }
            assert_eq!(next, n);
        }
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even_and_the_vector_path_agrees() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        let src = values(100, 7);
        let mut dst = vec![0u16; 100];
        convert_to_bf16(&src, &mut dst);
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(*d, to_bf16(*s), "{s}");
        }
    }

    #[test]
    fn exp_and_gelu_are_accurate() {
        for i in -800..=800 {
            let x = i as f32 / 10.0;
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            assert!(
                (got - want).abs() <= 5e-7 * want + 1e-37,
                "exp({x}) = {got}, want {want}"
            );
        }
        for i in -600..=600 {
            let x = i as f32 / 100.0;
            let want = gelu_f64(f64::from(x));
            assert!(
                (f64::from(gelu(x)) - want).abs() < 3e-7 * (1.0 + x.abs() as f64),
                "gelu({x})"
            );
            #[cfg(target_arch = "x86_64")]
            if avx512_bf16() {
                let v = x86::gelu16([x; 16]);
                assert!(
                    (f64::from(v[3]) - want).abs() < 3e-7 * (1.0 + x.abs() as f64),
                    "gelu16({x})"
                );
            }
        }
    }

    #[test]
    fn layer_norm_matches_the_definition() {
        let width = 384;
        let x = values(3 * width, 8);
        let gamma = values(width, 9);
        let beta = values(width, 10);
        let mut out = vec![0f32; x.len()];
        let mut bf = vec![0u16; x.len()];
        let mut portable = vec![0f32; x.len()];
        layer_norm_body(&x, &gamma, &beta, 1e-12, &mut portable, None);
        layer_norm(&x, &gamma, &beta, 1e-12, &mut out, Some(&mut bf));
        for (a, b) in out.iter().zip(&portable) {
            assert!((a - b).abs() < 1e-6, "{a} vs the portable {b}");
        }
        for r in 0..3 {
            let row: Vec<f64> = x[r * width..(r + 1) * width]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let mean = row.iter().sum::<f64>() / width as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
            for c in 0..width {
                let want = (row[c] - mean) / (var + 1e-12).sqrt() * f64::from(gamma[c])
                    + f64::from(beta[c]);
                let got = out[r * width + c];
                assert!(
                    (f64::from(got) - want).abs() < 1e-5,
                    "[{r},{c}] {got} vs {want}"
                );
                assert_eq!(bf[r * width + c], to_bf16(got));
            }
        }
    }

    #[test]
    fn attention_head_matches_the_definition() {
        // Shorter and longer than a register of keys, a whole one, and a head width with no
        // vector path (24); the dispatched kernel and, where that is AVX-512, the portable body.
        for (len, d) in [(9, 32), (37, 32), (16, 64), (1, 16), (5, 24)] {
            check_attention(len, d, attention_head);
            check_attention(len, d, attention_head_body);
        }
    }

    type Attention =
        fn(&[f32], usize, usize, (usize, usize, usize), f32, &mut [f32], &mut Vec<f32>);

    fn check_attention(len: usize, d: usize, attention: Attention) {
        let heads = 3;
        let ld = 3 * heads * d;
        let qkv = values(len * ld, 11)
            .iter()
            .map(|v| v * 4.0)
            .collect::<Vec<_>>();
        let scale = 1.0 / (d as f32).sqrt();
        let mut scratch = Vec::new();
        for h in 0..heads {
            let cols = (h * d, heads * d + h * d, 2 * heads * d + h * d);
            let mut out = vec![0f32; len * d];
            attention(&qkv, ld, len, cols, scale, &mut out, &mut scratch);
            for i in 0..len {
                let s: Vec<f64> = (0..len)
                    .map(|j| {
                        (0..d)
                            .map(|e| {
                                f64::from(qkv[i * ld + cols.0 + e])
                                    * f64::from(qkv[j * ld + cols.1 + e])
                            })
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::MIN, f64::max);
                let total: f64 = s.iter().map(|x| (x - max).exp()).sum();
                for e in 0..d {
                    let want: f64 = (0..len)
                        .map(|j| (s[j] - max).exp() / total * f64::from(qkv[j * ld + cols.2 + e]))
                        .sum();
                    let got = out[i * d + e];
                    assert!(
                        (f64::from(got) - want).abs() < 1e-5,
                        "len {len} d {d} head {h} [{i},{e}] {got} vs {want}"
                    );
                }
            }
        }
    }
}
