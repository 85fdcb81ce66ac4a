//! The knee: the offered rate past which p95 TTFT or the error rate breaks its threshold. The finder
//! steps the open-loop rate up (geometric or linear), summarises each step, and stops at the first
//! step that fails; the one before it is the last good rate.

use serde::{Deserialize, Serialize};

use crate::stats::PhaseStats;

/// The figures of one step that the knee is judged on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepResult {
    pub step: usize,
    pub offered_rps: f64,
    pub achieved_rps: f64,
    pub requests: u64,
    pub error_rate: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub e2e_p95_ms: Option<f64>,
    /// Why the step failed, when it did.
    pub failed: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Thresholds {
    pub max_p95_ttft_ms: f64,
    pub max_error_rate: f64,
}

impl StepResult {
    pub fn judge(step: usize, offered_rps: f64, s: &PhaseStats, th: &Thresholds) -> StepResult {
        let mut r = StepResult {
            step,
            offered_rps,
            achieved_rps: s.achieved_rps,
            requests: s.requests,
            error_rate: s.error_rate,
            ttft_p50_ms: s.ttft_ms.map(|p| p.p50),
            ttft_p95_ms: s.ttft_ms.map(|p| p.p95),
            e2e_p95_ms: s.e2e_ms.map(|p| p.p95),
            failed: None,
        };
        r.failed = failure(&r, th);
        r
    }
}

/// Why a step breaks a threshold, or `None` when it passes. A step with requests but no successful
/// one fails (it has no TTFT to judge); a step with no requests at all passes (nothing broke).
pub fn failure(r: &StepResult, th: &Thresholds) -> Option<String> {
    if r.error_rate > th.max_error_rate {
        return Some(format!(
            "error rate {:.1}% > {:.1}%",
            r.error_rate * 100.0,
            th.max_error_rate * 100.0
        ));
    }
    match r.ttft_p95_ms {
        Some(p95) if p95 > th.max_p95_ttft_ms => Some(format!(
            "p95 TTFT {p95:.0} ms > {:.0} ms",
            th.max_p95_ttft_ms
        )),
        None if r.requests > 0 => Some("no successful request".into()),
        _ => None,
    }
}

/// The outcome of the search.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Knee {
    pub found: bool,
    /// The highest offered rate whose step passed (all steps before it passed too).
    pub last_good_rps: Option<f64>,
    /// What that step achieved.
    pub last_good_achieved_rps: Option<f64>,
    /// The offered rate of the first failing step.
    pub knee_rps: Option<f64>,
    pub reason: String,
    pub thresholds: Thresholds,
}

/// The knee of a sequence of steps, in the order they ran.
pub fn find_knee(steps: &[StepResult], th: &Thresholds) -> Knee {
    let first_bad = steps.iter().position(|s| failure(s, th).is_some());
    let good = &steps[..first_bad.unwrap_or(steps.len())];
    let last_good = good.last();
    let (found, knee_rps, reason) = match first_bad {
        Some(i) => (
            true,
            Some(steps[i].offered_rps),
            format!(
                "step {} at {:.3} rps: {}",
                steps[i].step,
                steps[i].offered_rps,
                failure(&steps[i], th).unwrap_or_default()
            ),
        ),
        None => (
            false,
            None,
            "no step broke a threshold: raise --max-steps or --max-rate".into(),
        ),
    };
    Knee {
        found,
        last_good_rps: last_good.map(|s| s.offered_rps),
        last_good_achieved_rps: last_good.map(|s| s.achieved_rps),
        knee_rps,
        reason,
        thresholds: *th,
    }
}

/// Offered rate of step `i`: `start · factor^i`, or `start + i · add` when stepping linearly.
pub fn step_rate(start: f64, factor: f64, add: Option<f64>, i: usize) -> f64 {
    match add {
        Some(a) => start + a * i as f64,
        None => start * factor.powi(i as i32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TH: Thresholds = Thresholds {
        max_p95_ttft_ms: 1000.0,
        max_error_rate: 0.05,
    };

    fn step(i: usize, rps: f64, p95: Option<f64>, err: f64) -> StepResult {
        StepResult {
            step: i,
            offered_rps: rps,
            achieved_rps: rps * 0.9,
            requests: 10,
            error_rate: err,
            ttft_p50_ms: p95.map(|p| p / 2.0),
            ttft_p95_ms: p95,
            e2e_p95_ms: p95,
            failed: None,
        }
    }

    #[test]
    fn knee_is_the_first_step_past_the_latency_threshold() {
        let steps = [
            step(0, 0.5, Some(300.0), 0.0),
            step(1, 1.0, Some(450.0), 0.0),
            step(2, 2.0, Some(1500.0), 0.0),
            // A later good step does not undo the knee.
            step(3, 4.0, Some(200.0), 0.0),
        ];
        let k = find_knee(&steps, &TH);
        assert!(k.found);
        assert_eq!(k.last_good_rps, Some(1.0));
        assert_eq!(k.last_good_achieved_rps, Some(0.9));
        assert_eq!(k.knee_rps, Some(2.0));
        assert!(k.reason.contains("p95 TTFT"), "{}", k.reason);
    }

    #[test]
    fn errors_alone_make_a_knee() {
        let steps = [
            step(0, 1.0, Some(100.0), 0.0),
            step(1, 2.0, Some(100.0), 0.2),
        ];
        let k = find_knee(&steps, &TH);
        assert_eq!(k.knee_rps, Some(2.0));
        assert!(k.reason.contains("error rate"));
        // At the threshold exactly is still good.
        let edge = [step(0, 1.0, Some(1000.0), 0.05)];
        assert!(!find_knee(&edge, &TH).found);
    }

    #[test]
    fn first_step_failing_has_no_last_good_and_no_knee_when_all_pass() {
        let k = find_knee(&[step(0, 5.0, None, 0.0)], &TH);
        assert!(k.found);
        assert_eq!(k.last_good_rps, None);
        assert_eq!(k.knee_rps, Some(5.0));
        assert!(k.reason.contains("no successful request"));
        let all = [
            step(0, 1.0, Some(10.0), 0.0),
            step(1, 2.0, Some(20.0), 0.01),
        ];
        let k = find_knee(&all, &TH);
        assert!(!k.found);
        assert_eq!(k.last_good_rps, Some(2.0));
        assert_eq!(k.knee_rps, None);
        assert!(!find_knee(&[], &TH).found);
    }

    #[test]
    fn step_rates_grow_geometrically_or_linearly() {
        assert_eq!(step_rate(0.25, 2.0, None, 0), 0.25);
        assert_eq!(step_rate(0.25, 2.0, None, 3), 2.0);
        assert_eq!(step_rate(0.5, 2.0, Some(0.25), 4), 1.5);
    }
}
