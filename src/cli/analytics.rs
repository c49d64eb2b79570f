//! `nm-gateway agents recommend|recompute|outcomes`: an agent's analytics from the
//! controlplane (`nm.v1.Analytics`), readable or as JSON (`--json`, the shape of
//! [`nm_controlplane::analytics::AgentAnalytics`]).

use std::io::Write;

use anyhow::Context;
use nm_controlplane::analytics::report::{AgentAnalytics, EvidenceItem, Progress, Status};
use nm_types::money::format_usd;
use serde_json::json;

use super::{FilterArgs, UsageError, admin_channel, write_table};
use crate::config::Settings;
use crate::grpc::analytics::{analytics_from_pb, row_from_pb};
use crate::grpc::pb::{self, analytics_client::AnalyticsClient};

/// `nm-gateway agents recommend <agent>`.
#[derive(Debug, Clone, clap::Args)]
pub struct RecommendArgs {
    /// The agent name (`NM-Agent`).
    pub agent: String,
    /// Compute now instead of reading the latest stored result.
    #[arg(long)]
    pub refresh: bool,
    #[arg(long)]
    pub json: bool,
}

/// `nm-gateway agents recompute [<agent>]`.
#[derive(Debug, Clone, clap::Args)]
pub struct RecomputeArgs {
    /// The agent; omit to recompute every agent with signals.
    pub agent: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// `nm-gateway agents outcomes <agent> --by model,env,week`.
#[derive(Debug, Clone, clap::Args)]
pub struct OutcomesArgs {
    pub agent: String,
    /// Group by these, comma-separated: model, provider, env, week, user.
    #[arg(long, value_delimiter = ',')]
    pub by: Vec<String>,
    /// Only --since and --until apply (default: the last 30 days).
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Most rows, most sessions first.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    #[arg(long)]
    pub json: bool,
}

fn client(settings: &Settings) -> anyhow::Result<AnalyticsClient<super::AdminChannel>> {
    Ok(AnalyticsClient::new(admin_channel(settings)?))
}

/// The agent's analytics as `agents recommend` gets them (the stored answer, or computed now
/// while collecting or with `refresh`).
pub(crate) async fn answer(
    settings: &Settings,
    agent: String,
    refresh: bool,
) -> anyhow::Result<AgentAnalytics> {
    let answer = client(settings)?
        .get_recommendations(pb::GetRecommendationsRequest { agent, refresh })
        .await
        .with_context(|| format!("controlplane {}", settings.controlplane_url))?
        .into_inner();
    Ok(analytics_from_pb(&answer))
}

pub async fn recommend(
    settings: &Settings,
    args: RecommendArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let a = answer(settings, args.agent, args.refresh).await?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&a)?)?;
    } else {
        print_analytics(out, &a)?;
    }
    Ok(())
}

pub async fn recompute(
    settings: &Settings,
    args: RecomputeArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let results = client(settings)?
        .recompute(pb::RecomputeRequest {
            agent: args.agent.unwrap_or_default(),
        })
        .await
        .with_context(|| format!("controlplane {}", settings.controlplane_url))?
        .into_inner()
        .results;
    let all: Vec<AgentAnalytics> = results.iter().map(analytics_from_pb).collect();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&all)?)?;
        return Ok(());
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|a| {
            vec![
                a.agent.clone(),
                a.status.as_str().to_owned(),
                a.progress.signals.to_string(),
                a.recommendations.len().to_string(),
                time_ms(Some(a.computed_at_ms)),
            ]
        })
        .collect();
    write_table(
        out,
        &["AGENT", "STATUS", "SIGNALS", "RECOMMENDATIONS", "COMPUTED"],
        &rows,
    )?;
    Ok(())
}

fn dimension(name: &str) -> Result<pb::OutcomeDimension, UsageError> {
    Ok(match name.trim() {
        "model" => pb::OutcomeDimension::Model,
        "provider" => pb::OutcomeDimension::Provider,
        "env" => pb::OutcomeDimension::Env,
        "week" => pb::OutcomeDimension::Week,
        "user" => pb::OutcomeDimension::User,
        other => {
            return Err(UsageError(format!(
                "--by {other:?}: use model, provider, env, week or user"
            )));
        }
    })
}

pub async fn outcomes(
    settings: &Settings,
    args: OutcomesArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let names: Vec<String> = args
        .by
        .iter()
        .map(|b| b.trim().to_owned())
        .filter(|b| !b.is_empty())
        .collect();
    let dims = names
        .iter()
        .map(|b| dimension(b))
        .collect::<Result<Vec<_>, _>>()?;
    let rates = client(settings)?
        .get_outcome_rates(pb::GetOutcomeRatesRequest {
            agent: args.agent,
            group_by: dims.iter().map(|d| *d as i32).collect(),
            range: Some(args.filter.range()?),
            limit: args.limit,
        })
        .await
        .with_context(|| format!("controlplane {}", settings.controlplane_url))?
        .into_inner();
    let rows: Vec<_> = rates.rows.iter().map(row_from_pb).collect();
    if args.json {
        let json_rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let mut m = serde_json::Map::new();
                for (name, k) in names.iter().zip(&r.key) {
                    m.insert(name.clone(), json!(k));
                }
                m.insert("sessions".into(), json!(r.sessions));
                m.insert("signals".into(), json!(r.signals));
                m.insert("successes".into(), json!(r.successes));
                m.insert("success_rate".into(), json!(r.success_rate()));
                m.insert("abandoned".into(), json!(r.abandoned));
                m.insert("abandonment_rate".into(), json!(r.abandonment_rate()));
                m.insert("regenerated".into(), json!(r.regenerated));
                m.insert("regeneration_rate".into(), json!(r.regeneration_rate()));
                m.insert("heavily_edited".into(), json!(r.heavily_edited));
                m.insert("heavy_edit_rate".into(), json!(r.heavy_edit_rate()));
                m.insert("regenerations".into(), json!(r.regenerations));
                m.insert("cost_micros".into(), json!(r.cost_micros));
                m.insert(
                    "cost_per_success_micros".into(),
                    json!(r.cost_per_success_micros()),
                );
                m.insert(
                    "regenerations_per_success".into(),
                    json!(r.regenerations_per_success()),
                );
                serde_json::Value::Object(m)
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({"agent": rates.agent, "group_by": names, "rows": json_rows})
        )?;
        return Ok(());
    }
    let mut header: Vec<String> = names.iter().map(|n| n.to_uppercase()).collect();
    header.extend(
        [
            "SESSIONS",
            "SUCCESS",
            "ABANDONED",
            "REGENERATED",
            "HEAVY EDIT",
            "COST",
            "COST/SUCCESS",
            "REGEN/SUCCESS",
        ]
        .map(str::to_owned),
    );
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut row: Vec<String> = r
                .key
                .iter()
                .map(|k| k.clone().unwrap_or_else(|| "-".to_owned()))
                .collect();
            row.extend([
                r.sessions.to_string(),
                pct(r.success_rate()),
                pct(r.abandonment_rate()),
                pct(r.regeneration_rate()),
                pct(r.heavy_edit_rate()),
                format_usd(r.cost_micros),
                r.cost_per_success_micros()
                    .map_or_else(|| "-".to_owned(), format_usd),
                r.regenerations_per_success()
                    .map_or_else(|| "-".to_owned(), |x| format!("{x:.2}")),
            ]);
            row
        })
        .collect();
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    write_table(out, &header, &table)?;
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn time_ms(ms: Option<i64>) -> String {
    ms.and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(
            || "-".to_owned(),
            |d| d.format("%Y-%m-%d %H:%M:%SZ").to_string(),
        )
}

fn date_ms(ms: Option<i64>) -> String {
    ms.and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(|| "-".to_owned(), |d| d.format("%Y-%m-%d").to_string())
}

fn evidence_line(e: &EvidenceItem) -> String {
    let arm = |a: &nm_controlplane::analytics::report::Arm| {
        let mut s = format!(
            "{} {}/{} = {} [{}, {}]",
            a.label,
            a.count,
            a.n,
            pct(a.rate),
            pct(a.interval.lower),
            pct(a.interval.upper)
        );
        if let Some(t) = &a.example_trace_id {
            s.push_str(&format!(" (e.g. trace {t})"));
        }
        s
    };
    let mut s = format!("{}: {}", e.metric, arm(&e.a));
    if let Some(b) = &e.b {
        s.push_str(&format!(" vs {}", arm(b)));
    }
    if let (Some(d), Some(i)) = (e.difference, e.difference_interval) {
        if i.upper >= 1.0 {
            // A one-sided bound (a claim with its direction fixed in advance).
            s.push_str(&format!(
                "; difference {:+.1} pts, at least {:+.1}",
                d * 100.0,
                i.lower * 100.0
            ));
        } else {
            s.push_str(&format!(
                "; difference {:+.1} pts [{:+.1}, {:+.1}]",
                d * 100.0,
                i.lower * 100.0,
                i.upper * 100.0
            ));
        }
    }
    if let Some(level) = e.level {
        s.push_str(&format!("; level {}", pct(level)));
    }
    // Every interval is a confidence sequence: valid at every recomputation at once.
    let m = e.comparisons.max(1);
    let family = 1.0 - (1.0 - e.confidence) * f64::from(m);
    if m == 1 {
        s.push_str(&format!("; anytime-valid {:.0}%", e.confidence * 100.0));
    } else {
        s.push_str(&format!(
            "; anytime-valid {:.0}% over {m} comparisons ({:.2}% each)",
            family * 100.0,
            e.confidence * 100.0
        ));
    }
    match e.p_value {
        Some(p) if p <= 1e-12 => s.push_str(", always-valid p < 1e-12"),
        Some(p) => s.push_str(&format!(", always-valid p = {p:.2e}")),
        None => {}
    }
    if let Some(p) = e.prob_b_greater {
        s.push_str(&format!(", P(b > a) = {p:.3}"));
    }
    s
}

/// The progress of a collecting agent: the count, the recent rate and the expected date.
/// `agents recommend` and `agents show` print the same lines.
pub(crate) fn print_progress(out: &mut impl Write, p: &Progress) -> std::io::Result<()> {
    writeln!(
        out,
        "status: collecting, {}/{} signals ({} to go)",
        p.signals, p.threshold, p.remaining
    )?;
    writeln!(out, "recent rate: {:.1} signals/day", p.daily_rate)?;
    match p.eta_ms {
        Some(eta) => writeln!(out, "recommendations expected: {}", date_ms(Some(eta))),
        None => writeln!(
            out,
            "recommendations expected: unknown (no signals in the last 7 days)"
        ),
    }
}

/// The readable answer.
pub fn print_analytics(out: &mut impl Write, a: &AgentAnalytics) -> std::io::Result<()> {
    let p = &a.progress;
    writeln!(out, "agent: {}", a.agent)?;
    writeln!(out, "computed: {}", time_ms(Some(a.computed_at_ms)))?;
    match a.status {
        Status::Collecting => return print_progress(out, p),
        Status::Ready => writeln!(
            out,
            "status: ready, {} signals ({:.1}/day recently)",
            p.signals, p.daily_rate
        )?,
    }
    writeln!(
        out,
        "window: {} to {}",
        time_ms(Some(a.window.since_ms)),
        time_ms(Some(a.window.until_ms))
    )?;
    writeln!(
        out,
        "signals counted: {}{}",
        a.evidence.label(),
        if a.evidence.continued {
            " (continued counts as a success)"
        } else {
            ""
        }
    )?;
    if let Some(s) = &a.summary {
        writeln!(
            out,
            "sessions: {} (success {}, abandoned {}, regenerated {}, heavy edit {})",
            s.sessions,
            pct(s.success_rate()),
            pct(s.abandonment_rate()),
            pct(s.regeneration_rate()),
            pct(s.heavy_edit_rate())
        )?;
    }
    if let Some(s) = a.implicit_summary.as_ref().filter(|s| s.sessions > 0) {
        writeln!(
            out,
            "with implicit signals (not counted): {} sessions (success {}, abandoned {}, \
             regenerated {}, heavy edit {})",
            s.sessions,
            pct(s.success_rate()),
            pct(s.abandonment_rate()),
            pct(s.regeneration_rate()),
            pct(s.heavy_edit_rate())
        )?;
    }
    writeln!(out)?;
    writeln!(out, "outcome-weighted cost:")?;
    let rows: Vec<Vec<String>> = a
        .costs
        .iter()
        .map(|c| {
            vec![
                c.scope.as_str().to_owned(),
                c.name.clone(),
                c.sessions.to_string(),
                pct(c.success_rate),
                format_usd(c.cost_micros),
                c.cost_per_success_micros
                    .map_or_else(|| "-".to_owned(), format_usd),
                c.regenerations_per_success
                    .map_or_else(|| "-".to_owned(), |x| format!("{x:.2}")),
            ]
        })
        .collect();
    write_table(
        out,
        &[
            "SCOPE",
            "NAME",
            "SESSIONS",
            "SUCCESS",
            "COST",
            "COST/SUCCESS",
            "REGEN/SUCCESS",
        ],
        &rows,
    )?;
    writeln!(out)?;
    if a.recommendations.is_empty() {
        writeln!(
            out,
            "recommendations: none (the evidence supports none in this window)"
        )?;
        return Ok(());
    }
    writeln!(out, "recommendations ({}):", a.recommendations.len())?;
    for (i, r) in a.recommendations.iter().enumerate() {
        writeln!(out, "{}. [{}] {}", i + 1, r.kind.as_str(), r.message)?;
        for e in &r.evidence {
            writeln!(
                out,
                "   evidence ({}): {}",
                a.evidence.label(),
                evidence_line(e)
            )?;
        }
        if !r.figures.is_empty() {
            let figs: Vec<String> = r
                .figures
                .iter()
                .map(|f| format!("{} = {:.4}", f.name, f.value))
                .collect();
            writeln!(out, "   figures: {}", figs.join(", "))?;
        }
        writeln!(out, "   expected effect: {}", r.effect.summary)?;
    }
    Ok(())
}
