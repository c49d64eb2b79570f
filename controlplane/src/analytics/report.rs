//! What analytics answers for one agent: progress toward the threshold, the outcome summary,
//! outcome-weighted cost and the recommendations with their evidence. Serializable both ways:
//! the controlplane stores it as JSON (`analytics_results.report`, with the intervals it keeps
//! for the next look beside it), the CLI prints it as JSON.
//!
//! Every interval in the evidence is anytime-valid (a confidence sequence, see
//! [`super::stats`]): it holds at every recomputation at once, not only at one look.

use serde::{Deserialize, Serialize};

use super::stats::{Evidence, Interval};

/// Whether recommendations are produced yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Fewer signals than the threshold: only progress is reported.
    Collecting,
    /// At or past the threshold: recommendations are computed (there may be none).
    Ready,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Collecting => "collecting",
            Status::Ready => "ready",
        }
    }
}

/// A half-open time range `[since_ms, until_ms)`, Unix milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Window {
    pub since_ms: i64,
    pub until_ms: i64,
}

/// Progress toward the recommendation threshold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Progress {
    /// Signals of the agent, all time.
    pub signals: u64,
    /// Signals needed before recommendations ([`crate::signals::RECOMMENDATION_THRESHOLD`]).
    pub threshold: u64,
    /// Signals still missing (0 at or past the threshold).
    pub remaining: u64,
    /// Signals per day recently (see [`super::RATE_WINDOW_DAYS`]).
    pub daily_rate: f64,
    /// When the threshold should be reached at that rate; `None` when reached, or when no
    /// signal arrived recently (no rate to extrapolate).
    pub eta_ms: Option<i64>,
    pub first_signal_ms: Option<i64>,
    pub last_signal_ms: Option<i64>,
}

/// Session outcomes over a group (the agent, a model, an env, a week, an end user, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct OutcomeRow {
    /// One value per dimension asked for; `None` where the sessions had none (e.g. a session
    /// whose requests used more than one model has no model).
    pub key: Vec<Option<String>>,
    /// Sessions with at least one signal.
    pub sessions: u64,
    /// Signals in those sessions.
    pub signals: u64,
    /// Sessions whose last signal is a success.
    pub successes: u64,
    /// Sessions whose last signal is `abandoned`.
    pub abandoned: u64,
    /// Sessions with at least one regeneration.
    pub regenerated: u64,
    /// Sessions with at least one heavy edit.
    pub heavily_edited: u64,
    /// Regenerations over all sessions.
    pub regenerations: u64,
    /// Known cost of those sessions' requests, micro-dollars.
    pub cost_micros: u64,
    /// Requests of those sessions.
    pub requests: u64,
}

impl OutcomeRow {
    pub fn success_rate(&self) -> f64 {
        ratio(self.successes, self.sessions)
    }
    pub fn abandonment_rate(&self) -> f64 {
        ratio(self.abandoned, self.sessions)
    }
    pub fn regeneration_rate(&self) -> f64 {
        ratio(self.regenerated, self.sessions)
    }
    pub fn heavy_edit_rate(&self) -> f64 {
        ratio(self.heavily_edited, self.sessions)
    }
    /// Cost per successful session (accepted, sent, published, approved or lightly edited
    /// output), micro-dollars; `None` before the first success.
    pub fn cost_per_success_micros(&self) -> Option<u64> {
        super::stats::micros_per(self.cost_micros, self.successes)
    }
    /// Regenerations per successful session; `None` before the first success.
    pub fn regenerations_per_success(&self) -> Option<f64> {
        (self.successes > 0).then(|| self.regenerations as f64 / self.successes as f64)
    }
    /// Mean cost of a session, micro-dollars; `None` without sessions.
    pub fn cost_per_session_micros(&self) -> Option<u64> {
        super::stats::micros_per(self.cost_micros, self.sessions)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// What outcome-weighted cost is reported for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostScope {
    Agent,
    Model,
    User,
}

impl CostScope {
    pub fn as_str(self) -> &'static str {
        match self {
            CostScope::Agent => "agent",
            CostScope::Model => "model",
            CostScope::User => "user",
        }
    }
}

/// Outcome-weighted cost of the agent, one model, or one end user.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomeCost {
    pub scope: CostScope,
    /// The agent, model or end user.
    pub name: String,
    pub sessions: u64,
    pub successes: u64,
    pub cost_micros: u64,
    pub cost_per_success_micros: Option<u64>,
    pub regenerations_per_success: Option<f64>,
    pub success_rate: f64,
}

/// The kinds of recommendation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// One model serves the agent better than every other model it used.
    BestModel,
    /// One provider serves the agent better than every other provider it used.
    BestProvider,
    /// A model cheaper than the best performs as well, within a margin.
    CheaperModel,
    /// A rate (regeneration, abandonment, heavy edit) is above its level.
    HighRegeneration,
    HighAbandonment,
    HighHeavyEdit,
    /// A rate got significantly worse between the last two weeks (while not above its level).
    WorseningTrend,
    /// Success differs between environments.
    EnvDifference,
    /// Slow time to first byte goes with more abandonment.
    LatencyAbandonment,
    /// A few end users account for most of the cost.
    CostConcentration,
}

impl Kind {
    pub const ALL: [Kind; 10] = [
        Kind::BestModel,
        Kind::BestProvider,
        Kind::CheaperModel,
        Kind::HighRegeneration,
        Kind::HighAbandonment,
        Kind::HighHeavyEdit,
        Kind::WorseningTrend,
        Kind::EnvDifference,
        Kind::LatencyAbandonment,
        Kind::CostConcentration,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::BestModel => "best_model",
            Kind::BestProvider => "best_provider",
            Kind::CheaperModel => "cheaper_model",
            Kind::HighRegeneration => "high_regeneration",
            Kind::HighAbandonment => "high_abandonment",
            Kind::HighHeavyEdit => "high_heavy_edit",
            Kind::WorseningTrend => "worsening_trend",
            Kind::EnvDifference => "env_difference",
            Kind::LatencyAbandonment => "latency_abandonment",
            Kind::CostConcentration => "cost_concentration",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// One arm of a piece of evidence: a model, an env, a time window, a latency band.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arm {
    pub label: String,
    /// Events counted (successes, abandonments, ... as the metric says).
    pub count: u64,
    /// Sessions observed.
    pub n: u64,
    pub rate: f64,
    /// Anytime-valid interval of the rate at [`EvidenceItem::confidence`]: this look's for the
    /// arms of a comparison; for a rate against a level, the running intersection over the
    /// looks the level was decided on.
    pub interval: Interval,
    /// A traced request of this arm in the window (its OpenTelemetry trace id), to look at in
    /// the tracing backend: the latest one whose model, provider or env is the arm's label.
    #[serde(default)]
    pub example_trace_id: Option<String>,
}

/// One statistical fact behind a recommendation: a comparison of two arms (`b` against `a`),
/// or one arm against a fixed level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvidenceItem {
    /// What is counted: `success`, `abandonment`, `regeneration`, `heavy_edit`.
    pub metric: String,
    pub a: Arm,
    pub b: Option<Arm>,
    /// `rate(b) − rate(a)` and its anytime-valid interval (the running intersection over the
    /// looks at this growing set of sessions).
    pub difference: Option<f64>,
    pub difference_interval: Option<Interval>,
    /// The level `a`'s rate is compared with, when there is no `b`.
    pub level: Option<f64>,
    /// Confidence of each interval, anytime-valid, Bonferroni-adjusted and at the share of the
    /// stretch of the agent's life: `1 − 0.05 · share / comparisons` (share 6/(π² k²) in
    /// stretch `k`: 96.96% family-wise in the first), so 95% family-wise over the whole life.
    pub confidence: f64,
    /// Comparisons made for the same question (the Bonferroni `m`).
    pub comparisons: u32,
    /// Always-valid p-value at this look (unadjusted: compare it with `1 − confidence`) of what
    /// the evidence rules out: equal rates; `b` worse by the margin for `cheaper_model`; the
    /// rate at the level for a level.
    pub p_value: Option<f64>,
    /// Posterior probability that `b`'s rate is above `a`'s (uniform priors).
    pub prob_b_greater: Option<f64>,
}

impl EvidenceItem {
    /// From a two-arm comparison.
    pub fn compare(metric: &str, a_label: &str, b_label: &str, e: &Evidence) -> Self {
        let arm = |label: &str, x: &super::stats::ArmEvidence| Arm {
            label: label.to_owned(),
            count: x.successes,
            n: x.n,
            rate: x.rate,
            interval: x.interval,
            example_trace_id: None,
        };
        Self {
            metric: metric.to_owned(),
            a: arm(a_label, &e.a),
            b: Some(arm(b_label, &e.b)),
            difference: Some(e.difference),
            difference_interval: Some(e.difference_interval),
            level: None,
            confidence: e.confidence,
            comparisons: e.comparisons,
            p_value: Some(e.p_value),
            prob_b_greater: Some(e.prob_b_greater),
        }
    }

    /// From a rate shown above a level.
    pub fn above(
        metric: &str,
        label: &str,
        x: &super::stats::AboveLevel,
        comparisons: u32,
    ) -> Self {
        Self {
            metric: metric.to_owned(),
            a: Arm {
                label: label.to_owned(),
                count: x.arm.successes,
                n: x.arm.n,
                rate: x.arm.rate,
                interval: x.arm.interval,
                example_trace_id: None,
            },
            b: None,
            difference: None,
            difference_interval: None,
            level: Some(x.level),
            confidence: x.confidence,
            comparisons,
            p_value: Some(x.p_value),
            prob_b_greater: None,
        }
    }
}

/// What following a recommendation is expected to change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Effect {
    /// Change of the success rate (absolute, e.g. `0.08` = +8 points), when it can be estimated.
    pub success_rate_change: Option<f64>,
    /// Relative change of cost (e.g. `-0.6` = 60% cheaper), when it can be estimated.
    pub cost_change: Option<f64>,
    /// Cost per successful session before and after, micro-dollars.
    pub cost_per_success_before_micros: Option<u64>,
    pub cost_per_success_after_micros: Option<u64>,
    /// The expected effect in words.
    pub summary: String,
}

/// A named number that belongs to a recommendation's evidence but is not a rate (a share of
/// cost, a Gini coefficient, a latency cut-off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    pub name: String,
    pub value: f64,
}

/// One recommendation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    pub kind: Kind,
    /// One line a product team can act on.
    pub message: String,
    /// What it is about: a model, provider, env, metric; `None` for the agent as a whole.
    pub subject: Option<String>,
    pub evidence: Vec<EvidenceItem>,
    pub figures: Vec<Figure>,
    pub effect: Effect,
    /// The data the recommendation rests on.
    pub window: Window,
}

/// Everything analytics says about one agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentAnalytics {
    pub agent: String,
    pub status: Status,
    pub computed_at_ms: i64,
    pub progress: Progress,
    /// The data window of the outcome figures and recommendations.
    pub window: Window,
    /// Outcomes of the agent's sessions in the window (key empty); `None` while collecting.
    pub summary: Option<OutcomeRow>,
    /// Outcome-weighted cost: the agent, each model, the costliest end users.
    pub costs: Vec<OutcomeCost>,
    /// Empty when the evidence supports none.
    pub recommendations: Vec<Recommendation>,
    /// Which signals the figures and recommendations count (the agent's setting when they
    /// were computed; explicit only in answers stored before there was a choice).
    #[serde(default)]
    pub evidence: super::Evidence,
    /// Under explicit evidence, shown beside: the window's outcomes had implicit signals counted
    /// too (where a unit has no explicit one); `None` while collecting or when they count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub implicit_summary: Option<OutcomeRow>,
}
