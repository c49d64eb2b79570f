//! `nm-gateway budgets set|show|list|delete`: budgets at every level on the controlplane (a key,
//! a key label, an agent, a model, an env, an end user, and the defaults for keys and end users).

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
    /// Set a budget: of one scope, or a default (--default-key, --default). One period per
    /// budget: the --usd-per-* and --tokens-per-* given must name the same one.
    Set {
        #[command(flatten)]
        subject: Subject,
        /// Dollars per UTC day.
        #[arg(long, value_name = "USD")]
        usd_per_day: Option<String>,
        /// Dollars per ISO week (Monday 00:00 UTC).
        #[arg(long, value_name = "USD")]
        usd_per_week: Option<String>,
        /// Dollars per UTC calendar month.
        #[arg(long, value_name = "USD")]
        usd_per_month: Option<String>,
        /// Tokens (input plus output) per UTC day.
        #[arg(long, value_name = "N")]
        tokens_per_day: Option<u64>,
        /// Tokens per ISO week.
        #[arg(long, value_name = "N")]
        tokens_per_week: Option<u64>,
        /// Tokens per UTC calendar month.
        #[arg(long, value_name = "N")]
        tokens_per_month: Option<u64>,
        /// Requests started per minute.
        #[arg(long, value_name = "N")]
        rpm: Option<u32>,
        /// Tokens per minute (reserved from `max_tokens`, settled from the usage).
        #[arg(long, value_name = "N")]
        tpm: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// A scope's budget in force (its own or the default) and spend so far.
    Show {
        /// The end user (`NM-User`), as before scopes; or give one scope flag.
        user: Option<String>,
        #[command(flatten)]
        scope: ShowScope,
        #[arg(long)]
        json: bool,
    },
    /// Every budget.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a budget (a key or end user falls back to the default).
    Delete {
        #[command(flatten)]
        subject: Subject,
        #[arg(long)]
        json: bool,
    },
}

/// Whose budget.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Subject {
    /// The default budget of every end user without their own.
    #[arg(long)]
    default: bool,
    /// The default budget of every key without its own.
    #[arg(long)]
    default_key: bool,
    /// One end user (`NM-User`).
    #[arg(long)]
    user: Option<String>,
    /// One key, by id.
    #[arg(long, value_name = "ID")]
    key: Option<String>,
    /// Every key holding a label (`name=value`, e.g. `team=search`): a team's budget.
    #[arg(long, value_name = "NAME=VALUE")]
    label: Option<String>,
    /// One agent (`NM-Agent`).
    #[arg(long)]
    agent: Option<String>,
    /// One model, as requests name it.
    #[arg(long)]
    model: Option<String>,
    /// One env (`NM-Env`).
    #[arg(long)]
    env: Option<String>,
}

impl Subject {
    /// `(scope, scope_value)` on the wire.
    fn wire(&self) -> (String, String) {
        if self.default {
            return ("default".to_owned(), String::new());
        }
        if self.default_key {
            return ("default-key".to_owned(), String::new());
        }
        scope_of(
            &self.user,
            &self.key,
            &self.label,
            &self.agent,
            &self.model,
            &self.env,
        )
        .unwrap_or_else(|| ("default".to_owned(), String::new()))
    }
}

/// Which scope `show` shows (or the positional end user).
#[derive(Debug, Clone, clap::Args)]
#[group(required = false, multiple = false)]
pub struct ShowScope {
    #[arg(long = "user", value_name = "USER")]
    user_flag: Option<String>,
    #[arg(long, value_name = "ID")]
    key: Option<String>,
    #[arg(long, value_name = "NAME=VALUE")]
    label: Option<String>,
    #[arg(long)]
    agent: Option<String>,
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    env: Option<String>,
}

fn scope_of(
    user: &Option<String>,
    key: &Option<String>,
    label: &Option<String>,
    agent: &Option<String>,
    model: &Option<String>,
    env: &Option<String>,
) -> Option<(String, String)> {
    [
        ("user", user),
        ("key", key),
        ("label", label),
        ("agent", agent),
        ("model", model),
        ("env", env),
    ]
    .into_iter()
    .find_map(|(k, v)| v.as_ref().map(|v| (k.to_owned(), v.clone())))
}

pub async fn budgets(
    settings: &Settings,
    cmd: BudgetsCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let cp = &settings.controlplane_url;
    match cmd {
        BudgetsCommand::Set {
            subject,
            usd_per_day,
            usd_per_week,
            usd_per_month,
            tokens_per_day,
            tokens_per_week,
            tokens_per_month,
            rpm,
            tpm,
            json,
        } => {
            let mut periods = Vec::new();
            let mut limit = None;
            for (v, flag, p) in [
                (usd_per_day, "--usd-per-day", pb::BudgetPeriod::Day),
                (usd_per_week, "--usd-per-week", pb::BudgetPeriod::Week),
                (usd_per_month, "--usd-per-month", pb::BudgetPeriod::Month),
            ] {
                if let Some(v) = v {
                    if limit.is_some() {
                        return Err(UsageError("give one --usd-per-* limit".to_owned()).into());
                    }
                    limit = Some(usd(&v, flag)?);
                    periods.push(p);
                }
            }
            let mut tokens = None;
            for (v, p) in [
                (tokens_per_day, pb::BudgetPeriod::Day),
                (tokens_per_week, pb::BudgetPeriod::Week),
                (tokens_per_month, pb::BudgetPeriod::Month),
            ] {
                if let Some(v) = v {
                    if tokens.is_some() {
                        return Err(UsageError("give one --tokens-per-* limit".to_owned()).into());
                    }
                    tokens = Some(v);
                    periods.push(p);
                }
            }
            if periods.len() == 2 && periods[0] != periods[1] {
                return Err(UsageError(
                    "a budget has one period: --usd-per-* and --tokens-per-* must name the same \
                     (set a second budget on another scope for another period)"
                        .to_owned(),
                )
                .into());
            }
            if limit.is_none() && tokens.is_none() && rpm.is_none() && tpm.is_none() {
                return Err(UsageError(
                    "give --usd-per-day|week|month, --tokens-per-day|week|month, --rpm and/or \
                     --tpm"
                        .to_owned(),
                )
                .into());
            }
            let period = periods.first().copied().unwrap_or(pb::BudgetPeriod::Day);
            let (scope, scope_value) = subject.wire();
            let mut client = BudgetsClient::new(admin_channel(settings)?);
            let b = client
                .set_budget(pb::SetBudgetRequest {
                    user_id: None,
                    limit_micros: limit,
                    period: period.into(),
                    requests_per_minute: rpm,
                    scope,
                    scope_value,
                    limit_tokens: tokens,
                    tokens_per_minute: tpm,
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
        BudgetsCommand::Show { user, scope, json } => {
            let (kind, value) = match (
                user,
                scope_of(
                    &scope.user_flag,
                    &scope.key,
                    &scope.label,
                    &scope.agent,
                    &scope.model,
                    &scope.env,
                ),
            ) {
                (Some(u), None) => ("user".to_owned(), u),
                (None, Some(s)) => s,
                _ => {
                    return Err(UsageError(
                        "name one end user (USER or --user), or one of --key, --label, --agent, \
                         --model, --env"
                            .to_owned(),
                    )
                    .into());
                }
            };
            let mut client = BudgetsClient::new(admin_channel(settings)?);
            let s = client
                .get_budget(pb::GetBudgetRequest {
                    user_id: String::new(),
                    scope: kind.clone(),
                    scope_value: value.clone(),
                })
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            if json {
                let limits: Vec<_> = s
                    .limits
                    .iter()
                    .map(|l| {
                        json!({
                            "limit": l.limit,
                            "value": l.value,
                            "spent": l.spent,
                            "remaining": l.remaining,
                            "period_end": l.period_end.as_ref().map(|t| time(Some(t))),
                            "leased": l.leased,
                            "lease_holders": l.lease_holders,
                        })
                    })
                    .collect();
                writeln!(
                    out,
                    "{}",
                    json!({
                        "scope": s.scope,
                        "scope_value": s.scope_value,
                        "user_id": (kind == "user").then_some(&s.user_id),
                        "budget": s.budget.as_ref().map(budget_json),
                        "is_default": s.is_default,
                        "spent_today_micros": s.day_micros,
                        "spent_this_month_micros": s.month_micros,
                        "remaining_micros": s.remaining_micros,
                        "resets_at": s.resets_at.as_ref().map(|t| time(Some(t))),
                        "leased_micros": s.leased_micros,
                        "lease_holders": s.lease_holders,
                        "limits": limits,
                    })
                )?;
            } else {
                writeln!(out, "{kind}: {value}")?;
                match &s.budget {
                    Some(b) => writeln!(
                        out,
                        "budget: {}{}",
                        describe(b),
                        if s.is_default { " (default)" } else { "" }
                    )?,
                    None => writeln!(out, "budget: none")?,
                }
                for l in &s.limits {
                    let money = l.limit.starts_with("usd");
                    let n = |v: u64| if money { format_usd(v) } else { v.to_string() };
                    writeln!(
                        out,
                        "{}: limit {}, spent {}, remaining {}, until {}",
                        l.limit,
                        n(l.value),
                        n(l.spent),
                        n(l.remaining),
                        time(l.period_end.as_ref())
                    )?;
                    if l.lease_holders > 0 {
                        writeln!(
                            out,
                            "  held by {} dataplane(s): {}",
                            l.lease_holders,
                            n(l.leased)
                        )?;
                    }
                }
                writeln!(out, "spent today: {}", format_usd(s.day_micros))?;
                writeln!(out, "spent this month: {}", format_usd(s.month_micros))?;
            }
        }
        BudgetsCommand::List { json } => {
            let mut client = BudgetsClient::new(admin_channel(settings)?);
            let r = client
                .list_budgets(pb::ListBudgetsRequest {})
                .await
                .with_context(|| format!("controlplane {cp}"))?
                .into_inner();
            if json {
                let rows: Vec<_> = r.budgets.iter().map(budget_json).collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
            } else {
                let dash = || "-".to_owned();
                let rows: Vec<Vec<String>> = r
                    .budgets
                    .iter()
                    .map(|b| {
                        vec![
                            whose(b),
                            b.limit_micros.map_or_else(dash, format_usd),
                            b.limit_tokens.map_or_else(dash, |t| t.to_string()),
                            period_name(b).to_owned(),
                            b.requests_per_minute.map_or_else(dash, |r| r.to_string()),
                            b.tokens_per_minute.map_or_else(dash, |r| r.to_string()),
                            time(b.updated_at.as_ref()),
                        ]
                    })
                    .collect();
                write_table(
                    out,
                    &["WHO", "LIMIT", "TOKENS", "PER", "RPM", "TPM", "UPDATED"],
                    &rows,
                )?;
            }
        }
        BudgetsCommand::Delete { subject, json } => {
            let (scope, scope_value) = subject.wire();
            let label = whose_wire(&scope, &scope_value);
            let mut client = BudgetsClient::new(admin_channel(settings)?);
            let r = client
                .delete_budget(pb::DeleteBudgetRequest {
                    user_id: None,
                    scope,
                    scope_value,
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

fn whose_wire(scope: &str, value: &str) -> String {
    match scope {
        "" | "default" => "default".to_owned(),
        "default-key" => "default for keys".to_owned(),
        kind => format!("{kind} {value}"),
    }
}

fn whose(b: &pb::Budget) -> String {
    match (b.scope.as_str(), &b.user_id) {
        ("", Some(u)) => format!("user {u}"),
        (scope, _) => whose_wire(scope, &b.scope_value),
    }
}

fn period_name(b: &pb::Budget) -> &'static str {
    match b.period() {
        pb::BudgetPeriod::Month => "month",
        pb::BudgetPeriod::Week => "week",
        pb::BudgetPeriod::Day | pb::BudgetPeriod::Unspecified => "day",
    }
}

fn describe(b: &pb::Budget) -> String {
    let mut parts = Vec::new();
    if let Some(l) = b.limit_micros {
        parts.push(format!("{} per {}", format_usd(l), period_name(b)));
    }
    if let Some(t) = b.limit_tokens {
        parts.push(format!("{t} tokens per {}", period_name(b)));
    }
    if let Some(r) = b.requests_per_minute {
        parts.push(format!("{r} requests per minute"));
    }
    if let Some(t) = b.tokens_per_minute {
        parts.push(format!("{t} tokens per minute"));
    }
    parts.join(", ")
}

fn budget_json(b: &pb::Budget) -> serde_json::Value {
    json!({
        "scope": b.scope,
        "scope_value": b.scope_value,
        "user_id": b.user_id,
        "limit_micros": b.limit_micros,
        "limit_tokens": b.limit_tokens,
        "period": period_name(b),
        "requests_per_minute": b.requests_per_minute,
        "tokens_per_minute": b.tokens_per_minute,
        "updated_at": b.updated_at.as_ref().map(|t| time(Some(t))),
    })
}
