//! Statistics for recommendations: anytime-valid intervals and the comparisons that decide when
//! evidence is enough, however often the answer is recomputed.
//!
//! Everything here is a pure, deterministic function of counts (and, for the running
//! intersection, of the intervals an earlier look kept): no I/O and no random numbers, so the
//! same data always gives the same recommendations.
//!
//! # Why anytime-valid
//!
//! The controlplane recomputes every agent every `NM_ANALYTICS_INTERVAL_SECS` as signals
//! arrive, and a user acts on whatever the answer says at that moment. A fixed-sample 95%
//! interval is right for one look at the data; looked at again after every batch, the chance
//! that *some* look shows a false difference grows with the number of looks (equal models,
//! 18 looks from 120 to 800 sessions: about 20%). So every interval here is a *confidence
//! sequence*: a sequence of intervals `C₁, C₂, …` that contain the true rate at **every** sample
//! size at once with probability `1 − α`, so that looking at any of them, at any times chosen in
//! any way (even by peeking at the data), keeps the error at `α`.
//!
//! # One rate: a beta-binomial mixture (exact)
//!
//! For a rate `p` and `s` successes out of `n`, the likelihood ratio of a rate `θ` against `p`,
//! mixed over `θ ~ Beta(c·p, c·(1 − p))`,
//!
//! ```text
//! Mₙ(p) = ∫ θˢ (1 − θ)ⁿ⁻ˢ dBeta(θ) / (pˢ (1 − p)ⁿ⁻ˢ)
//!       = B(c·p + s, c·(1 − p) + n − s) / (B(c·p, c·(1 − p)) · pˢ (1 − p)ⁿ⁻ˢ)
//! ```
//!
//! is a nonnegative martingale with mean 1 when `p` is the true rate (each session's outcome
//! multiplies it by a factor of conditional mean 1). Ville's inequality, `P(∃n: Mₙ(p) ≥ 1/α) ≤ α`,
//! makes `Cₙ = {p : Mₙ(p) < 1/α}` a confidence sequence: exact, not asymptotic, for any `n` (a
//! conjugate mixture in the sense of Howard et al. 2021; for Bernoulli outcomes, Robbins'
//! beta-binomial mixture). The prior's weight `c` ([`MIXTURE_SESSIONS`], 40 sessions) tunes where
//! the sequence is tightest: a few hundred sessions per arm, where the decisions are made (measured
//! by `nm-analytics-bench --power`). At a given `n` the sequence is wider than a Wilson interval of
//! the same level (about `z = 3.0–3.3` instead of 1.96 at 95%): that is the price of looking as
//! often as one likes.
//!
//! # One-sided claims
//!
//! A rule whose claim has one direction fixed before looking (a rate *above* its level, a
//! cheaper model *not worse* by the margin, slow answers abandoned *more*) needs only one
//! bound. Cutting the mixture's prior to the rates on the claim's side of `p` and renormalizing
//! it gives `M⁺ₙ(p)`, still a mixture of likelihood ratios by a probability measure, so still a
//! martingale of mean 1 and exact by Ville's inequality ([`ln_one_sided_mixture`],
//! [`one_sided_bound`]); where the data sit on that side it is about twice `Mₙ(p)`, so a
//! one-sided bound at `α` is about as tight as a two-sided one at `2α`: some 10% fewer
//! sessions for the same claim. Choosing the direction after looking (which model is best,
//! which way a trend went) still takes the two-sided sequence.
//!
//! # Differences and multiplicity
//!
//! The interval of a difference `rate(b) − rate(a)` combines the two arms' sequences the way
//! Newcombe's hybrid score interval combines Wilson intervals (square and add the distances from
//! each estimate to its bounds). Like Newcombe's, this combination is approximate (it treats the
//! two deviations as independent and normal); the simulations in `simulate.rs` check that the
//! chance of ever excluding a true difference of 0 stays under `α` at every rate and allocation
//! tried. A question that makes `m` comparisons runs each at `α/m` (Bonferroni); a union bound
//! is time-uniform too, so the family-wise error over all looks stays at [`FAMILY_ALPHA`]. (The
//! bound takes the arms as fixed: when a third model reaches 30 sessions, `m` grows from 1 to 3
//! and its comparisons start at the new level.)
//!
//! The p-value shown is the *always-valid* p-value of this look (Johari et al.): the smallest
//! `α` at which this look's sequence excludes equality, so `p ≤ α` at some look has probability
//! at most `α` under equality, whatever the looks.
//!
//! # Running intersection
//!
//! If `Cₙ` is a confidence sequence for a fixed rate, so is `C₁ ∩ … ∩ Cₙ` (the event "every `Cₙ`
//! covers the rate" is the same for both; Howard et al. 2021): the intervals only shrink, so a
//! claim, once the evidence supports it, is not taken back by the next batch's noise.
//! [`Intersections`] keeps them per comparison across looks; the caller carries them only while
//! the data only grows (within one stretch of the agent's life, below). An empty intersection
//! means the sessions no longer behave like the earlier ones: that comparison restarts from the
//! current look.
//!
//! # The guarantee: the whole life of an agent
//!
//! A confidence sequence is valid over one sample that only grows. An agent's recommendations
//! follow its recent sessions, so `super::periods_at` cuts its life into *stretches* in which
//! the sessions compared only grow: for the window's rules its first 60 days, then each further
//! 30 days (the window starting 30 days before the stretch); for the trend, each calendar week
//! (this week so far against the last). Stretch `k` (counted from the agent's first signal,
//! which is stored with the answer and never moves) spends `6/(π² k²)` of [`FAMILY_ALPHA`]
//! ([`stretch_share`]; [`Intersections::spending`]): 60.8% in the first, 15.2% in the second,
//! 6.8% in the third. The shares sum to 1 (`Σ 1/k² = π²/6`), so by a union bound over the
//! stretches:
//!
//! > for one agent and one rule, over the agent's whole life, with a recompute at any schedule
//! > (even one chosen by looking at the answers), the probability that any look shows a false
//! > claim is at most 5%
//!
//! (exact for the level rules, which rest on one sequence each; for the differences, as exact
//! as their combination, checked by simulation in `simulate.rs`: 18 and 48 looks on every
//! rule's null situation, and whole lives of 180 days looked at up to three times a day). A
//! false claim is one about the sessions its look compares: equal models that stay equal.
//! The price: a later stretch decides at a stricter level (stretch 2 at 0.76%, stretch 10 at
//! 0.03%), so it needs more sessions for the same effect; but its window starts with 30 days
//! of sessions. Without the spending, each stretch would spend the whole 5%: a year of
//! recomputes (up to 12 a day) showed a false best model to 13.6% of equal-models agents,
//! against 3.6% with it (docs/analytics.md has the figures).
//!
//! Each decision returns its [`Evidence`] (counts, rates, intervals, the difference, the
//! always-valid p-value and the Bayesian probability that one arm is better), so a
//! recommendation can show why it was made.
//!
//! References:
//! - S. R. Howard, A. Ramdas, J. McAuliffe, J. Sekhon, "Time-uniform, nonparametric,
//!   nonasymptotic confidence sequences", Annals of Statistics 49(2) (2021) 1055–1080.
//! - R. Johari, P. Koomen, L. Pekelis, D. Walsh, "Always valid inference: continuous monitoring
//!   of A/B tests", Operations Research 70(3) (2022) 1806–1821.
//! - H. Robbins, "Statistical methods related to the law of the iterated logarithm", Annals of
//!   Mathematical Statistics 41(5) (1970) 1397–1409 (the beta-binomial mixture).
//! - J. Ville, *Étude critique de la notion de collectif* (1939) (the maximal inequality).
//! - R. G. Newcombe, "Interval estimation for the difference between independent proportions:
//!   comparison of eleven methods", Statistics in Medicine 17 (1998) 873–890.
//! - E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
//!   JASA 22 (1927) 209–212 (the fixed-sample interval the sequences replaced; kept for the
//!   before/after comparison).
//! - C. Lanczos, "A precise approximation of the gamma function", SIAM J. Numerical Analysis
//!   B1 (1964) 86–96.
//! - G. Marsaglia, "Evaluating the normal distribution", J. Statistical Software 11(4) (2004).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Fewest observations an arm needs before it is compared at all: below this, intervals are
/// too wide to separate anything but extreme differences.
pub const MIN_SAMPLES_PER_ARM: u64 = 30;

/// Family-wise false-claim rate: the chance, when a claim is false, that a question (with all
/// its comparisons) shows it at any look at a growing set of sessions.
pub const FAMILY_ALPHA: f64 = 0.05;

/// How much lower (absolute, on a rate in `[0, 1]`) a cheaper arm's success rate may be and
/// still "perform as well": 5 percentage points.
pub const NON_INFERIORITY_MARGIN: f64 = 0.05;

/// The weight, in sessions, of the beta prior of the mixture (see the module doc): the
/// sequences are tightest at about ten times this many sessions per arm. 20 to 80 give the
/// same power within a look or two on the benchmark's effects; 40 is in the middle.
pub const MIXTURE_SESSIONS: f64 = 40.0;

/// The top users in cost concentration: the top 10% of end users by cost (at least one).
pub const TOP_USERS_PERCENT: u64 = 10;

/// Cost is concentrated when the top [`TOP_USERS_PERCENT`] of users take at least this share of
/// it: half the spend from a tenth of the users, five times their even share. (For scale: a
/// Pareto "80/20" spread puts about 73% of the spend in the top tenth.)
pub const CONCENTRATED_TOP_SHARE: f64 = 0.5;

/// Fewest users for a concentration verdict: with fewer, "the top 10%" is one user and the
/// verdict says more about the sample than about the spend.
pub const MIN_USERS_FOR_CONCENTRATION: usize = 20;

/// The smallest p-value reported: below it, "p < 1e-12".
pub const P_VALUE_FLOOR: f64 = 1e-12;

/// Grid points for the posterior integral in [`prob_greater`].
const POSTERIOR_GRID: usize = 4096;
/// The posterior grid spans this many standard deviations either side of each arm's mean.
const POSTERIOR_SPAN_SDS: f64 = 12.0;
/// Beyond this |x| the normal tail is below 1e-17 and [`normal_cdf`] returns 0 or 1.
const NORMAL_CDF_LIMIT: f64 = 8.5;
/// ln √(2π).
const LN_SQRT_2PI: f64 = 0.918_938_533_204_672_8;
/// The rates searched for a sequence's bounds stay this far inside `(0, 1)`.
const RATE_EDGE: f64 = 1e-12;
/// A bound is found to within this (absolute, on the rate).
const BOUND_TOLERANCE: f64 = 1e-9;
/// From this argument on, [`ln_gamma`] uses Stirling's series (error below 1e-12).
const STIRLING_FROM: f64 = 10.0;

// === impl Proportion ===

/// `successes` out of `n` observations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Proportion {
    pub successes: u64,
    pub n: u64,
}

impl Proportion {
    /// A proportion; successes above `n` are clamped to `n`.
    pub const fn new(successes: u64, n: u64) -> Self {
        let successes = if successes > n { n } else { successes };
        Self { successes, n }
    }

    /// `successes / n`, or 0 when `n` is 0.
    pub fn rate(self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.successes.min(self.n) as f64 / self.n as f64
        }
    }

    /// `n - successes`.
    pub fn failures(self) -> u64 {
        self.n.saturating_sub(self.successes)
    }

    /// Both proportions pooled.
    pub fn merge(self, other: Self) -> Self {
        Self::new(
            self.successes.saturating_add(other.successes),
            self.n.saturating_add(other.n),
        )
    }

    /// The anytime-valid interval of the rate at level `1 − alpha` (see
    /// [`confidence_sequence`]).
    pub fn sequence(self, alpha: f64) -> Interval {
        confidence_sequence(self.successes, self.n, alpha).into()
    }

    /// The fixed-sample Wilson score interval of the rate (see [`wilson_interval`]).
    pub fn wilson(self, z: f64) -> Interval {
        wilson_interval(self.successes, self.n, z).into()
    }
}

/// A closed interval `[lower, upper]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub lower: f64,
    pub upper: f64,
}

impl Interval {
    pub fn contains(self, x: f64) -> bool {
        self.lower <= x && x <= self.upper
    }

    /// Both intervals' common part; `None` when they do not overlap.
    pub fn intersect(self, other: Self) -> Option<Self> {
        let i = Self {
            lower: self.lower.max(other.lower),
            upper: self.upper.min(other.upper),
        };
        (i.lower <= i.upper).then_some(i)
    }
}

impl From<(f64, f64)> for Interval {
    fn from((lower, upper): (f64, f64)) -> Self {
        Self { lower, upper }
    }
}

// === normal distribution ===

/// The standard normal CDF Φ(x).
///
/// Marsaglia's series `Φ(x) = 1/2 + φ(x)·(x + x³/3 + x⁵/(3·5) + x⁷/(3·5·7) + …)`: every term has
/// the sign of `x`, so the sum has no cancellation and the absolute error is about 1e-15. For
/// `|x| > 8.5` the tail is below 1e-17 and the result is 0 or 1.
pub fn normal_cdf(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    if x <= -NORMAL_CDF_LIMIT {
        return 0.0;
    }
    if x >= NORMAL_CDF_LIMIT {
        return 1.0;
    }
    let q = x * x;
    let mut term = x;
    let mut sum = x;
    let mut k = 1.0;
    // Terms grow until k passes x² (at most ~73 at the limit), then shrink geometrically.
    for _ in 0..1000 {
        k += 2.0;
        term *= q / k;
        let next = sum + term;
        if next == sum {
            break;
        }
        sum = next;
    }
    (0.5 + sum * (-0.5 * q - LN_SQRT_2PI).exp()).clamp(0.0, 1.0)
}

/// The standard normal quantile Φ⁻¹(p), by bisection on [`normal_cdf`] (deterministic, accurate
/// to the CDF's 1e-15). Returns ±∞ at 0 and 1, NaN outside `[0, 1]`.
pub fn normal_quantile(p: f64) -> f64 {
    if p.is_nan() || !(0.0..=1.0).contains(&p) {
        return f64::NAN;
    }
    if p == 0.0 {
        return f64::NEG_INFINITY;
    }
    if p == 1.0 {
        return f64::INFINITY;
    }
    let (mut lo, mut hi) = (-NORMAL_CDF_LIMIT, NORMAL_CDF_LIMIT);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The fixed-sample critical value for a two-sided test at family level [`FAMILY_ALPHA`] split
/// over `comparisons` (Bonferroni): `Φ⁻¹(1 − α / (2m))`. 1.96 for one comparison.
pub fn bonferroni_z(comparisons: u32) -> f64 {
    normal_quantile(1.0 - bonferroni_alpha(comparisons) / 2.0)
}

/// The per-comparison two-sided level: `FAMILY_ALPHA / m` (`m` of 0 counts as 1).
pub fn bonferroni_alpha(comparisons: u32) -> f64 {
    FAMILY_ALPHA / f64::from(comparisons.max(1))
}

/// The share of the family level that stretch `k` (1, 2, …) of an agent's life may spend:
/// `6 / (π² k²)`, which sums to 1 over all stretches (`Σ 1/k² = π²/6`), so the chance of a
/// false claim in *any* stretch of the agent's life is at most [`FAMILY_ALPHA`]: 60.8% of it for
/// the first stretch, 15.2% for the second, 6.8% for the third (see the module doc). Stretch
/// 0 spends nothing (a stretch with no data to compare: the trend in the agent's first week).
pub fn stretch_share(k: u64) -> f64 {
    if k == 0 {
        return 0.0;
    }
    let k = k as f64;
    6.0 / (std::f64::consts::PI * std::f64::consts::PI * k * k)
}

// === fixed-sample intervals (one look) ===

/// The Wilson score interval for `successes` out of `n` at normal critical value `z` (1.96 for
/// 95%), valid for **one** look at a sample of fixed size:
///
/// ```text
/// p̂ = s/n,   centre = (p̂ + z²/2n) / (1 + z²/n),
/// half-width = z/(1 + z²/n) · √(p̂(1 − p̂)/n + z²/4n²)
/// ```
///
/// The rules no longer decide on it (see the module doc); the before/after comparison of
/// `simulate.rs` does. `n = 0` gives `(0, 1)`; successes above `n` are clamped.
pub fn wilson_interval(successes: u64, n: u64, z: f64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let s = successes.min(n);
    let n_f = n as f64;
    let p = s as f64 / n_f;
    let z2 = z * z;
    let denom = 1.0 + z2 / n_f;
    let centre = (p + z2 / (2.0 * n_f)) / denom;
    let half = z / denom * (p * (1.0 - p) / n_f + z2 / (4.0 * n_f * n_f)).sqrt();
    // The exact bounds at the edges, free of rounding.
    let lower = if s == 0 {
        0.0
    } else {
        (centre - half).max(0.0)
    };
    let upper = if s == n {
        1.0
    } else {
        (centre + half).min(1.0)
    };
    (lower, upper)
}

/// Newcombe's hybrid score interval for `rate(b) − rate(a)` (method 10 of Newcombe 1998) from
/// Wilson intervals at `z`: the fixed-sample interval of one look.
pub fn fixed_difference_interval(a: Proportion, b: Proportion, z: f64) -> Interval {
    newcombe(a, b, a.wilson(z), b.wilson(z))
}

/// Newcombe's square-and-add combination of each arm's interval `[l, u]`:
///
/// ```text
/// d = p̂b − p̂a
/// lower = d − √((p̂b − lb)² + (ua − p̂a)²)
/// upper = d + √((ub − p̂b)² + (p̂a − la)²)
/// ```
fn newcombe(a: Proportion, b: Proportion, ia: Interval, ib: Interval) -> Interval {
    let (pa, pb) = (a.rate(), b.rate());
    let d = pb - pa;
    Interval {
        lower: d - ((pb - ib.lower).powi(2) + (ia.upper - pa).powi(2)).sqrt(),
        upper: d + ((ib.upper - pb).powi(2) + (pa - ia.lower).powi(2)).sqrt(),
    }
}

// === confidence sequences ===

/// ln Γ(x) for `x > 0`: Stirling's series from [`STIRLING_FROM`] on (four correction terms;
/// the next, `1/(1188 x⁹)`, is below 1e-12), Lanczos' approximation below (g = 7, nine terms;
/// relative error about 1e-15), with the reflection formula below 1/2.
fn ln_gamma(x: f64) -> f64 {
    if x >= STIRLING_FROM {
        let r = 1.0 / x;
        let r2 = r * r;
        let series = r * (1.0 / 12.0 - r2 * (1.0 / 360.0 - r2 * (1.0 / 1260.0 - r2 / 1680.0)));
        return (x - 0.5) * x.ln() - x + LN_SQRT_2PI + series;
    }
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Γ(x)Γ(1 − x) = π / sin(πx).
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + G + 0.5;
    let mut sum = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        sum += c / (x + i as f64);
    }
    LN_SQRT_2PI + (x + 0.5) * t.ln() - t + sum.ln()
}

/// `ln Mₙ(p)`: the log of the beta-binomial mixture martingale of the module doc at rate `p`
/// (in `(0, 1)`) after `successes` successes and `failures` failures. At most 0 at `p = s/n`;
/// it grows as `p` moves away from it (checked on a grid by the tests), and `p` is outside the
/// sequence at level `α` exactly when it reaches `ln(1/α)`.
pub fn ln_mixture(successes: u64, failures: u64, p: f64) -> f64 {
    ln_mixture_from(
        successes,
        failures,
        p,
        mixture_constant(successes + failures),
    )
}

/// The part of `ln Mₙ(p)` that does not depend on `p`: `ln Γ(c) − ln Γ(c + n)`.
fn mixture_constant(n: u64) -> f64 {
    ln_gamma(MIXTURE_SESSIONS) - ln_gamma(MIXTURE_SESSIONS + n as f64)
}

/// [`ln_mixture`] with its constant part computed once: `ln B(c·p + s, c·(1 − p) + f) −
/// ln B(c·p, c·(1 − p)) − s·ln p − f·ln(1 − p)`, the two `ln Γ` of sums `c + n` and `c` taken
/// out (they are the same at every `p`).
fn ln_mixture_from(successes: u64, failures: u64, p: f64, constant: f64) -> f64 {
    let (s, f) = (successes as f64, failures as f64);
    let (a, b) = (MIXTURE_SESSIONS * p, MIXTURE_SESSIONS * (1.0 - p));
    let mut ln = ln_gamma(a + s) + ln_gamma(b + f) - ln_gamma(a) - ln_gamma(b) + constant;
    if s > 0.0 {
        ln -= s * p.ln();
    }
    if f > 0.0 {
        ln -= f * (-p).ln_1p();
    }
    ln
}

/// The confidence sequence of a rate at level `1 − alpha`, at `successes` out of `n`: the rates
/// `p` with `Mₙ(p) < 1/α` (see the module doc), as `(lower, upper)`. `n = 0` gives `(0, 1)`;
/// successes above `n` are clamped.
///
/// Each bound is the one crossing of `ln Mₙ = ln(1/α)` on its side of the estimate. The search
/// starts from a Wilson interval at the `z` of a normal mixture of the same weight (close to the
/// answer, so a handful of evaluations bracket it), then narrows the bracket by the Illinois
/// method (regula falsi that halves the stale end's value) to 1e-9, and reports the outer end.
pub fn confidence_sequence(successes: u64, n: u64, alpha: f64) -> (f64, f64) {
    if n == 0 || alpha.is_nan() || alpha <= 0.0 {
        return (0.0, 1.0);
    }
    let s = successes.min(n);
    let f = n - s;
    let level = (1.0 / alpha.min(1.0)).ln();
    let constant = mixture_constant(n);
    let excess = |p: f64| ln_mixture_from(s, f, p, constant) - level;
    let p_hat = (s as f64 / n as f64).clamp(RATE_EDGE, 1.0 - RATE_EDGE);
    let (guess_lo, guess_hi) = sequence_guess(s, n, level);
    let lower = if s == 0 {
        0.0
    } else {
        crossing(&excess, RATE_EDGE, guess_lo, p_hat).unwrap_or(0.0)
    };
    let upper = if f == 0 {
        1.0
    } else {
        crossing(&excess, 1.0 - RATE_EDGE, guess_hi, p_hat).unwrap_or(1.0)
    };
    (lower, upper)
}

/// A first guess at a sequence's bounds at `level = ln(1/α)`: the Wilson interval at the `z`
/// of a normal mixture of the same weight, `z² = 2(1 + r)(ln(1/α) + ½ ln((1 + r)/r))`,
/// `r = (c + 1)/n`.
fn sequence_guess(s: u64, n: u64, level: f64) -> (f64, f64) {
    let r = (MIXTURE_SESSIONS + 1.0) / n as f64;
    let z = (2.0 * (1.0 + r) * (level + 0.5 * ((1.0 + r) / r).ln())).sqrt();
    wilson_interval(s, n, z)
}

/// Where `g` crosses 0 between `edge` and `estimate` (`g(estimate) < 0`), starting near
/// `guess`, on the outer side (`g ≥ 0` there); `None` when `g(edge) < 0` too (the sequence
/// reaches the edge).
fn crossing(g: &impl Fn(f64) -> f64, edge: f64, guess: f64, estimate: f64) -> Option<f64> {
    let (mut ins, mut g_in) = (estimate, g(estimate));
    if g_in.is_nan() || g_in >= 0.0 {
        // The estimate itself is outside: only rounding can do this; no narrower bound.
        return Some(estimate);
    }
    // Bracket: step out from the estimate to just short of the guess, then a little past it,
    // then twice as far each time, until outside (or at the edge).
    let mut step = (guess - estimate) * 0.95;
    if step.is_nan() || step.abs() <= BOUND_TOLERANCE {
        step = (edge - estimate) * 1e-3;
    }
    let mut growth = [1.15, 1.3].into_iter();
    let (mut out, mut g_out) = loop {
        let x = estimate + step;
        let beyond = (x - edge) * (estimate - edge) <= 0.0;
        let x = if beyond { edge } else { x };
        let gx = g(x);
        if !gx.is_nan() && gx >= 0.0 {
            break (x, gx);
        }
        if beyond {
            // NaN (no evidence to compute) counts as inside: the wider interval.
            return None;
        }
        ins = x;
        g_in = if gx.is_nan() { -1.0 } else { gx };
        step *= growth.next().unwrap_or(2.0);
    };
    // Which end moved last: the other one's value is halved when the same end moves twice.
    let mut last_out = None;
    for _ in 0..200 {
        if (out - ins).abs() <= BOUND_TOLERANCE {
            break;
        }
        let mut x = (out * g_in - ins * g_out) / (g_in - g_out);
        let (lo, hi) = (out.min(ins), out.max(ins));
        if x.is_nan() || x <= lo || x >= hi {
            x = 0.5 * (out + ins);
        }
        let gx = g(x);
        if gx.is_nan() || gx < 0.0 {
            ins = x;
            g_in = if gx.is_nan() { -1.0 } else { gx };
            if last_out == Some(false) {
                g_out *= 0.5;
            }
            last_out = Some(false);
        } else {
            out = x;
            g_out = gx;
            if last_out == Some(true) {
                g_in *= 0.5;
            }
            last_out = Some(true);
        }
    }
    Some(out)
}

/// Which side of a rate a one-sided sequence bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A lower bound: the rate is at least it (the mixture over rates above `p`).
    Lower,
    /// An upper bound: the rate is at most it (the mixture over rates below `p`).
    Upper,
}

/// `ln Iₓ(a, b)`, the log of the regularized incomplete beta function `P(Beta(a, b) ≤ x)`, by
/// its continued fraction (Lentz's method) on the side of `x` where it converges fast, so
/// both a tiny value and one close to 1 keep their digits.
pub(crate) fn ln_incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x.is_nan() || x <= 0.0 {
        return f64::NEG_INFINITY;
    }
    if x >= 1.0 {
        return 0.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (-x).ln_1p();
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front + (beta_fraction(x, a, b) / a).ln()
    } else {
        // I_x(a, b) = 1 − I_{1−x}(b, a).
        (-(ln_front + (beta_fraction(1.0 - x, b, a) / b).ln()).exp()).ln_1p()
    }
}

/// The continued fraction of `Iₓ(a, b)` (Numerical Recipes §6.4, modified Lentz), to a
/// relative 1e-15; it needs about `√max(a, b)` terms.
fn beta_fraction(x: f64, a: f64, b: f64) -> f64 {
    const TINY: f64 = 1e-300;
    const TERMS: u32 = 100_000;
    let nonzero = |v: f64| if v.abs() < TINY { TINY } else { v };
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 / nonzero(1.0 - qab * x / qap);
    let mut h = d;
    for m in 1..=TERMS {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        let even = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1.0 / nonzero(1.0 + even * d);
        c = nonzero(1.0 + even / c);
        h *= d * c;
        let odd = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 / nonzero(1.0 + odd * d);
        c = nonzero(1.0 + odd / c);
        let step = d * c;
        h *= step;
        if (step - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

/// `ln M⁺ₙ(p)` (`side` [`Side::Lower`]) or `ln M⁻ₙ(p)` ([`Side::Upper`]): the beta-binomial
/// mixture of the module doc with its prior cut to the rates above `p` (below `p`) and
/// renormalized,
///
/// ```text
/// M⁺ₙ(p) = Mₙ(p) · P(Beta(c·p + s, c·(1 − p) + f) > p) / P(Beta(c·p, c·(1 − p)) > p)
/// ```
///
/// still a mixture of likelihood ratios by a probability measure, so a martingale of mean 1
/// when `p` is the rate, and Ville's inequality bounds the chance that it ever reaches `1/α`
/// by `α`. It only grows large when the data sit on its side of `p` (about twice `Mₙ` there):
/// a one-sided bound at `α` is about as tight as a two-sided one at `2α`.
pub fn ln_one_sided_mixture(successes: u64, failures: u64, p: f64, side: Side) -> f64 {
    let (s, f) = (successes as f64, failures as f64);
    let (a, b) = (MIXTURE_SESSIONS * p, MIXTURE_SESSIONS * (1.0 - p));
    let cut = match side {
        // P(Beta(a, b) > p) = I_{1−p}(b, a).
        Side::Lower => {
            ln_incomplete_beta(1.0 - p, b + f, a + s) - ln_incomplete_beta(1.0 - p, b, a)
        }
        Side::Upper => ln_incomplete_beta(p, a + s, b + f) - ln_incomplete_beta(p, a, b),
    };
    ln_mixture(successes, failures, p) + cut
}

/// The one-sided confidence sequence of a rate at level `1 − alpha`, at `successes` out of
/// `n`: the bound on `side` of the rates `p` with `M±ₙ(p) < 1/α` ([`ln_one_sided_mixture`]),
/// found as [`confidence_sequence`] finds its bounds. The rate is on the right side of it at
/// every `n` at once with probability at least `1 − α`. `n = 0` gives 0 (lower) or 1 (upper).
pub fn one_sided_bound(successes: u64, n: u64, alpha: f64, side: Side) -> f64 {
    let edge = match side {
        Side::Lower => 0.0,
        Side::Upper => 1.0,
    };
    if n == 0 || alpha.is_nan() || alpha <= 0.0 {
        return edge;
    }
    let s = successes.min(n);
    let f = n - s;
    let level = (1.0 / alpha.min(1.0)).ln();
    let excess = |p: f64| ln_one_sided_mixture(s, f, p, side) - level;
    let p_hat = (s as f64 / n as f64).clamp(RATE_EDGE, 1.0 - RATE_EDGE);
    // Start from the two-sided guess at 2α (the one-sided bound is close to it).
    let (guess_lo, guess_hi) = sequence_guess(s, n, (level - std::f64::consts::LN_2).max(0.0));
    match side {
        Side::Lower if s == 0 => 0.0,
        Side::Lower => crossing(&excess, RATE_EDGE, guess_lo, p_hat).unwrap_or(0.0),
        Side::Upper if f == 0 => 1.0,
        Side::Upper => crossing(&excess, 1.0 - RATE_EDGE, guess_hi, p_hat).unwrap_or(1.0),
    }
}

/// The anytime-valid interval of `rate(b) − rate(a)` at level `1 − alpha`: the two arms'
/// [`confidence_sequence`]s at `alpha` combined as Newcombe combines Wilson intervals (see the
/// module doc for what that combination assumes, and `simulate.rs` for its check).
pub fn difference_interval(a: Proportion, b: Proportion, alpha: f64) -> Interval {
    newcombe(a, b, a.sequence(alpha), b.sequence(alpha))
}

/// The one-sided anytime-valid lower bound of `rate(b) − rate(a)` at level `1 − alpha`, as the
/// interval `[lower, 1]`: `b`'s lower and `a`'s upper [`one_sided_bound`] combined as in
/// [`difference_interval`]. For claims with one direction fixed before looking ("the slow half
/// is abandoned more", "not worse by the margin"): about as tight as the two-sided interval at
/// `2α`.
pub fn difference_lower_bound(a: Proportion, b: Proportion, alpha: f64) -> Interval {
    let (pa, pb) = (a.rate(), b.rate());
    let lb = one_sided_bound(b.successes, b.n, alpha, Side::Lower);
    let ua = one_sided_bound(a.successes, a.n, alpha, Side::Upper);
    Interval {
        lower: pb - pa - ((pb - lb).powi(2) + (ua - pa).powi(2)).sqrt(),
        upper: 1.0,
    }
}

/// The smallest level at which `excludes` holds (it holds at every level above it), by
/// bisection on its logarithm to about 0.2%; 1 when it does not hold at 1, at least
/// [`P_VALUE_FLOOR`].
fn smallest_level(excludes: impl Fn(f64) -> bool) -> f64 {
    if !excludes(1.0) {
        return 1.0;
    }
    if excludes(P_VALUE_FLOOR) {
        return P_VALUE_FLOOR;
    }
    // ln α: `lo` does not exclude, `hi` does.
    let (mut lo, mut hi) = (P_VALUE_FLOOR.ln(), 0.0_f64);
    for _ in 0..14 {
        let mid = 0.5 * (lo + hi);
        if excludes(mid.exp()) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi.exp()
}

/// The one-sided always-valid p-value, at this look, of "`rate(b) − rate(a)` is at most
/// `null`": the smallest level at which [`difference_lower_bound`] is above `null`. 1 when the
/// estimate is not above `null` or an arm is empty.
pub fn always_valid_p_value_above(a: Proportion, b: Proportion, null: f64) -> f64 {
    if a.n == 0 || b.n == 0 || b.rate() - a.rate() <= null {
        return 1.0;
    }
    smallest_level(|alpha| difference_lower_bound(a, b, alpha).lower > null)
}

/// The always-valid p-value, at this look, of "`rate(b) − rate(a)` is `null`" (0: the same
/// rate; `−δ` for non-inferiority): the smallest level at which [`difference_interval`]
/// excludes `null` (Johari et al.), found by bisection on its logarithm to about 0.2%. 1 when
/// the estimate is `null` or an arm is empty; at least [`P_VALUE_FLOOR`].
pub fn always_valid_p_value(a: Proportion, b: Proportion, null: f64) -> f64 {
    if a.n == 0 || b.n == 0 || b.rate() - a.rate() == null {
        return 1.0;
    }
    smallest_level(|alpha| {
        let i = difference_interval(a, b, alpha);
        i.lower > null || i.upper < null
    })
}

/// The one-sided always-valid p-value, at this look, of "the rate is at most `level`":
/// `1 / M⁺ₙ(level)`, the smallest level at which the one-sided sequence's lower bound is above
/// `level` (exact). 1 when `level` is not in `(0, 1)` or the rate is not above it.
pub fn level_p_value(p: Proportion, level: f64) -> f64 {
    if level.is_nan() || level <= 0.0 || level >= 1.0 || p.rate() <= level {
        return 1.0;
    }
    (-ln_one_sided_mixture(p.successes, p.failures(), level, Side::Lower))
        .exp()
        .clamp(P_VALUE_FLOOR, 1.0)
}

// === impl Intersections ===

/// The running intersection of the confidence sequences of the comparisons made, by key (see
/// the module doc): the intervals earlier looks kept, and the ones this look meets; and the
/// share of [`FAMILY_ALPHA`] each key's stretch may spend.
///
/// A key names one comparison at one level in one stretch (say
/// `window1795392000000|best|success|model|a|b|m1`); the caller keeps the same key for the same
/// comparison, oriented the same way, and carries the intervals only while the sessions compared
/// only grow. Keys not met at this look are not carried further.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Intersections {
    earlier: BTreeMap<String, Interval>,
    met: BTreeMap<String, Interval>,
    /// Key prefix → share of the family level (see [`Intersections::spending`]).
    shares: BTreeMap<String, f64>,
}

impl Intersections {
    /// No earlier look: every interval is this look's own, at the whole family level.
    pub fn fresh() -> Self {
        Self::default()
    }

    /// Starting from the intervals of earlier looks at the same sessions (or fewer of them).
    pub fn carried(earlier: BTreeMap<String, Interval>) -> Self {
        Self {
            earlier,
            ..Self::default()
        }
    }

    /// The comparisons whose keys start with `prefix` spend `share` (in `[0, 1]`) of the family
    /// level: their stretch's share of the agent's whole-life budget ([`stretch_share`]). Keys
    /// under no prefix spend all of it (one stretch: the tests of one growing sample).
    #[must_use]
    pub fn spending(mut self, prefix: &str, share: f64) -> Self {
        self.shares.insert(prefix.to_owned(), share.clamp(0.0, 1.0));
        self
    }

    /// The two-sided level of the comparison under `key`, one of `comparisons` of its question:
    /// `FAMILY_ALPHA · share / m`, the share of the longest prefix of `key` given to
    /// [`Intersections::spending`] (1 when none is).
    pub fn alpha(&self, key: &str, comparisons: u32) -> f64 {
        let share = self
            .shares
            .iter()
            .filter(|(prefix, _)| key.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .map_or(1.0, |(_, share)| *share);
        bonferroni_alpha(comparisons) * share
    }

    /// This look's interval for `key` intersected with the earlier looks'. When they do not
    /// overlap (the sessions no longer behave like the earlier ones, or the sequence was in its
    /// `α`), the comparison restarts from this look.
    pub fn meet(&mut self, key: &str, now: Interval) -> Interval {
        let met = self
            .earlier
            .get(key)
            .and_then(|earlier| earlier.intersect(now))
            .unwrap_or(now);
        self.met.insert(key.to_owned(), met);
        met
    }

    /// Carries the earlier looks' interval for `key` to the next look unchanged, when this look
    /// did not need its own (an intersection over some of the looks is still a confidence
    /// sequence).
    pub fn carry(&mut self, key: &str) {
        if let Some(earlier) = self.earlier.get(key) {
            self.met.insert(key.to_owned(), *earlier);
        }
    }

    /// The intervals met at this look, to carry to the next.
    pub fn into_met(self) -> BTreeMap<String, Interval> {
        self.met
    }
}

// === posterior ===

/// The posterior probability that `b`'s rate exceeds `a`'s, `P(θb > θa)`, with each rate
/// `θ ~ Beta(1 + successes, 1 + failures)` (a uniform prior updated by the counts). A Bayesian
/// posterior is not changed by when one looks, so it needs no correction for repeated looks;
/// it is shown beside the intervals, never decided on.
///
/// Computed deterministically, without sampling, as
/// `P = ∫ fb(x)·Fa(x) dx` by the midpoint rule on a grid of 4096 points spanning both
/// posteriors (each mean ± 12 standard deviations): each density is evaluated up to its
/// constant, `x^s (1 − x)^f`, normalised on the grid, and
/// `P ≈ Σᵢ mb(i)·(Σ_{j<i} ma(j) + ma(i)/2)`. Equal counts give exactly 1/2,
/// `P(a, b) + P(b, a) = 1` up to rounding, and against closed forms the error is below 1e-6.
pub fn prob_greater(a: Proportion, b: Proportion) -> f64 {
    let (a, b) = (
        Proportion::new(a.successes, a.n),
        Proportion::new(b.successes, b.n),
    );
    if a == b {
        return 0.5;
    }
    let (sa, fa) = (a.successes as f64, a.failures() as f64);
    let (sb, fb) = (b.successes as f64, b.failures() as f64);
    let (lo_a, hi_a) = posterior_span(sa, fa);
    let (lo_b, hi_b) = posterior_span(sb, fb);
    let lo = lo_a.min(lo_b).max(0.0);
    let hi = hi_a.max(hi_b).min(1.0);
    let h = (hi - lo) / POSTERIOR_GRID as f64;
    // Shift each log density by its value at the mode, so the largest term is about 1.
    let (peak_a, peak_b) = (log_kernel_at_mode(sa, fa), log_kernel_at_mode(sb, fb));
    let (mut mass_a, mut mass_b, mut below_a, mut acc) = (0.0, 0.0, 0.0, 0.0);
    for i in 0..POSTERIOR_GRID {
        let x = lo + (i as f64 + 0.5) * h;
        let (ln_x, ln_1mx) = (x.ln(), (-x).ln_1p());
        let ma = (sa * ln_x + fa * ln_1mx - peak_a).exp();
        let mb = (sb * ln_x + fb * ln_1mx - peak_b).exp();
        acc += mb * (below_a + 0.5 * ma);
        below_a += ma;
        mass_a += ma;
        mass_b += mb;
    }
    if mass_a <= 0.0 || mass_b <= 0.0 {
        return 0.5;
    }
    (acc / (mass_a * mass_b)).clamp(0.0, 1.0)
}

/// Mean ± [`POSTERIOR_SPAN_SDS`] standard deviations of `Beta(1 + s, 1 + f)`.
fn posterior_span(s: f64, f: f64) -> (f64, f64) {
    let (alpha, beta) = (1.0 + s, 1.0 + f);
    let total = alpha + beta;
    let mean = alpha / total;
    let sd = (alpha * beta / (total * total * (total + 1.0))).sqrt();
    (
        mean - POSTERIOR_SPAN_SDS * sd,
        mean + POSTERIOR_SPAN_SDS * sd,
    )
}

/// `s·ln x + f·ln(1 − x)` at its maximum, `x = s/(s + f)` (with `0·ln 0 = 0`).
fn log_kernel_at_mode(s: f64, f: f64) -> f64 {
    let total = s + f;
    let mut peak = 0.0;
    if s > 0.0 {
        peak += s * (s / total).ln();
    }
    if f > 0.0 {
        peak += f * (f / total).ln();
    }
    peak
}

// === decisions ===

/// One arm of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ArmEvidence {
    pub successes: u64,
    pub n: u64,
    pub rate: f64,
    /// Anytime-valid interval of the rate at this look, at the comparison's confidence.
    pub interval: Interval,
}

/// The evidence of one comparison of arm `b` against arm `a`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// The reference arm.
    pub a: ArmEvidence,
    /// The arm compared with it.
    pub b: ArmEvidence,
    /// `rate(b) − rate(a)`.
    pub difference: f64,
    /// Anytime-valid interval of the difference at [`Evidence::confidence`]: the running
    /// intersection over the looks at this growing set of sessions.
    pub difference_interval: Interval,
    /// Confidence of each interval here, Bonferroni-adjusted and at the stretch's share:
    /// `1 − FAMILY_ALPHA · share / comparisons` (so `1 − FAMILY_ALPHA` family-wise over the
    /// agent's life), valid at every look at once.
    pub confidence: f64,
    /// Comparisons made for the same question (the Bonferroni `m`).
    pub comparisons: u32,
    /// Always-valid p-value at this look of what the comparison rules out (equal rates; for
    /// non-inferiority, `b` worse by the margin), unadjusted (compare it with `1 − confidence`).
    pub p_value: f64,
    /// Posterior probability that `b`'s rate is above `a`'s ([`prob_greater`]).
    pub prob_b_greater: f64,
}

/// The evidence comparing `b` with `a` at level `1 − alpha` (the family level split over the
/// `comparisons` and the stretch, see [`Intersections::alpha`]), with the (intersected)
/// difference interval `difference_interval`; the p-value is that of the difference `null`.
///
/// With `one_sided`, the claim is that `b`'s rate is above `a`'s plus `null` (a direction fixed
/// before looking): the arms' intervals are one-sided (`a`'s upper bound, `b`'s lower), as is
/// the p-value ([`always_valid_p_value_above`]).
pub fn evidence(
    a: Proportion,
    b: Proportion,
    comparisons: u32,
    alpha: f64,
    difference_interval: Interval,
    null: f64,
    one_sided: bool,
) -> Evidence {
    let arm = |p: Proportion, side: Side| ArmEvidence {
        successes: p.successes,
        n: p.n,
        rate: p.rate(),
        interval: match (one_sided, side) {
            (false, _) => p.sequence(alpha),
            (true, Side::Upper) => Interval {
                lower: 0.0,
                upper: one_sided_bound(p.successes, p.n, alpha, Side::Upper),
            },
            (true, Side::Lower) => Interval {
                lower: one_sided_bound(p.successes, p.n, alpha, Side::Lower),
                upper: 1.0,
            },
        },
    };
    Evidence {
        a: arm(a, Side::Upper),
        b: arm(b, Side::Lower),
        difference: b.rate() - a.rate(),
        difference_interval,
        confidence: 1.0 - alpha,
        comparisons: comparisons.max(1),
        p_value: if one_sided {
            always_valid_p_value_above(a, b, null)
        } else {
            always_valid_p_value(a, b, null)
        },
        prob_b_greater: prob_greater(a, b),
    }
}

/// Which way `b` differs from `a`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// `b`'s rate is higher.
    Higher,
    /// `b`'s rate is lower.
    Lower,
}

/// A difference the evidence supports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Shift {
    pub direction: Direction,
    pub evidence: Evidence,
}

fn enough_samples(a: Proportion, b: Proportion) -> bool {
    a.n >= MIN_SAMPLES_PER_ARM && b.n >= MIN_SAMPLES_PER_ARM
}

/// This look's interval of `rate(b) − rate(a)` at the level of `comparisons`, met with the
/// earlier looks' under `key`.
fn met_difference(
    a: Proportion,
    b: Proportion,
    comparisons: u32,
    key: &str,
    run: &mut Intersections,
) -> Interval {
    let alpha = run.alpha(key, comparisons);
    run.meet(key, difference_interval(a, b, alpha))
}

/// The direction the interval `i` of `rate(b) − rate(a)` supports, when the estimate agrees
/// (an intersection kept from earlier looks can exclude 0 while this look's estimate has
/// crossed it: then no claim, rather than one the figures shown contradict).
fn direction_of(i: Interval, difference: f64) -> Option<Direction> {
    if i.lower > 0.0 && difference > 0.0 {
        Some(Direction::Higher)
    } else if i.upper < 0.0 && difference < 0.0 {
        Some(Direction::Lower)
    } else {
        None
    }
}

/// Whether `b`'s rate differs from `a`'s: both arms have [`MIN_SAMPLES_PER_ARM`], and the
/// anytime-valid difference interval (level adjusted for `comparisons`, intersected over the
/// looks under `key`) excludes zero. `None` means the evidence does not support a difference.
pub fn differs(
    a: Proportion,
    b: Proportion,
    comparisons: u32,
    key: &str,
    run: &mut Intersections,
) -> Option<Shift> {
    if !enough_samples(a, b) {
        return None;
    }
    // Decide on the interval alone; the full evidence (posterior included) only when it fires.
    let interval = met_difference(a, b, comparisons, key, run);
    let direction = direction_of(interval, b.rate() - a.rate())?;
    Some(Shift {
        direction,
        evidence: evidence(
            a,
            b,
            comparisons,
            run.alpha(key, comparisons),
            interval,
            0.0,
            false,
        ),
    })
}

/// Whether `b`'s rate is higher than `a`'s, a direction fixed before looking (say, "the slow
/// half is abandoned more"): both arms have [`MIN_SAMPLES_PER_ARM`], and the one-sided
/// anytime-valid lower bound of `rate(b) − rate(a)` ([`difference_lower_bound`], level
/// adjusted for `comparisons`, intersected over the looks under `key`) and the estimate are
/// above 0. Only that direction is ever claimed, so the whole level goes to its side. (When
/// the data pick the direction, use [`differs`].)
pub fn better(
    a: Proportion,
    b: Proportion,
    comparisons: u32,
    key: &str,
    run: &mut Intersections,
) -> Option<Evidence> {
    if !enough_samples(a, b) {
        return None;
    }
    let alpha = run.alpha(key, comparisons);
    let interval = run.meet(key, difference_lower_bound(a, b, alpha));
    (interval.lower > 0.0 && b.rate() > a.rate())
        .then(|| evidence(a, b, comparisons, alpha, interval, 0.0, true))
}

/// The arm with the highest rate, when it beats every other arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// Index of the best arm in the slice given.
    pub arm: usize,
    /// Comparisons the question made: all pairs of eligible arms.
    pub comparisons: u32,
    /// The evidence against each other eligible arm (`a` the other arm, `b` the best).
    pub against: Vec<Beaten>,
}

/// One arm the best arm beat.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Beaten {
    pub arm: usize,
    pub evidence: Evidence,
}

/// Which arm (model, provider) is best, if the evidence says so.
///
/// `arms` are `(label, counts)`; arms with fewer than [`MIN_SAMPLES_PER_ARM`] are left out (on
/// sample size alone, so leaving them out does not bias the test). Every pair of the `k`
/// remaining arms is compared at the Bonferroni `m = k(k − 1)/2` (the winner is found by looking
/// at the data, so every pair could have been the one tested), each pair's interval kept under
/// `"{key}|{label}|{label}|m{m}"` (labels in order, the interval oriented as the later minus the
/// earlier). The best arm is the one whose interval against every other arm lies above 0 and
/// whose rate is the highest; `None` with fewer than two eligible arms, or when no arm beats
/// all the others.
pub fn best_arm(arms: &[(&str, Proportion)], key: &str, run: &mut Intersections) -> Option<Best> {
    let eligible: Vec<usize> = (0..arms.len())
        .filter(|&i| arms[i].1.n >= MIN_SAMPLES_PER_ARM)
        .collect();
    let k = eligible.len() as u64;
    if k < 2 {
        return None;
    }
    let comparisons = u32::try_from(k * (k - 1) / 2).unwrap_or(u32::MAX);
    // above[i][j]: the interval of rate(j) − rate(i).
    let mut above: BTreeMap<(usize, usize), Interval> = BTreeMap::new();
    for (x, &i) in eligible.iter().enumerate() {
        for &j in &eligible[x + 1..] {
            // Key and orientation by label, so the same pair keeps its key as arms come and go.
            let (lo, hi) = if arms[i].0 <= arms[j].0 {
                (i, j)
            } else {
                (j, i)
            };
            let pair_key = pair_key(key, arms[lo].0, arms[hi].0, comparisons);
            let met = met_difference(arms[lo].1, arms[hi].1, comparisons, &pair_key, run);
            above.insert((lo, hi), met);
            above.insert(
                (hi, lo),
                Interval {
                    lower: -met.upper,
                    upper: -met.lower,
                },
            );
        }
    }
    let leader = eligible.iter().copied().reduce(|best, i| {
        if arms[i].1.rate() > arms[best].1.rate() {
            i
        } else {
            best
        }
    })?;
    let against = eligible
        .iter()
        .filter(|&&i| i != leader)
        .map(|&i| {
            let interval = *above.get(&(i, leader))?;
            let difference = arms[leader].1.rate() - arms[i].1.rate();
            (direction_of(interval, difference) == Some(Direction::Higher)).then(|| {
                let (lo, hi) = if arms[i].0 <= arms[leader].0 {
                    (i, leader)
                } else {
                    (leader, i)
                };
                let alpha = run.alpha(
                    &pair_key(key, arms[lo].0, arms[hi].0, comparisons),
                    comparisons,
                );
                Beaten {
                    arm: i,
                    evidence: evidence(
                        arms[i].1,
                        arms[leader].1,
                        comparisons,
                        alpha,
                        interval,
                        0.0,
                        false,
                    ),
                }
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Best {
        arm: leader,
        comparisons,
        against,
    })
}

/// The key of the comparison of the arms labelled `lo` and `hi` (in order) in [`best_arm`].
fn pair_key(key: &str, lo: &str, hi: &str, comparisons: u32) -> String {
    format!("{key}|{lo}|{hi}|m{comparisons}")
}

/// Whether `candidate` (say, a cheaper model) performs as well as `reference`: its rate is not
/// lower by more than [`NON_INFERIORITY_MARGIN`], i.e. the lower bound of the anytime-valid
/// interval of `rate(candidate) − rate(reference)` (intersected over the looks under `key`) is
/// above `−δ`, and so is the estimate.
///
/// The claim has one side, so the bound is one-sided ([`difference_lower_bound`]): it errs
/// with probability at most `α/m` at every look at once. Pass the number of candidate pairs as
/// `comparisons`. "As good" needs more evidence than "better": with equal true rates near
/// 0.7, thousands of sessions per arm.
pub fn performs_as_well(
    reference: Proportion,
    candidate: Proportion,
    comparisons: u32,
    key: &str,
    run: &mut Intersections,
) -> Option<Evidence> {
    if !enough_samples(reference, candidate) {
        return None;
    }
    let alpha = run.alpha(key, comparisons);
    let interval = run.meet(key, difference_lower_bound(reference, candidate, alpha));
    let difference = candidate.rate() - reference.rate();
    (interval.lower > -NON_INFERIORITY_MARGIN && difference > -NON_INFERIORITY_MARGIN).then(|| {
        evidence(
            reference,
            candidate,
            comparisons,
            alpha,
            interval,
            -NON_INFERIORITY_MARGIN,
            true,
        )
    })
}

/// Whether a rate has moved from the `previous` period to the `recent` one: [`differs`] with
/// `a` the previous period.
pub fn trend(
    previous: Proportion,
    recent: Proportion,
    comparisons: u32,
    key: &str,
    run: &mut Intersections,
) -> Option<Shift> {
    differs(previous, recent, comparisons, key, run)
}

/// A rate shown to be above a level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AboveLevel {
    /// The arm; its interval is the running intersection over the looks.
    pub arm: ArmEvidence,
    pub level: f64,
    /// Confidence of the interval, Bonferroni-adjusted, valid at every look at once.
    pub confidence: f64,
    /// One-sided always-valid p-value of "the rate is at most the level" at this look.
    pub p_value: f64,
}

/// Whether a rate (say, regenerations) is above `level`: at least [`MIN_SAMPLES_PER_ARM`]
/// observations, and the lower bound of the rate's one-sided confidence sequence
/// ([`one_sided_bound`]; level adjusted for `comparisons`, intersected over the looks under
/// `key`; shown as `[lower, 1]`) and the rate itself above it.
pub fn exceeds(
    p: Proportion,
    level: f64,
    comparisons: u32,
    key: &str,
    run: &mut Intersections,
) -> Option<AboveLevel> {
    if p.n < MIN_SAMPLES_PER_ARM {
        return None;
    }
    if p.rate() <= level {
        // No claim is possible whatever the interval; keep the earlier one for the next look.
        run.carry(key);
        return None;
    }
    let alpha = run.alpha(key, comparisons);
    let lower = one_sided_bound(p.successes, p.n, alpha, Side::Lower);
    let interval = run.meet(key, Interval { lower, upper: 1.0 });
    (interval.lower > level && p.rate() > level).then(|| AboveLevel {
        arm: ArmEvidence {
            successes: p.successes,
            n: p.n,
            rate: p.rate(),
            interval,
        },
        level,
        confidence: 1.0 - alpha,
        p_value: level_p_value(p, level),
    })
}

/// Pools ordered buckets into two halves of sizes as equal as whole buckets allow: the index of
/// the first bucket of the second half, then the two pooled halves. `None` with fewer than two
/// buckets. The cut depends on the sizes only, never on what is counted.
pub fn split_halves(buckets: &[Proportion]) -> Option<(usize, Proportion, Proportion)> {
    if buckets.len() < 2 {
        return None;
    }
    let total: u128 = buckets.iter().map(|b| u128::from(b.n)).sum();
    let mut before = 0u128;
    let mut cut = 1;
    let mut best_gap = u128::MAX;
    for (i, bucket) in buckets.iter().enumerate().take(buckets.len() - 1) {
        before += u128::from(bucket.n);
        let gap = before.abs_diff(total - before);
        if gap < best_gap {
            best_gap = gap;
            cut = i + 1;
        }
    }
    let pool = |part: &[Proportion]| {
        part.iter()
            .copied()
            .fold(Proportion::default(), Proportion::merge)
    };
    Some((cut, pool(&buckets[..cut]), pool(&buckets[cut..])))
}

// === cost ===

/// How a cost is spread over end users.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostConcentration {
    pub users: u64,
    /// Total cost, micro-dollars (saturating).
    pub total_micros: u64,
    /// Users in the top [`TOP_USERS_PERCENT`] (at least one).
    pub top_users: u64,
    /// Their cost, micro-dollars (saturating).
    pub top_micros: u64,
    /// `top_micros / total_micros`.
    pub top_share: f64,
    /// Gini coefficient of the per-user costs ([`gini`]).
    pub gini: f64,
}

impl CostConcentration {
    /// Whether the cost is concentrated in a few users: at least
    /// [`MIN_USERS_FOR_CONCENTRATION`] users, and the top [`TOP_USERS_PERCENT`] take at least
    /// [`CONCENTRATED_TOP_SHARE`] of the cost.
    pub fn is_concentrated(&self) -> bool {
        self.users >= MIN_USERS_FOR_CONCENTRATION as u64 && self.top_share >= CONCENTRATED_TOP_SHARE
    }
}

/// The concentration of per-user costs (micro-dollars, one entry per end user); `None` when
/// there are no users or no cost. Sums are exact (128-bit); only the shares are floating point.
pub fn cost_concentration(costs: &[u64]) -> Option<CostConcentration> {
    let mut sorted = costs.to_vec();
    sorted.sort_unstable();
    let total: u128 = sorted.iter().map(|&c| u128::from(c)).sum();
    if total == 0 {
        return None;
    }
    let users = sorted.len() as u64;
    let top_users = top_count(users);
    let top: u128 = sorted
        .iter()
        .rev()
        .take(usize::try_from(top_users).unwrap_or(usize::MAX))
        .map(|&c| u128::from(c))
        .sum();
    Some(CostConcentration {
        users,
        total_micros: u64::try_from(total).unwrap_or(u64::MAX),
        top_users,
        top_micros: u64::try_from(top).unwrap_or(u64::MAX),
        top_share: top as f64 / total as f64,
        gini: gini_sorted(&sorted, total),
    })
}

/// `⌈users · TOP_USERS_PERCENT / 100⌉`, at least 1.
fn top_count(users: u64) -> u64 {
    (users.saturating_mul(TOP_USERS_PERCENT).div_ceil(100)).max(1)
}

/// The Gini coefficient of per-user costs: 0 when everyone spends the same, `(n − 1)/n` when
/// one user spends everything. With the costs sorted ascending, `x₁ ≤ … ≤ xₙ`:
///
/// ```text
/// G = Σᵢ (2i − n − 1)·xᵢ / (n · Σᵢ xᵢ)
/// ```
///
/// (the mean absolute difference over twice the mean; e.g. Damgaard and Weiner, "Describing
/// inequality in plant size or fecundity", Ecology 81 (2000) 1139–1142). 0 for no users or no
/// cost.
pub fn gini(costs: &[u64]) -> f64 {
    let mut sorted = costs.to_vec();
    sorted.sort_unstable();
    let total: u128 = sorted.iter().map(|&c| u128::from(c)).sum();
    gini_sorted(&sorted, total)
}

fn gini_sorted(sorted: &[u64], total: u128) -> f64 {
    if sorted.is_empty() || total == 0 {
        return 0.0;
    }
    // Exact in 128 bits: |2i − n − 1| ≤ n and each cost < 2⁶⁴, so the sum stays far below 2¹²⁷
    // for any slice that fits in memory.
    let n = sorted.len() as i128;
    let weighted: i128 = sorted
        .iter()
        .zip(1i128..)
        .map(|(&x, i)| (2 * i - n - 1) * i128::from(x))
        .sum();
    weighted as f64 / (n as f64 * total as f64)
}

/// `total_micros / count`, rounded to the nearest micro-dollar (say, cost per accepted output);
/// `None` when `count` is 0. Integer arithmetic: money never goes through floating point.
pub fn micros_per(total_micros: u64, count: u64) -> Option<u64> {
    if count == 0 {
        return None;
    }
    let (total, count) = (u128::from(total_micros), u128::from(count));
    u64::try_from((2 * total + count) / (2 * count)).ok()
}
