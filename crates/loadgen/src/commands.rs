//! Each subcommand end to end: read the query set, drive the load, summarise, and write
//! `requests.jsonl`, `summary.json` and `report.html` under `--out`.

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::{json, Value};

use crate::caches::CacheReport;
use crate::cli::{
    Cli, ColdArgs, Command, Experiment, GateArgs, IsolationArgs, KneeArgs, Mode, ReconnectArgs,
    ReportArgs, RunArgs, TailsArgs, Target,
};
use crate::cold;
use crate::experiment;
use crate::gate::{self, Baseline, Decision, Measured};
use crate::isolation::{self, Isolation, Sampler};
use crate::knee::{self, StepResult, Thresholds};
use crate::notebook;
use crate::record::{self, RequestRecord};
use crate::report::{self, Attribution};
use crate::runner::{Plan, ProgressPrinter, Runner};
use crate::schedule::{load_queries, Arrivals, Phase, Phases};
use crate::shadow::ShadowReport;
use crate::stats::PhaseStats;
use crate::summary::Summary;

/// Exit status of a gate that found a regression.
pub const EXIT_REGRESSION: u8 = 1;
/// Exit status of a gate whose evidence was too thin to decide.
pub const EXIT_INCONCLUSIVE: u8 = 3;

/// Runs a subcommand and returns its exit status: 0, or for `gate` [`EXIT_REGRESSION`] or
/// [`EXIT_INCONCLUSIVE`].
pub async fn dispatch(command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Run(a) => run(&a).await.map(|_| 0),
        Command::Knee(a) => knee(&a).await.map(|_| 0),
        Command::Gate(a) => gate(&a).await.map(|d| match d {
            Decision::NoRegression => 0,
            Decision::Regression => EXIT_REGRESSION,
            Decision::Inconclusive => EXIT_INCONCLUSIVE,
        }),
        Command::Report(a) => report(&a).map(|_| 0),
        Command::Experiment(Experiment::Tails(a)) => tails(&a).await.map(|_| 0),
        Command::Experiment(Experiment::Cold(a)) => cold_experiment(&a).await.map(|_| 0),
        Command::Experiment(Experiment::Reconnect(a)) => reconnect(&a).await.map(|_| 0),
        Command::Plan(a) => crate::plan::run(&a).map(|_| 0),
    }
}

/// `experiment tails`: one closed-loop run per delay distribution, then the comparison.
pub async fn tails(a: &TailsArgs) -> anyhow::Result<Vec<experiment::Arm>> {
    if !positive(a.mean_ms) || a.requests == 0 || a.users == 0 {
        bail!("--mean-ms must be positive, --requests and --users at least 1");
    }
    let mut arms = Vec::new();
    for (name, plan, injected_p99) in experiment::plans(&a.stage, a.mean_ms) {
        eprintln!("tails: {name} delays into {} ({plan})", a.stage);
        let args = experiment::arm_args(a, &plan, name);
        let (mut summary, records) = run_load(&args).await?;
        summary.command = format!("experiment tails ({name})");
        write_outputs(&args.out, &summary, &records, None)?;
        let times = experiment::stage_times(&records, &a.stage);
        if times.is_empty() {
            bail!(
                "{name}: no successful request reported a {} time; is the server running with --faults true --fault-header true?",
                a.stage
            );
        }
        if let Some(i) = &summary.isolation {
            print_isolation(i);
        }
        arms.push(experiment::analyse(name, plan, &times, injected_p99));
    }
    print!("{}", experiment::table(&arms));
    std::fs::create_dir_all(&a.out)?;
    let path = a.out.join("tails.json");
    std::fs::write(&path, serde_json::to_string_pretty(&arms)? + "\n")?;
    println!("wrote {}", path.display());
    Ok(arms)
}

/// Sends every question of the runner's query set once, one at a time; an error names `what`
/// when any of them failed (a cache warmed with errors is not warm).
async fn send_each_once(runner: &Arc<Runner>, what: &str) -> anyhow::Result<()> {
    let sent = runner.send_each().await;
    let failed = sent.iter().filter(|r| !r.ok).count();
    if failed > 0 {
        bail!("{what}: {failed} of {} requests failed", sent.len());
    }
    Ok(())
}

/// `--warm`: the query set once before anything is measured, so the caches stand as they would
/// for a second run.
async fn warm_if_asked(runner: &Arc<Runner>, target: &Target) -> anyhow::Result<()> {
    if target.warm {
        eprintln!("--warm: sending each question of the query set once before measuring");
        send_each_once(runner, "--warm").await?;
    }
    Ok(())
}

/// `experiment cold`: an all-hot baseline arm, then one arm per cold share, each a closed-loop
/// run after the hot set has been sent once (so its hits are hits).
pub async fn cold_experiment(a: &ColdArgs) -> anyhow::Result<Vec<cold::ColdArm>> {
    if a.requests == 0 || a.users == 0 {
        bail!("--requests and --users must be at least 1");
    }
    if a.cold_shares.iter().any(|&c| !(0.0..=1.0).contains(&c)) {
        bail!("--cold-shares: each must be in [0, 1]");
    }
    let queries = load_queries(&a.target.queries)?;
    eprintln!(
        "cold: warming the hot set ({} questions, once each)",
        queries.len()
    );
    let warm = Runner::new(cold::hot_target(&a.target), queries)?;
    send_each_once(&warm, "warming the hot set").await?;
    let mut arms = Vec::new();
    for share in cold::shares(&a.cold_shares) {
        let args = cold::arm_args(a, share);
        eprintln!("cold: arm at cold share {share}");
        let (mut summary, records) = run_load(&args).await?;
        summary.command = format!("experiment cold (share {share})");
        write_outputs(&args.out, &summary, &records, None)?;
        if let Some(i) = &summary.isolation {
            print_isolation(i);
        }
        arms.push(cold::ColdArm::of(share, &summary));
    }
    cold::amplify(&mut arms);
    print!("{}", cold::table(&arms));
    std::fs::create_dir_all(&a.out)?;
    let path = a.out.join("cold.json");
    std::fs::write(&path, serde_json::to_string_pretty(&arms)? + "\n")?;
    println!("wrote {}", path.display());
    Ok(arms)
}

/// `experiment reconnect`: every arm's server, in turn, for `--rounds` rounds.
pub async fn reconnect(a: &ReconnectArgs) -> anyhow::Result<Vec<cold::ReconnectArm>> {
    if a.requests == 0 || a.users == 0 || a.rounds == 0 {
        bail!("--requests, --users and --rounds must be at least 1");
    }
    if a.with_retry && a.rounds % 2 == 1 {
        bail!(
            "--rounds {}: with --with-retry it must be even, so each arm and its +retry twin go \
             first (on the colder caches) equally often",
            a.rounds
        );
    }
    let arms = cold::parse_arms(&a.arms)?;
    let runs = cold::reconnect_runs(&arms, a.with_retry, a.target.retry_refused);
    let mut records: Vec<Vec<RequestRecord>> = vec![Vec::new(); runs.len()];
    for round in 0..a.rounds {
        for i in cold::round_order(&runs, round) {
            let arm = &runs[i];
            eprintln!("reconnect: round {round}, arm {} ({})", arm.name, arm.url);
            let args = cold::reconnect_args(a, arm, round);
            let (summary, rs) = run_load(&args).await?;
            write_outputs(&args.out, &summary, &rs, None)?;
            if let Some(iso) = &summary.isolation {
                print_isolation(iso);
            }
            records[i].extend(rs.into_iter().filter(|r| r.phase == Phase::Steady));
        }
    }
    let result: Vec<cold::ReconnectArm> = runs
        .iter()
        .zip(&records)
        .map(|(arm, rs)| cold::ReconnectArm::of(&arm.name, &arm.url, rs))
        .collect();
    print!("{}", cold::reconnect_table(&result));
    std::fs::create_dir_all(&a.out)?;
    let path = a.out.join("reconnect.json");
    std::fs::write(&path, serde_json::to_string_pretty(&result)? + "\n")?;
    println!("wrote {}", path.display());
    Ok(result)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The JSON objects merged into one (for the summary's `config`).
fn merged(parts: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    for p in parts {
        if let Some(o) = p.as_object() {
            out.extend(o.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
    }
    Value::Object(out)
}

/// True for a number above zero (false for NaN).
fn positive(x: f64) -> bool {
    x > 0.0
}

fn check_target(t: &Target) -> anyhow::Result<()> {
    if !positive(t.timeout) {
        bail!("--timeout must be positive");
    }
    if t.max_in_flight == 0 {
        bail!("--max-in-flight must be at least 1");
    }
    Ok(())
}

fn read_attribution(path: Option<&Path>) -> anyhow::Result<Option<Attribution>> {
    path.map(Attribution::read).transpose()
}

/// Writes the output files: requests.jsonl, summary.json, report.html, report.ipynb.
pub fn write_outputs(
    dir: &Path,
    summary: &Summary,
    records: &[RequestRecord],
    attribution: Option<&Attribution>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    record::write_jsonl(&dir.join("requests.jsonl"), records)?;
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(summary)? + "\n",
    )?;
    std::fs::write(
        dir.join("report.html"),
        report::render(summary, records, attribution),
    )?;
    std::fs::write(dir.join("report.ipynb"), notebook::render(summary))?;
    Ok(())
}

/// First Ctrl-C: stop sending, let requests in flight finish, write the outputs. Second: quit.
fn stop_on_ctrl_c(runner: &Arc<Runner>) {
    let runner = Arc::clone(runner);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\nstopping: waiting for the requests in flight (Ctrl-C again to quit now)");
            runner.stop();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
}

/// Pins the client if asked and starts the isolation sampler.
async fn start_isolation(url: &str, a: &IsolationArgs) -> anyhow::Result<Sampler> {
    if !positive(a.isolation_threshold) || a.isolation_threshold > 1.0 {
        bail!("--isolation-threshold must be in (0, 1]");
    }
    if let Some(cpus) = &a.pin_client {
        isolation::pin_client(cpus)?;
        if isolation::cpus() < 4 {
            eprintln!(
                "note: {} CPUs: pinning leaves the server few cores of its own; the isolation check reports the client's share either way",
                isolation::cpus()
            );
        }
    }
    Ok(Sampler::start(
        url,
        a.server_pid,
        a.isolation_threshold,
        a.pin_client.clone(),
    )
    .await)
}

fn print_isolation(i: &Isolation) {
    println!(
        "isolation: {} CPUs; client {:.1}%, server {}, others {:.1}%, steal {:.1}% of the box; load ≤ {}",
        i.cpus,
        i.client_share * 100.0,
        i.server_cores
            .map_or("unknown".into(), |c| format!("{c:.2} cores")),
        i.others_share * 100.0,
        i.steal_share * 100.0,
        i.load_1m_max.map_or("–".into(), |l| format!("{l:.2}")),
    );
    for f in &i.flags {
        println!("  FLAG: {f}");
    }
}

/// Runs one load and returns its summary and records, without writing anything.
pub async fn run_load(a: &RunArgs) -> anyhow::Result<(Summary, Vec<RequestRecord>)> {
    let (summary, records, _) = run_load_mirrored(a).await?;
    Ok((summary, records))
}

/// [`run_load`], also returning the `--shadow` server's records (empty without one).
pub async fn run_load_mirrored(
    a: &RunArgs,
) -> anyhow::Result<(Summary, Vec<RequestRecord>, Vec<RequestRecord>)> {
    check_target(&a.target)?;
    let s = &a.shape;
    if !positive(s.duration) || s.warmup < 0.0 || s.cooldown < 0.0 {
        bail!("--duration must be positive, --warmup and --cooldown not negative");
    }
    let arrivals = Arrivals {
        rate: s.rate,
        burst_rate: s.burst_rate,
        burst_size: s.burst_size,
    };
    if s.mode == Mode::Open && !positive(arrivals.offered_rps()) {
        bail!("open loop needs --rate > 0 or --burst-rate and --burst-size > 0");
    }
    if s.mode == Mode::Closed && s.users == 0 {
        bail!("closed loop needs --users >= 1");
    }
    // A replay carries its questions; the query set is only its fallback.
    let queries = match (&a.replay, load_queries(&a.target.queries)) {
        (Some(_), Err(_)) => vec![String::new()],
        (_, q) => q?,
    };
    let replayed = match &a.replay {
        Some(path) => Some(crate::replay::load(path, &queries)?),
        None => None,
    };
    let runner = Runner::new(a.target.clone(), queries)?;
    stop_on_ctrl_c(&runner);
    warm_if_asked(&runner, &a.target).await?;
    let printer = ProgressPrinter::start(Arc::clone(&runner.progress), a.quiet);
    let started_unix_ms = unix_ms();
    let plan = Plan::from_shape(s, a.target.seed);
    let sampler = start_isolation(&a.target.url, &a.isolation).await?;
    let ran = match &replayed {
        Some(items) => runner.replay(items).await,
        None => runner.run(&plan, String::new()).await,
    };
    let isolation = sampler.finish().await;
    drop(printer);
    let shadow_records = runner.shadow_records().await;
    let shadow = a
        .target
        .shadow
        .as_ref()
        .map(|url| ShadowReport::of(url, &ran.records, &shadow_records));
    let steady: Vec<&RequestRecord> = ran
        .records
        .iter()
        .filter(|r| r.phase == Phase::Steady)
        .collect();
    // A replay offers what the recording sent: its steady requests over their window.
    let offered = match &replayed {
        Some(_) => Some(steady.len() as f64 / ran.steady_s),
        None => plan.offered_rps(),
    };
    let stats = PhaseStats::of(&steady, ran.steady_s, offered).with_throughput(ran.throughput());
    let mut config = merged(&[json!(a.target), json!(a.shape), json!(a.isolation)]);
    if let Some(path) = &a.replay {
        config["replay"] = json!(path);
    }
    let summary = Summary {
        tool: "ragscope-loadgen".into(),
        command: "run".into(),
        config,
        started_unix_ms,
        phases: replayed.is_none().then_some(plan.phases),
        requests_by_phase: Summary::count_phases(&ran.records),
        steady: Some(stats),
        steps: Vec::new(),
        knee: None,
        isolation,
        gate: None,
        caches: CacheReport::of(&steady),
        shadow,
    };
    Ok((summary, ran.records, shadow_records))
}

fn print_steady(s: &PhaseStats) {
    let p = |p: Option<measure::stats::Percentiles>| {
        p.map_or("–".into(), |p| {
            let c = &p.ci;
            let mut line = format!(
                "n {} p50 {:.0} [{:.0}, {:.0}] p95 {:.0} [{:.0}, {:.0}] p99 {:.0} [{:.0}, {:.0}] p99.9 {:.0} [{:.0}, {:.0}]",
                p.count, p.p50, c.p50.lo, c.p50.hi, p.p95, c.p95.lo, c.p95.hi, p.p99, c.p99.lo,
                c.p99.hi, p.p99_9, c.p99_9.lo, c.p99_9.hi
            );
            for (name, beyond) in p.thin_tails() {
                line.push_str(&format!(" ({name}: {beyond:.1} samples beyond it, too few)"));
            }
            line
        })
    };
    println!(
        "steady: {} requests, {} ok, error rate {:.1}% {:?}; offered {} rps, achieved {:.3} rps",
        s.requests,
        s.ok,
        s.error_rate * 100.0,
        s.errors_by_kind,
        s.offered_rps
            .map_or("closed-loop".into(), |o| format!("{o:.3}")),
        s.achieved_rps
    );
    println!("  TTFT ms  {}", p(s.ttft_ms));
    println!("  TPOT ms  {}", p(s.tpot_ms));
    println!("  e2e ms   {}", p(s.e2e_ms));
    println!("  (intervals: bootstrap 95%, 1000 resamples, seeded)");
}

pub async fn run(a: &RunArgs) -> anyhow::Result<Summary> {
    let attribution = read_attribution(a.attribution.as_deref())?;
    let (summary, records, shadow) = run_load_mirrored(a).await?;
    write_outputs(&a.out, &summary, &records, attribution.as_ref())?;
    if let Some(s) = &summary.steady {
        print_steady(s);
    }
    if let Some(state) = summary.caches.as_ref().and_then(CacheReport::state) {
        println!("  {state}");
    }
    if let Some(c) = &summary.caches {
        for line in c.lines() {
            println!("  {line}");
        }
    }
    if let Some(r) = &summary.shadow {
        record::write_jsonl(&a.out.join("shadow.jsonl"), &shadow)?;
        print!("{}", r.table());
    }
    if let Some(i) = &summary.isolation {
        print_isolation(i);
    }
    println!("wrote {}", a.out.join("report.html").display());
    Ok(summary)
}

pub async fn knee(a: &KneeArgs) -> anyhow::Result<Summary> {
    check_target(&a.target)?;
    if !positive(a.start_rate) || !positive(a.step_duration) || a.max_steps == 0 {
        bail!("--start-rate and --step-duration must be positive, --max-steps at least 1");
    }
    if a.step.is_none() && !positive(a.factor - 1.0) {
        bail!("--factor must be above 1 (or give --step)");
    }
    if a.step.is_some_and(|s| !positive(s)) {
        bail!("--step must be positive");
    }
    if a.start_rate * a.step_duration < 10.0 {
        eprintln!(
            "note: the first step expects {:.1} requests; p95 over fewer than ~10 is rough (raise --step-duration or --start-rate)",
            a.start_rate * a.step_duration
        );
    }
    let attribution = read_attribution(a.attribution.as_deref())?;
    let th = Thresholds {
        max_p95_ttft_ms: a.max_p95_ttft_ms,
        max_error_rate: a.max_error_rate,
    };
    let queries = load_queries(&a.target.queries)?;
    let runner = Runner::new(a.target.clone(), queries)?;
    stop_on_ctrl_c(&runner);
    warm_if_asked(&runner, &a.target).await?;
    let printer = ProgressPrinter::start(Arc::clone(&runner.progress), a.quiet);
    let started_unix_ms = unix_ms();
    let sampler = start_isolation(&a.target.url, &a.isolation).await?;
    let mut steps: Vec<StepResult> = Vec::new();
    let mut records = Vec::new();
    for i in 0..a.max_steps {
        let rate = knee::step_rate(a.start_rate, a.factor, a.step, i);
        if rate > a.max_rate {
            break;
        }
        let plan = Plan {
            mode: Mode::Open,
            arrivals: Arrivals {
                rate,
                burst_rate: 0.0,
                burst_size: 0,
            },
            users: 1,
            think_ms: 0.0,
            phases: Phases {
                warmup_s: a.step_warmup,
                steady_s: a.step_duration,
                cooldown_s: 0.0,
            },
            max_requests: None,
            seed: a.target.seed.wrapping_add(i as u64),
            step: Some(i),
        };
        let ran = runner.run(&plan, format!("step {i} ")).await;
        let steady: Vec<&RequestRecord> = ran
            .records
            .iter()
            .filter(|r| r.phase == Phase::Steady)
            .collect();
        let stats =
            PhaseStats::of(&steady, ran.steady_s, Some(rate)).with_throughput(ran.throughput());
        let result = StepResult::judge(i, rate, &stats, &th);
        eprintln!(
            "step {i}: offered {rate:.3} rps, achieved {:.3}, {} requests, errors {:.1}%, TTFT p95 {} ms: {}",
            result.achieved_rps,
            result.requests,
            result.error_rate * 100.0,
            result.ttft_p95_ms.map_or("–".into(), |v| format!("{v:.0}")),
            result.failed.as_deref().unwrap_or("ok")
        );
        let failed = result.failed.is_some();
        steps.push(result);
        records.extend(ran.records);
        if failed || runner.stopped() {
            break;
        }
    }
    let isolation = sampler.finish().await;
    drop(printer);
    let found = knee::find_knee(&steps, &th);
    println!(
        "last good: {} rps; knee: {} rps ({})",
        found
            .last_good_rps
            .map_or("none".into(), |v| format!("{v:.3}")),
        found
            .knee_rps
            .map_or("not reached".into(), |v| format!("{v:.3}")),
        found.reason
    );
    let summary = Summary {
        tool: "ragscope-loadgen".into(),
        command: "knee".into(),
        config: merged(&[json!(a.target), json!(a)]),
        started_unix_ms,
        phases: None,
        requests_by_phase: Summary::count_phases(&records),
        steady: None,
        steps,
        knee: Some(found),
        isolation,
        gate: None,
        caches: None,
        shadow: None,
    };
    if let Some(i) = &summary.isolation {
        print_isolation(i);
    }
    write_outputs(&a.out, &summary, &records, attribution.as_ref())?;
    println!("wrote {}", a.out.join("report.html").display());
    Ok(summary)
}

/// The `run` flags of a baseline's load, pointed at `url`.
pub fn gate_run_args(b: &Baseline, url: &str, queries: &str, out: &str) -> anyhow::Result<RunArgs> {
    let mut argv: Vec<String> = vec!["ragscope-loadgen".into(), "run".into()];
    argv.extend(b.load.iter().cloned());
    argv.extend(
        ["--url", url, "--queries", queries, "--out", out]
            .iter()
            .map(|s| s.to_string()),
    );
    match Cli::try_parse_from(argv)
        .context("the baseline's `load` flags")?
        .command
    {
        Command::Run(a) => Ok(a),
        _ => unreachable!("parsed as run"),
    }
}

/// Runs the baseline's load and decides at `--confidence`.
pub async fn gate(a: &GateArgs) -> anyhow::Result<Decision> {
    if !positive(a.confidence - 0.5) || !positive(1.0 - a.confidence) {
        bail!("--confidence must be in (0.5, 1)");
    }
    let b = Baseline::read(&a.baseline)?;
    let mut args = gate_run_args(
        &b,
        &a.url,
        &a.queries.to_string_lossy(),
        &a.out.to_string_lossy(),
    )?;
    args.quiet |= a.quiet;
    args.isolation = a.isolation.clone();
    let (mut summary, records) = run_load(&args).await?;
    let steady = summary.steady.clone().context("no steady phase")?;
    print_steady(&steady);
    // A gate decided on a cold run against a hot baseline (or the reverse) decides on caches.
    if let Some(state) = summary.caches.as_ref().and_then(CacheReport::state) {
        println!("  {state}");
    }
    if let Some(i) = &summary.isolation {
        print_isolation(i);
    }
    let steady_records: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| r.phase == Phase::Steady)
        .collect();
    let rows = gate::compare(&b, &Measured::of(&steady_records, &steady), a.confidence);
    summary.command = "gate".into();
    summary.gate = Some(rows.clone());
    write_outputs(&args.out, &summary, &records, None)?;
    print!("{}", gate::table(&rows));
    println!(
        "gate: {} at {:.0}% confidence (baseline {}; report {})",
        gate::verdict_text(&rows),
        a.confidence * 100.0,
        a.baseline.display(),
        args.out.join("report.html").display()
    );
    Ok(gate::verdict(&rows).0)
}

pub fn report(a: &ReportArgs) -> anyhow::Result<()> {
    let summary: Summary = serde_json::from_str(
        &std::fs::read_to_string(a.from.join("summary.json"))
            .with_context(|| format!("reading {}", a.from.join("summary.json").display()))?,
    )
    .context("parsing summary.json")?;
    let records = record::read_jsonl(&a.from.join("requests.jsonl"))?;
    let attribution = read_attribution(a.attribution.as_deref())?;
    let path = a.from.join("report.html");
    std::fs::write(
        &path,
        report::render(&summary, &records, attribution.as_ref()),
    )?;
    std::fs::write(a.from.join("report.ipynb"), notebook::render(&summary))?;
    println!("wrote {}", path.display());
    Ok(())
}
