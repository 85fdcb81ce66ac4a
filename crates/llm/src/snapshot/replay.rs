//! A generation's failure snapshot, and its replay. When a phase of a generation fails (an
//! error, a caught panic, an injected fault, the deadline, or a client gone when asked for),
//! [`Watch::settle`] hands the request, the tokens so far, the decode batch sizes and the KV
//! cache itself to the [`SnapshotStore`](crate::snapshot::SnapshotStore), whose writer thread
//! digests the cache and writes the file: the failing request pays for building a small struct.
//!
//! [`replay`] re-runs a snapshot on a freshly loaded model, at batch size 1: the prompt's
//! prefill, then each generated token fed back, checking every position's KV digest and every
//! sampled token against the snapshot, and reports the first place they part.

use std::borrow::Cow;
use std::cell::RefCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{Device, Tensor};
use opentelemetry::trace::TraceId;
use opentelemetry::KeyValue;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use crate::kv_cache::KvCache;
use crate::llama::{Llama, WeightFormat};
use crate::sampler::{Logits, Sampler};
use crate::snapshot::{
    self as store, ModelFacts, PromptFacts, SamplingFacts, Snapshot, SnapshotStore, StageTiming,
    Timings,
};
use crate::weights::Gguf;
use crate::{FinishReason, GenerateError, GenerateRequest, Generated, KvDtype, MAX_TOP_LOGPROBS};
use telemetry::clock::{self, millis};
use telemetry::names::{attr, event, span};
use telemetry::span::Stage;

/// What a generation records as it runs for a snapshot it may need: each decode step's batch
/// size.
#[derive(Default)]
pub(crate) struct Trail {
    steps: RefCell<Vec<u32>>,
}

impl Trail {
    pub fn step(&self, batch: usize) {
        self.steps.borrow_mut().push(batch as u32);
    }
}

/// A phase's result, or the panic it raised.
pub(crate) type Caught<T> = std::thread::Result<Result<T, GenerateError>>;

/// Runs a phase, catching a panic so the snapshot can be taken before it resumes.
pub(crate) fn catch<T>(phase: impl FnOnce() -> Result<T, GenerateError>) -> Caught<T> {
    catch_unwind(AssertUnwindSafe(phase))
}

/// One generation, as far as its snapshot needs it.
pub(crate) struct Watch<'a> {
    pub llama: &'a Llama,
    pub req: &'a GenerateRequest<'a>,
    /// The `chat {model}` stage: it gets `rag.snapshot.id` and a `snapshot` event.
    pub stage: &'a Stage,
    pub trail: &'a Trail,
}

impl Watch<'_> {
    /// Passes a phase's result on (resuming its panic), first leaving a snapshot when it
    /// failed; `cache` is the request's KV cache, moved to the snapshot writer if one is taken.
    pub fn settle<T>(
        &self,
        out: &Generated,
        cache: Option<KvCache>,
        phase: Caught<T>,
    ) -> Result<T, GenerateError> {
        let failure = match &phase {
            Err(panic) => Some(("panic", Some(panic_message(panic.as_ref())))),
            Ok(Err(e @ GenerateError::Aborted)) => Some(("injected_error", Some(e.to_string()))),
            Ok(Err(e)) => Some(("error", Some(e.to_string()))),
            Ok(Ok(_)) => match out.finish {
                FinishReason::Timeout => Some(("timeout", None)),
                FinishReason::Cancelled => Some(("cancelled", None)),
                FinishReason::Stop | FinishReason::Length => None,
            },
        };
        if let Some((reason, message)) = failure {
            self.record(out, cache, reason, message);
        }
        match phase {
            Err(panic) => resume_unwind(panic),
            Ok(result) => result,
        }
    }

    fn record(
        &self,
        out: &Generated,
        cache: Option<KvCache>,
        reason: &'static str,
        message: Option<String>,
    ) {
        let Some(store) = self.llama.snapshots.as_ref() else {
            return;
        };
        if reason == "cancelled" && !store.on_cancel() {
            return;
        }
        let (llama, req) = (self.llama, self.req);
        let now_unix_ms = (clock::unix_nanos(clock::to_wall(clock::now())) / 1_000_000) as u64;
        let id = SnapshotStore::new_id(now_unix_ms);
        let trace_id = self.stage.trace_id();
        let mut snapshot = Snapshot {
            version: store::FORMAT_VERSION,
            id: id.clone(),
            created_unix_ms: now_unix_ms,
            reason: reason.to_string(),
            message,
            request_id: self.stage.inherited(attr::REQUEST_ID),
            trace_id: trace_id.clone(),
            span_id: self.stage.span_id(),
            model: model_facts(llama, None),
            prompt: PromptFacts {
                sha256: prompt_sha256(req.prompt),
                tokens: req.prompt.to_vec(),
                cached_tokens: out.cached_tokens,
            },
            sampling: SamplingFacts {
                sampling: req.sampling,
                max_tokens: req.max_tokens,
                ignore_eos: req.ignore_eos,
                stop: req.stop.to_vec(),
                end_at_paragraph: req.end_at_paragraph,
                logprobs: req.logprobs,
                context_tokens: req.context_tokens.to_vec(),
            },
            generated: out.tokens.clone(),
            decode_batch_sizes: self.trail.steps.borrow().clone(),
            kv: None,
            timings: Timings {
                stages: Vec::new(),
                prefill_ms: millis(out.prefill),
                chat_ms: millis(self.stage.elapsed()),
            },
        };
        let bytes = cache.as_ref().map_or(0, KvCache::bytes);
        let weights = (llama.gguf_path.clone(), llama.weights_sha256.clone());
        let job = move || {
            let (path, sha) = weights;
            snapshot.model.weights_sha256 =
                sha.get_or_init(|| store::file_sha256(&path).ok()).clone();
            if let Some(cache) = cache {
                match cache.digest() {
                    Ok(kv) => snapshot.kv = Some(kv),
                    Err(e) => tracing::warn!(error = %e, "snapshot without its KV digest"),
                }
            }
            snapshot.timings.stages = trace_timings(trace_id.as_deref());
            Some(snapshot)
        };
        if store.submit(Box::new(job), bytes) {
            self.stage.set(KeyValue::new(attr::SNAPSHOT_ID, id.clone()));
            self.stage.event(
                event::SNAPSHOT,
                vec![
                    KeyValue::new(attr::SNAPSHOT_ID, id),
                    KeyValue::new(attr::SNAPSHOT_REASON, reason),
                ],
            );
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// sha256 over the token ids, each as 4 little-endian bytes.
pub fn prompt_sha256(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    hex::encode(h.finalize())
}

/// The model as a snapshot names it.
fn model_facts(llama: &Llama, weights_sha256: Option<String>) -> ModelFacts {
    let net = &llama.transformer;
    ModelFacts {
        id: crate::llama::MODEL_ID.to_string(),
        weight_format: format!("{:?}", llama.format),
        device: if net.device.is_cpu() { "cpu" } else { "cuda" }.to_string(),
        kv_cache_dtype: net.host_kv().map(|d| d.name().to_string()),
        file: llama
            .gguf_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        weights_sha256,
        context_window: llama.context_window,
        n_layer: net.cfg.n_layer,
        n_kv_head: net.cfg.n_kv_head,
        head_dim: net.cfg.head_dim,
        embedding_length: net.cfg.n_head * net.cfg.head_dim,
    }
}

/// The finished spans of the trace so far (from the recent-trace buffer), by start.
fn trace_timings(trace_id: Option<&str>) -> Vec<StageTiming> {
    let (Some(id), Some(buffer)) = (
        trace_id.and_then(|t| TraceId::from_hex(t).ok()),
        telemetry::buffer::recent(),
    ) else {
        return Vec::new();
    };
    let spans = buffer.trace(id);
    let Some(first) = spans.iter().map(|s| s.start_time).min() else {
        return Vec::new();
    };
    let ms = |d: Result<std::time::Duration, _>| d.map(millis).unwrap_or(0.0);
    let mut out: Vec<StageTiming> = spans
        .iter()
        .map(|s| StageTiming {
            name: s.name.to_string(),
            start_ms: ms(s.start_time.duration_since(first)),
            duration_ms: ms(s.end_time.duration_since(s.start_time)),
        })
        .collect();
    out.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    out
}

/// A diagnostic change to one weight before a replay: `delta` added to element `index`
/// (row-major) of the GGUF tensor `tensor`.
#[derive(Debug, Clone, PartialEq)]
pub struct Perturbation {
    pub tensor: String,
    pub index: usize,
    pub delta: f32,
}

impl FromStr for Perturbation {
    type Err = String;

    /// `TENSOR:INDEX:DELTA`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.rsplitn(3, ':');
        let (Some(delta), Some(index), Some(tensor)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!(
                "--perturb-weight {s:?}: expected TENSOR:INDEX:DELTA"
            ));
        };
        Ok(Perturbation {
            tensor: tensor.to_string(),
            index: index
                .parse()
                .map_err(|e| format!("--perturb-weight {s:?}: INDEX: {e}"))?,
            delta: delta
                .parse()
                .map_err(|e| format!("--perturb-weight {s:?}: DELTA: {e}"))?,
        })
    }
}

impl Perturbation {
    /// Applies it to the tensors as read. In a quantised tensor the block holding the element
    /// is dequantised, changed and requantised (its other values may move by a rounding step).
    fn apply(&self, gguf: &mut Gguf) -> Result<(), GenerateError> {
        let err = |e: String| GenerateError::Load(format!("--perturb-weight {}: {e}", self.tensor));
        let t = gguf
            .tensor_mut(&self.tensor)
            .ok_or_else(|| err("no such tensor in the GGUF file".into()))?;
        let perturbed = (|| -> candle_core::Result<QTensor> {
            let (dtype, shape) = (t.dtype(), t.shape().clone());
            if self.index >= shape.elem_count() {
                candle_core::bail!("index {} of {} elements", self.index, shape.elem_count());
            }
            let (bs, ts) = (dtype.block_size(), dtype.type_size());
            let mut data = t.data()?.into_owned();
            let at = self.index / bs * ts;
            let cpu = Device::Cpu;
            let block = QStorage::from_data(Cow::Borrowed(&data[at..at + ts]), &cpu, dtype)?;
            let mut values = QTensor::new(block, (bs,))?
                .dequantize(&cpu)?
                .to_vec1::<f32>()?;
            values[self.index % bs] += self.delta;
            let again = QTensor::quantize(&Tensor::from_vec(values, (bs,), &cpu)?, dtype)?;
            data[at..at + ts].copy_from_slice(&again.data()?);
            QTensor::new(QStorage::from_data(Cow::Owned(data), &cpu, dtype)?, shape)
        })()
        .map_err(|e| err(e.to_string()))?;
        *t = perturbed;
        Ok(())
    }
}

/// Loads the model a snapshot was taken with, in its weight format and context window, on
/// the CPU, with `perturb` applied.
pub fn load_for_replay(
    gguf_path: &std::path::Path,
    tokenizer: Tokenizer,
    snapshot: &Snapshot,
    perturb: &[Perturbation],
) -> Result<Llama, GenerateError> {
    let name = &snapshot.model.weight_format;
    let format = WeightFormat::named(name)
        .ok_or_else(|| GenerateError::Load(format!("unknown weight format {name:?}")))?;
    let kv = match snapshot.model.kv_cache_dtype.as_deref() {
        None => KvDtype::F32,
        Some(name) => KvDtype::named(name)
            .ok_or_else(|| GenerateError::Load(format!("unknown KV cache dtype {name:?}")))?,
    };
    let llama = Llama::load_edited(
        gguf_path,
        tokenizer,
        &Device::Cpu,
        snapshot.model.context_window,
        (format, crate::llama::PrefillKernel::Detect),
        |gguf| perturb.iter().try_for_each(|p| p.apply(gguf)),
    )?;
    // A run on candle's tensors replays on the CPU decoder where the format has one: F32 both.
    if llama.kv_dtype().is_some() {
        return llama.with_kv_dtype(kv);
    }
    Ok(llama)
}

/// Where a replay first parted from its snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Divergence {
    /// The keys and values written at `position` differ, first in `layer`. `token_index`:
    /// the generated token fed at that position (`None`: a prompt position).
    Kv {
        position: usize,
        token_index: Option<usize>,
        layer: usize,
        expected: String,
        got: String,
    },
    /// Generated token `index` (at `position`) differs.
    Token {
        index: usize,
        position: usize,
        expected: u32,
        got: u32,
    },
    /// Every position's truncated digest matched, but a layer's whole digest did not.
    Layer {
        layer: usize,
        expected: String,
        got: String,
    },
}

/// A replay's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Replay {
    pub id: String,
    /// KV positions compared (prompt and fed-back tokens).
    pub positions_checked: usize,
    pub tokens_checked: usize,
    /// `None`: identical.
    pub divergence: Option<Divergence>,
    /// What differs between the run and the replay besides the computation itself.
    pub notes: Vec<String>,
}

/// Re-runs `snap` on `llama` and compares as it goes (see the module docs).
pub fn replay(llama: &Llama, snap: &Snapshot) -> Result<Replay, GenerateError> {
    let net = &llama.transformer;
    let cfg = &net.cfg;
    let facts = model_facts(llama, None);
    if (facts.n_layer, facts.n_kv_head, facts.head_dim)
        != (
            snap.model.n_layer,
            snap.model.n_kv_head,
            snap.model.head_dim,
        )
    {
        return Err(GenerateError::Load(format!(
            "the snapshot's model has {} layers × {} KV heads × {}; this one {} × {} × {}",
            snap.model.n_layer,
            snap.model.n_kv_head,
            snap.model.head_dim,
            facts.n_layer,
            facts.n_kv_head,
            facts.head_dim
        )));
    }
    let prompt = &snap.prompt.tokens;
    let n_prompt = prompt.len();
    if n_prompt == 0 || prompt_sha256(prompt) != snap.prompt.sha256 {
        return Err(GenerateError::Tokenizer(
            "the snapshot's prompt is empty or does not match its sha256".into(),
        ));
    }
    let mut report = Replay {
        id: snap.id.clone(),
        positions_checked: 0,
        tokens_checked: 0,
        divergence: None,
        notes: notes(snap),
    };
    let expected = snap.kv.as_ref();
    let checked = expected.map_or(0, |kv| kv.len.min(kv.positions.len()));
    let compare = |cache: &KvCache, pos: usize, token_index: Option<usize>, report: &mut Replay| {
        if pos >= checked {
            return Ok(None);
        }
        let want = &expected.expect("checked > 0").positions[pos];
        let got = cache.position_digests(pos, 1)?.remove(0);
        report.positions_checked += 1;
        Ok::<_, GenerateError>(first_layer(want, &got).map(|layer| Divergence::Kv {
            position: pos,
            token_index,
            layer,
            expected: want[layer * 8..][..8].to_string(),
            got: got[layer * 8..][..8].to_string(),
        }))
    };

    let host = net.host_kv();
    let capacity = n_prompt + snap.generated.len().max(1);
    let mut cache = KvCache::new(cfg, capacity, &net.device, host)?;
    // As the run did: positions a prefix-cache hit supplied were computed by an earlier
    // prefill of their own, the rest from there on. A whole prompt found in the cache (its
    // end and last logits too) was computed by one earlier prefill of that very prompt, so it
    // is one prefill here: recomputing its last position alone would be another computation
    // (a one-row matrix product), which on the F32 path need not give the same bits.
    let cached = match snap.prompt.cached_tokens {
        c if c >= n_prompt => 0,
        c => c,
    };
    if cached > 0 {
        net.prefill(&prompt[..cached], &mut cache, &llama.schedule)?;
    }
    let mut logits = Logits::Device(net.prefill(&prompt[cached..], &mut cache, &llama.schedule)?);
    for pos in 0..n_prompt {
        if let Some(d) = compare(&cache, pos, None, &mut report)? {
            report.divergence = Some(d);
            return Ok(report);
        }
    }

    let s = &snap.sampling;
    let ban: &[u32] = if s.ignore_eos { &llama.eos } else { &[] };
    let mut sampler = Sampler::for_request(&s.sampling, prompt, &s.context_tokens, ban);
    let top = s.logprobs.map(|k| k.min(MAX_TOP_LOGPROBS));
    let stage = Stage::root(span::REPLAY);
    let mut session = llama.schedule.session(&stage);
    for (i, &want) in snap.generated.iter().enumerate() {
        if i > 0 {
            let fed = snap.generated[i - 1];
            net.decode_one(
                session.as_mut(),
                &mut cache,
                fed,
                &mut logits,
                &llama.schedule,
            )?;
            if let Some(d) = compare(&cache, n_prompt + i - 1, Some(i - 1), &mut report)? {
                report.divergence = Some(d);
                return Ok(report);
            }
        }
        let got = sampler.pick(&logits, top)?.token;
        report.tokens_checked += 1;
        if got != want {
            report.divergence = Some(Divergence::Token {
                index: i,
                position: n_prompt + i,
                expected: want,
                got,
            });
            return Ok(report);
        }
    }
    drop(session);
    if let Some(kv) = expected.filter(|kv| kv.len == cache.len) {
        let whole = cache.digest()?;
        let differs = kv
            .layers
            .iter()
            .zip(&whole.layers)
            .position(|(a, b)| a != b);
        if let Some(layer) = differs {
            report.divergence = Some(Divergence::Layer {
                layer,
                expected: kv.layers[layer].clone(),
                got: whole.layers[layer].clone(),
            });
        }
    }
    Ok(report)
}

/// The first layer whose 8-digit digest differs between two position digests.
fn first_layer(want: &str, got: &str) -> Option<usize> {
    let (a, b) = (want.as_bytes(), got.as_bytes());
    (0..a.len().max(b.len()).div_ceil(8))
        .find(|&l| a.get(l * 8..l * 8 + 8) != b.get(l * 8..l * 8 + 8))
}

/// How the replay's conditions differ from the run's.
fn notes(snap: &Snapshot) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(max) = snap.decode_batch_sizes.iter().max().filter(|&&m| m > 1) {
        notes.push(format!(
            "the run batched decode steps with up to {max} sequences; the replay runs each alone"
        ));
    }
    if snap.prompt.cached_tokens > 0 {
        notes.push(format!(
            "the run took prompt positions 0..{} from the prefix cache; the replay computes them",
            snap.prompt.cached_tokens
        ));
    }
    if snap.model.device != "cpu" {
        notes.push(format!(
            "the run was on {}; the replay is on the CPU",
            snap.model.device
        ));
    }
    if snap.kv.is_none() {
        notes.push("the run failed before its KV cache existed: tokens only".into());
    }
    notes
}

/// The sha256 of the model file, computed once per model (on the snapshot writer thread).
pub(crate) type WeightsDigest = Arc<OnceLock<Option<String>>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{model, request, stage, zorbia_prompt};
    use crate::{Flow, Generator, Sampling};

    /// A model of its own with a snapshot store (the shared test model writes none).
    fn with_store(context: usize) -> (Llama, Arc<SnapshotStore>, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let args = crate::snapshot::SnapshotArgs {
            snapshots: true,
            snapshot_max_count: 8,
            snapshot_max_mb: 64,
            snapshot_on_cancel: false,
        };
        let store = SnapshotStore::open(&args, tmp.path()).unwrap().unwrap();
        let path = crate::testing::model_path().expect("the model file");
        let llama = Llama::from_gguf(&path, &Device::Cpu, context)
            .unwrap()
            .with_snapshots(Some(store.clone()));
        (llama, store, tmp)
    }

    /// The `n`th snapshot written, once it is (bounded wait).
    fn nth(store: &SnapshotStore, n: usize) -> Snapshot {
        for _ in 0..500 {
            if let Some(s) = store.list().get(n) {
                return serde_json::from_slice(&store.get(&s.id).unwrap()).unwrap();
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("snapshot {n} never written");
    }

    /// A consumer that answers `fail` at its `at`th piece, or panics there when `None`.
    fn failing_at(at: usize, fail: Option<Flow>) -> impl FnMut(crate::Piece<'_>) -> Flow {
        let mut pieces = 0;
        move |_| {
            pieces += 1;
            match (pieces >= at, fail) {
                (false, _) => Flow::Continue,
                (true, Some(flow)) => flow,
                (true, None) => panic!("a step that panics"),
            }
        }
    }

    #[test]
    fn failures_replay_identically_and_a_perturbed_embedding_row_is_found() {
        let Some(model) = model() else { return };
        let (llama, store, _tmp) = with_store(model.context_window);
        let prompt = zorbia_prompt(model);
        let sampling = Sampling {
            temperature: 0.8,
            seed: 11,
            ..Sampling::default()
        };
        let err = llama
            .generate(
                request(&prompt, 12, sampling),
                &stage(),
                &mut failing_at(6, Some(Flow::Fail)),
            )
            .unwrap_err();
        assert!(matches!(err, GenerateError::Aborted), "{err:?}");
        let snap = nth(&store, 0);
        assert_eq!(snap.reason, "injected_error");
        assert!(snap.generated.len() >= 6, "{:?}", snap.generated);
        let kv = snap.kv.as_ref().expect("a KV digest");
        assert_eq!(kv.len, prompt.len() + snap.generated.len() - 1);
        assert_eq!(kv.positions.len(), kv.len);
        assert_eq!(kv.layers.len(), model.transformer.cfg.n_layer);
        assert!(kv.positions.iter().all(|p| p.len() == 8 * kv.layers.len()));
        // Replayed on another instance of the model.
        let again = replay(model, &snap).unwrap();
        assert_eq!(again.divergence, None, "{again:?}");
        assert_eq!(again.positions_checked, kv.len);
        assert_eq!(again.tokens_checked, snap.generated.len());

        // A panic in a step: snapshotted, then passed on.
        let panicked = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut consumer = failing_at(4, None);
            let _ = llama.generate(request(&prompt, 12, sampling), &stage(), &mut consumer);
        }));
        assert!(panicked.is_err());
        let snap_panic = nth(&store, 1);
        assert_eq!(snap_panic.reason, "panic");
        assert_eq!(snap_panic.message.as_deref(), Some("a step that panics"));
        assert_eq!(replay(model, &snap_panic).unwrap().divergence, None);

        // One embedding row changed: every position before that token's first use agrees.
        let token = prompt[20];
        let first = prompt.iter().position(|&t| t == token).unwrap();
        let perturb = [Perturbation {
            tensor: "token_embd.weight".into(),
            index: token as usize * snap.model.embedding_length + 3,
            delta: 0.5,
        }];
        let path = crate::testing::model_path().expect("the model file");
        let tokenizer = crate::tokenizer::from_gguf_file(&path).unwrap();
        let perturbed = load_for_replay(&path, tokenizer, &snap, &perturb).unwrap();
        match replay(&perturbed, &snap).unwrap().divergence {
            Some(Divergence::Kv {
                position,
                token_index: None,
                layer: 0,
                ..
            }) => assert_eq!(position, first),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn perturbations_parse_and_name_their_parts() {
        let p: Perturbation = "blk.3.attn_k.weight:100:-0.25".parse().unwrap();
        assert_eq!(
            p,
            Perturbation {
                tensor: "blk.3.attn_k.weight".into(),
                index: 100,
                delta: -0.25
            }
        );
        assert!("blk.3.attn_k.weight:x:1"
            .parse::<Perturbation>()
            .unwrap_err()
            .contains("INDEX"));
        assert!("nothing".parse::<Perturbation>().is_err());
        assert_eq!(first_layer("aaaaaaaabbbbbbbb", "aaaaaaaabbbbbbbc"), Some(1));
        assert_eq!(first_layer("aaaaaaaa", "aaaaaaaa"), None);
    }
}
