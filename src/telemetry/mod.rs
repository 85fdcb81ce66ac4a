//! Telemetry: the shared clock, stage spans, and the exporters behind them.
//!
//! [`init`] sets up logging and, when an OTLP endpoint is configured through the standard
//! `OTEL_*` variables, a batch span exporter over gRPC or HTTP/protobuf. It returns a guard that
//! flushes and shuts the providers down when dropped. Export runs on the SDK's own thread and
//! never blocks a request; a dead collector costs dropped spans, not requests.

pub mod clock;
pub mod span;

use std::env;

use anyhow::{bail, Result};
use opentelemetry::baggage::BaggageExt;
use opentelemetry::propagation::{Extractor, TextMapCompositePropagator};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::EnvFilter;

/// The default `service.name` when `OTEL_SERVICE_NAME` is unset.
pub const SERVICE_NAME: &str = "ragscope";

/// Baggage members copied as attributes onto every span of a request.
const BAGGAGE_ATTRIBUTES_ENV: &str = "RAGSCOPE_BAGGAGE_ATTRIBUTES";

/// Flushes and shuts down the tracer provider on drop.
pub struct TelemetryGuard {
    tracer: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.tracer.take() {
            let _ = provider.force_flush();
            let _ = provider.shutdown();
        }
    }
}

fn env_nonempty(name: &str) -> Option<String> {
    env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Whether spans should be exported: an endpoint is configured, or `OTEL_TRACES_EXPORTER=otlp`
/// asks for the default one; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off.
fn tracing_wanted() -> bool {
    if env_nonempty("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    match env_nonempty("OTEL_TRACES_EXPORTER").as_deref() {
        Some("none") => false,
        Some(_) => true,
        None => {
            env_nonempty("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
                || env_nonempty("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        }
    }
}

/// The OTLP protocol from `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`
/// (default `http/protobuf`, as the specification says).
fn traces_protocol() -> Result<Protocol> {
    let value = env_nonempty("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| env_nonempty("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into());
    match value.as_str() {
        "grpc" => Ok(Protocol::Grpc),
        "http/protobuf" => Ok(Protocol::HttpBinary),
        other => bail!("OTEL_EXPORTER_OTLP_PROTOCOL={other}: supported are grpc and http/protobuf"),
    }
}

/// Sets up logs (to stderr, `RUST_LOG` filter) and span export. Call once, inside the tokio
/// runtime (the gRPC exporter's channel lives on it).
pub fn init() -> Result<TelemetryGuard> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    if !tracing_wanted() {
        tracing::info!("span export off (set OTEL_EXPORTER_OTLP_ENDPOINT to turn it on)");
        return Ok(TelemetryGuard { tracer: None });
    }
    let protocol = traces_protocol()?;
    let exporter = match protocol {
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?,
        _ => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(protocol)
            .build()?,
    };
    let resource = Resource::builder()
        .with_service_name(env_nonempty("OTEL_SERVICE_NAME").unwrap_or_else(|| SERVICE_NAME.into()))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    tracing::info!(?protocol, "exporting spans over OTLP");
    Ok(TelemetryGuard {
        tracer: Some(provider),
    })
}

struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The caller's trace context and baggage from W3C `traceparent`/`tracestate`/`baggage`.
pub fn extract_context(headers: &axum::http::HeaderMap) -> Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// Baggage members named in `RAGSCOPE_BAGGAGE_ATTRIBUTES` (comma-separated), as attributes
/// `baggage.<key>`, so one `colour=blue` header colours every span of the request.
pub fn baggage_attributes(cx: &Context) -> Vec<KeyValue> {
    let Some(wanted) = env_nonempty(BAGGAGE_ATTRIBUTES_ENV) else {
        return Vec::new();
    };
    let baggage = cx.baggage();
    wanted
        .split(',')
        .map(str::trim)
        .filter_map(|key| {
            baggage
                .get(key)
                .map(|v| KeyValue::new(format!("baggage.{key}"), v.to_string()))
        })
        .collect()
}
