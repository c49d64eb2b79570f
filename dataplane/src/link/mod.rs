//! The dataplane's side of the link to its controlplane: the port it needs ([`Port`]) for the
//! four flows, and the code that runs them, written once against the port.
//!
//! | flow | direction | type |
//! |---|---|---|
//! | key snapshots | controlplane → dataplane, a stream with heartbeats | [`KeyVerifiers`] |
//! | budget feed | controlplane → dataplane, a stream with heartbeats | [`Feed`] |
//! | request records | dataplane → controlplane, batches | [`RequestRecord`] |
//! | signals | dataplane → controlplane, one at a time, answered after the commit | [`Signal`] |
//!
//! - [`watch`]: the key and budget watchers, and [`watch::PortSignals`], the [`SignalSink`]
//!   that hands each signal to the port;
//! - [`shipper`]: the record shipper, with the on-disk [`Spool`](crate::spool::Spool) (its
//!   batches stored as the link's `IngestRequests` message, `nm_types::link`) and the
//!   [`dead_letter`] file;
//! - [`trace`]: the spans of the batches that carry traced records.
//!
//! The adapters live in the root crate, which composes the process: the in-process one (`serve`)
//! calls the controlplane crate, the gRPC one a controlplane in another process. The rules every
//! record and signal passes are the controlplane's, whatever adapter brought them; this crate
//! never depends on the controlplane crate.
//!
//! [`SignalSink`]: SignalSink

mod backoff;
pub mod dead_letter;
pub mod shipper;
pub mod trace;
pub mod watch;

pub use backoff::Backoff;
pub use trace::BatchSpans;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use nm_types::KeyVerifiers;
use nm_types::budget::{Feed, LeaseRequest, LeaseResponse};
use nm_types::record::RequestRecord;
use nm_types::signal::Signal;
use tokio::sync::watch as signal;
use tokio::task::JoinHandle;
use tokio_stream::Stream;

use crate::RecordQueue;
use crate::budget::Budgets;
use crate::metrics::Metrics;
use crate::{Health, KeySet};

/// A stream from the controlplane; an item error ends it.
pub type LinkStream<T> = Pin<Box<dyn Stream<Item = Result<T, LinkError>> + Send>>;

/// Why a link call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The controlplane could not be reached or could not store it now: try again later.
    #[error("controlplane unavailable: {0}")]
    Unavailable(String),
    /// The controlplane refused the data for breaking a rule: sending it again cannot help.
    #[error("refused by the controlplane: {0}")]
    Rejected(String),
    /// The controlplane does not accept this dataplane (a wrong or missing link secret, or a
    /// client certificate it does not trust).
    #[error("not accepted by the controlplane: {0}")]
    Unauthenticated(String),
    /// The call may have been carried out, but its answer was lost (the link broke mid-call, or
    /// the controlplane gave no answer in time): its outcome is unknown.
    #[error("no answer from the controlplane: {0}")]
    Unconfirmed(String),
    /// A signal named both a session and a request the controlplane knows under another
    /// session: not stored, and sending it again cannot help.
    #[error("refused by the controlplane: {0}")]
    SessionMismatch(String),
}

/// What the controlplane did with a batch of records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ingested {
    /// The budget feed position that includes this batch's spend.
    pub epoch: u64,
    pub seq: u64,
    /// Records refused for breaking a rule: (index in the batch, the rule).
    pub rejected: Vec<(usize, String)>,
}

/// The four flows between a dataplane and its controlplane.
#[async_trait::async_trait]
pub trait Port: fmt::Debug + Send + Sync + 'static {
    /// The valid keys: a snapshot at once, then on every change and as a heartbeat.
    async fn watch_keys(&self, dataplane: &str) -> Result<LinkStream<KeyVerifiers>, LinkError>;

    /// The budget feed: a full state at once, then deltas and heartbeats.
    async fn watch_budgets(&self, dataplane: &str) -> Result<LinkStream<Feed>, LinkError>;

    /// One lease round: reports this dataplane's claims on budgets and returns the grants.
    async fn lease(&self, request: &LeaseRequest) -> Result<LeaseResponse, LinkError>;

    /// Stores a batch of records (each once per request id; a resent batch is harmless).
    async fn ingest(&self, batch: &[RequestRecord]) -> Result<Ingested, LinkError>;

    /// Stores one signal; resolves after the commit. Its commit must begin within
    /// `commit_within`, or it is not stored. Any error but [`LinkError::Unconfirmed`] means it
    /// was not stored.
    async fn record_signal(
        &self,
        signal: Signal,
        commit_within: std::time::Duration,
    ) -> Result<SessionSpans, LinkError>;
}

/// The exported spans of a signal's session's latest requests (empty unless the call was traced).
pub type SessionSpans = Vec<nm_types::record::TraceRef>;

/// The dataplane state the link keeps current, and where its records wait.
#[derive(Debug, Clone)]
pub struct LinkTargets {
    pub keys: KeySet,
    /// The live experiments, replaced with every key snapshot.
    pub experiments: crate::experiment::Experiments,
    pub health: Health,
    pub budgets: Budgets,
    pub metrics: Metrics,
    /// Where records wait while the controlplane is unreachable.
    pub spool: shipper::SharedSpool,
    /// Where records the controlplane refused for good are set aside.
    pub dead_letters: dead_letter::DeadLetters,
    /// Told of every record the shipper is done with (crash ledger, journal).
    pub settler: crate::journal::Settler,
    /// Spans for the batches of traced records (tracing on).
    pub tracing: Option<BatchSpans>,
}

/// The dataplane's side of the link, running: the key and budget watchers and the record
/// shipper. [`Link::stop`] flushes the queued records and ends all three.
#[derive(Debug)]
pub struct Link {
    stop: signal::Sender<bool>,
    key_watcher: JoinHandle<()>,
    budget_watcher: JoinHandle<()>,
    lease_keeper: JoinHandle<()>,
    shipper: JoinHandle<()>,
}

impl Link {
    pub fn spawn(
        port: Arc<dyn Port>,
        targets: LinkTargets,
        queue: RecordQueue,
        name: String,
    ) -> Self {
        let (stop, stop_rx) = signal::channel(false);
        let key_watcher = tokio::spawn(watch::watch_keys(
            port.clone(),
            targets.keys,
            targets.experiments,
            targets.health.clone(),
            name.clone(),
            stop_rx.clone(),
        ));
        let budget_watcher = tokio::spawn(watch::watch_budgets(
            port.clone(),
            targets.budgets.clone(),
            targets.health,
            targets.metrics.clone(),
            name.clone(),
            stop_rx.clone(),
        ));
        let lease_keeper = tokio::spawn(watch::keep_leases(
            port.clone(),
            targets.budgets.clone(),
            name,
            stop_rx.clone(),
        ));
        let shipper = tokio::spawn(shipper::ship(
            port,
            queue,
            targets.budgets,
            targets.spool,
            targets.dead_letters,
            targets.metrics,
            targets.settler,
            targets.tracing,
            stop_rx,
        ));
        Self {
            stop,
            key_watcher,
            budget_watcher,
            lease_keeper,
            shipper,
        }
    }

    /// Stops watching, delivers or spools what is queued, and returns.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        self.key_watcher.abort();
        self.budget_watcher.abort();
        self.lease_keeper.abort();
        let _ = self.shipper.await;
    }
}

/// Why the controlplane did not store a signal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Not stored; the client may retry.
    #[error("{0}")]
    Unavailable(String),
    /// Refused for breaking a rule (the dataplane's own checks should have caught it).
    #[error("{0}")]
    Rejected(String),
    /// No answer in time: the signal was being committed when the wait ended (or the answer
    /// was lost), so it may have been stored.
    #[error("{0}")]
    Unconfirmed(String),
    /// Not stored: the signal names a request the controlplane knows under another session.
    #[error("{0}")]
    SessionMismatch(String),
}

/// Resolves once the signal is committed, with the exported spans of its session's latest
/// requests when the call was traced (its span links to them).
pub type SubmitFuture =
    Pin<Box<dyn Future<Output = Result<Vec<nm_types::record::TraceRef>, SubmitError>> + Send>>;

/// Where accepted signals go: the link's port ([`watch::PortSignals`]).
pub trait SignalSink: fmt::Debug + Send + Sync + 'static {
    /// Resolves once the signal is durably stored.
    fn submit(&self, signal: Signal) -> SubmitFuture;
}
