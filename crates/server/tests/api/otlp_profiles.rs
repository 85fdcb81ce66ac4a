//! The CPU samples as the OTLP profiles signal: an in-process receiver built from the
//! `v1development` protos gets the samples of real queries, each linked to the trace and span
//! of the stage that ran, with candle's frames in the chat stage's stacks. A dead receiver
//! costs counted profiles, never a request, and the Pyroscope push beside it goes on.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::profiles::v1development::{
    Function, KeyValueAndUnit, Link, Location, Mapping, Stack,
};
use opentelemetry_sdk::trace::InMemorySpanExporter;
use telemetry::profile::{self, ProfileSettings};

use crate::helpers::spawn_app;
use crate::receiver::{self, hex, Received};

/// One received sample, resolved through its request's dictionary.
#[derive(Debug)]
struct Resolved {
    /// (trace id, span id) in hex, when linked.
    link: Option<(String, String)>,
    frames: Vec<String>,
    attributes: HashMap<String, String>,
    nanos: i64,
}

fn resolve(requests: &[ExportProfilesServiceRequest]) -> Vec<Resolved> {
    let mut out = Vec::new();
    for request in requests {
        let dict = request.dictionary.as_ref().expect("a dictionary");
        // Every table opens with its zero value, so index 0 can mean "none".
        assert_eq!(dict.string_table[0], "");
        assert_eq!(dict.mapping_table[0], Mapping::default());
        assert_eq!(dict.location_table[0], Location::default());
        assert_eq!(dict.function_table[0], Function::default());
        assert_eq!(dict.link_table[0], Link::default());
        assert_eq!(dict.attribute_table[0], KeyValueAndUnit::default());
        assert_eq!(dict.stack_table[0], Stack::default());
        let s = |i: i32| dict.string_table[i as usize].clone();
        for rp in &request.resource_profiles {
            let service = rp
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .and_then(|a| a.value.as_ref()?.value.clone());
            assert_eq!(service, Some(AnyValue::StringValue("ragscope".into())));
            for profile in rp.scope_profiles.iter().flat_map(|sp| &sp.profiles) {
                let cpu = profile.sample_type.expect("a sample type");
                assert_eq!(
                    (s(cpu.type_strindex), s(cpu.unit_strindex)),
                    ("cpu".into(), "nanoseconds".into())
                );
                assert_eq!(profile.period, 10_000_000, "100 Hz");
                for sample in &profile.sample {
                    let link = (sample.link_index != 0).then(|| {
                        let l = &dict.link_table[sample.link_index as usize];
                        (hex(&l.trace_id), hex(&l.span_id))
                    });
                    let frames = dict.stack_table[sample.stack_index as usize]
                        .location_indices
                        .iter()
                        .flat_map(|l| &dict.location_table[*l as usize].line)
                        .map(|line| {
                            s(dict.function_table[line.function_index as usize].name_strindex)
                        })
                        .collect();
                    let attributes = sample
                        .attribute_indices
                        .iter()
                        .map(|a| &dict.attribute_table[*a as usize])
                        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
                            AnyValue::StringValue(v) => Some((s(kv.key_strindex), v.clone())),
                            _ => None,
                        })
                        .collect();
                    out.push(Resolved {
                        link,
                        frames,
                        attributes,
                        nanos: sample.values.iter().sum(),
                    });
                }
            }
        }
    }
    out
}

/// Real queries while CPU samples go out as OTLP profiles only (no Pyroscope) to an
/// in-process receiver: what it got, and the spans.
async fn profile_queries() -> (Vec<ExportProfilesServiceRequest>, InMemorySpanExporter) {
    let received = Received::default();
    let endpoint = receiver::grpc(received.clone()).await;
    let (exporter, tracer, guard) = crate::profile::profiling_to(None, Some(endpoint));
    let app = spawn_app().await;
    app.ingest_fixtures().await;
    crate::profile::ask_three_and_stop(&app, tracer, guard).await;
    let requests = received.profiles.lock().unwrap().clone();
    (requests, exporter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_profile_samples_link_to_the_trace_and_span_of_their_stage() {
    let (requests, exporter) = profile_queries().await;
    assert!(!requests.is_empty(), "no OTLP profiles arrived");
    let samples = resolve(&requests);
    // span id -> (trace id, span name) of every span marked as profiled.
    let profiled: HashMap<String, (String, String)> = exporter
        .get_finished_spans()
        .unwrap()
        .iter()
        .filter(|s| {
            s.attributes
                .iter()
                .any(|a| a.key.as_str() == "pyroscope.profile.id")
        })
        .map(|s| {
            (
                s.span_context.span_id().to_string(),
                (s.span_context.trace_id().to_string(), s.name.to_string()),
            )
        })
        .collect();
    let linked: Vec<&Resolved> = samples.iter().filter(|s| s.link.is_some()).collect();
    let mut by_name: HashMap<String, (usize, i64)> = HashMap::new();
    for s in &linked {
        let (trace, span) = s.link.as_ref().unwrap();
        let (span_trace, name) = profiled
            .get(span)
            .unwrap_or_else(|| panic!("a sample links to unknown span {span}"));
        assert_eq!(trace, span_trace, "the link's trace is its span's trace");
        assert_eq!(
            s.attributes.get("span_name"),
            Some(name),
            "the span_name attribute names the linked span"
        );
        let entry = by_name.entry(name.clone()).or_default();
        entry.0 += 1;
        entry.1 += s.nanos;
    }
    println!(
        "{} requests, {} samples, {} linked; by span name (samples, CPU ns): {by_name:?}",
        requests.len(),
        samples.len(),
        linked.len()
    );
    let chat: Vec<&&Resolved> = linked
        .iter()
        .filter(|s| profiled[&s.link.as_ref().unwrap().1].1.starts_with("chat "))
        .collect();
    assert!(!chat.is_empty(), "no sample links to a chat span");
    assert!(
        chat.iter()
            .any(|s| s.frames.iter().any(|f| f.contains("candle"))),
        "the chat samples' stacks hold no candle frame"
    );
    assert!(samples.iter().all(|s| s.nanos > 0 && !s.frames.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_otlp_profiles_receiver_costs_counted_profiles_not_requests() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (pyroscope, pushes) = crate::profile::receiver().await;
    let guard = profile::start(&ProfileSettings {
        url: Some(pyroscope),
        otlp_endpoint: Some(format!("http://{dead}")),
        application: "ragscope-test".into(),
        sample_rate: 100,
        upload_interval: Duration::from_millis(500),
    })
    .unwrap();
    let started = Instant::now();
    crate::profile::twenty_queries_answered().await;
    // Some CPU of our own, so every interval has samples to send.
    let mut x = 0u64;
    while started.elapsed() < Duration::from_secs(2) {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
    }
    tokio::task::spawn_blocking(move || drop(guard))
        .await
        .unwrap();
    let stats = profile::otlp::stats();
    let failed = stats.dropped_export_failed.load(Ordering::Relaxed);
    println!(
        "OTLP profiles: {failed} failed, {} exported; {} Pyroscope pushes",
        stats.exported.load(Ordering::Relaxed),
        pushes.lock().unwrap().len()
    );
    assert!(failed > 0, "the failed exports were not counted");
    assert_eq!(stats.exported.load(Ordering::Relaxed), 0);
    assert!(
        !pushes.lock().unwrap().is_empty(),
        "the Pyroscope push stopped with the OTLP receiver dead"
    );
}
