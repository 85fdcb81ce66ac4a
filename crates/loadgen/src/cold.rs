//! Two experiments on a real server.
//!
//! `experiment cold`: the trap of a small cold share. The hot set (the query file) is sent once
//! so the server's caches hold it, then an all-hot arm and one arm per `--cold-shares` run the
//! same closed-loop load. A cold request misses the query-embedding cache and most of the
//! prefix KV cache; at a 1% share P50 barely moves while P99 lands on the cold requests. The
//! table shows each arm's P50/P99 TTFT with intervals, the P99 amplification against the
//! all-hot arm, the caches' hit rates and the stage a miss costs most in.
//!
//! `experiment reconnect`: the same load (gRPC, or HTTP with `--endpoint rag`) against servers
//! that differ in their connection settings (`--max-connection-age-s`), in interleaved rounds so
//! the box's drift is shared; with `--with-retry` each arm runs again with the client retrying
//! a request its closing connection refused, so the table shows both the trap and the fix.

use std::collections::BTreeMap;

use anyhow::bail;
use serde::{Deserialize, Serialize};

use crate::caches::CacheReport;
use crate::cli::{ColdArgs, Mode, ReconnectArgs, RunArgs, Shape};
use crate::record::RequestRecord;
use crate::summary::Summary;
use measure::stats::Percentiles;

/// One arm of `experiment cold`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ColdArm {
    pub cold_share: f64,
    pub requests: u64,
    pub errors: u64,
    pub ttft_ms: Option<Percentiles>,
    /// This arm's P99 TTFT over the all-hot arm's.
    pub p99_amplification: Option<f64>,
    /// This arm's P50 TTFT over the all-hot arm's.
    pub p50_ratio: Option<f64>,
    pub caches: Option<CacheReport>,
}

impl ColdArm {
    pub fn of(share: f64, s: &Summary) -> ColdArm {
        let steady = s.steady.as_ref();
        ColdArm {
            cold_share: share,
            requests: steady.map_or(0, |p| p.requests),
            errors: steady.map_or(0, |p| p.errors),
            ttft_ms: steady.and_then(|p| p.ttft_ms),
            p99_amplification: None,
            p50_ratio: None,
            caches: s.caches.clone(),
        }
    }
}

/// The arms' shares: 0 (the baseline) first, then the asked ones in order, without repeats.
pub fn shares(asked: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0];
    for &s in asked {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Sets each arm's ratios to the first (all-hot) arm.
pub fn amplify(arms: &mut [ColdArm]) {
    let Some(base) = arms.first().and_then(|a| a.ttft_ms) else {
        return;
    };
    for a in arms.iter_mut() {
        if let Some(t) = a.ttft_ms {
            a.p99_amplification = Some(t.p99 / base.p99);
            a.p50_ratio = Some(t.p50 / base.p50);
        }
    }
}

fn closed(requests: u64, users: usize) -> Shape {
    Shape {
        mode: Mode::Closed,
        rate: 1.0,
        burst_rate: 0.0,
        burst_size: 0,
        users,
        think_ms: 0.0,
        warmup: 0.0,
        duration: 24.0 * 3600.0,
        cooldown: 0.0,
        requests: Some(requests),
    }
}

fn run_args(target: crate::cli::Target, shape: Shape, a: &ColdArgs, name: &str) -> RunArgs {
    RunArgs {
        target,
        shape,
        isolation: a.isolation.clone(),
        out: a.out.join(name),
        attribution: None,
        replay: None,
        quiet: a.quiet,
    }
}

/// The warm-up's target: every question of the hot set as it is (no cold, no perturbation,
/// no shadow).
pub fn hot_target(t: &crate::cli::Target) -> crate::cli::Target {
    let mut target = t.clone();
    target.cold_share = 0.0;
    target.no_match_share = 0.0;
    target.perturb_rate = 0.0;
    target.shadow = None;
    target
}

/// The run of the arm at `share`.
pub fn arm_args(a: &ColdArgs, share: f64) -> RunArgs {
    let mut target = a.target.clone();
    target.cold_share = share;
    run_args(
        target,
        closed(a.requests, a.users),
        a,
        &format!("share-{share}"),
    )
}

pub fn table(arms: &[ColdArm]) -> String {
    let mut s = format!(
        "{:<10} {:>8} {:>6} {:>24} {:>26} {:>8} {:>8} {:>12} {:>12}  a miss costs most in\n",
        "cold share",
        "requests",
        "errors",
        "TTFT p50 ms [95% CI]",
        "TTFT p99 ms [95% CI]",
        "p50 ×",
        "p99 ×",
        "embed hits",
        "prefix hits"
    );
    for a in arms {
        let (p50, p99) = a.ttft_ms.map_or(("–".into(), "–".into()), |t| {
            (
                format!("{:.0} [{:.0}, {:.0}]", t.p50, t.ci.p50.lo, t.ci.p50.hi),
                format!("{:.0} [{:.0}, {:.0}]", t.p99, t.ci.p99.lo, t.ci.p99.hi),
            )
        });
        let rate = |name: &str| {
            a.caches
                .as_ref()
                .and_then(|c| c.caches.iter().find(|r| r.cache == name))
                .map_or("–".into(), |r| format!("{:.1}%", r.hit_rate * 100.0))
        };
        let missed = a
            .caches
            .as_ref()
            .and_then(|c| {
                c.caches
                    .iter()
                    .find_map(|r| r.missed_stage.clone().map(|s| (s, r)))
            })
            .map_or("–".into(), |(s, r)| {
                format!(
                    "{s} (+{:.0} ms, {} cache)",
                    r.miss_minus_hit_ms[&s], r.cache
                )
            });
        s.push_str(&format!(
            "{:<10} {:>8} {:>6} {:>24} {:>26} {:>8} {:>8} {:>12} {:>12}  {}\n",
            a.cold_share,
            a.requests,
            a.errors,
            p50,
            p99,
            a.p50_ratio.map_or("–".into(), |r| format!("{r:.2}")),
            a.p99_amplification
                .map_or("–".into(), |r| format!("{r:.2}")),
            rate(crate::caches::QUERY_EMBEDDING),
            rate(crate::caches::PREFIX_KV),
            missed
        ));
        if let Some(t) = a.ttft_ms {
            for (name, beyond) in t.thin_tails() {
                if name == "p99" {
                    s.push_str(&format!(
                        "  (share {}: the P99 rests on {beyond:.1} samples beyond it: too few; see its interval)\n",
                        a.cold_share
                    ));
                }
            }
        }
    }
    s
}

/// `NAME=URL` arms.
pub fn parse_arms(arms: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    arms.iter()
        .map(|a| match a.split_once('=') {
            Some((n, u)) if !n.is_empty() && !u.is_empty() => Ok((n.to_string(), u.to_string())),
            _ => bail!("--arm {a:?}: expected NAME=URL"),
        })
        .collect()
}

/// One arm of `experiment reconnect`: a server, and whether the client retries refused requests.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconnectRun {
    pub name: String,
    pub url: String,
    pub retry: bool,
}

/// The arms to run: each `--arm`, and with `with_retry` the same server again as `NAME+retry`
/// next to it (so both see the same drift; [`round_order`] alternates which goes first). The flag `--retry-refused` retries in every arm.
pub fn reconnect_runs(
    arms: &[(String, String)],
    with_retry: bool,
    retry_all: bool,
) -> Vec<ReconnectRun> {
    let mut runs = Vec::new();
    for (name, url) in arms {
        runs.push(ReconnectRun {
            name: name.clone(),
            url: url.clone(),
            retry: retry_all,
        });
        if with_retry && !retry_all {
            runs.push(ReconnectRun {
                name: format!("{name}+retry"),
                url: url.clone(),
                retry: true,
            });
        }
    }
    runs
}

/// The order of `runs` in round `round`: as given in even rounds; in odd rounds each arm's
/// `+retry` run goes before it. The second of a pair runs the same seeded questions on the same
/// server just after the first, so it finds them cached; alternating gives each half its turn.
pub fn round_order(runs: &[ReconnectRun], round: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    if round % 2 == 1 {
        let mut i = 0;
        while i + 1 < runs.len() {
            if runs[i + 1].retry && !runs[i].retry && runs[i + 1].url == runs[i].url {
                order.swap(i, i + 1);
                i += 2;
            } else {
                i += 1;
            }
        }
    }
    order
}

/// The run of one reconnect arm in one round: the same seed in every arm of a round, so each
/// arm sees the same questions in the same order.
pub fn reconnect_args(a: &ReconnectArgs, arm: &ReconnectRun, round: usize) -> RunArgs {
    let mut target = a.target.clone();
    target.url = arm.url.clone();
    target.retry_refused = arm.retry;
    target.seed = target.seed.wrapping_add(round as u64);
    let name = format!("{}-round{round}", arm.name);
    RunArgs {
        target,
        shape: closed(a.requests, a.users),
        isolation: a.isolation.clone(),
        out: a.out.join(name),
        attribution: None,
        replay: None,
        quiet: a.quiet,
    }
}

/// One arm of `experiment reconnect`, over all its rounds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReconnectArm {
    pub name: String,
    pub url: String,
    pub requests: usize,
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Requests sent a second time because their connection refused the first.
    pub retried: usize,
    /// Of those, the ones whose second attempt succeeded.
    pub retried_ok: usize,
    pub ttft_ms: Option<Percentiles>,
    pub e2e_ms: Option<Percentiles>,
}

impl ReconnectArm {
    pub fn of(name: &str, url: &str, records: &[RequestRecord]) -> ReconnectArm {
        let mut errors = BTreeMap::new();
        for e in records.iter().filter_map(|r| r.error.clone()) {
            *errors.entry(e).or_insert(0) += 1;
        }
        ReconnectArm {
            name: name.into(),
            url: url.into(),
            requests: records.len(),
            errors_by_kind: errors,
            retried: records.iter().filter(|r| r.retried).count(),
            retried_ok: records.iter().filter(|r| r.retried && r.ok).count(),
            ttft_ms: Percentiles::of(records.iter().filter(|r| r.ok).filter_map(|r| r.ttft_ms)),
            e2e_ms: Percentiles::of(records.iter().filter_map(|r| r.e2e_ms)),
        }
    }
}

pub fn reconnect_table(arms: &[ReconnectArm]) -> String {
    let base = arms.first().and_then(|a| a.ttft_ms);
    let mut s = format!(
        "{:<14} {:>8} {:>24} {:>26} {:>8} {:>8}  errors\n",
        "arm", "requests", "TTFT p50 ms [95% CI]", "TTFT p99 ms [95% CI]", "p99 ×", "retried"
    );
    for a in arms {
        let (p50, p99, x) = a.ttft_ms.map_or(("–".into(), "–".into(), "–".into()), |t| {
            (
                format!("{:.0} [{:.0}, {:.0}]", t.p50, t.ci.p50.lo, t.ci.p50.hi),
                format!("{:.0} [{:.0}, {:.0}]", t.p99, t.ci.p99.lo, t.ci.p99.hi),
                base.map_or("–".into(), |b| format!("{:.2}", t.p99 / b.p99)),
            )
        });
        s.push_str(&format!(
            "{:<14} {:>8} {:>24} {:>26} {:>8} {:>8}  {:?}\n",
            a.name,
            a.requests,
            p50,
            p99,
            x,
            format!("{}/{}", a.retried_ok, a.retried),
            a.errors_by_kind
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caches::tests::rec;
    use crate::record::QueryKind;

    #[test]
    fn the_baseline_arm_comes_first_and_ratios_are_against_it() {
        assert_eq!(shares(&[0.01, 0.1, 0.01]), vec![0.0, 0.01, 0.1]);
        assert_eq!(shares(&[0.0, 0.5]), vec![0.0, 0.5]);
        let hot: Vec<f64> = (0..200).map(|i| 100.0 + (i % 10) as f64).collect();
        let mut mixed = hot.clone();
        mixed[..4].iter_mut().for_each(|v| *v = 2000.0);
        let arm = |share, v: &[f64]| ColdArm {
            cold_share: share,
            requests: v.len() as u64,
            errors: 0,
            ttft_ms: Percentiles::of(v.iter().copied()),
            p99_amplification: None,
            p50_ratio: None,
            caches: None,
        };
        let mut arms = vec![arm(0.0, &hot), arm(0.02, &mixed)];
        amplify(&mut arms);
        assert_eq!(arms[0].p99_amplification, Some(1.0));
        // 2% cold at 20x the hot latency: P99 lands on the cold ones, P50 does not move.
        assert!(arms[1].p99_amplification.unwrap() > 10.0, "{arms:?}");
        assert!((arms[1].p50_ratio.unwrap() - 1.0).abs() < 0.02);
        assert!(table(&arms).contains("0.02"));
    }

    #[test]
    fn arms_parse_and_reconnect_arms_count_errors() {
        let a = parse_arms(&["off=http://a:1".into(), "1s=http://b:2".into()]).unwrap();
        assert_eq!(a[1], ("1s".to_string(), "http://b:2".to_string()));
        assert!(parse_arms(&["nourl".into()]).is_err());
        assert!(parse_arms(&["=http://x".into()]).is_err());
        let mut rs: Vec<RequestRecord> = (0..20)
            .map(|i| rec(i, 50.0, true, 0, QueryKind::Hot))
            .collect();
        rs[0].ok = false;
        rs[0].error = Some("grpc_unavailable".into());
        rs[0].retried = true;
        rs[1].retried = true;
        let arm = ReconnectArm::of("100ms", "http://b:2", &rs);
        assert_eq!(arm.errors_by_kind["grpc_unavailable"], 1);
        assert_eq!((arm.retried, arm.retried_ok), (2, 1));
        assert_eq!(arm.ttft_ms.unwrap().count, 19);
        let table = reconnect_table(&[arm]);
        assert!(table.contains("100ms") && table.contains("1/2"), "{table}");
    }

    #[test]
    fn with_retry_each_arm_runs_again_right_after_itself() {
        let arms = [
            ("off".to_string(), "u1".to_string()),
            ("1s".to_string(), "u2".to_string()),
        ];
        let names = |runs: Vec<ReconnectRun>| -> Vec<(String, bool)> {
            runs.into_iter().map(|r| (r.name, r.retry)).collect()
        };
        assert_eq!(
            names(reconnect_runs(&arms, true, false)),
            [
                ("off", false),
                ("off+retry", true),
                ("1s", false),
                ("1s+retry", true)
            ]
            .map(|(n, r)| (n.to_string(), r))
        );
        let runs = reconnect_runs(&arms, true, false);
        assert_eq!(round_order(&runs, 0), [0, 1, 2, 3]);
        assert_eq!(
            round_order(&runs, 1),
            [1, 0, 3, 2],
            "retry first in odd rounds"
        );
        assert_eq!(round_order(&reconnect_runs(&arms, false, false), 1), [0, 1]);
        assert_eq!(
            names(reconnect_runs(&arms, false, false)),
            [("off".to_string(), false), ("1s".to_string(), false)]
        );
        // `--retry-refused` alone: every arm retries, under its own name.
        assert!(reconnect_runs(&arms, true, true).iter().all(|r| r.retry));
        assert_eq!(reconnect_runs(&arms, true, true).len(), 2);
    }
}
