//! Implicit signals in the controlplane (issue 32.4, 32.5), end to end through a real
//! controlplane (`serve` on SQLite, split on PostgreSQL): records carrying what the rules
//! inferred are sent through the dataplane's port as its shipper sends them (the rules
//! themselves are the dataplane's), then read back over the admin API: stored once however often
//! the batch is resent, attributed whether the judged answer's record came before or after,
//! counted by source and rule, listed a page at a time; the analytics count them only once the
//! agent's settings say so, an explicit signal always winning over implicit ones, with the
//! agreement table of the units that have both; and only an admin key may change the settings.

use std::collections::HashMap;

use nm_gateway::cli::{self, AgentsCommand, FilterArgs, SignalsCommand};
use nm_gateway::config::{self, FileSettings, Flags, Mode};
use nm_gateway::grpc::pb::{
    self, agents_client::AgentsClient, analytics_client::AnalyticsClient, keys_client::KeysClient,
};
use nm_types::record::{Inferred, RequestRecord};
use nm_types::signal::Rule;

use crate::answer_signals::{by_model, fresh_request_id, port};
use crate::common::gateway::{ADMIN_KEY, Db, Shape, TestGateway, admin, with_key};

fn inferred(rule: Rule, answer: &str, edit_distance: Option<u64>) -> Inferred {
    Inferred {
        rule,
        answer: answer.parse().unwrap_or_else(|e| panic!("{e}")),
        edit_distance,
    }
}

async fn implicit_signals(db: Db, shape: Shape) {
    let Some(gw) = TestGateway::builder().db(db).shape(shape).start().await else {
        return;
    };
    // A service key: records name it, and it may not change settings.
    let service = KeysClient::new(gw.grpc_channel().await)
        .create_key(admin(pb::CreateKeyRequest {
            name: "records".to_owned(),
            admin: false,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("create: {e}"))
        .into_inner();
    let key = service.key.unwrap_or_else(|| panic!("no key")).id;
    let (link, stop) = port(&gw).await;
    let now = chrono::Utc::now().timestamp_millis();
    let record = |id: &str, model: &str, session: &str, inferred: Vec<Inferred>| RequestRecord {
        request_id: id.to_owned(),
        started_at_ms: now,
        key_id: key.as_str().into(),
        provider: "openai".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        status: 200,
        streamed: true,
        model: Some(model.to_owned()),
        agent: Some("imp".to_owned()),
        session_id: session.parse().ok(),
        inferred,
        ..RequestRecord::default()
    };
    let [r1, r2, q1, q2, p1, p2, x1, x2] = std::array::from_fn(|_| fresh_request_id());
    // s1: the first answer carried on unchanged, the second abandoned mid-stream.
    // s2: the first answer asked again (an implicit failure); the application says accepted.
    // s3: the first answer carried back lightly edited (a success), no explicit signal.
    // s4: the second request re-asks the first, whose record comes later.
    let batch = vec![
        record(&r1, "m-a", "sess_i1", vec![]),
        record(
            &r2,
            "m-a",
            "sess_i1",
            vec![
                inferred(Rule::Continued, &r1, None),
                inferred(Rule::ClientDisconnect, &r2, None),
            ],
        ),
        record(&q1, "m-b", "sess_i2", vec![]),
        record(
            &q2,
            "m-b",
            "sess_i2",
            vec![inferred(Rule::Reask, &q1, None)],
        ),
        record(&p1, "m-b", "sess_i3", vec![]),
        record(
            &p2,
            "m-b",
            "sess_i3",
            vec![inferred(Rule::HistoryEdit, &p1, Some(12))],
        ),
        record(
            &x2,
            "m-c",
            "sess_i4",
            vec![inferred(Rule::Reask, &x1, None)],
        ),
    ];
    for _ in 0..2 {
        // Resent whole: stored once.
        let ingested = link.ingest(&batch).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(ingested.rejected.is_empty(), "{:?}", ingested.rejected);
    }
    let late = [record(&x1, "m-c", "sess_i4", vec![])];
    link.ingest(&late).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        gw.count("SELECT COUNT(*) AS n FROM signals WHERE source = 'implicit'")
            .await,
        5
    );
    assert_eq!(
        gw.count(&format!(
            "SELECT COUNT(*) AS n FROM signals WHERE id = '{x2}:reask' AND request_id = '{x1}' \
             AND session_id = 'sess_i4' AND agent = 'imp' AND action = 'regenerated' \
             AND source = 'implicit' AND rule = 'reask'"
        ))
        .await,
        1,
        "attributed by the record that carried it"
    );
    // The application's signal for s2.
    let a = gw
        .raw(
            "POST",
            "/v1/signal",
            &[("nm-key", ADMIN_KEY), ("content-type", "application/json")],
            r#"{"session_id":"sess_i2","action":"accepted"}"#.to_owned(),
        )
        .await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));

    // Default: explicit only; implicit signals shown beside.
    assert_eq!(by_model(&gw, "imp").await, [(Some("m-b".to_owned()), 1, 1)]);
    let mut agents = AgentsClient::new(gw.grpc_channel().await);
    let shown = agents
        .get_agent_signals(admin(pb::GetAgentSignalsRequest {
            agent: "imp".to_owned(),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(shown.total, 6);
    let sources: Vec<(String, Option<String>, u64)> = shown
        .by_source
        .iter()
        .map(|c| (c.source.clone(), c.rule.clone(), c.total))
        .collect();
    assert_eq!(
        sources,
        [
            ("explicit".to_owned(), None, 1),
            (
                "implicit".to_owned(),
                Some("client_disconnect".to_owned()),
                1
            ),
            ("implicit".to_owned(), Some("reask".to_owned()), 2),
            ("implicit".to_owned(), Some("history_edit".to_owned()), 1),
            ("implicit".to_owned(), Some("continued".to_owned()), 1),
        ]
    );
    let settings = shown.settings.unwrap_or_default();
    assert_eq!(
        (settings.evidence.as_str(), settings.continued_counts),
        ("explicit", false)
    );
    let agreement: Vec<(String, String, u64)> = shown
        .agreement
        .iter()
        .map(|c| {
            (
                c.explicit_outcome.clone(),
                c.implicit_outcome.clone(),
                c.units,
            )
        })
        .collect();
    assert_eq!(
        agreement,
        [("success".to_owned(), "failure".to_owned(), 1)],
        "s2: accepted by the application, asked again"
    );

    // A service key may not change an agent's settings.
    let denied = agents
        .set_agent_settings(with_key(
            &service.secret,
            pb::SetAgentSettingsRequest {
                agent: "imp".to_owned(),
                evidence: "explicit+implicit".to_owned(),
                continued_counts: false,
            },
        ))
        .await
        .err()
        .map(|s| s.code());
    assert_eq!(denied, Some(tonic::Code::PermissionDenied));
    let bad = agents
        .set_agent_settings(admin(pb::SetAgentSettingsRequest {
            agent: "imp".to_owned(),
            evidence: "explicit".to_owned(),
            continued_counts: true,
        }))
        .await
        .err()
        .map(|s| s.code());
    assert_eq!(bad, Some(tonic::Code::InvalidArgument));

    // Explicit + implicit: the explicit signal still decides s2; s1 abandoned, s3 a light
    // edit, s4 asked again.
    let set = agents
        .set_agent_settings(admin(pb::SetAgentSettingsRequest {
            agent: "imp".to_owned(),
            evidence: "explicit+implicit".to_owned(),
            continued_counts: false,
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(set.evidence, "explicit+implicit");
    assert!(set.updated_at.is_some());
    // The change is in the audit trail (the refused ones are not).
    assert_eq!(
        gw.count(
            "SELECT COUNT(*) AS n FROM audit_events WHERE action = 'agent.settings.set' \
             AND target = 'agent:imp' AND before_json IS NULL \
             AND after_json LIKE '%explicit+implicit%'"
        )
        .await,
        1
    );
    assert_eq!(
        by_model(&gw, "imp").await,
        [
            (Some("m-a".to_owned()), 1, 0),
            (Some("m-b".to_owned()), 2, 2),
            (Some("m-c".to_owned()), 1, 0),
        ]
    );
    let analytics = AnalyticsClient::new(gw.grpc_channel().await)
        .get_recommendations(admin(pb::GetRecommendationsRequest {
            agent: "imp".to_owned(),
            refresh: true,
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(analytics.evidence, "explicit + implicit");
    assert_eq!(
        analytics.progress.unwrap_or_default().signals,
        5,
        "continued not counted"
    );

    // The list: newest first, a page at a time, every field.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = agents
            .list_signals(admin(pb::ListSignalsRequest {
                agent: "imp".to_owned(),
                page_size: 2,
                page_token: token,
                ..Default::default()
            }))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_inner();
        assert!(page.signals.len() <= 2);
        seen.extend(page.signals);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen.len(), 6);
    let mut ids: Vec<&str> = seen.iter().map(|s| s.id.as_str()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 6, "no signal on two pages");
    let edit = seen
        .iter()
        .find(|s| s.rule.as_deref() == Some("history_edit"))
        .unwrap_or_else(|| panic!("no history_edit in {seen:?}"));
    assert_eq!(
        (
            edit.source.as_str(),
            edit.request_id.as_deref(),
            edit.action.as_str(),
            edit.edit_distance,
            edit.session_id.as_str()
        ),
        ("implicit", Some(p1.as_str()), "edited", Some(12), "sess_i3")
    );
    let session = agents
        .list_signals(admin(pb::ListSignalsRequest {
            session_id: "sess_i2".to_owned(),
            source: Some("explicit".to_owned()),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(session.signals.len(), 1);
    assert_eq!(session.signals[0].action, "accepted");
    let neither = agents
        .list_signals(admin(pb::ListSignalsRequest::default()))
        .await
        .err()
        .map(|s| s.code());
    assert_eq!(neither, Some(tonic::Code::InvalidArgument));

    // The CLI: `agents show` prints the sources, the evidence and the agreement table;
    // `signals list` the stored signals; `agents set` the settings.
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
    let mut out = Vec::new();
    cli::agents(
        &settings,
        AgentsCommand::Show {
            agent: Some("imp".to_owned()),
            unattributed: false,
            filter: FilterArgs::default(),
            json: false,
        },
        &mut out,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let text = String::from_utf8_lossy(&out).into_owned();
    for want in [
        "implicit  reask",
        "evidence: explicit + implicit",
        "agreement (units with both kinds",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }
    let mut out = Vec::new();
    cli::signals(
        &settings,
        SignalsCommand::List {
            agent: None,
            session: Some("sess_i3".to_owned()),
            source: None,
            limit: 10,
            json: true,
        },
        &mut out,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let listed: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(listed[0]["rule"], "history_edit", "{listed}");
    assert_eq!(listed[0]["edit_distance"], 12, "{listed}");
    let mut out = Vec::new();
    cli::agents(
        &settings,
        AgentsCommand::Set {
            agent: "imp".to_owned(),
            evidence: "explicit".to_owned(),
            continued_counts: false,
            json: true,
        },
        &mut out,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let set: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(set["evidence"], "explicit", "{set}");
    assert_eq!(by_model(&gw, "imp").await, [(Some("m-b".to_owned()), 1, 1)]);

    if let Some(stop) = stop {
        let _ = stop.send(true);
    }
    drop(link);
    gw.stop().await;
}

#[tokio::test]
async fn implicit_signals_serve_sqlite() {
    implicit_signals(Db::Sqlite, Shape::Serve).await;
}

#[tokio::test]
async fn implicit_signals_split_postgres() {
    implicit_signals(Db::Postgres, Shape::Split).await;
}
