//! An experiment's rules, without storage: what a new experiment must be
//! ([`check`]: agent, env, arms against the providers the gateway knows, unit, guardrails,
//! limits, description), its states, and which action each state allows ([`allowed`]).
//!
//! Arms and providers: every arm names a provider the gateway is configured with, and all of
//! them speak one wire format (only the model changes in the body, so the body must mean the
//! same thing to each). The first arm's provider is the one clients call; an arm on another
//! provider is sent there with the operator's credential for it (`NM_PROVIDER_KEY_<NAME>`),
//! never the client's, so such an arm needs one.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use nm_types::Env;
use nm_types::experiment::{Arm, Arms};
use nm_types::record::MAX_MODEL_LEN;

use crate::error::{Error, Result};

/// Longest description.
pub const MAX_DESCRIPTION_CHARS: usize = 1000;
/// Longest reason given with an action (kept in the history).
pub const MAX_REASON_CHARS: usize = 1000;

/// Where an experiment is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Sessions are split between the arms.
    Running,
    /// Requests pass unchanged until it is resumed.
    Paused,
    /// The evidence chose a winner (or an operator promoted an arm: then `promoted` is set and
    /// every session goes to the winner).
    Decided,
    /// A guardrail found an arm worse; requests pass unchanged (a rollback of that arm lets the
    /// others run on).
    Harm,
    /// Its maximum sessions or days came without a decision.
    Inconclusive,
    /// Ended by an operator, for good.
    Stopped,
}

impl State {
    pub const ALL: [State; 6] = [
        State::Running,
        State::Paused,
        State::Decided,
        State::Harm,
        State::Inconclusive,
        State::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Paused => "paused",
            State::Decided => "decided",
            State::Harm => "harm",
            State::Inconclusive => "inconclusive",
            State::Stopped => "stopped",
        }
    }
}

impl FromStr for State {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        State::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "state: {s:?} is not one of running, paused, decided, harm, inconclusive, stopped"
                ))
            })
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

pub use crate::analytics::experiment::{Guardrail, Unit};

/// What the gateway knows of one provider, for checking arms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderInfo {
    /// `openai`, `anthropic`, `gemini`: what its bodies mean.
    pub wire_format: String,
    /// Whether the operator configured a credential for it (`NM_PROVIDER_KEY_<NAME>` or the
    /// file's `api_key`).
    pub operator_credential: bool,
}

/// The providers the gateway is configured with, by canonical name: the process that answers
/// the admin API must see the same provider settings as the dataplanes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalogue {
    providers: BTreeMap<String, ProviderInfo>,
}

impl Catalogue {
    pub fn new(providers: impl IntoIterator<Item = (String, ProviderInfo)>) -> Self {
        Self {
            providers: providers.into_iter().collect(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&ProviderInfo> {
        self.providers.get(name)
    }

    fn known(&self) -> String {
        let names: Vec<&str> = self.providers.keys().map(String::as_str).collect();
        names.join(", ")
    }
}

/// One arm as an operator gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArmSpec {
    pub name: String,
    pub provider: String,
    pub model: String,
    pub weight: u32,
}

/// A new experiment as an operator gives it (strings as they came; [`check`] reads them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewExperiment {
    pub agent: String,
    /// Empty or absent: every env.
    pub env: Option<String>,
    pub arms: Vec<ArmSpec>,
    /// Empty: `session`.
    pub unit: String,
    pub guardrails: Vec<String>,
    /// 0: no limit.
    pub max_sessions: u64,
    /// 0: no limit.
    pub max_days: u32,
    pub auto_promote: bool,
    pub auto_rollback: bool,
    pub description: String,
}

/// A new experiment that passed [`check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub agent: String,
    pub env: Option<Env>,
    /// Providers by canonical (lower-case) name, models trimmed.
    pub arms: Vec<ArmSpec>,
    pub unit: Unit,
    /// Sorted, each once.
    pub guardrails: Vec<Guardrail>,
    pub max_sessions: Option<i64>,
    pub max_days: Option<i64>,
    pub auto_promote: bool,
    pub auto_rollback: bool,
    pub description: String,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Checks a new experiment against the rules and the providers the gateway knows. The error
/// names the field and the rule.
pub fn check(new: NewExperiment, catalogue: &Catalogue) -> Result<Checked> {
    let agent = nm_types::parse_agent(&new.agent)
        .map_err(|_| invalid("agent must be 1 to 128 printable characters"))?;
    let env = match new.env.as_deref().map(str::trim).filter(|e| !e.is_empty()) {
        None => None,
        Some(e) => Some(
            e.parse::<Env>()
                .map_err(|err| invalid(format!("env: {err}")))?,
        ),
    };
    let arms: Vec<ArmSpec> = new
        .arms
        .into_iter()
        .map(|a| ArmSpec {
            name: a.name.trim().to_owned(),
            provider: a.provider.trim().to_ascii_lowercase(),
            model: a.model.trim().to_owned(),
            weight: a.weight,
        })
        .collect();
    Arms::new(
        arms.iter()
            .map(|a| Arm {
                name: a.name.clone(),
                weight: a.weight,
            })
            .collect(),
    )
    .map_err(|e| invalid(format!("arms: {e}")))?;
    let first = &arms[0];
    let first_info = provider(catalogue, first)?;
    for arm in &arms {
        if arm.model.is_empty()
            || arm.model.len() > MAX_MODEL_LEN
            || arm.model.chars().any(char::is_control)
        {
            return Err(invalid(format!(
                "arm {}: the model must be 1 to {MAX_MODEL_LEN} printable characters",
                arm.name
            )));
        }
        let info = provider(catalogue, arm)?;
        if info.wire_format != first_info.wire_format {
            return Err(invalid(format!(
                "arm {}: provider {} speaks the {} wire format, but the first arm's provider {} \
                 speaks {}; every arm of an experiment must speak the same one",
                arm.name, arm.provider, info.wire_format, first.provider, first_info.wire_format
            )));
        }
        if arm.provider != first.provider && !info.operator_credential {
            return Err(invalid(format!(
                "arm {}: provider {} has no operator credential (NM_PROVIDER_KEY_{}); an arm on \
                 another provider than the first arm's ({}) is sent with the operator's \
                 credential, never the client's",
                arm.name,
                arm.provider,
                arm.provider.to_ascii_uppercase().replace('-', "_"),
                first.provider
            )));
        }
    }
    let unit: Unit = new.unit.parse()?;
    let mut guardrails = new
        .guardrails
        .iter()
        .filter(|g| !g.trim().is_empty())
        .map(|g| g.parse())
        .collect::<Result<Vec<Guardrail>>>()?;
    guardrails.sort_unstable();
    guardrails.dedup();
    let max_sessions = match new.max_sessions {
        0 => None,
        n => Some(
            i64::try_from(n).map_err(|_| invalid("max_sessions: at most 9223372036854775807"))?,
        ),
    };
    let max_days = (new.max_days > 0).then(|| i64::from(new.max_days));
    let description = new.description.trim().to_owned();
    check_text("description", &description, MAX_DESCRIPTION_CHARS)?;
    Ok(Checked {
        agent,
        env,
        arms,
        unit,
        guardrails,
        max_sessions,
        max_days,
        auto_promote: new.auto_promote,
        auto_rollback: new.auto_rollback,
        description,
    })
}

fn provider<'c>(catalogue: &'c Catalogue, arm: &ArmSpec) -> Result<&'c ProviderInfo> {
    catalogue.get(&arm.provider).ok_or_else(|| {
        invalid(format!(
            "arm {}: unknown provider {:?}; known: {}",
            arm.name,
            arm.provider,
            catalogue.known()
        ))
    })
}

/// Free text: at most `max` characters, no control characters but newlines and tabs.
pub fn check_text(field: &str, text: &str, max: usize) -> Result<()> {
    if text.chars().count() > max
        || text
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return Err(invalid(format!(
            "{field}: at most {max} characters, without control characters"
        )));
    }
    Ok(())
}

/// Something done to an experiment: by an operator, or by the evaluation (`system`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Pause,
    Resume,
    Stop,
    Promote,
    Rollback,
    Decide,
    Harm,
    Inconclusive,
}

impl Action {
    /// Its name in the audit trail (`experiment.<name>`).
    pub fn audit_action(self) -> &'static str {
        match self {
            Action::Pause => "experiment.pause",
            Action::Resume => "experiment.resume",
            Action::Stop => "experiment.stop",
            Action::Promote => "experiment.promote",
            Action::Rollback => "experiment.rollback",
            Action::Decide => "experiment.decide",
            Action::Harm => "experiment.harm",
            Action::Inconclusive => "experiment.inconclusive",
        }
    }

    /// Its event's kind in the experiment's history.
    pub fn event_kind(self) -> &'static str {
        match self {
            Action::Pause => "paused",
            Action::Resume => "resumed",
            Action::Stop => "stopped",
            Action::Promote => "promoted",
            Action::Rollback => "rolled_back",
            Action::Decide => "decided",
            Action::Harm => "harm",
            Action::Inconclusive => "inconclusive",
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Action::Pause => "paused",
            Action::Resume => "resumed",
            Action::Stop => "stopped",
            Action::Promote => "promoted",
            Action::Rollback => "have an arm rolled back",
            Action::Decide => "decided",
            Action::Harm => "stopped for harm",
            Action::Inconclusive => "ended inconclusive",
        }
    }
}

/// Whether `action` may happen to an experiment in `state` (`promoted`: its winner serves every
/// session). The error says which states allow it.
pub fn allowed(action: Action, state: State, promoted: bool) -> Result<()> {
    use State::*;
    if state == Stopped {
        return Err(Error::FailedPrecondition(
            "the experiment is stopped; a stopped experiment does not change".to_owned(),
        ));
    }
    let (ok, rule) = match action {
        Action::Pause => (state == Running, "only a running experiment can be paused"),
        Action::Resume => (state == Paused, "only a paused experiment can be resumed"),
        Action::Stop => (true, ""),
        Action::Promote => (
            !promoted,
            "its winner is promoted already; stop it to end the promotion",
        ),
        Action::Rollback => (
            matches!(state, Running | Paused | Harm),
            "an arm can be rolled back while the experiment is running, paused or in harm",
        ),
        Action::Decide | Action::Harm | Action::Inconclusive => (
            matches!(state, Running | Paused),
            "only a running or paused experiment can be decided, stopped for harm or ended inconclusive",
        ),
    };
    if ok {
        return Ok(());
    }
    let now = if promoted {
        format!("{state}, promoted")
    } else {
        state.to_string()
    };
    Err(Error::FailedPrecondition(format!(
        "the experiment cannot be {} now (it is {now}): {rule}",
        action.verb()
    )))
}
