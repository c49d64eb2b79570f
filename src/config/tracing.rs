//! Logs (the `OTEL_*` rows of this group are declared beside their reading, in
//! `crate::otel::settings`).

use super::decl::{Chart, Default, Flag, Group, Kind, Lit, Raw, declare};
use super::{ConfigError, LogFormat, invalid, parse};

declare! { Group::Tracing;
    /// log filter (`tracing` `EnvFilter` syntax, e.g. `info,nm_dataplane=debug`)
    LOG: String => parse::text, {
        env: "NM_LOG",
        file: Some(("log", Kind::Str)),
        default: Default::Is(Lit::Str("info")),
        chart: Chart::Value("log"),
    };
    /// `text` or `json` (one JSON object per line, on stderr)
    LOG_FORMAT: LogFormat => log_format, {
        env: "NM_LOG_FORMAT",
        flag: Some(Flag { long: "log-format", get: |f| f.log_format.as_deref() }),
        file: Some(("log_format", Kind::Str)),
        default: Default::Is(Lit::Str("text")),
        chart: Chart::ValueOwnDefault("logFormat", "json: one object per line, what cluster log collectors read"),
    };
}

fn log_format(key: &'static str, raw: Raw<'_>) -> Result<LogFormat, ConfigError> {
    match parse::text(key, raw)?.as_str() {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(invalid(key, format!("{other:?} is not one of text, json"))),
    }
}
