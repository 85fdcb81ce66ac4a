//! `ragscope-lab overhead`: what telemetry costs a server under load. Three `ragscope serve`
//! processes on the same ingested corpus differ only in telemetry: off, spans + metrics
//! exported over OTLP, and spans + metrics + CPU profiling at 100 Hz. Exports go to a local
//! sink that accepts and discards them.
//!
//! The trap is the server's caches (query vectors, sentence vectors, prefix KV, whole-prompt
//! hits): they change a request's time by up to its whole prefill, far more than telemetry
//! does, so a variant that meets warmer caches looks cheaper than it is. Two things keep
//! them out of the figure:
//! - every variant gets the same requests in the same sequence, so their caches evolve alike,
//!   and by default every cache is off (`--caches off`): each request does all its work in
//!   every variant. `--caches warm` instead sends every question to every server once before
//!   measuring, so all three run on caches equally hot;
//! - each round runs the variants in a fresh random order (seeded), so drift on the box and
//!   whatever the previous variant left in the CPU's caches hit every variant alike.
//!
//! The overhead is the per-round ratio of a variant's throughput to telemetry-off's in the same
//! round (pairing takes out what a round shares), as a geometric mean with a t interval over the
//! rounds; "inconclusive" when the interval holds no difference.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use futures::StreamExt;
use measure::confidence::{self, Interval};
use measure::stats::Percentiles;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;
use tokio::net::TcpListener;

use crate::Setup;

/// How the servers' caches stand while the variants are measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Caches {
    /// Every cache off (prefix KV, query vectors, sentence vectors): each request does all its
    /// work, whichever variant serves it.
    Off,
    /// The caches on, and every question sent to every server once before measuring: all
    /// variants run on caches equally hot (mostly whole-prompt hits), where telemetry's share
    /// of a request is largest.
    Warm,
}

/// What one run measures.
pub struct Plan {
    pub requests: usize,
    pub concurrency: usize,
    pub caches: Caches,
    pub seed: u64,
    pub questions: Vec<PathBuf>,
    pub binary: Option<PathBuf>,
}

struct Variant {
    name: &'static str,
    env: Vec<(&'static str, String)>,
}

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Accepts OTLP/HTTP and Pyroscope pushes and throws them away.
async fn sink() -> Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = axum::Router::new().fallback(|| async { Vec::<u8>::new() });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The corpus every variant serves, as the default server ingests it.
const CORPUS: &str = "git-doc";

/// Starts `binary serve` on `data` with `env` and `flags`, and waits until it is ready (the
/// first start ingests the corpus: minutes).
async fn start(
    name: &str,
    env: &[(&'static str, String)],
    flags: &[&str],
    binary: &Path,
    args: &Setup,
    data: &Path,
) -> Result<Server> {
    let port = free_port()?;
    let mut cmd = Command::new(binary);
    cmd.args([
        "serve",
        "--corpus",
        CORPUS,
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--grpc-listen",
        "off",
    ])
    .args(flags)
    .arg("--data-dir")
    .arg(data)
    .arg("--models-dir")
    .arg(&args.load.models.models_dir)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    for key in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SDK_DISABLED",
        "RAGSCOPE_PYROSCOPE_URL",
        "PYROSCOPE_SERVER_ADDRESS",
    ] {
        cmd.env_remove(key);
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    let mut server = Server {
        child: cmd.spawn().context("starting a server")?,
        base: format!("http://127.0.0.1:{port}"),
    };
    let client = reqwest::Client::new();
    let started = Instant::now();
    loop {
        if let Ok(r) = client.get(format!("{}/ready", server.base)).send().await {
            if r.status().is_success() {
                return Ok(server);
            }
        }
        if let Some(status) = server.child.try_wait()? {
            bail!("{name}: the server exited ({status}) before it was ready");
        }
        if started.elapsed() > Duration::from_secs(1800) {
            bail!("{name} did not become ready in 30 minutes");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The ingested corpus every variant starts from: `--data-dir` when it holds it already,
/// otherwise ingested there first by a server of its own (once; later runs reuse it).
async fn ingested(binary: &Path, args: &Setup) -> Result<PathBuf> {
    let dir = &args.load.store.data_dir;
    let marker = dir.join("corpus").join(format!("{CORPUS}.ingested"));
    if !marker.exists() {
        eprintln!(
            "telemetry overhead: ingesting {CORPUS} into {} first (minutes, once)",
            dir.display()
        );
        let env = [("OTEL_SDK_DISABLED", "true".to_string())];
        drop(start("ingest", &env, &[], binary, args, dir).await?);
    }
    Ok(dir.clone())
}

/// A copy of the ingested corpus for one variant (each server locks its own store).
fn copy_of(ingested: &Path, to: &Path) -> Result<PathBuf> {
    let status = Command::new("cp")
        .arg("-a")
        .arg(ingested)
        .arg(to)
        .status()
        .context("cp")?;
    if !status.success() {
        bail!(
            "copying {} to {}: {status}",
            ingested.display(),
            to.display()
        );
    }
    Ok(to.to_path_buf())
}

fn questions(paths: &[PathBuf]) -> Result<Vec<String>> {
    let mut all = Vec::new();
    for path in paths {
        all.extend(
            ragscope::eval::load_questions(path)
                .with_context(|| format!("--questions {}", path.display()))?
                .into_iter()
                .map(|q| q.question),
        );
    }
    if all.is_empty() {
        bail!("no questions in {paths:?}");
    }
    Ok(all)
}

/// Sends `questions`, `concurrency` at a time; returns per-request latencies (ms) and wall time.
async fn drive(base: &str, questions: &[String], concurrency: usize) -> Result<(Vec<f64>, f64)> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let results: Vec<Result<f64>> = futures::stream::iter(questions)
        .map(|q| {
            let client = client.clone();
            let url = format!("{base}/v1/rag/query");
            async move {
                let t = Instant::now();
                let body = json!({"query": q, "max_tokens": 32});
                let r = client.post(url).json(&body).send().await?;
                if !r.status().is_success() {
                    bail!("request failed: {}", r.status());
                }
                r.bytes().await?;
                Ok(telemetry::clock::millis(t.elapsed()))
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let latencies = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((latencies, started.elapsed().as_secs_f64()))
}

/// One variant's measurements: per round its throughput and mean latency, and every latency.
#[derive(Default)]
struct Measured {
    throughput: Vec<f64>,
    mean_ms: Vec<f64>,
    latencies: Vec<f64>,
}

pub async fn run(args: &Setup, plan: Plan) -> Result<()> {
    let binary = match &plan.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("ragscope"),
    };
    if !binary.exists() {
        bail!(
            "no server binary at {} (build it: cargo build --release -p ragscope)",
            binary.display()
        );
    }
    let questions = questions(&plan.questions)?;
    let sink = sink().await?;
    let exported = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", sink.clone()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY", "1000".to_string()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "5000".to_string()),
    ];
    let mut profiled = exported.clone();
    profiled.push(("RAGSCOPE_PYROSCOPE_URL", sink.clone()));
    profiled.push(("RAGSCOPE_PYROSCOPE_SAMPLE_RATE", "100".to_string()));
    let variants = [
        Variant {
            name: "telemetry off",
            env: vec![("OTEL_SDK_DISABLED", "true".to_string())],
        },
        Variant {
            name: "spans + metrics",
            env: exported,
        },
        Variant {
            name: "spans + metrics + profiling",
            env: profiled,
        },
    ];
    let flags: &[&str] = match plan.caches {
        Caches::Off => &[
            "--prefix-cache-mb",
            "0",
            "--query-cache",
            "0",
            "--sentence-cache",
            "0",
        ],
        Caches::Warm => &[],
    };
    let corpus = ingested(&binary, args).await?;
    let scratch = tempfile::tempdir()?;
    let mut servers = Vec::new();
    for (i, v) in variants.iter().enumerate() {
        let data = copy_of(&corpus, &scratch.path().join(format!("variant{i}")))?;
        servers.push(start(v.name, &v.env, flags, &binary, args, &data).await?);
    }
    // Warm-up, not counted: the same requests to each, so their caches stand alike; with
    // `--caches warm` every question, so all of them are hits from here on.
    let warm: Vec<String> = match plan.caches {
        Caches::Off => questions
            .iter()
            .take(plan.concurrency * 2)
            .cloned()
            .collect(),
        Caches::Warm => questions.clone(),
    };
    for s in &servers {
        drive(&s.base, &warm, plan.concurrency).await?;
    }
    let rounds = args.rounds.max(2);
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let mut measured: Vec<Measured> = variants.iter().map(|_| Measured::default()).collect();
    let mut order: Vec<usize> = (0..variants.len()).collect();
    for round in 0..rounds {
        // The round's questions, the same for every variant; the next round's are the next ones.
        let sent: Vec<String> = (0..plan.requests)
            .map(|i| questions[(round * plan.requests + i) % questions.len()].clone())
            .collect();
        order.shuffle(&mut rng);
        for &i in &order {
            let (l, wall) = drive(&servers[i].base, &sent, plan.concurrency).await?;
            let m = &mut measured[i];
            m.throughput.push(l.len() as f64 / wall);
            m.mean_ms.push(l.iter().sum::<f64>() / l.len() as f64);
            m.latencies.extend(l);
        }
        eprintln!("telemetry overhead: round {}/{rounds} done", round + 1);
    }
    println!(
        "telemetry overhead on {} ({})",
        llm::cpu::model(),
        llm::cpu::describe()
    );
    println!(
        "{rounds} rounds x {} requests per variant, concurrency {}, max_tokens 32, {} questions, \
         caches {}, variants in a random order each round (seed {})",
        plan.requests,
        plan.concurrency,
        questions.len(),
        match plan.caches {
            Caches::Off => "off (every request does all its work)",
            Caches::Warm => "warm (every question sent to every server first)",
        },
        plan.seed
    );
    print!("{}", table(&variants, &measured));
    Ok(())
}

/// `12.3 [11.9, 12.8]`.
fn with_interval(value: f64, i: Option<Interval>, decimals: usize) -> String {
    match i {
        Some(i) => format!(
            "{value:.decimals$} [{:.decimals$}, {:.decimals$}]",
            i.lo, i.hi
        ),
        None => format!("{value:.decimals$}"),
    }
}

/// A ratio against telemetry off as a cost in percent: `+1.2% [+0.3, +2.1]`, and its verdict.
fn cost(ratio: Option<(f64, Interval)>, slower_when_above: bool) -> (String, String) {
    let Some((r, i)) = ratio else {
        return ("–".into(), "(needs 2 rounds)".into());
    };
    // A throughput ratio below 1 is a cost; a latency ratio above 1 is.
    let pct = |x: f64| {
        if slower_when_above {
            (x - 1.0) * 100.0
        } else {
            (1.0 - x) * 100.0
        }
    };
    let (lo, hi) = {
        let (a, b) = (pct(i.lo), pct(i.hi));
        (a.min(b), a.max(b))
    };
    let verdict = if lo <= 0.0 && hi >= 0.0 {
        format!(
            "inconclusive (no difference beyond ±{:.1}%)",
            (hi - lo) / 2.0
        )
    } else if lo > 0.0 {
        format!("costs {:.1}%", pct(r))
    } else {
        format!("faster by {:.1}%: look for a difference in setup", -pct(r))
    };
    (format!("{:+.1}% [{lo:+.1}, {hi:+.1}]", pct(r)), verdict)
}

fn table(variants: &[Variant], measured: &[Measured]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<28} {:>24} {:>22} {:>24} {:>22} {:>22}  verdict (throughput)",
        "variant", "req/s [95%]", "p50 ms [95%]", "p99 ms [95%]", "throughput cost", "latency cost"
    );
    let base = &measured[0];
    for (v, m) in variants.iter().zip(measured) {
        let rps = confidence::mean_interval(&m.throughput, confidence::CONFIDENCE);
        let p = Percentiles::of(m.latencies.iter().copied());
        let (p50, p99) = p.map_or(("–".into(), "–".into()), |p| {
            (
                with_interval(p.p50, Some(p.ci.p50), 0),
                with_interval(p.p99, Some(p.ci.p99), 0),
            )
        });
        let pairs = |f: fn(&Measured) -> &Vec<f64>| -> Vec<(f64, f64)> {
            f(base).iter().copied().zip(f(m).iter().copied()).collect()
        };
        let (throughput, verdict, latency) = if std::ptr::eq(m, base) {
            ("–".to_string(), "the baseline".to_string(), "–".to_string())
        } else {
            let (t, verdict) = cost(
                confidence::paired_ratio(&pairs(|m| &m.throughput), confidence::CONFIDENCE),
                false,
            );
            let (l, _) = cost(
                confidence::paired_ratio(&pairs(|m| &m.mean_ms), confidence::CONFIDENCE),
                true,
            );
            (t, verdict, l)
        };
        let _ = writeln!(
            out,
            "{:<28} {:>24} {:>22} {:>24} {:>22} {:>22}  {verdict}",
            v.name,
            rps.map_or("–".into(), |(mean, i)| with_interval(mean, Some(i), 3)),
            p50,
            p99,
            throughput,
            latency,
        );
    }
    let _ = writeln!(
        out,
        "cost: the geometric mean over rounds of each round's ratio to telemetry off, with its \
         95% t interval; latency cost from each round's mean latency"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cost_names_its_direction_and_calls_noise_inconclusive() {
        let i = |lo, hi| Some((f64::midpoint(lo, hi), Interval { lo, hi }));
        // Throughput 3% lower, interval clear of 1: a cost.
        let (text, verdict) = cost(i(0.96, 0.98), false);
        assert_eq!(text, "+3.0% [+2.0, +4.0]");
        assert_eq!(verdict, "costs 3.0%");
        // Spanning 1: inconclusive, with its half-width.
        let (_, verdict) = cost(i(0.99, 1.02), false);
        assert_eq!(verdict, "inconclusive (no difference beyond ±1.5%)");
        // Latency 5% higher is a cost; lower is suspicious.
        assert_eq!(cost(i(1.04, 1.06), true).1, "costs 5.0%");
        assert!(cost(i(0.80, 0.82), true).1.starts_with("faster by 19.0%"));
        assert_eq!(cost(None, false).0, "–");
    }
}
