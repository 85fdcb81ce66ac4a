//! ragscope: a retrieval-augmented generation server whose every stage is a span on one clock.
//!
//! Map of the crate, in the order a request flows through it:
//! - [`config`]: every setting, from flags and `RAGSCOPE_*` variables (`OTEL_*` in [`telemetry`]).
//! - [`app`]: loading the stages, assembling the pipeline, serving until shutdown.
//! - [`api`]: the HTTP surface (RAG query, OpenAI-compatible chat and embeddings, documents) and
//!   the gRPC one (`proto/ragscope.proto`: Query, Ingest, Embed, Rerank, health), and the
//!   waterfall page at `/`.
//! - [`worker`]: the model-worker threads and their bounded queue (backpressure → 429).
//! - [`pipeline`]: one RAG request, top to bottom: embed → retrieve → rerank → prompt → generate,
//!   each stage run by the one stage runner.
//! - [`embed`], [`retrieve`], [`rerank`], [`prompt`], [`generate`]: the stages.
//! - [`ingest`]: documents → text → chunks → vectors in the store; the bundled corpus.
//! - [`models`]: the model manifest, fetching and verifying weights.
//! - [`fault`]: fault and latency injection (off unless configured), for experiments.
//! - [`snapshot`]: the bounded directory of failure snapshots that `ragscope replay` re-runs.
//! - [`attribute`]: where the latency went, per stage, from recorded traces.
//! - [`device`]: the one place that picks CPU or CUDA.
//! - [`cli`], [`eval`], [`bench`]: the other subcommands.

pub mod api;
pub mod app;
pub mod attribute;
pub mod bench;
pub mod cli;
pub mod config;
pub mod embed;
pub mod eval;
pub mod fault;
pub mod ingest;
pub mod pipeline;
pub mod prompt;
pub mod rerank;
pub mod retrieve;
pub mod tenant;
pub mod worker;
