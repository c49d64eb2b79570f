//! `nm-gateway budgets set|show|list|delete`: per-end-user budgets on the controlplane.

use std::io::Write;

use anyhow::Context;
use nm_types::money::{format_usd, parse_usd};
use serde_json::json;

use super::{UsageError, admin_channel, time, write_table};
use crate::config::Settings;
use crate::grpc::pb::{self, budgets_client::BudgetsClient};

/// `nm-gateway budgets <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BudgetsCommand {
    /// Set the default budget (--default) or one end user's override (--user).
    Set {
        #[command(flatten)]
        subject: Subject,
        /// Dollars an end user may spend per UTC day.
        #[arg(long, value_name = "USD", conflicts_with = "usd_per_month")]
        usd_per_day: Option<String>,
        /// Dollars an end user may spend per UTC calendar month.
        #[arg(long, value_name = "USD")]
        usd_per_month: Option<String>,
        /// Requests an end user may start per minute.
        #[arg(long, value_name = "N")]
        rpm: Option<u32>,
        #[arg(long)]
        json: bool,
    },
    /// One end user's budget in force and spend so far.
    Show {
        /// The end user (`NM-User`).
        user: String,
        #[arg(long)]
        json: bool,
    },
    /// The default budget and every override.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove the default budget or a user's override (the user falls back to the default).
    Delete {
        #[command(flatten)]
        subject: Subject,
        #[arg(long)]
        json: bool,
    },
}

/// Whose budget: the default or one user's.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Subject {
    /// The default budget of every end user without an override.
    #[arg(long)]
    default: bool,
    /// One end user's override (`NM-User`).
    #[arg(long)]
    user: Option<String>,
}

pub async fn budgets(
    settings: &Settings,
    cmd: BudgetsCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = BudgetsClient::new(admin_channel(settings)?);
    let cp = &settings.controlplane_url;
    match cmd {
        BudgetsCommand::Set {
            subject,
            usd_per_day,
            usd_per_month,
            rpm,
            json,
        } => {
            let (limit, period) = match (usd_per_day, usd_per_month) {
                (Some(d), _) => (Some(usd(&d, "--usd-per-day")?), pb::BudgetPeriod::Day),
                (None, Some(m)) => (Some(usd(&m, "--usd-per-month")?), pb::BudgetPeriod::Month),
                (None, None) => (None, pb::BudgetPeriod::Day),
            };
            if limit.is_none() && rpm.is_none() {
                return Err(UsageError(
                    "give --usd-per-day, --usd-per-month and/or --rpm".to_owned(),
                )
                .into());
            }
            let b = client
                .set_budget(pb::SetBudgetRequest {
                    user_id: subject.user,
                    limit_micros: limit,
                    period: period.into(),
                    requests_per_minute: rpm,
                })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            if json {
                writeln!(out, "{}", budget_json(&b))?;
            } else {
                writeln!(out, "budget set: {} {}", whose(&b), describe(&b))?;
            }
        }
        BudgetsCommand::Show { user, json } => {
            let s = client
                .get_budget(pb::GetBudgetRequest { user_id: user })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            if json {
                writeln!(
                    out,
                    "{}",
                    json!({
                        "user_id": s.user_id,
                        "budget": s.budget.as_ref().map(budget_json),
                        "is_default": s.is_default,
                        "spent_today_micros": s.day_micros,
                        "spent_this_month_micros": s.month_micros,
                        "remaining_micros": s.remaining_micros,
                        "resets_at": s.resets_at.as_ref().map(|t| time(Some(t))),
                        "leased_micros": s.leased_micros,
                        "lease_holders": s.lease_holders,
                    })
                )?;
            } else {
                writeln!(out, "user: {}", s.user_id)?;
                match &s.budget {
                    Some(b) => writeln!(
                        out,
                        "budget: {}{}",
                        describe(b),
                        if s.is_default { " (default)" } else { "" }
                    )?,
                    None => writeln!(out, "budget: none")?,
                }
                writeln!(out, "spent today: {}", format_usd(s.day_micros))?;
                writeln!(out, "spent this month: {}", format_usd(s.month_micros))?;
                if let Some(r) = s.remaining_micros {
                    writeln!(out, "remaining: {}", format_usd(r))?;
                }
                if s.lease_holders > 0 {
                    writeln!(
                        out,
                        "held by {} dataplane(s): {}",
                        s.lease_holders,
                        format_usd(s.leased_micros)
                    )?;
                }
                if s.resets_at.is_some() {
                    writeln!(out, "resets at: {}", time(s.resets_at.as_ref()))?;
                }
            }
        }
        BudgetsCommand::List { json } => {
            let r = client
                .list_budgets(pb::ListBudgetsRequest {})
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            let all: Vec<&pb::Budget> = r.default_budget.iter().chain(&r.overrides).collect();
            if json {
                let rows: Vec<_> = all.iter().map(|b| budget_json(b)).collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
            } else {
                let rows: Vec<Vec<String>> = all
                    .iter()
                    .map(|b| {
                        vec![
                            whose(b),
                            b.limit_micros.map_or_else(|| "-".to_owned(), format_usd),
                            period_name(b).to_owned(),
                            b.requests_per_minute
                                .map_or_else(|| "-".to_owned(), |r| r.to_string()),
                            time(b.updated_at.as_ref()),
                        ]
                    })
                    .collect();
                write_table(out, &["WHO", "LIMIT", "PER", "RPM", "UPDATED"], &rows)?;
            }
        }
        BudgetsCommand::Delete { subject, json } => {
            let label = subject
                .user
                .as_ref()
                .map_or_else(|| "default".to_owned(), |u| format!("user {u}"));
            let r = client
                .delete_budget(pb::DeleteBudgetRequest {
                    user_id: subject.user,
                })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            if json {
                writeln!(out, "{}", json!({"deleted": r.deleted}))?;
            } else if r.deleted {
                writeln!(out, "budget deleted: {label}")?;
            } else {
                writeln!(out, "no budget to delete: {label}")?;
            }
        }
    }
    Ok(())
}

fn usd(v: &str, flag: &str) -> Result<u64, UsageError> {
    parse_usd(v).map_err(|e| UsageError(format!("{flag}: {e}")))
}

fn whose(b: &pb::Budget) -> String {
    b.user_id
        .as_ref()
        .map_or_else(|| "default".to_owned(), |u| format!("user {u}"))
}

fn period_name(b: &pb::Budget) -> &'static str {
    match b.period() {
        pb::BudgetPeriod::Month => "month",
        pb::BudgetPeriod::Day | pb::BudgetPeriod::Unspecified => "day",
    }
}

fn describe(b: &pb::Budget) -> String {
    let mut parts = Vec::new();
    if let Some(l) = b.limit_micros {
        parts.push(format!("{} per {}", format_usd(l), period_name(b)));
    }
    if let Some(r) = b.requests_per_minute {
        parts.push(format!("{r} requests per minute"));
    }
    parts.join(", ")
}

fn budget_json(b: &pb::Budget) -> serde_json::Value {
    json!({
        "user_id": b.user_id,
        "limit_micros": b.limit_micros,
        "period": period_name(b),
        "requests_per_minute": b.requests_per_minute,
        "updated_at": b.updated_at.as_ref().map(|t| time(Some(t))),
    })
}
