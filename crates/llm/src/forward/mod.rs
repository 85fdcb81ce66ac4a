//! The llama forward pass on candle ops: token embedding, per layer RMSNorm, fused QKV, RoPE
//! (interleaved, as GGUF llamas rotate), grouped-query attention over the request's KV cache
//! and the SiLU-gated MLP, then the output head. Prefill runs the prompt through in chunks,
//! on the CPU in plain loops over the host KV cache ([`super::cpu_prefill`]) when the CPU
//! decoder holds the decode weights, else on candle's ops here; a decode step runs one token,
//! in the batcher's step when the CPU decoder holds the decode weights ([`super::schedule`]),
//! else here. Single-row attention on the CPU runs in plain loops ([`DecodeAttention`]) rather
//! than candle's matmul/softmax/matmul.

use candle_core::{Device, Module, Tensor};
use opentelemetry::KeyValue;

use super::cpu_decode::{self, Partial};
use super::cpu_prefill;
use super::host_kv::KvDtype;
use super::kv_cache::{read_host, write_host, KvCache, KvStore};
use super::sampler::Logits;
use super::schedule::{Scheduler, Session};
use super::weights::{Config, Weights};
use telemetry::clock;
use telemetry::names::{attr, event};
use telemetry::span::Stage;

/// Prompts are prefilled in chunks of at most this many tokens, which bounds the attention
/// scores of one chunk to `heads × PREFILL_CHUNK × context` floats (≈ 150 MB at 8192 positions)
/// while keeping the matmuls large enough to run as GEMMs.
pub(crate) const PREFILL_CHUNK: usize = 512;

/// Chunk sizes must be a multiple of this: the F32 GEMMs give a row the same result only when
/// the split falls on a multiple of 32 positions (38 = 32 + 6 prefilled in two parts matches
/// one pass; 5 + 33 and 16 + 22 do not), so chunking keeps every prompt's logits as they were.
pub const PREFILL_CHUNK_MULTIPLE: usize = 32;

/// The network: shared read-only weights, the RoPE tables and the device they live on.
pub(super) struct Transformer {
    pub cfg: Config,
    pub weights: Weights,
    /// RoPE tables `(context_window, head_dim / 2)`, built once.
    pub cos: Tensor,
    pub sin: Tensor,
    pub device: Device,
    /// Tokens per prefill chunk ([`PREFILL_CHUNK`] unless `--prefill-chunk-tokens` says
    /// fewer). Each chunk's layers take compute turns, so a smaller chunk lets the batched
    /// decode steps of other requests in more often while a long prompt prefills.
    pub prefill_chunk: std::sync::atomic::AtomicUsize,
    /// How a request's cache stores keys and values where the CPU decoder runs.
    pub kv_dtype: KvDtype,
}

impl Transformer {
    /// The host cache's dtype where the CPU decoder steps through it; `None`: candle tensors
    /// on the device.
    pub fn host_kv(&self) -> Option<KvDtype> {
        self.weights.decoder.is_some().then_some(self.kv_dtype)
    }

    /// Runs `tokens` at positions `cache.len..` through the model, appending to the cache.
    /// Returns the logits `(vocab,)` of the last position when `want_logits`.
    /// Each layer runs in its own turn on the cores ([`Scheduler::compute_turn`]).
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        want_logits: bool,
        schedule: &Scheduler,
    ) -> candle_core::Result<Option<Tensor>> {
        let x = self.hidden(tokens, cache, schedule)?;
        if !want_logits {
            return Ok(None);
        }
        let t = tokens.len();
        Ok(Some(self.head(&x.narrow(0, t - 1, 1)?)?.squeeze(0)?))
    }

    /// The output head over hidden states `(t, hidden)`: final norm, then logits `(t, vocab)`.
    fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let normed = candle_nn::ops::rms_norm(x, &self.weights.final_norm, self.cfg.rms_eps)?;
        self.weights.lm_head.forward(&normed)
    }

    /// Runs `tokens` at positions `cache.len..` through every layer, appending to the cache;
    /// returns the last layer's hidden states `(t, hidden)`, before the final norm.
    fn hidden(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        schedule: &Scheduler,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.cfg;
        let (t, pos) = (tokens.len(), cache.len);
        if t == 0 || pos + t > cache.capacity {
            candle_core::bail!(
                "{t} tokens at position {pos} do not fit a cache of {}",
                cache.capacity
            );
        }
        if let (KvStore::Host(kv), Some(decoder)) = (&mut cache.store, &self.weights.decoder) {
            let x = cpu_prefill::hidden(&self.weights, decoder, tokens, kv, pos, schedule)?;
            cache.len = pos + t;
            return Tensor::from_vec(x, (t, cfg.n_head * cfg.head_dim), &self.device);
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
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let _turn = schedule.compute_turn();
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
                    write_host(kv, li, (&k, &v), pos)?;
                    let (keys, values) = read_host(kv, li, (nkv, hd), len)?;
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
        Ok(x)
    }

    /// Runs `token` at the next position of `cache` and puts the logits in `logits`: in the
    /// batcher's next step when the request has a `session`, else through
    /// [`Transformer::forward`]. Returns the number of sequences the step ran for.
    pub fn decode_one(
        &self,
        session: Option<&mut Session<'_>>,
        cache: &mut KvCache,
        token: u32,
        logits: &mut Logits,
        schedule: &Scheduler,
    ) -> candle_core::Result<usize> {
        match (session, &mut cache.store) {
            (Some(session), KvStore::Host(kv)) => {
                let mut buf = match std::mem::replace(logits, Logits::Host(Vec::new())) {
                    Logits::Host(buf) => buf,
                    Logits::Device(_) => Vec::new(),
                };
                let batch = session.step(kv, cache.len, &[token], &mut buf)?;
                cache.len += 1;
                *logits = Logits::Host(buf);
                Ok(batch)
            }
            _ => {
                let out = self.forward(&[token], cache, true, schedule)?;
                *logits = Logits::Device(out.expect("logits requested"));
                telemetry::metrics::metrics().step_tokens.record(1.0, &[]);
                Ok(1)
            }
        }
    }

    /// Runs `tokens` (the last pick, then a draft to verify) at the cache's next positions in
    /// one batched step; `logits` receives a row of logits for each. The cache counts the
    /// first position only: the caller adds each draft token's when it picks from the row that
    /// ran on it (the keys and values past `cache.len` are overwritten by the next step).
    pub fn decode_draft(
        &self,
        session: &mut Session<'_>,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: &mut Vec<f32>,
    ) -> candle_core::Result<usize> {
        let KvStore::Host(kv) = &mut cache.store else {
            candle_core::bail!("drafts are verified on the CPU decoder's cache only");
        };
        let batch = session.step(kv, cache.len, tokens, logits)?;
        cache.len += 1;
        Ok(batch)
    }

    /// Tokens per prefill chunk.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Prefills `prompt` into `cache` in chunks; returns the last position's logits.
    pub fn prefill(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
        schedule: &Scheduler,
    ) -> candle_core::Result<Tensor> {
        self.prefill_traced(prompt, cache, schedule, None)
    }

    /// [`Transformer::prefill`], recording each chunk as a `prefill_chunk` event on `stage`
    /// (its first position, its tokens and how long it took, stamped at its end on the shared
    /// clock) when there is one.
    pub fn prefill_traced(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
        schedule: &Scheduler,
        stage: Option<&Stage>,
    ) -> candle_core::Result<Tensor> {
        let mut logits = None;
        let size = self.prefill_chunk().clamp(1, PREFILL_CHUNK);
        let n_chunks = prompt.len().div_ceil(size);
        for (i, chunk) in prompt.chunks(size).enumerate() {
            let (start, began) = (cache.len, clock::now());
            logits = self.forward(chunk, cache, i + 1 == n_chunks, schedule)?;
            telemetry::metrics::metrics()
                .step_tokens
                .record(chunk.len() as f64, &[]);
            if let Some(stage) = stage {
                let end = clock::now();
                let ms = end.saturating_duration_since(began).as_secs_f64() * 1e3;
                stage.event_at(
                    event::PREFILL_CHUNK,
                    end,
                    vec![
                        KeyValue::new(attr::PREFILL_CHUNK_START, start as i64),
                        KeyValue::new(attr::PREFILL_CHUNK_TOKENS, chunk.len() as i64),
                        KeyValue::new(attr::PREFILL_CHUNK_DURATION_MS, ms),
                    ],
                );
            }
        }
        logits.ok_or_else(|| candle_core::Error::Msg("empty prompt".into()))
    }

    /// Runs `prompt` into `cache` in chunks as [`Transformer::prefill`] does, but keeps every
    /// position's logits: `on_chunk(start, logits)` receives each chunk's `(t, vocab)` logits,
    /// the first row at position `start`, so a long prompt never holds `len × vocab` floats
    /// at once. For scoring a prompt ([`super::score`]).
    pub fn prefill_all_logits(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
        schedule: &Scheduler,
        on_chunk: &mut dyn FnMut(usize, &Tensor) -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        if prompt.is_empty() {
            candle_core::bail!("empty prompt");
        }
        for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
            let x = self.hidden(chunk, cache, schedule)?;
            let logits = {
                let _turn = schedule.compute_turn();
                self.head(&x)?
            };
            on_chunk(i * PREFILL_CHUNK, &logits)?;
        }
        Ok(())
    }
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

/// RoPE tables for the interleaved (GGUF llama) layout, computed as candle's quantized llama
/// does so the two agree bit for bit.
pub(super) fn rope_tables(
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

#[cfg(test)]
mod tests;
