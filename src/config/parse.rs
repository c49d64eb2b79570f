//! The typed parse functions settings declare: each turns a raw value (text from a flag or the
//! environment, or a file's string or integer) into its type, or an error naming the setting.
//! Text numbers are trimmed; strings are taken as given.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::decl::Raw;
use super::{ConfigError, invalid};

/// A string as given (a file integer is refused).
pub fn text(key: &'static str, raw: Raw<'_>) -> Result<String, ConfigError> {
    match raw {
        Raw::Text(s) => Ok(s.to_owned()),
        Raw::Int(n) => Err(invalid(key, format!("{n} is not text"))),
    }
}

/// A file path.
pub fn path(key: &'static str, raw: Raw<'_>) -> Result<PathBuf, ConfigError> {
    text(key, raw).map(PathBuf::from)
}

/// A whole number (text trimmed).
pub fn whole(key: &'static str, raw: Raw<'_>) -> Result<u64, ConfigError> {
    match raw {
        Raw::Text(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| invalid(key, format!("{v:?} is not a whole number"))),
        Raw::Int(n) => {
            u64::try_from(n).map_err(|_| invalid(key, format!("{n} is not a whole number")))
        }
    }
}

/// Whole seconds.
pub fn secs(key: &'static str, raw: Raw<'_>) -> Result<Duration, ConfigError> {
    whole(key, raw).map(Duration::from_secs)
}

/// Whole seconds, at least one.
pub fn secs_at_least_1(key: &'static str, raw: Raw<'_>) -> Result<Duration, ConfigError> {
    match whole(key, raw)? {
        0 => Err(invalid(key, "must be at least 1 second")),
        n => Ok(Duration::from_secs(n)),
    }
}

/// Whole seconds, at least one (the upstream timeouts' older wording).
pub fn timeout_secs(key: &'static str, raw: Raw<'_>) -> Result<Duration, ConfigError> {
    match whole(key, raw)? {
        0 => Err(invalid(key, "timeouts must be at least 1 second")),
        n => Ok(Duration::from_secs(n)),
    }
}

/// A listen address, `IP:PORT`.
pub fn addr(key: &'static str, raw: Raw<'_>) -> Result<SocketAddr, ConfigError> {
    let v = text(key, raw)?;
    v.parse().map_err(|_| {
        invalid(
            key,
            format!("{v:?} is not an address; use IP:PORT, e.g. 0.0.0.0:8080"),
        )
    })
}

/// An `http://` or `https://` URL with a host.
pub fn http_url(key: &'static str, raw: Raw<'_>) -> Result<String, ConfigError> {
    let url = text(key, raw)?;
    let uri: http::Uri = url
        .parse()
        .map_err(|_| invalid(key, format!("{url:?} is not a URL; use http://HOST:PORT")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(invalid(
            key,
            format!("{url:?} must be http://HOST:PORT or https://HOST:PORT"),
        ));
    }
    Ok(url)
}
