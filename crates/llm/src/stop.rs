//! Stop strings over a stream of generated text. A stop string can span tokens, so the text
//! that could still be the start of one is held back until the next token shows whether it is;
//! a stop string and everything after it never reach the consumer. Each token's log-probability
//! travels with the piece of text that completes it.
//!
//! A generation may also end at its first finished paragraph: a blank line after a sentence's
//! end (`.`, `!`, `?`) or a closed code block, outside any code block.

use std::collections::VecDeque;

use super::TokenLogprob;

/// The text of one generation between the tokens and the consumer.
pub(super) struct StopText<'a> {
    stops: &'a [String],
    /// End at the first finished paragraph.
    paragraph: bool,
    /// The text handed on so far (kept only when `paragraph` is on: the rule looks back).
    before: String,
    /// Bytes handed on so far.
    released: usize,
    /// Text produced after `released`: it may still turn into a stop string.
    held: String,
    /// Log-probabilities not handed on yet, with their token's text span (absolute offsets).
    queued: VecDeque<(usize, usize, TokenLogprob)>,
    /// What the last call released.
    out_text: String,
    out_logprobs: Vec<TokenLogprob>,
}

/// What one call lets through to the consumer.
pub(super) struct Release<'s> {
    pub text: &'s str,
    pub logprobs: &'s [TokenLogprob],
    /// A stop string was found: the generation ends here.
    pub stopped: bool,
}

impl Release<'_> {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.logprobs.is_empty()
    }
}

impl<'a> StopText<'a> {
    /// Empty stop strings are ignored (they would stop before the first token).
    pub fn new(stops: &'a [String]) -> StopText<'a> {
        StopText {
            stops,
            paragraph: false,
            before: String::new(),
            released: 0,
            held: String::new(),
            queued: VecDeque::new(),
            out_text: String::new(),
            out_logprobs: Vec::new(),
        }
    }

    /// One token's text (empty while a character is incomplete) and its log-probability.
    pub fn push(&mut self, text: &str, logprob: Option<TokenLogprob>) -> Release<'_> {
        let start = self.released + self.held.len();
        self.held.push_str(text);
        if let Some(lp) = logprob {
            self.queued.push_back((start, start + text.len(), lp));
        }
        let found = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .chain(self.paragraph_end())
            .min();
        if let Some(cut) = found {
            let mut out = self.release(cut, Some(cut));
            out.stopped = true;
            return out;
        }
        let keep = self.longest_stop_prefix();
        self.release(self.held.len() - keep, None)
    }

    /// Also ends the text at its first finished paragraph (a RAG answer's natural end).
    pub fn ending_at_paragraph(mut self, on: bool) -> StopText<'a> {
        self.paragraph = on;
        self
    }

    /// Where in `held` the first finished paragraph ends: a blank line whose text before it
    /// ends a sentence or closes a code block, with every code block closed.
    fn paragraph_end(&self) -> Option<usize> {
        if !self.paragraph {
            return None;
        }
        let mut from = 0;
        while let Some(i) = self.held[from..].find("\n\n") {
            let at = from + i;
            let head = self.held[..at].trim_end();
            let text = if head.is_empty() {
                self.before.trim_end()
            } else {
                head
            };
            let fences =
                self.before.matches("```").count() + self.held[..at].matches("```").count();
            let finished = text.ends_with(['.', '!', '?']) || text.ends_with("```");
            if fences.is_multiple_of(2) && finished {
                return Some(at);
            }
            from = at + 1;
        }
        None
    }

    /// Everything still held, once no more tokens come.
    pub fn finish(&mut self) -> Release<'_> {
        self.release(self.held.len(), Some(usize::MAX))
    }

    /// The longest end of `held` that a stop string starts with (shorter than the whole stop
    /// string, else it would have been found).
    fn longest_stop_prefix(&self) -> usize {
        let held = self.held.as_bytes();
        self.stops
            .iter()
            .filter_map(|s| {
                (1..s.len().min(held.len() + 1))
                    .rev()
                    .find(|&k| held.ends_with(&s.as_bytes()[..k]))
            })
            .chain((self.paragraph && self.held.ends_with('\n')).then_some(1))
            .max()
            .unwrap_or(0)
    }

    /// Hands on the first `upto` bytes of `held`. At the end (`last` is the cut in `held`, or
    /// `usize::MAX` for none), so do the log-probabilities of every token whose text starts
    /// before the cut, and then nothing stays held; otherwise those whose text is complete in
    /// what is handed on (a token still inside an incomplete character waits for the piece
    /// that completes it).
    fn release(&mut self, upto: usize, last: Option<usize>) -> Release<'_> {
        let end = self.released + upto;
        let cut = last.map(|c| self.released.saturating_add(c));
        self.out_text.clear();
        self.out_text.push_str(&self.held[..upto]);
        if self.paragraph {
            self.before.push_str(&self.held[..upto]);
        }
        self.held.drain(..upto);
        self.released = end;
        self.out_logprobs.clear();
        while let Some((start, stop, _)) = self.queued.front() {
            let ready = match cut {
                Some(cut) => *start < cut,
                None => *stop < end || (*stop == end && start < stop),
            };
            if !ready {
                break;
            }
            let (_, _, lp) = self.queued.pop_front().expect("front exists");
            self.out_logprobs.push(lp);
        }
        if last.is_some() {
            self.held.clear();
            self.queued.clear();
        }
        Release {
            text: &self.out_text,
            logprobs: &self.out_logprobs,
            stopped: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(id: u32) -> Option<TokenLogprob> {
        Some(TokenLogprob {
            id,
            bytes: Vec::new(),
            logprob: -1.0,
            top: Vec::new(),
        })
    }

    /// Feeds `tokens` and returns the released pieces, their log-probability ids, and whether
    /// a stop string ended it.
    fn feed(stops: &[&str], tokens: &[&str]) -> (Vec<String>, Vec<Vec<u32>>, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut st = StopText::new(&stops);
        let (mut pieces, mut ids) = (Vec::new(), Vec::new());
        let mut take = |r: Release<'_>| {
            pieces.push(r.text.to_string());
            ids.push(r.logprobs.iter().map(|l| l.id).collect());
            r.stopped
        };
        for (i, t) in tokens.iter().enumerate() {
            if take(st.push(t, lp(i as u32))) {
                return (pieces, ids, true);
            }
        }
        take(st.finish());
        (pieces, ids, false)
    }

    #[test]
    fn a_stop_string_across_tokens_is_cut_with_what_follows() {
        let (pieces, ids, stopped) = feed(&["END"], &["a", "b E", "N", "Dx", "y"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "ab ");
        // "E" was held from the second token until "D" showed it was the stop string.
        assert_eq!(pieces, ["a", "b ", "", ""]);
        // Tokens whose text starts before the cut keep their log-probabilities.
        assert_eq!(ids.concat(), [0, 1]);
    }

    #[test]
    fn a_false_start_is_flushed_once_it_cannot_match() {
        let (pieces, ids, stopped) = feed(&["END", "\n\n"], &["xE", "N", "d", "\n", "z"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "xENd\nz");
        assert_eq!(pieces, ["x", "", "ENd", "", "\nz", ""]);
        // "xE" is complete only once "E" is released.
        assert_eq!(
            ids,
            [vec![], vec![], vec![0, 1, 2], vec![], vec![3, 4], vec![]]
        );
    }

    #[test]
    fn the_earliest_stop_string_wins_and_no_stops_pass_everything() {
        let (pieces, _, stopped) = feed(&["cd", "b"], &["abcd"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "a");
        let (pieces, _, stopped) = feed(&[], &["a", "b"]);
        assert!(!stopped);
        assert_eq!(pieces, ["a", "b", ""]);
        let (pieces, _, _) = feed(&[""], &["a"]);
        assert_eq!(pieces.concat(), "a");
    }

    /// [`feed`] with the paragraph rule on.
    fn feed_paragraphs(stops: &[&str], tokens: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut st = StopText::new(&stops).ending_at_paragraph(true);
        let mut text = String::new();
        for t in tokens {
            let r = st.push(t, None);
            text.push_str(r.text);
            if r.stopped {
                return (text, true);
            }
        }
        text.push_str(st.finish().text);
        (text, false)
    }

    #[test]
    fn the_first_finished_paragraph_ends_the_text() {
        // The blank line arrives one newline per token; the sentence before it is finished.
        let (text, stopped) = feed_paragraphs(&[], &["Use", " --depth", ".", "\n", "\n", "More"]);
        assert!(stopped);
        assert_eq!(text, "Use --depth.");
        // A blank line after an unfinished sentence ("…command:") does not end it, nor does
        // one inside a code block; the one after the block's closing fence does.
        let tokens = [
            "Run this:",
            "\n\n",
            "```\n",
            "a.\n\n",
            "b\n",
            "```",
            "\n\n",
            "x",
        ];
        let (text, stopped) = feed_paragraphs(&[], &tokens);
        assert!(stopped);
        assert_eq!(text, "Run this:\n\n```\na.\n\nb\n```");
        // A blank line before any text is not an end; a stop string earlier still wins.
        let (text, stopped) = feed_paragraphs(&[], &["\n\n", "Done!", "\n\n"]);
        assert!(stopped);
        assert_eq!(text, "\n\nDone!");
        let (text, stopped) = feed_paragraphs(&["Done"], &["Ok. Done.", "\n\n"]);
        assert!(stopped);
        assert_eq!(text, "Ok. ");
        // Off, a finished paragraph is only text; a lone newline is handed on at the end.
        let (pieces, _, stopped) = feed(&[], &["A.", "\n\n", "B.\n"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "A.\n\nB.\n");
        let (text, stopped) = feed_paragraphs(&[], &["A.", "\n"]);
        assert!(!stopped);
        assert_eq!(text, "A.\n");
    }

    #[test]
    fn a_token_inside_an_incomplete_character_waits_for_it() {
        // The first token holds half of a character: no text, its log-probability waits.
        let (pieces, ids, _) = feed(&["!"], &["", "é", "!"]);
        assert_eq!(pieces, ["", "é", ""]);
        assert_eq!(ids, [vec![], vec![0, 1], vec![]]);
    }
}
