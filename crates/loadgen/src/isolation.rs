//! Who else used the CPU while the load ran. A load client on the server's box takes CPU the
//! server would have used, and so do neighbours (builds, other benchmarks) and the hypervisor
//! (steal): the latency measured is then the latency of a contended server, and nothing else in
//! a report says so. A sampler thread reads `/proc` during the run (the box's CPU split from
//! `/proc/stat`, load from `/proc/loadavg`, this process's and the server's CPU from
//! `/proc/<pid>/stat`) or, for a remote server, its `process_cpu_time_seconds_total` from
//! `/metrics`; the summary flags a client or neighbour above a threshold share of the box.

use std::collections::HashMap;
use std::net::{IpAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How often the sampler reads `/proc`.
const INTERVAL: Duration = Duration::from_millis(500);
/// Most samples kept (a day at the interval): the sampler never grows without bound.
const MAX_SAMPLES: usize = 172_800;
/// Neighbour processes named in the summary.
const TOP_NEIGHBOURS: usize = 5;

/// Cumulative CPU counters of the box (`/proc/stat`, first line), in clock ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BoxTicks {
    /// user + nice + system + irq + softirq.
    pub busy: u64,
    /// idle + iowait.
    pub idle: u64,
    pub steal: u64,
}

impl BoxTicks {
    pub fn total(&self) -> u64 {
        self.busy + self.idle + self.steal
    }

    /// Parses the aggregate `cpu` line of `/proc/stat`.
    pub fn parse(stat: &str) -> Option<BoxTicks> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        Some(BoxTicks {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            idle: at(3) + at(4),
            steal: at(7),
        })
    }
}

/// utime + stime of a `/proc/<pid>/stat` line, in clock ticks, and the command name.
pub fn parse_proc_stat(line: &str) -> Option<(String, u64)> {
    // The name is in parentheses and may itself hold spaces or parentheses.
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let name = line[open + 1..close].to_string();
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    // After the name: state is field 3, utime field 14, stime field 15.
    let utime: u64 = rest.get(11)?.parse().ok()?;
    let stime: u64 = rest.get(12)?.parse().ok()?;
    Some((name, utime + stime))
}

fn process_ticks(pid: u32) -> Option<u64> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_proc_stat(&line).map(|(_, t)| t)
}

/// Every process's (name, ticks), by pid.
fn all_processes() -> HashMap<u32, (String, u64)> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(p) = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|l| parse_proc_stat(&l))
        {
            out.insert(pid, p);
        }
    }
    out
}

fn read_box() -> Option<BoxTicks> {
    BoxTicks::parse(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn load_1m() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPUs this process may run on (its affinity), else all online CPUs.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The pid of the local process listening on `port` (TCP, IPv4 or IPv6): the socket inode
/// from `/proc/net/tcp*`, then the process holding it among `/proc/*/fd`.
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        inodes.extend(listening_inodes(&text, port));
    }
    if inodes.is_empty() {
        return None;
    }
    let targets: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path()) {
                if targets.iter().any(|t| link.as_os_str() == t.as_str()) {
                    return Some(pid);
                }
            }
        }
    }
    None
}

/// Inodes of sockets in a `/proc/net/tcp` table listening (state 0A) on `port`.
pub fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
            (local_port == port && *f.get(3)? == "0A").then(|| f.get(9)?.parse().ok())?
        })
        .collect()
}

/// Whether the server at `url` runs on this machine, and its port.
pub fn local_port(url: &str) -> Option<u16> {
    let u = reqwest::Url::parse(url).ok()?;
    let port = u.port_or_known_default()?;
    let host = u.host_str()?.trim_matches(['[', ']']);
    let local = (host, port)
        .to_socket_addrs()
        .ok()?
        .any(|a| is_local(a.ip()));
    local.then_some(port)
}

fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified()
}

/// The server's cumulative CPU seconds from a Prometheus exposition, if it reports them.
pub fn cpu_seconds_in_metrics(text: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with("process_cpu_time_seconds_total"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
}

/// Where the server's CPU time comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerSource {
    /// `/proc/<pid>/stat` of a local server.
    Proc { pid: u32 },
    /// The server's `/metrics` (`process_cpu_time_seconds_total`), read at the start and end.
    Metrics,
    /// Neither: the server is remote and reports no CPU time.
    Unknown,
}

/// One sample: shares of the box's CPU capacity since the previous sample.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Sample {
    /// Seconds since the sampler started.
    pub t_s: f64,
    pub client: f64,
    /// `None` when the server is not local.
    pub server: Option<f64>,
    /// Busy CPU of everything else (the box's busy time minus client and local server).
    pub others: f64,
    pub steal: f64,
    pub load_1m: Option<f64>,
}

/// A neighbour process and its share of the box over the run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Neighbour {
    pub pid: u32,
    pub name: String,
    pub share: f64,
}

/// What the isolation check found over a command's whole run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Isolation {
    pub cpus: usize,
    pub seconds: f64,
    pub server_source: ServerSource,
    /// Shares of the box's CPU capacity (1 = every CPU busy the whole time).
    pub client_share: f64,
    pub server_share: Option<f64>,
    /// The server's CPU in cores (from `/proc` or `/metrics`).
    pub server_cores: Option<f64>,
    pub others_share: f64,
    pub steal_share: f64,
    pub load_1m_max: Option<f64>,
    /// The busiest other processes (those alive at both ends of the run).
    pub neighbours: Vec<Neighbour>,
    /// The share above which the client or the neighbours are flagged.
    pub threshold: f64,
    /// CPUs the client was pinned to (`--pin-client`), if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_client: Option<String>,
    /// What the check flags; empty when the run looks isolated.
    pub flags: Vec<String>,
    pub samples: Vec<Sample>,
}

impl Isolation {
    pub fn isolated(&self) -> bool {
        self.flags.is_empty()
    }
}

struct Start {
    at: Instant,
    box_ticks: BoxTicks,
    client: u64,
    server: Option<u64>,
    processes: HashMap<u32, (String, u64)>,
    server_metrics_s: Option<f64>,
}

/// Samples `/proc` on its own thread until [`Sampler::finish`].
pub struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    start: Option<Start>,
    server_pid: Option<u32>,
    metrics_url: Option<String>,
    threshold: f64,
    pinned_client: Option<String>,
}

async fn metrics_cpu_seconds(url: &str) -> Option<f64> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .ok()?;
    let text = client.get(url).send().await.ok()?.text().await.ok()?;
    cpu_seconds_in_metrics(&text)
}

impl Sampler {
    /// Starts sampling. `server_pid`: the server's pid when known (else found by the URL's port
    /// when the server is local; else its `/metrics` is read at the start and the end).
    pub async fn start(
        url: &str,
        server_pid: Option<u32>,
        threshold: f64,
        pinned_client: Option<String>,
    ) -> Sampler {
        let me = std::process::id();
        let server_pid = server_pid
            .or_else(|| local_port(url).and_then(pid_listening_on))
            .filter(|&p| p != me);
        let metrics_url = server_pid
            .is_none()
            .then(|| format!("{}/metrics", url.trim_end_matches('/')));
        let server_metrics_s = match &metrics_url {
            Some(u) => metrics_cpu_seconds(u).await,
            None => None,
        };
        let start = read_box().map(|box_ticks| Start {
            at: Instant::now(),
            box_ticks,
            client: process_ticks(me).unwrap_or(0),
            server: server_pid.and_then(process_ticks),
            processes: all_processes(),
            server_metrics_s,
        });
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let thread = start.as_ref().map(|_| {
            let (stop, samples) = (Arc::clone(&stop), Arc::clone(&samples));
            std::thread::spawn(move || sample_loop(me, server_pid, &stop, &samples))
        });
        Sampler {
            stop,
            samples,
            thread,
            start,
            server_pid,
            metrics_url,
            threshold,
            pinned_client,
        }
    }

    /// Stops sampling and sums up; `None` where `/proc` cannot be read (not Linux).
    pub async fn finish(mut self) -> Option<Isolation> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let start = self.start.take()?;
        let end_box = read_box()?;
        let me = std::process::id();
        let seconds = start.at.elapsed().as_secs_f64();
        let total = end_box
            .total()
            .saturating_sub(start.box_ticks.total())
            .max(1) as f64;
        let client = process_ticks(me).unwrap_or(0).saturating_sub(start.client);
        let server = match (self.server_pid.and_then(process_ticks), start.server) {
            (Some(end), Some(begin)) => Some(end.saturating_sub(begin)),
            _ => None,
        };
        let busy = end_box.busy.saturating_sub(start.box_ticks.busy);
        let others = busy.saturating_sub(client + server.unwrap_or(0));
        let cpus = cpus();
        let metrics_cores = match (&self.metrics_url, start.server_metrics_s) {
            (Some(u), Some(begin)) => metrics_cpu_seconds(u)
                .await
                .map(|end| (end - begin).max(0.0) / seconds.max(1e-9)),
            _ => None,
        };
        let server_share = server.map(|s| s as f64 / total);
        let mut neighbours: Vec<Neighbour> = all_processes()
            .into_iter()
            .filter(|(pid, _)| *pid != me && Some(*pid) != self.server_pid)
            .filter_map(|(pid, (name, end))| {
                let (_, begin) = start.processes.get(&pid)?;
                let share = end.saturating_sub(*begin) as f64 / total;
                (share > 0.0).then_some(Neighbour { pid, name, share })
            })
            .collect();
        neighbours.sort_by(|a, b| b.share.total_cmp(&a.share));
        neighbours.truncate(TOP_NEIGHBOURS);
        let samples = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        let mut iso = Isolation {
            cpus,
            seconds,
            server_source: match (self.server_pid, metrics_cores) {
                (Some(pid), _) => ServerSource::Proc { pid },
                (None, Some(_)) => ServerSource::Metrics,
                (None, None) => ServerSource::Unknown,
            },
            client_share: client as f64 / total,
            server_share,
            server_cores: server_share.map(|s| s * cpus as f64).or(metrics_cores),
            others_share: others as f64 / total,
            steal_share: end_box.steal.saturating_sub(start.box_ticks.steal) as f64 / total,
            load_1m_max: samples
                .iter()
                .filter_map(|s| s.load_1m)
                .max_by(f64::total_cmp),
            neighbours,
            threshold: self.threshold,
            pinned_client: self.pinned_client.clone(),
            flags: Vec::new(),
            samples,
        };
        iso.flags = flags(&iso);
        Some(iso)
    }
}

/// What a summary must warn about.
pub fn flags(i: &Isolation) -> Vec<String> {
    let mut out = Vec::new();
    let pct = |x: f64| x * 100.0;
    if i.client_share > i.threshold {
        out.push(format!(
            "the load client took {:.1}% of the box's CPU (threshold {:.0}%): it competed with the server{}",
            pct(i.client_share),
            pct(i.threshold),
            if i.pinned_client.is_some() { "" } else { "; pin it apart with --pin-client where there are cores" }
        ));
    }
    if i.others_share > i.threshold {
        let names: Vec<String> = i
            .neighbours
            .iter()
            .take(3)
            .map(|n| format!("{} {:.1}%", n.name, pct(n.share)))
            .collect();
        out.push(format!(
            "other processes took {:.1}% of the box's CPU (threshold {:.0}%){}: the server shared the CPUs",
            pct(i.others_share),
            pct(i.threshold),
            if names.is_empty() { String::new() } else { format!(", busiest {}", names.join(", ")) }
        ));
    }
    if i.steal_share > i.threshold / 4.0 {
        out.push(format!(
            "the hypervisor stole {:.1}% of the CPU time",
            pct(i.steal_share)
        ));
    }
    if let Some(load) = i.load_1m_max.filter(|&l| l > i.cpus as f64) {
        out.push(format!(
            "the 1-minute load average reached {load:.2} on {} CPUs: runnable work queued for a CPU",
            i.cpus
        ));
    }
    out
}

fn sample_loop(me: u32, server_pid: Option<u32>, stop: &AtomicBool, samples: &Mutex<Vec<Sample>>) {
    let started = Instant::now();
    let mut prev = (
        read_box(),
        process_ticks(me),
        server_pid.and_then(process_ticks),
    );
    while !stop.load(Ordering::Relaxed) {
        // Short naps so that `finish` never waits a whole interval.
        let wake = Instant::now() + INTERVAL;
        while Instant::now() < wake && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let now = (
            read_box(),
            process_ticks(me),
            server_pid.and_then(process_ticks),
        );
        if let ((Some(b0), Some(c0), s0), (Some(b1), Some(c1), s1)) = (prev, now) {
            let total = b1.total().saturating_sub(b0.total());
            if total > 0 {
                let t = total as f64;
                let client = c1.saturating_sub(c0);
                let server = s0.zip(s1).map(|(a, b)| b.saturating_sub(a));
                let busy = b1.busy.saturating_sub(b0.busy);
                let sample = Sample {
                    t_s: started.elapsed().as_secs_f64(),
                    client: client as f64 / t,
                    server: server.map(|s| s as f64 / t),
                    others: busy.saturating_sub(client + server.unwrap_or(0)) as f64 / t,
                    steal: b1.steal.saturating_sub(b0.steal) as f64 / t,
                    load_1m: load_1m(),
                };
                let mut v = samples.lock().unwrap_or_else(|e| e.into_inner());
                if v.len() < MAX_SAMPLES {
                    v.push(sample);
                }
            }
        }
        prev = now;
    }
}

/// Pins every thread of this process to `cpus` (a `taskset` CPU list such as `1` or `2-3`).
pub fn pin_client(cpus: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &std::process::id().to_string()])
        .output()
        .map_err(|e| anyhow::anyhow!("--pin-client: running taskset: {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "--pin-client {cpus}: taskset failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_box_and_process_counters() {
        let stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\n";
        let b = BoxTicks::parse(stat).unwrap();
        assert_eq!(
            b,
            BoxTicks {
                busy: 160,
                idle: 820,
                steal: 10
            }
        );
        let line = "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 37 11 0 0 20 0 3 0 123 1000 50";
        assert_eq!(parse_proc_stat(line), Some(("tokio (rt) x".into(), 48)));
    }

    #[test]
    fn finds_listening_sockets_by_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:4740 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 55501 1 0\n   1: 0100007F:4740 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 55502 1 0\n";
        assert_eq!(listening_inodes(table, 0x4740), vec![55501]);
        assert!(listening_inodes(table, 80).is_empty());
        assert_eq!(local_port("http://127.0.0.1:18280"), Some(18280));
        assert_eq!(local_port("http://localhost"), Some(80));
        assert_eq!(
            cpu_seconds_in_metrics(
                "# TYPE x counter\nprocess_cpu_time_seconds_total{a=\"b\"} 12.5\n"
            ),
            Some(12.5)
        );
    }

    #[test]
    fn this_process_is_found_listening_and_its_cpu_counted() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert_eq!(pid_listening_on(port), Some(std::process::id()));
        assert!(process_ticks(std::process::id()).is_some());
    }

    fn iso(client: f64, others: f64) -> Isolation {
        Isolation {
            cpus: 2,
            seconds: 10.0,
            server_source: ServerSource::Unknown,
            client_share: client,
            server_share: None,
            server_cores: None,
            others_share: others,
            steal_share: 0.0,
            load_1m_max: Some(1.0),
            neighbours: vec![Neighbour {
                pid: 9,
                name: "rustc".into(),
                share: others,
            }],
            threshold: 0.1,
            pinned_client: None,
            flags: Vec::new(),
            samples: Vec::new(),
        }
    }

    #[test]
    fn flags_a_busy_client_and_busy_neighbours_only() {
        assert!(flags(&iso(0.02, 0.05)).is_empty());
        let f = flags(&iso(0.3, 0.05));
        assert_eq!(f.len(), 1);
        assert!(f[0].contains("load client took 30.0%"), "{f:?}");
        let f = flags(&iso(0.02, 0.6));
        assert_eq!(f.len(), 1);
        assert!(f[0].contains("rustc 60.0%"), "{f:?}");
    }
}
