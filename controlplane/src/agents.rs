//! What an operator reads and sets about an agent beyond its analytics: its settings (which
//! evidence its analytics count, [`crate::analytics::Evidence`]), its signals counted by source
//! and rule, how its explicit and implicit outcomes agree where both exist for the same unit,
//! and the stored signals themselves, a page at a time (source, rule, request id, action, edit
//! distance, time, session), so nobody needs to open the database to see what was recorded.

use sea_orm::ConnectionTrait;

use crate::analytics::evidence::{self, Evidence, Setting};
use crate::analytics::evidence::{IMPLICIT_INDEX, IMPLICIT_ROWS};
use crate::error::{Error, Result};
use crate::signals::{ActionCounts, SignalFilter, push_range};
use crate::sql::{Sql, count};
use crate::store::Store;
use nm_types::signal::Rule;
use nm_types::{Action, SessionId};

/// Signals of one source (and rule) per action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceCount {
    /// `explicit` or `implicit`.
    pub source: String,
    /// The rule of implicit signals.
    pub rule: Option<Rule>,
    pub total: u64,
    pub by_action: ActionCounts,
}

/// An outcome as the agreement table names it.
pub const OUTCOMES: [&str; 4] = ["success", "failure", "abandoned", "continued"];

/// One cell of the agreement table: units whose explicit outcome is `explicit` and whose
/// implicit one is `implicit` (an outcome of [`OUTCOMES`]; `continued` only on the implicit
/// side, when `continued` is the unit's only implicit signal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgreementCell {
    pub explicit: &'static str,
    pub implicit: &'static str,
    pub units: u64,
}

/// A stored signal, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSignal {
    pub id: String,
    pub source: String,
    pub rule: Option<String>,
    pub request_id: Option<String>,
    pub action: String,
    pub edit_distance: Option<u64>,
    pub received_at_ms: i64,
    /// Empty while a signal that named only an answer waits for that answer's record.
    pub session_id: String,
    pub agent: Option<String>,
    pub env: Option<String>,
}

/// Whose signals to list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Agent(String),
    Session(String),
}

/// One page of signals, newest first, and the token of the next (`None`: the last page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalPage {
    pub signals: Vec<StoredSignal>,
    pub next_page_token: Option<String>,
}

/// Default and largest page of [`Agents::list_signals`].
pub const DEFAULT_PAGE: u32 = 100;
pub const MAX_PAGE: u32 = 1000;

/// Agent settings, counts by source and the signal list. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Agents {
    store: Store,
}

fn agent_name(agent: &str) -> Result<String> {
    nm_types::parse_agent(agent).map_err(|e| Error::InvalidArgument(format!("agent: {e}")))
}

impl Agents {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    /// The agent's settings (the defaults when never set).
    pub fn settings<'a>(&'a self, agent: &'a str) -> crate::BoxFuture<'a, Result<Setting>> {
        Box::pin(async move {
            let agent = agent_name(agent)?;
            evidence::load(self.store.conn(), &agent).await
        })
    }

    /// Sets the agent's evidence. The analytics use it from their next computation; the
    /// intervals kept from looks that counted other signals are not carried over.
    /// Sets which evidence counts for `agent`, written to the audit trail as `actor`'s change
    /// in the same transaction.
    pub fn set_settings<'a>(
        &'a self,
        actor: &'a str,
        agent: &'a str,
        evidence: Evidence,
    ) -> crate::BoxFuture<'a, Result<Setting>> {
        Box::pin(async move {
            let agent = agent_name(agent)?;
            let now_ms = crate::now_ms();
            let txn = self.store.begin_write().await?;
            let before = evidence::load(&txn, &agent).await?;
            evidence::save(&txn, &agent, evidence, now_ms).await?;
            let json = |s: &Setting| {
                serde_json::json!({
                    "evidence": s.evidence.stored(),
                    "continued_counts": s.evidence.continued,
                })
            };
            let after = Setting {
                evidence,
                updated_at_ms: Some(now_ms),
            };
            let change = crate::audit::Change {
                actor,
                action: "agent.settings.set",
                target: &format!("agent:{agent}"),
                before: before.updated_at_ms.map(|_| json(&before)),
                after: Some(json(&after)),
            };
            crate::audit::record(&txn, change, now_ms).await?;
            txn.commit().await?;
            Ok(after)
        })
    }

    /// The agent's (or the unattributed bucket's) signals per source, rule and action:
    /// explicit first, then implicit by rule, sources without signals left out.
    pub fn source_counts<'a>(
        &'a self,
        f: &'a SignalFilter,
    ) -> crate::BoxFuture<'a, Result<Vec<SourceCount>>> {
        Box::pin(async move {
            let db = self.store.conn();
            fold_counts(
                db.query_all_raw(source_counts_statement(db.get_database_backend(), f))
                    .await?,
            )
        })
    }

    /// A session's signals per source, rule and action.
    pub fn session_source_counts<'a>(
        &'a self,
        session_id: &'a str,
    ) -> crate::BoxFuture<'a, Result<Vec<SourceCount>>> {
        Box::pin(async move {
            session_id
                .parse::<SessionId>()
                .map_err(|e| Error::InvalidArgument(format!("session_id: {e}")))?;
            let db = self.store.conn();
            let mut sql = Sql::new(
                db.get_database_backend(),
                "SELECT source, rule, action, COUNT(*) AS n FROM signals WHERE session_id = ",
            );
            sql.bind(session_id.to_owned())
                .push(" GROUP BY source, rule, action");
            fold_counts(db.query_all_raw(sql.build()).await?)
        })
    }

    /// How the agent's explicit and implicit outcomes agree, over every unit (a session, or an
    /// answer explicit signals name) that has both: units by (explicit outcome, implicit
    /// outcome), each outcome the last signal's of its kind (an implicit `continued` only
    /// where the unit has no other implicit signal). Read from the analytics rollup.
    pub fn agreement<'a>(
        &'a self,
        agent: &'a str,
    ) -> crate::BoxFuture<'a, Result<Vec<AgreementCell>>> {
        Box::pin(async move {
            let agent = agent_name(agent)?;
            let db = self.store.conn();
            let mut sql = Sql::new(
                db.get_database_backend(),
                &format!(
                    "SELECT cls, CASE WHEN isignals > 0 THEN isig_key % 4 ELSE 3 END AS icls, \
                 COUNT(*) AS n FROM session_rollups{} WHERE agent = ",
                    match db.get_database_backend() {
                        sea_orm::DatabaseBackend::Sqlite => format!(" INDEXED BY {IMPLICIT_INDEX}"),
                        _ => String::new(),
                    }
                ),
            );
            // Only the units with implicit signals: the partial index of exactly those rows.
            sql.bind(agent).push(&format!(
                " AND signals > 0 AND {IMPLICIT_ROWS} GROUP BY cls, \
             CASE WHEN isignals > 0 THEN isig_key % 4 ELSE 3 END"
            ));
            let name = |cls: i64| match cls {
                1 => OUTCOMES[0],
                2 => OUTCOMES[2],
                3 => OUTCOMES[3],
                _ => OUTCOMES[1],
            };
            let mut cells = Vec::new();
            for row in db.query_all_raw(sql.build()).await? {
                let cls: Option<i64> = row.try_get("", "cls")?;
                let icls: Option<i64> = row.try_get("", "icls")?;
                cells.push(AgreementCell {
                    explicit: name(cls.unwrap_or(0)),
                    implicit: name(icls.unwrap_or(0)),
                    units: count(&row, "n")?,
                });
            }
            cells.sort_by_key(|c| {
                (
                    OUTCOMES.iter().position(|o| *o == c.explicit),
                    OUTCOMES.iter().position(|o| *o == c.implicit),
                )
            });
            Ok(cells)
        })
    }

    /// A page of the stored signals of an agent or a session, newest first (by time, then id),
    /// at most `page_size` ([`DEFAULT_PAGE`] when 0, at most [`MAX_PAGE`]), after the page
    /// `page_token` ended (empty: the first page); with `source`, of that source only.
    pub fn list_signals<'a>(
        &'a self,
        scope: &'a Scope,
        source: Option<&'a str>,
        page_size: u32,
        page_token: &'a str,
    ) -> crate::BoxFuture<'a, Result<SignalPage>> {
        Box::pin(async move {
            let size = match page_size {
                0 => DEFAULT_PAGE,
                n => n.min(MAX_PAGE),
            };
            let after = match page_token {
                "" => None,
                t => Some(parse_token(t)?),
            };
            if let Some(s) = source
                && s != "explicit"
                && s != "implicit"
            {
                return Err(Error::InvalidArgument(
                    "source must be explicit or implicit".to_owned(),
                ));
            }
            let db = self.store.conn();
            let mut sql = Sql::new(
                db.get_database_backend(),
                "SELECT id, source, rule, request_id, action, edit_distance, received_at_ms, \
             session_id, agent, env FROM signals WHERE ",
            );
            match scope {
                Scope::Agent(agent) => sql.push("agent = ").bind(agent_name(agent)?),
                Scope::Session(session) => {
                    session
                        .parse::<SessionId>()
                        .map_err(|e| Error::InvalidArgument(format!("session_id: {e}")))?;
                    sql.push("session_id = ").bind(session.clone())
                }
            };
            if let Some(s) = source {
                sql.push(" AND source = ").bind(s.to_owned());
            }
            if let Some((at, id)) = after {
                sql.push(" AND (received_at_ms < ")
                    .bind(at)
                    .push(" OR (received_at_ms = ")
                    .bind(at)
                    .push(" AND id < ")
                    .bind(id)
                    .push("))");
            }
            sql.push(" ORDER BY received_at_ms DESC, id DESC LIMIT ")
                .bind(i64::from(size) + 1);
            let mut signals = Vec::new();
            for row in db.query_all_raw(sql.build()).await? {
                let distance: Option<i64> = row.try_get("", "edit_distance")?;
                signals.push(StoredSignal {
                    id: row.try_get("", "id")?,
                    source: row.try_get("", "source")?,
                    rule: row.try_get("", "rule")?,
                    request_id: row.try_get("", "request_id")?,
                    action: row.try_get("", "action")?,
                    edit_distance: distance.and_then(|d| u64::try_from(d).ok()),
                    received_at_ms: row.try_get("", "received_at_ms")?,
                    session_id: row.try_get("", "session_id")?,
                    agent: row.try_get("", "agent")?,
                    env: row.try_get("", "env")?,
                });
            }
            let more = signals.len() > size as usize;
            signals.truncate(size as usize);
            let next_page_token = more
                .then(|| {
                    signals
                        .last()
                        .map(|s| format!("{}:{}", s.received_at_ms, s.id))
                })
                .flatten();
            Ok(SignalPage {
                signals,
                next_page_token,
            })
        })
    }
}

/// A page token: `<time>:<id>` of the last signal of the page before.
fn parse_token(t: &str) -> Result<(i64, String)> {
    let bad = || Error::InvalidArgument("page_token: not a token this API returned".to_owned());
    let (at, id) = t.split_once(':').ok_or_else(bad)?;
    if id.is_empty() || id.len() > 128 {
        return Err(bad());
    }
    Ok((at.parse().map_err(|_| bad())?, id.to_owned()))
}

/// Rows of (source, rule, action, n) folded into one count per source and rule.
/// The statement of [`Agents::source_counts`]. On SQLite it reads the index of the signals in
/// the `GROUP BY`'s order (m0021, `idx_signals_agent_counts`), so the groups come as the index is
/// read, without a sort.
fn source_counts_statement(
    backend: sea_orm::DatabaseBackend,
    f: &SignalFilter,
) -> sea_orm::Statement {
    // Named: without statistics SQLite's planner may take the index in time order and sort.
    let indexed = match backend {
        sea_orm::DatabaseBackend::Sqlite => " INDEXED BY idx_signals_agent_counts",
        _ => "",
    };
    let mut sql = Sql::new(
        backend,
        &format!("SELECT source, rule, action, COUNT(*) AS n FROM signals{indexed} WHERE "),
    );
    match &f.agent {
        Some(agent) => sql.push("agent = ").bind(agent.clone()),
        None => sql.push("agent IS NULL"),
    };
    push_range(&mut sql, "received_at_ms", f.env, f.since_ms, f.until_ms);
    sql.push(" GROUP BY source, rule, action");
    sql.build()
}

fn fold_counts(rows: Vec<sea_orm::QueryResult>) -> Result<Vec<SourceCount>> {
    let mut out: Vec<SourceCount> = Vec::new();
    for row in rows {
        let source: String = row.try_get("", "source")?;
        let rule: Option<String> = row.try_get("", "rule")?;
        let rule = rule.and_then(|r| r.parse::<Rule>().ok());
        let action: String = row.try_get("", "action")?;
        let n = count(&row, "n")?;
        let i = match out
            .iter()
            .position(|c| c.source == source && c.rule == rule)
        {
            Some(i) => i,
            None => {
                out.push(SourceCount {
                    source,
                    rule,
                    total: 0,
                    by_action: ActionCounts::default(),
                });
                out.len() - 1
            }
        };
        out[i].total += n;
        if let Some(a) = Action::ALL.iter().position(|a| a.as_str() == action) {
            out[i].by_action.0[a] += n;
        }
    }
    out.sort_by_key(|c| (c.source != "explicit", c.rule));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite counts an agent's signals by source, rule and action in the order of an index
    /// (m0021), never sorting them, with or without a time range.
    #[tokio::test]
    async fn counts_by_source_read_the_index_in_order_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::connect(&format!("sqlite://{}/t.db?mode=rwc", dir.path().display()))
            .await
            .unwrap();
        let db = store.conn();
        for (since_ms, until_ms) in [(None, None), (Some(1), Some(i64::MAX))] {
            let f = SignalFilter {
                agent: Some("a".to_owned()),
                env: None,
                since_ms,
                until_ms,
            };
            let statement = source_counts_statement(db.get_database_backend(), &f);
            let plan = crate::sql::query_plan(db, &statement).await;
            assert!(
                plan.iter()
                    .any(|d| d.contains("COVERING INDEX idx_signals_agent_counts")),
                "{plan:?}"
            );
            assert!(!plan.iter().any(|d| d.contains("TEMP B-TREE")), "{plan:?}");
        }
    }

    #[test]
    fn page_tokens_round_trip_and_refuse_garbage() {
        assert_eq!(
            parse_token("1700000000000:a:b").ok(),
            Some((1_700_000_000_000, "a:b".to_owned()))
        );
        for bad in ["", "x:1", "12", "12:"] {
            assert!(parse_token(bad).is_err(), "{bad}");
        }
    }
}
