//! End-user erasure end to end, on SQLite and PostgreSQL: `nm.v1.Users/ForgetUser` replaces an
//! `NM-User` value by its token in everything stored, keeps the totals, deletes the user's own
//! budget, audits the erasure without the user in clear, and a second call changes nothing. On
//! SQLite, neither the database file nor its write-ahead log holds the user's bytes afterwards.

use std::time::Duration;

use nm_gateway::grpc::pb::{
    self, audit_client::AuditClient, budgets_client::BudgetsClient, usage_client::UsageClient,
    users_client::UsersClient,
};

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, TestGateway, admin};
use crate::common::mock::MockProvider;

const USER: &str = "alice-secret-id-7731";

async fn total(gw: &TestGateway) -> (Option<pb::UsageRow>, usize) {
    let mut client = UsageClient::new(gw.grpc_channel().await);
    let r = client
        .get_usage(admin(pb::GetUsageRequest {
            group_by: vec![pb::UsageDimension::User.into()],
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("usage: {e}"))
        .into_inner();
    (r.total, r.rows.len())
}

async fn forget(gw: &TestGateway) -> pb::ForgetUserResponse {
    UsersClient::new(gw.grpc_channel().await)
        .forget_user(admin(pb::ForgetUserRequest {
            user: USER.to_owned(),
        }))
        .await
        .unwrap_or_else(|e| panic!("forget: {e}"))
        .into_inner()
}

async fn forget_replaces_the_user_everywhere(db: Db) {
    let openai = MockProvider::json(crate::common::fixture("openai/chat_response.json"))
        .start()
        .await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &openai.url)
        .start()
        .await
    else {
        return;
    };
    BudgetsClient::new(gw.grpc_channel().await)
        .set_budget(admin(pb::SetBudgetRequest {
            user_id: Some(USER.to_owned()),
            limit_micros: Some(50_000_000),
            period: pb::BudgetPeriod::Day.into(),
            requests_per_minute: None,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("set budget: {e}"));
    for (user, session) in [
        (USER, "sess_fgt1"),
        (USER, "sess_fgt1"),
        (USER, "sess_fgt2"),
        ("bob", "sess_fgt3"),
    ] {
        let a = gw
            .chat(&[
                ("nm-agent", "helper"),
                ("nm-user", user),
                ("nm-session", session),
            ])
            .await;
        assert_eq!(a.status, 200);
    }
    let body = format!(
        r#"{{"session_id":"sess_fgt1","action":"accepted","custom_label":{{"who":"{USER}"}}}}"#
    );
    let a = gw
        .raw(
            "POST",
            "/v1/signal",
            &[("nm-key", ADMIN_KEY), ("content-type", "application/json")],
            body,
        )
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    eventually(Duration::from_secs(15), "records stored", || async {
        (gw.count("SELECT COUNT(*) AS n FROM requests").await == 4).then_some(())
    })
    .await;
    let (before, groups) = total(&gw).await;
    assert_eq!(groups, 2);

    let done = forget(&gw).await;
    assert!(done.token.starts_with("fgt_"), "{done:?}");
    assert_eq!(done.records, 3);
    assert_eq!(done.budgets, 1);
    let token = done.token.clone();
    for table in [
        "requests",
        "sessions",
        "signals",
        "session_rollups",
        "user_spend",
    ] {
        assert_eq!(
            gw.count(&format!(
                "SELECT COUNT(*) AS n FROM {table} WHERE user_id = '{USER}'"
            ))
            .await,
            0,
            "{table}"
        );
    }
    assert_eq!(
        gw.count(&format!(
            "SELECT COUNT(*) AS n FROM requests WHERE user_id = '{token}'"
        ))
        .await,
        3
    );
    // The budgets' daily spend: the user's rows are the token's now.
    assert_eq!(
        gw.count(&format!(
            "SELECT COUNT(*) AS n FROM budget_spend WHERE scope_value = '{USER}'"
        ))
        .await,
        0
    );
    assert_eq!(
        gw.count(&format!(
            "SELECT COUNT(*) AS n FROM budget_spend WHERE scope_kind = 'user' AND scope_value = '{token}'"
        ))
        .await,
        1
    );
    assert_eq!(
        gw.count("SELECT COUNT(*) AS n FROM budgets WHERE subject LIKE '%alice%'")
            .await,
        0
    );
    // Totals unchanged; the user's group is the token's now.
    assert_eq!(total(&gw).await, (before, 2));
    // Audited, without the user in clear.
    let events = AuditClient::new(gw.grpc_channel().await)
        .list_audit_events(admin(pb::ListAuditEventsRequest::default()))
        .await
        .unwrap_or_else(|e| panic!("audit: {e}"))
        .into_inner()
        .events;
    assert!(
        events
            .iter()
            .any(|e| e.action == "user.forget" && e.target == format!("user:{token}")),
        "{events:?}"
    );
    assert!(!format!("{events:?}").contains(USER), "{events:?}");

    // A second call: nothing left, nothing changed, no second audit row.
    let again = forget(&gw).await;
    assert_eq!((again.token.as_str(), again.rows), (token.as_str(), 0));
    assert_eq!(
        gw.count("SELECT COUNT(*) AS n FROM audit_events WHERE action = 'user.forget'")
            .await,
        1
    );

    if db == Db::Sqlite {
        let url = gw.dataplane_settings().database_url.clone();
        let path = url
            .trim_start_matches("sqlite://")
            .split('?')
            .next()
            .unwrap_or_default()
            .to_owned();
        for file in [path.clone(), format!("{path}-wal")] {
            let bytes = std::fs::read(&file).unwrap_or_default();
            if file == path {
                assert!(bytes.len() > 4096, "{file}: not read");
            }
            assert!(
                !bytes.windows(USER.len()).any(|w| w == USER.as_bytes()),
                "{file} ({} bytes) still holds the user id",
                bytes.len()
            );
        }
    }
    gw.stop().await;
}

#[tokio::test]
async fn forget_replaces_the_user_everywhere_sqlite() {
    forget_replaces_the_user_everywhere(Db::Sqlite).await;
}

#[tokio::test]
async fn forget_replaces_the_user_everywhere_postgres() {
    forget_replaces_the_user_everywhere(Db::Postgres).await;
}
