//! How the remote store uses a Qdrant server or cluster: the layout it gives a collection it
//! creates (shards, copies of each), how many copies a write and a read wait for, and how long
//! and how often it tries one call. The defaults are safe on a cluster and harmless on one
//! server: two copies of every shard (one peer's death loses nothing and answers on), a write
//! acknowledged once a copy has applied it (Qdrant sends it to every live copy), reads from any
//! copy, a call given 10 s and tried again twice when the server or a peer did not answer.

use std::time::Duration;

use opentelemetry::KeyValue;
use qdrant_client::qdrant::{
    self as wire, read_consistency, ReadConsistencyType, WriteOrderingType,
};
use telemetry::names::attr;

/// The settings; [`crate::settings::StoreArgs`] holds them as flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    /// Shards of a collection this store creates; `None`: Qdrant's own choice (one per peer).
    pub shards: Option<u32>,
    /// Copies of each shard of a collection this store creates (a single server keeps one).
    pub replication_factor: u32,
    /// Copies that must have applied a write before Qdrant acknowledges it.
    pub write_consistency_factor: u32,
    pub read_consistency: ReadConsistency,
    pub write_ordering: WriteOrdering,
    /// The longest one call may take.
    pub timeout: Duration,
    /// Further tries of a call that found the server or a peer unreachable, after pauses of
    /// 100 ms, 200 ms, …: every call this store makes is idempotent (points have fixed ids).
    pub retries: u32,
}

impl Default for Cluster {
    fn default() -> Cluster {
        Cluster {
            shards: None,
            replication_factor: 2,
            write_consistency_factor: 1,
            read_consistency: ReadConsistency::Factor(1),
            write_ordering: WriteOrdering::Weak,
            timeout: Duration::from_secs(10),
            retries: 2,
        }
    }
}

/// How many copies of a shard a read asks, as Qdrant's `read_consistency` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadConsistency {
    /// This many copies (1: any one, the fastest).
    Factor(u64),
    /// Every copy, and only points present on all of them.
    All,
    /// Every copy, points present on most of them.
    Majority,
    /// Half the copies and one, points present on all of those.
    Quorum,
}

impl ReadConsistency {
    /// `all`, `majority`, `quorum` or a number of copies.
    pub fn parse(s: &str) -> Result<ReadConsistency, String> {
        match s.trim() {
            "all" => Ok(ReadConsistency::All),
            "majority" => Ok(ReadConsistency::Majority),
            "quorum" => Ok(ReadConsistency::Quorum),
            n => n
                .parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .map(ReadConsistency::Factor)
                .ok_or_else(|| format!("{s:?}: give all, majority, quorum or a number of copies")),
        }
    }

    pub fn name(self) -> String {
        match self {
            ReadConsistency::Factor(n) => n.to_string(),
            ReadConsistency::All => "all".into(),
            ReadConsistency::Majority => "majority".into(),
            ReadConsistency::Quorum => "quorum".into(),
        }
    }

    pub(super) fn to_qdrant(self) -> read_consistency::Value {
        match self {
            ReadConsistency::Factor(n) => read_consistency::Value::Factor(n),
            ReadConsistency::All => read_consistency::Value::Type(ReadConsistencyType::All.into()),
            ReadConsistency::Majority => {
                read_consistency::Value::Type(ReadConsistencyType::Majority.into())
            }
            ReadConsistency::Quorum => {
                read_consistency::Value::Type(ReadConsistencyType::Quorum.into())
            }
        }
    }
}

/// Qdrant's write ordering: `weak` (its default, fastest), `medium` (through a dynamically
/// chosen leader) or `strong` (through the permanent leader; unavailable while it is down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WriteOrdering {
    Weak,
    Medium,
    Strong,
}

impl WriteOrdering {
    pub fn name(self) -> &'static str {
        match self {
            WriteOrdering::Weak => "weak",
            WriteOrdering::Medium => "medium",
            WriteOrdering::Strong => "strong",
        }
    }

    pub(super) fn to_qdrant(self) -> wire::WriteOrdering {
        let kind = match self {
            WriteOrdering::Weak => WriteOrderingType::Weak,
            WriteOrdering::Medium => WriteOrderingType::Medium,
            WriteOrdering::Strong => WriteOrderingType::Strong,
        };
        wire::WriteOrdering {
            r#type: kind as i32,
        }
    }
}

impl Cluster {
    /// The settings as attributes of the `retrieval` span: how this request's reads were made.
    pub fn attributes(&self) -> Vec<KeyValue> {
        let mut out = vec![
            KeyValue::new(
                attr::QDRANT_REPLICATION_FACTOR,
                i64::from(self.replication_factor),
            ),
            KeyValue::new(
                attr::QDRANT_WRITE_CONSISTENCY_FACTOR,
                i64::from(self.write_consistency_factor),
            ),
            KeyValue::new(attr::QDRANT_READ_CONSISTENCY, self.read_consistency.name()),
            KeyValue::new(attr::QDRANT_WRITE_ORDERING, self.write_ordering.name()),
            KeyValue::new(attr::QDRANT_TIMEOUT_MS, self.timeout.as_millis() as i64),
            KeyValue::new(attr::QDRANT_RETRIES, i64::from(self.retries)),
        ];
        if let Some(shards) = self.shards {
            out.push(KeyValue::new(attr::QDRANT_SHARDS, i64::from(shards)));
        }
        out
    }

    /// The pause before try `attempt` (1-based): 100 ms, doubling.
    pub(super) fn backoff(attempt: u32) -> Duration {
        Duration::from_millis(100 << (attempt.saturating_sub(1)).min(6))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_consistency_parses_its_names_and_numbers() {
        assert_eq!(ReadConsistency::parse("all"), Ok(ReadConsistency::All));
        assert_eq!(
            ReadConsistency::parse(" 2 "),
            Ok(ReadConsistency::Factor(2))
        );
        assert!(ReadConsistency::parse("0").is_err());
        assert!(ReadConsistency::parse("most").is_err());
        for r in [
            ReadConsistency::Factor(3),
            ReadConsistency::All,
            ReadConsistency::Majority,
            ReadConsistency::Quorum,
        ] {
            assert_eq!(ReadConsistency::parse(&r.name()), Ok(r));
        }
        assert_eq!(Cluster::backoff(1), Duration::from_millis(100));
        assert_eq!(Cluster::backoff(3), Duration::from_millis(400));
    }
}
