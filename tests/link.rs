//! The link between the halves: authenticated (link secret, TLS, mTLS), validated, bounded, and
//! honest before the first key snapshot. Plus one proxy / signal / budget flow run the same way
//! in `serve`, split and split over mutual TLS.

use std::time::Duration;

use nm_gateway::grpc::link_pb::{self, link_client::LinkClient};
use nm_gateway::grpc::pb::usage_client::UsageClient;
use nm_gateway::grpc::pb::{self, agents_client::AgentsClient, budgets_client::BudgetsClient};
use tokio_stream::StreamExt;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, LINK_SECRET, Shape, TestGateway, admin};
use crate::common::mock::MockProvider;
use crate::common::pki::Pki;

/// An OpenAI answer on gpt-4o: 1000 in + 500 out = 7,500 µ$.
const ANSWER: &str = r#"{"id":"chatcmpl-l","object":"chat.completion","created":1,"model":"gpt-4o-2024-08-06",
"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],
"usage":{"prompt_tokens":1000,"completion_tokens":500,"total_tokens":1500}}"#;
const REQUEST: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;

/// Adds `nm-link-secret` when it has one.
#[derive(Clone)]
struct Presents(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Presents {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(s) = &self.0 {
            req.metadata_mut().insert("nm-link-secret", s.clone());
        }
        Ok(req)
    }
}

type Client = LinkClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Presents>,
>;

/// A link client presenting `secret` (or nothing) on `channel`.
fn link_client(channel: tonic::transport::Channel, secret: Option<&str>) -> Client {
    let secret = secret.map(|s| s.parse().unwrap_or_else(|e| panic!("{e}")));
    LinkClient::with_interceptor(channel, Presents(secret))
}

fn forged_record(id: &str, cost_micros: u64) -> link_pb::RequestRecord {
    link_pb::RequestRecord {
        request_id: id.to_owned(),
        started_at: Some(prost_types::Timestamp {
            seconds: 1_764_000_000,
            nanos: 0,
        }),
        key_id: "key_forged".to_owned(),
        provider: "openai".to_owned(),
        method: "POST".to_owned(),
        path: "/v1/chat/completions".to_owned(),
        user_id: Some("victim".to_owned()),
        session_id: Some("sess_forged".to_owned()),
        agent: Some("intruder".to_owned()),
        status: 200,
        cost_micros: Some(cost_micros),
        budget_micros: Some(cost_micros),
        ..Default::default()
    }
}

/// Calls every link RPC with `secret` and returns each call's status code.
async fn every_link_call(
    channel: tonic::transport::Channel,
    secret: Option<&str>,
) -> Vec<(&'static str, tonic::Code)> {
    let mut c = link_client(channel, secret);
    let code = |r: Result<tonic::Code, tonic::Status>| r.unwrap_or_else(|s| s.code());
    let keys = c
        .watch_keys(link_pb::WatchKeysRequest::default())
        .await
        .map(|_| tonic::Code::Ok);
    let budgets = c
        .watch_budgets(link_pb::WatchBudgetsRequest::default())
        .await
        .map(|_| tonic::Code::Ok);
    let ingest = c
        .ingest_requests(link_pb::IngestRequestsRequest {
            records: vec![forged_record("forged-1", 50_000_000)],
        })
        .await
        .map(|_| tonic::Code::Ok);
    let signal = c
        .record_signal(link_pb::RecordSignalRequest {
            signal: Some(link_pb::Signal {
                session_id: "sess_forged".to_owned(),
                action: "thumbs_down".to_owned(),
                key_id: "key_forged".to_owned(),
                request_id: "forged-signal".to_owned(),
                idempotency_key: Some("client-key-1".to_owned()),
                ..Default::default()
            }),
            commit_within_ms: 0,
        })
        .await
        .map(|_| tonic::Code::Ok);
    vec![
        ("WatchKeys", code(keys)),
        ("WatchBudgets", code(budgets)),
        ("IngestRequests", code(ingest)),
        ("RecordSignal", code(signal)),
    ]
}

/// The id of the gateway's one key (the bootstrap admin key).
async fn admin_key_id(gw: &TestGateway) -> String {
    let mut keys = nm_gateway::grpc::pb::keys_client::KeysClient::new(gw.grpc_channel().await);
    let listed = keys
        .list_keys(admin(pb::ListKeysRequest::default()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    listed.keys[0].id.clone()
}

/// The number of stored request records.
async fn stored_requests(usage: &UsageClient<tonic::transport::Channel>) -> Option<u64> {
    let r = usage
        .clone()
        .get_usage(admin(pb::GetUsageRequest::default()))
        .await
        .ok()?
        .into_inner();
    Some(r.total?.requests)
}

/// Nothing an outsider sent was stored: no request, no signal, no spend.
async fn nothing_stored(gw: &TestGateway) {
    let mut usage = UsageClient::new(gw.grpc_channel().await);
    let report = usage
        .get_usage(admin(pb::GetUsageRequest::default()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(report.total.map(|t| t.requests), Some(0));
    let mut agents = AgentsClient::new(gw.grpc_channel().await);
    let listed = agents
        .list_agents(admin(pb::ListAgentsRequest::default()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert!(listed.agents.is_empty(), "{listed:?}");
    let mut budgets = BudgetsClient::new(gw.grpc_channel().await);
    let spent = budgets
        .get_budget(admin(pb::GetBudgetRequest {
            user_id: "victim".to_owned(),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(spent.day_micros, 0);
}

/// Without the secret, or with another, every link call is UNAUTHENTICATED and nothing is
/// stored: over plaintext, and over TLS (server-authenticated only, so the outsider gets as far
/// as the secret check).
#[tokio::test]
async fn an_outsider_gets_unauthenticated_on_every_link_call() {
    for tls in [false, true] {
        let mut b = TestGateway::builder().shape(if tls { Shape::SplitTls } else { Shape::Split });
        if tls {
            // TLS without client certificates: the secret is the only credential.
            b = b.env("NM_GRPC_TLS_CLIENT_CA", "");
        }
        let gw = b.run().await;
        for secret in [None, Some("lnk_a_wrong_secret_of_enough_length_0123456789")] {
            for (rpc, code) in every_link_call(gw.grpc_channel().await, secret).await {
                assert_eq!(
                    code,
                    tonic::Code::Unauthenticated,
                    "tls {tls}, {secret:?}: {rpc}"
                );
            }
        }
        nothing_stored(&gw).await;
        // The gateway's own dataplane, which has the secret, is served.
        assert_eq!(gw.get("/health").await.status, 200);
        gw.stop().await;
    }
}

/// With mTLS, a client without a certificate from the CA cannot even open a connection; one
/// with a certificate from another CA neither.
#[tokio::test]
async fn mtls_refuses_clients_without_a_trusted_certificate() {
    let gw = TestGateway::builder().shape(Shape::SplitTls).run().await;
    let dir = tempfile::tempdir().unwrap();
    let stranger = Pki::create_named(dir.path(), "stranger");
    let ca_pem = gw
        .dataplane_settings()
        .controlplane_tls
        .ca_pem
        .clone()
        .unwrap_or_else(|| panic!("TLS shape has a CA"));
    let without_cert = nm_gateway::config::ClientTls {
        ca_pem: Some(ca_pem.clone()),
        identity: None,
    };
    let foreign_cert = nm_gateway::config::ClientTls {
        ca_pem: Some(ca_pem),
        identity: Some((
            std::fs::read(&stranger.client_cert).unwrap(),
            std::fs::read(&stranger.client_key).unwrap(),
        )),
    };
    for (who, tls) in [
        ("no certificate", without_cert),
        ("foreign certificate", foreign_cert),
    ] {
        let channel = nm_gateway::grpc::channel(&gw.grpc_url(), &tls).unwrap();
        for (rpc, code) in every_link_call(channel, Some(LINK_SECRET)).await {
            assert_ne!(code, tonic::Code::Ok, "{who}: {rpc} succeeded");
        }
        // The admin API is behind the same handshake.
        let channel = nm_gateway::grpc::channel(&gw.grpc_url(), &tls).unwrap();
        let listed = UsageClient::new(channel)
            .get_usage(admin(pb::GetUsageRequest::default()))
            .await;
        assert!(
            listed.is_err(),
            "{who}: admin call over mTLS without a trusted certificate"
        );
    }
    nothing_stored(&gw).await;
    gw.stop().await;
}

/// The key stream carries verifiers, not key hashes: nothing in it equals the SHA-256 of the
/// admin key, and a verifier made without the link secret matches nothing.
#[tokio::test]
async fn the_key_stream_reveals_nothing_to_test_guesses_against() {
    let gw = TestGateway::builder().shape(Shape::Split).run().await;
    let mut c = link_client(gw.grpc_channel().await, Some(LINK_SECRET));
    let mut stream = c
        .watch_keys(link_pb::WatchKeysRequest {
            dataplane: "test".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    let snapshot = stream.next().await.unwrap().unwrap();
    assert_eq!(snapshot.keys.len(), 1);
    let entry = &snapshot.keys[0];
    assert_ne!(entry.verifier, nm_types::hash_key(ADMIN_KEY).to_vec());
    let with_secret = nm_types::VerifierKey::from_link_secret(LINK_SECRET);
    assert_eq!(entry.verifier, with_secret.of_secret(ADMIN_KEY).to_vec());
    let guessed = nm_types::VerifierKey::from_link_secret("");
    assert_ne!(entry.verifier, guessed.of_secret(ADMIN_KEY).to_vec());
    gw.stop().await;
}

/// A dataplane with a wrong secret gets no keys: `/health` says why, and requests are answered
/// 503 (try again), never 401 (SDKs give up on a 401).
#[tokio::test]
async fn a_dataplane_with_a_wrong_secret_gets_no_keys_and_says_why() {
    let mut gw = TestGateway::builder().shape(Shape::Split).run().await;
    let mut settings = gw.dataplane_settings().clone();
    settings.link_secret = Some(nm_gateway::config::Secret::new(
        "lnk_not_the_controlplanes_secret_0123456789abcdef",
    ));
    settings.http_addr = "127.0.0.1:0".parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    settings.spool_dir = dir.path().to_owned();
    let dp = nm_gateway::app::start_dataplane(&settings).await.unwrap();
    let http = dp.http_addr.unwrap();
    let health = eventually(
        Duration::from_secs(10),
        "health names the secret",
        || async {
            let a = gw.raw_at(http, "GET", "/health", &[], "").await;
            (a.status == 503 && a.json()["reason"].as_str()?.contains("link secret")).then_some(a)
        },
    )
    .await;
    assert_eq!(health.json()["status"], "unavailable");
    let a = gw
        .raw_at(
            http,
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", ADMIN_KEY)],
            REQUEST,
        )
        .await;
    assert_eq!(a.status, 503);
    assert_eq!(a.header("nm-error"), Some("unavailable"));
    assert!(a.header("retry-after").is_some());
    dp.stop().await.unwrap();
    gw.stop_controlplane().await;
    gw.restart_controlplane().await;
    gw.stop().await;
}

/// A dataplane that starts while its controlplane is down answers 503 `unavailable` with
/// `Retry-After` (proxy and signal), never `invalid_api_key`, and serves once it is back.
#[tokio::test]
async fn a_dataplane_started_before_its_controlplane_answers_503_then_serves() {
    let mock = MockProvider::json(ANSWER).start().await;
    let mut gw = TestGateway::builder()
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .run()
        .await;
    gw.stop_controlplane().await;
    gw.restart_dataplane().await;
    for _ in 0..20 {
        let a = gw.post("/openai/v1/chat/completions", &[], REQUEST).await;
        assert_eq!(a.status, 503, "{:?}", a.body);
        assert_eq!(a.header("nm-error"), Some("unavailable"));
        assert_eq!(a.header("retry-after"), Some("1"));
        let s = gw
            .post(
                "/v1/signal",
                &[("content-type", "application/json")],
                r#"{"session_id": "sess_early", "action": "accepted"}"#,
            )
            .await;
        assert_eq!(s.status, 503);
        assert_eq!(s.json()["error"]["code"], "unavailable");
    }
    // A request without a key is still told so.
    let a = gw
        .raw("POST", "/openai/v1/chat/completions", &[], REQUEST)
        .await;
    assert_eq!(a.status, 401);
    gw.restart_controlplane().await;
    gw.wait_healthy().await;
    let a = gw.post("/openai/v1/chat/completions", &[], REQUEST).await;
    assert_eq!(a.status, 200);
    gw.stop().await;
}

/// A dataplane holding the secret is still checked: out-of-range values and unknown keys are
/// refused one by one (named by index), the rest stored, and the usage reports keep working.
#[tokio::test]
async fn forged_values_from_a_linked_dataplane_are_refused_and_later_records_land() {
    let mock = MockProvider::json(ANSWER).start().await;
    let gw = TestGateway::builder()
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .run()
        .await;
    // The admin key's id: a live key.
    let key_id = admin_key_id(&gw).await;
    let live = |id: &str, cost: u64| link_pb::RequestRecord {
        key_id: key_id.clone(),
        ..forged_record(id, cost)
    };
    let mut c = link_client(gw.grpc_channel().await, Some(LINK_SECRET));
    let resp = c
        .ingest_requests(link_pb::IngestRequestsRequest {
            records: vec![
                live("ok-1", 1_000),
                live("huge-cost", u64::MAX),
                forged_record("unknown-key", 1_000),
                link_pb::RequestRecord {
                    path: "/x".repeat(5_000),
                    ..live("long-path", 1)
                },
                link_pb::RequestRecord {
                    status: 70_000,
                    ..live("bad-status", 1)
                },
                live("ok-2", 2_000),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.stored, 2);
    let rejected: Vec<u32> = resp.rejected.iter().map(|r| r.index).collect();
    assert_eq!(rejected, vec![1, 2, 3, 4], "{:?}", resp.rejected);
    assert!(resp.rejected[1].reason.contains("key_id"));
    // The reports work, and hold only what was valid.
    let mut usage = UsageClient::new(gw.grpc_channel().await);
    let report = usage
        .get_usage(admin(pb::GetUsageRequest::default()))
        .await
        .unwrap()
        .into_inner();
    let total = report.total.unwrap();
    assert_eq!((total.requests, total.cost_micros), (2, 3_000));
    // A real request afterwards is recorded as usual.
    assert_eq!(
        gw.post("/openai/v1/chat/completions", &[], REQUEST)
            .await
            .status,
        200
    );
    eventually(
        Duration::from_secs(10),
        "the proxied request's record",
        || async { (stored_requests(&usage).await? == 3).then_some(()) },
    )
    .await;
    gw.stop().await;
}

/// Requests with 60,000-byte paths (which any service key can send) used to make a batch too
/// large for a gRPC message and stop all recording: now their paths are shortened, batches cut
/// by size, and every record lands.
#[tokio::test]
async fn long_paths_do_not_stop_recording() {
    let mock = MockProvider::json(ANSWER).start().await;
    let gw = TestGateway::builder()
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .run()
        .await;
    let long = format!("/openai/v1/{}", "p".repeat(60_000));
    let mut sent = 0u64;
    for _ in 0..300 {
        let a = gw.post(&long, &[], REQUEST).await;
        assert_eq!(a.status, 200);
        sent += 1;
    }
    for _ in 0..100 {
        assert_eq!(
            gw.post("/openai/v1/chat/completions", &[], REQUEST)
                .await
                .status,
            200
        );
        sent += 1;
    }
    let usage = UsageClient::new(gw.grpc_channel().await);
    eventually(Duration::from_secs(20), "every record stored", || async {
        (stored_requests(&usage).await? == sent).then_some(())
    })
    .await;
    let metrics = gw.get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("nm_records_dead_lettered_total 0"), "{text}");
    gw.stop().await;
}

/// A batch in the spool that the controlplane refuses in part (here: a record with an
/// impossible cost, as an older or broken dataplane might have written) is dead-lettered and
/// counted; it does not block the records behind it.
#[tokio::test]
async fn a_poison_batch_is_dead_lettered_and_counted() {
    use prost::Message;
    let mock = MockProvider::json(ANSWER).start().await;
    let mut gw = TestGateway::builder()
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .run()
        .await;
    let spool_dir = gw.dataplane_settings().spool_dir.clone();
    let key_id = admin_key_id(&gw).await;
    // With the controlplane away and the dataplane stopped, put a poison batch at the head of
    // the spool; then start both again.
    gw.stop_controlplane().await;
    let poison = link_pb::IngestRequestsRequest {
        records: vec![
            link_pb::RequestRecord {
                key_id: key_id.clone(),
                ..forged_record("poison-1", u64::MAX)
            },
            link_pb::RequestRecord {
                key_id,
                ..forged_record("fine-1", 10)
            },
        ],
    };
    gw.stop_dataplane().await;
    {
        let mut spool = nm_dataplane::spool::Spool::open(&spool_dir, 64 << 20).unwrap();
        spool.append(&poison.encode_to_vec(), 2).unwrap();
    }
    gw.start_dataplane().await;
    gw.restart_controlplane().await;
    gw.wait_healthy().await;
    // Later traffic lands behind it.
    for _ in 0..5 {
        assert_eq!(
            gw.post("/openai/v1/chat/completions", &[], REQUEST)
                .await
                .status,
            200
        );
    }
    let usage = UsageClient::new(gw.grpc_channel().await);
    eventually(
        Duration::from_secs(20),
        "records behind the poison stored",
        || async { (stored_requests(&usage).await? == 6).then_some(()) },
    )
    .await;
    let metrics = gw.get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("nm_records_dead_lettered_total 1"), "{text}");
    let dead = std::fs::read_to_string(spool_dir.join("dead-letter.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = dead
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["record"]["request_id"], "poison-1");
    assert!(lines[0]["reason"].as_str().unwrap().contains("cost_micros"));
    gw.stop().await;
}

/// One proxy, signal and budget flow, the same in `serve`, split and split over mutual TLS.
#[tokio::test]
async fn serve_split_and_split_over_tls_run_the_same_flow() {
    for shape in [Shape::Serve, Shape::Split, Shape::SplitTls] {
        let mock = MockProvider::json(ANSWER).start().await;
        let gw = TestGateway::builder()
            .shape(shape)
            .upstream("openai", &mock.url)
            .run()
            .await;
        // Proxy, with attribution.
        let headers = [
            ("nm-agent", "flow-bot"),
            ("nm-session", "sess_flow"),
            ("nm-user", "frank"),
        ];
        let a = gw
            .post("/openai/v1/chat/completions", &headers, REQUEST)
            .await;
        assert_eq!(a.status, 200, "{shape:?}");
        assert_eq!(&a.body[..], ANSWER.as_bytes(), "{shape:?}");
        // A signal, counted for the session's agent.
        let s = gw
            .post(
                "/v1/signal",
                &[("content-type", "application/json")],
                r#"{"session_id": "sess_flow", "action": "accepted"}"#,
            )
            .await;
        assert_eq!(s.status, 200, "{shape:?}: {:?}", s.body);
        let agents = AgentsClient::new(gw.grpc_channel().await);
        eventually(
            Duration::from_secs(10),
            "the signal counted for flow-bot",
            || async {
                let c = agents
                    .clone()
                    .get_agent_signals(admin(pb::GetAgentSignalsRequest {
                        agent: "flow-bot".to_owned(),
                        ..Default::default()
                    }))
                    .await
                    .ok()?
                    .into_inner();
                (c.total == 1).then_some(())
            },
        )
        .await;
        // A budget below one answer's cost: once the spend is stored, frank is refused.
        let mut budgets = BudgetsClient::new(gw.grpc_channel().await);
        budgets
            .set_budget(admin(pb::SetBudgetRequest {
                user_id: Some("frank".to_owned()),
                limit_micros: Some(5_000),
                period: pb::BudgetPeriod::Day.into(),
                requests_per_minute: None,
                ..Default::default()
            }))
            .await
            .unwrap();
        eventually(Duration::from_secs(10), "frank refused", || async {
            let a = gw
                .post("/openai/v1/chat/completions", &headers, REQUEST)
                .await;
            (a.status == 429).then_some(())
        })
        .await;
        gw.stop().await;
    }
}
