//! Accepts connections (HTTP/1.1 and HTTP/2, detected per connection) and drains on shutdown:
//! when the shutdown future completes, the listener is closed (new connections are refused),
//! `/health` turns 503, and in-flight requests and streams get up to the grace period to finish.
//!
//! Connections are served on the [`Workers`] (one single-threaded runtime per CPU), each
//! connection wholly on one of them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::stack::{State, service};
use crate::workers::{self, Workers};

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every connection finished within the grace period.
    Clean,
    /// The grace period ran out; the remaining connections were dropped.
    GraceExpired,
}

pub async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> Drained {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    builder.http2().timer(hyper_util::rt::TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let workers = Workers::start(workers::default_count())
        .map_err(|e| warn!(error = %e, "cannot start the HTTP worker threads; serving on the main runtime"))
        .ok();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let svc = TowerToHyperService::new(service(state.clone()));
                    let builder = builder.clone();
                    let watcher = graceful.watcher();
                    // The socket moves to the worker's own I/O driver.
                    let stream = match stream.into_std() {
                        Ok(s) => s,
                        Err(e) => {
                            warn!(%peer, error = %e, "cannot hand a connection to a worker");
                            continue;
                        }
                    };
                    let task = async move {
                        let stream = match tokio::net::TcpStream::from_std(stream) {
                            Ok(s) => s,
                            Err(e) => {
                                warn!(%peer, error = %e, "cannot register a connection");
                                return;
                            }
                        };
                        let conn = builder.serve_connection(TokioIo::new(stream), svc);
                        if let Err(e) = watcher.watch(conn).await {
                            debug!(%peer, error = %e, "connection ended with an error");
                        }
                    };
                    match &workers {
                        Some(w) => w.spawn(task),
                        None => drop(tokio::spawn(task)),
                    }
                }
                Err(e) => {
                    // Usually EMFILE: back off a little instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    state.health.set_draining();
    info!(
        grace_secs = grace.as_secs(),
        "draining: listener closed, waiting for in-flight requests"
    );
    let drained = match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => {
            info!("drained");
            Drained::Clean
        }
        Err(_) => {
            warn!("grace period over; closing the remaining connections");
            Drained::GraceExpired
        }
    };
    if let Some(w) = workers {
        w.stop().await;
    }
    drained
}
