//! Telemetry settings that change while the server runs (SGLang's `/set_trace_level` is the
//! model): the share of new traces that are sampled and whether content (questions, answers,
//! documents' text) goes on spans. The server's admin route (`/admin/telemetry`) sets them;
//! every span and every request reads them when it starts, so a change applies to the next
//! request without a restart. The decode-step span detail lives with the decode batcher
//! (`llm::schedule`), which reads it each step.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use opentelemetry::trace::{
    Link, SamplingDecision, SamplingResult, SpanKind, TraceContextExt, TraceId, TraceState,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::ShouldSample;

static RATIO: AtomicU64 = AtomicU64::new(1.0f64.to_bits());
static CAPTURE: AtomicBool = AtomicBool::new(false);
static ADMIN_TOKEN: OnceLock<String> = OnceLock::new();

/// The share of new traces (those without a parent) that are sampled, 0 to 1.
pub fn sampling_ratio() -> f64 {
    f64::from_bits(RATIO.load(Ordering::Relaxed))
}

/// Sets the share of new traces sampled; an error names what is wrong with `ratio`.
pub fn set_sampling_ratio(ratio: f64) -> Result<(), String> {
    if !(0.0..=1.0).contains(&ratio) {
        return Err(format!("must be a number from 0 to 1, got {ratio}"));
    }
    RATIO.store(ratio.to_bits(), Ordering::Relaxed);
    Ok(())
}

/// Whether content (questions, answers, documents' text and metadata) goes on spans.
pub fn capture_content() -> bool {
    CAPTURE.load(Ordering::Relaxed)
}

pub fn set_capture_content(on: bool) {
    CAPTURE.store(on, Ordering::Relaxed);
}

/// The bearer token `/admin/telemetry` asks for (`--telemetry-admin-token`), if one was given.
pub fn admin_token() -> Option<&'static str> {
    ADMIN_TOKEN.get().map(String::as_str)
}

pub fn set_admin_token(token: Option<&str>) {
    if let Some(t) = token.map(str::trim).filter(|t| !t.is_empty()) {
        let _ = ADMIN_TOKEN.set(t.to_string());
    }
}

/// The starting ratio from the standard variables: `OTEL_TRACES_SAMPLER` `always_off` and
/// `parentbased_always_off` give 0, `traceidratio` and `parentbased_traceidratio` take
/// `OTEL_TRACES_SAMPLER_ARG`, anything else 1.
pub(crate) fn ratio_from_env() -> f64 {
    let sampler = std::env::var("OTEL_TRACES_SAMPLER").unwrap_or_default();
    match sampler.trim() {
        "always_off" | "parentbased_always_off" => 0.0,
        "traceidratio" | "parentbased_traceidratio" => std::env::var("OTEL_TRACES_SAMPLER_ARG")
            .ok()
            .and_then(|a| a.trim().parse::<f64>().ok())
            .filter(|r| (0.0..=1.0).contains(r))
            .unwrap_or(1.0),
        _ => 1.0,
    }
}

/// The sampler of every tracer provider: a span with a parent follows the parent's decision
/// (a caller's sampled `traceparent` keeps its trace whole; a request's stages never go
/// missing from a sampled request), and a new trace is sampled by its id against the ratio in
/// force now, as OpenTelemetry's `TraceIdRatioBased` does.
#[derive(Debug, Clone, Copy, Default)]
pub struct RatioSampler;

impl ShouldSample for RatioSampler {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        _name: &str,
        _span_kind: &SpanKind,
        _attributes: &[KeyValue],
        _links: &[Link],
    ) -> SamplingResult {
        let parent = parent_context
            .filter(|cx| cx.has_active_span())
            .map(|cx| cx.span().span_context().clone())
            .filter(|sc| sc.is_valid());
        let decision = match &parent {
            Some(sc) if sc.is_sampled() => SamplingDecision::RecordAndSample,
            Some(_) => SamplingDecision::Drop,
            None => by_ratio(sampling_ratio(), trace_id),
        };
        SamplingResult {
            decision,
            attributes: Vec::new(),
            trace_state: parent.map_or_else(TraceState::default, |sc| sc.trace_state().clone()),
        }
    }
}

/// The trace id's low 63 bits against `ratio` of their range.
fn by_ratio(ratio: f64, trace_id: TraceId) -> SamplingDecision {
    if ratio >= 1.0 {
        return SamplingDecision::RecordAndSample;
    }
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    let low = u64::from_be_bytes(trace_id.to_bytes()[8..].try_into().expect("8 bytes"));
    if low >> 1 < bound {
        SamplingDecision::RecordAndSample
    } else {
        SamplingDecision::Drop
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags};

    fn decide(parent: Option<&Context>, id: u128) -> SamplingDecision {
        RatioSampler
            .should_sample(
                parent,
                TraceId::from(id),
                "x",
                &SpanKind::Internal,
                &[],
                &[],
            )
            .decision
    }

    #[test]
    fn new_traces_follow_the_ratio_in_force_and_children_their_parent() {
        let ids: Vec<u128> = (0..2000u128)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
            .collect();
        let sampled = |ratio: f64| {
            set_sampling_ratio(ratio).unwrap();
            ids.iter()
                .filter(|&&id| decide(None, id) == SamplingDecision::RecordAndSample)
                .count()
        };
        assert_eq!(sampled(1.0), 2000);
        assert_eq!(sampled(0.0), 0);
        let quarter = sampled(0.25);
        assert!((400..600).contains(&quarter), "{quarter}");
        // A parent's decision stands whatever the ratio.
        let parent = |flags| {
            Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from(7u128),
                SpanId::from(9u64),
                flags,
                true,
                TraceState::default(),
            ))
        };
        set_sampling_ratio(0.0).unwrap();
        let yes = parent(TraceFlags::SAMPLED);
        assert_eq!(decide(Some(&yes), 7), SamplingDecision::RecordAndSample);
        set_sampling_ratio(1.0).unwrap();
        let no = parent(TraceFlags::default());
        assert_eq!(decide(Some(&no), 7), SamplingDecision::Drop);
        assert!(set_sampling_ratio(1.5).is_err() && set_sampling_ratio(f64::NAN).is_err());
        assert_eq!(sampling_ratio(), 1.0);
    }
}
