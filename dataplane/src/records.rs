//! Request records: what the dataplane tells the controlplane about each proxied request.
//!
//! Records leave the request path through a bounded queue ([`RecordSink`]): handing one over is
//! a non-blocking `try_send`, so a slow or absent controlplane never slows a request. The link's
//! shipper (`link::shipper`) drains the queue ([`RecordQueue`]) and ships batches. If the queue
//! is full the record is dropped and counted (logged at each power of two, readable through
//! [`RecordSink::dropped`]). What a crash can lose of them, and the mode that loses nothing:
//! [`crate::journal`].

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use crate::journal::{self, Commit, Durability, Durable, Journal, Settler, Tally};
use crate::metrics::Metrics;
use crate::spool::{Spool, SpoolError};
use tokio::sync::mpsc;
use tracing::warn;

pub use nm_types::UsageStatus;
pub use nm_types::record::RequestRecord;

/// A record of a request that has just started: what is known before it is forwarded. The rest
/// is filled in as the request goes on. (The path is the one forwarded; the shipper shortens one
/// beyond the record's cap before it leaves the dataplane.)
pub fn started(
    request_id: String,
    started_at: SystemTime,
    key_id: Arc<str>,
    provider: Arc<str>,
    method: &http::Method,
    path: String,
) -> RequestRecord {
    RequestRecord {
        request_id,
        started_at_ms: unix_ms(started_at),
        key_id,
        provider,
        method: method_name(method),
        path,
        ..RequestRecord::default()
    }
}

/// A time as Unix milliseconds (0 before 1970), the unit of every time the link carries.
pub fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The method's name, without an allocation for the standard ones.
pub fn method_name(method: &http::Method) -> Cow<'static, str> {
    use http::Method as M;
    Cow::Borrowed(match *method {
        M::GET => "GET",
        M::POST => "POST",
        M::PUT => "PUT",
        M::DELETE => "DELETE",
        M::PATCH => "PATCH",
        M::HEAD => "HEAD",
        M::OPTIONS => "OPTIONS",
        _ => return Cow::Owned(method.as_str().to_owned()),
    })
}

/// Milliseconds of a duration, saturating.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The producing side of the record queue. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RecordSink {
    tx: mpsc::Sender<RequestRecord>,
    dropped: Arc<AtomicU64>,
    metrics: Metrics,
    tally: Arc<Tally>,
    /// Set once at start with `NM_RECORD_DURABILITY=spool` ([`crate::journal`]).
    journal: Arc<OnceLock<Journal>>,
}

/// The consuming side, drained by the link's shipper.
pub type RecordQueue = mpsc::Receiver<RequestRecord>;

/// A bounded record queue of `capacity` records.
pub fn record_queue(capacity: usize, metrics: Metrics) -> (RecordSink, RecordQueue) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    (
        RecordSink {
            tx,
            dropped: Arc::default(),
            metrics,
            tally: Arc::default(),
            journal: Arc::default(),
        },
        rx,
    )
}

impl RecordSink {
    /// Queues a record without waiting (in `spool` durability, hands it to the journal, whose
    /// thread queues it once it is on disk).
    pub fn send(&self, record: RequestRecord) {
        if let Some(journal) = self.journal.get() {
            self.tally.accept();
            journal.submit(record, false);
            return;
        }
        if self.tx.try_send(record).is_err() {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            self.metrics.records_dropped("queue_full", 1);
            if n.is_power_of_two() {
                warn!(
                    dropped_total = n,
                    "request record queue full or closed; record dropped"
                );
            }
        } else {
            self.tally.accept();
        }
    }

    /// Whether records are journaled before an answer ends (`NM_RECORD_DURABILITY=spool`).
    pub fn is_durable(&self) -> bool {
        self.journal.get().is_some()
    }

    /// Like [`send`](Self::send); in `spool` durability the returned [`Commit`] resolves once
    /// the record is on disk.
    pub fn commit(&self, record: RequestRecord) -> Option<Arc<Commit>> {
        match self.journal.get() {
            Some(journal) => {
                self.tally.accept();
                journal.submit(record, true)
            }
            None => {
                self.send(record);
                None
            }
        }
    }

    /// Records dropped so far because the queue was full or closed.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The shipper's handle for reporting records it is done with.
    pub fn settler(&self) -> Settler {
        Settler {
            tally: self.tally.clone(),
            journal: self.journal.clone(),
        }
    }

    /// At start, before the shipper runs: the crash accounting of this run and, in `spool`
    /// durability, the journal every record then goes through (see [`crate::journal`]). What
    /// the previous run left journaled is moved to `spool`. Blocking.
    pub fn start_durability(
        &self,
        dir: &Path,
        cap_bytes: u64,
        durability: Durability,
        spool: &mut Spool,
    ) -> Result<Durable, SpoolError> {
        let (durable, journal) = journal::start(
            dir,
            cap_bytes,
            durability,
            &self.metrics,
            self.tally.clone(),
            self.tx.clone(),
            spool,
        )?;
        if let Some(journal) = journal {
            let _ = self.journal.set(journal);
        }
        Ok(durable)
    }
}
