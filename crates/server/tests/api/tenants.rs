//! Tenants over real sockets (stand-in model stages: these tests are about who is charged what):
//! a tenant past its request rate or in token debt gets 429 with its own code and a
//! `Retry-After`, on HTTP and gRPC, while another tenant is served; the tenant comes from the
//! key, or from baggage when keys are off, and shows on the queue span and in the metrics.

use ragscope::api::grpc::proto::QueryRequest;
use serde_json::{json, Value};
use tonic::{Code, Request};

use crate::fakes::FakeGenerator;
use crate::helpers::{send_for_retry, spawn_fake_app_with, TestApp};

const NOISY: &str = "noisy-key-51c0";
const QUIET: &str = "quiet-key-8e2a";
const ADMIN: &str = "admin-key-d417";

fn query() -> Value {
    json!({"query": "What is the capital of Zorbia?", "max_tokens": 4})
}

async fn ask(
    app: &TestApp,
    key: Option<&str>,
    baggage: Option<&str>,
) -> (u16, Option<String>, Value) {
    let mut r = app.client.post(app.url("/v1/rag/query")).json(&query());
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(b) = baggage {
        r = r.header("baggage", b);
    }
    send_for_retry(r).await
}

#[tokio::test]
async fn a_tenant_past_its_rate_is_refused_while_another_is_served() {
    let (noisy, quiet, admin) = (
        format!("{NOISY} tenant=noisy"),
        format!("{QUIET} tenant=quiet"),
        format!("admin:{ADMIN} tenant=ops"),
    );
    // Spans go to the trace buffer that /debug/traces reads.
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = telemetry::tracer_provider(exporter, telemetry::resource());
    opentelemetry::global::set_tracer_provider(provider);
    let app = spawn_fake_app_with(
        FakeGenerator::new(4),
        &[
            "--api-key",
            &noisy,
            "--api-key",
            &quiet,
            "--api-key",
            &admin,
            // Two requests at once, then one every 100 s.
            "--tenant-quota",
            "noisy:rps=0.01,burst=2",
        ],
    )
    .await;
    for _ in 0..2 {
        let (status, _, body) = ask(&app, Some(NOISY), None).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, retry, body) = ask(&app, Some(NOISY), None).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    assert_eq!(body["error"]["code"], "tenant_rps", "{body}");
    let retry: u64 = retry.expect("Retry-After").parse().unwrap();
    assert!((90..=100).contains(&retry), "Retry-After {retry}");
    // Unlimited, and not slowed by the other tenant's refusals.
    for _ in 0..3 {
        let (status, _, body) = ask(&app, Some(QUIET), None).await;
        assert_eq!(status, 200, "{body}");
    }

    // gRPC charges the same bucket.
    let mut client = app.rag_client().await;
    let mut r = Request::new(QueryRequest {
        query: "What is the capital of Zorbia?".into(),
        max_tokens: Some(4),
        ..Default::default()
    });
    r.metadata_mut()
        .insert("authorization", format!("Bearer {NOISY}").parse().unwrap());
    let status = client.query(r).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.metadata().get("ragscope-error-code").unwrap(),
        "tenant_rps"
    );

    let metrics = app.metrics_text().await;
    let count = |tenant: &str, outcome: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("ragscope_tenant_requests_total{")
                    && l.contains(&format!("rag_tenant=\"{tenant}\""))
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(count("noisy", "admitted"), 2.0, "{metrics}");
    assert_eq!(count("noisy", "rps"), 2.0, "{metrics}");
    assert_eq!(count("quiet", "admitted"), 3.0, "{metrics}");

    // The queue span says whose request it was; no key is on any span.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let r = app
        .client
        .get(app.url("/debug/traces?limit=20"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let traces = r.text().await.unwrap();
    assert!(traces.contains("\"rag.tenant\""), "{traces}");
    assert!(traces.contains("\"quiet\""), "{traces}");
    for key in [NOISY, QUIET, ADMIN] {
        assert!(!traces.contains(key), "a key is on a span");
    }
    app.stop().await;
}

#[tokio::test]
async fn without_keys_a_baggage_tenant_pays_its_tokens_and_waits_off_its_debt() {
    let app = spawn_fake_app_with(
        FakeGenerator::new(4),
        &[
            "--tenant-baggage-key",
            "tenant",
            "--tenant-quota",
            "batch:tokens=1,token_burst=5",
        ],
    )
    .await;
    // The first request is admitted on a full bucket and costs more than its five tokens.
    let (status, _, body) = ask(&app, None, Some("tenant=batch")).await;
    assert_eq!(status, 200, "{body}");
    let used = body["usage"]["total_tokens"].as_u64().unwrap();
    assert!(used > 5, "{body}");
    let (status, retry, body) = ask(&app, None, Some("tenant=batch")).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "tenant_tokens", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("token quota"),
        "{body}"
    );
    // The debt at one token a second.
    let retry: u64 = retry.expect("Retry-After").parse().unwrap();
    assert!(
        retry + 5 >= used && retry <= used,
        "Retry-After {retry} for {used} tokens"
    );
    // Other baggage values, and none, are other tenants.
    for baggage in [Some("tenant=someone-else"), None] {
        let (status, _, body) = ask(&app, None, baggage).await;
        assert_eq!(status, 200, "{baggage:?}: {body}");
    }
    let metrics = app.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ragscope_tenant_tokens_total{")
                && l.contains("rag_tenant=\"batch\"")
                && l.ends_with(&format!(" {used}"))),
        "{metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn bad_quota_flags_are_refused_by_name() {
    for (flags, says) in [
        (vec!["--tenant-quota", "acme rps=1"], "expected NAME:"),
        (
            vec!["--tenant-quota", "acme:rps=fast"],
            "`rps` must be a positive number",
        ),
        (
            vec!["--tenant-quota", "acme:speed=1"],
            "unknown quota setting `speed`",
        ),
        (vec!["--api-key", "k tenant=no/slash"], "tenant name"),
    ] {
        let args = crate::helpers::serve_args(std::path::Path::new("unused"), &flags);
        let keys = ragscope::api::auth::ApiKeys::from_args(&args.auth);
        let e = match keys {
            Err(e) => e.to_string(),
            Ok(keys) => rag::tenant::Tenants::new(&args.tenants, &keys.tenants()).unwrap_err(),
        };
        assert!(e.contains(says), "{flags:?}: {e}");
    }
}
