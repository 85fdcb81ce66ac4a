//! The prompt stage: the context passages and the question, rendered into the generator's
//! chat template and trimmed to the context window. Passages are kept best-first while they
//! fit; the rest are dropped (and counted on the span), so nothing ever overflows the model.
//!
//! The wording is a [`PromptTemplate`]; docs/CONTEXT.md has the evaluation each was measured
//! on and why the default is the default.

use llm::{ChatMessage, GenerateError, Generator};

/// The system text of the `numbered` template (the stage bench's fixed prompt uses it too).
pub const SYSTEM: &str = "You are a helpful assistant. Answer the question using only the numbered passages. \
Answer briefly and mention the exact command or option. If the passages do not contain the answer, say that you don't know.";

const BRIEF_SYSTEM: &str =
    "Answer the question in one short sentence, using only the numbered passages. \
Name the exact command or option.";

/// How the RAG prompt is worded. Every template marks each passage `[n]` for the answer's
/// `n`-th source, whatever order the passages are listed in.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum PromptTemplate {
    /// [`SYSTEM`]; the user turn is the passages, then the question.
    Numbered,
    /// A one-sentence instruction as the system turn; passages, then the question.
    Brief,
    /// The question first, then the passages, then the question again as the last line
    /// (a small model attends most to the end of its prompt). The best of the four on the
    /// evaluation set (docs/CONTEXT.md).
    #[default]
    QuestionLast,
    /// No system turn of ours (the model's own default); the instruction ends the user turn.
    Inline,
}

impl PromptTemplate {
    fn system(self) -> Option<&'static str> {
        match self {
            PromptTemplate::Numbered => Some(SYSTEM),
            PromptTemplate::Brief | PromptTemplate::QuestionLast => Some(BRIEF_SYSTEM),
            PromptTemplate::Inline => None,
        }
    }

    fn user_message(self, question: &str, passages: &[&(usize, String)]) -> String {
        let mut s = String::new();
        if self == PromptTemplate::QuestionLast {
            s.push_str(&format!("Question: {question}\n\n"));
        }
        s.push_str("Passages:\n");
        for (source, text) in passages {
            s.push_str(&format!("[{}] {}\n\n", source + 1, text.trim()));
        }
        match self {
            PromptTemplate::Inline => s.push_str(&format!(
                "Using only the passages above, answer in one short sentence and name the exact \
                 command or option.\nQuestion: {question}"
            )),
            _ => s.push_str(&format!("Question: {question}")),
        }
        s
    }
}

/// Text that, generated after an answer, means the answer is over: the RAG templates' own
/// section labels (a small model goes on to write the next "Question:" of its prompt's shape).
/// A RAG answer stops at them as at a request's stop strings.
pub const ANSWER_ENDS: &[&str] = &["\nQuestion:", "\nPassages:"];

/// A rendered prompt and how it was built.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Passages (indices into the input) that made it into the prompt.
    pub kept: Vec<usize>,
    /// Their text as the prompt holds it (the last one cut when `truncated`).
    pub texts: Vec<String>,
    pub dropped: usize,
    /// Some passage text was cut to fit.
    pub truncated: bool,
}

/// [`build_with`] in the default template.
pub fn build(
    generator: &dyn Generator,
    history: &[ChatMessage],
    question: &str,
    passages: &[&str],
    max_tokens: usize,
) -> Result<Prompt, GenerateError> {
    build_with(
        generator,
        PromptTemplate::default(),
        history,
        question,
        passages,
        max_tokens,
    )
}

/// The template's messages around `kept` passages (each with its index among the sources),
/// listed in the order of `listing`, tokenized.
fn render(
    generator: &dyn Generator,
    template: PromptTemplate,
    history: &[ChatMessage],
    question: &str,
    kept: &[(usize, String)],
    listing: &[usize],
) -> Result<Vec<u32>, GenerateError> {
    let place = |i: usize| listing.iter().position(|&l| l == i).unwrap_or(i);
    let mut listed: Vec<&(usize, String)> = kept.iter().collect();
    listed.sort_by_key(|(i, _)| place(*i));
    let mut messages: Vec<ChatMessage> = template
        .system()
        .map(|s| ChatMessage::new("system", s))
        .into_iter()
        .collect();
    messages.extend(history.iter().cloned());
    messages.push(ChatMessage::new(
        "user",
        template.user_message(question, &listed),
    ));
    generator.tokenizer().chat_prompt(&messages)
}

/// The head of every prompt [`build_with`] can make for this question, whatever the passages:
/// the tokens that a prompt without passages and one with a passage share. Known before
/// retrieval, so its prefill can start while the question is embedded and searched (with
/// `question-last`: the system turn, the history and the question; with the templates that
/// put passages first, the system turn and the history).
pub fn head(
    generator: &dyn Generator,
    template: PromptTemplate,
    history: &[ChatMessage],
    question: &str,
) -> Result<Vec<u32>, GenerateError> {
    let none = render(generator, template, history, question, &[], &[])?;
    let one = render(
        generator,
        template,
        history,
        question,
        &[(0, "x".into())],
        &[0],
    )?;
    let shared = none.iter().zip(&one).take_while(|(a, b)| a == b).count();
    Ok(none[..shared].to_vec())
}

/// Builds the chat prompt: the template's system message, earlier turns (`history`), then the
/// passages and `question`, leaving room for `max_tokens` of answer.
pub fn build_with(
    generator: &dyn Generator,
    template: PromptTemplate,
    history: &[ChatMessage],
    question: &str,
    passages: &[&str],
    max_tokens: usize,
) -> Result<Prompt, GenerateError> {
    let listing: Vec<usize> = (0..passages.len()).collect();
    build_listed(
        generator, template, history, question, passages, &listing, max_tokens,
    )
}

/// [`build_with`], the passages listed in the order of `listing` (indices into `passages`,
/// see [`ContextOrder`](crate::pipeline::context::ContextOrder)). Passages are still kept
/// best-first, in the order given, while they fit; each keeps its `[n]` marker.
pub fn build_listed(
    generator: &dyn Generator,
    template: PromptTemplate,
    history: &[ChatMessage],
    question: &str,
    passages: &[&str],
    listing: &[usize],
    max_tokens: usize,
) -> Result<Prompt, GenerateError> {
    let window = generator.context_window();
    let budget = window.saturating_sub(max_tokens);
    let render =
        |kept: &[(usize, String)]| render(generator, template, history, question, kept, listing);
    let mut kept: Vec<(usize, String)> = Vec::new();
    let mut tokens = render(&kept)?;
    if tokens.len() > budget {
        return Err(GenerateError::ContextOverflow {
            prompt: tokens.len(),
            max_tokens,
            window,
        });
    }
    let mut truncated = false;
    for (i, passage) in passages.iter().enumerate() {
        kept.push((i, passage.to_string()));
        match render(&kept)? {
            t if t.len() <= budget => tokens = t,
            _ => {
                // Try the passage cut to the room that is left, in words, if that room is
                // worth having; otherwise drop it and stop.
                let room = budget - tokens.len();
                kept.pop();
                if room >= 48 {
                    let words: Vec<&str> = passage.split_whitespace().collect();
                    let mut take = (room * 2 / 3).min(words.len());
                    while take > 16 {
                        kept.push((i, words[..take].join(" ")));
                        let t = render(&kept)?;
                        if t.len() <= budget {
                            tokens = t;
                            truncated = true;
                            break;
                        }
                        kept.pop();
                        take = take * 3 / 4;
                    }
                }
                break;
            }
        }
    }
    let (kept, texts): (Vec<usize>, Vec<String>) = kept.into_iter().unzip();
    Ok(Prompt {
        tokens,
        dropped: passages.len() - kept.len(),
        kept,
        texts,
        truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm::testing::model as test_model;
    use llm::ChatTokenizer;

    #[test]
    fn listed_passages_keep_their_source_markers_in_any_order() {
        let Some(model) = test_model() else { return };
        let passages = ["Alpha is first.", "Beta is second.", "Gamma is third."];
        let template = PromptTemplate::QuestionLast;
        let text = |listing: &[usize]| {
            let built =
                build_listed(model, template, &[], "Which?", &passages, listing, 16).unwrap();
            assert_eq!(built.kept, [0, 1, 2]);
            model.detokenize(&built.tokens).unwrap()
        };
        let places = |text: &str| -> Vec<usize> {
            ["[1] Alpha", "[2] Beta", "[3] Gamma"]
                .iter()
                .map(|m| text.find(m).unwrap_or_else(|| panic!("{m} in {text}")))
                .collect()
        };
        let listed = places(&text(&[2, 0, 1]));
        assert!(listed[2] < listed[0] && listed[0] < listed[1], "{listed:?}");
        let in_order = places(&text(&[0, 1, 2]));
        assert!(in_order[0] < in_order[1] && in_order[1] < in_order[2]);
        let plain = build_with(model, template, &[], "Which?", &passages, 16).unwrap();
        assert_eq!(model.detokenize(&plain.tokens).unwrap(), text(&[0, 1, 2]));
    }

    #[test]
    fn a_prompt_says_which_passages_it_holds_and_how_much_of_each() {
        let Some(model) = test_model() else { return };
        let long: String = (0..400).map(|i| format!("word{i} ")).collect();
        let passages = ["Alpha is first.", long.trim_end(), "Gamma is third."];
        let template = PromptTemplate::QuestionLast;
        let whole = build_with(model, template, &[], "Which?", &passages[..1], 16).unwrap();
        // Room for the first passage and ~200 more tokens: the second is cut, the third dropped.
        let max_tokens = 2048 - whole.tokens.len() - 200;
        let built = build_with(model, template, &[], "Which?", &passages, max_tokens).unwrap();
        assert_eq!(built.kept, [0, 1]);
        assert_eq!((built.dropped, built.truncated), (1, true));
        assert_eq!(built.texts[0], passages[0]);
        let cut = &built.texts[1];
        assert!(passages[1].starts_with(cut.as_str()) && cut.len() < passages[1].len());
        let prompt = model.detokenize(&built.tokens).unwrap();
        assert!(
            prompt.contains(cut.as_str()) && !prompt.contains("Gamma"),
            "{prompt}"
        );
    }

    #[test]
    fn the_head_starts_every_prompt_of_its_question() {
        let Some(model) = test_model() else { return };
        let history = [
            ChatMessage::new("user", "What does git stash do?"),
            ChatMessage::new("assistant", "It shelves your changes."),
        ];
        let question = "How do I list stashes?";
        let passages = [
            "[x] `git stash list` lists the stash entries.",
            "Other text.",
        ];
        for template in [
            PromptTemplate::Numbered,
            PromptTemplate::Brief,
            PromptTemplate::QuestionLast,
            PromptTemplate::Inline,
        ] {
            let head = head(model, template, &history, question).unwrap();
            for kept in [&passages[..0], &passages[..1], &passages[..]] {
                let built = build_with(model, template, &history, question, kept, 16).unwrap();
                assert_eq!(&built.tokens[..head.len()], &head[..], "{template:?}");
            }
            let text = model.detokenize(&head).unwrap();
            // Only question-last knows the question before the passages.
            let asks = text.contains(question);
            assert_eq!(asks, template == PromptTemplate::QuestionLast, "{text}");
            assert!(
                text.contains("What does git stash do?"),
                "the history is in it"
            );
        }
    }
}
