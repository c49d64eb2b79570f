//! `nm-bench`: how much latency, throughput and memory the gateway costs, measured against a
//! baseline, and what its usage metering costs. Run it with `cargo build --release --bin
//! nm-gateway && cargo run --release --bin nm-bench` (add `--json` for machine-readable output,
//! `--help` for the durations and rates).
//!
//! Everything runs on 127.0.0.1 with ephemeral ports, each server in its own OS process:
//!
//! - a fast **mock upstream** (`nm-bench mock`, hidden): hyper 1 answering
//!   `POST /v1/chat/completions` with a ~310-byte chat-completion JSON carrying `usage`, or, when
//!   the request JSON has `"stream": true`, an SSE stream that ends like OpenAI's with
//!   `stream_options.include_usage`: 20 content chunks, a `"finish_reason":"stop"` chunk, a
//!   `"choices":[]` chunk with `usage`, and `data: [DONE]`, each its own body frame, no delays.
//!   With the request header `x-bench-unmetered: 1` it sends the same bytes as
//!   `application/octet-stream`, a content type the gateway does not meter;
//! - four **targets** in front of it, measured one after the other: the mock itself
//!   (`direct`), a minimal hyper **forwarder** (`nm-bench forwarder`, hidden: hyper server plus
//!   the `hyper_util` legacy pooled client, streaming bodies through unbuffered), the real
//!   **gateway** (`nm-gateway serve` from the same target directory, on a temporary SQLite
//!   database, requests to `/openai/v1/chat/completions` with `NM-Key`, `NM-Agent` and
//!   `NM-User: bench-user-<n>` over 100 users) and **gateway-unmetered** (the same binary and
//!   setup, its requests marked `x-bench-unmetered: 1`), which isolates the metering cost.
//!   Right after a gateway is healthy the bench sets a generous default end-user budget with
//!   `nm-gateway budgets set --default`, so every request runs the budget path (reservation
//!   and settlement); after its scenarios it reads `nm-gateway usage --json` and
//!   `nm-gateway budgets show bench-user-0 --json`, and fails if the metered gateway recorded
//!   no tokens or no spend, or the unmetered one recorded tokens.
//!
//! For each target, non-streamed and streamed, the built-in load generator (hyper HTTP/1.1
//! client on tokio) runs
//!
//! - a **closed loop**: `--connections` keep-alive connections (default 50) each sending the
//!   next request as soon as the previous response body has been read, for `--duration`
//!   (default 10 s) after `--warmup` (default 2 s); reported as requests/s and errors;
//! - an **open loop**: requests started on a fixed schedule of `--rate` per second (default 500)
//!   for `--latency-duration` (default 10 s) after the warmup, never waiting for earlier
//!   responses (a pool opens as many connections as needed). A dedicated thread keeps the
//!   schedule; a request's latency runs from its *scheduled* send time to the end of its
//!   response body (the whole stream), so a stalled target cannot hide queueing delay.
//!
//! Before each loop the bench waits until the mock and the target are idle (CPU time from
//! `/proc/<pid>/stat`), so work left from the previous loop (the gateway's request records, say)
//! is not measured in the next one.
//!
//! Every response must be 200 with exactly the mock's body bytes; anything else is an error.
//! The report gives a table per scenario, the latency the forwarder and the gateways add over
//! `direct`, the metering cost (gateway against gateway-unmetered), the ratios against the
//! targets (gateway added p50 <= 1.5 x forwarder added p50; gateway throughput >= 0.75 x
//! forwarder throughput; gateway throughput >= 0.90 x gateway-unmetered throughput), the
//! gateways' peak (VmHWM) and current (VmRSS) resident memory from `/proc` after their runs
//! (target: gateway peak < 64 MiB), and the usage each gateway recorded.
//! With `--rounds N` the whole sequence runs N times (odd rounds in reverse order) and every
//! figure is the median over the rounds, which steadies the ratios on a noisy VM.
//! PASS/FAIL lines are information (N/A when the forwarder added under 0.01 ms, leaving the
//! ratio to noise): the exit status is 0 unless the bench itself broke.
//!
//! All processes share the machine's CPUs, so absolute numbers depend on the host; the
//! comparisons are the point. The CPU time a hypervisor took during each target's run (steal,
//! `/proc/stat`) is reported, since on a shared VM it is the main noise. Child processes are
//! killed at the end, on error and on Ctrl-C; the helpers also exit when the bench's end of
//! their stdin pipe closes.

use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail, ensure};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Body, Frame, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

const BOOTSTRAP_KEY: &str = "nmk_5d8a1f3c7e9b2d4f6a8c0e1b3d5f7a9c2e4b6d8f0a1c3e57";
/// Content chunks in the streamed answer (a finish chunk, a usage chunk and `[DONE]` follow).
const STREAM_CHUNKS: usize = 20;
/// End users the gateway requests are spread over (`NM-User: bench-user-<n % USERS>`).
const USERS: usize = 100;
/// With this request header set to `1` the mock answers `application/octet-stream`, a content
/// type the gateway forwards without metering.
const UNMETERED_HEADER: &str = "x-bench-unmetered";
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const KIB_PER_MIB: f64 = 1024.0;
// Targets from the brief.
const MAX_ADDED_P50_RATIO: f64 = 1.5;
const MIN_THROUGHPUT_RATIO: f64 = 0.75;
/// Metering may cost at most 10% of the gateway's throughput.
const MIN_METERED_THROUGHPUT_RATIO: f64 = 0.90;
const MAX_PEAK_RSS_MIB: f64 = 64.0;
/// A forwarder added p50 below this (ms) leaves the latency ratio to noise: the check is N/A.
const MIN_ADDED_MS: f64 = 0.01;
/// How long each target's turn lasts in the alternating open loops.
const SLICE: Duration = Duration::from_millis(500);
/// How long each target's turn lasts, at most, in the alternating closed loops: long enough that
/// the records a gateway stores after its turn ends (one linger and one batch, left out of every
/// turn's figures) stay a small part of what it stores during the turn.
const CLOSED_SLICE: Duration = Duration::from_secs(2);
/// Warmup of a closed-loop turn after the first (its connections are new).
const CLOSED_SLICE_WARMUP: Duration = Duration::from_millis(250);

#[derive(Debug, Parser)]
#[command(
    name = "nm-bench",
    about = "Measures nm-gateway (metered and unmetered) against a mock upstream and a minimal hyper forwarder"
)]
struct Cli {
    #[command(subcommand)]
    helper: Option<Helper>,
    /// Closed-loop measurement time per target and scenario in each round, in seconds.
    #[arg(long, default_value = "3", value_parser = secs)]
    duration: Duration,
    /// Warmup of each target before its first closed-loop and open-loop turn, in seconds.
    #[arg(long, default_value = "1", value_parser = secs)]
    warmup: Duration,
    /// Closed-loop keep-alive connections.
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Open-loop request rate, per second.
    #[arg(long, default_value_t = 500.0)]
    rate: f64,
    /// Open-loop measurement time per target and scenario in each round, in seconds.
    #[arg(long, default_value = "5", value_parser = secs)]
    latency_duration: Duration,
    /// Rounds of the whole sequence of targets; each figure reported is the median over the
    /// rounds (memory: the highest), and each round's ratios are printed as it ends. The checks
    /// judge the median of the rounds' own ratios (gateway against the forwarder of the same
    /// round), so drift in the machine's speed between rounds cancels out. Odd rounds run the
    /// targets in reverse order, so slow drift within a round does not favour one target.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    rounds: u32,
    /// Print the results as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// The nm-gateway binary (default: next to this one).
    #[arg(long, value_name = "PATH")]
    gateway_bin: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Helper {
    /// The mock upstream (run by the bench itself).
    #[command(hide = true)]
    Mock {
        #[arg(long)]
        port_file: PathBuf,
    },
    /// The baseline forwarder (run by the bench itself).
    #[command(hide = true)]
    Forwarder {
        #[arg(long)]
        upstream: SocketAddr,
        #[arg(long)]
        port_file: PathBuf,
    },
    /// Loads one target that is already running with the bench's requests and prints the
    /// figures: open loop at `--rate` for `--latency-duration`, or with `--closed` a closed loop
    /// of `--connections` for `--duration` (to profile one process alone).
    #[command(hide = true)]
    Load {
        #[arg(long)]
        addr: SocketAddr,
        /// direct, forwarder, gateway or gateway-unmetered: which path and headers to send.
        #[arg(long, value_parser = Target::from_name)]
        target: Target,
        #[arg(long)]
        stream: bool,
        #[arg(long)]
        closed: bool,
    },
}

fn secs(s: &str) -> Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .and_then(|v| Duration::try_from_secs_f64(v).ok())
        .ok_or_else(|| format!("{s:?} is not a number of seconds"))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match &cli.helper {
        Some(Helper::Mock { port_file }) => {
            exit_with_parent();
            runtime.block_on(mock_server(port_file))
        }
        Some(Helper::Forwarder {
            upstream,
            port_file,
        }) => {
            exit_with_parent();
            runtime.block_on(forwarder(*upstream, port_file))
        }
        Some(Helper::Load {
            addr,
            target,
            stream,
            closed,
        }) => runtime.block_on(load(&cli, *target, *addr, *stream, *closed)),
        None => runtime.block_on(async {
            tokio::select! {
                r = bench(&cli) => r,
                _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
            }
        }),
    }
}

// === the mock upstream ===

type MockBody = BoxBody<Bytes, Infallible>;

/// The mock's canned answers, also used to check every response the load generator reads.
struct Canned {
    json: Bytes,
    chunks: Vec<Bytes>,
}

impl Canned {
    fn new() -> Self {
        let json = Bytes::from_static(
            br#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hello from the nm-bench mock upstream. This reply is canned."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":13,"total_tokens":25}}"#,
        );
        let mut chunks: Vec<Bytes> = (0..STREAM_CHUNKS)
            .map(|i| {
                Bytes::from(format!(
                    "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i:02} \"}},\"finish_reason\":null}}]}}\n\n"
                ))
            })
            .collect();
        // The end of an OpenAI stream with `stream_options.include_usage`.
        let tail = [
            r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":20,"total_tokens":32}}"#,
            "[DONE]",
        ];
        chunks.extend(tail.map(|data| Bytes::from(format!("data: {data}\n\n"))));
        Self { json, chunks }
    }

    fn len(&self, stream: bool) -> usize {
        if stream {
            self.chunks.iter().map(Bytes::len).sum()
        } else {
            self.json.len()
        }
    }
}

async fn mock_server(port_file: &Path) -> anyhow::Result<()> {
    let canned = Arc::new(Canned::new());
    let listener = announce(port_file).await?;
    serve(listener, move |req| {
        let canned = canned.clone();
        async move { Ok::<_, Infallible>(mock_reply(req, &canned).await) }
    })
    .await
}

async fn mock_reply(req: Request<Incoming>, canned: &Canned) -> Response<MockBody> {
    if req.method() != Method::POST || req.uri().path() != "/v1/chat/completions" {
        return status_reply(StatusCode::NOT_FOUND, "no such route");
    }
    let unmetered = req
        .headers()
        .get(UNMETERED_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1");
    let Ok(body) = req.into_body().collect().await else {
        return status_reply(StatusCode::BAD_REQUEST, "unreadable body");
    };
    let stream = serde_json::from_slice::<Value>(&body.to_bytes())
        .ok()
        .and_then(|v| v.get("stream").and_then(Value::as_bool))
        .unwrap_or(false);
    let (content_type, body) = if stream {
        // One body frame per chunk (so chunked transfer), all ready at once.
        let frames = canned
            .chunks
            .clone()
            .into_iter()
            .map(|c| Ok(Frame::data(c)));
        (
            "text/event-stream",
            StreamBody::new(tokio_stream::iter(frames)).boxed(),
        )
    } else {
        ("application/json", Full::new(canned.json.clone()).boxed())
    };
    let content_type = if unmetered {
        "application/octet-stream"
    } else {
        content_type
    };
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn status_reply(status: StatusCode, msg: &'static str) -> Response<MockBody> {
    let mut resp = Response::new(Full::new(Bytes::from_static(msg.as_bytes())).boxed());
    *resp.status_mut() = status;
    resp
}

// === the baseline forwarder ===

type Forwarded = Either<Incoming, Full<Bytes>>;

async fn forwarder(upstream: SocketAddr, port_file: &Path) -> anyhow::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    let listener = announce(port_file).await?;
    serve(listener, move |req| {
        let client = client.clone();
        async move { Ok::<_, Infallible>(forward(&client, upstream, req).await) }
    })
    .await
}

/// Method, path, headers and body go to the upstream; its response streams back as it comes.
async fn forward(
    client: &Client<HttpConnector, Incoming>,
    upstream: SocketAddr,
    req: Request<Incoming>,
) -> Response<Forwarded> {
    let (mut parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    parts.uri = match format!("http://{upstream}{pq}").parse::<Uri>() {
        Ok(uri) => uri,
        Err(e) => return bad_gateway(e),
    };
    parts.headers.remove(header::HOST);
    parts.headers.remove(header::CONNECTION);
    match client.request(Request::from_parts(parts, body)).await {
        Ok(resp) => resp.map(Either::Left),
        Err(e) => bad_gateway(e),
    }
}

fn bad_gateway(e: impl std::fmt::Display) -> Response<Forwarded> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(e.to_string()))));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp
}

// === helper-process plumbing ===

/// Binds an ephemeral loopback port and tells the bench which (written whole, then renamed).
async fn announce(port_file: &Path) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let tmp = port_file.with_extension("tmp");
    std::fs::write(&tmp, listener.local_addr()?.port().to_string())?;
    std::fs::rename(&tmp, port_file)?;
    Ok(listener)
}

/// HTTP/1.1 server, one task per connection.
async fn serve<F, Fut, B>(listener: TcpListener, handler: F) -> anyhow::Result<()>
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                eprintln!("nm-bench helper: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service_fn(handler))
                .await;
        });
    }
}

/// Helpers exit when their stdin (a pipe from the bench) closes, so they never outlive it.
fn exit_with_parent() {
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
}

/// A child process, killed when dropped.
struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch directory (port files, the gateways' databases and logs), removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
        let dir = std::env::temp_dir().join(format!("nm-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn spawn_helper(dir: &Path, args: &[String]) -> anyhow::Result<Proc> {
    let name = args.first().map_or("helper", String::as_str);
    let port_file = dir.join(format!("{name}.port"));
    let _ = std::fs::remove_file(&port_file);
    let child = Command::new(std::env::current_exe()?)
        .args(args)
        .arg("--port-file")
        .arg(&port_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start the {name} helper"))?;
    let mut proc = Proc {
        child,
        addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(port) = std::fs::read_to_string(&port_file) {
            proc.addr.set_port(port.trim().parse()?);
            return Ok(proc);
        }
        if let Some(status) = proc.child.try_wait()? {
            bail!("the {name} helper exited early ({status})");
        }
        ensure!(Instant::now() < deadline, "the {name} helper did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `nm-gateway` without the caller's `NM_*` settings (the bench passes its own), logging warnings.
fn gateway_command(bin: &Path) -> Command {
    let mut cmd = Command::new(bin);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NM_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("NM_LOG", "warn");
    cmd
}

/// Starts `nm-gateway serve` on its own database, record spool and log (`<name>.db`,
/// `<name>-spool`, `<name>.log`: nothing carries over from another target or run), waits until
/// it is healthy and sets the bench's default end-user budget.
async fn spawn_gateway(
    bin: &Path,
    dir: &Path,
    name: &str,
    mock: SocketAddr,
) -> anyhow::Result<(Proc, Admin)> {
    // Hold both ports while picking, so they differ; the gateway binds them right after.
    let (http, grpc) = {
        let a = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let b = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        (a.local_addr()?, b.local_addr()?)
    };
    let log_path = dir.join(format!("{name}.log"));
    let db = format!("sqlite://{}/{name}.db?mode=rwc", dir.display());
    let mut cmd = gateway_command(bin);
    cmd.arg("serve")
        .env("NM_HTTP_ADDR", http.to_string())
        .env("NM_GRPC_ADDR", grpc.to_string())
        .env("NM_DATABASE_URL", db)
        .env("NM_SPOOL_DIR", dir.join(format!("{name}-spool")))
        .env("NM_BOOTSTRAP_KEY", BOOTSTRAP_KEY)
        .env("NM_UPSTREAM_OPENAI", format!("http://{mock}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?);
    let child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let mut proc = Proc { child, addr: http };
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = proc.child.try_wait()? {
            bail!(
                "nm-gateway exited ({status}) before it was healthy:\n{}",
                log()
            );
        }
        if health_ok(http).await.unwrap_or(false) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "nm-gateway /health did not return 200 within 30 s:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = Admin {
        bin: bin.to_owned(),
        controlplane: format!("http://{grpc}"),
    };
    let budget = [
        "budgets",
        "set",
        "--default",
        "--usd-per-day",
        "1000000",
        "--rpm",
        "1000000",
        "--json",
    ];
    admin
        .run(&budget)
        .await
        .context("cannot set the bench's default end-user budget")?;
    Ok((proc, admin))
}

/// A gateway's admin commands (`nm-gateway budgets|usage`), run against its controlplane with
/// the bench's key.
struct Admin {
    bin: PathBuf,
    controlplane: String,
}

impl Admin {
    /// Runs `nm-gateway <args>`, which must exit 0 and print JSON.
    async fn run(&self, args: &[&str]) -> anyhow::Result<Value> {
        let shown = format!("{} {}", self.bin.display(), args.join(" "));
        let mut cmd = gateway_command(&self.bin);
        cmd.args(args)
            .env("NM_ADMIN_KEY", BOOTSTRAP_KEY)
            .env("NM_CONTROLPLANE_URL", &self.controlplane)
            .stdin(Stdio::null());
        let out = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .output()
            .await
            .with_context(|| format!("cannot run `{shown}`"))?;
        ensure!(
            out.status.success(),
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "`{shown}` printed no JSON: {}",
                String::from_utf8_lossy(&out.stdout).trim()
            )
        })
    }

    /// What the gateway recorded: `nm-gateway usage --json` totals, and the first bench user's
    /// spend from `nm-gateway budgets show`.
    async fn usage(&self) -> anyhow::Result<Usage> {
        let report = self.run(&["usage", "--json"]).await?;
        let mut usage: Usage = serde_json::from_value(report["total"].clone())
            .context("unexpected `nm-gateway usage --json` output")?;
        let user = user_name(0);
        let budget = self.run(&["budgets", "show", &user, "--json"]).await?;
        usage.user0_spent_micros = budget["spent_today_micros"]
            .as_u64()
            .context("unexpected `nm-gateway budgets show --json` output")?;
        Ok(usage)
    }
}

fn user_name(n: usize) -> String {
    format!("bench-user-{}", n % USERS)
}

/// A gateway's usage totals after its run (`nm-gateway usage --json`).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Usage {
    requests: u64,
    input_tokens: u64,
    output_tokens: u64,
    cost_micros: u64,
    /// Requests whose answer carried no usage the gateway read.
    unmetered_requests: u64,
    /// What `bench-user-0` spent today according to its budget: the budget path settled.
    #[serde(default)]
    user0_spent_micros: u64,
}

async fn health_ok(addr: SocketAddr) -> anyhow::Result<bool> {
    let mut sender = connect(addr).await?;
    let req = Request::get("/health")
        .header(header::HOST, addr.to_string())
        .body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    Ok(resp.status() == StatusCode::OK)
}

/// Peak and current resident memory of a process, in KiB.
#[derive(Debug, Clone, Copy, Serialize)]
struct Mem {
    vm_hwm_kib: u64,
    vm_rss_kib: u64,
}

fn memory(pid: u32) -> anyhow::Result<Mem> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        Ok(line.trim().trim_end_matches("kB").trim().parse()?)
    };
    Ok(Mem {
        vm_hwm_kib: field("VmHWM:")?,
        vm_rss_kib: field("VmRSS:")?,
    })
}

/// CPU time (user + system, in clock ticks) a process has used so far.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces): state is 3rd, utime 14th, stime 15th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, f)| f)
        .split_whitespace()
        .collect();
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    tick(11)
        .zip(tick(12))
        .map(|(u, s)| u + s)
        .with_context(|| format!("unreadable /proc/{pid}/stat"))
}

/// Waits (up to 30 s) until the processes are idle: work a loop left behind (the gateway's
/// request records, say) must not land in the next loop's numbers. Returns seconds.
async fn settle(pids: &[u32]) -> anyhow::Result<f64> {
    let start = Instant::now();
    let ticks = || {
        pids.iter()
            .map(|&p| cpu_ticks(p))
            .sum::<anyhow::Result<u64>>()
    };
    let mut before = ticks()?;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = ticks()?;
        // At most 2 ticks (20 ms at the usual 100 Hz) of CPU in 250 ms counts as idle.
        if now - before <= 2 || start.elapsed() > Duration::from_secs(30) {
            return Ok(start.elapsed().as_secs_f64());
        }
        before = now;
    }
}

/// Machine-wide CPU time (ticks) stolen by the hypervisor, and all CPU time, from /proc/stat.
fn cpu_steal() -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let cpu = stat.lines().next().unwrap_or_default().split_whitespace();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let fields = cpu
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<Vec<u64>, _>>()?;
    ensure!(fields.len() == 8, "unreadable /proc/stat");
    Ok((fields[7], fields.iter().sum()))
}

// === the load generator ===

type Sender = SendRequest<Full<Bytes>>;

/// One target and one scenario: what to send and what must come back.
struct Spec {
    addr: SocketAddr,
    path: &'static str,
    /// Headers on every request (the gateway's `NM-Key` and `NM-Agent`, the unmetered mark).
    headers: HeaderMap,
    /// `NM-User` values: request `n` sends `users[n % users.len()]`; none when empty.
    users: Vec<HeaderValue>,
    body: Bytes,
    expected_len: usize,
}

impl Spec {
    /// Request `n`: a closed-loop connection's index, or an open-loop request's.
    fn request(&self, n: usize) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut req = Request::post(self.path)
            .header(header::HOST, self.addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, "Bearer sk-bench")
            .body(Full::new(self.body.clone()))?;
        let headers = req.headers_mut();
        for (name, value) in &self.headers {
            headers.insert(name, value.clone());
        }
        if let Some(user) = self.users.get(n % self.users.len().max(1)) {
            headers.insert("nm-user", user.clone());
        }
        Ok(req)
    }
}

async fn connect(addr: SocketAddr) -> anyhow::Result<Sender> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Sends one request and reads the whole response body.
async fn exchange(sender: &mut Sender, spec: &Spec, n: usize) -> anyhow::Result<()> {
    let attempt = async {
        sender.ready().await?;
        let resp = sender.send_request(spec.request(n)?).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        let mut len = 0;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                len += data.len();
            }
        }
        ensure!(status == StatusCode::OK, "status {status}");
        ensure!(
            len == spec.expected_len,
            "{len}-byte body, expected {}",
            spec.expected_len
        );
        Ok(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err(anyhow!("no complete response within {REQUEST_TIMEOUT:?}")))
}

#[derive(Debug, Default, Serialize)]
struct Closed {
    requests_per_s: f64,
    ok: u64,
    errors: u64,
    first_error: Option<String>,
}

async fn closed_loop(
    spec: &Arc<Spec>,
    connections: usize,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Closed> {
    let measure_from = Instant::now() + warmup;
    let end = measure_from + duration;
    let mut set = tokio::task::JoinSet::new();
    for n in 0..connections {
        let spec = spec.clone();
        set.spawn(async move {
            let mut tally = Closed::default();
            let mut sender: Option<Sender> = None;
            while Instant::now() < end {
                let result = match sender.take() {
                    Some(s) => Ok(s),
                    None => connect(spec.addr).await,
                };
                let result = match result {
                    Ok(mut s) => exchange(&mut s, &spec, n).await.map(|()| sender = Some(s)),
                    Err(e) => Err(e),
                };
                let done = Instant::now();
                let counted = done >= measure_from && done <= end;
                match result {
                    Ok(()) if counted => tally.ok += 1,
                    Ok(()) => {}
                    Err(e) => {
                        if counted {
                            tally.errors += 1;
                            tally.first_error.get_or_insert(format!("{e:#}"));
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            tally
        });
    }
    let mut total = Closed::default();
    while let Some(tally) = set.join_next().await {
        let tally = tally?;
        total.ok += tally.ok;
        total.errors += tally.errors;
        total.first_error = total.first_error.or(tally.first_error);
    }
    total.requests_per_s = total.ok as f64 / duration.as_secs_f64();
    Ok(total)
}

/// Idle keep-alive connections for the open loop; a new one is opened whenever none is idle.
#[derive(Default)]
struct Pool {
    idle: Mutex<Vec<Sender>>,
    opened: AtomicUsize,
}

impl Pool {
    async fn exchange(&self, spec: &Spec, n: usize) -> anyhow::Result<()> {
        let idle = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            std::iter::from_fn(|| idle.pop()).find(|s| !s.is_closed())
        };
        let mut sender = match idle {
            Some(s) => s,
            None => {
                self.opened.fetch_add(1, Ordering::Relaxed);
                connect(spec.addr).await?
            }
        };
        exchange(&mut sender, spec, n).await?;
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sender);
        Ok(())
    }
}

#[derive(Debug, Default, Serialize)]
struct Open {
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    samples: usize,
    errors: u64,
    connections: usize,
    first_error: Option<String>,
    /// How long the processes took to go idle after the closed loop (see [`settle`]).
    settle_s: f64,
}

/// An open loop's latencies and errors, gathered over one or more slices.
#[derive(Default)]
struct Samples {
    latencies: Vec<Duration>,
    errors: u64,
    first_error: Option<String>,
}

impl Samples {
    fn summary(mut self, connections: usize) -> Open {
        let latencies = &mut self.latencies;
        latencies.sort_unstable();
        let pct = |p: f64| -> f64 {
            let n = latencies.len();
            let rank = ((p * n as f64).ceil() as usize).clamp(1, n.max(1));
            latencies.get(rank - 1).map_or(f64::NAN, |d| ms(*d))
        };
        Open {
            p50_ms: pct(0.50),
            p90_ms: pct(0.90),
            p99_ms: pct(0.99),
            max_ms: pct(1.0),
            samples: latencies.len(),
            errors: self.errors,
            connections,
            first_error: self.first_error,
            settle_s: 0.0,
        }
    }
}

/// One target's open loop: `rate` requests per second for `warmup + duration`, latencies of
/// those scheduled after the warmup.
async fn open_loop(
    spec: &Arc<Spec>,
    rate: f64,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Open> {
    let pool = Arc::new(Pool::default());
    let mut samples = Samples::default();
    open_slice(spec, &pool, rate, warmup, duration, &mut samples).await?;
    Ok(samples.summary(pool.opened.load(Ordering::Relaxed)))
}

/// Sends `rate` requests per second for `warmup + duration` through `pool`, adding to
/// `samples` the latencies (from the scheduled send time to the end of the body) and errors of
/// the requests scheduled after the warmup.
async fn open_slice(
    spec: &Arc<Spec>,
    pool: &Arc<Pool>,
    rate: f64,
    warmup: Duration,
    duration: Duration,
    samples: &mut Samples,
) -> anyhow::Result<()> {
    let start = Instant::now() + Duration::from_millis(20);
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let runtime = tokio::runtime::Handle::current();
    let (spec, pool) = (spec.clone(), pool.clone());
    // A plain thread keeps the schedule (sub-millisecond sleeps, unlike tokio's timer wheel).
    let tasks = tokio::task::spawn_blocking(move || {
        let mut tasks = Vec::new();
        for i in 0usize.. {
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            if at >= end {
                break;
            }
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let (spec, pool) = (spec.clone(), pool.clone());
            tasks.push(runtime.spawn(async move {
                let result = pool.exchange(&spec, i).await.map(|()| at.elapsed());
                (at, result)
            }));
        }
        tasks
    })
    .await?;
    for task in tasks {
        let (at, result) = task.await?;
        match result {
            _ if at < measure_from => {}
            Ok(latency) => samples.latencies.push(latency),
            Err(e) => {
                samples.errors += 1;
                samples.first_error.get_or_insert(format!("{e:#}"));
            }
        }
    }
    Ok(())
}

/// Targets taking turns for `total` each, in slices of at most `max_slice`, the processes idle
/// before every turn: `turn(k, t, slice)` runs target `t` (its index in [`TARGETS`]) for its
/// `k`-th turn, counted from 0. Each round of turns is led by another target, so none always
/// follows the same one.
async fn take_turns(
    total: Duration,
    max_slice: Duration,
    order: [Target; 4],
    pids: &[u32],
    mut turn: impl AsyncFnMut(usize, usize, Duration) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let slices = (total.as_secs_f64() / max_slice.as_secs_f64())
        .ceil()
        .max(1.0);
    let slice = total.div_f64(slices);
    for k in 0..slices as usize {
        for j in 0..order.len() {
            settle(pids).await?;
            turn(k, order[(j + k) % order.len()] as usize, slice).await?;
        }
    }
    Ok(())
}

/// The closed loops of all targets (in [`TARGETS`] order), taken in turns: in slices of at
/// most [`CLOSED_SLICE`] until each target has had `--duration`, the first turn of each after
/// `--warmup`, later ones after [`CLOSED_SLICE_WARMUP`] (new connections), the processes idle
/// before every slice. Like [`open_loops_in_turns`], so that drift in the machine's speed
/// meets every target alike.
async fn closed_loops_in_turns(
    cli: &Cli,
    specs: &[Arc<Spec>],
    order: [Target; 4],
    pids: &[u32],
) -> anyhow::Result<Vec<Closed>> {
    let mut totals: Vec<Closed> = specs.iter().map(|_| Closed::default()).collect();
    take_turns(
        cli.duration,
        CLOSED_SLICE,
        order,
        pids,
        async |k, t, slice| {
            let warmup = match k {
                0 => cli.warmup,
                _ => CLOSED_SLICE_WARMUP.min(cli.warmup),
            };
            let turn = closed_loop(&specs[t], cli.connections, warmup, slice).await?;
            let total = &mut totals[t];
            total.ok += turn.ok;
            total.errors += turn.errors;
            total.first_error = total.first_error.take().or(turn.first_error);
            Ok(())
        },
    )
    .await?;
    for total in &mut totals {
        total.requests_per_s = total.ok as f64 / cli.duration.as_secs_f64();
    }
    Ok(totals)
}

/// The open loops of all targets (in [`TARGETS`] order), taken in turns: each target is warmed
/// up for `--warmup`, then they alternate in slices of about [`SLICE`] until each has had
/// `--latency-duration`, the processes idle before every slice. The machine's speed on a
/// shared VM drifts within seconds (the same binary's p50 moves by a third between runs a few
/// seconds apart), so targets measured one after the other compare drift as much as proxies;
/// in turns, every target meets the same drift.
async fn open_loops_in_turns(
    cli: &Cli,
    specs: &[Arc<Spec>],
    order: [Target; 4],
    pids: &[u32],
) -> anyhow::Result<Vec<Open>> {
    let pools: Vec<Arc<Pool>> = specs.iter().map(|_| Arc::default()).collect();
    let mut samples: Vec<Samples> = specs.iter().map(|_| Samples::default()).collect();
    for t in order.map(|t| t as usize) {
        let mut discarded = Samples::default();
        open_slice(
            &specs[t],
            &pools[t],
            cli.rate,
            cli.warmup,
            Duration::ZERO,
            &mut discarded,
        )
        .await?;
    }
    take_turns(
        cli.latency_duration,
        SLICE,
        order,
        pids,
        async |_, t, slice| {
            let (spec, pool) = (&specs[t], &pools[t]);
            open_slice(spec, pool, cli.rate, Duration::ZERO, slice, &mut samples[t]).await
        },
    )
    .await?;
    Ok(samples
        .into_iter()
        .zip(&pools)
        .map(|(s, pool)| s.summary(pool.opened.load(Ordering::Relaxed)))
        .collect())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

// === the run and the report ===

/// What the load generator talks to, declared in run order (`as usize` indexes the runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Direct,
    Forwarder,
    Gateway,
    GatewayUnmetered,
}

const TARGETS: [Target; 4] = [
    Target::Direct,
    Target::Forwarder,
    Target::Gateway,
    Target::GatewayUnmetered,
];
const SCENARIOS: [&str; 2] = ["non-streamed", "streamed"];

impl Target {
    fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Forwarder => "forwarder",
            Self::Gateway => "gateway",
            Self::GatewayUnmetered => "gateway-unmetered",
        }
    }

    fn from_name(name: &str) -> Result<Self, String> {
        TARGETS
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                format!("{name:?} is not one of direct, forwarder, gateway, gateway-unmetered")
            })
    }

    fn is_gateway(self) -> bool {
        matches!(self, Self::Gateway | Self::GatewayUnmetered)
    }

    /// Headers and `NM-User` values for this target's requests (see [`Spec`]).
    fn headers(self) -> anyhow::Result<(HeaderMap, Vec<HeaderValue>)> {
        let mut headers = HeaderMap::new();
        if !self.is_gateway() {
            return Ok((headers, Vec::new()));
        }
        headers.insert("nm-key", HeaderValue::from_static(BOOTSTRAP_KEY));
        headers.insert("nm-agent", HeaderValue::from_static("bench"));
        if self == Self::GatewayUnmetered {
            headers.insert(UNMETERED_HEADER, HeaderValue::from_static("1"));
        }
        let users = (0..USERS)
            .map(|n| HeaderValue::try_from(user_name(n)))
            .collect::<Result<_, _>>()?;
        Ok((headers, users))
    }

    /// What this target's requests of one scenario send and must get back.
    fn spec(self, addr: SocketAddr, stream: bool) -> anyhow::Result<Spec> {
        let (headers, users) = self.headers()?;
        let mut request = json!({
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "Say hello."}],
            "stream": stream,
        });
        if stream {
            request["stream_options"] = json!({"include_usage": true});
        }
        Ok(Spec {
            addr,
            path: if self.is_gateway() {
                "/openai/v1/chat/completions"
            } else {
                "/v1/chat/completions"
            },
            headers,
            users,
            body: Bytes::from(request.to_string()),
            expected_len: Canned::new().len(stream),
        })
    }

    /// Fails when a gateway's recorded usage shows its run did not measure what it is for.
    fn verify(self, u: &Usage) -> anyhow::Result<()> {
        let name = self.name();
        let seen = format!(
            "`nm-gateway usage --json` after its run: {} requests, {} input and {} output tokens",
            u.requests, u.input_tokens, u.output_tokens
        );
        match self {
            Self::Gateway => {
                ensure!(
                    u.requests > 0 && u.input_tokens > 0 && u.output_tokens > 0,
                    "metering is broken: {name} {seen}"
                );
                ensure!(
                    u.user0_spent_micros > 0,
                    "the budget path settled nothing: {} spent $0 according to `nm-gateway budgets show`",
                    user_name(0)
                );
            }
            Self::GatewayUnmetered => ensure!(
                u.requests > 0 && u.input_tokens == 0 && u.output_tokens == 0,
                "{name} does not isolate the metering cost: {seen}"
            ),
            Self::Direct | Self::Forwarder => {}
        }
        Ok(())
    }
}

#[derive(Serialize)]
struct Measured {
    scenario: &'static str,
    closed_loop: Closed,
    open_loop: Open,
}

#[derive(Serialize)]
struct TargetRun {
    target: &'static str,
    scenarios: Vec<Measured>,
    /// Resident memory after the run (not for `direct`, which is the mock).
    memory: Option<Mem>,
    /// What a gateway recorded, read after its run.
    usage: Option<Usage>,
    /// Share of the machine's CPU time the hypervisor took during the round (all targets
    /// alike, since they take turns): noise.
    cpu_steal_pct: f64,
}

/// `nm-bench load`: one scenario against one running target.
async fn load(
    cli: &Cli,
    target: Target,
    addr: SocketAddr,
    stream: bool,
    closed: bool,
) -> anyhow::Result<()> {
    check_load_options(cli)?;
    let spec = Arc::new(target.spec(addr, stream)?);
    let figures = if closed {
        serde_json::to_value(closed_loop(&spec, cli.connections, cli.warmup, cli.duration).await?)?
    } else {
        serde_json::to_value(open_loop(&spec, cli.rate, cli.warmup, cli.latency_duration).await?)?
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{figures}")?;
    Ok(out.flush()?)
}

/// Refuses load options no loop can run with (the whole bench and `nm-bench load` alike).
fn check_load_options(cli: &Cli) -> anyhow::Result<()> {
    ensure!(cli.connections > 0, "--connections must be at least 1");
    ensure!(
        cli.rate.is_finite() && cli.rate > 0.0,
        "--rate must be positive"
    );
    Ok(())
}

async fn bench(cli: &Cli) -> anyhow::Result<()> {
    check_load_options(cli)?;
    let gateway_bin = match &cli.gateway_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the bench binary has no directory")?
            .join("nm-gateway"),
    };
    ensure!(
        gateway_bin.is_file(),
        "{} not found; build it first: cargo build --release --bin nm-gateway",
        gateway_bin.display()
    );
    let dir = TempDir::new()?;
    let mock = spawn_helper(&dir.0, &["mock".to_owned()]).await?;
    let mut rounds = Vec::new();
    let mut paired = Vec::new();
    for round in 0..cli.rounds {
        let runs = run_round(cli, &gateway_bin, &dir, &mock, round).await?;
        let ratios = RoundRatios::of(&runs);
        if cli.rounds > 1 {
            for (s, scenario) in SCENARIOS.into_iter().enumerate() {
                let added = ratios.added_p50[s].map_or("n/a".to_owned(), |r| format!("{r:.2}"));
                eprintln!(
                    "nm-bench: round {}: {scenario}: gateway/forwarder req/s {:.2}, gateway/gateway-unmetered {:.2}, added p50 gateway/forwarder {added}",
                    round + 1,
                    ratios.throughput[s],
                    ratios.metering[s],
                );
            }
        }
        rounds.push(runs);
        paired.push(ratios);
    }
    drop(mock);
    let runs = median_of_rounds(rounds);

    let report = Report::new(cli, &gateway_bin, runs, &paired);
    let mut out = std::io::stdout().lock();
    if cli.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        report.write(&mut out)?;
    }
    Ok(out.flush()?)
}

/// One round: every target started at once, in a directory of its own; per scenario, the
/// closed loops and then the open loops with the targets taking turns
/// ([`closed_loops_in_turns`], [`open_loops_in_turns`]; in reverse order on odd rounds). The
/// runs come back in [`TARGETS`] order.
async fn run_round(
    cli: &Cli,
    gateway_bin: &Path,
    dir: &TempDir,
    mock: &Proc,
    round: u32,
) -> anyhow::Result<Vec<TargetRun>> {
    let mut order = TARGETS;
    if round % 2 == 1 {
        order.reverse();
    }
    // Each round starts its processes in a directory of its own: no port file, database or
    // spool carries over.
    let dir = dir.0.join(format!("round-{}", round + 1));
    std::fs::create_dir_all(&dir)?;
    let mut procs: Vec<Option<Proc>> = Vec::new();
    let mut admins: Vec<Option<Admin>> = Vec::new();
    for target in TARGETS {
        let (proc, admin) = match target {
            Target::Direct => (None, None),
            Target::Forwarder => {
                let args = ["forwarder", "--upstream", &mock.addr.to_string()].map(String::from);
                (Some(spawn_helper(&dir, &args).await?), None)
            }
            Target::Gateway | Target::GatewayUnmetered => {
                let (proc, admin) =
                    spawn_gateway(gateway_bin, &dir, target.name(), mock.addr).await?;
                (Some(proc), Some(admin))
            }
        };
        procs.push(proc);
        admins.push(admin);
    }
    let pids: Vec<u32> = std::iter::once(mock)
        .chain(procs.iter().flatten())
        .map(|p| p.child.id())
        .collect();
    let (steal, total) = cpu_steal()?;
    let mut scenarios: Vec<Vec<Measured>> = TARGETS.iter().map(|_| Vec::new()).collect();
    for (scenario, stream) in SCENARIOS.into_iter().zip([false, true]) {
        let specs = TARGETS
            .iter()
            .zip(&procs)
            .map(|(t, p)| {
                Ok(Arc::new(
                    t.spec(p.as_ref().map_or(mock.addr, |p| p.addr), stream)?,
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        eprintln!(
            "nm-bench: {scenario}: closed loops, the targets taking turns of up to {:.0} s",
            CLOSED_SLICE.as_secs_f64()
        );
        let closed = closed_loops_in_turns(cli, &specs, order, &pids).await?;
        let settled = settle(&pids).await?;
        eprintln!(
            "nm-bench: {scenario}: open loops, the targets taking turns of {:.2} s (idle after {settled:.1} s)",
            SLICE.as_secs_f64()
        );
        let open = open_loops_in_turns(cli, &specs, order, &pids).await?;
        for ((measured, closed_loop), mut open_loop) in scenarios.iter_mut().zip(closed).zip(open) {
            open_loop.settle_s = settled;
            measured.push(Measured {
                scenario,
                closed_loop,
                open_loop,
            });
        }
    }
    let (steal2, total2) = cpu_steal()?;
    let cpu_steal_pct = (steal2 - steal) as f64 * 100.0 / (total2 - total).max(1) as f64;
    // Idle: the last request records have reached the controlplanes.
    settle(&pids).await?;
    let mut runs = Vec::new();
    for (((target, proc), admin), scenarios) in
        TARGETS.into_iter().zip(&procs).zip(&admins).zip(scenarios)
    {
        let name = target.name();
        let memory = proc.as_ref().map(|p| memory(p.child.id())).transpose()?;
        let usage = match admin {
            Some(admin) => {
                let usage = admin.usage().await?;
                eprintln!(
                    "nm-bench: {name}: recorded {} requests, {} input and {} output tokens ({} unmetered)",
                    usage.requests,
                    usage.input_tokens,
                    usage.output_tokens,
                    usage.unmetered_requests
                );
                target.verify(&usage)?;
                Some(usage)
            }
            None => None,
        };
        runs.push(TargetRun {
            target: name,
            scenarios,
            memory,
            usage,
            cpu_steal_pct,
        });
    }
    Ok(runs)
}

/// One run per target from several rounds: per scenario the closed loop of the median
/// throughput and the open loop of the median p50, the highest memory, the mean steal, the last
/// round's usage.
fn median_of_rounds(rounds: Vec<Vec<TargetRun>>) -> Vec<TargetRun> {
    let mut per_target: Vec<Vec<TargetRun>> = TARGETS.iter().map(|_| Vec::new()).collect();
    for round in rounds {
        for (i, run) in round.into_iter().enumerate() {
            per_target[i].push(run);
        }
    }
    per_target
        .into_iter()
        .filter_map(|mut runs| {
            let n = runs.len();
            let cpu_steal_pct = runs.iter().map(|r| r.cpu_steal_pct).sum::<f64>() / n.max(1) as f64;
            let memory = runs
                .iter()
                .filter_map(|r| r.memory)
                .max_by_key(|m| m.vm_hwm_kib);
            let mut last = runs.pop()?;
            let mut all = runs;
            for (s, measured) in last.scenarios.iter_mut().enumerate() {
                let mut closed: Vec<Closed> = all
                    .iter_mut()
                    .map(|r| std::mem::take(&mut r.scenarios[s].closed_loop))
                    .collect();
                closed.push(std::mem::take(&mut measured.closed_loop));
                closed.sort_by(|a, b| a.requests_per_s.total_cmp(&b.requests_per_s));
                let mut open: Vec<Open> = all
                    .iter_mut()
                    .map(|r| std::mem::take(&mut r.scenarios[s].open_loop))
                    .collect();
                open.push(std::mem::take(&mut measured.open_loop));
                open.sort_by(|a, b| a.p50_ms.total_cmp(&b.p50_ms));
                let mid = closed.len() / 2;
                measured.closed_loop = closed.swap_remove(mid);
                measured.open_loop = open.swap_remove(mid);
            }
            last.memory = memory;
            last.cpu_steal_pct = cpu_steal_pct;
            Some(last)
        })
        .collect()
}

/// One round's ratios, per scenario: the gateway against the other targets of the same round.
struct RoundRatios {
    /// Gateway req/s / forwarder req/s.
    throughput: [f64; 2],
    /// Gateway req/s / gateway-unmetered req/s.
    metering: [f64; 2],
    /// Gateway added p50 / forwarder added p50; None when the forwarder added under
    /// [`MIN_ADDED_MS`] (the ratio is then noise).
    added_p50: [Option<f64>; 2],
}

impl RoundRatios {
    /// `runs` in [`TARGETS`] order.
    fn of(runs: &[TargetRun]) -> Self {
        let rps = |t: Target, s: usize| runs[t as usize].scenarios[s].closed_loop.requests_per_s;
        let p50 = |t: Target, s: usize| runs[t as usize].scenarios[s].open_loop.p50_ms;
        let gateway_over =
            |t: Target| [0, 1].map(|s| rps(Target::Gateway, s) / rps(t, s).max(f64::MIN_POSITIVE));
        Self {
            throughput: gateway_over(Target::Forwarder),
            metering: gateway_over(Target::GatewayUnmetered),
            added_p50: [0, 1].map(|s| {
                let direct = p50(Target::Direct, s);
                let forwarder = p50(Target::Forwarder, s) - direct;
                (forwarder >= MIN_ADDED_MS).then(|| (p50(Target::Gateway, s) - direct) / forwarder)
            }),
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count); None when empty.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// Latency the forwarder and the gateways add over `direct`, in ms.
#[derive(Serialize)]
struct Added {
    scenario: &'static str,
    forwarder_p50_ms: f64,
    forwarder_p99_ms: f64,
    gateway_p50_ms: f64,
    gateway_p99_ms: f64,
    gateway_unmetered_p50_ms: f64,
    gateway_unmetered_p99_ms: f64,
}

/// What metering costs: the gateway against gateway-unmetered.
#[derive(Serialize)]
struct MeteringCost {
    scenario: &'static str,
    /// Gateway req/s / gateway-unmetered req/s (closed loop).
    throughput_ratio: f64,
    /// Gateway open-loop latency minus gateway-unmetered's, ms.
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(Serialize)]
struct Check {
    check: String,
    value: f64,
    target: String,
    /// None: the measurement cannot decide (see [`MIN_ADDED_MS`]).
    pass: Option<bool>,
    /// With several rounds, a ratio check's value is the median of these, each round's own
    /// ratio (None: undecided in that round).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rounds: Vec<Option<f64>>,
    /// With several rounds, the same ratio taken between the targets' median figures instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    of_medians: Option<f64>,
}

impl Check {
    fn new(check: String, value: f64, op: &str, limit: f64) -> Self {
        let pass = match op {
            "<" => value < limit,
            "<=" => value <= limit,
            _ => value >= limit,
        };
        let (pass, target) = (Some(pass), format!("{op} {limit}"));
        Self {
            check,
            value,
            target,
            pass,
            rounds: Vec::new(),
            of_medians: None,
        }
    }

    /// A ratio check judged on the median of the rounds' own ratios (`rounds`, one per round).
    /// A round that cannot decide (None) counts against the gateway, as an infinite ratio for a
    /// `<=` check and a zero one for a `>=` check, so leaving it out never helps a pass; when no
    /// round decides, the check is N/A. With several rounds, the rounds and the ratio between
    /// the median figures (`of_medians`) are kept for the report; with one, both are that
    /// round's ratio.
    fn paired(
        check: String,
        rounds: Vec<Option<f64>>,
        of_medians: Option<f64>,
        op: &str,
        limit: f64,
    ) -> Self {
        let against = if op.starts_with('<') {
            f64::INFINITY
        } else {
            0.0
        };
        let decided = rounds
            .iter()
            .any(Option::is_some)
            .then(|| median(rounds.iter().map(|r| r.unwrap_or(against)).collect()))
            .flatten();
        let mut c = Self::new(check, decided.unwrap_or(f64::NAN), op, limit);
        if decided.is_none() {
            c.pass = None;
        }
        if rounds.len() > 1 {
            c.rounds = rounds;
            c.of_medians = of_medians;
        }
        c
    }
}

#[derive(Serialize)]
struct Report {
    config: Value,
    targets: Vec<TargetRun>,
    added_latency: Vec<Added>,
    metering_cost: Vec<MeteringCost>,
    checks: Vec<Check>,
}

impl Report {
    fn new(cli: &Cli, gateway_bin: &Path, targets: Vec<TargetRun>, paired: &[RoundRatios]) -> Self {
        let mut added_latency = Vec::new();
        let mut metering_cost = Vec::new();
        let mut checks = Vec::new();
        // The same ratios as each round's, between the targets' median figures.
        let medians = RoundRatios::of(&targets);
        for (s, scenario) in SCENARIOS.into_iter().enumerate() {
            let [direct, fwd, gw, unmetered] = TARGETS.map(|t| &targets[t as usize].scenarios[s]);
            let direct = &direct.open_loop;
            let add = Added {
                scenario,
                forwarder_p50_ms: fwd.open_loop.p50_ms - direct.p50_ms,
                forwarder_p99_ms: fwd.open_loop.p99_ms - direct.p99_ms,
                gateway_p50_ms: gw.open_loop.p50_ms - direct.p50_ms,
                gateway_p99_ms: gw.open_loop.p99_ms - direct.p99_ms,
                gateway_unmetered_p50_ms: unmetered.open_loop.p50_ms - direct.p50_ms,
                gateway_unmetered_p99_ms: unmetered.open_loop.p99_ms - direct.p99_ms,
            };
            let checked = [
                (
                    "gateway added p50 / forwarder added p50",
                    paired.iter().map(|r| r.added_p50[s]).collect(),
                    medians.added_p50[s],
                    "<=",
                    MAX_ADDED_P50_RATIO,
                ),
                (
                    "gateway req/s / forwarder req/s",
                    paired.iter().map(|r| Some(r.throughput[s])).collect(),
                    Some(medians.throughput[s]),
                    ">=",
                    MIN_THROUGHPUT_RATIO,
                ),
                (
                    "gateway req/s / gateway-unmetered req/s",
                    paired.iter().map(|r| Some(r.metering[s])).collect(),
                    Some(medians.metering[s]),
                    ">=",
                    MIN_METERED_THROUGHPUT_RATIO,
                ),
            ];
            for (what, rounds, of_medians, op, limit) in checked {
                let what = format!("{scenario}: {what}");
                checks.push(Check::paired(what, rounds, of_medians, op, limit));
            }
            let cost = MeteringCost {
                scenario,
                throughput_ratio: medians.metering[s],
                p50_ms: gw.open_loop.p50_ms - unmetered.open_loop.p50_ms,
                p99_ms: gw.open_loop.p99_ms - unmetered.open_loop.p99_ms,
            };
            added_latency.push(add);
            metering_cost.push(cost);
        }
        let peak = targets[Target::Gateway as usize]
            .memory
            .map_or(f64::NAN, |m| m.vm_hwm_kib as f64 / KIB_PER_MIB);
        let what = "gateway peak RSS (VmHWM), MiB".to_owned();
        checks.push(Check::new(what, peak, "<", MAX_PEAK_RSS_MIB));
        for target in [Target::Gateway, Target::GatewayUnmetered] {
            let errors = (targets[target as usize].scenarios.iter())
                .map(|m| m.closed_loop.errors + m.open_loop.errors)
                .sum::<u64>() as f64;
            let what = format!("{} errors", target.name());
            checks.push(Check::new(what, errors, "<=", 0.0));
        }
        let canned = Canned::new();
        let config = json!({
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "warmup_s": cli.warmup.as_secs_f64(),
            "closed_loop": {"connections": cli.connections, "duration_s": cli.duration.as_secs_f64()},
            "open_loop": {"rate_per_s": cli.rate, "duration_s": cli.latency_duration.as_secs_f64()},
            "response_bytes": [canned.len(false), canned.len(true)],
            "stream_content_chunks": STREAM_CHUNKS,
            "gateway_users": USERS,
            "gateway_bin": gateway_bin.display().to_string(),
        });
        Self {
            config,
            targets,
            added_latency,
            metering_cost,
            checks,
        }
    }

    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let c = &self.config;
        let (closed, open) = (&c["closed_loop"], &c["open_loop"]);
        writeln!(
            out,
            "nm-bench: gateway {}\n{} CPUs shared by all processes; warmup {} s; closed loop: {} connections for {} s; open loop: {} req/s for {} s",
            c["gateway_bin"].as_str().unwrap_or_default(),
            c["cpus"],
            c["warmup_s"],
            closed["connections"],
            closed["duration_s"],
            open["rate_per_s"],
            open["duration_s"]
        )?;
        for (s, (add, cost)) in self
            .added_latency
            .iter()
            .zip(&self.metering_cost)
            .enumerate()
        {
            let bytes = &c["response_bytes"][s];
            let detail = match s {
                0 => format!("{bytes} B JSON with usage"),
                _ => format!(
                    "{STREAM_CHUNKS} SSE content chunks + finish + usage + [DONE], {bytes} B"
                ),
            };
            writeln!(out, "\n== {} ({detail}) ==", add.scenario)?;
            writeln!(
                out,
                "{:>36} | open loop: latency to the end of the body",
                "closed loop"
            )?;
            writeln!(
                out,
                "target                 req/s  errors |   p50 ms   p90 ms   p99 ms   max ms  errors  conns"
            )?;
            for run in &self.targets {
                let (cl, ol) = (&run.scenarios[s].closed_loop, &run.scenarios[s].open_loop);
                writeln!(
                    out,
                    "{:<17} {:>10.0} {:>7} | {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>7} {:>6}",
                    run.target,
                    cl.requests_per_s,
                    cl.errors,
                    ol.p50_ms,
                    ol.p90_ms,
                    ol.p99_ms,
                    ol.max_ms,
                    ol.errors,
                    ol.connections
                )?;
                for err in [&cl.first_error, &ol.first_error].into_iter().flatten() {
                    writeln!(out, "{:<17} first error: {err}", "")?;
                }
            }
            writeln!(
                out,
                "added over direct: forwarder p50 {:+.3} ms, p99 {:+.3} ms; gateway p50 {:+.3} ms, p99 {:+.3} ms; gateway-unmetered p50 {:+.3} ms, p99 {:+.3} ms",
                add.forwarder_p50_ms,
                add.forwarder_p99_ms,
                add.gateway_p50_ms,
                add.gateway_p99_ms,
                add.gateway_unmetered_p50_ms,
                add.gateway_unmetered_p99_ms
            )?;
            writeln!(
                out,
                "metering cost (gateway vs gateway-unmetered): req/s ratio {:.3}; p50 {:+.3} ms, p99 {:+.3} ms",
                cost.throughput_ratio, cost.p50_ms, cost.p99_ms
            )?;
        }
        writeln!(out)?;
        for run in &self.targets {
            if let Some(m) = run.memory {
                writeln!(
                    out,
                    "{} memory after its run: peak RSS (VmHWM) {:.1} MiB, current RSS (VmRSS) {:.1} MiB",
                    run.target,
                    m.vm_hwm_kib as f64 / KIB_PER_MIB,
                    m.vm_rss_kib as f64 / KIB_PER_MIB
                )?;
            }
        }
        for run in &self.targets {
            if let Some(u) = &run.usage {
                writeln!(
                    out,
                    "{} usage recorded (nm-gateway usage): {} requests, {} input tokens, {} output tokens, {} unmetered, cost {:.6} USD; {} spent {:.6} USD",
                    run.target,
                    u.requests,
                    u.input_tokens,
                    u.output_tokens,
                    u.unmetered_requests,
                    u.cost_micros as f64 / 1e6,
                    user_name(0),
                    u.user0_spent_micros as f64 / 1e6
                )?;
            }
        }
        let steal: Vec<String> = (self.targets.iter())
            .map(|r| format!("{} {:.1}%", r.target, r.cpu_steal_pct))
            .collect();
        writeln!(
            out,
            "CPU time stolen by the hypervisor (noise): {}",
            steal.join(", ")
        )?;
        writeln!(out, "\nchecks (a report, not a test):")?;
        for c in &self.checks {
            let verdict = match c.pass {
                Some(true) => "PASS",
                Some(false) => "FAIL",
                None => "N/A ",
            };
            writeln!(
                out,
                "  {verdict}  {:<54} {:>8.2}  (target {})",
                c.check, c.value, c.target
            )?;
            if !c.rounds.is_empty() {
                let rounds: Vec<String> = (c.rounds.iter())
                    .map(|r| r.map_or("n/a".to_owned(), |v| format!("{v:.2}")))
                    .collect();
                let of_medians = c.of_medians.map_or("n/a".to_owned(), |v| format!("{v:.2}"));
                writeln!(
                    out,
                    "{:8}median of the rounds' ratios {}; between the median figures {of_medians}",
                    "",
                    rounds.join(", ")
                )?;
            }
        }
        if self.checks.iter().any(|c| c.pass.is_none()) {
            writeln!(
                out,
                "  N/A: the forwarder added under {MIN_ADDED_MS} ms over direct (in every round), so the ratio is noise; run again"
            )?;
        }
        Ok(())
    }
}
