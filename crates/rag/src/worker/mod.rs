//! Model-worker threads fed by one bounded queue, with admission by time.
//!
//! Model compute never runs on the async runtime's threads: a job is queued here and run by a
//! dedicated thread. Before a job is queued, its wait is predicted from measured service times
//! (an EWMA per [`JobKind`] and, where admission can tell, per [`Warmth`]: a prompt found in
//! the prefix cache or one to compute) and the jobs ahead of it; a job whose predicted wait is
//! above the configured maximum, or that could not finish before its deadline, is refused at
//! once (the API answers 429 with a `Retry-After` from the same prediction), as is any job
//! beyond the queue's capacity. So an admitted request waits about as long as the limit at most, and a
//! refused one costs nothing: no embedding or tokenisation has run. Before all of these, a job
//! must fit its tenant's quota ([`crate::tenant`]): its request and token buckets and its share
//! of the queue. Each job's wait is a
//! `queue` stage under the span that submitted it. How a running model then shares the cores
//! between requests is `generate::schedule`'s policy.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use tokio::sync::oneshot;

use crate::tenant::{OverQuota, Tenant};
use telemetry::clock::{self, millis};
use telemetry::metrics::metrics;
use telemetry::names::{attr, metric, StageKind};
use telemetry::span::Stage;

type Job = Box<dyn FnOnce() + Send>;

/// What a job does, for the service-time estimate it is admitted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// A whole RAG request (embed → … → generate).
    Query,
    Embed,
    Rerank,
    Ingest,
}

impl JobKind {
    const COUNT: usize = 4;

    fn index(self) -> usize {
        self as usize
    }
}

/// What admission can tell of a job's cost before it runs: whether its prompt is expected to
/// find its prefix in the generator's prefix cache. A RAG prompt computed from scratch costs
/// three to four times the prefill of one found there (1.1 s against 0.3 s on the 2-core box),
/// and a run of such prompts in the queue is what made admitted requests wait past the limit
/// under overload, so the two are timed apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Warmth {
    /// Nothing known (not a RAG request): the kind's estimate over all its jobs.
    #[default]
    Unknown,
    /// Most of its prompt is cached.
    Warm,
    /// Most of its prompt will be computed.
    Cold,
}

/// Why a job was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The queue holds `--queue-capacity` jobs already.
    QueueFull,
    /// The predicted wait is above `--max-queue-wait-ms`.
    MaxWait,
    /// The predicted wait plus the job's own service time would pass its deadline.
    Deadline,
    /// The tenant's request bucket is empty (`rps`).
    TenantRequests,
    /// The tenant's token bucket is in debt (`tokens`).
    TenantTokens,
    /// The tenant's jobs hold its share of the queue already (`share`).
    TenantShare,
}

impl Refusal {
    /// The `reason` label of the rejection counter and the error's `code`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::MaxWait => "queue_wait",
            Refusal::Deadline => "deadline",
            Refusal::TenantRequests => "tenant_rps",
            Refusal::TenantTokens => "tenant_tokens",
            Refusal::TenantShare => "tenant_queue_share",
        }
    }
}

/// A job refused at admission, with what the client should be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub reason: Refusal,
    /// The wait predicted for the job.
    pub wait: Duration,
    /// What the job was allowed to wait.
    pub allowed: Duration,
    /// When the queue is expected to have room for it (whole seconds, at least 1).
    pub retry_after_s: u64,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (wait, allowed) = (millis(self.wait), millis(self.allowed));
        match self.reason {
            Refusal::QueueFull => write!(f, "the server is at capacity: the model queue is full"),
            Refusal::MaxWait => write!(
                f,
                "the server is at capacity: the expected wait for a model worker ({wait:.0} ms) is above what this server admits ({allowed:.0} ms)"
            ),
            Refusal::Deadline => write!(
                f,
                "the server is at capacity: the expected wait for a model worker ({wait:.0} ms) and the usual service time would pass this request's deadline"
            ),
            Refusal::TenantRequests => write!(f, "this tenant's request rate quota is used up"),
            Refusal::TenantTokens => write!(
                f,
                "this tenant's token quota (prompt + output tokens per second) is used up"
            ),
            Refusal::TenantShare => write!(
                f,
                "this tenant's requests hold its share of the model queue already"
            ),
        }?;
        write!(f, "; retry after {} s", self.retry_after_s)
    }
}

/// What the admission decision knows: measured service times, the jobs ahead, and how far
/// measured waits have run past their predictions.
struct Ledger {
    /// Measured service times per [`JobKind`], all of its jobs.
    service: [Estimate; JobKind::COUNT],
    /// Measured service times per [`JobKind`] of the jobs whose [`Warmth`] was known: warm,
    /// cold.
    by_warmth: [[Estimate; 2]; JobKind::COUNT],
    /// Queued jobs in arrival order.
    queued: VecDeque<Queued>,
    /// Jobs running now.
    running: Vec<Started>,
    next_id: u64,
    calibration: Calibration,
}

/// A job waiting for a worker.
struct Queued {
    id: u64,
    kind: JobKind,
    warmth: Warmth,
    /// Its tenant's name.
    tenant: Option<Arc<str>>,
    /// The uncorrected wait predicted when it was admitted, seconds, and when that was.
    predicted: f64,
    at: Instant,
}

impl Queued {
    fn new(id: u64, kind: JobKind) -> Queued {
        Queued {
            id,
            kind,
            warmth: Warmth::Unknown,
            tenant: None,
            predicted: 0.0,
            at: Instant::now(),
        }
    }
}

/// A job on a worker, since `at`.
#[derive(Debug, Clone, Copy)]
struct Started {
    id: u64,
    kind: JobKind,
    warmth: Warmth,
    at: Instant,
}

/// Weight of the newest measurement in the service-time EWMA: about the last ten jobs count.
const EWMA_WEIGHT: f64 = 0.2;

/// An EWMA of measured service times and of their absolute deviation from it, seconds.
#[derive(Debug, Clone, Copy, Default)]
struct Estimate {
    /// `None` until a job was measured.
    mean: Option<f64>,
    spread: f64,
}

impl Estimate {
    fn add(&mut self, x: f64) {
        match self.mean {
            None => self.mean = Some(x),
            Some(m) => {
                self.spread += EWMA_WEIGHT * ((x - m).abs() - self.spread);
                self.mean = Some(m + EWMA_WEIGHT * (x - m));
            }
        }
    }
}

/// The correction applied to predicted waits, learned from the jobs that waited.
///
/// The prediction lists the queue onto the workers with the mean service time, so it is short
/// whenever service times rise under load (more requests decode together) and whenever a running
/// job outlives the mean (its remaining time reads as zero). Under 4× overload on an idle machine
/// admitted requests waited 10.5 s at the median and 13.6 s at p99 against a 10 s limit. So each
/// job that starts reports the ratio of its measured wait to its prediction, and admission
/// multiplies predictions by a high estimate of that ratio (mean plus three mean absolute
/// deviations; with two, 19 of 106 admitted requests still waited past a 10 s limit, p99 10.8 s):
/// a request is admitted only if even a pessimistic reading of its wait fits.
#[derive(Debug, Clone, Copy)]
struct Calibration {
    mean: f64,
    spread: f64,
    samples: u32,
}

impl Calibration {
    /// Waits predicted shorter than this say little about the ratio (scheduling noise).
    const MIN_PREDICTED_S: f64 = 0.25;
    /// Ratios seen before the correction applies.
    const MIN_SAMPLES: u32 = 4;
    const WEIGHT: f64 = 0.1;
    const MAX_FACTOR: f64 = 4.0;

    const fn new() -> Calibration {
        Calibration {
            mean: 1.0,
            spread: 0.0,
            samples: 0,
        }
    }

    fn observe(&mut self, predicted: f64, waited: f64) {
        if predicted < Self::MIN_PREDICTED_S {
            return;
        }
        let ratio = (waited / predicted).min(Self::MAX_FACTOR * 2.0);
        if self.samples == 0 {
            self.mean = ratio;
        } else {
            self.spread += Self::WEIGHT * ((ratio - self.mean).abs() - self.spread);
            self.mean += Self::WEIGHT * (ratio - self.mean);
        }
        self.samples = self.samples.saturating_add(1);
    }

    /// What predictions are multiplied by: at least 1 (the correction only lengthens them).
    fn factor(&self) -> f64 {
        if self.samples < Self::MIN_SAMPLES {
            return 1.0;
        }
        (self.mean + 3.0 * self.spread).clamp(1.0, Self::MAX_FACTOR)
    }
}

impl Ledger {
    fn new() -> Ledger {
        Ledger {
            service: [Estimate::default(); JobKind::COUNT],
            by_warmth: [[Estimate::default(); 2]; JobKind::COUNT],
            queued: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            calibration: Calibration::new(),
        }
    }

    /// What is known of the service time of a `kind` job of `warmth`: its own class's
    /// measurements once there are some, else the kind's.
    fn estimate(&self, kind: JobKind, warmth: Warmth) -> Estimate {
        let own = match warmth {
            Warmth::Unknown => None,
            Warmth::Warm => Some(self.by_warmth[kind.index()][0]),
            Warmth::Cold => Some(self.by_warmth[kind.index()][1]),
        };
        own.filter(|e| e.mean.is_some())
            .unwrap_or(self.service[kind.index()])
    }

    /// The expected service time of a `kind` job of `warmth`, seconds. Before one has finished
    /// (a cold start) the longest-running job of that kind bounds it from below, so a burst at
    /// start-up is not admitted as if jobs took no time.
    fn service_of(&self, kind: JobKind, warmth: Warmth) -> f64 {
        self.estimate(kind, warmth).mean.unwrap_or_else(|| {
            let now = Instant::now();
            self.running
                .iter()
                .filter(|s| s.kind == kind)
                .map(|s| now.saturating_duration_since(s.at).as_secs_f64())
                .fold(0.0, f64::max)
        })
    }

    /// How long a running job is expected to run on: its expected service time less what it
    /// has run, and at least the usual deviation (a job past the mean has not ended yet, so
    /// zero would be the one value known to be wrong).
    fn remaining(&self, job: &Started, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(job.at).as_secs_f64();
        let spread = self.estimate(job.kind, job.warmth).spread;
        (self.service_of(job.kind, job.warmth) - elapsed).max(spread)
    }

    fn record(&mut self, kind: JobKind, warmth: Warmth, took: Duration) {
        let x = took.as_secs_f64();
        self.service[kind.index()].add(x);
        match warmth {
            Warmth::Unknown => {}
            Warmth::Warm => self.by_warmth[kind.index()][0].add(x),
            Warmth::Cold => self.by_warmth[kind.index()][1].add(x),
        }
    }

    /// When a job submitted now would start, in seconds from now: the running jobs' expected
    /// remaining times and the queued jobs' service times handed to `workers` in FIFO order
    /// (list scheduling), then the earliest worker free after them. Also returns when the
    /// first worker frees up (what a full queue waits for).
    fn predicted_wait(&self, workers: usize, now: Instant) -> (f64, f64) {
        let mut free: Vec<f64> = self
            .running
            .iter()
            .map(|job| self.remaining(job, now))
            .collect();
        free.resize(workers.max(free.len()), 0.0);
        let earliest = |free: &[f64]| {
            free.iter()
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(b.1))
                .map_or((0, 0.0), |(i, &t)| (i, t))
        };
        let first_free = earliest(&free).1;
        for q in &self.queued {
            let (i, t) = earliest(&free);
            free[i] = t + self.service_of(q.kind, q.warmth);
        }
        (earliest(&free).1, first_free)
    }

    /// [`Ledger::predicted_wait`] times the correction learned from measured waits: what
    /// admission, `Retry-After` and the expected-wait gauge use.
    fn expected_wait(&self, workers: usize, now: Instant) -> (f64, f64) {
        let (wait, first_free) = self.predicted_wait(workers, now);
        let k = self.calibration.factor();
        (wait * k, first_free * k)
    }

    fn remove_queued(&mut self, id: u64) -> Option<Queued> {
        let at = self.queued.iter().position(|q| q.id == id)?;
        self.queued.remove(at)
    }

    fn queued_for(&self, tenant: &Tenant) -> usize {
        self.queued
            .iter()
            .filter(|q| q.tenant.as_deref() == Some(tenant.name()))
            .count()
    }
}

/// How long a job may wait, until when it must be done, and whose quota it counts against.
#[derive(Debug, Clone)]
pub struct Admission {
    pub kind: JobKind,
    /// The request's deadline, when it has one.
    pub deadline: Option<Instant>,
    /// The request's tenant ([`crate::tenant::current`] when created); ingest has no quota.
    pub tenant: Option<Tenant>,
    /// Whether its prompt is expected to be cached, when that is known.
    pub warmth: Warmth,
}

impl Admission {
    pub fn new(kind: JobKind) -> Admission {
        Admission {
            kind,
            warmth: Warmth::Unknown,
            deadline: None,
            tenant: crate::tenant::current().filter(|_| kind != JobKind::Ingest),
        }
    }

    pub fn by(mut self, deadline: Instant) -> Admission {
        self.deadline = Some(deadline);
        self
    }

    pub fn warmth(mut self, warmth: Warmth) -> Admission {
        self.warmth = warmth;
        self
    }
}

pub struct Workers {
    tx: Mutex<Option<SyncSender<Job>>>,
    depth: Arc<AtomicUsize>,
    capacity: usize,
    workers: usize,
    /// `--max-queue-wait-ms`; `None`: only the capacity and deadlines bound the wait.
    max_wait: Option<Duration>,
    /// The longest predicted wait admitted: `max_wait` less `--queue-wait-headroom`.
    admit_below: Option<Duration>,
    ledger: Arc<Mutex<Ledger>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Workers {
    pub fn new(threads: usize, capacity: usize) -> Workers {
        let (tx, rx) = sync_channel::<Job>(capacity.max(1));
        let rx = Arc::new(Mutex::new(rx));
        let handles = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("model-worker-{i}"))
                    .spawn(move || worker_loop(&rx))
                    .expect("spawning a model worker")
            })
            .collect();
        let depth = Arc::new(AtomicUsize::new(0));
        let ledger = Arc::new(Mutex::new(Ledger::new()));
        let observed = depth.clone();
        let meter = opentelemetry::global::meter(telemetry::span::SCOPE);
        let _gauge = meter
            .u64_observable_gauge(metric::QUEUE_DEPTH)
            .with_unit("{request}")
            .with_description("Requests waiting for a model worker")
            .with_callback(move |o| o.observe(observed.load(Ordering::Relaxed) as u64, &[]))
            .build();
        let running = ledger.clone();
        let _gauge = meter
            .u64_observable_gauge(metric::JOBS_RUNNING)
            .with_unit("{job}")
            .with_description("Jobs a model worker is running now")
            .with_callback(move |o| {
                if let Ok(l) = running.lock() {
                    o.observe(l.running.len() as u64, &[]);
                }
            })
            .build();
        let (observed, workers) = (ledger.clone(), threads.max(1));
        let _gauge = meter
            .f64_observable_gauge(metric::QUEUE_EXPECTED_WAIT)
            .with_unit("s")
            .with_description("Predicted wait for a model worker of a request arriving now")
            .with_callback(move |o| {
                if let Ok(l) = observed.lock() {
                    o.observe(l.expected_wait(workers, Instant::now()).0, &[]);
                }
            })
            .build();
        Workers {
            tx: Mutex::new(Some(tx)),
            depth,
            capacity,
            workers,
            max_wait: None,
            admit_below: None,
            ledger,
            threads: Mutex::new(handles),
        }
    }

    /// Refuses jobs whose predicted wait is above `max_wait` less the `headroom` share of it
    /// kept for the prediction's error (zero `max_wait`: no limit but the capacity).
    pub fn with_max_wait(mut self, max_wait: Duration, headroom: f64) -> Workers {
        self.max_wait = Some(max_wait).filter(|d| !d.is_zero());
        self.admit_below = self
            .max_wait
            .map(|d| d.mul_f64(1.0 - headroom.clamp(0.0, 0.9)));
        self
    }

    /// Jobs waiting for a worker right now.
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The predicted wait of a job submitted now, and the measured service time per kind
    /// (`/ready` shows them).
    pub fn outlook(&self) -> serde_json::Value {
        let l = self.ledger.lock().expect("worker ledger lock");
        let ms = |e: Estimate| e.mean.map(|s| (s * 1e3).round());
        let service = |k: JobKind| ms(l.service[k.index()]);
        let query = l.by_warmth[JobKind::Query.index()];
        serde_json::json!({
            "expected_wait_ms": (l.expected_wait(self.workers, Instant::now()).0 * 1e3).round(),
            "wait_correction": (l.calibration.factor() * 100.0).round() / 100.0,
            "max_wait_ms": self.max_wait.map(|d| d.as_millis() as u64),
            "admit_below_ms": self.admit_below.map(|d| d.as_millis() as u64),
            "service_ms": {
                "query": service(JobKind::Query),
                "query_cached_prompt": ms(query[0]),
                "query_computed_prompt": ms(query[1]),
                "embed": service(JobKind::Embed),
                "rerank": service(JobKind::Rerank),
                "ingest": service(JobKind::Ingest),
            },
        })
    }

    /// Queues `work` if `admission` allows; the receiver yields its result. A `queue` child of
    /// `parent` spans the wait. If the receiver is dropped before a worker picks the job up, the
    /// job is skipped.
    pub fn submit<T, F>(
        &self,
        admission: Admission,
        parent: &Stage,
        work: F,
    ) -> Result<oneshot::Receiver<T>, Refused>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (kind, warmth) = (admission.kind, admission.warmth);
        let tenant = admission.tenant.clone();
        let (id, expected) = self.admit(&admission).inspect_err(|r| {
            metrics()
                .admission_rejected
                .add(1, &[KeyValue::new(attr::REASON, r.reason.as_str())]);
        })?;
        let (done_tx, done_rx) = oneshot::channel();
        let queue = parent.child(StageKind::Queue.span_prefix());
        let waiting = self.depth.fetch_add(1, Ordering::Relaxed);
        queue.set_all([
            KeyValue::new(attr::QUEUE_DEPTH_AT_ENTRY, waiting as i64),
            KeyValue::new(attr::QUEUE_EXPECTED_WAIT_MS, millis(expected)),
        ]);
        if let Some(t) = &tenant {
            let name = KeyValue::new(attr::TENANT, t.name().to_string());
            queue.set(name.clone());
            parent.set(name);
        }
        let depth = self.depth.clone();
        let ledger = self.ledger.clone();
        let charged = tenant.clone();
        let job: Job = Box::new(move || {
            depth.fetch_sub(1, Ordering::Relaxed);
            let span = queue.span_context();
            metrics().stage(StageKind::Queue, queue.end(), Some(&span));
            let mut running = Running::start(ledger, id, kind, warmth);
            if done_tx.is_closed() {
                // A skipped job measures nothing about the service time.
                return;
            }
            let _tenant = crate::tenant::enter(charged);
            let _ = done_tx.send(work());
            running.measured = true;
        });
        let sent = match self.tx.lock().expect("worker queue lock").as_ref() {
            Some(tx) => tx.try_send(job),
            None => Err(TrySendError::Disconnected(job)),
        };
        match sent {
            Ok(()) => {
                if let Some(t) = &tenant {
                    t.count("admitted");
                }
                Ok(done_rx)
            }
            Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => {
                // Not the tenant's quota: its token goes back (the refusal is counted below).
                if let Some(t) = &tenant {
                    t.refund_request();
                }
                self.depth.fetch_sub(1, Ordering::Relaxed);
                let mut l = self.ledger.lock().expect("worker ledger lock");
                l.remove_queued(id);
                let retry_after_s = retry_after(l.expected_wait(self.workers, Instant::now()).1);
                drop(l);
                // The queue span of a refused job ends at once.
                drop(job);
                let refused = Refused {
                    reason: Refusal::QueueFull,
                    wait: Duration::ZERO,
                    allowed: Duration::ZERO,
                    retry_after_s,
                };
                metrics()
                    .admission_rejected
                    .add(1, &[KeyValue::new(attr::REASON, refused.reason.as_str())]);
                Err(refused)
            }
        }
    }

    /// Decides on a job arriving now and, when it is admitted, enters it in the ledger; returns
    /// its ledger id and predicted wait.
    fn admit(&self, admission: &Admission) -> Result<(u64, Duration), Refused> {
        let now = clock::now();
        let mut l = self.ledger.lock().expect("worker ledger lock");
        if let Some(tenant) = &admission.tenant {
            self.admit_tenant(&l, tenant)?;
        }
        let predicted = l.predicted_wait(self.workers, now).0;
        let (wait, first_free) = l.expected_wait(self.workers, now);
        let own = l.service_of(admission.kind, admission.warmth);
        let refuse = |reason, allowed: f64| Refused {
            reason,
            wait: Duration::from_secs_f64(wait),
            allowed: Duration::from_secs_f64(allowed.max(0.0)),
            retry_after_s: retry_after(wait - allowed.max(0.0)),
        };
        if self.depth() >= self.capacity.max(1) {
            return Err(Refused {
                retry_after_s: retry_after(first_free),
                ..refuse(Refusal::QueueFull, 0.0)
            });
        }
        if let Some(max) = self.admit_below {
            if wait > max.as_secs_f64() {
                return Err(refuse(Refusal::MaxWait, max.as_secs_f64()));
            }
        }
        if let Some(deadline) = admission.deadline {
            let left = deadline.saturating_duration_since(now).as_secs_f64();
            if wait + own > left {
                return Err(refuse(Refusal::Deadline, left - own));
            }
        }
        let id = l.next_id;
        l.next_id += 1;
        let tenant = admission.tenant.as_ref().map(|t| {
            t.take_request();
            Arc::<str>::from(t.name())
        });
        l.queued.push_back(Queued {
            tenant,
            predicted,
            at: now,
            warmth: admission.warmth,
            ..Queued::new(id, admission.kind)
        });
        Ok((id, Duration::from_secs_f64(wait)))
    }

    /// The tenant's part of admission: its buckets, then its share of the queue.
    fn admit_tenant(&self, l: &Ledger, tenant: &Tenant) -> Result<(), Refused> {
        let refuse = |reason: Refusal, outcome, until: f64| {
            tenant.count(outcome);
            Err(Refused {
                reason,
                wait: Duration::ZERO,
                allowed: Duration::ZERO,
                retry_after_s: retry_after(until),
            })
        };
        match tenant.check() {
            Err(OverQuota::Requests { retry_after: until }) => {
                return refuse(Refusal::TenantRequests, "rps", until)
            }
            Err(OverQuota::Tokens { retry_after: until }) => {
                return refuse(Refusal::TenantTokens, "tokens", until)
            }
            Ok(()) => {}
        }
        match tenant.queue_share(self.capacity) {
            Some(share) if l.queued_for(tenant) >= share => {
                let first_free = l.expected_wait(self.workers, Instant::now()).1;
                refuse(Refusal::TenantShare, "queue_share", first_free)
            }
            _ => Ok(()),
        }
    }

    /// Stops taking jobs and waits for the queued ones to finish.
    pub fn shutdown(&self) {
        self.tx.lock().expect("worker queue lock").take();
        for handle in self.threads.lock().expect("worker list lock").drain(..) {
            let _ = handle.join();
        }
    }
}

/// A job on a worker, in the ledger's running list until dropped (a panicking job too); its
/// duration feeds the service-time estimate once it has finished normally.
struct Running {
    ledger: Arc<Mutex<Ledger>>,
    job: Started,
    measured: bool,
}

impl Running {
    fn start(ledger: Arc<Mutex<Ledger>>, id: u64, kind: JobKind, warmth: Warmth) -> Running {
        let job = Started {
            id,
            kind,
            warmth,
            at: Instant::now(),
        };
        if let Ok(mut l) = ledger.lock() {
            if let Some(q) = l.remove_queued(id) {
                let waited = job.at.saturating_duration_since(q.at).as_secs_f64();
                l.calibration.observe(q.predicted, waited);
            }
            l.running.push(job);
        }
        Running {
            ledger,
            job,
            measured: false,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(mut l) = self.ledger.lock() {
            l.running.retain(|s| s.id != self.job.id);
            if self.measured {
                let job = self.job;
                l.record(job.kind, job.warmth, job.at.elapsed());
            }
        }
    }
}

/// Whole seconds until `wait` has passed, at least 1 (what `Retry-After` says).
fn retry_after(wait: f64) -> u64 {
    (wait.max(0.0).ceil() as u64).clamp(1, 3600)
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker_loop(rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = match rx.lock() {
            Ok(guard) => guard.recv(),
            Err(_) => return,
        };
        match job {
            // A panicking job must not take the worker down with it.
            Ok(job) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests;
