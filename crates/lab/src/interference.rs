//! `ragscope-lab interference --inputs DIR`: what a long prefill does to a
//! request that is decoding, for each `--prefill-chunks` size, in interleaved rounds in one
//! process (the model is loaded once; the chunk size is switched between runs).
//!
//! One run: stream A decodes the peer prompt's answer (greedy, end tokens ignored); once A has
//! `A_HEAD_START` tokens, stream B sends the same prompt (the prefix cache is off, so B
//! computes all of it) for one token, and A stops `A_TAIL` tokens after B's first. A's time per output token is the gap
//! between its consecutive tokens; the gaps that overlap B's prefill (B's start to B's first
//! token) are what the chunk size bounds. Reported per size: median over rounds of A's TPOT
//! p50 / p95 / max during B's prefill, A's p95 over its whole decode, and B's time to first
//! token (what smaller chunks cost the prefilling request).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::{median, percentile, stage};
use llm::llama::Llama;
use llm::{Flow, GenerateRequest, Generator};
use telemetry::clock;

/// Most tokens stream A decodes (it stops earlier, once B's prefill is over).
const A_MAX_TOKENS: usize = 1024;
/// A's tokens before B starts, so A is in its decode when B prefills.
const A_HEAD_START: usize = 8;
/// A's tokens after B's first token.
const A_TAIL: usize = 8;

#[derive(Debug, Serialize)]
pub struct InterferencePoint {
    pub chunk_tokens: usize,
    pub rounds: usize,
    /// Stream A's gaps that overlap B's prefill.
    pub tpot_during_prefill_p50_ms: f64,
    pub tpot_during_prefill_p95_ms: f64,
    pub tpot_during_prefill_max_ms: f64,
    /// Gaps per run that overlapped B's prefill (median).
    pub gaps_during_prefill: f64,
    /// Stream A over its whole decode.
    pub tpot_p95_ms: f64,
    /// Stream B's request start to its first token.
    pub prefill_ttft_ms: f64,
}

/// What one run measured.
struct Run {
    during: Vec<Duration>,
    all: Vec<Duration>,
    ttft: Duration,
}

pub fn measure(
    generator: &Llama,
    prompt: &[u32],
    chunks: &[usize],
    rounds: usize,
) -> Result<Vec<InterferencePoint>> {
    if chunks.is_empty() {
        bail!("--prefill-chunks names no size");
    }
    let sizes: Vec<usize> = chunks
        .iter()
        .map(|&c| generator.set_prefill_chunk(c))
        .collect();
    let before = generator.prefill_chunk();
    // Warm-up: pages the weights in and starts the threads.
    run(generator, prompt)?;
    let mut runs: Vec<Vec<Run>> = sizes.iter().map(|_| Vec::new()).collect();
    for _ in 0..rounds.max(1) {
        for (i, &size) in sizes.iter().enumerate() {
            generator.set_prefill_chunk(size);
            runs[i].push(run(generator, prompt)?);
        }
    }
    generator.set_prefill_chunk(before);
    Ok(sizes
        .iter()
        .zip(runs)
        .map(|(&size, mut runs)| {
            let mut per = |f: &mut dyn FnMut(&mut Run) -> f64| {
                median(&mut runs.iter_mut().map(&mut *f).collect::<Vec<_>>())
            };
            InterferencePoint {
                chunk_tokens: size,
                rounds: rounds.max(1),
                tpot_during_prefill_p50_ms: per(&mut |r| percentile(&mut r.during, 50.0)),
                tpot_during_prefill_p95_ms: per(&mut |r| percentile(&mut r.during, 95.0)),
                tpot_during_prefill_max_ms: per(&mut |r| percentile(&mut r.during, 100.0)),
                gaps_during_prefill: per(&mut |r| r.during.len() as f64),
                tpot_p95_ms: per(&mut |r| percentile(&mut r.all, 95.0)),
                prefill_ttft_ms: per(&mut |r| clock::millis(r.ttft)),
            }
        })
        .collect())
}

fn run(generator: &Llama, prompt: &[u32]) -> Result<Run> {
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let b_done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let b_done = &b_done;
        let a = scope.spawn(move || -> Result<Vec<Instant>> {
            let mut times = Vec::with_capacity(A_MAX_TOKENS);
            let mut tail = 0;
            generator.generate(
                GenerateRequest::benchmark(prompt, A_MAX_TOKENS),
                &stage(),
                &mut |_| {
                    times.push(clock::now());
                    if times.len() == A_HEAD_START {
                        let _ = started_tx.send(());
                    }
                    if b_done.load(Ordering::Relaxed) {
                        tail += 1;
                        if tail >= A_TAIL {
                            return Flow::Stop;
                        }
                    }
                    Flow::Continue
                },
            )?;
            Ok(times)
        });
        // B waits for A's head start (or for A to end, which the check below reports).
        let _ = started_rx.recv();
        let b_start = clock::now();
        let b = generator.generate(GenerateRequest::benchmark(prompt, 1), &stage(), &mut |_| {
            Flow::Continue
        });
        b_done.store(true, Ordering::Relaxed);
        let times = a.join().expect("stream A panicked")?;
        let b_first = b?.first_token_at.context("stream B generated nothing")?;
        if times.last().is_none_or(|&t| t < b_first) {
            bail!("stream A ended before stream B's prefill did");
        }
        let gap = |w: &[Instant]| w[1].saturating_duration_since(w[0]);
        Ok(Run {
            during: times
                .windows(2)
                .filter(|w| w[1] > b_start && w[0] < b_first)
                .map(gap)
                .collect(),
            all: times.windows(2).map(gap).collect(),
            ttft: b_first.saturating_duration_since(b_start),
        })
    })
}

pub fn print(prompt_tokens: usize, points: &[InterferencePoint]) {
    println!(
        "ragscope-lab interference: stream A decodes while stream B prefills the same {prompt_tokens}-token prompt; \
         medians of {} rounds",
        points.first().map_or(0, |p| p.rounds)
    );
    println!(
        "{:>6} {:>22} {:>12} {:>12} {:>8} {:>14} {:>12}",
        "chunk", "A TPOT in B's prefill", "p95", "max", "gaps", "A TPOT p95", "B TTFT"
    );
    for p in points {
        println!(
            "{:>6} {:>19.1} ms {:>9.1} ms {:>9.1} ms {:>8.0} {:>11.1} ms {:>9.1} ms",
            p.chunk_tokens,
            p.tpot_during_prefill_p50_ms,
            p.tpot_during_prefill_p95_ms,
            p.tpot_during_prefill_max_ms,
            p.gaps_during_prefill,
            p.tpot_p95_ms,
            p.prefill_ttft_ms
        );
    }
}
