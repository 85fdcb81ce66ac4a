//! API keys: who may call what. Off unless keys are configured (`--api-key`, `RAGSCOPE_API_KEYS`,
//! `--api-key-file`). A key is `SECRET` (user scope: queries, chat, embeddings, rerank, models)
//! or `admin:SECRET` (also document writes and deletes, `/admin/*` and `/debug/*`); `/health`,
//! `/ready` and `/metrics` stay open. HTTP takes `Authorization: Bearer <key>` in [`require_key`];
//! gRPC the `authorization` metadata in [`grpc_interceptor`]. Keys are compared as SHA-256
//! digests in constant time against every configured key, so neither timing nor length says
//! which part matched, and no key is ever logged or put on a span. `KEY tenant=NAME` charges the
//! key's requests to a tenant ([`rag::tenant`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use opentelemetry::KeyValue;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::{AppState, Readiness};
use crate::config::AuthArgs;
use telemetry::metrics::metrics;
use telemetry::names::attr;

/// What a key allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    User,
    Admin,
}

/// The scope of the key a request was authenticated with, left in its extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller(pub Scope);

/// The configured keys, as digests; empty means authentication is off.
#[derive(Default)]
pub struct ApiKeys {
    keys: Vec<Key>,
}

/// One configured key: its digest, scope and tenant.
struct Key {
    digest: [u8; 32],
    scope: Scope,
    tenant: Option<String>,
}

/// Never prints a key, not even its digest.
impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} configured)", self.keys.len())
    }
}

impl ApiKeys {
    /// The keys from the flags, the variable and the key file. Errors name where the bad entry
    /// is (flag position or file line), never the key.
    pub fn from_args(args: &AuthArgs) -> anyhow::Result<ApiKeys> {
        let mut specs: Vec<(String, String)> = args
            .api_keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                (
                    format!("--api-key / RAGSCOPE_API_KEYS entry {}", i + 1),
                    k.clone(),
                )
            })
            .collect();
        if let Some(path) = &args.api_key_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("--api-key-file: cannot read {}: {e}", path.display())
            })?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if !line.is_empty() && !line.starts_with('#') {
                    specs.push((format!("{} line {}", path.display(), n + 1), line.into()));
                }
            }
        }
        let keys = specs
            .iter()
            .map(|(origin, spec)| parse(spec).map_err(|e| anyhow::anyhow!("{origin}: {e}")))
            .collect::<anyhow::Result<_>>()?;
        Ok(ApiKeys { keys })
    }

    /// Keys given directly (tests).
    pub fn from_specs<S: AsRef<str>>(specs: &[S]) -> Result<ApiKeys, String> {
        let keys = specs
            .iter()
            .map(|s| parse(s.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(ApiKeys { keys })
    }

    pub fn is_on(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The configured key `token` is, or `None`. Every configured key is compared, whatever
    /// matched; of equal keys the one with the higher scope wins.
    fn find(&self, token: &str) -> Option<&Key> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found: Option<&Key> = None;
        for key in &self.keys {
            let same = key
                .digest
                .iter()
                .zip(&digest)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
            if same && found.is_none_or(|f| f.scope < key.scope) {
                found = Some(key);
            }
        }
        found
    }

    fn scope_of(&self, token: &str) -> Option<Scope> {
        self.find(token).map(|k| k.scope)
    }

    /// The tenant the key in an `Authorization` value (`Bearer <key>`) charges to, if it is a
    /// configured key that names one.
    pub fn tenant_of(&self, authorization: Option<&str>) -> Option<String> {
        let key = self.find(bearer(authorization?)?)?;
        key.tenant.clone()
    }

    /// Every tenant a key names.
    pub fn tenants(&self) -> Vec<String> {
        self.keys.iter().filter_map(|k| k.tenant.clone()).collect()
    }

    /// Authenticates an `Authorization` value (`Bearer <key>`) for a route that needs `needs`:
    /// 401 without a key or with an unknown one, 403 with a user key where admin is needed.
    pub fn check(&self, authorization: Option<&str>, needs: Scope) -> Result<Scope, ApiError> {
        let refuse = |reason: &'static str, e: ApiError| {
            metrics()
                .auth_rejected
                .add(1, &[KeyValue::new(attr::REASON, reason)]);
            Err(e)
        };
        let Some(value) = authorization else {
            return refuse(
                "missing",
                ApiError::unauthenticated(
                    "authorization: this server needs an API key, sent as `Authorization: Bearer <key>`",
                ),
            );
        };
        let Some(scope) = bearer(value).and_then(|t| self.scope_of(t)) else {
            return refuse(
                "invalid",
                ApiError::unauthenticated(
                    "authorization: incorrect API key provided (expected `Bearer <key>` with a key this server knows)",
                ),
            );
        };
        if scope < needs {
            return refuse(
                "scope",
                ApiError::forbidden(
                    "authorization: this API key has the user scope; this route needs an admin key",
                ),
            );
        }
        Ok(scope)
    }

    /// For handlers that need more than their route's check: admin scope when keys are on.
    pub fn require_admin(&self, caller: Option<&Caller>) -> Result<(), ApiError> {
        match caller {
            _ if !self.is_on() => Ok(()),
            Some(Caller(Scope::Admin)) => Ok(()),
            _ => {
                metrics()
                    .auth_rejected
                    .add(1, &[KeyValue::new(attr::REASON, "scope")]);
                Err(ApiError::forbidden(
                    "authorization: this API key has the user scope; this call needs an admin key",
                ))
            }
        }
    }
}

/// The key of an `Authorization: Bearer <key>` value.
fn bearer(value: &str) -> Option<&str> {
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

/// `SECRET` or `admin:SECRET` (`user:SECRET` says the default out loud), optionally followed by
/// ` tenant=NAME`.
fn parse(spec: &str) -> Result<Key, String> {
    let mut words = spec.split_whitespace();
    let spec = words.next().unwrap_or("");
    let mut tenant = None;
    for option in words {
        match option.split_once('=') {
            Some(("tenant", name)) => {
                rag::tenant::check_name(name)?;
                tenant = Some(name.to_string());
            }
            _ => {
                return Err(
                    "after the key only ` tenant=NAME` may follow (an API key has no spaces)"
                        .into(),
                )
            }
        }
    }
    let (scope, key) = match spec.split_once(':') {
        Some(("admin", key)) => (Scope::Admin, key),
        Some(("user", key)) => (Scope::User, key),
        _ => (Scope::User, spec),
    };
    if key.is_empty() {
        return Err("an API key must not be empty".into());
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(
            "an API key must be printable ASCII without spaces (it travels in a header)".into(),
        );
    }
    Ok(Key {
        digest: Sha256::digest(key.as_bytes()).into(),
        scope,
        tenant,
    })
}

/// The scope a route needs, or `None` for the open ones (probes and the scrape).
pub fn scope_for(method: &Method, path: &str) -> Option<Scope> {
    match path {
        // The page and its assets hold no data; what it shows comes through the routes below.
        "/health" | "/ready" | "/metrics" | "/" | "/ui" | "/ui/app.js" | "/ui/style.css" => None,
        // Recent traces are debug data whichever route serves them.
        p if p.starts_with("/admin/")
            || p.starts_with("/debug/")
            || p.starts_with("/ui/traces") =>
        {
            Some(Scope::Admin)
        }
        "/v1/documents" if method == Method::POST => Some(Scope::Admin),
        p if p.starts_with("/v1/documents/") => Some(Scope::Admin),
        _ => Some(Scope::User),
    }
}

/// The HTTP check: every route but the open ones needs a key when keys are on.
pub async fn require_key(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    if !state.auth.is_on() {
        return next.run(req).await;
    }
    let Some(needs) = scope_for(req.method(), req.uri().path()) else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    match state.auth.check(given, needs) {
        Ok(scope) => {
            req.extensions_mut().insert(Caller(scope));
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

/// The gRPC check, before any handler: UNAVAILABLE once shutdown began, UNAUTHENTICATED without
/// a known key (when keys are on). The caller's scope goes into the request for handlers that
/// need admin (`Ingest`).
pub fn grpc_interceptor(
    keys: Arc<ApiKeys>,
    readiness: Arc<Readiness>,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |mut req: tonic::Request<()>| {
        if readiness.is_draining() {
            return Err(ApiError::draining().into());
        }
        if keys.is_on() {
            let given = req
                .metadata()
                .get("authorization")
                .map(|v| v.to_str().unwrap_or(""));
            let scope = keys.check(given, Scope::User)?;
            req.extensions_mut().insert(Caller(scope));
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn keys_carry_their_scope_and_unknown_ones_fail() {
        let keys = ApiKeys::from_specs(&["u-key-1", "admin:a-key-2", "user:u-key-3"]).unwrap();
        let check = |v: Option<&str>, needs| keys.check(v, needs).map_err(|e| e.status);
        assert_eq!(check(Some("Bearer u-key-1"), Scope::User), Ok(Scope::User));
        assert_eq!(check(Some("Bearer u-key-3"), Scope::User), Ok(Scope::User));
        assert_eq!(
            check(Some("Bearer a-key-2"), Scope::Admin),
            Ok(Scope::Admin)
        );
        assert_eq!(check(Some("Bearer a-key-2"), Scope::User), Ok(Scope::Admin));
        assert_eq!(
            check(Some("Bearer u-key-1"), Scope::Admin),
            Err(StatusCode::FORBIDDEN)
        );
        for wrong in [
            None,
            Some("u-key-1"),
            Some("Bearer u-key"),
            Some("Bearer admin:a-key-2"),
        ] {
            assert_eq!(
                check(wrong, Scope::User),
                Err(StatusCode::UNAUTHORIZED),
                "{wrong:?}"
            );
        }
        let e = keys.check(Some("Bearer nope"), Scope::User).unwrap_err();
        assert_eq!(e.code, Some("invalid_api_key"));
        assert_eq!(e.kind, "invalid_request_error");
        assert!(!e.message.contains("nope"), "{}", e.message);
    }

    #[test]
    fn a_key_may_name_its_tenant() {
        let keys = ApiKeys::from_specs(&["k1 tenant=acme", "admin:k2 tenant=ops", "k3"]).unwrap();
        assert_eq!(keys.tenant_of(Some("Bearer k1")).as_deref(), Some("acme"));
        assert_eq!(keys.tenant_of(Some("Bearer k2")).as_deref(), Some("ops"));
        assert_eq!(keys.tenant_of(Some("Bearer k3")), None);
        assert_eq!(keys.tenant_of(Some("Bearer k1 tenant=acme")), None);
        assert_eq!(keys.tenant_of(Some("k1")), None);
        assert!(matches!(
            keys.check(Some("Bearer k2"), Scope::Admin),
            Ok(Scope::Admin)
        ));
        assert_eq!(keys.tenants(), ["acme", "ops"]);
    }

    #[test]
    fn bad_key_specs_are_refused_without_echoing_them() {
        assert!(ApiKeys::from_specs(&["admin:"]).is_err());
        let e = ApiKeys::from_specs(&["has space"]).unwrap_err();
        assert!(!e.contains("has space"), "{e}");
        let e = ApiKeys::from_specs(&["k tenant=bad/name"]).unwrap_err();
        assert!(e.contains("tenant name"), "{e}");
        assert!(!ApiKeys::default().is_on());
        assert_eq!(
            format!("{:?}", ApiKeys::from_specs(&["s3cret"]).unwrap()),
            "ApiKeys(1 configured)"
        );
    }

    #[test]
    fn routes_need_the_scope_the_manual_says() {
        let (get, post, delete) = (Method::GET, Method::POST, Method::DELETE);
        assert_eq!(scope_for(&get, "/health"), None);
        assert_eq!(scope_for(&get, "/ready"), None);
        assert_eq!(scope_for(&get, "/metrics"), None);
        assert_eq!(scope_for(&post, "/v1/rag/query"), Some(Scope::User));
        assert_eq!(scope_for(&post, "/v1/chat/completions"), Some(Scope::User));
        assert_eq!(scope_for(&get, "/v1/models"), Some(Scope::User));
        assert_eq!(scope_for(&post, "/v1/documents"), Some(Scope::Admin));
        assert_eq!(scope_for(&delete, "/v1/documents/a"), Some(Scope::Admin));
        assert_eq!(scope_for(&get, "/debug/traces"), Some(Scope::Admin));
        assert_eq!(scope_for(&get, "/admin/faults"), Some(Scope::Admin));
        assert_eq!(scope_for(&get, "/"), None);
        assert_eq!(scope_for(&get, "/ui/app.js"), None);
        assert_eq!(scope_for(&get, "/ui/config"), Some(Scope::User));
        assert_eq!(
            scope_for(&get, "/ui/traces/0af7651916cd43dd8448eb211c80319c"),
            Some(Scope::Admin)
        );
        assert_eq!(scope_for(&get, "/nowhere"), Some(Scope::User));
    }
}
