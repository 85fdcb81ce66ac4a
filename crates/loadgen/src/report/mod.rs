//! `report.html`: one self-contained page (inline CSS and SVG, no scripts) built from the
//! summary and the per-request records: latency CDF, latency over time, latency against offered
//! load when there are steps, the server's own per-stage timings from its `done` events, and
//! the attribution of `ragscope attribute --json` when one is given.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;
use crate::schedule::Phase;
use crate::summary::Summary;
use crate::svg::{self, escape, Band, BarGroup, Chart, Series, Style, PALETTE};
use measure::stats::Percentiles;

/// p50/p95/p99 in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq)]
pub struct Quantiles {
    #[serde(default)]
    pub p50: f64,
    #[serde(default)]
    pub p95: f64,
    #[serde(default)]
    pub p99: f64,
}

/// One stage of an attribution file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AttributedStage {
    pub stage: String,
    #[serde(default)]
    pub count: u64,
    #[serde(default)]
    pub self_ms: Quantiles,
    #[serde(default)]
    pub inclusive_ms: Quantiles,
    #[serde(default)]
    pub share: f64,
    #[serde(default)]
    pub critical_path_share: Option<f64>,
}

/// What `ragscope attribute --json FILE` writes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Attribution {
    #[serde(default)]
    pub traces: u64,
    #[serde(default)]
    pub end_to_end_ms: Quantiles,
    #[serde(default)]
    pub stages: Vec<AttributedStage>,
    #[serde(default)]
    pub residual_ms: Option<Quantiles>,
}

impl Attribution {
    pub fn read(path: &Path) -> anyhow::Result<Attribution> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the attribution {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

/// Server timing keys in pipeline order; anything else follows alphabetically.
const STAGE_ORDER: [&str; 7] = [
    "queue_ms",
    "embed_ms",
    "retrieve_ms",
    "rerank_ms",
    "prompt_ms",
    "prefill_ms",
    "decode_ms",
];
/// Keys that sum other stages: shown in the table, not as stages.
const AGGREGATES: [&str; 2] = ["ttft_ms", "total_ms"];

pub fn render(
    summary: &Summary,
    records: &[RequestRecord],
    attribution: Option<&Attribution>,
) -> String {
    let mut h = String::new();
    let title = format!("ragscope-loadgen {}", summary.command);
    let _ = write!(
        h,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{}</style></head><body><h1>{}</h1>",
        escape(&title),
        CSS,
        escape(&title)
    );
    config_section(&mut h, summary);
    if let Some(s) = &summary.steady {
        let _ = write!(h, "<h2>Steady phase</h2>");
        headline(&mut h, s);
        // Beside the latencies, what they rest on: a hot run and a cold one differ by the
        // whole prefill.
        if let Some(state) = summary.caches.as_ref().and_then(|c| c.state()) {
            let _ = write!(h, "<p class=\"cache-state\">{}</p>", escape(&state));
        }
    }
    if let Some(c) = &summary.caches {
        caches_section(&mut h, c);
    }
    if let Some(r) = &summary.shadow {
        shadow_section(&mut h, r);
    }
    if let Some(rows) = &summary.gate {
        gate_section(&mut h, rows);
    }
    if let Some(i) = &summary.isolation {
        isolation_section(&mut h, i);
    }
    if !summary.steps.is_empty() {
        knee_section(&mut h, summary);
    }
    let steady: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| r.phase == Phase::Steady)
        .collect();
    let _ = write!(
        h,
        "<h2>Latency distribution (steady phase, successful requests)</h2>"
    );
    h.push_str(&cdf_chart(&steady));
    let _ = write!(h, "<h2>Latency over time (all phases)</h2>");
    h.push_str(&over_time_chart(summary, records));
    server_stages_section(&mut h, &steady);
    match attribution {
        Some(a) => attribution_section(&mut h, a),
        None => {
            let _ = write!(
                h,
                "<h2>Stage attribution from traces</h2><p class=\"note\">No attribution given: run <code>ragscope attribute --json FILE</code> over this run's traces and pass <code>--attribution FILE</code>.</p>"
            );
        }
    }
    let _ = write!(
        h,
        "<p class=\"note\">{} requests in requests.jsonl; each line carries the <code>trace_id</code> sent in its <code>traceparent</code>.</p></body></html>",
        records.len()
    );
    h
}

const CSS: &str = "body{font-family:sans-serif;max-width:980px;margin:1em auto;color:#222}\
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}\
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}.bad{color:#b00;font-weight:bold}\
.ok{color:#080}.note{color:#555}code{background:#f4f4f4;padding:0 3px}svg{display:block;margin:.5em 0}";

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.1}"))
}

fn config_section(h: &mut String, s: &Summary) {
    let _ = write!(h, "<h2>Configuration</h2><table>");
    if let Some(obj) = s.config.as_object() {
        for (k, v) in obj {
            let v = match v {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let _ = write!(h, "<tr><td>{}</td><td>{}</td></tr>", escape(k), escape(&v));
        }
    }
    let phases: Vec<String> = s
        .requests_by_phase
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    let _ = write!(
        h,
        "<tr><td>requests by phase</td><td>{}</td></tr></table>",
        escape(&phases.join(", "))
    );
}

fn headline(h: &mut String, s: &crate::stats::PhaseStats) {
    let _ = write!(
        h,
        "<table><tr><th>requests</th><th>ok</th><th>errors</th><th>error rate</th><th>offered rps</th><th>sent rps</th><th>achieved rps</th><th>output tokens/s</th><th>seconds</th></tr><tr><td>{}</td><td>{}</td><td>{}</td><td>{:.2}%</td><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{:.1}</td><td>{:.1}</td></tr></table>",
        s.requests,
        s.ok,
        s.errors,
        s.error_rate * 100.0,
        s.offered_rps.map_or("closed loop".into(), |o| format!("{o:.3}")),
        s.sent_rps,
        s.achieved_rps,
        s.output_tokens_per_s,
        s.seconds
    );
    let _ = write!(
        h,
        "<table><tr><th>ms</th><th>count</th><th>mean</th><th>p50</th><th>p90</th><th>p95</th><th>p99</th><th>p99.9</th><th>max</th></tr>"
    );
    let rows = [
        ("TTFT", s.ttft_ms),
        ("time per output token", s.tpot_ms),
        ("end to end", s.e2e_ms),
    ];
    for (name, p) in rows {
        percentile_row(h, name, p);
    }
    h.push_str("</table><p class=\"note\">Brackets: 95% bootstrap confidence intervals (1000 resamples, seeded).</p>");
    for (name, p) in rows {
        let Some(p) = p else { continue };
        for (tail, beyond) in p.thin_tails() {
            let _ = write!(
                h,
                "<p class=\"bad\">{} {tail} rests on {beyond:.1} samples beyond it (of {}): fewer than {:.0}, so it is close to the largest few values, not a percentile. Run at least {:.0} requests.</p>",
                escape(name),
                p.count,
                measure::confidence::MIN_TAIL_SAMPLES,
                measure::confidence::MIN_TAIL_SAMPLES / (1.0 - if tail == "p99" { 0.99 } else { 0.999 })
            );
        }
    }
    if !s.errors_by_kind.is_empty() {
        let _ = write!(h, "<table><tr><th>error kind</th><th>count</th></tr>");
        for (k, v) in &s.errors_by_kind {
            let _ = write!(h, "<tr><td>{}</td><td>{v}</td></tr>", escape(k));
        }
        h.push_str("</table>");
    }
}

fn percentile_row(h: &mut String, name: &str, p: Option<Percentiles>) {
    match p {
        Some(p) => {
            let c = |v: f64, i: measure::confidence::Interval| {
                format!("{v:.1}<br><small>[{:.1}, {:.1}]</small>", i.lo, i.hi)
            };
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td></tr>",
                escape(name),
                p.count,
                p.mean,
                c(p.p50, p.ci.p50),
                c(p.p90, p.ci.p90),
                c(p.p95, p.ci.p95),
                c(p.p99, p.ci.p99),
                c(p.p99_9, p.ci.p99_9),
                p.max
            );
        }
        None => {
            let _ = write!(
                h,
                "<tr><td>{}</td><td colspan=\"8\">no successful request</td></tr>",
                escape(name)
            );
        }
    }
}

const PERCENTILE_HEAD: &str = "<tr><th>ms</th><th>count</th><th>mean</th><th>p50</th><th>p90</th><th>p95</th><th>p99</th><th>p99.9</th><th>max</th></tr>";

fn caches_section(h: &mut String, c: &crate::caches::CacheReport) {
    let _ = write!(
        h,
        "<h2>Caches: hit and miss (steady phase)</h2><p class=\"note\">As each response said: <code>cache.query_embedding</code>; a sentence-vector hit when more than half the context's sentence vectors came from the sentence cache (<code>cache.sentences_cached</code>); a prefix hit when more than half the prompt's tokens came from the prefix KV cache (<code>cached_tokens</code>), a whole-prompt hit when all of them did.</p><table><tr><th>cache</th><th>hit rate</th><th>hits / known</th><th>items held</th><th>a miss costs most in</th></tr>"
    );
    for r in &c.caches {
        let missed = r.missed_stage.as_ref().map_or("–".into(), |s| {
            format!("{s} (+{:.1} ms at the median)", r.miss_minus_hit_ms[s])
        });
        let held = match (r.item_share, &r.items) {
            (Some(share), Some(items)) => format!("{:.1}% of {items}", share * 100.0),
            _ => "–".into(),
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.1}%</td><td>{} / {}</td><td>{}</td><td>{}</td></tr>",
            escape(&r.cache),
            r.hit_rate * 100.0,
            r.hits,
            r.known,
            escape(&held),
            escape(&missed)
        );
    }
    let _ = write!(h, "</table><table>{PERCENTILE_HEAD}");
    for r in &c.caches {
        percentile_row(h, &format!("TTFT, {} hit", r.cache), r.hit_ttft_ms);
        percentile_row(h, &format!("TTFT, {} miss", r.cache), r.miss_ttft_ms);
    }
    for k in &c.kinds {
        percentile_row(h, &format!("TTFT, {} queries", k.kind.name()), k.ttft_ms);
    }
    h.push_str("</table>");
}

fn shadow_section(h: &mut String, r: &crate::shadow::ShadowReport) {
    let _ = write!(
        h,
        "<h2>Shadow: {} against the primary</h2><p class=\"note\">{} requests mirrored, {} answered, {} paired with the primary by request id; errors {}. The shadow's requests ran on tasks of their own: the primary's figures above are the primary's alone.</p><table><tr><th>ms</th><th>primary p50</th><th>primary p95</th><th>shadow p50</th><th>shadow p95</th><th>paired Δ median (shadow − primary)</th></tr>",
        escape(&r.url),
        r.mirrored,
        r.shadow_ok,
        r.paired,
        escape(&format!("{:?}", r.shadow_errors_by_kind))
    );
    for row in &r.rows {
        let p = |p: &Option<Percentiles>, f: fn(&Percentiles) -> f64| {
            p.as_ref().map_or("–".into(), |p| format!("{:.1}", f(p)))
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&row.stage),
            p(&row.primary, |p| p.p50),
            p(&row.primary, |p| p.p95),
            p(&row.shadow, |p| p.p50),
            p(&row.shadow, |p| p.p95),
            row.median_paired_diff_ms
                .map_or("–".into(), |d| format!("{d:+.1}"))
        );
    }
    h.push_str("</table>");
}

fn gate_section(h: &mut String, rows: &[crate::gate::Row]) {
    use crate::gate::Decision;
    let (verdict, _) = crate::gate::verdict(rows);
    let _ = write!(
        h,
        "<h2>Gate: <span class=\"{}\">{}</span></h2><table><tr><th>metric</th><th>baseline</th><th>measured</th><th>interval</th><th>limit</th><th>decision</th></tr>",
        if verdict == Decision::Regression { "bad" } else { "ok" },
        escape(&crate::gate::verdict_text(rows))
    );
    for r in rows {
        let (class, text) = match (r.decision, r.more_requests) {
            (Decision::Regression, _) => ("bad", "REGRESSION".to_string()),
            (Decision::NoRegression, _) => ("ok", "no regression".to_string()),
            (Decision::Inconclusive, Some(n)) => {
                ("", format!("inconclusive: need {n} more requests"))
            }
            (Decision::Inconclusive, None) => ("", "inconclusive".to_string()),
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"{class}\">{}</td></tr>",
            escape(&r.metric),
            r.baseline,
            r.measured.map_or("none".into(), |v| format!("{v:.3}")),
            r.interval.map_or("–".into(), |i| format!("[{:.3}, {:.3}]", i.lo, i.hi)),
            escape(&r.limit),
            escape(&text)
        );
    }
    h.push_str("</table><p class=\"note\">A row decides only when its whole interval lies on one side of the limit (bootstrap for the percentile, a Poisson count for the rate, the Beta posterior for the error rate).</p>");
}

/// The isolation check: the box's CPU split during the run, flags, and the split over time.
fn isolation_section(h: &mut String, i: &crate::isolation::Isolation) {
    let _ = write!(
        h,
        "<h2>Isolation: <span class=\"{}\">{}</span></h2>",
        if i.isolated() { "ok" } else { "bad" },
        if i.isolated() {
            "the server had the box"
        } else {
            "the server shared the box"
        }
    );
    for f in &i.flags {
        let _ = write!(h, "<p class=\"bad\">{}</p>", escape(f));
    }
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let _ = write!(
        h,
        "<table><tr><th>CPUs</th><th>seconds</th><th>client</th><th>server</th><th>server cores</th><th>others</th><th>steal</th><th>max load (1 min)</th><th>threshold</th></tr><tr><td>{}</td><td>{:.1}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr></table>",
        i.cpus,
        i.seconds,
        pct(i.client_share),
        i.server_share.map_or("–".into(), pct),
        i.server_cores.map_or("unknown".into(), |c| format!("{c:.2}")),
        pct(i.others_share),
        pct(i.steal_share),
        i.load_1m_max.map_or("–".into(), |l| format!("{l:.2}")),
        pct(i.threshold)
    );
    if !i.neighbours.is_empty() {
        let _ = write!(
            h,
            "<table><tr><th>busiest other process</th><th>pid</th><th>share of the box</th></tr>"
        );
        for n in &i.neighbours {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&n.name),
                n.pid,
                pct(n.share)
            );
        }
        h.push_str("</table>");
    }
    let _ = write!(
        h,
        "<p class=\"note\">Shares of the box's whole CPU capacity ({} CPUs = 100%). Server: {}.</p>",
        i.cpus,
        match &i.server_source {
            crate::isolation::ServerSource::Proc { pid } => format!("/proc/{pid}/stat"),
            crate::isolation::ServerSource::Metrics => "its /metrics (process_cpu_time_seconds_total)".into(),
            crate::isolation::ServerSource::Unknown => "remote and reporting no CPU time".into(),
        }
    );
    if i.samples.len() >= 2 {
        let series =
            |name: &str, f: fn(&crate::isolation::Sample) -> Option<f64>, style: usize| Series {
                name: name.into(),
                points: i
                    .samples
                    .iter()
                    .filter_map(|s| Some((s.t_s, f(s)? * 100.0)))
                    .collect(),
                color: PALETTE[style % PALETTE.len()],
                style: Style::Line,
            };
        let chart = Chart {
            title: "CPU share of the box over the run".into(),
            x_label: "seconds".into(),
            y_label: "% of the box".into(),
            series: vec![
                series("client", |s| Some(s.client), 0),
                series("server", |s| s.server, 1),
                series("others", |s| Some(s.others), 2),
                series("steal", |s| Some(s.steal), 3),
            ],
            bands: Vec::new(),
            hlines: vec![(i.threshold * 100.0, "threshold".into())],
            y_from_zero: true,
        };
        h.push_str(&svg::line_chart(&chart));
    }
}

fn knee_section(h: &mut String, s: &Summary) {
    let _ = write!(h, "<h2>Knee</h2>");
    if let Some(k) = &s.knee {
        let _ = write!(
            h,
            "<p><b>last good: {} rps offered ({} achieved)</b>, <b>knee: {} rps</b> — {}. Thresholds: p95 TTFT ≤ {:.0} ms, error rate ≤ {:.1}%.</p>",
            k.last_good_rps.map_or("none".into(), |v| format!("{v:.3}")),
            k.last_good_achieved_rps.map_or("–".into(), |v| format!("{v:.3}")),
            k.knee_rps.map_or("not reached".into(), |v| format!("{v:.3}")),
            escape(&k.reason),
            k.thresholds.max_p95_ttft_ms,
            k.thresholds.max_error_rate * 100.0
        );
    }
    let _ = write!(
        h,
        "<table><tr><th>step</th><th>offered rps</th><th>achieved rps</th><th>requests</th><th>error rate</th><th>TTFT p50</th><th>TTFT p95</th><th>e2e p95</th><th>verdict</th></tr>"
    );
    for st in &s.steps {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{}</td><td>{:.1}%</td><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>",
            st.step,
            st.offered_rps,
            st.achieved_rps,
            st.requests,
            st.error_rate * 100.0,
            fmt_opt(st.ttft_p50_ms),
            fmt_opt(st.ttft_p95_ms),
            fmt_opt(st.e2e_p95_ms),
            if st.failed.is_some() { "bad" } else { "ok" },
            escape(st.failed.as_deref().unwrap_or("ok"))
        );
    }
    h.push_str("</table>");
    if s.steps.len() >= 2 {
        h.push_str(&load_chart(s));
        let achieved = Chart {
            title: "Throughput vs offered load".into(),
            x_label: "offered requests/s".into(),
            y_label: "requests/s".into(),
            series: vec![
                Series {
                    name: "achieved".into(),
                    color: PALETTE[2],
                    style: Style::LineAndDots,
                    points: s
                        .steps
                        .iter()
                        .map(|st| (st.offered_rps, st.achieved_rps))
                        .collect(),
                },
                Series {
                    name: "offered".into(),
                    color: "#999",
                    style: Style::Line,
                    points: s
                        .steps
                        .iter()
                        .map(|st| (st.offered_rps, st.offered_rps))
                        .collect(),
                },
            ],
            y_from_zero: true,
            ..Chart::default()
        };
        h.push_str(&svg::line_chart(&achieved));
    }
}

/// Latency against offered load, one point per step, with the TTFT threshold.
fn load_chart(s: &Summary) -> String {
    let pts = |f: fn(&crate::knee::StepResult) -> Option<f64>| -> Vec<(f64, f64)> {
        s.steps
            .iter()
            .filter_map(|st| Some((st.offered_rps, f(st)?)))
            .collect()
    };
    let mut hlines = Vec::new();
    if let Some(k) = &s.knee {
        hlines.push((k.thresholds.max_p95_ttft_ms, "p95 TTFT limit".to_string()));
    }
    svg::line_chart(&Chart {
        title: "Latency vs offered load".into(),
        x_label: "offered requests/s".into(),
        y_label: "ms".into(),
        series: vec![
            Series {
                name: "TTFT p50".into(),
                color: PALETTE[0],
                style: Style::LineAndDots,
                points: pts(|st| st.ttft_p50_ms),
            },
            Series {
                name: "TTFT p95".into(),
                color: PALETTE[1],
                style: Style::LineAndDots,
                points: pts(|st| st.ttft_p95_ms),
            },
            Series {
                name: "e2e p95".into(),
                color: PALETTE[3],
                style: Style::LineAndDots,
                points: pts(|st| st.e2e_p95_ms),
            },
        ],
        hlines,
        y_from_zero: true,
        ..Chart::default()
    })
}

fn cdf_points(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    // At most ~400 points: the curve stays smooth and the file small.
    let stride = (v.len() / 400).max(1);
    let mut pts: Vec<(f64, f64)> = v
        .iter()
        .enumerate()
        .filter(|(i, _)| i % stride == 0 || *i == v.len() - 1)
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect();
    if let Some(&first) = v.first() {
        pts.insert(0, (first, 0.0));
    }
    pts.dedup();
    pts
}

fn cdf_chart(steady: &[&RequestRecord]) -> String {
    let ok = || steady.iter().filter(|r| r.ok);
    svg::line_chart(&Chart {
        title: "Latency CDF".into(),
        x_label: "ms".into(),
        y_label: "fraction of requests".into(),
        series: vec![
            Series {
                name: "TTFT".into(),
                color: PALETTE[0],
                style: Style::Line,
                points: cdf_points(ok().filter_map(|r| r.ttft_ms).collect()),
            },
            Series {
                name: "end to end".into(),
                color: PALETTE[3],
                style: Style::Line,
                points: cdf_points(ok().filter_map(|r| r.e2e_ms).collect()),
            },
        ],
        y_from_zero: true,
        ..Chart::default()
    })
}

fn over_time_chart(summary: &Summary, records: &[RequestRecord]) -> String {
    let ok = || records.iter().filter(|r| r.ok);
    let mut bands = Vec::new();
    if let Some(p) = summary.phases {
        // A run's phases start when its runner does, at 0 s.
        let start = 0.0;
        if p.warmup_s > 0.0 {
            bands.push(Band {
                from: start,
                to: start + p.warmup_s,
                label: "warm-up".into(),
            });
        }
        if p.cooldown_s > 0.0 {
            let at = start + p.warmup_s + p.steady_s;
            bands.push(Band {
                from: at,
                to: at + p.cooldown_s,
                label: "cool-down".into(),
            });
        }
    }
    // Knee steps: one band per step.
    let mut by_step: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for r in records {
        if let Some(s) = r.step {
            let e = by_step
                .entry(s)
                .or_insert((f64::INFINITY, f64::NEG_INFINITY));
            e.0 = e.0.min(r.sent_s);
            e.1 = e.1.max(r.sent_s);
        }
    }
    for (step, (a, b)) in by_step {
        let rate = records
            .iter()
            .find(|r| r.step == Some(step))
            .and_then(|r| r.offered_rps)
            .unwrap_or(0.0);
        bands.push(Band {
            from: a,
            to: b,
            label: format!("{rate:.2}/s"),
        });
    }
    let errors: Vec<(f64, f64)> = records
        .iter()
        .filter(|r| !r.ok)
        .map(|r| (r.sent_s, 0.0))
        .collect();
    let mut series = vec![
        Series {
            name: "TTFT".into(),
            color: PALETTE[0],
            style: Style::Dots,
            points: ok().filter_map(|r| Some((r.sent_s, r.ttft_ms?))).collect(),
        },
        Series {
            name: "end to end".into(),
            color: PALETTE[3],
            style: Style::Dots,
            points: ok().filter_map(|r| Some((r.sent_s, r.e2e_ms?))).collect(),
        },
    ];
    if !errors.is_empty() {
        series.push(Series {
            name: format!("errors ({})", errors.len()),
            color: PALETTE[1],
            style: Style::Dots,
            points: errors,
        });
    }
    svg::line_chart(&Chart {
        title: "Latency by send time".into(),
        x_label: "seconds since start".into(),
        y_label: "ms".into(),
        series,
        bands,
        y_from_zero: true,
        ..Chart::default()
    })
}

/// The server's per-request stage timings (from `done` events) of successful steady requests.
fn server_stages_section(h: &mut String, steady: &[&RequestRecord]) {
    let mut stages: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in steady.iter().filter(|r| r.ok) {
        for (k, v) in r.server_timings.iter().flatten() {
            stages.entry(k.clone()).or_default().push(*v);
        }
    }
    let _ = write!(
        h,
        "<h2>Per-stage breakdown from the server's own timings</h2>"
    );
    if stages.is_empty() {
        let _ = write!(
            h,
            "<p class=\"note\">No server timings: the chat endpoint does not send them, or no request succeeded.</p>"
        );
        return;
    }
    let mut keys: Vec<&String> = stages.keys().collect();
    keys.sort_by_key(|k| {
        (
            AGGREGATES.contains(&k.as_str()),
            STAGE_ORDER
                .iter()
                .position(|s| s == k)
                .unwrap_or(STAGE_ORDER.len()),
            (*k).clone(),
        )
    });
    let pcts: Vec<(String, Percentiles)> = keys
        .iter()
        .filter_map(|k| Some(((*k).clone(), Percentiles::of(stages[*k].clone())?)))
        .collect();
    let _ = write!(
        h,
        "<p class=\"note\">From the <code>timings</code> of each <code>done</code> event ({} requests): the server's spans, independent of any trace backend.</p><table><tr><th>stage</th><th>count</th><th>mean</th><th>p50</th><th>p95</th><th>p99</th></tr>",
        steady.iter().filter(|r| r.ok).count()
    );
    for (k, p) in &pcts {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
            escape(k.trim_end_matches("_ms")),
            p.count,
            p.mean,
            p.p50,
            p.p95,
            p.p99
        );
    }
    h.push_str("</table>");
    let shown: Vec<&(String, Percentiles)> = pcts
        .iter()
        .filter(|(k, _)| !AGGREGATES.contains(&k.as_str()))
        .collect();
    let cats: Vec<String> = shown
        .iter()
        .map(|(k, _)| k.trim_end_matches("_ms").to_string())
        .collect();
    let group = |name: &str, color, f: fn(&Percentiles) -> f64| BarGroup {
        name: name.into(),
        color,
        values: shown.iter().map(|(_, p)| f(p)).collect(),
    };
    h.push_str(&svg::bar_chart(
        "Server stage time per request",
        "ms",
        &cats,
        &[
            group("p50", PALETTE[0], |p| p.p50),
            group("p95", PALETTE[3], |p| p.p95),
            group("p99", PALETTE[1], |p| p.p99),
        ],
    ));
}

fn attribution_section(h: &mut String, a: &Attribution) {
    let _ = write!(
        h,
        "<h2>Stage attribution from traces</h2><p class=\"note\">{} traces; end to end p50 {:.1} / p95 {:.1} / p99 {:.1} ms.</p><table><tr><th>stage</th><th>count</th><th>self p50</th><th>self p95</th><th>self p99</th><th>incl. p50</th><th>incl. p95</th><th>incl. p99</th><th>share</th><th>critical path</th></tr>",
        a.traces, a.end_to_end_ms.p50, a.end_to_end_ms.p95, a.end_to_end_ms.p99
    );
    for s in &a.stages {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}%</td><td>{}</td></tr>",
            escape(&s.stage),
            s.count,
            s.self_ms.p50,
            s.self_ms.p95,
            s.self_ms.p99,
            s.inclusive_ms.p50,
            s.inclusive_ms.p95,
            s.inclusive_ms.p99,
            s.share * 100.0,
            s.critical_path_share
                .map_or("–".into(), |c| format!("{:.1}%", c * 100.0))
        );
    }
    if let Some(r) = a.residual_ms {
        let _ = write!(
            h,
            "<tr><td>unattributed residual</td><td></td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td colspan=\"5\"></td></tr>",
            r.p50, r.p95, r.p99
        );
    }
    h.push_str("</table>");
    let mut cats: Vec<String> = a.stages.iter().map(|s| s.stage.clone()).collect();
    let mut rows: Vec<Quantiles> = a.stages.iter().map(|s| s.self_ms).collect();
    if let Some(r) = a.residual_ms {
        cats.push("residual".into());
        rows.push(r);
    }
    let group = |name: &str, color, f: fn(&Quantiles) -> f64| BarGroup {
        name: name.into(),
        color,
        values: rows.iter().map(f).collect(),
    };
    h.push_str(&svg::bar_chart(
        "Self time per stage (attribution)",
        "ms",
        &cats,
        &[
            group("p50", PALETTE[0], |q| q.p50),
            group("p95", PALETTE[3], |q| q.p95),
            group("p99", PALETTE[1], |q| q.p99),
        ],
    ));
}

#[cfg(test)]
mod tests;
