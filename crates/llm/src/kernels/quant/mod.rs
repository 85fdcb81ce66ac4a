//! Quantised matrix × activations kernels for decode on the CPU.
//!
//! A decode step multiplies every weight matrix by one activation row per sequence, so it reads
//! all the weights once per step and does little arithmetic per byte: its speed is the bytes it
//! reads plus the overhead around them. These kernels read the GGUF's own blocks as shipped,
//! 4-bit Q4_1 (20 bytes per 32 weights) or 8-bit Q8_0 (34 bytes), against activations quantised
//! to 8 bits per block of 32 (as ggml's Q8_1), and multiply each weight block by every sequence of
//! a batched step while it is in registers: a batch of B reads the weights once, not B times.
//!
//! One block's dot product, with w = d·q + m (Q4_1, q in 0..16) or w = d·q (Q8_0, q signed) and
//! a = d_a·q_a: Σ w·a = d·d_a·Σ q·q_a + m·(d_a·Σ q_a). The integer sums use 8-bit multiplies
//! with 32-bit accumulation (AVX-512 VNNI `vpdpbusd` where the CPU has it, else AVX2
//! `vpmaddubsw` + `vpmaddwd`, else plain loops); the scales are applied in f32. Wherever AVX2
//! runs, the Q4_1 layer projections are read repacked in column panels instead ([`panels`],
//! chosen per matrix by [`DecodeMatrix`]): the same bytes, one conversion per eight outputs
//! rather than one per output, with `vpdpbusd` where VNNI runs; with VNNI the Q8_0 output head
//! is read in panels too. The blocks as shipped keep the head on AVX2 and everything on CPUs
//! without it. The ISA is picked once at run time, so one portable binary uses what the
//! machine has.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

mod acts;
#[cfg(target_arch = "x86_64")]
pub mod panels;

#[cfg(all(test, target_arch = "x86_64"))]
use acts::quantize_block_avx2;
pub use acts::QActs;
use acts::{quantize_block, ActRow};
#[cfg(test)]
use acts::{quantize_block_body, PARALLEL_QUANTIZE_BLOCKS};

/// Weights per quantisation block.
pub const BLOCK: usize = 32;

/// How a matrix's blocks are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    /// 16 bytes of nibbles (element j low, j + 16 high), scale d and minimum m.
    Q4_1,
    /// 32 signed bytes and scale d.
    Q8_0,
}

impl BlockFormat {
    fn quant_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_1 => BLOCK / 2,
            BlockFormat::Q8_0 => BLOCK,
        }
    }
}

/// A row-major `(rows, cols)` weight matrix in 32-wide blocks, split into quants and scales so
/// the kernels read each with aligned, contiguous loads. Same bytes as the GGUF blocks.
pub struct QMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    /// Row after row, block after block.
    quants: Vec<u8>,
    /// f16 bits, per row `cols / 32` then zeros up to [`scale_stride`]`(cols)`, so the kernels
    /// always load eight scales at once.
    d: Vec<u16>,
    /// f16 bits of the Q4_1 minimums, laid out as `d`; empty for Q8_0.
    m: Vec<u16>,
}

/// Scales per row as stored: the blocks of `cols`, padded to a multiple of eight.
fn scale_stride(cols: usize) -> usize {
    (cols / BLOCK).next_multiple_of(8)
}

impl QMatrix {
    /// Stacks the row-major matrices `parts` (each `(rows_i, cols)`) into one matrix. Q4_1 and
    /// Q8_0 are taken as shipped; any other type is dequantised and requantised to Q8_0.
    pub fn from_qtensors(parts: &[&QTensor]) -> candle_core::Result<QMatrix> {
        let Some(first) = parts.first() else {
            candle_core::bail!("no tensors to stack");
        };
        let (_, cols) = first.shape().dims2()?;
        let shipped = first.dtype();
        let format = match shipped {
            GgmlDType::Q4_1 => BlockFormat::Q4_1,
            _ => BlockFormat::Q8_0,
        };
        if !cols.is_multiple_of(BLOCK) {
            candle_core::bail!("{cols} columns are not a multiple of {BLOCK}");
        }
        let mut out = QMatrix {
            format,
            rows: 0,
            cols,
            quants: Vec::new(),
            d: Vec::new(),
            m: Vec::new(),
        };
        for part in parts {
            let (rows, c) = part.shape().dims2()?;
            if c != cols || part.dtype() != shipped {
                candle_core::bail!("cannot stack {part:?} with {first:?}");
            }
            match shipped {
                GgmlDType::Q4_1 => out.push_rows(&part.data()?, 20),
                GgmlDType::Q8_0 => out.push_rows(&part.data()?, 34),
                _ => {
                    let dense = part
                        .dequantize(&candle_core::Device::Cpu)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    out.push_quantized_q8(&dense);
                }
            }
            out.rows += rows;
        }
        Ok(out)
    }

    /// Quantises a dense row-major `(rows, cols)` matrix to Q8_0.
    pub fn quantize_q8(dense: &[f32], rows: usize, cols: usize) -> QMatrix {
        assert_eq!(dense.len(), rows * cols);
        assert!(cols.is_multiple_of(BLOCK));
        let mut out = QMatrix {
            format: BlockFormat::Q8_0,
            rows,
            cols,
            quants: Vec::with_capacity(rows * cols),
            d: Vec::with_capacity(rows * cols / BLOCK),
            m: Vec::new(),
        };
        out.push_quantized_q8(dense);
        out
    }

    /// Appends rows of ggml blocks: `d` (f16), then `m` (f16, Q4_1 only), then the quants.
    fn push_rows(&mut self, bytes: &[u8], block_bytes: usize) {
        let f16_at = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        for row in bytes.chunks_exact(self.cols / BLOCK * block_bytes) {
            for block in row.chunks_exact(block_bytes) {
                self.d.push(f16_at(block, 0));
                match self.format {
                    BlockFormat::Q4_1 => {
                        self.m.push(f16_at(block, 2));
                        self.quants.extend_from_slice(&block[4..]);
                    }
                    BlockFormat::Q8_0 => self.quants.extend_from_slice(&block[2..]),
                }
            }
            self.pad_scales();
        }
    }

    /// ggml's Q8_0 rounding (the activations' rounding, with d stored as f16).
    fn push_quantized_q8(&mut self, dense: &[f32]) {
        let mut q = [0i8; BLOCK];
        for row in dense.chunks_exact(self.cols) {
            for block in row.chunks_exact(BLOCK) {
                let (d, _) = quantize_block(block, &mut q);
                self.d.push(f16::from_f32(d).to_bits());
                self.quants.extend(q.iter().map(|&q| q as u8));
            }
            self.pad_scales();
        }
    }

    fn pad_scales(&mut self) {
        let stride = scale_stride(self.cols);
        self.d.resize(self.d.len().next_multiple_of(stride), 0);
        if self.format == BlockFormat::Q4_1 {
            self.m.resize(self.m.len().next_multiple_of(stride), 0);
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Bytes a full pass over the matrix reads (as stored in the GGUF).
    pub fn size_in_bytes(&self) -> usize {
        let scales = match self.format {
            BlockFormat::Q4_1 => 2,
            BlockFormat::Q8_0 => 1,
        };
        self.quants.len() + 2 * scales * self.rows * self.blocks_per_row()
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Row `r` in f32 (the embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (nb, stride) = (self.blocks_per_row(), scale_stride(self.cols));
        let qb = self.format.quant_bytes();
        for blk in 0..nb {
            let i = r * stride + blk;
            let d = f16::from_bits(self.d[i]).to_f32();
            let q = &self.quants[(r * nb + blk) * qb..][..qb];
            let o = &mut out[blk * BLOCK..(blk + 1) * BLOCK];
            match self.format {
                BlockFormat::Q4_1 => {
                    let m = f16::from_bits(self.m[i]).to_f32();
                    for j in 0..BLOCK / 2 {
                        o[j] = d * (q[j] & 0x0f) as f32 + m;
                        o[j + BLOCK / 2] = d * (q[j] >> 4) as f32 + m;
                    }
                }
                BlockFormat::Q8_0 => {
                    for (o, &q) in o.iter_mut().zip(q) {
                        *o = d * q as i8 as f32;
                    }
                }
            }
        }
    }

    fn row(&self, r: usize) -> Row<'_> {
        let (nb, stride) = (self.blocks_per_row(), scale_stride(self.cols));
        let qb = nb * self.format.quant_bytes();
        Row {
            blocks: nb,
            quants: &self.quants[r * qb..(r + 1) * qb],
            d: &self.d[r * stride..(r + 1) * stride],
            m: match self.format {
                BlockFormat::Q4_1 => &self.m[r * stride..(r + 1) * stride],
                BlockFormat::Q8_0 => &[],
            },
        }
    }
}

/// A decode matrix in the layout its kernel on this CPU reads: Q4_1 in column panels where the
/// kernels run at the AVX2 level or above, Q8_0 in panels where they run at `avx512` (VNNI)
/// ([`panels`]), else the blocks as shipped ([`matmul`]).
///
/// Measured on an AVX2-only AMD EPYC (family 25, 2 threads), the 30 layers' projections of the
/// default generator, medians of 15 interleaved rounds: panels 3.30 ms for one row against
/// 3.99 for the blocks as shipped, 3.60 against 4.86 for two, 4.84 against 8.18 for four, 7.95
/// against 15.02 for eight. On an AMD EPYC with AVX-512 VNNI (family 25 model 17, 2 threads;
/// `ragscope-lab kernels`, 92,160 × 576, two runs) the VNNI panels took 0.83-0.94 ms for one
/// row against 1.61-1.78 for the blocks as shipped four at a time through 512-bit VNNI (a
/// kernel since removed), and 1.01-1.51 against 4.09-4.57 for four. There the Q8_0 output head
/// (49,152 × 576; `decode-step`, five alternations) took 0.54-0.75 ms for one row in panels
/// against 0.99-1.66 on the blocks as shipped, and 0.79-1.05 against 1.89-3.07 for four.
pub enum DecodeMatrix {
    Blocks(QMatrix),
    #[cfg(target_arch = "x86_64")]
    Panels(std::sync::Arc<panels::Panels>),
}

impl DecodeMatrix {
    /// `w` in the layout for the kernels [`Isa::detect`] picks.
    pub fn new(w: QMatrix) -> DecodeMatrix {
        #[cfg(target_arch = "x86_64")]
        if panels::Panels::runs(w.format, Isa::detect()) {
            return DecodeMatrix::Panels(std::sync::Arc::new(panels::Panels::pack(&w)));
        }
        DecodeMatrix::Blocks(w)
    }

    /// Row `r` of the matrix in f32 (the embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self {
            DecodeMatrix::Blocks(w) => w.dequantize_row(r, out),
            #[cfg(target_arch = "x86_64")]
            DecodeMatrix::Panels(p) => p.dequantize_row(r, out),
        }
    }

    /// `out[i][r] = Σ_c x[i][c] · w[r][c]`, as [`matmul`].
    pub fn matmul(&self, x: &QActs, out: &mut [f32]) {
        match self {
            DecodeMatrix::Blocks(w) => matmul(w, x, out),
            #[cfg(target_arch = "x86_64")]
            DecodeMatrix::Panels(p) => p.matmul(x, out, None),
        }
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            DecodeMatrix::Blocks(w) => w.rows(),
            #[cfg(target_arch = "x86_64")]
            DecodeMatrix::Panels(p) => p.out_features(),
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        match self {
            DecodeMatrix::Blocks(w) => w.size_in_bytes(),
            #[cfg(target_arch = "x86_64")]
            DecodeMatrix::Panels(p) => p.size_in_bytes(),
        }
    }

    /// The panels, for a prefill that multiplies on the same kernel.
    #[cfg(target_arch = "x86_64")]
    pub fn panels(&self) -> Option<&std::sync::Arc<panels::Panels>> {
        match self {
            DecodeMatrix::Panels(p) => Some(p),
            DecodeMatrix::Blocks(_) => None,
        }
    }
}

#[derive(Clone, Copy)]
struct Row<'a> {
    blocks: usize,
    quants: &'a [u8],
    d: &'a [u16],
    m: &'a [u16],
}

/// The instruction set the quantised kernels run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    /// The set the kernels run on: [`crate::cpu::level`]'s (VNNI comes with the `avx512`
    /// level, AVX2 with FMA and F16C with `avx2`).
    pub fn detect() -> Isa {
        use crate::cpu::Level;
        match crate::cpu::level() {
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 | Level::Avx512Bf16 => Isa::Avx512Vnni,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => Isa::Avx2,
            _ => Isa::Portable,
        }
    }

    /// Whether this set's kernels run on this CPU: [`Isa::detect`]'s and every set below it.
    pub fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => Isa::detect() == Isa::Avx512Vnni,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Isa::detect() != Isa::Portable,
            Isa::Portable => true,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => "avx512-vnni",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

/// Activations per kernel call: each weight block is unpacked once for this many sequences.
const TILE: usize = 4;
/// Weight rows per kernel call: one activation block is loaded once for this many rows, and
/// each row keeps its own accumulator, so the multiply-adds do not wait on each other.
const ROW_TILE: usize = 4;
/// Below this many row × sequence dot products, waking the other threads costs more than it saves.
const PARALLEL_MIN_WORK: usize = 64;

/// Weight rows per kernel call for a tile of `n` activations. Measured (`ragscope-lab
/// kernels`, 2 threads): Q4_1 with one activation runs 1.6 ms with four rows per call against
/// 2.1 ms with one; Q8_0 5.6 ms with four rows, 2.2 ms with one. Two Q8_0 rows per call
/// (AVX2-only EPYC family 25, three alternations, noisy): one activation 2.2-3.1 ms against
/// 2.5-3.6 with one row, two 2.4 against 3.1-4.6, four 3.7-3.8 against 4.8-7.2; the output
/// head of the decode step 1.0-1.2 ms against 1.3-1.9 (five alternations of `decode-step`).
fn row_tile(format: BlockFormat, n: usize) -> usize {
    match (format, n) {
        (BlockFormat::Q8_0, _) => 2,
        (BlockFormat::Q4_1, 1) => ROW_TILE,
        (BlockFormat::Q4_1, _) => 2,
    }
}

/// `out[i][r] = Σ_c x[i][c] · w[r][c]`: `out` is row-major `(x.rows, w.rows)`. Rows of `w` are
/// split over candle's worker threads (the same pool as every other op, so nothing
/// oversubscribes the cores), one contiguous share each.
pub fn matmul(w: &QMatrix, x: &QActs, out: &mut [f32]) {
    matmul_with(Isa::detect(), w, x, out)
}

/// [`matmul`] on a given instruction set (tests compare them).
pub fn matmul_with(isa: Isa, w: &QMatrix, x: &QActs, out: &mut [f32]) {
    assert_eq!(w.cols, x.cols, "inner dimensions differ");
    assert_eq!(out.len(), x.rows * w.rows, "output has the wrong size");
    let (n_rows, n_seq) = (w.rows, x.rows);
    let out_addr = out.as_mut_ptr() as usize;
    let rows = |range: std::ops::Range<usize>| {
        for start in (0..n_seq).step_by(TILE) {
            let n = TILE.min(n_seq - start);
            let mut acts = [x.row(start); TILE];
            for (i, a) in acts.iter_mut().enumerate().take(n) {
                *a = x.row(start + i);
            }
            let step = row_tile(w.format, n);
            for r0 in range.clone().step_by(step) {
                let k = step.min(range.end - r0);
                let mut tile_rows = [w.row(r0); ROW_TILE];
                for (j, row) in tile_rows.iter_mut().enumerate().take(k) {
                    *row = w.row(r0 + j);
                }
                let dots = dot_tile(isa, w.format, &tile_rows[..k], &acts[..n]);
                for (j, dots) in dots.iter().take(k).enumerate() {
                    for (i, v) in dots.iter().take(n).enumerate() {
                        // SAFETY: each (sequence, row) element is written by exactly one work
                        // unit (rows are partitioned between units); `out` outlives this call.
                        unsafe { *(out_addr as *mut f32).add((start + i) * n_rows + r0 + j) = *v };
                    }
                }
            }
        }
    };
    if n_rows * n_seq < PARALLEL_MIN_WORK {
        rows(0..n_rows);
        return;
    }
    // One contiguous share per thread: each streams its rows front to back, which the
    // prefetchers follow far better than interleaved chunks.
    let pool = candle_core::utils::barrier_pool();
    let threads = pool.n_workers() + 1;
    let share = n_rows.div_ceil(threads).next_multiple_of(ROW_TILE);
    pool.execute(|tid| {
        let lo = (tid * share).min(n_rows);
        rows(lo..(lo + share).min(n_rows));
    });
}

/// Dots of up to [`ROW_TILE`] weight rows with up to [`TILE`] activation rows:
/// `out[row][activation]`.
type Dots = [[f32; TILE]; ROW_TILE];

fn dot_tile(isa: Isa, format: BlockFormat, rows: &[Row<'_>], acts: &[ActRow<'_>]) -> Dots {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` saw avx2, fma, f16c, avx512vnni and avx512vl on this CPU.
        Isa::Avx512Vnni => unsafe { x86::dot_tile_vnni(format, rows, acts) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` saw avx2, fma and f16c on this CPU.
        Isa::Avx2 => unsafe { x86::dot_tile_avx2(format, rows, acts) },
        Isa::Portable => {
            let mut out = [[0f32; TILE]; ROW_TILE];
            for (o, &row) in out.iter_mut().zip(rows) {
                *o = dot_tile_portable(format, row, acts);
            }
            out
        }
    }
}

fn dot_tile_portable(format: BlockFormat, w: Row<'_>, acts: &[ActRow<'_>]) -> [f32; TILE] {
    let mut out = [0f32; TILE];
    let qb = format.quant_bytes();
    for (o, a) in out.iter_mut().zip(acts) {
        let mut sum = 0f32;
        for blk in 0..w.blocks {
            let wq = &w.quants[blk * qb..(blk + 1) * qb];
            let aq = &a.q[blk * BLOCK..(blk + 1) * BLOCK];
            let isum: i32 = match format {
                BlockFormat::Q4_1 => (0..BLOCK / 2)
                    .map(|j| {
                        (wq[j] & 0x0f) as i32 * aq[j] as i32
                            + (wq[j] >> 4) as i32 * aq[j + BLOCK / 2] as i32
                    })
                    .sum(),
                BlockFormat::Q8_0 => wq
                    .iter()
                    .zip(aq)
                    .map(|(&q, &x)| q as i8 as i32 * x as i32)
                    .sum(),
            };
            let d = f16::from_bits(w.d[blk]).to_f32();
            sum += d * a.d[blk] * isum as f32;
            if format == BlockFormat::Q4_1 {
                sum += f16::from_bits(w.m[blk]).to_f32() * a.s[blk];
            }
        }
        *o = sum;
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{ActRow, BlockFormat, Dots, Row, BLOCK, ROW_TILE, TILE};

    /// One instruction set's byte dot products.
    trait ByteDot {
        /// 32 products of unsigned and signed bytes, summed in groups of four into 8 × i32.
        unsafe fn dot(u: __m256i, s: __m256i) -> __m256i;
    }

    struct Vnni;
    impl ByteDot for Vnni {
        #[inline(always)]
        unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
        }
    }

    struct Avx2;
    impl ByteDot for Avx2 {
        /// Pairs first (i16, no overflow: |q| ≤ 128 × 127 × 2), then pairs of pairs.
        #[inline(always)]
        unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    pub(super) unsafe fn dot_tile_vnni(
        format: BlockFormat,
        rows: &[Row<'_>],
        acts: &[ActRow<'_>],
    ) -> Dots {
        unsafe { dispatch::<Vnni>(format, rows, acts) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_tile_avx2(
        format: BlockFormat,
        rows: &[Row<'_>],
        acts: &[ActRow<'_>],
    ) -> Dots {
        unsafe { dispatch::<Avx2>(format, rows, acts) }
    }

    /// How far ahead of the blocks being multiplied the kernel asks for the weights (bytes).
    /// Measured on the decode step (`ragscope-lab decode-step`, Zen 5, medians of six
    /// interleaved runs), the layer matmuls: 2.85 ms at 4 KiB, 2.73 at 8 KiB, 3.26 at 2 KiB,
    /// against 4.88 when only the tile's first row was prefetched (1 KiB ahead), which left
    /// three quarters of its bytes to the hardware prefetchers.
    const PREFETCH_BYTES: usize = 4096;

    /// Picks the monomorphised tile for `rows.len()` × `acts.len()`.
    #[inline(always)]
    unsafe fn dispatch<D: ByteDot>(
        format: BlockFormat,
        rows: &[Row<'_>],
        acts: &[ActRow<'_>],
    ) -> Dots {
        let mut out = [[0f32; TILE]; ROW_TILE];
        macro_rules! tile {
            ($r:literal, $n:literal) => {{
                let w: &[Row<'_>; $r] = rows.try_into().expect("row tile size checked");
                let a: &[ActRow<'_>; $n] = acts.try_into().expect("tile size checked");
                let dots = match format {
                    BlockFormat::Q4_1 => unsafe { tile::<D, true, $r, $n>(w, a) },
                    BlockFormat::Q8_0 => unsafe { tile::<D, false, $r, $n>(w, a) },
                };
                for (o, d) in out.iter_mut().zip(&dots) {
                    o[..$n].copy_from_slice(d);
                }
            }};
        }
        match (rows.len(), acts.len()) {
            (4, 1) => tile!(4, 1),
            (3, 1) => tile!(3, 1),
            (2, 1) => tile!(2, 1),
            (1, 1) => tile!(1, 1),
            (2, 2) => tile!(2, 2),
            (1, 2) => tile!(1, 2),
            (2, 3) => tile!(2, 3),
            (1, 3) => tile!(1, 3),
            (2, 4) => tile!(2, 4),
            (1, 4) => tile!(1, 4),
            (r, n) => unreachable!("tile of {r} × {n}"),
        }
        out
    }

    /// `R` weight rows against `N` activation rows. `Q4`: nibbles and minimums (Q4_1), else
    /// signed bytes (Q8_0). Blocks go in groups of eight, so each group's scales are converted
    /// and multiplied eight at a time.
    #[inline(always)]
    unsafe fn tile<D: ByteDot, const Q4: bool, const R: usize, const N: usize>(
        rows: &[Row<'_>; R],
        acts: &[ActRow<'_>; N],
    ) -> [[f32; N]; R] {
        unsafe {
            let nb = rows[0].blocks;
            let stride = nb.next_multiple_of(8);
            for w in rows {
                assert!(w.blocks == nb && w.d.len() >= stride);
                assert!(w.quants.len() >= nb * if Q4 { BLOCK / 2 } else { BLOCK });
                assert!(!Q4 || w.m.len() >= stride);
            }
            for a in acts {
                assert!(a.q.len() >= nb * BLOCK && a.d.len() >= stride && a.s.len() >= stride);
            }
            let mut acc = [[_mm256_setzero_ps(); N]; R];
            // Σ m · d_a·Σq_a per lane (Q4_1 only).
            let mut acc_min = [[_mm256_setzero_ps(); N]; R];
            let low = _mm_set1_epi8(0x0f);
            let mut group = 0;
            while group < nb {
                let count = 8.min(nb - group);
                {
                    // Every row's group, PREFETCH_BYTES ahead: each byte the tile reads was
                    // asked for once, earlier. Prefetching never faults, even past the end.
                    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
                    for w in rows {
                        let p = w.quants.as_ptr().wrapping_add(group * qb + PREFETCH_BYTES);
                        let p = p as *const i8;
                        _mm_prefetch::<_MM_HINT_T0>(p);
                        _mm_prefetch::<_MM_HINT_T0>(p.add(64));
                        if !Q4 {
                            _mm_prefetch::<_MM_HINT_T0>(p.add(128));
                            _mm_prefetch::<_MM_HINT_T0>(p.add(192));
                        }
                    }
                }
                let mut scales = [[[0f32; 8]; N]; R];
                for (r, w) in rows.iter().enumerate() {
                    let dw = load_f16x8(w.d.as_ptr().add(group));
                    for (n, a) in acts.iter().enumerate() {
                        let da = _mm256_loadu_ps(a.d.as_ptr().add(group));
                        _mm256_storeu_ps(scales[r][n].as_mut_ptr(), _mm256_mul_ps(dw, da));
                        if Q4 {
                            let mw = load_f16x8(w.m.as_ptr().add(group));
                            let sa = _mm256_loadu_ps(a.s.as_ptr().add(group));
                            acc_min[r][n] = _mm256_fmadd_ps(mw, sa, acc_min[r][n]);
                        }
                    }
                }
                for i in 0..count {
                    let blk = group + i;
                    let mut a8 = [_mm256_setzero_si256(); N];
                    for (a8, a) in a8.iter_mut().zip(acts) {
                        *a8 = _mm256_loadu_si256(a.q.as_ptr().add(blk * BLOCK) as *const __m256i);
                    }
                    for (r, w) in rows.iter().enumerate() {
                        let (u, signs) = if Q4 {
                            let packed =
                                _mm_loadu_si128(w.quants.as_ptr().add(blk * 16) as *const __m128i);
                            let lo = _mm_and_si128(packed, low);
                            let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
                            (_mm256_set_m128i(hi, lo), None)
                        } else {
                            let q = _mm256_loadu_si256(
                                w.quants.as_ptr().add(blk * 32) as *const __m256i
                            );
                            // |q| as unsigned bytes; q's sign moves onto the activations.
                            (_mm256_sign_epi8(q, q), Some(q))
                        };
                        for n in 0..N {
                            let s = match signs {
                                Some(q) => _mm256_sign_epi8(a8[n], q),
                                None => a8[n],
                            };
                            let isum = D::dot(u, s);
                            let scale = _mm256_broadcast_ss(scales[r][n].get_unchecked(i));
                            acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r][n]);
                        }
                    }
                }
                group += count;
            }
            let mut out = [[0f32; N]; R];
            for r in 0..R {
                for n in 0..N {
                    out[r][n] = hsum(_mm256_add_ps(acc[r][n], acc_min[r][n]));
                }
            }
            out
        }
    }

    /// Eight f16 values (their bits) as f32.
    #[inline(always)]
    unsafe fn load_f16x8(bits: *const u16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(bits as *const __m128i)) }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests;
