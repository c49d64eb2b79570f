//! Settings: one typed [`Settings`], resolved once at start by [`resolve`] from flags, the
//! environment, an optional TOML file and defaults, in that order of precedence.
//!
//! The environment comes in as a map, so tests never touch the process environment. Every
//! problem names the setting and the fix; `main` exits 64 on any of them.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nm_dataplane::hot_path::HotPath;
use nm_dataplane::{AuthStyle, ProviderSpec, Registry, WireFormat};
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
pub const ENV_LINK_SECRET: &str = "NM_LINK_SECRET";
/// Shortest accepted link secret or bootstrap key.
pub const MIN_SECRET_LEN: usize = 32;
/// The guesses a secret must need at least, as log10, by [`guesses_log10`]. Measured: random
/// strings of 32 characters (hex, base64, alphanumeric) estimate at 29 to 33; phrases of four
/// to six common words at 19 to 26; repeats, sequences and keyboard walks below 10.
pub const MIN_SECRET_GUESSES_LOG10: f64 = 27.0;
pub const ENV_GRPC_TLS_CERT: &str = "NM_GRPC_TLS_CERT";
pub const ENV_GRPC_TLS_KEY: &str = "NM_GRPC_TLS_KEY";
pub const ENV_GRPC_TLS_CLIENT_CA: &str = "NM_GRPC_TLS_CLIENT_CA";
pub const ENV_CONTROLPLANE_CA: &str = "NM_CONTROLPLANE_CA";
pub const ENV_CONTROLPLANE_CLIENT_CERT: &str = "NM_CONTROLPLANE_CLIENT_CERT";
pub const ENV_CONTROLPLANE_CLIENT_KEY: &str = "NM_CONTROLPLANE_CLIENT_KEY";
pub const ENV_LOG: &str = "NM_LOG";
pub const DEFAULT_LOG: &str = "info";
pub const ENV_LOG_FORMAT: &str = "NM_LOG_FORMAT";
pub const ENV_MAX_BODY_BYTES: &str = "NM_MAX_BODY_BYTES";
pub const DEFAULT_MAX_BODY_BYTES: usize = nm_dataplane::DEFAULT_MAX_BODY_BYTES;
pub const ENV_CONNECT_TIMEOUT_SECS: &str = "NM_CONNECT_TIMEOUT_SECS";
pub const DEFAULT_CONNECT_TIMEOUT_SECS: u64 = 10;
pub const ENV_HEADER_TIMEOUT_SECS: &str = "NM_HEADER_TIMEOUT_SECS";
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 600;
/// Time a client connection has to send a request head (from its accept; and on HTTP/1.1 from
/// the end of the previous answer).
pub const ENV_CLIENT_HEADER_TIMEOUT_SECS: &str = "NM_CLIENT_HEADER_TIMEOUT_SECS";
pub const DEFAULT_CLIENT_HEADER_TIMEOUT_SECS: u64 = 10;
/// Longest wait for the next frame of a client's request body.
pub const ENV_CLIENT_BODY_IDLE_TIMEOUT_SECS: &str = "NM_CLIENT_BODY_IDLE_TIMEOUT_SECS";
pub const DEFAULT_CLIENT_BODY_IDLE_TIMEOUT_SECS: u64 = 30;
/// Bytes per second a request body must average (after the idle timeout); 0: no minimum.
pub const ENV_CLIENT_BODY_MIN_RATE: &str = "NM_CLIENT_BODY_MIN_RATE";
pub const DEFAULT_CLIENT_BODY_MIN_RATE: u64 = 1024;
/// Longest wait for the next frame of an upstream's answer body.
pub const ENV_RESPONSE_IDLE_TIMEOUT_SECS: &str = "NM_RESPONSE_IDLE_TIMEOUT_SECS";
pub const DEFAULT_RESPONSE_IDLE_TIMEOUT_SECS: u64 = 300;
/// Most client connections open at once; 0: from the open-file limit.
pub const ENV_MAX_CONNECTIONS: &str = "NM_MAX_CONNECTIONS";
pub const DEFAULT_MAX_CONNECTIONS: u64 = 0;
pub const ENV_SHUTDOWN_GRACE_SECS: &str = "NM_SHUTDOWN_GRACE_SECS";
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
pub const ENV_TLS_CA_FILE: &str = "NM_TLS_CA_FILE";
pub const ENV_RECORD_QUEUE: &str = "NM_RECORD_QUEUE";
pub const DEFAULT_RECORD_QUEUE: usize = 65_536;
pub const ENV_SPOOL_DIR: &str = "NM_SPOOL_DIR";
pub const DEFAULT_SPOOL_DIR: &str = "./nm-data/spool";
pub const ENV_SPOOL_MAX_BYTES: &str = "NM_SPOOL_MAX_BYTES";
pub const DEFAULT_SPOOL_MAX_BYTES: u64 = 256 * 1024 * 1024;
/// Where a request record waits before the controlplane has it: `memory` or `spool` (on disk
/// before the answer ends), see `nm_dataplane::journal`.
pub const ENV_RECORD_DURABILITY: &str = "NM_RECORD_DURABILITY";
pub const DEFAULT_RECORD_DURABILITY: nm_dataplane::journal::Durability =
    nm_dataplane::journal::Durability::Memory;
pub const ENV_RESERVE_OUTPUT_TOKENS: &str = "NM_RESERVE_OUTPUT_TOKENS";
pub const DEFAULT_RESERVE_OUTPUT_TOKENS: u64 = nm_dataplane::DEFAULT_RESERVE_OUTPUT_TOKENS;
/// Seconds between the controlplane's scheduled analytics recomputations; 0 turns them off.
pub const ENV_ANALYTICS_INTERVAL_SECS: &str = "NM_ANALYTICS_INTERVAL_SECS";
/// Hot-path mechanisms to turn off, comma-separated (benchmarks only; [`nm_dataplane::hot_path`]).
pub const ENV_HOT_PATH_OFF: &str = "NM_HOT_PATH_OFF";
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
    pub link_secret: Option<String>,
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
    pub link_secret: Option<String>,
    pub grpc_tls_cert: Option<PathBuf>,
    pub grpc_tls_key: Option<PathBuf>,
    pub grpc_tls_client_ca: Option<PathBuf>,
    pub controlplane_ca: Option<PathBuf>,
    pub controlplane_client_cert: Option<PathBuf>,
    pub controlplane_client_key: Option<PathBuf>,
    pub log: Option<String>,
    pub log_format: Option<LogFormat>,
    pub max_body_bytes: Option<usize>,
    pub connect_timeout_secs: Option<u64>,
    pub header_timeout_secs: Option<u64>,
    pub shutdown_grace_secs: Option<u64>,
    pub client_header_timeout_secs: Option<u64>,
    pub client_body_idle_timeout_secs: Option<u64>,
    pub client_body_min_rate: Option<u64>,
    pub response_idle_timeout_secs: Option<u64>,
    pub max_connections: Option<u64>,
    pub record_queue: Option<usize>,
    pub tls_ca_file: Option<PathBuf>,
    pub spool_dir: Option<PathBuf>,
    pub spool_max_bytes: Option<u64>,
    pub record_durability: Option<String>,
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
    /// The API family it speaks: how its answers report usage, and its error shape.
    pub format: Option<WireFormat>,
    /// The older name of `format`, from when it chose only the error shape; still accepted.
    pub errors: Option<WireFormat>,
    pub aliases: Option<Vec<String>>,
    pub api_key: Option<String>,
    /// Whether the upstream call carries the gateway's trace context (default true).
    pub trace_context: Option<bool>,
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
    /// The shared secret of the internal link (`NM_LINK_SECRET`).
    pub link_secret: Option<Secret>,
    /// TLS of the controlplane's gRPC port (server side).
    pub grpc_tls: Option<ServerTls>,
    /// TLS toward the controlplane (dataplane and CLI side).
    pub controlplane_tls: ClientTls,
    pub log: String,
    pub log_format: LogFormat,
    pub registry: Registry,
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    pub header_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Client connection limits; `max_connections` 0 here means "from the open-file limit",
    /// decided when the dataplane starts.
    pub conn_limits: nm_dataplane::conns::ConnLimits,
    pub upstream_idle_timeout: Duration,
    pub record_queue: usize,
    /// CA certificates (from `NM_TLS_CA_FILE`) trusted for upstream TLS beside the web PKI.
    pub extra_ca_certs: Vec<CertificateDer<'static>>,
    /// Where a dataplane spools records while its controlplane is unreachable, and the cap.
    pub spool_dir: PathBuf,
    pub spool_max_bytes: u64,
    /// Whether a record is on disk before its answer ends (`NM_RECORD_DURABILITY`).
    pub record_durability: nm_dataplane::journal::Durability,
    /// Answer length assumed for a budget reservation when a request sets no cap.
    pub reserve_output_tokens: u64,
    pub prices: nm_dataplane::pricing::PriceTable,
    /// Interval of the scheduled analytics recomputation (controlplane); `None`: off.
    pub analytics_interval: Option<Duration>,
    /// The hot path's mechanisms: all on, unless a benchmark turns some off.
    pub hot_path: HotPath,
    /// OpenTelemetry export (`OTEL_*`), off unless an endpoint is set.
    pub otel: crate::otel::settings::OtelSettings,
}

/// A secret setting: never printed by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// PEM material for the controlplane's gRPC TLS, read at start.
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    /// With a client CA, clients must present a certificate it signed (mTLS).
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mtls", &self.client_ca_pem.is_some())
            .finish_non_exhaustive()
    }
}

/// PEM material for connecting to an `https://` controlplane, read at start.
#[derive(Clone, Default)]
pub struct ClientTls {
    /// CA certificates trusted for the controlplane (else the web PKI roots).
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate and key presented to the controlplane (mTLS).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_cert", &self.identity.is_some())
            .finish()
    }
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
    let at_least_1s =
        |key: &str, file: Option<u64>, default: u64| -> Result<Duration, ConfigError> {
            match num(key, file, default)? {
                0 => Err(invalid(key, "must be at least 1 second")),
                secs => Ok(Duration::from_secs(secs)),
            }
        };
    let client_header_timeout = at_least_1s(
        ENV_CLIENT_HEADER_TIMEOUT_SECS,
        file.client_header_timeout_secs,
        DEFAULT_CLIENT_HEADER_TIMEOUT_SECS,
    )?;
    let client_body_idle_timeout = at_least_1s(
        ENV_CLIENT_BODY_IDLE_TIMEOUT_SECS,
        file.client_body_idle_timeout_secs,
        DEFAULT_CLIENT_BODY_IDLE_TIMEOUT_SECS,
    )?;
    let upstream_idle_timeout = at_least_1s(
        ENV_RESPONSE_IDLE_TIMEOUT_SECS,
        file.response_idle_timeout_secs,
        DEFAULT_RESPONSE_IDLE_TIMEOUT_SECS,
    )?;
    let client_body_min_rate = num(
        ENV_CLIENT_BODY_MIN_RATE,
        file.client_body_min_rate,
        DEFAULT_CLIENT_BODY_MIN_RATE,
    )?;
    let max_connections = num(
        ENV_MAX_CONNECTIONS,
        file.max_connections,
        DEFAULT_MAX_CONNECTIONS,
    )?;
    let max_connections = usize::try_from(max_connections)
        .map_err(|_| invalid(ENV_MAX_CONNECTIONS, "is too large"))?;
    let conn_limits = nm_dataplane::conns::ConnLimits {
        header_timeout: client_header_timeout,
        max_connections,
        body_idle_timeout: client_body_idle_timeout,
        body_min_rate: client_body_min_rate,
    };
    let record_queue = num(
        ENV_RECORD_QUEUE,
        file.record_queue.map(|v| v as u64),
        DEFAULT_RECORD_QUEUE as u64,
    )?;

    let hot_path = match env_get(ENV_HOT_PATH_OFF) {
        None => HotPath::default(),
        Some(off) => HotPath::all_but(&off).ok_or_else(|| {
            invalid(
                ENV_HOT_PATH_OFF,
                format!(
                    "{off:?}: name mechanisms from {}",
                    nm_dataplane::hot_path::NAMES.join(", ")
                ),
            )
        })?,
    };

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
    let record_durability = match env_get(ENV_RECORD_DURABILITY).or(file.record_durability) {
        None => DEFAULT_RECORD_DURABILITY,
        Some(v) => nm_dataplane::journal::Durability::parse(v.trim()).ok_or_else(|| {
            invalid(
                ENV_RECORD_DURABILITY,
                format!("is {v:?}; use `memory` (the default) or `spool`"),
            )
        })?,
    };
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

    let bootstrap_key = env_get(ENV_BOOTSTRAP_KEY).or(file.bootstrap_key);
    if let Some(key) = &bootstrap_key {
        strong_secret(ENV_BOOTSTRAP_KEY, key)?;
    }
    let link_secret = pick(&flags.link_secret, ENV_LINK_SECRET, file.link_secret);
    if let Some(secret) = &link_secret {
        strong_secret(ENV_LINK_SECRET, secret)?;
        if secret.chars().any(|c| !c.is_ascii_graphic()) {
            return Err(invalid(
                ENV_LINK_SECRET,
                "must be printable ASCII without spaces (it travels in gRPC metadata)",
            ));
        }
    }
    let link_secret = link_secret.map(Secret);
    match mode {
        Mode::Controlplane if link_secret.is_none() && !grpc_addr.ip().is_loopback() => {
            return Err(invalid(
                ENV_LINK_SECRET,
                format!(
                    "required: the controlplane listens on {grpc_addr}, beyond this host, and \
                     dataplanes must prove they are ours; set the same random secret of at least \
                     {MIN_SECRET_LEN} characters on the controlplane and every dataplane (e.g. \
                     `openssl rand -hex 32`), or listen on 127.0.0.1"
                ),
            ));
        }
        Mode::Dataplane if link_secret.is_none() => {
            return Err(invalid(
                ENV_LINK_SECRET,
                "required: a dataplane presents the controlplane's link secret; set the same \
                 value as on the controlplane",
            ));
        }
        _ => {}
    }
    let path_of = |key: &str, file: Option<PathBuf>| env_get(key).map(PathBuf::from).or(file);
    let grpc_tls = server_tls(
        path_of(ENV_GRPC_TLS_CERT, file.grpc_tls_cert),
        path_of(ENV_GRPC_TLS_KEY, file.grpc_tls_key),
        path_of(ENV_GRPC_TLS_CLIENT_CA, file.grpc_tls_client_ca),
    )?;
    // Only the shapes that connect to a controlplane read the client side.
    let controlplane_tls = if matches!(mode, Mode::Dataplane | Mode::Client) {
        client_tls(
            cp_uri.scheme_str() == Some("https"),
            path_of(ENV_CONTROLPLANE_CA, file.controlplane_ca),
            path_of(ENV_CONTROLPLANE_CLIENT_CERT, file.controlplane_client_cert),
            path_of(ENV_CONTROLPLANE_CLIENT_KEY, file.controlplane_client_key),
        )?
    } else {
        ClientTls::default()
    };

    Ok(Settings {
        mode,
        http_addr,
        grpc_addr,
        controlplane_url,
        database_url,
        bootstrap_key,
        link_secret,
        grpc_tls,
        controlplane_tls,
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
        conn_limits,
        upstream_idle_timeout,
        record_queue: usize::try_from(record_queue).unwrap_or(usize::MAX).max(1),
        extra_ca_certs,
        spool_dir,
        spool_max_bytes,
        record_durability,
        reserve_output_tokens,
        prices,
        analytics_interval,
        hot_path,
        otel: crate::otel::settings::resolve(env)?,
    })
}

/// Refuses a secret an attacker could guess: shorter than [`MIN_SECRET_LEN`], or estimated by
/// zxcvbn (dictionary words, names, keyboard walks, repeats, sequences, dates) to fall in fewer
/// than 10^[`MIN_SECRET_GUESSES_LOG10`] guesses.
pub fn strong_secret(key: &str, secret: &str) -> Result<(), ConfigError> {
    let advice = format!(
        "use at least {MIN_SECRET_LEN} random characters, e.g. `nmk_$(openssl rand -hex 24)`"
    );
    if secret.chars().count() < MIN_SECRET_LEN {
        return Err(invalid(key, format!("too short: {advice}")));
    }
    if guesses_log10(secret) < MIN_SECRET_GUESSES_LOG10 {
        return Err(invalid(
            key,
            format!("too easy to guess (words, repeats or sequences): {advice}"),
        ));
    }
    Ok(())
}

/// An estimate of the guesses a secret needs (log10): zxcvbn's (dictionary words, names,
/// keyboard walks, repeats, sequences, dates), summed over the secret's runs of letters, digits
/// and other characters of at most 16 characters each. zxcvbn itself caps its estimate near
/// 10^19, which any string of 20 characters reaches, words or not; on short runs it is exact
/// enough, and the runs of a random string add up far beyond what words do.
pub fn guesses_log10(secret: &str) -> f64 {
    fn class(c: char) -> u8 {
        if c.is_alphabetic() {
            0
        } else if c.is_numeric() {
            1
        } else {
            2
        }
    }
    let mut runs: Vec<String> = Vec::new();
    let mut last = None;
    for c in secret.chars() {
        let full = runs.last().is_some_and(|r| r.chars().count() >= 16);
        if last != Some(class(c)) || full {
            runs.push(String::new());
        }
        if let Some(run) = runs.last_mut() {
            run.push(c);
        }
        last = Some(class(c));
    }
    runs.iter()
        .map(|run| zxcvbn::zxcvbn(run, &[]).guesses_log10())
        .sum()
}

/// Reads a PEM file named by setting `key`.
fn read_pem(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(key, format!("{}: {e}", path.display())))
}

/// The controlplane's TLS settings: certificate and key together, a client CA only with them.
fn server_tls(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<ServerTls>, ConfigError> {
    let (cert, key) = match (cert, key) {
        (None, None) if client_ca.is_some() => {
            return Err(invalid(
                ENV_GRPC_TLS_CLIENT_CA,
                format!("needs {ENV_GRPC_TLS_CERT} and {ENV_GRPC_TLS_KEY} (mTLS is TLS first)"),
            ));
        }
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(invalid(
                ENV_GRPC_TLS_KEY,
                format!("required with {ENV_GRPC_TLS_CERT}"),
            ));
        }
        (None, Some(_)) => {
            return Err(invalid(
                ENV_GRPC_TLS_CERT,
                format!("required with {ENV_GRPC_TLS_KEY}"),
            ));
        }
        (Some(c), Some(k)) => (c, k),
    };
    load_certs_for(ENV_GRPC_TLS_CERT, &cert)?;
    let client_ca_pem = match client_ca {
        Some(path) => {
            load_certs_for(ENV_GRPC_TLS_CLIENT_CA, &path)?;
            Some(read_pem(ENV_GRPC_TLS_CLIENT_CA, &path)?)
        }
        None => None,
    };
    let key_pem = read_pem(ENV_GRPC_TLS_KEY, &key)?;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| invalid(ENV_GRPC_TLS_KEY, format!("{}: {e}", key.display())))?;
    Ok(Some(ServerTls {
        cert_pem: read_pem(ENV_GRPC_TLS_CERT, &cert)?,
        key_pem,
        client_ca_pem,
    }))
}

/// TLS toward the controlplane; only for an `https://` URL.
fn client_tls(
    https: bool,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<ClientTls, ConfigError> {
    if !https {
        let set = [
            (ENV_CONTROLPLANE_CA, &ca),
            (ENV_CONTROLPLANE_CLIENT_CERT, &cert),
            (ENV_CONTROLPLANE_CLIENT_KEY, &key),
        ]
        .into_iter()
        .find(|(_, v)| v.is_some());
        if let Some((name, _)) = set {
            return Err(invalid(
                name,
                format!("set, but {ENV_CONTROLPLANE_URL} is not https://: TLS would not be used"),
            ));
        }
        return Ok(ClientTls::default());
    }
    let ca_pem = match ca {
        Some(path) => {
            load_certs_for(ENV_CONTROLPLANE_CA, &path)?;
            Some(read_pem(ENV_CONTROLPLANE_CA, &path)?)
        }
        None => None,
    };
    let identity = match (cert, key) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                ENV_CONTROLPLANE_CLIENT_KEY,
                format!("required with {ENV_CONTROLPLANE_CLIENT_CERT}"),
            ));
        }
        (None, Some(_)) => {
            return Err(invalid(
                ENV_CONTROLPLANE_CLIENT_CERT,
                format!("required with {ENV_CONTROLPLANE_CLIENT_KEY}"),
            ));
        }
        (Some(c), Some(k)) => {
            load_certs_for(ENV_CONTROLPLANE_CLIENT_CERT, &c)?;
            let key_pem = read_pem(ENV_CONTROLPLANE_CLIENT_KEY, &k)?;
            rustls::pki_types::PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
                invalid(ENV_CONTROLPLANE_CLIENT_KEY, format!("{}: {e}", k.display()))
            })?;
            Some((read_pem(ENV_CONTROLPLANE_CLIENT_CERT, &c)?, key_pem))
        }
    };
    Ok(ClientTls { ca_pem, identity })
}

/// Every certificate in a PEM file; at least one.
fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    load_certs_for(ENV_TLS_CA_FILE, path)
}

/// Every certificate in a PEM file named by setting `key`; at least one.
fn load_certs_for(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bad = |problem: String| invalid(key, format!("{}: {problem}", path.display()));
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
        // A controlplane listens beyond loopback by default, so it needs its link secret.
        let secret = env(&[(ENV_LINK_SECRET, STRONG)]);
        let c = resolve(
            Mode::Controlplane,
            &Flags::default(),
            &secret,
            FileSettings::default(),
        )
        .ok();
        assert_eq!(
            c.map(|s| s.grpc_addr.to_string()).as_deref(),
            Some("0.0.0.0:50051")
        );
    }

    const STRONG: &str = "lnk_9f3e7a1c5b2d8e4f6a0c3b7d1e5f9a2c4b6d8e0f";

    #[test]
    fn the_link_secret_is_required_where_the_link_leaves_the_host() {
        let resolve_with = |mode, pairs: &[(&str, &str)]| {
            resolve(
                mode,
                &Flags::default(),
                &env(pairs),
                FileSettings::default(),
            )
        };
        let err =
            |r: Result<Settings, ConfigError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(resolve_with(Mode::Controlplane, &[])).starts_with("NM_LINK_SECRET: required"));
        assert!(resolve_with(Mode::Controlplane, &[(ENV_GRPC_ADDR, "127.0.0.1:50051")]).is_ok());
        assert!(err(resolve_with(Mode::Dataplane, &[])).starts_with("NM_LINK_SECRET: required"));
        assert!(resolve_with(Mode::Dataplane, &[(ENV_LINK_SECRET, STRONG)]).is_ok());
        assert!(resolve_with(Mode::Serve, &[]).is_ok_and(|s| s.link_secret.is_none()));
        // A secret must be strong and fit in metadata.
        assert!(
            err(resolve_with(Mode::Serve, &[(ENV_LINK_SECRET, "short")])).contains("too short")
        );
        let spaced = "lnk 9f3e7a1c5b2d8e4f6a0c3b7d1e5f9a2c4b6d8e0f";
        assert!(
            err(resolve_with(Mode::Serve, &[(ENV_LINK_SECRET, spaced)]))
                .contains("printable ASCII")
        );
        // Never printed by Debug.
        let s = resolve_with(Mode::Dataplane, &[(ENV_LINK_SECRET, STRONG)]).ok();
        assert!(!format!("{s:?}").contains(STRONG));
    }

    #[test]
    fn guessable_secrets_are_refused_and_random_ones_accepted() {
        for weak in [
            "correct-horse-battery-staple-2024",
            "nmk_correct-horse-battery-staple-2024",
            "correcthorsebatterystaplemorewords",
            "iloveyoumorethananythingintheworld",
            "Summer2024!Summer2024!Summer2024!x",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "abcdefghijklmnopqrstuvwxyz0123456789",
            "qwertyuiopasdfghjklzxcvbnm1234567890",
            "nmk_test_admin_key_0123456789abcdef",
        ] {
            assert!(
                strong_secret(ENV_BOOTSTRAP_KEY, weak).is_err(),
                "{weak}: {}",
                guesses_log10(weak)
            );
        }
        for random in [
            "c9eb13071a530560a7836487eee33da9",
            "u5/NEoouTVe3cdNiplT2LhwbQv6HsmIn",
            "9d2b1a91d0f90c7ee30dfed20a30417e",
            "GUqJSHpwUewzQsO/2BNOe3XGtYq1pLRE",
            "169be921aebb95b6f7f3a92e9376440f",
            "BhTN4SeX2sW4GCqBWaSHHmKMdCZiyEVL",
            "nmk_3f9c2a71d4e85b60a1c7e93d2f4b8a06c5e1d7f92b3a4c68",
            STRONG,
        ] {
            assert!(
                strong_secret(ENV_BOOTSTRAP_KEY, random).is_ok(),
                "{random}: {}",
                guesses_log10(random)
            );
        }
    }

    #[test]
    fn tls_settings_come_whole_and_only_where_they_apply() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
            .unwrap_or_else(|e| panic!("{e}"));
        let cert_path = dir.path().join("c.pem");
        let key_path = dir.path().join("k.pem");
        std::fs::write(&cert_path, cert.cert.pem()).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&key_path, cert.signing_key.serialize_pem())
            .unwrap_or_else(|e| panic!("{e}"));
        let (c, k) = (
            cert_path.display().to_string(),
            key_path.display().to_string(),
        );
        let run = |mode, pairs: &[(&str, &str)]| {
            resolve(
                mode,
                &Flags::default(),
                &env(pairs),
                FileSettings::default(),
            )
            .map_err(|e| e.to_string())
        };
        let cp = |pairs: &[(&str, &str)]| {
            let mut all = vec![(ENV_GRPC_ADDR, "127.0.0.1:1")];
            all.extend_from_slice(pairs);
            run(Mode::Controlplane, &all)
        };
        assert!(
            cp(&[(ENV_GRPC_TLS_CERT, &c), (ENV_GRPC_TLS_KEY, &k)])
                .is_ok_and(|s| s.grpc_tls.is_some())
        );
        assert!(cp(&[(ENV_GRPC_TLS_CERT, &c)]).is_err_and(|e| e.starts_with(ENV_GRPC_TLS_KEY)));
        assert!(
            cp(&[(ENV_GRPC_TLS_CLIENT_CA, &c)])
                .is_err_and(|e| e.starts_with(ENV_GRPC_TLS_CLIENT_CA))
        );
        assert!(
            cp(&[(ENV_GRPC_TLS_CERT, &k), (ENV_GRPC_TLS_KEY, &k)])
                .is_err_and(|e| e.starts_with(ENV_GRPC_TLS_CERT))
        );
        assert!(
            cp(&[
                (ENV_GRPC_TLS_CERT, "/nonexistent.pem"),
                (ENV_GRPC_TLS_KEY, &k)
            ])
            .is_err_and(|e| e.contains("nonexistent"))
        );
        let dp = |pairs: &[(&str, &str)]| {
            let mut all = vec![(ENV_LINK_SECRET, STRONG)];
            all.extend_from_slice(pairs);
            run(Mode::Dataplane, &all)
        };
        let https = (ENV_CONTROLPLANE_URL, "https://cp.internal:50051");
        assert!(
            dp(&[https, (ENV_CONTROLPLANE_CA, &c)])
                .is_ok_and(|s| s.controlplane_tls.ca_pem.is_some())
        );
        assert!(dp(&[https]).is_ok_and(|s| s.controlplane_tls.ca_pem.is_none()));
        assert!(
            dp(&[
                https,
                (ENV_CONTROLPLANE_CLIENT_CERT, &c),
                (ENV_CONTROLPLANE_CLIENT_KEY, &k)
            ])
            .is_ok_and(|s| s.controlplane_tls.identity.is_some())
        );
        assert!(
            dp(&[https, (ENV_CONTROLPLANE_CLIENT_CERT, &c)])
                .is_err_and(|e| e.starts_with(ENV_CONTROLPLANE_CLIENT_KEY))
        );
        assert!(dp(&[(ENV_CONTROLPLANE_CA, &c)]).is_err_and(|e| e.contains("not https")));
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
    fn a_providers_wire_format_is_format_or_its_older_name_errors() {
        let resolve_file = |text: &str| {
            let file: FileSettings = toml::from_str(text).unwrap_or_else(|e| panic!("{e}"));
            resolve(Mode::Serve, &Flags::default(), &HashMap::new(), file)
        };
        let format_of = |text: &str| {
            resolve_file(text)
                .ok()
                .and_then(|s| s.registry.get("acme").map(|p| p.format))
        };
        let acme = "[providers.acme]\nbase_url = \"http://127.0.0.1:7000\"\nauth = \"bearer\"\n";
        assert_eq!(format_of(acme), Some(WireFormat::Openai));
        assert_eq!(
            format_of(&format!("{acme}format = \"anthropic\"\n")),
            Some(WireFormat::Anthropic)
        );
        assert_eq!(
            format_of(&format!("{acme}errors = \"gemini\"\n")),
            Some(WireFormat::Gemini)
        );
        assert_eq!(
            format_of(&format!("{acme}format = \"gemini\"\nerrors = \"gemini\"\n")),
            Some(WireFormat::Gemini)
        );
        let err = resolve_file(&format!("{acme}format = \"gemini\"\nerrors = \"openai\"\n"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("providers.acme") && err.contains("disagree"),
            "{err}"
        );
        // A built-in keeps its own format unless told otherwise.
        let s = resolve_file("[providers.anthropic]\nbase_url = \"http://127.0.0.1:7001\"\n").ok();
        assert_eq!(
            s.and_then(|s| s.registry.get("anthropic").map(|p| p.format)),
            Some(WireFormat::Anthropic)
        );
    }

    #[test]
    fn hot_path_mechanisms_are_all_on_unless_a_benchmark_turns_them_off() {
        let with = |v: &str| {
            resolve(
                Mode::Serve,
                &Flags::default(),
                &env(&[(ENV_HOT_PATH_OFF, v)]),
                FileSettings::default(),
            )
        };
        let default = resolve(
            Mode::Serve,
            &Flags::default(),
            &HashMap::new(),
            FileSettings::default(),
        );
        assert_eq!(default.ok().map(|s| s.hot_path), Some(HotPath::default()));
        assert_eq!(
            with("key_cache").ok().map(|s| s.hot_path.key_cache),
            Some(false)
        );
        let err = with("key_cache,warp").err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains(ENV_HOT_PATH_OFF)),
            "{err:?}"
        );
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

    // === connection and body limits, record durability (issue 21) ===

    fn resolved(pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        resolve(
            Mode::Dataplane,
            &Flags::default(),
            &env(&[
                &[
                    (ENV_CONTROLPLANE_URL, "http://127.0.0.1:9090"),
                    (
                        "NM_LINK_SECRET",
                        "lnk_8e2d4f6a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e",
                    ),
                ],
                pairs,
            ]
            .concat()),
            FileSettings::default(),
        )
    }

    /// A refusal naming `key` (`main` exits 64 on every `ConfigError`).
    fn refused(key: &str, value: &str) -> String {
        match resolved(&[(key, value)]) {
            Err(ConfigError::Invalid {
                key: named,
                problem,
            }) => {
                assert_eq!(named, key, "{key}={value}: {problem}");
                problem
            }
            other => panic!("{key}={value} was not refused: {other:?}"),
        }
    }

    #[test]
    fn connection_limits_default() {
        let s = resolved(&[]).unwrap();
        let l = s.conn_limits;
        assert_eq!(
            l.header_timeout,
            Duration::from_secs(DEFAULT_CLIENT_HEADER_TIMEOUT_SECS)
        );
        assert_eq!(
            l.body_idle_timeout,
            Duration::from_secs(DEFAULT_CLIENT_BODY_IDLE_TIMEOUT_SECS)
        );
        assert_eq!(l.body_min_rate, DEFAULT_CLIENT_BODY_MIN_RATE);
        assert_eq!(l.max_connections, 0, "0: from the open-file limit at start");
        assert_eq!(
            s.upstream_idle_timeout,
            Duration::from_secs(DEFAULT_RESPONSE_IDLE_TIMEOUT_SECS)
        );
        assert_eq!(
            s.record_durability,
            nm_dataplane::journal::Durability::Memory
        );
    }

    #[test]
    fn connection_limits_take_valid_values() {
        let s = resolved(&[
            (ENV_CLIENT_HEADER_TIMEOUT_SECS, "3"),
            (ENV_CLIENT_BODY_IDLE_TIMEOUT_SECS, "7"),
            (ENV_CLIENT_BODY_MIN_RATE, "0"),
            (ENV_RESPONSE_IDLE_TIMEOUT_SECS, "45"),
            (ENV_MAX_CONNECTIONS, "5000"),
            (ENV_RECORD_DURABILITY, "spool"),
        ])
        .unwrap();
        let l = s.conn_limits;
        assert_eq!(l.header_timeout, Duration::from_secs(3));
        assert_eq!(l.body_idle_timeout, Duration::from_secs(7));
        assert_eq!(l.body_min_rate, 0);
        assert_eq!(l.max_connections, 5000);
        assert_eq!(s.upstream_idle_timeout, Duration::from_secs(45));
        assert_eq!(
            s.record_durability,
            nm_dataplane::journal::Durability::Spool
        );
    }

    #[test]
    fn connection_limits_refuse_bad_values_naming_the_setting() {
        for key in [
            ENV_CLIENT_HEADER_TIMEOUT_SECS,
            ENV_CLIENT_BODY_IDLE_TIMEOUT_SECS,
            ENV_RESPONSE_IDLE_TIMEOUT_SECS,
        ] {
            assert!(refused(key, "0").contains("at least 1 second"), "{key}");
            refused(key, "soon");
            refused(key, "-1");
        }
        for key in [ENV_CLIENT_BODY_MIN_RATE, ENV_MAX_CONNECTIONS] {
            refused(key, "fast");
            refused(key, "-5");
            refused(key, "1.5");
        }
        assert!(refused(ENV_RECORD_DURABILITY, "disk").contains("`spool`"));
    }
}
