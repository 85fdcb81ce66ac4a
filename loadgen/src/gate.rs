//! The performance gate: a checked-in baseline (the fixed load as `run` flags, the figures it
//! produced, and how far each may drift) compared with a fresh run of the same load.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::stats::PhaseStats;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    /// How and where the expected figures were measured.
    pub comment: String,
    /// The load, as flags of `ragscope-loadgen run` (without --url, --out, --queries).
    pub load: Vec<String>,
    pub expected: Expected,
    pub thresholds: GateThresholds,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    pub p95_ttft_ms: f64,
    pub rps: f64,
    pub error_rate: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateThresholds {
    /// p95 TTFT may grow to this multiple of the baseline.
    pub p95_ttft_max_ratio: f64,
    /// Achieved rps must stay at or above this fraction of the baseline.
    pub rps_min_ratio: f64,
    /// The error rate may rise by at most this much (absolute, 0.02 = two points).
    pub error_rate_max_increase: f64,
}

impl Baseline {
    pub fn read(path: &Path) -> anyhow::Result<Baseline> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the baseline {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

/// One compared metric.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Row {
    pub metric: String,
    pub baseline: f64,
    pub measured: Option<f64>,
    /// The bound the measured value must respect, e.g. `<= 3000`.
    pub limit: String,
    pub ok: bool,
}

pub fn compare(b: &Baseline, m: &PhaseStats) -> Vec<Row> {
    let t = &b.thresholds;
    let e = &b.expected;
    let ttft_limit = e.p95_ttft_ms * t.p95_ttft_max_ratio;
    let ttft = m.ttft_ms.map(|p| p.p95);
    let rps_limit = e.rps * t.rps_min_ratio;
    let err_limit = e.error_rate + t.error_rate_max_increase;
    vec![
        Row {
            metric: "p95 TTFT (ms)".into(),
            baseline: e.p95_ttft_ms,
            measured: ttft,
            limit: format!("<= {ttft_limit:.1}"),
            ok: ttft.is_some_and(|v| v <= ttft_limit),
        },
        Row {
            metric: "achieved rps".into(),
            baseline: e.rps,
            measured: Some(m.achieved_rps),
            limit: format!(">= {rps_limit:.3}"),
            ok: m.achieved_rps >= rps_limit,
        },
        Row {
            metric: "error rate".into(),
            baseline: e.error_rate,
            measured: Some(m.error_rate),
            limit: format!("<= {err_limit:.3}"),
            ok: m.error_rate <= err_limit,
        },
    ]
}

/// The comparison as a fixed-width table.
pub fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<16} {:>12} {:>12} {:>14}  {}\n",
        "metric", "baseline", "measured", "limit", "result"
    );
    for r in rows {
        let measured = r.measured.map_or("none".to_string(), |v| format!("{v:.3}"));
        s.push_str(&format!(
            "{:<16} {:>12.3} {:>12} {:>14}  {}\n",
            r.metric,
            r.baseline,
            measured,
            r.limit,
            if r.ok { "ok" } else { "REGRESSION" }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Percentiles;

    fn baseline() -> Baseline {
        Baseline {
            comment: String::new(),
            load: vec![],
            expected: Expected {
                p95_ttft_ms: 1000.0,
                rps: 1.0,
                error_rate: 0.0,
            },
            thresholds: GateThresholds {
                p95_ttft_max_ratio: 1.5,
                rps_min_ratio: 0.8,
                error_rate_max_increase: 0.02,
            },
        }
    }

    fn measured(p95: Option<f64>, rps: f64, err: f64) -> PhaseStats {
        let p = p95.map(|v| Percentiles {
            count: 10,
            mean: v,
            p50: v,
            p90: v,
            p95: v,
            p99: v,
            p99_9: v,
            max: v,
        });
        PhaseStats {
            requests: 10,
            ok: 10,
            errors: 0,
            error_rate: err,
            errors_by_kind: Default::default(),
            seconds: 10.0,
            offered_rps: Some(1.0),
            sent_rps: 1.0,
            achieved_rps: rps,
            achieved_window_s: 10.0,
            output_tokens_per_s: 0.0,
            ttft_ms: p,
            tpot_ms: None,
            e2e_ms: None,
            server_stages_ms: Default::default(),
        }
    }

    #[test]
    fn within_thresholds_passes() {
        let rows = compare(&baseline(), &measured(Some(1400.0), 0.85, 0.01));
        assert!(rows.iter().all(|r| r.ok), "{rows:?}");
        // Exactly at the limits still passes.
        let rows = compare(&baseline(), &measured(Some(1500.0), 0.8, 0.02));
        assert!(rows.iter().all(|r| r.ok), "{rows:?}");
    }

    #[test]
    fn each_regression_is_caught_on_its_own_row() {
        let slow = compare(&baseline(), &measured(Some(1600.0), 1.0, 0.0));
        assert_eq!(
            slow.iter().map(|r| r.ok).collect::<Vec<_>>(),
            [false, true, true]
        );
        let fewer = compare(&baseline(), &measured(Some(900.0), 0.7, 0.0));
        assert_eq!(
            fewer.iter().map(|r| r.ok).collect::<Vec<_>>(),
            [true, false, true]
        );
        let failing = compare(&baseline(), &measured(Some(900.0), 1.0, 0.05));
        assert_eq!(
            failing.iter().map(|r| r.ok).collect::<Vec<_>>(),
            [true, true, false]
        );
        // No successful request: no TTFT, which is a regression too.
        let none = compare(&baseline(), &measured(None, 0.0, 1.0));
        assert!(!none[0].ok);
        assert!(table(&none).contains("REGRESSION"));
        assert!(table(&slow).contains("none") || table(&slow).contains("1600.000"));
    }

    #[test]
    fn the_checked_in_baseline_parses_and_its_load_is_valid() {
        // At run time first: the cached target dir is shared between checkouts.
        let dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
            || env!("CARGO_MANIFEST_DIR").into(),
            std::path::PathBuf::from,
        );
        let path = dir.join("../perf/baseline.json");
        let b = Baseline::read(&path).unwrap();
        assert!(!b.comment.is_empty());
        assert!(b.expected.p95_ttft_ms > 0.0 && b.expected.rps > 0.0);
        let args = crate::commands::gate_run_args(&b, "http://127.0.0.1:1", "q.jsonl", "out");
        assert!(args.is_ok(), "{args:?}");
    }
}
