//! The OpenTelemetry settings, read the standard way (the `OTEL_*` variables of the
//! OpenTelemetry specification) from the same environment map as every other setting, and
//! checked: a value the SDK would silently ignore or replace stops the process instead (exit 64,
//! naming the variable).
//!
//! Tracing is off unless an OTLP endpoint is set; `OTEL_SDK_DISABLED=true` and
//! `OTEL_TRACES_EXPORTER=none` turn it off whatever else is set.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use crate::config::decl::ConfigError;

pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
pub const OTEL_TRACES_EXPORTER: &str = "OTEL_TRACES_EXPORTER";
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const OTEL_EXPORTER_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
pub const OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
pub const OTEL_EXPORTER_OTLP_HEADERS: &str = "OTEL_EXPORTER_OTLP_HEADERS";
pub const OTEL_EXPORTER_OTLP_TRACES_HEADERS: &str = "OTEL_EXPORTER_OTLP_TRACES_HEADERS";
pub const OTEL_EXPORTER_OTLP_CERTIFICATE: &str = "OTEL_EXPORTER_OTLP_CERTIFICATE";
pub const OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE: &str = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE";
pub const OTEL_EXPORTER_OTLP_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TIMEOUT";
pub const OTEL_EXPORTER_OTLP_TRACES_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT";
pub const OTEL_TRACES_SAMPLER: &str = "OTEL_TRACES_SAMPLER";
pub const OTEL_TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
pub const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
pub const OTEL_PROPAGATORS: &str = "OTEL_PROPAGATORS";
pub const OTEL_BSP_MAX_QUEUE_SIZE: &str = "OTEL_BSP_MAX_QUEUE_SIZE";
pub const OTEL_BSP_SCHEDULE_DELAY: &str = "OTEL_BSP_SCHEDULE_DELAY";
pub const OTEL_BSP_MAX_EXPORT_BATCH_SIZE: &str = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE";
pub const OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT: &str =
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT";

/// The `OTEL_*` variables in the settings table (docs/settings.md, the chart check). Their
/// reading is [`resolve`]'s: a signal's own variable (`_TRACES_`) beats the generic one, and some
/// values only make sense together, so the rows carry the names, defaults and docs, and each
/// parse function checks one value alone.
mod table {
    use super::*;
    use crate::config::decl::{Chart, Default, Group, Lit, Raw, declare};

    declare! { Group::Tracing;
        /// where spans go, e.g. `http://127.0.0.1:4317` (for `http/protobuf`, `/v1/traces` is appended); unset: tracing off
        ENDPOINT: () => |k, r| url(k, r), { env: OTEL_EXPORTER_OTLP_ENDPOINT, chart: Chart::Otel };
        /// where spans go, used as given; wins over `OTEL_EXPORTER_OTLP_ENDPOINT`
        TRACES_ENDPOINT: () => |k, r| url(k, r), { env: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT };
        /// `grpc` or `http/protobuf`, each over `http://` or `https://`
        PROTOCOL: () => |k, r| protocol(k, r), {
            env: OTEL_EXPORTER_OTLP_PROTOCOL,
            default: Default::Is(Lit::Str("grpc")),
            chart: Chart::Otel,
        };
        /// the protocol of trace exports; wins over `OTEL_EXPORTER_OTLP_PROTOCOL`
        TRACES_PROTOCOL: () => |k, r| protocol(k, r), { env: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL };
        /// PEM file of CA certificates trusted for an `https://` collector beside the public web PKI (a private CA)
        CERTIFICATE: () => |k, r| certificate(k, r), { env: OTEL_EXPORTER_OTLP_CERTIFICATE };
        /// the CA file for trace exports; wins over `OTEL_EXPORTER_OTLP_CERTIFICATE`
        TRACES_CERTIFICATE: () => |k, r| certificate(k, r), { env: OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE };
        /// `key=value,...` (values percent-decoded) sent with each export: a collector's API key
        HEADERS: () => |k, r| pairs(k, r), { env: OTEL_EXPORTER_OTLP_HEADERS, chart: Chart::Otel };
        /// headers of trace exports; win over `OTEL_EXPORTER_OTLP_HEADERS`
        TRACES_HEADERS: () => |k, r| pairs(k, r), { env: OTEL_EXPORTER_OTLP_TRACES_HEADERS };
        /// export timeout, milliseconds
        TIMEOUT: () => |k, r| timeout(k, r), {
            env: OTEL_EXPORTER_OTLP_TIMEOUT,
            default: Default::Is(Lit::Int(10_000)),
        };
        /// export timeout of traces, milliseconds; wins over `OTEL_EXPORTER_OTLP_TIMEOUT`
        TRACES_TIMEOUT: () => |k, r| timeout(k, r), { env: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT };
        /// not supported: exports go uncompressed (`none` is accepted); any other value stops the process (exit 64) rather than being ignored
        COMPRESSION: () => |k, r| no_compression(k, r), { env: "OTEL_EXPORTER_OTLP_COMPRESSION" };
        /// not supported, as `OTEL_EXPORTER_OTLP_COMPRESSION`
        TRACES_COMPRESSION: () => |k, r| no_compression(k, r), { env: "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION" };
        /// not supported: exports go without a client certificate; any value stops the process (exit 64)
        CLIENT_KEY: () => |k, r| refused(k, r), { env: "OTEL_EXPORTER_OTLP_CLIENT_KEY" };
        /// not supported, as `OTEL_EXPORTER_OTLP_CLIENT_KEY`
        CLIENT_CERTIFICATE: () => |k, r| refused(k, r), { env: "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE" };
        /// not supported, as `OTEL_EXPORTER_OTLP_CLIENT_KEY`
        TRACES_CLIENT_KEY: () => |k, r| refused(k, r), { env: "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY" };
        /// not supported, as `OTEL_EXPORTER_OTLP_CLIENT_KEY`
        TRACES_CLIENT_CERTIFICATE: () => |k, r| refused(k, r), { env: "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE" };
        /// `always_on`, `always_off`, `traceidratio`, `parentbased_always_on`, `parentbased_always_off`, `parentbased_traceidratio`
        SAMPLER: () => |k, r| sampler_name(k, r), {
            env: OTEL_TRACES_SAMPLER,
            default: Default::Is(Lit::Str("parentbased_always_on")),
            chart: Chart::Otel,
        };
        /// the ratio of a ratio sampler, in [0, 1]
        SAMPLER_ARG: () => |k, r| sampler_arg(k, r), {
            env: OTEL_TRACES_SAMPLER_ARG,
            default: Default::Is(Lit::Str("1.0")),
            chart: Chart::Otel,
        };
        /// `service.name`; `service.version` is the gateway's version
        SERVICE_NAME: () => |k, r| text(k, r).map(drop), {
            env: OTEL_SERVICE_NAME,
            default: Default::Described("`nm-gateway` (serve), `nm-dataplane`, `nm-controlplane`"),
            chart: Chart::Otel,
        };
        /// `key=value,...` resource attributes (`service.name` here counts when `OTEL_SERVICE_NAME` is unset)
        RESOURCE_ATTRIBUTES: () => |k, r| pairs(k, r), { env: OTEL_RESOURCE_ATTRIBUTES, chart: Chart::Otel };
        /// context formats read from clients and sent upstream: `tracecontext`, `baggage`, `none`
        PROPAGATORS: () => |k, r| text(k, r).and_then(|v| propagators(&v).map(drop)), {
            env: OTEL_PROPAGATORS,
            default: Default::Is(Lit::Str("tracecontext,baggage")),
        };
        /// `true` turns tracing off whatever else is set
        SDK_DISABLED: () => |k, r| text(k, r).and_then(|v| bool_value(k, &v).map(drop)), {
            env: OTEL_SDK_DISABLED,
            default: Default::Is(Lit::Str("false")),
        };
        /// `otlp`, or `none`: tracing off whatever else is set
        TRACES_EXPORTER: () => |k, r| exporter(k, r), {
            env: OTEL_TRACES_EXPORTER,
            default: Default::Is(Lit::Str("otlp")),
        };
        /// spans waiting for export (beyond: dropped and counted)
        BSP_MAX_QUEUE_SIZE: () => |k, r| count(k, r), {
            env: OTEL_BSP_MAX_QUEUE_SIZE,
            default: Default::Is(Lit::Int(DEFAULT_QUEUE as u64)),
        };
        /// spans per export, at most `OTEL_BSP_MAX_QUEUE_SIZE`
        BSP_MAX_EXPORT_BATCH_SIZE: () => |k, r| count(k, r), {
            env: OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
            default: Default::Is(Lit::Int(DEFAULT_BATCH as u64)),
        };
        /// milliseconds between exports
        BSP_SCHEDULE_DELAY: () => |k, r| text(k, r).and_then(|v| millis(k, &v).map(drop)), {
            env: OTEL_BSP_SCHEDULE_DELAY,
            default: Default::Is(Lit::Int(5_000)),
        };
        /// `true`: the first 16 KiB of each request and answer body go on its CLIENT span (`gen_ai.input.messages`, `gen_ai.output.messages`)
        CAPTURE_MESSAGE_CONTENT: () => |k, r| text(k, r).and_then(|v| bool_value(k, &v).map(drop)), {
            env: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT,
            default: Default::Is(Lit::Str("false")),
        };
    }

    /// A value as text (a number default shown as text), trimmed like [`resolve`] does.
    fn text(_: &'static str, raw: Raw<'_>) -> Result<String, ConfigError> {
        Ok(match raw {
            Raw::Text(s) => s.trim().to_owned(),
            Raw::Int(n) => n.to_string(),
        })
    }
    fn url(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        endpoint_url(k, &text(k, r)?).map(drop)
    }
    fn protocol(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        match text(k, r)?.as_str() {
            "grpc" | "http/protobuf" => Ok(()),
            other => Err(invalid(
                k,
                format!("{other:?} is not supported; use grpc or http/protobuf"),
            )),
        }
    }
    fn certificate(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        ca_file(k, &text(k, r)?).map(drop)
    }
    fn pairs(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        key_values(k, &text(k, r)?).map(drop)
    }
    fn timeout(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        if millis(k, &text(k, r)?)?.is_zero() {
            return Err(invalid(k, "must be at least 1 (milliseconds)"));
        }
        Ok(())
    }
    fn no_compression(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        match text(k, r)?.as_str() {
            "none" => Ok(()),
            v => Err(invalid(
                k,
                format!("{v:?} is not supported; exports are sent uncompressed (none)"),
            )),
        }
    }
    fn refused(k: &'static str, _: Raw<'_>) -> Result<(), ConfigError> {
        Err(invalid(k, CLIENT_CERT_REFUSED))
    }
    fn sampler_name(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        let _ = k;
        sampler(Some(&text(k, r)?), None).map(drop)
    }
    fn sampler_arg(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        sampler(Some("traceidratio"), Some(&text(k, r)?)).map(drop)
    }
    fn exporter(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        exporter_none(&text(k, r)?).map(drop)
    }
    fn count(k: &'static str, r: Raw<'_>) -> Result<(), ConfigError> {
        positive(k, &text(k, r)?).map(drop)
    }
}
pub use table::TABLE;

/// The specification's default export timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_QUEUE: usize = 2048;
pub const DEFAULT_SCHEDULE_DELAY: Duration = Duration::from_secs(5);
pub const DEFAULT_BATCH: usize = 512;

/// Whether and where spans are exported. `None` in [`OtelSettings::export`]: tracing is off
/// (nothing is created per request, and a client's `traceparent` passes through untouched).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OtelSettings {
    pub export: Option<Export>,
}

#[derive(Clone, PartialEq)]
pub struct Export {
    pub protocol: Protocol,
    /// The URL spans are sent to: for `http/protobuf` the full URL (`/v1/traces` appended to
    /// the generic endpoint), for `grpc` the collector's base URL.
    pub endpoint: String,
    /// Extra request headers or gRPC metadata (often a collector's API key: never printed).
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
    /// PEM CA certificates trusted for an `https://` collector beside the public web PKI
    /// (`OTEL_EXPORTER_OTLP_CERTIFICATE`).
    pub ca_pem: Option<Vec<u8>>,
    pub sampler: Sampler,
    /// `OTEL_SERVICE_NAME`, else `service.name` of `OTEL_RESOURCE_ATTRIBUTES`, else the
    /// process shape's default (decided at start).
    pub service_name: Option<String>,
    pub resource: Vec<(String, String)>,
    pub propagators: Propagators,
    pub queue: usize,
    pub schedule_delay: Duration,
    pub batch: usize,
    /// Prompt and completion content on spans (`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`).
    pub capture_content: bool,
}

impl fmt::Debug for Export {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header_names: Vec<&str> = self.headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("Export")
            .field("protocol", &self.protocol)
            .field("endpoint", &self.endpoint)
            .field("headers", &header_names)
            .field("timeout", &self.timeout)
            .field("sampler", &self.sampler)
            .field("service_name", &self.service_name)
            .field("propagators", &self.propagators)
            .field("capture_content", &self.capture_content)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

/// `OTEL_TRACES_SAMPLER`: the specification's samplers that need no remote service; the
/// dataplane's tracer applies them ([`nm_dataplane::otel::span`]).
pub use nm_dataplane::otel::span::{Root, Sampler};

/// `OTEL_PROPAGATORS`: which context formats are read from requests and written to upstreams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Propagators {
    pub tracecontext: bool,
    pub baggage: bool,
}

fn invalid(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        problem: problem.into(),
    }
}

/// Reads the `OTEL_*` settings from `env`.
pub fn resolve(env: &HashMap<String, String>) -> Result<OtelSettings, ConfigError> {
    let get = |k: &str| env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    // Every value is checked, even when tracing ends up off: a typo must not wait for the day
    // someone turns tracing on.
    let disabled = match get(OTEL_SDK_DISABLED) {
        Some(v) => bool_value(OTEL_SDK_DISABLED, v)?,
        None => false,
    };
    let exporter_none = match get(OTEL_TRACES_EXPORTER) {
        None => false,
        Some(v) => exporter_none(v)?,
    };
    let pair = |signal: &'static str, generic: &'static str| {
        get(signal)
            .map(|v| (signal, v))
            .or_else(|| get(generic).map(|v| (generic, v)))
    };

    let protocol = match pair(
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
        OTEL_EXPORTER_OTLP_PROTOCOL,
    ) {
        None => Protocol::Grpc,
        Some((_, "grpc")) => Protocol::Grpc,
        Some((_, "http/protobuf")) => Protocol::HttpProtobuf,
        Some((key, other)) => {
            return Err(invalid(
                key,
                format!("{other:?} is not supported; use grpc or http/protobuf"),
            ));
        }
    };
    let endpoint = match (
        get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT),
        get(OTEL_EXPORTER_OTLP_ENDPOINT),
    ) {
        (Some(url), _) => Some(endpoint_url(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, url)?),
        (None, Some(url)) => {
            let base = endpoint_url(OTEL_EXPORTER_OTLP_ENDPOINT, url)?;
            Some(match protocol {
                // The specification: the generic endpoint gets the signal's path over HTTP.
                Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
                Protocol::Grpc => base,
            })
        }
        (None, None) => None,
    };
    let headers = match pair(
        OTEL_EXPORTER_OTLP_TRACES_HEADERS,
        OTEL_EXPORTER_OTLP_HEADERS,
    ) {
        Some((key, v)) => key_values(key, v)?,
        None => Vec::new(),
    };
    let timeout = match pair(
        OTEL_EXPORTER_OTLP_TRACES_TIMEOUT,
        OTEL_EXPORTER_OTLP_TIMEOUT,
    ) {
        Some((key, v)) => {
            let ms = millis(key, v)?;
            if ms.is_zero() {
                return Err(invalid(key, "must be at least 1 (milliseconds)"));
            }
            ms
        }
        None => DEFAULT_TIMEOUT,
    };
    let sampler = sampler(get(OTEL_TRACES_SAMPLER), get(OTEL_TRACES_SAMPLER_ARG))?;
    let resource = match get(OTEL_RESOURCE_ATTRIBUTES) {
        Some(v) => key_values(OTEL_RESOURCE_ATTRIBUTES, v)?,
        None => Vec::new(),
    };
    let service_name = get(OTEL_SERVICE_NAME).map(str::to_owned).or_else(|| {
        resource
            .iter()
            .find(|(k, _)| k == "service.name")
            .map(|(_, v)| v.clone())
    });
    let propagators = match get(OTEL_PROPAGATORS) {
        None => Propagators {
            tracecontext: true,
            baggage: true,
        },
        Some(v) => propagators(v)?,
    };
    let count = |key: &str, default: usize| -> Result<usize, ConfigError> {
        get(key).map_or(Ok(default), |v| positive(key, v))
    };
    let queue = count(OTEL_BSP_MAX_QUEUE_SIZE, DEFAULT_QUEUE)?;
    let batch = count(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, DEFAULT_BATCH)?;
    if batch > queue {
        return Err(invalid(
            OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
            format!("{batch} is more than OTEL_BSP_MAX_QUEUE_SIZE ({queue})"),
        ));
    }
    let schedule_delay = match get(OTEL_BSP_SCHEDULE_DELAY) {
        Some(v) => millis(OTEL_BSP_SCHEDULE_DELAY, v)?,
        None => DEFAULT_SCHEDULE_DELAY,
    };
    let capture_content = match get(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT) {
        Some(v) => bool_value(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT, v)?,
        None => false,
    };

    // Read by the specification, not by this build: refused rather than silently ignored.
    for key in [
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
    ] {
        if get(key).is_some() {
            return Err(invalid(key, CLIENT_CERT_REFUSED));
        }
    }
    for key in [
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    ] {
        if let Some(v) = get(key).filter(|v| *v != "none") {
            return Err(invalid(
                key,
                format!("{v:?} is not supported; exports are sent uncompressed (none)"),
            ));
        }
    }
    let ca_pem = match pair(
        OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE,
        OTEL_EXPORTER_OTLP_CERTIFICATE,
    ) {
        Some((key, path)) => Some(ca_file(key, path)?),
        None => None,
    };
    let Some(endpoint) = endpoint.filter(|_| !disabled && !exporter_none) else {
        return Ok(OtelSettings { export: None });
    };
    Ok(OtelSettings {
        export: Some(Export {
            protocol,
            endpoint,
            headers,
            timeout,
            ca_pem,
            sampler,
            service_name,
            resource,
            propagators,
            queue,
            schedule_delay,
            batch,
            capture_content,
        }),
    })
}

/// Why a client certificate for the collector is refused.
const CLIENT_CERT_REFUSED: &str = "client certificates to the collector (mTLS) are not supported; put a collector or proxy that needs none in front";

/// `OTEL_TRACES_EXPORTER`: whether it names only `none` (`otlp` and `none` are supported).
fn exporter_none(v: &str) -> Result<bool, ConfigError> {
    let names: Vec<&str> = v.split(',').map(str::trim).collect();
    for n in &names {
        if !matches!(*n, "otlp" | "none") {
            return Err(invalid(
                OTEL_TRACES_EXPORTER,
                format!("{n:?} is not supported; use otlp or none"),
            ));
        }
    }
    Ok(names.iter().all(|n| *n == "none"))
}

/// A positive whole number (a batch processor's sizes).
fn positive(key: &str, v: &str) -> Result<usize, ConfigError> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(invalid(
            key,
            format!("{v:?} is not a positive whole number"),
        )),
    }
}

/// A PEM file of at least one CA certificate.
fn ca_file(key: &str, path: &str) -> Result<Vec<u8>, ConfigError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(path).map_err(|e| invalid(key, format!("{path}: {e}")))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(key, format!("{path}: not PEM certificates ({e})")))?;
    if certs.is_empty() {
        return Err(invalid(key, format!("{path}: no certificate in it")));
    }
    Ok(pem)
}

fn bool_value(key: &str, v: &str) -> Result<bool, ConfigError> {
    if v.eq_ignore_ascii_case("true") {
        Ok(true)
    } else if v.eq_ignore_ascii_case("false") {
        Ok(false)
    } else {
        Err(invalid(key, format!("{v:?} is not true or false")))
    }
}

fn millis(key: &str, v: &str) -> Result<Duration, ConfigError> {
    v.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| invalid(key, format!("{v:?} is not a whole number of milliseconds")))
}

fn endpoint_url(key: &str, url: &str) -> Result<String, ConfigError> {
    let bad = || {
        invalid(
            key,
            format!("{url:?} is not an http:// or https:// URL (e.g. http://127.0.0.1:4317)"),
        )
    };
    let uri: http::Uri = url.parse().map_err(|_| bad())?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(bad());
    }
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(invalid(
            key,
            "must not carry credentials; put them in OTEL_EXPORTER_OTLP_HEADERS",
        ));
    }
    Ok(url.to_owned())
}

/// `key1=value1,key2=value2`, values percent-decoded (the W3C Baggage format the specification
/// uses for headers and resource attributes).
fn key_values(key: &str, v: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((k, val)) = item.split_once('=') else {
            return Err(invalid(key, format!("{:?} is not key=value", shown(item))));
        };
        let k = k.trim();
        if k.is_empty() {
            return Err(invalid(key, "an entry has an empty key"));
        }
        let val = percent_encoding::percent_decode_str(val.trim())
            .decode_utf8()
            .map_err(|_| invalid(key, format!("the value of {k:?} is not UTF-8 once decoded")))?;
        out.push((k.to_owned(), val.into_owned()));
    }
    Ok(out)
}

/// An entry of a header list, shown in an error without its value (it may be a secret).
fn shown(item: &str) -> String {
    if item.len() > 24 {
        format!("{}...", item.chars().take(12).collect::<String>())
    } else {
        item.to_owned()
    }
}

fn sampler(name: Option<&str>, arg: Option<&str>) -> Result<Sampler, ConfigError> {
    let ratio = || -> Result<f64, ConfigError> {
        match arg {
            None => Ok(1.0),
            Some(a) => match a.parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
                _ => Err(invalid(
                    OTEL_TRACES_SAMPLER_ARG,
                    format!("{a:?} is not a ratio between 0 and 1"),
                )),
            },
        }
    };
    Ok(match name.unwrap_or("parentbased_always_on") {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::Ratio(ratio()?),
        "parentbased_always_on" => Sampler::ParentBased(Root::AlwaysOn),
        "parentbased_always_off" => Sampler::ParentBased(Root::AlwaysOff),
        "parentbased_traceidratio" => Sampler::ParentBased(Root::Ratio(ratio()?)),
        other => {
            return Err(invalid(
                OTEL_TRACES_SAMPLER,
                format!(
                    "{other:?} is not supported; use always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
                ),
            ));
        }
    })
}

fn propagators(v: &str) -> Result<Propagators, ConfigError> {
    let mut p = Propagators {
        tracecontext: false,
        baggage: false,
    };
    for name in v.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "tracecontext" => p.tracecontext = true,
            "baggage" => p.baggage = true,
            "none" => {}
            other => {
                return Err(invalid(
                    OTEL_PROPAGATORS,
                    format!("{other:?} is not supported; use tracecontext, baggage or none"),
                ));
            }
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(pairs: &[(&str, &str)]) -> Result<OtelSettings, ConfigError> {
        let env = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        resolve(&env)
    }

    fn export(pairs: &[(&str, &str)]) -> Export {
        match resolved(pairs) {
            Ok(OtelSettings { export: Some(e) }) => e,
            other => panic!("expected export for {pairs:?}, got {other:?}"),
        }
    }

    fn refused(pairs: &[(&str, &str)]) -> String {
        match resolved(pairs) {
            Err(ConfigError::Invalid { key, problem }) => format!("{key}: {problem}"),
            other => panic!("expected a refusal for {pairs:?}, got {other:?}"),
        }
    }

    const EP: (&str, &str) = (OTEL_EXPORTER_OTLP_ENDPOINT, "http://127.0.0.1:4317");

    #[test]
    fn off_unless_an_endpoint_is_set_and_the_off_switches_always_win() {
        assert_eq!(resolved(&[]).ok(), Some(OtelSettings::default()));
        assert!(
            resolved(&[(OTEL_SERVICE_NAME, "x")])
                .unwrap()
                .export
                .is_none()
        );
        assert!(resolved(&[EP]).unwrap().export.is_some());
        assert!(
            resolved(&[(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "http://c:4317")])
                .unwrap()
                .export
                .is_some()
        );
        assert!(
            resolved(&[EP, (OTEL_SDK_DISABLED, "TRUE")])
                .unwrap()
                .export
                .is_none()
        );
        assert!(
            resolved(&[EP, (OTEL_TRACES_EXPORTER, "none")])
                .unwrap()
                .export
                .is_none()
        );
        assert!(
            resolved(&[EP, (OTEL_SDK_DISABLED, "false")])
                .unwrap()
                .export
                .is_some()
        );
        assert!(
            resolved(&[EP, (OTEL_TRACES_EXPORTER, "otlp")])
                .unwrap()
                .export
                .is_some()
        );
    }

    #[test]
    fn defaults_are_the_specifications() {
        let e = export(&[EP]);
        assert_eq!(e.protocol, Protocol::Grpc);
        assert_eq!(e.endpoint, "http://127.0.0.1:4317");
        assert_eq!(e.timeout, Duration::from_secs(10));
        assert_eq!(e.sampler, Sampler::ParentBased(Root::AlwaysOn));
        assert_eq!(
            e.propagators,
            Propagators {
                tracecontext: true,
                baggage: true
            }
        );
        assert_eq!((e.queue, e.batch), (2048, 512));
        assert!(!e.capture_content);
        assert_eq!(e.service_name, None);
    }

    #[test]
    fn http_protobuf_appends_the_signal_path_to_the_generic_endpoint_only() {
        let http = (OTEL_EXPORTER_OTLP_PROTOCOL, "http/protobuf");
        let e = export(&[(OTEL_EXPORTER_OTLP_ENDPOINT, "http://c:4318/"), http]);
        assert_eq!(e.protocol, Protocol::HttpProtobuf);
        assert_eq!(e.endpoint, "http://c:4318/v1/traces");
        let e = export(&[
            (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "http://c:4318/custom"),
            http,
        ]);
        assert_eq!(e.endpoint, "http://c:4318/custom");
        // The signal's own protocol beats the generic one.
        let e = export(&[EP, http, (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "grpc")]);
        assert_eq!(e.protocol, Protocol::Grpc);
    }

    #[test]
    fn headers_resources_sampler_and_service_name_are_read() {
        let e = export(&[
            EP,
            (OTEL_EXPORTER_OTLP_HEADERS, "api-key=s%20ecret, x-team=llm"),
            (
                OTEL_RESOURCE_ATTRIBUTES,
                "deployment.environment.name=prod,service.name=from-res",
            ),
            (OTEL_TRACES_SAMPLER, "parentbased_traceidratio"),
            (OTEL_TRACES_SAMPLER_ARG, "0.25"),
            (OTEL_EXPORTER_OTLP_TIMEOUT, "2500"),
            (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT, "true"),
        ]);
        assert_eq!(
            e.headers,
            vec![
                ("api-key".to_owned(), "s ecret".to_owned()),
                ("x-team".to_owned(), "llm".to_owned())
            ]
        );
        assert_eq!(e.service_name.as_deref(), Some("from-res"));
        assert_eq!(e.sampler, Sampler::ParentBased(Root::Ratio(0.25)));
        assert_eq!(e.timeout, Duration::from_millis(2500));
        assert!(e.capture_content);
        // The header values never reach a log line.
        assert!(!format!("{e:?}").contains("ecret"));
        let e = export(&[
            EP,
            (OTEL_SERVICE_NAME, "mine"),
            (OTEL_RESOURCE_ATTRIBUTES, "service.name=res"),
        ]);
        assert_eq!(e.service_name.as_deref(), Some("mine"));
        let p = export(&[EP, (OTEL_PROPAGATORS, "tracecontext")]).propagators;
        assert!(p.tracecontext && !p.baggage);
        let p = export(&[EP, (OTEL_PROPAGATORS, "none")]).propagators;
        assert!(!p.tracecontext && !p.baggage);
    }

    #[test]
    fn the_charts_settings_are_accepted() {
        // helm/nm-gateway/templates/_helpers.tpl, "nm-gateway.otelEnv", as Kubernetes fills it.
        let e = export(&[
            (OTEL_SERVICE_NAME, "nm-dataplane"),
            (
                OTEL_EXPORTER_OTLP_ENDPOINT,
                "http://otel-collector.observability.svc:4317",
            ),
            (OTEL_EXPORTER_OTLP_PROTOCOL, "grpc"),
            (OTEL_TRACES_SAMPLER, "parentbased_traceidratio"),
            (OTEL_TRACES_SAMPLER_ARG, "0.1"),
            (
                OTEL_RESOURCE_ATTRIBUTES,
                "k8s.pod.name=nm-dp-7c9,k8s.namespace.name=llm,k8s.node.name=n1,k8s.pod.uid=0f1e,service.instance.id=0f1e,service.version=0.1.0,app.kubernetes.io/component=dataplane,app.kubernetes.io/instance=nm",
            ),
            (OTEL_EXPORTER_OTLP_HEADERS, "authorization=Bearer%20abc"),
        ]);
        assert_eq!(e.service_name.as_deref(), Some("nm-dataplane"));
        assert_eq!(e.sampler, Sampler::ParentBased(Root::Ratio(0.1)));
        assert_eq!(e.resource.len(), 8);
        assert_eq!(e.headers[0].1, "Bearer abc");
    }

    #[test]
    fn bad_values_are_refused_naming_the_variable_even_with_tracing_off() {
        for (pairs, key) in [
            (vec![(OTEL_SDK_DISABLED, "yes")], OTEL_SDK_DISABLED),
            (vec![(OTEL_TRACES_EXPORTER, "jaeger")], OTEL_TRACES_EXPORTER),
            (
                vec![(OTEL_EXPORTER_OTLP_PROTOCOL, "http/json")],
                OTEL_EXPORTER_OTLP_PROTOCOL,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_ENDPOINT, "127.0.0.1:4317")],
                OTEL_EXPORTER_OTLP_ENDPOINT,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "ftp://c")],
                OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_ENDPOINT, "http://u:p@c:4317")],
                OTEL_EXPORTER_OTLP_ENDPOINT,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_HEADERS, "novalue")],
                OTEL_EXPORTER_OTLP_HEADERS,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_TRACES_HEADERS, "=x")],
                OTEL_EXPORTER_OTLP_TRACES_HEADERS,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_TIMEOUT, "10s")],
                OTEL_EXPORTER_OTLP_TIMEOUT,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_TIMEOUT, "0")],
                OTEL_EXPORTER_OTLP_TIMEOUT,
            ),
            (
                vec![(OTEL_TRACES_SAMPLER, "jaeger_remote")],
                OTEL_TRACES_SAMPLER,
            ),
            (
                vec![
                    (OTEL_TRACES_SAMPLER, "traceidratio"),
                    (OTEL_TRACES_SAMPLER_ARG, "1.5"),
                ],
                OTEL_TRACES_SAMPLER_ARG,
            ),
            (
                vec![
                    (OTEL_TRACES_SAMPLER, "traceidratio"),
                    (OTEL_TRACES_SAMPLER_ARG, "half"),
                ],
                OTEL_TRACES_SAMPLER_ARG,
            ),
            (vec![(OTEL_PROPAGATORS, "b3")], OTEL_PROPAGATORS),
            (
                vec![(OTEL_RESOURCE_ATTRIBUTES, "a")],
                OTEL_RESOURCE_ATTRIBUTES,
            ),
            (
                vec![(OTEL_BSP_MAX_QUEUE_SIZE, "0")],
                OTEL_BSP_MAX_QUEUE_SIZE,
            ),
            (
                vec![(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, "4096")],
                OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
            ),
            (
                vec![(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT, "1")],
                OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT,
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_CERTIFICATE, "/nonexistent/ca.pem")],
                OTEL_EXPORTER_OTLP_CERTIFICATE,
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/k.pem")],
                "OTEL_EXPORTER_OTLP_CLIENT_KEY",
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")],
                "OTEL_EXPORTER_OTLP_COMPRESSION",
            ),
            (
                vec![(OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE, "/etc/hostname")],
                OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE,
            ),
        ] {
            let msg = refused(&pairs);
            assert!(msg.starts_with(&format!("{key}: ")), "{msg}");
        }
        // A header value stays out of the message.
        let msg = refused(&[(
            OTEL_EXPORTER_OTLP_HEADERS,
            "authorization-bearer-topsecretvalue",
        )]);
        assert!(!msg.contains("topsecretvalue"), "{msg}");
    }
}
