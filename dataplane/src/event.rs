//! The end-of-request event: one value per proxied request ([`RequestEvent`]), filled as the
//! request goes and turned, once, when the request ends, into everything the gateway says about
//! it ([`RequestEvent::end`]):
//!
//! | sink | what it gets |
//! |---|---|
//! | the request record ([`crate::records`]) | the event's record, with usage, cost and timings |
//! | the budget ([`crate::budget`]) | the reservation, settled at the request's cost |
//! | the exported spans ([`crate::otel`]) | the CLIENT span's answer and end, the SERVER span's outcome |
//! | the metrics ([`crate::metrics`]) | GenAI operation, HTTP server duration, gateway overhead, budget refusals |
//! | the access log ([`crate::log`]) | one `request completed` line, written from the record |
//! | the implicit rules ([`crate::implicit`]) | `client_disconnect` on the record; what the answer leaves for the session's next request |
//!
//! A request ends one of three ways ([`Ending`]): its answer passed through to its end, it was
//! cut short (the upstream broke off, the client went away), or the gateway answered it itself
//! with an error. Nothing in the middle of a request writes to a sink: the proxy
//! ([`crate::proxy`]) only fills the event. Requests refused before their key and provider are
//! known (no key, an unknown provider) have no event and no record; the rescue layer logs them.
//!
//! Where it lives: the proxy's handler builds it; once an answer arrives it moves into the answer
//! body's tracked state ([`crate::body`]), the allocation each proxied answer already has, and
//! ends when the body does. Ending it formats nothing a sink does not need: the access line is
//! written once, from the record, and only when the log filter lets it through. A refused
//! request's fields go on its `request` span ([`crate::log::RequestLog`]) instead, for the rescue
//! layer's error line.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::budget::Reservation;
use crate::implicit::{Implicit, Pending};
use crate::journal::Commit;
use crate::log::{AccessLine, AccessLog, RequestLog};
use crate::metrics::{Metrics, Operation};
use crate::otel::{End, Outcome, RequestTrace};
use crate::pricing::{Cost, Found, PriceTable};
use crate::providers::Provider;
use crate::records::{self, RecordSink, RequestRecord, UsageStatus};
use crate::routes::Route;

/// How a proxied request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The answer passed through to its end.
    Complete,
    /// The upstream broke off its answer (or stalled, [`crate::pace`]).
    UpstreamError,
    /// The client went away before the answer's end.
    ClientGone,
    /// The gateway answered with an error of its own; nothing of an upstream answer reached the
    /// client.
    Refused { status: u16, code: &'static str },
}

impl Ending {
    /// Whether an upstream answer reached the client (complete or cut short).
    fn answered(self) -> bool {
        !matches!(self, Ending::Refused { .. })
    }
}

/// What the trace layer ([`crate::layers::trace`]) opens for every request, as a request
/// extension: the request's log span, its route (classified once, there), and with tracing on
/// its exported spans. The layers below read the route; a handler takes the rest.
#[derive(Debug, Clone)]
pub struct RequestStart {
    /// The request's `request` span, of its log lines.
    pub log: RequestLog,
    pub route: Route,
    pub trace: Option<RequestTrace>,
}

impl RequestStart {
    /// The route of a request, as the trace layer classified it (classified here outside the
    /// full stack, in unit tests).
    pub fn route_of<B>(req: &http::Request<B>) -> Route {
        req.extensions()
            .get::<RequestStart>()
            .map_or_else(|| Route::of(req.uri().path()), |s| s.route)
    }
}

/// Where a finished event goes: the record queue, the prices its cost is read from, the
/// metrics, the access log.
#[derive(Debug, Clone, Copy)]
pub struct Sinks<'a> {
    pub records: &'a RecordSink,
    pub prices: &'a PriceTable,
    pub metrics: &'a Metrics,
    pub log: &'a AccessLog,
    /// The implicit rules' memory: what the answer leaves for the session's next request.
    pub implicit: &'a Implicit,
}

/// The same, owned: what an answer body carries to its end (handles cloned from the state).
#[derive(Debug, Clone)]
pub struct SinkHandles {
    pub records: RecordSink,
    pub prices: Arc<PriceTable>,
    pub metrics: Metrics,
    pub log: AccessLog,
    pub implicit: Arc<Implicit>,
}

impl SinkHandles {
    pub fn sinks(&self) -> Sinks<'_> {
        Sinks {
            records: &self.records,
            prices: &self.prices,
            metrics: &self.metrics,
            log: &self.log,
            implicit: &self.implicit,
        }
    }
}

/// One proxied request, as far as it has got.
#[derive(Debug)]
pub struct RequestEvent {
    /// What the controlplane will be told: key, provider, path, attribution, model, status;
    /// usage, cost and timings once the request ends.
    pub record: RequestRecord,
    pub provider: Arc<Provider>,
    /// `http.route`: the matched template ([`Route::template`]).
    pub route: &'static str,
    pub started: Instant,
    /// The request's `request` span, of its log lines ([`crate::log::request`]).
    pub log: RequestLog,
    /// The request's exported spans (tracing on).
    pub trace: Option<RequestTrace>,
    /// The end user's budget hold, settled when the request ends.
    pub reservation: Option<Reservation>,
    /// The price the budget's reservation was estimated at: the one for the record's model at
    /// its provider, found once a budget applied ([`Found`]). The answer's cost reuses it.
    pub reserved_price: Option<Found>,
    /// Time spent on the gateway's side up to the answer's head (the wait on the provider left
    /// out); None until an answer's head arrived.
    pub overhead: Option<Duration>,
    /// When the answer's first bytes passed.
    pub first_byte: Option<Instant>,
    /// The answer's bytes passed so far.
    pub bytes: u64,
    /// The budget limit that refused the request (`spend`, `rate`), if one did.
    pub budget_refused: Option<&'static str>,
    /// The answer's first bytes, when content is captured for its span
    /// (`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`).
    pub captured: Option<Vec<u8>>,
    /// The implicit rules on for the request and what they carry to its end
    /// ([`crate::implicit`]); None when every rule is off.
    pub implicit: Option<Pending>,
    /// The answer's text as the implicit rules keep it, when they read it.
    pub answer_text: Option<crate::usage::text::Digest>,
}

impl RequestEvent {
    /// The event of a request whose key and provider are known.
    pub fn new(
        record: RequestRecord,
        provider: Arc<Provider>,
        route: &'static str,
        started: Instant,
        log: RequestLog,
        trace: Option<RequestTrace>,
    ) -> Self {
        Self {
            record,
            provider,
            route,
            started,
            log,
            trace,
            reservation: None,
            reserved_price: None,
            overhead: None,
            first_byte: None,
            bytes: 0,
            budget_refused: None,
            captured: None,
            implicit: None,
            answer_text: None,
        }
    }

    /// Ends the request at `ended`, with the usage the answer reported (default when none was
    /// read), and writes every sink. With `wait`, in `spool` durability, returns the journal's
    /// [`Commit`] to wait on before the answer may end.
    pub fn end(
        mut self,
        ending: Ending,
        ended: Instant,
        usage: nm_types::Usage,
        sinks: Sinks<'_>,
        wait: bool,
    ) -> Option<Arc<Commit>> {
        self.complete_record(ending, ended, usage, sinks.prices);
        self.implicit(ending, sinks.implicit, sinks.metrics);
        self.settle(ending);
        self.record_metrics(ending, ended, sinks.metrics);
        self.end_spans(ending, ended);
        self.log(ending, sinks.log);
        if wait {
            return sinks.records.commit(self.record);
        }
        sinks.records.send(self.record);
        None
    }

    /// The record's end: timings, error code, usage and its status, cost.
    fn complete_record(
        &mut self,
        ending: Ending,
        ended: Instant,
        usage: nm_types::Usage,
        prices: &PriceTable,
    ) {
        let r = &mut self.record;
        r.latency_ms = records::millis(ended.duration_since(self.started));
        if let Ending::Refused { status, code } = ending {
            r.status = status;
            r.error_code = Some(Cow::Borrowed(code));
            return;
        }
        r.ttfb_ms = self
            .first_byte
            .map(|t| records::millis(t.duration_since(self.started)));
        r.response_bytes = self.bytes;
        r.error_code = match ending {
            Ending::UpstreamError => Some(Cow::Borrowed("upstream_body_error")),
            Ending::ClientGone => Some(Cow::Borrowed("client_disconnected")),
            Ending::Complete | Ending::Refused { .. } => r.error_code.take(),
        };
        r.usage = usage;
        // A metered answer cut short (the upstream broke, the client left) is `partial` once
        // anything of its usage was read (its counts, or only its model before the counts
        // came): the usage seen so far. `missing` is for an answer that ended without usage, or
        // was cut before the meter learned anything.
        let seen = r.usage != nm_types::Usage::default();
        r.usage_status = match (ending, r.usage.is_known()) {
            (Ending::Complete, true) => UsageStatus::Reported,
            (Ending::Complete | Ending::Refused { .. }, false) => UsageStatus::Missing,
            (Ending::UpstreamError | Ending::ClientGone, _) if seen => UsageStatus::Partial,
            (Ending::UpstreamError | Ending::ClientGone | Ending::Refused { .. }, _) => {
                UsageStatus::Missing
            }
        };
        let model = r.usage.model.as_deref().or(r.model.as_deref());
        // The reservation's price is the record's model's at the record's provider (neither
        // changes once a budget admitted the request): the same when the answer names that
        // model, or none. An answer naming another (a dated snapshot, say) is looked up.
        let price = match self.reserved_price {
            Some(found) if model == r.model.as_deref() => found,
            _ => prices.find(&r.provider, model),
        };
        r.cost_micros = Cost::at(price.0.as_ref(), &r.usage).micros();
    }

    /// The implicit rules at the answer's end: `client_disconnect` on this record, and what the
    /// answer leaves for the session's next request.
    fn implicit(&mut self, ending: Ending, implicit: &Implicit, metrics: &Metrics) {
        let r = &mut self.record;
        let Some(pending) = self.implicit.take() else {
            return;
        };
        let delivered = (200..300).contains(&r.status)
            && matches!(ending, Ending::Complete | Ending::ClientGone);
        if ending == Ending::ClientGone
            && delivered
            && r.streamed
            && pending.rules.has(nm_types::signal::Rule::ClientDisconnect)
            && let Ok(answer) = r.request_id.parse()
        {
            r.inferred.push(nm_types::record::Inferred {
                rule: nm_types::signal::Rule::ClientDisconnect,
                answer,
                edit_distance: None,
            });
        }
        for inferred in &r.inferred {
            metrics.implicit_inferred(inferred.rule);
        }
        implicit.remember(
            &pending,
            &r.request_id,
            delivered,
            ending == Ending::Complete,
            self.answer_text.take(),
            Instant::now(),
        );
    }

    /// Settles the request's budget hold, if it took one.
    fn settle(&mut self, ending: Ending) {
        let Some(hold) = self.reservation.take() else {
            return;
        };
        let r = &mut self.record;
        let charge = match ending {
            // Admitted, but nothing reached the provider: nothing to pay.
            Ending::Refused { .. } => 0,
            // Unknown is not free: a successful answer without usage counts its reservation.
            _ => r.cost_micros.unwrap_or(if (200..300).contains(&r.status) {
                hold.reserved_micros()
            } else {
                0
            }),
        };
        // Tokens as metered; unknown (or nothing sent) like the charge.
        let tokens = match ending {
            Ending::Refused { .. } => 0,
            _ => match (r.usage.input_tokens, r.usage.output_tokens) {
                (None, None) if (200..300).contains(&r.status) => hold.reserved_tokens(),
                (i, o) => i.unwrap_or(0).saturating_add(o.unwrap_or(0)),
            },
        };
        hold.settle(charge, tokens);
        r.budget_micros = Some(charge);
    }

    /// An answered request's access line; a refused request's fields on its `request` span,
    /// where the rescue layer's error line (it answers every error, with or without an event)
    /// finds them.
    fn log(&self, ending: Ending, log: &AccessLog) {
        let r = &self.record;
        let ending = match ending {
            Ending::Complete => "Complete",
            Ending::UpstreamError => "UpstreamError",
            Ending::ClientGone => "ClientGone",
            Ending::Refused { .. } => {
                self.log.know(|k| {
                    k.provider = Some(r.provider.clone());
                    k.model.clone_from(&r.model);
                    k.agent.clone_from(&r.agent);
                    k.session = r.session_id.as_ref().map(|s| s.as_str().to_owned());
                    k.env = r.env.map(|e| e.as_str());
                    k.key_id = Some(r.key_id.clone());
                    k.variant = r
                        .variant
                        .as_ref()
                        .map(|v| (v.experiment.clone(), v.arm.clone()));
                });
                return;
            }
        };
        log.write(&AccessLine {
            record: r,
            route: self.route,
            ids: self.log.ids(),
            ending,
        });
    }

    /// The GenAI operation metrics, the HTTP server duration, the gateway's overhead and budget
    /// refusals. (A
    /// refused request's answer is the gateway's own: the trace layer times it like any other.)
    fn record_metrics(&self, ending: Ending, ended: Instant, metrics: &Metrics) {
        let r = &self.record;
        let provider = &self.provider;
        if let Some(overhead) = self.overhead {
            metrics.gateway_overhead(&provider.system, overhead);
        }
        if let Some(limit) = self.budget_refused {
            metrics.budget_refused(limit);
        }
        let error_type: Option<Cow<'static, str>> = match ending {
            Ending::Complete if r.status >= 400 => Some(Cow::Owned(r.status.to_string())),
            Ending::Complete => None,
            Ending::UpstreamError => Some(Cow::Borrowed("upstream_aborted")),
            Ending::ClientGone => Some(Cow::Borrowed("client_disconnected")),
            Ending::Refused { code, .. } => Some(Cow::Borrowed(code)),
        };
        let duration = ended.duration_since(self.started);
        let digits = r.trace.map(|t| t.trace_digits());
        let trace_id = digits.as_ref().map(|d| d.as_str());
        if let Some(operation) = crate::otel::operation_name(provider.format, &r.path) {
            metrics.operation(&Operation {
                operation,
                provider: &provider.system,
                request_model: r.model.as_deref(),
                response_model: r.usage.model.as_deref(),
                error_type: error_type.as_deref(),
                duration,
                time_to_first_chunk: self
                    .first_byte
                    .filter(|_| r.streamed)
                    .map(|t| t.duration_since(self.started)),
                input_tokens: r.usage.input_tokens,
                output_tokens: r.usage.output_tokens,
                trace_id,
            });
        }
        if !ending.answered() {
            return;
        }
        if let Ok(method) = http::Method::from_bytes(r.method.as_bytes()) {
            metrics.http_server(&method, self.route, r.status, duration, trace_id);
        }
    }

    /// Ends the exported spans: the CLIENT span with the answer (or the call's failure), the
    /// SERVER span with an answer the gateway passed through (the trace layer ends it on an
    /// answer of the gateway's own).
    fn end_spans(&mut self, ending: Ending, ended: Instant) {
        let Some(mut trace) = self.trace.take() else {
            return;
        };
        let r = &self.record;
        trace.attribute(r.agent.as_deref(), r.env.map(|e| e.as_str()));
        if let Some(v) = &r.variant {
            trace.variant(&v.experiment, &v.arm);
        }
        let outcome = match ending {
            Ending::Complete => Outcome::Complete,
            Ending::UpstreamError => Outcome::UpstreamAborted,
            Ending::ClientGone => Outcome::ClientDisconnected,
            Ending::Refused { status, code } => {
                trace.call_failed(code);
                trace.gateway_error(code, status);
                return;
            }
        };
        trace.answered(r.status, r.streamed);
        // The clock time of the body's end (the event may end a moment later).
        let at = SystemTime::now()
            .checked_sub(ended.elapsed())
            .unwrap_or_else(SystemTime::now);
        trace.end(&End {
            outcome,
            at,
            status: r.status,
            usage: &r.usage,
            cost_micros: r.cost_micros,
            time_to_first_chunk: self.first_byte.map(|t| t.duration_since(self.started)),
            streamed: r.streamed,
            output: self.captured.as_deref(),
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nm_types::budget::{BudgetRule, Feed, Period, day_of, month_of_day};

    use super::*;
    use crate::budget::Budgets;
    use crate::providers::{Registry, builtin};
    use crate::records::{RecordQueue, record_queue};

    /// A user with a dollar a day, and a request of theirs admitted with a reservation of
    /// `reserved` micro-dollars.
    fn admitted(reserved: u64) -> (Budgets, RequestEvent) {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let budgets = Budgets::default();
        budgets.apply_feed(Feed {
            full: true,
            default: Some(BudgetRule::usd(1_000_000, Period::Day)),
            day: day_of(now),
            month: month_of_day(day_of(now)),
            ..Default::default()
        });
        let registry = Registry::build(builtin().into_iter().map(|(n, s)| (n.to_owned(), s)))
            .expect("the built-in providers");
        let provider = registry.get("openai").expect("openai").clone();
        let mut record = records::started(
            "req-1".to_owned(),
            SystemTime::now(),
            Arc::from("key-1"),
            provider.name.clone(),
            &http::Method::POST,
            "/v1/chat/completions".to_owned(),
        );
        record.model = Some("gpt-4o-mini".to_owned());
        record.user_id = Some("u".to_owned());
        let mut event = RequestEvent::new(
            record,
            provider,
            crate::routes::PROXY_TEMPLATE,
            Instant::now(),
            RequestLog::new("req-1", None, &http::Method::POST, None),
            None,
        );
        event.reservation = budgets
            .admit_leased("u", "req-1", reserved, now)
            .expect("admitted");
        (budgets, event)
    }

    fn end(
        event: RequestEvent,
        ending: Ending,
        usage: nm_types::Usage,
    ) -> (RequestRecord, Metrics) {
        let metrics = Metrics::default();
        let (records, mut queue): (RecordSink, RecordQueue) = record_queue(1, metrics.clone());
        let prices = PriceTable::builtin();
        let ended = event.started + Duration::from_millis(9);
        let log = AccessLog::off();
        let implicit = Implicit::new(crate::implicit::Settings::default(), metrics.clone());
        let sinks = Sinks {
            records: &records,
            prices: &prices,
            metrics: &metrics,
            log: &log,
            implicit: &implicit,
        };
        assert!(event.end(ending, ended, usage, sinks, true).is_none());
        (queue.try_recv().expect("the record was sent"), metrics)
    }

    #[test]
    fn a_refused_request_pays_nothing_and_its_record_carries_the_error() {
        let (_budgets, mut event) = admitted(5_000);
        event.budget_refused = Some("spend");
        let refused = Ending::Refused {
            status: 502,
            code: "upstream_unreachable",
        };
        let (record, metrics) = end(event, refused, nm_types::Usage::default());
        assert_eq!(record.status, 502);
        assert_eq!(record.error_code.as_deref(), Some("upstream_unreachable"));
        assert_eq!(record.latency_ms, 9);
        assert_eq!(record.budget_micros, Some(0));
        assert_eq!(record.cost_micros, None);
        assert_eq!(record.response_bytes, 0);
        let text = metrics.render();
        assert!(text.contains(r#"reason="spend""#), "{text}");
    }

    /// The price the budget's reservation was estimated at prices an answer that names the
    /// request's model, or none; an answer naming another model is priced from the table.
    #[test]
    fn the_reservations_price_is_reused_for_the_same_model_only() {
        let table = PriceTable::builtin();
        let usage = |model: Option<&str>| nm_types::Usage {
            input_tokens: Some(1_000_000),
            output_tokens: Some(1_000),
            model: model.map(str::to_owned),
            ..Default::default()
        };
        let cost = |kept: Option<Found>, answered: Option<&str>| {
            let (_budgets, mut event) = admitted(5_000);
            event.record.status = 200;
            event.reserved_price = kept;
            end(event, Ending::Complete, usage(answered)).0.cost_micros
        };
        // What the proxy keeps is what the table holds, so reusing it changes no cost.
        let found = table.find("openai", Some("gpt-4o-mini"));
        assert_eq!(found.0.as_ref(), table.lookup("openai", "gpt-4o-mini"));
        for answered in [None, Some("gpt-4o-mini")] {
            let looked_up = table.cost("openai", Some("gpt-4o-mini"), &usage(answered));
            assert_eq!(cost(Some(found), answered), looked_up.micros());
            assert_eq!(cost(None, answered), looked_up.micros());
        }
        // A price the table does not hold shows which one priced the answer.
        let kept = Found(Some(crate::pricing::ModelPrice {
            input: 7_000_000,
            output: 0,
            cached_input: None,
            cache_write: None,
        }));
        assert_eq!(cost(Some(kept), None), Some(7_000_000));
        assert_eq!(cost(Some(kept), Some("gpt-4o-mini")), Some(7_000_000));
        assert_eq!(
            cost(Some(kept), Some("gpt-4o-mini-2024-07-18")),
            table
                .cost("openai", Some("gpt-4o-mini-2024-07-18"), &usage(None))
                .micros()
        );
        // No price for the request's model: unknown, unless the answer names a priced one.
        assert_eq!(cost(Some(Found(None)), None), None);
        assert_eq!(
            cost(Some(Found(None)), Some("gpt-4o")),
            table.cost("openai", Some("gpt-4o"), &usage(None)).micros()
        );
    }

    #[test]
    fn a_successful_answer_without_usage_counts_its_reservation() {
        let (_budgets, mut event) = admitted(5_000);
        event.record.status = 200;
        event.bytes = 42;
        event.first_byte = Some(event.started + Duration::from_millis(4));
        let (record, _) = end(event, Ending::Complete, nm_types::Usage::default());
        assert_eq!(record.usage_status, UsageStatus::Missing);
        assert_eq!(record.budget_micros, Some(5_000));
        assert_eq!((record.ttfb_ms, record.response_bytes), (Some(4), 42));
        assert_eq!(record.error_code, None);
    }

    #[test]
    fn an_answer_cut_short_keeps_the_usage_seen_and_pays_for_it() {
        let (_budgets, mut event) = admitted(5_000);
        event.record.status = 200;
        let usage = nm_types::Usage {
            input_tokens: Some(1_000),
            output_tokens: Some(10),
            ..Default::default()
        };
        let (record, _) = end(event, Ending::ClientGone, usage);
        assert_eq!(record.usage_status, UsageStatus::Partial);
        assert_eq!(record.error_code.as_deref(), Some("client_disconnected"));
        assert!(record.cost_micros.is_some());
        assert_eq!(record.budget_micros, record.cost_micros);
    }
}
