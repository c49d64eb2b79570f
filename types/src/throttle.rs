//! Log lines rate-limited per call site: the first event is logged, then at most one per
//! interval, carrying how many were left out since the last line. A fault that strikes every
//! request or accept (a database outage, a full descriptor table) then costs one line a second,
//! not thousands, and the count keeps the volume visible.
//!
//! ```
//! # use nm_types::throttle::Throttle;
//! # use std::time::Duration;
//! let accept_errors = Throttle::new(Duration::from_secs(1));
//! if let Some(suppressed) = accept_errors.allow() {
//!     // log here, with `suppressed` as a field
//! #   let _ = suppressed;
//! }
//! ```
//!
//! Lock-free: one atomic read on the suppressed path, a compare-and-swap when a line is due.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One call site's allowance. Share it (a `static`, a field, an `Arc`) among the tasks whose
/// lines it limits.
#[derive(Debug)]
pub struct Throttle {
    every_ns: u64,
    /// Nanoseconds since [`epoch`] when the next line is due (0: the first one is).
    next_ns: AtomicU64,
    suppressed: AtomicU64,
}

/// The process's reference instant for every throttle.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Throttle {
    /// At most one line per `every`.
    pub const fn new(every: Duration) -> Self {
        let every_ns = every.as_nanos();
        Self {
            every_ns: if every_ns > u64::MAX as u128 {
                u64::MAX
            } else {
                every_ns as u64
            },
            next_ns: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when a line may be logged now (`n` lines were left out since the last one);
    /// `None` when this one is to be left out (and is counted).
    pub fn allow(&self) -> Option<u64> {
        let now = u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.allow_at(now)
    }

    fn allow_at(&self, now_ns: u64) -> Option<u64> {
        let next = self.next_ns.load(Ordering::Relaxed);
        if now_ns < next
            || self
                .next_ns
                .compare_exchange(
                    next,
                    now_ns.saturating_add(self.every_ns).max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_of_the_rest() {
        let t = Throttle::new(Duration::from_secs(1));
        let s = 1_000_000_000;
        assert_eq!(t.allow_at(0), Some(0));
        assert_eq!(t.allow_at(1), None);
        assert_eq!(t.allow_at(s - 1), None);
        assert_eq!(t.allow_at(s), Some(2));
        assert_eq!(t.allow_at(s + 5), None);
        assert_eq!(t.allow_at(3 * s), Some(1));
        assert_eq!(t.allow_at(3 * s + 1), None);
    }

    #[test]
    fn a_flood_gives_one_line_per_interval() {
        let t = Throttle::new(Duration::from_millis(100));
        // 10,000 events spread over one second of (simulated) time: 10 or 11 lines.
        let lines = (0..10_000u64)
            .filter(|i| t.allow_at(i * 100_000).is_some())
            .count();
        assert!((10..=11).contains(&lines), "{lines}");
    }
}
