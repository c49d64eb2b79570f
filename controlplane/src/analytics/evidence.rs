//! Which signals an agent's analytics count: its *evidence*, an agent setting
//! (`crate::agents`). By default only explicit signals (sent by the application) count;
//! an operator may let implicit ones (inferred by the dataplane's rules) count too, and the
//! rule `continued` (an answer carried back unchanged) as a success.
//!
//! An explicit signal always wins: a unit (a session, or an answer explicit signals name) with
//! any explicit signal in the window has the outcome of its explicit signals; only a unit with
//! none takes the outcome of its implicit ones (the last decides, as for explicit signals). So
//! adding implicit evidence never changes the outcome of a unit the application labelled.
//!
//! Over the rollup this is a view of `session_rollups` ([`Evidence::rollup`]) whose columns are
//! the effective ones; over raw rows, [`Evidence::session_from_rows`] folds the same way.

use sea_orm::ConnectionTrait;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sql::Sql;

/// Which signals count (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// Implicit signals count where a unit has no explicit one.
    pub implicit: bool,
    /// With `implicit`: the rule `continued` counts as a success (else it is no outcome).
    pub continued: bool,
}

/// The largest key (`time · 4 + class`) of `a` and `b`, either NULL (both databases: SQLite's
/// two-argument `MAX` is NULL when either is).
fn greatest(a: &str, b: &str) -> String {
    format!("CASE WHEN {a} IS NULL THEN {b} WHEN {b} IS NULL OR {a} >= {b} THEN {a} ELSE {b} END")
}

impl Evidence {
    /// Explicit signals only (the default).
    pub const EXPLICIT: Evidence = Evidence {
        implicit: false,
        continued: false,
    };

    /// As the evidence lines say it.
    pub fn label(self) -> &'static str {
        if self.implicit {
            "explicit + implicit"
        } else {
            "explicit"
        }
    }

    /// The rollup's implicit key of a row (or of grouped rows, `max` wrapping each column).
    fn implicit_key(self, isig_key: &str, icont_key: &str) -> String {
        if self.continued {
            greatest(isig_key, icont_key)
        } else {
            isig_key.to_owned()
        }
    }

    /// What the analytics read as `session_rollups`: the table itself for explicit evidence,
    /// else a view with the effective columns (and with `indexed`, SQLite's index hint, which
    /// the view does not take: its planner picks).
    pub(crate) fn rollup(self, indexed: &str) -> String {
        if !self.implicit {
            return format!("session_rollups{indexed}");
        }
        self.view("", "")
    }

    /// The view of [`Evidence::rollup`] over the rows of `session_rollups` that pass `filter`
    /// (a condition on the table's own columns), read through the index `indexed` names
    /// (SQLite's hint, or empty). Implicit evidence only.
    pub(crate) fn rollup_where(self, indexed: &str, filter: &str) -> String {
        debug_assert!(self.implicit, "explicit evidence reads the table itself");
        self.view(indexed, &format!(" WHERE {filter}"))
    }

    /// The rollup rows without any explicit signal and with implicit ones (`continued`
    /// aside), as implicit evidence without `continued` sees them, read through `indexed`:
    /// their effective columns are their implicit ones. Fewer columns than [`Evidence::rollup`]'s
    /// view, so that an index of `analytics::query::implicit_beside` covers them.
    pub(crate) fn implicit_only(indexed: &str) -> String {
        format!(
            "(SELECT agent, session_id, last_active_ms, first_request_ms, requests, cost, \
             CASE WHEN ifirst_ms < first_signal_ms OR first_signal_ms IS NULL THEN ifirst_ms \
             ELSE first_signal_ms END AS first_signal_ms, \
             isignals AS signals, isig_key % 4 AS cls, iregens AS regens, iheavy AS heavy \
             FROM session_rollups{indexed} WHERE {} AND signals = 0 AND isignals > 0) \
             AS session_rollups",
            IMPLICIT_ROWS
        )
    }

    fn view(self, indexed: &str, filter: &str) -> String {
        let key = format!(
            "CASE WHEN signals > 0 THEN sig_key ELSE {} END",
            self.implicit_key("isig_key", "icont_key")
        );
        let count = if self.continued {
            "isignals + icont"
        } else {
            "isignals"
        };
        format!(
            "(SELECT agent, session_id, last_active_ms, first_request_ms, last_request_ms, \
             requests, cost, model_min, model_max, provider_min, provider_max, env, user_id, \
             ttfb, ttfb_band, \
             CASE WHEN ifirst_ms < first_signal_ms OR first_signal_ms IS NULL THEN ifirst_ms \
             ELSE first_signal_ms END AS first_signal_ms, \
             CASE WHEN signals > 0 THEN signals ELSE {count} END AS signals, \
             {key} AS sig_key, ({key}) % 4 AS cls, \
             (({key}) / 4 + 259200000) / 604800000 AS week, \
             CASE WHEN signals > 0 THEN regens ELSE iregens END AS regens, \
             CASE WHEN signals > 0 THEN heavy ELSE iheavy END AS heavy \
             FROM session_rollups{indexed}{filter}) AS session_rollups"
        )
    }

    /// A unit of the per-unit table `s` from its rows (explicit and implicit signals and
    /// requests in the shape of `rollup::signal_rows`), grouped by unit; `esignals` is its
    /// number of explicit signals, whatever the evidence.
    pub(crate) fn session_from_rows(self) -> String {
        let (key, regens, heavy, signals) = if self.implicit {
            let count = if self.continued {
                "SUM(is_isig) + SUM(icont)"
            } else {
                "SUM(is_isig)"
            };
            (
                format!(
                    "CASE WHEN SUM(is_sig) > 0 THEN MAX(sig_key) ELSE {} END",
                    self.implicit_key("MAX(isig_key)", "MAX(icont_key)")
                ),
                "CASE WHEN SUM(is_sig) > 0 THEN SUM(regen) ELSE SUM(iregen) END".to_owned(),
                "CASE WHEN SUM(is_sig) > 0 THEN SUM(heavy) ELSE SUM(iheavy) END".to_owned(),
                format!("CASE WHEN SUM(is_sig) > 0 THEN SUM(is_sig) ELSE {count} END"),
            )
        } else {
            (
                "MAX(sig_key)".to_owned(),
                "SUM(regen)".to_owned(),
                "SUM(heavy)".to_owned(),
                "SUM(is_sig)".to_owned(),
            )
        };
        format!(
            "({key}) % 4 AS cls, ({key}) / 4 AS last_ms, \
             CAST({regens} AS BIGINT) AS regens, CAST({heavy} AS BIGINT) AS heavy, \
             CAST({signals} AS BIGINT) AS signals, CAST(SUM(is_sig) AS BIGINT) AS esignals, \
             CASE WHEN MIN(model) = MAX(model) THEN MIN(model) END AS model, \
             CASE WHEN MIN(provider) = MAX(provider) THEN MIN(provider) END AS provider, \
             MAX(env) AS env, MAX(user_id) AS user_id, CAST(SUM(cost) AS BIGINT) AS cost, \
             MAX(ttfb) AS ttfb, CAST(SUM(1 - is_sig - is_isig - icont) AS BIGINT) AS requests"
        )
    }
}

/// The partial index of the rollup rows with implicit signals (m0020), which the implicit
/// total beside explicit evidence reads (`query::implicit_beside`), and its condition: a query
/// reading it holds the condition as one of its `WHERE`'s terms.
pub(crate) const IMPLICIT_INDEX: &str = "idx_session_rollups_implicit";
pub(crate) const IMPLICIT_ROWS: &str = "(isignals > 0 OR icont > 0)";

/// `agent_settings.evidence` values.
const STORED_EXPLICIT: &str = "explicit";
const STORED_IMPLICIT: &str = "explicit+implicit";

impl Evidence {
    /// As stored and as the CLI takes it: `explicit` or `explicit+implicit`.
    pub fn stored(self) -> &'static str {
        if self.implicit {
            STORED_IMPLICIT
        } else {
            STORED_EXPLICIT
        }
    }

    /// From the stored (or CLI) words and the `continued` switch (which needs implicit
    /// evidence).
    pub fn parse(evidence: &str, continued: bool) -> Result<Evidence> {
        let implicit = match evidence {
            STORED_EXPLICIT => false,
            STORED_IMPLICIT => true,
            _ => {
                return Err(Error::InvalidArgument(
                    "evidence must be explicit or explicit+implicit".to_owned(),
                ));
            }
        };
        if continued && !implicit {
            return Err(Error::InvalidArgument(
                "continued counts only with evidence explicit+implicit".to_owned(),
            ));
        }
        Ok(Evidence {
            implicit,
            continued,
        })
    }

    /// A name for each of the three settings (the key of the intervals each keeps).
    pub fn key(self) -> &'static str {
        match (self.implicit, self.continued) {
            (false, _) => STORED_EXPLICIT,
            (true, false) => STORED_IMPLICIT,
            (true, true) => "explicit+implicit+continued",
        }
    }

    /// The condition on `signals` rows that keeps the signals this evidence counts.
    pub(crate) fn signal_filter(self) -> &'static str {
        match (self.implicit, self.continued) {
            (false, _) => "source = 'explicit'",
            (true, false) => "(source = 'explicit' OR rule <> 'continued')",
            (true, true) => "source IN ('explicit', 'implicit')",
        }
    }
}

/// An agent's evidence setting and when it was last set (`None`: never, the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Setting {
    pub evidence: Evidence,
    pub updated_at_ms: Option<i64>,
}

/// The evidence setting of `agent` (the default when none is stored).
pub async fn load<C: ConnectionTrait>(db: &C, agent: &str) -> Result<Setting> {
    let mut sql = Sql::new(
        db.get_database_backend(),
        "SELECT evidence, continued_counts, updated_at_ms FROM agent_settings WHERE agent = ",
    );
    sql.bind(agent.to_owned());
    let Some(row) = db.query_one_raw(sql.build()).await? else {
        return Ok(Setting::default());
    };
    let evidence: String = row.try_get("", "evidence")?;
    let continued: bool = row.try_get("", "continued_counts")?;
    Ok(Setting {
        evidence: Evidence::parse(&evidence, continued)?,
        updated_at_ms: Some(row.try_get("", "updated_at_ms")?),
    })
}

/// Stores the evidence setting of `agent`.
pub async fn save<C: ConnectionTrait>(
    db: &C,
    agent: &str,
    evidence: Evidence,
    now_ms: i64,
) -> Result<()> {
    let mut sql = Sql::new(
        db.get_database_backend(),
        "INSERT INTO agent_settings (agent, evidence, continued_counts, updated_at_ms) VALUES (",
    );
    sql.bind(agent.to_owned())
        .push(", ")
        .bind(evidence.stored())
        .push(", ")
        .bind(evidence.continued)
        .push(", ")
        .bind(now_ms)
        .push(
            ") ON CONFLICT (agent) DO UPDATE SET evidence = excluded.evidence, \
             continued_counts = excluded.continued_counts, updated_at_ms = excluded.updated_at_ms",
        );
    db.execute_raw(sql.build()).await?;
    Ok(())
}

/// The evidence settings whose counts `signal_rollups` keeps, with their columns' prefix
/// (`explicit_signals`, `explicit_first_ms`, `explicit_last_ms`, ...).
pub(crate) const SIGNAL_ROLLUPS: [(&str, Evidence); 3] = [
    (
        "explicit",
        Evidence {
            implicit: false,
            continued: false,
        },
    ),
    (
        "implicit",
        Evidence {
            implicit: true,
            continued: false,
        },
    ),
    (
        "continued",
        Evidence {
            implicit: true,
            continued: true,
        },
    ),
];

/// The prefix of the `signal_rollups` columns that hold the signals `evidence` counts.
pub(crate) fn signal_rollup_prefix(evidence: Evidence) -> &'static str {
    SIGNAL_ROLLUPS
        .iter()
        .find(|(_, e)| e.key() == evidence.key())
        .map_or("explicit", |(prefix, _)| prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_print() {
        for ev in [
            Evidence::EXPLICIT,
            Evidence {
                implicit: true,
                continued: false,
            },
            Evidence {
                implicit: true,
                continued: true,
            },
        ] {
            assert_eq!(Evidence::parse(ev.stored(), ev.continued).ok(), Some(ev));
        }
        assert!(Evidence::parse("explicit", true).is_err());
        assert!(Evidence::parse("implicit", false).is_err());
        assert_eq!(Evidence::EXPLICIT.label(), "explicit");
    }
}
