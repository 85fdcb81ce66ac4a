//! Decode under load: N requests decoding at once, for N in `--streams`.
//!
//! Each stream is a thread calling the generator with the peer benchmark's RAG prompt, greedy,
//! end-of-sequence banned, so every stream decodes exactly `--stream-tokens` tokens. Prefills
//! overlap and take different times, so the streams wait for each other after their first
//! token and the measurement covers only the window where all N decode together: aggregate
//! decode tokens/s over that window, and the time per output token (gaps between a stream's
//! consecutive tokens) at p50 and p95.

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::{percentile, stage};
use llm::llama::Llama;
use llm::{Flow, GenerateRequest, Generator};
use telemetry::clock;

#[derive(Debug, Serialize)]
pub struct StreamsPoint {
    pub streams: usize,
    pub aggregate_decode_tok_s: f64,
    pub per_stream_tok_s: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p95_ms: f64,
}

/// What one stream saw after all streams had their first token.
struct StreamRun {
    released: Instant,
    tokens: Vec<Instant>,
}

pub fn measure(
    generator: &Llama,
    prompt: &[u32],
    streams: &[usize],
    tokens: usize,
) -> Result<Vec<StreamsPoint>> {
    let mut points = Vec::new();
    // Warm-up: pages the weights in and starts the threads.
    run(generator, prompt, 1, 4)?;
    for &n in streams {
        let runs = run(generator, prompt, n.max(1), tokens)?;
        let start = runs
            .iter()
            .map(|r| r.released)
            .max()
            .context("no streams")?;
        let end = runs
            .iter()
            .filter_map(|r| r.tokens.last().copied())
            .max()
            .context("no tokens")?;
        let counted: usize = runs
            .iter()
            .map(|r| r.tokens.iter().filter(|&&t| t > start).count())
            .sum();
        let mut gaps: Vec<Duration> = runs
            .iter()
            .flat_map(|r| {
                r.tokens
                    .windows(2)
                    .map(|w| w[1].saturating_duration_since(w[0]))
            })
            .collect();
        let window = end.saturating_duration_since(start).as_secs_f64();
        let aggregate = counted as f64 / window.max(1e-9);
        points.push(StreamsPoint {
            streams: n,
            aggregate_decode_tok_s: aggregate,
            per_stream_tok_s: aggregate / n as f64,
            tpot_p50_ms: percentile(&mut gaps, 50.0),
            tpot_p95_ms: percentile(&mut gaps, 95.0),
        });
    }
    Ok(points)
}

fn run(generator: &Llama, prompt: &[u32], n: usize, tokens: usize) -> Result<Vec<StreamRun>> {
    let barrier = Barrier::new(n);
    let runs = Mutex::new(Vec::with_capacity(n));
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..n {
            scope.spawn(|| {
                let mut run: Option<StreamRun> = None;
                let out = generator.generate(
                    GenerateRequest::benchmark(prompt, tokens),
                    &stage(),
                    &mut |_| {
                        match &mut run {
                            None => {
                                barrier.wait();
                                run = Some(StreamRun {
                                    released: clock::now(),
                                    tokens: Vec::with_capacity(tokens),
                                });
                            }
                            Some(r) => r.tokens.push(clock::now()),
                        }
                        Flow::Continue
                    },
                );
                match (out, run) {
                    (Ok(_), Some(run)) => runs.lock().expect("no panics").push(run),
                    (Ok(_), None) => errors
                        .lock()
                        .expect("no panics")
                        .push("a stream produced no text".to_string()),
                    (Err(e), _) => errors.lock().expect("no panics").push(e.to_string()),
                }
            });
        }
    });
    let errors = errors.into_inner().expect("no panics");
    if let Some(e) = errors.first() {
        anyhow::bail!("{} of {n} streams failed: {e}", errors.len());
    }
    Ok(runs.into_inner().expect("no panics"))
}

pub fn print(points: &[StreamsPoint]) {
    println!(
        "{:>8} {:>16} {:>16} {:>10} {:>10}",
        "streams", "decode tok/s", "per stream", "TPOT p50", "TPOT p95"
    );
    for p in points {
        println!(
            "{:>8} {:>16.1} {:>16.1} {:>7.1} ms {:>7.1} ms",
            p.streams, p.aggregate_decode_tok_s, p.per_stream_tok_s, p.tpot_p50_ms, p.tpot_p95_ms
        );
    }
}
