//! Implicit signals: which rules the dataplane applies, how far back a re-ask looks, and the
//! bounds of what the rules remember (docs/signals.md, "Implicit signals").

use std::collections::HashMap;
use std::time::Duration;

use nm_dataplane::implicit::{self, Rules};

use super::decl::{Chart, Default, Group, Kind, Lit, Raw, declare};
use super::{ConfigError, invalid, parse};

declare! { Group::Signals;
    /// implicit rules on for every agent: `all`, `off`, or names separated by commas (`client_disconnect`, `reask`, `history_edit`, `continued`)
    IMPLICIT_RULES: Rules => rules, {
        env: "NM_IMPLICIT_RULES",
        file: Some(("implicit_rules", Kind::Str)),
        default: Default::Is(Lit::Str("all")),
        chart: Chart::Value("implicitRules"),
    };
    /// implicit rules off for some agents: `agent:rule` pairs separated by commas, `agent:all` for every rule (an agent name holding a comma cannot be named here)
    IMPLICIT_RULES_OFF: HashMap<String, Rules> => rules_off, {
        env: "NM_IMPLICIT_RULES_OFF",
        file: Some(("implicit_rules_off", Kind::Str)),
    };
    /// how far back, in seconds, a request of the session with the same conversation counts as a `reask` of the earlier answer
    IMPLICIT_REASK_WINDOW: Duration => parse::secs_at_least_1, {
        env: "NM_IMPLICIT_REASK_WINDOW_SECS",
        file: Some(("implicit_reask_window_secs", Kind::Int)),
        default: Default::Is(Lit::Int(implicit::DEFAULT_REASK_WINDOW.as_secs())),
    };
    /// most bytes the implicit rules remember per dataplane (conversation hashes; the last answers' first 4,096 characters while `history_edit` is on); over it the sessions touched longest ago are forgotten first
    IMPLICIT_MEMORY_BYTES: usize => memory_bytes, {
        env: "NM_IMPLICIT_MEMORY_BYTES",
        file: Some(("implicit_memory_bytes", Kind::Int)),
        default: Default::Is(Lit::Int(implicit::DEFAULT_MEMORY_BYTES as u64)),
        chart: Chart::Value("implicitMemoryBytes"),
    };
    /// how long, in seconds, the implicit rules remember a session after its last request
    IMPLICIT_MEMORY_TTL: Duration => parse::secs_at_least_1, {
        env: "NM_IMPLICIT_MEMORY_SECS",
        file: Some(("implicit_memory_secs", Kind::Int)),
        default: Default::Is(Lit::Int(implicit::DEFAULT_MEMORY_TTL.as_secs())),
    };
}

fn rules(key: &'static str, raw: Raw<'_>) -> Result<Rules, ConfigError> {
    Rules::parse(&parse::text(key, raw)?).map_err(|e| invalid(key, e))
}

fn rules_off(key: &'static str, raw: Raw<'_>) -> Result<HashMap<String, Rules>, ConfigError> {
    implicit::parse_off_by_agent(&parse::text(key, raw)?).map_err(|e| invalid(key, e))
}

fn memory_bytes(key: &'static str, raw: Raw<'_>) -> Result<usize, ConfigError> {
    let n = parse::whole(key, raw)?;
    usize::try_from(n).map_err(|_| invalid(key, "is too large"))
}
