//! The prompt stage: the reranked passages and the question, rendered into the generator's
//! chat template and trimmed to the context window. Passages are kept best-first while they
//! fit; the rest are dropped (and counted on the span), so nothing ever overflows the model.

use crate::generate::{ChatMessage, GenerateError, Generator};

pub const SYSTEM: &str = "You are a helpful assistant. Answer the question using only the numbered passages. \
Answer briefly and mention the exact command or option. If the passages do not contain the answer, say that you don't know.";

/// A rendered prompt and how it was built.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Passages (indices into the input) that made it into the prompt.
    pub kept: Vec<usize>,
    pub dropped: usize,
    /// Some passage text was cut to fit.
    pub truncated: bool,
}

fn user_message(question: &str, passages: &[(usize, String)]) -> String {
    let mut s = String::from("Passages:\n");
    for (n, (_, text)) in passages.iter().enumerate() {
        s.push_str(&format!("[{}] {}\n\n", n + 1, text.trim()));
    }
    s.push_str(&format!("Question: {question}"));
    s
}

/// Builds the chat prompt: system message, earlier turns (`history`), then the passages and
/// `question`, leaving room for `max_tokens` of answer.
pub fn build(
    generator: &dyn Generator,
    history: &[ChatMessage],
    question: &str,
    passages: &[&str],
    max_tokens: usize,
) -> Result<Prompt, GenerateError> {
    let window = generator.context_window();
    let budget = window.saturating_sub(max_tokens);
    let render = |kept: &[(usize, String)]| -> Result<Vec<u32>, GenerateError> {
        let mut messages = vec![ChatMessage::new("system", SYSTEM)];
        messages.extend(history.iter().cloned());
        messages.push(ChatMessage::new("user", user_message(question, kept)));
        generator.chat_prompt(&messages)
    };
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
    Ok(Prompt {
        tokens,
        dropped: passages.len() - kept.len(),
        kept: kept.into_iter().map(|(i, _)| i).collect(),
        truncated,
    })
}
