//! Two runs against each other (`attribute --baseline`): each stage's change in its median
//! owned time, with a bootstrap interval, and the stage that explains the end-to-end change;
//! and where a stage's cache held a different share in the two runs, that too, so a prefill
//! made fast by the prefix cache is named as a cache effect, not a change in the code.

use measure::confidence::{self, Interval};
use serde::Serialize;

use super::caches::CacheShift;
use super::Report;

/// How one stage changed between two runs.
#[derive(Debug, Clone, Serialize)]
pub struct StageChange {
    pub stage: String,
    pub self_p50_delta_ms: f64,
    pub self_p99_delta_ms: f64,
    pub critical_p50_delta_ms: f64,
    pub critical_p99_delta_ms: f64,
    /// Bootstrap interval of the change of the stage's median owned time (95%, seeded); absent
    /// when either report has no per-request samples (written before they were kept).
    pub critical_p50_interval: Option<Interval>,
    /// The interval excludes zero: the change is more than this stage's own noise.
    pub significant: bool,
    /// The change over the interval's half-width: how far out of its own noise it moved.
    pub signal_to_noise: f64,
    /// The stage's cache held a different share of its lookups in the two runs (at least
    /// [`super::caches::SHIFT`] apart).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheShift>,
}

impl StageChange {
    /// The cache shift that went the way the stage's time went: the likely cause of its change.
    pub fn cache_effect(&self) -> Option<&CacheShift> {
        self.cache.as_ref().filter(|c| c.coincides)
    }
}

/// The comparison of a run against a baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub end_to_end_p50_delta_ms: f64,
    pub end_to_end_p99_delta_ms: f64,
    pub end_to_end_p50_interval: Option<Interval>,
    pub stages: Vec<StageChange>,
    /// The stage whose significant change explains the end-to-end p50 change: among stages
    /// that moved significantly in the end-to-end direction, the one furthest out of its own
    /// noise. None when no stage's change is significant.
    pub explained_by: Option<String>,
    pub explained_share: f64,
    /// The stage with the largest raw p50 move in the end-to-end direction, significant or not
    /// (shown for contrast: on noisy large stages it is often noise).
    pub largest_move: Option<String>,
    /// The stage moving most at p99.
    pub p99_explained_by: Option<String>,
    /// When the stage that explains the change moved with its cache: the significant change
    /// furthest out of its noise among the stages whose caches held the same share in both runs
    /// (in either direction), i.e. what changed besides the caches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apart_from_caches: Option<String>,
    /// False when a report lacks per-request samples: then nothing is judged significant.
    pub samples: bool,
}

/// The change of the median of two samples, as a seeded bootstrap interval.
fn median_change(base: &[f64], run: &[f64], seed: u64) -> Option<Interval> {
    (!base.is_empty() && !run.is_empty()).then(|| {
        confidence::difference_interval(
            base,
            run,
            0.5,
            confidence::RESAMPLES,
            confidence::CONFIDENCE,
            seed,
        )
    })
}

pub fn compare(baseline: &Report, run: &Report) -> Comparison {
    let find = |r: &Report, name: &str| r.stages.iter().find(|s| s.stage == name).cloned();
    let mut names: Vec<String> = run.stages.iter().map(|s| s.stage.clone()).collect();
    for s in &baseline.stages {
        if !names.contains(&s.stage) {
            names.push(s.stage.clone());
        }
    }
    let samples =
        !baseline.end_to_end_samples_ms.is_empty() && !run.end_to_end_samples_ms.is_empty();
    let stages: Vec<StageChange> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let (b, r) = (
                find(baseline, name).unwrap_or_default(),
                find(run, name).unwrap_or_default(),
            );
            let delta = r.critical_ms.p50 - b.critical_ms.p50;
            let interval = if samples {
                median_change(
                    &b.critical_samples_ms,
                    &r.critical_samples_ms,
                    confidence::SEED + i as u64,
                )
            } else {
                None
            };
            StageChange {
                cache: CacheShift::between(b.cache, r.cache, delta),
                stage: name.clone(),
                self_p50_delta_ms: r.self_ms.p50 - b.self_ms.p50,
                self_p99_delta_ms: r.self_ms.p99 - b.self_ms.p99,
                critical_p50_delta_ms: delta,
                critical_p99_delta_ms: r.critical_ms.p99 - b.critical_ms.p99,
                significant: interval.is_some_and(|i| i.excludes_zero()),
                signal_to_noise: interval.map_or(0.0, |i| {
                    if i.half_width() > 0.0 {
                        delta / i.half_width()
                    } else if delta == 0.0 {
                        0.0
                    } else {
                        f64::INFINITY.copysign(delta)
                    }
                }),
                critical_p50_interval: interval,
            }
        })
        .collect();
    let e2e_p50 = run.end_to_end_ms.p50 - baseline.end_to_end_ms.p50;
    let e2e_p99 = run.end_to_end_ms.p99 - baseline.end_to_end_ms.p99;
    // The stage moving most in the direction the end-to-end time moved.
    let pick = |delta: fn(&StageChange) -> f64, total: f64| {
        stages
            .iter()
            .max_by(|a, b| (delta(a) * total.signum()).total_cmp(&(delta(b) * total.signum())))
            .filter(|s| delta(s) * total.signum() > 0.0)
            .map(|s| (s.stage.clone(), delta(s)))
    };
    let largest = pick(|s| s.critical_p50_delta_ms, e2e_p50);
    let significant = stages
        .iter()
        .filter(|s| s.significant && s.critical_p50_delta_ms * e2e_p50.signum() > 0.0)
        .max_by(|a, b| a.signal_to_noise.abs().total_cmp(&b.signal_to_noise.abs()))
        .map(|s| (s.stage.clone(), s.critical_p50_delta_ms));
    // Owned time, not self time: a span waiting alongside the work (`stream`) must not lead.
    let p99 = pick(|s| s.critical_p99_delta_ms, e2e_p99);
    let cache_led = significant.as_ref().is_some_and(|(name, _)| {
        stages
            .iter()
            .any(|s| &s.stage == name && s.cache_effect().is_some())
    });
    let apart_from_caches = cache_led
        .then(|| {
            stages
                .iter()
                .filter(|s| s.significant && s.cache_effect().is_none())
                .max_by(|a, b| a.signal_to_noise.abs().total_cmp(&b.signal_to_noise.abs()))
                .map(|s| s.stage.clone())
        })
        .flatten();
    Comparison {
        end_to_end_p50_delta_ms: e2e_p50,
        end_to_end_p99_delta_ms: e2e_p99,
        end_to_end_p50_interval: median_change(
            &baseline.end_to_end_samples_ms,
            &run.end_to_end_samples_ms,
            confidence::SEED,
        ),
        // A signed share: the end-to-end change may be negative (a faster run).
        explained_share: significant
            .as_ref()
            .filter(|_| e2e_p50 != 0.0)
            .map_or(0.0, |(_, d)| d / e2e_p50),
        explained_by: significant.map(|(s, _)| s),
        largest_move: largest.map(|(s, _)| s),
        p99_explained_by: p99.map(|(s, _)| s),
        apart_from_caches,
        stages,
        samples,
    }
}
