//! Compute kernels for the CPU BERT forward (`rag::embed::cpu_bert`) and the generator's prefill: a matrix multiply against
//! weights packed once at load, in BF16 on AVX-512 BF16 (`vdpbf16ps`, F32 accumulation) or in
//! F32 through the `gemm` crate anywhere else, and the row-wise pieces around it (LayerNorm,
//! exact-erf GELU, attention with softmax). The x86 paths are chosen at run time, so one binary
//! runs on any x86-64 or aarch64 CPU.
//!
//! By role: `linear` holds the layer and its portable F32 path, `bf16` the BF16 rounding, weight
//! packing and AVX-512 BF16 tile kernel, `amx` the same multiply on AMX tiles (Intel Xeons from
//! Sapphire Rapids on), `activation` the erf GELU and exp polynomials the
//! epilogues and the softmax use, `norm` LayerNorm and `attention` one head's attention. Each
//! keeps its AVX-512 bodies in its own `x86` module.

mod activation;
mod amx;
mod attention;
mod bf16;
mod linear;
mod norm;
pub mod quant;
mod shared;
#[cfg(test)]
mod tests;

#[cfg(target_arch = "x86_64")]
pub(crate) use activation::x86::exp_ps;
pub use activation::{exp, gelu, silu_mul};
pub use attention::{attention_head, attention_head_over, transpose_keys, Head, HeadRows, KeysT};
pub use bf16::{convert_to_bf16, from_bf16, to_bf16};
pub use linear::{column_share, Epilogue, Linear, Rows};
pub use norm::layer_norm;
pub use shared::Shared;

/// Output columns per packed weight panel; a thread's share of a matrix multiply is whole panels.
pub const PANEL: usize = 64;

/// One AVX-512 register of f32.
const LANES: usize = 16;

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

/// Whether the AVX-512 paths (BF16 dot products and the vectorised row kernels) run here:
/// the CPU has them and no lower level was asked for ([`crate::cpu`]).
pub fn avx512_bf16() -> bool {
    crate::cpu::has(crate::cpu::Level::Avx512Bf16)
}

/// Whether the AMX tile kernels run here: the CPU has AMX with BF16, the operating system
/// granted this process the tile state, and no lower level was asked for ([`crate::cpu`]).
pub fn amx() -> bool {
    crate::cpu::has(crate::cpu::Level::Amx)
}

/// Whether the AVX2 (with FMA) paths run here ([`crate::cpu`]).
pub fn avx2() -> bool {
    crate::cpu::has(crate::cpu::Level::Avx2)
}
