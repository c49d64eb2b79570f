//! Budgets at every level: the rules admins set (for a key, a key label, an agent, a model, an
//! env, an end user, and the defaults for keys and end users), and every scope's spend in the
//! current UTC day, week and month, fed to the dataplanes that enforce them.
//!
//! The database is the source of truth: rules live in `budgets`, spend in the `budget_spend`
//! daily rollup per scope, written in the same transaction as the request records it sums. A
//! label's spend is its keys' spend (the keys holding the label now). In memory the controlplane
//! keeps the current periods' totals and a sequence number, `seq`, that grows with every ingested
//! batch ([`Budgets::apply`], called after the batch commits). Dataplanes watch a feed
//! ([`Budgets::subscribe`]): a full state, then per-batch deltas naming the scopes whose spend
//! changed. An ingest acknowledgement carries `(epoch, seq)`, so a dataplane knows when its own
//! records' spend has reached the feed and can stop counting them locally.
//!
//! `epoch` is random per process start: after a restart, the feed's full state (reloaded from
//! the database) includes everything committed before, whatever the old sequence numbers were.
//!
//! Every budget is enforced through the same leases ([`Budgets::lease`]), keyed by (scope,
//! unit, period): see docs/budgets.md for the bound they give across dataplanes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use nm_types::budget::{
    BudgetRule, LeaseKey, LeaseRequest, LeaseResponse, LeaseUnit, MINUTE_MS, Period, Scope,
    ScopeKind, Subject, check_scope_value, day_of, first_day_of_month, first_day_of_week, grant,
    minute_of, month_of_day, week_of_day,
};
use sea_orm::sea_query::OnConflict;
use sea_orm::{ActiveValue::Set, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter};
use tokio::sync::broadcast;

use crate::error::{Error, Result};
use crate::sql::Cell;
use crate::store::entity::{api_key, budget, budget_spend, user_spend};
use crate::store::upsert::Upsert;
use crate::store::{Store, WriteTxn};

/// Deltas a slow watcher may fall behind before it is sent a full state instead.
const FEED_BUFFER: usize = 1024;
/// How long a dataplane's claims count without a new report: past it, the dataplane is taken
/// for gone and its unused lease is free again (it stops spending it by then too).
pub const LEASE_TTL_MS: u64 = 5_000;

/// A budget as stored: for a scope or one of the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBudget {
    pub subject: Subject,
    pub rule: BudgetRule,
    pub updated_at_ms: i64,
}

pub use nm_types::budget::Spend;

/// One freshly stored record that counts toward budgets: the scopes it belongs to (its key,
/// agent, model, env and end user; labels follow from the key).
#[derive(Debug, Clone)]
pub struct SpendItem {
    pub scopes: Vec<Scope>,
    pub started_at_ms: i64,
    pub micros: u64,
    pub tokens: u64,
}

/// Everything a dataplane needs at once.
#[derive(Debug, Clone)]
pub struct FullState {
    pub epoch: u64,
    pub seq: u64,
    pub day: i64,
    pub month: i64,
    pub budgets: Vec<StoredBudget>,
    /// The key ids holding each label a budget names.
    pub label_keys: Vec<(String, Vec<String>)>,
    pub spend: Vec<(Scope, Spend)>,
}

/// The scopes under a budget whose spend changed with one batch (their new totals).
#[derive(Debug, Clone)]
pub struct SpendDelta {
    pub epoch: u64,
    pub seq: u64,
    pub day: i64,
    pub month: i64,
    pub spend: Vec<(Scope, Spend)>,
}

/// What watchers hear.
#[derive(Debug, Clone)]
pub enum FeedEvent {
    Delta(Arc<SpendDelta>),
    /// Rules changed or a period rolled over: send a full state.
    Reset,
}

/// One limit of a budget now: the limit, what is spent, what remains, when the period ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitStatus {
    pub unit: LeaseUnit,
    pub limit: u64,
    pub spent: u64,
    pub remaining: u64,
    pub period_end_ms: i64,
    /// The dataplanes' claims on it, and how many hold one.
    pub leased: u64,
    pub holders: u32,
}

/// A scope's budget and spend, for `budgets show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetStatus {
    pub scope: Scope,
    pub budget: Option<StoredBudget>,
    pub is_default: bool,
    pub spend: Spend,
    pub limits: Vec<LimitStatus>,
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
    week: i64,
    month: i64,
    rules: BTreeMap<Subject, StoredBudget>,
    spend: HashMap<Scope, Spend>,
    /// Labels named by a budget: the keys holding each, and per key its such labels.
    label_keys: BTreeMap<String, Vec<String>>,
    key_labels: HashMap<String, Vec<String>>,
    /// Each live dataplane process's claims, by its instance id.
    holders: HashMap<u64, Holder>,
}

impl State {
    /// The budget in force for `scope`: its own, else the default for keys or end users.
    fn rule_for(&self, scope: &Scope) -> Option<(&StoredBudget, bool)> {
        if let Some(b) = self.rules.get(&Subject::Scope(scope.clone())) {
            return Some((b, false));
        }
        let default = match scope.kind {
            ScopeKind::User => Subject::DefaultUser,
            ScopeKind::Key => Subject::DefaultKey,
            _ => return None,
        };
        self.rules.get(&default).map(|b| (b, true))
    }

    /// The current period of `unit` under `rule`.
    fn current(&self, unit: LeaseUnit, rule: &BudgetRule, now_ms: i64) -> i64 {
        if unit.per_minute() {
            minute_of(now_ms)
        } else {
            rule.period.index_of_day(self.day)
        }
    }

    /// A label's spend: its keys' spend.
    fn label_spend(&self, label: &str) -> Spend {
        let mut total = Spend::default();
        for key in self.label_keys.get(label).into_iter().flatten() {
            if let Some(s) = self.spend.get(&Scope::new(ScopeKind::Key, key.as_str())) {
                add_spend(&mut total, s);
            }
        }
        total
    }
}

fn add_spend(total: &mut Spend, s: &Spend) {
    total.day_micros = total.day_micros.saturating_add(s.day_micros);
    total.week_micros = total.week_micros.saturating_add(s.week_micros);
    total.month_micros = total.month_micros.saturating_add(s.month_micros);
    total.day_tokens = total.day_tokens.saturating_add(s.day_tokens);
    total.week_tokens = total.week_tokens.saturating_add(s.week_tokens);
    total.month_tokens = total.month_tokens.saturating_add(s.month_tokens);
    if s.minute > total.minute {
        total.minute = s.minute;
        total.minute_requests = 0;
        total.minute_tokens = 0;
    }
    if s.minute == total.minute {
        total.minute_requests = total.minute_requests.saturating_add(s.minute_requests);
        total.minute_tokens = total.minute_tokens.saturating_add(s.minute_tokens);
    }
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
    /// Loads the rules, the current month's (and week's) spend, and the labels' keys.
    pub fn load(store: Store, now_ms: i64) -> crate::BoxFuture<'static, Result<Self>> {
        Box::pin(async move {
            let day = day_of(now_ms);
            let week = week_of_day(day);
            let month = month_of_day(day);
            let mut rules = BTreeMap::new();
            for row in budget::Entity::find().all(store.conn()).await? {
                let b = from_row(row)?;
                rules.insert(b.subject.clone(), b);
            }
            let mut spend: HashMap<Scope, Spend> = HashMap::new();
            let from = first_day_of_month(month).min(first_day_of_week(week));
            let rows = budget_spend::Entity::find()
                .filter(budget_spend::Column::Day.gte(from))
                .filter(budget_spend::Column::Day.lte(day))
                .all(store.conn())
                .await?;
            for row in rows {
                let Ok(kind) = row.scope_kind.parse::<ScopeKind>() else {
                    continue;
                };
                let s = spend.entry(Scope::new(kind, row.scope_value)).or_default();
                let micros = u64::try_from(row.cost_micros).unwrap_or(0);
                let tokens = u64::try_from(row.tokens).unwrap_or(0);
                if month_of_day(row.day) == month {
                    s.month_micros = s.month_micros.saturating_add(micros);
                    s.month_tokens = s.month_tokens.saturating_add(tokens);
                }
                if week_of_day(row.day) == week {
                    s.week_micros = s.week_micros.saturating_add(micros);
                    s.week_tokens = s.week_tokens.saturating_add(tokens);
                }
                if row.day == day {
                    s.day_micros = s.day_micros.saturating_add(micros);
                    s.day_tokens = s.day_tokens.saturating_add(tokens);
                }
            }
            let (feed, _) = broadcast::channel(FEED_BUFFER);
            let budgets = Self {
                store,
                state: Arc::new(Mutex::new(State {
                    epoch: rand::random::<u64>() | 1,
                    seq: 0,
                    day,
                    week,
                    month,
                    rules,
                    spend,
                    label_keys: BTreeMap::new(),
                    key_labels: HashMap::new(),
                    holders: HashMap::new(),
                })),
                feed,
            };
            budgets.refresh_labels().await?;
            Ok(budgets)
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain numbers behind; keep serving them.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads which keys hold the labels budgets name; when that changed, watchers get a full
    /// state. Called at start, when budgets change, and every few seconds (key labels change).
    pub fn refresh_labels(&self) -> crate::BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let wanted: HashSet<String> = self
                .lock()
                .rules
                .keys()
                .filter_map(|s| match s {
                    Subject::Scope(Scope {
                        kind: ScopeKind::Label,
                        value,
                    }) => Some(value.clone()),
                    _ => None,
                })
                .collect();
            let mut label_keys: BTreeMap<String, Vec<String>> =
                wanted.iter().map(|l| (l.clone(), Vec::new())).collect();
            if !wanted.is_empty() {
                let keys = api_key::Entity::find()
                    .filter(api_key::Column::LabelsJson.is_not_null())
                    .all(self.store.conn())
                    .await?;
                for k in keys {
                    for (name, value) in crate::keys::parse_labels(k.labels_json.as_deref()) {
                        let label = format!("{name}={value}");
                        if let Some(ids) = label_keys.get_mut(&label)
                            && !ids.contains(&k.id)
                        {
                            ids.push(k.id.clone());
                        }
                    }
                }
            }
            let mut st = self.lock();
            if st.label_keys == label_keys {
                return Ok(());
            }
            let mut key_labels: HashMap<String, Vec<String>> = HashMap::new();
            for (label, keys) in &label_keys {
                for k in keys {
                    key_labels.entry(k.clone()).or_default().push(label.clone());
                }
            }
            st.label_keys = label_keys;
            st.key_labels = key_labels;
            let labels: Vec<String> = st.label_keys.keys().cloned().collect();
            st.spend.retain(|s, _| s.kind != ScopeKind::Label);
            for label in labels {
                let total = st.label_spend(&label);
                st.spend.insert(Scope::new(ScopeKind::Label, label), total);
            }
            drop(st);
            let _ = self.feed.send(FeedEvent::Reset);
            Ok(())
        })
    }

    /// Creates or replaces a budget.
    pub fn set<'a>(
        &'a self,
        actor: &'a str,
        subject: Subject,
        rule: BudgetRule,
        now_ms: i64,
    ) -> crate::BoxFuture<'a, Result<StoredBudget>> {
        Box::pin(async move {
            rule.validate()
                .map_err(|why| Error::InvalidArgument(why.to_owned()))?;
            check_subject(&subject)?;
            let stored = StoredBudget {
                subject: subject.clone(),
                rule,
                updated_at_ms: now_ms,
            };
            let target = subject.to_stored();
            let row = budget::ActiveModel {
                subject: Set(target.clone()),
                limit_micros: Set(rule.limit_micros.and_then(|l| i64::try_from(l).ok())),
                period: Set(rule.period.as_str().to_owned()),
                requests_per_minute: Set(rule
                    .requests_per_minute
                    .map(|r| i32::try_from(r).unwrap_or(i32::MAX))),
                updated_at_ms: Set(now_ms),
                limit_tokens: Set(rule.limit_tokens.and_then(|l| i64::try_from(l).ok())),
                tokens_per_minute: Set(rule.tokens_per_minute.and_then(|l| i64::try_from(l).ok())),
            };
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
                            budget::Column::LimitTokens,
                            budget::Column::TokensPerMinute,
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
            self.lock().rules.insert(subject, stored.clone());
            let _ = self.feed.send(FeedEvent::Reset);
            self.refresh_labels().await?;
            Ok(stored)
        })
    }

    /// Removes a budget; false when there was none.
    pub fn delete<'a>(
        &'a self,
        actor: &'a str,
        subject: &'a Subject,
    ) -> crate::BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            check_subject(subject)?;
            let target = subject.to_stored();
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
            self.lock().rules.remove(subject);
            let _ = self.feed.send(FeedEvent::Reset);
            self.refresh_labels().await?;
            Ok(res.rows_affected > 0)
        })
    }

    /// Every budget: the defaults first, then by scope.
    pub fn list(&self) -> Vec<StoredBudget> {
        let st = self.lock();
        let mut all: Vec<StoredBudget> = st.rules.values().cloned().collect();
        all.sort_by_key(|b| match &b.subject {
            Subject::DefaultUser => (0, None),
            Subject::DefaultKey => (1, None),
            Subject::Scope(s) => (2, Some(s.clone())),
        });
        all
    }

    /// A scope's budget in force and current spend.
    pub fn status(&self, scope: &Scope, now_ms: i64) -> Result<BudgetStatus> {
        check_scope_value(scope.kind, &scope.value)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", scope.kind.as_str())))?;
        let mut st = self.lock();
        roll(&mut st, now_ms);
        let (budget, is_default) = match st.rule_for(scope) {
            Some((b, d)) => (Some(b.clone()), d),
            None => (None, false),
        };
        let spend = st.spend.get(scope).copied().unwrap_or_default();
        let ttl = i64::try_from(LEASE_TTL_MS).unwrap_or(i64::MAX);
        let mut limits = Vec::new();
        if let Some(b) = &budget {
            for unit in LeaseUnit::ALL {
                let Some(limit) = unit.limit(&b.rule) else {
                    continue;
                };
                let current = st.current(unit, &b.rule, now_ms);
                let spent = unit.recorded(&b.rule, &spend, current, current);
                let key = LeaseKey {
                    scope: scope.clone(),
                    unit,
                    period: current,
                };
                let (mut leased, mut holders) = (0u64, 0u32);
                for h in st.holders.values() {
                    if let Some(c) = h
                        .claims
                        .get(&key)
                        .filter(|_| h.last_report_ms + ttl > now_ms)
                    {
                        leased = leased.saturating_add(*c);
                        holders += 1;
                    }
                }
                limits.push(LimitStatus {
                    unit,
                    limit,
                    spent,
                    remaining: limit.saturating_sub(spent),
                    period_end_ms: if unit.per_minute() {
                        (minute_of(now_ms) + 1) * MINUTE_MS
                    } else {
                        b.rule.period.end_ms(now_ms)
                    },
                    leased,
                    holders,
                });
            }
        }
        let micros = limits.iter().find(|l| l.unit == LeaseUnit::Micros);
        Ok(BudgetStatus {
            scope: scope.clone(),
            is_default,
            day_micros: spend.day_micros,
            month_micros: spend.month_micros,
            remaining_micros: micros.map(|l| l.remaining),
            resets_at_ms: budget.as_ref().map(|b| b.rule.period.end_ms(now_ms)),
            leased_micros: micros.map_or(0, |l| l.leased),
            lease_holders: micros.map_or(0, |l| l.holders),
            budget,
            spend,
            limits,
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
        let mut granted = Vec::with_capacity(req.claims.len());
        for c in &req.claims {
            if c.want == 0 {
                granted.push(0);
                continue;
            }
            let bounds = st.rule_for(&c.key.scope).and_then(|(b, _)| {
                let rule = b.rule;
                let limit = c.key.unit.limit(&rule)?;
                let current = st.current(c.key.unit, &rule, now_ms);
                let spend = st.spend.get(&c.key.scope).copied().unwrap_or_default();
                let spent = c.key.unit.recorded(&rule, &spend, current, c.key.period);
                Some((limit, current, spent))
            });
            let g = match bounds {
                // A past period is over: nothing more to spend in it.
                Some((limit, current, spent)) if c.key.period >= current => {
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
        let (day, week, month) = (st.day, st.week, st.month);
        let now_minute = minute_of(now_ms);
        // The scopes whose spend this batch changed, in first-seen order: a batch of a thousand
        // records may name as many users, so membership is a set, not a scan of the list.
        let mut changed: Vec<Scope> = Vec::new();
        let mut seen: HashSet<Scope> = HashSet::new();
        let st = &mut *st;
        // Without any budget no scope is sent (below): nothing to track.
        let ruled = !st.rules.is_empty();
        for item in items {
            let item_day = day_of(item.started_at_ms);
            let item_month = month_of_day(item_day);
            let item_week = week_of_day(item_day);
            let item_minute = minute_of(item.started_at_ms);
            // Old news (an earlier period, a spooled record replayed late) stays in the database
            // rollup but does not count toward the current periods.
            if item_month != month && item_week != week && item_minute < now_minute - 1 {
                continue;
            }
            // The labels of the item's key, when a budget names any (rarely: no allocation
            // without them).
            let labels: Vec<Scope> = if st.key_labels.is_empty() {
                Vec::new()
            } else {
                item.scopes
                    .iter()
                    .filter(|s| s.kind == ScopeKind::Key)
                    .filter_map(|s| st.key_labels.get(&s.value))
                    .flatten()
                    .map(|l| Scope::new(ScopeKind::Label, l.as_str()))
                    .collect()
            };
            for scope in item.scopes.iter().chain(&labels) {
                // Most items name a scope already counted: look up before cloning it.
                let s = match st.spend.get_mut(scope) {
                    Some(s) => s,
                    None => st.spend.entry(scope.clone()).or_default(),
                };
                if item_month == month {
                    s.month_micros = s.month_micros.saturating_add(item.micros);
                    s.month_tokens = s.month_tokens.saturating_add(item.tokens);
                }
                if item_week == week {
                    s.week_micros = s.week_micros.saturating_add(item.micros);
                    s.week_tokens = s.week_tokens.saturating_add(item.tokens);
                }
                if item_day == day {
                    s.day_micros = s.day_micros.saturating_add(item.micros);
                    s.day_tokens = s.day_tokens.saturating_add(item.tokens);
                }
                if item_minute > s.minute {
                    s.minute = item_minute;
                    s.minute_requests = 0;
                    s.minute_tokens = 0;
                }
                if item_minute == s.minute {
                    s.minute_requests = s.minute_requests.saturating_add(1);
                    s.minute_tokens = s.minute_tokens.saturating_add(item.tokens);
                }
                if ruled && !seen.contains(scope) {
                    seen.insert(scope.clone());
                    changed.push(scope.clone());
                }
            }
        }
        // Only the scopes a budget applies to: nothing else reads them (a dataplane keeps the
        // spend of ruled scopes only, the alerts check ruled scopes only), and a new budget comes
        // with a full state. Without any budget a delta is just its position.
        let delta = SpendDelta {
            epoch: st.epoch,
            seq: st.seq,
            day,
            month,
            spend: changed
                .into_iter()
                .filter(|u| st.rule_for(u).is_some())
                .filter_map(|u| st.spend.get(&u).map(|s| (u, *s)))
                .collect(),
        };
        let at = (st.epoch, st.seq);
        let _ = self.feed.send(FeedEvent::Delta(Arc::new(delta)));
        at
    }
}

/// Adds a batch's spend to the daily rollup per scope, inside the batch's transaction. Labels
/// are not stored: a label's spend is its keys'.
pub(crate) async fn add_to_rollup(txn: &WriteTxn, items: &[SpendItem]) -> Result<()> {
    // One row per (scope, day): PostgreSQL refuses an upsert that names a row twice. Sorted, so
    // concurrent batches lock rows in one order.
    let mut sums: BTreeMap<(&str, &str, i64), (i64, i64, i64)> = BTreeMap::new();
    for item in items {
        for scope in item.scopes.iter().filter(|s| s.kind != ScopeKind::Label) {
            let e = sums
                .entry((
                    scope.kind.as_str(),
                    scope.value.as_str(),
                    day_of(item.started_at_ms),
                ))
                .or_default();
            e.0 =
                e.0.saturating_add(i64::try_from(item.micros).unwrap_or(i64::MAX));
            e.1 =
                e.1.saturating_add(i64::try_from(item.tokens).unwrap_or(i64::MAX));
            e.2 += 1;
        }
    }
    if sums.is_empty() {
        return Ok(());
    }
    let mut values = Vec::with_capacity(sums.len() * SPEND_COLUMNS.len());
    for ((kind, value, day), (micros, tokens, requests)) in &sums {
        values.extend([
            Cell::Text(Some(kind)),
            Cell::Text(Some(value)),
            Cell::Int(Some(*day)),
            Cell::Int(Some(*micros)),
            Cell::Int(Some(*tokens)),
            Cell::Int(Some(*requests)),
        ]);
    }
    SPEND_UPSERT.run(txn, &values).await
}

/// The columns of `budget_spend` [`add_to_rollup`] writes.
const SPEND_COLUMNS: [&str; 6] = [
    "scope_kind",
    "scope_value",
    "day",
    "cost_micros",
    "tokens",
    "requests",
];

/// [`add_to_rollup`]'s upsert: a batch's spend added to the day's.
static SPEND_UPSERT: LazyLock<Upsert> = LazyLock::new(|| {
    Upsert::new(
        "budget_spend",
        &SPEND_COLUMNS,
        " ON CONFLICT (scope_kind, scope_value, day) DO UPDATE SET \
         cost_micros = budget_spend.cost_micros + excluded.cost_micros, \
         tokens = budget_spend.tokens + excluded.tokens, \
         requests = budget_spend.requests + excluded.requests"
            .to_owned(),
    )
});

/// Moves the state to the periods of `now_ms`; true when they changed.
fn roll(st: &mut State, now_ms: i64) -> bool {
    let day = day_of(now_ms);
    if day <= st.day {
        return false;
    }
    let week = week_of_day(day);
    let month = month_of_day(day);
    for s in st.spend.values_mut() {
        s.day_micros = 0;
        s.day_tokens = 0;
        if week != st.week {
            s.week_micros = 0;
            s.week_tokens = 0;
        }
        if month != st.month {
            s.month_micros = 0;
            s.month_tokens = 0;
        }
    }
    if month != st.month && week != st.week {
        st.spend.retain(|_, s| s.minute >= minute_of(now_ms) - 1);
    }
    st.day = day;
    st.week = week;
    st.month = month;
    true
}

fn full_state(st: &State) -> FullState {
    FullState {
        epoch: st.epoch,
        seq: st.seq,
        day: st.day,
        month: st.month,
        budgets: st.rules.values().cloned().collect(),
        label_keys: st
            .label_keys
            .iter()
            .map(|(l, k)| (l.clone(), k.clone()))
            .collect(),
        spend: st.spend.iter().map(|(u, s)| (u.clone(), *s)).collect(),
    }
}

/// A stored budget row as the audit trail shows it.
fn budget_audit_json(b: &budget::Model) -> serde_json::Value {
    serde_json::json!({
        "subject": b.subject,
        "limit_micros": b.limit_micros,
        "limit_tokens": b.limit_tokens,
        "period": b.period,
        "requests_per_minute": b.requests_per_minute,
        "tokens_per_minute": b.tokens_per_minute,
    })
}

fn stored_audit_json(b: &StoredBudget) -> serde_json::Value {
    serde_json::json!({
        "subject": b.subject.to_stored(),
        "limit_micros": b.rule.limit_micros,
        "limit_tokens": b.rule.limit_tokens,
        "period": b.rule.period.as_str(),
        "requests_per_minute": b.rule.requests_per_minute,
        "tokens_per_minute": b.rule.tokens_per_minute,
    })
}

fn check_subject(subject: &Subject) -> Result<()> {
    match subject {
        Subject::Scope(s) => check_scope_value(s.kind, &s.value)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", s.kind.as_str()))),
        _ => Ok(()),
    }
}

fn from_row(row: budget::Model) -> Result<StoredBudget> {
    let subject = Subject::from_stored(&row.subject)
        .map_err(|e| Error::Config(format!("budgets table: {e}")))?;
    let period = row
        .period
        .parse::<Period>()
        .map_err(|e| Error::Config(format!("budgets table: {e}")))?;
    Ok(StoredBudget {
        subject,
        rule: BudgetRule {
            limit_micros: row.limit_micros.and_then(|l| u64::try_from(l).ok()),
            period,
            requests_per_minute: row.requests_per_minute.and_then(|r| u32::try_from(r).ok()),
            limit_tokens: row.limit_tokens.and_then(|l| u64::try_from(l).ok()),
            tokens_per_minute: row.tokens_per_minute.and_then(|l| u64::try_from(l).ok()),
        },
        updated_at_ms: row.updated_at_ms,
    })
}

/// The first millisecond of the minute after `ms`.
pub fn next_minute_ms(ms: i64) -> i64 {
    (minute_of(ms) + 1) * MINUTE_MS
}

/// End-user erasure (`crate::forget`), on the forgetting transaction: the user's daily spend
/// moves to `token` (totals unchanged; the legacy `user_spend` table too, emptied by m0012 but
/// written by older builds) and the user's own budget is deleted, so a user coming back under
/// the same id starts afresh. Returns (rows changed, budgets deleted).
pub(crate) async fn forget_user(
    txn: &impl ConnectionTrait,
    user: &str,
    token: &str,
) -> Result<(u64, u64)> {
    let backend = txn.get_database_backend();
    let user_kind = ScopeKind::User.as_str();
    let mut sql = crate::sql::Sql::new(
        backend,
        "INSERT INTO budget_spend (scope_kind, scope_value, day, cost_micros, tokens, requests) \
         SELECT scope_kind, ",
    );
    sql.bind(token.to_owned())
        .push(", day, cost_micros, tokens, requests FROM budget_spend WHERE scope_kind = ")
        .bind(user_kind.to_owned())
        .push(" AND scope_value = ")
        .bind(user.to_owned())
        .push(
            " ON CONFLICT (scope_kind, scope_value, day) DO UPDATE SET \
             cost_micros = budget_spend.cost_micros + excluded.cost_micros, \
             tokens = budget_spend.tokens + excluded.tokens, \
             requests = budget_spend.requests + excluded.requests",
        );
    txn.execute_raw(sql.build()).await?;
    let spend = budget_spend::Entity::delete_many()
        .filter(budget_spend::Column::ScopeKind.eq(user_kind))
        .filter(budget_spend::Column::ScopeValue.eq(user))
        .exec(txn)
        .await?
        .rows_affected;
    let mut legacy = crate::sql::Sql::new(
        backend,
        "INSERT INTO user_spend (user_id, day, cost_micros, requests) SELECT ",
    );
    legacy
        .bind(token.to_owned())
        .push(", day, cost_micros, requests FROM user_spend WHERE user_id = ")
        .bind(user.to_owned())
        .push(
            " ON CONFLICT (user_id, day) DO UPDATE SET \
             cost_micros = user_spend.cost_micros + excluded.cost_micros, \
             requests = user_spend.requests + excluded.requests",
        );
    txn.execute_raw(legacy.build()).await?;
    let legacy_spend = user_spend::Entity::delete_many()
        .filter(user_spend::Column::UserId.eq(user))
        .exec(txn)
        .await?
        .rows_affected;
    let own = Subject::Scope(Scope::user(user)).to_stored();
    let budgets = budget::Entity::delete_by_id(own)
        .exec(txn)
        .await?
        .rows_affected;
    Ok((spend + legacy_spend + budgets, budgets))
}

impl Budgets {
    /// After [`forget_user`] committed: the user's rule and spend leave memory, and every
    /// dataplane is sent a full state.
    pub fn forget_user_in_memory(&self, user: &str) {
        {
            let mut st = self.lock();
            let scope = Scope::user(user);
            st.rules.remove(&Subject::Scope(scope.clone()));
            st.spend.remove(&scope);
        }
        let _ = self.feed.send(FeedEvent::Reset);
    }
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
            scopes: vec![Scope::user(user)],
            started_at_ms: at,
            micros,
            tokens: 0,
        }
    }

    fn u(user: &str) -> Scope {
        Scope::user(user)
    }

    /// A rule no test reaches.
    fn any_rule() -> BudgetRule {
        BudgetRule {
            limit_micros: Some(1_000_000_000),
            period: Period::Day,
            requests_per_minute: None,
            limit_tokens: None,
            tokens_per_minute: None,
        }
    }

    #[tokio::test]
    async fn a_batch_delta_names_only_scopes_under_a_budget() {
        let (_dir, store) = store().await;
        let now = day_from_civil(2026, 11, 22) * DAY_MS + 3_600_000;
        let b = Budgets::load(store, now).await.unwrap();
        let agent = |name: &str| Scope::new(ScopeKind::Agent, name);
        let batch = |user: &str| SpendItem {
            scopes: vec![u(user), agent("ruled"), agent("free")],
            started_at_ms: now,
            micros: 10,
            tokens: 1,
        };
        let (_full, mut rx) = b.subscribe(now);
        // No budget at all: the delta is only its position, yet the spend is counted.
        let at = b.apply(&[batch("u1")], now);
        let FeedEvent::Delta(delta) = rx.recv().await.unwrap() else {
            panic!("expected a delta");
        };
        assert!(delta.spend.is_empty());
        assert_eq!((delta.epoch, delta.seq), at);
        assert_eq!(b.status(&agent("free"), now).unwrap().day_micros, 10);

        b.set("key_test", Subject::Scope(agent("ruled")), any_rule(), 1)
            .await
            .unwrap();
        b.set("key_test", Subject::DefaultUser, any_rule(), 2)
            .await
            .unwrap();
        let (_full, mut rx) = b.subscribe(now);
        b.apply(&[batch("u2")], now);
        let FeedEvent::Delta(delta) = rx.recv().await.unwrap() else {
            panic!("expected a delta");
        };
        let named: Vec<&Scope> = delta.spend.iter().map(|(s, _)| s).collect();
        assert_eq!(named, [&u("u2"), &agent("ruled")]);
        assert_eq!(delta.spend[1].1.day_micros, 20);
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
        let s = b.status(&u("u1"), now).unwrap();
        assert_eq!((s.day_micros, s.month_micros), (700, 1000));

        let reloaded = Budgets::load(store, now).await.unwrap();
        let s = reloaded.status(&u("u1"), now).unwrap();
        assert_eq!((s.day_micros, s.month_micros), (700, 1000));
        assert_ne!(reloaded.full_state(now).epoch, epoch);

        // Next day: the day resets, the month goes on.
        let s = reloaded.status(&u("u1"), now + DAY_MS).unwrap();
        assert_eq!((s.day_micros, s.month_micros), (0, 1000));
    }

    #[tokio::test]
    async fn a_batch_delta_names_each_user_once_in_first_seen_order() {
        let (_dir, store) = store().await;
        let now = day_from_civil(2026, 11, 22) * DAY_MS + 3_600_000;
        let b = Budgets::load(store, now).await.unwrap();
        b.set("key_test", Subject::DefaultUser, any_rule(), 1)
            .await
            .unwrap();
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
            let user = it.scopes[0].value.as_str();
            if !first_seen.contains(&user) {
                first_seen.push(user);
            }
        }
        let named: Vec<&str> = delta.spend.iter().map(|(u, _)| u.value.as_str()).collect();
        assert_eq!(named, first_seen);
        for (user, spend) in &delta.spend {
            let (micros, requests) = items
                .iter()
                .filter(|it| &it.scopes[0] == user)
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
            limit_tokens: None,
            tokens_per_minute: None,
        };
        b.set("key_test", Subject::DefaultUser, rule, 1)
            .await
            .unwrap();
        b.set(
            "key_test",
            Subject::Scope(u("alice")),
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
            limit_tokens: None,
            tokens_per_minute: None,
        };
        assert!(matches!(
            b.set("key_test", Subject::DefaultUser, bad, 3).await,
            Err(Error::InvalidArgument(_))
        ));
        let reloaded = Budgets::load(store, 0).await.unwrap();
        let all = reloaded.list();
        assert_eq!(all[0].subject, Subject::DefaultUser);
        assert_eq!(all[0].rule, rule);
        assert_eq!(all.len(), 2);
        assert!(reloaded.status(&u("bob"), 0).unwrap().is_default);
        assert!(!reloaded.status(&u("alice"), 0).unwrap().is_default);
        assert!(
            reloaded
                .delete("key_test", &Subject::Scope(u("alice")))
                .await
                .unwrap()
        );
        assert!(
            !reloaded
                .delete("key_test", &Subject::Scope(u("alice")))
                .await
                .unwrap()
        );
    }

    fn claim(user: &str, unit: LeaseUnit, period: i64, claim: u64, want: u64) -> LeaseClaim {
        LeaseClaim {
            key: LeaseKey {
                scope: u(user),
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
            limit_tokens: None,
            tokens_per_minute: None,
        };
        b.set("key_test", Subject::DefaultUser, rule, now)
            .await
            .unwrap();
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
        b.delete("key_test", &Subject::DefaultUser).await.unwrap();
        assert_eq!(b.lease(&report(4, vec![none]), later).granted, [0]);
    }
}
