//! SmolLM2-135M-Instruct (llama architecture) from its GGUF file as a [`Generator`]: the weights
//! read once and shared by every request, a KV cache preallocated per request, ChatML prompts
//! and streamed generation.
//!
//! A request prefills its prompt in chunks and then decodes one token per step, writing keys and
//! values in place (candle's quantized llama copies its whole cache at every step). The parts,
//! by role: [`weights`](super::weights) (GGUF reading, [`WeightFormat`]),
//! [`kv_cache`](super::kv_cache), [`forward`](super::forward) (the forward: candle's ops on a
//! GPU, RoPE, masks, decode attention), [`cpu_prefill`](super::cpu_prefill) (the prefill on the
//! CPU in plain loops), [`sampler`](super::sampler), [`template`](super::template) (ChatML),
//! [`generation`](super::generation) (the per-request loop) and [`schedule`](super::schedule)
//! (prefill turns, the compute lock, batched decode), and [`prefix_cache`](super::prefix_cache)
//! (prompt prefixes whose keys and values a new prefill starts from). On a GPU the same forward runs on candle's
//! CUDA ops, with weights in [`WeightFormat::F16PrefillQ8Decode`] and the KV cache allocated on
//! the device; CUDA events time prefill and sampled decode steps
//! ([`gpu`](telemetry::gpu)).

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use tokenizers::Tokenizer;

use super::forward::{self, Transformer};
use super::kv_cache::KvCache;
use super::prefix_cache::PrefixCache;
use super::schedule::Scheduler;
use super::speculate::Speculation;
use super::template::ChatTemplate;
use super::tokenizer::TokenBytes;
use super::weights::{self, load_err, Gguf, Weights};
use super::{GenerateError, KvDtype};

pub use super::weights::{Prefill, PrefillKernel, WeightFormat};

/// The model name clients see.
pub const MODEL_ID: &str = "SmolLM2-135M-Instruct";

/// SmolLM2 as a [`Generator`]: shared read-only weights, a KV cache per request.
pub struct Llama {
    pub(super) format: WeightFormat,
    pub(super) transformer: Transformer,
    pub(super) context_window: usize,
    pub(super) tokenizer: Tokenizer,
    /// Same tokenizer, but control-token text inside message content stays plain text, so a
    /// user cannot forge `<|im_start|>` turns.
    pub(super) content_tokenizer: Tokenizer,
    pub(super) token_bytes: TokenBytes,
    pub(super) template: ChatTemplate,
    pub(super) im_start: u32,
    pub(super) im_end: u32,
    pub(super) newline: Vec<u32>,
    /// Generation stops at any of these (`<|im_end|>`, `<|endoftext|>`).
    pub(super) eos: Vec<u32>,
    /// How requests share the cores: prefill turns, the compute lock, batched decode steps.
    pub(super) schedule: Scheduler,
    /// Keys and values of recent prompt prefixes (off until [`Llama::with_prefix_cache`]).
    pub(super) prefix: PrefixCache,
    /// The GGUF file the weights came from (named in failure snapshots).
    pub(super) gguf_path: std::path::PathBuf,
    /// Where failed generations leave snapshots (none until [`Llama::with_snapshots`]).
    pub(super) snapshots: Option<Arc<crate::snapshot::SnapshotStore>>,
    /// The GGUF file's sha256, computed when the first snapshot needs it.
    pub(super) weights_sha256: crate::snapshot::replay::WeightsDigest,
    /// How decode steps draft (off until [`Llama::with_speculation`]).
    pub(super) speculation: std::sync::Mutex<Speculation>,
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
        Self::load_with_kernel(
            gguf_path,
            tokenizer,
            device,
            max_context,
            format,
            PrefillKernel::Detect,
        )
    }

    /// Loads with an explicit weight format and, for [`WeightFormat::Bf16PrefillQ4Decode`], an
    /// explicit choice of BF16 kernel (the tolerance and fallback tests).
    pub fn load_with_kernel(
        gguf_path: &Path,
        tokenizer: Tokenizer,
        device: &Device,
        max_context: usize,
        format: WeightFormat,
        bf16: PrefillKernel,
    ) -> Result<Llama, GenerateError> {
        Self::load_edited(
            gguf_path,
            tokenizer,
            device,
            max_context,
            (format, bf16),
            |_| Ok(()),
        )
    }

    /// Loads with `edit` applied to the tensors as read, before they are converted (replay's
    /// `--perturb-weight`).
    pub(super) fn load_edited(
        gguf_path: &Path,
        tokenizer: Tokenizer,
        device: &Device,
        max_context: usize,
        (format, bf16): (WeightFormat, PrefillKernel),
        edit: impl FnOnce(&mut Gguf) -> Result<(), GenerateError>,
    ) -> Result<Llama, GenerateError> {
        let mut gguf = weights::read_gguf(gguf_path)?;
        edit(&mut gguf)?;
        let Gguf {
            cfg,
            template,
            eos_token_id,
            embed,
            output,
            final_norm,
            layers: raw_layers,
        } = gguf;

        let window = cfg.context_length.min(max_context).max(1);
        let (cos, sin) = forward::rope_tables(cfg.head_dim, cfg.rope_base, window, device)
            .map_err(|e| load_err(gguf_path, e))?;
        let weights = Weights::build(
            &cfg,
            raw_layers,
            embed,
            output,
            final_norm,
            format,
            bf16,
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
        if let Some(id) = eos_token_id {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let mut content_tokenizer = tokenizer.clone();
        content_tokenizer.set_encode_special_tokens(true);
        let newline = encode(&content_tokenizer, "\n")?;
        let token_bytes = TokenBytes::new(&tokenizer);
        let schedule = Scheduler::new(weights.decoder.clone());
        let prefix = PrefixCache::new(&cfg, 0, KvDtype::F32);
        Ok(Llama {
            format,
            transformer: Transformer {
                cfg,
                weights,
                cos,
                sin,
                device: device.clone(),
                prefill_chunk: forward::PREFILL_CHUNK.into(),
                kv_dtype: KvDtype::default(),
            },
            context_window: window,
            tokenizer,
            content_tokenizer,
            token_bytes,
            template,
            im_start,
            im_end,
            newline,
            eos,
            schedule,
            prefix,
            gguf_path: gguf_path.to_path_buf(),
            snapshots: None,
            weights_sha256: Default::default(),
            speculation: std::sync::Mutex::new(Speculation::OFF),
        })
    }

    /// Drafts as `speculation` says ([`crate::speculate`]). Loading leaves it off, so
    /// benchmarks measure plain decode unless told; the server sets `--speculation`.
    pub fn with_speculation(self, speculation: Speculation) -> Llama {
        self.set_speculation(speculation);
        self
    }

    /// [`Llama::with_speculation`] on a loaded model, for the decode steps from now on.
    pub fn set_speculation(&self, speculation: Speculation) {
        *self.speculation.lock().unwrap_or_else(|p| p.into_inner()) = speculation;
    }

    /// How decode steps draft now.
    pub fn speculation(&self) -> Speculation {
        *self.speculation.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leaves a snapshot in `store` for every failed generation.
    pub fn with_snapshots(mut self, store: Option<Arc<crate::snapshot::SnapshotStore>>) -> Llama {
        self.snapshots = store;
        self
    }

    /// Prefills prompts in chunks of `tokens` (a multiple of
    /// [`forward::PREFILL_CHUNK_MULTIPLE`], at most [`Llama::MAX_PREFILL_CHUNK`]; other values
    /// are rounded down to one, and to at least one multiple). Between chunks, as between
    /// layers, the batched decode steps of other requests take their turns.
    pub fn with_prefill_chunk(self, tokens: usize) -> Llama {
        self.set_prefill_chunk(tokens);
        self
    }

    /// [`Llama::with_prefill_chunk`] on a loaded model, for the prefills that start from now
    /// on (`ragscope-lab interference` switches sizes between rounds). Returns the
    /// size set.
    pub fn set_prefill_chunk(&self, tokens: usize) -> usize {
        let m = forward::PREFILL_CHUNK_MULTIPLE;
        let size = (tokens / m * m).clamp(m, Self::MAX_PREFILL_CHUNK);
        let chunk = &self.transformer.prefill_chunk;
        chunk.store(size, std::sync::atomic::Ordering::Relaxed);
        size
    }

    /// The largest prefill chunk (and the default): see [`forward::PREFILL_CHUNK`].
    pub const MAX_PREFILL_CHUNK: usize = forward::PREFILL_CHUNK;

    /// Tokens per prefill chunk.
    pub fn prefill_chunk(&self) -> usize {
        self.transformer.prefill_chunk()
    }

    /// Stores the keys and values of the CPU decoder's caches in `dtype` (F16 unless told).
    /// A cache of candle tensors (a GPU, the formats that decode on candle's ops) is F32, and
    /// anything else is refused for it.
    pub fn with_kv_dtype(mut self, dtype: KvDtype) -> Result<Llama, GenerateError> {
        if self.transformer.host_kv().is_none() && dtype != KvDtype::F32 {
            return Err(GenerateError::Load(format!(
                "a KV cache in {} needs the CPU decoder; the {:?} format on this device keeps \
                 F32 tensors",
                dtype.name(),
                self.format
            )));
        }
        self.transformer.kv_dtype = dtype;
        self.prefix = self.new_prefix_cache(self.prefix.budget());
        Ok(self)
    }

    /// An empty prefix cache of `budget` bytes whose blocks take the dtype of this model's
    /// request caches.
    fn new_prefix_cache(&self, budget: u64) -> PrefixCache {
        let dtype = self.transformer.host_kv().unwrap_or(KvDtype::F32);
        PrefixCache::new(&self.transformer.cfg, budget, dtype)
    }

    /// How a request's cache holds keys and values: `None` when it is candle tensors (F32) on
    /// the device rather than the CPU decoder's host buffers.
    pub fn kv_dtype(&self) -> Option<KvDtype> {
        self.transformer.host_kv()
    }

    /// Keeps up to `mb` MiB of prompt-prefix keys and values for later prompts to start from
    /// (0: none). Loading leaves it off, so benchmarks that repeat a prompt measure whole
    /// prefills; the server turns it on (`--prefix-cache-mb`).
    pub fn with_prefix_cache(mut self, mb: usize) -> Llama {
        self.prefix = self.new_prefix_cache(mb as u64 * (1 << 20));
        self
    }

    /// Prefills `prompt` into the empty `cache`: positions covered by the longest cached prefix
    /// are copied in, the rest computed, then the prompt's whole blocks cached, and its end (its
    /// last positions and logits), so the same prompt again needs no prefill at all. Returns the
    /// last position's logits and the number of positions that came from the cache.
    #[cfg(test)]
    pub(super) fn prefill(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
    ) -> candle_core::Result<(candle_core::Tensor, usize)> {
        self.prefill_traced(prompt, cache, None, true)
    }

    /// [`Llama::prefill`], with each computed chunk an event on `stage`; `whole`: take and
    /// leave the whole prompt's end too (not for a prompt that no request will repeat, such as
    /// a warm-up's head).
    pub(super) fn prefill_traced(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
        stage: Option<&telemetry::span::Stage>,
        whole: bool,
    ) -> candle_core::Result<(candle_core::Tensor, usize)> {
        let hit = self.prefix.lookup(prompt, whole);
        self.prefix.restore(&hit, cache)?;
        let cached = hit.tokens();
        let net = &self.transformer;
        if let Some(logits) = hit.logits() {
            let logits = candle_core::Tensor::from_slice(logits, logits.len(), &net.device)?;
            return Ok((logits, cached));
        }
        drop(hit);
        let logits = net.prefill_traced(&prompt[cached..], cache, &self.schedule, stage)?;
        let last = match whole && self.prefix.enabled() {
            true => Some(logits.to_vec1::<f32>()?),
            false => None,
        };
        self.prefix.insert(prompt, cache, last.as_deref())?;
        Ok((logits, cached))
    }

    /// How this instance's prefill projections multiply (BF16 only where the format asks for
    /// it and the CPU has it).
    pub fn prefill_kind(&self) -> Prefill {
        self.transformer.weights.prefill
    }

    /// The weight format this instance was loaded with.
    pub fn weight_format(&self) -> WeightFormat {
        self.format
    }

    /// The tokenizer (with control tokens recognised in text).
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Bytes of weights one decode step reads: every projection in its decode format, the
    /// output head and the norms (the embedding lookup reads a single row, left out). The
    /// memory bandwidth divided by this bounds decode tokens/s.
    pub fn decode_weight_bytes(&self) -> usize {
        self.transformer.weights.decode_bytes()
    }
}

/// `text`'s token ids, special-token text left as text.
pub(crate) fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, GenerateError> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| GenerateError::Tokenizer(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::model;
    use crate::{ChatMessage, ChatTokenizer};

    #[test]
    fn chat_prompt_renders_the_gguf_template() {
        let Some(model) = model() else { return };
        let system = model.template.default_system.clone();
        assert_eq!(
            system.as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        let decode = |ids: &[u32]| model.hf_tokenizer().decode(ids, false).unwrap();
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
        assert_eq!(ids, encode(model.hf_tokenizer(), expected).unwrap());
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
}
