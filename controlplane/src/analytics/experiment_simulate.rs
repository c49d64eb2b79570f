//! Experiments on synthetic ground truth, through the real decision rule ([`super::experiment`]):
//! units arrive one by one, each assigned to an arm at random in equal shares with a success
//! drawn at its arm's true rate, and the experiment is evaluated after **every** unit, as the
//! most impatient operator would look. Measured by `nm-analytics-bench --experiments`; the
//! tests run a smaller version.

use super::experiment::{ArmCounts, decide};
use super::synthetic::Rng;

/// What many simulated experiments of the same truth did.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcomes {
    pub runs: u64,
    /// Decided for an arm with the highest true rate.
    pub right: u64,
    /// Decided for another arm (every decision, when the rates are equal).
    pub wrong: u64,
    /// Judged units at each decision, sorted.
    pub units: Vec<u64>,
}

impl Outcomes {
    pub fn median_units(&self) -> Option<u64> {
        (!self.units.is_empty()).then(|| self.units[self.units.len() / 2])
    }
}

/// `runs` experiments with arms of true success rates `rates`, each until a decision or
/// `max_units` judged units, from seeds `seed + i`.
pub fn run(rates: &[f64], runs: u64, max_units: u64, seed: u64) -> Outcomes {
    let best = rates.iter().copied().fold(f64::MIN, f64::max);
    let mut out = Outcomes {
        runs,
        right: 0,
        wrong: 0,
        units: Vec::new(),
    };
    for i in 0..runs {
        let mut rng = Rng::new(seed.wrapping_add(i));
        let mut arms: Vec<ArmCounts> = (0..rates.len())
            .map(|k| ArmCounts {
                name: format!("arm{k}"),
                ..ArmCounts::default()
            })
            .collect();
        for unit in 1..=max_units {
            let k = rng.below(rates.len() as u64) as usize;
            let a = &mut arms[k];
            a.sessions += 1;
            a.judged += 1;
            a.successes += u64::from(rng.chance(rates[k]));
            if let Some(winner) = decide(&arms) {
                if rates[winner] == best && rates.iter().any(|r| *r != best) {
                    out.right += 1;
                } else {
                    out.wrong += 1;
                }
                out.units.push(unit);
                break;
            }
        }
    }
    out.units.sort_unstable();
    out
}

/// The `--experiments` table: equal arms (false decisions at any look) and real differences
/// (decided for the right arm, median units to a decision), `runs` experiments a row.
pub fn report(runs: u64, seed: u64, out: &mut impl std::io::Write) -> std::io::Result<()> {
    const MAX_UNITS: u64 = 5_000;
    writeln!(
        out,
        "### Experiments, a look after every unit ({runs} runs a row, at most {MAX_UNITS} \
         judged units, seed {seed})"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| true rates | decided right | decided wrong | undecided | median units to a decision |"
    )?;
    writeln!(out, "|---|---|---|---|---|")?;
    let rows: [&[f64]; 6] = [
        &[0.55, 0.55],
        &[0.20, 0.20],
        &[0.55, 0.55, 0.55],
        &[0.55, 0.70],
        &[0.55, 0.60],
        &[0.55, 0.55, 0.70],
    ];
    for rates in rows {
        let o = run(rates, runs, MAX_UNITS, seed);
        let pct = |n: u64| 100.0 * n as f64 / runs as f64;
        writeln!(
            out,
            "| {} | {:.1}% | {:.1}% | {:.1}% | {} |",
            rates
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" vs "),
            pct(o.right),
            pct(o.wrong),
            pct(runs - o.right - o.wrong),
            o.median_units().map_or("-".to_owned(), |u| u.to_string()),
        )?;
    }
    Ok(())
}
