//! `report.ipynb`: the report as a Jupyter notebook, for people who analyse in Jupyter. It is
//! plain nbformat 4 JSON written without a kernel: code cells that load the run's own files
//! (`summary.json`, `requests.jsonl`, next to the notebook) with pandas and draw the report's
//! plots with matplotlib (the latency CDF, latency over time, the server's stage timings, the
//! isolation check's CPU split, the knee's steps) and print the percentiles with their
//! intervals, the thin-tail warnings, the isolation flags and the gate's decisions.

use serde_json::{json, Value};

use crate::summary::Summary;

/// A cell's source as nbformat wants it: lines, each but the last ending in a newline.
fn lines(text: &str) -> Value {
    let text = text.trim_matches('\n');
    let parts: Vec<&str> = text.split('\n').collect();
    let n = parts.len();
    Value::Array(
        parts
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Value::String(if i + 1 < n {
                    format!("{l}\n")
                } else {
                    l.to_string()
                })
            })
            .collect(),
    )
}

fn markdown(id: &str, text: &str) -> Value {
    json!({"cell_type": "markdown", "id": id, "metadata": {}, "source": lines(text)})
}

fn code(id: &str, text: &str) -> Value {
    json!({
        "cell_type": "code",
        "id": id,
        "metadata": {},
        "execution_count": null,
        "outputs": [],
        "source": lines(text)
    })
}

const LOAD: &str = r#"
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

# The run's files sit next to this notebook; set RUN to read another output directory.
RUN = Path(".")
summary = json.loads((RUN / "summary.json").read_text())
requests = pd.read_json(RUN / "requests.jsonl", lines=True)
steady = requests[(requests["phase"] == "steady") & requests["ok"]]
print(f"{len(requests)} requests, {len(steady)} successful in the steady phase")
"#;

const PERCENTILES: &str = r#"
# Every percentile with its 95% bootstrap interval (1000 resamples, seeded) and the sample count.
rows = []
for name, key in [("TTFT", "ttft_ms"), ("time per output token", "tpot_ms"), ("end to end", "e2e_ms")]:
    p = (summary.get("steady") or {}).get(key)
    if not p:
        continue
    for q in ["p50", "p90", "p95", "p99", "p99.9"]:
        ci = p.get("ci", {}).get(q, {})
        beyond = p["count"] * (1 - {"p50": .5, "p90": .9, "p95": .95, "p99": .99, "p99.9": .999}[q])
        rows.append({"metric": name, "percentile": q, "ms": p[q], "ci_lo": ci.get("lo"),
                     "ci_hi": ci.get("hi"), "count": p["count"],
                     "warning": "too few samples beyond it" if q in ("p99", "p99.9") and beyond < 10 else ""})
pd.DataFrame(rows)
"#;

const CDF: &str = r#"
fig, ax = plt.subplots(figsize=(8, 4))
for col, label in [("ttft_ms", "TTFT"), ("e2e_ms", "end to end")]:
    v = steady[col].dropna().sort_values()
    if len(v):
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)
ax.set_xlabel("ms"); ax.set_ylabel("fraction of requests"); ax.set_title("Latency distribution (steady phase)")
ax.legend(); plt.show()
"#;

const OVER_TIME: &str = r#"
fig, ax = plt.subplots(figsize=(8, 4))
for phase, group in requests[requests["ok"]].groupby("phase"):
    ax.scatter(group["sent_s"], group["ttft_ms"], s=8, label=f"TTFT ({phase})")
failed = requests[~requests["ok"]]
if len(failed):
    ax.scatter(failed["sent_s"], [0] * len(failed), marker="x", color="red", label="failed")
ax.set_xlabel("seconds since start"); ax.set_ylabel("ms"); ax.set_title("Latency over time")
ax.legend(); plt.show()
"#;

const STAGES: &str = r#"
# The server's own per-stage timings from each `done` event.
if "server_timings" in steady and steady["server_timings"].notna().any():
    stages = pd.DataFrame(list(steady["server_timings"].dropna()))
    stages = stages.drop(columns=[c for c in ("ttft_ms", "total_ms") if c in stages])
    stages.boxplot(figsize=(9, 4), rot=30)
    plt.ylabel("ms"); plt.title("Server stage timings (steady phase)"); plt.show()
    display(stages.describe(percentiles=[.5, .95, .99]).T)
else:
    print("no server timings in this run")
"#;

const ISOLATION: &str = r#"
# Who else used the CPU during the run: client, server, other processes, steal (shares of the box).
iso = summary.get("isolation")
if iso:
    for flag in iso["flags"]:
        print("FLAG:", flag)
    print(f"{iso['cpus']} CPUs; client {iso['client_share']:.1%}, others {iso['others_share']:.1%}, "
          f"steal {iso['steal_share']:.1%}; server cores {iso.get('server_cores')}")
    samples = pd.DataFrame(iso["samples"])
    if len(samples):
        ax = (samples.set_index("t_s")[["client", "server", "others", "steal"]] * 100).plot(figsize=(8, 4))
        ax.axhline(iso["threshold"] * 100, color="grey", linestyle="--", label="threshold")
        ax.set_ylabel("% of the box"); ax.set_title("CPU share over the run"); plt.show()
    display(pd.DataFrame(iso["neighbours"]))
else:
    print("no isolation check in this run")
"#;

const GATE: &str = r#"
# The gate's decisions: a row decides only when its whole interval is on one side of the limit.
pd.DataFrame(summary["gate"])
"#;

const KNEE: &str = r#"
steps = pd.DataFrame(summary["steps"])
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
a.plot(steps["offered_rps"], steps["ttft_p95_ms"], marker="o", label="TTFT p95")
a.set_xlabel("offered requests/s"); a.set_ylabel("ms"); a.set_title("Latency vs offered load"); a.legend()
b.plot(steps["offered_rps"], steps["achieved_rps"], marker="o", label="achieved")
b.plot(steps["offered_rps"], steps["offered_rps"], linestyle="--", label="offered")
b.set_xlabel("offered requests/s"); b.set_ylabel("requests/s"); b.set_title("Throughput vs offered load"); b.legend()
plt.show()
summary.get("knee")
"#;

/// The notebook of a run's output directory.
pub fn render(summary: &Summary) -> String {
    let mut cells = vec![
        markdown(
            "title",
            &format!(
                "# ragscope-loadgen {}\n\nThe run's `summary.json` and `requests.jsonl`, loaded and plotted. \
                 Percentiles carry 95% bootstrap intervals; the isolation check says whether the server had the box.",
                summary.command
            ),
        ),
        code("load", LOAD),
        code("percentiles", PERCENTILES),
        code("cdf", CDF),
        code("over-time", OVER_TIME),
        code("stages", STAGES),
        code("isolation", ISOLATION),
    ];
    if summary.gate.is_some() {
        cells.push(code("gate", GATE));
    }
    if !summary.steps.is_empty() {
        cells.push(code("knee", KNEE));
    }
    let nb = json!({
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"}
        },
        "cells": cells
    });
    serde_json::to_string_pretty(&nb).unwrap_or_default() + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_nbformat_4_with_ids_and_line_lists() {
        let summary: Summary = serde_json::from_value(json!({
            "tool": "ragscope-loadgen", "command": "gate", "config": {}, "started_unix_ms": 0,
            "requests_by_phase": {}, "gate": []
        }))
        .unwrap();
        let nb: Value = serde_json::from_str(&render(&summary)).unwrap();
        assert_eq!(nb["nbformat"], 4);
        let cells = nb["cells"].as_array().unwrap();
        assert!(cells.iter().any(|c| c["id"] == "gate"));
        assert!(!cells.iter().any(|c| c["id"] == "knee"));
        let load = cells.iter().find(|c| c["id"] == "load").unwrap();
        let src = load["source"].as_array().unwrap();
        assert!(src[0].as_str().unwrap().ends_with('\n'));
        assert!(!src.last().unwrap().as_str().unwrap().ends_with('\n'));
        assert!(src
            .iter()
            .any(|l| l.as_str().unwrap().contains("requests.jsonl")));
    }
}
