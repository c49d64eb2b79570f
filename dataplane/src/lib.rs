//! nm-gateway dataplane: the transparent provider proxy and the HTTP API next to it.
//!
//! The hot path never waits on a database or a network round trip of ours: keys are checked in
//! memory ([`keys::KeySet`]), request records leave through a bounded queue
//! ([`records::RecordSink`]). Signals ([`signal`]) wait for the controlplane's commit before
//! answering, through a [`SignalSink`]. The dataplane's side of the link is here too: the port
//! it needs, its watchers and its shipper ([`link`]), the record spool ([`spool`]) and journal
//! ([`journal`]); the root crate only picks the port's adapter (in process or gRPC). This crate
//! knows nothing of gRPC or SQL.

#![forbid(unsafe_code)]

pub mod attribution;
pub mod body;
pub mod budget;
pub mod conns;
pub mod edge;
pub mod error;
pub mod event;
pub mod experiment;
pub mod forward;
pub mod hot_path;
pub mod implicit;
pub mod journal;
pub mod keys;
pub mod layers;
pub mod link;
pub mod log;
pub mod metrics;
pub mod otel;
pub mod pace;
pub mod path;
pub mod pricing;
pub mod providers;
pub mod proxy;
pub mod records;
pub mod routes;
pub mod server;
pub mod signal;
pub mod spool;
pub mod stack;
pub mod state;
pub mod usage;
pub mod workers;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use error::ProxyError;
pub use keys::{Health, KeySet, Principal};
pub use link::{SignalSink, SubmitError, SubmitFuture};
pub use providers::{AuthStyle, ProviderSpec, Registry, WireFormat};
pub use records::{RecordQueue, RecordSink, RequestRecord};
pub use server::Drained;

/// Default request-body limit (images are big).
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// Everything the dataplane needs to run, already validated by the root's settings.
#[derive(Debug, Clone)]
pub struct DataplaneConfig {
    pub registry: Registry,
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    /// Time allowed for the upstream's response head.
    pub header_timeout: Duration,
    pub shutdown_grace: Duration,
    pub record_queue_capacity: usize,
    /// CA certificates trusted for upstream TLS beside the public web PKI.
    pub extra_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// Version reported by `/health`.
    pub version: &'static str,
    /// Model prices: the built-in table with the config's rows over it.
    pub prices: pricing::PriceTable,
    /// Answer length (tokens) assumed for a budget reservation when a request sets no cap.
    pub reserve_output_tokens: u64,
    /// Answer length (tokens) a token budget (per minute or period) reserves when a request
    /// sets no `max_tokens`.
    pub tpm_default_max_tokens: u64,
    /// Makes the verifiers the controlplane's key snapshots hold (from the link secret).
    pub key_verifier: nm_types::VerifierKey,
    /// Client connections: header timeout, cap, request-body pace ([`conns`], [`pace`]).
    pub conn_limits: conns::ConnLimits,
    /// Longest wait for the next frame of an upstream's answer ([`pace`]).
    pub upstream_idle_timeout: Duration,
    /// The hot path's per-thread mechanisms (all on but for benchmarks).
    pub hot_path: hot_path::HotPath,
    /// Exported spans ([`otel`]); None when tracing is off.
    pub tracing: Option<otel::Tracing>,
    /// The metrics `/metrics` serves (made by the root, which counts into them too).
    pub metrics: metrics::Metrics,
    /// Where access lines go ([`log`]); [`log::AccessLog::off`] for none.
    pub access_log: log::AccessLog,
    /// The implicit signals' rules, window and memory bounds.
    pub implicit: implicit::Settings,
}

/// Answer length assumed for a budget reservation when a request sets no `max_tokens`.
pub const DEFAULT_RESERVE_OUTPUT_TOKENS: u64 = 4096;
/// Default of `tpm_default_max_tokens`.
pub const DEFAULT_TPM_DEFAULT_MAX_TOKENS: u64 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
}

/// A dataplane ready to serve. Its key set and health are handles the root updates.
#[derive(Debug, Clone)]
pub struct Dataplane {
    state: Arc<stack::State>,
    grace: Duration,
}

impl Dataplane {
    /// Builds the dataplane and the queue its request records come out of.
    pub fn new(
        config: DataplaneConfig,
        signals: Arc<dyn SignalSink>,
    ) -> Result<(Self, RecordQueue), Error> {
        let metrics = config.metrics;
        let hot_path = config.hot_path;
        body::defer_completions(hot_path.deferred_completion);
        let (records, queue) = records::record_queue(config.record_queue_capacity, metrics.clone());
        let metrics_for_implicit = metrics.clone();
        let registry = Arc::new(config.registry);
        let state = stack::State {
            experiments: experiment::Experiments::new(registry.clone()),
            registry,
            keys: KeySet::with_cache(config.key_verifier, hot_path.key_cache),
            health: Health::default(),
            upstream: forward::Upstream::new(
                config.connect_timeout,
                config.header_timeout,
                &config.extra_roots,
                if hot_path.worker_pools {
                    workers::default_count()
                } else {
                    1
                },
            )?
            .with_body_idle_timeout(config.upstream_idle_timeout),
            conn_limits: config.conn_limits,
            records,
            signals,
            max_body_bytes: config.max_body_bytes,
            version: config.version,
            prices: Arc::new(config.prices),
            budgets: budget::Budgets::default(),
            metrics,
            reserve_output_tokens: config.reserve_output_tokens,
            tpm_default_max_tokens: config.tpm_default_max_tokens,
            hot_path,
            tracing: config.tracing,
            access_log: config.access_log,
            implicit: Arc::new(implicit::Implicit::new(
                config.implicit,
                metrics_for_implicit,
            )),
        };
        Ok((
            Self {
                state: Arc::new(state),
                grace: config.shutdown_grace,
            },
            queue,
        ))
    }

    pub fn keys(&self) -> &KeySet {
        &self.state.keys
    }

    /// The live experiments the root keeps current from the controlplane's key stream.
    pub fn experiments(&self) -> &experiment::Experiments {
        &self.state.experiments
    }

    pub fn health(&self) -> &Health {
        &self.state.health
    }

    pub fn records(&self) -> &RecordSink {
        &self.state.records
    }

    /// The dataplane's Prometheus metrics (served at `/metrics`).
    pub fn metrics(&self) -> &metrics::Metrics {
        &self.state.metrics
    }

    /// The end-user budget state the root keeps current from the controlplane's feed.
    pub fn budgets(&self) -> &budget::Budgets {
        &self.state.budgets
    }

    /// Serves on `listener` until `shutdown` completes, then drains. The future is built and
    /// boxed here, once ([`server::serve`]), so the crate awaiting it does not compile the proxy.
    pub fn serve(
        self,
        listener: TcpListener,
        shutdown: server::Shutdown,
    ) -> Pin<Box<dyn Future<Output = Drained> + Send>> {
        server::serve(listener, self.state, shutdown, self.grace)
    }
}
