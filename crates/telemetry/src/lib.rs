//! Telemetry: the shared clock, stage spans, and the exporters behind them.
//!
//! [`init`] takes our own settings ([`TelemetryArgs`]) and sets up logging and, when an OTLP
//! endpoint is configured through the standard `OTEL_*` variables, a batch span exporter over
//! gRPC or HTTP/protobuf. It returns a guard that flushes and shuts the providers down when
//! dropped. Export runs on the SDK's own thread and never blocks a request; a dead collector
//! costs dropped spans, not requests.

pub mod buffer;
pub mod clock;
pub mod compat;
pub mod controls;
pub mod export;
pub mod gpu;
pub mod metrics;
pub mod names;
pub mod openinference;
pub mod profile;
pub mod settings;
pub mod span;
pub mod stage_events;

use std::collections::HashMap;
use std::env;
use std::sync::Arc;

use anyhow::{bail, Result};
use opentelemetry::baggage::BaggageExt;
use opentelemetry::propagation::{Extractor, TextMapCompositePropagator, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing_subscriber::EnvFilter;

use crate::names::{attr, metric};
use export::{ExportQueue, ExportStats, QueueSettings};
pub use settings::TelemetryArgs;

/// The default `service.name` when `OTEL_SERVICE_NAME` is unset.
pub const SERVICE_NAME: &str = "ragscope";

/// Baggage members copied as attributes onto every span of a request (`--baggage-attributes`),
/// set once by [`init`]; none before it.
static BAGGAGE_KEYS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Flushes and shuts down the providers on drop.
pub struct TelemetryGuard {
    tracer: Option<SdkTracerProvider>,
    /// One provider per stage service (`--stage-services`), and the decode steps' one.
    stage_tracers: Vec<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
    /// Stops the Pyroscope agent last, after the spans that point at its profiles.
    _profiler: Option<profile::ProfilerGuard>,
}

impl TelemetryGuard {
    /// Exports everything recorded so far (tests, and before exit).
    pub fn flush(&self) {
        for p in self.tracer.iter().chain(&self.stage_tracers) {
            let _ = p.force_flush();
        }
        if let Some(p) = &self.meter {
            let _ = p.force_flush();
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        self.flush();
        for provider in self
            .tracer
            .take()
            .into_iter()
            .chain(self.stage_tracers.drain(..))
        {
            let _ = provider.shutdown();
        }
        if let Some(provider) = self.meter.take() {
            let _ = provider.shutdown();
        }
    }
}

static EXPORT_STATS: std::sync::OnceLock<Arc<ExportStats>> = std::sync::OnceLock::new();

/// What happened to finished spans in this process (exported, dropped).
pub fn export_stats() -> Arc<ExportStats> {
    EXPORT_STATS.get_or_init(Default::default).clone()
}

/// A tracer provider whose spans go through our non-blocking [`ExportQueue`] to `exporter`.
pub fn tracer_provider<E: SpanExporter + 'static>(
    exporter: E,
    resource: Resource,
) -> SdkTracerProvider {
    let queue = ExportQueue::new(exporter, QueueSettings::from_env(), export_stats());
    let mut builder = SdkTracerProvider::builder()
        .with_sampler(controls::RatioSampler)
        .with_span_processor(queue);
    if let Some(recent) = buffer::processor() {
        builder = builder.with_span_processor(recent);
    }
    builder.with_resource(resource).build()
}

/// `service.name` from `OTEL_SERVICE_NAME` (default `ragscope`) plus `OTEL_RESOURCE_ATTRIBUTES`.
pub fn resource() -> Resource {
    Resource::builder()
        .with_service_name(service_name())
        .with_attribute(KeyValue::new(
            attr::SERVICE_VERSION,
            env!("CARGO_PKG_VERSION"),
        ))
        .build()
}

/// The process's `service.name`: `OTEL_SERVICE_NAME`, default `ragscope`.
pub fn service_name() -> String {
    env_nonempty("OTEL_SERVICE_NAME").unwrap_or_else(|| SERVICE_NAME.into())
}

pub(crate) fn env_nonempty(name: &str) -> Option<String> {
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

/// The OTLP protocol for a signal (`TRACES`, `METRICS`) from
/// `OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` (default
/// `http/protobuf`, as the specification says).
fn protocol_for(signal: &str) -> Result<Protocol> {
    let value = env_nonempty(&format!("OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"))
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
pub fn init(args: &TelemetryArgs) -> Result<TelemetryGuard> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    if !buffer::configure(args.trace_buffer) {
        tracing::warn!("the recent-trace buffer existed before telemetry started; its size stays");
    }
    let _ = BAGGAGE_KEYS.set(args.baggage_keys());
    compat::choose(args.metrics_compat);
    controls::set_admin_token(args.telemetry_admin_token.as_deref());
    let _ = controls::set_sampling_ratio(controls::ratio_from_env());
    opentelemetry::global::set_text_map_propagator(w3c_propagator());
    let meter = meter_provider()?;
    let service = service_name();
    let profiler = match profile::ProfileSettings::from_args(args, &service) {
        Some(settings) => Some(profile::start(&settings)?),
        None => None,
    };
    if !tracing_wanted() {
        tracing::info!("span export off (set OTEL_EXPORTER_OTLP_ENDPOINT to turn it on)");
        // Spans still feed the recent-trace buffer (`/debug/traces`) unless the SDK is off.
        let sdk_off =
            env_nonempty("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let tracer = buffer::processor().filter(|_| !sdk_off).map(|recent| {
            let provider = SdkTracerProvider::builder()
                .with_sampler(controls::RatioSampler)
                .with_span_processor(recent)
                .with_resource(trace_resource())
                .build();
            opentelemetry::global::set_tracer_provider(provider.clone());
            provider
        });
        let background = tracer
            .is_some()
            .then(|| install_background_services(|| None::<opentelemetry_otlp::SpanExporter>));
        return Ok(TelemetryGuard {
            tracer,
            stage_tracers: background.into_iter().flatten().collect(),
            meter: Some(meter),
            _profiler: profiler,
        });
    }
    let protocol = protocol_for("TRACES")?;
    let provider = tracer_provider(otlp_span_exporter(protocol)?, trace_resource());
    opentelemetry::global::set_tracer_provider(provider.clone());
    let mut stage_providers = if args.stage_services {
        tracing::info!("each stage exported under its own service.name");
        install_stage_services(|| otlp_span_exporter(protocol))?
    } else {
        Vec::new()
    };
    stage_providers.extend(install_background_services(|| {
        otlp_span_exporter(protocol)
            .inspect_err(|e| tracing::warn!("steps and lifecycle spans stay local: {e:#}"))
            .ok()
    }));
    tracing::info!(?protocol, "exporting spans over OTLP");
    Ok(TelemetryGuard {
        tracer: Some(provider),
        stage_tracers: stage_providers,
        meter: Some(meter),
        _profiler: profiler,
    })
}

fn otlp_span_exporter(protocol: Protocol) -> Result<opentelemetry_otlp::SpanExporter> {
    Ok(match protocol {
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?,
        _ => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(protocol)
            .build()?,
    })
}

/// Exports each pipeline stage under its own `service.name` (`ragscope-embed`, …), so
/// Jaeger and Tempo draw stages in different colours; parentage is unchanged. Returns the
/// providers to flush and shut down.
pub fn install_stage_services<E: SpanExporter + 'static>(
    make_exporter: impl Fn() -> Result<E>,
) -> Result<Vec<SdkTracerProvider>> {
    let mut tracers = HashMap::new();
    let mut providers = Vec::new();
    for service in names::stage_services() {
        let resource = Resource::builder()
            .with_service_name(service)
            .with_attribute(KeyValue::new(
                attr::SERVICE_VERSION,
                env!("CARGO_PKG_VERSION"),
            ))
            .build();
        let provider = tracer_provider(make_exporter()?, resource);
        tracers.insert(service, provider.tracer(span::SCOPE));
        providers.push(provider);
    }
    let _ = STAGE_TRACERS.set(tracers);
    Ok(providers)
}

static STAGE_TRACERS: std::sync::OnceLock<HashMap<&'static str, SdkTracer>> =
    std::sync::OnceLock::new();

static STEP_TRACER: std::sync::OnceLock<SdkTracer> = std::sync::OnceLock::new();
static LIFECYCLE_TRACER: std::sync::OnceLock<SdkTracer> = std::sync::OnceLock::new();

/// The tracer of a per-stage service, when per-stage services are on, or of the decode steps'
/// or the server's own lifecycle service ([`names::STEPS_SERVICE`],
/// [`names::LIFECYCLE_SERVICE`]) once [`install_background_services`] ran.
pub(crate) fn stage_tracer(service: &str) -> Option<&'static SdkTracer> {
    match service {
        names::STEPS_SERVICE => STEP_TRACER.get(),
        names::LIFECYCLE_SERVICE => LIFECYCLE_TRACER.get(),
        _ => STAGE_TRACERS.get()?.get(service),
    }
}

/// The resource of the request traces: `service.name`, its version, and the same name as the
/// OpenInference project (Phoenix files a trace under its resource's project).
pub fn trace_resource() -> Resource {
    let service = service_name();
    Resource::builder()
        .with_service_name(service.clone())
        .with_attribute(KeyValue::new(
            attr::SERVICE_VERSION,
            env!("CARGO_PKG_VERSION"),
        ))
        .with_attribute(KeyValue::new(attr::OPENINFERENCE_PROJECT_NAME, service))
        .build()
}

/// The service (and OpenInference project) batched decode steps are exported under:
/// `{service.name}-steps`.
pub fn steps_service_name() -> String {
    format!("{}-steps", service_name())
}

/// Exports batched decode steps (`decode_step`, each the root of a trace of its own) under
/// `{service.name}-steps`, and the server's own lifecycle (`startup`, `telemetry_change`)
/// under `{service.name}-lifecycle`, so a backend's list of `ragscope` traces and its latency
/// summary hold requests only: Jaeger lists the others under their own services, Tempo finds
/// requests with `{ resource.service.name = "ragscope" }`, Phoenix files them in their own
/// projects. Without an exporter, they still reach the recent-trace buffer under those
/// services.
pub fn install_background_services<E: SpanExporter + 'static>(
    exporter: impl Fn() -> Option<E>,
) -> Vec<SdkTracerProvider> {
    vec![
        background_provider(exporter(), steps_service_name(), &STEP_TRACER),
        background_provider(
            exporter(),
            format!("{}-lifecycle", service_name()),
            &LIFECYCLE_TRACER,
        ),
    ]
}

fn background_provider<E: SpanExporter + 'static>(
    exporter: Option<E>,
    name: String,
    slot: &std::sync::OnceLock<SdkTracer>,
) -> SdkTracerProvider {
    let resource = Resource::builder()
        .with_service_name(name.clone())
        .with_attribute(KeyValue::new(
            attr::SERVICE_VERSION,
            env!("CARGO_PKG_VERSION"),
        ))
        .with_attribute(KeyValue::new(attr::OPENINFERENCE_PROJECT_NAME, name))
        .build();
    let provider = match exporter {
        Some(exporter) => tracer_provider(exporter, resource),
        None => {
            let mut builder = SdkTracerProvider::builder()
                .with_sampler(controls::RatioSampler)
                .with_resource(resource);
            if let Some(recent) = buffer::processor() {
                builder = builder.with_span_processor(recent);
            }
            builder.build()
        }
    };
    let _ = slot.set(provider.tracer(span::SCOPE));
    provider
}

/// The meter provider: always the `/metrics` scrape reader; plus an OTLP push every
/// `OTEL_METRIC_EXPORT_INTERVAL` when an endpoint is configured.
fn meter_provider() -> Result<SdkMeterProvider> {
    let mut builder = SdkMeterProvider::builder()
        .with_resource(resource())
        .with_reader(metrics::scrape_reader());
    let metrics_wanted = tracing_wanted()
        && !matches!(
            env_nonempty("OTEL_METRICS_EXPORTER").as_deref(),
            Some("none")
        );
    if metrics_wanted {
        let protocol = protocol_for("METRICS")?;
        let exporter = match protocol {
            Protocol::Grpc => opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .build()?,
            _ => opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_protocol(protocol)
                .build()?,
        };
        builder = builder.with_periodic_exporter(exporter);
    }
    let provider = builder.build();
    opentelemetry::global::set_meter_provider(provider.clone());
    register_process_gauges();
    Ok(provider)
}

/// User plus system CPU seconds of this process, from `/proc/self/stat` (Linux; clock ticks at
/// the kernel's usual 100 Hz).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// Gauges read at collection time: dropped spans, profiles and stage events, KV cache, prefix
/// cache, GPU memory and build info.
pub(crate) fn register_process_gauges() {
    let meter = opentelemetry::global::meter(span::SCOPE);
    // The server's own CPU seconds: a load generator on another box reads them from /metrics
    // to tell how busy the server was (its isolation check).
    let _cpu = meter
        .f64_observable_counter(metric::PROCESS_CPU_TIME)
        .with_unit("s")
        .with_description("CPU time this process has used, user plus system")
        .with_callback(|o| {
            if let Some(s) = process_cpu_seconds() {
                o.observe(s, &[]);
            }
        })
        .build();
    dropped_counter(
        &meter,
        metric::SPANS_DROPPED,
        "{span}",
        "Finished spans not exported: queue full or export failed",
        export_stats(),
    );
    dropped_counter(
        &meter,
        metric::PROFILES_DROPPED,
        "{profile}",
        "OTLP profiles (one per upload interval) not exported: queue full or export failed",
        profile::otlp::stats(),
    );
    let _kv_bytes = meter
        .u64_observable_gauge(metric::KV_CACHE_BYTES)
        .with_unit("By")
        .with_description("KV-cache memory held by running generations")
        .with_callback(|o| {
            o.observe(
                metrics::KV_CACHE
                    .bytes
                    .load(std::sync::atomic::Ordering::Relaxed),
                &[],
            )
        })
        .build();
    let _kv_tokens = meter
        .u64_observable_gauge(metric::KV_CACHE_TOKENS)
        .with_unit("{token}")
        .with_description("Token positions reserved in the KV caches of running generations")
        .with_callback(|o| {
            o.observe(
                metrics::KV_CACHE
                    .tokens
                    .load(std::sync::atomic::Ordering::Relaxed),
                &[],
            )
        })
        .build();
    let _decode_batch = meter
        .u64_observable_gauge(metric::DECODE_BATCH_SIZE)
        .with_unit("{sequence}")
        .with_description("Requests in the latest batched decode step")
        .with_callback(|o| {
            o.observe(
                metrics::DECODE_BATCH
                    .last
                    .load(std::sync::atomic::Ordering::Relaxed),
                &[],
            )
        })
        .build();
    let prefix = &metrics::PREFIX_CACHE;
    for (name, unit, description, count) in [
        (
            metric::PREFIX_CACHE_LOOKUPS,
            "{lookup}",
            "Prefills that looked for a cached prompt prefix",
            &prefix.lookups,
        ),
        (
            metric::PREFIX_CACHE_HITS,
            "{lookup}",
            "Prefix-cache lookups that found a cached prefix",
            &prefix.hits,
        ),
        (
            metric::PREFIX_CACHE_HIT_TOKENS,
            "{token}",
            "Prompt tokens copied from the prefix cache instead of computed",
            &prefix.hit_tokens,
        ),
        (
            metric::PREFIX_CACHE_EVICTIONS,
            "{block}",
            "Prefix-cache blocks evicted to stay within --prefix-cache-mb",
            &prefix.evictions,
        ),
    ] {
        let _counter = meter
            .u64_observable_counter(name)
            .with_unit(unit)
            .with_description(description)
            .with_callback(move |o| {
                o.observe(count.load(std::sync::atomic::Ordering::Relaxed), &[])
            })
            .build();
    }
    let _prefix_bytes = meter
        .u64_observable_gauge(metric::PREFIX_CACHE_BYTES)
        .with_unit("By")
        .with_description("Memory held by the prefix cache's blocks")
        .with_callback(|o| {
            o.observe(
                metrics::PREFIX_CACHE
                    .bytes
                    .load(std::sync::atomic::Ordering::Relaxed),
                &[],
            )
        })
        .build();
    gpu::memory::register(&meter);
    stage_events::register(&meter);
    let _build = meter
        .u64_observable_gauge(metric::BUILD_INFO)
        .with_description("Always 1; the labels say which build is running")
        .with_callback(|o| {
            o.observe(
                1,
                &[KeyValue::new(attr::VERSION, env!("CARGO_PKG_VERSION"))],
            );
        })
        .build();
}

/// What an exporter dropped, by `reason` (queue_full, export_failed).
fn dropped_counter(
    meter: &opentelemetry::metrics::Meter,
    name: &'static str,
    unit: &'static str,
    description: &'static str,
    stats: Arc<ExportStats>,
) {
    let _counter = meter
        .u64_observable_counter(name)
        .with_unit(unit)
        .with_description(description)
        .with_callback(move |o| {
            use std::sync::atomic::Ordering::Relaxed;
            o.observe(
                stats.dropped_queue_full.load(Relaxed),
                &[KeyValue::new(attr::REASON, "queue_full")],
            );
            o.observe(
                stats.dropped_export_failed.load(Relaxed),
                &[KeyValue::new(attr::REASON, "export_failed")],
            );
        })
        .build();
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// W3C trace context and baggage, the propagation every ingress and egress uses.
fn w3c_propagator() -> TextMapCompositePropagator {
    TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ])
}

/// The caller's trace context and baggage from W3C `traceparent`/`tracestate`/`baggage`.
pub fn extract_context(headers: &http::HeaderMap) -> Context {
    static PROPAGATOR: std::sync::OnceLock<TextMapCompositePropagator> = std::sync::OnceLock::new();
    PROPAGATOR
        .get_or_init(w3c_propagator)
        .extract(&HeaderExtractor(headers))
}

/// `cx`'s trace context and baggage as W3C `traceparent`/`tracestate`/`baggage` header pairs,
/// for calls this server makes (nothing when `cx` holds no valid span and no baggage).
pub fn inject_context(cx: &Context) -> Vec<(String, String)> {
    static PROPAGATOR: std::sync::OnceLock<TextMapCompositePropagator> = std::sync::OnceLock::new();
    let mut headers = std::collections::HashMap::new();
    PROPAGATOR
        .get_or_init(w3c_propagator)
        .inject_context(cx, &mut headers);
    let mut pairs: Vec<(String, String)> = headers.into_iter().collect();
    pairs.sort();
    pairs
}

/// Baggage members named in `--baggage-attributes`, as attributes `baggage.<key>`, so one
/// `colour=blue` header colours every span of the request.
pub fn baggage_attributes(cx: &Context) -> Vec<KeyValue> {
    match BAGGAGE_KEYS.get() {
        Some(keys) if !keys.is_empty() => copy_baggage(keys, cx),
        _ => Vec::new(),
    }
}

fn copy_baggage(keys: &[String], cx: &Context) -> Vec<KeyValue> {
    let baggage = cx.baggage();
    keys.iter()
        .filter_map(|key| {
            baggage
                .get(key.as_str())
                .map(|v| KeyValue::new(format!("baggage.{key}"), v.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baggage_copies_only_the_named_members() {
        let cx = Context::new().with_baggage([
            KeyValue::new("colour", "blue"),
            KeyValue::new("tenant", "acme"),
        ]);
        let keys = ["colour".to_string(), "absent".to_string()];
        let copied = copy_baggage(&keys, &cx);
        assert_eq!(copied, vec![KeyValue::new("baggage.colour", "blue")]);
    }
}
