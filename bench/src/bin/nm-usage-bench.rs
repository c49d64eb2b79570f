//! `nm-usage-bench`: how long the usage and cost reports take on millions of request records,
//! computed by the database, and how fast those records are stored.
//!
//! `cargo build --profile dist -p nm-bench --bin nm-usage-bench && target/dist/nm-usage-bench`
//!
//! For each database (SQLite on a file in a temporary directory; PostgreSQL in a fresh
//! `nm_usage_bench_<random>` database created on the server named by `--postgres`, dropped at the
//! end, skipped with `--no-postgres`) it stores `--records` (default 1,000,000) request records
//! through the controlplane's real ingest path (`Records::ingest`, batches of 1,000, as a
//! dataplane ships them) and reports the fill rate. The data is generated from `--seed`, the same
//! for every database: 20 agents, 5,000 end users (a few heavy ones), up to 50,000 sessions,
//! three envs, four providers with a few models each, spread over the last 60 days; ~2 % of the
//! requests use an unpriced model, ~2 % carry no usage, ~3 % are errors, ~80 % name an end user.
//!
//! Then it runs seven `Usage::report` queries (totals, by agent, agent+model, user, day,
//! session, provider+model, over various time ranges) and `Budgets::load` (the startup load of
//! the month's spend), each `--runs` times (default 3), and prints min and median in ms. The
//! target, printed as PASS/FAIL: every report's median under 2,000 ms. The exit status is 0
//! unless the bench itself failed.
//!
//! On PostgreSQL the bench runs `VACUUM ANALYZE` after the fill, as autovacuum would on its own
//! in production (otherwise the timings depend on whether it has run yet); SQLite is queried
//! as the gateway leaves it.

use nm_bench::{DatabaseArgs, ScratchPg};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Parser;
use nm_controlplane::usage::{Dimension, UsageFilter, UsageReports, UsageRow};
use nm_controlplane::{Budgets, Records, RequestRecord, Store, Usage, UsageStatus};
use sea_orm::{ConnectionTrait, Statement};
use serde::Serialize;

const DAY_MS: i64 = 86_400_000;
const SPAN_DAYS: i64 = 60;
const BATCH: usize = 1_000;
const USERS: usize = 5_000;
const MAX_SESSIONS: usize = 50_000;
/// Sessions sending requests at the same time; a batch mixes their requests.
const CONCURRENT_SESSIONS: usize = 64;
/// Share of the records that name an end user.
const USER_SHARE: f64 = 0.8;
/// What a successful answer without a price counts against a budget (a dataplane's reservation).
const RESERVATION_MICROS: u64 = 20_000;
const TARGET_MS: f64 = 2_000.0;

const AGENTS: [&str; 20] = [
    "support-assistant",
    "code-review",
    "sales-copilot",
    "doc-search",
    "ticket-triage",
    "email-drafter",
    "meeting-notes",
    "sql-helper",
    "onboarding-guide",
    "contract-review",
    "translation",
    "qa-generator",
    "changelog-writer",
    "incident-summary",
    "hr-faq",
    "pricing-quote",
    "data-extractor",
    "research-agent",
    "social-posts",
    "release-checker",
];

/// A model requests ask for; `price` is (input, output) USD per million tokens, which is also
/// micro-dollars per token. None: the gateway has no price for it.
struct Model {
    provider: &'static str,
    name: &'static str,
    answered: &'static str,
    price: Option<(f64, f64)>,
    reasoning: bool,
}

const fn model(
    provider: &'static str,
    name: &'static str,
    answered: &'static str,
    price: Option<(f64, f64)>,
    reasoning: bool,
) -> Model {
    Model {
        provider,
        name,
        answered,
        price,
        reasoning,
    }
}

#[rustfmt::skip]
const MODELS: [Model; 13] = [
    model("openai", "gpt-4o", "gpt-4o-2024-08-06", Some((2.5, 10.0)), false),
    model("openai", "gpt-4o-mini", "gpt-4o-mini-2024-07-18", Some((0.15, 0.6)), false),
    model("openai", "gpt-4.1", "gpt-4.1-2025-04-14", Some((2.0, 8.0)), false),
    model("openai", "o3-mini", "o3-mini-2025-01-31", Some((1.1, 4.4)), true),
    model("anthropic", "claude-sonnet-4-20250514", "claude-sonnet-4-20250514", Some((3.0, 15.0)), false),
    model("anthropic", "claude-3-5-haiku-20241022", "claude-3-5-haiku-20241022", Some((0.8, 4.0)), false),
    model("anthropic", "claude-opus-4-20250514", "claude-opus-4-20250514", Some((15.0, 75.0)), false),
    model("gemini", "gemini-2.5-pro", "gemini-2.5-pro", Some((1.25, 10.0)), true),
    model("gemini", "gemini-2.5-flash", "gemini-2.5-flash", Some((0.3, 2.5)), false),
    model("groq", "llama-3.3-70b-versatile", "llama-3.3-70b-versatile", Some((0.59, 0.79)), false),
    model("groq", "llama-3.1-8b-instant", "llama-3.1-8b-instant", Some((0.05, 0.08)), false),
    model("groq", "qwen-qwq-32b", "qwen-qwq-32b", None, true),
    model("groq", "deepseek-r1-distill-llama-70b", "deepseek-r1-distill-llama-70b", None, true),
];

/// Share of the requests sent to an unpriced model.
const UNPRICED_SHARE: f64 = 0.02;

#[derive(Debug, Parser)]
#[command(
    about = "Usage and cost reports on millions of request records, on SQLite and PostgreSQL"
)]
struct Cli {
    /// Request records to store.
    #[arg(long, default_value_t = 1_000_000)]
    records: usize,
    /// Seed of the generated data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Runs of each timed query.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    #[command(flatten)]
    db: DatabaseArgs,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Records carry implicit signals, as the dataplane's rules infer them: each request after
    /// a session's first says what came of the one before (continued 60 %, history_edit 20 %,
    /// reask 10 %), a streamed answer is abandoned 5 % of the time (about 0.95 signals per
    /// record).
    #[arg(long)]
    inferred: bool,
}

/// SplitMix64: small, fast, and the same sequence for a seed on every platform.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.f64()
    }

    /// Uniform in [0, n).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }

    /// Log-normal around `median`: a few values far above it, as token counts and latencies are.
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let u = self.f64().max(f64::MIN_POSITIVE);
        let normal = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.f64()).cos();
        median * (sigma * normal).exp()
    }
}

/// Ranks 0..n drawn with weight 1 / (rank + 1)^s: rank 0 the most frequent.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += (k as f64).powf(-s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Self { cdf }
    }

    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// What an agent mostly does: which models it calls and how long its prompts are.
struct Agent {
    primary: usize,
    secondary: usize,
    input_median: f64,
    stream_share: f64,
}

struct Session {
    id: String,
    agent: usize,
    env: &'static str,
    user_id: Option<String>,
    start_ms: i64,
    gap_ms: i64,
    requests: u32,
    sent: u32,
    /// The request id of the session's last request.
    last: Option<String>,
}

/// The generated records, produced batch by batch in roughly chronological order.
struct Dataset {
    rng: Rng,
    agents: Vec<Agent>,
    priced: Vec<usize>,
    unpriced: Vec<usize>,
    sessions: Vec<Session>,
    next_session: usize,
    active: Vec<usize>,
    produced: usize,
    inferred: bool,
}

impl Dataset {
    fn sessions_for(records: usize) -> usize {
        (records / 20).clamp(1, MAX_SESSIONS)
    }

    fn new(seed: u64, records: usize, now_ms: i64, inferred: bool) -> Self {
        let mut rng = Rng(seed);
        let priced: Vec<usize> = (0..MODELS.len())
            .filter(|&i| MODELS[i].price.is_some())
            .collect();
        let unpriced: Vec<usize> = (0..MODELS.len())
            .filter(|&i| MODELS[i].price.is_none())
            .collect();
        let agents = (0..AGENTS.len())
            .map(|_| Agent {
                primary: priced[rng.below(priced.len())],
                secondary: priced[rng.below(priced.len())],
                input_median: 300.0 * 30f64.powf(rng.f64()),
                stream_share: rng.range(0.3, 0.9),
            })
            .collect();

        let count = Self::sessions_for(records);
        // Every session sends one request, the rest are shared out by a heavy-tailed weight.
        let weights: Vec<f64> = (0..count).map(|_| rng.lognormal(1.0, 1.2)).collect();
        let total_weight: f64 = weights.iter().sum();
        let extra = records.saturating_sub(count);
        let mut sizes: Vec<u32> = weights
            .iter()
            .map(|w| 1 + (extra as f64 * w / total_weight) as u32)
            .collect();
        let mut missing = records.saturating_sub(sizes.iter().map(|&s| s as usize).sum());
        while missing > 0 {
            sizes[rng.below(count)] += 1;
            missing -= 1;
        }

        let agent_rank = Zipf::new(AGENTS.len(), 0.8);
        let user_rank = Zipf::new(USERS, 0.9);
        let earliest = now_ms - SPAN_DAYS * DAY_MS;
        let latest = now_ms - 3_600_000;
        let mut sessions: Vec<Session> = sizes
            .into_iter()
            .map(|requests| {
                let start_ms = earliest + (rng.f64() * (latest - earliest) as f64) as i64;
                let gap = rng.lognormal(20_000.0, 0.8).clamp(1_000.0, 600_000.0) as i64;
                let room = (now_ms - start_ms) / i64::from(requests);
                let env = match rng.f64() {
                    p if p < 0.80 => "production",
                    p if p < 0.94 => "staging",
                    _ => "development",
                };
                Session {
                    id: String::new(),
                    agent: agent_rank.sample(&mut rng),
                    env,
                    user_id: rng
                        .chance(USER_SHARE)
                        .then(|| format!("user_{:05}", user_rank.sample(&mut rng))),
                    start_ms,
                    gap_ms: gap.min(room).max(1),
                    requests,
                    sent: 0,
                    last: None,
                }
            })
            .collect();
        sessions.sort_by_key(|s| s.start_ms);
        for (i, s) in sessions.iter_mut().enumerate() {
            s.id = format!("sess_{i:05x}{:015x}", rng.next_u64() >> 4);
        }
        Self {
            rng,
            agents,
            priced,
            unpriced,
            sessions,
            next_session: 0,
            active: Vec::with_capacity(CONCURRENT_SESSIONS),
            produced: 0,
            inferred,
        }
    }

    /// Up to `n` more records; empty when all are out.
    fn batch(&mut self, n: usize) -> Vec<RequestRecord> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            while self.active.len() < CONCURRENT_SESSIONS && self.next_session < self.sessions.len()
            {
                self.active.push(self.next_session);
                self.next_session += 1;
            }
            if self.active.is_empty() {
                break;
            }
            let slot = self.rng.below(self.active.len());
            let s = self.active[slot];
            let record = self.record(s);
            let session = &mut self.sessions[s];
            session.last = Some(record.request_id.clone());
            out.push(record);
            session.sent += 1;
            if session.sent == session.requests {
                self.active.swap_remove(slot);
            }
        }
        out
    }

    fn record(&mut self, s: usize) -> RequestRecord {
        self.produced += 1;
        let seq = self.produced;
        let rng = &mut self.rng;
        let session = &self.sessions[s];
        let agent = &self.agents[session.agent];
        let started_at_ms = session.start_ms
            + i64::from(session.sent) * session.gap_ms
            + rng.below(session.gap_ms as usize) as i64;

        let m = if rng.chance(UNPRICED_SHARE) {
            self.unpriced[rng.below(self.unpriced.len())]
        } else {
            match rng.f64() {
                p if p < 0.7 => agent.primary,
                p if p < 0.9 => agent.secondary,
                _ => self.priced[rng.below(self.priced.len())],
            }
        };
        let model = &MODELS[m];
        let streamed = rng.chance(agent.stream_share);
        let outcome = Outcome::draw(rng, streamed, session.user_id.is_some());

        let (usage, cost_micros, usage_status) = match outcome {
            Outcome::Answered(status @ (UsageStatus::Reported | UsageStatus::Partial)) => {
                let input = rng.lognormal(agent.input_median, 1.0).clamp(1.0, 200_000.0) as u64;
                let mut output = rng.lognormal(300.0, 0.9).clamp(1.0, 16_000.0) as u64;
                if status == UsageStatus::Partial {
                    output = (output as f64 * rng.range(0.1, 0.9)) as u64;
                }
                let cached = (matches!(model.provider, "openai" | "anthropic")
                    && input >= 1_024
                    && rng.chance(0.35))
                .then(|| (input as f64 * rng.range(0.3, 0.9)) as u64);
                let reasoning = model
                    .reasoning
                    .then(|| (output as f64 * rng.range(0.2, 0.7)) as u64);
                let cost = model.price.map(|(p_in, p_out)| {
                    let cached_in = cached.unwrap_or(0);
                    let billed = (input - cached_in) as f64 * p_in
                        + cached_in as f64 * p_in * 0.25
                        + output as f64 * p_out;
                    billed.round() as u64
                });
                let finish = match (status, rng.f64()) {
                    (UsageStatus::Partial, _) => None,
                    (_, p) if p < 0.85 => Some("stop"),
                    (_, p) if p < 0.95 => Some("tool_calls"),
                    _ => Some("length"),
                };
                let usage = Usage {
                    model: Some(model.answered.to_owned()),
                    input_tokens: Some(input),
                    output_tokens: Some(output),
                    cached_input_tokens: cached,
                    cache_write_tokens: None,
                    reasoning_tokens: reasoning,
                    finish_reason: finish.map(str::to_owned),
                    response_id: None,
                };
                (usage, cost, status)
            }
            Outcome::Answered(status) | Outcome::UpstreamError(_, status) => {
                (Usage::default(), None, status)
            }
            Outcome::GatewayError(..) => (Usage::default(), None, UsageStatus::NotApplicable),
        };
        let (status, error_code) = match outcome {
            Outcome::Answered(_) => (200, None),
            Outcome::UpstreamError(code, _) => (code, None),
            Outcome::GatewayError(code, name) => (code, Some(name.to_owned())),
        };
        let budget_micros = session.user_id.as_ref().and_then(|_| match outcome {
            Outcome::Answered(_) => Some(cost_micros.unwrap_or(RESERVATION_MICROS)),
            Outcome::GatewayError(_, "budget_exceeded") => None,
            Outcome::UpstreamError(..) | Outcome::GatewayError(..) => Some(0),
        });
        let output = usage.output_tokens.unwrap_or(0);
        // A UUIDv7, as the dataplane makes them: the time, then the sequence and random bits.
        let request_id = format!(
            "{:08x}-{:04x}-7{:03x}-{:04x}-{:012x}",
            (started_at_ms >> 16) as u32,
            (started_at_ms & 0xffff) as u16,
            (seq >> 16) & 0xfff,
            0x8000 | (seq & 0x3fff),
            rng.next_u64() >> 16
        );
        let mut inferred = Vec::new();
        if self.inferred {
            use nm_types::record::Inferred;
            use nm_types::signal::Rule;
            if let Some(answer) = session.last.as_deref().and_then(|a| a.parse().ok()) {
                let rule = match rng.f64() {
                    p if p < 0.6 => Some(Rule::Continued),
                    p if p < 0.8 => Some(Rule::HistoryEdit),
                    p if p < 0.9 => Some(Rule::Reask),
                    _ => None,
                };
                if let Some(rule) = rule {
                    inferred.push(Inferred {
                        rule,
                        answer,
                        edit_distance: (rule == Rule::HistoryEdit)
                            .then(|| rng.lognormal(80.0, 1.0) as u64),
                    });
                }
            }
            if streamed
                && rng.chance(0.05)
                && let Ok(answer) = request_id.parse()
            {
                inferred.push(Inferred {
                    rule: Rule::ClientDisconnect,
                    answer,
                    edit_distance: None,
                });
            }
        }
        RequestRecord {
            request_id,
            started_at_ms,
            key_id: format!("key_{:02}", session.agent % 6).into(),
            provider: model.provider.into(),
            method: "POST".into(),
            path: path_of(model),
            model: Some(model.name.to_owned()),
            agent: Some(AGENTS[session.agent].to_owned()),
            session_id: (!rng.chance(0.05))
                .then(|| session.id.parse().ok())
                .flatten(),
            env: session.env.parse().ok(),
            user_id: session.user_id.clone(),
            status,
            latency_ms: rng.lognormal(400.0 + output as f64 * 8.0, 0.5) as u64,
            ttfb_ms: streamed.then(|| rng.lognormal(450.0, 0.5) as u64),
            streamed,
            error_code: error_code.map(Into::into),
            response_bytes: if status == 200 {
                600 + output * if streamed { 25 } else { 5 }
            } else {
                200
            },
            usage,
            usage_status,
            cost_micros,
            budget_micros,
            trace: None,
            inferred,
            variant: None,
        }
    }
}

/// How a request ended.
#[derive(Clone, Copy)]
enum Outcome {
    /// 200, with the usage status of the answer.
    Answered(UsageStatus),
    /// The provider answered an error (no usage in it).
    UpstreamError(u16, UsageStatus),
    /// The gateway answered itself: status and error code.
    GatewayError(u16, &'static str),
}

impl Outcome {
    fn draw(rng: &mut Rng, streamed: bool, has_user: bool) -> Self {
        match rng.f64() {
            p if p < 0.012 => Self::UpstreamError(429, UsageStatus::Missing),
            p if p < 0.017 => Self::UpstreamError(500, UsageStatus::Missing),
            p if p < 0.022 => Self::UpstreamError(503, UsageStatus::Missing),
            p if p < 0.025 => Self::UpstreamError(400, UsageStatus::Missing),
            p if p < 0.028 => Self::GatewayError(502, "upstream_unreachable"),
            p if p < 0.030 && has_user => Self::GatewayError(429, "budget_exceeded"),
            p if p < 0.030 => Self::GatewayError(503, "unavailable"),
            p if p < 0.050 => Self::Answered(UsageStatus::Missing),
            p if p < 0.060 && streamed => Self::Answered(UsageStatus::Partial),
            _ => Self::Answered(UsageStatus::Reported),
        }
    }
}

fn path_of(model: &Model) -> String {
    match model.provider {
        "anthropic" => "/v1/messages".to_owned(),
        "gemini" => format!("/v1beta/models/{}:generateContent", model.name),
        "groq" => "/openai/v1/chat/completions".to_owned(),
        _ => "/v1/chat/completions".to_owned(),
    }
}

/// One timed report.
struct Case {
    name: String,
    dims: Vec<Dimension>,
    filter: UsageFilter,
    limit: u32,
}

fn cases(now_ms: i64) -> Vec<Case> {
    let since = |days: i64| UsageFilter {
        since_ms: Some(now_ms - days * DAY_MS),
        ..Default::default()
    };
    let case = |name: &str, dims: &[Dimension], filter: UsageFilter, limit: u32| Case {
        name: name.to_owned(),
        dims: dims.to_vec(),
        filter,
        limit,
    };
    vec![
        case("total, all time", &[], UsageFilter::default(), 0),
        case("by agent, 7 days", &[Dimension::Agent], since(7), 0),
        case(
            "by agent+model, 30 days",
            &[Dimension::Agent, Dimension::Model],
            since(30),
            0,
        ),
        case(
            "by user, 30 days, top 20",
            &[Dimension::User],
            since(30),
            20,
        ),
        case(
            &format!("by day, 60 days, agent {}", AGENTS[0]),
            &[Dimension::Day],
            UsageFilter {
                agent: Some(AGENTS[0].to_owned()),
                ..since(SPAN_DAYS)
            },
            0,
        ),
        case(
            "by session, 24 hours, top 100",
            &[Dimension::Session],
            since(1),
            100,
        ),
        case(
            "by provider+model, all time",
            &[Dimension::Provider, Dimension::Model],
            UsageFilter::default(),
            0,
        ),
    ]
}

#[derive(Debug, Serialize)]
struct Timing {
    name: String,
    /// Rows returned (a total-only report: 1), None for `Budgets::load`.
    rows: Option<usize>,
    truncated: bool,
    min_ms: f64,
    median_ms: f64,
    runs_ms: Vec<f64>,
    /// None for `Budgets::load`, which has no target.
    pass: Option<bool>,
}

impl Timing {
    fn new(name: String, rows: Option<usize>, truncated: bool, mut runs_ms: Vec<f64>) -> Self {
        let mut sorted = runs_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let mid = sorted.len() / 2;
        let median_ms = if sorted.len() % 2 == 1 {
            sorted[mid]
        } else {
            (sorted[mid - 1] + sorted[mid]) / 2.0
        };
        runs_ms.iter_mut().for_each(|ms| *ms = round2(*ms));
        Self {
            pass: rows.map(|_| median_ms < TARGET_MS),
            name,
            rows,
            truncated,
            min_ms: round2(sorted[0]),
            median_ms: round2(median_ms),
            runs_ms,
        }
    }
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[derive(Debug, Serialize)]
struct Totals {
    requests: u64,
    cost_usd: f64,
    input_tokens: u64,
    output_tokens: u64,
    unpriced_requests: u64,
    unmetered_requests: u64,
    errors: u64,
}

impl From<&UsageRow> for Totals {
    fn from(r: &UsageRow) -> Self {
        Self {
            requests: r.requests,
            cost_usd: round2(r.cost_micros as f64 / 1e6),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            unpriced_requests: r.unpriced_requests,
            unmetered_requests: r.unmetered_requests,
            errors: r.errors,
        }
    }
}

#[derive(Debug, Serialize)]
struct DbResult {
    database: &'static str,
    records: usize,
    fill_seconds: f64,
    /// Records stored per second of `Records::ingest` (generating the data not counted).
    records_per_sec: f64,
    size_bytes: Option<u64>,
    /// PostgreSQL only: the `VACUUM ANALYZE` after the fill.
    vacuum_seconds: Option<f64>,
    totals: Totals,
    reports: Vec<Timing>,
    budgets_load: Timing,
}

#[derive(Debug, Serialize)]
struct Output {
    records: usize,
    seed: u64,
    agents: usize,
    users: usize,
    sessions: usize,
    days: i64,
    batch: usize,
    runs: u32,
    target_ms: f64,
    databases: Vec<DbResult>,
}

/// Stores the generated records through `Records::ingest`; returns the wall time and the time
/// spent in `ingest`.
async fn fill(
    store: &Store,
    cli: &Cli,
    now_ms: i64,
    database: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let budgets = Budgets::load(store.clone(), now_ms).await?;
    let records = Records::new(store.clone(), budgets);
    let mut data = Dataset::new(cli.seed, cli.records, now_ms, cli.inferred);
    let progress_every = (cli.records / 10).max(BATCH);
    let (started, mut ingesting, mut stored) = (Instant::now(), Duration::ZERO, 0usize);
    loop {
        let batch = data.batch(BATCH);
        let n = batch.len();
        if n == 0 {
            break;
        }
        let t = Instant::now();
        let outcome = records.ingest(&batch).await?;
        ingesting += t.elapsed();
        if outcome.stored as usize != n {
            bail!(
                "{database}: a batch of {n} stored {}, {} duplicates, {} rejected",
                outcome.stored,
                outcome.duplicates,
                outcome.rejected.len()
            );
        }
        if (stored + n) / progress_every > stored / progress_every {
            eprintln!(
                "{database}: {} / {} records, {:.0} records/s",
                stored + n,
                cli.records,
                (stored + n) as f64 / ingesting.as_secs_f64()
            );
        }
        stored += n;
    }
    Ok((started.elapsed(), ingesting))
}

async fn bench_database(
    cli: &Cli,
    database: &'static str,
    url: &str,
    size_of: impl Fn() -> Option<u64>,
    now_ms: i64,
) -> anyhow::Result<DbResult> {
    let store = Store::connect(url).await?;
    let (fill_time, ingest_time) = fill(&store, cli, now_ms, database).await?;
    let vacuum_seconds = if database == "postgresql" {
        let t = Instant::now();
        store.conn().execute_unprepared("VACUUM ANALYZE").await?;
        Some(round2(t.elapsed().as_secs_f64()))
    } else {
        None
    };
    let size_bytes = match database {
        "postgresql" => {
            let row = store
                .conn()
                .query_one_raw(Statement::from_string(
                    store.backend(),
                    "SELECT pg_database_size(current_database()) AS size",
                ))
                .await?;
            row.and_then(|r| r.try_get::<i64>("", "size").ok())
                .and_then(|s| u64::try_from(s).ok())
        }
        _ => size_of(),
    };

    let usage = UsageReports::new(store.clone());
    let mut reports = Vec::new();
    let mut totals = None;
    for case in cases(now_ms) {
        let mut runs_ms = Vec::new();
        let mut last = None;
        for _ in 0..cli.runs {
            let t = Instant::now();
            let report = usage
                .report(&case.dims, &case.filter, case.limit)
                .await
                .with_context(|| format!("{database}: report {}", case.name))?;
            runs_ms.push(t.elapsed().as_secs_f64() * 1e3);
            last = Some(report);
        }
        let report = last.context("no run")?;
        if case.dims.is_empty() && case.filter == UsageFilter::default() {
            totals = Some(Totals::from(&report.total));
        }
        let rows = if case.dims.is_empty() {
            1
        } else {
            report.rows.len()
        };
        reports.push(Timing::new(
            case.name,
            Some(rows),
            report.truncated,
            runs_ms,
        ));
    }
    let totals = totals.context("no all-time total")?;
    if totals.requests != cli.records as u64 {
        bail!(
            "{database}: {} requests stored, {} expected",
            totals.requests,
            cli.records
        );
    }

    let mut runs_ms = Vec::new();
    for _ in 0..cli.runs {
        let t = Instant::now();
        let budgets = Budgets::load(store.clone(), now_ms).await?;
        runs_ms.push(t.elapsed().as_secs_f64() * 1e3);
        drop(budgets);
    }
    let budgets_load = Timing::new(
        "Budgets::load (month spend)".to_owned(),
        None,
        false,
        runs_ms,
    );
    drop(usage);
    store.close().await?;
    Ok(DbResult {
        database,
        records: cli.records,
        fill_seconds: round2(fill_time.as_secs_f64()),
        records_per_sec: (cli.records as f64 / ingest_time.as_secs_f64()).round(),
        size_bytes,
        vacuum_seconds,
        totals,
        reports,
        budgets_load,
    })
}

/// Bytes of the SQLite database and its WAL.
fn sqlite_size(dir: &Path) -> Option<u64> {
    let files = std::fs::read_dir(dir).ok()?;
    Some(
        files
            .filter_map(|f| f.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum(),
    )
}

async fn run_all(
    cli: &Cli,
    dir: &Path,
    pg: Option<&ScratchPg>,
    now_ms: i64,
) -> anyhow::Result<Vec<DbResult>> {
    let mut results = Vec::new();
    if !cli.db.no_sqlite {
        let url = format!("sqlite://{}/bench.db?mode=rwc", dir.display());
        results.push(bench_database(cli, "sqlite", &url, || sqlite_size(dir), now_ms).await?);
    }
    if let Some(pg) = pg {
        results.push(bench_database(cli, "postgresql", &pg.url, || None, now_ms).await?);
    }
    Ok(results)
}

fn print_table(out: &mut impl Write, o: &Output) -> std::io::Result<()> {
    writeln!(
        out,
        "usage reports: {} records (seed {}: {} agents, {} users, {} sessions, {} days), \
         ingested in batches of {}, each query run {} times",
        o.records, o.seed, o.agents, o.users, o.sessions, o.days, o.batch, o.runs
    )?;
    for db in &o.databases {
        let t = &db.totals;
        let share = |n: u64| 100.0 * n as f64 / t.requests.max(1) as f64;
        writeln!(out)?;
        writeln!(
            out,
            "{}: filled in {:.1} s, {:.0} records/s{}{}",
            db.database,
            db.fill_seconds,
            db.records_per_sec,
            db.size_bytes.map_or_else(String::new, |b| format!(
                ", {:.0} MiB",
                b as f64 / (1 << 20) as f64
            )),
            db.vacuum_seconds
                .map_or_else(String::new, |s| format!(", VACUUM ANALYZE {s:.1} s")),
        )?;
        writeln!(
            out,
            "  data: {} requests, ${:.2}, {} input / {} output tokens, {:.1} % unpriced, \
             {:.1} % unmetered, {:.1} % errors",
            t.requests,
            t.cost_usd,
            t.input_tokens,
            t.output_tokens,
            share(t.unpriced_requests),
            share(t.unmetered_requests),
            share(t.errors)
        )?;
        writeln!(
            out,
            "  {:<40} {:>6} {:>10} {:>10}  < {TARGET_MS:.0} ms",
            "query", "rows", "min ms", "median ms"
        )?;
        for r in db.reports.iter().chain([&db.budgets_load]) {
            writeln!(
                out,
                "  {:<40} {:>6} {:>10.1} {:>10.1}  {}",
                r.name,
                r.rows.map_or_else(
                    || "-".to_owned(),
                    |n| format!("{n}{}", if r.truncated { "+" } else { "" })
                ),
                r.min_ms,
                r.median_ms,
                match r.pass {
                    Some(true) => "PASS",
                    Some(false) => "FAIL",
                    None => "",
                }
            )?;
        }
    }
    writeln!(out)?;
    let verdicts: Vec<String> = o
        .databases
        .iter()
        .map(|db| {
            let slow: Vec<&str> = db
                .reports
                .iter()
                .filter(|r| r.pass == Some(false))
                .map(|r| r.name.as_str())
                .collect();
            if slow.is_empty() {
                format!("{} PASS", db.database)
            } else {
                format!("{} FAIL ({})", db.database, slow.join("; "))
            }
        })
        .collect();
    writeln!(
        out,
        "target (every report's median < {TARGET_MS:.0} ms): {}",
        verdicts.join(", ")
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.records == 0 {
        bail!("--records must be at least 1");
    }
    let now_ms = nm_controlplane::now_ms();
    // Before the temporary directory, so a failure leaves nothing behind.
    let pg = cli.db.scratch_pg("nm_usage_bench").await?;
    let dir: PathBuf = std::env::temp_dir().join(format!("nm-usage-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    let result = tokio::select! {
        r = run_all(&cli, &dir, pg.as_ref(), now_ms) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(pg) = pg {
        let name = pg.name.clone();
        if let Err(e) = pg.drop_it().await {
            eprintln!("could not drop the PostgreSQL database {name}: {e}");
        }
    }
    let output = Output {
        records: cli.records,
        seed: cli.seed,
        agents: AGENTS.len(),
        users: USERS,
        sessions: Dataset::sessions_for(cli.records),
        days: SPAN_DAYS,
        batch: BATCH,
        runs: cli.runs,
        target_ms: TARGET_MS,
        databases: result?,
    };

    let mut out = std::io::stdout().lock();
    if cli.json {
        serde_json::to_writer_pretty(&mut out, &output)?;
        writeln!(out)?;
    } else {
        print_table(&mut out, &output)?;
    }
    Ok(())
}
