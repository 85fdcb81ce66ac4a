//! Scoring a prompt: for every token after the first, the log-probability the model gives it
//! after the tokens before it, and the most likely alternatives at its position. This is what
//! OpenAI's legacy `echo: true, logprobs: k` returns for the prompt and what loglikelihood
//! evaluation (lm-eval) sums. One pass over the prompt that keeps every position's logits
//! ([`Transformer::prefill_all_logits`](super::forward::Transformer::prefill_all_logits)),
//! recorded as a `prefill` stage under the generation stage the pipeline hands it.

use opentelemetry::KeyValue;

use super::kv_cache::KvCache;
use super::llama::Llama;
use super::sampler::logprobs;
use super::{ChatTokenizer, GenerateError, TokenLogprob, TopLogprob, MAX_TOP_LOGPROBS};
use telemetry::clock;
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

/// `token`'s entry from one row of logits. Bytes as [`Generator::token_bytes`] gives them (a
/// control token's own text), so an echoed prompt's tokens spell its text.
fn token_logprob(llama: &Llama, row: &[f32], token: u32, top: usize) -> TokenLogprob {
    let (logprob, best) = logprobs(row, token, top);
    TokenLogprob {
        id: token,
        bytes: llama.token_bytes(token),
        logprob,
        top: best
            .into_iter()
            .map(|(id, logprob)| TopLogprob {
                id,
                bytes: llama.token_bytes(id),
                logprob,
            })
            .collect(),
    }
}

/// Scores `prompt` (see the module doc): `prompt.len() - 1` entries, entry `i` for token
/// `prompt[i + 1]`. Waits for the prefill turn as a generation does.
pub(super) fn score(
    llama: &Llama,
    prompt: &[u32],
    top: usize,
    stage: &Stage,
) -> Result<Vec<TokenLogprob>, GenerateError> {
    let net = &llama.transformer;
    let window = llama.context_window;
    if prompt.is_empty() {
        return Err(GenerateError::Tokenizer("the prompt is empty".into()));
    }
    if prompt.len() > window {
        return Err(GenerateError::ContextOverflow {
            prompt: prompt.len(),
            max_tokens: 0,
            window,
        });
    }
    let vocab = net.weights.embed.shape().dims()[0];
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(GenerateError::Tokenizer(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    let top = top.min(MAX_TOP_LOGPROBS);
    let _turn = llama.schedule.prefill_turn(stage);
    let prefill = stage.child(StageKind::Prefill.span_prefix());
    let host = net.host_kv();
    let mut scores = Vec::with_capacity(prompt.len() - 1);
    let result = KvCache::new(&net.cfg, prompt.len(), &net.device, host).and_then(|mut cache| {
        net.prefill_all_logits(prompt, &mut cache, &llama.schedule, &mut |start, logits| {
            for (i, row) in logits.to_vec2::<f32>()?.iter().enumerate() {
                if let Some(&next) = prompt.get(start + i + 1) {
                    scores.push(token_logprob(llama, row, next, top));
                }
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        prefill.fail("model", e.to_string());
        return Err(e.into());
    }
    let done = clock::now();
    let took = done
        .saturating_duration_since(prefill.started())
        .as_secs_f64();
    prefill.set_all([
        KeyValue::new(attr::GEN_AI_USAGE_INPUT_TOKENS, prompt.len() as i64),
        KeyValue::new(
            attr::PREFILL_TOKENS_PER_SECOND,
            prompt.len() as f64 / took.max(1e-9),
        ),
    ]);
    prefill.end_at(done);
    Ok(scores)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{f32_model, stage};
    use crate::ChatMessage;

    /// The last prefill position's logits, as a generation sees them.
    fn prefill_logits(llama: &Llama, prompt: &[u32]) -> Vec<f32> {
        let net = &llama.transformer;
        let host = net.host_kv();
        let mut cache = KvCache::new(&net.cfg, prompt.len(), &net.device, host).unwrap();
        net.prefill(prompt, &mut cache, &llama.schedule)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// The scoring pass gives, at every position we look at (one past the first prefill chunk
    /// included), the numbers the ordinary prefill of the prompt up to there gives. On the F32
    /// prefill: the BF16 one rounds activations, so prefixes of other lengths differ by more
    /// than this test's 2e-3 for reasons that are not the scoring's.
    #[test]
    fn scores_match_the_prefill_of_each_prefix() {
        let Some(llama) = f32_model() else { return };
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(60);
        let prompt = llama
            .chat_prompt(&[ChatMessage::new("user", text)])
            .unwrap();
        assert!(prompt.len() > super::super::forward::PREFILL_CHUNK + 10);
        let scores = score(llama, &prompt, 5, &stage()).unwrap();
        assert_eq!(scores.len(), prompt.len() - 1);
        for end in [
            3,
            40,
            super::super::forward::PREFILL_CHUNK + 7,
            prompt.len() - 1,
        ] {
            let row = prefill_logits(llama, &prompt[..end]);
            let reference = token_logprob(llama, &row, prompt[end], 5);
            let got = &scores[end - 1];
            assert_eq!(got.id, prompt[end]);
            assert!(
                (got.logprob - reference.logprob).abs() < 2e-3,
                "position {end}: {} vs {}",
                got.logprob,
                reference.logprob
            );
            assert_eq!(got.top[0].id, reference.top[0].id, "position {end}");
            for (a, b) in got.top.iter().zip(&reference.top) {
                assert!(
                    (a.logprob - b.logprob).abs() < 2e-3,
                    "position {end}: {a:?} vs {b:?}"
                );
            }
        }
    }
}
