//! `ragscope eval`: retrieval recall@k and MRR before and after reranking, and the rate of
//! answers containing the expected fact, on the evaluation questions (`eval/questions.jsonl`,
//! each naming the corpus document that answers it).

use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use serde::Deserialize;
use serde_json::json;

use crate::app;
use crate::config::{EvalArgs, PipelineArgs};
use llm::FinishReason;
use rag::pipeline::{RagAnswer, RagRequest};
use rag::rerank::fusion::FusionReranker;
use rag::rerank::{ranking, Candidate, Reranker};
use rag::retrieve::ScoredChunk;
use telemetry::names::span;
use telemetry::span::Stage;

#[derive(Debug, Deserialize)]
pub struct Question {
    pub id: String,
    pub question: String,
    /// The document id (file name) that answers it.
    pub doc: String,
    #[serde(default)]
    pub section: String,
    /// Any one of these, case-insensitively, makes an answer correct.
    pub answer_contains: Vec<String>,
}

pub fn load_questions(path: &Path) -> Result<Vec<Question>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}:{}", path.display(), i + 1))
        })
        .collect()
}

/// Rank (from 0) of the first chunk of `doc` in `order`, if any.
fn first_rank(hits: &[ScoredChunk], order: &[usize], doc: &str) -> Option<usize> {
    order.iter().position(|&i| hits[i].chunk.doc_id == doc)
}

/// Recall@k and MRR of one ordering over all questions.
#[derive(Debug, Default, Clone)]
pub struct RankScores {
    pub hits_at: Vec<(usize, usize)>,
    pub reciprocal_sum: f64,
}

impl RankScores {
    fn add(&mut self, ks: &[usize], rank: Option<usize>) {
        if self.hits_at.is_empty() {
            self.hits_at = ks.iter().map(|&k| (k, 0)).collect();
        }
        if let Some(r) = rank {
            self.reciprocal_sum += 1.0 / (r as f64 + 1.0);
            for (k, hits) in &mut self.hits_at {
                if r < *k {
                    *hits += 1;
                }
            }
        }
    }
}

pub async fn run(args: EvalArgs) -> Result<()> {
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || evaluate(&args, &handle)).await?
}

fn evaluate(args: &EvalArgs, handle: &tokio::runtime::Handle) -> Result<()> {
    let questions = load_questions(&args.questions)?;
    let pipeline = app::load_with_corpus(&args.load, &args.server)?;
    let top_k = args
        .load
        .pipeline
        .top_k
        .max(args.k.iter().copied().max().unwrap_or(1));
    let variants: Vec<(String, Option<Arc<dyn Reranker>>)> = vec![
        ("retrieval order".into(), None),
        (
            "fusion k=10 w=1".into(),
            Some(Arc::new(FusionReranker {
                k: 10.0,
                lexical_weight: 1.0,
            })),
        ),
        (
            "fusion k=60 w=1".into(),
            Some(Arc::new(FusionReranker {
                k: 60.0,
                lexical_weight: 1.0,
            })),
        ),
        (
            "fusion k=10 w=0.5".into(),
            Some(Arc::new(FusionReranker {
                k: 10.0,
                lexical_weight: 0.5,
            })),
        ),
    ];
    let mut scores = vec![RankScores::default(); variants.len()];
    let root = || Stage::root(span::EVAL);
    let lexical_top_k = args.load.pipeline.lexical_top_k.min(top_k);
    for q in &questions {
        let stage = root();
        let vector = pipeline.embedder.embed(&[&q.question], &stage)?.remove(0);
        let hits = rag::retrieve::hybrid_search(
            pipeline.store.as_ref(),
            &q.question,
            &vector,
            top_k,
            lexical_top_k,
            None,
            &stage,
        )?
        .hits;
        let candidates: Vec<Candidate> = hits
            .iter()
            .map(|h| Candidate {
                text: &h.chunk.text,
                retrieval_score: h.score,
            })
            .collect();
        for (v, (_, reranker)) in variants.iter().enumerate() {
            let order = match reranker {
                Some(r) => ranking(&r.score(&q.question, &candidates, &stage)?),
                None => (0..hits.len()).collect(),
            };
            scores[v].add(&args.k, first_rank(&hits, &order, &q.doc));
        }
    }
    let n = questions.len() as f64;
    println!(
        "\nretrieval over {} questions (top_k {top_k}, lexical_top_k {lexical_top_k}, \
         document-level match)",
        questions.len()
    );
    let header: Vec<String> = args.k.iter().map(|k| format!("recall@{k}")).collect();
    println!(
        "{:<22} {}  MRR",
        "ordering",
        header
            .iter()
            .map(|h| format!("{h:>10}"))
            .collect::<String>()
    );
    let mut report = Vec::new();
    for ((name, _), s) in variants.iter().zip(&scores) {
        let recalls: Vec<f64> = s.hits_at.iter().map(|(_, h)| *h as f64 / n).collect();
        println!(
            "{name:<22} {}  {:.3}",
            recalls
                .iter()
                .map(|r| format!("{r:>10.3}"))
                .collect::<String>(),
            s.reciprocal_sum / n
        );
        report.push(json!({"ordering": name, "recall": s.hits_at.iter().map(|(k, h)| json!({"k": k, "recall": *h as f64 / n})).collect::<Vec<_>>(), "mrr": s.reciprocal_sum / n}));
    }

    if args.answers {
        println!(
            "\nanswers (reranker: {}; {}):",
            pipeline.reranker.as_ref().map_or("none", |r| r.model_id()),
            settings(&args.load.pipeline, &args.load.sampling.defaults())
        );
        let mut tally = AnswerTally::default();
        let mut dump = args
            .dump
            .as_ref()
            .map(|path| {
                std::fs::File::create(path)
                    .map(std::io::BufWriter::new)
                    .with_context(|| format!("--dump {}", path.display()))
            })
            .transpose()?;
        for q in &questions {
            let answer = ask(&pipeline, args, handle, &q.question)?;
            let has_fact = |text: &str| {
                let lower = text.to_lowercase();
                q.answer_contains
                    .iter()
                    .any(|f| lower.contains(&f.to_lowercase()))
            };
            let ok = has_fact(&answer.answer);
            tally.add(&answer, ok);
            let in_context = answer.context.iter().any(|c| has_fact(c));
            tally.in_context += in_context as usize;
            let sources = format!("{} {}", q.question, answer.context.join(" "));
            let known = names(&sources);
            let names = names(&answer.answer);
            let invented: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| !known.contains(n))
                .collect();
            tally.names += names.len();
            tally.invented += invented.len();
            if let Some(out) = &mut dump {
                let line = json!({
                    "id": q.id,
                    "question": q.question,
                    "answer_contains": q.answer_contains,
                    "context": answer.context,
                    "answer": answer.answer,
                    "ok": ok,
                    "fact_in_context": in_context,
                    "invented_names": invented,
                    "prompt_tokens": answer.usage.prompt_tokens,
                    "completion_tokens": answer.usage.completion_tokens,
                    "finish_reason": answer.finish_reason.as_str(),
                    "ttft_ms": answer.timings.ttft_ms,
                    "decode_ms": answer.timings.decode_ms,
                });
                writeln!(out, "{line}")?;
            }
            println!(
                "{} {:>4} {:>4}+{:<3} {}",
                if ok { "ok  " } else { "MISS" },
                q.id,
                answer.usage.prompt_tokens,
                answer.usage.completion_tokens,
                answer
                    .answer
                    .replace('\n', " ")
                    .chars()
                    .take(110)
                    .collect::<String>()
            );
        }
        let n_answers = questions.len();
        println!(
            "\nanswer contains expected fact: {}/{n_answers} = {:.3}; mean prompt tokens {:.0}, \
             mean answer tokens {:.1}; ran to max_tokens {}, repeated a phrase {}; the fact was \
             in the context for {}; names in the answers {}, of them not in the question or \
             context (invented) {}",
            tally.correct,
            tally.correct as f64 / n,
            tally.prompt_tokens as f64 / n,
            tally.answer_tokens as f64 / n,
            tally.length,
            tally.repeats,
            tally.in_context,
            tally.names,
            tally.invented,
        );
        let mut readme = AnswerTally::default();
        println!("\nthe README's examples:");
        for question in README_QUESTIONS {
            let answer = ask(&pipeline, args, handle, question)?;
            readme.add(&answer, false);
            println!(
                "{:<6} {:>3} tokens, repeats: {:<5} {question} → {}",
                answer.finish_reason.as_str(),
                answer.usage.completion_tokens,
                repeats_a_phrase(&answer.answer),
                answer.answer.replace('\n', " ")
            );
        }
        report.push(json!({
            "settings": settings(&args.load.pipeline, &args.load.sampling.defaults()),
            "answer_contains_rate": tally.correct as f64 / n,
            "mean_prompt_tokens": tally.prompt_tokens as f64 / n,
            "mean_answer_tokens": tally.answer_tokens as f64 / n,
            "ran_to_max_tokens": tally.length,
            "repeated_a_phrase": tally.repeats,
            "fact_in_context": tally.in_context,
            "names_in_answers": tally.names,
            "invented_names": tally.invented,
            "readme_examples": {"ran_to_max_tokens": readme.length, "repeated_a_phrase": readme.repeats},
        }));
    }
    println!("\n{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The questions the README shows answers to.
const README_QUESTIONS: &[&str] = &[
    "How do I make a shallow clone?",
    "How do I undo git add?",
    "What does git stash pop do?",
];

/// One question through the whole pipeline with the settings of the command line.
fn ask(
    pipeline: &Arc<rag::pipeline::Pipeline>,
    args: &EvalArgs,
    handle: &tokio::runtime::Handle,
    question: &str,
) -> Result<RagAnswer> {
    let stage = Arc::new(Stage::root(span::EVAL));
    let req =
        RagRequest::with_defaults(question.to_string(), pipeline, args.server.request_timeout);
    Ok(handle.block_on(pipeline.start_query(req, &stage, None)?)?)
}

/// The settings an answer run used, for its report line.
fn settings(p: &PipelineArgs, sampling: &llm::Sampling) -> String {
    format!(
        "context {} budget {}/passage method {} order {} terms {} entry_lookup {} template {:?} \
         rerank_top_n {} max_tokens {} {} end_at_paragraph {}",
        p.context.as_str(),
        p.context_budget,
        p.context_method.as_str(),
        p.context_order.as_str(),
        p.context_terms,
        p.entry_lookup,
        p.prompt_template,
        p.rerank_top_n,
        p.max_tokens,
        sampling,
        p.end_at_paragraph
    )
}

/// Sums over the answers of one run.
#[derive(Debug, Default)]
struct AnswerTally {
    correct: usize,
    prompt_tokens: usize,
    answer_tokens: usize,
    /// Answers that ran to `max_tokens`.
    length: usize,
    /// Answers that repeat a phrase ([`repeats_a_phrase`]).
    repeats: usize,
    /// Questions whose context (what the prompt got) contained the expected fact.
    in_context: usize,
    /// Names in the answers ([`names`]), and those found in neither the question nor the
    /// context: an option or command the generator made up, or garbled while copying it.
    names: usize,
    invented: usize,
}

impl AnswerTally {
    fn add(&mut self, answer: &RagAnswer, correct: bool) {
        self.correct += correct as usize;
        self.prompt_tokens += answer.usage.prompt_tokens;
        self.answer_tokens += answer.usage.completion_tokens;
        self.length += (answer.finish_reason == FinishReason::Length) as usize;
        self.repeats += repeats_a_phrase(&answer.answer) as usize;
    }
}

/// Words in a row that, seen twice in one answer, make it a loop: "2. The second step is to
/// clone a repository" after "1. The first step is to clone a repository" shares six.
const LOOP_WORDS: usize = 6;

/// Whether some run of [`LOOP_WORDS`] words (lowercased, punctuation dropped) occurs twice.
pub fn repeats_a_phrase(text: &str) -> bool {
    let words: Vec<String> = text
        .split_whitespace()
        .map(|w| {
            w.chars()
                .filter(|c| c.is_alphanumeric() || *c == '-')
                .collect::<String>()
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .collect();
    let mut seen = std::collections::HashSet::new();
    words.windows(LOOP_WORDS).any(|w| !seen.insert(w.join(" ")))
}

/// The names an answer uses, each once: options (`--depth`, `-p`), dashed names
/// (`git-stash`, `remote-tracking`) and dotted configuration variables (`pull.rebase`, not
/// `e.g`), with surrounding punctuation and a trailing `.` or `-` dropped. Compared whole
/// against the sources' names, so `-p` is not found in `--prune`. English compounds
/// (`up-to-date`) count too, and `--no-autostash` is not found in `--[no-]autostash`: both
/// sides of a comparison carry the same noise.
pub fn names(text: &str) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    let parts = text.split(|c: char| !(c.is_alphanumeric() || matches!(c, '-' | '.' | '_')));
    for word in parts {
        let word = word.trim_start_matches('.').trim_end_matches(['.', '-']);
        let bare = word.trim_start_matches('-');
        let option = word.starts_with('-') && bare.starts_with(char::is_alphabetic);
        let joined = |mark: char, shortest: usize| {
            word.starts_with(char::is_alphabetic)
                && word.contains(mark)
                && word.split(mark).all(|p| p.chars().count() >= shortest)
        };
        let name = option || joined('-', 1) || joined('.', 2);
        if name && !out.contains(&word) {
            out.push(word);
        }
    }
    out
}

/// The first `n` evaluation questions (the benchmark's fixed query set).
pub fn first_questions(path: &Path, n: usize) -> Result<Vec<String>> {
    Ok(load_questions(path)?
        .into_iter()
        .take(n)
        .map(|q| q.question)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::{names, repeats_a_phrase};

    #[test]
    fn an_answers_names_are_its_options_dashed_names_and_variables() {
        let answer = "Run `git-clone --depth=1` (see pull.rebase, -p and remote-tracking). \
                      Then git-clone again; a - b, e.g. 1.5, --, x-.";
        assert_eq!(
            names(answer),
            [
                "git-clone",
                "--depth",
                "pull.rebase",
                "-p",
                "remote-tracking"
            ]
        );
    }

    #[test]
    fn a_looping_answer_repeats_a_phrase_and_a_short_one_does_not() {
        assert!(repeats_a_phrase(
            "1. The first step is to clone a repository. 2. The second step is to clone a \
             repository."
        ));
        assert!(!repeats_a_phrase(
            "Use `git clone --depth 1 <url>` to make a shallow clone."
        ));
    }
}
