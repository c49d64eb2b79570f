//! Log lines leave the process through a bounded queue and a writer thread of their own, so a
//! slow or stalled stderr (a full pipe, a log collector that stopped reading) only ever delays
//! that thread. A line that finds the queue full is dropped and counted
//! (`nm_log_lines_dropped_total`); a worker never waits to log.
//!
//! Every line of the process goes this way, the access log ([`super::access`]) and the `tracing`
//! lines alike (the root hands this writer to its subscriber), so they keep their order.

use std::io::{self, Write};
use std::sync::Arc;
#[cfg(test)]
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

/// Lines the queue holds before new ones are dropped: about 3 MiB of access lines, a few
/// seconds of a busy gateway's log.
pub const QUEUE_LINES: usize = 8192;

/// The writer thread's buffer: lines queued together leave in one write.
const WRITE_BUFFER: usize = 64 * 1024;

/// The process's log output. Cheap to clone.
#[derive(Clone)]
pub struct LogLines {
    queue: SyncSender<Msg>,
    dropped: Arc<AtomicU64>,
}

enum Msg {
    Line(Vec<u8>),
    Flush(mpsc::Sender<()>),
}

impl std::fmt::Debug for LogLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLines")
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

impl LogLines {
    /// Lines to the process's stderr.
    pub fn stderr() -> io::Result<Self> {
        Self::start(QUEUE_LINES, io::stderr())
    }

    /// Lines to `out`, through a queue of `capacity` lines and a thread of their own (which
    /// ends when the last handle is gone, after writing what was queued).
    pub fn start<W: Write + Send + 'static>(capacity: usize, out: W) -> io::Result<Self> {
        let (queue, lines) = mpsc::sync_channel(capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let lost = dropped.clone();
        std::thread::Builder::new()
            .name("nm-log".to_owned())
            .spawn(move || write_lines(&lines, out, &lost))?;
        Ok(Self { queue, dropped })
    }

    /// Queues one line (its bytes copied), or drops and counts it when the queue is full.
    pub fn write_line(&self, line: &[u8]) {
        self.send(line.to_vec());
    }

    /// Queues one line, or drops and counts it when the queue is full.
    pub fn send(&self, line: Vec<u8>) {
        if self.queue.try_send(Msg::Line(line)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Lines dropped so far: the queue was full, or the output failed.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Waits, at most `patience`, until every line queued before this call has been written;
    /// false when the output did not take them in time (a stalled stderr at exit).
    pub fn flush(&self, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        let (done, written) = mpsc::channel();
        let mut msg = Msg::Flush(done);
        loop {
            match self.queue.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return false,
            }
        }
        written
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }
}

/// The writer thread: gathers what is queued into one buffer and writes it at once, until
/// every handle is gone. Lines the output refused are counted in `lost`.
fn write_lines<W: Write>(queue: &Receiver<Msg>, mut out: W, lost: &AtomicU64) {
    let mut batch = Vec::with_capacity(WRITE_BUFFER);
    let mut in_batch = 0u64;
    let mut flushed = Vec::new();
    let mut write = |batch: &mut Vec<u8>, in_batch: &mut u64| {
        if out.write_all(batch).and_then(|()| out.flush()).is_err() {
            lost.fetch_add(*in_batch, Ordering::Relaxed);
        }
        batch.clear();
        *in_batch = 0;
    };
    while let Ok(first) = queue.recv() {
        let mut next = Some(first);
        while let Some(msg) = next {
            match msg {
                Msg::Line(line) => {
                    batch.extend_from_slice(&line);
                    in_batch += 1;
                    if batch.len() >= WRITE_BUFFER {
                        write(&mut batch, &mut in_batch);
                    }
                }
                Msg::Flush(done) => flushed.push(done),
            }
            next = queue.try_recv().ok();
        }
        if !batch.is_empty() {
            write(&mut batch, &mut in_batch);
        }
        for done in flushed.drain(..) {
            let _ = done.send(());
        }
    }
}

/// A `Write` over [`LogLines`]: each `write` is one line (the `tracing` formatter writes a
/// whole line at once).
#[derive(Debug, Clone)]
pub struct LineWriter<'a>(pub &'a LogLines);

impl Write for LineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write_line(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An output for tests: what was written.
#[cfg(test)]
#[derive(Debug, Clone, Default)]
pub(crate) struct Captured {
    pub bytes: Arc<Mutex<Vec<u8>>>,
}

#[cfg(test)]
impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::Receiver as Gate;

    use super::*;

    /// An output that, at its first write, says so and blocks until the gate opens (a stalled
    /// pipe), then takes everything.
    struct Stalled {
        entered: mpsc::Sender<()>,
        gate: Option<Gate<()>>,
        out: Captured,
    }

    impl Write for Stalled {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if let Some(gate) = self.gate.take() {
                let _ = self.entered.send(());
                let _ = gate.recv();
            }
            self.out.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_arrive_whole_and_in_order() {
        let out = Captured::default();
        let lines = LogLines::start(16, out.clone()).expect("the thread starts");
        for i in 0..100 {
            lines.write_line(format!("line {i}\n").as_bytes());
            if i % 10 == 9 {
                assert!(lines.flush(Duration::from_secs(10)));
            }
        }
        let text = String::from_utf8(out.bytes.lock().expect("lock").clone()).expect("utf-8");
        let expected: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, expected);
        assert_eq!(lines.dropped(), 0);
    }

    #[test]
    fn a_stalled_output_drops_and_counts_lines_without_blocking_the_writer() {
        let (open, gate) = mpsc::channel();
        let (entered, blocked) = mpsc::channel();
        let out = Captured::default();
        let stalled = Stalled {
            entered,
            gate: Some(gate),
            out: out.clone(),
        };
        let lines = LogLines::start(8, stalled).expect("the thread starts");
        lines.write_line(b"first\n");
        blocked
            .recv_timeout(Duration::from_secs(10))
            .expect("the writer took the first line and stalled");
        // 8 lines fill the queue; the rest are dropped at once (this loop would hang if a full
        // queue made the caller wait).
        for i in 0..1000 {
            lines.write_line(format!("{i}\n").as_bytes());
        }
        assert_eq!(lines.dropped(), 992);
        assert!(
            !lines.flush(Duration::from_millis(50)),
            "a stalled output cannot flush"
        );
        open.send(()).expect("the writer waits on the gate");
        assert!(lines.flush(Duration::from_secs(10)));
        let text = String::from_utf8(out.bytes.lock().expect("lock").clone()).expect("utf-8");
        assert_eq!(text, "first\n0\n1\n2\n3\n4\n5\n6\n7\n");
    }

    #[test]
    fn an_output_that_fails_counts_its_lines_as_dropped() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::Error::from(io::ErrorKind::BrokenPipe))
            }
            fn flush(&mut self) -> io::Result<()> {
                Err(io::Error::from(io::ErrorKind::BrokenPipe))
            }
        }
        let lines = LogLines::start(16, Broken).expect("the thread starts");
        for _ in 0..3 {
            lines.write_line(b"lost\n");
        }
        assert!(lines.flush(Duration::from_secs(10)));
        assert_eq!(lines.dropped(), 3);
    }
}
