//! Model-worker threads fed by one bounded queue.
//!
//! Model compute never runs on the async runtime's threads: a job is queued here and run by a
//! dedicated thread. The queue has a fixed capacity; a full queue is refused at once (the API
//! answers 429 with Retry-After) rather than letting latency grow without bound. Each job's wait
//! is recorded as a `queue` stage under the span that submitted it.
//! How a running model then shares the cores between requests is `generate::schedule`'s policy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use opentelemetry::KeyValue;
use tokio::sync::oneshot;

use crate::telemetry::metrics::metrics;
use crate::telemetry::names::{attr, metric, StageKind};
use crate::telemetry::span::Stage;

type Job = Box<dyn FnOnce() + Send>;

/// The queue was full; retry later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

pub struct Workers {
    tx: Mutex<Option<SyncSender<Job>>>,
    depth: Arc<AtomicUsize>,
    capacity: usize,
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
        let observed = depth.clone();
        let _gauge = opentelemetry::global::meter(crate::telemetry::span::SCOPE)
            .u64_observable_gauge(metric::QUEUE_DEPTH)
            .with_unit("{request}")
            .with_description("Requests waiting for a model worker")
            .with_callback(move |o| o.observe(observed.load(Ordering::Relaxed) as u64, &[]))
            .build();
        Workers {
            tx: Mutex::new(Some(tx)),
            depth,
            capacity,
            threads: Mutex::new(handles),
        }
    }

    /// Jobs waiting for a worker right now.
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queues `work`; the receiver yields its result. A `queue` child of `parent` spans the
    /// wait. If the receiver is dropped before a worker picks the job up, the job is skipped.
    pub fn submit<T, F>(&self, parent: &Stage, work: F) -> Result<oneshot::Receiver<T>, QueueFull>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (done_tx, done_rx) = oneshot::channel();
        let queue = parent.child(StageKind::Queue.span_prefix());
        let waiting = self.depth.fetch_add(1, Ordering::Relaxed);
        queue.set(KeyValue::new(attr::QUEUE_DEPTH_AT_ENTRY, waiting as i64));
        let depth = self.depth.clone();
        let job: Job = Box::new(move || {
            depth.fetch_sub(1, Ordering::Relaxed);
            metrics().stage(StageKind::Queue, queue.end());
            if done_tx.is_closed() {
                return;
            }
            let _ = done_tx.send(work());
        });
        let sent = match self.tx.lock().expect("worker queue lock").as_ref() {
            Some(tx) => tx.try_send(job),
            None => Err(TrySendError::Disconnected(job)),
        };
        match sent {
            Ok(()) => Ok(done_rx),
            Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => {
                self.depth.fetch_sub(1, Ordering::Relaxed);
                // The queue span of a refused job ends at once and says why.
                drop(job);
                Err(QueueFull)
            }
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
mod tests {
    use super::*;
    use std::time::Duration;

    fn root() -> Stage {
        Stage::root("t")
    }

    #[tokio::test]
    async fn runs_jobs_off_the_caller_thread() {
        let w = Workers::new(1, 4);
        let caller = std::thread::current().id();
        let rx = w
            .submit(&root(), move || std::thread::current().id() != caller)
            .unwrap();
        assert!(rx.await.unwrap());
    }

    #[tokio::test]
    async fn a_full_queue_is_refused_and_then_recovers() {
        let w = Workers::new(1, 1);
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let busy = w
            .submit(&root(), move || release_rx.recv().unwrap())
            .unwrap();
        // Wait until the worker has taken the blocking job off the queue.
        while w.depth() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let queued = w.submit(&root(), || 1).unwrap();
        assert_eq!(w.submit(&root(), || 2).unwrap_err(), QueueFull);
        release_tx.send(()).unwrap();
        busy.await.unwrap();
        assert_eq!(queued.await.unwrap(), 1);
        assert_eq!(w.submit(&root(), || 3).unwrap().await.unwrap(), 3);
    }

    #[tokio::test]
    async fn a_panicking_job_leaves_the_worker_alive() {
        let w = Workers::new(1, 2);
        let rx = w.submit(&root(), || -> u8 { panic!("boom") }).unwrap();
        assert!(rx.await.is_err());
        assert_eq!(w.submit(&root(), || 7).unwrap().await.unwrap(), 7);
    }
}
