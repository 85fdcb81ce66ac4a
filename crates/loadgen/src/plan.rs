//! `plan`: how many server replicas, and how much Qdrant, a target load needs at a p95 TTFT
//! SLO, from one replica's measured knee. The capacity of a replica is the throughput it
//! achieved at the highest offered rate whose p95 TTFT met the SLO (every step before it met
//! it too); the per-stage service times are the server's own `timings` of that step's requests
//! (or a `ragscope attribute --json` report); Little's law (L = λ·W) turns the target rate and
//! the measured time in the server into requests in flight. The plan divides the target by the
//! capacity kept below the knee by a headroom factor, adds spare replicas, and checks the
//! measured capacity against the bound of the one serial resource per replica, the prefill turn.
//! docs/SCALING.md walks through it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use crate::knee::StepResult;
use crate::record::RequestRecord;
use crate::summary::Summary;

#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// The knee run's `summary.json` (`ragscope-loadgen knee`); its `requests.jsonl` beside it
    /// gives the per-stage times unless --attribution does.
    #[arg(long)]
    pub knee: PathBuf,
    /// The load to plan for, requests per second.
    #[arg(long)]
    pub target_rps: f64,
    /// The p95 time-to-first-token objective, milliseconds.
    #[arg(long)]
    pub slo_ttft_p95_ms: f64,
    /// A knee step also fails above this error rate.
    #[arg(long, default_value_t = 0.01)]
    pub max_error_rate: f64,
    /// `ragscope attribute --json` output for the same load: per-stage times from traces.
    #[arg(long)]
    pub attribution: Option<PathBuf>,
    /// Share of the measured capacity a replica is planned to carry (the knee is the edge:
    /// Poisson bursts and a lost replica's load must fit below it).
    #[arg(long, default_value_t = 0.7)]
    pub headroom: f64,
    /// Replicas beyond the ones the load needs, so one can fail or restart (N+1).
    #[arg(long, default_value_t = 1)]
    pub spare: usize,
    /// Model workers per replica (`--workers` of the measured server).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Chunks the collection will hold (Qdrant memory).
    #[arg(long, default_value_t = 100_000)]
    pub chunks: u64,
    /// Embedding dimension.
    #[arg(long, default_value_t = 384)]
    pub dim: u64,
    /// Mean payload per chunk in bytes (its text, ids, metadata).
    #[arg(long, default_value_t = 1500)]
    pub payload_bytes: u64,
    /// CPU cores per Qdrant node.
    #[arg(long, default_value_t = 4)]
    pub qdrant_cores: u64,
    /// Print the plan as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What one replica was measured to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Replica {
    /// The knee step the capacity comes from.
    pub step: usize,
    pub offered_rps: f64,
    /// Completions per second at that step: the replica's capacity at the SLO.
    pub capacity_rps: f64,
    pub ttft_p95_ms: f64,
    /// Mean server time per stage of that step's requests (`embed`, `retrieve`, …, `total`).
    pub stage_ms: BTreeMap<String, f64>,
}

/// The plan and the figures it rests on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub target_rps: f64,
    pub slo_ttft_p95_ms: f64,
    pub replica: Replica,
    /// Capacity times headroom: what one replica is planned to carry.
    pub planned_rps_per_replica: f64,
    /// Replicas the load needs, and with the spares.
    pub replicas_for_load: usize,
    pub replicas: usize,
    /// Little's law: requests in the server at the target (λ·W), in all and per replica.
    pub in_flight: f64,
    pub in_flight_per_replica: f64,
    /// One prefill at a time per replica: at most 1000 / prefill_ms requests per second.
    pub prefill_bound_rps: Option<f64>,
    /// Retrieval's share of the request's model-worker time (everything but queueing).
    pub retrieval_share: Option<f64>,
    /// Qdrant CPU the target keeps busy (core-seconds per second: one search, one core).
    pub qdrant_busy_cores: f64,
    pub qdrant_nodes: u64,
    pub qdrant_memory_gib: f64,
    pub qdrant_shards: u64,
    pub qdrant_replication_factor: u64,
    /// The reasoning, one line per step.
    pub notes: Vec<String>,
}

/// The highest step with requests whose p95 TTFT meets `slo` and error rate
/// `max_error_rate`, all before it meeting both (a step that sent nothing breaks nothing, as
/// in the knee finder, but measures nothing either); `None` when no step qualifies.
pub fn capacity_step(steps: &[StepResult], slo: f64, max_error_rate: f64) -> Option<&StepResult> {
    let meets =
        |s: &StepResult| s.error_rate <= max_error_rate && s.ttft_p95_ms.is_some_and(|p| p <= slo);
    steps
        .iter()
        .take_while(|s| s.requests == 0 || meets(s))
        .filter(|s| s.requests > 0)
        .last()
}

/// Mean of each server timing over `records` (ok ones of `step`), keys without `_ms`.
pub fn stage_means(records: &[RequestRecord], step: usize) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let timings = records
        .iter()
        .filter(|r| r.ok && r.step == Some(step))
        .filter_map(|r| r.server_timings.as_ref());
    for t in timings {
        for (k, v) in t {
            let e = sums
                .entry(k.trim_end_matches("_ms").to_string())
                .or_default();
            e.0 += v;
            e.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(k, (s, n))| (k, s / n as f64))
        .collect()
}

/// Per-stage mean self times from a `ragscope attribute --json` report, under the names the
/// server's `timings` use.
pub fn attribution_means(report: &serde_json::Value) -> BTreeMap<String, f64> {
    let name = |stage: &str| -> Option<&'static str> {
        Some(match stage {
            "queue" => "queue",
            "embeddings" => "embed",
            "retrieval" => "retrieve",
            "rerank" => "rerank",
            "context" => "context",
            "prompt" => "prompt",
            "chat › prefill" => "prefill",
            "chat › decode" => "decode",
            _ => return None,
        })
    };
    let mut out = BTreeMap::new();
    for s in report["stages"].as_array().into_iter().flatten() {
        let stage = s["stage"].as_str().unwrap_or_default();
        let first = stage.split(' ').next().unwrap_or_default();
        let key = name(stage).or_else(|| name(first));
        if let (Some(k), Some(ms)) = (key, s["inclusive_ms"]["mean"].as_f64()) {
            out.insert(k.to_string(), ms);
        }
    }
    if let Some(ms) = report["end_to_end_ms"]["mean"].as_f64() {
        out.insert("total".into(), ms);
    }
    out
}

/// Qdrant's sizing rule for vectors kept in RAM (vectors × dimension × 4 bytes × 1.5 for the
/// index and overhead), plus the payloads, in GiB.
pub fn qdrant_memory_gib(chunks: u64, dim: u64, payload_bytes: u64) -> f64 {
    let vectors = chunks as f64 * dim as f64 * 4.0 * 1.5;
    let payload = chunks as f64 * payload_bytes as f64;
    (vectors + payload) / (1u64 << 30) as f64
}

/// The plan for `a` from one replica's measurement.
pub fn plan(a: &PlanArgs, replica: Replica) -> anyhow::Result<Plan> {
    // Written so that NaN fails too.
    let valid = a.target_rps > 0.0 && a.headroom > 0.0 && a.headroom <= 1.0;
    if !valid {
        bail!("--target-rps must be positive and --headroom in (0, 1]");
    }
    let completed = replica.capacity_rps > 0.0;
    if !completed {
        bail!("the capacity step completed no request");
    }
    let mut notes = Vec::new();
    let stage = |k: &str| replica.stage_ms.get(k).copied();
    notes.push(format!(
        "one replica: {:.2} rps achieved at step {} (offered {:.2} rps) with p95 TTFT {:.0} ms ≤ SLO {:.0} ms",
        replica.capacity_rps, replica.step, replica.offered_rps, replica.ttft_p95_ms, a.slo_ttft_p95_ms
    ));
    let planned = replica.capacity_rps * a.headroom;
    let for_load = (a.target_rps / planned).ceil().max(1.0) as usize;
    notes.push(format!(
        "planned per replica: {:.2} × headroom {:.2} = {planned:.2} rps → ⌈{:.2} / {planned:.2}⌉ = {for_load} replicas, + {} spare = {}",
        replica.capacity_rps, a.headroom, a.target_rps, a.spare, for_load + a.spare
    ));
    // Little's law over the time a request spends in the server.
    let w_ms = stage("total").unwrap_or(0.0);
    let in_flight = a.target_rps * w_ms / 1000.0;
    let per_replica = in_flight / for_load as f64;
    notes.push(format!(
        "Little's law: L = λ·W = {:.2} rps × {:.0} ms = {in_flight:.1} requests in the servers, {per_replica:.1} per replica against {} workers{}",
        a.target_rps, w_ms, a.workers,
        if per_replica > a.workers as f64 { ": requests queue for a worker (TTFT grows)" } else { "" }
    ));
    let prefill_bound = stage("prefill").filter(|&p| p > 0.0).map(|p| 1000.0 / p);
    if let Some(bound) = prefill_bound {
        notes.push(format!(
            "serial bound: prefills run one at a time, {:.0} ms each → at most {bound:.2} rps per replica; the measured capacity is {:.0}% of it",
            stage("prefill").unwrap_or_default(),
            100.0 * replica.capacity_rps / bound
        ));
    }
    let worker_ms: f64 = [
        "embed", "retrieve", "rerank", "context", "prompt", "prefill", "decode",
    ]
    .iter()
    .filter_map(|k| stage(k))
    .sum();
    let retrieve = stage("retrieve").unwrap_or(0.0);
    let retrieval_share = (worker_ms > 0.0).then(|| retrieve / worker_ms);
    let busy = a.target_rps * retrieve / 1000.0;
    // Keep Qdrant's cores half busy so a search rarely waits for one.
    let by_cpu = (busy / (a.qdrant_cores as f64 * 0.5)).ceil() as u64;
    let memory = qdrant_memory_gib(a.chunks, a.dim, a.payload_bytes);
    let nodes = by_cpu.max(1);
    // Two copies so a node can go; shards a multiple of the nodes so they spread evenly.
    let replication = if nodes > 1 { 2 } else { 1 };
    let shards = nodes.max(1) * 2;
    notes.push(format!(
        "retrieval: {retrieve:.1} ms of {worker_ms:.0} ms worker time ({:.1}%) → {:.2} Qdrant cores busy at the target → {nodes} node(s) of {} cores at ≤ 50% CPU",
        100.0 * retrieval_share.unwrap_or(0.0), busy, a.qdrant_cores
    ));
    notes.push(format!(
        "Qdrant memory: {} chunks × ({} × 4 B × 1.5 + {} B payload) = {memory:.2} GiB (per copy)",
        a.chunks, a.dim, a.payload_bytes
    ));
    Ok(Plan {
        target_rps: a.target_rps,
        slo_ttft_p95_ms: a.slo_ttft_p95_ms,
        replica,
        planned_rps_per_replica: planned,
        replicas_for_load: for_load,
        replicas: for_load + a.spare,
        in_flight,
        in_flight_per_replica: per_replica,
        prefill_bound_rps: prefill_bound,
        retrieval_share,
        qdrant_busy_cores: busy,
        qdrant_nodes: nodes,
        qdrant_memory_gib: memory,
        qdrant_shards: shards,
        qdrant_replication_factor: replication,
        notes,
    })
}

/// The replica's measurement from a knee directory (and an attribution report).
pub fn measured(a: &PlanArgs) -> anyhow::Result<Replica> {
    let text = std::fs::read_to_string(&a.knee)
        .with_context(|| format!("reading {}", a.knee.display()))?;
    let summary: Summary = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a loadgen summary", a.knee.display()))?;
    if summary.steps.is_empty() {
        bail!(
            "{} has no knee steps (run `ragscope-loadgen knee`)",
            a.knee.display()
        );
    }
    let Some(step) = capacity_step(&summary.steps, a.slo_ttft_p95_ms, a.max_error_rate) else {
        let first = &summary.steps[0];
        bail!(
            "no measured rate meets the SLO: the first step ({:.2} rps offered) had p95 TTFT {} ms and error rate {:.1}%; one replica cannot serve any load at p95 ≤ {} ms",
            first.offered_rps,
            first.ttft_p95_ms.map_or("-".into(), |p| format!("{p:.0}")),
            first.error_rate * 100.0,
            a.slo_ttft_p95_ms
        );
    };
    let stage_ms = match &a.attribution {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            attribution_means(&serde_json::from_str(&text)?)
        }
        None => {
            let dir = a.knee.parent().unwrap_or(Path::new("."));
            let records = crate::record::read_jsonl(&dir.join("requests.jsonl"))?;
            stage_means(&records, step.step)
        }
    };
    Ok(Replica {
        step: step.step,
        offered_rps: step.offered_rps,
        capacity_rps: step.achieved_rps,
        ttft_p95_ms: step.ttft_p95_ms.unwrap_or_default(),
        stage_ms,
    })
}

/// `ragscope-loadgen plan`: print the plan.
pub fn run(a: &PlanArgs) -> anyhow::Result<Plan> {
    let p = plan(a, measured(a)?)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(p);
    }
    println!(
        "capacity plan: {:.2} rps at p95 TTFT ≤ {:.0} ms",
        p.target_rps, p.slo_ttft_p95_ms
    );
    for n in &p.notes {
        println!("  - {n}");
    }
    println!(
        "replicas: {} ({} for the load + {} spare)   docker compose up -d --scale ragscope={}",
        p.replicas,
        p.replicas_for_load,
        p.replicas - p.replicas_for_load,
        p.replicas
    );
    println!(
        "qdrant: {} node(s), collection shard_number={} replication_factor={}, {:.2} GiB RAM per copy",
        p.qdrant_nodes, p.qdrant_shards, p.qdrant_replication_factor, p.qdrant_memory_gib
    );
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn step(i: usize, offered: f64, achieved: f64, p95: f64, errors: f64) -> StepResult {
        StepResult {
            step: i,
            offered_rps: offered,
            achieved_rps: achieved,
            requests: 20,
            error_rate: errors,
            ttft_p50_ms: Some(p95 / 2.0),
            ttft_p95_ms: Some(p95),
            e2e_p95_ms: None,
            failed: None,
        }
    }

    fn args(extra: &[&str]) -> PlanArgs {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            a: PlanArgs,
        }
        let mut argv = vec!["plan", "--knee", "k.json"];
        argv.extend_from_slice(extra);
        Wrap::parse_from(argv).a
    }

    fn replica(capacity: f64, stages: &[(&str, f64)]) -> Replica {
        Replica {
            step: 2,
            offered_rps: capacity,
            capacity_rps: capacity,
            ttft_p95_ms: 900.0,
            stage_ms: stages.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
        }
    }

    #[test]
    fn the_capacity_is_the_last_step_in_a_row_to_meet_the_slo() {
        let steps = [
            step(0, 0.25, 0.25, 400.0, 0.0),
            step(1, 0.5, 0.49, 800.0, 0.0),
            step(2, 1.0, 0.9, 2500.0, 0.0),
            // Meets the SLO again after a failure: not counted (the run was past the knee).
            step(3, 1.5, 1.1, 900.0, 0.0),
        ];
        assert_eq!(capacity_step(&steps, 1000.0, 0.01).unwrap().step, 1);
        assert_eq!(capacity_step(&steps, 3000.0, 0.01).unwrap().step, 3);
        assert!(capacity_step(&steps, 300.0, 0.01).is_none());
        // A first step that drew no arrivals neither counts nor stops the search.
        let mut quiet = step(0, 0.1, 0.0, 0.0, 0.0);
        (quiet.requests, quiet.ttft_p95_ms) = (0, None);
        let later = [quiet, step(1, 0.2, 0.2, 500.0, 0.0)];
        assert_eq!(capacity_step(&later, 1000.0, 0.01).unwrap().step, 1);
        assert!(capacity_step(&later[..1], 1000.0, 0.01).is_none());
        // Errors fail a step however fast it was.
        let errors = [
            step(0, 0.25, 0.25, 100.0, 0.0),
            step(1, 0.5, 0.4, 100.0, 0.2),
        ];
        assert_eq!(capacity_step(&errors, 1000.0, 0.05).unwrap().step, 0);
    }

    #[test]
    fn replicas_are_the_target_over_the_planned_share_plus_spares() {
        let stages = [("prefill", 500.0), ("retrieve", 2.0), ("total", 3000.0)];
        let a = args(&["--target-rps", "10", "--slo-ttft-p95-ms", "1000"]);
        let p = plan(&a, replica(1.0, &stages)).unwrap();
        // 1.0 rps × 0.7 = 0.7 planned; ⌈10 / 0.7⌉ = 15, + 1 spare.
        assert!((p.planned_rps_per_replica - 0.7).abs() < 1e-9);
        assert_eq!((p.replicas_for_load, p.replicas), (15, 16));
        // L = 10 rps × 3 s = 30 in flight, 2 per replica.
        assert!((p.in_flight - 30.0).abs() < 1e-9);
        assert!((p.in_flight_per_replica - 2.0).abs() < 1e-9);
        assert_eq!(p.prefill_bound_rps, Some(2.0));
        // Exactly at a multiple: no extra replica.
        let a = args(&[
            "--target-rps",
            "1.4",
            "--slo-ttft-p95-ms",
            "1000",
            "--spare",
            "0",
        ]);
        assert_eq!(plan(&a, replica(1.0, &stages)).unwrap().replicas, 2);
        let a = args(&[
            "--target-rps",
            "1.41",
            "--slo-ttft-p95-ms",
            "1000",
            "--spare",
            "0",
        ]);
        assert_eq!(plan(&a, replica(1.0, &stages)).unwrap().replicas, 3);
        // A replica that completed nothing cannot be planned with.
        assert!(plan(&a, replica(0.0, &stages)).is_err());
    }

    #[test]
    fn qdrant_is_sized_by_retrieval_time_and_chunk_count() {
        let stages = [
            ("embed", 10.0),
            ("retrieve", 40.0),
            ("prefill", 150.0),
            ("total", 300.0),
        ];
        let a = args(&[
            "--target-rps",
            "100",
            "--slo-ttft-p95-ms",
            "1000",
            "--qdrant-cores",
            "2",
            "--chunks",
            "1000000",
            "--payload-bytes",
            "0",
        ]);
        let p = plan(&a, replica(5.0, &stages)).unwrap();
        assert!((p.retrieval_share.unwrap() - 0.2).abs() < 1e-9);
        // 100 rps × 40 ms = 4 cores busy; at ≤ 50% of 2 cores each: 4 nodes, 2 copies, 8 shards.
        assert!((p.qdrant_busy_cores - 4.0).abs() < 1e-9);
        assert_eq!(
            (p.qdrant_nodes, p.qdrant_replication_factor, p.qdrant_shards),
            (4, 2, 8)
        );
        // 1e6 × 384 × 4 × 1.5 bytes = 2.146 GiB.
        assert!(
            (p.qdrant_memory_gib - 2.1458).abs() < 1e-3,
            "{}",
            p.qdrant_memory_gib
        );
    }

    #[test]
    fn stage_means_come_from_the_capacity_steps_successful_requests() {
        let record = |step: usize, ok: bool, prefill: f64| -> RequestRecord {
            serde_json::from_value(serde_json::json!({
                "id": 0, "phase": "steady", "step": step, "sent_s": 0.0, "done_s": 0.0,
                "sent_unix_ms": 0, "query_rank": 0, "trace_id": "", "ok": ok, "tokens": 0,
                "server_timings": {"prefill_ms": prefill},
            }))
            .unwrap()
        };
        let records = [
            record(1, true, 100.0),
            record(1, true, 300.0),
            record(1, false, 9e9),
            record(2, true, 7.0),
        ];
        assert_eq!(stage_means(&records, 1)["prefill"], 200.0);
        let report = serde_json::json!({
            "end_to_end_ms": {"mean": 900.0},
            "stages": [
                {"stage": "retrieval git-doc", "inclusive_ms": {"mean": 3.0}},
                {"stage": "chat › prefill", "inclusive_ms": {"mean": 400.0}},
            ]
        });
        let m = attribution_means(&report);
        assert_eq!(
            (m["retrieve"], m["prefill"], m["total"]),
            (3.0, 400.0, 900.0)
        );
    }
}
