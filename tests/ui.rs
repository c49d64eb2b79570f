//! The web page over plain HTTP (no browser): sign-in with admin and viewer keys, service and
//! wrong keys refused, missing, forged and ended sessions sent to the sign-in page, the security
//! headers, no state-changing route, hostile agent names, and the figures equal to the gRPC
//! answers, on the demo data (`nm-gateway demo`), on SQLite and PostgreSQL. The browser test is
//! `ui_browser.rs`; the listener's start-up rules are in `process.rs`.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use nm_gateway::grpc::pb::{
    self, agents_client::AgentsClient, analytics_client::AnalyticsClient,
    budgets_client::BudgetsClient, keys_client::KeysClient, usage_client::UsageClient,
};
use nm_gateway::ui::html::{count, pct, usd};
use tonic::transport::Channel;

use crate::common::gateway::{ADMIN_KEY, Db, TestGateway, with_key};
use crate::common::http::{Answer, client, read, request, send};

fn ok<T>(r: Result<tonic::Response<T>, tonic::Status>) -> T {
    r.unwrap_or_else(|e| panic!("{e}")).into_inner()
}

/// A gateway with the web page on a free port, over a database the demo filled.
pub async fn demo_gateway(db: Db) -> Option<TestGateway> {
    let url = match db {
        Db::Sqlite => None,
        Db::Postgres => Some(crate::common::gateway::fresh_postgres_db().await?),
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = url.unwrap_or_else(|| format!("sqlite://{}/demo.db?mode=rwc", dir.path().display()));
    let env: HashMap<String, String> = [
        ("NM_DATABASE_URL".to_owned(), url.clone()),
        ("NM_BOOTSTRAP_KEY".to_owned(), ADMIN_KEY.to_owned()),
    ]
    .into();
    let settings = nm_gateway::config::resolve(
        nm_gateway::config::Mode::Serve,
        &nm_gateway::config::Flags::default(),
        &env,
        nm_gateway::config::FileSettings::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut out = Vec::new();
    nm_gateway::demo::run(&settings, 42, &mut out)
        .await
        .unwrap_or_else(|e| panic!("demo: {e:#}"));
    let gw = TestGateway::builder()
        .env("NM_DATABASE_URL", &url)
        .env("NM_UI_ADDR", "127.0.0.1:0")
        .db(db)
        .start()
        .await?;
    // The temp dir lives as long as the test process (the gateway's file is in it).
    std::mem::forget(dir);
    Some(gw)
}

/// A small browser: one cookie, requests to the page.
pub struct Browser {
    base: String,
    origin: String,
    cookie: Option<String>,
    client: crate::common::http::TestClient,
}

impl Browser {
    pub fn new(gw: &TestGateway) -> Self {
        let ui = gw.ui.unwrap_or_else(|| panic!("no web page"));
        Self {
            base: format!("http://{ui}"),
            origin: format!("http://{ui}"),
            cookie: None,
            client: client(),
        }
    }

    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut h: Vec<(&str, &str)> = headers.to_vec();
        let cookie = self.cookie.as_ref().map(|c| format!("nm_ui_session={c}"));
        if let Some(c) = &cookie {
            h.push(("cookie", c));
        }
        read(
            send(
                &self.client,
                request(
                    method,
                    &format!("{}{path}", self.base),
                    &h,
                    Bytes::from(body.to_owned()),
                ),
            )
            .await,
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send("GET", path, &[], "").await
    }

    /// Posts a form from this page (its `Origin`).
    pub async fn post_form(&self, path: &str, body: &str) -> Answer {
        let origin = self.origin.clone();
        self.send(
            "POST",
            path,
            &[
                ("content-type", "application/x-www-form-urlencoded"),
                ("origin", &origin),
            ],
            body,
        )
        .await
    }

    /// Signs in with `key`: the answer, and the session kept on success.
    pub async fn sign_in(&mut self, key: &str) -> Answer {
        let body = format!("key={}", percent(key));
        let a = self.post_form("/sign-in", &body).await;
        if a.status == 303 {
            let set = a.header("set-cookie").unwrap_or_default().to_owned();
            self.cookie = set
                .split(';')
                .next()
                .and_then(|kv| kv.strip_prefix("nm_ui_session="))
                .map(str::to_owned);
        }
        a
    }
}

fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'_' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn text(a: &Answer) -> String {
    String::from_utf8_lossy(&a.body).into_owned()
}

async fn create_key(keys: &mut KeysClient<Channel>, role: pb::KeyRole) -> (String, String) {
    let r = ok(keys
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: format!("ui-{}", role.as_str_name()),
                role: role as i32,
                ..Default::default()
            },
        ))
        .await);
    (r.key.unwrap_or_default().id, r.secret)
}

/// The `<tr data-agent="NAME">` row of a page.
fn row<'a>(html: &'a str, agent: &str) -> &'a str {
    let start = html
        .find(&format!("<tr data-agent=\"{agent}\">"))
        .unwrap_or_else(|| panic!("no row for {agent}"));
    let rest = &html[start..];
    &rest[..rest.find("</tr>").unwrap_or(rest.len())]
}

async fn pages_equal_grpc_and_refuse_what_they_should(db: Db) {
    let Some(gw) = demo_gateway(db).await else {
        return;
    };
    let channel = gw.grpc_channel().await;
    let mut keys = KeysClient::new(channel.clone());
    let (viewer_id, viewer) = create_key(&mut keys, pb::KeyRole::Viewer).await;
    let (_, service) = create_key(&mut keys, pb::KeyRole::Service).await;
    let mut b = Browser::new(&gw);

    // No session: to the sign-in page; the sign-in page itself has the security headers.
    let a = b.get("/agents").await;
    assert_eq!(a.status, 303);
    assert_eq!(a.header("location"), Some("/sign-in"));
    let a = b.get("/sign-in").await;
    assert_eq!(a.status, 200);
    let csp = a.header("content-security-policy").unwrap_or_default();
    for part in [
        "default-src 'none'",
        "style-src 'self'",
        "img-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(part), "{csp}");
    }
    assert!(!csp.contains("script-src"), "no script at all: {csp}");
    assert_eq!(a.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(a.header("referrer-policy"), Some("same-origin"));
    assert!(!text(&a).contains("<script"));
    assert_eq!(b.get("/favicon.svg").await.status, 200);
    assert_eq!(b.get("/style.css").await.status, 200);

    // Refused: another origin, a wrong key, a service key, an empty or oversized form.
    let a = b
        .send(
            "POST",
            "/sign-in",
            &[
                ("content-type", "application/x-www-form-urlencoded"),
                ("origin", "http://evil.example"),
            ],
            &format!("key={ADMIN_KEY}"),
        )
        .await;
    assert_eq!(a.status, 403);
    let a = b
        .send(
            "POST",
            "/sign-in",
            &[("content-type", "application/x-www-form-urlencoded")],
            &format!("key={ADMIN_KEY}"),
        )
        .await;
    assert_eq!(a.status, 403, "no Origin: refused");
    let a = b
        .sign_in("nmk_0000000000000000000000000000000000000000000000ff")
        .await;
    assert_eq!(a.status, 401);
    assert!(text(&a).contains("unknown or revoked"), "{}", text(&a));
    let a = b.sign_in(&service).await;
    assert_eq!(a.status, 401);
    assert!(text(&a).contains("service key cannot sign in"));
    assert_eq!(b.post_form("/sign-in", "").await.status, 401);
    assert_eq!(
        b.post_form("/sign-in", &"k=v&".repeat(5000)).await.status,
        413
    );
    assert!(b.cookie.is_none());

    // A forged cookie: to the sign-in page, told the session ended.
    b.cookie = Some("ab".repeat(32));
    let a = b.get("/agents").await;
    assert_eq!(
        (a.status, a.header("location")),
        (303, Some("/sign-in?expired=1"))
    );

    // Viewer signs in: the cookie's attributes.
    let a = b.sign_in(&viewer).await;
    assert_eq!(a.status, 303, "{}", text(&a));
    let set = a.header("set-cookie").unwrap_or_default().to_owned();
    for attr in ["HttpOnly", "SameSite=Strict", "Max-Age=", "Path=/"] {
        assert!(set.contains(attr), "{set}");
    }
    assert!(!set.contains(&viewer), "the key never goes into the cookie");
    assert!(!set.contains("Secure"), "plain HTTP: no Secure");
    let a = b
        .send(
            "POST",
            "/sign-in",
            &[
                ("content-type", "application/x-www-form-urlencoded"),
                ("origin", &b.origin.clone()),
                ("x-forwarded-proto", "https"),
            ],
            &format!("key={}", percent(&viewer)),
        )
        .await;
    assert!(
        a.header("set-cookie")
            .unwrap_or_default()
            .contains("; Secure"),
        "behind TLS: Secure"
    );

    // Agents: each agent's figures equal the gRPC answers.
    let started = Instant::now();
    let a = b.get("/agents").await;
    let took = started.elapsed();
    assert_eq!(a.status, 200, "{}", text(&a));
    assert!(a.header("content-security-policy").is_some());
    let html = text(&a);
    assert!(html.contains(&format!("{viewer_id} (viewer)")));
    let mut agents = AgentsClient::new(channel.clone());
    let mut analytics = AnalyticsClient::new(channel.clone());
    let list = ok(agents
        .list_agents(with_key(&viewer, pb::ListAgentsRequest::default()))
        .await);
    let named: Vec<_> = list.agents.iter().filter(|a| !a.unattributed).collect();
    assert!(!named.is_empty(), "the demo has agents");
    for ag in &named {
        let r = row(&html, &ag.agent);
        assert!(
            r.contains(&format!("data-k=\"sessions\">{}<", count(ag.sessions))),
            "{r}"
        );
        assert!(
            r.contains(&format!("data-k=\"signals\">{}<", count(ag.signals))),
            "{r}"
        );
        let an = ok(analytics
            .get_recommendations(with_key(
                &viewer,
                pb::GetRecommendationsRequest {
                    agent: ag.agent.clone(),
                    refresh: false,
                },
            ))
            .await);
        if let Some(s) = &an.summary {
            assert!(
                r.contains(&format!("data-k=\"success\">{}<", pct(s.success_rate))),
                "{r}"
            );
            if let Some(c) = s.cost_per_success_micros {
                assert!(r.contains(&format!("data-k=\"cps\">{}<", usd(c))), "{r}");
            }
        }
    }
    eprintln!("ui: /agents answered in {took:?} on the demo data");
    // Sorting is server-side and keeps every row.
    let sorted = text(&b.get("/agents?sort=sessions").await);
    for ag in &named {
        row(&sorted, &ag.agent);
    }

    // One agent: its summary and charts.
    let first = &named[0].agent;
    let started = Instant::now();
    let a = b.get(&format!("/agents/{}", percent(first))).await;
    eprintln!("ui: /agents/{first} answered in {:?}", started.elapsed());
    assert_eq!(a.status, 200);
    let html = text(&a);
    let an = ok(analytics
        .get_recommendations(with_key(
            &viewer,
            pb::GetRecommendationsRequest {
                agent: first.clone(),
                refresh: false,
            },
        ))
        .await);
    if let Some(s) = &an.summary {
        assert!(
            html.contains(&format!(
                "{} sessions, {} successful ({})",
                count(s.sessions),
                count(s.successes),
                pct(s.success_rate)
            )),
            "summary"
        );
    }
    for r in &an.recommendations {
        assert!(
            html.contains(&nm_gateway::ui::html::escape(&r.message)),
            "{}",
            r.message
        );
    }
    assert!(
        html.contains("<svg") && html.contains("<title id=\"weekly-model-t\">"),
        "a chart with a title"
    );
    // Latency bands: every arm's weekly percentiles equal the gRPC answer.
    let days_ago = |days: i64| {
        Some(pb::TimeRange {
            since: Some(prost_types::Timestamp {
                seconds: chrono::Utc::now().timestamp() - days * 86_400,
                nanos: 0,
            }),
            until: None,
        })
    };
    let latency = ok(UsageClient::new(channel.clone())
        .get_latency(with_key(
            &viewer,
            pb::GetLatencyRequest {
                range: days_ago(12 * 7),
                group_by: [
                    pb::UsageDimension::Model,
                    pb::UsageDimension::Provider,
                    pb::UsageDimension::Env,
                    pb::UsageDimension::Week,
                ]
                .into_iter()
                .map(|d| d as i32)
                .collect(),
                filter: Some(pb::UsageFilter {
                    agent: Some(first.clone()),
                    ..Default::default()
                }),
                limit: 10_000,
            },
        ))
        .await);
    assert!(
        !latency.rows.is_empty(),
        "the demo's requests have latencies"
    );
    assert!(
        html.contains("<title id=\"latency-t\">"),
        "the latency chart"
    );
    let key = |k: &[pb::UsageKey], i: usize| {
        k.get(i)
            .and_then(|k| k.value.clone())
            .unwrap_or_else(|| "(none)".to_owned())
    };
    let cells = |p: Option<pb::LatencyPercentiles>| match p.filter(|p| p.count > 0) {
        Some(p) => format!(
            "<td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
            count(p.p50_ms),
            count(p.p90_ms),
            count(p.p99_ms)
        ),
        None => "<td>–</td><td>–</td><td>–</td>".to_owned(),
    };
    for r in latency.rows.iter().take(200) {
        let arm = format!(
            "{} · {} · {}",
            key(&r.key, 0),
            key(&r.key, 1),
            key(&r.key, 2)
        );
        let want = format!(
            "<tr data-arm=\"{arm}\" data-week=\"{week}\"><th scope=\"row\">{arm}</th><td>{week}</td>\
             <td class=\"num\">{}</td>{}{}</tr>",
            count(r.requests),
            cells(r.latency),
            cells(r.ttfb),
            arm = nm_gateway::ui::html::escape(&arm),
            week = key(&r.key, 3),
        );
        assert!(html.contains(&want), "{want}");
    }

    // Usage: the 30-day total equals the gRPC answer.
    let a = b.get("/usage").await;
    assert_eq!(a.status, 200);
    let since = prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() - 30 * 86_400,
        nanos: 0,
    };
    let report = ok(UsageClient::new(channel.clone())
        .get_usage(with_key(
            &viewer,
            pb::GetUsageRequest {
                range: Some(pb::TimeRange {
                    since: Some(since),
                    until: None,
                }),
                ..Default::default()
            },
        ))
        .await);
    let total = report.total.unwrap_or_default();
    assert!(
        text(&a).contains(&format!(
            "<strong>{}</strong> over {} requests",
            usd(total.cost_micros),
            count(total.requests)
        )),
        "usage total"
    );
    // Spend by key: every key's 30 days equal the gRPC report by key.
    let page = text(&a);
    assert!(
        page.contains("<title id=\"spend-key-t\">"),
        "spend by key over time"
    );
    let by_key = ok(UsageClient::new(channel.clone())
        .get_usage(with_key(
            &viewer,
            pb::GetUsageRequest {
                range: Some(pb::TimeRange {
                    since: Some(since),
                    until: None,
                }),
                group_by: vec![pb::UsageDimension::Key as i32],
                limit: 200,
                ..Default::default()
            },
        ))
        .await);
    assert!(!by_key.rows.is_empty(), "the demo's requests have keys");
    for r in &by_key.rows {
        let want = format!(
            "<tr><th scope=\"row\">{}</th><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            nm_gateway::ui::html::escape(r.key[0].value.as_deref().unwrap_or("(none)")),
            count(r.requests),
            count(r.input_tokens),
            count(r.output_tokens),
            usd(r.cost_micros),
            count(r.errors)
        );
        let section = &page[page.find("data-usage=\"key\"").unwrap_or(0)..];
        assert!(section.contains(&want), "{want}");
    }
    // Budgets: a budget of another scope than an end user, its limits and use as gRPC says.
    let mut budgets = BudgetsClient::new(channel.clone());
    ok(budgets
        .set_budget(with_key(
            ADMIN_KEY,
            pb::SetBudgetRequest {
                scope: "agent".to_owned(),
                scope_value: first.to_owned(),
                limit_micros: Some(25_000_000),
                period: pb::BudgetPeriod::Week.into(),
                tokens_per_minute: Some(90_000),
                ..Default::default()
            },
        ))
        .await);
    let status = ok(budgets
        .get_budget(with_key(
            &viewer,
            pb::GetBudgetRequest {
                scope: "agent".to_owned(),
                scope_value: first.to_owned(),
                ..Default::default()
            },
        ))
        .await);
    let page = text(&b.get("/usage").await);
    assert_eq!(status.limits.len(), 2, "{status:?}");
    for l in &status.limits {
        let money = l.limit.starts_with("usd");
        let amount = |v: u64| if money { usd(v) } else { count(v) };
        let row = format!(
            "data-scope=\"agent\" data-value=\"{}\" data-limit=\"{}\"",
            nm_gateway::ui::html::escape(first),
            l.limit
        );
        let at = page
            .find(&row)
            .unwrap_or_else(|| panic!("no row {row} on the page"));
        let tail = &page[at..];
        let end = tail.find("</tr>").unwrap_or(tail.len());
        let cells = &tail[..end];
        assert!(
            cells.contains(&format!("{} {}", amount(l.value), l.limit)),
            "{cells}"
        );
        assert!(
            cells.contains(&format!("<td class=\"num\">{}</td>", amount(l.spent))),
            "{cells}"
        );
    }
    assert!(
        page.contains("every end user without a budget of their own"),
        "the default for end users shown (set or not)"
    );

    assert_eq!(b.get("/experiments").await.status, 200);

    // Hostile names: escaped, bounded, decoded safely.
    let a = b.get("/agents/%3Cscript%3Ealert(1)%3C%2Fscript%3E").await;
    assert!(!text(&a).contains("<script>"), "escaped");
    assert_eq!(
        b.get(&format!("/agents/{}", "a".repeat(500))).await.status,
        400
    );
    assert_eq!(b.get("/agents/%ff%fe").await.status, 400);
    assert_eq!(b.get("/agents/a%00b").await.status, 400);
    assert_eq!(b.get("/nope").await.status, 404);

    // Read-only: nothing but sign-in and sign-out takes a POST (or any other method).
    for (method, path) in [
        ("POST", "/agents"),
        ("PUT", "/agents"),
        ("DELETE", "/usage"),
        ("POST", "/experiments"),
        ("PATCH", "/sign-in"),
    ] {
        let a = b
            .send(method, path, &[("origin", &b.origin.clone())], "")
            .await;
        assert_eq!(a.status, 405, "{method} {path}");
    }
    let a = b
        .send("POST", &format!("/agents/{}", percent(first)), &[], "")
        .await;
    assert!(a.status == 404 || a.status == 405, "{}", a.status);

    // Sign-out needs the page's token; then the old cookie is refused.
    assert_eq!(b.post_form("/sign-out", "csrf=wrong").await.status, 403);
    let page = text(&b.get("/usage").await);
    let token = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or_default()
        .to_owned();
    let a = b.post_form("/sign-out", &format!("csrf={token}")).await;
    assert_eq!(a.status, 303);
    assert!(
        a.header("set-cookie")
            .unwrap_or_default()
            .contains("Max-Age=0")
    );
    let a = b.get("/agents").await;
    assert_eq!(
        (a.status, a.header("location")),
        (303, Some("/sign-in?expired=1"))
    );

    // An admin signs in too; revoking its key ends its session at the next page.
    let (admin_id, admin_secret) = create_key(&mut keys, pb::KeyRole::Admin).await;
    assert_eq!(b.sign_in(&admin_secret).await.status, 303);
    assert!(text(&b.get("/agents").await).contains(&format!("{admin_id} (admin)")));
    ok(keys
        .revoke_key(with_key(ADMIN_KEY, pb::RevokeKeyRequest { id: admin_id }))
        .await);
    crate::common::eventually(
        std::time::Duration::from_secs(10),
        "revoked key signed out",
        || async {
            let a = b.get("/agents").await;
            (a.status == 303).then_some(())
        },
    )
    .await;
    gw.stop().await;
}

#[tokio::test]
async fn ui_pages_sqlite() {
    pages_equal_grpc_and_refuse_what_they_should(Db::Sqlite).await;
}

#[tokio::test]
async fn ui_pages_postgres() {
    pages_equal_grpc_and_refuse_what_they_should(Db::Postgres).await;
}

/// The one-agent page with a million signals stored (about 833,000 sessions, as many requests
/// and signals again, over 28 days): how long the pages take, first (the analytics computed)
/// and then (stored). Slow to fill (minutes in a debug build): run by hand,
/// `cargo nextest run -E 'test(ui_million)' --run-ignored only --no-capture`;
/// `NM_UI_BENCH_SIGNALS` changes the count; `NM_UI_BENCH_DB=<file>` only fills that file and
/// keeps it. The numbers are in docs/ui.md.
#[tokio::test]
#[ignore = "fills a million signals: a measurement, run by hand"]
async fn ui_million_signals_agent_page() {
    use nm_controlplane::analytics::synthetic::{AgentSpec, ModelSpec, Path, generate_with};
    let signals: usize = std::env::var("NM_UI_BENCH_SIGNALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    // `NM_UI_BENCH_DB=<file>`: fill that file and keep it (to time another build's pages on it).
    let kept = std::env::var("NM_UI_BENCH_DB").ok();
    let url = match &kept {
        Some(file) => format!("sqlite://{file}?mode=rwc"),
        None => format!("sqlite://{}/big.db?mode=rwc", dir.path().display()),
    };
    let store = nm_controlplane::Store::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let spec = AgentSpec::new(
        "big-agent",
        (signals as f64 / 1.2) as usize,
        vec![
            ModelSpec::new("openai", "gpt-4o", 0.72, 7_000),
            ModelSpec::new("openai", "gpt-4o-mini", 0.70, 500),
            ModelSpec::new("anthropic", "claude-3-5-haiku", 0.66, 1_500),
        ],
    );
    let started = Instant::now();
    let written = generate_with(
        &store,
        &[spec],
        7,
        nm_controlplane::now_ms(),
        10_000,
        Path::Direct,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("ui bench: stored {written:?} in {:?}", started.elapsed());
    let _ = store.close().await;
    if kept.is_some() {
        return;
    }
    let gw = TestGateway::builder()
        .env("NM_DATABASE_URL", &url)
        .env("NM_UI_ADDR", "127.0.0.1:0")
        .start()
        .await
        .unwrap_or_else(|| panic!("no gateway"));
    let mut b = Browser::new(&gw);
    assert_eq!(b.sign_in(ADMIN_KEY).await.status, 303);
    for round in [
        "first (analytics computed)",
        "second (stored)",
        "third (stored)",
    ] {
        for path in ["/agents", "/agents/big-agent", "/usage", "/experiments"] {
            let t = Instant::now();
            let a = b.get(path).await;
            assert_eq!(a.status, 200, "{path}");
            eprintln!("ui bench: {round} {path} {:?}", t.elapsed());
        }
    }
    gw.stop().await;
}
