//! The access log: one line per proxied request an upstream answered, `request completed`,
//! written once when the request ends ([`crate::event`]) from its record, into a reused
//! per-thread buffer, and queued to the process's log output ([`super::lines`]).
//!
//! It reads like the `tracing` lines around it (same timestamp, level, target, layout, text or
//! JSON), and obeys the same filter: `NM_LOG=warn`, or `nm_dataplane::event=warn`, turns it off,
//! and then nothing is formatted. The request's fields are its `request` span's (named as the
//! span names them), followed by the line's own (`http.response.status_code`, `latency_ms`,
//! `bytes`, `ending`). Only what the request knew is written: an absent model or session is left
//! out, not written empty. Values from the client (model, agent, session) are quoted and escaped,
//! so no value can forge a line or a field.

use std::cell::RefCell;
use std::time::SystemTime;

use nm_types::record::{HexDigits, TraceRef};

use super::lines::LogLines;
use crate::records::RequestRecord;

/// The target the access line is logged under (the filter's name for it).
pub const TARGET: &str = "nm_dataplane::event";

/// The line's own message.
const MESSAGE: &str = "request completed";

/// How lines are written: as `tracing`'s default text formatter, or its JSON one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Where access lines go. Cheap to clone; [`AccessLog::off`] writes nothing.
#[derive(Debug, Clone, Default)]
pub struct AccessLog {
    lines: Option<LogLines>,
    format: LogFormat,
}

/// One access line's values: the finished request's record and what the record does not hold.
#[derive(Debug, Clone, Copy)]
pub struct AccessLine<'a> {
    pub record: &'a RequestRecord,
    /// `http.route`: the matched template.
    pub route: &'static str,
    /// The ids the request's log span carries (its SERVER span's, sampled or not).
    pub ids: Option<&'a TraceRef>,
    /// How the answer ended: `Complete`, `UpstreamError`, `ClientGone`.
    pub ending: &'static str,
}

thread_local! {
    /// The line being written, reused by every request the thread ends.
    static LINE: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(1024));
    /// The timestamp's whole-second part, `YYYY-MM-DDTHH:MM:SS`, for the second it was made.
    static SECOND: RefCell<(u64, [u8; 19])> = const { RefCell::new((u64::MAX, [0; 19])) };
}

impl AccessLog {
    /// Access lines in `format` to `lines`.
    pub fn new(lines: LogLines, format: LogFormat) -> Self {
        Self {
            lines: Some(lines),
            format,
        }
    }

    /// No access log (a process without a log output: unit tests, embedded use).
    pub fn off() -> Self {
        Self::default()
    }

    /// The log output, to read its drop count.
    pub fn lines(&self) -> Option<&LogLines> {
        self.lines.as_ref()
    }

    /// Writes the line, unless the log filter turns INFO off for [`TARGET`].
    pub fn write(&self, line: &AccessLine<'_>) {
        let Some(lines) = &self.lines else {
            return;
        };
        if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
            return;
        }
        LINE.with_borrow_mut(|buf| {
            buf.clear();
            format(buf, self.format, line, SystemTime::now());
            lines.write_line(buf);
        });
    }

    /// Writes a line of a request's own (the caller checked the filter).
    pub(crate) fn write_shape<S: Fields, E: Fields>(&self, shape: &Shape<'_, S, E>) {
        let Some(lines) = &self.lines else {
            return;
        };
        LINE.with_borrow_mut(|buf| {
            buf.clear();
            shape.write(buf, self.format, SystemTime::now());
            lines.write_line(buf);
        });
    }
}

/// Writes `line` at `now` into `out`, newline included.
pub fn format(out: &mut Vec<u8>, format: LogFormat, line: &AccessLine<'_>, now: SystemTime) {
    let span = AccessSpan {
        line,
        hex: Hex::of(line.ids),
    };
    Shape {
        level: tracing::Level::INFO,
        target: TARGET,
        message: MESSAGE,
        span: &span,
        event: line,
    }
    .write(out, format, now);
}

/// A field's value, as the `tracing` formatters write it.
#[derive(Clone, Copy)]
pub enum Val<'a> {
    /// A string value: quoted (text) or a JSON string.
    Str(&'a str),
    /// A value recorded for display (`%`): bare in text, a JSON string.
    Bare(&'a str),
    Num(u64),
    /// A value recorded for display (`%`) that is not a string yet.
    Show(&'a dyn std::fmt::Display),
}

/// The fields of a line, its span's or its own, handed to `f` in order.
pub(crate) trait Fields {
    fn each<'a>(&'a self, f: &mut impl FnMut(&'static str, Val<'a>));
}

/// A line in the `request` span, laid out as `tracing`'s formatters lay out an event in a span.
pub(crate) struct Shape<'a, S, E> {
    pub level: tracing::Level,
    /// Ours, written as they are (no escaping).
    pub target: &'static str,
    pub message: &'static str,
    /// The `request` span's fields.
    pub span: &'a S,
    /// The line's own fields, after its message.
    pub event: &'a E,
}

impl<S: Fields, E: Fields> Shape<'_, S, E> {
    /// Writes the line at `now` into `out`, newline included.
    pub(crate) fn write(&self, out: &mut Vec<u8>, format: LogFormat, now: SystemTime) {
        match format {
            LogFormat::Text => text(out, self, now),
            LogFormat::Json => json(out, self, now),
        }
    }
}

/// The access line's span fields: the request span's, in the order of its declaration
/// ([`crate::log::RequestLog`]), those the request learnt, and the outcome's.
struct AccessSpan<'a> {
    line: &'a AccessLine<'a>,
    hex: Hex,
}

impl Fields for AccessSpan<'_> {
    fn each<'a>(&'a self, f: &mut impl FnMut(&'static str, Val<'a>)) {
        let r = self.line.record;
        f("nm.request_id", Val::Str(&r.request_id));
        if let Some((trace, span)) = &self.hex.0 {
            f("trace_id", Val::Str(trace.as_str()));
            f("span_id", Val::Str(span.as_str()));
        }
        f("http.request.method", Val::Bare(&r.method));
        f("http.route", Val::Str(self.line.route));
        f("gen_ai.provider.name", Val::Str(&r.provider));
        if let Some(m) = &r.model {
            f("gen_ai.request.model", Val::Str(m));
        }
        if let Some(a) = &r.agent {
            f("nm.agent", Val::Str(a));
        }
        if let Some(s) = &r.session_id {
            f("nm.session", Val::Str(s.as_str()));
        }
        if let Some(e) = r.env {
            f("nm.env", Val::Str(e.as_str()));
        }
        if let Some(v) = &r.variant {
            f("nm.experiment", Val::Str(&v.experiment));
            f("nm.arm", Val::Str(&v.arm));
        }
        f("nm.key_id", Val::Str(&r.key_id));
        f("http.response.status_code", Val::Num(r.status.into()));
        f("nm.latency_ms", Val::Num(r.latency_ms));
        if let Some(m) = &r.usage.model {
            f("gen_ai.response.model", Val::Str(m));
        }
        if let Some(t) = r.usage.input_tokens {
            f("gen_ai.usage.input_tokens", Val::Num(t));
        }
        if let Some(t) = r.usage.output_tokens {
            f("gen_ai.usage.output_tokens", Val::Num(t));
        }
        if let Some(c) = r.cost_micros {
            f("nm.cost_micros", Val::Num(c));
        }
    }
}

/// The access line's own fields, after its message.
impl Fields for AccessLine<'_> {
    fn each<'a>(&'a self, f: &mut impl FnMut(&'static str, Val<'a>)) {
        let r = self.record;
        f("http.response.status_code", Val::Num(r.status.into()));
        f("latency_ms", Val::Num(r.latency_ms));
        f("bytes", Val::Num(r.response_bytes));
        f("ending", Val::Bare(self.ending));
    }
}

/// `2026-11-28T20:31:28.123456Z  INFO request{nm.request_id="…" …}: nm_dataplane::event:
/// request completed http.response.status_code=200 latency_ms=3 bytes=314 ending=Complete`
fn text<S: Fields, E: Fields>(out: &mut Vec<u8>, line: &Shape<'_, S, E>, now: SystemTime) {
    timestamp(out, now);
    out.push(b' ');
    // The level right-aligned in five columns, as the text formatter pads it.
    out.extend_from_slice(match line.level {
        tracing::Level::TRACE => b"TRACE",
        tracing::Level::DEBUG => b"DEBUG",
        tracing::Level::INFO => b" INFO",
        tracing::Level::WARN => b" WARN",
        tracing::Level::ERROR => b"ERROR",
    });
    out.extend_from_slice(b" request{");
    let mut first = true;
    line.span.each(&mut |name, v| {
        if !first {
            out.push(b' ');
        }
        first = false;
        text_field(out, name, v);
    });
    out.extend_from_slice(b"}: ");
    out.extend_from_slice(line.target.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(line.message.as_bytes());
    line.event.each(&mut |name, v| {
        out.push(b' ');
        text_field(out, name, v);
    });
    out.push(b'\n');
}

fn text_field(out: &mut Vec<u8>, name: &str, v: Val<'_>) {
    out.extend_from_slice(name.as_bytes());
    out.push(b'=');
    match v {
        Val::Str(s) => quoted(out, s),
        Val::Bare(s) => out.extend_from_slice(s.as_bytes()),
        Val::Num(n) => out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes()),
        // Bare, as the text formatter writes a `%` value, but with its control characters
        // escaped: an error's text may quote what a client sent, and must not end the line.
        Val::Show(d) => {
            for c in d.to_string().chars() {
                if c.is_control() {
                    out.extend_from_slice(c.escape_debug().to_string().as_bytes());
                } else {
                    let mut utf8 = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
                }
            }
        }
    }
}

/// `{"timestamp":"…","level":"INFO","message":"request completed",<fields>,"target":"…",
/// "span":{<span fields>,"name":"request"}}`, the layout of the JSON formatter with the event
/// flattened and the current span.
fn json<S: Fields, E: Fields>(out: &mut Vec<u8>, line: &Shape<'_, S, E>, now: SystemTime) {
    out.extend_from_slice(b"{\"timestamp\":\"");
    timestamp(out, now);
    out.extend_from_slice(b"\",\"level\":\"");
    out.extend_from_slice(line.level.as_str().as_bytes());
    out.extend_from_slice(b"\",\"message\":\"");
    out.extend_from_slice(line.message.as_bytes());
    out.push(b'"');
    line.event.each(&mut |name, v| {
        out.push(b',');
        json_field(out, name, v);
    });
    out.extend_from_slice(b",\"target\":\"");
    out.extend_from_slice(line.target.as_bytes());
    out.extend_from_slice(b"\",\"span\":{");
    line.span.each(&mut |name, v| {
        json_field(out, name, v);
        out.push(b',');
    });
    out.extend_from_slice(b"\"name\":\"request\"}}\n");
}

/// A field; its name is one of ours, which needs no escaping.
fn json_field(out: &mut Vec<u8>, name: &str, v: Val<'_>) {
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\":");
    match v {
        Val::Str(s) | Val::Bare(s) => json_string(out, s),
        Val::Num(n) => out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes()),
        Val::Show(d) => json_string(out, &d.to_string()),
    }
}

/// A JSON string, escaped by serde_json's escaper.
fn json_string(out: &mut Vec<u8>, s: &str) {
    // Writing a `&str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// A text value in double quotes, escaped as Rust's `Debug` escapes a `str`: quotes,
/// backslashes, and control characters (C0, DEL and C1) are written as escapes, so a value
/// cannot end its field, its line, or send a terminal a control sequence.
fn quoted(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_debug(s, |piece| out.extend_from_slice(piece.as_bytes()));
    out.push(b'"');
}

/// Bytes that end a plain run: `"`, `\`, C0 controls, DEL, and 0xC2 (the lead byte of the C1
/// controls, U+0080..U+009F, and of other characters, which pass).
const STOPS: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t[0x7f] = true;
    t[0xc2] = true;
    t
};

/// `s` escaped as `Debug` escapes a `str` (without the quotes), handed to `put` in pieces:
/// plain runs as they are, each escape on its own.
pub fn escape_debug(s: &str, mut put: impl FnMut(&str)) {
    let bytes = s.as_bytes();
    // Most values are plain printable ASCII: one pass without early exit (which the compiler
    // vectorises) finds that, and the value goes out whole.
    let plain_ascii = !bytes.iter().fold(false, |stop, &b| {
        stop | (b < 0x20) | (b == b'"') | (b == b'\\') | (b >= 0x7f)
    });
    if plain_ascii {
        put(s);
        return;
    }
    let mut plain = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !STOPS[usize::from(b)] {
            i += 1;
            continue;
        }
        let (len, code) = match (b, bytes.get(i + 1)) {
            // U+0080..U+009F are 0xC2 0x80..0x9F; other characters led by 0xC2 pass.
            (0xc2, Some(&next @ 0x80..=0x9f)) => (2, next),
            (0xc2, _) => {
                i += 1;
                continue;
            }
            _ => (1, b),
        };
        put(&s[plain..i]);
        match code {
            b'"' => put("\\\""),
            b'\\' => put("\\\\"),
            b'\n' => put("\\n"),
            b'\r' => put("\\r"),
            b'\t' => put("\\t"),
            0 => put("\\0"),
            c => {
                const DIGITS: &[u8; 16] = b"0123456789abcdef";
                let mut buf = *b"\\u{00}";
                buf[3] = DIGITS[usize::from(c >> 4)];
                buf[4] = DIGITS[usize::from(c & 0xf)];
                // No leading zero, as `Debug` writes them: `\u{1b}`, `\u{7}`.
                if c < 0x10 {
                    buf.copy_within(4..6, 3);
                    put(std::str::from_utf8(&buf[..5]).unwrap_or_default());
                } else {
                    put(std::str::from_utf8(&buf).unwrap_or_default());
                }
            }
        }
        i += len;
        plain = i;
    }
    put(&s[plain..]);
}

/// A trace's ids in hex digits, made on the stack.
struct Hex(Option<(HexDigits<32>, HexDigits<16>)>);

impl Hex {
    fn of(ids: Option<&TraceRef>) -> Self {
        Self(ids.map(|t| (t.trace_digits(), t.span_digits())))
    }
}

/// RFC 3339 UTC with microseconds, as `tracing`'s default timer writes it:
/// `2026-11-28T20:31:28.123456Z`. The date and time of day are made once a second per thread.
fn timestamp(out: &mut Vec<u8>, now: SystemTime) {
    let since = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    SECOND.with_borrow_mut(|(second, text)| {
        if *second != secs {
            *second = secs;
            *text = civil(secs);
        }
        out.extend_from_slice(text);
    });
    out.push(b'.');
    let micros = since.subsec_micros();
    let mut digits = [b'0'; 6];
    let mut n = micros;
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out.extend_from_slice(&digits);
    out.push(b'Z');
}

/// `YYYY-MM-DDTHH:MM:SS` of a Unix time (the days-to-civil algorithm of H. Hinnant's
/// `chrono`-compatible date library, proleptic Gregorian, years 1970..=9999).
fn civil(secs: u64) -> [u8; 19] {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Days since 0000-03-01.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = (yoe + era * 400 + u64::from(month <= 2)).min(9999);
    let mut t = *b"0000-00-00T00:00:00";
    let mut put = |at: usize, width: usize, mut v: u64| {
        for i in (at..at + width).rev() {
            t[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, 4, year);
    put(5, 2, month);
    put(8, 2, day);
    put(11, 2, hour);
    put(14, 2, minute);
    put(17, 2, second);
    t
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::sync::Arc;
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::records::UsageStatus;

    fn record() -> RequestRecord {
        let mut r = crate::records::started(
            "req-1".to_owned(),
            SystemTime::UNIX_EPOCH,
            Arc::from("key-1"),
            Arc::from("openai"),
            &http::Method::POST,
            "/v1/chat/completions".to_owned(),
        );
        r.model = Some("gpt-4o-mini".to_owned());
        r.agent = Some("support".to_owned());
        r.status = 200;
        r.latency_ms = 12;
        r.response_bytes = 314;
        r.usage.model = Some("gpt-4o-mini-2024-07-18".to_owned());
        r.usage.input_tokens = Some(12);
        r.usage.output_tokens = Some(20);
        r.usage_status = UsageStatus::Reported;
        r.cost_micros = Some(14);
        r.error_code = None::<Cow<'static, str>>;
        r
    }

    /// 2026-11-28T20:31:28.012345Z
    fn at() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_micros(1_795_897_888_012_345)
    }

    fn line<'a>(r: &'a RequestRecord, ids: Option<&'a TraceRef>) -> AccessLine<'a> {
        AccessLine {
            record: r,
            route: "/{provider}/{*path}",
            ids,
            ending: "Complete",
        }
    }

    fn written(f: LogFormat, line: &AccessLine<'_>) -> String {
        let mut out = Vec::new();
        format(&mut out, f, line, at());
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn the_text_line_reads_like_the_tracing_formatter() {
        let r = record();
        assert_eq!(
            written(LogFormat::Text, &line(&r, None)),
            "2026-11-28T20:31:28.012345Z  INFO request{nm.request_id=\"req-1\" \
             http.request.method=POST http.route=\"/{provider}/{*path}\" \
             gen_ai.provider.name=\"openai\" gen_ai.request.model=\"gpt-4o-mini\" \
             nm.agent=\"support\" nm.key_id=\"key-1\" http.response.status_code=200 \
             nm.latency_ms=12 gen_ai.response.model=\"gpt-4o-mini-2024-07-18\" \
             gen_ai.usage.input_tokens=12 gen_ai.usage.output_tokens=20 nm.cost_micros=14}: \
             nm_dataplane::event: request completed http.response.status_code=200 \
             latency_ms=12 bytes=314 ending=Complete\n"
        );
    }

    #[test]
    fn a_request_in_an_experiment_names_its_experiment_and_arm() {
        let mut r = record();
        r.variant = Some(nm_types::experiment::Variant {
            experiment: Arc::from("exp-1"),
            arm: Arc::from("groq"),
            requested_model: Some("gpt-4o".to_owned()),
        });
        let text = written(LogFormat::Text, &line(&r, None));
        assert!(
            text.contains(
                " nm.agent=\"support\" nm.experiment=\"exp-1\" nm.arm=\"groq\" nm.key_id="
            ),
            "{text}"
        );
        let v: serde_json::Value =
            serde_json::from_str(&written(LogFormat::Json, &line(&r, None))).expect("JSON");
        assert_eq!(v["span"]["nm.experiment"], "exp-1");
        assert_eq!(v["span"]["nm.arm"], "groq");
    }

    #[test]
    fn the_json_line_has_the_json_formatters_layout() {
        let r = record();
        let ids = TraceRef {
            trace_id: [0xab; 16],
            span_id: [0x01; 8],
        };
        let text = written(LogFormat::Json, &line(&r, Some(&ids)));
        assert!(text.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).expect("one JSON object");
        assert_eq!(v["timestamp"], "2026-11-28T20:31:28.012345Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "request completed");
        assert_eq!(v["target"], "nm_dataplane::event");
        assert_eq!(v["http.response.status_code"], 200);
        assert_eq!(v["bytes"], 314);
        assert_eq!(v["ending"], "Complete");
        let span = &v["span"];
        assert_eq!(span["name"], "request");
        assert_eq!(span["trace_id"], "ab".repeat(16));
        assert_eq!(span["span_id"], "01".repeat(8));
        assert_eq!(span["http.request.method"], "POST");
        assert_eq!(span["gen_ai.usage.output_tokens"], 20);
        assert_eq!(span["nm.cost_micros"], 14);
        assert!(
            span.get("nm.session").is_none(),
            "absent values are left out"
        );
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_microseconds() {
        let mut out = Vec::new();
        timestamp(&mut out, SystemTime::UNIX_EPOCH);
        assert_eq!(out, b"1970-01-01T00:00:00.000000Z");
        for (secs, text) in [
            (951_782_400, "2000-02-29T00:00:00"),
            (4_107_542_399, "2100-02-28T23:59:59"),
            (1_709_251_199, "2024-02-29T23:59:59"),
            (1_735_689_600, "2025-01-01T00:00:00"),
        ] {
            assert_eq!(civil(secs), text.as_bytes(), "{secs}");
        }
    }

    #[test]
    fn hostile_values_cannot_forge_a_field_or_a_line() {
        let mut r = record();
        r.model = Some("x\" nm.agent=\"admin\nFAKE \u{9b}2J\\".to_owned());
        let text = written(LogFormat::Text, &line(&r, None));
        assert_eq!(text.matches('\n').count(), 1);
        assert!(
            text.contains(r#"gen_ai.request.model="x\" nm.agent=\"admin\nFAKE \u{9b}2J\\""#),
            "{text}"
        );
        let json = written(LogFormat::Json, &line(&r, None));
        let v: serde_json::Value = serde_json::from_str(&json).expect("one JSON object");
        assert_eq!(
            v["span"]["gen_ai.request.model"],
            r.model.as_deref().unwrap_or("")
        );
    }

    proptest! {
        /// For ASCII, the C1 controls and printable characters beyond, exactly what `Debug`
        /// writes.
        #[test]
        fn escapes_as_debug_does(s in "[\\x00-\\x7f\u{80}-\u{9f}é€😀]{0,40}") {
            let mut out = String::new();
            escape_debug(&s, |piece| out.push_str(piece));
            prop_assert_eq!(format!("\"{out}\""), format!("{s:?}"));
        }

        /// Any model string: one text line whose quoted value reads back as the string (as
        /// Rust's `Debug` escapes it), and one JSON object that holds it exactly.
        #[test]
        fn any_value_stays_inside_its_field(model in any::<String>()) {
            let mut r = record();
            r.model = Some(model.clone());
            let text = written(LogFormat::Text, &line(&r, None));
            prop_assert_eq!(text.matches('\n').count(), 1);
            prop_assert!(text.ends_with('\n'));
            let json = written(LogFormat::Json, &line(&r, None));
            let v: serde_json::Value = serde_json::from_str(&json).expect("one JSON object");
            prop_assert_eq!(v["span"]["gen_ai.request.model"].as_str(), Some(model.as_str()));
            // Every control character is escaped.
            prop_assert!(!text[..text.len() - 1].chars().any(|c| c.is_control()));
        }
    }
}
