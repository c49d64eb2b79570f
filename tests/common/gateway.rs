//! Real gateways for tests, on `127.0.0.1:0` ports: `serve` (both halves in one process) or
//! `split` (controlplane and dataplane started separately, talking gRPC over loopback), on a
//! temporary SQLite file or a fresh PostgreSQL database (from `NM_TEST_POSTGRES_URL`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use nm_controlplane::scratch::ScratchPg;
use nm_gateway::app::{self, Running};
use nm_gateway::config::{self, FileSettings, Flags, Mode};
use sea_orm::Database;

use super::http::{Answer, TestClient, client, read, request, send};

/// The bootstrap admin key every test gateway starts with (of generated strength, as a
/// bootstrap key must be).
pub const ADMIN_KEY: &str = "nmk_3f9c2a71d4e85b60a1c7e93d2f4b8a06c5e1d7f92b3a4c68";

/// The link secret of every test gateway's halves.
pub const LINK_SECRET: &str = "lnk_8e2d4f6a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    Sqlite,
    Postgres,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Serve,
    Split,
    /// Split, with the link over mutual TLS (certificates made for the test).
    SplitTls,
}

impl Shape {
    /// Whether the controlplane is a process of its own.
    pub fn is_split(self) -> bool {
        self != Shape::Serve
    }
}

#[derive(Debug)]
pub struct Builder {
    env: HashMap<String, String>,
    file: FileSettings,
    db: Db,
    shape: Shape,
}

impl Builder {
    /// Sets a setting as if it came from the environment.
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.insert(k.to_owned(), v.to_owned());
        self
    }

    /// Points a provider at a mock.
    pub fn upstream(self, provider: &str, url: &str) -> Self {
        self.env(
            &format!("NM_UPSTREAM_{}", provider.to_ascii_uppercase()),
            url,
        )
    }

    /// Settings as if from a `--config` TOML file.
    pub fn config_toml(mut self, text: &str) -> Self {
        self.file = toml::from_str(text).unwrap_or_else(|e| panic!("test config: {e}"));
        self
    }

    pub fn db(mut self, db: Db) -> Self {
        self.db = db;
        self
    }

    pub fn shape(mut self, shape: Shape) -> Self {
        self.shape = shape;
        self
    }

    /// Starts a gateway on SQLite (or any database that is always there) and waits until it is
    /// healthy.
    pub async fn run(self) -> TestGateway {
        match self.start().await {
            Some(gw) => gw,
            None => panic!("no database for this test gateway"),
        }
    }

    /// Starts the gateway and waits until `/health` is 200 (the dataplane has its keys).
    /// Returns `None` only for PostgreSQL when `NM_TEST_POSTGRES_URL` is not set.
    pub async fn start(self) -> Option<TestGateway> {
        let gw = self.start_unready().await?;
        gw.wait_healthy().await;
        Some(gw)
    }

    /// Starts the gateway without waiting for it to become ready (for tests of readiness).
    pub async fn start_unready(mut self) -> Option<TestGateway> {
        // NM_TEST_LOG=debug shows the gateways' logs (with --nocapture).
        if let Ok(filter) = std::env::var("NM_TEST_LOG") {
            let _ = nm_gateway::telemetry::init(&filter, nm_gateway::config::LogFormat::Text);
        }
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let db_url = match self.db {
            Db::Sqlite => format!("sqlite://{}/nm.db?mode=rwc", dir.path().display()),
            Db::Postgres => fresh_postgres_db().await?,
        };
        // A test may name its own database (a file on a small disk, say).
        let db_url = self
            .env
            .entry("NM_DATABASE_URL".into())
            .or_insert(db_url)
            .clone();
        self.env
            .entry("NM_BOOTSTRAP_KEY".into())
            .or_insert(ADMIN_KEY.into());
        self.env
            .entry("NM_HTTP_ADDR".into())
            .or_insert("127.0.0.1:0".into());
        self.env
            .entry("NM_GRPC_ADDR".into())
            .or_insert("127.0.0.1:0".into());
        // Many gateways run at once on this machine: the web page only where a test asks.
        self.env.entry("NM_UI_ADDR".into()).or_insert("off".into());
        self.env
            .entry("NM_SHUTDOWN_GRACE_SECS".into())
            .or_insert("5".into());
        self.env
            .entry("NM_SPOOL_DIR".into())
            .or_insert(dir.path().join("spool").display().to_string());
        // Serve needs none for itself; with it, further dataplanes can join (add_dataplane).
        self.env
            .entry("NM_LINK_SECRET".into())
            .or_insert(LINK_SECRET.into());
        let pki = (self.shape == Shape::SplitTls).then(|| super::pki::Pki::create(dir.path()));
        if let Some(pki) = &pki {
            // What a test set itself wins (e.g. an empty NM_GRPC_TLS_CLIENT_CA: TLS, no mTLS).
            for (k, v) in pki.server_env(true).into_iter().chain(pki.client_env()) {
                self.env.entry(k.to_owned()).or_insert(v);
            }
        }
        let scheme = if pki.is_some() { "https" } else { "http" };
        let file = self.file.clone();
        let settings = |mode, env: &HashMap<String, String>| {
            config::resolve(mode, &Flags::default(), env, file.clone())
                .unwrap_or_else(|e| panic!("test settings: {e}"))
        };
        let cp_settings = settings(Mode::Controlplane, &self.env);
        let cp_url = |grpc: SocketAddr| match pki {
            // The certificate names localhost.
            Some(_) => format!("https://localhost:{}", grpc.port()),
            None => format!("{scheme}://{grpc}"),
        };
        let started = match self.shape {
            Shape::Serve => vec![app::start_serve(&settings(Mode::Serve, &self.env)).await],
            Shape::Split | Shape::SplitTls => {
                let cp = app::start_controlplane(&cp_settings).await;
                let grpc = cp.as_ref().ok().and_then(|r| r.grpc_addr);
                let mut env = self.env.clone();
                env.insert(
                    "NM_CONTROLPLANE_URL".into(),
                    grpc.map(cp_url).unwrap_or_default(),
                );
                let dp = app::start_dataplane(&settings(Mode::Dataplane, &env)).await;
                vec![cp, dp]
            }
        };
        let running: Vec<Running> = started
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("start: {e:#}")))
            .collect();
        let http = running
            .iter()
            .find_map(|r| r.http_addr)
            .unwrap_or_else(|| panic!("no dataplane"));
        let grpc = running
            .iter()
            .find_map(|r| r.grpc_addr)
            .unwrap_or_else(|| panic!("no controlplane"));
        let ui = running.iter().find_map(|r| r.ui_addr);
        let mut dp_env = self.env.clone();
        dp_env.insert("NM_CONTROLPLANE_URL".into(), cp_url(grpc));
        dp_env
            .entry("NM_LINK_SECRET".into())
            .or_insert(LINK_SECRET.into());
        let dp_settings = settings(Mode::Dataplane, &dp_env);
        let gw = TestGateway {
            http,
            grpc,
            ui,
            db_url,
            db: self.db,
            shape: self.shape,
            cp_settings,
            dp_settings,
            extra: Vec::new(),
            running,
            client: client(),
            _dir: dir,
        };
        Some(gw)
    }
}

/// A gRPC request carrying `key` in `nm-key` metadata.
pub fn with_key<T>(key: &str, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(v) = key.parse::<tonic::metadata::MetadataValue<_>>() {
        req.metadata_mut().insert("nm-key", v);
    }
    req
}

/// A gRPC request carrying the test admin key.
pub fn admin<T>(msg: T) -> tonic::Request<T> {
    with_key(ADMIN_KEY, msg)
}

/// A fresh, empty PostgreSQL database, or `None` (with a notice) when no server is configured.
pub async fn fresh_postgres_db() -> Option<String> {
    Some(ScratchPg::for_tests().await?.url)
}

/// A started gateway. Call [`TestGateway::stop`] at the end of a test to drain it.
#[derive(Debug)]
pub struct TestGateway {
    pub http: SocketAddr,
    pub grpc: SocketAddr,
    /// The web page's address, when the test set `NM_UI_ADDR` (default here: off).
    pub ui: Option<SocketAddr>,
    pub db_url: String,
    pub db: Db,
    pub shape: Shape,
    cp_settings: nm_gateway::config::Settings,
    /// Settings a (further) dataplane of this gateway starts with.
    dp_settings: nm_gateway::config::Settings,
    /// Dataplanes started by [`TestGateway::add_dataplane`].
    extra: Vec<Running>,
    running: Vec<Running>,
    client: TestClient,
    _dir: tempfile::TempDir,
}

impl TestGateway {
    pub fn builder() -> Builder {
        Builder {
            env: HashMap::new(),
            file: FileSettings::default(),
            db: Db::Sqlite,
            shape: Shape::Serve,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// The controlplane's URL, as its dataplanes and the CLI use it.
    pub fn grpc_url(&self) -> String {
        self.dp_settings.controlplane_url.clone()
    }

    /// Settings a dataplane of this gateway starts with (its link secret, its TLS).
    pub fn dataplane_settings(&self) -> &nm_gateway::config::Settings {
        &self.dp_settings
    }

    /// A connected gRPC channel to the controlplane (over TLS, with the dataplane's client
    /// certificate, in the TLS shape).
    pub async fn grpc_channel(&self) -> tonic::transport::Channel {
        let url = self.grpc_url();
        let channel = nm_gateway::grpc::channel(&url, &self.dp_settings.controlplane_tls)
            .unwrap_or_else(|e| panic!("{e}"));
        // A lazy channel: make one call's worth of connection now, so a test fails here when
        // the controlplane cannot be reached.
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap_or_else(|e| panic!("controlplane connect {url}: {e}"));
        channel
    }

    pub async fn wait_healthy(&self) {
        super::eventually(Duration::from_secs(10), "gateway /health 200", || async {
            let a = self.get("/health").await;
            (a.status == 200).then_some(())
        })
        .await;
    }

    pub async fn get(&self, path: &str) -> Answer {
        read(
            send(
                &self.client,
                request("GET", &self.url(path), &[], Bytes::new()),
            )
            .await,
        )
        .await
    }

    /// POSTs with the admin key as `NM-Key` plus `headers`.
    pub async fn post(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        let mut h = vec![("nm-key", ADMIN_KEY)];
        h.extend_from_slice(headers);
        self.raw("POST", path, &h, body).await
    }

    /// A minimal OpenAI chat request (`gpt-4o-mini`) with the admin key plus `headers`.
    pub async fn chat(&self, headers: &[(&str, &str)]) -> Answer {
        self.post(
            "/openai/v1/chat/completions",
            headers,
            r#"{"model":"gpt-4o-mini"}"#,
        )
        .await
    }

    /// Any request, exactly as given (no key added).
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        read(self.send(method, path, headers, body).await).await
    }

    /// Sends and returns the response with its body unread (for streaming tests).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> hyper::Response<hyper::body::Incoming> {
        send(
            &self.client,
            request(method, &self.url(path), headers, body),
        )
        .await
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> hyper::Request<Full<Bytes>> {
        request(method, &self.url(path), headers, body)
    }

    /// A connection to the controlplane's database (for checking what was stored).
    pub async fn database(&self) -> sea_orm::DatabaseConnection {
        Database::connect(&self.db_url)
            .await
            .unwrap_or_else(|e| panic!("test db connect: {e}"))
    }

    /// The `n` column of the one row `sql` selects (a `SELECT COUNT(*) AS n ...`).
    pub async fn count(&self, sql: &str) -> i64 {
        use sea_orm::{ConnectionTrait, Statement};
        let db = self.database().await;
        let backend = db.get_database_backend();
        let row = db
            .query_one_raw(Statement::from_string(backend, sql.to_owned()))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .unwrap_or_else(|| panic!("{sql}: no row"));
        let n: i64 = row.try_get("", "n").unwrap_or_else(|e| panic!("{e}"));
        let _ = db.close().await;
        n
    }

    /// Waits (up to 15 s) until exactly one stored request record matches `condition` (SQL).
    pub async fn one_request_where(&self, condition: &str) {
        let sql = format!("SELECT COUNT(*) AS n FROM requests WHERE {condition}");
        crate::common::eventually(Duration::from_secs(15), &sql, || async {
            (self.count(&sql).await == 1).then_some(())
        })
        .await;
    }

    /// Split shape: stops the controlplane only.
    pub async fn stop_controlplane(&mut self) {
        assert!(
            self.shape.is_split(),
            "only a split gateway has a separate controlplane"
        );
        let cp = self.running.remove(0);
        cp.stop()
            .await
            .unwrap_or_else(|e| panic!("controlplane stop: {e:#}"));
    }

    /// Split shape: starts a controlplane again on the same address and database.
    pub async fn restart_controlplane(&mut self) {
        assert!(
            self.shape.is_split(),
            "only a split gateway has a separate controlplane"
        );
        let mut settings = self.cp_settings.clone();
        settings.grpc_addr = self.grpc;
        let cp = app::start_controlplane(&settings)
            .await
            .unwrap_or_else(|e| panic!("controlplane restart: {e:#}"));
        self.running.insert(0, cp);
    }

    /// Starts another dataplane against the same controlplane, with its own spool directory;
    /// returns its HTTP address (use [`TestGateway::raw_at`]).
    pub async fn add_dataplane(&mut self) -> SocketAddr {
        let mut settings = self.dp_settings.clone();
        settings.spool_dir = self
            ._dir
            .path()
            .join(format!("spool-extra-{}", self.extra.len()));
        let dp = app::start_dataplane(&settings)
            .await
            .unwrap_or_else(|e| panic!("extra dataplane: {e:#}"));
        let http = dp.http_addr.unwrap_or_else(|| panic!("no http address"));
        self.extra.push(dp);
        super::eventually(
            Duration::from_secs(10),
            "extra dataplane healthy",
            || async {
                let a = self.raw_at(http, "GET", "/health", &[], "").await;
                (a.status == 200).then_some(())
            },
        )
        .await;
        http
    }

    /// Split shape: stops every dataplane, the added ones first (each drains and, with the
    /// controlplane away, spools what it could not deliver); returns their spool directories,
    /// the first dataplane's first, which stay.
    pub async fn stop_dataplanes(&mut self) -> Vec<std::path::PathBuf> {
        let mut dirs = vec![self.dp_settings.spool_dir.clone()];
        dirs.extend(
            (0..self.extra.len()).map(|i| self._dir.path().join(format!("spool-extra-{i}"))),
        );
        while let Some(r) = self.extra.pop() {
            r.stop()
                .await
                .unwrap_or_else(|e| panic!("extra dataplane stop: {e:#}"));
        }
        self.stop_dataplane().await;
        dirs
    }

    /// Split shape: stops the dataplane (it drains and, with the controlplane away, spools what
    /// it could not deliver) and starts a new one with the same settings and spool directory.
    /// Returns once the new one is listening (not necessarily healthy).
    pub async fn restart_dataplane(&mut self) {
        assert!(
            self.shape.is_split(),
            "only a split gateway has a separate dataplane"
        );
        self.stop_dataplane().await;
        self.start_dataplane().await;
    }

    /// Split shape: stops the dataplane (it drains, and spools what it could not deliver).
    pub async fn stop_dataplane(&mut self) {
        assert!(
            self.shape.is_split(),
            "only a split gateway has a separate dataplane"
        );
        let dp = self.running.pop().unwrap_or_else(|| panic!("no dataplane"));
        dp.stop()
            .await
            .unwrap_or_else(|e| panic!("dataplane stop: {e:#}"));
    }

    /// Split shape: starts the dataplane again with the same settings, address and spool.
    /// Returns once it is listening (not necessarily healthy).
    pub async fn start_dataplane(&mut self) {
        let mut settings = self.dp_settings.clone();
        settings.http_addr = self.http;
        let dp = app::start_dataplane(&settings)
            .await
            .unwrap_or_else(|e| panic!("dataplane restart: {e:#}"));
        self.running.push(dp);
    }

    /// Any request to the dataplane at `http`, exactly as given.
    pub async fn raw_at(
        &self,
        http: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        let url = format!("http://{http}{path}");
        read(send(&self.client, request(method, &url, headers, body)).await).await
    }

    /// Drains and stops everything (dataplanes first).
    pub async fn stop(mut self) {
        while let Some(r) = self.extra.pop() {
            if let Err(e) = r.stop().await {
                panic!("extra dataplane stopped with an error: {e:#}");
            }
        }
        while let Some(r) = self.running.pop() {
            if let Err(e) = r.stop().await {
                panic!("gateway stopped with an error: {e:#}");
            }
        }
        if self.db == Db::Postgres {
            drop_postgres_db(&self.db_url).await;
        }
    }
}

/// Drops a database made by [`fresh_postgres_db`] (best effort).
pub async fn drop_postgres_db(url: &str) {
    nm_controlplane::scratch::drop_test_db(url).await;
}
