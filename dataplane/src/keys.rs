//! The in-memory set of valid service keys, and the dataplane's view of its controlplane.
//!
//! The proxy checks `NM-Key` here: one SHA-256 and one hash-map lookup under a read lock, no
//! database and no network. The root keeps the set current from the controlplane's key stream;
//! when the controlplane is unreachable the last known set stays in force and `/health` says so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use nm_types::{KeyHash, hash_key};

/// Who made a request: the service key that authenticated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub key_id: Arc<str>,
    pub admin: bool,
}

/// Valid key hashes -> principal. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct KeySet {
    inner: Arc<RwLock<Arc<HashMap<KeyHash, Principal>>>>,
}

impl KeySet {
    /// Replaces the whole set (a fresh snapshot from the controlplane).
    pub fn replace(&self, keys: HashMap<KeyHash, Principal>) {
        let keys = Arc::new(keys);
        match self.inner.write() {
            Ok(mut guard) => *guard = keys,
            Err(poisoned) => *poisoned.into_inner() = keys,
        }
    }

    fn snapshot(&self) -> Arc<HashMap<KeyHash, Principal>> {
        match self.inner.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The principal for a presented secret, if the key is valid.
    pub fn check(&self, secret: &str) -> Option<Principal> {
        self.snapshot().get(&hash_key(secret)).cloned()
    }

    pub fn len(&self) -> usize {
        self.snapshot().len()
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
                None => Ok(()),
                Some(p) => Err(format!("controlplane unreachable: {p}")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_check_by_hash() {
        let set = KeySet::default();
        assert!(set.check("nmk_a").is_none());
        let p = Principal {
            key_id: Arc::from("key_1"),
            admin: false,
        };
        set.replace(HashMap::from([(hash_key("nmk_a"), p.clone())]));
        assert_eq!(set.check("nmk_a"), Some(p));
        assert!(set.check("nmk_b").is_none());
        set.replace(HashMap::new());
        assert!(set.check("nmk_a").is_none());
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
