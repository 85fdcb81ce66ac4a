//! Batched decode in `ragscope attribute`: a batched step (`decode_step`, the root of a trace of
//! its own) ran for several requests at once, so its time belongs to none of them alone. Each
//! step's time is split among its members in proportion to their tokens in it: the positions
//! the step computed for each, one per step plus the draft tokens it verified when the request
//! speculates (what the step cost, whether or not the drafts were accepted; the request's
//! `decode` span says how many were). A `sampled:N` span stands for N steps and carries each
//! member's tokens over them. The shares of every step add up to the step, so the attributed
//! times of all requests add up to the batcher's busy time.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::SpanRecord;
use telemetry::names::attr;

/// What the output says about how a step's time is split.
pub const SPLIT: &str =
    "each step's time goes to its members in proportion to their share of the step's tokens";

/// What a `decode_step` span says about whom it ran for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRecord {
    /// Sequences in the step the span timed.
    pub batch_size: usize,
    /// Steps the span stands for (`rag.decode.window.steps`; 1 when every step is a span).
    pub steps: u64,
    /// Busy time of those steps in ns, when the span stands for more than its own step.
    pub busy_ns: Option<i128>,
    pub members: Vec<StepMember>,
}

/// One request a step ran for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMember {
    pub request_id: String,
    pub trace_id: String,
    /// The request's `decode` span.
    pub span_id: String,
    /// Tokens the step (or the steps the span stands for) computed for it.
    pub tokens: u64,
}

/// A step's facts from OTLP/JSON attributes (`[{key, value}]`); `None` for any other span.
pub fn from_otlp(attributes: Option<&Vec<Value>>) -> Option<StepRecord> {
    let attributes = attributes?;
    let get = |key: &str| {
        attributes
            .iter()
            .find(|a| a["key"] == key)
            .map(|a| &a["value"])
    };
    let scalar = |v: &Value| -> Option<String> {
        ["stringValue", "intValue", "doubleValue"]
            .iter()
            .find_map(|k| match v.get(*k)? {
                Value::String(s) => Some(s.clone()),
                Value::Number(n) => Some(n.to_string()),
                _ => None,
            })
    };
    let array = |key: &str| -> Vec<String> {
        get(key)
            .and_then(|v| v["arrayValue"]["values"].as_array())
            .map(|items| items.iter().filter_map(scalar).collect())
            .unwrap_or_default()
    };
    let number = |key: &str| {
        get(key)
            .and_then(scalar)
            .and_then(|s| s.parse::<f64>().ok())
    };
    record(array, number)
}

/// A step's facts from Jaeger tags, which carry arrays as JSON text.
pub fn from_jaeger(tags: Option<&Vec<Value>>) -> Option<StepRecord> {
    let tags = tags?;
    let get = |key: &str| tags.iter().find(|t| t["key"] == key).map(|t| &t["value"]);
    let array = |key: &str| -> Vec<String> {
        let parsed = match get(key) {
            Some(Value::String(text)) => serde_json::from_str::<Vec<Value>>(text).ok(),
            Some(Value::Array(items)) => Some(items.clone()),
            _ => None,
        };
        parsed
            .unwrap_or_default()
            .into_iter()
            .map(|v| match v {
                Value::String(s) => s,
                other => other.to_string(),
            })
            .collect()
    };
    let number = |key: &str| match get(key) {
        Some(Value::Number(n)) => n.as_f64(),
        Some(Value::String(s)) => s.parse().ok(),
        _ => None,
    };
    record(array, number)
}

/// The step from its attributes, read by key as arrays of text and as numbers.
fn record(
    array: impl Fn(&str) -> Vec<String>,
    number: impl Fn(&str) -> Option<f64>,
) -> Option<StepRecord> {
    let span_ids = array(attr::DECODE_MEMBERS_SPAN_IDS);
    if span_ids.is_empty() {
        return None;
    }
    let (trace_ids, request_ids, tokens) = (
        array(attr::DECODE_MEMBERS_TRACE_IDS),
        array(attr::DECODE_MEMBERS_REQUEST_IDS),
        array(attr::DECODE_MEMBERS_TOKENS),
    );
    let batch_size = number(attr::DECODE_BATCH_SIZE);
    let window_steps = number(attr::DECODE_WINDOW_STEPS);
    let window_busy_ms = number(attr::DECODE_WINDOW_BUSY_MS);
    let at = |v: &[String], i: usize| v.get(i).cloned().unwrap_or_default();
    let members = span_ids
        .iter()
        .enumerate()
        .map(|(i, span_id)| StepMember {
            request_id: at(&request_ids, i),
            trace_id: at(&trace_ids, i).to_ascii_lowercase(),
            span_id: span_id.to_ascii_lowercase(),
            tokens: tokens.get(i).and_then(|t| t.parse().ok()).unwrap_or(1),
        })
        .collect();
    Some(StepRecord {
        batch_size: batch_size.map_or(span_ids.len(), |b| b as usize),
        steps: window_steps.map_or(1, |s| s as u64),
        busy_ns: window_busy_ms.map(|ms| (ms * 1e6).round() as i128),
        members,
    })
}

/// One request's share of the batched steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestShare {
    pub trace_id: String,
    pub request_id: String,
    /// Tokens the steps computed for it.
    pub tokens: u64,
    /// Its shares of the steps' time.
    pub attributed_ms: f64,
    /// Its `decode` span's duration, when that span is among the spans read.
    pub decode_ms: Option<f64>,
}

/// The batched steps among the spans read, and whose time they were.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchReport {
    /// `decode_step` spans read.
    pub step_spans: usize,
    /// Steps they stand for.
    pub steps: u64,
    /// Sequences per step, on average over the steps.
    pub mean_batch_size: f64,
    /// The steps' time: the batcher's busy time.
    pub busy_ms: f64,
    /// The requests' shares together (equal to `busy_ms` but for rounding).
    pub attributed_ms: f64,
    /// How a step's time is split.
    pub split: String,
    /// Per request, in the order their decode spans started.
    pub requests: Vec<RequestShare>,
}

/// Splits every batched step's time among its members; `None` when no span is a step.
pub fn analyse(spans: &[SpanRecord]) -> Option<BatchReport> {
    let decode: HashMap<&str, &SpanRecord> =
        spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let mut report = BatchReport {
        split: SPLIT.to_string(),
        ..BatchReport::default()
    };
    let mut shares: HashMap<(String, String), RequestShare> = HashMap::new();
    let mut tokens_total = 0u64;
    for s in spans {
        let Some(step) = &s.step else { continue };
        let busy = step.busy_ns.unwrap_or(s.end_ns - s.start_ns).max(0) as f64 / 1e6;
        let tokens: u64 = step.members.iter().map(|m| m.tokens).sum();
        report.step_spans += 1;
        report.steps += step.steps;
        report.busy_ms += busy;
        tokens_total += tokens;
        if tokens == 0 {
            continue;
        }
        for m in &step.members {
            let share = shares
                .entry((m.trace_id.clone(), m.span_id.clone()))
                .or_insert_with(|| RequestShare {
                    trace_id: m.trace_id.clone(),
                    request_id: m.request_id.clone(),
                    decode_ms: decode
                        .get(m.span_id.as_str())
                        .map(|d| (d.end_ns - d.start_ns) as f64 / 1e6),
                    ..RequestShare::default()
                });
            share.tokens += m.tokens;
            share.attributed_ms += busy * m.tokens as f64 / tokens as f64;
        }
    }
    if report.step_spans == 0 {
        return None;
    }
    report.mean_batch_size = tokens_total as f64 / report.steps.max(1) as f64;
    let mut requests: Vec<((String, String), RequestShare)> = shares.into_iter().collect();
    let started = |span_id: &str| decode.get(span_id).map_or(i128::MAX, |d| d.start_ns);
    requests.sort_by(|a, b| {
        started(&a.0 .1)
            .cmp(&started(&b.0 .1))
            .then_with(|| a.0.cmp(&b.0))
    });
    report.requests = requests.into_iter().map(|(_, share)| share).collect();
    report.attributed_ms = report.requests.iter().map(|r| r.attributed_ms).sum();
    Some(report)
}

/// Rows of the per-request table shown before the rest are summed up in one line.
const SHOWN: usize = 20;

/// The report as text, saying how the time was split.
pub fn table(report: &BatchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nbatched decode: {} steps in {} decode_step spans, {:.2} sequences per step on average; batcher busy {:.1} ms",
        report.steps, report.step_spans, report.mean_batch_size, report.busy_ms
    );
    let _ = writeln!(out, "split: {}", report.split);
    let _ = writeln!(
        out,
        "{:<34} {:<38} {:>7} {:>14} {:>12}",
        "trace", "request id", "tokens", "attributed ms", "decode ms"
    );
    for r in report.requests.iter().take(SHOWN) {
        let decode = r.decode_ms.map_or("-".to_string(), |d| format!("{d:.1}"));
        let _ = writeln!(
            out,
            "{:<34} {:<38} {:>7} {:>14.1} {:>12}",
            r.trace_id, r.request_id, r.tokens, r.attributed_ms, decode
        );
    }
    if report.requests.len() > SHOWN {
        let rest = &report.requests[SHOWN..];
        let _ = writeln!(
            out,
            "({} more requests: {:.1} ms together)",
            rest.len(),
            rest.iter().map(|r| r.attributed_ms).sum::<f64>()
        );
    }
    let _ = writeln!(
        out,
        "attributed to {} requests: {:.1} ms, {:.1}% of the batcher's busy time",
        report.requests.len(),
        report.attributed_ms,
        100.0 * super::ratio(report.attributed_ms, report.busy_ms)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(trace: &str, span: &str, tokens: u64) -> StepMember {
        StepMember {
            request_id: format!("req-{trace}"),
            trace_id: trace.into(),
            span_id: span.into(),
            tokens,
        }
    }

    fn step(id: &str, start_ms: i128, end_ms: i128, members: Vec<StepMember>) -> SpanRecord {
        SpanRecord {
            trace_id: format!("step-{id}"),
            span_id: id.into(),
            parent_id: String::new(),
            name: "decode_step".into(),
            start_ns: start_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            faults: Vec::new(),
            status_code: None,
            step: Some(StepRecord {
                batch_size: members.len(),
                steps: 1,
                busy_ns: None,
                members,
            }),
            cache: None,
        }
    }

    #[test]
    fn a_step_is_split_by_token_share_and_the_shares_add_up() {
        let mut spans = vec![
            // Alone: all of its 4 ms are a's.
            step("s1", 0, 4, vec![member("a", "da", 1)]),
            // a and b together: 6 ms, half each.
            step(
                "s2",
                4,
                10,
                vec![member("a", "da", 1), member("b", "db", 1)],
            ),
            // A window of steps where b had three tokens to a's one: 8 ms of busy time.
            step(
                "s3",
                10,
                12,
                vec![member("a", "da", 1), member("b", "db", 3)],
            ),
        ];
        if let Some(s) = spans[2].step.as_mut() {
            s.steps = 3;
            s.busy_ns = Some(8_000_000);
        }
        let report = analyse(&spans).unwrap();
        assert_eq!((report.step_spans, report.steps), (3, 5));
        assert_eq!(report.busy_ms, 4.0 + 6.0 + 8.0);
        let a = report.requests.iter().find(|r| r.trace_id == "a").unwrap();
        let b = report.requests.iter().find(|r| r.trace_id == "b").unwrap();
        assert!((a.attributed_ms - (4.0 + 3.0 + 2.0)).abs() < 1e-9, "{a:?}");
        assert!((b.attributed_ms - (3.0 + 6.0)).abs() < 1e-9, "{b:?}");
        assert_eq!((a.tokens, b.tokens), (3, 4));
        assert!((report.attributed_ms - report.busy_ms).abs() < 1e-9);
        assert!((report.mean_batch_size - 7.0 / 5.0).abs() < 1e-9);
        assert!(table(&report).contains(SPLIT));
        assert!(analyse(&spans[..0]).is_none());
    }

    #[test]
    fn otlp_and_jaeger_attributes_name_the_same_members() {
        let otlp: Vec<Value> = serde_json::from_value(serde_json::json!([
            {"key": "rag.decode.batch_size", "value": {"intValue": "2"}},
            {"key": "rag.decode.members.span_ids", "value": {"arrayValue": {"values": [
                {"stringValue": "AA"}, {"stringValue": "bb"}]}}},
            {"key": "rag.decode.members.trace_ids", "value": {"arrayValue": {"values": [
                {"stringValue": "t1"}, {"stringValue": "t2"}]}}},
            {"key": "rag.decode.members.request_ids", "value": {"arrayValue": {"values": [
                {"stringValue": "r1"}, {"stringValue": "r2"}]}}},
            {"key": "rag.decode.members.tokens", "value": {"arrayValue": {"values": [
                {"intValue": "1"}, {"intValue": "2"}]}}},
            {"key": "rag.decode.window.steps", "value": {"intValue": "2"}},
            {"key": "rag.decode.window.busy_ms", "value": {"doubleValue": 1.5}},
        ]))
        .unwrap();
        let from_otlp = from_otlp(Some(&otlp)).unwrap();
        assert_eq!(from_otlp.members[0].span_id, "aa");
        assert_eq!(from_otlp.members[1].tokens, 2);
        assert_eq!(from_otlp.busy_ns, Some(1_500_000));
        let jaeger: Vec<Value> = serde_json::from_value(serde_json::json!([
            {"key": "rag.decode.batch_size", "type": "int64", "value": 2},
            {"key": "rag.decode.members.span_ids", "type": "string", "value": "[\"aa\",\"bb\"]"},
            {"key": "rag.decode.members.trace_ids", "type": "string", "value": "[\"t1\",\"t2\"]"},
            {"key": "rag.decode.members.request_ids", "type": "string", "value": "[\"r1\",\"r2\"]"},
            {"key": "rag.decode.members.tokens", "type": "string", "value": "[1,2]"},
            {"key": "rag.decode.window.steps", "type": "int64", "value": 2},
            {"key": "rag.decode.window.busy_ms", "type": "float64", "value": 1.5},
        ]))
        .unwrap();
        assert_eq!(from_jaeger(Some(&jaeger)), Some(from_otlp));
        assert_eq!(from_otlp_none(), None);
    }

    fn from_otlp_none() -> Option<StepRecord> {
        from_otlp(Some(&vec![
            serde_json::json!({"key": "x", "value": {"intValue": "1"}}),
        ]))
    }
}
