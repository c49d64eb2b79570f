//! Server-sent events split incrementally: frames in, `(event type, data)` pairs out.
//!
//! Built for the meter's hot path: an event whose `data` line lies whole within one frame is
//! handed over as a slice of that frame, and only what straddles a frame boundary (the unfinished
//! line, the data of an unfinished event) is copied and kept. It follows the "interpreting an
//! event stream" rules of the WHATWG HTML standard for what metering needs: `\n`, `\r\n` and `\r`
//! line ends (a `\r\n` may be cut between frames), a leading byte-order mark, `:` comments,
//! `data` lines joined with `\n`, `event` naming the event; `id`, `retry` and unknown fields are
//! ignored. An event over [`MAX_EVENT`] bytes is skipped, not buffered, and so is the data of an
//! event the [`Handler`] does not want.

use memchr::{memchr, memchr2};

/// Most bytes one event's data (or one line) may hold; a bigger event is skipped. Usage events
/// are small: this only bounds the memory a broken or hostile upstream can make us hold.
pub(super) const MAX_EVENT: usize = 1 << 20;

/// Longest event type kept. A longer one is not a type we know, so its events are handed over.
const MAX_NAME: usize = 64;

/// Buffers grown past this by one big event are released, not kept for the stream's lifetime.
const KEEP_CAPACITY: usize = 64 * 1024;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Receives the events of a stream.
pub(super) trait Handler {
    /// Whether events of this type can hold anything of interest; the data of others is neither
    /// copied nor handed over. The default type (no `event` field) is always wanted.
    fn wants(&self, event: &[u8]) -> bool;

    /// One complete event: its type (empty for the default) and its data.
    fn event(&mut self, event: &[u8], data: &[u8]);
}

/// The splitter's state between frames.
#[derive(Debug, Default)]
pub(super) struct Splitter {
    /// The start of the line the last frame ended in (at most `MAX_EVENT` bytes of it).
    line: Vec<u8>,
    /// That line's full length so far, kept or not.
    line_len: usize,
    /// Whether a line is carried over from the last frame.
    in_line: bool,
    /// The last frame ended in `\r`: a `\n` opening the next one ends no further line.
    after_cr: bool,
    /// A line has been read (only the first may open with a byte-order mark).
    started: bool,
    event: Event,
}

/// The event being assembled.
#[derive(Debug, Default)]
struct Event {
    name: Vec<u8>,
    /// The type was too long to keep: not one we could skip.
    long_name: bool,
    data: Data,
    /// The data, when it had to be copied.
    owned: Vec<u8>,
    /// Bytes of data so far, `\n` joins included.
    len: usize,
    /// The data is not kept: the event is too big or unwanted.
    skip: bool,
}

#[derive(Debug, Default, Clone, Copy)]
enum Data {
    #[default]
    None,
    /// A single `data` line, at this range of the current frame.
    Frame(usize, usize),
    /// In `Event::owned`.
    Owned,
}

impl Splitter {
    /// Reads one frame, calling `handler` for every event it completes.
    pub(super) fn feed(&mut self, frame: &[u8], handler: &mut impl Handler) {
        let mut pos = 0;
        if self.after_cr && !frame.is_empty() {
            self.after_cr = false;
            if frame[0] == b'\n' {
                pos = 1;
            }
        }
        while pos < frame.len() {
            let Some(off) = memchr2(b'\n', b'\r', &frame[pos..]) else {
                self.carry(&frame[pos..]);
                break;
            };
            let end = pos + off;
            let next = match (frame[end], frame.get(end + 1)) {
                (b'\r', Some(b'\n')) => end + 2,
                (b'\r', None) => {
                    self.after_cr = true;
                    end + 1
                }
                _ => end + 1,
            };
            if self.in_line {
                self.carry(&frame[pos..end]);
                // Taken out so the line can be read while `self` changes; given back to keep
                // its capacity.
                let line = std::mem::take(&mut self.line);
                let len = std::mem::replace(&mut self.line_len, 0);
                self.in_line = false;
                self.line(&line, len, None, frame, handler);
                self.line = line;
                self.line.clear();
                if self.line.capacity() > KEEP_CAPACITY {
                    self.line = Vec::new();
                }
            } else {
                self.line(&frame[pos..end], end - pos, Some(pos), frame, handler);
            }
            pos = next;
        }
        // Data still pointing into this frame must be copied before the frame goes.
        if let Data::Frame(start, end) = self.event.data {
            self.event.owned.clear();
            self.event.owned.extend_from_slice(&frame[start..end]);
            self.event.data = Data::Owned;
        }
    }

    /// The body ended: an event whose data lines all ended is handed over even without the
    /// closing blank line (lenient where the standard drops it: the data is whole), a cut line
    /// is dropped.
    pub(super) fn finish(&mut self, handler: &mut impl Handler) {
        self.dispatch(&[], handler);
    }

    /// Keeps (the start of) a line the frame ends in.
    fn carry(&mut self, bytes: &[u8]) {
        self.in_line = true;
        self.line_len = self.line_len.saturating_add(bytes.len());
        let room = MAX_EVENT.saturating_sub(self.line.len());
        self.line.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// One line, without its end; `len` is its full length (`line` may hold only its start) and
    /// `at` its offset in `frame` when it lies there whole.
    fn line(
        &mut self,
        mut line: &[u8],
        mut len: usize,
        mut at: Option<usize>,
        frame: &[u8],
        handler: &mut impl Handler,
    ) {
        if !self.started {
            self.started = true;
            if line.starts_with(BOM) {
                line = &line[BOM.len()..];
                len -= BOM.len();
                at = at.map(|a| a + BOM.len());
            }
        }
        if len == 0 {
            self.dispatch(frame, handler);
            return;
        }
        if line.first() == Some(&b':') {
            return; // a comment (keep-alives, OpenRouter's "processing" notes)
        }
        let (field, value_at) = match memchr(b':', line) {
            Some(colon) => (
                &line[..colon],
                colon + 1 + usize::from(line.get(colon + 1) == Some(&b' ')),
            ),
            None => (line, line.len()),
        };
        let value = &line[value_at..];
        let too_big = len > MAX_EVENT;
        match field {
            b"data" => self.data(
                value,
                len - value_at,
                too_big,
                at.map(|a| a + value_at),
                frame,
                handler,
            ),
            b"event" => {
                let event = &mut self.event;
                event.name.clear();
                event.long_name = too_big || value.len() > MAX_NAME;
                if !event.long_name {
                    event.name.extend_from_slice(value);
                }
            }
            _ => {}
        }
    }

    /// A `data` line's value (`len` bytes in full, at `at` in `frame` when whole there).
    fn data(
        &mut self,
        value: &[u8],
        len: usize,
        too_big: bool,
        at: Option<usize>,
        frame: &[u8],
        handler: &impl Handler,
    ) {
        let event = &mut self.event;
        if event.skip {
            return;
        }
        // The type usually comes first: an unwanted event is dropped before any copy.
        let unwanted = !event.name.is_empty() && !handler.wants(&event.name);
        let join = usize::from(!matches!(event.data, Data::None));
        event.len = event.len.saturating_add(len).saturating_add(join);
        if unwanted || too_big || event.len > MAX_EVENT {
            event.skip = true;
            event.data = Data::None;
            event.owned = Vec::new();
            return;
        }
        match (event.data, at) {
            (Data::None, Some(start)) => event.data = Data::Frame(start, start + value.len()),
            (Data::None, None) => {
                event.owned.clear();
                event.owned.extend_from_slice(value);
                event.data = Data::Owned;
            }
            (Data::Frame(start, end), _) => {
                event.owned.clear();
                event.owned.extend_from_slice(&frame[start..end]);
                event.owned.push(b'\n');
                event.owned.extend_from_slice(value);
                event.data = Data::Owned;
            }
            (Data::Owned, _) => {
                event.owned.push(b'\n');
                event.owned.extend_from_slice(value);
            }
        }
    }

    /// A blank line: hands the event over and starts the next.
    fn dispatch(&mut self, frame: &[u8], handler: &mut impl Handler) {
        let event = &mut self.event;
        let wanted = event.long_name || event.name.is_empty() || handler.wants(&event.name);
        if wanted && !event.skip {
            match event.data {
                Data::None => {}
                Data::Frame(start, end) => handler.event(&event.name, &frame[start..end]),
                Data::Owned => handler.event(&event.name, &event.owned),
            }
        }
        event.name.clear();
        event.long_name = false;
        event.data = Data::None;
        event.owned.clear();
        if event.owned.capacity() > KEEP_CAPACITY {
            event.owned = Vec::new();
        }
        event.len = 0;
        event.skip = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records events; `skip` names the one event type it does not want.
    #[derive(Default)]
    struct Record {
        skip: &'static str,
        events: Vec<(String, String)>,
    }

    impl Handler for Record {
        fn wants(&self, event: &[u8]) -> bool {
            event != self.skip.as_bytes()
        }

        fn event(&mut self, event: &[u8], data: &[u8]) {
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            self.events.push((text(event), text(data)));
        }
    }

    fn split(frames: &[&[u8]], skip: &'static str) -> Vec<(String, String)> {
        let mut splitter = Splitter::default();
        let mut record = Record {
            skip,
            ..Record::default()
        };
        for frame in frames {
            splitter.feed(frame, &mut record);
        }
        splitter.finish(&mut record);
        record.events
    }

    fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
        expected
            .iter()
            .map(|(e, d)| ((*e).to_owned(), (*d).to_owned()))
            .collect()
    }

    /// Every way of cutting `stream` in two or three gives the same events as reading it whole.
    fn same_when_cut(stream: &[u8], skip: &'static str) -> Vec<(String, String)> {
        let whole = split(&[stream], skip);
        for i in 0..=stream.len() {
            for j in i..=stream.len() {
                let got = split(&[&stream[..i], &stream[i..j], &stream[j..]], skip);
                assert_eq!(got, whole, "cut at {i} and {j}");
            }
        }
        whole
    }

    #[test]
    fn line_ends() {
        let want = pairs(&[("", "a"), ("", "b"), ("", "c")]);
        assert_eq!(
            same_when_cut(b"data: a\n\ndata: b\n\ndata: c\n\n", ""),
            want
        );
        assert_eq!(
            same_when_cut(b"data: a\r\n\r\ndata: b\r\n\r\ndata: c\r\n\r\n", ""),
            want
        );
        assert_eq!(
            same_when_cut(b"data: a\r\rdata: b\r\rdata: c\r\r", ""),
            want
        );
        assert_eq!(
            same_when_cut(b"data: a\r\n\ndata: b\n\r\ndata: c\r\r\n", ""),
            want
        );
    }

    #[test]
    fn fields() {
        let stream =
            b"\xEF\xBB\xBF: keep-alive\nid: 7\nretry: 100\nevent: note\ndata:x\ndata: y\ndata\n\n\
                       :comment\ndata: {\"a\": 1}\nunknown: z\n\n";
        let want = pairs(&[("note", "x\ny\n"), ("", "{\"a\": 1}")]);
        assert_eq!(same_when_cut(stream, ""), want);
    }

    #[test]
    fn unwanted_events_are_dropped() {
        let stream = b"event: ping\ndata: {}\n\nevent: keep\ndata: 1\n\ndata: 2\nevent: ping\n\n";
        assert_eq!(same_when_cut(stream, "ping"), pairs(&[("keep", "1")]));
    }

    #[test]
    fn no_data_no_event() {
        assert_eq!(
            split(&[b"event: x\n\n\n\n: only a comment\n\n"], ""),
            pairs(&[])
        );
    }

    #[test]
    fn the_last_event_needs_whole_lines() {
        assert_eq!(split(&[b"data: a\n"], ""), pairs(&[("", "a")]));
        assert_eq!(split(&[b"data: a\ndata: b"], ""), pairs(&[("", "a")]));
        assert_eq!(split(&[b"data: partial"], ""), pairs(&[]));
    }

    #[test]
    fn oversized_events_are_skipped() {
        let big = vec![b'x'; MAX_EVENT + 1];
        let mut stream = b"data: ".to_vec();
        stream.extend_from_slice(&big);
        stream.extend_from_slice(b"\n\ndata: after\n\n");
        let want = pairs(&[("", "after")]);
        assert_eq!(split(&[&stream], ""), want);
        let pieces: Vec<&[u8]> = stream.chunks(4096).collect();
        assert_eq!(split(&pieces, ""), want);

        // Two lines that fit alone but not together.
        let half = vec![b'y'; MAX_EVENT / 2 + 1];
        let mut stream = Vec::new();
        for _ in 0..2 {
            stream.extend_from_slice(b"data: ");
            stream.extend_from_slice(&half);
            stream.push(b'\n');
        }
        stream.extend_from_slice(b"\ndata: after\n\n");
        assert_eq!(split(&[&stream], ""), want);
    }

    #[test]
    fn long_event_types_are_handed_over() {
        let name = "e".repeat(MAX_NAME + 1);
        let stream = format!("event: {name}\ndata: 1\n\n");
        assert_eq!(split(&[stream.as_bytes()], ""), pairs(&[("", "1")]));
    }
}
