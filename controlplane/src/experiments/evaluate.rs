//! The evaluation loop: every analytics interval, each running experiment is counted from its
//! records and signals (`analytics::experiment_query`), judged (`analytics::experiment`: the
//! decision with its guarantee) and acted on: `decide`, `harm` or `inconclusive` as `system`,
//! then, where the experiment allows it, the winner promoted or the harmful arm rolled back.
//! Each change is announced to the webhooks (`experiment` alerts, once per change).
//!
//! The guardrails' thresholds are fixed once per experiment and kept in its row
//! (`latency_threshold_ms`, `cost_threshold_micros`): from the agent's week before the
//! experiment, or, without that history, from the experiment's own first units, pooled.

use std::time::Duration;

use sea_orm::ConnectionTrait;
use serde_json::json;
use tokio::sync::watch;
use tracing::{Instrument, debug, info, warn};

use super::{Experiment, Experiments, ListFilter, State};
use crate::alerts::{self, Alerts};
use crate::analytics::evidence;
use crate::analytics::experiment::{ArmCounts, Evaluation, Guardrail, Plan, Verdict, evaluate};
use crate::analytics::experiment_query::{
    Thresholds, arm_counts, history_thresholds, pooled_thresholds,
};
use crate::error::Result;
use crate::sql::Sql;
use crate::{audit::SYSTEM_ACTOR, now_ms};

/// One experiment's evidence now: every arm's counts (rolled-back arms included, in the
/// experiment's order) and the evaluation of its active arms.
#[derive(Debug, Clone)]
pub struct Evidence {
    pub counts: Vec<ArmCounts>,
    pub evaluation: Evaluation,
    /// The position in `counts` of each evaluated (active) arm, in `evaluation.arms` order.
    pub active: Vec<usize>,
}

impl Evidence {
    /// The evaluation of the arm at `counts[i]`, when it is active.
    pub fn arm(&self, i: usize) -> Option<&crate::analytics::experiment::ArmEvaluation> {
        let k = self.active.iter().position(|&a| a == i)?;
        self.evaluation.arms.get(k)
    }
}

impl Experiments {
    /// Counts and evaluates `e` at `now_ms` (nothing stored, nothing acted on).
    pub fn evidence<'a>(
        &'a self,
        e: &'a Experiment,
        now_ms: i64,
    ) -> crate::BoxFuture<'a, Result<Evidence>> {
        Box::pin(async move {
            let setting = evidence::load(self.store.conn(), &e.agent).await?;
            let thresholds = self.thresholds(e).await?;
            let names: Vec<String> = e.arms.iter().map(|a| a.name.clone()).collect();
            let counts = arm_counts(
                &self.store,
                &e.id,
                &names,
                e.unit,
                setting.evidence,
                thresholds,
            )
            .await?;
            let active: Vec<usize> = (0..e.arms.len())
                .filter(|&i| !e.arms[i].rolled_back)
                .collect();
            let judged: Vec<ArmCounts> = active.iter().map(|&i| counts[i].clone()).collect();
            let plan = Plan {
                unit: e.unit,
                guardrails: e.guardrails.clone(),
                max_sessions: e.max_sessions.unwrap_or(0),
                max_days: e.max_days.unwrap_or(0),
                started_at_ms: e.created_at_ms,
            };
            Ok(Evidence {
                evaluation: evaluate(&plan, &judged, now_ms),
                counts,
                active,
            })
        })
    }

    /// Evaluates every running experiment at `now_ms` and acts on what the evidence says;
    /// returns how many changed state. One experiment's failure is logged and the others go on.
    pub fn evaluate_all<'a>(
        &'a self,
        alerts: Option<&'a Alerts>,
        now_ms: i64,
    ) -> crate::BoxFuture<'a, Result<usize>> {
        Box::pin(async move {
            let running = self
                .list(&ListFilter {
                    state: State::Running.as_str().to_owned(),
                    ..ListFilter::default()
                })
                .await?;
            let mut changed = 0;
            for e in running {
                match self.evaluate_one(&e, alerts, now_ms).await {
                    Ok(true) => changed += 1,
                    Ok(false) => {}
                    Err(err) => warn!(experiment = %e.id, error = %err, "experiment not evaluated"),
                }
            }
            Ok(changed)
        })
    }

    async fn evaluate_one(
        &self,
        e: &Experiment,
        alerts: Option<&Alerts>,
        now: i64,
    ) -> Result<bool> {
        let ev = self.evidence(e, now).await?;
        let summary = &ev.evaluation.summary;
        let name = |k: usize| e.arms[ev.active[k]].name.clone();
        let (after, arm) = match ev.evaluation.verdict {
            Verdict::Running => return Ok(false),
            Verdict::Decided { winner } => {
                let arm = name(winner);
                let mut after = self.decide(&e.id, &arm, summary).await?;
                if e.auto_promote {
                    after = self
                        .promote(
                            SYSTEM_ACTOR,
                            &e.id,
                            &arm,
                            "auto-promote: the evidence chose it",
                        )
                        .await?;
                }
                (after, Some(arm))
            }
            Verdict::Harm { arm, .. } => {
                let arm = name(arm);
                let mut after = self.harm(&e.id, &arm, summary).await?;
                if e.auto_rollback {
                    after = self
                        .rollback(
                            SYSTEM_ACTOR,
                            &e.id,
                            &arm,
                            "auto-rollback: a guardrail stopped it",
                        )
                        .await?;
                }
                (after, Some(arm))
            }
            Verdict::Inconclusive { .. } => (self.inconclusive(&e.id, summary).await?, None),
        };
        info!(
            experiment = %e.id,
            state = after.state.as_str(),
            arm = arm.as_deref().unwrap_or(""),
            "experiment evaluated: {summary}"
        );
        if let Some(alerts) = alerts {
            let kind = match ev.evaluation.verdict {
                Verdict::Decided { .. } => "decided",
                Verdict::Harm { .. } => "harm",
                _ => "inconclusive",
            };
            let data = json!({
                "experiment_id": e.id,
                "agent": e.agent,
                "state": kind,
                "arm": arm,
                "promoted": after.promoted,
                "state_now": after.state.as_str(),
                "message": format!("experiment {} of {}: {summary}", e.id, e.agent),
            });
            let dedupe = format!(
                "experiment:{}:{kind}:{}:{}",
                e.id,
                arm.as_deref().unwrap_or(""),
                e.updated_at_ms
            );
            if let Err(err) = alerts.emit(alerts::Kind::Experiment, &dedupe, data).await {
                warn!(experiment = %e.id, error = %err, "experiment alert not stored");
            }
        }
        Ok(true)
    }

    /// The guardrails' thresholds of `e`: stored once found (see the module doc).
    async fn thresholds(&self, e: &Experiment) -> Result<Thresholds> {
        let needs_latency = e.guardrails.contains(&Guardrail::P95Latency);
        let needs_cost = e.guardrails.contains(&Guardrail::CostPerSession);
        if !needs_latency && !needs_cost {
            return Ok(Thresholds::default());
        }
        let db = self.store.conn();
        let mut sql = Sql::new(
            self.store.backend(),
            "SELECT latency_threshold_ms, cost_threshold_micros FROM experiments WHERE id = ",
        );
        sql.bind(e.id.as_str());
        let stored = match db.query_one_raw(sql.build()).await? {
            Some(row) => Thresholds {
                latency_ms: row
                    .try_get::<Option<i64>>("", "latency_threshold_ms")?
                    .and_then(|v| u64::try_from(v).ok()),
                cost_micros: row
                    .try_get::<Option<i64>>("", "cost_threshold_micros")?
                    .and_then(|v| u64::try_from(v).ok()),
            },
            None => Thresholds::default(),
        };
        let missing = (needs_latency && stored.latency_ms.is_none())
            || (needs_cost && stored.cost_micros.is_none());
        if !missing {
            return Ok(stored);
        }
        let env = e.env.map(|v| v.as_str());
        let history = history_thresholds(&self.store, &e.agent, env, e.created_at_ms).await?;
        let pooled = if (needs_latency && history.latency_ms.is_none())
            || (needs_cost && history.cost_micros.is_none())
        {
            pooled_thresholds(&self.store, &e.id).await?
        } else {
            Thresholds::default()
        };
        let found = Thresholds {
            latency_ms: stored
                .latency_ms
                .or(history.latency_ms)
                .or(pooled.latency_ms),
            cost_micros: stored
                .cost_micros
                .or(history.cost_micros)
                .or(pooled.cost_micros),
        };
        if found != stored {
            let to_i64 = |v: Option<u64>| v.and_then(|v| i64::try_from(v).ok());
            let mut sql = Sql::new(
                self.store.backend(),
                "UPDATE experiments SET latency_threshold_ms = ",
            );
            sql.bind(to_i64(found.latency_ms))
                .push(", cost_threshold_micros = ")
                .bind(to_i64(found.cost_micros))
                .push(" WHERE id = ")
                .bind(e.id.as_str());
            let txn = self.store.begin_write().await?;
            txn.execute_raw(sql.build()).await?;
            txn.commit().await?;
            debug!(experiment = %e.id, ?found, "guardrail thresholds fixed");
        }
        Ok(found)
    }

    /// Evaluates every running experiment now and then every `interval`, until `shutdown`.
    pub fn spawn_evaluator(
        &self,
        interval: Duration,
        alerts: Option<Alerts>,
        mut shutdown: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(
            async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = shutdown.wait_for(|stop| *stop) => break,
                    }
                    match this.evaluate_all(alerts.as_ref(), now_ms()).await {
                        Ok(n) => debug!(changed = n, "experiments evaluated"),
                        Err(e) => warn!(error = %e, "experiment evaluation failed"),
                    }
                }
            }
            .instrument(tracing::info_span!("experiment_evaluator")),
        )
    }
}

#[cfg(test)]
#[path = "evaluate_tests.rs"]
mod tests;
