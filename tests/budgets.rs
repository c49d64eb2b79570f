//! Per-end-user budgets: enforced by the dataplane from memory before forwarding, with
//! reservations for requests in flight, shared by every dataplane of one controlplane.

use std::time::Duration;

use nm_gateway::grpc::pb::{self, budgets_client::BudgetsClient};
use tokio::task::JoinSet;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Shape, TestGateway, admin};
use crate::common::http::{client, read, send};
use crate::common::mock::MockProvider;

/// An OpenAI answer on gpt-4o ($2.50 in, $10 out per million): 1000 in + 500 out = 7,500 µ$.
const ANSWER: &str = r#"{"id":"chatcmpl-b","object":"chat.completion","created":1,"model":"gpt-4o-2024-08-06",
"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],
"usage":{"prompt_tokens":1000,"completion_tokens":500,"total_tokens":1500}}"#;
const COST: u64 = 7_500;
/// max_tokens 1000 reserves 1000 x $10/M = 10,000 µ$ of output, plus the prompt's estimate.
const REQUEST: &str =
    r#"{"model":"gpt-4o","max_tokens":1000,"messages":[{"role":"user","content":"hi"}]}"#;
const MAX_RESERVATION: u64 = 10_100;

async fn set_default(gw: &TestGateway, limit_micros: Option<u64>, rpm: Option<u32>) {
    let mut client = BudgetsClient::new(gw.grpc_channel().await);
    client
        .set_budget(admin(pb::SetBudgetRequest {
            user_id: None,
            limit_micros,
            period: pb::BudgetPeriod::Day.into(),
            requests_per_minute: rpm,
        }))
        .await
        .unwrap_or_else(|e| panic!("set budget: {e}"));
}

async fn spent_today(gw: &TestGateway, user: &str) -> u64 {
    let mut client = BudgetsClient::new(gw.grpc_channel().await);
    client
        .get_budget(admin(pb::GetBudgetRequest {
            user_id: user.to_owned(),
        }))
        .await
        .unwrap_or_else(|e| panic!("get budget: {e}"))
        .into_inner()
        .day_micros
}

/// Waits until the dataplane at `http` enforces `rules` budget rules (its `/metrics` says so
/// once the controlplane's push arrived).
async fn pushed(gw: &TestGateway, http: std::net::SocketAddr, rules: usize) {
    let want = format!("nm_budget_rules {rules}");
    eventually(Duration::from_secs(10), "budget rules pushed", || async {
        let m = gw.raw_at(http, "GET", "/metrics", &[], "").await;
        String::from_utf8_lossy(&m.body)
            .contains(&want)
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn fifty_concurrent_requests_cannot_overshoot_a_small_budget() {
    let mock = MockProvider::json(ANSWER)
        .delay(Duration::from_millis(400))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let limit = 100_000;
    set_default(&gw, Some(limit), None).await;
    pushed(&gw, gw.http, 1).await;

    let client = client();
    let mut requests = JoinSet::new();
    for _ in 0..50 {
        let req = gw.request(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", ADMIN_KEY), ("nm-user", "alice")],
            REQUEST,
        );
        let client = client.clone();
        requests.spawn(async move { read(send(&client, req).await).await });
    }
    let answers = requests.join_all().await;
    let ok = answers.iter().filter(|a| a.status == 200).count() as u64;
    let refused: Vec<_> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(ok + refused.len() as u64, 50, "only 200s and 429s");
    assert!(ok >= 1, "the first requests fit the budget");
    assert!(!refused.is_empty(), "50 x 7,500 µ$ cannot fit 100,000 µ$");
    // Admitted while spend + reservations < limit: at most one reservation over.
    assert!(
        ok * MAX_RESERVATION <= limit + MAX_RESERVATION,
        "{ok} admitted"
    );
    assert_eq!(
        mock.received().len() as u64,
        ok,
        "refused ones never reached the provider"
    );

    let r = refused[0];
    assert_eq!(r.header("nm-error"), Some("budget_exceeded"));
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After missing"));
    assert!(
        (1..=86_400).contains(&retry),
        "until the day resets: {retry}"
    );
    let body = r.json();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(body["error"]["code"], "budget_exceeded");

    // The spend the controlplane counts is exactly the answers' cost.
    let spent = eventually(Duration::from_secs(10), "spend recorded", || async {
        let s = spent_today(&gw, "alice").await;
        (s == ok * COST).then_some(s)
    })
    .await;
    assert!(spent <= limit + MAX_RESERVATION);
    // Another end user has their own budget.
    let b = gw
        .post(
            "/openai/v1/chat/completions",
            &[("nm-user", "bob")],
            REQUEST,
        )
        .await;
    assert_eq!(b.status, 200);
    gw.stop().await;
}

#[tokio::test]
async fn a_spent_budget_holds_on_every_provider_route() {
    let openai = MockProvider::json(ANSWER).start().await;
    let anthropic =
        MockProvider::json(r#"{"type":"message","usage":{"input_tokens":1,"output_tokens":1}}"#)
            .start()
            .await;
    let gemini = MockProvider::json(r#"{"candidates":[]}"#).start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &openai.url)
        .upstream("anthropic", &anthropic.url)
        .upstream("gemini", &gemini.url)
        .run()
        .await;
    // 1 µ$ a day: the first request is admitted (nothing spent yet), the rest are refused.
    set_default(&gw, Some(1), None).await;
    pushed(&gw, gw.http, 1).await;
    let first = gw
        .post(
            "/openai/v1/chat/completions",
            &[("nm-user", "carol")],
            REQUEST,
        )
        .await;
    assert_eq!(first.status, 200);

    let a = gw
        .post(
            "/anthropic/v1/messages",
            &[("nm-user", "carol")],
            r#"{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[]}"#,
        )
        .await;
    assert_eq!(a.status, 429);
    assert_eq!(a.json()["type"], "error");
    assert_eq!(a.json()["error"]["type"], "rate_limit_error");
    // Refused after its body was read: the connection stays open for the next request.
    assert_eq!(a.header("connection"), None);
    let g = gw
        .post(
            "/gemini/v1beta/models/gemini-2.5-flash:generateContent",
            &[("nm-user", "carol")],
            "{}",
        )
        .await;
    assert_eq!(g.status, 429);
    assert_eq!(g.json()["error"]["status"], "RESOURCE_EXHAUSTED");
    assert_eq!(g.header("nm-error"), Some("budget_exceeded"));
    assert!(anthropic.received().is_empty() && gemini.received().is_empty());
    // Requests without an end user are not budgeted.
    let anon = gw.post("/openai/v1/chat/completions", &[], REQUEST).await;
    assert_eq!(anon.status, 200);
    gw.stop().await;
}

#[tokio::test]
async fn requests_per_minute_are_limited() {
    let mock = MockProvider::json(ANSWER).start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    set_default(&gw, None, Some(3)).await;
    pushed(&gw, gw.http, 1).await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let a = gw
            .post(
                "/openai/v1/chat/completions",
                &[("nm-user", "dave")],
                REQUEST,
            )
            .await;
        statuses.push(a.status);
        if a.status == 429 {
            let retry: u64 = a
                .header("retry-after")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!((1..=60).contains(&retry), "{retry}");
        }
    }
    // Three fit, unless the minute turned over during the loop (then more may).
    assert_eq!(&statuses[..3], &[200, 200, 200]);
    assert!(statuses.contains(&429) || statuses.iter().all(|s| *s == 200));
    gw.stop().await;
}

/// Two dataplanes of one controlplane enforce one budget: once one dataplane's spend is stored,
/// the other refuses the same end user (it learns by the controlplane's push, not per request).
#[tokio::test]
async fn two_dataplanes_share_one_budget() {
    let mock = MockProvider::json(ANSWER).start().await;
    let mut gw = TestGateway::builder()
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .run()
        .await;
    let second = gw.add_dataplane().await;
    let limit = 50_000;
    set_default(&gw, Some(limit), None).await;
    pushed(&gw, gw.http, 1).await;
    pushed(&gw, second, 1).await;

    // Spend through the first dataplane until it refuses.
    let mut first_ok = 0u64;
    loop {
        let a = gw
            .post(
                "/openai/v1/chat/completions",
                &[("nm-user", "erin")],
                REQUEST,
            )
            .await;
        match a.status {
            200 => first_ok += 1,
            429 => break,
            s => panic!("status {s}"),
        }
        assert!(first_ok < 20, "the first dataplane never refused");
    }
    assert!(first_ok * COST >= limit && first_ok * COST <= limit + MAX_RESERVATION);
    eventually(Duration::from_secs(10), "spend stored", || async {
        (spent_today(&gw, "erin").await == first_ok * COST).then_some(())
    })
    .await;

    // The second dataplane has never seen erin, yet refuses: the feed told it. (Its very first
    // try may race the push by a moment; its own admitted request then counts locally.)
    let headers = [("nm-key", ADMIN_KEY), ("nm-user", "erin")];
    let mut second_ok = 0u64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let a = gw
            .raw_at(
                second,
                "POST",
                "/openai/v1/chat/completions",
                &headers,
                REQUEST,
            )
            .await;
        if a.status == 429 {
            break;
        }
        second_ok += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "second dataplane never refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(second_ok <= 1, "second dataplane admitted {second_ok}");
    gw.stop().await;
}
