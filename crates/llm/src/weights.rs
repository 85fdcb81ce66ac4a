//! The model's weights: reading the GGUF (hyperparameters, chat template, tensors) and holding
//! the projections in the chosen [`WeightFormat`], once per process and read-only. The candle
//! forward ([`super::forward`]) and the CPU decoder ([`super::cpu_decode`]) compute with them.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::cpu_decode::{self, CpuDecoder, RawLayer};
use super::cpu_prefill::by_rows;
use super::template::ChatTemplate;
use super::GenerateError;
use crate::kernels::quant::DecodeMatrix;
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::{panels::Panels, BlockFormat, QMatrix};
use crate::kernels::{
    amx, avx2, avx512_bf16, column_share, convert_to_bf16, from_bf16, to_bf16, Epilogue, Linear,
    Precision, Rows, Shared, PANEL,
};

/// How the projection matrices (attention and MLP) are held in memory. The token embedding,
/// which doubles as the output head, stays as shipped (Q8_0).
///
/// Prefill is a GEMM and dense F32 wins; decode is one row per matmul and reads every weight,
/// so the fewest bytes win: the file's own Q4_1 blocks through our kernels, without candle's
/// per-op overhead. The default holds both (about 490 MB in all, fine for 135 M parameters).
/// The formats beside the two defaults were measured once against each other (the journal of
/// 2026-11-30 and 2026-12-02 has the figures); Q8_0 and F32 stay as the bridges to candle's
/// reference model in the forward's tests, F32PrefillQ8Decode as the CPU stand-in for the GPU
/// default's decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// Requantised to Q8_0 for prefill and decode.
    Q8_0,
    /// Dequantised to dense F32 for prefill and decode.
    F32,
    /// Dense F32 for prefill (GEMM-bound), Q8_0 for decode (one row: GEMV, bandwidth-bound),
    /// both on candle's ops.
    F32PrefillQ8Decode,
    /// Dense F32 for prefill (candle's GEMM), and decode on our own [`CpuDecoder`] over the file's
    /// own blocks (Q4_1 as SmolLM2 ships it, 40% fewer bytes per token than Q8_0), batched
    /// across requests. What the CPU default runs where the CPU has no AVX-512 BF16.
    F32PrefillQ4Decode,
    /// The CPU default: as [`WeightFormat::F32PrefillQ4Decode`], but the prefill projections
    /// multiply in BF16 with F32 accumulation (AVX-512 BF16 `vdpbf16ps`, the embedder's GEMM)
    /// where the CPU has it (1.6× faster prefill than F32 on a Zen 5, no faster on an Intel
    /// Xeon: docs/PERFORMANCE.md and the journal); elsewhere
    /// they stay dense F32 (candle's GEMM), bit for bit [`WeightFormat::F32PrefillQ4Decode`].
    /// Attention, norms, RoPE, softmax and the output head stay F32. [`Prefill`] says which ran.
    #[default]
    Bf16PrefillQ4Decode,
    /// The GPU default: dense F16 for prefill (tensor-core GEMMs through cuBLAS; activations are
    /// cast to F16 for the matmul and back), Q8_0 for decode (candle's quantised CUDA
    /// matrix-vector kernels read a quarter of F32's bytes per token).
    F16PrefillQ8Decode,
}

impl WeightFormat {
    /// Every format a name can pick (its `Debug` name, e.g. `F32PrefillQ8Decode`).
    pub const ALL: [WeightFormat; 6] = [
        WeightFormat::Q8_0,
        WeightFormat::F32,
        WeightFormat::F32PrefillQ8Decode,
        WeightFormat::F32PrefillQ4Decode,
        WeightFormat::Bf16PrefillQ4Decode,
        WeightFormat::F16PrefillQ8Decode,
    ];

    /// The format with this `Debug` name.
    pub fn named(name: &str) -> Option<WeightFormat> {
        Self::ALL.into_iter().find(|f| format!("{f:?}") == name)
    }

    /// The format [`Llama::load`](super::llama::Llama::load) picks for `device`: the measured CPU default above, or
    /// [`WeightFormat::F16PrefillQ8Decode`] on a GPU.
    pub fn for_device(device: &Device) -> WeightFormat {
        if device.is_cpu() {
            WeightFormat::default()
        } else {
            WeightFormat::F16PrefillQ8Decode
        }
    }
}

/// Hyperparameters from the GGUF `llama.*` metadata.
#[derive(Debug, Clone)]
pub(super) struct Config {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub context_length: usize,
}

/// How [`WeightFormat::Bf16PrefillQ4Decode`] runs its prefill projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefill {
    /// BF16 weights and activations, F32 accumulation, on AMX tiles (`tdpbf16ps`, Intel Xeons
    /// from Sapphire Rapids on, once the operating system granted the tile state): the
    /// [`Prefill::Bf16`] arithmetic, 16 × 16 × 32 products per instruction.
    Amx,
    /// BF16 weights and activations, F32 accumulation, on AVX-512 BF16.
    Bf16,
    /// The file's own Q4_1 weights against activations rounded to 8 bits per block of 32
    /// (decode's arithmetic), integer dot products on AVX2
    /// ([`crate::kernels::quant::panels`]): on CPUs with AVX2 but not AVX-512 BF16, about
    /// twice candle's F32 GEMM per projection (`ragscope-lab kernels`) in a seventh of the
    /// memory.
    Int8,
    /// Dense F32 on candle: every format but the BF16 one, and the BF16 one on a CPU with
    /// neither (or when [`PrefillKernel::ForceF32`] asked for it, or the projections do not
    /// ship as Q4_1).
    F32,
    /// Weights and activations rounded to BF16 as the BF16 path rounds them, multiplied in F32
    /// on the portable GEMM ([`PrefillKernel::Emulate`]): the BF16 path's numerics (a product of
    /// two BF16 values is exact in F32) on any CPU, at F32 speed or worse. For measuring the
    /// BF16 tolerance where the CPU lacks the instructions.
    Bf16Emulated,
}

impl Prefill {
    /// As the `prefill` span's `rag.prefill.precision` says it.
    pub fn name(self) -> &'static str {
        match self {
            Prefill::Amx => "bf16-amx",
            Prefill::Bf16 => "bf16",
            Prefill::Int8 => "int8",
            Prefill::F32 => "f32",
            Prefill::Bf16Emulated => "bf16-emulated",
        }
    }
}

/// What [`WeightFormat::Bf16PrefillQ4Decode`] asks of the CPU at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillKernel {
    /// BF16 on AMX tiles where the CPU has them and they were granted, else BF16 where the CPU
    /// has AVX-512 BF16, else the int8 GEMM where it has AVX2 and the projections ship as
    /// Q4_1, else the F32 fallback.
    #[default]
    Detect,
    /// BF16 on AVX-512 BF16 even where AMX would run (the AMX tests' comparison); where the CPU
    /// lacks AVX-512 BF16, as [`PrefillKernel::Detect`].
    Bf16,
    /// The F32 fallback even where a faster kernel would run (the fallback's test).
    ForceF32,
    /// [`Prefill::Bf16Emulated`].
    Emulate,
    /// The int8 GEMM wherever it can run, AVX-512 BF16 or not (its tests on every CPU).
    Int8,
}

impl PrefillKernel {
    /// What a BF16-prefill format gets with this choice on this CPU, for projections shipped
    /// as Q4_1 (`q4_1`) or not. `--cpu-level` caps what is detected.
    pub fn resolve(self, q4_1: bool) -> Prefill {
        let int8 = q4_1 && avx2();
        match self {
            PrefillKernel::Detect if amx() => Prefill::Amx,
            PrefillKernel::Detect | PrefillKernel::Bf16 if avx512_bf16() => Prefill::Bf16,
            PrefillKernel::Detect | PrefillKernel::Bf16 | PrefillKernel::Int8 if int8 => {
                Prefill::Int8
            }
            PrefillKernel::Detect
            | PrefillKernel::Bf16
            | PrefillKernel::Int8
            | PrefillKernel::ForceF32 => Prefill::F32,
            PrefillKernel::Emulate => Prefill::Bf16Emulated,
        }
    }
}

/// A projection matrix in the form its kernel reads.
#[derive(Clone)]
enum Matmul {
    Candle(QMatMul),
    /// The shared BF16 GEMM (or its emulation), split by output columns over candle's threads.
    Linear(Arc<Bf16Proj>),
    /// The Q4_1 × int8 GEMM ([`Prefill::Int8`]).
    #[cfg(target_arch = "x86_64")]
    Int8(Arc<Panels>),
}

impl Matmul {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Matmul::Candle(m) => m.forward(x),
            Matmul::Linear(l) => l.forward(x),
            #[cfg(target_arch = "x86_64")]
            Matmul::Int8(p) => {
                let (m, k) = x.dims2()?;
                let a = x.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; m * p.out_features()];
                if k != p.in_features() {
                    candle_core::bail!(
                        "[{m}, {k}] rows for a [{}, {}] projection",
                        p.out_features(),
                        p.in_features()
                    );
                }
                p.forward_rows(&a, m, &mut out, None);
                Tensor::from_vec(out, (m, p.out_features()), x.device())
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Matmul::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Matmul::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
            Matmul::Linear(l) => l.bytes(),
            #[cfg(target_arch = "x86_64")]
            Matmul::Int8(p) => p.size_in_bytes(),
        }
    }
}

/// A projection for the embedder's [`Linear`] (zero bias: llama projections have none).
pub(crate) struct Bf16Proj {
    linear: Linear,
    /// Round the input rows to BF16 before an F32 multiply ([`Prefill::Bf16Emulated`]).
    emulate: bool,
    k: usize,
}

impl Bf16Proj {
    /// `dense` is `[n, k]` F32, for `prefill` ([`Prefill::Amx`], [`Prefill::Bf16`] or
    /// [`Prefill::Bf16Emulated`]). Emulated, the weights are rounded to BF16 and kept in F32.
    pub(crate) fn new(dense: &Tensor, prefill: Prefill) -> candle_core::Result<Bf16Proj> {
        let emulate = prefill == Prefill::Bf16Emulated;
        let (n, k) = dense.dims2()?;
        let mut w = dense.flatten_all()?.to_vec1::<f32>()?;
        let precision = if emulate {
            for x in &mut w {
                *x = from_bf16(to_bf16(*x));
            }
            Precision::F32
        } else {
            Precision::Bf16
        };
        let mut linear = Linear::new(&w, &vec![0.0; n], n, k, precision);
        if !emulate && linear.precision() != Precision::Bf16 {
            candle_core::bail!("[{n}, {k}] cannot be packed for the BF16 kernel");
        }
        if prefill != Prefill::Amx {
            linear = linear.without_tiles();
        } else if !linear.on_tiles() {
            candle_core::bail!("[{n}, {k}] cannot run on AMX tiles");
        }
        Ok(Bf16Proj { linear, emulate, k })
    }

    fn bytes(&self) -> usize {
        let elem = match self.linear.precision() {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        };
        self.linear.out_features() * self.k * elem
    }

    /// `x` `(m, k)` F32 → `(m, n)` F32, through [`Bf16Proj::forward_rows`].
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, _) = x.dims2()?;
        let a = x.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; m * self.linear.out_features()];
        self.forward_rows(&a, m, &mut out, None)?;
        Tensor::from_vec(out, (m, self.linear.out_features()), x.device())
    }

    /// `out = x Wᵀ (+ residual)` for the `m` rows of `x` `(m, k)`; `out` and `residual` are
    /// `(m, n)`. The work is split into (column panel, block of rows) items over candle's
    /// thread pool, so a matrix of few panels still keeps every thread busy. Each output
    /// element sums its `k` products in one fixed order whatever `m` is, so this gives a row
    /// the same result in any chunking of the prompt.
    pub(crate) fn forward_rows(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        residual: Option<&[f32]>,
    ) -> candle_core::Result<()> {
        let (n, k) = (self.linear.out_features(), self.k);
        if x.len() != m * k || out.len() != m * n || residual.is_some_and(|r| r.len() != m * n) {
            candle_core::bail!("[{m}, {k}] rows for a [{n}, {k}] projection: wrong sizes");
        }
        if self.emulate {
            let emulated = x.iter().map(|v| from_bf16(to_bf16(*v))).collect::<Vec<_>>();
            self.gemm(Rows::F32(&emulated), m, out, residual);
            return Ok(());
        }
        // The rows in BF16, converted block by block over the pool into a buffer this thread
        // keeps: a fresh one was zeroed and then filled on one core, for every projection.
        BF16_ROWS.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < x.len() {
                buf.resize(x.len(), 0);
            }
            by_rows(&mut buf[..x.len()], k, ROW_BLOCK, |r0, rows| {
                convert_to_bf16(&x[r0 * k..][..rows.len()], rows)
            });
            self.gemm(Rows::Bf16(&buf[..x.len()]), m, out, residual);
        });
        Ok(())
    }

    /// `out = rows Wᵀ (+ residual)` over the pool, by (column panel, block of rows) items.
    fn gemm(&self, rows: Rows<'_>, m: usize, out: &mut [f32], residual: Option<&[f32]>) {
        let (n, k) = (self.linear.out_features(), self.k);
        let panels = n.div_ceil(PANEL);
        let blocks = m.div_ceil(ROW_BLOCK);
        let dst = Shared::new(out);
        let item = |i: usize| {
            let (cols, r0) = (column_share(n, i / blocks, panels), i % blocks * ROW_BLOCK);
            let r1 = (r0 + ROW_BLOCK).min(m);
            let part = match rows {
                Rows::Bf16(a) => Rows::Bf16(&a[r0 * k..r1 * k]),
                Rows::F32(a) => Rows::F32(&a[r0 * k..r1 * k]),
            };
            let epilogue = match residual {
                Some(res) => Epilogue::Add(&res[r0 * n..r1 * n]),
                None => Epilogue::None,
            };
            // SAFETY: `out` is `m * n` f32; each item writes only its own rows × columns.
            unsafe {
                self.linear
                    .forward_columns(part, r1 - r0, dst.ptr().add(r0 * n), cols, epilogue)
            }
        };
        candle_core::utils::barrier_pool()
            .execute_chunked(panels * blocks, |items| items.for_each(item));
    }
}

thread_local! {
    /// Prefill rows in BF16 ([`Bf16Proj::forward_rows`]), kept at the largest size seen.
    static BF16_ROWS: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows per work item of [`Bf16Proj::forward_rows`]: a multiple of the AVX-512 kernel's 6-row
/// tile and of the AMX kernel's 32-row block.
const ROW_BLOCK: usize = 96;

/// One projection, held twice when prefill and decode prefer different formats.
pub(super) struct Proj {
    prefill: Matmul,
    decode: Matmul,
}

impl Proj {
    pub fn forward(&self, x: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
        if rows > 1 {
            self.prefill.forward(x)
        } else {
            self.decode.forward(x)
        }
    }

    /// The prefill projection on host rows: `out = x Wᵀ (+ residual)`, `x` `(m, k)`, `out`
    /// and `residual` `(m, n)`.
    pub fn prefill_rows(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        residual: Option<&[f32]>,
    ) -> candle_core::Result<()> {
        match &self.prefill {
            Matmul::Linear(l) => l.forward_rows(x, m, out, residual),
            #[cfg(target_arch = "x86_64")]
            Matmul::Int8(p) => {
                let (n, k) = (p.out_features(), p.in_features());
                if x.len() != m * k
                    || out.len() != m * n
                    || residual.is_some_and(|r| r.len() != m * n)
                {
                    candle_core::bail!("[{m}, {k}] rows for a [{n}, {k}] projection: wrong sizes");
                }
                p.forward_rows(x, m, out, residual);
                Ok(())
            }
            Matmul::Candle(_) => {
                let k = x.len() / m.max(1);
                let y = self
                    .prefill
                    .forward(&Tensor::from_slice(x, (m, k), &Device::Cpu)?)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                if y.len() != out.len() {
                    candle_core::bail!("a projection of {} values into {}", y.len(), out.len());
                }
                match residual {
                    Some(res) => {
                        for ((o, y), r) in out.iter_mut().zip(&y).zip(res) {
                            *o = r + y;
                        }
                    }
                    None => out.copy_from_slice(&y),
                }
                Ok(())
            }
        }
    }
}

pub(super) struct Layer {
    pub attn_norm: Tensor,
    /// q, k and v stacked row-wise: one matmul instead of three per step.
    pub qkv: Proj,
    pub attn_out: Proj,
    pub ffn_norm: Tensor,
    /// gate and up stacked row-wise.
    pub gate_up: Proj,
    pub down: Proj,
}

/// Everything read from the GGUF, converted to the chosen [`WeightFormat`]; read-only.
pub(super) struct Weights {
    /// Token embedding, Q8_0 as shipped; also the output head when the model ties them.
    pub embed: Arc<QTensor>,
    pub lm_head: QMatMul,
    pub layers: Vec<Layer>,
    pub final_norm: Tensor,
    /// Decode without candle ops (the `…Q4Decode` formats on the CPU).
    pub decoder: Option<Arc<CpuDecoder>>,
    /// How the prefill projections multiply.
    pub prefill: Prefill,
}

impl Weights {
    #[allow(clippy::too_many_arguments)] // the GGUF's parts, each used once
    pub fn build(
        cfg: &Config,
        raw_layers: Vec<[QTensor; 9]>,
        embed: QTensor,
        output: Option<QTensor>,
        final_norm: QTensor,
        format: WeightFormat,
        kernel: PrefillKernel,
        device: &Device,
        rope: (&Tensor, &Tensor),
    ) -> candle_core::Result<Weights> {
        let prefill = if format == WeightFormat::Bf16PrefillQ4Decode && device.is_cpu() {
            let q4_1 = raw_layers.iter().all(|[_, q, k, v, o, _, gate, up, down]| {
                [q, k, v, o, gate, up, down]
                    .iter()
                    .all(|t| t.dtype() == GgmlDType::Q4_1)
            });
            kernel.resolve(q4_1)
        } else {
            Prefill::F32
        };
        let q4_decode = matches!(
            format,
            WeightFormat::F32PrefillQ4Decode | WeightFormat::Bf16PrefillQ4Decode
        );
        let decoder = if q4_decode && device.is_cpu() {
            let raw: Vec<RawLayer<'_>> = raw_layers
                .iter()
                .map(
                    |[attn_norm, q, k, v, o, ffn_norm, gate, up, down]| RawLayer {
                        attn_norm,
                        q,
                        k,
                        v,
                        o,
                        ffn_norm,
                        gate,
                        up,
                        down,
                    },
                )
                .collect();
            let dims = cpu_decode::Dims {
                n_head: cfg.n_head,
                n_kv_head: cfg.n_kv_head,
                head_dim: cfg.head_dim,
                ffn: cfg.ffn,
                rms_eps: cfg.rms_eps,
            };
            let table = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            Some(Arc::new(CpuDecoder::new(
                dims,
                &raw,
                &embed,
                output.as_ref(),
                &final_norm,
                (table(rope.0)?, table(rope.1)?),
            )?))
        } else {
            None
        };
        let vector = |t: &QTensor| t.dequantize(&Device::Cpu)?.to_device(device);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, [attn_norm, q, k, v, o, ffn_norm, gate, up, down]) in raw_layers.iter().enumerate()
        {
            // The decoder's copy, which the int8 prefill shares where both are panels.
            let dec = decoder.as_ref().map(|d| &d.layers[i]);
            layers.push(Layer {
                attn_norm: vector(attn_norm)?,
                qkv: proj(&[q, k, v], dec.map(|l| &l.qkv), format, prefill, device)?,
                attn_out: proj(&[o], dec.map(|l| &l.attn_out), format, prefill, device)?,
                ffn_norm: vector(ffn_norm)?,
                gate_up: proj(
                    &[gate, up],
                    dec.map(|l| &l.gate_up),
                    format,
                    prefill,
                    device,
                )?,
                down: proj(&[down], dec.map(|l| &l.down), format, prefill, device)?,
            });
        }
        let embed = Arc::new(move_q(embed, device)?);
        let lm_head = match output {
            Some(o) => QMatMul::QTensor(Arc::new(move_q(o, device)?)),
            None => QMatMul::QTensor(embed.clone()),
        };
        Ok(Weights {
            embed,
            lm_head,
            layers,
            final_norm: vector(&final_norm)?,
            decoder,
            prefill,
        })
    }

    /// Bytes of weights one decode step reads: every projection in its decode format, the
    /// output head and the norms (the embedding lookup reads a single row, left out).
    pub fn decode_bytes(&self) -> usize {
        if let Some(decoder) = &self.decoder {
            return decoder.weight_bytes();
        }
        let vector = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let w = self;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.attn_out, &l.gate_up, &l.down]
                    .iter()
                    .map(|p| p.decode.bytes())
                    .sum::<usize>()
                    + vector(&l.attn_norm)
                    + vector(&l.ffn_norm)
            })
            .sum();
        layers + Matmul::Candle(w.lm_head.clone()).bytes() + vector(&w.final_norm)
    }
}

/// What the GGUF holds: hyperparameters, the chat template, and the tensors as shipped (on the
/// CPU), before [`Weights::build`] converts them.
pub(super) struct Gguf {
    pub cfg: Config,
    pub template: ChatTemplate,
    /// `tokenizer.ggml.eos_token_id`, when the file names one.
    pub eos_token_id: Option<u32>,
    pub embed: QTensor,
    /// The output head, when not tied to the embedding.
    pub output: Option<QTensor>,
    pub final_norm: QTensor,
    /// Per layer: attn_norm, q, k, v, output, ffn_norm, gate, up, down.
    pub layers: Vec<[QTensor; 9]>,
}

pub(super) fn load_err(path: &Path, e: impl std::fmt::Display) -> GenerateError {
    GenerateError::Load(format!("{}: {e}", path.display()))
}

/// Reads the llama GGUF at `gguf_path`: its metadata, checked, and every tensor.
pub(super) fn read_gguf(gguf_path: &Path) -> Result<Gguf, GenerateError> {
    let file = std::fs::File::open(gguf_path).map_err(|e| load_err(gguf_path, e))?;
    let mut reader = BufReader::new(file);
    let ct = gguf_file::Content::read(&mut reader).map_err(|e| load_err(gguf_path, e))?;
    let md = |key: &str| {
        ct.metadata
            .get(key)
            .ok_or_else(|| load_err(gguf_path, format!("metadata has no {key}")))
    };
    let md_usize = |key: &str| -> Result<usize, GenerateError> {
        md(key)?
            .to_u64()
            .map(|v| v as usize)
            .map_err(|e| load_err(gguf_path, format!("{key}: {e}")))
    };
    let md_f32 = |key: &str| -> Result<f32, GenerateError> {
        md(key)?
            .to_f32()
            .map_err(|e| load_err(gguf_path, format!("{key}: {e}")))
    };
    let arch = md("general.architecture")?
        .to_string()
        .map_err(|e| load_err(gguf_path, e))?;
    if arch != "llama" {
        return Err(load_err(
            gguf_path,
            format!("architecture {arch} is not llama"),
        ));
    }
    let n_head = md_usize("llama.attention.head_count")?.max(1);
    let hidden = md_usize("llama.embedding_length")?;
    let mut cfg = Config {
        n_layer: md_usize("llama.block_count")?,
        n_head,
        n_kv_head: md_usize("llama.attention.head_count_kv")?,
        head_dim: hidden / n_head,
        ffn: 0,
        rms_eps: md_f32("llama.attention.layer_norm_rms_epsilon")?,
        rope_base: md_f32("llama.rope.freq_base").unwrap_or(10_000.0),
        context_length: md_usize("llama.context_length")?,
    };
    if cfg.n_kv_head == 0
        || !cfg.n_head.is_multiple_of(cfg.n_kv_head)
        || !cfg.head_dim.is_multiple_of(2)
    {
        return Err(load_err(gguf_path, "inconsistent head counts"));
    }
    let template = ChatTemplate::parse(
        ct.metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str),
    )?;

    let cpu = Device::Cpu;
    let mut tensor = |name: &str| {
        ct.tensor(&mut reader, name, &cpu)
            .map_err(|e| load_err(gguf_path, e))
    };
    let embed = tensor("token_embd.weight")?;
    let final_norm = tensor("output_norm.weight")?;
    // SmolLM2 ties the output head to the embedding; other llamas ship `output.weight`.
    let output = tensor("output.weight").ok();
    let mut raw_layers = Vec::with_capacity(cfg.n_layer);
    for i in 0..cfg.n_layer {
        let mut t = |suffix: &str| tensor(&format!("blk.{i}.{suffix}.weight"));
        raw_layers.push([
            t("attn_norm")?,
            t("attn_q")?,
            t("attn_k")?,
            t("attn_v")?,
            t("attn_output")?,
            t("ffn_norm")?,
            t("ffn_gate")?,
            t("ffn_up")?,
            t("ffn_down")?,
        ]);
    }
    cfg.ffn = raw_layers
        .first()
        .map(|l| l[6].shape().dims()[0])
        .unwrap_or(0);
    let eos_token_id = ct
        .metadata
        .get("tokenizer.ggml.eos_token_id")
        .and_then(|v| v.to_u32().ok());
    Ok(Gguf {
        cfg,
        template,
        eos_token_id,
        embed,
        output,
        final_norm,
        layers: raw_layers,
    })
}

impl Gguf {
    /// The tensor the GGUF file names `name` (`token_embd.weight`, `output_norm.weight`,
    /// `blk.3.attn_k.weight`, …).
    pub fn tensor_mut(&mut self, name: &str) -> Option<&mut QTensor> {
        const PER_LAYER: [&str; 9] = [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ];
        match name {
            "token_embd.weight" => Some(&mut self.embed),
            "output_norm.weight" => Some(&mut self.final_norm),
            "output.weight" => self.output.as_mut(),
            _ => {
                let (layer, part) = name.strip_prefix("blk.")?.split_once('.')?;
                let part = part.strip_suffix(".weight")?;
                let j = PER_LAYER.iter().position(|p| *p == part)?;
                self.layers
                    .get_mut(layer.parse::<usize>().ok()?)
                    .map(|l| &mut l[j])
            }
        }
    }
}

/// Moves a CPU tensor onto `device` with its quantisation unchanged.
fn move_q(t: QTensor, device: &Device) -> candle_core::Result<QTensor> {
    if device.is_cpu() {
        return Ok(t);
    }
    let storage = QStorage::from_data(t.data()?, device, t.dtype())?;
    QTensor::new(storage, t.shape().clone())
}

/// Stacks the row-major matrices `parts` (each `(rows_i, k)`) into one `(Σ rows_i, k)` projection
/// in `format`, its prefill multiplying as `prefill` says.
/// `parts` stacked in the forms `format` and `prefill` ask for; `decoded` is the decoder's copy
/// of the same matrix, if it has one.
fn proj(
    parts: &[&QTensor],
    decoded: Option<&DecodeMatrix>,
    format: WeightFormat,
    prefill: Prefill,
    device: &Device,
) -> candle_core::Result<Proj> {
    let cpu = Device::Cpu;
    let dense = || -> candle_core::Result<Tensor> {
        let ts = parts
            .iter()
            .map(|p| p.dequantize(&cpu))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&ts, 0)
    };
    let q8 = |dense: &Tensor| -> candle_core::Result<QMatMul> {
        Ok(QMatMul::QTensor(Arc::new(QTensor::quantize_onto(
            dense,
            GgmlDType::Q8_0,
            device,
        )?)))
    };
    let f32 = |dense: Tensor| -> candle_core::Result<QMatMul> {
        Ok(QMatMul::Tensor(dense.to_device(device)?))
    };
    let (prefill, decode) = match format {
        WeightFormat::Q8_0 => {
            let m = q8(&dense()?)?;
            (m.clone(), m)
        }
        WeightFormat::F32 => {
            let m = f32(dense()?)?;
            (m.clone(), m)
        }
        WeightFormat::F32PrefillQ8Decode => {
            let d = dense()?;
            (f32(d.clone())?, q8(&d)?)
        }
        // Decode runs on `CpuDecoder`'s own copy; a one-token prefill chunk takes the F32 path.
        WeightFormat::F32PrefillQ4Decode => {
            let m = f32(dense()?)?;
            (m.clone(), m)
        }
        // Only the BF16 copy when it runs: a one-token chunk takes it too, so a prompt's rows
        // come out the same however it is chunked.
        WeightFormat::Bf16PrefillQ4Decode => match prefill {
            Prefill::F32 => {
                let m = f32(dense()?)?;
                (m.clone(), m)
            }
            #[cfg(target_arch = "x86_64")]
            Prefill::Int8 => {
                let panels = match decoded.and_then(DecodeMatrix::panels) {
                    Some(p) => p.clone(),
                    None => Arc::new(Panels::pack(&QMatrix::from_qtensors(parts)?)),
                };
                if panels.format() != BlockFormat::Q4_1 {
                    candle_core::bail!("the int8 prefill needs Q4_1, not {:?}", panels.format());
                }
                let m = Matmul::Int8(panels);
                return Ok(Proj {
                    prefill: m.clone(),
                    decode: m,
                });
            }
            #[cfg(not(target_arch = "x86_64"))]
            Prefill::Int8 => unreachable!("the int8 prefill resolves only where AVX2 runs"),
            Prefill::Amx | Prefill::Bf16 | Prefill::Bf16Emulated => {
                let m = Matmul::Linear(Arc::new(Bf16Proj::new(&dense()?, prefill)?));
                return Ok(Proj {
                    prefill: m.clone(),
                    decode: m,
                });
            }
        },
        WeightFormat::F16PrefillQ8Decode => {
            let d = dense()?;
            let f16 = QMatMul::TensorF16(d.to_dtype(DType::F16)?.to_device(device)?);
            (f16, q8(&d)?)
        }
    };
    Ok(Proj {
        prefill: Matmul::Candle(prefill),
        decode: Matmul::Candle(decode),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{model, model_path};

    /// Each choice resolves by the kernels this CPU runs at the level in force: the test
    /// command runs this at every level the CPU has, so on an AMX machine it sees AMX, then
    /// each fallback below it.
    #[test]
    fn prefill_kernels_resolve_by_what_this_cpu_runs() {
        use PrefillKernel as K;
        let int8 = if avx2() { Prefill::Int8 } else { Prefill::F32 };
        let vector = if avx512_bf16() { Prefill::Bf16 } else { int8 };
        let detected = if amx() { Prefill::Amx } else { vector };
        assert_eq!(K::Detect.resolve(true), detected);
        assert_eq!(K::Bf16.resolve(true), vector);
        assert_eq!(K::Int8.resolve(true), int8);
        assert_eq!(K::ForceF32.resolve(true), Prefill::F32);
        assert_eq!(K::Emulate.resolve(true), Prefill::Bf16Emulated);
        // Projections not shipped as Q4_1 have no int8 path.
        let no_q4 = |p: Prefill| if p == Prefill::Int8 { Prefill::F32 } else { p };
        assert_eq!(K::Detect.resolve(false), no_q4(detected));
        assert_eq!(K::Bf16.resolve(false), no_q4(vector));
        assert_eq!(K::Int8.resolve(false), Prefill::F32);
    }

    #[test]
    fn decode_weight_bytes_counts_the_shipped_projections_the_head_and_the_norms() {
        let Some(model) = model() else { return };
        assert_eq!(model.weight_format(), WeightFormat::Bf16PrefillQ4Decode);
        let mut reader =
            BufReader::new(std::fs::File::open(model_path().expect("the model file")).unwrap());
        let ct = gguf_file::Content::read(&mut reader).unwrap();
        let mut expected = 0;
        for (name, info) in &ct.tensor_infos {
            let elems = info.shape.elem_count();
            expected += if name.ends_with("norm.weight") {
                elems * 4
            } else if name.starts_with("blk.") {
                assert_eq!(info.ggml_dtype, GgmlDType::Q4_1);
                elems / 32 * 20 // Q4_1: 32 weights in 20 bytes
            } else {
                assert_eq!(name, "token_embd.weight", "untied head?");
                assert_eq!(info.ggml_dtype, GgmlDType::Q8_0);
                elems / 32 * 34
            };
        }
        assert_eq!(model.decode_weight_bytes(), expected);
    }
}
