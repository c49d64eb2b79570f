//! Admin commands (`nm-gateway keys|agents|budgets|experiments|usage|audit|alerts ...`): gRPC calls to the controlplane
//! with the admin key in `nm-key` metadata, printed as a table or, with `--json`, as JSON.

mod alerts;
mod analytics;
mod audit;
mod budgets;
mod experiments;
mod keys;
mod signals;
mod usage;
mod users;

pub use alerts::{AlertsCommand, alerts};
pub use analytics::{OutcomesArgs, RecommendArgs, RecomputeArgs, print_analytics};

pub use audit::{AuditArgs, audit};
pub use budgets::{BudgetsCommand, budgets};
pub use experiments::{ExperimentsCommand, experiments};
pub use keys::{KeysCommand, keys};
pub use signals::{SignalsCommand, signals};
pub use usage::{UsageArgs, usage};
pub use users::{UsersCommand, users};

use std::io::Write;

use anyhow::Context;
use nm_types::Action;
use serde_json::json;
use tonic::metadata::MetadataValue;

use crate::config::Settings;
use crate::grpc::pb::{self, agents_client::AgentsClient};
use crate::grpc::{NM_KEY_METADATA, convert};

/// `nm-gateway agents <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum AgentsCommand {
    /// Every agent with its signals, sessions, requests and last activity.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        #[arg(long)]
        json: bool,
    },
    /// One agent's signal counts per action and its progress toward recommendations.
    Show {
        /// The agent name (`NM-Agent`); omit with --unattributed.
        agent: Option<String>,
        /// Show the signals that belong to no agent.
        #[arg(long, conflicts_with = "agent")]
        unattributed: bool,
        #[command(flatten)]
        filter: FilterArgs,
        #[arg(long)]
        json: bool,
    },
    /// One agent's analytics: progress toward 100 signals, then recommendations with their
    /// evidence and outcome-weighted cost.
    Recommend(RecommendArgs),
    /// Recompute analytics now (one agent, or every agent with signals) and store them.
    Recompute(RecomputeArgs),
    /// One agent's session outcome rates grouped by model, provider, env, week or user.
    Outcomes(OutcomesArgs),
    /// Set an agent's settings: which signals its analytics count.
    Set {
        /// The agent name (`NM-Agent`).
        agent: String,
        /// `explicit` (the default: signals the application sent) or `explicit+implicit` (also
        /// the gateway's implicit signals, where a session or answer has no explicit one).
        #[arg(long)]
        evidence: String,
        /// With `explicit+implicit`: count the rule `continued` (an answer carried back
        /// unchanged) as a success.
        #[arg(long)]
        continued_counts: bool,
        #[arg(long)]
        json: bool,
    },
}

/// Filters shared by the agents commands.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FilterArgs {
    /// Only this env: production, staging or development.
    #[arg(long)]
    env: Option<String>,
    /// From this time: RFC 3339, YYYY-MM-DD (UTC), or an age like 7d, 24h, 30m.
    #[arg(long)]
    since: Option<String>,
    /// Until this time (exclusive), same forms as --since.
    #[arg(long)]
    until: Option<String>,
}

impl FilterArgs {
    pub(crate) fn range(&self) -> Result<pb::TimeRange, UsageError> {
        let now = chrono::Utc::now();
        let ts = |s: &Option<String>,
                  flag: &str|
         -> Result<Option<prost_types::Timestamp>, UsageError> {
            s.as_deref()
                .map(|v| {
                    parse_time(v, now)
                        .map(|t| convert::ms_to_timestamp(t.timestamp_millis()))
                        .ok_or_else(|| UsageError(format!("--{flag} {v:?}: use RFC 3339, YYYY-MM-DD or an age like 7d, 24h, 30m")))
                })
                .transpose()
        };
        Ok(pb::TimeRange {
            since: ts(&self.since, "since")?,
            until: ts(&self.until, "until")?,
        })
    }

    pub(crate) fn env(&self) -> Result<Option<String>, UsageError> {
        match &self.env {
            None => Ok(None),
            Some(e) => e
                .parse::<nm_types::Env>()
                .map(|e| Some(e.as_str().to_owned()))
                .map_err(|err| UsageError(format!("--env: {err}"))),
        }
    }
}

/// RFC 3339, a UTC date, or an age (`7d`, `24h`, `30m`, `90s`) before `now`.
pub fn parse_time(
    v: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<chrono::DateTime<chrono::Utc>> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(v) {
        return Some(t.with_timezone(&chrono::Utc));
    }
    if let Ok(d) = chrono::NaiveDate::parse_from_str(v, "%Y-%m-%d") {
        return Some(d.and_hms_opt(0, 0, 0)?.and_utc());
    }
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: i64 = num.parse().ok().filter(|n| *n >= 0)?;
    let age = match unit {
        "d" => chrono::Duration::try_days(n)?,
        "h" => chrono::Duration::try_hours(n)?,
        "m" => chrono::Duration::try_minutes(n)?,
        "s" => chrono::Duration::try_seconds(n)?,
        _ => return None,
    };
    now.checked_sub_signed(age)
}

/// Errors a user can fix by changing the command line or settings (exit code 64).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Adds the admin key to every call.
#[derive(Debug, Clone)]
pub struct AdminKey(MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for AdminKey {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert(NM_KEY_METADATA, self.0.clone());
        Ok(req)
    }
}

pub(crate) type AdminChannel =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AdminKey>;

/// A channel to the controlplane that presents `NM_ADMIN_KEY`.
pub(crate) fn admin_channel(settings: &Settings) -> anyhow::Result<AdminChannel> {
    let admin_key = settings.admin_key.clone().ok_or_else(|| {
        UsageError("set NM_ADMIN_KEY (or --admin-key) to an admin service key".to_owned())
    })?;
    let value = admin_key
        .parse()
        .map_err(|_| UsageError("NM_ADMIN_KEY is not a valid header value".to_owned()))?;
    let channel = crate::grpc::channel(&settings.controlplane_url, &settings.controlplane_tls)?;
    Ok(tonic::service::interceptor::InterceptedService::new(
        channel,
        AdminKey(value),
    ))
}

pub async fn agents(
    settings: &Settings,
    cmd: AgentsCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let cmd = match cmd {
        AgentsCommand::Recommend(a) => return analytics::recommend(settings, a, out).await,
        AgentsCommand::Recompute(a) => return analytics::recompute(settings, a, out).await,
        AgentsCommand::Outcomes(a) => return analytics::outcomes(settings, a, out).await,
        other => other,
    };
    let mut client = AgentsClient::new(admin_channel(settings)?);
    let cp = &settings.controlplane_url;
    match cmd {
        AgentsCommand::Recommend(_) | AgentsCommand::Recompute(_) | AgentsCommand::Outcomes(_) => {}
        AgentsCommand::Set {
            agent,
            evidence,
            continued_counts,
            json,
        } => {
            let evidence = evidence.trim().to_owned();
            if evidence != "explicit" && evidence != "explicit+implicit" {
                return Err(
                    UsageError("--evidence: use explicit or explicit+implicit".to_owned()).into(),
                );
            }
            if continued_counts && evidence == "explicit" {
                return Err(UsageError(
                    "--continued-counts needs --evidence explicit+implicit".to_owned(),
                )
                .into());
            }
            let s = client
                .set_agent_settings(pb::SetAgentSettingsRequest {
                    agent,
                    evidence,
                    continued_counts,
                })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            if json {
                writeln!(out, "{}", settings_json(&s))?;
            } else {
                writeln!(
                    out,
                    "agent {}: evidence {}{}",
                    s.agent,
                    s.evidence,
                    if s.continued_counts {
                        ", continued counts as a success"
                    } else {
                        ""
                    }
                )?;
            }
        }
        AgentsCommand::List { filter, json } => {
            let req = pb::ListAgentsRequest {
                env: filter.env()?,
                range: Some(filter.range()?),
            };
            let agents = client
                .list_agents(req)
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner()
                .agents;
            if json {
                let rows: Vec<_> = agents
                    .iter()
                    .map(|a| {
                        json!({
                            "agent": (!a.unattributed).then_some(&a.agent),
                            "signals": a.signals,
                            "sessions": a.sessions,
                            "requests": a.requests,
                            "last_activity": a.last_activity.as_ref().map(|t| time(Some(t))),
                        })
                    })
                    .collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
            } else {
                let rows: Vec<Vec<String>> = agents
                    .iter()
                    .map(|a| {
                        vec![
                            agent_label(a.unattributed, &a.agent),
                            a.signals.to_string(),
                            a.sessions.to_string(),
                            a.requests.to_string(),
                            time(a.last_activity.as_ref()),
                        ]
                    })
                    .collect();
                write_table(
                    out,
                    &["AGENT", "SIGNALS", "SESSIONS", "REQUESTS", "LAST ACTIVITY"],
                    &rows,
                )?;
            }
        }
        AgentsCommand::Show {
            agent,
            unattributed,
            filter,
            json,
        } => {
            if agent.is_none() && !unattributed {
                return Err(UsageError("name an agent, or pass --unattributed".to_owned()).into());
            }
            // Progress toward recommendations as `agents recommend` gives it: all the agent's
            // signals (whatever the filters), the recent rate and the expected date.
            let analytics = match &agent {
                Some(name) => Some(analytics::answer(settings, name.clone(), false).await?),
                None => None,
            };
            let req = pb::GetAgentSignalsRequest {
                agent: agent.unwrap_or_default(),
                unattributed,
                env: filter.env()?,
                range: Some(filter.range()?),
            };
            let s = client
                .get_agent_signals(req)
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            let by = s.by_action.unwrap_or_default();
            let counts: Vec<(&str, u64)> = Action::ALL
                .into_iter()
                .map(|a| (a.as_str(), action_count(&by, a)))
                .collect();
            if json {
                let by_action: serde_json::Map<String, serde_json::Value> = counts
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), json!(v)))
                    .collect();
                let mut v = json!({
                    "agent": (!unattributed).then_some(&s.agent),
                    "total": s.total,
                    "by_action": by_action,
                    "threshold": s.threshold,
                    "remaining": s.remaining,
                    "recommendations_unlocked": s.recommendations_unlocked,
                    "progress": s.progress,
                });
                v["by_source"] = json!(s.by_source.iter().map(source_json).collect::<Vec<_>>());
                v["agreement"] = json!(
                    s.agreement
                        .iter()
                        .map(|c| json!({
                            "explicit": c.explicit_outcome,
                            "implicit": c.implicit_outcome,
                            "units": c.units,
                        }))
                        .collect::<Vec<_>>()
                );
                if let Some(settings) = &s.settings {
                    v["settings"] = settings_json(settings);
                }
                if let Some(a) = &analytics {
                    let p = &a.progress;
                    v["threshold"] = json!(p.threshold);
                    v["remaining"] = json!(p.remaining);
                    v["recommendations_unlocked"] =
                        json!(a.status == nm_controlplane::analytics::Status::Ready);
                    v["progress"] = json!((p.signals as f64 / p.threshold.max(1) as f64).min(1.0));
                    v["daily_rate"] = json!(p.daily_rate);
                    v["eta_ms"] = json!(p.eta_ms);
                }
                writeln!(out, "{v}")?;
            } else {
                writeln!(out, "agent: {}", agent_label(unattributed, &s.agent))?;
                writeln!(out, "signals: {}", s.total)?;
                let rows: Vec<Vec<String>> = counts
                    .iter()
                    .map(|(k, v)| vec![(*k).to_owned(), v.to_string()])
                    .collect();
                write_table(out, &["ACTION", "COUNT"], &rows)?;
                print_sources(out, &s)?;
                match &analytics {
                    Some(a) if a.status == nm_controlplane::analytics::Status::Collecting => {
                        analytics::print_progress(out, &a.progress)?;
                    }
                    Some(a) => writeln!(
                        out,
                        "recommendations: unlocked ({} of {} signals)",
                        a.progress.signals, a.progress.threshold
                    )?,
                    None if s.recommendations_unlocked => writeln!(
                        out,
                        "recommendations: unlocked ({} of {} signals)",
                        s.total, s.threshold
                    )?,
                    None => writeln!(
                        out,
                        "recommendations: collecting, {}/{} signals ({:.0}%), {} to go",
                        s.total,
                        s.threshold,
                        s.progress * 100.0,
                        s.remaining
                    )?,
                }
            }
        }
    }
    Ok(())
}

/// An agent's settings as JSON.
fn settings_json(s: &pb::AgentSettings) -> serde_json::Value {
    json!({
        "agent": s.agent,
        "evidence": s.evidence,
        "continued_counts": s.continued_counts,
        "updated_at_ms": s.updated_at.as_ref().map(convert::timestamp_to_ms),
    })
}

/// One source's (and rule's) counts as JSON.
fn source_json(c: &pb::SourceCounts) -> serde_json::Value {
    let by = c.by_action.unwrap_or_default();
    let by_action: serde_json::Map<String, serde_json::Value> = Action::ALL
        .into_iter()
        .map(|a| (a.as_str().to_owned(), json!(action_count(&by, a))))
        .filter(|(_, n)| n != &json!(0))
        .collect();
    json!({"source": c.source, "rule": c.rule, "total": c.total, "by_action": by_action})
}

/// `agents show`'s lines on sources: counts by source and rule, the evidence the analytics
/// count, and the agreement table where both kinds exist.
fn print_sources(out: &mut impl Write, s: &pb::AgentSignals) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = s
        .by_source
        .iter()
        .map(|c| {
            let by = c.by_action.unwrap_or_default();
            let actions: Vec<String> = Action::ALL
                .into_iter()
                .filter(|a| action_count(&by, *a) > 0)
                .map(|a| format!("{} {}", a.as_str(), action_count(&by, a)))
                .collect();
            vec![
                c.source.clone(),
                c.rule.clone().unwrap_or_else(|| "-".to_owned()),
                c.total.to_string(),
                actions.join(", "),
            ]
        })
        .collect();
    if !rows.is_empty() {
        write_table(out, &["SOURCE", "RULE", "COUNT", "ACTIONS"], &rows)?;
    }
    if let Some(settings) = &s.settings {
        let counted = if settings.evidence == "explicit" {
            "explicit (implicit shown beside, not counted)".to_owned()
        } else if settings.continued_counts {
            "explicit + implicit (continued counts as a success)".to_owned()
        } else {
            "explicit + implicit".to_owned()
        };
        writeln!(out, "evidence: {counted}")?;
    }
    if !s.agreement.is_empty() {
        writeln!(
            out,
            "agreement (units with both kinds: explicit outcome vs implicit outcome):"
        )?;
        let implicit: Vec<&str> = ["success", "failure", "abandoned", "continued"]
            .into_iter()
            .filter(|o| s.agreement.iter().any(|c| c.implicit_outcome == *o))
            .collect();
        let mut header = vec!["EXPLICIT \\ IMPLICIT".to_owned()];
        header.extend(implicit.iter().map(|o| o.to_uppercase()));
        let rows: Vec<Vec<String>> = ["success", "failure", "abandoned"]
            .into_iter()
            .filter(|o| s.agreement.iter().any(|c| c.explicit_outcome == *o))
            .map(|e| {
                let mut row = vec![e.to_owned()];
                row.extend(implicit.iter().map(|i| {
                    s.agreement
                        .iter()
                        .find(|c| c.explicit_outcome == e && c.implicit_outcome == *i)
                        .map_or(0, |c| c.units)
                        .to_string()
                }));
                row
            })
            .collect();
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        write_table(out, &header, &rows)?;
    }
    Ok(())
}

fn agent_label(unattributed: bool, agent: &str) -> String {
    if unattributed {
        "(unattributed)".to_owned()
    } else {
        agent.to_owned()
    }
}

pub(crate) fn time(ts: Option<&prost_types::Timestamp>) -> String {
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

/// The count of `action` in the controlplane's answer. Exhaustive, so an action added to
/// `types/signal-actions.json` fails to compile here until its proto field is read.
fn action_count(by: &pb::ActionCounts, action: Action) -> u64 {
    match action {
        Action::Accepted => by.accepted,
        Action::Edited => by.edited,
        Action::Regenerated => by.regenerated,
        Action::Abandoned => by.abandoned,
        Action::ThumbsUp => by.thumbs_up,
        Action::ThumbsDown => by.thumbs_down,
        Action::Published => by.published,
        Action::Sent => by.sent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-22T12:00:00Z")
            .map(|t| t.with_timezone(&chrono::Utc))
            .ok();
        let Some(now) = now else { return };
        let p = |s: &str| parse_time(s, now).map(|t| t.to_rfc3339());
        assert_eq!(p("7d").as_deref(), Some("2026-11-15T12:00:00+00:00"));
        assert_eq!(p("24h").as_deref(), Some("2026-11-21T12:00:00+00:00"));
        assert_eq!(
            p("2026-11-01").as_deref(),
            Some("2026-11-01T00:00:00+00:00")
        );
        assert_eq!(
            p("2026-11-01T10:00:00+02:00").as_deref(),
            Some("2026-11-01T08:00:00+00:00")
        );
        for bad in ["", "d", "-1d", "7w", "yesterday", "2026-13-01"] {
            assert_eq!(p(bad), None, "{bad}");
        }
    }
}
