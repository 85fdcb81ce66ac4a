//! The HTML report renders a summary with every section.
use super::*;

#[test]
fn attribution_in_the_agreed_schema_parses() {
    let json = r#"{"traces": 40, "end_to_end_ms": {"p50": 900, "p95": 1500, "p99": 2000},
      "stages": [{"stage": "embeddings", "count": 40, "self_ms": {"p50": 9, "p95": 12, "p99": 15},
        "inclusive_ms": {"p50": 9, "p95": 12, "p99": 15}, "share": 0.01, "critical_path_share": 0.01}],
      "residual_ms": {"p50": 1, "p95": 2, "p99": 3}}"#;
    let a: Attribution = serde_json::from_str(json).unwrap();
    assert_eq!(a.traces, 40);
    assert_eq!(a.stages[0].self_ms.p95, 12.0);
    let mut h = String::new();
    attribution_section(&mut h, &a);
    assert!(h.contains("embeddings"));
    assert!(h.contains("unattributed residual"));
    assert!(h.contains("<svg"));
}

#[test]
fn cdf_ends_at_one_and_is_monotone() {
    let pts = cdf_points((0..1000).map(|i| (i % 37) as f64).collect());
    assert_eq!(pts.last().unwrap().1, 1.0);
    assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    assert!(pts.len() <= 1000);
}
