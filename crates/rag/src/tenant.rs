//! Tenants and their quotas: who a request is charged to, and how much each may take.
//!
//! A request's tenant comes from its API key (`KEY tenant=NAME` in the key syntax, see
//! the API's `auth` module); with keys off, from the W3C `baggage` member named by
//! `--tenant-baggage-key`, which is only as trustworthy as the network, so it is never used when
//! keys are on. Without either it is `default`. Names that no key and no `--tenant-quota` names
//! are all charged to `other`, so the tenants (and the metric label) are bounded by the
//! configuration, not by what clients send.
//!
//! A quota (`--tenant-quota NAME:rps=R,burst=B,tokens=T,token_burst=TB,share=S`; `*` for every
//! tenant without its own) is two token buckets and a queue share, checked at admission
//! ([`crate::worker`]) before any work runs:
//! - requests per second: each model job takes one token from a bucket of `burst` (default
//!   `max(1, rps)`) refilled at `rps`;
//! - prompt + output tokens per second: a request is admitted while the bucket is above zero
//!   and pays what it used when it finishes, so the bucket may go into debt and the tenant
//!   waits it off (`Retry-After` says how long); `token_burst` defaults to ten seconds' worth;
//! - `share`: the fraction of `--queue-capacity` the tenant's jobs may hold in the queue.
//!
//! The tenant travels with the request without every handler passing it on: [`scope`] runs a
//! request's future with it (a task-local, set by the API's tenant layer for HTTP and gRPC alike),
//! [`Admission::new`](crate::worker::Admission::new) reads it, and the model worker enters it
//! for the job's duration so the pipeline can [`charge`] the tokens it used.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use opentelemetry::KeyValue;
use parking_lot::Mutex;

pub use crate::settings::TenantArgs;
use telemetry::metrics::metrics;
use telemetry::names::attr;

/// Charged when nothing names the caller.
pub const DEFAULT: &str = "default";
/// Charged for every name the configuration does not know.
pub const OTHER: &str = "other";

/// One tenant's limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quota {
    /// Model jobs per second, refilled continuously; `None`: no request limit.
    pub rps: Option<f64>,
    pub burst: f64,
    /// Prompt + output tokens per second; `None`: no token limit.
    pub tokens_per_s: Option<f64>,
    pub token_burst: f64,
    /// Fraction of the queue's capacity this tenant's waiting jobs may hold.
    pub share: Option<f64>,
}

impl Quota {
    /// `rps=R,burst=B,tokens=T,token_burst=TB,share=S`, any subset but not none.
    pub fn parse(spec: &str) -> Result<Quota, String> {
        let mut q = Quota {
            rps: None,
            burst: 0.0,
            tokens_per_s: None,
            token_burst: 0.0,
            share: None,
        };
        let (mut burst, mut token_burst) = (None, None);
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not `name=value`"))?;
            let v: f64 = value
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("`{key}` must be a positive number, not `{value}`"))?;
            match key.trim() {
                "rps" => q.rps = Some(v),
                "burst" => burst = Some(v),
                "tokens" => q.tokens_per_s = Some(v),
                "token_burst" => token_burst = Some(v),
                "share" if v <= 1.0 => q.share = Some(v),
                "share" => {
                    return Err(format!(
                        "`share` is a fraction of the queue, at most 1, not {v}"
                    ))
                }
                other => {
                    return Err(format!(
                        "unknown quota setting `{other}` (rps, burst, tokens, token_burst, share)"
                    ))
                }
            }
        }
        if q.rps.is_none() && q.tokens_per_s.is_none() && q.share.is_none() {
            return Err("a quota needs at least one of rps, tokens, share".into());
        }
        q.burst = burst.unwrap_or_else(|| q.rps.map_or(0.0, |r| r.max(1.0)));
        q.token_burst = token_burst.unwrap_or_else(|| q.tokens_per_s.map_or(0.0, |t| 10.0 * t));
        Ok(q)
    }
}

/// A token bucket; its level may go below zero when it is charged after the fact.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    capacity: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: f64, capacity: f64) -> Bucket {
        Bucket {
            rate,
            capacity,
            level: capacity,
            at: Instant::now(),
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.rate).min(self.capacity);
        self.at = now;
    }

    /// Seconds until the level reaches `need`, or zero if it is there already.
    fn wait_for(&self, need: f64) -> f64 {
        ((need - self.level) / self.rate).max(0.0)
    }
}

/// Why a tenant's job may not be admitted now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OverQuota {
    /// Its request bucket is empty; a token is back in `retry_after` seconds.
    Requests { retry_after: f64 },
    /// Its token bucket is in debt; paid off in `retry_after` seconds.
    Tokens { retry_after: f64 },
}

#[derive(Debug)]
struct Buckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

/// A tenant: its name (the metric label) and its buckets. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Tenant {
    name: Arc<str>,
    quota: Option<Quota>,
    buckets: Arc<Mutex<Buckets>>,
}

impl Tenant {
    fn new(name: &str, quota: Option<Quota>) -> Tenant {
        let buckets = Buckets {
            requests: quota.and_then(|q| q.rps.map(|r| Bucket::full(r, q.burst))),
            tokens: quota.and_then(|q| q.tokens_per_s.map(|t| Bucket::full(t, q.token_burst))),
        };
        Tenant {
            name: name.into(),
            quota,
            buckets: Arc::new(Mutex::new(buckets)),
        }
    }

    /// A tenant with no limits, for tests and servers without quotas.
    pub fn unlimited(name: &str) -> Tenant {
        Tenant::new(name, None)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many of a queue of `capacity` this tenant's waiting jobs may hold, if limited.
    pub fn queue_share(&self, capacity: usize) -> Option<usize> {
        let share = self.quota?.share?;
        Some(((share * capacity as f64).ceil() as usize).max(1))
    }

    /// Whether a job may be admitted now (nothing is taken).
    pub fn check(&self) -> Result<(), OverQuota> {
        let now = Instant::now();
        let mut b = self.buckets.lock();
        if let Some(r) = &mut b.requests {
            r.refill(now);
            if r.level < 1.0 {
                return Err(OverQuota::Requests {
                    retry_after: r.wait_for(1.0),
                });
            }
        }
        if let Some(t) = &mut b.tokens {
            t.refill(now);
            if t.level <= 0.0 {
                return Err(OverQuota::Tokens {
                    retry_after: t.wait_for(f64::MIN_POSITIVE),
                });
            }
        }
        Ok(())
    }

    /// Takes the request token of a job being admitted (counted once it is queued: see
    /// [`Tenant::count`]).
    pub fn take_request(&self) {
        if let Some(r) = &mut self.buckets.lock().requests {
            r.refill(Instant::now());
            r.level -= 1.0;
        }
    }

    /// Gives back the token [`Tenant::take_request`] took, for a job that was not queued after
    /// all (the queue filled between admission and the send).
    pub fn refund_request(&self) {
        if let Some(r) = &mut self.buckets.lock().requests {
            r.refill(Instant::now());
            r.level = (r.level + 1.0).min(r.capacity);
        }
    }

    /// Counts what became of this tenant's job: `admitted`, or the limit that refused it.
    pub fn count(&self, outcome: &'static str) {
        metrics().tenant_requests.add(
            1,
            &[
                KeyValue::new(attr::TENANT, self.name.to_string()),
                KeyValue::new(attr::OUTCOME, outcome),
            ],
        );
    }

    /// Pays `tokens` (prompt + output) out of the token bucket.
    fn pay(&self, tokens: usize) {
        if let Some(t) = &mut self.buckets.lock().tokens {
            t.refill(Instant::now());
            t.level -= tokens as f64;
        }
        metrics().tenant_tokens.add(
            tokens as u64,
            &[KeyValue::new(attr::TENANT, self.name.to_string())],
        );
    }
}

/// Every tenant the configuration knows, with their quotas, and how to tell who a request is.
#[derive(Debug)]
pub struct Tenants {
    /// By name: every quota's and key's tenant, `default` and `other`; those without a quota
    /// of their own have `*`'s.
    known: HashMap<String, Tenant>,
    baggage_key: Option<String>,
}

impl Default for Tenants {
    fn default() -> Tenants {
        Tenants::new(&TenantArgs::default(), &[]).expect("no quotas parse")
    }
}

impl Tenants {
    /// The tenants named by quotas and by keys (`key_tenants`), each with its quota.
    pub fn new(args: &TenantArgs, key_tenants: &[String]) -> Result<Tenants, String> {
        let mut quotas: HashMap<String, Quota> = HashMap::new();
        for spec in &args.quotas {
            let (name, rest) = spec.split_once(':').ok_or_else(|| {
                format!("--tenant-quota `{spec}`: expected NAME:rps=R,tokens=T,… (`*` for every other tenant)")
            })?;
            let name = name.trim();
            check_name(name).map_err(|e| format!("--tenant-quota `{spec}`: {e}"))?;
            let quota = Quota::parse(rest).map_err(|e| format!("--tenant-quota {name}: {e}"))?;
            if quotas.insert(name.to_string(), quota).is_some() {
                return Err(format!("--tenant-quota: `{name}` is given twice"));
            }
        }
        let fallback = quotas.get("*").copied();
        let mut names: Vec<&str> = quotas.keys().map(String::as_str).collect();
        names.extend(key_tenants.iter().map(String::as_str));
        names.extend([DEFAULT, OTHER]);
        let known = names
            .into_iter()
            .filter(|n| *n != "*")
            .map(|n| {
                let quota = quotas.get(n).copied().or(fallback);
                (n.to_string(), Tenant::new(n, quota))
            })
            .collect();
        Ok(Tenants {
            known,
            baggage_key: args.baggage_key.clone(),
        })
    }

    /// The tenant called `name`, or `other` when the configuration does not know it.
    pub fn get(&self, name: &str) -> Tenant {
        self.known
            .get(name)
            .or_else(|| self.known.get(OTHER))
            .cloned()
            .expect("`other` is always known")
    }

    /// The W3C baggage member that names a request's tenant when API keys are off.
    pub fn baggage_key(&self) -> Option<&str> {
        self.baggage_key.as_deref()
    }
}

/// Tenant names are metric label values: short and printable.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.*".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tenant name `{name}` must be 1-64 characters of letters, digits, `-`, `_`, `.`"
        ))
    }
}

tokio::task_local! {
    static REQUEST_TENANT: Tenant;
}

thread_local! {
    static JOB_TENANT: RefCell<Option<Tenant>> = const { RefCell::new(None) };
}

/// Runs `fut` as a request of `tenant`.
pub async fn scope<F: Future>(tenant: Tenant, fut: F) -> F::Output {
    REQUEST_TENANT.scope(tenant, fut).await
}

/// The tenant of the request being handled on this task or model job, if any.
pub fn current() -> Option<Tenant> {
    REQUEST_TENANT
        .try_with(Tenant::clone)
        .ok()
        .or_else(|| JOB_TENANT.with(|t| t.borrow().clone()))
}

/// Makes `tenant` the current one on this (model-worker) thread until the guard drops.
pub fn enter(tenant: Option<Tenant>) -> JobGuard {
    JobGuard(JOB_TENANT.with(|t| t.replace(tenant)))
}

pub struct JobGuard(Option<Tenant>);

impl Drop for JobGuard {
    fn drop(&mut self) {
        let previous = self.0.take();
        JOB_TENANT.with(|t| *t.borrow_mut() = previous);
    }
}

/// Charges the current job's tenant for `tokens` prompt + output tokens.
pub fn charge(tokens: usize) {
    if let Some(t) = JOB_TENANT.with(|t| t.borrow().clone()) {
        t.pay(tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn args(quotas: &[&str], baggage_key: Option<&str>) -> TenantArgs {
        TenantArgs {
            quotas: quotas.iter().map(|s| s.to_string()).collect(),
            baggage_key: baggage_key.map(str::to_string),
        }
    }

    #[test]
    fn quotas_parse_with_their_defaults_and_bad_ones_are_named() {
        let q = Quota::parse("rps=2.5, tokens=100").unwrap();
        assert_eq!(q.rps, Some(2.5));
        assert_eq!(q.burst, 2.5);
        assert_eq!(q.token_burst, 1000.0);
        assert_eq!(Quota::parse("rps=0.2").unwrap().burst, 1.0);
        assert_eq!(Quota::parse("share=0.25").unwrap().share, Some(0.25));
        for (bad, says) in [
            ("", "at least one"),
            ("rps", "name=value"),
            ("rps=-1", "`rps` must be a positive number"),
            ("rps=fast", "`rps` must be a positive number"),
            ("share=2", "at most 1"),
            ("rate=3", "unknown quota setting `rate`"),
        ] {
            let e = Quota::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        let e = Tenants::new(&args(&["acme rps=1"], None), &[]).unwrap_err();
        assert!(e.contains("expected NAME:"), "{e}");
        let e = Tenants::new(&args(&["a:rps=1", "a:rps=2"], None), &[]).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        assert!(check_name("team-a_1.x").is_ok());
        assert!(check_name("has space").is_err());
        assert!(check_name(&"x".repeat(65)).is_err());
    }

    #[test]
    fn the_request_bucket_refuses_past_its_burst_and_says_when_to_retry() {
        let t = Tenant::new("a", Some(Quota::parse("rps=10,burst=2").unwrap()));
        for _ in 0..2 {
            t.check().unwrap();
            t.take_request();
        }
        let Err(OverQuota::Requests { retry_after }) = t.check() else {
            panic!("a third request within the burst's time was admitted");
        };
        assert!(retry_after > 0.0 && retry_after <= 0.1, "{retry_after}");
        std::thread::sleep(Duration::from_millis(120));
        t.check().expect("a token is back after 1/rps");
    }

    #[test]
    fn a_refunded_request_token_admits_the_next_job_and_never_overfills_the_bucket() {
        let t = Tenant::new("a", Some(Quota::parse("rps=0.001,burst=1").unwrap()));
        t.take_request();
        assert!(t.check().is_err(), "the only token was taken");
        t.refund_request();
        t.check().expect("the refunded token admits the next job");
        t.refund_request();
        t.take_request();
        assert!(t.check().is_err(), "a refund beyond the burst was kept");
    }

    #[test]
    fn the_token_bucket_is_paid_after_the_fact_and_debt_is_waited_off() {
        let t = Tenant::new(
            "a",
            Some(Quota::parse("tokens=1000,token_burst=100").unwrap()),
        );
        t.check().unwrap();
        t.pay(150);
        let Err(OverQuota::Tokens { retry_after }) = t.check() else {
            panic!("a tenant in debt was admitted");
        };
        // 50 tokens of debt at 1000/s.
        assert!(retry_after > 0.03 && retry_after <= 0.05, "{retry_after}");
        std::thread::sleep(Duration::from_millis(60));
        t.check().expect("the debt is paid off");
    }

    #[test]
    fn names_the_configuration_does_not_know_share_one_tenant() {
        let tenants =
            Tenants::new(&args(&["acme:rps=1", "*:rps=5"], None), &["keyed".into()]).unwrap();
        assert_eq!(tenants.get("acme").quota.unwrap().rps, Some(1.0));
        // Known from a key, limited by `*`.
        assert_eq!(tenants.get("keyed").quota.unwrap().rps, Some(5.0));
        assert_eq!(tenants.get("stranger").name(), OTHER);
        assert_eq!(tenants.get(DEFAULT).quota.unwrap().rps, Some(5.0));
        let a = tenants.get("nobody-1");
        let b = tenants.get("nobody-2");
        assert!(Arc::ptr_eq(&a.buckets, &b.buckets));
        assert_eq!(tenants.get("acme").queue_share(32), None);
        let shared = Tenants::new(&args(&["acme:share=0.1"], None), &[]).unwrap();
        assert_eq!(shared.get("acme").queue_share(32), Some(4));
    }

    #[tokio::test]
    async fn the_tenant_follows_the_request_into_its_model_job() {
        let t = Tenant::new("a", Some(Quota::parse("tokens=100").unwrap()));
        let seen = scope(t.clone(), async { current().map(|t| t.name().to_string()) }).await;
        assert_eq!(seen.as_deref(), Some("a"));
        assert!(current().is_none());
        std::thread::spawn(move || {
            let guard = enter(Some(t.clone()));
            charge(1500);
            assert!(matches!(t.check(), Err(OverQuota::Tokens { .. })));
            drop(guard);
            assert!(current().is_none(), "the job's tenant outlived its guard");
        })
        .join()
        .unwrap();
    }
}
