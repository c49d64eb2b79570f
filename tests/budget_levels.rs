//! Budgets at every level (issue 34.3): a key, a key label, an agent, a model, an env, an end
//! user, and the defaults for keys and end users; dollars and tokens per period, requests and
//! tokens per minute. Each refusal names its budget; every level goes through the same leases,
//! so the bound across dataplanes holds for a non-user level too.

use std::net::SocketAddr;
use std::time::Duration;

use nm_gateway::grpc::pb::{self, budgets_client::BudgetsClient, keys_client::KeysClient};
use tokio::task::JoinSet;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, Shape, TestGateway, admin, with_key};
use crate::common::http::{Answer, client, read, request, send};
use crate::common::mock::MockProvider;

/// gpt-4o: 2 prompt + 600 completion tokens = 6,005 µ$ and 602 tokens a request.
const ANSWER: &str = r#"{"id":"chatcmpl-l","object":"chat.completion","created":1,"model":"gpt-4o-2024-08-06",
"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],
"usage":{"prompt_tokens":2,"completion_tokens":600,"total_tokens":602}}"#;
const COST: u64 = 6_005;
const REQUEST: &str =
    r#"{"model":"gpt-4o","max_tokens":600,"messages":[{"role":"user","content":"hi"}]}"#;

fn reservation() -> u64 {
    6_000 + (REQUEST.len() as u64).div_ceil(4) * 3
}

fn budget(scope: &str, value: &str) -> pb::SetBudgetRequest {
    pb::SetBudgetRequest {
        scope: scope.to_owned(),
        scope_value: value.to_owned(),
        period: pb::BudgetPeriod::Day.into(),
        ..Default::default()
    }
}

async fn set(gw: &TestGateway, req: pb::SetBudgetRequest) {
    BudgetsClient::new(gw.grpc_channel().await)
        .set_budget(admin(req))
        .await
        .unwrap_or_else(|e| panic!("set budget: {e}"));
}

async fn show(gw: &TestGateway, scope: &str, value: &str) -> pb::BudgetStatus {
    BudgetsClient::new(gw.grpc_channel().await)
        .get_budget(admin(pb::GetBudgetRequest {
            scope: scope.to_owned(),
            scope_value: value.to_owned(),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("get budget: {e}"))
        .into_inner()
}

/// Waits until the dataplane at `http` enforces `rules` budget rules.
async fn pushed(gw: &TestGateway, http: SocketAddr, rules: usize) {
    let want = format!("nm_budget_rules {rules}");
    eventually(Duration::from_secs(10), "budget rules pushed", || async {
        let m = gw.raw_at(http, "GET", "/metrics", &[], "").await;
        String::from_utf8_lossy(&m.body)
            .contains(&want)
            .then_some(())
    })
    .await;
}

async fn chat(at: SocketAddr, key: &str, headers: &[(&str, &str)], body: &'static str) -> Answer {
    let url = format!("http://{at}/openai/v1/chat/completions");
    let mut h = vec![("nm-key", key)];
    h.extend_from_slice(headers);
    read(send(&client(), request("POST", &url, &h, body)).await).await
}

fn message(a: &Answer) -> String {
    a.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// Makes sure at least 20 s are left in the current UTC minute, so that a burst stays in one:
/// when fewer are, waits for the next minute to begin (computed, not polled).
async fn early_in_a_minute() {
    let into_minute = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(Duration::ZERO, |d| {
            Duration::from_millis(u64::try_from(d.as_millis() % 60_000).unwrap_or(0))
        });
    if into_minute > Duration::from_secs(40) {
        tokio::time::sleep(Duration::from_secs(60).saturating_sub(into_minute)).await;
    }
}

/// A service key, usable once the dataplane has it.
async fn service_key(gw: &TestGateway, name: &str, labels: &[(&str, &str)]) -> (String, String) {
    let r = KeysClient::new(gw.grpc_channel().await)
        .create_key(admin(pb::CreateKeyRequest {
            name: name.into(),
            role: pb::KeyRole::Service as i32,
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("create key: {e}"))
        .into_inner();
    let id = r.key.unwrap_or_default().id;
    let secret = r.secret;
    eventually(Duration::from_secs(15), "key known", || async {
        // Auth comes before the route: a known key gets 404 for no such provider.
        let a = gw
            .raw_at(
                gw.http,
                "GET",
                "/no-such-provider/v1/models",
                &[("nm-key", &secret)],
                "",
            )
            .await;
        (a.status != 401).then_some(())
    })
    .await;
    (id, secret)
}

/// A key, headers, a body, and the refusal's words.
type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'static str, &'a str);

/// Each level refuses with its name: one request per minute on an agent, a model, an env, a
/// key, a label, an end user, then the default for keys; the second request of each is
/// refused `rate_limited`, naming the budget, with `Retry-After`.
async fn each_level_refuses_with_its_name(db: Db) {
    let mock = MockProvider::json(ANSWER).start().await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        eprintln!("skipped: NM_TEST_POSTGRES_URL is not set");
        return;
    };
    let (key_id, key) = service_key(&gw, "levels-key", &[]).await;
    let (_, team_key) = service_key(&gw, "levels-team", &[("team", "search")]).await;
    let rpm1 = |scope: &str, value: &str| pb::SetBudgetRequest {
        requests_per_minute: Some(1),
        ..budget(scope, value)
    };
    set(&gw, rpm1("agent", "ag-levels")).await;
    set(&gw, rpm1("model", "gpt-4o-mini")).await;
    set(&gw, rpm1("env", "staging")).await;
    set(&gw, rpm1("key", &key_id)).await;
    set(&gw, rpm1("label", "team=search")).await;
    set(&gw, rpm1("user", "levels-user")).await;
    pushed(&gw, gw.http, 6).await;
    early_in_a_minute().await;

    let mini = r#"{"model":"gpt-4o-mini","max_tokens":10,"messages":[]}"#;
    let key_says = format!("the key {key_id} budget allows 1 requests per minute");
    let cases: [Case<'_>; 6] = [
        (
            ADMIN_KEY,
            &[("nm-agent", "ag-levels")],
            REQUEST,
            "the agent ag-levels budget allows 1 requests per minute",
        ),
        (
            ADMIN_KEY,
            &[],
            mini,
            "the model gpt-4o-mini budget allows 1 requests per minute",
        ),
        (
            ADMIN_KEY,
            &[("nm-env", "staging")],
            REQUEST,
            "the env staging budget allows 1 requests per minute",
        ),
        (&key, &[], REQUEST, &key_says),
        (
            &team_key,
            &[],
            REQUEST,
            "the label team=search budget allows 1 requests per minute",
        ),
        (
            ADMIN_KEY,
            &[("nm-user", "levels-user")],
            REQUEST,
            "this end user may start 1 requests per minute",
        ),
    ];
    for (k, headers, body, want) in cases {
        let first = chat(gw.http, k, headers, body).await;
        assert_eq!(first.status, 200, "{want}: {}", message(&first));
        let second = chat(gw.http, k, headers, body).await;
        assert_eq!(second.status, 429, "{want}");
        assert_eq!(second.header("nm-error"), Some("rate_limited"));
        assert!(second.header("retry-after").is_some());
        assert!(message(&second).contains(want), "{}", message(&second));
    }

    // The default for keys: every key without its own, each on its own count. The key with its
    // own budget keeps it (already used this minute: still its own name).
    set(&gw, rpm1("default-key", "")).await;
    pushed(&gw, gw.http, 7).await;
    let (other_id, other) = service_key(&gw, "levels-other", &[]).await;
    assert_eq!(chat(gw.http, &other, &[], REQUEST).await.status, 200);
    let again = chat(gw.http, &other, &[], REQUEST).await;
    assert_eq!(again.status, 429);
    assert!(
        message(&again).contains(&format!("the default key budget (key {other_id})")),
        "{}",
        message(&again)
    );
    let own = chat(gw.http, &key, &[], REQUEST).await;
    assert!(
        message(&own).contains(&format!("the key {key_id} budget")),
        "{}",
        message(&own)
    );

    // show: limit, spent, remaining, period end per limit.
    let s = show(&gw, "agent", "ag-levels").await;
    let rpm = s
        .limits
        .iter()
        .find(|l| l.limit == "rpm")
        .unwrap_or_else(|| panic!("{s:?}"));
    assert_eq!(rpm.value, 1);
    assert!(rpm.period_end.is_some());
    gw.stop().await;
}

#[tokio::test]
async fn each_level_refuses_with_its_name_sqlite() {
    each_level_refuses_with_its_name(Db::Sqlite).await;
}

#[tokio::test]
async fn each_level_refuses_with_its_name_postgres() {
    each_level_refuses_with_its_name(Db::Postgres).await;
}

/// Tokens per day settle from the metered usage; tokens per minute reserve from `max_tokens`.
#[tokio::test]
async fn tokens_per_period_and_per_minute() {
    let mock = MockProvider::json(ANSWER)
        .delay(Duration::from_millis(300))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    set(
        &gw,
        pb::SetBudgetRequest {
            limit_tokens: Some(1_000),
            period: pb::BudgetPeriod::Week.into(),
            ..budget("agent", "tok-week")
        },
    )
    .await;
    set(
        &gw,
        pb::SetBudgetRequest {
            tokens_per_minute: Some(2_000),
            ..budget("agent", "tok-minute")
        },
    )
    .await;
    pushed(&gw, gw.http, 2).await;
    early_in_a_minute().await;

    // 602 tokens a request: the first two pass (the second from 602 < 1000), the third is over.
    let week = [("nm-agent", "tok-week")];
    assert_eq!(chat(gw.http, ADMIN_KEY, &week, REQUEST).await.status, 200);
    assert_eq!(chat(gw.http, ADMIN_KEY, &week, REQUEST).await.status, 200);
    let third = chat(gw.http, ADMIN_KEY, &week, REQUEST).await;
    assert_eq!(third.status, 429);
    assert_eq!(third.header("nm-error"), Some("budget_exceeded"));
    assert!(
        message(&third).contains("the agent tok-week budget of 1000 tokens per week"),
        "{}",
        message(&third)
    );
    let s = eventually(Duration::from_secs(10), "tokens recorded", || async {
        let s = show(&gw, "agent", "tok-week").await;
        let l = s
            .limits
            .iter()
            .find(|l| l.limit == "tokens_per_week")?
            .clone();
        (l.spent == 1_204).then_some(l)
    })
    .await;
    assert_eq!(s.remaining, 0);

    // Ten at once against 2,000 tokens a minute, each reserving its 600 max_tokens plus the
    // prompt (about 620): at most four are admitted before any answer settles.
    let mut requests = JoinSet::new();
    for _ in 0..10 {
        let at = gw.http;
        requests.spawn(
            async move { chat(at, ADMIN_KEY, &[("nm-agent", "tok-minute")], REQUEST).await },
        );
    }
    let answers = requests.join_all().await;
    let ok = answers.iter().filter(|a| a.status == 200).count();
    assert!((1..=4).contains(&ok), "{ok} admitted");
    for a in answers.iter().filter(|a| a.status != 200) {
        assert_eq!(a.header("nm-error"), Some("rate_limited"));
        assert!(
            message(a).contains("2000 tokens per minute"),
            "{}",
            message(a)
        );
    }
    gw.stop().await;
}

/// The bound for a non-user level: 40 concurrent clients over two dataplanes, one agent with
/// $0.05 a day, spend at most the limit plus one reservation per dataplane.
async fn an_agent_budget_holds_over_dataplanes(n: usize, db: Db) {
    let mock = MockProvider::json(ANSWER)
        .delay(Duration::from_millis(300))
        .start()
        .await;
    let Some(mut gw) = TestGateway::builder()
        .db(db)
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        eprintln!("skipped: NM_TEST_POSTGRES_URL is not set");
        return;
    };
    let mut planes = vec![gw.http];
    for _ in 1..n {
        planes.push(gw.add_dataplane().await);
    }
    let limit = 50_000;
    set(
        &gw,
        pb::SetBudgetRequest {
            limit_micros: Some(limit),
            ..budget("agent", "bound-agent")
        },
    )
    .await;
    for p in &planes {
        pushed(&gw, *p, 1).await;
    }
    let mut requests = JoinSet::new();
    for i in 0..40 {
        let at = planes[i % planes.len()];
        requests.spawn(async move {
            chat(at, ADMIN_KEY, &[("nm-agent", "bound-agent")], REQUEST).await
        });
    }
    let answers = requests.join_all().await;
    let ok = answers.iter().filter(|a| a.status == 200).count() as u64;
    let refused: Vec<_> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(ok + refused.len() as u64, 40, "only 200s and 429s");
    assert!(ok >= 2, "{ok} admitted");
    for r in &refused {
        assert_eq!(r.header("nm-error"), Some("budget_exceeded"));
        assert!(r.header("retry-after").is_some());
        assert!(
            message(r).contains("the agent bound-agent budget of $0.05 per day"),
            "{}",
            message(r)
        );
    }
    let spent = eventually(Duration::from_secs(15), "spend recorded", || async {
        let s = show(&gw, "agent", "bound-agent").await;
        (s.day_micros == ok * COST).then_some(s.day_micros)
    })
    .await;
    let bound = limit + n as u64 * reservation();
    eprintln!("agent budget, {n} dataplanes: {ok} answers, {spent} µ$ spent, bound {bound}");
    assert!(
        spent <= bound,
        "{spent} µ$ over {n} dataplanes: more than {bound}"
    );
    gw.stop().await;
}

#[tokio::test]
async fn an_agent_budget_holds_over_two_dataplanes() {
    an_agent_budget_holds_over_dataplanes(2, Db::Sqlite).await;
}

#[tokio::test]
async fn an_agent_budget_holds_over_three_dataplanes_on_postgres() {
    an_agent_budget_holds_over_dataplanes(3, Db::Postgres).await;
}

/// A viewer reads budgets but cannot set or delete one, at any level.
#[tokio::test]
async fn a_viewer_cannot_set_or_delete_budgets() {
    let gw = TestGateway::builder().run().await;
    let r = KeysClient::new(gw.grpc_channel().await)
        .create_key(admin(pb::CreateKeyRequest {
            name: "viewer".into(),
            role: pb::KeyRole::Viewer as i32,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("create key: {e}"))
        .into_inner();
    let viewer = r.secret;
    let mut budgets = BudgetsClient::new(gw.grpc_channel().await);
    for (scope, value) in [("agent", "a"), ("default-key", ""), ("label", "team=x")] {
        let set = budgets
            .set_budget(with_key(
                &viewer,
                pb::SetBudgetRequest {
                    requests_per_minute: Some(5),
                    ..budget(scope, value)
                },
            ))
            .await;
        assert_eq!(
            set.map(|_| ()).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        let delete = budgets
            .delete_budget(with_key(
                &viewer,
                pb::DeleteBudgetRequest {
                    scope: scope.to_owned(),
                    scope_value: value.to_owned(),
                    ..Default::default()
                },
            ))
            .await;
        assert_eq!(
            delete.map(|_| ()).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
    }
    assert!(
        budgets
            .list_budgets(with_key(&viewer, pb::ListBudgetsRequest {}))
            .await
            .is_ok()
    );
    gw.stop().await;
}
