//! Drives the load. Open loop: a seeded schedule of arrivals, each request sent at its time whatever
//! the server is doing (so queueing shows up as latency, as it would for real users). Closed loop:
//! `users` tasks, each sending, waiting for the end of the stream and thinking before the next.
//! Every request carries a fresh `traceparent`; every one becomes a [`RequestRecord`].

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::task::JoinSet;

use crate::cli::{Endpoint, Mode, Shape, Target};
use crate::client::{self, Ask, Outcome};
use crate::mix::{Drawn, Mix};
use crate::record::RequestRecord;
use crate::replay::Replayed;
use crate::schedule::{exponential, Arrivals, Gradient, Phase, Phases, Zipf};

/// One load to run: the shape, its phases, and which knee step it is (if any).
#[derive(Debug, Clone)]
pub struct Plan {
    pub mode: Mode,
    pub arrivals: Arrivals,
    pub users: usize,
    pub think_ms: f64,
    pub phases: Phases,
    pub max_requests: Option<u64>,
    pub seed: u64,
    pub step: Option<usize>,
}

impl Plan {
    pub fn from_shape(shape: &Shape, seed: u64) -> Plan {
        Plan {
            mode: shape.mode,
            arrivals: Arrivals {
                rate: shape.rate,
                burst_rate: shape.burst_rate,
                burst_size: shape.burst_size,
            },
            users: shape.users,
            think_ms: shape.think_ms,
            phases: Phases {
                warmup_s: shape.warmup,
                steady_s: shape.duration,
                cooldown_s: shape.cooldown,
            },
            max_requests: shape.requests,
            seed,
            step: None,
        }
    }

    /// Offered requests per second (open loop only).
    pub fn offered_rps(&self) -> Option<f64> {
        (self.mode == Mode::Open).then(|| self.arrivals.offered_rps())
    }
}

/// What a plan produced.
#[derive(Debug)]
pub struct Ran {
    pub records: Vec<RequestRecord>,
    /// How long the steady phase really lasted (shorter when the request bound stopped the run).
    pub steady_s: f64,
    /// When the steady phase began, in seconds from the start of the command.
    pub steady_start_s: f64,
    /// The request bound stopped sending before the phases ran out.
    pub stopped_early: bool,
}

impl Ran {
    /// Successful requests per second over the steady window, counted by when they completed
    /// (so a server falling behind shows its real throughput, not the offered rate). A run
    /// stopped by the request bound keeps its window open until its last steady request ends.
    pub fn throughput(&self) -> (u64, f64) {
        let start = self.steady_start_s;
        let mut end = start + self.steady_s;
        if self.stopped_early {
            end = self
                .records
                .iter()
                .filter(|r| r.phase == Phase::Steady)
                .map(|r| r.done_s)
                .fold(end, f64::max);
        }
        let ok = crate::stats::completions_in(&self.records, start, end);
        (ok, end - start)
    }
}

/// Live counters for the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    pub sent: AtomicU64,
    pub completed: AtomicU64,
    pub errors: AtomicU64,
    pub in_flight: AtomicU64,
    current: Mutex<Option<Current>>,
}

/// The plan now running: its label, start, phases and offered rate.
type Current = (String, Instant, Phases, Option<f64>);

impl Progress {
    fn begin(&self, label: String, phases: Phases, offered: Option<f64>) {
        *self.current.lock().unwrap() = Some((label, Instant::now(), phases, offered));
    }

    /// The progress line, with `rate` = completions per second since the last line.
    pub fn line(&self, rate: f64) -> String {
        let stage = match &*self.current.lock().unwrap() {
            Some((label, start, phases, offered)) => {
                let t = start.elapsed().as_secs_f64();
                let phase = if t >= phases.total() {
                    "draining".to_string()
                } else {
                    format!("{:?}", phases.at(t)).to_lowercase()
                };
                let offered = offered.map_or(String::new(), |o| format!(" offered {o:.2}/s"));
                format!(
                    "{label}{phase} {:.0}/{:.0}s{offered}",
                    t.min(phases.total()),
                    phases.total()
                )
            }
            None => "starting".to_string(),
        };
        format!(
            "[{stage}] rate {rate:.2}/s in-flight {} completed {} errors {}",
            self.in_flight.load(Ordering::Relaxed),
            self.completed.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
        )
    }
}

/// Prints the progress line to stderr every second (in place on a terminal, every 5 s otherwise)
/// until dropped.
pub struct ProgressPrinter(Option<tokio::task::JoinHandle<()>>);

impl ProgressPrinter {
    pub fn start(progress: Arc<Progress>, quiet: bool) -> ProgressPrinter {
        if quiet {
            return ProgressPrinter(None);
        }
        let tty = std::io::stderr().is_terminal();
        let every = if tty { 1 } else { 5 };
        ProgressPrinter(Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(every));
            let mut last = (Instant::now(), 0u64);
            loop {
                tick.tick().await;
                let done = progress.completed.load(Ordering::Relaxed);
                let dt = last.0.elapsed().as_secs_f64().max(1e-3);
                let line = progress.line((done - last.1) as f64 / dt);
                last = (Instant::now(), done);
                let mut err = std::io::stderr().lock();
                if tty {
                    let _ = write!(err, "\r\x1b[2K{line}");
                } else {
                    let _ = writeln!(err, "{line}");
                }
                let _ = err.flush();
            }
        })))
    }
}

impl Drop for ProgressPrinter {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
            if std::io::stderr().is_terminal() {
                eprintln!();
            }
        }
    }
}

/// Where requests go: an HTTP base URL, or a gRPC channel.
#[derive(Clone)]
enum Conn {
    Http(String),
    Grpc(tonic::transport::Channel),
}

impl Conn {
    fn new(endpoint: Endpoint, url: &str) -> anyhow::Result<Conn> {
        Ok(match endpoint {
            Endpoint::Grpc => Conn::Grpc(crate::grpc::channel(url)?),
            _ => Conn::Http(url.to_string()),
        })
    }
}

/// The mirror of every request to a second server: separate tasks, bounded like the primary's
/// in-flight requests, collected only after the primary's load has finished.
struct Shadow {
    conn: Conn,
    tasks: Mutex<JoinSet<RequestRecord>>,
    in_flight: Arc<AtomicU64>,
    dropped: Mutex<Vec<RequestRecord>>,
}

/// Sends requests for one command; ids and times run on across the plans it is given.
pub struct Runner {
    http: reqwest::Client,
    conn: Conn,
    grpc_headers: crate::grpc::Headers,
    shadow: Option<Shadow>,
    mix: Mix,
    target: Target,
    queries: Arc<Vec<String>>,
    zipf: Zipf,
    gradient: Gradient,
    t0: Instant,
    next_id: AtomicU64,
    pub progress: Arc<Progress>,
    /// Set once to stop sending (Ctrl-C); requests in flight still finish and are recorded.
    stop: tokio::sync::watch::Sender<bool>,
}

/// A request about to go out.
#[derive(Clone)]
struct Sending {
    id: u64,
    phase: Phase,
    step: Option<usize>,
    offered_rps: Option<f64>,
    user: Option<usize>,
    scheduled_s: Option<f64>,
    rank: usize,
    top_k: Option<usize>,
    rerank_top_n: Option<usize>,
    /// A replayed request's question and filter; unset, the mix draws them.
    drawn: Option<Drawn>,
}

impl Runner {
    pub fn new(target: Target, queries: Vec<String>) -> anyhow::Result<Arc<Runner>> {
        let zipf = Zipf::new(queries.len(), target.zipf_alpha)?;
        let gradient = Gradient {
            kind: target.gradient,
            top_k: target.top_k,
            rerank_top_n: target.rerank_top_n,
        };
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &target.api_key {
            let mut bearer = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| anyhow::anyhow!("--api-key: must be printable ASCII"))?;
            bearer.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, bearer);
        }
        if let Some(plan) = &target.fault {
            let value = reqwest::header::HeaderValue::from_str(plan)
                .map_err(|_| anyhow::anyhow!("--fault: must be printable ASCII JSON"))?;
            headers.insert("x-ragscope-fault", value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .pool_max_idle_per_host(target.max_in_flight)
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        let mix = Mix {
            cold_share: target.cold_share,
            no_match_share: target.no_match_share,
            perturb_rate: target.perturb_rate,
            seed: target.seed,
            nonce: unix_ms(),
        };
        mix.check()?;
        let shadow = match &target.shadow {
            Some(url) => Some(Shadow {
                conn: Conn::new(target.endpoint, url)?,
                tasks: Mutex::new(JoinSet::new()),
                in_flight: Arc::new(AtomicU64::new(0)),
                dropped: Mutex::new(Vec::new()),
            }),
            None => None,
        };
        Ok(Arc::new(Runner {
            http,
            conn: Conn::new(target.endpoint, &target.url)?,
            grpc_headers: crate::grpc::Headers {
                api_key: target.api_key.clone(),
                fault: target.fault.clone(),
                retry: target.retry_refused,
            },
            shadow,
            mix,
            target,
            queries: Arc::new(queries),
            zipf,
            gradient,
            t0: Instant::now(),
            next_id: AtomicU64::new(0),
            progress: Arc::new(Progress::default()),
            stop: tokio::sync::watch::Sender::new(false),
        }))
    }

    /// Stops sending new requests; the running plan then waits for those in flight.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    pub fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    /// Resolves once [`Runner::stop`] has been called.
    async fn stopping(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|&s| s).await;
    }

    fn now_s(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// Runs a plan to the end: every request sent has finished (or timed out) when this returns.
    pub async fn run(self: &Arc<Runner>, plan: &Plan, label: String) -> Ran {
        self.progress.begin(label, plan.phases, plan.offered_rps());
        match plan.mode {
            Mode::Open => self.open_loop(plan).await,
            Mode::Closed => self.closed_loop(plan).await,
        }
    }

    async fn open_loop(self: &Arc<Runner>, plan: &Plan) -> Ran {
        let mut rng = StdRng::seed_from_u64(plan.seed);
        let horizon = plan.phases.total();
        let times = plan.arrivals.times(horizon, &mut rng);
        let offered = plan.offered_rps();
        let base = tokio::time::Instant::now();
        let base_s = self.now_s();
        let mut tasks = JoinSet::new();
        let mut records = Vec::new();
        let mut stopped_at = None;
        for (i, &at) in times.iter().enumerate() {
            if plan.max_requests.is_some_and(|m| i as u64 >= m) {
                stopped_at = Some(at);
                break;
            }
            let rank = self.zipf.sample(&mut rng);
            let (top_k, rerank_top_n) = self.gradient.at(rank, self.zipf.len(), at, horizon);
            tokio::select! {
                _ = tokio::time::sleep_until(base + Duration::from_secs_f64(at)) => {}
                _ = self.stopping() => {
                    stopped_at = Some(base.elapsed().as_secs_f64());
                    break;
                }
            }
            let sending = Sending {
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
                phase: plan.phases.at(at),
                step: plan.step,
                offered_rps: offered,
                user: None,
                scheduled_s: Some(base_s + at),
                rank,
                top_k,
                rerank_top_n,
                drawn: None,
            };
            if self.progress.in_flight.load(Ordering::Relaxed) >= self.target.max_in_flight as u64 {
                records.push(self.dropped(sending));
                continue;
            }
            let runner = Arc::clone(self);
            tasks.spawn(async move { runner.send(sending).await });
        }
        if stopped_at.is_none() {
            // The phases last their full length even when the schedule's last arrival is early
            // (or there is none): a knee step at a low rate must still take its time.
            tokio::select! {
                _ = tokio::time::sleep_until(base + Duration::from_secs_f64(horizon)) => {}
                _ = self.stopping() => {}
            }
        }
        while let Some(done) = tasks.join_next().await {
            if let Ok(r) = done {
                records.push(r);
            }
        }
        records.sort_by_key(|r| r.id);
        Ran {
            records,
            steady_s: steady_seconds(&plan.phases, stopped_at),
            steady_start_s: base_s + plan.phases.warmup_s,
            stopped_early: stopped_at.is_some(),
        }
    }

    async fn closed_loop(self: &Arc<Runner>, plan: &Plan) -> Ran {
        let base = Instant::now();
        let base_s = self.now_s();
        let horizon = plan.phases.total();
        let sent = Arc::new(AtomicU64::new(0));
        let stopped_at = Arc::new(Mutex::new(None::<f64>));
        let mut users = JoinSet::new();
        for user in 0..plan.users.max(1) {
            let runner = Arc::clone(self);
            let plan = plan.clone();
            let sent = Arc::clone(&sent);
            let stopped_at = Arc::clone(&stopped_at);
            users.spawn(async move {
                let mut rng = StdRng::seed_from_u64(plan.seed.wrapping_add(user as u64 * 7919 + 1));
                let mut records = Vec::new();
                loop {
                    let t = base.elapsed().as_secs_f64();
                    if t >= horizon {
                        break;
                    }
                    if runner.stopped() {
                        stopped_at.lock().unwrap().get_or_insert(t);
                        break;
                    }
                    if plan
                        .max_requests
                        .is_some_and(|m| sent.fetch_add(1, Ordering::Relaxed) >= m)
                    {
                        stopped_at.lock().unwrap().get_or_insert(t);
                        break;
                    }
                    let rank = runner.zipf.sample(&mut rng);
                    let (top_k, rerank_top_n) =
                        runner.gradient.at(rank, runner.zipf.len(), t, horizon);
                    let sending = Sending {
                        id: runner.next_id.fetch_add(1, Ordering::Relaxed),
                        phase: plan.phases.at(t),
                        step: plan.step,
                        offered_rps: None,
                        user: Some(user),
                        scheduled_s: None,
                        rank,
                        top_k,
                        rerank_top_n,
                        drawn: None,
                    };
                    records.push(runner.send(sending).await);
                    if plan.think_ms > 0.0 {
                        let think = exponential(&mut rng, 1e3 / plan.think_ms);
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_secs_f64(think)) => {}
                            _ = runner.stopping() => {}
                        }
                    }
                }
                records
            });
        }
        let mut records = Vec::new();
        while let Some(done) = users.join_next().await {
            records.extend(done.unwrap_or_default());
        }
        records.sort_by_key(|r| r.id);
        let stopped = *stopped_at.lock().unwrap();
        Ran {
            records,
            steady_s: steady_seconds(&plan.phases, stopped),
            steady_start_s: base_s + plan.phases.warmup_s,
            stopped_early: stopped.is_some(),
        }
    }

    async fn send(&self, s: Sending) -> RequestRecord {
        let p = &self.progress;
        p.sent.fetch_add(1, Ordering::Relaxed);
        p.in_flight.fetch_add(1, Ordering::Relaxed);
        let drawn = match s.drawn.clone() {
            Some(d) => d,
            None => self.mix.draw(&self.queries[s.rank], s.id),
        };
        let ask = Ask {
            query: drawn.query.clone(),
            top_k: s.top_k,
            rerank_top_n: s.rerank_top_n,
            max_tokens: self.target.max_tokens,
            filter: drawn.filter.clone(),
        };
        if let Some(shadow) = &self.shadow {
            self.mirror(shadow, &s, &drawn, &ask);
        }
        let (traceparent, trace_id) = client::traceparent();
        let sent_s = self.now_s();
        let sent_unix_ms = unix_ms();
        let outcome = exchange(
            &self.conn,
            &self.http,
            &self.target,
            &self.grpc_headers,
            &ask,
            &traceparent,
        )
        .await;
        let done_s = self.now_s();
        p.in_flight.fetch_sub(1, Ordering::Relaxed);
        p.completed.fetch_add(1, Ordering::Relaxed);
        if outcome.error.is_some() {
            p.errors.fetch_add(1, Ordering::Relaxed);
        }
        record(s, drawn, (sent_s, done_s), sent_unix_ms, trace_id, outcome)
    }

    /// Sends the same request to the shadow server on a task of its own: the primary's request
    /// goes out without waiting for it, and its record is kept apart.
    fn mirror(&self, shadow: &Shadow, s: &Sending, drawn: &Drawn, ask: &Ask) {
        let copy = Sending {
            drawn: Some(drawn.clone()),
            ..s.clone()
        };
        if shadow.in_flight.load(Ordering::Relaxed) >= self.target.max_in_flight as u64 {
            let now = self.now_s();
            let outcome = Outcome {
                error: Some("dropped".into()),
                error_detail: Some("shadow: too many requests in flight".into()),
                ..Outcome::default()
            };
            let r = record(
                copy,
                drawn.clone(),
                (now, now),
                unix_ms(),
                String::new(),
                outcome,
            );
            shadow.dropped.lock().unwrap().push(r);
            return;
        }
        shadow.in_flight.fetch_add(1, Ordering::Relaxed);
        let in_flight = Arc::clone(&shadow.in_flight);
        let conn = shadow.conn.clone();
        let (http, target, grpc_headers, t0) = (
            self.http.clone(),
            self.target.clone(),
            self.grpc_headers.clone(),
            self.t0,
        );
        let ask = ask.clone();
        let drawn = drawn.clone();
        shadow.tasks.lock().unwrap().spawn(async move {
            let (traceparent, trace_id) = client::traceparent();
            let sent_s = t0.elapsed().as_secs_f64();
            let sent_unix_ms = unix_ms();
            let outcome = exchange(&conn, &http, &target, &grpc_headers, &ask, &traceparent).await;
            in_flight.fetch_sub(1, Ordering::Relaxed);
            let done_s = t0.elapsed().as_secs_f64();
            record(
                copy,
                drawn,
                (sent_s, done_s),
                sent_unix_ms,
                trace_id,
                outcome,
            )
        });
    }

    /// The shadow's records, once every mirrored request has finished (empty without
    /// `--shadow`). Call after the primary's load: it waits up to the request timeout.
    pub async fn shadow_records(&self) -> Vec<RequestRecord> {
        let Some(shadow) = &self.shadow else {
            return Vec::new();
        };
        let mut tasks = std::mem::take(&mut *shadow.tasks.lock().unwrap());
        let mut out = std::mem::take(&mut *shadow.dropped.lock().unwrap());
        while let Some(done) = tasks.join_next().await {
            if let Ok(r) = done {
                out.push(r);
            }
        }
        out.sort_by_key(|r| r.id);
        out
    }

    /// Sends every question of the query set once, in order, one at a time (to fill the
    /// server's caches with the hot set before an experiment measures it).
    pub async fn send_each(self: &Arc<Runner>) -> Vec<RequestRecord> {
        let mut records = Vec::new();
        for rank in 0..self.queries.len() {
            if self.stopped() {
                break;
            }
            let (top_k, rerank_top_n) = self.gradient.at(rank, self.zipf.len(), 0.0, 1.0);
            let sending = Sending {
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
                phase: Phase::Warmup,
                step: None,
                offered_rps: None,
                user: Some(0),
                scheduled_s: None,
                rank,
                top_k,
                rerank_top_n,
                drawn: None,
            };
            records.push(self.send(sending).await);
        }
        records
    }

    /// Sends the replayed requests at their recorded offsets from now (open loop: a request
    /// goes out at its time whatever the server does).
    pub async fn replay(self: &Arc<Runner>, items: &[Replayed]) -> Ran {
        let base = tokio::time::Instant::now();
        let base_s = self.now_s();
        let mut tasks = JoinSet::new();
        let mut records = Vec::new();
        let mut stopped_at = None;
        for item in items {
            tokio::select! {
                _ = tokio::time::sleep_until(base + Duration::from_secs_f64(item.at_s)) => {}
                _ = self.stopping() => {
                    stopped_at = Some(base.elapsed().as_secs_f64());
                    break;
                }
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let mut drawn = item.drawn.clone();
            if let Some((q, what)) = self.mix.perturb_at(&drawn.query, id) {
                drawn.query = q;
                drawn.perturbation = Some(what);
            }
            let sending = Sending {
                id,
                phase: item.phase,
                step: None,
                offered_rps: None,
                user: None,
                scheduled_s: Some(base_s + item.at_s),
                rank: item.rank,
                top_k: item.top_k,
                rerank_top_n: item.rerank_top_n,
                drawn: Some(drawn),
            };
            if self.progress.in_flight.load(Ordering::Relaxed) >= self.target.max_in_flight as u64 {
                records.push(self.dropped(sending));
                continue;
            }
            let runner = Arc::clone(self);
            tasks.spawn(async move { runner.send(sending).await });
        }
        while let Some(done) = tasks.join_next().await {
            if let Ok(r) = done {
                records.push(r);
            }
        }
        records.sort_by_key(|r| r.id);
        let (start, end) = crate::replay::steady_window(items);
        let end = stopped_at.map_or(end, |t: f64| t.min(end));
        Ran {
            records,
            steady_s: (end - start).max(1e-3),
            steady_start_s: base_s + start,
            stopped_early: stopped_at.is_some(),
        }
    }

    /// A request the open loop could not send because too many were in flight.
    fn dropped(&self, s: Sending) -> RequestRecord {
        self.progress.errors.fetch_add(1, Ordering::Relaxed);
        let outcome = Outcome {
            error: Some("dropped".into()),
            error_detail: Some(format!(
                "{} requests in flight (--max-in-flight)",
                self.target.max_in_flight
            )),
            ..Outcome::default()
        };
        let now = self.now_s();
        let drawn = match s.drawn.clone() {
            Some(d) => d,
            None => self.mix.draw(&self.queries[s.rank], s.id),
        };
        record(s, drawn, (now, now), unix_ms(), String::new(), outcome)
    }
}

/// One exchange with `conn`, over HTTP or gRPC.
async fn exchange(
    conn: &Conn,
    http: &reqwest::Client,
    target: &Target,
    grpc_headers: &crate::grpc::Headers,
    ask: &Ask,
    traceparent: &str,
) -> Outcome {
    let timeout = Duration::from_secs_f64(target.timeout);
    match conn {
        Conn::Http(url) => {
            let request = client::HttpRequest {
                http,
                base_url: url,
                endpoint: target.endpoint,
                model: &target.model,
                traceparent,
                retry: target.retry_refused,
            };
            client::send(&request, ask, timeout).await
        }
        Conn::Grpc(channel) => {
            crate::grpc::send(channel, grpc_headers, ask, traceparent, timeout).await
        }
    }
}

fn record(
    s: Sending,
    drawn: Drawn,
    (sent_s, done_s): (f64, f64),
    sent_unix_ms: u64,
    trace_id: String,
    o: Outcome,
) -> RequestRecord {
    RequestRecord {
        id: s.id,
        phase: s.phase,
        step: s.step,
        offered_rps: s.offered_rps,
        user: s.user,
        scheduled_s: s.scheduled_s,
        sent_s,
        done_s,
        sent_unix_ms,
        query_rank: s.rank,
        top_k: s.top_k,
        rerank_top_n: s.rerank_top_n,
        trace_id,
        ok: o.error.is_none(),
        status: o.status,
        error: o.error,
        error_detail: o.error_detail,
        ttft_ms: o.ttft_ms,
        tpot_ms: o.tpot_ms,
        e2e_ms: o.e2e_ms,
        tokens: o.tokens,
        prompt_tokens: o.prompt_tokens,
        server_timings: o.server_timings,
        query: Some(drawn.query),
        filter: drawn.filter,
        query_kind: Some(drawn.kind),
        perturbation: drawn.perturbation,
        embedding_cached: o.embedding_cached,
        cached_tokens: o.cached_tokens,
        sentences: o.sentences.map(|s| s.0),
        sentences_cached: o.sentences.map(|s| s.1),
        retried: o.retried,
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The steady phase's real length when the run stopped at `stopped_at` seconds (if it did).
fn steady_seconds(phases: &Phases, stopped_at: Option<f64>) -> f64 {
    match stopped_at {
        Some(t) => (t - phases.warmup_s).clamp(0.0, phases.steady_s),
        None => phases.steady_s,
    }
}
