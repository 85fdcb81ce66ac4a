//! A passage as the context stage and entry lookup read it: its `title › section` header, its
//! sentences, and the entry term (the option or variable a manual entry defines) a sentence
//! begins.

use crate::ingest::chunk::sentences;

/// One passage split for selection: its first line (the chunk's `title › section`) and the
/// sentences of the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPassage {
    pub header: Option<String>,
    pub sentences: Vec<String>,
}

impl SplitPassage {
    /// For each sentence, the term of the entry it belongs to: the leading option or variable
    /// of the nearest sentence at or before it that starts with one ([`entry_term`]). Entries
    /// that began in an earlier chunk have none here.
    pub fn entry_terms(&self) -> Vec<Option<&str>> {
        let mut current = None;
        self.sentences
            .iter()
            .map(|s| {
                current = entry_term(s).or(current);
                current
            })
            .collect()
    }
}

/// The option(s) or configuration variable a manual entry starts with, if `sentence` starts
/// one: a run of options with their argument placeholders (`-p --patch`,
/// `--depth <depth>`, `--[no-]verify`), or a dotted lowercase-led variable
/// (`core.hooksPath`, `mergetool.<tool>.path`). Prose, including a sentence that merely
/// mentions an option later on, has none.
pub fn entry_term(sentence: &str) -> Option<&str> {
    let mut end = 0;
    for (i, word) in sentence.split_whitespace().enumerate() {
        let option = word.starts_with('-')
            && word
                .trim_start_matches('-')
                .starts_with(|c: char| c.is_alphanumeric() || c == '[');
        let placeholder = i > 0 && (word.starts_with('<') || word.starts_with('['));
        let variable = i == 0 && is_variable(word.trim_end_matches([',', ':']));
        if !(option || placeholder || variable) {
            break;
        }
        // The word's place: its first occurrence after the previous word's end.
        let start = sentence[end..].find(word).map_or(end, |at| end + at);
        end = start + word.len();
    }
    let term = sentence[..end].trim().trim_end_matches([',', ':']);
    (!term.is_empty()).then_some(term)
}

/// `section.key`, `section.<name>.key`: at least two dot-separated parts, the first all
/// lowercase ASCII letters, none empty, and no sentence-ending dot.
fn is_variable(word: &str) -> bool {
    let parts: Vec<&str> = word.split('.').collect();
    parts.len() >= 2
        && parts.iter().all(|p| !p.is_empty())
        && parts[0].chars().all(|c| c.is_ascii_lowercase())
}

/// Splits a chunk's text: a first line without sentence punctuation is its header (the chunker
/// starts every chunk with `title › section`), the rest goes through the chunker's sentence
/// splitter, so the sentences are the units the chunk was packed from.
pub fn split_passage(text: &str) -> SplitPassage {
    let text = text.trim();
    let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
    let is_header = !rest.trim().is_empty()
        && !first.trim_end().ends_with(['.', '!', '?'])
        && first.chars().count() <= 120;
    if is_header {
        SplitPassage {
            header: Some(first.trim().to_string()),
            sentences: sentences(rest),
        }
    } else {
        SplitPassage {
            header: None,
            sentences: sentences(text),
        }
    }
}
