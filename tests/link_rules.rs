//! The link's rules are the controlplane's, whatever adapter brings the data: the same hostile
//! records and signals, sent through `serve`'s in-process adapter and through a split
//! deployment's gRPC link, meet the same refusals (caps, a key valid at the record's or the
//! signal's time, one row per request id and per idempotency key).
//!
//! Both go through the dataplane's own port (`nm_dataplane::link::Port`), the way its shipper
//! and its signal endpoint do; the records are crafted, so they can break every rule.

use std::sync::Arc;
use std::time::Duration;

use nm_controlplane::{Controlplane, Store};
use nm_dataplane::link::{LinkError, Port};
use nm_gateway::grpc::pb::{self, keys_client::KeysClient};
use nm_gateway::link::local::InProcess;
use nm_gateway::link::remote::Grpc;
use nm_types::record::RequestRecord;
use nm_types::signal::Signal;
use nm_types::{Action, VerifierKey};

use crate::common::gateway::{LINK_SECRET, Shape, TestGateway, admin};

/// Milliseconds since 1970, now.
fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

const HOUR_MS: i64 = 3_600_000;

/// The key ids the hostile data names: one live, one revoked now.
struct Keys {
    live: String,
    revoked: String,
    revoked_at_ms: i64,
}

type Client = KeysClient<tonic::transport::Channel>;

/// Creates a service key through the admin API; returns its id.
async fn create_key(client: &mut Client, name: &str) -> String {
    client
        .create_key(admin(pb::CreateKeyRequest {
            name: name.to_owned(),
            admin: false,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("create: {e}"))
        .into_inner()
        .key
        .unwrap_or_else(|| panic!("no key"))
        .id
}

/// Creates a live and a revoked key through the admin API.
async fn keys(gw: &TestGateway) -> Keys {
    let mut client = KeysClient::new(gw.grpc_channel().await);
    let live = create_key(&mut client, "live").await;
    let revoked = create_key(&mut client, "revoked").await;
    let answer = client
        .revoke_key(admin(pb::RevokeKeyRequest {
            id: revoked.clone(),
        }))
        .await
        .unwrap_or_else(|e| panic!("revoke: {e}"))
        .into_inner();
    let revoked_at = answer
        .key
        .and_then(|k| k.revoked_at)
        .unwrap_or_else(|| panic!("not revoked"));
    Keys {
        live,
        revoked,
        revoked_at_ms: nm_gateway::grpc::convert::timestamp_to_ms(&revoked_at),
    }
}

/// The port of `gw`'s shape: in `serve`, the in-process adapter over the gateway's database;
/// split, the gRPC adapter to its controlplane, with the link secret.
async fn port(gw: &TestGateway) -> (Arc<dyn Port>, Option<tokio::sync::watch::Sender<bool>>) {
    if gw.shape.is_split() {
        let grpc =
            Grpc::new(gw.grpc_channel().await, LINK_SECRET).unwrap_or_else(|e| panic!("{e}"));
        return (Arc::new(grpc), None);
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let store = Store::connect(&gw.db_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let cp = Controlplane::open(store, stopped)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let local = InProcess::new(cp, VerifierKey::from_link_secret(LINK_SECRET), None);
    (Arc::new(local), Some(stop))
}

fn record(id: &str, key_id: &str, started_at_ms: i64) -> RequestRecord {
    RequestRecord {
        request_id: id.to_owned(),
        started_at_ms,
        key_id: key_id.into(),
        provider: "openai".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        status: 200,
        ..RequestRecord::default()
    }
}

fn signal(id: &str, key_id: &str, received_at_ms: i64) -> Signal {
    Signal {
        id: id.to_owned(),
        received_at_ms,
        session_id: "sess_rules".parse().ok(),
        request_id: None,
        action: Action::Accepted,
        edit_distance: None,
        custom_label: None,
        key_id: key_id.into(),
        idempotency_key: None,
        agent_hint: None,
    }
}

/// The rule a refusal names (the gRPC adapter puts the status code in front of it), or the
/// kind of a failure that is not a refusal.
fn refusal(e: LinkError) -> String {
    match e {
        LinkError::Rejected(m) => m.rsplit(": ").next().unwrap_or_default().to_owned(),
        other => panic!("not a refusal: {other}"),
    }
}

const KEY_RULE_RECORD: &str = "key_id must name a key that was valid when the request was made";
const KEY_RULE_SIGNAL: &str = "key_id must name a key that was valid when the signal was sent";

/// Sends the hostile records through `port` and checks each refusal.
async fn records_meet_the_rules(gw: &TestGateway, port: &dyn Port, keys: &Keys) {
    let now = now_ms();
    let over_cap_model = RequestRecord {
        model: Some("m".repeat(300)),
        ..record("rules-model", &keys.live, now)
    };
    let over_cap_cost = RequestRecord {
        cost_micros: Some(2_000_000_000_000),
        ..record("rules-cost", &keys.live, now)
    };
    let batch = [
        record("rules-ok", &keys.live, now),
        over_cap_model,
        over_cap_cost,
        record("rules-unknown-key", "key_never_issued", now),
        // Revoked before the request: refused; revoked after it (delivered late): stored.
        record(
            "rules-after-revoke",
            &keys.revoked,
            keys.revoked_at_ms + HOUR_MS,
        ),
        record(
            "rules-before-revoke",
            &keys.revoked,
            keys.revoked_at_ms - HOUR_MS,
        ),
        record("", &keys.live, now),
    ];
    let ingested = port.ingest(&batch).await.unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<(usize, String)> = [
        (1, "model must be 1 to 256 printable characters"),
        (2, "cost_micros and budget_micros must be at most 10^12"),
        (3, KEY_RULE_RECORD),
        (4, KEY_RULE_RECORD),
        (6, "request_id must be 1 to 64 printable characters"),
    ]
    .into_iter()
    .map(|(i, why)| (i, why.to_owned()))
    .collect();
    assert_eq!(ingested.rejected, want, "{:?}", gw.shape);

    // The same request id again (a resent batch): accepted, stored once.
    let again = port
        .ingest(&[record("rules-ok", &keys.live, now)])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(again.rejected.is_empty(), "{:?}", again.rejected);
    let stored = gw
        .count("SELECT COUNT(*) AS n FROM requests WHERE request_id LIKE 'rules-%'")
        .await;
    assert_eq!(
        stored, 2,
        "rules-ok once, rules-before-revoke ({:?})",
        gw.shape
    );

    // A batch over the cap is refused whole.
    let huge: Vec<RequestRecord> = (0..=nm_controlplane::MAX_INGEST_BATCH)
        .map(|i| record(&format!("rules-huge-{i}"), &keys.live, now))
        .collect();
    let refused = port.ingest(&huge).await.map(drop).map_err(refusal);
    assert_eq!(
        refused,
        Err("at most 10000 records per call".to_owned()),
        "{:?}",
        gw.shape
    );
}

/// Sends the hostile signals through `port` and checks each refusal.
async fn signals_meet_the_rules(gw: &TestGateway, port: &dyn Port, keys: &Keys) {
    let now = now_ms();
    let within = Duration::from_secs(10);
    let cases: Vec<(Signal, Result<(), &str>)> = vec![
        (signal("rules-s-ok", &keys.live, now), Ok(())),
        (
            Signal {
                custom_label: Some("{not json".to_owned()),
                ..signal("rules-s-label", &keys.live, now)
            },
            Err("custom_label must be JSON of at most 1024 bytes"),
        ),
        (
            Signal {
                custom_label: Some(format!("\"{}\"", "x".repeat(2000))),
                ..signal("rules-s-big-label", &keys.live, now)
            },
            Err("custom_label must be JSON of at most 1024 bytes"),
        ),
        (
            Signal {
                action: Action::Edited,
                ..signal("rules-s-edited", &keys.live, now)
            },
            Err("edit_distance is required when action is edited"),
        ),
        (
            Signal {
                edit_distance: Some(1_000_000_001),
                ..signal("rules-s-distance", &keys.live, now)
            },
            Err("edit_distance must be at most 10^9"),
        ),
        (
            Signal {
                idempotency_key: Some("k".repeat(256)),
                ..signal("rules-s-idem", &keys.live, now)
            },
            Err("idempotency key must be 1 to 255 characters"),
        ),
        (
            Signal {
                agent_hint: Some("a".repeat(200)),
                ..signal("rules-s-agent", &keys.live, now)
            },
            Err("agent name must be 1 to 128 printable characters"),
        ),
        (
            signal("rules-s-unknown", "key_never_issued", now),
            Err(KEY_RULE_SIGNAL),
        ),
        (
            signal(
                "rules-s-after-revoke",
                &keys.revoked,
                keys.revoked_at_ms + HOUR_MS,
            ),
            Err(KEY_RULE_SIGNAL),
        ),
        (
            signal(
                "rules-s-before-revoke",
                &keys.revoked,
                keys.revoked_at_ms - HOUR_MS,
            ),
            Ok(()),
        ),
        (
            signal("rules-s-1969", &keys.live, -1),
            Err("received_at must be between 1970 and 2100"),
        ),
        (
            signal(&"i".repeat(65), &keys.live, now),
            Err("signal id must be 1 to 64 characters"),
        ),
    ];
    for (s, want) in cases {
        let id = s.id.clone();
        let got = port
            .record_signal(s, within)
            .await
            .map(drop)
            .map_err(refusal);
        assert_eq!(got, want.map_err(str::to_owned), "{id} ({:?})", gw.shape);
    }

    // A retry with the same idempotency key and a new id: acknowledged, counted once.
    for id in ["rules-s-idem-1", "rules-s-idem-2"] {
        let s = Signal {
            idempotency_key: Some("rules-once".to_owned()),
            ..signal(id, &keys.live, now)
        };
        port.record_signal(s, within)
            .await
            .unwrap_or_else(|e| panic!("{id}: {e}"));
    }
    let stored = gw
        .count("SELECT COUNT(*) AS n FROM signals WHERE id LIKE 'rules-s-%'")
        .await;
    assert_eq!(
        stored, 3,
        "ok, before-revoke, one of the idempotent pair ({:?})",
        gw.shape
    );
}

async fn same_rules(shape: Shape) {
    let gw = TestGateway::builder().shape(shape).run().await;
    let keys = keys(&gw).await;
    let (port, stop) = port(&gw).await;
    records_meet_the_rules(&gw, port.as_ref(), &keys).await;
    signals_meet_the_rules(&gw, port.as_ref(), &keys).await;
    if let Some(stop) = stop {
        let _ = stop.send(true);
    }
    drop(port);
    gw.stop().await;
}

#[tokio::test]
async fn serve_applies_the_controlplanes_rules() {
    same_rules(Shape::Serve).await;
}

#[tokio::test]
async fn split_applies_the_same_rules() {
    same_rules(Shape::Split).await;
}
