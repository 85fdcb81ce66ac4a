//! Fault and latency injection, for running the server as a system under test: add a known
//! delay, CPU burn or error rate to one stage and check that the traces put it there.
//!
//! Off unless `--faults true`. A [`FaultPlan`] says what to inject per stage; the server holds
//! one (from `--fault-plan`, replaced at run time through `PUT /admin/faults` with the admin
//! token) and a request may bring its own in the `x-ragscope-fault` header when
//! `--fault-header true`. Every injected fault is written on its stage's span as `rag.fault.*`
//! attributes and counted in `ragscope.faults.injected`, so nobody mistakes it for real latency.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use opentelemetry::KeyValue;
use rand::Rng;
use serde::{Deserialize, Serialize};

pub use crate::settings::FaultArgs;
use telemetry::names::{attr, StageKind};
use telemetry::span::Stage;

/// The request header carrying a per-request plan (JSON, same shape as `PUT /admin/faults`).
pub const HEADER: &str = "x-ragscope-fault";

/// No injected delay is longer than this, whatever a heavy tail draws.
const MAX_DELAY: Duration = Duration::from_secs(30);

/// The stages a fault can be injected into; names match the span names' first word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultStage {
    Embeddings,
    Retrieval,
    Rerank,
    Prompt,
    Chat,
}

impl FaultStage {
    /// The fault key of a pipeline stage; `None` for stages faults are not injected into.
    pub fn of(kind: StageKind) -> Option<FaultStage> {
        Some(match kind {
            StageKind::Embed => FaultStage::Embeddings,
            StageKind::Retrieve => FaultStage::Retrieval,
            StageKind::Rerank => FaultStage::Rerank,
            StageKind::Prompt => FaultStage::Prompt,
            StageKind::Generate => FaultStage::Chat,
            _ => return None,
        })
    }

    pub fn kind(self) -> StageKind {
        match self {
            FaultStage::Embeddings => StageKind::Embed,
            FaultStage::Retrieval => StageKind::Retrieve,
            FaultStage::Rerank => StageKind::Rerank,
            FaultStage::Prompt => StageKind::Prompt,
            FaultStage::Chat => StageKind::Generate,
        }
    }

    /// The key in a plan and the `rag.stage` label of the fault counter: the stage's span prefix.
    pub fn as_str(self) -> &'static str {
        self.kind().span_prefix()
    }
}

/// What to inject, per stage. The empty plan injects nothing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FaultPlan {
    pub stages: BTreeMap<FaultStage, StageFault>,
}

/// Faults for one stage. Delay and CPU burn apply to a `probability` fraction of requests;
/// errors to an independent `error_rate` fraction.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageFault {
    /// A fixed added delay in milliseconds (shorthand for `delay: {dist: fixed, ms}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<f64>,
    /// An added delay drawn from a distribution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay: Option<Delay>,
    /// Fraction of requests that get the delay and the CPU burn (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probability: Option<f64>,
    /// Fraction of requests failed with an injected error (HTTP 500).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub error_rate: f64,
    /// Busy CPU time in milliseconds on the stage's thread: shows up in its flame graph.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_burn_ms: f64,
    /// Slow streaming (chat only): extra milliseconds before each generated token is sent.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub token_delay_ms: f64,
    /// Chat only: fail the generation with an injected error when it streams its Nth piece of
    /// text (mid-answer, so its failure snapshot holds tokens and a KV cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_after_tokens: Option<usize>,
    /// Chat only: panic in the token path at the Nth piece instead (caught by the generator,
    /// which snapshots it, and by the model worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub panic_after_tokens: Option<usize>,
}

/// A failure injected into a running generation ([`StageFault::error_after_tokens`],
/// [`StageFault::panic_after_tokens`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MidAnswer {
    /// The streamed piece (counted from 1, per choice) at which it fires.
    pub at: usize,
    pub panic: bool,
}

impl MidAnswer {
    /// Injects it into the running `chat` stage: marks the span and counts it, then tells the
    /// generator to fail, or panics.
    pub fn fire(&self, span: &Stage) -> llm::Flow {
        span.set(KeyValue::new(attr::FAULT_ERROR, true));
        span.fail("injected_fault", Injected(FaultStage::Chat).to_string());
        if self.panic {
            count(FaultStage::Chat, "panic");
            panic!("fault injected into the chat stage (a panic)");
        }
        count(FaultStage::Chat, "error");
        llm::Flow::Fail
    }
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// A delay distribution, in milliseconds. `pareto` and `lognormal` have heavy tails.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "lowercase", deny_unknown_fields)]
pub enum Delay {
    Fixed { ms: f64 },
    Uniform { min_ms: f64, max_ms: f64 },
    Exponential { mean_ms: f64 },
    Lognormal { median_ms: f64, sigma: f64 },
    Pareto { scale_ms: f64, shape: f64 },
}

impl Delay {
    fn name(&self) -> &'static str {
        match self {
            Delay::Fixed { .. } => "fixed",
            Delay::Uniform { .. } => "uniform",
            Delay::Exponential { .. } => "exponential",
            Delay::Lognormal { .. } => "lognormal",
            Delay::Pareto { .. } => "pareto",
        }
    }

    /// One draw, in milliseconds, by inverting the distribution function at `u` in (0, 1]
    /// (and `z`, a standard normal draw, for the log-normal).
    fn sample_ms(&self, u: f64, z: f64) -> f64 {
        match *self {
            Delay::Fixed { ms } => ms,
            Delay::Uniform { min_ms, max_ms } => min_ms + (max_ms - min_ms) * u,
            Delay::Exponential { mean_ms } => -mean_ms * u.ln(),
            Delay::Lognormal { median_ms, sigma } => median_ms * (sigma * z).exp(),
            Delay::Pareto { scale_ms, shape } => scale_ms / u.powf(1.0 / shape),
        }
    }

    fn validate(&self) -> Result<(), String> {
        let non_negative = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number ≥ 0, got {v}"))
            }
        };
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number > 0, got {v}"))
            }
        };
        match *self {
            Delay::Fixed { ms } => non_negative("ms", ms),
            Delay::Uniform { min_ms, max_ms } => {
                non_negative("min_ms", min_ms)?;
                non_negative("max_ms", max_ms)?;
                if max_ms < min_ms {
                    return Err(format!("max_ms ({max_ms}) must be ≥ min_ms ({min_ms})"));
                }
                Ok(())
            }
            Delay::Exponential { mean_ms } => positive("mean_ms", mean_ms),
            Delay::Lognormal { median_ms, sigma } => {
                positive("median_ms", median_ms)?;
                non_negative("sigma", sigma)
            }
            Delay::Pareto { scale_ms, shape } => {
                positive("scale_ms", scale_ms)?;
                positive("shape", shape)
            }
        }
    }
}

/// An error injected into a stage.
#[derive(Debug, thiserror::Error)]
#[error("fault injected into the {} stage", .0.as_str())]
pub struct Injected(pub FaultStage);

impl FaultPlan {
    /// Parses and checks a plan; errors name the field, e.g. `retrieval.delay.shape: …`.
    pub fn parse(json: &str) -> Result<FaultPlan, String> {
        let raw: BTreeMap<String, serde_json::Value> = serde_json::from_str(json)
            .map_err(|e| format!("must be a JSON object of stages: {e}"))?;
        let mut plan = FaultPlan::default();
        for (name, value) in raw {
            let stage: FaultStage = serde_json::from_value(serde_json::Value::String(name.clone()))
                .map_err(|_| {
                    format!("{name}: unknown stage; expected embeddings, retrieval, rerank, prompt or chat")
                })?;
            let fault: StageFault = serde_path_to_error::deserialize(value).map_err(|e| {
                let path = e.path().to_string();
                if path == "." {
                    format!("{name}: {}", e.inner())
                } else {
                    format!("{name}.{path}: {}", e.inner())
                }
            })?;
            plan.stages.insert(stage, fault);
        }
        plan.validate()?;
        Ok(plan)
    }

    pub fn validate(&self) -> Result<(), String> {
        for (stage, f) in &self.stages {
            let at =
                |field: &str, problem: String| format!("{}.{field}: {problem}", stage.as_str());
            let fraction = |field: &str, v: f64| {
                if (0.0..=1.0).contains(&v) {
                    Ok(())
                } else {
                    Err(at(field, format!("must be between 0 and 1, got {v}")))
                }
            };
            if f.delay_ms.is_some() && f.delay.is_some() {
                return Err(at(
                    "delay_ms",
                    "give either delay_ms or delay, not both".into(),
                ));
            }
            if let Some(ms) = f.delay_ms {
                Delay::Fixed { ms }
                    .validate()
                    .map_err(|e| at("delay_ms", e))?;
            }
            if let Some(d) = &f.delay {
                d.validate().map_err(|e| at("delay", e))?;
            }
            fraction("probability", f.probability.unwrap_or(1.0))?;
            fraction("error_rate", f.error_rate)?;
            for (field, v) in [
                ("cpu_burn_ms", f.cpu_burn_ms),
                ("token_delay_ms", f.token_delay_ms),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(at(field, format!("must be a finite number ≥ 0, got {v}")));
                }
            }
            if f.token_delay_ms > 0.0 && *stage != FaultStage::Chat {
                return Err(at(
                    "token_delay_ms",
                    "only the chat stage streams tokens".into(),
                ));
            }
            for (field, n) in [
                ("error_after_tokens", f.error_after_tokens),
                ("panic_after_tokens", f.panic_after_tokens),
            ] {
                match n {
                    Some(_) if *stage != FaultStage::Chat => {
                        return Err(at(field, "only the chat stage streams tokens".into()))
                    }
                    Some(0) => return Err(at(field, "must be at least 1".into())),
                    _ => {}
                }
            }
            if f.error_after_tokens.is_some() && f.panic_after_tokens.is_some() {
                return Err(at(
                    "panic_after_tokens",
                    "give either error_after_tokens or panic_after_tokens, not both".into(),
                ));
            }
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// Injects this plan's faults for `stage` into the running `span`: records what it does
    /// on the span, burns CPU and sleeps on the calling (worker) thread, or fails.
    pub fn apply(&self, stage: FaultStage, span: &Stage) -> Result<(), Injected> {
        let Some(fault) = self.stages.get(&stage) else {
            return Ok(());
        };
        let mut rng = rand::rng();
        if fault.error_rate > 0.0 && rng.random::<f64>() < fault.error_rate {
            span.set(KeyValue::new(attr::FAULT_ERROR, true));
            span.fail("injected_fault", Injected(stage).to_string());
            count(stage, "error");
            return Err(Injected(stage));
        }
        if rng.random::<f64>() >= fault.probability.unwrap_or(1.0) {
            return Ok(());
        }
        if fault.cpu_burn_ms > 0.0 {
            span.set(KeyValue::new(attr::FAULT_CPU_BURN_MS, fault.cpu_burn_ms));
            count(stage, "cpu_burn");
            burn(Duration::from_secs_f64(fault.cpu_burn_ms / 1e3));
        }
        let delay = match (&fault.delay, fault.delay_ms) {
            (Some(d), _) => Some(d.clone()),
            (None, Some(ms)) => Some(Delay::Fixed { ms }),
            (None, None) => None,
        };
        if let Some(delay) = delay {
            let u = 1.0 - rng.random::<f64>(); // (0, 1]: ln and powf stay finite
            let z = standard_normal(&mut rng);
            let ms = delay
                .sample_ms(u, z)
                .clamp(0.0, MAX_DELAY.as_secs_f64() * 1e3);
            span.set_all([
                KeyValue::new(attr::FAULT_DELAY_MS, ms),
                KeyValue::new(attr::FAULT_DELAY_DISTRIBUTION, delay.name()),
            ]);
            count(stage, "delay");
            std::thread::sleep(Duration::from_secs_f64(ms / 1e3));
        }
        Ok(())
    }

    /// The chat stage's mid-answer failure, if any.
    pub fn mid_answer(&self) -> Option<MidAnswer> {
        let f = self.stages.get(&FaultStage::Chat)?;
        match (f.error_after_tokens, f.panic_after_tokens) {
            (Some(at), _) => Some(MidAnswer { at, panic: false }),
            (None, Some(at)) => Some(MidAnswer { at, panic: true }),
            (None, None) => None,
        }
    }

    /// The slow-stream delay before each generated token, if any.
    pub fn token_delay(&self) -> Option<Duration> {
        let ms = self.stages.get(&FaultStage::Chat)?.token_delay_ms;
        (ms > 0.0).then(|| Duration::from_secs_f64(ms / 1e3))
    }
}

pub(crate) fn count(stage: FaultStage, kind: &'static str) {
    telemetry::metrics::metrics().faults_injected.add(
        1,
        &[
            KeyValue::new(attr::STAGE, stage.as_str()),
            KeyValue::new(attr::KIND, kind),
        ],
    );
}

/// Keeps the thread busy (not asleep) for `d`, so a profiler sees the time.
fn burn(d: Duration) {
    let until = Instant::now() + d;
    let mut x = 0u64;
    while Instant::now() < until {
        for i in 0..1000u64 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
    }
}

/// Box–Muller: one standard normal draw.
fn standard_normal(rng: &mut impl Rng) -> f64 {
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Where a request's plan came from, recorded as `rag.fault.source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanSource {
    Server,
    Header,
}

/// The server's fault settings and its current plan (switchable at run time).
pub struct Faults {
    pub enabled: bool,
    /// Bearer token for `/admin/faults`; without one the endpoint is off.
    pub admin_token: Option<String>,
    /// Whether a request may bring its own plan in the `x-ragscope-fault` header.
    pub allow_header: bool,
    plan: RwLock<Arc<FaultPlan>>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults::disabled()
    }
}

impl Faults {
    pub fn disabled() -> Faults {
        Faults {
            enabled: false,
            admin_token: None,
            allow_header: false,
            plan: RwLock::new(Arc::new(FaultPlan::default())),
        }
    }

    pub fn from_args(args: &FaultArgs) -> Result<Faults> {
        let configured =
            args.fault_plan.is_some() || args.fault_admin_token.is_some() || args.fault_header;
        if !args.faults {
            if configured {
                bail!("--fault-plan, --fault-admin-token and --fault-header need --faults true");
            }
            return Ok(Faults::disabled());
        }
        let plan = match &args.fault_plan {
            None => FaultPlan::default(),
            Some(text) => {
                let json = match text.strip_prefix('@') {
                    Some(path) => std::fs::read_to_string(path)
                        .with_context(|| format!("--fault-plan: reading {path}"))?,
                    None => text.clone(),
                };
                FaultPlan::parse(&json).map_err(|e| anyhow::anyhow!("--fault-plan: {e}"))?
            }
        };
        let admin_token = args.fault_admin_token.clone().filter(|t| !t.is_empty());
        tracing::warn!(
            stages = plan.stages.len(),
            admin = admin_token.is_some(),
            header = args.fault_header,
            "fault injection is ON: spans record every injected fault as rag.fault.*"
        );
        Ok(Faults {
            enabled: true,
            admin_token,
            allow_header: args.fault_header,
            plan: RwLock::new(Arc::new(plan)),
        })
    }

    /// The plan every request without its own runs.
    pub fn current(&self) -> Arc<FaultPlan> {
        self.plan.read().expect("fault plan lock").clone()
    }

    pub fn replace(&self, plan: FaultPlan) {
        *self.plan.write().expect("fault plan lock") = Arc::new(plan);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_with_shorthand_and_distributions() {
        let plan = FaultPlan::parse(
            r#"{"retrieval": {"delay_ms": 20},
                "rerank": {"delay": {"dist": "pareto", "scale_ms": 2, "shape": 1.5}, "probability": 0.1},
                "chat": {"token_delay_ms": 5, "error_rate": 0.01}}"#,
        )
        .unwrap();
        assert_eq!(plan.stages.len(), 3);
        assert_eq!(plan.stages[&FaultStage::Retrieval].delay_ms, Some(20.0));
        assert_eq!(plan.token_delay(), Some(Duration::from_millis(5)));
    }

    #[test]
    fn bad_plans_name_the_field() {
        let cases = [
            (r#"{"retriever": {}}"#, "retriever"),
            (r#"{"retrieval": {"delay_ms": -1}}"#, "retrieval.delay_ms"),
            (
                r#"{"retrieval": {"error_rate": 2}}"#,
                "retrieval.error_rate",
            ),
            (
                r#"{"rerank": {"delay": {"dist": "pareto", "scale_ms": 1, "shape": 0}}}"#,
                "rerank.delay: shape",
            ),
            (r#"{"rerank": {"delay": {"dist": "zipf"}}}"#, "rerank.delay"),
            (
                r#"{"embeddings": {"token_delay_ms": 3}}"#,
                "embeddings.token_delay_ms",
            ),
            (
                r#"{"prompt": {"delay_ms": 1, "delay": {"dist": "fixed", "ms": 1}}}"#,
                "prompt.delay_ms",
            ),
            (r#"{"prompt": {"sleep": 1}}"#, "prompt"),
            (
                r#"{"retrieval": {"error_after_tokens": 2}}"#,
                "retrieval.error_after_tokens",
            ),
            (
                r#"{"chat": {"panic_after_tokens": 0}}"#,
                "chat.panic_after_tokens",
            ),
        ];
        for (json, want) in cases {
            let err = FaultPlan::parse(json).unwrap_err();
            assert!(err.contains(want), "{json}: {err}");
        }
    }

    #[test]
    fn distributions_invert_their_cdfs() {
        let pareto = Delay::Pareto {
            scale_ms: 2.0,
            shape: 2.0,
        };
        assert_eq!(pareto.sample_ms(1.0, 0.0), 2.0);
        assert!((pareto.sample_ms(0.01, 0.0) - 20.0).abs() < 1e-9);
        let exp = Delay::Exponential { mean_ms: 10.0 };
        assert!((exp.sample_ms((-1.0f64).exp(), 0.0) - 10.0).abs() < 1e-9);
        let uniform = Delay::Uniform {
            min_ms: 5.0,
            max_ms: 15.0,
        };
        assert_eq!(uniform.sample_ms(0.5, 0.0), 10.0);
        let lognormal = Delay::Lognormal {
            median_ms: 8.0,
            sigma: 1.0,
        };
        assert_eq!(lognormal.sample_ms(0.5, 0.0), 8.0);
    }

    #[test]
    fn a_fixed_delay_is_slept_inside_the_stage() {
        let plan = FaultPlan::parse(r#"{"retrieval": {"delay_ms": 15}}"#).unwrap();
        let span = Stage::root("retrieval test");
        let started = Instant::now();
        plan.apply(FaultStage::Retrieval, &span).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(15));
        // Other stages are untouched.
        let started = Instant::now();
        plan.apply(FaultStage::Embeddings, &span).unwrap();
        assert!(started.elapsed() < Duration::from_millis(15));
    }

    #[test]
    fn error_rate_one_always_fails_and_zero_never() {
        let span = Stage::root("chat test");
        let always = FaultPlan::parse(r#"{"chat": {"error_rate": 1}}"#).unwrap();
        let err = always.apply(FaultStage::Chat, &span).unwrap_err();
        assert_eq!(err.to_string(), "fault injected into the chat stage");
        let never = FaultPlan::parse(r#"{"chat": {"error_rate": 0}}"#).unwrap();
        for _ in 0..100 {
            never.apply(FaultStage::Chat, &span).unwrap();
        }
    }

    #[test]
    fn settings_without_the_switch_are_refused() {
        let args = FaultArgs {
            faults: false,
            fault_plan: Some("{}".into()),
            fault_admin_token: None,
            fault_header: false,
        };
        let err = Faults::from_args(&args).err().unwrap().to_string();
        assert!(err.contains("--faults true"), "{err}");
    }
}
