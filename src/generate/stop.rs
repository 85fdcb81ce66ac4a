//! Stop strings over a stream of generated text. A stop string can span tokens, so the text
//! that could still be the start of one is held back until the next token shows whether it is;
//! a stop string and everything after it never reach the consumer. Each token's log-probability
//! travels with the piece of text that completes it.

use std::collections::VecDeque;

use super::TokenLogprob;

/// The text of one generation between the tokens and the consumer.
pub(super) struct StopText<'a> {
    stops: &'a [String],
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
            .min();
        if let Some(cut) = found {
            let mut out = self.release(cut, Some(cut));
            out.stopped = true;
            return out;
        }
        let keep = self.longest_stop_prefix();
        self.release(self.held.len() - keep, None)
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
        assert_eq!(ids, [vec![], vec![], vec![0, 1, 2], vec![], vec![3, 4], vec![]]);
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

    #[test]
    fn a_token_inside_an_incomplete_character_waits_for_it() {
        // The first token holds half of a character: no text, its log-probability waits.
        let (pieces, ids, _) = feed(&["!"], &["", "é", "!"]);
        assert_eq!(pieces, ["", "é", ""]);
        assert_eq!(ids, [vec![], vec![0, 1], vec![]]);
    }
}
