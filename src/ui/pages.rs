//! The pages, each a few admin gRPC calls ([`super::Services`], with the signed-in key) turned
//! into HTML: `/agents`, `/agents/<agent>`, `/experiments`, `/usage`. No page reads the
//! database itself; every figure is a field of a gRPC answer, or a sum of the rows of one grouped
//! finer (the weekly rates per model, provider and env from one answer by all three and week;
//! /usage's charts and tables from one answer by day, model, provider, agent and key), and the
//! confidence bands of the weekly success rates are the controlplane's own
//! `confidence_sequence` over the weekly counts the gRPC answer gives.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use http::StatusCode;
use nm_controlplane::analytics::stats::confidence_sequence;
use tonic::{Code, Status};

use super::Ui;
use super::chart::{self, Series};
use super::html::{Nav, count, date, escape, path_segment, pct, time, usd};
use crate::grpc::pb;
use crate::grpc::pb::agents_server::Agents as _;
use crate::grpc::pb::analytics_server::Analytics as _;
use crate::grpc::pb::budgets_server::Budgets as _;
use crate::grpc::pb::experiments_server::Experiments as _;
use crate::grpc::pb::usage_server::Usage as _;

/// Most agents, experiments and budget rows one page lists.
const MAX_ROWS: usize = 200;
/// Longest agent name accepted in a URL (nm-types' own cap).
const MAX_AGENT_LEN: usize = nm_types::MAX_AGENT_LEN;
/// The weeks the success-rate charts cover, and the days of the usage charts.
const WEEKS: i64 = 12;
const USAGE_DAYS: i64 = 30;

/// Why a page is not shown.
#[derive(Debug)]
pub enum PageError {
    /// The key behind the session no longer signs in (revoked, expired).
    SignedOut,
    /// A status page with this text (no internal detail).
    Status(StatusCode, String),
}

impl From<Status> for PageError {
    fn from(s: Status) -> Self {
        match s.code() {
            Code::Unauthenticated => PageError::SignedOut,
            Code::PermissionDenied => PageError::Status(
                StatusCode::FORBIDDEN,
                "This key may not read this page.".into(),
            ),
            Code::NotFound => PageError::Status(StatusCode::NOT_FOUND, s.message().to_owned()),
            Code::InvalidArgument => {
                PageError::Status(StatusCode::BAD_REQUEST, s.message().to_owned())
            }
            _ => {
                tracing::warn!(code = ?s.code(), message = s.message(), "web page: an admin call failed");
                PageError::Status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "The data could not be read just now; try again shortly.".into(),
                )
            }
        }
    }
}

type Page = Result<(String, Nav, String), PageError>;

/// The page at `path` (already known to be one of the four).
pub async fn render(ui: &Ui, secret: &str, path: &str, query: &str) -> Page {
    let call = Call { ui, secret };
    match path {
        "/agents" => agents(&call, query).await,
        "/experiments" => experiments(&call).await,
        "/usage" => usage(&call).await,
        p => {
            let raw = p.strip_prefix("/agents/").unwrap_or_default();
            let name = agent_name(raw).ok_or_else(|| {
                PageError::Status(
                    StatusCode::BAD_REQUEST,
                    format!("An agent name is 1 to {MAX_AGENT_LEN} printable characters."),
                )
            })?;
            agent(&call, &name).await
        }
    }
}

/// A path segment as an agent name: percent-decoded, valid UTF-8, printable, bounded.
pub fn agent_name(raw: &str) -> Option<String> {
    if raw.is_empty() || raw.len() > MAX_AGENT_LEN * 3 {
        return None;
    }
    let name = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .ok()?
        .into_owned();
    let ok = !name.trim().is_empty()
        && name.len() <= MAX_AGENT_LEN
        && !name.chars().any(char::is_control);
    ok.then_some(name)
}

struct Call<'a> {
    ui: &'a Ui,
    secret: &'a str,
}

impl Call<'_> {
    fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Ok(v) = self.secret.parse() {
            req.metadata_mut().insert(crate::grpc::NM_KEY_METADATA, v);
        }
        req
    }
}

fn days_ago(days: i64) -> prost_types::Timestamp {
    let now = chrono::Utc::now().timestamp();
    prost_types::Timestamp {
        seconds: now - days * 86_400,
        nanos: 0,
    }
}

fn since(days: i64) -> Option<pb::TimeRange> {
    Some(pb::TimeRange {
        since: Some(days_ago(days)),
        until: None,
    })
}

fn agent_href(name: &str) -> String {
    format!("/agents/{}", path_segment(name))
}

fn key_value(k: &[pb::UsageKey], i: usize) -> String {
    k.get(i)
        .and_then(|k| k.value.clone())
        .unwrap_or_else(|| "(none)".to_owned())
}

// === Agents ===

/// One agent's line on the agents page.
struct AgentLine {
    summary: pb::AgentSummary,
    analytics: pb::AgentAnalytics,
    signals: pb::AgentSignals,
}

async fn agents(c: &Call<'_>, query: &str) -> Page {
    let s = &c.ui.services;
    let list = s
        .agents
        .list_agents(c.req(pb::ListAgentsRequest::default()))
        .await?
        .into_inner();
    let unattributed = list.agents.iter().find(|a| a.unattributed).cloned();
    let mut lines = Vec::new();
    for a in list
        .agents
        .into_iter()
        .filter(|a| !a.unattributed)
        .take(MAX_ROWS)
    {
        let (analytics, signals) = tokio::join!(
            s.analytics
                .get_recommendations(c.req(pb::GetRecommendationsRequest {
                    agent: a.agent.clone(),
                    refresh: false,
                })),
            s.agents
                .get_agent_signals(c.req(pb::GetAgentSignalsRequest {
                    agent: a.agent.clone(),
                    ..Default::default()
                })),
        );
        let (analytics, signals) = (analytics?.into_inner(), signals?.into_inner());
        lines.push(AgentLine {
            summary: a,
            analytics,
            signals,
        });
    }
    let sort = query
        .split('&')
        .find_map(|p| p.strip_prefix("sort="))
        .unwrap_or("name");
    let success = |l: &AgentLine| l.analytics.summary.as_ref().map(|s| s.success_rate);
    let cps = |l: &AgentLine| {
        l.analytics
            .summary
            .as_ref()
            .and_then(|s| s.cost_per_success_micros)
    };
    match sort {
        "sessions" => lines.sort_by_key(|l| std::cmp::Reverse(l.summary.sessions)),
        "signals" => lines.sort_by_key(|l| std::cmp::Reverse(l.summary.signals)),
        "success" => lines.sort_by(|a, b| {
            success(b)
                .partial_cmp(&success(a))
                .unwrap_or(std::cmp::Ordering::Equal)
        }),
        "cost" => lines.sort_by_key(|l| cps(l).unwrap_or(u64::MAX)),
        "activity" => lines.sort_by(|a, b| {
            let t = |l: &AgentLine| l.summary.last_activity.map(|t| t.seconds);
            t(b).cmp(&t(a))
        }),
        _ => lines.sort_by(|a, b| a.summary.agent.cmp(&b.summary.agent)),
    }
    let mut h = String::with_capacity(8192);
    if lines.is_empty() {
        h.push_str("<p>No agent has sent requests or signals yet. Requests with an <code>NM-Agent</code> header appear here.</p>");
    }
    h.push_str(
        "<p>Success rate and cost per successful session are over each agent's analytics window \
         (its current stretch of life); sessions and signals are all time.</p>\
         <table class=\"list\"><caption>Agents</caption><thead><tr>",
    );
    for (key, label) in [
        ("name", "Agent"),
        ("", "Status"),
        ("sessions", "Sessions"),
        ("signals", "Signals"),
        ("", "Signals by source"),
        ("success", "Success rate"),
        ("cost", "Cost per successful session"),
        ("activity", "Last activity"),
    ] {
        if key.is_empty() {
            let _ = write!(h, "<th scope=\"col\">{label}</th>");
        } else {
            let current = if key == sort {
                " aria-sort=\"descending\""
            } else {
                ""
            };
            let _ = write!(
                h,
                "<th scope=\"col\"{current}><a href=\"/agents?sort={key}\">{label}</a></th>"
            );
        }
    }
    h.push_str("</tr></thead><tbody>");
    for l in &lines {
        let name = &l.summary.agent;
        let _ = write!(
            h,
            "<tr data-agent=\"{}\"><th scope=\"row\"><a href=\"{}\">{}</a></th><td>{}</td>\
             <td class=\"num\" data-k=\"sessions\">{}</td><td class=\"num\" data-k=\"signals\">{}</td><td>{}</td>\
             <td class=\"num\" data-k=\"success\">{}</td><td class=\"num\" data-k=\"cps\">{}</td><td>{}</td></tr>",
            escape(name),
            escape(&agent_href(name)),
            escape(name),
            status_text(&l.analytics),
            count(l.summary.sessions),
            count(l.summary.signals),
            sources_text(&l.signals.by_source),
            success(l).map_or_else(|| "–".to_owned(), pct),
            cps(l).map_or_else(|| "–".to_owned(), usd),
            time(l.summary.last_activity.as_ref()),
        );
    }
    h.push_str("</tbody></table>");
    if let Some(u) = unattributed {
        let _ = write!(
            h,
            "<p>Without an agent (no <code>NM-Agent</code> header): {} sessions, {} signals, {} requests.</p>",
            count(u.sessions),
            count(u.signals),
            count(u.requests)
        );
    }
    let rated: Vec<(String, f64)> = lines
        .iter()
        .filter_map(|l| success(l).map(|r| (l.summary.agent.clone(), r)))
        .collect();
    if !rated.is_empty() {
        h.push_str(&chart::bars(
            "agents-success",
            "Success rate by agent",
            "The share of each agent's sessions whose last signal is a success, over its analytics window.",
            "success rate",
            pct,
            &rated,
        ));
    }
    Ok(("Agents".into(), Nav::Agents, h))
}

fn status_text(a: &pb::AgentAnalytics) -> String {
    match a.status() {
        pb::AnalyticsStatus::Ready => "<span class=\"ready\">ready</span>".into(),
        _ => {
            let p = a.progress.unwrap_or_default();
            let eta = p
                .eta
                .as_ref()
                .map(|t| format!(", expected {}", date(Some(t))))
                .unwrap_or_default();
            format!(
                "collecting: {} of {} signals{}",
                count(p.signals),
                count(p.threshold),
                eta
            )
        }
    }
}

fn sources_text(by_source: &[pb::SourceCounts]) -> String {
    if by_source.is_empty() {
        return "–".into();
    }
    by_source
        .iter()
        .map(|s| {
            let what = match &s.rule {
                Some(rule) => format!("{} ({})", s.source, rule),
                None => s.source.clone(),
            };
            format!("{} {}", escape(&what), count(s.total))
        })
        .collect::<Vec<_>>()
        .join("<br>")
}

// === One agent ===

async fn agent(c: &Call<'_>, name: &str) -> Page {
    let s = &c.ui.services;
    // Every arm at once: one outcome-rate query grouped by model, provider, env and week (each
    // dimension's weekly rates are sums of its rows, as a query by that dimension alone would
    // count them), and one latency query grouped the same way.
    let (a, signals, rates, latency) = tokio::join!(
        s.analytics
            .get_recommendations(c.req(pb::GetRecommendationsRequest {
                agent: name.to_owned(),
                refresh: false,
            })),
        s.agents
            .get_agent_signals(c.req(pb::GetAgentSignalsRequest {
                agent: name.to_owned(),
                ..Default::default()
            })),
        s.analytics
            .get_outcome_rates(c.req(pb::GetOutcomeRatesRequest {
                agent: name.to_owned(),
                group_by: ARM_WEEK.iter().map(|d| *d as i32).collect(),
                range: since(WEEKS * 7),
                limit: 10_000,
            })),
        s.usage.get_latency(
            c.req(pb::GetLatencyRequest {
                range: since(WEEKS * 7),
                group_by: [
                    pb::UsageDimension::Model,
                    pb::UsageDimension::Provider,
                    pb::UsageDimension::Env,
                    pb::UsageDimension::Week,
                ]
                .into_iter()
                .map(|d| d as i32)
                .collect(),
                filter: Some(pb::UsageFilter {
                    agent: Some(name.to_owned()),
                    ..Default::default()
                }),
                limit: 10_000,
            })
        ),
    );
    let a = a?.into_inner();
    let signals = signals?.into_inner();
    let rates = rates?.into_inner();
    let latency = latency?.into_inner();
    let mut h = String::with_capacity(16 * 1024);
    let _ = write!(
        h,
        "<p><a href=\"/agents\">All agents</a></p><section><h2>Status</h2><p data-k=\"status\">{}</p>",
        status_text(&a)
    );
    if let Some(p) = &a.progress {
        let _ = write!(
            h,
            "<p><label for=\"progress\">Signals toward recommendations</label> \
             <progress id=\"progress\" max=\"{}\" value=\"{}\">{} of {}</progress> \
             {:.1} signals a day; first {}, last {}.</p>",
            p.threshold.max(1),
            p.signals.min(p.threshold.max(1)),
            p.signals,
            p.threshold,
            p.daily_rate,
            time(p.first_signal.as_ref()),
            time(p.last_signal.as_ref())
        );
    }
    let _ = write!(
        h,
        "<p>Evidence counted: <strong>{}</strong>{}. Computed {}; window {} to {}.</p></section>",
        escape(if a.evidence.is_empty() {
            "explicit"
        } else {
            &a.evidence
        }),
        if a.continued_counts {
            " (continued counts as a success)"
        } else {
            ""
        },
        time(a.computed_at.as_ref()),
        date(a.window.as_ref().and_then(|w| w.since.as_ref())),
        date(a.window.as_ref().and_then(|w| w.until.as_ref())),
    );
    recommendations(&mut h, &a, c.ui.trace_url.as_deref());
    // Success rate over time per arm.
    h.push_str("<section><h2>Success rate over time</h2><p>Weekly success rate of the agent's sessions per model, provider and env, with its 95% anytime-valid band (a confidence sequence: valid however often the page is looked at).</p>");
    for (i, label) in ["model", "provider", "env"].into_iter().enumerate() {
        h.push_str(&weekly_chart(label, &weekly_rows(&rates.rows, i)));
    }
    h.push_str("</section>");
    latency_section(&mut h, &latency);
    // Outcome mix.
    h.push_str("<section><h2>Outcome mix</h2>");
    if let Some(sum) = &a.summary {
        let other = sum
            .sessions
            .saturating_sub(sum.successes)
            .saturating_sub(sum.abandoned);
        let _ = write!(
            h,
            "<p data-k=\"summary\">{} sessions, {} successful ({}), cost per successful session {}.</p>",
            count(sum.sessions),
            count(sum.successes),
            pct(sum.success_rate),
            sum.cost_per_success_micros.map_or_else(|| "–".into(), usd)
        );
        h.push_str(&chart::bars(
            "outcomes",
            "Sessions by outcome",
            "Sessions in the analytics window by the outcome of their last signal; regenerated and heavily edited sessions may also be counted as successes or failures.",
            "sessions",
            |v| count(v as u64),
            &[
                ("success".into(), sum.successes as f64),
                ("abandoned".into(), sum.abandoned as f64),
                ("other outcome".into(), other as f64),
                ("with a regeneration".into(), sum.regenerated as f64),
                ("heavily edited".into(), sum.heavily_edited as f64),
            ],
        ));
    } else {
        h.push_str("<p>No outcomes yet: the agent is still collecting signals.</p>");
    }
    if let Some(by) = &signals.by_action {
        h.push_str(&chart::bars(
            "actions",
            "Signals by action (all time)",
            "Every signal of the agent by its action, explicit and implicit together.",
            "signals",
            |v| count(v as u64),
            &action_rows(by),
        ));
    }
    let _ = write!(
        h,
        "<p>Signals by source: {}.</p></section>",
        sources_text(&signals.by_source).replace("<br>", ", ")
    );
    // Cost per model and per success.
    h.push_str("<section><h2>Cost per model and per success</h2>");
    let models: Vec<&pb::OutcomeCost> = a.costs.iter().filter(|c| c.scope == "model").collect();
    if models.is_empty() {
        h.push_str("<p>No costs yet.</p>");
    } else {
        h.push_str("<table class=\"list\"><caption>Cost by model (analytics window)</caption><thead><tr><th scope=\"col\">Model</th><th scope=\"col\">Sessions</th><th scope=\"col\">Successes</th><th scope=\"col\">Success rate</th><th scope=\"col\">Cost</th><th scope=\"col\">Cost per success</th></tr></thead><tbody>");
        for m in &models {
            let _ = write!(
                h,
                "<tr><th scope=\"row\">{}</th><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                escape(&m.name),
                count(m.sessions),
                count(m.successes),
                pct(m.success_rate),
                usd(m.cost_micros),
                m.cost_per_success_micros.map_or_else(|| "–".into(), usd)
            );
        }
        h.push_str("</tbody></table>");
        let rows: Vec<(String, f64)> = models
            .iter()
            .filter_map(|m| {
                m.cost_per_success_micros
                    .map(|c| (m.name.clone(), c as f64))
            })
            .collect();
        if !rows.is_empty() {
            h.push_str(&chart::bars(
                "cost-per-success",
                "Cost per successful session by model",
                "Known cost of a model's sessions divided by its successful sessions.",
                "USD per success",
                |v| usd(v as u64),
                &rows,
            ));
        }
    }
    h.push_str("</section>");
    Ok((format!("Agent {name}"), Nav::Agents, h))
}

fn action_rows(by: &pb::ActionCounts) -> Vec<(String, f64)> {
    [
        ("accepted", by.accepted),
        ("edited", by.edited),
        ("regenerated", by.regenerated),
        ("abandoned", by.abandoned),
        ("thumbs_up", by.thumbs_up),
        ("thumbs_down", by.thumbs_down),
        ("published", by.published),
        ("sent", by.sent),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v as f64))
    .collect()
}

fn recommendations(h: &mut String, a: &pb::AgentAnalytics, trace_url: Option<&str>) {
    h.push_str("<section><h2>Recommendations</h2>");
    if a.status() != pb::AnalyticsStatus::Ready {
        h.push_str("<p>Recommendations come once the agent has enough signals.</p></section>");
        return;
    }
    if a.recommendations.is_empty() {
        h.push_str("<p>The evidence supports no recommendation yet.</p>");
    }
    for (i, r) in a.recommendations.iter().enumerate() {
        let _ = write!(h, "<article class=\"rec\"><h3>{}</h3>", escape(&r.message));
        if let Some(e) = r.effect.as_ref().filter(|e| !e.summary.is_empty()) {
            let _ = write!(h, "<p>{}</p>", escape(&e.summary));
        }
        if !r.evidence.is_empty() {
            let _ = write!(
                h,
                "<table class=\"list\"><caption>Evidence for recommendation {}</caption><thead><tr>\
                 <th scope=\"col\">Metric</th><th scope=\"col\">Arm</th><th scope=\"col\">Count / sessions</th>\
                 <th scope=\"col\">Rate</th><th scope=\"col\">Anytime-valid interval</th><th scope=\"col\">Confidence</th>\
                 <th scope=\"col\">Example trace</th></tr></thead><tbody>",
                i + 1
            );
            for ev in &r.evidence {
                for arm in ev.a.iter().chain(ev.b.iter()) {
                    let interval = arm.interval.map_or_else(
                        || "–".into(),
                        |iv| format!("{} – {}", pct(iv.lower), pct(iv.upper)),
                    );
                    let trace = match (&arm.example_trace_id, trace_url) {
                        (Some(id), Some(tpl))
                            if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) =>
                        {
                            format!(
                                "<a href=\"{}\" rel=\"noreferrer\">trace {}</a>",
                                escape(&tpl.replace("{trace_id}", id)),
                                escape(&id[..8])
                            )
                        }
                        (Some(id), None) => format!("<code>{}</code>", escape(id)),
                        _ => "–".into(),
                    };
                    let _ = write!(
                        h,
                        "<tr><td>{}</td><th scope=\"row\">{}</th><td class=\"num\">{} / {}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                        escape(&ev.metric),
                        escape(&arm.label),
                        count(arm.count),
                        count(arm.n),
                        pct(arm.rate),
                        interval,
                        pct(ev.confidence),
                        trace
                    );
                }
                if let (Some(d), Some(iv)) = (ev.difference, ev.difference_interval) {
                    let _ = write!(
                        h,
                        "<tr><td colspan=\"7\">Difference {:+.1} points, interval {:+.1} to {:+.1}{}</td></tr>",
                        d * 100.0,
                        iv.lower * 100.0,
                        iv.upper * 100.0,
                        ev.p_value
                            .map(|p| format!(", always-valid p = {p:.4}"))
                            .unwrap_or_default()
                    );
                }
            }
            h.push_str("</tbody></table>");
        }
        if !r.figures.is_empty() {
            h.push_str("<ul class=\"figures\">");
            for f in &r.figures {
                let _ = write!(
                    h,
                    "<li>{}: {}</li>",
                    escape(&f.name),
                    escape(&format!("{:.4}", f.value))
                );
            }
            h.push_str("</ul>");
        }
        h.push_str("</article>");
    }
    h.push_str("</section>");
}

/// The outcome rates' dimensions on one agent's page: the arm (model, provider, env) and week.
const ARM_WEEK: [pb::OutcomeDimension; 4] = [
    pb::OutcomeDimension::Model,
    pb::OutcomeDimension::Provider,
    pb::OutcomeDimension::Env,
    pb::OutcomeDimension::Week,
];

/// The rows by (arm dimension `i`, week), summed from rows by ([`ARM_WEEK`]): the counts a
/// query grouped by that dimension and week gives, and its success rate from them.
pub fn weekly_rows(rows: &[pb::OutcomeRow], i: usize) -> Vec<pb::OutcomeRow> {
    let mut sums: BTreeMap<(Option<String>, Option<String>), pb::OutcomeRow> = BTreeMap::new();
    for r in rows {
        let k = |j: usize| r.key.get(j).and_then(|k| k.value.clone());
        let e = sums.entry((k(i), k(3))).or_insert_with(|| pb::OutcomeRow {
            key: vec![pb::UsageKey { value: k(i) }, pb::UsageKey { value: k(3) }],
            ..Default::default()
        });
        e.sessions = e.sessions.saturating_add(r.sessions);
        e.successes = e.successes.saturating_add(r.successes);
    }
    sums.into_values()
        .map(|mut r| {
            r.success_rate = if r.sessions == 0 {
                0.0
            } else {
                r.successes as f64 / r.sessions as f64
            };
            r
        })
        .collect()
}

/// An arm's name: its model, provider and env.
fn arm_name(key: &[pb::UsageKey]) -> String {
    format!(
        "{} · {} · {}",
        key_value(key, 0),
        key_value(key, 1),
        key_value(key, 2)
    )
}

fn ms(v: f64) -> String {
    format!("{} ms", count(v.round() as u64))
}

/// The latency section: per arm (model, provider, env) the weekly median latency and time to
/// first byte with the band up to their 90th percentile, and every percentile in a table.
fn latency_section(h: &mut String, report: &pb::LatencyReport) {
    h.push_str(&format!(
        "<section><h2>Latency</h2><p>Per arm (model · provider · env), week by week (Monday's date): \
         the median (p50) as a line, shaded up to the 90th percentile, of the time from the \
         request's start to the end of its answer, and to its first byte (streamed answers). \
         Percentiles of the stored records, to two significant digits; the six busiest arms of the \
         last {WEEKS} weeks.</p>"
    ));
    if report.rows.is_empty() {
        h.push_str("<p>No requests in the last weeks.</p></section>");
        return;
    }
    let weeks: BTreeSet<String> = report.rows.iter().map(|r| key_value(&r.key, 3)).collect();
    let weeks: Vec<String> = weeks.into_iter().collect();
    let mut arms: BTreeMap<String, u64> = BTreeMap::new();
    for r in &report.rows {
        *arms.entry(arm_name(&r.key)).or_default() += r.requests;
    }
    let mut arms: Vec<(String, u64)> = arms.into_iter().collect();
    arms.sort_by_key(|a| std::cmp::Reverse(a.1));
    arms.truncate(6);
    for (id, title, what, pick) in [
        (
            "latency",
            "Latency by arm",
            "from the request's start to the end of its answer",
            (|r: &pb::LatencyRow| r.latency)
                as fn(&pb::LatencyRow) -> Option<pb::LatencyPercentiles>,
        ),
        (
            "ttfb",
            "Time to first byte by arm",
            "from the request's start to the first byte of its answer",
            |r: &pb::LatencyRow| r.ttfb,
        ),
    ] {
        let mut max = 0.0_f64;
        let series: Vec<Series> = arms
            .iter()
            .map(|(arm, _)| {
                let mut points = vec![None; weeks.len()];
                for r in report.rows.iter().filter(|r| arm_name(&r.key) == *arm) {
                    let Some(p) = pick(r).filter(|p| p.count > 0) else {
                        continue;
                    };
                    let Some(w) = weeks.iter().position(|x| *x == key_value(&r.key, 3)) else {
                        continue;
                    };
                    max = max.max(p.p90_ms as f64);
                    points[w] = Some((p.p50_ms as f64, Some((p.p50_ms as f64, p.p90_ms as f64))));
                }
                Series {
                    name: arm.clone(),
                    points,
                }
            })
            .collect();
        if series.iter().all(|s| s.points.iter().all(Option::is_none)) {
            let _ = write!(
                h,
                "<p>No {} measured in the last {WEEKS} weeks.</p>",
                escape(&title.to_lowercase())
            );
            continue;
        }
        h.push_str(&chart::lines(
            id,
            title,
            &format!(
                "Weekly median (line) and 90th percentile (top of the band) of the time {what}, in milliseconds, per arm."
            ),
            &weeks,
            "milliseconds",
            max * 1.1,
            ms,
            &series,
        ));
    }
    h.push_str(
        "<details><summary>Latency percentiles by arm and week</summary><table class=\"list\" data-latency=\"arms\">\
         <caption>Percentiles by arm and week, in milliseconds</caption><thead><tr>\
         <th scope=\"col\">Arm</th><th scope=\"col\">Week</th><th scope=\"col\">Requests</th>\
         <th scope=\"col\">Latency p50</th><th scope=\"col\">p90</th><th scope=\"col\">p99</th>\
         <th scope=\"col\">First byte p50</th><th scope=\"col\">p90</th><th scope=\"col\">p99</th></tr></thead><tbody>",
    );
    let pcts = |p: Option<pb::LatencyPercentiles>| match p.filter(|p| p.count > 0) {
        Some(p) => format!(
            "<td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
            count(p.p50_ms),
            count(p.p90_ms),
            count(p.p99_ms)
        ),
        None => "<td>–</td><td>–</td><td>–</td>".to_owned(),
    };
    for r in report.rows.iter().take(MAX_ROWS) {
        let _ = write!(
            h,
            "<tr data-arm=\"{}\" data-week=\"{}\"><th scope=\"row\">{}</th><td>{}</td><td class=\"num\">{}</td>{}{}</tr>",
            escape(&arm_name(&r.key)),
            escape(&key_value(&r.key, 3)),
            escape(&arm_name(&r.key)),
            escape(&key_value(&r.key, 3)),
            count(r.requests),
            pcts(r.latency),
            pcts(r.ttfb)
        );
    }
    h.push_str("</tbody></table></details></section>");
}

/// The weekly success rate of each group (the first key), with its band, as a line chart.
fn weekly_chart(label: &str, rows: &[pb::OutcomeRow]) -> String {
    let weeks: BTreeSet<String> = rows.iter().map(|r| key_value(&r.key, 1)).collect();
    let weeks: Vec<String> = weeks.into_iter().collect();
    let mut by_group: BTreeMap<String, (u64, Vec<chart::Point>)> = BTreeMap::new();
    for r in rows {
        let g = key_value(&r.key, 0);
        let Some(w) = weeks.iter().position(|x| *x == key_value(&r.key, 1)) else {
            continue;
        };
        let entry = by_group
            .entry(g)
            .or_insert_with(|| (0, vec![None; weeks.len()]));
        entry.0 += r.sessions;
        if r.sessions > 0 {
            let (lo, hi) = confidence_sequence(r.successes, r.sessions, 0.05);
            entry.1[w] = Some((r.success_rate, Some((lo, hi))));
        }
    }
    let mut groups: Vec<(String, (u64, Vec<chart::Point>))> = by_group.into_iter().collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.1.0));
    let series: Vec<Series> = groups
        .into_iter()
        .take(6)
        .map(|(name, (_, points))| Series { name, points })
        .collect();
    if series.is_empty() {
        return format!("<p>No sessions with an outcome by {label} in the last {WEEKS} weeks.</p>");
    }
    chart::lines(
        &format!("weekly-{label}"),
        &format!("Weekly success rate by {label}"),
        &format!(
            "Success rate of sessions per week (Monday's date) by {label}, the six largest, with 95% anytime-valid bands."
        ),
        &weeks,
        "success rate",
        1.0,
        pct,
        &series,
    )
}

// === Experiments ===

async fn experiments(c: &Call<'_>) -> Page {
    let s = &c.ui.services.experiments;
    let list = s
        .list_experiments(c.req(pb::ListExperimentsRequest::default()))
        .await?
        .into_inner();
    let mut h = String::with_capacity(8192);
    if list.experiments.is_empty() {
        h.push_str("<p>No experiments exist. Create one with <code>nm-gateway experiments create</code>.</p>");
    }
    for e in list.experiments.iter().take(MAX_ROWS) {
        let report = s
            .get_experiment(c.req(pb::GetExperimentRequest { id: e.id.clone() }))
            .await?
            .into_inner();
        let events = s
            .list_experiment_events(c.req(pb::ListExperimentEventsRequest { id: e.id.clone() }))
            .await?
            .into_inner();
        experiment(&mut h, e, &report, &events.events);
    }
    Ok(("Experiments".into(), Nav::Experiments, h))
}

fn experiment(
    h: &mut String,
    e: &pb::Experiment,
    report: &pb::ExperimentReport,
    events: &[pb::ExperimentEvent],
) {
    let weight_total: u64 = e
        .arms
        .iter()
        .filter(|a| !a.rolled_back)
        .map(|a| u64::from(a.weight))
        .sum();
    let _ = write!(
        h,
        "<section class=\"experiment\" data-experiment=\"{}\"><h2>{} · <a href=\"{}\">{}</a>{}</h2>\
         <p>State <strong data-k=\"state\">{}</strong>{}. {}</p><p>{}</p>",
        escape(&e.id),
        escape(&e.id),
        escape(&agent_href(&e.agent)),
        escape(&e.agent),
        e.env
            .as_ref()
            .map(|v| format!(" ({})", escape(v)))
            .unwrap_or_default(),
        escape(&e.state),
        e.winner
            .as_ref()
            .map(|w| format!(", winner {}", escape(w)))
            .unwrap_or_default(),
        escape(&e.reason),
        escape(&report.summary),
    );
    if let Some(u) = report.units_to_decision {
        let _ = write!(
            h,
            "<p>About {} more {}s to a decision at the difference seen so far.</p>",
            count(u),
            escape(&e.unit)
        );
    }
    h.push_str("<table class=\"list\"><caption>Arms</caption><thead><tr><th scope=\"col\">Arm</th><th scope=\"col\">Provider / model</th><th scope=\"col\">Allocation</th><th scope=\"col\">Sessions</th><th scope=\"col\">Judged</th><th scope=\"col\">Success rate</th><th scope=\"col\">Anytime-valid interval</th><th scope=\"col\">Cost per success</th><th scope=\"col\">Guardrails</th></tr></thead><tbody>");
    let mut series = Vec::new();
    for r in &report.arms {
        let Some(arm) = &r.arm else { continue };
        let share = if arm.rolled_back || weight_total == 0 {
            0.0
        } else {
            f64::from(arm.weight) / weight_total as f64
        };
        let guard = r
            .guardrails
            .iter()
            .map(|g| format!("{} {}", escape(&g.name), escape(&g.status)))
            .collect::<Vec<_>>()
            .join(", ");
        let interval = r.success_interval.map(|iv| (iv.lower, iv.upper));
        let _ = write!(
            h,
            "<tr><th scope=\"row\">{}{}</th><td>{} / {}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            escape(&arm.name),
            if arm.rolled_back {
                " (rolled back)"
            } else {
                ""
            },
            escape(&arm.provider),
            escape(&arm.model),
            pct(share),
            count(r.sessions),
            count(r.judged),
            pct(r.success_rate),
            interval.map_or_else(
                || "–".into(),
                |(lo, hi)| format!("{} – {}", pct(lo), pct(hi))
            ),
            r.cost_per_success_micros.map_or_else(|| "–".into(), usd),
            if guard.is_empty() {
                "–".into()
            } else {
                guard
            }
        );
        series.push(Series {
            name: arm.name.clone(),
            points: vec![(r.judged > 0).then_some((r.success_rate, interval))],
        });
    }
    h.push_str("</tbody></table>");
    if series.iter().any(|s| s.points.iter().any(Option::is_some)) {
        h.push_str(&chart::lines(
            &format!("exp-{}", path_segment(&e.id)),
            "Success rate by arm",
            "Each arm's success rate now, with its anytime-valid interval.",
            &["now".to_owned()],
            "success rate",
            1.0,
            pct,
            &series,
        ));
    }
    h.push_str("<details><summary>History</summary><ol class=\"history\">");
    for ev in events.iter().take(MAX_ROWS) {
        let _ = write!(
            h,
            "<li>{} · {}{} by {}: {}</li>",
            time(ev.at.as_ref()),
            escape(&ev.kind),
            ev.arm
                .as_ref()
                .map(|a| format!(" ({})", escape(a)))
                .unwrap_or_default(),
            escape(&ev.actor),
            escape(&ev.detail)
        );
    }
    h.push_str("</ol></details></section>");
}

// === Usage and budgets ===

async fn usage(c: &Call<'_>) -> Page {
    let s = &c.ui.services;
    let report = |dims: Vec<pb::UsageDimension>, limit: u32| {
        s.usage.get_usage(c.req(pb::GetUsageRequest {
            range: since(USAGE_DAYS),
            group_by: dims.into_iter().map(|d| d as i32).collect(),
            filter: None,
            limit,
        }))
    };
    // Two queries: the usage by day, model, provider, agent and key, from which every chart and
    // table but the end users' is summed (a sum of finer groups is what the coarser report
    // gives), and the end users' (too many to cross with the rest). Past 10,000 rows (a very
    // busy month), each chart and table is a report of its own.
    let fine = [
        pb::UsageDimension::Day,
        pb::UsageDimension::Model,
        pb::UsageDimension::Provider,
        pb::UsageDimension::Agent,
        pb::UsageDimension::Key,
    ];
    let (fine, by_user) = tokio::join!(
        report(fine.to_vec(), 10_000),
        report(vec![pb::UsageDimension::User], 20)
    );
    let (fine, by_user) = (fine?.into_inner(), by_user?.into_inner());
    let (by_day, by_day_key, by_model, by_provider, by_agent) = if fine.truncated {
        let (by_day, by_day_key, by_model, by_provider, by_agent) = tokio::join!(
            report(
                vec![pb::UsageDimension::Day, pb::UsageDimension::Model],
                10_000,
            ),
            report(
                vec![pb::UsageDimension::Day, pb::UsageDimension::Key],
                10_000,
            ),
            report(vec![pb::UsageDimension::Model], 20),
            report(vec![pb::UsageDimension::Provider], 20),
            report(vec![pb::UsageDimension::Agent], 20),
        );
        (
            by_day?.into_inner(),
            by_day_key?.into_inner(),
            by_model?.into_inner(),
            by_provider?.into_inner(),
            by_agent?.into_inner(),
        )
    } else {
        let by_day = pb::UsageReport {
            rows: regroup(&fine.rows, &[0, 1]),
            ..fine.clone()
        };
        let by_day_key = pb::UsageReport {
            rows: regroup(&fine.rows, &[0, 4]),
            ..pb::UsageReport::default()
        };
        let top = |at: usize| {
            let mut rows = regroup(&fine.rows, &[at]);
            let truncated = rows.len() > 20;
            rows.truncate(20);
            pb::UsageReport {
                rows,
                truncated,
                ..pb::UsageReport::default()
            }
        };
        (by_day, by_day_key, top(1), top(2), top(3))
    };
    let mut tables = vec![
        (by_model, "Model"),
        (by_provider, "Provider"),
        (by_agent, "Agent"),
        (by_user, "User"),
    ];
    let mut h = String::with_capacity(16 * 1024);
    let total = by_day.total.clone().unwrap_or_default();
    let _ = write!(
        h,
        "<p data-k=\"usage-total\">Last {USAGE_DAYS} days: <strong>{}</strong> over {} requests, {} input and {} output tokens.</p>",
        usd(total.cost_micros),
        count(total.requests),
        count(total.input_tokens),
        count(total.output_tokens)
    );
    let days: BTreeSet<String> = by_day
        .rows
        .iter()
        .chain(&by_day_key.rows)
        .map(|r| key_value(&r.key, 0))
        .collect();
    let days: Vec<String> = days.into_iter().collect();
    let models = per_day(&by_day.rows, &days);
    let keys = per_day(&by_day_key.rows, &days);
    if !models.is_empty() {
        h.push_str("<section><h2>Spend and tokens over time</h2>");
        h.push_str(&chart::lines(
            "spend",
            "Spend per day by model",
            "Known cost of each day's requests (UTC) for the six costliest models.",
            &days,
            "USD per day",
            series_max(&models.spend) * 1.1,
            |v| format!("${v:.2}"),
            &models.spend,
        ));
        h.push_str(&chart::lines(
            "tokens",
            "Tokens per day by model",
            "Input plus output tokens of each day's requests (UTC) for the six costliest models.",
            &days,
            "tokens per day",
            series_max(&models.tokens) * 1.1,
            |v| count(v as u64),
            &models.tokens,
        ));
        if !keys.is_empty() {
            h.push_str(&chart::lines(
                "spend-key",
                "Spend per day by key",
                "Known cost of each day's requests (UTC) made with each of the six costliest keys (by key id).",
                &days,
                "USD per day",
                series_max(&keys.spend) * 1.1,
                |v| format!("${v:.2}"),
                &keys.spend,
            ));
        }
        h.push_str("</section>");
    }
    // The keys' totals are the sums of their days (the report by day and key covers them all
    // unless cut at its limit, which the caption says).
    let _ = write!(
        h,
        "<section><h2>Spend by key</h2><table class=\"list\" data-usage=\"key\"><caption>By key (last {USAGE_DAYS} days{})</caption><thead><tr><th scope=\"col\">Key</th><th scope=\"col\">Requests</th><th scope=\"col\">Input tokens</th><th scope=\"col\">Output tokens</th><th scope=\"col\">Cost</th><th scope=\"col\">Errors</th></tr></thead><tbody>",
        if by_day_key.truncated {
            ", from the 10,000 costliest days and keys"
        } else {
            ""
        }
    );
    for row in keys.totals.iter().take(MAX_ROWS) {
        usage_row(&mut h, row);
    }
    h.push_str("</tbody></table></section>");
    h.push_str("<section><h2>Spend by model, provider, agent and user</h2>");
    for (r, label) in tables.drain(..) {
        let _ = write!(
            h,
            "<table class=\"list\" data-usage=\"{}\"><caption>By {} (last {USAGE_DAYS} days{})</caption><thead><tr><th scope=\"col\">{label}</th><th scope=\"col\">Requests</th><th scope=\"col\">Input tokens</th><th scope=\"col\">Output tokens</th><th scope=\"col\">Cost</th><th scope=\"col\">Errors</th></tr></thead><tbody>",
            label.to_ascii_lowercase(),
            label.to_ascii_lowercase(),
            if r.truncated {
                ", the 20 costliest"
            } else {
                ""
            }
        );
        for row in &r.rows {
            usage_row(&mut h, row);
        }
        h.push_str("</tbody></table>");
    }
    if !by_day.unpriced_models.is_empty() {
        h.push_str("<p>Models without a price (their cost is unknown): ");
        let names: Vec<String> = by_day
            .unpriced_models
            .iter()
            .map(|m| {
                format!(
                    "{}/{} ({} requests)",
                    escape(&m.provider),
                    escape(&m.model),
                    count(m.requests)
                )
            })
            .collect();
        h.push_str(&names.join(", "));
        h.push_str("</p>");
    }
    h.push_str("</section>");
    // Budgets.
    let list = s
        .budgets
        .list_budgets(c.req(pb::ListBudgetsRequest {}))
        .await?
        .into_inner();
    // Each budget of a scope, in force now (the defaults have no ledger of their own).
    let mut statuses = Vec::new();
    for b in list
        .budgets
        .iter()
        .filter(|b| !b.scope.starts_with("default"))
        .take(MAX_ROWS)
    {
        let st = s
            .budgets
            .get_budget(c.req(pb::GetBudgetRequest {
                user_id: String::new(),
                scope: b.scope.clone(),
                scope_value: b.scope_value.clone(),
            }))
            .await?
            .into_inner();
        statuses.push(st);
    }
    h.push_str(&budgets(&list, &statuses));
    Ok(("Usage and budgets".into(), Nav::Usage, h))
}

/// `rows` grouped by their keys at positions `at` (in that order), the measures summed,
/// costliest first: the rows a report grouped by those dimensions alone gives.
fn regroup(rows: &[pb::UsageRow], at: &[usize]) -> Vec<pb::UsageRow> {
    let mut sums: BTreeMap<Vec<Option<String>>, pb::UsageRow> = BTreeMap::new();
    for r in rows {
        let key: Vec<Option<String>> = at
            .iter()
            .map(|&i| r.key.get(i).and_then(|k| k.value.clone()))
            .collect();
        let e = sums.entry(key.clone()).or_insert_with(|| pb::UsageRow {
            key: key
                .into_iter()
                .map(|value| pb::UsageKey { value })
                .collect(),
            ..Default::default()
        });
        e.requests = e.requests.saturating_add(r.requests);
        e.input_tokens = e.input_tokens.saturating_add(r.input_tokens);
        e.output_tokens = e.output_tokens.saturating_add(r.output_tokens);
        e.cached_input_tokens = e.cached_input_tokens.saturating_add(r.cached_input_tokens);
        e.reasoning_tokens = e.reasoning_tokens.saturating_add(r.reasoning_tokens);
        e.cost_micros = e.cost_micros.saturating_add(r.cost_micros);
        e.unpriced_requests = e.unpriced_requests.saturating_add(r.unpriced_requests);
        e.unmetered_requests = e.unmetered_requests.saturating_add(r.unmetered_requests);
        e.errors = e.errors.saturating_add(r.errors);
    }
    let mut out: Vec<pb::UsageRow> = sums.into_values().collect();
    out.sort_by(|a, b| {
        b.cost_micros
            .cmp(&a.cost_micros)
            .then(b.requests.cmp(&a.requests))
    });
    out
}

/// A report by (day, something) as series over `days`: the six costliest somethings' spend and
/// tokens per day, and every something's totals (costliest first).
struct PerDay {
    spend: Vec<Series>,
    tokens: Vec<Series>,
    totals: Vec<pb::UsageRow>,
}

impl PerDay {
    fn is_empty(&self) -> bool {
        self.totals.is_empty()
    }
}

fn per_day(rows: &[pb::UsageRow], days: &[String]) -> PerDay {
    let mut by: BTreeMap<String, (pb::UsageRow, Vec<chart::Point>, Vec<chart::Point>)> =
        BTreeMap::new();
    for r in rows {
        let Some(d) = days.iter().position(|x| *x == key_value(&r.key, 0)) else {
            continue;
        };
        let name = key_value(&r.key, 1);
        let e = by.entry(name.clone()).or_insert_with(|| {
            (
                pb::UsageRow {
                    key: vec![pb::UsageKey { value: Some(name) }],
                    ..Default::default()
                },
                vec![None; days.len()],
                vec![None; days.len()],
            )
        });
        e.0.requests = e.0.requests.saturating_add(r.requests);
        e.0.input_tokens = e.0.input_tokens.saturating_add(r.input_tokens);
        e.0.output_tokens = e.0.output_tokens.saturating_add(r.output_tokens);
        e.0.cost_micros = e.0.cost_micros.saturating_add(r.cost_micros);
        e.0.errors = e.0.errors.saturating_add(r.errors);
        e.1[d] = Some((r.cost_micros as f64 / 1e6, None));
        e.2[d] = Some(((r.input_tokens + r.output_tokens) as f64, None));
    }
    let mut by: Vec<_> = by.into_values().collect();
    by.sort_by(|a, b| {
        b.0.cost_micros
            .cmp(&a.0.cost_micros)
            .then(b.0.requests.cmp(&a.0.requests))
    });
    let name = |r: &pb::UsageRow| key_value(&r.key, 0);
    PerDay {
        spend: by
            .iter()
            .take(6)
            .map(|(r, p, _)| Series {
                name: name(r),
                points: p.clone(),
            })
            .collect(),
        tokens: by
            .iter()
            .take(6)
            .map(|(r, _, t)| Series {
                name: name(r),
                points: t.clone(),
            })
            .collect(),
        totals: by.into_iter().map(|(r, _, _)| r).collect(),
    }
}

fn series_max(ss: &[Series]) -> f64 {
    ss.iter()
        .flat_map(|s| s.points.iter().flatten().map(|p| p.0))
        .fold(0.0_f64, f64::max)
}

/// The budgets section: the defaults' limits, then each scope's budget with every limit's burn
/// in the current period (or minute).
/// One row of a usage table: its key, requests, tokens, cost and errors.
fn usage_row(h: &mut String, row: &pb::UsageRow) {
    let _ = write!(
        h,
        "<tr><th scope=\"row\">{}</th><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
        escape(&key_value(&row.key, 0)),
        count(row.requests),
        count(row.input_tokens),
        count(row.output_tokens),
        usd(row.cost_micros),
        count(row.errors)
    );
}

fn budgets(list: &pb::ListBudgetsResponse, statuses: &[pb::BudgetStatus]) -> String {
    let mut h = String::from("<section><h2>Budgets</h2>");
    let period = |b: &pb::Budget| match b.period() {
        pb::BudgetPeriod::Day => "day",
        pb::BudgetPeriod::Week => "week",
        pb::BudgetPeriod::Month => "month",
        pb::BudgetPeriod::Unspecified => "period",
    };
    let limits = |b: &pb::Budget| {
        let parts: Vec<String> = [
            b.limit_micros
                .map(|l| format!("{} per {}", usd(l), period(b))),
            b.limit_tokens
                .map(|t| format!("{} tokens per {}", count(t), period(b))),
            b.requests_per_minute
                .map(|r| format!("{r} requests a minute")),
            b.tokens_per_minute
                .map(|t| format!("{} tokens a minute", count(t))),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() {
            "no limit".to_owned()
        } else {
            parts.join(", ")
        }
    };
    for (scope, who) in [
        ("default", "every end user without a budget of their own"),
        ("default-key", "every key without a budget of its own"),
    ] {
        match list.budgets.iter().find(|b| b.scope == scope) {
            Some(b) => {
                let _ = write!(h, "<p>Default for {who}: {}.</p>", escape(&limits(b)));
            }
            None => {
                let _ = write!(h, "<p>No default for {who}.</p>");
            }
        }
    }
    if statuses.is_empty() {
        h.push_str("<p>No key, label, agent, model, env or end user has a budget of its own.</p></section>");
        return h;
    }
    h.push_str("<table class=\"list\"><caption>Budgets in force: each limit's use in its current period</caption><thead><tr><th scope=\"col\">Budget</th><th scope=\"col\">Limit</th><th scope=\"col\">Used</th><th scope=\"col\">Burn</th><th scope=\"col\">Resets</th></tr></thead><tbody>");
    for st in statuses {
        let name = format!("{} {}", st.scope, st.scope_value);
        for l in &st.limits {
            let money = l.limit.starts_with("usd");
            let amount = |v: u64| if money { usd(v) } else { count(v) };
            let burn = (l.value > 0).then(|| l.spent as f64 / l.value as f64);
            let meter = burn.map_or_else(
                || "–".to_owned(),
                |r| {
                    format!(
                        "<meter min=\"0\" max=\"1\" low=\"0.8\" high=\"0.95\" optimum=\"0\" value=\"{:.4}\" aria-label=\"burn of {} {}\">{}</meter> {}",
                        r.min(1.0),
                        escape(&name),
                        escape(&l.limit),
                        pct(r),
                        pct(r)
                    )
                },
            );
            let _ = write!(
                h,
                "<tr data-scope=\"{}\" data-value=\"{}\" data-limit=\"{}\"><th scope=\"row\">{}</th><td>{} {}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
                escape(&st.scope),
                escape(&st.scope_value),
                escape(&l.limit),
                escape(&name),
                amount(l.value),
                escape(&l.limit),
                amount(l.spent),
                meter,
                time(l.period_end.as_ref())
            );
        }
    }
    h.push_str("</tbody></table></section>");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_names_from_paths_are_decoded_and_bounded() {
        assert_eq!(agent_name("support-bot").as_deref(), Some("support-bot"));
        assert_eq!(agent_name("a%20b%2Fc").as_deref(), Some("a b/c"));
        assert_eq!(agent_name("%3Cscript%3E").as_deref(), Some("<script>"));
        assert_eq!(agent_name(""), None);
        assert_eq!(agent_name("%20"), None);
        assert_eq!(agent_name("%ff%fe"), None, "not UTF-8");
        assert_eq!(agent_name("a%00b"), None, "a control character");
        assert_eq!(agent_name(&"a".repeat(MAX_AGENT_LEN + 1)), None);
        assert!(agent_name(&"a".repeat(MAX_AGENT_LEN)).is_some());
    }
}
