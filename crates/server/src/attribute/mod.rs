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
pub mod caches;
mod compare;
pub mod source;
pub mod store_side;
mod tables;

pub use compare::{compare, Comparison, StageChange};
pub use tables::{comparison_table, table, windows_table};

use std::collections::{BTreeMap, HashMap};

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
    /// What a cache held for the span, when it says (`embeddings`, `context`, `prefill`).
    pub cache: Option<caches::SpanCache>,
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
    /// What the stage's cache held over the run, when its spans say (for `--baseline` to tell
    /// a cache effect from a change in the stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<caches::StageCache>,
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
    /// stage → what its cache held in this request (summed over its spans).
    caches: HashMap<String, caches::SpanCache>,
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
        if let Some(used) = s.cache {
            t.caches
                .entry(path.clone())
                .and_modify(|c| {
                    c.looked_up += used.looked_up;
                    c.held += used.held;
                })
                .or_insert(used);
        }
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
            let mut cache = None;
            for used in traces.iter().filter_map(|t| t.caches.get(name)) {
                caches::StageCache::add(&mut cache, *used);
            }
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
                cache,
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
    if let Some(url) = &args.prometheus {
        match store_side::measure(url, &spans).await? {
            Some(side) => {
                print!("{}", store_side::table(&side));
                out["store_side"] = serde_json::to_value(&side)?;
            }
            None => eprintln!("--prometheus: no `retrieval` spans, so nothing to compare"),
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("--json: writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
