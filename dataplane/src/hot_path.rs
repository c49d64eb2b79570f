//! The hot path's per-thread mechanisms, each one on by default and each one measured
//! (ARCHITECTURE.md, "Hot-path mechanisms"). `NM_HOT_PATH_OFF` turns some off, so a benchmark
//! can measure what one buys on today's code; production leaves them all on.

/// Which mechanisms are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotPath {
    /// A request record is completed after the answer's last bytes are written, by one task per
    /// worker, instead of before ([`crate::body`]).
    pub deferred_completion: bool,
    /// A worker remembers the keys it checked against the current key set ([`crate::keys`]).
    pub key_cache: bool,
    /// Each worker has an upstream client and connection pool of its own, picked by the
    /// worker's index ([`crate::forward`], [`crate::workers::current`]).
    pub worker_pools: bool,
    /// Each worker keeps a timer armed a second ahead ([`crate::workers`]).
    pub timer_tick: bool,
}

impl Default for HotPath {
    fn default() -> Self {
        Self {
            deferred_completion: true,
            key_cache: true,
            worker_pools: true,
            timer_tick: true,
        }
    }
}

/// The names `NM_HOT_PATH_OFF` takes.
pub const NAMES: [&str; 4] = [
    "deferred_completion",
    "key_cache",
    "worker_pools",
    "timer_tick",
];

impl HotPath {
    /// Everything on but the comma-separated mechanisms named; `None` for an unknown name.
    pub fn all_but(off: &str) -> Option<Self> {
        let mut on = Self::default();
        for name in off.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let switch = match name {
                "deferred_completion" => &mut on.deferred_completion,
                "key_cache" => &mut on.key_cache,
                "worker_pools" => &mut on.worker_pools,
                "timer_tick" => &mut on.timer_tick,
                _ => return None,
            };
            *switch = false;
        }
        Some(on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_turn_off_their_mechanism_and_nothing_else() {
        assert_eq!(HotPath::all_but(""), Some(HotPath::default()));
        let some = HotPath::all_but(" key_cache, timer_tick ");
        assert_eq!(
            some,
            Some(HotPath {
                key_cache: false,
                timer_tick: false,
                ..HotPath::default()
            })
        );
        let none = HotPath::all_but(&NAMES.join(","));
        assert_eq!(
            none,
            Some(HotPath {
                deferred_completion: false,
                key_cache: false,
                worker_pools: false,
                timer_tick: false,
            })
        );
        assert_eq!(HotPath::all_but("key_cache,turbo"), None);
    }
}
