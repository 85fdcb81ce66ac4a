//! How one model's requests share the cores: the scheduling policy behind [`super::llama::Llama`]
//! (which requests run at all is the worker queue's business, `crate::worker`). Three rules:
//! - **Prefills take turns.** One prompt prefills at a time: interleaved on the same cores they
//!   would all finish late, while in turn the first request's first token comes after one
//!   prefill, not several. A request that has to wait records the wait as a `prefill_queue`
//!   stage.
//! - **A prefill layer and a batched decode step alternate on the cores, in arrival order.**
//!   Each holds one fair lock ([`parking_lot::FairMutex`], handed over first come, first served)
//!   for one layer or one step, so a long prompt never stalls the decoding requests for its whole
//!   prefill, and the two never run at once (candle's GEMM threads, its spinning pool and the
//!   decoder's threads oversubscribed two cores and slowed both two- to threefold).
//! - **The decode steps of all requests run as one batched step.** Every request prefills on
//!   its own worker thread, then hands each decode step to one batcher thread, which runs the
//!   steps of all requests that are decoding as one [`CpuDecoder::step`], reading every weight
//!   once for the whole batch, and hands each request its logits back. Requests join and leave
//!   between steps (continuous batching, as vLLM and TGI do on GPUs). Sampling, streaming and the
//!   per-token telemetry stay on the request's own thread, so each request's `decode` span still
//!   shows its own tokens at their own times; the span also records the batch sizes its steps
//!   ran in.
//!
//! A batched step belongs to no single request, so it is a trace of its own: a root
//! `decode_step` span (exported under the generation stage's service) naming its members, and
//! each member's `decode` span links to the steps it took part in (the first
//! [`StepTrace::links`]; the rest are counted). `--decode-step-spans` bounds how many steps
//! become spans: all, one in N (each carrying the totals of the steps it stands for, so step
//! time can still be split among requests, `ragscope attribute`), or none. While a step that is
//! a span runs, the CPU profile's samples carry its span id.
//!
//! Without the CPU decoder (the GPU, and the formats that decode on candle's ops) each request
//! decodes on its own thread through the candle forward, each step's layers taking compute turns
//! like a prefill's.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::trace::SpanContext;
use opentelemetry::{Array, KeyValue, StringValue, Value};

use super::cpu_decode::{CpuDecoder, HostKv, SeqStep};
use telemetry::clock;
use telemetry::names::{attr, span};
use telemetry::profile;
use telemetry::span::Stage;

/// Most sequences in one step.
pub const MAX_BATCH: usize = 16;
/// How long a step waits for the decoding requests that have not sent their next token yet
/// (each is sampling or streaming its last one, normally tens of microseconds). A request
/// whose consumer is slow misses the step instead of holding everyone back.
const GATHER: Duration = Duration::from_millis(1);
/// After this long without a step, the steps not yet recorded as a span are summed into one
/// (with `sampled:N`), so no step time goes unaccounted.
const IDLE: Duration = Duration::from_millis(50);

/// Which batched decode steps become `decode_step` spans (`--decode-step-spans`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSpans {
    /// Every step.
    All,
    /// One step in N, carrying the totals (steps, busy time, tokens per member) of the steps
    /// since the last span, itself included.
    Sampled(u32),
    /// None.
    Off,
}

impl FromStr for StepSpans {
    type Err = String;

    fn from_str(s: &str) -> Result<StepSpans, String> {
        match s.trim() {
            "all" => Ok(StepSpans::All),
            "off" => Ok(StepSpans::Off),
            other => other
                .strip_prefix("sampled:")
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|&n| n >= 1)
                .map(StepSpans::Sampled)
                .ok_or_else(|| format!("{other:?}: expected all, off or sampled:N (N >= 1)")),
        }
    }
}

impl fmt::Display for StepSpans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepSpans::All => f.write_str("all"),
            StepSpans::Sampled(n) => write!(f, "sampled:{n}"),
            StepSpans::Off => f.write_str("off"),
        }
    }
}

/// How batched steps are traced: which become spans, and how many of them a request's
/// `decode` span links to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTrace {
    pub spans: StepSpans,
    /// Links per `decode` span, to its first step spans; the others are counted in
    /// `rag.decode.step_links.dropped`.
    pub links: usize,
}

impl StepTrace {
    /// A 256-token answer decoding alone makes 16 step spans, not 256.
    pub const DEFAULT: StepTrace = StepTrace {
        spans: StepSpans::Sampled(16),
        links: 32,
    };
}

static STEP_TRACE: RwLock<StepTrace> = RwLock::new(StepTrace::DEFAULT);

/// Sets how the batchers of models loaded from now on trace their steps (the server does this
/// from its flags before loading the generator).
pub fn set_step_trace(trace: StepTrace) {
    *STEP_TRACE.write().unwrap_or_else(|p| p.into_inner()) = trace;
}

fn step_trace() -> StepTrace {
    *STEP_TRACE.read().unwrap_or_else(|p| p.into_inner())
}

/// Step spans chosen at run time (`/admin/telemetry`), over what each batcher started with:
/// 0 none, 1 off, 2 all, 2 + N sampled:N.
static STEP_SPANS_NOW: AtomicU64 = AtomicU64::new(0);

/// From the next step on, every batcher makes `spans` step spans (a run-time change of
/// `--decode-step-spans`).
pub fn set_step_spans(spans: StepSpans) {
    let code = match spans {
        StepSpans::Off => 1,
        StepSpans::All => 2,
        StepSpans::Sampled(n) => 2 + u64::from(n),
    };
    STEP_SPANS_NOW.store(code, Ordering::Relaxed);
}

/// The step spans in force for the server's batchers: the run-time choice, else the flag's.
pub fn step_spans() -> StepSpans {
    changed_step_spans().unwrap_or(step_trace().spans)
}

fn changed_step_spans() -> Option<StepSpans> {
    match STEP_SPANS_NOW.load(Ordering::Relaxed) {
        0 => None,
        1 => Some(StepSpans::Off),
        2 => Some(StepSpans::All),
        n => Some(StepSpans::Sampled(u32::try_from(n - 2).unwrap_or(u32::MAX))),
    }
}

/// One model's scheduling state, shared by all its requests.
pub(super) struct Scheduler {
    /// Taken for a request's whole prefill: prefills run one at a time.
    prefill_turn: Mutex<()>,
    /// Held for each prefill layer and each batched decode step, handed over in arrival order.
    compute: Arc<parking_lot::FairMutex<()>>,
    /// Batches the decode steps of concurrent requests (with the CPU decoder).
    batcher: Option<Batcher<CpuDecoder>>,
}

impl Scheduler {
    /// `decoder`: the CPU decoder whose steps are batched, when the model decodes on it.
    pub fn new(decoder: Option<Arc<CpuDecoder>>) -> Scheduler {
        let compute = Arc::new(parking_lot::FairMutex::new(()));
        let batcher = decoder.map(|d| Batcher::start(d, compute.clone(), step_trace()));
        Scheduler {
            prefill_turn: Mutex::new(()),
            compute,
            batcher,
        }
    }

    /// Waits for the prefill turn, held until the guard drops; the wait is its own
    /// `prefill_queue` stage under `stage` when there is one.
    pub fn prefill_turn(&self, stage: &Stage) -> MutexGuard<'_, ()> {
        match self.prefill_turn.try_lock() {
            Ok(turn) => turn,
            Err(TryLockError::WouldBlock) => {
                let wait = stage.child(span::PREFILL_QUEUE);
                let turn = self.prefill_turn.lock().unwrap_or_else(|p| p.into_inner());
                wait.end();
                turn
            }
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        }
    }

    /// One turn on the cores, for one prefill layer (or one unbatched decode step's layer).
    pub fn compute_turn(&self) -> parking_lot::FairMutexGuard<'_, ()> {
        self.compute.lock()
    }

    /// Registers a request that is about to decode, under its `decode` stage, when decode
    /// steps are batched: its steps then go through [`BatchSession::step`].
    pub fn session(&self, decode: &Stage) -> Option<Session<'_>> {
        self.batcher.as_ref().map(|b| b.session(decode))
    }
}

/// What a batcher runs: one decode step for a batch of sequences at once. The CPU decoder is
/// the one the server uses; tests drive the batcher with a stand-in.
pub trait StepEngine: Send + Sync + 'static {
    /// One sequence's own state (its KV cache), moved to the batcher and back each step.
    type Seq: Send + Default + 'static;
    /// Logits per sequence.
    fn vocab(&self) -> usize;
    /// Refuses a step that cannot run, before it joins a batch.
    fn check(&self, seq: &Self::Seq, pos: usize, tokens: &[u32]) -> candle_core::Result<()>;
    /// Runs each sequence's tokens at `pos`, `pos + 1`, …; `logits` holds `vocab()` per token,
    /// sequence after sequence. A row's logits must not depend on the other rows of the step.
    fn step(
        &self,
        seqs: &mut [StepInput<'_, Self::Seq>],
        logits: &mut [f32],
    ) -> candle_core::Result<()>;
}

/// One sequence's share of a step: its tokens from `pos` on (more than one when it verifies a
/// speculative draft).
pub struct StepInput<'a, S> {
    pub seq: &'a mut S,
    pub pos: usize,
    pub tokens: &'a [u32],
}

impl StepEngine for CpuDecoder {
    type Seq = HostKv;

    fn vocab(&self) -> usize {
        CpuDecoder::vocab(self)
    }

    fn check(&self, kv: &HostKv, pos: usize, tokens: &[u32]) -> candle_core::Result<()> {
        if tokens.is_empty() {
            candle_core::bail!("a step with no token");
        }
        tokens
            .iter()
            .enumerate()
            .try_for_each(|(j, &token)| CpuDecoder::check(self, kv, pos + j, token))
    }

    fn step(
        &self,
        seqs: &mut [StepInput<'_, HostKv>],
        logits: &mut [f32],
    ) -> candle_core::Result<()> {
        let mut steps: Vec<SeqStep<'_>> = seqs
            .iter_mut()
            .map(|s| SeqStep {
                kv: &mut *s.seq,
                pos: s.pos,
                tokens: s.tokens,
            })
            .collect();
        CpuDecoder::step(self, &mut steps, logits)
    }
}

/// Who a step ran for: a decoding request, as its step spans name it.
struct Member {
    request_id: String,
    trace_id: String,
    /// The request's `decode` span.
    span_id: String,
    /// The request's decode span: a batch of one that is no span of its own labels its CPU
    /// profile with it.
    profile: Option<profile::SpanTarget>,
}

/// One request's step, sent to the batcher and back.
struct Job<S> {
    seq: S,
    pos: usize,
    /// The token to run, then the draft to verify beside it (if any).
    tokens: Vec<u32>,
    logits: Vec<f32>,
    member: Arc<Member>,
    reply: mpsc::SyncSender<Done<S>>,
}

struct Done<S> {
    seq: S,
    logits: Vec<f32>,
    batch: usize,
    result: candle_core::Result<()>,
    /// The step's span and this request's place in the batch, when the step is a span.
    step: Option<(SpanContext, usize)>,
}

/// The batcher thread and the channel feeding it.
pub struct Batcher<E: StepEngine> {
    tx: Mutex<Option<Sender<Job<E::Seq>>>>,
    /// Requests between their first and last decode step.
    active: Arc<AtomicUsize>,
    links: usize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<E: StepEngine> Batcher<E> {
    /// A batcher over `engine` with a compute lock of its own.
    pub fn new(engine: Arc<E>, trace: StepTrace) -> Batcher<E> {
        Self::start(engine, Arc::new(parking_lot::FairMutex::new(())), trace)
    }

    /// `compute`: taken for each step, shared with the model's prefill layers.
    fn start(
        engine: Arc<E>,
        compute: Arc<parking_lot::FairMutex<()>>,
        trace: StepTrace,
    ) -> Batcher<E> {
        let (tx, rx) = mpsc::channel();
        let active = Arc::new(AtomicUsize::new(0));
        let seen = active.clone();
        let thread = std::thread::Builder::new()
            .name("decode-batcher".into())
            .spawn(move || run(&*engine, &rx, &seen, &compute, trace.spans))
            .expect("spawning the decode batcher");
        Batcher {
            tx: Mutex::new(Some(tx)),
            active,
            links: trace.links,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Registers a request that is about to decode, under its `decode` stage; it counts as
    /// active until dropped.
    pub fn session(&self, decode: &Stage) -> BatchSession<'_, E> {
        self.active.fetch_add(1, Ordering::Relaxed);
        let (reply, done) = mpsc::sync_channel(1);
        let member = Member {
            request_id: decode.inherited(attr::REQUEST_ID).unwrap_or_default(),
            trace_id: decode.trace_id().unwrap_or_default(),
            span_id: decode.span_id().unwrap_or_default(),
            profile: profile::enabled()
                .then(|| profile::target(decode))
                .flatten(),
        };
        BatchSession {
            batcher: self,
            member: Arc::new(member),
            reply,
            done,
            steps: 0,
            step_spans: 0,
            links: Vec::new(),
        }
    }
}

impl<E: StepEngine> Drop for Batcher<E> {
    fn drop(&mut self) {
        self.tx.lock().expect("batcher lock").take();
        if let Some(t) = self.thread.lock().expect("batcher lock").take() {
            let _ = t.join();
        }
    }
}

/// The CPU decoder's session, as the model's decode loop holds it.
pub(crate) type Session<'a> = BatchSession<'a, CpuDecoder>;

/// A decoding request's handle on the batcher.
pub struct BatchSession<'a, E: StepEngine> {
    batcher: &'a Batcher<E>,
    member: Arc<Member>,
    /// Every step's answer comes back on this one channel.
    reply: mpsc::SyncSender<Done<E::Seq>>,
    done: Receiver<Done<E::Seq>>,
    /// Batched steps taken.
    steps: usize,
    /// Of those, the steps that were spans.
    step_spans: usize,
    /// Links to the first step spans, for the `decode` span.
    links: Vec<(SpanContext, Vec<KeyValue>)>,
}

impl<E: StepEngine> BatchSession<'_, E> {
    /// Runs `tokens` at `pos`, `pos + 1`, … of `seq` in the next batched step (the token the
    /// request picked, then the draft it wants verified); `logits` receives the vocabulary's
    /// logits for each, one row after another. Returns the number of sequences the step ran
    /// for.
    pub fn step(
        &mut self,
        seq: &mut E::Seq,
        pos: usize,
        tokens: &[u32],
        logits: &mut Vec<f32>,
    ) -> candle_core::Result<usize> {
        let job = Job {
            seq: std::mem::take(seq),
            pos,
            tokens: tokens.to_vec(),
            logits: std::mem::take(logits),
            member: self.member.clone(),
            reply: self.reply.clone(),
        };
        let gone = || candle_core::Error::Msg("the decode batcher stopped".into());
        let sent = match self.batcher.tx.lock().expect("batcher lock").as_ref() {
            Some(tx) => tx.send(job).map_err(|_| gone()),
            None => Err(gone()),
        };
        sent?;
        let done = self.done.recv().map_err(|_| gone())?;
        *seq = done.seq;
        *logits = done.logits;
        if done.result.is_ok() {
            self.steps += 1;
            if let Some((cx, slot)) = done.step {
                self.step_spans += 1;
                if self.links.len() < self.batcher.links {
                    self.links.push((
                        cx,
                        vec![
                            KeyValue::new(attr::DECODE_BATCH_SIZE, done.batch as i64),
                            KeyValue::new(attr::DECODE_BATCH_SLOT, slot as i64),
                            // The first token comes from the prefill: step k gives token k + 1.
                            KeyValue::new(attr::GEN_AI_TOKEN_INDEX, self.steps as i64),
                        ],
                    ));
                }
            }
        }
        done.result.map(|()| done.batch)
    }

    /// Puts the links to the step spans this request took part in, and how many steps there
    /// were, on its `decode` span (call before it ends).
    pub fn finish(self, decode: &Stage) {
        if self.steps == 0 {
            return;
        }
        decode.set_all([
            KeyValue::new(attr::DECODE_STEPS, self.steps as i64),
            KeyValue::new(attr::DECODE_STEP_SPANS, self.step_spans as i64),
            KeyValue::new(
                attr::DECODE_STEP_LINKS_DROPPED,
                (self.step_spans - self.links.len()) as i64,
            ),
        ]);
        for (cx, attributes) in &self.links {
            decode.link(cx.clone(), attributes.clone());
        }
    }
}

impl<E: StepEngine> Drop for BatchSession<'_, E> {
    fn drop(&mut self) {
        self.batcher.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The service a step span is exported under: the one the members' `decode` spans have.
fn step_service() -> Option<&'static str> {
    Some(telemetry::names::STEPS_SERVICE)
}

/// One step as its span records it: (index, batch size, rows, start, end, compute-lock wait).
type StepFacts = (u64, usize, usize, Instant, Instant, Duration);

/// Steps run since the last step span (`sampled:N`), summed for the next one.
#[derive(Default)]
struct Window {
    steps: u64,
    busy: Duration,
    /// Each member once, with the positions its steps computed (one a step, more when a
    /// step verified a draft).
    members: Vec<(Arc<Member>, i64)>,
    /// The latest step: (index, batch size, rows, start, end, compute-lock wait).
    last: Option<StepFacts>,
}

impl Window {
    fn add(&mut self, step: StepFacts, members: &[(Arc<Member>, i64)]) {
        self.steps += 1;
        self.busy += step.4.saturating_duration_since(step.3);
        for (m, rows) in members {
            match self.members.iter_mut().find(|(w, _)| Arc::ptr_eq(w, m)) {
                Some((_, tokens)) => *tokens += rows,
                None => self.members.push((m.clone(), *rows)),
            }
        }
        self.last = Some(step);
    }

    /// The window's totals as step-span attributes; empties it.
    fn take(&mut self) -> Vec<KeyValue> {
        let window = std::mem::take(self);
        let mut kvs = member_attributes(&window.members);
        kvs.push(KeyValue::new(
            attr::DECODE_WINDOW_STEPS,
            window.steps as i64,
        ));
        kvs.push(KeyValue::new(
            attr::DECODE_WINDOW_BUSY_MS,
            window.busy.as_secs_f64() * 1e3,
        ));
        kvs
    }

    /// Records the steps no span has covered yet as one span over the latest of them.
    fn flush(&mut self) {
        let Some((index, batch, rows, started, ended, wait)) = self.last else {
            return;
        };
        let step = Stage::detached_at(span::DECODE_STEP, step_service(), started);
        step.set_all(step_attributes(index, batch, wait));
        step.set(KeyValue::new(attr::DECODE_STEP_ROWS, rows as i64));
        step.set_all(self.take());
        step.end_at(ended);
    }
}

fn step_attributes(index: u64, batch: usize, wait: Duration) -> [KeyValue; 3] {
    [
        KeyValue::new(attr::DECODE_STEP_INDEX, index as i64),
        KeyValue::new(attr::DECODE_BATCH_SIZE, batch as i64),
        KeyValue::new(attr::DECODE_STEP_WAIT_MS, wait.as_secs_f64() * 1e3),
    ]
}

/// Who a step (or a window of steps) ran for, and how many tokens each got, as parallel arrays.
fn member_attributes(members: &[(Arc<Member>, i64)]) -> Vec<KeyValue> {
    let strings = |f: fn(&Member) -> &str| {
        Value::Array(Array::String(
            members
                .iter()
                .map(|(m, _)| StringValue::from(f(m).to_string()))
                .collect(),
        ))
    };
    vec![
        KeyValue::new(attr::DECODE_MEMBERS_REQUEST_IDS, strings(|m| &m.request_id)),
        KeyValue::new(attr::DECODE_MEMBERS_TRACE_IDS, strings(|m| &m.trace_id)),
        KeyValue::new(attr::DECODE_MEMBERS_SPAN_IDS, strings(|m| &m.span_id)),
        KeyValue::new(
            attr::DECODE_MEMBERS_TOKENS,
            Value::Array(Array::I64(members.iter().map(|(_, t)| *t).collect())),
        ),
    ]
}

/// The CPU profile's current label on the batcher and compute threads. Each change makes the
/// profiler cut its sample buffer, so it changes only when the target does.
#[derive(Default)]
struct ProfileLabel(Option<profile::SpanTarget>, Option<profile::Labelled>);

impl ProfileLabel {
    fn set(&mut self, target: Option<profile::SpanTarget>) {
        if target != self.0 {
            self.1 = None;
            self.1 = target.as_ref().and_then(profile::label_span);
            self.0 = target;
        }
    }
}

fn run<E: StepEngine>(
    engine: &E,
    rx: &Receiver<Job<E::Seq>>,
    active: &AtomicUsize,
    compute: &parking_lot::FairMutex<()>,
    spans: StepSpans,
) {
    let vocab = engine.vocab();
    let mut logits = Vec::new();
    // A batch of one that is not a span of its own is labelled with its request's decode
    // span, kept while the same request decodes alone; a step span labels its own step only.
    let mut label = ProfileLabel::default();
    let mut index = 0u64;
    let mut window = Window::default();
    loop {
        let first = match rx.recv_timeout(IDLE) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                window.flush();
                match rx.recv() {
                    Ok(job) => job,
                    Err(_) => break,
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let mut jobs = vec![first];
        let until = Instant::now() + GATHER;
        while jobs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(TryRecvError::Empty) => {
                    if jobs.len() >= active.load(Ordering::Relaxed) || Instant::now() >= until {
                        break;
                    }
                    std::thread::yield_now();
                }
                Err(TryRecvError::Disconnected) => break,
            }
        }
        // A request whose own step is invalid fails alone, before the batch runs.
        let mut valid = Vec::with_capacity(jobs.len());
        for job in jobs {
            match engine.check(&job.seq, job.pos, &job.tokens) {
                Ok(()) => valid.push(job),
                Err(e) => finish(job, 0, Err(e), None),
            }
        }
        let mut jobs = valid;
        if jobs.is_empty() {
            continue;
        }
        let b = jobs.len();
        let rows: usize = jobs.iter().map(|j| j.tokens.len()).sum();
        index += 1;
        let batches = &telemetry::metrics::DECODE_BATCH;
        telemetry::metrics::metrics()
            .step_tokens
            .record(rows as f64, &[]);
        batches.last.store(b as u64, Ordering::Relaxed);
        batches.largest.fetch_max(b as u64, Ordering::Relaxed);
        let traced = match changed_step_spans().unwrap_or(spans) {
            StepSpans::All => true,
            StepSpans::Sampled(n) => index.is_multiple_of(u64::from(n)),
            StepSpans::Off => false,
        };
        let started = clock::now();
        let step = traced.then(|| Stage::detached_at(span::DECODE_STEP, step_service(), started));
        let step_target = step
            .as_ref()
            .filter(|_| profile::enabled())
            .and_then(profile::target);
        let own = (b == 1).then(|| jobs[0].member.profile.clone()).flatten();
        label.set(step_target.clone().or(own));
        // The step's span is the batcher thread's current context while it runs.
        let current = step.as_ref().map(|s| s.context().clone().attach());
        logits.resize(rows * vocab, 0.0);
        let turn = compute.lock();
        let computing = clock::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut inputs: Vec<StepInput<'_, E::Seq>> = jobs
                .iter_mut()
                .map(|j| StepInput {
                    seq: &mut j.seq,
                    pos: j.pos,
                    tokens: &j.tokens,
                })
                .collect();
            engine.step(&mut inputs, &mut logits)
        }))
        .unwrap_or_else(|_| Err(candle_core::Error::Msg("decode step panicked".into())));
        drop(turn);
        let ended = clock::now();
        drop(current);
        if step_target.is_some() {
            label.set(None);
        }
        let members: Vec<(Arc<Member>, i64)> = jobs
            .iter()
            .map(|j| (j.member.clone(), j.tokens.len() as i64))
            .collect();
        let link = step.as_ref().map(Stage::span_context);
        let mut row = 0;
        for (i, mut job) in jobs.into_iter().enumerate() {
            let n = job.tokens.len();
            let result = match &result {
                Ok(()) => {
                    job.logits.clear();
                    job.logits
                        .extend_from_slice(&logits[row * vocab..(row + n) * vocab]);
                    Ok(())
                }
                Err(e) => Err(candle_core::Error::Msg(e.to_string())),
            };
            row += n;
            let at = link.clone().map(|cx| (cx, i));
            finish(job, b, result, at);
        }
        // The members have their logits; the span is written while they sample.
        let wait = computing.saturating_duration_since(started);
        let facts = (index, b, rows, started, ended, wait);
        if let StepSpans::Sampled(_) = spans {
            window.add(facts, &members);
        }
        if let Some(step) = step {
            step.set_all(step_attributes(index, b, wait));
            step.set(KeyValue::new(attr::DECODE_STEP_ROWS, rows as i64));
            if let Err(e) = &result {
                step.fail("model", e.to_string());
            }
            match spans {
                StepSpans::Sampled(_) => step.set_all(window.take()),
                _ => step.set_all(member_attributes(&members)),
            }
            step.end_at(ended);
        }
    }
    window.flush();
}

fn finish<S>(
    job: Job<S>,
    batch: usize,
    result: candle_core::Result<()>,
    step: Option<(SpanContext, usize)>,
) {
    let _ = job.reply.send(Done {
        seq: job.seq,
        logits: job.logits,
        batch,
        result,
        step,
    });
}

#[cfg(test)]
mod tests {
    use crate::testing::{model, request, run};
    use crate::{ChatMessage, ChatTokenizer, Sampling};

    /// Requests decoding at the same time share batched steps; each still gets exactly the
    /// tokens it gets alone (greedy), whatever it is batched with, and the decode span says so.
    #[test]
    fn batched_decoding_gives_each_request_its_own_tokens() {
        let Some(model) = model() else { return };
        let prompts: Vec<Vec<u32>> = [
            "Passage: The capital of Zorbia is Quenta.\nQuestion: What is the capital of Zorbia?",
            "Write a short poem about the sea.",
            "List three uses of git stash.",
        ]
        .iter()
        .map(|q| model.chat_prompt(&[ChatMessage::new("user", *q)]).unwrap())
        .collect();
        // Each prefill lets every decoding request take one step per layer (30), so a request
        // that prefilled first can be nearly done by the time the last one decodes. Past the
        // natural end and long enough, all three are sure to decode side by side, with no
        // prefill left, for dozens of steps.
        let max_tokens = [96, 96, 96];
        let greedy = |p, n| {
            let mut req = request(p, n, Sampling::default());
            req.ignore_eos = true;
            run(model, req).0.tokens
        };
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .zip(max_tokens)
            .map(|(p, n)| greedy(p, n))
            .collect();
        let start = std::sync::Barrier::new(prompts.len());
        let together: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = prompts
                .iter()
                .zip(max_tokens)
                .map(|(p, n)| {
                    let start = &start;
                    scope.spawn(move || {
                        start.wait();
                        greedy(p, n)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(together, alone);
        assert!(model.schedule.batcher.is_some(), "the CPU default batches");
        let largest = &telemetry::metrics::DECODE_BATCH.largest;
        assert!(
            largest.load(std::sync::atomic::Ordering::Relaxed) > 1,
            "the steps never ran batched"
        );
    }
}
