//! The HTTP API's accept loop: each connection served by hyper (HTTP/1.1, or h2c with prior
//! knowledge) with the connection management the gRPC server has ([`ConnectionArgs`]): HTTP/2
//! keepalive pings, and a maximum age after which a connection is shut down gracefully so its
//! client reconnects, as a load balancer in front of replicas needs to rebalance keep-alive
//! clients. HTTP/1 clients get `--header-read-timeout-s` to send their headers, and every
//! socket has Nagle's algorithm off, so a streamed token is sent when it is written (not held
//! until the client acknowledges the previous one). Past `--max-connections` open, a new
//! connection gets one 503 `too_many_connections` and is closed. Connections are tasks of the
//! loop, so dropping it cuts whatever still runs.

use std::future::Future;
use std::time::Duration;

use axum::response::IntoResponse;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::error::ApiError;
use super::limit::ConnectionLimit;
use crate::config::ConnectionArgs;

/// Connections past the cap being answered 503 at once; past this many, more are just closed.
const REFUSING_AT_ONCE: usize = 64;
/// How long a refused client has to send the request its 503 answers.
const REFUSAL_TIME: Duration = Duration::from_secs(2);

/// Serves `app` on `listener` until `stop` resolves, then stops accepting, shuts every
/// connection down gracefully (HTTP/1 finishes the response in flight, HTTP/2 sends GOAWAY and
/// finishes its streams) and returns once all have closed.
///
/// A connection older than `--max-connection-age-s` is shut down the same way and cut
/// `--max-connection-age-grace-s` later if still open. Each connection's age is drawn within
/// ±10% of the flag, so a pool of connections opened together does not close (and reconnect)
/// together.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    connections: &ConnectionArgs,
    stop: impl Future<Output = ()> + Clone + Send + 'static,
) -> std::io::Result<()> {
    let mut builder = Builder::new(TokioExecutor::new());
    // hyper's HTTP/1 header timeout only runs with a timer; without one it is silently off.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(connections.header_read_timeout_s);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(connections.http2_keepalive_interval_s);
    if let Some(timeout) = connections.http2_keepalive_timeout_s {
        builder.http2().keep_alive_timeout(timeout);
    }
    let (age, grace) = (
        connections.max_connection_age_s,
        connections.max_connection_age_grace_s,
    );
    let limit = ConnectionLimit::new(connections.max_connections as usize, "http");
    let mut refusing = JoinSet::new();
    let mut tasks = JoinSet::new();
    let stopping = stop.clone();
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            _ = &mut stopping => break,
            // Reaps finished connections so the set holds only open ones.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            Some(_) = refusing.join_next(), if !refusing.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(error = %e, "TCP_NODELAY could not be set");
                    }
                    match limit.admit() {
                        Some(slot) => {
                            let limits = Lifetime { age: age.map(jittered), grace };
                            let conn = connection(builder.clone(), stream, app.clone(), limits, stop.clone());
                            tasks.spawn(async move {
                                conn.await;
                                drop(slot);
                            });
                        }
                        None if refusing.len() < REFUSING_AT_ONCE => {
                            refusing.spawn(refuse(stream, limit.max()));
                        }
                        None => drop(stream),
                    }
                }
                Err(e) => accept_failed(e).await,
            },
        }
    }
    drop(listener);
    refusing.abort_all();
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Answers every request on a connection past the cap with a 503 (HTTP/1: one, then closes),
/// within [`REFUSAL_TIME`].
async fn refuse(stream: TcpStream, max: usize) {
    let busy = axum::Router::new().fallback(move || async move {
        let mut response = ApiError::too_many_connections(max).into_response();
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        response
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .keep_alive(false)
        .timer(TokioTimer::new())
        .header_read_timeout(REFUSAL_TIME);
    let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(busy));
    let _ = tokio::time::timeout(REFUSAL_TIME, conn).await;
}

/// How long one connection may live: graceful shutdown at `age`, cut `grace` after that.
#[derive(Debug, Clone, Copy)]
struct Lifetime {
    age: Option<Duration>,
    grace: Option<Duration>,
}

async fn connection(
    builder: Builder<TokioExecutor>,
    stream: TcpStream,
    app: axum::Router,
    limits: Lifetime,
    stop: impl Future<Output = ()>,
) {
    let conn =
        builder.serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(app));
    tokio::pin!(conn, stop);
    let aged = tokio::time::sleep(limits.age.unwrap_or(Duration::MAX));
    let cut = tokio::time::sleep(Duration::MAX);
    tokio::pin!(aged, cut);
    // Once set, neither the age nor `stop` is polled again: one graceful shutdown is enough.
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
                return;
            }
            _ = &mut aged, if !closing && limits.age.is_some() => {
                closing = true;
                conn.as_mut().graceful_shutdown();
                if let Some(grace) = limits.grace {
                    cut.as_mut().reset(tokio::time::Instant::now() + grace);
                }
            }
            _ = &mut stop, if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = &mut cut => return,
        }
    }
}

/// Within ±10% of `age`.
fn jittered(age: Duration) -> Duration {
    age.mul_f64(0.9 + 0.2 * rand::random::<f64>())
}

/// A connection reset before it was accepted is its client's business; anything else (out of
/// file descriptors) is logged and paused on, so the loop does not spin on it.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::warn!(error = %e, "accepting an HTTP connection failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_jittered_within_ten_percent() {
        let age = Duration::from_secs(10);
        let drawn: Vec<Duration> = (0..200).map(|_| jittered(age)).collect();
        assert!(drawn
            .iter()
            .all(|d| *d >= age.mul_f64(0.9) && *d <= age.mul_f64(1.1)));
        let (lo, hi) = (drawn.iter().min().unwrap(), drawn.iter().max().unwrap());
        assert!(*hi - *lo > Duration::from_millis(500), "{lo:?}..{hi:?}");
    }
}
