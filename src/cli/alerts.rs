//! `nm-gateway alerts add|list|remove|test|deliveries`: webhooks and their deliveries.

use std::io::Write;

use anyhow::Context;
use serde_json::json;

use super::{admin_channel, time, write_table};
use crate::config::Settings;
use crate::grpc::pb::{self, alerts_client::AlertsClient};

/// `nm-gateway alerts <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum AlertsCommand {
    /// Register a webhook; prints its signing secret once.
    Add {
        /// Where alerts are POSTed (https://, or http:// for a receiver you trust the path to).
        url: String,
        /// Only these kinds (repeat the flag): budget, key_expiry, recommendation, experiment,
        /// test. Default: all.
        #[arg(long = "kind", value_name = "KIND")]
        kinds: Vec<String>,
        /// Send Slack's `{"text": ...}` body instead of the event's JSON.
        #[arg(long)]
        slack: bool,
        #[arg(long, default_value = "")]
        description: String,
        #[arg(long)]
        json: bool,
    },
    /// Every webhook (without secrets).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a webhook and its pending deliveries.
    Remove {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Send a test event to one webhook now.
    Test {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Deliveries, newest first: state, tries, the receiver's last answer.
    Deliveries {
        /// Only this webhook's.
        #[arg(long)]
        webhook: Option<String>,
        /// At most this many (up to 1000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
}

pub async fn alerts(
    settings: &Settings,
    command: AlertsCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = AlertsClient::new(admin_channel(settings)?);
    let ctx = || format!("controlplane {}", settings.controlplane_url);
    match command {
        AlertsCommand::Add {
            url,
            kinds,
            slack,
            description,
            json,
        } => {
            let r = client
                .add_webhook(pb::AddWebhookRequest {
                    url,
                    kinds,
                    format: if slack { "slack" } else { "json" }.to_owned(),
                    description,
                })
                .await
                .with_context(ctx)?
                .into_inner();
            let w = r.webhook.unwrap_or_default();
            if json {
                let mut v = webhook_json(&w);
                v["secret"] = json!(r.secret);
                writeln!(out, "{v}")?;
            } else {
                writeln!(out, "webhook {} added for {}", w.id, w.kinds.join(", "))?;
                writeln!(
                    out,
                    "signing secret (shown only now): {}\nverify NM-Signature: t=<unix seconds>,v1=<hex HMAC-SHA-256 of \"<t>.<body>\">",
                    r.secret
                )?;
            }
        }
        AlertsCommand::List { json } => {
            let list = client
                .list_webhooks(pb::ListWebhooksRequest {})
                .await
                .with_context(ctx)?
                .into_inner()
                .webhooks;
            if json {
                let rows: Vec<_> = list.iter().map(webhook_json).collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|w| {
                        vec![
                            w.id.clone(),
                            w.url.clone(),
                            w.kinds.join(","),
                            w.format.clone(),
                            time(w.created_at.as_ref()),
                        ]
                    })
                    .collect();
                write_table(out, &["ID", "URL", "KINDS", "FORMAT", "CREATED"], &rows)?;
            }
        }
        AlertsCommand::Remove { id, json } => {
            let w = client
                .remove_webhook(pb::RemoveWebhookRequest { id })
                .await
                .with_context(ctx)?
                .into_inner();
            if json {
                writeln!(out, "{}", webhook_json(&w))?;
            } else {
                writeln!(out, "webhook {} removed", w.id)?;
            }
        }
        AlertsCommand::Test { id, json } => {
            let r = client
                .test_webhook(pb::TestWebhookRequest { id: id.clone() })
                .await
                .with_context(ctx)?
                .into_inner();
            if json {
                writeln!(
                    out,
                    "{}",
                    json!({ "event_id": r.event_id, "webhook_id": id })
                )?;
            } else {
                writeln!(
                    out,
                    "test event {} queued for {id}; see `nm-gateway alerts deliveries --webhook {id}`",
                    r.event_id
                )?;
            }
        }
        AlertsCommand::Deliveries {
            webhook,
            limit,
            json,
        } => {
            let list = client
                .list_deliveries(pb::ListDeliveriesRequest {
                    webhook_id: webhook.unwrap_or_default(),
                    limit,
                })
                .await
                .with_context(ctx)?
                .into_inner()
                .deliveries;
            if json {
                let rows: Vec<_> = list
                    .iter()
                    .map(|d| {
                        json!({
                            "event_id": d.event_id,
                            "webhook_id": d.webhook_id,
                            "kind": d.kind,
                            "event_at": time(d.event_at.as_ref()),
                            "state": d.state,
                            "attempts": d.attempts,
                            "last_status": d.last_status,
                            "last_error": d.last_error,
                            "next_attempt_at": d.next_attempt_at.as_ref().map(|t| time(Some(t))),
                            "updated_at": time(d.updated_at.as_ref()),
                        })
                    })
                    .collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|d| {
                        vec![
                            time(d.event_at.as_ref()),
                            d.kind.clone(),
                            d.webhook_id.clone(),
                            d.state.clone(),
                            d.attempts.to_string(),
                            d.last_status.map_or(String::new(), |s| s.to_string()),
                            d.last_error.clone().unwrap_or_default(),
                        ]
                    })
                    .collect();
                write_table(
                    out,
                    &[
                        "EVENT AT", "KIND", "WEBHOOK", "STATE", "TRIES", "STATUS", "ERROR",
                    ],
                    &rows,
                )?;
            }
        }
    }
    Ok(())
}

fn webhook_json(w: &pb::Webhook) -> serde_json::Value {
    json!({
        "id": w.id,
        "url": w.url,
        "kinds": w.kinds,
        "format": w.format,
        "description": w.description,
        "created_at": time(w.created_at.as_ref()),
    })
}
