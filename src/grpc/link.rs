//! The dataplane's link to its controlplane: a key watcher that keeps the in-memory
//! [`KeySet`] current and `/health` truthful, a budget watcher that keeps the end-user
//! [`Budgets`] current, and a shipper that drains the request-record queue into
//! `IngestRequests` batches (and tells the budgets which records were stored).
//!
//! Neither ever blocks a request. When the controlplane is unreachable, the last known key set
//! stays in force, `/health` answers 503, and records wait in the bounded queue while the shipper
//! retries (a spool on disk comes with usage metering).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nm_dataplane::budget::{Budgets, Feed, RemoteSpend};
use nm_dataplane::{
    Health, KeySet, Principal, RecordQueue, SignalSink, SignalSubmission, SubmitError, SubmitFuture,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use super::convert::{record_to_pb, signal_to_pb};
use super::pb::{self, dataplane_client::DataplaneClient};

/// Without a snapshot or heartbeat for this long, the controlplane counts as unreachable.
pub const STALE_AFTER: Duration = Duration::from_secs(6);
/// Most records per `IngestRequests` call.
pub const MAX_BATCH: usize = 1_000;
/// How long the shipper waits for more records before sending a batch.
pub const LINGER: Duration = Duration::from_millis(50);
/// How long shutdown waits for the last records to be delivered.
pub const FLUSH_DEADLINE: Duration = Duration::from_secs(10);
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
}

impl Link {
    pub fn spawn(channel: Channel, targets: LinkTargets, queue: RecordQueue, name: String) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let client = DataplaneClient::new(channel);
        let watcher = tokio::spawn(watch_keys(
            client.clone(),
            targets.keys,
            targets.health.clone(),
            name.clone(),
            stop_rx.clone(),
        ));
        let budget_watcher = tokio::spawn(watch_budgets(
            client.clone(),
            targets.budgets.clone(),
            targets.health.clone(),
            name,
            stop_rx.clone(),
        ));
        let shipper = tokio::spawn(ship(client, queue, targets.budgets, stop_rx));
        Self {
            stop,
            watcher,
            budget_watcher,
            shipper,
        }
    }

    /// Stops watching, delivers what is queued (up to [`FLUSH_DEADLINE`]), and returns.
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
    mut client: DataplaneClient<Channel>,
    budgets: Budgets,
    health: Health,
    name: String,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let problem = match client
            .watch_budgets(pb::WatchBudgetsRequest {
                dataplane: name.clone(),
            })
            .await
        {
            Err(status) => format!("{}: {}", status.code(), status.message()),
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    match tokio::time::timeout(STALE_AFTER, stream.message()).await {
                        Ok(Ok(Some(msg))) => {
                            budgets.apply_feed(feed_from_pb(msg));
                            health.set_budgets_loaded();
                            backoff = Duration::from_millis(100);
                        }
                        Ok(Ok(None)) => break "budget feed closed by the controlplane".to_owned(),
                        Ok(Err(status)) => {
                            break format!("{}: {}", status.code(), status.message());
                        }
                        Err(_) => break format!("no budget feed for {}s", STALE_AFTER.as_secs()),
                    }
                }
            }
        };
        if *stop.borrow() {
            return;
        }
        debug!(problem = %problem, "budget feed lost; keeping the last known budgets");
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

/// Tells the budgets which of a batch's records the controlplane stored, and where in its feed.
fn mark_delivered(
    budgets: &Budgets,
    batch: &[pb::RequestRecord],
    resp: &pb::IngestRequestsResponse,
) {
    let budgeted = batch.iter().filter_map(|r| {
        r.budget_micros?;
        Some((r.user_id.as_deref()?, r.request_id.as_str()))
    });
    budgets.delivered(budgeted, resp.epoch, resp.seq);
}

async fn watch_keys(
    mut client: DataplaneClient<Channel>,
    keys: KeySet,
    health: Health,
    name: String,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(100);
    let mut last_version = None;
    loop {
        let problem = match client
            .watch_keys(pb::WatchKeysRequest {
                dataplane: name.clone(),
            })
            .await
        {
            Err(status) => format!("{}: {}", status.code(), status.message()),
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    match tokio::time::timeout(STALE_AFTER, stream.message()).await {
                        Ok(Ok(Some(snapshot))) => {
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
                            backoff = Duration::from_millis(100);
                        }
                        Ok(Ok(None)) => break "key stream closed by the controlplane".to_owned(),
                        Ok(Err(status)) => {
                            break format!("{}: {}", status.code(), status.message());
                        }
                        Err(_) => break format!("no key snapshot for {}s", STALE_AFTER.as_secs()),
                    }
                }
            }
        };
        if *stop.borrow() {
            return;
        }
        warn!(problem = %problem, "controlplane unreachable; keeping the last known keys");
        health.set_controlplane_problem(problem);
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
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

async fn ship(
    mut client: DataplaneClient<Channel>,
    mut queue: RecordQueue,
    budgets: Budgets,
    mut stop: watch::Receiver<bool>,
) {
    let mut batch: Vec<pb::RequestRecord> = Vec::new();
    let mut backoff = Duration::from_millis(100);
    loop {
        if batch.is_empty() {
            tokio::select! {
                received = queue.recv() => match received {
                    Some(r) => batch.push(record_to_pb(r)),
                    None => return,
                },
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        // Linger briefly so a busy dataplane sends few large batches: every batch is one database
        // transaction, and many small ones cost the controlplane far more than the rows do.
        let linger_until = tokio::time::Instant::now() + LINGER;
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(r) => batch.push(record_to_pb(r)),
                Err(_) => match tokio::time::timeout_at(linger_until, queue.recv()).await {
                    Ok(Some(r)) => batch.push(record_to_pb(r)),
                    Ok(None) | Err(_) => break,
                },
            }
        }
        match client
            .ingest_requests(pb::IngestRequestsRequest {
                records: batch.clone(),
            })
            .await
        {
            Ok(resp) => {
                mark_delivered(&budgets, &batch, resp.get_ref());
                batch.clear();
                backoff = Duration::from_millis(100);
            }
            Err(status) => {
                debug!(code = ?status.code(), message = status.message(), records = batch.len(), "record delivery failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    // Shutting down: the server has drained, so the queue holds everything there will be.
    queue.close();
    while let Ok(r) = queue.try_recv() {
        batch.push(record_to_pb(r));
    }
    let total = batch.len();
    let deadline = tokio::time::Instant::now() + FLUSH_DEADLINE;
    while !batch.is_empty() {
        let n = batch.len().min(MAX_BATCH);
        let chunk: Vec<_> = batch[..n].to_vec();
        let sent = tokio::time::timeout_at(
            deadline,
            client.ingest_requests(pb::IngestRequestsRequest { records: chunk }),
        )
        .await;
        match sent {
            Ok(Ok(resp)) => {
                mark_delivered(&budgets, &batch[..n], resp.get_ref());
                batch.drain(..n);
            }
            Ok(Err(status)) if tokio::time::Instant::now() < deadline => {
                debug!(code = ?status.code(), "final record delivery failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => {
                warn!(
                    lost = batch.len(),
                    "controlplane unreachable at shutdown; request records not delivered"
                );
                return;
            }
        }
    }
    if total > 0 {
        info!(records = total, "delivered the last request records");
    }
}
