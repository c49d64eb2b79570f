//! The web page in a real browser: `tests/ui/browser.py` drives Debian's Chromium with
//! Playwright over a gateway holding the demo data, and checks sign-in and refusals, every
//! page free of console errors and failed requests, the figures equal to the gRPC answers
//! computed here, a viewer finding nothing that changes state, and axe-core's accessibility
//! check. `.ci/run` installs the tools and sets `NM_TEST_UI_PYTHON`, `NM_TEST_UI_CHROMIUM` and
//! `NM_TEST_UI_AXE`; without them the test prints SKIPPED. With `NM_BLESS=1` the screenshots are
//! written to docs/img/ (committed, shown in the README and docs/ui.md).

use std::collections::BTreeMap;
use std::process::Command;

use nm_gateway::grpc::pb::{
    self, agents_client::AgentsClient, analytics_client::AnalyticsClient, keys_client::KeysClient,
    usage_client::UsageClient,
};
use nm_gateway::ui::html::{count, path_segment, pct, usd};
use serde_json::json;

use crate::common::gateway::{ADMIN_KEY, Db, with_key};

fn ok<T>(r: Result<tonic::Response<T>, tonic::Status>) -> T {
    r.unwrap_or_else(|e| panic!("{e}")).into_inner()
}

#[tokio::test]
async fn ui_in_a_real_browser() {
    let tools = (
        std::env::var("NM_TEST_UI_PYTHON"),
        std::env::var("NM_TEST_UI_CHROMIUM"),
        std::env::var("NM_TEST_UI_AXE"),
    );
    let (Ok(python), Ok(chromium), Ok(axe)) = tools else {
        eprintln!(
            "SKIPPED ui_in_a_real_browser: set NM_TEST_UI_PYTHON (Playwright), NM_TEST_UI_CHROMIUM \
             and NM_TEST_UI_AXE (axe.min.js); .ci/run installs them"
        );
        return;
    };
    let Some(gw) = crate::ui::demo_gateway(Db::Sqlite).await else {
        return;
    };
    let channel = gw.grpc_channel().await;
    let keys = KeysClient::new(channel.clone());
    let key = |role: pb::KeyRole| {
        let mut keys = keys.clone();
        async move {
            ok(keys
                .create_key(with_key(
                    ADMIN_KEY,
                    pb::CreateKeyRequest {
                        name: "browser".into(),
                        role: role as i32,
                        ..Default::default()
                    },
                ))
                .await)
            .secret
        }
    };
    let viewer = key(pb::KeyRole::Viewer).await;
    let service = key(pb::KeyRole::Service).await;
    // What the page must show: the gRPC answers, formatted as the page formats them.
    let list = ok(AgentsClient::new(channel.clone())
        .list_agents(with_key(&viewer, pb::ListAgentsRequest::default()))
        .await);
    let mut analytics = AnalyticsClient::new(channel.clone());
    let mut expected = BTreeMap::new();
    for a in list.agents.iter().filter(|a| !a.unattributed) {
        let an = ok(analytics
            .get_recommendations(with_key(
                &viewer,
                pb::GetRecommendationsRequest {
                    agent: a.agent.clone(),
                    refresh: false,
                },
            ))
            .await);
        let success = an
            .summary
            .as_ref()
            .map_or_else(|| "–".to_owned(), |s| pct(s.success_rate));
        expected.insert(
            a.agent.clone(),
            json!({"sessions": count(a.sessions), "signals": count(a.signals), "success": success}),
        );
    }
    let first = list
        .agents
        .iter()
        .find(|a| !a.unattributed)
        .map(|a| a.agent.clone())
        .unwrap_or_else(|| panic!("the demo has agents"));
    let since = prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() - 30 * 86_400,
        nanos: 0,
    };
    let usage = ok(UsageClient::new(channel.clone())
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
    let bless = std::env::var("NM_BLESS").is_ok_and(|v| v == "1");
    let shots = bless.then(|| concat!(env!("CARGO_MANIFEST_DIR"), "/docs/img").to_owned());
    if let Some(dir) = &shots {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{e}"));
    }
    let ui = gw.ui.unwrap_or_else(|| panic!("no web page"));
    let cfg = json!({
        "base": format!("http://{ui}"),
        "viewer": viewer,
        "service": service,
        "agent_path": path_segment(&first),
        "expected": expected,
        "usage_total": usd(usage.total.unwrap_or_default().cost_micros),
        "chromium": chromium,
        "axe": axe,
        "screenshots": shots,
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ui/browser.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .arg(cfg.to_string())
            .output()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("browser: {stdout}");
    assert!(
        out.status.success(),
        "browser test failed:\n{stdout}\n{stderr}"
    );
    gw.stop().await;
}
