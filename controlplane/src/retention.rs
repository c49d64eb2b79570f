//! Retention: request records and signals older than their setting (`NM_RETENTION_RECORDS`,
//! `NM_RETENTION_SIGNALS`; unset: kept forever) are deleted by a background task, in bounded
//! batches with a pause between them, so ingest, signal acknowledgement and the analytics only
//! ever wait for one batch.
//!
//! **History is kept.** The usage of every record is in `usage_rollups` (one row per UTC day,
//! agent, end user, env, provider, model and key) and its latencies in `latency_totals`, both
//! added at ingest (`crate::usage::add_day_totals`), so deleting records loses no usage or
//! latency history: the reports read whole days from those totals. A batch of signals is folded
//! into `signal_rollups` (per agent and UTC day, the signals each evidence setting counts, with
//! their first and last times) in the same transaction that deletes it: on PostgreSQL in one
//! statement (`WITH gone AS (DELETE ... RETURNING ...) INSERT ...`), on SQLite inside the
//! batch's `BEGIN IMMEDIATE` transaction, which no other writer can enter. So the rollups hold
//! exactly the signals deleted, and the analytics' progress counts add them to the signals
//! still stored. The rest of the agent analytics reads one row per session
//! (`session_rollups`), written with each signal; retention never deletes those.
//! The sessions table (`sessions`, one row per session for attribution) loses the sessions not
//! seen since the records' cutoff.
//!
//! **Disk.** SQLite databases are created with `auto_vacuum=INCREMENTAL`; after a run that
//! deleted rows, the free pages go back to the file system in steps (`PRAGMA
//! incremental_vacuum`), so the file stops growing. A database created before keeps its mode
//! until one `VACUUM`, which the task runs once at its start (it rewrites the file: logged
//! with its duration).
//!
//! **PostgreSQL partitions.** There `requests` and `signals` are partitioned by UTC day
//! ([`crate::partitions`]). A run first drops the day partitions that lie wholly before the
//! cutoff, a day of signals folded into `signal_rollups` in the transaction that drops it; then
//! the batches above delete what remains before the cutoff (the day the cutoff falls in, and any
//! old row that landed in the DEFAULT partition), signals folded as above. The task runs on PostgreSQL
//! even without a retention setting: each tick gives the next days their partitions.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, DatabaseBackend};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::analytics::evidence::SIGNAL_ROLLUPS;
use crate::error::Result;
use crate::partitions;
use crate::sql::Sql;
use crate::store::Store;

/// Most rows one batch deletes (more when rows share the boundary's millisecond).
pub const BATCH: u64 = 2_000;
/// The shortest pause after each batch: the other writers' turn.
pub const PAUSE: Duration = Duration::from_millis(20);
/// After each batch, the pause is at least this many times the batch's own duration: retention
/// holds SQLite's one write lock (or PostgreSQL's I/O) at most a third of the time.
pub const PAUSE_FACTOR: u32 = 2;
/// Pages returned to the file system per step of SQLite's incremental vacuum (4 MiB of 4 KiB
/// pages).
pub const VACUUM_STEP_PAGES: u32 = 1_000;
/// The longest time between two runs.
pub const MAX_INTERVAL: Duration = Duration::from_secs(600);

const DAY_MS: i64 = 86_400_000;

/// How long raw rows are kept; `None`: forever.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    pub records: Option<Duration>,
    pub signals: Option<Duration>,
}

impl Retention {
    pub fn is_off(&self) -> bool {
        self.records.is_none() && self.signals.is_none()
    }

    /// Time between runs: a tenth of the shortest retention, from 1 s to [`MAX_INTERVAL`].
    pub fn interval(&self) -> Duration {
        let shortest = [self.records, self.signals]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(MAX_INTERVAL);
        (shortest / 10).clamp(Duration::from_secs(1), MAX_INTERVAL)
    }
}

/// What one run deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub records: u64,
    pub signals: u64,
    pub sessions: u64,
    pub batches: u64,
    /// SQLite pages given back to the file system.
    pub pages_freed: u64,
    /// PostgreSQL day partitions dropped (their rows are counted in `records` and `signals`).
    pub partitions: u64,
}

/// Running totals since start, for logs and tests.
#[derive(Debug, Default)]
pub struct Totals {
    pub records: AtomicU64,
    pub signals: AtomicU64,
    pub runs: AtomicU64,
}

#[derive(Debug, Clone)]
pub struct Retainer {
    store: Store,
    retention: Retention,
    totals: Arc<Totals>,
}

impl Retainer {
    pub fn new(store: Store, retention: Retention) -> Self {
        Self {
            store,
            retention,
            totals: Arc::default(),
        }
    }

    pub fn totals(&self) -> &Totals {
        &self.totals
    }

    /// Runs at start and then every [`Retention::interval`] until `shutdown`. Does nothing when
    /// everything is kept, but on PostgreSQL, where it keeps the next days' partitions made.
    pub fn spawn(self, mut shutdown: watch::Receiver<bool>) -> Option<tokio::task::JoinHandle<()>> {
        let upkeep = self.store.backend() == DatabaseBackend::Postgres;
        if self.retention.is_off() && !upkeep {
            return None;
        }
        Some(tokio::spawn(async move {
            let every = self.retention.interval();
            if !self.retention.is_off() {
                info!(
                    records = ?self.retention.records,
                    signals = ?self.retention.signals,
                    interval_secs = every.as_secs(),
                    "retention started"
                );
                if let Err(e) = self.switch_to_incremental_vacuum().await {
                    warn!(error = %e, "retention: cannot switch SQLite to incremental vacuum");
                }
            }
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.changed() => return,
                }
                if *shutdown.borrow() {
                    return;
                }
                if upkeep {
                    match crate::partitions::ensure_ahead(&self.store, crate::now_ms()).await {
                        Ok(0) => {}
                        Ok(made) => info!(made, "partitions: next days' partitions made"),
                        Err(e) => {
                            warn!(error = %e, "partitions: cannot make the next days' partitions; the next run tries again")
                        }
                    }
                }
                if self.retention.is_off() {
                    continue;
                }
                if let Err(e) = self.run(crate::now_ms(), &shutdown).await {
                    warn!(error = %e, "retention run failed; the next one tries again");
                }
            }
        }))
    }

    /// SQLite databases made before retention existed have no incremental vacuum: one `VACUUM`
    /// switches them (the file is rewritten; writers wait for it).
    async fn switch_to_incremental_vacuum(&self) -> Result<()> {
        let db = self.store.conn();
        if db.get_database_backend() != DatabaseBackend::Sqlite {
            return Ok(());
        }
        let mode = pragma(db, "PRAGMA auto_vacuum").await?;
        if mode == 2 {
            return Ok(());
        }
        let started = Instant::now();
        warn!("retention: switching the SQLite file to incremental vacuum (one VACUUM)");
        self.store.vacuum_to_incremental().await?;
        let mode = pragma(db, "PRAGMA auto_vacuum").await?;
        info!(
            ms = started.elapsed().as_millis() as u64,
            mode, "retention: SQLite file vacuumed"
        );
        Ok(())
    }

    /// One run at `now_ms`: every batch due, then SQLite's free pages returned. Stops between
    /// batches when `shutdown` turns true.
    pub async fn run(&self, now_ms: i64, shutdown: &watch::Receiver<bool>) -> Result<Deleted> {
        let started = Instant::now();
        let mut done = Deleted::default();
        if let Some(keep) = self.retention.records {
            let cutoff = cutoff(now_ms, keep);
            let (rows, dropped) = self
                .drop_partitions(partitions::REQUESTS, cutoff, shutdown)
                .await?;
            done.records += rows;
            done.partitions += dropped;
            while !*shutdown.borrow() {
                let took = Instant::now();
                let n = self.records_batch(cutoff).await?;
                done.records += n;
                done.batches += 1;
                if n == 0 {
                    break;
                }
                pause(took.elapsed()).await;
            }
            while !*shutdown.borrow() {
                let took = Instant::now();
                let n = self
                    .delete_batch("sessions", "last_seen_ms", cutoff)
                    .await?;
                done.sessions += n;
                done.batches += 1;
                if n == 0 {
                    break;
                }
                pause(took.elapsed()).await;
            }
        }
        if let Some(keep) = self.retention.signals {
            let cutoff = cutoff(now_ms, keep);
            let (rows, dropped) = self
                .drop_partitions(partitions::SIGNALS, cutoff, shutdown)
                .await?;
            done.signals += rows;
            done.partitions += dropped;
            while !*shutdown.borrow() {
                let took = Instant::now();
                let n = self.signals_batch(cutoff).await?;
                done.signals += n;
                done.batches += 1;
                if n == 0 {
                    break;
                }
                pause(took.elapsed()).await;
            }
            // PostgreSQL: the (key, Idempotency-Key) pairs of the signals gone (m0017).
            if partitions::is_partitioned(self.store.conn(), partitions::SIGNALS.table).await? {
                while !*shutdown.borrow() {
                    let took = Instant::now();
                    let n = self
                        .delete_batch("signal_idempotency", "received_at_ms", cutoff)
                        .await?;
                    done.batches += 1;
                    if n == 0 {
                        break;
                    }
                    pause(took.elapsed()).await;
                }
            }
        }
        if done.records + done.signals + done.sessions > 0 {
            done.pages_freed = self.return_free_pages(shutdown).await?;
        }
        self.totals.runs.fetch_add(1, Ordering::Relaxed);
        self.totals
            .records
            .fetch_add(done.records, Ordering::Relaxed);
        self.totals
            .signals
            .fetch_add(done.signals, Ordering::Relaxed);
        if done.records + done.signals + done.sessions > 0 {
            info!(
                records = done.records,
                signals = done.signals,
                sessions = done.sessions,
                batches = done.batches,
                partitions = done.partitions,
                pages_freed = done.pages_freed,
                ms = started.elapsed().as_millis() as u64,
                "retention: old rows deleted"
            );
        }
        Ok(done)
    }

    /// PostgreSQL: drops the day partitions of `p` wholly before `cutoff`, oldest first, a day of
    /// request records or signals folded into its rollups in the transaction that drops it. Returns the
    /// rows and the partitions dropped. A day whose detach could not get its lock in time ends
    /// the run with that error (logged); the next run tries again.
    async fn drop_partitions(
        &self,
        p: partitions::Partitioned,
        cutoff: i64,
        shutdown: &watch::Receiver<bool>,
    ) -> Result<(u64, u64)> {
        let (mut rows, mut dropped) = (0, 0);
        for name in partitions::expired(&self.store, p, cutoff).await? {
            if *shutdown.borrow() {
                break;
            }
            let took = Instant::now();
            // Records need no fold: their usage is in the day totals since their ingest.
            let fold = if p == partitions::SIGNALS {
                Some(format!(
                    "{} WHERE agent IS NOT NULL{}",
                    signal_fold_head(DatabaseBackend::Postgres, &name),
                    signal_fold_tail()
                ))
            } else {
                None
            };
            if let Some(n) = partitions::drop_partition(&self.store, p, &name, fold).await? {
                rows += n;
                dropped += 1;
                info!(
                    partition = %name,
                    rows = n,
                    ms = took.elapsed().as_millis() as u64,
                    "retention: partition dropped"
                );
            }
            pause(took.elapsed()).await;
        }
        Ok((rows, dropped))
    }

    /// The time below which a batch of at most [`BATCH`] rows of `table` lies: `cutoff`, or
    /// just past the time of the batch's last row.
    async fn batch_bound(
        &self,
        db: &impl ConnectionTrait,
        table: &str,
        time: &str,
        cutoff: i64,
    ) -> Result<i64> {
        let mut sql = Sql::new(
            db.get_database_backend(),
            &format!("SELECT {time} AS t FROM {table} WHERE {time} < "),
        );
        sql.bind(cutoff)
            .push(&format!(" ORDER BY {time} LIMIT 1 OFFSET "))
            .bind((BATCH - 1) as i64);
        Ok(match db.query_one_raw(sql.build()).await? {
            Some(row) => row.try_get::<i64>("", "t")?.saturating_add(1).min(cutoff),
            None => cutoff,
        })
    }

    /// Deletes one batch of request records before `cutoff` (their usage stays in the day
    /// totals, `usage_rollups` and `latency_totals`, where the ingest added it).
    async fn records_batch(&self, cutoff: i64) -> Result<u64> {
        let txn = self.store.begin_write().await?;
        let backend = txn.get_database_backend();
        if backend == DatabaseBackend::Postgres {
            partitions::lock_shared(&txn).await?;
        }
        let bound = self
            .batch_bound(&txn, "requests", "started_at_ms", cutoff)
            .await?;
        let mut del = Sql::new(backend, "DELETE FROM requests WHERE started_at_ms < ");
        del.bind(bound);
        let n = txn.execute_raw(del.build()).await?.rows_affected();
        txn.commit().await?;
        Ok(n)
    }

    /// Deletes one batch of signals before `cutoff`, their counts added to `signal_rollups` in
    /// the same transaction.
    async fn signals_batch(&self, cutoff: i64) -> Result<u64> {
        let txn = self.store.begin_write().await?;
        let backend = txn.get_database_backend();
        if backend == DatabaseBackend::Postgres {
            partitions::lock_shared(&txn).await?;
        }
        let bound = self
            .batch_bound(&txn, "signals", "received_at_ms", cutoff)
            .await?;
        let n = if backend == DatabaseBackend::Postgres {
            let mut sql = Sql::new(
                backend,
                "WITH gone AS (DELETE FROM signals WHERE received_at_ms < ",
            );
            sql.bind(bound)
                .push(" RETURNING agent, received_at_ms, source, rule), folded AS (")
                .push(&signal_fold_head(backend, "gone"))
                .push(" WHERE agent IS NOT NULL")
                .push(&signal_fold_tail())
                .push(" RETURNING 1) SELECT CAST(COUNT(*) AS BIGINT) AS n FROM gone");
            match txn.query_one_raw(sql.build()).await? {
                Some(row) => u64::try_from(row.try_get::<i64>("", "n")?).unwrap_or(0),
                None => 0,
            }
        } else {
            let mut fold = Sql::new(backend, &signal_fold_head(backend, "signals"));
            fold.push(" WHERE agent IS NOT NULL AND received_at_ms < ")
                .bind(bound)
                .push(&signal_fold_tail());
            txn.execute_raw(fold.build()).await?;
            let mut del = Sql::new(backend, "DELETE FROM signals WHERE received_at_ms < ");
            del.bind(bound);
            txn.execute_raw(del.build()).await?.rows_affected()
        };
        txn.commit().await?;
        Ok(n)
    }

    /// Deletes one batch of rows of `table` whose `time` is before `cutoff`.
    async fn delete_batch(&self, table: &str, time: &str, cutoff: i64) -> Result<u64> {
        let txn = self.store.begin_write().await?;
        if txn.get_database_backend() == DatabaseBackend::Postgres {
            partitions::lock_shared(&txn).await?;
        }
        let bound = self.batch_bound(&txn, table, time, cutoff).await?;
        let mut sql = Sql::new(
            txn.get_database_backend(),
            &format!("DELETE FROM {table} WHERE {time} < "),
        );
        sql.bind(bound);
        let n = txn.execute_raw(sql.build()).await?.rows_affected();
        txn.commit().await?;
        Ok(n)
    }

    /// SQLite: gives the free pages back to the file system, [`VACUUM_STEP_PAGES`] per write
    /// transaction. Returns the pages freed.
    async fn return_free_pages(&self, shutdown: &watch::Receiver<bool>) -> Result<u64> {
        if self.store.backend() != DatabaseBackend::Sqlite {
            return Ok(0);
        }
        let mut freed = 0;
        while !*shutdown.borrow() {
            let before = pragma(self.store.conn(), "PRAGMA freelist_count").await?;
            if before <= 0 {
                break;
            }
            let took = Instant::now();
            let txn = self.store.begin_write().await?;
            txn.execute_unprepared(&format!("PRAGMA incremental_vacuum({VACUUM_STEP_PAGES})"))
                .await?;
            txn.commit().await?;
            pause(took.elapsed()).await;
            let after = pragma(self.store.conn(), "PRAGMA freelist_count").await?;
            if after >= before {
                // Not in incremental mode (the switch failed): the pages stay free for reuse.
                break;
            }
            freed += (before - after) as u64;
        }
        Ok(freed)
    }
}

/// The pause after a batch that took `took`.
async fn pause(took: Duration) {
    tokio::time::sleep((took * PAUSE_FACTOR).max(PAUSE)).await;
}

/// `now_ms - keep`.
fn cutoff(now_ms: i64, keep: Duration) -> i64 {
    now_ms.saturating_sub(i64::try_from(keep.as_millis()).unwrap_or(i64::MAX))
}

/// A one-number pragma.
async fn pragma(db: &impl ConnectionTrait, text: &str) -> Result<i64> {
    let stmt = sea_orm::Statement::from_string(db.get_database_backend(), text.to_owned());
    Ok(match db.query_one_raw(stmt).await? {
        Some(row) => row.try_get_by_index::<i64>(0)?,
        None => 0,
    })
}

/// `INSERT INTO signal_rollups` of the signals of `from` (`signals`, a partition or the CTE of
/// the deleted rows), up to its `WHERE`: per agent and UTC day, for each evidence setting, the
/// signals its filter ([`crate::analytics::Evidence::signal_filter`], the very condition the progress counts use)
/// keeps, and their first and last times. [`signal_fold_tail`] follows the filter.
fn signal_fold_head(backend: DatabaseBackend, from: &str) -> String {
    let mut columns = Vec::new();
    let mut measures = Vec::new();
    for (prefix, evidence) in SIGNAL_ROLLUPS {
        let filter = evidence.signal_filter();
        columns.push(format!(
            "{prefix}_signals, {prefix}_first_ms, {prefix}_last_ms"
        ));
        let n = format!("SUM(CASE WHEN {filter} THEN 1 ELSE 0 END)");
        measures.push(format!(
            "{}, MIN(CASE WHEN {filter} THEN received_at_ms END), \
             MAX(CASE WHEN {filter} THEN received_at_ms END)",
            match backend {
                DatabaseBackend::Postgres => format!("CAST({n} AS BIGINT)"),
                _ => n,
            }
        ));
    }
    format!(
        "INSERT INTO signal_rollups (agent, day, {}) SELECT agent, received_at_ms / {DAY_MS}, {} \
         FROM {from}",
        columns.join(", "),
        measures.join(", "),
    )
}

/// The grouping and the addition to the rows already there (the earlier first time, the later
/// last time; NULL where a side has none).
fn signal_fold_tail() -> String {
    let mut set = Vec::new();
    for (prefix, _) in SIGNAL_ROLLUPS {
        let (n, first, last) = (
            format!("{prefix}_signals"),
            format!("{prefix}_first_ms"),
            format!("{prefix}_last_ms"),
        );
        set.push(format!("{n} = signal_rollups.{n} + excluded.{n}"));
        for (c, keep_old) in [(&first, "<="), (&last, ">=")] {
            set.push(format!(
                "{c} = CASE WHEN excluded.{c} IS NULL OR (signal_rollups.{c} IS NOT NULL \
                 AND signal_rollups.{c} {keep_old} excluded.{c}) THEN signal_rollups.{c} \
                 ELSE excluded.{c} END"
            ));
        }
    }
    format!(
        " GROUP BY 1, 2 ON CONFLICT (agent, day) DO UPDATE SET {}",
        set.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analytics::evidence::signal_rollup_prefix;

    #[test]
    fn runs_every_tenth_of_the_shortest_retention_within_bounds() {
        let r = |records: Option<u64>, signals: Option<u64>| Retention {
            records: records.map(Duration::from_secs),
            signals: signals.map(Duration::from_secs),
        };
        assert!(r(None, None).is_off());
        assert_eq!(r(Some(30), None).interval(), Duration::from_secs(3));
        assert_eq!(r(Some(5), Some(3_600)).interval(), Duration::from_secs(1));
        assert_eq!(r(None, Some(90 * 86_400)).interval(), MAX_INTERVAL);
        assert_eq!(
            r(Some(3_000), Some(90 * 86_400)).interval(),
            Duration::from_secs(300)
        );
    }

    #[test]
    fn cutoff_saturates() {
        assert_eq!(cutoff(100_000, Duration::from_secs(30)), 70_000);
        assert_eq!(cutoff(i64::MIN + 5, Duration::from_secs(1)), i64::MIN);
    }

    #[test]
    fn the_signal_fold_counts_with_each_settings_own_filter() {
        let sql = format!(
            "{} WHERE agent IS NOT NULL{}",
            signal_fold_head(DatabaseBackend::Sqlite, "signals"),
            signal_fold_tail()
        );
        for (prefix, evidence) in SIGNAL_ROLLUPS {
            assert_eq!(signal_rollup_prefix(evidence), prefix);
            assert!(
                sql.contains(&format!(
                    "SUM(CASE WHEN {} THEN 1 ELSE 0 END)",
                    evidence.signal_filter()
                )),
                "{prefix}"
            );
            let n = format!("{prefix}_signals");
            assert!(sql.contains(&format!("{n} = signal_rollups.{n} + excluded.{n}")));
        }
        let keys: std::collections::BTreeSet<_> =
            SIGNAL_ROLLUPS.iter().map(|(_, e)| e.key()).collect();
        assert_eq!(keys.len(), SIGNAL_ROLLUPS.len());
    }
}
