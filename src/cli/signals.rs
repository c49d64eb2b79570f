//! `nm-gateway signals list --agent A | --session S`: the stored signals (explicit and implicit,
//! with source, rule, request id, action, edit distance, time and session), newest first,
//! following the pages of `nm.v1.Agents/ListSignals`.

use std::io::Write;

use anyhow::Context;
use serde_json::json;

use super::{UsageError, admin_channel, time, write_table};
use crate::config::Settings;
use crate::grpc::pb::{self, agents_client::AgentsClient};

/// `nm-gateway signals <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum SignalsCommand {
    /// The stored signals of an agent or a session, newest first.
    List {
        /// The agent's signals.
        #[arg(long, conflicts_with = "session", required_unless_present = "session")]
        agent: Option<String>,
        /// The session's signals (`sess_...`).
        #[arg(long)]
        session: Option<String>,
        /// Only `explicit` or only `implicit` signals.
        #[arg(long)]
        source: Option<String>,
        /// Most signals to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
}

pub async fn signals(
    settings: &Settings,
    cmd: SignalsCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let SignalsCommand::List {
        agent,
        session,
        source,
        limit,
        json,
    } = cmd;
    if let Some(s) = &source
        && s != "explicit"
        && s != "implicit"
    {
        return Err(UsageError("--source: use explicit or implicit".to_owned()).into());
    }
    let mut client = AgentsClient::new(admin_channel(settings)?);
    let mut all: Vec<pb::StoredSignal> = Vec::new();
    let mut token = String::new();
    while all.len() < limit as usize {
        let page = client
            .list_signals(pb::ListSignalsRequest {
                agent: agent.clone().unwrap_or_default(),
                session_id: session.clone().unwrap_or_default(),
                page_size: (limit as usize - all.len()).min(1000) as u32,
                page_token: token,
                source: source.clone(),
            })
            .await
            .with_context(|| format!("controlplane {}", settings.controlplane_url))?
            .into_inner();
        all.extend(page.signals);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    if json {
        let rows: Vec<serde_json::Value> = all
            .iter()
            .map(|s| {
                json!({
                    "id": s.id,
                    "source": s.source,
                    "rule": s.rule,
                    "request_id": s.request_id,
                    "action": s.action,
                    "edit_distance": s.edit_distance,
                    "received_at_ms": s.received_at.as_ref().map(crate::grpc::convert::timestamp_to_ms),
                    "session_id": (!s.session_id.is_empty()).then_some(&s.session_id),
                    "agent": s.agent,
                    "env": s.env,
                })
            })
            .collect();
        writeln!(out, "{}", serde_json::Value::Array(rows))?;
        return Ok(());
    }
    let dash = |v: Option<&str>| v.filter(|v| !v.is_empty()).unwrap_or("-").to_owned();
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|s| {
            vec![
                time(s.received_at.as_ref()),
                s.source.clone(),
                dash(s.rule.as_deref()),
                s.action.clone(),
                s.edit_distance
                    .map_or_else(|| "-".to_owned(), |d| d.to_string()),
                dash(s.request_id.as_deref()),
                dash(Some(&s.session_id)),
            ]
        })
        .collect();
    write_table(
        out,
        &[
            "TIME", "SOURCE", "RULE", "ACTION", "EDIT", "REQUEST", "SESSION",
        ],
        &rows,
    )?;
    Ok(())
}
