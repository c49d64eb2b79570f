//! Admin commands (`nm-gateway keys ...`): gRPC calls to the controlplane with the admin key in
//! `nm-key` metadata, printed as a table or, with `--json`, as JSON.

use std::io::Write;

use anyhow::Context;
use serde_json::json;
use tonic::metadata::MetadataValue;

use crate::config::Settings;
use crate::grpc::pb::{self, keys_client::KeysClient};
use crate::grpc::{NM_KEY_METADATA, convert, link};

/// `nm-gateway keys <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum KeysCommand {
    /// Create a key and print its secret (shown only once).
    Create {
        /// A label for the key.
        #[arg(long)]
        name: String,
        /// Allow the key to call admin APIs (key management).
        #[arg(long)]
        admin: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets).
    List {
        /// Include revoked keys.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id; every dataplane refuses it within 5 seconds.
    Revoke {
        /// The key's id (`key_...`).
        id: String,
        #[arg(long)]
        json: bool,
    },
}

/// Errors a user can fix by changing the command line or settings (exit code 64).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub async fn keys(
    settings: &Settings,
    cmd: KeysCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let admin_key = settings.admin_key.clone().ok_or_else(|| {
        UsageError("set NM_ADMIN_KEY (or --admin-key) to an admin service key".to_owned())
    })?;
    let value: MetadataValue<_> = admin_key
        .parse()
        .map_err(|_| UsageError("NM_ADMIN_KEY is not a valid header value".to_owned()))?;
    let channel = link::channel(&settings.controlplane_url)?;
    let mut client = KeysClient::with_interceptor(channel, move |mut req: tonic::Request<()>| {
        req.metadata_mut().insert(NM_KEY_METADATA, value.clone());
        Ok(req)
    });
    let cp = &settings.controlplane_url;
    match cmd {
        KeysCommand::Create { name, admin, json } => {
            let r = client
                .create_key(pb::CreateKeyRequest { name, admin })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            let key = r.key.unwrap_or_default();
            if json {
                writeln!(
                    out,
                    "{}",
                    json!({"key": key_json(&key), "secret": r.secret})
                )?;
            } else {
                writeln!(
                    out,
                    "created key {} ({}{})",
                    key.id,
                    key.name,
                    if key.admin { ", admin" } else { "" }
                )?;
                writeln!(out, "secret (shown only now): {}", r.secret)?;
            }
        }
        KeysCommand::List { all, json } => {
            let keys = client
                .list_keys(pb::ListKeysRequest {
                    include_revoked: all,
                })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner()
                .keys;
            if json {
                writeln!(
                    out,
                    "{}",
                    serde_json::Value::Array(keys.iter().map(key_json).collect())
                )?;
            } else {
                let rows: Vec<Vec<String>> = keys
                    .iter()
                    .map(|k| {
                        vec![
                            k.id.clone(),
                            k.name.clone(),
                            format!("{}…", k.display_prefix),
                            if k.admin { "admin" } else { "service" }.to_owned(),
                            time(k.created_at.as_ref()),
                            k.revoked_at
                                .as_ref()
                                .map_or_else(|| "-".to_owned(), |t| time(Some(t))),
                        ]
                    })
                    .collect();
                write_table(
                    out,
                    &["ID", "NAME", "PREFIX", "ROLE", "CREATED", "REVOKED"],
                    &rows,
                )?;
            }
        }
        KeysCommand::Revoke { id, json } => {
            let key = client
                .revoke_key(pb::RevokeKeyRequest { id })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner()
                .key
                .unwrap_or_default();
            if json {
                writeln!(out, "{}", key_json(&key))?;
            } else {
                writeln!(
                    out,
                    "revoked key {} ({}); dataplanes refuse it within 5 seconds",
                    key.id, key.name
                )?;
            }
        }
    }
    Ok(())
}

fn key_json(k: &pb::ApiKey) -> serde_json::Value {
    json!({
        "id": k.id,
        "name": k.name,
        "admin": k.admin,
        "display_prefix": k.display_prefix,
        "created_at": k.created_at.as_ref().map(|t| time(Some(t))),
        "revoked_at": k.revoked_at.as_ref().map(|t| time(Some(t))),
    })
}

fn time(ts: Option<&prost_types::Timestamp>) -> String {
    ts.and_then(|t| chrono::DateTime::from_timestamp_millis(convert::timestamp_to_ms(t)))
        .map_or_else(
            || "-".to_owned(),
            |d| d.format("%Y-%m-%d %H:%M:%SZ").to_string(),
        )
}

/// Left-aligned columns separated by two spaces.
pub fn write_table(
    out: &mut impl Write,
    header: &[&str],
    rows: &[Vec<String>],
) -> std::io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line =
        |out: &mut dyn Write, cells: &mut dyn Iterator<Item = &str>| -> std::io::Result<()> {
            let mut s = String::new();
            for (i, (cell, w)) in cells.zip(&widths).enumerate() {
                if i > 0 {
                    s.push_str("  ");
                }
                s.push_str(cell);
                s.extend(std::iter::repeat_n(
                    ' ',
                    w.saturating_sub(cell.chars().count()),
                ));
            }
            writeln!(out, "{}", s.trim_end())
        };
    line(out, &mut header.iter().copied())?;
    for row in rows {
        line(out, &mut row.iter().map(String::as_str))?;
    }
    if rows.is_empty() {
        writeln!(out, "(none)")?;
    }
    Ok(())
}
