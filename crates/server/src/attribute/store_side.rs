//! The vector store's own view beside the spans (`attribute --prometheus URL`). Qdrant records
//! no traces, but it counts the time it spent on each gRPC call it answered
//! (`grpc_responses_duration_seconds`, per endpoint, on its `/metrics`), and a Prometheus that
//! scrapes it (the compose stack's `qdrant` job) keeps every scrape. For the window the traces
//! cover, this takes the last scrape before the first `retrieval` span began and the first one
//! after the last ended, and sets Qdrant's time for the calls in between beside the time the
//! `retrieval` spans took: the difference is the network, the client and waiting for a
//! connection. It is a window's comparison, not a request's: Qdrant calls that no traced
//! request made in that window (another client, an ingest) count too, and are listed.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{source::get_json, stage_name, SpanRecord};

/// The counters read, per endpoint (`/qdrant.Points/Query`, …).
const SECONDS: &str = "grpc_responses_duration_seconds_sum";
const CALLS: &str = "grpc_responses_duration_seconds_count";
/// The endpoints a retrieval calls: the hybrid search and the entry lookup are queries.
const SEARCH_ENDPOINTS: &[&str] = &["/qdrant.Points/Query", "/qdrant.Points/Search"];

/// One endpoint's calls and time inside the window, summed over every Qdrant peer scraped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointTime {
    pub endpoint: String,
    pub calls: f64,
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoreSide {
    /// The window, in seconds since the epoch: from the scrapes just before the first
    /// retrieval to those just after the last.
    pub from_s: f64,
    pub to_s: f64,
    /// `retrieval` spans in the window and their mean duration (the client side).
    pub retrievals: usize,
    pub retrieval_mean_ms: f64,
    /// Qdrant's own time, by endpoint, busiest first.
    pub endpoints: Vec<EndpointTime>,
    /// Qdrant's time on searches (Query, Search) per retrieval (the server side).
    pub server_ms_per_retrieval: f64,
}

/// Qdrant's time beside the `retrieval` spans; `None` when there are none (the embedded store
/// makes no calls to compare with).
pub async fn measure(prometheus: &str, spans: &[SpanRecord]) -> Result<Option<StoreSide>> {
    let retrievals: Vec<&SpanRecord> = spans
        .iter()
        .filter(|s| stage_name(&s.name) == "retrieval")
        .collect();
    let (Some(first), Some(last)) = (
        retrievals.iter().map(|s| s.start_ns).min(),
        retrievals.iter().map(|s| s.end_ns).max(),
    ) else {
        return Ok(None);
    };
    let (first_s, last_s) = (first as f64 / 1e9, last as f64 / 1e9);
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()?;
    let base = prometheus.trim_end_matches('/');
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    // Every raw sample from a minute before the window to now.
    let range = (now_s - first_s + 60.0).ceil().max(60.0) as u64;
    let query = |q: String| {
        let url = reqwest::Url::parse_with_params(
            &format!("{base}/api/v1/query"),
            &[("query", q), ("time", format!("{now_s:.3}"))],
        );
        let client = client.clone();
        async move {
            let url = url.with_context(|| format!("--prometheus {prometheus}"))?;
            let answer = get_json(&client, url.as_str()).await?;
            Ok::<_, anyhow::Error>(
                answer["data"]["result"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            )
        }
    };
    // Peers scraped (and up) before the window began: a call counter that has no sample from
    // before then did not exist yet (Qdrant adds an endpoint's series at its first call).
    let mut up_before: BTreeMap<String, f64> = BTreeMap::new();
    for s in query(format!("up[{range}s]")).await? {
        let last_up = samples(&s["values"])
            .into_iter()
            .filter(|(t, v)| *t <= first_s && *v == 1.0)
            .map(|(t, _)| t)
            .next_back();
        if let Some(t) = last_up {
            let instance = s["metric"]["instance"].as_str().unwrap_or("").to_string();
            up_before.insert(instance, t);
        }
    }
    let mut by_endpoint: BTreeMap<String, EndpointTime> = BTreeMap::new();
    let from_s = up_before.values().copied().fold(first_s, f64::min);
    let mut to_s = last_s;
    for (metric, is_seconds) in [(SECONDS, true), (CALLS, false)] {
        let series = query(format!(
            "{metric}{{endpoint=~\"/qdrant.Points/.*\"}}[{range}s]"
        ))
        .await?;
        for s in &series {
            let samples = samples(&s["values"]);
            let instance = s["metric"]["instance"].as_str().unwrap_or("");
            let before = match samples.iter().rev().find(|(t, _)| *t <= first_s) {
                Some(&(t, v)) => (t, v),
                None if up_before.contains_key(instance) => (first_s, 0.0),
                None => bail!(
                    "Prometheus at {prometheus} has no scrape of {instance} from before the first \
                     retrieval: was its `qdrant` job scraping every peer then?"
                ),
            };
            let Some(&after) = samples.iter().find(|(t, _)| *t >= last_s) else {
                bail!(
                    "Prometheus at {prometheus} has not scraped {instance} since the last \
                     retrieval ended; run this again after its next scrape"
                );
            };
            if after.1 < before.1 {
                bail!("{metric} went down inside the window: Qdrant at {instance} restarted");
            }
            to_s = to_s.max(after.0);
            let endpoint = s["metric"]["endpoint"].as_str().unwrap_or("?").to_string();
            let entry = by_endpoint.entry(endpoint.clone()).or_insert(EndpointTime {
                endpoint,
                calls: 0.0,
                seconds: 0.0,
            });
            if is_seconds {
                entry.seconds += after.1 - before.1;
            } else {
                entry.calls += after.1 - before.1;
            }
        }
    }
    if by_endpoint.is_empty() {
        bail!(
            "Prometheus at {prometheus} has no {SECONDS} series: is it scraping Qdrant's /metrics \
             (the compose stack's `qdrant` job)?"
        );
    }
    let mut endpoints: Vec<EndpointTime> = by_endpoint
        .into_values()
        .filter(|e| e.calls > 0.0)
        .collect();
    endpoints.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let search_s: f64 = endpoints
        .iter()
        .filter(|e| SEARCH_ENDPOINTS.contains(&e.endpoint.as_str()))
        .map(|e| e.seconds)
        .sum();
    let n = retrievals.len();
    let mean_ms = retrievals
        .iter()
        .map(|s| (s.end_ns - s.start_ns) as f64 / 1e6)
        .sum::<f64>()
        / n as f64;
    Ok(Some(StoreSide {
        from_s,
        to_s,
        retrievals: n,
        retrieval_mean_ms: mean_ms,
        endpoints,
        server_ms_per_retrieval: search_s * 1000.0 / n as f64,
    }))
}

/// `[[unix_seconds, "value"], …]` as numbers, oldest first.
fn samples(values: &Value) -> Vec<(f64, f64)> {
    values
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let t = v[0].as_f64()?;
            let x = v[1].as_str()?.parse().ok()?;
            Some((t, x))
        })
        .collect()
}

pub fn table(side: &StoreSide) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nretrieval, client side and Qdrant's side ({:.1} s between Prometheus's scrapes around the traces)",
        side.to_s - side.from_s
    );
    let _ = writeln!(
        out,
        "  ragscope `retrieval` spans: {} requests, {:.2} ms mean",
        side.retrievals, side.retrieval_mean_ms
    );
    let _ = writeln!(out, "  Qdrant's own time for the calls it answered:");
    for e in &side.endpoints {
        let _ = writeln!(
            out,
            "    {:<28} {:>7.0} calls {:>9.3} ms mean {:>9.3} ms per retrieval",
            e.endpoint,
            e.calls,
            e.seconds * 1000.0 / e.calls,
            e.seconds * 1000.0 / side.retrievals as f64
        );
    }
    let rest = side.retrieval_mean_ms - side.server_ms_per_retrieval;
    let _ = writeln!(
        out,
        "  searching took Qdrant {:.2} ms per retrieval; the other {:.2} ms ({:.0}%) is the network, \
         the client and waiting for a connection",
        side.server_ms_per_retrieval,
        rest,
        100.0 * rest / side.retrieval_mean_ms.max(f64::MIN_POSITIVE)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_read_prometheus_matrix_values() {
        let v = serde_json::json!([[1700000000.5, "1.5"], [1700000001.5, "2"], [1.0, "NaN"]]);
        let s = samples(&v);
        assert_eq!(s[0], (1700000000.5, 1.5));
        assert_eq!(s[1], (1700000001.5, 2.0));
        assert!(s[2].1.is_nan());
    }
}
