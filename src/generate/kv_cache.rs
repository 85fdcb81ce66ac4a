//! One request's KV cache, preallocated for the prompt and every token it may generate and
//! written in place: candle tensors on the device, or host buffers that the CPU decoder
//! ([`super::cpu_decode`]) steps through and the prefill forward writes and reads back.
//! A live cache is counted in the KV-cache gauges.

use candle_core::{DType, Device, Tensor};

use super::cpu_decode::HostKv;
use super::weights::Config;

/// The keys and values of one request: per layer `(n_kv_head, capacity, head_dim)`, written in
/// place. Head-major so every head's keys are one contiguous run, as the attention matmuls (and
/// cuBLAS) want them.
/// On a GPU the cache is allocated there, once per request, and never copied.
pub(super) struct KvCache {
    pub store: KvStore,
    pub len: usize,
    pub capacity: usize,
    /// Bytes counted in the KV-cache gauges while this cache lives.
    bytes: u64,
    on_gpu: bool,
}

pub(super) enum KvStore {
    /// Candle tensors per layer: the GPU, and the formats that decode on candle's ops.
    Tensors { k: Vec<Tensor>, v: Vec<Tensor> },
    /// Plain host buffers (same layout) that [`CpuDecoder`](super::cpu_decode::CpuDecoder) writes in place; prefill writes
    /// them through candle and reads them back for its attention.
    Host(HostKv),
}

impl KvCache {
    /// `host`: buffers for the CPU decoder instead of device tensors.
    pub fn new(
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

/// Writes `x` `(n_kv_head, t, head_dim)` into a host cache `(n_kv_head, cap, head_dim)` at
/// positions `pos..pos + t`.
pub(super) fn write_host(
    buf: &mut [f32],
    x: &Tensor,
    cap: usize,
    pos: usize,
) -> candle_core::Result<()> {
    let (nkv, t, hd) = x.dims3()?;
    let data = x.flatten_all()?.to_vec1::<f32>()?;
    for (g, rows) in data.chunks_exact(t * hd).enumerate().take(nkv) {
        buf[(g * cap + pos) * hd..][..t * hd].copy_from_slice(rows);
    }
    Ok(())
}

/// The first `len` positions of a host cache `(n_kv_head, cap, head_dim)` as a
/// `(n_kv_head, len, head_dim)` tensor.
pub(super) fn read_host(
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
