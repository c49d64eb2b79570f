//! The rules on simulated counts, look after look: how often a false claim shows at *any* look
//! (the guarantee of [`super::stats`]), and how many sessions a true difference takes to be
//! named (the power), with the rules as they are (anytime-valid) and as they were (fixed-sample
//! intervals).
//!
//! No database: an agent is a set of counters that grow by batches of sessions. At each look
//! the counters become the [`Aggregates`] the SQL would return, and [`recommend::recommend`]
//! runs on them with the intervals carried from the previous look, as
//! [`super::Analytics::recompute_at`] carries them (the end-to-end version of the same runs,
//! through SQLite and the stored answer, is in `ground_truth_tests.rs`). Seeded and
//! deterministic: the same arguments give the same figures. Used by the tests (a few thousand
//! agents) and by `nm-analytics-bench --power` (more, and the table in `bench/HISTORY.md`).

use super::query::{Aggregates, Periods};
use super::recommend;
use super::report::{Kind, OutcomeRow, Recommendation, Window};
use super::rollup::TTFB_BANDS_MS;
use super::stats::{self, Intersections, MIN_SAMPLES_PER_ARM, Proportion};
use super::synthetic::Rng;
use super::{DAY_MS, WINDOW_DAYS};

/// When the looks happen: after every `batch` sessions, from `first` sessions to `last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub batch: u64,
    pub first: u64,
    pub last: u64,
}

impl Schedule {
    /// The issue's schedule: batches of 40 sessions, a look after each from 120 (about 100
    /// signals) to 800 sessions: 18 looks.
    pub const ISSUE: Schedule = Schedule {
        batch: 40,
        first: 120,
        last: 800,
    };

    /// The issue's batches, looked at until `last` sessions.
    pub const fn issue_until(last: u64) -> Schedule {
        Schedule {
            batch: 40,
            first: 120,
            last,
        }
    }

    /// How many looks it makes.
    pub fn looks(&self) -> u64 {
        if self.last < self.first || self.batch == 0 {
            0
        } else {
            (self.last - self.first) / self.batch + 1
        }
    }
}

/// A situation where some claim would be false.
#[derive(Debug, Clone, PartialEq)]
pub enum Null {
    /// Models with the same success rate, sessions split by `weights`: a best model is false.
    EqualModels { success: f64, weights: Vec<f64> },
    /// One model through `providers` providers of the same success rate: a best provider is
    /// false.
    EqualProviders { success: f64, providers: usize },
    /// A model costing a tenth of the other whose success is lower by exactly the
    /// non-inferiority margin: "as good" is false (the hardest case of the null).
    CheaperAtMargin { success: f64 },
    /// Regeneration, abandonment and heavy-edit rates exactly at their levels: "high" is false.
    RatesAtLevels,
    /// The same rates last week and this week (below the levels, or above them with
    /// `above_levels`): any trend (a worsening trend, or "rising"/"falling" in a high rate's
    /// message) is false. Last week holds `last_week` sessions; the schedule counts this week's.
    NoTrend { above_levels: bool, last_week: u64 },
    /// Environments with the same success rate, sessions split by `weights`.
    EqualEnvs { success: f64, weights: Vec<f64> },
    /// The same abandonment rate at every time to first byte, sessions spread over the TTFB
    /// bands by `weights` (fastest first).
    FlatLatency { abandonment: f64, weights: Vec<f64> },
}

impl Null {
    /// A short name for tables.
    pub fn label(&self) -> String {
        match self {
            Null::EqualModels { success, weights } => {
                format!(
                    "best_model: {} equal models at {success}, split {weights:?}",
                    weights.len()
                )
            }
            Null::EqualProviders { success, providers } => {
                format!("best_provider: {providers} equal providers at {success}")
            }
            Null::CheaperAtMargin { success } => format!(
                "cheaper_model: {:.2} vs {success} (exactly the margin worse)",
                success - stats::NON_INFERIORITY_MARGIN
            ),
            Null::RatesAtLevels => "high_*: the three rates exactly at their levels".to_owned(),
            Null::NoTrend {
                above_levels,
                last_week,
            } => format!(
                "worsening_trend / trend words: no change, rates {} their levels, {last_week} sessions last week",
                if *above_levels { "above" } else { "below" }
            ),
            Null::EqualEnvs { success, weights } => {
                format!("env_difference: {} equal envs at {success}", weights.len())
            }
            Null::FlatLatency { abandonment, .. } => {
                format!("latency_abandonment: {abandonment} abandoned at every TTFB")
            }
        }
    }

    /// Whether `r` is a claim this situation makes false.
    pub fn is_false_claim(&self, r: &Recommendation) -> bool {
        match self {
            Null::EqualModels { .. } => r.kind == Kind::BestModel,
            Null::EqualProviders { .. } => r.kind == Kind::BestProvider,
            Null::CheaperAtMargin { .. } => r.kind == Kind::CheaperModel,
            Null::RatesAtLevels => matches!(
                r.kind,
                Kind::HighRegeneration | Kind::HighAbandonment | Kind::HighHeavyEdit
            ),
            Null::NoTrend { .. } => {
                r.kind == Kind::WorseningTrend
                    || r.evidence.iter().any(|e| e.a.label == "last week")
            }
            Null::EqualEnvs { .. } => r.kind == Kind::EnvDifference,
            Null::FlatLatency { .. } => r.kind == Kind::LatencyAbandonment,
        }
    }

    fn draw(&self, rng: &mut Rng, this_week: bool) -> Session {
        let mut s = Session {
            this_week,
            ..Session::default()
        };
        match self {
            Null::EqualModels { success, weights } => {
                s.model = rng.weighted(weights);
                s.success = rng.chance(*success);
            }
            Null::EqualProviders { success, providers } => {
                s.provider = rng.below(*providers as u64) as usize;
                s.success = rng.chance(*success);
            }
            Null::CheaperAtMargin { success } => {
                s.model = rng.below(2) as usize;
                let p = if s.model == 0 {
                    *success
                } else {
                    success - stats::NON_INFERIORITY_MARGIN
                };
                s.success = rng.chance(p);
                s.cost_micros = if s.model == 0 { 10_000 } else { 1_000 };
            }
            Null::RatesAtLevels => {
                // Abandoned and heavily edited are exclusive endings; regeneration comes on top.
                let ending = rng.f64();
                s.abandoned = ending < recommend::LEVEL_ABANDONMENT;
                s.heavy_edit = !s.abandoned
                    && ending < recommend::LEVEL_ABANDONMENT + recommend::LEVEL_HEAVY_EDIT;
                s.regenerated = rng.chance(recommend::LEVEL_REGENERATION);
                s.success = !s.abandoned && !s.heavy_edit;
            }
            Null::NoTrend { above_levels, .. } => {
                let (regen, abandon, heavy) = if *above_levels {
                    (0.45, 0.30, 0.35)
                } else {
                    (0.15, 0.10, 0.12)
                };
                let ending = rng.f64();
                s.abandoned = ending < abandon;
                s.heavy_edit = !s.abandoned && ending < abandon + heavy;
                s.regenerated = rng.chance(regen);
                s.success = !s.abandoned && !s.heavy_edit;
            }
            Null::EqualEnvs { success, weights } => {
                s.env = rng.weighted(weights);
                s.success = rng.chance(*success);
            }
            Null::FlatLatency {
                abandonment,
                weights,
            } => {
                s.band = Some(rng.weighted(weights));
                s.abandoned = rng.chance(*abandonment);
                s.success = !s.abandoned;
            }
        }
        s
    }
}

/// One simulated session: what the SQL would group it by, and what it counts as.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Session {
    model: usize,
    provider: usize,
    env: usize,
    band: Option<usize>,
    success: bool,
    abandoned: bool,
    regenerated: bool,
    heavy_edit: bool,
    cost_micros: u64,
    this_week: bool,
}

// === impl Agent ===

/// One agent's counters, by the groups the rules read.
#[derive(Debug, Clone, Default)]
struct Agent {
    total: OutcomeRow,
    models: Vec<OutcomeRow>,
    providers: Vec<OutcomeRow>,
    envs: Vec<OutcomeRow>,
    bands: Vec<OutcomeRow>,
    recent: OutcomeRow,
    previous: OutcomeRow,
}

fn count(row: &mut OutcomeRow, s: &Session) {
    row.sessions += 1;
    row.signals += 1;
    row.requests += 1;
    row.successes += u64::from(s.success);
    row.abandoned += u64::from(s.abandoned);
    row.regenerated += u64::from(s.regenerated);
    row.regenerations += u64::from(s.regenerated);
    row.heavily_edited += u64::from(s.heavy_edit);
    row.cost_micros += s.cost_micros;
}

fn slot(rows: &mut Vec<OutcomeRow>, i: usize) -> &mut OutcomeRow {
    if rows.len() <= i {
        rows.resize(i + 1, OutcomeRow::default());
    }
    &mut rows[i]
}

impl Agent {
    fn add(&mut self, s: &Session) {
        count(&mut self.total, s);
        count(slot(&mut self.models, s.model), s);
        count(slot(&mut self.providers, s.provider), s);
        count(slot(&mut self.envs, s.env), s);
        if let Some(band) = s.band {
            count(slot(&mut self.bands, band), s);
        }
        count(
            if s.this_week {
                &mut self.recent
            } else {
                &mut self.previous
            },
            s,
        );
    }

    fn aggregates(&self) -> Aggregates {
        let named = |prefix: &str, rows: &[OutcomeRow]| -> Vec<OutcomeRow> {
            rows.iter()
                .enumerate()
                .filter(|(_, r)| r.sessions > 0)
                .map(|(i, r)| OutcomeRow {
                    key: vec![Some(format!("{prefix}-{i}"))],
                    ..r.clone()
                })
                .collect()
        };
        Aggregates {
            total: self.total.clone(),
            by_model: named("model", &self.models),
            by_provider: named("provider", &self.providers),
            by_env: named("env", &self.envs),
            recent: self.recent.clone(),
            previous: self.previous.clone(),
            by_ttfb: self
                .bands
                .iter()
                .enumerate()
                .filter(|(i, r)| r.sessions > 0 && *i <= TTFB_BANDS_MS.len())
                .map(|(i, r)| (i, r.clone()))
                .collect(),
            by_user: Vec::new(),
            user_costs: Vec::new(),
        }
    }
}

/// The periods of every simulated look: one window, this week starting at 0 (only the keys'
/// names depend on them).
const PERIODS: Periods = Periods {
    window: Window {
        since_ms: 0,
        until_ms: WINDOW_DAYS * DAY_MS,
    },
    recent_since: 0,
    previous_since: -7 * DAY_MS,
};

/// How often a null situation showed a false claim.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FalseClaims {
    pub agents: u64,
    /// Agents with a false claim at some look.
    pub any_look: u64,
    /// Agents with a false claim at the last look (the one-look rate).
    pub last_look: u64,
    /// Agents that showed a false claim, then not, then again: the flicker of the rule.
    pub came_back: u64,
}

impl FalseClaims {
    pub fn rate(&self) -> f64 {
        self.any_look as f64 / self.agents.max(1) as f64
    }

    /// Whether the any-look rate is at most `alpha` up to the binomial spread of this many
    /// agents: `any_look ≤ n·α + 3·√(n·α·(1 − α))` (three standard deviations: a one-sided
    /// 0.13% chance of failing when the true rate is exactly `alpha`).
    pub fn within(&self, alpha: f64) -> bool {
        self.any_look as f64 <= self.margin(alpha)
    }

    /// The largest count [`FalseClaims::within`] accepts.
    pub fn margin(&self, alpha: f64) -> f64 {
        let n = self.agents as f64;
        n * alpha + 3.0 * (n * alpha * (1.0 - alpha)).sqrt()
    }
}

/// How the rules decide.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// As they are in the first stretch of an agent's life: anytime-valid, intervals carried
    /// from look to look, at the stretch's share of the level ([`stats::stretch_share`]`(1)`).
    Anytime,
    /// The same, at another share of the level (1: the whole level, as if the agent lived one
    /// stretch only; 1/2: the first stretch of a spending by halves).
    AnytimeShare(f64),
    /// The same anytime-valid intervals, each look on its own (no running intersection).
    AnytimeNoIntersection,
    /// As they were: the fixed-sample Newcombe–Wilson interval at Bonferroni 95%, each look on
    /// its own (only the best-model rule: the power comparison and the issue's A/A).
    Fixed,
    /// The fixed-sample rule at another critical value `z` (for one comparison): with `z`
    /// calibrated to a schedule ([`calibrated_z`]), the best a rule valid for that schedule
    /// only could do.
    FixedAt(f64),
}

impl Rule {
    /// The share of the level the anytime-valid rules spend in the simulated stretch.
    fn share(self) -> f64 {
        match self {
            Rule::AnytimeShare(share) => share,
            _ => stats::stretch_share(1),
        }
    }

    /// The intervals this look starts from: `earlier`'s when the rule keeps the running
    /// intersection, none otherwise; at the rule's share of the level.
    fn look(self, earlier: Intersections) -> Intersections {
        let carried = match self {
            Rule::Anytime | Rule::AnytimeShare(_) => Intersections::carried(earlier.into_met()),
            _ => Intersections::fresh(),
        };
        carried
            .spending(
                &recommend::window_keys(PERIODS.window.since_ms),
                self.share(),
            )
            .spending(&recommend::week_keys(PERIODS.recent_since), self.share())
    }
}

/// The claims of one look: the recommendations (or, for [`Rule::Fixed`], the best model the
/// old rule would name) that `null` makes false.
fn false_claim_at(null: &Null, a: &Aggregates, rule: Rule, run: &mut Intersections) -> bool {
    match rule {
        Rule::Fixed => fixed_best_model(a).is_some(),
        Rule::FixedAt(z) => fixed_best_model_at(a, Some(z)).is_some(),
        Rule::Anytime | Rule::AnytimeShare(_) | Rule::AnytimeNoIntersection => {
            recommend::recommend(a, &PERIODS, run)
                .iter()
                .any(|r| null.is_false_claim(r))
        }
    }
}

/// The best model as the fixed-sample rule named it: the arm with the highest success rate,
/// when its Newcombe–Wilson interval at the Bonferroni `z` against every other eligible arm
/// lies above 0. The name of the model.
pub fn fixed_best_model(a: &Aggregates) -> Option<String> {
    fixed_best_model_at(a, None)
}

/// [`fixed_best_model`] at the critical value `z` (default: Bonferroni's for 95%).
fn fixed_best_model_at(a: &Aggregates, z: Option<f64>) -> Option<String> {
    let arms: Vec<&OutcomeRow> = a
        .by_model
        .iter()
        .filter(|r| r.sessions >= MIN_SAMPLES_PER_ARM)
        .collect();
    let k = arms.len() as u32;
    if k < 2 {
        return None;
    }
    let z = z.unwrap_or_else(|| stats::bonferroni_z(k * (k - 1) / 2));
    let p = |r: &OutcomeRow| Proportion::new(r.successes, r.sessions);
    let leader = arms.iter().copied().reduce(|best, r| {
        if p(r).rate() > p(best).rate() {
            r
        } else {
            best
        }
    })?;
    arms.iter()
        .filter(|r| !std::ptr::eq(**r, leader))
        .all(|r| stats::fixed_difference_interval(p(r), p(leader), z).lower > 0.0)
        .then(|| leader.key.first().cloned().flatten())
        .flatten()
}

/// Runs `agents` agents of `null` on `schedule` and counts the false claims (agent `i` draws
/// from the seed `seed + i`).
pub fn false_claims(
    null: &Null,
    rule: Rule,
    schedule: Schedule,
    agents: u64,
    seed: u64,
) -> FalseClaims {
    let mut out = FalseClaims {
        agents,
        ..FalseClaims::default()
    };
    for i in 0..agents {
        let mut rng = Rng::new(seed.wrapping_add(i));
        let mut agent = Agent::default();
        if let Null::NoTrend { last_week, .. } = null {
            for _ in 0..*last_week {
                agent.add(&null.draw(&mut rng, false));
            }
        }
        let mut run = Intersections::fresh();
        let (mut seen, mut gone, mut back, mut last) = (false, false, false, false);
        let mut sessions = 0;
        while sessions < schedule.last {
            for _ in 0..schedule.batch {
                agent.add(&null.draw(&mut rng, true));
            }
            sessions += schedule.batch;
            if sessions < schedule.first {
                continue;
            }
            let mut this = rule.look(run);
            last = false_claim_at(null, &agent.aggregates(), rule, &mut this);
            run = this;
            back |= last && gone;
            gone |= seen && !last;
            seen |= last;
        }
        out.any_look += u64::from(seen);
        out.last_look += u64::from(last);
        out.came_back += u64::from(back);
    }
    out
}

// === power ===

/// Sessions to the first look naming the truly better model, over the agents of one effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Power {
    /// Sessions at that look per agent; `None` when the cap came first.
    pub first: Vec<Option<u64>>,
    /// Agents that at some look named the worse model.
    pub wrong: u64,
    /// Agents whose correct claim disappeared at a later look (within `after` sessions).
    pub flickered: u64,
}

impl Power {
    /// The `q`-quantile (0 to 1) of the sessions to the first correct claim, `None` when more
    /// than that share of agents never got one before the cap (nearest rank).
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let mut v: Vec<u64> = self.first.iter().map(|f| f.unwrap_or(u64::MAX)).collect();
        v.sort_unstable();
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1)) - 1;
        v.get(rank).copied().filter(|x| *x != u64::MAX)
    }
}

/// Two models, `a` succeeding with probability `rate_a` and `b` with `rate_b`, sessions split
/// evenly, looked at on the issue's batches until `cap` sessions: when does `rule` first name
/// the better one? After the first correct claim, the looks go on for `after` more sessions to
/// see whether it holds.
pub fn power(
    rate_a: f64,
    rate_b: f64,
    rule: Rule,
    cap: u64,
    after: u64,
    agents: u64,
    seed: u64,
) -> Power {
    let better = if rate_b >= rate_a {
        "model-1"
    } else {
        "model-0"
    };
    let schedule = Schedule::issue_until(cap);
    let mut out = Power {
        first: Vec::new(),
        wrong: 0,
        flickered: 0,
    };
    for i in 0..agents {
        let mut rng = Rng::new(seed.wrapping_add(i));
        let mut agent = Agent::default();
        let mut run = Intersections::fresh();
        let (mut first, mut wrong, mut flickered) = (None, false, false);
        let mut sessions = 0;
        while sessions < schedule.last {
            for _ in 0..schedule.batch {
                let model = rng.below(2) as usize;
                let rate = if model == 0 { rate_a } else { rate_b };
                agent.add(&Session {
                    model,
                    success: rng.chance(rate),
                    ..Session::default()
                });
            }
            sessions += schedule.batch;
            if sessions < schedule.first {
                continue;
            }
            let a = agent.aggregates();
            let named = match rule {
                Rule::Fixed => fixed_best_model(&a),
                Rule::FixedAt(z) => fixed_best_model_at(&a, Some(z)),
                Rule::Anytime | Rule::AnytimeShare(_) | Rule::AnytimeNoIntersection => {
                    let mut this = rule.look(run);
                    let named = recommend::recommend(&a, &PERIODS, &mut this)
                        .into_iter()
                        .find(|r| r.kind == Kind::BestModel)
                        .and_then(|r| r.subject);
                    run = this;
                    named
                }
            };
            match named.as_deref() {
                Some(m) if m == better => {
                    first.get_or_insert(sessions);
                }
                Some(_) => wrong = true,
                None => flickered |= first.is_some(),
            }
            if first.is_some_and(|f| sessions >= f + after) {
                break;
            }
        }
        out.first.push(first);
        out.wrong += u64::from(wrong);
        out.flickered += u64::from(flickered);
    }
    out
}

/// The critical value at which the fixed-sample rule shows a false best model (two equal
/// models at 0.6) at some look of `schedule` in 5% of `agents` agents: what a rule tuned to
/// exactly that schedule, and valid for no other, would use (Pocock's idea). By bisection.
pub fn calibrated_z(schedule: Schedule, agents: u64, seed: u64) -> f64 {
    let null = &nulls()[0];
    let (mut lo, mut hi) = (stats::bonferroni_z(1), 5.0);
    for _ in 0..30 {
        let mid = 0.5 * (lo + hi);
        let f = false_claims(null, Rule::FixedAt(mid), schedule, agents, seed);
        if f.rate() > stats::FAMILY_ALPHA {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

// === a whole life ===

/// How often equal models showed a false best model over agents' whole lives.
#[derive(Debug, Clone, PartialEq)]
pub struct Lifetime {
    /// Per stretch of the agents' lives (1, 2, …; see [`super::window_stretch`]): the agents
    /// with a false best model at some look in it.
    pub stretches: Vec<FalseClaims>,
    /// The agents with a false best model at some look of their lives.
    pub life: FalseClaims,
    /// Looks made, over all agents.
    pub looks: u64,
}

/// What happens over an agent's whole life, with the code of a real recompute: equal models at
/// `success`, `per_day` sessions a day for `days` days, and each day a look after a random
/// share of the day's sessions, from 1 to `max_looks_per_day` of them (the schedule drawn from
/// the seed: any schedule is allowed). Each look counts the sessions of its window
/// ([`super::periods_at`]), meets them with the intervals carried within the stretch, at the
/// stretch's share of the level ([`super::carried`]), as [`super::Analytics::recompute_at`]
/// does. With `spending` off, every stretch gets the whole level instead: what the bound would
/// be without the spending.
pub fn lifetime(
    success: f64,
    per_day: u64,
    days: u64,
    max_looks_per_day: u64,
    spending: bool,
    agents: u64,
    seed: u64,
) -> Lifetime {
    let origin = 0;
    let stretches = super::window_stretch(days as i64 * DAY_MS - 1, origin) as usize;
    let mut out = Lifetime {
        stretches: vec![
            FalseClaims {
                agents,
                ..FalseClaims::default()
            };
            stretches
        ],
        life: FalseClaims {
            agents,
            ..FalseClaims::default()
        },
        looks: 0,
    };
    let max_looks_per_day = max_looks_per_day.max(1);
    for i in 0..agents {
        let mut rng = Rng::new(seed.wrapping_add(i));
        // Sessions and successes per model before each day: `before[d]` sums days 0..d.
        let mut before: Vec<[(u64, u64); 2]> = vec![[(0, 0); 2]];
        let mut fired = vec![false; stretches];
        let mut earlier = std::collections::BTreeMap::new();
        for day in 0..days {
            let mut today = before[before.len() - 1];
            let looks = 1 + rng.below(max_looks_per_day);
            let mut cuts: Vec<u64> = (0..looks).map(|_| rng.below(per_day + 1)).collect();
            cuts.sort_unstable();
            let mut drawn = 0;
            for (look, cut) in cuts.into_iter().enumerate() {
                for _ in drawn..cut {
                    let model = rng.below(2) as usize;
                    today[model].0 += 1;
                    today[model].1 += u64::from(rng.chance(success));
                }
                drawn = drawn.max(cut);
                // The look's time: inside the day, after the earlier looks.
                let now = day as i64 * DAY_MS + (look as i64 + 1) * DAY_MS / (looks as i64 + 1);
                let periods = super::periods_at(now, origin);
                let from = before[usize::try_from(periods.window.since_ms / DAY_MS).unwrap_or(0)];
                let counts: Vec<(u64, u64)> = (0..2)
                    .map(|m| (today[m].0 - from[m].0, today[m].1 - from[m].1))
                    .collect();
                if counts.iter().map(|c| c.0).sum::<u64>() < Schedule::ISSUE.first {
                    continue;
                }
                let mut run = super::carried(std::mem::take(&mut earlier), &periods, origin);
                if !spending {
                    run = run.spending(&recommend::window_keys(periods.window.since_ms), 1.0);
                }
                let claim = recommend::recommend(&two_models(&counts), &periods, &mut run)
                    .iter()
                    .any(|r| r.kind == Kind::BestModel);
                earlier = run.into_met();
                out.looks += 1;
                let k = super::window_stretch(now, origin) as usize;
                if let Some(f) = fired.get_mut(k - 1) {
                    *f |= claim;
                }
            }
            for _ in drawn..per_day {
                let model = rng.below(2) as usize;
                today[model].0 += 1;
                today[model].1 += u64::from(rng.chance(success));
            }
            before.push(today);
        }
        for (stretch, f) in out.stretches.iter_mut().zip(&fired) {
            stretch.any_look += u64::from(*f);
        }
        out.life.any_look += u64::from(fired.iter().any(|f| *f));
    }
    out
}

/// The aggregates of an agent with two models and these `(sessions, successes)`.
fn two_models(counts: &[(u64, u64)]) -> Aggregates {
    let row = |key: Option<String>, sessions: u64, successes: u64| OutcomeRow {
        key: vec![key],
        sessions,
        signals: sessions,
        requests: sessions,
        successes,
        ..OutcomeRow::default()
    };
    Aggregates {
        total: row(
            None,
            counts.iter().map(|c| c.0).sum(),
            counts.iter().map(|c| c.1).sum(),
        ),
        by_model: counts
            .iter()
            .enumerate()
            .map(|(i, c)| row(Some(format!("model-{i}")), c.0, c.1))
            .collect(),
        ..Aggregates::default()
    }
}

/// The null situations the tests and the benchmark run, one or more per rule.
pub fn nulls() -> Vec<Null> {
    // Log-normal TTFB around 700 ms puts most sessions in the middle bands.
    let ttfb = vec![0.25, 0.35, 0.25, 0.1, 0.04, 0.01];
    vec![
        Null::EqualModels {
            success: 0.6,
            weights: vec![1.0, 1.0],
        },
        Null::EqualModels {
            success: 0.6,
            weights: vec![1.0, 1.0, 1.0],
        },
        Null::EqualModels {
            success: 0.1,
            weights: vec![4.0, 1.0],
        },
        Null::EqualProviders {
            success: 0.7,
            providers: 3,
        },
        Null::CheaperAtMargin { success: 0.7 },
        Null::RatesAtLevels,
        Null::NoTrend {
            above_levels: false,
            last_week: 700,
        },
        Null::NoTrend {
            above_levels: true,
            last_week: 700,
        },
        Null::EqualEnvs {
            success: 0.6,
            weights: vec![0.6, 0.3, 0.1],
        },
        Null::FlatLatency {
            abandonment: 0.1,
            weights: ttfb,
        },
    ]
}

// === the report ===

/// The effects of the power table: model `a`'s success rate, model `b`'s.
pub const EFFECTS: [(f64, f64); 3] = [(0.55, 0.70), (0.60, 0.68), (0.40, 0.60)];

/// Power runs stop at this many sessions.
const POWER_CAP: u64 = 8_000;

/// After the first correct claim, the power runs look on for this many sessions (ten looks) to
/// see whether it holds.
const POWER_AFTER: u64 = 400;

fn sessions(x: Option<u64>) -> String {
    x.map_or_else(|| format!("> {POWER_CAP}"), |x| x.to_string())
}

/// The benchmark's report (`nm-analytics-bench --power`), as Markdown tables: the false claims
/// at any look for every rule's null situations (`agents` agents each, on the issue's 18 looks
/// and on 48 looks to 2,000 sessions), the power before and after on [`EFFECTS`] (`agents`
/// agents each), and a steady agent past its first 30 days (`agents / 4`).
pub fn report(agents: u64, seed: u64, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let alpha = stats::FAMILY_ALPHA;
    writeln!(
        out,
        "### False claims at any look ({agents} agents per row, seed {seed})"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| rule: situation where the claim is false | looks | at some look | rate | limit (5% + 3 sd) | at the last look |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|")?;
    let longer = Schedule::issue_until(2_000);
    let mut row = |label: &str, rule: Rule, schedule: Schedule, null: &Null| {
        let f = false_claims(null, rule, schedule, agents, seed);
        writeln!(
            out,
            "| {label} | {} | {} | {:.2}% | {:.0} | {} |",
            schedule.looks(),
            f.any_look,
            100.0 * f.rate(),
            f.margin(alpha).floor(),
            f.last_look
        )
    };
    let issue = &nulls()[0];
    row(
        &format!("before (fixed-sample 95%), {}", issue.label()),
        Rule::Fixed,
        Schedule::ISSUE,
        issue,
    )?;
    for null in nulls() {
        for schedule in [Schedule::ISSUE, longer] {
            row(&null.label(), Rule::Anytime, schedule, &null)?;
        }
    }
    writeln!(out)?;

    let z = calibrated_z(Schedule::ISSUE, agents, seed);
    writeln!(
        out,
        "### Sessions to the first correct `best_model` ({agents} agents per row, batches of 40, a look after each from 120 sessions)"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| effect | rule | median | 90th percentile | after / before (median, p90) | agents ever naming the worse model | claims that later disappeared |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|")?;
    for (a, b) in EFFECTS {
        let before = power(a, b, Rule::Fixed, POWER_CAP, POWER_AFTER, agents, seed);
        let after = power(a, b, Rule::Anytime, POWER_CAP, POWER_AFTER, agents, seed);
        let loose = power(
            a,
            b,
            Rule::AnytimeNoIntersection,
            POWER_CAP,
            POWER_AFTER,
            agents,
            seed,
        );
        let tuned = power(a, b, Rule::FixedAt(z), 800, 0, agents, seed);
        let ratio = |x: Option<u64>, y: Option<u64>| match (x, y) {
            (Some(x), Some(y)) if y > 0 => format!("{:.2}", x as f64 / y as f64),
            _ => "-".to_owned(),
        };
        for (name, p, note) in [
            ("before: fixed-sample 95%", &before, String::new()),
            (
                "after: anytime-valid, the first stretch's share (3.04%)",
                &after,
                format!(
                    "{}, {}",
                    ratio(after.quantile(0.5), before.quantile(0.5)),
                    ratio(after.quantile(0.9), before.quantile(0.9))
                ),
            ),
            (
                "after, without the running intersection",
                &loose,
                String::new(),
            ),
        ] {
            writeln!(
                out,
                "| {a:.2} vs {b:.2} | {name} | {} | {} | {note} | {} | {} |",
                sessions(p.quantile(0.5)),
                sessions(p.quantile(0.9)),
                p.wrong,
                p.flickered
            )?;
        }
        writeln!(
            out,
            "| {a:.2} vs {b:.2} | reference: fixed-sample at z = {z:.2}, valid for these 18 looks only (to 800 sessions) | {} | {} | {}, {} | {} | - |",
            tuned
                .quantile(0.5)
                .map_or_else(|| "> 800".to_owned(), |x| x.to_string()),
            tuned
                .quantile(0.9)
                .map_or_else(|| "> 800".to_owned(), |x| x.to_string()),
            ratio(tuned.quantile(0.5), before.quantile(0.5)),
            ratio(tuned.quantile(0.9), before.quantile(0.9)),
            tuned.wrong,
        )?;
    }
    writeln!(out)?;

    writeln!(
        out,
        "### The spending's price: sessions to the first correct `best_model` at a stretch's share of the 5% ({agents} agents per row, same batches)"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| share of the 5% | spent by | {} |",
        EFFECTS
            .map(|(a, b)| format!("median, {a:.2} vs {b:.2} | p90"))
            .join(" | ")
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|")?;
    let shares = [
        (1.0, "no spending (one stretch only)".to_owned()),
        (
            stats::stretch_share(1),
            "6/(π²k²): stretch 1 (the first 60 days)".to_owned(),
        ),
        (0.5, "1/2^k: stretch 1".to_owned()),
        (0.25, "1/2^k: stretch 2".to_owned()),
        (stats::stretch_share(2), "6/(π²k²): stretch 2".to_owned()),
        (stats::stretch_share(4), "6/(π²k²): stretch 4".to_owned()),
        (1.0 / 16.0, "1/2^k: stretch 4".to_owned()),
        (1.0 / 1024.0, "1/2^k: stretch 10".to_owned()),
        (stats::stretch_share(10), "6/(π²k²): stretch 10".to_owned()),
    ];
    for (share, by) in shares {
        let rule = Rule::AnytimeShare(share);
        let cells: Vec<String> = EFFECTS
            .iter()
            .map(|&(a, b)| {
                let p = power(a, b, rule, POWER_CAP, 0, agents, seed);
                format!(
                    "{} | {}",
                    sessions(p.quantile(0.5)),
                    sessions(p.quantile(0.9))
                )
            })
            .collect();
        writeln!(
            out,
            "| {:.2}% | {by} | {} |",
            100.0 * share,
            cells.join(" | ")
        )?;
    }
    writeln!(out)?;

    let steady = (agents / 4).max(1);
    let days = 360;
    writeln!(
        out,
        "### A whole life: equal models at 0.6, 60 sessions a day for {days} days, 1 to 12 looks a day at random times ({steady} agents)"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| days of the agent's life | stretch | the window | share of the 5% | agents with a false `best_model` (spending) | rate | without the spending (5% each stretch) | rate |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|")?;
    let spent = lifetime(0.6, 60, days, 12, true, steady, seed);
    let unspent = lifetime(0.6, 60, days, 12, false, steady, seed);
    for (i, (f, g)) in spent.stretches.iter().zip(&unspent.stretches).enumerate() {
        let k = i as u64 + 1;
        let (from, to) = if k == 1 {
            (0, 60)
        } else {
            (30 * k, 30 * (k + 1))
        };
        writeln!(
            out,
            "| {from}-{to} | {k} | days {}-{to} | {:.1}% | {} | {:.2}% | {} | {:.2}% |",
            if k == 1 { 0 } else { from - 30 },
            100.0 * stats::stretch_share(k),
            f.any_look,
            100.0 * f.rate(),
            g.any_look,
            100.0 * g.rate()
        )?;
    }
    writeln!(
        out,
        "| 0-{days}, the whole life | all | | 100% | {} | {:.2}% | {} | {:.2}% |",
        spent.life.any_look,
        100.0 * spent.life.rate(),
        unspent.life.any_look,
        100.0 * unspent.life.rate()
    )?;
    Ok(())
}

// === implicit evidence ===

/// How a simulated population's implicit behaviour follows its true satisfaction (issue 32):
/// some sessions send an explicit signal (truthful); the others may only *behave*: an
/// unsatisfied user re-asks or abandons (an implicit failure) or, now and then, carries the
/// answer on anyway; a satisfied one mostly carries it on (`continued`), now and then re-asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Behaviour {
    /// Share of sessions that send an explicit signal.
    pub explicit_share: f64,
    /// Satisfied sessions without an explicit signal: `continued` with this probability...
    pub satisfied_continue: f64,
    /// ... a re-ask or an abandon with this one (noise), else nothing seen.
    pub satisfied_negative: f64,
    /// Unsatisfied sessions without an explicit signal: a re-ask or an abandon...
    pub unsatisfied_negative: f64,
    /// ... `continued` anyway (a misleading signal), else nothing seen.
    pub unsatisfied_continue: f64,
}

impl Behaviour {
    /// The population of `nm-analytics-bench --implicit`: 20 % of sessions send a signal (the
    /// issue's "about 100 signals a day" out of a few hundred sessions); the rules see most of
    /// what the others do, imperfectly.
    pub const ISSUE: Behaviour = Behaviour {
        explicit_share: 0.2,
        satisfied_continue: 0.7,
        satisfied_negative: 0.05,
        unsatisfied_negative: 0.6,
        unsatisfied_continue: 0.2,
    };
}

/// Two models succeeding (truly satisfying) with probabilities `rate_a` and `rate_b`, sessions
/// split evenly and labelled as [`Behaviour`] says, counted as `evidence` says (an explicit
/// signal wins; implicit ones only where a session has none; `continued` a success only with
/// `evidence.continued`), looked at with the anytime-valid rules on the issue's batches of 40
/// *traffic* sessions (labelled or not) until `cap`: sessions to the first correct `best_model`
/// (and agents that named the worse, or with equal rates any, model). The random draws do not
/// depend on `evidence`: the same traffic, counted three ways.
pub fn implicit_power(
    (rate_a, rate_b): (f64, f64),
    b: Behaviour,
    evidence: super::evidence::Evidence,
    cap: u64,
    agents: u64,
    seed: u64,
) -> Power {
    let better = if rate_b > rate_a {
        Some("model-1")
    } else if rate_a > rate_b {
        Some("model-0")
    } else {
        None
    };
    let schedule = Schedule::issue_until(cap);
    let mut out = Power {
        first: Vec::new(),
        wrong: 0,
        flickered: 0,
    };
    for i in 0..agents {
        let mut rng = Rng::new(seed.wrapping_add(i));
        let mut agent = Agent::default();
        let mut run = Intersections::fresh();
        let (mut first, mut wrong) = (None, false);
        let mut sessions = 0;
        while sessions < schedule.last && first.is_none() {
            for _ in 0..schedule.batch {
                let model = rng.below(2) as usize;
                let satisfied = rng.chance(if model == 0 { rate_a } else { rate_b });
                let explicit = rng.chance(b.explicit_share);
                let u = rng.f64();
                let (negative, cont) = if satisfied {
                    (b.satisfied_negative, b.satisfied_continue)
                } else {
                    (b.unsatisfied_negative, b.unsatisfied_continue)
                };
                let outcome = if explicit {
                    Some(satisfied)
                } else if !evidence.implicit {
                    None
                } else if u < negative {
                    Some(false)
                } else if u < negative + cont && evidence.continued {
                    Some(true)
                } else {
                    None
                };
                if let Some(success) = outcome {
                    agent.add(&Session {
                        model,
                        success,
                        ..Session::default()
                    });
                }
            }
            sessions += schedule.batch;
            if sessions < schedule.first {
                continue;
            }
            let mut this = Rule::Anytime.look(run);
            let named = recommend::recommend(&agent.aggregates(), &PERIODS, &mut this)
                .into_iter()
                .find(|r| r.kind == Kind::BestModel)
                .and_then(|r| r.subject);
            run = this;
            match (named.as_deref(), better) {
                (Some(m), Some(want)) if m == want => first = Some(sessions),
                (Some(_), _) => wrong = true,
                (None, _) => {}
            }
        }
        out.first.push(first);
        out.wrong += u64::from(wrong);
    }
    out
}

/// The table of `nm-analytics-bench --implicit`: sessions to the first correct `best_model`
/// with explicit signals only and with implicit evidence, for a few effects, and the agents
/// that named a wrong (or, with equal models, any) model.
pub fn implicit_report(
    agents: u64,
    seed: u64,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    use super::evidence::Evidence;
    let b = Behaviour::ISSUE;
    writeln!(
        out,
        "### Sessions to the first correct `best_model`, explicit only vs explicit + implicit \
         ({agents} agents per row, batches of 40 sessions, a look after each from 120, cap 4,000)"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "Population: {:.0}% of sessions send an explicit signal; without one, a satisfied user \
         continues {:.0}% / re-asks {:.0}%, an unsatisfied one re-asks or abandons {:.0}% / \
         continues {:.0}%.",
        b.explicit_share * 100.0,
        b.satisfied_continue * 100.0,
        b.satisfied_negative * 100.0,
        b.unsatisfied_negative * 100.0,
        b.unsatisfied_continue * 100.0
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| true rates (a, b) | evidence | median sessions | 90th percentile | found by 4,000 | wrong model named |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|")?;
    let evidences = [
        ("explicit", Evidence::EXPLICIT),
        (
            "explicit + implicit",
            Evidence {
                implicit: true,
                continued: false,
            },
        ),
        (
            "explicit + implicit, continued counts",
            Evidence {
                implicit: true,
                continued: true,
            },
        ),
    ];
    let show = |q: Option<u64>| q.map_or_else(|| "> 4000".to_owned(), |s| s.to_string());
    for rates in [(0.55, 0.70), (0.60, 0.70), (0.60, 0.60)] {
        for (label, evidence) in evidences {
            let p = implicit_power(rates, b, evidence, 4_000, agents, seed);
            let found = p.first.iter().filter(|f| f.is_some()).count();
            writeln!(
                out,
                "| {:.2}, {:.2} | {label} | {} | {} | {:.1}% | {} |",
                rates.0,
                rates.1,
                if rates.0 == rates.1 {
                    "-".to_owned()
                } else {
                    show(p.quantile(0.5))
                },
                if rates.0 == rates.1 {
                    "-".to_owned()
                } else {
                    show(p.quantile(0.9))
                },
                100.0 * found as f64 / agents.max(1) as f64,
                p.wrong
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Agents per null situation: the binomial margin of 2,000 at 5% is 3 standard deviations,
    /// 29 agents (1.5 points).
    const AGENTS: u64 = 2_000;

    #[test]
    fn schedule_counts_its_looks() {
        assert_eq!(Schedule::ISSUE.looks(), 18);
        assert_eq!(Schedule::issue_until(100).looks(), 0);
    }

    /// The issue's measurement, reproduced: equal models looked at 18 times with the old
    /// fixed-sample rule show a false best model in about 20% of agents, though only ~5% at
    /// the last look. This is what the tests below would catch if the rules went back.
    #[test]
    fn the_fixed_rule_fails_the_any_look_test() {
        let null = &nulls()[0];
        let f = false_claims(null, Rule::Fixed, Schedule::ISSUE, AGENTS, 1);
        assert!(!f.within(stats::FAMILY_ALPHA), "{f:?}");
        assert!(f.rate() > 0.15, "{f:?}");
        assert!(f.last_look as f64 <= f.margin(stats::FAMILY_ALPHA), "{f:?}");
    }

    /// The guarantee for the `i`-th of [`nulls`]: over the issue's 18 looks, at most 5% of
    /// agents (plus the binomial margin) ever show the false claim.
    fn at_most_five_percent_at_any_look(i: usize) {
        let null = &nulls()[i];
        let f = false_claims(
            null,
            Rule::Anytime,
            Schedule::ISSUE,
            AGENTS,
            1_000 * i as u64,
        );
        eprintln!("{}: {} of {} agents", null.label(), f.any_look, f.agents);
        assert!(f.within(stats::FAMILY_ALPHA), "{}: {f:?}", null.label());
    }

    #[test]
    fn any_look_best_model_two_equal() {
        at_most_five_percent_at_any_look(0);
    }

    #[test]
    fn any_look_best_model_three_equal() {
        at_most_five_percent_at_any_look(1);
    }

    #[test]
    fn any_look_best_model_rare_successes_uneven_split() {
        at_most_five_percent_at_any_look(2);
    }

    #[test]
    fn any_look_best_provider() {
        at_most_five_percent_at_any_look(3);
    }

    #[test]
    fn any_look_cheaper_model_at_the_margin() {
        at_most_five_percent_at_any_look(4);
    }

    #[test]
    fn any_look_high_rates_at_their_levels() {
        at_most_five_percent_at_any_look(5);
    }

    #[test]
    fn any_look_trend_below_levels() {
        at_most_five_percent_at_any_look(6);
    }

    #[test]
    fn any_look_trend_above_levels() {
        at_most_five_percent_at_any_look(7);
    }

    #[test]
    fn any_look_env_difference() {
        at_most_five_percent_at_any_look(8);
    }

    #[test]
    fn any_look_latency_abandonment() {
        at_most_five_percent_at_any_look(9);
    }

    #[test]
    fn every_null_is_tested() {
        assert_eq!(nulls().len(), 10);
    }

    /// Power on the issue's effect (0.55 vs 0.70): the better model is named by 800 sessions
    /// for most agents, the worse one never, and the running intersection keeps a claim once
    /// made.
    #[test]
    fn a_true_difference_is_named_early_and_kept() {
        let p = power(0.55, 0.70, Rule::Anytime, 2_000, 400, 300, 7);
        let median = p.quantile(0.5);
        assert!(median.is_some_and(|m| m <= 560), "{median:?}");
        assert!(
            p.quantile(0.9).is_some_and(|m| m <= 1_000),
            "{:?}",
            p.quantile(0.9)
        );
        assert_eq!(p.wrong, 0);
        assert_eq!(p.flickered, 0, "a claim came and went");
        // Without the intersection the same intervals do flicker: the intersection is what
        // keeps the answer steady.
        let loose = power(0.55, 0.70, Rule::AnytimeNoIntersection, 2_000, 400, 300, 7);
        assert!(loose.flickered > 0, "{}", loose.flickered);
        assert_eq!(
            loose.first, p.first,
            "the intersection never changes the first claim"
        );
    }

    /// The whole-life guarantee, with the code of a real recompute: 1,000 agents with equal
    /// models live 180 days (stretches 1 to 5), looked at 1 to 3 times a day at random times;
    /// at most 5% of them (plus the binomial margin) ever show a false best model, and no
    /// stretch shows more than its share.
    #[test]
    fn a_whole_life_shows_a_false_claim_at_most_five_percent() {
        let l = lifetime(0.6, 60, 180, 3, true, 1_000, 77);
        eprintln!("{l:?}");
        assert_eq!(l.stretches.len(), 5);
        assert!(l.life.within(stats::FAMILY_ALPHA), "{:?}", l.life);
        for (k, f) in (1..).zip(&l.stretches) {
            let alpha = stats::FAMILY_ALPHA * stats::stretch_share(k);
            assert!(f.within(alpha), "stretch {k}: {f:?}");
        }
    }

    /// The check above catches a missing spending: the same lives with the whole 5% in every
    /// stretch, over a year, show a false best model far more often than 5%.
    #[test]
    fn without_the_spending_a_long_life_breaks_the_bound() {
        let l = lifetime(0.6, 60, 360, 3, false, 400, 77);
        eprintln!("{l:?}");
        assert!(!l.life.within(stats::FAMILY_ALPHA), "{:?}", l.life);
    }

    #[test]
    fn stretch_shares_sum_to_at_most_one() {
        let total: f64 = (0..1_000_000).map(stats::stretch_share).sum();
        assert!(total <= 1.0 && total > 0.999_998, "{total}");
        assert_eq!(stats::stretch_share(0), 0.0);
    }

    #[test]
    fn power_quantiles() {
        let p = Power {
            first: vec![Some(120), Some(160), None, Some(200)],
            wrong: 0,
            flickered: 0,
        };
        assert_eq!(p.quantile(0.5), Some(160));
        assert_eq!(p.quantile(0.75), Some(200));
        assert_eq!(p.quantile(0.9), None);
    }

    /// Implicit evidence that follows satisfaction finds the better model sooner, never names
    /// the worse one, and counted three ways the same traffic agrees on the order.
    #[test]
    fn implicit_evidence_finds_the_better_model_sooner() {
        use crate::analytics::evidence::Evidence;
        let run =
            |evidence| implicit_power((0.55, 0.70), Behaviour::ISSUE, evidence, 4_000, 200, 7);
        let explicit = run(Evidence::EXPLICIT);
        let implicit = run(Evidence {
            implicit: true,
            continued: false,
        });
        let continued = run(Evidence {
            implicit: true,
            continued: true,
        });
        let median = |p: &Power| p.quantile(0.5).unwrap_or(u64::MAX);
        assert!(
            median(&implicit) < median(&explicit),
            "{implicit:?} vs {explicit:?}"
        );
        assert!(
            median(&continued) < median(&implicit),
            "{continued:?} vs {implicit:?}"
        );
        assert_eq!(explicit.wrong + implicit.wrong + continued.wrong, 0);
    }
}
