//! Providers and upstreams: the provider registry (built-ins, the file's `[providers.*]`, then
//! `NM_UPSTREAM_<PROVIDER>` and `NM_PROVIDER_KEY_<PROVIDER>`), the trust and timeouts of
//! upstream calls.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use nm_dataplane::{AuthStyle, ProviderSpec, Registry, WireFormat};
use rustls::pki_types::CertificateDer;
use serde::Deserialize;

use super::decl::{Chart, Default, Group, Kind, Lit, Raw, declare};
use super::{ConfigError, invalid, link, parse};

declare! { Group::Providers;
    /// base URL override, e.g. `NM_UPSTREAM_OPENAI=http://127.0.0.1:9100` (`<PROVIDER>`: the provider's name in upper case)
    UPSTREAM: () => family, {
        env: "NM_UPSTREAM_<PROVIDER>",
        default: Default::Described("the provider's public API base"),
        chart: Chart::Template,
    };
    /// provider credential added when the client sends none
    PROVIDER_KEY: () => family, {
        env: "NM_PROVIDER_KEY_<PROVIDER>",
        chart: Chart::Template,
    };
    /// for a controlplane that holds no provider credential: the providers (comma-separated names) whose operator credential the dataplanes hold, so an experiment may send arms there (the chart sets it from the provider keys' names)
    OPERATOR_CREDENTIALS: Vec<String> => operator_credentials, {
        env: "NM_OPERATOR_CREDENTIALS",
        file: Some(("operator_credentials", Kind::Str)),
        default: Default::Described("none beyond this process's own credentials"),
        chart: Chart::Template,
    };
    /// PEM file of CA certificates trusted for upstream TLS beside the public web PKI
    TLS_CA_FILE: Vec<CertificateDer<'static>> => ca_file, {
        env: "NM_TLS_CA_FILE",
        file: Some(("tls_ca_file", Kind::Str)),
    };
    /// upstream connect (TCP + TLS) timeout, in seconds
    CONNECT_TIMEOUT: Duration => parse::timeout_secs, {
        env: "NM_CONNECT_TIMEOUT_SECS",
        file: Some(("connect_timeout_secs", Kind::Int)),
        default: Default::Is(Lit::Int(10)),
        chart: Chart::Value("connectTimeoutSecs"),
    };
    /// time allowed for the upstream's response head, in seconds (a non-streamed answer arrives only when generated)
    HEADER_TIMEOUT: Duration => parse::timeout_secs, {
        env: "NM_HEADER_TIMEOUT_SECS",
        file: Some(("header_timeout_secs", Kind::Int)),
        default: Default::Is(Lit::Int(600)),
        chart: Chart::Value("headerTimeoutSecs"),
    };
    /// longest wait, in seconds, for the next piece of an upstream's answer body once its head arrived; past it the answer is cut (the client sees it incomplete) and recorded as `upstream_body_error`
    RESPONSE_IDLE_TIMEOUT: Duration => parse::secs_at_least_1, {
        env: "NM_RESPONSE_IDLE_TIMEOUT_SECS",
        file: Some(("response_idle_timeout_secs", Kind::Int)),
        default: Default::Is(Lit::Int(300)),
    };
}

fn operator_credentials(key: &'static str, raw: Raw<'_>) -> Result<Vec<String>, ConfigError> {
    let text = parse::text(key, raw)?;
    let names: Vec<String> = text
        .split(',')
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    if let Some(bad) = names.iter().find(|n| {
        !n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    }) {
        return Err(invalid(key, format!("{bad:?} is not a provider name")));
    }
    Ok(names)
}

/// The families are read by [`registry`], not by the walk.
fn family(_: &'static str, _: Raw<'_>) -> Result<(), ConfigError> {
    Ok(())
}

fn ca_file(key: &'static str, raw: Raw<'_>) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let path = parse::path(key, raw)?;
    link::load_certs_for(key, &path)
}

/// A provider in the config file. For a built-in name every field is optional (it changes the
/// built-in); a new name needs `base_url` and `auth`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileProvider {
    pub base_url: Option<String>,
    pub auth: Option<AuthStyle>,
    /// The API family it speaks: how its answers report usage, and its error shape.
    pub format: Option<WireFormat>,
    /// The older name of `format`, from when it chose only the error shape; still accepted.
    pub errors: Option<WireFormat>,
    pub aliases: Option<Vec<String>>,
    pub api_key: Option<String>,
    /// Whether the upstream call carries the gateway's trace context (default true).
    pub trace_context: Option<bool>,
}

/// Built-ins, then config-file providers, then `NM_UPSTREAM_*` / `NM_PROVIDER_KEY_*`.
pub(super) fn registry(
    env: &HashMap<String, String>,
    file: BTreeMap<String, FileProvider>,
) -> Result<Registry, ConfigError> {
    let mut specs: BTreeMap<String, ProviderSpec> = nm_dataplane::providers::builtin()
        .into_iter()
        .map(|(n, s)| (n.to_owned(), s))
        .collect();

    for (name, fp) in file {
        let key = format!("providers.{name}");
        let format = match (fp.format, fp.errors) {
            (Some(f), Some(e)) if f != e => {
                return Err(invalid(
                    &key,
                    "format and errors (its older name) disagree; set format only",
                ));
            }
            (f, e) => f.or(e),
        };
        let spec = match specs.remove(&name) {
            Some(mut s) => {
                if let Some(u) = fp.base_url {
                    s.base_url = u;
                }
                s.auth = fp.auth.unwrap_or(s.auth);
                s.format = format.unwrap_or(s.format);
                if let Some(a) = fp.aliases {
                    s.aliases = a;
                }
                s.api_key = fp.api_key.or(s.api_key);
                s.trace_context = fp.trace_context.unwrap_or(s.trace_context);
                s
            }
            None => ProviderSpec {
                base_url: fp
                    .base_url
                    .ok_or_else(|| invalid(&key, "a new provider needs base_url"))?,
                auth: fp.auth.ok_or_else(|| {
                    invalid(
                        &key,
                        "a new provider needs auth (bearer, x_api_key or goog_api_key)",
                    )
                })?,
                format: format.unwrap_or(WireFormat::Openai),
                aliases: fp.aliases.unwrap_or_default(),
                api_key: fp.api_key,
                trace_context: fp.trace_context.unwrap_or(true),
            },
        };
        specs.insert(name, spec);
    }

    let upstream = UPSTREAM.meta.prefix().unwrap_or_default();
    let provider_key = PROVIDER_KEY.meta.prefix().unwrap_or_default();
    for (key, value) in env.iter().filter(|(_, v)| !v.is_empty()) {
        let (is_upstream, suffix) = if let Some(s) = key.strip_prefix(upstream) {
            (true, s)
        } else if let Some(s) = key.strip_prefix(provider_key) {
            (false, s)
        } else {
            continue;
        };
        let name = suffix.to_ascii_lowercase();
        if !specs.contains_key(&name) {
            return Err(invalid(
                key,
                format!("names no provider; known: {}", known(&specs)),
            ));
        }
        let Some(spec) = specs.get_mut(&name) else {
            continue;
        };
        if is_upstream {
            spec.base_url = value.clone();
        } else {
            spec.api_key = Some(value.clone());
        }
    }

    Registry::build(specs).map_err(|e| invalid("providers", e.to_string()))
}

fn known(specs: &BTreeMap<String, ProviderSpec>) -> String {
    specs
        .keys()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}
