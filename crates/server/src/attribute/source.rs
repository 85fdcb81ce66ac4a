//! Where `ragscope attribute` reads spans from: OTLP JSON (the collector's file exporter writes
//! one export request per line; Tempo's trace API answers the same shape), Jaeger's query API
//! JSON, or the server's own `/debug/traces`.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::{caches, SpanRecord};
use crate::config::AttributeArgs;

/// Reads every span the arguments point at.
pub async fn load(args: &AttributeArgs) -> Result<Vec<SpanRecord>> {
    let mut spans = Vec::new();
    for path in &args.file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--file: reading {}", path.display()))?;
        spans.extend(parse_otlp_text(&text).with_context(|| format!("--file {}", path.display()))?);
    }
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()?;
    if let Some(url) = &args.server {
        let url = format!(
            "{}/debug/traces?limit={}",
            url.trim_end_matches('/'),
            args.limit
        );
        spans.extend(parse_otlp(&get_json(&client, &url).await?)?);
    }
    if let Some(url) = &args.jaeger {
        let url = format!(
            "{}/api/traces?service={}&limit={}&lookback={}",
            url.trim_end_matches('/'),
            args.service,
            args.limit,
            args.lookback
        );
        spans.extend(parse_jaeger(&get_json(&client, &url).await?)?);
    }
    if let Some(url) = &args.tempo {
        let base = url.trim_end_matches('/');
        let search = format!(
            "{base}/api/search?tags=service.name%3D{}&limit={}",
            args.service, args.limit
        );
        let found = get_json(&client, &search).await?;
        let ids: Vec<&str> = found["traces"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["traceID"].as_str())
            .collect();
        for id in ids {
            let trace = get_json(&client, &format!("{base}/api/traces/{id}")).await?;
            spans.extend(parse_otlp(&trace)?);
        }
    }
    if args.file.is_empty()
        && args.server.is_none()
        && args.jaeger.is_none()
        && args.tempo.is_none()
    {
        bail!("say where the spans are: --server URL, --file PATH, --jaeger URL or --tempo URL");
    }
    Ok(spans)
}

pub(super) async fn get_json(client: &reqwest::Client, url: &str) -> Result<Value> {
    let response = client
        .get(url)
        .header("accept", "application/json")
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    if !status.is_success() {
        bail!(
            "GET {url}: {status}: {}",
            response.text().await.unwrap_or_default()
        );
    }
    response
        .json()
        .await
        .with_context(|| format!("GET {url}: not JSON"))
}

/// A file of OTLP JSON: one document, or one export request per line.
pub fn parse_otlp_text(text: &str) -> Result<Vec<SpanRecord>> {
    if let Ok(doc) = serde_json::from_str::<Value>(text) {
        return parse_otlp(&doc);
    }
    let mut spans = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let doc: Value =
            serde_json::from_str(line).with_context(|| format!("line {}: not JSON", n + 1))?;
        spans.extend(parse_otlp(&doc).with_context(|| format!("line {}", n + 1))?);
    }
    Ok(spans)
}

/// OTLP/JSON traces: `resourceSpans` (export requests), `batches` (Tempo v1) or
/// `trace.resourceSpans` (Tempo v2).
pub fn parse_otlp(doc: &Value) -> Result<Vec<SpanRecord>> {
    let resources = doc
        .get("resourceSpans")
        .or_else(|| doc.get("batches"))
        .or_else(|| doc.get("trace").and_then(|t| t.get("resourceSpans")))
        .and_then(Value::as_array)
        .context("not OTLP JSON traces: no resourceSpans")?;
    let mut spans = Vec::new();
    for resource in resources {
        let scopes = resource
            .get("scopeSpans")
            .or_else(|| resource.get("instrumentationLibrarySpans"))
            .and_then(Value::as_array);
        for scope in scopes.into_iter().flatten() {
            for s in scope["spans"].as_array().into_iter().flatten() {
                spans.push(otlp_span(s)?);
            }
        }
    }
    Ok(spans)
}

fn otlp_span(s: &Value) -> Result<SpanRecord> {
    let nanos = |key: &str| -> Result<i128> {
        match &s[key] {
            Value::String(v) => v.parse().with_context(|| format!("{key}: {v:?}")),
            Value::Number(n) => n.as_u64().map(i128::from).context(key.to_string()),
            _ => bail!("span without {key}"),
        }
    };
    let mut faults = Vec::new();
    let mut status_code = None;
    let attributes: Vec<(&str, String)> = s["attributes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            (
                a["key"].as_str().unwrap_or_default(),
                otlp_value(&a["value"]),
            )
        })
        .collect();
    for (key, value) in &attributes {
        if key.starts_with("rag.fault.") {
            faults.push((key.to_string(), value.clone()));
        } else if *key == "http.response.status_code" {
            status_code = value.parse().ok();
        }
    }
    Ok(SpanRecord {
        trace_id: id(&s["traceId"]),
        span_id: id(&s["spanId"]),
        parent_id: id(&s["parentSpanId"]),
        name: s["name"].as_str().unwrap_or_default().to_string(),
        start_ns: nanos("startTimeUnixNano")?,
        end_ns: nanos("endTimeUnixNano")?,
        faults,
        status_code,
        step: super::batch::from_otlp(s["attributes"].as_array()),
        cache: caches::from_attributes(attributes.into_iter()),
    })
}

/// Ids are hex in OTLP/JSON; Tempo sometimes answers base64. Either way they only need to match.
fn id(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_ascii_lowercase()
}

fn otlp_value(v: &Value) -> String {
    for key in ["stringValue", "intValue", "doubleValue", "boolValue"] {
        match v.get(key) {
            Some(Value::String(s)) => return s.clone(),
            Some(other) if !other.is_null() => return other.to_string(),
            _ => {}
        }
    }
    v.to_string()
}

/// Jaeger's query API (`/api/traces`): times in microseconds, parents in `references`.
pub fn parse_jaeger(doc: &Value) -> Result<Vec<SpanRecord>> {
    let traces = doc["data"]
        .as_array()
        .context("not a Jaeger /api/traces answer: no data")?;
    let mut spans = Vec::new();
    for trace in traces {
        for s in trace["spans"].as_array().into_iter().flatten() {
            let micros = |key: &str| s[key].as_i64().map(i128::from).context(key.to_string());
            let start = micros("startTime")? * 1000;
            let parent = s["references"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|r| r["refType"] == "CHILD_OF")
                .map(|r| id(&r["spanID"]))
                .unwrap_or_default();
            let mut faults = Vec::new();
            let mut status_code = None;
            let tags: Vec<(&str, String)> = s["tags"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|tag| {
                    let value = match &tag["value"] {
                        Value::String(v) => v.clone(),
                        other => other.to_string(),
                    };
                    (tag["key"].as_str().unwrap_or_default(), value)
                })
                .collect();
            for (key, value) in &tags {
                if key.starts_with("rag.fault.") {
                    faults.push((key.to_string(), value.clone()));
                } else if *key == "http.response.status_code" {
                    status_code = value.parse().ok();
                }
            }
            spans.push(SpanRecord {
                trace_id: id(&s["traceID"]),
                span_id: id(&s["spanID"]),
                parent_id: parent,
                name: s["operationName"].as_str().unwrap_or_default().to_string(),
                start_ns: start,
                end_ns: start + micros("duration")? * 1000,
                faults,
                status_code,
                step: super::batch::from_jaeger(s["tags"].as_array()),
                cache: caches::from_attributes(tags.into_iter()),
            });
        }
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn otlp_json_lines_and_tempo_answers_parse_alike() {
        let request = json!({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [
            {"traceId": "AB01", "spanId": "01", "parentSpanId": "", "name": "POST /v1/rag/query",
             "startTimeUnixNano": "1000000", "endTimeUnixNano": "9000000",
             "attributes": [{"key": "http.response.status_code", "value": {"intValue": "200"}}]},
            {"traceId": "ab01", "spanId": "02", "parentSpanId": "01", "name": "retrieval c",
             "startTimeUnixNano": 2000000, "endTimeUnixNano": 3000000,
             "attributes": [{"key": "rag.fault.delay_ms", "value": {"doubleValue": 20.0}}]}
        ]}]}]});
        let lines = format!("{request}\n\n{request}\n");
        let spans = parse_otlp_text(&lines).unwrap();
        assert_eq!(spans.len(), 4);
        assert_eq!(spans[0].trace_id, "ab01");
        assert_eq!(spans[0].status_code, Some(200));
        assert_eq!(
            spans[1].faults,
            vec![("rag.fault.delay_ms".to_string(), "20.0".to_string())]
        );
        let tempo = json!({"batches": request["resourceSpans"].clone()});
        assert_eq!(parse_otlp(&tempo).unwrap(), spans[..2].to_vec());
        assert!(parse_otlp(&json!({"data": []})).is_err());
    }

    #[test]
    fn jaeger_answers_parse_with_parents_from_references() {
        let doc = json!({"data": [{"traceID": "ab", "spans": [
            {"traceID": "ab", "spanID": "1", "operationName": "POST /v1/rag/query", "references": [],
             "startTime": 1000, "duration": 8000, "tags": [{"key": "http.response.status_code", "type": "int64", "value": 200}]},
            {"traceID": "ab", "spanID": "2", "operationName": "retrieval c",
             "references": [{"refType": "CHILD_OF", "traceID": "ab", "spanID": "1"}],
             "startTime": 2000, "duration": 1000, "tags": []}
        ]}]});
        let spans = parse_jaeger(&doc).unwrap();
        assert_eq!(spans[1].parent_id, "1");
        assert_eq!((spans[1].start_ns, spans[1].end_ns), (2_000_000, 3_000_000));
        assert_eq!(spans[0].status_code, Some(200));
        let report = super::super::analyse(&spans, &[]);
        assert_eq!(report.end_to_end_ms.p50, 8.0);
    }
}
