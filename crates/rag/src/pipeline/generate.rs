//! The generation stage (`chat {model}`): the answer, one per choice, generated side by side,
//! each piece streamed as it completes through [`Delivery`], which also applies the faults
//! injected into tokens; then the answer with its usage and timings, and generation's metrics.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use opentelemetry::trace::SpanContext;
use opentelemetry::KeyValue;

use super::cite::{Citer, Header};
use super::events::SendError;
use super::{
    CacheUse, Choice, Event, EventSender, Pipeline, PipelineError, PromptTokensDetails, RagAnswer,
    RagRequest, Source, StageRunner, StageSpec, Streamed, Timings, Usage,
};
use crate::fault::{FaultStage, Injected, MidAnswer};
use crate::prompt::{self, Prompt};
use crate::settings::AnswerHeaders;
use llm::{Flow, GenerateRequest, Generated, Piece};
use telemetry::clock::{self, millis};
use telemetry::metrics::metrics;
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

/// What the generation stage gets besides the request: the prompt, the tokens of the context
/// it holds (which the copy and context biases favour) and where the answer stops.
pub(super) struct Given<'a> {
    pub prompt: &'a [u32],
    pub context_tokens: &'a [u32],
    pub stop: &'a [String],
    /// The prompt's passage headers, when an answer that begins with one cites it instead.
    pub headers: &'a [Header],
}

impl Pipeline {
    /// 6. A RAG answer to the built prompt: its context's tokens are the ones the prompt holds
    ///    (passages it dropped or cut are not there to copy), and the template's own labels
    ///    end it as the request's stop strings do (a small model that starts a new
    ///    "Question:" is past the end of its answer).
    pub(super) fn answer_prompt(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        built: &Prompt,
        events: Option<&EventSender>,
    ) -> Result<Vec<Generated>, PipelineError> {
        let context_tokens = if req.sampling.reads_context() {
            self.generator
                .tokenizer()
                .tokenize(&built.texts.join("\n"), false)?
        } else {
            Vec::new()
        };
        let stop: Vec<String> = req
            .stop
            .iter()
            .cloned()
            .chain(prompt::ANSWER_ENDS.iter().map(|s| s.to_string()))
            .collect();
        let headers = match (self.defaults.answer_headers, req.logprobs) {
            (AnswerHeaders::Cite, None) => Header::of(&built.kept, &built.texts),
            _ => Vec::new(),
        };
        let given = Given {
            prompt: &built.tokens,
            context_tokens: &context_tokens,
            stop: &stop,
            headers: &headers,
        };
        self.generate(run, req, given, events)
    }

    /// The generation stage: one generation per choice (choice `i` seeded `seed + i`), ending
    /// at the first finished paragraph when the request asks.
    pub(super) fn generate(
        &self,
        run: &mut StageRunner,
        req: &RagRequest,
        given: Given<'_>,
        events: Option<&EventSender>,
    ) -> Result<Vec<Generated>, PipelineError> {
        let model = self.generator.model_id();
        let started = run.request().started();
        let spec =
            StageSpec::model(StageKind::Generate, model).with(request_attributes(req, events));
        run.run(spec, |stage| {
            let delivery = Delivery::new(req, stage, events, given.headers);
            let requests = (0..req.choices.max(1))
                .map(|i| GenerateRequest {
                    prompt: given.prompt,
                    max_tokens: req.max_tokens,
                    sampling: llm::Sampling {
                        seed: req.sampling.seed.wrapping_add(i as u64),
                        ..req.sampling
                    },
                    token_trace: self.defaults.token_trace,
                    deadline: Some(req.deadline),
                    ignore_eos: false,
                    stop: given.stop,
                    end_at_paragraph: req.end_at_paragraph,
                    logprobs: req.logprobs,
                    context_tokens: given.context_tokens,
                })
                .collect();
            let on_token = |choice: usize, piece: Piece<'_>| delivery.piece(choice, piece);
            let generated =
                llm::generate_choices(self.generator.as_ref(), requests, stage, &on_token)
                    .map_err(|e| match e {
                        llm::GenerateError::Aborted => {
                            PipelineError::Injected(Injected(FaultStage::Chat))
                        }
                        e => e.into(),
                    })?;
            let mut generated = generated;
            // What was held back for a header reaches the client, and each choice's text is
            // what it was shown.
            for (g, shown) in generated.iter_mut().zip(delivery.finish()) {
                if let Some(text) = shown {
                    g.text = text;
                }
            }
            delivery.record();
            let finishes: Vec<&str> = generated.iter().map(|g| g.finish.as_str()).collect();
            let output: usize = generated.iter().map(|g| g.tokens.len()).sum();
            stage.set_all([
                KeyValue::new(attr::GEN_AI_RESPONSE_MODEL, model.to_string()),
                KeyValue::new(attr::GEN_AI_RESPONSE_FINISH_REASONS, finishes.join(",")),
                KeyValue::new(
                    attr::GEN_AI_USAGE_INPUT_TOKENS,
                    generated[0].prompt_tokens as i64,
                ),
                KeyValue::new(attr::GEN_AI_USAGE_OUTPUT_TOKENS, output as i64),
                // The same counts under OpenInference's names (Phoenix sums them per trace).
                KeyValue::new(
                    attr::LLM_TOKEN_COUNT_PROMPT,
                    generated[0].prompt_tokens as i64,
                ),
                KeyValue::new(attr::LLM_TOKEN_COUNT_COMPLETION, output as i64),
                KeyValue::new(
                    attr::LLM_TOKEN_COUNT_TOTAL,
                    (generated[0].prompt_tokens + output) as i64,
                ),
            ]);
            if let Some(ttft) = time_to_first_token(&generated[0], started) {
                stage.set(KeyValue::new(
                    attr::GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
                    ttft / 1e3,
                ));
            }
            if telemetry::controls::capture_content() {
                stage.set(KeyValue::new(attr::ANSWER_TEXT, generated[0].text.clone()));
                stage.set_all(telemetry::openinference::text(
                    attr::OUTPUT_VALUE,
                    &generated[0].text,
                ));
            }
            Ok(generated)
        })
    }

    /// 7. The answer with its timings (the first choice's); generation's metrics recorded.
    pub(super) fn finish(
        &self,
        run: StageRunner,
        sources: Vec<Source>,
        generated: Vec<Generated>,
    ) -> RagAnswer {
        let request = run.request();
        let first = &generated[0];
        let mut timings = run.timings();
        timings.record(StageKind::Prefill, millis(first.prefill));
        timings.record(StageKind::Decode, millis(first.decode));
        timings.ttft_ms = time_to_first_token(first, request.started()).unwrap_or_default();
        timings.total_ms = millis(request.elapsed());
        record_generation(&timings, first, &request.span_context());
        for g in &generated[1..] {
            metrics().tokens.add(
                g.tokens.len() as u64,
                &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, "output")],
            );
        }
        record_finished(&generated);
        let prompt_tokens = first.prompt_tokens;
        // The prompt is counted once however many choices share it.
        let cached_tokens = first.cached_tokens;
        let completion_tokens = generated.iter().map(|g| g.tokens.len()).sum();
        let speculation = generated
            .iter()
            .fold(llm::speculate::Tally::default(), |t, g| t + g.speculation);
        crate::tenant::charge(prompt_tokens + completion_tokens);
        let choices: Vec<Choice> = generated
            .into_iter()
            .map(|g| Choice {
                text: g.text.trim().to_string(),
                finish_reason: g.finish,
                completion_tokens: g.tokens.len(),
                logprobs: g.logprobs,
                end_logprob: g.end_logprob,
            })
            .collect();
        let first = &choices[0];
        RagAnswer {
            answer: first.text.clone(),
            sources,
            usage: Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
                prompt_tokens_details: PromptTokensDetails { cached_tokens },
            },
            timings,
            cache: CacheUse::default(),
            finish_reason: first.finish_reason,
            logprobs: first.logprobs.clone(),
            choices,
            context: Vec::new(),
            finished_at: clock::now(),
            speculation,
        }
    }
}

/// The generation stage's request attributes: the sampler's settings, the token limit, whether
/// it streams, and the stop strings and choice count when they are not the default.
fn request_attributes(req: &RagRequest, events: Option<&EventSender>) -> Vec<KeyValue> {
    let mut attributes = req.sampling.attributes();
    attributes.extend([
        KeyValue::new(attr::GEN_AI_REQUEST_MAX_TOKENS, req.max_tokens as i64),
        KeyValue::new(attr::GEN_AI_REQUEST_STREAM, events.is_some()),
    ]);
    if !req.stop.is_empty() {
        let stops = req.stop.iter().map(|s| s.clone().into()).collect();
        attributes.push(KeyValue::new(
            attr::GEN_AI_REQUEST_STOP_SEQUENCES,
            opentelemetry::Value::Array(opentelemetry::Array::String(stops)),
        ));
    }
    if req.choices != 1 {
        attributes.push(KeyValue::new(
            attr::GEN_AI_REQUEST_CHOICE_COUNT,
            req.choices as i64,
        ));
    }
    attributes
}

/// Each piece of each choice on its way to the client: an injected mid-answer failure fires
/// at its piece of every choice, an injected token delay holds each piece, and then the piece
/// goes on the request's event channel; a channel closed (the client went away) or stalled
/// (it stopped reading) stops the choice.
struct Delivery<'a> {
    stage: &'a Stage,
    events: Option<&'a EventSender>,
    mid_answer: Option<MidAnswer>,
    token_delay: Option<Duration>,
    /// Pieces delivered so far, per choice.
    pieces: Vec<AtomicUsize>,
    /// Per choice: the header-to-citation filter and the text it let out (with headers only).
    citers: Option<Vec<Mutex<(Citer<'a>, String)>>>,
    delayed: AtomicUsize,
    stalled_ms: AtomicU64,
}

impl<'a> Delivery<'a> {
    fn new(
        req: &RagRequest,
        stage: &'a Stage,
        events: Option<&'a EventSender>,
        headers: &'a [Header],
    ) -> Delivery<'a> {
        let choices = req.choices.max(1);
        Delivery {
            stage,
            events,
            mid_answer: req.faults.mid_answer(),
            token_delay: req.faults.token_delay(),
            pieces: (0..choices).map(|_| AtomicUsize::new(0)).collect(),
            citers: (!headers.is_empty()).then(|| {
                (0..choices)
                    .map(|_| Mutex::new((Citer::new(headers), String::new())))
                    .collect()
            }),
            delayed: AtomicUsize::new(0),
            stalled_ms: AtomicU64::new(0),
        }
    }

    fn piece(&self, choice: usize, piece: Piece<'_>) -> Flow {
        if let Some(fault) = self.mid_answer {
            let n = self.pieces[choice].fetch_add(1, Ordering::Relaxed);
            if n + 1 >= fault.at {
                return fault.fire(self.stage);
            }
        }
        if let Some(d) = self.token_delay {
            std::thread::sleep(d);
            self.delayed.fetch_add(1, Ordering::Relaxed);
        }
        let text = match &self.citers {
            Some(citers) => {
                let mut c = citers[choice].lock().unwrap_or_else(|p| p.into_inner());
                let text = c.0.push(piece.text);
                c.1.push_str(&text);
                text
            }
            None => piece.text.to_string(),
        };
        if text.is_empty() && piece.logprobs.is_empty() {
            return Flow::Continue;
        }
        let streamed = Streamed {
            choice,
            text,
            logprobs: piece.logprobs.to_vec(),
        };
        self.send(streamed)
    }

    fn send(&self, streamed: Streamed) -> Flow {
        match self.events.map(|tx| tx.send(Event::Token(streamed))) {
            Some(Err(SendError::Closed)) => Flow::Stop,
            Some(Err(SendError::Stalled(waited))) => {
                let ms = (waited.as_millis() as u64).max(1);
                self.stalled_ms.store(ms, Ordering::Relaxed);
                Flow::Stop
            }
            _ => Flow::Continue,
        }
    }

    /// Each choice's shown text once its generation ended, with what the citation filter
    /// still held sent on (`None` without the filter: the generated text is what was shown).
    fn finish(&self) -> Vec<Option<String>> {
        let Some(citers) = &self.citers else {
            return vec![None; self.pieces.len()];
        };
        citers
            .iter()
            .enumerate()
            .map(|(choice, c)| {
                let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
                let tail = c.0.finish();
                if !tail.is_empty() {
                    c.1.push_str(&tail);
                    let _ = self.send(Streamed {
                        choice,
                        text: tail,
                        logprobs: Vec::new(),
                    });
                }
                Some(std::mem::take(&mut c.1))
            })
            .collect()
    }

    /// On the stage: a stall (the finish reason, `cancelled`, is the same as for a client that
    /// went away, so the span says which) and the injected token delay.
    fn record(&self) {
        let stalled = self.stalled_ms.load(Ordering::Relaxed);
        if stalled > 0 {
            self.stage
                .set(KeyValue::new(attr::STREAM_STALLED_MS, stalled as i64));
            metrics().stream_stalls.add(1, &[]);
        }
        if let Some(d) = self.token_delay {
            let delayed = self.delayed.load(Ordering::Relaxed);
            self.stage.set_all([
                KeyValue::new(attr::FAULT_TOKEN_DELAY_MS, millis(d)),
                KeyValue::new(attr::FAULT_DELAYED_TOKENS, delayed as i64),
            ]);
            crate::fault::count(FaultStage::Chat, "token_delay");
        }
    }
}

/// Milliseconds from the request's start to the first generated token.
fn time_to_first_token(generated: &Generated, started: Instant) -> Option<f64> {
    generated
        .first_token_at
        .map(|t| millis(t.saturating_duration_since(started)))
}

/// A finished generation's lengths (prompt, all choices, the longest) and finish reason.
fn record_finished(generated: &[Generated]) {
    let m = metrics();
    let lengths = [
        ("input", generated[0].prompt_tokens),
        ("output", generated.iter().map(|g| g.tokens.len()).sum()),
        (
            "output_longest",
            generated.iter().map(|g| g.tokens.len()).max().unwrap_or(0),
        ),
    ];
    for (kind, n) in lengths {
        m.request_tokens
            .record(n as f64, &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, kind)]);
    }
    m.requests_finished.add(
        1,
        &[KeyValue::new(attr::REASON, generated[0].finish.as_str())],
    );
}

/// Generation's metrics: its two stages, time to first token, time per output token, tokens;
/// the request's span is their exemplar.
fn record_generation(t: &Timings, generated: &Generated, request: &SpanContext) {
    let m = metrics();
    m.stage(StageKind::Prefill, generated.prefill, Some(request));
    m.stage(StageKind::Decode, generated.decode, Some(request));
    if generated.first_token_at.is_some() {
        m.time_to_first_token
            .record(t.ttft_ms / 1e3, &[], Some(request));
    }
    if generated.tokens.len() > 1 {
        let per_token = t.decode_ms / 1e3 / (generated.tokens.len() - 1) as f64;
        m.time_per_output_token
            .record(per_token, &[], Some(request));
    }
    m.tokens.add(
        generated.prompt_tokens as u64,
        &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, "input")],
    );
    m.tokens.add(
        generated.tokens.len() as u64,
        &[KeyValue::new(attr::GEN_AI_TOKEN_TYPE, "output")],
    );
}
