//! Prefix KV reuse (what vLLM calls automatic prefix caching): the keys and values of recently
//! prefilled prompts, kept in blocks of [`BLOCK_TOKENS`] tokens, so a prompt that starts the
//! same way (the fixed system head of every RAG prompt, a repeated question, a chat whose history
//! is the previous turn's prompt) copies those positions into its own KV cache and prefills only
//! the rest ([`super::llama::Llama`]'s prefill).
//!
//! A block's key is a hash chained over every token before it and its own, so one key names a
//! whole prefix at its positions. Each block also keeps its tokens and its parent's key, and a
//! lookup walks from the first block checking both, so a hash collision reads as a miss, never
//! as someone else's keys and values. Only positions the prefill computed are cached (not decoded
//! ones): decode steps compute with other weights and kernels, and a hit must give the logits a
//! cold prefill would. Bounded in bytes, least recently used block first; a lookup or insert
//! touches a prefix's blocks last to first, so a block always leaves before its ancestors and
//! nothing cached is ever unreachable. Blocks are shared (`Arc`), so a request copies its hit
//! outside the lock while another request inserts or evicts.
//!
//! A prompt asked again in full skips its prefill altogether: beside the block its reusable
//! prefix ends with, the cache keeps the prompt's last positions (the partial block a prefill
//! must otherwise compute) and the logits its prefill ended on, so a repeated question (the
//! load generator's popular ones, a client retrying) restores every position and starts
//! decoding at once, with the logits a cold prefill of that prompt gave.
//!
//! Blocks live in host memory whichever cache store the request has: the CPU decoder's host
//! buffers (the CPU default) or candle tensors (the other formats, and a GPU, where a hit
//! crosses to the device in one copy per layer). Both stores are tested on the CPU; the GPU
//! runs the same candle ops but has not been run with a hit on a GPU. Blocks are kept in the
//! dtype of the caches they come from: F16 for the CPU decoder's default cache (exactly its
//! values, in half the bytes of F32, so the same budget holds twice the prompts), else F32.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::host_kv::KvDtype;
use super::kv_cache::KvCache;
use super::weights::Config;
use telemetry::metrics::PREFIX_CACHE;

/// Tokens per block: the granularity of a hit. Small enough that a repeated prompt recomputes
/// at most 16 positions; large enough that a 600-token prompt is ~40 map entries.
pub(super) const BLOCK_TOKENS: usize = 16;

/// The default budget, in MiB: ~11,600 positions of SmolLM2-135M (22.5 KiB each in F16, the
/// CPU default; half as many in F32), about fifty default RAG prompts, less than the model's
/// own prefill weights.
pub const DEFAULT_MB: usize = 256;

/// Whole prompts' ends a block keeps (the most recent; prompts that share every block but
/// differ in their last positions).
const TAILS_PER_BLOCK: usize = 4;

/// One cached block of a prefix.
struct Block {
    /// The previous block's key (`None` for a prompt's first block).
    parent: Option<u64>,
    tokens: [u32; BLOCK_TOKENS],
    /// Per layer: keys, then values, each `(n_kv_head, BLOCK_TOKENS, head_dim)`.
    kv: BlockKv,
    /// The ends of whole prompts whose reusable prefix ends with this block, oldest first.
    tails: Vec<Tail>,
    /// This block's bytes and its tails'.
    bytes: u64,
    /// Position in the LRU order (larger: used more recently).
    tick: u64,
}

/// The end of a whole prompt: the positions after its reusable blocks (1 to [`BLOCK_TOKENS`])
/// and the last position's logits.
struct Tail {
    tokens: Vec<u32>,
    /// Per layer: keys, then values, each `(n_kv_head, tokens.len(), head_dim)`.
    kv: BlockKv,
    logits: Arc<[f32]>,
}

impl Tail {
    fn bytes(&self) -> u64 {
        self.kv.bytes() + 4 * self.logits.len() as u64
    }
}

/// A block's keys and values, in the dtype of the caches they came from.
#[derive(Clone)]
enum BlockKv {
    F32(Arc<[f32]>),
    F16(Arc<[f16]>),
}

impl BlockKv {
    fn bytes(&self) -> u64 {
        match self {
            BlockKv::F32(x) => 4 * x.len() as u64,
            BlockKv::F16(x) => 2 * x.len() as u64,
        }
    }

    /// Elements `range` as F32, into `out`.
    fn read(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            BlockKv::F32(x) => out.copy_from_slice(&x[range]),
            BlockKv::F16(x) => x[range].convert_to_f32_slice(out),
        }
    }
}

#[derive(Default)]
struct Blocks {
    by_key: HashMap<u64, Block>,
    /// tick → key, oldest first.
    lru: BTreeMap<u64, u64>,
    next_tick: u64,
    bytes: u64,
}

/// A lookup's result: the cached blocks of the prompt's longest cached prefix, in order, and
/// when the whole prompt was cached, its end.
pub(super) struct Hit {
    blocks: Vec<BlockKv>,
    /// The positions after the blocks, their count, and the prompt's last logits.
    tail: Option<(BlockKv, usize, Arc<[f32]>)>,
}

impl Hit {
    /// Prompt positions the hit covers.
    pub fn tokens(&self) -> usize {
        self.blocks.len() * BLOCK_TOKENS + self.tail.as_ref().map_or(0, |t| t.1)
    }

    /// The last position's logits, when the whole prompt was cached (nothing to prefill).
    pub fn logits(&self) -> Option<&[f32]> {
        self.tail.as_ref().map(|t| &t.2[..])
    }
}

/// Counts since the cache was made (the process-wide sums feed the `ragscope.prefix_cache.*`
/// metrics).
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub lookups: AtomicU64,
    pub hits: AtomicU64,
    pub hit_tokens: AtomicU64,
    pub evictions: AtomicU64,
}

/// One model's prefix cache, shared by all its requests.
pub(super) struct PrefixCache {
    budget: u64,
    /// How blocks are stored.
    dtype: KvDtype,
    n_layer: usize,
    n_kv_head: usize,
    head_dim: usize,
    blocks: Mutex<Blocks>,
    pub counts: Counts,
}

impl PrefixCache {
    /// A cache of at most `budget` bytes of blocks for a model shaped `cfg` (0: off), taking
    /// blocks from caches in `dtype` and keeping them so (F16 only from F16 caches: storing a
    /// cache's F32 values in F16 would round them, and a hit must give what a cold prefill
    /// gives).
    pub fn new(cfg: &Config, budget: u64, dtype: KvDtype) -> PrefixCache {
        PrefixCache {
            budget,
            dtype,
            n_layer: cfg.n_layer,
            n_kv_head: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            blocks: Mutex::default(),
            counts: Counts::default(),
        }
    }

    /// Floats of one layer's keys (or values) in one block.
    fn half_layer(&self) -> usize {
        self.n_kv_head * BLOCK_TOKENS * self.head_dim
    }

    fn block_bytes(&self) -> u64 {
        (self.n_layer * 2 * self.half_layer() * self.dtype.size()) as u64
    }

    /// The budget this cache was made with (a model's new KV dtype makes it anew).
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Whether a block fits the budget at all.
    pub fn enabled(&self) -> bool {
        self.budget >= self.block_bytes()
    }

    /// Bytes of blocks held now (the process-wide sum is the `ragscope.prefix_cache.bytes` gauge).
    #[cfg(test)]
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Blocks> {
        // Nothing panics while the lock is held; a poisoned cache is still consistent.
        self.blocks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The longest cached block-aligned prefix of `prompt` that leaves at least one token to
    /// compute (a prefill must produce the last position's logits), or with `whole` the whole
    /// prompt when it was cached with its end (then nothing is left to compute).
    pub fn lookup(&self, prompt: &[u32], whole: bool) -> Hit {
        let mut hit = Hit {
            blocks: Vec::new(),
            tail: None,
        };
        if !self.enabled() {
            return hit;
        }
        let (usable, keys) = reusable(prompt);
        let mut blocks = self.lock();
        let matched = blocks.matching(usable, &keys);
        blocks.touch(&keys[..matched]);
        hit.blocks = keys[..matched]
            .iter()
            .map(|k| blocks.by_key[k].kv.clone())
            .collect();
        if whole && matched == keys.len() {
            hit.tail = blocks
                .tail(&keys, &prompt[usable.len()..])
                .map(|t| (t.kv.clone(), t.tokens.len(), t.logits.clone()));
        }
        drop(blocks);
        self.count(&self.counts.lookups, &PREFIX_CACHE.lookups, 1);
        if matched > 0 {
            self.count(&self.counts.hits, &PREFIX_CACHE.hits, 1);
            let n = hit.tokens() as u64;
            self.count(&self.counts.hit_tokens, &PREFIX_CACHE.hit_tokens, n);
        }
        hit
    }

    /// Tokens of `prompt` that a whole [`PrefixCache::lookup`] would find now, without using
    /// the blocks or counting a lookup (admission's guess at a prefill's cost).
    pub fn peek(&self, prompt: &[u32]) -> usize {
        if !self.enabled() {
            return 0;
        }
        let (usable, keys) = reusable(prompt);
        let blocks = self.lock();
        let matched = blocks.matching(usable, &keys);
        let tail = match matched == keys.len() {
            true => blocks.tail(&keys, &prompt[usable.len()..]),
            false => None,
        };
        matched * BLOCK_TOKENS + tail.map_or(0, |t| t.tokens.len())
    }

    fn count(&self, own: &AtomicU64, global: &AtomicU64, n: u64) {
        own.fetch_add(n, Relaxed);
        global.fetch_add(n, Relaxed);
    }

    /// Copies `hit` into positions `0..hit.tokens()` of the empty `cache`.
    pub fn restore(&self, hit: &Hit, cache: &mut KvCache) -> candle_core::Result<()> {
        let n = hit.tokens();
        if n == 0 {
            return Ok(());
        }
        if cache.len != 0 || n > cache.capacity {
            candle_core::bail!(
                "a prefix of {n} into a cache holding {} of {}",
                cache.len,
                cache.capacity
            );
        }
        let (nkv, hd) = (self.n_kv_head, self.head_dim);
        let mut k = vec![0f32; nkv * n * hd];
        let mut v = vec![0f32; nkv * n * hd];
        // Each piece (a block, or the tail) holds per layer `(nkv, len, hd)` keys then values;
        // its positions go at `first..first + len` of every kv head's rows.
        let pieces = hit
            .blocks
            .iter()
            .enumerate()
            .map(|(b, kv)| (kv, b * BLOCK_TOKENS, BLOCK_TOKENS))
            .chain(
                hit.tail
                    .as_ref()
                    .map(|(kv, len, _)| (kv, hit.blocks.len() * BLOCK_TOKENS, *len)),
            );
        let pieces: Vec<_> = pieces.collect();
        for li in 0..self.n_layer {
            for &(kv, first, len) in &pieces {
                let (row, half) = (len * hd, nkv * len * hd);
                let (pk, pv) = (li * 2 * half, li * 2 * half + half);
                for g in 0..nkv {
                    let at = (g * n + first) * hd;
                    let from = g * row..(g + 1) * row;
                    kv.read(pk + from.start..pk + from.end, &mut k[at..at + row]);
                    kv.read(pv + from.start..pv + from.end, &mut v[at..at + row]);
                }
            }
            cache.write_span(li, 0, n, &k, &v)?;
        }
        cache.len = n;
        Ok(())
    }

    /// Caches the full blocks of `prompt` that `cache` holds (prefilled) and the cache does not
    /// have yet, evicting the least recently used blocks to stay within the budget; with the
    /// prompt's last `logits`, also its end (see [`PrefixCache::lookup`]'s `whole`).
    pub fn insert(
        &self,
        prompt: &[u32],
        cache: &KvCache,
        logits: Option<&[f32]>,
    ) -> candle_core::Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        let full = prompt.len().min(cache.len) / BLOCK_TOKENS;
        let whole = &prompt[..full * BLOCK_TOKENS];
        let keys = chain_keys(whole);
        // The end a repeat of the whole prompt would restore: the positions after its reusable
        // blocks, which `keys` starts with.
        let usable = prompt.len().saturating_sub(1) / BLOCK_TOKENS;
        let (have, has_end) = {
            let blocks = self.lock();
            let have = blocks.matching(whole, &keys);
            let ends = usable > 0 && have >= usable;
            let has_end = ends
                && blocks
                    .tail(&keys[..usable], &prompt[usable * BLOCK_TOKENS..])
                    .is_some();
            (have, has_end)
        };
        let end = (usable > 0 && cache.len >= prompt.len() && !has_end)
            .then_some(logits)
            .flatten();
        if have == full && end.is_none() {
            return Ok(());
        }
        // Copy what is new out of the request's cache without holding the lock.
        let new: Vec<BlockKv> = (have..full)
            .map(|b| self.copy_out(cache, b * BLOCK_TOKENS, BLOCK_TOKENS))
            .collect::<candle_core::Result<_>>()?;
        let end = match end {
            Some(logits) => {
                let first = usable * BLOCK_TOKENS;
                Some(Tail {
                    tokens: prompt[first..].to_vec(),
                    kv: self.copy_out(cache, first, prompt.len() - first)?,
                    logits: logits.into(),
                })
            }
            None => None,
        };

        let bytes = self.block_bytes();
        let mut blocks = self.lock();
        // Another request may have cached some of them meanwhile, or evicted the blocks ours
        // would hang from (then ours would be unreachable: keep none).
        let now = blocks.matching(whole, &keys);
        if now < have {
            return Ok(());
        }
        // The prefix so far becomes the most recently used, so eviction takes other blocks
        // first; reaching one of these means the budget holds nothing else.
        blocks.touch(&keys[..now]);
        let keep_from = blocks.next_tick - now as u64;
        let (mut cached, mut evicted) = (now, 0);
        for (i, kv) in (have..full).zip(new) {
            if i < now {
                continue;
            }
            if !blocks.make_room(bytes, self.budget, keep_from, &mut evicted) {
                break;
            }
            let tick = blocks.tick();
            let block = Block {
                parent: i.checked_sub(1).map(|p| keys[p]),
                tokens: whole[i * BLOCK_TOKENS..][..BLOCK_TOKENS]
                    .try_into()
                    .expect("one block of tokens"),
                kv,
                tails: Vec::new(),
                bytes,
                tick,
            };
            blocks.lru.insert(tick, keys[i]);
            blocks.by_key.insert(keys[i], block);
            blocks.bytes += bytes;
            PREFIX_CACHE.bytes.fetch_add(bytes, Relaxed);
            cached = i + 1;
        }
        blocks.touch(&keys[..cached]);
        if let Some(end) = end.filter(|_| cached >= usable) {
            let keep_from = blocks.next_tick - cached as u64;
            let more = end.bytes();
            if blocks.tail(&keys[..usable], &end.tokens).is_none()
                && blocks.make_room(more, self.budget, keep_from, &mut evicted)
            {
                let host = blocks
                    .by_key
                    .get_mut(&keys[usable - 1])
                    .expect("kept above");
                host.tails.push(end);
                host.bytes += more;
                let mut freed = 0;
                if host.tails.len() > TAILS_PER_BLOCK {
                    freed = host.tails.remove(0).bytes();
                    host.bytes -= freed;
                }
                blocks.bytes = blocks.bytes + more - freed;
                PREFIX_CACHE.bytes.fetch_add(more, Relaxed);
                PREFIX_CACHE.bytes.fetch_sub(freed, Relaxed);
            }
        }
        drop(blocks);
        self.count(&self.counts.evictions, &PREFIX_CACHE.evictions, evicted);
        Ok(())
    }

    /// Positions `first..first + len` of `cache`, as a block or a tail holds them: per layer
    /// the keys, then the values, each `(n_kv_head, len, head_dim)`, in this cache's dtype.
    fn copy_out(&self, cache: &KvCache, first: usize, len: usize) -> candle_core::Result<BlockKv> {
        let mut kv = Vec::with_capacity(self.n_layer * 2 * self.n_kv_head * len * self.head_dim);
        for li in 0..self.n_layer {
            let (k, v) = cache.read_span(li, first, len)?;
            kv.extend_from_slice(&k);
            kv.extend_from_slice(&v);
        }
        Ok(match self.dtype {
            KvDtype::F32 => BlockKv::F32(kv.into()),
            KvDtype::F16 => {
                let mut half = vec![f16::ZERO; kv.len()];
                half.convert_from_f32_slice(&kv);
                BlockKv::F16(half.into())
            }
        })
    }
}

impl Drop for PrefixCache {
    fn drop(&mut self) {
        PREFIX_CACHE.bytes.fetch_sub(self.lock().bytes, Relaxed);
    }
}

impl Blocks {
    /// How many leading blocks of `prompt` (keyed `keys`) are cached, each checked against its
    /// parent and its tokens.
    fn matching(&self, prompt: &[u32], keys: &[u64]) -> usize {
        let mut parent = None;
        for (i, (key, tokens)) in keys
            .iter()
            .zip(prompt.chunks_exact(BLOCK_TOKENS))
            .enumerate()
        {
            match self.by_key.get(key) {
                Some(b) if b.parent == parent && b.tokens[..] == *tokens => parent = Some(*key),
                _ => return i,
            }
        }
        keys.len()
    }

    /// The end cached for a whole prompt whose reusable blocks are `keys` (all cached) and
    /// whose last positions are `tokens`.
    fn tail(&self, keys: &[u64], tokens: &[u32]) -> Option<&Tail> {
        let host = self.by_key.get(keys.last()?)?;
        host.tails.iter().find(|t| t.tokens == tokens)
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    /// Marks a cached prefix used, last block first, so each block is more recent than every
    /// block after it.
    fn touch(&mut self, keys: &[u64]) {
        for key in keys.iter().rev() {
            let tick = self.tick();
            let block = self.by_key.get_mut(key).expect("touched blocks are cached");
            self.lru.remove(&block.tick);
            block.tick = tick;
            self.lru.insert(tick, *key);
        }
    }

    /// Evicts least recently used blocks until `bytes` more fit the budget; `false` when they
    /// cannot (the budget is smaller, or only blocks used since tick `keep_from` are left).
    fn make_room(&mut self, bytes: u64, budget: u64, keep_from: u64, evicted: &mut u64) -> bool {
        while self.bytes + bytes > budget {
            let Some((&tick, &key)) = self.lru.first_key_value() else {
                return false;
            };
            if tick > keep_from {
                return false;
            }
            self.lru.remove(&tick);
            let gone = self
                .by_key
                .remove(&key)
                .expect("the LRU names cached blocks");
            self.bytes -= gone.bytes;
            PREFIX_CACHE.bytes.fetch_sub(gone.bytes, Relaxed);
            *evicted += 1;
        }
        true
    }
}

/// The key of every block of `prompt` (whole blocks only): each hashes its parent's key and
/// its own tokens, so it stands for the whole prefix up to its end.
/// The whole blocks of `prompt` a prefill may take from the cache (at least its last token is
/// left to compute), with their chain keys.
fn reusable(prompt: &[u32]) -> (&[u32], Vec<u64>) {
    let usable = prompt.len().saturating_sub(1) / BLOCK_TOKENS;
    let prompt = &prompt[..usable * BLOCK_TOKENS];
    (prompt, chain_keys(prompt))
}

fn chain_keys(prompt: &[u32]) -> Vec<u64> {
    let mut parent = 0u64;
    prompt
        .chunks_exact(BLOCK_TOKENS)
        .map(|tokens| {
            // SipHash with fixed keys: the same key in every run and on every thread.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            parent.hash(&mut h);
            tokens.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests;
