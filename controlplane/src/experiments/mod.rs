//! Experiments (the controlplane's half): everything an operator does with one, stored, and the
//! live set the dataplanes apply.
//!
//! An experiment belongs to one agent (and optionally one env) and splits that agent's sessions
//! between two or more arms, each a model on a provider of one wire format, by weight
//! (`nm_types::experiment`: the sticky assignment every dataplane computes alike). Its life:
//!
//! ```text
//!            pause              decide(winner)        promote(arm)
//!   running ───────▶ paused    running|paused ──▶ decided ──────────▶ decided + promoted
//!      ▲               │        running|paused ──▶ harm ──rollback──▶ running
//!      └─────resume────┘        running|paused ──▶ inconclusive
//!   any state but stopped ──stop──▶ stopped (for good)
//! ```
//!
//! Promotion (to a named arm, or to the decided winner) works from every state but stopped and
//! ends the experiment `decided` with `promoted` set: every session of the agent then goes to
//! the winner until the experiment is stopped. A rollback takes one arm out (never the last
//! active one); from `harm` the experiment runs on with the arms left.
//!
//! Each change ([`Experiments::pause`], ..., and the evaluation's [`Experiments::decide`],
//! [`Experiments::harm`], [`Experiments::inconclusive`], which act as `system`) is one write
//! transaction holding the experiment's new row, its history event (`experiment_events`) and
//! its audit row (`experiment.<action>`), and logs one INFO line. Illegal transitions are
//! refused with `FailedPrecondition` naming the rule.
//!
//! At most one experiment per agent and env is running or paused (or promoted, which changes
//! traffic too), and one without env conflicts with every env of its agent: a create checks it
//! inside its write transaction, under a lock per agent on PostgreSQL (SQLite's writers are
//! serialised by `BEGIN IMMEDIATE`), so two concurrent creates cannot both win.
//!
//! The live set ([`LiveSet`]: running experiments with the arms not rolled back, promoted ones
//! with their winner alone) is kept in a `watch`, re-read after every change made here and every
//! [`LIVE_REFRESH`] (another replica's changes); every key snapshot carries it
//! (`crate::feeds::key_snapshots`).

mod evaluate;
mod rules;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use nm_types::Env;
use nm_types::experiment::{Live, LiveArm, Salt};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, Condition, ConnectionTrait, DatabaseBackend, EntityTrait,
    QueryFilter, QueryOrder, Set,
};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::audit::{self, Change, SYSTEM_ACTOR};
use crate::error::{Error, Result};
use crate::sql::Sql;
use crate::store::Store;
use crate::store::entity::{experiment, experiment_arm, experiment_event};

pub use evaluate::Evidence;
pub use rules::{
    Action, ArmSpec, Catalogue, Checked, Guardrail, MAX_DESCRIPTION_CHARS, MAX_REASON_CHARS,
    NewExperiment, ProviderInfo, State, Unit, allowed, check,
};

/// How often the live set is re-read from the database.
pub const LIVE_REFRESH: Duration = Duration::from_secs(2);

/// One arm as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExperimentArm {
    pub name: String,
    pub provider: String,
    pub model: String,
    pub weight: u32,
    pub rolled_back: bool,
}

/// An experiment as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Experiment {
    pub id: String,
    pub agent: String,
    pub env: Option<Env>,
    pub state: State,
    /// The key of its assignment (a secret: its `Debug` hides it; never in an answer).
    pub salt: Salt,
    pub unit: Unit,
    pub guardrails: Vec<Guardrail>,
    pub max_sessions: Option<u64>,
    pub max_days: Option<u32>,
    pub auto_promote: bool,
    pub auto_rollback: bool,
    pub description: String,
    pub winner: Option<String>,
    pub promoted: bool,
    pub reason: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// In the order given at creation.
    pub arms: Vec<ExperimentArm>,
}

impl Experiment {
    /// The arms no rollback took out.
    pub fn active_arms(&self) -> impl Iterator<Item = &ExperimentArm> {
        self.arms.iter().filter(|a| !a.rolled_back)
    }

    /// How it changes traffic now, if it does: running, its arms not rolled back; promoted,
    /// its winner alone.
    pub fn live(&self) -> Option<Live> {
        let arms: Vec<&ExperimentArm> = match (self.state, self.promoted) {
            (State::Running, _) => self.active_arms().collect(),
            (State::Decided, true) => self
                .arms
                .iter()
                .filter(|a| Some(&a.name) == self.winner.as_ref())
                .collect(),
            _ => return None,
        };
        if arms.is_empty() {
            return None;
        }
        Some(Live {
            id: self.id.as_str().into(),
            agent: self.agent.as_str().into(),
            env: self.env,
            salt: self.salt,
            arms: arms
                .into_iter()
                .map(|a| LiveArm {
                    name: a.name.as_str().into(),
                    weight: a.weight,
                    provider: a.provider.as_str().into(),
                    model: a.model.as_str().into(),
                })
                .collect(),
        })
    }

    /// The arm `name`, which must not have been rolled back.
    fn active_arm(&mut self, name: &str) -> Result<&mut ExperimentArm> {
        let names = self
            .arms
            .iter()
            .map(|a| a.name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let arm = self
            .arms
            .iter_mut()
            .find(|a| a.name == name)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "arm: the experiment has no arm named {name:?} (its arms: {names})"
                ))
            })?;
        if arm.rolled_back {
            return Err(Error::FailedPrecondition(format!(
                "arm {name} was rolled back"
            )));
        }
        Ok(arm)
    }

    /// Whether this experiment and one on `agent`/`env` would claim the same traffic.
    fn overlaps(&self, agent: &str, env: Option<Env>) -> bool {
        self.agent == agent && (self.env.is_none() || env.is_none() || self.env == env)
    }

    /// Whether it holds its agent and env: running, paused, or promoted.
    fn holds_traffic(&self) -> bool {
        matches!(self.state, State::Running | State::Paused)
            || (self.state == State::Decided && self.promoted)
    }
}

/// One entry of an experiment's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub at_ms: i64,
    /// `created`, `paused`, `resumed`, `stopped`, `decided`, `harm`, `inconclusive`,
    /// `promoted`, `rolled_back`.
    pub kind: String,
    pub arm: Option<String>,
    /// A key id, or `system`.
    pub actor: String,
    pub detail: String,
}

/// The experiments that change traffic now, as every key snapshot carries them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LiveSet {
    /// Grows by one whenever the set changes.
    pub version: u64,
    /// By id.
    pub experiments: Vec<Live>,
}

/// Which experiments to list.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Empty: every agent.
    pub agent: String,
    /// Empty: every state.
    pub state: String,
}

/// Experiments over a [`Store`], with the live set.
#[derive(Debug, Clone)]
pub struct Experiments {
    store: Store,
    live: Arc<watch::Sender<Arc<LiveSet>>>,
}

impl Experiments {
    /// Reads the live set from the database.
    pub fn load(store: Store) -> crate::BoxFuture<'static, Result<Self>> {
        Box::pin(async move {
            let experiments = Self {
                store,
                live: Arc::new(watch::Sender::new(Arc::new(LiveSet::default()))),
            };
            experiments.refresh().await?;
            Ok(experiments)
        })
    }

    /// The live set now and on every change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<LiveSet>> {
        self.live.subscribe()
    }

    pub fn live(&self) -> Arc<LiveSet> {
        self.live.borrow().clone()
    }

    /// Re-reads the live set: running experiments, and promoted ones.
    pub fn refresh(&self) -> crate::BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let rows = experiment::Entity::find()
                .filter(
                    Condition::any()
                        .add(experiment::Column::State.eq(State::Running.as_str()))
                        .add(
                            Condition::all()
                                .add(experiment::Column::State.eq(State::Decided.as_str()))
                                .add(experiment::Column::Promoted.eq(true)),
                        ),
                )
                .all(self.store.conn())
                .await?;
            let mut live = Vec::with_capacity(rows.len());
            for e in self.with_arms(self.store.conn(), rows).await? {
                let e = match e {
                    Ok(e) => e,
                    Err(why) => {
                        warn!(error = %why, "stored experiment unreadable; left out of the live set");
                        continue;
                    }
                };
                match e.live() {
                    Some(l) => match l.check() {
                        Ok(()) => live.push(l),
                        Err(why) => {
                            warn!(experiment.id = %e.id, why, "stored experiment breaks a rule of live experiments; left out");
                        }
                    },
                    None => {
                        warn!(experiment.id = %e.id, "live experiment without an arm; left out")
                    }
                }
            }
            live.sort_by(|a, b| a.id.cmp(&b.id));
            self.live.send_if_modified(|set| {
                if set.experiments == live {
                    return false;
                }
                *set = Arc::new(LiveSet {
                    version: set.version + 1,
                    experiments: live,
                });
                true
            });
            Ok(())
        })
    }

    /// Re-reads the live set every `period` until `shutdown`.
    pub fn spawn_refresher(
        &self,
        period: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let experiments = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
                if let Err(e) = experiments.refresh().await {
                    warn!(error = %e, "experiments refresh failed; keeping the last live set");
                }
            }
        })
    }

    // === reads ===

    /// Experiments, newest first.
    pub fn list<'a>(
        &'a self,
        filter: &'a ListFilter,
    ) -> crate::BoxFuture<'a, Result<Vec<Experiment>>> {
        Box::pin(async move {
            let mut q = experiment::Entity::find()
                .order_by_desc(experiment::Column::CreatedAtMs)
                .order_by_desc(experiment::Column::Id);
            let agent = filter.agent.trim();
            if !agent.is_empty() {
                q = q.filter(experiment::Column::Agent.eq(agent));
            }
            let state = filter.state.trim();
            if !state.is_empty() {
                let state: State = state.parse()?;
                q = q.filter(experiment::Column::State.eq(state.as_str()));
            }
            let rows = q.all(self.store.conn()).await?;
            self.with_arms(self.store.conn(), rows)
                .await?
                .into_iter()
                .collect()
        })
    }

    pub fn get<'a>(&'a self, id: &'a str) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move { read(self.store.conn(), id).await })
    }

    /// The history, oldest first.
    pub fn history<'a>(&'a self, id: &'a str) -> crate::BoxFuture<'a, Result<Vec<Event>>> {
        Box::pin(async move {
            self.get(id).await?;
            let rows = experiment_event::Entity::find()
                .filter(experiment_event::Column::ExperimentId.eq(id))
                .order_by_asc(experiment_event::Column::AtMs)
                .order_by_asc(experiment_event::Column::Id)
                .all(self.store.conn())
                .await?;
            Ok(rows
                .into_iter()
                .map(|r| Event {
                    at_ms: r.at_ms,
                    kind: r.kind,
                    arm: r.arm,
                    actor: r.actor,
                    detail: r.detail,
                })
                .collect())
        })
    }

    /// Each row with its arms (one query for all), or why it could not be read.
    async fn with_arms(
        &self,
        db: &impl ConnectionTrait,
        rows: Vec<experiment::Model>,
    ) -> Result<Vec<Result<Experiment>>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
        let mut arms = experiment_arm::Entity::find()
            .filter(experiment_arm::Column::ExperimentId.is_in(ids))
            .order_by_asc(experiment_arm::Column::ExperimentId)
            .order_by_asc(experiment_arm::Column::Position)
            .all(db)
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut arms)
                    .into_iter()
                    .partition(|a| a.experiment_id == row.id);
                arms = rest;
                from_rows(row, mine)
            })
            .collect())
    }

    /// Makes sure no other experiment holds `agent` on `env` (running, paused or promoted, an
    /// experiment without env overlapping every env), inside the write transaction `txn` that
    /// will make `id` hold it. On PostgreSQL it first takes a lock per agent for the rest of the
    /// transaction: claims on one agent queue there until the first commits, and READ
    /// COMMITTED then shows each the rows committed before it got the lock. (SQLite's writers
    /// are serialised by `BEGIN IMMEDIATE`.)
    async fn claim(
        &self,
        txn: &impl ConnectionTrait,
        agent: &str,
        env: Option<Env>,
        id: &str,
    ) -> Result<()> {
        if txn.get_database_backend() == DatabaseBackend::Postgres {
            let mut lock = Sql::new(
                DatabaseBackend::Postgres,
                "SELECT pg_advisory_xact_lock(hashtextextended(",
            );
            lock.bind(format!("nm.experiments:{agent}")).push(", 0))");
            txn.execute_raw(lock.build()).await?;
        }
        let same_agent = experiment::Entity::find()
            .filter(experiment::Column::Agent.eq(agent))
            .filter(experiment::Column::Id.ne(id))
            .filter(experiment::Column::State.is_in([
                State::Running.as_str(),
                State::Paused.as_str(),
                State::Decided.as_str(),
            ]))
            .all(txn)
            .await?;
        for other in self.with_arms(txn, same_agent).await?.into_iter().flatten() {
            if other.holds_traffic() && other.overlaps(agent, env) {
                let promoted = if other.promoted { ", promoted" } else { "" };
                return Err(Error::FailedPrecondition(format!(
                    "agent {agent} already has experiment {} ({}{promoted}) on {}; stop it first \
                     (one running or paused experiment per agent and env, and one without env \
                     covers every env)",
                    other.id,
                    other.state,
                    other.env.map_or("every env", Env::as_str)
                )));
            }
        }
        Ok(())
    }

    // === changes ===

    /// Creates an experiment (running at once), by `actor`, with arms checked against
    /// `catalogue`.
    #[tracing::instrument(skip_all, fields(experiment.id = tracing::field::Empty))]
    pub fn create<'a>(
        &'a self,
        actor: &'a str,
        new: NewExperiment,
        catalogue: &'a Catalogue,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move {
            let c = check(new, catalogue)?;
            let now = crate::now_ms();
            let exp = Experiment {
                id: format!("exp_{}", hex(&rand::random::<[u8; 6]>())),
                agent: c.agent,
                env: c.env,
                state: State::Running,
                salt: Salt::new(rand::random()),
                unit: c.unit,
                guardrails: c.guardrails,
                max_sessions: c.max_sessions.and_then(|n| u64::try_from(n).ok()),
                max_days: c.max_days.and_then(|n| u32::try_from(n).ok()),
                auto_promote: c.auto_promote,
                auto_rollback: c.auto_rollback,
                description: c.description,
                winner: None,
                promoted: false,
                reason: "created".to_owned(),
                created_at_ms: now,
                updated_at_ms: now,
                arms: c
                    .arms
                    .into_iter()
                    .map(|a| ExperimentArm {
                        name: a.name,
                        provider: a.provider,
                        model: a.model,
                        weight: a.weight,
                        rolled_back: false,
                    })
                    .collect(),
            };
            let txn = self.store.begin_write().await?;
            self.claim(&txn, &exp.agent, exp.env, &exp.id).await?;
            experiment::ActiveModel {
                id: Set(exp.id.clone()),
                agent: Set(exp.agent.clone()),
                env: Set(exp.env.map(|e| e.as_str().to_owned())),
                state: Set(exp.state.as_str().to_owned()),
                salt: Set(exp.salt.to_string()),
                unit: Set(exp.unit.as_str().to_owned()),
                guardrails: Set(guardrails_text(&exp.guardrails)),
                max_sessions: Set(c.max_sessions),
                max_days: Set(c.max_days),
                auto_promote: Set(exp.auto_promote),
                auto_rollback: Set(exp.auto_rollback),
                description: Set(exp.description.clone()),
                winner: Set(None),
                promoted: Set(false),
                reason: Set(exp.reason.clone()),
                created_at_ms: Set(now),
                updated_at_ms: Set(now),
            }
            .insert(&txn)
            .await?;
            for (position, arm) in exp.arms.iter().enumerate() {
                experiment_arm::ActiveModel {
                    experiment_id: Set(exp.id.clone()),
                    position: Set(i32::try_from(position).unwrap_or(i32::MAX)),
                    name: Set(arm.name.clone()),
                    provider: Set(arm.provider.clone()),
                    model: Set(arm.model.clone()),
                    weight: Set(i64::from(arm.weight)),
                    rolled_back: Set(false),
                }
                .insert(&txn)
                .await?;
            }
            let detail = exp
                .arms
                .iter()
                .map(|a| format!("{}={}:{}:{}", a.name, a.provider, a.model, a.weight))
                .collect::<Vec<_>>()
                .join(" ");
            write_event(&txn, &exp.id, now, "created", None, actor, &detail).await?;
            let change = Change {
                actor,
                action: "experiment.create",
                target: &exp.id,
                before: None,
                after: Some(audit_json(&exp)),
            };
            audit::record(&txn, change, now).await?;
            txn.commit().await?;
            tracing::Span::current().record("experiment.id", exp.id.as_str());
            info!(
                experiment.id = %exp.id,
                nm.agent = %exp.agent,
                env = exp.env.map_or("every", Env::as_str),
                arms = exp.arms.len(),
                by = actor,
                "experiment created"
            );
            self.refreshed().await;
            Ok(exp)
        })
    }

    /// running -> paused.
    pub fn pause<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        reason: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move { self.apply(actor, id, Action::Pause, None, reason).await })
    }

    /// paused -> running.
    pub fn resume<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        reason: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move { self.apply(actor, id, Action::Resume, None, reason).await })
    }

    /// Any state but stopped -> stopped.
    pub fn stop<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        reason: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move { self.apply(actor, id, Action::Stop, None, reason).await })
    }

    /// Every session to `arm` (empty: the decided winner; none: `FailedPrecondition`).
    pub fn promote<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        arm: &'a str,
        reason: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move {
            let arm = Some(arm.trim()).filter(|a| !a.is_empty());
            self.apply(actor, id, Action::Promote, arm, reason).await
        })
    }

    /// Takes `arm` out (never the last active one).
    pub fn rollback<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
        arm: &'a str,
        reason: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move {
            self.apply(actor, id, Action::Rollback, Some(arm.trim()), reason)
                .await
        })
    }

    /// The evaluation chose `winner` (as `system`); `detail` is the evidence in words.
    pub fn decide<'a>(
        &'a self,
        id: &'a str,
        winner: &'a str,
        detail: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move {
            self.apply(SYSTEM_ACTOR, id, Action::Decide, Some(winner), detail)
                .await
        })
    }

    /// A guardrail found `arm` worse (as `system`); `detail` names the guardrail and evidence.
    pub fn harm<'a>(
        &'a self,
        id: &'a str,
        arm: &'a str,
        detail: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move {
            self.apply(SYSTEM_ACTOR, id, Action::Harm, Some(arm), detail)
                .await
        })
    }

    /// The limit came without a decision (as `system`); `detail` says what was ruled out.
    pub fn inconclusive<'a>(
        &'a self,
        id: &'a str,
        detail: &'a str,
    ) -> crate::BoxFuture<'a, Result<Experiment>> {
        Box::pin(async move {
            self.apply(SYSTEM_ACTOR, id, Action::Inconclusive, None, detail)
                .await
        })
    }

    /// One change: the row locked (PostgreSQL) and read in the write transaction, the rule
    /// applied, the row, the arms changed, the event and the audit row written, committed.
    async fn apply(
        &self,
        actor: &str,
        id: &str,
        action: Action,
        arm: Option<&str>,
        detail: &str,
    ) -> Result<Experiment> {
        let detail = detail.trim();
        rules::check_text("reason", detail, MAX_REASON_CHARS)?;
        let now = crate::now_ms();
        let txn = self.store.begin_write().await?;
        if txn.get_database_backend() == DatabaseBackend::Postgres {
            let mut lock = Sql::new(
                DatabaseBackend::Postgres,
                "SELECT id FROM experiments WHERE id = ",
            );
            lock.bind(id.to_owned()).push(" FOR UPDATE");
            txn.execute_raw(lock.build()).await?;
        }
        let before = read(&txn, id).await?;
        let mut after = before.clone();
        let event_arm = transition(&mut after, action, arm, detail)?;
        if after.holds_traffic() && !before.holds_traffic() {
            // A promotion from a finished state, a rollback from harm: it takes its agent back.
            self.claim(&txn, &after.agent, after.env, id).await?;
        }
        after.updated_at_ms = now;
        let row = experiment::ActiveModel {
            id: sea_orm::ActiveValue::Unchanged(after.id.clone()),
            state: Set(after.state.as_str().to_owned()),
            winner: Set(after.winner.clone()),
            promoted: Set(after.promoted),
            reason: Set(after.reason.clone()),
            updated_at_ms: Set(now),
            ..Default::default()
        };
        row.update(&txn).await?;
        for (old, new) in before.arms.iter().zip(&after.arms) {
            if old.rolled_back != new.rolled_back {
                let mut sql = Sql::new(
                    txn.get_database_backend(),
                    "UPDATE experiment_arms SET rolled_back = ",
                );
                sql.bind(new.rolled_back)
                    .push(" WHERE experiment_id = ")
                    .bind(id.to_owned())
                    .push(" AND name = ")
                    .bind(new.name.clone());
                txn.execute_raw(sql.build()).await?;
            }
        }
        write_event(
            &txn,
            id,
            now,
            action.event_kind(),
            event_arm.as_deref(),
            actor,
            &after.reason,
        )
        .await?;
        let change = Change {
            actor,
            action: action.audit_action(),
            target: id,
            before: Some(audit_json(&before)),
            after: Some(audit_json(&after)),
        };
        audit::record(&txn, change, now).await?;
        txn.commit().await?;
        info!(
            experiment.id = %id,
            nm.agent = %after.agent,
            from = %before.state,
            to = %after.state,
            promoted = after.promoted,
            arm = event_arm.as_deref().unwrap_or(""),
            by = actor,
            reason = %after.reason,
            "experiment {}",
            action.event_kind()
        );
        self.refreshed().await;
        Ok(after)
    }

    /// Refreshes the live set after a committed change; a failure is only logged (the change
    /// is stored, and the next periodic refresh picks it up).
    async fn refreshed(&self) {
        if let Err(e) = self.refresh().await {
            warn!(error = %e, "experiments refresh after a change failed; the next one retries");
        }
    }
}

/// Applies `action` to `e` by the rules; returns the arm its event concerns. `detail` (already
/// checked) becomes the reason when given.
pub(crate) fn transition(
    e: &mut Experiment,
    action: Action,
    arm: Option<&str>,
    detail: &str,
) -> Result<Option<String>> {
    allowed(action, e.state, e.promoted)?;
    let reason = |default: String| {
        if detail.is_empty() {
            default
        } else {
            detail.to_owned()
        }
    };
    let named = |what: &str| {
        arm.filter(|a| !a.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| Error::InvalidArgument(format!("arm: name the arm {what}")))
    };
    let event_arm = match action {
        Action::Pause => {
            e.state = State::Paused;
            e.reason = reason("paused".to_owned());
            None
        }
        Action::Resume => {
            e.state = State::Running;
            e.reason = reason("resumed".to_owned());
            None
        }
        Action::Stop => {
            e.state = State::Stopped;
            e.reason = reason("stopped".to_owned());
            None
        }
        Action::Promote => {
            let name = match arm.filter(|a| !a.is_empty()) {
                Some(a) => a.to_owned(),
                None => match (e.state, &e.winner) {
                    (State::Decided, Some(w)) => w.clone(),
                    _ => {
                        return Err(Error::FailedPrecondition(format!(
                            "the experiment has no decided winner to promote (it is {}): name \
                             the arm to promote",
                            e.state
                        )));
                    }
                },
            };
            e.active_arm(&name)?;
            e.state = State::Decided;
            e.winner = Some(name.clone());
            e.promoted = true;
            e.reason = reason(format!("arm {name} promoted: every session goes to it"));
            Some(name)
        }
        Action::Rollback => {
            let name = named("to roll back")?;
            e.active_arm(&name)?;
            if e.active_arms().count() <= 1 {
                return Err(Error::FailedPrecondition(format!(
                    "arm {name} is the experiment's last active arm; stop the experiment instead"
                )));
            }
            e.active_arm(&name)?.rolled_back = true;
            if e.state == State::Harm {
                e.state = State::Running;
            }
            e.reason = reason(format!(
                "arm {name} rolled back: its sessions go to the other arms"
            ));
            Some(name)
        }
        Action::Decide => {
            let name = named("the evidence chose")?;
            e.active_arm(&name)?;
            e.state = State::Decided;
            e.winner = Some(name.clone());
            e.promoted = false;
            e.reason = reason(format!("arm {name} won"));
            Some(name)
        }
        Action::Harm => {
            let name = named("a guardrail stopped")?;
            e.active_arm(&name)?;
            e.state = State::Harm;
            e.reason = reason(format!("arm {name} is worse on a guardrail"));
            Some(name)
        }
        Action::Inconclusive => {
            e.state = State::Inconclusive;
            e.reason = reason("its limit came without a decision".to_owned());
            None
        }
    };
    Ok(event_arm)
}

async fn read(db: &impl ConnectionTrait, id: &str) -> Result<Experiment> {
    let not_found = || Error::NotFound(format!("no experiment with id {id:?}"));
    if id.is_empty() || id.len() > nm_types::experiment::MAX_EXPERIMENT_ID_LEN {
        return Err(not_found());
    }
    let row = experiment::Entity::find_by_id(id.to_owned())
        .one(db)
        .await?
        .ok_or_else(not_found)?;
    let arms = experiment_arm::Entity::find()
        .filter(experiment_arm::Column::ExperimentId.eq(id))
        .order_by_asc(experiment_arm::Column::Position)
        .all(db)
        .await?;
    from_rows(row, arms)
}

async fn write_event(
    db: &impl ConnectionTrait,
    experiment_id: &str,
    at_ms: i64,
    kind: &str,
    arm: Option<&str>,
    actor: &str,
    detail: &str,
) -> Result<()> {
    experiment_event::ActiveModel {
        id: Set(format!("xev_{}", uuid::Uuid::now_v7().simple())),
        experiment_id: Set(experiment_id.to_owned()),
        at_ms: Set(at_ms),
        kind: Set(kind.to_owned()),
        arm: Set(arm.map(str::to_owned)),
        actor: Set(actor.to_owned()),
        detail: Set(detail.to_owned()),
    }
    .insert(db)
    .await?;
    Ok(())
}

/// A stored row that breaks a rule (written by a newer version, or by hand).
fn corrupt(id: &str, what: &str) -> Error {
    Error::Database(sea_orm::DbErr::Custom(format!(
        "stored experiment {id}: unreadable {what}"
    )))
}

fn from_rows(row: experiment::Model, arms: Vec<experiment_arm::Model>) -> Result<Experiment> {
    let id = row.id.clone();
    let env = row
        .env
        .as_deref()
        .map(|e| e.parse::<Env>().map_err(|_| corrupt(&id, "env")))
        .transpose()?;
    let state: State = row.state.parse().map_err(|_| corrupt(&id, "state"))?;
    let salt: Salt = row.salt.parse().map_err(|_| corrupt(&id, "salt"))?;
    let unit: Unit = row.unit.parse().map_err(|_| corrupt(&id, "unit"))?;
    let guardrails = row
        .guardrails
        .split(',')
        .filter(|g| !g.is_empty())
        .map(|g| {
            g.parse::<Guardrail>()
                .map_err(|_| corrupt(&id, "guardrails"))
        })
        .collect::<Result<Vec<_>>>()?;
    let arms = arms
        .into_iter()
        .map(|a| {
            Ok(ExperimentArm {
                weight: u32::try_from(a.weight).map_err(|_| corrupt(&id, "arm weight"))?,
                name: a.name,
                provider: a.provider,
                model: a.model,
                rolled_back: a.rolled_back,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Experiment {
        id: row.id,
        agent: row.agent,
        env,
        state,
        salt,
        unit,
        guardrails,
        max_sessions: row.max_sessions.and_then(|n| u64::try_from(n).ok()),
        max_days: row.max_days.and_then(|n| u32::try_from(n).ok()),
        auto_promote: row.auto_promote,
        auto_rollback: row.auto_rollback,
        description: row.description,
        winner: row.winner,
        promoted: row.promoted,
        reason: row.reason,
        created_at_ms: row.created_at_ms,
        updated_at_ms: row.updated_at_ms,
        arms,
    })
}

fn guardrails_text(g: &[Guardrail]) -> String {
    g.iter().map(|g| g.as_str()).collect::<Vec<_>>().join(",")
}

/// An experiment as the audit trail shows it: everything but its salt.
pub fn audit_json(e: &Experiment) -> serde_json::Value {
    json!({
        "id": e.id,
        "agent": e.agent,
        "env": e.env.map(Env::as_str),
        "state": e.state.as_str(),
        "unit": e.unit.as_str(),
        "guardrails": e.guardrails.iter().map(|g| g.as_str()).collect::<Vec<_>>(),
        "max_sessions": e.max_sessions,
        "max_days": e.max_days,
        "auto_promote": e.auto_promote,
        "auto_rollback": e.auto_rollback,
        "description": e.description,
        "winner": e.winner,
        "promoted": e.promoted,
        "reason": e.reason,
        "arms": e.arms.iter().map(|a| json!({
            "name": a.name,
            "provider": a.provider,
            "model": a.model,
            "weight": a.weight,
            "rolled_back": a.rolled_back,
        })).collect::<Vec<_>>(),
    })
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
