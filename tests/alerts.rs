//! Alerts through a real gateway and a real webhook receiver on loopback: deliveries signed
//! with the webhook's secret, retried after failures with the same event id and sent once after
//! a success; a key close to its expiry announced once; the Slack body; bad input refused; a
//! viewer that can read but not change; the audit trail.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use nm_gateway::grpc::pb::{self, alerts_client::AlertsClient, keys_client::KeysClient};
use tokio::net::TcpListener;
use tonic::Code;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, TestGateway, with_key};

/// A webhook receiver: records each POST (its headers and body) and answers 500 to the first
/// `failures`, then 200.
struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>>,
}

impl Receiver {
    async fn start(failures: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let url = format!(
            "http://{}/hook",
            listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
        );
        let got: Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>> = Arc::default();
        let seen = got.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let seen = seen.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let n = {
                                let mut g = seen
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                                g.push((parts.headers, body));
                                g.len()
                            };
                            let status = if n <= failures { 500 } else { 200 };
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(status)
                                    .body(Full::new(Bytes::from_static(b"ok")))
                                    .unwrap_or_else(|e| panic!("{e}")),
                            )
                        }
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { url, got }
    }

    fn received(&self) -> Vec<(http::HeaderMap, Bytes)> {
        self.got
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

fn ok<T>(r: Result<tonic::Response<T>, tonic::Status>) -> T {
    r.unwrap_or_else(|e| panic!("{e}")).into_inner()
}

/// Checks `NM-Signature` against the secret: `t=<secs>,v1=<hex HMAC-SHA-256 of "<t>.<body>">`.
fn assert_signed(headers: &http::HeaderMap, body: &[u8], secret: &str) {
    let sig = headers["nm-signature"]
        .to_str()
        .unwrap_or_else(|e| panic!("{e}"));
    let (t, v1) = sig
        .strip_prefix("t=")
        .and_then(|s| s.split_once(",v1="))
        .unwrap_or_else(|| panic!("{sig}"));
    let t: i64 = t.parse().unwrap_or_else(|e| panic!("{e}"));
    assert!((chrono::Utc::now().timestamp() - t).abs() < 60, "{sig}");
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(body);
    let want: String = nm_types::hmac_sha256(secret.as_bytes(), &msg)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(v1, want, "signature of {}", String::from_utf8_lossy(body));
}

async fn gateway() -> (TestGateway, AlertsClient<tonic::transport::Channel>) {
    let gw = TestGateway::builder()
        .env("NM_ALERT_RETRY_SECS", "1")
        .run()
        .await;
    let alerts = AlertsClient::new(gw.grpc_channel().await);
    (gw, alerts)
}

async fn add(
    alerts: &mut AlertsClient<tonic::transport::Channel>,
    url: &str,
    kinds: &[&str],
    format: &str,
) -> pb::AddWebhookResponse {
    ok(alerts
        .add_webhook(with_key(
            ADMIN_KEY,
            pb::AddWebhookRequest {
                url: url.to_owned(),
                kinds: kinds.iter().map(|k| (*k).to_owned()).collect(),
                format: format.to_owned(),
                description: "test".into(),
            },
        ))
        .await)
}

async fn deliveries(
    alerts: &mut AlertsClient<tonic::transport::Channel>,
    webhook: &str,
) -> Vec<pb::Delivery> {
    ok(alerts
        .list_deliveries(with_key(
            ADMIN_KEY,
            pb::ListDeliveriesRequest {
                webhook_id: webhook.to_owned(),
                limit: 0,
            },
        ))
        .await)
    .deliveries
}

#[tokio::test]
async fn a_delivery_is_signed_retried_after_failures_and_sent_once() {
    let (gw, mut alerts) = gateway().await;
    let receiver = Receiver::start(2).await;
    let added = add(&mut alerts, &receiver.url, &["test"], "").await;
    let webhook = added.webhook.unwrap_or_else(|| panic!("missing"));
    assert!(added.secret.starts_with("whsec_") && added.secret.len() == 70);

    let event = ok(alerts
        .test_webhook(with_key(
            ADMIN_KEY,
            pb::TestWebhookRequest {
                id: webhook.id.clone(),
            },
        ))
        .await)
    .event_id;
    // Two failures (500), then a success: three tries of the same event.
    eventually(Duration::from_secs(30), "three tries", || async {
        (receiver.received().len() >= 3).then_some(())
    })
    .await;
    let d = eventually(Duration::from_secs(10), "delivered", || async {
        deliveries(&mut alerts.clone(), &webhook.id)
            .await
            .into_iter()
            .find(|d| d.state == "delivered")
    })
    .await;
    assert_eq!(
        (d.event_id.as_str(), d.attempts, d.last_status),
        (event.as_str(), 3, Some(200))
    );
    assert_eq!(d.kind, "test");
    let got = receiver.received();
    for (headers, body) in &got {
        assert_eq!(headers["nm-event-id"], event.as_str());
        assert_eq!(headers["content-type"], "application/json");
        assert_signed(headers, body, &added.secret);
        let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v["id"], event.as_str());
        assert_eq!(v["kind"], "test");
    }
    // The process's metrics count each try by outcome.
    let metrics = gw.get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    for line in [
        r#"nm_alert_deliveries_total{outcome="retried"} 2"#,
        r#"nm_alert_deliveries_total{outcome="delivered"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    // Nothing more after the success: a second event, sent after it, is the next POST.
    let second = ok(alerts
        .test_webhook(with_key(
            ADMIN_KEY,
            pb::TestWebhookRequest {
                id: webhook.id.clone(),
            },
        ))
        .await)
    .event_id;
    eventually(Duration::from_secs(30), "the second event", || async {
        (receiver.received().len() >= 4).then_some(())
    })
    .await;
    let got = receiver.received();
    assert_eq!(got.len(), 4);
    assert!(
        got[..3]
            .iter()
            .all(|(h, _)| h["nm-event-id"] == event.as_str())
    );
    assert_eq!(got[3].0["nm-event-id"], second.as_str());
    gw.stop().await;
}

#[tokio::test]
async fn a_key_close_to_its_expiry_is_announced_once_and_slack_gets_text() {
    let (gw, mut alerts) = gateway().await;
    let json = Receiver::start(0).await;
    let slack = Receiver::start(0).await;
    let added = add(&mut alerts, &json.url, &["key_expiry"], "json").await;
    add(&mut alerts, &slack.url, &["key_expiry"], "slack").await;
    // A webhook for other kinds hears nothing of it.
    let other = Receiver::start(0).await;
    add(&mut alerts, &other.url, &["budget"], "json").await;

    let mut keys = KeysClient::new(gw.grpc_channel().await);
    let expires = chrono::Utc::now() + chrono::Duration::days(2);
    let key = ok(keys
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: "soon".into(),
                expires_at: Some(nm_gateway::grpc::convert::ms_to_timestamp(
                    expires.timestamp_millis(),
                )),
                ..Default::default()
            },
        ))
        .await)
    .key
    .unwrap_or_else(|| panic!("missing"));
    eventually(Duration::from_secs(20), "the expiry notice", || async {
        (json.received().len() == 1 && slack.received().len() == 1).then_some(())
    })
    .await;
    let (headers, body) = &json.received()[0];
    assert_signed(headers, body, &added.secret);
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(v["kind"], "key_expiry");
    assert_eq!(v["data"]["key_id"], key.id.as_str());
    let text: serde_json::Value =
        serde_json::from_slice(&slack.received()[0].1).unwrap_or_else(|e| panic!("{e}"));
    let text = text["text"].as_str().unwrap_or_else(|| panic!("missing"));
    assert!(
        text.contains(&key.id) && text.contains("within 7d"),
        "{text}"
    );
    // A later look (every 5 s) sends nothing more of it: a second key, made after the first
    // notice, is announced alone.
    let later = ok(keys
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: "sooner".into(),
                expires_at: Some(nm_gateway::grpc::convert::ms_to_timestamp(
                    (chrono::Utc::now() + chrono::Duration::hours(12)).timestamp_millis(),
                )),
                ..Default::default()
            },
        ))
        .await)
    .key
    .unwrap_or_else(|| panic!("missing"));
    eventually(Duration::from_secs(20), "the second notice", || async {
        (json.received().len() >= 2).then_some(())
    })
    .await;
    let got = json.received();
    assert_eq!(got.len(), 2);
    let second: serde_json::Value =
        serde_json::from_slice(&got[1].1).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second["data"]["key_id"], later.id.as_str());
    assert_eq!(other.received().len(), 0);
    gw.stop().await;
}

#[tokio::test]
async fn bad_webhooks_are_refused_and_a_viewer_cannot_change_them() {
    let (gw, mut alerts) = gateway().await;
    for (url, kinds, format, says) in [
        ("ftp://x/hook", vec![], "", "https://"),
        ("https://user:pw@example.com/", vec![], "", "user:password"),
        ("https://example.com/", vec!["budgets"], "", "kinds"),
        ("https://example.com/", vec![], "xml", "format"),
    ] {
        let e = alerts
            .add_webhook(with_key(
                ADMIN_KEY,
                pb::AddWebhookRequest {
                    url: url.into(),
                    kinds: kinds.into_iter().map(str::to_owned).collect(),
                    format: format.into(),
                    description: String::new(),
                },
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{url}");
        assert!(e.message().contains(says), "{}", e.message());
    }
    let added = add(&mut alerts, "https://hooks.example.com/x", &[], "").await;
    let webhook = added.webhook.unwrap_or_else(|| panic!("missing"));
    assert_eq!(webhook.kinds.len(), 5);

    let mut keys = KeysClient::new(gw.grpc_channel().await);
    let viewer = ok(keys
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: "viewer".into(),
                role: pb::KeyRole::Viewer as i32,
                ..Default::default()
            },
        ))
        .await)
    .secret;
    let listed = ok(alerts
        .list_webhooks(with_key(&viewer, pb::ListWebhooksRequest {}))
        .await)
    .webhooks;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].url, "https://hooks.example.com/x");
    let e = alerts
        .remove_webhook(with_key(
            &viewer,
            pb::RemoveWebhookRequest {
                id: webhook.id.clone(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    ok(alerts
        .remove_webhook(with_key(
            ADMIN_KEY,
            pb::RemoveWebhookRequest {
                id: webhook.id.clone(),
            },
        ))
        .await);
    let e = alerts
        .remove_webhook(with_key(
            ADMIN_KEY,
            pb::RemoveWebhookRequest {
                id: webhook.id.clone(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // Both changes are audited, without the secret.
    let audit = gw
        .count("SELECT COUNT(*) AS n FROM audit_events WHERE action IN ('webhook.add', 'webhook.remove')")
        .await;
    assert_eq!(audit, 2);
    let leaked = gw
        .count(&format!(
            "SELECT COUNT(*) AS n FROM audit_events WHERE after_json LIKE '%{}%'",
            &added.secret[6..30]
        ))
        .await;
    assert_eq!(leaked, 0);
    gw.stop().await;
}
