//! Helper processes: starting the mock, the forwarder and the gateways, their admin commands,
//! and reading their memory and CPU time from `/proc`.

use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Incoming};
use hyper::header;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::net::TcpListener;

use crate::load::connect;
use crate::{BOOTSTRAP_KEY, USERS};

/// Binds an ephemeral loopback port and tells the bench which (written whole, then renamed).
pub(crate) async fn announce(port_file: &Path) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let tmp = port_file.with_extension("tmp");
    std::fs::write(&tmp, listener.local_addr()?.port().to_string())?;
    std::fs::rename(&tmp, port_file)?;
    Ok(listener)
}

/// HTTP/1.1 server, one task per connection.
pub(crate) async fn serve<F, Fut, B>(listener: TcpListener, handler: F) -> anyhow::Result<()>
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
pub(crate) fn exit_with_parent() {
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
}

/// A child process, killed when dropped.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch directory (port files, the gateways' databases and logs), removed when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new() -> anyhow::Result<Self> {
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

pub(crate) async fn spawn_helper(dir: &Path, args: &[String]) -> anyhow::Result<Proc> {
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

/// `nm-gateway` without the caller's `NM_*` and `OTEL_*` settings (the bench passes its own),
/// logging warnings.
pub(crate) fn gateway_command(bin: &Path) -> Command {
    let mut cmd = Command::new(bin);
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("NM_") || key_text.starts_with("OTEL_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("NM_LOG", "warn");
    cmd
}

/// Starts `nm-gateway serve` on its own database, record spool and log (`<name>.db`,
/// `<name>-spool`, `<name>.log`: nothing carries over from another target or run), waits until
/// it is healthy and sets the bench's default end-user budget.
pub(crate) async fn spawn_gateway(
    bin: &Path,
    dir: &Path,
    name: &str,
    mock: SocketAddr,
    env: &[(&str, String)],
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
        .envs(env.iter().map(|(k, v)| (k, v)))
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
pub(crate) struct Admin {
    pub(crate) bin: PathBuf,
    pub(crate) controlplane: String,
}

impl Admin {
    /// Runs `nm-gateway <args>`, which must exit 0 and print JSON.
    pub(crate) async fn run(&self, args: &[&str]) -> anyhow::Result<Value> {
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
    pub(crate) async fn usage(&self) -> anyhow::Result<Usage> {
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

pub(crate) fn user_name(n: usize) -> String {
    format!("bench-user-{}", n % USERS)
}

/// A gateway's usage totals after its run (`nm-gateway usage --json`).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Usage {
    pub(crate) requests: u64,
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
    pub(crate) cost_micros: u64,
    /// Requests whose answer carried no usage the gateway read.
    pub(crate) unmetered_requests: u64,
    /// What `bench-user-0` spent today according to its budget: the budget path settled.
    #[serde(default)]
    pub(crate) user0_spent_micros: u64,
}

pub(crate) async fn health_ok(addr: SocketAddr) -> anyhow::Result<bool> {
    let mut sender = connect(addr).await?;
    let req = Request::get("/health")
        .header(header::HOST, addr.to_string())
        .body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    Ok(resp.status() == StatusCode::OK)
}

/// Peak and current resident memory of a process, in KiB.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Mem {
    pub(crate) vm_hwm_kib: u64,
    pub(crate) vm_rss_kib: u64,
}

pub(crate) fn memory(pid: u32) -> anyhow::Result<Mem> {
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
pub(crate) fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
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
pub(crate) async fn settle(pids: &[u32]) -> anyhow::Result<f64> {
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
pub(crate) fn cpu_steal() -> anyhow::Result<(u64, u64)> {
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
