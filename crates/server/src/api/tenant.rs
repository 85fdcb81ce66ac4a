//! Who a request is charged to, decided once as it arrives, for HTTP routes and gRPC calls
//! alike: its API key's tenant when keys are on ([`super::auth`]), else the W3C baggage member
//! `--tenant-baggage-key` names (the client's claim, so never believed with keys on), else
//! `default`. The request then runs as that tenant's ([`rag::tenant::scope`]), and its quota is
//! checked at admission.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{header, Request};
use opentelemetry::baggage::BaggageExt;
use tower::{Layer, Service};

use super::auth::ApiKeys;
use rag::tenant::{scope, Tenant, Tenants, DEFAULT};

/// The tenant of a request: its key's when keys are on (an unknown key's request is refused
/// before it runs, so it is charged to `default` here), else its baggage member's.
fn tenant_of<B>(tenants: &Tenants, keys: &ApiKeys, req: &Request<B>) -> Tenant {
    if keys.is_on() {
        let authorization = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let name = keys.tenant_of(authorization);
        return tenants.get(name.as_deref().unwrap_or(DEFAULT));
    }
    let Some(key) = tenants.baggage_key() else {
        return tenants.get(DEFAULT);
    };
    let cx = telemetry::extract_context(req.headers());
    match cx.baggage().get(key) {
        Some(v) => tenants.get(v.as_str().as_ref()),
        None => tenants.get(DEFAULT),
    }
}

/// Runs every request (HTTP route or gRPC call) as its tenant's.
#[derive(Clone)]
pub struct TenantLayer {
    pub tenants: Arc<Tenants>,
    pub keys: Arc<ApiKeys>,
}

impl<S> Layer<S> for TenantLayer {
    type Service = WithTenant<S>;

    fn layer(&self, inner: S) -> WithTenant<S> {
        WithTenant {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct WithTenant<S> {
    inner: S,
    layer: TenantLayer,
}

impl<S, B> Service<Request<B>> for WithTenant<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let tenant = tenant_of(&self.layer.tenants, &self.layer.keys, &req);
        Box::pin(scope(tenant, self.inner.call(req)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rag::tenant::{TenantArgs, OTHER};

    #[test]
    fn the_tenant_comes_from_the_key_and_baggage_only_counts_without_keys() {
        let tenants = Tenants::new(
            &TenantArgs {
                quotas: Vec::new(),
                baggage_key: Some("tenant".into()),
            },
            &["acme".into()],
        )
        .unwrap();
        let req = |auth: Option<&str>, baggage: Option<&str>| {
            let mut r = Request::builder();
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            if let Some(b) = baggage {
                r = r.header("baggage", b);
            }
            r.body(()).unwrap()
        };
        let open = ApiKeys::default();
        let name =
            |keys: &ApiKeys, r: &Request<()>| tenant_of(&tenants, keys, r).name().to_string();
        assert_eq!(name(&open, &req(None, Some("tenant=acme"))), "acme");
        assert_eq!(name(&open, &req(None, Some("tenant=unknown"))), OTHER);
        assert_eq!(name(&open, &req(None, None)), DEFAULT);
        let keys = ApiKeys::from_specs(&["k1 tenant=acme", "k2"]).unwrap();
        assert_eq!(name(&keys, &req(Some("Bearer k1"), None)), "acme");
        // A keyless tenant claim is not believed when keys are on.
        assert_eq!(
            name(&keys, &req(Some("Bearer k2"), Some("tenant=acme"))),
            DEFAULT
        );
    }
}
