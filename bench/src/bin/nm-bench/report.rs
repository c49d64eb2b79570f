//! The report: ratios per round, the checks, and the tables or JSON.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use crate::mock::Canned;
use crate::processes::user_name;
use crate::{
    Cli, KIB_PER_MIB, MAX_ADDED_P50_RATIO, MAX_PEAK_RSS_MIB, MIN_ADDED_MS,
    MIN_METERED_THROUGHPUT_RATIO, MIN_THROUGHPUT_RATIO, SCENARIOS, STREAM_CHUNKS, Target,
    TargetRun, USERS,
};

/// Tracing off may cost nothing against the gateway from before tracing: anything at or above
/// this throughput ratio is within the VM's run-to-run noise (±15%).
const MIN_BEFORE_THROUGHPUT_RATIO: f64 = 0.85;
/// Tracing every request, exported to a local collector, may cost at most 10% of throughput.
const MIN_TRACED_THROUGHPUT_RATIO: f64 = 0.90;
/// Tracing on but sampling nothing may cost at most 2%.
const MIN_UNSAMPLED_THROUGHPUT_RATIO: f64 = 0.98;

/// The pairs of gateway targets compared (`of` req/s / `over` req/s, at least the limit), those
/// of them a run has.
const VERSUS: [(Target, Target, f64); 4] = [
    (
        Target::Gateway,
        Target::GatewayUnmetered,
        MIN_METERED_THROUGHPUT_RATIO,
    ),
    (
        Target::Gateway,
        Target::GatewayBefore,
        MIN_BEFORE_THROUGHPUT_RATIO,
    ),
    (
        Target::GatewayTraced,
        Target::Gateway,
        MIN_TRACED_THROUGHPUT_RATIO,
    ),
    (
        Target::GatewayUnsampled,
        Target::Gateway,
        MIN_UNSAMPLED_THROUGHPUT_RATIO,
    ),
];

/// A ratio check before it is judged: what, each round's ratio, the ratio of the median
/// figures, the operator and the limit ([`Check::paired`]).
type PairedCheck = (String, Vec<Option<f64>>, Option<f64>, &'static str, f64);

/// The run of `t` among `runs`.
fn run_of(runs: &[TargetRun], t: Target) -> Option<&TargetRun> {
    runs.iter().find(|r| r.target == t.name())
}

/// One round's ratios, per scenario: the gateway against the other targets of the same round.
pub(crate) struct RoundRatios {
    /// Gateway req/s / forwarder req/s.
    pub(crate) throughput: [f64; 2],
    /// The gateway targets compared with each other ([`VERSUS`]).
    pub(crate) versus: Vec<Versus>,
    /// Gateway added p50 / forwarder added p50; None when the forwarder added under
    /// [`MIN_ADDED_MS`] (the ratio is then noise).
    pub(crate) added_p50: [Option<f64>; 2],
}

/// `of` against `over`: req/s ratio per scenario.
pub(crate) struct Versus {
    pub(crate) of: Target,
    pub(crate) over: Target,
    pub(crate) limit: f64,
    pub(crate) throughput: [f64; 2],
}

impl RoundRatios {
    pub(crate) fn of(runs: &[TargetRun]) -> Self {
        let rps = |t: Target, s: usize| {
            run_of(runs, t).map_or(f64::NAN, |r| r.scenarios[s].closed_loop.requests_per_s)
        };
        let p50 = |t: Target, s: usize| {
            run_of(runs, t).map_or(f64::NAN, |r| r.scenarios[s].open_loop.p50_ms)
        };
        let ratio = |of: Target, over: Target| {
            [0, 1].map(|s| rps(of, s) / rps(over, s).max(f64::MIN_POSITIVE))
        };
        let versus = VERSUS
            .into_iter()
            .filter(|(of, over, _)| run_of(runs, *of).is_some() && run_of(runs, *over).is_some())
            .map(|(of, over, limit)| Versus {
                of,
                over,
                limit,
                throughput: ratio(of, over),
            })
            .collect();
        Self {
            throughput: ratio(Target::Gateway, Target::Forwarder),
            versus,
            added_p50: [0, 1].map(|s| {
                let direct = p50(Target::Direct, s);
                let forwarder = p50(Target::Forwarder, s) - direct;
                (forwarder >= MIN_ADDED_MS).then(|| (p50(Target::Gateway, s) - direct) / forwarder)
            }),
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count); None when empty.
pub(crate) fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// Latency a target adds over `direct`, in ms.
#[derive(Serialize)]
pub(crate) struct Added {
    pub(crate) scenario: &'static str,
    pub(crate) target: &'static str,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
}

/// What a mechanism costs: one gateway target against another (metering: the gateway against
/// gateway-unmetered; tracing: gateway-traced and gateway-unsampled against the gateway, the
/// gateway against gateway-before).
#[derive(Serialize)]
pub(crate) struct Cost {
    pub(crate) scenario: &'static str,
    pub(crate) of: &'static str,
    pub(crate) over: &'static str,
    /// `of` req/s / `over` req/s (closed loop).
    pub(crate) throughput_ratio: f64,
    /// `of`'s open-loop latency minus `over`'s, ms.
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
}

#[derive(Serialize)]
pub(crate) struct Check {
    pub(crate) check: String,
    pub(crate) value: f64,
    pub(crate) target: String,
    /// None: the measurement cannot decide (see [`MIN_ADDED_MS`]).
    pub(crate) pass: Option<bool>,
    /// With several rounds, a ratio check's value is the median of these, each round's own
    /// ratio (None: undecided in that round).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) rounds: Vec<Option<f64>>,
    /// With several rounds, the same ratio taken between the targets' median figures instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) of_medians: Option<f64>,
}

impl Check {
    pub(crate) fn new(check: String, value: f64, op: &str, limit: f64) -> Self {
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
    pub(crate) fn paired(
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
pub(crate) struct Report {
    pub(crate) config: Value,
    pub(crate) targets: Vec<TargetRun>,
    pub(crate) added_latency: Vec<Added>,
    pub(crate) costs: Vec<Cost>,
    pub(crate) checks: Vec<Check>,
}

impl Report {
    pub(crate) fn new(
        cli: &Cli,
        gateway_bin: &Path,
        targets: Vec<TargetRun>,
        paired: &[RoundRatios],
    ) -> Self {
        let mut added_latency = Vec::new();
        let mut costs = Vec::new();
        let mut checks = Vec::new();
        // The same ratios as each round's, between the targets' median figures.
        let medians = RoundRatios::of(&targets);
        let open = |t: Target, s: usize| run_of(&targets, t).map(|r| &r.scenarios[s].open_loop);
        for (s, scenario) in SCENARIOS.into_iter().enumerate() {
            if let Some(direct) = open(Target::Direct, s) {
                for run in targets.iter().filter(|r| r.target != Target::Direct.name()) {
                    let o = &run.scenarios[s].open_loop;
                    added_latency.push(Added {
                        scenario,
                        target: run.target,
                        p50_ms: o.p50_ms - direct.p50_ms,
                        p99_ms: o.p99_ms - direct.p99_ms,
                    });
                }
            }
            let mut checked: Vec<PairedCheck> = vec![
                (
                    "gateway added p50 / forwarder added p50".to_owned(),
                    paired.iter().map(|r| r.added_p50[s]).collect(),
                    medians.added_p50[s],
                    "<=",
                    MAX_ADDED_P50_RATIO,
                ),
                (
                    "gateway req/s / forwarder req/s".to_owned(),
                    paired.iter().map(|r| Some(r.throughput[s])).collect(),
                    Some(medians.throughput[s]),
                    ">=",
                    MIN_THROUGHPUT_RATIO,
                ),
            ];
            for (i, v) in medians.versus.iter().enumerate() {
                checked.push((
                    format!("{} req/s / {} req/s", v.of.name(), v.over.name()),
                    paired
                        .iter()
                        .map(|r| Some(r.versus[i].throughput[s]))
                        .collect(),
                    Some(v.throughput[s]),
                    ">=",
                    v.limit,
                ));
                if let (Some(of), Some(over)) = (open(v.of, s), open(v.over, s)) {
                    costs.push(Cost {
                        scenario,
                        of: v.of.name(),
                        over: v.over.name(),
                        throughput_ratio: v.throughput[s],
                        p50_ms: of.p50_ms - over.p50_ms,
                        p99_ms: of.p99_ms - over.p99_ms,
                    });
                }
            }
            for (what, rounds, of_medians, op, limit) in checked {
                let what = format!("{scenario}: {what}");
                checks.push(Check::paired(what, rounds, of_medians, op, limit));
            }
        }
        let peak = run_of(&targets, Target::Gateway)
            .and_then(|r| r.memory)
            .map_or(f64::NAN, |m| m.vm_hwm_kib as f64 / KIB_PER_MIB);
        let what = "gateway peak RSS (VmHWM), MiB".to_owned();
        checks.push(Check::new(what, peak, "<", MAX_PEAK_RSS_MIB));
        for run in targets.iter().filter(|r| r.usage.is_some()) {
            let errors = (run.scenarios.iter())
                .map(|m| m.closed_loop.errors + m.open_loop.errors)
                .sum::<u64>() as f64;
            let what = format!("{} errors", run.target);
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
            costs,
            checks,
        }
    }

    pub(crate) fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
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
        for (s, scenario) in SCENARIOS.into_iter().enumerate() {
            let bytes = &c["response_bytes"][s];
            let detail = match s {
                0 => format!("{bytes} B JSON with usage"),
                _ => format!(
                    "{STREAM_CHUNKS} SSE content chunks + finish + usage + [DONE], {bytes} B"
                ),
            };
            writeln!(out, "\n== {scenario} ({detail}) ==")?;
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
            let added: Vec<String> = (self.added_latency.iter())
                .filter(|a| a.scenario == scenario)
                .map(|a| {
                    format!(
                        "{} p50 {:+.3} ms, p99 {:+.3} ms",
                        a.target, a.p50_ms, a.p99_ms
                    )
                })
                .collect();
            writeln!(out, "added over direct: {}", added.join("; "))?;
            for cost in self.costs.iter().filter(|c| c.scenario == scenario) {
                writeln!(
                    out,
                    "{} vs {}: req/s ratio {:.3}; p50 {:+.3} ms, p99 {:+.3} ms",
                    cost.of, cost.over, cost.throughput_ratio, cost.p50_ms, cost.p99_ms
                )?;
            }
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
