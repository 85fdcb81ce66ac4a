//! The retrieval–generation overlap: with `overlap` on, a RAG request starts prefilling its
//! prompt's head (system turn, history and question: known before retrieval) into the prefix
//! cache on a thread of its own while the query is embedded and searched, so the prompt's
//! prefill starts from a hit. The warm prefill is the request's `warm_prefill` span, beside
//! `embeddings` and `retrieval` on the shared clock. It belongs to the request's admitted job
//! (no worker slot or queue place of its own, no tokens charged twice: the prompt it warms is
//! the one the request is charged for) and generates nothing.
//!
//! When the prompt is ready, a warm still waiting for the prefill turn is called off (the
//! request's own prefill then does the whole prompt, as without overlap), and one under way is
//! waited for: it is a few blocks long and the prefill behind it reads what it wrote. A request
//! that fails first calls its warm off the same way; one already computing finishes, which
//! leaves a valid head in the cache and nothing else. Either way the request waits (until its
//! deadline at most) for the warm's thread to end its span, so the span ends inside the
//! request's; a called-off warm ends as soon as it holds the turn it was waiting for, which the
//! request's own prefill would have waited for too.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use opentelemetry::KeyValue;

use llm::Generator;
use telemetry::names::{attr, span};
use telemetry::span::Stage;

/// Whether RAG requests overlap their prompt head's prefill with retrieval (`--overlap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Overlap {
    /// Embed, retrieve, rerank, build the prompt, then prefill all of it.
    #[default]
    Off,
    /// Prefill the head (system turn, history, question) while embedding and retrieving.
    On,
}

impl Overlap {
    pub fn on(self) -> bool {
        self == Overlap::On
    }
}

const PENDING: u8 = 0;
const RUNNING: u8 = 1;
const CALLED_OFF: u8 = 2;

/// A warm prefill in flight; dropping it calls it off unless it is already computing.
pub struct Warm {
    state: Arc<AtomicU8>,
    done: mpsc::Receiver<()>,
    deadline: Instant,
}

/// How a warm prefill ended (`rag.overlap.outcome` on its span). `asked`: whether the
/// generator got as far as asking to proceed, i.e. had work to do; one that had none (no
/// prefix cache, a head shorter than one block) is `skipped` however early the request
/// called it off, so the outcome names the configuration, not the race.
fn outcome(prefilled: bool, failed: bool, asked: bool) -> &'static str {
    if failed {
        "failed"
    } else if prefilled {
        "prefilled"
    } else if !asked {
        "skipped"
    } else {
        "called_off"
    }
}

impl Warm {
    /// Starts prefilling `head` under a `warm_prefill` child of `request`, whose deadline
    /// bounds the wait for it. `None` when no thread could be started (the request then runs
    /// sequentially).
    pub fn start(
        generator: Arc<dyn Generator>,
        head: Vec<u32>,
        request: &Stage,
        deadline: Instant,
    ) -> Option<Warm> {
        let stage = request.child(span::WARM_PREFILL);
        let state = Arc::new(AtomicU8::new(PENDING));
        let (tx, done) = mpsc::sync_channel(1);
        let shared = state.clone();
        let spawned = std::thread::Builder::new()
            .name("warm-prefill".into())
            .spawn(move || {
                let asked = std::cell::Cell::new(false);
                let proceed = || {
                    asked.set(true);
                    shared
                        .compare_exchange(PENDING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                };
                let result = match generator.prefix_cache() {
                    Some(cache) => cache.warm(&head, &stage, &proceed),
                    None => Ok(None),
                };
                if let Err(e) = &result {
                    stage.fail("model", e.to_string());
                }
                let prefilled = matches!(result, Ok(Some(_)));
                let outcome = outcome(prefilled, result.is_err(), asked.get());
                stage.set(KeyValue::new(attr::OVERLAP_OUTCOME, outcome));
                stage.end();
                let _ = tx.send(());
            });
        spawned.ok().map(|_| Warm {
            state,
            done,
            deadline,
        })
    }

    /// Called once the prompt is built (dropping does the same): calls off a warm that has
    /// not started computing, then waits for its thread to end the span.
    pub fn finish(self) {}

    /// `true` when the warm will not compute (called off now, or nothing to do).
    fn call_off(&self) -> bool {
        match self
            .state
            .compare_exchange(PENDING, CALLED_OFF, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(now) => now != RUNNING,
        }
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        self.call_off();
        let left = self
            .deadline
            .saturating_duration_since(telemetry::clock::now());
        let _ = self.done.recv_timeout(left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_called_off_before_its_turn_never_computes() {
        let state = AtomicU8::new(PENDING);
        let warm = Warm {
            state: Arc::new(state),
            done: mpsc::sync_channel(1).1,
            deadline: Instant::now(),
        };
        // Called off while pending: `finish` must not wait (nobody would ever send).
        assert!(warm.call_off());
        assert_eq!(warm.state.load(Ordering::Acquire), CALLED_OFF);
        assert_eq!(outcome(false, false, true), "called_off");
        warm.finish();
        // A warm that found nothing to do is skipped, called off first or not, and is not
        // waited for either.
        assert_eq!(outcome(false, false, false), "skipped");
        let warm = Warm {
            state: Arc::new(AtomicU8::new(PENDING)),
            done: mpsc::sync_channel(1).1,
            deadline: Instant::now(),
        };
        assert!(warm.call_off());
        // One that is computing is waited for.
        let running = Warm {
            state: Arc::new(AtomicU8::new(RUNNING)),
            done: mpsc::sync_channel(1).1,
            deadline: Instant::now(),
        };
        assert!(!running.call_off());
        assert_eq!(outcome(true, false, true), "prefilled");
        assert_eq!(outcome(false, true, true), "failed");
    }
}
