//! Export to a warehouse: one file per UTC day and kind (`records/2026-11-28.parquet`,
//! `signals/2026-11-28.jsonl`) written from the database, for DuckDB, Spark, BigQuery, ClickHouse
//! or anything else that reads Parquet or JSON lines (docs/export.md is the manual and the schema).
//!
//! What is read: the `requests` or `signals` rows whose time (`started_at_ms`, `received_at_ms`)
//! falls in the day, in pages of [`PAGE_ROWS`] by a keyset cursor (time, id): each page is one
//! indexed range query, so memory is bounded by a page plus one Parquet row group
//! ([`ROW_GROUP_ROWS`] rows), whatever the day holds, and the database is never asked to sort a
//! whole day.
//!
//! What is promised:
//! - The same rows in the same order (time, then id) give the same bytes: no export time, host or
//!   random value is written, in the rows or in the file's metadata. Re-running a day replaces its
//!   file with an identical one (given the same rows).
//! - A day's file appears whole or not at all: it is written to a `.partial` name beside it and
//!   renamed when complete (an interrupted run leaves the old file, or none, and a `.partial`
//!   the next run overwrites). An S3 destination uploads the finished file in one PUT (the root
//!   crate's `export::s3`).
//! - The schema is versioned ([`SCHEMA_VERSION`]): in each Parquet file's key-value metadata
//!   (`nm.schema` = `records/1`) and in each JSON line (`"nm_schema":"records/1"`). A column is
//!   only ever added under a new version; a version never changes meaning.
//!
//! What is never done: export anything but stored rows (no key material: `key_id` is the key's
//! public id), or hold a day in memory.

mod columns;
mod writer;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use chrono::{DateTime, Days, NaiveDate, Utc};
use sea_orm::{ColumnTrait, Condition, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::entity::{request, signal};

pub use columns::{Col, Ty, Val};
pub use writer::DayWriter;

/// The version of the exported columns (docs/export.md).
pub const SCHEMA_VERSION: u32 = 1;
/// Rows read from the database per query.
pub const PAGE_ROWS: u64 = 2_000;
/// Rows per Parquet row group: the most rows held in memory while writing Parquet.
pub const ROW_GROUP_ROWS: usize = 32_768;

/// What is exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Request records (`requests`).
    Records,
    /// Signals, explicit and implicit (`signals`).
    Signals,
}

impl Kind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "records" => Some(Self::Records),
            "signals" => Some(Self::Signals),
            _ => None,
        }
    }
    /// The folder name and the schema's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Records => "records",
            Self::Signals => "signals",
        }
    }
    pub fn columns(self) -> &'static [Col] {
        match self {
            Self::Records => columns::RECORDS,
            Self::Signals => columns::SIGNALS,
        }
    }
    /// `records/1`: the value of `nm.schema`.
    pub fn schema_tag(self) -> String {
        format!("{}/{SCHEMA_VERSION}", self.name())
    }
}

/// The file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Apache Parquet, snappy-compressed.
    Parquet,
    /// One JSON object per line (UTF-8, `\n`).
    Jsonl,
}

impl Format {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "parquet" => Some(Self::Parquet),
            "jsonl" => Some(Self::Jsonl),
            _ => None,
        }
    }
    pub fn extension(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::Jsonl => "jsonl",
        }
    }
}

/// What one day's export wrote.
#[derive(Clone, Debug)]
pub struct DayExport {
    pub day: NaiveDate,
    /// `records/2026-11-28.parquet`: the path relative to the destination.
    pub relative: String,
    /// The complete file (already renamed into place).
    pub path: PathBuf,
    pub rows: u64,
    pub bytes: u64,
}

/// The file name of one day, relative to the destination: `records/2026-11-28.parquet`.
pub fn relative_name(kind: Kind, format: Format, day: NaiveDate) -> String {
    format!(
        "{}/{}.{}",
        kind.name(),
        day.format("%Y-%m-%d"),
        format.extension()
    )
}

/// The UTC days from `since` (inclusive) to `until` (exclusive).
pub fn days(since: NaiveDate, until: NaiveDate) -> impl Iterator<Item = NaiveDate> {
    since.iter_days().take_while(move |d| *d < until)
}

fn day_bounds_ms(day: NaiveDate) -> Result<(i64, i64)> {
    let start = day
        .and_hms_opt(0, 0, 0)
        .ok_or_else(|| Error::InvalidArgument(format!("day {day} has no midnight")))?
        .and_utc()
        .timestamp_millis();
    let next = day
        .checked_add_days(Days::new(1))
        .ok_or_else(|| Error::InvalidArgument(format!("day {day} is out of range")))?;
    let end = next
        .and_hms_opt(0, 0, 0)
        .ok_or_else(|| Error::InvalidArgument(format!("day {next} has no midnight")))?
        .and_utc()
        .timestamp_millis();
    Ok((start, end))
}

/// Writes one day of `kind` into `dir` (`dir/records/2026-11-28.parquet`), replacing the file
/// that was there. Returns once the file is complete and in place.
pub fn export_day<'a>(
    store: &'a Store,
    kind: Kind,
    format: Format,
    dir: &'a Path,
    day: NaiveDate,
) -> crate::BoxFuture<'a, Result<DayExport>> {
    Box::pin(async move {
        let relative = relative_name(kind, format, day);
        let path = dir.join(&relative);
        let parent = path
            .parent()
            .ok_or_else(|| Error::InvalidArgument("export destination has no folder".into()))?
            .to_path_buf();
        let partial = parent.join(format!(
            ".{}.{}.partial",
            day.format("%Y-%m-%d"),
            format.extension()
        ));
        let (start, end) = day_bounds_ms(day)?;

        let open_partial = partial.clone();
        let mut writer = blocking(move || {
            std::fs::create_dir_all(&parent)?;
            DayWriter::create(&open_partial, kind, format)
        })
        .await?;

        let mut rows = 0u64;
        let mut cursor: Option<(i64, String)> = None;
        loop {
            let page = match kind {
                Kind::Records => records_page(store, start, end, cursor.as_ref()).await?,
                Kind::Signals => signals_page(store, start, end, cursor.as_ref()).await?,
            };
            let Some((at, id)) = page.last_key.clone() else {
                break;
            };
            let full = page.rows.len() as u64 == PAGE_ROWS;
            rows += page.rows.len() as u64;
            cursor = Some((at, id));
            writer = blocking(move || {
                writer.write(page.rows)?;
                Ok(writer)
            })
            .await?;
            if !full {
                break;
            }
        }

        let (from, to) = (partial, path.clone());
        let bytes = blocking(move || {
            writer.finish()?;
            let bytes = std::fs::metadata(&from)?.len();
            std::fs::rename(&from, &to)?;
            Ok(bytes)
        })
        .await?;
        Ok(DayExport {
            day,
            relative,
            path,
            rows,
            bytes,
        })
    })
}

/// The time of `t` as a UTC day.
pub fn utc_day(t: DateTime<Utc>) -> NaiveDate {
    t.date_naive()
}

struct Page {
    rows: Vec<Vec<Val>>,
    last_key: Option<(i64, String)>,
}

async fn records_page(
    store: &Store,
    start: i64,
    end: i64,
    after: Option<&(i64, String)>,
) -> Result<Page> {
    use request::Column as C;
    let models =
        page::<request::Entity>(store, (C::StartedAtMs, C::RequestId), (start, end), after).await?;
    let last_key = models
        .last()
        .map(|m| (m.started_at_ms, m.request_id.clone()));
    Ok(Page {
        rows: models.into_iter().map(columns::record_row).collect(),
        last_key,
    })
}

async fn signals_page(
    store: &Store,
    start: i64,
    end: i64,
    after: Option<&(i64, String)>,
) -> Result<Page> {
    use signal::Column as C;
    let models =
        page::<signal::Entity>(store, (C::ReceivedAtMs, C::Id), (start, end), after).await?;
    let last_key = models.last().map(|m| (m.received_at_ms, m.id.clone()));
    Ok(Page {
        rows: models.into_iter().map(columns::signal_row).collect(),
        last_key,
    })
}

/// One page of `E`'s rows of `[start, end)` by `time`, in (time, id) order, after the cursor.
async fn page<E: EntityTrait>(
    store: &Store,
    (time, id): (E::Column, E::Column),
    (start, end): (i64, i64),
    after: Option<&(i64, String)>,
) -> Result<Vec<E::Model>> {
    // The lower bound is the cursor's time, not the day's start: the index range then begins
    // at the cursor, and a page costs the same at the day's end as at its start.
    let from = after.map_or(start, |(at, _)| (*at).max(start));
    let mut q = E::find().filter(time.gte(from)).filter(time.lt(end));
    if let Some((at, last)) = after {
        q = q.filter(
            Condition::any()
                .add(time.gt(*at))
                .add(Condition::all().add(time.eq(*at)).add(id.gt(last.clone()))),
        );
    }
    Ok(q.order_by_asc(time)
        .order_by_asc(id)
        .limit(PAGE_ROWS)
        .all(store.conn())
        .await?)
}

/// Runs file work off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::result::Result<T, ExportIoError> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(|e| Error::Export(e.to_string())),
        Err(e) => Err(Error::Export(format!("export task failed: {e}"))),
    }
}

/// A file or encoding failure while writing an export.
#[derive(Debug, thiserror::Error)]
pub enum ExportIoError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}
