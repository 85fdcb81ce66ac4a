//! `ragscope attribute`: where did the latency go? Reads finished traces (OTLP JSON files, a
//! Jaeger or Tempo query API, or the server's own `/debug/traces`), and reports per stage the
//! self and inclusive time, each stage's share of end-to-end time, the critical path, and the
//! residual no stage covers. With a baseline it names the stage whose change explains the
//! end-to-end change.
//!
//! Time is split without double counting: every instant of a request belongs to the innermost
//! span running then, and among concurrent siblings to the shortest (a streamed response's
//! `stream` span waits while the worker's stages run, and owns only the gaps between them and
//! the tail it writes alone). The owned ("critical") times of all stages plus the residual add
//! up to the request exactly.

pub mod batch;
pub mod source;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::config::AttributeArgs;

/// One finished span, whatever format it came from. Times in nanoseconds since the epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root (or a span whose parent is in another process).
    pub parent_id: String,
    pub name: String,
    pub start_ns: i128,
    pub end_ns: i128,
    /// `rag.fault.*` attributes, kept so injected faults are visible in the report.
    pub faults: Vec<(String, String)>,
    /// HTTP status of a server span, when it has one.
    pub status_code: Option<i64>,
    /// Whom a batched decode step ran for, when the span is one (`decode_step`).
    pub step: Option<batch::StepRecord>,
}

/// Percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    #[serde(default)]
    pub mean: f64,
}

impl Percentiles {
    pub fn of(values: &[f64]) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        Percentiles {
            p50: percentile(&v, 50.0),
            p95: percentile(&v, 95.0),
            p99: percentile(&v, 99.0),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// The p-th percentile (0..=100) of sorted values, interpolating between the nearest ranks;
/// NaN for none. The load generator's statistics, on this module's percent scale.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    ragscope_loadgen::stats::percentile(sorted, p / 100.0)
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    /// The stage's path under the request span, e.g. `chat › decode`.
    pub stage: String,
    /// Requests in which the stage ran.
    pub count: usize,
    /// Span duration minus its children's, per request (summed when it ran more than once).
    pub self_ms: Percentiles,
    /// Span duration, per request.
    pub inclusive_ms: Percentiles,
    /// Time the stage owned (see the module docs), per request.
    #[serde(default)]
    pub critical_ms: Percentiles,
    /// Self time over end-to-end time, all requests together.
    pub share: f64,
    /// Owned time over end-to-end time; all stages' plus the residual's make 1.
    pub critical_path_share: f64,
    /// Injected faults seen on the stage's spans (`rag.fault.*`), by attribute.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub faults: BTreeMap<String, usize>,
}

/// The stage that made the slowest requests slow.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TailDriver {
    pub stage: String,
    /// Requests in the tail (at or above the end-to-end p99; at least one).
    pub requests: usize,
    /// The stage's mean owned time in the tail minus its median over all requests.
    pub excess_ms: f64,
    /// The tail's mean end-to-end time minus the median end-to-end time.
    pub end_to_end_excess_ms: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub traces: usize,
    /// Requests left out because their root span failed (HTTP ≥ 400).
    #[serde(default)]
    pub failed: usize,
    pub end_to_end_ms: Percentiles,
    pub stages: Vec<StageReport>,
    /// Time inside the request span that no stage owns.
    pub residual_ms: Percentiles,
    #[serde(default)]
    pub residual_share: f64,
    /// The critical path of the median request: (stage, ms) in order.
    #[serde(default)]
    pub critical_path: Vec<(String, f64)>,
    #[serde(default)]
    pub tail: Option<TailDriver>,
}

/// One request's numbers, per stage path.
#[derive(Debug, Default)]
struct TraceTimes {
    end_to_end: f64,
    residual: f64,
    /// stage → (self, inclusive, owned) in ms.
    stages: HashMap<String, (f64, f64, f64)>,
    faults: HashMap<String, Vec<(String, String)>>,
    path: Vec<(String, f64)>,
    /// When each stage first started, ms after the request began (for ordering the report).
    offsets: HashMap<String, f64>,
}

/// The first word of a span name (`embeddings all-MiniLM-L6-v2` → `embeddings`): model and
/// collection names vary, the operation does not.
pub fn stage_name(span_name: &str) -> &str {
    span_name.split_whitespace().next().unwrap_or(span_name)
}

/// Analyses every trace whose root span's name starts with one of `roots` (all roots if empty).
pub fn analyse(spans: &[SpanRecord], roots: &[String]) -> Report {
    let mut by_trace: BTreeMap<&str, Vec<&SpanRecord>> = BTreeMap::new();
    for s in spans {
        by_trace.entry(s.trace_id.as_str()).or_default().push(s);
    }
    let mut failed = 0;
    let mut traces = Vec::new();
    for spans in by_trace.values() {
        let ids: HashMap<&str, usize> = spans
            .iter()
            .enumerate()
            .map(|(i, s)| (s.span_id.as_str(), i))
            .collect();
        for (i, root) in spans.iter().enumerate() {
            let is_root = root.parent_id.is_empty() || !ids.contains_key(root.parent_id.as_str());
            if !is_root
                || !(roots.is_empty() || roots.iter().any(|r| root.name.starts_with(r.as_str())))
            {
                continue;
            }
            if root.status_code.is_some_and(|c| c >= 400) {
                failed += 1;
                continue;
            }
            traces.push(trace_times(spans, &ids, i));
        }
    }
    summarise(traces, failed)
}

fn trace_times(spans: &[&SpanRecord], ids: &HashMap<&str, usize>, root: usize) -> TraceTimes {
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); spans.len()];
    for (i, s) in spans.iter().enumerate() {
        if let Some(&p) = ids.get(s.parent_id.as_str()) {
            if p != i {
                children[p].push(i);
            }
        }
    }
    // The subtree under the root, each span with its path and depth.
    let mut nodes: Vec<(usize, String, usize)> = Vec::new();
    let mut stack = vec![(root, String::new(), 0usize)];
    while let Some((i, path, depth)) = stack.pop() {
        for &c in &children[i] {
            let name = stage_name(&spans[c].name);
            let child_path = if path.is_empty() {
                name.to_string()
            } else {
                format!("{path} › {name}")
            };
            stack.push((c, child_path, depth + 1));
        }
        nodes.push((i, path, depth));
    }
    let r = spans[root];
    let ms = |ns: i128| ns as f64 / 1e6;
    let mut t = TraceTimes {
        end_to_end: ms(r.end_ns - r.start_ns),
        ..TraceTimes::default()
    };
    // Self and inclusive time, clipped to the root.
    for (i, path, _) in &nodes {
        if path.is_empty() {
            continue;
        }
        let s = spans[*i];
        let (start, end) = (s.start_ns.max(r.start_ns), s.end_ns.min(r.end_ns));
        let inclusive = (end - start).max(0);
        let covered = union_length(
            children[*i]
                .iter()
                .map(|&c| (spans[c].start_ns.max(start), spans[c].end_ns.min(end))),
        );
        let offset = ms(start - r.start_ns);
        t.offsets
            .entry(path.clone())
            .and_modify(|o| *o = o.min(offset))
            .or_insert(offset);
        let entry = t.stages.entry(path.clone()).or_default();
        entry.0 += ms(inclusive - covered);
        entry.1 += ms(inclusive);
        if !s.faults.is_empty() {
            t.faults
                .entry(path.clone())
                .or_default()
                .extend(s.faults.iter().cloned());
        }
    }
    // Ownership sweep over the elementary intervals between all boundaries.
    let mut cuts: Vec<i128> = nodes
        .iter()
        .flat_map(|(i, _, _)| [spans[*i].start_ns, spans[*i].end_ns])
        .filter(|&x| x >= r.start_ns && x <= r.end_ns)
        .collect();
    cuts.push(r.start_ns);
    cuts.push(r.end_ns);
    cuts.sort_unstable();
    cuts.dedup();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        let owner = nodes
            .iter()
            .filter(|(i, _, _)| spans[*i].start_ns <= a && spans[*i].end_ns >= b)
            .max_by_key(|(i, _, depth)| {
                (
                    *depth,
                    std::cmp::Reverse(spans[*i].end_ns - spans[*i].start_ns),
                )
            })
            .map(|(_, path, _)| path.as_str())
            .unwrap_or("");
        let d = ms(b - a);
        if owner.is_empty() {
            t.residual += d;
        } else {
            t.stages.entry(owner.to_string()).or_default().2 += d;
        }
        t.path.push((
            if owner.is_empty() {
                "(residual)"
            } else {
                owner
            }
            .to_string(),
            d,
        ));
    }
    t.path = readable_path(std::mem::take(&mut t.path));
    t
}

/// Drops the slivers (< 0.1 ms) between spans and merges what is then adjacent.
fn readable_path(segments: Vec<(String, f64)>) -> Vec<(String, f64)> {
    let mut path: Vec<(String, f64)> = Vec::new();
    for (label, ms) in segments.into_iter().filter(|(_, ms)| *ms >= 0.1) {
        match path.last_mut() {
            Some((last, total)) if *last == label => *total += ms,
            _ => path.push((label, ms)),
        }
    }
    path
}

/// Total length covered by possibly overlapping intervals.
fn union_length(intervals: impl Iterator<Item = (i128, i128)>) -> i128 {
    let mut v: Vec<(i128, i128)> = intervals.filter(|(a, b)| b > a).collect();
    v.sort_unstable();
    let (mut total, mut reach) = (0, i128::MIN);
    for (a, b) in v {
        let a = a.max(reach);
        if b > a {
            total += b - a;
            reach = b;
        }
    }
    total
}

fn summarise(traces: Vec<TraceTimes>, failed: usize) -> Report {
    let e2e: Vec<f64> = traces.iter().map(|t| t.end_to_end).collect();
    let total_e2e: f64 = e2e.iter().sum();
    let mut names: Vec<String> = traces
        .iter()
        .flat_map(|t| t.stages.keys().cloned())
        .collect();
    names.sort();
    names.dedup();
    // In request order: by when the stage starts on average; a parent before its children.
    let order = |name: &str| {
        let offsets: Vec<f64> = traces
            .iter()
            .filter_map(|t| t.offsets.get(name).copied())
            .collect();
        offsets.iter().sum::<f64>() / offsets.len().max(1) as f64
    };
    names.sort_by(|a, b| {
        order(a)
            .total_cmp(&order(b))
            .then(a.matches('›').count().cmp(&b.matches('›').count()))
            .then(a.cmp(b))
    });
    let stages: Vec<StageReport> = names
        .iter()
        .map(|name| {
            let runs: Vec<&(f64, f64, f64)> =
                traces.iter().filter_map(|t| t.stages.get(name)).collect();
            let column =
                |f: fn(&(f64, f64, f64)) -> f64| runs.iter().map(|r| f(r)).collect::<Vec<_>>();
            let mut faults = BTreeMap::new();
            for t in &traces {
                for (key, _) in t.faults.get(name).into_iter().flatten() {
                    *faults.entry(key.clone()).or_insert(0) += 1;
                }
            }
            let total = |f: fn(&(f64, f64, f64)) -> f64| runs.iter().map(|r| f(r)).sum::<f64>();
            StageReport {
                stage: name.clone(),
                count: runs.len(),
                self_ms: Percentiles::of(&column(|r| r.0)),
                inclusive_ms: Percentiles::of(&column(|r| r.1)),
                critical_ms: Percentiles::of(&column(|r| r.2)),
                share: ratio(total(|r| r.0), total_e2e),
                critical_path_share: ratio(total(|r| r.2), total_e2e),
                faults,
            }
        })
        .collect();
    let residual: Vec<f64> = traces.iter().map(|t| t.residual).collect();
    let median_trace = {
        let mut idx: Vec<usize> = (0..traces.len()).collect();
        idx.sort_by(|&a, &b| traces[a].end_to_end.total_cmp(&traces[b].end_to_end));
        idx.get(idx.len() / 2).map(|&i| traces[i].path.clone())
    };
    Report {
        traces: traces.len(),
        failed,
        end_to_end_ms: Percentiles::of(&e2e),
        residual_ms: Percentiles::of(&residual),
        residual_share: ratio(residual.iter().sum(), total_e2e),
        tail: tail_driver(&traces, &stages),
        stages,
        critical_path: median_trace.unwrap_or_default(),
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Which stage's owned time grew most in the requests at or above the end-to-end p99.
fn tail_driver(traces: &[TraceTimes], stages: &[StageReport]) -> Option<TailDriver> {
    if traces.len() < 2 {
        return None;
    }
    let mut e2e: Vec<f64> = traces.iter().map(|t| t.end_to_end).collect();
    e2e.sort_by(f64::total_cmp);
    let cut = percentile(&e2e, 99.0);
    let tail: Vec<&TraceTimes> = traces.iter().filter(|t| t.end_to_end >= cut).collect();
    let tail_mean = tail.iter().map(|t| t.end_to_end).sum::<f64>() / tail.len() as f64;
    let best = stages
        .iter()
        .map(|s| {
            let mean_in_tail = tail
                .iter()
                .map(|t| t.stages.get(&s.stage).map_or(0.0, |v| v.2))
                .sum::<f64>()
                / tail.len() as f64;
            (s.stage.clone(), mean_in_tail - s.critical_ms.p50)
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    Some(TailDriver {
        stage: best.0,
        requests: tail.len(),
        excess_ms: best.1,
        end_to_end_excess_ms: tail_mean - percentile(&e2e, 50.0),
    })
}

/// How one stage changed between two runs.
#[derive(Debug, Clone, Serialize)]
pub struct StageChange {
    pub stage: String,
    pub self_p50_delta_ms: f64,
    pub self_p99_delta_ms: f64,
    pub critical_p50_delta_ms: f64,
    pub critical_p99_delta_ms: f64,
}

/// The comparison of a run against a baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub end_to_end_p50_delta_ms: f64,
    pub end_to_end_p99_delta_ms: f64,
    pub stages: Vec<StageChange>,
    /// The stage whose p50 change explains most of the end-to-end p50 change, and how much.
    pub explained_by: Option<String>,
    pub explained_share: f64,
    /// The same for p99.
    pub p99_explained_by: Option<String>,
}

pub fn compare(baseline: &Report, run: &Report) -> Comparison {
    let find = |r: &Report, name: &str| r.stages.iter().find(|s| s.stage == name).cloned();
    let mut names: Vec<String> = run.stages.iter().map(|s| s.stage.clone()).collect();
    for s in &baseline.stages {
        if !names.contains(&s.stage) {
            names.push(s.stage.clone());
        }
    }
    let stages: Vec<StageChange> = names
        .iter()
        .map(|name| {
            let (b, r) = (
                find(baseline, name).unwrap_or_default(),
                find(run, name).unwrap_or_default(),
            );
            StageChange {
                stage: name.clone(),
                self_p50_delta_ms: r.self_ms.p50 - b.self_ms.p50,
                self_p99_delta_ms: r.self_ms.p99 - b.self_ms.p99,
                critical_p50_delta_ms: r.critical_ms.p50 - b.critical_ms.p50,
                critical_p99_delta_ms: r.critical_ms.p99 - b.critical_ms.p99,
            }
        })
        .collect();
    let e2e_p50 = run.end_to_end_ms.p50 - baseline.end_to_end_ms.p50;
    let e2e_p99 = run.end_to_end_ms.p99 - baseline.end_to_end_ms.p99;
    // The stage moving most in the direction the end-to-end time moved.
    let pick = |delta: fn(&StageChange) -> f64, total: f64| {
        stages
            .iter()
            .max_by(|a, b| (delta(a) * total.signum()).total_cmp(&(delta(b) * total.signum())))
            .filter(|s| delta(s) * total.signum() > 0.0)
            .map(|s| (s.stage.clone(), delta(s)))
    };
    let p50 = pick(|s| s.critical_p50_delta_ms, e2e_p50);
    // Owned time, not self time: a span waiting alongside the work (`stream`) must not lead.
    let p99 = pick(|s| s.critical_p99_delta_ms, e2e_p99);
    Comparison {
        end_to_end_p50_delta_ms: e2e_p50,
        end_to_end_p99_delta_ms: e2e_p99,
        explained_share: p50.as_ref().map_or(0.0, |(_, d)| ratio(*d, e2e_p50)),
        explained_by: p50.map(|(s, _)| s),
        p99_explained_by: p99.map(|(s, _)| s),
        stages,
    }
}

/// The report as a table.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    let e = &report.end_to_end_ms;
    let _ = writeln!(
        out,
        "{} requests ({} failed, left out); end-to-end p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms\n",
        report.traces, report.failed, e.p50, e.p95, e.p99
    );
    let _ = writeln!(
        out,
        "{:<28} {:>6} {:>9} {:>9} {:>9} {:>10} {:>7} {:>9}  faults",
        "stage", "count", "self p50", "self p95", "self p99", "incl p50", "share", "critical"
    );
    for s in &report.stages {
        let faults: Vec<String> = s.faults.iter().map(|(k, n)| format!("{k}×{n}")).collect();
        let _ = writeln!(
            out,
            "{:<28} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>6.1}% {:>8.1}%  {}",
            s.stage,
            s.count,
            s.self_ms.p50,
            s.self_ms.p95,
            s.self_ms.p99,
            s.inclusive_ms.p50,
            s.share * 100.0,
            s.critical_path_share * 100.0,
            faults.join(" ")
        );
    }
    let r = &report.residual_ms;
    let _ = writeln!(
        out,
        "{:<28} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>10} {:>7} {:>8.1}%",
        "(residual)",
        report.traces,
        r.p50,
        r.p95,
        r.p99,
        "",
        "",
        report.residual_share * 100.0
    );
    if !report.critical_path.is_empty() {
        let path: Vec<String> = report
            .critical_path
            .iter()
            .map(|(s, ms)| format!("{s} {ms:.1}"))
            .collect();
        let _ = writeln!(
            out,
            "\ncritical path of the median request (ms): {}",
            path.join(" → ")
        );
    }
    if let Some(t) = &report.tail {
        let _ = writeln!(
            out,
            "tail: in the {} slowest request(s) (≥ p99) {} owns {:+.1} ms more than its median, of {:+.1} ms end-to-end",
            t.requests, t.stage, t.excess_ms, t.end_to_end_excess_ms
        );
    }
    out
}

/// The comparison as a table.
pub fn comparison_table(c: &Comparison) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nagainst the baseline: end-to-end p50 {:+.2} ms, p99 {:+.2} ms\n",
        c.end_to_end_p50_delta_ms, c.end_to_end_p99_delta_ms
    );
    let _ = writeln!(
        out,
        "{:<28} {:>14} {:>14} {:>16} {:>16}",
        "stage", "Δ self p50", "Δ self p99", "Δ critical p50", "Δ critical p99"
    );
    for s in &c.stages {
        let _ = writeln!(
            out,
            "{:<28} {:>+11.2} ms {:>+11.2} ms {:>+13.2} ms {:>+13.2} ms",
            s.stage,
            s.self_p50_delta_ms,
            s.self_p99_delta_ms,
            s.critical_p50_delta_ms,
            s.critical_p99_delta_ms
        );
    }
    match &c.explained_by {
        Some(stage) => {
            let _ = writeln!(
                out,
                "\n{stage} explains {:.0}% of the end-to-end p50 change ({:+.2} ms of {:+.2} ms)",
                c.explained_share * 100.0,
                c.stages
                    .iter()
                    .find(|s| &s.stage == stage)
                    .map_or(0.0, |s| s.critical_p50_delta_ms),
                c.end_to_end_p50_delta_ms
            );
        }
        None => {
            let _ = writeln!(out, "\nno stage moved with the end-to-end p50");
        }
    }
    if let Some(stage) = &c.p99_explained_by {
        let d = c
            .stages
            .iter()
            .find(|s| &s.stage == stage)
            .map_or(0.0, |s| s.critical_p99_delta_ms);
        let _ = writeln!(
            out,
            "the p99 change is led by {stage} ({d:+.2} ms of {:+.2} ms)",
            c.end_to_end_p99_delta_ms
        );
    }
    out
}

/// `ragscope attribute`.
pub async fn run(args: AttributeArgs) -> Result<()> {
    let spans = source::load(&args).await?;
    if spans.is_empty() {
        bail!("no spans found in the given source");
    }
    let report = analyse(&spans, &args.root);
    if report.traces == 0 {
        bail!(
            "{} spans read, but no trace has a root span named {:?} (see --root)",
            spans.len(),
            args.root
        );
    }
    print!("{}", table(&report));
    let mut out = serde_json::to_value(&report)?;
    if let Some(batched) = batch::analyse(&spans) {
        print!("{}", batch::table(&batched));
        out["batch"] = serde_json::to_value(&batched)?;
    }
    if let Some(path) = &args.baseline {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--baseline: reading {}", path.display()))?;
        let baseline: Report = serde_json::from_str(&text).with_context(|| {
            format!(
                "--baseline: {} is not a report written by --json",
                path.display()
            )
        })?;
        let comparison = compare(&baseline, &report);
        print!("{}", comparison_table(&comparison));
        out["comparison"] = serde_json::to_value(&comparison)?;
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("--json: writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(
        trace: &str,
        id: &str,
        parent: &str,
        name: &str,
        start_ms: i128,
        end_ms: i128,
    ) -> SpanRecord {
        SpanRecord {
            trace_id: trace.into(),
            span_id: id.into(),
            parent_id: parent.into(),
            name: name.into(),
            start_ns: start_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            faults: Vec::new(),
            status_code: Some(200),
            step: None,
        }
    }

    /// A streamed request: stream waits alongside the worker stages, then writes alone.
    fn request(trace: &str, retrieval_ms: i128) -> Vec<SpanRecord> {
        let r = retrieval_ms;
        vec![
            span(trace, "root", "remote", "POST /v1/rag/query", 0, 100 + r),
            span(trace, "q", "root", "queue", 1, 3),
            span(trace, "e", "root", "embeddings m", 3, 13),
            span(trace, "f", "e", "forward", 5, 12),
            span(trace, "r", "root", "retrieval c", 13, 13 + r),
            span(trace, "c", "root", "chat m", 14 + r, 90 + r),
            span(trace, "p", "c", "prefill", 14 + r, 50 + r),
            span(trace, "s", "root", "stream", 2, 99 + r),
        ]
    }

    fn stage<'a>(r: &'a Report, name: &str) -> &'a StageReport {
        r.stages.iter().find(|s| s.stage == name).unwrap()
    }

    #[test]
    fn owned_times_and_residual_add_up_to_the_request() {
        let spans = request("t1", 5);
        let report = analyse(&spans, &["POST /v1/rag/query".into()]);
        assert_eq!(report.traces, 1);
        assert_eq!(report.end_to_end_ms.p50, 105.0);
        let owned: f64 =
            report.stages.iter().map(|s| s.critical_ms.p50).sum::<f64>() + report.residual_ms.p50;
        assert!((owned - 105.0).abs() < 1e-9, "{owned}");
        assert_eq!(stage(&report, "embeddings").self_ms.p50, 3.0);
        assert_eq!(stage(&report, "embeddings").inclusive_ms.p50, 10.0);
        assert_eq!(stage(&report, "embeddings › forward").self_ms.p50, 7.0);
        assert_eq!(stage(&report, "retrieval").critical_ms.p50, 5.0);
        assert_eq!(stage(&report, "chat › prefill").critical_ms.p50, 36.0);
        assert_eq!(stage(&report, "queue").critical_ms.p50, 2.0);
        // stream owns the gap before chat and the tail it writes alone (90+r..99+r).
        assert_eq!(stage(&report, "stream").critical_ms.p50, 1.0 + 9.0);
        assert_eq!(report.residual_ms.p50, 1.0 + 1.0);
        let path: Vec<&str> = report
            .critical_path
            .iter()
            .map(|(s, _)| s.as_str())
            .collect();
        assert_eq!(
            &path[..5],
            [
                "(residual)",
                "queue",
                "embeddings",
                "embeddings › forward",
                "embeddings"
            ]
        );
        assert_eq!(
            report.critical_path.iter().map(|(_, ms)| ms).sum::<f64>(),
            105.0
        );
    }

    #[test]
    fn a_baseline_comparison_names_the_stage_that_moved() {
        let base: Vec<SpanRecord> = (0..20).flat_map(|i| request(&format!("b{i}"), 5)).collect();
        let slow: Vec<SpanRecord> = (0..20)
            .flat_map(|i| request(&format!("s{i}"), 25))
            .collect();
        let roots = ["POST /v1/rag/query".to_string()];
        let c = compare(&analyse(&base, &roots), &analyse(&slow, &roots));
        assert_eq!(c.end_to_end_p50_delta_ms, 20.0);
        assert_eq!(c.explained_by.as_deref(), Some("retrieval"));
        assert!((c.explained_share - 1.0).abs() < 1e-9);
        let embed = c.stages.iter().find(|s| s.stage == "embeddings").unwrap();
        assert_eq!(embed.self_p50_delta_ms, 0.0);
    }

    #[test]
    fn the_tail_driver_is_the_stage_that_grew_in_the_slowest_requests() {
        let mut spans: Vec<SpanRecord> =
            (0..99).flat_map(|i| request(&format!("n{i}"), 5)).collect();
        spans.extend(request("slow", 300));
        let report = analyse(&spans, &[]);
        let tail = report.tail.unwrap();
        assert_eq!(tail.stage, "retrieval");
        assert!(tail.excess_ms > 250.0, "{tail:?}");
    }

    #[test]
    fn failed_requests_are_counted_and_left_out() {
        let mut spans = request("ok", 5);
        let mut bad = request("bad", 5);
        bad[0].status_code = Some(500);
        spans.extend(bad);
        let report = analyse(&spans, &[]);
        assert_eq!((report.traces, report.failed), (1, 1));
    }

    #[test]
    fn percentiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 75.0), 4.0);
        assert!((percentile(&v, 99.0) - 4.96).abs() < 1e-9);
    }
}
