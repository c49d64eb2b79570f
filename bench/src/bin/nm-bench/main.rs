//! `nm-bench`: how much latency, throughput and memory the gateway costs, measured against a
//! baseline, and what its usage metering costs. Run it with `cargo build --profile dist -p
//! nm-gateway -p nm-bench --bin nm-gateway --bin nm-bench && target/dist/nm-bench` (add `--json`
//! for machine-readable output, `--help` for the durations and rates).
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

mod collector;
mod forwarder;
mod load;
mod mock;
mod processes;
mod report;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use hyper::header::{HeaderMap, HeaderValue};
use serde::Serialize;
use serde_json::json;

use crate::forwarder::forwarder;
use crate::load::{
    Closed, Open, Spec, closed_loop, closed_loops_in_turns, open_loop, open_loops_in_turns,
};
use crate::mock::{Canned, mock_server};
use crate::processes::{
    Admin, Mem, Proc, TempDir, Usage, cpu_steal, exit_with_parent, memory, settle, spawn_gateway,
    spawn_helper, user_name,
};
use crate::report::{Report, RoundRatios};

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
    /// Measure what tracing costs instead of metering: the targets are direct, forwarder,
    /// gateway (tracing off), gateway-traced (every request sampled, exporting over OTLP/gRPC to
    /// a local collector), gateway-unsampled (the same, sampled at 0) and, with `--before-bin`,
    /// gateway-before.
    #[arg(long)]
    tracing: bool,
    /// With `--tracing`: an nm-gateway binary from before tracing existed (tracing off), to
    /// compare tracing-off against.
    #[arg(long, value_name = "PATH", requires = "tracing")]
    before_bin: Option<PathBuf>,
    /// Gateway requests carry `NM-Session: sess_bench<n % N>` (n: the closed loop's connection,
    /// the open loop's request), so the implicit rules read every request's conversation and
    /// answer (each is a `reask` of its session's last); 0: no session. Run once more with
    /// `NM_IMPLICIT_RULES=off` in the environment (the gateways inherit it) for the rules' cost.
    #[arg(long, default_value_t = 0)]
    sessions: usize,
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
    /// The local OTLP collector of `--tracing` (run by the bench itself).
    #[command(hide = true)]
    Collector {
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
        Some(Helper::Collector { port_file }) => {
            exit_with_parent();
            runtime.block_on(collector::collector(port_file))
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

// === the run and the report ===

/// What the load generator talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Direct,
    Forwarder,
    Gateway,
    GatewayUnmetered,
    /// `--before-bin`, tracing off.
    GatewayBefore,
    /// Tracing on, every request sampled, exporting to the bench's collector.
    GatewayTraced,
    /// Tracing on, sampled at 0.
    GatewayUnsampled,
}

/// The default run's targets, in run order: what metering costs.
const TARGETS: [Target; 4] = [
    Target::Direct,
    Target::Forwarder,
    Target::Gateway,
    Target::GatewayUnmetered,
];

/// `--tracing`'s targets, in run order: what tracing costs.
const TRACING_TARGETS: [Target; 6] = [
    Target::Direct,
    Target::Forwarder,
    Target::Gateway,
    Target::GatewayBefore,
    Target::GatewayTraced,
    Target::GatewayUnsampled,
];

/// The targets of this run.
fn targets(cli: &Cli) -> Vec<Target> {
    if !cli.tracing {
        return TARGETS.to_vec();
    }
    TRACING_TARGETS
        .into_iter()
        .filter(|t| *t != Target::GatewayBefore || cli.before_bin.is_some())
        .collect()
}
const SCENARIOS: [&str; 2] = ["non-streamed", "streamed"];

impl Target {
    fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Forwarder => "forwarder",
            Self::Gateway => "gateway",
            Self::GatewayUnmetered => "gateway-unmetered",
            Self::GatewayBefore => "gateway-before",
            Self::GatewayTraced => "gateway-traced",
            Self::GatewayUnsampled => "gateway-unsampled",
        }
    }

    fn from_name(name: &str) -> Result<Self, String> {
        TARGETS
            .into_iter()
            .chain(TRACING_TARGETS)
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                format!("{name:?} is not one of direct, forwarder, gateway, gateway-unmetered, gateway-before, gateway-traced, gateway-unsampled")
            })
    }

    fn is_gateway(self) -> bool {
        !matches!(self, Self::Direct | Self::Forwarder)
    }

    /// The settings a gateway target runs with beyond the bench's own (its OpenTelemetry).
    fn gateway_env(self, collector: Option<SocketAddr>) -> Vec<(&'static str, String)> {
        let traced = |sampler: &str| {
            let mut env = vec![
                ("OTEL_SERVICE_NAME", self.name().to_owned()),
                ("OTEL_TRACES_SAMPLER", sampler.to_owned()),
            ];
            if let Some(c) = collector {
                env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{c}")));
            }
            env
        };
        match self {
            Self::GatewayTraced => traced("always_on"),
            Self::GatewayUnsampled => {
                let mut env = traced("traceidratio");
                env.push(("OTEL_TRACES_SAMPLER_ARG", "0".to_owned()));
                env
            }
            _ => Vec::new(),
        }
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
    fn spec(self, addr: SocketAddr, stream: bool, sessions: usize) -> anyhow::Result<Spec> {
        let (headers, users) = self.headers()?;
        let sessions = match self.is_gateway() {
            true => (0..sessions)
                .map(|n| HeaderValue::try_from(format!("sess_bench{n}")))
                .collect::<Result<_, _>>()?,
            false => Vec::new(),
        };
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
            sessions,
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
            Self::Gateway | Self::GatewayBefore | Self::GatewayTraced | Self::GatewayUnsampled => {
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
    let spec = Arc::new(target.spec(addr, stream, cli.sessions)?);
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
        "{} not found; build it first: cargo build --profile dist -p nm-gateway",
        gateway_bin.display()
    );
    if let Some(before) = &cli.before_bin {
        ensure!(
            before.is_file(),
            "--before-bin {} not found",
            before.display()
        );
    }
    let bins = Bins {
        gateway: gateway_bin.clone(),
        before: cli.before_bin.clone(),
    };
    let targets = targets(cli);
    let dir = TempDir::new()?;
    let mock = spawn_helper(&dir.0, &["mock".to_owned()]).await?;
    let collector = match cli.tracing {
        true => {
            let proc = spawn_helper(&dir.0, &["collector".to_owned()]).await?;
            Some(Collector {
                addr: proc.addr,
                counts: collector::counts_file(&dir.0.join("collector.port")),
                _proc: proc,
            })
        }
        false => None,
    };
    let helpers = Helpers { mock, collector };
    let mut rounds = Vec::new();
    let mut paired = Vec::new();
    for round in 0..cli.rounds {
        let runs = run_round(cli, &bins, &dir, &helpers, round, &targets).await?;
        let ratios = RoundRatios::of(&runs);
        if cli.rounds > 1 {
            for (s, scenario) in SCENARIOS.into_iter().enumerate() {
                let added = ratios.added_p50[s].map_or("n/a".to_owned(), |r| format!("{r:.2}"));
                let versus: Vec<String> = ratios
                    .versus
                    .iter()
                    .map(|v| format!("{}/{} {:.2}", v.of.name(), v.over.name(), v.throughput[s]))
                    .collect();
                eprintln!(
                    "nm-bench: round {}: {scenario}: gateway/forwarder req/s {:.2}, {}, added p50 gateway/forwarder {added}",
                    round + 1,
                    ratios.throughput[s],
                    versus.join(", "),
                );
            }
        }
        rounds.push(runs);
        paired.push(ratios);
    }
    drop(helpers);
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
/// runs come back in the order of `targets`.
async fn run_round(
    cli: &Cli,
    bins: &Bins,
    dir: &TempDir,
    helpers: &Helpers,
    round: u32,
    targets: &[Target],
) -> anyhow::Result<Vec<TargetRun>> {
    let mock = &helpers.mock;
    let mut order: Vec<usize> = (0..targets.len()).collect();
    if round % 2 == 1 {
        order.reverse();
    }
    // Each round starts its processes in a directory of its own: no port file, database or
    // spool carries over.
    let dir = dir.0.join(format!("round-{}", round + 1));
    std::fs::create_dir_all(&dir)?;
    let mut procs: Vec<Option<Proc>> = Vec::new();
    let mut admins: Vec<Option<Admin>> = Vec::new();
    for &target in targets {
        let (proc, admin) = match target {
            Target::Direct => (None, None),
            Target::Forwarder => {
                let args = ["forwarder", "--upstream", &mock.addr.to_string()].map(String::from);
                (Some(spawn_helper(&dir, &args).await?), None)
            }
            _ => {
                let bin = match (target, &bins.before) {
                    (Target::GatewayBefore, Some(before)) => before,
                    _ => &bins.gateway,
                };
                let env = target.gateway_env(helpers.collector.as_ref().map(|c| c.addr));
                let (proc, admin) =
                    spawn_gateway(bin, &dir, target.name(), mock.addr, &env).await?;
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
    let mut scenarios: Vec<Vec<Measured>> = targets.iter().map(|_| Vec::new()).collect();
    for (scenario, stream) in SCENARIOS.into_iter().zip([false, true]) {
        let specs = targets
            .iter()
            .zip(&procs)
            .map(|(t, p)| {
                Ok(Arc::new(t.spec(
                    p.as_ref().map_or(mock.addr, |p| p.addr),
                    stream,
                    cli.sessions,
                )?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        eprintln!(
            "nm-bench: {scenario}: closed loops, the targets taking turns of up to {:.0} s",
            CLOSED_SLICE.as_secs_f64()
        );
        let closed = closed_loops_in_turns(cli, &specs, &order, &pids).await?;
        let settled = settle(&pids).await?;
        eprintln!(
            "nm-bench: {scenario}: open loops, the targets taking turns of {:.2} s (idle after {settled:.1} s)",
            SLICE.as_secs_f64()
        );
        let open = open_loops_in_turns(cli, &specs, &order, &pids).await?;
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
    if let Some(c) = &helpers.collector {
        verify_exports(&c.counts, targets)?;
    }
    for (((&target, proc), admin), scenarios) in
        targets.iter().zip(&procs).zip(&admins).zip(scenarios)
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

/// The gateway binaries: the one measured, and `--before-bin`'s.
struct Bins {
    gateway: PathBuf,
    before: Option<PathBuf>,
}

/// The helper processes every round shares.
struct Helpers {
    mock: Proc,
    collector: Option<Collector>,
}

struct Collector {
    addr: SocketAddr,
    /// Where it writes the spans it received, per service name.
    counts: PathBuf,
    _proc: Proc,
}

/// Fails when the traced gateway exported nothing or the unsampled one exported anything: the
/// run would not measure what it says.
fn verify_exports(counts: &Path, targets: &[Target]) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(counts).unwrap_or_else(|_| "{}".to_owned());
    let counts: std::collections::BTreeMap<String, u64> = serde_json::from_str(&text)?;
    let of = |t: Target| counts.get(t.name()).copied().unwrap_or(0);
    if targets.contains(&Target::GatewayTraced) {
        ensure!(
            of(Target::GatewayTraced) > 0,
            "gateway-traced exported no span to the collector"
        );
        eprintln!(
            "nm-bench: the collector received {} spans from gateway-traced",
            of(Target::GatewayTraced)
        );
    }
    ensure!(
        of(Target::GatewayUnsampled) == 0,
        "gateway-unsampled exported {} spans at a sampling ratio of 0",
        of(Target::GatewayUnsampled)
    );
    Ok(())
}

/// One run per target from several rounds: per scenario the closed loop of the median
/// throughput and the open loop of the median p50, the highest memory, the mean steal, the last
/// round's usage.
fn median_of_rounds(rounds: Vec<Vec<TargetRun>>) -> Vec<TargetRun> {
    let count = rounds.first().map_or(0, Vec::len);
    let mut per_target: Vec<Vec<TargetRun>> = (0..count).map(|_| Vec::new()).collect();
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
