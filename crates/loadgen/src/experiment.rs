//! `experiment tails`: why a P99 cannot be guessed from a mean. The same mean delay is injected
//! into one stage twice, once exponential and once Pareto(α=1.5) (the heavy tail latencies
//! often have), and the stage's measured P99 (with its interval) is set against what a normal
//! (mean + 2.33 sd) and an exponential (shifted, from the mean) assumption predict from the
//! same samples. On the Pareto run both assumptions land far from the measured P99.

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::cli::{Mode, RunArgs, Shape, TailsArgs};
use crate::record::RequestRecord;
use crate::schedule::Phase;
use measure::confidence::{self, Interval};
use measure::stats::percentile;

/// The P99 one assumption predicts from a sample's mean, spread and minimum.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Prediction {
    pub assumption: String,
    pub p99_ms: f64,
    /// (predicted - measured) / measured.
    pub error: f64,
    /// Whether the prediction falls inside the measured P99's interval.
    pub within_interval: bool,
}

/// What one distribution's run measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Arm {
    pub distribution: String,
    /// The fault plan sent with every request.
    pub plan: serde_json::Value,
    pub samples: usize,
    pub mean_ms: f64,
    pub sd_ms: f64,
    pub p99_ms: f64,
    /// Bootstrap interval of the P99 (95%, seeded), widened to the order-statistic interval.
    pub p99_interval: Interval,
    /// Samples beyond the P99: under 10, the P99 is close to the largest few values.
    pub beyond_p99: f64,
    /// The true P99 of the injected delay alone (closed form), for reference.
    pub injected_p99_ms: f64,
    pub predictions: Vec<Prediction>,
}

/// z of the 99th percentile of the standard normal.
const Z99: f64 = 2.326_347_874;

/// The measured P99 of `values` with its interval, and the normal and exponential predictions.
pub fn analyse(
    distribution: &str,
    plan: serde_json::Value,
    values: &[f64],
    injected_p99_ms: f64,
) -> Arm {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let mean = v.iter().sum::<f64>() / n.max(1) as f64;
    let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64).sqrt();
    let p99 = percentile(&v, 0.99);
    let boot = confidence::quantile_intervals(
        &v,
        &[0.99],
        confidence::RESAMPLES,
        confidence::CONFIDENCE,
        confidence::SEED,
    )[0];
    let order = confidence::order_statistic_interval(&v, 0.99, confidence::CONFIDENCE);
    let interval = Interval {
        lo: boot.lo.min(order.lo),
        hi: boot.hi.max(order.hi),
    };
    let min = v.first().copied().unwrap_or(0.0);
    let predict = |assumption: &str, p: f64| Prediction {
        assumption: assumption.into(),
        p99_ms: p,
        error: (p - p99) / p99,
        within_interval: p >= interval.lo && p <= interval.hi,
    };
    Arm {
        distribution: distribution.into(),
        plan,
        samples: n,
        mean_ms: mean,
        sd_ms: sd,
        p99_ms: p99,
        p99_interval: interval,
        beyond_p99: confidence::samples_beyond(n, 0.99),
        injected_p99_ms,
        predictions: vec![
            predict("normal: mean + 2.33 sd", mean + Z99 * sd),
            predict(
                "exponential: min + (mean - min) ln 100",
                min + (mean - min) * 100f64.ln(),
            ),
        ],
    }
}

/// The stage's `done` timing key.
fn timing_key(stage: &str) -> &'static str {
    match stage {
        "embeddings" => "embed_ms",
        "rerank" => "rerank_ms",
        "prompt" => "prompt_ms",
        _ => "retrieve_ms",
    }
}

/// The stage's own time per successful steady request, from the server's `done` timings.
pub fn stage_times(records: &[RequestRecord], stage: &str) -> Vec<f64> {
    let key = timing_key(stage);
    records
        .iter()
        .filter(|r| r.ok && r.phase == Phase::Steady)
        .filter_map(|r| r.server_timings.as_ref()?.get(key).copied())
        .collect()
}

/// The two plans: exponential with mean m, Pareto(α=1.5) with scale m/3 (its mean is
/// scale·α/(α-1) = m), and each one's true P99.
pub fn plans(stage: &str, mean_ms: f64) -> [(&'static str, serde_json::Value, f64); 2] {
    let scale = mean_ms / 3.0;
    [
        (
            "exponential",
            json!({stage: {"delay": {"dist": "exponential", "mean_ms": mean_ms}}}),
            mean_ms * 100f64.ln(),
        ),
        (
            "pareto",
            json!({stage: {"delay": {"dist": "pareto", "scale_ms": scale, "shape": 1.5}}}),
            scale * 100f64.powf(1.0 / 1.5),
        ),
    ]
}

/// The `run` arguments of one arm.
pub fn arm_args(a: &TailsArgs, plan: &serde_json::Value, name: &str) -> RunArgs {
    let mut target = a.target.clone();
    target.fault = Some(plan.to_string());
    RunArgs {
        target,
        shape: Shape {
            mode: Mode::Closed,
            rate: 1.0,
            burst_rate: 0.0,
            burst_size: 0,
            users: a.users,
            think_ms: 0.0,
            warmup: 0.0,
            duration: 24.0 * 3600.0,
            cooldown: 0.0,
            requests: Some(a.requests),
        },
        isolation: a.isolation.clone(),
        out: a.out.join(name),
        attribution: None,
        replay: None,
        quiet: a.quiet,
    }
}

/// The experiment's table.
pub fn table(arms: &[Arm]) -> String {
    let mut s = format!(
        "{:<12} {:>7} {:>9} {:>9} {:>10} {:>22} {:>12}  predictions (error vs measured)\n",
        "delay", "samples", "mean ms", "sd ms", "P99 ms", "95% interval", "injected P99"
    );
    for a in arms {
        let preds: Vec<String> = a
            .predictions
            .iter()
            .map(|p| {
                format!(
                    "{} → {:.1} ms ({:+.0}%{})",
                    p.assumption,
                    p.p99_ms,
                    p.error * 100.0,
                    if p.within_interval {
                        ", inside"
                    } else {
                        ", OUTSIDE the interval"
                    }
                )
            })
            .collect();
        s.push_str(&format!(
            "{:<12} {:>7} {:>9.1} {:>9.1} {:>10.1} {:>22} {:>12.1}  {}\n",
            a.distribution,
            a.samples,
            a.mean_ms,
            a.sd_ms,
            a.p99_ms,
            format!("[{:.1}, {:.1}]", a.p99_interval.lo, a.p99_interval.hi),
            a.injected_p99_ms,
            preds.join("; ")
        ));
        if a.beyond_p99 < confidence::MIN_TAIL_SAMPLES {
            s.push_str(&format!(
                "  ({} P99 rests on {:.1} samples beyond it: too few; the interval says how unsure it is)\n",
                a.distribution, a.beyond_p99
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn light_tailed_assumptions_miss_a_pareto_p99_but_fit_an_exponential_one() {
        let mut rng = StdRng::seed_from_u64(11);
        let mut u = || 1.0 - rng.random::<f64>();
        let mean = 100.0;
        // 20 000 draws: a P99 resting on 200 samples, so the interval is tight.
        let exp: Vec<f64> = (0..20_000).map(|_| -mean * u().ln()).collect();
        let scale = mean / 3.0;
        let pareto: Vec<f64> = (0..20_000).map(|_| scale / u().powf(1.0 / 1.5)).collect();
        let [(_, pe, e99), (_, pp, p99)] = plans("retrieval", mean);
        let e = analyse("exponential", pe, &exp, e99);
        let p = analyse("pareto", pp, &pareto, p99);
        // The measured P99s sit on the closed forms: 460.5 and 718.0 ms.
        assert!(e.p99_interval.lo < e99 && e99 < e.p99_interval.hi, "{e:?}");
        assert!(p.p99_interval.lo < p99 && p99 < p.p99_interval.hi, "{p:?}");
        // Exponential data: the exponential assumption is right, the normal one 25%+ low.
        assert!(e.predictions[1].error.abs() < 0.05, "{e:?}");
        assert!(e.predictions[0].error < -0.2, "{e:?}");
        // Pareto data of the same mean: the exponential assumption predicts about half.
        assert!(p.predictions[1].error < -0.35, "{p:?}");
        assert!(!p.predictions[1].within_interval);
        let t = table(&[e, p]);
        assert!(t.contains("OUTSIDE"), "{t}");
    }
}
