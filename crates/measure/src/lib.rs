//! Measuring a server from outside, in the few pieces both sides need: the load generator
//! (`ragscope-loadgen`) and the server's own client commands (`ragscope query`,
//! `ragscope attribute`) and the lab. It links no model code and no network stack.
//!
//! - [`stats`]: the one percentile of the workspace, and percentiles with their intervals.
//! - [`confidence`]: bootstrap intervals, the Beta posterior of an error rate: how sure a figure is.
//! - [`sse`]: an incremental Server-Sent Events reader, for timing a streamed answer.

pub mod confidence;
pub mod sse;
pub mod stats;
