//! `nm-gateway usage`: usage and cost over a time range, grouped as asked, from the
//! controlplane's database.

use std::io::Write;

use anyhow::Context;
use nm_types::money::format_usd;
use serde_json::json;

use super::{FilterArgs, UsageError, admin_channel, write_table};
use crate::config::Settings;
use crate::grpc::pb::{self, usage_client::UsageClient};

/// `nm-gateway usage [--by ...] [filters]`.
#[derive(Debug, Clone, clap::Args)]
pub struct UsageArgs {
    /// Group by these, comma-separated: agent, session, user, env, provider, model, key, day,
    /// week.
    #[arg(long, value_delimiter = ',')]
    by: Vec<String>,
    #[command(flatten)]
    filter: FilterArgs,
    /// Only this agent.
    #[arg(long)]
    agent: Option<String>,
    /// Only this session (`sess_...`).
    #[arg(long)]
    session: Option<String>,
    /// Only this end user.
    #[arg(long)]
    user: Option<String>,
    /// Only this provider.
    #[arg(long)]
    provider: Option<String>,
    /// Only this model (as answered, else as requested).
    #[arg(long)]
    model: Option<String>,
    /// Most rows, largest cost first (default 100, at most 10000).
    #[arg(long, default_value_t = 100)]
    limit: u32,
    #[arg(long)]
    json: bool,
}

fn dimension(name: &str) -> Result<pb::UsageDimension, UsageError> {
    Ok(match name.trim() {
        "agent" => pb::UsageDimension::Agent,
        "session" => pb::UsageDimension::Session,
        "user" => pb::UsageDimension::User,
        "env" => pb::UsageDimension::Env,
        "provider" => pb::UsageDimension::Provider,
        "model" => pb::UsageDimension::Model,
        "day" => pb::UsageDimension::Day,
        "key" => pb::UsageDimension::Key,
        "week" => pb::UsageDimension::Week,
        other => {
            return Err(UsageError(format!(
                "--by {other:?}: use agent, session, user, env, provider, model, key, day or week"
            )));
        }
    })
}

pub async fn usage(
    settings: &Settings,
    args: UsageArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let dims = args
        .by
        .iter()
        .filter(|b| !b.trim().is_empty())
        .map(|b| dimension(b))
        .collect::<Result<Vec<_>, _>>()?;
    let req = pb::GetUsageRequest {
        range: Some(args.filter.range()?),
        group_by: dims.iter().map(|d| *d as i32).collect(),
        filter: Some(pb::UsageFilter {
            agent: args.agent,
            session_id: args.session,
            user_id: args.user,
            env: args.filter.env()?,
            provider: args.provider,
            model: args.model,
        }),
        limit: args.limit,
    };
    let mut client = UsageClient::new(admin_channel(settings)?);
    let report = client
        .get_usage(req)
        .await
        .with_context(|| format!("controlplane {}", settings.controlplane_url))?
        .into_inner();
    let names: Vec<&str> = dims.iter().map(|d| dim_name(*d)).collect();
    let total = report.total.clone().unwrap_or_default();
    if args.json {
        let row_json = |r: &pb::UsageRow| {
            let mut m = serde_json::Map::new();
            for (name, k) in names.iter().zip(&r.key) {
                m.insert((*name).to_owned(), json!(k.value));
            }
            m.insert("requests".into(), json!(r.requests));
            m.insert("input_tokens".into(), json!(r.input_tokens));
            m.insert("output_tokens".into(), json!(r.output_tokens));
            m.insert("cached_input_tokens".into(), json!(r.cached_input_tokens));
            m.insert("reasoning_tokens".into(), json!(r.reasoning_tokens));
            m.insert("cost_micros".into(), json!(r.cost_micros));
            m.insert("unpriced_requests".into(), json!(r.unpriced_requests));
            m.insert("unmetered_requests".into(), json!(r.unmetered_requests));
            m.insert("errors".into(), json!(r.errors));
            serde_json::Value::Object(m)
        };
        writeln!(
            out,
            "{}",
            json!({
                "group_by": names,
                "rows": report.rows.iter().map(row_json).collect::<Vec<_>>(),
                "truncated": report.truncated,
                "total": row_json(&total),
                "unpriced_models": report.unpriced_models.iter().map(|m| json!({
                    "provider": m.provider, "model": m.model, "requests": m.requests,
                })).collect::<Vec<_>>(),
            })
        )?;
        return Ok(());
    }

    let mut header: Vec<String> = names.iter().map(|n| n.to_uppercase()).collect();
    header.extend(
        [
            "REQUESTS",
            "INPUT",
            "OUTPUT",
            "CACHED",
            "COST",
            "UNPRICED",
            "UNMETERED",
            "ERRORS",
        ]
        .map(str::to_owned),
    );
    let cells = |r: &pb::UsageRow, key: Vec<String>| {
        let mut row = key;
        row.extend([
            r.requests.to_string(),
            r.input_tokens.to_string(),
            r.output_tokens.to_string(),
            r.cached_input_tokens.to_string(),
            format_usd(r.cost_micros),
            r.unpriced_requests.to_string(),
            r.unmetered_requests.to_string(),
            r.errors.to_string(),
        ]);
        row
    };
    let mut rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .map(|r| {
            let key = r
                .key
                .iter()
                .map(|k| k.value.clone().unwrap_or_else(|| "-".to_owned()))
                .collect();
            cells(r, key)
        })
        .collect();
    let mut total_key = vec![String::new(); names.len()];
    if let Some(first) = total_key.first_mut() {
        *first = "TOTAL".to_owned();
    }
    rows.push(cells(&total, total_key));
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    write_table(out, &header, &rows)?;
    if report.truncated {
        writeln!(
            out,
            "(more rows than --limit {}; totals cover all)",
            args.limit
        )?;
    }
    if !report.unpriced_models.is_empty() {
        writeln!(
            out,
            "models without a price (their cost is unknown, not zero):"
        )?;
        for m in &report.unpriced_models {
            writeln!(out, "  {}/{}: {} requests", m.provider, m.model, m.requests)?;
        }
    }
    Ok(())
}

fn dim_name(d: pb::UsageDimension) -> &'static str {
    match d {
        pb::UsageDimension::Agent => "agent",
        pb::UsageDimension::Session => "session",
        pb::UsageDimension::User => "user",
        pb::UsageDimension::Env => "env",
        pb::UsageDimension::Provider => "provider",
        pb::UsageDimension::Model => "model",
        pb::UsageDimension::Day => "day",
        pb::UsageDimension::Key => "key",
        pb::UsageDimension::Week => "week",
        pb::UsageDimension::Unspecified => "?",
    }
}
