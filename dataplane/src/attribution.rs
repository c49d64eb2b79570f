//! Parses the attribution headers (`NM-Agent`, `NM-Session`, `NM-Env`, `NM-User`). A header that
//! is present but malformed is a 400 `invalid_header`: silently dropping it would lose the
//! attribution the client asked for.

use http::{HeaderMap, HeaderName};
use nm_types::{Env, SessionId, parse_agent, parse_user};

use crate::error::ProxyError;

// Names, not strings: a look-up by `HeaderName` skips parsing the name on every request.
pub const NM_AGENT: HeaderName = HeaderName::from_static("nm-agent");
pub const NM_SESSION: HeaderName = HeaderName::from_static("nm-session");
pub const NM_ENV: HeaderName = HeaderName::from_static("nm-env");
pub const NM_USER: HeaderName = HeaderName::from_static("nm-user");

/// Who a request is for, as the client declared it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    pub agent: Option<String>,
    pub session: Option<SessionId>,
    pub env: Option<Env>,
    pub user: Option<String>,
}

impl Attribution {
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, ProxyError> {
        Ok(Self {
            agent: parse(headers, &NM_AGENT, "NM-Agent", parse_agent)?,
            session: parse(headers, &NM_SESSION, "NM-Session", |s| {
                s.parse::<SessionId>()
            })?,
            env: parse(headers, &NM_ENV, "NM-Env", |s| s.parse::<Env>())?,
            user: parse(headers, &NM_USER, "NM-User", parse_user)?,
        })
    }
}

fn parse<T>(
    headers: &HeaderMap,
    name: &HeaderName,
    display: &'static str,
    f: impl FnOnce(&str) -> Result<T, nm_types::ParseError>,
) -> Result<Option<T>, ProxyError> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    let invalid = |reason: String| ProxyError::InvalidHeader {
        header: display,
        reason,
    };
    let text = value
        .to_str()
        .map_err(|_| invalid("value is not visible ASCII".to_owned()))?;
    f(text).map(Some).map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn parses_and_refuses() {
        let mut h = HeaderMap::new();
        assert_eq!(
            Attribution::from_headers(&h).ok(),
            Some(Attribution::default())
        );
        h.insert(NM_AGENT, HeaderValue::from_static("support-bot"));
        h.insert(NM_SESSION, HeaderValue::from_static("sess_42"));
        h.insert(NM_ENV, HeaderValue::from_static("staging"));
        h.insert(NM_USER, HeaderValue::from_static("user-7"));
        let a = Attribution::from_headers(&h).ok();
        assert_eq!(a.as_ref().and_then(|a| a.env), Some(Env::Staging));
        assert_eq!(
            a.and_then(|a| a.session).map(|s| s.to_string()).as_deref(),
            Some("sess_42")
        );

        for (name, bad) in [(NM_SESSION, "42"), (NM_ENV, "prod"), (NM_AGENT, " ")] {
            let mut h = HeaderMap::new();
            h.insert(name.clone(), HeaderValue::from_static(bad));
            assert!(
                matches!(
                    Attribution::from_headers(&h),
                    Err(ProxyError::InvalidHeader { .. })
                ),
                "{name}={bad}"
            );
        }
    }
}
