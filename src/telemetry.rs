//! Logging through `tracing`: human-readable by default, JSON lines with `NM_LOG_FORMAT=json`.
//! The filter comes from `NM_LOG` (an `EnvFilter` directive, default `info`). Logs go to stderr
//! through the dataplane's non-blocking log output ([`nm_dataplane::log`]): a stalled stderr
//! drops lines (counted) instead of stalling the process. stdout is kept for command output.

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

use nm_dataplane::log::lines::LineWriter;
use nm_dataplane::log::{AccessLog, LogFormat as LineFormat, LogLines};
use tracing::Subscriber;
use tracing::field::{Field, Visit};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// Noisy dependencies are held at warn unless the filter names them.
const QUIET: &[&str] = &[
    "sqlx=warn",
    "sea_orm=warn",
    "h2=warn",
    "hyper=warn",
    "hyper_util=warn",
    "tower=warn",
    "rustls=warn",
];

/// Longest wait at exit for queued lines to reach stderr.
const FLUSH_PATIENCE: Duration = Duration::from_secs(2);

/// The process's log output and its format, once [`init`] ran.
static OUTPUT: OnceLock<(LogLines, LineFormat)> = OnceLock::new();

/// The `tracing` formatter's writer: each line it makes goes to the log output whole.
struct Lines(LogLines);

impl<'a> MakeWriter<'a> for Lines {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter(&self.0)
    }
}

/// Installs the global subscriber. Safe to call more than once (later calls do nothing).
pub fn init(filter: &str, format: LogFormat) -> Result<(), tracing_subscriber::filter::ParseError> {
    let mut directives = QUIET.join(",");
    directives.push(',');
    directives.push_str(filter);
    let filter = EnvFilter::try_new(directives)?;
    let Ok(lines) = LogLines::stderr() else {
        // No thread for the log output: write stderr directly, without an access log.
        init_with(filter, format, std::io::stderr);
        return Ok(());
    };
    let line_format = match format {
        LogFormat::Text => LineFormat::Text,
        LogFormat::Json => LineFormat::Json,
    };
    if OUTPUT.set((lines.clone(), line_format)).is_ok() {
        init_with(filter, format, Lines(lines));
    }
    Ok(())
}

fn init_with<W>(filter: EnvFilter, format: LogFormat, writer: W)
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let _ = subscriber(filter, format, writer).try_init();
}

/// The process's subscriber: the filter, then lines in `format` to `writer`.
fn subscriber<W>(
    filter: EnvFilter,
    format: LogFormat,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let registry = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    match format {
        LogFormat::Text => Box::new(registry.with(fmt.with_ansi(false).fmt_fields(TextFields))),
        LogFormat::Json => Box::new(
            registry.with(
                fmt.json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_span_list(false),
            ),
        ),
    }
}

/// The text format's fields, `name=value` with strings quoted and escaped as `Debug` writes
/// them: what `tracing`'s default field formatter writes, without its styling machinery, which
/// cost a few thousand instructions for every request's span.
struct TextFields;

impl<'w> FormatFields<'w> for TextFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut visitor = TextVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct TextVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl TextVisitor<'_> {
    /// Starts a field: the separator, then `name=` (nothing for the message).
    fn start(&mut self, field: &Field) -> bool {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return false;
        }
        if !self.first {
            self.result = self.writer.write_char(' ');
        }
        self.first = false;
        if name != "message" {
            let name = name.strip_prefix("r#").unwrap_or(name);
            self.result = self
                .result
                .and_then(|()| self.writer.write_str(name))
                .and_then(|()| self.writer.write_char('='));
        }
        self.result.is_ok()
    }
}

impl Visit for TextVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if !self.start(field) {
            return;
        }
        if field.name() == "message" {
            self.result = self.writer.write_str(value);
            return;
        }
        let w = &mut self.writer;
        let mut result = w.write_char('"');
        nm_dataplane::log::access::escape_debug(value, |piece| {
            result = result.and_then(|()| w.write_str(piece));
        });
        self.result = result.and_then(|()| w.write_char('"'));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if self.start(field) {
            self.result = self.writer.write_str(itoa::Buffer::new().format(value));
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if self.start(field) {
            self.result = self.writer.write_str(itoa::Buffer::new().format(value));
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if self.start(field) {
            self.result = self.writer.write_str(if value { "true" } else { "false" });
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.start(field) {
            self.result = write!(self.writer, "{value:?}");
        }
    }
}

/// The dataplane's access log: into the log output, in the log format; off before [`init`].
pub fn access_log() -> AccessLog {
    OUTPUT.get().map_or_else(AccessLog::off, |(lines, format)| {
        AccessLog::new(lines.clone(), *format)
    })
}

/// Waits (briefly) for queued log lines to reach stderr: before the process exits, and before
/// a message written straight to stderr that must come after them.
pub fn flush() {
    if let Some((lines, _)) = OUTPUT.get() {
        lines.flush(FLUSH_PATIENCE);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex, PoisonError};

    use nm_dataplane::log::{AccessLog, LogLines, RequestLog, Val};
    use nm_types::record::TraceRef;
    use tracing::field::Empty;

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Shared {
        type Writer = Shared;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    impl Shared {
        fn text(&self) -> String {
            String::from_utf8(
                self.0
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone(),
            )
            .expect("utf-8")
        }
    }

    const TARGET: &str = "nm_dataplane::layers::rescue";
    const ROUTE: &str = "/{provider}/{*path}";

    /// What the `request` span was: a `tracing` span with the same declaration, the same
    /// records, and a warning in it; the line as the process's subscriber writes it.
    fn tracing_line(format: LogFormat, ids: &TraceRef) -> String {
        let out = Shared::default();
        let sub = subscriber(EnvFilter::new("debug"), format, out.clone());
        tracing::subscriber::with_default(sub, || {
            let (trace, span) = (ids.trace_digits(), ids.span_digits());
            let span = tracing::info_span!(
                "request",
                nm.request_id = "req-\"1\"",
                trace_id = trace.as_str(),
                span_id = span.as_str(),
                http.request.method = %http::Method::POST,
                http.route = ROUTE,
                gen_ai.provider.name = Empty,
                gen_ai.request.model = Empty,
                nm.agent = Empty,
                nm.session = Empty,
                nm.env = Empty,
                nm.key_id = Empty,
                http.response.status_code = Empty,
            );
            span.record("gen_ai.provider.name", "openai");
            span.record("gen_ai.request.model", "gpt-4o\nmini");
            span.record("nm.agent", "support");
            span.record("nm.key_id", "key-1");
            span.record("http.response.status_code", 502);
            let _in = span.enter();
            tracing::event!(
                target: TARGET,
                tracing::Level::WARN,
                {
                    nm.error = "upstream_error",
                    error = %"cannot reach openai: connection refused",
                    suppressed = 3u64,
                },
                "upstream failed"
            );
        });
        out.text()
    }

    /// The same line from the request's [`RequestLog`].
    fn our_line(format: LogFormat, ids: &TraceRef) -> String {
        let out = Shared::default();
        let lines = LogLines::start(16, out.clone()).expect("log thread");
        let format = match format {
            LogFormat::Text => LineFormat::Text,
            LogFormat::Json => LineFormat::Json,
        };
        let log = RequestLog::new("req-\"1\"", Some(*ids), &http::Method::POST, Some(ROUTE));
        log.know(|k| {
            k.provider = Some("openai".into());
            k.model = Some("gpt-4o\nmini".to_owned());
            k.agent = Some("support".to_owned());
            k.key_id = Some("key-1".into());
            k.status = Some(502);
        });
        let error = "cannot reach openai: connection refused";
        log.line(
            &AccessLog::new(lines.clone(), format),
            tracing::Level::WARN,
            TARGET,
            "upstream failed",
            &[
                ("nm.error", Val::Str("upstream_error")),
                ("error", Val::Show(&error)),
                ("suppressed", Val::Num(3)),
            ],
        );
        assert!(lines.flush(Duration::from_secs(5)));
        out.text()
    }

    fn ids() -> TraceRef {
        TraceRef {
            trace_id: [0x4b; 16],
            span_id: [0x07; 8],
        }
    }

    #[test]
    fn a_requests_text_line_reads_as_tracing_writes_it_in_a_request_span() {
        let (theirs, ours) = (
            tracing_line(LogFormat::Text, &ids()),
            our_line(LogFormat::Text, &ids()),
        );
        // Equal after the timestamp (27 bytes).
        assert_eq!(ours.len() - 27, theirs.len() - 27, "{ours}{theirs}");
        assert_eq!(ours[27..], theirs[27..]);
        assert!(
            ours.contains("gen_ai.request.model=\"gpt-4o\\nmini\""),
            "{ours}"
        );
    }

    #[test]
    fn a_requests_json_line_holds_what_tracing_writes_in_a_request_span() {
        let parse = |line: &str| {
            assert_eq!(line.matches('\n').count(), 1, "{line}");
            let mut v: serde_json::Value = serde_json::from_str(line).expect("one JSON object");
            assert!(v["timestamp"].is_string());
            v["timestamp"].take();
            v
        };
        let (theirs, ours) = (
            parse(&tracing_line(LogFormat::Json, &ids())),
            parse(&our_line(LogFormat::Json, &ids())),
        );
        assert_eq!(ours, theirs);
        assert_eq!(ours["span"]["name"], "request");
        assert_eq!(ours["span"]["http.response.status_code"], 502);
    }
}
