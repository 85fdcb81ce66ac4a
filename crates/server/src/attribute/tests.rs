//! Attribution on hand-made spans: self and inclusive times, the critical path, residuals, baselines.
use super::*;

fn span(
    trace: &str,
    id: &str,
    parent: &str,
    name: &str,
    start_ms: i128,
    end_ms: i128,
) -> SpanRecord {
    SpanRecord {
        trace_id: trace.into(),
        span_id: id.into(),
        parent_id: parent.into(),
        name: name.into(),
        start_ns: start_ms * 1_000_000,
        end_ns: end_ms * 1_000_000,
        faults: Vec::new(),
        status_code: Some(200),
        step: None,
        cache: None,
    }
}

/// A streamed request: stream waits alongside the worker stages, then writes alone.
fn request(trace: &str, retrieval_ms: i128) -> Vec<SpanRecord> {
    let r = retrieval_ms;
    vec![
        span(trace, "root", "remote", "POST /v1/rag/query", 0, 100 + r),
        span(trace, "q", "root", "queue", 1, 3),
        span(trace, "e", "root", "embeddings m", 3, 13),
        span(trace, "f", "e", "forward", 5, 12),
        span(trace, "r", "root", "retrieval c", 13, 13 + r),
        span(trace, "c", "root", "chat m", 14 + r, 90 + r),
        span(trace, "p", "c", "prefill", 14 + r, 50 + r),
        span(trace, "s", "root", "stream", 2, 99 + r),
    ]
}

fn stage<'a>(r: &'a Report, name: &str) -> &'a StageReport {
    r.stages.iter().find(|s| s.stage == name).unwrap()
}

#[test]
fn owned_times_and_residual_add_up_to_the_request() {
    let spans = request("t1", 5);
    let report = analyse(&spans, &["POST /v1/rag/query".into()]);
    assert_eq!(report.traces, 1);
    assert_eq!(report.end_to_end_ms.p50, 105.0);
    let owned: f64 =
        report.stages.iter().map(|s| s.critical_ms.p50).sum::<f64>() + report.residual_ms.p50;
    assert!((owned - 105.0).abs() < 1e-9, "{owned}");
    assert_eq!(stage(&report, "embeddings").self_ms.p50, 3.0);
    assert_eq!(stage(&report, "embeddings").inclusive_ms.p50, 10.0);
    assert_eq!(stage(&report, "embeddings › forward").self_ms.p50, 7.0);
    assert_eq!(stage(&report, "retrieval").critical_ms.p50, 5.0);
    assert_eq!(stage(&report, "chat › prefill").critical_ms.p50, 36.0);
    assert_eq!(stage(&report, "queue").critical_ms.p50, 2.0);
    // stream owns the gap before chat and the tail it writes alone (90+r..99+r).
    assert_eq!(stage(&report, "stream").critical_ms.p50, 1.0 + 9.0);
    assert_eq!(report.residual_ms.p50, 1.0 + 1.0);
    let path: Vec<&str> = report
        .critical_path
        .iter()
        .map(|(s, _)| s.as_str())
        .collect();
    assert_eq!(
        &path[..5],
        [
            "(residual)",
            "queue",
            "embeddings",
            "embeddings › forward",
            "embeddings"
        ]
    );
    assert_eq!(
        report.critical_path.iter().map(|(_, ms)| ms).sum::<f64>(),
        105.0
    );
}

#[test]
fn a_baseline_comparison_names_the_stage_that_moved() {
    let base: Vec<SpanRecord> = (0..20).flat_map(|i| request(&format!("b{i}"), 5)).collect();
    let slow: Vec<SpanRecord> = (0..20)
        .flat_map(|i| request(&format!("s{i}"), 25))
        .collect();
    let roots = ["POST /v1/rag/query".to_string()];
    let c = compare(&analyse(&base, &roots), &analyse(&slow, &roots));
    assert_eq!(c.end_to_end_p50_delta_ms, 20.0);
    assert_eq!(c.explained_by.as_deref(), Some("retrieval"));
    assert!((c.explained_share - 1.0).abs() < 1e-9);
    let embed = c.stages.iter().find(|s| s.stage == "embeddings").unwrap();
    assert_eq!(embed.self_p50_delta_ms, 0.0);
}

/// A request with a small rerank stage and a large prefill: root → embeddings, rerank,
/// chat › prefill, back to back.
fn rag(trace: &str, start: i128, rerank: i128, prefill: i128) -> Vec<SpanRecord> {
    let (r, p) = (10 + rerank, 10 + rerank + prefill);
    vec![
        span(
            trace,
            "root",
            "",
            "POST /v1/rag/query",
            start,
            start + p + 5,
        ),
        span(trace, "e", "root", "embeddings m", start, start + 10),
        span(trace, "r", "root", "rerank m", start + 10, start + r),
        span(trace, "c", "root", "chat m", start + r, start + p + 5),
        span(trace, "p", "c", "prefill", start + r, start + p),
    ]
}

#[test]
fn the_baseline_names_the_significant_change_not_the_largest_raw_move() {
    // 14 requests per run (the case seen here): rerank +35 ms on a ~5 ms stage; prefill a
    // noisy 0.7-1.5 s stage whose median moves by ~+100 ms from one run to the next by
    // chance (a different spread of the same distribution, plus the shift).
    let frac = |x: f64| x - x.floor();
    let noisy = |i: usize, phase: f64| (700.0 + 800.0 * frac(i as f64 * 0.618 + phase)) as i128;
    let base: Vec<SpanRecord> = (0..14)
        .flat_map(|i| rag(&format!("b{i}"), 0, 5 + (i % 3) as i128, noisy(i, 0.0)))
        .collect();
    let run: Vec<SpanRecord> = (0..14)
        .flat_map(|i| {
            rag(
                &format!("r{i}"),
                0,
                40 + (i % 3) as i128,
                noisy(i, 0.5) + 100,
            )
        })
        .collect();
    let (b, r) = (analyse(&base, &[]), analyse(&run, &[]));
    assert_eq!(b.end_to_end_samples_ms.len(), 14);
    assert_eq!(stage(&b, "rerank").critical_samples_ms.len(), 14);
    let c = compare(&b, &r);
    let change = |name: &str| c.stages.iter().find(|s| s.stage == name).unwrap().clone();
    let (rerank, prefill) = (change("rerank"), change("chat › prefill"));
    assert_eq!(rerank.critical_p50_delta_ms, 35.0);
    assert!(rerank.significant, "{rerank:?}");
    assert!(
        prefill.critical_p50_delta_ms > rerank.critical_p50_delta_ms,
        "the trap needs a larger raw move on the noisy stage: {prefill:?}"
    );
    assert!(!prefill.significant, "{prefill:?}");
    assert_eq!(c.largest_move.as_deref(), Some("chat › prefill"));
    assert_eq!(
        c.explained_by.as_deref(),
        Some("rerank"),
        "{}",
        comparison_table(&c)
    );
    assert!(comparison_table(&c).contains("within that stage's own noise"));
    // The same comparison twice: the same intervals (seeded).
    let again = compare(&b, &r);
    assert_eq!(
        again
            .stages
            .iter()
            .map(|s| s.critical_p50_interval)
            .collect::<Vec<_>>(),
        c.stages
            .iter()
            .map(|s| s.critical_p50_interval)
            .collect::<Vec<_>>()
    );
    // A report without samples (an older one) judges nothing significant.
    let mut old = b.clone();
    old.end_to_end_samples_ms.clear();
    let c = compare(&old, &r);
    assert!(!c.samples && c.explained_by.is_none());
}

#[test]
fn windows_name_the_stage_that_owns_each_bursts_violations() {
    // Three 10 s windows: calm, a rerank burst, a prefill burst (SLO 500 ms).
    let mut spans = Vec::new();
    for i in 0..30i128 {
        let start = i * 1000;
        let (rerank, prefill) = match i / 10 {
            1 if i % 2 == 0 => (600, 200),
            2 if i % 2 == 0 => (5, 900),
            _ => (5, 200),
        };
        spans.extend(rag(&format!("w{i}"), start, rerank, prefill));
    }
    let report = analyse_windows(&spans, &[], 10.0, 500.0);
    let w = &report.windows;
    assert_eq!(w.len(), 3, "{w:?}");
    assert_eq!(
        (w[0].requests, w[0].violations, w[0].owner.as_deref()),
        (10, 0, None)
    );
    assert_eq!(
        (w[1].violations, w[1].owner.as_deref()),
        (5, Some("rerank"))
    );
    assert_eq!(
        (w[2].violations, w[2].owner.as_deref()),
        (5, Some("chat › prefill"))
    );
    assert!(w[2].owner_excess_ms > 600.0, "{w:?}");
    assert!(windows_table(w, 500.0).contains("rerank"));
}

#[test]
fn the_tail_driver_is_the_stage_that_grew_in_the_slowest_requests() {
    let mut spans: Vec<SpanRecord> = (0..99).flat_map(|i| request(&format!("n{i}"), 5)).collect();
    spans.extend(request("slow", 300));
    let report = analyse(&spans, &[]);
    let tail = report.tail.unwrap();
    assert_eq!(tail.stage, "retrieval");
    assert!(tail.excess_ms > 250.0, "{tail:?}");
}

#[test]
fn failed_requests_are_counted_and_left_out() {
    let mut spans = request("ok", 5);
    let mut bad = request("bad", 5);
    bad[0].status_code = Some(500);
    spans.extend(bad);
    let report = analyse(&spans, &[]);
    assert_eq!((report.traces, report.failed), (1, 1));
}

#[test]
fn percentiles_interpolate() {
    let v = [1.0, 2.0, 3.0, 4.0, 5.0];
    assert_eq!(percentile(&v, 50.0), 3.0);
    assert_eq!(percentile(&v, 75.0), 4.0);
    assert!((percentile(&v, 99.0) - 4.96).abs() < 1e-9);
}

#[test]
fn a_baseline_names_the_cache_when_only_cache_hits_differ() {
    use super::caches::{Cache, SpanCache};
    // The case seen here: a baseline run of 14 questions, then the same 14 again with +35 ms
    // injected into rerank. The second run found every prompt in the prefix cache, so its
    // prefill fell from ~200 ms to ~1 ms: the largest, most significant move, and not the code's.
    let prefix = |held: u64| SpanCache {
        cache: Cache::PrefixKv,
        looked_up: 206,
        held,
    };
    let with_caches = |mut spans: Vec<SpanRecord>, prefill: SpanCache, query_hit: bool| {
        for s in &mut spans {
            if s.name == "prefill" {
                s.cache = Some(prefill);
            } else if s.name.starts_with("embeddings") {
                s.cache = Some(SpanCache {
                    cache: Cache::QueryVectors,
                    looked_up: 1,
                    held: u64::from(query_hit),
                });
            }
        }
        spans
    };
    let jitter = |i: usize| (i * 7 % 5) as i128;
    let base: Vec<SpanRecord> = (0..14)
        .flat_map(|i| {
            let spans = rag(&format!("b{i}"), 0, 5 + jitter(i), 200 + 3 * jitter(i));
            with_caches(spans, prefix(16), false)
        })
        .collect();
    let run: Vec<SpanRecord> = (0..14)
        .flat_map(|i| {
            let spans = rag(&format!("r{i}"), 0, 40 + jitter(i), 1 + jitter(i) % 2);
            with_caches(spans, prefix(206), true)
        })
        .collect();
    let (b, r) = (analyse(&base, &[]), analyse(&run, &[]));
    let held = stage(&r, "chat › prefill").cache.unwrap();
    assert_eq!(
        (held.held, held.looked_up, held.whole),
        (14 * 206, 14 * 206, 14)
    );
    let c = compare(&b, &r);
    let change = |name: &str| c.stages.iter().find(|s| s.stage == name).unwrap().clone();
    let prefill = change("chat › prefill");
    assert_eq!(c.explained_by.as_deref(), Some("chat › prefill"));
    let effect = prefill
        .cache_effect()
        .expect("the prefill moved with its cache");
    assert_eq!(effect.cache, Cache::PrefixKv);
    // The embeddings stage's cache moved too (all hits now), but its time did not: no effect.
    let embeddings = change("embeddings");
    assert!(embeddings.cache.is_some() && embeddings.cache_effect().is_none());
    // The rerank change, against the end-to-end direction, is what changed apart from caches.
    assert_eq!(c.apart_from_caches.as_deref(), Some("rerank"));
    let text = comparison_table(&c);
    assert!(
        text.contains("a cache effect, not a change in chat › prefill: 2884 of 2884 prompt tokens (100%) came from the prefix cache in this run, 224 of 2884 (8%) in the baseline; 14 of 14 requests were whole-prompt hits (0 of 14 in the baseline)"),
        "{text}"
    );
    assert!(text.contains("--warm"), "{text}");
    assert!(
        text.contains("apart from the caches, the largest significant change is rerank +35.00 ms"),
        "{text}"
    );
    // Reports written before caches were read compare as before, without cache lines.
    let mut old = b.clone();
    for s in &mut old.stages {
        s.cache = None;
    }
    let plain = compare(&old, &r);
    assert!(plain.stages.iter().all(|s| s.cache.is_none()));
    assert!(!comparison_table(&plain).contains("cache effect"));
    let json = serde_json::to_string(&b).unwrap();
    let back: Report = serde_json::from_str(&json).unwrap();
    let caches = |r: &Report| r.stages.iter().map(|s| s.cache).collect::<Vec<_>>();
    assert_eq!(caches(&back), caches(&b));
}
