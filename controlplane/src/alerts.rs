//! Alerts: webhooks an operator registers, and the events the controlplane sends them (a budget
//! crossing a threshold, a key close to its expiry, a new recommendation, an experiment's
//! decision).
//!
//! **Once per event.** Each event has a *dedupe key* that names what happened (`key_expiry:<key
//! id>:<expiry>:<7d|1d>`, `recommendation:<agent>:<kind>:<subject>:<look>`...): [`Alerts::emit`]
//! stores it with `ON CONFLICT DO NOTHING` in one transaction with one delivery row per webhook
//! that subscribed to its kind, so an event seen twice (a second look, a second replica) is
//! sent once.
//!
//! **Delivery never blocks anything.** Emitting is one short write from the task that noticed
//! the event, never from a request; a worker task sends due deliveries ([`Alerts::spawn_worker`])
//! through a [`Sender`] (the root's HTTP client). Each delivery is claimed first (its next try
//! pushed a minute ahead by a conditional update), so two replicas never send the same one at
//! the same time; receivers still dedupe by the event id (`NM-Event-Id`), as a delivery whose
//! answer was lost is sent again. A failed try (no answer, or not 2xx) is retried with a
//! doubling delay from `retry` up to [`MAX_RETRY_DELAY`], until the event is older than
//! [`GIVE_UP_AFTER`] (at least an hour of tries); then the delivery is `failed`.
//!
//! **Signed.** The body is JSON (or Slack's `{"text": ...}` for a webhook made so), with
//! `NM-Signature: t=<unix seconds>,v1=<hex HMAC-SHA-256 of "<t>.<body>" under the webhook's
//! secret>`; the secret is shown once, when the webhook is added.

use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rand::RngCore;
use sea_orm::{ConnectionTrait, QueryResult};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{Notify, watch};
use tracing::{Instrument, debug, info, warn};

use crate::audit::{self, Change};
use crate::error::{Error, Result};
use crate::now_ms;
use crate::sql::{Sql, count};
use crate::store::Store;

/// What an alert is about; a webhook subscribes to some or all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A budget's spend crossed 50%, 80% or 100% of its limit in a period.
    Budget,
    /// A key expires within 7 days, then within a day.
    KeyExpiry,
    /// An agent's analytics made a recommendation it did not make at the previous look.
    Recommendation,
    /// An experiment was decided, stopped by a guardrail, or ended inconclusive.
    Experiment,
    /// Sent by `alerts test`.
    Test,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Self::Budget,
        Self::KeyExpiry,
        Self::Recommendation,
        Self::Experiment,
        Self::Test,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Budget => "budget",
            Self::KeyExpiry => "key_expiry",
            Self::Recommendation => "recommendation",
            Self::Experiment => "experiment",
            Self::Test => "test",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// A webhook's body format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// The event as JSON.
    Json,
    /// `{"text": "<one line>"}`, which Slack's incoming webhooks (and Mattermost, Discord's
    /// Slack-compatible endpoint) read.
    Slack,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Slack => "slack",
        }
    }

    fn parse(s: &str) -> Self {
        if s == "slack" {
            Self::Slack
        } else {
            Self::Json
        }
    }
}

/// Longest webhook URL.
pub const MAX_URL_LEN: usize = 2048;
/// Most webhooks.
pub const MAX_WEBHOOKS: u64 = 100;
/// Longest delay between two tries of a delivery.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(15 * 60);
/// A delivery is tried until its event is this old (then `failed`).
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(65 * 60);
/// How long a claimed delivery is held before another worker may try it.
const CLAIM: Duration = Duration::from_secs(60);
/// Deliveries sent per pass of the worker.
const BATCH: u64 = 32;
/// How often the worker looks for keys close to their expiry (one read of `api_keys`).
const EXPIRY_CHECK: Duration = Duration::from_secs(5);
/// How far ahead a key's expiry is announced, and again when it is this close.
const EXPIRY_NOTICES: [(&str, i64); 2] = [("7d", 7 * 86_400_000), ("1d", 86_400_000)];

/// A registered webhook (its secret is never read back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Webhook {
    pub id: String,
    pub url: String,
    /// The kinds it receives.
    pub kinds: Vec<Kind>,
    pub format: Format,
    pub description: String,
    pub created_at_ms: i64,
}

/// A webhook just added: the only moment its secret is known.
#[derive(Debug, Clone)]
pub struct AddedWebhook {
    pub webhook: Webhook,
    pub secret: String,
}

/// One delivery of one event to one webhook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delivery {
    pub event_id: String,
    pub webhook_id: String,
    pub kind: String,
    pub event_at_ms: i64,
    /// `pending`, `delivered` or `failed`.
    pub state: String,
    pub attempts: u64,
    /// The receiver's last HTTP status, when it answered.
    pub last_status: Option<u16>,
    /// Why the last try failed, in words.
    pub last_error: Option<String>,
    pub next_at_ms: Option<i64>,
    pub updated_at_ms: i64,
}

/// A POST to a webhook, as the worker asks for it.
#[derive(Debug, Clone)]
pub struct Post {
    pub url: String,
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

/// How a POST ended: the receiver's status, or why there was none.
pub type Sent = std::result::Result<u16, String>;

/// Sends webhook POSTs: the root's HTTP client (the controlplane has none of its own).
pub trait Sender: Send + Sync + 'static {
    fn post(&self, post: Post) -> Pin<Box<dyn Future<Output = Sent> + Send + '_>>;
}

/// Told of each try's outcome (`delivered`, `retried`, `failed`): the process's metrics.
pub type Observer = Box<dyn Fn(&'static str) + Send + Sync>;

/// The alerts: webhooks, events and their deliveries.
#[derive(Clone)]
pub struct Alerts {
    store: Store,
    wake: Arc<Notify>,
    observer: Arc<OnceLock<Observer>>,
}

impl std::fmt::Debug for Alerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerts").finish_non_exhaustive()
    }
}

impl Alerts {
    pub fn new(store: Store) -> Self {
        Self {
            store,
            wake: Arc::new(Notify::new()),
            observer: Arc::default(),
        }
    }

    /// Tells `observer` the outcome of every delivery try from now on (set once: later calls
    /// are ignored).
    pub fn observe(&self, observer: Observer) {
        let _ = self.observer.set(observer);
    }

    /// Registers a webhook for `kinds` (all when empty); audited as `webhook.add`.
    pub fn add<'a>(
        &'a self,
        actor: &'a str,
        url: &'a str,
        kinds: &'a [Kind],
        format: Format,
        description: &'a str,
    ) -> crate::BoxFuture<'a, Result<AddedWebhook>> {
        Box::pin(async move {
            check_url(url)?;
            if description.chars().count() > 1000 || description.chars().any(char::is_control) {
                return Err(Error::InvalidArgument(
                    "description: at most 1000 characters, no control characters".into(),
                ));
            }
            let kinds: Vec<Kind> = if kinds.is_empty() {
                Kind::ALL.to_vec()
            } else {
                let mut k = kinds.to_vec();
                k.sort_by_key(|k| k.as_str());
                k.dedup();
                k
            };
            let mut secret_bytes = [0u8; 32];
            rand::rng().fill_bytes(&mut secret_bytes);
            let secret = format!("whsec_{}", hex(&secret_bytes));
            let now = now_ms();
            let webhook = Webhook {
                id: format!("whk_{}", uuid::Uuid::now_v7().simple()),
                url: url.to_owned(),
                kinds,
                format,
                description: description.to_owned(),
                created_at_ms: now,
            };
            let txn = self.store.begin_write().await?;
            let existing = first_count(
                &txn,
                Sql::new(
                    txn.get_database_backend(),
                    "SELECT COUNT(*) AS n FROM webhooks",
                ),
            )
            .await?;
            if existing >= MAX_WEBHOOKS {
                return Err(Error::InvalidArgument(format!(
                    "at most {MAX_WEBHOOKS} webhooks; remove one first"
                )));
            }
            let mut sql = Sql::new(
                txn.get_database_backend(),
                "INSERT INTO webhooks (id, url, secret, kinds, format, description, created_at_ms) \
             VALUES (",
            );
            sql.bind(webhook.id.as_str())
                .push(", ")
                .bind(url)
                .push(", ")
                .bind(secret.as_str())
                .push(", ")
                .bind(kinds_text(&webhook.kinds))
                .push(", ")
                .bind(format.as_str())
                .push(", ")
                .bind(description)
                .push(", ")
                .bind(now)
                .push(")");
            txn.execute_raw(sql.build()).await?;
            audit::record(
                &txn,
                Change {
                    actor,
                    action: "webhook.add",
                    target: &webhook.id,
                    before: None,
                    after: Some(webhook_json(&webhook)),
                },
                now,
            )
            .await?;
            txn.commit().await?;
            info!(webhook = %webhook.id, kinds = %kinds_text(&webhook.kinds), "webhook added");
            Ok(AddedWebhook { webhook, secret })
        })
    }

    /// Every webhook, oldest first.
    pub fn list(&self) -> crate::BoxFuture<'_, Result<Vec<Webhook>>> {
        Box::pin(async move {
            let sql = Sql::new(
                self.store.backend(),
                "SELECT id, url, kinds, format, description, created_at_ms FROM webhooks \
             ORDER BY created_at_ms, id",
            );
            self.store
                .conn()
                .query_all_raw(sql.build())
                .await?
                .iter()
                .map(webhook_of)
                .collect()
        })
    }

    /// Removes a webhook and its pending deliveries; audited as `webhook.remove`.
    pub fn remove<'a>(
        &'a self,
        actor: &'a str,
        id: &'a str,
    ) -> crate::BoxFuture<'a, Result<Webhook>> {
        Box::pin(async move {
            let now = now_ms();
            let txn = self.store.begin_write().await?;
            let backend = txn.get_database_backend();
            let mut find = Sql::new(
                backend,
                "SELECT id, url, kinds, format, description, created_at_ms FROM webhooks WHERE id = ",
            );
            find.bind(id);
            let webhook = match txn.query_one_raw(find.build()).await? {
                Some(row) => webhook_of(&row)?,
                None => return Err(Error::NotFound(format!("no webhook with id {id:?}"))),
            };
            for table in ["alert_deliveries", "webhooks"] {
                let col = if table == "webhooks" {
                    "id"
                } else {
                    "webhook_id"
                };
                let mut sql = Sql::new(backend, &format!("DELETE FROM {table} WHERE {col} = "));
                sql.bind(id);
                txn.execute_raw(sql.build()).await?;
            }
            audit::record(
                &txn,
                Change {
                    actor,
                    action: "webhook.remove",
                    target: id,
                    before: Some(webhook_json(&webhook)),
                    after: None,
                },
                now,
            )
            .await?;
            txn.commit().await?;
            info!(webhook = %id, "webhook removed");
            Ok(webhook)
        })
    }

    /// Stores an event for every webhook of its kind, once per `dedupe` key; returns its id, or
    /// `None` when the same event was emitted before.
    pub fn emit<'a>(
        &'a self,
        kind: Kind,
        dedupe: &'a str,
        data: Value,
    ) -> crate::BoxFuture<'a, Result<Option<String>>> {
        Box::pin(async move { self.emit_to(kind, dedupe, data, None).await })
    }

    /// Sends a test event to one webhook (whatever kinds it subscribed to).
    pub fn test<'a>(&'a self, webhook: &'a str) -> crate::BoxFuture<'a, Result<String>> {
        Box::pin(async move {
            if !self.list().await?.iter().any(|w| w.id == webhook) {
                return Err(Error::NotFound(format!("no webhook with id {webhook:?}")));
            }
            let id = uuid::Uuid::now_v7().simple().to_string();
            let data = json!({ "message": "a test event from nm-gateway" });
            self.emit_to(Kind::Test, &format!("test:{id}"), data, Some(webhook))
                .await?
                .ok_or_else(|| Error::Unavailable("the test event was not stored".into()))
        })
    }

    async fn emit_to(
        &self,
        kind: Kind,
        dedupe: &str,
        data: Value,
        only: Option<&str>,
    ) -> Result<Option<String>> {
        // A read first: an event seen again (every look at an expiring key) costs no write.
        let mut seen = Sql::new(
            self.store.backend(),
            "SELECT COUNT(*) AS n FROM alert_events WHERE dedupe = ",
        );
        seen.bind(dedupe);
        if first_count(self.store.conn(), seen).await? > 0 {
            return Ok(None);
        }
        let now = now_ms();
        let id = format!("evt_{}", uuid::Uuid::now_v7().simple());
        let txn = self.store.begin_write().await?;
        let backend = txn.get_database_backend();
        let mut sql = Sql::new(
            backend,
            "INSERT INTO alert_events (id, kind, dedupe, at_ms, data) VALUES (",
        );
        sql.bind(id.as_str())
            .push(", ")
            .bind(kind.as_str())
            .push(", ")
            .bind(dedupe)
            .push(", ")
            .bind(now)
            .push(", ")
            .bind(data.to_string())
            .push(") ON CONFLICT (dedupe) DO NOTHING");
        if txn.execute_raw(sql.build()).await?.rows_affected() == 0 {
            return Ok(None);
        }
        // One delivery per webhook of the kind (`kinds` is a comma-separated list).
        let mut sql = Sql::new(
            backend,
            "INSERT INTO alert_deliveries (event_id, webhook_id, state, attempts, next_at_ms, \
             updated_at_ms) SELECT ",
        );
        sql.bind(id.as_str())
            .push(", id, 'pending', 0, ")
            .bind(now)
            .push(", ")
            .bind(now)
            .push(" FROM webhooks WHERE ");
        match only {
            Some(w) => sql.push("id = ").bind(w),
            None => sql
                .push("(',' || kinds || ',') LIKE ")
                .bind(format!("%,{},%", kind.as_str())),
        };
        let targets = txn.execute_raw(sql.build()).await?.rows_affected();
        txn.commit().await?;
        debug!(event = %id, kind = kind.as_str(), webhooks = targets, "alert event stored");
        self.wake.notify_one();
        Ok(Some(id))
    }

    /// Deliveries, newest event first: every webhook's, or one's.
    pub fn deliveries<'a>(
        &'a self,
        webhook: Option<&'a str>,
        limit: u64,
    ) -> crate::BoxFuture<'a, Result<Vec<Delivery>>> {
        Box::pin(async move {
            let mut sql = Sql::new(
                self.store.backend(),
                "SELECT d.event_id, d.webhook_id, e.kind, e.at_ms, d.state, d.attempts, \
             d.last_status, d.last_error, d.next_at_ms, d.updated_at_ms \
             FROM alert_deliveries d JOIN alert_events e ON e.id = d.event_id",
            );
            if let Some(w) = webhook {
                sql.push(" WHERE d.webhook_id = ").bind(w);
            }
            sql.push(" ORDER BY e.at_ms DESC, d.event_id DESC LIMIT ")
                .bind(i64::try_from(limit.clamp(1, 1000)).unwrap_or(1000));
            self.store
                .conn()
                .query_all_raw(sql.build())
                .await?
                .iter()
                .map(|r| {
                    Ok(Delivery {
                        event_id: r.try_get("", "event_id")?,
                        webhook_id: r.try_get("", "webhook_id")?,
                        kind: r.try_get("", "kind")?,
                        event_at_ms: r.try_get("", "at_ms")?,
                        state: r.try_get("", "state")?,
                        attempts: count(r, "attempts")?,
                        last_status: r
                            .try_get::<Option<i64>>("", "last_status")?
                            .and_then(|s| u16::try_from(s).ok()),
                        last_error: r.try_get("", "last_error")?,
                        next_at_ms: r.try_get("", "next_at_ms")?,
                        updated_at_ms: r.try_get("", "updated_at_ms")?,
                    })
                })
                .collect()
        })
    }

    /// Announces keys that expire within 7 days, and again within a day (one event each).
    pub fn check_key_expiry(&self, now: i64) -> crate::BoxFuture<'_, Result<usize>> {
        Box::pin(async move {
            let mut sql = Sql::new(
                self.store.backend(),
                "SELECT id, name, expires_at_ms FROM api_keys WHERE revoked_at_ms IS NULL \
             AND expires_at_ms IS NOT NULL AND expires_at_ms > ",
            );
            sql.bind(now)
                .push(" AND expires_at_ms <= ")
                .bind(now + EXPIRY_NOTICES[0].1);
            let rows = self.store.conn().query_all_raw(sql.build()).await?;
            let mut sent = 0;
            for row in rows {
                let id: String = row.try_get("", "id")?;
                let name: String = row.try_get("", "name")?;
                let at: i64 = row.try_get("", "expires_at_ms")?;
                // The closest notice that applies (a key made to expire in an hour gets "1d" only).
                let Some((notice, _)) = EXPIRY_NOTICES
                    .iter()
                    .rev()
                    .find(|(_, within)| at - now <= *within)
                else {
                    continue;
                };
                let data = json!({
                    "key_id": id,
                    "key_name": name,
                    "expires_at": rfc3339(at),
                    "message": format!("key {name} ({id}) expires at {} (within {notice})", rfc3339(at)),
                });
                let dedupe = format!("key_expiry:{id}:{at}:{notice}");
                if self.emit(Kind::KeyExpiry, &dedupe, data).await?.is_some() {
                    sent += 1;
                }
            }
            Ok(sent)
        })
    }

    /// Sends due deliveries until `shutdown`, and looks for expiring keys every
    /// [`EXPIRY_CHECK`]. `retry` is
    /// the delay before the first retry (doubling after each failure).
    pub fn spawn_worker(
        &self,
        sender: Arc<dyn Sender>,
        retry: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(
            async move {
                let mut expiry = tokio::time::interval(EXPIRY_CHECK);
                expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    let check_expiry = tokio::select! {
                        _ = expiry.tick() => true,
                        _ = this.wake.notified() => false,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => false,
                        _ = shutdown.wait_for(|stop| *stop) => break,
                    };
                    if check_expiry && let Err(e) = this.check_key_expiry(now_ms()).await {
                        warn!(error = %e, "key expiry check failed");
                    }
                    // Several passes while a pass is full.
                    loop {
                        match this.deliver_due(&*sender, retry).await {
                            Ok(n) if n == BATCH as usize => continue,
                            Ok(_) => break,
                            Err(e) => {
                                warn!(error = %e, "alert delivery pass failed");
                                break;
                            }
                        }
                    }
                }
            }
            .instrument(tracing::info_span!("alerts")),
        )
    }

    /// One pass: claims up to [`BATCH`] due deliveries and sends them, one at a time.
    pub fn deliver_due<'a>(
        &'a self,
        sender: &'a dyn Sender,
        retry: Duration,
    ) -> crate::BoxFuture<'a, Result<usize>> {
        Box::pin(async move {
            let now = now_ms();
            let mut sql = Sql::new(
                self.store.backend(),
                "SELECT d.event_id, d.webhook_id, d.attempts, d.next_at_ms, e.kind, e.at_ms, e.data, \
             w.url, w.secret, w.format FROM alert_deliveries d \
             JOIN alert_events e ON e.id = d.event_id JOIN webhooks w ON w.id = d.webhook_id \
             WHERE d.state = 'pending' AND d.next_at_ms <= ",
            );
            sql.bind(now)
                .push(" ORDER BY d.next_at_ms LIMIT ")
                .bind(BATCH as i64);
            let due = self.store.conn().query_all_raw(sql.build()).await?;
            let n = due.len();
            for row in due {
                let event_id: String = row.try_get("", "event_id")?;
                let webhook_id: String = row.try_get("", "webhook_id")?;
                let next_at: i64 = row.try_get("", "next_at_ms")?;
                if !self.claim(&event_id, &webhook_id, next_at, now).await? {
                    continue; // another replica's
                }
                let attempts = count(&row, "attempts")? + 1;
                let event_at: i64 = row.try_get("", "at_ms")?;
                let kind: String = row.try_get("", "kind")?;
                let data: String = row.try_get("", "data")?;
                let url: String = row.try_get("", "url")?;
                let secret: String = row.try_get("", "secret")?;
                let format = Format::parse(&row.try_get::<String>("", "format")?);
                let data: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                let body = body(format, &event_id, &kind, event_at, &data);
                let t = now_ms() / 1000;
                let post = Post {
                    url,
                    headers: vec![
                        ("content-type", "application/json".to_owned()),
                        ("nm-event-id", event_id.clone()),
                        ("nm-signature", signature(&secret, t, &body)),
                    ],
                    body,
                };
                let sent = sender.post(post).await;
                let after = now_ms();
                let (state, status, error, next) = match sent {
                    Ok(s) if (200..300).contains(&s) => ("delivered", Some(s), None, None),
                    other => {
                        let (status, error) = match other {
                            Ok(s) => (Some(s), format!("the receiver answered {s}")),
                            Err(e) => (None, e),
                        };
                        let delay = retry_delay(retry, attempts);
                        let next = after + delay.as_millis() as i64;
                        if next - event_at > GIVE_UP_AFTER.as_millis() as i64 {
                            ("failed", status, Some(error), None)
                        } else {
                            ("pending", status, Some(error), Some(next))
                        }
                    }
                };
                if let Some(observe) = self.observer.get() {
                    observe(if state == "pending" { "retried" } else { state });
                }
                if state == "failed" {
                    warn!(event = %event_id, webhook = %webhook_id, attempts, error = error.as_deref().unwrap_or(""), "alert delivery failed for good");
                }
                let mut sql =
                    Sql::new(self.store.backend(), "UPDATE alert_deliveries SET state = ");
                sql.bind(state)
                    .push(", attempts = ")
                    .bind(attempts as i64)
                    .push(", last_status = ")
                    .bind(status.map(i64::from))
                    .push(", last_error = ")
                    .bind(error)
                    .push(", next_at_ms = ")
                    .bind(next)
                    .push(", updated_at_ms = ")
                    .bind(after)
                    .push(" WHERE event_id = ")
                    .bind(event_id.as_str())
                    .push(" AND webhook_id = ")
                    .bind(webhook_id.as_str());
                let txn = self.store.begin_write().await?;
                txn.execute_raw(sql.build()).await?;
                txn.commit().await?;
            }
            Ok(n)
        })
    }

    /// Takes a due delivery for [`CLAIM`]: true when this worker got it.
    async fn claim(&self, event: &str, webhook: &str, next_at: i64, now: i64) -> Result<bool> {
        let mut sql = Sql::new(
            self.store.backend(),
            "UPDATE alert_deliveries SET next_at_ms = ",
        );
        sql.bind(now + CLAIM.as_millis() as i64)
            .push(" WHERE event_id = ")
            .bind(event)
            .push(" AND webhook_id = ")
            .bind(webhook)
            .push(" AND state = 'pending' AND next_at_ms = ")
            .bind(next_at);
        let txn = self.store.begin_write().await?;
        let got = txn.execute_raw(sql.build()).await?.rows_affected() == 1;
        txn.commit().await?;
        Ok(got)
    }
}

/// The delay after the `attempts`-th failed try: `retry · 2^(attempts − 1)`, at most
/// [`MAX_RETRY_DELAY`].
pub fn retry_delay(retry: Duration, attempts: u64) -> Duration {
    let factor = 1u32 << attempts.saturating_sub(1).min(20);
    retry.saturating_mul(factor).min(MAX_RETRY_DELAY)
}

/// The shares of a budget's limit whose crossing is announced, in percent.
pub const BUDGET_THRESHOLDS: [u64; 3] = [50, 80, 100];

impl Alerts {
    /// Announces each end user's spend crossing [`BUDGET_THRESHOLDS`] of their budget's limit,
    /// once per threshold and period: follows the budgets' feed (the users each stored batch
    /// changed), so it never stands in front of an ingest; a crossing missed while this task
    /// fell behind is seen at the user's next batch.
    pub fn spawn_budget_watch(
        &self,
        budgets: &crate::Budgets,
        mut shutdown: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        let budgets = budgets.clone();
        tokio::spawn(
            async move {
                let (_, mut events) = budgets.subscribe(now_ms());
                // Crossings announced by this process (the database's dedupe keys hold across
                // processes): saves a read per changed user and batch.
                let mut announced: std::collections::HashSet<String> = Default::default();
                loop {
                    let event = tokio::select! {
                        e = events.recv() => e,
                        _ = shutdown.wait_for(|stop| *stop) => break,
                    };
                    let scopes: Vec<nm_types::budget::Scope> = match event {
                        Ok(crate::budgets::FeedEvent::Delta(d)) => {
                            d.spend.iter().map(|(u, _)| u.clone()).collect()
                        }
                        Ok(crate::budgets::FeedEvent::Reset) => continue,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                    };
                    for scope in scopes {
                        if let Err(e) = this.check_budget(&budgets, &scope, &mut announced).await {
                            warn!(error = %e, "budget alert not stored");
                        }
                    }
                }
            }
            .instrument(tracing::info_span!("budget_alerts")),
        )
    }

    /// Emits the crossings of `scope`'s budget not yet announced.
    async fn check_budget(
        &self,
        budgets: &crate::Budgets,
        scope: &nm_types::budget::Scope,
        announced: &mut std::collections::HashSet<String>,
    ) -> Result<()> {
        let now = now_ms();
        let status = budgets.status(scope, now)?;
        let Some(budget) = &status.budget else {
            return Ok(());
        };
        let Some(limit) = budget.rule.limit_micros.filter(|l| *l > 0) else {
            return Ok(());
        };
        let period = budget.rule.period.as_str();
        let (spent, _) = status.spend.in_period(budget.rule.period);
        let (kind, user) = (scope.kind.as_str(), scope.value.as_str());
        let index = budget.rule.period.index_of(now);
        for pct in BUDGET_THRESHOLDS {
            if u128::from(spent) * 100 < u128::from(limit) * u128::from(pct) {
                break;
            }
            let dedupe = format!("budget:{kind}:{user}:{period}:{index}:{pct}");
            if !announced.insert(dedupe.clone()) {
                continue;
            }
            let whose = if status.is_default {
                "the default budget"
            } else {
                "their own budget"
            };
            let who = if scope.kind == nm_types::budget::ScopeKind::User {
                "end user"
            } else {
                kind
            };
            let data = json!({
                "budget": if status.is_default { "default" } else { kind },
                "scope": kind,
                "scope_value": user,
                "user_id": (scope.kind == nm_types::budget::ScopeKind::User).then_some(user),
                "period": period,
                "threshold_percent": pct,
                "spent_micros": spent,
                "limit_micros": limit,
                "message": format!(
                    "{who} {user} has spent {pct}% or more of {whose} ({} of {} this {period})",
                    nm_types::money::format_usd(spent),
                    nm_types::money::format_usd(limit),
                ),
            });
            self.emit(Kind::Budget, &dedupe, data).await?;
        }
        Ok(())
    }
}

/// `t=<unix seconds>,v1=<hex HMAC-SHA-256 of "<t>.<body>">`.
pub fn signature(secret: &str, t: i64, body: &[u8]) -> String {
    let mut msg = Vec::with_capacity(body.len() + 12);
    msg.extend_from_slice(t.to_string().as_bytes());
    msg.push(b'.');
    msg.extend_from_slice(body);
    format!(
        "t={t},v1={}",
        hex(&nm_types::hmac_sha256(secret.as_bytes(), &msg))
    )
}

/// The body of a delivery.
fn body(format: Format, id: &str, kind: &str, at_ms: i64, data: &Value) -> Vec<u8> {
    let v = match format {
        Format::Json => json!({
            "id": id,
            "kind": kind,
            "at": rfc3339(at_ms),
            "data": data,
        }),
        Format::Slack => {
            let line = data.get("message").and_then(Value::as_str).unwrap_or(kind);
            json!({ "text": format!("nm-gateway {kind}: {line}") })
        }
    };
    v.to_string().into_bytes()
}

fn check_url(url: &str) -> Result<()> {
    let bad = |why: &str| Err(Error::InvalidArgument(format!("url: {why}")));
    if url.len() > MAX_URL_LEN || url.chars().any(|c| c.is_control() || c == ' ') {
        return bad("at most 2048 characters, no spaces or control characters");
    }
    let Some(rest) = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
    else {
        return bad("must start with https:// (or http://)");
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    if host.is_empty() || host.contains('@') {
        return bad("needs a host, and no user:password@");
    }
    Ok(())
}

fn kinds_text(kinds: &[Kind]) -> String {
    kinds
        .iter()
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

fn webhook_of(row: &QueryResult) -> Result<Webhook> {
    let kinds: String = row.try_get("", "kinds")?;
    Ok(Webhook {
        id: row.try_get("", "id")?,
        url: row.try_get("", "url")?,
        kinds: kinds.split(',').filter_map(Kind::parse).collect(),
        format: Format::parse(&row.try_get::<String>("", "format")?),
        description: row.try_get("", "description")?,
        created_at_ms: row.try_get("", "created_at_ms")?,
    })
}

/// A webhook in the audit trail: everything but the secret.
fn webhook_json(w: &Webhook) -> Value {
    json!({
        "url": w.url,
        "kinds": kinds_text(&w.kinds),
        "format": w.format.as_str(),
        "description": w.description,
    })
}

async fn first_count(db: &impl ConnectionTrait, sql: Sql) -> Result<u64> {
    match db.query_one_raw(sql.build()).await? {
        Some(row) => count(&row, "n"),
        None => Ok(0),
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each threshold of an end user's budget is announced once per period, as the ingest's
    /// batches cross it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn budget_crossings_are_announced_once_each() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/a.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        let now = now_ms();
        let budgets = crate::Budgets::load(store.clone(), now).await.unwrap();
        let rule = nm_types::budget::BudgetRule {
            limit_micros: Some(100_000),
            period: nm_types::budget::Period::Day,
            requests_per_minute: None,
            limit_tokens: None,
            tokens_per_minute: None,
        };
        budgets
            .set(
                "key_admin",
                nm_types::budget::Subject::DefaultUser,
                rule,
                now,
            )
            .await
            .unwrap();
        let alerts = Alerts::new(store.clone());
        let (_stop, shutdown) = watch::channel(false);
        let task = alerts.spawn_budget_watch(&budgets, shutdown);
        let spend = |micros: u64| crate::budgets::SpendItem {
            scopes: vec![nm_types::budget::Scope::user("user-7")],
            started_at_ms: now_ms(),
            micros,
            tokens: 0,
        };
        let events = || async {
            let sql = Sql::new(
                store.backend(),
                "SELECT dedupe FROM alert_events WHERE kind = 'budget' ORDER BY dedupe",
            );
            let rows = store.conn().query_all_raw(sql.build()).await.unwrap();
            rows.iter()
                .map(|r| r.try_get::<String>("", "dedupe").unwrap())
                .collect::<Vec<_>>()
        };
        let until = |n: usize| async move {
            for _ in 0..100 {
                if events().await.len() >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        // Give the watcher its subscription before the first batch.
        tokio::time::sleep(Duration::from_millis(100)).await;
        budgets.apply(&[spend(40_000)], now_ms());
        budgets.apply(&[spend(20_000)], now_ms()); // 60%: 50
        until(1).await;
        budgets.apply(&[spend(50_000)], now_ms()); // 110%: 80 and 100
        until(3).await;
        budgets.apply(&[spend(50_000)], now_ms()); // nothing new
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got = events().await;
        let day = nm_types::budget::Period::Day.index_of(now_ms());
        assert_eq!(
            got,
            [100, 50, 80].map(|p| format!("budget:user:user-7:day:{day}:{p}")),
        );
        task.abort();
    }

    #[test]
    fn retries_double_up_to_the_cap_and_last_over_an_hour() {
        let r = Duration::from_secs(5);
        assert_eq!(retry_delay(r, 1), Duration::from_secs(5));
        assert_eq!(retry_delay(r, 2), Duration::from_secs(10));
        assert_eq!(retry_delay(r, 5), Duration::from_secs(80));
        assert_eq!(retry_delay(r, 30), MAX_RETRY_DELAY);
        // Tries until the event is older than an hour.
        let total: Duration = (1..=12).map(|a| retry_delay(r, a)).sum();
        assert!(total > Duration::from_secs(3600), "{total:?}");
        assert!(GIVE_UP_AFTER >= Duration::from_secs(3600));
    }

    #[test]
    fn the_signature_is_hmac_sha256_of_time_dot_body() {
        // `printf '1700000000.{}' | openssl dgst -sha256 -hmac secret`
        let s = signature("secret", 1_700_000_000, b"{}");
        assert_eq!(
            s,
            "t=1700000000,v1=b8569b78799ff9e3cbff0fc2d63a33a2b57f3282abd07c37ae5e8e7d79a5f163"
        );
    }

    #[test]
    fn urls_are_checked() {
        for good in [
            "https://hooks.example.com/x",
            "http://127.0.0.1:9000/hook?a=b",
        ] {
            assert!(check_url(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "ftp://x",
            "https://",
            "https://user:pw@host/",
            "https://a b/",
            &format!("https://h/{}", "a".repeat(MAX_URL_LEN)),
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn slack_bodies_are_one_line_of_text() {
        let b = body(
            Format::Slack,
            "evt_1",
            "key_expiry",
            0,
            &json!({"message": "key k expires"}),
        );
        assert_eq!(
            String::from_utf8_lossy(&b),
            r#"{"text":"nm-gateway key_expiry: key k expires"}"#
        );
        let b = body(Format::Json, "evt_1", "test", 0, &json!({"a": 1}));
        let v: Value = serde_json::from_slice(&b).unwrap_or_default();
        assert_eq!(v["id"], "evt_1");
        assert_eq!(v["data"]["a"], 1);
        assert_eq!(v["at"], "1970-01-01T00:00:00.000Z");
    }
}
