//! End-user erasure (`nm-gateway users forget USER`): every stored occurrence of an `NM-User`
//! value is replaced by an irreversible token, `fgt_` and 32 hex digits of an HMAC-SHA-256 of
//! the value under a secret the controlplane generated and keeps (`controlplane_secrets`). The
//! same user always maps to the same token, so the totals and the per-user groups stay whole;
//! the value cannot be read back from the token without the secret.
//!
//! One write transaction replaces it in the request records, sessions, signals (their user
//! column, and their custom labels where a label names the user as a JSON string), the
//! analytics' session rollups, the usage rollups and the daily spend (merged into the token's
//! rows), the audit trail and the alert events (where the user is named as a JSON string or
//! as `user:<id>`); the user's own budget is deleted (`budgets::forget_user`), so a user coming
//! back under the same id starts afresh under the default budget. An audit row
//! (`user.forget`, target the token) records the counts. A second call finds nothing and
//! changes nothing.
//!
//! **Bytes on disk.** SQLite: the transaction runs with `secure_delete` on (the freed space of
//! every changed row is overwritten with zeros), then the write-ahead log is checkpointed and
//! truncated, so neither the database file nor its `-wal` holds the value. PostgreSQL: the old
//! row versions are dead tuples until vacuumed; the touched tables are vacuumed after the
//! transaction (their space is reused; a `VACUUM FULL` rewrites them, see
//! docs/data-lifecycle.md).

use std::time::Duration;

use sea_orm::{ConnectionTrait, DatabaseBackend};
use serde_json::json;

use crate::error::{Error, Result};
use crate::sql::Sql;
use crate::store::Store;

const SECRET_NAME: &str = "user_token_key";

/// What one call changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// The token that now stands for the user.
    pub token: String,
    /// Rows changed, in all tables.
    pub rows: u64,
    pub records: u64,
    pub budgets: u64,
}

#[derive(Debug, Clone)]
pub struct Users {
    store: Store,
    budgets: crate::Budgets,
}

impl Users {
    pub fn new(store: Store, budgets: crate::Budgets) -> Self {
        Self { store, budgets }
    }

    /// The token of `user`: the same for the same user, not reversible without the secret.
    pub fn token<'a>(&'a self, user: &'a str) -> crate::BoxFuture<'a, Result<String>> {
        Box::pin(async move {
            let secret = self.secret().await?;
            let mac = nm_types::hmac_sha256(secret.as_bytes(), user.as_bytes());
            let hex: String = mac[..16].iter().map(|b| format!("{b:02x}")).collect();
            Ok(format!("fgt_{hex}"))
        })
    }

    /// The secret, made at first use.
    async fn secret(&self) -> Result<String> {
        let db = self.store.conn();
        let backend = db.get_database_backend();
        let read = || {
            let mut sql = Sql::new(
                backend,
                "SELECT value FROM controlplane_secrets WHERE name = ",
            );
            sql.bind(SECRET_NAME);
            sql.build()
        };
        if let Some(row) = db.query_one_raw(read()).await? {
            return Ok(row.try_get("", "value")?);
        }
        let fresh: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        let txn = self.store.begin_write().await?;
        let mut sql = Sql::new(
            backend,
            "INSERT INTO controlplane_secrets (name, value, created_at_ms) VALUES (",
        );
        sql.bind(SECRET_NAME)
            .push(", ")
            .bind(fresh)
            .push(", ")
            .bind(crate::now_ms())
            .push(") ON CONFLICT (name) DO NOTHING");
        txn.execute_raw(sql.build()).await?;
        txn.commit().await?;
        // Whoever inserted first wins.
        let row = db
            .query_one_raw(read())
            .await?
            .ok_or_else(|| Error::Unavailable("secret not stored".to_owned()))?;
        Ok(row.try_get("", "value")?)
    }

    /// Replaces `user` by its token everywhere (see the module's comment). `actor`: the admin
    /// key's id, for the audit row.
    pub fn forget<'a>(
        &'a self,
        actor: &'a str,
        user: &'a str,
    ) -> crate::BoxFuture<'a, Result<Forgotten>> {
        Box::pin(async move {
            let user = nm_types::parse_user(user)
                .map_err(|e| Error::InvalidArgument(format!("user: {e}")))?;
            let token = self.token(&user).await?;
            if token == user {
                return Ok(Forgotten {
                    token,
                    ..Default::default()
                });
            }
            let sqlite = self.store.backend() == DatabaseBackend::Sqlite;
            let txn = self.store.begin_write().await?;
            if sqlite {
                txn.execute_unprepared("PRAGMA secure_delete = ON").await?;
            }
            let backend = txn.get_database_backend();
            let mut out = Forgotten {
                token: token.clone(),
                ..Default::default()
            };
            let rename = |table: &str| {
                let mut sql = Sql::new(backend, &format!("UPDATE {table} SET user_id = "));
                sql.bind(token.clone())
                    .push(" WHERE user_id = ")
                    .bind(user.clone());
                sql.build()
            };
            out.records = txn.execute_raw(rename("requests")).await?.rows_affected();
            out.rows += out.records;
            for table in ["sessions", "signals", "session_rollups"] {
                out.rows += txn.execute_raw(rename(table)).await?.rows_affected();
            }
            out.rows += merge_usage_rollups(&txn, &user, &token).await?;
            let (rows, budgets) = crate::budgets::forget_user(&txn, &user, &token).await?;
            out.rows += rows;
            out.budgets = budgets;
            // Free text that may name the user: as a JSON string, or as a budget subject.
            let quoted = |v: &str| serde_json::Value::String(v.to_owned()).to_string();
            let names = [
                (quoted(&user), quoted(&token)),
                (format!("user:{user}"), format!("user:{token}")),
            ];
            for (table, column) in [
                ("signals", "custom_label"),
                ("audit_events", "target"),
                ("audit_events", "before_json"),
                ("audit_events", "after_json"),
                ("alert_events", "data"),
                ("alert_events", "dedupe"),
            ] {
                for (from, to) in &names {
                    out.rows += txn
                        .execute_raw(replace(backend, table, column, from, to))
                        .await?
                        .rows_affected();
                }
            }
            if out.rows > 0 {
                let change = crate::audit::Change {
                    actor,
                    action: "user.forget",
                    target: &format!("user:{token}"),
                    before: None,
                    after: Some(
                        json!({"rows": out.rows, "records": out.records, "budgets": out.budgets}),
                    ),
                };
                crate::audit::record(&txn, change, crate::now_ms()).await?;
            }
            if sqlite {
                txn.execute_unprepared("PRAGMA secure_delete = OFF").await?;
            }
            txn.commit().await?;
            if out.rows == 0 {
                return Ok(out);
            }
            self.budgets.forget_user_in_memory(&user);
            self.wipe_old_versions().await;
            tracing::info!(rows = out.rows, token = %token, "end user forgotten");
            Ok(out)
        })
    }

    /// The old versions of the changed rows: SQLite's write-ahead log checkpointed into the
    /// file and truncated (retried while readers hold it); PostgreSQL's tables vacuumed.
    /// Failures are logged: the data is replaced either way.
    async fn wipe_old_versions(&self) {
        let db = self.store.conn();
        if db.get_database_backend() == DatabaseBackend::Sqlite {
            for _ in 0..50 {
                let stmt = sea_orm::Statement::from_string(
                    DatabaseBackend::Sqlite,
                    "PRAGMA wal_checkpoint(TRUNCATE)",
                );
                match db.query_one_raw(stmt).await {
                    Ok(Some(row)) if row.try_get_by_index::<i64>(0).unwrap_or(1) == 0 => return,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "forget: WAL checkpoint failed");
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tracing::warn!("forget: the WAL is still read; it is truncated at a later checkpoint");
            return;
        }
        let tables = "requests, sessions, signals, session_rollups, usage_rollups, user_spend, \
                      budgets, audit_events, alert_events";
        if let Err(e) = db.execute_unprepared(&format!("VACUUM {tables}")).await {
            tracing::warn!(error = %e, "forget: VACUUM failed");
        }
    }
}

/// `UPDATE table SET column = REPLACE(column, from, to)` where the column holds `from`.
fn replace(
    backend: DatabaseBackend,
    table: &str,
    column: &str,
    from: &str,
    to: &str,
) -> sea_orm::Statement {
    let find = match backend {
        DatabaseBackend::Postgres => "strpos",
        _ => "instr",
    };
    let mut sql = Sql::new(
        backend,
        &format!("UPDATE {table} SET {column} = REPLACE({column}, "),
    );
    sql.bind(from.to_owned())
        .push(", ")
        .bind(to.to_owned())
        .push(&format!(") WHERE {find}({column}, "))
        .bind(from.to_owned())
        .push(") > 0");
    sql.build()
}

/// The user's usage rollups added to the token's, then deleted.
async fn merge_usage_rollups(txn: &impl ConnectionTrait, user: &str, token: &str) -> Result<u64> {
    use crate::usage::totals::{MEASURE_COLUMNS, add_on_conflict};
    let backend = txn.get_database_backend();
    let cols = MEASURE_COLUMNS.join(", ");
    let mut sql = Sql::new(
        backend,
        &format!(
            "INSERT INTO usage_rollups (day, agent, user_id, env, provider, model, key_id, {cols}) \
             SELECT day, agent, "
        ),
    );
    sql.bind(token.to_owned())
        .push(&format!(
            ", env, provider, model, key_id, {cols} FROM usage_rollups WHERE user_id = "
        ))
        .bind(user.to_owned())
        .push(&add_on_conflict());
    txn.execute_raw(sql.build()).await?;
    let mut del = Sql::new(backend, "DELETE FROM usage_rollups WHERE user_id = ");
    del.bind(user.to_owned());
    Ok(txn.execute_raw(del.build()).await?.rows_affected())
}
