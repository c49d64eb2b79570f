//! `nm-signal-bench`: how many signals per second the gateway acknowledges — each one committed
//! to the database before `{"ok": true}` — and how long one takes.
//!
//! `cargo build --profile dist -p nm-gateway -p nm-bench --bin nm-gateway --bin nm-signal-bench &&
//! target/dist/nm-signal-bench`
//!
//! For each database (SQLite on a temporary file; PostgreSQL in a fresh database on the server
//! named by `--postgres`, skipped with a notice when it cannot be reached) it starts the real
//! `nm-gateway serve` from the same target directory, then `--clients` (default 64) concurrent
//! clients, each on its own keep-alive HTTP/1.1 connection, send `POST /v1/signal` back to back
//! for `--duration` (default 10 s) after `--warmup` (default 2 s): every action over many
//! sessions. It reports acknowledged signals per second, errors, latency p50/p90/p99/max, and
//! checks through the admin CLI that the stored count equals the acknowledged count. Targets on
//! a 2-core machine: >= 3,000 signals/s on SQLite with p99 < 50 ms (printed as PASS/FAIL; the exit
//! status is 0 unless the bench itself broke).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use nm_types::Action;
use sea_orm::{ConnectionTrait, Database};

const KEY: &str = "nmk_e7c3a9f1b5d2e8c4a6f0b2d9e1c7a3f5b8d0e2c4a6f1b3d9";

#[derive(Debug, Parser)]
#[command(about = "Signals acknowledged per second, and their latency, on SQLite and PostgreSQL")]
struct Cli {
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Measured seconds.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Warm-up seconds (not measured).
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// PostgreSQL server (a fresh database is created on it); `none` to skip.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    postgres: String,
}

struct Gateway {
    child: Child,
    http: SocketAddr,
    grpc: SocketAddr,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn gateway_bin() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("nm-gateway");
    if !bin.exists() {
        bail!(
            "{} not found: build it first (cargo build --profile dist -p nm-gateway)",
            bin.display()
        );
    }
    Ok(bin)
}

async fn start(db_url: &str, dir: &Path) -> anyhow::Result<Gateway> {
    let (http, grpc) = (free_port()?, free_port()?);
    let child = Command::new(gateway_bin()?)
        .arg("serve")
        .current_dir(dir)
        .env("NM_HTTP_ADDR", format!("127.0.0.1:{http}"))
        .env("NM_GRPC_ADDR", format!("127.0.0.1:{grpc}"))
        .env("NM_DATABASE_URL", db_url)
        .env("NM_BOOTSTRAP_KEY", KEY)
        .env("NM_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting nm-gateway")?;
    let gw = Gateway {
        child,
        http: ([127, 0, 0, 1], http).into(),
        grpc: ([127, 0, 0, 1], grpc).into(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = connect(gw.http).await
            && let Ok(r) = s
                .send_request(Request::get("/health").body(Full::new(Bytes::new()))?)
                .await
            && r.status() == 200
        {
            return Ok(gw);
        }
        if Instant::now() > deadline {
            bail!("the gateway did not become healthy within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> anyhow::Result<Sender> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

#[derive(Default)]
struct Tally {
    /// Acknowledged in the measured window.
    ok: u64,
    /// Acknowledged at any time (warm-up included), to compare with what was stored.
    acked_all: u64,
    errors: u64,
    latencies_us: Vec<u64>,
}

async fn client(
    addr: SocketAddr,
    id: usize,
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Tally> {
    let mut sender = connect(addr).await?;
    let mut tally = Tally::default();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let action = Action::ALL[n % Action::ALL.len()];
        let body = if action.requires_edit_distance() {
            format!(
                r#"{{"session_id":"sess_b{id}_{}","action":"{action}","edit_distance":{n}}}"#,
                n % 50
            )
        } else {
            format!(
                r#"{{"session_id":"sess_b{id}_{}","action":"{action}"}}"#,
                n % 50
            )
        };
        let req = Request::post("/v1/signal")
            .header("host", "bench")
            .header("nm-key", KEY)
            .header("nm-agent", format!("bench-{}", id % 4))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let started = Instant::now();
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        let took = started.elapsed();
        let acked = status == 200 && body.as_ref() == br#"{"ok":true}"#;
        tally.acked_all += u64::from(acked);
        if measuring.load(Ordering::Relaxed) {
            if acked {
                tally.ok += 1;
                tally
                    .latencies_us
                    .push(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
            } else {
                tally.errors += 1;
            }
        }
    }
    Ok(tally)
}

struct Result {
    database: &'static str,
    acked: u64,
    acked_all: u64,
    errors: u64,
    per_sec: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    stored: Option<u64>,
}

async fn run(
    cli: &Cli,
    database: &'static str,
    db_url: &str,
    dir: &Path,
) -> anyhow::Result<Result> {
    let gw = start(db_url, dir).await?;
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..cli.clients)
        .map(|i| tokio::spawn(client(gw.http, i, measuring.clone(), stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(cli.warmup)).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(cli.duration)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut all = Tally::default();
    for t in tasks {
        let t = t.await??;
        all.ok += t.ok;
        all.errors += t.errors;
        all.acked_all += t.acked_all;
        all.latencies_us.extend(t.latencies_us);
    }
    all.latencies_us.sort_unstable();
    let pct = |p: f64| {
        let v = &all.latencies_us;
        if v.is_empty() {
            return 0.0;
        }
        let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
        v[i] as f64 / 1000.0
    };
    let stored = stored_total(&gw).ok();
    Ok(Result {
        database,
        acked: all.ok,
        acked_all: all.acked_all,
        errors: all.errors,
        per_sec: all.ok as f64 / elapsed.as_secs_f64(),
        p50: pct(0.50),
        p90: pct(0.90),
        p99: pct(0.99),
        max: pct(1.0),
        stored,
    })
}

/// Signals stored, summed over the bench agents, read back through the admin CLI.
fn stored_total(gw: &Gateway) -> anyhow::Result<u64> {
    let out = Command::new(gateway_bin()?)
        .args(["agents", "list", "--json"])
        .env("NM_CONTROLPLANE_URL", format!("http://{}", gw.grpc))
        .env("NM_ADMIN_KEY", KEY)
        .output()?;
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(rows
        .as_array()
        .map_or(0, |a| a.iter().filter_map(|r| r["signals"].as_u64()).sum()))
}

async fn fresh_postgres(base: &str) -> anyhow::Result<String> {
    let name = format!("nm_signal_bench_{}", std::process::id());
    let admin = Database::connect(base).await?;
    admin
        .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name}"))
        .await?;
    admin
        .execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await?;
    admin.close().await?;
    let (prefix, _) = base
        .rsplit_once('/')
        .context("the PostgreSQL URL needs a /DATABASE part")?;
    Ok(format!("{prefix}/{name}"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let dir = std::env::temp_dir().join(format!("nm-signal-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut results = Vec::new();
    let sqlite = format!("sqlite://{}/bench.db?mode=rwc", dir.display());
    results.push(run(&cli, "sqlite", &sqlite, &dir).await?);
    if cli.postgres != "none" {
        match fresh_postgres(&cli.postgres).await {
            Ok(url) => results.push(run(&cli, "postgresql", &url, &dir).await?),
            Err(e) => eprintln!("PostgreSQL skipped ({}): {e}", cli.postgres),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);

    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "signals: {} clients, {} s measured after {} s warm-up, nm-gateway serve",
        cli.clients, cli.duration, cli.warmup
    )?;
    writeln!(
        out,
        "{:<11} {:>10} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>17}",
        "database",
        "signals/s",
        "errors",
        "acked",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "stored/acked(all)"
    )?;
    for r in &results {
        writeln!(
            out,
            "{:<11} {:>10.0} {:>8} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>17}",
            r.database,
            r.per_sec,
            r.errors,
            r.acked,
            r.p50,
            r.p90,
            r.p99,
            r.max,
            format!(
                "{}/{}",
                r.stored.map_or_else(|| "?".to_owned(), |s| s.to_string()),
                r.acked_all
            )
        )?;
    }
    if let Some(s) = results.iter().find(|r| r.database == "sqlite") {
        let pass =
            s.per_sec >= 3000.0 && s.p99 < 50.0 && s.errors == 0 && s.stored == Some(s.acked_all);
        writeln!(
            out,
            "target (sqlite >= 3000 signals/s, p99 < 50 ms, no errors, stored = acknowledged): {}",
            if pass { "PASS" } else { "FAIL" }
        )?;
    }
    Ok(())
}
