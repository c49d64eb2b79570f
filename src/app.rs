//! Starting the process shapes: `serve` (both halves in one process), `dataplane`,
//! `controlplane`. Each `start_*` binds its listeners first (so port 0 works and the address is
//! known), then runs in the background; the returned [`Running`] stops it gracefully.
//!
//! One rule for the link between the halves (`nm_dataplane::link`, adapters in [`crate::link`]):
//! in `serve` all four flows (key snapshots, budget feed, records, signals) go to the
//! controlplane of the same process in process ([`InProcess`]); a separate dataplane uses gRPC
//! for all four ([`Grpc`], with the link secret, over TLS for an `https://` URL). The
//! dataplane's side of each flow, and the controlplane's rules, are the same code either way. `serve`'s gRPC port still serves the admin API, and the link to extra
//! dataplanes when `NM_LINK_SECRET` is set.
//!
//! Shutdown order: the dataplane drains (listener closed, in-flight requests and streams finish
//! within the grace period), its last request records are delivered, then the controlplane ends
//! its streams and stops.

use std::net::SocketAddr;

use std::sync::Arc;

use anyhow::Context;
use nm_controlplane::experiments::{Catalogue, ProviderInfo};
use nm_controlplane::{Controlplane, Store};
use nm_dataplane::link::dead_letter::DeadLetters;
use nm_dataplane::link::shipper::SharedSpool;
use nm_dataplane::link::watch::PortSignals;
use nm_dataplane::link::{Link, LinkTargets, Port};
use nm_dataplane::spool::Spool;
use nm_dataplane::{Dataplane, DataplaneConfig, WireFormat};
use nm_types::VerifierKey;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

use crate::config::{Mode, Settings};
use crate::grpc::server;
use crate::link::local::InProcess;
use crate::link::remote::Grpc;
use crate::otel::Telemetry;
use crate::otel::export::DropCounter;
use nm_dataplane::metrics::Metrics;

/// A started process shape.
#[derive(Debug)]
pub struct Running {
    /// Where the dataplane listens (serve, dataplane).
    pub http_addr: Option<SocketAddr>,
    /// Where the controlplane listens (serve, controlplane).
    pub grpc_addr: Option<SocketAddr>,
    /// Where the web page listens (serve, controlplane; unless off or its default address
    /// was taken).
    pub ui_addr: Option<SocketAddr>,
    /// The admin key generated for a fresh database, to show once.
    pub generated_admin_key: Option<String>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Begins a graceful shutdown.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }

    /// Waits until the process shape has stopped.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("server task panicked")?
    }

    /// Shuts down and waits.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown();
        self.wait().await
    }
}

async fn signalled(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

pub async fn start(settings: &Settings) -> anyhow::Result<Running> {
    match settings.mode {
        Mode::Serve => start_serve(settings).await,
        Mode::Dataplane => start_dataplane(settings).await,
        Mode::Controlplane => start_controlplane(settings).await,
        Mode::Client => anyhow::bail!("admin commands do not start a server"),
    }
}

pub async fn start_controlplane(settings: &Settings) -> anyhow::Result<Running> {
    let (shutdown, rx) = watch::channel(false);
    let telemetry = telemetry(settings, "nm-controlplane", None)?;
    let link_tracing = telemetry.as_ref().map(Telemetry::link);
    let (_, grpc_addr, ui_addr, generated_admin_key, task) =
        controlplane(settings, rx, link_tracing).await?;
    let task = flushed(task, telemetry);
    Ok(Running {
        http_addr: None,
        grpc_addr: Some(grpc_addr),
        ui_addr,
        generated_admin_key,
        shutdown,
        task,
    })
}

pub async fn start_dataplane(settings: &Settings) -> anyhow::Result<Running> {
    let (shutdown, rx) = watch::channel(false);
    let secret = settings
        .link_secret
        .as_ref()
        .context("NM_LINK_SECRET is required for a dataplane")?;
    let channel = crate::grpc::channel(&settings.controlplane_url, &settings.controlplane_tls)?;
    let port: Arc<dyn Port> = Arc::new(Grpc::new(channel, secret.expose())?);
    info!(controlplane = %settings.controlplane_url, "dataplane linked to its controlplane over gRPC");
    let verifier = VerifierKey::from_link_secret(secret.expose());
    let metrics = Metrics::default();
    let telemetry = telemetry(settings, "nm-dataplane", Some(&metrics))?;
    let tracing = telemetry.as_ref().map(Telemetry::dataplane);
    let link_tracing = telemetry.as_ref().map(Telemetry::link);
    let (http_addr, task) =
        dataplane(settings, port, verifier, rx, metrics, tracing, link_tracing).await?;
    let task = flushed(task, telemetry);
    Ok(Running {
        http_addr: Some(http_addr),
        grpc_addr: None,
        ui_addr: None,
        generated_admin_key: None,
        shutdown,
        task,
    })
}

pub async fn start_serve(settings: &Settings) -> anyhow::Result<Running> {
    let (shutdown, rx) = watch::channel(false);
    let (cp_stop, cp_rx) = watch::channel(false);
    let metrics = Metrics::default();
    let telemetry = telemetry(settings, "nm-gateway", Some(&metrics))?;
    let link_tracing = telemetry.as_ref().map(Telemetry::link);
    let (cp, grpc_addr, ui_addr, generated_admin_key, cp_task) =
        controlplane(settings, cp_rx, link_tracing.clone()).await?;
    let counted = metrics.clone();
    cp.alerts
        .observe(Box::new(move |outcome| counted.alert_delivery(outcome)));
    // Verifiers made in process never leave it; with a link secret they are the same ones
    // extra dataplanes get.
    let verifier =
        VerifierKey::from_link_secret(settings.link_secret.as_ref().map_or("", |s| s.expose()));
    let source = link_tracing.as_ref().map(|t| t.source());
    let port: Arc<dyn Port> = Arc::new(InProcess::new(cp, verifier.clone(), source));
    let tracing = telemetry.as_ref().map(Telemetry::dataplane);
    let (http_addr, dp_task) =
        dataplane(settings, port, verifier, rx, metrics, tracing, link_tracing).await?;
    let task = tokio::spawn(async move {
        let dp = dp_task.await.context("dataplane task panicked")?;
        let _ = cp_stop.send(true);
        let cp = cp_task.await.context("controlplane task panicked")?;
        dp.and(cp)
    });
    let task = flushed(task, telemetry);
    Ok(Running {
        http_addr: Some(http_addr),
        grpc_addr: Some(grpc_addr),
        ui_addr,
        generated_admin_key,
        shutdown,
        task,
    })
}

type Task = JoinHandle<anyhow::Result<()>>;

/// The shape's OpenTelemetry export, when `OTEL_*` turns it on; drops are counted in the
/// dataplane's metrics where there are some.
fn telemetry(
    settings: &Settings,
    default_service: &'static str,
    metrics: Option<&Metrics>,
) -> anyhow::Result<Option<Telemetry>> {
    let Some(export) = &settings.otel.export else {
        return Ok(None);
    };
    let drops: DropCounter = match metrics {
        Some(m) => {
            let m = m.clone();
            Arc::new(move |reason, n| m.otel_spans_dropped(reason, n))
        }
        None => Arc::new(|reason, n| tracing::debug!(reason, spans = n, "spans dropped")),
    };
    let telemetry = Telemetry::start(export, default_service, drops)
        .context("cannot start the OpenTelemetry export thread")?;
    Ok(Some(telemetry))
}

/// `task`, then the export of its last spans.
fn flushed(task: Task, telemetry: Option<Telemetry>) -> Task {
    match telemetry {
        None => task,
        Some(t) => tokio::spawn(async move {
            let result = task.await;
            t.shutdown().await;
            result.context("server task panicked")?
        }),
    }
}

async fn controlplane(
    settings: &Settings,
    stop: watch::Receiver<bool>,
    tracing: Option<crate::otel::link::LinkTracing>,
) -> anyhow::Result<(
    Controlplane,
    SocketAddr,
    Option<SocketAddr>,
    Option<String>,
    Task,
)> {
    let store = Store::connect(&settings.database_url).await?;
    let cp = Controlplane::open(store.clone(), stop.clone()).await?;
    let generated = cp
        .keys
        .ensure_admin(settings.bootstrap_key.as_deref())
        .await?;
    let listener = TcpListener::bind(settings.grpc_addr)
        .await
        .with_context(|| format!("cannot listen on NM_GRPC_ADDR {}", settings.grpc_addr))?;
    let addr = listener.local_addr()?;
    // The web page: its own listener, bound now so a given address that is taken stops the
    // start; it calls the same admin services the gRPC server serves.
    let ui_listener = crate::ui::bind(&settings.ui).await?;
    let ui_addr = ui_listener.as_ref().and_then(|l| l.local_addr().ok());
    let tls = if settings.grpc_tls.is_some() {
        "TLS"
    } else {
        "plaintext"
    };
    info!(%addr, tls, link = settings.link_secret.is_some(), "controlplane gRPC listening on {addr}");
    if settings.link_secret.is_none() && settings.mode == Mode::Controlplane {
        tracing::warn!(
            "no NM_LINK_SECRET: this controlplane serves the admin API only; dataplanes cannot connect"
        );
    }
    // Recommendations are recomputed on a schedule (and on demand over gRPC); a new one is
    // announced to the webhooks.
    let scheduler = settings.analytics_interval.map(|every| {
        nm_controlplane::analytics::Analytics::new(store.clone())
            .with_alerts(cp.alerts.clone())
            .spawn_scheduler(every, stop.clone())
    });
    // Running experiments are evaluated on the same schedule; their changes are announced.
    let evaluator = settings.analytics_interval.map(|every| {
        cp.experiments
            .spawn_evaluator(every, Some(cp.alerts.clone()), stop.clone())
    });
    let budget_alerts = cp.alerts.spawn_budget_watch(&cp.budgets, stop.clone());
    // Raw rows past their retention are deleted in the background (nothing when unset).
    let retention = nm_controlplane::retention::Retainer::new(store.clone(), settings.retention)
        .spawn(stop.clone());
    // Yesterday's records and signals, written after each UTC midnight (docs/export.md).
    let exporter = match settings.export.clone() {
        Some(schedule) => Some(crate::export::spawn_schedule(
            store.clone(),
            schedule,
            std::env::vars().collect(),
            stop.clone(),
        )?),
        None => None,
    };
    let alerts = cp.alerts.spawn_worker(
        std::sync::Arc::new(crate::webhooks::WebhookClient::new()?),
        settings.alert_retry,
        stop.clone(),
    );
    let served_cp = cp.clone();
    let providers = Arc::new(provider_catalogue(
        &settings.registry,
        &settings.operator_credentials,
    ));
    let ui = ui_listener.map(|l| {
        let services = crate::ui::Services::new(&cp, providers.clone());
        let ui = Arc::new(crate::ui::Ui::new(services, &settings.ui));
        tokio::spawn(crate::ui::serve(ui, l, signalled(stop.clone())))
    });
    let options = server::Options {
        link_secret: settings.link_secret.clone(),
        tls: settings.grpc_tls.clone(),
        tracing,
        providers,
    };
    let task = tokio::spawn(async move {
        let served = server::serve(served_cp, options, listener, signalled(stop)).await;
        if let Some(ui) = ui {
            let _ = ui.await;
        }
        if let Some(scheduler) = scheduler {
            scheduler.abort();
            let _ = scheduler.await;
        }
        if let Some(evaluator) = evaluator {
            evaluator.abort();
            let _ = evaluator.await;
        }
        alerts.abort();
        let _ = alerts.await;
        if let Some(retention) = retention {
            retention.abort();
            let _ = retention.await;
        }
        budget_alerts.abort();
        let _ = budget_alerts.await;
        if let Some(exporter) = exporter {
            exporter.abort();
            let _ = exporter.await;
        }
        store.close().await?;
        info!("controlplane stopped");
        served
    });
    Ok((cp, addr, ui_addr, generated.map(|k| k.secret), task))
}

/// What experiments may know of the configured providers: each one's wire format and whether
/// the operator gave it a credential, here or on the dataplanes (`held_elsewhere`:
/// `NM_OPERATOR_CREDENTIALS`), never the credential itself.
pub fn provider_catalogue(
    registry: &nm_dataplane::Registry,
    held_elsewhere: &[String],
) -> Catalogue {
    Catalogue::new(registry.names().into_iter().filter_map(|name| {
        let p = registry.get(&name)?;
        let wire_format = match p.format {
            WireFormat::Openai => "openai",
            WireFormat::Anthropic => "anthropic",
            WireFormat::Gemini => "gemini",
        };
        Some((
            name.to_string(),
            ProviderInfo {
                wire_format: wire_format.to_owned(),
                operator_credential: p.api_key.as_deref().is_some_and(|k| !k.is_empty())
                    || held_elsewhere.iter().any(|h| **h == *name),
            },
        ))
    }))
}

async fn dataplane(
    settings: &Settings,
    port: Arc<dyn Port>,
    key_verifier: VerifierKey,
    stop: watch::Receiver<bool>,
    metrics: Metrics,
    tracing: Option<nm_dataplane::otel::Tracing>,
    // Spans of the link's calls (and, in `serve`, the in-process controlplane's database spans).
    link_tracing: Option<crate::otel::link::LinkTracing>,
) -> anyhow::Result<(SocketAddr, Task)> {
    let config = DataplaneConfig {
        registry: settings.registry.clone(),
        max_body_bytes: settings.max_body_bytes,
        connect_timeout: settings.connect_timeout,
        header_timeout: settings.header_timeout,
        shutdown_grace: settings.shutdown_grace,
        record_queue_capacity: settings.record_queue,
        extra_roots: settings.extra_ca_certs.clone(),
        version: crate::VERSION,
        prices: settings.prices.clone(),
        reserve_output_tokens: settings.reserve_output_tokens,
        tpm_default_max_tokens: settings.tpm_default_max_tokens,
        key_verifier,
        conn_limits: nm_dataplane::conns::ConnLimits {
            max_connections: crate::limits::connection_cap(settings.conn_limits.max_connections),
            ..settings.conn_limits
        },
        upstream_idle_timeout: settings.upstream_idle_timeout,
        hot_path: settings.hot_path,
        implicit: settings.implicit.clone(),
        tracing,
        metrics,
        access_log: crate::telemetry::access_log(),
    };
    let signals = Arc::new(PortSignals { port: port.clone() });
    let (dp, queue) = Dataplane::new(config, signals)?;
    let name = format!("dataplane-{}", std::process::id());
    let spool_dir = settings.spool_dir.clone();
    let spool_cap = settings.spool_max_bytes;
    let (durability, sink) = (settings.record_durability, dp.records().clone());
    let (spool, durable) = tokio::task::spawn_blocking(move || {
        let mut spool = Spool::open(&spool_dir, spool_cap)?;
        let durable = sink.start_durability(&spool_dir, spool_cap, durability, &mut spool)?;
        Ok::<_, nm_dataplane::spool::SpoolError>((spool, durable))
    })
    .await?
    .with_context(|| {
        format!(
            "cannot open the record spool in NM_SPOOL_DIR {}",
            settings.spool_dir.display()
        )
    })?;
    let targets = LinkTargets {
        keys: dp.keys().clone(),
        experiments: dp.experiments().clone(),
        health: dp.health().clone(),
        budgets: dp.budgets().clone(),
        metrics: dp.metrics().clone(),
        spool: SharedSpool::new(spool),
        dead_letters: DeadLetters::in_dir(&settings.spool_dir),
        settler: dp.records().settler(),
        tracing: link_tracing.as_ref().map(|t| t.batches()),
    };
    let link = Link::spawn(port, targets, queue, name);
    let listener = TcpListener::bind(settings.http_addr)
        .await
        .with_context(|| format!("cannot listen on NM_HTTP_ADDR {}", settings.http_addr))?;
    let addr = listener.local_addr()?;
    info!(%addr, "dataplane HTTP listening on {addr}");
    let task = tokio::spawn(async move {
        let drained = dp.serve(listener, Box::pin(signalled(stop))).await;
        link.stop().await;
        // The shipper is done: the journal applies its last settlements, the ledger says the
        // run ended cleanly.
        tokio::task::spawn_blocking(move || durable.stop()).await?;
        info!(?drained, "dataplane stopped");
        Ok(())
    });
    Ok((addr, task))
}

#[cfg(test)]
mod catalogue_tests {
    use super::*;

    /// A controlplane knows a provider has an operator credential from its own settings or
    /// from `NM_OPERATOR_CREDENTIALS`, and never holds more than that fact.
    #[test]
    fn operator_credentials_come_from_here_or_from_the_names_given() {
        let env: std::collections::HashMap<String, String> = [
            ("NM_PROVIDER_KEY_MISTRAL", "sk-m"),
            ("NM_OPERATOR_CREDENTIALS", " Groq, "),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
        let settings = crate::config::resolve(
            Mode::Serve,
            &crate::config::Flags::default(),
            &env,
            crate::config::FileSettings::default(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let c = provider_catalogue(&settings.registry, &settings.operator_credentials);
        let held = |n: &str| c.get(n).is_some_and(|p| p.operator_credential);
        assert!(held("mistral"), "its own credential");
        assert!(held("groq"), "named in NM_OPERATOR_CREDENTIALS");
        assert!(!held("openai"));
        assert_eq!(
            c.get("groq").map(|p| p.wire_format.as_str()),
            Some("openai")
        );
        // A name that is no provider name is refused at start.
        let bad: std::collections::HashMap<String, String> =
            [("NM_OPERATOR_CREDENTIALS".to_owned(), "groq;rm".to_owned())].into();
        let e = crate::config::resolve(
            Mode::Serve,
            &crate::config::Flags::default(),
            &bad,
            crate::config::FileSettings::default(),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(e.contains("NM_OPERATOR_CREDENTIALS"), "{e}");
    }
}
