//! One request's generation, shaped like candle's `TextGeneration` examples: prefill the prompt
//! once (in its turn, [`super::schedule`]), then one token per step against the request's KV
//! cache, each picked by the [`Sampler`] and streamed as complete UTF-8, until an end token, the
//! consumer, `max_tokens` or the deadline stops it. [`super::llama::Llama`]'s
//! [`Generator::generate`](super::Generator::generate) runs one of these per request; it records
//! the `prefill` and `decode` stages and one event (or span) per token.

use opentelemetry::KeyValue;

use super::kv_cache::KvCache;
use super::llama::Llama;
use super::sampler::{Logits, Sampler};
use super::tokenizer::Utf8Stream;
use super::{FinishReason, Flow, GenerateError, GenerateRequest, Generated, TokenTrace};
use crate::telemetry::clock;
use crate::telemetry::gpu::{self, GpuTimer};
use crate::telemetry::names::{attr, event, span, StageKind};
use crate::telemetry::span::Stage;

/// One request's generation over a loaded model.
pub(super) struct TextGeneration<'a> {
    llama: &'a Llama,
    req: GenerateRequest<'a>,
    /// The `chat {model}` stage the pipeline hands the generator.
    stage: &'a Stage,
}

impl<'a> TextGeneration<'a> {
    pub fn new(llama: &'a Llama, req: GenerateRequest<'a>, stage: &'a Stage) -> Self {
        TextGeneration { llama, req, stage }
    }

    /// Runs the request to its end; `on_token` receives each complete piece of text.
    pub fn run(&self, on_token: &mut dyn FnMut(&str) -> Flow) -> Result<Generated, GenerateError> {
        self.check()?;
        let req = &self.req;
        let mut out = Generated {
            text: String::new(),
            tokens: Vec::with_capacity(req.max_tokens),
            finish: FinishReason::Length,
            prompt_tokens: req.prompt.len(),
            cached_tokens: 0,
            prefill: Default::default(),
            decode: Default::default(),
            first_token_at: None,
        };
        if req.max_tokens == 0 {
            return Ok(out);
        }
        let Some((cache, logits)) = self.prefill(&mut out)? else {
            return Ok(out);
        };
        self.decode(cache, logits, &mut out, on_token)?;
        Ok(out)
    }

    fn past_deadline(&self) -> bool {
        self.req.deadline.is_some_and(|d| clock::now() >= d)
    }

    /// Refuses what cannot run: a prompt and `max_tokens` beyond the context window, an empty
    /// prompt, a token id outside the vocabulary.
    fn check(&self) -> Result<(), GenerateError> {
        let req = &self.req;
        let n_prompt = req.prompt.len();
        let window = self.llama.context_window;
        if n_prompt + req.max_tokens > window {
            return Err(GenerateError::ContextOverflow {
                prompt: n_prompt,
                max_tokens: req.max_tokens,
                window,
            });
        }
        if n_prompt == 0 {
            return Err(GenerateError::Tokenizer("the prompt is empty".into()));
        }
        let vocab = self.llama.transformer.weights.embed.shape().dims()[0];
        if let Some(bad) = req.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(GenerateError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(())
    }

    /// Waits for the prefill turn, then prefills the prompt into a new KV cache (the `prefill`
    /// stage), from the longest prefix the prefix cache holds. Returns the cache and the last position's logits, or `None` when the deadline
    /// passed during the wait.
    fn prefill(&self, out: &mut Generated) -> Result<Option<(KvCache, Logits)>, GenerateError> {
        let (llama, req) = (self.llama, &self.req);
        let net = &llama.transformer;
        let n_prompt = req.prompt.len();
        let turn = llama.schedule.prefill_turn(self.stage);
        if self.past_deadline() {
            out.finish = FinishReason::Timeout;
            return Ok(None);
        }

        let prefill = self.stage.child(StageKind::Prefill.span_prefix());
        let mut cache = on_stage(
            &prefill,
            KvCache::new(
                &net.cfg,
                n_prompt + req.max_tokens,
                &net.device,
                net.weights.decoder.is_some(),
            ),
        )?;
        let gpu = GpuTimer::start(&net.device);
        let prefilled = llama.prefill(req.prompt, &mut cache);
        let (logits, cached) = on_stage(&prefill, prefilled)?;
        let logits = Logits::Device(logits);
        gpu.finish_into(&prefill, "prefill");
        let done = clock::now();
        let took = done.saturating_duration_since(prefill.started());
        let computed = n_prompt - cached;
        prefill.set_all([
            KeyValue::new(attr::GEN_AI_USAGE_INPUT_TOKENS, n_prompt as i64),
            KeyValue::new(attr::PREFILL_CACHED_TOKENS, cached as i64),
            KeyValue::new(attr::PREFILL_COMPUTED_TOKENS, computed as i64),
            KeyValue::new(attr::PREFILL_TOKENS_PER_SECOND, per_second(computed, took)),
        ]);
        self.stage.set(KeyValue::new(
            attr::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
            cached as i64,
        ));
        out.cached_tokens = cached;
        out.prefill = prefill.end_at(done);
        drop(turn);
        Ok(Some((cache, logits)))
    }

    /// Decodes one token per step from `logits` on, until an end token, the consumer,
    /// `max_tokens` or the deadline stops it (the `decode` stage).
    fn decode(
        &self,
        mut cache: KvCache,
        mut logits: Logits,
        out: &mut Generated,
        on_token: &mut dyn FnMut(&str) -> Flow,
    ) -> Result<(), GenerateError> {
        let (llama, req) = (self.llama, &self.req);
        let net = &llama.transformer;
        let decode = self.stage.child(StageKind::Decode.span_prefix());
        let gpu_every = if net.device.is_cpu() {
            0
        } else {
            gpu::decode_sample_every()
        };
        let mut sampler = Sampler::new(&req.sampling);
        if req.ignore_eos {
            sampler = sampler.banning(&llama.eos);
        }
        let mut stream = Utf8Stream::new();
        let mut index = 0usize;
        let mut session = llama.schedule.session(&decode);
        let mut batches = BatchSizes::default();
        loop {
            if self.past_deadline() {
                out.finish = FinishReason::Timeout;
                break;
            }
            let step =
                (req.token_trace == TokenTrace::Spans).then(|| decode.child(span::DECODE_STEP));
            if let Some(&last) = out.tokens.last() {
                let timer = gpu::sampled(index, gpu_every).then(|| GpuTimer::start(&net.device));
                let batch = on_stage(
                    &decode,
                    net.decode_one(
                        session.as_mut(),
                        &mut cache,
                        last,
                        &mut logits,
                        &llama.schedule,
                    ),
                )?;
                batches.record(batch);
                if let Some(iv) = timer.and_then(GpuTimer::finish) {
                    let host = step.as_ref().unwrap_or(&decode);
                    let index = KeyValue::new(attr::GEN_AI_TOKEN_INDEX, index as i64);
                    gpu::emit(host, "decode_step", &iv, vec![index]);
                }
            }
            let next = on_stage(&decode, sampler.sample(&logits))?;
            let at = clock::now();
            out.first_token_at.get_or_insert(at);
            let attributes = || {
                vec![
                    KeyValue::new(attr::GEN_AI_TOKEN_INDEX, index as i64),
                    KeyValue::new(attr::GEN_AI_TOKEN_ID, next as i64),
                ]
            };
            match (req.token_trace, step) {
                (TokenTrace::Events, _) => decode.event_at(event::TOKEN, at, attributes()),
                (TokenTrace::Spans, Some(step)) => {
                    step.set_all(attributes());
                    step.end_at(at);
                }
                _ => {}
            }
            index += 1;
            if llama.eos.contains(&next) {
                out.finish = FinishReason::Stop;
                break;
            }
            out.tokens.push(next);
            let piece = stream.push(llama.token_bytes.get(next));
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
                KeyValue::new(attr::DECODE_BATCH_SIZE_MAX, batches.max as i64),
                KeyValue::new(
                    attr::DECODE_BATCH_SIZE_MEAN,
                    batches.total as f64 / batches.steps as f64,
                ),
            ]);
        }
        // Client-visible rate: every token delivered after prefill, over the decode stage.
        decode.set_all([
            KeyValue::new(attr::GEN_AI_USAGE_OUTPUT_TOKENS, n_out as i64),
            KeyValue::new(attr::DECODE_TOKENS_PER_SECOND, per_second(n_out, took)),
        ]);
        out.decode = decode.end_at(done);
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use crate::generate::testing::{model, request, run, stage, zorbia_prompt, MAX_CONTEXT};
    use crate::generate::{
        ChatMessage, FinishReason, Flow, GenerateError, Generator, Sampling, TokenTrace,
    };
    use crate::telemetry::clock;

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
}
