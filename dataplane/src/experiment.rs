//! Experiments on the proxy path: which requests are in one, which arm serves each, and the one
//! rewrite an arm makes.
//!
//! The controlplane sends the experiments that change traffic with every key snapshot
//! ([`nm_types::experiment::Live`]); the key watcher hands each set to [`Experiments::apply`],
//! which keeps those this dataplane can serve as written (they pass [`Live::check`], every arm's
//! provider is configured here, and all arms' providers speak one wire format), indexed by
//! agent, and logs at INFO when that set changes (ids only: a salt is a secret).
//!
//! A request is in an experiment when it has an `NM-Session`, its agent (and env, when the
//! experiment names one) match, it does not opt out (`NM-Experiment: off`), it names a model
//! (the body's top-level `model` for the OpenAI and Anthropic formats, the path's for Gemini)
//! and the provider it addressed speaks the arms' wire format. The session picks the arm
//! ([`Live::assign`]: sticky, the same on every dataplane). An arm on another provider than the
//! one addressed needs the operator's credential for it (`NM_PROVIDER_KEY_<NAME>`); without one
//! the request passes unchanged, and a throttled WARN says why.
//!
//! The arm changes only the model: the bytes of the body's top-level `model` string's contents
//! ([`rewrite_body`]; every other byte stays as received), or the path's model segment
//! ([`rewrite_path`]). Everything an arm needs per request (the model JSON-escaped and
//! percent-encoded, its `NM-Variant` value, its provider) is made once, when the set is applied.
//!
//! Outside experiments the cost is one atomic load while no experiment is applied, else one
//! read-locked hash-map lookup that misses. The lock is never held across an await. In one,
//! each worker thread remembers its sessions' arms ([`ASSIGNED`]), so a session's later requests
//! skip the arms' keyed hashes.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use bytes::{Bytes, BytesMut};
use http::HeaderValue;
use nm_types::Env;
use nm_types::experiment::{Live, Variant};
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use tracing::{info, warn};

use crate::providers::{Provider, Registry, WireFormat};

/// The answer header naming the experiment and arm that served a request.
pub const NM_VARIANT: http::HeaderName = http::HeaderName::from_static("nm-variant");

/// What a path segment may not hold as is (RFC 3986 §3.3 `pchar`, less `:`, which ends a
/// Gemini model segment).
const SEGMENT: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'/')
    .add(b':')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'[')
    .add(b'\\')
    .add(b']')
    .add(b'^')
    .add(b'`')
    .add(b'{')
    .add(b'|')
    .add(b'}');

/// The live experiments this dataplane applies. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct Experiments {
    inner: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    registry: Arc<Registry>,
    /// Whether any experiment is applied: a request reads only this while none is.
    any: AtomicBool,
    index: RwLock<Arc<Index>>,
    /// The set last received, so a heartbeat's unchanged set costs a comparison, not a rebuild
    /// (nor its log lines).
    received: Mutex<Vec<Live>>,
}

/// Agent -> the experiments on it, those of one env before those of every env.
#[derive(Debug, Default)]
struct Index {
    /// Which set this is (never 0, never reused): what a thread's remembered arms were made in.
    generation: u64,
    by_agent: HashMap<Arc<str>, Vec<Arc<Applied>>, foldhash::fast::RandomState>,
}

/// Where [`Index::generation`] comes from.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// Sessions remembered at most this many per thread; a full memory starts over.
const ASSIGNED_CAPACITY: usize = 4096;

thread_local! {
    /// This thread's recent assignments. A session sends many requests, and choosing its arm
    /// (a SipHash-2-4 and a logarithm per arm) was a third of what an experiment cost each.
    static ASSIGNED: RefCell<Assigned> = RefCell::new(Assigned::default());
}

/// Session -> (experiment, arm), for the index of `generation` only: an entry names its
/// experiment by address, which that index keeps alive, and a new index (weights changed, an
/// experiment stopped) forgets every entry at once.
#[derive(Default)]
struct Assigned {
    generation: u64,
    entries: HashMap<Box<str>, (usize, usize), foldhash::fast::RandomState>,
}

impl Assigned {
    /// `session`'s arm in `experiment`, chosen by `choose` unless remembered.
    fn arm(
        &mut self,
        generation: u64,
        experiment: &Applied,
        session: &str,
        choose: impl FnOnce() -> Option<usize>,
    ) -> Option<usize> {
        let address = std::ptr::from_ref(experiment) as usize;
        if self.generation != generation {
            self.entries.clear();
            self.generation = generation;
        } else if let Some(&(at, arm)) = self.entries.get(session)
            && at == address
        {
            return Some(arm);
        }
        let arm = choose()?;
        if self.entries.len() >= ASSIGNED_CAPACITY {
            self.entries.clear();
        }
        self.entries.insert(session.into(), (address, arm));
        Some(arm)
    }
}

/// One experiment as applied: the live experiment and what its arms need per request.
#[derive(Debug)]
pub struct Applied {
    pub live: Live,
    /// The wire format all its arms' providers speak.
    pub format: WireFormat,
    /// In the order of `live.arms`.
    pub arms: Vec<Arm>,
}

/// What one arm needs per request, made when the set is applied.
#[derive(Debug)]
pub struct Arm {
    pub name: Arc<str>,
    pub provider: Arc<Provider>,
    pub model: Arc<str>,
    /// The model as the contents of a JSON string.
    pub model_json: Bytes,
    /// The model as a path segment.
    pub model_path: Box<str>,
    /// `NM-Variant: <experiment id>/<arm>`.
    pub variant: HeaderValue,
}

/// A request's experiment and arm.
#[derive(Debug, Clone)]
pub struct Assignment {
    pub experiment: Arc<Applied>,
    pub arm: usize,
}

impl Assignment {
    pub fn arm(&self) -> &Arm {
        &self.experiment.arms[self.arm]
    }

    pub fn id(&self) -> &Arc<str> {
        &self.experiment.live.id
    }

    /// The record's variant; `requested` is the model the client named, kept when the arm
    /// serves another.
    pub fn variant(&self, requested: Option<String>) -> Variant {
        let arm = self.arm();
        Variant {
            experiment: self.experiment.live.id.clone(),
            arm: arm.name.clone(),
            requested_model: requested.filter(|m| **m != *arm.model),
        }
    }
}

/// Why an experiment was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{0}")]
    Invalid(&'static str),
    #[error("arm {arm:?} names provider {provider:?}, which this dataplane does not have")]
    UnknownProvider { arm: String, provider: String },
    #[error("its arms' providers speak different wire formats")]
    MixedFormats,
    #[error("arm {arm:?}'s model cannot be sent in a header or path")]
    UnsendableModel { arm: String },
}

impl Experiments {
    /// None applied yet; arms' providers are looked up in `registry`.
    pub fn new(registry: Arc<Registry>) -> Self {
        Self {
            inner: Arc::new(Shared {
                registry,
                any: AtomicBool::new(false),
                index: RwLock::default(),
                received: Mutex::default(),
            }),
        }
    }

    /// Replaces the applied set with the experiments of `live` this dataplane can serve. A set
    /// equal to the last one received changes nothing.
    pub fn apply(&self, live: Vec<Live>) {
        let mut received = self
            .inner
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *received == live {
            return;
        }
        let mut index = Index {
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
            ..Index::default()
        };
        let mut ids = Vec::new();
        for e in &live {
            match self.prepare(e) {
                Ok(applied) => {
                    ids.push(e.id.clone());
                    index
                        .by_agent
                        .entry(e.agent.clone())
                        .or_default()
                        .push(Arc::new(applied));
                }
                Err(why) => warn!(
                    experiment = %e.id,
                    problem = %why,
                    "experiment not applied; its requests pass unchanged"
                ),
            }
        }
        for list in index.by_agent.values_mut() {
            // One env's experiment before every env's; then by id, so the order is the same
            // on every dataplane.
            list.sort_by(|a, b| {
                (a.live.env.is_none(), &a.live.id).cmp(&(b.live.env.is_none(), &b.live.id))
            });
        }
        let any = !index.by_agent.is_empty();
        *self
            .inner
            .index
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(index);
        self.inner.any.store(any, Ordering::Release);
        ids.sort();
        info!(
            experiments = %ids.join(","),
            count = ids.len(),
            "applied experiments changed"
        );
        *received = live;
    }

    fn prepare(&self, e: &Live) -> Result<Applied, Refused> {
        e.check().map_err(Refused::Invalid)?;
        let mut format = None;
        let mut arms = Vec::with_capacity(e.arms.len());
        for arm in &e.arms {
            let provider = self
                .inner
                .registry
                .get(&arm.provider)
                .cloned()
                .ok_or_else(|| Refused::UnknownProvider {
                    arm: arm.name.to_string(),
                    provider: arm.provider.to_string(),
                })?;
            if *format.get_or_insert(provider.format) != provider.format {
                return Err(Refused::MixedFormats);
            }
            let unsendable = || Refused::UnsendableModel {
                arm: arm.name.to_string(),
            };
            let json = serde_json::to_string(&*arm.model).map_err(|_| unsendable())?;
            let model_json = Bytes::copy_from_slice(
                json.as_bytes()
                    .get(1..json.len().saturating_sub(1))
                    .ok_or_else(unsendable)?,
            );
            let variant = HeaderValue::try_from(format!("{}/{}", e.id, arm.name))
                .map_err(|_| unsendable())?;
            arms.push(Arm {
                name: arm.name.clone(),
                provider,
                model: arm.model.clone(),
                model_json,
                model_path: utf8_percent_encode(&arm.model, SEGMENT)
                    .to_string()
                    .into_boxed_str(),
                variant,
            });
        }
        Ok(Applied {
            live: e.clone(),
            format: format.ok_or(Refused::Invalid("a live experiment has 1 to 16 arms"))?,
            arms,
        })
    }

    /// The ids of the experiments applied now, sorted.
    pub fn applied(&self) -> Vec<Arc<str>> {
        let index = self.snapshot();
        let mut ids: Vec<_> = index
            .by_agent
            .values()
            .flatten()
            .map(|a| a.live.id.clone())
            .collect();
        ids.sort();
        ids
    }

    fn snapshot(&self) -> Arc<Index> {
        self.inner
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The experiment and arm of a request by `agent` in `env` with `session` to a provider
    /// of wire format `format`, if it is in one (the caller has checked the opt-out and that
    /// it names a model).
    pub fn assign(
        &self,
        agent: Option<&str>,
        env: Option<Env>,
        session: Option<&str>,
        format: WireFormat,
    ) -> Option<Assignment> {
        if !self.inner.any.load(Ordering::Acquire) {
            return None;
        }
        let (agent, session) = (agent?, session?);
        let (generation, experiment) = {
            let index = self
                .inner
                .index
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            let experiment = index
                .by_agent
                .get(agent)?
                .iter()
                .find(|a| a.live.env.is_none_or(|e| Some(e) == env))?
                .clone();
            (index.generation, experiment)
        };
        if experiment.format != format {
            return None;
        }
        let arm = ASSIGNED.with_borrow_mut(|assigned| {
            assigned.arm(generation, &experiment, session, || {
                let chosen = experiment.live.assign(session);
                experiment
                    .live
                    .arms
                    .iter()
                    .position(|a| std::ptr::eq(a, chosen))
            })
        })?;
        Some(Assignment { experiment, arm })
    }
}

/// `body` with the bytes at `span` (a JSON string's contents) replaced by `model_json`; every
/// other byte as received.
pub fn rewrite_body(body: &[u8], span: Range<usize>, model_json: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(body.len() - span.len() + model_json.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(model_json);
    out.extend_from_slice(&body[span.end..]);
    out.freeze()
}

/// `path` with the model segment at `span` replaced by `model_path`.
pub fn rewrite_path(path: &str, span: Range<usize>, model_path: &str) -> String {
    let mut out = String::with_capacity(path.len() - span.len() + model_path.len());
    out.push_str(&path[..span.start]);
    out.push_str(model_path);
    out.push_str(&path[span.end..]);
    out
}

#[cfg(test)]
#[path = "experiment_tests.rs"]
mod tests;
