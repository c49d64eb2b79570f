//! Service keys over gRPC: admin-only management, keys checked from memory on the dataplane,
//! revocation reaching every dataplane within seconds (also when another controlplane replica
//! changed the database), on SQLite and PostgreSQL, in one process and split.

use std::time::Duration;

use nm_gateway::grpc::pb::{self, keys_client::KeysClient};
use sea_orm::ConnectionTrait;
use tonic::Code;
use tonic::transport::Channel;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, Shape, TestGateway, with_key};
use crate::common::mock::MockProvider;

async fn keys_client(gw: &TestGateway) -> KeysClient<Channel> {
    KeysClient::new(gw.grpc_channel().await)
}

async fn status_with(gw: &TestGateway, key: &str) -> u16 {
    gw.raw(
        "POST",
        "/openai/v1/chat/completions",
        &[("nm-key", key)],
        "{}",
    )
    .await
    .status
}

async fn lifecycle(db: Db, shape: Shape) {
    let mock = MockProvider::json("{}").start().await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .shape(shape)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };
    let mut client = keys_client(&gw).await;

    let created = client
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: "checkout-service".into(),
                admin: false,
                ..Default::default()
            },
        ))
        .await
        .unwrap_or_else(|e| panic!("create: {e}"))
        .into_inner();
    let secret = created.secret.clone();
    let key = created.key.unwrap_or_default();
    assert!(secret.starts_with("nmk_") && secret.len() == 52, "{secret}");
    assert!(key.id.starts_with("key_") && !key.admin && secret.starts_with(&key.display_prefix));

    eventually(
        Duration::from_secs(10),
        "new key accepted by the dataplane",
        || async { (status_with(&gw, &secret).await == 200).then_some(()) },
    )
    .await;

    let listed = client
        .list_keys(with_key(
            ADMIN_KEY,
            pb::ListKeysRequest {
                include_revoked: false,
            },
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert!(
        listed
            .keys
            .iter()
            .any(|k| k.id == key.id && k.name == "checkout-service")
    );
    assert_eq!(listed.keys.len(), 2, "bootstrap + the new one");

    // A service key is not an admin key.
    let denied = client
        .create_key(with_key(
            &secret,
            pb::CreateKeyRequest {
                name: "x".into(),
                admin: true,
                ..Default::default()
            },
        ))
        .await;
    assert_eq!(denied.err().map(|s| s.code()), Some(Code::PermissionDenied));

    let revoked = client
        .revoke_key(with_key(
            ADMIN_KEY,
            pb::RevokeKeyRequest { id: key.id.clone() },
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert!(revoked.key.is_some_and(|k| k.revoked_at.is_some()));
    let started = std::time::Instant::now();
    eventually(Duration::from_secs(10), "revoked key refused", || async {
        (status_with(&gw, &secret).await == 401).then_some(())
    })
    .await;
    eprintln!(
        "revocation reached the dataplane after {:?}",
        started.elapsed()
    );

    let all = client
        .list_keys(with_key(
            ADMIN_KEY,
            pb::ListKeysRequest {
                include_revoked: true,
            },
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(all.keys.len(), 2);
    let active = client
        .list_keys(with_key(
            ADMIN_KEY,
            pb::ListKeysRequest {
                include_revoked: false,
            },
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(active.keys.len(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn key_lifecycle_sqlite_serve() {
    lifecycle(Db::Sqlite, Shape::Serve).await;
}

#[tokio::test]
async fn key_lifecycle_sqlite_split() {
    lifecycle(Db::Sqlite, Shape::Split).await;
}

#[tokio::test]
async fn key_lifecycle_postgres_split() {
    lifecycle(Db::Postgres, Shape::Split).await;
}

#[tokio::test]
async fn admin_calls_need_an_admin_key() {
    let gw = TestGateway::builder().run().await;
    let mut client = keys_client(&gw).await;
    let missing = client
        .list_keys(tonic::Request::new(pb::ListKeysRequest::default()))
        .await;
    assert_eq!(missing.err().map(|s| s.code()), Some(Code::Unauthenticated));
    let wrong = client
        .list_keys(with_key("nmk_nope", pb::ListKeysRequest::default()))
        .await;
    assert_eq!(wrong.err().map(|s| s.code()), Some(Code::Unauthenticated));
    let bad_name = client
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: " ".into(),
                admin: false,
                ..Default::default()
            },
        ))
        .await;
    assert_eq!(
        bad_name.err().map(|s| s.code()),
        Some(Code::InvalidArgument)
    );
    let unknown = client
        .revoke_key(with_key(
            ADMIN_KEY,
            pb::RevokeKeyRequest {
                id: "key_nope".into(),
            },
        ))
        .await;
    assert_eq!(unknown.err().map(|s| s.code()), Some(Code::NotFound));
    gw.stop().await;
}

#[tokio::test]
async fn a_revocation_written_by_another_replica_is_picked_up() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let mut client = keys_client(&gw).await;
    let created = client
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: "other-replica".into(),
                admin: false,
                ..Default::default()
            },
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    let id = created.key.map(|k| k.id).unwrap_or_default();
    eventually(Duration::from_secs(10), "key accepted", || async {
        (status_with(&gw, &created.secret).await == 200).then_some(())
    })
    .await;

    // Another controlplane on the same database revokes it: only the database changes here.
    let db = gw.database().await;
    db.execute_unprepared(&format!(
        "UPDATE api_keys SET revoked_at_ms = 1 WHERE id = '{id}'"
    ))
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    eventually(
        Duration::from_secs(10),
        "revocation from the database refused",
        || async { (status_with(&gw, &created.secret).await == 401).then_some(()) },
    )
    .await;
    gw.stop().await;
}

#[tokio::test]
async fn the_bootstrap_key_survives_restarts_and_is_created_once() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("sqlite://{}/nm.db?mode=rwc", dir.path().display());
    for _ in 0..2 {
        let gw = TestGateway::builder()
            .env("NM_DATABASE_URL", &url)
            .run()
            .await;
        let mut client = keys_client(&gw).await;
        let keys = client
            .list_keys(with_key(
                ADMIN_KEY,
                pb::ListKeysRequest {
                    include_revoked: true,
                },
            ))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_inner();
        assert_eq!(keys.keys.len(), 1);
        assert!(keys.keys[0].admin);
        gw.stop().await;
    }
}
