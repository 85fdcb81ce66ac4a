//! The CPU samples as the OTLP profiles signal: a [`Tee`] wraps the pprof backend, so whoever
//! drives the sampler (the Pyroscope agent, or our own timer when no Pyroscope is set) hands
//! each interval's reports to a bounded queue as well, and one thread converts them to
//! `ExportProfilesServiceRequest`s and sends them over gRPC. A sample's stage labels become a
//! link to its trace and span, and attributes.
//!
//! The signal is alpha (proto package `v1development`): this speaks the proto of
//! `opentelemetry-proto` 0.31 (OTLP 1.8.0), and a receiver must speak the same one.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_proto::tonic::collector::profiles::v1development::profiles_service_client::ProfilesServiceClient;
use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope};
use opentelemetry_proto::tonic::profiles::v1development::{
    AggregationTemporality, Function, KeyValueAndUnit, Line, Link, Location, Mapping, Profile,
    ProfilesDictionary, ResourceProfiles, Sample, ScopeProfiles, Stack, ValueType,
};
use opentelemetry_proto::tonic::resource::v1::Resource as ProtoResource;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_sdk::Resource;
use pyroscope::backend::{Backend, ReportBatch, ReportData, Tag, ThreadTag};
use pyroscope::backend::{Report, StackFrame};

use crate::export::ExportStats;

/// Intervals waiting for the export thread; past this the newest is dropped (and counted).
const QUEUE: usize = 4;
/// How long one export may take, connecting included.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

static STATS: OnceLock<Arc<ExportStats>> = OnceLock::new();

/// What happened to OTLP profiles in this process: one profile per upload interval, exported,
/// dropped because the queue was full, or dropped because the export failed.
pub fn stats() -> Arc<ExportStats> {
    STATS.get_or_init(Default::default).clone()
}

/// One upload interval's samples.
struct Interval {
    reports: Vec<Report>,
    from: SystemTime,
    until: SystemTime,
}

/// The sending end of the export thread's queue: never blocks, counts what it drops.
struct Queue {
    tx: SyncSender<Interval>,
    stats: Arc<ExportStats>,
}

impl Queue {
    fn offer(&self, interval: Interval) {
        if interval.reports.is_empty() {
            return;
        }
        match self.tx.try_send(interval) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.stats.queue_full("profile"),
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

/// The OTLP profiles export thread; join it after the sampler stopped to send the last
/// interval.
pub(crate) struct Exporter {
    thread: JoinHandle<()>,
}

impl Exporter {
    /// Waits until every queued interval was sent or given up on (the [`Tee`] holding the
    /// queue must be gone).
    pub(crate) fn join(self) {
        let _ = self.thread.join();
    }
}

/// Starts the export thread to `endpoint` and wraps `inner` in a [`Tee`] that feeds it.
/// `keep_for_agent`: whether the caller uploads what `report` returns (the Pyroscope agent).
pub(crate) fn tee(
    inner: Box<dyn Backend>,
    endpoint: &str,
    resource: Resource,
    sample_rate: u32,
    keep_for_agent: bool,
) -> Result<(Tee, Exporter)> {
    let endpoint = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .with_context(|| format!("OTLP profiles endpoint {endpoint:?}"))?
        .connect_timeout(EXPORT_TIMEOUT)
        .timeout(EXPORT_TIMEOUT);
    let (tx, rx) = sync_channel(QUEUE);
    let stats = stats();
    let thread_stats = stats.clone();
    let thread = std::thread::Builder::new()
        .name("profile-export".into())
        .spawn(move || export_loop(endpoint, rx, resource, sample_rate, &thread_stats))
        .context("spawning the OTLP profiles export thread")?;
    let tee = Tee {
        inner,
        queue: Queue { tx, stats },
        keep_for_agent,
        last: SystemTime::now(),
    };
    Ok((tee, Exporter { thread }))
}

fn export_loop(
    endpoint: tonic::transport::Endpoint,
    rx: Receiver<Interval>,
    resource: Resource,
    sample_rate: u32,
    stats: &ExportStats,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::warn!("OTLP profiles stay local: no runtime for the exporter ({e})");
            return;
        }
    };
    let mut client = {
        let _entered = runtime.enter();
        ProfilesServiceClient::new(endpoint.connect_lazy())
    };
    let resource = ResourceAttributesWithSchema::from(&resource);
    let resource = ProtoResource {
        attributes: resource.attributes.0,
        ..Default::default()
    };
    while let Ok(interval) = rx.recv() {
        let request = export_request(&interval, resource.clone(), sample_rate);
        match runtime.block_on(client.export(request)) {
            Ok(response) => {
                let rejected = response
                    .into_inner()
                    .partial_success
                    .map_or(0, |p| p.rejected_profiles);
                if rejected > 0 {
                    stats.export_failed(rejected as u64, "profile", "the receiver rejected them");
                } else {
                    stats.exported.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(status) => stats.export_failed(
                1,
                "profile",
                format_args!("{}: {}", status.code(), status.message()),
            ),
        }
    }
}

/// A [`Backend`] that passes everything to the pprof backend and hands a copy of each
/// interval's reports to the OTLP export queue: the same samples, two ways out.
pub(crate) struct Tee {
    inner: Box<dyn Backend>,
    queue: Queue,
    keep_for_agent: bool,
    /// The end of the previous interval.
    last: SystemTime,
}

impl Backend for Tee {
    fn initialize(&mut self) -> pyroscope::Result<()> {
        self.last = SystemTime::now();
        self.inner.initialize()
    }

    fn shutdown(self: Box<Self>) -> pyroscope::Result<()> {
        // Dropping the queue's sender lets the export thread finish once it is drained.
        self.inner.shutdown()
    }

    fn report(&mut self) -> pyroscope::Result<ReportBatch> {
        let mut batch = self.inner.report()?;
        let until = SystemTime::now();
        let from = std::mem::replace(&mut self.last, until);
        if let ReportData::Reports(reports) = &mut batch.data {
            let reports = if self.keep_for_agent {
                reports.clone()
            } else {
                std::mem::take(reports)
            };
            self.queue.offer(Interval {
                reports,
                from,
                until,
            });
        }
        Ok(batch)
    }

    fn add_tag(&self, tag: ThreadTag) -> pyroscope::Result<()> {
        self.inner.add_tag(tag)
    }

    fn remove_tag(&self, tag: ThreadTag) -> pyroscope::Result<()> {
        self.inner.remove_tag(tag)
    }
}

/// Interns values into a dictionary table whose entry 0 is the zero value.
struct Table<K, V> {
    index: HashMap<K, i32>,
    values: Vec<V>,
}

impl<K: std::hash::Hash + Eq, V: Default> Table<K, V> {
    fn new() -> Self {
        Table {
            index: HashMap::new(),
            values: vec![V::default()],
        }
    }

    fn intern(&mut self, key: K, value: impl FnOnce() -> V) -> i32 {
        if let Some(i) = self.index.get(&key) {
            return *i;
        }
        let i = self.values.len() as i32;
        self.values.push(value());
        self.index.insert(key, i);
        i
    }
}

/// The dictionary one request's profiles point into.
struct Dictionary {
    strings: Table<String, String>,
    functions: Table<Function, Function>,
    locations: Table<(i32, i64), Location>,
    stacks: Table<Vec<i32>, Stack>,
    links: Table<Link, Link>,
    attributes: Table<(i32, String), KeyValueAndUnit>,
}

impl Dictionary {
    fn new() -> Self {
        Dictionary {
            strings: Table::new(),
            functions: Table::new(),
            locations: Table::new(),
            stacks: Table::new(),
            links: Table::new(),
            attributes: Table::new(),
        }
    }

    fn string(&mut self, s: &str) -> i32 {
        if s.is_empty() {
            return 0;
        }
        self.strings.intern(s.to_string(), || s.to_string())
    }

    fn location(&mut self, frame: &StackFrame) -> i32 {
        let function = Function {
            name_strindex: self.string(frame.name.as_deref().unwrap_or_default()),
            system_name_strindex: 0,
            filename_strindex: self.string(frame.filename.as_deref().unwrap_or_default()),
            start_line: 0,
        };
        let function_index = self.functions.intern(function, || function);
        let line = frame.line.map_or(0, i64::from);
        self.locations.intern((function_index, line), || Location {
            line: vec![Line {
                function_index,
                line,
                column: 0,
            }],
            ..Default::default()
        })
    }

    /// Frames leaf first, as pprof-rs records them and as `Stack` wants them.
    fn stack(&mut self, frames: &[StackFrame]) -> i32 {
        let locations: Vec<i32> = frames.iter().map(|f| self.location(f)).collect();
        self.stacks.intern(locations.clone(), || Stack {
            location_indices: locations,
        })
    }

    /// The link a sample's labels name: one `trace_id` and one `span_id`, in hex. Samples of
    /// two concurrent stages (the shared compute pool) carry two of each and get none.
    fn link(&mut self, tags: &BTreeSet<&Tag>) -> i32 {
        let one = |key: &str| {
            let mut values = tags.iter().filter(|t| t.key == key).map(|t| &t.value);
            match (values.next(), values.next()) {
                (Some(v), None) => Some(v.as_str()),
                _ => None,
            }
        };
        let (Some(trace), Some(span)) = (one("trace_id"), one("span_id")) else {
            return 0;
        };
        let (Ok(trace), Ok(span)) = (TraceId::from_hex(trace), SpanId::from_hex(span)) else {
            return 0;
        };
        let link = Link {
            trace_id: trace.to_bytes().to_vec(),
            span_id: span.to_bytes().to_vec(),
        };
        self.links.intern(link.clone(), || link)
    }

    /// Every label but the ids (which the link carries) as a string attribute.
    fn attributes(&mut self, tags: &BTreeSet<&Tag>) -> Vec<i32> {
        tags.iter()
            .filter(|t| t.key != "trace_id" && t.key != "span_id")
            .map(|t| {
                let key_strindex = self.string(&t.key);
                self.attributes
                    .intern((key_strindex, t.value.clone()), || KeyValueAndUnit {
                        key_strindex,
                        value: Some(AnyValue {
                            value: Some(any_value::Value::StringValue(t.value.clone())),
                        }),
                        unit_strindex: 0,
                    })
            })
            .collect()
    }

    fn into_proto(self) -> ProfilesDictionary {
        ProfilesDictionary {
            mapping_table: vec![Mapping::default()],
            location_table: self.locations.values,
            function_table: self.functions.values,
            link_table: self.links.values,
            string_table: self.strings.values,
            attribute_table: self.attributes.values,
            stack_table: self.stacks.values,
        }
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One interval as one CPU profile: a sample per stack and label set, its value the sampled
/// CPU time (count × the sampling period).
fn export_request(
    interval: &Interval,
    resource: ProtoResource,
    sample_rate: u32,
) -> ExportProfilesServiceRequest {
    let mut dict = Dictionary::new();
    let period = 1_000_000_000 / i64::from(sample_rate.max(1));
    let cpu = ValueType {
        type_strindex: dict.string("cpu"),
        unit_strindex: dict.string("nanoseconds"),
        aggregation_temporality: AggregationTemporality::Delta as i32,
    };
    let mut samples = Vec::new();
    for report in &interval.reports {
        for (trace, count) in report.iter() {
            let tags: BTreeSet<&Tag> = trace
                .metadata
                .tags
                .iter()
                .chain(&report.metadata.tags)
                .collect();
            samples.push(Sample {
                stack_index: dict.stack(&trace.frames),
                values: vec![*count as i64 * period],
                attribute_indices: dict.attributes(&tags),
                link_index: dict.link(&tags),
                timestamps_unix_nano: Vec::new(),
            });
        }
    }
    let from = unix_nanos(interval.from);
    let profile = Profile {
        sample_type: Some(cpu),
        sample: samples,
        time_unix_nano: from,
        duration_nano: unix_nanos(interval.until).saturating_sub(from),
        period_type: Some(cpu),
        period,
        ..Default::default()
    };
    ExportProfilesServiceRequest {
        resource_profiles: vec![ResourceProfiles {
            resource: Some(resource),
            scope_profiles: vec![ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: crate::span::SCOPE.into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                profiles: vec![profile],
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
        dictionary: Some(dict.into_proto()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyroscope::backend::{Metadata, StackTrace};

    fn frame(name: &str, line: u32) -> StackFrame {
        StackFrame::new(
            None,
            Some(name.into()),
            Some("lib.rs".into()),
            None,
            None,
            Some(line),
        )
    }

    fn report(frames: Vec<StackFrame>, tags: &[(&str, &str)], count: usize) -> Report {
        let mut metadata = Metadata::default();
        for (k, v) in tags {
            metadata.add_tag(Tag::new(k.to_string(), v.to_string()));
        }
        let trace = StackTrace {
            frames,
            metadata: metadata.clone(),
            ..Default::default()
        };
        Report::new(HashMap::from([(trace, count)])).metadata(metadata)
    }

    #[test]
    fn labelled_samples_link_to_their_span_and_keep_their_frames() {
        let trace_id = "0af7651916cd43dd8448eb211c80319c";
        let span_id = "b7ad6b7169203331";
        let leaf = frame("candle_core::cpu::matmul", 10);
        let root = frame("main", 1);
        let interval = Interval {
            reports: vec![
                report(
                    vec![leaf.clone(), root.clone()],
                    &[
                        ("span_id", span_id),
                        ("trace_id", trace_id),
                        ("span_name", "chat qwen"),
                    ],
                    3,
                ),
                report(vec![root.clone()], &[], 2),
                // Two concurrent stages' labels: no link.
                report(
                    vec![leaf],
                    &[
                        ("span_id", span_id),
                        ("span_id", "00f067aa0ba902b7"),
                        ("trace_id", trace_id),
                    ],
                    1,
                ),
            ],
            from: UNIX_EPOCH + Duration::from_secs(100),
            until: UNIX_EPOCH + Duration::from_secs(110),
        };
        let request = export_request(&interval, ProtoResource::default(), 100);
        let dict = request.dictionary.unwrap();
        // Shared frames are one location each, after the zero location.
        assert_eq!(dict.location_table.len(), 3);
        assert_eq!(dict.link_table.len(), 2);
        let profile = &request.resource_profiles[0].scope_profiles[0].profiles[0];
        assert_eq!(profile.period, 10_000_000);
        assert_eq!(profile.time_unix_nano, 100_000_000_000);
        assert_eq!(profile.duration_nano, 10_000_000_000);
        let s = |i: i32| dict.string_table[i as usize].as_str();
        let cpu = profile.sample_type.unwrap();
        assert_eq!(
            (s(cpu.type_strindex), s(cpu.unit_strindex)),
            ("cpu", "nanoseconds")
        );
        assert_eq!(profile.sample.len(), 3);
        let linked: Vec<&Sample> = profile
            .sample
            .iter()
            .filter(|x| x.link_index != 0)
            .collect();
        assert_eq!(linked.len(), 1, "only the unambiguous sample is linked");
        let sample = linked[0];
        assert_eq!(sample.values, vec![30_000_000]);
        let link = &dict.link_table[sample.link_index as usize];
        assert_eq!(
            link.trace_id,
            TraceId::from_hex(trace_id).unwrap().to_bytes()
        );
        assert_eq!(link.span_id, SpanId::from_hex(span_id).unwrap().to_bytes());
        let names: Vec<&str> = dict.stack_table[sample.stack_index as usize]
            .location_indices
            .iter()
            .map(|l| {
                let f = dict.location_table[*l as usize].line[0].function_index;
                s(dict.function_table[f as usize].name_strindex)
            })
            .collect();
        assert_eq!(names, ["candle_core::cpu::matmul", "main"], "leaf first");
        let attrs: Vec<(&str, &AnyValue)> = sample
            .attribute_indices
            .iter()
            .map(|a| {
                let kv = &dict.attribute_table[*a as usize];
                (s(kv.key_strindex), kv.value.as_ref().unwrap())
            })
            .collect();
        assert_eq!(attrs.len(), 1, "the ids travel in the link: {attrs:?}");
        assert_eq!(attrs[0].0, "span_name");
        assert_eq!(
            attrs[0].1.value,
            Some(any_value::Value::StringValue("chat qwen".into()))
        );
    }
}
