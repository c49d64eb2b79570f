//! Synthetic traffic with known ground truth, generated from a seed: sessions of an agent with
//! their proxied requests (model, provider, env, end user, cost, time to first byte) and their
//! signals, written through the controlplane's real ingest path ([`Records::ingest`]) and into
//! the `signals` table (and the session rollups) as the signal writer stores them (attributed to
//! the session's agent).
//!
//! Used by `nm-gateway demo`, the tests (model B truly better than A, equal models, a cheaper
//! equal model) and the benchmark. Deterministic: the same specs and seed give the same rows.
//!
//! Each session draws a model (by weight), an env, an end user (Zipf: a few heavy users), a
//! time to first byte (log-normal around the model's median) and its final outcome: a success
//! with the model's probability (plus the env's shift; minus the latency effect, if any), else
//! a failure (abandoned, heavy edit or thumbs-down in the spec's shares). Zero or more
//! regenerations come first, each with its own request. Success actions are spread over
//! accepted, light edit, sent, published and thumbs-up.

use sea_orm::{ActiveValue, EntityTrait, Set};

use super::rollup::{SignalFacts, add_requests, add_signals};

use crate::error::Result;
use crate::records::{RequestRecord, Usage, UsageStatus};
use crate::sql::insert_chunks;
use crate::store::Store;
use crate::store::entity::signal;
use crate::{Budgets, Records};

const DAY_MS: i64 = 86_400_000;

/// One model an agent uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub provider: String,
    pub model: String,
    /// Share of the sessions (relative weight).
    pub weight: f64,
    /// True probability that a session ends in a success.
    pub success: f64,
    /// Cost of one request, micro-dollars.
    pub cost_micros: u64,
    /// Median time to first byte, ms.
    pub ttfb_ms: f64,
}

impl ModelSpec {
    pub fn new(provider: &str, model: &str, success: f64, cost_micros: u64) -> Self {
        Self {
            provider: provider.to_owned(),
            model: model.to_owned(),
            weight: 1.0,
            success,
            cost_micros,
            ttfb_ms: 700.0,
        }
    }
}

/// One environment: its share of sessions and its shift of every model's success rate.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvSpec {
    pub env: String,
    pub weight: f64,
    pub success_shift: f64,
}

/// One agent's traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSpec {
    pub agent: String,
    pub sessions: usize,
    /// Sessions are spread evenly over the last `days` days before `now`.
    pub days: i64,
    pub models: Vec<ModelSpec>,
    pub envs: Vec<EnvSpec>,
    pub users: usize,
    /// Zipf exponent of the users' activity (0: even; above 1: a few users dominate).
    pub user_skew: f64,
    /// Mean regenerations before the final signal.
    pub regenerations: f64,
    /// Shares of the failures that end abandoned and heavily edited (the rest: thumbs-down).
    pub abandon_share: f64,
    pub heavy_edit_share: f64,
    /// Probability per second of TTFB above 2 s that a would-be success is abandoned instead.
    pub slow_abandon_per_sec: f64,
}

impl AgentSpec {
    /// An agent with `sessions` sessions over the last 28 days, in production only, 200 end
    /// users evenly active, few regenerations, no latency effect.
    pub fn new(agent: &str, sessions: usize, models: Vec<ModelSpec>) -> Self {
        Self {
            agent: agent.to_owned(),
            sessions,
            days: 28,
            models,
            envs: vec![EnvSpec {
                env: "production".to_owned(),
                weight: 1.0,
                success_shift: 0.0,
            }],
            users: 200,
            user_skew: 0.0,
            regenerations: 0.2,
            abandon_share: 0.3,
            heavy_edit_share: 0.2,
            slow_abandon_per_sec: 0.0,
        }
    }
}

/// What [`generate`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub sessions: u64,
    pub requests: u64,
    pub signals: u64,
}

// === impl Rng ===

/// SplitMix64: tiny, fast and the same on every platform and version.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Log-normal with this median and log-sd.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        // Box-Muller.
        let u1 = self.f64().max(1e-12);
        let u2 = self.f64();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        median * (sigma * z).exp()
    }

    /// An index drawn with these relative weights.
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.f64() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len().saturating_sub(1)
    }
}

/// Cumulative Zipf weights over `n` items with exponent `s`, for drawing by bisection.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (1..=n.max(1))
        .map(|k| {
            acc += 1.0 / (k as f64).powf(s);
            acc
        })
        .collect();
    for c in &mut cdf {
        *c /= acc;
    }
    cdf
}

/// One generated session.
struct Session {
    requests: Vec<RequestRecord>,
    signals: Vec<signal::ActiveModel>,
}

/// Generates the sessions of `spec` (numbered from `index` so several specs can share a
/// database) and hands them to `sink` in batches.
pub struct Generator<'a> {
    spec: &'a AgentSpec,
    rng: Rng,
    users: Vec<f64>,
    tag: String,
    now_ms: i64,
    next: usize,
}

impl<'a> Generator<'a> {
    pub fn new(spec: &'a AgentSpec, seed: u64, tag: &str, now_ms: i64) -> Self {
        Self {
            users: zipf_cdf(spec.users, spec.user_skew),
            spec,
            rng: Rng::new(seed),
            tag: tag.to_owned(),
            now_ms,
            next: 0,
        }
    }

    fn session(&mut self) -> Option<Session> {
        let spec = self.spec;
        if self.next >= spec.sessions || spec.models.is_empty() {
            return None;
        }
        let i = self.next;
        self.next += 1;
        let rng = &mut self.rng;
        let model =
            &spec.models[rng.weighted(&spec.models.iter().map(|m| m.weight).collect::<Vec<_>>())];
        let env = (!spec.envs.is_empty()).then(|| {
            &spec.envs[rng.weighted(&spec.envs.iter().map(|e| e.weight).collect::<Vec<_>>())]
        });
        let u = rng.f64();
        let user = self.users.partition_point(|c| *c < u);
        let user_id = format!("user-{:04}", user + 1);
        let session_id = format!("sess_{}{i}", self.tag);
        // Evenly over the span, ending an hour before now, with jitter.
        let span = spec.days.max(1) * DAY_MS - 3_600_000;
        let start = self.now_ms - 3_600_000 - span
            + (span as f64 * (i as f64 + rng.f64()) / spec.sessions as f64) as i64;
        let ttfb = rng.lognormal(model.ttfb_ms, 0.5).clamp(50.0, 60_000.0);

        let mut regens = 0u32;
        while regens < 5 && rng.chance(spec.regenerations / (1.0 + spec.regenerations)) {
            regens += 1;
        }
        let p = (model.success + env.map_or(0.0, |e| e.success_shift)).clamp(0.0, 1.0);
        let mut success = rng.chance(p);
        let slow_secs = ((ttfb - 2_000.0) / 1_000.0).max(0.0);
        let latency_abandon =
            success && rng.chance((spec.slow_abandon_per_sec * slow_secs).min(0.9));
        if latency_abandon {
            success = false;
        }
        let (action, edit_distance) = if success {
            match rng.weighted(&[0.45, 0.2, 0.1, 0.05, 0.2]) {
                0 => ("accepted", None),
                1 => ("edited", Some(5 + rng.below(150) as i64)),
                2 => ("sent", None),
                3 => ("published", None),
                _ => ("thumbs_up", None),
            }
        } else if latency_abandon || rng.chance(spec.abandon_share) {
            ("abandoned", None)
        } else if rng.chance(spec.heavy_edit_share / (1.0 - spec.abandon_share).max(1e-9)) {
            ("edited", Some(200 + rng.below(800) as i64))
        } else {
            ("thumbs_down", None)
        };

        let mut requests = Vec::new();
        let mut signals = Vec::new();
        for k in 0..=regens {
            let at = start + i64::from(k) * 45_000;
            requests.push(RequestRecord {
                request_id: format!("{session_id}-{k}"),
                started_at_ms: at,
                key_id: "key_synthetic".into(),
                provider: model.provider.as_str().into(),
                method: "POST".into(),
                path: "/v1/chat/completions".to_owned(),
                model: Some(model.model.clone()),
                agent: Some(spec.agent.clone()),
                session_id: session_id.parse().ok(),
                env: env.and_then(|e| e.env.parse().ok()),
                user_id: Some(user_id.clone()),
                status: 200,
                latency_ms: ttfb as u64 + 1_500,
                ttfb_ms: Some(ttfb as u64),
                streamed: true,
                error_code: None,
                response_bytes: 2_000,
                usage: Usage {
                    input_tokens: Some(800),
                    output_tokens: Some(300),
                    ..Usage::default()
                },
                usage_status: UsageStatus::Reported,
                cost_micros: Some(model.cost_micros),
                budget_micros: Some(model.cost_micros),
                trace: None,
                inferred: Vec::new(),
                variant: None,
            });
            let (a, d) = if k < regens {
                ("regenerated", None)
            } else {
                (action, edit_distance)
            };
            signals.push(signal::ActiveModel {
                id: Set(format!("{session_id}-s{k}")),
                received_at_ms: Set(at + 20_000 + ttfb as i64),
                session_id: Set(session_id.clone()),
                request_id: Set(None),
                action: Set(a.to_owned()),
                edit_distance: Set(d),
                custom_label: Set(None),
                key_id: Set("key_synthetic".to_owned()),
                idempotency_key: Set(None),
                agent_hint: Set(Some(spec.agent.clone())),
                agent: Set(Some(spec.agent.clone())),
                env: Set(env.map(|e| e.env.clone())),
                user_id: Set(Some(user_id.clone())),
                attributed_by_session: Set(true),
                source: Set("explicit".to_owned()),
                rule: Set(None),
            });
        }
        Some(Session { requests, signals })
    }
}

/// How [`generate_with`] writes requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Through [`Records::ingest`], as a dataplane ships them: the `sessions` table and the
    /// spend rollups are kept too.
    Ingest,
    /// Plain multi-row inserts into `requests` (and the analytics' session rollups) only: much
    /// faster, for statistical tests and benchmarks that read requests, signals and rollups only.
    Direct,
}

/// Writes the traffic of every spec (each from its own stream of `seed`) into `store`, in
/// batches of about `batch` requests, through [`Records::ingest`]; signals are inserted
/// attributed, as the signal writer stores them once the session is known.
pub fn generate<'a>(
    store: &'a Store,
    specs: &'a [AgentSpec],
    seed: u64,
    now_ms: i64,
    batch: usize,
) -> crate::BoxFuture<'a, Result<Written>> {
    Box::pin(async move { generate_with(store, specs, seed, now_ms, batch, Path::Ingest).await })
}

/// [`generate`], writing requests the way `path` says.
#[tracing::instrument(skip_all, fields(agents = specs.len(), seed, ?path))]
pub fn generate_with<'a>(
    store: &'a Store,
    specs: &'a [AgentSpec],
    seed: u64,
    now_ms: i64,
    batch: usize,
    path: Path,
) -> crate::BoxFuture<'a, Result<Written>> {
    Box::pin(async move {
        let budgets = Budgets::load(store.clone(), now_ms).await?;
        let records = Records::new(store.clone(), budgets);
        let mut written = Written::default();
        for (n, spec) in specs.iter().enumerate() {
            let tag = format!("{seed:x}x{n}x");
            let mut g = Generator::new(
                spec,
                seed.wrapping_mul(1_000_003).wrapping_add(n as u64),
                &tag,
                now_ms,
            );
            loop {
                let mut requests = Vec::new();
                let mut signals = Vec::new();
                while requests.len() < batch.max(1) {
                    let Some(s) = g.session() else { break };
                    written.sessions += 1;
                    requests.extend(s.requests);
                    signals.extend(s.signals);
                }
                if requests.is_empty() {
                    break;
                }
                written.requests += requests.len() as u64;
                written.signals += signals.len() as u64;
                match path {
                    Path::Ingest => {
                        records.ingest(&requests).await?;
                    }
                    Path::Direct => insert_requests(store, requests).await?,
                }
                insert_signals(store, signals).await?;
            }
        }
        Ok(written)
    })
}

async fn insert_requests(store: &Store, rows: Vec<RequestRecord>) -> Result<()> {
    let txn = store.begin_write().await?;
    let refs: Vec<&RequestRecord> = rows.iter().collect();
    add_requests(&txn, &refs).await?;
    crate::usage::add_day_totals(&txn, &refs).await?;
    for chunk in refs.chunks(4_096) {
        crate::records::write_rows(&txn, chunk).await?;
    }
    txn.commit().await?;
    Ok(())
}

async fn insert_signals(store: &Store, rows: Vec<signal::ActiveModel>) -> Result<()> {
    let txn = store.begin_write().await?;
    let facts: Vec<SignalFacts<'_>> = rows
        .iter()
        .filter_map(|r| {
            match (
                &r.agent,
                &r.session_id,
                &r.received_at_ms,
                &r.action,
                &r.edit_distance,
            ) {
                (
                    ActiveValue::Set(Some(agent)),
                    ActiveValue::Set(session_id),
                    ActiveValue::Set(received_at_ms),
                    ActiveValue::Set(action),
                    ActiveValue::Set(edit_distance),
                ) => Some(SignalFacts {
                    agent,
                    session_id,
                    received_at_ms: *received_at_ms,
                    // The generator writes only valid actions.
                    action: action.parse().ok()?,
                    edit_distance: *edit_distance,
                }),
                _ => None,
            }
        })
        .collect();
    add_signals(&txn, &facts).await?;
    let mut rest = rows.into_iter();
    for size in insert_chunks(rest.len()) {
        let chunk: Vec<_> = rest.by_ref().take(size).collect();
        signal::Entity::insert_many(chunk)
            .exec_without_returning(&txn)
            .await?;
    }
    txn.commit().await?;
    Ok(())
}

/// The demo's agents: a support assistant where one model is truly better, slow answers get
/// abandoned and a few end users dominate the cost; a document search where a much cheaper
/// model performs as well; a code reviewer with a high regeneration rate and staging worse than
/// production; a new agent still collecting signals.
pub fn demo_specs() -> Vec<AgentSpec> {
    let env = |env: &str, weight: f64, success_shift: f64| EnvSpec {
        env: env.to_owned(),
        weight,
        success_shift,
    };
    let mut support = AgentSpec::new(
        "support-assistant",
        2_500,
        vec![
            ModelSpec::new("openai", "gpt-4o", 0.80, 9_000),
            ModelSpec {
                ttfb_ms: 2_500.0,
                ..ModelSpec::new("anthropic", "claude-sonnet-4-5", 0.62, 11_000)
            },
        ],
    );
    support.users = 400;
    support.user_skew = 1.3;
    support.slow_abandon_per_sec = 0.08;
    support.envs = vec![env("production", 0.8, 0.0), env("staging", 0.2, 0.0)];

    // "As good within 5 points" takes more sessions than "better": about 4,000 per model to be
    // likely at equal rates (anytime-valid intervals, see `stats`).
    let mut search = AgentSpec::new(
        "doc-search",
        8_000,
        vec![
            ModelSpec::new("openai", "gpt-4o", 0.72, 6_000),
            ModelSpec {
                ttfb_ms: 350.0,
                ..ModelSpec::new("openai", "gpt-4o-mini", 0.72, 400)
            },
        ],
    );
    search.users = 300;

    let mut review = AgentSpec::new(
        "code-review",
        1_500,
        vec![ModelSpec::new(
            "anthropic",
            "claude-sonnet-4-5",
            0.62,
            14_000,
        )],
    );
    review.regenerations = 0.9;
    review.users = 60;
    review.envs = vec![env("production", 0.6, 0.05), env("staging", 0.4, -0.2)];

    let mut fresh = AgentSpec::new(
        "email-drafter",
        30,
        vec![ModelSpec::new("openai", "gpt-4o-mini", 0.7, 500)],
    );
    fresh.days = 4;
    fresh.users = 10;
    vec![support, search, review, fresh]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_uniform_enough() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        let xs: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..5).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        let mut r = Rng::new(1);
        let hits = (0..10_000).filter(|_| r.chance(0.3)).count();
        assert!((2_800..3_200).contains(&hits), "{hits}");
    }

    #[test]
    fn sessions_follow_the_spec() {
        let spec = AgentSpec::new("a", 2_000, vec![ModelSpec::new("openai", "m", 0.7, 100)]);
        let mut g = Generator::new(&spec, 3, "t", 1_800_000_000_000);
        let mut sessions = 0;
        let mut successes = 0;
        while let Some(s) = g.session() {
            sessions += 1;
            assert_eq!(s.requests.len(), s.signals.len());
            let last = s.signals.last().unwrap();
            let action = last.action.clone().unwrap();
            let d = last.edit_distance.clone().unwrap().map(|d| d as u64);
            let action: nm_types::Action = action.parse().unwrap();
            successes += u32::from(super::super::outcome::is_success(action, d));
        }
        assert_eq!(sessions, 2_000);
        let rate = f64::from(successes) / 2_000.0;
        assert!((0.66..0.74).contains(&rate), "{rate}");
    }
}
