//! `/admin/telemetry`: the trace sampling ratio, the decode-step spans and content capture
//! change while the server runs, each change is recorded, and bad input changes nothing; and
//! the server's start is a trace of its own.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_fake_app_with, TestApp};

const TOKEN: &str = "telemetry-s3cret";

async fn put(app: &TestApp, body: Value) -> (StatusCode, Value) {
    let r = app
        .client
        .put(app.url("/admin/telemetry"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status(), r.json().await.unwrap())
}

/// Asks a question; returns its trace id and the spans `/debug/traces` holds of that trace.
async fn ask(app: &TestApp) -> (String, Vec<Value>) {
    let r = app
        .client
        .post(app.url("/v1/rag/query"))
        .json(&json!({"query": "What is the capital of Zorbia?", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let trace = r.headers()["x-trace-id"].to_str().unwrap().to_string();
    r.bytes().await.unwrap();
    (
        trace.clone(),
        spans(app, |s| s["traceId"] == trace.as_str()).await,
    )
}

async fn spans(app: &TestApp, keep: impl Fn(&Value) -> bool) -> Vec<Value> {
    // The request span ends as its last byte goes out: give the buffer a moment.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let doc = get_json(&app.client, &app.url("/debug/traces")).await;
    all_spans(&doc)
        .into_iter()
        .filter(|s| keep(s))
        .cloned()
        .collect()
}

async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

/// Every span of an OTLP JSON document.
fn all_spans(doc: &Value) -> Vec<&Value> {
    doc["resourceSpans"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| r["scopeSpans"].as_array().into_iter().flatten())
        .flat_map(|s| s["spans"].as_array().into_iter().flatten())
        .collect()
}

fn has_attribute(spans: &[Value], key: &str) -> bool {
    spans.iter().any(|s| {
        s["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a["key"] == key)
    })
}

#[tokio::test]
async fn sampling_steps_and_capture_change_without_a_restart() {
    crate::stages::record_spans();
    let app = spawn_fake_app_with(FakeGenerator::new(2), &[]).await;
    app.ingest(json!([{"id": "z", "text": "The capital of Zorbia is Zorb."}]))
        .await;
    // Without a token configured (and no admin key) the route does not exist.
    let r = app
        .client
        .get(app.url("/admin/telemetry"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    telemetry::controls::set_admin_token(Some(TOKEN));
    let r = app
        .client
        .get(app.url("/admin/telemetry"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = app
        .client
        .get(app.url("/admin/telemetry"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let settings: Value = r.json().await.unwrap();
    assert_eq!(settings["trace_sampling_ratio"], 1.0);
    assert_eq!(settings["capture_content"], false);
    // Bad input is refused by name, and changes nothing (not even the valid fields beside it).
    for (body, field) in [
        (json!({"trace_sampling_ratio": 2}), "trace_sampling_ratio"),
        (
            json!({"decode_step_spans": "some", "capture_content": true}),
            "decode_step_spans",
        ),
        (json!({"verbosity": "high"}), "verbosity"),
    ] {
        let (status, e) = put(&app, body).await;
        assert_eq!(status, 400, "{e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(field),
            "{e}"
        );
    }
    let (_, spans_before) = ask(&app).await;
    assert!(!spans_before.is_empty());
    assert!(!has_attribute(&spans_before, "rag.query.text"));
    // Sampling off: a new request leaves no spans at all.
    let (status, now) = put(
        &app,
        json!({"trace_sampling_ratio": 0.0, "decode_step_spans": "all", "capture_content": true}),
    )
    .await;
    assert_eq!(status, 200, "{now}");
    assert_eq!(
        now,
        json!({"trace_sampling_ratio": 0.0, "decode_step_spans": "all", "capture_content": true})
    );
    let (_, unsampled) = ask(&app).await;
    assert!(unsampled.is_empty(), "{unsampled:?}");
    // Back on: the next request is traced, with its question on the request span.
    put(&app, json!({"trace_sampling_ratio": 1.0})).await;
    let (_, traced) = ask(&app).await;
    assert!(has_attribute(&traced, "rag.query.text"), "{traced:?}");
    // Each change left a `telemetry_change` event naming the setting.
    let changes = spans(&app, |s| s["name"] == "telemetry_change").await;
    let changed: Vec<&str> = changes
        .iter()
        .flat_map(|s| s["events"].as_array().into_iter().flatten())
        .flat_map(|e| e["attributes"].as_array().into_iter().flatten())
        .filter(|a| a["key"] == "rag.telemetry.setting")
        .filter_map(|a| a["value"]["stringValue"].as_str())
        .collect();
    for setting in [
        "trace_sampling_ratio",
        "decode_step_spans",
        "capture_content",
    ] {
        assert!(changed.contains(&setting), "{changed:?}");
    }
}

/// The real binary's start is a `startup` trace in its own `/debug/traces`, with the model
/// load and the store open under it, ending before `/ready` says ready.
#[tokio::test]
async fn the_start_is_a_trace_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let child = crate::overload::Child::spawn(dir.path(), &[]);
    let client = reqwest::Client::new();
    let started = std::time::Instant::now();
    while !client
        .get(child.url("/ready"))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(180),
            "not ready:\n{}",
            child.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let doc = get_json(&client, &child.url("/debug/traces")).await;
    let spans = all_spans(&doc);
    let root = spans
        .iter()
        .find(|s| s["name"] == "startup")
        .unwrap_or_else(|| panic!("no startup span: {doc}"));
    let children: Vec<&str> = spans
        .iter()
        .filter(|s| s["parentSpanId"] == root["spanId"])
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(children, ["load_models", "open_store"], "{doc}");
    let nanos = |s: &Value, k: &str| s[k].as_str().unwrap().parse::<u128>().unwrap();
    let (start, end) = (
        nanos(root, "startTimeUnixNano"),
        nanos(root, "endTimeUnixNano"),
    );
    for child in spans.iter().filter(|s| s["parentSpanId"] == root["spanId"]) {
        assert!(
            nanos(child, "startTimeUnixNano") >= start && nanos(child, "endTimeUnixNano") <= end
        );
    }
}
