//! Every path the gateway answers itself, in one table ([`TABLE`]), and what any request path
//! resolves to ([`Route::of`]). The trace layer asks [`Route::of`] once per request; the router
//! ([`crate::stack`]), the key check ([`crate::layers::auth`]) and the error shape
//! ([`crate::layers::rescue`]) read its answer; the provider registry refuses a provider named like a route's first segment
//! ([`is_reserved`]). A new route is one line here and one arm in the router.

use crate::path::split_prefix;

/// A route the gateway serves itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Own {
    /// `GET /health`: ready to serve.
    Ready,
    /// `GET /health/live`: the process serves HTTP.
    Live,
    /// `GET /metrics`: Prometheus exposition.
    Metrics,
    /// `POST /v1/signal`: what an end user did with an output.
    Signal,
}

/// `http.route` of every proxied request: a template, so metrics and traces stay
/// low-cardinality whatever the client sends.
pub const PROXY_TEMPLATE: &str = "/{provider}/{*native_path}";

/// One of the gateway's own routes.
#[derive(Debug)]
pub struct Entry {
    pub path: &'static str,
    pub route: Own,
    /// Whether the request must carry a valid `NM-Key`.
    pub needs_key: bool,
}

/// The gateway's own routes. Their first segments (`health`, `metrics`, `v1`) are reserved: a
/// path under one of them that is not in the table is the gateway's 404, never a provider's.
/// Errors on all of them take the gateway's envelope.
pub const TABLE: [Entry; 4] = [
    Entry {
        path: "/health",
        route: Own::Ready,
        needs_key: false,
    },
    Entry {
        path: "/health/live",
        route: Own::Live,
        needs_key: false,
    },
    Entry {
        path: "/metrics",
        route: Own::Metrics,
        needs_key: false,
    },
    Entry {
        path: "/v1/signal",
        route: Own::Signal,
        needs_key: true,
    },
];

/// The first segments of the table's paths: no provider may be called so, and a path under one
/// that is not in the table is the gateway's 404. Kept beside [`TABLE`] (a test checks the two
/// agree) so that a proxy path, the common case, is judged by comparing one segment with three
/// short names.
const RESERVED: [&str; 3] = ["health", "metrics", "v1"];

/// What a request path resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// One of the gateway's own routes.
    Own(Own),
    /// Under a reserved name but in no route (`/v1/nope`, `/metrics/x`): 404.
    Unknown,
    /// `/<provider>/<native path>`, or a path with no provider at all.
    Proxy,
}

impl Route {
    /// Resolves a request path (exact match; no normalisation). Asked once per request, by the
    /// trace layer, which hands the answer down ([`crate::event::RequestStart`]); a proxy path
    /// costs one segment split and three short comparisons.
    pub fn of(path: &str) -> Self {
        match split_prefix(path) {
            Some((first, _)) if is_reserved(first) => TABLE
                .iter()
                .find(|e| e.path == path)
                .map_or(Self::Unknown, |e| Self::Own(e.route)),
            _ => Self::Proxy,
        }
    }

    /// Whether the request must carry a valid `NM-Key` before anything else happens. Only the
    /// table's open routes are served without one: an unknown path is judged after the key, so
    /// an outsider learns nothing about what exists.
    pub fn needs_key(self) -> bool {
        match self {
            Self::Own(own) => TABLE.iter().any(|e| e.route == own && e.needs_key),
            Self::Unknown | Self::Proxy => true,
        }
    }

    /// `http.route`: the matched template (None for an unknown path).
    pub fn template(self) -> Option<&'static str> {
        match self {
            Self::Own(Own::Ready) => Some("/health"),
            Self::Own(Own::Live) => Some("/health/live"),
            Self::Own(Own::Metrics) => Some("/metrics"),
            Self::Own(Own::Signal) => Some("/v1/signal"),
            Self::Proxy => Some(PROXY_TEMPLATE),
            Self::Unknown => None,
        }
    }

    /// Whether errors take the gateway's envelope; otherwise the provider's native shape.
    pub fn gateway_shaped(self) -> bool {
        !matches!(self, Self::Proxy)
    }
}

/// Whether a first path segment belongs to the gateway (no provider may be called so).
pub fn is_reserved(name: &str) -> bool {
    RESERVED.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_by_the_table() {
        assert_eq!(Route::of("/health"), Route::Own(Own::Ready));
        assert_eq!(Route::of("/health/live"), Route::Own(Own::Live));
        assert_eq!(Route::of("/metrics"), Route::Own(Own::Metrics));
        assert_eq!(Route::of("/v1/signal"), Route::Own(Own::Signal));
        for unknown in [
            "/v1/nope",
            "/v1",
            "/v1/",
            "/metrics/x",
            "/health/",
            "/health/x",
        ] {
            assert_eq!(Route::of(unknown), Route::Unknown, "{unknown}");
        }
        for proxy in [
            "/openai/v1/chat/completions",
            "/",
            "",
            "/V1/signal",
            "/healthz",
        ] {
            assert_eq!(Route::of(proxy), Route::Proxy, "{proxy}");
        }
    }

    #[test]
    fn only_the_probes_and_metrics_are_open() {
        let open: Vec<_> = TABLE
            .iter()
            .filter(|e| !e.needs_key)
            .map(|e| e.path)
            .collect();
        assert_eq!(open, ["/health", "/health/live", "/metrics"]);
        assert!(Route::of("/v1/signal").needs_key());
        assert!(Route::of("/health/x").needs_key());
        assert!(Route::of("/openai/v1/models").needs_key());
    }

    #[test]
    fn every_own_route_and_reserved_name_errs_in_the_gateway_shape() {
        for e in &TABLE {
            assert!(Route::of(e.path).gateway_shaped(), "{}", e.path);
        }
        assert!(Route::of("/metrics/x").gateway_shaped());
        assert!(!Route::of("/openai/v1/models").gateway_shaped());
        for name in ["health", "metrics", "v1"] {
            assert!(is_reserved(name), "{name}");
        }
        assert!(!is_reserved("openai"));
        assert!(!is_reserved("live"));
    }

    #[test]
    fn the_reserved_names_are_exactly_the_tables_first_segments() {
        let mut firsts: Vec<&str> = TABLE
            .iter()
            .filter_map(|e| split_prefix(e.path).map(|(first, _)| first))
            .collect();
        firsts.sort_unstable();
        firsts.dedup();
        assert_eq!(firsts, RESERVED);
    }
}
