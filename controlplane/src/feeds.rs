//! What the controlplane streams to each dataplane, as domain types: the valid keys and the live
//! experiments ([`key_snapshots`]) and the end-user budget state ([`budget_feed`]). Both send a heartbeat
//! every [`HEARTBEAT`] even when nothing changed, so a dataplane that hears nothing for a while
//! knows its controlplane is gone, and both end when the process shuts down.
//!
//! The link adapters carry them: in process (`nm-gateway serve`) as they are, or over gRPC
//! (the root's `grpc::link_server`), which only maps them to protobuf.

use std::sync::Arc;
use std::time::Duration;

use nm_types::budget::Feed;
use nm_types::{KeyVerifiers, VerifiedKey, VerifierKey};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{mpsc, watch};
use tracing::debug;

use crate::budgets::{FeedEvent, FullState, SpendDelta};
use crate::store::Writability;
use crate::{Budgets, Experiments, KeySnapshot, Keys, now_ms};

/// How often a watcher hears the current state even when nothing changed.
pub const HEARTBEAT: Duration = Duration::from_secs(2);

/// The valid keys for the dataplane `name`: the current set at once, again whenever it changes,
/// and every [`HEARTBEAT`]. Keys are sent as verifiers under `verifier` (never their hashes).
/// Each snapshot also says whether the database takes writes (`write_problem`), and a change of
/// that sends one at once: a dataplane is ready only while its controlplane can store what it
/// sends. And each carries the live experiments (`experiments`): a change of that set sends one
/// at once too.
pub fn key_snapshots(
    keys: &Keys,
    experiments: &Experiments,
    writability: &Writability,
    verifier: VerifierKey,
    name: String,
    mut shutdown: watch::Receiver<bool>,
) -> mpsc::Receiver<KeyVerifiers> {
    let mut current = keys.cache().subscribe();
    let mut writable = writability.subscribe();
    let mut live = experiments.subscribe();
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        debug!(dataplane = %name, "key watcher connected");
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        loop {
            let mut snapshot = verifiers(&current.borrow_and_update(), &verifier);
            snapshot.write_problem = writable.borrow_and_update().map(str::to_owned);
            snapshot.experiments = live.borrow_and_update().experiments.clone();
            if tx.send(snapshot).await.is_err() {
                break;
            }
            tokio::select! {
                changed = current.changed() => if changed.is_err() { break },
                changed = writable.changed() => if changed.is_err() { break },
                changed = live.changed() => if changed.is_err() { break },
                _ = heartbeat.tick() => {}
                _ = shutdown.wait_for(|stop| *stop) => break,
            }
        }
        debug!(dataplane = %name, "key watcher gone");
    });
    rx
}

fn verifiers(snapshot: &Arc<KeySnapshot>, verifier: &VerifierKey) -> KeyVerifiers {
    KeyVerifiers {
        version: snapshot.version,
        keys: snapshot
            .keys
            .iter()
            .map(|(hash, info)| VerifiedKey {
                id: info.id.clone(),
                verifier: verifier.of_hash(hash),
                role: info.role,
                scope: info.scope.clone(),
                expires_at_ms: info.expires_at_ms,
            })
            .collect(),
        write_problem: None,
        experiments: Vec::new(),
    }
}

/// The budget feed for the dataplane `name`: a full state, then a delta after each ingested
/// batch, a full state again on a rule change or when the watcher falls behind, and an empty
/// delta at the current position every [`HEARTBEAT`].
pub fn budget_feed(
    budgets: &Budgets,
    name: String,
    mut shutdown: watch::Receiver<bool>,
) -> mpsc::Receiver<Feed> {
    let budgets = budgets.clone();
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        debug!(dataplane = %name, "budget watcher connected");
        let (full, mut events) = budgets.subscribe(now_ms());
        let mut last_seq = full.seq;
        let mut next = Some(full_feed(full));
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        loop {
            if let Some(msg) = next.take()
                && tx.send(msg).await.is_err()
            {
                break;
            }
            tokio::select! {
                event = events.recv() => {
                    next = Some(match event {
                        Ok(FeedEvent::Delta(d)) => {
                            last_seq = d.seq;
                            delta_feed(&d)
                        }
                        // A reset, or this watcher fell behind: start over from a full state.
                        Ok(FeedEvent::Reset) | Err(RecvError::Lagged(_)) => {
                            let full = budgets.full_state(now_ms());
                            last_seq = full.seq;
                            full_feed(full)
                        }
                        Err(RecvError::Closed) => break,
                    });
                }
                _ = heartbeat.tick() => {
                    // An empty delta at the last position: "still here, nothing new".
                    budgets.tick(now_ms());
                    // Keys gain and lose labels: a label budget follows (a full state if so).
                    let b = budgets.clone();
                    tokio::spawn(async move {
                        if let Err(e) = b.refresh_labels().await {
                            debug!(error = %e, "label budgets' keys not refreshed");
                        }
                    });
                    let (epoch, seq, day, month) = budgets.position();
                    if seq == last_seq {
                        next = Some(Feed { epoch, seq, day, month, ..Feed::default() });
                    }
                }
                _ = shutdown.wait_for(|stop| *stop) => break,
            }
        }
        debug!(dataplane = %name, "budget watcher gone");
    });
    rx
}

fn full_feed(f: FullState) -> Feed {
    use nm_types::budget::Subject;
    let mut default = None;
    let mut default_key = None;
    let mut overrides = Vec::new();
    for b in f.budgets {
        match b.subject {
            Subject::DefaultUser => default = Some(b.rule),
            Subject::DefaultKey => default_key = Some(b.rule),
            Subject::Scope(scope) => overrides.push((scope, b.rule)),
        }
    }
    Feed {
        epoch: f.epoch,
        seq: f.seq,
        full: true,
        default,
        default_key,
        overrides,
        label_keys: f.label_keys,
        spend: f.spend,
        day: f.day,
        month: f.month,
    }
}

fn delta_feed(d: &SpendDelta) -> Feed {
    Feed {
        epoch: d.epoch,
        seq: d.seq,
        full: false,
        spend: d.spend.clone(),
        day: d.day,
        month: d.month,
        ..Feed::default()
    }
}
