//! Limits: what a client connection and its request may take of the dataplane.

use std::time::Duration;

use super::decl::{Chart, Default, Group, Kind, Lit, Raw, declare};
use super::{ConfigError, invalid, parse};

declare! { Group::Limits;
    /// largest request body forwarded, in bytes
    MAX_BODY_BYTES: usize => max_body_bytes, {
        env: "NM_MAX_BODY_BYTES",
        file: Some(("max_body_bytes", Kind::Int)),
        default: Default::Is(Lit::Int(nm_dataplane::DEFAULT_MAX_BODY_BYTES as u64)),
        chart: Chart::Value("maxBodyBytes"),
    };
    /// time, in seconds, a client connection has to send a request head: from its accept (a socket that sends nothing is closed), and from the end of the previous answer (an idle kept-alive HTTP/1.1 connection, or an HTTP/2 connection with no open stream, closes)
    CLIENT_HEADER_TIMEOUT: Duration => parse::secs_at_least_1, {
        env: "NM_CLIENT_HEADER_TIMEOUT_SECS",
        file: Some(("client_header_timeout_secs", Kind::Int)),
        default: Default::Is(Lit::Int(10)),
    };
    /// longest wait, in seconds, for the next piece of a request body (then 408 `request_timeout`)
    CLIENT_BODY_IDLE_TIMEOUT: Duration => parse::secs_at_least_1, {
        env: "NM_CLIENT_BODY_IDLE_TIMEOUT_SECS",
        file: Some(("client_body_idle_timeout_secs", Kind::Int)),
        default: Default::Is(Lit::Int(30)),
    };
    /// bytes per second a request body must average beyond its idle timeout (then 408); `0`: no minimum
    CLIENT_BODY_MIN_RATE: u64 => parse::whole, {
        env: "NM_CLIENT_BODY_MIN_RATE",
        file: Some(("client_body_min_rate", Kind::Int)),
        default: Default::Is(Lit::Int(1024)),
    };
    /// most client connections open at once; at the cap the connection idle the longest is closed to make room. `0`: (open-file limit − 64) / 2, e.g. 480 under `ulimit -n 1024`
    MAX_CONNECTIONS: usize => max_connections, {
        env: "NM_MAX_CONNECTIONS",
        file: Some(("max_connections", Kind::Int)),
        default: Default::Is(Lit::Int(0)),
    };
}

fn max_body_bytes(key: &'static str, raw: Raw<'_>) -> Result<usize, ConfigError> {
    let n = parse::whole(key, raw)?;
    usize::try_from(n)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| invalid(key, "must be a positive number of bytes"))
}

fn max_connections(key: &'static str, raw: Raw<'_>) -> Result<usize, ConfigError> {
    let n = parse::whole(key, raw)?;
    usize::try_from(n).map_err(|_| invalid(key, "is too large"))
}
