//! Server metrics: one set of OpenTelemetry instruments, read two ways: pushed over OTLP when an
//! endpoint is configured, and rendered on `GET /metrics` from a reader we collect on each
//! scrape, in the Prometheus text format or, when the scraper asks for it, in OpenMetrics with
//! exemplars: each latency bucket names the trace and span of its latest observation, so a
//! dashboard goes from a slow bucket to a trace that landed in it. Durations are seconds, with
//! buckets from 1 ms to 60 s.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};
use opentelemetry::trace::SpanContext;
use opentelemetry::KeyValue;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, Pipeline, SdkMeterProvider, Temporality,
};

use super::names::{attr, metric, StageKind};

/// Histogram bounds for durations in seconds: 1 ms … 60 s.
pub const DURATION_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// A latency histogram whose observations also leave exemplars: per series and bucket, the
/// trace and span of the latest observation, for the OpenMetrics exposition.
pub struct Timed {
    histogram: Histogram<f64>,
    name: &'static str,
}

impl Timed {
    /// Records `seconds` under `attributes`; a valid `span` becomes the bucket's exemplar.
    pub fn record(&self, seconds: f64, attributes: &[KeyValue], span: Option<&SpanContext>) {
        self.histogram.record(seconds, attributes);
        // A trace the sampler dropped is nowhere to be found: no exemplar points at it.
        if let Some(span) = span.filter(|s| s.is_valid() && s.is_sampled()) {
            let exemplar = Exemplar {
                trace_id: span.trace_id().to_string(),
                span_id: span.span_id().to_string(),
                value: seconds,
                unix_s: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
            };
            let key = (series_key(self.name, attributes.iter()), bucket_of(seconds));
            let mut kept = exemplars().lock().unwrap_or_else(|e| e.into_inner());
            kept.insert(key, exemplar);
        }
    }
}

/// One observation a bucket shows as its exemplar.
#[derive(Debug, Clone)]
struct Exemplar {
    trace_id: String,
    span_id: String,
    value: f64,
    unix_s: f64,
}

/// The latest exemplar per (series, bucket index); the series are few (a histogram's label
/// sets), so this stays small.
type Exemplars = HashMap<(String, usize), Exemplar>;

fn exemplars() -> &'static Mutex<Exemplars> {
    static KEPT: OnceLock<Mutex<Exemplars>> = OnceLock::new();
    KEPT.get_or_init(Default::default)
}

/// A series as a key: the instrument and its attributes in key order.
fn series_key<'a>(name: &str, attributes: impl Iterator<Item = &'a KeyValue>) -> String {
    let mut parts: Vec<String> = attributes
        .map(|kv| format!("{}={}", kv.key, kv.value))
        .collect();
    parts.sort();
    format!("{name}|{}", parts.join(","))
}

/// The index of the bucket `seconds` falls in ([`DURATION_BUCKETS`]; its length is `+Inf`).
fn bucket_of(seconds: f64) -> usize {
    DURATION_BUCKETS
        .iter()
        .position(|&bound| seconds <= bound)
        .unwrap_or(DURATION_BUCKETS.len())
}

/// The instruments every part of the server records into.
pub struct Metrics {
    pub request_duration: Timed,
    pub time_to_first_token: Timed,
    pub time_per_output_token: Timed,
    pub stage_duration: Timed,
    pub tokens: Counter<u64>,
    pub requests_in_flight: UpDownCounter<i64>,
    pub cache_requests: Counter<u64>,
    /// Injected faults by `rag.stage` and `kind` (delay, cpu_burn, error, token_delay).
    pub faults_injected: Counter<u64>,
    /// Requests refused at admission, by `reason` (queue_full, queue_wait, deadline, draining).
    pub admission_rejected: Counter<u64>,
    /// Requests refused by API-key checks, by `reason` (missing, invalid, scope).
    pub auth_rejected: Counter<u64>,
    /// Model jobs per tenant, by `outcome` (admitted or the quota that refused them).
    pub tenant_requests: Counter<u64>,
    /// Prompt + output tokens charged per tenant.
    pub tenant_tokens: Counter<u64>,
    /// Per-request quality of RAG answers (see `record_quality` in the pipeline).
    pub quality: Quality,
    /// Failure snapshots by `result` (written, evicted, dropped, failed).
    pub snapshots: Counter<u64>,
    /// Streamed generations cancelled because the client stopped reading.
    pub stream_stalls: Counter<u64>,
    /// Open connections, by `listener` (http, grpc).
    pub connections_open: UpDownCounter<i64>,
    /// Connections turned away at accept for `--max-connections`, by `listener`.
    pub connections_rejected: Counter<u64>,
    /// The gap between two tokens of one generation (seconds), one sample per gap.
    pub token_interval: Histogram<f64>,
    /// Tokens per finished generation, by `gen_ai.token.type` (input, output, output_longest).
    pub request_tokens: Histogram<f64>,
    /// Finished generations by `reason` (the finish reason).
    pub requests_finished: Counter<u64>,
    /// Tokens per model step: a prefill chunk's, or a decode step's (one per sequence, plus
    /// the draft tokens it verified).
    pub step_tokens: Histogram<f64>,
    /// Speculative draft tokens by `kind`: drafted (verified by a step) and accepted.
    pub spec_tokens: Counter<u64>,
    /// Drafts verified: decode steps that carried one.
    pub spec_drafts: Counter<u64>,
}

/// Histograms of what each RAG answer was made of, one observation per request: with them a
/// dashboard shows that answers got shorter, the context emptier or the prefix cache colder
/// at the moment latency moved.
pub struct Quality {
    pub output_tokens: Histogram<f64>,
    /// Mean log-probability of the answer's tokens (only requests that asked for logprobs).
    pub answer_confidence: Histogram<f64>,
    pub context_fill: Histogram<f64>,
    pub context_relevance: Histogram<f64>,
    pub prefix_hit_ratio: Histogram<f64>,
    pub retrieval_gap: Histogram<f64>,
}

/// Bounds for ratios in [0, 1].
const RATIO_BUCKETS: [f64; 10] = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9];
/// Bounds for token counts.
const TOKEN_BUCKETS: [f64; 10] = [1.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];
/// Bounds for a request's prompt or answer length in tokens.
const REQUEST_TOKEN_BUCKETS: [f64; 12] = [
    1.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];
/// Bounds for a mean token log-probability (≤ 0; 0 is certainty).
const LOGPROB_BUCKETS: [f64; 9] = [-5.0, -3.0, -2.0, -1.5, -1.0, -0.7, -0.5, -0.3, -0.1];

/// KV-cache memory held by running generations, read by the `ragscope.kv_cache.*` gauges.
#[derive(Debug, Default)]
pub struct KvCacheUsage {
    pub bytes: std::sync::atomic::AtomicU64,
    pub tokens: std::sync::atomic::AtomicU64,
    /// Token positions the running generations could reserve at most (model workers × the
    /// context window), set by the server; 0 when unknown.
    pub capacity_tokens: std::sync::atomic::AtomicU64,
}

pub static KV_CACHE: KvCacheUsage = KvCacheUsage {
    bytes: std::sync::atomic::AtomicU64::new(0),
    tokens: std::sync::atomic::AtomicU64::new(0),
    capacity_tokens: std::sync::atomic::AtomicU64::new(0),
};

/// The prefix caches' counts, read by the `ragscope.prefix_cache.*` instruments.
#[derive(Debug, Default)]
pub struct PrefixCacheUsage {
    /// Prefills that looked for a cached prefix.
    pub lookups: std::sync::atomic::AtomicU64,
    /// Lookups that found one.
    pub hits: std::sync::atomic::AtomicU64,
    /// Prompt positions copied from the cache instead of computed.
    pub hit_tokens: std::sync::atomic::AtomicU64,
    /// Blocks evicted to stay within the budget.
    pub evictions: std::sync::atomic::AtomicU64,
    /// Bytes of blocks held.
    pub bytes: std::sync::atomic::AtomicU64,
}

pub static PREFIX_CACHE: PrefixCacheUsage = PrefixCacheUsage {
    lookups: std::sync::atomic::AtomicU64::new(0),
    hits: std::sync::atomic::AtomicU64::new(0),
    hit_tokens: std::sync::atomic::AtomicU64::new(0),
    evictions: std::sync::atomic::AtomicU64::new(0),
    bytes: std::sync::atomic::AtomicU64::new(0),
};

/// Sequences per batched decode step, read by the `ragscope.decode.batch_size` gauge.
#[derive(Debug, Default)]
pub struct DecodeBatches {
    /// The latest step's.
    pub last: std::sync::atomic::AtomicU64,
    /// The largest so far.
    pub largest: std::sync::atomic::AtomicU64,
}

pub static DECODE_BATCH: DecodeBatches = DecodeBatches {
    last: std::sync::atomic::AtomicU64::new(0),
    largest: std::sync::atomic::AtomicU64::new(0),
};

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// The process's instruments (on the global meter provider, installed by `telemetry::init`).
pub fn metrics() -> &'static Metrics {
    METRICS.get_or_init(|| Metrics::new(&opentelemetry::global::meter(super::span::SCOPE)))
}

impl Metrics {
    fn new(meter: &Meter) -> Metrics {
        let seconds = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(DURATION_BUCKETS.to_vec())
                .build()
        };
        let timed = |name: &'static str, description: &'static str| Timed {
            histogram: seconds(name, description),
            name,
        };
        Metrics {
            request_duration: timed(
                metric::REQUEST_DURATION,
                "Time from request arrival to the last byte of the response",
            ),
            time_to_first_token: timed(
                metric::TIME_TO_FIRST_TOKEN,
                "Time from request arrival to the first generated token",
            ),
            time_per_output_token: timed(
                metric::TIME_PER_OUTPUT_TOKEN,
                "Decode time per generated token after the first",
            ),
            stage_duration: timed(metric::STAGE_DURATION, "Duration of one pipeline stage"),
            tokens: meter
                .u64_counter(metric::TOKEN_USAGE)
                .with_unit("{token}")
                .with_description("Tokens processed, by gen_ai.token.type (input or output)")
                .build(),
            requests_in_flight: meter
                .i64_up_down_counter(metric::REQUESTS_IN_FLIGHT)
                .with_unit("{request}")
                .with_description("Requests being served")
                .build(),
            cache_requests: meter
                .u64_counter(metric::CACHE_REQUESTS)
                .with_unit("{request}")
                .with_description("Cache look-ups by cache and result (hit or miss)")
                .build(),
            faults_injected: meter
                .u64_counter(metric::FAULTS_INJECTED)
                .with_unit("{fault}")
                .with_description("Faults injected on purpose (only with --faults true)")
                .build(),
            admission_rejected: meter
                .u64_counter(metric::ADMISSION_REJECTED)
                .with_unit("{request}")
                .with_description("Requests refused before any work, by reason")
                .build(),
            auth_rejected: meter
                .u64_counter(metric::AUTH_REJECTED)
                .with_unit("{request}")
                .with_description("Requests refused for a missing, unknown or under-scoped API key")
                .build(),
            tenant_requests: meter
                .u64_counter(metric::TENANT_REQUESTS)
                .with_unit("{request}")
                .with_description("Model jobs per tenant, admitted or refused by its quota")
                .build(),
            tenant_tokens: meter
                .u64_counter(metric::TENANT_TOKENS)
                .with_unit("{token}")
                .with_description("Prompt and output tokens charged to each tenant")
                .build(),
            quality: Quality::new(meter, &seconds),
            snapshots: meter
                .u64_counter(metric::SNAPSHOTS)
                .with_unit("{snapshot}")
                .with_description(
                    "Failure snapshots written, evicted, dropped (queue full) or failed",
                )
                .build(),
            stream_stalls: meter
                .u64_counter(metric::STREAM_STALLS)
                .with_unit("{stream}")
                .with_description("Streamed generations cancelled: the client stopped reading")
                .build(),
            connections_open: meter
                .i64_up_down_counter(metric::CONNECTIONS_OPEN)
                .with_unit("{connection}")
                .with_description("Open connections per listener")
                .build(),
            token_interval: seconds(
                metric::TOKEN_INTERVAL,
                "Time between two consecutive tokens of one generation",
            ),
            request_tokens: meter
                .f64_histogram(metric::REQUEST_TOKENS)
                .with_unit("{token}")
                .with_description(
                    "Tokens per finished generation: input (prompt), output (all choices), \
                     output_longest (the longest choice)",
                )
                .with_boundaries(REQUEST_TOKEN_BUCKETS.to_vec())
                .build(),
            requests_finished: meter
                .u64_counter(metric::REQUESTS_FINISHED)
                .with_unit("{request}")
                .with_description("Finished generations by finish reason")
                .build(),
            step_tokens: meter
                .f64_histogram(metric::STEP_TOKENS)
                .with_unit("{token}")
                .with_description(
                    "Tokens per model step: a prefill chunk's, or a decode step's (one per sequence \
                     plus the draft tokens it verified)",
                )
                .with_boundaries(REQUEST_TOKEN_BUCKETS.to_vec())
                .build(),
            spec_tokens: meter
                .u64_counter(metric::SPEC_TOKENS)
                .with_unit("{token}")
                .with_description(
                    "Speculative draft tokens by kind: drafted (verified) and accepted",
                )
                .build(),
            spec_drafts: meter
                .u64_counter(metric::SPEC_DRAFTS)
                .with_unit("{draft}")
                .with_description("Speculative drafts verified (decode steps that carried one)")
                .build(),
            connections_rejected: meter
                .u64_counter(metric::CONNECTIONS_REJECTED)
                .with_unit("{connection}")
                .with_description(
                    "Connections closed at accept: the listener had --max-connections open",
                )
                .build(),
        }
    }

    /// Records one stage's duration under its `rag.stage` label (nothing for a stage without
    /// one), with `span` (the stage's) as the bucket's exemplar.
    pub fn stage(&self, kind: StageKind, took: Duration, span: Option<&SpanContext>) {
        if let Some(label) = kind.metric_label() {
            self.stage_duration.record(
                took.as_secs_f64(),
                &[KeyValue::new(attr::STAGE, label)],
                span,
            );
        }
    }
}

impl Quality {
    fn new(
        meter: &Meter,
        seconds: &dyn Fn(&'static str, &'static str) -> Histogram<f64>,
    ) -> Quality {
        let histogram =
            |name: &'static str, unit: &'static str, description: &'static str, bounds: &[f64]| {
                meter
                    .f64_histogram(name)
                    .with_unit(unit)
                    .with_description(description)
                    .with_boundaries(bounds.to_vec())
                    .build()
            };
        Quality {
            output_tokens: histogram(
                metric::ANSWER_OUTPUT_TOKENS,
                "{token}",
                "Tokens generated per RAG answer",
                &TOKEN_BUCKETS,
            ),
            answer_confidence: histogram(
                metric::ANSWER_CONFIDENCE,
                "1",
                "Mean log-probability of an answer's tokens (requests that asked for logprobs)",
                &LOGPROB_BUCKETS,
            ),
            context_fill: histogram(
                metric::CONTEXT_FILL_RATIO,
                "1",
                "Prompt plus answer tokens over the context window",
                &RATIO_BUCKETS,
            ),
            context_relevance: histogram(
                metric::CONTEXT_RELEVANCE,
                "1",
                "Mean retrieval similarity of the passages the prompt kept to the query",
                &RATIO_BUCKETS,
            ),
            prefix_hit_ratio: histogram(
                metric::PREFIX_CACHE_HIT_RATIO,
                "1",
                "Share of a prompt's tokens that came from the prefix cache",
                &RATIO_BUCKETS,
            ),
            retrieval_gap: seconds(
                metric::RETRIEVAL_TO_GENERATION_GAP,
                "Time from the end of retrieval to the start of generation",
            ),
        }
    }
}

/// A [`ManualReader`] shared between the meter provider and the `/metrics` handler.
#[derive(Debug, Clone, Default)]
pub struct ScrapeReader(Arc<ManualReader>);

impl MetricReader for ScrapeReader {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline)
    }

    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

static SCRAPE: OnceLock<ScrapeReader> = OnceLock::new();

/// Registers the reader `/metrics` renders from; `init` calls it once.
pub fn scrape_reader() -> ScrapeReader {
    SCRAPE.get_or_init(ScrapeReader::default).clone()
}

/// Installs a meter provider with only the scrape reader (when `init` was not called, e.g. in
/// tests) so `/metrics` always has data.
pub fn ensure_provider() -> Option<SdkMeterProvider> {
    if SCRAPE.get().is_some() {
        return None;
    }
    let provider = SdkMeterProvider::builder()
        .with_reader(scrape_reader())
        .build();
    opentelemetry::global::set_meter_provider(provider.clone());
    super::register_process_gauges();
    Some(provider)
}

/// Prometheus name: dots become underscores, the unit and `_total` suffixes are added.
fn prom_name(name: &str, unit: &str, counter: bool) -> String {
    let mut n: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    match unit {
        "s" if !n.ends_with("_seconds") => n.push_str("_seconds"),
        "By" if !n.ends_with("_bytes") => n.push_str("_bytes"),
        _ => {}
    }
    if counter {
        n.push_str("_total");
    }
    n
}

pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn labels<'a>(attrs: impl Iterator<Item = &'a KeyValue>, extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = attrs
        .map(|kv| {
            let key: String = kv
                .key
                .as_str()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            format!("{key}=\"{}\"", escape(&kv.value.to_string()))
        })
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

pub(crate) fn format_f64(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

/// The content type of the OpenMetrics exposition.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders everything the scrape reader collects in the Prometheus text format (0.0.4).
pub fn render_prometheus() -> String {
    render(false)
}

/// Renders everything in OpenMetrics 1.0, the latency buckets with their exemplars
/// (`# {trace_id="…",span_id="…"} value timestamp`), ending with `# EOF`.
pub fn render_openmetrics() -> String {
    render(true)
}

/// The latest exemplar of one bucket as the OpenMetrics suffix of its line, if any.
fn exemplar_suffix(kept: &Exemplars, series: &str, bucket: usize) -> String {
    kept.get(&(series.to_string(), bucket))
        .map_or(String::new(), |e| {
            format!(
                " # {{trace_id=\"{}\",span_id=\"{}\"}} {} {:.3}",
                e.trace_id,
                e.span_id,
                format_f64(e.value),
                e.unix_s
            )
        })
}

fn render(open: bool) -> String {
    let mut rm = ResourceMetrics::default();
    if scrape_reader().collect(&mut rm).is_err() {
        return if open {
            "# EOF\n".into()
        } else {
            String::new()
        };
    }
    let kept = if open {
        exemplars()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    } else {
        Exemplars::new()
    };
    let mut out = String::new();
    for scope in rm.scope_metrics() {
        for metric in scope.metrics() {
            let help = escape(metric.description());
            macro_rules! sum_or_gauge {
                ($data:expr, $to_f64:expr) => {
                    match $data {
                        MetricData::Sum(sum) => {
                            let counter = sum.is_monotonic();
                            let name = prom_name(metric.name(), metric.unit(), counter);
                            let kind = if counter { "counter" } else { "gauge" };
                            // OpenMetrics names a counter's family without `_total`.
                            let family = if open && counter {
                                name.trim_end_matches("_total")
                            } else {
                                name.as_str()
                            };
                            let _ = writeln!(out, "# HELP {family} {help}\n# TYPE {family} {kind}");
                            for p in sum.data_points() {
                                let _ = writeln!(
                                    out,
                                    "{name}{} {}",
                                    labels(p.attributes(), None),
                                    format_f64($to_f64(p.value()))
                                );
                            }
                        }
                        MetricData::Gauge(g) => {
                            let name = prom_name(metric.name(), metric.unit(), false);
                            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
                            for p in g.data_points() {
                                let _ = writeln!(
                                    out,
                                    "{name}{} {}",
                                    labels(p.attributes(), None),
                                    format_f64($to_f64(p.value()))
                                );
                            }
                        }
                        MetricData::Histogram(h) => {
                            let name = prom_name(metric.name(), metric.unit(), false);
                            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
                            for p in h.data_points() {
                                let series = series_key(metric.name(), p.attributes());
                                let mut cumulative = 0u64;
                                let mut bucket = 0;
                                for (bound, count) in p.bounds().zip(p.bucket_counts()) {
                                    cumulative += count;
                                    let _ = writeln!(
                                        out,
                                        "{name}_bucket{} {cumulative}{}",
                                        labels(p.attributes(), Some(("le", format_f64(bound)))),
                                        exemplar_suffix(&kept, &series, bucket)
                                    );
                                    bucket += 1;
                                }
                                let _ = writeln!(
                                    out,
                                    "{name}_bucket{} {}{}",
                                    labels(p.attributes(), Some(("le", "+Inf".into()))),
                                    p.count(),
                                    exemplar_suffix(&kept, &series, bucket)
                                );
                                let _ = writeln!(
                                    out,
                                    "{name}_sum{} {}",
                                    labels(p.attributes(), None),
                                    format_f64($to_f64(p.sum()))
                                );
                                let _ = writeln!(
                                    out,
                                    "{name}_count{} {}",
                                    labels(p.attributes(), None),
                                    p.count()
                                );
                            }
                        }
                        MetricData::ExponentialHistogram(_) => {}
                    }
                };
            }
            match metric.data() {
                AggregatedMetrics::F64(d) => sum_or_gauge!(d, |v: f64| v),
                AggregatedMetrics::U64(d) => sum_or_gauge!(d, |v: u64| v as f64),
                AggregatedMetrics::I64(d) => sum_or_gauge!(d, |v: i64| v as f64),
            }
        }
    }
    super::compat::render(&rm, open, &mut out);
    if open {
        out.push_str("# EOF\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        assert_eq!(
            prom_name("gen_ai.server.request.duration", "s", false),
            "gen_ai_server_request_duration_seconds"
        );
        assert_eq!(
            prom_name("ragscope.token.usage", "{token}", true),
            "ragscope_token_usage_total"
        );
    }

    #[test]
    fn recorded_values_render_as_cumulative_histograms() {
        let _provider = ensure_provider();
        let m = metrics();
        m.stage(StageKind::Embed, Duration::from_millis(3), None);
        m.stage(StageKind::Embed, Duration::from_millis(30), None);
        m.tokens
            .add(5, &[KeyValue::new("gen_ai.token.type", "input")]);
        let text = render_prometheus();
        assert!(
            text.contains("# TYPE ragscope_stage_duration_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains(
                "ragscope_stage_duration_seconds_bucket{rag_stage=\"embed\",le=\"0.005\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "ragscope_stage_duration_seconds_bucket{rag_stage=\"embed\",le=\"+Inf\"} 2"
            ),
            "{text}"
        );
        assert!(
            text.contains("ragscope_token_usage_total{gen_ai_token_type=\"input\"} 5"),
            "{text}"
        );
    }

    #[test]
    fn openmetrics_buckets_carry_their_latest_exemplar() {
        use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};
        let _provider = ensure_provider();
        let span = |t: &str, s: &str| {
            SpanContext::new(
                TraceId::from_hex(t).unwrap(),
                SpanId::from_hex(s).unwrap(),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            )
        };
        let m = metrics();
        let first = span("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
        let latest = span("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
        m.stage(StageKind::Rerank, Duration::from_millis(40), Some(&first));
        m.stage(StageKind::Rerank, Duration::from_millis(45), Some(&latest));
        // No span, no exemplar: the bucket keeps the latest one that had a span.
        m.stage(StageKind::Rerank, Duration::from_millis(42), None);
        let text = render_openmetrics();
        let line = text
            .lines()
            .find(|l| {
                l.starts_with(
                    "ragscope_stage_duration_seconds_bucket{rag_stage=\"rerank\",le=\"0.05\"}",
                )
            })
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            line.contains(
                " 3 # {trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\",span_id=\"00f067aa0ba902b7\"} 0.045 "
            ),
            "{line}"
        );
        assert!(text.ends_with("# EOF\n"));
        // Counter families drop `_total` in OpenMetrics; their samples keep it.
        m.tokens
            .add(1, &[KeyValue::new("gen_ai.token.type", "output")]);
        let text = render_openmetrics();
        assert!(
            text.contains("# TYPE ragscope_token_usage counter"),
            "{text}"
        );
        assert!(text.contains("ragscope_token_usage_total{"), "{text}");
        // The plain text format stays as it was: no exemplars, no EOF.
        let plain = render_prometheus();
        assert!(!plain.contains("trace_id") && !plain.contains("# EOF"));
        assert!(plain.contains("# TYPE ragscope_token_usage_total counter"));
    }
}
