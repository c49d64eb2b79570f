//! The declaration of a setting ([`Setting`]) and the one walk that resolves it ([`Sources`]):
//! flag > environment > file > default, the value then parsed and checked by the setting's own
//! typed function, whatever source it came from.
//!
//! A setting is one [`declare!`] row in the file of its concern; the macro makes its `static`
//! and adds it to its group's `TABLE`, which the docs table, the chart check and the file-key
//! check read. Nothing else names a setting's environment variable, flag, file key or default.

use std::collections::{BTreeMap, HashMap};

use super::{Flags, Mode};

/// The concern a setting belongs to: one section of docs/settings.md, one file of `config/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    Server,
    Link,
    Storage,
    Providers,
    Budgets,
    Limits,
    Signals,
    Tracing,
}

impl Group {
    pub const ALL: [Group; 8] = [
        Group::Server,
        Group::Link,
        Group::Storage,
        Group::Providers,
        Group::Budgets,
        Group::Limits,
        Group::Signals,
        Group::Tracing,
    ];

    /// The section title in docs/settings.md.
    pub fn title(self) -> &'static str {
        match self {
            Group::Server => "Server",
            Group::Link => "Link and TLS",
            Group::Storage => "Storage and records",
            Group::Providers => "Providers and upstreams",
            Group::Budgets => "Keys and budgets",
            Group::Limits => "Limits",
            Group::Signals => "Implicit signals",
            Group::Tracing => "Logs and tracing",
        }
    }
}

/// A literal default, in the form a file would give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lit {
    Str(&'static str),
    Int(u64),
}

/// A setting's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Default {
    /// No value: the setting is off or optional.
    Unset,
    /// This value, parsed like any other.
    Is(Lit),
    /// Depends on the process shape: `controlplane` for `nm-gateway controlplane`, `other` for
    /// every other command.
    ByMode { other: Lit, controlplane: Lit },
    /// Decided elsewhere (an `OTEL_*` variable's, a provider's); the text says how.
    Described(&'static str),
}

/// The TOML type a file key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Str,
    Int,
}

/// How the Helm chart sets a setting (checked by `config::chart_tests`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chart {
    /// Not set by the chart: its product default holds, `extraEnv` can set it.
    No,
    /// Set by the chart's templates from its own wiring (ports, paths, Secrets, the URL).
    Template,
    /// The chart value `config.<name>` (values.yaml, values.schema.json, configmap.yaml), whose
    /// default is the product default.
    Value(&'static str),
    /// The chart value `config.<name>`, with a chart default of its own (the text: why).
    ValueOwnDefault(&'static str, &'static str),
    /// The chart's `otel.*` values set it (`nm-gateway.otelEnv` in `_helpers.tpl`).
    Otel,
}

/// A command-line flag: its long name, and where clap put its value.
#[derive(Clone, Copy)]
pub struct Flag {
    pub long: &'static str,
    pub get: fn(&Flags) -> Option<&str>,
}

impl std::fmt::Debug for Flag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "--{}", self.long)
    }
}

/// A raw value before its setting's parse function: text (a flag, the environment, a string
/// default or file value) or a whole number (a file integer or a numeric default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Raw<'a> {
    Text(&'a str),
    Int(i64),
}

impl Lit {
    pub fn raw(self) -> Raw<'static> {
        match self {
            Lit::Str(s) => Raw::Text(s),
            Lit::Int(n) => Raw::Int(i64::try_from(n).unwrap_or(i64::MAX)),
        }
    }
}

/// Everything about a setting but its type.
#[derive(Debug, Clone, Copy)]
pub struct Meta {
    pub env: &'static str,
    pub flag: Option<Flag>,
    /// Its key in the `--config` TOML file.
    pub file: Option<(&'static str, Kind)>,
    pub default: Default,
    pub group: Group,
    /// One line for docs/settings.md.
    pub doc: &'static str,
    pub chart: Chart,
    /// Parses a raw value with the setting's own function, dropping the result (the checks of
    /// defaults and chart values).
    pub check: fn(Raw<'_>) -> Result<(), ConfigError>,
}

impl Meta {
    /// The fields a row may leave out.
    pub const BASE: Meta = Meta {
        env: "",
        flag: None,
        file: None,
        default: Default::Unset,
        group: Group::Server,
        doc: "",
        chart: Chart::No,
        check: |_| Ok(()),
    };

    /// For a family (`NM_UPSTREAM_<PROVIDER>`): the prefix of its variables.
    pub fn prefix(&self) -> Option<&'static str> {
        self.env.strip_suffix("<PROVIDER>")
    }

    /// The raw default for a process shape, if it has one.
    pub fn default_raw(&self, mode: Mode) -> Option<Raw<'static>> {
        match self.default {
            Default::Is(lit) => Some(lit.raw()),
            Default::ByMode { controlplane, .. } if mode == Mode::Controlplane => {
                Some(controlplane.raw())
            }
            Default::ByMode { other, .. } => Some(other.raw()),
            Default::Unset | Default::Described(_) => None,
        }
    }
}

/// A declared setting of type `T`: its [`Meta`] and the function that turns a raw value into a
/// `T` or an error naming the setting.
pub struct Setting<T> {
    pub meta: Meta,
    pub parse: fn(&'static str, Raw<'_>) -> Result<T, ConfigError>,
}

/// Declares the settings of one group: for each, a `static NAME: Setting<T>` and an entry in the
/// group's `TABLE`. A row:
///
/// ```text
/// /// One line for the docs.
/// NAME: Type => parse_fn, { env: "NM_...", flag: .., file: .., default: .., chart: .. };
/// ```
///
/// Fields left out take [`Meta::BASE`]'s value (no flag, no file key, unset, not in the chart).
macro_rules! declare {
    ($group:expr; $(
        #[doc = $doc:literal]
        $name:ident: $ty:ty => $parse:expr, { $($field:ident: $value:expr),* $(,)? };
    )*) => {
        $(
            #[doc = $doc]
            #[allow(
                clippy::needless_update,
                reason = "a row that sets every field leaves nothing to Meta::BASE; most do not"
            )]
            pub static $name: $crate::config::decl::Setting<$ty> = $crate::config::decl::Setting {
                meta: $crate::config::decl::Meta {
                    group: $group,
                    doc: $doc,
                    check: |raw| ($parse)($name.meta.env, raw).map(|_| ()),
                    $($field: $value,)*
                    ..$crate::config::decl::Meta::BASE
                },
                parse: $parse,
            };
        )*
        /// This group's settings, in declaration order.
        pub static TABLE: &[&$crate::config::decl::Meta] = &[$(&$name.meta),*];
    };
}
pub(crate) use declare;

/// Whether `value` has the TOML type of `kind`.
pub fn file_value_fits(kind: Kind, value: &toml::Value) -> bool {
    matches!(
        (kind, value),
        (Kind::Str, toml::Value::String(_)) | (Kind::Int, toml::Value::Integer(_))
    )
}

/// The places a value may come from, walked in order of precedence.
pub struct Sources<'a> {
    pub mode: Mode,
    pub flags: &'a Flags,
    pub env: &'a HashMap<String, String>,
    pub file: &'a BTreeMap<String, toml::Value>,
}

impl<'a> Sources<'a> {
    /// The value given for `meta`, if any: a flag, else a non-empty environment variable, else
    /// the file.
    fn given(&self, meta: &Meta) -> Option<Raw<'a>> {
        if let Some(v) = meta.flag.and_then(|f| (f.get)(self.flags)) {
            return Some(Raw::Text(v));
        }
        if let Some(v) = self.env.get(meta.env).filter(|v| !v.is_empty()) {
            return Some(Raw::Text(v));
        }
        let (key, _) = meta.file?;
        match self.file.get(key)? {
            toml::Value::String(s) => Some(Raw::Text(s)),
            toml::Value::Integer(n) => Some(Raw::Int(*n)),
            // `FileSettings` admits only the declared kinds.
            _ => None,
        }
    }

    /// A setting with a default: the value given, else the default, parsed.
    pub fn get<T>(&self, setting: &Setting<T>) -> Result<T, ConfigError> {
        let meta = &setting.meta;
        let raw = self
            .given(meta)
            .or_else(|| meta.default_raw(self.mode))
            .ok_or_else(|| invalid(meta.env, "required"))?;
        (setting.parse)(meta.env, raw)
    }

    /// An optional setting: the value given, parsed, or `None`.
    pub fn opt<T>(&self, setting: &Setting<T>) -> Result<Option<T>, ConfigError> {
        self.given(&setting.meta)
            .map(|raw| (setting.parse)(setting.meta.env, raw))
            .transpose()
    }
}

/// A setting that cannot be used: names it and the problem.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{key}: {problem}")]
    Invalid { key: String, problem: String },
    #[error("config file {path}: {problem}")]
    File {
        path: std::path::PathBuf,
        problem: String,
    },
}

pub(super) fn invalid(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        problem: problem.into(),
    }
}
