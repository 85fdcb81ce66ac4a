//! CPU profiles cut by span: one sampler (the pprof backend, SIGPROF) runs when a Pyroscope
//! server or OTLP profiles are configured, and while a pipeline stage runs, the samples of the
//! threads doing its work carry that stage's `span_id`, `trace_id` and `span_name` labels. The
//! Pyroscope agent pushes them; with OTLP profiles on, a tee ([`otlp`]) also exports each
//! interval's samples as the OTLP profiles signal, each linked to its trace and span. The stage's
//! span gets `pyroscope.profile.id` = its span id, which is what Grafana's "profiles for this
//! span" looks up.
//!
//! The threads doing a stage's work are the model worker running it and the compute pools candle
//! parallelises on (rayon's global pool, and the barrier pool the CPU decode kernels use), so
//! they are labelled. The decode batcher labels a batched step that is a span with that step's
//! span (`decode_step`), so a step has its own flame graph. Each label change makes the
//! agent cut its sample buffer (about 1 ms), so labels change at stage granularity only.
//! With more than one model worker, compute-pool samples of concurrent stages carry both
//! stages' labels: per-span profiles are exact with `--workers 1`.

pub mod otlp;

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, Context as _, Result};
use opentelemetry::KeyValue;
use pyroscope::backend::{
    pprof_backend, Backend, BackendConfig, BackendImpl, BackendReady, PprofConfig, Tag, ThreadTag,
};
use pyroscope::pyroscope::{PyroscopeAgentBuilder, PyroscopeAgentRunning};
use pyroscope::{PyroscopeAgent, ThreadId};

use super::span::Stage;
use super::TelemetryArgs;
use crate::names::attr;

/// Where and how to profile.
#[derive(Debug, Clone)]
pub struct ProfileSettings {
    /// Pyroscope server, e.g. `http://pyroscope:4040`; `None`: no Pyroscope push.
    pub url: Option<String>,
    /// OTLP/gRPC receiver of the profiles signal, e.g. `http://otel-collector:4317`; `None`:
    /// no OTLP profiles.
    pub otlp_endpoint: Option<String>,
    pub application: String,
    /// Samples per second per thread.
    pub sample_rate: u32,
    pub upload_interval: Duration,
}

impl ProfileSettings {
    /// From the `--pyroscope-*` and `--otlp-profiles*` settings; `None` when neither way out
    /// is set.
    pub fn from_args(args: &TelemetryArgs, application: &str) -> Option<ProfileSettings> {
        let url = args.pyroscope_server().map(str::to_string);
        let otlp_endpoint = args.otlp_profiles_target();
        if url.is_none() && otlp_endpoint.is_none() {
            return None;
        }
        Some(ProfileSettings {
            url,
            otlp_endpoint,
            application: application.to_string(),
            sample_rate: args.pyroscope_sample_rate,
            upload_interval: args.pyroscope_upload_interval,
        })
    }
}

/// What drives the sampler: the Pyroscope agent (which pushes what each interval's report
/// returns), or, with OTLP profiles only, a timer of ours, so no agent tries to reach a
/// Pyroscope server that does not exist (its session pushes every interval, empty or not).
enum Driver {
    Agent(Box<PyroscopeAgent<PyroscopeAgentRunning>>),
    Timer(Timer),
}

impl Driver {
    fn backend(&self) -> &BackendImpl<BackendReady> {
        match self {
            Driver::Agent(agent) => &agent.backend,
            Driver::Timer(timer) => &timer.backend,
        }
    }

    /// Takes the last interval's report and stops sampling.
    fn stop(self) {
        match self {
            Driver::Agent(agent) => {
                if let Ok(ready) = agent.stop() {
                    ready.shutdown();
                }
            }
            Driver::Timer(timer) => timer.stop(),
        }
    }
}

/// Reports the backend every upload interval, and once more when stopped.
struct Timer {
    backend: BackendImpl<BackendReady>,
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Timer {
    fn start(backend: BackendImpl<BackendReady>, interval: Duration) -> Result<Timer> {
        let shared = Arc::clone(&backend.backend);
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("profile-timer".into())
            .spawn(move || loop {
                let last = !matches!(
                    stopped.recv_timeout(interval),
                    Err(RecvTimeoutError::Timeout)
                );
                // The tee forwards the reports; what `report` returns has nowhere to go.
                let report = match shared.lock() {
                    Ok(mut backend) => backend.as_mut().map(|b| b.report()),
                    Err(_) => None,
                };
                if let Some(Err(e)) = report {
                    tracing::warn!("CPU profile report failed: {e}");
                }
                if last {
                    return;
                }
            })
            .context("spawning the profile timer")?;
        Ok(Timer {
            backend,
            stop,
            thread,
        })
    }

    fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
        let _ = self.backend.shutdown();
    }
}

struct Profiler {
    driver: Mutex<Option<Driver>>,
    /// The OTLP profiles export thread, joined at shutdown so the last interval goes out.
    exporter: Mutex<Option<otlp::Exporter>>,
    /// rayon's global pool: where candle's kernels run.
    compute_threads: Vec<ThreadId>,
}

static PROFILER: OnceLock<Profiler> = OnceLock::new();

/// Stops the sampler (sending what it holds) when dropped.
pub struct ProfilerGuard;

impl Drop for ProfilerGuard {
    fn drop(&mut self) {
        if let Some(p) = PROFILER.get() {
            if let Some(driver) = p.driver.lock().expect("profiler lock").take() {
                driver.stop();
            }
            if let Some(exporter) = p.exporter.lock().expect("profiler lock").take() {
                exporter.join();
            }
        }
    }
}

/// Starts the sampler and whichever ways out are set. Upload and export failures are logged
/// and counted; they never reach a request.
pub fn start(settings: &ProfileSettings) -> Result<ProfilerGuard> {
    let mut compute_threads: Vec<ThreadId> = rayon::broadcast(|_| ThreadId::pthread_self());
    compute_threads.extend(barrier_pool_threads());
    let pprof = pprof_backend(
        PprofConfig {
            sample_rate: settings.sample_rate,
        },
        BackendConfig::default(),
    );
    let (backend, exporter) = match &settings.otlp_endpoint {
        Some(endpoint) => {
            let inner: Box<dyn Backend> = pprof
                .backend
                .lock()
                .map_err(|_| anyhow!("the pprof backend's lock is poisoned"))?
                .take()
                .context("the pprof backend is gone")?;
            let (tee, exporter) = otlp::tee(
                inner,
                endpoint,
                crate::trace_resource(),
                settings.sample_rate,
                settings.url.is_some(),
            )?;
            (BackendImpl::new(Box::new(tee)), Some(exporter))
        }
        None => (pprof, None),
    };
    let driver = match &settings.url {
        Some(url) => Driver::Agent(Box::new(
            PyroscopeAgentBuilder::new(
                url,
                &settings.application,
                settings.sample_rate,
                "pyroscope-rs",
                env!("CARGO_PKG_VERSION"),
                backend,
            )
            .upload_interval(settings.upload_interval)
            .build()
            .context("building the Pyroscope agent")?
            .start()
            .context("starting the Pyroscope agent")?,
        )),
        None => Driver::Timer(Timer::start(
            backend.initialize().context("starting the CPU sampler")?,
            settings.upload_interval,
        )?),
    };
    let _ = PROFILER.set(Profiler {
        driver: Mutex::new(Some(driver)),
        exporter: Mutex::new(exporter),
        compute_threads,
    });
    tracing::info!(
        pyroscope = settings.url.as_deref().unwrap_or("off"),
        otlp_profiles = settings.otlp_endpoint.as_deref().unwrap_or("off"),
        rate = settings.sample_rate,
        "CPU profiling"
    );
    Ok(ProfilerGuard)
}

/// The workers of candle's barrier pool, which the CPU decode kernels split their rows over:
/// `execute` runs the closure once on every worker and once on the caller (the last index),
/// which is left out.
fn barrier_pool_threads() -> Vec<ThreadId> {
    let pool = candle_core::utils::barrier_pool();
    let workers = pool.n_workers();
    let seen = Mutex::new(Vec::with_capacity(workers));
    pool.execute(|tid| {
        if tid < workers {
            seen.lock()
                .expect("thread list lock")
                .push(ThreadId::pthread_self());
        }
    });
    seen.into_inner().expect("thread list lock")
}

pub fn enabled() -> bool {
    PROFILER
        .get()
        .is_some_and(|p| p.driver.lock().is_ok_and(|d| d.is_some()))
}

/// While alive, CPU samples of the calling thread and the compute pool are labelled with
/// `stage`'s span. `None` when profiling is off or the span is not recorded.
pub struct Labelled {
    threads: Vec<ThreadId>,
    tags: Vec<Tag>,
}

/// Labels the current thread and the compute pool with `stage` until the result is dropped,
/// and marks the span as profiled.
pub fn label(stage: &Stage) -> Option<Labelled> {
    label_span(&target(stage)?)
}

/// What a profile label names: a span, readable on any thread (a [`Stage`] stays with its
/// request's thread).
#[derive(Debug, Clone, PartialEq)]
pub struct SpanTarget {
    span_id: String,
    trace_id: String,
    name: String,
}

/// `stage` as a label target, and marks it as profiled; `None` when profiling is off or the
/// span is not recorded.
pub fn target(stage: &Stage) -> Option<SpanTarget> {
    PROFILER.get()?;
    let target = SpanTarget {
        span_id: stage.span_id()?,
        trace_id: stage.trace_id()?,
        name: stage.name().to_string(),
    };
    stage.set(KeyValue::new(
        attr::PYROSCOPE_PROFILE_ID,
        target.span_id.clone(),
    ));
    Some(target)
}

/// [`label`] for a span owned by another thread (the decode batcher's batch of one).
pub fn label_span(target: &SpanTarget) -> Option<Labelled> {
    let profiler = PROFILER.get()?;
    let SpanTarget {
        span_id,
        trace_id,
        name,
    } = target.clone();
    let guard = profiler.driver.lock().ok()?;
    let backend = guard.as_ref()?.backend();
    let mut threads = profiler.compute_threads.clone();
    let me = ThreadId::pthread_self();
    if !threads.contains(&me) {
        threads.push(me);
    }
    let tags = vec![
        Tag::new("span_id".into(), span_id.clone()),
        Tag::new("trace_id".into(), trace_id),
        Tag::new("span_name".into(), name),
    ];
    for t in &threads {
        for tag in &tags {
            let _ = backend.add_tag(ThreadTag::new(t.clone(), tag.clone()));
        }
    }
    Some(Labelled { threads, tags })
}

impl Drop for Labelled {
    fn drop(&mut self) {
        let Some(profiler) = PROFILER.get() else {
            return;
        };
        let Ok(guard) = profiler.driver.lock() else {
            return;
        };
        let Some(driver) = guard.as_ref() else { return };
        for t in &self.threads {
            for tag in &self.tags {
                let _ = driver
                    .backend()
                    .remove_tag(ThreadTag::new(t.clone(), tag.clone()));
            }
        }
    }
}
