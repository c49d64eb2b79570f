//! `nm-analytics-bench`: how long one agent's analytics take to compute with a million signals
//! and a million requests stored, on SQLite and PostgreSQL.
//!
//! `cargo build --profile dist -p nm-bench --bin nm-analytics-bench && target/dist/nm-analytics-bench`
//!
//! For each database (SQLite on a file in a temporary directory; PostgreSQL in a fresh
//! `nm_analytics_bench_<random>` database created on the server named by `--postgres`, dropped
//! at the end, skipped with `--no-postgres`) it stores `--signals` (default 1,000,000) signals
//! and as many requests, generated from `--seed` by the analytics' synthetic traffic generator
//! (one request per signal: every regeneration is a new answer): 20 agents over the last 28
//! days (all of it inside the 30-day analytics window, the worst case), three models each,
//! three envs, Zipf-distributed end users. The measured agent `big-agent` holds `--share` of the
//! traffic (default 40%: 400,000 signals); `agent-07` is a typical one (about 3%).
//!
//! The fill goes through the controlplane's own writes of the rollup the analytics read
//! (`session_rollups`, kept in the same transactions as the requests and signals), so its time
//! includes that cost.
//!
//! Then it times, `--runs` times (default 3), `Analytics::compute` for both agents (progress
//! counts, the one SQL statement of per-session outcomes and their groups, read from the
//! rollup, and the recommendation rules), and the outcome rates by model, env and week, and
//! prints min and median in ms. Target, printed as PASS/FAIL: every median under 2,000 ms.
//!
//! On PostgreSQL the bench runs `VACUUM ANALYZE` after the fill, as autovacuum would on its own
//! in production; SQLite is queried as the gateway leaves it.
//!
//! `--power` measures the statistics instead, on simulated counts (no database; see
//! `analytics::simulate`): the false claims at any look for every rule, the sessions to the
//! first correct `best_model` before and after the anytime-valid intervals, the price of each
//! stretch's share of the 5%, and whole lives of agents (a year, looked at up to 12 times a
//! day). `--agents` (default 4,000) per row; Markdown tables on stdout.
//!
//! `--implicit` simulates implicit evidence (issue 32): a population whose implicit behaviour
//! (re-asks, abandons, answers carried on) follows its true satisfaction, explicit signals sent
//! by a fifth of the sessions; how many sessions the right `best_model` needs counting explicit
//! signals only, and explicit + implicit (`analytics::simulate::implicit_report`).

use nm_bench::{DatabaseArgs, ScratchPg};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail};
use clap::Parser;
use nm_controlplane::analytics::synthetic::{AgentSpec, EnvSpec, ModelSpec, Path, generate_with};
use nm_controlplane::analytics::{
    Analytics, DAY_MS, Dimension, WINDOW_DAYS, experiment_simulate, simulate,
};
use nm_controlplane::{Store, now_ms};
use sea_orm::ConnectionTrait;

const TARGET_MS: f64 = 2_000.0;
const AGENTS: usize = 20;
/// Signals (and requests) per session: 1 + mean regenerations.
const REGENERATIONS: f64 = 0.2;

#[derive(Debug, Parser)]
#[command(
    about = "One agent's analytics with a million signals and requests stored, on SQLite and PostgreSQL"
)]
struct Cli {
    /// Signals to store (and about as many requests).
    #[arg(long, default_value_t = 1_000_000)]
    signals: usize,
    /// Share of the traffic that belongs to the measured agent `big-agent`.
    #[arg(long, default_value_t = 0.4)]
    share: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    #[command(flatten)]
    db: DatabaseArgs,
    /// Keep the SQLite file and the PostgreSQL database (their URLs are printed).
    #[arg(long)]
    keep: bool,
    /// Measure the statistics (false claims at any look, power) instead of the queries.
    #[arg(long)]
    power: bool,
    /// Simulate explicit-only against explicit + implicit evidence instead of the queries.
    #[arg(long)]
    implicit: bool,
    /// Simulate experiments (issue 33) through the decision rule, a look after every unit:
    /// `--agents` experiments per row.
    #[arg(long)]
    experiments: bool,
    /// Simulated agents per row of the `--power` and `--implicit` tables.
    #[arg(long, default_value_t = 4_000)]
    agents: u64,
}

fn specs(cli: &Cli) -> Vec<AgentSpec> {
    let sessions = (cli.signals as f64 / (1.0 + REGENERATIONS)).round() as usize;
    let big = (sessions as f64 * cli.share.clamp(0.0, 1.0)).round() as usize;
    let rest = (sessions - big) / (AGENTS - 1);
    (0..AGENTS)
        .map(|i| {
            let name = if i == 0 {
                "big-agent".to_owned()
            } else {
                format!("agent-{i:02}")
            };
            let mut spec = AgentSpec::new(
                &name,
                if i == 0 { big } else { rest },
                vec![
                    ModelSpec::new("openai", "gpt-4o", 0.74, 9_000),
                    ModelSpec {
                        ttfb_ms: 1_800.0,
                        ..ModelSpec::new("anthropic", "claude-sonnet-4-5", 0.66, 11_000)
                    },
                    ModelSpec::new("openai", "gpt-4o-mini", 0.72, 600),
                ],
            );
            spec.regenerations = REGENERATIONS;
            spec.users = 5_000;
            spec.user_skew = 1.1;
            spec.slow_abandon_per_sec = 0.05;
            spec.envs = ["production", "staging", "development"]
                .iter()
                .zip([0.8, 0.15, 0.05])
                .map(|(env, weight)| EnvSpec {
                    env: (*env).to_owned(),
                    weight,
                    success_shift: 0.0,
                })
                .collect();
            spec
        })
        .collect()
}

struct Timed {
    name: String,
    detail: String,
    min_ms: f64,
    median_ms: f64,
}

async fn time<T, F, Fut>(runs: u32, mut f: F) -> anyhow::Result<(Vec<f64>, T)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut ms = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        let started = Instant::now();
        last = Some(f().await?);
        ms.push(started.elapsed().as_secs_f64() * 1_000.0);
    }
    ms.sort_by(f64::total_cmp);
    Ok((ms, last.ok_or_else(|| anyhow!("no run"))?))
}

async fn bench_database(
    cli: &Cli,
    system: &str,
    url: &str,
    now: i64,
    out: &mut impl Write,
) -> anyhow::Result<Vec<Timed>> {
    let store = Store::connect(url).await?;
    let specs = specs(cli);
    let started = Instant::now();
    let written = generate_with(&store, &specs, cli.seed, now, 10_000, Path::Direct).await?;
    let fill = started.elapsed().as_secs_f64();
    writeln!(
        out,
        "{system}: stored {} signals, {} requests, {} sessions in {fill:.1} s",
        written.signals, written.requests, written.sessions
    )?;
    if system == "postgresql" {
        let started = Instant::now();
        store.conn().execute_unprepared("VACUUM ANALYZE").await?;
        writeln!(
            out,
            "  VACUUM ANALYZE {:.1} s",
            started.elapsed().as_secs_f64()
        )?;
    }
    out.flush()?;

    let analytics = Analytics::new(store.clone());
    let mut timed = Vec::new();
    for agent in ["big-agent", "agent-07"] {
        let (ms, r) = time(cli.runs, || async {
            Ok(analytics.compute(agent, now).await?)
        })
        .await?;
        let kinds: Vec<&str> = r.recommendations.iter().map(|x| x.kind.as_str()).collect();
        timed.push(Timed {
            name: format!("recommendations {agent}"),
            detail: format!(
                "{} signals, {} sessions; {}",
                r.progress.signals,
                r.summary.as_ref().map_or(0, |s| s.sessions),
                kinds.join(", ")
            ),
            min_ms: ms[0],
            median_ms: ms[ms.len() / 2],
        });
    }
    let (ms, (_, rows)) = time(cli.runs, || async {
        Ok(analytics
            .outcome_rates(
                "big-agent",
                &[Dimension::Model, Dimension::Env, Dimension::Week],
                Some(now - WINDOW_DAYS * DAY_MS),
                Some(now),
                0,
            )
            .await?)
    })
    .await?;
    timed.push(Timed {
        name: "outcome rates big-agent by model,env,week".to_owned(),
        detail: format!("{} rows", rows.len()),
        min_ms: ms[0],
        median_ms: ms[ms.len() / 2],
    });
    store.close().await?;
    Ok(timed)
}

async fn run_all(
    cli: &Cli,
    dir: &std::path::Path,
    pg: Option<&ScratchPg>,
    out: &mut impl Write,
) -> anyhow::Result<Vec<(String, Vec<Timed>)>> {
    let now = now_ms();
    let mut results = Vec::new();
    if !cli.db.no_sqlite {
        let url = format!("sqlite://{}/bench.db?mode=rwc", dir.display());
        results.push((
            "sqlite".to_owned(),
            bench_database(cli, "sqlite", &url, now, out).await?,
        ));
    }
    if let Some(pg) = pg {
        results.push((
            "postgresql".to_owned(),
            bench_database(cli, "postgresql", &pg.url, now, out).await?,
        ));
    }
    Ok(results)
}

/// Prints a simulation's report to stdout, then how long it took.
fn simulated(
    report: impl FnOnce(&mut std::io::StdoutLock<'static>) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut out = std::io::stdout().lock();
    report(&mut out)?;
    writeln!(out)?;
    writeln!(
        out,
        "(simulated in {:.0} s)",
        started.elapsed().as_secs_f64()
    )?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.power {
        return simulated(|out| simulate::report(cli.agents, cli.seed, out));
    }
    if cli.experiments {
        return simulated(|out| experiment_simulate::report(cli.agents, cli.seed, out));
    }
    if cli.implicit {
        return simulated(|out| simulate::implicit_report(cli.agents, cli.seed, out));
    }
    if cli.signals < 1_000 {
        bail!("--signals must be at least 1000");
    }
    // Before the temporary directory, so a failure leaves nothing behind.
    let pg = cli.db.scratch_pg("nm_analytics_bench").await?;
    let dir: PathBuf =
        std::env::temp_dir().join(format!("nm-analytics-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "analytics: {} signals and as many requests, {AGENTS} agents, big-agent {:.0}% of the traffic, seed {}, {} runs each",
        cli.signals,
        cli.share * 100.0,
        cli.seed,
        cli.runs
    )?;
    let result = tokio::select! {
        r = run_all(&cli, &dir, pg.as_ref(), &mut out) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    if cli.keep {
        eprintln!(
            "kept the SQLite database: sqlite://{}/bench.db",
            dir.display()
        );
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    if let Some(pg) = pg.filter(|pg| {
        if cli.keep {
            eprintln!("kept the PostgreSQL database: {}", pg.url);
        }
        !cli.keep
    }) {
        let name = pg.name.clone();
        if let Err(e) = pg.drop_it().await {
            eprintln!("could not drop the PostgreSQL database {name}: {e}");
        }
    }
    let mut verdicts = Vec::new();
    for (system, timed) in result? {
        writeln!(out)?;
        writeln!(
            out,
            "{system}\n  {:<45} {:>9} {:>10}  < {TARGET_MS:.0} ms",
            "query", "min ms", "median ms"
        )?;
        let mut pass = true;
        for t in &timed {
            let ok = t.median_ms < TARGET_MS;
            pass &= ok;
            writeln!(
                out,
                "  {:<45} {:>9.1} {:>10.1}  {}  ({})",
                t.name,
                t.min_ms,
                t.median_ms,
                if ok { "PASS" } else { "FAIL" },
                t.detail
            )?;
        }
        verdicts.push(format!("{system} {}", if pass { "PASS" } else { "FAIL" }));
    }
    writeln!(out)?;
    writeln!(
        out,
        "target (every median < {TARGET_MS:.0} ms): {}",
        verdicts.join(", ")
    )?;
    Ok(())
}
