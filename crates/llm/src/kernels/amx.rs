//! The BF16 matrix multiply on AMX tiles (Intel Xeon from Sapphire Rapids on): the same
//! packed panels as the AVX-512 BF16 kernel (`bf16`), multiplied by `tdpbf16ps`, which does a
//! 16 × 16 × 32 block of products per instruction with F32 accumulation.
//!
//! Tiles need three things the vector kernels do not, each handled here or in [`crate::cpu`]:
//! - the process asks the kernel for the tile state once (`arch_prctl`, at detection);
//! - every thread loads a tile configuration before its first tile instruction, so each call
//!   of [`gemm`] loads its own (a pool thread that never ran a tile kernel has none: that is
//!   the SIGILL llama.cpp's AMX build dies of), and puts back the one the thread had when it
//!   leaves: candle's own AMX matmuls (Q4_K, on the same pool) configure a thread once and
//!   expect it to stay configured;
//! - the tile registers are not Rust values, so the kernel is written against [`Tiles`], whose
//!   hardware form is one instruction per method and whose emulated form ([`Emulated`], in the
//!   tests) checks each instruction's shape rules as the CPU would and runs on any CPU.
//!
//! The register plan: C tiles 0-3 hold a 32 × 32 block of the output, A tiles 4-5 its two
//! 16-row halves of the input rows (32 inputs each), B tiles 6-7 its two 16-column halves of
//! the weights. A B tile is 16 rows of input pairs × 16 columns × 2 BF16, which is exactly a
//! 16-column slice of the panel layout, read at the panel's row stride.

use std::ops::Range;

use super::{Epilogue, PANEL};

/// Inputs per tile step: a 64-byte tile row of BF16.
pub const STEP: usize = 32;

/// Output rows and columns per block: two tiles each way.
const BLOCK: usize = 32;

/// The 64-byte operand of `ldtilecfg` (palette 1).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile.
    colsb: [u16; 16],
    /// Rows of each tile; 0 leaves the tile unconfigured.
    rows: [u8; 16],
}

impl TileConfig {
    /// No configuration: what `sttilecfg` stores where none is loaded.
    pub const EMPTY: TileConfig = TileConfig {
        palette: 0,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };

    /// The configuration for a block of `top + bottom` output rows (`top` in 1..=16, `bottom`
    /// in 0..=16): tiles 0, 1 and 4 hold the first `top` rows, 2, 3 and 5 the next `bottom`
    /// (unconfigured when 0), 6 and 7 the weights.
    pub(super) fn for_rows(top: usize, bottom: usize) -> TileConfig {
        assert!((1..=16).contains(&top) && bottom <= 16);
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (tile, rows) in [
            (0, top),
            (1, top),
            (4, top),
            (2, bottom),
            (3, bottom),
            (5, bottom),
            (6, STEP / 2),
            (7, STEP / 2),
        ] {
            if rows > 0 {
                cfg.rows[tile] = rows as u8;
                cfg.colsb[tile] = 64;
            }
        }
        cfg
    }
}

/// The tile instructions the kernel uses, one method each. Tile numbers are constants at every
/// call site, so the hardware form compiles to the single instruction.
///
/// # Safety
/// Every method is `unsafe`: the hardware form needs AMX granted to the process, a loaded
/// configuration on this thread, and `base` pointing at `rows × stride` readable (writable
/// for `store`) bytes of the configured tile's shape.
pub trait Tiles {
    unsafe fn configure(&mut self, cfg: &TileConfig);
    /// `sttilecfg`: the configuration in force (all zeros where none is).
    unsafe fn current(&mut self) -> TileConfig;
    unsafe fn load(&mut self, tile: usize, base: *const u8, stride: usize);
    /// `tdpbf16ps c, a, b`: `c[m][n] += Σ_k a[m][2k..2k+2] · b[k][2n..2n+2]`.
    unsafe fn dot(&mut self, c: usize, a: usize, b: usize);
    unsafe fn store(&mut self, tile: usize, base: *mut u8, stride: usize);
    unsafe fn release(&mut self);
}

/// `out[r][c] = epilogue(Σ_i a[r][i] W[c][i] + bias[c])` for the `m` rows of `a` (`[m, k]`
/// BF16) and the columns `cols` (whole panels) of the packed weights, `out` being `[m, n]`:
/// `Linear::forward_columns` for BF16 layers on AMX. Each output starts from its bias (and
/// residual) and adds its products in steps of [`STEP`] inputs in order, whatever `m` is, so
/// a row gets the same result in any chunking of its prompt.
///
/// # Safety
/// `k` is a multiple of [`STEP`]; `out` points to `m * n` writable f32 and nothing else touches
/// columns `cols` of it while this runs; `tiles` can run (see [`Tiles`]).
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm<T: Tiles>(
    tiles: &mut T,
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
    assert!(
        k.is_multiple_of(STEP) && k > 0,
        "k = {k} is not whole tile steps"
    );
    assert!(a.len() >= m * k && packed.len() >= n * k && bias.len() >= n);
    assert!(cols.start.is_multiple_of(PANEL) && cols.end.is_multiple_of(PANEL) && cols.end <= n);
    let pairs = k / 2;
    let (lda, ldc, ldb) = (k * 2, n * 4, PANEL * 2 * 2);
    // SAFETY: storing the configuration is always allowed where AMX is granted.
    let previous = unsafe { tiles.current() };
    let mut loaded = None;
    for r0 in (0..m).step_by(BLOCK) {
        let rows = (m - r0).min(BLOCK);
        let (top, bottom) = (rows.min(16), rows.saturating_sub(16));
        let cfg = TileConfig::for_rows(top, bottom);
        if loaded != Some(cfg) {
            // SAFETY: a valid palette-1 configuration.
            unsafe { tiles.configure(&cfg) };
            loaded = Some(cfg);
        }
        for c0 in (cols.start..cols.end).step_by(BLOCK) {
            // Each output starts as its bias plus its residual, loaded into the C tiles.
            for r in r0..r0 + rows {
                // SAFETY: row r, columns c0..c0+32 ⊂ cols are ours (the caller's contract).
                let y = unsafe { std::slice::from_raw_parts_mut(out.add(r * n + c0), BLOCK) };
                y.copy_from_slice(&bias[c0..c0 + BLOCK]);
                if let Epilogue::Add(res) = epilogue {
                    for (y, x) in y.iter_mut().zip(&res[r * n + c0..][..BLOCK]) {
                        *y += x;
                    }
                }
            }
            let c = |r: usize, c: usize| out.wrapping_add(r * n + c).cast::<u8>();
            let panel = &packed[c0 / PANEL * pairs * PANEL * 2..][..pairs * PANEL * 2];
            let within = c0 % PANEL;
            // SAFETY (the block): every load and store stays inside rows r0..r0+rows and columns
            // c0..c0+32 of `out`, rows r0..r0+rows of `a`, and `panel`, at the shapes configured
            // above; tiles 2, 3 and 5 are touched only when `bottom` rows exist.
            unsafe {
                tiles.load(0, c(r0, c0), ldc);
                tiles.load(1, c(r0, c0 + 16), ldc);
                if bottom > 0 {
                    tiles.load(2, c(r0 + 16, c0), ldc);
                    tiles.load(3, c(r0 + 16, c0 + 16), ldc);
                }
                for i0 in (0..k).step_by(STEP) {
                    let x = a.as_ptr().add(r0 * k + i0).cast::<u8>();
                    let w = panel
                        .as_ptr()
                        .add(i0 / 2 * PANEL * 2 + within * 2)
                        .cast::<u8>();
                    tiles.load(4, x, lda);
                    tiles.load(6, w, ldb);
                    tiles.load(7, w.add(16 * 2 * 2), ldb);
                    tiles.dot(0, 4, 6);
                    tiles.dot(1, 4, 7);
                    if bottom > 0 {
                        tiles.load(5, x.add(16 * lda), lda);
                        tiles.dot(2, 5, 6);
                        tiles.dot(3, 5, 7);
                    }
                }
                tiles.store(0, c(r0, c0), ldc);
                tiles.store(1, c(r0, c0 + 16), ldc);
                if bottom > 0 {
                    tiles.store(2, c(r0 + 16, c0), ldc);
                    tiles.store(3, c(r0 + 16, c0 + 16), ldc);
                }
            }
            if let Epilogue::Gelu = epilogue {
                for r in r0..r0 + rows {
                    // SAFETY: as above.
                    let y = unsafe { std::slice::from_raw_parts_mut(out.add(r * n + c0), BLOCK) };
                    super::activation::gelu_in_place(y);
                }
            }
        }
    }
    // SAFETY: both are always allowed where AMX is granted. Releasing returns the tile state
    // to its initial form, so the thread's context switches and signals save none of it;
    // where the thread had a configuration of its own, it gets it back (its tiles' data is
    // zeroed either way, as every `ldtilecfg` does).
    unsafe {
        if previous.palette == 0 {
            tiles.release();
        } else {
            tiles.configure(&previous);
        }
    }
}

/// The instructions themselves. Only for a process [`crate::cpu`] found AMX in and was granted
/// the tile state by the kernel (`crate::cpu::Level::Amx`).
#[cfg(target_arch = "x86_64")]
pub struct Hardware;

#[cfg(target_arch = "x86_64")]
impl Tiles for Hardware {
    #[inline(always)]
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        // SAFETY: the caller's contract (see `Tiles`).
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg as *const TileConfig, options(nostack))
        };
    }

    #[inline(always)]
    unsafe fn current(&mut self) -> TileConfig {
        let mut cfg = TileConfig::EMPTY;
        // SAFETY: the caller's contract (see `Tiles`); 64 writable, aligned bytes.
        unsafe {
            std::arch::asm!("sttilecfg [{}]", in(reg) &mut cfg as *mut TileConfig, options(nostack))
        };
        cfg
    }

    #[inline(always)]
    unsafe fn load(&mut self, tile: usize, base: *const u8, stride: usize) {
        macro_rules! load {
            ($t:literal) => {
                // SAFETY: the caller's contract (see `Tiles`).
                unsafe {
                    std::arch::asm!(
                        concat!("tileloadd tmm", $t, ", [{b} + {s}*1]"),
                        b = in(reg) base, s = in(reg) stride, options(nostack, readonly)
                    )
                }
            };
        }
        match tile {
            0 => load!(0),
            1 => load!(1),
            2 => load!(2),
            3 => load!(3),
            4 => load!(4),
            5 => load!(5),
            6 => load!(6),
            7 => load!(7),
            _ => unreachable!("tile {tile}"),
        }
    }

    #[inline(always)]
    unsafe fn dot(&mut self, c: usize, a: usize, b: usize) {
        macro_rules! dot {
            ($c:literal, $a:literal, $b:literal) => {
                // SAFETY: the caller's contract (see `Tiles`).
                unsafe {
                    std::arch::asm!(
                        concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
                        options(nostack, nomem)
                    )
                }
            };
        }
        match (c, a, b) {
            (0, 4, 6) => dot!(0, 4, 6),
            (1, 4, 7) => dot!(1, 4, 7),
            (2, 5, 6) => dot!(2, 5, 6),
            (3, 5, 7) => dot!(3, 5, 7),
            _ => unreachable!("tdpbf16ps tmm{c}, tmm{a}, tmm{b} is not in the register plan"),
        }
    }

    #[inline(always)]
    unsafe fn store(&mut self, tile: usize, base: *mut u8, stride: usize) {
        macro_rules! store {
            ($t:literal) => {
                // SAFETY: the caller's contract (see `Tiles`).
                unsafe {
                    std::arch::asm!(
                        concat!("tilestored [{b} + {s}*1], tmm", $t),
                        b = in(reg) base, s = in(reg) stride, options(nostack)
                    )
                }
            };
        }
        match tile {
            0 => store!(0),
            1 => store!(1),
            2 => store!(2),
            3 => store!(3),
            _ => unreachable!("tile {tile} holds no output"),
        }
    }

    #[inline(always)]
    unsafe fn release(&mut self) {
        // SAFETY: always allowed where AMX is granted.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The tile instructions in plain Rust, as the Intel SDM describes them, with the checks the
/// CPU makes (a configuration it would refuse, a tile used before one, shapes that do not fit,
/// or one tile as two operands are `#GP` or `#UD` there and a panic here): the kernel's
/// addressing and shapes, tested on any CPU. Its `tdpbf16ps` sums one step's products in one
/// order (each pair's dot product, the step's sum, then into C); the CPU's order inside an
/// instruction is its own, so the two agree to rounding, not bit for bit.
#[cfg(test)]
pub struct Emulated {
    cfg: Option<TileConfig>,
    tiles: [[u8; 1024]; 8],
    /// Instructions run, by kind (configure, load, dot, store, release).
    pub counts: [usize; 5],
}

#[cfg(test)]
impl Emulated {
    pub fn new() -> Emulated {
        Emulated {
            cfg: None,
            tiles: [[0; 1024]; 8],
            counts: [0; 5],
        }
    }

    /// The configuration in force, if any.
    pub fn config(&self) -> Option<TileConfig> {
        self.cfg
    }

    /// (rows, bytes per row) of a configured tile.
    fn shape(&self, tile: usize) -> (usize, usize) {
        let cfg = self
            .cfg
            .as_ref()
            .expect("a tile instruction before ldtilecfg");
        let (rows, colsb) = (cfg.rows[tile] as usize, cfg.colsb[tile] as usize);
        assert!(rows > 0 && colsb > 0, "tmm{tile} is not configured");
        (rows, colsb)
    }

    fn f32_at(&self, tile: usize, row: usize, col: usize) -> f32 {
        let at = row * 64 + col * 4;
        f32::from_le_bytes(self.tiles[tile][at..at + 4].try_into().unwrap())
    }

    fn bf16_at(&self, tile: usize, row: usize, col: usize) -> f32 {
        let at = row * 64 + col * 2;
        super::from_bf16(u16::from_le_bytes([
            self.tiles[tile][at],
            self.tiles[tile][at + 1],
        ]))
    }
}

#[cfg(test)]
impl Tiles for Emulated {
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        assert_eq!(cfg.palette, 1);
        assert!(
            cfg.start_row == 0 && cfg.reserved == [0; 14],
            "reserved bytes set"
        );
        for t in 0..16 {
            let (rows, colsb) = (cfg.rows[t], cfg.colsb[t]);
            assert!(rows <= 16 && colsb <= 64, "tmm{t} too large");
            assert_eq!(
                rows == 0,
                colsb == 0,
                "tmm{t}: rows {rows} with {colsb} bytes a row"
            );
            assert!(t < 8 || rows == 0, "tmm{t} does not exist");
        }
        self.cfg = Some(*cfg);
        self.tiles = [[0; 1024]; 8];
        self.counts[0] += 1;
    }

    unsafe fn current(&mut self) -> TileConfig {
        self.cfg.unwrap_or(TileConfig::EMPTY)
    }

    unsafe fn load(&mut self, tile: usize, base: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(tile);
        self.tiles[tile] = [0; 1024];
        for r in 0..rows {
            // SAFETY: the caller's contract (see `Tiles`).
            let row = unsafe { std::slice::from_raw_parts(base.add(r * stride), colsb) };
            self.tiles[tile][r * 64..r * 64 + colsb].copy_from_slice(row);
        }
        self.counts[1] += 1;
    }

    unsafe fn dot(&mut self, c: usize, a: usize, b: usize) {
        assert!(
            c != a && c != b && a != b,
            "tdpbf16ps tmm{c}, tmm{a}, tmm{b}: a tile twice"
        );
        let ((c_rows, c_colsb), (a_rows, a_colsb), (b_rows, b_colsb)) =
            (self.shape(c), self.shape(a), self.shape(b));
        assert!(
            c_rows == a_rows && a_colsb / 4 == b_rows && c_colsb == b_colsb,
            "tdpbf16ps tmm{c}, tmm{a}, tmm{b}: shapes {c_rows}×{c_colsb}, {a_rows}×{a_colsb}, \
             {b_rows}×{b_colsb} do not fit"
        );
        for m in 0..c_rows {
            for n in 0..c_colsb / 4 {
                let mut step = 0f32;
                for kk in 0..a_colsb / 4 {
                    step += self.bf16_at(a, m, 2 * kk) * self.bf16_at(b, kk, 2 * n)
                        + self.bf16_at(a, m, 2 * kk + 1) * self.bf16_at(b, kk, 2 * n + 1);
                }
                let acc = self.f32_at(c, m, n) + step;
                let at = m * 64 + n * 4;
                self.tiles[c][at..at + 4].copy_from_slice(&acc.to_le_bytes());
            }
        }
        self.counts[2] += 1;
    }

    unsafe fn store(&mut self, tile: usize, base: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(tile);
        for r in 0..rows {
            // SAFETY: the caller's contract (see `Tiles`).
            let row = unsafe { std::slice::from_raw_parts_mut(base.add(r * stride), colsb) };
            row.copy_from_slice(&self.tiles[tile][r * 64..r * 64 + colsb]);
        }
        self.counts[3] += 1;
    }

    unsafe fn release(&mut self) {
        self.cfg = None;
        self.counts[4] += 1;
    }
}
