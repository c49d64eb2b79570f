//! The record shipper: drains the dataplane's record queue into `IngestRequests` batches, and
//! never loses what it accepted.
//!
//! - Normally a batch (up to [`MAX_BATCH`] records, lingering up to [`LINGER`] to fill) goes
//!   straight to the controlplane.
//! - When a send fails, the batch is appended to the on-disk [`Spool`] (fsynced), and from then
//!   on every new batch is appended behind it, so order is kept. The oldest spooled batch is
//!   retried with backoff; when it is stored, it is popped and the next one follows at once.
//! - At shutdown, what is queued is sent if the controlplane answers within
//!   [`FLUSH_DEADLINE`], else spooled: the next start replays it.
//! - A batch sent twice (a crash between the send and the pop) is stored once: records are keyed
//!   by request id.
//! - When the spool reaches its cap, it drops its oldest batches; the dropped records are counted
//!   in the dataplane's metrics and logged.
//!
//! Spool operations are blocking file I/O with fsync, so they run on the blocking pool.
//!
//! Batches go to a [`Destination`]: the controlplane's `IngestRequests` over gRPC, or, when
//! `nm-gateway serve` runs both halves in one process, the same ingest called in process (no
//! protobuf encoding, HTTP/2 or loopback socket per batch; the spool works the same either way).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nm_dataplane::RecordQueue;
use nm_dataplane::budget::Budgets;
use nm_dataplane::metrics::Metrics;
use nm_dataplane::spool::{Spool, SpoolError, SpooledBatch};
use prost::Message;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::transport::Channel;
use tracing::{debug, error, info, warn};

use nm_controlplane::{Records, RequestRecord};

use super::convert::{record_from_pb, record_to_pb, record_to_stored};
use super::pb::{self, dataplane_client::DataplaneClient};
use super::status::to_status;

/// Most records per `IngestRequests` call.
pub const MAX_BATCH: usize = 1_000;
/// How long the shipper waits for more records before sending a batch.
pub const LINGER: Duration = Duration::from_millis(50);
/// How long shutdown tries to deliver the last records before spooling them.
pub const FLUSH_DEADLINE: Duration = Duration::from_secs(10);
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

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

/// Where record batches are delivered.
#[derive(Debug, Clone)]
pub enum Destination {
    /// A controlplane in another process, over gRPC.
    Remote(DataplaneClient<Channel>),
    /// The controlplane of this process (`nm-gateway serve`).
    Local(Records),
}

/// The budget feed position a stored batch's spend is part of (epoch, seq).
type FeedPosition = (u64, u64);

impl Destination {
    /// Stores a batch. The records stay the caller's, so a batch that is not stored can be
    /// spooled, and one that is can settle its budget reservations, without a copy: in process
    /// they are stored as they are; to a remote controlplane they are encoded.
    async fn ingest(&mut self, batch: &[RequestRecord]) -> Result<FeedPosition, tonic::Status> {
        match self {
            Self::Remote(client) => {
                let records = batch.iter().cloned().map(record_to_pb).collect();
                let resp = client
                    .ingest_requests(pb::IngestRequestsRequest { records })
                    .await?
                    .into_inner();
                Ok((resp.epoch, resp.seq))
            }
            Self::Local(records) => {
                let outcome = records.ingest(batch).await.map_err(to_status)?;
                Ok((outcome.epoch, outcome.seq))
            }
        }
    }
}

/// Drains `queue` until `stop` turns true and the queue is empty.
pub async fn ship(
    mut destination: Destination,
    mut queue: RecordQueue,
    budgets: Budgets,
    spool: SharedSpool,
    metrics: Metrics,
    mut stop: watch::Receiver<bool>,
) {
    let mut shipper = Shipper {
        budgets,
        spool,
        metrics,
        backoff: MIN_BACKOFF,
        retry_at: Instant::now(),
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
            shipper.send_spooled(&mut destination).await;
            continue;
        }
        // Wait for the first record of a batch, or until the spool's next retry.
        if batch.is_empty() {
            let wake = (!shipper.spool_empty()).then_some(shipper.retry_at);
            tokio::select! {
                received = queue.recv() => match received {
                    Some(r) => batch.push(record_to_stored(r)),
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
        if shipper.spool_empty() {
            if !shipper.send(&mut destination, &records).await {
                shipper.append(records).await;
            }
        } else {
            // Behind what is spooled already: keep the order.
            shipper.append(records).await;
        }
    }

    // Shutting down: the server has drained, so the queue holds everything there will be.
    queue.close();
    while let Ok(r) = queue.try_recv() {
        batch.push(record_to_stored(r));
    }
    let deadline = Instant::now() + FLUSH_DEADLINE;
    while !shipper.spool_empty() && Instant::now() < deadline {
        if !shipper.send_spooled(&mut destination).await {
            break;
        }
    }
    let total = batch.len();
    while !batch.is_empty() {
        let rest = batch.split_off(batch.len().min(MAX_BATCH));
        let chunk = std::mem::replace(&mut batch, rest);
        if !shipper.spool_empty() || Instant::now() >= deadline {
            shipper.append(chunk).await;
            continue;
        }
        // A send cut off by the deadline may still have been stored: spooling it too is
        // harmless (stored once per request id).
        match tokio::time::timeout_at(deadline, shipper.send(&mut destination, &chunk)).await {
            Ok(true) => {}
            Ok(false) | Err(_) => shipper.append(chunk).await,
        }
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

/// Moves queued records into `batch`, up to [`MAX_BATCH`], without waiting.
fn take_queued(queue: &mut RecordQueue, batch: &mut Vec<RequestRecord>) {
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(r) => batch.push(record_to_stored(r)),
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
    budgets: Budgets,
    spool: SharedSpool,
    metrics: Metrics,
    backoff: Duration,
    retry_at: Instant,
}

impl Shipper {
    fn spool_empty(&self) -> bool {
        self.spool.with(Spool::is_empty)
    }

    /// Sends one batch; false when the controlplane did not take it.
    async fn send(&mut self, destination: &mut Destination, records: &[RequestRecord]) -> bool {
        match destination.ingest(records).await {
            Ok(position) => {
                self.delivered(records, position);
                true
            }
            Err(status) => {
                debug!(code = ?status.code(), message = status.message(), records = records.len(), "record delivery failed; spooling");
                self.failed();
                false
            }
        }
    }

    /// Tries the oldest spooled batch; true when it was delivered (or unreadable and skipped).
    async fn send_spooled(&mut self, destination: &mut Destination) -> bool {
        let head = match self.spool.run(Spool::peek).await {
            Ok(Some(head)) => head,
            Ok(None) => return true,
            Err(e) => {
                error!(error = %e, "cannot read the record spool");
                self.failed();
                return false;
            }
        };
        let SpooledBatch { bytes, records } = head;
        let req = match pb::IngestRequestsRequest::decode(bytes.as_slice()) {
            Ok(req) => req,
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
        let records: Vec<RequestRecord> = req.records.into_iter().map(record_from_pb).collect();
        match destination.ingest(&records).await {
            Ok(position) => {
                self.delivered(&records, position);
                self.pop().await;
                true
            }
            Err(status) => {
                debug!(code = ?status.code(), "spooled batch not delivered yet");
                self.failed();
                false
            }
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
        let records = records.into_iter().map(record_to_pb).collect();
        let bytes = pb::IngestRequestsRequest { records }.encode_to_vec();
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

    fn delivered(&mut self, records: &[RequestRecord], (epoch, seq): FeedPosition) {
        let budgeted = records.iter().filter_map(|r| {
            r.budget_micros?;
            Some((r.user_id.as_deref()?, r.request_id.as_str()))
        });
        self.budgets.delivered(budgeted, epoch, seq);
        self.backoff = MIN_BACKOFF;
        self.retry_at = Instant::now();
    }

    fn failed(&mut self) {
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    fn publish_spool_gauges(&self) {
        let (records, bytes) = self.spool.with(|s| (s.pending_records(), s.bytes()));
        self.metrics.set_spool(records, bytes);
    }
}
