//! A BERT cross-encoder reranker: `[CLS] query [SEP] passage [SEP]` through the encoder, the
//! pooled `[CLS]` vector through a classification head, one relevance logit per pair.
//!
//! Loads the layout of Hugging Face `BertForSequenceClassification` checkpoints
//! (`bert.pooler.dense`, `classifier`), e.g. `cross-encoder/ms-marco-MiniLM-L-6-v2`, from a
//! local directory or, where a hub is reachable, a hub id.

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use candle_transformers::models::bert::{BertModel, Config};
use opentelemetry::KeyValue;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use super::{Candidate, RerankError, Reranker};
use telemetry::gpu::GpuTimer;
use telemetry::names::{attr, span};
use telemetry::span::Stage;

/// Pairs per forward pass.
const SUB_BATCH: usize = 16;

pub struct CrossEncoder {
    bert: BertModel,
    pooler: Linear,
    classifier: Linear,
    tokenizer: Tokenizer,
    device: Device,
    model_id: String,
}

impl CrossEncoder {
    /// Files a cross-encoder directory (or hub repository) must hold.
    pub const FILES: [&'static str; 3] = ["config.json", "tokenizer.json", "model.safetensors"];

    pub fn load(dir: &Path, model_id: &str, device: &Device) -> Result<Self, RerankError> {
        let config: Config = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| RerankError::Load(format!("config.json: {e}")))
            .and_then(|s| serde_json::from_str(&s).map_err(|e| RerankError::Load(e.to_string())))?;
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| RerankError::Load(format!("tokenizer.json: {e}")))?;
        // SAFETY: the weights file is not modified while mapped.
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(
                &[dir.join("model.safetensors")],
                DType::F32,
                device,
            )?
        };
        let bert = BertModel::load(vb.clone(), &config)?;
        let head = |name: &str, out: usize| -> Result<Linear, RerankError> {
            let vb = if vb.contains_tensor(&format!("bert.{name}.weight")) {
                vb.pp(format!("bert.{name}"))
            } else {
                vb.pp(name)
            };
            Ok(candle_nn::linear(config.hidden_size, out, vb)?)
        };
        let pooler = head("pooler.dense", config.hidden_size)?;
        let classifier = head("classifier", 1)?;
        Self::from_parts(bert, pooler, classifier, tokenizer, device, model_id)
    }

    /// Assembles a cross-encoder from a loaded backbone and head.
    pub fn from_parts(
        bert: BertModel,
        pooler: Linear,
        classifier: Linear,
        mut tokenizer: Tokenizer,
        device: &Device,
        model_id: &str,
    ) -> Result<Self, RerankError> {
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..Default::default()
        }));
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: 512,
                ..Default::default()
            }))
            .map_err(|e| RerankError::Tokenizer(e.to_string()))?;
        Ok(CrossEncoder {
            bert,
            pooler,
            classifier,
            tokenizer,
            device: device.clone(),
            model_id: model_id.to_string(),
        })
    }

    fn score_batch(
        &self,
        query: &str,
        passages: &[&str],
        host: &Stage,
    ) -> Result<Vec<f32>, RerankError> {
        let pairs: Vec<(String, String)> = passages
            .iter()
            .map(|p| (query.to_string(), p.to_string()))
            .collect();
        let encodings = self
            .tokenizer
            .encode_batch(pairs, true)
            .map_err(|e| RerankError::Tokenizer(e.to_string()))?;
        let n = encodings.len();
        let seq = encodings.first().map_or(0, |e| e.get_ids().len());
        let flat = |f: fn(&tokenizers::Encoding) -> &[u32]| -> Vec<u32> {
            encodings.iter().flat_map(|e| f(e).to_vec()).collect()
        };
        let ids = Tensor::from_vec(flat(|e| e.get_ids()), (n, seq), &self.device)?;
        let types = Tensor::from_vec(flat(|e| e.get_type_ids()), (n, seq), &self.device)?;
        let mask = Tensor::from_vec(flat(|e| e.get_attention_mask()), (n, seq), &self.device)?;
        let gpu = GpuTimer::start(&self.device);
        let hidden = self.bert.forward(&ids, &types, Some(&mask))?;
        let cls = hidden.i((.., 0))?;
        let pooled = self.pooler.forward(&cls)?.tanh()?;
        let logits = self.classifier.forward(&pooled)?.squeeze(1)?;
        gpu.finish_into(host, "rerank");
        Ok(logits.to_vec1::<f32>()?)
    }
}

impl Reranker for CrossEncoder {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn score(
        &self,
        query: &str,
        candidates: &[Candidate<'_>],
        stage: &Stage,
    ) -> Result<Vec<f32>, RerankError> {
        let forward = stage.child(span::FORWARD);
        forward.set(KeyValue::new(attr::BATCH_SIZE, candidates.len() as i64));
        let texts: Vec<&str> = candidates.iter().map(|c| c.text).collect();
        let mut scores = Vec::with_capacity(texts.len());
        for group in texts.chunks(SUB_BATCH) {
            scores.extend(self.score_batch(query, group, &forward)?);
        }
        forward.end();
        Ok(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MiniLM backbone with a head built here: weights drawn from a fixed seed, written to a
    /// checkpoint directory in the Hugging Face layout and loaded back through `load`.
    fn encoder_with_head(sign: f32) -> Option<(CrossEncoder, tempfile::TempDir)> {
        let src = llm::testing::model_dir("all-MiniLM-L6-v2")?;
        let dir = tempfile::tempdir().unwrap();
        for f in ["config.json", "tokenizer.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        let dev = Device::Cpu;
        let mut tensors =
            candle_core::safetensors::load(src.join("model.safetensors"), &dev).unwrap();
        let h = 384;
        let eye = Tensor::eye(h, DType::F32, &dev).unwrap();
        tensors.insert("bert.pooler.dense.weight".into(), eye);
        tensors.insert(
            "bert.pooler.dense.bias".into(),
            Tensor::zeros(h, DType::F32, &dev).unwrap(),
        );
        // The classifier reads the first pooled dimensions, scaled by `sign`.
        let w: Vec<f32> = (0..h).map(|i| if i < 32 { sign } else { 0.0 }).collect();
        tensors.insert(
            "classifier.weight".into(),
            Tensor::from_vec(w, (1, h), &dev).unwrap(),
        );
        tensors.insert(
            "classifier.bias".into(),
            Tensor::zeros(1, DType::F32, &dev).unwrap(),
        );
        candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
        let ce = CrossEncoder::load(dir.path(), "test-ce", &dev).unwrap();
        Some((ce, dir))
    }

    #[test]
    fn loads_a_checkpoint_and_scores_pairs_consistently() {
        let Some((ce, _dir)) = encoder_with_head(1.0) else {
            return;
        };
        let stage = Stage::root("t");
        let passages = [
            "git stash pop restores the most recent stash",
            "a recipe for bread",
            "git clone --depth 1 makes a shallow clone",
        ];
        let c: Vec<Candidate> = passages
            .iter()
            .map(|t| Candidate {
                text: t,
                retrieval_score: 0.0,
            })
            .collect();
        let batch = ce.score("how do I restore a stash?", &c, &stage).unwrap();
        assert_eq!(batch.len(), 3);
        for (i, cand) in c.iter().enumerate() {
            let single = ce
                .score("how do I restore a stash?", &[*cand], &stage)
                .unwrap()[0];
            assert!((single - batch[i]).abs() < 1e-4, "{single} vs {}", batch[i]);
        }
        assert!(batch.iter().all(|s| s.is_finite()));
        assert!(
            batch.iter().any(|s| (s - batch[0]).abs() > 1e-3),
            "head must separate pairs"
        );

        // Negating the head reverses the order: the scores really come from the head.
        let (neg, _dir2) = encoder_with_head(-1.0).unwrap();
        let flipped = neg.score("how do I restore a stash?", &c, &stage).unwrap();
        for (a, b) in batch.iter().zip(&flipped) {
            assert!((a + b).abs() < 1e-4);
        }
    }
}
