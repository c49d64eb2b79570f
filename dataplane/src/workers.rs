//! The HTTP worker threads: one single-threaded tokio runtime per CPU.
//!
//! The accept loop hands each connection to a worker, round-robin. Everything that connection
//! does afterwards — parsing, the proxy handler, the upstream call (each worker has its own
//! upstream connection pool, see [`crate::forward::Upstream`]) and the streamed response body —
//! runs on that one thread. Nothing is stolen by or woken across threads, and memory is freed on
//! the thread that allocated it. Against the same service on tokio's shared multi-threaded
//! runtime this served 8–14% more requests per second (wrk, 50 connections, alternating runs),
//! and per-worker upstream pools another 4–12%.
//!
//! The rest of the process (controlplane link, record shipper, gRPC) stays on the main
//! runtime; the record queue and the in-memory key and budget state are shared across both.

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;
use tracing::warn;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// How many workers a dataplane runs: one per CPU this process may use.
pub fn default_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The index of the worker running the caller (`0..count`), or 0 outside a worker thread.
pub fn current() -> usize {
    INDEX.with(Cell::get)
}

/// Running worker threads. Dropping it stops them: their runtimes shut down, which drops the
/// connections still open on them.
#[derive(Debug)]
pub struct Workers {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
}

impl Workers {
    /// Starts `count` workers (at least one), each with its timer tick unless `tick` is off.
    pub fn start(count: usize, tick: bool) -> std::io::Result<Self> {
        let count = count.max(1);
        let mut workers = Self {
            handles: Vec::with_capacity(count),
            stops: Vec::with_capacity(count),
            threads: Vec::with_capacity(count),
            next: AtomicUsize::new(0),
        };
        for index in 0..count {
            let runtime = Builder::new_current_thread().enable_all().build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            workers.handles.push(runtime.handle().clone());
            workers.stops.push(stop);
            let thread = std::thread::Builder::new()
                .name(format!("nm-http-{index}"))
                .spawn(move || {
                    INDEX.with(|i| i.set(index));
                    // A current-thread runtime runs its tasks only inside `block_on`: block until
                    // told to stop (or until the sender is dropped).
                    runtime.block_on(async move {
                        tokio::select! {
                            _ = stopped => {}
                            () = keep_timer_armed(), if tick => {}
                        }
                    });
                })?;
            workers.threads.push(thread);
        }
        Ok(workers)
    }

    /// Runs `task` on the next worker.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        // The JoinHandle is not needed: the task reports its own end.
        drop(self.handles[i].spawn(task));
    }

    /// Stops the workers and waits until their threads have ended (tasks still running are
    /// dropped).
    pub async fn stop(mut self) {
        self.stops.clear();
        let threads = std::mem::take(&mut self.threads);
        let joined = tokio::task::spawn_blocking(move || {
            for t in threads {
                if t.join().is_err() {
                    warn!("an HTTP worker thread panicked");
                }
            }
        })
        .await;
        if joined.is_err() {
            warn!("could not wait for the HTTP worker threads");
        }
    }
}

/// Keeps one timer on the worker's clock at most [`TICK`] ahead, forever.
///
/// tokio's timer writes to the runtime's wake-up eventfd whenever a timer is set earlier than the
/// earliest one the runtime knew of when it last went idle, and "none at all" counts as later
/// than anything. On an HTTP worker that happened on about a third of all requests (the
/// upstream's response-head timeout, hyper's header-read timeout, set on a worker that had gone
/// idle with no timer): a `write` system call, and an extra spin of the event loop, each time.
/// With this tick the runtime always idles with a timer at most a second away, so a request's
/// timeouts (seconds long) never count as earlier, and the tick itself costs one wake-up a
/// second.
async fn keep_timer_armed() {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// How far ahead [`keep_timer_armed`] keeps its timer; shorter than any request timeout.
const TICK: std::time::Duration = std::time::Duration::from_secs(1);
