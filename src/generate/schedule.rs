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
//! Without the CPU decoder (the GPU, and the formats that decode on candle's ops) each request
//! decodes on its own thread through the candle forward, each step's layers taking compute turns
//! like a prefill's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::cpu_decode::{CpuDecoder, HostKv, SeqStep};
use crate::telemetry::names::span;
use crate::telemetry::profile;
use crate::telemetry::span::Stage;

/// Most sequences in one step.
pub const MAX_BATCH: usize = 16;
/// How long a step waits for the decoding requests that have not sent their next token yet
/// (each is sampling or streaming its last one, normally tens of microseconds). A request
/// whose consumer is slow misses the step instead of holding everyone back.
const GATHER: Duration = Duration::from_millis(1);

/// One model's scheduling state, shared by all its requests.
pub(super) struct Scheduler {
    /// Taken for a request's whole prefill: prefills run one at a time.
    prefill_turn: Mutex<()>,
    /// Held for each prefill layer and each batched decode step, handed over in arrival order.
    compute: Arc<parking_lot::FairMutex<()>>,
    /// Batches the decode steps of concurrent requests (with the CPU decoder).
    batcher: Option<Batcher>,
}

impl Scheduler {
    /// `decoder`: the CPU decoder whose steps are batched, when the model decodes on it.
    pub fn new(decoder: Option<Arc<CpuDecoder>>) -> Scheduler {
        let compute = Arc::new(parking_lot::FairMutex::new(()));
        let batcher = decoder.map(|d| Batcher::start(d, compute.clone()));
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
    /// steps are batched: its steps then go through [`Session::step`].
    pub fn session(&self, decode: &Stage) -> Option<Session<'_>> {
        self.batcher.as_ref().map(|b| b.session(decode))
    }
}

/// One request's step, sent to the batcher and back.
struct Job {
    kv: HostKv,
    pos: usize,
    token: u32,
    logits: Vec<f32>,
    /// The request's decode span: a batch of one labels its CPU profile with it.
    profile: Option<profile::SpanTarget>,
    reply: mpsc::SyncSender<Done>,
}

struct Done {
    kv: HostKv,
    logits: Vec<f32>,
    batch: usize,
    result: candle_core::Result<()>,
}

/// The batcher thread and the channel feeding it.
struct Batcher {
    tx: Mutex<Option<Sender<Job>>>,
    /// Requests between their first and last decode step.
    active: Arc<AtomicUsize>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Batcher {
    /// `compute`: taken for each step, shared with the model's prefill layers.
    pub fn start(decoder: Arc<CpuDecoder>, compute: Arc<parking_lot::FairMutex<()>>) -> Batcher {
        let (tx, rx) = mpsc::channel();
        let active = Arc::new(AtomicUsize::new(0));
        let seen = active.clone();
        let thread = std::thread::Builder::new()
            .name("decode-batcher".into())
            .spawn(move || run(&decoder, &rx, &seen, &compute))
            .expect("spawning the decode batcher");
        Batcher {
            tx: Mutex::new(Some(tx)),
            active,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Registers a request that is about to decode, under its `decode` stage; it counts as
    /// active until dropped.
    pub fn session(&self, decode: &Stage) -> Session<'_> {
        self.active.fetch_add(1, Ordering::Relaxed);
        let (reply, done) = mpsc::sync_channel(1);
        Session {
            batcher: self,
            profile: profile::enabled()
                .then(|| profile::target(decode))
                .flatten(),
            reply,
            done,
        }
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        self.tx.lock().expect("batcher lock").take();
        if let Some(t) = self.thread.lock().expect("batcher lock").take() {
            let _ = t.join();
        }
    }
}

/// A decoding request's handle on the batcher.
pub(super) struct Session<'a> {
    batcher: &'a Batcher,
    profile: Option<profile::SpanTarget>,
    /// Every step's answer comes back on this one channel.
    reply: mpsc::SyncSender<Done>,
    done: Receiver<Done>,
}

impl Session<'_> {
    /// Runs `token` at `pos` of `kv` in the next batched step; `logits` receives the vocabulary's
    /// logits. Returns the number of sequences the step ran for.
    pub fn step(
        &mut self,
        kv: &mut HostKv,
        pos: usize,
        token: u32,
        logits: &mut Vec<f32>,
    ) -> candle_core::Result<usize> {
        let job = Job {
            kv: std::mem::take(kv),
            pos,
            token,
            logits: std::mem::take(logits),
            profile: self.profile.clone(),
            reply: self.reply.clone(),
        };
        let gone = || candle_core::Error::Msg("the decode batcher stopped".into());
        let sent = match self.batcher.tx.lock().expect("batcher lock").as_ref() {
            Some(tx) => tx.send(job).map_err(|_| gone()),
            None => Err(gone()),
        };
        sent?;
        let done = self.done.recv().map_err(|_| gone())?;
        *kv = done.kv;
        *logits = done.logits;
        done.result.map(|()| done.batch)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.batcher.active.fetch_sub(1, Ordering::Relaxed);
    }
}

fn run(
    decoder: &CpuDecoder,
    rx: &Receiver<Job>,
    active: &AtomicUsize,
    compute: &parking_lot::FairMutex<()>,
) {
    let vocab = decoder.vocab();
    let mut logits = Vec::new();
    // The profile label of a batch of one, kept while the same request decodes alone: each
    // label change flushes the profiler, so it changes only when the batch does. A batch of
    // several serves several spans at once; its samples carry no span.
    let mut labelled: (Option<profile::SpanTarget>, Option<profile::Labelled>) = (None, None);
    while let Ok(first) = rx.recv() {
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
            match decoder.check(&job.kv, job.pos, job.token) {
                Ok(()) => valid.push(job),
                Err(e) => finish(job, 0, Err(e)),
            }
        }
        let mut jobs = valid;
        if jobs.is_empty() {
            continue;
        }
        let b = jobs.len();
        let batches = &crate::telemetry::metrics::DECODE_BATCH;
        batches.last.store(b as u64, Ordering::Relaxed);
        batches.largest.fetch_max(b as u64, Ordering::Relaxed);
        let single = if b == 1 {
            jobs[0].profile.clone()
        } else {
            None
        };
        if single != labelled.0 {
            labelled.1 = None;
            labelled.1 = single.as_ref().and_then(profile::label_span);
            labelled.0 = single;
        }
        logits.resize(b * vocab, 0.0);
        let turn = compute.lock();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut steps: Vec<SeqStep<'_>> = jobs
                .iter_mut()
                .map(|j| SeqStep {
                    kv: &mut j.kv,
                    pos: j.pos,
                    token: j.token,
                })
                .collect();
            decoder.step(&mut steps, &mut logits)
        }))
        .unwrap_or_else(|_| Err(candle_core::Error::Msg("decode step panicked".into())));
        drop(turn);
        for (i, mut job) in jobs.into_iter().enumerate() {
            let result = match &result {
                Ok(()) => {
                    job.logits.clear();
                    job.logits
                        .extend_from_slice(&logits[i * vocab..(i + 1) * vocab]);
                    Ok(())
                }
                Err(e) => Err(candle_core::Error::Msg(e.to_string())),
            };
            finish(job, b, result);
        }
    }
}

fn finish(job: Job, batch: usize, result: candle_core::Result<()>) {
    let _ = job.reply.send(Done {
        kv: job.kv,
        logits: job.logits,
        batch,
        result,
    });
}

#[cfg(test)]
mod tests {
    use crate::generate::testing::{model, request, run};
    use crate::generate::{ChatMessage, Generator, Sampling};

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
        let largest = &crate::telemetry::metrics::DECODE_BATCH.largest;
        assert!(
            largest.load(std::sync::atomic::Ordering::Relaxed) > 1,
            "the steps never ran batched"
        );
    }
}
