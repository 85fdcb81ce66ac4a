//! `ragscope bench --step-span-overhead`: what batched decode step spans cost decoding. Three
//! server processes differ only in `--decode-step-spans` (`off`, `sampled:16`, `all`), each
//! exporting its spans over OTLP to a local sink; the same concurrent requests go to each in
//! interleaved rounds (A B C A B C …), so drift on the box hits every variant alike.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};

use super::median;
use super::overhead::{sink, start, Variant, QUESTIONS};
use crate::config::BenchArgs;

const MAX_TOKENS: usize = 48;

/// One round against one server: aggregate decode tokens/s (tokens over the round's wall time)
/// and each request's own decode rate (its tokens over its `decode` time).
async fn round(base: &str, n: usize, concurrency: usize) -> Result<(f64, Vec<f64>)> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let answers: Vec<Result<(f64, f64)>> = futures::stream::iter(0..n)
        .map(|i| {
            let client = client.clone();
            let url = format!("{base}/v1/rag/query");
            async move {
                let body =
                    json!({"query": QUESTIONS[i % QUESTIONS.len()], "max_tokens": MAX_TOKENS});
                let r = client.post(url).json(&body).send().await?;
                if !r.status().is_success() {
                    bail!("request failed: {}", r.status());
                }
                let v: Value = r.json().await?;
                let tokens = v["usage"]["completion_tokens"]
                    .as_f64()
                    .context("no usage.completion_tokens")?;
                let decode_ms = v["timings"]["decode_ms"]
                    .as_f64()
                    .context("no timings.decode_ms")?;
                Ok((tokens, decode_ms))
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let answers = answers.into_iter().collect::<Result<Vec<_>>>()?;
    let wall = started.elapsed().as_secs_f64();
    let tokens: f64 = answers.iter().map(|a| a.0).sum();
    let rates = answers
        .iter()
        .filter(|(t, ms)| *t > 1.0 && *ms > 0.0)
        .map(|(t, ms)| t / ms * 1e3)
        .collect();
    Ok((tokens / wall, rates))
}

pub async fn run(args: &BenchArgs) -> Result<()> {
    let sink = sink().await?;
    let variant = |name: &'static str, spans: &str| Variant {
        name,
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", sink.clone()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_string()),
            ("OTEL_BSP_SCHEDULE_DELAY", "1000".to_string()),
            ("RAGSCOPE_DECODE_STEP_SPANS", spans.to_string()),
        ],
    };
    let variants = [
        variant("step spans off", "off"),
        variant("step spans sampled:16", "sampled:16"),
        variant("step spans all", "all"),
    ];
    let data = tempfile::tempdir()?;
    let mut servers = Vec::new();
    for v in &variants {
        servers.push(start(v, args, data.path()).await?);
    }
    for s in &servers {
        round(&s.base, args.concurrency, args.concurrency).await?;
    }
    let mut aggregate: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut per_request: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for r in 0..args.rounds.max(1) {
        for (i, s) in servers.iter().enumerate() {
            let (tps, mut rates) = round(&s.base, args.requests, args.concurrency).await?;
            aggregate[i].push(tps);
            per_request[i].append(&mut rates);
        }
        eprintln!(
            "step-span overhead: round {}/{} done",
            r + 1,
            args.rounds.max(1)
        );
    }
    println!(
        "step-span overhead: {} rounds x {} requests per variant, concurrency {}, max_tokens {MAX_TOKENS}, spans exported over OTLP",
        args.rounds.max(1),
        args.requests,
        args.concurrency
    );
    println!(
        "{:<24} {:>16} {:>8} {:>22} {:>8}",
        "variant", "tok/s (round)", "vs off", "decode tok/s (request)", "vs off"
    );
    let base = (
        median(&mut aggregate[0].clone()),
        median(&mut per_request[0].clone()),
    );
    for (i, v) in variants.iter().enumerate() {
        let (a, p) = (median(&mut aggregate[i]), median(&mut per_request[i]));
        println!(
            "{:<24} {:>16.2} {:>7.1}% {:>22.2} {:>7.1}%",
            v.name,
            a,
            (a / base.0 - 1.0) * 100.0,
            p,
            (p / base.1 - 1.0) * 100.0
        );
    }
    Ok(())
}
