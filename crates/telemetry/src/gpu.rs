//! GPU time on the shared clock: CUDA events around each GPU phase (embed forward, rerank
//! forward, prefill, sampled decode steps), placed on [`clock`](super::clock) and emitted as
//! `gpu <phase>` child spans of the host stage that launched the work; plus GPU memory gauges.
//!
//! CUDA events measure device time between two points of a stream, but on the device's own
//! clock. We anchor it to ours at a synchronisation point: after the end event has completed
//! (`cuEventSynchronize`) the host reads the shared clock, and the device interval is laid back
//! from there. Without the `cuda` feature, or on the CPU, every call here is a no-op.

use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use super::clock;
use super::names::{attr, span};
use super::span::Stage;

/// What the host saw of one GPU phase, all readings of the shared clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMarks {
    /// Just before the start event was recorded (the first launch of the phase follows).
    pub launch_start: Instant,
    /// Just after the end event was recorded: every launch of the phase is queued.
    pub launch_end: Instant,
    /// Just after waiting for the end event returned: the device has finished the phase.
    pub synced: Instant,
}

/// One GPU phase on the shared clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuInterval {
    pub start: Instant,
    pub end: Instant,
    /// Device time between the two events (CUDA's own measurement).
    pub device: Duration,
    /// Host time spent launching the phase's work (`launch_start..launch_end`).
    pub host_launch: Duration,
    /// Host window (`launch_start..synced`) minus device time: queueing before the phase ran,
    /// device idle gaps waiting for launches, and the synchronisation's own latency.
    pub gap: Duration,
}

/// Places a phase that took `device` on the GPU onto the shared clock.
///
/// The end event completed no later than `synced` and, because a stream runs in order, the
/// start event completed no earlier than `launch_start`. So the phase ends at `synced` and
/// starts `device` earlier, but never before `launch_start`: the interval always lies inside
/// the host window and therefore inside the host span around it. When the device time exceeds
/// the host window (clock granularity; it cannot really happen) the interval is the window.
pub fn anchor(marks: HostMarks, device: Duration) -> GpuInterval {
    let launch_start = marks.launch_start;
    let launch_end = marks.launch_end.max(launch_start);
    let synced = marks.synced.max(launch_end);
    let window = synced - launch_start;
    let start = synced
        .checked_sub(device)
        .unwrap_or(launch_start)
        .max(launch_start);
    GpuInterval {
        start,
        end: synced,
        device,
        host_launch: launch_end - launch_start,
        gap: window.saturating_sub(device),
    }
}

/// Converts CUDA's `cuEventElapsedTime` milliseconds (float, ~0.5 µs resolution) to a duration;
/// negative or non-finite readings become zero.
pub fn device_duration(ms: f32) -> Duration {
    if ms.is_finite() && ms > 0.0 {
        Duration::from_secs_f64(ms as f64 / 1e3)
    } else {
        Duration::ZERO
    }
}

/// Whether decode step `index` (0-based, the first generated token being 0) is timed when every
/// `every`-th step is sampled; 0 times none, 1 every step.
pub fn sampled(index: usize, every: usize) -> bool {
    every != 0 && index.is_multiple_of(every)
}

/// The attributes a `gpu <phase>` span carries.
pub fn attributes(iv: &GpuInterval) -> Vec<KeyValue> {
    vec![
        KeyValue::new(attr::GPU_DEVICE_MS, clock::millis(iv.device)),
        KeyValue::new(attr::GPU_HOST_LAUNCH_MS, clock::millis(iv.host_launch)),
        KeyValue::new(attr::GPU_GAP_MS, clock::millis(iv.gap)),
    ]
}

/// Emits `iv` as the child span `gpu {phase}` of `host`.
pub fn emit(host: &Stage, phase: &str, iv: &GpuInterval, extra: Vec<KeyValue>) {
    let span = host.child_at(format!("{} {phase}", span::GPU), iv.start);
    span.set_all(attributes(iv).into_iter().chain(extra));
    span.end_at(iv.end);
}

static DECODE_SAMPLE_EVERY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(8);

/// Sets how often decode steps are timed on the GPU (`--gpu-decode-sample`).
pub fn set_decode_sample_every(every: usize) {
    DECODE_SAMPLE_EVERY.store(every, std::sync::atomic::Ordering::Relaxed);
}

/// Every how many decode steps one is timed on the GPU (0: none).
pub fn decode_sample_every() -> usize {
    DECODE_SAMPLE_EVERY.load(std::sync::atomic::Ordering::Relaxed)
}

/// A GPU phase being timed. Start it before the phase's first launch, finish it after the last:
/// finishing waits for the device, so put it where the host would wait anyway (before copying
/// results back).
pub struct GpuTimer {
    #[cfg(feature = "cuda")]
    inner: Option<cuda::Running>,
}

impl GpuTimer {
    /// Starts timing on `device`'s stream; a no-op timer on the CPU or without the feature.
    pub fn start(device: &candle_core::Device) -> GpuTimer {
        #[cfg(feature = "cuda")]
        {
            GpuTimer {
                inner: cuda::Running::start(device),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            GpuTimer {}
        }
    }

    /// Whether this timer measures anything.
    pub fn is_active(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.inner.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Waits for the phase to finish on the device and returns it on the shared clock; `None`
    /// for a no-op timer or when the driver reports an error (timing is never worth failing a
    /// request for).
    pub fn finish(self) -> Option<GpuInterval> {
        #[cfg(feature = "cuda")]
        {
            let iv = self.inner?.finish();
            memory::sample();
            iv
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// Finishes and emits `gpu {phase}` under `host`.
    pub fn finish_into(self, host: &Stage, phase: &str) -> Option<GpuInterval> {
        let iv = self.finish()?;
        emit(host, phase, &iv, Vec::new());
        Some(iv)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use candle_core::cuda::cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};

    use super::{anchor, device_duration, GpuInterval, HostMarks};
    use crate::clock;

    pub(super) struct Running {
        stream: Arc<CudaStream>,
        start: CudaEvent,
        launch_start: std::time::Instant,
    }

    impl Running {
        pub(super) fn start(device: &candle_core::Device) -> Option<Running> {
            let stream = device.as_cuda_device().ok()?.cuda_stream();
            let launch_start = clock::now();
            let start = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()?;
            Some(Running {
                stream,
                start,
                launch_start,
            })
        }

        pub(super) fn finish(self) -> Option<GpuInterval> {
            let end = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()?;
            let launch_end = clock::now();
            end.synchronize().ok()?;
            let synced = clock::now();
            let ms = self.start.elapsed_ms(&end).ok()?;
            Some(anchor(
                HostMarks {
                    launch_start: self.launch_start,
                    launch_end,
                    synced,
                },
                device_duration(ms),
            ))
        }
    }
}

/// GPU memory, read through the driver (`cuMemGetInfo`) for the device models run on:
/// `ragscope.gpu.memory.used` (whole device, every process), `ragscope.gpu.memory.peak` (the
/// largest `used` seen at a GPU phase end or a collection), `ragscope.gpu.memory.total`, and
/// `ragscope.gpu.kv_cache.bytes` (KV caches of running generations held on the GPU).
pub mod memory {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    use crate::names::metric;

    /// KV-cache bytes on the GPU; the generator adds and subtracts.
    pub static KV_CACHE_BYTES: AtomicU64 = AtomicU64::new(0);
    static PEAK: AtomicU64 = AtomicU64::new(0);

    #[cfg(feature = "cuda")]
    static CONTEXT: std::sync::OnceLock<
        std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>,
    > = std::sync::OnceLock::new();

    /// Remembers the CUDA device models run on, for the gauges. Does nothing on the CPU.
    pub fn watch(device: &candle_core::Device) {
        #[cfg(feature = "cuda")]
        if let Ok(cuda) = device.as_cuda_device() {
            let _ = CONTEXT.set(cuda.cuda_stream().context().clone());
            sample();
        }
        #[cfg(not(feature = "cuda"))]
        let _ = device;
    }

    /// `(used, total)` bytes on the watched device; `None` without one.
    pub fn read() -> Option<(u64, u64)> {
        #[cfg(feature = "cuda")]
        {
            let (free, total) = CONTEXT.get()?.mem_get_info().ok()?;
            Some(((total - free) as u64, total as u64))
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// Reads the device's usage and raises the peak; returns the usage.
    pub fn sample() -> Option<u64> {
        let (used, _) = read()?;
        PEAK.fetch_max(used, Relaxed);
        Some(used)
    }

    /// The largest usage seen so far (0 before any reading).
    pub fn peak() -> u64 {
        PEAK.load(Relaxed)
    }

    /// Registers the gauges; they report nothing until a CUDA device is watched.
    pub fn register(meter: &opentelemetry::metrics::Meter) {
        let _used = meter
            .u64_observable_gauge(metric::GPU_MEMORY_USED)
            .with_unit("By")
            .with_description("GPU memory in use on the models' device (all processes)")
            .with_callback(|o| {
                if let Some(used) = sample() {
                    o.observe(used, &[]);
                }
            })
            .build();
        let _peak = meter
            .u64_observable_gauge(metric::GPU_MEMORY_PEAK)
            .with_unit("By")
            .with_description("Largest GPU memory use seen at a GPU phase end or a collection")
            .with_callback(|o| {
                if read().is_some() {
                    o.observe(peak(), &[]);
                }
            })
            .build();
        let _total = meter
            .u64_observable_gauge(metric::GPU_MEMORY_TOTAL)
            .with_unit("By")
            .with_description("GPU memory of the models' device")
            .with_callback(|o| {
                if let Some((_, total)) = read() {
                    o.observe(total, &[]);
                }
            })
            .build();
        let _kv = meter
            .u64_observable_gauge(metric::GPU_KV_CACHE_BYTES)
            .with_unit("By")
            .with_description("KV-cache memory of running generations held on the GPU")
            .with_callback(|o| {
                if read().is_some() {
                    o.observe(KV_CACHE_BYTES.load(Relaxed), &[]);
                }
            })
            .build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marks(base: Instant, launch_end_us: u64, synced_us: u64) -> HostMarks {
        HostMarks {
            launch_start: base,
            launch_end: base + Duration::from_micros(launch_end_us),
            synced: base + Duration::from_micros(synced_us),
        }
    }

    #[test]
    fn the_phase_ends_at_the_sync_point_and_lasts_its_device_time() {
        let base = Instant::now();
        let iv = anchor(marks(base, 300, 1_000), Duration::from_micros(600));
        assert_eq!(iv.end, base + Duration::from_micros(1_000));
        assert_eq!(iv.start, base + Duration::from_micros(400));
        assert_eq!(iv.end - iv.start, iv.device);
        assert_eq!(iv.host_launch, Duration::from_micros(300));
        assert_eq!(iv.gap, Duration::from_micros(400));
    }

    #[test]
    fn device_time_longer_than_the_host_window_is_clamped_to_it() {
        let base = Instant::now();
        let iv = anchor(marks(base, 100, 500), Duration::from_micros(800));
        assert_eq!(iv.start, base);
        assert_eq!(iv.end, base + Duration::from_micros(500));
        assert_eq!(iv.gap, Duration::ZERO);
        assert_eq!(
            iv.device,
            Duration::from_micros(800),
            "device time is reported as read"
        );
    }

    #[test]
    fn the_interval_always_lies_inside_the_host_window() {
        let base = Instant::now();
        for (launch_end, synced, device) in [
            (0, 0, 0),
            (10, 10, 10),
            (50, 20, 5), // launch_end after synced: clock readings out of order
            (1, 1_000_000, 999_999),
            (5, 7, 1_000_000),
        ] {
            let m = marks(base, launch_end, synced);
            let iv = anchor(m, Duration::from_micros(device));
            assert!(iv.start >= m.launch_start, "{m:?} {iv:?}");
            assert!(iv.start <= iv.end, "{m:?} {iv:?}");
            assert!(iv.end >= m.synced && iv.end <= m.synced.max(m.launch_end));
            assert!(iv.gap <= iv.end - m.launch_start);
        }
    }

    #[test]
    fn cuda_milliseconds_become_durations() {
        assert_eq!(device_duration(1.5), Duration::from_micros(1_500));
        assert_eq!(device_duration(-0.1), Duration::ZERO);
        assert_eq!(device_duration(f32::NAN), Duration::ZERO);
    }

    #[test]
    fn decode_sampling_picks_every_nth_step() {
        let picked: Vec<usize> = (0..10).filter(|&i| sampled(i, 4)).collect();
        assert_eq!(picked, [0, 4, 8]);
        assert!((0..10).all(|i| sampled(i, 1)));
        assert!(!(0..10).any(|i| sampled(i, 0)));
    }

    #[test]
    fn on_the_cpu_timers_do_nothing() {
        let t = GpuTimer::start(&candle_core::Device::Cpu);
        assert!(!t.is_active());
        assert_eq!(t.finish(), None);
    }

    #[test]
    fn an_emitted_gpu_span_nests_in_its_host_span() {
        use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        // nextest runs each test in its own process, so the global provider is ours alone.
        opentelemetry::global::set_tracer_provider(provider.clone());
        let host = Stage::root("prefill");
        let launch_start = clock::now();
        std::thread::sleep(Duration::from_millis(3));
        let synced = clock::now();
        let iv = anchor(
            HostMarks {
                launch_start,
                launch_end: launch_start + Duration::from_micros(200),
                synced,
            },
            Duration::from_millis(1),
        );
        emit(&host, "prefill", &iv, Vec::new());
        host.end();
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().unwrap();
        let gpu = spans.iter().find(|s| s.name == "gpu prefill").unwrap();
        let host = spans.iter().find(|s| s.name == "prefill").unwrap();
        assert_eq!(gpu.parent_span_id, host.span_context.span_id());
        assert!(gpu.start_time >= host.start_time && gpu.end_time <= host.end_time);
        let device_ms = gpu
            .attributes
            .iter()
            .find(|kv| kv.key.as_str() == "gpu.device_ms")
            .map(|kv| kv.value.to_string());
        assert_eq!(device_ms.as_deref(), Some("1"));
    }
}
