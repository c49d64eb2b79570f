//! Analytics end to end against a real SQLite file, on synthetic traffic whose truth is known
//! (generated from seeds): a truly better model is named, equal models are not (false-positive
//! rate over many seeds), a cheaper equal model is found, the threshold and ETA are right.
//! The same checks through the gRPC server, on SQLite and PostgreSQL, are in
//! `tests/analytics.rs`.

use std::collections::BTreeMap;

use super::synthetic::{AgentSpec, ModelSpec, Path, generate, generate_with};
use super::*;

const NOW: i64 = 1_800_000_000_000;

async fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/a.db?mode=rwc", dir.path().display());
    let store = Store::connect(&url).await.unwrap();
    (dir, store)
}

fn kinds(r: &AgentAnalytics) -> Vec<Kind> {
    r.recommendations.iter().map(|x| x.kind).collect()
}

#[tokio::test]
async fn better_model_is_recommended_with_its_evidence() {
    let (_dir, store) = store().await;
    let spec = AgentSpec::new(
        "b-better",
        600,
        vec![
            ModelSpec::new("openai", "model-a", 0.55, 1_000),
            ModelSpec::new("anthropic", "model-b", 0.75, 1_000),
        ],
    );
    generate(&store, &[spec], 11, NOW, 500).await.unwrap();
    // One request of model-b was traced: the evidence names its trace.
    let traced = nm_types::record::TraceRef {
        trace_id: [0x4b; 16],
        span_id: [0x0f; 8],
    };
    let budgets = crate::Budgets::load(store.clone(), NOW).await.unwrap();
    crate::Records::new(store.clone(), budgets)
        .ingest(&[nm_types::record::RequestRecord {
            request_id: "traced-1".to_owned(),
            started_at_ms: NOW - 60_000,
            key_id: "k".into(),
            provider: "anthropic".into(),
            method: "POST".into(),
            path: "/v1/messages".to_owned(),
            model: Some("model-b".to_owned()),
            agent: Some("b-better".to_owned()),
            status: 200,
            trace: Some(traced),
            ..Default::default()
        }])
        .await
        .unwrap();
    let r = Analytics::new(store)
        .compute("b-better", NOW)
        .await
        .unwrap();
    assert_eq!(r.status, Status::Ready);
    let best: Vec<_> = r
        .recommendations
        .iter()
        .filter(|x| x.kind == Kind::BestModel)
        .collect();
    assert_eq!(best.len(), 1, "{:?}", kinds(&r));
    let best = best[0];
    assert_eq!(best.subject.as_deref(), Some("model-b"));
    let ev = &best.evidence[0];
    assert_eq!(ev.a.label, "model-a");
    assert_eq!(ev.a.example_trace_id, None, "model-a had no traced request");
    assert_eq!(
        ev.b.as_ref().and_then(|b| b.example_trace_id.as_deref()),
        Some(traced.trace_hex().as_str())
    );
    assert!(ev.a.n >= 250 && ev.b.as_ref().is_some_and(|b| b.n >= 250));
    assert!(ev.difference_interval.is_some_and(|i| i.lower > 0.0));
    assert!(ev.prob_b_greater.is_some_and(|p| p > 0.99));
    assert!(best.effect.success_rate_change.is_some_and(|g| g > 0.0));
    assert_eq!(best.window, r.window);
    // No cheaper model: both cost the same.
    assert!(!kinds(&r).contains(&Kind::CheaperModel));
    // Outcome-weighted cost for the agent and both models.
    assert_eq!(
        r.costs.len(),
        2 + 1
            + r.costs
                .iter()
                .filter(|c| c.scope == report::CostScope::User)
                .count()
    );
    assert!(r.costs.iter().all(|c| c.cost_per_success_micros.is_some()));
}

/// Three equal models (same success rate, same price) for 60 seeds: a model recommendation
/// (best model or cheaper model) in at most 5% of them. Bonferroni over the three pairs keeps
/// the family-wise rate at or below 5% by construction; the data sets are all generated into
/// one SQLite file (one agent per seed) so the check stays fast.
#[tokio::test]
async fn equal_models_rarely_produce_a_model_recommendation() {
    const SEEDS: u64 = 60;
    let (_dir, store) = store().await;
    let specs: Vec<AgentSpec> = (0..SEEDS)
        .map(|seed| {
            AgentSpec::new(
                &format!("null-{seed}"),
                300,
                vec![
                    ModelSpec::new("openai", "model-a", 0.6, 1_000),
                    ModelSpec::new("openai", "model-b", 0.6, 1_000),
                    ModelSpec::new("openai", "model-c", 0.6, 1_000),
                ],
            )
        })
        .collect();
    generate_with(&store, &specs, 5, NOW, 4_000, Path::Direct)
        .await
        .unwrap();
    let analytics = Analytics::new(store);
    let mut fired = Vec::new();
    for seed in 0..SEEDS {
        let r = analytics
            .compute(&format!("null-{seed}"), NOW)
            .await
            .unwrap();
        assert_eq!(r.status, Status::Ready);
        assert!(r.summary.as_ref().is_some_and(|s| s.sessions == 300));
        if r.recommendations.iter().any(|x| {
            matches!(
                x.kind,
                Kind::BestModel | Kind::BestProvider | Kind::CheaperModel
            )
        }) {
            fired.push(seed);
        }
    }
    eprintln!(
        "model recommendations on equal models: {} of {SEEDS} seeds {fired:?}",
        fired.len()
    );
    assert!(
        fired.len() as u64 * 20 <= SEEDS,
        "fired for seeds {fired:?}"
    );
}

#[tokio::test]
async fn cheaper_equal_model_is_found() {
    let (_dir, store) = store().await;
    // "As good within 5 points" needs about 3,500 sessions per model to be found nine times in
    // ten (see `stats::performs_as_well`).
    let spec = AgentSpec::new(
        "cheaper",
        8_000,
        vec![
            ModelSpec::new("openai", "big-model", 0.7, 10_000),
            ModelSpec::new("openai", "small-model", 0.7, 1_000),
        ],
    );
    generate_with(&store, &[spec], 21, NOW, 4_000, Path::Direct)
        .await
        .unwrap();
    let r = Analytics::new(store).compute("cheaper", NOW).await.unwrap();
    let cheaper: Vec<_> = r
        .recommendations
        .iter()
        .filter(|x| x.kind == Kind::CheaperModel)
        .collect();
    assert_eq!(cheaper.len(), 1, "{:?}", r.recommendations);
    assert_eq!(cheaper[0].subject.as_deref(), Some("small-model"));
    assert!(cheaper[0].effect.cost_change.is_some_and(|c| c < -0.8));
    assert!(!kinds(&r).contains(&Kind::BestModel));
}

#[tokio::test]
async fn threshold_and_eta() {
    let (_dir, store) = store().await;
    // 9 sessions a day for 4 days, ~1.2 signals each: collecting, with a rate near 10/day.
    let mut spec = AgentSpec::new("young", 36, vec![ModelSpec::new("openai", "m", 0.7, 100)]);
    spec.days = 4;
    let w = generate(&store, &[spec], 3, NOW, 500).await.unwrap();
    assert!(w.signals < 100);
    let analytics = Analytics::new(store.clone());
    let r = analytics.get("young").await.unwrap();
    // `get` computes at the wall clock; recompute at NOW for exact numbers.
    assert_eq!(r.status, Status::Collecting);
    let r = analytics.compute("young", NOW).await.unwrap();
    assert_eq!(r.status, Status::Collecting);
    assert!(r.recommendations.is_empty() && r.summary.is_none());
    let p = &r.progress;
    assert_eq!(p.signals, w.signals);
    assert_eq!(p.remaining, 100 - w.signals);
    let expected_rate =
        w.signals as f64 / ((NOW - p.first_signal_ms.unwrap()) as f64 / DAY_MS as f64);
    assert!((p.daily_rate - expected_rate).abs() < 1e-6, "{p:?}");
    let eta_days = (p.eta_ms.unwrap() - NOW) as f64 / DAY_MS as f64;
    assert!(
        (eta_days - p.remaining as f64 / expected_rate).abs() < 0.01,
        "{eta_days}"
    );

    // Past the threshold: ready, stored, and read back as stored.
    let spec = AgentSpec::new("young", 200, vec![ModelSpec::new("openai", "m", 0.7, 100)]);
    generate(&store, &[spec], 4, NOW, 500).await.unwrap();
    let r = analytics.recompute("young").await.unwrap();
    assert_eq!(r.status, Status::Ready);
    assert!(r.progress.signals >= 100 && r.progress.eta_ms.is_none());
    let again = analytics.get("young").await.unwrap();
    assert_eq!(again, r);
}

#[tokio::test]
async fn demo_agents_show_each_kind() {
    let (_dir, store) = store().await;
    let specs = synthetic::demo_specs();
    generate_with(&store, &specs, 42, NOW, 4_000, Path::Direct)
        .await
        .unwrap();
    let analytics = Analytics::new(store);
    let support = analytics.compute("support-assistant", NOW).await.unwrap();
    let k = kinds(&support);
    for want in [
        Kind::BestModel,
        Kind::LatencyAbandonment,
        Kind::CostConcentration,
    ] {
        assert!(k.contains(&want), "support-assistant lacks {want:?}: {k:?}");
    }
    let search = analytics.compute("doc-search", NOW).await.unwrap();
    assert!(
        kinds(&search).contains(&Kind::CheaperModel),
        "{:?}",
        kinds(&search)
    );
    let review = analytics.compute("code-review", NOW).await.unwrap();
    let k = kinds(&review);
    for want in [Kind::HighRegeneration, Kind::EnvDifference] {
        assert!(k.contains(&want), "code-review lacks {want:?}: {k:?}");
    }
    let fresh = analytics.compute("email-drafter", NOW).await.unwrap();
    assert_eq!(fresh.status, Status::Collecting);

    // Outcome rates by model and week add up to the summary.
    let (_, rows) = analytics
        .outcome_rates(
            "support-assistant",
            &[Dimension::Model, Dimension::Week],
            Some(NOW - WINDOW_DAYS * DAY_MS),
            Some(NOW),
            0,
        )
        .await
        .unwrap();
    let sessions: u64 = rows.iter().map(|r| r.sessions).sum();
    assert_eq!(Some(sessions), support.summary.as_ref().map(|s| s.sessions));
    assert!(rows.iter().all(|r| r.key.len() == 2));
    assert!(
        rows.iter()
            .any(|r| r.key[1].as_deref().is_some_and(|w| w.len() == 10))
    );
}

// === recomputed look after look ===

const HOUR_MS: i64 = 3_600_000;

/// Adds a batch of `per_agent` sessions to each of `agents` agents (`{prefix}-{i}`, models
/// `model-a` and `model-b` with these success rates), spread over the day before `now`.
async fn add_batch(
    store: &Store,
    prefix: &str,
    agents: usize,
    rates: (f64, f64),
    per_agent: usize,
    seed: u64,
    now: i64,
) {
    let specs: Vec<AgentSpec> = (0..agents)
        .map(|i| {
            let mut spec = AgentSpec::new(
                &format!("{prefix}-{i}"),
                per_agent,
                vec![
                    ModelSpec::new("openai", "model-a", rates.0, 1_000),
                    ModelSpec::new("openai", "model-b", rates.1, 1_000),
                ],
            );
            spec.days = 1;
            spec
        })
        .collect();
    generate_with(store, &specs, seed, now, 4_000, Path::Direct)
        .await
        .unwrap();
}

fn best_model(r: &AgentAnalytics) -> Option<&Recommendation> {
    r.recommendations.iter().find(|x| x.kind == Kind::BestModel)
}

/// The experiment through a real SQLite file and the scheduler's path
/// ([`Analytics::recompute_at`], which reads and stores the intervals with the answer), for a
/// few seeds: agents whose models are equal, batches of 40 sessions an hour apart, a recompute
/// after each from 120 sessions to 800 (18 looks). No answer shows a winner beyond the 5% (the
/// rate itself is measured on thousands of agents in `simulate.rs`); the old fixed-sample rule
/// on the same counts is printed for comparison (the issue saw 5 of 20).
#[tokio::test]
async fn equal_models_show_no_winner_across_recomputes() {
    const AGENTS: usize = 5;
    let (_dir, store) = store().await;
    let analytics = Analytics::new(store.clone());
    let (mut now, mut sessions) = (NOW, 0);
    let (mut fixed, mut shown) = (vec![false; AGENTS], vec![false; AGENTS]);
    for batch in 0..20u64 {
        now += HOUR_MS;
        add_batch(&store, "aa", AGENTS, (0.6, 0.6), 40, 100 + batch, now).await;
        sessions += 40;
        if sessions < 120 {
            continue;
        }
        for i in 0..AGENTS {
            let agent = format!("aa-{i}");
            let r = analytics.recompute_at(&agent, now).await.unwrap();
            assert_eq!(r.status, Status::Ready);
            assert_eq!(r.summary.as_ref().map(|s| s.sessions), Some(sessions));
            shown[i] |= best_model(&r).is_some();
            // The old rule on the same counts (the answer's per-model outcome-weighted cost).
            let by_model = r
                .costs
                .iter()
                .filter(|c| c.scope == report::CostScope::Model)
                .map(|c| OutcomeRow {
                    key: vec![Some(c.name.clone())],
                    sessions: c.sessions,
                    successes: c.successes,
                    ..OutcomeRow::default()
                })
                .collect();
            let aggregates = query::Aggregates {
                by_model,
                ..query::Aggregates::default()
            };
            fixed[i] |= simulate::fixed_best_model(&aggregates).is_some();
        }
    }
    let count = |v: &[bool]| v.iter().filter(|x| **x).count();
    eprintln!(
        "equal models, 18 looks: fixed-sample rule {} of {AGENTS}, anytime-valid {} of {AGENTS}",
        count(&fixed),
        count(&shown)
    );
    // 5% of 5 agents, with the binomial margin: at most one.
    let claims = simulate::FalseClaims {
        agents: AGENTS as u64,
        any_look: count(&shown) as u64,
        ..simulate::FalseClaims::default()
    };
    assert!(claims.within(stats::FAMILY_ALPHA), "{shown:?}");
}

/// A true difference (0.55 against 0.70), recomputed after every batch: the better model is
/// named, the worse one never, and once named it stays, its interval only narrowing (the
/// running intersection, read back from the stored answer).
#[tokio::test]
async fn a_better_model_is_named_and_kept_across_recomputes() {
    const AGENTS: usize = 2;
    let (_dir, store) = store().await;
    let analytics = Analytics::new(store.clone());
    let (mut now, mut sessions) = (NOW, 0);
    let mut first: Vec<Option<(u64, f64)>> = vec![None; AGENTS];
    for batch in 0..25u64 {
        now += HOUR_MS;
        add_batch(&store, "ab", AGENTS, (0.55, 0.70), 40, 200 + batch, now).await;
        sessions += 40;
        if sessions < 120 {
            continue;
        }
        for (i, first) in first.iter_mut().enumerate() {
            let r = analytics
                .recompute_at(&format!("ab-{i}"), now)
                .await
                .unwrap();
            match (best_model(&r), *first) {
                (Some(best), _) => {
                    assert_eq!(best.subject.as_deref(), Some("model-b"));
                    let lower = best.evidence[0]
                        .difference_interval
                        .map_or(f64::NAN, |d| d.lower);
                    assert!(lower > 0.0);
                    // (The stored JSON may round the last digit.)
                    if let Some((_, earlier)) = *first {
                        assert!(lower >= earlier - 1e-12, "agent {i}: {lower} < {earlier}");
                    }
                    *first = Some((first.map_or(sessions, |f| f.0), lower));
                }
                (None, Some((at, _))) => {
                    panic!("agent {i}: named at {at} sessions, gone at {sessions}")
                }
                (None, None) => {}
            }
        }
    }
    eprintln!("0.55 vs 0.70: first named at {first:?}");
    assert!(first.iter().all(Option::is_some), "{first:?}");
}

/// The stored intervals are carried within a stretch of the agent's life (its first 60 days,
/// though the sessions of day 1 are then more than 30 days old), and dropped once the next
/// stretch starts; the origin the stretches count from is stored with them and never moves.
#[tokio::test]
async fn intervals_are_carried_within_a_stretch_only() {
    let (_dir, store) = store().await;
    let analytics = Analytics::new(store.clone());
    add_batch(&store, "win", 1, (0.5, 0.7), 400, 1, NOW).await;
    analytics.recompute_at("win-0", NOW).await.unwrap();
    let first = analytics
        .stored_with_sequences("win-0")
        .await
        .unwrap()
        .unwrap();
    let origin = first.origin_ms.unwrap();
    assert_eq!(Some(origin), first.report.progress.first_signal_ms);
    let window = recommend::window_keys(origin);
    assert!(
        first.sequences.keys().any(|k| k.starts_with(&window)),
        "{:?}",
        first.sequences
    );
    // 31 days on: still stretch 1, the window still starts at the origin and the intervals
    // are met with the earlier ones (never wider).
    let later = NOW + 31 * DAY_MS;
    add_batch(&store, "win", 1, (0.5, 0.7), 400, 2, later).await;
    let r = analytics.recompute_at("win-0", later).await.unwrap();
    assert_eq!(r.window.since_ms, origin);
    let kept = analytics
        .stored_with_sequences("win-0")
        .await
        .unwrap()
        .unwrap();
    for (key, i) in &first.sequences {
        if key.starts_with(&window) {
            let j = kept.sequences[key];
            assert!(
                j.lower >= i.lower - 1e-12 && j.upper <= i.upper + 1e-12,
                "{key}"
            );
        }
    }
    // 61 days on, stretch 2: the window starts 30 days after the origin, and a look stands on
    // its own (what it stores is its own intervals, met with nothing earlier).
    let last = NOW + 61 * DAY_MS;
    add_batch(&store, "win", 1, (0.5, 0.7), 400, 3, last).await;
    let r = analytics.recompute_at("win-0", last).await.unwrap();
    assert_eq!(r.window.since_ms, origin + 30 * DAY_MS);
    let fresh = analytics
        .compute_from(
            "win-0",
            last,
            Earlier {
                sequences: BTreeMap::new(),
                origin_ms: Some(origin),
                evidence: super::Evidence::EXPLICIT,
                parked: BTreeMap::new(),
            },
        )
        .await
        .unwrap();
    let stored = analytics
        .stored_with_sequences("win-0")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.origin_ms, Some(origin));
    // The same intervals (up to the JSON's last digit).
    assert_eq!(
        stored.sequences.keys().collect::<Vec<_>>(),
        fresh.sequences.keys().collect::<Vec<_>>()
    );
    assert!(
        stored
            .sequences
            .keys()
            .all(|k| !k.starts_with(&window) && !k.starts_with("window|"))
    );
    for (key, i) in &stored.sequences {
        let j = fresh.sequences[key];
        assert!(
            (i.lower - j.lower).abs() < 1e-12 && (i.upper - j.upper).abs() < 1e-12,
            "{key}"
        );
    }
    assert_eq!(
        stored.report.recommendations.len(),
        fresh.report.recommendations.len()
    );
}

/// Answers stored before the intervals existed are read (and the next look starts afresh).
#[tokio::test]
async fn answers_stored_without_intervals_are_read() {
    let (_dir, store) = store().await;
    let analytics = Analytics::new(store.clone());
    add_batch(&store, "old", 1, (0.5, 0.7), 400, 1, NOW).await;
    let r = analytics.compute("old-0", NOW).await.unwrap();
    analytics.save(&r).await.unwrap();
    let stored = analytics
        .stored_with_sequences("old-0")
        .await
        .unwrap()
        .unwrap();
    assert!(stored.sequences.is_empty());
    // (Equal up to the JSON's last digit of a float.)
    let messages = |a: &AgentAnalytics| -> Vec<String> {
        a.recommendations
            .iter()
            .map(|x| x.message.clone())
            .collect()
    };
    assert_eq!(stored.report.summary, r.summary);
    assert_eq!(messages(&stored.report), messages(&r));
    // The JSON an older controlplane wrote is the answer alone.
    let json = serde_json::to_string(&r).unwrap();
    assert!(!json.contains("sequences"));
    let again = analytics.recompute_at("old-0", NOW).await.unwrap();
    assert_eq!(messages(&again), messages(&r));
}

/// Each evidence setting keeps its own intervals: a look under another setting starts its own
/// (the explicit ones parked, not met with implicit data), and the setting that comes back
/// resumes its intervals where they were.
#[tokio::test]
async fn each_evidence_setting_keeps_its_own_intervals() {
    use super::evidence::{self, Evidence};
    let (_dir, store) = store().await;
    let analytics = Analytics::new(store.clone());
    add_batch(&store, "win", 1, (0.5, 0.7), 400, 1, NOW).await;
    analytics.recompute_at("win-0", NOW).await.unwrap();
    let explicit = analytics
        .stored_with_sequences("win-0")
        .await
        .unwrap()
        .unwrap();
    assert!(!explicit.sequences.is_empty());
    // Implicit signals shown beside (here none: the same sessions).
    assert_eq!(
        explicit
            .report
            .implicit_summary
            .as_ref()
            .map(|s| s.sessions),
        explicit.report.summary.as_ref().map(|s| s.sessions)
    );
    let implicit = Evidence {
        implicit: true,
        continued: false,
    };
    evidence::save(store.conn(), "win-0", implicit, NOW)
        .await
        .unwrap();
    let r = analytics.recompute_at("win-0", NOW + 1).await.unwrap();
    assert_eq!(r.evidence, implicit);
    assert_eq!(r.implicit_summary, None, "counted, not beside");
    let switched = analytics
        .stored_with_sequences("win-0")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        switched.parked.get(Evidence::EXPLICIT.key()),
        Some(&explicit.sequences)
    );
    evidence::save(store.conn(), "win-0", Evidence::EXPLICIT, NOW + 2)
        .await
        .unwrap();
    analytics.recompute_at("win-0", NOW + 2).await.unwrap();
    let back = analytics
        .stored_with_sequences("win-0")
        .await
        .unwrap()
        .unwrap();
    assert!(back.parked.contains_key(implicit.key()));
    for (key, i) in &explicit.sequences {
        let Some(j) = back.sequences.get(key) else {
            continue;
        };
        assert!(
            j.lower >= i.lower - 1e-12 && j.upper <= i.upper + 1e-12,
            "{key}: resumed, never wider"
        );
    }
}

/// A recommendation an agent's look makes for the first time is announced once: the next look,
/// making it again, announces nothing.
#[tokio::test]
async fn a_new_recommendation_is_announced_once() {
    let (_dir, store) = store().await;
    let spec = AgentSpec::new(
        "announced",
        600,
        vec![
            ModelSpec::new("openai", "model-a", 0.55, 1_000),
            ModelSpec::new("anthropic", "model-b", 0.75, 1_000),
        ],
    );
    generate(&store, &[spec], 11, NOW, 500).await.unwrap();
    let alerts = crate::Alerts::new(store.clone());
    let analytics = Analytics::new(store.clone()).with_alerts(alerts.clone());
    let events = || async {
        let db = store.conn();
        let rows = db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT dedupe, data FROM alert_events WHERE kind = 'recommendation'",
            ))
            .await
            .unwrap();
        rows.iter()
            .map(|r| r.try_get::<String>("", "data").unwrap())
            .collect::<Vec<_>>()
    };
    let first = analytics.recompute_at("announced", NOW).await.unwrap();
    let made = first.recommendations.len();
    assert!(made >= 1, "{:?}", kinds(&first));
    let announced = events().await;
    assert_eq!(announced.len(), made, "{announced:?}");
    assert!(
        announced
            .iter()
            .any(|d| d.contains("best_model") && d.contains("model-b")),
        "{announced:?}"
    );
    analytics
        .recompute_at("announced", NOW + 60_000)
        .await
        .unwrap();
    assert_eq!(events().await.len(), made);
}
