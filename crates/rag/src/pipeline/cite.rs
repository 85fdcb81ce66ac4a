//! Answers that read as answers. A small model often begins a RAG answer by pasting the header
//! of the passage it copies, as the prompt showed it: `[3] git-show(1) › PRETTY FORMATS`, then
//! the passage's text. [`Citer`] turns that header into a citation: the header line is dropped
//! and `[3]` goes at the end of the first sentence after it, so the answer shows as a sentence
//! with its source (the answer's `sources` are numbered the same way).
//!
//! It works on the streamed pieces as they come: text that could still be the start of a
//! header is held back until its line ends (or it cannot be one), and a sentence's last
//! character until the next one says whether the sentence ended there. The pieces it lets out,
//! joined, are the answer's text. An answer that does not start with a header of one of its
//! passages passes through unchanged.

/// One passage as the prompt numbered it: its number (from 1) and its first line.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub number: usize,
    pub title: String,
}

impl Header {
    /// The passages' headers from their text as the prompt holds it and their places in the
    /// input (the prompt numbers passage `i` as `[i + 1]`). A passage has one when its first
    /// line is a title over more text: short, not a sentence (a document without headings
    /// starts with its text, which an answer may well begin with).
    pub fn of(kept: &[usize], texts: &[String]) -> Vec<Header> {
        kept.iter()
            .zip(texts)
            .filter_map(|(&i, text)| {
                let mut lines = text.trim().lines();
                let title = lines.next()?.trim();
                let more = lines.any(|l| !l.trim().is_empty());
                let sentence = title.ends_with(['.', '!', '?', ':']);
                (more && !sentence && !title.is_empty() && title.len() <= MAX_HEADER).then(|| {
                    Header {
                        number: i + 1,
                        title: title.to_string(),
                    }
                })
            })
            .collect()
    }
}

enum State {
    /// At the start: is the first line a header?
    Head,
    /// After a dropped header: the first sentence, then the citation.
    Body { cite: usize },
    /// Passing text through.
    Through,
}

/// Turns a leading passage header into a citation, piece by piece.
pub struct Citer<'a> {
    headers: &'a [Header],
    state: State,
    /// Text received and not yet let out.
    held: String,
    /// The last characters let out in the first sentence (to tell "e.g." from a sentence end).
    recent: String,
    /// What was received when the header was dropped, shown after all if nothing follows.
    dropped: String,
}

impl<'a> Citer<'a> {
    pub fn new(headers: &'a [Header]) -> Citer<'a> {
        let state = if headers.is_empty() {
            State::Through
        } else {
            State::Head
        };
        Citer {
            headers,
            state,
            held: String::new(),
            recent: String::new(),
            dropped: String::new(),
        }
    }

    /// The text to let out now for `text`, the next piece of the answer.
    pub fn push(&mut self, text: &str) -> String {
        if let State::Through = self.state {
            return text.to_string();
        }
        self.held.push_str(text);
        self.settle(false)
    }

    /// What is still held, at the end of the answer.
    pub fn finish(&mut self) -> String {
        self.settle(true)
    }

    fn settle(&mut self, end: bool) -> String {
        match self.state {
            State::Through => std::mem::take(&mut self.held),
            State::Head => self.head(end),
            State::Body { cite } => self.body(cite, end),
        }
    }

    fn head(&mut self, end: bool) -> String {
        match self.held.find('\n') {
            Some(nl) => match self.header(&self.held[..nl]) {
                Some(cite) => {
                    let rest = self.held[nl + 1..].trim_start().to_string();
                    self.dropped = std::mem::replace(&mut self.held, rest);
                    self.state = State::Body { cite };
                    self.body(cite, end)
                }
                None => self.through(),
            },
            // An answer that is a header alone stays as it is.
            None if end => self.through(),
            None if self.could_be_header(&self.held) => String::new(),
            None => self.through(),
        }
    }

    fn through(&mut self) -> String {
        self.state = State::Through;
        std::mem::take(&mut self.held)
    }

    /// The first sentence of the copied text, with the citation at its end: before the first
    /// newline, or after a `.`, `!` or `?` followed by white space (not the dot of "e.g.").
    fn body(&mut self, cite: usize, end: bool) -> String {
        let citation = format!(" [{cite}]");
        let mut chars = self.held.char_indices().peekable();
        let mut cut = None;
        while let Some((i, c)) = chars.next() {
            if c == '\n' {
                cut = Some(i);
                break;
            }
            if matches!(c, '.' | '!' | '?') {
                match chars.peek() {
                    Some(&(_, next)) if next.is_whitespace() => {
                        let before = format!("{}{}", self.recent, &self.held[..i]);
                        if c != '.' || !abbreviation(&before) {
                            cut = Some(i + 1);
                            break;
                        }
                    }
                    Some(_) => {}
                    // The next piece says whether the sentence ends here.
                    None if !end => {
                        let out = self.held[..i].to_string();
                        self.remember(&out);
                        self.held.drain(..i);
                        return out;
                    }
                    None => {}
                }
            }
        }
        match cut {
            Some(at) => {
                let mut out = self.held[..at].trim_end().to_string();
                out.push_str(&citation);
                out.push_str(&self.held[at..]);
                self.state = State::Through;
                self.held.clear();
                out
            }
            None if end => {
                let held = std::mem::take(&mut self.held);
                self.state = State::Through;
                let mut out = held.trim_end().to_string();
                if out.is_empty() && self.recent.is_empty() {
                    // Nothing came after the header: the answer is the header after all (what
                    // was received up to the header's end, and the white space since).
                    return std::mem::take(&mut self.dropped) + &held;
                }
                out.push_str(&citation);
                out
            }
            None => {
                let out = std::mem::take(&mut self.held);
                self.remember(&out);
                out
            }
        }
    }

    fn remember(&mut self, out: &str) {
        self.recent.push_str(out);
        let keep = self.recent.len().saturating_sub(8);
        let start = (keep..=self.recent.len())
            .find(|&i| self.recent.is_char_boundary(i))
            .unwrap_or(self.recent.len());
        self.recent.drain(..start);
    }

    /// The number to cite when `line` is a passage header: `[N] title` for one of the
    /// passages' titles (cited by the number the prompt gave that title: the generator mixes
    /// up numbers), `[N] a › b` for a passage number `N` (titles pieced together from two
    /// headers), or a title behind a bracket (`[title` or `[title]`).
    fn header(&self, line: &str) -> Option<usize> {
        let line = line.trim();
        let rest = line.strip_prefix('[')?;
        let by_title = |title: &str| {
            self.headers
                .iter()
                .find(|h| h.title == title)
                .map(|h| h.number)
        };
        if let Some((n, title)) = rest.split_once("] ") {
            if let Ok(n) = n.parse::<usize>() {
                let title = title.trim();
                let numbered = self.headers.iter().any(|h| h.number == n);
                let shaped = title.contains(" › ") && !title.starts_with('[');
                return by_title(title).or_else(|| (numbered && shaped).then_some(n));
            }
        }
        by_title(rest.strip_suffix(']').unwrap_or(rest).trim())
    }

    /// Whether `held`, with no line end yet, can still grow into a header: `[N] ` (any
    /// number: the generator mixes them up) and then anything but a bracket, or a bracket and
    /// the start of a title, within a header's length.
    fn could_be_header(&self, held: &str) -> bool {
        let held = held.trim_start();
        if held.len() > MAX_HEADER {
            return false;
        }
        let Some(rest) = held.strip_prefix('[') else {
            return held.is_empty();
        };
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let numbered = match &rest[digits..] {
            _ if digits == 0 || digits > 3 => false,
            "" | "]" => true,
            after => after
                .strip_prefix("] ")
                .is_some_and(|title| !title.starts_with('[')),
        };
        numbered
            || self
                .headers
                .iter()
                .any(|h| h.title.starts_with(rest) || rest.starts_with(h.title.as_str()))
    }
}

/// The longest line held back as a possible header (bytes).
const MAX_HEADER: usize = 240;

/// Whether the text before a dot ends in an abbreviation such as "e.g" or "i.e".
fn abbreviation(before: &str) -> bool {
    let word = before
        .rsplit(|c: char| c.is_whitespace() || c == '(')
        .next()
        .unwrap_or("");
    word.contains('.') && word.len() <= 4
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> Vec<Header> {
        Header::of(
            &[0, 2],
            &[
                "git-reset(1) › DESCRIPTION\nIf <mode> is omitted, defaults to --mixed.".into(),
                "git-stash(1) › COMMANDS\npop: Remove a single stashed state.".into(),
            ],
        )
    }

    /// Feeds `pieces` one by one; the pieces let out, joined.
    fn cite(pieces: &[&str]) -> String {
        let headers = headers();
        let mut citer = Citer::new(&headers);
        let mut out: String = pieces.iter().map(|p| citer.push(p)).collect();
        out.push_str(&citer.finish());
        out
    }

    #[test]
    fn a_pasted_header_becomes_a_citation_after_the_first_sentence() {
        let answer = "[1] git-reset(1) › DESCRIPTION\nIf <mode> is omitted, defaults to --mixed. \
                      The <mode> must be one of the following.";
        let want = "If <mode> is omitted, defaults to --mixed. [1] The <mode> must be one of the \
                    following.";
        assert_eq!(cite(&[answer]), want);
        // The same, a few characters at a time, split anywhere.
        let chars: Vec<String> = answer.chars().map(String::from).collect();
        for size in [1, 2, 3, 5, 7, 11] {
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.concat()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(cite(&refs), want, "pieces of {size}");
        }
    }

    #[test]
    fn the_title_behind_a_bracket_cites_its_passage_and_a_line_end_closes_the_sentence() {
        assert_eq!(
            cite(&[
                "[git-stash(1) › COMMANDS\n",
                "pop: Remove a single stashed state\n",
                "ok"
            ]),
            "pop: Remove a single stashed state [3]\nok"
        );
        // e.g. is no sentence end; the end of the answer is.
        assert_eq!(
            cite(&[
                "[3] git-stash(1) › COMMANDS\n\nUse it, e.g. ",
                "git stash pop"
            ]),
            "Use it, e.g. git stash pop [3]"
        );
    }

    #[test]
    fn a_header_under_the_wrong_number_or_pieced_together_still_cites() {
        // The title is passage 3's: cited as 3, whatever number the answer gave it.
        assert_eq!(
            cite(&["[1] git-stash(1) › COMMANDS\npop: Remove it. Then more."]),
            "pop: Remove it. [3] Then more."
        );
        // A number no passage has, streamed a character at a time, before a known title.
        let answer = "[7] git-reset(1) › DESCRIPTION\nIf unset. More.";
        let pieces: Vec<String> = answer.chars().map(String::from).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(cite(&refs), "If unset. [1] More.");
        // A header-shaped line under a passage's number.
        assert_eq!(
            cite(&["[1] git-stash(1) › ", "DESCRIPTION\nSome text"]),
            "Some text [1]"
        );
    }

    #[test]
    fn other_answers_pass_through_unchanged() {
        for answer in [
            "To undo git add, run git reset.",
            "[1] [--filter <spec>] [--depth <depth>]\nmore",
            "[2] git-reset(1) is not a header\nmore",
            "[1] git-reset(1) › DESCRIPTION",
            "[1] git-reset(1) › DESCRIPTION\n",
            "",
        ] {
            assert_eq!(cite(&[answer]), answer);
        }
        // A document without headings starts with its text: no header to take for one.
        let plain = Header::of(
            &[0, 1],
            &[
                "The flumox is a garden tool.\nIt has three tines.".into(),
                "A single line".into(),
            ],
        );
        assert!(plain.is_empty(), "{plain:?}");
        let none: Vec<Header> = Vec::new();
        assert_eq!(Citer::new(&none).push("[1] x\ny"), "[1] x\ny");
    }
}
