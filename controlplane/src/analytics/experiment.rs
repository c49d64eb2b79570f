//! An experiment's decision: which arm wins, which one a guardrail stops, or that no difference
//! was found, with a guarantee that holds however often one looks.
//!
//! Everything here is a pure function of per-arm counts ([`ArmCounts`]): the controlplane counts
//! them from the stored records and signals (`super::experiment_counts`) and evaluates every
//! running experiment each analytics interval, but any schedule (a look after every session)
//! keeps the guarantee.
//!
//! # The primary metric
//!
//! The success rate of the experiment's *unit*: a session (its last signal decides, as in the
//! agent's analytics) or an answer (the signals naming it). Arms are compared pairwise with the
//! anytime-valid interval of the difference of their rates ([`stats::difference_interval`], the
//! confidence sequences of the agent's analytics), each pair at `α / m` for `m` pairs
//! (Bonferroni), `α` = [`stats::FAMILY_ALPHA`]. An arm **wins** when its rate is above every
//! other arm's with evidence: each of its differences excludes 0. Because each interval covers
//! the true difference at every number of units at once, the chance that an experiment between
//! equal arms ever declares a winner, looked at after every unit for its whole life, is at most
//! 5% (up to the combination's approximation, checked by the simulation below). An experiment
//! has one stretch: its units only grow while it runs, so it spends the whole 5% on its one
//! question.
//!
//! No arm is compared before it has [`stats::MIN_SAMPLES_PER_ARM`] judged units.
//!
//! # Guardrails
//!
//! Each guardrail is a rate of a bad event, compared between arms the same way at its own 5%:
//! an arm is **harmful** when its bad rate is above another arm's with evidence. The events:
//!
//! | guardrail | event | out of |
//! |---|---|---|
//! | `abandonment` | the session's outcome is `abandoned` | sessions |
//! | `error_rate` | the request failed (a 5xx, a gateway error, the upstream body cut) | requests |
//! | `p95_latency` | the request took longer than the latency threshold | requests |
//! | `cost_per_session` | the session cost more than the cost threshold | sessions |
//!
//! The thresholds are fixed for the experiment's life: the agent's p95 latency and median
//! session cost over the week before the experiment, or, without that history, the pooled value
//! of the experiment's own first units (pooled over arms, so under equal arms it favours none).
//! A latency or cost guardrail therefore asks "does this arm push more of its units past the
//! usual tail", which a shift of the whole distribution and a fatter tail both answer yes to.
//!
//! # Ending
//!
//! At the plan's maximum sessions or days without a winner, the experiment is **inconclusive**,
//! and the evidence says which difference it ruled out: the largest distance from 0 any pair's
//! interval still allows.

use std::fmt::Write as _;
use std::str::FromStr;

use serde::Serialize;

use super::stats::{self, FAMILY_ALPHA, Interval, MIN_SAMPLES_PER_ARM, Proportion};
use crate::error::{Error, Result};

/// What an experiment's primary metric counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Unit {
    /// A session: its last signal decides (the default).
    #[default]
    Session,
    /// An answer named by signals (`request_id`).
    Request,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Request => "request",
        }
    }
}

impl FromStr for Unit {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "session" => Ok(Self::Session),
            "request" => Ok(Self::Request),
            other => Err(Error::InvalidArgument(format!(
                "unit: {other:?} is not session or request"
            ))),
        }
    }
}

/// A measure that stops an arm early when it is worse (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Guardrail {
    Abandonment,
    ErrorRate,
    CostPerSession,
    P95Latency,
}

impl FromStr for Guardrail {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|g| g.as_str() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "guardrails: {s:?} is not one of abandonment, error_rate, cost_per_session, \
                 p95_latency"
                ))
            })
    }
}

impl Guardrail {
    pub const ALL: [Guardrail; 4] = [
        Self::Abandonment,
        Self::ErrorRate,
        Self::CostPerSession,
        Self::P95Latency,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abandonment => "abandonment",
            Self::ErrorRate => "error_rate",
            Self::CostPerSession => "cost_per_session",
            Self::P95Latency => "p95_latency",
        }
    }

    /// The guardrail's bad events of an arm, out of its units.
    fn events(self, a: &ArmCounts) -> Proportion {
        match self {
            Self::Abandonment => Proportion::new(a.abandoned, a.sessions),
            Self::ErrorRate => Proportion::new(a.errors, a.requests),
            Self::CostPerSession => Proportion::new(a.costly, a.sessions),
            Self::P95Latency => Proportion::new(a.slow, a.requests),
        }
    }

    /// The arm's value as `experiments show` gives it: a rate, micro-dollars per session, or
    /// milliseconds.
    fn value(self, a: &ArmCounts) -> f64 {
        match self {
            Self::Abandonment | Self::ErrorRate => self.events(a).rate(),
            Self::CostPerSession => {
                stats::micros_per(a.cost_micros, a.sessions).map_or(0.0, |m| m as f64)
            }
            Self::P95Latency => a.p95_latency_ms.map_or(0.0, |m| m as f64),
        }
    }
}

/// What the evaluation needs to know of an experiment besides its counts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub unit: Unit,
    pub guardrails: Vec<Guardrail>,
    /// Sessions (all arms) at which an undecided experiment ends inconclusive; 0: no limit.
    pub max_sessions: u64,
    /// Days after its start at which an undecided experiment ends inconclusive; 0: no limit.
    pub max_days: u32,
    pub started_at_ms: i64,
}

/// One arm's counts, over the units assigned to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArmCounts {
    pub name: String,
    /// Sessions with a request served by the arm.
    pub sessions: u64,
    pub requests: u64,
    /// Signals about the arm's units.
    pub signals: u64,
    /// Units with an outcome (sessions or answers, by the plan's unit), and the successful ones.
    pub judged: u64,
    pub successes: u64,
    /// Sessions whose outcome is `abandoned`.
    pub abandoned: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Requests slower than the latency threshold.
    pub slow: u64,
    /// Sessions that cost more than the cost threshold.
    pub costly: u64,
    /// Known cost of the arm's requests, micro-dollars.
    pub cost_micros: u64,
    pub p95_latency_ms: Option<u64>,
}

impl ArmCounts {
    fn primary(&self) -> Proportion {
        Proportion::new(self.successes, self.judged)
    }
}

/// A guardrail's verdict on one arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardStatus {
    /// Too few units to compare.
    Collecting,
    Ok,
    /// Worse than another arm, with evidence.
    Harm,
}

impl GuardStatus {
    pub fn name(self) -> &'static str {
        match self {
            Self::Collecting => "collecting",
            Self::Ok => "ok",
            Self::Harm => "harm",
        }
    }
}

/// One arm's evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct ArmEvaluation {
    pub rate: f64,
    /// Anytime-valid interval of the arm's success rate (at the pairwise level).
    pub interval: Interval,
    pub cost_per_success_micros: Option<u64>,
    pub guardrails: Vec<(Guardrail, f64, GuardStatus)>,
}

/// What the evidence says now.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// No decision yet.
    Running,
    /// Arm `winner` (an index into the counts) is better than every other arm.
    Decided { winner: usize },
    /// A guardrail found arm `arm` worse than another arm.
    Harm { arm: usize, guardrail: Guardrail },
    /// The plan's limit came without a winner; differences beyond `ruled_out` (absolute, on the
    /// rate) are excluded.
    Inconclusive { ruled_out: f64 },
}

/// The experiment's evaluation at one look.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub verdict: Verdict,
    pub arms: Vec<ArmEvaluation>,
    /// The evidence in words.
    pub summary: String,
    /// Judged units still needed for a decision if the rates stay as they are.
    pub units_to_decision: Option<u64>,
}

const MS_PER_DAY: i64 = 86_400_000;

/// Evaluates an experiment at `now_ms` (see the module doc). `arms` are the active arms (a
/// rolled-back arm is no longer compared).
pub fn evaluate(plan: &Plan, arms: &[ArmCounts], now_ms: i64) -> Evaluation {
    let pairs = pairs(arms.len());
    let alpha = FAMILY_ALPHA / pairs.len().max(1) as f64;
    let ready = arms.len() >= 2 && arms.iter().all(|a| a.judged >= MIN_SAMPLES_PER_ARM);

    let mut evals: Vec<ArmEvaluation> = arms
        .iter()
        .map(|a| ArmEvaluation {
            rate: a.primary().rate(),
            interval: a.primary().sequence(alpha),
            cost_per_success_micros: stats::micros_per(a.cost_micros, a.successes),
            guardrails: Vec::new(),
        })
        .collect();

    // Guardrails first: harm stops an experiment whatever the primary metric says.
    let mut harm = None;
    for &g in &plan.guardrails {
        let flagged = harmful(arms, g, alpha);
        for (i, e) in evals.iter_mut().enumerate() {
            let status = match &flagged {
                None => GuardStatus::Collecting,
                Some(f) if f.contains(&i) => GuardStatus::Harm,
                Some(_) => GuardStatus::Ok,
            };
            e.guardrails.push((g, g.value(&arms[i]), status));
            if status == GuardStatus::Harm && harm.is_none() {
                harm = Some((i, g));
            }
        }
    }

    // The primary metric's differences, for every pair.
    let diffs = if ready {
        differences(arms, &pairs, alpha)
    } else {
        Vec::new()
    };
    let winner = if ready {
        winner(arms.len(), &diffs)
    } else {
        None
    };
    let ruled_out = diffs
        .iter()
        .map(|(_, _, d)| d.lower.abs().max(d.upper.abs()))
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));

    let sessions: u64 = arms.iter().map(|a| a.sessions).sum();
    let at_limit = (plan.max_sessions > 0 && sessions >= plan.max_sessions)
        || (plan.max_days > 0
            && now_ms.saturating_sub(plan.started_at_ms) >= i64::from(plan.max_days) * MS_PER_DAY);

    let verdict = match (harm, winner) {
        (Some((arm, guardrail)), _) => Verdict::Harm { arm, guardrail },
        (None, Some(winner)) => Verdict::Decided { winner },
        (None, None) if at_limit => Verdict::Inconclusive {
            ruled_out: ruled_out.unwrap_or(1.0),
        },
        (None, None) => Verdict::Running,
    };
    let units_to_decision = match verdict {
        Verdict::Running => units_to_decision(arms, alpha),
        _ => None,
    };
    let summary = summary(plan, arms, &verdict, ready, ruled_out, units_to_decision);
    Evaluation {
        verdict,
        arms: evals,
        summary,
        units_to_decision,
    }
}

/// The interval of `rate(j) − rate(i)` for each pair `(i, j)`.
fn differences(
    arms: &[ArmCounts],
    pairs: &[(usize, usize)],
    alpha: f64,
) -> Vec<(usize, usize, Interval)> {
    pairs
        .iter()
        .map(|&(i, j)| {
            let d = stats::difference_interval(arms[i].primary(), arms[j].primary(), alpha);
            (i, j, d)
        })
        .collect()
}

/// The arm whose rate is above every other's with evidence: each of its differences excludes 0.
fn winner(arms: usize, diffs: &[(usize, usize, Interval)]) -> Option<usize> {
    (0..arms).find(|&w| {
        diffs.iter().all(|&(i, j, d)| {
            (i != w && j != w) || (j == w && d.lower > 0.0) || (i == w && d.upper < 0.0)
        })
    })
}

/// The primary decision alone, as [`evaluate`] makes it: the winner, if any (the simulation's
/// look, without the report).
pub fn decide(arms: &[ArmCounts]) -> Option<usize> {
    if arms.len() < 2 || arms.iter().any(|a| a.judged < MIN_SAMPLES_PER_ARM) {
        return None;
    }
    let pairs = pairs(arms.len());
    let alpha = FAMILY_ALPHA / pairs.len() as f64;
    winner(arms.len(), &differences(arms, &pairs, alpha))
}

/// Every unordered pair of `n` arms.
fn pairs(n: usize) -> Vec<(usize, usize)> {
    (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .collect()
}

/// The arms guardrail `g` finds worse than another arm (`None`: too few units to compare).
fn harmful(arms: &[ArmCounts], g: Guardrail, alpha: f64) -> Option<Vec<usize>> {
    let events: Vec<Proportion> = arms.iter().map(|a| g.events(a)).collect();
    if arms.len() < 2 || events.iter().any(|e| e.n < MIN_SAMPLES_PER_ARM) {
        return None;
    }
    let mut bad = Vec::new();
    for (i, j) in pairs(arms.len()) {
        let d = stats::difference_interval(events[i], events[j], alpha);
        if d.lower > 0.0 && !bad.contains(&j) {
            bad.push(j);
        }
        if d.upper < 0.0 && !bad.contains(&i) {
            bad.push(i);
        }
    }
    Some(bad)
}

/// Judged units (all arms) still needed before the best and second-best arms' interval
/// excludes 0, if their rates stay as they are and units keep coming in today's proportions:
/// the smallest scale-up of today's counts that decides, found by doubling then bisection.
/// `None` when the rates are equal or a decision would need more than 10^7 units.
fn units_to_decision(arms: &[ArmCounts], alpha: f64) -> Option<u64> {
    if arms.len() < 2 || arms.iter().any(|a| a.judged == 0) {
        return None;
    }
    let mut order: Vec<usize> = (0..arms.len()).collect();
    order.sort_by(|&a, &b| {
        arms[b]
            .primary()
            .rate()
            .total_cmp(&arms[a].primary().rate())
    });
    let (best, second) = (&arms[order[0]], &arms[order[1]]);
    if best.primary().rate() == second.primary().rate() {
        return None;
    }
    let total: u64 = arms.iter().map(|a| a.judged).sum();
    let scaled = |p: Proportion, k: f64| {
        let n = (p.n as f64 * k).ceil() as u64;
        Proportion::new((p.rate() * n as f64).round() as u64, n)
    };
    let decides = |k: f64| {
        let (a, b) = (scaled(second.primary(), k), scaled(best.primary(), k));
        a.n >= MIN_SAMPLES_PER_ARM
            && b.n >= MIN_SAMPLES_PER_ARM
            && stats::difference_interval(a, b, alpha).lower > 0.0
    };
    const MAX_UNITS: f64 = 1e7;
    let (mut lo, mut hi) = (1.0, 2.0);
    while !decides(hi) {
        lo = hi;
        hi *= 2.0;
        if hi * total as f64 > MAX_UNITS {
            return None;
        }
    }
    for _ in 0..20 {
        let mid = 0.5 * (lo + hi);
        if decides(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(((hi * total as f64).ceil() as u64).saturating_sub(total))
}

fn summary(
    plan: &Plan,
    arms: &[ArmCounts],
    verdict: &Verdict,
    ready: bool,
    ruled_out: Option<f64>,
    to_go: Option<u64>,
) -> String {
    let unit = plan.unit.as_str();
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    let mut s = String::new();
    match verdict {
        Verdict::Decided { winner } => {
            let w = &arms[*winner];
            let _ = write!(
                s,
                "{} wins: {} {unit} success against",
                w.name,
                pct(w.primary().rate())
            );
            for (i, a) in arms.iter().enumerate() {
                if i != *winner {
                    let _ = write!(s, " {} for {},", pct(a.primary().rate()), a.name);
                }
            }
            s.pop();
            let _ = write!(
                s,
                "; every difference excludes 0 at a family-wise {}% (anytime-valid).",
                FAMILY_ALPHA * 100.0
            );
        }
        Verdict::Harm { arm, guardrail } => {
            let _ = write!(
                s,
                "{} is worse on {} than another arm, with anytime-valid evidence at 5%.",
                arms[*arm].name,
                guardrail.as_str()
            );
        }
        Verdict::Inconclusive { ruled_out } => {
            let _ = write!(
                s,
                "No winner at the plan's limit; a difference of more than {} points in {unit} \
                 success between any two arms is ruled out.",
                format_args!("{:.1}", 100.0 * ruled_out)
            );
        }
        Verdict::Running if !ready => {
            let least = arms.iter().map(|a| a.judged).min().unwrap_or(0);
            let _ = write!(
                s,
                "Collecting: every arm needs {MIN_SAMPLES_PER_ARM} judged {unit}s before arms \
                 are compared (the fewest has {least})."
            );
        }
        Verdict::Running => {
            s.push_str("No difference with evidence yet");
            if let Some(r) = ruled_out {
                let _ = write!(
                    s,
                    "; differences beyond {} points are ruled out",
                    format_args!("{:.1}", 100.0 * r)
                );
            }
            match to_go {
                Some(n) => {
                    let _ = write!(
                        s,
                        "; about {n} more judged {unit}s to decide at the rates seen."
                    );
                }
                None => s.push('.'),
            }
        }
    }
    s
}

#[cfg(test)]
#[path = "experiment_tests.rs"]
mod tests;
