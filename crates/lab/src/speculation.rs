//! `ragscope-lab speculation`: RAG answers' decode speed with and without speculative decoding
//! from the prompt, on the evaluation questions through the whole pipeline (retrieval, the
//! default context and prompt, the default sampling). The questions go in groups of
//! `--concurrency` asked at once (so their decode steps are batched); every group is answered
//! under every setting, one after another in an order that rotates from group to group, so the
//! box's state is shared by all settings of a group. Each setting's speed-up is the geometric
//! mean of its per-group decode-rate ratios against the first setting, with a 95% t interval.
//! Answers are compared with the first setting's, text and token count: drafting must change
//! none. Measurements, not assertions: the journal quotes the table with its command.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::Setup;
use llm::speculate::{Speculation, Tally};
use measure::confidence::paired_ratio;
use rag::pipeline::RagRequest;
use ragscope::app;
use telemetry::span::Stage;

/// What to compare and on which questions.
pub struct Plan {
    pub settings: Vec<Speculation>,
    pub questions: Vec<PathBuf>,
    /// At most this many questions (all when 0).
    pub limit: usize,
    /// Questions asked at once.
    pub concurrency: usize,
}

/// One answer: its text, completion tokens and decode seconds.
type Answer = (String, usize, f64);

/// One setting's answers, group by group.
#[derive(Default)]
struct Runs {
    answers: Vec<Vec<Answer>>,
    tally: Tally,
}

pub fn run(args: &Setup, plan: &Plan, handle: &tokio::runtime::Handle) -> Result<()> {
    if plan.settings.len() < 2 {
        bail!("give at least two settings to compare (the first is the baseline)");
    }
    let mut load = args.load.clone();
    // Each question is asked once per setting: from the second on its prompt would come from
    // the prefix cache. Decode is what is measured, but keep every answer's work the same.
    load.generator.prefix_cache_mb = 0;
    let pipeline = app::load_with_corpus(&load, &args.server)?;
    let mut questions = Vec::new();
    for path in &plan.questions {
        questions.extend(
            ragscope::eval::load_questions(path)?
                .into_iter()
                .map(|q| q.question),
        );
    }
    if plan.limit > 0 {
        questions.truncate(plan.limit);
    }
    let n = plan.settings.len();
    let mut runs: Vec<Runs> = (0..n).map(|_| Runs::default()).collect();
    let groups: Vec<&[String]> = questions.chunks(plan.concurrency.max(1)).collect();
    for (i, group) in groups.iter().enumerate() {
        for k in 0..n {
            let s = (i + k) % n;
            if !pipeline.generator.set_speculation(plan.settings[s]) {
                bail!("this generator does not draft");
            }
            let root = Arc::new(Stage::root("speculation"));
            let asked = group
                .iter()
                .map(|q| {
                    let timeout = args.server.request_timeout;
                    let req = RagRequest::with_defaults(q.clone(), &pipeline, timeout);
                    pipeline.start_query(req, &root, None)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut answers = Vec::new();
            for a in handle.block_on(futures::future::join_all(asked)) {
                let a = a?;
                runs[s].tally = runs[s].tally + a.speculation;
                answers.push((
                    a.answer,
                    a.usage.completion_tokens,
                    a.timings.decode_ms / 1e3,
                ));
            }
            runs[s].answers.push(answers);
        }
        eprintln!("speculation: group {}/{} done", i + 1, groups.len());
    }

    println!(
        "speculative decoding on {} ({})",
        llm::cpu::model(),
        llm::cpu::describe()
    );
    println!(
        "{} questions ({}), {} at once, each group under every setting in a rotating order; \
         prefix cache off; decode tok/s = (tokens - 1) / decode time, summed over the answers",
        questions.len(),
        plan.questions
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        plan.concurrency.max(1)
    );
    println!(
        "{:<24} {:>10} {:>22} {:>10} {:>16} {:>10}",
        "setting", "decode/s", "speed-up [95%]", "accepted", "tokens per step", "same"
    );
    // Decode tokens and seconds of a group's answers.
    let sums = |g: &[Answer]| -> (usize, f64) {
        g.iter()
            .fold((0, 0.0), |(t, s), a| (t + a.1.saturating_sub(1), s + a.2))
    };
    let rate = |g: &[Answer]| {
        let (t, s) = sums(g);
        t as f64 / s.max(1e-9)
    };
    let base = &runs[0];
    for (setting, r) in plan.settings.iter().zip(&runs) {
        let (tokens, seconds) = r
            .answers
            .iter()
            .map(|g| sums(g))
            .fold((0, 0.0), |(t, s), (gt, gs)| (t + gt, s + gs));
        let pairs: Vec<(f64, f64)> = base
            .answers
            .iter()
            .zip(&r.answers)
            .filter(|(a, b)| sums(a).0 > 0 && sums(b).0 > 0)
            .map(|(a, b)| (rate(a), rate(b)))
            .collect();
        let speedup = match paired_ratio(&pairs, 0.95) {
            Some((m, i)) => format!("{m:.2}x [{:.2}, {:.2}]", i.lo, i.hi),
            None => "-".into(),
        };
        let same = base
            .answers
            .iter()
            .flatten()
            .zip(r.answers.iter().flatten())
            .filter(|(a, b)| a.0 == b.0 && a.1 == b.1)
            .count();
        let accepted = r
            .tally
            .rate()
            .map_or("-".into(), |x| format!("{:.0}%", x * 100.0));
        // Decode steps taken: one per token not drafted and accepted.
        let steps = tokens.saturating_sub(r.tally.accepted).max(1);
        println!(
            "{:<24} {:>10.1} {:>22} {:>10} {:>16.2} {:>6}/{}",
            setting.to_string(),
            tokens as f64 / seconds.max(1e-9),
            speedup,
            accepted,
            tokens as f64 / steps as f64,
            same,
            questions.len()
        );
    }
    Ok(())
}
