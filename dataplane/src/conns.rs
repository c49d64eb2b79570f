//! Client connections: how many may be open, how long a new one may stay silent, which are
//! closed when the limit is reached, and the drain at shutdown.
//!
//! Every accepted connection is registered in [`Conns`] with a [`ConnState`]: the requests in
//! flight on it (a request counts until its response body has been sent or dropped) and since
//! when it has been idle. Limits:
//!
//! - **Header timeout.** A new connection must deliver its first request head within
//!   `header_timeout` of being accepted, or it is closed; that covers a socket that never sends
//!   a byte, and one that sends a few bytes of a request line or an HTTP/2 preface and stops
//!   (hyper's own header timeout starts only once it knows the protocol). Afterwards hyper
//!   applies the same timeout to every following HTTP/1.1 request head, which also closes a
//!   kept-alive connection idle for that long.
//! - **Idle timeout.** A connection that has served requests and has none in flight for the
//!   same `header_timeout` is shut down gracefully by its task (checked by one timer per
//!   connection, re-armed at most once per timeout). That is what closes an HTTP/2 connection
//!   left open with no stream: hyper has no idle timeout for HTTP/2.
//! - **A cap on open connections** (`max_connections`). A connection accepted at the cap makes
//!   room by closing the connection that has been idle (no request in flight) the longest —
//!   silent sockets first, since they have been idle since they were accepted — and an idle
//!   HTTP/1.1 or HTTP/2 connection closes at once (hyper's graceful shutdown: a request already
//!   under way finishes first). When no connection is idle, the new one is closed at once. So a
//!   flood of silent or idle sockets cannot keep a client with a request from being served, and
//!   the process never runs out of file descriptors for its upstream connections and spool.
//! - **Drain.** At shutdown every connection is told to finish (graceful shutdown: the requests
//!   in flight complete, then it closes); [`Conns::drained`] resolves when none is left.
//!
//! Costs on the request path: an atomic increment when a request starts and a decrement (plus a
//! clock read when it was the last) when its response ends. Registering a connection takes a
//! mutex once at accept and once at close; choosing which connection to close scans the open
//! ones, only at the cap.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::Notify;

use crate::body::{BoxError, GatewayBody};

/// Limits on client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Time a connection has to deliver a request head (its first, and on HTTP/1.1 each next).
    pub header_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Request bodies ([`crate::pace`]): longest wait for the next frame.
    pub body_idle_timeout: Duration,
    /// Request bodies: bytes per second they must average after the idle time (0: none).
    pub body_min_rate: u64,
}

/// Default time for a request head to arrive.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest wait for the next frame of a request body.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default minimum average rate of a request body, bytes per second.
pub const DEFAULT_BODY_MIN_RATE: u64 = 1024;
/// File descriptors kept out of the connection cap's reach: upstream connections, the
/// database, the spool, the logs.
const RESERVED_FDS: u64 = 64;

/// The connection cap for a process allowed `nofile` open files: half of what is left after a
/// reserve, since each client connection with a request in flight also holds an upstream one.
pub fn max_connections_for(nofile: u64) -> usize {
    let cap = nofile.saturating_sub(RESERVED_FDS) / 2;
    usize::try_from(cap.max(16)).unwrap_or(usize::MAX)
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: 4096,
            body_idle_timeout: DEFAULT_BODY_IDLE_TIMEOUT,
            body_min_rate: DEFAULT_BODY_MIN_RATE,
        }
    }
}

/// One connection's state, shared by its task, its requests and the registry.
#[derive(Debug)]
pub struct ConnState {
    in_flight: AtomicU32,
    /// Requests started on it so far (the header timeout ends with the first).
    started: AtomicU32,
    /// Milliseconds since [`Conns`] began when it last became idle.
    idle_since_ms: AtomicU64,
    /// Told to close (shed at the cap, or the drain).
    close: Notify,
    /// The registry's start, for the idle clock.
    epoch: Instant,
}

impl ConnState {
    /// A request begins; the returned guard ends it (keep it until the response body ends).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            conn: Some(self.clone()),
        }
    }

    /// Whether any request has started on it.
    pub fn has_started(&self) -> bool {
        self.started.load(Ordering::Relaxed) > 0
    }

    fn is_idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }

    /// How long it has been without a request in flight; `None` while one is.
    pub fn idle_for(&self) -> Option<Duration> {
        if !self.is_idle() {
            return None;
        }
        let since = self.idle_since_ms.load(Ordering::Relaxed);
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        Some(Duration::from_millis(now.saturating_sub(since)))
    }

    /// Resolves when the connection is told to close.
    pub async fn closing(&self) {
        self.close.notified().await;
    }
}

/// A request in flight on a connection; dropping it ends the request.
#[derive(Debug)]
pub struct InFlight {
    conn: Option<Arc<ConnState>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take()
            && conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1
        {
            let since = conn.epoch.elapsed().as_millis();
            conn.idle_since_ms
                .store(u64::try_from(since).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }
}

#[derive(Debug, Default)]
struct Registry {
    next_id: u64,
    open: BTreeMap<u64, Arc<ConnState>>,
    draining: bool,
}

/// The open client connections of one dataplane. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Conns {
    inner: Arc<Mutex<Registry>>,
    /// Woken whenever a connection closes (the drain waits on it).
    closed: Arc<Notify>,
    epoch: Instant,
    pub limits: ConnLimits,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// At the cap, and every open connection has a request in flight.
    Full,
    /// Shutting down.
    Draining,
}

impl Conns {
    pub fn new(limits: ConnLimits) -> Self {
        Self {
            inner: Arc::default(),
            closed: Arc::default(),
            epoch: Instant::now(),
            limits,
        }
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Registers a new connection. At the cap, the connection idle the longest is told to
    /// close (and leaves the count at once); returns whether one was.
    pub fn admit(&self) -> Result<(Registered, bool), Refused> {
        let mut reg = self.registry();
        if reg.draining {
            return Err(Refused::Draining);
        }
        let mut shed = false;
        if reg.open.len() >= self.limits.max_connections {
            let oldest_idle = reg
                .open
                .iter()
                .filter(|(_, c)| c.is_idle())
                .min_by_key(|(id, c)| (c.idle_since_ms.load(Ordering::Relaxed), **id))
                .map(|(id, _)| *id);
            let Some(id) = oldest_idle else {
                return Err(Refused::Full);
            };
            if let Some(victim) = reg.open.remove(&id) {
                victim.close.notify_one();
                shed = true;
            }
        }
        let id = reg.next_id;
        reg.next_id += 1;
        let state = Arc::new(ConnState {
            in_flight: AtomicU32::new(0),
            started: AtomicU32::new(0),
            idle_since_ms: AtomicU64::new(
                u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX),
            ),
            close: Notify::new(),
            epoch: self.epoch,
        });
        reg.open.insert(id, state.clone());
        Ok((
            Registered {
                conns: self.clone(),
                id,
                state,
            },
            shed,
        ))
    }

    /// How many connections are open.
    pub fn open(&self) -> usize {
        self.registry().open.len()
    }

    /// Stops admitting connections and tells every open one to finish.
    pub fn drain(&self) {
        let mut reg = self.registry();
        reg.draining = true;
        for c in reg.open.values() {
            c.close.notify_one();
        }
    }

    /// Resolves once no connection is open (after [`Conns::drain`]).
    pub async fn drained(&self) {
        loop {
            let notified = self.closed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// A registered connection; dropping it unregisters it.
#[derive(Debug)]
pub struct Registered {
    conns: Conns,
    id: u64,
    pub state: Arc<ConnState>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.conns.registry().open.remove(&self.id);
        self.conns.closed.notify_waiters();
    }
}

// === impl Track ===

/// The dataplane service of one connection, counting its requests in flight: a request counts
/// from the call until its response body has ended or been dropped.
#[derive(Debug, Clone)]
pub struct Track<S> {
    inner: S,
    conn: Arc<ConnState>,
}

impl<S> Track<S> {
    pub fn new(inner: S, conn: Arc<ConnState>) -> Self {
        Self { inner, conn }
    }
}

impl<S, B> tower::Service<http::Request<B>> for Track<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<GatewayBody>>,
{
    type Response = http::Response<TrackedBody>;
    type Error = S::Error;
    type Future = TrackFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        TrackFuture {
            guard: Some(self.conn.begin()),
            inner: self.inner.call(req),
        }
    }
}

pin_project! {
    /// The response future of [`Track`]: hands the request's guard to the response body.
    pub struct TrackFuture<F> {
        #[pin]
        inner: F,
        guard: Option<InFlight>,
    }
}

impl<F, E> Future for TrackFuture<F>
where
    F: Future<Output = Result<http::Response<GatewayBody>, E>>,
{
    type Output = Result<http::Response<TrackedBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let resp = std::task::ready!(this.inner.poll(cx))?;
        let guard = this.guard.take();
        Poll::Ready(Ok(resp.map(|inner| TrackedBody {
            inner,
            _guard: guard,
        })))
    }
}

pin_project! {
    /// A response body holding its request's place among the connection's requests in flight.
    pub struct TrackedBody {
        #[pin]
        inner: GatewayBody,
        _guard: Option<InFlight>,
    }
}

impl Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conns(max: usize) -> Conns {
        Conns::new(ConnLimits {
            max_connections: max,
            ..ConnLimits::default()
        })
    }

    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room() {
        let c = conns(3);
        let (a, _) = c.admit().unwrap();
        let (b, _) = c.admit().unwrap();
        let (d, _) = c.admit().unwrap();
        // `a` is busy; `b` and `d` are idle since they opened, `b` the longer.
        let busy = a.state.begin();
        let (_e, shed) = c.admit().unwrap();
        assert!(shed);
        assert_eq!(c.open(), 3);
        let reg = c.registry();
        assert!(reg.open.contains_key(&a.id));
        assert!(
            !reg.open.contains_key(&b.id),
            "the oldest idle one goes first"
        );
        assert!(reg.open.contains_key(&d.id));
        drop(reg);
        drop(busy);
    }

    #[test]
    fn when_every_connection_is_busy_the_new_one_is_refused() {
        let c = conns(2);
        let (a, _) = c.admit().unwrap();
        let (b, _) = c.admit().unwrap();
        let _ga = a.state.begin();
        let _gb = b.state.begin();
        assert_eq!(c.admit().unwrap_err(), Refused::Full);
        assert_eq!(c.open(), 2);
    }

    #[test]
    fn a_connection_idle_again_is_judged_by_when_its_last_request_ended() {
        let c = conns(2);
        let (a, _) = c.admit().unwrap();
        let (b, _) = c.admit().unwrap();
        // `a` served a request that ended after `b` opened: `b` has been idle longer.
        std::thread::sleep(Duration::from_millis(5));
        drop(a.state.begin());
        let (_n, shed) = c.admit().unwrap();
        assert!(shed);
        assert!(c.registry().open.contains_key(&a.id));
        assert!(!c.registry().open.contains_key(&b.id));
    }

    #[tokio::test]
    async fn drain_tells_every_connection_and_waits_for_them() {
        let c = conns(8);
        let (a, _) = c.admit().unwrap();
        let state = a.state.clone();
        let task = tokio::spawn(async move {
            state.closing().await;
            drop(a);
        });
        c.drain();
        assert_eq!(c.admit().unwrap_err(), Refused::Draining);
        c.drained().await;
        task.await.unwrap();
        assert_eq!(c.open(), 0);
    }

    #[test]
    fn the_cap_leaves_room_for_upstreams() {
        assert_eq!(max_connections_for(1024), 480);
        assert_eq!(max_connections_for(10), 16);
        assert!(max_connections_for(1 << 20) > 500_000);
    }
}
