//! What the implicit rules remember between a session's requests, in this process only.
//!
//! Per session (a keyed hash of the key id and `NM-Session`, never the id itself): the
//! conversations recently asked (their hash, the answer's request id, when), and the last
//! complete answer (the hash of the conversation it answered, its length, a keyed hash of its
//! text and, with `history_edit` on, its first 4,096 characters).
//!
//! Bounds: a cap in bytes and a time limit. Sessions are spread over [`SHARDS`] mutex-guarded
//! shards (a session's requests may reach any worker thread); each holds its share of the cap
//! and an age queue. A lock is held for a hash-map look-up and a few pushes, never while text is
//! compared: a recalled answer's text is shared out (`Arc`), compared after the lock is gone.
//! Over the cap the sessions touched longest ago go first (`nm_implicit_memory_evicted_total
//! {reason="cap"}`); a session untouched for the time limit is forgotten when its shard is next
//! written (`reason="expired"`) and never recalled after it.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nm_types::signal::RequestIdBytes;

use crate::metrics::Metrics;
use crate::usage::text::{Kept, TextKeys};

/// Shards of the memory (a power of two).
pub const SHARDS: usize = 16;
/// Conversations remembered per session (the newest).
pub const MAX_ASKED: usize = 16;
/// What a session costs beyond its text, counted against the cap: the map entry, its age-queue
/// entries, the asked list's allocation.
const SESSION_BYTES: usize = 256;
const ASKED_BYTES: usize = std::mem::size_of::<Asked>();

/// A conversation asked.
#[derive(Debug, Clone)]
pub struct Asked {
    pub key: u64,
    pub answer: RequestIdBytes,
    pub at: Instant,
}

/// The last complete answer of a session.
#[derive(Debug, Clone)]
pub struct Last {
    pub answer: RequestIdBytes,
    /// The hash of the conversation it answered.
    pub asked: u64,
    pub chars: u64,
    pub hash: u64,
    /// Its first characters (`history_edit` on).
    pub kept: Option<Kept>,
}

#[derive(Debug)]
struct Session {
    /// When last written, and its age-queue stamp.
    touched: Instant,
    stamp: u64,
    asked: VecDeque<Asked>,
    last: Option<Arc<Last>>,
}

impl Session {
    fn bytes(&self) -> usize {
        SESSION_BYTES
            + self.asked.len() * ASKED_BYTES
            + self
                .last
                .as_ref()
                .map_or(0, |l| 96 + l.kept.as_ref().map_or(0, |k| k.len()))
    }
}

#[derive(Debug, Default)]
struct Shard {
    /// The keys are keyed hashes already: a cheap hasher spreads them.
    sessions: HashMap<u64, Session, foldhash::fast::RandomState>,
    /// Sessions by age of their last write: `(session, stamp)`; an entry whose stamp is no
    /// longer its session's is stale and skipped.
    ages: VecDeque<(u64, u64, Instant)>,
    bytes: usize,
    next_stamp: u64,
}

/// What a request recalls of its session.
#[derive(Debug, Default)]
pub struct Recalled {
    /// The newest answer to the same conversation within the window.
    pub regenerated: Option<RequestIdBytes>,
    pub last: Option<Arc<Last>>,
}

/// The rules' memory: shared by every worker of the process.
#[derive(Debug)]
pub struct Memory {
    shards: Box<[Mutex<Shard>]>,
    shard_cap: usize,
    ttl: Duration,
    metrics: Metrics,
}

impl Memory {
    pub fn new(cap_bytes: usize, ttl: Duration, metrics: Metrics) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            shard_cap: cap_bytes / SHARDS,
            ttl,
            metrics,
        }
    }

    /// The key a session is remembered under.
    pub fn session_key(&self, keys: &TextKeys, key_id: &str, session: &str) -> u64 {
        let mut h = keys.build_hasher();
        h.write(key_id.as_bytes());
        h.write_u8(0xff);
        h.write(session.as_bytes());
        h.finish()
    }

    fn shard(&self, session: u64) -> &Mutex<Shard> {
        // The low bits pick the map's buckets; the high ones the shard.
        &self.shards[(session >> 60) as usize % SHARDS]
    }

    /// What the session remembers: the newest answer to `asked` within `window`, and the last
    /// answer.
    pub fn recall(
        &self,
        session: u64,
        asked: Option<u64>,
        window: Duration,
        now: Instant,
    ) -> Recalled {
        let Ok(shard) = self.shard(session).lock() else {
            return Recalled::default();
        };
        let Some(s) = shard.sessions.get(&session) else {
            return Recalled::default();
        };
        if now.saturating_duration_since(s.touched) > self.ttl {
            return Recalled::default();
        }
        let regenerated = asked.and_then(|key| {
            s.asked
                .iter()
                .rev()
                .find(|a| a.key == key && now.saturating_duration_since(a.at) <= window)
                .map(|a| a.answer)
        });
        Recalled {
            regenerated,
            last: s.last.clone(),
        }
    }

    /// Remembers a request's conversation and its answer.
    pub fn remember(&self, session: u64, asked: Option<Asked>, last: Option<Last>, now: Instant) {
        let Ok(mut guard) = self.shard(session).lock() else {
            return;
        };
        let shard = &mut *guard;
        let stamp = shard.next_stamp;
        shard.next_stamp += 1;
        let (s, before) = match shard.sessions.entry(session) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let s = e.into_mut();
                let before = s.bytes();
                (s, before)
            }
            std::collections::hash_map::Entry::Vacant(e) => (
                e.insert(Session {
                    touched: now,
                    stamp,
                    asked: VecDeque::new(),
                    last: None,
                }),
                0,
            ),
        };
        if let Some(asked) = asked {
            if s.asked.len() >= MAX_ASKED {
                s.asked.pop_front();
            }
            s.asked.push_back(asked);
        }
        if let Some(last) = last {
            // No request holds the previous one any more (the usual case): its allocation is
            // reused.
            match s.last.as_mut().and_then(Arc::get_mut) {
                Some(slot) => *slot = last,
                None => s.last = Some(Arc::new(last)),
            }
        }
        s.touched = now;
        s.stamp = stamp;
        let after = s.bytes();
        shard.bytes = shard.bytes.saturating_sub(before) + after;
        self.metrics.implicit_memory_changed(before, after);
        shard.ages.push_back((session, stamp, now));
        self.trim(shard, now);
    }

    /// Forgets expired sessions, then the oldest while over the cap; compacts the age queue.
    fn trim(&self, shard: &mut Shard, now: Instant) {
        while let Some(&(session, stamp, at)) = shard.ages.front() {
            let expired = now.saturating_duration_since(at) > self.ttl;
            if !expired && shard.bytes <= self.shard_cap {
                break;
            }
            shard.ages.pop_front();
            if shard
                .sessions
                .get(&session)
                .is_some_and(|s| s.stamp == stamp)
                && let Some(gone) = shard.sessions.remove(&session)
            {
                let bytes = gone.bytes();
                shard.bytes = shard.bytes.saturating_sub(bytes);
                self.metrics.implicit_memory_changed(bytes, 0);
                self.metrics
                    .implicit_evicted(if expired { "expired" } else { "cap" });
            }
        }
        if shard.ages.len() > 2 * shard.sessions.len() + 64 {
            let mut live: Vec<(u64, u64, Instant)> = shard
                .sessions
                .iter()
                .map(|(k, s)| (*k, s.stamp, s.touched))
                .collect();
            live.sort_unstable_by_key(|e| e.1);
            shard.ages = live.into();
        }
    }

    /// Bytes held, as counted against the cap.
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .filter_map(|s| s.lock().ok().map(|s| s.bytes))
            .sum()
    }

    /// Sessions held.
    pub fn sessions(&self) -> usize {
        self.shards
            .iter()
            .filter_map(|s| s.lock().ok().map(|s| s.sessions.len()))
            .sum()
    }
}
