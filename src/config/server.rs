//! Server: where the processes listen, how they stop, and the benchmarks' switches.

use std::net::SocketAddr;
use std::time::Duration;

use nm_dataplane::hot_path::HotPath;

use super::decl::{Chart, Default, Flag, Group, Lit, Raw, declare};
use super::parse;
use super::{ConfigError, invalid};

declare! { Group::Server;
    /// dataplane listen address
    HTTP_ADDR: SocketAddr => parse::addr, {
        env: "NM_HTTP_ADDR",
        flag: Some(Flag { long: "http-addr", get: |f| f.http_addr.as_deref() }),
        file: Some(("http_addr", super::decl::Kind::Str)),
        default: Default::Is(Lit::Str("0.0.0.0:8080")),
        chart: Chart::Template,
    };
    /// controlplane listen address
    GRPC_ADDR: SocketAddr => parse::addr, {
        env: "NM_GRPC_ADDR",
        flag: Some(Flag { long: "grpc-addr", get: |f| f.grpc_addr.as_deref() }),
        file: Some(("grpc_addr", super::decl::Kind::Str)),
        default: Default::ByMode {
            other: Lit::Str("127.0.0.1:50051"),
            controlplane: Lit::Str("0.0.0.0:50051"),
        },
        chart: Chart::Template,
    };
    /// on SIGTERM: how long in-flight requests and streams may take to finish
    SHUTDOWN_GRACE: Duration => parse::secs, {
        env: "NM_SHUTDOWN_GRACE_SECS",
        file: Some(("shutdown_grace_secs", super::decl::Kind::Int)),
        default: Default::Is(Lit::Int(30)),
        chart: Chart::Value("shutdownGraceSecs"),
    };
    /// the web page's listen address (`serve`, `controlplane`); `off` turns it off; a taken default address is a warning and no page, a given one that cannot be bound stops the start (docs/ui.md)
    UI_ADDR: Option<SocketAddr> => ui_addr, {
        env: "NM_UI_ADDR",
        file: Some(("ui_addr", super::decl::Kind::Str)),
        default: Default::Is(Lit::Str("127.0.0.1:8090")),
        chart: Chart::Template,
    };
    /// the web page's link to a trace in the operator's tracing backend: a URL with `{trace_id}` (e.g. `http://jaeger:16686/trace/{trace_id}`); unset: no links
    UI_TRACE_URL: String => ui_trace_url, {
        env: "NM_UI_TRACE_URL",
        file: Some(("ui_trace_url", super::decl::Kind::Str)),
        chart: Chart::Template,
    };
    /// benchmarks only: hot-path mechanisms to turn off, comma-separated (`deferred_completion`, `key_cache`, `worker_pools`, `timer_tick`; ARCHITECTURE.md, "Hot-path mechanisms")
    HOT_PATH_OFF: HotPath => hot_path_off, {
        env: "NM_HOT_PATH_OFF",
    };
}

fn hot_path_off(key: &'static str, raw: Raw<'_>) -> Result<HotPath, ConfigError> {
    let off = parse::text(key, raw)?;
    HotPath::all_but(&off).ok_or_else(|| {
        invalid(
            key,
            format!(
                "{off:?}: name mechanisms from {}",
                nm_dataplane::hot_path::NAMES.join(", ")
            ),
        )
    })
}

fn ui_addr(key: &'static str, raw: Raw<'_>) -> Result<Option<SocketAddr>, ConfigError> {
    let text = parse::text(key, raw)?;
    if text.trim() == "off" {
        return Ok(None);
    }
    parse::addr(key, Raw::Text(&text)).map(Some)
}

fn ui_trace_url(key: &'static str, raw: Raw<'_>) -> Result<String, ConfigError> {
    let url = parse::text(key, raw)?;
    let well_formed = (url.starts_with("http://") || url.starts_with("https://"))
        && url.contains("{trace_id}")
        && url.len() <= 2000
        && !url
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '"' || c == '<');
    if !well_formed {
        return Err(invalid(
            key,
            format!(
                "{url:?}: give an http(s) URL containing {{trace_id}}, e.g. http://127.0.0.1:16686/trace/{{trace_id}}"
            ),
        ));
    }
    Ok(url)
}
