//! Percentiles and the per-phase summary of a set of request records. The one percentile of the
//! workspace: the server's trace attribution and its bench table use it too.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::confidence::{self, Interval};
use crate::record::RequestRecord;

/// The `q` quantile (0..=1) of sorted values, interpolating linearly between closest ranks;
/// NaN for no values, so that an empty set reads as "no figure" rather than a zero.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    #[serde(rename = "p99.9")]
    pub p99_9: f64,
    pub max: f64,
    /// Bootstrap intervals of the percentiles ([`confidence::CONFIDENCE`], seeded).
    #[serde(default)]
    pub ci: PercentileIntervals,
}

/// The confidence interval of each percentile of a [`Percentiles`].
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct PercentileIntervals {
    pub p50: Interval,
    pub p90: Interval,
    pub p95: Interval,
    pub p99: Interval,
    #[serde(rename = "p99.9")]
    pub p99_9: Interval,
}

/// The tail percentiles a summary checks for thin support.
pub const TAILS: [(&str, f64); 2] = [("p99", 0.99), ("p99.9", 0.999)];

impl Percentiles {
    /// The tail percentiles (`p99`, `p99.9`) resting on fewer than
    /// [`confidence::MIN_TAIL_SAMPLES`] samples beyond them, with that number.
    pub fn thin_tails(&self) -> Vec<(&'static str, f64)> {
        TAILS
            .iter()
            .map(|&(name, q)| (name, confidence::samples_beyond(self.count, q)))
            .filter(|&(_, beyond)| beyond < confidence::MIN_TAIL_SAMPLES)
            .collect()
    }

    /// `None` for no values; NaNs are ignored.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Percentiles> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let qs = [0.50, 0.90, 0.95, 0.99, 0.999];
        let ci = confidence::quantile_intervals(
            &v,
            &qs,
            confidence::RESAMPLES,
            confidence::CONFIDENCE,
            confidence::SEED,
        );
        Some(Percentiles {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 0.50),
            p90: percentile(&v, 0.90),
            p95: percentile(&v, 0.95),
            p99: percentile(&v, 0.99),
            p99_9: percentile(&v, 0.999),
            max: v[v.len() - 1],
            ci: PercentileIntervals {
                p50: ci[0],
                p90: ci[1],
                p95: ci[2],
                p99: ci[3],
                p99_9: ci[4],
            },
        })
    }
}

/// Successful requests that completed within `[from, to]` seconds, whatever phase sent them.
pub fn completions_in(records: &[RequestRecord], from: f64, to: f64) -> u64 {
    records
        .iter()
        .filter(|r| r.ok && r.done_s >= from && r.done_s <= to)
        .count() as u64
}

/// The summary of one phase (or one knee step) of a load.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PhaseStats {
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    pub error_rate: f64,
    /// Error kind → count: `http_<status>`, `timeout`, `connect`, `request`, `stream`, `dropped`.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Seconds the phase lasted (what the rates divide by).
    pub seconds: f64,
    /// Open loop: the rate the schedule offered. Closed loop: none.
    pub offered_rps: Option<f64>,
    /// Requests sent per second.
    pub sent_rps: f64,
    /// Successful responses per second, counted by completion time over `achieved_window_s`
    /// (see [`crate::runner::Ran::throughput`]).
    pub achieved_rps: f64,
    pub achieved_window_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Option<Percentiles>,
    pub tpot_ms: Option<Percentiles>,
    pub e2e_ms: Option<Percentiles>,
    /// The server's own stage timings (from `done` events) of the successful requests.
    pub server_stages_ms: BTreeMap<String, Percentiles>,
}

impl PhaseStats {
    /// Replaces the achieved rate with `ok` completions over `window_s` seconds.
    pub fn with_throughput(mut self, (ok, window_s): (u64, f64)) -> PhaseStats {
        self.achieved_rps = if window_s > 0.0 {
            ok as f64 / window_s
        } else {
            0.0
        };
        self.achieved_window_s = window_s;
        self
    }

    pub fn of(records: &[&RequestRecord], seconds: f64, offered_rps: Option<f64>) -> PhaseStats {
        let requests = records.len() as u64;
        let ok: Vec<&&RequestRecord> = records.iter().filter(|r| r.ok).collect();
        let mut errors_by_kind = BTreeMap::new();
        for r in records.iter().filter(|r| !r.ok) {
            let kind = r.error.clone().unwrap_or_else(|| "unknown".into());
            *errors_by_kind.entry(kind).or_insert(0) += 1;
        }
        let errors = requests - ok.len() as u64;
        let per_s = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
        let mut stages: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for r in &ok {
            for (k, v) in r.server_timings.iter().flatten() {
                stages.entry(k.clone()).or_default().push(*v);
            }
        }
        PhaseStats {
            requests,
            ok: ok.len() as u64,
            errors,
            error_rate: if requests == 0 {
                0.0
            } else {
                errors as f64 / requests as f64
            },
            errors_by_kind,
            seconds,
            offered_rps,
            sent_rps: per_s(requests as f64),
            achieved_rps: per_s(ok.len() as f64),
            achieved_window_s: seconds,
            output_tokens_per_s: per_s(ok.iter().map(|r| r.tokens as f64).sum()),
            ttft_ms: Percentiles::of(ok.iter().filter_map(|r| r.ttft_ms)),
            tpot_ms: Percentiles::of(ok.iter().filter_map(|r| r.tpot_ms)),
            e2e_ms: Percentiles::of(ok.iter().filter_map(|r| r.e2e_ms)),
            server_stages_ms: stages
                .into_iter()
                .filter_map(|(k, v)| Some((k, Percentiles::of(v)?)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Phase;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert!((percentile(&v, 0.5) - 50.5).abs() < 1e-9);
        assert!((percentile(&v, 0.95) - 95.05).abs() < 1e-9);
        assert!((percentile(&v, 0.99) - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&[7.0], 0.999), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
        let p = Percentiles::of([3.0, 1.0, 2.0, f64::NAN]).unwrap();
        assert_eq!(p.count, 3);
        assert_eq!(p.p50, 2.0);
        assert_eq!(p.mean, 2.0);
        assert_eq!(p.max, 3.0);
        assert!(p.p99_9 <= 3.0 && p.p99_9 > 2.99);
        assert!(Percentiles::of([]).is_none());
        let json = serde_json::to_value(p).unwrap();
        assert!(json.get("p99.9").is_some());
        assert!(json["ci"].get("p99.9").is_some());
        // Three samples: the median's interval spans them, and both tails are thin.
        assert!(p.ci.p50.lo >= 1.0 && p.ci.p50.hi <= 3.0 && p.ci.p50.lo < p.ci.p50.hi);
        assert_eq!(p.thin_tails().len(), 2);
        let many = Percentiles::of((0..2000).map(f64::from)).unwrap();
        let thin = many.thin_tails();
        assert_eq!(thin.len(), 1);
        assert_eq!(thin[0].0, "p99.9");
        assert!((thin[0].1 - 2.0).abs() < 1e-9);
        assert!(many.ci.p99.lo < many.p99 && many.p99 < many.ci.p99.hi);
    }

    fn rec(ok: bool, error: Option<&str>, ttft: f64) -> RequestRecord {
        RequestRecord {
            id: 0,
            phase: Phase::Steady,
            step: None,
            offered_rps: None,
            user: None,
            scheduled_s: None,
            sent_s: 0.0,
            done_s: 1.0,
            sent_unix_ms: 0,
            query_rank: 0,
            top_k: None,
            rerank_top_n: None,
            trace_id: String::new(),
            ok,
            status: Some(200),
            error: error.map(str::to_string),
            error_detail: None,
            ttft_ms: ok.then_some(ttft),
            tpot_ms: None,
            e2e_ms: ok.then_some(ttft * 2.0),
            tokens: 4,
            prompt_tokens: None,
            server_timings: ok.then(|| [("embed_ms".to_string(), ttft / 10.0)].into()),
            query: None,
            filter: None,
            query_kind: None,
            perturbation: None,
            embedding_cached: None,
            cached_tokens: None,
            retried: false,
        }
    }

    #[test]
    fn phase_stats_count_errors_by_kind_and_rates() {
        let rs = [
            rec(true, None, 100.0),
            rec(true, None, 300.0),
            rec(false, Some("http_429"), 0.0),
            rec(false, Some("http_429"), 0.0),
            rec(false, Some("timeout"), 0.0),
        ];
        let refs: Vec<&RequestRecord> = rs.iter().collect();
        let s = PhaseStats::of(&refs, 10.0, Some(0.5));
        assert_eq!(s.requests, 5);
        assert_eq!(s.ok, 2);
        assert_eq!(s.errors, 3);
        assert!((s.error_rate - 0.6).abs() < 1e-12);
        assert_eq!(s.errors_by_kind["http_429"], 2);
        assert_eq!(s.errors_by_kind["timeout"], 1);
        assert!((s.sent_rps - 0.5).abs() < 1e-12);
        assert!((s.achieved_rps - 0.2).abs() < 1e-12);
        assert!((s.output_tokens_per_s - 0.8).abs() < 1e-12);
        assert_eq!(s.ttft_ms.unwrap().p50, 200.0);
        assert_eq!(s.server_stages_ms["embed_ms"].count, 2);
        // Throughput counts successful completions inside the window only.
        let mut late = rec(true, None, 5.0);
        late.done_s = 20.0;
        let all = [rs[0].clone(), rs[1].clone(), rs[2].clone(), late];
        assert_eq!(completions_in(&all, 0.0, 10.0), 2);
        assert_eq!(completions_in(&all, 0.0, 30.0), 3);
        assert_eq!(completions_in(&all, 1.5, 30.0), 1);
        let t = s.with_throughput((3, 30.0));
        assert!((t.achieved_rps - 0.1).abs() < 1e-12);
        assert_eq!(t.achieved_window_s, 30.0);
    }
}
