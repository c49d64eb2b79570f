//! What a crash of the dataplane can lose of its request records, and how a restart learns it.
//!
//! Two modes (`NM_RECORD_DURABILITY`, [`Durability`]):
//!
//! - **`memory`** (default): a record waits in memory (the record queue, then the shipper's
//!   batch) until the controlplane acknowledges it or the shipper spools it. Nothing on the
//!   request path touches the disk. A `kill -9` loses the records completed in the last linger
//!   window (50 ms) plus the batch whose send was under way, and whatever queued behind a slow
//!   send. The [`Ledger`] tells the next start how many: a small file in the spool directory,
//!   rewritten (no fsync: a process crash keeps the page cache) every [`LEDGER_EVERY`] by a
//!   thread of its own with the records accepted and settled (acknowledged, refused for good,
//!   spooled, or counted as dropped). A start that finds it still marked running counts the
//!   difference in `nm_records_lost_in_crash_total` and logs it at WARN. The count is that of
//!   the ledger's last write: records completed in the last [`LEDGER_EVERY`] before the crash
//!   are missing from it, and a batch stored whose acknowledgement the crash cut off is in it.
//! - **`spool`**: a record is appended to the journal (a [`Spool`] in `journal/` under the
//!   spool directory, fsynced) before the client sees the end of its answer: the body holds
//!   its last frame (or its end) until the journal's thread reports the record durable
//!   ([`Commit`]). That thread commits whatever arrived while it was writing in one append and
//!   one fsync (group commit), then forwards the records to the record queue in journal order
//!   (waiting when the queue is full, so nothing is dropped). The shipper reports each batch it
//!   settled ([`Settler`]); the journal consumes that many records, in order, and advances its
//!   cursor at most every [`SKIP_EVERY`] while busy. At start, what the journal still holds is
//!   moved to the spool and replayed (`nm_records_journal_replayed_total`); a record
//!   replayed although it was stored is stored once (keyed by request id). An error the gateway
//!   makes itself is answered once its record is on disk (`proxy.rs`); the record of an answer
//!   cut short is journaled at once, with no end left to hold back.
//!
//! The journal runs on a thread of its own: no runtime thread ever waits on the disk in either
//! mode. It holds at most what the record queue holds plus the shipper's batch (it waits when
//! the queue is full), well under the spool's cap, which it shares.
//!
//! Measured (debug build, 2-core VM, its disk): `spool` added about 2.5 ms to an answer's end
//! at 200 req/s (one fsync) and took about 15% off closed-loop throughput.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{error, info, warn};

use nm_types::link::encode_batch;
use nm_types::record::RequestRecord;

use crate::metrics::Metrics;
use crate::spool::{Spool, SpoolError};

/// How often the ledger is rewritten while its counts change.
pub const LEDGER_EVERY: Duration = Duration::from_millis(20);
/// How often a busy journal advances its cursor past what was shipped.
pub const SKIP_EVERY: Duration = Duration::from_millis(200);
const LEDGER_FILE: &str = "records.ledger";
const JOURNAL_DIR: &str = "journal";
const LEDGER_MAGIC: [u8; 4] = *b"NML\x01";
const LEDGER_BYTES: usize = 28;

/// Where a request record waits before the controlplane has it (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// In memory; a crash loses the last moments' records, counted at the next start.
    #[default]
    Memory,
    /// On disk before the answer ends; a crash loses nothing.
    Spool,
}

impl Durability {
    /// The setting's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Memory => "memory",
            Durability::Spool => "spool",
        }
    }

    /// From the setting's spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "memory" => Some(Durability::Memory),
            "spool" => Some(Durability::Spool),
            _ => None,
        }
    }
}

/// Records accepted into the pipeline and records settled out of it, for the ledger.
#[derive(Debug, Default)]
pub struct Tally {
    accepted: AtomicU64,
    settled: AtomicU64,
}

impl Tally {
    pub(crate) fn accept(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self) -> (u64, u64) {
        // Settled first: read the other way, a settlement between the reads could show more
        // settled than accepted.
        let settled = self.settled.load(Ordering::Acquire);
        (self.accepted.load(Ordering::Acquire), settled)
    }
}

/// The shipper's handle: reports records it is done with.
#[derive(Debug, Clone)]
pub struct Settler {
    pub(crate) tally: Arc<Tally>,
    pub(crate) journal: Arc<std::sync::OnceLock<Journal>>,
}

impl Settler {
    /// `n` records, the oldest the shipper took from the queue, were acknowledged, refused for
    /// good, spooled, or dropped and counted.
    pub fn settled(&self, n: usize) {
        self.tally.settled.fetch_add(n as u64, Ordering::Release);
        if let Some(journal) = self.journal.get() {
            journal.consumed(n as u64);
        }
    }
}

// === ledger ===

/// The previous run's last word, read at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LedgerState {
    running: bool,
    durability: Durability,
    accepted: u64,
    settled: u64,
}

impl LedgerState {
    fn encode(self) -> [u8; LEDGER_BYTES] {
        let mut out = [0; LEDGER_BYTES];
        out[..4].copy_from_slice(&LEDGER_MAGIC);
        out[4] = u8::from(self.running);
        out[5] = match self.durability {
            Durability::Memory => 0,
            Durability::Spool => 1,
        };
        out[8..16].copy_from_slice(&self.accepted.to_le_bytes());
        out[16..24].copy_from_slice(&self.settled.to_le_bytes());
        let crc = crc32fast::hash(&out[..24]);
        out[24..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; LEDGER_BYTES] = bytes.try_into().ok()?;
        let u64_at = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let crc = u32::from_le_bytes([bytes[24], bytes[25], bytes[26], bytes[27]]);
        if bytes[..4] != LEDGER_MAGIC || crc32fast::hash(&bytes[..24]) != crc {
            return None;
        }
        Some(Self {
            running: bytes[4] == 1,
            durability: if bytes[5] == 1 {
                Durability::Spool
            } else {
                Durability::Memory
            },
            accepted: u64_at(8),
            settled: u64_at(16),
        })
    }
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SpoolError {
    move |source| SpoolError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The ledger file and the thread that keeps it current.
#[derive(Debug)]
pub struct Ledger {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    file: Arc<File>,
    path: PathBuf,
    tally: Arc<Tally>,
    durability: Durability,
}

impl Ledger {
    /// Reads what the previous run left, then marks this run as running (fsynced) and starts
    /// the thread that rewrites the counts.
    fn start(
        dir: &Path,
        durability: Durability,
        tally: Arc<Tally>,
    ) -> Result<(Self, Option<LedgerState>), SpoolError> {
        let path = dir.join(LEDGER_FILE);
        let previous = match fs::read(&path) {
            Ok(bytes) => LedgerState::decode(&bytes).or_else(|| {
                warn!(ledger = %path.display(), "record ledger unreadable; what a crash of the previous run lost cannot be counted");
                None
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err("read", &path)(e)),
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err("open", &path))?;
        let first = LedgerState {
            running: true,
            durability,
            accepted: 0,
            settled: 0,
        };
        file.set_len(LEDGER_BYTES as u64)
            .and_then(|()| write_ledger(&file, first))
            .and_then(|()| file.sync_data())
            .map_err(io_err("write", &path))?;
        let file = Arc::new(file);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (file, stop, tally, path) =
                (file.clone(), stop.clone(), tally.clone(), path.clone());
            std::thread::Builder::new()
                .name("nm-record-ledger".into())
                .spawn(move || {
                    let mut written = (0, 0);
                    let mut failed = false;
                    while !stop.load(Ordering::Acquire) {
                        std::thread::park_timeout(LEDGER_EVERY);
                        let (accepted, settled) = tally.get();
                        if (accepted, settled) == written {
                            continue;
                        }
                        let state = LedgerState {
                            running: true,
                            durability,
                            accepted,
                            settled,
                        };
                        match write_ledger(&file, state) {
                            Ok(()) => (written, failed) = ((accepted, settled), false),
                            Err(e) if !failed => {
                                failed = true;
                                warn!(ledger = %path.display(), error = %e, "cannot update the record ledger");
                            }
                            Err(_) => {}
                        }
                    }
                })
                .map_err(io_err("start a thread for", dir))?
        };
        Ok((
            Self {
                stop,
                thread: Some(thread),
                file,
                path,
                tally,
                durability,
            },
            previous,
        ))
    }

    /// Stops the thread and marks the run as ended cleanly (fsynced). Blocking.
    fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
        let (accepted, settled) = self.tally.get();
        let state = LedgerState {
            running: false,
            durability: self.durability,
            accepted,
            settled,
        };
        if let Err(e) = write_ledger(&self.file, state).and_then(|()| self.file.sync_data()) {
            warn!(ledger = %self.path.display(), error = %e, "cannot mark the record ledger as ended");
        }
    }
}

fn write_ledger(file: &File, state: LedgerState) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(&state.encode(), 0)
}

// === journal ===

/// Resolves when a record handed to the journal is on disk (or the journal could not take it,
/// logged and counted: the answer is not held for ever).
#[derive(Debug, Default)]
pub struct Commit {
    done: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Commit {
    pub fn poll(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.done.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        *lock(&self.waker) = Some(cx.waker().clone());
        if self.done.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn complete(&self) {
        self.done.store(true, Ordering::Release);
        if let Some(w) = lock(&self.waker).take() {
            w.wake();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The producing side of the journal (cheap to clone): hands records to its thread.
#[derive(Debug, Clone)]
pub struct Journal {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    intake: Mutex<Intake>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct Intake {
    records: Vec<(RequestRecord, Option<Arc<Commit>>)>,
    /// Records the shipper settled since the thread last looked.
    consumed: u64,
    stop: bool,
}

impl Journal {
    /// Queues `record` for the next group commit; the returned [`Commit`] resolves once it is
    /// durable. Never waits on the disk.
    pub(crate) fn submit(&self, record: RequestRecord, wait: bool) -> Option<Arc<Commit>> {
        let commit = wait.then(Arc::<Commit>::default);
        lock(&self.shared.intake)
            .records
            .push((record, commit.clone()));
        self.shared.wake.notify_one();
        commit
    }

    fn consumed(&self, n: u64) {
        lock(&self.shared.intake).consumed += n;
        self.shared.wake.notify_one();
    }
}

/// The journal's thread: group commits, forwarding to the record queue, consumption.
struct Writer {
    shared: Arc<Shared>,
    spool: Spool,
    queue: mpsc::Sender<RequestRecord>,
    metrics: Metrics,
    /// The journal's batches this run, oldest first, as forwarded: records, and whether the
    /// batch is in the journal (an append that failed forwarded its records all the same).
    runs: VecDeque<(u64, bool)>,
    /// Records of the front run the shipper has settled.
    front_settled: u64,
    /// Journal batches wholly settled, not yet skipped.
    to_skip: u64,
    skip_due: Instant,
    forwarding: bool,
    warned_at: Option<Instant>,
}

impl Writer {
    fn run(mut self) {
        loop {
            let (records, consumed, stop) = {
                let mut intake = lock(&self.shared.intake);
                loop {
                    if !intake.records.is_empty() || intake.consumed > 0 || intake.stop {
                        break;
                    }
                    if self.to_skip > 0 {
                        let now = Instant::now();
                        if now >= self.skip_due {
                            break;
                        }
                        intake = self
                            .shared
                            .wake
                            .wait_timeout(intake, self.skip_due - now)
                            .map_or_else(|p| p.into_inner().0, |(g, _)| g);
                    } else {
                        intake = self
                            .shared
                            .wake
                            .wait(intake)
                            .unwrap_or_else(|p| p.into_inner());
                    }
                }
                (
                    std::mem::take(&mut intake.records),
                    std::mem::take(&mut intake.consumed),
                    intake.stop,
                )
            };
            self.settle(consumed);
            let idle = records.is_empty();
            if !idle {
                self.commit(records);
            }
            if self.to_skip > 0 && (idle || stop || Instant::now() >= self.skip_due) {
                self.skip();
            }
            if stop && idle {
                if self.to_skip > 0 {
                    self.skip();
                }
                return;
            }
        }
    }

    fn settle(&mut self, consumed: u64) {
        self.front_settled += consumed;
        while let Some(&(n, journaled)) = self.runs.front() {
            if self.front_settled < n {
                break;
            }
            self.front_settled -= n;
            self.runs.pop_front();
            if journaled {
                self.to_skip += 1;
            }
        }
    }

    fn commit(&mut self, batch: Vec<(RequestRecord, Option<Arc<Commit>>)>) {
        let (records, commits): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let n = records.len();
        let bytes = encode_batch(&records);
        let journaled = match self
            .spool
            .append(&bytes, u32::try_from(n).unwrap_or(u32::MAX))
        {
            Ok(()) => true,
            Err(e) => {
                // The records go on in memory, as in the default mode; the answers are not held.
                if self
                    .warned_at
                    .is_none_or(|at| at.elapsed() >= Duration::from_secs(30))
                {
                    self.warned_at = Some(Instant::now());
                    error!(error = %e, records = n, "cannot journal request records; they wait in memory only");
                }
                false
            }
        };
        for commit in commits.into_iter().flatten() {
            commit.complete();
        }
        if !self.forwarding {
            return;
        }
        self.runs.push_back((n as u64, journaled));
        for record in records {
            if self.queue.blocking_send(record).is_err() {
                // The shipper has stopped (shutdown): what is journaled is replayed next start.
                self.forwarding = false;
                if !journaled {
                    self.metrics.records_dropped("queue_full", n as u64);
                }
                break;
            }
        }
    }

    fn skip(&mut self) {
        match self.spool.skip(self.to_skip) {
            Ok(()) => self.to_skip = 0,
            Err(e) => {
                warn!(error = %e, "cannot advance the record journal; retrying");
            }
        }
        self.skip_due = Instant::now() + SKIP_EVERY;
    }
}

/// A running journal: its thread, stopped by [`Durable::stop`].
#[derive(Debug)]
struct JournalThread {
    journal: Journal,
    thread: JoinHandle<()>,
}

/// The crash accounting of a running dataplane: the ledger, and in `spool` mode the journal.
#[derive(Debug)]
pub struct Durable {
    ledger: Ledger,
    journal: Option<JournalThread>,
}

impl Durable {
    /// Ends the journal (after the shipper has stopped: it applies the last settlements) and
    /// marks the run as ended cleanly. Blocking.
    pub fn stop(self) {
        if let Some(j) = self.journal {
            lock(&j.journal.shared.intake).stop = true;
            j.journal.shared.wake.notify_one();
            let _ = j.thread.join();
        }
        self.ledger.stop();
    }
}

/// At start, before the shipper runs: learns what the previous run lost or left journaled (a
/// crash), moves what the journal holds into `spool` (replayed from there), starts the ledger
/// over the pipeline's `tally`, and in `spool` mode the journal, which forwards to `queue`.
/// Returns the journal for the record sink to submit to (`RecordSink::start_durability`, the
/// one caller). Blocking.
pub(crate) fn start(
    dir: &Path,
    cap_bytes: u64,
    durability: Durability,
    metrics: &Metrics,
    tally: Arc<Tally>,
    queue: mpsc::Sender<RequestRecord>,
    spool: &mut Spool,
) -> Result<(Durable, Option<Journal>), SpoolError> {
    let metrics = metrics.clone();
    let journal_dir = dir.join(JOURNAL_DIR);
    let mut journal = if durability == Durability::Spool || journal_dir.exists() {
        Some(Spool::open(&journal_dir, cap_bytes)?)
    } else {
        None
    };
    let replayed = match &mut journal {
        Some(j) => move_over(j, spool)?,
        None => 0,
    };
    let (ledger, previous) = Ledger::start(dir, durability, tally)?;
    if replayed > 0 {
        metrics.records_journal_replayed(replayed);
        warn!(
            records = replayed,
            crashed = previous.is_some_and(|p| p.running),
            "request records the previous run journaled and had not shipped are replayed"
        );
    }
    if let Some(prev) = previous.filter(|p| p.running && p.durability == Durability::Memory) {
        let lost = prev.accepted.saturating_sub(prev.settled);
        metrics.records_lost_in_crash(lost);
        warn!(
            records = lost,
            last_moments = ?LEDGER_EVERY,
            "the previous run ended without a shutdown (a crash?); request records it had accepted and neither delivered nor spooled were lost (records of its last moments are not in this count); NM_RECORD_DURABILITY=spool loses none"
        );
    }
    let journal = match (durability, journal) {
        (Durability::Spool, Some(spool)) => {
            let shared = Arc::new(Shared::default());
            let writer = Writer {
                shared: shared.clone(),
                spool,
                queue,
                metrics,
                runs: VecDeque::new(),
                front_settled: 0,
                to_skip: 0,
                skip_due: Instant::now(),
                forwarding: true,
                warned_at: None,
            };
            let thread = std::thread::Builder::new()
                .name("nm-record-journal".into())
                .spawn(move || writer.run())
                .map_err(io_err("start a thread for", &journal_dir))?;
            let journal = Journal { shared };
            info!(dir = %journal_dir.display(), "request records are journaled before each answer ends (NM_RECORD_DURABILITY=spool)");
            Some(JournalThread { journal, thread })
        }
        _ => None,
    };
    let handle = journal.as_ref().map(|j| j.journal.clone());
    Ok((Durable { ledger, journal }, handle))
}

/// Moves every batch of `journal` to the end of `spool`; returns the records moved. A crash
/// between the two leaves a batch in both: replayed twice, stored once.
fn move_over(journal: &mut Spool, spool: &mut Spool) -> Result<u64, SpoolError> {
    let mut records = 0;
    while let Some(batch) = journal.peek()? {
        spool.append(&batch.bytes, batch.records)?;
        journal.skip(1)?;
        records += u64::from(batch.records);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            ..RequestRecord::default()
        }
    }

    fn drain_ids(spool: &mut Spool) -> Vec<String> {
        let mut ids = Vec::new();
        while let Some(b) = spool.peek().unwrap() {
            let batch = nm_types::link::decode_batch(&b.bytes).unwrap();
            ids.extend(batch.into_iter().map(|r| r.unwrap().request_id));
            spool.pop().unwrap();
        }
        ids
    }

    /// What the record sink holds of the pipeline: its counts, its queue, its journal.
    struct Pipeline {
        metrics: Metrics,
        tally: Arc<Tally>,
        queue: mpsc::Receiver<RequestRecord>,
        durable: Durable,
        journal: Option<Journal>,
    }

    impl Pipeline {
        fn start(dir: &Path, durability: Durability, spool: &mut Spool) -> Self {
            let metrics = Metrics::default();
            let tally = Arc::new(Tally::default());
            let (tx, queue) = mpsc::channel(8);
            let (durable, journal) =
                start(dir, CAP, durability, &metrics, tally.clone(), tx, spool).unwrap();
            Self {
                metrics,
                tally,
                queue,
                durable,
                journal,
            }
        }

        /// As the record sink hands a record over (`commit`: waiting for the disk).
        fn submit(&self, record: RequestRecord, commit: bool) -> Option<Arc<Commit>> {
            self.tally.accept();
            self.journal.as_ref()?.submit(record, commit)
        }

        fn settler(&self) -> Settler {
            let journal = Arc::new(std::sync::OnceLock::new());
            if let Some(j) = &self.journal {
                let _ = journal.set(j.clone());
            }
            Settler {
                tally: self.tally.clone(),
                journal,
            }
        }
    }

    const CAP: u64 = 1 << 20;

    #[test]
    fn ledger_state_round_trips_and_refuses_corruption() {
        let state = LedgerState {
            running: true,
            durability: Durability::Spool,
            accepted: 12,
            settled: 7,
        };
        let mut bytes = state.encode();
        assert_eq!(LedgerState::decode(&bytes), Some(state));
        bytes[9] ^= 1;
        assert_eq!(LedgerState::decode(&bytes), None);
    }

    #[test]
    fn a_run_that_did_not_end_is_counted_as_a_crash_with_what_it_had_not_settled() {
        let dir = tempfile::tempdir().unwrap();
        let crashed = LedgerState {
            running: true,
            durability: Durability::Memory,
            accepted: 10,
            settled: 3,
        };
        fs::write(dir.path().join(LEDGER_FILE), crashed.encode()).unwrap();
        let mut spool = Spool::open(dir.path(), CAP).unwrap();
        let p = Pipeline::start(dir.path(), Durability::Memory, &mut spool);
        assert!(
            p.metrics
                .render()
                .contains("nm_records_lost_in_crash_total 7")
        );
        assert!(p.journal.is_none());
        p.tally.accept();
        p.settler().settled(1);
        p.durable.stop();
        // A clean end: the next start counts nothing.
        let p = Pipeline::start(dir.path(), Durability::Memory, &mut spool);
        assert!(
            p.metrics
                .render()
                .contains("nm_records_lost_in_crash_total 0")
        );
        p.durable.stop();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn journaled_records_are_durable_before_their_commit_resolves_and_replayed_until_settled()
    {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), CAP).unwrap();
        let mut p = Pipeline::start(dir.path(), Durability::Spool, &mut spool);
        assert!(p.journal.is_some());
        for id in ["r1", "r2", "r3"] {
            let commit = p.submit(record(id), true).expect("a commit to wait on");
            std::future::poll_fn(|cx| commit.poll(cx)).await;
            // Durable now: the journal's files hold it.
            let on_disk: Vec<u8> = fs::read_dir(dir.path().join(JOURNAL_DIR))
                .unwrap()
                .flat_map(|e| fs::read(e.unwrap().path()).unwrap())
                .collect();
            assert!(on_disk.windows(2).any(|w| w == id.as_bytes()), "{id}");
        }
        p.submit(record("r4"), false);
        let mut got = Vec::new();
        while got.len() < 4 {
            got.push(p.queue.recv().await.unwrap().request_id);
        }
        assert_eq!(got, ["r1", "r2", "r3", "r4"]);
        // The shipper settles the first two only, then the process ends.
        p.settler().settled(2);
        let Pipeline { durable, queue, .. } = p;
        tokio::task::spawn_blocking(move || durable.stop())
            .await
            .unwrap();
        drop(queue);

        let mut spool = Spool::open(dir.path(), CAP).unwrap();
        let p = Pipeline::start(dir.path(), Durability::Memory, &mut spool);
        // The unsettled records moved to the spool (a journal batch is replayed whole).
        let replayed = drain_ids(&mut spool);
        assert!(
            replayed.ends_with(&["r3".to_owned(), "r4".to_owned()]),
            "{replayed:?}"
        );
        assert!(!replayed.contains(&"r1".to_owned()), "{replayed:?}");
        assert!(
            p.metrics
                .render()
                .contains("nm_records_journal_replayed_total 2")
        );
        p.durable.stop();
    }
}
