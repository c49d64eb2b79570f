//! The migration runner: applies [`super::migration`]'s migrations in their order and records
//! each applied one in the `seaql_migrations` table.
//!
//! The table, its rows and the rules are sea-orm-migration 2.0's, which this replaced, so a
//! database it migrated is read exactly as it left it:
//! - `seaql_migrations (version, applied_at)`: `version` the migration's name (the primary key),
//!   `applied_at` Unix seconds; created if missing, with the statement sea-orm derives from the
//!   entity below (the one sea-orm-migration ran).
//! - Pending migrations are the listed ones whose name has no row, applied in the list's order;
//!   a row naming no listed migration (a database from a newer binary) fails the run before
//!   anything is applied.
//! - On PostgreSQL each migration and its row are one transaction; on SQLite neither runs in
//!   one.
//! - `down` reverses the applied ones, newest first, and deletes their rows.
//!
//! Why our own: sea-orm-migration compiled sea-schema (schema discovery, which nothing here
//! uses) and turned on sea-orm's default features (`rust_decimal`, `time`, streams), about a
//! tenth of a first build's CPU (bench/HISTORY.md, "Session 25: the first build"). The runner
//! is a boxed future made here, so its code is compiled in this crate once, not again in each
//! crate that awaits [`MigratorTrait::up`].

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use sea_orm::sea_query::{
    Expr, ExprTrait, IndexCreateStatement, Query, TableAlterStatement, TableCreateStatement,
    TableDropStatement,
};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseExecutor, DbBackend, DbErr, Schema,
    TransactionTrait,
};
use tracing::debug;

/// What a migration module needs, in one glob import.
pub mod prelude {
    pub use super::{
        MigrationName, MigrationTrait, MigratorTrait, SchemaManager, SchemaManagerConnection,
    };
    pub use sea_orm::sea_query::*;
    pub use sea_orm::{ConnectionTrait, DbErr, DeriveIden};
}

/// The connection a migration runs on: the pool, or (PostgreSQL) the migration's transaction.
pub type SchemaManagerConnection<'c> = DatabaseExecutor<'c>;

/// A future made by this module.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A migration's name: its row in `seaql_migrations`. Never change a shipped one.
pub trait MigrationName {
    fn name(&self) -> &str;
}

/// One migration: its way up, and down (for the tests of an upgrade).
#[async_trait::async_trait]
pub trait MigrationTrait: MigrationName + Send + Sync {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr>;

    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        Err(DbErr::Migration(format!("{} has no way down", self.name())))
    }
}

/// A list of migrations, and the runs over it.
pub trait MigratorTrait {
    /// The migrations, oldest first.
    fn migrations() -> Vec<Box<dyn MigrationTrait>>;

    /// Applies the pending migrations, at most `steps` of them.
    fn up(db: &DatabaseConnection, steps: Option<u32>) -> BoxFuture<'_, Result<(), DbErr>> {
        up(db, Self::migrations(), steps)
    }

    /// Reverses the applied migrations, newest first, at most `steps` of them.
    fn down(db: &DatabaseConnection, steps: Option<u32>) -> BoxFuture<'_, Result<(), DbErr>> {
        down(db, Self::migrations(), steps)
    }

    /// The migrations not applied yet.
    fn get_pending_migrations(
        db: &DatabaseConnection,
    ) -> BoxFuture<'_, Result<Vec<Box<dyn MigrationTrait>>, DbErr>> {
        let all = Self::migrations();
        Box::pin(async move {
            install(db).await?;
            Ok(split(all, applied(db).await?)?.pending)
        })
    }
}

/// What a migration's `up` and `down` are given: the connection, and the schema statements
/// (sea-orm-migration's names; not its `has_table`/`has_column`/`has_index` probes, which needed
/// sea-schema: a migration asks the catalogue itself, or uses `IF NOT EXISTS`).
pub struct SchemaManager<'c> {
    conn: SchemaManagerConnection<'c>,
}

impl<'c> SchemaManager<'c> {
    fn new(conn: impl Into<SchemaManagerConnection<'c>>) -> Self {
        Self { conn: conn.into() }
    }

    pub fn get_connection(&self) -> &SchemaManagerConnection<'c> {
        &self.conn
    }

    pub fn get_database_backend(&self) -> DbBackend {
        self.conn.get_database_backend()
    }

    pub async fn create_table(&self, stmt: TableCreateStatement) -> Result<(), DbErr> {
        self.conn.execute(&stmt).await.map(drop)
    }

    pub async fn create_index(&self, stmt: IndexCreateStatement) -> Result<(), DbErr> {
        self.conn.execute(&stmt).await.map(drop)
    }

    pub async fn alter_table(&self, stmt: TableAlterStatement) -> Result<(), DbErr> {
        self.conn.execute(&stmt).await.map(drop)
    }

    pub async fn drop_table(&self, stmt: TableDropStatement) -> Result<(), DbErr> {
        self.conn.execute(&stmt).await.map(drop)
    }
}

/// sea-orm-migration's table, as an entity: `install` creates it from this definition.
mod seaql_migrations {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "seaql_migrations")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub version: String,
        pub applied_at: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

use seaql_migrations::{Column, Entity};

/// The list split by what the database has applied, each part in the list's order.
struct Split {
    applied: Vec<Box<dyn MigrationTrait>>,
    pending: Vec<Box<dyn MigrationTrait>>,
}

fn split(all: Vec<Box<dyn MigrationTrait>>, in_db: HashSet<String>) -> Result<Split, DbErr> {
    let known: HashSet<&str> = all.iter().map(|m| m.name()).collect();
    let mut unknown: Vec<&String> = in_db
        .iter()
        .filter(|v| !known.contains(v.as_str()))
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        let lines: Vec<String> = unknown
            .iter()
            .map(|v| {
                format!(
                    "Migration file of version '{v}' is missing, this migration has been applied but its file is missing"
                )
            })
            .collect();
        return Err(DbErr::Custom(lines.join("\n")));
    }
    let (applied, pending) = all.into_iter().partition(|m| in_db.contains(m.name()));
    Ok(Split { applied, pending })
}

async fn install(db: &DatabaseConnection) -> Result<(), DbErr> {
    let mut stmt = Schema::new(db.get_database_backend()).create_table_from_entity(Entity);
    stmt.if_not_exists();
    db.execute(&stmt).await.map(drop)
}

async fn applied(db: &DatabaseConnection) -> Result<HashSet<String>, DbErr> {
    let stmt = Query::select()
        .column(Column::Version)
        .from(Entity)
        .to_owned();
    db.query_all(&stmt)
        .await?
        .iter()
        .map(|row| row.try_get::<String>("", "version"))
        .collect()
}

async fn record(db: &impl ConnectionTrait, name: &str) -> Result<(), DbErr> {
    let applied_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let stmt = Query::insert()
        .into_table(Entity)
        .columns([Column::Version, Column::AppliedAt])
        .values([name.into(), applied_at.into()])
        .map_err(|e| DbErr::Custom(e.to_string()))?
        .to_owned();
    db.execute(&stmt).await.map(drop)
}

async fn unrecord(db: &impl ConnectionTrait, name: &str) -> Result<(), DbErr> {
    let stmt = Query::delete()
        .from_table(Entity)
        .and_where(Expr::col(Column::Version).eq(name))
        .to_owned();
    db.execute(&stmt).await.map(drop)
}

/// At most `steps` of `list` (all when `None`).
fn limit<T>(list: Vec<T>, steps: Option<u32>) -> impl Iterator<Item = T> {
    let n = steps.map_or(usize::MAX, |s| usize::try_from(s).unwrap_or(usize::MAX));
    list.into_iter().take(n)
}

fn up(
    db: &DatabaseConnection,
    all: Vec<Box<dyn MigrationTrait>>,
    steps: Option<u32>,
) -> BoxFuture<'_, Result<(), DbErr>> {
    Box::pin(async move {
        install(db).await?;
        let pending = split(all, applied(db).await?)?.pending;
        for m in limit(pending, steps) {
            debug!(migration = m.name(), "applying migration");
            if db.get_database_backend() == DbBackend::Postgres {
                let txn = db.begin().await?;
                m.up(&SchemaManager::new(&txn)).await?;
                record(&txn, m.name()).await?;
                txn.commit().await?;
            } else {
                m.up(&SchemaManager::new(db)).await?;
                record(db, m.name()).await?;
            }
        }
        Ok(())
    })
}

fn down(
    db: &DatabaseConnection,
    all: Vec<Box<dyn MigrationTrait>>,
    steps: Option<u32>,
) -> BoxFuture<'_, Result<(), DbErr>> {
    Box::pin(async move {
        install(db).await?;
        let mut applied = split(all, applied(db).await?)?.applied;
        applied.reverse();
        for m in limit(applied, steps) {
            debug!(migration = m.name(), "reversing migration");
            if db.get_database_backend() == DbBackend::Postgres {
                let txn = db.begin().await?;
                m.down(&SchemaManager::new(&txn)).await?;
                unrecord(&txn, m.name()).await?;
                txn.commit().await?;
            } else {
                m.down(&SchemaManager::new(db)).await?;
                unrecord(db, m.name()).await?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use sea_orm::{Database, Statement};

    use super::prelude::*;
    use super::*;

    /// What sea-orm-migration 2.0.4 created on SQLite (read from a database it migrated).
    const SEA_ORM_MIGRATION_TABLE: &str = "CREATE TABLE \"seaql_migrations\" ( \"version\" varchar NOT NULL PRIMARY KEY, \"applied_at\" integer NOT NULL )";

    /// A migration that creates (and on the way down drops) a table named after it.
    struct Make(&'static str);

    impl MigrationName for Make {
        fn name(&self) -> &str {
            self.0
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for Make {
        async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.get_connection()
                .execute_unprepared(&format!("CREATE TABLE {} (x INTEGER)", self.0))
                .await
                .map(drop)
        }

        async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
            m.drop_table(Table::drop().table(Alias::new(self.0)).to_owned())
                .await
        }
    }

    struct Three;

    impl MigratorTrait for Three {
        fn migrations() -> Vec<Box<dyn MigrationTrait>> {
            vec![
                Box::new(Make("ma")),
                Box::new(Make("mb")),
                Box::new(Make("mc")),
            ]
        }
    }

    async fn strings(db: &DatabaseConnection, sql: &str) -> Vec<String> {
        db.query_all_raw(Statement::from_string(DbBackend::Sqlite, sql))
            .await
            .unwrap()
            .iter()
            .map(|r| r.try_get_by_index::<String>(0).unwrap())
            .collect()
    }

    async fn tables(db: &DatabaseConnection) -> Vec<String> {
        strings(
            db,
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'm_' ORDER BY name",
        )
        .await
    }

    async fn versions(db: &DatabaseConnection) -> Vec<String> {
        strings(db, "SELECT version FROM seaql_migrations ORDER BY version").await
    }

    async fn fresh() -> (tempfile::TempDir, DatabaseConnection) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/m.db?mode=rwc", dir.path().display());
        let db = Database::connect(&url).await.unwrap();
        (dir, db)
    }

    #[tokio::test]
    async fn the_table_is_the_one_sea_orm_migration_made() {
        let (_dir, db) = fresh().await;
        Three::up(&db, Some(0)).await.unwrap();
        let sql = strings(
            &db,
            "SELECT sql FROM sqlite_master WHERE name = 'seaql_migrations'",
        )
        .await;
        assert_eq!(sql, [SEA_ORM_MIGRATION_TABLE]);
        assert_eq!(Three::get_pending_migrations(&db).await.unwrap().len(), 3);
    }

    /// A database sea-orm-migration left with two migrations applied gets only the third.
    #[tokio::test]
    async fn a_database_sea_orm_migration_left_gets_only_what_it_lacks() {
        let (_dir, db) = fresh().await;
        db.execute_unprepared(SEA_ORM_MIGRATION_TABLE)
            .await
            .unwrap();
        db.execute_unprepared(
            "INSERT INTO seaql_migrations VALUES ('ma', 1795990425), ('mb', 1795990425)",
        )
        .await
        .unwrap();
        Three::up(&db, None).await.unwrap();
        assert_eq!(tables(&db).await, ["mc"]);
        assert_eq!(versions(&db).await, ["ma", "mb", "mc"]);
        assert!(Three::get_pending_migrations(&db).await.unwrap().is_empty());
        // Again: nothing to do.
        Three::up(&db, None).await.unwrap();
        assert_eq!(versions(&db).await, ["ma", "mb", "mc"]);
    }

    #[tokio::test]
    async fn steps_bound_the_way_up_and_down() {
        let (_dir, db) = fresh().await;
        Three::up(&db, Some(2)).await.unwrap();
        assert_eq!(tables(&db).await, ["ma", "mb"]);
        Three::up(&db, None).await.unwrap();
        assert_eq!(tables(&db).await, ["ma", "mb", "mc"]);
        // Newest first.
        Three::down(&db, Some(2)).await.unwrap();
        assert_eq!(tables(&db).await, ["ma"]);
        assert_eq!(versions(&db).await, ["ma"]);
        Three::down(&db, None).await.unwrap();
        assert!(tables(&db).await.is_empty());
        assert!(versions(&db).await.is_empty());
    }

    /// A row this binary has no migration for (a newer binary ran) stops the run before any
    /// migration is applied.
    #[tokio::test]
    async fn an_unknown_applied_migration_fails_the_run() {
        let (_dir, db) = fresh().await;
        Three::up(&db, Some(0)).await.unwrap();
        db.execute_unprepared("INSERT INTO seaql_migrations VALUES ('m9_newer', 1)")
            .await
            .unwrap();
        let e = Three::up(&db, None).await.unwrap_err().to_string();
        assert!(e.contains("'m9_newer' is missing"), "{e}");
        assert!(tables(&db).await.is_empty());
        assert!(Three::get_pending_migrations(&db).await.is_err());
    }
}
