//! ragscope, the server: the `ragscope` binary's library. The layers below it are crates of their
//! own (telemetry ← llm ← rag); this one serves them and owns only what faces the outside.
//!
//! Map of the crate:
//! - [`config`]: the command line; it flattens each lower crate's settings beside the server's own.
//! - [`app`]: loading the stages, assembling the pipeline, serving until shutdown.
//! - [`api`]: the HTTP surface (RAG query, OpenAI-compatible chat, completions and embeddings,
//!   documents, tokenizer, debug and admin routes) and the gRPC one (`proto/ragscope.proto`),
//!   with authentication, tenants and the one mapping of errors to statuses; the waterfall page.
//! - [`attribute`]: where the latency went, per stage, from recorded traces.
//! - [`cli`], [`eval`]: the other subcommands. Benchmarks are the lab's (`crates/lab`).

pub mod api;
pub mod app;
pub mod attribute;
pub mod cli;
pub mod config;
pub mod eval;
