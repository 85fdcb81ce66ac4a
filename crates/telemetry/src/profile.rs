//! CPU profiles cut by span: the Pyroscope agent (pprof backend, SIGPROF sampling) runs when a
//! server address is configured, and while a pipeline stage runs, the samples of the threads
//! doing its work carry that stage's `span_id`, `trace_id` and `span_name` labels. The stage's
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

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, Result};
use opentelemetry::KeyValue;
use pyroscope::backend::{pprof_backend, BackendConfig, PprofConfig, Tag};
use pyroscope::pyroscope::{PyroscopeAgentBuilder, PyroscopeAgentRunning};
use pyroscope::{PyroscopeAgent, ThreadId};

use super::span::Stage;
use super::TelemetryArgs;
use crate::names::attr;

/// Where and how to profile.
#[derive(Debug, Clone)]
pub struct ProfileSettings {
    /// Pyroscope server, e.g. `http://pyroscope:4040`.
    pub url: String,
    pub application: String,
    /// Samples per second per thread.
    pub sample_rate: u32,
    pub upload_interval: Duration,
}

impl ProfileSettings {
    /// From the `--pyroscope-*` settings; `None` when no server is set.
    pub fn from_args(args: &TelemetryArgs, application: &str) -> Option<ProfileSettings> {
        Some(ProfileSettings {
            url: args.pyroscope_server()?.to_string(),
            application: application.to_string(),
            sample_rate: args.pyroscope_sample_rate,
            upload_interval: args.pyroscope_upload_interval,
        })
    }
}

struct Profiler {
    agent: Mutex<Option<PyroscopeAgent<PyroscopeAgentRunning>>>,
    /// rayon's global pool: where candle's kernels run.
    compute_threads: Vec<ThreadId>,
}

static PROFILER: OnceLock<Profiler> = OnceLock::new();

/// Stops the agent (uploading what it holds) when dropped.
pub struct ProfilerGuard;

impl Drop for ProfilerGuard {
    fn drop(&mut self) {
        if let Some(p) = PROFILER.get() {
            if let Some(agent) = p.agent.lock().expect("profiler lock").take() {
                if let Ok(ready) = agent.stop() {
                    ready.shutdown();
                }
            }
        }
    }
}

/// Starts the agent. Upload failures are the agent's to log; they never reach a request.
pub fn start(settings: &ProfileSettings) -> Result<ProfilerGuard> {
    let mut compute_threads: Vec<ThreadId> = rayon::broadcast(|_| ThreadId::pthread_self());
    compute_threads.extend(barrier_pool_threads());
    let backend = pprof_backend(
        PprofConfig {
            sample_rate: settings.sample_rate,
        },
        BackendConfig::default(),
    );
    let agent = PyroscopeAgentBuilder::new(
        &settings.url,
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
    .context("starting the Pyroscope agent")?;
    let _ = PROFILER.set(Profiler {
        agent: Mutex::new(Some(agent)),
        compute_threads,
    });
    tracing::info!(url = %settings.url, rate = settings.sample_rate, "CPU profiling to Pyroscope");
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
        .is_some_and(|p| p.agent.lock().is_ok_and(|a| a.is_some()))
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
    let guard = profiler.agent.lock().ok()?;
    let agent = guard.as_ref()?;
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
            let _ = agent.add_thread_tag(t.clone(), tag.clone());
        }
    }
    Some(Labelled { threads, tags })
}

impl Drop for Labelled {
    fn drop(&mut self) {
        let Some(profiler) = PROFILER.get() else {
            return;
        };
        let Ok(guard) = profiler.agent.lock() else {
            return;
        };
        let Some(agent) = guard.as_ref() else { return };
        for t in &self.threads {
            for tag in &self.tags {
                let _ = agent.remove_thread_tag(t.clone(), tag.clone());
            }
        }
    }
}
