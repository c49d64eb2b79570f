//! The controlplane's composition: its parts over one [`Store`], opened once at start and
//! shared by every adapter (the gRPC services, the in-process link of `nm-gateway serve`).

use tokio::sync::watch;

use crate::usage::UsageReports;
use crate::{Budgets, Experiments, Keys, Records, Signals, Store, now_ms};

#[derive(Debug, Clone)]
pub struct Controlplane {
    pub store: Store,
    pub keys: Keys,
    pub records: Records,
    pub signals: Signals,
    pub budgets: Budgets,
    pub usage: UsageReports,
    pub agents: crate::Agents,
    pub audit: crate::Audit,
    pub alerts: crate::Alerts,
    pub experiments: Experiments,
    /// End-user erasure.
    pub users: crate::forget::Users,
    /// Becomes `true` when the process shuts down; long-lived streams end then.
    shutdown: watch::Receiver<bool>,
}

impl Controlplane {
    /// Opens the parts over `store`, runs the start-up write check (a failure is logged and
    /// keeps readiness false; the controlplane still starts, so it recovers by itself when the
    /// database takes writes again) and starts the periodic write probe, which ends with
    /// `shutdown`.
    pub fn open(
        store: Store,
        shutdown: watch::Receiver<bool>,
    ) -> crate::BoxFuture<'static, crate::error::Result<Self>> {
        Box::pin(async move {
            if let Err(e) = store.probe_write().await {
                tracing::error!(
                    error = %e,
                    "start-up check: the database does not take writes; the controlplane starts \
                     NOT_SERVING and becomes ready once a write goes through"
                );
            }
            crate::store::writable::spawn_prober(store.clone(), shutdown.clone());
            let keys = Keys::load(store.clone()).await?;
            let budgets = Budgets::load(store.clone(), now_ms()).await?;
            let records = Records::new(store.clone(), budgets.clone());
            let signals = Signals::start(store.clone());
            let experiments = Experiments::load(store.clone()).await?;
            experiments.spawn_refresher(crate::experiments::LIVE_REFRESH, shutdown.clone());
            Ok(Self {
                users: crate::forget::Users::new(store.clone(), budgets.clone()),
                experiments,
                usage: UsageReports::new(store.clone()),
                agents: crate::Agents::new(store.clone()),
                audit: crate::Audit::new(store.clone()),
                alerts: crate::Alerts::new(store.clone()),
                store,
                keys,
                records,
                signals,
                budgets,
                shutdown,
            })
        })
    }

    /// Turns `true` when the process shuts down.
    pub fn shutdown(&self) -> watch::Receiver<bool> {
        self.shutdown.clone()
    }
}
