//! The BERT encoder forward on the CPU in plain Rust, for [`super::bert::BertEmbedder`]: weights
//! copied out of the safetensors once (packed to BF16 where the CPU has AVX-512 BF16), a batch's
//! real tokens packed into one matrix for every linear layer, LayerNorm and GELU, so nothing is
//! spent on padding; attention per sequence at its own length; then mean pooling and L2
//! normalisation. Candle's `BertModel` stays for other devices and as the reference in tests.
//!
//! BF16 vectors stay within cosine 0.999 of candle's F32 model (a test holds it to that);
//! `ragscope-lab embed-ab` times the forwards against each other, and docs/PERFORMANCE.md
//! has the figures against PyTorch.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use candle_nn::VarBuilder;
use candle_transformers::models::bert::{Config, HiddenAct};

use super::EmbedError;
use llm::kernels::{self, column_share, Epilogue, Head, HeadRows, Linear, Precision, Rows, Shared};

pub struct CpuBert {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    eps: f32,
    max_positions: usize,
    /// `[vocab, hidden]`.
    word: Vec<f32>,
    /// `[max_positions, hidden]`.
    position: Vec<f32>,
    /// Token type 0's row: every input is a single segment.
    token_type: Vec<f32>,
    embed_norm: Norm,
    layers: Vec<Layer>,
    precision: Precision,
    threads: usize,
}

struct Norm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

struct Layer {
    /// Query, key and value as one `[3 × hidden, hidden]` layer: one pass over the input rows.
    qkv: Linear,
    attention_out: Linear,
    attention_norm: Norm,
    up: Linear,
    down: Linear,
    output_norm: Norm,
}

impl CpuBert {
    /// Copies the weights out of `vb` (F32, on the CPU) for a BERT with `config`, which must
    /// pass [`supports`].
    pub fn load(
        vb: &VarBuilder,
        config: &Config,
        precision: Precision,
        threads: usize,
    ) -> Result<CpuBert, EmbedError> {
        supports(config).map_err(EmbedError::Load)?;
        let (h, i) = (config.hidden_size, config.intermediate_size);
        let vb = if vb.contains_tensor("embeddings.word_embeddings.weight") {
            vb.clone()
        } else {
            vb.pp("bert")
        };
        let get = |shape: &[usize], name: &str| -> Result<Vec<f32>, EmbedError> {
            Ok(vb.get(shape, name)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let norm = |prefix: &str| -> Result<Norm, EmbedError> {
            Ok(Norm {
                gamma: get(&[h], &format!("{prefix}.LayerNorm.weight"))?,
                beta: get(&[h], &format!("{prefix}.LayerNorm.bias"))?,
            })
        };
        let linear = |prefix: &str, n: usize, k: usize| -> Result<Linear, EmbedError> {
            let w = get(&[n, k], &format!("{prefix}.weight"))?;
            let b = get(&[n], &format!("{prefix}.bias"))?;
            Ok(Linear::new(&w, &b, n, k, precision))
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{l}");
            let mut w = Vec::with_capacity(3 * h * h);
            let mut b = Vec::with_capacity(3 * h);
            for part in ["query", "key", "value"] {
                w.extend(get(&[h, h], &format!("{p}.attention.self.{part}.weight"))?);
                b.extend(get(&[h], &format!("{p}.attention.self.{part}.bias"))?);
            }
            layers.push(Layer {
                qkv: Linear::new(&w, &b, 3 * h, h, precision),
                attention_out: linear(&format!("{p}.attention.output.dense"), h, h)?,
                attention_norm: norm(&format!("{p}.attention.output"))?,
                up: linear(&format!("{p}.intermediate.dense"), i, h)?,
                down: linear(&format!("{p}.output.dense"), h, i)?,
                output_norm: norm(&format!("{p}.output"))?,
            });
        }
        let token_types = get(
            &[config.type_vocab_size, h],
            "embeddings.token_type_embeddings.weight",
        )?;
        // A layer whose shape the BF16 kernel cannot take was packed in F32; run all in F32 then.
        let all_bf16 = layers.iter().all(|l| {
            [&l.qkv, &l.attention_out, &l.up, &l.down]
                .iter()
                .all(|x| x.precision() == Precision::Bf16)
        });
        if precision == Precision::Bf16 && !all_bf16 {
            return CpuBert::load(&vb, config, Precision::F32, threads);
        }
        Ok(CpuBert {
            hidden: h,
            heads: config.num_attention_heads,
            intermediate: i,
            eps: config.layer_norm_eps as f32,
            max_positions: config.max_position_embeddings,
            word: get(&[config.vocab_size, h], "embeddings.word_embeddings.weight")?,
            position: get(
                &[config.max_position_embeddings, h],
                "embeddings.position_embeddings.weight",
            )?,
            token_type: token_types[..h].to_vec(),
            embed_norm: norm("embeddings")?,
            layers,
            precision,
            threads: threads.max(1),
        })
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Unit-length mean-pooled embeddings of `sequences` (token ids with their special tokens).
    pub fn embed(&self, sequences: &[&[u32]]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let vocab = self.word.len() / self.hidden;
        for s in sequences {
            if s.is_empty() || s.len() > self.max_positions {
                return Err(EmbedError::Tokenizer(format!(
                    "{} tokens, the model takes 1 to {}",
                    s.len(),
                    self.max_positions
                )));
            }
            if let Some(id) = s.iter().find(|&&id| id as usize >= vocab) {
                return Err(EmbedError::Tokenizer(format!(
                    "token id {id} outside the vocabulary of {vocab}"
                )));
            }
        }
        let mut spans = Vec::with_capacity(sequences.len());
        let mut rows = 0;
        for s in sequences {
            spans.push(rows..rows + s.len());
            rows += s.len();
        }
        let hidden = self.encode(sequences, &spans, rows);
        Ok(spans
            .iter()
            .map(|span| {
                let mut mean = vec![0f32; self.hidden];
                for r in span.clone() {
                    for (m, x) in mean.iter_mut().zip(&hidden[r * self.hidden..]) {
                        *m += x;
                    }
                }
                let count = span.len() as f32;
                mean.iter_mut().for_each(|m| *m /= count);
                let norm = mean.iter().map(|m| m * m).sum::<f32>().sqrt().max(1e-12);
                mean.iter_mut().for_each(|m| *m /= norm);
                mean
            })
            .collect())
    }

    /// The last layer's hidden states, `[rows, hidden]`, of all sequences packed row after row.
    fn encode(&self, sequences: &[&[u32]], spans: &[Range<usize>], rows: usize) -> Vec<f32> {
        let (h, i) = (self.hidden, self.intermediate);
        let bf16 = self.precision == Precision::Bf16;
        let bf16_len = |n: usize| if bf16 { n } else { 0 };
        let mut x = vec![0f32; rows * h];
        let mut x_bf16 = vec![0u16; bf16_len(rows * h)];
        let mut qkv = vec![0f32; rows * 3 * h];
        let mut ctx = vec![0f32; if bf16 { 0 } else { rows * h }];
        let mut ctx_bf16 = vec![0u16; bf16_len(rows * h)];
        let mut sum = vec![0f32; rows * h];
        let mut up = vec![0f32; rows * i];
        let mut up_bf16 = vec![0u16; bf16_len(rows * i)];
        let buffers = Buffers {
            x: Shared::new(&mut x),
            x_bf16: Shared::new(&mut x_bf16),
            qkv: Shared::new(&mut qkv),
            ctx: Shared::new(&mut ctx),
            ctx_bf16: Shared::new(&mut ctx_bf16),
            sum: Shared::new(&mut sum),
            up: Shared::new(&mut up),
            up_bf16: Shared::new(&mut up_bf16),
        };
        // A single short query is not worth a second thread's start-up.
        let threads = if rows < 4 { 1 } else { self.threads };
        run_team(threads, |team| {
            // SAFETY: between two `team.sync()`s each thread writes only its own share (rows,
            // columns or heads) of the buffers it writes, and reads only buffers no thread
            // writes in that phase.
            unsafe { self.encode_share(team, sequences, spans, rows, &buffers) }
        });
        x
    }

    /// One thread's share of [`Self::encode`].
    ///
    /// # Safety
    /// Every thread of `team` runs this with the same arguments; `buffers` are sized for `rows`.
    unsafe fn encode_share(
        &self,
        team: &Team<'_>,
        sequences: &[&[u32]],
        spans: &[Range<usize>],
        rows: usize,
        b: &Buffers,
    ) {
        let (h, i) = (self.hidden, self.intermediate);
        let bf16 = self.precision == Precision::Bf16;
        let my_rows = share(rows, team.id, team.threads);
        let rows_of = |width: usize| my_rows.start * width..my_rows.end * width;

        unsafe {
            // Embeddings: word + token type + position, then LayerNorm.
            {
                let sum = b.sum.part(rows_of(h));
                for (span, ids) in spans.iter().zip(sequences) {
                    for (pos, &id) in ids.iter().enumerate() {
                        let r = span.start + pos;
                        if !my_rows.contains(&r) {
                            continue;
                        }
                        let out = &mut sum[(r - my_rows.start) * h..][..h];
                        let word = &self.word[id as usize * h..][..h];
                        let position = &self.position[pos * h..][..h];
                        for (((o, w), t), p) in
                            out.iter_mut().zip(word).zip(&self.token_type).zip(position)
                        {
                            *o = w + t + p;
                        }
                    }
                }
                self.norm(&self.embed_norm, sum, b, rows_of(h));
            }
            team.sync();

            let x_rows = || {
                if bf16 {
                    Rows::Bf16(b.x_bf16.read())
                } else {
                    Rows::F32(b.x.read())
                }
            };
            let scale = 1.0 / ((h / self.heads) as f32).sqrt();
            let mut scratch = Vec::new();
            let mut head_out = Vec::new();
            for layer in &self.layers {
                layer.qkv.forward_columns(
                    x_rows(),
                    rows,
                    b.qkv.ptr(),
                    column_share(3 * h, team.id, team.threads),
                    Epilogue::None,
                );
                team.sync();

                self.attention(team, spans, b, scale, &mut scratch, &mut head_out);
                team.sync();

                let ctx = if bf16 {
                    Rows::Bf16(b.ctx_bf16.read())
                } else {
                    Rows::F32(b.ctx.read())
                };
                layer.attention_out.forward_columns(
                    ctx,
                    rows,
                    b.sum.ptr(),
                    column_share(h, team.id, team.threads),
                    Epilogue::Add(b.x.read()),
                );
                team.sync();

                self.norm(&layer.attention_norm, b.sum.part(rows_of(h)), b, rows_of(h));
                team.sync();

                layer.up.forward_columns(
                    x_rows(),
                    rows,
                    b.up.ptr(),
                    column_share(i, team.id, team.threads),
                    Epilogue::Gelu,
                );
                team.sync();

                let up = if bf16 {
                    kernels::convert_to_bf16(b.up.part(rows_of(i)), b.up_bf16.part(rows_of(i)));
                    team.sync();
                    Rows::Bf16(b.up_bf16.read())
                } else {
                    Rows::F32(b.up.read())
                };
                layer.down.forward_columns(
                    up,
                    rows,
                    b.sum.ptr(),
                    column_share(h, team.id, team.threads),
                    Epilogue::Add(b.x.read()),
                );
                team.sync();

                self.norm(&layer.output_norm, b.sum.part(rows_of(h)), b, rows_of(h));
                team.sync();
            }
        }
    }

    /// LayerNorm of this thread's rows of `sum` into `x` (and its BF16 copy).
    ///
    /// # Safety
    /// `range` is this thread's share of `x` and `x_bf16`.
    unsafe fn norm(&self, norm: &Norm, sum: &[f32], b: &Buffers, range: Range<usize>) {
        let x = unsafe { b.x.part(range.clone()) };
        let x_bf16 = (self.precision == Precision::Bf16).then(|| unsafe { b.x_bf16.part(range) });
        kernels::layer_norm(sum, &norm.gamma, &norm.beta, self.eps, x, x_bf16);
    }

    /// This thread's heads: every `threads`-th of the (sequence, head) pairs, which keeps the
    /// threads even when the sequences come sorted by length.
    ///
    /// # Safety
    /// No thread writes `qkv` during this phase; each (sequence, head) is one thread's.
    unsafe fn attention(
        &self,
        team: &Team<'_>,
        spans: &[Range<usize>],
        b: &Buffers,
        scale: f32,
        scratch: &mut Vec<f32>,
        head_out: &mut Vec<f32>,
    ) {
        let h = self.hidden;
        let d = h / self.heads;
        let qkv = unsafe { b.qkv.read() };
        for item in (team.id..spans.len() * self.heads).step_by(team.threads) {
            let (span, head) = (&spans[item / self.heads], item % self.heads);
            let len = span.len();
            head_out.resize(len * d, 0.0);
            let rows = &qkv[span.start * 3 * h..span.end * 3 * h];
            let at = |offset: usize| HeadRows {
                data: rows,
                stride: 3 * h,
                offset,
            };
            let input = Head {
                q: at(head * d),
                k: at(h + head * d),
                v: at(2 * h + head * d),
                queries: len,
                keys: len,
                causal: false,
            };
            kernels::attention_head(&input, scale, head_out, scratch);
            for (r, out) in span.clone().zip(head_out.chunks_exact(d)) {
                let at = r * h + head * d..r * h + head * d + d;
                if self.precision == Precision::Bf16 {
                    let dst = unsafe { b.ctx_bf16.part(at) };
                    for (d, s) in dst.iter_mut().zip(out) {
                        *d = kernels::to_bf16(*s);
                    }
                } else {
                    unsafe { b.ctx.part(at) }.copy_from_slice(out);
                }
            }
        }
    }
}

/// Whether [`CpuBert`] can run a BERT with `config`, and why not.
pub fn supports(config: &Config) -> Result<(), String> {
    if config.hidden_act != HiddenAct::Gelu {
        return Err(format!(
            "the CPU forward supports hidden_act \"gelu\", not {:?}",
            config.hidden_act
        ));
    }
    let (h, heads) = (config.hidden_size, config.num_attention_heads);
    if heads == 0 || !h.is_multiple_of(heads) {
        return Err(format!(
            "hidden size {h} is not a multiple of {heads} heads"
        ));
    }
    Ok(())
}

/// Rows `part` of `parts` of `n`.
fn share(n: usize, part: usize, parts: usize) -> Range<usize> {
    n * part / parts..n * (part + 1) / parts
}

/// The activations of one forward pass; in F32 mode the `_bf16` ones are empty.
struct Buffers {
    x: Shared<f32>,
    x_bf16: Shared<u16>,
    qkv: Shared<f32>,
    ctx: Shared<f32>,
    ctx_bf16: Shared<u16>,
    /// A layer's output plus its residual, before LayerNorm.
    sum: Shared<f32>,
    up: Shared<f32>,
    up_bf16: Shared<u16>,
}

/// One thread of a forward pass: which of how many, and the barrier they meet at.
struct Team<'a> {
    id: usize,
    threads: usize,
    barrier: &'a SpinBarrier,
}

impl Team<'_> {
    fn sync(&self) {
        self.barrier.wait();
    }
}

/// Runs `body` on `threads` threads (this one and `threads - 1` scoped ones) that meet at a
/// spinning barrier between phases: a phase of a short query lasts microseconds, less than a
/// sleeping thread takes to wake. Starting the scoped thread costs 30-55 µs per forward pass
/// (measured under load), little against a 2 ms query, so there is no pool to keep alive.
fn run_team(threads: usize, body: impl Fn(&Team<'_>) + Sync) {
    let barrier = SpinBarrier::new(threads);
    let run = |id: usize| {
        // A thread that panics would leave the others waiting at the barrier forever.
        let poison = PoisonOnPanic(&barrier);
        body(&Team {
            id,
            threads,
            barrier: &barrier,
        });
        std::mem::forget(poison);
    };
    std::thread::scope(|s| {
        for id in 1..threads {
            let run = &run;
            std::thread::Builder::new()
                .name("embed-forward".into())
                .spawn_scoped(s, move || run(id))
                .expect("spawning an embedding thread");
        }
        run(0);
    });
}

struct PoisonOnPanic<'a>(&'a SpinBarrier);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        self.0.poisoned.store(true, Ordering::Release);
    }
}

struct SpinBarrier {
    threads: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
}

impl SpinBarrier {
    fn new(threads: usize) -> SpinBarrier {
        SpinBarrier {
            threads,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
        }
    }

    fn wait(&self) {
        if self.threads == 1 {
            return;
        }
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            assert!(
                !self.poisoned.load(Ordering::Acquire),
                "another embedding thread panicked"
            );
            // Spin for tens of microseconds, then give the core away: on a busy machine the
            // thread we wait for may need it.
            if spins < 1 << 12 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embed::bert;
    use candle_core::Device;

    fn model(precision: Precision, threads: usize) -> Option<(CpuBert, tokenizers::Tokenizer)> {
        let dir = llm::testing::model_dir("all-MiniLM-L6-v2")?;
        let (config, tokenizer) = bert::load_config_and_tokenizer(&dir).unwrap();
        let vb = bert::weights(&dir, &Device::Cpu).unwrap();
        Some((
            CpuBert::load(&vb, &config, precision, threads).unwrap(),
            tokenizer,
        ))
    }

    #[test]
    fn threads_split_the_work_without_changing_the_result() {
        let texts = [
            "Rebase",
            "How do I undo the last commit?",
            "git stash saves your local modifications away and reverts the working directory.",
        ];
        for precision in [Precision::F32, Precision::best()] {
            let Some((one, tokenizer)) = model(precision, 1) else {
                return;
            };
            let (three, _) = model(precision, 3).unwrap();
            let mut tokenizer = tokenizer;
            tokenizer.with_padding(None);
            let encodings = tokenizer.encode_batch(texts.to_vec(), true).unwrap();
            let ids: Vec<&[u32]> = encodings.iter().map(|e| e.get_ids()).collect();
            // Each output element is computed the same way whichever thread computes it.
            assert_eq!(one.embed(&ids).unwrap(), three.embed(&ids).unwrap());
            // One at a time (one row too few for a second thread) equals the batch.
            let batch = one.embed(&ids).unwrap();
            for (seq, v) in ids.iter().zip(&batch) {
                assert_eq!(&three.embed(&[seq]).unwrap()[0], v, "{precision:?}");
            }
        }
    }

    #[test]
    fn configs_it_cannot_run_are_named() {
        let base = Config {
            hidden_act: HiddenAct::Gelu,
            ..Config::default()
        };
        assert_eq!(supports(&base), Ok(()));
        let tanh_gelu = Config {
            hidden_act: HiddenAct::GeluApproximate,
            ..base.clone()
        };
        assert!(supports(&tanh_gelu)
            .unwrap_err()
            .contains("GeluApproximate"));
        let odd_heads = Config {
            num_attention_heads: 7,
            ..base
        };
        assert!(supports(&odd_heads).unwrap_err().contains("7 heads"));
    }

    #[test]
    fn bad_token_sequences_are_errors() {
        let Some((m, _)) = model(Precision::F32, 2) else {
            return;
        };
        assert!(m.embed(&[&[]]).is_err());
        assert!(m.embed(&[&[101, 99_999, 102]]).is_err());
        assert!(m.embed(&[&vec![101; 513]]).is_err());
        assert!(m.embed(&[]).unwrap().is_empty());
    }
}
