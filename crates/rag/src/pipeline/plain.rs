//! The generator alone, on a prompt as the client wrote it: no embedding, retrieval, rerank or
//! prompt building. `/v1/completions` and chat with the plain model id run this, so a benchmark
//! measures the generator on exactly the prompt it would send another server. The same
//! `queue` → `chat {model}` (→ `stream`) stages as a RAG request, through the same
//! [`StageRunner`].

use std::future::Future;
use std::sync::Arc;

use super::generate::Given;
use super::{check_deadline, EventSender, Pipeline, PipelineError, RagAnswer, RagRequest};
use super::{StageRunner, StageSpec};
use crate::fault::FaultPlan;
use crate::worker::JobKind;
use llm::TokenLogprob;
use telemetry::clock::millis;
use telemetry::names::StageKind;
use telemetry::span::Stage;

impl Pipeline {
    /// Generates from `prompt` as given, with `req`'s generation settings (its query and
    /// retrieval settings are not used). Queued before this returns, as
    /// [`Pipeline::start_query`] is; with `events`, tokens are sent as they are ready.
    pub fn start_plain(
        self: &Arc<Self>,
        req: RagRequest,
        prompt: Vec<u32>,
        request: &Arc<Stage>,
        events: Option<EventSender>,
    ) -> Result<
        impl Future<Output = Result<RagAnswer, PipelineError>> + Send + 'static,
        PipelineError,
    > {
        self.start_job(req, request, events, move |this, req, stage, events| {
            this.plain(req, &prompt, stage, events)
        })
    }

    /// On a worker thread: only the generation stage. The text is returned exactly as
    /// generated (a completion is concatenated to its prompt, so no trimming).
    fn plain(
        &self,
        req: &RagRequest,
        prompt: &[u32],
        request: &Stage,
        events: Option<&EventSender>,
    ) -> Result<RagAnswer, PipelineError> {
        let mut run = StageRunner::new(request, &req.faults);
        run.timings_mut().queue_ms = millis(request.elapsed());
        check_deadline(req, request)?;
        let given = Given {
            prompt,
            context_tokens: &[],
            stop: &req.stop,
            headers: &[],
        };
        let generated = self.generate(&mut run, req, given, events)?;
        let texts: Vec<String> = generated.iter().map(|g| g.text.clone()).collect();
        let mut answer = self.finish(run, Vec::new(), generated);
        for (choice, text) in answer.choices.iter_mut().zip(texts) {
            choice.text = text;
        }
        answer.answer = answer.choices[0].text.clone();
        Ok(answer)
    }

    /// Scores `prompt` (the generator's [`score`](llm::Generator::score)) in a
    /// `chat {model}` stage on a model worker: the logprobs of an echoed prompt.
    pub async fn score_prompt(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        top: usize,
        faults: Arc<FaultPlan>,
        request: &Arc<Stage>,
    ) -> Result<Vec<TokenLogprob>, PipelineError> {
        let this = self.clone();
        let stage = request.clone();
        self.run_on_worker(JobKind::Query, request, move || {
            let mut run = StageRunner::new(&stage, &faults);
            let spec = StageSpec::model(StageKind::Generate, this.generator.model_id());
            run.run(spec, |stage| {
                Ok(this.generator.score(&prompt, top, stage)?)
            })
        })
        .await
    }
}
