//! ragscope-rag, the RAG layer: one request from a question to a streamed answer, each stage a
//! span on the shared clock ([`telemetry`]), generation by the generator layer ([`llm`]).
//!
//! Map of the crate, in the order a request flows through it:
//! - [`worker`]: the model-worker threads and their bounded queue, admission by predicted
//!   wait (backpressure → 429), and [`tenant`] quotas checked there.
//! - [`pipeline`]: one RAG request, top to bottom: embed → retrieve → rerank → context → prompt
//!   → generate, each stage run by the one stage runner.
//! - [`embed`], [`retrieve`], [`rerank`], [`prompt`]: the stages (the generator is [`llm`]'s).
//! - [`ingest`]: documents → text → chunks → vectors in the store; the bundled corpus.
//! - [`fault`]: fault and latency injection (off unless configured), for experiments.
//! - [`settings`]: every setting of this layer, as flags the binary flattens.

pub mod embed;
pub mod fault;
pub mod ingest;
pub mod pipeline;
pub mod prompt;
pub mod rerank;
pub mod retrieve;
pub mod settings;
pub mod tenant;
pub mod worker;
