//! Span export that never blocks serving: a finished span is handed to a bounded queue with
//! `try_send` and exported in batches by one background thread. A full queue or a failed export
//! drops spans; both are counted (`ragscope.spans.dropped`) and logged at most once a minute.
//!
//! Batch size, queue size and delay follow the standard `OTEL_BSP_*` variables.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;

/// Counts of what happened to telemetry on its way out: finished spans, or OTLP profiles.
#[derive(Debug, Default)]
pub struct ExportStats {
    pub exported: AtomicU64,
    pub dropped_queue_full: AtomicU64,
    pub dropped_export_failed: AtomicU64,
    last_warning: Mutex<Option<Instant>>,
}

impl ExportStats {
    pub fn dropped(&self) -> u64 {
        self.dropped_queue_full.load(Ordering::Relaxed)
            + self.dropped_export_failed.load(Ordering::Relaxed)
    }

    /// Counts one item (span, profile) a full queue turned away, and says so at most once a
    /// minute.
    pub(crate) fn queue_full(&self, signal: &str) {
        self.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        self.warn_rate_limited(&format!(
            "{signal} export: the export queue is full; {signal}s are being dropped"
        ));
    }

    /// Counts `n` items (spans, profiles) a failed export lost, and says so at most once a
    /// minute.
    pub(crate) fn export_failed(&self, n: u64, signal: &str, error: impl std::fmt::Display) {
        self.dropped_export_failed.fetch_add(n, Ordering::Relaxed);
        self.warn_rate_limited(&format!(
            "{signal} export: export failed ({error}); {signal}s are being dropped"
        ));
    }

    fn warn_rate_limited(&self, message: &str) {
        let mut last = self.last_warning.lock().expect("warning lock");
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            *last = Some(Instant::now());
            tracing::warn!(
                dropped_total = self.dropped(),
                "{message} (logged at most once a minute)"
            );
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    pub max_queue: usize,
    pub max_batch: usize,
    pub delay: Duration,
}

impl QueueSettings {
    /// From `OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, `OTEL_BSP_SCHEDULE_DELAY`
    /// (milliseconds), with the specification's defaults (2048, 512, 5000).
    pub fn from_env() -> QueueSettings {
        let get = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|v| *v > 0)
                .unwrap_or(default)
        };
        QueueSettings {
            max_queue: get("OTEL_BSP_MAX_QUEUE_SIZE", 2048) as usize,
            max_batch: get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512) as usize,
            delay: Duration::from_millis(get("OTEL_BSP_SCHEDULE_DELAY", 5000)),
        }
    }
}

enum Message {
    Span(Box<SpanData>),
    Flush(SyncSender<()>),
    /// The provider's resource (`service.name`, …), which the exporter attaches to every batch.
    Resource(Resource),
}

/// A [`SpanProcessor`] that queues finished spans for a background export thread.
#[derive(Debug)]
pub struct ExportQueue {
    tx: Mutex<Option<SyncSender<Message>>>,
    stats: Arc<ExportStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl ExportQueue {
    pub fn new<E: SpanExporter + 'static>(
        exporter: E,
        settings: QueueSettings,
        stats: Arc<ExportStats>,
    ) -> ExportQueue {
        let (tx, rx) = sync_channel(settings.max_queue.max(1));
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("span-export".into())
            .spawn(move || export_loop(exporter, rx, settings, &thread_stats))
            .expect("spawning the span export thread");
        ExportQueue {
            tx: Mutex::new(Some(tx)),
            stats,
            thread: Mutex::new(Some(thread)),
        }
    }

    fn sender(&self) -> Option<SyncSender<Message>> {
        self.tx.lock().ok()?.clone()
    }
}

fn export_loop<E: SpanExporter>(
    mut exporter: E,
    rx: Receiver<Message>,
    settings: QueueSettings,
    stats: &ExportStats,
) {
    let mut batch: Vec<SpanData> = Vec::with_capacity(settings.max_batch);
    let mut deadline = Instant::now() + settings.delay;
    let export = |exporter: &E, batch: &mut Vec<SpanData>| {
        if batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        match futures::executor::block_on(exporter.export(std::mem::take(batch))) {
            Ok(()) => {
                stats.exported.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                stats.export_failed(n, "span", e);
            }
        }
    };
    loop {
        let wait = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Message::Span(span)) => {
                batch.push(*span);
                if batch.len() >= settings.max_batch {
                    export(&exporter, &mut batch);
                    deadline = Instant::now() + settings.delay;
                }
            }
            Ok(Message::Resource(resource)) => exporter.set_resource(&resource),
            Ok(Message::Flush(done)) => {
                // Spans queued before the flush request are already in the batch.
                export(&exporter, &mut batch);
                let _ = done.send(());
            }
            Err(RecvTimeoutError::Timeout) => {
                export(&exporter, &mut batch);
                deadline = Instant::now() + settings.delay;
            }
            Err(RecvTimeoutError::Disconnected) => {
                export(&exporter, &mut batch);
                return;
            }
        }
    }
}

impl SpanProcessor for ExportQueue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let Some(tx) = self.sender() else { return };
        match tx.try_send(Message::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.stats.queue_full("span"),
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        let tx = self.sender().ok_or(OTelSdkError::AlreadyShutdown)?;
        let (done_tx, done_rx) = sync_channel(1);
        // A flush waits for queue room: it is only called at shutdown and by tests.
        tx.send(Message::Flush(done_tx))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        done_rx
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| OTelSdkError::Timeout(Duration::from_secs(30)))
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Some(tx) = self.sender() {
            let _ = tx.send(Message::Resource(resource.clone()));
        }
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        let _ = self.force_flush();
        self.tx.lock().expect("export queue lock").take();
        if let Some(thread) = self.thread.lock().expect("export thread lock").take() {
            let _ = thread.join();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Tracer, TracerProvider};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};

    #[derive(Debug)]
    struct FailingExporter;

    impl SpanExporter for FailingExporter {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            Err(OTelSdkError::InternalFailure("collector down".into()))
        }
    }

    #[test]
    fn spans_reach_the_exporter_on_flush() {
        let exporter = InMemorySpanExporter::default();
        let stats = Arc::new(ExportStats::default());
        let queue = ExportQueue::new(exporter.clone(), QueueSettings::from_env(), stats.clone());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .build();
        let tracer = provider.tracer("t");
        for _ in 0..10 {
            tracer.start("s");
        }
        provider.force_flush().unwrap();
        assert_eq!(exporter.get_finished_spans().unwrap().len(), 10);
        assert_eq!(stats.exported.load(Ordering::Relaxed), 10);
        assert_eq!(stats.dropped(), 0);
    }

    #[test]
    fn a_dead_collector_costs_counted_spans_not_callers() {
        let stats = Arc::new(ExportStats::default());
        let settings = QueueSettings {
            max_queue: 4,
            max_batch: 2,
            delay: Duration::from_secs(60),
        };
        let queue = ExportQueue::new(FailingExporter, settings, stats.clone());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .build();
        let tracer = provider.tracer("t");
        let started = Instant::now();
        for _ in 0..1000 {
            tracer.start("s");
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "ending spans must not block"
        );
        provider.force_flush().unwrap();
        assert_eq!(stats.dropped(), 1000);
        assert_eq!(stats.exported.load(Ordering::Relaxed), 0);
    }
}
