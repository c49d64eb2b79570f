//! The link's retry schedule, shared by the stream watchers and the record shipper: 100 ms,
//! doubling to 2 s, back to 100 ms after a success.

use std::time::Duration;

const MIN: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_secs(2);

/// Exponential backoff between attempts at one thing.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: MIN }
    }
}

impl Backoff {
    /// The wait before the next attempt; each call doubles the one after, up to 2 s.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(MAX);
        delay
    }

    /// After a success: the next failure waits the shortest time again.
    pub fn reset(&mut self) {
        self.next = MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let mut b = Backoff::default();
        let delays: Vec<u128> = (0..7).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 2000, 2000]);
        b.reset();
        assert_eq!(b.next_delay(), MIN);
    }
}
