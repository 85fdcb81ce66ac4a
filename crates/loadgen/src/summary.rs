//! `summary.json`: what one command ran with and what it found. It sits above the statistics,
//! the knee finder and the gate, which it gathers; none of them depends on it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::caches::CacheReport;
use crate::gate::Row;
use crate::isolation::Isolation;
use crate::knee::{Knee, StepResult};
use crate::record::RequestRecord;
use crate::schedule::Phases;
use crate::shadow::ShadowReport;
use crate::stats::PhaseStats;

/// `summary.json`: the configuration, the steady-phase figures, and the knee or gate outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub tool: String,
    /// `run`, `knee` or `gate`.
    pub command: String,
    /// The flags the command ran with.
    pub config: serde_json::Value,
    pub started_unix_ms: u64,
    /// Phase lengths of a `run` or `gate` (the report shades them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<Phases>,
    /// Requests per phase, all phases.
    pub requests_by_phase: BTreeMap<String, u64>,
    /// The steady phase: the only one the figures count. Absent for `knee` (see `steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steady: Option<PhaseStats>,
    /// Knee finder: one entry per step, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knee: Option<Knee>,
    /// Who else used the CPU during the run (absent where `/proc` is unreadable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
    /// Gate: the compared metrics and the verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<Vec<Row>>,
    /// Steady phase: per-cache hit rates and TTFT by hit and miss, and by query kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caches: Option<CacheReport>,
    /// `--shadow`: the mirrored server against the primary, stage by stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowReport>,
}

impl Summary {
    pub fn count_phases(records: &[RequestRecord]) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for r in records {
            let key = serde_json::to_value(r.phase)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            *m.entry(key).or_insert(0) += 1;
        }
        m
    }
}
