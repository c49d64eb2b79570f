//! Request records: what the dataplane tells the controlplane about each proxied request.
//!
//! Records leave the request path through a bounded queue ([`RecordSink`]): handing one over is
//! a non-blocking `try_send`, so a slow or absent controlplane never slows a request. The root
//! drains the queue ([`RecordQueue`]) and ships batches over gRPC. If the queue is full the record
//! is dropped and counted (logged at each power of two, readable through
//! [`RecordSink::dropped`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use nm_types::Env;

use crate::metrics::Metrics;
use crate::usage::Usage;
use tokio::sync::mpsc;
use tracing::warn;

/// One proxied request, as seen by the dataplane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// The `NM-Request-Id` the client received.
    pub request_id: String,
    pub started_at: SystemTime,
    pub key_id: Arc<str>,
    pub provider: Arc<str>,
    /// A standard method is held without an allocation.
    pub method: http::Method,
    /// Native path without the query string (queries may carry credentials).
    pub path: String,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub session_id: Option<String>,
    pub env: Option<Env>,
    pub user_id: Option<String>,
    pub status: u16,
    pub latency: Duration,
    pub ttfb: Option<Duration>,
    pub streamed: bool,
    /// Gateway error code, or `client_disconnected` / `upstream_body_error`.
    pub error_code: Option<&'static str>,
    pub response_bytes: u64,
    /// Tokens, answered model and finish reason, as the provider reported them.
    pub usage: Usage,
    pub usage_status: UsageStatus,
    /// Cost in micro-dollars, when the usage and the model's price are known.
    pub cost_micros: Option<u64>,
    /// What the request counted against its end user's budget (None: not budgeted).
    pub budget_micros: Option<u64>,
}

pub use nm_types::UsageStatus;

impl RequestRecord {
    /// A record of a request that has just started: what is known before it is forwarded. The
    /// rest is filled in as the request goes on.
    pub fn started(
        request_id: String,
        started_at: SystemTime,
        key_id: Arc<str>,
        provider: Arc<str>,
        method: http::Method,
        path: String,
    ) -> Self {
        Self {
            request_id,
            started_at,
            key_id,
            provider,
            method,
            path,
            model: None,
            agent: None,
            session_id: None,
            env: None,
            user_id: None,
            status: 0,
            latency: Duration::ZERO,
            ttfb: None,
            streamed: false,
            error_code: None,
            response_bytes: 0,
            usage: Usage::default(),
            usage_status: UsageStatus::default(),
            cost_micros: None,
            budget_micros: None,
        }
    }
}

/// The producing side of the record queue. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RecordSink {
    tx: mpsc::Sender<RequestRecord>,
    dropped: Arc<AtomicU64>,
    metrics: Metrics,
}

/// The consuming side, drained by the root's shipper.
pub type RecordQueue = mpsc::Receiver<RequestRecord>;

/// A bounded record queue of `capacity` records.
pub fn record_queue(capacity: usize, metrics: Metrics) -> (RecordSink, RecordQueue) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    (
        RecordSink {
            tx,
            dropped: Arc::default(),
            metrics,
        },
        rx,
    )
}

impl RecordSink {
    /// Queues a record without waiting.
    pub fn send(&self, record: RequestRecord) {
        if self.tx.try_send(record).is_err() {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            self.metrics.records_dropped("queue_full", 1);
            if n.is_power_of_two() {
                warn!(
                    dropped_total = n,
                    "request record queue full or closed; record dropped"
                );
            }
        }
    }

    /// Records dropped so far because the queue was full or closed.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
