//! Agent analytics end to end through the real servers, on SQLite and PostgreSQL: progress
//! and ETA while collecting (from signals posted to `/v1/signal`), recommendations on seeded
//! synthetic traffic whose truth is known (model B truly better than A), outcome rates by
//! model, env and week, on-demand and scheduled recomputation, admin-only access, and the CLI
//! (`agents recommend`, and `agents show` with the same progress). The many-seed statistical
//! checks run in-process in `nm-controlplane` (`analytics::simulate`,
//! `analytics::ground_truth_tests`).

use std::collections::HashMap;
use std::time::Duration;

use nm_controlplane::analytics::synthetic::{AgentSpec, ModelSpec, generate};
use nm_controlplane::{Store, now_ms};
use nm_gateway::cli::{AgentsCommand, FilterArgs, RecommendArgs};
use nm_gateway::config::{self, FileSettings, Flags, Mode};
use nm_gateway::grpc::pb::{self, analytics_client::AnalyticsClient};
use sea_orm::{ConnectionTrait, Statement};
use tonic::transport::Channel;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, TestGateway, admin};

const DAY_MS: i64 = 86_400_000;

async fn client(gw: &TestGateway) -> AnalyticsClient<Channel> {
    AnalyticsClient::new(gw.grpc_channel().await)
}

async fn recommendations(gw: &TestGateway, agent: &str) -> pb::AgentAnalytics {
    client(gw)
        .await
        .get_recommendations(admin(pb::GetRecommendationsRequest {
            agent: agent.to_owned(),
            refresh: false,
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner()
}

fn ms(ts: Option<&prost_types::Timestamp>) -> i64 {
    ts.map_or(0, nm_gateway::grpc::convert::timestamp_to_ms)
}

async fn post_signal(gw: &TestGateway, agent: &str, session: &str, action: &str) {
    let a = gw
        .post(
            "/v1/signal",
            &[("content-type", "application/json"), ("nm-agent", agent)],
            format!(r#"{{"session_id":"{session}","action":"{action}"}}"#),
        )
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
}

async fn analytics_end_to_end(db: Db) {
    let Some(gw) = TestGateway::builder()
        .db(db)
        .env("NM_ANALYTICS_INTERVAL_SECS", "1")
        .start()
        .await
    else {
        return;
    };

    // Collecting: 5 real signals just now is 5 a day (a young agent's rate counts at least a
    // day), so the remaining 95 take 19 days.
    for i in 0..5 {
        post_signal(&gw, "fresh-agent", &format!("sess_fresh{i}"), "accepted").await;
    }
    let before = now_ms();
    let r = recommendations(&gw, "fresh-agent").await;
    assert_eq!(r.status(), pb::AnalyticsStatus::Collecting);
    let p = r.progress.unwrap_or_default();
    assert_eq!((p.signals, p.threshold, p.remaining), (5, 100, 95));
    assert!((p.daily_rate - 5.0).abs() < 1e-9, "{p:?}");
    let eta = ms(p.eta.as_ref());
    assert!(
        (eta - (before + 19 * DAY_MS)).abs() < 60_000,
        "eta {eta} vs {}",
        before + 19 * DAY_MS
    );
    assert!(ms(r.computed_at.as_ref()) >= before - 1_000);
    assert!(r.recommendations.is_empty() && r.summary.is_none());

    // Ready: seeded traffic where model-b truly succeeds 75% of the time against model-a's 55%.
    let store = Store::connect(&gw.db_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut spec = AgentSpec::new(
        "ab-test",
        600,
        vec![
            ModelSpec::new("openai", "model-a", 0.55, 2_000),
            ModelSpec::new("anthropic", "model-b", 0.75, 2_000),
        ],
    );
    spec.envs = vec![
        nm_controlplane::analytics::synthetic::EnvSpec {
            env: "production".into(),
            weight: 0.7,
            success_shift: 0.0,
        },
        nm_controlplane::analytics::synthetic::EnvSpec {
            env: "staging".into(),
            weight: 0.3,
            success_shift: 0.0,
        },
    ];
    let written = generate(&store, &[spec], 7, now_ms(), 1_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = store.close().await;

    let r = recommendations(&gw, "ab-test").await;
    assert_eq!(r.status(), pb::AnalyticsStatus::Ready);
    assert_eq!(
        r.progress.as_ref().map(|p| p.signals),
        Some(written.signals)
    );
    // In its first 60 days an agent's window is its whole life: from its first signal on.
    let window = r.window.unwrap_or_default();
    let first = r.progress.as_ref().and_then(|p| p.first_signal.as_ref());
    assert_eq!(ms(window.since.as_ref()), ms(first));
    assert!(ms(window.until.as_ref()) - ms(window.since.as_ref()) <= 60 * DAY_MS);
    let best: Vec<_> = r
        .recommendations
        .iter()
        .filter(|x| x.kind == "best_model")
        .collect();
    assert_eq!(best.len(), 1, "{:#?}", r.recommendations);
    assert_eq!(best[0].subject.as_deref(), Some("model-b"));
    assert!(!best[0].message.is_empty());
    let ev = &best[0].evidence[0];
    assert!(
        ev.difference_interval
            .as_ref()
            .is_some_and(|i| i.lower > 0.0)
    );
    assert!(ev.a.as_ref().is_some_and(|a| a.n >= 30));
    assert!(best[0].effect.is_some() && best[0].window.is_some());
    let summary = r.summary.clone().unwrap_or_default();
    assert_eq!(summary.sessions, written.sessions);
    assert!(
        r.costs
            .iter()
            .any(|c| c.scope == "model" && c.name == "model-b")
    );

    // Outcome rates by model, env and week add up to the summary.
    let rates = client(&gw)
        .await
        .get_outcome_rates(admin(pb::GetOutcomeRatesRequest {
            agent: "ab-test".into(),
            group_by: vec![
                pb::OutcomeDimension::Model as i32,
                pb::OutcomeDimension::Env as i32,
                pb::OutcomeDimension::Week as i32,
            ],
            range: None,
            limit: 0,
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert!(rates.rows.iter().all(|row| row.key.len() == 3));
    assert_eq!(
        rates.rows.iter().map(|row| row.sessions).sum::<u64>(),
        summary.sessions
    );
    assert_eq!(
        rates.rows.iter().map(|row| row.successes).sum::<u64>(),
        summary.successes
    );
    assert!(rates.rows.iter().any(|row| {
        row.key[1].value.as_deref() == Some("staging") && row.key[0].value.is_some()
    }));

    // The scheduler (every second here) stores both agents' results.
    let conn = gw.database().await;
    eventually(
        Duration::from_secs(20),
        "scheduled analytics stored",
        || async {
            let row = conn
                .query_one_raw(Statement::from_string(
                    conn.get_database_backend(),
                    "SELECT COUNT(*) AS n FROM analytics_results WHERE status = 'ready' AND agent = 'ab-test'",
                ))
                .await
                .ok()
                .flatten()?;
            (row.try_get::<i64>("", "n").ok()? == 1).then_some(())
        },
    )
    .await;
    let _ = conn.close().await;

    // On demand: every agent with signals.
    let all = client(&gw)
        .await
        .recompute(admin(pb::RecomputeRequest {
            agent: String::new(),
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner()
        .results;
    let mut names: Vec<&str> = all.iter().map(|a| a.agent.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["ab-test", "fresh-agent"]);

    // An agent nobody has heard of is collecting from zero, with no ETA.
    let ghost = recommendations(&gw, "no-such-agent").await;
    assert_eq!(ghost.status(), pb::AnalyticsStatus::Collecting);
    assert_eq!(
        ghost
            .progress
            .map(|p| (p.signals, p.remaining, p.eta.is_none())),
        Some((0, 100, true))
    );

    // Admin only, and names are validated.
    let mut c = client(&gw).await;
    let denied = c
        .get_recommendations(tonic::Request::new(pb::GetRecommendationsRequest {
            agent: "ab-test".into(),
            refresh: false,
        }))
        .await
        .err()
        .map(|e| e.code());
    assert_eq!(denied, Some(tonic::Code::Unauthenticated));
    let bad = c
        .get_recommendations(admin(pb::GetRecommendationsRequest {
            agent: " ".into(),
            refresh: true,
        }))
        .await
        .err()
        .map(|e| e.code());
    assert_eq!(bad, Some(tonic::Code::InvalidArgument));

    // The CLI, readable and JSON.
    let flags = Flags {
        controlplane_url: Some(gw.grpc_url()),
        admin_key: Some(ADMIN_KEY.to_owned()),
        ..Flags::default()
    };
    let settings = config::resolve(
        Mode::Client,
        &flags,
        &HashMap::new(),
        FileSettings::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let cli = |command: AgentsCommand| {
        let settings = settings.clone();
        async move {
            let mut out = Vec::new();
            nm_gateway::cli::agents(&settings, command, &mut out)
                .await
                .unwrap_or_else(|e| panic!("{e:#}"));
            String::from_utf8(out).unwrap_or_default()
        }
    };
    let recommend = |agent: &str, json: bool| {
        cli(AgentsCommand::Recommend(RecommendArgs {
            agent: agent.into(),
            refresh: false,
            json,
        }))
    };
    let run = |json: bool| recommend("ab-test", json);
    let text = run(false).await;
    assert!(text.contains("status: ready"), "{text}");
    assert!(text.contains("[best_model] Use model-b"), "{text}");
    // The first stretch of the agent's life spends 6/π² of the 5%: 96.96%.
    assert!(text.contains("anytime-valid 97%"), "{text}");

    // `agents show` gives a collecting agent the progress `agents recommend` gives.
    let shown = cli(AgentsCommand::Show {
        agent: Some("fresh-agent".into()),
        unattributed: false,
        filter: FilterArgs::default(),
        json: false,
    })
    .await;
    let progress = recommend("fresh-agent", false).await;
    let lines: Vec<&str> = progress
        .lines()
        .filter(|l| {
            l.starts_with("status:")
                || l.starts_with("recent rate:")
                || l.starts_with("recommendations expected:")
        })
        .collect();
    assert_eq!(lines.len(), 3, "{progress}");
    for line in lines {
        assert!(shown.contains(line), "{line:?} not in {shown}");
    }
    let v: serde_json::Value = serde_json::from_str(&run(true).await).unwrap_or_default();
    assert_eq!(v["status"], "ready");
    assert_eq!(v["recommendations"][0]["kind"], "best_model");
    assert_eq!(v["recommendations"][0]["subject"], "model-b");

    gw.stop().await;
}

#[tokio::test]
async fn analytics_sqlite() {
    analytics_end_to_end(Db::Sqlite).await;
}

#[tokio::test]
async fn analytics_postgres() {
    analytics_end_to_end(Db::Postgres).await;
}
