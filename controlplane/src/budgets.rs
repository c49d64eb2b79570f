//! End-user budgets: the rules admins set, and every end user's spend in the current UTC day
//! and month, fed to the dataplanes that enforce them.
//!
//! The database is the source of truth: rules live in `budgets`, spend in the `user_spend` daily
//! rollup, written in the same transaction as the request records it sums. In memory the
//! controlplane keeps the current periods' totals and a sequence number, `seq`, that grows with
//! every ingested batch ([`Budgets::apply`], called after the batch commits). Dataplanes watch a
//! feed ([`Budgets::subscribe`]): a full state, then per-batch deltas naming the users whose spend
//! changed. An ingest acknowledgement carries `(epoch, seq)`, so a dataplane knows when its own
//! records' spend has reached the feed and can stop counting them locally.
//!
//! `epoch` is random per process start: after a restart, the feed's full state (reloaded from
//! the database) includes everything committed before, whatever the old sequence numbers were.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use nm_types::budget::{
    BudgetRule, LeaseKey, LeaseRequest, LeaseResponse, LeaseUnit, MINUTE_MS, Period, day_of,
    first_day_of_month, grant, minute_of, month_of_day,
};
use nm_types::parse_user;
use sea_orm::sea_query::{Expr, OnConflict};
use sea_orm::{ActiveValue::Set, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter};
use tokio::sync::broadcast;

use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::entity::{budget, user_spend};

const DEFAULT_SUBJECT: &str = "default";
const USER_PREFIX: &str = "user:";
/// Deltas a slow watcher may fall behind before it is sent a full state instead.
const FEED_BUFFER: usize = 1024;
/// How long a dataplane's claims count without a new report: past it, the dataplane is taken
/// for gone and its unused lease is free again (it stops spending it by then too).
pub const LEASE_TTL_MS: u64 = 5_000;

/// A budget as stored: for the default (`user_id` None) or one end user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBudget {
    pub user_id: Option<String>,
    pub rule: BudgetRule,
    pub updated_at_ms: i64,
}

pub use nm_types::budget::Spend;

/// One freshly stored record that counts toward a budget.
#[derive(Debug, Clone)]
pub struct SpendItem {
    pub user_id: String,
    pub started_at_ms: i64,
    pub micros: u64,
}

/// Everything a dataplane needs at once.
#[derive(Debug, Clone)]
pub struct FullState {
    pub epoch: u64,
    pub seq: u64,
    pub day: i64,
    pub month: i64,
    pub budgets: Vec<StoredBudget>,
    pub spend: Vec<(String, Spend)>,
}

/// The users whose spend changed with one batch (their new totals).
#[derive(Debug, Clone)]
pub struct SpendDelta {
    pub epoch: u64,
    pub seq: u64,
    pub day: i64,
    pub month: i64,
    pub spend: Vec<(String, Spend)>,
}

/// What watchers hear.
#[derive(Debug, Clone)]
pub enum FeedEvent {
    Delta(Arc<SpendDelta>),
    /// Rules changed or a period rolled over: send a full state.
    Reset,
}

/// A user's budget and spend, for `budgets show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetStatus {
    pub user_id: String,
    pub budget: Option<StoredBudget>,
    pub is_default: bool,
    pub day_micros: u64,
    pub month_micros: u64,
    pub remaining_micros: Option<u64>,
    pub resets_at_ms: Option<i64>,
    /// The dataplanes' claims on the spend budget in its current period, and how many hold one.
    pub leased_micros: u64,
    pub lease_holders: u32,
}

#[derive(Debug)]
struct State {
    epoch: u64,
    seq: u64,
    day: i64,
    month: i64,
    default: Option<StoredBudget>,
    overrides: BTreeMap<String, StoredBudget>,
    spend: HashMap<String, Spend>,
    /// Each live dataplane process's claims, by its instance id.
    holders: HashMap<u64, Holder>,
}

/// One dataplane process's claims, as it last reported them plus what was granted since.
#[derive(Debug)]
struct Holder {
    last_report_ms: i64,
    claims: HashMap<LeaseKey, u64>,
}

#[derive(Debug, Clone)]
pub struct Budgets {
    store: Store,
    state: Arc<Mutex<State>>,
    feed: broadcast::Sender<FeedEvent>,
}

impl Budgets {
    /// Loads the rules and the current month's spend.
    pub async fn load(store: Store, now_ms: i64) -> Result<Self> {
        let day = day_of(now_ms);
        let month = month_of_day(day);
        let mut default = None;
        let mut overrides = BTreeMap::new();
        for row in budget::Entity::find().all(store.conn()).await? {
            let b = from_row(row)?;
            match &b.user_id {
                None => default = Some(b),
                Some(u) => {
                    overrides.insert(u.clone(), b);
                }
            }
        }
        let mut spend: HashMap<String, Spend> = HashMap::new();
        let rows = user_spend::Entity::find()
            .filter(user_spend::Column::Day.gte(first_day_of_month(month)))
            .filter(user_spend::Column::Day.lte(day))
            .all(store.conn())
            .await?;
        for row in rows {
            let s = spend.entry(row.user_id).or_default();
            let micros = u64::try_from(row.cost_micros).unwrap_or(0);
            s.month_micros = s.month_micros.saturating_add(micros);
            if row.day == day {
                s.day_micros = s.day_micros.saturating_add(micros);
            }
        }
        let (feed, _) = broadcast::channel(FEED_BUFFER);
        Ok(Self {
            store,
            state: Arc::new(Mutex::new(State {
                epoch: rand::random::<u64>() | 1,
                seq: 0,
                day,
                month,
                default,
                overrides,
                spend,
                holders: HashMap::new(),
            })),
            feed,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain numbers behind; keep serving them.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates or replaces the default budget (`user_id` None) or a user's override.
    pub async fn set(
        &self,
        actor: &str,
        user_id: Option<&str>,
        rule: BudgetRule,
        now_ms: i64,
    ) -> Result<StoredBudget> {
        rule.validate()
            .map_err(|why| Error::InvalidArgument(why.to_owned()))?;
        if let Some(limit) = rule.limit_micros
            && i64::try_from(limit).is_err()
        {
            return Err(Error::InvalidArgument("limit is too large".to_owned()));
        }
        let user_id = user_id.map(check_user).transpose()?;
        let stored = StoredBudget {
            user_id: user_id.clone(),
            rule,
            updated_at_ms: now_ms,
        };
        let row = budget::ActiveModel {
            subject: Set(subject(user_id.as_deref())),
            limit_micros: Set(rule.limit_micros.and_then(|l| i64::try_from(l).ok())),
            period: Set(rule.period.as_str().to_owned()),
            requests_per_minute: Set(rule
                .requests_per_minute
                .map(|r| i32::try_from(r).unwrap_or(i32::MAX))),
            updated_at_ms: Set(now_ms),
        };
        let target = subject(user_id.as_deref());
        let txn = self.store.begin_write().await?;
        let before = budget::Entity::find_by_id(target.clone()).one(&txn).await?;
        budget::Entity::insert(row)
            .on_conflict(
                OnConflict::column(budget::Column::Subject)
                    .update_columns([
                        budget::Column::LimitMicros,
                        budget::Column::Period,
                        budget::Column::RequestsPerMinute,
                        budget::Column::UpdatedAtMs,
                    ])
                    .to_owned(),
            )
            .exec_without_returning(&txn)
            .await?;
        let change = crate::audit::Change {
            actor,
            action: "budget.set",
            target: &format!("budget:{target}"),
            before: before.as_ref().map(budget_audit_json),
            after: Some(stored_audit_json(&stored)),
        };
        crate::audit::record(&txn, change, now_ms).await?;
        txn.commit().await?;
        {
            let mut st = self.lock();
            match &user_id {
                None => st.default = Some(stored.clone()),
                Some(u) => {
                    st.overrides.insert(u.clone(), stored.clone());
                }
            }
        }
        let _ = self.feed.send(FeedEvent::Reset);
        Ok(stored)
    }

    /// Removes the default budget or a user's override; false when there was none.
    pub async fn delete(&self, actor: &str, user_id: Option<&str>) -> Result<bool> {
        let user_id = user_id.map(check_user).transpose()?;
        let target = subject(user_id.as_deref());
        let txn = self.store.begin_write().await?;
        let before = budget::Entity::find_by_id(target.clone()).one(&txn).await?;
        let res = budget::Entity::delete_by_id(target.clone())
            .exec(&txn)
            .await?;
        if let Some(before) = &before {
            let change = crate::audit::Change {
                actor,
                action: "budget.delete",
                target: &format!("budget:{target}"),
                before: Some(budget_audit_json(before)),
                after: None,
            };
            crate::audit::record(&txn, change, crate::now_ms()).await?;
        }
        txn.commit().await?;
        {
            let mut st = self.lock();
            match &user_id {
                None => st.default = None,
                Some(u) => {
                    st.overrides.remove(u);
                }
            }
        }
        let _ = self.feed.send(FeedEvent::Reset);
        Ok(res.rows_affected > 0)
    }

    /// The default budget and every override (by user id).
    pub fn list(&self) -> (Option<StoredBudget>, Vec<StoredBudget>) {
        let st = self.lock();
        (st.default.clone(), st.overrides.values().cloned().collect())
    }

    /// A user's effective budget and current spend.
    pub fn status(&self, user_id: &str, now_ms: i64) -> Result<BudgetStatus> {
        let user_id = check_user(user_id)?;
        let mut st = self.lock();
        roll(&mut st, now_ms);
        let (budget, is_default) = match st.overrides.get(&user_id) {
            Some(b) => (Some(b.clone()), false),
            None => (st.default.clone(), st.default.is_some()),
        };
        let spend = st.spend.get(&user_id).copied().unwrap_or_default();
        let (remaining_micros, resets_at_ms) = match &budget {
            Some(b) => {
                let spent = match b.rule.period {
                    Period::Day => spend.day_micros,
                    Period::Month => spend.month_micros,
                };
                (
                    b.rule.limit_micros.map(|l| l.saturating_sub(spent)),
                    Some(b.rule.period.end_ms(now_ms)),
                )
            }
            None => (None, None),
        };
        let (mut leased_micros, mut lease_holders) = (0u64, 0u32);
        if let Some(b) = &budget {
            let key = LeaseKey {
                user: user_id.clone(),
                unit: LeaseUnit::Micros,
                period: b.rule.period.index_of(now_ms),
            };
            let ttl = i64::try_from(LEASE_TTL_MS).unwrap_or(i64::MAX);
            for h in st.holders.values() {
                if let Some(c) = h
                    .claims
                    .get(&key)
                    .filter(|_| h.last_report_ms + ttl > now_ms)
                {
                    leased_micros = leased_micros.saturating_add(*c);
                    lease_holders += 1;
                }
            }
        }
        Ok(BudgetStatus {
            user_id,
            budget,
            leased_micros,
            lease_holders,
            is_default,
            day_micros: spend.day_micros,
            month_micros: spend.month_micros,
            remaining_micros,
            resets_at_ms,
        })
    }

    /// The full state and a receiver for what follows it (nothing is missed in between).
    pub fn subscribe(&self, now_ms: i64) -> (FullState, broadcast::Receiver<FeedEvent>) {
        let mut st = self.lock();
        if roll(&mut st, now_ms) {
            let _ = self.feed.send(FeedEvent::Reset);
        }
        let rx = self.feed.subscribe();
        (full_state(&st), rx)
    }

    /// The current full state.
    pub fn full_state(&self, now_ms: i64) -> FullState {
        let mut st = self.lock();
        if roll(&mut st, now_ms) {
            let _ = self.feed.send(FeedEvent::Reset);
        }
        full_state(&st)
    }

    /// `(epoch, seq, day, month)` now.
    pub fn position(&self) -> (u64, u64, i64, i64) {
        let st = self.lock();
        (st.epoch, st.seq, st.day, st.month)
    }

    /// Rolls the periods over when the UTC day changed (heartbeat); watchers get a full state.
    pub fn tick(&self, now_ms: i64) {
        let mut st = self.lock();
        if roll(&mut st, now_ms) {
            let _ = self.feed.send(FeedEvent::Reset);
        }
    }

    /// Takes a dataplane's report of its claims and grants what it asks for, from what remains
    /// of each budget once the recorded spend and every live dataplane's claim are counted.
    pub fn lease(&self, req: &LeaseRequest, now_ms: i64) -> LeaseResponse {
        let mut st = self.lock();
        if roll(&mut st, now_ms) {
            let _ = self.feed.send(FeedEvent::Reset);
        }
        let ttl = i64::try_from(LEASE_TTL_MS).unwrap_or(i64::MAX);
        st.holders
            .retain(|_, h| h.last_report_ms.saturating_add(ttl) > now_ms);
        let mut mine: HashMap<LeaseKey, u64> = req
            .claims
            .iter()
            .filter(|c| c.claim > 0)
            .map(|c| (c.key.clone(), c.claim))
            .collect();
        let minute = minute_of(now_ms);
        let mut granted = Vec::with_capacity(req.claims.len());
        for c in &req.claims {
            if c.want == 0 {
                granted.push(0);
                continue;
            }
            let rule = st
                .overrides
                .get(&c.key.user)
                .or(st.default.as_ref())
                .map(|b| b.rule);
            let spend = st.spend.get(&c.key.user).copied().unwrap_or_default();
            let bounds = rule.and_then(|rule| match c.key.unit {
                LeaseUnit::Micros => {
                    let current = match rule.period {
                        Period::Day => (st.day, spend.day_micros),
                        Period::Month => (st.month, spend.month_micros),
                    };
                    rule.limit_micros.map(|l| (l, current))
                }
                LeaseUnit::Requests => rule.requests_per_minute.map(|rpm| {
                    let spent = if spend.minute == c.key.period {
                        u64::from(spend.minute_requests)
                    } else {
                        0
                    };
                    (u64::from(rpm), (minute, spent))
                }),
            });
            let g = match bounds {
                // A past period is over: nothing more to spend in it.
                Some((limit, (current, spent))) if c.key.period >= current => {
                    let spent = if c.key.period == current { spent } else { 0 };
                    let (mut others, mut holders) = (0u64, 0usize);
                    for (id, h) in &st.holders {
                        if *id == req.instance {
                            continue;
                        }
                        if let Some(&claim) = h.claims.get(&c.key).filter(|c| **c > 0) {
                            others = others.saturating_add(claim);
                            holders += 1;
                        }
                    }
                    let own = mine.get(&c.key).copied().unwrap_or(0);
                    grant(limit, spent, others, own, c.want, holders)
                }
                _ => 0,
            };
            if g > 0 {
                *mine.entry(c.key.clone()).or_default() += g;
            }
            granted.push(g);
        }
        if mine.is_empty() {
            st.holders.remove(&req.instance);
        } else {
            st.holders.insert(
                req.instance,
                Holder {
                    last_report_ms: now_ms,
                    claims: mine,
                },
            );
        }
        LeaseResponse {
            granted,
            ttl_ms: LEASE_TTL_MS,
        }
    }

    /// The dataplane processes holding a claim now (for `budgets show` and tests).
    pub fn lease_holders(&self, now_ms: i64) -> usize {
        let ttl = i64::try_from(LEASE_TTL_MS).unwrap_or(i64::MAX);
        self.lock()
            .holders
            .values()
            .filter(|h| h.last_report_ms.saturating_add(ttl) > now_ms)
            .count()
    }

    /// Counts a committed batch's spend; returns the `(epoch, seq)` that includes it.
    pub fn apply(&self, items: &[SpendItem], now_ms: i64) -> (u64, u64) {
        let mut st = self.lock();
        if roll(&mut st, now_ms) {
            let _ = self.feed.send(FeedEvent::Reset);
        }
        st.seq += 1;
        let (day, month) = (st.day, st.month);
        let now_minute = minute_of(now_ms);
        // The users whose spend this batch changed, in first-seen order: a batch of a thousand
        // records may name as many users, so membership is a set, not a scan of the list.
        let mut changed: Vec<&str> = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for item in items {
            let item_day = day_of(item.started_at_ms);
            let item_month = month_of_day(item_day);
            let item_minute = minute_of(item.started_at_ms);
            // Old news (an earlier period, a spooled record replayed late) stays in the database
            // rollup but does not count toward the current periods.
            if item_month != month && item_minute < now_minute - 1 {
                continue;
            }
            // Most items name a user already counted: look up before cloning the id for a new
            // entry.
            let s = match st.spend.get_mut(&item.user_id) {
                Some(s) => s,
                None => st.spend.entry(item.user_id.clone()).or_default(),
            };
            if item_month == month {
                s.month_micros = s.month_micros.saturating_add(item.micros);
                if item_day == day {
                    s.day_micros = s.day_micros.saturating_add(item.micros);
                }
            }
            if item_minute > s.minute {
                s.minute = item_minute;
                s.minute_requests = 0;
            }
            if item_minute == s.minute {
                s.minute_requests = s.minute_requests.saturating_add(1);
            }
            if seen.insert(&item.user_id) {
                changed.push(&item.user_id);
            }
        }
        let delta = SpendDelta {
            epoch: st.epoch,
            seq: st.seq,
            day,
            month,
            spend: changed
                .into_iter()
                .filter_map(|u| st.spend.get(u).map(|s| (u.to_owned(), *s)))
                .collect(),
        };
        let at = (st.epoch, st.seq);
        drop(st);
        let _ = self.feed.send(FeedEvent::Delta(Arc::new(delta)));
        at
    }
}

/// Adds a batch's spend to the daily rollup, inside the batch's transaction.
pub(crate) async fn add_to_rollup<C: ConnectionTrait>(db: &C, items: &[SpendItem]) -> Result<()> {
    // One row per (user, day): PostgreSQL refuses an upsert that names a row twice.
    let mut sums: BTreeMap<(&str, i64), (i64, i64)> = BTreeMap::new();
    for item in items {
        let e = sums
            .entry((&item.user_id, day_of(item.started_at_ms)))
            .or_default();
        e.0 =
            e.0.saturating_add(i64::try_from(item.micros).unwrap_or(i64::MAX));
        e.1 += 1;
    }
    if sums.is_empty() {
        return Ok(());
    }
    let rows = sums.into_iter().map(
        |((user, day), (micros, requests))| user_spend::ActiveModel {
            user_id: Set(user.to_owned()),
            day: Set(day),
            cost_micros: Set(micros),
            requests: Set(requests),
        },
    );
    let on_conflict = OnConflict::columns([user_spend::Column::UserId, user_spend::Column::Day])
        .value(
            user_spend::Column::CostMicros,
            Expr::cust(r#""user_spend"."cost_micros" + "excluded"."cost_micros""#),
        )
        .value(
            user_spend::Column::Requests,
            Expr::cust(r#""user_spend"."requests" + "excluded"."requests""#),
        )
        .to_owned();
    user_spend::Entity::insert_many(rows)
        .on_conflict(on_conflict)
        .exec_without_returning(db)
        .await?;
    Ok(())
}

/// Moves the state to the periods of `now_ms`; true when they changed.
fn roll(st: &mut State, now_ms: i64) -> bool {
    let day = day_of(now_ms);
    if day <= st.day {
        return false;
    }
    let month = month_of_day(day);
    for s in st.spend.values_mut() {
        s.day_micros = 0;
        if month != st.month {
            s.month_micros = 0;
        }
    }
    if month != st.month {
        st.spend.retain(|_, s| s.minute >= minute_of(now_ms) - 1);
    }
    st.day = day;
    st.month = month;
    true
}

fn full_state(st: &State) -> FullState {
    FullState {
        epoch: st.epoch,
        seq: st.seq,
        day: st.day,
        month: st.month,
        budgets: st
            .default
            .iter()
            .chain(st.overrides.values())
            .cloned()
            .collect(),
        spend: st.spend.iter().map(|(u, s)| (u.clone(), *s)).collect(),
    }
}

/// A stored budget row as the audit trail shows it.
fn budget_audit_json(b: &budget::Model) -> serde_json::Value {
    serde_json::json!({
        "subject": b.subject,
        "limit_micros": b.limit_micros,
        "period": b.period,
        "requests_per_minute": b.requests_per_minute,
    })
}

fn stored_audit_json(b: &StoredBudget) -> serde_json::Value {
    serde_json::json!({
        "subject": subject(b.user_id.as_deref()),
        "limit_micros": b.rule.limit_micros,
        "period": b.rule.period.as_str(),
        "requests_per_minute": b.rule.requests_per_minute,
    })
}

fn subject(user_id: Option<&str>) -> String {
    match user_id {
        None => DEFAULT_SUBJECT.to_owned(),
        Some(u) => format!("{USER_PREFIX}{u}"),
    }
}

fn check_user(user_id: &str) -> Result<String> {
    parse_user(user_id)
        .map_err(|e| Error::InvalidArgument(format!("user_id: {e}")))
        .map(|u| u.to_string())
}

fn from_row(row: budget::Model) -> Result<StoredBudget> {
    let user_id = if row.subject == DEFAULT_SUBJECT {
        None
    } else if let Some(u) = row.subject.strip_prefix(USER_PREFIX) {
        Some(u.to_owned())
    } else {
        return Err(Error::Config(format!(
            "budgets table: unknown subject {:?}",
            row.subject
        )));
    };
    let period = row
        .period
        .parse::<Period>()
        .map_err(|e| Error::Config(format!("budgets table: {e}")))?;
    Ok(StoredBudget {
        user_id,
        rule: BudgetRule {
            limit_micros: row.limit_micros.and_then(|l| u64::try_from(l).ok()),
            period,
            requests_per_minute: row.requests_per_minute.and_then(|r| u32::try_from(r).ok()),
        },
        updated_at_ms: row.updated_at_ms,
    })
}

/// The first millisecond of the minute after `ms`.
pub fn next_minute_ms(ms: i64) -> i64 {
    (minute_of(ms) + 1) * MINUTE_MS
}

#[cfg(test)]
mod tests {
    use super::*;
    use nm_types::budget::{DAY_MS, LeaseClaim, day_from_civil};

    async fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/b.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        (dir, store)
    }

    fn item(user: &str, at: i64, micros: u64) -> SpendItem {
        SpendItem {
            user_id: user.to_owned(),
            started_at_ms: at,
            micros,
        }
    }

    #[tokio::test]
    async fn spend_counts_per_period_and_survives_a_reload() {
        let (_dir, store) = store().await;
        let now = day_from_civil(2026, 11, 22) * DAY_MS + 3_600_000;
        let yesterday = now - DAY_MS;
        let b = Budgets::load(store.clone(), now).await.unwrap();
        let items = [
            item("u1", now, 700),
            item("u1", yesterday, 300),
            item("u2", now, 5),
        ];
        let txn = store.begin_write().await.unwrap();
        add_to_rollup(&txn, &items).await.unwrap();
        txn.commit().await.unwrap();
        let (epoch, seq) = b.apply(&items, now);
        assert_eq!(seq, 1);
        let s = b.status("u1", now).unwrap();
        assert_eq!((s.day_micros, s.month_micros), (700, 1000));

        let reloaded = Budgets::load(store, now).await.unwrap();
        let s = reloaded.status("u1", now).unwrap();
        assert_eq!((s.day_micros, s.month_micros), (700, 1000));
        assert_ne!(reloaded.full_state(now).epoch, epoch);

        // Next day: the day resets, the month goes on.
        let s = reloaded.status("u1", now + DAY_MS).unwrap();
        assert_eq!((s.day_micros, s.month_micros), (0, 1000));
    }

    #[tokio::test]
    async fn a_batch_delta_names_each_user_once_in_first_seen_order() {
        let (_dir, store) = store().await;
        let now = day_from_civil(2026, 11, 22) * DAY_MS + 3_600_000;
        let b = Budgets::load(store, now).await.unwrap();
        let (_full, mut rx) = b.subscribe(now);
        // A thousand records over 300 users, each user three or four times, interleaved.
        let users: Vec<String> = (0..300).map(|i| format!("user-{i}")).collect();
        let items: Vec<SpendItem> = (0..1000)
            .map(|i| item(&users[(i * 7) % 300], now, 1 + (i as u64 % 5)))
            .collect();
        b.apply(&items, now);
        let FeedEvent::Delta(delta) = rx.recv().await.unwrap() else {
            panic!("expected a delta");
        };
        let mut first_seen: Vec<&str> = Vec::new();
        for it in &items {
            if !first_seen.contains(&it.user_id.as_str()) {
                first_seen.push(&it.user_id);
            }
        }
        let named: Vec<&str> = delta.spend.iter().map(|(u, _)| u.as_str()).collect();
        assert_eq!(named, first_seen);
        for (user, spend) in &delta.spend {
            let (micros, requests) = items
                .iter()
                .filter(|it| &it.user_id == user)
                .fold((0, 0), |(m, n), it| (m + it.micros, n + 1));
            assert_eq!((spend.day_micros, spend.month_micros), (micros, micros));
            assert_eq!(spend.minute_requests, requests);
        }
    }

    #[tokio::test]
    async fn rules_round_trip_and_feed_resets() {
        let (_dir, store) = store().await;
        let b = Budgets::load(store.clone(), 0).await.unwrap();
        let (_full, mut rx) = b.subscribe(0);
        let rule = BudgetRule {
            limit_micros: Some(5_000_000),
            period: Period::Day,
            requests_per_minute: Some(60),
        };
        b.set("key_test", None, rule, 1).await.unwrap();
        b.set(
            "key_test",
            Some("alice"),
            BudgetRule {
                limit_micros: Some(1),
                ..rule
            },
            2,
        )
        .await
        .unwrap();
        assert!(matches!(rx.recv().await.unwrap(), FeedEvent::Reset));
        let bad = BudgetRule {
            limit_micros: None,
            period: Period::Day,
            requests_per_minute: None,
        };
        assert!(matches!(
            b.set("key_test", None, bad, 3).await,
            Err(Error::InvalidArgument(_))
        ));
        let reloaded = Budgets::load(store, 0).await.unwrap();
        let (default, overrides) = reloaded.list();
        assert_eq!(default.map(|d| d.rule), Some(rule));
        assert_eq!(overrides.len(), 1);
        assert!(reloaded.status("bob", 0).unwrap().is_default);
        assert!(!reloaded.status("alice", 0).unwrap().is_default);
        assert!(reloaded.delete("key_test", Some("alice")).await.unwrap());
        assert!(!reloaded.delete("key_test", Some("alice")).await.unwrap());
    }

    fn claim(user: &str, unit: LeaseUnit, period: i64, claim: u64, want: u64) -> LeaseClaim {
        LeaseClaim {
            key: LeaseKey {
                user: user.to_owned(),
                unit,
                period,
            },
            claim,
            want,
        }
    }

    fn report(instance: u64, claims: Vec<LeaseClaim>) -> LeaseRequest {
        LeaseRequest {
            dataplane: format!("dp{instance}"),
            instance,
            claims,
        }
    }

    #[tokio::test]
    async fn leases_never_sum_past_what_remains_and_a_silent_holder_is_reclaimed() {
        let (_dir, store) = store().await;
        let now = day_from_civil(2026, 11, 22) * DAY_MS + 3_600_000;
        let b = Budgets::load(store.clone(), now).await.unwrap();
        let rule = BudgetRule {
            limit_micros: Some(50_000),
            period: Period::Day,
            requests_per_minute: Some(10),
        };
        b.set("key_test", None, rule, now).await.unwrap();
        let day = day_of(now);
        // 10,000 recorded: 40,000 remain to lease.
        let txn = store.begin_write().await.unwrap();
        add_to_rollup(&txn, &[item("ann", now, 10_000)])
            .await
            .unwrap();
        txn.commit().await.unwrap();
        b.apply(&[item("ann", now, 10_000)], now);

        let micros = |c: u64, w: u64| claim("ann", LeaseUnit::Micros, day, c, w);
        // The first asker gets what it wants while it fits.
        let g1 = b.lease(&report(1, vec![micros(0, 24_000)]), now).granted;
        assert_eq!(g1, [24_000]);
        // The second shares what is left with the first holder: 16,000 over two.
        let g2 = b.lease(&report(2, vec![micros(0, 24_000)]), now).granted;
        assert_eq!(g2, [8_000]);
        // The first, having spent all of it, asks again: 8,000 free, shared.
        let g1 = b
            .lease(&report(1, vec![micros(24_000, 24_000)]), now)
            .granted;
        assert_eq!(g1, [4_000]);
        // 10,000 recorded + 28,000 + 8,000 claimed: a third shares the last 4,000 with both.
        let g3 = b.lease(&report(3, vec![micros(0, 6_000)]), now).granted;
        assert_eq!(g3, [1_334]);
        assert_eq!(b.lease_holders(now), 3);
        // Each reports again with all of it spent: what is left is shared again, and the sum of
        // the claims never passes what remains (10,000 + 28,395 + 8,593 + 2,223 < 50,000).
        let g3 = b.lease(&report(3, vec![micros(1_334, 6_000)]), now).granted;
        assert_eq!(g3, [889]);
        let g2 = b.lease(&report(2, vec![micros(8_000, 6_000)]), now).granted;
        assert_eq!(g2, [593]);
        let g1 = b
            .lease(&report(1, vec![micros(28_000, 6_000)]), now)
            .granted;
        assert_eq!(g1, [395]);

        // Dataplane 2 goes silent: after the time to live its unused 8,000 are free again.
        let later = now + i64::try_from(LEASE_TTL_MS).unwrap();
        let g1 = b
            .lease(&report(1, vec![micros(28_000, 8_000)]), later)
            .granted;
        assert_eq!(g1, [8_000]);
        assert_eq!(b.lease_holders(later), 1);

        // A claim left out of a report is released.
        b.lease(&report(1, vec![]), later);
        assert_eq!(b.lease_holders(later), 0);

        // Requests per minute: ten per minute whoever asks; a past minute gets nothing.
        let minute = minute_of(later);
        let req = |c: u64, w: u64| claim("ann", LeaseUnit::Requests, minute, c, w);
        assert_eq!(b.lease(&report(1, vec![req(0, 8)]), later).granted, [8]);
        // Two left, shared with the one holder.
        assert_eq!(b.lease(&report(2, vec![req(0, 8)]), later).granted, [1]);
        let past = claim("ann", LeaseUnit::Requests, minute - 1, 0, 8);
        assert_eq!(b.lease(&report(3, vec![past]), later).granted, [0]);
        // No budget for a user: nothing is leased (the dataplane does not ask for one then).
        let none = claim("zed", LeaseUnit::Micros, day, 0, 8);
        b.delete("key_test", None).await.unwrap();
        assert_eq!(b.lease(&report(4, vec![none]), later).granted, [0]);
    }
}

/// End-user erasure (`crate::forget`), on the forgetting transaction: the user's daily spend
/// moves to `token` (totals unchanged) and the user's own budget is deleted, so a user coming
/// back under the same id starts afresh. Returns (rows changed, budgets deleted).
pub(crate) async fn forget_user(
    txn: &impl ConnectionTrait,
    user: &str,
    token: &str,
) -> Result<(u64, u64)> {
    let backend = txn.get_database_backend();
    let mut sql = crate::sql::Sql::new(
        backend,
        "INSERT INTO user_spend (user_id, day, cost_micros, requests) SELECT ",
    );
    sql.bind(token.to_owned())
        .push(", day, cost_micros, requests FROM user_spend WHERE user_id = ")
        .bind(user.to_owned())
        .push(
            " ON CONFLICT (user_id, day) DO UPDATE SET \
             cost_micros = user_spend.cost_micros + excluded.cost_micros, \
             requests = user_spend.requests + excluded.requests",
        );
    txn.execute_raw(sql.build()).await?;
    let spend = user_spend::Entity::delete_many()
        .filter(user_spend::Column::UserId.eq(user))
        .exec(txn)
        .await?
        .rows_affected;
    let budgets = budget::Entity::delete_by_id(subject(Some(user)))
        .exec(txn)
        .await?
        .rows_affected;
    Ok((spend + budgets, budgets))
}

impl Budgets {
    /// After [`forget_user`] committed: the user's rule and spend leave memory, and every
    /// dataplane is sent a full state.
    pub fn forget_user_in_memory(&self, user: &str) {
        {
            let mut st = self.lock();
            st.overrides.remove(user);
            st.spend.remove(user);
        }
        let _ = self.feed.send(FeedEvent::Reset);
    }
}
