//! The record shipper: drains the dataplane's record queue into batches for the controlplane,
//! and never loses what it accepted without counting it.
//!
//! - Normally a batch (up to [`MAX_BATCH`] records and [`MAX_BATCH_BYTES`], lingering up to
//!   [`LINGER`] to fill) goes straight to the controlplane through the link's [`Port`].
//! - When a send fails for a reason that may pass (the controlplane is unreachable, its
//!   database is down, the link secret is wrong), the batch is appended to the on-disk
//!   [`Spool`] (fsynced), and from then on every new batch is appended behind it, so order is
//!   kept. The oldest spooled batch is retried with backoff; when it is stored, it is popped and
//!   the next one follows at once.
//! - What the controlplane refuses for good (invalid data: a record alone, or a whole batch) is
//!   set aside in the [`DeadLetters`] file and counted, and never blocks what follows it.
//! - At shutdown, what is queued is sent if the controlplane answers within
//!   [`FLUSH_DEADLINE`], else spooled: the next start replays it.
//! - A batch sent twice (a crash between the send and the pop) is stored once: records are keyed
//!   by request id.
//! - When the spool reaches its cap, it drops its oldest batches; the dropped records are counted
//!   in the dataplane's metrics and logged.
//! - Delivery problems are logged at WARN at most once per [`WARN_EVERY`] (the rest at debug).
//!
//! Spool and dead-letter operations are blocking file I/O with fsync, so they run on the
//! blocking pool.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nm_types::link::{decode_batch, encode_batch};
use nm_types::record::{RequestRecord, shorten_path};
use opentelemetry::context::FutureExt as _;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::dead_letter::DeadLetters;
use super::{Backoff, BatchSpans, Ingested, LinkError, Port};
use crate::RecordQueue;
use crate::budget::Budgets;
use crate::journal::Settler;
use crate::metrics::Metrics;
use crate::spool::{Spool, SpoolError, SpooledBatch};

/// Most records per batch.
pub const MAX_BATCH: usize = 1_000;
/// Most bytes per batch, by [`size_bound`]: well below the link's message limit
/// (the root's `grpc::MAX_LINK_MESSAGE_BYTES`), so no batch can be too large to send.
pub const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;
/// How often a delivery problem is logged at WARN; the rest go to debug.
pub const WARN_EVERY: Duration = Duration::from_secs(30);
/// How long the shipper waits for more records before sending a batch.
pub const LINGER: Duration = Duration::from_millis(50);
/// How long shutdown tries to deliver the last records before spooling them.
pub const FLUSH_DEADLINE: Duration = Duration::from_secs(10);

/// The spool, shared with the blocking pool.
#[derive(Debug, Clone)]
pub struct SharedSpool(Arc<Mutex<Spool>>);

impl SharedSpool {
    pub fn new(spool: Spool) -> Self {
        Self(Arc::new(Mutex::new(spool)))
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Spool) -> Result<T, SpoolError> + Send + 'static,
    ) -> Result<T, SpoolError> {
        let inner = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let mut spool = inner.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut spool)
        })
        .await
        .unwrap_or_else(|e| {
            Err(SpoolError::Io {
                op: "run spool task",
                path: Default::default(),
                source: std::io::Error::other(e.to_string()),
            })
        })
    }

    fn with<T>(&self, f: impl FnOnce(&Spool) -> T) -> T {
        f(&self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// An upper bound of a record's encoded size: the text it holds plus a fixed allowance for
/// the numbers and field tags (27 fields of at most 11 bytes of overhead each).
pub fn size_bound(r: &RequestRecord) -> usize {
    let opt = |s: Option<&str>| s.map_or(0, str::len);
    300 + r.request_id.len()
        + r.key_id.len()
        + r.provider.len()
        + r.method.len()
        + r.path.len()
        + opt(r.model.as_deref())
        + opt(r.agent.as_deref())
        + opt(r.session_id.as_ref().map(nm_types::SessionId::as_str))
        + opt(r.env.map(nm_types::Env::as_str))
        + opt(r.user_id.as_deref())
        + opt(r.error_code.as_deref())
        + opt(r.usage.model.as_deref())
        + opt(r.usage.finish_reason.as_deref())
}

/// A record as it leaves the dataplane: its path shortened to the record's cap (the request
/// itself was forwarded with the whole path).
fn leaving(mut r: RequestRecord) -> RequestRecord {
    shorten_path(&mut r.path);
    r
}

/// Cuts `records` into runs of at most [`MAX_BATCH`] records and [`MAX_BATCH_BYTES`].
fn chunks(records: &[RequestRecord]) -> Vec<&[RequestRecord]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, r) in records.iter().enumerate() {
        let size = size_bound(r);
        if i > start && (i - start == MAX_BATCH || bytes + size > MAX_BATCH_BYTES) {
            out.push(&records[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < records.len() {
        out.push(&records[start..]);
    }
    out
}

/// Drains `queue` until `stop` turns true and the queue is empty. Every record taken from it
/// is reported to `settler` once it is delivered, refused for good, spooled or counted as lost
/// (the crash ledger and the journal, [`crate::journal`]).
#[expect(
    clippy::too_many_arguments,
    reason = "the shipper's parts, named at its one call"
)]
pub async fn ship(
    port: Arc<dyn Port>,
    mut queue: RecordQueue,
    budgets: Budgets,
    spool: SharedSpool,
    dead_letters: DeadLetters,
    metrics: Metrics,
    settler: Settler,
    tracing: Option<BatchSpans>,
    mut stop: watch::Receiver<bool>,
) {
    let mut shipper = Shipper {
        port,
        tracing,
        budgets,
        spool,
        dead_letters,
        metrics,
        backoff: Backoff::default(),
        retry_at: Instant::now(),
        warned_at: None,
        quiet_failures: 0,
    };
    shipper.publish_spool_gauges();
    if !shipper.spool_empty() {
        info!(
            batches = shipper.spool.with(Spool::pending_batches),
            records = shipper.spool.with(Spool::pending_records),
            "replaying spooled request records"
        );
    }
    let mut batch: Vec<RequestRecord> = Vec::with_capacity(MAX_BATCH);
    loop {
        // Retry the spool's head when due; a success may be followed by more at once.
        if !shipper.spool_empty() && Instant::now() >= shipper.retry_at {
            shipper.send_spooled().await;
            continue;
        }
        // Wait for the first record of a batch, or until the spool's next retry.
        if batch.is_empty() {
            let wake = (!shipper.spool_empty()).then_some(shipper.retry_at);
            tokio::select! {
                received = queue.recv() => match received {
                    Some(r) => batch.push(leaving(r)),
                    None => break,
                },
                () = sleep_until(wake) => continue,
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        // Linger briefly so a busy dataplane sends few large batches: every batch is one database
        // transaction, and many small ones cost the controlplane far more than the rows do. The
        // linger is one sleep, not a wait per record: records arriving meanwhile queue up
        // without waking this task each time.
        let linger_until = Instant::now() + LINGER;
        take_queued(&mut queue, &mut batch);
        if batch.len() < MAX_BATCH {
            tokio::select! {
                () = tokio::time::sleep_until(linger_until) => {}
                _ = stop.wait_for(|s| *s) => {}
            }
            take_queued(&mut queue, &mut batch);
        }
        let records = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
        let n = records.len();
        if shipper.spool_empty() {
            if !shipper.send(&records).await {
                shipper.append(records).await;
            }
        } else {
            // Behind what is spooled already: keep the order.
            shipper.append(records).await;
        }
        settler.settled(n);
    }

    // Shutting down: the server has drained, so the queue holds everything there will be.
    queue.close();
    while let Ok(r) = queue.try_recv() {
        batch.push(leaving(r));
    }
    let deadline = Instant::now() + FLUSH_DEADLINE;
    while !shipper.spool_empty() && Instant::now() < deadline {
        if !shipper.send_spooled().await {
            break;
        }
    }
    let total = batch.len();
    while !batch.is_empty() {
        let rest = batch.split_off(batch.len().min(MAX_BATCH));
        let chunk = std::mem::replace(&mut batch, rest);
        let n = chunk.len();
        if !shipper.spool_empty() || Instant::now() >= deadline {
            shipper.append(chunk).await;
            settler.settled(n);
            continue;
        }
        // A send cut off by the deadline may still have been stored: spooling it too is
        // harmless (stored once per request id).
        match tokio::time::timeout_at(deadline, shipper.send(&chunk)).await {
            Ok(true) => {}
            Ok(false) | Err(_) => shipper.append(chunk).await,
        }
        settler.settled(n);
    }
    let spooled = shipper.spool.with(Spool::pending_records);
    if spooled > 0 {
        warn!(
            records = spooled,
            "controlplane unreachable at shutdown; request records stay spooled for the next start"
        );
    } else if total > 0 {
        info!(records = total, "delivered the last request records");
    }
}

/// Moves queued records into `batch`, up to [`MAX_BATCH`] records (its bytes are bounded when
/// it is sent, see [`chunks`]), without waiting.
fn take_queued(queue: &mut RecordQueue, batch: &mut Vec<RequestRecord>) {
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(r) => batch.push(leaving(r)),
            Err(_) => break,
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

struct Shipper {
    port: Arc<dyn Port>,
    /// A span for each delivered batch that holds traced records, linked to their requests.
    tracing: Option<BatchSpans>,
    budgets: Budgets,
    spool: SharedSpool,
    dead_letters: DeadLetters,
    metrics: Metrics,
    backoff: Backoff,
    retry_at: Instant,
    /// When a delivery problem was last logged at WARN, and how many failures since then went
    /// unreported at that level.
    warned_at: Option<Instant>,
    quiet_failures: u64,
}

impl Shipper {
    fn spool_empty(&self) -> bool {
        self.spool.with(Spool::is_empty)
    }

    /// Delivers `records` in chunks of bounded size; false when the controlplane did not take
    /// them all for a reason that may pass (the caller keeps them to retry). What it refuses for
    /// good is dead-lettered: those records are settled.
    async fn send(&mut self, records: &[RequestRecord]) -> bool {
        for chunk in chunks(records) {
            let traced = self.tracing.as_ref().and_then(|t| {
                t.batch(
                    "IngestRequests",
                    chunk.len(),
                    chunk.iter().filter_map(|r| r.trace),
                )
            });
            let ingested = match traced {
                Some(cx) => self.port.ingest(chunk).with_context(cx).await,
                None => self.port.ingest(chunk).await,
            };
            match ingested {
                Ok(ingested) => self.delivered(chunk, &ingested).await,
                Err(LinkError::Rejected(why)) => {
                    let refused: Vec<_> = chunk.iter().map(|r| (r, why.as_str())).collect();
                    self.dead_letter(&refused).await;
                }
                Err(e) => {
                    self.failed(&e, records.len());
                    return false;
                }
            }
        }
        true
    }

    /// Tries the oldest spooled batch; true when it was delivered (or unreadable and skipped).
    async fn send_spooled(&mut self) -> bool {
        let head = match self.spool.run(Spool::peek).await {
            Ok(Some(head)) => head,
            Ok(None) => return true,
            Err(e) => {
                error!(error = %e, "cannot read the record spool");
                self.retry_later();
                return false;
            }
        };
        let SpooledBatch { bytes, records } = head;
        let read = match decode_batch(&bytes) {
            Ok(read) => read,
            Err(e) => {
                // Frames are CRC-checked, so this is a batch of another version; it cannot be
                // sent as is, and keeping it would block every batch behind it.
                error!(error = %e, records, "spooled batch cannot be decoded; dropped");
                self.metrics
                    .records_dropped("spool_undecodable", u64::from(records));
                self.pop().await;
                return true;
            }
        };
        // Spooled records were typed when written, so each reads back; one that does not (a
        // file from another version) could never be stored: counted and logged, not retried.
        let total = read.len();
        let records: Vec<RequestRecord> = read
            .into_iter()
            .filter_map(|r| r.ok().map(leaving))
            .collect();
        if records.len() < total {
            let lost = (total - records.len()) as u64;
            error!(records = lost, "spooled records cannot be read; dropped");
            self.metrics.records_dropped("spool_undecodable", lost);
        }
        if self.send(&records).await {
            self.pop().await;
            true
        } else {
            false
        }
    }

    async fn pop(&mut self) {
        if let Err(e) = self.spool.run(Spool::pop).await {
            // The batch will be sent again; the controlplane stores it once.
            error!(error = %e, "cannot advance the record spool");
        }
        self.publish_spool_gauges();
    }

    async fn append(&mut self, records: Vec<RequestRecord>) {
        let n = records.len();
        let bytes = encode_batch(&records);
        let count = u32::try_from(n).unwrap_or(u32::MAX);
        let dropped_before = self.spool.with(Spool::dropped_records);
        match self.spool.run(move |s| s.append(&bytes, count)).await {
            Ok(()) => {
                let dropped = self.spool.with(Spool::dropped_records) - dropped_before;
                if dropped > 0 {
                    self.metrics.records_dropped("spool_full", dropped);
                    warn!(
                        dropped,
                        dropped_total = self.spool.with(Spool::dropped_records),
                        "record spool full: its oldest records were dropped"
                    );
                }
            }
            Err(e) => {
                self.metrics.records_dropped("spool_error", n as u64);
                error!(error = %e, records = n, "cannot spool request records; they are lost");
            }
        }
        self.publish_spool_gauges();
    }

    async fn delivered(&mut self, records: &[RequestRecord], ingested: &Ingested) {
        if !ingested.rejected.is_empty() {
            let refused: Vec<_> = ingested
                .rejected
                .iter()
                .filter_map(|(i, why)| Some((records.get(*i)?, why.as_str())))
                .collect();
            self.dead_letter(&refused).await;
        }
        let budgeted = records.iter().filter_map(|r| {
            r.budget_micros?;
            Some(r.request_id.as_str())
        });
        self.budgets
            .delivered(budgeted, ingested.epoch, ingested.seq);
        self.backoff.reset();
        self.retry_at = Instant::now();
    }

    /// Sets aside records the controlplane refused for good, and counts them.
    async fn dead_letter(&mut self, refused: &[(&RequestRecord, &str)]) {
        let n = refused.len() as u64;
        self.metrics.records_dead_lettered(n);
        let owned: Vec<(RequestRecord, String)> = refused
            .iter()
            .map(|(r, why)| ((*r).clone(), (*why).to_owned()))
            .collect();
        let first_reason = owned
            .first()
            .map(|(_, why)| why.clone())
            .unwrap_or_default();
        let file = self.dead_letters.clone();
        let at_ms = crate::records::unix_ms(std::time::SystemTime::now());
        let written = tokio::task::spawn_blocking(move || {
            let refs: Vec<_> = owned.iter().map(|(r, why)| (r, why.as_str())).collect();
            file.append(&refs, at_ms)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        if self.warn_due() {
            match written {
                Ok(()) => warn!(
                    records = n,
                    reason = %first_reason,
                    file = %self.dead_letters.path().display(),
                    "the controlplane refused request records for good; set aside in the dead-letter file"
                ),
                Err(e) => warn!(
                    records = n,
                    reason = %first_reason,
                    error = %e,
                    "the controlplane refused request records for good; the dead-letter file could not take them"
                ),
            }
        }
    }

    fn failed(&mut self, e: &LinkError, records: usize) {
        if self.warn_due() {
            warn!(
                error = %e,
                records,
                failures_since_last_report = self.quiet_failures,
                "request records not delivered; spooled, retrying with backoff"
            );
            self.quiet_failures = 0;
        } else {
            self.quiet_failures += 1;
            debug!(error = %e, records, "request records not delivered");
        }
        self.retry_later();
    }

    /// Whether a WARN line may be logged now (at most one per [`WARN_EVERY`]).
    fn warn_due(&mut self) -> bool {
        let now = Instant::now();
        if self.warned_at.is_some_and(|at| now < at + WARN_EVERY) {
            return false;
        }
        self.warned_at = Some(now);
        true
    }

    fn retry_later(&mut self) {
        self.retry_at = Instant::now() + self.backoff.next_delay();
    }

    fn publish_spool_gauges(&self) {
        let (records, bytes) = self.spool.with(|s| (s.pending_records(), s.bytes()));
        self.metrics.set_spool(records, bytes);
    }
}
