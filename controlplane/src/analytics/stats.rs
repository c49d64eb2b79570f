//! Statistics for recommendations: intervals and comparisons that decide when evidence is enough.
//!
//! Everything here is a pure, deterministic function of counts: no I/O and no random numbers,
//! so the same data always gives the same recommendations (and the same snapshots).
//!
//! # When a comparison counts as evidence
//!
//! A recommendation claims that one rate differs from another: a model's success rate against
//! another's, this week's regeneration rate against last week's, slow requests' abandonment rate
//! against fast ones'. It is made only when
//!
//! 1. every arm compared has at least [`MIN_SAMPLES_PER_ARM`] observations, and
//! 2. the confidence interval of the difference lies entirely on one side of zero, at confidence
//!    `1 - FAMILY_ALPHA / m`, where `m` is the number of comparisons made to answer the question
//!    (Bonferroni).
//!
//! The interval of the difference is Newcombe's hybrid score interval, built from the two arms'
//! Wilson intervals: "intervals that separate", made precise, with coverage close to nominal
//! even for small counts and rates near 0 or 1 (where the textbook Wald interval fails).
//! Bonferroni bounds the chance that *any* of the `m` comparisons fires by luck by
//! [`FAMILY_ALPHA`], so comparing many models at once does not multiply false recommendations:
//! when all arms are equal, a recommendation appears in at most about 5% of data sets. The
//! simulation tests at the bottom check that, and that a real difference is found.
//!
//! Each decision returns its [`Evidence`] (counts, rates, intervals, the difference, a z-test
//! p-value and the Bayesian probability that one arm is better), so a recommendation can show
//! why it was made.
//!
//! References:
//! - E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
//!   JASA 22 (1927) 209–212.
//! - L. D. Brown, T. T. Cai, A. DasGupta, "Interval estimation for a binomial proportion",
//!   Statistical Science 16 (2001) 101–133.
//! - R. G. Newcombe, "Interval estimation for the difference between independent proportions:
//!   comparison of eleven methods", Statistics in Medicine 17 (1998) 873–890.
//! - A. Agresti, *Categorical Data Analysis*, 3rd ed. (2013), §1.4 and §2.1 (tests for
//!   proportions).
//! - G. Marsaglia, "Evaluating the normal distribution", J. Statistical Software 11(4) (2004).

use serde::{Deserialize, Serialize};

/// Fewest observations an arm needs before it is compared at all: below this, intervals are
/// too wide to separate anything but extreme differences, and normal approximations are poor.
pub const MIN_SAMPLES_PER_ARM: u64 = 30;

/// Family-wise false-positive rate: the chance, when there is no real difference, that a
/// question (with all its comparisons) yields a recommendation anyway.
pub const FAMILY_ALPHA: f64 = 0.05;

/// How much lower (absolute, on a rate in `[0, 1]`) a cheaper arm's success rate may be and
/// still "perform as well": 5 percentage points.
pub const NON_INFERIORITY_MARGIN: f64 = 0.05;

/// The "top users" in cost concentration: the top 10% of end users by cost (at least one).
pub const TOP_USERS_PERCENT: u64 = 10;

/// Cost is concentrated when the top [`TOP_USERS_PERCENT`] of users take at least this share of
/// it: half the spend from a tenth of the users, five times their even share. (For scale: a
/// Pareto "80/20" spread puts about 73% of the spend in the top tenth.)
pub const CONCENTRATED_TOP_SHARE: f64 = 0.5;

/// Fewest users for a concentration verdict: with fewer, "the top 10%" is one user and the
/// verdict says more about the sample than about the spend.
pub const MIN_USERS_FOR_CONCENTRATION: usize = 20;

/// Grid points for the posterior integral in [`prob_greater`].
const POSTERIOR_GRID: usize = 4096;
/// The posterior grid spans this many standard deviations either side of each arm's mean.
const POSTERIOR_SPAN_SDS: f64 = 12.0;
/// Beyond this |x| the normal tail is below 1e-17 and [`normal_cdf`] returns 0 or 1.
const NORMAL_CDF_LIMIT: f64 = 8.5;
/// ln √(2π).
const LN_SQRT_2PI: f64 = 0.918_938_533_204_672_8;

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

    /// The Wilson score interval of the rate (see [`wilson_interval`]).
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

/// The critical value for a two-sided test at family level [`FAMILY_ALPHA`] split over
/// `comparisons` (Bonferroni): `Φ⁻¹(1 − α / (2m))`. 1.96 for one comparison.
pub fn bonferroni_z(comparisons: u32) -> f64 {
    normal_quantile(1.0 - bonferroni_alpha(comparisons) / 2.0)
}

/// The per-comparison two-sided level: `FAMILY_ALPHA / m` (`m` of 0 counts as 1).
pub fn bonferroni_alpha(comparisons: u32) -> f64 {
    FAMILY_ALPHA / f64::from(comparisons.max(1))
}

// === intervals ===

/// The Wilson score interval for `successes` out of `n` at normal critical value `z` (1.96 for
/// 95%):
///
/// ```text
/// p̂ = s/n,   centre = (p̂ + z²/2n) / (1 + z²/n),
/// half-width = z/(1 + z²/n) · √(p̂(1 − p̂)/n + z²/4n²)
/// ```
///
/// (Wilson 1927; recommended over the Wald interval by Brown, Cai and DasGupta 2001: it stays
/// inside `[0, 1]` and keeps its coverage near 0 and 1.) `n = 0` gives `(0, 1)`; successes above
/// `n` are clamped.
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

/// Newcombe's hybrid score interval for the difference `rate(b) − rate(a)` (method 10 of
/// Newcombe 1998), from the Wilson intervals `[l, u]` of each arm at the same `z`:
///
/// ```text
/// d = p̂b − p̂a
/// lower = d − √((p̂b − lb)² + (ua − p̂a)²)
/// upper = d + √((ub − p̂b)² + (p̂a − la)²)
/// ```
pub fn difference_interval(a: Proportion, b: Proportion, z: f64) -> Interval {
    let (pa, pb) = (a.rate(), b.rate());
    let (la, ua) = wilson_interval(a.successes, a.n, z);
    let (lb, ub) = wilson_interval(b.successes, b.n, z);
    let d = pb - pa;
    Interval {
        lower: d - ((pb - lb).powi(2) + (ua - pa).powi(2)).sqrt(),
        upper: d + ((ub - pb).powi(2) + (pa - la).powi(2)).sqrt(),
    }
}

// === tests of two proportions ===

/// The pooled two-proportion z statistic for `rate(b) − rate(a)`:
///
/// ```text
/// p̄ = (sa + sb)/(na + nb),   z = (p̂b − p̂a) / √(p̄(1 − p̄)(1/na + 1/nb))
/// ```
///
/// (Agresti 2013, §2.1.) 0 when either arm is empty or the pooled rate is 0 or 1 (no
/// variation, so no evidence).
pub fn two_proportion_z(a: Proportion, b: Proportion) -> f64 {
    if a.n == 0 || b.n == 0 {
        return 0.0;
    }
    let (na, nb) = (a.n as f64, b.n as f64);
    let pooled = (a.successes.min(a.n) as f64 + b.successes.min(b.n) as f64) / (na + nb);
    let variance = pooled * (1.0 - pooled) * (1.0 / na + 1.0 / nb);
    if variance <= 0.0 {
        return 0.0;
    }
    (b.rate() - a.rate()) / variance.sqrt()
}

/// The two-sided p-value of the pooled two-proportion z-test: `2·Φ(−|z|)`. Symmetric in its
/// arguments; 1 when there is no evidence either way.
pub fn two_proportion_p_value(a: Proportion, b: Proportion) -> f64 {
    (2.0 * normal_cdf(-two_proportion_z(a, b).abs())).min(1.0)
}

/// The posterior probability that `b`'s rate exceeds `a`'s, `P(θb > θa)`, with each rate
/// `θ ~ Beta(1 + successes, 1 + failures)` (a uniform prior updated by the counts).
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
    /// Wilson interval at the comparison's confidence.
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
    /// Newcombe interval of the difference at [`Evidence::confidence`].
    pub difference_interval: Interval,
    /// Two-sided confidence of every interval here, Bonferroni-adjusted:
    /// `1 − FAMILY_ALPHA / comparisons`.
    pub confidence: f64,
    /// Comparisons made for the same question (the Bonferroni `m`).
    pub comparisons: u32,
    /// Two-sided p-value of the pooled z-test, unadjusted (compare it with
    /// `1 − confidence`).
    pub p_value: f64,
    /// Posterior probability that `b`'s rate is above `a`'s ([`prob_greater`]).
    pub prob_b_greater: f64,
}

/// The evidence comparing `b` with `a`, whatever it shows, with intervals at the confidence
/// adjusted for `comparisons`.
pub fn evidence(a: Proportion, b: Proportion, comparisons: u32) -> Evidence {
    let z = bonferroni_z(comparisons);
    let arm = |p: Proportion| ArmEvidence {
        successes: p.successes,
        n: p.n,
        rate: p.rate(),
        interval: p.wilson(z),
    };
    Evidence {
        a: arm(a),
        b: arm(b),
        difference: b.rate() - a.rate(),
        difference_interval: difference_interval(a, b, z),
        confidence: 1.0 - bonferroni_alpha(comparisons),
        comparisons: comparisons.max(1),
        p_value: two_proportion_p_value(a, b),
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

/// Whether `b`'s rate differs from `a`'s: both arms have [`MIN_SAMPLES_PER_ARM`], and the
/// difference interval, at confidence adjusted for `comparisons`, excludes zero. `None` means
/// the evidence does not support a difference.
pub fn differs(a: Proportion, b: Proportion, comparisons: u32) -> Option<Shift> {
    if !enough_samples(a, b) {
        return None;
    }
    // Decide on the interval alone; the full evidence (posterior included) only when it fires.
    let interval = difference_interval(a, b, bonferroni_z(comparisons));
    let direction = if interval.lower > 0.0 {
        Direction::Higher
    } else if interval.upper < 0.0 {
        Direction::Lower
    } else {
        return None;
    };
    Some(Shift {
        direction,
        evidence: evidence(a, b, comparisons),
    })
}

/// Whether `b`'s rate is higher than `a`'s ([`differs`], one direction). The interval is
/// two-sided, so this holds the family level even when the direction was picked after looking
/// at the data (as when `b` is the leader).
pub fn better(a: Proportion, b: Proportion, comparisons: u32) -> Option<Evidence> {
    differs(a, b, comparisons)
        .filter(|shift| shift.direction == Direction::Higher)
        .map(|shift| shift.evidence)
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
/// Arms with fewer than [`MIN_SAMPLES_PER_ARM`] are left out (on sample size alone, so leaving
/// them out does not bias the test). Of the `k` remaining arms, the one with the highest rate must
/// [`better`] every other, with the Bonferroni `m = k(k − 1)/2`: the leader is chosen by
/// looking at the data, so every pair could have been the one tested. `None` with fewer than
/// two eligible arms, or when the leader does not separate from all of them.
pub fn best_arm(arms: &[Proportion]) -> Option<Best> {
    let eligible: Vec<usize> = (0..arms.len())
        .filter(|&i| arms[i].n >= MIN_SAMPLES_PER_ARM)
        .collect();
    let k = eligible.len() as u64;
    if k < 2 {
        return None;
    }
    let comparisons = u32::try_from(k * (k - 1) / 2).unwrap_or(u32::MAX);
    let leader = eligible.iter().copied().reduce(|best, i| {
        if arms[i].rate() > arms[best].rate() {
            i
        } else {
            best
        }
    })?;
    let against = eligible
        .iter()
        .filter(|&&i| i != leader)
        .map(|&i| {
            better(arms[i], arms[leader], comparisons).map(|evidence| Beaten { arm: i, evidence })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Best {
        arm: leader,
        comparisons,
        against,
    })
}

/// Whether `candidate` (say, a cheaper model) performs as well as `reference` (the best): its
/// rate is not lower by more than [`NON_INFERIORITY_MARGIN`], i.e. the lower bound of the
/// difference interval `rate(candidate) − rate(reference)` is above `−δ`.
///
/// The lower bound of a two-sided `1 − α/m` interval is a one-sided test at `α/(2m)`: 2.5% for
/// one candidate, the usual level for non-inferiority (ICH E9). Pass the number of candidates
/// as `comparisons`. "As good" needs more evidence than "better": with equal true rates near
/// 0.5, the bound clears 5 points half the time at about 800 observations per arm, and nine
/// times in ten at about 2,000.
pub fn performs_as_well(
    reference: Proportion,
    candidate: Proportion,
    comparisons: u32,
) -> Option<Evidence> {
    if !enough_samples(reference, candidate) {
        return None;
    }
    let interval = difference_interval(reference, candidate, bonferroni_z(comparisons));
    (interval.lower > -NON_INFERIORITY_MARGIN).then(|| evidence(reference, candidate, comparisons))
}

/// Whether a rate has moved between the `previous` window and the `recent` one (two windows of
/// equal length, back to back): [`differs`] with `a` the previous window.
pub fn trend(previous: Proportion, recent: Proportion, comparisons: u32) -> Option<Shift> {
    differs(previous, recent, comparisons)
}

/// A rate shown to be above a level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AboveLevel {
    pub arm: ArmEvidence,
    pub level: f64,
    /// Two-sided confidence of the interval, Bonferroni-adjusted.
    pub confidence: f64,
}

/// Whether a rate (say, regenerations) is above `level`: at least [`MIN_SAMPLES_PER_ARM`]
/// observations and the Wilson lower bound, at confidence adjusted for `comparisons`, above it.
pub fn exceeds(p: Proportion, level: f64, comparisons: u32) -> Option<AboveLevel> {
    if p.n < MIN_SAMPLES_PER_ARM {
        return None;
    }
    let interval = p.wilson(bonferroni_z(comparisons));
    (interval.lower > level).then(|| AboveLevel {
        arm: ArmEvidence {
            successes: p.successes,
            n: p.n,
            rate: p.rate(),
            interval,
        },
        level,
        confidence: 1.0 - bonferroni_alpha(comparisons),
    })
}

/// Whether slow time to first byte raises abandonment.
///
/// `buckets` are abandonment counts (`successes` = abandoned sessions, `n` = sessions) by time
/// to first byte, fastest first. They are pooled into a fast and a slow half, cut between
/// buckets where the two halves' sizes are closest, and the slow half must have the
/// [`better`] (here: higher) abandonment rate. `None` with fewer than two buckets or without
/// the evidence. In the result `a` is the fast half and `b` the slow one.
pub fn slow_ttfb_raises_abandonment(buckets: &[Proportion], comparisons: u32) -> Option<Evidence> {
    let (_, fast, slow) = split_halves(buckets)?;
    better(fast, slow, comparisons)
}

/// Pools ordered buckets into two halves of sizes as equal as whole buckets allow: the index of
/// the first bucket of the second half, then the two pooled halves. `None` with fewer than two
/// buckets.
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn normal_cdf_and_quantile_known_values() {
        assert_eq!(normal_cdf(0.0), 0.5);
        assert!(close(normal_cdf(1.96), 0.975_002_104_851_780, 1e-14));
        assert!(close(normal_cdf(-1.0), 0.158_655_253_931_457, 1e-14));
        assert!(close(normal_cdf(-3.0), 0.001_349_898_031_630_095, 1e-15));
        assert_eq!(normal_cdf(-9.0), 0.0);
        assert_eq!(normal_cdf(9.0), 1.0);
        assert!(normal_cdf(f64::NAN).is_nan());
        assert!(close(normal_quantile(0.975), 1.959_963_984_540_054, 1e-12));
        assert!(close(normal_quantile(0.5), 0.0, 1e-15));
        assert!(close(normal_quantile(0.05), -1.644_853_626_951_472, 1e-12));
        assert_eq!(normal_quantile(0.0), f64::NEG_INFINITY);
        assert!(normal_quantile(1.5).is_nan());
        assert!(close(bonferroni_z(1), 1.959_963_984_540_054, 1e-12));
        // α = 0.05/3 two-sided.
        assert!(close(bonferroni_z(3), 2.393_979_799_818_51, 1e-9));
        assert_eq!(bonferroni_alpha(0), FAMILY_ALPHA);
    }

    #[test]
    fn wilson_known_values() {
        let (lo, hi) = wilson_interval(10, 100, 1.96);
        assert!(
            close(lo, 0.0552, 1e-4) && close(hi, 0.1744, 1e-4),
            "{lo} {hi}"
        );
        let (lo, hi) = wilson_interval(50, 100, 1.96);
        assert!(
            close(lo, 0.4038, 1e-4) && close(hi, 0.5962, 1e-4),
            "{lo} {hi}"
        );
    }

    #[test]
    fn wilson_edges() {
        assert_eq!(wilson_interval(0, 0, 1.96), (0.0, 1.0));
        let z: f64 = 1.96;
        let (lo, hi) = wilson_interval(10, 10, z);
        assert_eq!(hi, 1.0);
        assert!(close(lo, 10.0 / (10.0 + z * z), 1e-12));
        let (lo, hi) = wilson_interval(0, 10, z);
        assert_eq!(lo, 0.0);
        assert!(close(hi, z * z / (10.0 + z * z), 1e-12));
        // Successes above n are clamped.
        assert_eq!(wilson_interval(11, 10, z), wilson_interval(10, 10, z));
        assert_eq!(Proportion::new(11, 10), Proportion::new(10, 10));
        assert_eq!(Proportion::new(0, 0).rate(), 0.0);
    }

    #[test]
    fn wilson_is_symmetric_and_nested() {
        for n in [1u64, 7, 30, 101] {
            for s in 0..=n {
                let (lo, hi) = wilson_interval(s, n, 1.96);
                let (mlo, mhi) = wilson_interval(n - s, n, 1.96);
                assert!(close(lo, 1.0 - mhi, 1e-12) && close(hi, 1.0 - mlo, 1e-12));
                let p = s as f64 / n as f64;
                assert!(lo <= p && p <= hi);
                let (wlo, whi) = wilson_interval(s, n, 2.5);
                assert!(wlo <= lo && hi <= whi);
            }
        }
    }

    #[test]
    fn newcombe_known_value() {
        // Newcombe (1998), example (a): 56/70 − 48/80, method 10: 0.0524 to 0.3339.
        let i = difference_interval(Proportion::new(48, 80), Proportion::new(56, 70), 1.96);
        assert!(
            close(i.lower, 0.0524, 1e-4) && close(i.upper, 0.3339, 1e-4),
            "{i:?}"
        );
        // Swapping the arms mirrors the interval.
        let j = difference_interval(Proportion::new(56, 70), Proportion::new(48, 80), 1.96);
        assert!(close(i.lower, -j.upper, 1e-12) && close(i.upper, -j.lower, 1e-12));
    }

    #[test]
    fn z_test_known_value_and_symmetry() {
        let (a, b) = (Proportion::new(48, 80), Proportion::new(56, 70));
        // p̄ = 104/150, se = 0.075469, z = 0.2 / se.
        assert!(close(two_proportion_z(a, b), 2.650_08, 1e-4));
        assert!(close(
            two_proportion_z(b, a),
            -two_proportion_z(a, b),
            1e-15
        ));
        assert!(close(two_proportion_p_value(a, b), 0.008_05, 1e-4));
        assert_eq!(two_proportion_p_value(a, b), two_proportion_p_value(b, a));
        // No variation or no data: no evidence.
        assert_eq!(
            two_proportion_p_value(Proportion::new(10, 10), Proportion::new(30, 30)),
            1.0
        );
        assert_eq!(
            two_proportion_p_value(Proportion::new(0, 0), Proportion::new(3, 30)),
            1.0
        );
    }

    #[test]
    fn posterior_closed_forms() {
        // θa ~ U(0,1), θb ~ Beta(2,1): P(θb > θa) = ∫ 2x·x dx = 2/3.
        let p = prob_greater(Proportion::new(0, 0), Proportion::new(1, 1));
        assert!(close(p, 2.0 / 3.0, 1e-6), "{p}");
        // θa ~ Beta(2,1), θb ~ Beta(1,2): ∫ 2x(1 − x)² dx = 1/6.
        let p = prob_greater(Proportion::new(1, 1), Proportion::new(0, 1));
        assert!(close(p, 1.0 / 6.0, 1e-6), "{p}");
    }

    #[test]
    fn posterior_symmetry_and_agreement() {
        let arms = [
            Proportion::new(0, 0),
            Proportion::new(3, 40),
            Proportion::new(120, 200),
            Proportion::new(140, 200),
            Proportion::new(600_000, 1_000_000),
            Proportion::new(5000, 5000),
        ];
        for a in arms {
            assert_eq!(prob_greater(a, a), 0.5);
            for b in arms {
                let sum = prob_greater(a, b) + prob_greater(b, a);
                assert!(close(sum, 1.0, 1e-9), "{a:?} {b:?}: {sum}");
            }
        }
        // For n in the hundreds, the posterior and the z-test agree: P ≈ Φ(z).
        let (a, b) = (Proportion::new(120, 200), Proportion::new(140, 200));
        let p = prob_greater(a, b);
        assert!(close(p, normal_cdf(two_proportion_z(a, b)), 0.01), "{p}");
        assert!(p > 0.9 && p < 1.0);
        // A narrow arm against a wide one.
        let p = prob_greater(Proportion::new(15, 30), Proportion::new(600_000, 1_000_000));
        assert!(close(p, 0.87, 0.02), "{p}");
    }

    #[test]
    fn decisions_need_samples_per_arm() {
        let big = Proportion::new(29, 29);
        let small = Proportion::new(0, 29);
        assert_eq!(better(small, big, 1), None);
        assert!(better(Proportion::new(0, 30), Proportion::new(30, 30), 1).is_some());
        assert_eq!(performs_as_well(big, big, 1), None);
        assert_eq!(trend(small, big, 1), None);
        assert_eq!(exceeds(big, 0.5, 1), None);
        assert_eq!(best_arm(&[big, small]), None);
        assert_eq!(best_arm(&[Proportion::new(30, 30)]), None);
        assert_eq!(best_arm(&[]), None);
    }

    #[test]
    fn better_is_directional_and_carries_evidence() {
        let (a, b) = (Proportion::new(100, 200), Proportion::new(140, 200));
        let e = better(a, b, 1).unwrap();
        assert_eq!((e.a.n, e.b.n), (200, 200));
        assert!(close(e.difference, 0.2, 1e-12));
        assert!(e.difference_interval.lower > 0.0);
        assert!(e.p_value < 0.05 && e.prob_b_greater > 0.99);
        assert!(close(e.confidence, 0.95, 1e-12));
        assert!(e.b.interval.contains(0.7));
        assert_eq!(better(b, a, 1), None);
        assert_eq!(differs(b, a, 1).unwrap().direction, Direction::Lower);
        // A difference that holds alone can fail once many comparisons share the level.
        let (a, b) = (Proportion::new(100, 200), Proportion::new(122, 200));
        assert!(better(a, b, 1).is_some());
        assert_eq!(better(a, b, 45), None);
    }

    #[test]
    fn best_arm_picks_a_clear_leader_only() {
        let arms = [
            Proportion::new(100, 200),
            Proportion::new(5, 10), // too few: left out
            Proportion::new(150, 200),
            Proportion::new(104, 200),
        ];
        let best = best_arm(&arms).unwrap();
        assert_eq!(best.arm, 2);
        assert_eq!(best.comparisons, 3);
        let beaten: Vec<usize> = best.against.iter().map(|b| b.arm).collect();
        assert_eq!(beaten, [0, 3]);
        // A leader that does not separate from the runner-up is no recommendation.
        let arms = [
            Proportion::new(100, 200),
            Proportion::new(150, 200),
            Proportion::new(146, 200),
        ];
        assert_eq!(best_arm(&arms), None);
    }

    #[test]
    fn non_inferiority() {
        // Equal rates with plenty of data: as good within 5 points.
        let e =
            performs_as_well(Proportion::new(1200, 2000), Proportion::new(1200, 2000), 1).unwrap();
        assert!(e.difference_interval.lower > -NON_INFERIORITY_MARGIN);
        // Equal rates, little data: the interval is too wide to tell.
        assert_eq!(
            performs_as_well(Proportion::new(120, 200), Proportion::new(120, 200), 1),
            None
        );
        // Clearly worse.
        assert_eq!(
            performs_as_well(Proportion::new(1200, 2000), Proportion::new(1000, 2000), 1),
            None
        );
        // Better is also as good.
        assert!(
            performs_as_well(Proportion::new(1000, 2000), Proportion::new(1200, 2000), 1).is_some()
        );
    }

    #[test]
    fn trend_and_level() {
        let up = trend(Proportion::new(20, 200), Proportion::new(50, 200), 1).unwrap();
        assert_eq!(up.direction, Direction::Higher);
        let down = trend(Proportion::new(50, 200), Proportion::new(20, 200), 1).unwrap();
        assert_eq!(down.direction, Direction::Lower);
        assert_eq!(
            trend(Proportion::new(50, 200), Proportion::new(52, 200), 1),
            None
        );

        let high = exceeds(Proportion::new(60, 200), 0.2, 1).unwrap();
        assert!(high.arm.interval.lower > 0.2);
        assert_eq!(exceeds(Proportion::new(45, 200), 0.2, 1), None);
    }

    #[test]
    fn slow_first_byte_and_abandonment() {
        // Abandonment rises with TTFB.
        let buckets = [
            Proportion::new(10, 100),
            Proportion::new(12, 100),
            Proportion::new(30, 100),
            Proportion::new(35, 100),
        ];
        let e = slow_ttfb_raises_abandonment(&buckets, 1).unwrap();
        assert_eq!((e.a.successes, e.a.n), (22, 200));
        assert_eq!((e.b.successes, e.b.n), (65, 200));
        // Flat, or falling: nothing.
        let flat = [Proportion::new(20, 100); 4];
        assert_eq!(slow_ttfb_raises_abandonment(&flat, 1), None);
        let mut falling = buckets;
        falling.reverse();
        assert_eq!(slow_ttfb_raises_abandonment(&falling, 1), None);
        assert_eq!(slow_ttfb_raises_abandonment(&buckets[..1], 1), None);
    }

    #[test]
    fn halves_balance_whole_buckets() {
        let buckets = [
            Proportion::new(1, 10),
            Proportion::new(1, 10),
            Proportion::new(1, 50),
            Proportion::new(1, 30),
        ];
        // Cuts give 10|90, 20|80, 70|30: the last is closest to even.
        let (_, fast, slow) = split_halves(&buckets).unwrap();
        assert_eq!((fast.n, slow.n), (70, 30));
        assert_eq!((fast.successes, slow.successes), (3, 1));
    }

    #[test]
    fn cost_concentration_and_gini() {
        assert_eq!(cost_concentration(&[]), None);
        assert_eq!(cost_concentration(&[0, 0]), None);
        assert_eq!(gini(&[]), 0.0);

        let even = cost_concentration(&[1_000_000; 50]).unwrap();
        assert_eq!((even.users, even.top_users), (50, 5));
        assert!(close(even.top_share, 0.1, 1e-12));
        assert_eq!(even.gini, 0.0);
        assert!(!even.is_concentrated());

        assert!(close(gini(&[4, 1, 3, 2]), 0.25, 1e-12));
        assert!(close(gini(&[0, 0, 0, 7]), 0.75, 1e-12));

        // Two whales among forty users.
        let mut costs = vec![10_000u64; 38];
        costs.extend([5_000_000, 4_000_000]);
        let c = cost_concentration(&costs).unwrap();
        assert_eq!(c.top_users, 4);
        assert_eq!(c.total_micros, 9_380_000);
        assert_eq!(c.top_micros, 9_020_000);
        assert!(c.top_share > 0.9 && c.gini > 0.8);
        assert!(c.is_concentrated());

        // The same shape among too few users is no verdict.
        let few = cost_concentration(&[10, 10, 10, 1000]).unwrap();
        assert_eq!(few.top_users, 1);
        assert!(few.top_share > CONCENTRATED_TOP_SHARE && !few.is_concentrated());

        // Sums do not overflow.
        let huge = cost_concentration(&[u64::MAX; 3]).unwrap();
        assert_eq!(huge.total_micros, u64::MAX);
        assert!(close(huge.top_share, 1.0 / 3.0, 1e-12));
    }

    #[test]
    fn micros_per_rounds_in_integers() {
        assert_eq!(micros_per(10, 0), None);
        assert_eq!(micros_per(10, 4), Some(3)); // 2.5 rounds up
        assert_eq!(micros_per(10, 3), Some(3));
        assert_eq!(micros_per(u64::MAX, 1), Some(u64::MAX));
    }

    // === simulation ===

    const SEEDS: u64 = 200;
    const N: u64 = 200;

    fn draw(rng: &mut StdRng, p: f64, n: u64) -> Proportion {
        Proportion::new((0..n).filter(|_| rng.random_bool(p)).count() as u64, n)
    }

    /// Seeds, of [`SEEDS`], for which `decide` fires on arms drawn with these rates.
    fn fired(rates: &[f64], n: u64, decide: impl Fn(&[Proportion]) -> bool) -> u64 {
        (0..SEEDS)
            .filter(|&seed| {
                let mut rng = StdRng::seed_from_u64(seed);
                let arms: Vec<Proportion> = rates.iter().map(|&p| draw(&mut rng, p, n)).collect();
                decide(&arms)
            })
            .count() as u64
    }

    #[test]
    fn equal_models_rarely_produce_a_recommendation() {
        // Three equal arms: at most 5% of seeds name a best model.
        let fp = fired(&[0.6, 0.6, 0.6], N, |arms| best_arm(arms).is_some());
        assert!(fp * 20 <= SEEDS, "{fp} of {SEEDS} seeds");
        // Two equal windows: a single two-sided 5% comparison, so about 10 of 200 seeds by
        // construction; 15 leaves room for the sampling error of 200 seeds.
        let fp = fired(&[0.3, 0.3], N, |w| trend(w[0], w[1], 1).is_some());
        assert!(fp <= 15, "{fp} of {SEEDS} seeds");
    }

    #[test]
    fn a_real_difference_is_found() {
        let hits = fired(&[0.5, 0.7], N, |arms| better(arms[0], arms[1], 1).is_some());
        assert!(hits * 5 >= SEEDS * 4, "{hits} of {SEEDS} seeds");
        // Among three arms, and named as the best one.
        let hits = fired(&[0.5, 0.7, 0.5], N, |arms| {
            best_arm(arms).is_some_and(|best| best.arm == 1)
        });
        assert!(hits * 5 >= SEEDS * 4, "{hits} of {SEEDS} seeds");
    }

    #[test]
    fn a_worse_cheap_model_is_rarely_called_as_good() {
        // Exactly the margin worse is the boundary of the null: at most 2.5% one-sided, 5% here.
        let fp = fired(&[0.65, 0.60], 2000, |arms| {
            performs_as_well(arms[0], arms[1], 1).is_some()
        });
        assert!(fp * 20 <= SEEDS, "{fp} of {SEEDS} seeds");
    }
}
