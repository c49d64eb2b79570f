//! API keys: creation, listing, revocation, rotation, changes of role, scope, labels and
//! expiry, the bootstrap key, and the in-memory key snapshot that dataplanes watch.
//!
//! Secrets are `nmk_` followed by 48 hex digits (192 random bits). Only their SHA-256 hash is
//! stored. The [`KeyCache`] holds every unrevoked key's hashes (two for a key whose rotation's
//! grace period has not been replaced, each with its own expiry); it is refreshed after every
//! change made through this process and re-read from the database every few seconds, so
//! changes made by another controlplane replica on the same database are seen too. An expired
//! key stays in the set, marked, so a dataplane answers `expired_api_key`, not "unknown".
//!
//! Every change is stored with its audit row in one write transaction ([`crate::audit`]).
//!
//! Last use: the ingest notes, per key, the start of the latest request it stored
//! ([`Keys::note_used`], memory only); the refresher writes what changed at most every
//! [`LAST_USE_FLUSH_TICKS`] ticks, one `UPDATE` per key that was used, never one per request.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nm_types::access::{Role, Scope};
use nm_types::{KEY_PREFIX, KeyHash, hash_key};
use rand::RngCore;
use sea_orm::{ActiveModelTrait, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, Set};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::audit::{self, Change, SYSTEM_ACTOR};
use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::entity::api_key;

/// Name given to the key created from `NM_BOOTSTRAP_KEY`.
pub const BOOTSTRAP_KEY_NAME: &str = "bootstrap";
/// Name given to the admin key generated for a fresh database.
pub const GENERATED_ADMIN_KEY_NAME: &str = "initial-admin";
/// Shortest secret accepted as a bootstrap key.
pub const MIN_BOOTSTRAP_KEY_LEN: usize = 16;
/// Most labels on one key.
pub const MAX_LABELS: usize = 16;
/// Longest grace period a rotation grants the replaced secret.
pub const MAX_GRACE: Duration = Duration::from_secs(30 * 86_400);
/// Refresher ticks between two writes of the keys' last use.
pub const LAST_USE_FLUSH_TICKS: u32 = 5;

/// Key labels (`team=search`): the team a budget can name.
pub type Labels = BTreeMap<String, String>;

/// One accepted secret as the dataplanes and the admin check see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: String,
    pub role: Role,
    /// `None`: unrestricted.
    pub scope: Option<Arc<Scope>>,
    /// When this secret stops being accepted: the key's expiry, or for a secret a rotation
    /// replaced, the end of its grace period if earlier.
    pub expires_at_ms: Option<i64>,
}

impl KeyInfo {
    pub fn is_expired(&self, now_ms: i64) -> bool {
        self.expires_at_ms.is_some_and(|t| t <= now_ms)
    }
}

/// The set of accepted secrets (unrevoked keys), by hash.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct KeySnapshot {
    /// Grows by one whenever the set changes.
    pub version: u64,
    pub keys: HashMap<KeyHash, KeyInfo>,
}

/// A key just created or rotated: the only moment its secret is known.
#[derive(Debug, Clone)]
pub struct CreatedKey {
    pub key: api_key::Model,
    pub secret: String,
}

/// What a new key is.
#[derive(Debug, Clone, Default)]
pub struct NewKey {
    pub name: String,
    pub role: Role,
    pub scope: Scope,
    pub labels: Labels,
    pub expires_at_ms: Option<i64>,
}

/// What a change of a key sets; `None` leaves a field as it is.
#[derive(Debug, Clone, Default)]
pub struct KeyChange {
    pub role: Option<Role>,
    pub scope: Option<Scope>,
    pub labels: Option<Labels>,
    /// `Some(None)` removes the expiry.
    pub expires_at_ms: Option<Option<i64>>,
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
    /// Key id -> start of its latest stored request, not yet written to `api_keys`.
    last_used: Arc<Mutex<HashMap<String, i64>>>,
}

impl Keys {
    /// Loads the current key set from the database.
    pub fn load(store: Store) -> crate::BoxFuture<'static, Result<Self>> {
        Box::pin(async move {
            let keys = Self {
                store,
                cache: KeyCache::new(),
                last_used: Arc::default(),
            };
            keys.refresh().await?;
            Ok(keys)
        })
    }

    pub fn cache(&self) -> &KeyCache {
        &self.cache
    }

    /// The key a secret belongs to, if it is unrevoked (expired or not: see
    /// [`KeyInfo::is_expired`]). Memory only: no database access.
    pub fn authenticate(&self, secret: &str) -> Option<KeyInfo> {
        self.cache.current().keys.get(&hash_key(secret)).cloned()
    }

    /// For each (key id, time): whether that key was valid then, i.e. it is live now or was
    /// revoked after that time, and had not expired by then. A dataplane may deliver a record
    /// long after its request (from its spool), when the key has been revoked since; a key id
    /// never issued is never valid. Live keys are answered from memory; others with one query
    /// for the batch.
    pub async fn valid_at(&self, uses: &[(&str, i64)]) -> Result<Vec<bool>> {
        let current = self.cache.current();
        // Live key id -> its latest expiry over its secrets.
        let mut live: HashMap<&str, Option<i64>> = HashMap::new();
        for k in current.keys.values() {
            let e = live.entry(k.id.as_str()).or_insert(k.expires_at_ms);
            *e = match (*e, k.expires_at_ms) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
        }
        let mut others: Vec<String> = uses
            .iter()
            .filter(|(id, _)| !live.contains_key(id))
            .map(|(id, _)| (*id).to_owned())
            .collect();
        others.sort_unstable();
        others.dedup();
        let gone: HashMap<String, (Option<i64>, Option<i64>)> = if others.is_empty() {
            HashMap::new()
        } else {
            api_key::Entity::find()
                .filter(api_key::Column::Id.is_in(others))
                .all(self.store.conn())
                .await?
                .into_iter()
                .map(|k| (k.id, (k.revoked_at_ms, k.expires_at_ms)))
                .collect()
        };
        let before = |expiry: Option<i64>, at: i64| expiry.is_none_or(|e| at < e);
        Ok(uses
            .iter()
            .map(|(id, at)| match live.get(id) {
                Some(expiry) => before(*expiry, *at),
                None => gone.get(*id).is_some_and(|(revoked, expiry)| {
                    revoked.is_none_or(|r| r >= *at) && before(*expiry, *at)
                }),
            })
            .collect())
    }

    /// Notes that these keys made requests starting at these times (records just accepted).
    /// Memory only; [`Keys::flush_last_used`] writes it.
    pub fn note_used<'a>(&self, uses: impl IntoIterator<Item = (&'a str, i64)>) {
        let mut pending = match self.last_used.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        for (id, at) in uses {
            match pending.get_mut(id) {
                Some(t) => *t = (*t).max(at),
                None => {
                    pending.insert(id.to_owned(), at);
                }
            }
        }
    }

    fn pending_last_used(&self) -> HashMap<String, i64> {
        match self.last_used.lock() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Writes the last uses noted since the previous flush: one write transaction, one
    /// `UPDATE` per key, never moving a key's last use backwards (another replica may have
    /// written a later one).
    pub async fn flush_last_used(&self) -> Result<()> {
        let pending = std::mem::take(&mut *match self.last_used.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        });
        if pending.is_empty() {
            return Ok(());
        }
        let write = async {
            let txn = self.store.begin_write().await?;
            let mut ids: Vec<(&String, &i64)> = pending.iter().collect();
            // One lock order for every writer of `api_keys` rows.
            ids.sort_unstable();
            for (id, at) in ids {
                let mut sql = crate::sql::Sql::new(
                    self.store.backend(),
                    "UPDATE api_keys SET last_used_at_ms = ",
                );
                sql.bind(*at)
                    .push(" WHERE id = ")
                    .bind(id.clone())
                    .push(" AND (last_used_at_ms IS NULL OR last_used_at_ms < ")
                    .bind(*at)
                    .push(")");
                sea_orm::ConnectionTrait::execute_raw(&txn, sql.build()).await?;
            }
            txn.commit().await
        };
        if let Err(e) = write.await {
            // Kept for the next flush.
            self.note_used(pending.iter().map(|(id, at)| (id.as_str(), *at)));
            return Err(e);
        }
        Ok(())
    }

    /// Re-reads the unrevoked keys from the database.
    pub fn refresh(&self) -> crate::BoxFuture<'_, Result<()>> {
        Box::pin(async move {
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
                let info = match key_info(&row) {
                    Ok(info) => info,
                    Err(e) => {
                        warn!(key.id = %row.id, error = %e, "stored key role or scope unreadable; key ignored");
                        continue;
                    }
                };
                if let Some(previous) = row.previous_hash_hex.as_deref().and_then(decode_hash) {
                    let until = row.previous_valid_until_ms.unwrap_or(0);
                    let expires = Some(info.expires_at_ms.map_or(until, |e| e.min(until)));
                    keys.insert(
                        previous,
                        KeyInfo {
                            expires_at_ms: expires,
                            ..info.clone()
                        },
                    );
                }
                keys.insert(hash, info);
            }
            self.cache.replace(keys);
            Ok(())
        })
    }

    /// Re-reads the key set every `period` until the task is dropped, and writes the keys'
    /// last use every [`LAST_USE_FLUSH_TICKS`] ticks.
    pub fn spawn_refresher(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let keys = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut ticks = 0u32;
            loop {
                tick.tick().await;
                if let Err(e) = keys.refresh().await {
                    warn!(error = %e, "key refresh failed; keeping the last known key set");
                }
                ticks = ticks.wrapping_add(1);
                if ticks.is_multiple_of(LAST_USE_FLUSH_TICKS)
                    && let Err(e) = keys.flush_last_used().await
                {
                    warn!(error = %e, "writing the keys' last use failed; kept for the next try");
                }
            }
        })
    }

    /// Creates a key with a fresh random secret, by `actor` (the acting key's id).
    #[tracing::instrument(skip_all, fields(key.id = tracing::field::Empty))]
    pub fn create<'a>(
        &'a self,
        actor: &'a str,
        new: NewKey,
    ) -> crate::BoxFuture<'a, Result<CreatedKey>> {
        Box::pin(async move {
            let new = validate_new(new, crate::now_ms())?;
            let secret = generate_secret();
            let created = self.insert(actor, new, &secret).await?;
            tracing::Span::current().record("key.id", created.key.id.as_str());
            info!(key.id = %created.key.id, role = %created.key.role, "key created");
            Ok(created)
        })
    }

    async fn insert(&self, actor: &str, new: NewKey, secret: &str) -> Result<CreatedKey> {
        let now = crate::now_ms();
        let txn = self.store.begin_write().await?;
        let model = api_key::ActiveModel {
            id: Set(format!("key_{}", uuid::Uuid::now_v7().simple())),
            name: Set(new.name),
            hash_hex: Set(encode_hash(&hash_key(secret))),
            display_prefix: Set(display_prefix(secret)),
            admin: Set(new.role == Role::Admin),
            created_at_ms: Set(now),
            revoked_at_ms: Set(None),
            role: Set(new.role.as_str().to_owned()),
            scope_json: Set(scope_json(&new.scope)),
            labels_json: Set(labels_json(&new.labels)),
            expires_at_ms: Set(new.expires_at_ms),
            previous_hash_hex: Set(None),
            previous_valid_until_ms: Set(None),
            rotated_at_ms: Set(None),
            last_used_at_ms: Set(None),
        }
        .insert(&txn)
        .await?;
        let change = Change {
            actor,
            action: "key.create",
            target: &model.id,
            before: None,
            after: Some(audit_json(&model)),
        };
        audit::record(&txn, change, now).await?;
        txn.commit().await?;
        self.refresh().await?;
        Ok(CreatedKey {
            key: model,
            secret: secret.to_owned(),
        })
    }

    /// All keys (unrevoked only unless `include_revoked`), newest first, with their last use
    /// (including what this replica noted and has not written yet).
    pub fn list(&self, include_revoked: bool) -> crate::BoxFuture<'_, Result<Vec<api_key::Model>>> {
        Box::pin(async move {
            let mut q = api_key::Entity::find().order_by_desc(api_key::Column::CreatedAtMs);
            if !include_revoked {
                q = q.filter(api_key::Column::RevokedAtMs.is_null());
            }
            let mut keys = q.all(self.store.conn()).await?;
            let pending = self.pending_last_used();
            for k in &mut keys {
                if let Some(at) = pending.get(&k.id) {
                    k.last_used_at_ms = Some(k.last_used_at_ms.map_or(*at, |t| t.max(*at)));
                }
            }
            Ok(keys)
        })
    }

    /// Reads a key in a write transaction, applies `f` to it and stores it with its audit row.
    async fn change(
        &self,
        actor: &str,
        id: &str,
        action: &str,
        f: impl FnOnce(&api_key::Model, &mut api_key::ActiveModel, i64) -> Result<bool>,
    ) -> Result<api_key::Model> {
        let now = crate::now_ms();
        let txn = self.store.begin_write().await?;
        let found = api_key::Entity::find_by_id(id.to_owned())
            .one(&txn)
            .await?
            .ok_or_else(|| Error::NotFound(format!("no key with id {id:?}")))?;
        let mut active: api_key::ActiveModel = found.clone().into();
        if !f(&found, &mut active, now)? {
            // Nothing to change (revoking twice): no write, no audit row.
            return Ok(found);
        }
        let updated = active.update(&txn).await?;
        let change = Change {
            actor,
            action,
            target: id,
            before: Some(audit_json(&found)),
            after: Some(audit_json(&updated)),
        };
        audit::record(&txn, change, now).await?;
        txn.commit().await?;
        self.refresh().await?;
        Ok(updated)
    }

    /// Revokes a key. Revoking twice keeps the first revocation time.
    #[tracing::instrument(skip(self, actor))]
    pub fn revoke<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
    ) -> crate::BoxFuture<'a, Result<api_key::Model>> {
        Box::pin(async move {
            let updated = self
                .change(actor, id, "key.revoke", |found, active, now| {
                    if found.revoked_at_ms.is_some() {
                        return Ok(false);
                    }
                    active.revoked_at_ms = Set(Some(now));
                    Ok(true)
                })
                .await?;
            info!(key.id = %id, "key revoked");
            Ok(updated)
        })
    }

    /// Gives a key a new secret; the one it replaces stays valid for `grace` (0: not at all).
    /// Id, role, scope, labels and history stay. A secret replaced by an earlier rotation is
    /// dropped at once (a key has at most two valid secrets).
    #[tracing::instrument(skip(self, actor))]
    pub fn rotate<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        grace: Duration,
    ) -> crate::BoxFuture<'a, Result<CreatedKey>> {
        Box::pin(async move {
            if grace > MAX_GRACE {
                return Err(Error::InvalidArgument(format!(
                    "grace: at most {} days",
                    MAX_GRACE.as_secs() / 86_400
                )));
            }
            let secret = generate_secret();
            let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
            let key = self
                .change(actor, id, "key.rotate", |found, active, now| {
                    if found.revoked_at_ms.is_some() {
                        return Err(Error::InvalidArgument(
                            "a revoked key cannot be rotated".to_owned(),
                        ));
                    }
                    let keep = grace_ms > 0;
                    active.previous_hash_hex = Set(keep.then(|| found.hash_hex.clone()));
                    active.previous_valid_until_ms =
                        Set(keep.then(|| now.saturating_add(grace_ms)));
                    active.hash_hex = Set(encode_hash(&hash_key(&secret)));
                    active.display_prefix = Set(display_prefix(&secret));
                    active.rotated_at_ms = Set(Some(now));
                    Ok(true)
                })
                .await?;
            info!(key.id = %id, grace_secs = grace.as_secs(), "key rotated");
            Ok(CreatedKey { key, secret })
        })
    }

    /// Changes a key's role, scope, labels or expiry.
    #[tracing::instrument(skip_all, fields(key.id = %id))]
    pub fn update<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        c: KeyChange,
    ) -> crate::BoxFuture<'a, Result<api_key::Model>> {
        Box::pin(async move {
            let scope = c.scope.map(normalized_scope).transpose()?;
            let labels = c.labels.map(validated_labels).transpose()?;
            let updated = self
                .change(actor, id, "key.update", |found, active, now| {
                    if found.revoked_at_ms.is_some() {
                        return Err(Error::InvalidArgument(
                            "a revoked key cannot be changed".to_owned(),
                        ));
                    }
                    let role = match c.role {
                        Some(r) => r,
                        None => parse_role(&found.role)?,
                    };
                    let scope = match scope {
                        Some(s) => s,
                        None => parse_scope(found.scope_json.as_deref())?,
                    };
                    check_role_scope(role, &scope)?;
                    if let Some(Some(at)) = c.expires_at_ms {
                        check_expiry(at, now)?;
                    }
                    active.role = Set(role.as_str().to_owned());
                    active.admin = Set(role == Role::Admin);
                    active.scope_json = Set(scope_json(&scope));
                    if let Some(labels) = &labels {
                        active.labels_json = Set(labels_json(labels));
                    }
                    if let Some(expiry) = c.expires_at_ms {
                        active.expires_at_ms = Set(expiry);
                    }
                    Ok(true)
                })
                .await?;
            info!(key.id = %id, "key changed");
            Ok(updated)
        })
    }

    /// Makes sure an admin key exists at start.
    ///
    /// With `bootstrap` set, that secret is an admin key (created if missing; a bootstrap key that
    /// an admin revoked stays revoked). Without it, a database with no keys at all gets one
    /// generated admin key, returned here so the caller can print it once.
    pub fn ensure_admin<'a>(
        &'a self,
        bootstrap: Option<&'a str>,
    ) -> crate::BoxFuture<'a, Result<Option<CreatedKey>>> {
        Box::pin(async move {
            let admin = |name: &str| NewKey {
                name: name.to_owned(),
                role: Role::Admin,
                ..NewKey::default()
            };
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
                    Some(k) if k.role != Role::Admin.as_str() => {
                        warn!(key.id = %k.id, "NM_BOOTSTRAP_KEY names an existing non-admin key; left as it is");
                    }
                    Some(_) => {}
                    None => {
                        let created = self
                            .insert(SYSTEM_ACTOR, admin(BOOTSTRAP_KEY_NAME), secret)
                            .await?;
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
                .insert(
                    SYSTEM_ACTOR,
                    admin(GENERATED_ADMIN_KEY_NAME),
                    &generate_secret(),
                )
                .await?;
            info!(key.id = %created.key.id, "fresh database: generated the first admin key");
            Ok(Some(created))
        })
    }
}

/// A key as the audit trail shows it: everything but secrets (no hash, no display prefix).
pub fn audit_json(k: &api_key::Model) -> serde_json::Value {
    json!({
        "id": k.id,
        "name": k.name,
        "role": k.role,
        "scope": k.scope_json.as_deref().and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok()),
        "labels": k.labels_json.as_deref().and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok()),
        "expires_at_ms": k.expires_at_ms,
        "revoked_at_ms": k.revoked_at_ms,
        "rotated_at_ms": k.rotated_at_ms,
        "previous_valid_until_ms": k.previous_valid_until_ms,
    })
}

/// The role and scope a stored key row carries.
pub fn key_info(row: &api_key::Model) -> Result<KeyInfo> {
    let role = parse_role(&row.role)?;
    let scope = parse_scope(row.scope_json.as_deref())?;
    Ok(KeyInfo {
        id: row.id.clone(),
        role,
        scope: (!scope.is_unrestricted()).then(|| Arc::new(scope)),
        expires_at_ms: row.expires_at_ms,
    })
}

pub fn parse_role(role: &str) -> Result<Role> {
    role.parse().map_err(Error::InvalidArgument)
}

pub fn parse_scope(json: Option<&str>) -> Result<Scope> {
    match json {
        None => Ok(Scope::default()),
        Some(s) => serde_json::from_str(s)
            .map_err(|e| Error::InvalidArgument(format!("stored scope: {e}"))),
    }
}

pub fn parse_labels(json: Option<&str>) -> Labels {
    json.and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default()
}

fn scope_json(scope: &Scope) -> Option<String> {
    (!scope.is_unrestricted()).then(|| serde_json::to_string(scope).unwrap_or_default())
}

fn labels_json(labels: &Labels) -> Option<String> {
    (!labels.is_empty()).then(|| serde_json::to_string(labels).unwrap_or_default())
}

fn normalized_scope(scope: Scope) -> Result<Scope> {
    scope
        .normalized()
        .map_err(|e| Error::InvalidArgument(format!("scope: {e}")))
}

fn check_role_scope(role: Role, scope: &Scope) -> Result<()> {
    if role != Role::Service && !scope.is_unrestricted() {
        return Err(Error::InvalidArgument(format!(
            "scope: only service keys take a scope (this key's role is {role})"
        )));
    }
    Ok(())
}

fn check_expiry(at_ms: i64, now_ms: i64) -> Result<()> {
    if at_ms <= now_ms {
        return Err(Error::InvalidArgument(
            "expires_at must be in the future".to_owned(),
        ));
    }
    Ok(())
}

/// Label names: 1 to 63 of `a-z`, `0-9`, `-`, `_`, `.`; values: 0 to 128 printable characters.
fn validated_labels(labels: Labels) -> Result<Labels> {
    if labels.len() > MAX_LABELS {
        return Err(Error::InvalidArgument(format!(
            "labels: at most {MAX_LABELS}"
        )));
    }
    for (k, v) in &labels {
        let name_ok = !k.is_empty()
            && k.len() <= 63
            && k.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
            });
        if !name_ok {
            return Err(Error::InvalidArgument(format!(
                "labels: {k:?} is not a label name (1 to 63 of a-z, 0-9, '-', '_', '.')"
            )));
        }
        if v.len() > 128 || v.chars().any(char::is_control) {
            return Err(Error::InvalidArgument(format!(
                "labels: the value of {k:?} must be at most 128 printable characters"
            )));
        }
    }
    Ok(labels)
}

fn validate_new(new: NewKey, now_ms: i64) -> Result<NewKey> {
    let name = validate_name(&new.name)?;
    let scope = normalized_scope(new.scope)?;
    check_role_scope(new.role, &scope)?;
    if let Some(at) = new.expires_at_ms {
        check_expiry(at, now_ms)?;
    }
    Ok(NewKey {
        name,
        scope,
        labels: validated_labels(new.labels)?,
        ..new
    })
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
    use crate::store::entity::audit_event;

    async fn keys() -> (tempfile::TempDir, Keys) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/k.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        (dir, Keys::load(store).await.unwrap())
    }

    fn entries_of(keys: &Keys, id: &str) -> Vec<KeyInfo> {
        keys.cache()
            .current()
            .keys
            .values()
            .filter(|k| k.id == id)
            .cloned()
            .collect()
    }

    #[tokio::test]
    async fn rotation_keeps_the_old_secret_for_its_grace_only() {
        let (_dir, keys) = keys().await;
        let scope = Scope {
            models: vec!["gpt-4o*".into()],
            ..Scope::default()
        };
        let created = keys
            .create(
                "key_admin",
                NewKey {
                    name: "svc".into(),
                    scope: scope.clone(),
                    ..NewKey::default()
                },
            )
            .await
            .unwrap();
        let id = created.key.id.clone();
        let first = keys.authenticate(&created.secret).unwrap();
        assert_eq!(first.scope.as_deref(), Some(&scope));
        assert_eq!(first.role, Role::Service);

        let second = keys
            .rotate("key_admin", &id, Duration::from_secs(60))
            .await
            .unwrap();
        let entries = entries_of(&keys, &id);
        assert_eq!(entries.len(), 2, "both secrets while the grace runs");
        let old = keys.authenticate(&created.secret).unwrap();
        assert!(old.expires_at_ms.is_some_and(|t| t > crate::now_ms()));
        assert_eq!(old.scope.as_deref(), Some(&scope), "same scope");
        assert!(
            keys.authenticate(&second.secret)
                .is_some_and(|k| k.expires_at_ms.is_none())
        );

        let third = keys.rotate("key_admin", &id, Duration::ZERO).await.unwrap();
        assert_eq!(
            entries_of(&keys, &id).len(),
            1,
            "at most two secrets; no grace: one"
        );
        assert!(keys.authenticate(&created.secret).is_none());
        assert!(keys.authenticate(&second.secret).is_none());
        assert!(keys.authenticate(&third.secret).is_some());
        let n = audit_event::Entity::find()
            .filter(audit_event::Column::Action.eq("key.rotate"))
            .all(keys.store.conn())
            .await
            .unwrap()
            .len();
        assert_eq!(n, 2);
    }

    #[tokio::test]
    async fn expiry_bounds_validity_and_rules_are_checked() {
        let (_dir, keys) = keys().await;
        let now = crate::now_ms();
        let created = keys
            .create(
                "key_admin",
                NewKey {
                    name: "short".into(),
                    expires_at_ms: Some(now + 60_000),
                    ..NewKey::default()
                },
            )
            .await
            .unwrap();
        let id = created.key.id.as_str();
        assert_eq!(
            keys.valid_at(&[(id, now), (id, now + 60_000), (id, now + 120_000)])
                .await
                .unwrap(),
            [true, false, false]
        );
        keys.revoke("key_admin", id).await.unwrap();
        assert_eq!(
            keys.valid_at(&[(id, now), (id, now + 120_000)])
                .await
                .unwrap(),
            [true, false],
            "a revoked key: by the database, expiry included"
        );
        let bad = [
            NewKey {
                name: "past".into(),
                expires_at_ms: Some(now - 1),
                ..NewKey::default()
            },
            NewKey {
                name: "scoped admin".into(),
                role: Role::Admin,
                scope: Scope {
                    agents: vec!["a".into()],
                    ..Scope::default()
                },
                ..NewKey::default()
            },
            NewKey {
                name: "label".into(),
                labels: Labels::from([("Team".into(), "x".into())]),
                ..NewKey::default()
            },
        ];
        for new in bad {
            assert!(matches!(
                keys.create("key_admin", new).await,
                Err(Error::InvalidArgument(_))
            ));
        }
        // Last use: noted in memory, shown at once, written by the flush.
        let live = keys
            .create(
                "key_admin",
                NewKey {
                    name: "used".into(),
                    ..NewKey::default()
                },
            )
            .await
            .unwrap();
        keys.note_used([(live.key.id.as_str(), 5), (live.key.id.as_str(), 7)]);
        let shown = |list: Vec<api_key::Model>| {
            list.into_iter()
                .find(|k| k.id == live.key.id)
                .and_then(|k| k.last_used_at_ms)
        };
        assert_eq!(shown(keys.list(false).await.unwrap()), Some(7));
        keys.flush_last_used().await.unwrap();
        let stored = api_key::Entity::find_by_id(live.key.id.clone())
            .one(keys.store.conn())
            .await
            .unwrap()
            .and_then(|k| k.last_used_at_ms);
        assert_eq!(stored, Some(7));
        keys.note_used([(live.key.id.as_str(), 3)]);
        keys.flush_last_used().await.unwrap();
        assert_eq!(
            shown(keys.list(false).await.unwrap()),
            Some(7),
            "never backwards"
        );
    }

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
