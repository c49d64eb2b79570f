//! `nm-gateway audit`: the audit trail of admin changes, oldest first, as a table or JSON (one
//! array of every event in the range, fetched page by page).

use std::io::Write;

use anyhow::Context;
use serde_json::json;

use super::{UsageError, admin_channel, parse_time, time, write_table};
use crate::config::Settings;
use crate::grpc::convert;
use crate::grpc::pb::{self, audit_client::AuditClient};

/// Events asked for per call.
const PAGE: u32 = 500;

/// `nm-gateway audit --since ... [--until ...] [--json]`.
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// From this time: RFC 3339, YYYY-MM-DD (UTC), or an age like 7d, 24h, 30m.
    #[arg(long)]
    since: Option<String>,
    /// Until this time (exclusive), same forms as --since.
    #[arg(long)]
    until: Option<String>,
    /// Print JSON (an array of events) instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn audit(
    settings: &Settings,
    args: AuditArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let now = chrono::Utc::now();
    let ts =
        |v: &Option<String>, flag: &str| -> Result<Option<prost_types::Timestamp>, UsageError> {
            v.as_deref()
                .map(|v| {
                    parse_time(v, now)
                    .map(|t| convert::ms_to_timestamp(t.timestamp_millis()))
                    .ok_or_else(|| {
                        UsageError(format!(
                            "--{flag} {v:?}: use RFC 3339, YYYY-MM-DD or an age like 7d, 24h, 30m"
                        ))
                    })
                })
                .transpose()
        };
    let range = pb::TimeRange {
        since: ts(&args.since, "since")?,
        until: ts(&args.until, "until")?,
    };
    let mut client = AuditClient::new(admin_channel(settings)?);
    let mut events = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_audit_events(pb::ListAuditEventsRequest {
                range: Some(range),
                page_size: PAGE,
                page_token: std::mem::take(&mut page_token),
            })
            .await
            .with_context(|| format!("controlplane {}", settings.controlplane_url))?
            .into_inner();
        events.extend(page.events);
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    if args.json {
        let parse = |s: &str| {
            (!s.is_empty())
                .then(|| serde_json::from_str::<serde_json::Value>(s).unwrap_or_else(|_| json!(s)))
        };
        let rows: Vec<_> = events
            .iter()
            .map(|e| {
                json!({
                    "id": e.id,
                    "at": time(e.at.as_ref()),
                    "actor_key_id": e.actor_key_id,
                    "action": e.action,
                    "target": e.target,
                    "before": parse(&e.before_json),
                    "after": parse(&e.after_json),
                })
            })
            .collect();
        writeln!(out, "{}", serde_json::Value::Array(rows))?;
    } else {
        let rows: Vec<Vec<String>> = events
            .iter()
            .map(|e| {
                vec![
                    time(e.at.as_ref()),
                    e.actor_key_id.clone(),
                    e.action.clone(),
                    e.target.clone(),
                ]
            })
            .collect();
        write_table(out, &["TIME", "BY", "ACTION", "TARGET"], &rows)?;
    }
    Ok(())
}
