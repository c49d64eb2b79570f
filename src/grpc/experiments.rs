//! `nm.v1.Experiments`: experiments over gRPC, and their protobuf <-> domain mapping. Changes
//! need an admin key, reads (list, get, history) an admin or viewer key. The rules are
//! `nm_controlplane::experiments`; this adapter only maps, and checks arms against the
//! providers of the process it runs in ([`Catalogue`], from the root's provider settings).

use std::sync::Arc;

use nm_controlplane::Controlplane;
use nm_controlplane::experiments::{
    ArmSpec, Catalogue, Event, Evidence, Experiment, ExperimentArm, ListFilter, NewExperiment,
};
use nm_types::Env;
use tonic::{Request, Response, Status};

use super::convert::ms_to_timestamp;
use super::pb::experiments_server::Experiments as ExperimentsApi;
use super::{pb, require_admin, require_reader, status::to_status};

#[derive(Debug, Clone)]
pub struct ExperimentsService {
    pub cp: Controlplane,
    /// The providers arms may name.
    pub providers: Arc<Catalogue>,
}

impl ExperimentsService {
    /// A state change by an admin: `change(experiments, actor, id, reason)`.
    async fn act(
        &self,
        req: Request<pb::ExperimentActionRequest>,
        change: impl AsyncFnOnce(
            &nm_controlplane::Experiments,
            &str,
            &str,
            &str,
        ) -> nm_controlplane::error::Result<Experiment>,
    ) -> Result<Response<pb::Experiment>, Status> {
        let admin = require_admin(&self.cp.keys, &req)?;
        let r = req.into_inner();
        let e = change(&self.cp.experiments, &admin.id, r.id.trim(), &r.reason)
            .await
            .map_err(to_status)?;
        Ok(Response::new(experiment_to_pb(&e)))
    }
}

#[tonic::async_trait]
impl ExperimentsApi for ExperimentsService {
    async fn create_experiment(
        &self,
        req: Request<pb::CreateExperimentRequest>,
    ) -> Result<Response<pb::Experiment>, Status> {
        let admin = require_admin(&self.cp.keys, &req)?;
        let r = req.into_inner();
        let new = NewExperiment {
            agent: r.agent,
            env: r.env,
            arms: r
                .arms
                .into_iter()
                .map(|a| ArmSpec {
                    name: a.name,
                    provider: a.provider,
                    model: a.model,
                    weight: a.weight,
                })
                .collect(),
            unit: r.unit,
            guardrails: r.guardrails,
            max_sessions: r.max_sessions,
            max_days: r.max_days,
            auto_promote: r.auto_promote,
            auto_rollback: r.auto_rollback,
            description: r.description,
        };
        let e = self
            .cp
            .experiments
            .create(&admin.id, new, &self.providers)
            .await
            .map_err(to_status)?;
        Ok(Response::new(experiment_to_pb(&e)))
    }

    async fn list_experiments(
        &self,
        req: Request<pb::ListExperimentsRequest>,
    ) -> Result<Response<pb::ListExperimentsResponse>, Status> {
        require_reader(&self.cp.keys, &req)?;
        let r = req.into_inner();
        let list = self
            .cp
            .experiments
            .list(&ListFilter {
                agent: r.agent,
                state: r.state,
            })
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListExperimentsResponse {
            experiments: list.iter().map(experiment_to_pb).collect(),
        }))
    }

    async fn get_experiment(
        &self,
        req: Request<pb::GetExperimentRequest>,
    ) -> Result<Response<pb::ExperimentReport>, Status> {
        require_reader(&self.cp.keys, &req)?;
        let id = req.into_inner().id;
        let e = self
            .cp
            .experiments
            .get(id.trim())
            .await
            .map_err(to_status)?;
        let evidence = self
            .cp
            .experiments
            .evidence(&e, nm_controlplane::now_ms())
            .await
            .map_err(to_status)?;
        Ok(Response::new(report_to_pb(&e, &evidence)))
    }

    async fn pause_experiment(
        &self,
        req: Request<pb::ExperimentActionRequest>,
    ) -> Result<Response<pb::Experiment>, Status> {
        self.act(req, async |x, actor, id, reason| {
            x.pause(actor, id, reason).await
        })
        .await
    }

    async fn resume_experiment(
        &self,
        req: Request<pb::ExperimentActionRequest>,
    ) -> Result<Response<pb::Experiment>, Status> {
        self.act(req, async |x, actor, id, reason| {
            x.resume(actor, id, reason).await
        })
        .await
    }

    async fn stop_experiment(
        &self,
        req: Request<pb::ExperimentActionRequest>,
    ) -> Result<Response<pb::Experiment>, Status> {
        self.act(req, async |x, actor, id, reason| {
            x.stop(actor, id, reason).await
        })
        .await
    }

    async fn promote_experiment(
        &self,
        req: Request<pb::PromoteExperimentRequest>,
    ) -> Result<Response<pb::Experiment>, Status> {
        let admin = require_admin(&self.cp.keys, &req)?;
        let r = req.into_inner();
        let e = self
            .cp
            .experiments
            .promote(&admin.id, r.id.trim(), &r.arm, &r.reason)
            .await
            .map_err(to_status)?;
        Ok(Response::new(experiment_to_pb(&e)))
    }

    async fn rollback_arm(
        &self,
        req: Request<pb::RollbackArmRequest>,
    ) -> Result<Response<pb::Experiment>, Status> {
        let admin = require_admin(&self.cp.keys, &req)?;
        let r = req.into_inner();
        if r.arm.trim().is_empty() {
            return Err(Status::invalid_argument("arm: name the arm to roll back"));
        }
        let e = self
            .cp
            .experiments
            .rollback(&admin.id, r.id.trim(), &r.arm, &r.reason)
            .await
            .map_err(to_status)?;
        Ok(Response::new(experiment_to_pb(&e)))
    }

    async fn list_experiment_events(
        &self,
        req: Request<pb::ListExperimentEventsRequest>,
    ) -> Result<Response<pb::ListExperimentEventsResponse>, Status> {
        require_reader(&self.cp.keys, &req)?;
        let id = req.into_inner().id;
        let events = self
            .cp
            .experiments
            .history(id.trim())
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListExperimentEventsResponse {
            events: events.into_iter().map(event_to_pb).collect(),
        }))
    }
}

// === mapping ===

pub fn arm_to_pb(a: &ExperimentArm) -> pb::ExperimentArm {
    pb::ExperimentArm {
        name: a.name.clone(),
        provider: a.provider.clone(),
        model: a.model.clone(),
        weight: a.weight,
        rolled_back: a.rolled_back,
    }
}

/// An experiment as the API shows it (never its salt).
pub fn experiment_to_pb(e: &Experiment) -> pb::Experiment {
    pb::Experiment {
        id: e.id.clone(),
        agent: e.agent.clone(),
        env: e.env.map(|env| Env::as_str(env).to_owned()),
        state: e.state.as_str().to_owned(),
        arms: e.arms.iter().map(arm_to_pb).collect(),
        unit: e.unit.as_str().to_owned(),
        guardrails: e.guardrails.iter().map(|g| g.as_str().to_owned()).collect(),
        max_sessions: e.max_sessions.unwrap_or(0),
        max_days: e.max_days.unwrap_or(0),
        auto_promote: e.auto_promote,
        auto_rollback: e.auto_rollback,
        description: e.description.clone(),
        created_at: Some(ms_to_timestamp(e.created_at_ms)),
        updated_at: Some(ms_to_timestamp(e.updated_at_ms)),
        winner: e.winner.clone(),
        reason: e.reason.clone(),
        promoted: e.promoted,
    }
}

/// The experiment with what `requests` counts per arm. The evidence (judged units, successes,
/// intervals, guardrails, summary, units to a decision) is the evaluation's to fill.
pub fn report_to_pb(e: &Experiment, ev: &Evidence) -> pb::ExperimentReport {
    pb::ExperimentReport {
        experiment: Some(experiment_to_pb(e)),
        arms: e
            .arms
            .iter()
            .zip(&ev.counts)
            .enumerate()
            .map(|(i, (a, c))| {
                let judged = ev.arm(i);
                pb::ArmReport {
                    arm: Some(arm_to_pb(a)),
                    sessions: c.sessions,
                    requests: c.requests,
                    signals: c.signals,
                    judged: c.judged,
                    successes: c.successes,
                    success_rate: judged.map_or(0.0, |j| j.rate),
                    success_interval: judged.map(|j| pb::Interval {
                        lower: j.interval.lower,
                        upper: j.interval.upper,
                    }),
                    cost_micros: c.cost_micros,
                    cost_per_success_micros: judged.and_then(|j| j.cost_per_success_micros),
                    guardrails: judged
                        .map(|j| {
                            j.guardrails
                                .iter()
                                .map(|(g, value, status)| pb::GuardrailReport {
                                    name: g.as_str().to_owned(),
                                    value: *value,
                                    status: status.name().to_owned(),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                }
            })
            .collect(),
        summary: ev.evaluation.summary.clone(),
        units_to_decision: ev.evaluation.units_to_decision,
    }
}

pub fn event_to_pb(e: Event) -> pb::ExperimentEvent {
    pb::ExperimentEvent {
        at: Some(ms_to_timestamp(e.at_ms)),
        kind: e.kind,
        arm: e.arm,
        actor: e.actor,
        detail: e.detail,
    }
}
