//! Prometheus metrics of the dataplane, served at `GET /metrics` (text exposition, no key, like
//! `/health`): what a record's journey lost and why, the spool's backlog, and budget refusals.
//! Labels are closed sets of our own codes, never user input.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// Cheap to clone; every clone updates the same metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    records_dropped: Family<Reason, Counter>,
    records_dead_lettered: Counter,
    budget_refusals: Family<Reason, Counter>,
    spool_records: Gauge,
    spool_bytes: Gauge,
    budget_rules: Gauge,
    connections_closed: Family<Reason, Counter>,
    records_lost_in_crash: Counter,
    records_journal_replayed: Counter,
    otel_spans_dropped: Family<Reason, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("nm");
        let records_dropped = Family::<Reason, Counter>::default();
        registry.register(
            "records_dropped",
            "Request records lost before reaching the controlplane, by reason (queue_full, spool_full, spool_error, spool_undecodable)",
            records_dropped.clone(),
        );
        let records_dead_lettered = Counter::default();
        registry.register(
            "records_dead_lettered",
            "Request records the controlplane refused for good (invalid data), set aside in the dead-letter file beside the spool",
            records_dead_lettered.clone(),
        );
        let budget_refusals = Family::<Reason, Counter>::default();
        registry.register(
            "budget_refusals",
            "Requests refused with 429 budget_exceeded, by reason (spend, rate)",
            budget_refusals.clone(),
        );
        let spool_records = Gauge::default();
        registry.register(
            "spool_records",
            "Request records waiting in the on-disk spool for the controlplane",
            spool_records.clone(),
        );
        let spool_bytes = Gauge::default();
        registry.register(
            "spool_bytes",
            "Bytes of the on-disk record spool",
            spool_bytes.clone(),
        );
        let budget_rules = Gauge::default();
        registry.register(
            "budget_rules",
            "End-user budget rules (default and overrides) this dataplane enforces, as last received",
            budget_rules.clone(),
        );
        let connections_closed = Family::<Reason, Counter>::default();
        registry.register(
            "connections_closed",
            "Client connections the gateway closed itself, by reason (header_timeout: no request head in time; idle_timeout: no request in flight for the header timeout after serving some; shed: idle the longest when the connection cap was reached; refused: at the cap with none idle)",
            connections_closed.clone(),
        );
        let records_lost_in_crash = Counter::default();
        registry.register(
            "records_lost_in_crash",
            "Request records the previous run of this dataplane had accepted and neither delivered nor spooled when it died (NM_RECORD_DURABILITY=memory), learned at start",
            records_lost_in_crash.clone(),
        );
        let records_journal_replayed = Counter::default();
        registry.register(
            "records_journal_replayed",
            "Request records a previous run journaled (NM_RECORD_DURABILITY=spool) and had not shipped when it ended (a crash, or a shipper stopped first), replayed at start",
            records_journal_replayed.clone(),
        );
        let otel_spans_dropped = Family::<Reason, Counter>::default();
        registry.register(
            "otel_spans_dropped",
            "Spans not exported to the OpenTelemetry collector, by reason (queue_full: the export queue was full; export_failed: the collector refused or did not answer)",
            otel_spans_dropped.clone(),
        );
        Self {
            inner: Arc::new(Inner {
                otel_spans_dropped,
                records_lost_in_crash,
                records_journal_replayed,
                connections_closed,
                registry,
                records_dropped,
                records_dead_lettered,
                budget_refusals,
                spool_records,
                spool_bytes,
                budget_rules,
            }),
        }
    }
}

impl Metrics {
    pub fn records_dropped(&self, reason: &'static str, n: u64) {
        self.inner
            .records_dropped
            .get_or_create(&Reason { reason })
            .inc_by(n);
    }

    pub fn records_dead_lettered(&self, n: u64) {
        self.inner.records_dead_lettered.inc_by(n);
    }

    pub fn budget_refused(&self, reason: &'static str) {
        self.inner
            .budget_refusals
            .get_or_create(&Reason { reason })
            .inc();
    }

    pub fn set_spool(&self, records: u64, bytes: u64) {
        self.inner
            .spool_records
            .set(i64::try_from(records).unwrap_or(i64::MAX));
        self.inner
            .spool_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    pub fn set_budget_rules(&self, rules: usize) {
        self.inner
            .budget_rules
            .set(i64::try_from(rules).unwrap_or(i64::MAX));
    }

    /// Records a crash of the previous run lost (see [`crate::journal`]).
    pub fn records_lost_in_crash(&self, n: u64) {
        self.inner.records_lost_in_crash.inc_by(n);
    }

    /// Records a previous run left in the journal, replayed.
    pub fn records_journal_replayed(&self, n: u64) {
        self.inner.records_journal_replayed.inc_by(n);
    }

    /// A client connection closed by the gateway (see [`crate::conns`]).
    pub fn connection_closed(&self, reason: &'static str) {
        self.inner
            .connections_closed
            .get_or_create(&Reason { reason })
            .inc();
    }

    /// Spans the OpenTelemetry export lost.
    pub fn otel_spans_dropped(&self, reason: &'static str, n: u64) {
        self.inner
            .otel_spans_dropped
            .get_or_create(&Reason { reason })
            .inc_by(n);
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_gauges() {
        let m = Metrics::default();
        m.records_dropped("spool_full", 3);
        m.budget_refused("spend");
        m.set_spool(7, 4096);
        m.set_budget_rules(2);
        let text = m.render();
        assert!(
            text.contains(r#"nm_records_dropped_total{reason="spool_full"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"nm_budget_refusals_total{reason="spend"} 1"#),
            "{text}"
        );
        assert!(text.contains("nm_spool_records 7"), "{text}");
        assert!(text.contains("nm_spool_bytes 4096"), "{text}");
        assert!(text.contains("nm_budget_rules 2"), "{text}");
    }
}
