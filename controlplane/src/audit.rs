//! The audit trail: one row per admin change (keys created, revoked, rotated or changed;
//! budgets set or deleted), with the acting key's id, the time, the action, its target and the
//! state before and after as JSON.
//!
//! [`record`] is called by each change *inside the change's own write transaction*, so a change
//! is never stored without its audit row nor an audit row without its change. What goes into
//! `before`/`after` is built by the changing module from what it stores, minus secrets: a key's
//! JSON (`keys::audit_json`) has no hash, no secret, not even its display prefix.
//! Reading is paged by (time, id), oldest first, optionally from and until a time.

use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect, Set,
};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::entity::audit_event;

/// The actor of what the controlplane does by itself (the bootstrap key at start).
pub const SYSTEM_ACTOR: &str = "system";
/// Most events in one page.
pub const MAX_PAGE: u64 = 1_000;
/// Events in a page when the caller does not say.
pub const DEFAULT_PAGE: u64 = 100;

/// One admin change about to be stored.
#[derive(Debug, Clone)]
pub struct Change<'a> {
    pub actor: &'a str,
    pub action: &'a str,
    pub target: &'a str,
    pub before: Option<Value>,
    pub after: Option<Value>,
}

/// Stores `change` on `txn`: the write transaction of the change itself.
pub async fn record(txn: &impl ConnectionTrait, change: Change<'_>, at_ms: i64) -> Result<()> {
    audit_event::ActiveModel {
        id: Set(format!("aud_{}", uuid::Uuid::now_v7().simple())),
        at_ms: Set(at_ms),
        actor_key_id: Set(change.actor.to_owned()),
        action: Set(change.action.to_owned()),
        target: Set(change.target.to_owned()),
        before_json: Set(change.before.map(|v| v.to_string())),
        after_json: Set(change.after.map(|v| v.to_string())),
    }
    .insert(txn)
    .await?;
    Ok(())
}

/// Which events to read.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
    /// Events per page (default [`DEFAULT_PAGE`], at most [`MAX_PAGE`]).
    pub page_size: u64,
    /// The `next_page_token` of the previous page.
    pub page_token: Option<String>,
}

/// One page of events, oldest first.
#[derive(Debug, Clone)]
pub struct AuditPage {
    pub events: Vec<audit_event::Model>,
    /// Set when more events may follow.
    pub next_page_token: Option<String>,
}

/// Reads the trail.
#[derive(Debug, Clone)]
pub struct Audit {
    store: Store,
}

impl Audit {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    pub fn list<'a>(&'a self, q: &'a AuditQuery) -> crate::BoxFuture<'a, Result<AuditPage>> {
        Box::pin(async move {
            let size = match q.page_size {
                0 => DEFAULT_PAGE,
                n => n.min(MAX_PAGE),
            };
            let mut find = audit_event::Entity::find()
                .order_by_asc(audit_event::Column::AtMs)
                .order_by_asc(audit_event::Column::Id);
            if let Some(since) = q.since_ms {
                find = find.filter(audit_event::Column::AtMs.gte(since));
            }
            if let Some(until) = q.until_ms {
                find = find.filter(audit_event::Column::AtMs.lt(until));
            }
            if let Some(token) = q.page_token.as_deref().filter(|t| !t.is_empty()) {
                let (at, id) = parse_token(token)?;
                find = find.filter(
                    sea_orm::Condition::any()
                        .add(audit_event::Column::AtMs.gt(at))
                        .add(
                            sea_orm::Condition::all()
                                .add(audit_event::Column::AtMs.eq(at))
                                .add(audit_event::Column::Id.gt(id)),
                        ),
                );
            }
            let mut events = find.limit(size + 1).all(self.store.conn()).await?;
            let more = events.len() as u64 > size;
            events.truncate(usize::try_from(size).unwrap_or(usize::MAX));
            let next_page_token = more
                .then(|| events.last().map(|e| format!("{}:{}", e.at_ms, e.id)))
                .flatten();
            Ok(AuditPage {
                events,
                next_page_token,
            })
        })
    }
}

fn parse_token(token: &str) -> Result<(i64, String)> {
    token
        .split_once(':')
        .and_then(|(at, id)| Some((at.parse().ok()?, id.to_owned())))
        .filter(|(_, id)| id.starts_with("aud_") && id.len() <= 64)
        .ok_or_else(|| Error::InvalidArgument("page_token: not a token this API gave".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        assert_eq!(parse_token("12:aud_x").ok(), Some((12, "aud_x".to_owned())));
        for bad in ["", "12", "x:aud_x", "12:key_x"] {
            assert!(parse_token(bad).is_err(), "{bad}");
        }
    }
}
