//! Experiments through real processes: the lifecycle over gRPC and the CLI (create, list, show,
//! pause, resume, rollback, promote, stop, history), every bad input refused with its rule, one
//! winner of concurrent creates, viewer keys reading but not changing, the audit trail, the per-arm
//! counts from stored records, and the live set reaching the key stream dataplanes follow.

use std::time::Duration;

use nm_gateway::grpc::link_pb::{self, link_client::LinkClient};
use nm_gateway::grpc::pb::{
    self, audit_client::AuditClient, experiments_client::ExperimentsClient, keys_client::KeysClient,
};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;

use crate::common::gateway::{ADMIN_KEY, Db, LINK_SECRET, Shape, TestGateway, with_key};

fn ok<T>(r: Result<tonic::Response<T>, tonic::Status>) -> T {
    r.unwrap_or_else(|e| panic!("{e}")).into_inner()
}

/// A refusal's code and message.
fn refused<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> (Code, String) {
    match r {
        Ok(v) => panic!("expected a refusal, got {v:?}"),
        Err(s) => (s.code(), s.message().to_owned()),
    }
}

fn arm(name: &str, provider: &str, model: &str, weight: u32) -> pb::ExperimentArmSpec {
    pb::ExperimentArmSpec {
        name: name.into(),
        provider: provider.into(),
        model: model.into(),
        weight,
    }
}

fn create_req(agent: &str, env: Option<&str>) -> pb::CreateExperimentRequest {
    pb::CreateExperimentRequest {
        agent: agent.into(),
        env: env.map(str::to_owned),
        arms: vec![
            arm("control", "openai", "gpt-4o-mini", 50),
            arm("candidate", "groq", "llama-3.3-70b-versatile", 50),
        ],
        guardrails: vec!["abandonment".into(), "p95_latency".into()],
        max_sessions: 5000,
        description: "cheaper model for support".into(),
        ..Default::default()
    }
}

/// A gateway whose groq has an operator credential (openai, mistral and the others have none).
async fn gateway(db: Db, shape: Shape) -> Option<TestGateway> {
    TestGateway::builder()
        .db(db)
        .shape(shape)
        .env("NM_PROVIDER_KEY_GROQ", "gsk_operator_test_credential")
        .start()
        .await
}

/// Adds `nm-link-secret`.
#[derive(Clone)]
struct LinkSecret(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for LinkSecret {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("nm-link-secret", self.0.clone());
        Ok(req)
    }
}

type Link = LinkClient<tonic::service::interceptor::InterceptedService<Channel, LinkSecret>>;

fn link(channel: Channel) -> Link {
    let secret = LINK_SECRET.parse().unwrap_or_else(|e| panic!("{e}"));
    LinkClient::with_interceptor(channel, LinkSecret(secret))
}

/// The key stream a dataplane follows: reads snapshots until one's experiments satisfy
/// `want` (a change is sent at once; heartbeats every 2 s), for at most 10 s.
struct KeyStream(tonic::Streaming<link_pb::KeySnapshot>);

impl KeyStream {
    async fn open(channel: Channel) -> Self {
        let stream = ok(link(channel)
            .watch_keys(link_pb::WatchKeysRequest {
                dataplane: "experiments-test".into(),
            })
            .await);
        Self(stream)
    }

    async fn until(
        &mut self,
        what: &str,
        want: impl Fn(&[link_pb::LiveExperiment]) -> bool,
    ) -> Vec<link_pb::LiveExperiment> {
        let read = async {
            loop {
                let snapshot = match self.0.next().await {
                    Some(Ok(s)) => s,
                    other => panic!("key stream ended: {other:?}"),
                };
                if want(&snapshot.experiments) {
                    return snapshot.experiments;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .unwrap_or_else(|_| panic!("the key stream never showed {what}"))
    }
}

fn arm_names(live: &link_pb::LiveExperiment) -> Vec<&str> {
    live.arms.iter().map(|a| a.name.as_str()).collect()
}

/// A record a dataplane would send for a request an arm served.
fn record(
    id: &str,
    key_id: &str,
    session: &str,
    experiment: &str,
    arm: &str,
    cost_micros: u64,
) -> link_pb::RequestRecord {
    link_pb::RequestRecord {
        request_id: id.into(),
        started_at: Some(nm_gateway::grpc::convert::ms_to_timestamp(
            chrono::Utc::now().timestamp_millis(),
        )),
        key_id: key_id.into(),
        provider: "groq".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        model: Some("llama-3.3-70b-versatile".into()),
        agent: Some("support-bot".into()),
        session_id: Some(session.into()),
        status: 200,
        cost_micros: Some(cost_micros),
        experiment_id: Some(experiment.into()),
        arm: Some(arm.into()),
        requested_model: Some("gpt-4o-mini".into()),
        ..Default::default()
    }
}

async fn run_cli(url: &str, key: &str, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_nm-gateway"))
        .args(args)
        .env("NM_CONTROLPLANE_URL", url)
        .env("NM_ADMIN_KEY", key)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn cli_json(url: &str, args: &[&str]) -> serde_json::Value {
    let out = run_cli(url, ADMIN_KEY, args).await;
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
}

async fn lifecycle(db: Db, shape: Shape) {
    let Some(gw) = gateway(db, shape).await else {
        return;
    };
    let channel = gw.grpc_channel().await;
    let mut x = ExperimentsClient::new(channel.clone());
    let mut keys = KeysClient::new(channel.clone());
    let admin_id = ok(keys
        .list_keys(with_key(ADMIN_KEY, pb::ListKeysRequest::default()))
        .await)
    .keys
    .into_iter()
    .find(|k| k.name == "bootstrap")
    .map(|k| k.id)
    .unwrap_or_default();
    let viewer = ok(keys
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: "watcher".into(),
                role: pb::KeyRole::Viewer as i32,
                ..Default::default()
            },
        ))
        .await)
    .secret;
    let mut stream = KeyStream::open(channel.clone()).await;
    stream.until("no experiment", <[_]>::is_empty).await;

    // Created: running, and on the key stream with its arms and a 16-byte salt.
    let e = ok(x
        .create_experiment(with_key(ADMIN_KEY, create_req("support-bot", None)))
        .await);
    let id = e.id.clone();
    assert!(
        id.len() == 16
            && id.starts_with("exp_")
            && id[4..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{id}"
    );
    assert_eq!(e.state, "running");
    assert_eq!(e.env, None);
    assert_eq!(e.unit, "session");
    assert_eq!(e.guardrails, ["abandonment", "p95_latency"]);
    assert_eq!(e.max_sessions, 5000);
    let live = stream
        .until("the new experiment", |l| l.iter().any(|e| e.id == id))
        .await;
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].agent, "support-bot");
    assert_eq!(live[0].env, None);
    assert_eq!(live[0].salt.len(), 16);
    assert_eq!(arm_names(&live[0]), ["control", "candidate"]);
    assert_eq!(
        (
            live[0].arms[1].provider.as_str(),
            live[0].arms[1].model.as_str(),
            live[0].arms[1].weight
        ),
        ("groq", "llama-3.3-70b-versatile", 50)
    );

    // Every bad input, refused with its rule.
    let bad: Vec<(pb::CreateExperimentRequest, Code, &str)> = vec![
        (
            pb::CreateExperimentRequest {
                arms: vec![
                    arm("control", "openai", "gpt-4o-mini", 1),
                    arm("other", "nowhere", "m", 1),
                ],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "arm other: unknown provider \"nowhere\"",
        ),
        (
            pb::CreateExperimentRequest {
                arms: vec![
                    arm("control", "openai", "gpt-4o-mini", 1),
                    arm("claude", "anthropic", "claude-sonnet-4", 1),
                ],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "speaks the anthropic wire format",
        ),
        (
            pb::CreateExperimentRequest {
                arms: vec![
                    arm("control", "openai", "gpt-4o-mini", 1),
                    arm("m", "mistral", "mistral-large-latest", 1),
                ],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "provider mistral has no operator credential (NM_PROVIDER_KEY_MISTRAL)",
        ),
        (
            pb::CreateExperimentRequest {
                arms: vec![
                    arm("control", "openai", "gpt-4o-mini", 0),
                    arm("b", "openai", "gpt-4o", 1),
                ],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "weights must be whole numbers from 1 to 1000000",
        ),
        (
            pb::CreateExperimentRequest {
                arms: vec![arm("control", "openai", "gpt-4o-mini", 1)],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "an experiment needs 2 to 16 arms",
        ),
        (
            pb::CreateExperimentRequest {
                arms: (0..17)
                    .map(|i| arm(&format!("a{i}"), "openai", "gpt-4o", 1))
                    .collect(),
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "an experiment needs 2 to 16 arms",
        ),
        (
            pb::CreateExperimentRequest {
                arms: vec![
                    arm("control arm", "openai", "gpt-4o-mini", 1),
                    arm("b", "openai", "gpt-4o", 1),
                ],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "arm names must be",
        ),
        (
            pb::CreateExperimentRequest {
                guardrails: vec!["vibes".into()],
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "guardrails: \"vibes\" is not one of",
        ),
        (
            pb::CreateExperimentRequest {
                unit: "user".into(),
                ..create_req("bad-bot", None)
            },
            Code::InvalidArgument,
            "unit: \"user\" is not session or request",
        ),
        (
            create_req("bad-bot", Some("prod")),
            Code::InvalidArgument,
            "env:",
        ),
        (create_req("", None), Code::InvalidArgument, "agent must be"),
        // The agent has a running experiment on every env: any env of it conflicts.
        (
            create_req("support-bot", Some("production")),
            Code::FailedPrecondition,
            "agent support-bot already has experiment",
        ),
    ];
    for (req, code, rule) in bad {
        let (got, message) = refused(x.create_experiment(with_key(ADMIN_KEY, req)).await);
        assert_eq!(got, code, "{message}");
        assert!(message.contains(rule), "{message:?} should say {rule:?}");
    }

    // A viewer reads; only an admin changes.
    let listed = ok(x
        .list_experiments(with_key(&viewer, pb::ListExperimentsRequest::default()))
        .await);
    assert_eq!(listed.experiments.len(), 1, "refused creates store nothing");
    ok(x.get_experiment(with_key(
        &viewer,
        pb::GetExperimentRequest { id: id.clone() },
    ))
    .await);
    ok(x.list_experiment_events(with_key(
        &viewer,
        pb::ListExperimentEventsRequest { id: id.clone() },
    ))
    .await);
    let action = |key: &str, reason: &str| {
        with_key(
            key,
            pb::ExperimentActionRequest {
                id: id.clone(),
                reason: reason.into(),
            },
        )
    };
    assert_eq!(
        refused(x.pause_experiment(action(&viewer, "")).await).0,
        Code::PermissionDenied
    );
    assert_eq!(
        refused(
            x.create_experiment(with_key(&viewer, create_req("v-bot", None)))
                .await
        )
        .0,
        Code::PermissionDenied
    );
    assert_eq!(
        refused(
            x.pause_experiment(action(
                "nmk_not_a_key_at_all_0000000000000000000000000000",
                ""
            ))
            .await
        )
        .0,
        Code::Unauthenticated
    );

    // Records an arm served are stored with their variant and counted per arm.
    let ingest = ok(link(channel.clone())
        .ingest_requests(link_pb::IngestRequestsRequest {
            records: vec![
                record("exp-r1", &admin_id, "sess_a1", &id, "control", 100),
                record("exp-r2", &admin_id, "sess_a1", &id, "control", 200),
                record("exp-r3", &admin_id, "sess_b1", &id, "candidate", 50),
            ],
        })
        .await);
    assert_eq!(
        (ingest.stored, ingest.rejected.len()),
        (3, 0),
        "{:?}",
        ingest.rejected
    );
    assert_eq!(
        gw.count(&format!(
            "SELECT COUNT(*) AS n FROM requests WHERE experiment_id = '{id}' AND arm = 'control' \
             AND requested_model = 'gpt-4o-mini'"
        ))
        .await,
        2
    );
    let report = ok(x
        .get_experiment(with_key(
            ADMIN_KEY,
            pb::GetExperimentRequest { id: id.clone() },
        ))
        .await);
    let counts: Vec<(String, u64, u64, u64)> = report
        .arms
        .iter()
        .map(|a| {
            (
                a.arm.as_ref().map(|x| x.name.clone()).unwrap_or_default(),
                a.sessions,
                a.requests,
                a.cost_micros,
            )
        })
        .collect();
    assert_eq!(
        counts,
        [
            ("control".to_owned(), 1, 2, 300),
            ("candidate".to_owned(), 1, 1, 50)
        ]
    );

    // Pause: off the key stream; resume only from paused.
    let paused = ok(x
        .pause_experiment(action(ADMIN_KEY, "checking the prompts"))
        .await);
    assert_eq!(
        (paused.state.as_str(), paused.reason.as_str()),
        ("paused", "checking the prompts")
    );
    stream
        .until("the paused experiment gone", <[_]>::is_empty)
        .await;
    let (code, message) = refused(x.pause_experiment(action(ADMIN_KEY, "")).await);
    assert_eq!(code, Code::FailedPrecondition);
    assert!(
        message.contains("only a running experiment can be paused"),
        "{message}"
    );
    ok(x.resume_experiment(action(ADMIN_KEY, "")).await);
    let (code, message) = refused(x.resume_experiment(action(ADMIN_KEY, "")).await);
    assert_eq!(code, Code::FailedPrecondition);
    assert!(
        message.contains("only a paused experiment can be resumed"),
        "{message}"
    );
    stream
        .until("the resumed experiment", |l| l.iter().any(|e| e.id == id))
        .await;

    // Promotion without a decided winner needs an arm.
    let (code, message) = refused(
        x.promote_experiment(with_key(
            ADMIN_KEY,
            pb::PromoteExperimentRequest {
                id: id.clone(),
                ..Default::default()
            },
        ))
        .await,
    );
    assert_eq!(code, Code::FailedPrecondition);
    assert!(message.contains("no decided winner"), "{message}");

    // Rollback: the arm leaves the key stream; the last active arm stays.
    let rb = |arm: &str| {
        with_key(
            ADMIN_KEY,
            pb::RollbackArmRequest {
                id: id.clone(),
                arm: arm.into(),
                reason: String::new(),
            },
        )
    };
    let rolled = ok(x.rollback_arm(rb("candidate")).await);
    assert!(
        rolled
            .arms
            .iter()
            .any(|a| a.name == "candidate" && a.rolled_back)
    );
    stream
        .until("the control arm alone", |l| {
            l.iter().any(|e| e.id == id && arm_names(e) == ["control"])
        })
        .await;
    let (code, message) = refused(x.rollback_arm(rb("control")).await);
    assert_eq!(code, Code::FailedPrecondition);
    assert!(message.contains("last active arm"), "{message}");
    let (code, message) = refused(x.rollback_arm(rb("nope")).await);
    assert_eq!(code, Code::InvalidArgument);
    assert!(message.contains("no arm named \"nope\""), "{message}");

    // Promote: decided, promoted, the winner alone on the key stream.
    let promoted = ok(x
        .promote_experiment(with_key(
            ADMIN_KEY,
            pb::PromoteExperimentRequest {
                id: id.clone(),
                arm: "control".into(),
                reason: "control is good enough".into(),
            },
        ))
        .await);
    assert_eq!(
        (
            promoted.state.as_str(),
            promoted.winner.as_deref(),
            promoted.promoted
        ),
        ("decided", Some("control"), true)
    );
    // A promoted experiment still holds its agent.
    let (code, _) = refused(
        x.create_experiment(with_key(ADMIN_KEY, create_req("support-bot", None)))
            .await,
    );
    assert_eq!(code, Code::FailedPrecondition);

    // Stop: off the key stream, for good.
    let stopped = ok(x.stop_experiment(action(ADMIN_KEY, "shipped")).await);
    assert_eq!(stopped.state, "stopped");
    stream
        .until("no experiment after the stop", <[_]>::is_empty)
        .await;
    let (code, message) = refused(x.resume_experiment(action(ADMIN_KEY, "")).await);
    assert_eq!(code, Code::FailedPrecondition);
    assert!(message.contains("stopped"), "{message}");
    assert_eq!(
        refused(
            x.get_experiment(with_key(
                ADMIN_KEY,
                pb::GetExperimentRequest {
                    id: "exp_000000000000".into()
                }
            ))
            .await
        )
        .0,
        Code::NotFound
    );

    // The history, oldest first, by whom.
    let events = ok(x
        .list_experiment_events(with_key(
            ADMIN_KEY,
            pb::ListExperimentEventsRequest { id: id.clone() },
        ))
        .await)
    .events;
    let kinds: Vec<(&str, Option<&str>, &str)> = events
        .iter()
        .map(|e| (e.kind.as_str(), e.arm.as_deref(), e.actor.as_str()))
        .collect();
    let me = admin_id.as_str();
    assert_eq!(
        kinds,
        [
            ("created", None, me),
            ("paused", None, me),
            ("resumed", None, me),
            ("rolled_back", Some("candidate"), me),
            ("promoted", Some("control"), me),
            ("stopped", None, me),
        ]
    );
    assert_eq!(events[1].detail, "checking the prompts");

    // The audit trail: one row per change, without the salt.
    let trail = ok(AuditClient::new(channel.clone())
        .list_audit_events(with_key(
            ADMIN_KEY,
            pb::ListAuditEventsRequest {
                page_size: 1000,
                ..Default::default()
            },
        ))
        .await)
    .events;
    let actions: Vec<&str> = trail
        .iter()
        .filter(|e| e.target == id)
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(
        actions,
        [
            "experiment.create",
            "experiment.pause",
            "experiment.resume",
            "experiment.rollback",
            "experiment.promote",
            "experiment.stop"
        ]
    );
    let salt: String = live[0].salt.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        trail
            .iter()
            .all(|e| !e.after_json.contains(&salt) && !e.before_json.contains(&salt)),
        "the salt never reaches the audit trail"
    );
    gw.stop().await;
}

#[tokio::test]
async fn lifecycle_over_grpc_sqlite_serve() {
    lifecycle(Db::Sqlite, Shape::Serve).await;
}

#[tokio::test]
async fn lifecycle_over_grpc_postgres_split() {
    lifecycle(Db::Postgres, Shape::Split).await;
}

/// Concurrent creates on one agent (some on one env, some on every env): exactly one wins, the
/// others are told which experiment holds the agent.
async fn one_of_concurrent_creates_wins(db: Db) {
    let Some(gw) = gateway(db, Shape::Split).await else {
        return;
    };
    let channel = gw.grpc_channel().await;
    // Even ones on every env, odd ones on production: each pair conflicts.
    let attempts: Vec<_> = (0..8)
        .map(|i| {
            let mut x = ExperimentsClient::new(channel.clone());
            let env = (i % 2 == 1).then_some("production");
            let req = create_req("race-bot", env);
            tokio::spawn(async move { x.create_experiment(with_key(ADMIN_KEY, req)).await })
        })
        .collect();
    let mut results = Vec::new();
    for a in attempts {
        results.push(a.await.unwrap_or_else(|e| panic!("{e}")));
    }
    let won: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().map(|e| e.get_ref().id.clone()))
        .collect();
    assert_eq!(won.len(), 1, "{results:?}");
    for r in &results {
        if let Err(s) = r {
            assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
            assert!(s.message().contains(&won[0]), "{}", s.message());
        }
    }
    assert_eq!(
        gw.count("SELECT COUNT(*) AS n FROM experiments WHERE agent = 'race-bot'")
            .await,
        1
    );
    // Different envs of one agent are independent.
    let mut x = ExperimentsClient::new(channel.clone());
    let winner_env = ok(x
        .get_experiment(with_key(
            ADMIN_KEY,
            pb::GetExperimentRequest { id: won[0].clone() },
        ))
        .await)
    .experiment
    .and_then(|e| e.env);
    if winner_env.is_some() {
        ok(
            x.create_experiment(with_key(ADMIN_KEY, create_req("race-bot", Some("staging"))))
                .await,
        );
    }
    gw.stop().await;
}

#[tokio::test]
async fn one_of_concurrent_creates_wins_sqlite() {
    one_of_concurrent_creates_wins(Db::Sqlite).await;
}

#[tokio::test]
async fn one_of_concurrent_creates_wins_postgres() {
    one_of_concurrent_creates_wins(Db::Postgres).await;
}

/// The CLI, a real process: create, list, show, pause, resume, promote, stop, history; a bad arm
/// is a usage error (exit 64); a viewer key may read but not create.
#[tokio::test]
async fn the_cli_runs_an_experiment() {
    let Some(gw) = gateway(Db::Sqlite, Shape::Serve).await else {
        return;
    };
    let url = gw.grpc_url();
    let created = cli_json(
        &url,
        &[
            "experiments",
            "create",
            "--agent",
            "support-bot",
            "--env",
            "production",
            "--arm",
            "control=openai:gpt-4o-mini:50",
            "--arm",
            "candidate=groq:llama-3.3-70b-versatile:50",
            "--guardrail",
            "abandonment",
            "--max-days",
            "14",
            "--auto-promote",
            "--description",
            "cheaper model",
            "--json",
        ],
    )
    .await;
    let id = created["id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(created["state"], "running");
    assert_eq!(created["env"], "production");
    assert_eq!(created["max_days"], 14);
    assert_eq!(created["auto_promote"], true);
    assert_eq!(created["arms"][1]["provider"], "groq");
    let listed = cli_json(
        &url,
        &["experiments", "list", "--agent", "support-bot", "--json"],
    )
    .await;
    assert_eq!(listed[0]["id"], id.as_str());
    let shown = cli_json(&url, &["experiments", "show", &id, "--json"]).await;
    assert_eq!(shown["experiment"]["id"], id.as_str());
    assert_eq!(shown["arms"][0]["arm"], "control");
    assert_eq!(shown["arms"][0]["requests"], 0);
    cli_json(
        &url,
        &["experiments", "pause", &id, "--reason", "a look", "--json"],
    )
    .await;
    cli_json(&url, &["experiments", "resume", &id, "--json"]).await;
    let promoted = cli_json(
        &url,
        &[
            "experiments",
            "promote",
            &id,
            "--arm",
            "candidate",
            "--json",
        ],
    )
    .await;
    assert_eq!(
        (
            &promoted["state"],
            &promoted["winner"],
            &promoted["promoted"]
        ),
        (
            &serde_json::json!("decided"),
            &serde_json::json!("candidate"),
            &serde_json::json!(true)
        )
    );
    cli_json(&url, &["experiments", "stop", &id, "--json"]).await;
    let history = cli_json(&url, &["experiments", "history", &id, "--json"]).await;
    let kinds: Vec<&str> = history
        .as_array()
        .map(|a| a.iter().filter_map(|e| e["kind"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        kinds,
        ["created", "paused", "resumed", "promoted", "stopped"]
    );
    assert_eq!(history[1]["detail"], "a look");

    // Text output too.
    let out = run_cli(&url, ADMIN_KEY, &["experiments", "show", &id]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("state: stopped"), "{text}");
    assert!(text.contains("groq:llama-3.3-70b-versatile"), "{text}");

    // A malformed arm never reaches the controlplane.
    let bad = run_cli(
        &url,
        ADMIN_KEY,
        &[
            "experiments",
            "create",
            "--agent",
            "x",
            "--arm",
            "control=openai",
            "--arm",
            "b=openai:gpt-4o:1",
        ],
    )
    .await;
    assert_eq!(bad.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("NAME=PROVIDER:MODEL:WEIGHT"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    // A refusal of the controlplane reaches the operator in words.
    let refused = run_cli(
        &url,
        ADMIN_KEY,
        &[
            "experiments",
            "create",
            "--agent",
            "x",
            "--arm",
            "a=openai:gpt-4o:1",
            "--arm",
            "b=anthropic:claude-sonnet-4:1",
        ],
    )
    .await;
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("wire format"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    gw.stop().await;
}
