//! Settings: one typed [`Settings`], resolved once at start by [`resolve`] from flags, the
//! environment, an optional TOML file and defaults, in that order of precedence.
//!
//! The environment comes in as a map, so tests never touch the process environment. Every
//! problem names the setting and the fix; `main` exits 64 on any of them.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nm_dataplane::{AuthStyle, ErrorStyle, ProviderSpec, Registry};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::Deserialize;

// === names and defaults, side by side ===

pub const ENV_HTTP_ADDR: &str = "NM_HTTP_ADDR";
pub const DEFAULT_HTTP_ADDR: &str = "0.0.0.0:8080";
pub const ENV_GRPC_ADDR: &str = "NM_GRPC_ADDR";
pub const DEFAULT_GRPC_ADDR_SERVE: &str = "127.0.0.1:50051";
pub const DEFAULT_GRPC_ADDR_CONTROLPLANE: &str = "0.0.0.0:50051";
pub const ENV_CONTROLPLANE_URL: &str = "NM_CONTROLPLANE_URL";
pub const DEFAULT_CONTROLPLANE_URL: &str = "http://127.0.0.1:50051";
pub const ENV_DATABASE_URL: &str = "NM_DATABASE_URL";
pub const DEFAULT_DATABASE_URL: &str = "sqlite://./nm-data/nm-gateway.db?mode=rwc";
pub const ENV_UPSTREAM_PREFIX: &str = "NM_UPSTREAM_";
pub const ENV_PROVIDER_KEY_PREFIX: &str = "NM_PROVIDER_KEY_";
pub const ENV_BOOTSTRAP_KEY: &str = "NM_BOOTSTRAP_KEY";
pub const ENV_ADMIN_KEY: &str = "NM_ADMIN_KEY";
pub const ENV_LOG: &str = "NM_LOG";
pub const DEFAULT_LOG: &str = "info";
pub const ENV_LOG_FORMAT: &str = "NM_LOG_FORMAT";
pub const ENV_MAX_BODY_BYTES: &str = "NM_MAX_BODY_BYTES";
pub const DEFAULT_MAX_BODY_BYTES: usize = nm_dataplane::DEFAULT_MAX_BODY_BYTES;
pub const ENV_CONNECT_TIMEOUT_SECS: &str = "NM_CONNECT_TIMEOUT_SECS";
pub const DEFAULT_CONNECT_TIMEOUT_SECS: u64 = 10;
pub const ENV_HEADER_TIMEOUT_SECS: &str = "NM_HEADER_TIMEOUT_SECS";
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 600;
pub const ENV_SHUTDOWN_GRACE_SECS: &str = "NM_SHUTDOWN_GRACE_SECS";
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
pub const ENV_TLS_CA_FILE: &str = "NM_TLS_CA_FILE";
pub const ENV_RECORD_QUEUE: &str = "NM_RECORD_QUEUE";
pub const DEFAULT_RECORD_QUEUE: usize = 65_536;
pub const ENV_SPOOL_DIR: &str = "NM_SPOOL_DIR";
pub const DEFAULT_SPOOL_DIR: &str = "./nm-data/spool";
pub const ENV_SPOOL_MAX_BYTES: &str = "NM_SPOOL_MAX_BYTES";
pub const DEFAULT_SPOOL_MAX_BYTES: u64 = 256 * 1024 * 1024;
pub const ENV_RESERVE_OUTPUT_TOKENS: &str = "NM_RESERVE_OUTPUT_TOKENS";
pub const DEFAULT_RESERVE_OUTPUT_TOKENS: u64 = nm_dataplane::DEFAULT_RESERVE_OUTPUT_TOKENS;
/// Seconds between the controlplane's scheduled analytics recomputations; 0 turns them off.
pub const ENV_ANALYTICS_INTERVAL_SECS: &str = "NM_ANALYTICS_INTERVAL_SECS";
pub const DEFAULT_ANALYTICS_INTERVAL_SECS: u64 = 600;

/// Which process shape is starting; some defaults depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Serve,
    Dataplane,
    Controlplane,
    /// An admin CLI command (only the controlplane URL and admin key matter).
    Client,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Values given on the command line (all optional).
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub http_addr: Option<String>,
    pub grpc_addr: Option<String>,
    pub controlplane_url: Option<String>,
    pub database_url: Option<String>,
    pub admin_key: Option<String>,
    pub log_format: Option<String>,
}

/// The optional TOML file (`--config FILE`). Unknown keys are an error: a typo must not be
/// silently ignored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    pub http_addr: Option<String>,
    pub grpc_addr: Option<String>,
    pub controlplane_url: Option<String>,
    pub database_url: Option<String>,
    pub bootstrap_key: Option<String>,
    pub admin_key: Option<String>,
    pub log: Option<String>,
    pub log_format: Option<LogFormat>,
    pub max_body_bytes: Option<usize>,
    pub connect_timeout_secs: Option<u64>,
    pub header_timeout_secs: Option<u64>,
    pub shutdown_grace_secs: Option<u64>,
    pub record_queue: Option<usize>,
    pub tls_ca_file: Option<PathBuf>,
    pub spool_dir: Option<PathBuf>,
    pub spool_max_bytes: Option<u64>,
    pub reserve_output_tokens: Option<u64>,
    pub analytics_interval_secs: Option<u64>,
    /// Extra providers, or changes to built-in ones, by name.
    #[serde(default)]
    pub providers: BTreeMap<String, FileProvider>,
    /// Model prices added to, or replacing, the built-in table (`[[prices]]`).
    #[serde(default)]
    pub prices: Vec<nm_dataplane::pricing::PriceSpec>,
}

/// A provider in the config file. For a built-in name every field is optional (it changes the
/// built-in); a new name needs `base_url` and `auth`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileProvider {
    pub base_url: Option<String>,
    pub auth: Option<AuthStyle>,
    pub errors: Option<ErrorStyle>,
    pub aliases: Option<Vec<String>>,
    pub api_key: Option<String>,
}

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub mode: Mode,
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    pub controlplane_url: String,
    pub database_url: String,
    pub bootstrap_key: Option<String>,
    pub admin_key: Option<String>,
    pub log: String,
    pub log_format: LogFormat,
    pub registry: Registry,
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    pub header_timeout: Duration,
    pub shutdown_grace: Duration,
    pub record_queue: usize,
    /// CA certificates (from `NM_TLS_CA_FILE`) trusted for upstream TLS beside the web PKI.
    pub extra_ca_certs: Vec<CertificateDer<'static>>,
    /// Where a dataplane spools records while its controlplane is unreachable, and the cap.
    pub spool_dir: PathBuf,
    pub spool_max_bytes: u64,
    /// Answer length assumed for a budget reservation when a request sets no cap.
    pub reserve_output_tokens: u64,
    pub prices: nm_dataplane::pricing::PriceTable,
    /// Interval of the scheduled analytics recomputation (controlplane); `None`: off.
    pub analytics_interval: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{key}: {problem}")]
    Invalid { key: String, problem: String },
    #[error("config file {path}: {problem}")]
    File { path: PathBuf, problem: String },
}

fn invalid(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        problem: problem.into(),
    }
}

/// Reads and parses a TOML settings file.
pub fn load_file(path: &Path) -> Result<FileSettings, ConfigError> {
    let file_err = |problem: String| ConfigError::File {
        path: path.to_owned(),
        problem,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?;
    toml::from_str(&text).map_err(|e| file_err(e.to_string()))
}

/// Flag > env > file > default, validated.
pub fn resolve(
    mode: Mode,
    flags: &Flags,
    env: &HashMap<String, String>,
    file: FileSettings,
) -> Result<Settings, ConfigError> {
    let env_get = |k: &str| env.get(k).filter(|v| !v.is_empty()).cloned();
    let pick = |flag: &Option<String>, key: &str, file: Option<String>| {
        flag.clone().or_else(|| env_get(key)).or(file)
    };

    let grpc_default = if mode == Mode::Controlplane {
        DEFAULT_GRPC_ADDR_CONTROLPLANE
    } else {
        DEFAULT_GRPC_ADDR_SERVE
    };
    let http_addr = parse_addr(
        ENV_HTTP_ADDR,
        pick(&flags.http_addr, ENV_HTTP_ADDR, file.http_addr),
        DEFAULT_HTTP_ADDR,
    )?;
    let grpc_addr = parse_addr(
        ENV_GRPC_ADDR,
        pick(&flags.grpc_addr, ENV_GRPC_ADDR, file.grpc_addr),
        grpc_default,
    )?;

    let controlplane_url = pick(
        &flags.controlplane_url,
        ENV_CONTROLPLANE_URL,
        file.controlplane_url,
    )
    .unwrap_or_else(|| DEFAULT_CONTROLPLANE_URL.to_owned());
    let cp_uri: http::Uri = controlplane_url.parse().map_err(|_| {
        invalid(
            ENV_CONTROLPLANE_URL,
            format!("{controlplane_url:?} is not a URL; use http://HOST:PORT"),
        )
    })?;
    if !matches!(cp_uri.scheme_str(), Some("http" | "https")) || cp_uri.authority().is_none() {
        return Err(invalid(
            ENV_CONTROLPLANE_URL,
            format!("{controlplane_url:?} must be http://HOST:PORT or https://HOST:PORT"),
        ));
    }

    let database_url = pick(&flags.database_url, ENV_DATABASE_URL, file.database_url)
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
    if !["sqlite:", "postgres://", "postgresql://"]
        .iter()
        .any(|p| database_url.starts_with(p))
    {
        return Err(invalid(
            ENV_DATABASE_URL,
            "must start with sqlite:// or postgres://",
        ));
    }

    let log_format = match pick(&flags.log_format, ENV_LOG_FORMAT, None) {
        Some(s) => match s.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(invalid(
                    ENV_LOG_FORMAT,
                    format!("{other:?} is not one of text, json"),
                ));
            }
        },
        None => file.log_format.unwrap_or_default(),
    };

    let num = |key: &str, file: Option<u64>, default: u64| -> Result<u64, ConfigError> {
        match env_get(key) {
            Some(v) => v
                .trim()
                .parse::<u64>()
                .map_err(|_| invalid(key, format!("{v:?} is not a whole number"))),
            None => Ok(file.unwrap_or(default)),
        }
    };
    let max_body_bytes = num(
        ENV_MAX_BODY_BYTES,
        file.max_body_bytes.map(|v| v as u64),
        DEFAULT_MAX_BODY_BYTES as u64,
    )?;
    let max_body_bytes = usize::try_from(max_body_bytes)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| invalid(ENV_MAX_BODY_BYTES, "must be a positive number of bytes"))?;
    let connect = num(
        ENV_CONNECT_TIMEOUT_SECS,
        file.connect_timeout_secs,
        DEFAULT_CONNECT_TIMEOUT_SECS,
    )?;
    let header = num(
        ENV_HEADER_TIMEOUT_SECS,
        file.header_timeout_secs,
        DEFAULT_HEADER_TIMEOUT_SECS,
    )?;
    if connect == 0 || header == 0 {
        return Err(invalid(
            ENV_CONNECT_TIMEOUT_SECS,
            "timeouts must be at least 1 second",
        ));
    }
    let grace = num(
        ENV_SHUTDOWN_GRACE_SECS,
        file.shutdown_grace_secs,
        DEFAULT_SHUTDOWN_GRACE_SECS,
    )?;
    let record_queue = num(
        ENV_RECORD_QUEUE,
        file.record_queue.map(|v| v as u64),
        DEFAULT_RECORD_QUEUE as u64,
    )?;

    let spool_max_bytes = num(
        ENV_SPOOL_MAX_BYTES,
        file.spool_max_bytes,
        DEFAULT_SPOOL_MAX_BYTES,
    )?;
    if spool_max_bytes < 1024 * 1024 {
        return Err(invalid(
            ENV_SPOOL_MAX_BYTES,
            "must be at least 1048576 (1 MiB)",
        ));
    }
    let reserve_output_tokens = num(
        ENV_RESERVE_OUTPUT_TOKENS,
        file.reserve_output_tokens,
        DEFAULT_RESERVE_OUTPUT_TOKENS,
    )?;
    let analytics_interval = num(
        ENV_ANALYTICS_INTERVAL_SECS,
        file.analytics_interval_secs,
        DEFAULT_ANALYTICS_INTERVAL_SECS,
    )?;
    let analytics_interval =
        (analytics_interval > 0).then(|| Duration::from_secs(analytics_interval));
    let spool_dir = env_get(ENV_SPOOL_DIR)
        .map(PathBuf::from)
        .or(file.spool_dir)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SPOOL_DIR));
    let price_rows = file
        .prices
        .into_iter()
        .map(nm_dataplane::pricing::PriceRow::try_from)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid("prices", e.to_string()))?;
    let prices = nm_dataplane::pricing::PriceTable::builtin().with_overrides(price_rows);

    let registry = providers(env, file.providers)?;
    let extra_ca_certs = match env_get(ENV_TLS_CA_FILE)
        .map(PathBuf::from)
        .or(file.tls_ca_file)
    {
        Some(path) => load_certs(&path)?,
        None => Vec::new(),
    };

    Ok(Settings {
        mode,
        http_addr,
        grpc_addr,
        controlplane_url,
        database_url,
        bootstrap_key: env_get(ENV_BOOTSTRAP_KEY).or(file.bootstrap_key),
        admin_key: pick(&flags.admin_key, ENV_ADMIN_KEY, file.admin_key),
        log: env_get(ENV_LOG)
            .or(file.log)
            .unwrap_or_else(|| DEFAULT_LOG.to_owned()),
        log_format,
        registry,
        max_body_bytes,
        connect_timeout: Duration::from_secs(connect),
        header_timeout: Duration::from_secs(header),
        shutdown_grace: Duration::from_secs(grace),
        record_queue: usize::try_from(record_queue).unwrap_or(usize::MAX).max(1),
        extra_ca_certs,
        spool_dir,
        spool_max_bytes,
        reserve_output_tokens,
        prices,
        analytics_interval,
    })
}

/// Every certificate in a PEM file; at least one.
fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bad = |problem: String| invalid(ENV_TLS_CA_FILE, format!("{}: {problem}", path.display()));
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in the file".to_owned()));
    }
    Ok(certs)
}

fn parse_addr(key: &str, value: Option<String>, default: &str) -> Result<SocketAddr, ConfigError> {
    let v = value.unwrap_or_else(|| default.to_owned());
    v.parse().map_err(|_| {
        invalid(
            key,
            format!("{v:?} is not an address; use IP:PORT, e.g. 0.0.0.0:8080"),
        )
    })
}

/// Built-ins, then config-file providers, then `NM_UPSTREAM_*` / `NM_PROVIDER_KEY_*`.
fn providers(
    env: &HashMap<String, String>,
    file: BTreeMap<String, FileProvider>,
) -> Result<Registry, ConfigError> {
    let mut specs: BTreeMap<String, ProviderSpec> = nm_dataplane::providers::builtin()
        .into_iter()
        .map(|(n, s)| (n.to_owned(), s))
        .collect();

    for (name, fp) in file {
        let key = format!("providers.{name}");
        let spec = match specs.remove(&name) {
            Some(mut s) => {
                if let Some(u) = fp.base_url {
                    s.base_url = u;
                }
                s.auth = fp.auth.unwrap_or(s.auth);
                s.errors = fp.errors.unwrap_or(s.errors);
                if let Some(a) = fp.aliases {
                    s.aliases = a;
                }
                s.api_key = fp.api_key.or(s.api_key);
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
                errors: fp.errors.unwrap_or(ErrorStyle::Openai),
                aliases: fp.aliases.unwrap_or_default(),
                api_key: fp.api_key,
            },
        };
        specs.insert(name, spec);
    }

    for (key, value) in env.iter().filter(|(_, v)| !v.is_empty()) {
        let (field, suffix) = if let Some(s) = key.strip_prefix(ENV_UPSTREAM_PREFIX) {
            ("upstream", s)
        } else if let Some(s) = key.strip_prefix(ENV_PROVIDER_KEY_PREFIX) {
            ("key", s)
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
        if field == "upstream" {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_need_nothing() {
        let s = resolve(
            Mode::Serve,
            &Flags::default(),
            &HashMap::new(),
            FileSettings::default(),
        );
        let s = s.ok();
        assert_eq!(
            s.as_ref().map(|s| s.http_addr.to_string()).as_deref(),
            Some("0.0.0.0:8080")
        );
        assert_eq!(
            s.as_ref().map(|s| s.grpc_addr.to_string()).as_deref(),
            Some("127.0.0.1:50051")
        );
        assert_eq!(
            s.as_ref().map(|s| s.database_url.as_str()),
            Some(DEFAULT_DATABASE_URL)
        );
        let c = resolve(
            Mode::Controlplane,
            &Flags::default(),
            &HashMap::new(),
            FileSettings::default(),
        )
        .ok();
        assert_eq!(
            c.map(|s| s.grpc_addr.to_string()).as_deref(),
            Some("0.0.0.0:50051")
        );
    }

    #[test]
    fn flag_beats_env_beats_file() {
        let file = FileSettings {
            http_addr: Some("127.0.0.1:1".into()),
            ..Default::default()
        };
        let e = env(&[(ENV_HTTP_ADDR, "127.0.0.1:2")]);
        let flags = Flags {
            http_addr: Some("127.0.0.1:3".into()),
            ..Default::default()
        };
        let port = |f: &Flags, e: &HashMap<String, String>| {
            resolve(Mode::Serve, f, e, file.clone())
                .map(|s| s.http_addr.port())
                .unwrap_or(0)
        };
        assert_eq!(port(&flags, &e), 3);
        assert_eq!(port(&Flags::default(), &e), 2);
        assert_eq!(port(&Flags::default(), &HashMap::new()), 1);
    }

    #[test]
    fn provider_overrides_from_env_and_file() {
        let mut file = FileSettings::default();
        file.providers.insert(
            "local".into(),
            FileProvider {
                base_url: Some("http://127.0.0.1:7000/v".into()),
                auth: Some(AuthStyle::Bearer),
                ..Default::default()
            },
        );
        let e = env(&[
            ("NM_UPSTREAM_OPENAI", "http://127.0.0.1:9100"),
            ("NM_PROVIDER_KEY_ANTHROPIC", "sk-ant"),
        ]);
        let s = resolve(Mode::Serve, &Flags::default(), &e, file).ok();
        let reg = s.map(|s| s.registry).unwrap_or_default();
        assert_eq!(
            reg.get("openai")
                .map(|p| p.authority.to_string())
                .as_deref(),
            Some("127.0.0.1:9100")
        );
        assert_eq!(
            reg.get("anthropic")
                .and_then(|p| p.api_key.clone())
                .as_deref(),
            Some("sk-ant")
        );
        assert_eq!(reg.get("local").map(|p| p.base_path.as_str()), Some("/v"));
    }

    #[test]
    fn bad_values_name_the_setting() {
        let cases = [
            (ENV_HTTP_ADDR, "nonsense"),
            ("NM_UPSTREAM_NOPE", "http://x"),
            ("NM_UPSTREAM_OPENAI", "ftp://x"),
            (ENV_DATABASE_URL, "mysql://x"),
            (ENV_MAX_BODY_BYTES, "lots"),
            (ENV_LOG_FORMAT, "xml"),
            (ENV_CONTROLPLANE_URL, "localhost"),
        ];
        for (k, v) in cases {
            let err = resolve(
                Mode::Serve,
                &Flags::default(),
                &env(&[(k, v)]),
                FileSettings::default(),
            )
            .err();
            let msg = err.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                msg.contains(k) || msg.contains("providers"),
                "{k}={v}: {msg}"
            );
        }
    }

    #[test]
    fn file_rejects_unknown_keys() {
        assert!(toml::from_str::<FileSettings>("htp_addr = \"x\"").is_err());
        let f: Result<FileSettings, _> =
            toml::from_str("[providers.openai]\nbase_url = \"http://127.0.0.1:1\"\n");
        assert!(f.is_ok());
    }
}
