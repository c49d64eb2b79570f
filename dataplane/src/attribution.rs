//! Parses the attribution headers (`NM-Agent`, `NM-Session`, `NM-Env`, `NM-User`) and the
//! experiments' opt-out (`NM-Experiment: off`). A header that is present but malformed is a 400
//! `invalid_header`: silently dropping it would lose the attribution the client asked for.

use http::{HeaderMap, HeaderName};
use nm_types::{Env, SessionId, parse_agent, parse_user};

use crate::error::ProxyError;

// Names, not strings: a look-up by `HeaderName` skips parsing the name on every request.
pub const NM_AGENT: HeaderName = HeaderName::from_static("nm-agent");
pub const NM_SESSION: HeaderName = HeaderName::from_static("nm-session");
pub const NM_ENV: HeaderName = HeaderName::from_static("nm-env");
pub const NM_USER: HeaderName = HeaderName::from_static("nm-user");
pub const NM_EXPERIMENT: HeaderName = HeaderName::from_static("nm-experiment");

/// Who a request is for, as the client declared it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    pub agent: Option<String>,
    pub session: Option<SessionId>,
    pub env: Option<Env>,
    pub user: Option<String>,
    /// `NM-Experiment: off`: the request stays out of any experiment on its agent.
    pub experiment_off: bool,
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
            experiment_off: parse(headers, &NM_EXPERIMENT, "NM-Experiment", parse_opt_out)?
                .is_some(),
        })
    }
}

/// `NM-Experiment`'s one value, `off` (any case); any other value is refused rather than
/// ignored, so a typo never silently leaves a request in an experiment.
fn parse_opt_out(value: &str) -> Result<(), &'static str> {
    if value.trim().eq_ignore_ascii_case("off") {
        Ok(())
    } else {
        Err("the only value is \"off\" (leave the request out of experiments)")
    }
}

fn parse<T, E: std::fmt::Display>(
    headers: &HeaderMap,
    name: &HeaderName,
    display: &'static str,
    f: impl FnOnce(&str) -> Result<T, E>,
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

        assert!(!Attribution::from_headers(&h).is_ok_and(|a| a.experiment_off));
        h.insert(NM_EXPERIMENT, HeaderValue::from_static("Off"));
        assert!(Attribution::from_headers(&h).is_ok_and(|a| a.experiment_off));

        for (name, bad) in [
            (NM_SESSION, "42"),
            (NM_ENV, "prod"),
            (NM_AGENT, " "),
            (NM_EXPERIMENT, "on"),
            (NM_EXPERIMENT, "no"),
            (NM_EXPERIMENT, ""),
        ] {
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
