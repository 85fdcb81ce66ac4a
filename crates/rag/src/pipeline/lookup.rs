//! Entry lookup: a question that names a manual entry (`What does git stash pop do?`,
//! `What does git log --follow do?`) is answered by that entry's definition, the way a
//! reader of the manual would look it up.
//!
//! The embedder cannot do this: "git stash pop" is as near to the EXAMPLES that run
//! `git stash pop` as to the entry `pop [--index] … Remove a single stashed state …`, and
//! the entry often starts in the middle of a chunk. Lookup is exact instead: a sentence
//! defines a named entry when its passage's page is the command the question names
//! (`git-stash(1)` for "git stash") and the sentence starts with the subcommand or option
//! the question says right after it. Retrieval adds the passages holding such a sentence that
//! the nearest vectors missed ([`fetch`]), the rerank stage puts them first ([`promote`]), and
//! the context stage makes that sentence the passage's best.
//!
//! A manual's EXAMPLES are entries too, titled by the task they show (git-reset's
//! `Undo add`, git-diff's `Comparing branches`). A question that says every word of such a
//! title ("How do I undo git add?") asks for that example, wherever its page is: the
//! question names no page, and dense vectors put git-rm's `SEE ALSO [git-add(1)]` nearer to
//! it. Titles are compared after the BM25 tokenizer (stopwords out, words stemmed), and the
//! passages are found by BM25 over the whole collection.

use std::collections::HashSet;

use super::context::passage::{entry_term, split_passage, SplitPassage};
use crate::retrieve::lexical;
use crate::retrieve::VectorStore;
use crate::retrieve::{Condition, Filter, FilterField, MatchValue, ScoredChunk, StoreError};
use telemetry::span::Stage;

/// Chunks searched within the pages a question may name, for entries retrieval missed.
const PAGE_TOP_K: usize = 64;

/// Chunks the question's words find by BM25 over the whole collection, searched for an
/// example it asks for.
const EXAMPLE_TOP_K: usize = 16;

/// Words an example's title has at least, after the BM25 tokenizer: one word ("Examples")
/// names no task.
const TITLE_TERMS_MIN: usize = 2;

/// Words an example's title has at most, as written: a longer run before a shell prompt is
/// prose.
const TITLE_WORDS_MAX: usize = 12;

/// Words that follow a command in a question without being its subcommand ("Which git
/// rev-parse option prints…").
const NOT_SUBCOMMANDS: &[&str] = &[
    "option",
    "options",
    "subcommand",
    "subcommands",
    "command",
    "commands",
    "flag",
    "flags",
    "mode",
    "setting",
    "variable",
];

/// Pages the question's words cannot name: question words, and the suite's own name.
const NOT_COMMANDS: &[&str] = &[
    "a", "an", "and", "are", "can", "do", "does", "for", "git", "how", "i", "in", "is", "it", "my",
    "of", "on", "or", "the", "to", "use", "what", "when", "which", "why", "with",
];

/// Pages searched for a question's entries at most: each of the first few command-like words,
/// alone and after the word before it.
const MAX_COMMANDS: usize = 4;

/// The question's words without surrounding punctuation (`do?` → `do`): words lower-cased,
/// options as written (`-d` is not `-D`) without their value (`--depth=1` → `--depth`), a
/// typographic dash that a client put for `--` made `--` again (`—follow`). Not the
/// tokenizers of `context::terms` or the fusion reranker, which drop stopwords and dashes.
fn words(question: &str) -> Vec<String> {
    question
        .split_whitespace()
        .filter_map(|w| {
            let w = match w.strip_prefix(['—', '–']) {
                Some(rest) => format!("--{rest}"),
                None => w.to_string(),
            };
            let w = w
                .trim_matches(|c: char| !(c.is_alphanumeric() || matches!(c, '-' | '_' | '.')))
                .trim_end_matches('.');
            if w.trim_start_matches('-').is_empty() {
                None
            } else if w.starts_with('-') {
                Some(w.split('=').next().unwrap_or(w).to_string())
            } else {
                Some(w.to_lowercase())
            }
        })
        .collect()
}

/// A command's or subcommand's name: lower-case ASCII letters, digits and inner dashes,
/// starting with a letter.
fn is_name(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_lowercase())
        && word
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// The word a question uses for the command of a passage whose header is a manual page's
/// (`name(N) › SECTION`): the page's name, or what follows its suite's prefix (`stash` for
/// `git-stash(1)`, as in "git stash"). Empty for other headers.
fn commands(header: &str) -> Vec<String> {
    let title = header.split(" › ").next().unwrap_or_default();
    let Some((page, rest)) = title.split_once('(') else {
        return Vec::new();
    };
    let page = page.to_lowercase();
    let manual_section = rest.strip_suffix(')').unwrap_or_default();
    let is_page = is_name(&page)
        && !manual_section.is_empty()
        && manual_section.chars().all(|c| c.is_ascii_digit());
    if !is_page {
        return Vec::new();
    }
    let sub = page.split_once('-').map(|(_, sub)| sub.to_string());
    std::iter::once(page).chain(sub).collect()
}

/// What an entry starting `sentence` is looked up by: each of its options as written, without
/// placeholders or a list comma (`-p`, `--patch` of `-p, --patch`; `--depth` of
/// `--depth <depth>`; both `--verify` and `--no-verify` of `--[no-]verify`), or its subcommand
/// (`pop` of `pop [--index] …`, `prune` of `prune Deletes stale references …`: a lower-case
/// word followed by an argument placeholder or a capitalised description).
fn heads(sentence: &str) -> Vec<String> {
    if let Some(term) = entry_term(sentence) {
        return term
            .split_whitespace()
            .filter(|w| w.starts_with('-'))
            .flat_map(|w| {
                let w = w.trim_end_matches(',');
                match w.strip_prefix("--[no-]") {
                    Some(rest) => vec![format!("--{rest}"), format!("--no-{rest}")],
                    None => vec![w.to_string()],
                }
            })
            .map(|w| w.split(['=', '[', '<']).next().unwrap_or(&w).to_string())
            .filter(|w| !w.trim_start_matches('-').is_empty())
            .collect();
    }
    let mut parts = sentence.split_whitespace();
    let (Some(first), Some(second)) = (parts.next(), parts.next()) else {
        return Vec::new();
    };
    let described = second.starts_with(['[', '<']) || second.starts_with(char::is_uppercase);
    if is_name(first) && described {
        vec![first.to_string()]
    } else {
        Vec::new()
    }
}

/// Whether a passage whose header is `header` is in a page's EXAMPLES section (`git-reset(1)
/// › EXAMPLES`), where [`example_title`] looks for titles.
fn in_examples(header: Option<&str>) -> bool {
    header
        .and_then(|h| h.split(" › ").nth(1))
        .is_some_and(|section| section.eq_ignore_ascii_case("examples"))
}

/// The task an example entry starting `sentence` is titled by: the words before its first
/// shell prompt (`Undo add` of `Undo add $ edit <1> $ git add frotz.c …`; `Clone from
/// upstream` of the list item `* Clone from upstream: $ git clone …`), capitalised and at most
/// [`TITLE_WORDS_MAX`] words.
fn example_title(sentence: &str) -> Option<&str> {
    let (before, _) = sentence.split_once(" $ ")?;
    let title = after_last_sentence(before).trim();
    let title = ["* ", "- "]
        .iter()
        .find_map(|item| title.strip_prefix(item))
        .unwrap_or(title)
        .trim_end_matches(':');
    let words = title.split_whitespace().count();
    (title.starts_with(char::is_uppercase) && words <= TITLE_WORDS_MAX).then_some(title)
}

/// What follows the last sentence end in `text`: a `.`, `!` or `?`, with any closing brackets
/// and quotes after it, then a space. The sentence splitter ends sentences only at a mark
/// followed by a space, so an example's title can follow a `…doing so.)` in one sentence.
fn after_last_sentence(text: &str) -> &str {
    let mut start = 0;
    let mut after_mark = false;
    for (i, c) in text.char_indices() {
        if after_mark && c.is_whitespace() {
            start = i;
        }
        after_mark = matches!(c, '.' | '!' | '?')
            || (after_mark && matches!(c, ')' | ']' | '"' | '\'' | '’' | '”'));
    }
    &text[start..]
}

/// What a question names: the command word's position and the words after it, and its BM25
/// terms for the examples it may ask for.
pub struct Question {
    words: Vec<String>,
    terms: lexical::Terms,
}

impl Question {
    pub fn new(question: &str) -> Question {
        Question {
            words: words(question),
            terms: lexical::query(question),
        }
    }

    /// Whether `sentence`, in an EXAMPLES passage ([`in_examples`]), starts an example the
    /// question asks for: the question says every word of its title (at least
    /// [`TITLE_TERMS_MIN`], after the BM25 tokenizer), and the title is at least half of what
    /// the question says, so a long question does not ask for every short title it happens
    /// to cover. "How do I undo git add?" asks for git-reset's `Undo add`.
    fn asks_for_example(&self, sentence: &str) -> bool {
        let Some(title) = example_title(sentence) else {
            return false;
        };
        let title = lexical::query(title).indices;
        title.len() >= TITLE_TERMS_MIN
            && 2 * title.len() >= self.terms.indices.len()
            && title.iter().all(|t| self.terms.indices.contains(t))
    }

    /// Whether `sentence`, in a passage whose header is `header`, starts an entry the question
    /// names: the question says the page's command, then (right after it) the entry's
    /// subcommand or (anywhere after it) one of its options. A question with two options or
    /// more after the command compares or excludes them ("without --soft or --hard") rather
    /// than asking what one is, so it looks up no option.
    pub fn names(&self, header: Option<&str>, sentence: &str) -> bool {
        let commands = header.map(commands).unwrap_or_default();
        let Some(at) = self.words.iter().position(|w| commands.contains(w)) else {
            return false;
        };
        let after = &self.words[at + 1..];
        let one_option = after.iter().filter(|w| w.starts_with('-')).count() == 1;
        heads(sentence).iter().any(|head| {
            if head.starts_with('-') {
                one_option && after.contains(head)
            } else {
                after.first() == Some(head) && !NOT_SUBCOMMANDS.contains(&head.as_str())
            }
        })
    }

    /// The titles of the manual pages the question may name by a command followed by a
    /// subcommand or an option: for each of the first [`MAX_COMMANDS`] such words (question
    /// words and the suite's name aside), `word(N)` and, with the word before it as the
    /// suite, `suite-word(N)` (`git-log(1)` for "git log --follow"), N from 1 to 8: at most 64
    /// titles. Empty when no word can be a command.
    pub fn pages(&self) -> Vec<String> {
        let command = |w: &str| is_name(w) && !NOT_COMMANDS.contains(&w);
        let mut pages: Vec<String> = Vec::new();
        let mut commands = 0;
        for (i, pair) in self.words.windows(2).enumerate() {
            let (word, next) = (&pair[0], &pair[1]);
            if commands == MAX_COMMANDS {
                break;
            }
            if !command(word) || !(command(next) || next.starts_with('-')) {
                continue;
            }
            commands += 1;
            pages.push(word.clone());
            if let Some(suite) = i.checked_sub(1).map(|j| &self.words[j]) {
                if is_name(suite) {
                    pages.push(format!("{suite}-{word}"));
                }
            }
        }
        pages.dedup();
        pages
            .iter()
            .flat_map(|p| (1..=8).map(move |n| format!("{p}({n})")))
            .collect()
    }

    /// For each sentence of `passage`, whether it starts an entry the question names, or
    /// belongs to an example it asks for: the titled sentence and the shell lines right after
    /// it, which the sentence splitter cut at a `...` argument (`Undo a commit and redo $ git
    /// commit ...` then `$ git reset --soft HEAD^ <1> …`).
    pub fn named_sentences(&self, passage: &SplitPassage) -> Vec<bool> {
        let header = passage.header.as_deref();
        let examples = in_examples(header);
        let mut in_example = false;
        passage
            .sentences
            .iter()
            .map(|s| {
                in_example =
                    examples && (self.asks_for_example(s) || (in_example && s.starts_with("$ ")));
                in_example || self.names(header, s)
            })
            .collect()
    }
}

/// Adds to `hits` the chunks that define the entry `question` names, or show the example it
/// asks for, and retrieval did not find: the `PAGE_TOP_K` nearest to `vector` within the pages
/// the question may name ([`Question::pages`]) and the `EXAMPLE_TOP_K` best BM25 matches of
/// its words, kept only if they hold the entry or example. Returns how many it added.
pub fn fetch(
    store: &dyn VectorStore,
    question: &str,
    vector: &[f32],
    hits: &mut Vec<ScoredChunk>,
    stage: &Stage,
) -> Result<usize, StoreError> {
    let question = Question::new(question);
    let pages = question.pages();
    let mut found = Vec::new();
    if !pages.is_empty() {
        let filter = Filter {
            conditions: vec![Condition {
                field: FilterField::Metadata("title".into()),
                matches: MatchValue::AnyKeyword(pages),
            }],
        };
        found = store.search(vector, PAGE_TOP_K, Some(&filter), stage)?;
    }
    if question.terms.indices.len() >= TITLE_TERMS_MIN {
        // The page search's finds survive a failed example search.
        match store.search_lexical(&question.terms, vector, EXAMPLE_TOP_K, None, stage) {
            Ok(examples) => found.extend(examples),
            Err(e) => tracing::warn!(error = %e, "example lookup's search failed"),
        }
    }
    let mut seen: HashSet<String> = hits.iter().map(|h| h.chunk.id.clone()).collect();
    let before = hits.len();
    for hit in found {
        if !seen.contains(&hit.chunk.id)
            && question
                .named_sentences(&split_passage(&hit.chunk.text))
                .contains(&true)
        {
            seen.insert(hit.chunk.id.clone());
            hits.push(hit);
        }
    }
    Ok(hits.len() - before)
}

/// Raises the scores of the passages (`texts`, scored by `scores`) that hold a sentence starting
/// the entry `question` names, or the example it asks for, above every other passage's, their order among themselves kept;
/// returns how many it raised. The rerank stage's step.
pub fn promote(question: &str, texts: &[&str], scores: &mut [f32]) -> usize {
    let question = Question::new(question);
    let named = texts
        .iter()
        .map(|t| question.named_sentences(&split_passage(t)).contains(&true));
    raise(scores, named)
}

/// Raises the scores of the sentences (of `split`, in its order, as `scores` is) that start
/// the entry `question` names, or belong to the example it asks for, above every other
/// sentence's, so one is kept first and its
/// passage counts as the best; returns how many it raised. The context stage's step.
pub fn promote_sentences(question: &str, split: &[SplitPassage], scores: &mut [f32]) -> usize {
    let question = Question::new(question);
    raise(
        scores,
        split.iter().flat_map(|p| question.named_sentences(p)),
    )
}

/// Adds the scores' range plus one to each score whose flag is set: all of them end above every
/// unflagged score, in the order they had. Returns how many it raised.
fn raise(scores: &mut [f32], flags: impl Iterator<Item = bool>) -> usize {
    let (low, high) = scores
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &s| {
            (lo.min(s), hi.max(s))
        });
    let lift = high - low + 1.0;
    let mut raised = 0;
    for (score, _) in scores.iter_mut().zip(flags).filter(|(_, flag)| *flag) {
        *score += lift;
        raised += 1;
    }
    raised
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::context::split_passage;

    #[test]
    fn a_subcommand_entry_is_named_by_command_then_subcommand() {
        let q = Question::new("What does git stash pop do?");
        let header = Some("git-stash(1) › COMMANDS");
        assert!(q.names(
            header,
            "pop [--index] [-q|--quiet] [<stash>] Remove a single stashed state from the stash list."
        ));
        // The same word elsewhere in a sentence, another subcommand, another page: no.
        assert!(!q.names(
            header,
            "$ git stash pop Interrupted workflow When you are …"
        ));
        assert!(!q.names(
            header,
            "apply [--index] [<stash>] Like pop, but do not remove it."
        ));
        assert!(!q.names(Some("git-remote(1) › COMMANDS"), "pop [<name>] Remove it."));
        // A subcommand without placeholders is found by its capitalised description.
        let prune = Question::new("What does git remote prune do?");
        assert!(prune.names(
            Some("git-remote(1) › COMMANDS"),
            "prune Deletes stale references associated with <name>."
        ));
        // "Which git stash subcommand…" asks for one; it does not name the entry `subcommand`.
        let which = Question::new("Which git rev-parse option prints the top level?");
        assert!(!which.names(
            Some("git-rev-parse(1) › Example"),
            "option C Set the colour."
        ));
        // Prose that starts with a lower-case word is not an entry.
        assert!(!prune.names(
            Some("git-remote(1) › COMMANDS"),
            "prune stale branches with care."
        ));
    }

    #[test]
    fn an_option_entry_is_named_by_any_of_its_options_after_the_command() {
        let q = Question::new("What does git log --follow do?");
        let header = Some("git-log(1) › OPTIONS");
        assert!(q.names(
            header,
            "--follow Continue listing the history of a file beyond renames."
        ));
        assert!(!q.names(header, "--no-follow Stop at renames."));
        assert!(!q.names(Some("git-diff(1) › OPTIONS"), "--follow Follow."));
        let patch = Question::new("what does `git add --patch` do");
        assert!(patch.names(
            Some("git-add(1) › OPTIONS"),
            "-p --patch Interactively choose hunks."
        ));
        let depth = Question::new("What does git clone --depth=1 do?");
        assert!(depth.names(
            Some("git-clone(1) › OPTIONS"),
            "--depth <depth> Create a shallow clone."
        ));
        // Two options are compared or excluded, not looked up.
        let modes =
            Question::new("If I run git reset without --soft or --hard, what mode is used?");
        assert!(!modes.names(
            Some("git-reset(1) › DESCRIPTION"),
            "--soft Does not touch the index file."
        ));
        // A question that does not say the command names nothing.
        let bare = Question::new("What does --follow do?");
        assert!(!bare.names(header, "--follow Continue listing."));
    }

    #[test]
    fn passages_defining_the_named_entry_are_raised_above_the_rest_in_their_order() {
        let texts = [
            "git-stash(1) › EXAMPLES\n$ git stash pop Interrupted workflow.",
            "git-stash(1) › COMMANDS\nMore. pop [--index] Remove a single stashed state.",
            "git-stash(1) › OPTIONS\n--index Only valid for pop and apply.",
            "git-stash(1) › COMMANDS\npop [--index] Remove it. apply Like pop.",
        ];
        let mut scores = [0.9, 0.2, 0.5, 0.1];
        assert_eq!(
            promote("What does git stash pop do?", &texts, &mut scores),
            2
        );
        assert_eq!(crate::rerank::ranking(&scores), [1, 3, 0, 2]);
        let mut unnamed = [0.9, 0.2, 0.5, 0.1];
        assert_eq!(promote("What is a stash?", &texts, &mut unnamed), 0);
        assert_eq!(unnamed, [0.9, 0.2, 0.5, 0.1]);
    }

    #[test]
    fn the_pages_a_question_may_name_are_its_commands_with_and_without_their_suite() {
        let pages = Question::new("What does git log --follow do?").pages();
        assert_eq!(pages.len(), 16, "{pages:?}");
        for page in ["git-log(1)", "log(8)"] {
            assert!(pages.iter().any(|p| p == page), "{page} in {pages:?}");
        }
        // Question words and the suite alone are no commands.
        for page in ["git(1)", "what(1)", "does-git(1)", "--follow(1)"] {
            assert!(!pages.iter().any(|p| p == page), "{page} in {pages:?}");
        }
        assert!(Question::new("Why?").pages().is_empty());
        // A long question searches at most a few commands' pages.
        let long = "frob zap ".repeat(40);
        assert!(Question::new(&long).pages().len() <= 8 * 2 * MAX_COMMANDS);
    }

    #[test]
    fn options_are_matched_as_written_and_in_every_spelling_of_the_entry() {
        let header = Some("git-branch(1) › OPTIONS");
        let big = Question::new("What does git branch -D do?");
        assert!(!big.names(header, "-d --delete Delete a branch."));
        assert!(big.names(header, "-D Shortcut for --delete --force."));
        let verify = Question::new("What does git commit --no-verify do?");
        let commit = Some("git-commit(1) › OPTIONS");
        assert!(verify.names(commit, "--[no-]verify Run or bypass the hooks."));
        let comma = Question::new("What does git add -p do?");
        assert!(comma.names(Some("git-add(1) › OPTIONS"), "-p, --patch Choose hunks."));
        // A dash a chat client typeset for `--` is read as `--`; a bare `--` is no option.
        let typeset = Question::new("What does git log —follow do?");
        let log = Some("git-log(1) › OPTIONS");
        assert!(typeset.names(log, "--follow Continue listing."));
        let bare = Question::new("What does git log -- --follow do?");
        assert!(bare.names(log, "--follow Continue listing."));
    }

    #[test]
    fn a_sentence_starting_the_named_entry_becomes_the_best() {
        let split = [
            split_passage("git-stash(1) › EXAMPLES\n$ git stash pop Interrupted workflow."),
            split_passage(
                "git-stash(1) › COMMANDS\nUse it. pop [--index] Remove a single stashed state.",
            ),
        ];
        let mut scores = [0.9, 0.4, 0.3];
        assert_eq!(
            promote_sentences("What does git stash pop do?", &split, &mut scores),
            1
        );
        // Raised above the best, the others untouched.
        assert_eq!(crate::rerank::ranking(&scores), [2, 0, 1]);
        assert_eq!(scores[..2], [0.9, 0.4]);
        let mut untouched = [0.9, 0.4, 0.3];
        assert_eq!(
            promote_sentences("How do I stash?", &split, &mut untouched),
            0
        );
        assert_eq!(untouched, [0.9, 0.4, 0.3]);
    }

    #[test]
    fn a_question_saying_every_word_of_an_example_title_asks_for_it() {
        let q = Question::new("How do I undo git add?");
        assert!(q.asks_for_example("Undo add $ edit <1> $ git add frotz.c <2>"));
        // A title the splitter left behind the previous sentence's `.)` or a closing quote.
        let merge = Question::new("How do I undo a merge or pull?");
        assert!(
            merge.asks_for_example("(See git-rebase(1) for why.) Undo a merge or pull $ git pull")
        );
        assert!(merge.asks_for_example("It’s “done.” Undo a merge or pull $ git pull"));
        // A list item's marker and colon are not the title.
        let upstream = Question::new("How do I clone from upstream?");
        assert!(upstream.asks_for_example("* Clone from upstream: $ git clone git://a.example/l"));
        assert!(upstream.asks_for_example("- Clone from upstream: $ git clone git://a.example/l"));
        // Inflections meet after the tokenizer.
        let compare = Question::new("How can I compare two branches?");
        assert!(compare.asks_for_example("Comparing branches $ git diff topic master <1>"));
        // A title word the question does not say, a one-word title: no.
        assert!(!q.asks_for_example("Undo a commit and redo $ git commit …"));
        assert!(!Question::new("How do I undo it?").asks_for_example("Undo $ git reset"));
        // A long question does not ask for every short title it covers.
        let long = Question::new(
            "Which option makes git log list the commits that touched a file and show branches?",
        );
        assert!(!long.asks_for_example("Show branches $ git show-branch"));
        // No prompt, lower case, or prose longer than a title before the prompt: no title.
        assert_eq!(example_title("Undo add the changes."), None);
        assert_eq!(example_title("undo add $ edit"), None);
        let prose = "Undo add and then undo add again and again and again and again $ git reset";
        assert_eq!(example_title(prose), None);
    }

    #[test]
    fn an_example_is_its_titled_sentence_and_the_shell_lines_after_it_in_examples_only() {
        let q = Question::new("How do I undo git add?");
        let split = split_passage(
            "git-reset(1) › EXAMPLES\nSee the index. Undo add $ git commit ... $ git reset <1> 1. \
             Prose after it. $ git log ...",
        );
        assert_eq!(q.named_sentences(&split), [false, true, true, false, false]);
        // The same sentences outside EXAMPLES, or without a header, are no example.
        for header in ["git-reset(1) › DESCRIPTION\n", ""] {
            let other = split_passage(&format!("{header}Undo add $ edit <1> $ git reset <2>"));
            assert_eq!(q.named_sentences(&other), [false], "{header}");
        }
    }

    #[test]
    fn pages_without_a_command_name_nothing() {
        let q = Question::new("What does git stash pop do?");
        assert!(!q.names(Some("Git User Manual › Stashing"), "pop Remove it."));
        assert!(!q.names(Some("git-stash › COMMANDS"), "pop Remove it."));
        // Any manual page's name is its command; a suite's page also answers to its tail.
        let frob = Question::new("What does frob zap do?");
        assert!(frob.names(Some("frob(1) › COMMANDS"), "zap [<n>] Cools it."));
        let dashed = Question::new("What does git-stash pop do?");
        assert!(dashed.names(Some("git-stash(1) › COMMANDS"), "pop [<stash>] Remove it."));
        assert!(!q.names(None, "pop [<stash>] Remove it."));
        let split = split_passage(
            "git-stash(1) › COMMANDS\nYou can also use it. pop [--index] [<stash>] Remove a \
             single stashed state. apply [--index] Like pop.",
        );
        assert_eq!(q.named_sentences(&split), [false, true, false]);
    }
}
