//! The load generator: closed and open loops against one target, and targets taking turns.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpStream;

use crate::processes::settle;
use crate::{CLOSED_SLICE, CLOSED_SLICE_WARMUP, Cli, REQUEST_TIMEOUT, SLICE};

pub(crate) type Sender = SendRequest<Full<Bytes>>;

/// One target and one scenario: what to send and what must come back.
pub(crate) struct Spec {
    pub(crate) addr: SocketAddr,
    pub(crate) path: &'static str,
    /// Headers on every request (the gateway's `NM-Key` and `NM-Agent`, the unmetered mark).
    pub(crate) headers: HeaderMap,
    /// `NM-User` values: request `n` sends `users[n % users.len()]`; none when empty.
    pub(crate) users: Vec<HeaderValue>,
    /// `NM-Session` values: request `n` sends `sessions[n % sessions.len()]`; none when empty.
    pub(crate) sessions: Vec<HeaderValue>,
    pub(crate) body: Bytes,
    pub(crate) expected_len: usize,
}

impl Spec {
    /// Request `n`: a closed-loop connection's index, or an open-loop request's.
    pub(crate) fn request(&self, n: usize) -> anyhow::Result<Request<Full<Bytes>>> {
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
        if let Some(session) = self.sessions.get(n % self.sessions.len().max(1)) {
            headers.insert("nm-session", session.clone());
        }
        Ok(req)
    }
}

pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<Sender> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Sends one request and reads the whole response body.
pub(crate) async fn exchange(sender: &mut Sender, spec: &Spec, n: usize) -> anyhow::Result<()> {
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
pub(crate) struct Closed {
    pub(crate) requests_per_s: f64,
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

pub(crate) async fn closed_loop(
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
pub(crate) struct Pool {
    pub(crate) idle: Mutex<Vec<Sender>>,
    pub(crate) opened: AtomicUsize,
}

impl Pool {
    pub(crate) async fn exchange(&self, spec: &Spec, n: usize) -> anyhow::Result<()> {
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
pub(crate) struct Open {
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) samples: usize,
    pub(crate) errors: u64,
    pub(crate) connections: usize,
    pub(crate) first_error: Option<String>,
    /// How long the processes took to go idle after the closed loop (see [`settle`]).
    pub(crate) settle_s: f64,
}

/// An open loop's latencies and errors, gathered over one or more slices.
#[derive(Default)]
pub(crate) struct Samples {
    pub(crate) latencies: Vec<Duration>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

impl Samples {
    pub(crate) fn summary(mut self, connections: usize) -> Open {
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
pub(crate) async fn open_loop(
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
pub(crate) async fn open_slice(
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
/// before every turn: `turn(k, t, slice)` runs target `t` (its index in the run's targets) for its
/// `k`-th turn, counted from 0. Each round of turns is led by another target, so none always
/// follows the same one.
pub(crate) async fn take_turns(
    total: Duration,
    max_slice: Duration,
    order: &[usize],
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
            turn(k, order[(j + k) % order.len()], slice).await?;
        }
    }
    Ok(())
}

/// The closed loops of all targets (in the run's order), taken in turns: in slices of at
/// most [`CLOSED_SLICE`] until each target has had `--duration`, the first turn of each after
/// `--warmup`, later ones after [`CLOSED_SLICE_WARMUP`] (new connections), the processes idle
/// before every slice. Like [`open_loops_in_turns`], so that drift in the machine's speed
/// meets every target alike.
pub(crate) async fn closed_loops_in_turns(
    cli: &Cli,
    specs: &[Arc<Spec>],
    order: &[usize],
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

/// The open loops of all targets (in the run's order), taken in turns: each target is warmed
/// up for `--warmup`, then they alternate in slices of about [`SLICE`] until each has had
/// `--latency-duration`, the processes idle before every slice. The machine's speed on a
/// shared VM drifts within seconds (the same binary's p50 moves by a third between runs a few
/// seconds apart), so targets measured one after the other compare drift as much as proxies;
/// in turns, every target meets the same drift.
pub(crate) async fn open_loops_in_turns(
    cli: &Cli,
    specs: &[Arc<Spec>],
    order: &[usize],
    pids: &[u32],
) -> anyhow::Result<Vec<Open>> {
    let pools: Vec<Arc<Pool>> = specs.iter().map(|_| Arc::default()).collect();
    let mut samples: Vec<Samples> = specs.iter().map(|_| Samples::default()).collect();
    for &t in order {
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

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
