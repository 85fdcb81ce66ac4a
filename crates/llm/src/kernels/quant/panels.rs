//! The file's own Q4_1 weights repacked in column panels, multiplied on AVX2 (with AVX-512
//! VNNI where it runs) against activation rows quantised to 8 bits per block of 32
//! ([`super::QActs`], ggml's Q8_1 rounding). Decode (one row per sequence, a few more when a
//! step verifies drafts) runs it on every CPU with AVX2, and prefill (hundreds of rows) on
//! CPUs with AVX2 but not AVX-512 BF16, where the two compute the same sums from one copy of
//! the weights, 0.625 bytes per weight as shipped.
//!
//! The weights are repacked once at load into groups of eight output columns. In a group, one
//! block (32 inputs) is four 32-byte vectors; vector j holds, for each of the eight columns,
//! bytes 4j..4j + 4 of that column's block as shipped: the nibbles of inputs 4j..4j + 4 (low)
//! and 16 + 4j..16 + 4j + 4 (high). Masked and shifted, a vector is four consecutive inputs of
//! eight columns; an activation row's matching four bytes, broadcast, meet all eight in one
//! `vpmaddubsw` (unsigned weights × signed activations). A block's 16 products per lane stay in
//! 16 bits (|Σ| ≤ 8 · 2 · 15 · 127 = 30480 < 2¹⁵), so a block costs eight multiplies, then one
//! widening, one conversion and two scaled adds per eight outputs: w = d·q + m gives
//! Σ w·a = d·d_a·Σ q·q_a + m·(d_a·Σ q_a). The blocks-as-shipped kernel ([`super::matmul`]) holds
//! a block per register and spends the widening and conversion on every single output: on
//! AVX2 it is compute-bound even for one row, and each further row costs nearly as much again.
//! With AVX-512 VNNI, `vpdpbusd` adds each vector's products straight into 32-bit sums: half
//! the integer instructions for the same sums, so the same bits.
//!
//! Each output sums its blocks in one fixed order, whatever the number of rows or the tile a
//! row falls in, so a prompt's rows come out the same however it is chunked, and a decode row's
//! logits do not depend on the rows verified or batched beside it.

use std::arch::x86_64::*;

use super::{ActRow, BlockFormat, Isa, QActs, QMatrix, BLOCK};
use crate::kernels::Shared;

/// Output columns per packed group: one 256-bit register of i32 or f32.
const GROUP: usize = 8;
/// Bytes of one group's block of quants: four vectors.
const GROUP_BLOCK_BYTES: usize = GROUP * BLOCK / 2;
/// Activation rows per register tile; each group's unpacked weights serve them all.
const TILE_ROWS: usize = 4;
/// Rows per work item: a multiple of [`TILE_ROWS`].
const ROW_BLOCK: usize = 64;
/// Groups per work item (64 columns): their weights (k = 1536: 72 KiB) stay in L2 while the
/// item's rows pass over them, each row tile's activations in L1.
const ITEM_GROUPS: usize = 8;

/// A Q4_1 weight matrix `(n, k)` (n output columns, each a row of the GGUF matrix) in the
/// group layout above.
pub struct Q4Panels {
    n: usize,
    k: usize,
    /// Group after group, block after block, [`GROUP_BLOCK_BYTES`] each.
    quants: Vec<u8>,
    /// Per group and block: the eight columns' scales d, then their minimums m (f16 bits as
    /// shipped; zero for the columns past `n` in the last group).
    scales: Vec<u16>,
}

impl Q4Panels {
    /// The layout above, from a Q4_1 matrix (`None` for any other format).
    pub fn pack(w: &QMatrix) -> Option<Q4Panels> {
        if w.format != BlockFormat::Q4_1 {
            return None;
        }
        let (n, k) = (w.rows, w.cols);
        let (nb, groups) = (k / BLOCK, n.div_ceil(GROUP));
        let mut quants = vec![0u8; groups * nb * GROUP_BLOCK_BYTES];
        let mut scales = vec![0u16; groups * nb * 2 * GROUP];
        for c in 0..n {
            let row = w.row(c);
            let (g, i) = (c / GROUP, c % GROUP);
            for b in 0..nb {
                let src = &row.quants[b * BLOCK / 2..(b + 1) * BLOCK / 2];
                let dst = &mut quants[(g * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
                for j in 0..4 {
                    dst[j * 32 + 4 * i..][..4].copy_from_slice(&src[4 * j..4 * j + 4]);
                }
                let s = &mut scales[(g * nb + b) * 2 * GROUP..][..2 * GROUP];
                s[i] = row.d[b];
                s[GROUP + i] = row.m[b];
            }
        }
        Some(Q4Panels {
            n,
            k,
            quants,
            scales,
        })
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

    /// `out = x Wᵀ (+ residual)` for the `m` rows of `x` `(m, k)`; `out` and `residual` are
    /// `(m, n)`. The rows are quantised into a buffer the calling thread keeps, then multiplied
    /// by [`Q4Panels::matmul`]. Needs AVX2 with FMA and F16C ([`crate::kernels::avx2`]).
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
    /// AVX2 with FMA and F16C ([`crate::kernels::avx2`]).
    pub fn matmul(&self, x: &QActs, out: &mut [f32], residual: Option<&[f32]>) {
        self.matmul_with(Isa::detect(), x, out, residual)
    }

    /// [`Q4Panels::matmul`] on the byte dot products of `isa`: `vpdpbusd` with AVX-512 VNNI,
    /// else AVX2's `vpmaddubsw` (the same integer sums, so the same bits).
    pub fn matmul_with(&self, isa: Isa, x: &QActs, out: &mut [f32], residual: Option<&[f32]>) {
        let (n, m) = (self.n, x.rows);
        assert_eq!(x.cols, self.k, "inner dimensions differ");
        assert_eq!(out.len(), m * n, "output rows");
        assert!(residual.is_none_or(|r| r.len() == m * n), "residual rows");
        assert!(
            crate::kernels::avx2(),
            "the Q4_1 panel kernel needs AVX2, FMA and F16C"
        );
        let (groups, row_blocks) = (n.div_ceil(GROUP), m.div_ceil(ROW_BLOCK));
        let items = groups.div_ceil(ITEM_GROUPS) * row_blocks;
        let vnni = isa == Isa::Avx512Vnni;
        assert!(
            !vnni || Isa::detect() == Isa::Avx512Vnni,
            "the VNNI panel kernel needs AVX-512 VNNI"
        );
        let dst = Shared::new(out);
        let item = |i: usize| {
            let (g0, r0) = (i / row_blocks * ITEM_GROUPS, i % row_blocks * ROW_BLOCK);
            let (g1, r1) = ((g0 + ITEM_GROUPS).min(groups), (r0 + ROW_BLOCK).min(m));
            let (rows, groups) = ((r0, r1), (g0, g1));
            // SAFETY: the CPU has AVX2, FMA and F16C, and VNNI where it is asked for (asserted
            // above); the item writes only rows r0..r1 × columns of groups g0..g1 of `out`,
            // which no other item touches.
            unsafe {
                if vnni {
                    self.item_vnni(x, rows, groups, dst.ptr(), residual)
                } else {
                    self.item_avx2(x, rows, groups, dst.ptr(), residual)
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
        unsafe { self.item::<false>(acts, rows, groups, out, residual) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn item_vnni(
        &self,
        acts: &QActs,
        rows: (usize, usize),
        groups: (usize, usize),
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        // SAFETY: as the caller's.
        unsafe { self.item::<true>(acts, rows, groups, out, residual) }
    }

    /// Rows `r0..r1` × groups `g0..g1`, row tile by row tile.
    #[inline(always)]
    unsafe fn item<const VNNI: bool>(
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
                    4 => self.row_tile::<VNNI, 4>(acts, r, (g0, g1), out, residual),
                    3 => self.row_tile::<VNNI, 3>(acts, r, (g0, g1), out, residual),
                    2 => self.row_tile::<VNNI, 2>(acts, r, (g0, g1), out, residual),
                    _ => self.row_tile::<VNNI, 1>(acts, r, (g0, g1), out, residual),
                }
            }
            r += rows;
        }
    }

    /// Rows `r..r + R` × groups `g0..g1`.
    #[inline(always)]
    unsafe fn row_tile<const VNNI: bool, const R: usize>(
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
            assert!(a.q.len() >= self.k && a.d.len() >= nb && a.s.len() >= nb);
        }
        for g in g0..g1 {
            // SAFETY: as the caller's; the rows hold k values and nb scales each.
            unsafe { self.tile::<VNNI, R>(&rows, r, g, out, residual) }
        }
    }

    /// Rows `r..r + R` (`rows`) × group `g`'s eight columns. With `VNNI` each `vpdpbusd`
    /// adds four products straight into 32 bits; else pairs go into 16 bits, widened once a
    /// block.
    #[inline(always)]
    unsafe fn tile<const VNNI: bool, const R: usize>(
        &self,
        rows: &[ActRow<'_>; R],
        r: usize,
        g: usize,
        out: *mut f32,
        residual: Option<&[f32]>,
    ) {
        let (n, nb) = (self.n, self.k / BLOCK);
        assert!((g + 1) * nb * GROUP_BLOCK_BYTES <= self.quants.len());
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let quants = self.quants.as_ptr().add(g * nb * GROUP_BLOCK_BYTES);
            let scales = self.scales.as_ptr().add(g * nb * 2 * GROUP);
            let aq = |i: usize, at: usize| rows[i].q.as_ptr().add(at) as *const i32;
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let wq = quants.add(b * GROUP_BLOCK_BYTES);
                let mut isum = [_mm256_setzero_si256(); R];
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
                let half8 = |at: usize| _mm_loadu_si128(scales.add(at) as *const __m128i);
                let d = _mm256_cvtph_ps(half8(b * 2 * GROUP));
                let m = _mm256_cvtph_ps(half8(b * 2 * GROUP + GROUP));
                for (i, (acc, isum)) in acc.iter_mut().zip(isum).enumerate() {
                    let da = _mm256_set1_ps(*rows[i].d.get_unchecked(b));
                    let sa = _mm256_set1_ps(*rows[i].s.get_unchecked(b));
                    let isum = if VNNI {
                        isum
                    } else {
                        _mm256_madd_epi16(isum, ones)
                    };
                    let dots = _mm256_cvtepi32_ps(isum);
                    *acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, da), *acc);
                    *acc = _mm256_fmadd_ps(m, sa, *acc);
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
