//! Settings: one typed [`Settings`], resolved once at start by [`resolve`] from flags, the
//! environment, an optional TOML file and defaults, in that order of precedence.
//!
//! Each setting is declared once, as one row of a `decl::declare!` table in the file of its
//! concern: [`server`], [`link`] (and TLS), [`storage`], [`providers`], [`budgets`] (and keys),
//! [`limits`], [`tracing`] (logs; the `OTEL_*` rows live beside their reading in
//! `crate::otel::settings`). A row holds the environment variable, the flag, the file key, the
//! default, the typed parse-and-check function, the group, a one-line doc and how the Helm chart
//! sets it. [`resolve`] walks the rows ([`decl::Sources`]: flag > env > file > default); the
//! file's keys are the rows' keys (any other is refused); docs/settings.md and the chart are
//! checked against the rows by the tests in `docs_tests`.
//!
//! Adding a setting is four edits:
//! 1. its row in the group's file (`config/<group>.rs`);
//! 2. its field in [`Settings`] and the line of [`resolve`] that fills it (this file);
//! 3. its row in docs/settings.md: `NM_BLESS=1 cargo nextest run -E 'test(settings_doc)'`
//!    writes it;
//! 4. if its row says the chart sets it (`Chart::Value`): the value in helm/nm-gateway/values.yaml
//!    and its schema in values.schema.json (configmap.yaml turns every `config.*` value into its
//!    `NM_*` variable by itself).
//!
//! A flag also needs its clap argument in `src/command.rs` (a test there checks the two agree).
//!
//! The environment comes in as a map, so tests never touch the process environment. Every
//! problem names the setting and the fix; `main` exits 64 on any of them.

pub mod budgets;
pub mod decl;
pub mod export;
pub mod limits;
pub mod link;
mod parse;
pub mod providers;
pub mod server;
pub mod signals;
pub mod storage;
pub mod tracing;

#[cfg(test)]
mod docs_tests;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nm_dataplane::Registry;
use nm_dataplane::hot_path::HotPath;
use rustls::pki_types::CertificateDer;
use serde::Deserialize;

pub use decl::ConfigError;
use decl::invalid;
pub use link::{MIN_SECRET_GUESSES_LOG10, MIN_SECRET_LEN, guesses_log10, strong_secret};
pub use providers::FileProvider;

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

/// Values given on the command line (all optional); each is read by the row that names it
/// (`flag: Some(Flag { .. })`).
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

/// The optional TOML file (`--config FILE`): the declared settings' file keys, plus providers
/// and prices. Unknown keys are an error: a typo must not be silently ignored.
#[derive(Debug, Clone, Default)]
pub struct FileSettings {
    /// Values by file key, each of a declared setting and of its TOML type.
    values: BTreeMap<String, toml::Value>,
    /// Extra providers, or changes to built-in ones, by name.
    pub providers: BTreeMap<String, FileProvider>,
    /// Model prices added to, or replacing, the built-in table (`[[prices]]`).
    pub prices: Vec<nm_dataplane::pricing::PriceSpec>,
}

impl<'de> Deserialize<'de> for FileSettings {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Whole {
            #[serde(default)]
            providers: BTreeMap<String, FileProvider>,
            #[serde(default)]
            prices: Vec<nm_dataplane::pricing::PriceSpec>,
            #[serde(flatten)]
            values: BTreeMap<String, toml::Value>,
        }
        let whole = Whole::deserialize(d)?;
        for (key, value) in &whole.values {
            let Some((_, kind)) = by_file_key(key).and_then(|m| m.file) else {
                return Err(serde::de::Error::custom(format!(
                    "unknown field `{key}`, expected one of {}",
                    file_keys().join(", ")
                )));
            };
            if !decl::file_value_fits(kind, value) {
                let want = match kind {
                    decl::Kind::Str => "a string",
                    decl::Kind::Int => "a whole number",
                };
                return Err(serde::de::Error::custom(format!(
                    "invalid type for `{key}`: {} {value}, expected {want}",
                    value.type_str()
                )));
            }
        }
        Ok(FileSettings {
            values: whole.values,
            providers: whole.providers,
            prices: whole.prices,
        })
    }
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
    /// Providers whose operator credential the dataplanes hold though this process does not
    /// (`NM_OPERATOR_CREDENTIALS`): experiments' arms may go there.
    pub operator_credentials: Vec<String>,
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
    pub tpm_default_max_tokens: u64,
    pub prices: nm_dataplane::pricing::PriceTable,
    /// Interval of the scheduled analytics recomputation (controlplane); `None`: off.
    pub analytics_interval: Option<Duration>,
    /// The first retry delay of a failed alert delivery.
    pub alert_retry: Duration,
    /// The hot path's mechanisms: all on, unless a benchmark turns some off.
    pub hot_path: HotPath,
    /// OpenTelemetry export (`OTEL_*`), off unless an endpoint is set.
    pub otel: crate::otel::settings::OtelSettings,
    /// The implicit signals' rules and their memory (dataplane).
    pub implicit: nm_dataplane::implicit::Settings,
    /// How long raw records and signals are kept (controlplane); unset: forever.
    pub retention: nm_controlplane::retention::Retention,
    /// The scheduled export (`NM_EXPORT_TO`), run by the controlplane; `None`: off.
    pub export: Option<crate::export::Schedule>,
    /// The web page (`NM_UI_ADDR`, `NM_UI_TRACE_URL`).
    pub ui: UiSettings,
}

/// Where the web page listens and what it links to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UiSettings {
    /// `None`: `off`.
    pub addr: Option<SocketAddr>,
    /// Set by the operator (a failure to bind stops the start), not the default (a failure to
    /// bind is a warning).
    pub explicit: bool,
    /// A URL template with `{trace_id}`.
    pub trace_url: Option<String>,
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

/// Every declared setting, group by group.
pub fn all() -> impl Iterator<Item = &'static decl::Meta> {
    [
        server::TABLE,
        link::TABLE,
        storage::TABLE,
        providers::TABLE,
        budgets::TABLE,
        limits::TABLE,
        signals::TABLE,
        tracing::TABLE,
        crate::otel::settings::TABLE,
        export::TABLE,
    ]
    .into_iter()
    .flatten()
    .copied()
}

/// The setting a file key belongs to.
pub fn by_file_key(key: &str) -> Option<&'static decl::Meta> {
    all().find(|m| m.file.is_some_and(|(k, _)| k == key))
}

/// Every file key, for the message about an unknown one.
pub fn file_keys() -> Vec<&'static str> {
    let mut keys: Vec<&str> = all().filter_map(|m| m.file.map(|(k, _)| k)).collect();
    keys.extend(["providers", "prices"]);
    keys
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
    let src = decl::Sources {
        mode,
        flags,
        env,
        file: &file.values,
    };
    let http_addr = src.get(&server::HTTP_ADDR)?;
    let grpc_addr = src.get(&server::GRPC_ADDR)?;
    let controlplane_url = src.get(&link::CONTROLPLANE_URL)?;
    let database_url = src.get(&storage::DATABASE_URL)?;
    let log_format = src.get(&tracing::LOG_FORMAT)?;
    let max_body_bytes = src.get(&limits::MAX_BODY_BYTES)?;
    let connect_timeout = src.get(&providers::CONNECT_TIMEOUT)?;
    let header_timeout = src.get(&providers::HEADER_TIMEOUT)?;
    let shutdown_grace = src.get(&server::SHUTDOWN_GRACE)?;
    let conn_limits = nm_dataplane::conns::ConnLimits {
        header_timeout: src.get(&limits::CLIENT_HEADER_TIMEOUT)?,
        body_idle_timeout: src.get(&limits::CLIENT_BODY_IDLE_TIMEOUT)?,
        body_min_rate: src.get(&limits::CLIENT_BODY_MIN_RATE)?,
        max_connections: src.get(&limits::MAX_CONNECTIONS)?,
    };
    let upstream_idle_timeout = src.get(&providers::RESPONSE_IDLE_TIMEOUT)?;
    let record_queue = src.get(&storage::RECORD_QUEUE)?;
    let hot_path = src.opt(&server::HOT_PATH_OFF)?.unwrap_or_default();
    let implicit = nm_dataplane::implicit::Settings {
        rules: src.get(&signals::IMPLICIT_RULES)?,
        off_by_agent: src.opt(&signals::IMPLICIT_RULES_OFF)?.unwrap_or_default(),
        reask_window: src.get(&signals::IMPLICIT_REASK_WINDOW)?,
        memory_bytes: src.get(&signals::IMPLICIT_MEMORY_BYTES)?,
        memory_ttl: src.get(&signals::IMPLICIT_MEMORY_TTL)?,
    };
    let spool_max_bytes = src.get(&storage::SPOOL_MAX_BYTES)?;
    let record_durability = src.get(&storage::RECORD_DURABILITY)?;
    let reserve_output_tokens = src.get(&budgets::RESERVE_OUTPUT_TOKENS)?;
    let tpm_default_max_tokens = src.get(&budgets::TPM_DEFAULT_MAX_TOKENS)?;
    let analytics_interval = src.get(&storage::ANALYTICS_INTERVAL)?;
    let alert_retry = src.get(&storage::ALERT_RETRY)?;
    let spool_dir = src.get(&storage::SPOOL_DIR)?;
    let price_rows = file
        .prices
        .iter()
        .cloned()
        .map(nm_dataplane::pricing::PriceRow::try_from)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid("prices", e.to_string()))?;
    let prices = nm_dataplane::pricing::PriceTable::builtin().with_overrides(price_rows);
    let registry = providers::registry(env, file.providers.clone())?;
    let extra_ca_certs = src.opt(&providers::TLS_CA_FILE)?.unwrap_or_default();
    let operator_credentials = src
        .opt(&providers::OPERATOR_CREDENTIALS)?
        .unwrap_or_default();
    let bootstrap_key = src.opt(&budgets::BOOTSTRAP_KEY)?;
    let link_secret = src.opt(&link::LINK_SECRET)?.map(Secret);
    let secret_env = link::LINK_SECRET.meta.env;
    match mode {
        Mode::Controlplane if link_secret.is_none() && !grpc_addr.ip().is_loopback() => {
            return Err(invalid(
                secret_env,
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
                secret_env,
                "required: a dataplane presents the controlplane's link secret; set the same \
                 value as on the controlplane",
            ));
        }
        _ => {}
    }
    let grpc_tls = link::server_tls(
        src.opt(&link::GRPC_TLS_CERT)?,
        src.opt(&link::GRPC_TLS_KEY)?,
        src.opt(&link::GRPC_TLS_CLIENT_CA)?,
    )?;
    // Only the shapes that connect to a controlplane read the client side.
    let controlplane_tls = if matches!(mode, Mode::Dataplane | Mode::Client) {
        link::client_tls(
            controlplane_url
                .parse::<http::Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("https")),
            src.opt(&link::CONTROLPLANE_CA)?,
            src.opt(&link::CONTROLPLANE_CLIENT_CERT)?,
            src.opt(&link::CONTROLPLANE_CLIENT_KEY)?,
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
        admin_key: src.opt(&budgets::ADMIN_KEY)?,
        log: src.get(&tracing::LOG)?,
        log_format,
        registry,
        operator_credentials,
        max_body_bytes,
        connect_timeout,
        header_timeout,
        shutdown_grace,
        conn_limits,
        upstream_idle_timeout,
        record_queue,
        extra_ca_certs,
        spool_dir,
        spool_max_bytes,
        record_durability,
        reserve_output_tokens,
        tpm_default_max_tokens,
        prices,
        analytics_interval,
        alert_retry,
        hot_path,
        implicit,
        otel: crate::otel::settings::resolve(env)?,
        retention: nm_controlplane::retention::Retention {
            records: src.opt(&storage::RETENTION_RECORDS)?,
            signals: src.opt(&storage::RETENTION_SIGNALS)?,
        },
        export: export::schedule(&src, env)?,
        ui: UiSettings {
            addr: src.get(&server::UI_ADDR)?,
            explicit: src.opt(&server::UI_ADDR)?.is_some(),
            trace_url: src.opt(&server::UI_TRACE_URL)?,
        },
    })
}
