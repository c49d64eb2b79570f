//! The dataplane's side of the controlplane's two streams, written once against the [`Port`]:
//! a key watcher that keeps the in-memory [`KeySet`] and the live [`Experiments`] (which every
//! key snapshot carries) current and `/health` truthful, and a budget watcher that keeps the
//! end-user [`Budgets`] current. Also the [`SignalSink`] that hands each signal to the port.
//!
//! Neither ever blocks a request. When the controlplane is unreachable, the last known keys and
//! budgets stay in force and `/health` answers 503 with the reason (a wrong link secret says
//! so); each stream is reopened with backoff.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nm_types::KeyVerifiers;
use nm_types::signal::Signal;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tracing::{debug, warn};

use super::{Backoff, LinkError, LinkStream, Port};
use crate::budget::Budgets;
use crate::experiment::Experiments;
use crate::metrics::Metrics;
use crate::{Health, KeySet, Principal, SignalSink, SubmitError, SubmitFuture};

/// Without a snapshot or heartbeat for this long, the controlplane counts as unreachable.
pub const STALE_AFTER: Duration = Duration::from_secs(6);
/// By when the controlplane must have begun a signal's commit; a signal not begun by then is
/// not stored, and the answer says so (503, "nothing was stored").
pub const SIGNAL_COMMIT_WITHIN: Duration = Duration::from_secs(4);
/// The longest a signal request waits for the controlplane's answer. Past it (a commit that
/// began in time but stalls, as on a frozen disk) the outcome is unknown: 503 saying the signal
/// may have been stored. Shorter than the official clients' 10 s timeout, so they hear why.
pub const SIGNAL_TIMEOUT: Duration = Duration::from_secs(8);

/// Sends each signal through the port and resolves once it is committed.
#[derive(Debug, Clone)]
pub struct PortSignals {
    pub port: Arc<dyn Port>,
}

impl SignalSink for PortSignals {
    fn submit(&self, signal: Signal) -> SubmitFuture {
        let port = self.port.clone();
        Box::pin(async move {
            let call = port.record_signal(signal, SIGNAL_COMMIT_WITHIN);
            match tokio::time::timeout(SIGNAL_TIMEOUT, call).await {
                Err(_) => Err(SubmitError::Unconfirmed(format!(
                    "the controlplane did not confirm the commit within {}s",
                    SIGNAL_TIMEOUT.as_secs()
                ))),
                Ok(Ok(spans)) => Ok(spans),
                Ok(Err(LinkError::Rejected(why))) => Err(SubmitError::Rejected(why)),
                Ok(Err(LinkError::SessionMismatch(why))) => Err(SubmitError::SessionMismatch(why)),
                Ok(Err(LinkError::Unconfirmed(e))) => {
                    debug!(error = %e, "signal outcome unknown");
                    Err(SubmitError::Unconfirmed(
                        "the answer from the controlplane was lost".to_owned(),
                    ))
                }
                Ok(Err(e)) => {
                    debug!(error = %e, "signal not stored");
                    Err(SubmitError::Unavailable(
                        "the controlplane could not store the signal".to_owned(),
                    ))
                }
            }
        })
    }
}

/// Keeps `keys` current and reports the controlplane's reachability on `health`.
pub async fn watch_keys(
    port: Arc<dyn Port>,
    keys: KeySet,
    experiments: Experiments,
    health: Health,
    name: String,
    stop: watch::Receiver<bool>,
) {
    let mut last_version = None;
    // Whether this outage was reported at WARN already (the stream is retried every few
    // seconds; one line per outage is enough).
    let warned = AtomicBool::new(false);
    let on_message = |mut snapshot: KeyVerifiers| {
        warned.store(false, Ordering::Relaxed);
        if last_version != Some(snapshot.version) {
            debug!(
                version = snapshot.version,
                keys = snapshot.keys.len(),
                "key snapshot"
            );
            last_version = Some(snapshot.version);
        }
        health.set_write_problem(snapshot.write_problem.clone());
        experiments.apply(std::mem::take(&mut snapshot.experiments));
        keys.replace(principals(snapshot));
        health.set_controlplane_ok();
    };
    let on_lost = |problem: String| {
        if !warned.swap(true, Ordering::Relaxed) {
            warn!(problem = %problem, "controlplane unreachable; keeping the last known keys");
        } else {
            debug!(problem = %problem, "controlplane still unreachable");
        }
        health.set_controlplane_problem(problem);
    };
    let open = || {
        let port = port.clone();
        let name = name.clone();
        async move { port.watch_keys(&name).await }
    };
    follow("key snapshot", open, on_message, on_lost, stop).await;
}

/// Keeps `budgets` current from the controlplane's feed. While the feed is down the last known
/// state stays in force (the key watcher reports the outage on `/health`).
pub async fn watch_budgets(
    port: Arc<dyn Port>,
    budgets: Budgets,
    health: Health,
    metrics: Metrics,
    name: String,
    stop: watch::Receiver<bool>,
) {
    let on_message = |feed: nm_types::budget::Feed| {
        let full = feed.full;
        budgets.apply_feed(feed);
        if full {
            metrics.set_budget_rules(budgets.rules());
        }
        health.set_budgets_loaded();
    };
    let on_lost = |problem: String| {
        debug!(problem = %problem, "budget feed lost; keeping the last known budgets");
    };
    let open = || {
        let port = port.clone();
        let name = name.clone();
        async move { port.watch_budgets(&name).await }
    };
    follow("budget feed", open, on_message, on_lost, stop).await;
}

/// How often the lease keeper reports and renews when no lease ran out.
pub const LEASE_ROUND: Duration = Duration::from_millis(500);

/// Keeps this dataplane's budget leases: a round every [`LEASE_ROUND`], and at once when a
/// request found its lease used up. Each round reports every claim and adds what was granted;
/// an unanswered round changes nothing (the leases held stay spendable until their time to
/// live, counted from the last answered round's sending).
pub async fn keep_leases(
    port: Arc<dyn Port>,
    budgets: Budgets,
    name: String,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(LEASE_ROUND);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = budgets.lease_needed() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let sent_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let request = budgets.lease_request(&name, sent_ms);
        let round = budgets.round_started();
        if !request.claims.is_empty() {
            match port.lease(&request).await {
                Ok(response) => budgets.apply_grants(&request, &response, sent_ms),
                Err(e) => debug!(error = %e, "lease round failed; keeping the leases held"),
            }
        }
        budgets.round_ended(round);
    }
}

/// Follows one of the controlplane's streams for as long as the link runs: opens it, hands
/// every message to `on_message`, and when it fails, closes or stays silent for
/// [`STALE_AFTER`] (the controlplane sends heartbeats), reports the problem to `on_lost` and
/// reopens it with [`Backoff`].
async fn follow<T, Open, Fut>(
    what: &'static str,
    mut open: Open,
    mut on_message: impl FnMut(T),
    mut on_lost: impl FnMut(String),
    mut stop: watch::Receiver<bool>,
) where
    Open: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<LinkStream<T>, LinkError>>,
{
    let mut backoff = Backoff::default();
    loop {
        let problem = match open().await {
            Err(e) => e.to_string(),
            Ok(mut stream) => loop {
                match tokio::time::timeout(STALE_AFTER, stream.next()).await {
                    Ok(Some(Ok(msg))) => {
                        on_message(msg);
                        backoff.reset();
                    }
                    Ok(None) => break format!("{what} closed by the controlplane"),
                    Ok(Some(Err(e))) => break e.to_string(),
                    Err(_) => break format!("no {what} for {}s", STALE_AFTER.as_secs()),
                }
            },
        };
        if *stop.borrow() {
            return;
        }
        on_lost(problem);
        tokio::select! {
            () = tokio::time::sleep(backoff.next_delay()) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

fn principals(snapshot: KeyVerifiers) -> HashMap<nm_types::KeyHash, Principal> {
    snapshot
        .keys
        .into_iter()
        .map(|k| {
            (
                k.verifier,
                Principal {
                    key_id: Arc::from(k.id),
                    role: k.role,
                    scope: k.scope,
                    expires_at_ms: k.expires_at_ms,
                },
            )
        })
        .collect()
}
