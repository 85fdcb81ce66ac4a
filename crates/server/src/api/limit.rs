//! `--max-connections`: how many connections one listener keeps open. A connection is counted
//! from accept to close by an [`OpenConnection`]; one accepted past the cap is turned away
//! before hyper or tonic read anything from it (HTTP answers it a 503 first, in
//! [`super::http`]; gRPC closes it here). Both are on `ragscope_connections_{open,rejected}`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use opentelemetry::KeyValue;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

use telemetry::metrics::metrics;
use telemetry::names::attr;

/// One listener's cap.
#[derive(Debug, Clone)]
pub struct ConnectionLimit {
    open: Arc<Semaphore>,
    max: usize,
    listener: &'static str,
}

impl ConnectionLimit {
    /// At most `max` open connections on the listener named `listener` (the metric label).
    pub fn new(max: usize, listener: &'static str) -> ConnectionLimit {
        ConnectionLimit {
            open: Arc::new(Semaphore::new(max)),
            max,
            listener,
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// The slot of a connection just accepted, or `None` (counted as rejected) if the
    /// listener is at its cap.
    pub fn admit(&self) -> Option<OpenConnection> {
        let label = [KeyValue::new(attr::LISTENER, self.listener)];
        match self.open.clone().try_acquire_owned() {
            Ok(permit) => {
                metrics().connections_open.add(1, &label);
                Some(OpenConnection {
                    _permit: permit,
                    listener: self.listener,
                })
            }
            Err(_) => {
                metrics().connections_rejected.add(1, &label);
                None
            }
        }
    }

    /// `incoming` with every connection past the cap closed at once, and each admitted one
    /// holding its slot until tonic drops it.
    pub fn limit<S, IO>(self, incoming: S) -> impl Stream<Item = io::Result<Limited<IO>>>
    where
        S: Stream<Item = io::Result<IO>>,
    {
        incoming.filter_map(move |accepted| {
            let admitted = match accepted {
                Ok(io) => self.admit().map(|slot| Ok(Limited { io, _slot: slot })),
                Err(e) => Some(Err(e)),
            };
            std::future::ready(admitted)
        })
    }
}

/// An open connection's slot under its listener's cap, given back when dropped.
#[derive(Debug)]
pub struct OpenConnection {
    _permit: OwnedSemaphorePermit,
    listener: &'static str,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics()
            .connections_open
            .add(-1, &[KeyValue::new(attr::LISTENER, self.listener)]);
    }
}

/// A connection and its slot: the I/O is `IO`'s own.
#[derive(Debug)]
pub struct Limited<IO> {
    io: IO,
    _slot: OpenConnection,
}

impl<IO: Connected> Connected for Limited<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Limited<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Limited<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_given_back_when_its_connection_closes() {
        let limit = ConnectionLimit::new(2, "test");
        let a = limit.admit().expect("first");
        let _b = limit.admit().expect("second");
        assert!(limit.admit().is_none(), "a third past a cap of two");
        drop(a);
        assert!(limit.admit().is_some(), "the closed one's slot");
    }
}
