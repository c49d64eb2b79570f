//! Service API keys: creation, listing, revocation, the bootstrap key, and the in-memory key
//! snapshot that dataplanes watch.
//!
//! Secrets are `nmk_` followed by 48 hex digits (192 random bits). Only their SHA-256 hash is
//! stored. The [`KeyCache`] holds the set of valid hashes; it is refreshed after every change made
//! through this process and re-read from the database every few seconds, so changes made by
//! another controlplane replica on the same database are seen too.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nm_types::{KEY_PREFIX, KeyHash, hash_key};
use rand::RngCore;
use sea_orm::{ActiveModelTrait, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, Set};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::entity::api_key;

/// Name given to the key created from `NM_BOOTSTRAP_KEY`.
pub const BOOTSTRAP_KEY_NAME: &str = "bootstrap";
/// Name given to the admin key generated for a fresh database.
pub const GENERATED_ADMIN_KEY_NAME: &str = "initial-admin";
/// Shortest secret accepted as a bootstrap key.
pub const MIN_BOOTSTRAP_KEY_LEN: usize = 16;

/// A valid key as the dataplanes and the admin check see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: String,
    pub admin: bool,
}

/// The set of valid (unrevoked) keys, by hash.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct KeySnapshot {
    /// Grows by one whenever the set changes.
    pub version: u64,
    pub keys: HashMap<KeyHash, KeyInfo>,
}

/// A key just created: the only moment its secret is known.
#[derive(Debug, Clone)]
pub struct CreatedKey {
    pub key: api_key::Model,
    pub secret: String,
}

/// Shares the current [`KeySnapshot`] with watchers.
#[derive(Debug, Clone)]
pub struct KeyCache {
    tx: Arc<watch::Sender<Arc<KeySnapshot>>>,
}

impl KeyCache {
    fn new() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(Arc::new(KeySnapshot::default()))),
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<KeySnapshot>> {
        self.tx.subscribe()
    }

    pub fn current(&self) -> Arc<KeySnapshot> {
        self.tx.borrow().clone()
    }

    /// Replaces the key set, bumping the version only when it differs.
    fn replace(&self, keys: HashMap<KeyHash, KeyInfo>) {
        self.tx.send_if_modified(|snap| {
            if snap.keys == keys {
                return false;
            }
            *snap = Arc::new(KeySnapshot {
                version: snap.version + 1,
                keys,
            });
            true
        });
    }
}

/// Key management over a [`Store`].
#[derive(Debug, Clone)]
pub struct Keys {
    store: Store,
    cache: KeyCache,
}

impl Keys {
    /// Loads the current key set from the database.
    pub async fn load(store: Store) -> Result<Self> {
        let keys = Self {
            store,
            cache: KeyCache::new(),
        };
        keys.refresh().await?;
        Ok(keys)
    }

    pub fn cache(&self) -> &KeyCache {
        &self.cache
    }

    /// The key a secret belongs to, if it is valid. Memory only: no database access.
    pub fn authenticate(&self, secret: &str) -> Option<KeyInfo> {
        self.cache.current().keys.get(&hash_key(secret)).cloned()
    }

    /// For each (key id, time): whether that key was valid then, i.e. it is live now or was
    /// revoked after that time. A dataplane may deliver a record long after its request (from
    /// its spool), when the key has been revoked since; a key id never issued is never valid.
    /// Live keys are answered from memory; others with one query for the batch.
    pub async fn valid_at(&self, uses: &[(&str, i64)]) -> Result<Vec<bool>> {
        let current = self.cache.current();
        let live: std::collections::HashSet<&str> =
            current.keys.values().map(|k| k.id.as_str()).collect();
        let mut others: Vec<String> = uses
            .iter()
            .filter(|(id, _)| !live.contains(id))
            .map(|(id, _)| (*id).to_owned())
            .collect();
        others.sort_unstable();
        others.dedup();
        let revoked: HashMap<String, Option<i64>> = if others.is_empty() {
            HashMap::new()
        } else {
            api_key::Entity::find()
                .filter(api_key::Column::Id.is_in(others))
                .all(self.store.conn())
                .await?
                .into_iter()
                .map(|k| (k.id, k.revoked_at_ms))
                .collect()
        };
        Ok(uses
            .iter()
            .map(|(id, at)| {
                live.contains(id)
                    || revoked
                        .get(*id)
                        .is_some_and(|r| r.is_none_or(|revoked_at| revoked_at >= *at))
            })
            .collect())
    }

    /// Re-reads the valid keys from the database.
    pub async fn refresh(&self) -> Result<()> {
        let rows = api_key::Entity::find()
            .filter(api_key::Column::RevokedAtMs.is_null())
            .all(self.store.conn())
            .await?;
        let mut keys = HashMap::with_capacity(rows.len());
        for row in rows {
            let Some(hash) = decode_hash(&row.hash_hex) else {
                warn!(key.id = %row.id, "stored key hash is not 64 hex digits; key ignored");
                continue;
            };
            keys.insert(
                hash,
                KeyInfo {
                    id: row.id,
                    admin: row.admin,
                },
            );
        }
        self.cache.replace(keys);
        Ok(())
    }

    /// Re-reads the key set every `period` until the task is dropped.
    pub fn spawn_refresher(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let keys = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = keys.refresh().await {
                    warn!(error = %e, "key refresh failed; keeping the last known key set");
                }
            }
        })
    }

    /// Creates a key with a fresh random secret.
    #[tracing::instrument(skip(self), fields(key.id = tracing::field::Empty))]
    pub async fn create(&self, name: &str, admin: bool) -> Result<CreatedKey> {
        let name = validate_name(name)?;
        let secret = generate_secret();
        let created = self.insert(&name, &secret, admin).await?;
        tracing::Span::current().record("key.id", created.key.id.as_str());
        info!(key.id = %created.key.id, admin, "key created");
        Ok(created)
    }

    async fn insert(&self, name: &str, secret: &str, admin: bool) -> Result<CreatedKey> {
        let model = api_key::ActiveModel {
            id: Set(format!("key_{}", uuid::Uuid::now_v7().simple())),
            name: Set(name.to_owned()),
            hash_hex: Set(encode_hash(&hash_key(secret))),
            display_prefix: Set(display_prefix(secret)),
            admin: Set(admin),
            created_at_ms: Set(crate::now_ms()),
            revoked_at_ms: Set(None),
        }
        .insert(self.store.conn())
        .await?;
        self.refresh().await?;
        Ok(CreatedKey {
            key: model,
            secret: secret.to_owned(),
        })
    }

    /// All keys (unrevoked only unless `include_revoked`), newest first.
    pub async fn list(&self, include_revoked: bool) -> Result<Vec<api_key::Model>> {
        let mut q = api_key::Entity::find().order_by_desc(api_key::Column::CreatedAtMs);
        if !include_revoked {
            q = q.filter(api_key::Column::RevokedAtMs.is_null());
        }
        Ok(q.all(self.store.conn()).await?)
    }

    /// Revokes a key. Revoking twice keeps the first revocation time.
    #[tracing::instrument(skip(self))]
    pub async fn revoke(&self, id: &str) -> Result<api_key::Model> {
        let found = api_key::Entity::find_by_id(id.to_owned())
            .one(self.store.conn())
            .await?
            .ok_or_else(|| Error::NotFound(format!("no key with id {id:?}")))?;
        if found.revoked_at_ms.is_some() {
            return Ok(found);
        }
        let mut active: api_key::ActiveModel = found.into();
        active.revoked_at_ms = Set(Some(crate::now_ms()));
        let updated = active.update(self.store.conn()).await?;
        self.refresh().await?;
        info!(key.id = %id, "key revoked");
        Ok(updated)
    }

    /// Makes sure an admin key exists at start.
    ///
    /// With `bootstrap` set, that secret is an admin key (created if missing; a bootstrap key that
    /// an admin revoked stays revoked). Without it, a database with no keys at all gets one
    /// generated admin key, returned here so the caller can print it once.
    pub async fn ensure_admin(&self, bootstrap: Option<&str>) -> Result<Option<CreatedKey>> {
        if let Some(secret) = bootstrap {
            if secret.len() < MIN_BOOTSTRAP_KEY_LEN
                || secret.chars().any(|c| c.is_control() || c.is_whitespace())
            {
                return Err(Error::Config(format!(
                    "NM_BOOTSTRAP_KEY must be at least {MIN_BOOTSTRAP_KEY_LEN} characters without spaces"
                )));
            }
            let existing = api_key::Entity::find()
                .filter(api_key::Column::HashHex.eq(encode_hash(&hash_key(secret))))
                .one(self.store.conn())
                .await?;
            match existing {
                Some(k) if k.revoked_at_ms.is_some() => {
                    warn!(key.id = %k.id, "NM_BOOTSTRAP_KEY names a revoked key; it stays revoked");
                }
                Some(k) if !k.admin => {
                    warn!(key.id = %k.id, "NM_BOOTSTRAP_KEY names an existing non-admin key; left as it is");
                }
                Some(_) => {}
                None => {
                    let created = self.insert(BOOTSTRAP_KEY_NAME, secret, true).await?;
                    info!(key.id = %created.key.id, "bootstrap admin key created from NM_BOOTSTRAP_KEY");
                }
            }
            return Ok(None);
        }
        let any = api_key::Entity::find().one(self.store.conn()).await?;
        if any.is_some() {
            return Ok(None);
        }
        let created = self
            .insert(GENERATED_ADMIN_KEY_NAME, &generate_secret(), true)
            .await?;
        info!(key.id = %created.key.id, "fresh database: generated the first admin key");
        Ok(Some(created))
    }
}

fn validate_name(name: &str) -> Result<String> {
    let name = name.trim();
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(Error::InvalidArgument(
            "name must be 1 to 128 printable characters".to_owned(),
        ));
    }
    Ok(name.to_owned())
}

fn generate_secret() -> String {
    let mut bytes = [0u8; 24];
    rand::rng().fill_bytes(&mut bytes);
    format!("{KEY_PREFIX}{}", hex(&bytes))
}

fn display_prefix(secret: &str) -> String {
    secret.chars().take(KEY_PREFIX.len() + 8).collect()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

pub fn encode_hash(hash: &KeyHash) -> String {
    hex(hash)
}

pub fn decode_hash(hex: &str) -> Option<KeyHash> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_hex_round_trips() {
        let h = hash_key("nmk_example");
        assert_eq!(decode_hash(&encode_hash(&h)), Some(h));
        assert_eq!(decode_hash("zz"), None);
    }

    #[test]
    fn secrets_have_the_documented_shape() {
        let s = generate_secret();
        assert!(s.starts_with(KEY_PREFIX));
        assert_eq!(s.len(), KEY_PREFIX.len() + 48);
        assert_eq!(display_prefix(&s).len(), 12);
        assert_ne!(s, generate_secret());
    }
}
