//! `--shadow URL`: the primary's requests mirrored to a second server (a candidate build or
//! configuration), compared stage by stage. Each mirrored request has the primary's id, so the
//! comparison pairs them: per stage (the server's `done` timings) and for TTFT and end to end,
//! both sides' percentiles and the median of the paired differences (shadow minus primary).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;
use measure::stats::{percentile, Percentiles};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ShadowRow {
    /// A server stage (`embed_ms`, …) or the client's `ttft_ms` / `e2e_ms`.
    pub stage: String,
    pub primary: Option<Percentiles>,
    pub shadow: Option<Percentiles>,
    /// Median over requests both answered of shadow minus primary, milliseconds.
    pub median_paired_diff_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ShadowReport {
    pub url: String,
    pub mirrored: usize,
    pub shadow_ok: usize,
    /// Requests both servers answered.
    pub paired: usize,
    pub shadow_errors_by_kind: BTreeMap<String, u64>,
    pub rows: Vec<ShadowRow>,
}

type Metric = fn(&RequestRecord) -> Option<f64>;

impl ShadowReport {
    /// Pairs `primary` and `shadow` by request id (steady and otherwise alike: the shadow has
    /// no phases of its own).
    pub fn of(url: &str, primary: &[RequestRecord], shadow: &[RequestRecord]) -> ShadowReport {
        let by_id: BTreeMap<u64, &RequestRecord> = primary.iter().map(|r| (r.id, r)).collect();
        let pairs: Vec<(&RequestRecord, &RequestRecord)> = shadow
            .iter()
            .filter(|s| s.ok)
            .filter_map(|s| Some((*by_id.get(&s.id)?, s)))
            .filter(|(p, _)| p.ok)
            .collect();
        let mut stages: BTreeSet<String> = BTreeSet::new();
        for (p, s) in &pairs {
            for t in [&p.server_timings, &s.server_timings].into_iter().flatten() {
                stages.extend(t.keys().filter(|k| *k != "ttft_ms").cloned());
            }
        }
        let mut rows = vec![
            compare("ttft_ms (client)", &pairs, |r| r.ttft_ms),
            compare("e2e_ms (client)", &pairs, |r| r.e2e_ms),
        ];
        for stage in stages {
            let pick =
                |r: &RequestRecord, stage: &str| r.server_timings.as_ref()?.get(stage).copied();
            let p: Vec<f64> = pairs.iter().filter_map(|(p, _)| pick(p, &stage)).collect();
            let s: Vec<f64> = pairs.iter().filter_map(|(_, s)| pick(s, &stage)).collect();
            let mut d: Vec<f64> = pairs
                .iter()
                .filter_map(|(p, s)| Some(pick(s, &stage)? - pick(p, &stage)?))
                .collect();
            d.sort_by(f64::total_cmp);
            rows.push(ShadowRow {
                stage,
                primary: Percentiles::of(p),
                shadow: Percentiles::of(s),
                median_paired_diff_ms: (!d.is_empty()).then(|| percentile(&d, 0.5)),
            });
        }
        let mut errors = BTreeMap::new();
        for e in shadow.iter().filter_map(|r| r.error.clone()) {
            *errors.entry(e).or_insert(0) += 1;
        }
        ShadowReport {
            url: url.into(),
            mirrored: shadow.len(),
            shadow_ok: shadow.iter().filter(|r| r.ok).count(),
            paired: pairs.len(),
            shadow_errors_by_kind: errors,
            rows,
        }
    }

    pub fn table(&self) -> String {
        let mut s = format!(
            "shadow {}: {} mirrored, {} ok, {} paired with the primary; errors {:?}\n{:<18} {:>22} {:>22} {:>16}\n",
            self.url,
            self.mirrored,
            self.shadow_ok,
            self.paired,
            self.shadow_errors_by_kind,
            "ms",
            "primary p50 / p95",
            "shadow p50 / p95",
            "paired Δ median"
        );
        let pp = |p: &Option<Percentiles>| {
            p.map_or("–".into(), |p| format!("{:.1} / {:.1}", p.p50, p.p95))
        };
        for r in &self.rows {
            s.push_str(&format!(
                "{:<18} {:>22} {:>22} {:>16}\n",
                r.stage,
                pp(&r.primary),
                pp(&r.shadow),
                r.median_paired_diff_ms
                    .map_or("–".into(), |d| format!("{d:+.1}"))
            ));
        }
        s
    }
}

fn compare(name: &str, pairs: &[(&RequestRecord, &RequestRecord)], metric: Metric) -> ShadowRow {
    let mut d: Vec<f64> = pairs
        .iter()
        .filter_map(|(p, s)| Some(metric(s)? - metric(p)?))
        .collect();
    d.sort_by(f64::total_cmp);
    ShadowRow {
        stage: name.into(),
        primary: Percentiles::of(pairs.iter().filter_map(|(p, _)| metric(p))),
        shadow: Percentiles::of(pairs.iter().filter_map(|(_, s)| metric(s))),
        median_paired_diff_ms: (!d.is_empty()).then(|| percentile(&d, 0.5)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caches::tests::rec;
    use crate::record::QueryKind;

    #[test]
    fn stages_are_paired_by_request_and_the_slower_stage_shows() {
        let primary: Vec<RequestRecord> = (0..50)
            .map(|i| rec(i, 100.0, true, 390, QueryKind::Hot))
            .collect();
        let mut shadow = primary.clone();
        for s in &mut shadow {
            // The candidate's rerank is 30 ms slower, everything else the same.
            *s.server_timings
                .as_mut()
                .unwrap()
                .get_mut("rerank_ms")
                .unwrap() += 30.0;
            s.ttft_ms = s.ttft_ms.map(|t| t + 30.0);
        }
        shadow[3].ok = false;
        shadow[3].error = Some("http_503".into());
        let r = ShadowReport::of("http://b", &primary, &shadow);
        assert_eq!((r.mirrored, r.shadow_ok, r.paired), (50, 49, 49));
        assert_eq!(r.shadow_errors_by_kind["http_503"], 1);
        let row = |name: &str| r.rows.iter().find(|x| x.stage == name).unwrap();
        assert_eq!(row("rerank_ms").median_paired_diff_ms, Some(30.0));
        assert_eq!(row("embed_ms").median_paired_diff_ms, Some(0.0));
        assert_eq!(row("ttft_ms (client)").median_paired_diff_ms, Some(30.0));
        assert!(!r.rows.iter().any(|x| x.stage == "ttft_ms"));
        assert!(r.table().contains("+30.0"), "{}", r.table());
    }
}
