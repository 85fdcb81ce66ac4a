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
use measure::confidence::{self, Interval};

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
    measure::stats::percentile(sorted, p / 100.0)
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
    /// The owned time of each request the stage ran in: what a later `--baseline` comparison
    /// resamples to tell a real change from this stage's own noise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub critical_samples_ms: Vec<f64>,
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
    /// Every request's end-to-end time (for `--baseline` intervals).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub end_to_end_samples_ms: Vec<f64>,
    /// With `--window`: per time window, who owns the SLO violations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<WindowReport>,
}

/// One time window of `--window`: its requests, how many broke the SLO, and which stage owned
/// the violating requests' excess time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowReport {
    /// Seconds from the first request's start.
    pub from_s: f64,
    pub to_s: f64,
    pub requests: usize,
    pub violations: usize,
    /// The stage whose owned time in the violating requests exceeds its median over the whole
    /// run by the most, and by how much on average (ms). None without violations.
    pub owner: Option<String>,
    pub owner_excess_ms: f64,
    /// The violating requests' mean end-to-end time minus the SLO.
    pub over_slo_ms: f64,
}

/// One request's numbers, per stage path.
#[derive(Debug, Default)]
struct TraceTimes {
    /// When the request began (ns since the epoch).
    start_ns: i128,
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
    let (traces, failed) = request_times(spans, roots);
    summarise(&traces, failed)
}

/// [`analyse`], plus per window of `window_s` seconds the owner of the violations of an
/// end-to-end SLO of `slo_ms`.
pub fn analyse_windows(
    spans: &[SpanRecord],
    roots: &[String],
    window_s: f64,
    slo_ms: f64,
) -> Report {
    let (traces, failed) = request_times(spans, roots);
    let mut report = summarise(&traces, failed);
    // The owners are judged against the medians of the whole run.
    report.windows = windows(&traces, window_s, slo_ms, &report.stages);
    report
}

/// Per window: the SLO violations and the stage that owns them (see [`WindowReport`]).
fn windows(
    traces: &[TraceTimes],
    window_s: f64,
    slo_ms: f64,
    stages: &[StageReport],
) -> Vec<WindowReport> {
    let Some(first) = traces.iter().map(|t| t.start_ns).min() else {
        return Vec::new();
    };
    let width_ns = (window_s * 1e9).max(1.0) as i128;
    let mut by_window: BTreeMap<i128, Vec<&TraceTimes>> = BTreeMap::new();
    for t in traces {
        by_window
            .entry((t.start_ns - first) / width_ns)
            .or_default()
            .push(t);
    }
    by_window
        .into_iter()
        .map(|(i, ts)| {
            let bad: Vec<&&TraceTimes> = ts.iter().filter(|t| t.end_to_end > slo_ms).collect();
            let owner = (!bad.is_empty())
                .then(|| {
                    stages
                        .iter()
                        .map(|s| {
                            let mean = bad
                                .iter()
                                .map(|t| t.stages.get(&s.stage).map_or(0.0, |v| v.2))
                                .sum::<f64>()
                                / bad.len() as f64;
                            (s.stage.clone(), mean - s.critical_ms.p50)
                        })
                        .max_by(|a, b| a.1.total_cmp(&b.1))
                })
                .flatten();
            let over = if bad.is_empty() {
                0.0
            } else {
                bad.iter().map(|t| t.end_to_end - slo_ms).sum::<f64>() / bad.len() as f64
            };
            WindowReport {
                from_s: i as f64 * window_s,
                to_s: (i + 1) as f64 * window_s,
                requests: ts.len(),
                violations: bad.len(),
                owner_excess_ms: owner.as_ref().map_or(0.0, |o| o.1),
                owner: owner.map(|o| o.0),
                over_slo_ms: over,
            }
        })
        .collect()
}

fn request_times(spans: &[SpanRecord], roots: &[String]) -> (Vec<TraceTimes>, usize) {
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
    (traces, failed)
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
        start_ns: r.start_ns,
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

fn summarise(traces: &[TraceTimes], failed: usize) -> Report {
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
            for t in traces {
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
                critical_samples_ms: column(|r| r.2),
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
        tail: tail_driver(traces, &stages),
        stages,
        critical_path: median_trace.unwrap_or_default(),
        end_to_end_samples_ms: e2e,
        windows: Vec::new(),
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
    /// Bootstrap interval of the change of the stage's median owned time (95%, seeded); absent
    /// when either report has no per-request samples (written before they were kept).
    pub critical_p50_interval: Option<Interval>,
    /// The interval excludes zero: the change is more than this stage's own noise.
    pub significant: bool,
    /// The change over the interval's half-width: how far out of its own noise it moved.
    pub signal_to_noise: f64,
}

/// The comparison of a run against a baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub end_to_end_p50_delta_ms: f64,
    pub end_to_end_p99_delta_ms: f64,
    pub end_to_end_p50_interval: Option<Interval>,
    pub stages: Vec<StageChange>,
    /// The stage whose significant change explains the end-to-end p50 change: among stages
    /// that moved significantly in the end-to-end direction, the one furthest out of its own
    /// noise. None when no stage's change is significant.
    pub explained_by: Option<String>,
    pub explained_share: f64,
    /// The stage with the largest raw p50 move in the end-to-end direction, significant or not
    /// (shown for contrast: on noisy large stages it is often noise).
    pub largest_move: Option<String>,
    /// The stage moving most at p99.
    pub p99_explained_by: Option<String>,
    /// False when a report lacks per-request samples: then nothing is judged significant.
    pub samples: bool,
}

/// The change of the median of two samples, as a seeded bootstrap interval.
fn median_change(base: &[f64], run: &[f64], seed: u64) -> Option<Interval> {
    (!base.is_empty() && !run.is_empty()).then(|| {
        confidence::difference_interval(
            base,
            run,
            0.5,
            confidence::RESAMPLES,
            confidence::CONFIDENCE,
            seed,
        )
    })
}

pub fn compare(baseline: &Report, run: &Report) -> Comparison {
    let find = |r: &Report, name: &str| r.stages.iter().find(|s| s.stage == name).cloned();
    let mut names: Vec<String> = run.stages.iter().map(|s| s.stage.clone()).collect();
    for s in &baseline.stages {
        if !names.contains(&s.stage) {
            names.push(s.stage.clone());
        }
    }
    let samples =
        !baseline.end_to_end_samples_ms.is_empty() && !run.end_to_end_samples_ms.is_empty();
    let stages: Vec<StageChange> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let (b, r) = (
                find(baseline, name).unwrap_or_default(),
                find(run, name).unwrap_or_default(),
            );
            let delta = r.critical_ms.p50 - b.critical_ms.p50;
            let interval = if samples {
                median_change(
                    &b.critical_samples_ms,
                    &r.critical_samples_ms,
                    confidence::SEED + i as u64,
                )
            } else {
                None
            };
            StageChange {
                stage: name.clone(),
                self_p50_delta_ms: r.self_ms.p50 - b.self_ms.p50,
                self_p99_delta_ms: r.self_ms.p99 - b.self_ms.p99,
                critical_p50_delta_ms: delta,
                critical_p99_delta_ms: r.critical_ms.p99 - b.critical_ms.p99,
                significant: interval.is_some_and(|i| i.excludes_zero()),
                signal_to_noise: interval.map_or(0.0, |i| {
                    if i.half_width() > 0.0 {
                        delta / i.half_width()
                    } else if delta == 0.0 {
                        0.0
                    } else {
                        f64::INFINITY.copysign(delta)
                    }
                }),
                critical_p50_interval: interval,
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
    let largest = pick(|s| s.critical_p50_delta_ms, e2e_p50);
    let significant = stages
        .iter()
        .filter(|s| s.significant && s.critical_p50_delta_ms * e2e_p50.signum() > 0.0)
        .max_by(|a, b| a.signal_to_noise.abs().total_cmp(&b.signal_to_noise.abs()))
        .map(|s| (s.stage.clone(), s.critical_p50_delta_ms));
    // Owned time, not self time: a span waiting alongside the work (`stream`) must not lead.
    let p99 = pick(|s| s.critical_p99_delta_ms, e2e_p99);
    Comparison {
        end_to_end_p50_delta_ms: e2e_p50,
        end_to_end_p99_delta_ms: e2e_p99,
        end_to_end_p50_interval: median_change(
            &baseline.end_to_end_samples_ms,
            &run.end_to_end_samples_ms,
            confidence::SEED,
        ),
        // A signed share: the end-to-end change may be negative (a faster run).
        explained_share: significant
            .as_ref()
            .filter(|_| e2e_p50 != 0.0)
            .map_or(0.0, |(_, d)| d / e2e_p50),
        explained_by: significant.map(|(s, _)| s),
        largest_move: largest.map(|(s, _)| s),
        p99_explained_by: p99.map(|(s, _)| s),
        stages,
        samples,
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

/// The `--window` table: per window, violations of the SLO and their owner.
pub fn windows_table(windows: &[WindowReport], slo_ms: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nSLO {slo_ms:.0} ms end to end, per window:\n{:>8} {:>8} {:>9} {:>11}  owner (its excess over its median)",
        "from s", "requests", "violated", "mean over"
    );
    for w in windows {
        let _ = writeln!(
            out,
            "{:>8.1} {:>8} {:>9} {:>8.1} ms  {}",
            w.from_s,
            w.requests,
            w.violations,
            w.over_slo_ms,
            w.owner.as_ref().map_or("–".into(), |o| format!(
                "{o} ({:+.1} ms)",
                w.owner_excess_ms
            ))
        );
    }
    out
}

/// The comparison as a table.
pub fn comparison_table(c: &Comparison) -> String {
    let mut out = String::new();
    let interval = |i: Option<Interval>| {
        i.map_or("–".to_string(), |i| {
            format!("[{:+.1}, {:+.1}]", i.lo, i.hi)
        })
    };
    let _ = writeln!(
        out,
        "\nagainst the baseline: end-to-end p50 {:+.2} ms {}, p99 {:+.2} ms\n",
        c.end_to_end_p50_delta_ms,
        interval(c.end_to_end_p50_interval),
        c.end_to_end_p99_delta_ms
    );
    let _ = writeln!(
        out,
        "{:<28} {:>14} {:>14} {:>16} {:>22} {:>16}  significant",
        "stage", "Δ self p50", "Δ self p99", "Δ critical p50", "95% interval", "Δ critical p99"
    );
    for s in &c.stages {
        let _ = writeln!(
            out,
            "{:<28} {:>+11.2} ms {:>+11.2} ms {:>+13.2} ms {:>22} {:>+13.2} ms  {}",
            s.stage,
            s.self_p50_delta_ms,
            s.self_p99_delta_ms,
            s.critical_p50_delta_ms,
            interval(s.critical_p50_interval),
            s.critical_p99_delta_ms,
            if s.significant {
                format!("yes ({:.1}× its noise)", s.signal_to_noise.abs())
            } else {
                "no".into()
            }
        );
    }
    if !c.samples {
        let _ = writeln!(
            out,
            "\n(a report has no per-request samples: written by an older ragscope; rewrite it with --json to judge significance)"
        );
    }
    if c.largest_move.is_some() && c.largest_move != c.explained_by {
        let _ = writeln!(
            out,
            "\nthe largest raw move is {}, but it is within that stage's own noise",
            c.largest_move.as_deref().unwrap_or_default()
        );
    }
    // Significant changes against the end-to-end direction explain nothing of it, but they are
    // real (an injected delay hidden by a larger speed-up elsewhere): list them.
    for s in c
        .stages
        .iter()
        .filter(|s| s.significant && s.critical_p50_delta_ms * c.end_to_end_p50_delta_ms < 0.0)
    {
        let _ = writeln!(
            out,
            "\nalso significant, against the end-to-end change: {} {:+.2} ms ({:.1}× its noise)",
            s.stage,
            s.critical_p50_delta_ms,
            s.signal_to_noise.abs()
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
            let _ = writeln!(
                out,
                "\nno stage moved significantly with the end-to-end p50"
            );
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
    let report = match args.window {
        Some(w) if w.is_nan() || w <= 0.0 => bail!("--window must be a positive number of seconds"),
        Some(w) => analyse_windows(&spans, &args.root, w, args.slo_ms),
        None => analyse(&spans, &args.root),
    };
    if report.traces == 0 {
        bail!(
            "{} spans read, but no trace has a root span named {:?} (see --root)",
            spans.len(),
            args.root
        );
    }
    print!("{}", table(&report));
    if !report.windows.is_empty() {
        print!("{}", windows_table(&report.windows, args.slo_ms));
    }
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

    /// A request with a small rerank stage and a large prefill: root → embeddings, rerank,
    /// chat › prefill, back to back.
    fn rag(trace: &str, start: i128, rerank: i128, prefill: i128) -> Vec<SpanRecord> {
        let (r, p) = (10 + rerank, 10 + rerank + prefill);
        vec![
            span(
                trace,
                "root",
                "",
                "POST /v1/rag/query",
                start,
                start + p + 5,
            ),
            span(trace, "e", "root", "embeddings m", start, start + 10),
            span(trace, "r", "root", "rerank m", start + 10, start + r),
            span(trace, "c", "root", "chat m", start + r, start + p + 5),
            span(trace, "p", "c", "prefill", start + r, start + p),
        ]
    }

    #[test]
    fn the_baseline_names_the_significant_change_not_the_largest_raw_move() {
        // 14 requests per run (the case seen here): rerank +35 ms on a ~5 ms stage; prefill a
        // noisy 0.7-1.5 s stage whose median moves by ~+100 ms from one run to the next by
        // chance (a different spread of the same distribution, plus the shift).
        let frac = |x: f64| x - x.floor();
        let noisy = |i: usize, phase: f64| (700.0 + 800.0 * frac(i as f64 * 0.618 + phase)) as i128;
        let base: Vec<SpanRecord> = (0..14)
            .flat_map(|i| rag(&format!("b{i}"), 0, 5 + (i % 3) as i128, noisy(i, 0.0)))
            .collect();
        let run: Vec<SpanRecord> = (0..14)
            .flat_map(|i| {
                rag(
                    &format!("r{i}"),
                    0,
                    40 + (i % 3) as i128,
                    noisy(i, 0.5) + 100,
                )
            })
            .collect();
        let (b, r) = (analyse(&base, &[]), analyse(&run, &[]));
        assert_eq!(b.end_to_end_samples_ms.len(), 14);
        assert_eq!(stage(&b, "rerank").critical_samples_ms.len(), 14);
        let c = compare(&b, &r);
        let change = |name: &str| c.stages.iter().find(|s| s.stage == name).unwrap().clone();
        let (rerank, prefill) = (change("rerank"), change("chat › prefill"));
        assert_eq!(rerank.critical_p50_delta_ms, 35.0);
        assert!(rerank.significant, "{rerank:?}");
        assert!(
            prefill.critical_p50_delta_ms > rerank.critical_p50_delta_ms,
            "the trap needs a larger raw move on the noisy stage: {prefill:?}"
        );
        assert!(!prefill.significant, "{prefill:?}");
        assert_eq!(c.largest_move.as_deref(), Some("chat › prefill"));
        assert_eq!(
            c.explained_by.as_deref(),
            Some("rerank"),
            "{}",
            comparison_table(&c)
        );
        assert!(comparison_table(&c).contains("within that stage's own noise"));
        // The same comparison twice: the same intervals (seeded).
        let again = compare(&b, &r);
        assert_eq!(
            again
                .stages
                .iter()
                .map(|s| s.critical_p50_interval)
                .collect::<Vec<_>>(),
            c.stages
                .iter()
                .map(|s| s.critical_p50_interval)
                .collect::<Vec<_>>()
        );
        // A report without samples (an older one) judges nothing significant.
        let mut old = b.clone();
        old.end_to_end_samples_ms.clear();
        let c = compare(&old, &r);
        assert!(!c.samples && c.explained_by.is_none());
    }

    #[test]
    fn windows_name_the_stage_that_owns_each_bursts_violations() {
        // Three 10 s windows: calm, a rerank burst, a prefill burst (SLO 500 ms).
        let mut spans = Vec::new();
        for i in 0..30i128 {
            let start = i * 1000;
            let (rerank, prefill) = match i / 10 {
                1 if i % 2 == 0 => (600, 200),
                2 if i % 2 == 0 => (5, 900),
                _ => (5, 200),
            };
            spans.extend(rag(&format!("w{i}"), start, rerank, prefill));
        }
        let report = analyse_windows(&spans, &[], 10.0, 500.0);
        let w = &report.windows;
        assert_eq!(w.len(), 3, "{w:?}");
        assert_eq!(
            (w[0].requests, w[0].violations, w[0].owner.as_deref()),
            (10, 0, None)
        );
        assert_eq!(
            (w[1].violations, w[1].owner.as_deref()),
            (5, Some("rerank"))
        );
        assert_eq!(
            (w[2].violations, w[2].owner.as_deref()),
            (5, Some("chat › prefill"))
        );
        assert!(w[2].owner_excess_ms > 600.0, "{w:?}");
        assert!(windows_table(w, 500.0).contains("rerank"));
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
