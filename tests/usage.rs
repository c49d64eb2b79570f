//! Usage metering end to end: the dataplane reads tokens from the answers as they stream by,
//! prices them, and the controlplane stores and aggregates them. Unknown stays unknown.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use nm_gateway::grpc::pb::{self, usage_client::UsageClient};
use sea_orm::{ConnectionTrait, QueryResult, Statement};

use crate::common::gateway::{ADMIN_KEY, Db, TestGateway, admin};
use crate::common::mock::MockProvider;
use crate::common::{cut_every, eventually, fixture, sse_events};

/// The stored usage of one request.
#[derive(Debug, PartialEq, Eq)]
struct Stored {
    answered_model: Option<String>,
    input: Option<i64>,
    output: Option<i64>,
    cost: Option<i64>,
    status: String,
    finish: Option<String>,
}

async fn stored(gw: &TestGateway, request_id: &str) -> Stored {
    let db = gw.database().await;
    let backend = db.get_database_backend();
    let sql = format!(
        "SELECT answered_model, input_tokens, output_tokens, cost_micros, usage_status, finish_reason \
         FROM requests WHERE request_id = '{request_id}'"
    );
    let row: QueryResult = eventually(Duration::from_secs(10), "record stored", || async {
        db.query_one_raw(Statement::from_string(backend, sql.clone()))
            .await
            .ok()
            .flatten()
    })
    .await;
    let get_s = |c: &str| row.try_get::<Option<String>>("", c).unwrap_or(None);
    let get_i = |c: &str| row.try_get::<Option<i64>>("", c).unwrap_or(None);
    let s = Stored {
        answered_model: get_s("answered_model"),
        input: get_i("input_tokens"),
        output: get_i("output_tokens"),
        cost: get_i("cost_micros"),
        status: row.try_get("", "usage_status").unwrap_or_default(),
        finish: get_s("finish_reason"),
    };
    let _ = db.close().await;
    s
}

/// Sends `body` to `path` and returns the request id once the answer was read whole.
async fn call(gw: &TestGateway, path: &str, body: &str) -> String {
    let a = gw
        .post(path, &[("nm-agent", "metered")], body.to_owned())
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    a.header("nm-request-id").unwrap_or_default().to_owned()
}

async fn every_provider_is_metered(db: Db) {
    // Streams cut every 7 bytes: SSE events and multi-byte characters split across frames.
    let openai = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let openai_sse = MockProvider::sse(cut_every(&fixture("openai/chat_stream.sse"), 7))
        .start()
        .await;
    let anthropic = MockProvider::sse(cut_every(&fixture("anthropic/messages_stream.sse"), 7))
        .start()
        .await;
    let gemini = MockProvider::sse(sse_events(&fixture("gemini/stream.sse")))
        .start()
        .await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &openai.url)
        .upstream("groq", &openai_sse.url)
        .upstream("anthropic", &anthropic.url)
        .upstream("gemini", &gemini.url)
        .start()
        .await
    else {
        return;
    };

    // gpt-4o-mini: $0.15 in, $0.60 out per million. 19 x 0.15 + 6 x 0.60 = 6.45 -> 6 µ$.
    let id = call(
        &gw,
        "/openai/v1/chat/completions",
        r#"{"model":"gpt-4o-mini"}"#,
    )
    .await;
    let s = stored(&gw, &id).await;
    assert_eq!(
        s,
        Stored {
            answered_model: Some("gpt-4o-mini-2024-07-18".into()),
            input: Some(19),
            output: Some(6),
            cost: Some(6),
            status: "reported".into(),
            finish: Some("stop".into()),
        }
    );

    // An OpenAI-compatible stream with `include_usage`, through groq: no groq price for
    // gpt-4o-mini, so the tokens are known and the cost is not (unknown, not zero).
    let id = call(
        &gw,
        "/groq/openai/v1/chat/completions",
        r#"{"model":"gpt-4o-mini","stream":true}"#,
    )
    .await;
    let s = stored(&gw, &id).await;
    assert_eq!((s.input, s.output, s.cost), (Some(19), Some(3), None));
    assert_eq!(s.status, "reported");

    // Anthropic: input from message_start, output from the last (cumulative) message_delta.
    // claude-sonnet-4-5: 14 x $3 + 9 x $15 per million = 177 µ$.
    let id = call(
        &gw,
        "/anthropic/v1/messages",
        r#"{"model":"claude-sonnet-4-5","max_tokens":100,"stream":true}"#,
    )
    .await;
    let s = stored(&gw, &id).await;
    assert_eq!((s.input, s.output, s.cost), (Some(14), Some(9), Some(177)));
    assert_eq!(
        s.answered_model.as_deref(),
        Some("claude-sonnet-4-5-20250929")
    );
    assert_eq!(s.finish.as_deref(), Some("end_turn"));

    // Gemini repeats usageMetadata; the last one counts. gemini-2.0-flash: 9 x 0.10 + 8 x 0.40.
    let id = call(
        &gw,
        "/gemini/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
        "{}",
    )
    .await;
    let s = stored(&gw, &id).await;
    assert_eq!((s.input, s.output, s.cost), (Some(9), Some(8), Some(4)));
    gw.stop().await;
}

#[tokio::test]
async fn every_provider_is_metered_sqlite() {
    every_provider_is_metered(Db::Sqlite).await;
}

#[tokio::test]
async fn every_provider_is_metered_postgres() {
    every_provider_is_metered(Db::Postgres).await;
}

/// Gemini without `alt=sse` streams a JSON array of responses; frames cut anywhere.
#[tokio::test]
async fn a_gemini_json_array_stream_is_metered() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("dataplane/src/usage/fixtures/gemini_array.json");
    let array = Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{e}")));
    let mock = MockProvider::sse(cut_every(&array, 13))
        .header("content-type", "application/json; charset=UTF-8")
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("gemini", &mock.url)
        .run()
        .await;
    let id = call(
        &gw,
        "/gemini/v1beta/models/gemini-2.5-pro:streamGenerateContent",
        "{}",
    )
    .await;
    let s = stored(&gw, &id).await;
    assert_eq!((s.input, s.output), (Some(902), Some(61 + 187)));
    assert_eq!(s.answered_model.as_deref(), Some("gemini-2.5-pro"));
    assert_eq!(s.finish.as_deref(), Some("MAX_TOKENS"));
    assert!(s.cost.is_some_and(|c| c > 0));
    gw.stop().await;
}

#[tokio::test]
async fn a_stream_without_usage_is_recorded_as_unknown() {
    let sse = fixture("openai/chat_stream.sse");
    let without_usage: Vec<Bytes> = sse_events(&sse)
        .into_iter()
        .filter(|e| !e.windows(7).any(|w| w == b"\"usage\""))
        .collect();
    let mock = MockProvider::sse(without_usage).start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let id = call(
        &gw,
        "/openai/v1/chat/completions",
        r#"{"model":"gpt-4o-mini","stream":true}"#,
    )
    .await;
    let s = stored(&gw, &id).await;
    assert_eq!((s.input, s.output, s.cost), (None, None, None));
    assert_eq!(s.status, "missing");
    assert_eq!(s.finish.as_deref(), Some("stop"));
    gw.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_keeps_the_usage_seen_so_far() {
    let chunks = sse_events(&fixture("anthropic/messages_stream.sse"));
    let mock = MockProvider::sse(chunks).hold_last().start().await;
    let gw = TestGateway::builder()
        .upstream("anthropic", &mock.url)
        .run()
        .await;
    let resp = gw
        .send(
            "POST",
            "/anthropic/v1/messages",
            &[("nm-key", ADMIN_KEY)],
            r#"{"model":"claude-sonnet-4-5","max_tokens":100,"stream":true}"#,
        )
        .await;
    let id = resp
        .headers()
        .get("nm-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut body = resp.into_body();
    // Read until message_start went by, then leave.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("message_start") {
        match body.frame().await {
            Some(Ok(f)) => seen.extend_from_slice(f.data_ref().map_or(&[][..], |d| d)),
            _ => panic!("stream ended early"),
        }
    }
    drop(body);
    let s = stored(&gw, &id).await;
    assert_eq!(s.status, "partial");
    assert_eq!(s.input, Some(14));
    mock.release();
    gw.stop().await;
}

#[tokio::test]
async fn usage_is_aggregated_by_the_database_sqlite() {
    usage_is_aggregated_by_the_database(Db::Sqlite).await;
}

#[tokio::test]
async fn usage_is_aggregated_by_the_database_postgres() {
    usage_is_aggregated_by_the_database(Db::Postgres).await;
}

async fn usage_is_aggregated_by_the_database(db: Db) {
    let priced = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let unpriced = MockProvider::json(
        r#"{"model":"house-model-7b","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":5}}"#,
    )
    .start()
    .await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &priced.url)
        .upstream("together", &unpriced.url)
        .start()
        .await
    else {
        return;
    };
    for _ in 0..3 {
        call(
            &gw,
            "/openai/v1/chat/completions",
            r#"{"model":"gpt-4o-mini"}"#,
        )
        .await;
    }
    let last = call(
        &gw,
        "/together/v1/chat/completions",
        r#"{"model":"house-model-7b"}"#,
    )
    .await;
    stored(&gw, &last).await;

    let mut client = UsageClient::new(gw.grpc_channel().await);
    let report = eventually(Duration::from_secs(10), "4 requests in the report", || {
        let mut client = client.clone();
        async move {
            let r = client
                .get_usage(admin(pb::GetUsageRequest {
                    group_by: vec![
                        pb::UsageDimension::Provider.into(),
                        pb::UsageDimension::Model.into(),
                    ],
                    ..Default::default()
                }))
                .await
                .ok()?
                .into_inner();
            (r.total.as_ref()?.requests == 4).then_some(r)
        }
    })
    .await;
    let total = report.total.clone().unwrap_or_default();
    assert_eq!(total.input_tokens, 3 * 19 + 5);
    assert_eq!(total.cost_micros, 3 * 6);
    assert_eq!(total.unpriced_requests, 1);
    let first = &report.rows[0];
    let key: Vec<_> = first.key.iter().map(|k| k.value.clone()).collect();
    assert_eq!(
        key,
        [
            Some("openai".to_owned()),
            Some("gpt-4o-mini-2024-07-18".to_owned())
        ]
    );
    assert_eq!(first.requests, 3);
    assert_eq!(report.unpriced_models.len(), 1);
    assert_eq!(report.unpriced_models[0].model, "house-model-7b");

    // Grouped by day with a limit of one row: the total still covers everything.
    let by_day = client
        .get_usage(admin(pb::GetUsageRequest {
            group_by: vec![
                pb::UsageDimension::Day.into(),
                pb::UsageDimension::Agent.into(),
            ],
            range: Some(pb::TimeRange {
                since: Some(prost_types::Timestamp {
                    seconds: 0,
                    nanos: 0,
                }),
                until: None,
            }),
            limit: 1,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(by_day.rows.len(), 1);
    assert_eq!(by_day.total.unwrap_or_default().requests, 4);
    assert!(
        by_day.rows[0].key[0]
            .value
            .as_deref()
            .is_some_and(|d| d.len() == 10)
    );

    // Admin only.
    let denied = client
        .get_usage(tonic::Request::new(pb::GetUsageRequest::default()))
        .await;
    assert_eq!(
        denied.map(|_| ()).map_err(|s| s.code()),
        Err(tonic::Code::Unauthenticated)
    );
    gw.stop().await;
}
