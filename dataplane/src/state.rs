//! What every handler shares: the dataplane's [`State`]. Its own module so that the handlers
//! ([`crate::proxy`], [`crate::signal`]) and the stack that routes to them ([`crate::stack`])
//! all read it without importing each other.

use std::sync::Arc;

use crate::event::{SinkHandles, Sinks};
use crate::forward::Upstream;
use crate::keys::{Health, KeySet};
use crate::link::SignalSink;
use crate::providers::Registry;
use crate::records::RecordSink;

/// Everything a request handler needs. Shared, read-only apart from the key set and health.
#[derive(Debug)]
pub struct State {
    pub registry: Arc<Registry>,
    /// The live experiments ([`crate::experiment`]), kept current by the key watcher.
    pub experiments: crate::experiment::Experiments,
    pub keys: KeySet,
    pub health: Health,
    pub upstream: Upstream,
    pub records: RecordSink,
    pub signals: Arc<dyn SignalSink>,
    pub max_body_bytes: usize,
    pub version: &'static str,
    pub prices: Arc<crate::pricing::PriceTable>,
    pub budgets: crate::budget::Budgets,
    pub metrics: crate::metrics::Metrics,
    /// Answer length assumed for a budget reservation when the request sets no cap.
    pub reserve_output_tokens: u64,
    /// Answer length (tokens) a token budget reserves when the request sets no `max_tokens`.
    pub tpm_default_max_tokens: u64,
    /// Client connection limits (header timeout, cap, request-body pace).
    pub conn_limits: crate::conns::ConnLimits,
    /// The per-thread mechanisms in force ([`crate::hot_path`]).
    pub hot_path: crate::hot_path::HotPath,
    /// Exported spans ([`crate::otel`]); None when tracing is off.
    pub tracing: Option<crate::otel::Tracing>,
    /// One line per proxied request ([`crate::log`]).
    pub access_log: crate::log::AccessLog,
    /// The implicit rules and their memory ([`crate::implicit`]).
    pub implicit: Arc<crate::implicit::Implicit>,
}

impl State {
    /// Where a request's end goes ([`crate::event`]).
    pub fn sinks(&self) -> Sinks<'_> {
        Sinks {
            records: &self.records,
            prices: &self.prices,
            metrics: &self.metrics,
            log: &self.access_log,
            implicit: &self.implicit,
        }
    }

    /// The same, for an answer body to carry to its end.
    pub fn sink_handles(&self) -> SinkHandles {
        SinkHandles {
            records: self.records.clone(),
            prices: self.prices.clone(),
            metrics: self.metrics.clone(),
            log: self.access_log.clone(),
            implicit: self.implicit.clone(),
        }
    }
}
