//! Bodies that must keep moving: a client's request body and an upstream's answer are given up
//! when they stall, so a peer that stops sending cannot hold a connection (and a file
//! descriptor, and a worker's memory) for ever.
//!
//! [`Pace`] watches one body and answers, each time the body has nothing to give, whether it has
//! waited too long:
//! - **idle**: no frame for `idle` while the body was being read. The clock runs only while the
//!   reader waits on the peer (from the first `Pending` after a frame), never while the reader
//!   itself is busy or held back: a client reading an answer slowly does not make the upstream
//!   look stalled.
//! - **minimum rate** (request bodies): the body as a whole may take `idle` plus one second per
//!   `min_rate` bytes received. A client trickling a byte every few seconds never trips the idle
//!   rule; it trips this one.
//!
//! A stalled request body ends with [`BodyTimeout`] (the handler answers 408 `request_timeout`
//! and closes the connection); a stalled upstream body ends with it too, which the record notes
//! as an upstream body error and hyper turns into an aborted response (HTTP/1.1: the connection
//! closes before the last chunk; HTTP/2: the stream is reset), so the client sees the answer
//! did not complete.
//!
//! Cost: nothing while a body's frames are ready when asked. A wait (`Pending`: an upstream's
//! answer usually has one before each of its frames) reads the clock and polls the timer, which
//! is armed at the first wait and moved only when it fires before the deadline (about once an
//! idle time); the reason of a timeout is written only for a body given up.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

/// The error of the bodies the gateway passes through (any body's error, boxed).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body gave nothing for too long (or came in slower than the minimum rate).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} stalled: {why}")]
pub struct BodyTimeout {
    pub what: &'static str,
    pub why: String,
}

/// How long a body may wait on its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaceLimits {
    /// Longest wait for the next frame.
    pub idle: Duration,
    /// Bytes per second the body must average after `idle`; 0: no minimum.
    pub min_rate: u64,
}

/// The state of one body's pace.
#[derive(Debug)]
pub struct Pace {
    limits: PaceLimits,
    what: &'static str,
    started: Option<Instant>,
    received: u64,
    /// Armed at the first `Pending`, reset as the deadline moves.
    timer: Option<Pin<Box<Sleep>>>,
    /// When the current wait for a frame times out.
    idle_deadline: Option<Instant>,
    waiting: bool,
}

impl Pace {
    pub fn new(limits: PaceLimits, what: &'static str) -> Self {
        Self {
            limits,
            what,
            started: None,
            received: 0,
            timer: None,
            idle_deadline: None,
            waiting: false,
        }
    }

    /// Notes a frame of `bytes` bytes: the idle clock stops.
    pub fn progress(&mut self, bytes: usize) {
        self.received = self.received.saturating_add(bytes as u64);
        self.waiting = false;
    }

    /// The body has nothing now: `Ready(Err)` once it has waited too long, else `Pending` (with
    /// the timer set to wake `cx` at the deadline, or before it).
    pub fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<BodyTimeout> {
        let now = Instant::now();
        let started = *self.started.get_or_insert(now);
        // The idle clock starts at the first wait after progress and keeps its deadline while
        // the waits go on.
        let idle_deadline = match self.idle_deadline {
            Some(at) if self.waiting => at,
            _ => now + self.limits.idle,
        };
        self.idle_deadline = Some(idle_deadline);
        let mut deadline = idle_deadline;
        let mut by_rate = false;
        if let Some(credit_ms) = self
            .received
            .saturating_mul(1000)
            .checked_div(self.limits.min_rate)
        {
            let at = started + self.limits.idle + Duration::from_millis(credit_ms);
            if at <= deadline {
                deadline = at;
                by_rate = true;
            }
        }
        self.waiting = true;
        // Neither deadline ever moves earlier (a wait's starts later than the last one's; the
        // rate's grows with the bytes received), so a timer armed for an earlier one is left to
        // fire and moved only then: resetting it at every wait (every frame of a streamed
        // answer) cost more than the rest of the body's pace.
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        // Should a change ever make a deadline move earlier, the timer follows it at once.
        if timer.deadline() > deadline {
            timer.as_mut().reset(deadline);
        }
        loop {
            match timer.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) if timer.deadline() < deadline => timer.as_mut().reset(deadline),
                Poll::Ready(()) => break,
            }
        }
        // Only a body given up has its reason written.
        let why = if by_rate {
            format!(
                "slower than {} bytes/s ({} bytes in {}s)",
                self.limits.min_rate,
                self.received,
                now.duration_since(started).as_secs()
            )
        } else {
            format!("no data for {}s", self.limits.idle.as_secs())
        };
        Poll::Ready(BodyTimeout {
            what: self.what,
            why,
        })
    }
}

pin_project! {
    /// A body given up when it stalls (see [`Pace`]).
    #[derive(Debug)]
    pub struct Paced<B> {
        #[pin]
        inner: B,
        pace: Pace,
        timed_out: bool,
    }
}

impl<B> Paced<B> {
    pub fn new(inner: B, limits: PaceLimits, what: &'static str) -> Self {
        Self {
            inner,
            pace: Pace::new(limits, what),
            timed_out: false,
        }
    }
}

impl<B> Body for Paced<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if *this.timed_out {
            return Poll::Ready(None);
        }
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.pace.progress(frame.data_ref().map_or(0, Bytes::len));
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.pace.poll_stalled(cx) {
                Poll::Ready(timeout) => {
                    *this.timed_out = true;
                    Poll::Ready(Some(Err(Box::new(timeout))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::sync::mpsc;

    /// A body fed frame by frame from a channel.
    struct ChannelBody(mpsc::Receiver<Bytes>);

    impl Body for ChannelBody {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        }
    }

    fn paced(idle_ms: u64, min_rate: u64) -> (mpsc::Sender<Bytes>, Paced<ChannelBody>) {
        let (tx, rx) = mpsc::channel(4);
        let limits = PaceLimits {
            idle: Duration::from_millis(idle_ms),
            min_rate,
        };
        (tx, Paced::new(ChannelBody(rx), limits, "test body"))
    }

    #[tokio::test]
    async fn a_silent_body_times_out() {
        let (tx, mut body) = paced(100, 0);
        tx.send(Bytes::from_static(b"abc")).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let err = body.frame().await.unwrap().unwrap_err();
        let err = err.downcast::<BodyTimeout>().unwrap();
        assert!(err.why.contains("no data"), "{}", err.why);
        // After the error the body is over.
        assert!(body.frame().await.is_none());
        assert!(body.is_end_stream());
    }

    #[tokio::test]
    async fn frames_within_the_idle_time_keep_it_going() {
        let (tx, body) = paced(2000, 0);
        let sender = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                tx.send(Bytes::from_static(b"x")).await.unwrap();
            }
        });
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all.len(), 10);
        sender.await.unwrap();
    }

    #[tokio::test]
    async fn a_body_that_keeps_moving_outlives_its_first_deadline() {
        // Each gap (30 ms) is well within the idle time (100 ms), the whole body (400 ms) is
        // not: the timer armed at the first wait fires early and is moved, never a timeout.
        let (tx, body) = paced(100, 0);
        let sender = tokio::spawn(async move {
            for _ in 0..13 {
                tokio::time::sleep(Duration::from_millis(30)).await;
                tx.send(Bytes::from_static(b"x")).await.unwrap();
            }
        });
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all.len(), 13);
        sender.await.unwrap();
    }

    #[tokio::test]
    async fn a_trickle_trips_the_minimum_rate() {
        // A byte every 50 ms never trips the 2 s idle time, but averages 20 bytes/s against a
        // minimum of 1,000: the body may take 2 s + received/1000 s, far less than the 10 s
        // the trickle would last.
        let (tx, body) = paced(2000, 1000);
        let sender = tokio::spawn(async move {
            for _ in 0..200 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if tx.send(Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
            }
        });
        let err = body.collect().await.unwrap_err();
        let err = err.downcast::<BodyTimeout>().unwrap();
        assert!(err.why.contains("slower than 1000 bytes/s"), "{}", err.why);
        sender.abort();
    }

    #[tokio::test]
    async fn time_the_reader_spends_elsewhere_does_not_count() {
        let (tx, mut body) = paced(200, 0);
        tx.send(Bytes::from_static(b"a")).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // The reader is busy (backpressure) for longer than the idle time...
        tokio::time::sleep(Duration::from_millis(600)).await;
        // ...and the next frame is already there when it asks again.
        tx.send(Bytes::from_static(b"b")).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        drop(tx);
        assert!(body.frame().await.is_none());
    }
}
