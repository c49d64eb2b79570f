//! The evaluation over a real SQLite file: records ingested with their variants, signals about
//! their sessions, the counts, the decision and the actions it takes.

use nm_types::experiment::Variant;
use nm_types::record::RequestRecord;
use sea_orm::{ConnectionTrait, Statement};

use super::super::{ArmSpec, Catalogue, NewExperiment, ProviderInfo};
use super::*;
use crate::Store;

const NOW: i64 = 1_800_000_000_000;

fn catalogue() -> Catalogue {
    let p = |credential: bool| ProviderInfo {
        wire_format: "openai".to_owned(),
        operator_credential: credential,
    };
    Catalogue::new([
        ("openai".to_owned(), p(false)),
        ("groq".to_owned(), p(true)),
    ])
}

fn new(guardrails: &[&str], auto: bool) -> NewExperiment {
    let arm = |name: &str, provider: &str, model: &str| ArmSpec {
        name: name.to_owned(),
        provider: provider.to_owned(),
        model: model.to_owned(),
        weight: 1,
    };
    NewExperiment {
        agent: "support-bot".to_owned(),
        arms: vec![
            arm("control", "openai", "gpt-4o-mini"),
            arm("candidate", "groq", "llama-3.3-70b-versatile"),
        ],
        guardrails: guardrails.iter().map(|g| (*g).to_owned()).collect(),
        auto_promote: auto,
        auto_rollback: auto,
        ..NewExperiment::default()
    }
}

/// Runs `test` on a fresh SQLite file and, when the test database is configured, on a fresh
/// PostgreSQL database.
async fn on_both<F: std::future::Future<Output = ()>>(test: impl Fn(Store) -> F) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/x.db?mode=rwc", dir.path().display());
    test(Store::connect(&url).await.unwrap()).await;
    if let Some(db) = crate::scratch::ScratchPg::for_tests().await {
        let store = Store::connect(&db.url).await.unwrap();
        test(store.clone()).await;
        store.close().await.unwrap();
        crate::scratch::drop_test_db(&db.url).await;
    }
}

/// `sessions` sessions on `arm`, one request each (status `status`), of which `successes`
/// end `accepted` and the others `abandoned`.
async fn traffic(
    store: &Store,
    e: &Experiment,
    arm: &str,
    sessions: u32,
    successes: u32,
    status: u16,
) {
    let records: Vec<RequestRecord> = (0..sessions)
        .map(|i| RequestRecord {
            request_id: format!("{arm}-r{i}"),
            started_at_ms: NOW - 3_600_000,
            key_id: "k".into(),
            provider: "openai".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".to_owned(),
            model: Some("m".to_owned()),
            agent: Some(e.agent.clone()),
            session_id: Some(format!("sess_{arm}_{i:04}").parse().unwrap()),
            status,
            latency_ms: 100,
            cost_micros: Some(1_000),
            variant: Some(Variant {
                experiment: e.id.as_str().into(),
                arm: arm.into(),
                requested_model: Some("gpt-4o".to_owned()),
            }),
            ..Default::default()
        })
        .collect();
    let budgets = crate::Budgets::load(store.clone(), NOW).await.unwrap();
    crate::Records::new(store.clone(), budgets)
        .ingest(&records)
        .await
        .unwrap();
    let db = store.conn();
    for i in 0..sessions {
        let action = if i < successes {
            "accepted"
        } else {
            "abandoned"
        };
        db.execute_raw(Statement::from_string(
            db.get_database_backend(),
            format!(
                "INSERT INTO signals (id, received_at_ms, session_id, action, key_id, agent, \
                 attributed_by_session, source) VALUES ('{arm}-s{i}', {}, 'sess_{arm}_{i:04}', \
                 '{action}', 'k', '{}', TRUE, 'explicit')",
                NOW - 1_000,
                e.agent
            ),
        ))
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_better_arm_is_decided_promoted_and_announced() {
    on_both(a_better_arm_is_decided_promoted_and_announced_on).await;
}

async fn a_better_arm_is_decided_promoted_and_announced_on(store: Store) {
    let x = Experiments::load(store.clone()).await.unwrap();
    let alerts = Alerts::new(store.clone());
    let e = x
        .create("key_admin", new(&[], true), &catalogue())
        .await
        .unwrap();
    traffic(&store, &e, "control", 120, 50, 200).await;
    traffic(&store, &e, "candidate", 120, 105, 200).await;

    let ev = x.evidence(&e, NOW).await.unwrap();
    let c = &ev.counts;
    assert_eq!(
        (
            c[0].sessions,
            c[0].requests,
            c[0].judged,
            c[0].successes,
            c[0].abandoned
        ),
        (120, 120, 120, 50, 70)
    );
    assert_eq!(
        (c[1].judged, c[1].successes, c[1].cost_micros),
        (120, 105, 120_000)
    );
    assert_eq!(ev.evaluation.verdict, Verdict::Decided { winner: 1 });

    assert_eq!(x.evaluate_all(Some(&alerts), NOW).await.unwrap(), 1);
    let after = x.get(&e.id).await.unwrap();
    assert_eq!(after.state, State::Decided);
    assert_eq!(after.winner.as_deref(), Some("candidate"));
    assert!(after.promoted, "auto-promote");
    let live = x.live();
    assert_eq!(live.experiments[0].arms.len(), 1);
    assert_eq!(&*live.experiments[0].arms[0].name, "candidate");
    let kinds: Vec<String> = x
        .history(&e.id)
        .await
        .unwrap()
        .into_iter()
        .map(|h| format!("{}:{}", h.kind, h.actor))
        .collect();
    assert_eq!(
        kinds,
        ["created:key_admin", "decided:system", "promoted:system"]
    );
    // Announced once; a second pass has nothing running to evaluate.
    assert_eq!(x.evaluate_all(Some(&alerts), NOW).await.unwrap(), 0);
    let db = store.conn();
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT COUNT(*) AS n FROM alert_events WHERE kind = 'experiment'".to_owned(),
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.try_get::<i64>("", "n").unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guardrail_stops_the_worse_arm_and_rolls_it_back() {
    on_both(a_guardrail_stops_the_worse_arm_and_rolls_it_back_on).await;
}

async fn a_guardrail_stops_the_worse_arm_and_rolls_it_back_on(store: Store) {
    let x = Experiments::load(store.clone()).await.unwrap();
    let e = x
        .create("key_admin", new(&["error_rate"], true), &catalogue())
        .await
        .unwrap();
    // Equal success, but the candidate's answers fail (502) four times in ten.
    traffic(&store, &e, "control", 100, 60, 200).await;
    traffic(&store, &e, "candidate", 60, 36, 200).await;
    let failing: Vec<RequestRecord> = (0..40)
        .map(|i| RequestRecord {
            request_id: format!("fail-{i}"),
            started_at_ms: NOW - 3_600_000,
            key_id: "k".into(),
            provider: "groq".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".to_owned(),
            agent: Some(e.agent.clone()),
            session_id: Some(format!("sess_fail_{i:04}").parse().unwrap()),
            status: 502,
            variant: Some(Variant {
                experiment: e.id.as_str().into(),
                arm: "candidate".into(),
                requested_model: None,
            }),
            ..Default::default()
        })
        .collect();
    let budgets = crate::Budgets::load(store.clone(), NOW).await.unwrap();
    crate::Records::new(store.clone(), budgets)
        .ingest(&failing)
        .await
        .unwrap();

    let ev = x.evidence(&e, NOW).await.unwrap();
    assert_eq!(ev.counts[1].errors, 40);
    assert_eq!(
        ev.evaluation.verdict,
        Verdict::Harm {
            arm: 1,
            guardrail: Guardrail::ErrorRate
        }
    );
    x.evaluate_all(None, NOW).await.unwrap();
    let after = x.get(&e.id).await.unwrap();
    // Rolled back: the experiment runs on with the control alone.
    assert_eq!(after.state, State::Running);
    assert!(after.arms[1].rolled_back);
    assert_eq!(x.live().experiments[0].arms.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_end_an_experiment_inconclusive_and_thresholds_are_fixed_once() {
    on_both(limits_end_an_experiment_inconclusive_and_thresholds_are_fixed_once_on).await;
}

async fn limits_end_an_experiment_inconclusive_and_thresholds_are_fixed_once_on(store: Store) {
    let x = Experiments::load(store.clone()).await.unwrap();
    let mut n = new(&["p95_latency"], false);
    n.max_sessions = 100;
    let e = x.create("key_admin", n, &catalogue()).await.unwrap();
    traffic(&store, &e, "control", 60, 30, 200).await;
    traffic(&store, &e, "candidate", 60, 31, 200).await;
    let ev = x.evidence(&e, NOW).await.unwrap();
    assert!(matches!(
        ev.evaluation.verdict,
        Verdict::Inconclusive { .. }
    ));
    // No history before the experiment: the threshold is its own requests' p95 (all 100 ms).
    let db = store.conn();
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            format!(
                "SELECT latency_threshold_ms AS t FROM experiments WHERE id = '{}'",
                e.id
            ),
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.try_get::<Option<i64>>("", "t").unwrap(), Some(100));
    x.evaluate_all(None, NOW).await.unwrap();
    let after = x.get(&e.id).await.unwrap();
    assert_eq!(after.state, State::Inconclusive);
    assert!(after.reason.contains("ruled out"), "{}", after.reason);
    assert!(x.live().experiments.is_empty());
}
