//! BERT sentence embedder (all-MiniLM-L6-v2) on candle: pad to the longest input of a batch,
//! truncate at 256 tokens, mean-pool over real tokens, L2-normalise.
//!
//! Inputs are sorted by length and cut into sub-batches, so a long passage does not make every
//! short one in its batch pay for its padding.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use opentelemetry::KeyValue;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use super::{EmbedError, Embedder};
use crate::telemetry::gpu::GpuTimer;
use crate::telemetry::span::Stage;

/// The model's `max_seq_length` in sentence-transformers; the shipped tokenizer.json says 128.
pub const MAX_TOKENS: usize = 256;
/// Inputs per forward pass.
const SUB_BATCH: usize = 32;

pub struct BertEmbedder {
    model: BertModel,
    tokenizer: Tokenizer,
    /// The same tokenizer without truncation or padding, for counting real lengths.
    counter: Tokenizer,
    device: Device,
    model_id: String,
    dimension: usize,
}

/// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir`.
pub fn load_bert(
    dir: &Path,
    device: &Device,
) -> Result<(BertModel, Tokenizer, Config), EmbedError> {
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
    let weights = dir.join("model.safetensors");
    // F32 on the GPU too: candle's BERT builds its attention mask as `(1 - mask) * f32::MIN` in
    // the model dtype, which is -inf in F16/BF16 and turns every kept position into NaN.
    // SAFETY: the weights file is not modified while mapped (it is verified and read-only).
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], DType::F32, device)? };
    let model = BertModel::load(vb, &config)?;
    Ok((model, tokenizer, config))
}

impl BertEmbedder {
    pub fn load(dir: &Path, model_id: &str, device: &Device) -> Result<Self, EmbedError> {
        let (model, tokenizer, config) = load_bert(dir, device)?;
        let mut counter = tokenizer.clone();
        counter.with_padding(None);
        counter
            .with_truncation(None)
            .map_err(|e| EmbedError::Load(e.to_string()))?;
        Ok(BertEmbedder {
            model,
            tokenizer,
            counter,
            device: device.clone(),
            model_id: model_id.to_string(),
            dimension: config.hidden_size,
        })
    }

    fn embed_batch(&self, texts: &[&str], stage: &Stage) -> Result<Vec<Vec<f32>>, EmbedError> {
        let tokenize = stage.child("tokenize");
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        let (ids, mask) = batch_tensors(&encodings, &self.device)?;
        let (batch, seq) = ids.dims2()?;
        tokenize.set(KeyValue::new("rag.batch.size", batch as i64));
        tokenize.set(KeyValue::new(
            "rag.batch.padded_tokens",
            (batch * seq) as i64,
        ));
        tokenize.end();

        let forward = stage.child("forward");
        let gpu = GpuTimer::start(&self.device);
        let hidden = self.model.forward(&ids, &ids.zeros_like()?, Some(&mask))?;
        let pooled = mean_pool_normalised(&hidden, &mask)?;
        gpu.finish_into(&forward, "embed");
        let vectors = pooled.to_vec2::<f32>()?;
        forward.end();
        Ok(vectors)
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
            "gen_ai.embeddings.dimension.count",
            self.dimension as i64,
        ));
        stage.set(KeyValue::new("rag.inputs", texts.len() as i64));
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
    use crate::telemetry::span::Stage;

    fn embedder() -> BertEmbedder {
        let dir = crate::models::test_model_dir("all-MiniLM-L6-v2");
        BertEmbedder::load(&dir, "all-MiniLM-L6-v2", &Device::Cpu).unwrap()
    }

    fn stage() -> Stage {
        Stage::root("test")
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn batched_equals_one_by_one_and_vectors_are_unit_length() {
        let e = embedder();
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
        let e = embedder();
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
        let e = embedder();
        let long = "word ".repeat(2000);
        assert!(e.count_tokens(&long).unwrap() > MAX_TOKENS);
        let v = e.embed(&[&long], &stage()).unwrap();
        assert!((dot(&v[0], &v[0]) - 1.0).abs() < 1e-4);
    }
}
