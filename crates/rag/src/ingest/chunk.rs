//! Token-aware chunking: a document's text is split into sections at headings, sections into
//! sentences, and sentences are packed into chunks of at most `max_tokens` embedder tokens,
//! each chunk starting with the last sentences of the previous one (`overlap_tokens`).
//!
//! Every chunk is prefixed with its document title and section heading, which the embedder
//! sees too: a passage deep in "git-stash(1) › OPTIONS" is found by questions about stash.

/// A run of text under one heading.
#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    pub heading: Option<String>,
    pub text: String,
}

#[derive(Debug, Clone, Copy)]
pub struct ChunkerConfig {
    pub max_tokens: usize,
    pub overlap_tokens: usize,
}

impl Default for ChunkerConfig {
    fn default() -> Self {
        ChunkerConfig {
            max_tokens: 200,
            overlap_tokens: 40,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChunkText {
    pub text: String,
    pub section: Option<String>,
}

/// Splits Markdown-style text (`#`-prefixed heading lines) into sections.
pub fn sections(text: &str) -> Vec<Section> {
    let mut out = Vec::new();
    let mut current = Section {
        heading: None,
        text: String::new(),
    };
    for line in text.lines() {
        let trimmed = line.trim_start();
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && trimmed[hashes..].starts_with(' ') {
            if !current.text.trim().is_empty() {
                out.push(current);
            }
            current = Section {
                heading: Some(trimmed[hashes..].trim().to_string()),
                text: String::new(),
            };
        } else {
            current.text.push_str(line);
            current.text.push('\n');
        }
    }
    if !current.text.trim().is_empty() {
        out.push(current);
    }
    out
}

/// Sentence-like units: sentences end at `.`, `!`, `?` followed by whitespace; blank lines and
/// list items also end a unit (manual pages are mostly option lists, not prose).
pub fn sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut unit = String::new();
        for line in block.lines() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let starts_item = line.starts_with("* ") || line.starts_with("- ");
            if starts_item && !unit.is_empty() {
                push_sentences(&unit, &mut out);
                unit.clear();
            }
            if !unit.is_empty() {
                unit.push(' ');
            }
            unit.push_str(line);
        }
        push_sentences(&unit, &mut out);
    }
    out
}

fn push_sentences(unit: &str, out: &mut Vec<String>) {
    let mut start = 0;
    let bytes = unit.as_bytes();
    for i in 0..bytes.len() {
        let end_mark = matches!(bytes[i], b'.' | b'!' | b'?');
        let followed_by_space = bytes.get(i + 1).is_some_and(|b| b.is_ascii_whitespace());
        if end_mark && followed_by_space {
            let s = unit[start..=i].trim();
            if !s.is_empty() {
                out.push(s.to_string());
            }
            start = i + 1;
        }
    }
    let rest = unit[start..].trim();
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
}

/// Packs sentences into chunks. `count` returns a text's length in embedder tokens.
pub fn chunk(
    title: &str,
    sections: &[Section],
    cfg: ChunkerConfig,
    count: &dyn Fn(&str) -> usize,
) -> Vec<ChunkText> {
    let mut out = Vec::new();
    for section in sections {
        let header = match &section.heading {
            Some(h) if !title.is_empty() => format!("{title} › {h}\n"),
            Some(h) => format!("{h}\n"),
            None if !title.is_empty() => format!("{title}\n"),
            None => String::new(),
        };
        // A very long heading still leaves the body some room.
        let budget = cfg
            .max_tokens
            .saturating_sub(count(&header))
            .max(16.min(cfg.max_tokens / 2));
        let mut units: Vec<(String, usize)> = Vec::new();
        for s in sentences(&section.text) {
            let n = count(&s);
            if n <= budget {
                units.push((s, n));
            } else {
                units.extend(split_long(&s, budget, count));
            }
        }
        let mut window: Vec<(String, usize)> = Vec::new();
        let mut tokens = 0;
        let mut fresh = false; // whether the window holds anything not yet emitted
        for (s, n) in units {
            if tokens + n > budget && fresh {
                out.push(emit(&header, &window, &section.heading));
                // Keep the tail of the window as overlap.
                let mut keep = 0;
                let mut kept_tokens = 0;
                for (_, m) in window.iter().rev() {
                    if kept_tokens + m > cfg.overlap_tokens || kept_tokens + m + n > budget {
                        break;
                    }
                    kept_tokens += m;
                    keep += 1;
                }
                window.drain(..window.len() - keep);
                tokens = kept_tokens;
            }
            tokens += n;
            window.push((s, n));
            fresh = true;
        }
        if fresh {
            out.push(emit(&header, &window, &section.heading));
        }
    }
    out
}

fn emit(header: &str, window: &[(String, usize)], heading: &Option<String>) -> ChunkText {
    let body: Vec<&str> = window.iter().map(|(s, _)| s.as_str()).collect();
    ChunkText {
        text: format!("{header}{}", body.join(" ")),
        section: heading.clone(),
    }
}

/// Cuts a sentence longer than the budget into word runs that fit.
fn split_long(s: &str, budget: usize, count: &dyn Fn(&str) -> usize) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut piece = String::new();
    for word in s.split_whitespace() {
        let candidate = if piece.is_empty() {
            word.to_string()
        } else {
            format!("{piece} {word}")
        };
        if count(&candidate) > budget && !piece.is_empty() {
            let n = count(&piece);
            out.push((std::mem::replace(&mut piece, word.to_string()), n));
        } else {
            piece = candidate;
        }
    }
    if !piece.is_empty() {
        let n = count(&piece);
        out.push((piece, n));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    #[test]
    fn headings_split_sections() {
        let s = sections("intro line\n# NAME\ngit-stash - Stash\n\n## OPTIONS\n-p\n");
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].heading, None);
        assert_eq!(s[1].heading.as_deref(), Some("NAME"));
        assert_eq!(s[2].heading.as_deref(), Some("OPTIONS"));
        assert_eq!(s[2].text.trim(), "-p");
    }

    #[test]
    fn sentences_end_at_punctuation_and_list_items() {
        let s = sentences("One two. Three four? Five\nsix.\n\n* item one\n* item two");
        assert_eq!(
            s,
            [
                "One two.",
                "Three four?",
                "Five six.",
                "* item one",
                "* item two"
            ]
        );
        assert_eq!(sentences("version 2.3 is out"), ["version 2.3 is out"]);
    }

    #[test]
    fn chunks_respect_the_budget_and_overlap_at_sentence_boundaries() {
        let text: String = (0..30)
            .map(|i| format!("Sentence number {i} here. "))
            .collect();
        let cfg = ChunkerConfig {
            max_tokens: 20,
            overlap_tokens: 8,
        };
        let chunks = chunk("", &sections(&text), cfg, &words);
        assert!(chunks.len() > 5);
        for c in &chunks {
            assert!(words(&c.text) <= 20, "{}", c.text);
            assert!(c.text.ends_with('.'));
        }
        // Each chunk after the first repeats the previous chunk's last sentence(s), and
        // starts at a sentence boundary of it.
        for pair in chunks.windows(2) {
            let last = pair[0].text.rsplit(". ").next().unwrap();
            assert!(pair[1].text.contains(last), "{pair:?}");
            let first = pair[1].text.split(". ").next().unwrap();
            assert!(pair[0].text.contains(first), "{pair:?}");
        }
        // Nothing is lost.
        let all: String = chunks.iter().map(|c| c.text.clone()).collect();
        for i in 0..30 {
            assert!(all.contains(&format!("number {i} here")));
        }
    }

    #[test]
    fn a_sentence_longer_than_the_budget_is_split_by_words() {
        let long = "w ".repeat(50);
        let chunks = chunk(
            "T",
            &sections(&long),
            ChunkerConfig {
                max_tokens: 12,
                overlap_tokens: 0,
            },
            &words,
        );
        assert!(chunks.iter().all(|c| words(&c.text) <= 12));
        let total: usize = chunks.iter().map(|c| words(&c.text) - 1).sum();
        assert_eq!(total, 50);
    }

    #[test]
    fn chunks_carry_title_and_section() {
        let chunks = chunk(
            "git-stash(1)",
            &sections("## OPTIONS\nUse --keep-index."),
            ChunkerConfig::default(),
            &words,
        );
        assert_eq!(chunks[0].text, "git-stash(1) › OPTIONS\nUse --keep-index.");
        assert_eq!(chunks[0].section.as_deref(), Some("OPTIONS"));
    }
}
