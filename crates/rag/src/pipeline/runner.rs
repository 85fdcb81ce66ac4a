//! The one way a stage of a request runs. Every stage has the same ceremony: a child span of
//! the request named after its [`StageKind`], the attributes known up front, injected faults,
//! a CPU-profile label for the stages that compute, the work itself, `error.type` on failure,
//! the duration into `timings` and the `ragscope.stage.duration` metric. Written once here, so
//! no route can forget part of it.

use std::borrow::Cow;

use opentelemetry::KeyValue;

use super::{PipelineError, Timings};
use crate::fault::{FaultPlan, FaultStage};
use telemetry::clock::millis;
use telemetry::metrics::metrics;
use telemetry::names::StageKind;
use telemetry::profile;
use telemetry::span::{model_attributes, Stage};

/// A stage about to run: what it is, what it works on, and the attributes known before it runs.
pub struct StageSpec {
    kind: StageKind,
    subject: Option<String>,
    attributes: Vec<KeyValue>,
    profiled: bool,
}

impl StageSpec {
    pub fn new(kind: StageKind) -> StageSpec {
        StageSpec {
            kind,
            subject: None,
            attributes: Vec::new(),
            profiled: kind.profiled(),
        }
    }

    /// A model stage: named after the model, with the GenAI model attributes.
    pub fn model(kind: StageKind, model: &str) -> StageSpec {
        let mut spec = StageSpec::new(kind).on(model);
        spec.attributes = model_attributes(kind, model);
        spec
    }

    /// What the stage works on, the second word of its span name (a model, a collection).
    pub fn on(mut self, subject: impl Into<String>) -> StageSpec {
        self.subject = Some(subject.into());
        self
    }

    pub fn with(mut self, attributes: impl IntoIterator<Item = KeyValue>) -> StageSpec {
        self.attributes.extend(attributes);
        self
    }

    /// Turns the profile label off for a run that does no work worth a label (a cache hit):
    /// each label change makes the profiler cut its buffer.
    pub fn profiled(mut self, profiled: bool) -> StageSpec {
        self.profiled = profiled && self.kind.profiled();
        self
    }

    fn span_name(&self) -> Cow<'static, str> {
        self.kind.span_name(self.subject.as_deref())
    }
}

/// Runs the stages of one request under its span and collects their durations.
pub struct StageRunner<'a> {
    request: &'a Stage,
    faults: &'a FaultPlan,
    timings: Timings,
}

impl<'a> StageRunner<'a> {
    pub fn new(request: &'a Stage, faults: &'a FaultPlan) -> StageRunner<'a> {
        StageRunner {
            request,
            faults,
            timings: Timings::default(),
        }
    }

    /// Runs `work` as the stage `spec` describes. A failure, of the work or an injected fault,
    /// is recorded on the stage's span as `error.type` before it is returned.
    pub fn run<T>(
        &mut self,
        spec: StageSpec,
        work: impl FnOnce(&Stage) -> Result<T, PipelineError>,
    ) -> Result<T, PipelineError> {
        let stage = self.request.child(spec.span_name());
        stage.set_all(spec.attributes);
        let result = (|| {
            if let Some(fault) = FaultStage::of(spec.kind) {
                self.faults.apply(fault, &stage)?;
            }
            let _profiled = spec.profiled.then(|| profile::label(&stage));
            work(&stage)
        })();
        match &result {
            // An injected fault has marked the span already, with its own attributes.
            Err(PipelineError::Injected(_)) | Ok(_) => {}
            Err(e) => stage.fail(e.kind(), e.to_string()),
        }
        let span = stage.span_context();
        let took = stage.end();
        self.timings.record(spec.kind, millis(took));
        metrics().stage(spec.kind, took, Some(&span));
        result
    }

    /// The request's stage span, for work between stages.
    pub fn request(&self) -> &Stage {
        self.request
    }

    /// The durations so far.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    pub fn timings_mut(&mut self) -> &mut Timings {
        &mut self.timings
    }
}
