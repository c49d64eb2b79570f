//! `nm.v1.Analytics` (admin): an agent's recommendations, on-demand recomputation and outcome
//! rates; plus the conversions between [`nm_controlplane::analytics`]'s answer and its protobuf
//! form, both ways (the CLI turns the protobuf back into the controlplane's type to print it).

use nm_controlplane::analytics::report::{
    AgentAnalytics, Arm, CostScope, Effect, EvidenceItem, Figure, Kind, OutcomeCost, OutcomeRow,
    Progress, Recommendation, Status as AnalyticsStatus, Window,
};
use nm_controlplane::analytics::stats::Interval;
use nm_controlplane::analytics::{Analytics, Dimension, Evidence};
use tonic::{Request, Response, Status};
use tracing::info;

use super::convert::{ms_to_timestamp, range_ms, timestamp_to_ms};
use super::pb;
use super::pb::analytics_server::Analytics as AnalyticsApi;
use nm_controlplane::Controlplane;

use super::status::to_status;
use super::{require_admin, require_reader};

#[derive(Debug, Clone)]
pub struct AnalyticsService {
    pub cp: Controlplane,
    pub analytics: Analytics,
}

#[tonic::async_trait]
impl AnalyticsApi for AnalyticsService {
    #[tracing::instrument(skip_all, fields(nm.agent = tracing::field::Empty))]
    async fn get_recommendations(
        &self,
        req: Request<pb::GetRecommendationsRequest>,
    ) -> Result<Response<pb::AgentAnalytics>, Status> {
        // Reading is a viewer's right; `refresh` recomputes and stores: an admin's.
        if req.get_ref().refresh {
            require_admin(&self.cp.keys, &req)?;
        } else {
            require_reader(&self.cp.keys, &req)?;
        }
        let r = req.into_inner();
        tracing::Span::current().record("nm.agent", r.agent.as_str());
        let answer = if r.refresh {
            self.analytics.recompute(&r.agent).await
        } else {
            self.analytics.get(&r.agent).await
        }
        .map_err(to_status)?;
        Ok(Response::new(analytics_to_pb(&answer)))
    }

    async fn recompute(
        &self,
        req: Request<pb::RecomputeRequest>,
    ) -> Result<Response<pb::RecomputeResponse>, Status> {
        let admin = require_admin(&self.cp.keys, &req)?;
        let agent = req.into_inner().agent;
        let results = if agent.trim().is_empty() {
            self.analytics.recompute_all().await
        } else {
            self.analytics.recompute(&agent).await.map(|r| vec![r])
        }
        .map_err(to_status)?;
        info!(by = %admin.id, agents = results.len(), "analytics recomputed on demand");
        Ok(Response::new(pb::RecomputeResponse {
            results: results.iter().map(analytics_to_pb).collect(),
        }))
    }

    async fn get_outcome_rates(
        &self,
        req: Request<pb::GetOutcomeRatesRequest>,
    ) -> Result<Response<pb::OutcomeRates>, Status> {
        require_reader(&self.cp.keys, &req)?;
        let r = req.into_inner();
        let dims = r
            .group_by()
            .map(|d| match d {
                pb::OutcomeDimension::Model => Ok(Dimension::Model),
                pb::OutcomeDimension::Provider => Ok(Dimension::Provider),
                pb::OutcomeDimension::Env => Ok(Dimension::Env),
                pb::OutcomeDimension::Week => Ok(Dimension::Week),
                pb::OutcomeDimension::User => Ok(Dimension::User),
                pb::OutcomeDimension::Unspecified => {
                    Err(Status::invalid_argument("group_by: unspecified dimension"))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (since, until) = range_ms(r.range.as_ref());
        let (window, rows) = self
            .analytics
            .outcome_rates(&r.agent, &dims, since, until, r.limit)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::OutcomeRates {
            agent: r.agent.trim().to_owned(),
            window: Some(window_to_pb(window)),
            rows: rows.iter().map(row_to_pb).collect(),
        }))
    }
}

// === controlplane -> protobuf ===

fn window_to_pb(w: Window) -> pb::TimeRange {
    pb::TimeRange {
        since: Some(ms_to_timestamp(w.since_ms)),
        until: Some(ms_to_timestamp(w.until_ms)),
    }
}

fn interval_to_pb(i: Interval) -> pb::Interval {
    pb::Interval {
        lower: i.lower,
        upper: i.upper,
    }
}

pub fn row_to_pb(r: &OutcomeRow) -> pb::OutcomeRow {
    pb::OutcomeRow {
        key: r
            .key
            .iter()
            .map(|k| pb::UsageKey { value: k.clone() })
            .collect(),
        sessions: r.sessions,
        signals: r.signals,
        successes: r.successes,
        abandoned: r.abandoned,
        regenerated: r.regenerated,
        heavily_edited: r.heavily_edited,
        regenerations: r.regenerations,
        cost_micros: r.cost_micros,
        requests: r.requests,
        success_rate: r.success_rate(),
        abandonment_rate: r.abandonment_rate(),
        regeneration_rate: r.regeneration_rate(),
        heavy_edit_rate: r.heavy_edit_rate(),
        cost_per_success_micros: r.cost_per_success_micros(),
        regenerations_per_success: r.regenerations_per_success(),
    }
}

fn arm_to_pb(a: &Arm) -> pb::EvidenceArm {
    pb::EvidenceArm {
        label: a.label.clone(),
        count: a.count,
        n: a.n,
        rate: a.rate,
        interval: Some(interval_to_pb(a.interval)),
        example_trace_id: a.example_trace_id.clone(),
    }
}

fn recommendation_to_pb(r: &Recommendation) -> pb::Recommendation {
    pb::Recommendation {
        kind: r.kind.as_str().to_owned(),
        message: r.message.clone(),
        subject: r.subject.clone(),
        evidence: r
            .evidence
            .iter()
            .map(|e| pb::Evidence {
                metric: e.metric.clone(),
                a: Some(arm_to_pb(&e.a)),
                b: e.b.as_ref().map(arm_to_pb),
                difference: e.difference,
                difference_interval: e.difference_interval.map(interval_to_pb),
                level: e.level,
                confidence: e.confidence,
                comparisons: e.comparisons,
                p_value: e.p_value,
                prob_b_greater: e.prob_b_greater,
            })
            .collect(),
        figures: r
            .figures
            .iter()
            .map(|f| pb::Figure {
                name: f.name.clone(),
                value: f.value,
            })
            .collect(),
        effect: Some(pb::ExpectedEffect {
            success_rate_change: r.effect.success_rate_change,
            cost_change: r.effect.cost_change,
            cost_per_success_before_micros: r.effect.cost_per_success_before_micros,
            cost_per_success_after_micros: r.effect.cost_per_success_after_micros,
            summary: r.effect.summary.clone(),
        }),
        window: Some(window_to_pb(r.window)),
    }
}

pub fn analytics_to_pb(a: &AgentAnalytics) -> pb::AgentAnalytics {
    let p = &a.progress;
    pb::AgentAnalytics {
        agent: a.agent.clone(),
        status: match a.status {
            AnalyticsStatus::Collecting => pb::AnalyticsStatus::Collecting,
            AnalyticsStatus::Ready => pb::AnalyticsStatus::Ready,
        } as i32,
        computed_at: Some(ms_to_timestamp(a.computed_at_ms)),
        progress: Some(pb::AnalyticsProgress {
            signals: p.signals,
            threshold: p.threshold,
            remaining: p.remaining,
            daily_rate: p.daily_rate,
            eta: p.eta_ms.map(ms_to_timestamp),
            first_signal: p.first_signal_ms.map(ms_to_timestamp),
            last_signal: p.last_signal_ms.map(ms_to_timestamp),
        }),
        window: Some(window_to_pb(a.window)),
        summary: a.summary.as_ref().map(row_to_pb),
        costs: a
            .costs
            .iter()
            .map(|c| pb::OutcomeCost {
                scope: c.scope.as_str().to_owned(),
                name: c.name.clone(),
                sessions: c.sessions,
                successes: c.successes,
                cost_micros: c.cost_micros,
                cost_per_success_micros: c.cost_per_success_micros,
                regenerations_per_success: c.regenerations_per_success,
                success_rate: c.success_rate,
            })
            .collect(),
        recommendations: a.recommendations.iter().map(recommendation_to_pb).collect(),
        evidence: a.evidence.label().to_owned(),
        continued_counts: a.evidence.continued,
        implicit_summary: a.implicit_summary.as_ref().map(row_to_pb),
    }
}

// === protobuf -> controlplane ===

fn window_from_pb(w: Option<&pb::TimeRange>) -> Window {
    let (since, until) = range_ms(w);
    Window {
        since_ms: since.unwrap_or(0),
        until_ms: until.unwrap_or(0),
    }
}

fn interval_from_pb(i: Option<&pb::Interval>) -> Interval {
    i.map_or(
        Interval {
            lower: 0.0,
            upper: 1.0,
        },
        |i| Interval {
            lower: i.lower,
            upper: i.upper,
        },
    )
}

pub fn row_from_pb(r: &pb::OutcomeRow) -> OutcomeRow {
    OutcomeRow {
        key: r.key.iter().map(|k| k.value.clone()).collect(),
        sessions: r.sessions,
        signals: r.signals,
        successes: r.successes,
        abandoned: r.abandoned,
        regenerated: r.regenerated,
        heavily_edited: r.heavily_edited,
        regenerations: r.regenerations,
        cost_micros: r.cost_micros,
        requests: r.requests,
    }
}

fn arm_from_pb(a: &pb::EvidenceArm) -> Arm {
    Arm {
        label: a.label.clone(),
        count: a.count,
        n: a.n,
        rate: a.rate,
        interval: interval_from_pb(a.interval.as_ref()),
        example_trace_id: a.example_trace_id.clone(),
    }
}

fn recommendation_from_pb(r: &pb::Recommendation) -> Option<Recommendation> {
    let effect = r.effect.clone().unwrap_or_default();
    Some(Recommendation {
        // A kind this CLI does not know (a newer server) is left out.
        kind: Kind::parse(&r.kind)?,
        message: r.message.clone(),
        subject: r.subject.clone(),
        evidence: r
            .evidence
            .iter()
            .map(|e| EvidenceItem {
                metric: e.metric.clone(),
                a: e.a.as_ref().map(arm_from_pb).unwrap_or_else(|| Arm {
                    label: String::new(),
                    count: 0,
                    n: 0,
                    rate: 0.0,
                    interval: interval_from_pb(None),
                    example_trace_id: None,
                }),
                b: e.b.as_ref().map(arm_from_pb),
                difference: e.difference,
                difference_interval: e
                    .difference_interval
                    .as_ref()
                    .map(|i| interval_from_pb(Some(i))),
                level: e.level,
                confidence: e.confidence,
                comparisons: e.comparisons,
                p_value: e.p_value,
                prob_b_greater: e.prob_b_greater,
            })
            .collect(),
        figures: r
            .figures
            .iter()
            .map(|f| Figure {
                name: f.name.clone(),
                value: f.value,
            })
            .collect(),
        effect: Effect {
            success_rate_change: effect.success_rate_change,
            cost_change: effect.cost_change,
            cost_per_success_before_micros: effect.cost_per_success_before_micros,
            cost_per_success_after_micros: effect.cost_per_success_after_micros,
            summary: effect.summary,
        },
        window: window_from_pb(r.window.as_ref()),
    })
}

pub fn analytics_from_pb(a: &pb::AgentAnalytics) -> AgentAnalytics {
    let p = a.progress.unwrap_or_default();
    AgentAnalytics {
        agent: a.agent.clone(),
        status: match a.status() {
            pb::AnalyticsStatus::Ready => AnalyticsStatus::Ready,
            pb::AnalyticsStatus::Collecting | pb::AnalyticsStatus::Unspecified => {
                AnalyticsStatus::Collecting
            }
        },
        computed_at_ms: a.computed_at.as_ref().map_or(0, timestamp_to_ms),
        progress: Progress {
            signals: p.signals,
            threshold: p.threshold,
            remaining: p.remaining,
            daily_rate: p.daily_rate,
            eta_ms: p.eta.as_ref().map(timestamp_to_ms),
            first_signal_ms: p.first_signal.as_ref().map(timestamp_to_ms),
            last_signal_ms: p.last_signal.as_ref().map(timestamp_to_ms),
        },
        window: window_from_pb(a.window.as_ref()),
        summary: a.summary.as_ref().map(row_from_pb),
        costs: a
            .costs
            .iter()
            .filter_map(|c| {
                Some(OutcomeCost {
                    scope: match c.scope.as_str() {
                        "agent" => CostScope::Agent,
                        "model" => CostScope::Model,
                        "user" => CostScope::User,
                        _ => return None,
                    },
                    name: c.name.clone(),
                    sessions: c.sessions,
                    successes: c.successes,
                    cost_micros: c.cost_micros,
                    cost_per_success_micros: c.cost_per_success_micros,
                    regenerations_per_success: c.regenerations_per_success,
                    success_rate: c.success_rate,
                })
            })
            .collect(),
        recommendations: a
            .recommendations
            .iter()
            .filter_map(recommendation_from_pb)
            .collect(),
        evidence: Evidence {
            implicit: a.evidence
                == Evidence {
                    implicit: true,
                    continued: false,
                }
                .label(),
            continued: a.continued_counts,
        },
        implicit_summary: a.implicit_summary.as_ref().map(row_from_pb),
    }
}
