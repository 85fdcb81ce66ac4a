//! Warming the prefix cache: prefilling a prompt's head (what every prompt for this question
//! starts with, known before retrieval) into [`super::prefix_cache`] while the request is still
//! embedding and retrieving, so its real prefill starts from a hit. Only whole blocks are
//! cached, so only the head's whole blocks are prefilled; the computed positions go to a
//! scratch KV cache that is dropped. Nothing is generated and no decode slot is taken: the
//! warm holds the prefill turn for its few blocks, like any short prefill.

use opentelemetry::KeyValue;

use super::kv_cache::KvCache;
use super::llama::Llama;
use super::prefix_cache::BLOCK_TOKENS;
use super::{GenerateError, Warmed};
use telemetry::names::attr;
use telemetry::span::Stage;

/// Prefills the whole blocks of `head` into the prefix cache (see [`super::Generator::warm`]).
pub(super) fn warm(
    llama: &Llama,
    head: &[u32],
    stage: &Stage,
    proceed: &dyn Fn() -> bool,
) -> Result<Option<Warmed>, GenerateError> {
    let blocks = head.len() / BLOCK_TOKENS;
    if blocks == 0 || !llama.prefix.enabled() || head.len() >= llama.context_window {
        return Ok(None);
    }
    // One token past the last whole block: a lookup always leaves the last position to compute,
    // so without it a fully cached head would recompute its last block. The extra position is
    // in no whole block and is never cached.
    let mut tokens = head[..blocks * BLOCK_TOKENS].to_vec();
    tokens.push(llama.im_end);
    let _turn = llama.schedule.prefill_turn(stage);
    if !proceed() {
        return Ok(None);
    }
    let net = &llama.transformer;
    let host = net.host_kv();
    let mut cache = KvCache::new(&net.cfg, tokens.len(), &net.device, host)?;
    let (_, cached) = llama.prefill_traced(&tokens, &mut cache, Some(stage), false)?;
    let warmed = Warmed {
        head_tokens: blocks * BLOCK_TOKENS,
        cached_tokens: cached,
        computed_tokens: tokens.len() - cached,
    };
    stage.set_all([
        KeyValue::new(attr::GEN_AI_USAGE_INPUT_TOKENS, warmed.head_tokens as i64),
        KeyValue::new(attr::PREFILL_CACHED_TOKENS, cached as i64),
        KeyValue::new(attr::PREFILL_COMPUTED_TOKENS, warmed.computed_tokens as i64),
    ]);
    Ok(Some(warmed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{model_path, request, run, stage, MAX_CONTEXT};
    use crate::{ChatMessage, ChatTokenizer, Sampling};

    #[test]
    fn a_warmed_head_is_the_prompts_cache_hit_and_the_answer_is_unchanged() {
        let Some(path) = model_path() else { return };
        let load = || {
            Llama::from_gguf(&path, &candle_core::Device::Cpu, MAX_CONTEXT)
                .unwrap()
                .with_prefix_cache(64)
        };
        let (warmed, cold) = (load(), load());
        // A prompt and a head of it, as the pipeline warms the part of a RAG prompt it knows
        // before retrieval (that its head starts every prompt is the prompt builder's test).
        let prompt = warmed
            .chat_prompt(&[ChatMessage::new(
                "user",
                "Context: The capital of Zorbia is Quenta, a city on the river Zor.\n\n\
                 Question: What is the capital of Zorbia?",
            )])
            .unwrap();
        let head = &prompt[..prompt.len() - 12];

        let w = warm(&warmed, head, &stage(), &|| true).unwrap().unwrap();
        let blocks = head.len() / BLOCK_TOKENS * BLOCK_TOKENS;
        assert!(blocks >= BLOCK_TOKENS, "head of {} tokens", head.len());
        assert_eq!(w.head_tokens, blocks);
        assert_eq!((w.cached_tokens, w.computed_tokens), (0, blocks + 1));
        // Warming again computes only the position past the blocks.
        let again = warm(&warmed, head, &stage(), &|| true).unwrap().unwrap();
        assert_eq!((again.cached_tokens, again.computed_tokens), (blocks, 1));
        // Called off once the turn is held: nothing computed.
        assert_eq!(warm(&warmed, head, &stage(), &|| false).unwrap(), None);

        let greedy = Sampling::default();
        let (hit, _) = run(&warmed, request(&prompt, 8, greedy));
        let (whole, _) = run(&cold, request(&prompt, 8, greedy));
        assert_eq!(
            hit.cached_tokens, blocks,
            "the prefill starts from the warmed head"
        );
        assert_eq!(whole.cached_tokens, 0);
        assert_eq!(hit.tokens, whole.tokens, "greedy: the same answer");
    }
}
