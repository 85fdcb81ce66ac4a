//! The context stage's selection and scoring, on hand-made passages and the real models.
use super::*;

#[test]
fn a_chunk_splits_into_its_header_and_sentences() {
    let s = split_passage(
        "git-clone(1) › OPTIONS\n--depth <depth> Create a shallow clone. It is truncated to \
         the given number of commits. --bare Make a bare repository.",
    );
    assert_eq!(s.header.as_deref(), Some("git-clone(1) › OPTIONS"));
    assert_eq!(
        s.sentences,
        [
            "--depth <depth> Create a shallow clone.",
            "It is truncated to the given number of commits.",
            "--bare Make a bare repository."
        ]
    );
    // A first line that is a sentence of its own is not a header.
    let plain = split_passage("Zorbia is a country.\nIts capital is Quenta.");
    assert_eq!(plain.header, None);
    assert_eq!(
        plain.sentences,
        ["Zorbia is a country.", "Its capital is Quenta."]
    );
}

#[test]
fn terms_keep_options_whole_and_drop_common_words() {
    assert_eq!(
        terms("How do I use --depth with git-clone's shallow clones?"),
        ["use", "depth", "git-clone", "shallow", "clones"]
    );
}

#[test]
fn lexical_scores_favour_rare_question_words() {
    let sentences = [
        "The repository is cloned.",
        "A shallow clone has a truncated history.",
        "The repository has a history.",
    ];
    let s = lexical_scores("shallow clone of a repository", &sentences);
    assert!(s[1] > s[0] && s[1] > s[2], "{s:?}");
    assert_eq!(lexical_scores("unrelated words", &sentences), [0.0; 3]);
}

#[test]
fn hybrid_scores_add_scaled_parts() {
    let dense = [0.2, 0.4, 0.3];
    let lexical = [0.0, 0.0, 2.0];
    let h = combine(ContextMethod::Hybrid, Some(&dense), &lexical);
    for (got, want) in h.iter().zip([0.0, 1.0, 1.5]) {
        assert!((got - want).abs() < 1e-6, "{h:?}");
    }
    assert_eq!(combine(ContextMethod::Dense, Some(&dense), &lexical), dense);
    assert_eq!(
        combine(ContextMethod::Lexical, Some(&dense), &lexical),
        lexical
    );
}

fn unit(passage: usize, index: usize, tokens: usize, score: f32) -> Unit {
    Unit {
        passage,
        index,
        tokens,
        score,
        term_tokens: 0,
    }
}

#[test]
fn an_entry_term_is_the_leading_option_run_or_variable() {
    let cases = [
        (
            "--depth <depth> Create a shallow clone.",
            Some("--depth <depth>"),
        ),
        ("-p --patch Interactively choose hunks.", Some("-p --patch")),
        ("--[no-]verify Bypass the hooks.", Some("--[no-]verify")),
        (
            "--ignore-revs-file <file> Ignore revisions.",
            Some("--ignore-revs-file <file>"),
        ),
        (
            "core.hooksPath By default Git looks in hooks.",
            Some("core.hooksPath"),
        ),
        (
            "mergetool.<tool>.path: Override the path.",
            Some("mergetool.<tool>.path"),
        ),
        // Prose, a sentence that mentions an option later, a dash and a number.
        ("With --no-ff, create a merge commit.", None),
        ("The default is 2.weeks.ago.", None),
        ("- a list item.", None),
        ("-1 Show one commit.", Some("-1")),
        ("e.g. this is prose.", None),
        ("", None),
    ];
    for (sentence, want) in cases {
        assert_eq!(entry_term(sentence), want, "{sentence:?}");
    }
}

#[test]
fn a_sentence_belongs_to_the_entry_above_it() {
    let p = split_passage(
        "git-commit(1) › OPTIONS\nThe first line is prose. --amend Replace the tip of the \
         current branch. The recorded tree is prepared as usual. --no-edit Keep the message.",
    );
    assert_eq!(
        p.entry_terms(),
        [None, Some("--amend"), Some("--amend"), Some("--no-edit")]
    );
}

#[test]
fn a_header_names_the_entry_term_of_its_best_sentence_on_top_of_the_budget() {
    let split = vec![split_passage(
        "git-commit(1) › OPTIONS\n--amend Replace the tip. The tree is prepared as usual. \
         --no-edit Keep the message.",
    )];
    let units = [
        Unit {
            term_tokens: 3,
            ..unit(0, 0, 10, 0.2)
        },
        // The best sentence says no option itself; its entry's term is --amend.
        Unit {
            term_tokens: 3,
            ..unit(0, 1, 10, 0.9)
        },
        Unit {
            term_tokens: 4,
            ..unit(0, 2, 10, 0.5)
        },
    ];
    // Header 5 + marker 4 + 10 = 19, then 10 more is 29: the term is not charged.
    let s = select_sentences(&split, &[5], &units, 29);
    assert_eq!(
        s.passages[0].text,
        "git-commit(1) › OPTIONS › --amend\n\
         The tree is prepared as usual. --no-edit Keep the message."
    );
    assert_eq!((s.sentences_out, s.tokens_out), (2, 25));
    assert_eq!((s.terms_named, s.term_tokens), (1, 3));
    // Without a term cost (terms off), the header is the chunk's own.
    let off: Vec<Unit> = units
        .iter()
        .map(|u| Unit {
            term_tokens: 0,
            ..*u
        })
        .collect();
    let s = select_sentences(&split, &[5], &off, 29);
    assert_eq!(
        s.passages[0].text,
        "git-commit(1) › OPTIONS\nThe tree is prepared as usual. --no-edit Keep the message."
    );
    assert_eq!((s.sentences_out, s.tokens_out), (2, 25));
    assert_eq!((s.terms_named, s.term_tokens), (0, 0));
}

#[test]
fn sentences_are_chosen_by_score_within_the_budget_and_grouped_by_passage() {
    let split = vec![
        SplitPassage {
            header: Some("a(1) › X".into()),
            sentences: vec!["A0.".into(), "A1.".into(), "A2.".into()],
        },
        SplitPassage {
            header: None,
            sentences: vec!["B0.".into(), "B1.".into()],
        },
    ];
    let headers = [3, 0];
    let units = [
        unit(0, 0, 10, 0.1),
        unit(0, 1, 10, 0.5),
        unit(0, 2, 10, 0.9),
        unit(1, 0, 10, 0.8),
        unit(1, 1, 50, 0.7),
    ];
    // 0.9 (10 + header 3 + marker 4), 0.8 (10 + 4), 0.7 does not fit, 0.5 (10): 41.
    let s = select_sentences(&split, &headers, &units, 45);
    assert_eq!(
        s.passages,
        [
            ContextPassage {
                source: 0,
                text: "a(1) › X\nA1. A2.".into(),
                best: 0.9,
            },
            ContextPassage {
                source: 1,
                text: "B0.".into(),
                best: 0.8,
            },
        ]
    );
    assert_eq!((s.sentences_in, s.sentences_out), (5, 3));
    assert_eq!((s.tokens_in, s.tokens_out), (93, 33));
    // The best sentence is kept even when alone it is over the budget.
    let tiny = select_sentences(&split, &headers, &units, 1);
    assert_eq!(tiny.sentences_out, 1);
    assert_eq!(tiny.passages[0].text, "a(1) › X\nA2.");
}

#[test]
fn whole_passages_fill_the_budget_best_first() {
    let texts = ["first", "second", "third"];
    let s = select_passages(&texts, &[50, 100, 30], 90);
    let kept: Vec<usize> = s.passages.iter().map(|p| p.source).collect();
    assert_eq!(kept, [0, 2]);
    assert_eq!((s.tokens_in, s.tokens_out), (180, 80));
    // The first passage is kept whatever the budget.
    assert_eq!(select_passages(&texts, &[50, 100, 30], 1).passages.len(), 1);
}

#[test]
fn best_last_lists_the_passage_with_the_best_sentence_nearest_the_question() {
    let passage = |source, best| ContextPassage {
        source,
        text: String::new(),
        best,
    };
    let passages = [passage(0, 0.6), passage(1, 0.9), passage(2, 0.4)];
    assert_eq!(ContextOrder::Rank.listing(&passages), [0, 1, 2]);
    assert_eq!(ContextOrder::BestLast.listing(&passages), [2, 0, 1]);
    // A tie keeps the better-ranked passage nearer the question.
    let tied = [passage(0, 0.5), passage(1, 0.5)];
    assert_eq!(ContextOrder::BestLast.listing(&tied), [1, 0]);
    // Whole passages: the best-ranked last.
    let whole = select_passages(&["a", "b", "c"], &[1, 1, 1], 100);
    assert_eq!(ContextOrder::BestLast.listing(&whole.passages), [2, 1, 0]);
}

#[test]
fn modes_parse_from_their_names() {
    for m in [
        ContextMode::Off,
        ContextMode::Sentences,
        ContextMode::Passages,
    ] {
        assert_eq!(ContextMode::parse(m.as_str()), Some(m));
    }
    assert_eq!(ContextMode::parse("all"), None);
    for o in [ContextOrder::Rank, ContextOrder::BestLast] {
        assert_eq!(ContextOrder::parse(o.as_str()), Some(o));
    }
    assert_eq!(ContextOrder::parse("best_last"), None);
}
