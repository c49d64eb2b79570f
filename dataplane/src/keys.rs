//! The in-memory set of valid keys (with each one's role, scope and expiry), and the dataplane's view of its controlplane.
//!
//! The proxy checks `NM-Key` here: one SHA-256, one HMAC (the key's verifier, see
//! [`VerifierKey`]) and one hash-map lookup under a read lock (or, for a key this thread checked
//! against the current set already, two SipHashes and one lookup in a small thread-local cache),
//! no database and no network. The root keeps the set current from the controlplane's key
//! stream; when the controlplane is unreachable the last known set stays in force and `/health`
//! says so. Until the first snapshot arrives the set is *not loaded*: requests are answered 503,
//! not 401, since no key can be judged yet.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use nm_types::access::{Role, Scope};
use nm_types::{KeyHash, VerifierKey};

/// Who made a request: the key that authenticated it, what it may do and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub key_id: Arc<str>,
    pub role: Role,
    /// `None`: unrestricted (no request is refused for its provider, model, agent or env).
    pub scope: Option<Arc<Scope>>,
    /// When this secret stops being accepted, by this process's clock (ms since the epoch).
    pub expires_at_ms: Option<i64>,
}

impl Principal {
    /// An unrestricted service key that never expires.
    pub fn service(key_id: &str) -> Self {
        Self {
            key_id: Arc::from(key_id),
            role: Role::Service,
            scope: None,
            expires_at_ms: None,
        }
    }

    /// Whether the secret has expired. Reads the clock only for a key that expires.
    pub fn is_expired(&self) -> bool {
        self.expires_at_ms.is_some_and(|at| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            at <= now
        })
    }
}

/// Valid key verifiers -> principal. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct KeySet {
    inner: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    verifier: VerifierKey,
    /// Whether checks go through the thread's cache ([`CHECKED`]); off only for benchmarks.
    cache: bool,
    snapshot: RwLock<Arc<Snapshot>>,
    /// The snapshot's generation, readable without the lock: a check answered from the
    /// thread's cache reads only this, which every thread can keep in its own CPU cache (it
    /// changes only when the set is replaced). Taking the read lock and cloning the snapshot's
    /// `Arc` on every request wrote to cache lines that every HTTP worker shares.
    generation: AtomicU64,
}

/// One version of the set. Its generation is unique in the process (across every `KeySet`), so
/// a cached check names exactly the snapshot it was made against.
#[derive(Debug, Default)]
struct Snapshot {
    generation: u64,
    keys: HashMap<KeyHash, Principal>,
}

/// Source of snapshot generations; 0 is the empty default set's.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// Secrets checked at most this many per thread are remembered; a full cache starts over.
const CACHE_CAPACITY: usize = 1024;

thread_local! {
    /// This thread's recent successful checks. A client sends the same key on every request, and
    /// the SHA-256 and HMAC of a check were 2–3% of the proxy's instructions.
    static CHECKED: RefCell<Checked> = RefCell::new(Checked::default());
}

/// Successful checks: a presented secret's [`Checked::tag`] -> (generation, principal). An entry
/// counts only for the snapshot it was made against, so replacing the set (a revocation)
/// invalidates every entry at once. The secret itself is never kept.
#[derive(Default)]
struct Checked {
    /// Two SipHash-1-3 keys, from std's `RandomState` (seeded at random for each thread).
    keys: (std::hash::RandomState, std::hash::RandomState),
    entries: HashMap<u128, (u64, Principal), foldhash::fast::RandomState>,
}

impl Checked {
    /// A secret's tag: SipHash-1-3 under both of the thread's keys, 128 bits. A keyed PRF, so
    /// another string with a cached secret's tag cannot be found without the keys, and the tag
    /// tells nothing of the secret. About a tenth of the SHA-256 and HMAC it stands in for.
    fn tag(&self, secret: &str) -> u128 {
        use std::hash::BuildHasher;
        (u128::from(self.keys.0.hash_one(secret)) << 64) | u128::from(self.keys.1.hash_one(secret))
    }
}

impl KeySet {
    /// An empty, not yet loaded set whose snapshots hold verifiers made with `verifier`.
    pub fn new(verifier: VerifierKey) -> Self {
        Self::with_cache(verifier, true)
    }

    /// [`KeySet::new`], with the thread-local cache of checks on or off.
    pub fn with_cache(verifier: VerifierKey, cache: bool) -> Self {
        Self {
            inner: Arc::new(Shared {
                verifier,
                cache,
                snapshot: RwLock::default(),
                generation: AtomicU64::new(0),
            }),
        }
    }

    /// Whether a snapshot has arrived (before that no key can be judged).
    pub fn is_loaded(&self) -> bool {
        self.inner.generation.load(Ordering::Acquire) != 0
    }

    /// Replaces the whole set (a fresh snapshot from the controlplane): verifier -> principal.
    pub fn replace(&self, keys: HashMap<KeyHash, Principal>) {
        let snapshot = Arc::new(Snapshot {
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
            keys,
        });
        let generation = snapshot.generation;
        let mut guard = match self.inner.snapshot.write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        *guard = snapshot;
        self.inner.generation.store(generation, Ordering::Release);
    }

    fn snapshot(&self) -> Arc<Snapshot> {
        match self.inner.snapshot.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The principal for a presented secret, if the key is valid.
    pub fn check(&self, secret: &str) -> Option<Principal> {
        let current = self.inner.generation.load(Ordering::Acquire);
        if !self.inner.cache {
            let snapshot = self.snapshot();
            return snapshot
                .keys
                .get(&self.inner.verifier.of_secret(secret))
                .cloned();
        }
        let (tag, cached) = CHECKED.with_borrow(|c| {
            let tag = c.tag(secret);
            let hit = c
                .entries
                .get(&tag)
                .filter(|(generation, _)| *generation == current)
                .map(|(_, p)| p.clone());
            (tag, hit)
        });
        if cached.is_some() {
            return cached;
        }
        let snapshot = self.snapshot();
        let found = snapshot.keys.get(&self.inner.verifier.of_secret(secret))?;
        // This thread's own copies of the key id and scope: the requests that clone and drop
        // them then count on `Arc`s no other worker touches.
        let principal = Principal {
            key_id: Arc::from(&*found.key_id),
            role: found.role,
            scope: found.scope.as_ref().map(|s| Arc::new(Scope::clone(s))),
            expires_at_ms: found.expires_at_ms,
        };
        CHECKED.with_borrow_mut(|c| {
            if c.entries.len() >= CACHE_CAPACITY {
                c.entries.clear();
            }
            c.entries
                .insert(tag, (snapshot.generation, principal.clone()));
        });
        Some(principal)
    }

    pub fn len(&self) -> usize {
        self.snapshot().keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What `/health` reports: whether the controlplane is reachable and whether we are draining.
#[derive(Debug, Clone)]
pub struct Health {
    inner: Arc<Mutex<HealthState>>,
}

#[derive(Debug)]
struct HealthState {
    /// `None` when the controlplane is reachable; otherwise why not.
    controlplane_problem: Option<String>,
    /// Whether the first end-user budget state has arrived (requests naming an end user are
    /// refused until then).
    budgets_loaded: bool,
    /// Why the controlplane's database does not take writes (from its key snapshots); `None`
    /// while it does.
    write_problem: Option<String>,
    draining: bool,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            inner: Arc::new(Mutex::new(HealthState {
                controlplane_problem: Some(
                    "waiting for the first key snapshot from the controlplane".to_owned(),
                ),
                budgets_loaded: false,
                write_problem: None,
                draining: false,
            })),
        }
    }
}

impl Health {
    fn with<R>(&self, f: impl FnOnce(&mut HealthState) -> R) -> R {
        match self.inner.lock() {
            Ok(mut g) => f(&mut g),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    pub fn set_controlplane_ok(&self) {
        self.with(|s| s.controlplane_problem = None);
    }

    pub fn set_controlplane_problem(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.with(|s| s.controlplane_problem = Some(reason));
    }

    /// What the controlplane last said about its database taking writes.
    pub fn set_write_problem(&self, problem: Option<String>) {
        self.with(|s| s.write_problem = problem);
    }

    pub fn set_budgets_loaded(&self) {
        self.with(|s| s.budgets_loaded = true);
    }

    pub fn set_draining(&self) {
        self.with(|s| s.draining = true);
    }

    /// `Ok` when healthy, else the reason.
    pub fn status(&self) -> Result<(), String> {
        self.with(|s| {
            if s.draining {
                return Err("shutting down".to_owned());
            }
            match &s.controlplane_problem {
                None if !s.budgets_loaded => {
                    Err("waiting for the end-user budgets from the controlplane".to_owned())
                }
                None => match &s.write_problem {
                    None => Ok(()),
                    Some(p) => Err(format!(
                        "the controlplane cannot store signals and records: {p}"
                    )),
                },
                Some(p) => Err(format!("controlplane unreachable: {p}")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verifier() -> VerifierKey {
        VerifierKey::from_link_secret("test link secret")
    }

    fn entry(secret: &str, p: Principal) -> (KeyHash, Principal) {
        (verifier().of_secret(secret), p)
    }

    #[test]
    fn keys_check_by_verifier() {
        let set = KeySet::new(verifier());
        assert!(!set.is_loaded());
        assert!(set.check("nmk_a").is_none());
        let p = Principal::service("key_1");
        set.replace(HashMap::from([entry("nmk_a", p.clone())]));
        assert!(set.is_loaded());
        assert_eq!(set.check("nmk_a"), Some(p.clone()));
        // A verifier made under another link secret matches nothing.
        let other = VerifierKey::from_link_secret("another link secret");
        set.replace(HashMap::from([(other.of_secret("nmk_a"), p)]));
        assert!(set.check("nmk_a").is_none());
        set.replace(HashMap::from([entry("nmk_a", Principal::service("key_1"))]));
        assert!(set.check("nmk_b").is_none());
        set.replace(HashMap::new());
        assert!(set.check("nmk_a").is_none());
    }

    /// Checks are cached per thread; the cache must never outlive the snapshot it was made
    /// against, nor answer for another set.
    #[test]
    fn cached_checks_follow_replacements_and_sets() {
        let p = Principal::service;
        let a = KeySet::new(verifier());
        let b = KeySet::new(verifier());
        a.replace(HashMap::from([entry("nmk_a", p("key_1"))]));
        b.replace(HashMap::from([entry("nmk_b", p("key_2"))]));
        for _ in 0..3 {
            assert_eq!(a.check("nmk_a"), Some(p("key_1")));
            assert_eq!(b.check("nmk_b"), Some(p("key_2")));
            assert_eq!(b.check("nmk_a"), None, "a key of another set");
        }
        // Revoked: gone at once, though checked a moment ago.
        a.replace(HashMap::new());
        assert_eq!(a.check("nmk_a"), None);
        // Re-issued under another id: the new principal, not the cached one.
        a.replace(HashMap::from([entry("nmk_a", p("key_3"))]));
        assert_eq!(a.check("nmk_a"), Some(p("key_3")));
        // A full cache starts over without losing correctness.
        for i in 0..(CACHE_CAPACITY + 10) {
            assert_eq!(a.check(&format!("nmk_unknown_{i}")), None);
        }
        let keys = (0..CACHE_CAPACITY + 10)
            .map(|i| entry(&format!("nmk_{i}"), p(&format!("key_{i}"))))
            .collect();
        a.replace(keys);
        for i in 0..(CACHE_CAPACITY + 10) {
            assert_eq!(a.check(&format!("nmk_{i}")), Some(p(&format!("key_{i}"))));
        }
        assert_eq!(a.check("nmk_0"), Some(p("key_0")));
    }

    #[test]
    fn health_transitions() {
        let h = Health::default();
        assert!(h.status().is_err());
        h.set_controlplane_ok();
        assert!(h.status().is_err_and(|r| r.contains("budgets")));
        h.set_budgets_loaded();
        assert_eq!(h.status(), Ok(()));
        h.set_controlplane_problem("connection refused");
        assert!(h.status().is_err_and(|r| r.contains("connection refused")));
        h.set_controlplane_ok();
        h.set_draining();
        assert!(h.status().is_err_and(|r| r.contains("shutting down")));
    }
}
