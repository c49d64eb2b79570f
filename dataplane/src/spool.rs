//! A size-capped on-disk spool of record batches.
//!
//! The shipper sends request/usage records to the controlplane in batches. While the
//! controlplane is unreachable it appends the batches here, and replays them oldest first once
//! it is back: `peek`, send, `pop`. The API is synchronous `std::fs`; callers run it on a
//! blocking thread.
//!
//! # On-disk format
//!
//! One directory holds:
//!
//! - Segments `NNNNNNNNNNNNNNNNNNNN.seg`: 20-digit sequence numbers, increasing, never reused.
//!   A segment is a run of frames, little-endian:
//!
//!   ```text
//!   offset  size  field
//!        0     1  magic 0xA5
//!        1     1  frame version, 1
//!        2     4  payload length (u32)
//!        6     4  record count (u32)
//!       10     4  CRC-32 (IEEE) of bytes 1..10 and the payload
//!       14   len  payload: the batch, opaque
//!   ```
//!
//!   A new segment is started when the next frame would take the current one past
//!   `min(8 MiB, cap / 4)`; a frame bigger than that gets a segment of its own.
//! - `cursor`, 32 bytes: `NMC` and version 1, then the segment number and the offset of the
//!   oldest unconsumed frame (u64 each), the persisted dropped-record total (u64) and a CRC-32 of
//!   the 28 bytes before it. It is replaced atomically: written to `cursor.tmp`, fsynced,
//!   renamed over `cursor`, directory fsynced.
//!
//! Reading starts in the cursor's segment at its offset; segments numbered below the cursor's
//! are consumed leftovers and are deleted at open; if the cursor's segment is gone, reading
//! starts at offset 0 of the next one. So the cursor is always written before segments are
//! unlinked, and an unlink that a crash undoes is harmless.
//!
//! # Guarantees
//!
//! - Durability: [`Spool::append`] returns once the frame (and, for a new segment, the directory
//!   entry) is fsynced. [`Spool::pop`] returns once the new cursor is durable.
//! - Order: batches are peeked in append order, across restarts.
//! - Replay after a restart: every appended batch whose pop has not returned `Ok` is replayed. A
//!   batch whose pop returned `Ok` is never replayed; one delivered but not yet popped when the
//!   process died is replayed once more. Delivery is at-least-once, which the controlplane
//!   absorbs (records are keyed by request id).
//! - Drop-oldest: after `open` and after every `append`, the segments take at most `cap_bytes`
//!   on disk (consumed frames count until their segment is deleted). To make room, whole oldest
//!   segments are deleted and their unconsumed records counted in [`Spool::dropped_records`] and
//!   logged, never silently. A batch that alone exceeds the cap is rejected.
//! - Recovery: `open` verifies every frame. A crash mid-append leaves a torn frame at the end
//!   of the newest segment (that append never returned); it and anything after the first bad
//!   frame of any segment is truncated, logged with its size and counted in
//!   [`Spool::corrupt_bytes`]. A bad frame met later while reading (the file changed under us)
//!   skips the rest of its segment, counting its records as dropped. Nothing here panics or
//!   gets stuck on a corrupt file.
//! - When everything is consumed no segment is left on disk, only the cursor.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use tracing::{debug, warn};

const FRAME_MAGIC: u8 = 0xA5;
const FRAME_VERSION: u8 = 1;
/// Magic, version, length, record count, CRC.
pub const FRAME_HEADER_BYTES: u64 = 14;
const MAX_SEGMENT_BYTES: u64 = 8 * 1024 * 1024;
const SEGMENT_SUFFIX: &str = ".seg";
const SEGMENT_DIGITS: usize = 20;

const CURSOR_FILE: &str = "cursor";
const CURSOR_TMP: &str = "cursor.tmp";
const CURSOR_MAGIC: [u8; 4] = *b"NMC\x01";
const CURSOR_BYTES: usize = 32;

/// What can go wrong with the spool.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("spool: cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "spool: a batch of {size} bytes (with its frame header) exceeds the cap of {cap} bytes"
    )]
    BatchTooLarge { size: u64, cap: u64 },
    #[error("spool: pop without a peeked batch; call peek first")]
    NotPeeked,
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SpoolError {
    move |source| SpoolError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// One spooled batch, as appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpooledBatch {
    pub bytes: Vec<u8>,
    pub records: u32,
}

/// A size-capped, crash-safe FIFO of batches in a directory. See the module docs.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    cap: u64,
    /// A segment is rolled when the next frame would take it past this.
    segment_target: u64,
    /// Oldest first. The front is the read head; only it may be partially consumed, and a
    /// segment is deleted as soon as it is fully consumed, so none here is.
    segments: VecDeque<Segment>,
    /// Read offset into the front segment.
    offset: u64,
    /// Number of the next segment to create; above every number ever seen.
    next_seq: u64,
    /// Open for appending to the back segment; `None` makes the next append start a segment.
    writer: Option<File>,
    reader: Option<(u64, File)>,
    peeked: Option<Position>,
    dropped_records: u64,
    dropped_total: u64,
    corrupt_bytes: u64,
}

#[derive(Debug)]
struct Segment {
    seq: u64,
    /// Bytes of valid frames; the file is never read past this.
    len: u64,
    /// Unconsumed batches and records.
    batches: u64,
    records: u64,
}

/// Where the last peeked batch lies.
#[derive(Debug, Clone, Copy)]
struct Position {
    seq: u64,
    offset: u64,
    frame_len: u64,
    records: u32,
}

// === impl Spool ===

impl Spool {
    /// Opens the spool in `dir` (creating it), recovering from a crash: verifies every frame,
    /// truncates torn or corrupt tails (logged), deletes consumed segments and restores the read
    /// position. If the spool is over `cap_bytes` (a lowered cap), the oldest segments are
    /// dropped and counted.
    pub fn open(dir: &Path, cap_bytes: u64) -> Result<Self, SpoolError> {
        fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        remove_if_exists(&dir.join(CURSOR_TMP))?;
        let cursor = read_cursor(dir)?;
        let seqs = list_segments(dir)?;

        let mut spool = Spool {
            dir: dir.to_path_buf(),
            cap: cap_bytes,
            segment_target: (cap_bytes / 4).min(MAX_SEGMENT_BYTES),
            segments: VecDeque::new(),
            offset: 0,
            next_seq: seqs
                .last()
                .map_or(cursor.seq, |&last| last.max(cursor.seq))
                .saturating_add(1),
            writer: None,
            reader: None,
            peeked: None,
            dropped_records: 0,
            dropped_total: cursor.dropped_total,
            corrupt_bytes: 0,
        };

        for seq in seqs {
            let path = segment_path(dir, seq);
            if seq < cursor.seq {
                remove_if_exists(&path)?;
                continue;
            }
            let scan = scan_segment(&path)?;
            if let Some(reason) = scan.bad {
                let cut = scan.file_len - scan.valid_len;
                warn!(
                    segment = %path.display(),
                    offset = scan.valid_len,
                    bytes = cut,
                    reason,
                    "spool: truncating a torn or corrupt segment tail"
                );
                truncate(&path, scan.valid_len)?;
                spool.corrupt_bytes += cut;
            }
            let start = if seq == cursor.seq {
                resume_offset(&scan, cursor.offset, &path)
            } else {
                0
            };
            if start >= scan.valid_len {
                // Fully consumed, or empty (a crash right after creating it).
                remove_if_exists(&path)?;
                continue;
            }
            let (batches, records) = scan
                .frames
                .iter()
                .filter(|(at, _)| *at >= start)
                .fold((0, 0), |(b, r), (_, n)| (b + 1, r + u64::from(*n)));
            if spool.segments.is_empty() {
                spool.offset = start;
            }
            spool.segments.push_back(Segment {
                seq,
                len: scan.valid_len,
                batches,
                records,
            });
        }

        if let Some(back) = spool.segments.back() {
            let path = segment_path(dir, back.seq);
            let file = OpenOptions::new()
                .append(true)
                .open(&path)
                .map_err(io_err("open", &path))?;
            spool.writer = Some(file);
        }
        let (seq, offset) = spool.read_position();
        spool.store_cursor(seq, offset, spool.dropped_total)?;
        spool.make_room(0)?;
        debug!(
            dir = %dir.display(),
            batches = spool.pending_batches(),
            records = spool.pending_records(),
            bytes = spool.bytes(),
            "spool: opened"
        );
        Ok(spool)
    }

    /// Appends one batch holding `records` records; it is durable when this returns. Drops the
    /// oldest whole segments first if the spool would exceed its cap; rejects a batch that alone
    /// exceeds it ([`SpoolError::BatchTooLarge`], nothing dropped).
    pub fn append(&mut self, batch: &[u8], records: u32) -> Result<(), SpoolError> {
        let size = FRAME_HEADER_BYTES + batch.len() as u64;
        let len = u32::try_from(batch.len())
            .ok()
            .filter(|_| size <= self.cap)
            .ok_or(SpoolError::BatchTooLarge {
                size,
                cap: self.cap,
            })?;
        self.make_room(size)?;
        let roll = match (self.segments.back(), &self.writer) {
            (Some(back), Some(_)) => back.len > 0 && back.len + size > self.segment_target,
            _ => true,
        };
        if roll {
            self.roll()?;
        }

        let frame = encode_frame(batch, len, records);
        let (Some(back), Some(writer)) = (self.segments.back_mut(), self.writer.as_mut()) else {
            // roll() leaves both set; never report an unwritten batch as stored.
            return Err(io_err("append to", &self.dir)(io::Error::other(
                "no segment open for appending",
            )));
        };
        match writer.write_all(&frame).and_then(|()| writer.sync_data()) {
            Ok(()) => {
                back.len += size;
                back.batches += 1;
                back.records += u64::from(records);
                Ok(())
            }
            Err(e) => {
                let path = segment_path(&self.dir, back.seq);
                self.abandon_writer();
                Err(io_err("append to", &path)(e))
            }
        }
    }

    /// The oldest unconsumed batch, without consuming it. A frame found corrupt here (the file
    /// changed since open) makes the rest of its segment skipped, its records counted as dropped.
    pub fn peek(&mut self) -> Result<Option<SpooledBatch>, SpoolError> {
        self.peeked = None;
        while let Some(front) = self.segments.front() {
            let (seq, end, offset) = (front.seq, front.len, self.offset);
            let path = segment_path(&self.dir, seq);
            let file = match self.reader.take() {
                Some((s, file)) if s == seq => file,
                _ => File::open(&path).map_err(io_err("open", &path))?,
            };
            let file = &mut self.reader.insert((seq, file)).1;
            let mut payload = Vec::new();
            let read = file
                .seek(SeekFrom::Start(offset))
                .and_then(|_| read_frame(file, end.saturating_sub(offset), &mut payload));
            match read {
                Ok(FrameRead::Frame { records, frame_len }) => {
                    self.peeked = Some(Position {
                        seq,
                        offset,
                        frame_len,
                        records,
                    });
                    return Ok(Some(SpooledBatch {
                        bytes: payload,
                        records,
                    }));
                }
                Ok(FrameRead::Bad(reason)) => self.skip_corrupt_front(reason)?,
                Err(e) => {
                    self.reader = None;
                    return Err(io_err("read", &path)(e));
                }
            }
        }
        Ok(None)
    }

    /// Marks the batch returned by the last [`peek`](Self::peek) as delivered, durably: once
    /// this returns `Ok` the batch is never replayed, even after a restart. If that batch was
    /// dropped by the cap since the peek (and counted), this does nothing. On error nothing
    /// changes and the pop can be retried.
    pub fn pop(&mut self) -> Result<(), SpoolError> {
        let peeked = self.peeked.ok_or(SpoolError::NotPeeked)?;
        let Some(front) = self.segments.front() else {
            self.peeked = None;
            return Ok(());
        };
        if front.seq != peeked.seq || self.offset != peeked.offset {
            self.peeked = None;
            return Ok(());
        }
        let offset = self.offset + peeked.frame_len;
        if offset >= front.len {
            self.drop_front(1, 0)?;
        } else {
            self.store_cursor(front.seq, offset, self.dropped_total)?;
            self.offset = offset;
            if let Some(front) = self.segments.front_mut() {
                front.batches -= 1;
                front.records -= u64::from(peeked.records);
            }
        }
        self.peeked = None;
        Ok(())
    }

    /// Consumes the `batches` oldest batches without reading their payloads, with one cursor
    /// write for all: like that many `peek`s and `pop`s, for an owner that has the batches in
    /// memory already (the record journal). Fewer are consumed when fewer are left. On error
    /// nothing changes.
    pub fn skip(&mut self, batches: u64) -> Result<(), SpoolError> {
        use std::os::unix::fs::FileExt;
        self.peeked = None;
        let (mut done, mut offset, mut left) = (0, self.offset, batches);
        // Batches and records consumed in the segment where reading stops.
        let (mut in_front, mut in_front_records) = (0, 0);
        while left > 0 {
            let Some(segment) = self.segments.get(done) else {
                break;
            };
            let path = segment_path(&self.dir, segment.seq);
            let mut header = [0; FRAME_HEADER_BYTES as usize];
            File::open(&path)
                .and_then(|f| f.read_exact_at(&mut header, offset))
                .map_err(io_err("read", &path))?;
            if header[0] != FRAME_MAGIC || header[1] != FRAME_VERSION {
                return Err(io_err("skip in", &path)(io::Error::other(
                    "no frame where one was expected",
                )));
            }
            let len = u32::from_le_bytes([header[2], header[3], header[4], header[5]]);
            let records = u32::from_le_bytes([header[6], header[7], header[8], header[9]]);
            offset += FRAME_HEADER_BYTES + u64::from(len);
            (in_front, in_front_records) = (in_front + 1, in_front_records + u64::from(records));
            left -= 1;
            if offset >= segment.len {
                (done, offset, in_front, in_front_records) = (done + 1, 0, 0, 0);
            }
        }
        if done == 0 && in_front == 0 {
            return Ok(());
        }
        let seq = self.segments.get(done).map_or(self.next_seq, |s| s.seq);
        self.store_cursor(seq, offset, self.dropped_total)?;
        for segment in self.segments.drain(..done) {
            if self.reader.as_ref().is_some_and(|(s, _)| *s == segment.seq) {
                self.reader = None;
            }
            let path = segment_path(&self.dir, segment.seq);
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != io::ErrorKind::NotFound
            {
                warn!(segment = %path.display(), error = %e, "spool: cannot delete a segment");
            }
        }
        self.offset = offset;
        match self.segments.front_mut() {
            Some(front) => {
                front.batches -= in_front;
                front.records -= in_front_records;
            }
            None => self.writer = None,
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    pub fn pending_batches(&self) -> u64 {
        self.segments.iter().map(|s| s.batches).sum()
    }

    pub fn pending_records(&self) -> u64 {
        self.segments.iter().map(|s| s.records).sum()
    }

    /// Bytes the segments take on disk, consumed frames of the head segment included.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Records dropped since this process opened the spool: by the cap, or skipped with a
    /// segment found corrupt while reading.
    pub fn dropped_records(&self) -> u64 {
        self.dropped_records
    }

    /// Like [`dropped_records`](Self::dropped_records), but the total since the spool was
    /// created, persisted in the cursor.
    pub fn dropped_records_total(&self) -> u64 {
        self.dropped_total
    }

    /// Bytes discarded since open because they were torn or corrupt (their records, unknown,
    /// are not in the dropped counts). A crash mid-append normally leaves a few here.
    pub fn corrupt_bytes(&self) -> u64 {
        self.corrupt_bytes
    }

    /// The cursor to persist: the front segment and offset, or the next segment's start.
    fn read_position(&self) -> (u64, u64) {
        self.segments
            .front()
            .map_or((self.next_seq, 0), |front| (front.seq, self.offset))
    }

    /// Drops the oldest whole segments until `incoming` more bytes fit under the cap.
    fn make_room(&mut self, incoming: u64) -> Result<(), SpoolError> {
        let excess = (self.bytes() + incoming).saturating_sub(self.cap);
        if excess == 0 {
            return Ok(());
        }
        let (mut count, mut freed, mut batches, mut records) = (0, 0, 0, 0);
        for segment in &self.segments {
            if freed >= excess {
                break;
            }
            count += 1;
            freed += segment.len;
            batches += segment.batches;
            records += segment.records;
        }
        if count == 0 {
            return Ok(());
        }
        warn!(
            dir = %self.dir.display(),
            segments = count,
            batches,
            records,
            bytes = freed,
            cap = self.cap,
            "spool: full; dropping the oldest segments"
        );
        self.drop_front(count, records)
    }

    /// Skips the rest of the front segment after a bad frame, counting its records as dropped.
    fn skip_corrupt_front(&mut self, reason: &'static str) -> Result<(), SpoolError> {
        let Some(front) = self.segments.front() else {
            return Ok(());
        };
        let bytes = front.len - self.offset;
        warn!(
            segment = %segment_path(&self.dir, front.seq).display(),
            offset = self.offset,
            bytes,
            batches = front.batches,
            records = front.records,
            reason,
            "spool: corrupt frame; skipping the rest of the segment, its records count as dropped"
        );
        let records = front.records;
        self.corrupt_bytes += bytes;
        self.drop_front(1, records)
    }

    /// Deletes the `count` oldest segments, adding `dropped` to the dropped counters. The cursor
    /// moves past them first, so a crash leaves at worst files that open deletes.
    fn drop_front(&mut self, count: usize, dropped: u64) -> Result<(), SpoolError> {
        let next = self.segments.get(count).map_or(self.next_seq, |s| s.seq);
        let total = self.dropped_total + dropped;
        self.store_cursor(next, 0, total)?;
        self.dropped_total = total;
        self.dropped_records += dropped;
        self.offset = 0;
        for segment in self.segments.drain(..count) {
            if self
                .reader
                .as_ref()
                .is_some_and(|(seq, _)| *seq == segment.seq)
            {
                self.reader = None;
            }
            let path = segment_path(&self.dir, segment.seq);
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != io::ErrorKind::NotFound
            {
                // Behind the cursor now: the next open deletes it.
                warn!(segment = %path.display(), error = %e, "spool: cannot delete a segment");
            }
        }
        if self.segments.is_empty() {
            self.writer = None;
        }
        Ok(())
    }

    /// Starts a new, empty segment and makes it the one appended to.
    fn roll(&mut self) -> Result<(), SpoolError> {
        self.writer = None;
        let seq = self.next_seq;
        // Advance first: a failed create must not be retried on the same name forever.
        self.next_seq += 1;
        let path = segment_path(&self.dir, seq);
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err("create", &path))?;
        if let Err(e) = sync_dir(&self.dir) {
            // An empty segment is harmless (open deletes it); removing it is a courtesy.
            drop(fs::remove_file(&path));
            return Err(e);
        }
        self.segments.push_back(Segment {
            seq,
            len: 0,
            batches: 0,
            records: 0,
        });
        self.writer = Some(file);
        Ok(())
    }

    /// After a failed append: cuts the partial frame off and stops appending to that segment.
    fn abandon_writer(&mut self) {
        let Some(writer) = self.writer.take() else {
            return;
        };
        let Some(back) = self.segments.back() else {
            return;
        };
        let path = segment_path(&self.dir, back.seq);
        if let Err(e) = writer.set_len(back.len) {
            // Reads stop at `back.len`; open truncates whatever is past it.
            warn!(segment = %path.display(), error = %e, "spool: cannot cut a failed append off");
        }
        if back.len == 0 {
            self.segments.pop_back();
            if self.segments.is_empty() {
                self.offset = 0;
            }
            drop(fs::remove_file(&path));
        }
    }

    /// Atomically replaces the cursor file.
    fn store_cursor(&self, seq: u64, offset: u64, dropped_total: u64) -> Result<(), SpoolError> {
        let bytes = Cursor {
            seq,
            offset,
            dropped_total,
        }
        .encode();
        let tmp = self.dir.join(CURSOR_TMP);
        let path = self.dir.join(CURSOR_FILE);
        File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(&bytes)?;
                f.sync_all()
            })
            .map_err(io_err("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io_err("rename over", &path))?;
        sync_dir(&self.dir)
    }
}

// === impl Cursor ===

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Cursor {
    seq: u64,
    offset: u64,
    dropped_total: u64,
}

impl Cursor {
    fn encode(self) -> [u8; CURSOR_BYTES] {
        let mut out = [0; CURSOR_BYTES];
        out[..4].copy_from_slice(&CURSOR_MAGIC);
        out[4..12].copy_from_slice(&self.seq.to_le_bytes());
        out[12..20].copy_from_slice(&self.offset.to_le_bytes());
        out[20..28].copy_from_slice(&self.dropped_total.to_le_bytes());
        let crc = crc32fast::hash(&out[..28]);
        out[28..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; CURSOR_BYTES] = bytes.try_into().ok()?;
        let u64_at = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let crc = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]);
        (bytes[..4] == CURSOR_MAGIC && crc32fast::hash(&bytes[..28]) == crc).then(|| Cursor {
            seq: u64_at(4),
            offset: u64_at(12),
            dropped_total: u64_at(20),
        })
    }
}

/// The stored cursor; a missing one means "from the start", as does a corrupt one (logged):
/// replaying too much is allowed, losing is not.
fn read_cursor(dir: &Path) -> Result<Cursor, SpoolError> {
    let path = dir.join(CURSOR_FILE);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Cursor::default()),
        Err(e) => return Err(io_err("read", &path)(e)),
    };
    Ok(Cursor::decode(&bytes).unwrap_or_else(|| {
        warn!(
            cursor = %path.display(),
            "spool: corrupt cursor; replaying every spooled batch"
        );
        Cursor::default()
    }))
}

// === frames ===

fn encode_frame(batch: &[u8], len: u32, records: u32) -> Vec<u8> {
    let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES as usize + batch.len());
    frame.push(FRAME_MAGIC);
    frame.push(FRAME_VERSION);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&records.to_le_bytes());
    let crc = frame_crc(&frame[1..10], batch);
    frame.extend_from_slice(&crc.to_le_bytes());
    frame.extend_from_slice(batch);
    frame
}

fn frame_crc(header: &[u8], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(header);
    hasher.update(payload);
    hasher.finalize()
}

enum FrameRead {
    Frame { records: u32, frame_len: u64 },
    Bad(&'static str),
}

/// Reads and verifies the frame at the reader's position into `payload`; `available` bytes of
/// the segment remain from there.
fn read_frame(r: &mut impl Read, available: u64, payload: &mut Vec<u8>) -> io::Result<FrameRead> {
    let mut header = [0; FRAME_HEADER_BYTES as usize];
    if available < FRAME_HEADER_BYTES || !read_full(r, &mut header)? {
        return Ok(FrameRead::Bad("truncated header"));
    }
    if header[0] != FRAME_MAGIC || header[1] != FRAME_VERSION {
        return Ok(FrameRead::Bad("bad magic or version"));
    }
    let len = u32::from_le_bytes([header[2], header[3], header[4], header[5]]);
    let records = u32::from_le_bytes([header[6], header[7], header[8], header[9]]);
    let crc = u32::from_le_bytes([header[10], header[11], header[12], header[13]]);
    let frame_len = FRAME_HEADER_BYTES + u64::from(len);
    if frame_len > available {
        return Ok(FrameRead::Bad("truncated payload"));
    }
    payload.clear();
    payload.resize(len as usize, 0);
    if !read_full(r, payload)? {
        return Ok(FrameRead::Bad("truncated payload"));
    }
    if frame_crc(&header[1..10], payload) != crc {
        return Ok(FrameRead::Bad("CRC mismatch"));
    }
    Ok(FrameRead::Frame { records, frame_len })
}

/// `read_exact`, with a short file answering `false` rather than an error.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    match r.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

// === segments on disk ===

struct Scan {
    file_len: u64,
    /// Length of the run of valid frames from the start.
    valid_len: u64,
    /// Offset and record count of each valid frame.
    frames: Vec<(u64, u32)>,
    /// Why the frame at `valid_len` is bad, if the file goes on past it.
    bad: Option<&'static str>,
}

fn scan_segment(path: &Path) -> Result<Scan, SpoolError> {
    let file = File::open(path).map_err(io_err("open", path))?;
    let file_len = file.metadata().map_err(io_err("stat", path))?.len();
    let mut reader = BufReader::with_capacity(256 * 1024, file);
    let mut payload = Vec::new();
    let mut frames = Vec::new();
    let mut pos = 0;
    let mut bad = None;
    while pos < file_len {
        match read_frame(&mut reader, file_len - pos, &mut payload).map_err(io_err("read", path))? {
            FrameRead::Frame { records, frame_len } => {
                frames.push((pos, records));
                pos += frame_len;
            }
            FrameRead::Bad(reason) => {
                bad = Some(reason);
                break;
            }
        }
    }
    Ok(Scan {
        file_len,
        valid_len: pos,
        frames,
        bad,
    })
}

/// Where to resume in the cursor's segment: the cursor offset, or the frame holding it if it
/// does not fall on a boundary (replaying that frame once more).
fn resume_offset(scan: &Scan, wanted: u64, path: &Path) -> u64 {
    if wanted >= scan.valid_len {
        return scan.valid_len;
    }
    let at = scan
        .frames
        .iter()
        .map(|(at, _)| *at)
        .take_while(|at| *at <= wanted)
        .last()
        .unwrap_or(0);
    if at != wanted {
        warn!(
            segment = %path.display(),
            cursor = wanted,
            resume = at,
            "spool: cursor is not on a frame boundary; replaying from the frame holding it"
        );
    }
    at
}

fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!(
        "{seq:0width$}{SEGMENT_SUFFIX}",
        width = SEGMENT_DIGITS
    ))
}

/// Segment numbers in `dir`, ascending; other files are ignored.
fn list_segments(dir: &Path) -> Result<Vec<u64>, SpoolError> {
    let mut seqs = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err("list", dir))? {
        let entry = entry.map_err(io_err("list", dir))?;
        let name = entry.file_name();
        let seq = name
            .to_str()
            .and_then(|n| n.strip_suffix(SEGMENT_SUFFIX))
            .filter(|n| n.len() == SEGMENT_DIGITS && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse().ok());
        if let Some(seq) = seq {
            seqs.push(seq);
        }
    }
    seqs.sort_unstable();
    Ok(seqs)
}

fn truncate(path: &Path, len: u64) -> Result<(), SpoolError> {
    OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| {
            f.set_len(len)?;
            f.sync_all()
        })
        .map_err(io_err("truncate", path))
}

fn remove_if_exists(path: &Path) -> Result<(), SpoolError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("delete", path)(e)),
        _ => Ok(()),
    }
}

/// Makes created, renamed and deleted directory entries durable (POSIX needs the directory
/// itself fsynced for that).
fn sync_dir(dir: &Path) -> Result<(), SpoolError> {
    if cfg!(unix) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("sync directory", dir))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A recognisable payload: the id, then filler up to `size` bytes.
    fn payload(id: u64, size: usize) -> Vec<u8> {
        let mut bytes = id.to_le_bytes().to_vec();
        bytes.resize(size.max(8), id as u8);
        bytes
    }

    fn id_of(bytes: &[u8]) -> u64 {
        u64::from_le_bytes(bytes[..8].try_into().unwrap())
    }

    /// Peeks and pops everything, returning the ids in order.
    fn drain(spool: &mut Spool) -> Vec<u64> {
        let mut ids = Vec::new();
        while let Some(batch) = spool.peek().unwrap() {
            ids.push(id_of(&batch.bytes));
            spool.pop().unwrap();
        }
        assert!(spool.is_empty());
        assert_eq!(spool.pending_batches(), 0);
        assert_eq!(spool.pending_records(), 0);
        ids
    }

    fn segment_files(dir: &Path) -> Vec<PathBuf> {
        list_segments(dir)
            .unwrap()
            .into_iter()
            .map(|seq| segment_path(dir, seq))
            .collect()
    }

    fn file_len(path: &Path) -> u64 {
        fs::metadata(path).unwrap().len()
    }

    fn set_len(path: &Path, len: u64) {
        OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    fn flip_byte(path: &Path, at: u64) {
        let mut bytes = fs::read(path).unwrap();
        bytes[at as usize] ^= 0xFF;
        fs::write(path, bytes).unwrap();
    }

    #[test]
    fn skip_consumes_across_segments_durably_and_appends_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        for id in 0..30 {
            spool.append(&payload(id, 100), 2).unwrap();
        }
        assert!(segment_files(dir.path()).len() >= 3);
        spool.skip(13).unwrap();
        assert_eq!(spool.pending_batches(), 17);
        assert_eq!(spool.pending_records(), 34);
        spool.append(&payload(30, 100), 2).unwrap();
        drop(spool);
        // The skipped batches are not replayed; the rest are, in order.
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert_eq!(drain(&mut spool), (13..31).collect::<Vec<_>>());
        // Skipping more than there is consumes everything and leaves no segment behind.
        spool.append(&payload(31, 100), 1).unwrap();
        spool.skip(5).unwrap();
        assert!(spool.is_empty());
        assert!(segment_files(dir.path()).is_empty());
        spool.append(&payload(32, 100), 1).unwrap();
        assert_eq!(drain(&mut spool), vec![32]);
    }

    #[test]
    fn order_across_many_segments_and_nothing_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert!(spool.is_empty());
        for id in 0..30 {
            spool.append(&payload(id, 100), id as u32 + 1).unwrap();
        }
        assert!(segment_files(dir.path()).len() >= 3);
        assert_eq!(spool.pending_batches(), 30);
        assert_eq!(spool.pending_records(), (1..=30).sum::<u64>());
        assert_eq!(spool.bytes(), 30 * (FRAME_HEADER_BYTES + 100));

        let mut seen = Vec::new();
        while let Some(batch) = spool.peek().unwrap() {
            // Peeking twice does not consume.
            assert_eq!(spool.peek().unwrap().as_ref(), Some(&batch));
            let id = id_of(&batch.bytes);
            assert_eq!(batch.bytes, payload(id, 100));
            assert_eq!(batch.records, id as u32 + 1);
            seen.push(id);
            spool.pop().unwrap();
        }
        assert_eq!(seen, (0..30).collect::<Vec<_>>());
        assert!(spool.is_empty());
        assert_eq!(spool.bytes(), 0);
        assert!(segment_files(dir.path()).is_empty());

        // Still usable, and a reopen finds it empty.
        spool.append(&payload(99, 10), 1).unwrap();
        assert_eq!(drain(&mut spool), [99]);
        drop(spool);
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert!(spool.is_empty());
        assert_eq!(spool.peek().unwrap(), None);
        assert!(segment_files(dir.path()).is_empty());
    }

    #[test]
    fn reopen_keeps_everything_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        for id in 0..25 {
            spool.append(&payload(id, 90), 2).unwrap();
        }
        drop(spool);
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert_eq!(spool.pending_batches(), 25);
        assert_eq!(spool.pending_records(), 50);
        assert_eq!(spool.corrupt_bytes(), 0);
        // Appends continue after the recovered ones.
        spool.append(&payload(25, 90), 2).unwrap();
        assert_eq!(drain(&mut spool), (0..26).collect::<Vec<_>>());
    }

    #[test]
    fn reopen_after_partial_consumption_replays_only_unpopped() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        for id in 0..20 {
            spool.append(&payload(id, 100), 1).unwrap();
        }
        let segments_before = segment_files(dir.path()).len();
        for id in 0..12 {
            assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), id);
            spool.pop().unwrap();
        }
        // Peeked (say, sent) but never popped: replayed.
        assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), 12);
        assert!(segment_files(dir.path()).len() < segments_before);
        drop(spool);

        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert_eq!(spool.pending_batches(), 8);
        assert_eq!(drain(&mut spool), (12..20).collect::<Vec<_>>());
    }

    #[test]
    fn torn_tail_at_every_offset_of_the_last_frame() {
        let size = 40;
        let frame = FRAME_HEADER_BYTES + size as u64;
        for cut in 1..=frame {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
            for id in 0..3 {
                spool.append(&payload(id, size), 1).unwrap();
            }
            drop(spool);
            let newest = segment_files(dir.path()).pop().unwrap();
            set_len(&newest, file_len(&newest) - cut);

            let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
            assert_eq!(spool.corrupt_bytes(), frame - cut, "cut {cut}");
            assert_eq!(file_len(&newest), 2 * frame, "cut {cut}");
            assert_eq!(spool.pending_batches(), 2);
            spool.append(&payload(7, size), 1).unwrap();
            drop(spool);
            let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
            assert_eq!(spool.corrupt_bytes(), 0);
            assert_eq!(drain(&mut spool), [0, 1, 7], "cut {cut}");
        }
    }

    #[test]
    fn zero_filled_tail_is_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        spool.append(&payload(0, 30), 1).unwrap();
        drop(spool);
        let newest = segment_files(dir.path()).pop().unwrap();
        let len = file_len(&newest);
        set_len(&newest, len + 100);

        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(spool.corrupt_bytes(), 100);
        assert_eq!(file_len(&newest), len);
        assert_eq!(drain(&mut spool), [0]);
    }

    #[test]
    fn corrupt_crc_in_the_newest_segment() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        for id in 0..4 {
            spool.append(&payload(id, 50), 1).unwrap();
        }
        drop(spool);
        let newest = segment_files(dir.path()).pop().unwrap();
        let frame = FRAME_HEADER_BYTES + 50;
        // A payload byte of the third frame: it and the fourth are cut.
        flip_byte(&newest, 2 * frame + FRAME_HEADER_BYTES + 20);

        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(spool.corrupt_bytes(), 2 * frame);
        assert_eq!(drain(&mut spool), [0, 1]);
    }

    #[test]
    fn corrupt_frame_in_an_older_segment_skips_the_rest_of_it() {
        let dir = tempfile::tempdir().unwrap();
        // Segments of at most 1024 bytes: 8 frames of 114.
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        for id in 0..24 {
            spool.append(&payload(id, 100), 1).unwrap();
        }
        drop(spool);
        let files = segment_files(dir.path());
        assert_eq!(files.len(), 3);
        // The record count of the fourth frame of the middle segment.
        flip_byte(&files[1], 3 * 114 + 7);

        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert_eq!(spool.corrupt_bytes(), 5 * 114);
        let expected: Vec<u64> = (0..11).chain(16..24).collect();
        assert_eq!(drain(&mut spool), expected);
    }

    #[test]
    fn corruption_found_while_reading_skips_and_counts() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        for id in 0..16 {
            spool.append(&payload(id, 100), 3).unwrap();
        }
        let files = segment_files(dir.path());
        assert_eq!(files.len(), 2);
        assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), 0);
        spool.pop().unwrap();
        // Damage the third frame of the first segment under the open spool.
        flip_byte(&files[0], 2 * 114 + 30);

        assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), 1);
        spool.pop().unwrap();
        // Frames 2..8 of the first segment are skipped: 6 batches of 3 records.
        assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), 8);
        assert_eq!(spool.dropped_records(), 18);
        assert_eq!(spool.dropped_records_total(), 18);
        assert_eq!(spool.corrupt_bytes(), 6 * 114);
        assert!(!files[0].exists());
        assert_eq!(drain(&mut spool), (8..16).collect::<Vec<_>>());
    }

    #[test]
    fn corruption_of_the_segment_being_written_is_survivable() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        spool.append(&payload(0, 100), 1).unwrap();
        spool.append(&payload(1, 100), 1).unwrap();
        let files = segment_files(dir.path());
        assert_eq!(files.len(), 1);
        flip_byte(&files[0], 20);
        assert_eq!(spool.peek().unwrap(), None);
        assert_eq!(spool.dropped_records(), 2);
        spool.append(&payload(2, 100), 1).unwrap();
        assert_eq!(drain(&mut spool), [2]);
    }

    #[test]
    fn corrupt_cursor_replays_everything() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        for id in 0..5 {
            spool.append(&payload(id, 10), 1).unwrap();
        }
        spool.peek().unwrap();
        spool.pop().unwrap();
        drop(spool);
        flip_byte(&dir.path().join(CURSOR_FILE), 13);
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(drain(&mut spool), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn cursor_off_a_frame_boundary_replays_that_frame() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        for id in 0..3 {
            spool.append(&payload(id, 10), 1).unwrap();
        }
        let seq = spool.segments[0].seq;
        spool.store_cursor(seq, 24 + 5, 0).unwrap();
        drop(spool);
        let mut spool = Spool::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(drain(&mut spool), [1, 2]);
    }

    #[test]
    fn cap_drops_the_oldest_whole_segments_and_counts_them() {
        let dir = tempfile::tempdir().unwrap();
        let cap = 2000;
        let mut spool = Spool::open(dir.path(), cap).unwrap();
        // Frames of 100 bytes, 3 records each; segments of 500 bytes.
        for id in 0..50 {
            spool.append(&payload(id, 86), 3).unwrap();
            assert!(spool.bytes() <= cap);
            assert_eq!(
                spool.dropped_records() + spool.pending_records(),
                3 * (id + 1)
            );
        }
        assert!(spool.dropped_records() > 0);
        assert_eq!(
            spool.dropped_records() % 15,
            0,
            "whole segments of 5 frames"
        );
        let kept = spool.pending_batches();
        assert_eq!(spool.bytes(), kept * 100);
        drop(spool);

        let mut spool = Spool::open(dir.path(), cap).unwrap();
        assert_eq!(spool.dropped_records(), 0);
        assert_eq!(spool.dropped_records_total(), 3 * (50 - kept));
        assert_eq!(drain(&mut spool), (50 - kept..50).collect::<Vec<_>>());
    }

    #[test]
    fn dropping_the_partly_consumed_head_counts_only_unconsumed_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1000).unwrap();
        // Segments of 250 bytes: 2 frames of 100.
        for id in 0..10 {
            spool.append(&payload(id, 86), 1).unwrap();
        }
        spool.peek().unwrap();
        spool.pop().unwrap();
        spool.append(&payload(10, 86), 1).unwrap();
        assert_eq!(spool.dropped_records(), 1);
        assert_eq!(drain(&mut spool), (2..11).collect::<Vec<_>>());
    }

    #[test]
    fn a_batch_bigger_than_the_cap_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let cap = 1000;
        let mut spool = Spool::open(dir.path(), cap).unwrap();
        spool.append(&payload(0, 100), 1).unwrap();
        let err = spool.append(&payload(1, 1000), 1).unwrap_err();
        assert!(matches!(
            err,
            SpoolError::BatchTooLarge {
                size: 1014,
                cap: 1000
            }
        ));
        assert_eq!(spool.pending_batches(), 1);
        assert_eq!(spool.dropped_records(), 0);

        // Exactly the cap fits, dropping everything older.
        spool
            .append(&payload(2, (cap - FRAME_HEADER_BYTES) as usize), 4)
            .unwrap();
        assert_eq!(spool.bytes(), cap);
        assert_eq!(spool.dropped_records(), 1);
        assert_eq!(drain(&mut spool), [2]);
    }

    #[test]
    fn pop_needs_a_peek_and_ignores_a_peeked_batch_since_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1000).unwrap();
        assert!(matches!(spool.pop(), Err(SpoolError::NotPeeked)));
        for id in 0..8 {
            spool.append(&payload(id, 86), 1).unwrap();
        }
        assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), 0);
        spool.pop().unwrap();
        assert!(matches!(spool.pop(), Err(SpoolError::NotPeeked)));

        assert_eq!(id_of(&spool.peek().unwrap().unwrap().bytes), 1);
        // Drops the head segment (batches 0 and 1) while batch 1 is out for delivery.
        for id in 8..11 {
            spool.append(&payload(id, 86), 1).unwrap();
        }
        assert_eq!(spool.dropped_records(), 1);
        spool.pop().unwrap();
        assert_eq!(drain(&mut spool), (2..11).collect::<Vec<_>>());
    }

    #[test]
    fn a_lower_cap_at_open_drops_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4000).unwrap();
        for id in 0..30 {
            spool.append(&payload(id, 86), 1).unwrap();
        }
        drop(spool);
        let mut spool = Spool::open(dir.path(), 1000).unwrap();
        assert!(spool.bytes() <= 1000);
        assert_eq!(
            spool.dropped_records() + spool.pending_records(),
            30,
            "every record is kept or counted"
        );
        let ids = drain(&mut spool);
        assert_eq!(ids.last(), Some(&29));
        assert_eq!(ids, (30 - ids.len() as u64..30).collect::<Vec<_>>());
    }

    #[test]
    fn leftovers_of_a_crash_are_cleaned_up() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        for id in 0..20 {
            spool.append(&payload(id, 100), 1).unwrap();
        }
        let first = segment_files(dir.path())[0].clone();
        let consumed = fs::read(&first).unwrap();
        for _ in 0..9 {
            spool.peek().unwrap();
            spool.pop().unwrap();
        }
        drop(spool);
        // A consumed segment whose unlink was lost, an empty segment, a stale temp cursor.
        fs::write(&first, consumed).unwrap();
        fs::write(segment_path(dir.path(), 999), b"").unwrap();
        fs::write(dir.path().join(CURSOR_TMP), b"junk").unwrap();

        let mut spool = Spool::open(dir.path(), 4096).unwrap();
        assert!(!first.exists());
        assert!(!segment_path(dir.path(), 999).exists());
        assert!(!dir.path().join(CURSOR_TMP).exists());
        spool.append(&payload(20, 100), 1).unwrap();
        assert_eq!(drain(&mut spool), (9..21).collect::<Vec<_>>());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Append {
            size: usize,
            records: u32,
        },
        Pop,
        /// Peek, append (which may drop the peeked batch), then pop.
        PeekAppendPop {
            size: usize,
            records: u32,
        },
        Reopen,
        /// Crash mid-append: cut the newest segment inside its last frame, then reopen.
        TornTail {
            keep_permille: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0usize..600, 1u32..5).prop_map(|(size, records)| Op::Append { size, records }),
            3 => Just(Op::Pop),
            1 => (0usize..600, 1u32..5)
                .prop_map(|(size, records)| Op::PeekAppendPop { size, records }),
            1 => Just(Op::Reopen),
            1 => (0u64..1000).prop_map(|keep_permille| Op::TornTail { keep_permille }),
        ]
    }

    /// The batches the spool must hold: (id, size, records), oldest first.
    struct Model {
        batches: VecDeque<(u64, usize, u32)>,
        next_id: u64,
        dropped_total: u64,
    }

    impl Model {
        /// Takes the spool's drops (always a prefix: the oldest) and checks the counters.
        fn sync(&mut self, spool: &Spool, cap: u64) -> Result<(), TestCaseError> {
            let mut dropped = spool.dropped_records_total() - self.dropped_total;
            self.dropped_total = spool.dropped_records_total();
            while dropped > 0 {
                let (_, _, records) = self.batches.pop_front().unwrap();
                prop_assert!(u64::from(records) <= dropped, "dropped a partial batch");
                dropped -= u64::from(records);
            }
            prop_assert_eq!(spool.pending_batches(), self.batches.len() as u64);
            let records: u64 = self.batches.iter().map(|b| u64::from(b.2)).sum();
            prop_assert_eq!(spool.pending_records(), records);
            prop_assert_eq!(spool.is_empty(), self.batches.is_empty());
            prop_assert!(spool.bytes() <= cap);
            Ok(())
        }

        fn append(&mut self, spool: &mut Spool, size: usize, records: u32) -> u64 {
            let id = self.next_id;
            self.next_id += 1;
            spool.append(&payload(id, size), records).unwrap();
            self.batches.push_back((id, size, records));
            id
        }
    }

    fn check_front(
        batch: Option<&SpooledBatch>,
        model: &Model,
    ) -> Result<Option<u64>, TestCaseError> {
        match (batch, model.batches.front()) {
            (None, None) => Ok(None),
            (Some(batch), Some(&(id, size, records))) => {
                prop_assert_eq!(&batch.bytes, &payload(id, size));
                prop_assert_eq!(batch.records, records);
                Ok(Some(id))
            }
            (batch, front) => Err(TestCaseError::fail(format!(
                "spool front {batch:?}, model front {front:?}"
            ))),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// Any sequence of appends, pops, reopens and torn tails keeps the spool equal to a
        /// FIFO model, less the oldest batches it reports as dropped.
        #[test]
        fn behaves_like_a_fifo(cap in 1500u64..6000, ops in proptest::collection::vec(op(), 1..60)) {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::open(dir.path(), cap).unwrap();
            let mut model = Model { batches: VecDeque::new(), next_id: 0, dropped_total: 0 };
            for op in ops {
                match op {
                    Op::Append { size, records } => {
                        model.append(&mut spool, size, records);
                    }
                    Op::Pop => {
                        let batch = spool.peek().unwrap();
                        if check_front(batch.as_ref(), &model)?.is_some() {
                            spool.pop().unwrap();
                            model.batches.pop_front();
                        }
                    }
                    Op::PeekAppendPop { size, records } => {
                        let batch = spool.peek().unwrap();
                        let peeked = check_front(batch.as_ref(), &model)?;
                        model.append(&mut spool, size, records);
                        model.sync(&spool, cap)?;
                        if let Some(peeked) = peeked {
                            spool.pop().unwrap();
                            if model.batches.front().map(|b| b.0) == Some(peeked) {
                                model.batches.pop_front();
                            }
                        }
                    }
                    Op::Reopen => {
                        drop(spool);
                        spool = Spool::open(dir.path(), cap).unwrap();
                        prop_assert_eq!(spool.corrupt_bytes(), 0);
                    }
                    Op::TornTail { keep_permille } => {
                        let Some(&(_, size, _)) = model.batches.back() else { continue };
                        drop(spool);
                        let newest = segment_files(dir.path()).pop().unwrap();
                        let frame = FRAME_HEADER_BYTES + payload(0, size).len() as u64;
                        let keep = frame * keep_permille / 1000;
                        set_len(&newest, file_len(&newest) - frame + keep);
                        spool = Spool::open(dir.path(), cap).unwrap();
                        prop_assert_eq!(spool.corrupt_bytes(), keep);
                        model.batches.pop_back();
                    }
                }
                model.sync(&spool, cap)?;
            }
            let mut ids = Vec::new();
            while let Some(batch) = spool.peek().unwrap() {
                let id = check_front(Some(&batch), &model)?;
                ids.extend(id);
                spool.pop().unwrap();
                model.batches.pop_front();
            }
            prop_assert!(model.batches.is_empty(), "spool ran out before the model: {:?}", ids);
            prop_assert!(segment_files(dir.path()).is_empty());
        }
    }

    /// Throughput of durable appends of 50 KB batches on this machine's disk. Informative only:
    /// `cargo nextest run --workspace --run-ignored only -E 'test(spool::tests::append_rate)'`.
    #[test]
    #[ignore = "measures the disk, asserts nothing"]
    fn append_rate_of_50kb_batches() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), 1 << 30).unwrap();
        let batch = vec![7; 50 * 1024];
        let n = 500;
        let start = std::time::Instant::now();
        for _ in 0..n {
            spool.append(&batch, 100).unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "spool: {n} appends of 50 KiB in {secs:.2} s: {:.0} appends/s ({:.1} MiB/s)",
            f64::from(n) / secs,
            f64::from(n) * 50.0 / 1024.0 / secs
        );
    }
}
