//! PostgreSQL's time partitions of `requests` (by `started_at_ms`) and `signals` (by
//! `received_at_ms`), made by migration m0017: one partition per UTC day, named by its date
//! (`requests_p20261129`, bounds `[day * 86_400_000, (day + 1) * 86_400_000)` in Unix ms), and a
//! DEFAULT partition (`requests_default`) that takes any row whose day has none, so nothing
//! accepted is ever refused or lost.
//!
//! **Upkeep.** [`ensure_ahead`] gives today and the next [`AHEAD_DAYS`] days their partitions;
//! the retention task ([`crate::retention`]) calls it at start and at each run, retention set or
//! not. A partition is made as a plain table, given the rows of its day that the DEFAULT
//! partition holds (a clock far ahead, a long stop), then attached: attaching takes only a
//! `SHARE UPDATE EXCLUSIVE` lock on the parent, so ingest goes on meanwhile.
//!
//! **Retention.** [`drop_partition`] removes a whole day at once: it locks the partition against
//! writers (`SHARE`: readers go on), runs the caller's fold of its rows, if any (signals go into
//! `signal_rollups` in the same transaction; request records need none, their usage is in the
//! day totals since their ingest), then detaches and drops it. The detach needs
//! the parent's `ACCESS EXCLUSIVE` lock for an instant; it waits at most [`LOCK_TIMEOUT`] for it
//! (a long analytics query), after which the run gives up on that day and the next run tries
//! again, so ingest never queues behind it for longer. Every transaction here takes one
//! advisory lock ([`lock`]) and retention's row batches take it shared ([`lock_shared`]): several
//! controlplanes on one database never fold a day twice nor deadlock each other. These
//! transactions are not the store's write transactions: a detach that gave up waiting is no
//! sign that the database refuses writes.

use std::collections::BTreeSet;

use sea_orm::{ConnectionTrait, DatabaseBackend, Statement, TransactionTrait};

use crate::error::Result;
use crate::store::Store;

const DAY_MS: i64 = 86_400_000;
/// Days after today that have their partition ready.
pub const AHEAD_DAYS: i64 = 7;
/// The longest a detach waits for the parent table's lock.
pub const LOCK_TIMEOUT: &str = "1s";
/// The advisory lock of partition changes (exclusive) and retention's batches (shared).
const LOCK_KEY: i64 = 0x6e6d_7061_7274;

/// A table partitioned by day: its name and its time column (Unix ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitioned {
    pub table: &'static str,
    pub time: &'static str,
}

pub const REQUESTS: Partitioned = Partitioned {
    table: "requests",
    time: "started_at_ms",
};
pub const SIGNALS: Partitioned = Partitioned {
    table: "signals",
    time: "received_at_ms",
};

/// The UTC day (days since the epoch) of `ms`.
pub fn day_of_ms(ms: i64) -> i64 {
    ms.div_euclid(DAY_MS)
}

/// `requests_p20261129`: the partition of `table` for `day`.
pub fn partition_name(table: &str, day: i64) -> String {
    let date = chrono::DateTime::from_timestamp(day.saturating_mul(86_400), 0)
        .unwrap_or_default()
        .format("%Y%m%d");
    format!("{table}_p{date}")
}

/// The day of a partition named by [`partition_name`]; `None` for other names.
pub fn day_of_partition(table: &str, name: &str) -> Option<i64> {
    let date = name.strip_prefix(table)?.strip_prefix("_p")?;
    if date.len() != 8 {
        return None;
    }
    let date = chrono::NaiveDate::parse_from_str(date, "%Y%m%d").ok()?;
    Some(
        date.signed_duration_since(chrono::NaiveDate::default())
            .num_days(),
    )
}

/// Whether `table` is partitioned (PostgreSQL after m0017).
pub async fn is_partitioned(db: &impl ConnectionTrait, table: &str) -> Result<bool> {
    if db.get_database_backend() != DatabaseBackend::Postgres {
        return Ok(false);
    }
    let row = db
        .query_one_raw(Statement::from_string(
            DatabaseBackend::Postgres,
            format!(
                "SELECT CAST(COUNT(*) AS BIGINT) AS n FROM pg_class \
                 WHERE oid = to_regclass('{table}') AND relkind = 'p'"
            ),
        ))
        .await?;
    Ok(match row {
        Some(r) => r.try_get::<i64>("", "n")? > 0,
        None => false,
    })
}

/// The day partitions attached to `table`, oldest first (the DEFAULT one is not among them).
pub async fn attached(db: &impl ConnectionTrait, table: &str) -> Result<Vec<(i64, String)>> {
    let rows = db
        .query_all_raw(Statement::from_string(
            DatabaseBackend::Postgres,
            format!(
                "SELECT CAST(c.relname AS TEXT) AS name FROM pg_inherits i \
                 JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass('{table}')"
            ),
        ))
        .await?;
    let mut days = Vec::with_capacity(rows.len());
    for r in rows {
        let name: String = r.try_get("", "name")?;
        if let Some(day) = day_of_partition(table, &name) {
            days.push((day, name));
        }
    }
    days.sort();
    Ok(days)
}

/// Takes the partitions' advisory lock for the transaction.
pub async fn lock(db: &impl ConnectionTrait) -> Result<()> {
    db.execute_unprepared(&format!("SELECT pg_advisory_xact_lock({LOCK_KEY})"))
        .await?;
    Ok(())
}

/// Takes the partitions' advisory lock shared for the transaction (retention's row batches).
pub async fn lock_shared(db: &impl ConnectionTrait) -> Result<()> {
    db.execute_unprepared(&format!("SELECT pg_advisory_xact_lock_shared({LOCK_KEY})"))
        .await?;
    Ok(())
}

/// Gives the days from `now_ms`'s to [`AHEAD_DAYS`] later their partitions in each partitioned
/// table. Returns how many partitions were made.
pub async fn ensure_ahead(store: &Store, now_ms: i64) -> Result<u64> {
    let today = day_of_ms(now_ms);
    let mut made = 0;
    for p in [REQUESTS, SIGNALS] {
        if !is_partitioned(store.conn(), p.table).await? {
            continue;
        }
        let have: BTreeSet<i64> = attached(store.conn(), p.table)
            .await?
            .into_iter()
            .map(|(day, _)| day)
            .collect();
        for day in today..=today + AHEAD_DAYS {
            if !have.contains(&day) && make_partition(store, p, day).await? {
                made += 1;
            }
        }
    }
    Ok(made)
}

/// Makes `day`'s partition of `p` with the rows of that day the DEFAULT partition holds. False
/// when another controlplane made it first.
pub async fn make_partition(store: &Store, p: Partitioned, day: i64) -> Result<bool> {
    let Partitioned { table, time } = p;
    let name = partition_name(table, day);
    let (lo, hi) = (day * DAY_MS, (day + 1) * DAY_MS);
    let txn = store.conn().begin().await?;
    lock(&txn).await?;
    let exists = txn
        .query_one_raw(Statement::from_string(
            DatabaseBackend::Postgres,
            format!("SELECT CAST(to_regclass('{name}') AS TEXT) AS t"),
        ))
        .await?
        .map(|r| r.try_get::<Option<String>>("", "t"))
        .transpose()?
        .flatten()
        .is_some();
    if exists {
        txn.commit().await?;
        return Ok(false);
    }
    for sql in [
        format!("CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"),
        format!(
            "WITH moved AS (DELETE FROM {table}_default WHERE {time} >= {lo} AND {time} < {hi} \
             RETURNING *) INSERT INTO {name} SELECT * FROM moved"
        ),
        format!("ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({lo}) TO ({hi})"),
    ] {
        txn.execute_unprepared(&sql).await?;
    }
    txn.commit().await?;
    Ok(true)
}

/// The day partitions of `p` that lie wholly before `cutoff_ms`, oldest first.
pub async fn expired(store: &Store, p: Partitioned, cutoff_ms: i64) -> Result<Vec<String>> {
    if !is_partitioned(store.conn(), p.table).await? {
        return Ok(Vec::new());
    }
    Ok(attached(store.conn(), p.table)
        .await?
        .into_iter()
        .filter(|(day, _)| (day + 1).saturating_mul(DAY_MS) <= cutoff_ms)
        .map(|(_, name)| name)
        .collect())
}

/// Drops the partition `name` of `p`, after running `fold` (SQL that reads the partition by its
/// name) in the same transaction. Returns the rows it held; `None` when another controlplane
/// dropped it first.
pub async fn drop_partition(
    store: &Store,
    p: Partitioned,
    name: &str,
    fold: Option<String>,
) -> Result<Option<u64>> {
    let table = p.table;
    let txn = store.conn().begin().await?;
    lock(&txn).await?;
    let still = attached(&txn, table).await?.iter().any(|(_, n)| n == name);
    if !still {
        txn.commit().await?;
        return Ok(None);
    }
    // No writer adds to the day between the fold and the drop.
    txn.execute_unprepared(&format!("LOCK TABLE {name} IN SHARE MODE"))
        .await?;
    let rows = match txn
        .query_one_raw(Statement::from_string(
            DatabaseBackend::Postgres,
            format!("SELECT CAST(COUNT(*) AS BIGINT) AS n FROM {name}"),
        ))
        .await?
    {
        Some(r) => u64::try_from(r.try_get::<i64>("", "n")?).unwrap_or(0),
        None => 0,
    };
    if let Some(fold) = fold
        && rows > 0
    {
        txn.execute_unprepared(&fold).await?;
    }
    for sql in [
        format!("SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"),
        format!("ALTER TABLE {table} DETACH PARTITION {name}"),
        format!("DROP TABLE {name}"),
    ] {
        txn.execute_unprepared(&sql).await?;
    }
    txn.commit().await?;
    Ok(Some(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_named_by_their_utc_date_and_read_back() {
        let day = day_of_ms(1_796_000_000_000);
        let name = partition_name("requests", day);
        assert_eq!(name, "requests_p20261130");
        assert_eq!(day_of_partition("requests", &name), Some(day));
        assert_eq!(day_of_partition("signals", &name), None);
        assert_eq!(day_of_partition("requests", "requests_default"), None);
        assert_eq!(day_of_partition("requests", "requests_p2026120"), None);
        assert_eq!(partition_name("signals", 0), "signals_p19700101");
        assert_eq!(day_of_ms(-1), -1);
    }
}
