//! Logging through `tracing`: human-readable by default, JSON lines with `NM_LOG_FORMAT=json`.
//! The filter comes from `NM_LOG` (an `EnvFilter` directive, default `info`). Logs go to stderr
//! through the dataplane's non-blocking log output ([`nm_dataplane::log`]): a stalled stderr
//! drops lines (counted) instead of stalling the process. stdout is kept for command output.

use std::sync::OnceLock;
use std::time::Duration;

use nm_dataplane::log::lines::LineWriter;
use nm_dataplane::log::{AccessLog, LogFormat as LineFormat, LogLines};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// Noisy dependencies are held at warn unless the filter names them.
const QUIET: &[&str] = &[
    "sqlx=warn",
    "sea_orm=warn",
    "sea_orm_migration=warn",
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
    let registry = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    let _ = match format {
        LogFormat::Text => registry.with(fmt.with_ansi(false)).try_init(),
        LogFormat::Json => registry
            .with(
                fmt.json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_span_list(false),
            )
            .try_init(),
    };
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
