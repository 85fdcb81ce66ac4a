//! Failure snapshots: what a failed generation saw, kept as one JSON file per failure in
//! `<data-dir>/snapshots/` so `ragscope replay` can re-run it and find where a re-run parts from
//! it ([`crate::snapshot::replay`] captures and replays; this module keeps the files).
//!
//! The generator hands a [`Job`] to the store when a generation fails; one `snapshot-writer`
//! thread digests the KV cache, writes the file and evicts the oldest files beyond
//! `--snapshot-max-count` / `--snapshot-max-mb`. The queue holds at most [`QUEUE`] jobs and
//! [`QUEUE_BYTES`] of the KV caches they own; beyond either a new snapshot is dropped. Nothing
//! here ever blocks a request, and every outcome is counted in `ragscope.snapshots{result}`.

pub mod replay;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use opentelemetry::KeyValue;
use serde::{Deserialize, Serialize};

pub use crate::kv_cache::KvDigest;
pub use crate::settings::SnapshotArgs;
use crate::Sampling;
use telemetry::names::attr;

/// The snapshot file format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Snapshots waiting for the writer; beyond this a new one is dropped (and counted).
pub const QUEUE: usize = 16;

/// Bytes of KV cache the waiting snapshots may hold together (two full 2,048-position caches
/// of SmolLM2-135M); beyond this a new one is dropped (and counted).
pub const QUEUE_BYTES: u64 = 192 << 20;

/// Everything a failed generation leaves for `ragscope replay`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    pub version: u32,
    pub id: String,
    pub created_unix_ms: u64,
    /// `error`, `timeout`, `injected_error`, `panic` or `cancelled`.
    pub reason: String,
    /// The error or panic message.
    pub message: Option<String>,
    pub request_id: Option<String>,
    pub trace_id: Option<String>,
    /// The `chat {model}` span that carries `rag.snapshot.id`.
    pub span_id: Option<String>,
    pub model: ModelFacts,
    pub prompt: PromptFacts,
    pub sampling: SamplingFacts,
    /// Tokens generated before the failure, in order (a stop string's too; never an end token).
    pub generated: Vec<u32>,
    /// How many sequences each decode step ran with, one entry per step (CPU batcher; 1
    /// elsewhere). Replay runs every step at batch size 1.
    pub decode_batch_sizes: Vec<u32>,
    /// `None` when the generation failed before its KV cache existed.
    pub kv: Option<KvDigest>,
    pub timings: Timings,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelFacts {
    pub id: String,
    /// [`WeightFormat`](crate::llama::WeightFormat) as its Rust name.
    pub weight_format: String,
    /// `cpu` or `cuda`.
    pub device: String,
    /// How the CPU decoder's cache stored keys and values (`f16`, `f32`); absent for a cache
    /// of device tensors (F32), and in snapshots written before it was recorded (F32 then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_dtype: Option<String>,
    /// The GGUF file's name and the sha256 of its bytes.
    pub file: String,
    pub weights_sha256: Option<String>,
    pub context_window: usize,
    pub n_layer: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Width of a token embedding row (for `--perturb-weight token_embd.weight:ROW*WIDTH+i:..`).
    pub embedding_length: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptFacts {
    /// sha256 over the prompt's token ids, each as 4 little-endian bytes.
    pub sha256: String,
    pub tokens: Vec<u32>,
    /// Leading prompt positions whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SamplingFacts {
    #[serde(flatten)]
    pub sampling: Sampling,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    /// The answer could also end at its first finished paragraph.
    #[serde(default)]
    pub end_at_paragraph: bool,
    pub logprobs: Option<usize>,
    /// The context tokens `context_bias` and `copy_bias` looked at (absent in snapshots of requests without it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub context_tokens: Vec<u32>,
}

/// Stage timings of the failed request, in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Timings {
    /// The request's finished spans (from the recent-trace buffer, so `decode` and `prefill`
    /// too once the failure ended them), by start.
    pub stages: Vec<StageTiming>,
    /// The prefill stage (0 when it did not finish).
    pub prefill_ms: f64,
    /// The `chat {model}` stage from its start to the failure.
    pub chat_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageTiming {
    pub name: String,
    /// From the earliest finished span of the trace.
    pub start_ms: f64,
    pub duration_ms: f64,
}

/// What `GET /debug/snapshots` lists per snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub id: String,
    pub created_unix_ms: u64,
    pub reason: String,
    pub request_id: Option<String>,
    pub trace_id: Option<String>,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub bytes: u64,
}

impl Summary {
    fn of(s: &Snapshot, bytes: u64) -> Summary {
        Summary {
            id: s.id.clone(),
            created_unix_ms: s.created_unix_ms,
            reason: s.reason.clone(),
            request_id: s.request_id.clone(),
            trace_id: s.trace_id.clone(),
            prompt_tokens: s.prompt.tokens.len(),
            generated_tokens: s.generated.len(),
            bytes,
        }
    }
}

/// Work the writer thread does for one snapshot: builds it (digesting the KV cache it owns).
/// `None` writes nothing.
pub type Job = Box<dyn FnOnce() -> Option<Snapshot> + Send>;

/// The bounded snapshot directory and its writer.
pub struct SnapshotStore {
    dir: PathBuf,
    max_count: usize,
    max_bytes: u64,
    on_cancel: bool,
    /// Jobs and the bytes of KV cache each owns.
    tx: SyncSender<(Job, u64)>,
    /// KV-cache bytes owned by queued jobs.
    pending: Arc<AtomicU64>,
    /// Snapshots on disk by id (ids sort by creation time).
    index: Arc<Mutex<BTreeMap<String, Summary>>>,
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

impl SnapshotStore {
    /// The store in `<data_dir>/snapshots`, with the snapshots already there; `None` with
    /// `--snapshots off`.
    pub fn open(args: &SnapshotArgs, data_dir: &Path) -> Result<Option<Arc<SnapshotStore>>> {
        if !args.snapshots {
            return Ok(None);
        }
        let dir = data_dir.join("snapshots");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut index = BTreeMap::new();
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let read = std::fs::read(&path).ok().and_then(|b| {
                serde_json::from_slice::<Snapshot>(&b)
                    .ok()
                    .map(|s| (s, b.len()))
            });
            match read {
                Some((s, bytes)) => {
                    index.insert(s.id.clone(), Summary::of(&s, bytes as u64));
                }
                None => tracing::warn!(path = %path.display(), "not a snapshot this build reads"),
            }
        }
        let (tx, rx) = sync_channel::<(Job, u64)>(QUEUE);
        let pending = Arc::new(AtomicU64::new(0));
        let store = Arc::new(SnapshotStore {
            dir,
            max_count: args.snapshot_max_count.max(1),
            max_bytes: args.snapshot_max_mb.saturating_mul(1 << 20).max(1),
            on_cancel: args.snapshot_on_cancel,
            tx,
            pending: pending.clone(),
            index: Arc::new(Mutex::new(index)),
        });
        let writer = Writer {
            dir: store.dir.clone(),
            max_count: store.max_count,
            max_bytes: store.max_bytes,
            index: store.index.clone(),
        };
        writer.evict();
        std::thread::Builder::new()
            .name("snapshot-writer".into())
            .spawn(move || {
                // Ends when the store (the only sender) is dropped.
                for (job, bytes) in rx {
                    let snapshot = job();
                    pending.fetch_sub(bytes, Ordering::Relaxed);
                    if let Some(snapshot) = snapshot {
                        writer.write(snapshot);
                    }
                }
            })?;
        Ok(Some(store))
    }

    /// Whether a client that went away counts as a failure (`--snapshot-on-cancel`).
    pub fn on_cancel(&self) -> bool {
        self.on_cancel
    }

    /// A new id: creation time in Unix milliseconds, a per-process sequence number and a random
    /// suffix, so ids sort by creation and never collide between processes.
    pub fn new_id(now_unix_ms: u64) -> String {
        let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        format!("{now_unix_ms:013}-{seq:06}-{:04x}", rand::random::<u16>())
    }

    /// Queues a snapshot whose job owns `bytes` of KV cache for the writer, without waiting;
    /// `false` (and a count) when the queue is full.
    pub fn submit(&self, job: Job, bytes: u64) -> bool {
        let before = self.pending.fetch_add(bytes, Ordering::Relaxed);
        let queued = before + bytes <= QUEUE_BYTES
            && match self.tx.try_send((job, bytes)) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            };
        if !queued {
            self.pending.fetch_sub(bytes, Ordering::Relaxed);
            count("dropped");
        }
        queued
    }

    /// The snapshots on disk, oldest first.
    pub fn list(&self) -> Vec<Summary> {
        self.index
            .lock()
            .expect("snapshot index")
            .values()
            .cloned()
            .collect()
    }

    /// One snapshot's file, as written; `None` for an unknown id.
    pub fn get(&self, id: &str) -> Option<Vec<u8>> {
        if !self.index.lock().expect("snapshot index").contains_key(id) {
            return None;
        }
        std::fs::read(self.dir.join(format!("{id}.json"))).ok()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The writer thread's half: files and the bounds.
struct Writer {
    dir: PathBuf,
    max_count: usize,
    max_bytes: u64,
    index: Arc<Mutex<BTreeMap<String, Summary>>>,
}

impl Writer {
    fn write(&self, snapshot: Snapshot) {
        let written = serde_json::to_vec(&snapshot)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| {
                if bytes.len() as u64 > self.max_bytes {
                    anyhow::bail!(
                        "{} bytes exceed --snapshot-max-mb on their own",
                        bytes.len()
                    );
                }
                let path = self.dir.join(format!("{}.json", snapshot.id));
                let partial = path.with_extension("json.partial");
                std::fs::write(&partial, &bytes)?;
                std::fs::rename(&partial, &path)?;
                Ok(bytes.len() as u64)
            });
        match written {
            Ok(bytes) => {
                self.index
                    .lock()
                    .expect("snapshot index")
                    .insert(snapshot.id.clone(), Summary::of(&snapshot, bytes));
                count("written");
                self.evict();
            }
            Err(e) => {
                count("failed");
                tracing::warn!(id = %snapshot.id, error = %e, "snapshot not written");
            }
        }
    }

    /// Removes the oldest snapshots until both bounds hold.
    fn evict(&self) {
        let mut index = self.index.lock().expect("snapshot index");
        let mut total: u64 = index.values().map(|s| s.bytes).sum();
        while index.len() > self.max_count || total > self.max_bytes {
            let Some((id, s)) = index.pop_first() else {
                break;
            };
            total -= s.bytes;
            let _ = std::fs::remove_file(self.dir.join(format!("{id}.json")));
            count("evicted");
        }
    }
}

fn count(result: &'static str) {
    telemetry::metrics::metrics()
        .snapshots
        .add(1, &[KeyValue::new(attr::RESULT, result)]);
}

/// sha256 of a file's bytes, as hex.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(count: usize, mb: u64) -> SnapshotArgs {
        SnapshotArgs {
            snapshots: true,
            snapshot_max_count: count,
            snapshot_max_mb: mb,
            snapshot_on_cancel: false,
        }
    }

    /// A snapshot whose file is about `tokens * 7` bytes.
    fn snapshot(id: String, tokens: usize) -> Snapshot {
        Snapshot {
            version: FORMAT_VERSION,
            id,
            created_unix_ms: 0,
            reason: "error".into(),
            message: None,
            request_id: None,
            trace_id: None,
            span_id: None,
            model: ModelFacts {
                id: "m".into(),
                weight_format: "F32".into(),
                device: "cpu".into(),
                kv_cache_dtype: None,
                file: "m.gguf".into(),
                weights_sha256: None,
                context_window: 8,
                n_layer: 1,
                n_kv_head: 1,
                head_dim: 2,
                embedding_length: 2,
            },
            prompt: PromptFacts {
                sha256: String::new(),
                tokens: vec![123_456; tokens],
                cached_tokens: 0,
            },
            sampling: SamplingFacts {
                sampling: Sampling::default(),
                max_tokens: 4,
                ignore_eos: false,
                stop: Vec::new(),
                end_at_paragraph: false,
                logprobs: None,
                context_tokens: Vec::new(),
            },
            generated: Vec::new(),
            decode_batch_sizes: Vec::new(),
            kv: None,
            timings: Timings::default(),
        }
    }

    /// Submits and waits until the writer has handled it (it runs jobs in order, so once a
    /// later job runs the snapshot is written).
    fn write(store: &SnapshotStore, s: Snapshot) {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        assert!(store.submit(Box::new(move || Some(s)), 0));
        assert!(store.submit(
            Box::new(move || {
                done_tx.send(()).unwrap();
                None
            }),
            0
        ));
        done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap();
    }

    #[test]
    fn the_oldest_are_evicted_beyond_the_count() {
        let tmp = tempfile::tempdir().unwrap();
        let store = SnapshotStore::open(&args(2, 64), tmp.path())
            .unwrap()
            .unwrap();
        let ids: Vec<String> = (0..3).map(|i| SnapshotStore::new_id(1000 + i)).collect();
        for id in &ids {
            write(&store, snapshot(id.clone(), 4));
        }
        let listed: Vec<String> = store.list().into_iter().map(|s| s.id).collect();
        assert_eq!(listed, ids[1..]);
        assert!(store.get(&ids[0]).is_none());
        assert!(!tmp
            .path()
            .join(format!("snapshots/{}.json", ids[0]))
            .exists());
        let back: Snapshot = serde_json::from_slice(&store.get(&ids[2]).unwrap()).unwrap();
        assert_eq!(back.prompt.tokens.len(), 4);
        // A reopened store finds what is on disk.
        drop(store);
        let again = SnapshotStore::open(&args(2, 64), tmp.path())
            .unwrap()
            .unwrap();
        assert_eq!(again.list().len(), 2);
    }

    #[test]
    fn the_oldest_are_evicted_beyond_the_bytes_and_an_oversized_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let store = SnapshotStore::open(&args(100, 1), tmp.path())
            .unwrap()
            .unwrap();
        // ~0.45 MiB each: two fit in 1 MiB, three do not.
        let big = 65_000;
        let ids: Vec<String> = (0..3).map(|i| SnapshotStore::new_id(2000 + i)).collect();
        for id in &ids {
            write(&store, snapshot(id.clone(), big));
        }
        let listed: Vec<String> = store.list().into_iter().map(|s| s.id).collect();
        assert_eq!(listed, ids[1..]);
        let total: u64 = store.list().iter().map(|s| s.bytes).sum();
        assert!(total <= 1 << 20, "{total}");
        write(&store, snapshot(SnapshotStore::new_id(3000), 4 * big));
        assert_eq!(
            store.list().len(),
            2,
            "a snapshot larger than the budget is not kept"
        );
    }

    #[test]
    fn a_full_queue_drops_instead_of_waiting() {
        let tmp = tempfile::tempdir().unwrap();
        let store = SnapshotStore::open(&args(4, 64), tmp.path())
            .unwrap()
            .unwrap();
        assert!(!store.submit(Box::new(|| None), QUEUE_BYTES + 1));
        // Hold the writer in its first job, then fill the queue.
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        assert!(store.submit(
            Box::new(move || {
                started_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                None
            }),
            0
        ));
        started_rx.recv().unwrap();
        let queued = (0..QUEUE + 2)
            .filter(|_| store.submit(Box::new(|| None), 0))
            .count();
        assert_eq!(queued, QUEUE);
        release_tx.send(()).unwrap();
    }

    #[test]
    fn ids_sort_by_creation() {
        let a = SnapshotStore::new_id(999);
        let b = SnapshotStore::new_id(1000);
        let c = SnapshotStore::new_id(1000);
        assert!(a < b && b < c, "{a} {b} {c}");
    }
}
