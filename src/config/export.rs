//! The scheduled export to a warehouse (docs/export.md): where the controlplane writes
//! yesterday's records and signals after each UTC midnight, and in which format. Declared in the
//! "Storage and records" section.

use nm_controlplane::export::Format;

use super::decl::{Default, Group, Kind, Lit, Raw, declare};
use super::{ConfigError, invalid, parse};
use crate::export::Destination;

declare! { Group::Storage;
    /// scheduled export: a folder or `s3://BUCKET/PREFIX` where the controlplane writes yesterday's `records/DAY` and `signals/DAY` files after each UTC midnight, and the missing day at start (S3 credentials from `AWS_*`); unset: no scheduled export
    EXPORT_TO: Destination => destination, {
        env: "NM_EXPORT_TO",
        file: Some(("export_to", Kind::Str)),
    };
    /// format of the scheduled export: `parquet` or `jsonl`
    EXPORT_FORMAT: Format => format, {
        env: "NM_EXPORT_FORMAT",
        file: Some(("export_format", Kind::Str)),
        default: Default::Is(Lit::Str("parquet")),
    };
}

fn destination(key: &'static str, raw: Raw<'_>) -> Result<Destination, ConfigError> {
    Destination::parse(&parse::text(key, raw)?).map_err(|e| invalid(key, e))
}

fn format(key: &'static str, raw: Raw<'_>) -> Result<Format, ConfigError> {
    let v = parse::text(key, raw)?;
    Format::parse(v.trim())
        .ok_or_else(|| invalid(key, format!("is {v:?}; use `parquet` or `jsonl`")))
}

/// The scheduled export, if `NM_EXPORT_TO` is set; an S3 destination needs its credentials in the
/// environment now, not at the first midnight.
pub(super) fn schedule(
    src: &super::decl::Sources<'_>,
    env: &std::collections::HashMap<String, String>,
) -> Result<Option<crate::export::Schedule>, ConfigError> {
    let Some(to) = src.opt(&EXPORT_TO)? else {
        return Ok(None);
    };
    if matches!(to, Destination::S3 { .. }) {
        for var in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
            if env.get(var).is_none_or(|v| v.trim().is_empty()) {
                return Err(invalid(
                    EXPORT_TO.meta.env,
                    format!("is an S3 destination but {var} is not set"),
                ));
            }
        }
    }
    Ok(Some(crate::export::Schedule {
        to,
        format: src.get(&EXPORT_FORMAT)?,
        kinds: vec![
            nm_controlplane::export::Kind::Records,
            nm_controlplane::export::Kind::Signals,
        ],
    }))
}
