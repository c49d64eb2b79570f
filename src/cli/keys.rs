//! `nm-gateway keys create|list|revoke|rotate|update`: API keys on the controlplane, with their
//! role, scope, labels, expiry and last use. Secrets are printed once, by `create` and `rotate`.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Context;
use serde_json::json;

use super::{UsageError, admin_channel, time, write_table};
use crate::config::Settings;
use crate::grpc::convert;
use crate::grpc::pb::{self, keys_client::KeysClient};

/// `nm-gateway keys <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum KeysCommand {
    /// Create a key and print its secret (shown only once).
    Create {
        /// A label for the key.
        #[arg(long)]
        name: String,
        /// admin (everything), viewer (the admin APIs that read) or service (the proxy and
        /// signals only).
        #[arg(long, default_value = "service", conflicts_with = "admin")]
        role: String,
        /// Same as --role admin.
        #[arg(long)]
        admin: bool,
        #[command(flatten)]
        scope: ScopeArgs,
        /// A label, NAME=VALUE (repeat for more), e.g. --label team=search.
        #[arg(long = "label", value_name = "NAME=VALUE")]
        labels: Vec<String>,
        #[command(flatten)]
        expiry: ExpiryArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets) with role, scope, labels, expiry and last use.
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
    /// Give a key a new secret (printed once); its id, role, scope, labels and history stay.
    Rotate {
        /// The key's id (`key_...`).
        id: String,
        /// How long the old secret stays valid: 30s, 15m, 12h, 7d (default: not at all).
        #[arg(long, value_name = "DURATION")]
        grace: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Change a key's role, scope, labels or expiry (only what is given changes).
    Update {
        /// The key's id (`key_...`).
        id: String,
        /// admin, viewer or service.
        #[arg(long)]
        role: Option<String>,
        /// Replace the scope with the lists given (--providers, --models, --agents, --envs).
        #[command(flatten)]
        scope: ScopeArgs,
        /// Remove every scope limit.
        #[arg(long, conflicts_with_all = ["providers", "models", "agents", "envs"])]
        unrestricted: bool,
        /// Replace the labels (repeat for more).
        #[arg(long = "label", value_name = "NAME=VALUE")]
        labels: Vec<String>,
        /// Remove every label.
        #[arg(long, conflicts_with = "labels")]
        clear_labels: bool,
        #[command(flatten)]
        expiry: ExpiryArgs,
        /// Remove the expiry.
        #[arg(long, conflicts_with_all = ["expires_in", "expires_at"])]
        no_expiry: bool,
        #[arg(long)]
        json: bool,
    },
}

/// Where a service key may go (comma-separated lists; none: anywhere).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ScopeArgs {
    /// Providers, e.g. openai,anthropic.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    providers: Vec<String>,
    /// Model glob patterns, e.g. 'gpt-4o*,claude-*' (`*` any run, `?` one character).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    models: Vec<String>,
    /// Agents (`NM-Agent` values).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    agents: Vec<String>,
    /// Envs: production, staging, development.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    envs: Vec<String>,
}

impl ScopeArgs {
    fn is_empty(&self) -> bool {
        self.providers.is_empty()
            && self.models.is_empty()
            && self.agents.is_empty()
            && self.envs.is_empty()
    }

    fn to_pb(&self) -> pb::KeyScope {
        pb::KeyScope {
            providers: self.providers.clone(),
            models: self.models.clone(),
            agents: self.agents.clone(),
            envs: self.envs.clone(),
        }
    }
}

/// When a key expires.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ExpiryArgs {
    /// Expire after this long: 30m, 12h, 90d, 1w.
    #[arg(long, value_name = "DURATION", conflicts_with = "expires_at")]
    expires_in: Option<String>,
    /// Expire at this time: RFC 3339 or YYYY-MM-DD (UTC).
    #[arg(long, value_name = "TIME")]
    expires_at: Option<String>,
}

impl ExpiryArgs {
    fn timestamp(
        &self,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Option<prost_types::Timestamp>, UsageError> {
        let at = match (&self.expires_in, &self.expires_at) {
            (Some(d), _) => {
                let d = nm_types::duration::parse(d)
                    .map_err(|e| UsageError(format!("--expires-in: {e}")))?;
                let d = chrono::Duration::from_std(d)
                    .map_err(|_| UsageError("--expires-in: too long".to_owned()))?;
                Some(now + d)
            }
            (None, Some(t)) => Some(absolute_time(t).ok_or_else(|| {
                UsageError(format!(
                    "--expires-at {t:?}: use RFC 3339 (2027-01-31T12:00:00Z) or YYYY-MM-DD"
                ))
            })?),
            (None, None) => None,
        };
        Ok(at.map(|t| convert::ms_to_timestamp(t.timestamp_millis())))
    }
}

/// RFC 3339 or a UTC date (never an age: an expiry is ahead).
fn absolute_time(v: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(v) {
        return Some(t.with_timezone(&chrono::Utc));
    }
    let d = chrono::NaiveDate::parse_from_str(v, "%Y-%m-%d").ok()?;
    Some(d.and_hms_opt(0, 0, 0)?.and_utc())
}

fn parse_labels(labels: &[String]) -> Result<BTreeMap<String, String>, UsageError> {
    labels
        .iter()
        .map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| UsageError(format!("--label {l:?}: write NAME=VALUE")))
        })
        .collect()
}

fn parse_role(role: &str) -> Result<pb::KeyRole, UsageError> {
    let role = role
        .parse::<nm_types::access::Role>()
        .map_err(|e| UsageError(format!("--role: {e}")))?;
    Ok(convert::role_to_pb(role))
}

pub async fn keys(
    settings: &Settings,
    cmd: KeysCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let now = chrono::Utc::now();
    let mut client = KeysClient::new(admin_channel(settings)?);
    let cp = &settings.controlplane_url;
    match cmd {
        KeysCommand::Create {
            name,
            role,
            admin,
            scope,
            labels,
            expiry,
            json,
        } => {
            let req = pb::CreateKeyRequest {
                name,
                admin,
                role: if admin {
                    pb::KeyRole::Admin
                } else {
                    parse_role(&role)?
                } as i32,
                scope: (!scope.is_empty()).then(|| scope.to_pb()),
                labels: parse_labels(&labels)?.into_iter().collect(),
                expires_at: expiry.timestamp(now)?,
            };
            let r = client
                .create_key(req)
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
                    "created key {} ({}, {})",
                    key.id,
                    key.name,
                    role_name(&key)
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
                            role_name(k).to_owned(),
                            scope_text(k.scope.as_ref()),
                            labels_text(k),
                            time(k.created_at.as_ref()),
                            time(k.expires_at.as_ref()),
                            time(k.last_used_at.as_ref()),
                            k.revoked_at
                                .as_ref()
                                .map_or_else(|| "-".to_owned(), |t| time(Some(t))),
                        ]
                    })
                    .collect();
                write_table(
                    out,
                    &[
                        "ID",
                        "NAME",
                        "PREFIX",
                        "ROLE",
                        "SCOPE",
                        "LABELS",
                        "CREATED",
                        "EXPIRES",
                        "LAST USED",
                        "REVOKED",
                    ],
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
        KeysCommand::Rotate { id, grace, json } => {
            let grace = grace
                .as_deref()
                .map(nm_types::duration::parse)
                .transpose()
                .map_err(|e| UsageError(format!("--grace: {e}")))?
                .unwrap_or_default();
            let r = client
                .rotate_key(pb::RotateKeyRequest {
                    id,
                    grace_seconds: grace.as_secs(),
                })
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
                writeln!(out, "rotated key {} ({})", key.id, key.name)?;
                writeln!(out, "new secret (shown only now): {}", r.secret)?;
                match &key.previous_secret_valid_until {
                    Some(t) => writeln!(out, "the old secret stays valid until {}", time(Some(t)))?,
                    None => writeln!(
                        out,
                        "the old secret is refused by every dataplane within 5 seconds"
                    )?,
                }
            }
        }
        KeysCommand::Update {
            id,
            role,
            scope,
            unrestricted,
            labels,
            clear_labels,
            expiry,
            no_expiry,
            json,
        } => {
            let req = pb::UpdateKeyRequest {
                id,
                role: role
                    .as_deref()
                    .map(parse_role)
                    .transpose()?
                    .unwrap_or(pb::KeyRole::Unspecified) as i32,
                scope: (unrestricted || !scope.is_empty()).then(|| scope.to_pb()),
                labels: (clear_labels || !labels.is_empty())
                    .then(|| parse_labels(&labels))
                    .transpose()?
                    .map(|labels| pb::KeyLabels {
                        labels: labels.into_iter().collect(),
                    }),
                expires_at: expiry.timestamp(now)?,
                clear_expiry: no_expiry,
            };
            let key = client
                .update_key(req)
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
                    "updated key {} ({}, {}; scope {}); dataplanes apply it within 5 seconds",
                    key.id,
                    key.name,
                    role_name(&key),
                    scope_text(key.scope.as_ref())
                )?;
            }
        }
    }
    Ok(())
}

fn role_name(k: &pb::ApiKey) -> &'static str {
    match k.role() {
        pb::KeyRole::Admin => "admin",
        pb::KeyRole::Viewer => "viewer",
        pb::KeyRole::Service => "service",
        pb::KeyRole::Unspecified if k.admin => "admin",
        pb::KeyRole::Unspecified => "service",
    }
}

/// `providers=openai,anthropic models=gpt-4o*`, or `-` for none.
fn scope_text(scope: Option<&pb::KeyScope>) -> String {
    let Some(s) = scope else {
        return "-".to_owned();
    };
    let parts: Vec<String> = [
        ("providers", &s.providers),
        ("models", &s.models),
        ("agents", &s.agents),
        ("envs", &s.envs),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(k, v)| format!("{k}={}", v.join(",")))
    .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(" ")
    }
}

fn labels_text(k: &pb::ApiKey) -> String {
    if k.labels.is_empty() {
        return "-".to_owned();
    }
    let sorted: BTreeMap<_, _> = k.labels.iter().collect();
    sorted
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn key_json(k: &pb::ApiKey) -> serde_json::Value {
    let ts = |t: &Option<prost_types::Timestamp>| t.as_ref().map(|t| time(Some(t)));
    json!({
        "id": k.id,
        "name": k.name,
        "role": role_name(k),
        "admin": role_name(k) == "admin",
        "scope": k.scope.as_ref().map(|s| json!({
            "providers": s.providers,
            "models": s.models,
            "agents": s.agents,
            "envs": s.envs,
        })),
        "labels": k.labels.iter().collect::<BTreeMap<_, _>>(),
        "display_prefix": k.display_prefix,
        "created_at": ts(&k.created_at),
        "expires_at": ts(&k.expires_at),
        "last_used_at": ts(&k.last_used_at),
        "rotated_at": ts(&k.rotated_at),
        "previous_secret_valid_until": ts(&k.previous_secret_valid_until),
        "revoked_at": ts(&k.revoked_at),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_expiry() {
        assert_eq!(
            parse_labels(&["team=search".into(), "tier = gold".into()]).ok(),
            Some(BTreeMap::from([
                ("team".to_owned(), "search".to_owned()),
                ("tier".to_owned(), "gold".to_owned())
            ]))
        );
        assert!(parse_labels(&["team".into()]).is_err());
        assert!(parse_labels(&["=x".into()]).is_err());
        let now = chrono::DateTime::from_timestamp(1_000_000, 0).unwrap_or_default();
        let in_an_hour = ExpiryArgs {
            expires_in: Some("1h".into()),
            expires_at: None,
        };
        assert_eq!(
            in_an_hour.timestamp(now).ok().flatten().map(|t| t.seconds),
            Some(1_003_600)
        );
        let bad = ExpiryArgs {
            expires_in: Some("soon".into()),
            expires_at: None,
        };
        assert!(bad.timestamp(now).is_err());
        assert!(absolute_time("2027-01-31").is_some());
        assert!(absolute_time("7d").is_none());
    }
}
