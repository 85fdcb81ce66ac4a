//! `--metrics-compat vllm`: the series vLLM's own Grafana dashboards and benchmark clients read
//! (`vllm:time_to_first_token_seconds`, `vllm:num_requests_running`, …), rendered on `/metrics`
//! beside our own names from the very same instruments at the same scrape, so the two can never
//! disagree. Each carries vLLM's labels, `model_name` (the generator the server runs) and
//! `engine` ("0": one engine per process).
//!
//! | vLLM series | from |
//! |---|---|
//! | `vllm:e2e_request_latency_seconds` | `gen_ai.server.request.duration` of the generating routes (`/v1/rag/query`, `/v1/chat/completions`, `/v1/completions`, gRPC `Query`) |
//! | `vllm:time_to_first_token_seconds` | `gen_ai.server.time_to_first_token` |
//! | `vllm:inter_token_latency_seconds` | `ragscope.token.interval` (one sample per gap) |
//! | `vllm:request_time_per_output_token_seconds` | `gen_ai.server.time_per_output_token` |
//! | `vllm:request_{queue,prefill,decode}_time_seconds` | `ragscope.stage.duration` of `queue`, `prefill`, `decode` |
//! | `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_max_num_generation_tokens` | `ragscope.request.tokens` input, output, output_longest |
//! | `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | `ragscope.token.usage` input, output |
//! | `vllm:request_success_total{finished_reason}` | `ragscope.requests.finished{reason}` |
//! | `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` | prompt tokens of prefills that looked up the prefix cache; `ragscope.prefix_cache.hit_tokens` |
//! | `vllm:num_requests_running`, `vllm:num_requests_waiting` | `ragscope.jobs.running`, `ragscope.queue.depth` |
//! | `vllm:iteration_tokens_total` (a histogram) | `ragscope.step.tokens` |
//! | `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_{draft,accepted}_tokens_total` | `ragscope.spec.drafts`, `ragscope.spec.tokens` drafted, accepted |
//! | `vllm:kv_cache_usage_perc` | `ragscope.kv_cache.tokens` over the positions the workers could hold (workers × context window) |

use std::fmt::Write as _;
use std::sync::OnceLock;

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};

use super::metrics::{escape, format_f64, KV_CACHE};
use super::names::{attr, metric};

/// Which other servers' metric names `/metrics` also renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MetricsCompat {
    /// Our names only.
    #[default]
    None,
    /// vLLM's names too (`vllm:*`).
    Vllm,
}

static CHOSEN: OnceLock<MetricsCompat> = OnceLock::new();
static VLLM_MODEL: OnceLock<String> = OnceLock::new();

/// Records the choice (`telemetry::init` does, from `--metrics-compat`).
pub fn choose(compat: MetricsCompat) {
    let _ = CHOSEN.set(compat);
}

/// The generator is loaded: with `--metrics-compat vllm`, its name labels the `vllm:*` series
/// from now on (the first call wins).
pub fn model_loaded(model: &str) {
    if CHOSEN.get() == Some(&MetricsCompat::Vllm) {
        enable_vllm(model);
    }
}

/// Renders vLLM's names from now on, labelled `model_name="{model}"` (the first call wins).
pub fn enable_vllm(model: &str) {
    let _ = VLLM_MODEL.set(model.to_string());
}

/// The routes whose requests generate an answer (vLLM's end-to-end latency is of those only).
const GENERATING_ROUTES: [&str; 3] = ["/v1/rag/query", "/v1/chat/completions", "/v1/completions"];

/// One data point's attributes as text.
type Labels = Vec<(String, String)>;

/// Histogram points merged: bucket counts (not cumulative, the last is +Inf), sum and count.
struct Merged {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// The instruments of one scrape, by name.
struct Scrape<'a>(&'a ResourceMetrics);

impl Scrape<'_> {
    fn data(&self, name: &str) -> Option<&AggregatedMetrics> {
        self.0
            .scope_metrics()
            .flat_map(|s| s.metrics())
            .find(|m| m.name() == name)
            .map(|m| m.data())
    }

    /// The histogram `name`'s points whose labels pass `keep`, merged.
    fn histogram(&self, name: &str, keep: impl Fn(&Labels) -> bool) -> Option<Merged> {
        let Some(AggregatedMetrics::F64(MetricData::Histogram(h))) = self.data(name) else {
            return None;
        };
        let mut merged: Option<Merged> = None;
        for p in h.data_points() {
            if !keep(&labels(p.attributes())) {
                continue;
            }
            let m = merged.get_or_insert_with(|| Merged {
                bounds: p.bounds().collect(),
                counts: vec![0; p.bounds().count() + 1],
                sum: 0.0,
                count: 0,
            });
            for (slot, c) in m.counts.iter_mut().zip(p.bucket_counts()) {
                *slot += c;
            }
            m.sum += p.sum();
            m.count += p.count();
        }
        merged
    }

    /// The sum of the counter, up-down counter or gauge `name` over points whose labels pass
    /// `keep`; `None` when the instrument has no data yet.
    fn total(&self, name: &str, keep: impl Fn(&Labels) -> bool) -> Option<f64> {
        macro_rules! points {
            ($d:expr, $f:expr) => {
                match $d {
                    MetricData::Sum(s) => s
                        .data_points()
                        .filter(|p| keep(&labels(p.attributes())))
                        .map(|p| $f(p.value()))
                        .sum::<f64>(),
                    MetricData::Gauge(g) => g
                        .data_points()
                        .filter(|p| keep(&labels(p.attributes())))
                        .map(|p| $f(p.value()))
                        .sum::<f64>(),
                    _ => 0.0,
                }
            };
        }
        Some(match self.data(name)? {
            AggregatedMetrics::F64(d) => points!(d, |v: f64| v),
            AggregatedMetrics::U64(d) => points!(d, |v: u64| v as f64),
            AggregatedMetrics::I64(d) => points!(d, |v: i64| v as f64),
        })
    }

    /// Per value of the label `key`, the sum of `name`'s points.
    fn by(&self, name: &str, key: &str) -> Vec<(String, f64)> {
        let Some(AggregatedMetrics::U64(MetricData::Sum(s))) = self.data(name) else {
            return Vec::new();
        };
        let mut out: Vec<(String, f64)> = Vec::new();
        for p in s.data_points() {
            let value = labels(p.attributes())
                .into_iter()
                .find(|(k, _)| k == key)
                .map_or(String::new(), |(_, v)| v);
            match out.iter_mut().find(|(v, _)| *v == value) {
                Some((_, n)) => *n += p.value() as f64,
                None => out.push((value, p.value() as f64)),
            }
        }
        out
    }
}

fn labels<'a>(attributes: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> Labels {
    attributes
        .map(|kv| (kv.key.to_string(), kv.value.to_string()))
        .collect()
}

fn has(labels: &Labels, key: &str, value: &str) -> bool {
    labels.iter().any(|(k, v)| k == key && v == value)
}

fn any(_: &Labels) -> bool {
    true
}

/// Writes vLLM's families from this scrape's instruments, when `--metrics-compat vllm` is on.
pub(crate) fn render(rm: &ResourceMetrics, open: bool, out: &mut String) {
    let Some(model) = VLLM_MODEL.get() else {
        return;
    };
    let scrape = Scrape(rm);
    let base = format!("model_name=\"{}\",engine=\"0\"", escape(model));
    let mut histogram = |name: &str, help: &str, m: Option<Merged>| {
        let m = m.unwrap_or(Merged {
            bounds: Vec::new(),
            counts: vec![0],
            sum: 0.0,
            count: 0,
        });
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, c) in m.bounds.iter().zip(&m.counts) {
            cumulative += c;
            let _ = writeln!(
                out,
                "{name}_bucket{{{base},le=\"{}\"}} {cumulative}",
                format_f64(*bound)
            );
        }
        let _ = writeln!(out, "{name}_bucket{{{base},le=\"+Inf\"}} {}", m.count);
        let _ = writeln!(out, "{name}_sum{{{base}}} {}", format_f64(m.sum));
        let _ = writeln!(out, "{name}_count{{{base}}} {}", m.count);
    };
    let generating = |l: &Labels| {
        GENERATING_ROUTES
            .iter()
            .any(|r| has(l, attr::HTTP_ROUTE, r))
            || has(l, attr::RPC_METHOD, "Query")
    };
    let stage = |s: &'static str| move |l: &Labels| has(l, attr::STAGE, s);
    let tokens = |t: &'static str| move |l: &Labels| has(l, attr::GEN_AI_TOKEN_TYPE, t);
    histogram(
        "vllm:e2e_request_latency_seconds",
        "End-to-end request latency of generating requests (ragscope: gen_ai.server.request.duration).",
        scrape.histogram(metric::REQUEST_DURATION, generating),
    );
    histogram(
        "vllm:time_to_first_token_seconds",
        "Time to first token (ragscope: gen_ai.server.time_to_first_token).",
        scrape.histogram(metric::TIME_TO_FIRST_TOKEN, any),
    );
    histogram(
        "vllm:inter_token_latency_seconds",
        "Time between consecutive tokens (ragscope: ragscope.token.interval).",
        scrape.histogram(metric::TOKEN_INTERVAL, any),
    );
    histogram(
        "vllm:request_time_per_output_token_seconds",
        "Decode time per output token of a request (ragscope: gen_ai.server.time_per_output_token).",
        scrape.histogram(metric::TIME_PER_OUTPUT_TOKEN, any),
    );
    for (name, help, s) in [
        (
            "vllm:request_queue_time_seconds",
            "Time waiting for a model worker.",
            "queue",
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Prefill time of a request.",
            "prefill",
        ),
        (
            "vllm:request_decode_time_seconds",
            "Decode time of a request.",
            "decode",
        ),
    ] {
        histogram(
            name,
            help,
            scrape.histogram(metric::STAGE_DURATION, stage(s)),
        );
    }
    for (name, help, t) in [
        (
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            "input",
        ),
        (
            "vllm:request_generation_tokens",
            "Generated tokens per finished request.",
            "output",
        ),
        (
            "vllm:request_max_num_generation_tokens",
            "Tokens of the longest choice per finished request.",
            "output_longest",
        ),
    ] {
        histogram(
            name,
            help,
            scrape.histogram(metric::REQUEST_TOKENS, tokens(t)),
        );
    }
    // vLLM's name for a histogram ends in `_total`; it is one all the same.
    histogram(
        "vllm:iteration_tokens_total",
        "Tokens per model step: a prefill chunk's, or a decode step's (ragscope.step.tokens).",
        scrape.histogram(metric::STEP_TOKENS, any),
    );
    let counter = |out: &mut String, family: &str, help: &str, samples: &[(String, f64)]| {
        // OpenMetrics names the family without `_total`; the text format names it with it.
        let shown = if open {
            family.to_string()
        } else {
            format!("{family}_total")
        };
        let _ = writeln!(out, "# HELP {shown} {help}\n# TYPE {shown} counter");
        for (extra, v) in samples {
            let _ = writeln!(out, "{family}_total{{{base}{extra}}} {}", format_f64(*v));
        }
    };
    let prompt = scrape
        .total(metric::TOKEN_USAGE, tokens("input"))
        .unwrap_or(0.0);
    let generated = scrape
        .total(metric::TOKEN_USAGE, tokens("output"))
        .unwrap_or(0.0);
    counter(
        out,
        "vllm:prompt_tokens",
        "Prompt tokens processed.",
        &[(String::new(), prompt)],
    );
    counter(
        out,
        "vllm:generation_tokens",
        "Generated tokens.",
        &[(String::new(), generated)],
    );
    let finished: Vec<(String, f64)> = scrape
        .by(metric::REQUESTS_FINISHED, attr::REASON)
        .into_iter()
        .map(|(reason, n)| (format!(",finished_reason=\"{}\"", escape(&reason)), n))
        .collect();
    counter(
        out,
        "vllm:request_success",
        "Finished requests by finish reason.",
        &finished,
    );
    let lookups = scrape
        .total(metric::PREFIX_CACHE_LOOKUPS, any)
        .unwrap_or(0.0);
    let hits = scrape
        .total(metric::PREFIX_CACHE_HIT_TOKENS, any)
        .unwrap_or(0.0);
    counter(
        out,
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        &[(String::new(), if lookups > 0.0 { prompt } else { 0.0 })],
    );
    counter(
        out,
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        &[(String::new(), hits)],
    );
    let spec = |kind: &str| {
        scrape
            .total(metric::SPEC_TOKENS, |l| has(l, attr::KIND, kind))
            .unwrap_or(0.0)
    };
    counter(
        out,
        "vllm:spec_decode_num_drafts",
        "Speculative drafts verified.",
        &[(
            String::new(),
            scrape.total(metric::SPEC_DRAFTS, any).unwrap_or(0.0),
        )],
    );
    counter(
        out,
        "vllm:spec_decode_num_draft_tokens",
        "Speculative draft tokens verified.",
        &[(String::new(), spec("drafted"))],
    );
    counter(
        out,
        "vllm:spec_decode_num_accepted_tokens",
        "Speculative draft tokens accepted.",
        &[(String::new(), spec("accepted"))],
    );
    let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{base}}} {}",
            format_f64(v)
        );
    };
    gauge(
        out,
        "vllm:num_requests_running",
        "Jobs a model worker is running.",
        scrape.total(metric::JOBS_RUNNING, any).unwrap_or(0.0),
    );
    gauge(
        out,
        "vllm:num_requests_waiting",
        "Jobs waiting for a model worker.",
        scrape.total(metric::QUEUE_DEPTH, any).unwrap_or(0.0),
    );
    let capacity = KV_CACHE
        .capacity_tokens
        .load(std::sync::atomic::Ordering::Relaxed) as f64;
    let held = KV_CACHE.tokens.load(std::sync::atomic::Ordering::Relaxed) as f64;
    gauge(
        out,
        "vllm:kv_cache_usage_perc",
        "KV positions held over those the workers could hold (a fraction, 0 to 1).",
        if capacity > 0.0 {
            (held / capacity).min(1.0)
        } else {
            0.0
        },
    );
}
