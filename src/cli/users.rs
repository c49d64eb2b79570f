//! `nm-gateway users forget USER`: end-user erasure over gRPC (`nm.v1.Users`).

use std::io::Write;

use anyhow::Context;
use serde_json::json;

use super::admin_channel;
use crate::config::Settings;
use crate::grpc::pb::{self, users_client::UsersClient};

/// `nm-gateway users <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum UsersCommand {
    /// Replace every stored occurrence of an end user's NM-User value by an irreversible token
    /// and remove it from the database files; the user's own budget is deleted. A second call
    /// changes nothing.
    Forget {
        /// The NM-User value.
        user: String,
        /// Print JSON instead of a line of text.
        #[arg(long)]
        json: bool,
    },
}

pub async fn users(
    settings: &Settings,
    command: UsersCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let UsersCommand::Forget { user, json } = command;
    let mut client = UsersClient::new(admin_channel(settings)?);
    let done = client
        .forget_user(pb::ForgetUserRequest { user })
        .await
        .context("ForgetUser")?
        .into_inner();
    if json {
        let v = json!({
            "token": done.token,
            "rows": done.rows,
            "records": done.records,
            "budgets": done.budgets,
        });
        writeln!(out, "{v}")?;
    } else if done.rows == 0 {
        writeln!(
            out,
            "nothing stored names this user (already forgotten, or never seen); token {}",
            done.token
        )?;
    } else {
        writeln!(
            out,
            "forgotten: {} rows now name {} ({} request records, {} budget deleted)",
            done.rows, done.token, done.records, done.budgets
        )?;
    }
    Ok(())
}
