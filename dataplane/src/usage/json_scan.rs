//! An incremental JSON scanner that picks a few values out of a document without keeping it.
//!
//! A non-streamed answer (or Gemini's streamed JSON array) can be megabytes of content around a
//! few hundred bytes we want: the model, the usage, the finish reason. The scanner is a byte-level
//! state machine fed frame by frame, cut anywhere (inside a string, an escape, a number, a UTF-8
//! character). It tracks only the containers on the way to a selected value, each as a frame on a
//! stack no deeper than the [`Select`] tree; a value nobody selected is consumed by counting
//! brackets and quotes (strings are crossed with `memchr`), never stored. A selected value is
//! captured raw, handed over as a slice of the frame when it lies whole within one (else copied
//! across frames, up to [`MAX_CAPTURE`] bytes), for the caller to parse with serde.
//!
//! A document fed whole in one frame (a request body) may also have values handed over in
//! place to a reader of their own ([`Select::walk`], [`Scanner::feed_walking`]), which says
//! where each ends; the scan goes on from there (a request's list of turns:
//! [`crate::implicit::conversation`]). A selection may ask to be told when an object it looked
//! into closes (`ended`), and captures may be allowed to grow with the document
//! ([`Scanner::with_limit`]): how the turns were read before, kept for the tests that compare
//! the two readers.
//!
//! It does not validate: malformed input gives fewer captures, never an error or unbounded
//! memory. Keys are compared as raw bytes, so a key spelled with escapes (`"\u0075sage"`) is not
//! recognised; no provider writes keys that way.

use memchr::memchr2;

/// Most bytes one captured value may hold; a bigger one is dropped.
pub(super) const MAX_CAPTURE: usize = 64 * 1024;

/// Longest key compared; a longer one selects nothing.
const MAX_KEY: usize = 64;

/// Which values of a document to capture, as a tree of the paths leading to them.
#[derive(Debug)]
pub(crate) struct Select<T: 'static> {
    /// Capture this value whole, tagged.
    capture: Option<T>,
    /// If it is an object, the members to look into.
    keys: &'static [(&'static str, Select<T>)],
    /// If it is an array, the elements to look into (this wins over `capture` for an array).
    items: Option<Items<T>>,
    /// Told (with an empty value) when an object looked into under this selection closes.
    done: Option<T>,
    /// Hand the value over to the walker, tagged.
    walk: Option<T>,
}

#[derive(Debug)]
struct Items<T: 'static> {
    /// Only the element at this index; every element when `None`.
    index: Option<u32>,
    select: &'static Select<T>,
}

impl<T: Copy + 'static> Select<T> {
    /// Capture the value here.
    pub(crate) const fn capture(tag: T) -> Self {
        Self {
            capture: Some(tag),
            keys: &[],
            items: None,
            done: None,
            walk: None,
        }
    }

    /// Look into these members of an object.
    pub(crate) const fn keys(keys: &'static [(&'static str, Select<T>)]) -> Self {
        Self {
            capture: None,
            keys,
            items: None,
            done: None,
            walk: None,
        }
    }

    /// Look into the first element of an array.
    pub(crate) const fn first(element: &'static Select<T>) -> Self {
        Self {
            capture: None,
            keys: &[],
            items: Some(Items {
                index: Some(0),
                select: element,
            }),
            done: None,
            walk: None,
        }
    }

    /// Look into every element of an array.
    pub(crate) const fn each(element: &'static Select<T>) -> Self {
        Self {
            capture: None,
            keys: &[],
            items: Some(Items {
                index: None,
                select: element,
            }),
            done: None,
            walk: None,
        }
    }

    /// Look into every element of an array; any other value (a string) is captured whole.
    #[cfg(test)]
    pub(crate) const fn each_or_capture(tag: T, element: &'static Select<T>) -> Self {
        Self {
            capture: Some(tag),
            keys: &[],
            items: Some(Items {
                index: None,
                select: element,
            }),
            done: None,
            walk: None,
        }
    }

    /// Hand the value over, tagged, to the walker given to [`Scanner::feed_walking`]: it reads
    /// the value in place and says where it ends. Without a walker (or when it declines), the
    /// value is crossed unread.
    pub(crate) const fn walk(tag: T) -> Self {
        Self {
            capture: None,
            keys: &[],
            items: None,
            done: None,
            walk: Some(tag),
        }
    }

    /// The same selection, telling `tag` when an object it looked into closes.
    #[cfg(test)]
    pub(crate) const fn ended(self, tag: T) -> Self {
        Self {
            done: Some(tag),
            ..self
        }
    }

    /// A document: one object selected by `object`, or an array of such objects (how Gemini
    /// streams without SSE), each selected alike.
    pub(crate) const fn document(object: &'static Select<T>) -> Self {
        Self {
            capture: None,
            keys: object.keys,
            items: Some(Items {
                index: None,
                select: object,
            }),
            done: None,
            walk: None,
        }
    }

    fn member(&self, key: &[u8]) -> Option<&Select<T>> {
        self.keys
            .iter()
            .find(|(k, _)| k.as_bytes() == key)
            .map(|(_, s)| s)
    }
}

/// The scanner's state between frames.
#[derive(Debug)]
pub(crate) struct Scanner<T: 'static> {
    root: &'static Select<T>,
    /// Containers being looked into, outermost first.
    stack: Vec<Frame<T>>,
    mode: Mode,
    /// The key being read (its first `MAX_KEY` bytes, escapes raw; inline, as every object
    /// member has one) and its full length.
    key: [u8; MAX_KEY],
    key_len: usize,
    /// The tag of the value being captured.
    capture: Option<T>,
    /// Where the capture starts in the current frame (0 when it started in an earlier one).
    capture_from: usize,
    /// Bytes of the capture from earlier frames, while they fit in `MAX_CAPTURE`.
    captured: Vec<u8>,
    /// Full length of the capture from earlier frames.
    captured_len: usize,
    /// Most bytes one captured value may hold; a bigger one is dropped.
    limit: usize,
}

#[derive(Debug)]
struct Frame<T: 'static> {
    select: &'static Select<T>,
    object: bool,
    /// In an array, the index of the current element.
    index: u32,
    /// In an object, the selection of the current member's value.
    member: Option<&'static Select<T>>,
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    /// Expecting a value.
    Value,
    /// In an object, expecting a key or `}`.
    Key,
    /// Inside a key; `escaped` right after a backslash.
    KeyText { escaped: bool },
    /// After a key, expecting `:`.
    Colon,
    /// After a value, expecting `,` or a closing bracket.
    After,
    /// Inside a value that is not looked into: skipped, or captured whole.
    Skip(Skip),
}

#[derive(Debug, Clone, Copy, Default)]
struct Skip {
    /// Open brackets inside the value.
    depth: u32,
    /// Inside a string.
    text: bool,
    /// Right after a backslash in a string.
    escaped: bool,
    /// A number or literal, which ends at the first delimiter.
    bare: bool,
}

impl<T: Copy + 'static> Scanner<T> {
    pub(crate) fn new(root: &'static Select<T>) -> Self {
        Self {
            root,
            // Deep enough for every selection we make: one allocation, never grown.
            stack: Vec::with_capacity(4),
            mode: Mode::Value,
            key: [0; MAX_KEY],
            key_len: 0,
            capture: None,
            capture_from: 0,
            captured: Vec::new(),
            captured_len: 0,
            limit: MAX_CAPTURE,
        }
    }

    /// A scanner whose captures may hold up to `limit` bytes: for a document fed whole in one
    /// frame (a request body), whose captures are handed over in place, never copied.
    #[cfg(test)]
    pub(crate) fn with_limit(root: &'static Select<T>, limit: usize) -> Self {
        Self {
            limit,
            ..Self::new(root)
        }
    }

    /// Looks for `root` instead, from the start of the next document (a scanner made before it
    /// knew all it must read: its stack's allocation kept).
    pub(crate) fn reselect(&mut self, root: &'static Select<T>) {
        self.stack.clear();
        self.mode = Mode::Value;
        self.capture = None;
        self.root = root;
    }

    /// Containers being looked into (for the tests comparing readers).
    #[cfg(test)]
    pub(crate) fn depth(&self) -> usize {
        self.stack.len()
    }

    /// Reads one frame, calling `sink` with each selected value it completes.
    pub(crate) fn feed(&mut self, frame: &[u8], sink: &mut impl FnMut(T, &[u8])) {
        self.feed_walking(frame, sink, &mut |_, _| None);
    }

    /// [`Scanner::feed`], handing each value selected by [`Select::walk`] to `walk`, with the
    /// rest of the frame from its first byte: `walk` returns how many bytes the value took (the
    /// scan goes on after them), or None to have it crossed unread. For a document whole in one
    /// frame: a value the frame cuts is the walker's to judge.
    pub(crate) fn feed_walking(
        &mut self,
        frame: &[u8],
        sink: &mut impl FnMut(T, &[u8]),
        walk: &mut impl FnMut(T, &[u8]) -> Option<usize>,
    ) {
        self.capture_from = 0;
        let mut i = 0;
        while i < frame.len() {
            i = match self.mode {
                Mode::Value => self.value(frame, i, sink, walk),
                Mode::Skip(skip) => self.skip(frame, i, skip, sink),
                Mode::KeyText { escaped } => self.key_text(frame, i, escaped),
                Mode::Key => {
                    match frame[i] {
                        b'"' => {
                            self.key_len = 0;
                            self.mode = Mode::KeyText { escaped: false };
                        }
                        b'}' => self.close(sink),
                        _ => {} // whitespace, or a stray byte of malformed input
                    }
                    i + 1
                }
                Mode::Colon => {
                    match frame[i] {
                        b':' => self.mode = Mode::Value,
                        b'}' => self.close(sink),
                        _ => {}
                    }
                    i + 1
                }
                Mode::After => {
                    match frame[i] {
                        b',' => self.next(),
                        b'}' | b']' => self.close(sink),
                        _ => {}
                    }
                    i + 1
                }
            };
        }
        if self.capture.is_some() {
            self.keep(&frame[self.capture_from..]);
        }
    }

    /// The first byte of a value (or whitespace before it) at `frame[i]`.
    fn value(
        &mut self,
        frame: &[u8],
        i: usize,
        sink: &mut impl FnMut(T, &[u8]),
        walk: &mut impl FnMut(T, &[u8]) -> Option<usize>,
    ) -> usize {
        let b = frame[i];
        match b {
            // Whitespace; `,` and `:` here are malformed and dropped.
            b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' => return i + 1,
            // `[]`, or malformed input.
            b'}' | b']' => {
                self.close(sink);
                return i + 1;
            }
            _ => {}
        }
        let select = self.selected();
        if let Some(select) = select {
            if let Some(taken) = select.walk.and_then(|tag| walk(tag, &frame[i..])) {
                self.end_value();
                // At least the first byte, at most the frame.
                return i + taken.clamp(1, frame.len() - i);
            }
            let look_into_array = b == b'[' && select.items.is_some();
            if let Some(tag) = select.capture.filter(|_| !look_into_array) {
                self.capture = Some(tag);
                self.capture_from = i;
                self.captured.clear();
                self.captured_len = 0;
            } else if b == b'{' && !select.keys.is_empty() {
                self.stack.push(Frame {
                    select,
                    object: true,
                    index: 0,
                    member: None,
                });
                self.mode = Mode::Key;
                return i + 1;
            } else if look_into_array {
                self.stack.push(Frame {
                    select,
                    object: false,
                    index: 0,
                    member: None,
                });
                return i + 1;
            }
        }
        let skip = Skip::default();
        match b {
            b'{' | b'[' => {
                self.mode = Mode::Skip(Skip { depth: 1, ..skip });
                i + 1
            }
            b'"' => {
                self.mode = Mode::Skip(Skip { text: true, ..skip });
                i + 1
            }
            // A number or literal: its first byte is not a delimiter (all are matched above),
            // so the skip makes progress.
            _ => {
                self.mode = Mode::Skip(Skip { bare: true, ..skip });
                i
            }
        }
    }

    /// What selects the value starting now, if anything.
    fn selected(&self) -> Option<&'static Select<T>> {
        match self.stack.last() {
            None => Some(self.root),
            Some(frame) if frame.object => frame.member,
            Some(frame) => {
                let items = frame.select.items.as_ref()?;
                items
                    .index
                    .is_none_or(|k| k == frame.index)
                    .then_some(items.select)
            }
        }
    }

    /// Consumes a value that is not looked into (skipped or captured), from `frame[i]` to its end
    /// or the frame's.
    fn skip(
        &mut self,
        frame: &[u8],
        mut i: usize,
        mut s: Skip,
        sink: &mut impl FnMut(T, &[u8]),
    ) -> usize {
        let end = loop {
            if s.text {
                if s.escaped {
                    if i >= frame.len() {
                        break None;
                    }
                    s.escaped = false;
                    i += 1;
                }
                let Some(off) = memchr2(b'"', b'\\', &frame[i..]) else {
                    break None;
                };
                let at = i + off;
                i = at + 1;
                if frame[at] == b'\\' {
                    s.escaped = true;
                } else {
                    s.text = false;
                    if s.depth == 0 {
                        break Some(i);
                    }
                }
            } else if s.bare {
                let Some(off) = frame[i..].iter().position(|&b| is_delimiter(b)) else {
                    break None;
                };
                break Some(i + off); // the delimiter is not part of the value
            } else {
                while i < frame.len() && !s.text {
                    let b = frame[i];
                    i += 1;
                    match b {
                        b'"' => s.text = true,
                        b'{' | b'[' => s.depth = s.depth.saturating_add(1),
                        b'}' | b']' => s.depth = s.depth.saturating_sub(1),
                        _ => continue,
                    }
                    if s.depth == 0 {
                        break;
                    }
                }
                if s.depth == 0 && !s.text {
                    break Some(i);
                }
                if !s.text {
                    break None;
                }
            }
        };
        match end {
            Some(end) => {
                if let Some(tag) = self.capture.take() {
                    self.captured(tag, &frame[self.capture_from..end], sink);
                }
                self.end_value();
                end
            }
            None => {
                self.mode = Mode::Skip(s);
                frame.len()
            }
        }
    }

    /// Reads key bytes from `frame[i]` to the closing quote or the frame's end.
    fn key_text(&mut self, frame: &[u8], mut i: usize, mut escaped: bool) -> usize {
        loop {
            if escaped {
                let Some(&b) = frame.get(i) else { break };
                self.key_push(&[b]);
                escaped = false;
                i += 1;
            }
            let Some(off) = memchr2(b'"', b'\\', &frame[i..]) else {
                self.key_push(&frame[i..]);
                i = frame.len();
                break;
            };
            let at = i + off;
            self.key_push(&frame[i..at]);
            if frame[at] == b'"' {
                let member = match self.stack.last() {
                    Some(frame) if self.key_len <= MAX_KEY => {
                        frame.select.member(&self.key[..self.key_len])
                    }
                    _ => None,
                };
                if let Some(frame) = self.stack.last_mut() {
                    frame.member = member;
                }
                self.mode = Mode::Colon;
                return at + 1;
            }
            self.key_push(b"\\");
            escaped = true;
            i = at + 1;
        }
        self.mode = Mode::KeyText { escaped };
        i
    }

    fn key_push(&mut self, bytes: &[u8]) {
        let end = self.key_len.saturating_add(bytes.len());
        if end <= MAX_KEY {
            self.key[self.key_len..end].copy_from_slice(bytes);
        }
        self.key_len = end;
    }

    /// A `,` after a value.
    fn next(&mut self) {
        match self.stack.last_mut() {
            Some(frame) if frame.object => {
                frame.member = None;
                self.mode = Mode::Key;
            }
            Some(frame) => {
                frame.index = frame.index.saturating_add(1);
                self.mode = Mode::Value;
            }
            None => self.mode = Mode::Value,
        }
    }

    /// A closing bracket of a container being looked into; tells its selection's `done`.
    fn close(&mut self, sink: &mut impl FnMut(T, &[u8])) {
        let done = self
            .stack
            .pop()
            .and_then(|f| f.select.done.filter(|_| f.object));
        self.end_value();
        if let Some(tag) = done {
            sink(tag, &[]);
        }
    }

    fn end_value(&mut self) {
        // At the top level, whatever follows is read as another document.
        self.mode = if self.stack.is_empty() {
            Mode::Value
        } else {
            Mode::After
        };
    }

    /// Keeps capture bytes across frames, dropping them once the capture is too big.
    fn keep(&mut self, bytes: &[u8]) {
        self.captured_len = self.captured_len.saturating_add(bytes.len());
        if self.captured_len <= self.limit {
            self.captured.extend_from_slice(bytes);
        } else {
            self.captured = Vec::new();
        }
    }

    /// A capture ended with `tail`, its bytes in the current frame.
    fn captured(&mut self, tag: T, tail: &[u8], sink: &mut impl FnMut(T, &[u8])) {
        if self.captured_len == 0 {
            // Whole within this frame: handed over in place.
            if tail.len() <= self.limit {
                sink(tag, tail);
            }
        } else {
            self.keep(tail);
            if self.captured_len <= self.limit {
                sink(tag, &self.captured);
            }
            self.captured.clear();
            self.captured_len = 0;
        }
    }
}

fn is_delimiter(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' | b'{' | b'}' | b'[' | b']' | b'"'
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Tag {
        Model,
        Usage,
        Reason,
        Number,
    }

    const CHOICE: Select<Tag> = Select::keys(&[("finish_reason", Select::capture(Tag::Reason))]);
    const NESTED: Select<Tag> = Select::keys(&[("n", Select::capture(Tag::Number))]);
    const OBJECT: Select<Tag> = Select::keys(&[
        ("model", Select::capture(Tag::Model)),
        ("usage", Select::capture(Tag::Usage)),
        ("choices", Select::first(&CHOICE)),
        ("deep", NESTED),
    ]);
    static DOC: Select<Tag> = Select::document(&OBJECT);

    fn scan(frames: &[&[u8]]) -> Vec<(Tag, String)> {
        let mut scanner = Scanner::new(&DOC);
        let mut out = Vec::new();
        for frame in frames {
            scanner.feed(frame, &mut |tag, value: &[u8]| {
                out.push((tag, String::from_utf8_lossy(value).into_owned()));
            });
        }
        out
    }

    /// Scans `doc` whole, then cut at every pair of places, expecting the same captures.
    fn scan_cut(doc: &str) -> Vec<(Tag, String)> {
        let doc = doc.as_bytes();
        let whole = scan(&[doc]);
        for i in 0..=doc.len() {
            for j in i..=doc.len() {
                assert_eq!(
                    scan(&[&doc[..i], &doc[i..j], &doc[j..]]),
                    whole,
                    "cut at {i} and {j}"
                );
            }
        }
        whole
    }

    fn caps(expected: &[(Tag, &str)]) -> Vec<(Tag, String)> {
        expected
            .iter()
            .map(|(t, v)| (*t, (*v).to_owned()))
            .collect()
    }

    #[test]
    fn captures_selected_values_only() {
        let doc = r#"{"id":"x","model":"gpt-4o","choices":[{"index":0,"message":{"model":"no","usage":1},"finish_reason":"stop"},{"finish_reason":"length"}],"usage":{"prompt_tokens":3,"details":{"a":[1,2]}}}"#;
        assert_eq!(
            scan_cut(doc),
            caps(&[
                (Tag::Model, r#""gpt-4o""#),
                (Tag::Reason, r#""stop""#),
                (Tag::Usage, r#"{"prompt_tokens":3,"details":{"a":[1,2]}}"#),
            ])
        );
    }

    #[test]
    fn strings_hide_brackets_quotes_and_keys() {
        let doc = r#"{"content":"}{][\" \"usage\": {\"model\":1} \\","x":["]",{"}":"{"}],"model":"m\"1\\"}"#;
        assert_eq!(scan_cut(doc), caps(&[(Tag::Model, r#""m\"1\\""#)]));
    }

    #[test]
    fn escaped_keys_are_not_recognised() {
        assert_eq!(
            scan(&[br#"{"mod\u0065l":"a","\"model\"":"b","model":"c"}"#]),
            caps(&[(Tag::Model, r#""c""#)])
        );
    }

    #[test]
    fn numbers_and_literals_end_at_delimiters() {
        let doc = "{\"deep\":{\"n\":-12.5e+3},\"model\":null ,\"usage\":true}\n";
        assert_eq!(
            scan_cut(doc),
            caps(&[
                (Tag::Number, "-12.5e+3"),
                (Tag::Model, "null"),
                (Tag::Usage, "true")
            ])
        );
    }

    #[test]
    fn only_the_first_element_is_looked_into() {
        let doc = r#"{"choices":[[{"finish_reason":"a"}],{"finish_reason":"b"}],"model":"m"}"#;
        assert_eq!(scan_cut(doc), caps(&[(Tag::Model, r#""m""#)]));
        let doc = r#"{"choices":[],"model":"m","choices":[{}, {"finish_reason":"b"}]}"#;
        assert_eq!(scan_cut(doc), caps(&[(Tag::Model, r#""m""#)]));
    }

    #[test]
    fn a_top_level_array_is_a_stream_of_documents() {
        let doc = "[{\"model\":\"a\",\"usage\":{\"n\":1}}\n,\r\n{\"model\":\"b\",\"choices\":[{\"finish_reason\":\"STOP\"}],\"usage\":{\"n\":2}}\n]";
        assert_eq!(
            scan_cut(doc),
            caps(&[
                (Tag::Model, r#""a""#),
                (Tag::Usage, r#"{"n":1}"#),
                (Tag::Model, r#""b""#),
                (Tag::Reason, r#""STOP""#),
                (Tag::Usage, r#"{"n":2}"#),
            ])
        );
        // Deeper arrays are not documents.
        assert_eq!(
            scan(&[br#"[[{"model":"x"}],{"model":"y"}]"#]),
            caps(&[(Tag::Model, r#""y""#)])
        );
    }

    #[test]
    fn multi_byte_characters_survive_any_cut() {
        let doc = r#"{"content":"h\u00e9llo — 日本語 🎉","model":"é🎉\u00e9"}"#;
        assert_eq!(scan_cut(doc), caps(&[(Tag::Model, r#""é🎉\u00e9""#)]));
    }

    #[test]
    fn oversized_captures_are_dropped() {
        let big = format!(
            "{{\"usage\":\"{}\",\"model\":\"m\"}}",
            "x".repeat(MAX_CAPTURE)
        );
        let want = caps(&[(Tag::Model, r#""m""#)]);
        assert_eq!(scan(&[big.as_bytes()]), want);
        let pieces: Vec<&[u8]> = big.as_bytes().chunks(1000).collect();
        assert_eq!(scan(&pieces), want);
    }

    #[test]
    fn the_stack_stays_shallow() {
        let mut doc = "[".repeat(10_000);
        doc.push_str(&"]".repeat(10_000));
        doc.push_str(r#"{"model":"after"}"#);
        let mut scanner = Scanner::new(&DOC);
        let mut out = Vec::new();
        scanner.feed(doc.as_bytes(), &mut |tag, _: &[u8]| out.push(tag));
        assert!(scanner.stack.len() <= 1);
        assert_eq!(out, vec![Tag::Model]);
    }

    const TURN: Select<Tag> = Select::keys(&[
        ("model", Select::capture(Tag::Model)),
        ("usage", Select::capture(Tag::Usage)),
    ])
    .ended(Tag::Number);
    static TURNS: Select<Tag> = Select::keys(&[
        ("list", Select::each(&TURN)),
        ("either", Select::each_or_capture(Tag::Reason, &TURN)),
    ]);

    fn scan_turns(doc: &str) -> Vec<(Tag, String)> {
        let mut scanner = Scanner::with_limit(&TURNS, doc.len());
        let mut out = Vec::new();
        scanner.feed(doc.as_bytes(), &mut |tag, value: &[u8]| {
            out.push((tag, String::from_utf8_lossy(value).into_owned()));
        });
        out
    }

    #[test]
    fn each_element_is_looked_into_and_its_end_told() {
        let doc = r#"{"list":[{"model":"a","x":[{"usage":1}]},{},"s",{"usage":{"n":2}}],"either":"plain"}"#;
        assert_eq!(
            scan_turns(doc),
            caps(&[
                (Tag::Model, r#""a""#),
                (Tag::Number, ""),
                (Tag::Number, ""),
                (Tag::Usage, r#"{"n":2}"#),
                (Tag::Number, ""),
                (Tag::Reason, r#""plain""#),
            ])
        );
        let doc = r#"{"either":[{"model":"b"}]}"#;
        assert_eq!(
            scan_turns(doc),
            caps(&[(Tag::Model, r#""b""#), (Tag::Number, "")])
        );
    }

    #[test]
    fn a_larger_limit_captures_large_values_in_place() {
        let big = "y".repeat(MAX_CAPTURE * 2);
        let doc = format!(r#"{{"list":[{{"model":"{big}"}}]}}"#);
        let got = scan_turns(&doc);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].1.len(), big.len() + 2);
    }

    proptest! {
        #[test]
        fn garbage_is_harmless(bytes in proptest::collection::vec(any::<u8>(), 0..512), cut in any::<prop::sample::Index>()) {
            let at = cut.index(bytes.len() + 1);
            scan(&[&bytes[..at], &bytes[at..]]);
        }

        #[test]
        fn json_like_garbage_is_harmless(text in r#"[\[\]{}",:\\ a0-9eu]{0,200}"#, cut in any::<prop::sample::Index>()) {
            let bytes = text.as_bytes();
            let at = cut.index(bytes.len() + 1);
            prop_assert_eq!(scan(&[&bytes[..at], &bytes[at..]]), scan(&[bytes]));
        }
    }
}
