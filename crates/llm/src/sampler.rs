//! Picking each next token from the last position's logits, as candle's `LogitsProcessor`
//! does: repetition penalties or an n-gram block over the tokens generated so far, then greedy,
//! or temperature and nucleus sampling from a seeded RNG; optionally the log-probabilities of
//! the model's own distribution. The generation loop ([`super::generation`]) owns one
//! [`Sampler`] per request.

use std::collections::HashMap;

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Sampling;

/// The longest run of an answer's last tokens the copy bias looks for in the context: enough
/// to tell one option's spelling from another's.
const COPY_MATCH: usize = 8;

/// The last position's logits `(vocab,)`: a candle tensor (maybe on the GPU), or the host
/// buffer [`CpuDecoder`](super::cpu_decode::CpuDecoder) wrote.
pub(super) enum Logits {
    Device(Tensor),
    Host(Vec<f32>),
}

/// Picks each next token: greedy, or softmax(logits / temperature) sampling, optionally over the
/// nucleus (the most likely tokens whose probabilities first reach `top_p`), from a seeded RNG.
/// Buffers are reused across tokens; the nucleus is found without sorting the whole vocabulary.
pub(super) struct Sampler {
    /// `None` means greedy.
    temperature: Option<f32>,
    /// Below 1: nucleus sampling.
    top_p: f32,
    rng: StdRng,
    probs: Vec<f32>,
    candidates: Vec<u32>,
    /// Tokens never picked (end-of-sequence when the request ignores it).
    banned: Vec<u32>,
    /// `None` when the request asks for no penalty and no n-gram block.
    penalties: Option<Penalties>,
    /// The logits after penalties (used only when some apply).
    adjusted: Vec<f32>,
}

/// A pick, and with it the log-probabilities of the raw logits when they were asked for.
pub(super) struct Pick {
    pub token: u32,
    /// The picked token's log-probability and the `k` most likely `(token, logprob)`.
    pub logprobs: Option<(f32, Vec<(u32, f32)>)>,
}

/// The penalties and the n-gram block, with the generated tokens they look at, and the biases
/// towards the context's tokens and spans.
struct Penalties {
    /// The context's distinct tokens, and what is added to their logits.
    favoured: Vec<u32>,
    bias: f32,
    /// The context's tokens in order: what is added to the logits of the tokens that continue
    /// there the answer's last tokens, and the n-grams the block allows as often as it holds them.
    context: Vec<u32>,
    copy: f32,
    /// Where the answer starts in `history` (after the prompt, when that was counted).
    answer_from: usize,
    presence: f32,
    frequency: f32,
    repetition: f32,
    ngram: usize,
    /// How often each generated token was picked.
    counts: HashMap<u32, u32>,
    /// Every generated token, in order (for the n-gram block).
    history: Vec<u32>,
}

impl Penalties {
    fn new(s: &Sampling) -> Option<Penalties> {
        s.penalises().then(|| Penalties {
            favoured: Vec::new(),
            bias: s.context_bias,
            context: Vec::new(),
            copy: s.copy_bias,
            answer_from: 0,
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            repetition: s.repetition_penalty,
            ngram: s.no_repeat_ngram,
            counts: HashMap::new(),
            history: Vec::new(),
        })
    }

    /// Adjusts the logits of the context's tokens and of the tokens seen so far; only those
    /// are touched.
    fn apply(&self, logits: &mut [f32]) {
        if self.bias != 0.0 {
            for &token in &self.favoured {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l += self.bias;
                }
            }
        }
        for (&token, &count) in &self.counts {
            let Some(l) = logits.get_mut(token as usize) else {
                continue;
            };
            if self.repetition != 1.0 {
                *l = if *l > 0.0 {
                    *l / self.repetition
                } else {
                    *l * self.repetition
                };
            }
            *l -= self.presence + self.frequency * count as f32;
        }
        if self.copy != 0.0 {
            self.for_each_copied(|token| {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l += self.copy;
                }
            });
        }
        self.for_each_blocked(|token| {
            if let Some(l) = logits.get_mut(token as usize) {
                *l = f32::NEG_INFINITY;
            }
        });
    }

    /// Calls `f` once with each token that follows, in the context, the longest run of the
    /// answer's last tokens (up to [`COPY_MATCH`]) that the context holds.
    fn for_each_copied(&self, mut f: impl FnMut(u32)) {
        let (answer, context) = (&self.history[self.answer_from..], &self.context);
        let Some(&last) = answer.last() else {
            return;
        };
        let mut best = 0;
        let mut next: Vec<u32> = Vec::new();
        for j in 0..context.len().saturating_sub(1) {
            if context[j] != last {
                continue;
            }
            let mut run = 1;
            while run < COPY_MATCH
                && run < answer.len()
                && run <= j
                && context[j - run] == answer[answer.len() - 1 - run]
            {
                run += 1;
            }
            if run > best {
                best = run;
                next.clear();
            }
            if run == best && !next.contains(&context[j + 1]) {
                next.push(context[j + 1]);
            }
        }
        next.into_iter().for_each(&mut f);
    }

    /// Calls `f` with each token that would complete an n-gram already generated: the last
    /// `ngram - 1` tokens appeared before, followed by it. An n-gram the context holds more
    /// often than the history is not blocked: a name the context repeats (`git stash` of "git
    /// stash pop … the inverse of git stash push", three tokens) may be repeated, where a loop
    /// over the answer's own words, or over a sentence it copied, is stopped once it has said
    /// it as often as the context does. With `penalize_prompt` the history holds the prompt,
    /// context included, so nothing is allowed: the block is HF's. One pass over the history
    /// and one over the context.
    fn for_each_blocked(&self, mut f: impl FnMut(u32)) {
        let (n, h) = (self.ngram, &self.history);
        if n == 0 || h.len() + 1 < n {
            return;
        }
        let tail = &h[h.len() + 1 - n..];
        // Each token completing the n-gram in the history, with how many times the history
        // holds that n-gram less how many times the context does.
        let mut excess: HashMap<u32, i64> = HashMap::new();
        for w in h.windows(n).filter(|w| w[..n - 1] == *tail) {
            *excess.entry(w[n - 1]).or_default() += 1;
        }
        if !excess.is_empty() {
            for w in self.context.windows(n).filter(|w| w[..n - 1] == *tail) {
                if let Some(e) = excess.get_mut(&w[n - 1]) {
                    *e -= 1;
                }
            }
        }
        // Allowed only where the context holds the n-gram more often than the history.
        excess
            .into_iter()
            .filter(|&(_, e)| e >= 0)
            .for_each(|(token, _)| f(token));
    }

    fn accept(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
        self.history.push(token);
    }
}

/// The log-softmax of `logits` at `token`, and the `k` most likely tokens with theirs (most
/// likely first; ties in token order). One pass for the normaliser, one for the top `k`.
pub(super) fn logprobs(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() == k && l <= top[k - 1].1 {
                continue;
            }
            let at = top.partition_point(|&(_, t)| t >= l);
            top.insert(at, (i as u32, l));
            top.truncate(k);
        }
    }
    let top = top.into_iter().map(|(i, l)| (i, lp(l))).collect();
    (lp(logits[token as usize]), top)
}

impl Sampler {
    pub fn new(s: &Sampling) -> Sampler {
        let temperature = (s.temperature > 0.0).then_some(s.temperature as f32);
        let top_p = match s.top_p {
            Some(p) if p > 0.0 && p < 1.0 => p as f32,
            _ => 1.0,
        };
        Sampler {
            temperature,
            top_p,
            rng: StdRng::seed_from_u64(s.seed),
            probs: Vec::new(),
            candidates: Vec::new(),
            banned: Vec::new(),
            penalties: Penalties::new(s),
            adjusted: Vec::new(),
        }
    }

    /// The sampler a generation request asks for: its sampling, the prompt counted for the
    /// penalties when `penalize_prompt` says so, its context's tokens favoured, and `eos`
    /// banned when it ignores the end of sequence.
    pub fn for_request(s: &Sampling, prompt: &[u32], context: &[u32], ban: &[u32]) -> Sampler {
        let mut sampler = Sampler::new(s);
        if s.penalize_prompt {
            sampler = sampler.seeing(prompt);
        }
        if let Some(p) = &mut sampler.penalties {
            if p.bias != 0.0 {
                p.favoured = context.to_vec();
                p.favoured.sort_unstable();
                p.favoured.dedup();
            }
            if p.copy != 0.0 || p.ngram > 0 {
                p.context = context.to_vec();
            }
            p.answer_from = p.history.len();
        }
        sampler.banning(ban)
    }

    /// Counts `prompt` as generated for the penalties and the n-gram block (when any apply).
    pub fn seeing(mut self, prompt: &[u32]) -> Sampler {
        if let Some(p) = &mut self.penalties {
            prompt.iter().for_each(|&t| p.accept(t));
        }
        self
    }

    /// Never picks any of `tokens`: as if their logits were minus infinity.
    pub fn banning(mut self, tokens: &[u32]) -> Sampler {
        self.banned = tokens.to_vec();
        self
    }

    /// The next token from `logits` (the tests' shorthand for [`Sampler::pick`]).
    #[cfg(test)]
    pub fn sample(&mut self, logits: &Logits) -> candle_core::Result<u32> {
        Ok(self.pick(logits, None)?.token)
    }

    /// The next token from `logits`, with the log-probabilities of the `k` most likely tokens
    /// when `top_logprobs` is `Some(k)`. The pick counts towards later penalties.
    pub fn pick(
        &mut self,
        logits: &Logits,
        top_logprobs: Option<usize>,
    ) -> candle_core::Result<Pick> {
        let plain = self.penalties.is_none() && top_logprobs.is_none();
        let copied;
        let raw: &[f32] = match logits {
            Logits::Device(t) => {
                if plain && self.temperature.is_none() {
                    // Greedy on the device: only the winner's index comes back.
                    let best = t.argmax(0)?.to_scalar::<u32>()?;
                    if !self.banned.contains(&best) {
                        return Ok(Pick {
                            token: best,
                            logprobs: None,
                        });
                    }
                }
                copied = t.to_vec1::<f32>()?;
                &copied
            }
            Logits::Host(v) => v,
        };
        let token = match &self.penalties {
            None => self.sample_host(raw)?,
            Some(p) => {
                let mut adjusted = std::mem::take(&mut self.adjusted);
                adjusted.clear();
                adjusted.extend_from_slice(raw);
                p.apply(&mut adjusted);
                let token = self.sample_host(&adjusted);
                self.adjusted = adjusted;
                token?
            }
        };
        if let Some(p) = &mut self.penalties {
            p.accept(token);
        }
        Ok(Pick {
            token,
            logprobs: top_logprobs.map(|k| logprobs(raw, token, k)),
        })
    }

    fn sample_host(&mut self, logits: &[f32]) -> candle_core::Result<u32> {
        let Some(temperature) = self.temperature else {
            // The first largest of the tokens not banned.
            return (0..logits.len() as u32)
                .filter(|i| !self.banned.contains(i))
                .fold(None, |best: Option<u32>, i| match best {
                    Some(b) if logits[b as usize] >= logits[i as usize] => Some(b),
                    _ => Some(i),
                })
                .ok_or_else(|| candle_core::Error::Msg("every token is banned".into()));
        };
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / temperature;
        self.probs.clear();
        self.probs
            .extend(logits.iter().map(|&l| ((l - max) * inv_t).exp()));
        for &i in &self.banned {
            if let Some(p) = self.probs.get_mut(i as usize) {
                *p = 0.0;
            }
        }
        let total: f64 = self.probs.iter().map(|&p| p as f64).sum();
        let n = self.probs.len();
        let probs = &self.probs;
        self.candidates.clear();
        if self.top_p >= 1.0 {
            self.candidates.extend(0..n as u32);
        } else {
            // A token with probability below (1 - top_p) / n can never be in the nucleus: even
            // together with every less likely token it cannot make up the excluded 1 - top_p.
            // So only the few likely tokens need sorting.
            let floor = (total * (1.0 - self.top_p as f64) / n as f64) as f32;
            self.candidates
                .extend((0..n as u32).filter(|&i| probs[i as usize] >= floor));
            self.candidates
                .sort_unstable_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
            let target = total * self.top_p as f64;
            let mut cum = 0.0;
            let mut keep = self.candidates.len();
            for (j, &i) in self.candidates.iter().enumerate() {
                cum += probs[i as usize] as f64;
                if cum >= target {
                    keep = j + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
        }
        let mass: f64 = self
            .candidates
            .iter()
            .map(|&i| probs[i as usize] as f64)
            .sum();
        let mut r = self.rng.random::<f64>() * mass;
        for &i in &self.candidates {
            r -= probs[i as usize] as f64;
            if r < 0.0 {
                return Ok(i);
            }
        }
        // Rounding left r at or just above zero: the last candidate that can be drawn.
        let probs = &self.probs;
        self.candidates
            .iter()
            .rev()
            .copied()
            .find(|&i| probs[i as usize] > 0.0)
            .ok_or_else(|| candle_core::Error::Msg("no token to sample".into()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn draw(sampling: Sampling, logits: &[f32], n: usize) -> Vec<u32> {
        let logits = Logits::Device(Tensor::new(logits, &Device::Cpu).unwrap());
        let mut s = Sampler::new(&sampling);
        (0..n).map(|_| s.sample(&logits).unwrap()).collect()
    }

    fn sampling(temperature: f64, top_p: Option<f64>, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            seed,
            ..Sampling::default()
        }
    }

    /// The greedy picks after each token of `history` was generated.
    fn greedy_after(sampling: Sampling, logits: &[f32], history: &[u32]) -> u32 {
        let mut s = Sampler::new(&sampling);
        if let Some(p) = &mut s.penalties {
            history.iter().for_each(|&t| p.accept(t));
        }
        s.sample(&Logits::Host(logits.to_vec())).unwrap()
    }

    #[test]
    fn presence_and_frequency_penalties_subtract_from_seen_tokens() {
        let logits = [1.0, 0.0, 3.0, -2.0];
        let s = Sampling {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Sampling::default()
        };
        let mut p = Penalties::new(&s).unwrap();
        [2, 2, 3].iter().for_each(|&t| p.accept(t));
        let mut adjusted = logits;
        p.apply(&mut adjusted);
        // Token 2: seen twice, 3 - 0.5 - 2 * 0.25; token 3: once; 0 and 1 untouched.
        assert_eq!(adjusted, [1.0, 0.0, 2.0, -2.75]);
        // Strong enough, the penalty moves greedy off the repeated token; negative, it favours it.
        let strong = Sampling {
            frequency_penalty: 1.5,
            ..Sampling::default()
        };
        assert_eq!(greedy_after(strong, &logits, &[2]), 2);
        assert_eq!(greedy_after(strong, &logits, &[2, 2]), 0);
        let negative = Sampling {
            presence_penalty: -2.0,
            ..Sampling::default()
        };
        assert_eq!(greedy_after(negative, &[3.0, 1.5], &[1]), 1);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let s = Sampling {
            repetition_penalty: 2.0,
            ..Sampling::default()
        };
        let mut p = Penalties::new(&s).unwrap();
        [0, 1, 1].iter().for_each(|&t| p.accept(t));
        let mut adjusted = [4.0, -1.0, 3.0];
        p.apply(&mut adjusted);
        // Once per seen token whatever the count (HF's semantics).
        assert_eq!(adjusted, [2.0, -2.0, 3.0]);
        assert_eq!(greedy_after(s, &[4.0, -1.0, 3.0], &[0]), 2);
        // Neutral settings add no work at all.
        assert!(Penalties::new(&Sampling::default()).is_none());
        // A prompt token counts only when asked.
        let logits = Logits::Host(vec![4.0, -1.0, 3.0]);
        assert_eq!(Sampler::new(&s).seeing(&[0]).sample(&logits).unwrap(), 2);
        let plain = Sampler::new(&Sampling::default()).seeing(&[0]);
        assert!(plain.penalties.is_none());
    }

    #[test]
    fn the_context_bias_favours_the_contexts_tokens_only() {
        let logits = Logits::Host(vec![3.0, 2.0, 1.5, 0.0]);
        let s = Sampling {
            context_bias: 1.0,
            ..Sampling::default()
        };
        // Token 2 is in the context: 1.5 + 1.0 beats 2.0 but not 3.0; with 2.0 it wins.
        let pick = |s: &Sampling, context: &[u32]| {
            Sampler::for_request(s, &[], context, &[])
                .pick(&logits, Some(1))
                .unwrap()
        };
        assert_eq!(pick(&s, &[2, 2]).token, 0);
        let strong = Sampling {
            context_bias: 2.0,
            ..s
        };
        let p = pick(&strong, &[2, 2]);
        assert_eq!(p.token, 2);
        // The reported log-probabilities are the model's own, before the bias.
        let (lp, top) = p.logprobs.unwrap();
        assert_eq!(top[0].0, 0);
        assert!(lp < top[0].1);
        // No context, or no bias: the model's own pick.
        assert_eq!(pick(&strong, &[]).token, 0);
        assert_eq!(pick(&Sampling::default(), &[2]).token, 0);
    }

    #[test]
    fn the_copy_bias_favours_what_follows_the_longest_match_in_the_context() {
        let s = Sampling {
            copy_bias: 2.0,
            ..Sampling::default()
        };
        // The context spells "5 1 2" and "7 1 3": after "7 1" the longer match says 3.
        let context = [5, 1, 2, 9, 7, 1, 3];
        let logits = Logits::Host(vec![0.0, 0.0, 1.0, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let mut sampler = Sampler::for_request(&s, &[4, 4], &context, &[]);
        let feed = |sampler: &mut Sampler, token: u32| {
            sampler.penalties.as_mut().unwrap().accept(token);
        };
        // Nothing generated yet: no bias, the model's own pick.
        assert_eq!(sampler.sample(&logits).unwrap(), 4);
        sampler = Sampler::for_request(&s, &[4, 4], &context, &[]);
        feed(&mut sampler, 7);
        feed(&mut sampler, 1);
        assert_eq!(sampler.sample(&logits).unwrap(), 3);
        // After a lone "1" both continuations match one token long: 2 wins on its logit.
        let mut sampler = Sampler::for_request(&s, &[], &context, &[]);
        feed(&mut sampler, 1);
        assert_eq!(sampler.sample(&logits).unwrap(), 2);
        // A token the context does not hold: the model's own pick.
        let mut sampler = Sampler::for_request(&s, &[], &context, &[]);
        feed(&mut sampler, 8);
        assert_eq!(sampler.sample(&logits).unwrap(), 4);
        // The prompt, counted for the penalties, is not part of the answer being matched.
        let counted = Sampling {
            penalize_prompt: true,
            ..s
        };
        let mut sampler = Sampler::for_request(&counted, &[7, 1], &context, &[]);
        assert_eq!(sampler.sample(&logits).unwrap(), 4);
    }

    #[test]
    fn no_repeat_ngram_blocks_the_token_completing_a_seen_ngram() {
        let s = Sampling {
            no_repeat_ngram: 3,
            ..Sampling::default()
        };
        let mut p = Penalties::new(&s).unwrap();
        // 5 6 7 ... 5 6: a 7 would repeat "5 6 7".
        [5, 6, 7, 1, 5, 6].iter().for_each(|&t| p.accept(t));
        let mut blocked = Vec::new();
        p.for_each_blocked(|t| blocked.push(t));
        assert_eq!(blocked, [7]);
        let mut logits = vec![0.0; 8];
        logits[7] = 5.0;
        logits[4] = 1.0;
        assert_eq!(greedy_after(s, &logits, &[5, 6, 7, 1, 5, 6]), 4);
        // Not after "6 5": nothing to complete.
        assert_eq!(greedy_after(s, &logits, &[5, 6, 7, 6, 5]), 7);
        let unigram = Sampling {
            no_repeat_ngram: 1,
            ..Sampling::default()
        };
        assert_eq!(greedy_after(unigram, &[3.0, 2.0, 1.0], &[0, 1]), 2);
    }

    #[test]
    fn an_ngram_the_context_repeats_may_be_repeated_as_often_as_it_does() {
        let s = Sampling {
            no_repeat_ngram: 3,
            ..Sampling::default()
        };
        let mut host = vec![0.0; 8];
        host[7] = 5.0;
        host[4] = 1.0;
        let logits = Logits::Host(host);
        let answer = [5, 6, 7, 1, 5, 6];
        let pick = |context: &[u32]| {
            let mut sampler = Sampler::for_request(&s, &[], context, &[]);
            answer
                .iter()
                .for_each(|&t| sampler.penalties.as_mut().unwrap().accept(t));
            sampler.sample(&logits).unwrap()
        };
        // "5 6 7" twice in the context: the answer may say it a second time, not a third.
        assert_eq!(pick(&[5, 6, 7, 2, 5, 6, 7]), 7);
        assert_eq!(pick(&[5, 6, 7, 2]), 4);
        assert_eq!(pick(&[]), 4);
        let thrice = [5, 6, 7, 1, 5, 6, 7, 1, 5, 6];
        let mut sampler = Sampler::for_request(&s, &[], &[5, 6, 7, 2, 5, 6, 7], &[]);
        thrice
            .iter()
            .for_each(|&t| sampler.penalties.as_mut().unwrap().accept(t));
        assert_eq!(sampler.sample(&logits).unwrap(), 4);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_with_the_top_sorted() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let (chosen, top) = logprobs(&logits, 2, 3);
        assert!((chosen as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2]);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        let total: f64 = (0..5)
            .map(|i| (logprobs(&logits, i, 0).0 as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        // Greedy's pick carries the largest log-probability, taken before any penalty.
        let s = Sampling {
            frequency_penalty: 1.0,
            ..Sampling::default()
        };
        let mut sampler = Sampler::new(&s);
        let pick = sampler
            .pick(&Logits::Host(logits.to_vec()), Some(2))
            .unwrap();
        assert_eq!(pick.token, 1);
        let (lp, top) = pick.logprobs.unwrap();
        assert_eq!(lp, top[0].1);
        assert!(lp <= 0.0);
        // Token 1 is now penalised: greedy takes 3; its log-probability is still the raw one.
        let pick = sampler
            .pick(&Logits::Host(logits.to_vec()), Some(2))
            .unwrap();
        assert_eq!(pick.token, 3);
        assert_eq!(pick.logprobs.unwrap().0, lp);
    }

    #[test]
    fn sampler_greedy_takes_the_argmax() {
        let logits = [0.1, 2.0, -1.0, 1.9];
        assert_eq!(draw(sampling(0.0, None, 1), &logits, 3), [1, 1, 1]);
        assert_eq!(draw(sampling(f64::NAN, Some(0.5), 1), &logits, 1), [1]);
    }

    #[test]
    fn sampler_never_picks_a_banned_token() {
        let logits = Logits::Device(Tensor::new(&[0.1f32, 2.0, -1.0, 1.9], &Device::Cpu).unwrap());
        let mut greedy = Sampler::new(&sampling(0.0, None, 1)).banning(&[1]);
        assert_eq!(greedy.sample(&logits).unwrap(), 3);
        let mut sampled = Sampler::new(&sampling(1.0, Some(0.9), 5)).banning(&[1, 3]);
        for _ in 0..200 {
            assert!(![1, 3].contains(&sampled.sample(&logits).unwrap()));
        }
    }

    #[test]
    fn sampler_follows_the_softmax() {
        // p = [0.25, 0.75]
        let logits = [0.0, 3f32.ln()];
        let picks = draw(sampling(1.0, None, 42), &logits, 4000);
        let ones = picks.iter().filter(|&&i| i == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        // Temperature 2 flattens it to softmax([0, ln 3 / 2]) = [0.366, 0.634].
        let picks = draw(sampling(2.0, None, 42), &logits, 4000);
        let ones = picks.iter().filter(|&&i| i == 1).count() as f64 / 4000.0;
        assert!((ones - 0.634).abs() < 0.03, "{ones}");
    }

    #[test]
    fn sampler_top_p_keeps_only_the_nucleus() {
        // p = [0.1, 0.6, 0.3]: top_p 0.5 is {1}; 0.8 is {1, 2}.
        let logits = [1f32.ln(), 6f32.ln(), 3f32.ln()];
        assert!(draw(sampling(1.0, Some(0.5), 3), &logits, 500)
            .iter()
            .all(|&i| i == 1));
        let picks = draw(sampling(1.0, Some(0.8), 3), &logits, 2000);
        assert!(!picks.contains(&0));
        let twos = picks.iter().filter(|&&i| i == 2).count() as f64 / 2000.0;
        assert!((twos - 1.0 / 3.0).abs() < 0.04, "{twos}");
        // Same seed, same draws; another seed differs somewhere.
        let a = draw(sampling(1.0, Some(0.95), 9), &logits, 64);
        assert_eq!(a, draw(sampling(1.0, Some(0.95), 9), &logits, 64));
        assert_ne!(a, draw(sampling(1.0, Some(0.95), 10), &logits, 64));
    }
}
