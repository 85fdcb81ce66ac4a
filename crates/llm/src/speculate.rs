//! Speculative decoding from the prompt ("prompt lookup": vLLM's `ngram` method, llama.cpp's
//! `lookup`). A RAG answer copies long runs of its passages, so the next tokens are often
//! already in the prompt: find the answer's last n tokens earlier in the prompt (or the answer
//! so far) and propose the tokens that followed them there as a draft.
//!
//! The request then runs its last pick and the draft through the model in one batched decode
//! step ([`super::schedule`]), which reads every weight once for all of those positions, and
//! gets back one row of logits per position. It picks from the rows in order, exactly as it
//! would have picked one step at a time, and keeps going while each pick equals the draft token
//! the next row was computed from; at the first pick that differs, the rows after it are thrown
//! away. The cache's length counts a draft token's position only when the request picks from
//! the row that ran on it, so what rejected rows wrote past it is overwritten by the next step.
//!
//! A row's logits are the same bits whether it runs alone or beside a draft (the CPU decoder
//! treats every row alone, [`super::cpu_decode`]), and the sampler sees the same logits in the
//! same order, so the output is token for token the one without speculation, for greedy and
//! seeded sampling alike. With sampling that is a stricter acceptance than the rejection rule
//! of speculative sampling (a draft token is kept only when the sampler picks it), which keeps
//! the distribution exactly and accepts fewer tokens.
//!
//! Only the batched CPU decoder verifies drafts; on candle's ops (a GPU) decoding runs without.

use std::fmt;
use std::str::FromStr;

/// The shortest n-gram a draft may be found from: a single token recurs too often to say
/// what follows it.
pub const MIN_NGRAM: usize = 2;

/// How requests draft (`--speculation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    /// Most draft tokens verified per step; 0: off.
    pub max_draft: usize,
    /// The longest n-gram matched; shorter ones down to [`MIN_NGRAM`] are tried when it
    /// finds nothing.
    pub ngram: usize,
}

impl Speculation {
    pub const OFF: Speculation = Speculation {
        max_draft: 0,
        ngram: 3,
    };

    /// What the server runs unless told otherwise. On the AVX2 EPYC (family 25), answering
    /// the evaluation questions one at a time, drafts of 2 and 3 gave 1.17× and 1.15× (the
    /// same within their intervals), 4 and 6 only 1.11× (each row of a step costs compute the
    /// AVX2 kernels have little of to spare); two at a time, 3 gave 1.46×. 3 takes more tokens
    /// a step where rows are cheaper. `ragscope-lab speculation` measures it.
    pub const DEFAULT: Speculation = Speculation {
        max_draft: 3,
        ngram: 3,
    };

    pub fn is_on(&self) -> bool {
        self.max_draft > 0 && self.ngram >= 1
    }

    /// The method's name on the `decode` span.
    pub fn method(&self) -> &'static str {
        if self.is_on() {
            "prompt_lookup"
        } else {
            "off"
        }
    }
}

impl FromStr for Speculation {
    type Err = String;

    /// `off`, or `prompt-lookup[:K[:N]]` (at most K draft tokens, n-grams of at most N).
    fn from_str(s: &str) -> Result<Speculation, String> {
        let s = s.trim();
        if s == "off" {
            return Ok(Speculation::OFF);
        }
        let bad = || format!("{s:?}: expected off or prompt-lookup[:DRAFT[:NGRAM]]");
        let mut parts = s.split(':');
        if parts.next() != Some("prompt-lookup") {
            return Err(bad());
        }
        let mut out = Speculation::DEFAULT;
        if let Some(k) = parts.next() {
            out.max_draft = k.parse().map_err(|_| bad())?;
        }
        if let Some(n) = parts.next() {
            out.ngram = n.parse().map_err(|_| bad())?;
        }
        if parts.next().is_some() || out.ngram < MIN_NGRAM || out.max_draft > MAX_DRAFT {
            return Err(bad());
        }
        Ok(out)
    }
}

impl fmt::Display for Speculation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_on() {
            write!(f, "prompt-lookup:{}:{}", self.max_draft, self.ngram)
        } else {
            f.write_str("off")
        }
    }
}

/// The most draft tokens one step verifies.
pub const MAX_DRAFT: usize = 16;

/// Appends to `draft` up to `max` tokens that followed the latest earlier occurrence of the
/// last n tokens of `history` (the prompt, then the answer so far), for the longest n from
/// `ngram` down to [`MIN_NGRAM`] that occurs; nothing when none does.
pub fn draft(history: &[u32], ngram: usize, max: usize, draft: &mut Vec<u32>) {
    let len = history.len();
    if max == 0 {
        return;
    }
    for n in (MIN_NGRAM..=ngram).rev() {
        if len <= n {
            continue;
        }
        let tail = &history[len - n..];
        // The latest occurrence that ends before the tail does, so it has a token after it.
        let found = (0..len - n).rev().find(|&i| &history[i..i + n] == tail);
        if let Some(i) = found {
            let from = i + n;
            draft.extend_from_slice(&history[from..len.min(from + max)]);
            return;
        }
    }
}

/// One request's drafts and what became of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Steps that verified a draft.
    pub steps: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl std::ops::Add for Tally {
    type Output = Tally;

    fn add(self, other: Tally) -> Tally {
        Tally {
            steps: self.steps + other.steps,
            drafted: self.drafted + other.drafted,
            accepted: self.accepted + other.accepted,
        }
    }
}

impl Tally {
    pub fn rate(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafted(history: &[u32], ngram: usize, max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        draft(history, ngram, max, &mut out);
        out
    }

    #[test]
    fn a_draft_continues_the_latest_earlier_match_of_the_longest_ngram() {
        // "1 2 3" appears twice before the tail: the later one (followed by 7 8) wins.
        let h = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(drafted(&h, 3, 4), vec![7, 8, 6, 1]);
        assert_eq!(drafted(&h, 3, 2), vec![7, 8]);
        // Only "2 3" of the trigram "0 2 3" occurs earlier: the bigram's continuation.
        let h = [1, 2, 3, 4, 5, 0, 2, 3];
        assert_eq!(drafted(&h, 3, 3), vec![4, 5, 0]);
    }

    #[test]
    fn nothing_is_drafted_without_a_match_or_room() {
        assert!(drafted(&[1, 2, 3, 4], 3, 4).is_empty());
        assert!(drafted(&[1, 2, 1, 2], 2, 0).is_empty());
        assert!(drafted(&[5], 3, 4).is_empty());
        // A single repeated token is no n-gram of at least two.
        assert!(drafted(&[7, 1, 9, 1], 3, 4).is_empty());
        // The draft stops at the end of the history.
        assert_eq!(drafted(&[1, 2, 9, 1, 2], 2, 8), vec![9, 1, 2]);
    }

    #[test]
    fn settings_parse_and_print() {
        assert_eq!("off".parse::<Speculation>().unwrap(), Speculation::OFF);
        assert_eq!(
            "prompt-lookup".parse::<Speculation>().unwrap(),
            Speculation::DEFAULT
        );
        let s: Speculation = "prompt-lookup:4:2".parse().unwrap();
        assert_eq!(
            "prompt-lookup:3".parse::<Speculation>().unwrap(),
            Speculation::DEFAULT
        );
        assert_eq!((s.max_draft, s.ngram), (4, 2));
        assert_eq!(s.to_string(), "prompt-lookup:4:2");
        assert_eq!(Speculation::OFF.to_string(), "off");
        for bad in [
            "lookup",
            "prompt-lookup:x",
            "prompt-lookup:4:1",
            "prompt-lookup:99",
        ] {
            assert!(bad.parse::<Speculation>().is_err(), "{bad}");
        }
    }
}

/// On the real generator: the same tokens with and without drafts.
#[cfg(test)]
mod on_the_model {
    use super::Speculation;
    use crate::testing::{model, rag_messages, request, run, zorbia_prompt};
    use crate::{ChatMessage, ChatTokenizer, Sampling};

    fn prompts(model: &crate::llama::Llama) -> Vec<Vec<u32>> {
        let copy = ChatMessage::new(
            "user",
            "Passage: git stash pop applies the most recently stashed changes to the working \
             tree and removes that entry from the stash list; git stash apply applies them \
             and keeps the entry.\nQuestion: What does git stash pop do? Quote the passage.",
        );
        vec![
            zorbia_prompt(model),
            model.chat_prompt(&rag_messages()).unwrap(),
            model.chat_prompt(&[copy]).unwrap(),
        ]
    }

    /// Greedy and seeded sampling give the same tokens, one step at a time or verifying
    /// drafts, alone or with other requests in the step; and the drafts are taken.
    #[test]
    fn drafting_changes_no_token_and_drafts_are_accepted() {
        let Some(model) = model() else { return };
        let prompts = prompts(model);
        let samplings = [
            Sampling::default(),
            Sampling {
                temperature: 0.8,
                seed: 7,
                ..Sampling::default()
            },
            Sampling {
                repetition_penalty: 1.15,
                no_repeat_ngram: 4,
                ..Sampling::default()
            },
        ];
        let generate = |p: &Vec<u32>, s: &Sampling| {
            let mut req = request(p, 48, *s);
            req.ignore_eos = true;
            run(model, req).0
        };
        let plain: Vec<Vec<u32>> = samplings
            .iter()
            .flat_map(|s| prompts.iter().map(move |p| (p, s)))
            .map(|(p, s)| generate(p, s).tokens)
            .collect();
        model.set_speculation(Speculation::DEFAULT);
        let (mut drafted, mut accepted) = (0, 0);
        let mut alone = Vec::new();
        for s in &samplings {
            for p in &prompts {
                let out = generate(p, s);
                drafted += out.speculation.drafted;
                accepted += out.speculation.accepted;
                alone.push(out.tokens);
            }
        }
        // All of them at once: drafts verified in batched steps beside other requests.
        let together: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = samplings
                .iter()
                .flat_map(|s| prompts.iter().map(move |p| (p, s)))
                .map(|(p, s)| scope.spawn(move || generate(p, s).tokens))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        model.set_speculation(Speculation::OFF);
        assert_eq!(alone, plain, "drafting changed an answer");
        assert_eq!(together, plain, "drafting in a batch changed an answer");
        assert!(
            drafted > 0 && accepted > 0,
            "{accepted} of {drafted} drafts taken"
        );
        eprintln!("accepted {accepted} of {drafted} draft tokens");
    }
}
