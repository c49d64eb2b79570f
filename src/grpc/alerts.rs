//! `nm.v1.Alerts`: webhooks and their deliveries (`nm_controlplane::alerts`), mapping only.

use nm_controlplane::Controlplane;
use nm_controlplane::alerts::{Delivery, Format, Kind, Webhook};
use tonic::{Request, Response, Status};

use super::convert::ms_to_timestamp;
use super::pb::{self, alerts_server::Alerts as AlertsApi};
use super::status::to_status;
use super::{require_admin, require_reader};

#[derive(Debug, Clone)]
pub struct AlertsService(pub Controlplane);

#[tonic::async_trait]
impl AlertsApi for AlertsService {
    async fn add_webhook(
        &self,
        req: Request<pb::AddWebhookRequest>,
    ) -> Result<Response<pb::AddWebhookResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        let kinds = r
            .kinds
            .iter()
            .map(|k| {
                Kind::parse(k).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "kinds: {k:?} is not one of {}",
                        Kind::ALL.map(Kind::as_str).join(", ")
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let format = match r.format.as_str() {
            "" | "json" => Format::Json,
            "slack" => Format::Slack,
            other => {
                return Err(Status::invalid_argument(format!(
                    "format: {other:?} is not json or slack"
                )));
            }
        };
        let added = self
            .0
            .alerts
            .add(&admin.id, &r.url, &kinds, format, &r.description)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::AddWebhookResponse {
            webhook: Some(webhook(added.webhook)),
            secret: added.secret,
        }))
    }

    async fn list_webhooks(
        &self,
        req: Request<pb::ListWebhooksRequest>,
    ) -> Result<Response<pb::ListWebhooksResponse>, Status> {
        require_reader(&self.0.keys, &req)?;
        let webhooks = self.0.alerts.list().await.map_err(to_status)?;
        Ok(Response::new(pb::ListWebhooksResponse {
            webhooks: webhooks.into_iter().map(webhook).collect(),
        }))
    }

    async fn remove_webhook(
        &self,
        req: Request<pb::RemoveWebhookRequest>,
    ) -> Result<Response<pb::Webhook>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let id = req.into_inner().id;
        let removed = self
            .0
            .alerts
            .remove(&admin.id, &id)
            .await
            .map_err(to_status)?;
        Ok(Response::new(webhook(removed)))
    }

    async fn test_webhook(
        &self,
        req: Request<pb::TestWebhookRequest>,
    ) -> Result<Response<pb::TestWebhookResponse>, Status> {
        require_admin(&self.0.keys, &req)?;
        let id = req.into_inner().id;
        let event_id = self.0.alerts.test(&id).await.map_err(to_status)?;
        Ok(Response::new(pb::TestWebhookResponse { event_id }))
    }

    async fn list_deliveries(
        &self,
        req: Request<pb::ListDeliveriesRequest>,
    ) -> Result<Response<pb::ListDeliveriesResponse>, Status> {
        require_reader(&self.0.keys, &req)?;
        let r = req.into_inner();
        let limit = if r.limit == 0 {
            100
        } else {
            u64::from(r.limit)
        };
        let webhook = Some(r.webhook_id.as_str()).filter(|w| !w.is_empty());
        let deliveries = self
            .0
            .alerts
            .deliveries(webhook, limit)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListDeliveriesResponse {
            deliveries: deliveries.into_iter().map(delivery).collect(),
        }))
    }
}

fn webhook(w: Webhook) -> pb::Webhook {
    pb::Webhook {
        id: w.id,
        url: w.url,
        kinds: w.kinds.iter().map(|k| k.as_str().to_owned()).collect(),
        format: w.format.as_str().to_owned(),
        description: w.description,
        created_at: Some(ms_to_timestamp(w.created_at_ms)),
    }
}

fn delivery(d: Delivery) -> pb::Delivery {
    pb::Delivery {
        event_id: d.event_id,
        webhook_id: d.webhook_id,
        kind: d.kind,
        event_at: Some(ms_to_timestamp(d.event_at_ms)),
        state: d.state,
        attempts: d.attempts,
        last_status: d.last_status.map(u32::from),
        last_error: d.last_error,
        next_attempt_at: d.next_at_ms.map(ms_to_timestamp),
        updated_at: Some(ms_to_timestamp(d.updated_at_ms)),
    }
}

/// Keeps the one list of kinds the proto's comment names in step with the controlplane's.
#[cfg(test)]
mod tests {
    #[test]
    fn every_kind_is_named_in_the_proto() {
        let proto = include_str!("../../proto/nm/v1/admin.proto");
        for k in nm_controlplane::alerts::Kind::ALL {
            assert!(
                proto.contains(&format!("`{}`", k.as_str())),
                "{}",
                k.as_str()
            );
        }
    }
}
