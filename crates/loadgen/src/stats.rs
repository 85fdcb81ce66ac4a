//! The per-phase summary of a set of request records (percentiles from `measure::stats`).

use std::collections::BTreeMap;

use measure::stats::Percentiles;
use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;

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
            sentences: None,
            sentences_cached: None,
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
