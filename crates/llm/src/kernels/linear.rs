//! A linear layer `y = x Wᵀ + b` whose weights are prepared once at load for the kernel that
//! runs it, computed a share of output columns at a time so the forward's threads split one
//! multiply; the bias and an epilogue (GELU or a residual add) are applied as each output is
//! written. BF16 layers run the `amx` tile kernel where the CPU has AMX, else the AVX-512
//! `bf16` one; F32 ones the portable path here.

use std::ops::Range;

use super::activation::gelu_exact_in_place;
use super::bf16::pack_panels;
#[cfg(target_arch = "x86_64")]
use super::bf16::x86;
use super::{amx, avx512_bf16, Precision, PANEL};

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
    /// BF16 weights multiplied on AMX tiles rather than by `vdpbf16ps` (same packing).
    tiles: bool,
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
    /// `k` even (true of every BERT layer); otherwise the layer is F32. A BF16 layer runs on AMX
    /// tiles where [`amx`] holds and `k` is whole tile steps of 32 (every BERT and llama
    /// projection here), unless [`Linear::without_tiles`] says otherwise.
    pub fn new(weight: &[f32], bias: &[f32], n: usize, k: usize, precision: Precision) -> Linear {
        assert_eq!(weight.len(), n * k, "weight is not [{n}, {k}]");
        assert_eq!(bias.len(), n, "bias is not [{n}]");
        let bf16 = precision == Precision::Bf16
            && avx512_bf16()
            && n.is_multiple_of(PANEL)
            && k.is_multiple_of(2);
        let weights = if bf16 {
            Weights::Bf16(pack_panels(weight, n, k))
        } else {
            Weights::F32(weight.to_vec())
        };
        let tiles = bf16 && amx() && k.is_multiple_of(super::amx::STEP);
        Linear {
            n,
            k,
            bias: bias.to_vec(),
            weights,
            tiles,
        }
    }

    /// The same layer on the AVX-512 BF16 kernel even where AMX would run (the AMX tests'
    /// comparison, and `PrefillKernel::Bf16`).
    pub fn without_tiles(mut self) -> Linear {
        self.tiles = false;
        self
    }

    /// Whether this layer multiplies on AMX tiles.
    pub fn on_tiles(&self) -> bool {
        self.tiles
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
                if self.tiles {
                    assert!(amx(), "an AMX layer where the tiles were not granted");
                    // SAFETY: AMX is granted to the process (`amx()`); `gemm` loads this
                    // thread's configuration itself; `out` is the caller's contract.
                    return unsafe {
                        super::amx::gemm(
                            &mut super::amx::Hardware,
                            a,
                            m,
                            k,
                            packed,
                            &self.bias,
                            n,
                            out,
                            cols,
                            epilogue,
                        )
                    };
                }
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
            gelu_exact_in_place(row);
        }
    }
}
