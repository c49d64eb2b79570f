//! Logging through `tracing`: human-readable by default, JSON lines with `NM_LOG_FORMAT=json`.
//! The filter comes from `NM_LOG` (an `EnvFilter` directive, default `info`). Logs go to stderr;
//! stdout is kept for command output.

use tracing_subscriber::EnvFilter;
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

/// Installs the global subscriber. Safe to call more than once (later calls do nothing).
pub fn init(filter: &str, format: LogFormat) -> Result<(), tracing_subscriber::filter::ParseError> {
    let mut directives = QUIET.join(",");
    directives.push(',');
    directives.push_str(filter);
    let filter = EnvFilter::try_new(directives)?;
    let registry = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
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
    Ok(())
}
