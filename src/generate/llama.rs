//! SmolLM2-135M-Instruct (llama architecture) from its GGUF file: our own forward pass on candle
//! ops, a KV cache preallocated per request, ChatML prompts and streamed generation.
//!
//! The weights are read once and shared by every request; a request prefills its prompt in
//! chunks and then decodes one token per step, writing keys and values in place (candle's
//! quantized llama copies its whole cache at every step) and attending in plain CPU loops.
//! On a GPU the same forward runs on candle's CUDA ops, with weights in
//! [`WeightFormat::F16PrefillQ8Decode`] and the KV cache allocated on the device; CUDA events
//! time prefill and sampled decode steps ([`gpu`](crate::telemetry::gpu)).

use std::borrow::Cow;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use opentelemetry::KeyValue;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenizers::Tokenizer;

use super::batch::{Batcher, Session};
use super::cpu_decode::{self, CpuDecoder, HostKv, Partial, RawLayer};
use super::tokenizer::{TokenBytes, Utf8Stream};
use super::{
    ChatMessage, FinishReason, Flow, GenerateError, GenerateRequest, Generated, Generator,
    Sampling, TokenTrace,
};
use crate::telemetry::clock;
use crate::telemetry::gpu::{self, GpuTimer};
use crate::telemetry::span::Stage;

/// The model name clients see.
pub const MODEL_ID: &str = "SmolLM2-135M-Instruct";

/// Prompts are prefilled in chunks of this many tokens, which bounds the attention scores of one
/// chunk to `heads × PREFILL_CHUNK × context` floats (≈ 150 MB at 8192 positions) while keeping
/// the matmuls large enough to run as GEMMs.
const PREFILL_CHUNK: usize = 512;

/// How the projection matrices (attention and MLP) are held in memory. The token embedding,
/// which doubles as the output head, stays as shipped (Q8_0).
///
/// Measured on the 2-core dev box (AVX-512 VNNI, release build, default target CPU, idle):
/// `bench_weight_formats`, a 598-token RAG prompt then 128 greedy tokens, medians of 3.
///
/// | format                   | prefill tok/s | decode tok/s (598→726 ctx) |
/// |--------------------------|---------------|----------------------------|
/// | Q4_1 as shipped          | 29            | 26                         |
/// | Q8_0 everywhere          | 175           | 81                         |
/// | F32 everywhere           | 375           | 41                         |
/// | F32 prefill, Q8_0 decode | 417           | 90                         |
///
/// | F32 prefill, Q4_1 decode on [`CpuDecoder`] (the default, later) | 331-449 | 114-142 |
///
/// Other idle runs moved these by about ±10 % (F32 prefill up to 447, Q8_0 decode up to 91).
/// Prefill is a GEMM and dense F32 wins; decode is one row per matmul and reads every weight,
/// so the fewest bytes win: the file's own Q4_1 blocks through our kernels, without candle's
/// per-op overhead. The default holds both (≈ 490 MB in all, fine for 135 M parameters).
/// Decode used to be 56 tok/s in both Q8_0 formats before the `DecodeAttention` loops replaced
/// candle's matmul/softmax/matmul for the single decode row (per-token cost at 20 / 600 / 1200
/// positions of context went from 11.8 / 17.1 / 21.9 ms to 10.1 / 12.5 / 12.9 ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The file's own quantisation (Q4_1): slow kernels, kept for comparison.
    Shipped,
    /// Requantised to Q8_0 for prefill and decode.
    Q8_0,
    /// Dequantised to dense F32 for prefill and decode.
    F32,
    /// Dense F32 for prefill (GEMM-bound), Q8_0 for decode (one row: GEMV, bandwidth-bound),
    /// both on candle's ops.
    F32PrefillQ8Decode,
    /// The CPU default: dense F32 for prefill on candle, and decode on our own
    /// [`CpuDecoder`] over the file's own blocks (Q4_1 as SmolLM2 ships it, 40% fewer bytes per
    /// token than Q8_0), batched across requests.
    #[default]
    F32PrefillQ4Decode,
    /// The GPU default: dense F16 for prefill (tensor-core GEMMs through cuBLAS; activations are
    /// cast to F16 for the matmul and back), Q8_0 for decode (candle's quantised CUDA
    /// matrix-vector kernels read a quarter of F32's bytes per token).
    F16PrefillQ8Decode,
}

impl WeightFormat {
    /// The format [`Llama::load`] picks for `device`: the measured CPU default above, or
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
struct Config {
    n_layer: usize,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    ffn: usize,
    rms_eps: f32,
    rope_base: f32,
    context_length: usize,
}

/// One projection, held twice when prefill and decode prefer different formats.
struct Proj {
    prefill: QMatMul,
    decode: QMatMul,
}

impl Proj {
    fn forward(&self, x: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
        if rows > 1 {
            self.prefill.forward(x)
        } else {
            self.decode.forward(x)
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    /// q, k and v stacked row-wise: one matmul instead of three per step.
    qkv: Proj,
    attn_out: Proj,
    ffn_norm: Tensor,
    /// gate and up stacked row-wise.
    gate_up: Proj,
    down: Proj,
}

/// Everything read from the GGUF, converted to the chosen [`WeightFormat`]; read-only.
struct Weights {
    /// Token embedding, Q8_0 as shipped; also the output head when the model ties them.
    embed: Arc<QTensor>,
    lm_head: QMatMul,
    layers: Vec<Layer>,
    final_norm: Tensor,
    /// Decode without candle ops ([`WeightFormat::F32PrefillQ4Decode`] on the CPU).
    decoder: Option<Arc<CpuDecoder>>,
}

impl Weights {
    #[allow(clippy::too_many_arguments)] // the GGUF's parts, each used once
    fn build(
        cfg: &Config,
        raw_layers: Vec<[QTensor; 9]>,
        embed: QTensor,
        output: Option<QTensor>,
        final_norm: QTensor,
        format: WeightFormat,
        device: &Device,
        rope: (&Tensor, &Tensor),
    ) -> candle_core::Result<Weights> {
        let decoder = if format == WeightFormat::F32PrefillQ4Decode && device.is_cpu() {
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
        for [attn_norm, q, k, v, o, ffn_norm, gate, up, down] in &raw_layers {
            layers.push(Layer {
                attn_norm: vector(attn_norm)?,
                qkv: proj(&[q, k, v], format, device)?,
                attn_out: proj(&[o], format, device)?,
                ffn_norm: vector(ffn_norm)?,
                gate_up: proj(&[gate, up], format, device)?,
                down: proj(&[down], format, device)?,
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
        })
    }
}

/// The keys and values of one request: per layer `(n_kv_head, capacity, head_dim)`, written in
/// place. Head-major so every head's keys are one contiguous run, as the attention matmuls (and
/// cuBLAS) want them.
/// On a GPU the cache is allocated there, once per request, and never copied.
struct KvCache {
    store: KvStore,
    len: usize,
    capacity: usize,
    /// Bytes counted in the KV-cache gauges while this cache lives.
    bytes: u64,
    on_gpu: bool,
}

enum KvStore {
    /// Candle tensors per layer: the GPU, and the formats that decode on candle's ops.
    Tensors { k: Vec<Tensor>, v: Vec<Tensor> },
    /// Plain host buffers (same layout) that [`CpuDecoder`] writes in place; prefill writes
    /// them through candle and reads them back for its attention.
    Host(HostKv),
}

impl KvCache {
    /// `host`: buffers for [`CpuDecoder`] instead of device tensors.
    fn new(
        cfg: &Config,
        capacity: usize,
        device: &Device,
        host: bool,
    ) -> candle_core::Result<KvCache> {
        let store = if host {
            KvStore::Host(HostKv::new(
                cfg.n_layer,
                cfg.n_kv_head,
                cfg.head_dim,
                capacity,
            ))
        } else {
            let shape = (cfg.n_kv_head, capacity, cfg.head_dim);
            let mut k = Vec::with_capacity(cfg.n_layer);
            let mut v = Vec::with_capacity(cfg.n_layer);
            for _ in 0..cfg.n_layer {
                k.push(Tensor::zeros(shape, DType::F32, device)?);
                v.push(Tensor::zeros(shape, DType::F32, device)?);
            }
            KvStore::Tensors { k, v }
        };
        let bytes = (2 * cfg.n_layer * cfg.n_kv_head * capacity * cfg.head_dim * 4) as u64;
        let on_gpu = !device.is_cpu();
        Self::account(bytes, capacity as u64, on_gpu, true);
        Ok(KvCache {
            store,
            len: 0,
            capacity,
            bytes,
            on_gpu,
        })
    }

    fn account(bytes: u64, tokens: u64, on_gpu: bool, add: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let usage = &crate::telemetry::metrics::KV_CACHE;
        let gpu = &crate::telemetry::gpu::memory::KV_CACHE_BYTES;
        if add {
            usage.bytes.fetch_add(bytes, Relaxed);
            usage.tokens.fetch_add(tokens, Relaxed);
            if on_gpu {
                gpu.fetch_add(bytes, Relaxed);
            }
        } else {
            usage.bytes.fetch_sub(bytes, Relaxed);
            usage.tokens.fetch_sub(tokens, Relaxed);
            if on_gpu {
                gpu.fetch_sub(bytes, Relaxed);
            }
        }
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        Self::account(self.bytes, self.capacity as u64, self.on_gpu, false);
    }
}

/// How the chat template renders a conversation (ChatML, optionally with a default system turn).
#[derive(Debug, Clone, PartialEq)]
struct ChatTemplate {
    /// Inserted as the first turn when the conversation does not start with a system message.
    default_system: Option<String>,
}

impl ChatTemplate {
    /// Recognises the GGUF's Jinja `tokenizer.chat_template`. We render it in Rust rather than
    /// run a template engine, so anything but ChatML is refused instead of mis-rendered.
    fn parse(template: Option<&str>) -> Result<ChatTemplate, GenerateError> {
        let Some(t) = template else {
            return Ok(ChatTemplate {
                default_system: None,
            });
        };
        let chatml = t.contains("<|im_start|>")
            && t.contains("<|im_end|>")
            && t.contains("message['role']")
            && t.contains("message['content']");
        if !chatml {
            return Err(GenerateError::Load(format!(
                "unsupported chat template (not ChatML): {t}"
            )));
        }
        let default_system = if t.contains("messages[0]['role'] != 'system'") {
            const OPEN: &str = "<|im_start|>system";
            let start = t.find(OPEN).ok_or_else(|| {
                GenerateError::Load("chat template inserts a system turn we cannot find".into())
            })? + OPEN.len();
            let body = &t[start..];
            let end = body.find("<|im_end|>").ok_or_else(|| {
                GenerateError::Load("chat template's system turn is not closed".into())
            })?;
            // The Jinja literal may spell the newline as an escape.
            let body = body[..end].replace("\\n", "\n");
            let body = body.strip_prefix('\n').unwrap_or(&body);
            Some(body.to_string())
        } else {
            None
        };
        Ok(ChatTemplate { default_system })
    }

    /// The (role, content) turns the template renders: the default system turn, if the
    /// conversation lacks one, then the messages.
    fn turns<'a>(
        &'a self,
        messages: &'a [ChatMessage],
    ) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let default = match (messages.first(), &self.default_system) {
            (Some(first), Some(system)) if first.role != "system" => {
                Some(("system", system.as_str()))
            }
            _ => None,
        };
        default.into_iter().chain(
            messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str())),
        )
    }

    /// The rendered text (what the Jinja template would produce), for tests.
    #[cfg(test)]
    fn render(&self, messages: &[ChatMessage]) -> String {
        let mut out = String::new();
        for (role, content) in self.turns(messages) {
            out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        out + "<|im_start|>assistant\n"
    }
}

/// SmolLM2 as a [`Generator`]: shared read-only weights, a KV cache per request.
pub struct Llama {
    cfg: Config,
    format: WeightFormat,
    weights: Weights,
    /// RoPE tables `(context_window, head_dim / 2)`, built once.
    cos: Tensor,
    sin: Tensor,
    device: Device,
    context_window: usize,
    tokenizer: Tokenizer,
    /// Same tokenizer, but control-token text inside message content stays plain text, so a
    /// user cannot forge `<|im_start|>` turns.
    content_tokenizer: Tokenizer,
    token_bytes: TokenBytes,
    template: ChatTemplate,
    im_start: u32,
    im_end: u32,
    newline: Vec<u32>,
    /// Generation stops at any of these (`<|im_end|>`, `<|endoftext|>`).
    eos: Vec<u32>,
    /// Batches the decode steps of concurrent requests (with the CPU decoder).
    batcher: Option<Batcher>,
    /// Prefills run one at a time: interleaved on the same cores they would all finish late,
    /// while in turn the first request's first token comes after one prefill, not several.
    /// Decode steps of other requests go on meanwhile.
    prefill_turn: std::sync::Mutex<()>,
    /// Held for each prefill layer and each batched decode step, handed over in arrival order:
    /// the two take turns on the cores instead of running at once, where candle's GEMM threads,
    /// its spinning pool and the decoder's threads oversubscribed two cores and slowed both
    /// two- to threefold.
    compute: Arc<parking_lot::FairMutex<()>>,
}

fn load_err(path: &Path, e: impl std::fmt::Display) -> GenerateError {
    GenerateError::Load(format!("{}: {e}", path.display()))
}

impl Llama {
    /// Loads the GGUF at `gguf_path` in the [`WeightFormat`] for `device`. The context window
    /// is `min(llama.context_length, max_context)`.
    pub fn load(
        gguf_path: &Path,
        tokenizer: Tokenizer,
        device: &Device,
        max_context: usize,
    ) -> Result<Llama, GenerateError> {
        Self::load_with_format(
            gguf_path,
            tokenizer,
            device,
            max_context,
            WeightFormat::for_device(device),
        )
    }

    /// Loads with the tokenizer rebuilt from the GGUF's own metadata.
    pub fn from_gguf(
        gguf_path: &Path,
        device: &Device,
        max_context: usize,
    ) -> Result<Llama, GenerateError> {
        let tokenizer = super::tokenizer::from_gguf_file(gguf_path)?;
        Self::load(gguf_path, tokenizer, device, max_context)
    }

    /// Loads with an explicit weight format (benchmarks and reference tests).
    pub fn load_with_format(
        gguf_path: &Path,
        tokenizer: Tokenizer,
        device: &Device,
        max_context: usize,
        format: WeightFormat,
    ) -> Result<Llama, GenerateError> {
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

        let window = cfg.context_length.min(max_context).max(1);
        let (cos, sin) = rope_tables(cfg.head_dim, cfg.rope_base, window, device)
            .map_err(|e| load_err(gguf_path, e))?;
        let weights = Weights::build(
            &cfg,
            raw_layers,
            embed,
            output,
            final_norm,
            format,
            device,
            (&cos, &sin),
        )
        .map_err(|e| load_err(gguf_path, e))?;

        let special = |name: &str| {
            tokenizer
                .token_to_id(name)
                .ok_or_else(|| GenerateError::Tokenizer(format!("vocabulary has no {name}")))
        };
        let im_start = special("<|im_start|>")?;
        let im_end = special("<|im_end|>")?;
        let mut eos = vec![im_end];
        if let Some(id) = tokenizer.token_to_id("<|endoftext|>") {
            eos.push(id);
        }
        if let Some(id) = ct
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.to_u32().ok())
        {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let mut content_tokenizer = tokenizer.clone();
        content_tokenizer.set_encode_special_tokens(true);
        let newline = encode(&content_tokenizer, "\n")?;
        let token_bytes = TokenBytes::new(&tokenizer);
        let compute = Arc::new(parking_lot::FairMutex::new(()));
        let batcher = weights
            .decoder
            .clone()
            .map(|d| Batcher::start(d, compute.clone()));
        Ok(Llama {
            batcher,
            prefill_turn: std::sync::Mutex::new(()),
            compute,
            cfg,
            format,
            weights,
            cos,
            sin,
            device: device.clone(),
            context_window: window,
            tokenizer,
            content_tokenizer,
            token_bytes,
            template,
            im_start,
            im_end,
            newline,
            eos,
        })
    }

    /// The weight format this instance was loaded with.
    pub fn weight_format(&self) -> WeightFormat {
        self.format
    }

    /// The tokenizer (with control tokens recognised in text).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Bytes of weights one decode step reads: every projection in its decode format, the
    /// output head and the norms (the embedding lookup reads a single row, left out). The
    /// memory bandwidth divided by this bounds decode tokens/s.
    pub fn decode_weight_bytes(&self) -> usize {
        if let Some(decoder) = &self.weights.decoder {
            return decoder.weight_bytes();
        }
        let matmul = |m: &QMatMul| match m {
            QMatMul::QTensor(q) => q.storage_size_in_bytes(),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        };
        let vector = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let w = &self.weights;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.attn_out, &l.gate_up, &l.down]
                    .iter()
                    .map(|p| matmul(&p.decode))
                    .sum::<usize>()
                    + vector(&l.attn_norm)
                    + vector(&l.ffn_norm)
            })
            .sum();
        layers + matmul(&w.lm_head) + vector(&w.final_norm)
    }

    /// Runs `tokens` at positions `cache.len..` through the model, appending to the cache.
    /// Returns the logits `(vocab,)` of the last position when `want_logits`.
    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        want_logits: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        let cfg = &self.cfg;
        let (t, pos) = (tokens.len(), cache.len);
        if t == 0 || pos + t > cache.capacity {
            candle_core::bail!(
                "{t} tokens at position {pos} do not fit a cache of {}",
                cache.capacity
            );
        }
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let len = pos + t;
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.weights.embed.embedding(&ids)?;
        // Rows of the tables for these positions, one per "batch" row (see the rope call).
        let cos = self.cos.narrow(0, pos, t)?.reshape((t, 1, hd / 2))?;
        let sin = self.sin.narrow(0, pos, t)?.reshape((t, 1, hd / 2))?;
        let mask = if t > 1 {
            Some(causal_mask(t, pos, &self.device)?)
        } else {
            None
        };
        let cap = cache.capacity;
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let _turn = self.compute.lock();
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let qkv = layer.qkv.forward(&h, t)?;
            // RoPE on q and k together. Laid out as (t, heads, 1, hd) with cos/sin (t, 1, hd/2),
            // each token is its own "batch" row with its own position.
            let qk =
                qkv.narrow(1, 0, (nh + nkv) * hd)?
                    .contiguous()?
                    .reshape((t, nh + nkv, 1, hd))?;
            let qk = candle_nn::rotary_emb::rope_i(&qk, &cos, &sin)?.squeeze(2)?;
            let k = qk.narrow(1, nh, nkv)?.transpose(0, 1)?.contiguous()?;
            let v = qkv
                .narrow(1, (nh + nkv) * hd, nkv * hd)?
                .reshape((t, nkv, hd))?
                .transpose(0, 1)?
                .contiguous()?;
            let q = qk.narrow(1, 0, nh)?;
            let y = match &mut cache.store {
                KvStore::Tensors { k: ks, v: vs } => {
                    ks[li].slice_set(&k, 1, pos)?;
                    vs[li].slice_set(&v, 1, pos)?;
                    attention(&q, &ks[li], &vs[li], len, mask.as_ref())?
                }
                KvStore::Host(kv) => {
                    write_host(&mut kv.k[li], &k, cap, pos)?;
                    write_host(&mut kv.v[li], &v, cap, pos)?;
                    let keys = read_host(&kv.k[li], (nkv, cap, hd), len)?;
                    let values = read_host(&kv.v[li], (nkv, cap, hd), len)?;
                    attention_ops(&q, &keys, &values, len, mask.as_ref())?
                }
            };
            x = (x + layer.attn_out.forward(&y, t)?)?;

            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
            let gu = layer.gate_up.forward(&h, t)?;
            let gate = candle_nn::ops::silu(&gu.narrow(1, 0, cfg.ffn)?)?;
            let m = (gate * gu.narrow(1, cfg.ffn, cfg.ffn)?)?;
            x = (x + layer.down.forward(&m, t)?)?;
        }
        cache.len = len;
        if !want_logits {
            return Ok(None);
        }
        let last = candle_nn::ops::rms_norm(
            &x.narrow(0, t - 1, 1)?,
            &self.weights.final_norm,
            cfg.rms_eps,
        )?;
        Ok(Some(self.weights.lm_head.forward(&last)?.squeeze(0)?))
    }

    /// Runs `token` at the next position of `cache` and puts the logits in `logits`: in the
    /// batcher's next step when the request has a `session`, else through
    /// [`Llama::forward`]. Returns the number of sequences the step ran for.
    fn decode_one(
        &self,
        session: Option<&mut Session<'_>>,
        cache: &mut KvCache,
        token: u32,
        logits: &mut Logits,
    ) -> candle_core::Result<usize> {
        match (session, &mut cache.store) {
            (Some(session), KvStore::Host(kv)) => {
                let mut buf = match std::mem::replace(logits, Logits::Host(Vec::new())) {
                    Logits::Host(buf) => buf,
                    Logits::Device(_) => Vec::new(),
                };
                let batch = session.step(kv, cache.len, token, &mut buf)?;
                cache.len += 1;
                *logits = Logits::Host(buf);
                Ok(batch)
            }
            _ => {
                let out = self.forward(&[token], cache, true)?;
                *logits = Logits::Device(out.expect("logits requested"));
                Ok(1)
            }
        }
    }

    /// Prefills `prompt` into `cache` in chunks; returns the last position's logits.
    fn prefill(&self, prompt: &[u32], cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let mut logits = None;
        let n_chunks = prompt.len().div_ceil(PREFILL_CHUNK);
        for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
            logits = self.forward(chunk, cache, i + 1 == n_chunks)?;
        }
        logits.ok_or_else(|| candle_core::Error::Msg("empty prompt".into()))
    }
}

/// Writes `x` `(n_kv_head, t, head_dim)` into a host cache `(n_kv_head, cap, head_dim)` at
/// positions `pos..pos + t`.
fn write_host(buf: &mut [f32], x: &Tensor, cap: usize, pos: usize) -> candle_core::Result<()> {
    let (nkv, t, hd) = x.dims3()?;
    let data = x.flatten_all()?.to_vec1::<f32>()?;
    for (g, rows) in data.chunks_exact(t * hd).enumerate().take(nkv) {
        buf[(g * cap + pos) * hd..][..t * hd].copy_from_slice(rows);
    }
    Ok(())
}

/// The first `len` positions of a host cache `(n_kv_head, cap, head_dim)` as a
/// `(n_kv_head, len, head_dim)` tensor.
fn read_host(
    buf: &[f32],
    (nkv, cap, hd): (usize, usize, usize),
    len: usize,
) -> candle_core::Result<Tensor> {
    let mut data = Vec::with_capacity(nkv * len * hd);
    for g in 0..nkv {
        data.extend_from_slice(&buf[g * cap * hd..][..len * hd]);
    }
    Tensor::from_vec(data, (nkv, len, hd), &Device::Cpu)
}

/// Attention of the queries `q` `(t, n_head, head_dim)` (positions `len - t..len`) over the
/// first `len` positions of a layer's cache; returns `(t, n_head * head_dim)`.
fn attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    len: usize,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (t, nh, hd) = q.dims3()?;
    if t == 1 && q.device().is_cpu() {
        let scale = 1.0 / (hd as f32).sqrt();
        return q.reshape((nh, hd))?.apply_op3_no_bwd(
            k_cache,
            v_cache,
            &DecodeAttention { len, scale },
        );
    }
    attention_ops(q, k_cache, v_cache, len, mask)
}

/// [`attention`] with candle's ops: any device, any number of queries.
fn attention_ops(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    len: usize,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (t, nh, hd) = q.dims3()?;
    let nkv = k_cache.dim(0)?;
    let scale = 1.0 / (hd as f64).sqrt();
    let keys = k_cache.narrow(1, 0, len)?;
    let values = v_cache.narrow(1, 0, len)?;
    // Grouped-query attention without repeating k/v: query head h uses kv head h / n_rep, so
    // (nh, t, hd) read as (nkv, n_rep * t, hd) lines every query row up with its own kv head
    // in one batched matmul.
    let q = q
        .transpose(0, 1)?
        .contiguous()?
        .reshape((nkv, nh / nkv * t, hd))?
        .affine(scale, 0.0)?;
    let att = q.matmul(&keys.t()?)?;
    let att = match mask {
        Some(mask) => att
            .reshape((nkv, nh / nkv, t, len))?
            .broadcast_add(mask)?
            .reshape((nkv, nh / nkv * t, len))?,
        None => att,
    };
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    att.matmul(&values)?
        .reshape((nh, t, hd))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((t, nh * hd))
}

/// One query token against the cache, in plain loops on the CPU. With a single query row the
/// matmul/softmax/matmul ops above cost ~190 µs per layer at 600 positions, almost all of it
/// thread dispatch and packing for tiny GEMMs; these loops do the same arithmetic in a
/// fraction of that. Inputs: q `(n_head, head_dim)`, caches `(n_kv_head, capacity, head_dim)`.
/// Long contexts are split into position ranges over candle's own worker threads (as
/// flash-decoding does: each range keeps its own softmax max and sum, merged at the end).
struct DecodeAttention {
    len: usize,
    scale: f32,
}

impl candle_core::CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        q: &candle_core::CpuStorage,
        q_l: &candle_core::Layout,
        k: &candle_core::CpuStorage,
        k_l: &candle_core::Layout,
        v: &candle_core::CpuStorage,
        v_l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        fn slice<'a>(
            s: &'a candle_core::CpuStorage,
            l: &candle_core::Layout,
        ) -> candle_core::Result<&'a [f32]> {
            match l.contiguous_offsets() {
                Some((a, b)) => Ok(&s.as_slice::<f32>()?[a..b]),
                None => candle_core::bail!("decode-attention wants contiguous inputs"),
            }
        }
        let (nh, hd) = q_l.shape().dims2()?;
        let (nkv, cap, khd) = k_l.shape().dims3()?;
        if khd != hd || v_l.shape().dims3()? != (nkv, cap, hd) || nh % nkv != 0 {
            candle_core::bail!("decode-attention: shapes {q_l:?} {k_l:?} {v_l:?}");
        }
        let len = self.len;
        if len == 0 || len > cap {
            candle_core::bail!("decode-attention: {len} positions in a cache of {cap}");
        }
        let data = (slice(q, q_l)?, slice(k, k_l)?, slice(v, v_l)?);
        let dims = (nh, nkv, cap, hd);

        let pool = candle_core::utils::barrier_pool();
        let n_threads = if len >= cpu_decode::PARALLEL_ATTENTION_MIN_LEN {
            pool.n_workers() + 1
        } else {
            1
        };
        let chunk = len.div_ceil(n_threads);
        let parts: Vec<std::sync::Mutex<Partial>> =
            (0..n_threads).map(|_| Default::default()).collect();
        let (q, k, v) = data;
        let work = |tid: usize| {
            let start = tid * chunk;
            if start < len {
                let mut p = parts[tid].lock().expect("no panics while held");
                p.attend(q, (k, v), dims, start..len.min(start + chunk), self.scale);
            }
        };
        if n_threads == 1 {
            work(0);
        } else {
            pool.execute(work);
        }
        let parts: Vec<Partial> = parts
            .into_iter()
            .map(|m| m.into_inner().expect("no panics while held"))
            .take(len.div_ceil(chunk))
            .collect();
        let mut out = vec![0f32; nh * hd];
        cpu_decode::merge(&parts, nh, hd, &mut out);
        Ok((
            candle_core::CpuStorage::F32(out),
            candle_core::Shape::from((1, nh * hd)),
        ))
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
/// in `format`.
fn proj(parts: &[&QTensor], format: WeightFormat, device: &Device) -> candle_core::Result<Proj> {
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
        WeightFormat::Shipped => {
            // Quantised blocks never span rows, so stacking rows is concatenating their bytes.
            let dtype = parts[0].dtype();
            let k = parts[0].shape().dims()[1];
            let mut bytes = Vec::new();
            let mut rows = 0;
            for p in parts {
                if p.dtype() != dtype || p.shape().dims()[1] != k {
                    candle_core::bail!("cannot stack {:?} with {:?}", p, parts[0]);
                }
                rows += p.shape().dims()[0];
                bytes.extend_from_slice(&p.data()?);
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), &cpu, dtype)?;
            let q = move_q(QTensor::new(storage, (rows, k))?, device)?;
            let m = QMatMul::QTensor(Arc::new(q));
            (m.clone(), m)
        }
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
        WeightFormat::F16PrefillQ8Decode => {
            let d = dense()?;
            let f16 = QMatMul::TensorF16(d.to_dtype(DType::F16)?.to_device(device)?);
            (f16, q8(&d)?)
        }
    };
    Ok(Proj { prefill, decode })
}

/// RoPE tables for the interleaved (GGUF llama) layout, computed as candle's quantized llama
/// does so the two agree bit for bit.
fn rope_tables(
    head_dim: usize,
    base: f32,
    positions: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let theta: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for &th in &theta {
            let a = p as f32 * th;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (positions, half), device)?,
        Tensor::from_vec(sin, (positions, half), device)?,
    ))
}

/// Additive causal mask `(t, pos + t)`: query `i` (at position `pos + i`) sees keys `..= pos + i`.
fn causal_mask(t: usize, pos: usize, device: &Device) -> candle_core::Result<Tensor> {
    let len = pos + t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..len).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(mask, (t, len), device)
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, GenerateError> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| GenerateError::Tokenizer(e.to_string()))
}

/// How many sequences a request's decode steps ran with.
#[derive(Default)]
struct BatchSizes {
    steps: usize,
    total: usize,
    max: usize,
}

impl BatchSizes {
    fn record(&mut self, batch: usize) {
        self.steps += 1;
        self.total += batch;
        self.max = self.max.max(batch);
    }
}

/// The last position's logits `(vocab,)`: a candle tensor (maybe on the GPU), or the host
/// buffer [`CpuDecoder`] wrote.
enum Logits {
    Device(Tensor),
    Host(Vec<f32>),
}

/// Picks each next token: greedy, or softmax(logits / temperature) sampling, optionally over the
/// nucleus (the most likely tokens whose probabilities first reach `top_p`), from a seeded RNG.
/// Buffers are reused across tokens; the nucleus is found without sorting the whole vocabulary.
struct Sampler {
    /// `None` means greedy.
    temperature: Option<f32>,
    /// Below 1: nucleus sampling.
    top_p: f32,
    rng: StdRng,
    probs: Vec<f32>,
    candidates: Vec<u32>,
    /// Tokens never picked (end-of-sequence when the request ignores it).
    banned: Vec<u32>,
}

impl Sampler {
    fn new(s: &Sampling) -> Sampler {
        let temperature = (s.temperature > 0.0).then_some(s.temperature as f32);
        let top_p = match s.top_p {
            Some(p) if p > 0.0 && p < 1.0 => p as f32,
            _ => 1.0,
        };
        Sampler {
            temperature,
            top_p,
            rng: StdRng::seed_from_u64(s.seed),
            probs: Vec::new(),
            candidates: Vec::new(),
            banned: Vec::new(),
        }
    }

    /// Never picks any of `tokens`: as if their logits were minus infinity.
    fn banning(mut self, tokens: &[u32]) -> Sampler {
        self.banned = tokens.to_vec();
        self
    }

    fn sample(&mut self, logits: &Logits) -> candle_core::Result<u32> {
        match logits {
            Logits::Device(t) => {
                if self.temperature.is_none() {
                    // Greedy on the device: only the winner's index comes back.
                    let best = t.argmax(0)?.to_scalar::<u32>()?;
                    if !self.banned.contains(&best) {
                        return Ok(best);
                    }
                }
                self.sample_host(&t.to_vec1::<f32>()?)
            }
            Logits::Host(v) => self.sample_host(v),
        }
    }

    fn sample_host(&mut self, logits: &[f32]) -> candle_core::Result<u32> {
        let Some(temperature) = self.temperature else {
            // The first largest of the tokens not banned.
            return (0..logits.len() as u32)
                .filter(|i| !self.banned.contains(i))
                .fold(None, |best: Option<u32>, i| match best {
                    Some(b) if logits[b as usize] >= logits[i as usize] => Some(b),
                    _ => Some(i),
                })
                .ok_or_else(|| candle_core::Error::Msg("every token is banned".into()));
        };
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / temperature;
        self.probs.clear();
        self.probs
            .extend(logits.iter().map(|&l| ((l - max) * inv_t).exp()));
        for &i in &self.banned {
            if let Some(p) = self.probs.get_mut(i as usize) {
                *p = 0.0;
            }
        }
        let total: f64 = self.probs.iter().map(|&p| p as f64).sum();
        let n = self.probs.len();
        let probs = &self.probs;
        self.candidates.clear();
        if self.top_p >= 1.0 {
            self.candidates.extend(0..n as u32);
        } else {
            // A token with probability below (1 - top_p) / n can never be in the nucleus: even
            // together with every less likely token it cannot make up the excluded 1 - top_p.
            // So only the few likely tokens need sorting.
            let floor = (total * (1.0 - self.top_p as f64) / n as f64) as f32;
            self.candidates
                .extend((0..n as u32).filter(|&i| probs[i as usize] >= floor));
            self.candidates
                .sort_unstable_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
            let target = total * self.top_p as f64;
            let mut cum = 0.0;
            let mut keep = self.candidates.len();
            for (j, &i) in self.candidates.iter().enumerate() {
                cum += probs[i as usize] as f64;
                if cum >= target {
                    keep = j + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
        }
        let mass: f64 = self
            .candidates
            .iter()
            .map(|&i| probs[i as usize] as f64)
            .sum();
        let mut r = self.rng.random::<f64>() * mass;
        for &i in &self.candidates {
            r -= probs[i as usize] as f64;
            if r < 0.0 {
                return Ok(i);
            }
        }
        // Rounding left r at or just above zero: the last candidate that can be drawn.
        let probs = &self.probs;
        self.candidates
            .iter()
            .rev()
            .copied()
            .find(|&i| probs[i as usize] > 0.0)
            .ok_or_else(|| candle_core::Error::Msg("no token to sample".into()))
    }
}

/// Marks `stage` failed when a model error escapes it.
fn on_stage<T>(stage: &Stage, r: candle_core::Result<T>) -> Result<T, GenerateError> {
    r.map_err(|e| {
        stage.fail("model", e.to_string());
        GenerateError::Model(e)
    })
}

fn per_second(n: usize, d: std::time::Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

impl Generator for Llama {
    fn model_id(&self) -> &str {
        MODEL_ID
    }

    fn context_window(&self) -> usize {
        self.context_window
    }

    fn count_tokens(&self, text: &str) -> Result<usize, GenerateError> {
        Ok(encode(&self.content_tokenizer, text)?.len())
    }

    /// Renders ChatML as the GGUF's template does, tokenizing turn by turn: control tokens are
    /// inserted as ids and message text never turns into control tokens.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, GenerateError> {
        let mut ids = Vec::new();
        for (role, content) in self.template.turns(messages) {
            ids.push(self.im_start);
            // Role and content as one string, as in the rendered template, so BPE sees the
            // same pre-token split.
            ids.extend(encode(
                &self.content_tokenizer,
                &format!("{role}\n{content}"),
            )?);
            ids.push(self.im_end);
            ids.extend_from_slice(&self.newline);
        }
        ids.push(self.im_start);
        ids.extend(encode(&self.content_tokenizer, "assistant\n")?);
        Ok(ids)
    }

    fn generate(
        &self,
        req: GenerateRequest<'_>,
        stage: &Stage,
        on_token: &mut dyn FnMut(&str) -> Flow,
    ) -> Result<Generated, GenerateError> {
        let n_prompt = req.prompt.len();
        if n_prompt + req.max_tokens > self.context_window {
            return Err(GenerateError::ContextOverflow {
                prompt: n_prompt,
                max_tokens: req.max_tokens,
                window: self.context_window,
            });
        }
        if n_prompt == 0 {
            return Err(GenerateError::Tokenizer("the prompt is empty".into()));
        }
        let vocab = self.weights.embed.shape().dims()[0];
        if let Some(bad) = req.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(GenerateError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let past_deadline = || req.deadline.is_some_and(|d| clock::now() >= d);
        let mut out = Generated {
            text: String::new(),
            tokens: Vec::with_capacity(req.max_tokens),
            finish: FinishReason::Length,
            prompt_tokens: n_prompt,
            prefill: Default::default(),
            decode: Default::default(),
            first_token_at: None,
        };
        if req.max_tokens == 0 {
            return Ok(out);
        }
        // Wait for the prefill turn; the wait is its own stage when there is one.
        let turn = match self.prefill_turn.try_lock() {
            Ok(turn) => turn,
            Err(std::sync::TryLockError::WouldBlock) => {
                let wait = stage.child("prefill_queue");
                let turn = self.prefill_turn.lock().unwrap_or_else(|p| p.into_inner());
                wait.end();
                turn
            }
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        };
        if past_deadline() {
            out.finish = FinishReason::Timeout;
            return Ok(out);
        }

        let prefill = stage.child("prefill");
        let mut cache = on_stage(
            &prefill,
            KvCache::new(
                &self.cfg,
                n_prompt + req.max_tokens,
                &self.device,
                self.weights.decoder.is_some(),
            ),
        )?;
        let gpu = GpuTimer::start(&self.device);
        let mut logits = Logits::Device(on_stage(&prefill, self.prefill(req.prompt, &mut cache))?);
        gpu.finish_into(&prefill, "prefill");
        let done = clock::now();
        let took = done.saturating_duration_since(prefill.started());
        prefill.set_all([
            KeyValue::new("gen_ai.usage.input_tokens", n_prompt as i64),
            KeyValue::new("rag.prefill.tokens_per_second", per_second(n_prompt, took)),
        ]);
        out.prefill = prefill.end_at(done);
        drop(turn);

        let decode = stage.child("decode");
        let gpu_every = if self.device.is_cpu() {
            0
        } else {
            gpu::decode_sample_every()
        };
        let mut sampler = Sampler::new(&req.sampling);
        if req.ignore_eos {
            sampler = sampler.banning(&self.eos);
        }
        let mut stream = Utf8Stream::new();
        let mut index = 0usize;
        let mut session = self.batcher.as_ref().map(|b| b.session(&decode));
        let mut batches = BatchSizes::default();
        loop {
            if past_deadline() {
                out.finish = FinishReason::Timeout;
                break;
            }
            let step = (req.token_trace == TokenTrace::Spans).then(|| decode.child("decode_step"));
            if let Some(&last) = out.tokens.last() {
                let timer = gpu::sampled(index, gpu_every).then(|| GpuTimer::start(&self.device));
                let batch = on_stage(
                    &decode,
                    self.decode_one(session.as_mut(), &mut cache, last, &mut logits),
                )?;
                batches.record(batch);
                if let Some(iv) = timer.and_then(GpuTimer::finish) {
                    let host = step.as_ref().unwrap_or(&decode);
                    let index = KeyValue::new("gen_ai.token.index", index as i64);
                    gpu::emit(host, "decode_step", &iv, vec![index]);
                }
            }
            let next = on_stage(&decode, sampler.sample(&logits))?;
            let at = clock::now();
            out.first_token_at.get_or_insert(at);
            let attributes = || {
                vec![
                    KeyValue::new("gen_ai.token.index", index as i64),
                    KeyValue::new("gen_ai.token.id", next as i64),
                ]
            };
            match (req.token_trace, step) {
                (TokenTrace::Events, _) => decode.event_at("token", at, attributes()),
                (TokenTrace::Spans, Some(step)) => {
                    step.set_all(attributes());
                    step.end_at(at);
                }
                _ => {}
            }
            index += 1;
            if self.eos.contains(&next) {
                out.finish = FinishReason::Stop;
                break;
            }
            out.tokens.push(next);
            let piece = stream.push(self.token_bytes.get(next));
            if !piece.is_empty() {
                out.text.push_str(piece);
                if on_token(piece) == Flow::Stop {
                    out.finish = FinishReason::Cancelled;
                    break;
                }
            }
            if out.tokens.len() >= req.max_tokens {
                out.finish = FinishReason::Length;
                break;
            }
        }
        // A character cut off by the end of generation still reaches the client (as U+FFFD),
        // so the streamed pieces always add up to `text`.
        let tail = stream.finish();
        if !tail.is_empty() {
            out.text.push_str(tail);
            if out.finish != FinishReason::Cancelled {
                on_token(tail);
            }
        }
        drop(session);
        let n_out = out.tokens.len();
        let done = clock::now();
        let took = done.saturating_duration_since(decode.started());
        if batches.steps > 0 {
            decode.set_all([
                KeyValue::new("rag.decode.batch_size.max", batches.max as i64),
                KeyValue::new(
                    "rag.decode.batch_size.mean",
                    batches.total as f64 / batches.steps as f64,
                ),
            ]);
        }
        // Client-visible rate: every token delivered after prefill, over the decode stage.
        decode.set_all([
            KeyValue::new("gen_ai.usage.output_tokens", n_out as i64),
            KeyValue::new("rag.decode.tokens_per_second", per_second(n_out, took)),
        ]);
        out.decode = decode.end_at(done);
        Ok(out)
    }
}

/// The CPU decoder of the model at `path`, for `ragscope bench --decode-step`.
pub(crate) fn decoder_for_bench(path: &Path) -> (Arc<CpuDecoder>, Llama) {
    let model = Llama::from_gguf(path, &Device::Cpu, 2048).expect("load");
    (model.weights.decoder.clone().expect("CPU default"), model)
}

/// Where tests find the model: `$RAGSCOPE_MODELS_DIR` (default `models`), then
/// `SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf`.
#[cfg(test)]
pub(crate) fn test_model_path() -> std::path::PathBuf {
    let dir = std::env::var("RAGSCOPE_MODELS_DIR").unwrap_or_else(|_| "models".into());
    std::path::Path::new(&dir)
        .join(MODEL_ID)
        .join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[cfg(test)]
mod tests {
    use std::io::BufReader;
    use std::sync::OnceLock;
    use std::time::Instant;

    use candle_transformers::models::quantized_llama::ModelWeights;

    use super::*;

    const MAX_CONTEXT: usize = 2048;

    /// The default-format model, loaded once for all tests, or `None` (with a note) when the
    /// GGUF is absent.
    fn model() -> Option<&'static Llama> {
        static MODEL: OnceLock<Option<Llama>> = OnceLock::new();
        MODEL
            .get_or_init(|| {
                let path = test_model_path();
                if !path.exists() {
                    eprintln!("skipping: {} not found", path.display());
                    return None;
                }
                Some(Llama::from_gguf(&path, &Device::Cpu, MAX_CONTEXT).expect("load model"))
            })
            .as_ref()
    }

    /// A no-op stage: no global tracer provider is installed in unit tests.
    fn stage() -> Stage {
        Stage::root("test")
    }

    fn request(prompt: &[u32], max_tokens: usize, sampling: Sampling) -> GenerateRequest<'_> {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            token_trace: TokenTrace::Events,
            deadline: None,
            ignore_eos: false,
        }
    }

    /// Generates and also returns the streamed pieces.
    fn run(model: &Llama, req: GenerateRequest<'_>) -> (Generated, Vec<String>) {
        let mut pieces = Vec::new();
        let out = model
            .generate(req, &stage(), &mut |p| {
                pieces.push(p.to_string());
                Flow::Continue
            })
            .expect("generate");
        (out, pieces)
    }

    /// A one-passage question the model answers correctly ("Quenta").
    fn zorbia_prompt(model: &Llama) -> Vec<u32> {
        model
            .chat_prompt(&[ChatMessage::new(
                "user",
                "Passage: The capital of Zorbia is Quenta.\nQuestion: What is the capital of Zorbia?",
            )])
            .unwrap()
    }

    fn rag_messages() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new(
                "system",
                "Answer the question using only the passages. Be brief.",
            ),
            ChatMessage::new(
                "user",
                "Passage 1: The Great Barrier Reef is the world's largest coral reef system, \
                 composed of over 2,900 individual reefs off the coast of Queensland, Australia.\n\
                 Passage 2: It can be seen from outer space and was selected as a World Heritage \
                 Site in 1981.\n\nQuestion: Where is the Great Barrier Reef?",
            ),
        ]
    }

    /// The same GGUF with every projection matrix converted to `dtype` (the format our model
    /// holds for `format`), written to a temporary file for candle's reference implementation.
    fn converted_gguf(dtype: GgmlDType) -> tempfile::NamedTempFile {
        let path = test_model_path();
        let mut reader = BufReader::new(std::fs::File::open(&path).unwrap());
        let ct = gguf_file::Content::read(&mut reader).unwrap();
        let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
        names.sort();
        let tensors: Vec<(&str, QTensor)> = names
            .into_iter()
            .map(|name| {
                let t = ct.tensor(&mut reader, name, &Device::Cpu).unwrap();
                let projection = name.starts_with("blk.") && !name.ends_with("norm.weight");
                let t = if projection {
                    QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), dtype).unwrap()
                } else {
                    t
                };
                (name.as_str(), t)
            })
            .collect();
        let metadata: Vec<(&str, &gguf_file::Value)> =
            ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let mut w = std::io::BufWriter::new(file.as_file_mut());
        gguf_file::write(&mut w, &metadata, &tensor_refs).unwrap();
        drop(w);
        file
    }

    /// candle-transformers' quantized llama, greedy: the logits of every step and up to `n`
    /// tokens (stopping at an end token, as our generator does).
    fn reference_greedy(gguf: &Path, prompt: &[u32], n: usize) -> (Vec<Tensor>, Vec<u32>) {
        let cpu = Device::Cpu;
        let mut reader = BufReader::new(std::fs::File::open(gguf).unwrap());
        let ct = gguf_file::Content::read(&mut reader).unwrap();
        let mut m = ModelWeights::from_gguf(ct, &mut reader, &cpu).unwrap();
        let input = Tensor::new(prompt, &cpu).unwrap().unsqueeze(0).unwrap();
        let mut logits = vec![m.forward(&input, 0).unwrap().squeeze(0).unwrap()];
        let mut out = Vec::new();
        for pos in prompt.len()..prompt.len() + n {
            let last = logits.last().unwrap();
            let next = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
            if next == 0 || next == 2 {
                break;
            }
            out.push(next);
            let input = Tensor::new(&[next], &cpu).unwrap().unsqueeze(0).unwrap();
            logits.push(m.forward(&input, pos).unwrap().squeeze(0).unwrap());
        }
        (logits, out)
    }

    /// Our logits for `prompt` then each of `forced` fed back one at a time.
    fn our_logits(model: &Llama, prompt: &[u32], forced: &[u32]) -> Vec<Tensor> {
        let cap = prompt.len() + forced.len();
        let host = model.weights.decoder.is_some();
        let mut cache = KvCache::new(&model.cfg, cap, &Device::Cpu, host).unwrap();
        let mut logits = vec![model.prefill(prompt, &mut cache).unwrap()];
        let mut last = Logits::Host(Vec::new());
        let decode = stage();
        let mut session = model.batcher.as_ref().map(|b| b.session(&decode));
        for &t in forced {
            model
                .decode_one(session.as_mut(), &mut cache, t, &mut last)
                .unwrap();
            logits.push(match &last {
                Logits::Device(t) => t.clone(),
                Logits::Host(v) => Tensor::new(v.as_slice(), &Device::Cpu).unwrap(),
            });
        }
        logits
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Same weights, same greedy tokens as candle-transformers' `quantized_llama::ModelWeights`.
    /// Each of our formats runs against the reference on the GGUF converted the same way (Q8_0
    /// or F32 projections), and the default (F32 prefill, our Q4_1 decode) against the
    /// reference on the file as shipped (Q4_1 with Q8_1 activations); its prefill is also
    /// checked against the F32 reference. Teacher-forced on the reference's tokens, every step
    /// must pick the same token and:
    /// - F32: logits within 1e-3 (seen: bit-identical; the Q8_0 output head re-quantises the
    ///   last hidden state, which absorbs our different float summation order);
    /// - Q8_0: worst per-step mean |Δlogit| below 1.0. Q8_0 re-quantises activations at every
    ///   matmul, so ~1e-7 differences in summation order (our decode attention is a plain loop,
    ///   our GEMMs batch heads differently) now and then flip a quantisation step and the
    ///   logits drift: seen worst mean 0.32 (max 1.23). A real bug is far off that: rotating
    ///   decode keys one position too far gave worst mean 3.3 (max 6.6) and a different token.
    /// - the default: the same bound; its F32 prefill differs from the reference's quantised
    ///   one by the activation rounding.
    #[test]
    fn greedy_output_matches_candle_reference() {
        let Some(default_model) = model() else { return };
        let prompt = default_model.chat_prompt(&rag_messages()).unwrap();
        let path = test_model_path();
        for (format, dtype) in [
            (WeightFormat::Q8_0, Some(GgmlDType::Q8_0)),
            (WeightFormat::F32, Some(GgmlDType::F32)),
            (WeightFormat::F32PrefillQ4Decode, None),
        ] {
            let (ref_logits, ref_tokens) = match dtype {
                Some(dtype) => reference_greedy(converted_gguf(dtype).path(), &prompt, 32),
                None => reference_greedy(&path, &prompt, 32),
            };
            assert!(
                ref_tokens.len() > 8,
                "reference stopped early: {ref_tokens:?}"
            );
            let tokenizer = default_model.tokenizer().clone();
            let ours = Llama::load_with_format(&path, tokenizer, &Device::Cpu, 1024, format)
                .expect("load");

            // Teacher-forced: our logits at every step of the reference's run.
            let logits = our_logits(&ours, &prompt, &ref_tokens);
            let (mut worst_max, mut worst_mean) = (0f32, 0f32);
            for (step, (a, b)) in logits.iter().zip(&ref_logits).enumerate() {
                let argmax = |t: &Tensor| t.argmax(0).unwrap().to_scalar::<u32>().unwrap();
                let mean = (a - b)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .mean_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                worst_max = worst_max.max(max_abs_diff(a, b));
                worst_mean = worst_mean.max(mean);
                assert_eq!(argmax(a), argmax(b), "{format:?}: step {step} picks differ");
            }
            eprintln!("{format:?}: |Δlogit| max {worst_max}, worst step mean {worst_mean}");
            match format {
                WeightFormat::F32 => assert!(worst_max < 1e-3, "{format:?}: {worst_max}"),
                _ => assert!(worst_mean < 1.0, "{format:?}: {worst_mean}"),
            }

            let (out, _) = run(&ours, request(&prompt, 32, Sampling::default()));
            assert_eq!(out.tokens, ref_tokens, "{format:?}: greedy tokens differ");
            if format == WeightFormat::F32 {
                let ours = our_logits(default_model, &prompt, &[]);
                let diff = max_abs_diff(&ours[0], &ref_logits[0]);
                assert!(diff < 1e-3, "default format: first logits differ by {diff}");
            }
        }
    }

    /// The GPU default format, run here on candle's CPU F16 matmul: F16 prefill weights only
    /// round the prompt's activations, so the logits stay close to the F32-prefill format's and
    /// every teacher-forced step picks the same token.
    #[test]
    fn f16_prefill_format_stays_close_to_the_f32_prefill_format() {
        let Some(default_model) = model() else { return };
        assert_eq!(
            WeightFormat::for_device(&Device::Cpu),
            WeightFormat::F32PrefillQ4Decode
        );
        assert_eq!(
            default_model.weight_format(),
            WeightFormat::F32PrefillQ4Decode
        );
        // Same decode weights as the GPU format: only the prefill format differs.
        let default_model = &Llama::load_with_format(
            &test_model_path(),
            default_model.tokenizer().clone(),
            &Device::Cpu,
            1024,
            WeightFormat::F32PrefillQ8Decode,
        )
        .expect("load");
        let prompt = default_model.chat_prompt(&rag_messages()).unwrap();
        let (out, _) = run(default_model, request(&prompt, 16, Sampling::default()));
        let f16 = Llama::load_with_format(
            &test_model_path(),
            default_model.tokenizer().clone(),
            &Device::Cpu,
            1024,
            WeightFormat::F16PrefillQ8Decode,
        )
        .expect("load");
        let ours = our_logits(&f16, &prompt, &out.tokens);
        let reference = our_logits(default_model, &prompt, &out.tokens);
        let argmax = |t: &Tensor| t.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        let (mut worst_max, mut worst_mean) = (0f32, 0f32);
        for (step, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert_eq!(argmax(a), argmax(b), "step {step} picks differ");
            let d = (a - b).unwrap().abs().unwrap();
            let mean = d.mean_all().unwrap().to_scalar::<f32>().unwrap();
            worst_max = worst_max.max(max_abs_diff(a, b));
            worst_mean = worst_mean.max(mean);
        }
        eprintln!(
            "F16 prefill vs F32 prefill: |Δlogit| max {worst_max}, worst step mean {worst_mean}"
        );
        assert!(worst_max > 0.0, "the F16 weights were not used");
        // Same bound as the Q8_0 reference check: decode re-quantises activations, so a small
        // difference in the cached keys and values now and then flips a quantisation step.
        assert!(worst_mean < 1.0, "worst step mean |Δlogit| {worst_mean}");
    }

    #[test]
    fn answers_from_the_passage() {
        let Some(model) = model() else { return };
        let prompt = zorbia_prompt(model);
        let (out, _) = run(model, request(&prompt, 24, Sampling::default()));
        eprintln!("answer: {:?}", out.text);
        assert!(out.text.contains("Quenta"), "answer was {:?}", out.text);
        assert_eq!(out.prompt_tokens, prompt.len());
        assert!(out.first_token_at.is_some());
    }

    #[test]
    fn ignore_eos_runs_to_max_tokens_past_the_natural_end() {
        let Some(model) = model() else { return };
        let prompt = zorbia_prompt(model);
        let (stopped, _) = run(model, request(&prompt, 64, Sampling::default()));
        assert_eq!(stopped.finish, FinishReason::Stop, "{:?}", stopped.text);
        let n = stopped.tokens.len() + 8;
        let mut req = request(&prompt, n, Sampling::default());
        req.ignore_eos = true;
        let (full, _) = run(model, req);
        assert_eq!(full.finish, FinishReason::Length);
        assert_eq!(full.tokens.len(), n);
        assert!(full.tokens.iter().all(|t| !model.eos.contains(t)));
        // Greedy up to where the end token would have been picked.
        assert_eq!(full.tokens[..stopped.tokens.len()], stopped.tokens[..]);
    }

    #[test]
    fn decode_weight_bytes_counts_the_shipped_projections_the_head_and_the_norms() {
        let Some(model) = model() else { return };
        assert_eq!(model.weight_format(), WeightFormat::F32PrefillQ4Decode);
        let mut reader = BufReader::new(std::fs::File::open(test_model_path()).unwrap());
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

    #[test]
    fn seeded_sampling_is_reproducible() {
        let Some(model) = model() else { return };
        let prompt = model
            .chat_prompt(&[ChatMessage::new(
                "user",
                "Write a short poem about the sea.",
            )])
            .unwrap();
        let sampling = |seed| Sampling {
            temperature: 1.0,
            top_p: Some(0.95),
            seed,
        };
        let (a, _) = run(model, request(&prompt, 16, sampling(7)));
        let (b, _) = run(model, request(&prompt, 16, sampling(7)));
        assert_eq!(a.tokens, b.tokens);
        let differs = (1..=4)
            .any(|seed| run(model, request(&prompt, 16, sampling(seed))).0.tokens != a.tokens);
        assert!(differs, "four other seeds all gave the same tokens");
    }

    #[test]
    fn context_overflow_is_an_error_not_a_panic() {
        let Some(model) = model() else { return };
        assert_eq!(model.context_window(), MAX_CONTEXT);
        let prompt = vec![100u32; MAX_CONTEXT - 10];
        let err = model
            .generate(
                request(&prompt, 11, Sampling::default()),
                &stage(),
                &mut |_| Flow::Continue,
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                GenerateError::ContextOverflow {
                    prompt: 2038,
                    max_tokens: 11,
                    window: MAX_CONTEXT
                }
            ),
            "{err:?}"
        );
        let err = model
            .generate(request(&[], 4, Sampling::default()), &stage(), &mut |_| {
                Flow::Continue
            })
            .unwrap_err();
        assert!(matches!(err, GenerateError::Tokenizer(_)), "{err:?}");
    }

    #[test]
    fn stop_from_the_consumer_cancels() {
        let Some(model) = model() else { return };
        let prompt = model
            .chat_prompt(&[ChatMessage::new("user", "Count from one to twenty.")])
            .unwrap();
        let mut calls = 0;
        let out = model
            .generate(
                request(&prompt, 64, Sampling::default()),
                &stage(),
                &mut |_| {
                    calls += 1;
                    Flow::Stop
                },
            )
            .unwrap();
        assert_eq!(out.finish, FinishReason::Cancelled);
        assert_eq!(calls, 1);
        assert!(out.tokens.len() < 64);
    }

    #[test]
    fn a_passed_deadline_times_out() {
        let Some(model) = model() else { return };
        let prompt = model
            .chat_prompt(&[ChatMessage::new("user", "Hello")])
            .unwrap();
        let mut req = request(&prompt, 8, Sampling::default());
        req.deadline = Some(clock::now());
        let (out, pieces) = run(model, req);
        assert_eq!(out.finish, FinishReason::Timeout);
        assert!(out.tokens.is_empty() && pieces.is_empty());
    }

    /// Requests decoding at the same time share batched steps; each still gets exactly the
    /// tokens it gets alone (greedy), whatever it is batched with, and the decode span says so.
    #[test]
    fn batched_decoding_gives_each_request_its_own_tokens() {
        let Some(model) = model() else { return };
        let prompts: Vec<Vec<u32>> = [
            "Passage: The capital of Zorbia is Quenta.\nQuestion: What is the capital of Zorbia?",
            "Write a short poem about the sea.",
            "List three uses of git stash.",
        ]
        .iter()
        .map(|q| model.chat_prompt(&[ChatMessage::new("user", *q)]).unwrap())
        .collect();
        let max_tokens = [40, 24, 32];
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .zip(max_tokens)
            .map(|(p, n)| run(model, request(p, n, Sampling::default())).0.tokens)
            .collect();
        let start = std::sync::Barrier::new(prompts.len());
        let together: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = prompts
                .iter()
                .zip(max_tokens)
                .map(|(p, n)| {
                    let start = &start;
                    scope.spawn(move || {
                        start.wait();
                        run(model, request(p, n, Sampling::default())).0.tokens
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(together, alone);
        assert!(model.batcher.is_some(), "the CPU default batches");
        let largest = &crate::telemetry::metrics::DECODE_BATCH.largest;
        assert!(
            largest.load(std::sync::atomic::Ordering::Relaxed) > 1,
            "the steps never ran batched"
        );
    }

    #[test]
    fn streamed_pieces_concatenate_to_the_text() {
        let Some(model) = model() else { return };
        let prompt = model
            .chat_prompt(&[ChatMessage::new(
                "user",
                "Translate to French and Japanese: good morning, my friend.",
            )])
            .unwrap();
        for trace in [TokenTrace::Events, TokenTrace::Spans, TokenTrace::Off] {
            let mut req = request(&prompt, 40, Sampling::default());
            req.token_trace = trace;
            let (out, pieces) = run(model, req);
            assert!(!out.tokens.is_empty());
            assert_eq!(pieces.concat(), out.text);
            assert_eq!(
                out.text,
                model.tokenizer().decode(&out.tokens, true).unwrap()
            );
            assert!(out.tokens.len() <= 40);
            if out.finish == FinishReason::Length {
                assert_eq!(out.tokens.len(), 40);
            }
        }
    }

    #[test]
    fn chat_prompt_renders_the_gguf_template() {
        let Some(model) = model() else { return };
        let system = model.template.default_system.clone();
        assert_eq!(
            system.as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        let decode = |ids: &[u32]| model.tokenizer().decode(ids, false).unwrap();
        // No system turn: the template's default is inserted.
        let ids = model
            .chat_prompt(&[ChatMessage::new("user", "What is 2+2?")])
            .unwrap();
        let expected = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained \
                        by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
                        <|im_start|>assistant\n";
        assert_eq!(decode(&ids), expected);
        assert_eq!(
            model
                .template
                .render(&[ChatMessage::new("user", "What is 2+2?")]),
            expected
        );
        // Same ids as tokenizing the rendered template in one go.
        assert_eq!(ids, encode(model.tokenizer(), expected).unwrap());
        // An explicit system turn replaces the default.
        let ids = model
            .chat_prompt(&[
                ChatMessage::new("system", "Be terse."),
                ChatMessage::new("user", "Hi"),
            ])
            .unwrap();
        assert_eq!(
            decode(&ids),
            "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // Control-token text inside content stays text.
        let ids = model
            .chat_prompt(&[ChatMessage::new("user", "a<|im_end|>b")])
            .unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == model.im_end).count(), 2);
    }

    #[test]
    fn template_parsing_refuses_non_chatml() {
        assert!(ChatTemplate::parse(Some("{{ bos_token }}[INST] {{ message }}")).is_err());
        let plain = ChatTemplate::parse(Some(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
             message['content'] + '<|im_end|>\\n'}}{% endfor %}",
        ))
        .unwrap();
        assert_eq!(plain.default_system, None);
        assert_eq!(
            plain.render(&[ChatMessage::new("user", "x")]),
            "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn causal_mask_hides_the_future_only() {
        let m = causal_mask(2, 3, &Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(m, vec![vec![0., 0., 0., 0., inf], vec![0., 0., 0., 0., 0.]]);
    }

    /// Prefill in chunks (with rectangular causal masks after the first) computes what one
    /// pass over the whole prompt computes.
    #[test]
    fn chunked_prefill_matches_one_pass() {
        let Some(model) = model() else { return };
        let prompt = long_prompt(model);
        assert!(prompt.len() > PREFILL_CHUNK);
        let mut cache = KvCache::new(&model.cfg, prompt.len(), &Device::Cpu, false).unwrap();
        let one_pass = model.forward(&prompt, &mut cache, true).unwrap().unwrap();
        let chunked = our_logits(model, &prompt, &[]).remove(0);
        let diff = max_abs_diff(&one_pass, &chunked);
        assert!(diff < 1e-3, "logits differ by {diff}");
        assert_eq!(
            one_pass.argmax(0).unwrap().to_scalar::<u32>().unwrap(),
            chunked.argmax(0).unwrap().to_scalar::<u32>().unwrap()
        );
    }

    /// The CPU decode-attention loops compute what the candle-ops attention computes.
    #[test]
    fn decode_attention_matches_the_ops_path() {
        let cpu = Device::Cpu;
        let (nh, nkv, hd, cap) = (9, 3, 64, 320);
        let k = Tensor::randn(0f32, 1.0, (nkv, cap, hd), &cpu).unwrap();
        let v = Tensor::randn(0f32, 1.0, (nkv, cap, hd), &cpu).unwrap();
        // One thread below PARALLEL_ATTENTION_MIN_LEN, split ranges above.
        for len in [1, 37, cpu_decode::PARALLEL_ATTENTION_MIN_LEN + 1, 300] {
            let q = Tensor::randn(0f32, 1.0, (1, nh, hd), &cpu).unwrap();
            let ours = attention(&q, &k, &v, len, None).unwrap();
            let ops = attention_ops(&q, &k, &v, len, None).unwrap();
            assert_eq!(ours.dims(), &[1, nh * hd]);
            let diff = max_abs_diff(&ours.flatten_all().unwrap(), &ops.flatten_all().unwrap());
            assert!(diff < 1e-5, "len {len}: differ by {diff}");
            // Only the first `len` positions count.
            let ones = Tensor::ones((nkv, cap - len, hd), DType::F32, &cpu).unwrap();
            let k2 = k.slice_assign(&[0..nkv, len..cap, 0..hd], &ones).unwrap();
            let again = attention(&q, &k2, &v, len, None).unwrap();
            let diff = max_abs_diff(&ours.flatten_all().unwrap(), &again.flatten_all().unwrap());
            assert_eq!(diff, 0.0, "len {len}: read past the end");
        }
    }

    fn draw(sampling: Sampling, logits: &[f32], n: usize) -> Vec<u32> {
        let logits = Logits::Device(Tensor::new(logits, &Device::Cpu).unwrap());
        let mut s = Sampler::new(&sampling);
        (0..n).map(|_| s.sample(&logits).unwrap()).collect()
    }

    fn sampling(temperature: f64, top_p: Option<f64>, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            seed,
        }
    }

    #[test]
    fn sampler_greedy_takes_the_argmax() {
        let logits = [0.1, 2.0, -1.0, 1.9];
        assert_eq!(draw(sampling(0.0, None, 1), &logits, 3), [1, 1, 1]);
        assert_eq!(draw(sampling(f64::NAN, Some(0.5), 1), &logits, 1), [1]);
    }

    #[test]
    fn sampler_never_picks_a_banned_token() {
        let logits = Logits::Device(Tensor::new(&[0.1f32, 2.0, -1.0, 1.9], &Device::Cpu).unwrap());
        let mut greedy = Sampler::new(&sampling(0.0, None, 1)).banning(&[1]);
        assert_eq!(greedy.sample(&logits).unwrap(), 3);
        let mut sampled = Sampler::new(&sampling(1.0, Some(0.9), 5)).banning(&[1, 3]);
        for _ in 0..200 {
            assert!(![1, 3].contains(&sampled.sample(&logits).unwrap()));
        }
    }

    #[test]
    fn sampler_follows_the_softmax() {
        // p = [0.25, 0.75]
        let logits = [0.0, 3f32.ln()];
        let picks = draw(sampling(1.0, None, 42), &logits, 4000);
        let ones = picks.iter().filter(|&&i| i == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        // Temperature 2 flattens it to softmax([0, ln 3 / 2]) = [0.366, 0.634].
        let picks = draw(sampling(2.0, None, 42), &logits, 4000);
        let ones = picks.iter().filter(|&&i| i == 1).count() as f64 / 4000.0;
        assert!((ones - 0.634).abs() < 0.03, "{ones}");
    }

    #[test]
    fn sampler_top_p_keeps_only_the_nucleus() {
        // p = [0.1, 0.6, 0.3]: top_p 0.5 is {1}; 0.8 is {1, 2}.
        let logits = [1f32.ln(), 6f32.ln(), 3f32.ln()];
        assert!(draw(sampling(1.0, Some(0.5), 3), &logits, 500)
            .iter()
            .all(|&i| i == 1));
        let picks = draw(sampling(1.0, Some(0.8), 3), &logits, 2000);
        assert!(!picks.contains(&0));
        let twos = picks.iter().filter(|&&i| i == 2).count() as f64 / 2000.0;
        assert!((twos - 1.0 / 3.0).abs() < 0.04, "{twos}");
        // Same seed, same draws; another seed differs somewhere.
        let a = draw(sampling(1.0, Some(0.95), 9), &logits, 64);
        assert_eq!(a, draw(sampling(1.0, Some(0.95), 9), &logits, 64));
        assert_ne!(a, draw(sampling(1.0, Some(0.95), 10), &logits, 64));
    }

    /// A ~600-token RAG prompt for the benchmark.
    fn long_prompt(model: &Llama) -> Vec<u32> {
        let passage = "The Great Barrier Reef is the world's largest coral reef system, composed \
                       of over 2,900 individual reefs and 900 islands stretching for over 2,300 \
                       kilometres over an area of approximately 344,400 square kilometres. The \
                       reef is located in the Coral Sea, off the coast of Queensland, Australia. ";
        let mut text = String::new();
        let mut i = 1;
        loop {
            text.push_str(&format!("Passage {i}: {passage}\n"));
            let msgs = [ChatMessage::new(
                "user",
                format!("{text}\nQuestion: How long is the reef?"),
            )];
            let ids = model.chat_prompt(&msgs).unwrap();
            if ids.len() >= 580 {
                return ids;
            }
            i += 1;
        }
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// Prefill and decode speed of each weight format: ~600-token prompt, then 128 greedy tokens
    /// (end tokens ignored so every run decodes the same count), medians of 3 after a warm-up.
    /// Run: `cargo test --release --lib bench_weight_formats -- --ignored --nocapture`.
    /// Only on an idle machine: candle's quantized matmuls wait for their workers in spin
    /// barriers, so on an oversubscribed CPU the Q8_0 numbers collapse (seen: 4 tok/s).
    #[test]
    #[ignore = "benchmark, run by hand on a quiet machine"]
    fn bench_weight_formats() {
        let Some(default_model) = model() else { return };
        let prompt = long_prompt(default_model);
        const DECODE: usize = 128;
        let formats = [
            WeightFormat::Shipped,
            WeightFormat::Q8_0,
            WeightFormat::F32,
            WeightFormat::F32PrefillQ8Decode,
            WeightFormat::F32PrefillQ4Decode,
        ];
        // e.g. RAGSCOPE_BENCH_FORMATS=Q8_0,F32PrefillQ8Decode to run a subset.
        let only = std::env::var("RAGSCOPE_BENCH_FORMATS").ok();
        for format in formats {
            if only
                .as_ref()
                .is_some_and(|o| !o.split(',').any(|f| f == format!("{format:?}")))
            {
                continue;
            }
            let model = Llama::load_with_format(
                &test_model_path(),
                default_model.tokenizer().clone(),
                &Device::Cpu,
                MAX_CONTEXT,
                format,
            )
            .unwrap();
            let once = || {
                let host = model.weights.decoder.is_some();
                let mut cache =
                    KvCache::new(&model.cfg, prompt.len() + DECODE, &Device::Cpu, host).unwrap();
                let t0 = Instant::now();
                let mut logits = Logits::Device(model.prefill(&prompt, &mut cache).unwrap());
                let t1 = Instant::now();
                let mut greedy = Sampler::new(&Sampling::default());
                let decode = stage();
                let mut session = model.batcher.as_ref().map(|b| b.session(&decode));
                for _ in 0..DECODE {
                    let next = greedy.sample(&logits).unwrap();
                    model
                        .decode_one(session.as_mut(), &mut cache, next, &mut logits)
                        .unwrap();
                }
                let t2 = Instant::now();
                (
                    prompt.len() as f64 / (t1 - t0).as_secs_f64(),
                    DECODE as f64 / (t2 - t1).as_secs_f64(),
                )
            };
            once();
            let runs: Vec<(f64, f64)> = (0..3).map(|_| once()).collect();
            println!(
                "{format:?}: prompt {} tokens, prefill {:.0} tok/s, decode {:.1} tok/s (runs {runs:.1?})",
                prompt.len(),
                median(runs.iter().map(|r| r.0).collect()),
                median(runs.iter().map(|r| r.1).collect()),
            );
        }
    }
}
