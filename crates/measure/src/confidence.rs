//! How sure a figure is: seeded bootstrap intervals for percentiles and their differences, the
//! Beta posterior of an error rate, and the normal quantile. A P99 from 40 requests is a guess
//! with an error bar; this module computes the bar, so the summary, the gate and
//! `ragscope attribute --baseline` can say "inconclusive" instead of deciding on noise.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::stats::percentile;

/// Resamples per bootstrap interval.
pub const RESAMPLES: usize = 1000;
/// Confidence of every interval in the summary and report.
pub const CONFIDENCE: f64 = 0.95;
/// Seed of every bootstrap: the same samples give the same interval, run after run.
pub const SEED: u64 = 17;
/// A tail percentile resting on fewer samples beyond it than this is flagged as thin.
pub const MIN_TAIL_SAMPLES: f64 = 10.0;

/// A two-sided confidence interval. An unbounded side is written as JSON `null` (JSON has no
/// infinity) and read back as -∞ (`lo`) or +∞ (`hi`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    #[serde(deserialize_with = "null_is_minus_infinity")]
    pub lo: f64,
    #[serde(deserialize_with = "null_is_infinity")]
    pub hi: f64,
}

fn null_is_minus_infinity<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NEG_INFINITY))
}

fn null_is_infinity<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::INFINITY))
}

impl Interval {
    pub fn half_width(&self) -> f64 {
        (self.hi - self.lo) / 2.0
    }

    /// True when the interval lies wholly above or wholly below zero.
    pub fn excludes_zero(&self) -> bool {
        self.lo > 0.0 || self.hi < 0.0
    }
}

/// The percentile interval of `stat` over bootstrap resamples: the (1 - confidence)/2 and
/// (1 + confidence)/2 quantiles of the resampled statistic.
fn interval_of(mut draws: Vec<f64>, confidence: f64) -> Interval {
    draws.retain(|x| !x.is_nan());
    draws.sort_by(f64::total_cmp);
    let a = (1.0 - confidence) / 2.0;
    Interval {
        lo: percentile(&draws, a),
        hi: percentile(&draws, 1.0 - a),
    }
}

/// One bootstrap resample of `values`, sorted.
fn resample_sorted(values: &[f64], rng: &mut StdRng, buf: &mut Vec<f64>) {
    buf.clear();
    buf.extend((0..values.len()).map(|_| values[rng.random_range(0..values.len())]));
    buf.sort_by(f64::total_cmp);
}

/// Bootstrap intervals of several quantiles `qs` (0..=1) of `values` at once (each resample is
/// sorted once). Empty values give NaN intervals.
pub fn quantile_intervals(
    values: &[f64],
    qs: &[f64],
    resamples: usize,
    confidence: f64,
    seed: u64,
) -> Vec<Interval> {
    if values.is_empty() {
        return vec![
            Interval {
                lo: f64::NAN,
                hi: f64::NAN
            };
            qs.len()
        ];
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut draws: Vec<Vec<f64>> = vec![Vec::with_capacity(resamples); qs.len()];
    let mut buf = Vec::with_capacity(values.len());
    for _ in 0..resamples {
        resample_sorted(values, &mut rng, &mut buf);
        for (d, &q) in draws.iter_mut().zip(qs) {
            d.push(percentile(&buf, q));
        }
    }
    draws
        .into_iter()
        .map(|d| interval_of(d, confidence))
        .collect()
}

/// Bootstrap interval of `quantile(b) - quantile(a)` for two independent samples (each resampled
/// on its own): does the `q` quantile differ between a baseline `a` and a run `b`?
pub fn difference_interval(
    a: &[f64],
    b: &[f64],
    q: f64,
    resamples: usize,
    confidence: f64,
    seed: u64,
) -> Interval {
    if a.is_empty() || b.is_empty() {
        return Interval {
            lo: f64::NAN,
            hi: f64::NAN,
        };
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ba, mut bb) = (Vec::with_capacity(a.len()), Vec::with_capacity(b.len()));
    let draws = (0..resamples)
        .map(|_| {
            resample_sorted(a, &mut rng, &mut ba);
            resample_sorted(b, &mut rng, &mut bb);
            percentile(&bb, q) - percentile(&ba, q)
        })
        .collect();
    interval_of(draws, confidence)
}

/// The distribution-free interval of the `q` quantile from order statistics: the number of
/// samples below the true quantile is Binomial(n, q), so `[x_(l), x_(u)]` covers it with the
/// asked confidence. Unlike the bootstrap, which never reaches past the largest sample, it says
/// when a sample is too small: the upper bound is +∞ when no order statistic is high enough
/// (a p95 from 12 requests has no finite 95% upper bound).
pub fn order_statistic_interval(sorted: &[f64], q: f64, confidence: f64) -> Interval {
    let n = sorted.len();
    if n == 0 {
        return Interval {
            lo: f64::NAN,
            hi: f64::NAN,
        };
    }
    let a = (1.0 - confidence) / 2.0;
    // cdf[k] = P(K <= k), K ~ Binomial(n, q), summed in logs.
    let (lq, lp) = (q.ln(), (1.0 - q).ln());
    let mut cdf = Vec::with_capacity(n + 1);
    let mut ln_choose = 0.0;
    let mut total = 0.0;
    for k in 0..=n {
        if k > 0 {
            ln_choose += ((n - k + 1) as f64).ln() - (k as f64).ln();
        }
        total += (ln_choose + k as f64 * lq + (n - k) as f64 * lp).exp();
        cdf.push(total);
    }
    // Upper: the smallest u (1-based) with P(K <= u - 1) >= 1 - a.
    let hi = (1..=n)
        .find(|&u| cdf[u - 1] >= 1.0 - a)
        .map_or(f64::INFINITY, |u| sorted[u - 1]);
    // Lower: the largest l with P(K <= l - 1) <= a.
    let lo = (1..=n)
        .rev()
        .find(|&l| cdf[l - 1] <= a)
        .map_or(f64::NEG_INFINITY, |l| sorted[l - 1]);
    Interval { lo, hi }
}

/// Samples beyond the `q` quantile among `n`: what a tail percentile actually rests on.
pub fn samples_beyond(n: usize, q: f64) -> f64 {
    n as f64 * (1.0 - q)
}

/// Requests a sample of `n` would need for an interval of half-width `half_width` to shrink to
/// `target` (intervals narrow as 1/√n). `None` when no size would do (a zero target).
pub fn needed_for(n: usize, half_width: f64, target: f64) -> Option<u64> {
    if target.is_nan() || target <= 0.0 || !half_width.is_finite() {
        return None;
    }
    let ratio = half_width / target;
    Some((n.max(1) as f64 * ratio * ratio).ceil() as u64)
}

/// The standard normal quantile (Acklam's rational approximation, relative error < 1.2e-9).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    if p <= 0.0 {
        return f64::NEG_INFINITY;
    }
    if p >= 1.0 {
        return f64::INFINITY;
    }
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.024_25 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.024_25 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, n = 9).
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut s = G[0];
    for (i, g) in G.iter().enumerate().skip(1) {
        s += g / (x + i as f64);
    }
    let t = x + 7.5;
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + s.ln()
}

/// The continued fraction of the incomplete beta function (modified Lentz), for x < (a+1)/(a+b+2).
fn beta_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let mut c = 1.0;
    let mut d = 1.0 - (a + b) * x / (a + 1.0);
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..300 {
        let m = m as f64;
        let num = m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m));
        for num in [
            num,
            -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0)),
        ] {
            d = 1.0 + num * d;
            if d.abs() < TINY {
                d = TINY;
            }
            c = 1.0 + num / c;
            if c.abs() < TINY {
                c = TINY;
            }
            d = 1.0 / d;
            h *= d * c;
        }
        if (d * c - 1.0).abs() < 1e-14 {
            break;
        }
    }
    h
}

/// P(X ≤ x) for X ~ Beta(a, b): the regularised incomplete beta function.
pub fn beta_cdf(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let front =
        (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp();
    if x < (a + 1.0) / (a + b + 2.0) {
        front * beta_fraction(a, b, x) / a
    } else {
        1.0 - front * beta_fraction(b, a, 1.0 - x) / b
    }
}

/// The posterior probability that an error rate is at most `limit`, after `errors` failures in
/// `n` requests, under a uniform prior: Beta(1 + errors, 1 + n - errors).
pub fn error_rate_at_most(limit: f64, errors: u64, n: u64) -> f64 {
    beta_cdf(
        limit,
        1.0 + errors as f64,
        1.0 + n.saturating_sub(errors) as f64,
    )
}

/// The `p` quantile of Student's t with `df` degrees of freedom, by bisection on its CDF (the
/// regularised incomplete beta): the factor a mean's interval needs when it rests on a few
/// rounds rather than thousands of requests (2.26 for 10 rounds at 95%, where the normal
/// quantile would say 1.96 and claim more than the data hold).
pub fn student_t_quantile(p: f64, df: f64) -> f64 {
    if p == 0.5 {
        return 0.0;
    }
    if p < 0.5 {
        return -student_t_quantile(1.0 - p, df);
    }
    // P(T ≤ t) for t ≥ 0.
    let cdf = |t: f64| 1.0 - 0.5 * beta_cdf(df / (df + t * t), df / 2.0, 0.5);
    let (mut lo, mut hi) = (0.0, 1.0);
    while cdf(hi) < p && hi < 1e9 {
        hi *= 2.0;
    }
    for _ in 0..200 {
        let mid = (lo + hi) / 2.0;
        if cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-12 * hi.max(1.0) {
            break;
        }
    }
    (lo + hi) / 2.0
}

/// A mean with its t interval: the mean of `values` and the range that covers the true mean
/// with the asked confidence, assuming the values are independent draws. `None` for fewer than
/// two values (no spread to judge by).
pub fn mean_interval(values: &[f64], confidence: f64) -> Option<(f64, Interval)> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half =
        student_t_quantile((1.0 + confidence) / 2.0, (n - 1) as f64) * (var / n as f64).sqrt();
    Some((
        mean,
        Interval {
            lo: mean - half,
            hi: mean + half,
        },
    ))
}

/// How `b` compares with `a` when each round measured both on the same machine, the same
/// questions and the same minute: the geometric mean of the per-round ratios `b / a`, with its
/// t interval (taken on the log scale, so a ratio and its inverse get mirror intervals). Pairing
/// takes out what a round shares (the questions it drew, the box's state then), which is most
/// of the spread between rounds. `None` for fewer than two usable rounds.
pub fn paired_ratio(pairs: &[(f64, f64)], confidence: f64) -> Option<(f64, Interval)> {
    let logs: Vec<f64> = pairs
        .iter()
        .filter(|(a, b)| *a > 0.0 && *b > 0.0 && a.is_finite() && b.is_finite())
        .map(|(a, b)| (b / a).ln())
        .collect();
    let (mean, interval) = mean_interval(&logs, confidence)?;
    Some((
        mean.exp(),
        Interval {
            lo: interval.lo.exp(),
            hi: interval.hi.exp(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn student_t_matches_the_tables_and_tends_to_the_normal() {
        // Two-sided 95%: 12.706 at 1 df, 2.262 at 9, 2.042 at 30; 1.96 in the limit.
        assert!((student_t_quantile(0.975, 1.0) - 12.706_2).abs() < 1e-3);
        assert!((student_t_quantile(0.975, 9.0) - 2.262_2).abs() < 1e-3);
        assert!((student_t_quantile(0.975, 30.0) - 2.042_3).abs() < 1e-3);
        assert!((student_t_quantile(0.975, 1e6) - normal_quantile(0.975)).abs() < 1e-3);
        assert!((student_t_quantile(0.025, 9.0) + 2.262_2).abs() < 1e-3);
        assert_eq!(student_t_quantile(0.5, 4.0), 0.0);
    }

    #[test]
    fn a_paired_ratio_sees_through_what_rounds_share() {
        assert!(mean_interval(&[1.0], 0.95).is_none());
        let (mean, i) = mean_interval(&[1.0, 2.0, 3.0], 0.95).unwrap();
        // sd 1, n 3: half-width t(0.975, 2) / sqrt(3) = 4.303 / 1.732.
        assert!((mean - 2.0).abs() < 1e-12);
        assert!((i.half_width() - 4.302_65 / 3f64.sqrt()).abs() < 1e-3);
        // Rounds differ by 2x among themselves, but b is 1% slower than a in every one: the
        // pairs say so exactly, where the two columns' own spreads would hide it.
        let pairs: Vec<(f64, f64)> = (0..8)
            .map(|r| {
                let a = 1.0 + r as f64 / 8.0;
                (a, a * 0.99 * if r % 2 == 0 { 1.001 } else { 0.999 })
            })
            .collect();
        let (ratio, i) = paired_ratio(&pairs, 0.95).unwrap();
        assert!((ratio - 0.99).abs() < 1e-3, "{ratio}");
        assert!(i.lo < ratio && ratio < i.hi && i.hi < 1.0, "{i:?}");
        // Noise around no difference: the interval spans 1.
        let noisy = [(1.0, 1.02), (1.0, 0.97), (2.0, 2.03), (2.0, 1.99)];
        let (_, i) = paired_ratio(&noisy, 0.95).unwrap();
        assert!(i.lo < 1.0 && 1.0 < i.hi, "{i:?}");
        assert!(paired_ratio(&[(1.0, 0.0), (0.0, 1.0)], 0.95).is_none());
    }

    #[test]
    fn normal_quantile_matches_the_tables() {
        assert!((normal_quantile(0.975) - 1.959_964).abs() < 1e-5);
        assert!((normal_quantile(0.99) - 2.326_348).abs() < 1e-5);
        assert!((normal_quantile(0.5)).abs() < 1e-12);
        assert!((normal_quantile(0.001) + 3.090_232).abs() < 1e-5);
    }

    #[test]
    fn beta_cdf_matches_closed_forms() {
        // Beta(1, 1) is uniform; Beta(1, b) has CDF 1 - (1-x)^b; Beta(a, 1) has x^a.
        assert!((beta_cdf(0.3, 1.0, 1.0) - 0.3).abs() < 1e-10);
        assert!((beta_cdf(0.2, 1.0, 5.0) - (1.0 - 0.8f64.powi(5))).abs() < 1e-10);
        assert!((beta_cdf(0.7, 3.0, 1.0) - 0.343).abs() < 1e-10);
        // Symmetry: I_x(a, b) = 1 - I_{1-x}(b, a).
        let (a, b, x) = (4.5, 12.0, 0.31);
        assert!((beta_cdf(x, a, b) + beta_cdf(1.0 - x, b, a) - 1.0).abs() < 1e-10);
        // No errors in 100 requests: the rate is below 5% with probability 1 - 0.95^101.
        let p = error_rate_at_most(0.05, 0, 100);
        assert!((p - (1.0 - 0.95f64.powi(101))).abs() < 1e-9, "{p}");
    }

    #[test]
    fn quantile_intervals_are_seeded_cover_the_truth_and_narrow_with_n() {
        let mut rng = StdRng::seed_from_u64(3);
        // Exponential with mean 100: the true median is 100 ln 2 = 69.3.
        let draw = |n: usize, rng: &mut StdRng| -> Vec<f64> {
            (0..n)
                .map(|_| -100.0 * (1.0 - rng.random::<f64>()).ln())
                .collect()
        };
        let small = draw(200, &mut rng);
        let large = draw(5000, &mut rng);
        let s = quantile_intervals(&small, &[0.5, 0.99], RESAMPLES, CONFIDENCE, SEED);
        let again = quantile_intervals(&small, &[0.5, 0.99], RESAMPLES, CONFIDENCE, SEED);
        assert_eq!(s, again, "same seed, same interval");
        let l = quantile_intervals(&large, &[0.5], RESAMPLES, CONFIDENCE, SEED);
        assert!(l[0].lo < 69.3 && 69.3 < l[0].hi, "{:?}", l[0]);
        assert!(l[0].half_width() < s[0].half_width() / 2.0);
        assert!(
            s[1].half_width() > s[0].half_width(),
            "the tail is less sure"
        );
        let d = difference_interval(&small, &small, 0.5, 500, CONFIDENCE, SEED);
        assert!(!d.excludes_zero(), "{d:?}");
        let shifted: Vec<f64> = small.iter().map(|x| x + 50.0).collect();
        let d = difference_interval(&small, &shifted, 0.5, 500, CONFIDENCE, SEED);
        assert!(d.excludes_zero() && d.lo > 20.0 && d.hi < 80.0, "{d:?}");
    }

    #[test]
    fn order_statistics_refuse_a_bound_the_sample_cannot_give() {
        let twelve: Vec<f64> = (1..=12).map(f64::from).collect();
        let i = order_statistic_interval(&twelve, 0.95, 0.95);
        assert!(i.hi.is_infinite() && i.lo.is_finite(), "{i:?}");
        // JSON has no infinity: written as null, read back as the unbounded side.
        let json = serde_json::to_string(&i).unwrap();
        assert!(json.contains("\"hi\":null"), "{json}");
        assert_eq!(serde_json::from_str::<Interval>(&json).unwrap(), i);
        // The bootstrap stops at the largest sample and looks deceptively sure.
        let b = quantile_intervals(&twelve, &[0.95], RESAMPLES, CONFIDENCE, SEED)[0];
        assert!(b.hi <= 12.0);
        // The median of 100: about the 40th to the 60th value.
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        let m = order_statistic_interval(&hundred, 0.5, 0.95);
        assert!(
            (39.0..=42.0).contains(&m.lo) && (59.0..=62.0).contains(&m.hi),
            "{m:?}"
        );
        let p99 =
            order_statistic_interval(&(1..=2000).map(f64::from).collect::<Vec<_>>(), 0.99, 0.95);
        assert!(
            p99.lo < 1980.0 && p99.hi > 1980.0 && p99.hi.is_finite(),
            "{p99:?}"
        );
    }

    #[test]
    fn needed_requests_scale_with_the_square_of_the_width() {
        assert_eq!(needed_for(100, 20.0, 10.0), Some(400));
        assert_eq!(needed_for(100, 5.0, 10.0), Some(25));
        assert_eq!(needed_for(100, 5.0, 0.0), None);
        assert!((samples_beyond(500, 0.99) - 5.0).abs() < 1e-9);
    }
}
