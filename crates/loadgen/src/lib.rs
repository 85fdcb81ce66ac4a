//! ragscope-loadgen: drives ragscope's HTTP API with a reproducible load and reports what it saw.
//!
//! Map of the crate, from a command line to a report:
//! - [`cli`]: the `run`, `knee`, `gate` and `report` subcommands and their flags.
//! - [`schedule`]: seeded arrivals (Poisson plus bursts), Zipf query popularity, the context gradient.
//! - [`client`]: one streaming request, timed (TTFT, time per output token, end to end), read with
//!   `measure::sse`.
//! - [`runner`]: open- and closed-loop load with warm-up, steady and cool-down phases, and progress.
//! - [`record`] and [`stats`]: the per-request JSON lines and the phase summaries over them
//!   (percentiles and their intervals come from `measure`).
//! - [`isolation`]: who else used the CPU during a run (the client, the server, neighbours, steal).
//! - [`knee`]: stepping the offered rate up until latency or errors pass a threshold.
//! - [`gate`]: comparing a small fixed load against a checked-in baseline.
//! - [`summary`]: `summary.json`, gathering the steady-phase figures and the knee or gate outcome.
//! - [`report`] and [`svg`]: the self-contained HTML report, plots drawn here as inline SVG.
//! - [`notebook`]: the same report as a Jupyter notebook that loads the run's files.
//! - [`experiment`]: `experiment tails`, heavy against light tails injected into one stage;
//!   [`cold`]: `experiment cold` (cold requests among hot) and `experiment reconnect`.
//! - [`mix`]: cold, no-match and perturbed queries; [`caches`]: hit/miss splits per cache.
//! - [`replay`] and [`shadow`]: a recorded run sent again; requests mirrored to a second server.
//! - [`grpc`]: the `ragscope.v1.Rag/Query` client (`--endpoint grpc`).
//! - [`plan`]: `plan`, the replicas and Qdrant a target load needs, from a knee and Little's law.
//! - [`commands`]: each subcommand end to end, writing `requests.jsonl`, `summary.json`, `report.html`,
//!   `report.ipynb`.
//!
//! This crate deliberately links no model code: it must be cheap to build and run next to a server.

pub mod caches;
pub mod cli;
pub mod client;
pub mod cold;
pub mod commands;
pub mod experiment;
pub mod gate;
pub mod grpc;
pub mod isolation;
pub mod knee;
pub mod mix;
pub mod notebook;
pub mod plan;
pub mod record;
pub mod replay;
pub mod report;
pub mod runner;
pub mod schedule;
pub mod shadow;
pub mod stats;
pub mod summary;
pub mod svg;
