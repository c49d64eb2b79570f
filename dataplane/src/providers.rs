//! The provider registry: which `/<prefix>/` maps to which upstream base URL, how the provider
//! expects credentials, and which wire format it speaks ([`WireFormat`]: how its answers report
//! usage and what error shape its SDKs parse).
//!
//! Built-in providers come from [`builtin`]; the config file may add more or change a built-in's
//! base URL; `NM_UPSTREAM_<NAME>` and `NM_PROVIDER_KEY_<NAME>` override the URL and the
//! operator's credential (the root resolves those settings and hands us a finished list).

use foldhash::HashMap;
use std::sync::Arc;

use http::Uri;
use serde::Deserialize;

/// How a provider reads its API credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthStyle {
    /// `Authorization: Bearer <key>` (OpenAI and the OpenAI-compatible providers).
    Bearer,
    /// `x-api-key: <key>` (Anthropic).
    XApiKey,
    /// `x-goog-api-key: <key>` (Gemini).
    GoogApiKey,
}

/// The family of APIs a provider speaks. It decides both what the gateway reads from the answers
/// ([`crate::usage::Meter::new`]: where the token counts are) and the shape of the errors the
/// gateway makes on the provider's routes ([`crate::error::ProxyError::into_response`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireFormat {
    /// OpenAI and the OpenAI-compatible providers (groq, mistral, deepseek, xai, together,
    /// fireworks, openrouter): chat completions, completions, embeddings and the Responses API.
    /// Errors: `{"error": {"message", "type", "param", "code"}}`.
    Openai,
    /// Anthropic messages. Errors: `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
    /// Gemini `generateContent` / `streamGenerateContent` (SSE with `alt=sse`, a JSON array
    /// without). Errors: `{"error": {"code", "message", "status"}}`.
    Gemini,
}

/// One upstream provider, ready to route to.
#[derive(Debug, Clone)]
pub struct Provider {
    /// Canonical lowercase name, used in records and metrics.
    pub name: Arc<str>,
    /// Base URL parts: scheme + authority, and a path prefix without trailing `/`.
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    pub base_path: String,
    pub auth: AuthStyle,
    pub format: WireFormat,
    /// Credential the gateway adds when the client sends none.
    pub api_key: Option<String>,
    /// `gen_ai.provider.name` in traces: the OpenTelemetry name of a known provider, else ours.
    pub system: Arc<str>,
    /// Whether the upstream call carries the gateway's trace context (`traceparent`).
    pub trace_context: bool,
    /// `server.address` and `server.port` of its calls' spans: the authority's host, and its
    /// port or the scheme's (read once here, not on every traced call).
    pub server_address: Arc<str>,
    pub server_port: u16,
}

/// A provider's settings before validation (from built-ins, the config file or env).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSpec {
    pub base_url: String,
    pub auth: AuthStyle,
    #[serde(default = "default_format")]
    pub format: WireFormat,
    #[serde(default)]
    pub aliases: Vec<String>,
    #[serde(default)]
    pub api_key: Option<String>,
    /// Send the gateway's trace context upstream (`traceparent`) when tracing is on.
    #[serde(default = "default_true")]
    pub trace_context: bool,
}

fn default_true() -> bool {
    true
}

fn default_format() -> WireFormat {
    WireFormat::Openai
}

/// Built-in providers: name -> spec. Aliases are listed in the spec.
pub fn builtin() -> Vec<(&'static str, ProviderSpec)> {
    let spec = |base: &str, auth, format, aliases: &[&str]| ProviderSpec {
        base_url: base.to_owned(),
        auth,
        format,
        aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
        api_key: None,
        trace_context: true,
    };
    use AuthStyle::*;
    use WireFormat::*;
    vec![
        (
            "openai",
            spec("https://api.openai.com", Bearer, Openai, &[]),
        ),
        (
            "anthropic",
            spec("https://api.anthropic.com", XApiKey, Anthropic, &[]),
        ),
        (
            "gemini",
            spec(
                "https://generativelanguage.googleapis.com",
                GoogApiKey,
                Gemini,
                &["google"],
            ),
        ),
        ("groq", spec("https://api.groq.com", Bearer, Openai, &[])),
        (
            "mistral",
            spec("https://api.mistral.ai", Bearer, Openai, &[]),
        ),
        (
            "deepseek",
            spec("https://api.deepseek.com", Bearer, Openai, &[]),
        ),
        ("xai", spec("https://api.x.ai", Bearer, Openai, &[])),
        (
            "together",
            spec("https://api.together.xyz", Bearer, Openai, &[]),
        ),
        (
            "fireworks",
            spec("https://api.fireworks.ai/inference", Bearer, Openai, &[]),
        ),
        (
            "openrouter",
            spec("https://openrouter.ai/api", Bearer, Openai, &[]),
        ),
    ]
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error(
        "provider {name:?}: name must be lowercase letters, digits, '-' or '_', and not v1, health or metrics"
    )]
    BadName { name: String },
    #[error("provider {name:?}: base URL {url:?} is not an absolute http(s) URL without query")]
    BadUrl { name: String, url: String },
    #[error("provider {name:?}: alias {alias:?} is already taken")]
    DuplicateAlias { name: String, alias: String },
}

/// Prefix -> provider, aliases included.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    by_prefix: HashMap<String, Arc<Provider>>,
}

impl Registry {
    /// Builds the registry from named specs. Later entries with the same name replace earlier
    /// ones, so callers pass built-ins first and overrides after.
    pub fn build<I>(specs: I) -> Result<Self, RegistryError>
    where
        I: IntoIterator<Item = (String, ProviderSpec)>,
    {
        let mut merged: Vec<(String, ProviderSpec)> = Vec::new();
        for (name, spec) in specs {
            match merged.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = spec,
                None => merged.push((name, spec)),
            }
        }
        let mut by_prefix = HashMap::default();
        for (name, spec) in merged {
            let provider = Arc::new(validate(&name, &spec)?);
            for prefix in std::iter::once(&name).chain(&spec.aliases) {
                if !valid_name(prefix) {
                    return Err(RegistryError::BadName {
                        name: prefix.clone(),
                    });
                }
                if by_prefix.insert(prefix.clone(), provider.clone()).is_some() {
                    return Err(RegistryError::DuplicateAlias {
                        name: name.clone(),
                        alias: prefix.clone(),
                    });
                }
            }
        }
        Ok(Self { by_prefix })
    }

    /// The provider for a path prefix (case-insensitive).
    pub fn get(&self, prefix: &str) -> Option<&Arc<Provider>> {
        self.by_prefix.get(prefix).or_else(|| {
            prefix
                .bytes()
                .any(|b| b.is_ascii_uppercase())
                .then(|| self.by_prefix.get(&prefix.to_ascii_lowercase()))
                .flatten()
        })
    }

    /// Every canonical provider name, sorted.
    pub fn names(&self) -> Vec<Arc<str>> {
        let mut names: Vec<_> = self.by_prefix.values().map(|p| p.name.clone()).collect();
        names.sort();
        names.dedup();
        names
    }
}

fn valid_name(name: &str) -> bool {
    !crate::routes::is_reserved(name)
        && !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn validate(name: &str, spec: &ProviderSpec) -> Result<Provider, RegistryError> {
    if !valid_name(name) {
        return Err(RegistryError::BadName {
            name: name.to_owned(),
        });
    }
    let bad_url = || RegistryError::BadUrl {
        name: name.to_owned(),
        url: spec.base_url.clone(),
    };
    let uri: Uri = spec.base_url.parse().map_err(|_| bad_url())?;
    let scheme = uri.scheme().cloned().ok_or_else(bad_url)?;
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        return Err(bad_url());
    }
    let authority = uri.authority().cloned().ok_or_else(bad_url)?;
    if uri.query().is_some() || authority.as_str().contains('@') {
        return Err(bad_url());
    }
    let server_address = Arc::from(authority.host());
    let default_port = if scheme == http::uri::Scheme::HTTPS {
        443
    } else {
        80
    };
    let server_port = authority.port_u16().unwrap_or(default_port);
    Ok(Provider {
        name: Arc::from(name),
        scheme,
        authority,
        base_path: uri.path().trim_end_matches('/').to_owned(),
        auth: spec.auth,
        format: spec.format,
        api_key: spec.api_key.clone().filter(|k| !k.is_empty()),
        system: Arc::from(semconv_name(name)),
        trace_context: spec.trace_context,
        server_address,
        server_port,
    })
}

/// The OpenTelemetry GenAI name (`gen_ai.provider.name`) of a built-in provider; others keep
/// their configured name.
fn semconv_name(name: &str) -> &str {
    match name {
        "gemini" => "gcp.gemini",
        "mistral" => "mistral_ai",
        "xai" => "x_ai",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Registry {
        Registry::build(builtin().into_iter().map(|(n, s)| (n.to_owned(), s))).unwrap_or_default()
    }

    #[test]
    fn builtins_and_aliases_resolve() {
        let r = registry();
        for name in [
            "openai",
            "anthropic",
            "gemini",
            "groq",
            "mistral",
            "deepseek",
            "xai",
            "together",
            "fireworks",
            "openrouter",
        ] {
            assert_eq!(r.get(name).map(|p| &*p.name), Some(name));
        }
        assert_eq!(r.get("google").map(|p| &*p.name), Some("gemini"));
        assert_eq!(r.get("OpenAI").map(|p| &*p.name), Some("openai"));
        assert!(r.get("nope").is_none());
        assert_eq!(
            r.get("openrouter").map(|p| p.base_path.as_str()),
            Some("/api")
        );
    }

    #[test]
    fn overrides_replace_builtins() {
        let mut specs: Vec<_> = builtin()
            .into_iter()
            .map(|(n, s)| (n.to_owned(), s))
            .collect();
        let mut openai = specs[0].1.clone();
        openai.base_url = "http://127.0.0.1:9100/".to_owned();
        specs.push(("openai".to_owned(), openai));
        let r = Registry::build(specs).unwrap_or_default();
        let p = r.get("openai").cloned();
        assert_eq!(
            p.map(|p| p.authority.to_string()),
            Some("127.0.0.1:9100".to_owned())
        );
    }

    #[test]
    fn bad_specs_are_refused() {
        let spec = |url: &str| ProviderSpec {
            base_url: url.to_owned(),
            auth: AuthStyle::Bearer,
            format: WireFormat::Openai,
            aliases: vec![],
            api_key: None,
            trace_context: true,
        };
        for url in [
            "ftp://x",
            "not a url",
            "/relative",
            "http://u:p@host",
            "http://h/?q=1",
        ] {
            assert!(
                Registry::build([("x".to_owned(), spec(url))]).is_err(),
                "{url}"
            );
        }
        assert!(Registry::build([("Bad Name".to_owned(), spec("http://h"))]).is_err());
    }
}
