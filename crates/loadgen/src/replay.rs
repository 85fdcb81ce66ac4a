//! `run --replay requests.jsonl`: a recorded run sent again with its own timing. Each request
//! that was sent goes out at its recorded offset from the first one (so the inter-arrival gaps,
//! bursts and a closed loop's think times come back as they were), with the recorded question,
//! filter, context sizes and phase. Requests the recording dropped (never sent) are skipped.

use std::path::Path;

use anyhow::bail;

use crate::mix::Drawn;
use crate::record::{QueryKind, RequestRecord};
use crate::schedule::Phase;

/// One request to send again.
#[derive(Debug, Clone, PartialEq)]
pub struct Replayed {
    /// Seconds after the replay starts.
    pub at_s: f64,
    pub phase: Phase,
    pub rank: usize,
    pub top_k: Option<usize>,
    pub rerank_top_n: Option<usize>,
    pub drawn: Drawn,
}

/// The replay schedule of `records`: sent ones only, in order of their send time, offsets
/// from the first. A record without its question (written before questions were recorded)
/// takes `queries[query_rank]`.
pub fn schedule(records: &[RequestRecord], queries: &[String]) -> anyhow::Result<Vec<Replayed>> {
    let mut sent: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| r.error.as_deref() != Some("dropped"))
        .collect();
    if sent.is_empty() {
        bail!("the recording holds no request that was sent");
    }
    sent.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s).then(a.id.cmp(&b.id)));
    let first = sent[0].sent_s;
    sent.into_iter()
        .map(|r| {
            let query = match &r.query {
                Some(q) => q.clone(),
                None => match queries.get(r.query_rank) {
                    Some(q) => q.clone(),
                    None => bail!(
                        "request {}: no recorded question and rank {} is beyond the query set ({} questions)",
                        r.id,
                        r.query_rank,
                        queries.len()
                    ),
                },
            };
            Ok(Replayed {
                at_s: r.sent_s - first,
                phase: r.phase,
                rank: r.query_rank,
                top_k: r.top_k,
                rerank_top_n: r.rerank_top_n,
                drawn: Drawn {
                    query,
                    kind: r.query_kind.unwrap_or(QueryKind::Hot),
                    filter: r.filter.clone(),
                    perturbation: r.perturbation.clone(),
                },
            })
        })
        .collect()
}

/// Reads a recording and makes its schedule.
pub fn load(path: &Path, queries: &[String]) -> anyhow::Result<Vec<Replayed>> {
    schedule(&crate::record::read_jsonl(path)?, queries)
}

/// The steady window of a replay, in seconds after its start: from the first steady request's
/// offset to the last one's (the whole replay when none is marked steady).
pub fn steady_window(items: &[Replayed]) -> (f64, f64) {
    let steady: Vec<f64> = items
        .iter()
        .filter(|i| i.phase == Phase::Steady)
        .map(|i| i.at_s)
        .collect();
    let all: Vec<f64> = items.iter().map(|i| i.at_s).collect();
    let pick = if steady.is_empty() { &all } else { &steady };
    let lo = pick.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = pick.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if lo.is_finite() {
        (lo, hi)
    } else {
        (0.0, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caches::tests::rec;

    fn at(id: u64, sent_s: f64, phase: Phase) -> RequestRecord {
        let mut r = rec(id, 10.0, true, 0, QueryKind::Hot);
        r.sent_s = sent_s;
        r.phase = phase;
        r.query = Some(format!("question {id}"));
        r.query_rank = id as usize;
        r
    }

    #[test]
    fn offsets_keep_the_recorded_gaps_in_send_order() {
        // Written in id order, sent out of it (closed-loop users interleave).
        let rs = vec![
            at(0, 10.0, Phase::Warmup),
            at(2, 10.25, Phase::Steady),
            at(1, 12.5, Phase::Steady),
            at(3, 13.0, Phase::Steady),
            at(4, 20.0, Phase::Cooldown),
        ];
        let s = schedule(&rs, &[]).unwrap();
        let offsets: Vec<f64> = s.iter().map(|i| i.at_s).collect();
        assert_eq!(offsets, vec![0.0, 0.25, 2.5, 3.0, 10.0]);
        let qs: Vec<&str> = s.iter().map(|i| i.drawn.query.as_str()).collect();
        assert_eq!(
            qs,
            [
                "question 0",
                "question 2",
                "question 1",
                "question 3",
                "question 4"
            ]
        );
        assert_eq!(steady_window(&s), (0.25, 3.0));
        // Inter-arrival gaps are the recorded ones.
        let gaps: Vec<f64> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(gaps, vec![0.25, 2.25, 0.5, 7.0]);
    }

    #[test]
    fn dropped_requests_are_skipped_and_missing_questions_come_from_the_set() {
        let mut rs = vec![at(0, 5.0, Phase::Steady), at(1, 6.0, Phase::Steady)];
        rs[0].error = Some("dropped".into());
        rs[1].query = None;
        rs[1].filter = Some(serde_json::json!({"doc_id": "a"}));
        rs[1].perturbation = Some("template:1".into());
        let queries = vec!["zero".to_string(), "one".to_string()];
        let s = schedule(&rs, &queries).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].at_s, 0.0);
        assert_eq!(s[0].drawn.query, "one");
        assert_eq!(s[0].drawn.filter.as_ref().unwrap()["doc_id"], "a");
        assert_eq!(s[0].drawn.perturbation.as_deref(), Some("template:1"));
        assert!(schedule(&rs, &queries[..1]).is_err());
        assert!(schedule(&rs[..1], &queries).is_err());
    }
}
