//! One request's generation, shaped like candle's `TextGeneration` examples: prefill the prompt
//! once (in its turn, [`super::schedule`]), then one token per step against the request's KV
//! cache, each picked by the [`Sampler`] and streamed as complete UTF-8 (held back while it may
//! be the start of a stop string, [`super::stop`]), until an end token, a stop string, the
//! consumer, `max_tokens` or the deadline stops it. [`super::llama::Llama`]'s
//! [`Generator::generate`](super::Generator::generate) runs one of these per request; it records
//! the `prefill` and `decode` stages and one event (or span) per token.

use opentelemetry::KeyValue;

use super::kv_cache::KvCache;
use super::llama::Llama;
use super::sampler::{Logits, Sampler};
use super::speculate::{self, Speculation, Tally};
use super::stop::{Release, StopText};
use super::tokenizer::Utf8Stream;
use super::{
    FinishReason, Flow, GenerateError, GenerateRequest, Generated, Piece, TokenLogprob, TokenTrace,
    TopLogprob, MAX_TOP_LOGPROBS,
};
use crate::snapshot::replay::{self as snapshot, Trail};
use telemetry::clock;
use telemetry::gpu::{self, GpuTimer};
use telemetry::metrics::metrics;
use telemetry::names::{attr, event, span, StageKind};
use telemetry::span::Stage;

/// One request's generation over a loaded model.
pub(super) struct TextGeneration<'a> {
    llama: &'a Llama,
    req: GenerateRequest<'a>,
    /// The `chat {model}` stage the pipeline hands the generator.
    stage: &'a Stage,
    /// What a failure snapshot needs beyond the request and the output.
    trail: Trail,
}

impl<'a> TextGeneration<'a> {
    pub fn new(llama: &'a Llama, req: GenerateRequest<'a>, stage: &'a Stage) -> Self {
        TextGeneration {
            llama,
            req,
            stage,
            trail: Trail::default(),
        }
    }

    /// Runs the request to its end; `on_token` receives each complete piece of text.
    pub fn run(
        &self,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<Generated, GenerateError> {
        self.check()?;
        let req = &self.req;
        let mut out = Generated {
            text: String::new(),
            tokens: Vec::with_capacity(req.max_tokens),
            logprobs: Vec::new(),
            end_logprob: None,
            finish: FinishReason::Length,
            prompt_tokens: req.prompt.len(),
            cached_tokens: 0,
            prefill: Default::default(),
            decode: Default::default(),
            first_token_at: None,
            speculation: Default::default(),
        };
        if req.max_tokens == 0 {
            return Ok(out);
        }
        // A failure of either phase (or a finish that counts as one) leaves a snapshot.
        let prefilled = snapshot::catch(|| self.prefill(&mut out));
        let Some((mut cache, logits)) = self.settle(&out, None, prefilled)? else {
            return Ok(out);
        };
        let decoded = snapshot::catch(|| self.decode(&mut cache, logits, &mut out, on_token));
        self.settle(&out, Some(cache), decoded)?;
        Ok(out)
    }

    fn settle<T>(
        &self,
        out: &Generated,
        cache: Option<KvCache>,
        phase: snapshot::Caught<T>,
    ) -> Result<T, GenerateError> {
        let watch = snapshot::Watch {
            llama: self.llama,
            req: &self.req,
            stage: self.stage,
            trail: &self.trail,
        };
        watch.settle(out, cache, phase)
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
                net.host_kv(),
            ),
        )?;
        let gpu = GpuTimer::start(&net.device);
        let prefilled = llama.prefill_traced(req.prompt, &mut cache, Some(&prefill), true);
        let (logits, cached) = on_stage(&prefill, prefilled)?;
        let logits = Logits::Device(logits);
        gpu.finish_into(&prefill, "prefill");
        let done = clock::now();
        let took = done.saturating_duration_since(prefill.started());
        let computed = n_prompt - cached;
        let chunk = net.prefill_chunk().max(1);
        prefill.set_all([
            KeyValue::new(attr::GEN_AI_USAGE_INPUT_TOKENS, n_prompt as i64),
            KeyValue::new(attr::PREFILL_CACHED_TOKENS, cached as i64),
            KeyValue::new(attr::PREFILL_COMPUTED_TOKENS, computed as i64),
            KeyValue::new(attr::PREFILL_PRECISION, llama.prefill_kind().name()),
            KeyValue::new(attr::PREFILL_CHUNK_SIZE, chunk as i64),
            KeyValue::new(attr::PREFILL_CHUNKS, computed.div_ceil(chunk) as i64),
        ]);
        // A whole-prompt hit computes nothing: a rate of 0 would read as a stalled prefill
        // on a dashboard, so the span has none.
        if computed > 0 {
            prefill.set(KeyValue::new(
                attr::PREFILL_TOKENS_PER_SECOND,
                per_second(computed, took),
            ));
        }
        self.stage.set_all([
            KeyValue::new(attr::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, cached as i64),
            KeyValue::new(attr::LLM_TOKEN_COUNT_CACHE_READ, cached as i64),
        ]);
        out.cached_tokens = cached;
        out.prefill = prefill.end_at(done);
        drop(turn);
        Ok(Some((cache, logits)))
    }

    /// Decodes one token per step from `logits` on, until an end token, the consumer,
    /// `max_tokens` or the deadline stops it (the `decode` stage).
    fn decode(
        &self,
        cache: &mut KvCache,
        logits: Logits,
        out: &mut Generated,
        on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
    ) -> Result<(), GenerateError> {
        let (llama, req) = (self.llama, &self.req);
        let net = &llama.transformer;
        let decode = self.stage.child(StageKind::Decode.span_prefix());
        let gpu_every = if net.device.is_cpu() {
            0
        } else {
            gpu::decode_sample_every()
        };
        let ban: &[u32] = if req.ignore_eos { &llama.eos } else { &[] };
        let mut sampler = Sampler::for_request(&req.sampling, req.prompt, req.context_tokens, ban);
        let mut stream = Utf8Stream::new();
        let mut text = StopText::new(req.stop).ending_at_paragraph(req.end_at_paragraph);
        let top_logprobs = req.logprobs.map(|k| k.min(MAX_TOP_LOGPROBS));
        let mut by_stop_string = false;
        let mut index = 0usize;
        let mut session = llama.schedule.session(&decode);
        // Drafts are verified in the CPU decoder's batched steps only.
        let speculation = Some(llama.speculation()).filter(|s| s.is_on() && session.is_some());
        let mut drafts = Drafts::new(req.prompt);
        // The logits to pick from next: the prefill's, then a step's row or rows.
        let mut rows = std::collections::VecDeque::from([logits]);
        let mut batches = BatchSizes::default();
        let mut last_token_at = None;
        loop {
            if self.past_deadline() {
                out.finish = FinishReason::Timeout;
                break;
            }
            let step =
                (req.token_trace == TokenTrace::Spans).then(|| decode.child(span::DECODE_STEP));
            if rows.is_empty() {
                let last = *out.tokens.last().expect("a step follows a pick");
                // Room for a draft: within the cache, and short of max_tokens (the step's last
                // row gives one more token than it drafted).
                let room = (cache.capacity.saturating_sub(cache.len + 1))
                    .min(req.max_tokens.saturating_sub(out.tokens.len() + 1));
                let tokens = drafts.propose(speculation, last, room, batches.last);
                let batch = if tokens.len() > 1 {
                    let session = session.as_mut().expect("drafts need the batcher");
                    let mut buf = Vec::new();
                    let batch =
                        on_stage(&decode, net.decode_draft(session, cache, tokens, &mut buf))?;
                    let vocab = buf.len() / tokens.len();
                    rows.extend(buf.chunks_exact(vocab).map(|r| Logits::Host(r.to_vec())));
                    batch
                } else {
                    let timer =
                        gpu::sampled(index, gpu_every).then(|| GpuTimer::start(&net.device));
                    let mut logits = Logits::Host(Vec::new());
                    let batch = on_stage(
                        &decode,
                        net.decode_one(session.as_mut(), cache, last, &mut logits, &llama.schedule),
                    )?;
                    rows.push_back(logits);
                    if let Some(iv) = timer.and_then(GpuTimer::finish) {
                        let host = step.as_ref().unwrap_or(&decode);
                        let index = KeyValue::new(attr::GEN_AI_TOKEN_INDEX, index as i64);
                        gpu::emit(host, "decode_step", &iv, vec![index]);
                    }
                    batch
                };
                batches.record(batch);
                self.trail.step(batch);
            }
            let logits = rows.pop_front().expect("a row to pick from");
            // A draft row ran on a token a pick confirmed: its position joins the cache now,
            // as a one-token step's would.
            if drafts.on_draft_row() {
                cache.len += 1;
            }
            let pick = on_stage(&decode, sampler.pick(&logits, top_logprobs))?;
            let next = pick.token;
            // A pick that differs from the draft token the next row ran on ends the draft:
            // the rows after it are not the answer's.
            if !drafts.check(next) {
                rows.clear();
            }
            let at = clock::now();
            if let Some(previous) = last_token_at.replace(at) {
                metrics()
                    .token_interval
                    .record(at.saturating_duration_since(previous).as_secs_f64(), &[]);
            }
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
            let end = llama.eos.contains(&next);
            // The end token has no text of its own.
            let bytes = if end {
                &[][..]
            } else {
                llama.token_bytes.get(next)
            };
            let logprob = pick.logprobs.map(|(logprob, top)| TokenLogprob {
                id: next,
                bytes: bytes.to_vec(),
                logprob,
                top: top
                    .into_iter()
                    .map(|(id, logprob)| TopLogprob {
                        id,
                        bytes: llama.token_bytes.get(id).to_vec(),
                        logprob,
                    })
                    .collect(),
            });
            if end {
                out.end_logprob = logprob;
                out.finish = FinishReason::Stop;
                break;
            }
            out.tokens.push(next);
            let released = text.push(stream.push(bytes), logprob);
            let stopped = released.stopped;
            match deliver(released, out, on_token) {
                Flow::Continue => {}
                Flow::Stop => {
                    out.finish = FinishReason::Cancelled;
                    break;
                }
                Flow::Fail => return Err(GenerateError::Aborted),
            }
            if stopped {
                out.finish = FinishReason::Stop;
                by_stop_string = true;
                break;
            }
            if out.tokens.len() >= req.max_tokens {
                out.finish = FinishReason::Length;
                break;
            }
        }
        if out.finish != FinishReason::Cancelled && !by_stop_string {
            // What was held back for a stop string that never came, and a character cut off by
            // the end of generation (as U+FFFD), still reach the client, so the streamed pieces
            // always add up to `text`.
            let tail = stream.finish().to_string();
            let released = text.push(&tail, None);
            let stopped = released.stopped;
            deliver(released, out, on_token);
            if stopped {
                out.finish = FinishReason::Stop;
            } else {
                deliver(text.finish(), out, on_token);
            }
        }
        drafts.record(&decode, speculation);
        out.speculation = drafts.tally;
        // Links to the batched steps it took part in, while the span still records.
        if let Some(session) = session {
            session.finish(&decode);
        }
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

/// Hands released text and log-probabilities to the consumer (when there are any) and adds
/// them to the generation's output.
fn deliver(
    released: Release<'_>,
    out: &mut Generated,
    on_token: &mut dyn FnMut(Piece<'_>) -> Flow,
) -> Flow {
    if released.is_empty() {
        return Flow::Continue;
    }
    out.text.push_str(released.text);
    out.logprobs.extend_from_slice(released.logprobs);
    on_token(Piece {
        text: released.text,
        logprobs: released.logprobs,
    })
}

/// One request's drafting: what it has seen, the draft its pending rows ran on, the tally.
struct Drafts {
    /// The prompt, then every token picked.
    history: Vec<u32>,
    /// The last pick and the draft behind it, as the latest step ran them.
    tokens: Vec<u32>,
    /// How far into `tokens` the picks have come.
    checked: usize,
    tally: Tally,
}

impl Drafts {
    fn new(prompt: &[u32]) -> Drafts {
        Drafts {
            history: prompt.to_vec(),
            tokens: Vec::new(),
            checked: 0,
            tally: Tally::default(),
        }
    }

    /// The tokens for the next step: `last`, then up to `room` draft tokens when speculation
    /// is on and the history holds a match. The draft shrinks with the batch the last step ran
    /// in (`batch` sequences: at most `max_draft / batch` each): a draft's rows cost compute
    /// beside the weights the step reads once, and a full step has less of it to spare.
    fn propose(
        &mut self,
        speculation: Option<Speculation>,
        last: u32,
        room: usize,
        batch: usize,
    ) -> &[u32] {
        self.tokens.clear();
        self.tokens.push(last);
        self.checked = 1;
        if let Some(s) = speculation {
            let max = (s.max_draft / batch.max(1)).min(room);
            speculate::draft(&self.history, s.ngram, max, &mut self.tokens);
            let drafted = self.tokens.len() - 1;
            if drafted > 0 {
                self.tally.steps += 1;
                self.tally.drafted += drafted;
                let m = metrics();
                m.spec_drafts.add(1, &[]);
                m.spec_tokens
                    .add(drafted as u64, &[KeyValue::new(attr::KIND, "drafted")]);
            }
        }
        &self.tokens
    }

    /// Whether the row about to be picked from ran on an accepted draft token (not on the
    /// step's first token).
    fn on_draft_row(&self) -> bool {
        self.checked >= 2
    }

    /// Takes the pick `next` into the history; whether the rows after it still hold (false:
    /// it differs from the draft token the next row ran on).
    fn check(&mut self, next: u32) -> bool {
        self.history.push(next);
        let Some(&drafted) = self.tokens.get(self.checked) else {
            return true;
        };
        if drafted == next {
            self.checked += 1;
            self.tally.accepted += 1;
            metrics()
                .spec_tokens
                .add(1, &[KeyValue::new(attr::KIND, "accepted")]);
            true
        } else {
            self.tokens.clear();
            self.checked = 0;
            false
        }
    }

    /// The request's drafts on its `decode` span.
    fn record(&self, decode: &Stage, speculation: Option<Speculation>) {
        let Some(s) = speculation else { return };
        let t = self.tally;
        decode.set_all([
            KeyValue::new(attr::SPEC_METHOD, s.method()),
            KeyValue::new(attr::SPEC_STEPS, t.steps as i64),
            KeyValue::new(attr::SPEC_DRAFTED, t.drafted as i64),
            KeyValue::new(attr::SPEC_ACCEPTED, t.accepted as i64),
        ]);
        if let Some(rate) = t.rate() {
            decode.set(KeyValue::new(attr::SPEC_ACCEPTANCE_RATE, rate));
        }
    }
}

/// How many sequences a request's decode steps ran with.
#[derive(Default)]
struct BatchSizes {
    steps: usize,
    total: usize,
    max: usize,
    /// The latest step's.
    last: usize,
}

impl BatchSizes {
    fn record(&mut self, batch: usize) {
        self.steps += 1;
        self.total += batch;
        self.max = self.max.max(batch);
        self.last = batch;
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
    use crate::testing::{model, request, run, stage, zorbia_prompt, MAX_CONTEXT};
    use crate::{
        ChatMessage, ChatTokenizer, FinishReason, Flow, GenerateError, Generator, Sampling,
        TokenTrace,
    };
    use telemetry::clock;

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
    fn an_answer_that_ends_on_the_end_token_reports_its_logprob() {
        let Some(model) = model() else { return };
        let prompt = zorbia_prompt(model);
        let mut req = request(&prompt, 64, Sampling::default());
        req.logprobs = Some(2);
        let (stopped, _) = run(model, req);
        assert_eq!(stopped.finish, FinishReason::Stop, "{:?}", stopped.text);
        let end = stopped.end_logprob.expect("the end token's logprob");
        assert!(model.eos.contains(&end.id), "{}", end.id);
        assert!(end.bytes.is_empty() && end.logprob <= 0.0, "{end:?}");
        // Greedy: the end token was the most likely one.
        assert_eq!(end.top[0].id, end.id);
        assert_eq!(stopped.logprobs.len(), stopped.tokens.len());
        let (plain, _) = run(model, request(&prompt, 64, Sampling::default()));
        assert!(plain.end_logprob.is_none());
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
            ..Sampling::default()
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

    /// Token n-grams that occur more than once (counted once per extra occurrence).
    fn repeated_ngrams(tokens: &[u32], n: usize) -> usize {
        let mut seen = std::collections::HashSet::new();
        tokens.windows(n).filter(|w| !seen.insert(*w)).count()
    }

    #[test]
    fn a_stop_string_spanning_two_tokens_ends_the_text_before_it() {
        let Some(model) = model() else { return };
        let prompt = zorbia_prompt(model);
        let (free, _) = run(model, request(&prompt, 24, Sampling::default()));
        // The end of one token's text and the start of the next, as one stop string.
        let texts: Vec<String> = free
            .tokens
            .iter()
            .map(|&t| String::from_utf8_lossy(model.token_bytes.get(t)).into_owned())
            .collect();
        let at = (1..texts.len())
            .find(|&i| {
                let word = |t: &str| t.trim().len() >= 2 && t.is_ascii();
                word(&texts[i - 1]) && word(&texts[i])
            })
            .expect("two adjacent word tokens");
        let (a, b) = (texts[at - 1].trim_start(), texts[at].trim_end());
        let stop = format!("{}{}", &a[a.len() - 2..], &b[..2]);
        let expected = &free.text[..free.text.find(&stop).expect("the stop string occurs")];
        for stops in [vec![stop.clone()], vec!["never-seen".into(), stop.clone()]] {
            let mut req = request(&prompt, 24, Sampling::default());
            req.stop = &stops;
            let (out, pieces) = run(model, req);
            assert_eq!(
                out.finish,
                FinishReason::Stop,
                "{stop:?} in {:?}",
                free.text
            );
            assert_eq!(out.text, expected, "stop {stop:?}");
            assert!(!out.text.contains(&stop));
            assert_eq!(pieces.concat(), out.text);
        }
        // A stop string that never completes holds nothing back for good.
        let never = vec![format!("{}#", free.text.chars().next().unwrap())];
        let mut req = request(&prompt, 24, Sampling::default());
        req.stop = &never;
        let (out, pieces) = run(model, req);
        assert_eq!(
            (out.text.as_str(), out.finish),
            (free.text.as_str(), free.finish)
        );
        assert_eq!(pieces.concat(), out.text);
    }

    #[test]
    fn logprobs_come_with_each_token_and_greedy_picks_the_most_likely() {
        let Some(model) = model() else { return };
        let prompt = zorbia_prompt(model);
        let (plain, _) = run(model, request(&prompt, 16, Sampling::default()));
        let mut req = request(&prompt, 16, Sampling::default());
        req.logprobs = Some(5);
        let mut streamed = Vec::new();
        let out = model
            .generate(req, &stage(), &mut |p| {
                streamed.extend_from_slice(p.logprobs);
                Flow::Continue
            })
            .unwrap();
        // Asking for log-probabilities changes nothing else.
        assert_eq!(out.tokens, plain.tokens);
        assert_eq!(out.text, plain.text);
        assert_eq!(streamed, out.logprobs);
        assert_eq!(
            out.logprobs.iter().map(|l| l.id).collect::<Vec<_>>(),
            out.tokens
        );
        for lp in &out.logprobs {
            assert_eq!(lp.top.len(), 5);
            assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
            assert!(lp.top.iter().all(|t| t.logprob <= 0.0));
            let mass: f32 = lp.top.iter().map(|t| t.logprob.exp()).sum();
            assert!(mass <= 1.0 + 1e-4, "{mass}");
            assert_eq!(
                lp.logprob, lp.top[0].logprob,
                "greedy takes the most likely"
            );
            assert_eq!(lp.bytes, model.token_bytes.get(lp.id));
        }
        let k = crate::MAX_TOP_LOGPROBS;
        let mut req = request(&prompt, 2, Sampling::default());
        req.logprobs = Some(k + 5);
        assert_eq!(run(model, req).0.logprobs[0].top.len(), k);
    }

    #[test]
    fn the_ngram_block_breaks_a_loop_and_penalties_change_it() {
        let Some(model) = model() else { return };
        let prompt = model
            .chat_prompt(&[ChatMessage::new(
                "user",
                "List the steps to clone a git repository.",
            )])
            .unwrap();
        let looped = |sampling: Sampling| {
            let mut req = request(&prompt, 96, sampling);
            req.ignore_eos = true;
            run(model, req).0.tokens
        };
        let greedy = looped(Sampling::default());
        let base = repeated_ngrams(&greedy, 4);
        assert!(base > 0, "greedy past its end did not repeat itself");
        let blocked = looped(Sampling {
            no_repeat_ngram: 4,
            ..Sampling::default()
        });
        assert_eq!(repeated_ngrams(&blocked, 4), 0);
        for penalised in [
            Sampling {
                frequency_penalty: 1.0,
                ..Sampling::default()
            },
            Sampling {
                presence_penalty: 1.5,
                ..Sampling::default()
            },
            Sampling {
                repetition_penalty: 1.3,
                ..Sampling::default()
            },
        ] {
            // Each changes the greedy path; how much repetition is left is measured, not
            // asserted (docs/sampling.md: frequency_penalty 1.0 left as many repeated 4-grams).
            let tokens = looped(penalised);
            assert_ne!(tokens, greedy, "{penalised:?}");
            eprintln!(
                "{penalised:?}: {} repeated 4-grams (greedy {base})",
                repeated_ngrams(&tokens, 4)
            );
        }
    }

    #[test]
    fn choices_run_together_each_as_it_runs_alone() {
        let Some(model) = model() else { return };
        let prompt = model
            .chat_prompt(&[ChatMessage::new(
                "user",
                "Write a short poem about the sea.",
            )])
            .unwrap();
        let sampling = |seed| Sampling {
            temperature: 1.0,
            seed,
            ..Sampling::default()
        };
        let alone: Vec<Vec<u32>> = (0..3)
            .map(|i| run(model, request(&prompt, 24, sampling(40 + i))).0.tokens)
            .collect();
        let pieces = std::sync::Mutex::new(vec![String::new(); 3]);
        let together = crate::generate_choices(
            model,
            (0..3)
                .map(|i| request(&prompt, 24, sampling(40 + i)))
                .collect(),
            &stage(),
            &|choice, p| {
                pieces.lock().unwrap()[choice].push_str(p.text);
                Flow::Continue
            },
        )
        .unwrap();
        let tokens: Vec<Vec<u32>> = together.iter().map(|g| g.tokens.clone()).collect();
        assert_eq!(tokens, alone);
        assert_ne!(tokens[0], tokens[1], "two seeds gave the same tokens");
        let texts: Vec<String> = together.into_iter().map(|g| g.text).collect();
        assert_eq!(pieces.into_inner().unwrap(), texts);
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
                model.hf_tokenizer().decode(&out.tokens, true).unwrap()
            );
            assert!(out.tokens.len() <= 40);
            if out.finish == FinishReason::Length {
                assert_eq!(out.tokens.len(), 40);
            }
        }
    }
}
