//! Accepts connections (HTTP/1.1 and HTTP/2, detected per connection) and drains on shutdown:
//! when the shutdown future completes, the listener is closed (new connections are refused),
//! `/health` turns 503, and in-flight requests and streams get up to the grace period to finish.
//!
//! Connections are served on the [`Workers`] (one single-threaded runtime per CPU), each
//! connection wholly on one of them. How many may be open, how long a new one may stay silent
//! or a served one idle, and which are closed at the cap: [`crate::conns`]. Accept failures (no file descriptor
//! left) are logged at most once a second.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use nm_types::throttle::Throttle;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::conns::{Conns, Track};
use crate::stack::service;
use crate::state::State;
use crate::workers::{self, Workers};

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every connection finished within the grace period.
    Clean,
    /// The grace period ran out; the remaining connections were dropped.
    GraceExpired,
}

/// A future that completes when the server is to stop accepting (boxed once, at start-up).
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Serves on `listener` until `shutdown` completes, then drains.
///
/// Not generic, and the future is boxed here, once at start-up: the accept loop and the whole
/// per-connection proxy (hyper's server and client, h2) are compiled in this crate, not again
/// in the crate that awaits it (an `async fn`'s state machine is compiled where it is polled).
/// Nothing per request or per connection is boxed for it (bench/HISTORY.md, "Session 27").
pub fn serve(
    listener: TcpListener,
    state: Arc<State>,
    shutdown: Shutdown,
    grace: Duration,
) -> Pin<Box<dyn Future<Output = Drained> + Send>> {
    Box::pin(accept_loop(listener, state, shutdown, grace))
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<State>,
    mut shutdown: Shutdown,
    grace: Duration,
) -> Drained {
    let limits = state.conn_limits;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder.http2().timer(hyper_util::rt::TokioTimer::new());
    let conns = Conns::new(limits);
    let workers = Workers::start(workers::default_count(), state.hot_path.timer_tick)
        .map_err(|e| warn!(error = %e, "cannot start the HTTP worker threads; serving on the main runtime"))
        .ok();
    info!(
        max_connections = limits.max_connections,
        header_timeout_secs = limits.header_timeout.as_secs(),
        "accepting connections"
    );
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let registered = match conns.admit() {
                        Ok((registered, shed)) => {
                            if shed {
                                state.metrics.connection_closed("shed");
                            }
                            registered
                        }
                        Err(_) => {
                            // At the cap with every connection busy: this one is closed unserved.
                            state.metrics.connection_closed("refused");
                            if let Some(suppressed) = REFUSED_LOGGED.allow() {
                                warn!(%peer, suppressed, max = limits.max_connections,
                                    "connection refused: at the connection cap, none idle");
                            }
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let svc = TowerToHyperService::new(Track::new(
                        service(state.clone()),
                        registered.state.clone(),
                    ));
                    let builder = builder.clone();
                    let metrics = state.metrics.clone();
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
                        // Until it ends: closed when no request head arrives within the header
                        // timeout of the accept; shut down gracefully (requests in flight
                        // finish) when the registry says so (shed at the cap, or the drain).
                        let conn = builder.serve_connection(TokioIo::new(stream), svc);
                        tokio::pin!(conn);
                        let first_head = tokio::time::sleep(limits.header_timeout);
                        tokio::pin!(first_head);
                        // Once requests have come: the idle check (an HTTP/2 connection with no
                        // open stream is otherwise kept for ever).
                        let idle_check = tokio::time::sleep(limits.header_timeout);
                        tokio::pin!(idle_check);
                        let (mut waiting_first, mut closing) = (true, false);
                        loop {
                            tokio::select! {
                                ended = conn.as_mut() => {
                                    if let Err(e) = ended {
                                        // hyper's own header timeout (a request line or the
                                        // next request's head too slow) counts like ours.
                                        if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout) {
                                            metrics.connection_closed("header_timeout");
                                        }
                                        debug!(%peer, error = %e, "connection ended with an error");
                                    }
                                    break;
                                }
                                () = &mut first_head, if waiting_first => {
                                    waiting_first = false;
                                    if !registered.state.has_started() {
                                        metrics.connection_closed("header_timeout");
                                        debug!(%peer, "connection closed: no request head within the header timeout");
                                        break;
                                    }
                                }
                                () = &mut idle_check, if !waiting_first && !closing => {
                                    let timeout = limits.header_timeout;
                                    let now = tokio::time::Instant::now();
                                    match registered.state.idle_for() {
                                        Some(idle) if idle >= timeout => {
                                            closing = true;
                                            metrics.connection_closed("idle_timeout");
                                            debug!(%peer, "connection closed: idle for the header timeout");
                                            conn.as_mut().graceful_shutdown();
                                        }
                                        Some(idle) => idle_check.as_mut().reset(now + (timeout - idle)),
                                        None => idle_check.as_mut().reset(now + timeout),
                                    }
                                }
                                () = registered.state.closing(), if !closing => {
                                    closing = true;
                                    conn.as_mut().graceful_shutdown();
                                }
                            }
                        }
                        drop(registered);
                    };
                    match &workers {
                        Some(w) => w.spawn(task),
                        None => drop(tokio::spawn(task)),
                    }
                }
                Err(e) => {
                    // Usually EMFILE (no file descriptor left): back off a little instead of
                    // spinning, and log at most a line a second.
                    if let Some(suppressed) = ACCEPT_LOGGED.allow() {
                        warn!(error = %e, suppressed, "accept failed");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = shutdown.as_mut() => break,
        }
    }
    drop(listener);
    state.health.set_draining();
    info!(
        grace_secs = grace.as_secs(),
        "draining: listener closed, waiting for in-flight requests"
    );
    conns.drain();
    let drained = match tokio::time::timeout(grace, conns.drained()).await {
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

/// Accept failures' allowance: at most a line a second (see [`nm_types::throttle`]).
static ACCEPT_LOGGED: Throttle = Throttle::new(Duration::from_secs(1));
/// Connections refused at the cap: likewise.
static REFUSED_LOGGED: Throttle = Throttle::new(Duration::from_secs(1));
