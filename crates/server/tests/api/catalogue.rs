//! The span and metric catalogues of docs/TELEMETRY.md against the code's name registry
//! (`src/telemetry/names.rs`): every name the catalogue lists is one the code emits, every
//! stage and metric the code has is listed, and every attribute key is documented somewhere
//! in the README or a reference page under docs/ (the dated journal does not count).

use std::collections::BTreeSet;

use telemetry::names::{attr, metric, span, StageKind};

fn read(rel: &str) -> String {
    let path = crate::helpers::repo_dir().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The README and every reference page directly under docs/ (not docs/journal/), for names
/// documented outside the two tables.
fn manual() -> String {
    let mut text = read("README.md");
    let docs = crate::helpers::repo_dir().join("docs");
    if let Ok(entries) = std::fs::read_dir(docs) {
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|e| e == "md") {
                text.push_str(&std::fs::read_to_string(entry.path()).unwrap());
            }
        }
    }
    text
}

/// The reference page that holds the two catalogues.
const CATALOGUES: &str = "docs/TELEMETRY.md";

/// The rows of the markdown table under `heading`, as cells.
fn table(page: &str, heading: &str) -> Vec<Vec<String>> {
    let start = page
        .find(heading)
        .unwrap_or_else(|| panic!("{CATALOGUES} has no {heading:?} section"));
    page[start..]
        .lines()
        .skip(1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2) // the header and its rule
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

/// The `code` spans of a cell, with `a.{b,c}_d` written out as `a.b_d`, `a.c_d`.
fn names(cell: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, part) in cell.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        match (part.find('{'), part.find('}')) {
            (Some(open), Some(close)) if !part.contains(' ') => {
                for choice in part[open + 1..close].split(',') {
                    out.push(format!("{}{choice}{}", &part[..open], &part[close + 1..]));
                }
            }
            _ => out.push(part.to_string()),
        }
    }
    out
}

#[test]
fn the_span_catalogue_lists_what_the_server_emits() {
    let page = read(CATALOGUES);
    let rows = table(&page, "### Span catalogue");
    assert!(rows.len() >= 10, "{rows:?}");
    let known_attributes: BTreeSet<&str> = attr::ALL.iter().copied().collect();
    // A span may be named in the first column or in the "when" column of its stage's row.
    let mut listed_spans: BTreeSet<String> = rows.iter().flat_map(|row| names(&row[1])).collect();
    for (i, row) in rows.iter().enumerate() {
        for name in names(&row[0]) {
            let first = name.split(' ').next().unwrap().to_string();
            if i == 0 {
                // The request span, named after the HTTP method and route.
                assert!(first.chars().all(|c| c.is_ascii_uppercase()), "{name}");
                continue;
            }
            assert!(
                StageKind::of_span_name(&first).is_some() || span::ALL.contains(&first.as_str()),
                "the catalogue lists a span `{name}` the registry does not have"
            );
            listed_spans.insert(first);
        }
        for key in names(row.last().unwrap()) {
            if key.ends_with(".*") || !key.contains('.') {
                continue; // `baggage.*`, and values such as `plain`
            }
            assert!(
                known_attributes.contains(key.as_str()),
                "the catalogue lists an attribute `{key}` the registry does not have"
            );
        }
    }
    let request_spans = StageKind::ALL.iter().map(|k| k.span_prefix()).chain([
        span::TOKENIZE,
        span::FORWARD,
        span::PREFILL_QUEUE,
        span::DECODE_STEP,
    ]);
    for name in request_spans {
        assert!(
            listed_spans.contains(name),
            "the span catalogue does not list `{name}`"
        );
    }
}

#[test]
fn the_metrics_table_lists_every_instrument() {
    let page = read(CATALOGUES);
    let listed: BTreeSet<String> = table(&page, "### Metrics")
        .iter()
        .flat_map(|row| names(&row[0]))
        .collect();
    let manual = manual();
    for name in metric::ALL {
        // GPU gauges exist only in CUDA builds and are documented with them.
        let gpu = name.starts_with("ragscope.gpu.");
        assert!(
            listed.contains(*name) || (gpu && manual.contains(name)),
            "the metrics table does not list `{name}`"
        );
    }
    for name in &listed {
        assert!(
            metric::ALL.contains(&name.as_str()),
            "the metrics table lists `{name}`, which the registry does not have"
        );
    }
}

#[test]
fn every_attribute_key_is_documented() {
    let manual = manual();
    // Labels of metric points and resource attributes, documented with their metrics.
    let labels = [
        attr::STAGE,
        attr::CACHE,
        attr::RESULT,
        attr::REASON,
        attr::KIND,
        attr::VERSION,
        attr::SERVICE_NAME,
        attr::SERVICE_VERSION,
        attr::FAULT_PREFIX,
    ];
    let undocumented: Vec<&str> = attr::ALL
        .iter()
        .copied()
        .filter(|key| !labels.contains(key))
        .filter(|key| !documented(&manual, key))
        .collect();
    assert!(
        undocumented.is_empty(),
        "attribute keys the README and docs/ never mention: {undocumented:?}"
    );
}

/// Whether `key` is in a code span of the manual: alone, with a value (`rpc.system=grpc`), in
/// a brace list (`gen_ai.request.{model,seed}`) or as the Prometheus label it becomes.
fn documented(manual: &str, key: &str) -> bool {
    let label = key.replace('.', "_");
    manual.split('`').skip(1).step_by(2).any(|code| {
        code == label
            || code
                .strip_prefix(key)
                .is_some_and(|rest| rest.starts_with('='))
            || names(&format!("`{code}`")).iter().any(|n| n == key)
    })
}

#[test]
fn brace_lists_are_written_out() {
    assert_eq!(
        names("`gen_ai.usage.{input,output}_tokens`, `x`"),
        [
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "x"
        ]
    );
}
