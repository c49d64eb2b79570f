//! `nm-gateway experiments create|list|show|pause|resume|stop|promote|rollback|history`:
//! randomised experiments on the controlplane. Changes need an admin key; a viewer key may
//! list, show and read the history.

use std::io::Write;

use anyhow::Context;
use nm_types::money::format_usd;
use serde_json::json;

use super::{UsageError, admin_channel, time, write_table};
use crate::config::Settings;
use crate::grpc::pb::{self, experiments_client::ExperimentsClient};

/// `nm-gateway experiments <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ExperimentsCommand {
    /// Start an experiment: an agent's sessions split between arms by weight.
    Create {
        /// The agent (`NM-Agent`) whose sessions are split.
        #[arg(long)]
        agent: String,
        /// Only this env: production, staging or development (default: every env).
        #[arg(long)]
        env: Option<String>,
        /// An arm, NAME=PROVIDER:MODEL:WEIGHT (2 to 16; the first is the provider clients
        /// call), e.g. --arm control=openai:gpt-4o-mini:50 --arm
        /// candidate=groq:llama-3.3-70b-versatile:50.
        #[arg(
            long = "arm",
            value_name = "NAME=PROVIDER:MODEL:WEIGHT",
            required = true
        )]
        arms: Vec<String>,
        /// The primary metric's unit: session (default) or request.
        #[arg(long)]
        unit: Option<String>,
        /// A guardrail (repeat for more): abandonment, error_rate, cost_per_session,
        /// p95_latency.
        #[arg(long = "guardrail", value_name = "NAME")]
        guardrails: Vec<String>,
        /// End inconclusive at this many sessions without a decision.
        #[arg(long, value_name = "N")]
        max_sessions: Option<u64>,
        /// End inconclusive after this many days without a decision.
        #[arg(long, value_name = "DAYS")]
        max_days: Option<u32>,
        /// Promote the winner as soon as the evidence decides.
        #[arg(long)]
        auto_promote: bool,
        /// Roll back an arm a guardrail stops.
        #[arg(long)]
        auto_rollback: bool,
        /// Free text (at most 1000 characters).
        #[arg(long)]
        description: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Experiments, newest first.
    List {
        /// Only this agent's.
        #[arg(long)]
        agent: Option<String>,
        /// Only in this state: running, paused, decided, harm, inconclusive, stopped.
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// One experiment with its arms and what each has served.
    Show {
        /// The experiment's id (`exp_...`).
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// running -> paused: its requests pass unchanged until resumed.
    Pause(ActionArgs),
    /// paused -> running.
    Resume(ActionArgs),
    /// Stop for good: its requests pass unchanged.
    Stop(ActionArgs),
    /// Send every session to one arm (default: the decided winner); the experiment ends.
    Promote {
        #[command(flatten)]
        action: ActionArgs,
        /// The arm to promote (default: the winner the evidence decided).
        #[arg(long)]
        arm: Option<String>,
    },
    /// Take one arm out: its sessions go to the other arms.
    Rollback {
        #[command(flatten)]
        action: ActionArgs,
        /// The arm to take out.
        #[arg(long)]
        arm: String,
    },
    /// The experiment's history: every state change and action, oldest first.
    History {
        /// The experiment's id (`exp_...`).
        id: String,
        #[arg(long)]
        json: bool,
    },
}

/// What every action takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ActionArgs {
    /// The experiment's id (`exp_...`).
    id: String,
    /// Why, for the history.
    #[arg(long)]
    reason: Option<String>,
    #[arg(long)]
    json: bool,
}

/// `NAME=PROVIDER:MODEL:WEIGHT`; the model may hold colons (`ft:gpt-4o:org::id`).
pub fn parse_arm(spec: &str) -> Result<pb::ExperimentArmSpec, UsageError> {
    let bad = || {
        UsageError(format!(
            "--arm {spec:?}: use NAME=PROVIDER:MODEL:WEIGHT, e.g. control=openai:gpt-4o-mini:50"
        ))
    };
    let (name, rest) = spec.split_once('=').ok_or_else(bad)?;
    let (provider, rest) = rest.split_once(':').ok_or_else(bad)?;
    let (model, weight) = rest.rsplit_once(':').ok_or_else(bad)?;
    let weight: u32 = weight.trim().parse().map_err(|_| {
        UsageError(format!(
            "--arm {spec:?}: the weight {weight:?} is not a whole number from 1 to 1000000"
        ))
    })?;
    if name.trim().is_empty() || provider.trim().is_empty() || model.trim().is_empty() {
        return Err(bad());
    }
    Ok(pb::ExperimentArmSpec {
        name: name.trim().to_owned(),
        provider: provider.trim().to_owned(),
        model: model.trim().to_owned(),
        weight,
    })
}

pub async fn experiments(
    settings: &Settings,
    cmd: ExperimentsCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = ExperimentsClient::new(admin_channel(settings)?);
    let cp = &settings.controlplane_url;
    let ctx = || format!("controlplane {cp}");
    match cmd {
        ExperimentsCommand::Create {
            agent,
            env,
            arms,
            unit,
            guardrails,
            max_sessions,
            max_days,
            auto_promote,
            auto_rollback,
            description,
            json,
        } => {
            let arms = arms
                .iter()
                .map(|a| parse_arm(a))
                .collect::<Result<Vec<_>, _>>()?;
            let e = client
                .create_experiment(pb::CreateExperimentRequest {
                    agent,
                    env,
                    arms,
                    unit: unit.unwrap_or_default(),
                    guardrails,
                    max_sessions: max_sessions.unwrap_or(0),
                    max_days: max_days.unwrap_or(0),
                    auto_promote,
                    auto_rollback,
                    description: description.unwrap_or_default(),
                })
                .await
                .with_context(ctx)?
                .into_inner();
            print_changed(out, "created", &e, json)?;
        }
        ExperimentsCommand::List { agent, state, json } => {
            let list = client
                .list_experiments(pb::ListExperimentsRequest {
                    agent: agent.unwrap_or_default(),
                    state: state.unwrap_or_default(),
                })
                .await
                .with_context(ctx)?
                .into_inner()
                .experiments;
            if json {
                let rows: Vec<_> = list.iter().map(experiment_json).collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|e| {
                        vec![
                            e.id.clone(),
                            e.agent.clone(),
                            e.env.clone().unwrap_or_else(|| "*".to_owned()),
                            state_label(e),
                            e.arms
                                .iter()
                                .map(|a| a.name.as_str())
                                .collect::<Vec<_>>()
                                .join(","),
                            time(e.created_at.as_ref()),
                        ]
                    })
                    .collect();
                write_table(
                    out,
                    &["ID", "AGENT", "ENV", "STATE", "ARMS", "CREATED"],
                    &rows,
                )?;
            }
        }
        ExperimentsCommand::Show { id, json } => {
            let r = client
                .get_experiment(pb::GetExperimentRequest { id })
                .await
                .with_context(ctx)?
                .into_inner();
            if json {
                writeln!(out, "{}", report_json(&r))?;
            } else {
                print_report(out, &r)?;
            }
        }
        ExperimentsCommand::Pause(a) => {
            let e = client
                .pause_experiment(action(&a))
                .await
                .with_context(ctx)?
                .into_inner();
            print_changed(out, "paused", &e, a.json)?;
        }
        ExperimentsCommand::Resume(a) => {
            let e = client
                .resume_experiment(action(&a))
                .await
                .with_context(ctx)?
                .into_inner();
            print_changed(out, "resumed", &e, a.json)?;
        }
        ExperimentsCommand::Stop(a) => {
            let e = client
                .stop_experiment(action(&a))
                .await
                .with_context(ctx)?
                .into_inner();
            print_changed(out, "stopped", &e, a.json)?;
        }
        ExperimentsCommand::Promote { action: a, arm } => {
            let e = client
                .promote_experiment(pb::PromoteExperimentRequest {
                    id: a.id.clone(),
                    arm: arm.unwrap_or_default(),
                    reason: a.reason.clone().unwrap_or_default(),
                })
                .await
                .with_context(ctx)?
                .into_inner();
            print_changed(out, "promoted", &e, a.json)?;
        }
        ExperimentsCommand::Rollback { action: a, arm } => {
            let e = client
                .rollback_arm(pb::RollbackArmRequest {
                    id: a.id.clone(),
                    arm,
                    reason: a.reason.clone().unwrap_or_default(),
                })
                .await
                .with_context(ctx)?
                .into_inner();
            print_changed(out, "arm rolled back", &e, a.json)?;
        }
        ExperimentsCommand::History { id, json } => {
            let events = client
                .list_experiment_events(pb::ListExperimentEventsRequest { id })
                .await
                .with_context(ctx)?
                .into_inner()
                .events;
            if json {
                let rows: Vec<_> = events
                    .iter()
                    .map(|e| {
                        json!({
                            "at": time(e.at.as_ref()),
                            "kind": e.kind,
                            "arm": e.arm,
                            "actor": e.actor,
                            "detail": e.detail,
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
                            e.kind.clone(),
                            e.arm.clone().unwrap_or_else(|| "-".to_owned()),
                            e.actor.clone(),
                            e.detail.clone(),
                        ]
                    })
                    .collect();
                write_table(out, &["TIME", "EVENT", "ARM", "BY", "DETAIL"], &rows)?;
            }
        }
    }
    Ok(())
}

fn action(a: &ActionArgs) -> pb::ExperimentActionRequest {
    pb::ExperimentActionRequest {
        id: a.id.clone(),
        reason: a.reason.clone().unwrap_or_default(),
    }
}

/// `decided (promoted: b)`, `running`, ...
fn state_label(e: &pb::Experiment) -> String {
    match (&e.winner, e.promoted) {
        (Some(w), true) => format!("{} (promoted: {w})", e.state),
        (Some(w), false) => format!("{} (winner: {w})", e.state),
        (None, _) => e.state.clone(),
    }
}

fn print_changed(
    out: &mut impl Write,
    what: &str,
    e: &pb::Experiment,
    json: bool,
) -> std::io::Result<()> {
    if json {
        return writeln!(out, "{}", experiment_json(e));
    }
    writeln!(out, "experiment {} {what}: {}", e.id, state_label(e))?;
    print_arms(out, e)
}

fn print_arms(out: &mut impl Write, e: &pb::Experiment) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = e
        .arms
        .iter()
        .map(|a| {
            vec![
                a.name.clone(),
                a.provider.clone(),
                a.model.clone(),
                a.weight.to_string(),
                if a.rolled_back {
                    "rolled back"
                } else {
                    "active"
                }
                .to_owned(),
            ]
        })
        .collect();
    write_table(
        out,
        &["ARM", "PROVIDER", "MODEL", "WEIGHT", "STATUS"],
        &rows,
    )
}

fn print_report(out: &mut impl Write, r: &pb::ExperimentReport) -> std::io::Result<()> {
    let Some(e) = &r.experiment else {
        return Ok(());
    };
    writeln!(out, "experiment: {}", e.id)?;
    writeln!(
        out,
        "agent: {} (env: {})",
        e.agent,
        e.env.as_deref().unwrap_or("every")
    )?;
    writeln!(out, "state: {}", state_label(e))?;
    writeln!(out, "reason: {}", e.reason)?;
    writeln!(out, "unit: {}", e.unit)?;
    if !e.guardrails.is_empty() {
        writeln!(out, "guardrails: {}", e.guardrails.join(", "))?;
    }
    let limit = |n: u64, what: &str| {
        if n == 0 {
            "none".to_owned()
        } else {
            format!("{n} {what}")
        }
    };
    writeln!(
        out,
        "limits: {}, {}",
        limit(e.max_sessions, "sessions"),
        limit(u64::from(e.max_days), "days")
    )?;
    writeln!(
        out,
        "acts by itself: promote {}, roll back {}",
        if e.auto_promote { "yes" } else { "no" },
        if e.auto_rollback { "yes" } else { "no" }
    )?;
    if !e.description.is_empty() {
        writeln!(out, "description: {}", e.description)?;
    }
    writeln!(out, "created: {}", time(e.created_at.as_ref()))?;
    let rows: Vec<Vec<String>> = r
        .arms
        .iter()
        .map(|a| {
            let arm = a.arm.clone().unwrap_or_default();
            let rate = if a.judged > 0 {
                match &a.success_interval {
                    Some(i) => format!(
                        "{:.1}% [{:.1}, {:.1}]",
                        a.success_rate * 100.0,
                        i.lower * 100.0,
                        i.upper * 100.0
                    ),
                    None => format!("{:.1}%", a.success_rate * 100.0),
                }
            } else {
                "-".to_owned()
            };
            vec![
                arm.name,
                format!("{}:{}", arm.provider, arm.model),
                arm.weight.to_string(),
                if arm.rolled_back {
                    "rolled back"
                } else {
                    "active"
                }
                .to_owned(),
                a.sessions.to_string(),
                a.requests.to_string(),
                format_usd(a.cost_micros),
                a.judged.to_string(),
                rate,
            ]
        })
        .collect();
    write_table(
        out,
        &[
            "ARM", "MODEL", "WEIGHT", "STATUS", "SESSIONS", "REQUESTS", "COST", "JUDGED", "SUCCESS",
        ],
        &rows,
    )?;
    if !r.summary.is_empty() {
        writeln!(out, "evidence: {}", r.summary)?;
    }
    if let Some(n) = r.units_to_decision {
        writeln!(out, "about {n} more {}s to a decision", e.unit)?;
    }
    Ok(())
}

fn experiment_json(e: &pb::Experiment) -> serde_json::Value {
    json!({
        "id": e.id,
        "agent": e.agent,
        "env": e.env,
        "state": e.state,
        "winner": e.winner,
        "promoted": e.promoted,
        "reason": e.reason,
        "unit": e.unit,
        "guardrails": e.guardrails,
        "max_sessions": (e.max_sessions > 0).then_some(e.max_sessions),
        "max_days": (e.max_days > 0).then_some(e.max_days),
        "auto_promote": e.auto_promote,
        "auto_rollback": e.auto_rollback,
        "description": e.description,
        "created_at": time(e.created_at.as_ref()),
        "updated_at": time(e.updated_at.as_ref()),
        "arms": e.arms.iter().map(|a| json!({
            "name": a.name,
            "provider": a.provider,
            "model": a.model,
            "weight": a.weight,
            "rolled_back": a.rolled_back,
        })).collect::<Vec<_>>(),
    })
}

fn report_json(r: &pb::ExperimentReport) -> serde_json::Value {
    json!({
        "experiment": r.experiment.as_ref().map(experiment_json),
        "arms": r.arms.iter().map(|a| json!({
            "arm": a.arm.as_ref().map(|arm| arm.name.clone()),
            "sessions": a.sessions,
            "requests": a.requests,
            "signals": a.signals,
            "judged": a.judged,
            "successes": a.successes,
            "success_rate": (a.judged > 0).then_some(a.success_rate),
            "success_interval": a.success_interval.as_ref().map(|i| json!([i.lower, i.upper])),
            "cost_micros": a.cost_micros,
            "cost_per_success_micros": a.cost_per_success_micros,
            "guardrails": a.guardrails.iter().map(|g| json!({
                "name": g.name,
                "value": g.value,
                "status": g.status,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "summary": (!r.summary.is_empty()).then_some(&r.summary),
        "units_to_decision": r.units_to_decision,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_parse_with_colons_in_the_model() {
        let a = parse_arm("control=openai:gpt-4o-mini:50").unwrap();
        assert_eq!(
            (
                a.name.as_str(),
                a.provider.as_str(),
                a.model.as_str(),
                a.weight
            ),
            ("control", "openai", "gpt-4o-mini", 50)
        );
        let ft = parse_arm("ft=openai:ft:gpt-4o:org::abc:3").unwrap();
        assert_eq!((ft.model.as_str(), ft.weight), ("ft:gpt-4o:org::abc", 3));
        for bad in [
            "control",
            "control=openai",
            "control=openai:gpt-4o",
            "control=openai:gpt-4o:x",
            "=openai:gpt-4o:1",
            "a=:gpt-4o:1",
            "a=openai::1",
            "a=openai:gpt-4o:-1",
        ] {
            assert!(parse_arm(bad).is_err(), "{bad}");
        }
    }
}
