//! The export of spans: ended spans go into a bounded queue on the request path
//! ([`SpanQueue`], never waiting: a full queue drops the span and counts it), and one thread of
//! its own exports them in batches. The thread runs its own single-threaded Tokio runtime, which both OTLP transports
//! need (tonic's channel, hyper's HTTP client), so a slow, dead or hanging collector only ever
//! delays that thread.
//!
//! Like the SDK's batch processor, the request path does not wake the thread for each span: a
//! span only joins the queue; the thread wakes on its schedule, when a batch is full, or to
//! shut down. Unlike it, drops are counted where the operator sees them
//! (`nm_otel_spans_dropped_total`, reasons `queue_full` and `export_failed`), and a batch is
//! encoded straight into OTLP protobuf ([`super::otlp`]) in a buffer the thread reuses, then sent
//! ([`super::transport`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nm_dataplane::otel::span::{Backlog, SpanData, SpanQueue};
use nm_types::throttle::Throttle;

use super::otlp::Encoder;
use super::transport::Sender;
use super::wire::BuildError;

pub use nm_dataplane::otel::span::DropCounter;

/// What the export thread is asked to do besides its schedule.
enum Control {
    /// A batch's worth is queued.
    Batch,
    Shutdown(mpsc::Sender<()>),
}

/// The export thread, to shut down; spans reach it through the [`SpanQueue`] [`start`] returns
/// with it.
pub struct Exporter {
    control: SyncSender<Control>,
    thread: JoinHandle<()>,
    /// Longest wait for the shutdown (the export timeout and a margin).
    patience: Duration,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter").finish_non_exhaustive()
    }
}

/// The export thread's settings.
pub struct Schedule {
    pub queue: usize,
    pub batch: usize,
    pub delay: Duration,
    pub timeout: Duration,
}

/// The export thread gave no answer in time, or is gone.
#[derive(Debug, thiserror::Error)]
#[error("the OpenTelemetry export thread did not answer within {0:?}")]
pub struct NoAnswer(Duration);

/// Starts the export thread, which encodes with `encoder` and sends with what `make` builds on
/// it, inside its runtime; returns the queue spans are ended into, and the thread's handle.
pub fn start<F>(
    schedule: Schedule,
    encoder: Encoder,
    make: F,
    drops: DropCounter,
) -> std::io::Result<(SpanQueue, Exporter)>
where
    F: FnOnce() -> Result<Sender, BuildError> + Send + 'static,
{
    let (spans, span_rx) = mpsc::sync_channel(schedule.queue);
    // Control messages are few; a small buffer keeps `Batch` from ever waiting.
    let (control, control_rx) = mpsc::sync_channel(16);
    let backlog = Arc::new(Backlog::default());
    let worker = Worker {
        spans: span_rx,
        control: control_rx,
        backlog: backlog.clone(),
        batch: schedule.batch,
        delay: schedule.delay,
        timeout: schedule.timeout,
        drops: drops.clone(),
        failing: false,
        pending: Vec::new(),
        encoder,
        buffer: Vec::new(),
    };
    let thread = std::thread::Builder::new()
        .name("nm-otel-export".to_owned())
        .spawn(move || worker.run(make))?;
    let wake = control.clone();
    let queue = SpanQueue {
        spans,
        backlog,
        batch: schedule.batch,
        wake: Box::new(move || {
            let _ = wake.try_send(Control::Batch);
        }),
        drops,
    };
    let exporter = Exporter {
        control,
        thread,
        patience: schedule.timeout + Duration::from_secs(1),
    };
    Ok((queue, exporter))
}

impl Exporter {
    /// Exports what is queued and stops the thread; blocks until done (or the export timeout).
    pub fn shutdown(self) -> Result<(), NoAnswer> {
        let (tx, rx) = mpsc::channel();
        let answered = match self.control.send(Control::Shutdown(tx)) {
            Ok(()) => rx
                .recv_timeout(self.patience)
                .map_err(|_| NoAnswer(self.patience)),
            Err(_) => Err(NoAnswer(Duration::ZERO)),
        };
        if answered.is_ok() {
            let _ = self.thread.join();
        }
        answered
    }
}

struct Worker {
    spans: Receiver<SpanData>,
    control: Receiver<Control>,
    backlog: Arc<Backlog>,
    batch: usize,
    delay: Duration,
    timeout: Duration,
    drops: DropCounter,
    /// Whether the last export failed.
    failing: bool,
    /// The batch being exported (reused), and its encoding.
    pending: Vec<SpanData>,
    encoder: Encoder,
    buffer: Vec<u8>,
}

/// Partial successes (spans a collector refused) are logged at most once a minute.
static REJECTED: Throttle = Throttle::new(Duration::from_secs(60));

impl Worker {
    fn run<F>(mut self, make: F)
    where
        F: FnOnce() -> Result<Sender, BuildError>,
    {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "OpenTelemetry export thread has no runtime; no span will be exported");
                return;
            }
        };
        let exporter = {
            let _entered = runtime.enter();
            make()
        };
        let exporter = match exporter {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::error!(error = %e, "cannot build the OTLP exporter; no span will be exported");
                None
            }
        };
        let mut next = Instant::now() + self.delay;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            match self.control.recv_timeout(wait) {
                Ok(Control::Batch) => {
                    self.backlog.batch_asked.store(false, Ordering::Relaxed);
                    self.export_queued(&runtime, exporter.as_ref());
                }
                Ok(Control::Shutdown(done)) => {
                    self.export_queued(&runtime, exporter.as_ref());
                    let _ = done.send(());
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.export_queued(&runtime, exporter.as_ref());
                    next = Instant::now() + self.delay;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.export_queued(&runtime, exporter.as_ref());
                    return;
                }
            }
        }
    }

    /// Exports everything queued, in batches.
    fn export_queued(&mut self, runtime: &tokio::runtime::Runtime, exporter: Option<&Sender>) {
        loop {
            while self.pending.len() < self.batch {
                match self.spans.try_recv() {
                    Ok(span) => self.pending.push(span),
                    Err(_) => break,
                }
            }
            let n = self.pending.len();
            if n == 0 {
                return;
            }
            self.backlog.queued.fetch_sub(n, Ordering::Relaxed);
            let full = n == self.batch;
            let exported = match exporter {
                Some(e) => {
                    self.encoder.encode(&self.pending, &mut self.buffer);
                    // The encoded batch is handed over whole (a copy of it would cost as much as
                    // its encoding); the next one gets a buffer of the same size.
                    let size = self.buffer.capacity();
                    let body = Bytes::from(std::mem::replace(
                        &mut self.buffer,
                        Vec::with_capacity(size),
                    ));
                    let timeout = self.timeout;
                    // The timer is made inside the runtime (it needs its clock).
                    runtime
                        .block_on(async {
                            tokio::time::timeout(
                                timeout + Duration::from_millis(500),
                                e.send(body, timeout),
                            )
                            .await
                        })
                        .map_err(|_| "timed out".to_owned())
                        .and_then(|r| r.map_err(|e| e.to_string()))
                }
                None => Err("no exporter".to_owned()),
            };
            self.pending.clear();
            match exported {
                Ok(answer) => {
                    if std::mem::replace(&mut self.failing, false) {
                        tracing::info!("OTLP export works again");
                    }
                    if let Some(p) = answer.partial_success
                        && (p.rejected_spans > 0 || !p.error_message.is_empty())
                        && let Some(suppressed) = REJECTED.allow()
                    {
                        tracing::warn!(
                            rejected_spans = p.rejected_spans,
                            message = %p.error_message,
                            suppressed,
                            "the OTLP collector refused part of a batch"
                        );
                    }
                }
                Err(e) => {
                    (self.drops)("export_failed", n as u64);
                    // Once per outage, not once per batch.
                    if !std::mem::replace(&mut self.failing, true) {
                        tracing::warn!(error = %e, spans = n, "OTLP export failed; spans are dropped (nm_otel_spans_dropped_total) until the collector answers");
                    }
                }
            }
            if !full {
                return;
            }
        }
    }
}
