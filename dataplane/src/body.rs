//! Bodies. [`GatewayBody`], the body of every response, is either a small body the gateway
//! made (errors, health) or an upstream body passed through frame by frame ([`ObservedBody`]).
//! [`RequestBody`] is a client's request body as the handlers see it.
//!
//! `ObservedBody` never buffers or alters a frame: it forwards each one as it is polled (so
//! backpressure reaches the upstream), counts bytes, notes the first byte's time, shows the
//! frame to the usage [`Meter`] (which reads it in place), and when the body ends — completely,
//! with an upstream error, or because the client went away and hyper dropped it — it ends the
//! request's event ([`crate::event`]), which completes the record, settles the budget, and
//! ends the request's spans, metrics and log line.
//! Dropping it also drops the upstream body, which closes the upstream stream: a client that
//! disconnects cancels the upstream request.
//!
//! That completion (and the metering of the last frame, which for a JSON answer is the whole
//! answer) runs after the last bytes are written ([`Finish::later`]): it is queued for a task
//! on the same worker thread, which runs once the connection's task has flushed the response
//! and yielded. So it adds nothing to the latency the client sees. The end time is taken when the
//! last frame passes; a completion whose task never runs (the runtime is shutting down) is done
//! when the task is dropped, so no record is lost.
//!
//! With `NM_RECORD_DURABILITY=spool` ([`crate::journal`]) an answer that ends completely is
//! completed at once instead, and its last frame (or its end) is held until the record is in the
//! journal on disk: a crash after the client saw the end cannot lose the record.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use pin_project_lite::pin_project;

use crate::event::{Ending, RequestEvent, SinkHandles};
use crate::journal::Commit;
pub use crate::pace::BoxError;
use crate::pace::{PaceLimits, Paced};
use crate::usage::Meter;

/// An upstream's answer body, given up when it stalls for the body idle timeout
/// ([`crate::pace`]).
pub type UpstreamBody = Paced<Incoming>;

/// Whether a request body has been read to its end, shared between the body and the layer that
/// answers errors ([`crate::layers::rescue`]).
#[derive(Debug, Clone, Default)]
pub struct ReadToEnd(Arc<AtomicBool>);

impl ReadToEnd {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

pin_project! {
    /// A client's request body, passed through unchanged, noting when it has been read to the
    /// end, and given up when it stalls ([`crate::pace`]). An error answered before its end
    /// leaves bytes on the connection that hyper will not read; the answer must then close the
    /// connection (see the rescue layer).
    #[derive(Debug)]
    pub struct RequestBody {
        #[pin]
        inner: Paced<Incoming>,
        // `None` for a body that was empty from the start (nothing to track).
        read: Option<ReadToEnd>,
    }
}

impl RequestBody {
    /// Wraps `inner`, paced by `limits`; the second value tells, later, whether it was read to
    /// the end (`None` for an empty body, which always is).
    pub fn new(inner: Incoming, limits: PaceLimits) -> (Self, Option<ReadToEnd>) {
        let read = (!inner.is_end_stream()).then(ReadToEnd::default);
        (
            Self {
                inner: Paced::new(inner, limits, "the request body"),
                read: read.clone(),
            },
            read,
        )
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        if let Some(read) = this.read
            && (matches!(polled, Poll::Ready(None)) || this.inner.is_end_stream())
        {
            read.0.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// The body of every dataplane response.
    #[project = GatewayBodyProj]
    pub enum GatewayBody {
        Full { #[pin] inner: Full<Bytes> },
        Upstream { #[pin] inner: ObservedBody },
    }
}

impl GatewayBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        GatewayBody::Full {
            inner: Full::new(bytes.into()),
        }
    }

    pub fn empty() -> Self {
        Self::full(Bytes::new())
    }
}

impl Body for GatewayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            GatewayBodyProj::Full { inner } => inner.poll_frame(cx).map_err(|never| match never {}),
            GatewayBodyProj::Upstream { inner } => inner.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GatewayBody::Full { inner } => inner.is_end_stream(),
            GatewayBody::Upstream { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GatewayBody::Full { inner } => inner.size_hint(),
            GatewayBody::Upstream { inner } => inner.size_hint(),
        }
    }
}

/// A body's end, waiting to end its request's event: the event, how and when the body ended,
/// and the last frame, not yet shown to the meter. Dropping it ends the event.
struct Finish {
    tracked: Option<Box<Tracked>>,
    ending: Ending,
    ended: Instant,
    last: Option<Bytes>,
}

/// What an [`ObservedBody`] tracks for its request's completion. Boxed: the response then
/// moves through the layers and into hyper as a few words instead of a kilobyte, and so does
/// its [`Finish`] into the completion queue.
struct Tracked {
    /// The request, filled on as the answer passes (first byte, bytes, captured content).
    event: RequestEvent,
    meter: Option<Meter>,
    sinks: SinkHandles,
}

thread_local! {
    /// On a single-threaded runtime's thread: completions waiting for the running task to yield
    /// (see [`Finish::later`]).
    static PENDING: RefCell<Pending> = const {
        RefCell::new(Pending {
            queue: Vec::new(),
            waker: None,
            draining: false,
        })
    };
}

/// Whether completions wait for the running task to yield ([`Finish::later`]); off only to
/// measure what that buys ([`crate::hot_path`]).
static DEFER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets whether request records are completed after the answer is written (the default) or
/// before. Process-wide: it is read where no request state reaches.
pub fn defer_completions(on: bool) {
    DEFER.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// A thread's waiting completions and the task that runs them.
struct Pending {
    queue: Vec<Finish>,
    /// The [`Drain`] task's waker, once it has run.
    waker: Option<Waker>,
    /// Whether this thread has a [`Drain`] task (spawned and not yet dropped).
    draining: bool,
}

/// The task of a thread that completes its queued records, each time it is woken.
/// Dropped (its runtime shutting down), it completes what is still queued and lets later
/// completions on the thread run at once.
#[derive(Default)]
struct Drain {
    /// The batch being completed; kept so its capacity is reused.
    batch: Vec<Finish>,
}

impl Future for Drain {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let batch = &mut self.batch;
        PENDING.with_borrow_mut(|p| {
            if !p.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                p.waker = Some(cx.waker().clone());
            }
            std::mem::swap(&mut p.queue, batch);
        });
        // Completing runs no code that queues again, and runs outside the borrow.
        batch.clear();
        Poll::Pending
    }
}

impl Drop for Drain {
    fn drop(&mut self) {
        let left = PENDING.try_with(|p| {
            let mut p = p.borrow_mut();
            p.draining = false;
            p.waker = None;
            std::mem::take(&mut p.queue)
        });
        drop(left);
    }
}

impl Finish {
    /// The end of a body, now.
    fn now(tracked: Box<Tracked>, ending: Ending, last: Option<Bytes>) -> Self {
        Self {
            tracked: Some(tracked),
            ending,
            ended: Instant::now(),
            last,
        }
    }

    /// Completes the record once the running task has yielded, so after the connection's task has
    /// written the response. On a single-threaded runtime (every HTTP worker's) it joins the
    /// thread's queue, which one long-lived task ([`Drain`]) empties; on tokio's multi-threaded
    /// runtime, where a task may move between threads, it gets a task of its own; without a
    /// runtime it is done at once.
    fn later(self) {
        if !DEFER.load(std::sync::atomic::Ordering::Relaxed) {
            return drop(self);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return drop(self);
        };
        if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
            // Run or dropped unpolled at runtime shutdown: either way `drop` completes it.
            return drop(runtime.spawn(async move { drop(self) }));
        }
        // While the thread's locals are being torn down the closure is dropped unrun, and with
        // it `self`, which completes the record.
        let queued = PENDING.try_with(move |p| {
            let mut p = p.borrow_mut();
            p.queue.push(self);
            if let Some(w) = &p.waker {
                w.wake_by_ref();
            }
            !std::mem::replace(&mut p.draining, true)
        });
        if queued == Ok(true) {
            // Queued first: a runtime that is shutting down drops the new task at once, and
            // its drop completes the queue.
            drop(runtime.spawn(Drain::default()));
        }
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.complete(false);
    }
}

impl Finish {
    /// Completes the record now, on this thread; in `spool` durability returns what to wait on
    /// before the answer may end.
    fn commit(mut self) -> Option<Arc<Commit>> {
        self.complete(true)
    }

    fn complete(&mut self, wait: bool) -> Option<Arc<Commit>> {
        let tracked = self.tracked.take()?;
        let Tracked {
            mut event,
            mut meter,
            sinks,
        } = *tracked;
        if let (Some(m), Some(last)) = (meter.as_mut(), &self.last) {
            m.feed(last);
        }
        // The captured content goes on the span only with the answer's last frame.
        event.captured = match (event.captured.take(), &self.last) {
            (Some(mut text), Some(last)) => {
                capture(&mut text, last);
                Some(text)
            }
            _ => None,
        };
        let (usage, text) = meter.map(Meter::finish_with_text).unwrap_or_default();
        event.answer_text = text;
        event.end(self.ending, self.ended, usage, sinks.sinks(), wait)
    }
}

pin_project! {
    /// An upstream body passed through untouched while its progress is observed.
    pub struct ObservedBody {
        #[pin]
        inner: UpstreamBody,
        // Until the body ends (or is dropped).
        tracked: Option<Box<Tracked>>,
        // In `spool` durability: the last frame (or the end), held until its record is on disk.
        held: Option<Held>,
    }

    impl PinnedDrop for ObservedBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(tracked) = this.tracked.take() {
                let ending = if this.inner.is_end_stream() { Ending::Complete } else { Ending::ClientGone };
                Finish::now(tracked, ending, None).later();
            }
        }
    }
}

/// The end of an answer, held until its record is durable ([`crate::journal`]).
struct Held {
    frame: Option<Frame<Bytes>>,
    commit: Arc<Commit>,
}

impl ObservedBody {
    /// `meter` reads usage from the frames; None when the answer cannot carry any we understand.
    /// `event` ends with the body, into `sinks`.
    pub fn new(
        inner: UpstreamBody,
        mut event: RequestEvent,
        meter: Option<Meter>,
        sinks: SinkHandles,
    ) -> Self {
        event.captured = event
            .trace
            .as_ref()
            .filter(|t| t.captures_content())
            .map(|_| Vec::new());
        Self {
            inner,
            tracked: Some(Box::new(Tracked {
                event,
                meter,
                sinks,
            })),
            held: None,
        }
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if let Some(held) = this.held.as_mut() {
            if held.commit.poll(cx).is_pending() {
                return Poll::Pending;
            }
            return Poll::Ready(this.held.take().and_then(|h| h.frame).map(Ok));
        }
        let polled = this.inner.as_mut().poll_frame(cx);
        let Some(Tracked {
            event: t, meter, ..
        }) = this.tracked.as_deref_mut()
        else {
            return polled;
        };
        let mut last = None;
        let ending = match &polled {
            Poll::Pending => return polled,
            Poll::Ready(Some(Ok(frame))) => {
                let end = this.inner.is_end_stream();
                if let Some(data) = frame.data_ref() {
                    if t.first_byte.is_none() && !data.is_empty() {
                        t.first_byte = Some(Instant::now());
                    }
                    t.bytes += data.len() as u64;
                    if let Some(text) = t.captured.as_mut()
                        && !end
                    {
                        capture(text, data);
                    }
                    if (meter.is_some() || t.captured.is_some()) && end {
                        // Metered once the response is written (a clone shares the bytes).
                        last = Some(data.clone());
                    } else if let Some(m) = meter.as_mut() {
                        m.feed(data);
                    }
                }
                end.then_some(Ending::Complete)
            }
            Poll::Ready(Some(Err(_))) => Some(Ending::UpstreamError),
            Poll::Ready(None) => Some(Ending::Complete),
        };
        if let Some(ending) = ending
            && let Some(tracked) = this.tracked.take()
        {
            let durable = tracked.sinks.records.is_durable();
            let finish = Finish::now(tracked, ending, last);
            if !(durable && ending == Ending::Complete) {
                finish.later();
                return polled;
            }
            // The client must not see the end before the record is on disk: hold the last frame
            // (or the end of the stream) until the journal says so.
            if let Some(commit) = finish.commit() {
                let frame = match polled {
                    Poll::Ready(Some(Ok(frame))) => Some(frame),
                    _ => None,
                };
                let held = this.held.insert(Held { frame, commit });
                if held.commit.poll(cx).is_pending() {
                    return Poll::Pending;
                }
                return Poll::Ready(this.held.take().and_then(|h| h.frame).map(Ok));
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Keeps the first [`crate::otel::MAX_CONTENT_BYTES`] of an answer.
fn capture(text: &mut Vec<u8>, data: &[u8]) {
    let room = (crate::otel::MAX_CONTENT_BYTES + 4).saturating_sub(text.len());
    text.extend_from_slice(&data[..data.len().min(room)]);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::metrics::Metrics;
    use crate::pricing::PriceTable;
    use crate::providers::{Registry, WireFormat, builtin};
    use crate::records::{self, RecordQueue, UsageStatus, record_queue};
    use crate::usage::Framing;

    const ANSWER: &[u8] = br#"{"id":"c1","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#;

    /// A finished non-streamed answer whose one frame the meter has not seen yet.
    fn finish(started: Instant) -> (Finish, RecordQueue) {
        let (sink, queue) = record_queue(8, Metrics::default());
        let mut record = records::started(
            "req-1".to_owned(),
            SystemTime::now(),
            Arc::from("key-1"),
            Arc::from("openai"),
            &http::Method::POST,
            "/v1/chat/completions".to_owned(),
        );
        record.model = Some("gpt-4o-mini".to_owned());
        record.status = 200;
        let registry =
            Registry::build(builtin().into_iter().map(|(n, s)| (n.to_owned(), s))).unwrap();
        let provider = registry.get("openai").unwrap().clone();
        let mut event = RequestEvent::new(
            record,
            provider,
            crate::routes::PROXY_TEMPLATE,
            started,
            crate::log::RequestLog::new("req-1", None, &http::Method::POST, None),
            None,
        );
        event.first_byte = Some(started + Duration::from_millis(5));
        event.bytes = ANSWER.len() as u64;
        let sinks = SinkHandles {
            records: sink,
            prices: Arc::new(PriceTable::builtin()),
            metrics: Metrics::default(),
            log: crate::log::AccessLog::off(),
            implicit: Arc::new(crate::implicit::Implicit::new(
                crate::implicit::Settings::default(),
                Metrics::default(),
            )),
        };
        let ended = started + Duration::from_millis(7);
        let finish = Finish {
            tracked: Some(Box::new(Tracked {
                event,
                meter: Some(Meter::new(WireFormat::Openai, Framing::Json)),
                sinks,
            })),
            ending: Ending::Complete,
            ended,
            last: Some(Bytes::from_static(ANSWER)),
        };
        (finish, queue)
    }

    #[test]
    fn completion_runs_after_the_current_task_yields_and_meters_the_last_frame() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let started = Instant::now();
        let (finish, mut queue) = finish(started);
        let record = runtime.block_on(async move {
            finish.later();
            assert!(
                queue.try_recv().is_err(),
                "completed before the response's task yielded"
            );
            tokio::task::yield_now().await;
            queue.try_recv().expect("completed once the task yielded")
        });
        assert_eq!(record.usage.input_tokens, Some(12));
        assert_eq!(record.usage.output_tokens, Some(3));
        assert_eq!(record.usage_status, UsageStatus::Reported);
        assert!(record.cost_micros.is_some());
        assert_eq!(record.response_bytes, ANSWER.len() as u64);
        // Times are those of the body's end, not of the deferred completion.
        assert_eq!(record.latency_ms, 7);
        assert_eq!(record.ttfb_ms, Some(5));
    }

    #[test]
    fn completion_whose_task_never_runs_is_done_when_the_runtime_drops_it() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (finish, mut queue) = finish(Instant::now());
        // The runtime returns from block_on without running the spawned task, then drops it.
        runtime.block_on(async move { finish.later() });
        assert!(queue.try_recv().is_err());
        drop(runtime);
        let record = queue
            .try_recv()
            .expect("completed when its task was dropped");
        assert_eq!(record.usage.input_tokens, Some(12));
    }

    #[tokio::test]
    async fn on_a_worker_completions_queue_until_the_running_task_yields() {
        let workers = crate::workers::Workers::start(1, true).unwrap();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        workers.spawn(async move {
            let started = Instant::now();
            let (first, mut queue) = finish(started);
            let (second, _) = finish(started);
            // The second's record goes to its own (dropped) queue; only its order matters.
            first.later();
            second.later();
            let queued = queue.try_recv().is_err();
            tokio::task::yield_now().await;
            let record = queue.try_recv();
            // Again, once the drain task exists and waits.
            let (third, mut queue3) = finish(started);
            third.later();
            let queued3 = queue3.try_recv().is_err();
            tokio::task::yield_now().await;
            let _ = done_tx.send((queued, record, queued3, queue3.try_recv()));
        });
        let (queued, record, queued3, record3) = done_rx.await.unwrap();
        assert!(queued, "completed before the task yielded");
        assert_eq!(record.unwrap().usage.input_tokens, Some(12));
        assert!(queued3);
        assert_eq!(record3.unwrap().usage.output_tokens, Some(3));
        workers.stop().await;
    }

    #[tokio::test]
    async fn records_queued_on_a_worker_survive_its_stop() {
        let workers = crate::workers::Workers::start(1, true).unwrap();
        let (finish, mut queue) = finish(Instant::now());
        let (queued_tx, queued_rx) = tokio::sync::oneshot::channel();
        workers.spawn(async move {
            finish.later();
            let _ = queued_tx.send(());
            std::future::pending::<()>().await;
        });
        queued_rx.await.unwrap();
        workers.stop().await;
        assert!(queue.try_recv().is_ok(), "the record was lost");
    }

    #[test]
    fn a_drain_task_dropped_unrun_completes_the_queue_and_stands_down() {
        let (finish, mut queue) = finish(Instant::now());
        PENDING.with_borrow_mut(|p| {
            p.queue.push(finish);
            p.draining = true;
        });
        // What a runtime shutting down does to the task.
        drop(Drain::default());
        assert!(queue.try_recv().is_ok(), "the queued record was lost");
        assert!(PENDING.with_borrow(|p| !p.draining && p.queue.is_empty()));
    }

    #[test]
    fn completion_outside_a_runtime_is_done_at_once() {
        let (finish, mut queue) = finish(Instant::now());
        finish.later();
        assert_eq!(queue.try_recv().unwrap().usage.output_tokens, Some(3));
    }
}
