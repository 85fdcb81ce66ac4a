//! Reproducible request schedules. Open-loop arrival times (a Poisson process plus a burst process),
//! which query each request asks (Zipf popularity over the query set, rank 0 = the first query in the
//! file) and how much context it requests (the gradient). All of it is drawn from one seeded
//! generator, so the same seed and flags replay the same schedule.

use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Context};
use rand::Rng;
use serde::{Deserialize, Serialize};

/// Zipf(α) over ranks `0..n`: P(rank r) ∝ 1 / (r + 1)^α. α = 0 is uniform.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, alpha: f64) -> anyhow::Result<Zipf> {
        if n == 0 {
            bail!("the query set is empty");
        }
        if !(alpha >= 0.0 && alpha.is_finite()) {
            bail!("--zipf-alpha must be a finite number >= 0, got {alpha}");
        }
        let weights: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-alpha)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Ok(Zipf { cdf })
    }

    pub fn len(&self) -> usize {
        self.cdf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cdf.is_empty()
    }

    /// The probability of `rank`.
    pub fn probability(&self, rank: usize) -> f64 {
        let below = if rank == 0 { 0.0 } else { self.cdf[rank - 1] };
        self.cdf[rank] - below
    }

    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.random();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

/// An exponential draw with the given rate (events per second): the gap of a Poisson process.
pub fn exponential(rng: &mut impl Rng, rate: f64) -> f64 {
    let u: f64 = rng.random();
    -(1.0 - u).ln() / rate
}

/// Open-loop arrivals: Poisson requests at `rate` per second, plus bursts arriving as a Poisson
/// process at `burst_rate` per second, each burst `burst_size` requests at the same instant.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Arrivals {
    pub rate: f64,
    pub burst_rate: f64,
    pub burst_size: usize,
}

impl Arrivals {
    /// Requests per second offered on average.
    pub fn offered_rps(&self) -> f64 {
        self.rate + self.burst_rate * self.burst_size as f64
    }

    /// Sorted arrival times in seconds within `[0, horizon)`.
    pub fn times(&self, horizon: f64, rng: &mut impl Rng) -> Vec<f64> {
        let mut times = Vec::new();
        if self.rate > 0.0 {
            let mut t = exponential(rng, self.rate);
            while t < horizon {
                times.push(t);
                t += exponential(rng, self.rate);
            }
        }
        if self.burst_rate > 0.0 && self.burst_size > 0 {
            let mut t = exponential(rng, self.burst_rate);
            while t < horizon {
                times.extend(std::iter::repeat_n(t, self.burst_size));
                t += exponential(rng, self.burst_rate);
            }
        }
        times.sort_by(f64::total_cmp);
        times
    }
}

/// A count that is either fixed (`4`) or ranges over the gradient (`4:20`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Range {
    pub min: usize,
    pub max: usize,
}

impl FromStr for Range {
    type Err = String;
    fn from_str(s: &str) -> Result<Range, String> {
        let parse = |p: &str| {
            p.trim()
                .parse::<usize>()
                .map_err(|_| format!("expected N or MIN:MAX, got {s:?}"))
        };
        let (min, max) = match s.split_once(':') {
            Some((a, b)) => (parse(a)?, parse(b)?),
            None => (parse(s)?, parse(s)?),
        };
        if min == 0 || min > max {
            return Err(format!("need 1 <= MIN <= MAX, got {s:?}"));
        }
        Ok(Range { min, max })
    }
}

impl Range {
    /// The value at position `f` in [0, 1] between min and max.
    pub fn at(&self, f: f64) -> usize {
        let f = f.clamp(0.0, 1.0);
        self.min + ((self.max - self.min) as f64 * f).round() as usize
    }
}

/// What the requested context grows with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum GradientKind {
    /// Fixed: the lower end of each range.
    #[default]
    None,
    /// Rarer queries (higher popularity rank) ask for more passages.
    Rank,
    /// Every query asks for more passages as the run goes on.
    Time,
}

/// The context-length gradient: `top_k` and `rerank_top_n` as functions of rank or time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gradient {
    pub kind: GradientKind,
    pub top_k: Option<Range>,
    pub rerank_top_n: Option<Range>,
}

impl Gradient {
    /// `(top_k, rerank_top_n)` for a query of popularity `rank` out of `n`, sent at `t` of `horizon` s.
    /// `None` leaves the server's default. `rerank_top_n` never exceeds `top_k`.
    pub fn at(
        &self,
        rank: usize,
        n: usize,
        t: f64,
        horizon: f64,
    ) -> (Option<usize>, Option<usize>) {
        let f = match self.kind {
            GradientKind::None => 0.0,
            GradientKind::Rank if n > 1 => rank as f64 / (n - 1) as f64,
            GradientKind::Rank => 0.0,
            GradientKind::Time if horizon > 0.0 => t / horizon,
            GradientKind::Time => 0.0,
        };
        let top_k = self.top_k.map(|r| r.at(f));
        let mut rerank = self.rerank_top_n.map(|r| r.at(f));
        if let (Some(k), Some(n)) = (top_k, rerank.as_mut()) {
            *n = (*n).min(k);
        }
        (top_k, rerank)
    }
}

/// Warm-up, steady (the only phase the summary counts) and cool-down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Warmup,
    Steady,
    Cooldown,
}

/// Phase lengths in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    pub warmup_s: f64,
    pub steady_s: f64,
    pub cooldown_s: f64,
}

impl Phases {
    pub fn total(&self) -> f64 {
        self.warmup_s + self.steady_s + self.cooldown_s
    }

    /// The phase at `t` seconds after the start.
    pub fn at(&self, t: f64) -> Phase {
        if t < self.warmup_s {
            Phase::Warmup
        } else if t < self.warmup_s + self.steady_s {
            Phase::Steady
        } else {
            Phase::Cooldown
        }
    }
}

/// The questions of a JSON-lines query set (field `question`, or `query`), in popularity order.
pub fn load_queries(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the query set {}", path.display()))?;
    let mut queries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let q = v
            .get("question")
            .or_else(|| v.get("query"))
            .and_then(|q| q.as_str())
            .with_context(|| format!("{}:{}: no string field `question`", path.display(), i + 1))?;
        queries.push(q.to_string());
    }
    if queries.is_empty() {
        bail!("{} holds no questions", path.display());
    }
    Ok(queries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn zipf_frequencies_follow_the_power_law() {
        let z = Zipf::new(10, 1.0).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let mut counts = [0usize; 10];
        let draws = 200_000;
        for _ in 0..draws {
            counts[z.sample(&mut rng)] += 1;
        }
        // Every rank is drawn, and each frequency is within 10% (relative) of its probability:
        // at 200k draws the standard error is under 2% even for the rarest rank.
        for (r, &c) in counts.iter().enumerate() {
            let expected = z.probability(r) * draws as f64;
            assert!(
                (c as f64 - expected).abs() < 0.1 * expected,
                "rank {r}: {c} vs {expected}"
            );
        }
        // Rank 0 twice as likely as rank 1 under alpha 1.
        assert!((z.probability(0) / z.probability(1) - 2.0).abs() < 1e-9);
        let total: f64 = (0..10).map(|r| z.probability(r)).sum();
        assert!((total - 1.0).abs() < 1e-9);
    }

    #[test]
    fn zipf_alpha_zero_is_uniform_and_bad_input_is_refused() {
        let z = Zipf::new(4, 0.0).unwrap();
        for r in 0..4 {
            assert!((z.probability(r) - 0.25).abs() < 1e-12);
        }
        assert!(Zipf::new(0, 1.0).is_err());
        assert!(Zipf::new(3, -1.0).is_err());
        assert!(Zipf::new(3, f64::NAN).is_err());
    }

    #[test]
    fn poisson_schedule_has_the_right_count_and_gaps() {
        let a = Arrivals {
            rate: 50.0,
            burst_rate: 0.0,
            burst_size: 0,
        };
        let mut rng = StdRng::seed_from_u64(1);
        let times = a.times(200.0, &mut rng);
        // Expected 10 000 arrivals, sd 100: ±6% is 6 sd.
        assert!((9_400..=10_600).contains(&times.len()), "{}", times.len());
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        assert!(times.iter().all(|&t| (0.0..200.0).contains(&t)));
        // Exponential gaps: mean 1/rate and coefficient of variation 1.
        let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.02).abs() < 0.002, "mean gap {mean}");
        let cv = var.sqrt() / mean;
        assert!((0.9..1.1).contains(&cv), "cv {cv}");
    }

    #[test]
    fn bursts_arrive_together_and_add_to_the_offered_rate() {
        let a = Arrivals {
            rate: 0.0,
            burst_rate: 2.0,
            burst_size: 5,
        };
        assert_eq!(a.offered_rps(), 10.0);
        let mut rng = StdRng::seed_from_u64(3);
        let times = a.times(500.0, &mut rng);
        assert_eq!(times.len() % 5, 0);
        // Every instant holds exactly a whole burst.
        for chunk in times.chunks(5) {
            assert!(chunk.iter().all(|&t| t == chunk[0]));
        }
        let bursts = times.len() / 5;
        // Expected 1000 bursts, sd ~32: ±15% is ~5 sd.
        assert!((850..=1150).contains(&bursts), "{bursts}");
    }

    #[test]
    fn the_same_seed_replays_the_same_schedule() {
        let a = Arrivals {
            rate: 3.0,
            burst_rate: 0.5,
            burst_size: 4,
        };
        let t1 = a.times(60.0, &mut StdRng::seed_from_u64(42));
        let t2 = a.times(60.0, &mut StdRng::seed_from_u64(42));
        let t3 = a.times(60.0, &mut StdRng::seed_from_u64(43));
        assert_eq!(t1, t2);
        assert_ne!(t1, t3);
    }

    #[test]
    fn gradient_grows_with_rank_and_with_time() {
        let g = Gradient {
            kind: GradientKind::Rank,
            top_k: Some("4:20".parse().unwrap()),
            rerank_top_n: Some("2:10".parse().unwrap()),
        };
        assert_eq!(g.at(0, 50, 0.0, 10.0), (Some(4), Some(2)));
        assert_eq!(g.at(49, 50, 0.0, 10.0), (Some(20), Some(10)));
        let mid = g.at(25, 50, 0.0, 10.0);
        assert!(mid.0.unwrap() > 4 && mid.0.unwrap() < 20);
        let t = Gradient {
            kind: GradientKind::Time,
            ..g
        };
        assert_eq!(t.at(49, 50, 0.0, 10.0), (Some(4), Some(2)));
        assert_eq!(t.at(0, 50, 10.0, 10.0), (Some(20), Some(10)));
        assert_eq!(t.at(0, 50, 5.0, 10.0), (Some(12), Some(6)));
        let none = Gradient {
            kind: GradientKind::None,
            ..g
        };
        assert_eq!(none.at(49, 50, 9.0, 10.0), (Some(4), Some(2)));
        // rerank_top_n is capped by top_k.
        let capped = Gradient {
            kind: GradientKind::Rank,
            top_k: Some("3".parse().unwrap()),
            rerank_top_n: Some("2:8".parse().unwrap()),
        };
        assert_eq!(capped.at(9, 10, 0.0, 1.0), (Some(3), Some(3)));
        let unset = Gradient {
            kind: GradientKind::Rank,
            top_k: None,
            rerank_top_n: None,
        };
        assert_eq!(unset.at(3, 10, 0.0, 1.0), (None, None));
    }

    #[test]
    fn ranges_parse_and_reject_nonsense() {
        assert_eq!("5".parse::<Range>().unwrap(), Range { min: 5, max: 5 });
        assert_eq!("2:9".parse::<Range>().unwrap(), Range { min: 2, max: 9 });
        assert!("0".parse::<Range>().is_err());
        assert!("9:2".parse::<Range>().is_err());
        assert!("a:b".parse::<Range>().is_err());
    }

    #[test]
    fn phases_split_time() {
        let p = Phases {
            warmup_s: 2.0,
            steady_s: 10.0,
            cooldown_s: 1.0,
        };
        assert_eq!(p.at(0.5), Phase::Warmup);
        assert_eq!(p.at(2.0), Phase::Steady);
        assert_eq!(p.at(11.9), Phase::Steady);
        assert_eq!(p.at(12.5), Phase::Cooldown);
        assert_eq!(p.total(), 13.0);
    }

    #[test]
    fn the_evaluation_questions_load() {
        // At run time first: the cached target dir is shared between checkouts.
        let dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
            || env!("CARGO_MANIFEST_DIR").into(),
            std::path::PathBuf::from,
        );
        let path = dir.join("../../eval/questions.jsonl");
        let q = load_queries(&path).unwrap();
        assert!(q.len() >= 10);
        assert!(q[0].contains("stash"));
    }
}
