//! BERT sentence embedder (all-MiniLM-L6-v2): truncate at 256 tokens, mean-pool over real
//! tokens, L2-normalise.
//!
//! On the CPU the forward is [`super::cpu_bert`]'s: no padding (a batch's tokens packed into one
//! matrix), BF16 matrix multiplies where the CPU has AVX-512 BF16. Elsewhere it is candle's
//! `BertModel`, padded to the longest input of a batch. Either way inputs are sorted by length
//! and cut into sub-batches, so a long passage does not make every short one in its batch pay
//! for its padding (or, unpadded, for its attention working set).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use opentelemetry::KeyValue;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use super::cpu_bert::{self, CpuBert};
use super::{EmbedError, Embedder};
use llm::kernels::Precision;
use telemetry::gpu::GpuTimer;
use telemetry::names::{attr, span};
use telemetry::span::Stage;

/// The model's `max_seq_length` in sentence-transformers; the shipped tokenizer.json says 128.
pub const MAX_TOKENS: usize = 256;
/// Inputs per forward pass.
const SUB_BATCH: usize = 32;

pub struct BertEmbedder {
    forward: Forward,
    tokenizer: Tokenizer,
    /// The same tokenizer without truncation or padding, for counting real lengths.
    counter: Tokenizer,
    device: Device,
    model_id: String,
    dimension: usize,
}

/// Which forward pass an embedder runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Candle's `BertModel` in F32 on the embedder's device, padded batches.
    Candle,
    /// [`CpuBert`] with linear layers in this precision (CPU only).
    Cpu(Precision),
}

enum Forward {
    Candle(BertModel),
    Cpu(CpuBert),
}

/// Loads `config.json` and `tokenizer.json` from `dir`; the tokenizer truncates at
/// [`MAX_TOKENS`] and pads to the longest input of a batch.
pub(super) fn load_config_and_tokenizer(dir: &Path) -> Result<(Config, Tokenizer), EmbedError> {
    let config: Config = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|e| EmbedError::Load(format!("{}: {e}", dir.join("config.json").display())))
        .and_then(|s| serde_json::from_str(&s).map_err(|e| EmbedError::Load(e.to_string())))?;
    let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| EmbedError::Load(format!("tokenizer.json: {e}")))?;
    tokenizer.with_padding(Some(PaddingParams {
        strategy: PaddingStrategy::BatchLongest,
        ..Default::default()
    }));
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: MAX_TOKENS,
            ..Default::default()
        }))
        .map_err(|e| EmbedError::Load(e.to_string()))?;
    Ok((config, tokenizer))
}

/// `model.safetensors` in `dir`, mapped, as F32 on `device`.
pub(super) fn weights(dir: &Path, device: &Device) -> Result<VarBuilder<'static>, EmbedError> {
    // F32 on the GPU too: candle's BERT builds its attention mask as `(1 - mask) * f32::MIN` in
    // the model dtype, which is -inf in F16/BF16 and turns every kept position into NaN.
    // SAFETY: the weights file is not modified while mapped (it is verified and read-only).
    Ok(unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, device)?
    })
}

/// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir` as candle's model.
pub fn load_bert(
    dir: &Path,
    device: &Device,
) -> Result<(BertModel, Tokenizer, Config), EmbedError> {
    let (config, tokenizer) = load_config_and_tokenizer(dir)?;
    let model = BertModel::load(weights(dir, device)?, &config)?;
    Ok((model, tokenizer, config))
}

impl BertEmbedder {
    /// On the CPU the [`Backend::Cpu`] forward in the best precision the CPU has (if it
    /// supports the model's config), else candle's.
    pub fn load(dir: &Path, model_id: &str, device: &Device) -> Result<Self, EmbedError> {
        Self::load_inner(dir, model_id, device, None)
    }

    /// With the forward pass chosen by the caller (the tests and the A/B benchmark).
    pub fn load_with(
        dir: &Path,
        model_id: &str,
        device: &Device,
        backend: Backend,
    ) -> Result<Self, EmbedError> {
        Self::load_inner(dir, model_id, device, Some(backend))
    }

    fn load_inner(
        dir: &Path,
        model_id: &str,
        device: &Device,
        backend: Option<Backend>,
    ) -> Result<Self, EmbedError> {
        let (config, tokenizer) = load_config_and_tokenizer(dir)?;
        let backend = backend.unwrap_or_else(|| match cpu_bert::supports(&config) {
            Ok(()) if device.is_cpu() => Backend::Cpu(Precision::best()),
            Ok(()) => Backend::Candle,
            Err(why) => {
                tracing::info!("embedder {model_id}: candle's forward, {why}");
                Backend::Candle
            }
        });
        let vb = weights(dir, device)?;
        let forward = match backend {
            Backend::Candle => Forward::Candle(BertModel::load(vb, &config)?),
            Backend::Cpu(precision) => {
                if !device.is_cpu() {
                    return Err(EmbedError::Load(
                        "the CPU forward needs the weights on the CPU".into(),
                    ));
                }
                let threads = candle_core::utils::get_num_threads();
                Forward::Cpu(CpuBert::load(&vb, &config, precision, threads)?)
            }
        };
        let mut counter = tokenizer.clone();
        counter.with_padding(None);
        counter
            .with_truncation(None)
            .map_err(|e| EmbedError::Load(e.to_string()))?;
        Ok(BertEmbedder {
            forward,
            tokenizer,
            counter,
            device: device.clone(),
            model_id: model_id.to_string(),
            dimension: config.hidden_size,
        })
    }

    /// The forward pass this embedder runs.
    pub fn backend(&self) -> Backend {
        match &self.forward {
            Forward::Candle(_) => Backend::Candle,
            Forward::Cpu(model) => Backend::Cpu(model.precision()),
        }
    }

    /// One forward pass. `rag.batch.padded_tokens` is the tokens the forward computes: the
    /// padded batch (inputs × longest) for candle, the real tokens for the unpadded CPU forward.
    fn embed_batch(&self, texts: &[&str], stage: &Stage) -> Result<Vec<Vec<f32>>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let tokenize = stage.child(span::TOKENIZE);
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        tokenize.set(KeyValue::new(attr::BATCH_SIZE, encodings.len() as i64));
        match &self.forward {
            Forward::Candle(model) => {
                let (ids, mask) = batch_tensors(&encodings, &self.device)?;
                let (batch, seq) = ids.dims2()?;
                tokenize.set(KeyValue::new(
                    attr::BATCH_PADDED_TOKENS,
                    (batch * seq) as i64,
                ));
                tokenize.end();

                let forward = stage.child(span::FORWARD);
                let gpu = GpuTimer::start(&self.device);
                let hidden = model.forward(&ids, &ids.zeros_like()?, Some(&mask))?;
                let pooled = mean_pool_normalised(&hidden, &mask)?;
                gpu.finish_into(&forward, "embed");
                let vectors = pooled.to_vec2::<f32>()?;
                forward.end();
                Ok(vectors)
            }
            Forward::Cpu(model) => {
                // Padding is on the right: an input's real tokens are the prefix its mask keeps.
                let sequences: Vec<&[u32]> = encodings
                    .iter()
                    .map(|e| {
                        let real = e.get_attention_mask().iter().filter(|&&m| m == 1).count();
                        &e.get_ids()[..real]
                    })
                    .collect();
                let tokens: usize = sequences.iter().map(|s| s.len()).sum();
                tokenize.set(KeyValue::new(attr::BATCH_PADDED_TOKENS, tokens as i64));
                tokenize.end();

                let forward = stage.child(span::FORWARD);
                let vectors = model.embed(&sequences)?;
                forward.end();
                Ok(vectors)
            }
        }
    }
}

/// Token ids and attention mask of a padded batch as `[batch, seq]` u32 tensors.
pub fn batch_tensors(
    encodings: &[tokenizers::Encoding],
    device: &Device,
) -> Result<(Tensor, Tensor), EmbedError> {
    let seq = encodings.first().map_or(0, |e| e.get_ids().len());
    let ids: Vec<u32> = encodings
        .iter()
        .flat_map(|e| e.get_ids().to_vec())
        .collect();
    let mask: Vec<u32> = encodings
        .iter()
        .flat_map(|e| e.get_attention_mask().to_vec())
        .collect();
    let n = encodings.len();
    Ok((
        Tensor::from_vec(ids, (n, seq), device)?,
        Tensor::from_vec(mask, (n, seq), device)?,
    ))
}

/// Mean over the tokens the mask keeps, then L2 normalisation: `[b, s, h] -> [b, h]`.
fn mean_pool_normalised(hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
    let counts = mask.sum(1)?.clamp(1e-9, f64::MAX)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
    mean.broadcast_div(&norm)
}

impl Embedder for BertEmbedder {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dimension(&self) -> usize {
        self.dimension
    }

    fn max_tokens(&self) -> usize {
        MAX_TOKENS
    }

    fn count_tokens(&self, text: &str) -> Result<usize, EmbedError> {
        let enc = self
            .counter
            .encode_fast(text, false)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().len())
    }

    fn embed(&self, texts: &[&str], stage: &Stage) -> Result<Vec<Vec<f32>>, EmbedError> {
        stage.set(KeyValue::new(
            attr::GEN_AI_EMBEDDINGS_DIMENSION_COUNT,
            self.dimension as i64,
        ));
        stage.set(KeyValue::new(attr::INPUTS, texts.len() as i64));
        if texts.len() <= 1 {
            return self.embed_batch(texts, stage);
        }
        // Sort by length (characters approximate tokens well enough) so each sub-batch pads
        // to a similar length; put results back in the caller's order.
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| texts[i].len());
        let mut out = vec![Vec::new(); texts.len()];
        for group in order.chunks(SUB_BATCH) {
            let batch: Vec<&str> = group.iter().map(|&i| texts[i]).collect();
            for (&i, v) in group.iter().zip(self.embed_batch(&batch, stage)?) {
                out[i] = v;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use telemetry::span::Stage;

    fn embedder() -> Option<BertEmbedder> {
        let dir = llm::testing::model_dir("all-MiniLM-L6-v2")?;
        Some(BertEmbedder::load(&dir, "all-MiniLM-L6-v2", &Device::Cpu).unwrap())
    }

    fn stage() -> Stage {
        Stage::root("test")
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn batched_equals_one_by_one_and_vectors_are_unit_length() {
        let Some(e) = embedder() else { return };
        let texts = [
            "How do I undo the last commit?",
            "git stash saves your local modifications away and reverts the working directory to match the HEAD commit, so you can switch branches.",
            "Rebase",
        ];
        let batched = e.embed(&texts, &stage()).unwrap();
        for (t, b) in texts.iter().zip(&batched) {
            let single = &e.embed(&[t], &stage()).unwrap()[0];
            assert_eq!(single.len(), 384);
            for (x, y) in single.iter().zip(b) {
                assert!((x - y).abs() < 1e-5, "{t}: {x} vs {y}");
            }
            assert!((dot(b, b) - 1.0).abs() < 1e-4);
        }
    }

    #[test]
    fn paraphrases_score_above_unrelated_pairs() {
        let Some(e) = embedder() else { return };
        let v = e
            .embed(
                &[
                    "How can I delete a branch?",
                    "What is the command to remove a git branch?",
                    "The recipe needs two cups of flour and an egg.",
                ],
                &stage(),
            )
            .unwrap();
        let para = dot(&v[0], &v[1]);
        let unrelated = dot(&v[0], &v[2]);
        assert!(
            para > unrelated + 0.3,
            "paraphrase {para}, unrelated {unrelated}"
        );
    }

    #[test]
    fn long_inputs_are_truncated_not_rejected() {
        let Some(e) = embedder() else { return };
        let long = "word ".repeat(2000);
        assert!(e.count_tokens(&long).unwrap() > MAX_TOKENS);
        let v = e.embed(&[&long], &stage()).unwrap();
        assert!((dot(&v[0], &v[0]) - 1.0).abs() < 1e-4);
    }

    fn cosine(a: &[f32], b: &[f32]) -> f32 {
        dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
    }

    /// What the embedder meets: one word, queries, corpus-like sentences and passages, code,
    /// non-ASCII text, and a passage past the 256-token truncation.
    fn varied_inputs() -> Vec<String> {
        let mut texts: Vec<String> = [
            "Rebase",
            "How do I undo the last commit?",
            "What is the difference between git merge and git rebase when both branches have diverged?",
            "git stash saves your local modifications away and reverts the working directory to match the HEAD commit, so you can switch branches.",
            "`git log --oneline --graph --decorate --all` prints the history as a graph.",
            "Übersetzungen: l'historique des révisions — 版本历史 — is kept per repository.",
            "",
        ]
        .map(String::from)
        .to_vec();
        let passage = "A branch in Git is simply a lightweight movable pointer to one of these \
                       commits. The default branch name in Git is master. As you start making \
                       commits, you're given a master branch that points to the last commit you made. ";
        texts.push(passage.repeat(2));
        texts.push(passage.repeat(12));
        texts
    }

    #[test]
    fn cpu_forward_matches_the_candle_reference() {
        let Some(dir) = llm::testing::model_dir("all-MiniLM-L6-v2") else {
            return;
        };
        let reference =
            BertEmbedder::load_with(&dir, "all-MiniLM-L6-v2", &Device::Cpu, Backend::Candle)
                .unwrap();
        let texts = varied_inputs();
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        assert!(reference.count_tokens(texts.last().unwrap()).unwrap() > MAX_TOKENS);
        let want = reference.embed(&texts, &stage()).unwrap();
        let want_single = reference.embed(&texts[1..2], &stage()).unwrap();

        let mut precisions = vec![(Precision::F32, 0.99999)];
        if Precision::best() == Precision::Bf16 {
            precisions.push((Precision::Bf16, 0.999));
        }
        for (precision, floor) in precisions {
            let backend = Backend::Cpu(precision);
            let e =
                BertEmbedder::load_with(&dir, "all-MiniLM-L6-v2", &Device::Cpu, backend).unwrap();
            assert_eq!(e.backend(), backend);
            let got = e.embed(&texts, &stage()).unwrap();
            let got_single = e.embed(&texts[1..2], &stage()).unwrap();
            let mut worst = f32::INFINITY;
            for ((t, g), w) in texts
                .iter()
                .chain(&texts[1..2])
                .zip(got.iter().chain(&got_single))
                .zip(want.iter().chain(&want_single))
            {
                assert_eq!(g.len(), 384);
                assert!(
                    (dot(g, g) - 1.0).abs() < 1e-4,
                    "{precision:?} {t:?}: not unit length"
                );
                let c = cosine(g, w);
                assert!(
                    c >= floor,
                    "{precision:?} {t:?}: cosine {c} to the reference"
                );
                worst = worst.min(c);
            }
            eprintln!(
                "{precision:?}: lowest cosine to candle's F32 BertModel {worst:.6} (1 - cos {:.1e})",
                1.0 - worst
            );
        }
    }
}
