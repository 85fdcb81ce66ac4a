//! The performance gate: a checked-in baseline (the fixed load as `run` flags, the figures it
//! produced, and how far each may drift) compared with a fresh run of the same load. It decides
//! on confidence bounds, not point estimates: a p95 from a dozen requests has an interval wide
//! enough to hold both "fine" and "50% slower", and then the honest answer is "inconclusive:
//! need N more requests", not a pass or a fail on noise.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;
use crate::stats::PhaseStats;
use measure::confidence::{self, Interval};
use measure::stats::percentile;

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

/// What the evidence says about one metric, or about the whole gate.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Beyond the limit at the gate's confidence.
    Regression,
    /// Within the limit at the gate's confidence.
    NoRegression,
    /// The interval straddles the limit: more requests would tell.
    Inconclusive,
}

/// One compared metric.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Row {
    pub metric: String,
    pub baseline: f64,
    pub measured: Option<f64>,
    /// The bound the measured value must respect, e.g. `<= 3000`.
    pub limit: String,
    /// The measured value's interval at the gate's confidence (bootstrap for the percentile,
    /// Poisson for the rate, the Beta posterior for the error rate).
    #[serde(default)]
    pub interval: Option<Interval>,
    /// Error rate: the posterior probability that it is within the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p_within: Option<f64>,
    pub decision: Decision,
    /// Inconclusive: about how many more requests would let the interval clear the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub more_requests: Option<u64>,
    /// False only for a regression (an inconclusive row does not fail the gate on its own).
    pub ok: bool,
}

/// The raw figures a gate decides on: the steady phase's samples, not only their summary.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub ttft_ms: Vec<f64>,
    pub requests: u64,
    pub errors: u64,
    /// Successful completions inside the throughput window, and its length.
    pub completions: u64,
    pub window_s: f64,
}

impl Measured {
    pub fn of(steady: &[&RequestRecord], stats: &PhaseStats) -> Measured {
        Measured {
            ttft_ms: steady
                .iter()
                .filter(|r| r.ok)
                .filter_map(|r| r.ttft_ms)
                .collect(),
            requests: stats.requests,
            errors: stats.errors,
            completions: (stats.achieved_rps * stats.achieved_window_s).round() as u64,
            window_s: stats.achieved_window_s,
        }
    }
}

/// The most extra requests the gate will ever ask for (beyond it: "not within reach").
const MAX_MORE: u64 = 1_000_000;

fn decide(
    metric: &str,
    baseline: f64,
    measured: Option<f64>,
    limit: (f64, bool),
    interval: Option<Interval>,
    n: u64,
) -> Row {
    let (bound, upper) = (limit.0, limit.1);
    let decision = match (measured, interval) {
        (None, _) => Decision::Regression,
        (Some(_), Some(i)) if upper && i.lo > bound => Decision::Regression,
        (Some(_), Some(i)) if upper && i.hi <= bound => Decision::NoRegression,
        (Some(_), Some(i)) if !upper && i.hi < bound => Decision::Regression,
        (Some(_), Some(i)) if !upper && i.lo >= bound => Decision::NoRegression,
        _ => Decision::Inconclusive,
    };
    let more_requests = match (decision, measured, interval) {
        (Decision::Inconclusive, Some(m), Some(i)) => {
            confidence::needed_for(n as usize, i.half_width(), (m - bound).abs())
                .map(|need| need.saturating_sub(n).clamp(1, MAX_MORE))
        }
        _ => None,
    };
    Row {
        metric: metric.into(),
        baseline,
        measured,
        limit: format!("{} {bound:.3}", if upper { "<=" } else { ">=" }),
        interval,
        p_within: None,
        decision,
        more_requests,
        ok: decision != Decision::Regression,
    }
}

/// The error-rate row: the Beta posterior's probability of being within the limit decides.
fn error_row(baseline: f64, limit: f64, errors: u64, n: u64, conf: f64) -> Row {
    let p = confidence::error_rate_at_most(limit, errors, n);
    let decision = if p >= conf {
        Decision::NoRegression
    } else if p <= 1.0 - conf {
        Decision::Regression
    } else {
        Decision::Inconclusive
    };
    // Credible interval of the rate: the posterior's quantiles, found by bisection.
    let quantile = |target: f64| {
        let (mut lo, mut hi) = (0.0, 1.0);
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            if confidence::error_rate_at_most(mid, errors, n) < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (lo + hi) / 2.0
    };
    let a = (1.0 - conf) / 2.0;
    // More requests at the same observed rate until the posterior decides (doubling).
    let more_requests = (decision == Decision::Inconclusive)
        .then(|| {
            let rate = errors as f64 / n.max(1) as f64;
            let mut m = n.max(1);
            while m - n < MAX_MORE {
                m *= 2;
                let e = (rate * m as f64).round() as u64;
                let p = confidence::error_rate_at_most(limit, e, m);
                if p >= conf || p <= 1.0 - conf {
                    return Some(m - n);
                }
            }
            None
        })
        .flatten();
    Row {
        metric: "error rate".into(),
        baseline,
        measured: Some(if n == 0 {
            0.0
        } else {
            errors as f64 / n as f64
        }),
        limit: format!("<= {limit:.3}"),
        interval: Some(Interval {
            lo: quantile(a),
            hi: quantile(1.0 - a),
        }),
        p_within: Some(p),
        decision,
        more_requests,
        ok: decision != Decision::Regression,
    }
}

/// Compares a run with the baseline's limits at confidence `conf` (e.g. 0.95).
pub fn compare(b: &Baseline, m: &Measured, conf: f64) -> Vec<Row> {
    let t = &b.thresholds;
    let e = &b.expected;
    let mut sorted = m.ttft_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let ttft = (!sorted.is_empty()).then(|| percentile(&sorted, 0.95));
    // The wider of the bootstrap and the order-statistic interval: the bootstrap alone never
    // reaches past the largest sample, and would call a p95 of a dozen requests "sure".
    let ttft_ci = ttft.map(|_| {
        let boot = confidence::quantile_intervals(
            &sorted,
            &[0.95],
            confidence::RESAMPLES,
            conf,
            confidence::SEED,
        )[0];
        let order = confidence::order_statistic_interval(&sorted, 0.95, conf);
        Interval {
            lo: boot.lo.min(order.lo),
            hi: boot.hi.max(order.hi),
        }
    });
    // Completions in the window as a Poisson count: rate ± z·√k / T.
    let window = m.window_s.max(1e-9);
    let rps = m.completions as f64 / window;
    let z = confidence::normal_quantile(1.0 - (1.0 - conf) / 2.0);
    let spread = z * (m.completions.max(1) as f64).sqrt() / window;
    let rps_ci = Interval {
        lo: (rps - spread).max(0.0),
        hi: rps + spread,
    };
    let ttft_limit = e.p95_ttft_ms * t.p95_ttft_max_ratio;
    let mut ttft_row = decide(
        "p95 TTFT (ms)",
        e.p95_ttft_ms,
        ttft,
        (ttft_limit, true),
        ttft_ci,
        sorted.len() as u64,
    );
    if let (Decision::Inconclusive, Some(m), Some(i)) = (ttft_row.decision, ttft, ttft_ci) {
        if i.hi.is_infinite() {
            // Too few requests for any upper bound: at least enough for one (0.95^n ≤ α/2),
            // and enough for the lower side's width to clear the limit.
            let n = sorted.len() as u64;
            let floor = ((1.0 - conf) / 2.0).ln() / 0.95f64.ln();
            let by_width =
                confidence::needed_for(n as usize, m - i.lo, (m - ttft_limit).abs()).unwrap_or(0);
            ttft_row.more_requests = Some(
                (floor.ceil() as u64)
                    .max(by_width)
                    .saturating_sub(n)
                    .clamp(1, MAX_MORE),
            );
        }
    }
    vec![
        ttft_row,
        decide(
            "achieved rps",
            e.rps,
            Some(rps),
            (e.rps * t.rps_min_ratio, false),
            Some(rps_ci),
            m.completions,
        ),
        error_row(
            e.error_rate,
            e.error_rate + t.error_rate_max_increase,
            m.errors,
            m.requests,
            conf,
        ),
    ]
}

/// The gate's verdict over its rows: any regression, else inconclusive if any row is, with the
/// most extra requests any row asks for.
pub fn verdict(rows: &[Row]) -> (Decision, Option<u64>) {
    if rows.iter().any(|r| r.decision == Decision::Regression) {
        return (Decision::Regression, None);
    }
    let more = rows.iter().filter_map(|r| r.more_requests).max();
    if rows.iter().any(|r| r.decision == Decision::Inconclusive) {
        (Decision::Inconclusive, more)
    } else {
        (Decision::NoRegression, None)
    }
}

/// The verdict in words, as printed and shown in the report.
pub fn verdict_text(rows: &[Row]) -> String {
    match verdict(rows) {
        (Decision::Regression, _) => "regression".into(),
        (Decision::NoRegression, _) => "no regression".into(),
        (Decision::Inconclusive, Some(n)) => format!("inconclusive: need {n} more requests"),
        (Decision::Inconclusive, None) => "inconclusive: the estimate sits on the limit".into(),
    }
}

/// The comparison as a fixed-width table.
pub fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<16} {:>12} {:>12} {:>25} {:>14}  {}\n",
        "metric", "baseline", "measured", "interval", "limit", "decision"
    );
    for r in rows {
        let measured = r.measured.map_or("none".to_string(), |v| format!("{v:.3}"));
        let interval = r
            .interval
            .map_or("–".to_string(), |i| format!("[{:.3}, {:.3}]", i.lo, i.hi));
        let decision = match (r.decision, r.more_requests) {
            (Decision::Regression, _) => "REGRESSION".to_string(),
            (Decision::NoRegression, _) => "no regression".to_string(),
            (Decision::Inconclusive, Some(n)) => format!("inconclusive (+{n} requests)"),
            (Decision::Inconclusive, None) => "inconclusive".to_string(),
        };
        s.push_str(&format!(
            "{:<16} {:>12.3} {:>12} {:>25} {:>14}  {}\n",
            r.metric, r.baseline, measured, interval, r.limit, decision
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

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
                p95_ttft_max_ratio: 1.2,
                rps_min_ratio: 0.8,
                error_rate_max_increase: 0.02,
            },
        }
    }

    /// A synthetic run: `n` log-normal TTFTs whose p95 is `p95` ms, `errors` failures, and
    /// completions at `rps` over the run.
    fn run(seed: u64, n: usize, p95: f64, errors: u64, rps: f64) -> Measured {
        let mut rng = StdRng::seed_from_u64(seed);
        let sigma = 0.4;
        let median = p95 / (sigma * 1.644_854f64).exp();
        let ttft_ms = (0..n)
            .map(|_| {
                let (u1, u2): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                median * (sigma * z).exp()
            })
            .collect();
        let requests = n as u64 + errors;
        Measured {
            ttft_ms,
            requests,
            errors,
            completions: n as u64,
            window_s: n as f64 / rps,
        }
    }

    fn decisions(rows: &[Row]) -> Vec<Decision> {
        rows.iter().map(|r| r.decision).collect()
    }

    #[test]
    fn a_large_run_without_a_regression_passes_every_row() {
        // Same distribution as the baseline: p95 1000 against a limit of 1200.
        let rows = compare(&baseline(), &run(1, 600, 1000.0, 0, 1.0), 0.95);
        use Decision::*;
        assert_eq!(
            decisions(&rows),
            [NoRegression, NoRegression, NoRegression],
            "{}",
            table(&rows)
        );
        assert_eq!(verdict(&rows), (NoRegression, None));
        let i = rows[0].interval.unwrap();
        assert!(i.lo < rows[0].measured.unwrap() && rows[0].measured.unwrap() < i.hi);
    }

    #[test]
    fn an_injected_regression_is_caught_on_its_own_row() {
        use Decision::*;
        // p95 +60%: well past the 1.2× limit.
        let slow = compare(&baseline(), &run(2, 600, 1600.0, 0, 1.0), 0.95);
        assert_eq!(
            decisions(&slow),
            [Regression, NoRegression, NoRegression],
            "{}",
            table(&slow)
        );
        assert_eq!(verdict_text(&slow), "regression");
        // Throughput halved.
        let fewer = compare(&baseline(), &run(3, 600, 1000.0, 0, 0.5), 0.95);
        assert_eq!(decisions(&fewer)[1], Regression, "{}", table(&fewer));
        // 8% errors against a limit of 2%.
        let failing = compare(&baseline(), &run(4, 600, 1000.0, 50, 1.0), 0.95);
        assert_eq!(decisions(&failing)[2], Regression, "{}", table(&failing));
        assert!(failing[2].p_within.unwrap() < 0.05);
        // No successful request at all.
        let none = compare(&baseline(), &run(5, 0, 1000.0, 10, 1.0), 0.95);
        assert_eq!(none[0].decision, Regression);
        assert!(table(&none).contains("REGRESSION"));
    }

    #[test]
    fn a_small_run_is_inconclusive_and_says_how_many_more_requests() {
        use Decision::*;
        // 12 requests (the size of the checked-in baseline's load), p95 +10%, no errors:
        // neither a pass nor a fail is honest.
        let rows = compare(&baseline(), &run(6, 12, 1100.0, 0, 1.0), 0.95);
        assert_eq!(rows[0].decision, Inconclusive, "{}", table(&rows));
        assert_eq!(rows[2].decision, Inconclusive, "{}", table(&rows));
        let (v, more) = verdict(&rows);
        assert_eq!(v, Inconclusive);
        assert!(more.unwrap() > 12, "{rows:?}");
        assert!(verdict_text(&rows).starts_with("inconclusive: need "));
        assert!(rows.iter().all(|r| r.ok), "inconclusive does not fail");
        // The same shift measured on many more requests decides.
        let rows = compare(&baseline(), &run(6, 3000, 1100.0, 0, 1.0), 0.95);
        assert_eq!(rows[0].decision, NoRegression, "{}", table(&rows));
        // A higher confidence asks for more evidence from the same run.
        let mid = run(7, 150, 1120.0, 0, 1.0);
        let loose = compare(&baseline(), &mid, 0.5);
        let strict = compare(&baseline(), &mid, 0.999);
        assert_eq!(loose[0].decision, NoRegression, "{}", table(&loose));
        assert_eq!(strict[0].decision, Inconclusive, "{}", table(&strict));
    }
    #[test]
    fn the_checked_in_baseline_parses_and_its_load_is_valid() {
        // At run time first: the cached target dir is shared between checkouts.
        let dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
            || env!("CARGO_MANIFEST_DIR").into(),
            std::path::PathBuf::from,
        );
        let path = dir.join("../../perf/baseline.json");
        let b = Baseline::read(&path).unwrap();
        assert!(!b.comment.is_empty());
        assert!(b.expected.p95_ttft_ms > 0.0 && b.expected.rps > 0.0);
        let args = crate::commands::gate_run_args(&b, "http://127.0.0.1:1", "q.jsonl", "out");
        assert!(args.is_ok(), "{args:?}");
    }
}
