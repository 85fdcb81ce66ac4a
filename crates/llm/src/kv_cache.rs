//! One request's KV cache, preallocated for the prompt and every token it may generate and
//! written in place: candle tensors on the device, or host buffers that the CPU decoder
//! ([`super::cpu_decode`]) steps through and the prefill forward writes and reads back.
//! A live cache is counted in the KV-cache gauges.

use candle_core::{DType, Device, Tensor};

use super::host_kv::{HostKv, KvDtype};
use super::weights::Config;
use serde::{Deserialize, Serialize};

/// A digest of the cache's positions `0..len` (prompt, then each token fed back): what a
/// failure snapshot keeps and its replay compares.
///
/// For layer `l` and position `p` the digested bytes are that position's keys of every KV head
/// in head order (`head_dim` f32 each), then its values likewise, as little-endian f32.
/// `layers[l]` is the sha256 of those bytes for `p = 0..len` in order; `positions[p]` is, for
/// each layer in order, the first 4 bytes of the sha256 of position `p`'s bytes alone, as 8
/// hex digits (`n_layer × 8` digits per position).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvDigest {
    pub len: usize,
    pub layers: Vec<String>,
    pub positions: Vec<String>,
}

/// The keys and values of one request: per layer `(n_kv_head, capacity, head_dim)`, written in
/// place. Head-major so every head's keys are one contiguous run, as the attention matmuls (and
/// cuBLAS) want them.
/// On a GPU the cache is allocated there, once per request, and never copied.
pub(super) struct KvCache {
    pub store: KvStore,
    pub len: usize,
    pub capacity: usize,
    n_kv_head: usize,
    head_dim: usize,
    /// Bytes counted in the KV-cache gauges while this cache lives.
    bytes: u64,
    on_gpu: bool,
}

pub(super) enum KvStore {
    /// Candle tensors per layer: the GPU, and the formats that decode on candle's ops.
    Tensors { k: Vec<Tensor>, v: Vec<Tensor> },
    /// Plain host buffers (same layout) that [`CpuDecoder`](super::cpu_decode::CpuDecoder)
    /// and the CPU prefill ([`super::cpu_prefill`]) write in place and attend over.
    Host(HostKv),
}

impl KvCache {
    /// `host`: buffers for the CPU decoder, in that dtype, instead of F32 device tensors.
    pub fn new(
        cfg: &Config,
        capacity: usize,
        device: &Device,
        host: Option<KvDtype>,
    ) -> candle_core::Result<KvCache> {
        let store = if let Some(dtype) = host {
            KvStore::Host(HostKv::new(
                cfg.n_layer,
                cfg.n_kv_head,
                cfg.head_dim,
                capacity,
                dtype,
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
        let size = host.map_or(4, KvDtype::size);
        let bytes = (2 * cfg.n_layer * cfg.n_kv_head * capacity * cfg.head_dim * size) as u64;
        let on_gpu = !device.is_cpu();
        Self::account(bytes, capacity as u64, on_gpu, true);
        Ok(KvCache {
            store,
            len: 0,
            capacity,
            n_kv_head: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            bytes,
            on_gpu,
        })
    }

    /// Layer `li`'s keys and values at positions `start..start + n`, each `(n_kv_head, n,
    /// head_dim)` in a flat host buffer (how the prefix cache takes a prompt's blocks).
    pub fn read_span(
        &self,
        li: usize,
        start: usize,
        n: usize,
    ) -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
        self.check_span(start, n)?;
        let (nkv, hd, cap) = (self.n_kv_head, self.head_dim, self.capacity);
        match &self.store {
            KvStore::Host(kv) => Ok(read_rows(kv, li, (nkv, cap, hd), start, n)),
            KvStore::Tensors { k, v } => {
                let read = |t: &Tensor| t.narrow(1, start, n)?.flatten_all()?.to_vec1::<f32>();
                Ok((read(&k[li])?, read(&v[li])?))
            }
        }
    }

    /// Writes layer `li`'s keys and values for positions `start..start + n`, laid out as
    /// [`KvCache::read_span`] returns them (how a prefix-cache hit enters a request's cache).
    pub fn write_span(
        &mut self,
        li: usize,
        start: usize,
        n: usize,
        keys: &[f32],
        values: &[f32],
    ) -> candle_core::Result<()> {
        self.check_span(start, n)?;
        let (nkv, hd, cap) = (self.n_kv_head, self.head_dim, self.capacity);
        if keys.len() != nkv * n * hd || values.len() != keys.len() {
            candle_core::bail!("{} keys for {n} positions", keys.len());
        }
        match &mut self.store {
            KvStore::Host(kv) => write_rows(kv, li, (keys, values), (cap, hd), start, n),
            KvStore::Tensors { k, v } => {
                for (t, src) in [(&k[li], keys), (&v[li], values)] {
                    let src = Tensor::from_slice(src, (nkv, n, hd), t.device())?;
                    t.slice_set(&src, 1, start)?;
                }
            }
        }
        Ok(())
    }

    /// Bytes this cache holds (all of its capacity).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The failure-snapshot digest of positions `0..len` ([`KvDigest`] says exactly which
    /// bytes are hashed).
    pub fn digest(&self) -> candle_core::Result<KvDigest> {
        let (layers, positions) = self.digests(0, self.len, true)?;
        Ok(KvDigest {
            len: self.len,
            layers,
            positions,
        })
    }

    /// [`KvDigest::positions`] for positions `start..start + n` alone (replay checks each
    /// position as it is written).
    pub fn position_digests(&self, start: usize, n: usize) -> candle_core::Result<Vec<String>> {
        Ok(self.digests(start, n, false)?.1)
    }

    /// Per layer the sha256 over the positions (when `whole`), and per position the layers'
    /// truncated digests.
    fn digests(
        &self,
        start: usize,
        n: usize,
        whole: bool,
    ) -> candle_core::Result<(Vec<String>, Vec<String>)> {
        use sha2::{Digest, Sha256};
        let (nkv, hd) = (self.n_kv_head, self.head_dim);
        let n_layer = match &self.store {
            KvStore::Host(kv) => kv.n_layers(),
            KvStore::Tensors { k, .. } => k.len(),
        };
        let mut layers = Vec::with_capacity(n_layer);
        let mut positions = vec![String::with_capacity(8 * n_layer); n];
        let mut bytes = Vec::with_capacity(2 * nkv * hd * 4);
        for li in 0..n_layer {
            let (k, v) = self.read_span(li, start, n)?;
            let mut layer = Sha256::new();
            for (p, digest) in positions.iter_mut().enumerate() {
                bytes.clear();
                for rows in [&k, &v] {
                    for g in 0..nkv {
                        for x in &rows[(g * n + p) * hd..][..hd] {
                            bytes.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                }
                if whole {
                    layer.update(&bytes);
                }
                digest.push_str(&hex::encode(&Sha256::digest(&bytes)[..4]));
            }
            if whole {
                layers.push(hex::encode(layer.finalize()));
            }
        }
        Ok((layers, positions))
    }

    fn check_span(&self, start: usize, n: usize) -> candle_core::Result<()> {
        if start + n > self.capacity {
            candle_core::bail!(
                "positions {start}..{} of a cache of {}",
                start + n,
                self.capacity
            );
        }
        Ok(())
    }

    fn account(bytes: u64, tokens: u64, on_gpu: bool, add: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let usage = &telemetry::metrics::KV_CACHE;
        let gpu = &telemetry::gpu::memory::KV_CACHE_BYTES;
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

/// Writes layer `li`'s keys `k` and values `v`, each `(n_kv_head, t, head_dim)`, into a host
/// cache at positions `pos..pos + t`.
pub(super) fn write_host(
    kv: &mut HostKv,
    li: usize,
    (k, v): (&Tensor, &Tensor),
    pos: usize,
) -> candle_core::Result<()> {
    let (_, t, hd) = k.dims3()?;
    let (k, v) = (
        k.flatten_all()?.to_vec1::<f32>()?,
        v.flatten_all()?.to_vec1::<f32>()?,
    );
    write_rows(kv, li, (&k, &v), (kv.capacity, hd), pos, t);
    Ok(())
}

/// Layer `li`'s first `len` positions of a host cache as `(n_kv_head, len, head_dim)` tensors
/// of keys and values.
pub(super) fn read_host(
    kv: &HostKv,
    li: usize,
    (nkv, hd): (usize, usize),
    len: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (k, v) = read_rows(kv, li, (nkv, kv.capacity, hd), 0, len);
    Ok((
        Tensor::from_vec(k, (nkv, len, hd), &Device::Cpu)?,
        Tensor::from_vec(v, (nkv, len, hd), &Device::Cpu)?,
    ))
}

/// Layer `li`'s keys and values at positions `start..start + n` of a host cache
/// `(n_kv_head, cap, head_dim)`, each as `(n_kv_head, n, head_dim)`.
fn read_rows(
    kv: &HostKv,
    li: usize,
    (nkv, cap, hd): (usize, usize, usize),
    start: usize,
    n: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut k = Vec::with_capacity(nkv * n * hd);
    let mut v = Vec::with_capacity(nkv * n * hd);
    for g in 0..nkv {
        let at = (g * cap + start) * hd;
        kv.read(li, at..at + n * hd, &mut k, &mut v);
    }
    (k, v)
}

/// Writes layer `li`'s `keys` and `values`, each `(n_kv_head, n, head_dim)`, at positions
/// `pos..pos + n` of a host cache `(n_kv_head, cap, head_dim)`.
fn write_rows(
    kv: &mut HostKv,
    li: usize,
    (keys, values): (&[f32], &[f32]),
    (cap, hd): (usize, usize),
    pos: usize,
    n: usize,
) {
    for (g, (k, v)) in keys
        .chunks_exact(n * hd)
        .zip(values.chunks_exact(n * hd))
        .enumerate()
    {
        kv.write(li, (g * cap + pos) * hd, k, v);
    }
}
