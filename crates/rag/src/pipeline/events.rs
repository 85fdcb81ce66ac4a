//! The channel a streamed answer's events take from the generation (on a model worker) to the
//! transport writing them (SSE, OpenAI chunks, gRPC).
//!
//! Bounded by time, not by blocking: a send never waits, because a worker's decode step serves
//! every stream batched with this one. Once more than `capacity` events lie unread for longer
//! than `stall_timeout` (the client stopped reading and the socket is full), the next send
//! fails with [`SendError::Stalled`] and the generation stops. So a client that stops reading
//! holds at most `capacity` events plus what was generated during the timeout, and no model
//! time after it; a closed receiver (the client went away) stops it at the next token.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Event;

/// Why an event could not be sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SendError {
    /// The receiver is gone: the client disconnected.
    Closed,
    /// More than the channel's capacity lay unread for this long.
    Stalled(Duration),
}

struct Shared {
    /// Events sent and not yet received.
    queued: AtomicUsize,
    /// Since when more than `capacity` have been queued.
    full_since: Mutex<Option<Instant>>,
    capacity: usize,
    stall_timeout: Duration,
}

/// The generation's end.
#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::UnboundedSender<Event>,
    shared: Arc<Shared>,
}

/// The transport's end.
pub struct EventReceiver {
    rx: mpsc::UnboundedReceiver<Event>,
    shared: Arc<Shared>,
}

/// A channel that fails sends once more than `capacity` events have waited unread for
/// longer than `stall_timeout`.
pub fn channel(capacity: usize, stall_timeout: Duration) -> (EventSender, EventReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        queued: AtomicUsize::new(0),
        full_since: Mutex::new(None),
        capacity: capacity.max(1),
        stall_timeout,
    });
    (
        EventSender {
            tx,
            shared: shared.clone(),
        },
        EventReceiver { rx, shared },
    )
}

impl EventSender {
    pub fn send(&self, event: Event) -> Result<(), SendError> {
        let shared = &self.shared;
        // Counted before the send, so the receiver never sees an event it was not counted for.
        let queued = shared.queued.fetch_add(1, Ordering::AcqRel) + 1;
        if self.tx.send(event).is_err() {
            return Err(SendError::Closed);
        }
        if queued <= shared.capacity {
            return Ok(());
        }
        let mut full_since = shared.full_since.lock().unwrap_or_else(|e| e.into_inner());
        let waited = full_since.get_or_insert_with(Instant::now).elapsed();
        if waited > shared.stall_timeout {
            Err(SendError::Stalled(waited))
        } else {
            Ok(())
        }
    }
}

impl EventReceiver {
    pub async fn recv(&mut self) -> Option<Event> {
        let event = self.rx.recv().await?;
        let shared = &self.shared;
        if shared.queued.fetch_sub(1, Ordering::AcqRel) - 1 <= shared.capacity {
            *shared.full_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Event {
        Event::Token(Default::default())
    }

    #[tokio::test]
    async fn a_reader_that_keeps_up_never_stalls() {
        let (tx, mut rx) = channel(2, Duration::ZERO);
        for _ in 0..100 {
            tx.send(token()).unwrap();
            tx.send(token()).unwrap();
            rx.recv().await.unwrap();
            rx.recv().await.unwrap();
        }
    }

    #[tokio::test]
    async fn unread_events_past_the_timeout_stall_the_sender() {
        let (tx, mut rx) = channel(2, Duration::from_millis(20));
        for _ in 0..3 {
            tx.send(token()).unwrap(); // the third is over capacity: the clock starts
        }
        std::thread::sleep(Duration::from_millis(30));
        match tx.send(token()) {
            Err(SendError::Stalled(waited)) => assert!(waited >= Duration::from_millis(20)),
            other => panic!("want Stalled, got {other:?}"),
        }
        // Reading drains it below capacity, which resets the clock.
        for _ in 0..3 {
            rx.recv().await.unwrap();
        }
        tx.send(token()).unwrap();
        drop(rx);
        assert_eq!(tx.send(token()), Err(SendError::Closed));
    }
}
