//! The controlplane's composition: its parts over one [`Store`], opened once at start and
//! shared by every adapter (the gRPC services, the in-process link of `nm-gateway serve`).

use tokio::sync::watch;

use crate::usage::UsageReports;
use crate::{Budgets, Keys, Records, Signals, Store, now_ms};

#[derive(Debug, Clone)]
pub struct Controlplane {
    pub store: Store,
    pub keys: Keys,
    pub records: Records,
    pub signals: Signals,
    pub budgets: Budgets,
    pub usage: UsageReports,
    /// Becomes `true` when the process shuts down; long-lived streams end then.
    shutdown: watch::Receiver<bool>,
}

impl Controlplane {
    pub async fn open(store: Store, shutdown: watch::Receiver<bool>) -> crate::error::Result<Self> {
        let keys = Keys::load(store.clone()).await?;
        let budgets = Budgets::load(store.clone(), now_ms()).await?;
        let records = Records::new(store.clone(), budgets.clone());
        let signals = Signals::start(store.clone());
        Ok(Self {
            usage: UsageReports::new(store.clone()),
            store,
            keys,
            records,
            signals,
            budgets,
            shutdown,
        })
    }

    /// Turns `true` when the process shuts down.
    pub fn shutdown(&self) -> watch::Receiver<bool> {
        self.shutdown.clone()
    }
}
