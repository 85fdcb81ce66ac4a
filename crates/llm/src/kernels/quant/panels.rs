//! The file's own blocks repacked in column panels, multiplied against activation rows quantised
//! to 8 bits per block of 32 ([`super::QActs`], ggml's Q8_1 rounding). Q4_1 runs on AVX2 (with
//! AVX-512 VNNI where it runs): decode (one row per sequence, a few more when a step verifies
//! drafts) on every CPU with AVX2, and prefill (hundreds of rows) on CPUs with AVX2 but not
//! AVX-512 BF16, where the two compute the same sums from one copy of the weights, 0.625 bytes
//! per weight as shipped. Q8_0 (the output head, which is also the token embedding) runs on
//! AVX-512 VNNI only.
//!
//! The weights are repacked once at load into groups of eight output columns. In a group, one
//! Q4_1 block (32 inputs) is four 32-byte vectors; vector j holds, for each of the eight
//! columns, bytes 4j..4j + 4 of that column's block as shipped: the nibbles of inputs
//! 4j..4j + 4 (low) and 16 + 4j..16 + 4j + 4 (high). Masked and shifted, a vector is four
//! consecutive inputs of eight columns; an activation row's matching four bytes, broadcast,
//! meet all eight in one `vpmaddubsw` (unsigned weights × signed activations). A block's 16
//! products per lane stay in 16 bits (|Σ| ≤ 8 · 2 · 15 · 127 = 30480 < 2¹⁵), so a block costs
//! eight multiplies, then one widening, one conversion and two scaled adds per eight outputs:
//! w = d·q + m gives Σ w·a = d·d_a·Σ q·q_a + m·(d_a·Σ q_a). The blocks-as-shipped kernel
//! ([`super::matmul`]) holds a block per register and spends the widening and conversion on
//! every single output: on AVX2 it is compute-bound even for one row, and each further row
//! costs nearly as much again. With AVX-512 VNNI, `vpdpbusd` adds each vector's products
//! straight into 32-bit sums: half the integer instructions for the same sums, so the same
//! bits.
//!
//! A Q8_0 block is eight vectors, vector j holding inputs 4j..4j + 4 of the eight columns as
//! q + 128 (0..=255, so the bytes are unsigned as `vpdpbusd` wants them). The integer sum is
//! then Σ (q + 128)·q_a = Σ q·q_a + 128·Σ q_a, and the kernel takes off 128·Σ q_a (each
//! activation block keeps its integer sum) before converting: the exact Σ q·q_a, as the blocks
//! kernel computes it. Taking the offset off in floats instead would subtract two terms each
//! about 128 times the result and lose some 7 bits of it. On AVX2, `vpmaddubsw`'s 16-bit pairs
//! overflow at 255 · 127 · 2, so there Q8_0 stays on the blocks kernel.
//!
//! Each output sums its blocks in one fixed order, whatever the number of rows or the tile a
//! row falls in, so a prompt's rows come out the same however it is chunked, and a decode row's
//! logits do not depend on the rows verified or batched beside it.

use std::arch::x86_64::*;

use half::f16;

use super::{ActRow, BlockFormat, Isa, QActs, QMatrix, BLOCK};
use crate::kernels::Shared;

/// Output columns per packed group: one 256-bit register of i32 or f32.
const GROUP: usize = 8;
/// Activation rows per register tile; each group's unpacked weights serve them all.
const TILE_ROWS: usize = 4;
/// Rows per work item: a multiple of [`TILE_ROWS`].
const ROW_BLOCK: usize = 64;
/// Groups per work item (64 columns): their Q4_1 weights (k = 1536: 72 KiB) stay in L2 while
/// the item's rows pass over them, each row tile's activations in L1.
const ITEM_GROUPS: usize = 8;

/// A weight matrix `(n, k)` (n output columns, each a row of the GGUF matrix) in the group
/// layout above.
pub struct Panels {
    format: BlockFormat,
    n: usize,
    k: usize,
    /// Group after group, block after block, [`Panels::group_block_bytes`] each.
    quants: Vec<u8>,
    /// Per group and block: the eight columns' scales d, then (Q4_1) their minimums m, f16
    /// bits as shipped; zero for the columns past `n` in the last group.
    scales: Vec<u16>,
}

impl Panels {
    /// Whether the panel kernel multiplies `format` on `isa`: Q4_1 wherever AVX2 runs, Q8_0
    /// with AVX-512 VNNI.
    pub fn runs(format: BlockFormat, isa: Isa) -> bool {
        match format {
            BlockFormat::Q4_1 => isa != Isa::Portable,
            BlockFormat::Q8_0 => isa == Isa::Avx512Vnni,
        }
    }

    /// The layout above, from the blocks as shipped.
    pub fn pack(w: &QMatrix) -> Panels {
        let (n, k, format) = (w.rows, w.cols, w.format);
        let (nb, groups) = (k / BLOCK, n.div_ceil(GROUP));
        let (block_bytes, scales_per) = (
            Self::group_block_bytes(format),
            Self::scales_per_block(format),
        );
        let qb = format.quant_bytes();
        let mut quants = vec![0u8; groups * nb * block_bytes];
        let mut scales = vec![0u16; groups * nb * scales_per];
        for c in 0..n {
            let row = w.row(c);
            let (g, i) = (c / GROUP, c % GROUP);
            for b in 0..nb {
                let src = &row.quants[b * qb..(b + 1) * qb];
                let dst = &mut quants[(g * nb + b) * block_bytes..][..block_bytes];
                for j in 0..qb / 4 {
                    let lane = &mut dst[j * 32 + 4 * i..][..4];
                    lane.copy_from_slice(&src[4 * j..4 * j + 4]);
                    if format == BlockFormat::Q8_0 {
                        // q + 128 as an unsigned byte.
                        lane.iter_mut().for_each(|q| *q ^= 0x80);
                    }
                }
                let s = &mut scales[(g * nb + b) * scales_per..][..scales_per];
                s[i] = row.d[b];
                if format == BlockFormat::Q4_1 {
                    s[GROUP + i] = row.m[b];
                }
            }
        }
        Panels {
            format,
            n,
            k,
            quants,
            scales,
        }
    }

    /// Bytes of one group's block of quants: four vectors of nibbles (Q4_1) or eight of bytes.
    fn group_block_bytes(format: BlockFormat) -> usize {
        GROUP * format.quant_bytes()
    }

    /// Scales per group and block: d (and m for Q4_1) for each column.
    fn scales_per_block(format: BlockFormat) -> usize {
        match format {
            BlockFormat::Q4_1 => 2 * GROUP,
            BlockFormat::Q8_0 => GROUP,
        }
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Bytes held: quants and scales, as many as the blocks as shipped.
    pub fn size_in_bytes(&self) -> usize {
        self.quants.len() + 2 * self.scales.len()
    }

    /// Column `c` (row `c` of the GGUF matrix) in f32, as [`QMatrix::dequantize_row`] gives it:
    /// the token embedding's lookup, where the head is the embedding.
    pub fn dequantize_row(&self, c: usize, out: &mut [f32]) {
        assert!(c < self.n, "row {c} of {}", self.n);
        let (nb, (g, i)) = (self.k / BLOCK, (c / GROUP, c % GROUP));
        let (block_bytes, scales_per) = (
            Self::group_block_bytes(self.format),
            Self::scales_per_block(self.format),
        );
        for (b, o) in out[..self.k].chunks_exact_mut(BLOCK).enumerate() {
            let q = &self.quants[(g * nb + b) * block_bytes..][..block_bytes];
            let s = &self.scales[(g * nb + b) * scales_per..][..scales_per];
            let d = f16::from_bits(s[i]).to_f32();
            // Byte t of vector j, lane i.
            let byte = |j: usize, t: usize| q[j * 32 + 4 * i + t];
            match self.format {
                BlockFormat::Q4_1 => {
                    let m = f16::from_bits(s[GROUP + i]).to_f32();
                    for at in 0..BLOCK / 2 {
                        let byte = byte(at / 4, at % 4);
                        o[at] = d * (byte & 0x0f) as f32 + m;
                        o[at + BLOCK / 2] = d * (byte >> 4) as f32 + m;
                    }
                }
                BlockFormat::Q8_0 => {
                    for (at, o) in o.iter_mut().enumerate() {
                        *o = d * (byte(at / 4, at % 4) ^ 0x80) as i8 as f32;
                    }
                }
            }
        }
    }

    /// `out = x Wᵀ (+ residual)` for the `m` rows of `x` `(m, k)`; `out` and `residual` are
    /// `(m, n)`. The rows are quantised into a buffer the calling thread keeps, then multiplied
    /// by [`Panels::matmul`].
    pub fn forward_rows(&self, x: &[f32], m: usize, out: &mut [f32], residual: Option<&[f32]>) {
        assert_eq!(x.len(), m * self.k, "input rows");
        ACTS.with(|acts| {
            let mut acts = acts.borrow_mut();
            acts.quantize(x, m, self.k);
            self.matmul(&acts, out, residual);
        });
    }

    /// `out = x Wᵀ (+ residual)` for the quantised rows `x`; `out` and `residual` are
    /// `(x.rows, n)`. Work items of (64 columns, 64 rows) go over candle's thread pool. Needs
    /// the CPU [`Panels::runs`] names for the format.
    pub fn matmul(&self, x: &QActs, out: &mut [f32], residual: Option<&[f32]>) {
        self.matmul_with(Isa::detect(), x, out, residual)
    }

    /// [`Panels::matmul`] on the byte dot products of `isa`: `vpdpbusd` with AVX-512 VNNI,
    /// else AVX2's `vpmaddubsw` (Q4_1 only; the same integer sums, so the same bits).
    pub fn matmul_with(&self, isa: Isa, x: &QActs, out: &mut [f32], residual: Option<&[f32]>) {
        let (n, m) = (self.n, x.rows);
        assert_eq!(x.cols, self.k, "inner dimensions differ");
        assert_eq!(out.len(), m * n, "output rows");
        assert!(residual.is_none_or(|r| r.len() == m * n), "residual rows");
        assert!(
            Self::runs(self.format, isa) && isa.runs_here(),
            "the {:?} panel kernel does not run on {} here (the CPU runs {})",
            self.format,
            isa.name(),
            Isa::detect().name()
        );
        let vnni = isa == Isa::Avx512Vnni;
        let (groups, row_blocks) = (n.div_ceil(GROUP), m.div_ceil(ROW_BLOCK));
        let items = groups.div_ceil(ITEM_GROUPS) * row_blocks;
        let q4 = self.format == BlockFormat::Q4_1;
        let dst = Shared::new(out);
        let item = |i: usize| {
            let (g0, r0) = (i / row_blocks * ITEM_GROUPS, i % row_blocks * ROW_BLOCK);
            let (g1, r1) = ((g0 + ITEM_GROUPS).min(groups), (r0 + ROW_BLOCK).min(m));
            let (rows, groups) = ((r0, r1), (g0, g1));
            // SAFETY: the CPU has AVX2, FMA and F16C, and VNNI where it is asked for (asserted
            // above; Q8_0 runs only there); the item writes only rows r0..r1 × columns of
            // groups g0..g1 of `out`, which no other item touches.
            unsafe {
                match (vnni, q4) {
                    (true, true) => self.item_vnni::<true>(x, rows, groups, dst.ptr(), residual),
                    (true, false) => self.item_vnni::<false>(x, rows, groups, dst.ptr(), residual),
                    (false, _) => self.item_avx2(x, rows, groups, dst.ptr(), residual),
                }
            }
        };
        if items == 1 {
            item(0);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(items, |items| items.for_each(item));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn item_avx2(
        &self,
        acts: &QActs,
        rows: (usize, usize),
        groups: (usize, usize),
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        // SAFETY: as the caller's.
        unsafe { self.item::<false, true>(acts, rows, groups, out, residual) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn item_vnni<const Q4: bool>(
        &self,
        acts: &QActs,
        rows: (usize, usize),
        groups: (usize, usize),
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        // SAFETY: as the caller's.
        unsafe { self.item::<true, Q4>(acts, rows, groups, out, residual) }
    }

    /// Rows `r0..r1` × groups `g0..g1`, row tile by row tile.
    #[inline(always)]
    unsafe fn item<const VNNI: bool, const Q4: bool>(
        &self,
        acts: &QActs,
        (r0, r1): (usize, usize),
        (g0, g1): (usize, usize),
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        let mut r = r0;
        while r < r1 {
            let rows = TILE_ROWS.min(r1 - r);
            // SAFETY (each arm): as the caller's.
            unsafe {
                match rows {
                    4 => self.row_tile::<VNNI, Q4, 4>(acts, r, (g0, g1), out, residual),
                    3 => self.row_tile::<VNNI, Q4, 3>(acts, r, (g0, g1), out, residual),
                    2 => self.row_tile::<VNNI, Q4, 2>(acts, r, (g0, g1), out, residual),
                    _ => self.row_tile::<VNNI, Q4, 1>(acts, r, (g0, g1), out, residual),
                }
            }
            r += rows;
        }
    }

    /// Rows `r..r + R` × groups `g0..g1`.
    #[inline(always)]
    unsafe fn row_tile<const VNNI: bool, const Q4: bool, const R: usize>(
        &self,
        acts: &QActs,
        r: usize,
        (g0, g1): (usize, usize),
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        let nb = self.k / BLOCK;
        assert!(r + R <= acts.rows);
        let rows: [ActRow<'_>; R] = std::array::from_fn(|i| acts.row(r + i));
        for a in &rows {
            assert!(a.q.len() >= self.k && a.d.len() >= nb);
            assert!(a.s.len() >= nb && a.sum.len() >= nb);
        }
        for g in g0..g1 {
            // SAFETY: as the caller's; the rows hold k values and nb scales and sums each.
            unsafe { self.tile::<VNNI, Q4, R>(&rows, r, g, out, residual) }
        }
    }

    /// Rows `r..r + R` (`rows`) × group `g`'s eight columns. With `VNNI` each `vpdpbusd`
    /// adds four products straight into 32 bits; else pairs go into 16 bits, widened once a
    /// block (Q4_1 only).
    #[inline(always)]
    unsafe fn tile<const VNNI: bool, const Q4: bool, const R: usize>(
        &self,
        rows: &[ActRow<'_>; R],
        r: usize,
        g: usize,
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        let (n, nb) = (self.n, self.k / BLOCK);
        let format = if Q4 {
            BlockFormat::Q4_1
        } else {
            BlockFormat::Q8_0
        };
        let (block_bytes, scales_per) = (
            Self::group_block_bytes(format),
            Self::scales_per_block(format),
        );
        assert!(self.format == format && (VNNI || Q4));
        assert!((g + 1) * nb * block_bytes <= self.quants.len());
        assert!((g + 1) * nb * scales_per <= self.scales.len());
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let quants = self.quants.as_ptr().add(g * nb * block_bytes);
            let scales = self.scales.as_ptr().add(g * nb * scales_per);
            let aq = |i: usize, at: usize| rows[i].q.as_ptr().add(at) as *const i32;
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let wq = quants.add(b * block_bytes);
                let mut isum = [_mm256_setzero_si256(); R];
                if Q4 {
                    for j in 0..4 {
                        let x = _mm256_loadu_si256(wq.add(32 * j) as *const __m256i);
                        let lo = _mm256_and_si256(x, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
                        for (i, isum) in isum.iter_mut().enumerate() {
                            let a_lo = _mm256_set1_epi32(aq(i, b * BLOCK + 4 * j).read_unaligned());
                            let a_hi =
                                _mm256_set1_epi32(aq(i, b * BLOCK + 16 + 4 * j).read_unaligned());
                            if VNNI {
                                *isum = _mm256_dpbusd_epi32(*isum, lo, a_lo);
                                *isum = _mm256_dpbusd_epi32(*isum, hi, a_hi);
                            } else {
                                *isum = _mm256_add_epi16(*isum, _mm256_maddubs_epi16(lo, a_lo));
                                *isum = _mm256_add_epi16(*isum, _mm256_maddubs_epi16(hi, a_hi));
                            }
                        }
                    }
                } else {
                    for j in 0..8 {
                        let x = _mm256_loadu_si256(wq.add(32 * j) as *const __m256i);
                        for (i, isum) in isum.iter_mut().enumerate() {
                            let a = _mm256_set1_epi32(aq(i, b * BLOCK + 4 * j).read_unaligned());
                            *isum = _mm256_dpbusd_epi32(*isum, x, a);
                        }
                    }
                }
                let half8 = |at: usize| _mm_loadu_si128(scales.add(at) as *const __m128i);
                let d = _mm256_cvtph_ps(half8(b * scales_per));
                let m = if Q4 {
                    _mm256_cvtph_ps(half8(b * scales_per + GROUP))
                } else {
                    _mm256_setzero_ps()
                };
                for (i, (acc, isum)) in acc.iter_mut().zip(isum).enumerate() {
                    let da = _mm256_set1_ps(*rows[i].d.get_unchecked(b));
                    let isum = if VNNI {
                        isum
                    } else {
                        _mm256_madd_epi16(isum, ones)
                    };
                    let isum = if Q4 {
                        isum
                    } else {
                        // Σ (q + 128)·q_a − 128·Σ q_a, exact in 32 bits.
                        let offset = _mm256_set1_epi32(*rows[i].sum.get_unchecked(b) << 7);
                        _mm256_sub_epi32(isum, offset)
                    };
                    let dots = _mm256_cvtepi32_ps(isum);
                    *acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, da), *acc);
                    if Q4 {
                        let sa = _mm256_set1_ps(*rows[i].s.get_unchecked(b));
                        *acc = _mm256_fmadd_ps(m, sa, *acc);
                    }
                }
            }
            let (c0, cols) = (g * GROUP, GROUP.min(n - g * GROUP));
            for (i, acc) in acc.into_iter().enumerate() {
                let at = (r + i) * n + c0;
                let mut v = [0f32; GROUP];
                _mm256_storeu_ps(v.as_mut_ptr(), acc);
                if let Some(res) = residual {
                    for (v, x) in v.iter_mut().zip(&res[at..at + cols]) {
                        *v += x;
                    }
                }
                std::ptr::copy_nonoverlapping(v.as_ptr(), out.add(at), cols);
            }
        }
    }
}

thread_local! {
    /// The calling thread's quantised prefill rows, kept at the largest size seen.
    static ACTS: std::cell::RefCell<QActs> = std::cell::RefCell::new(QActs::default());
}
