//! Schema migrations, run at start on SQLite and PostgreSQL alike. Never edit a migration that
//! has shipped: add a new one, in its own module, with its own explicit name (sea-orm's derived
//! names come from the file name, which all migrations here share).
//!
//! Times are stored as integer milliseconds since the Unix epoch: range filters and day buckets
//! are then plain integer arithmetic on both databases.

use super::migrate::prelude::*;

pub struct Migrator;

impl Migrator {
    /// Applies the migrations up to and including the one named `name`, no further: a database
    /// as an older version left it, for the tests of an upgrade.
    pub async fn up_through(db: &sea_orm::DatabaseConnection, name: &str) -> Result<(), DbErr> {
        let Some(at) = Self::migrations().iter().position(|m| m.name() == name) else {
            return Err(DbErr::Custom(format!("no migration named {name}")));
        };
        let steps = <u32 as TryFrom<usize>>::try_from(at + 1).unwrap_or(u32::MAX);
        Self::up(db, Some(steps)).await
    }
}

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m0001_keys_requests_sessions::Migration),
            Box::new(m0002_signals::Migration),
            Box::new(m0003_usage_budgets::Migration),
            Box::new(m0004_unpriced_index::Migration),
            Box::new(m0005_analytics::Migration),
            Box::new(m0006_session_rollups::Migration),
            Box::new(m0007_trace_ids::Migration),
            Box::new(m0008_signal_request_id::Migration),
            Box::new(m0009_signal_source::Migration),
            Box::new(m0010_key_scopes_audit::Migration),
            Box::new(m0011_experiments::Migration),
            Box::new(m0012_budget_scopes::Migration),
            Box::new(m0013_alerts::Migration),
            Box::new(m0101_write_probe::Migration),
            Box::new(m0014_usage_rollups::Migration),
            Box::new(m0015_secrets::Migration),
            Box::new(m0016_signals_by_time::Migration),
            Box::new(m0017_partitions::Migration),
            Box::new(m0018_signal_rollups::Migration),
            Box::new(m0019_traced_requests::Migration),
            Box::new(m0020_implicit_rollups::Migration),
            Box::new(m0021_signal_counts::Migration),
            Box::new(m0022_latency_totals::Migration),
            Box::new(m0023_usage_day_totals::Migration),
            Box::new(m0024_partial_request_indexes::Migration),
        ]
    }
}

#[derive(DeriveIden)]
enum ApiKeys {
    Table,
    Id,
    Name,
    HashHex,
    DisplayPrefix,
    Admin,
    CreatedAtMs,
    RevokedAtMs,
}

#[derive(DeriveIden)]
enum Requests {
    Table,
    RequestId,
    StartedAtMs,
    KeyId,
    Provider,
    Method,
    Path,
    Model,
    Agent,
    SessionId,
    Env,
    UserId,
    Status,
    LatencyMs,
    TtfbMs,
    Streamed,
    ErrorCode,
    ResponseBytes,
    AnsweredModel,
    InputTokens,
    OutputTokens,
    CachedInputTokens,
    CacheWriteTokens,
    ReasoningTokens,
    FinishReason,
    CostMicros,
    UsageStatus,
}

#[derive(DeriveIden)]
enum UserSpend {
    Table,
    UserId,
    Day,
    CostMicros,
    Requests,
}

#[derive(DeriveIden)]
enum Budgets {
    Table,
    Subject,
    LimitMicros,
    Period,
    RequestsPerMinute,
    UpdatedAtMs,
}

#[derive(DeriveIden)]
enum Sessions {
    Table,
    SessionId,
    Agent,
    Env,
    UserId,
    FirstSeenMs,
    LastSeenMs,
    RequestCount,
}

#[derive(DeriveIden)]
enum Signals {
    Table,
    Id,
    ReceivedAtMs,
    SessionId,
    Action,
    EditDistance,
    CustomLabel,
    KeyId,
    IdempotencyKey,
    AgentHint,
    Agent,
    Env,
    UserId,
    AttributedBySession,
}

mod m0002_signals {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0002_signals"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.create_table(
                Table::create()
                    .table(Signals::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(Signals::Id)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(Signals::ReceivedAtMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(Signals::SessionId).string().not_null())
                    .col(ColumnDef::new(Signals::Action).string().not_null())
                    .col(ColumnDef::new(Signals::EditDistance).big_integer().null())
                    .col(ColumnDef::new(Signals::CustomLabel).text().null())
                    .col(ColumnDef::new(Signals::KeyId).string().not_null())
                    .col(ColumnDef::new(Signals::IdempotencyKey).string().null())
                    .col(ColumnDef::new(Signals::AgentHint).string().null())
                    .col(ColumnDef::new(Signals::Agent).string().null())
                    .col(ColumnDef::new(Signals::Env).string().null())
                    .col(ColumnDef::new(Signals::UserId).string().null())
                    .col(
                        ColumnDef::new(Signals::AttributedBySession)
                            .boolean()
                            .not_null(),
                    )
                    .to_owned(),
            )
            .await?;
            // Counts per agent (optionally per env) over a time range.
            m.create_index(
                Index::create()
                    .name("idx_signals_agent_time")
                    .table(Signals::Table)
                    .col(Signals::Agent)
                    .col(Signals::ReceivedAtMs)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
            // Re-attribution when a session's first request arrives; one session's signals.
            m.create_index(
                Index::create()
                    .name("idx_signals_session")
                    .table(Signals::Table)
                    .col(Signals::SessionId)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
            // A retried signal (same key, same Idempotency-Key) is stored once. NULLs never
            // conflict, so signals without the header are unaffected.
            m.create_index(
                Index::create()
                    .name("idx_signals_idempotency")
                    .table(Signals::Table)
                    .col(Signals::KeyId)
                    .col(Signals::IdempotencyKey)
                    .unique()
                    .if_not_exists()
                    .to_owned(),
            )
            .await
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.drop_table(Table::drop().table(Signals::Table).to_owned())
                .await
        }
    }
}

mod m0001_keys_requests_sessions {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0001_keys_requests_sessions"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.create_table(
                Table::create()
                    .table(ApiKeys::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(ApiKeys::Id)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(ColumnDef::new(ApiKeys::Name).string().not_null())
                    .col(
                        ColumnDef::new(ApiKeys::HashHex)
                            .string()
                            .not_null()
                            .unique_key(),
                    )
                    .col(ColumnDef::new(ApiKeys::DisplayPrefix).string().not_null())
                    .col(ColumnDef::new(ApiKeys::Admin).boolean().not_null())
                    .col(
                        ColumnDef::new(ApiKeys::CreatedAtMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(ApiKeys::RevokedAtMs).big_integer().null())
                    .to_owned(),
            )
            .await?;

            m.create_table(
                Table::create()
                    .table(Requests::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(Requests::RequestId)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(Requests::StartedAtMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(Requests::KeyId).string().not_null())
                    .col(ColumnDef::new(Requests::Provider).string().not_null())
                    .col(ColumnDef::new(Requests::Method).string().not_null())
                    .col(ColumnDef::new(Requests::Path).text().not_null())
                    .col(ColumnDef::new(Requests::Model).string().null())
                    .col(ColumnDef::new(Requests::Agent).string().null())
                    .col(ColumnDef::new(Requests::SessionId).string().null())
                    .col(ColumnDef::new(Requests::Env).string().null())
                    .col(ColumnDef::new(Requests::UserId).string().null())
                    .col(ColumnDef::new(Requests::Status).integer().not_null())
                    .col(ColumnDef::new(Requests::LatencyMs).big_integer().not_null())
                    .col(ColumnDef::new(Requests::TtfbMs).big_integer().null())
                    .col(ColumnDef::new(Requests::Streamed).boolean().not_null())
                    .col(ColumnDef::new(Requests::ErrorCode).string().null())
                    .col(
                        ColumnDef::new(Requests::ResponseBytes)
                            .big_integer()
                            .not_null(),
                    )
                    .to_owned(),
            )
            .await?;
            m.create_index(
                Index::create()
                    .name("idx_requests_session")
                    .table(Requests::Table)
                    .col(Requests::SessionId)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
            m.create_index(
                Index::create()
                    .name("idx_requests_agent_time")
                    .table(Requests::Table)
                    .col(Requests::Agent)
                    .col(Requests::StartedAtMs)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
            m.create_index(
                Index::create()
                    .name("idx_requests_time")
                    .table(Requests::Table)
                    .col(Requests::StartedAtMs)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;

            m.create_table(
                Table::create()
                    .table(Sessions::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(Sessions::SessionId)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(ColumnDef::new(Sessions::Agent).string().null())
                    .col(ColumnDef::new(Sessions::Env).string().null())
                    .col(ColumnDef::new(Sessions::UserId).string().null())
                    .col(
                        ColumnDef::new(Sessions::FirstSeenMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(Sessions::LastSeenMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(
                        ColumnDef::new(Sessions::RequestCount)
                            .big_integer()
                            .not_null(),
                    )
                    .to_owned(),
            )
            .await?;
            m.create_index(
                Index::create()
                    .name("idx_sessions_agent")
                    .table(Sessions::Table)
                    .col(Sessions::Agent)
                    .if_not_exists()
                    .to_owned(),
            )
            .await
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.drop_table(Table::drop().table(Sessions::Table).to_owned())
                .await?;
            m.drop_table(Table::drop().table(Requests::Table).to_owned())
                .await?;
            m.drop_table(Table::drop().table(ApiKeys::Table).to_owned())
                .await
        }
    }
}

/// Usage and cost columns on `requests`, the per-user daily spend rollup that budgets read, and
/// the budgets themselves.
mod m0003_usage_budgets {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0003_usage_budgets"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            // SQLite adds one column per ALTER TABLE.
            let columns = [
                ColumnDef::new(Requests::AnsweredModel)
                    .string()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::InputTokens)
                    .big_integer()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::OutputTokens)
                    .big_integer()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::CachedInputTokens)
                    .big_integer()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::CacheWriteTokens)
                    .big_integer()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::ReasoningTokens)
                    .big_integer()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::FinishReason)
                    .string()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::CostMicros)
                    .big_integer()
                    .null()
                    .to_owned(),
                ColumnDef::new(Requests::UsageStatus)
                    .string()
                    .not_null()
                    .default("not_applicable")
                    .to_owned(),
            ];
            for mut column in columns {
                m.alter_table(
                    Table::alter()
                        .table(Requests::Table)
                        .add_column(&mut column)
                        .to_owned(),
                )
                .await?;
            }

            // Day = UTC days since the Unix epoch; month sums are ranges of days.
            m.create_table(
                Table::create()
                    .table(UserSpend::Table)
                    .if_not_exists()
                    .col(ColumnDef::new(UserSpend::UserId).string().not_null())
                    .col(ColumnDef::new(UserSpend::Day).big_integer().not_null())
                    .col(
                        ColumnDef::new(UserSpend::CostMicros)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(UserSpend::Requests).big_integer().not_null())
                    .primary_key(Index::create().col(UserSpend::UserId).col(UserSpend::Day))
                    .to_owned(),
            )
            .await?;
            m.create_index(
                Index::create()
                    .name("idx_user_spend_day")
                    .table(UserSpend::Table)
                    .col(UserSpend::Day)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;

            // Subject: `default` or `user:<id>`.
            m.create_table(
                Table::create()
                    .table(Budgets::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(Budgets::Subject)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(ColumnDef::new(Budgets::LimitMicros).big_integer().null())
                    .col(ColumnDef::new(Budgets::Period).string().not_null())
                    .col(ColumnDef::new(Budgets::RequestsPerMinute).integer().null())
                    .col(
                        ColumnDef::new(Budgets::UpdatedAtMs)
                            .big_integer()
                            .not_null(),
                    )
                    .to_owned(),
            )
            .await
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.drop_table(Table::drop().table(Budgets::Table).to_owned())
                .await?;
            m.drop_table(Table::drop().table(UserSpend::Table).to_owned())
                .await?;
            for column in [
                Requests::AnsweredModel,
                Requests::InputTokens,
                Requests::OutputTokens,
                Requests::CachedInputTokens,
                Requests::CacheWriteTokens,
                Requests::ReasoningTokens,
                Requests::FinishReason,
                Requests::CostMicros,
                Requests::UsageStatus,
            ] {
                m.alter_table(
                    Table::alter()
                        .table(Requests::Table)
                        .drop_column(column)
                        .to_owned(),
                )
                .await?;
            }
            Ok(())
        }
    }
}

/// A partial index on the requests whose usage is known but whose cost is not (unpriced
/// models): the usage report lists them without reading the other rows. Tiny: only unpriced
/// rows enter it.
mod m0004_unpriced_index {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0004_unpriced_index"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            // The same SQL on SQLite and PostgreSQL; the query builder has no partial indexes.
            m.get_connection()
                .execute_unprepared(
                    "CREATE INDEX IF NOT EXISTS idx_requests_unpriced ON requests (started_at_ms) \
                     WHERE cost_micros IS NULL AND (input_tokens IS NOT NULL OR output_tokens IS NOT NULL)",
                )
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP INDEX IF EXISTS idx_requests_unpriced")
                .await?;
            Ok(())
        }
    }
}

/// Agent analytics: one stored result per agent (the latest computation, as JSON), so reads are
/// one primary-key lookup; and a covering index that lets the per-session outcome pass read an
/// agent's signals in the window from the index alone.
mod m0005_analytics {
    use super::*;

    #[derive(DeriveIden)]
    enum AnalyticsResults {
        Table,
        Agent,
        ComputedAtMs,
        Status,
        Report,
    }

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0005_analytics"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.create_table(
                Table::create()
                    .table(AnalyticsResults::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(AnalyticsResults::Agent)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(
                        ColumnDef::new(AnalyticsResults::ComputedAtMs)
                            .big_integer()
                            .not_null(),
                    )
                    .col(ColumnDef::new(AnalyticsResults::Status).string().not_null())
                    .col(ColumnDef::new(AnalyticsResults::Report).text().not_null())
                    .to_owned(),
            )
            .await?;
            // The outcome pass groups an agent's signals in a time window by session and reads
            // action and edit distance: all of it from this index, never the table.
            m.create_index(
                Index::create()
                    .name("idx_signals_agent_outcome")
                    .table(Signals::Table)
                    .col(Signals::Agent)
                    .col(Signals::ReceivedAtMs)
                    .col(Signals::SessionId)
                    .col(Signals::Action)
                    .col(Signals::EditDistance)
                    .if_not_exists()
                    .to_owned(),
            )
            .await
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP INDEX IF EXISTS idx_signals_agent_outcome")
                .await?;
            m.drop_table(Table::drop().table(AnalyticsResults::Table).to_owned())
                .await
        }
    }
}

/// Per-session rollups for the analytics (`analytics::rollup`): one row per (agent, session) of
/// mergeable aggregates of the session's signals and requests, kept by the ingest in the same
/// transaction as the rows, so an agent's analytics read one row per session instead of
/// grouping all its signals and requests. Filled here from the rows already stored, so an
/// upgraded database answers exactly as before.
mod m0006_session_rollups {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0006_session_rollups"
        }
    }

    /// The table, in the one SQL text SQLite and PostgreSQL share. Signals: number,
    /// max(received_at_ms * 4 + class), regenerations, heavy edits, first signal. Requests:
    /// number, model and provider range, env, end user, known cost, slowest TTFB, first and
    /// last. Then the last signal or request, and three columns derived from the others, written
    /// with them (not generated columns: SQLite reads those from the table, never from a
    /// covering index): the outcome class, the TTFB band and the UTC week (from Monday) of the
    /// last signal.
    const TABLE: &str = "CREATE TABLE IF NOT EXISTS session_rollups (\
        agent TEXT NOT NULL, session_id TEXT NOT NULL, \
        signals BIGINT NOT NULL, sig_key BIGINT, regens BIGINT NOT NULL, heavy BIGINT NOT NULL, \
        first_signal_ms BIGINT, \
        requests BIGINT NOT NULL, model_min TEXT, model_max TEXT, provider_min TEXT, \
        provider_max TEXT, env TEXT, user_id TEXT, cost BIGINT, ttfb BIGINT, \
        first_request_ms BIGINT, last_request_ms BIGINT, \
        last_active_ms BIGINT NOT NULL, cls BIGINT, ttfb_band BIGINT, week BIGINT, \
        PRIMARY KEY (agent, session_id))";

    /// The rollup of every stored (agent, session). The class of a signal (1 success, 2
    /// abandoned, 0 other failure) and the heavy-edit threshold are those of
    /// `analytics::outcome` when this migration was written.
    const BACKFILL: &str = "INSERT INTO session_rollups (agent, session_id, signals, sig_key, \
        regens, heavy, first_signal_ms, requests, model_min, model_max, provider_min, \
        provider_max, env, user_id, cost, ttfb, first_request_ms, last_request_ms, last_active_ms, \
        cls, ttfb_band, week) \
        SELECT agent, session_id, CAST(SUM(is_sig) AS BIGINT), MAX(sig_key), \
        CAST(SUM(regen) AS BIGINT), CAST(SUM(heavy) AS BIGINT), MIN(sig_ms), \
        CAST(SUM(1 - is_sig) AS BIGINT), MIN(model), MAX(model), MIN(provider), MAX(provider), \
        MAX(env), MAX(user_id), CAST(SUM(cost) AS BIGINT), MAX(ttfb), MIN(req_ms), MAX(req_ms), \
        MAX(COALESCE(sig_ms, req_ms)), MAX(sig_key) % 4, \
        CASE WHEN MAX(ttfb) IS NULL THEN NULL WHEN MAX(ttfb) < 500 THEN 0 \
        WHEN MAX(ttfb) < 1000 THEN 1 WHEN MAX(ttfb) < 2000 THEN 2 WHEN MAX(ttfb) < 4000 THEN 3 \
        WHEN MAX(ttfb) < 8000 THEN 4 ELSE 5 END, (MAX(sig_key) / 4 + 259200000) / 604800000 \
        FROM (SELECT agent, session_id, 1 AS is_sig, received_at_ms * 4 + \
        CASE WHEN action IN ('accepted', 'thumbs_up', 'published', 'sent') THEN 1 \
        WHEN action = 'edited' AND edit_distance < 200 THEN 1 \
        WHEN action = 'abandoned' THEN 2 ELSE 0 END AS sig_key, \
        CASE WHEN action = 'regenerated' THEN 1 ELSE 0 END AS regen, \
        CASE WHEN action = 'edited' AND edit_distance >= 200 THEN 1 ELSE 0 END AS heavy, \
        received_at_ms AS sig_ms, CAST(NULL AS TEXT) AS model, CAST(NULL AS TEXT) AS provider, \
        CAST(NULL AS TEXT) AS env, CAST(NULL AS TEXT) AS user_id, CAST(NULL AS BIGINT) AS cost, \
        CAST(NULL AS BIGINT) AS ttfb, CAST(NULL AS BIGINT) AS req_ms \
        FROM signals WHERE agent IS NOT NULL \
        UNION ALL SELECT agent, session_id, 0, NULL, 0, 0, NULL, COALESCE(answered_model, model), \
        provider, env, user_id, cost_micros, ttfb_ms, started_at_ms \
        FROM requests WHERE agent IS NOT NULL AND session_id IS NOT NULL) AS u \
        GROUP BY agent, session_id";

    /// What the analytics read of a row besides its keys: the window test and the measures.
    const READ: &str = "last_active_ms, first_signal_ms, first_request_ms, signals, cls, regens, \
        heavy, requests, cost";

    /// The indexes. An agent's sessions active since a time (the window, the trend weeks) on
    /// both databases. SQLite has no hash aggregate: a `GROUP BY` over hundreds of thousands of
    /// sessions is a sort, several times slower than reading them. So on SQLite the indexes
    /// cover what the analytics read, and two more hand the sessions over already ordered by
    /// their cube key and by end user, each followed by the session's measures, so that SQLite
    /// groups sessions as it reads them, and sessions alike (same key, class, counts) fold into
    /// one group: most of the work per session is then one comparison and one count.
    /// PostgreSQL hashes; it gets the narrow index only.
    fn indexes(sqlite: bool) -> Vec<String> {
        if !sqlite {
            return vec![
                "CREATE INDEX IF NOT EXISTS idx_session_rollups_agent_active \
                 ON session_rollups (agent, last_active_ms)"
                    .to_owned(),
            ];
        }
        vec![
            format!(
                "CREATE INDEX IF NOT EXISTS idx_session_rollups_agent_active \
                 ON session_rollups (agent, last_active_ms, sig_key, {READ})"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS idx_session_rollups_cube ON session_rollups \
                 (agent, model_min, model_max, provider_min, provider_max, env, week, ttfb_band, \
                 signals, cls, regens, heavy, requests, {READ})"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS idx_session_rollups_user ON session_rollups \
                 (agent, user_id, signals, cls, regens, heavy, requests, {READ})"
            ),
        ]
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared(TABLE).await?;
            let sqlite = m.get_database_backend() == sea_orm::DatabaseBackend::Sqlite;
            for index in indexes(sqlite) {
                db.execute_unprepared(&index).await?;
            }
            db.execute_unprepared(BACKFILL).await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS session_rollups")
                .await?;
            Ok(())
        }
    }

    #[cfg(test)]
    mod tests {
        use super::BACKFILL;
        use crate::analytics::rollup::ttfb_band;

        /// The stored TTFB band is the analytics' band: changing the bands needs a migration.
        #[test]
        fn stored_band_follows_the_analytics_bands() {
            let band = ttfb_band("MAX(ttfb)", false);
            assert!(BACKFILL.contains(&band), "{band}");
        }
    }
}

/// The OpenTelemetry span of each request (`requests.trace_id` and `span_id`, 32 and 16 hex
/// digits; NULL when the request was not traced), so a signal and the analytics can name the
/// traces behind them.
mod m0007_trace_ids {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0007_trace_ids"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("ALTER TABLE requests ADD COLUMN trace_id TEXT")
                .await?;
            m.get_connection()
                .execute_unprepared("ALTER TABLE requests ADD COLUMN span_id TEXT")
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("ALTER TABLE requests DROP COLUMN trace_id")
                .await?;
            m.get_connection()
                .execute_unprepared("ALTER TABLE requests DROP COLUMN span_id")
                .await?;
            Ok(())
        }
    }
}

/// Signals that name one answer: `signals.request_id`, the `NM-Request-Id` of the request the
/// signal is about (NULL: the signal is about its session, as every signal stored before).
/// Indexed: the records ingest looks up the signals waiting for a batch's requests, and the
/// analytics read a request's signals. Existing rows keep NULL, so an upgraded database answers
/// exactly as before; its rollups need no change.
mod m0008_signal_request_id {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0008_signal_request_id"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared("ALTER TABLE signals ADD COLUMN request_id TEXT")
                .await?;
            db.execute_unprepared(
                "CREATE INDEX IF NOT EXISTS idx_signals_request ON signals (request_id)",
            )
            .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared("DROP INDEX IF EXISTS idx_signals_request")
                .await?;
            db.execute_unprepared("ALTER TABLE signals DROP COLUMN request_id")
                .await?;
            Ok(())
        }
    }
}

/// Implicit signals (issue 32): `signals.source` (`explicit`: sent to `/v1/signal`;
/// `implicit`: inferred by a dataplane rule, carried by the record of the request that revealed
/// it) and `signals.rule` (the rule's name; NULL for explicit ones). Every existing row is
/// explicit. `session_rollups` gains the implicit signals' own aggregates beside the explicit
/// ones (`analytics::rollup`), so the analytics can count them or not, per agent: number,
/// latest key (time · 4 + class), regenerations, heavy edits and first time of the signals
/// that are outcomes, and number and latest key of `continued` ones (an outcome only where the
/// operator says so). `agent_settings` holds per-agent choices (which evidence counts). The
/// indexes serve the per-agent counts by source and rule, the progress counts by evidence and
/// the rollup's test of whether an explicit signal names a request (a list of an agent's or a
/// session's signals pages over the indexes of m0002).
mod m0009_signal_source {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0009_signal_source"
        }
    }

    /// The statements, the same SQL on SQLite and PostgreSQL (SQLite adds one column per
    /// `ALTER TABLE`).
    const UP: [&str; 13] = [
        "ALTER TABLE signals ADD COLUMN source TEXT NOT NULL DEFAULT 'explicit'",
        "ALTER TABLE signals ADD COLUMN rule TEXT",
        // An agent's signals of one source: the progress counts (first, last, how many) seek
        // and range over it; the counts by source, rule and action read it alone.
        "CREATE INDEX IF NOT EXISTS idx_signals_agent_source \
         ON signals (agent, source, received_at_ms, rule, action)",
        // Whether an explicit signal names a request (every unit test of the rollup and the
        // analytics), from the index alone; it replaces m0008's index on `request_id`.
        "CREATE INDEX IF NOT EXISTS idx_signals_request_source ON signals (request_id, source)",
        "DROP INDEX IF EXISTS idx_signals_request",
        "ALTER TABLE session_rollups ADD COLUMN isignals BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE session_rollups ADD COLUMN isig_key BIGINT",
        "ALTER TABLE session_rollups ADD COLUMN iregens BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE session_rollups ADD COLUMN iheavy BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE session_rollups ADD COLUMN ifirst_ms BIGINT",
        "ALTER TABLE session_rollups ADD COLUMN icont BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE session_rollups ADD COLUMN icont_key BIGINT",
        "CREATE TABLE IF NOT EXISTS agent_settings (agent TEXT NOT NULL PRIMARY KEY, \
         evidence TEXT NOT NULL, continued_counts BOOLEAN NOT NULL, \
         updated_at_ms BIGINT NOT NULL)",
    ];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in UP {
                db.execute_unprepared(sql).await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in [
                "DROP TABLE IF EXISTS agent_settings",
                "DROP INDEX IF EXISTS idx_signals_agent_source",
                "DROP INDEX IF EXISTS idx_signals_request_source",
                "CREATE INDEX IF NOT EXISTS idx_signals_request ON signals (request_id)",
            ] {
                db.execute_unprepared(sql).await?;
            }
            for col in [
                "isignals",
                "isig_key",
                "iregens",
                "iheavy",
                "ifirst_ms",
                "icont",
                "icont_key",
            ] {
                db.execute_unprepared(&format!("ALTER TABLE session_rollups DROP COLUMN {col}"))
                    .await?;
            }
            db.execute_unprepared("ALTER TABLE signals DROP COLUMN rule")
                .await?;
            db.execute_unprepared("ALTER TABLE signals DROP COLUMN source")
                .await?;
            Ok(())
        }
    }
}

/// Key roles, scopes, labels, expiry, rotation and last use (`api_keys`), and the audit trail
/// (`audit_events`). Existing keys keep their rights: admin keys become `admin`, the others
/// `service`, unrestricted and without expiry. Every new column is nullable or has a default,
/// so the statements are the same on SQLite and PostgreSQL.
mod m0010_key_scopes_audit {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0010_key_scopes_audit"
        }
    }

    const KEY_COLUMNS: [(&str, &str); 8] = [
        ("role", "TEXT NOT NULL DEFAULT 'service'"),
        ("scope_json", "TEXT"),
        ("labels_json", "TEXT"),
        ("expires_at_ms", "BIGINT"),
        ("previous_hash_hex", "TEXT"),
        ("previous_valid_until_ms", "BIGINT"),
        ("rotated_at_ms", "BIGINT"),
        ("last_used_at_ms", "BIGINT"),
    ];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for (column, ty) in KEY_COLUMNS {
                db.execute_unprepared(&format!("ALTER TABLE api_keys ADD COLUMN {column} {ty}"))
                    .await?;
            }
            db.execute_unprepared("UPDATE api_keys SET role = 'admin' WHERE admin")
                .await?;
            db.execute_unprepared(
                "CREATE TABLE IF NOT EXISTS audit_events (\
                 id TEXT PRIMARY KEY, \
                 at_ms BIGINT NOT NULL, \
                 actor_key_id TEXT NOT NULL, \
                 action TEXT NOT NULL, \
                 target TEXT NOT NULL, \
                 before_json TEXT, \
                 after_json TEXT)",
            )
            .await?;
            db.execute_unprepared(
                "CREATE INDEX IF NOT EXISTS idx_audit_events_time ON audit_events (at_ms, id)",
            )
            .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared("DROP TABLE IF EXISTS audit_events")
                .await?;
            for (column, _) in KEY_COLUMNS {
                db.execute_unprepared(&format!("ALTER TABLE api_keys DROP COLUMN {column}"))
                    .await?;
            }
            Ok(())
        }
    }
}

/// Experiments (issue 33): `experiments` (one row each: agent, env, state, the secret salt of
/// its assignment, unit, guardrails, limits, what to act on by itself, winner, promoted, the
/// reason of its state), `experiment_arms` (its arms in order: name, provider, model, weight,
/// rolled back) and `experiment_events` (its history: every state change and action, by whom).
/// `requests` gains the experiment and arm that served each request and the model the client
/// named when the arm changed it, indexed for the per-arm counts. Every new column of
/// `requests` is NULL on existing rows (they were in no experiment). The same SQL on SQLite and
/// PostgreSQL.
mod m0011_experiments {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0011_experiments"
        }
    }

    const UP: [&str; 9] = [
        "CREATE TABLE IF NOT EXISTS experiments (\
         id TEXT PRIMARY KEY, \
         agent TEXT NOT NULL, \
         env TEXT, \
         state TEXT NOT NULL, \
         salt TEXT NOT NULL, \
         unit TEXT NOT NULL, \
         guardrails TEXT NOT NULL, \
         max_sessions BIGINT, \
         max_days BIGINT, \
         auto_promote BOOLEAN NOT NULL, \
         auto_rollback BOOLEAN NOT NULL, \
         description TEXT NOT NULL, \
         winner TEXT, \
         promoted BOOLEAN NOT NULL, \
         reason TEXT NOT NULL, \
         created_at_ms BIGINT NOT NULL, \
         updated_at_ms BIGINT NOT NULL, \
         latency_threshold_ms BIGINT, \
         cost_threshold_micros BIGINT)",
        // An agent's experiments by state: the conflict check of a create, the live set.
        "CREATE INDEX IF NOT EXISTS idx_experiments_agent_state ON experiments (agent, state)",
        "CREATE TABLE IF NOT EXISTS experiment_arms (\
         experiment_id TEXT NOT NULL REFERENCES experiments (id), \
         position INTEGER NOT NULL, \
         name TEXT NOT NULL, \
         provider TEXT NOT NULL, \
         model TEXT NOT NULL, \
         weight BIGINT NOT NULL, \
         rolled_back BOOLEAN NOT NULL, \
         PRIMARY KEY (experiment_id, position), \
         UNIQUE (experiment_id, name))",
        "CREATE TABLE IF NOT EXISTS experiment_events (\
         id TEXT PRIMARY KEY, \
         experiment_id TEXT NOT NULL REFERENCES experiments (id), \
         at_ms BIGINT NOT NULL, \
         kind TEXT NOT NULL, \
         arm TEXT, \
         actor TEXT NOT NULL, \
         detail TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS idx_experiment_events_time \
         ON experiment_events (experiment_id, at_ms, id)",
        "ALTER TABLE requests ADD COLUMN experiment_id TEXT",
        "ALTER TABLE requests ADD COLUMN arm TEXT",
        "ALTER TABLE requests ADD COLUMN requested_model TEXT",
        // The per-arm counts of an experiment.
        "CREATE INDEX IF NOT EXISTS idx_requests_experiment ON requests (experiment_id, arm)",
    ];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in UP {
                db.execute_unprepared(sql).await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in [
                "DROP INDEX IF EXISTS idx_requests_experiment",
                "ALTER TABLE requests DROP COLUMN requested_model",
                "ALTER TABLE requests DROP COLUMN arm",
                "ALTER TABLE requests DROP COLUMN experiment_id",
                "DROP TABLE IF EXISTS experiment_events",
                "DROP TABLE IF EXISTS experiment_arms",
                "DROP TABLE IF EXISTS experiments",
            ] {
                db.execute_unprepared(sql).await?;
            }
            Ok(())
        }
    }
}

/// The table the write probe upserts (`Store::probe_write`): one row, the time of the last
/// probe. Numbered apart from the feature migrations (m01xx: operational tables), so branches
/// adding m0007 and later merge without renumbering.
mod m0101_write_probe {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0101_write_probe"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(
                    "CREATE TABLE IF NOT EXISTS write_probe \
                     (id BIGINT PRIMARY KEY, written_at_ms BIGINT NOT NULL)",
                )
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS write_probe")
                .await?;
            Ok(())
        }
    }
}

/// Alerts: webhooks, the events sent to them (unique by their dedupe key: an event seen twice is
/// sent once) and one delivery row per (event, webhook), due by `next_at_ms`.
/// Budgets at every level: token limits on `budgets` (subjects now also `default-key` and
/// `<kind>:<value>` for keys, labels, agents, models and envs), and `budget_spend`, the daily
/// rollup per scope that replaces `user_spend` (its rows are moved over as `user` scopes).
mod m0012_budget_scopes {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0012_budget_scopes"
        }
    }

    const UP: [&str; 5] = [
        "ALTER TABLE budgets ADD COLUMN limit_tokens BIGINT",
        "ALTER TABLE budgets ADD COLUMN tokens_per_minute BIGINT",
        "CREATE TABLE IF NOT EXISTS budget_spend (\
         scope_kind TEXT NOT NULL, \
         scope_value TEXT NOT NULL, \
         day BIGINT NOT NULL, \
         cost_micros BIGINT NOT NULL, \
         tokens BIGINT NOT NULL, \
         requests BIGINT NOT NULL, \
         PRIMARY KEY (scope_kind, scope_value, day))",
        "CREATE INDEX IF NOT EXISTS idx_budget_spend_day ON budget_spend (day)",
        "INSERT INTO budget_spend (scope_kind, scope_value, day, cost_micros, tokens, requests) \
         SELECT 'user', user_id, day, cost_micros, 0, requests FROM user_spend",
    ];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in UP {
                db.execute_unprepared(sql).await?;
            }
            db.execute_unprepared("DELETE FROM user_spend").await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared(
                "INSERT INTO user_spend (user_id, day, cost_micros, requests) \
                 SELECT scope_value, day, cost_micros, requests FROM budget_spend \
                 WHERE scope_kind = 'user'",
            )
            .await?;
            db.execute_unprepared("DROP TABLE IF EXISTS budget_spend")
                .await?;
            db.execute_unprepared(
                "DELETE FROM budgets WHERE subject NOT LIKE 'user:%' AND subject <> 'default'",
            )
            .await?;
            for column in ["limit_tokens", "tokens_per_minute"] {
                db.execute_unprepared(&format!("ALTER TABLE budgets DROP COLUMN {column}"))
                    .await?;
            }
            Ok(())
        }
    }
}

mod m0013_alerts {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0013_alerts"
        }
    }

    const UP: [&str; 4] = [
        "CREATE TABLE IF NOT EXISTS webhooks (\
         id TEXT PRIMARY KEY, \
         url TEXT NOT NULL, \
         secret TEXT NOT NULL, \
         kinds TEXT NOT NULL, \
         format TEXT NOT NULL, \
         description TEXT NOT NULL, \
         created_at_ms BIGINT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS alert_events (\
         id TEXT PRIMARY KEY, \
         kind TEXT NOT NULL, \
         dedupe TEXT NOT NULL UNIQUE, \
         at_ms BIGINT NOT NULL, \
         data TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS alert_deliveries (\
         event_id TEXT NOT NULL, \
         webhook_id TEXT NOT NULL, \
         state TEXT NOT NULL, \
         attempts BIGINT NOT NULL, \
         last_status BIGINT, \
         last_error TEXT, \
         next_at_ms BIGINT, \
         updated_at_ms BIGINT NOT NULL, \
         PRIMARY KEY (event_id, webhook_id))",
        "CREATE INDEX IF NOT EXISTS idx_alert_deliveries_due \
         ON alert_deliveries (state, next_at_ms)",
    ];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in UP {
                db.execute_unprepared(sql).await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for table in ["alert_deliveries", "alert_events", "webhooks"] {
                db.execute_unprepared(&format!("DROP TABLE IF EXISTS {table}"))
                    .await?;
            }
            Ok(())
        }
    }
}

/// The usage of the request records that retention deleted (`crate::retention`), per UTC day and
/// (agent, end user, env, provider, model, key): the usage reports add these rows to the records
/// still stored. Absent values are stored as `''` (a primary key column cannot hold NULL on
/// PostgreSQL, and two NULLs never conflict on either database); the reports read them back as
/// absent. Sums of absent tokens or costs are 0, as the reports sum them.
mod m0014_usage_rollups {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0014_usage_rollups"
        }
    }

    const UP: [&str; 1] = ["CREATE TABLE IF NOT EXISTS usage_rollups (\
         day BIGINT NOT NULL, \
         agent TEXT NOT NULL, \
         user_id TEXT NOT NULL, \
         env TEXT NOT NULL, \
         provider TEXT NOT NULL, \
         model TEXT NOT NULL, \
         key_id TEXT NOT NULL, \
         requests BIGINT NOT NULL, \
         input_tokens BIGINT NOT NULL, \
         output_tokens BIGINT NOT NULL, \
         cached_input_tokens BIGINT NOT NULL, \
         reasoning_tokens BIGINT NOT NULL, \
         cost_micros BIGINT NOT NULL, \
         unpriced BIGINT NOT NULL, \
         unmetered BIGINT NOT NULL, \
         errors BIGINT NOT NULL, \
         PRIMARY KEY (day, agent, user_id, env, provider, model, key_id))"];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for sql in UP {
                db.execute_unprepared(sql).await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS usage_rollups")
                .await?;
            Ok(())
        }
    }
}

/// Secrets the controlplane generates for itself and keeps (the key of the tokens that replace a
/// forgotten end user's id, `crate::forget`).
mod m0015_secrets {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0015_secrets"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(
                    "CREATE TABLE IF NOT EXISTS controlplane_secrets (\
                     name TEXT PRIMARY KEY, value TEXT NOT NULL, created_at_ms BIGINT NOT NULL)",
                )
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS controlplane_secrets")
                .await?;
            Ok(())
        }
    }
}

/// Signals by the time they were received: retention deletes the oldest and the export pages a
/// day in (time, id) order; without it both walk the whole table.
mod m0016_signals_by_time {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0016_signals_by_time"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(
                    "CREATE INDEX IF NOT EXISTS idx_signals_received ON signals (received_at_ms, id)",
                )
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP INDEX IF EXISTS idx_signals_received")
                .await?;
            Ok(())
        }
    }
}

/// The signals that retention deleted (`crate::retention`), per agent and UTC day, as the
/// analytics' progress counts them (`crate::analytics::Analytics::progress`): for each of the
/// three evidence settings, how many signals it counts and the first and the last of their
/// times (`explicit_*`: setting `explicit`; `implicit_*`: `explicit+implicit`; `continued_*`:
/// `explicit+implicit+continued`; a time is NULL when the setting counts none that day). The
/// progress counts add these rows to the signals still stored. Signals without an agent are not
/// kept (no agent's progress counts them).
mod m0018_signal_rollups {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0018_signal_rollups"
        }
    }

    const UP: &str = "CREATE TABLE IF NOT EXISTS signal_rollups (\
         agent TEXT NOT NULL, \
         day BIGINT NOT NULL, \
         explicit_signals BIGINT NOT NULL, \
         explicit_first_ms BIGINT, \
         explicit_last_ms BIGINT, \
         implicit_signals BIGINT NOT NULL, \
         implicit_first_ms BIGINT, \
         implicit_last_ms BIGINT, \
         continued_signals BIGINT NOT NULL, \
         continued_first_ms BIGINT, \
         continued_last_ms BIGINT, \
         PRIMARY KEY (agent, day))";

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection().execute_unprepared(UP).await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS signal_rollups")
                .await?;
            Ok(())
        }
    }
}

/// The agent's traced requests by time, for the analytics' example traces
/// (`analytics::latest_traces`: the latest traced request naming each evidence arm), with the
/// columns that statement reads (so it never reads the table, and SQLite prefers it to the
/// index of all the agent's requests, which has the same leading columns). Partial:
/// only requests with a trace id are in it, so a gateway that traces nothing keeps an empty
/// index and pays nothing at ingest, and the walk for labels no traced request names ends at
/// once instead of reading every request of the agent's window (about 1 s of CPU per 400,000
/// requests on SQLite; bench/HISTORY.md, session 23). On PostgreSQL the index is made on every
/// day's partition, and on partitions made later.
mod m0019_traced_requests {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0019_traced_requests"
        }
    }

    pub(crate) const INDEX: &str = "idx_requests_agent_traced";

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(&format!(
                    "CREATE INDEX IF NOT EXISTS {INDEX} ON requests \
                     (agent, started_at_ms, trace_id, model, provider, env) \
                     WHERE trace_id IS NOT NULL"
                ))
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(&format!("DROP INDEX IF EXISTS {INDEX}"))
                .await?;
            Ok(())
        }
    }
}

/// A partial index of the rollup rows that have implicit signals, covering what the implicit
/// total beside explicit evidence (`analytics::query::implicit_beside`) and the agreement of
/// explicit and implicit outcomes (`agents::Agents::agreement`) read of them: an agent whose
/// units have no implicit signal has nothing in it and costs nothing there, at ingest or when
/// read. The same on both databases. (SQLite uses a partial index only for a query whose
/// `WHERE` holds the index's condition as one of its terms: the queries repeat it.)
mod m0020_implicit_rollups {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0020_implicit_rollups"
        }
    }

    pub(crate) const INDEX: &str = crate::analytics::evidence::IMPLICIT_INDEX;

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(&format!(
                    "CREATE INDEX IF NOT EXISTS {INDEX} ON session_rollups \
                     (agent, last_active_ms, first_request_ms, first_signal_ms, ifirst_ms, \
                     signals, cls, isignals, isig_key, iregens, iheavy, icont, requests, cost) \
                     WHERE {}",
                    crate::analytics::evidence::IMPLICIT_ROWS
                ))
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(&format!("DROP INDEX IF EXISTS {INDEX}"))
                .await?;
            Ok(())
        }
    }
}

/// SQLite: an index of the signals in the order of their counts by source, rule and action
/// (`agents::Agents::source_counts`, the web page's and `agents show`'s), covering the time:
/// SQLite has no hash aggregate, and over `idx_signals_agent_source` (in time order within a
/// source) its `GROUP BY` sorted every signal of the agent (0.8 s of CPU for a million; 0.09 s
/// read in this order). PostgreSQL hashes the groups: nothing there.
mod m0021_signal_counts {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0021_signal_counts"
        }
    }

    pub(crate) const INDEX: &str = "idx_signals_agent_counts";

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            if db.get_database_backend() == sea_orm::DatabaseBackend::Sqlite {
                db.execute_unprepared(&format!(
                    "CREATE INDEX IF NOT EXISTS {INDEX} ON signals \
                     (agent, source, rule, action, received_at_ms)"
                ))
                .await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(&format!("DROP INDEX IF EXISTS {INDEX}"))
                .await?;
            Ok(())
        }
    }
}

/// `latency_totals`: each stored record's latency and time to first byte counted per agent, UTC
/// day, env, provider, model, metric (0 latency, 1 time to first byte) and histogram bucket, as
/// the latency reports count them (`usage::latency`): kept by the ingest in the batch's
/// transaction, so a report over weeks reads a few hundred rows. An absent agent, env or model
/// is `''` (none can be empty). Filled here from the stored records. Retention leaves it alone
/// (the latency history outlives the records); it names no end user.
mod m0022_latency_totals {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0022_latency_totals"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared(
                "CREATE TABLE IF NOT EXISTS latency_totals (agent TEXT NOT NULL, \
                 day BIGINT NOT NULL, env TEXT NOT NULL, provider TEXT NOT NULL, \
                 model TEXT NOT NULL, metric BIGINT NOT NULL, bucket BIGINT NOT NULL, \
                 n BIGINT NOT NULL, PRIMARY KEY (agent, day, env, provider, model, metric, bucket))",
            )
            .await?;
            db.execute_unprepared(&crate::usage::latency::backfill_sql())
                .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS latency_totals")
                .await?;
            Ok(())
        }
    }
}

/// `usage_rollups` becomes the usage per UTC day of every record stored, kept at ingest
/// (`crate::usage::totals`): the records stored so far are added to it (it held only those
/// retention had deleted), and retention no longer folds what it deletes.
mod m0023_usage_day_totals {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0023_usage_day_totals"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared(&crate::usage::totals::backfill_sql(
                db.get_database_backend(),
                false,
            ))
            .await?;
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            db.execute_unprepared(&crate::usage::totals::backfill_sql(
                db.get_database_backend(),
                true,
            ))
            .await?;
            db.execute_unprepared("DELETE FROM usage_rollups WHERE requests = 0")
                .await?;
            Ok(())
        }
    }
}

/// The `requests` indexes by session and by experiment hold only the rows that have one: a
/// request without a session or outside an experiment (most of them) then adds no entry to
/// either B-tree when it is stored. Every query that reads them names the column with `=` or
/// `IN`, which implies `IS NOT NULL`, so both databases still use them. Each partial index is
/// made under a new name before the full one is dropped (SQLite runs migrations on the pool: a
/// connection that has not seen the drop yet would refuse the same name again). On PostgreSQL
/// the index of the partitioned table is made on every partition.
mod m0024_partial_request_indexes {
    use super::*;

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0024_partial_request_indexes"
        }
    }

    /// (full index, partial index, columns, the column a row needs for an entry).
    pub(crate) const INDEXES: [(&str, &str, &str, &str); 2] = [
        (
            "idx_requests_session",
            "idx_requests_in_session",
            "session_id",
            "session_id",
        ),
        (
            "idx_requests_experiment",
            "idx_requests_in_experiment",
            "experiment_id, arm",
            "experiment_id",
        ),
    ];

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for (full, partial, columns, needed) in INDEXES {
                db.execute_unprepared(&format!(
                    "CREATE INDEX IF NOT EXISTS {partial} ON requests ({columns}) \
                     WHERE {needed} IS NOT NULL"
                ))
                .await?;
                db.execute_unprepared(&format!("DROP INDEX IF EXISTS {full}"))
                    .await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            for (full, partial, columns, _) in INDEXES {
                db.execute_unprepared(&format!(
                    "CREATE INDEX IF NOT EXISTS {full} ON requests ({columns})"
                ))
                .await?;
                db.execute_unprepared(&format!("DROP INDEX IF EXISTS {partial}"))
                    .await?;
            }
            Ok(())
        }
    }
}

/// PostgreSQL: `requests` (by `started_at_ms`) and `signals` (by `received_at_ms`) become tables
/// partitioned by range, one partition per UTC day (`requests_p20261129`, bounds in Unix ms), plus
/// a DEFAULT partition (`requests_default`) for any row whose day has no partition: nothing
/// accepted is refused or lost. Retention then drops whole days (`crate::partitions`). Each
/// table is rebuilt in this migration's transaction: the old one renamed, a partitioned one
/// made like it, a partition for every day that holds rows and for today and the next
/// [`AHEAD`] days, the rows copied, the old table dropped, the primary key and the indexes made
/// again. A primary key of a partitioned table must hold the partition key: `requests` is keyed
/// by (request_id, started_at_ms) and `signals` by (id, received_at_ms); a resent record or
/// signal carries the same time, so it is still stored once. The one unique index that cannot
/// hold the time, a signal's (key, `Idempotency-Key`), moves to its own small table,
/// `signal_idempotency`, filled by a trigger that skips a signal whose pair is already there
/// (what `ON CONFLICT DO NOTHING` did with the index). SQLite: nothing changes.
mod m0017_partitions {
    use super::*;
    use sea_orm::{DatabaseBackend, Statement};

    pub struct Migration;

    impl MigrationName for Migration {
        fn name(&self) -> &str {
            "m0017_partitions"
        }
    }

    const DAY_MS: i64 = 86_400_000;
    /// Days after today that get their partition now (the controlplane keeps making them).
    const AHEAD: i64 = 7;
    /// Days whose rows get a partition: 1970 to 2243; rows outside go to DEFAULT.
    const LAST_DAY: i64 = 100_000;

    /// A partitioned table: its name, its time column, the rest of its primary key.
    const TABLES: [(&str, &str, &str); 2] = [
        ("requests", "started_at_ms", "request_id"),
        ("signals", "received_at_ms", "id"),
    ];

    const IDEMPOTENCY_INDEX: &str = "idx_signals_idempotency";

    const IDEMPOTENCY_UP: [&str; 5] = [
        "CREATE TABLE signal_idempotency (key_id TEXT NOT NULL, idempotency_key TEXT NOT NULL, \
         signal_id TEXT NOT NULL, received_at_ms BIGINT NOT NULL, \
         PRIMARY KEY (key_id, idempotency_key))",
        "CREATE INDEX idx_signal_idempotency_received ON signal_idempotency (received_at_ms)",
        "INSERT INTO signal_idempotency (key_id, idempotency_key, signal_id, received_at_ms) \
         SELECT key_id, idempotency_key, id, received_at_ms FROM signals \
         WHERE idempotency_key IS NOT NULL",
        // A row the trigger answers NULL for is skipped, as a conflict of `ON CONFLICT DO
        // NOTHING` is: not inserted, not returned. Concurrent inserts of one pair wait on the
        // primary key of `signal_idempotency`, so exactly one is stored. The signal that owns
        // the pair passes (an UPDATE that moves it to another partition inserts it again).
        "CREATE FUNCTION nm_signal_idempotency() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF NEW.idempotency_key IS NULL THEN RETURN NEW; END IF; \
           INSERT INTO signal_idempotency (key_id, idempotency_key, signal_id, received_at_ms) \
             VALUES (NEW.key_id, NEW.idempotency_key, NEW.id, NEW.received_at_ms) \
             ON CONFLICT DO NOTHING; \
           IF FOUND THEN RETURN NEW; END IF; \
           IF EXISTS (SELECT 1 FROM signal_idempotency WHERE key_id = NEW.key_id \
             AND idempotency_key = NEW.idempotency_key AND signal_id = NEW.id) THEN \
             RETURN NEW; \
           END IF; \
           RETURN NULL; \
         END $$",
        "CREATE TRIGGER signals_idempotency BEFORE INSERT ON signals \
         FOR EACH ROW EXECUTE FUNCTION nm_signal_idempotency()",
    ];

    const IDEMPOTENCY_DOWN: [&str; 3] = [
        "DROP TRIGGER IF EXISTS signals_idempotency ON signals",
        "DROP FUNCTION IF EXISTS nm_signal_idempotency()",
        "DROP TABLE IF EXISTS signal_idempotency",
    ];

    /// `requests_p20261129`: the partition of `table` for UTC day `day` (days since the epoch).
    fn partition_name(table: &str, day: i64) -> String {
        let date = chrono::DateTime::from_timestamp(day.saturating_mul(86_400), 0)
            .unwrap_or_default()
            .format("%Y%m%d");
        format!("{table}_p{date}")
    }

    async fn strings(db: &SchemaManagerConnection<'_>, sql: String) -> Result<Vec<String>, DbErr> {
        let rows = db
            .query_all_raw(Statement::from_string(DatabaseBackend::Postgres, sql))
            .await?;
        rows.iter()
            .map(|r| r.try_get_by_index::<String>(0))
            .collect()
    }

    /// Index definitions of `table` but its primary key's, as `CREATE INDEX ... ON table ...`
    /// (valid again once the rebuilt table has the name).
    async fn indexes(
        db: &SchemaManagerConnection<'_>,
        table: &str,
    ) -> Result<Vec<(String, String)>, DbErr> {
        let rows = db
            .query_all_raw(Statement::from_string(
                DatabaseBackend::Postgres,
                format!(
                    "SELECT indexname, indexdef FROM pg_indexes \
                     WHERE schemaname = current_schema() AND tablename = '{table}' \
                     AND indexname NOT IN (SELECT conname FROM pg_constraint \
                     WHERE conrelid = '{table}'::regclass AND contype = 'p') ORDER BY indexname"
                ),
            ))
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get_by_index(0)?, r.try_get_by_index(1)?)))
            .collect()
    }

    /// Rebuilds `table` partitioned by `time` (or, `partitioned` false, back as a plain table),
    /// with its rows, its primary key (`key`, plus `time` when partitioned) and its indexes.
    async fn rebuild(
        db: &SchemaManagerConnection<'_>,
        (table, time, key): (&str, &str, &str),
        partitioned: bool,
    ) -> Result<(), DbErr> {
        let old = format!("{table}_m0017_old");
        let defs = indexes(db, table).await?;
        let pkey = strings(
            db,
            format!(
                "SELECT conname FROM pg_constraint WHERE conrelid = '{table}'::regclass \
                 AND contype = 'p'"
            ),
        )
        .await?;
        let days: Vec<i64> = if partitioned {
            let today = chrono::Utc::now().timestamp_millis().div_euclid(DAY_MS);
            let rows = db
                .query_all_raw(Statement::from_string(
                    DatabaseBackend::Postgres,
                    format!(
                        "SELECT DISTINCT CAST(FLOOR({time} / {DAY_MS}.0) AS BIGINT) FROM {table} \
                         WHERE {time} >= 0 AND {time} < {} ORDER BY 1",
                        LAST_DAY * DAY_MS
                    ),
                ))
                .await?;
            let mut days = rows
                .iter()
                .map(|r| r.try_get_by_index::<i64>(0))
                .collect::<Result<Vec<_>, _>>()?;
            days.extend(today..=today + AHEAD);
            days.sort_unstable();
            days.dedup();
            days
        } else {
            Vec::new()
        };
        let mut sql = Vec::new();
        for (name, _) in &defs {
            sql.push(format!("DROP INDEX \"{name}\""));
        }
        for name in &pkey {
            sql.push(format!("ALTER TABLE {table} DROP CONSTRAINT \"{name}\""));
        }
        sql.push(format!("ALTER TABLE {table} RENAME TO {old}"));
        let like =
            format!("CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)");
        if partitioned {
            sql.push(format!("{like} PARTITION BY RANGE ({time})"));
            sql.push(format!(
                "CREATE TABLE {table}_default PARTITION OF {table} DEFAULT"
            ));
            for day in days {
                sql.push(format!(
                    "CREATE TABLE {} PARTITION OF {table} FOR VALUES FROM ({}) TO ({})",
                    partition_name(table, day),
                    day * DAY_MS,
                    (day + 1) * DAY_MS
                ));
            }
        } else {
            sql.push(like);
        }
        sql.push(format!("INSERT INTO {table} SELECT * FROM {old}"));
        sql.push(format!("DROP TABLE {old}"));
        sql.push(if partitioned {
            format!("ALTER TABLE {table} ADD PRIMARY KEY ({key}, {time})")
        } else {
            format!("ALTER TABLE {table} ADD PRIMARY KEY ({key})")
        });
        for (name, def) in defs {
            if name != IDEMPOTENCY_INDEX {
                sql.push(def);
            }
        }
        if table == "signals" && !partitioned {
            sql.push(format!(
                "CREATE UNIQUE INDEX {IDEMPOTENCY_INDEX} ON signals (key_id, idempotency_key)"
            ));
        }
        for s in sql {
            db.execute_unprepared(&s).await?;
        }
        Ok(())
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Migration {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            if db.get_database_backend() != DatabaseBackend::Postgres {
                return Ok(());
            }
            for t in TABLES {
                rebuild(db, t, true).await?;
            }
            for sql in IDEMPOTENCY_UP {
                db.execute_unprepared(sql).await?;
            }
            Ok(())
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            let db = m.get_connection();
            if db.get_database_backend() != DatabaseBackend::Postgres {
                return Ok(());
            }
            for sql in IDEMPOTENCY_DOWN {
                db.execute_unprepared(sql).await?;
            }
            for t in TABLES {
                rebuild(db, t, false).await?;
            }
            Ok(())
        }
    }

    #[cfg(test)]
    mod tests {
        use super::super::super::migrate::MigratorTrait;
        use sea_orm::{ConnectionTrait, Database, DatabaseConnection};

        use super::super::Migrator;
        use crate::scratch::ScratchPg;

        async fn one(db: &DatabaseConnection, sql: &str) -> i64 {
            db.query_one_raw(sea_orm::Statement::from_string(
                sea_orm::DatabaseBackend::Postgres,
                sql,
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get_by_index::<i64>(0)
            .unwrap()
        }

        async fn partitioned(db: &DatabaseConnection) -> i64 {
            one(
                db,
                "SELECT COUNT(*) FROM pg_class WHERE relname IN ('requests', 'signals') \
                 AND relkind = 'p'",
            )
            .await
        }

        /// Down and up again keep every row; down gives back plain tables with their unique keys.
        #[tokio::test]
        async fn down_and_up_again_keep_every_row_postgres() {
            let Some(pg) = ScratchPg::for_tests().await else {
                return;
            };
            let db = Database::connect(&pg.url).await.unwrap();
            Migrator::up(&db, None).await.unwrap();
            assert_eq!(partitioned(&db).await, 2);
            let now = chrono::Utc::now().timestamp_millis();
            for (id, at) in [("r1", now), ("r2", 1_000)] {
                db.execute_unprepared(&format!(
                    "INSERT INTO requests (request_id, started_at_ms, key_id, provider, method, \
                     path, status, latency_ms, streamed, response_bytes) VALUES \
                     ('{id}', {at}, 'k', 'openai', 'POST', '/', 200, 1, false, 1)"
                ))
                .await
                .unwrap();
            }
            let signal = |id: &str| {
                format!(
                    "INSERT INTO signals (id, received_at_ms, session_id, action, key_id, \
                     idempotency_key, attributed_by_session) VALUES \
                     ('{id}', {now}, 's', 'accepted', 'k', 'idem', false) ON CONFLICT DO NOTHING"
                )
            };
            assert_eq!(
                db.execute_unprepared(&signal("s1"))
                    .await
                    .unwrap()
                    .rows_affected(),
                1
            );
            assert_eq!(
                db.execute_unprepared(&signal("s2"))
                    .await
                    .unwrap()
                    .rows_affected(),
                0
            );
            // The row before any partition's day is kept in DEFAULT.
            assert_eq!(one(&db, "SELECT COUNT(*) FROM requests_default").await, 1);

            // Down through m0017 (and the migrations after it).
            let steps = Migrator::migrations()
                .iter()
                .rev()
                .position(|m| m.name() == "m0017_partitions")
                .unwrap()
                + 1;
            Migrator::down(&db, Some(u32::try_from(steps).unwrap()))
                .await
                .unwrap();
            assert_eq!(partitioned(&db).await, 0);
            assert_eq!(one(&db, "SELECT COUNT(*) FROM requests").await, 2);
            assert_eq!(one(&db, "SELECT COUNT(*) FROM signals").await, 1);
            assert_eq!(
                db.execute_unprepared(&signal("s3"))
                    .await
                    .unwrap()
                    .rows_affected(),
                0
            );

            Migrator::up(&db, None).await.unwrap();
            assert_eq!(partitioned(&db).await, 2);
            assert_eq!(one(&db, "SELECT COUNT(*) FROM requests").await, 2);
            assert_eq!(one(&db, "SELECT COUNT(*) FROM signals").await, 1);
            assert_eq!(
                db.execute_unprepared(&signal("s4"))
                    .await
                    .unwrap()
                    .rows_affected(),
                0
            );
            db.close().await.unwrap();
            pg.drop_it().await.unwrap();
        }
    }
}

/// m0024: SQLite still reads the partial indexes for what they were made for.
#[cfg(test)]
mod partial_index_tests {
    use sea_orm::{DatabaseBackend, Statement};

    use crate::store::Store;

    #[tokio::test]
    async fn session_and_experiment_lookups_read_their_partial_indexes() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/plan.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        for (sql, index) in [
            (
                "SELECT request_id FROM requests WHERE session_id = 'sess_a'",
                "idx_requests_in_session",
            ),
            (
                "SELECT request_id FROM requests WHERE session_id IN ('sess_a', 'sess_b')",
                "idx_requests_in_session",
            ),
            (
                "SELECT arm, COUNT(*) FROM requests WHERE experiment_id = 'exp_a' GROUP BY arm",
                "idx_requests_in_experiment",
            ),
        ] {
            let stmt = Statement::from_string(DatabaseBackend::Sqlite, sql);
            let plan = crate::sql::query_plan(store.conn(), &stmt).await;
            assert!(
                plan.iter().any(|step| step.contains(index)),
                "{sql}: {plan:?}"
            );
        }
    }
}
