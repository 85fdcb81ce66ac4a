//! Percentiles with bootstrap intervals: the one percentile of the workspace (the load
//! generator's summaries, `ragscope attribute` and the lab's tables all use it).

use serde::{Deserialize, Serialize};

use crate::confidence::{self, Interval};

/// The `q` quantile (0..=1) of sorted values, interpolating linearly between closest ranks;
/// NaN for no values, so that an empty set reads as "no figure" rather than a zero.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    #[serde(rename = "p99.9")]
    pub p99_9: f64,
    pub max: f64,
    /// Bootstrap intervals of the percentiles ([`confidence::CONFIDENCE`], seeded).
    #[serde(default)]
    pub ci: PercentileIntervals,
}

/// The confidence interval of each percentile of a [`Percentiles`].
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct PercentileIntervals {
    pub p50: Interval,
    pub p90: Interval,
    pub p95: Interval,
    pub p99: Interval,
    #[serde(rename = "p99.9")]
    pub p99_9: Interval,
}

/// The tail percentiles a summary checks for thin support.
pub const TAILS: [(&str, f64); 2] = [("p99", 0.99), ("p99.9", 0.999)];

impl Percentiles {
    /// The tail percentiles (`p99`, `p99.9`) resting on fewer than
    /// [`confidence::MIN_TAIL_SAMPLES`] samples beyond them, with that number.
    pub fn thin_tails(&self) -> Vec<(&'static str, f64)> {
        TAILS
            .iter()
            .map(|&(name, q)| (name, confidence::samples_beyond(self.count, q)))
            .filter(|&(_, beyond)| beyond < confidence::MIN_TAIL_SAMPLES)
            .collect()
    }

    /// `None` for no values; NaNs are ignored.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Percentiles> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let qs = [0.50, 0.90, 0.95, 0.99, 0.999];
        let ci = confidence::quantile_intervals(
            &v,
            &qs,
            confidence::RESAMPLES,
            confidence::CONFIDENCE,
            confidence::SEED,
        );
        Some(Percentiles {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 0.50),
            p90: percentile(&v, 0.90),
            p95: percentile(&v, 0.95),
            p99: percentile(&v, 0.99),
            p99_9: percentile(&v, 0.999),
            max: v[v.len() - 1],
            ci: PercentileIntervals {
                p50: ci[0],
                p90: ci[1],
                p95: ci[2],
                p99: ci[3],
                p99_9: ci[4],
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert!((percentile(&v, 0.5) - 50.5).abs() < 1e-9);
        assert!((percentile(&v, 0.95) - 95.05).abs() < 1e-9);
        assert!((percentile(&v, 0.99) - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&[7.0], 0.999), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
        let p = Percentiles::of([3.0, 1.0, 2.0, f64::NAN]).unwrap();
        assert_eq!(p.count, 3);
        assert_eq!(p.p50, 2.0);
        assert_eq!(p.mean, 2.0);
        assert_eq!(p.max, 3.0);
        assert!(p.p99_9 <= 3.0 && p.p99_9 > 2.99);
        assert!(Percentiles::of([]).is_none());
        let json = serde_json::to_value(p).unwrap();
        assert!(json.get("p99.9").is_some());
        assert!(json["ci"].get("p99.9").is_some());
        // Three samples: the median's interval spans them, and both tails are thin.
        assert!(p.ci.p50.lo >= 1.0 && p.ci.p50.hi <= 3.0 && p.ci.p50.lo < p.ci.p50.hi);
        assert_eq!(p.thin_tails().len(), 2);
        let many = Percentiles::of((0..2000).map(f64::from)).unwrap();
        let thin = many.thin_tails();
        assert_eq!(thin.len(), 1);
        assert_eq!(thin[0].0, "p99.9");
        assert!((thin[0].1 - 2.0).abs() < 1e-9);
        assert!(many.ci.p99.lo < many.p99 && many.p99 < many.ci.p99.hi);
    }
}
