//! The reports as text tables, for the terminal.

use std::fmt::Write;

use measure::confidence::Interval;

use super::{Comparison, Report, StageChange, WindowReport};

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
        if let Some(shift) = &s.cache {
            let _ = writeln!(
                out,
                "{:<28} ↳ {}{}",
                "",
                shift.sentence(),
                if shift.coincides {
                    ": the stage moved with its cache"
                } else {
                    ""
                }
            );
        }
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
            let change = c.stages.iter().find(|s| &s.stage == stage);
            let _ = writeln!(
                out,
                "\n{stage} explains {:.0}% of the end-to-end p50 change ({:+.2} ms of {:+.2} ms)",
                c.explained_share * 100.0,
                change.map_or(0.0, |s| s.critical_p50_delta_ms),
                c.end_to_end_p50_delta_ms
            );
            if let Some(shift) = change.and_then(StageChange::cache_effect) {
                let _ = writeln!(
                    out,
                    "  a cache effect, not a change in {stage}: {}.\n  The runs met the caches \
                     in different states; measure both the same way (`ragscope-loadgen run \
                     --warm`, or a fresh server for each) to compare the stage itself.",
                    shift.sentence()
                );
                match c
                    .apart_from_caches
                    .as_ref()
                    .and_then(|name| c.stages.iter().find(|s| &s.stage == name))
                {
                    Some(s) => {
                        let _ = writeln!(
                            out,
                            "  apart from the caches, the largest significant change is {} \
                             {:+.2} ms ({:.1}× its noise)",
                            s.stage,
                            s.critical_p50_delta_ms,
                            s.signal_to_noise.abs()
                        );
                    }
                    None => {
                        let _ = writeln!(
                            out,
                            "  apart from the caches, no stage changed significantly"
                        );
                    }
                }
            }
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
