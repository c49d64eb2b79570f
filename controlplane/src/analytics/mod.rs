//! Agent analytics: recommendations from signals joined with their sessions' usage.
//!
//! - [`outcome`] maps the eight signal actions to outcomes and folds a session's signals;
//! - [`stats`] holds the statistics that decide whether the evidence supports a recommendation
//!   (anytime-valid: confidence sequences, so recomputing as often as one likes keeps the
//!   false-claim rate);
//! - [`query`] computes the per-session outcomes and their groups in the database (one SQL
//!   statement per question, on SQLite and PostgreSQL);
//! - [`recommend`] turns the groups into recommendations;
//! - [`report`] is the answer, stored per agent in `analytics_results`;
//! - [`synthetic`] generates seeded traffic with known ground truth (demo, tests, benchmark);
//! - [`simulate`] runs the rules on simulated counts, look after look: the false-claim rate at
//!   any look and the power (the tests and `nm-analytics-bench --power`).
//!
//! Imports go one way: `rollup` (the `session_rollups` table, kept by the ingest) builds on
//! `outcome` (also the outcome model in SQL) and holds the TTFB bands it stores; `query` reads
//! the rollup; `recommend` reads `query`'s groups. None of them imports back up this chain.
//!
//! [`Analytics`] ties them together. Below [`RECOMMENDATION_THRESHOLD`] signals an agent is
//! *collecting*: the answer gives the count, the recent daily rate and the estimated date of
//! the first recommendations. At or past it, the recommendations are computed over the last
//! [`WINDOW_DAYS`] days and stored. [`Analytics::spawn_scheduler`] recomputes every agent on an
//! interval; [`Analytics::recompute`] does it on demand; [`Analytics::get`] reads the stored
//! answer (a primary-key lookup), computing it first when there is none, or when the stored one
//! is still collecting (cheap: two indexed counts), so progress is always current.
//!
//! An agent's life is cut into stretches in which the data only grows (see [`periods_at`]):
//! for the window's comparisons, its first 60 days, then each further 30 days (the window then
//! starts 30 days before the stretch, so it holds 30 to 60 days); for the trend, each calendar
//! week. A stored answer keeps, per comparison, the running intersection of its confidence
//! sequence in the current stretch ([`stats::Intersections`]), so a claim does not come and go
//! with each batch, and the agent's origin (its first signal), from which the stretches are
//! counted. Stretch `k` spends `6/(π² k²)` of the 5% ([`stats::stretch_share`]): the shares
//! sum to 1, so over the whole life of an agent, whatever the schedule of recomputes, the chance
//! of ever showing a false claim is at most 5% per rule. A new stretch starts its
//! intersections afresh (intersecting across different samples would freeze old evidence in
//! place, when the window is there to follow change).

pub mod evidence;
pub mod experiment;
pub mod experiment_query;
#[cfg(any(test, feature = "test-support"))]
pub mod experiment_simulate;
pub mod outcome;
pub mod query;
pub mod recommend;
pub mod report;
pub(crate) mod rollup;
#[cfg(any(test, feature = "test-support"))]
pub mod simulate;
pub mod stats;
pub mod synthetic;

use std::collections::BTreeMap;
use std::time::Duration;

use sea_orm::sea_query::OnConflict;
use sea_orm::{ConnectionTrait, EntityTrait, Set};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{Instrument, debug, info, warn};

pub use evidence::Evidence;
pub use query::Dimension;
pub use report::{AgentAnalytics, Kind, OutcomeRow, Progress, Recommendation, Status, Window};
use stats::{Intersections, Interval};

use crate::error::{Error, Result};
use crate::signals::RECOMMENDATION_THRESHOLD;
use crate::sql::Sql;
use crate::store::Store;
use crate::store::entity::analytics_result;

pub const DAY_MS: i64 = 86_400_000;
/// Length of a stretch of an agent's life: the recommendations rest on the sessions of the
/// current stretch and the one before (see [`periods_at`]), so on 30 to 60 days of data
/// (the first 60 days of the agent's life, all of it). Also the default range of outcome
/// queries.
pub const WINDOW_DAYS: i64 = 30;
/// Length of each of the two trend periods: this calendar week so far (UTC, from Monday)
/// against the last.
pub const TREND_DAYS: i64 = 7;
/// The recent daily signal rate is measured over this many days (or since the agent's first
/// signal, when that is more recent, but at least one day).
pub const RATE_WINDOW_DAYS: i64 = 7;
/// Default interval of the scheduled recomputation.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(600);

/// What `analytics_results.report` holds: the answer, and what the rules keep from look to
/// look, which stays in the controlplane (the gRPC answer has no place for it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stored {
    #[serde(flatten)]
    report: AgentAnalytics,
    /// The running intersection of each comparison's confidence sequence at this look, by key
    /// (see [`recommend::window_keys`]); absent from answers stored before there were any.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    sequences: BTreeMap<String, Interval>,
    /// The start of the agent's life: its first signal when it was first stored. The stretches
    /// (and so the share of the level each may spend) count from it, and it never moves, so
    /// no stretch's share is spent twice. Absent from answers stored before it was kept: the
    /// first signal then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    origin_ms: Option<i64>,
    /// The intervals of the other evidence settings the agent had ([`Evidence::key`]), kept
    /// as they were when the setting changed: a setting that comes back resumes its own
    /// sequences, so each setting is one family over the agent's life, whatever the switches.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    parked: BTreeMap<String, BTreeMap<String, Interval>>,
}

/// What a look carries from the stored answer: the intervals kept and the agent's origin.
#[derive(Debug, Clone, Default, PartialEq)]
struct Earlier {
    sequences: BTreeMap<String, Interval>,
    origin_ms: Option<i64>,
    /// The evidence those intervals counted: intervals are carried only to a look that counts
    /// the same signals (a confidence sequence follows one stream of data).
    evidence: Evidence,
    /// The intervals of the other settings ([`Stored::parked`]).
    parked: BTreeMap<String, BTreeMap<String, Interval>>,
}

/// The start (Monday 00:00 UTC) of the calendar week holding `ms`.
pub fn week_start_ms(ms: i64) -> i64 {
    let day = ms.div_euclid(DAY_MS);
    // 1970-01-01 was a Thursday: day 0 is 3 days after a Monday.
    (day - (day + 3).rem_euclid(7)) * DAY_MS
}

/// Which stretch of its life an agent born at `origin_ms` is in at `now_ms`, for the window's
/// comparisons: 1 in its first 60 days, then `k` from `k` × 30 days of age to `k + 1` × 30 days.
pub fn window_stretch(now_ms: i64, origin_ms: i64) -> u64 {
    let age = now_ms.saturating_sub(origin_ms).max(0);
    u64::try_from(age / (WINDOW_DAYS * DAY_MS))
        .unwrap_or(0)
        .max(1)
}

/// Which stretch of its life an agent born at `origin_ms` is in at `now_ms`, for the trend:
/// the calendar weeks since the one holding the origin (0 in that week, when there is no
/// earlier week to compare with).
pub fn week_stretch(now_ms: i64, origin_ms: i64) -> u64 {
    let weeks = (week_start_ms(now_ms) - week_start_ms(origin_ms)) / (TREND_DAYS * DAY_MS);
    u64::try_from(weeks).unwrap_or(0)
}

/// The window and trend periods of a computation at `now_ms` for an agent born at `origin_ms`.
///
/// The window only grows within a stretch, so each stretch's confidence sequences stay valid
/// at every look in it: in stretch 1 (the first 60 days) it starts at the origin; in stretch
/// `k ≥ 2` (from `k` × 30 days of age) it starts at the beginning of stretch `k − 1`, so it
/// holds 30 to 60 days. The trend compares this calendar week (UTC, from Monday), which only
/// grows, with the last.
pub fn periods_at(now_ms: i64, origin_ms: i64) -> query::Periods {
    let recent_since = week_start_ms(now_ms);
    let k = i64::try_from(window_stretch(now_ms, origin_ms)).unwrap_or(i64::MAX);
    let since_ms = origin_ms.saturating_add((k - 1).saturating_mul(WINDOW_DAYS * DAY_MS));
    query::Periods {
        window: Window {
            since_ms: since_ms.min(now_ms),
            until_ms: now_ms,
        },
        recent_since,
        previous_since: recent_since - TREND_DAYS * DAY_MS,
    }
}

/// The intervals of an earlier look that still apply at this one (the window's, in the same
/// stretch; this week's trend), and each stretch's share of the family level
/// ([`stats::stretch_share`]): over the agent's whole life the shares sum to at most 1, so the
/// chance of a false claim at any look in any stretch is at most [`stats::FAMILY_ALPHA`] per
/// rule.
fn carried(
    mut earlier: BTreeMap<String, Interval>,
    periods: &query::Periods,
    origin_ms: i64,
) -> Intersections {
    let window = recommend::window_keys(periods.window.since_ms);
    let week = recommend::week_keys(periods.recent_since);
    earlier.retain(|key, _| key.starts_with(&week) || key.starts_with(&window));
    let now_ms = periods.window.until_ms;
    Intersections::carried(earlier)
        .spending(
            &window,
            stats::stretch_share(window_stretch(now_ms, origin_ms)),
        )
        .spending(&week, stats::stretch_share(week_stretch(now_ms, origin_ms)))
}

/// A stored look as [`Analytics::announce`] compares it: its time and its recommendations'
/// kinds and subjects.
type Look = (i64, Vec<(Kind, Option<String>)>);

/// Analytics over the controlplane's database. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Analytics {
    store: Store,
    /// Where a new recommendation is announced (none: not announced).
    alerts: Option<crate::Alerts>,
}

impl Analytics {
    pub fn new(store: Store) -> Self {
        Self {
            store,
            alerts: None,
        }
    }

    /// Announces each recommendation an agent's look makes that its previous look did not.
    pub fn with_alerts(mut self, alerts: crate::Alerts) -> Self {
        self.alerts = Some(alerts);
        self
    }

    /// An agent's progress toward the threshold at `now_ms`: two indexed counts of the signals
    /// stored, plus those retention deleted (`signal_rollups`, per UTC day).
    #[tracing::instrument(skip_all, fields(nm.agent = %agent))]
    pub fn progress<'a>(
        &'a self,
        agent: &'a str,
        now_ms: i64,
    ) -> crate::BoxFuture<'a, Result<Progress>> {
        Box::pin(async move {
            let evidence = evidence::load(self.store.conn(), agent).await?.evidence;
            self.progress_of(agent, now_ms, evidence).await
        })
    }

    /// [`Analytics::progress`], counting the signals of `evidence`. The signals retention
    /// deleted count from their rollup, which retention writes in the transaction that deletes
    /// them, so each signal counts once: stored or rolled up. Their first and last times are
    /// exact; among the last [`RATE_WINDOW_DAYS`] days, a deleted day counts whole when the
    /// window touches it (its day is on or after the window's start's UTC day), which only
    /// matters with signals kept less than `RATE_WINDOW_DAYS + 1` days.
    async fn progress_of(&self, agent: &str, now_ms: i64, evidence: Evidence) -> Result<Progress> {
        let db = self.store.conn();
        let backend = db.get_database_backend();
        let filter = format!(" AND {}", evidence.signal_filter());
        let since_ms = now_ms - RATE_WINDOW_DAYS * DAY_MS;
        // Four subqueries on the index `signals(agent, received_at_ms)`: the first and the last
        // are one seek each, the counts step through the index without evaluating anything per
        // entry (half the time of one pass computing all four).
        let mut sql = Sql::new(
            backend,
            "SELECT (SELECT COUNT(*) FROM signals WHERE agent = ",
        );
        sql.bind(agent.to_owned())
            .push(&filter)
            .push(") AS total, (SELECT MIN(received_at_ms) FROM signals WHERE agent = ")
            .bind(agent.to_owned())
            .push(&filter)
            .push(") AS first, (SELECT MAX(received_at_ms) FROM signals WHERE agent = ")
            .bind(agent.to_owned())
            .push(&filter)
            .push(") AS last, (SELECT COUNT(*) FROM signals WHERE agent = ")
            .bind(agent.to_owned())
            .push(&filter)
            .push(" AND received_at_ms >= ")
            .bind(since_ms)
            .push(") AS recent");
        // The deleted ones: one range of the rollup's primary key (agent, day).
        let c = evidence::signal_rollup_prefix(evidence);
        let sum = |e: &str| match backend {
            sea_orm::DatabaseBackend::Postgres => format!("CAST(COALESCE(SUM({e}), 0) AS BIGINT)"),
            _ => format!("COALESCE(SUM({e}), 0)"),
        };
        sql.push(&format!(
            ", {} AS rolled_total, {} AS rolled_recent, MIN({c}_first_ms) AS rolled_first, \
             MAX({c}_last_ms) AS rolled_last FROM signal_rollups WHERE agent = ",
            sum(&format!("{c}_signals")),
            sum(&format!(
                "CASE WHEN day >= {} THEN {c}_signals ELSE 0 END",
                since_ms.div_euclid(DAY_MS)
            )),
        ))
        .bind(agent.to_owned());
        let row = db
            .query_one_raw(sql.build())
            .await?
            .ok_or_else(|| Error::Unavailable("count query returned no row".to_owned()))?;
        let count = |name: &str| -> Result<u64> {
            Ok(u64::try_from(row.try_get::<i64>("", name)?).unwrap_or(0))
        };
        let total = count("total")? + count("rolled_total")?;
        let recent = count("recent")? + count("rolled_recent")?;
        let time = |name: &str| -> Result<Option<i64>> { Ok(row.try_get("", name)?) };
        let first = [time("first")?, time("rolled_first")?]
            .into_iter()
            .flatten()
            .min();
        let last = [time("last")?, time("rolled_last")?]
            .into_iter()
            .flatten()
            .max();
        Ok(progress(total, recent, first, last, now_ms))
    }

    /// Computes an agent's analytics at `now_ms` as a first look would (no interval carried
    /// from an earlier look; not stored).
    pub fn compute<'a>(
        &'a self,
        agent: &'a str,
        now_ms: i64,
    ) -> crate::BoxFuture<'a, Result<AgentAnalytics>> {
        Box::pin(async move {
            Ok(self
                .compute_from(agent, now_ms, Earlier::default())
                .await?
                .report)
        })
    }

    /// Computes an agent's analytics at `now_ms`, meeting each comparison's interval with
    /// those of `earlier` that still apply, in the stretch of the agent's life that `now_ms` is
    /// in (see [`carried`]).
    #[tracing::instrument(skip_all, fields(nm.agent = %agent, status = tracing::field::Empty, recommendations = tracing::field::Empty))]
    async fn compute_from(&self, agent: &str, now_ms: i64, earlier: Earlier) -> Result<Stored> {
        let agent = nm_types::parse_agent(agent)
            .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
        let evidence = evidence::load(self.store.conn(), &agent).await?.evidence;
        let progress = self.progress_of(&agent, now_ms, evidence).await?;
        let origin_ms = earlier.origin_ms.or(progress.first_signal_ms);
        let mut parked = earlier.parked;
        let sequences = if earlier.evidence == evidence {
            earlier.sequences
        } else {
            if !earlier.sequences.is_empty() {
                parked.insert(earlier.evidence.key().to_owned(), earlier.sequences);
            }
            parked.remove(evidence.key()).unwrap_or_default()
        };
        let periods = periods_at(now_ms, origin_ms.unwrap_or(now_ms));
        let window = periods.window;
        let span = tracing::Span::current();
        if progress.signals < RECOMMENDATION_THRESHOLD {
            span.record("status", "collecting");
            return Ok(Stored {
                report: AgentAnalytics {
                    agent,
                    status: Status::Collecting,
                    computed_at_ms: now_ms,
                    progress,
                    window,
                    summary: None,
                    costs: Vec::new(),
                    recommendations: Vec::new(),
                    evidence,
                    implicit_summary: None,
                },
                sequences,
                origin_ms,
                parked,
            });
        }
        let aggregates = query::aggregates(&self.store, &agent, periods, evidence).await?;
        // Implicit signals shown beside explicit ones: the same window counted with them (one
        // total row; the rules never read it), from the explicit total.
        let implicit_summary = if evidence.implicit {
            None
        } else {
            Some(query::implicit_beside(&self.store, &agent, window, &aggregates.total).await?)
        };
        let mut run = carried(sequences, &periods, origin_ms.unwrap_or(now_ms));
        let mut recommendations = recommend::recommend(&aggregates, &periods, &mut run);
        example_traces(&self.store, &agent, window.since_ms, &mut recommendations).await?;
        span.record("status", "ready");
        span.record("recommendations", recommendations.len());
        Ok(Stored {
            report: AgentAnalytics {
                costs: recommend::costs(&agent, &aggregates),
                agent,
                status: Status::Ready,
                computed_at_ms: now_ms,
                progress,
                window,
                summary: Some(aggregates.total),
                recommendations,
                evidence,
                implicit_summary,
            },
            sequences: run.into_met(),
            origin_ms,
            parked,
        })
    }

    /// Computes an agent's analytics now and stores them (an agent without any signal, say a
    /// mistyped name, is answered but not stored).
    pub fn recompute<'a>(&'a self, agent: &'a str) -> crate::BoxFuture<'a, Result<AgentAnalytics>> {
        Box::pin(async move { self.recompute_at(agent, crate::now_ms()).await })
    }

    /// [`Analytics::recompute`] at `now_ms`: the stored answer's intervals that still apply
    /// are met with this look's, and the new ones stored with the answer.
    pub fn recompute_at<'a>(
        &'a self,
        agent: &'a str,
        now_ms: i64,
    ) -> crate::BoxFuture<'a, Result<AgentAnalytics>> {
        Box::pin(async move {
            let agent = nm_types::parse_agent(agent)
                .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
            let stored_before = self.stored_with_sequences(&agent).await?;
            let before: Option<Look> = stored_before.as_ref().map(|s| {
                let r = &s.report;
                let recs = r
                    .recommendations
                    .iter()
                    .map(|x| (x.kind, x.subject.clone()))
                    .collect();
                (r.computed_at_ms, recs)
            });
            let earlier = stored_before
                .map(|s| Earlier {
                    sequences: s.sequences,
                    origin_ms: s.origin_ms,
                    evidence: s.report.evidence,
                    parked: s.parked,
                })
                .unwrap_or_default();
            let stored = self.compute_from(&agent, now_ms, earlier).await?;
            if stored.report.progress.signals > 0 {
                self.save_stored(&stored).await?;
                self.announce(&agent, before, &stored.report).await;
            }
            Ok(stored.report)
        })
    }

    /// Sends an alert for each recommendation of `now` the look before (`before`: its time and
    /// recommendations) did not make. The previous look's time is in the dedupe key, so two
    /// replicas computing the same look send it once; a recommendation that goes and comes
    /// back is new again. A failure is logged: alerts never fail a look.
    async fn announce(&self, agent: &str, before: Option<Look>, now: &AgentAnalytics) {
        let Some(alerts) = &self.alerts else {
            return;
        };
        let (look, known) = before.unwrap_or_default();
        for r in &now.recommendations {
            if known.iter().any(|(k, s)| *k == r.kind && *s == r.subject) {
                continue;
            }
            let kind = serde_json::to_value(r.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let subject = r.subject.as_deref().unwrap_or("");
            let dedupe = format!("recommendation:{agent}:{kind}:{subject}:{look}");
            let data = serde_json::json!({
                "agent": agent,
                "recommendation": kind,
                "subject": r.subject,
                "message": format!("{agent}: {}", r.message),
            });
            if let Err(e) = alerts
                .emit(crate::alerts::Kind::Recommendation, &dedupe, data)
                .await
            {
                warn!(nm.agent = %agent, error = %e, "recommendation alert not stored");
            }
        }
    }

    /// Recomputes and stores every agent that has signals; returns how many.
    #[tracing::instrument(skip_all, fields(agents = tracing::field::Empty))]
    pub fn recompute_all(&self) -> crate::BoxFuture<'_, Result<Vec<AgentAnalytics>>> {
        Box::pin(async move {
            let agents = self.agents().await?;
            tracing::Span::current().record("agents", agents.len());
            let mut out = Vec::with_capacity(agents.len());
            for agent in agents {
                match self.recompute(&agent).await {
                    Ok(r) => out.push(r),
                    // An agent name that no longer parses (stored before a rule change) is skipped.
                    Err(Error::InvalidArgument(e)) => {
                        warn!(nm.agent = %agent, error = %e, "agent skipped")
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(out)
        })
    }

    /// Agents with at least one signal.
    pub fn agents(&self) -> crate::BoxFuture<'_, Result<Vec<String>>> {
        Box::pin(async move {
            let db = self.store.conn();
            let sql = Sql::new(
                db.get_database_backend(),
                "SELECT DISTINCT agent FROM signals WHERE agent IS NOT NULL ORDER BY agent",
            );
            db.query_all_raw(sql.build())
                .await?
                .iter()
                .map(|row| Ok(row.try_get::<String>("", "agent")?))
                .collect()
        })
    }

    /// The stored analytics of an agent, if any.
    pub fn stored<'a>(
        &'a self,
        agent: &'a str,
    ) -> crate::BoxFuture<'a, Result<Option<AgentAnalytics>>> {
        Box::pin(async move { Ok(self.stored_with_sequences(agent).await?.map(|s| s.report)) })
    }

    /// The stored answer with the intervals kept for the next look.
    async fn stored_with_sequences(&self, agent: &str) -> Result<Option<Stored>> {
        let Some(row) = analytics_result::Entity::find_by_id(agent.to_owned())
            .one(self.store.conn())
            .await?
        else {
            return Ok(None);
        };
        match serde_json::from_str::<Stored>(&row.report) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                // Written by another version: recompute rather than fail.
                warn!(nm.agent = %agent, error = %e, "stored analytics unreadable; recomputing");
                Ok(None)
            }
        }
    }

    /// The agent's analytics: the stored answer when it is ready; otherwise computed now (and
    /// stored).
    pub fn get<'a>(&'a self, agent: &'a str) -> crate::BoxFuture<'a, Result<AgentAnalytics>> {
        Box::pin(async move {
            let agent = nm_types::parse_agent(agent)
                .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
            match self.stored(&agent).await? {
                Some(r) if r.status == Status::Ready => Ok(r),
                _ => self.recompute(&agent).await,
            }
        })
    }

    /// Stores a computed answer, replacing the previous one (and the intervals it kept: the
    /// next look starts its intersections afresh).
    pub fn save<'a>(&'a self, r: &'a AgentAnalytics) -> crate::BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.save_stored(&Stored {
                report: r.clone(),
                sequences: BTreeMap::new(),
                origin_ms: r.progress.first_signal_ms,
                parked: BTreeMap::new(),
            })
            .await
        })
    }

    /// Stores a computed answer with its intervals, replacing the previous one.
    async fn save_stored(&self, stored: &Stored) -> Result<()> {
        let r = &stored.report;
        let report = serde_json::to_string(stored)
            .map_err(|e| Error::Unavailable(format!("cannot encode analytics: {e}")))?;
        let model = analytics_result::ActiveModel {
            agent: Set(r.agent.clone()),
            computed_at_ms: Set(r.computed_at_ms),
            status: Set(r.status.as_str().to_owned()),
            report: Set(report),
        };
        analytics_result::Entity::insert(model)
            .on_conflict(
                OnConflict::column(analytics_result::Column::Agent)
                    .update_columns([
                        analytics_result::Column::ComputedAtMs,
                        analytics_result::Column::Status,
                        analytics_result::Column::Report,
                    ])
                    .to_owned(),
            )
            .exec(self.store.conn())
            .await?;
        Ok(())
    }

    /// Session outcomes of `agent` over `[since_ms, until_ms)` (default: the analytics window
    /// ending now), grouped by `dims`.
    pub fn outcome_rates<'a>(
        &'a self,
        agent: &'a str,
        dims: &'a [Dimension],
        since_ms: Option<i64>,
        until_ms: Option<i64>,
        limit: u32,
    ) -> crate::BoxFuture<'a, Result<(Window, Vec<OutcomeRow>)>> {
        Box::pin(async move {
            let agent = nm_types::parse_agent(agent)
                .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
            if dims.len() > 5 {
                return Err(Error::InvalidArgument(
                    "at most 5 group-by dimensions".to_owned(),
                ));
            }
            let until = until_ms.unwrap_or_else(crate::now_ms);
            let since = since_ms.unwrap_or(until - WINDOW_DAYS * DAY_MS);
            if since >= until {
                return Err(Error::InvalidArgument(
                    "range: since must be before until".to_owned(),
                ));
            }
            let evidence = evidence::load(self.store.conn(), &agent).await?.evidence;
            let rows =
                query::outcome_rates(&self.store, &agent, dims, since, until, limit, evidence)
                    .await?;
            Ok((
                Window {
                    since_ms: since,
                    until_ms: until,
                },
                rows,
            ))
        })
    }

    /// Recomputes every agent now and then every `interval`, until `shutdown` turns true.
    /// Failures are logged and retried at the next tick.
    pub fn spawn_scheduler(
        &self,
        interval: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(
            async move {
                info!(
                    interval_secs = interval.as_secs(),
                    "analytics scheduler started"
                );
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = shutdown.wait_for(|stop| *stop) => break,
                    }
                    let started = std::time::Instant::now();
                    match this.recompute_all().await {
                        Ok(done) => debug!(
                            agents = done.len(),
                            elapsed_ms = started.elapsed().as_millis() as u64,
                            "analytics recomputed"
                        ),
                        Err(e) => warn!(error = %e, "scheduled analytics recomputation failed"),
                    }
                }
            }
            .instrument(tracing::info_span!("analytics_scheduler")),
        )
    }
}

/// Progress from the counts: the daily rate is the signals of the last [`RATE_WINDOW_DAYS`]
/// days over that many days, or over the days since the first signal when the agent is younger
/// (at least one day, so a burst in the first minutes is not extrapolated to thousands a day).
/// The ETA is `now + remaining / rate` days.
pub fn progress(
    total: u64,
    recent: u64,
    first_ms: Option<i64>,
    last_ms: Option<i64>,
    now_ms: i64,
) -> Progress {
    let remaining = RECOMMENDATION_THRESHOLD.saturating_sub(total);
    let days = first_ms.map_or(RATE_WINDOW_DAYS as f64, |first| {
        ((now_ms - first) as f64 / DAY_MS as f64).clamp(1.0, RATE_WINDOW_DAYS as f64)
    });
    let daily_rate = recent as f64 / days;
    let eta_ms = (remaining > 0 && daily_rate > 0.0)
        .then(|| now_ms + (remaining as f64 / daily_rate * DAY_MS as f64).round() as i64);
    Progress {
        signals: total,
        threshold: RECOMMENDATION_THRESHOLD,
        remaining,
        daily_rate,
        eta_ms,
        first_signal_ms: first_ms,
        last_signal_ms: last_ms,
    }
}

/// Names a traced request for each labelled evidence arm: the latest in the window whose model,
/// provider or env is the label (arms of other kinds, such as weeks or latency bands, get none).
async fn example_traces(
    store: &Store,
    agent: &str,
    since_ms: i64,
    recommendations: &mut [Recommendation],
) -> Result<()> {
    let labels: Vec<String> = recommendations
        .iter()
        .flat_map(|r| &r.evidence)
        .flat_map(|e| std::iter::once(&e.a).chain(e.b.as_ref()))
        .map(|arm| arm.label.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let found = latest_traces(store, agent, since_ms, labels).await?;
    for r in recommendations.iter_mut() {
        for e in &mut r.evidence {
            for arm in std::iter::once(&mut e.a).chain(e.b.as_mut()) {
                arm.example_trace_id = found.get(&arm.label).cloned();
            }
        }
    }
    Ok(())
}

/// The latest traced request of `agent` in `[since_ms, until_ms]` whose model, provider or env
/// is one of `labels` (read through the partial index `idx_requests_agent_traced`, m0019).
fn latest_trace_statement(
    backend: sea_orm::DatabaseBackend,
    agent: &str,
    since_ms: i64,
    until_ms: i64,
    labels: &[String],
) -> sea_orm::Statement {
    // SQLite's planner, without statistics, takes the index of all the agent's requests (same
    // leading columns): named here, so an untraced gateway's walk reads nothing.
    let from = match backend {
        sea_orm::DatabaseBackend::Sqlite => "requests INDEXED BY idx_requests_agent_traced",
        _ => "requests",
    };
    let mut sql = crate::sql::Sql::new(
        backend,
        &format!(
            "SELECT trace_id, model, provider, env, started_at_ms FROM {from} \
             WHERE trace_id IS NOT NULL AND agent = "
        ),
    );
    sql.bind(agent.to_owned())
        .push(" AND started_at_ms >= ")
        .bind(since_ms)
        .push(" AND started_at_ms <= ")
        .bind(until_ms);
    for column in ["model", "provider", "env"] {
        sql.push(if column == "model" { " AND (" } else { " OR " })
            .push(column)
            .push(" IN (");
        for (i, label) in labels.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.bind(label.clone());
        }
        sql.push(")");
    }
    sql.push(") ORDER BY started_at_ms DESC LIMIT 1");
    sql.build()
}

/// For each of `labels`, the trace of the latest traced request of `agent` since `since_ms`
/// whose model, provider or env is the label (labels without one are left out).
///
/// One walk down the agent's traced requests by time (the partial index of m0019, which holds
/// only traced requests), newest first, shared by all the labels: each statement asks for the latest traced request
/// at or before the walk's position that names a label still unanswered, so each answers at
/// least one more label and the next starts where it stopped. A label no traced request names
/// (a week, a latency band) costs no more than the one walk, and when the gateway traces
/// nothing the walk is over at once. One statement per label, each walking the whole window, took about 1 s of CPU per
/// label for an agent with 400,000 requests in it (7 labels: 7 s; bench/HISTORY.md, session 23).
async fn latest_traces(
    store: &Store,
    agent: &str,
    since_ms: i64,
    mut labels: Vec<String>,
) -> Result<BTreeMap<String, String>> {
    let db = store.conn();
    let mut found = BTreeMap::new();
    let mut until_ms = i64::MAX;
    while !labels.is_empty() {
        let statement = latest_trace_statement(
            db.get_database_backend(),
            agent,
            since_ms,
            until_ms,
            &labels,
        );
        let Some(row) = db.query_one_raw(statement).await? else {
            break;
        };
        let trace: String = row.try_get("", "trace_id")?;
        let named: [Option<String>; 3] = [
            row.try_get("", "model")?,
            row.try_get("", "provider")?,
            row.try_get("", "env")?,
        ];
        labels.retain(|label| {
            let hit = named.iter().flatten().any(|v| v == label);
            if hit {
                found.insert(label.clone(), trace.clone());
            }
            !hit
        });
        // Requests of the same millisecond as this one may name other labels: the next
        // statement reads from this millisecond on (the labels this row answered are gone
        // from it, so it cannot return this row again).
        until_ms = row.try_get("", "started_at_ms")?;
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    #[test]
    fn eta_follows_the_recent_rate() {
        // ~10 signals a day for a week, 40 so far: 60 to go, 6 days.
        let p = progress(40, 70, Some(NOW - 30 * DAY_MS), Some(NOW), NOW);
        assert_eq!(p.remaining, 60);
        assert!((p.daily_rate - 10.0).abs() < 1e-9);
        assert_eq!(p.eta_ms, Some(NOW + 6 * DAY_MS));
        // ~100 a day: the next day.
        let p = progress(90, 700, Some(NOW - 30 * DAY_MS), Some(NOW), NOW);
        assert!(p.eta_ms.is_some_and(|t| t > NOW && t <= NOW + DAY_MS));
        // A young agent: 20 signals in two days is 10 a day.
        let p = progress(20, 20, Some(NOW - 2 * DAY_MS), Some(NOW), NOW);
        assert!((p.daily_rate - 10.0).abs() < 1e-9);
        assert_eq!(p.eta_ms, Some(NOW + 8 * DAY_MS));
    }

    #[test]
    fn weeks_start_on_monday_utc() {
        // 2026-11-23 was a Monday.
        let monday = 1_795_392_000_000;
        assert_eq!(week_start_ms(monday), monday);
        assert_eq!(week_start_ms(monday + 7 * DAY_MS - 1), monday);
        assert_eq!(week_start_ms(monday - 1), monday - 7 * DAY_MS);
        assert_eq!(week_start_ms(0), -3 * DAY_MS);
        let p = periods_at(monday + DAY_MS, monday - 90 * DAY_MS);
        assert_eq!(
            (p.recent_since, p.previous_since),
            (monday, monday - 7 * DAY_MS)
        );
    }

    #[test]
    fn the_window_grows_within_each_stretch() {
        let origin = NOW;
        let at = |days: i64, ms: i64| periods_at(origin + days * DAY_MS + ms, origin).window;
        // The first 60 days: everything since the origin, stretch 1.
        for days in [0, 1, 29, 30, 59] {
            assert_eq!(at(days, 0).since_ms, origin, "day {days}");
            assert_eq!(window_stretch(origin + days * DAY_MS, origin), 1);
        }
        assert_eq!(at(59, DAY_MS - 1).since_ms, origin);
        // Then stretch k from k × 30 days, the window starting 30 days before it.
        for k in 2..6 {
            let start = origin + k * 30 * DAY_MS;
            assert_eq!(window_stretch(start, origin), k as u64);
            assert_eq!(window_stretch(start - 1, origin), (k - 1).max(1) as u64);
            for ms in [0, DAY_MS, 30 * DAY_MS - 1] {
                let w = periods_at(start + ms, origin).window;
                assert_eq!(w.since_ms, start - 30 * DAY_MS, "stretch {k}");
                let days = (w.until_ms - w.since_ms) as f64 / DAY_MS as f64;
                assert!((30.0..60.0).contains(&days), "{days}");
            }
        }
        // A clock before the origin stays in stretch 1 with an empty window.
        let w = periods_at(origin - DAY_MS, origin).window;
        assert_eq!(window_stretch(origin - DAY_MS, origin), 1);
        assert!(w.since_ms <= w.until_ms);
    }

    #[test]
    fn weeks_are_counted_from_the_origin() {
        let monday = 1_795_392_000_000;
        let origin = monday + 3 * DAY_MS;
        assert_eq!(week_stretch(origin, origin), 0);
        assert_eq!(week_stretch(monday + 7 * DAY_MS - 1, origin), 0);
        assert_eq!(week_stretch(monday + 7 * DAY_MS, origin), 1);
        assert_eq!(week_stretch(monday + 70 * DAY_MS, origin), 10);
    }

    #[test]
    fn intervals_are_carried_within_their_stretch_at_its_share() {
        let origin = NOW - 10 * DAY_MS;
        let periods = periods_at(NOW, origin);
        let week = recommend::week_keys(periods.recent_since);
        let window = recommend::window_keys(periods.window.since_ms);
        let i = Interval {
            lower: 0.1,
            upper: 0.2,
        };
        let earlier: BTreeMap<String, Interval> = [
            (format!("{window}best|x"), i),
            (format!("{}best|x", recommend::window_keys(origin - 1)), i),
            (format!("{week}trend|x"), i),
            (
                format!("{}trend|x", recommend::week_keys(periods.previous_since)),
                i,
            ),
        ]
        .into_iter()
        .collect();
        let mut run = carried(earlier.clone(), &periods, origin);
        for key in earlier.keys() {
            run.carry(key);
        }
        // Another stretch's window and last week's trend are other questions.
        assert_eq!(
            run.clone().into_met().into_keys().collect::<Vec<_>>(),
            [format!("{week}trend|x"), format!("{window}best|x")]
        );
        // Stretch 1 of the window spends 6/π² of the level; the trend, in week 1 or 2 of the
        // agent's life, its week's share; anything else all of it.
        let w = week_stretch(NOW, origin);
        assert!((1..=2).contains(&w));
        let close = |x: f64, y: f64| (x - y).abs() < 1e-15;
        assert!(close(
            run.alpha(&format!("{window}best|x"), 2),
            stats::FAMILY_ALPHA * stats::stretch_share(1) / 2.0
        ));
        assert!(close(
            run.alpha(&format!("{week}trend|x"), 1),
            stats::FAMILY_ALPHA * stats::stretch_share(w)
        ));
        assert!(close(run.alpha("other", 1), stats::FAMILY_ALPHA));
        // Sixty days on, stretch 2: a new window, a new start, a quarter of the first share.
        let later = periods_at(origin + 60 * DAY_MS, origin);
        let run = carried(earlier, &later, origin);
        assert!(run.into_met().is_empty());
        let window2 = recommend::window_keys(later.window.since_ms);
        assert_ne!(window2, window);
        let run = carried(BTreeMap::new(), &later, origin);
        assert!(close(
            run.alpha(&format!("{window2}best|x"), 1),
            stats::FAMILY_ALPHA * stats::stretch_share(2)
        ));
    }

    #[test]
    fn no_eta_without_a_rate_or_once_reached() {
        assert_eq!(progress(0, 0, None, None, NOW).eta_ms, None);
        assert_eq!(
            progress(30, 0, Some(NOW - 60 * DAY_MS), Some(NOW - 50 * DAY_MS), NOW).eta_ms,
            None
        );
        let p = progress(150, 10, Some(NOW - DAY_MS), Some(NOW), NOW);
        assert_eq!((p.remaining, p.eta_ms), (0, None));
    }
}

#[cfg(test)]
mod ground_truth_tests;

#[cfg(test)]
mod rollup_tests;

#[cfg(test)]
mod stats_tests;

#[cfg(test)]
mod trace_tests;
