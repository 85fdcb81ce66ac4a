//! Picking each next token from the last position's logits, as candle's `LogitsProcessor`
//! does: greedy, or temperature and nucleus sampling from a seeded RNG. The generation loop
//! ([`super::generation`]) owns one [`Sampler`] per request.

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Sampling;

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
        }
    }

    /// Never picks any of `tokens`: as if their logits were minus infinity.
    pub fn banning(mut self, tokens: &[u32]) -> Sampler {
        self.banned = tokens.to_vec();
        self
    }

    /// The next token from `logits`.
    pub fn sample(&mut self, logits: &Logits) -> candle_core::Result<u32> {
        match logits {
            Logits::Device(t) => {
                if self.temperature.is_none() {
                    // Greedy on the device: only the winner's index comes back.
                    let best = t.argmax(0)?.to_scalar::<u32>()?;
                    if !self.banned.contains(&best) {
                        return Ok(best);
                    }
                }
                self.sample_host(&t.to_vec1::<f32>()?)
            }
            Logits::Host(v) => self.sample_host(v),
        }
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
        }
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
