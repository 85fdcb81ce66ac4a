//! What the tests of this crate and of the crates above it share: where the models are, the
//! default generator loaded once, and small ways to run it. Compiled for this crate's tests and,
//! through the `testing` feature, for the tests of the crates above (their dev-dependency turns
//! it on); never part of the server.
//!
//! A test that needs a model file asks [`model_dir`] (or [`generator`]) for it. Missing, it fails
//! the test when `RAGSCOPE_REQUIRE_MODELS` is set (the test command sets it) and otherwise skips
//! the test with a `SKIPPED` line, so a plain `cargo test` on a fresh clone says what it did not
//! run instead of failing or passing green.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};

use crate::kv_cache::KvCache;
use crate::llama::{Llama, MODEL_ID};
use crate::sampler::Logits;
use crate::{
    ChatMessage, ChatTokenizer, Flow, GenerateRequest, Generated, Generator, Sampling, TokenTrace,
};
use telemetry::span::Stage;

/// Where the models are unpacked: `$RAGSCOPE_MODELS_DIR`, else the repository's `models/`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("RAGSCOPE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // At run time first: the cached target dir is shared between checkouts.
            std::env::var_os("CARGO_MANIFEST_DIR")
                .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
                .join("../../models")
        })
}

/// The directory of the manifest model `name`, or `None` after a `SKIPPED` line when it is
/// missing; a missing model fails the test instead when `RAGSCOPE_REQUIRE_MODELS` is set.
pub fn model_dir(name: &str) -> Option<PathBuf> {
    present(models_dir().join(name))
}

/// `path`, if it exists; see [`model_dir`] for what happens when it does not.
pub fn present(path: PathBuf) -> Option<PathBuf> {
    if path.exists() {
        return Some(path);
    }
    let fetch = "run `cargo run --release -- models fetch`";
    if std::env::var_os("RAGSCOPE_REQUIRE_MODELS").is_some() {
        panic!(
            "{} not found and RAGSCOPE_REQUIRE_MODELS is set: {fetch}",
            path.display()
        );
    }
    eprintln!("SKIPPED: {} not found ({fetch})", path.display());
    None
}

/// The generator's GGUF file (see [`model_dir`] for a missing one).
pub fn model_path() -> Option<PathBuf> {
    present(model_dir(MODEL_ID)?.join("SmolLM2-135M-Instruct.Q4_1.gguf"))
}

/// The context window the tests load the generator with.
pub const MAX_CONTEXT: usize = 2048;

/// The default-format generator, loaded once for all tests, or `None` when its file is
/// missing (see [`model_dir`]).
pub fn model() -> Option<&'static Llama> {
    static MODEL: OnceLock<Option<Llama>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path = model_path()?;
            Some(Llama::from_gguf(&path, &Device::Cpu, MAX_CONTEXT).expect("load model"))
        })
        .as_ref()
}

/// The model with the F32 prefill (`F32PrefillQ4Decode`: what the default runs on a CPU
/// without AVX-512 BF16) and an F32 KV cache, loaded once: the reference the BF16 prefill and
/// the F16 cache are measured against, and the model of tests about exact agreement between two
/// ways of computing the same logits (BF16 rounding of activations turns a 1e-7 difference into
/// a 1e-3 one).
pub fn f32_model() -> Option<&'static Llama> {
    static MODEL: OnceLock<Option<Llama>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let default = model()?;
            let format = crate::llama::WeightFormat::F32PrefillQ4Decode;
            let tokenizer = default.hf_tokenizer().clone();
            let path = model_path()?;
            Some(
                Llama::load_with_format(&path, tokenizer, &Device::Cpu, MAX_CONTEXT, format)
                    .and_then(|m| m.with_kv_dtype(crate::KvDtype::F32))
                    .expect("load model"),
            )
        })
        .as_ref()
}

/// A no-op stage: no global tracer provider is installed in unit tests.
pub fn stage() -> Stage {
    Stage::root("test")
}

pub fn request(prompt: &[u32], max_tokens: usize, sampling: Sampling) -> GenerateRequest<'_> {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        token_trace: TokenTrace::Events,
        deadline: None,
        ignore_eos: false,
        stop: &[],
        end_at_paragraph: false,
        logprobs: None,
        context_tokens: &[],
    }
}

/// Generates and also returns the streamed pieces.
pub fn run(model: &Llama, req: GenerateRequest<'_>) -> (Generated, Vec<String>) {
    let mut pieces = Vec::new();
    let out = model
        .generate(req, &stage(), &mut |p| {
            pieces.push(p.text.to_string());
            Flow::Continue
        })
        .expect("generate");
    (out, pieces)
}

/// A one-passage question the model answers correctly ("Quenta").
pub fn zorbia_prompt(model: &Llama) -> Vec<u32> {
    model
        .chat_prompt(&[ChatMessage::new(
            "user",
            "Passage: The capital of Zorbia is Quenta.\nQuestion: What is the capital of Zorbia?",
        )])
        .unwrap()
}

pub fn rag_messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new(
            "system",
            "Answer the question using only the passages. Be brief.",
        ),
        ChatMessage::new(
            "user",
            "Passage 1: The Great Barrier Reef is the world's largest coral reef system, \
             composed of over 2,900 individual reefs off the coast of Queensland, Australia.\n\
             Passage 2: It can be seen from outer space and was selected as a World Heritage \
             Site in 1981.\n\nQuestion: Where is the Great Barrier Reef?",
        ),
    ]
}

/// Our logits for `prompt` then each of `forced` fed back one at a time.
pub fn our_logits(model: &Llama, prompt: &[u32], forced: &[u32]) -> Vec<Tensor> {
    let cap = prompt.len() + forced.len();
    let (net, schedule) = (&model.transformer, &model.schedule);
    let host = net.host_kv();
    let mut cache = KvCache::new(&net.cfg, cap, &Device::Cpu, host).unwrap();
    let mut logits = vec![net.prefill(prompt, &mut cache, schedule).unwrap()];
    let mut last = Logits::Host(Vec::new());
    let decode = stage();
    let mut session = schedule.session(&decode);
    for &t in forced {
        net.decode_one(session.as_mut(), &mut cache, t, &mut last, schedule)
            .unwrap();
        logits.push(match &last {
            Logits::Device(t) => t.clone(),
            Logits::Host(v) => Tensor::new(v.as_slice(), &Device::Cpu).unwrap(),
        });
    }
    logits
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A RAG prompt of about 600 tokens (longer than one prefill chunk): the same passage repeated
/// until the rendered chat prompt reaches 580 tokens.
pub fn long_prompt(model: &Llama) -> Vec<u32> {
    let passage = "The Great Barrier Reef is the world's largest coral reef system, composed \
                   of over 2,900 individual reefs and 900 islands stretching for over 2,300 \
                   kilometres over an area of approximately 344,400 square kilometres. The \
                   reef is located in the Coral Sea, off the coast of Queensland, Australia. ";
    let mut text = String::new();
    let mut i = 1;
    loop {
        text.push_str(&format!("Passage {i}: {passage}\n"));
        let msgs = [ChatMessage::new(
            "user",
            format!("{text}\nQuestion: How long is the reef?"),
        )];
        let ids = model.chat_prompt(&msgs).unwrap();
        if ids.len() >= 580 {
            return ids;
        }
        i += 1;
    }
}
