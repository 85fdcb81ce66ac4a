//! Admission and the workers: the queue's bound, the wait predicted and refused, tenants' quotas, shutdown.
use super::*;
use std::time::Duration;

fn root() -> Stage {
    Stage::root("t")
}

fn any() -> Admission {
    Admission::new(JobKind::Embed)
}

fn query(id: u64, at: Instant) -> Started {
    Started {
        id,
        kind: JobKind::Query,
        warmth: Warmth::Unknown,
        at,
    }
}

#[tokio::test]
async fn runs_jobs_off_the_caller_thread() {
    let w = Workers::new(1, 4);
    let caller = std::thread::current().id();
    let rx = w
        .submit(any(), &root(), move || {
            std::thread::current().id() != caller
        })
        .unwrap();
    assert!(rx.await.unwrap());
}

#[tokio::test]
async fn a_full_queue_is_refused_and_then_recovers() {
    let w = Workers::new(1, 1);
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let busy = w
        .submit(any(), &root(), move || release_rx.recv().unwrap())
        .unwrap();
    // Wait until the worker has taken the blocking job off the queue.
    while w.depth() > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let queued = w.submit(any(), &root(), || 1).unwrap();
    assert_eq!(
        w.submit(any(), &root(), || 2).unwrap_err().reason,
        Refusal::QueueFull
    );
    release_tx.send(()).unwrap();
    busy.await.unwrap();
    assert_eq!(queued.await.unwrap(), 1);
    assert_eq!(w.submit(any(), &root(), || 3).unwrap().await.unwrap(), 3);
}

#[tokio::test]
async fn a_panicking_job_leaves_the_worker_alive() {
    let w = Workers::new(1, 2);
    let rx = w
        .submit(any(), &root(), || -> u8 { panic!("boom") })
        .unwrap();
    assert!(rx.await.is_err());
    assert_eq!(w.submit(any(), &root(), || 7).unwrap().await.unwrap(), 7);
}

#[test]
fn the_predicted_wait_hands_the_queue_to_the_first_free_worker() {
    let now = Instant::now();
    let mut l = Ledger {
        running: vec![query(0, now)],
        ..Ledger::new()
    };
    l.record(JobKind::Query, Warmth::Unknown, Duration::from_secs(1));
    // One worker busy for 1 s more, one idle: a job now starts at once.
    assert_eq!(l.predicted_wait(2, now), (0.0, 0.0));
    for id in 1..=3 {
        l.queued.push_back(Queued::new(id, JobKind::Query));
    }
    // The three queued jobs start at 0, 1 and 1 s; the fourth at 2 s.
    let (wait, first_free) = l.predicted_wait(2, now);
    assert!((wait - 2.0).abs() < 1e-9, "{wait}");
    assert_eq!(first_free, 0.0);
    l.record(JobKind::Query, Warmth::Unknown, Duration::from_secs(2));
    assert!((l.service_of(JobKind::Query, Warmth::Unknown) - 1.2).abs() < 1e-9);
}

#[test]
fn before_any_measurement_a_running_job_bounds_the_service_time_from_below() {
    let now = Instant::now();
    let started = now - Duration::from_secs(3);
    let mut l = Ledger {
        queued: VecDeque::from([Queued::new(1, JobKind::Query)]),
        running: vec![query(0, started)],
        ..Ledger::new()
    };
    assert!(l.service_of(JobKind::Query, Warmth::Unknown) >= 3.0);
    assert_eq!(l.service_of(JobKind::Embed, Warmth::Unknown), 0.0);
    // One worker: the running job's remaining time is unknown (0), the queued one ~3 s.
    let (wait, _) = l.predicted_wait(1, now);
    assert!(wait >= 3.0, "{wait}");
    l.record(JobKind::Query, Warmth::Unknown, Duration::from_secs(1));
    assert_eq!(l.service_of(JobKind::Query, Warmth::Unknown), 1.0);
}

#[test]
fn cached_and_computed_prompts_are_timed_apart_and_an_overrun_job_still_counts() {
    let now = Instant::now();
    let mut l = Ledger::new();
    for _ in 0..10 {
        l.record(JobKind::Query, Warmth::Warm, Duration::from_secs(1));
        l.record(JobKind::Query, Warmth::Cold, Duration::from_secs(3));
    }
    assert!((l.service_of(JobKind::Query, Warmth::Warm) - 1.0).abs() < 1e-9);
    assert!((l.service_of(JobKind::Query, Warmth::Cold) - 3.0).abs() < 1e-9);
    // Unknown warmth: everything measured (the EWMA ends on a cold job).
    let all = l.service_of(JobKind::Query, Warmth::Unknown);
    assert!((1.0..3.0).contains(&all), "{all}");
    // A class never measured falls back to its kind.
    let mut fresh = Ledger::new();
    fresh.record(JobKind::Query, Warmth::Unknown, Duration::from_secs(2));
    assert_eq!(fresh.service_of(JobKind::Query, Warmth::Cold), 2.0);
    // One worker, a queue of two computed prompts and one cached one: 3 + 3 + 1 s.
    for (id, warmth) in [(1, Warmth::Cold), (2, Warmth::Cold), (3, Warmth::Warm)] {
        l.queued.push_back(Queued {
            warmth,
            ..Queued::new(id, JobKind::Query)
        });
    }
    let (wait, _) = l.predicted_wait(1, now);
    assert!((wait - 7.0).abs() < 1e-9, "{wait}");
    // A job running past its mean is expected to take about a deviation more, not nothing.
    l.queued.clear();
    for x in [2.0, 4.0, 2.0, 4.0] {
        l.record(JobKind::Query, Warmth::Warm, Duration::from_secs_f64(x));
    }
    let overrun = Started {
        warmth: Warmth::Warm,
        ..query(0, now - Duration::from_secs(10))
    };
    l.running.push(overrun);
    let spread = l.estimate(JobKind::Query, Warmth::Warm).spread;
    assert!(spread > 0.5, "{spread}");
    assert_eq!(l.predicted_wait(1, now).0, spread);
}

#[test]
fn predictions_are_lengthened_by_how_far_measured_waits_ran_past_them() {
    let mut c = Calibration::new();
    // Too few samples, and waits too short to say anything: no correction.
    c.observe(2.0, 3.0);
    c.observe(0.1, 5.0);
    assert_eq!(c.factor(), 1.0);
    for i in 0..40 {
        // Waits ran 1.3-1.7× their predictions.
        c.observe(4.0, 4.0 * (1.3 + 0.1 * f64::from(i % 5)));
    }
    let k = c.factor();
    assert!((1.7..2.4).contains(&k), "{k}");
    let mut l = Ledger::new();
    l.calibration = c;
    l.record(JobKind::Query, Warmth::Unknown, Duration::from_secs(2));
    l.queued.push_back(Queued::new(1, JobKind::Query));
    let now = Instant::now();
    let (raw, _) = l.predicted_wait(1, now);
    let (corrected, _) = l.expected_wait(1, now);
    assert!((corrected - raw * k).abs() < 1e-9, "{raw} {corrected}");
    // Predictions that were too long never shorten the wait below the prediction.
    let mut early = Calibration::new();
    for _ in 0..20 {
        early.observe(4.0, 1.0);
    }
    assert_eq!(early.factor(), 1.0);
}

#[tokio::test]
async fn a_job_that_would_wait_too_long_or_miss_its_deadline_is_refused() {
    // 200 ms less half of it kept back: waits above 100 ms are refused.
    let w = Workers::new(1, 16).with_max_wait(Duration::from_millis(200), 0.5);
    let query = Admission::new(JobKind::Query);
    // Teach the estimate: a query takes about 300 ms.
    w.submit(query.clone(), &root(), || {
        std::thread::sleep(Duration::from_millis(300))
    })
    .unwrap()
    .await
    .unwrap();
    // Idle, but 300 ms of service cannot finish inside a 50 ms deadline.
    let soon = query.clone().by(Instant::now() + Duration::from_millis(50));
    let refused = w.submit(soon, &root(), || ()).unwrap_err();
    assert_eq!(refused.reason, Refusal::Deadline);
    assert!(refused.to_string().contains("deadline"), "{refused}");
    // Busy for ~300 ms more: above the 100 ms limit.
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let busy = w
        .submit(query.clone(), &root(), move || release_rx.recv().unwrap())
        .unwrap();
    while w.depth() > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let refused = w.submit(query, &root(), || ()).unwrap_err();
    assert_eq!(refused.reason, Refusal::MaxWait);
    assert!(refused.wait > Duration::from_millis(100), "{refused:?}");
    // What it was allowed is the limit less the headroom, not the limit.
    assert_eq!(refused.allowed, Duration::from_millis(100));
    assert!(refused.to_string().contains("admits (100 ms)"), "{refused}");
    assert_eq!(refused.retry_after_s, 1);
    release_tx.send(()).unwrap();
    busy.await.unwrap();
}

#[tokio::test]
async fn a_panicking_job_leaves_the_ledger_clean() {
    let w = Workers::new(1, 2);
    let rx = w
        .submit(any(), &root(), || -> u8 { panic!("boom") })
        .unwrap();
    assert!(rx.await.is_err());
    tokio::time::sleep(Duration::from_millis(5)).await;
    let l = w.ledger.lock().unwrap();
    assert!(l.running.is_empty() && l.queued.is_empty());
    assert_eq!(l.service[JobKind::Embed.index()].mean, None);
}

#[tokio::test]
async fn a_tenant_is_held_to_its_quota_and_share_without_touching_others() {
    use crate::tenant::TenantArgs;
    use crate::tenant::{scope, Tenants};
    let args = TenantArgs {
        // One request a second refills nothing while the test runs (at 1000 a second, a
        // millisecond's pause on a loaded box refilled a token and the last refusal passed).
        quotas: vec!["noisy:rps=1,burst=3,share=0.25".into()],
        baggage_key: None,
    };
    let tenants = Tenants::new(&args, &["quiet".into()]).unwrap();
    let w = Workers::new(1, 8);
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    // The one worker is busy, so what follows queues.
    let busy = w
        .submit(any(), &root(), move || release_rx.recv().unwrap())
        .unwrap();
    while w.depth() > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let submit = |name: &str| {
        let tenant = tenants.get(name);
        let w = &w;
        async move { scope(tenant, async { w.submit(any(), &root(), || ()) }).await }
    };
    // A quarter of 8: two queued jobs, then the share refuses a third.
    let queued = [
        submit("noisy").await.unwrap(),
        submit("noisy").await.unwrap(),
    ];
    let refused = submit("noisy").await.unwrap_err();
    assert_eq!(refused.reason, Refusal::TenantShare);
    // The bucket's burst of 3 is spent too (two queued and the busy job's none: only
    // admitted jobs take a token), and the quiet tenant is admitted all the same.
    let quiet = submit("quiet").await.unwrap();
    release_tx.send(()).unwrap();
    busy.await.unwrap();
    for rx in queued {
        rx.await.unwrap();
    }
    quiet.await.unwrap();
    submit("noisy").await.unwrap().await.unwrap();
    let refused = submit("noisy").await.unwrap_err();
    assert_eq!(refused.reason, Refusal::TenantRequests);
    assert!(
        refused.to_string().contains("request rate quota"),
        "{refused}"
    );
    assert_eq!(refused.retry_after_s, 1);
}
