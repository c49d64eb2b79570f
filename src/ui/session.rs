//! Signed-in sessions: a random id (the cookie) mapped, in this process's memory only, to the
//! key that signed in and a CSRF token for the sign-out form, until it expires. The key's
//! secret is kept here because every page is an admin gRPC call made with it (`nm-key`): a key
//! revoked or expired since the sign-in fails that call, and the page signs the session out.
//! The map is bounded; a restart signs everyone out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::RngCore;

/// How long a session lasts after its sign-in.
pub const TTL: Duration = Duration::from_secs(8 * 3600);
/// Most sessions held at once; beyond, the one closest to its end is dropped.
pub const MAX_SESSIONS: usize = 10_000;

/// A signed-in session.
#[derive(Clone)]
pub struct Session {
    pub secret: String,
    pub key_id: String,
    pub role: String,
    pub csrf: String,
    pub expires: Instant,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("key_id", &self.key_id)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// The sessions of this process.
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

/// 32 random bytes as hex.
pub fn token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Sessions {
    /// Starts a session for a key; returns its id.
    pub fn start(&self, secret: String, key_id: String, role: String, now: Instant) -> String {
        let id = token();
        let session = Session {
            secret,
            key_id,
            role,
            csrf: token(),
            expires: now + TTL,
        };
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, s| s.expires > now);
        if map.len() >= MAX_SESSIONS {
            let oldest = map
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                map.remove(&k);
            }
        }
        map.insert(id.clone(), session);
        id
    }

    /// The live session of this id.
    pub fn get(&self, id: &str, now: Instant) -> Option<Session> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(id) {
            Some(s) if s.expires > now => Some(s.clone()),
            Some(_) => {
                map.remove(id);
                None
            }
            None => None,
        }
    }

    /// Ends a session.
    pub fn end(&self, id: &str) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_and_end() {
        let s = Sessions::default();
        let t0 = Instant::now();
        let id = s.start("nmk_x".into(), "k1".into(), "viewer".into(), t0);
        assert_eq!(id.len(), 64);
        assert!(s.get(&id, t0).is_some());
        assert!(s.get(&id, t0 + TTL).is_none(), "expired");
        assert!(s.get(&id, t0).is_none(), "and forgotten");
        let id = s.start("nmk_x".into(), "k1".into(), "viewer".into(), t0);
        s.end(&id);
        assert!(s.get(&id, t0).is_none());
        assert!(s.get("nope", t0).is_none());
    }

    #[test]
    fn tokens_differ() {
        assert_ne!(token(), token());
    }
}
