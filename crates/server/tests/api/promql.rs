//! Every metric a Grafana panel, a datasource link or a Prometheus rule queries is one the
//! server really serves on `/metrics` (or one the collector's spanmetrics connector derives
//! from spans, named from `otel-collector.yaml`): the metric names are read out of the real
//! PromQL expressions.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_fake_app, spawn_fake_app_with_store};
use crate::qdrant_server::{open, qdrant_available, Peers};
use crate::stack::{json_file, yaml, COLLECTOR, DASHBOARDS, DATASOURCES, RULES};

// ---------- PromQL: which metric names an expression reads ----------

/// Removes every `open … close` group (nesting-aware) from `s`.
fn strip_groups(s: &str, open: char, close: char) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in s.chars() {
        if c == open {
            depth += 1;
        } else if c == close && depth > 0 {
            depth -= 1;
        } else if depth == 0 {
            out.push(c);
        }
    }
    out
}

/// Metric names an expression selects: identifiers that are not functions, aggregations,
/// keywords, label names in `by (…)`/`on (…)` lists, or inside matchers, strings and ranges.
fn promql_metric_names(expr: &str) -> BTreeSet<String> {
    // Strings first (they may hold braces), then matchers, ranges and grouping label lists.
    let mut s = String::new();
    let mut quote = None;
    let mut escaped = false;
    for c in expr.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                }
            }
            None if c == '"' || c == '\'' || c == '`' => quote = Some(c),
            None => s.push(c),
        }
    }
    let s = strip_groups(&s, '{', '}');
    let s = strip_groups(&s, '[', ']');
    let grouping = strip_grouping_lists(
        &s,
        &[
            "by",
            "without",
            "on",
            "ignoring",
            "group_left",
            "group_right",
        ],
    );
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
        "atan2",
    ];
    let mut names = BTreeSet::new();
    let chars: Vec<char> = grouping.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            // A number like 1e3 or a Grafana variable ($__rate_interval) is not a name.
            let after_number = start > 0 && chars[start - 1].is_ascii_digit();
            let variable = start > 0 && chars[start - 1] == '$';
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let call = j < chars.len() && chars[j] == '(';
            if !call && !after_number && !variable && !KEYWORDS.contains(&word.as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Drops the parenthesised label list after each grouping keyword (`by (le, rag_stage)`).
fn strip_grouping_lists(s: &str, keywords: &[&str]) -> String {
    let mut out = s.to_string();
    for kw in keywords {
        while let Some(pos) = find_word(&out, kw) {
            let rest = &out[pos + kw.len()..];
            let trimmed = rest.trim_start();
            if !trimmed.starts_with('(') {
                // Keyword without a list (e.g. `on` inside a name is excluded by find_word).
                out.replace_range(pos..pos + kw.len(), &" ".repeat(kw.len()));
                continue;
            }
            let open = pos + kw.len() + (rest.len() - trimmed.len());
            let close = out[open..]
                .find(')')
                .map(|c| open + c + 1)
                .unwrap_or(out.len());
            out.replace_range(pos..close, " ");
        }
    }
    out
}

/// Byte offset of `word` standing alone (not part of a longer identifier).
fn find_word(s: &str, word: &str) -> Option<usize> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut from = 0;
    while let Some(off) = s[from..].find(word) {
        let at = from + off;
        let before = s[..at].chars().next_back();
        let after = s[at + word.len()..].chars().next();
        if !before.is_some_and(ident) && !after.is_some_and(ident) {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

#[test]
fn promql_names_are_extracted_from_real_queries() {
    let names = promql_metric_names(
        r#"histogram_quantile(0.95, sum by (le, rag_stage) (rate(ragscope_stage_duration_seconds_bucket{http_route=~"/v1/(rag|x)"}[$__rate_interval])))"#,
    );
    assert_eq!(
        names,
        BTreeSet::from(["ragscope_stage_duration_seconds_bucket".to_string()])
    );
    let names = promql_metric_names(
        "sum(rate(a_total{x=\"}\"}[5m])) / on (instance) group_left (version) b_info > 1e3 and c",
    );
    assert_eq!(
        names,
        BTreeSet::from(["a_total".into(), "b_info".into(), "c".into()])
    );
    assert!(promql_metric_names("vector(1)").is_empty());
}

// ---------- what the server and the collector really export ----------

/// Sample names in a Prometheus text exposition (`_bucket`, `_sum`, `_count` included).
fn exposed_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            l.split(|c: char| c == '{' || c.is_whitespace())
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// Names the collector's spanmetrics connector produces once its Prometheus exporter has
/// translated them, derived from the connector's namespace and histogram unit.
fn spanmetrics_names(collector: &Value) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let Some(connectors) = collector["connectors"].as_object() else {
        return names;
    };
    for (id, cfg) in connectors {
        if id.split('/').next() != Some("spanmetrics") {
            continue;
        }
        let ns = cfg["namespace"]
            .as_str()
            .unwrap_or("traces.span.metrics")
            .replace('.', "_");
        let unit = match cfg["histogram"]["unit"].as_str().unwrap_or("ms") {
            "s" => "seconds",
            "ms" => "milliseconds",
            other => panic!("spanmetrics histogram unit {other:?} not handled here"),
        };
        names.insert(format!("{ns}_calls_total"));
        for suffix in ["bucket", "sum", "count"] {
            names.insert(format!("{ns}_duration_{unit}_{suffix}"));
        }
        if cfg["events"]["enabled"].as_bool() == Some(true) {
            names.insert(format!("{ns}_events_total"));
        }
    }
    names
}

/// Every `(where, datasource uid, PromQL)` the dashboards, datasource links and rules hold.
fn promql_queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for file in DASHBOARDS {
        let dash = json_file(file);
        for panel in dash["panels"].as_array().unwrap() {
            let panel_ds = panel["datasource"]["uid"].as_str();
            for t in panel["targets"].as_array().into_iter().flatten() {
                let uid = t["datasource"]["uid"].as_str().or(panel_ds);
                if uid == Some("prometheus") {
                    let expr = t["expr"].as_str().unwrap_or_else(|| {
                        panic!(
                            "{file}: panel {:?} has a target without expr",
                            panel["title"]
                        )
                    });
                    out.push((format!("{file}: {}", panel["title"]), expr.to_string()));
                }
            }
        }
    }
    let ds = yaml(DATASOURCES);
    for d in ds["datasources"].as_array().unwrap() {
        for link in ["tracesToMetrics"] {
            for q in d["jsonData"][link]["queries"]
                .as_array()
                .into_iter()
                .flatten()
            {
                out.push((
                    format!("{DATASOURCES}: {} {link}", d["name"]),
                    q["query"].as_str().unwrap().replace("$__tags", ""),
                ));
            }
        }
    }
    let rules = yaml(RULES);
    for g in rules["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            let name = r["alert"].as_str().or(r["record"].as_str()).unwrap();
            out.push((
                format!("{RULES}: {name}"),
                r["expr"].as_str().unwrap().into(),
            ));
        }
    }
    out
}

#[tokio::test]
async fn every_queried_metric_is_exported_by_the_server_or_the_collector() {
    let app = spawn_fake_app(FakeGenerator::new(8)).await;
    app.ingest_fixtures().await;
    for body in [
        json!({"query": "What is the capital of Zorbia?", "max_tokens": 8}),
        json!({"query": "What is a flumox?", "max_tokens": 8, "stream": true}),
    ] {
        let r = app
            .client
            .post(app.url("/v1/rag/query"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let (status, _) = app.post("/v1/rag/query", &json!({"query": ""})).await;
    assert_eq!(status, 400);
    let metrics = app.metrics_text().await;
    let server = exposed_names(&metrics);
    let spans = spanmetrics_names(&yaml(COLLECTOR));
    assert!(
        !spans.is_empty(),
        "{COLLECTOR} defines no spanmetrics connector"
    );

    let qdrant = qdrant_names().await;

    let queries = promql_queries();
    assert!(queries.len() >= 20, "only {} queries found", queries.len());
    let mut used = BTreeSet::new();
    let mut missing = Vec::new();
    for (place, expr) in &queries {
        let names = promql_metric_names(expr);
        assert!(!names.is_empty(), "{place}: no metric in {expr}");
        for name in names {
            let from_qdrant = match &qdrant {
                Some(names) => names.contains(&name),
                None => name.starts_with("grpc_responses_"), // SKIPPED: said above
            };
            if !server.contains(&name) && !spans.contains(&name) && !from_qdrant {
                missing.push(format!("{place}: {name} (in {expr})"));
            }
            used.insert(name);
        }
    }
    assert!(
        missing.is_empty(),
        "metrics neither on /metrics, nor from spanmetrics, nor on Qdrant's /metrics:\n{}\n\n/metrics:\n{metrics}",
        missing.join("\n")
    );
    // The stage latency dashboard covers stage durations, token latencies, queue and KV cache.
    for name in [
        "ragscope_stage_duration_seconds_bucket",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "gen_ai_server_request_duration_seconds_count",
        "ragscope_queue_depth",
        "ragscope_kv_cache_bytes",
        "ragscope_spans_dropped_total",
    ] {
        assert!(used.contains(name), "no panel or rule queries {name}");
    }
    assert!(
        used.iter().any(|n| spans.contains(n)),
        "no panel uses the span metrics (the exemplars)"
    );
    app.stop().await;
}

// ---------- Grafana: dashboards and datasource uids ----------

/// What a real Qdrant server exposes on its `/metrics` once ragscope has written to and
/// searched it over gRPC (the compose stack's `qdrant` job scrapes the same); `None` when no
/// Qdrant can be started here (then the panels' Qdrant names go unchecked, and this says so).
async fn qdrant_names() -> Option<BTreeSet<String>> {
    if !qdrant_available("every_queried_metric_is_exported: Qdrant's metrics") {
        return None;
    }
    let peers = Peers::start(1);
    let store = open(&peers.grpc[0], Duration::from_secs(10)).await.unwrap();
    let app = spawn_fake_app_with_store(FakeGenerator::new(3), store).await;
    app.ingest_fixtures().await;
    let (status, body) = app
        .post("/v1/rag/query", &json!({"query": "What is a flumox?"}))
        .await;
    assert_eq!(status, 200, "{body}");
    let text = app
        .client
        .get(format!("{}/metrics", peers.rest[0]))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    app.stop().await;
    Some(exposed_names(&text))
}
