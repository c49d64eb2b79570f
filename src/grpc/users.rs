//! `nm.v1.Users`: end-user erasure (`nm_controlplane::forget`), mapping only.

use nm_controlplane::Controlplane;
use tonic::{Request, Response, Status};
use tracing::info;

use super::pb::{self, users_server::Users as UsersApi};
use super::require_admin;
use super::status::to_status;

#[derive(Debug, Clone)]
pub struct UsersService(pub Controlplane);

#[tonic::async_trait]
impl UsersApi for UsersService {
    async fn forget_user(
        &self,
        req: Request<pb::ForgetUserRequest>,
    ) -> Result<Response<pb::ForgetUserResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let user = req.into_inner().user;
        let done = self
            .0
            .users
            .forget(&admin.id, &user)
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, token = %done.token, rows = done.rows, "end user forgotten over gRPC");
        Ok(Response::new(pb::ForgetUserResponse {
            token: done.token,
            rows: done.rows,
            records: done.records,
            budgets: done.budgets,
        }))
    }
}
