//! The one clock every span, event and timing in the process is stamped from.
//!
//! Design: the clock is anchored exactly once, reading the wall clock and the monotonic clock
//! back to back. From then on every timestamp is an [`Instant`] (monotonic, never steps back)
//! and is converted to wall time only when it leaves the process, as `anchor_wall + (t - anchor)`.
//! Because a child stage is started after and ended before its parent on the same monotonic
//! clock, and all conversions share one anchor, a child's interval always lies inside its
//! parent's, whichever thread did the work. NTP steps of the wall clock after start-up cannot
//! reorder spans; they only shift the whole process's timeline, which is what we want.

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

struct Anchor {
    wall: SystemTime,
    mono: Instant,
}

static ANCHOR: OnceLock<Anchor> = OnceLock::new();

fn anchor() -> &'static Anchor {
    ANCHOR.get_or_init(|| Anchor {
        wall: SystemTime::now(),
        mono: Instant::now(),
    })
}

/// Reads the shared clock. Anchors it on first use.
pub fn now() -> Instant {
    anchor();
    Instant::now()
}

/// Converts a reading of the shared clock to wall time for export.
pub fn to_wall(t: Instant) -> SystemTime {
    let a = anchor();
    match t.checked_duration_since(a.mono) {
        Some(after) => a.wall + after,
        None => a.wall - (a.mono - t),
    }
}

/// Milliseconds from the clock's anchor to a wall time from [`to_wall`] (negative before it):
/// one number line for every reading in the process, the unit of the stage-event stream. It
/// inverts `to_wall` exactly, so spans read back from the trace buffer land on the same line.
pub fn anchor_millis(wall: SystemTime) -> f64 {
    let a = anchor();
    match wall.duration_since(a.wall) {
        Ok(after) => millis(after),
        Err(before) => -millis(before.duration()),
    }
}

/// Nanoseconds since the Unix epoch, the unit of OTLP timestamps.
pub fn unix_nanos(wall: SystemTime) -> u128 {
    wall.duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos()
}

/// Milliseconds as a float, the unit of every timing we report to clients.
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_time_preserves_monotonic_order_and_spacing() {
        let a = now();
        std::thread::sleep(Duration::from_millis(2));
        let b = now();
        let (wa, wb) = (to_wall(a), to_wall(b));
        assert_eq!(wb.duration_since(wa).unwrap(), b - a);
    }

    #[test]
    fn anchor_millis_and_unix_nanos_agree_on_spacing() {
        let a = now();
        std::thread::sleep(Duration::from_millis(3));
        let b = now();
        let (wa, wb) = (to_wall(a), to_wall(b));
        let ms = anchor_millis(wb) - anchor_millis(wa);
        let ns = unix_nanos(wb) - unix_nanos(wa);
        assert!((ms - millis(b - a)).abs() < 1e-6, "{ms}");
        assert_eq!(ns, (b - a).as_nanos());
    }

    #[test]
    fn instants_before_the_anchor_map_before_it() {
        let early = Instant::now();
        let later = now();
        assert!(to_wall(early) <= to_wall(later));
    }
}
