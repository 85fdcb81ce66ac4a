//! The query mix: what each request asks beyond its Zipf draw. A share of requests is cold (a
//! variant of the drawn question that no earlier request sent, so the server's query-embedding
//! cache and its prefix KV cache both miss), a share carries a filter no document matches, and
//! at `perturb_rate` the question gets a typo or a paraphrase template (widening the semantic
//! spread a fixed query set lacks). Every decision is drawn from the run's seed and the request
//! id alone, so it does not depend on the order in which concurrent users send, and is recorded
//! per request in `requests.jsonl`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::record::QueryKind;

/// The shares of the mix (each in [0, 1]; cold and no-match together at most 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    pub cold_share: f64,
    pub no_match_share: f64,
    pub perturb_rate: f64,
    pub seed: u64,
    /// Distinguishes this run's cold variants from every earlier run's, so a server that saw
    /// an earlier run with the same seed still has none of them cached.
    pub nonce: u64,
}

/// What one request asks.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub query: String,
    pub kind: QueryKind,
    pub filter: Option<Value>,
    pub perturbation: Option<String>,
}

/// Paraphrase templates: `{q}` is the question, `{lq}` the question with a lower-case first letter.
pub const TEMPLATES: [&str; 6] = [
    "Quick question: {q}",
    "Could you tell me {lq}",
    "{q} Please answer briefly.",
    "I am new to git. {q}",
    "In git, {lq}",
    "Help me out here: {q}",
];

impl Mix {
    /// No cold, no no-match, no perturbation: every request asks its Zipf draw as it is.
    pub fn none(seed: u64) -> Mix {
        Mix {
            cold_share: 0.0,
            no_match_share: 0.0,
            perturb_rate: 0.0,
            seed,
            nonce: 0,
        }
    }

    pub fn check(&self) -> anyhow::Result<()> {
        let share = |x: f64| (0.0..=1.0).contains(&x);
        if !share(self.cold_share) || !share(self.no_match_share) || !share(self.perturb_rate) {
            anyhow::bail!("--cold-share, --no-match-share and --perturb-rate must be in [0, 1]");
        }
        if self.cold_share + self.no_match_share > 1.0 {
            anyhow::bail!("--cold-share plus --no-match-share must be at most 1");
        }
        Ok(())
    }

    /// The request `id`'s question and filter, from the Zipf-drawn `base` question.
    pub fn draw(&self, base: &str, id: u64) -> Drawn {
        let mut rng = StdRng::seed_from_u64(
            self.seed
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(id.wrapping_mul(0xbf58_476d_1ce4_e5b9))
                ^ 0x006d_6978,
        );
        let u: f64 = rng.random();
        let (kind, mut query, filter) = if u < self.cold_share {
            // The tag leads: the question comes first in the prompt, so the prefix cache misses
            // from there on as well as the embedding cache.
            let tag = format!("Ticket {:x}-{id}:", self.nonce);
            (QueryKind::Cold, format!("{tag} {base}"), None)
        } else if u < self.cold_share + self.no_match_share {
            let filter =
                json!({"doc_id": format!("ragscope-loadgen-no-such-document-{:x}", self.nonce)});
            (QueryKind::NoMatch, base.to_string(), Some(filter))
        } else {
            (QueryKind::Hot, base.to_string(), None)
        };
        let mut perturbation = None;
        if let Some((q, what)) = self.perturb_at(&query, id) {
            query = q;
            perturbation = Some(what);
        }
        Drawn {
            query,
            kind,
            filter,
            perturbation,
        }
    }
}

impl Mix {
    /// At `perturb_rate`, request `id`'s perturbation of `query` (seeded by the seed and id
    /// alone: a replay perturbs the recorded questions the same way each time).
    pub fn perturb_at(&self, query: &str, id: u64) -> Option<(String, String)> {
        if self.perturb_rate <= 0.0 {
            return None;
        }
        let mut rng = StdRng::seed_from_u64(
            self.seed
                .wrapping_mul(0xd6e8_feb8_6659_fd93)
                .wrapping_add(id.wrapping_mul(0x94d0_49bb_1331_11eb))
                ^ 0x7065_7274,
        );
        (rng.random::<f64>() < self.perturb_rate).then(|| perturb(query, &mut rng))
    }
}

/// A typo (half the time) or a paraphrase template, and what was done (`typo:swap@12`,
/// `typo:drop@3`, `typo:double@7`, `template:2`).
pub fn perturb(q: &str, rng: &mut impl Rng) -> (String, String) {
    let chars: Vec<char> = q.chars().collect();
    let letters: Vec<usize> = (0..chars.len())
        .filter(|&i| chars[i].is_alphabetic())
        .collect();
    if rng.random::<bool>() && letters.len() >= 2 {
        let at = letters[rng.random_range(0..letters.len() - 1)];
        let mut c = chars.clone();
        let op = match rng.random_range(0..3) {
            0 => {
                c.swap(at, at + 1);
                "swap"
            }
            1 => {
                c.remove(at);
                "drop"
            }
            _ => {
                c.insert(at, chars[at]);
                "double"
            }
        };
        let typo: String = c.into_iter().collect();
        // A swap of two equal letters changes nothing: double one instead, so a perturbation
        // always changes the question.
        if typo == q {
            let mut c = chars.clone();
            c.insert(at, chars[at]);
            return (c.into_iter().collect(), format!("typo:double@{at}"));
        }
        return (typo, format!("typo:{op}@{at}"));
    }
    let i = rng.random_range(0..TEMPLATES.len());
    let lq = lower_first(q);
    let text = TEMPLATES[i].replace("{q}", q).replace("{lq}", &lq);
    (text, format!("template:{i}"))
}

fn lower_first(q: &str) -> String {
    let mut c = q.chars();
    match c.next() {
        Some(f) => f.to_lowercase().chain(c).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(cold: f64, none: f64, perturb: f64) -> Mix {
        Mix {
            cold_share: cold,
            no_match_share: none,
            perturb_rate: perturb,
            seed: 7,
            nonce: 0xabc,
        }
    }

    #[test]
    fn shares_come_out_at_their_rates_and_cold_queries_never_repeat() {
        let m = mix(0.1, 0.05, 0.0);
        let n = 20_000;
        let drawn: Vec<Drawn> = (0..n).map(|id| m.draw("How do I stash?", id)).collect();
        let count = |k: QueryKind| drawn.iter().filter(|d| d.kind == k).count() as f64 / n as f64;
        // Binomial sd at n = 20 000 is about 0.002: these bounds are 5 sd wide.
        assert!(
            (count(QueryKind::Cold) - 0.1).abs() < 0.011,
            "{}",
            count(QueryKind::Cold)
        );
        assert!((count(QueryKind::NoMatch) - 0.05).abs() < 0.008);
        let cold: std::collections::HashSet<&str> = drawn
            .iter()
            .filter(|d| d.kind == QueryKind::Cold)
            .map(|d| d.query.as_str())
            .collect();
        assert_eq!(
            cold.len(),
            drawn.iter().filter(|d| d.kind == QueryKind::Cold).count()
        );
        assert!(cold.iter().all(|q| q.starts_with("Ticket abc-")));
        for d in &drawn {
            match d.kind {
                QueryKind::Hot => assert!(d.query == "How do I stash?" && d.filter.is_none()),
                QueryKind::NoMatch => assert!(d.filter.as_ref().unwrap()["doc_id"]
                    .as_str()
                    .unwrap()
                    .contains("no-such-document")),
                QueryKind::Cold => assert!(d.filter.is_none()),
            }
        }
    }

    #[test]
    fn draws_depend_on_seed_and_id_only() {
        let m = mix(0.3, 0.1, 0.5);
        let forward: Vec<Drawn> = (0..200).map(|id| m.draw("q one two", id)).collect();
        let backward: Vec<Drawn> = (0..200).rev().map(|id| m.draw("q one two", id)).collect();
        assert!(forward.iter().eq(backward.iter().rev()));
        let other = Mix { seed: 8, ..m };
        let moved = (0..200)
            .filter(|&id| other.draw("q one two", id) != forward[id as usize])
            .count();
        assert!(moved > 50, "{moved}");
        assert_eq!(Mix::none(7).draw("q", 3).kind, QueryKind::Hot);
    }

    #[test]
    fn perturbations_change_the_question_and_say_how() {
        let m = mix(0.0, 0.0, 1.0);
        let base = "Which git stash subcommand applies the most recent stash?";
        let (mut typos, mut templates) = (0, 0);
        for id in 0..500 {
            let d = m.draw(base, id);
            let what = d.perturbation.expect("rate 1 perturbs every request");
            assert_ne!(d.query, base, "{what}");
            if let Some(rest) = what.strip_prefix("typo:") {
                typos += 1;
                // One edit: the lengths differ by at most one character.
                let diff = d.query.chars().count() as i64 - base.chars().count() as i64;
                assert!(diff.abs() <= 1, "{what}: {}", d.query);
                assert!(["swap@", "drop@", "double@"]
                    .iter()
                    .any(|p| rest.starts_with(p)));
            } else {
                templates += 1;
                let i: usize = what.strip_prefix("template:").unwrap().parse().unwrap();
                assert!(i < TEMPLATES.len());
                assert!(d.query.to_lowercase().contains(&base[1..].to_lowercase()));
            }
        }
        assert!(typos > 150 && templates > 150, "{typos} {templates}");
        assert!(mix(0.0, 0.0, 0.0).draw(base, 1).perturbation.is_none());
    }

    #[test]
    fn shares_out_of_range_are_refused() {
        assert!(mix(0.6, 0.5, 0.0).check().is_err());
        assert!(mix(-0.1, 0.0, 0.0).check().is_err());
        assert!(mix(0.0, 0.0, 1.5).check().is_err());
        assert!(mix(0.5, 0.5, 1.0).check().is_ok());
    }
}
