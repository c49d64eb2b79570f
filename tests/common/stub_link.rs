//! A stand-in controlplane speaking `nm.link.v1` over gRPC on loopback, for dataplane tests that
//! need a key snapshot the real controlplane would not send (live experiments, before their
//! controlplane side exists): one service key, the experiments the test sets, an empty budget
//! feed, and the records it is sent, kept for the test to read. The dataplanes are the real
//! `app::start_dataplane`, so what they do with a snapshot goes through the same gRPC mapping
//! and key watcher as against the real controlplane.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nm_gateway::app::{self, Running};
use nm_gateway::config::{self, FileSettings, Flags, Mode};
use nm_gateway::grpc::link_pb;
use nm_gateway::grpc::link_pb::link_server::{Link, LinkServer};
use nm_types::access::Role;
use nm_types::budget::Feed;
use nm_types::experiment::Live;
use nm_types::record::RequestRecord;
use nm_types::{KeyVerifiers, VerifiedKey, VerifierKey};
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::gateway::LINK_SECRET;

/// The one key the stub's snapshots hold (a service key, unrestricted).
pub const STUB_KEY: &str = "nmk_stub_5d1e9a3c7b2f4e6a8c0d2f4b6a8c0e2f4a6c8e0b";

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The stand-in controlplane, serving until dropped with its runtime.
#[derive(Clone)]
pub struct StubLink {
    experiments: watch::Sender<Vec<Live>>,
    records: Arc<Mutex<Vec<RequestRecord>>>,
    pub url: String,
}

#[derive(Clone)]
struct Service {
    experiments: watch::Receiver<Vec<Live>>,
    records: Arc<Mutex<Vec<RequestRecord>>>,
}

impl StubLink {
    pub async fn start(experiments: Vec<Live>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("addr: {e}"));
        let (tx, rx) = watch::channel(experiments);
        let records = Arc::new(Mutex::new(Vec::new()));
        let service = Service {
            experiments: rx,
            records: records.clone(),
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(LinkServer::new(service))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Self {
            experiments: tx,
            records,
            url: format!("http://{addr}"),
        }
    }

    /// Replaces the experiments the next snapshots carry (sent at once).
    pub fn set_experiments(&self, experiments: Vec<Live>) {
        self.experiments.send_replace(experiments);
    }

    /// The records the dataplanes delivered so far.
    pub fn records(&self) -> Vec<RequestRecord> {
        self.records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Waits until a record of `request_id` arrived.
    pub async fn record(&self, request_id: &str) -> RequestRecord {
        super::eventually(Duration::from_secs(10), "record delivered", || async {
            self.records()
                .into_iter()
                .find(|r| r.request_id == request_id)
        })
        .await
    }

    /// Starts a real dataplane (`app::start_dataplane`) following this stub, with `env` over
    /// the defaults, and waits until it has its keys.
    pub async fn dataplane(&self, env: &[(&str, &str)]) -> (Running, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut map: std::collections::HashMap<String, String> = [
            ("NM_CONTROLPLANE_URL", self.url.as_str()),
            ("NM_LINK_SECRET", LINK_SECRET),
            ("NM_HTTP_ADDR", "127.0.0.1:0"),
            ("NM_SHUTDOWN_GRACE_SECS", "5"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        map.insert(
            "NM_SPOOL_DIR".into(),
            dir.path().join("spool").display().to_string(),
        );
        for (k, v) in env {
            map.insert((*k).to_owned(), (*v).to_owned());
        }
        let settings = config::resolve(
            Mode::Dataplane,
            &Flags::default(),
            &map,
            FileSettings::default(),
        )
        .unwrap_or_else(|e| panic!("dataplane settings: {e}"));
        let dp = app::start_dataplane(&settings)
            .await
            .unwrap_or_else(|e| panic!("dataplane: {e:#}"));
        let http = dp.http_addr.unwrap_or_else(|| panic!("no http address"));
        let client = super::http::client();
        super::eventually(Duration::from_secs(10), "dataplane healthy", || async {
            let url = format!("http://{http}/health");
            let a = super::http::read(
                super::http::send(
                    &client,
                    super::http::request("GET", &url, &[], bytes::Bytes::new()),
                )
                .await,
            )
            .await;
            (a.status == 200).then_some(())
        })
        .await;
        (dp, dir)
    }
}

fn snapshot(version: u64, experiments: Vec<Live>) -> link_pb::KeySnapshot {
    let verifier = VerifierKey::from_link_secret(LINK_SECRET);
    nm_types::link::key_verifiers_to_pb(KeyVerifiers {
        version,
        keys: vec![VerifiedKey {
            id: "stub-key".to_owned(),
            verifier: verifier.of_secret(STUB_KEY),
            role: Role::Service,
            scope: None,
            expires_at_ms: None,
        }],
        write_problem: None,
        experiments,
    })
}

#[tonic::async_trait]
impl Link for Service {
    type WatchKeysStream = Stream_<link_pb::KeySnapshot>;
    type WatchBudgetsStream = Stream_<link_pb::BudgetFeed>;

    async fn watch_keys(
        &self,
        _: Request<link_pb::WatchKeysRequest>,
    ) -> Result<Response<Self::WatchKeysStream>, Status> {
        // A snapshot at once, on every change, and every second as the heartbeat.
        let mut rx = self.experiments.clone();
        let (tx, out) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut version = 0;
            loop {
                version += 1;
                let current = rx.borrow_and_update().clone();
                if tx.send(Ok(snapshot(version, current))).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn watch_budgets(
        &self,
        _: Request<link_pb::WatchBudgetsRequest>,
    ) -> Result<Response<Self::WatchBudgetsStream>, Status> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let day = nm_types::budget::day_of(now_ms);
        let feed = move |full| {
            nm_types::link::feed_to_pb(Feed {
                epoch: 1,
                seq: 0,
                full,
                default: None,
                overrides: Vec::new(),
                spend: Vec::new(),
                day,
                month: nm_types::budget::month_of_day(day),
                ..Default::default()
            })
        };
        let first = tokio_stream::once(Ok(feed(true)));
        let beats = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            Duration::from_secs(1),
        ))
        .map(move |_| Ok(feed(false)));
        Ok(Response::new(Box::pin(first.chain(beats))))
    }

    async fn ingest_requests(
        &self,
        req: Request<link_pb::IngestRequestsRequest>,
    ) -> Result<Response<link_pb::IngestRequestsResponse>, Status> {
        let mut rejected = Vec::new();
        let mut stored = 0;
        for (i, r) in req.into_inner().records.into_iter().enumerate() {
            match nm_types::link::record_from_pb(r) {
                Ok(record) => {
                    stored += 1;
                    self.records
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(record);
                }
                Err(why) => rejected.push(link_pb::RejectedRecord {
                    index: i as u32,
                    reason: why.to_owned(),
                }),
            }
        }
        Ok(Response::new(link_pb::IngestRequestsResponse {
            stored,
            epoch: 1,
            seq: 0,
            rejected,
        }))
    }

    async fn record_signal(
        &self,
        _: Request<link_pb::RecordSignalRequest>,
    ) -> Result<Response<link_pb::RecordSignalResponse>, Status> {
        Err(Status::unimplemented("the stub stores no signals"))
    }

    /// The stub has no budgets: nothing to lease.
    async fn lease(
        &self,
        _: Request<link_pb::LeaseRequest>,
    ) -> Result<Response<link_pb::LeaseResponse>, Status> {
        Ok(Response::new(link_pb::LeaseResponse::default()))
    }
}
