//! Picking each next token from the last position's logits, as candle's `LogitsProcessor`
//! does: repetition penalties or an n-gram block over the tokens generated so far, then greedy,
//! or temperature and nucleus sampling from a seeded RNG; optionally the log-probabilities of
//! the model's own distribution. The generation loop ([`super::generation`]) owns one
//! [`Sampler`] per request. [`Sampling`], what it is asked for, is defined here too: a decoding
//! setting is its field, its flag, its span attribute and its effect, in one file.

use std::collections::HashMap;

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use opentelemetry::KeyValue;
use serde::{Deserialize, Serialize};
use telemetry::names::attr;

/// How the next token is chosen: the one description of a decoding setting. The API's
/// `Decoding` fills it from a request, [`SamplingArgs`] gives its RAG defaults,
/// [`Sampling::attributes`] puts it on the `chat` span and the [`Sampler`] applies it.
/// `temperature <= 0` means greedy. [`Sampling::default`] is neutral: no penalty, no n-gram
/// block, greedy (the plain model's and the benchmarks' settings).
///
/// The penalties and the n-gram block look at the tokens this request has generated, not at
/// the prompt (OpenAI's semantics; HF and llama.cpp count the prompt too, which
/// `penalize_prompt` asks for): a RAG answer has to copy words from its passages.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub seed: u64,
    /// OpenAI's `presence_penalty`: subtracted once from the logit of every token generated so far.
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty`: subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// HF / llama.cpp's `repetition_penalty` (1 = off): a generated token's positive logit is
    /// divided by it, a negative one multiplied.
    pub repetition_penalty: f32,
    /// Never generate an n-gram of this many tokens twice (0 = off), as HF's
    /// `no_repeat_ngram_size`, except where the context passages hold it more often than the
    /// answer so far.
    pub no_repeat_ngram: usize,
    /// Count the prompt's tokens as already generated for the penalties and the n-gram block.
    pub penalize_prompt: bool,
    /// Added to the logit of every token of the request's context passages
    /// ([`GenerateRequest::context_tokens`](crate::GenerateRequest::context_tokens); 0 = off).
    #[serde(default)]
    pub context_bias: f32,
    /// Added to the logit of each token that continues, in the context passages, the longest
    /// run of the answer's last tokens found there (0 = off): the answer is pulled towards
    /// copying its sources' spans instead of inventing them.
    #[serde(default)]
    pub copy_bias: f32,
}

/// The sampler's flags: what a RAG answer gets for the settings its request leaves out.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct SamplingArgs {
    /// RAG answers' repetition penalty (HF / llama.cpp's; 1 = off) unless the request says
    /// otherwise.
    #[arg(long, env = "RAGSCOPE_REPETITION_PENALTY", default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// RAG answers never repeat an n-gram of this many tokens (0 = off) unless the request says
    /// otherwise.
    #[arg(long, env = "RAGSCOPE_NO_REPEAT_NGRAM", default_value_t = 3)]
    pub no_repeat_ngram: usize,
    /// Added to the logit of every token of a RAG answer's context passages (0 = off) unless
    /// the request says otherwise: the small generator copies its sources' words more often
    /// (docs/CONTEXT.md has the measurements).
    #[arg(long, env = "RAGSCOPE_CONTEXT_BIAS", default_value_t = 0.0)]
    pub context_bias: f32,
    /// Added to the logit of each token that continues, in a RAG answer's context passages,
    /// the longest run of the answer's last tokens found there (0 = off) unless the request
    /// says otherwise: the answer copies its sources' spans (an option, a command line) rather
    /// than inventing them. With the default 3 and answers ending at their first paragraph,
    /// 25/50 evaluation answers carry the fact against 18/50 with neither (docs/CONTEXT.md).
    #[arg(long, env = "RAGSCOPE_COPY_BIAS", default_value_t = 3.0)]
    pub copy_bias: f32,
}

impl SamplingArgs {
    /// The sampling a RAG request gets for what it does not set: greedy, with these controls.
    pub fn defaults(&self) -> Sampling {
        Sampling {
            repetition_penalty: self.repetition_penalty,
            no_repeat_ngram: self.no_repeat_ngram,
            context_bias: self.context_bias,
            copy_bias: self.copy_bias,
            ..Sampling::default()
        }
    }
}

impl Sampling {
    /// Whether any penalty or block needs the request's generated tokens.
    pub fn penalises(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.no_repeat_ngram > 0
            || self.context_bias != 0.0
            || self.copy_bias != 0.0
    }

    /// Whether the context passages' tokens are needed: a bias towards them, or the n-gram
    /// block's allowance for what they repeat.
    pub fn reads_context(&self) -> bool {
        self.context_bias != 0.0 || self.copy_bias != 0.0 || self.no_repeat_ngram > 0
    }

    /// The settings as `chat` span attributes: temperature and seed always, top-p when set,
    /// and each penalty, bias or block that is not neutral.
    pub fn attributes(&self) -> Vec<KeyValue> {
        let mut out = vec![
            KeyValue::new(attr::GEN_AI_REQUEST_TEMPERATURE, self.temperature),
            KeyValue::new(attr::GEN_AI_REQUEST_SEED, self.seed as i64),
        ];
        if let Some(p) = self.top_p {
            out.push(KeyValue::new(attr::GEN_AI_REQUEST_TOP_P, p));
        }
        let neutral = Sampling::default();
        for (key, value, off) in [
            (
                attr::GEN_AI_REQUEST_PRESENCE_PENALTY,
                self.presence_penalty,
                neutral.presence_penalty,
            ),
            (
                attr::GEN_AI_REQUEST_FREQUENCY_PENALTY,
                self.frequency_penalty,
                neutral.frequency_penalty,
            ),
            (
                attr::REQUEST_REPETITION_PENALTY,
                self.repetition_penalty,
                neutral.repetition_penalty,
            ),
            (
                attr::REQUEST_CONTEXT_BIAS,
                self.context_bias,
                neutral.context_bias,
            ),
            (attr::REQUEST_COPY_BIAS, self.copy_bias, neutral.copy_bias),
        ] {
            if value != off {
                out.push(KeyValue::new(key, f64::from(value)));
            }
        }
        if self.penalize_prompt {
            out.push(KeyValue::new(attr::REQUEST_PENALIZE_PROMPT, true));
        }
        if self.no_repeat_ngram > 0 {
            out.push(KeyValue::new(
                attr::REQUEST_NO_REPEAT_NGRAM_SIZE,
                self.no_repeat_ngram as i64,
            ));
        }
        out
    }
}

/// `name value` pairs of every setting, for reports (`ragscope eval`'s settings line).
impl std::fmt::Display for Sampling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "temperature {} top_p {:?} seed {} presence_penalty {} frequency_penalty {} \
             repetition_penalty {} no_repeat_ngram {} penalize_prompt {} context_bias {} copy_bias {}",
            self.temperature,
            self.top_p,
            self.seed,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.no_repeat_ngram,
            self.penalize_prompt,
            self.context_bias,
            self.copy_bias
        )
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: None,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            no_repeat_ngram: 0,
            penalize_prompt: false,
            context_bias: 0.0,
            copy_bias: 0.0,
        }
    }
}

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
mod tests;
