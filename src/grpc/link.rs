//! The dataplane's link to its controlplane: a key watcher that keeps the in-memory
//! [`KeySet`] current and `/health` truthful, a budget watcher that keeps the end-user
//! [`Budgets`] current, and a shipper that drains the request-record queue into
//! `IngestRequests` batches (and tells the budgets which records were stored).
//!
//! None ever blocks a request. When the controlplane is unreachable, the last known keys and
//! budgets stay in force, `/health` answers 503, and records go to the on-disk spool until the
//! controlplane is back (see [`super::shipper`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use nm_dataplane::budget::{Budgets, Feed, RemoteSpend};
use nm_dataplane::metrics::Metrics;
use nm_dataplane::{
    Health, KeySet, Principal, RecordQueue, SignalSink, SignalSubmission, SubmitError, SubmitFuture,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, warn};

use super::convert::signal_to_pb;
use super::pb::{self, dataplane_client::DataplaneClient};
use super::server::{BudgetFeedStream, Controlplane, budget_feed};
use super::shipper::{Destination, SharedSpool, ship};

/// Without a snapshot or heartbeat for this long, the controlplane counts as unreachable.
pub const STALE_AFTER: Duration = Duration::from_secs(6);
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a signal request waits for the controlplane's commit before answering 503.
pub const SIGNAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends each signal to the controlplane and resolves once it is committed.
#[derive(Debug, Clone)]
pub struct GrpcSignalSink {
    client: DataplaneClient<Channel>,
}

impl GrpcSignalSink {
    pub fn new(channel: Channel) -> Self {
        Self {
            client: DataplaneClient::new(channel),
        }
    }
}

impl SignalSink for GrpcSignalSink {
    fn submit(&self, signal: SignalSubmission) -> SubmitFuture {
        let mut client = self.client.clone();
        Box::pin(async move {
            let req = pb::RecordSignalRequest {
                signal: Some(signal_to_pb(signal)),
            };
            match tokio::time::timeout(SIGNAL_TIMEOUT, client.record_signal(req)).await {
                Err(_) => Err(SubmitError::Unavailable(format!(
                    "controlplane did not answer within {}s",
                    SIGNAL_TIMEOUT.as_secs()
                ))),
                Ok(Ok(_)) => Ok(()),
                Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                    Err(SubmitError::Rejected(status.message().to_owned()))
                }
                Ok(Err(status)) => Err(SubmitError::Unavailable(format!(
                    "controlplane: {}",
                    status.message()
                ))),
            }
        })
    }
}

/// A lazily connected channel to the controlplane (reconnects by itself).
pub fn channel(url: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect_lazy())
}

/// The running link. [`Link::stop`] flushes the queued records and ends both tasks.
#[derive(Debug)]
pub struct Link {
    stop: watch::Sender<bool>,
    watcher: JoinHandle<()>,
    budget_watcher: JoinHandle<()>,
    shipper: JoinHandle<()>,
}

/// The dataplane state the link keeps current.
#[derive(Debug, Clone)]
pub struct LinkTargets {
    pub keys: KeySet,
    pub health: Health,
    pub budgets: Budgets,
    pub metrics: Metrics,
    /// Where records wait while the controlplane is unreachable.
    pub spool: SharedSpool,
}

impl Link {
    /// `local`: the controlplane of this process (`serve`): records are delivered to it and the
    /// budget feed read from it directly, without gRPC.
    pub fn spawn(
        channel: Channel,
        local: Option<Controlplane>,
        targets: LinkTargets,
        queue: RecordQueue,
        name: String,
    ) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let client = DataplaneClient::new(channel);
        let destination = match &local {
            Some(cp) => Destination::Local(cp.records.clone()),
            None => Destination::Remote(client.clone()),
        };
        let watcher = tokio::spawn(watch_keys(
            client.clone(),
            targets.keys,
            targets.health.clone(),
            name.clone(),
            stop_rx.clone(),
        ));
        let budget_watcher = tokio::spawn(watch_budgets(
            client.clone(),
            local,
            targets.budgets.clone(),
            targets.health.clone(),
            targets.metrics.clone(),
            name,
            stop_rx.clone(),
        ));
        let shipper = tokio::spawn(ship(
            destination,
            queue,
            targets.budgets,
            targets.spool,
            targets.metrics,
            stop_rx,
        ));
        Self {
            stop,
            watcher,
            budget_watcher,
            shipper,
        }
    }

    /// Stops watching, delivers or spools what is queued, and returns.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        self.watcher.abort();
        self.budget_watcher.abort();
        let _ = self.shipper.await;
    }
}

/// Keeps `budgets` current from the controlplane's feed. While the feed is down the last known
/// state stays in force (the key watcher reports the outage on `/health`).
async fn watch_budgets(
    client: DataplaneClient<Channel>,
    local: Option<Controlplane>,
    budgets: Budgets,
    health: Health,
    metrics: Metrics,
    name: String,
    stop: watch::Receiver<bool>,
) {
    let open = || {
        let mut client = client.clone();
        let local = local.clone();
        let dataplane = name.clone();
        async move {
            if let Some(cp) = local {
                return Ok(budget_feed(&cp, dataplane));
            }
            let stream = client
                .watch_budgets(pb::WatchBudgetsRequest { dataplane })
                .await?
                .into_inner();
            Ok::<BudgetFeedStream, tonic::Status>(Box::pin(stream))
        }
    };
    let on_message = |msg: pb::BudgetFeed| {
        let full = msg.full;
        budgets.apply_feed(feed_from_pb(msg));
        if full {
            metrics.set_budget_rules(budgets.rules());
        }
        health.set_budgets_loaded();
    };
    let on_lost = |problem: String| {
        debug!(problem = %problem, "budget feed lost; keeping the last known budgets");
    };
    follow("budget feed", open, on_message, on_lost, stop).await;
}

/// Follows one of the controlplane's server streams for as long as the link runs: opens it,
/// hands every message to `on_message`, and when it fails, closes or stays silent for
/// [`STALE_AFTER`] (the controlplane sends heartbeats), reports the problem to `on_lost` and
/// reopens it with backoff (100 ms, doubling to 2 s).
async fn follow<T, S, Open, Fut>(
    what: &'static str,
    mut open: Open,
    mut on_message: impl FnMut(T),
    mut on_lost: impl FnMut(String),
    mut stop: watch::Receiver<bool>,
) where
    Open: FnMut() -> Fut,
    Fut: Future<Output = Result<S, tonic::Status>>,
    S: Stream<Item = Result<T, tonic::Status>> + Unpin,
{
    let mut backoff = MIN_BACKOFF;
    loop {
        let problem = match open().await {
            Err(status) => format!("{}: {}", status.code(), status.message()),
            Ok(mut stream) => loop {
                match tokio::time::timeout(STALE_AFTER, stream.next()).await {
                    Ok(Some(Ok(msg))) => {
                        on_message(msg);
                        backoff = MIN_BACKOFF;
                    }
                    Ok(None) => break format!("{what} closed by the controlplane"),
                    Ok(Some(Err(status))) => {
                        break format!("{}: {}", status.code(), status.message());
                    }
                    Err(_) => break format!("no {what} for {}s", STALE_AFTER.as_secs()),
                }
            },
        };
        if *stop.borrow() {
            return;
        }
        on_lost(problem);
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn feed_from_pb(msg: pb::BudgetFeed) -> Feed {
    let mut default = None;
    let mut overrides = Vec::new();
    for b in &msg.budgets {
        let rule = super::convert::rule_from_pb(b);
        match &b.user_id {
            None => default = Some(rule),
            Some(u) => overrides.push((u.clone(), rule)),
        }
    }
    Feed {
        epoch: msg.epoch,
        seq: msg.seq,
        full: msg.full,
        default,
        overrides,
        spend: msg
            .spend
            .into_iter()
            .map(|s| {
                (
                    s.user_id,
                    RemoteSpend {
                        day_micros: s.day_micros,
                        month_micros: s.month_micros,
                        minute: s.minute,
                        minute_requests: s.minute_requests,
                    },
                )
            })
            .collect(),
        day: msg.day,
        month: msg.month,
    }
}

async fn watch_keys(
    client: DataplaneClient<Channel>,
    keys: KeySet,
    health: Health,
    name: String,
    stop: watch::Receiver<bool>,
) {
    let open = || {
        let mut client = client.clone();
        let dataplane = name.clone();
        async move {
            let resp = client
                .watch_keys(pb::WatchKeysRequest { dataplane })
                .await?;
            Ok::<_, tonic::Status>(resp.into_inner())
        }
    };
    let mut last_version = None;
    let on_message = |snapshot: pb::KeySnapshot| {
        if last_version != Some(snapshot.version) {
            debug!(
                version = snapshot.version,
                keys = snapshot.keys.len(),
                "key snapshot"
            );
            last_version = Some(snapshot.version);
        }
        keys.replace(principals(snapshot));
        health.set_controlplane_ok();
    };
    let on_lost = |problem: String| {
        warn!(problem = %problem, "controlplane unreachable; keeping the last known keys");
        health.set_controlplane_problem(problem);
    };
    follow("key snapshot", open, on_message, on_lost, stop).await;
}

fn principals(snapshot: pb::KeySnapshot) -> HashMap<nm_types::KeyHash, Principal> {
    snapshot
        .keys
        .into_iter()
        .filter_map(|k| {
            let hash: nm_types::KeyHash = k.hash.as_slice().try_into().ok()?;
            Some((
                hash,
                Principal {
                    key_id: Arc::from(k.id),
                    admin: k.admin,
                },
            ))
        })
        .collect()
}
