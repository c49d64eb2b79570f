//! The rules that turn an agent's aggregates into recommendations. Pure functions of counts
//! and of the intervals earlier looks kept: the same data always gives the same
//! recommendations.
//!
//! Every rule decides through [`super::stats`]: minimum samples per arm, anytime-valid
//! intervals that separate (Bonferroni-adjusted for the comparisons the question makes), or the
//! lower bound of a rate's confidence sequence above a level, each intersected with the same
//! comparison's intervals from earlier looks under a key (see [`Intersections`]). Keys start
//! with [`window_keys`] when they compare sessions of the whole window (named by the window's
//! start, so carried for the stretch of the agent's life that the window grows in) or with
//! [`week_keys`] when they compare this week with the last (carried for the week); the caller
//! gives each prefix its stretch's share of the level. A null situation (equal models, rates
//! below their levels, no trend, no latency effect, spend spread evenly) produces no
//! recommendation, at any look of the agent's whole life, but with probability at most 5% per
//! rule.

use nm_types::money::format_usd;

use super::query::{Aggregates, Periods};
use super::report::{
    CostScope, Effect, EvidenceItem, Figure, Kind, OutcomeCost, OutcomeRow, Recommendation, Window,
};
use super::rollup::TTFB_BANDS_MS;
use super::stats::{
    self, Direction, Intersections, MIN_SAMPLES_PER_ARM, NON_INFERIORITY_MARGIN, Proportion,
    best_arm, better, cost_concentration, differs, exceeds, performs_as_well, trend,
};

/// Regeneration is high when more than this share of sessions has a regeneration.
pub const LEVEL_REGENERATION: f64 = 0.30;
/// Abandonment is high when more than this share of sessions ends abandoned.
pub const LEVEL_ABANDONMENT: f64 = 0.20;
/// Heavy editing is high when more than this share of sessions has a heavy edit.
pub const LEVEL_HEAVY_EDIT: f64 = 0.25;
/// A model is "cheaper" when its mean cost per session is at most this share of the
/// reference's (at least 10% cheaper).
pub const CHEAPER_MAX_COST_SHARE: f64 = 0.9;
/// End users listed in the outcome-weighted cost (the costliest).
pub const TOP_COST_USERS: usize = 10;

/// Where the keys of comparisons over the whole window start (`window_since_ms` is the
/// window's start, which names the stretch of the agent's life: see `super::periods_at`).
pub fn window_keys(window_since_ms: i64) -> String {
    format!("window{window_since_ms}|")
}

/// Where the keys of this week's trend comparisons start (`week_since_ms` is the week's start).
pub fn week_keys(week_since_ms: i64) -> String {
    format!("week{week_since_ms}|")
}

/// Possible cuts between the TTFB bands (one fewer than the bands): the latency rule picks one
/// by the bands' sizes, and any of them could be picked, so it is Bonferroni over all of them.
const LATENCY_CUTS: u32 = TTFB_BANDS_MS.len() as u32;

/// The three rates watched for being high, with their levels.
const WATCHED: [(Kind, &str, f64); 3] = [
    (Kind::HighRegeneration, "regeneration", LEVEL_REGENERATION),
    (Kind::HighAbandonment, "abandonment", LEVEL_ABANDONMENT),
    (Kind::HighHeavyEdit, "heavy_edit", LEVEL_HEAVY_EDIT),
];

fn watched_rate(metric: &str, row: &OutcomeRow) -> Proportion {
    match metric {
        "regeneration" => Proportion::new(row.regenerated, row.sessions),
        "abandonment" => Proportion::new(row.abandoned, row.sessions),
        _ => Proportion::new(row.heavily_edited, row.sessions),
    }
}

fn success(row: &OutcomeRow) -> Proportion {
    Proportion::new(row.successes, row.sessions)
}

fn name(row: &OutcomeRow) -> Option<&str> {
    row.key.first().and_then(|k| k.as_deref())
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

fn pts(x: f64) -> String {
    format!("{:+.0} pts", x * 100.0)
}

fn usd(micros: Option<u64>) -> String {
    micros.map_or_else(|| "-".to_owned(), format_usd)
}

/// Named arms with at least [`MIN_SAMPLES_PER_ARM`] sessions (rows without a name left out).
fn eligible(rows: &[OutcomeRow]) -> Vec<&OutcomeRow> {
    rows.iter()
        .filter(|r| name(r).is_some() && r.sessions >= MIN_SAMPLES_PER_ARM)
        .collect()
}

/// Outcome-weighted cost: the agent, each named model, and the costliest end users.
pub fn costs(agent: &str, a: &Aggregates) -> Vec<OutcomeCost> {
    let cost = |scope, name: &str, r: &OutcomeRow| OutcomeCost {
        scope,
        name: name.to_owned(),
        sessions: r.sessions,
        successes: r.successes,
        cost_micros: r.cost_micros,
        cost_per_success_micros: r.cost_per_success_micros(),
        regenerations_per_success: r.regenerations_per_success(),
        success_rate: r.success_rate(),
    };
    let mut out = vec![cost(CostScope::Agent, agent, &a.total)];
    for r in &a.by_model {
        if let Some(n) = name(r) {
            out.push(cost(CostScope::Model, n, r));
        }
    }
    let mut users: Vec<&OutcomeRow> = a.by_user.iter().filter(|r| name(r).is_some()).collect();
    users.sort_by(|x, y| {
        y.cost_micros
            .cmp(&x.cost_micros)
            .then_with(|| x.key.cmp(&y.key))
    });
    for r in users.into_iter().take(TOP_COST_USERS) {
        if let Some(n) = name(r) {
            out.push(cost(CostScope::User, n, r));
        }
    }
    out
}

/// All the recommendations the evidence in `a` (over `periods`) supports, each comparison's
/// interval met with the earlier looks' in `run`.
pub fn recommend(
    a: &Aggregates,
    periods: &Periods,
    run: &mut Intersections,
) -> Vec<Recommendation> {
    let window = periods.window;
    let mut out = Vec::new();
    let best = best_model(a, window, run);
    let best_subject = best.as_ref().and_then(|b| b.subject.clone());
    out.extend(best);
    out.extend(best_provider(a, window, run));
    // A cheaper model that is also the best one is already said by the best-model finding.
    out.extend(
        cheaper_model(a, window, run)
            .filter(|c| best_subject.is_none() || c.subject != best_subject),
    );
    out.extend(high_rates(a, window, &week_keys(periods.recent_since), run));
    out.extend(env_difference(a, window, run));
    out.extend(latency_abandonment(a, window, run));
    out.extend(concentration(a, window));
    out
}

/// The arm whose success rate beats every other, with the evidence against each.
struct Leader<'a> {
    best: stats::Best,
    winner: &'a OutcomeRow,
    winner_name: String,
    evidence: Vec<EvidenceItem>,
}

fn leader<'a>(arms: &[&'a OutcomeRow], key: &str, run: &mut Intersections) -> Option<Leader<'a>> {
    let props: Vec<(&str, Proportion)> = arms
        .iter()
        .map(|r| (name(r).unwrap_or("-"), success(r)))
        .collect();
    let best = best_arm(&props, key, run)?;
    let winner = arms[best.arm];
    let winner_name = name(winner)?.to_owned();
    let evidence = best
        .against
        .iter()
        .map(|b| {
            EvidenceItem::compare(
                "success",
                name(arms[b.arm]).unwrap_or("-"),
                &winner_name,
                &b.evidence,
            )
        })
        .collect();
    Some(Leader {
        best,
        winner,
        winner_name,
        evidence,
    })
}

/// The model with the best success rate, when it beats every other model with enough sessions.
fn best_model(a: &Aggregates, window: Window, run: &mut Intersections) -> Option<Recommendation> {
    let arms = eligible(&a.by_model);
    let Leader {
        best,
        winner,
        winner_name,
        evidence,
    } = leader(
        &arms,
        &format!("{}best|success|model", window_keys(window.since_ms)),
        run,
    )?;
    let runner_up = best
        .against
        .iter()
        .max_by(|x, y| x.evidence.a.rate.total_cmp(&y.evidence.a.rate))?;
    let others = arms[runner_up.arm];
    let gain = winner.success_rate() - a.total.success_rate();
    let before = a.total.cost_per_success_micros();
    let after = winner.cost_per_success_micros();
    let cost_change = match (before, after) {
        (Some(b), Some(x)) if b > 0 => Some(x as f64 / b as f64 - 1.0),
        _ => None,
    };
    let message = format!(
        "Use {winner_name}: {} of its sessions succeed vs {} with {} ({}), across {} sessions",
        pct(winner.success_rate()),
        pct(others.success_rate()),
        name(others).unwrap_or("-"),
        pts(runner_up.evidence.difference),
        a.total.sessions,
    );
    Some(Recommendation {
        kind: Kind::BestModel,
        message,
        subject: Some(winner_name.clone()),
        evidence,
        figures: Vec::new(),
        effect: Effect {
            success_rate_change: Some(gain),
            cost_change,
            cost_per_success_before_micros: before,
            cost_per_success_after_micros: after,
            summary: format!(
                "moving all of the agent's traffic to {winner_name}: success {} ({}), cost per success {} -> {}",
                pct(winner.success_rate()),
                pts(gain),
                usd(before),
                usd(after)
            ),
        },
        window,
    })
}

/// The provider with the best success rate, unless it only repeats the best model's finding
/// (each eligible provider served one eligible model, so the comparison is the same one).
fn best_provider(
    a: &Aggregates,
    window: Window,
    run: &mut Intersections,
) -> Option<Recommendation> {
    let arms = eligible(&a.by_provider);
    let models = eligible(&a.by_model).len();
    if arms.len() < 2 || arms.len() == models {
        return None;
    }
    let Leader {
        winner,
        winner_name,
        evidence,
        ..
    } = leader(
        &arms,
        &format!("{}best|success|provider", window_keys(window.since_ms)),
        run,
    )?;
    let gain = winner.success_rate() - a.total.success_rate();
    Some(Recommendation {
        kind: Kind::BestProvider,
        message: format!(
            "Prefer provider {winner_name}: {} of its sessions succeed, better than every other provider",
            pct(winner.success_rate())
        ),
        subject: Some(winner_name.clone()),
        evidence,
        figures: Vec::new(),
        effect: Effect {
            success_rate_change: Some(gain),
            cost_change: None,
            cost_per_success_before_micros: a.total.cost_per_success_micros(),
            cost_per_success_after_micros: winner.cost_per_success_micros(),
            summary: format!(
                "moving the agent's traffic to {winner_name}: success {}",
                pts(gain)
            ),
        },
        window,
    })
}

/// A cheaper model that performs as well as a costlier one: for every pair of models with
/// enough sessions where one costs at most [`CHEAPER_MAX_COST_SHARE`] of the other per session,
/// the cheaper one's success must not be lower by more than [`NON_INFERIORITY_MARGIN`]
/// (Bonferroni over all such pairs). Of the pairs that pass, the one that would save the most
/// (the costlier model's sessions times the difference in cost per session) is recommended.
fn cheaper_model(
    a: &Aggregates,
    window: Window,
    run: &mut Intersections,
) -> Option<Recommendation> {
    let arms = eligible(&a.by_model);
    let cost = |r: &OutcomeRow| r.cost_per_session_micros().filter(|c| *c > 0);
    let mut pairs = Vec::new();
    for r in &arms {
        for c in &arms {
            if let (Some(rc), Some(cc)) = (cost(r), cost(c))
                && (cc as f64) <= rc as f64 * CHEAPER_MAX_COST_SHARE
            {
                pairs.push((*r, *c, rc, cc));
            }
        }
    }
    let m = u32::try_from(pairs.len()).unwrap_or(u32::MAX);
    // Every pair meets its interval (so the intersection goes on), then the best saving wins.
    let passed: Vec<_> = pairs
        .into_iter()
        .filter_map(|(r, c, rc, cc)| {
            let key = format!(
                "{}as_good|success|model|{}|{}|m{m}",
                window_keys(window.since_ms),
                name(r).unwrap_or("-"),
                name(c).unwrap_or("-")
            );
            performs_as_well(success(r), success(c), m, &key, run).map(|e| (r, c, rc, cc, e))
        })
        .collect();
    let (reference, cheap, ref_cost, cheap_cost, ev) = passed
        .into_iter()
        .max_by_key(|(r, _, rc, cc, _)| r.sessions.saturating_mul(rc - cc))?;
    let cheap_name = name(cheap)?.to_owned();
    let ref_name = name(reference)?.to_owned();
    let cost_change = cheap_cost as f64 / ref_cost as f64 - 1.0;
    Some(Recommendation {
        kind: Kind::CheaperModel,
        message: format!(
            "Try {cheap_name} instead of {ref_name}: {} cheaper per session and {} (success {} vs {})",
            pct(-cost_change),
            if ev.difference_interval.lower > 0.0 {
                "better".to_owned()
            } else {
                format!(
                    "as good within {} pts",
                    (NON_INFERIORITY_MARGIN * 100.0).round()
                )
            },
            pct(cheap.success_rate()),
            pct(reference.success_rate()),
        ),
        subject: Some(cheap_name.clone()),
        evidence: vec![EvidenceItem::compare(
            "success",
            &ref_name,
            &cheap_name,
            &ev,
        )],
        figures: vec![
            Figure {
                name: "non_inferiority_margin".to_owned(),
                value: NON_INFERIORITY_MARGIN,
            },
            Figure {
                name: "reference_cost_per_session_micros".to_owned(),
                value: ref_cost as f64,
            },
            Figure {
                name: "candidate_cost_per_session_micros".to_owned(),
                value: cheap_cost as f64,
            },
        ],
        effect: Effect {
            success_rate_change: Some(ev.difference),
            cost_change: Some(cost_change),
            cost_per_success_before_micros: reference.cost_per_success_micros(),
            cost_per_success_after_micros: cheap.cost_per_success_micros(),
            summary: format!(
                "{ref_name}'s traffic on {cheap_name}: cost per session {} -> {} ({}), success {} (at worst {})",
                usd(Some(ref_cost)),
                usd(Some(cheap_cost)),
                pct(cost_change),
                pts(ev.difference),
                pts(ev.difference_interval.lower),
            ),
        },
        window,
    })
}

/// Regeneration, abandonment and heavy-edit rates above their levels (Bonferroni over the
/// three), each with its trend (this calendar week so far against the last, Bonferroni over the
/// three); a rate below its level that got significantly worse is reported as a worsening trend.
///
/// The trend compares calendar weeks (UTC, from Monday), not the last 7 days against the 7
/// before: two sliding weeks change their sessions at every look, so no sequence could cover
/// them; last week is fixed and this week only grows, so within the week the looks are at a
/// growing set of sessions. On Monday the comparison starts again.
fn high_rates(
    a: &Aggregates,
    window: Window,
    week_keys: &str,
    run: &mut Intersections,
) -> Vec<Recommendation> {
    let m = WATCHED.len() as u32;
    let mut out = Vec::new();
    for (kind, metric, level) in WATCHED {
        let overall = watched_rate(metric, &a.total);
        let moved = trend(
            watched_rate(metric, &a.previous),
            watched_rate(metric, &a.recent),
            m,
            &format!("{week_keys}trend|{metric}|m{m}"),
            run,
        );
        let trend_evidence =
            moved.map(|s| EvidenceItem::compare(metric, "last week", "this week", &s.evidence));
        let trend_words = match moved.map(|s| s.direction) {
            Some(Direction::Higher) => format!(
                "rising ({} last week -> {} this week so far)",
                pct(a.previous_rate(metric)),
                pct(a.recent_rate(metric))
            ),
            Some(Direction::Lower) => format!(
                "falling ({} last week -> {} this week so far)",
                pct(a.previous_rate(metric)),
                pct(a.recent_rate(metric))
            ),
            None => "no significant change from last week".to_owned(),
        };
        let label = metric.replace('_', " ");
        let level_key = format!("{}level|{metric}|m{m}", window_keys(window.since_ms));
        if let Some(above) = exceeds(overall, level, m, &level_key, run) {
            let mut evidence = vec![EvidenceItem::above(metric, "all sessions", &above, m)];
            evidence.extend(trend_evidence);
            out.push(Recommendation {
                kind,
                message: format!(
                    "High {label} rate: {} of sessions (above {}), {trend_words}",
                    pct(overall.rate()),
                    pct(level)
                ),
                subject: Some(metric.to_owned()),
                evidence,
                figures: Vec::new(),
                effect: Effect {
                    success_rate_change: None,
                    cost_change: None,
                    cost_per_success_before_micros: a.total.cost_per_success_micros(),
                    cost_per_success_after_micros: None,
                    summary: format!(
                        "bringing the {label} rate down to {} would touch {} of {} sessions",
                        pct(level),
                        ((overall.rate() - level) * overall.n as f64).round(),
                        overall.n
                    ),
                },
                window,
            });
        } else if let (Some(shift), Some(ev)) = (moved, trend_evidence)
            && shift.direction == Direction::Higher
        {
            out.push(Recommendation {
                kind: Kind::WorseningTrend,
                message: format!("The {label} rate is {trend_words}"),
                subject: Some(metric.to_owned()),
                evidence: vec![ev],
                figures: Vec::new(),
                effect: Effect {
                    summary: format!(
                        "returning to last week's level would spare {} of this week's {} sessions",
                        pct(shift.evidence.difference),
                        shift.evidence.b.n
                    ),
                    ..Effect::default()
                },
                window,
            });
        }
    }
    out
}

impl Aggregates {
    fn recent_rate(&self, metric: &str) -> f64 {
        watched_rate(metric, &self.recent).rate()
    }
    fn previous_rate(&self, metric: &str) -> f64 {
        watched_rate(metric, &self.previous).rate()
    }
}

/// The largest difference in success between two environments, among the pairs the evidence
/// separates (Bonferroni over all pairs of envs with enough sessions).
fn env_difference(
    a: &Aggregates,
    window: Window,
    run: &mut Intersections,
) -> Option<Recommendation> {
    let mut arms = eligible(&a.by_env);
    // By name, so a pair keeps its key and orientation from look to look.
    arms.sort_by(|x, y| name(x).cmp(&name(y)));
    let k = arms.len() as u32;
    if k < 2 {
        return None;
    }
    let m = k * (k - 1) / 2;
    let mut found: Option<(usize, usize, stats::Shift)> = None;
    for i in 0..arms.len() {
        for j in (i + 1)..arms.len() {
            let key = format!(
                "{}differs|success|env|{}|{}|m{m}",
                window_keys(window.since_ms),
                name(arms[i]).unwrap_or("-"),
                name(arms[j]).unwrap_or("-")
            );
            if let Some(shift) = differs(success(arms[i]), success(arms[j]), m, &key, run)
                && found.as_ref().is_none_or(|(_, _, f)| {
                    shift.evidence.difference.abs() > f.evidence.difference.abs()
                })
            {
                found = Some((i, j, shift));
            }
        }
    }
    let (i, j, shift) = found?;
    // Name the better env first.
    let (hi, lo) = if shift.direction == Direction::Higher {
        (j, i)
    } else {
        (i, j)
    };
    let (hi_name, lo_name) = (name(arms[hi])?.to_owned(), name(arms[lo])?.to_owned());
    let gap = arms[hi].success_rate() - arms[lo].success_rate();
    Some(Recommendation {
        kind: Kind::EnvDifference,
        message: format!(
            "Sessions in {lo_name} succeed less than in {hi_name}: {} vs {} ({}); check what differs (model, prompt, config)",
            pct(arms[lo].success_rate()),
            pct(arms[hi].success_rate()),
            pts(-gap)
        ),
        subject: Some(lo_name.clone()),
        evidence: vec![EvidenceItem::compare(
            "success",
            name(arms[i]).unwrap_or("-"),
            name(arms[j]).unwrap_or("-"),
            &shift.evidence,
        )],
        figures: Vec::new(),
        effect: Effect {
            success_rate_change: Some(gap),
            summary: format!(
                "{lo_name} performing like {hi_name}: success {} there",
                pts(gap)
            ),
            ..Effect::default()
        },
        window,
    })
}

fn band_label(band: usize) -> String {
    match (
        band.checked_sub(1).map(|b| TTFB_BANDS_MS[b]),
        TTFB_BANDS_MS.get(band),
    ) {
        (None, Some(hi)) => format!("< {hi} ms"),
        (Some(lo), Some(hi)) => format!("{lo}-{hi} ms"),
        (Some(lo), None) => format!(">= {lo} ms"),
        (None, None) => "-".to_owned(),
    }
}

/// Slow time to first byte going with more abandonment: sessions split at the band boundary
/// that halves them (chosen by the sessions' numbers alone); the slow half must have the higher
/// abandonment rate, Bonferroni over every cut the split could choose ([`LATENCY_CUTS`]).
fn latency_abandonment(
    a: &Aggregates,
    window: Window,
    run: &mut Intersections,
) -> Option<Recommendation> {
    let buckets: Vec<Proportion> = a
        .by_ttfb
        .iter()
        .map(|(_, r)| Proportion::new(r.abandoned, r.sessions))
        .collect();
    let (cut, fast, slow) = stats::split_halves(&buckets)?;
    let cut_ms = a
        .by_ttfb
        .get(cut)
        .and_then(|(band, _)| band.checked_sub(1))
        .and_then(|b| TTFB_BANDS_MS.get(b))
        .copied()?;
    let key = format!(
        "{}latency|abandonment|cut{cut_ms}|m{LATENCY_CUTS}",
        window_keys(window.since_ms)
    );
    let ev = better(fast, slow, LATENCY_CUTS, &key, run)?;
    let ratio = if ev.a.rate > 0.0 {
        ev.b.rate / ev.a.rate
    } else {
        f64::INFINITY
    };
    let mut figures = vec![Figure {
        name: "ttfb_cut_ms".to_owned(),
        value: cut_ms as f64,
    }];
    for (band, r) in &a.by_ttfb {
        figures.push(Figure {
            name: format!("abandonment_rate {}", band_label(*band)),
            value: r.abandonment_rate(),
        });
    }
    Some(Recommendation {
        kind: Kind::LatencyAbandonment,
        message: format!(
            "Slow answers are abandoned more: TTFB >= {cut_ms} ms {} abandoned vs {} below ({:.1}x); cut time to first byte (streaming, a faster model, shorter prompts)",
            pct(ev.b.rate),
            pct(ev.a.rate),
            ratio
        ),
        subject: Some("ttfb".to_owned()),
        evidence: vec![EvidenceItem::compare(
            "abandonment",
            &format!("ttfb < {cut_ms} ms"),
            &format!("ttfb >= {cut_ms} ms"),
            &ev,
        )],
        figures,
        effect: Effect {
            success_rate_change: None,
            cost_change: None,
            cost_per_success_before_micros: None,
            cost_per_success_after_micros: None,
            summary: format!(
                "slow sessions abandoned as often as fast ones: {} fewer abandoned sessions",
                ((ev.b.rate - ev.a.rate) * ev.b.n as f64).round()
            ),
        },
        window,
    })
}

/// Cost concentrated in a few end users (see [`stats::CostConcentration::is_concentrated`]).
fn concentration(a: &Aggregates, window: Window) -> Option<Recommendation> {
    let costs: Vec<u64> = a.user_costs.iter().map(|(_, c)| *c).collect();
    let c = cost_concentration(&costs)?;
    if !c.is_concentrated() {
        return None;
    }
    let top: Vec<&str> = a
        .user_costs
        .iter()
        .take(3)
        .map(|(u, _)| u.as_str())
        .collect();
    Some(Recommendation {
        kind: Kind::CostConcentration,
        message: format!(
            "{} of {} end users ({}%) account for {} of the cost ({} of {}); top: {}; consider per-user budgets",
            c.top_users,
            c.users,
            stats::TOP_USERS_PERCENT,
            pct(c.top_share),
            format_usd(c.top_micros),
            format_usd(c.total_micros),
            top.join(", ")
        ),
        subject: None,
        evidence: Vec::new(),
        figures: vec![
            Figure {
                name: "users".to_owned(),
                value: c.users as f64,
            },
            Figure {
                name: "top_users".to_owned(),
                value: c.top_users as f64,
            },
            Figure {
                name: "top_share".to_owned(),
                value: c.top_share,
            },
            Figure {
                name: "gini".to_owned(),
                value: c.gini,
            },
            Figure {
                name: "total_micros".to_owned(),
                value: c.total_micros as f64,
            },
            Figure {
                name: "top_micros".to_owned(),
                value: c.top_micros as f64,
            },
        ],
        effect: Effect {
            success_rate_change: None,
            cost_change: Some(-c.top_share),
            cost_per_success_before_micros: None,
            cost_per_success_after_micros: None,
            summary: format!(
                "budgets on the top {} users bound {} of the agent's spend",
                c.top_users,
                pct(c.top_share)
            ),
        },
        window,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, sessions: u64, successes: u64, cost: u64) -> OutcomeRow {
        OutcomeRow {
            key: vec![Some(key.to_owned())],
            sessions,
            successes,
            cost_micros: cost,
            ..OutcomeRow::default()
        }
    }

    fn agg(models: Vec<OutcomeRow>) -> Aggregates {
        let mut total = OutcomeRow::default();
        for m in &models {
            total.sessions += m.sessions;
            total.successes += m.successes;
            total.cost_micros += m.cost_micros;
        }
        Aggregates {
            total,
            by_model: models,
            ..Aggregates::default()
        }
    }

    const P: Periods = Periods {
        window: Window {
            since_ms: 0,
            until_ms: 1,
        },
        recent_since: 0,
        previous_since: 0,
    };

    fn recs(a: &Aggregates) -> Vec<Recommendation> {
        recommend(a, &P, &mut Intersections::fresh())
    }

    #[test]
    fn null_situation_produces_nothing() {
        let a = agg(vec![row("a", 500, 300, 5000), row("b", 500, 300, 5000)]);
        assert!(recs(&a).is_empty());
        assert!(recs(&Aggregates::default()).is_empty());
    }

    #[test]
    fn better_model_is_named() {
        let a = agg(vec![row("a", 400, 200, 4000), row("b", 400, 300, 4000)]);
        let recs = recs(&a);
        assert_eq!(recs.len(), 1, "{recs:?}");
        assert_eq!(recs[0].kind, Kind::BestModel);
        assert_eq!(recs[0].subject.as_deref(), Some("b"));
        assert!(
            recs[0].evidence[0]
                .difference_interval
                .is_some_and(|i| i.lower > 0.0)
        );
    }

    #[test]
    fn cheaper_equal_model_is_found() {
        let a = agg(vec![
            row("big", 5000, 3500, 500_000),
            row("small", 5000, 3500, 50_000),
        ]);
        let recs = recs(&a);
        assert_eq!(recs.len(), 1, "{recs:?}");
        assert_eq!(recs[0].kind, Kind::CheaperModel);
        assert_eq!(recs[0].subject.as_deref(), Some("small"));
        assert!(recs[0].effect.cost_change.is_some_and(|c| c < -0.85));
    }

    #[test]
    fn too_few_sessions_is_no_evidence() {
        let a = agg(vec![row("a", 20, 2, 10), row("b", 20, 19, 10)]);
        assert!(recs(&a).is_empty());
    }

    /// Every comparison a pass makes keeps its interval under a key of its kind: the window's,
    /// or this week's.
    #[test]
    fn every_comparison_is_kept_under_its_key() {
        let mut a = agg(vec![row("a", 400, 200, 4000), row("b", 400, 300, 400)]);
        a.total.regenerated = 400;
        a.recent = OutcomeRow {
            sessions: 100,
            regenerated: 30,
            ..OutcomeRow::default()
        };
        a.previous = OutcomeRow {
            sessions: 100,
            regenerated: 20,
            ..OutcomeRow::default()
        };
        let periods = Periods {
            recent_since: 7 * 86_400_000,
            ..P
        };
        let mut run = Intersections::fresh();
        recommend(&a, &periods, &mut run);
        let keys: Vec<String> = run.into_met().into_keys().collect();
        for key in &keys {
            assert!(
                key.starts_with(&window_keys(0)) || key.starts_with(&week_keys(7 * 86_400_000)),
                "{key}"
            );
        }
        for want in [
            "window0|best|success|model|a|b|m1",
            "window0|as_good|success|model|a|b|m1",
            "window0|level|regeneration|m3",
            "week604800000|trend|regeneration|m3",
        ] {
            assert!(keys.iter().any(|k| k == want), "{want} not in {keys:?}");
        }
    }
}
