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
//! [`Analytics`] ties them together. Below [`RECOMMENDATION_THRESHOLD`] signals an agent is
//! *collecting*: the answer gives the count, the recent daily rate and the estimated date of
//! the first recommendations. At or past it, the recommendations are computed over the last
//! [`WINDOW_DAYS`] days and stored. [`Analytics::spawn_scheduler`] recomputes every agent on an
//! interval; [`Analytics::recompute`] does it on demand; [`Analytics::get`] reads the stored
//! answer (a primary-key lookup), computing it first when there is none, or when the stored one
//! is still collecting (cheap: two indexed counts), so progress is always current.
//!
//! A stored answer also keeps, per comparison, the running intersection of its confidence
//! sequence ([`stats::Intersections`]), so a claim does not come and go with each batch. The
//! next computation carries them only while they are still about the same, grown, sessions:
//! the window's comparisons while the agent's first signal is still inside the window (no
//! session has left it), the trend's for the same calendar week. Once sessions leave the
//! window, each look stands on its own window (intersecting across different samples would
//! freeze old evidence in place, when the window is there to follow change).

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

pub use query::Dimension;
pub use report::{AgentAnalytics, Kind, OutcomeRow, Progress, Recommendation, Status, Window};
use stats::{Intersections, Interval};

use crate::error::{Error, Result};
use crate::signals::RECOMMENDATION_THRESHOLD;
use crate::sql::Sql;
use crate::store::Store;
use crate::store::entity::analytics_result;

pub const DAY_MS: i64 = 86_400_000;
/// Days of data the recommendations rest on (ending at the computation).
pub const WINDOW_DAYS: i64 = 30;
/// Length of each of the two trend periods: this calendar week so far (UTC, from Monday)
/// against the last.
pub const TREND_DAYS: i64 = 7;
/// The recent daily signal rate is measured over this many days (or since the agent's first
/// signal, when that is more recent, but at least one day).
pub const RATE_WINDOW_DAYS: i64 = 7;
/// Default interval of the scheduled recomputation.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(600);

/// What `analytics_results.report` holds: the answer, and the intervals the rules keep from
/// look to look, which stay in the controlplane (the gRPC answer has no place for them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stored {
    #[serde(flatten)]
    report: AgentAnalytics,
    /// The running intersection of each comparison's confidence sequence at this look, by key
    /// (see [`recommend::WINDOW_KEYS`]); absent from answers stored before there were any.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    sequences: BTreeMap<String, Interval>,
}

/// The start (Monday 00:00 UTC) of the calendar week holding `ms`.
pub fn week_start_ms(ms: i64) -> i64 {
    let day = ms.div_euclid(DAY_MS);
    // 1970-01-01 was a Thursday: day 0 is 3 days after a Monday.
    (day - (day + 3).rem_euclid(7)) * DAY_MS
}

/// The window and trend periods of a computation at `now_ms`.
pub fn periods_at(now_ms: i64) -> query::Periods {
    let recent_since = week_start_ms(now_ms);
    query::Periods {
        window: Window {
            since_ms: now_ms - WINDOW_DAYS * DAY_MS,
            until_ms: now_ms,
        },
        recent_since,
        previous_since: recent_since - TREND_DAYS * DAY_MS,
    }
}

/// The intervals of an earlier look that still apply at this one: the window's while the
/// agent's first signal is inside the window (every session ever is in it, so the sessions only
/// grew), this week's trend keys always (last week is fixed, this week only grows).
fn carried(
    mut earlier: BTreeMap<String, Interval>,
    progress: &Progress,
    periods: &query::Periods,
) -> Intersections {
    let whole = progress
        .first_signal_ms
        .is_some_and(|first| first >= periods.window.since_ms);
    let week = recommend::week_keys(periods.recent_since);
    earlier.retain(|key, _| {
        key.starts_with(&week) || (whole && key.starts_with(recommend::WINDOW_KEYS))
    });
    Intersections::carried(earlier)
}

/// Analytics over the controlplane's database. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Analytics {
    store: Store,
}

impl Analytics {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    /// An agent's progress toward the threshold at `now_ms`: two indexed counts.
    #[tracing::instrument(skip_all, fields(nm.agent = %agent))]
    pub async fn progress(&self, agent: &str, now_ms: i64) -> Result<Progress> {
        let db = self.store.conn();
        // Four subqueries on the index `signals(agent, received_at_ms)`: the first and the last
        // are one seek each, the counts step through the index without evaluating anything per
        // entry (half the time of one pass computing all four).
        let mut sql = Sql::new(
            db.get_database_backend(),
            "SELECT (SELECT COUNT(*) FROM signals WHERE agent = ",
        );
        sql.bind(agent.to_owned())
            .push(") AS total, (SELECT MIN(received_at_ms) FROM signals WHERE agent = ")
            .bind(agent.to_owned())
            .push(") AS first, (SELECT MAX(received_at_ms) FROM signals WHERE agent = ")
            .bind(agent.to_owned())
            .push(") AS last, (SELECT COUNT(*) FROM signals WHERE agent = ")
            .bind(agent.to_owned())
            .push(" AND received_at_ms >= ")
            .bind(now_ms - RATE_WINDOW_DAYS * DAY_MS)
            .push(") AS recent");
        let row = db
            .query_one_raw(sql.build())
            .await?
            .ok_or_else(|| Error::Unavailable("count query returned no row".to_owned()))?;
        let total = u64::try_from(row.try_get::<i64>("", "total")?).unwrap_or(0);
        let recent = u64::try_from(row.try_get::<i64>("", "recent")?).unwrap_or(0);
        let first: Option<i64> = row.try_get("", "first")?;
        let last: Option<i64> = row.try_get("", "last")?;
        Ok(progress(total, recent, first, last, now_ms))
    }

    /// Computes an agent's analytics at `now_ms` as a first look would (no interval carried
    /// from an earlier look; not stored).
    pub async fn compute(&self, agent: &str, now_ms: i64) -> Result<AgentAnalytics> {
        Ok(self
            .compute_from(agent, now_ms, BTreeMap::new())
            .await?
            .report)
    }

    /// Computes an agent's analytics at `now_ms`, meeting each comparison's interval with
    /// those of `earlier` that still apply (see [`carried`]).
    #[tracing::instrument(skip_all, fields(nm.agent = %agent, status = tracing::field::Empty, recommendations = tracing::field::Empty))]
    async fn compute_from(
        &self,
        agent: &str,
        now_ms: i64,
        earlier: BTreeMap<String, Interval>,
    ) -> Result<Stored> {
        let agent = nm_types::parse_agent(agent)
            .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
        let progress = self.progress(&agent, now_ms).await?;
        let periods = periods_at(now_ms);
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
                },
                sequences: BTreeMap::new(),
            });
        }
        let aggregates = query::aggregates(&self.store, &agent, periods).await?;
        let mut run = carried(earlier, &progress, &periods);
        let recommendations = recommend::recommend(&aggregates, &periods, &mut run);
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
            },
            sequences: run.into_met(),
        })
    }

    /// Computes an agent's analytics now and stores them (an agent without any signal, say a
    /// mistyped name, is answered but not stored).
    pub async fn recompute(&self, agent: &str) -> Result<AgentAnalytics> {
        self.recompute_at(agent, crate::now_ms()).await
    }

    /// [`Analytics::recompute`] at `now_ms`: the stored answer's intervals that still apply
    /// are met with this look's, and the new ones stored with the answer.
    pub async fn recompute_at(&self, agent: &str, now_ms: i64) -> Result<AgentAnalytics> {
        let agent = nm_types::parse_agent(agent)
            .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
        let earlier = self
            .stored_with_sequences(&agent)
            .await?
            .map(|s| s.sequences)
            .unwrap_or_default();
        let stored = self.compute_from(&agent, now_ms, earlier).await?;
        if stored.report.progress.signals > 0 {
            self.save_stored(&stored).await?;
        }
        Ok(stored.report)
    }

    /// Recomputes and stores every agent that has signals; returns how many.
    #[tracing::instrument(skip_all, fields(agents = tracing::field::Empty))]
    pub async fn recompute_all(&self) -> Result<Vec<AgentAnalytics>> {
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
    }

    /// Agents with at least one signal.
    pub async fn agents(&self) -> Result<Vec<String>> {
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
    }

    /// The stored analytics of an agent, if any.
    pub async fn stored(&self, agent: &str) -> Result<Option<AgentAnalytics>> {
        Ok(self.stored_with_sequences(agent).await?.map(|s| s.report))
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
    pub async fn get(&self, agent: &str) -> Result<AgentAnalytics> {
        let agent = nm_types::parse_agent(agent)
            .map_err(|e| Error::InvalidArgument(format!("agent: {e}")))?;
        match self.stored(&agent).await? {
            Some(r) if r.status == Status::Ready => Ok(r),
            _ => self.recompute(&agent).await,
        }
    }

    /// Stores a computed answer, replacing the previous one (and the intervals it kept: the
    /// next look starts its intersections afresh).
    pub async fn save(&self, r: &AgentAnalytics) -> Result<()> {
        self.save_stored(&Stored {
            report: r.clone(),
            sequences: BTreeMap::new(),
        })
        .await
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
    pub async fn outcome_rates(
        &self,
        agent: &str,
        dims: &[Dimension],
        since_ms: Option<i64>,
        until_ms: Option<i64>,
        limit: u32,
    ) -> Result<(Window, Vec<OutcomeRow>)> {
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
        let rows = query::outcome_rates(&self.store, &agent, dims, since, until, limit).await?;
        Ok((
            Window {
                since_ms: since,
                until_ms: until,
            },
            rows,
        ))
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
        let p = periods_at(monday + DAY_MS);
        assert_eq!(
            (p.recent_since, p.previous_since),
            (monday, monday - 7 * DAY_MS)
        );
        assert_eq!(p.window.until_ms - p.window.since_ms, WINDOW_DAYS * DAY_MS);
    }

    #[test]
    fn intervals_are_carried_while_they_are_about_the_same_sessions() {
        let periods = periods_at(NOW);
        let week = recommend::week_keys(periods.recent_since);
        let i = Interval {
            lower: 0.1,
            upper: 0.2,
        };
        let earlier: BTreeMap<String, Interval> = [
            (format!("{}best|x", recommend::WINDOW_KEYS), i),
            (format!("{week}trend|x"), i),
            (
                format!("{}trend|x", recommend::week_keys(periods.previous_since)),
                i,
            ),
        ]
        .into_iter()
        .collect();
        let progress = |first: i64| Progress {
            first_signal_ms: Some(first),
            ..Progress::default()
        };
        let kept = |first: i64| {
            let mut run = carried(earlier.clone(), &progress(first), &periods);
            for key in earlier.keys() {
                run.carry(key);
            }
            run.into_met().into_keys().collect::<Vec<_>>()
        };
        // A young agent: the window's and this week's; last week's trend is another question.
        assert_eq!(
            kept(periods.window.since_ms),
            [
                format!("{week}trend|x"),
                format!("{}best|x", recommend::WINDOW_KEYS)
            ]
        );
        // Sessions have left the window: this week's only.
        assert_eq!(
            kept(periods.window.since_ms - 1),
            [format!("{week}trend|x")]
        );
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
