//! What a key may do: its [`Role`] and, for a service key, its [`Scope`] (providers, model glob
//! patterns, agents, envs). The controlplane validates and stores them; the dataplane receives
//! them with each key in its key snapshot and checks every request against them in memory,
//! before anything is forwarded.
//!
//! - `admin`: every admin API, the proxy and signals.
//! - `viewer`: the read-only admin APIs (analytics, usage, budgets, keys without secrets);
//!   neither the proxy nor signals nor any change.
//! - `service` (the default): the proxy and signals only.
//!
//! An empty list in a scope means "any". A non-empty one must match: a request that does not
//! name the dimension at all (no `NM-Agent`, no `NM-Env`, no model in its body or path) is
//! refused by a key scoped on it, since nothing shows it is inside the scope. Models match by
//! [`glob_match`] (`*` any run of characters, `?` exactly one); providers, agents and envs
//! match exactly (a provider by its name or one of its aliases).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Env, MAX_AGENT_LEN};

/// Most entries in one list of a scope.
pub const MAX_SCOPE_ENTRIES: usize = 64;
/// Longest provider name or model pattern in a scope, in bytes.
pub const MAX_SCOPE_ENTRY_LEN: usize = 128;

/// What a key may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything: every admin API, the proxy and signals.
    Admin,
    /// The read-only admin APIs; neither the proxy nor signals.
    Viewer,
    /// The proxy and signals only.
    #[default]
    Service,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Admin, Role::Viewer, Role::Service];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Viewer => "viewer",
            Role::Service => "service",
        }
    }

    /// Whether the role may use the dataplane (the proxy and signals).
    pub fn may_proxy(self) -> bool {
        self != Role::Viewer
    }

    /// Whether the role may call the admin APIs that only read.
    pub fn may_read_admin(self) -> bool {
        self != Role::Service
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| "role must be one of admin, viewer, service".to_owned())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The dimension of a scope that refused a request (named in the refusal's message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeDim {
    Provider,
    Model,
    Agent,
    Env,
}

impl ScopeDim {
    pub fn as_str(self) -> &'static str {
        match self {
            ScopeDim::Provider => "provider",
            ScopeDim::Model => "model",
            ScopeDim::Agent => "agent",
            ScopeDim::Env => "env",
        }
    }
}

/// Where a service key may go. Empty lists allow anything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scope {
    pub providers: Vec<String>,
    /// Glob patterns ([`glob_match`]).
    pub models: Vec<String>,
    pub agents: Vec<String>,
    pub envs: Vec<Env>,
}

/// A request outside its key's scope: which dimension refused it, and why (safe to return to
/// the client that sent the request, and to log: it names the request's own values).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ScopeRefusal {
    pub dim: ScopeDim,
    pub message: String,
}

impl Scope {
    /// True when nothing is restricted.
    pub fn is_unrestricted(&self) -> bool {
        self.providers.is_empty()
            && self.models.is_empty()
            && self.agents.is_empty()
            && self.envs.is_empty()
    }

    /// Checks sizes and forms; the lists come back sorted and without duplicates. Provider
    /// names are lowercase (the URL prefix is); model patterns and agents printable.
    pub fn normalized(mut self) -> Result<Self, String> {
        let check = |what: &str, list: &mut Vec<String>, ok: &dyn Fn(&str) -> bool| {
            if list.len() > MAX_SCOPE_ENTRIES {
                return Err(format!("at most {MAX_SCOPE_ENTRIES} {what}"));
            }
            for v in list.iter_mut() {
                *v = v.trim().to_owned();
                if !ok(v) {
                    return Err(format!("{what}: {v:?} is not allowed"));
                }
            }
            list.sort_unstable();
            list.dedup();
            Ok(())
        };
        let printable = |max: usize| {
            move |v: &str| !v.is_empty() && v.len() <= max && !v.chars().any(char::is_control)
        };
        check("providers", &mut self.providers, &|v| {
            !v.is_empty()
                && v.len() <= MAX_SCOPE_ENTRY_LEN
                && v.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        })?;
        check("models", &mut self.models, &printable(MAX_SCOPE_ENTRY_LEN))?;
        check("agents", &mut self.agents, &printable(MAX_AGENT_LEN))?;
        if self.envs.len() > Env::ALL.len() {
            return Err("at most 3 envs".to_owned());
        }
        self.envs.sort_unstable_by_key(|e| e.as_str());
        self.envs.dedup();
        Ok(self)
    }

    /// A provider by its name and aliases (the request's prefix may be either).
    pub fn check_provider<'a>(
        &self,
        name: &str,
        aliases: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ScopeRefusal> {
        if self.providers.is_empty()
            || self.providers.iter().any(|p| p == name)
            || aliases
                .into_iter()
                .any(|a| self.providers.iter().any(|p| p == a))
        {
            return Ok(());
        }
        Err(self.refusal(ScopeDim::Provider, Some(name)))
    }

    /// The request's model (from its body or path); none named is refused by a model scope.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ScopeRefusal> {
        if self.models.is_empty()
            || model.is_some_and(|m| self.models.iter().any(|p| glob_match(p, m)))
        {
            return Ok(());
        }
        Err(self.refusal(ScopeDim::Model, model))
    }

    /// The request's `NM-Agent`; none is refused by an agent scope.
    pub fn check_agent(&self, agent: Option<&str>) -> Result<(), ScopeRefusal> {
        if self.agents.is_empty() || agent.is_some_and(|a| self.agents.iter().any(|s| s == a)) {
            return Ok(());
        }
        Err(self.refusal(ScopeDim::Agent, agent))
    }

    /// The request's `NM-Env`; none is refused by an env scope.
    pub fn check_env(&self, env: Option<Env>) -> Result<(), ScopeRefusal> {
        if self.envs.is_empty() || env.is_some_and(|e| self.envs.contains(&e)) {
            return Ok(());
        }
        Err(self.refusal(ScopeDim::Env, env.map(Env::as_str)))
    }

    fn refusal(&self, dim: ScopeDim, got: Option<&str>) -> ScopeRefusal {
        let allowed = match dim {
            ScopeDim::Provider => self.providers.join(", "),
            ScopeDim::Model => self.models.join(", "),
            ScopeDim::Agent => self.agents.join(", "),
            ScopeDim::Env => self
                .envs
                .iter()
                .map(|e| e.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        };
        let what = dim.as_str();
        let message = match got {
            Some(v) => {
                // The request's own value, cut short: it came from the client.
                let v: String = v.chars().take(MAX_SCOPE_ENTRY_LEN).collect();
                format!("{what} {v:?} is outside this key's scope ({what}s allowed: {allowed})")
            }
            None => format!(
                "this key is limited by {what} ({what}s allowed: {allowed}) and the request names none"
            ),
        };
        ScopeRefusal { dim, message }
    }
}

/// Whether `text` matches the glob `pattern`: `*` matches any run of characters (none
/// included), `?` exactly one character, anything else itself (case-sensitive). Linear in
/// practice (one backtrack point, the last `*`), no allocation.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    // After the last `*` seen: where the pattern resumes, and the text position it was tried at.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some(b'*') => {
                pi += 1;
                star = Some((pi, ti));
                continue;
            }
            Some(b'?') => {
                pi += 1;
                ti += utf8_len(t[ti]);
                continue;
            }
            // A literal byte: UTF-8 is prefix-free, so byte equality is character equality
            // once the whole character matched.
            Some(&c) if c == t[ti] => {
                pi += 1;
                ti += 1;
                continue;
            }
            _ => {}
        }
        // Mismatch: let the last `*` swallow one more character, or fail.
        let Some((resume, tried)) = star else {
            return false;
        };
        let next = tried + utf8_len(t[tried]);
        star = Some((resume, next));
        pi = resume;
        ti = next;
    }
    p[pi.min(p.len())..].iter().all(|&c| c == b'*')
}

/// Length of the UTF-8 character starting with `lead` (a character boundary).
fn utf8_len(lead: u8) -> usize {
    match lead {
        0..0x80 => 1,
        0xF0.. => 4,
        0xE0.. => 3,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, as plainly as it can be written: exponential, for short inputs only.
    fn reference(p: &[char], t: &[char]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some(('*', rest)) => (0..=t.len()).any(|i| reference(rest, &t[i..])),
            Some(('?', rest)) => !t.is_empty() && reference(rest, &t[1..]),
            Some((c, rest)) => t.first() == Some(c) && reference(rest, &t[1..]),
        }
    }

    #[test]
    fn globs() {
        for (p, t, want) in [
            ("gpt-4o*", "gpt-4o", true),
            ("gpt-4o*", "gpt-4o-mini", true),
            ("gpt-4o*", "gpt-4", false),
            ("*", "", true),
            ("", "", true),
            ("", "a", false),
            ("claude-*-sonnet-*", "claude-3-5-sonnet-20241022", true),
            ("claude-*-sonnet-*", "claude-3-5-haiku-20241022", false),
            ("gemini-?.?-flash", "gemini-2.0-flash", true),
            ("gemini-?.?-flash", "gemini-2.0-flash-lite", false),
            ("a?c", "aéc", true),
            ("*é", "café", true),
            ("GPT-4O", "gpt-4o", false),
            ("a*b*c", "abxbxc", true),
            ("a*b*c", "abxbx", false),
        ] {
            assert_eq!(glob_match(p, t), want, "{p:?} on {t:?}");
        }
    }

    proptest! {
        #[test]
        fn glob_matches_the_reference(
            p in proptest::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '*', '?']), 0..8),
            t in proptest::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '*', '?']), 0..10),
        ) {
            let (ps, ts): (String, String) = (p.iter().collect(), t.iter().collect());
            prop_assert_eq!(glob_match(&ps, &ts), reference(&p, &t), "{:?} on {:?}", ps, ts);
        }
    }

    #[test]
    fn scopes_refuse_by_dimension() {
        let scope = Scope {
            providers: vec!["openai".into(), "gemini".into()],
            models: vec!["gpt-4o*".into()],
            agents: vec!["search".into()],
            envs: vec![Env::Production],
        };
        assert!(scope.check_provider("openai", []).is_ok());
        assert!(scope.check_provider("vertex", ["gemini"]).is_ok());
        let r = scope.check_provider("anthropic", []).err();
        assert_eq!(r.as_ref().map(|r| r.dim), Some(ScopeDim::Provider));
        assert!(r.is_some_and(
            |r| r.message.contains("provider \"anthropic\"") && r.message.contains("openai")
        ));
        assert!(scope.check_model(Some("gpt-4o-mini")).is_ok());
        assert_eq!(
            scope.check_model(Some("gpt-5")).err().map(|r| r.dim),
            Some(ScopeDim::Model)
        );
        assert!(
            scope
                .check_model(None)
                .is_err_and(|r| r.message.contains("names none"))
        );
        assert!(scope.check_agent(Some("search")).is_ok());
        assert_eq!(
            scope.check_agent(None).err().map(|r| r.dim),
            Some(ScopeDim::Agent)
        );
        assert!(scope.check_env(Some(Env::Production)).is_ok());
        assert_eq!(
            scope.check_env(Some(Env::Staging)).err().map(|r| r.dim),
            Some(ScopeDim::Env)
        );
        let any = Scope::default();
        assert!(any.is_unrestricted());
        assert!(any.check_model(None).is_ok() && any.check_agent(None).is_ok());
    }

    #[test]
    fn scopes_are_checked_and_normalized() {
        let s = Scope {
            providers: vec![" openai".into(), "anthropic".into(), "openai".into()],
            ..Scope::default()
        }
        .normalized();
        assert_eq!(
            s.map(|s| s.providers),
            Ok(vec!["anthropic".to_owned(), "openai".to_owned()])
        );
        for bad in [
            Scope {
                providers: vec!["OpenAI".into()],
                ..Scope::default()
            },
            Scope {
                models: vec![String::new()],
                ..Scope::default()
            },
            Scope {
                agents: vec!["a\nb".into()],
                ..Scope::default()
            },
            Scope {
                models: vec!["m".into(); MAX_SCOPE_ENTRIES + 1],
                ..Scope::default()
            },
        ] {
            assert!(bad.normalized().is_err());
        }
        assert_eq!("viewer".parse::<Role>(), Ok(Role::Viewer));
        assert!("root".parse::<Role>().is_err());
    }
}
