//! The prefix cache: block keys, hits and eviction on a tiny model shape, and on the real model the same tokens with and without a hit.
use candle_core::Device;

use super::*;
use crate::llama::{Llama, WeightFormat};
use crate::testing::{
    long_prompt, max_abs_diff, model, model_path, rag_messages, request, run, zorbia_prompt,
    MAX_CONTEXT,
};
use crate::{ChatMessage, ChatTokenizer, KvDtype, Sampling};

/// A tiny model shape: 2 layers, 2 kv heads of 4 dims.
fn tiny() -> Config {
    Config {
        n_layer: 2,
        n_head: 2,
        n_kv_head: 2,
        head_dim: 4,
        ffn: 8,
        rms_eps: 1e-5,
        rope_base: 10000.0,
        context_length: 256,
    }
}

/// A host cache holding `len` positions whose values name their layer, position and lane.
fn filled(cfg: &Config, len: usize, salt: f32) -> KvCache {
    let mut cache = KvCache::new(cfg, 128, &Device::Cpu, Some(KvDtype::F32)).unwrap();
    let n = cfg.n_kv_head * len * cfg.head_dim;
    for li in 0..cfg.n_layer {
        let k: Vec<f32> = (0..n).map(|i| salt + (li * 100_000 + i) as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        cache.write_span(li, 0, len, &k, &v).unwrap();
    }
    cache.len = len;
    cache
}

fn prompt(len: usize, first: u32) -> Vec<u32> {
    (0..len as u32).map(|i| first + i).collect()
}

#[test]
fn lookup_finds_the_longest_cached_block_prefix_and_leaves_a_token_to_compute() {
    let cfg = tiny();
    let cache = PrefixCache::new(&cfg, 1 << 20, KvDtype::F32);
    let a = prompt(40, 1000);
    let source = filled(&cfg, 40, 0.5);
    assert_eq!(cache.lookup(&a, false).tokens(), 0);
    cache.insert(&a, &source, None).unwrap();
    assert_eq!(cache.bytes(), 2 * cache.block_bytes(), "two whole blocks");

    let hit = cache.lookup(&a, false);
    assert_eq!(hit.tokens(), 32);
    // A prompt of exactly two blocks reuses one: its last token must still be computed.
    assert_eq!(cache.lookup(&a[..32], false).tokens(), 16);
    assert_eq!(cache.lookup(&a[..33], false).tokens(), 32);
    let mut b = a.clone();
    b[20] = 7;
    assert_eq!(
        cache.lookup(&b, false).tokens(),
        16,
        "differs in the second block"
    );
    b[3] = 7;
    assert_eq!(
        cache.lookup(&b, false).tokens(),
        0,
        "differs in the first block"
    );
    // A peek finds what a lookup would, and counts nothing.
    assert_eq!(
        (cache.peek(&a), cache.peek(&a[..32]), cache.peek(&b)),
        (32, 16, 0)
    );
    assert_eq!(cache.counts.lookups.load(Relaxed), 6);
    assert_eq!(cache.counts.hits.load(Relaxed), 4);
    assert_eq!(cache.counts.hit_tokens.load(Relaxed), 32 + 16 + 32 + 16);

    // The hit restores exactly the source's keys and values.
    let mut fresh = KvCache::new(&cfg, 128, &Device::Cpu, Some(KvDtype::F32)).unwrap();
    cache.restore(&hit, &mut fresh).unwrap();
    assert_eq!(fresh.len, 32);
    for li in 0..cfg.n_layer {
        assert_eq!(
            fresh.read_span(li, 0, 32).unwrap(),
            source.read_span(li, 0, 32).unwrap()
        );
    }
    // Into tensors too (the store of the formats that decode on candle's ops).
    let mut tensors = KvCache::new(&cfg, 128, &Device::Cpu, None).unwrap();
    cache.restore(&hit, &mut tensors).unwrap();
    assert_eq!(
        tensors.read_span(1, 0, 32).unwrap(),
        source.read_span(1, 0, 32).unwrap()
    );
    // Only an empty cache takes a prefix.
    assert!(cache.restore(&hit, &mut tensors).is_err());
}

/// A prompt inserted with its logits comes back whole: every position, and the logits, so
/// nothing is left to prefill; only the same tokens, all of them, make that hit.
#[test]
fn a_whole_prompt_comes_back_with_its_end_and_logits() {
    let cfg = tiny();
    let cache = PrefixCache::new(&cfg, 1 << 20, KvDtype::F32);
    let a = prompt(40, 1000);
    let source = filled(&cfg, 40, 0.5);
    let logits: Vec<f32> = (0..50).map(|i| i as f32 * 0.5).collect();
    cache.insert(&a, &source, Some(&logits)).unwrap();
    let end = (2 * cfg.n_layer * cfg.n_kv_head * 8 * cfg.head_dim + 50) as u64 * 4;
    assert_eq!(cache.bytes(), 2 * cache.block_bytes() + end);

    let hit = cache.lookup(&a, true);
    assert_eq!((hit.tokens(), hit.logits()), (40, Some(&logits[..])));
    assert_eq!(cache.peek(&a), 40);
    let mut fresh = KvCache::new(&cfg, 128, &Device::Cpu, Some(KvDtype::F32)).unwrap();
    cache.restore(&hit, &mut fresh).unwrap();
    assert_eq!(fresh.len, 40);
    for li in 0..cfg.n_layer {
        assert_eq!(
            fresh.read_span(li, 0, 40).unwrap(),
            source.read_span(li, 0, 40).unwrap()
        );
    }
    // Without `whole`, the blocks only.
    let blocks = cache.lookup(&a, false);
    assert_eq!((blocks.tokens(), blocks.logits()), (32, None));
    // Another ending, a shorter or a longer prompt: the blocks, and its end to compute.
    let mut b = a.clone();
    b[39] = 7;
    let longer = prompt(41, 1000);
    for other in [&b[..], &a[..39], &longer[..]] {
        let hit = cache.lookup(other, true);
        assert_eq!((hit.tokens(), hit.logits().is_none()), (32, true));
    }
    // The same prompt again adds nothing; a prompt of exactly two blocks keeps its second
    // block as its end.
    cache.insert(&a, &source, Some(&logits)).unwrap();
    assert_eq!(cache.bytes(), 2 * cache.block_bytes() + end);
    let two = prompt(32, 1000);
    cache
        .insert(&two, &filled(&cfg, 32, 0.5), Some(&logits))
        .unwrap();
    assert_eq!(cache.lookup(&two, true).tokens(), 32);
    assert_eq!(cache.lookup(&two, false).tokens(), 16);
}

/// Blocks from an F16 request cache are kept in F16: half the bytes of F32 blocks, and a
/// hit restores the request cache's values exactly.
#[test]
fn f16_blocks_take_half_the_bytes_and_restore_exactly() {
    let cfg = tiny();
    let wide = PrefixCache::new(&cfg, 1 << 20, KvDtype::F32);
    let cache = PrefixCache::new(&cfg, 1 << 20, KvDtype::F16);
    assert_eq!(2 * cache.block_bytes(), wide.block_bytes());
    let f16 = Some(KvDtype::F16);
    let mut source = KvCache::new(&cfg, 128, &Device::Cpu, f16).unwrap();
    let n = cfg.n_kv_head * 40 * cfg.head_dim;
    for li in 0..cfg.n_layer {
        let k: Vec<f32> = (0..n)
            .map(|i| (li * 1000 + i) as f32 * 0.013 - 3.0)
            .collect();
        let v: Vec<f32> = k.iter().map(|x| x * -0.37).collect();
        source.write_span(li, 0, 40, &k, &v).unwrap();
    }
    source.len = 40;
    let a = prompt(40, 7);
    cache.insert(&a, &source, None).unwrap();
    assert_eq!(cache.bytes(), 2 * cache.block_bytes());
    let hit = cache.lookup(&a, false);
    assert_eq!(hit.tokens(), 32);
    let mut fresh = KvCache::new(&cfg, 128, &Device::Cpu, f16).unwrap();
    cache.restore(&hit, &mut fresh).unwrap();
    for li in 0..cfg.n_layer {
        assert_eq!(
            fresh.read_span(li, 0, 32).unwrap(),
            source.read_span(li, 0, 32).unwrap()
        );
    }
}

#[test]
fn the_byte_budget_holds_by_evicting_least_recently_used_blocks() {
    let cfg = tiny();
    let probe = PrefixCache::new(&cfg, 0, KvDtype::F32);
    assert!(!probe.enabled());
    probe
        .insert(&prompt(40, 0), &filled(&cfg, 40, 0.0), None)
        .unwrap();
    assert_eq!(
        (probe.bytes(), probe.lookup(&prompt(40, 0), false).tokens()),
        (0, 0)
    );
    assert_eq!(
        probe.counts.lookups.load(Relaxed),
        0,
        "off: not even looked up"
    );

    let block = probe.block_bytes();
    let cache = PrefixCache::new(&cfg, 3 * block, KvDtype::F32);
    let (a, b, c) = (prompt(33, 0), prompt(33, 5000), prompt(90, 9000));
    cache.insert(&a, &filled(&cfg, 33, 0.0), None).unwrap();
    cache.insert(&b, &filled(&cfg, 33, 1.0), None).unwrap();
    // Four blocks for a budget of three: a's last block (the least recently used, and a
    // leaf) went.
    assert_eq!(cache.counts.evictions.load(Relaxed), 1);
    assert_eq!(cache.bytes(), 3 * block);
    assert_eq!(cache.lookup(&a, false).tokens(), 16);
    assert_eq!(cache.lookup(&b, false).tokens(), 32);
    // A prompt longer than the whole budget keeps its first three blocks.
    cache.insert(&c, &filled(&cfg, 90, 2.0), None).unwrap();
    assert!(cache.bytes() <= 3 * block);
    assert_eq!(cache.lookup(&c, false).tokens(), 48);
    assert_eq!(
        (
            cache.lookup(&a, false).tokens(),
            cache.lookup(&b, false).tokens()
        ),
        (0, 0)
    );
    assert_eq!(cache.counts.evictions.load(Relaxed), 4);
    // Re-inserting what is cached changes nothing.
    cache.insert(&c, &filled(&cfg, 90, 2.0), None).unwrap();
    assert_eq!(cache.counts.evictions.load(Relaxed), 4);
}

/// The default model with a prefix cache of its own.
fn cached(format: WeightFormat) -> Llama {
    let tokenizer = model().expect("model").hf_tokenizer().clone();
    let path = model_path().expect("the model file");
    Llama::load_with_format(&path, tokenizer, &Device::Cpu, MAX_CONTEXT, format)
        .expect("load")
        .with_prefix_cache(64)
}

/// Greedy tokens and the cached-token count of one generation.
fn greedy(model: &Llama, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let (out, _) = run(model, request(prompt, n, Sampling::default()));
    (out.tokens, out.cached_tokens)
}

fn blocks_of(n: usize) -> usize {
    n / BLOCK_TOKENS * BLOCK_TOKENS
}

/// The same greedy tokens with and without a hit, on the CPU default (keys and values in
/// host buffers, decoded by the CPU decoder): a repeated ~600-token prompt (two prefill
/// chunks cold, none after the hit: the whole prompt comes back), the same prompt one token
/// longer (its blocks from the cache, its end computed), a new question under the same
/// system turn, and the next turn of a chat, each against a model without a prefix cache.
#[test]
fn greedy_tokens_are_the_same_with_and_without_a_prefix_hit() {
    let Some(plain) = model() else { return };
    let ours = cached(WeightFormat::default());
    let n = 24;

    let long = long_prompt(plain);
    let (expected, _) = greedy(plain, &long, n);
    assert_eq!(greedy(&ours, &long, n), (expected.clone(), 0), "cold");
    assert_eq!(greedy(&ours, &long, n), (expected, long.len()), "repeated");
    let mut longer = long.clone();
    longer.push(long[long.len() / 2]);
    assert_eq!(
        greedy(&ours, &longer, n),
        (greedy(plain, &longer, n).0, blocks_of(longer.len() - 1)),
        "extended"
    );

    let mut messages = rag_messages();
    let first = ours.chat_prompt(&messages).unwrap();
    messages[1].content = "Passage 1: Quenta is the capital of Zorbia.\n\nQuestion: \
                           What is the capital of Zorbia?"
        .into();
    let second = ours.chat_prompt(&messages).unwrap();
    let (answer, _) = greedy(&ours, &first, n);
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        shared >= BLOCK_TOKENS,
        "the system turn is a block: {shared}"
    );
    let (tokens, hit) = greedy(&ours, &second, n);
    assert_eq!(hit, blocks_of(shared), "the system head");
    assert_eq!(tokens, greedy(plain, &second, n).0);

    // The next turn: the first turn's prompt and answer are the history.
    let mut turns = rag_messages();
    turns.push(ChatMessage::new(
        "assistant",
        plain.hf_tokenizer().decode(&answer, true).unwrap(),
    ));
    turns.push(ChatMessage::new("user", "Was it seen from space?"));
    let next = ours.chat_prompt(&turns).unwrap();
    let shared = first.iter().zip(&next).take_while(|(a, b)| a == b).count();
    let (tokens, hit) = greedy(&ours, &next, n);
    assert_eq!(hit, blocks_of(shared.min(first.len())));
    assert!(hit + BLOCK_TOKENS > first.len(), "{hit} of {}", first.len());
    assert_eq!(tokens, greedy(plain, &next, n).0);
}

/// The same on the formats whose keys and values are candle tensors (decode on candle's
/// ops): a hit's last-position logits agree with a cold prefill's, and the greedy tokens
/// are the same.
#[test]
fn a_hit_gives_the_cold_logits_on_the_tensor_cache_too() {
    let Some(plain) = model() else { return };
    let ours = cached(WeightFormat::F32PrefillQ8Decode);
    let prompt = zorbia_prompt(plain);
    let net = &ours.transformer;
    let (cold_tokens, none) = greedy(&ours, &prompt, 16);
    let (warm_tokens, hit) = greedy(&ours, &prompt, 16);
    assert_eq!((none, hit), (0, prompt.len()));
    assert_eq!(cold_tokens, warm_tokens);

    // One token longer: the blocks come from the cache, the end is computed over them.
    let mut longer = prompt.clone();
    longer.push(prompt[1]);
    let fresh = || KvCache::new(&net.cfg, longer.len(), &net.device, None).unwrap();
    let cold = net.prefill(&longer, &mut fresh(), &ours.schedule).unwrap();
    let (warm, hit) = ours.prefill(&longer, &mut fresh()).unwrap();
    assert_eq!(hit, blocks_of(longer.len() - 1));
    let diff = max_abs_diff(&cold, &warm);
    eprintln!("|Δlogit| cold vs hit: {diff}");
    assert!(diff < 1e-3, "{diff}");
}
