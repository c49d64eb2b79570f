//! A request's log context: the fields of the `request` span its lines are written in, held
//! by the request itself instead of by a `tracing` span.
//!
//! A `tracing` span per request cost more than the access line it was for: its creation formats
//! its fields into the subscriber's registry, and the request's future entered and left it on
//! every poll (about 5k instructions a request). The lines the gateway writes about a request (the
//! access line, the rescue layer's error line, a signal's line) are few and all ours, so each is
//! written with the request's fields from here ([`super::access::Shape`]), in the layout the
//! `tracing` formatters give a line in a span named `request`. Lines from elsewhere during a
//! request (a library's, the in-process controlplane's) carry no request fields.

use std::sync::{Arc, Mutex, PoisonError};

use nm_types::record::TraceRef;

use super::AccessLog;
use super::access::{Fields, Shape, Val};

/// The `request` span's fields: set when the request starts, and learnt as it goes. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct RequestLog(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    request_id: String,
    /// The SERVER span's ids, when its context is valid (sampled or not).
    ids: Option<TraceRef>,
    method: http::Method,
    /// The matched route's template (None for an unknown path).
    route: Option<&'static str>,
    /// Written only on the paths that refuse or answer a request themselves, never on a
    /// proxied answer's (its access line is written from its record).
    known: Mutex<Known>,
}

/// What a request's lines learn as it goes, in the order they are written.
#[derive(Debug, Default)]
pub struct Known {
    pub provider: Option<Arc<str>>,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub session: Option<String>,
    pub env: Option<&'static str>,
    pub key_id: Option<Arc<str>>,
    pub status: Option<u16>,
    /// The experiment and arm the request was assigned (its error answer's `NM-Variant`).
    pub variant: Option<(Arc<str>, Arc<str>)>,
}

/// A line's own fields, after its message.
pub type LineFields<'a> = [(&'static str, Val<'a>)];

impl RequestLog {
    pub fn new(
        request_id: &str,
        ids: Option<TraceRef>,
        method: &http::Method,
        route: Option<&'static str>,
    ) -> Self {
        Self(Arc::new(Inner {
            request_id: request_id.to_owned(),
            ids,
            method: method.clone(),
            route,
            known: Mutex::default(),
        }))
    }

    /// The ids of the request's SERVER span, when its context is valid.
    pub fn ids(&self) -> Option<&TraceRef> {
        self.0.ids.as_ref()
    }

    /// Records what the request learnt, for its later lines.
    pub fn know(&self, learn: impl FnOnce(&mut Known)) {
        learn(&mut self.0.known.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The `NM-Variant` of the request's answer, when it was assigned an experiment's arm
    /// before the gateway answered it with an error.
    pub fn variant_header(&self) -> Option<http::HeaderValue> {
        let known = self.0.known.lock().unwrap_or_else(PoisonError::into_inner);
        let (experiment, arm) = known.variant.as_ref()?;
        http::HeaderValue::try_from(format!("{experiment}/{arm}")).ok()
    }

    /// Writes a line in the request's span to `out`. The caller has asked the log filter
    /// (`tracing::enabled!` with the line's target and level), so a filtered line costs nothing.
    pub fn line(
        &self,
        out: &AccessLog,
        level: tracing::Level,
        target: &'static str,
        message: &'static str,
        fields: &LineFields<'_>,
    ) {
        let known = self.0.known.lock().unwrap_or_else(PoisonError::into_inner);
        let span = Span {
            inner: &self.0,
            known: &known,
            hex: self
                .0
                .ids
                .as_ref()
                .map(|t| (t.trace_digits(), t.span_digits())),
        };
        out.write_shape(&Shape {
            level,
            target,
            message,
            span: &span,
            event: &Own(fields),
        });
    }
}

/// The span's fields, in the order of the span's declaration as it was: the request id, the
/// trace's ids, the method, the route, then what the request learnt.
struct Span<'a> {
    inner: &'a Inner,
    known: &'a Known,
    hex: Option<(
        nm_types::record::HexDigits<32>,
        nm_types::record::HexDigits<16>,
    )>,
}

impl Fields for Span<'_> {
    fn each<'a>(&'a self, f: &mut impl FnMut(&'static str, Val<'a>)) {
        let (i, k) = (self.inner, self.known);
        f("nm.request_id", Val::Str(&i.request_id));
        if let Some((trace, span)) = &self.hex {
            f("trace_id", Val::Str(trace.as_str()));
            f("span_id", Val::Str(span.as_str()));
        }
        f("http.request.method", Val::Bare(i.method.as_str()));
        if let Some(r) = i.route {
            f("http.route", Val::Str(r));
        }
        let texts = [
            ("gen_ai.provider.name", k.provider.as_deref()),
            ("gen_ai.request.model", k.model.as_deref()),
            ("nm.agent", k.agent.as_deref()),
            ("nm.session", k.session.as_deref()),
            ("nm.env", k.env),
            ("nm.experiment", k.variant.as_ref().map(|v| &*v.0)),
            ("nm.arm", k.variant.as_ref().map(|v| &*v.1)),
            ("nm.key_id", k.key_id.as_deref()),
        ];
        for (name, v) in texts {
            if let Some(v) = v {
                f(name, Val::Str(v));
            }
        }
        if let Some(s) = k.status {
            f("http.response.status_code", Val::Num(s.into()));
        }
    }
}

/// A line's own fields.
struct Own<'f, 'a>(&'f LineFields<'a>);

impl Fields for Own<'_, '_> {
    fn each<'a>(&'a self, f: &mut impl FnMut(&'static str, Val<'a>)) {
        for (name, v) in self.0 {
            f(name, *v);
        }
    }
}
