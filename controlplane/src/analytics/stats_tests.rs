//! Unit tests of [`super::stats`]: known values, the properties each interval must have, and
//! single-look simulations. The any-look simulations of the rules are in `simulate.rs`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::stats::*;

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

/// The pooled two-proportion z statistic (Agresti 2013, §2.1), to check the posterior against.
fn two_proportion_z(a: Proportion, b: Proportion) -> f64 {
    let (na, nb) = (a.n as f64, b.n as f64);
    let pooled = (a.successes + b.successes) as f64 / (na + nb);
    (b.rate() - a.rate()) / (pooled * (1.0 - pooled) * (1.0 / na + 1.0 / nb)).sqrt()
}

fn run() -> Intersections {
    Intersections::fresh()
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
fn wilson_known_values_and_edges() {
    let (lo, hi) = wilson_interval(10, 100, 1.96);
    assert!(
        close(lo, 0.0552, 1e-4) && close(hi, 0.1744, 1e-4),
        "{lo} {hi}"
    );
    assert_eq!(wilson_interval(0, 0, 1.96), (0.0, 1.0));
    let z: f64 = 1.96;
    let (lo, hi) = wilson_interval(10, 10, z);
    assert_eq!(hi, 1.0);
    assert!(close(lo, 10.0 / (10.0 + z * z), 1e-12));
    assert_eq!(wilson_interval(11, 10, z), wilson_interval(10, 10, z));
    assert_eq!(Proportion::new(11, 10), Proportion::new(10, 10));
    assert_eq!(Proportion::new(0, 0).rate(), 0.0);
}

#[test]
fn newcombe_known_value() {
    // Newcombe (1998), example (a): 56/70 − 48/80, method 10: 0.0524 to 0.3339.
    let i = fixed_difference_interval(Proportion::new(48, 80), Proportion::new(56, 70), 1.96);
    assert!(
        close(i.lower, 0.0524, 1e-4) && close(i.upper, 0.3339, 1e-4),
        "{i:?}"
    );
}

/// The mixture (and through it ln Γ) against closed forms.
#[test]
fn mixture_known_values() {
    // M at p with no data is exactly 1.
    assert!(close(ln_mixture(0, 0, 0.3), 0.0, 1e-12));
    // One success: M = E[θ]/p = p/p = 1 under the prior centred on p.
    assert!(close(ln_mixture(1, 0, 0.3), 0.0, 1e-12));
    assert!(close(ln_mixture(0, 1, 0.7), 0.0, 1e-12));
    // The same across the switch from Lanczos to Stirling (c·p + 1 crosses 10): Γ(x + 1) = xΓ(x)
    // must hold whichever formula computes each side.
    for k in 0..=40 {
        let p = 0.2 + f64::from(k) * 0.0025;
        assert!(close(ln_mixture(1, 0, p), 0.0, 1e-11), "p {p}");
    }
    // Two successes: E[θ²]/p² = (a(a + 1)/(c(c + 1)))/p² with a = c·p: (c·p + 1)/(p·(c + 1)).
    let (c, p) = (MIXTURE_SESSIONS, 0.2);
    let want = ((c * p + 1.0) / (p * (c + 1.0))).ln();
    assert!(close(ln_mixture(2, 0, p), want, 1e-11), "{want}");
    // Large counts keep their precision: 600,000 of 1,000,000 at the estimate is a small
    // negative number (the mixture's cost of not knowing the rate), not rounding noise.
    let at_estimate = ln_mixture(600_000, 400_000, 0.6);
    assert!(at_estimate < 0.0 && at_estimate > -10.0, "{at_estimate}");
}

/// ln M has a single minimum in p (near the estimate, not exactly at it: the prior is centred
/// on the rate tested) and grows away from it, on a grid of counts and rates: the sequence is
/// an interval, and each bound is the one crossing of the level on its side.
#[test]
fn mixture_is_unimodal_so_the_sequence_is_an_interval() {
    for n in [1u64, 2, 5, 30, 31, 100, 333, 1000, 5000] {
        for s in [
            0,
            1,
            2,
            n / 10,
            n / 3,
            n / 2,
            n - n / 5,
            n.saturating_sub(1),
            n,
        ] {
            let s = s.min(n);
            let values: Vec<f64> = (1..800)
                .map(|k| ln_mixture(s, n - s, f64::from(k) / 800.0))
                .collect();
            let lowest = (0..values.len())
                .min_by(|&i, &j| values[i].total_cmp(&values[j]))
                .unwrap();
            for w in values[..=lowest].windows(2) {
                assert!(w[0] >= w[1] - 1e-9, "s {s} n {n}: rises before the minimum");
            }
            for w in values[lowest..].windows(2) {
                assert!(w[1] >= w[0] - 1e-9, "s {s} n {n}: falls after the minimum");
            }
        }
    }
}

#[test]
fn sequence_bounds_are_where_the_mixture_reaches_the_level() {
    let alpha: f64 = 0.05;
    let level = (1.0 / alpha).ln();
    for (s, n) in [
        (10u64, 100u64),
        (60, 100),
        (2, 30),
        (28, 30),
        (600, 1000),
        (3, 2000),
    ] {
        let (lo, hi) = confidence_sequence(s, n, alpha);
        let p = s as f64 / n as f64;
        assert!(
            lo > 0.0 && lo < p && p < hi && hi < 1.0,
            "{s}/{n}: {lo} {hi}"
        );
        // Just outside each bound the mixture is at or past the level; just inside, below.
        assert!(ln_mixture(s, n - s, lo) >= level - 1e-6, "{s}/{n}");
        assert!(ln_mixture(s, n - s, lo + 1e-6) < level, "{s}/{n}");
        assert!(ln_mixture(s, n - s, hi) >= level - 1e-6, "{s}/{n}");
        assert!(ln_mixture(s, n - s, hi - 1e-6) < level, "{s}/{n}");
    }
}

#[test]
fn sequence_edges_symmetry_and_nesting() {
    assert_eq!(confidence_sequence(0, 0, 0.05), (0.0, 1.0));
    let (lo, hi) = confidence_sequence(0, 50, 0.05);
    assert_eq!(lo, 0.0);
    assert!(hi > 0.0 && hi < 0.5, "{hi}");
    let (lo, hi) = confidence_sequence(50, 50, 0.05);
    assert_eq!(hi, 1.0);
    assert!(lo > 0.5 && lo < 1.0, "{lo}");
    assert_eq!(
        confidence_sequence(60, 50, 0.05),
        confidence_sequence(50, 50, 0.05)
    );
    // One success is no evidence against a tiny rate: the prior centred on a tiny rate
    // expects one now and then (two are evidence).
    assert_eq!(confidence_sequence(1, 30, 0.05).0, 0.0);
    assert!(confidence_sequence(2, 30, 0.05).0 > 0.0);
    for n in [1u64, 7, 30, 101, 400] {
        for s in 0..=n {
            let (lo, hi) = confidence_sequence(s, n, 0.05);
            let (mlo, mhi) = confidence_sequence(n - s, n, 0.05);
            // Mirror images (the prior is centred on the rate tested).
            assert!(close(lo, 1.0 - mhi, 1e-8) && close(hi, 1.0 - mlo, 1e-8));
            // Wider at a smaller α, and wider than the one-look Wilson interval.
            let (slo, shi) = confidence_sequence(s, n, 0.05 / 3.0);
            assert!(slo <= lo + 1e-12 && hi <= shi + 1e-12);
            let (wlo, whi) = wilson_interval(s, n, 1.96);
            assert!(lo <= wlo + 1e-9 && whi <= hi + 1e-9, "{s}/{n}");
        }
    }
    // The width it costs: at 300 sessions and a rate of 0.6, about z = 3 instead of 1.96.
    let (lo, hi) = confidence_sequence(180, 300, 0.05);
    let z = (hi - lo) / 2.0 / (0.6_f64 * 0.4 / 300.0).sqrt();
    assert!((2.8..3.3).contains(&z), "{z}");
}

/// Ville's inequality, checked: for each true rate, the share of 400 sequences of 400
/// outcomes in which the rate ever leaves the sequence (looked at after every outcome) stays
/// under α. Cheap: leaving the sequence is `ln M ≥ ln(1/α)`, one evaluation per look.
#[test]
fn the_rate_rarely_ever_leaves_its_sequence() {
    const RUNS: u64 = 400;
    const LOOKS: u64 = 400;
    let level = (1.0 / FAMILY_ALPHA).ln();
    for p in [0.03_f64, 0.3, 0.9] {
        let mut rng = StdRng::seed_from_u64(p.to_bits());
        let left = (0..RUNS)
            .filter(|_| {
                let mut s = 0;
                (1..=LOOKS).any(|n| {
                    s += u64::from(rng.random_bool(p));
                    ln_mixture(s, n - s, p) >= level
                })
            })
            .count() as u64;
        // α = 5% of 400 is 20; the bound is exact, so the margin is only the binomial
        // spread of 400 runs (3 standard deviations: 13).
        assert!(left <= 33, "p {p}: {left} of {RUNS}");
    }
}

#[test]
fn incomplete_beta_known_values() {
    let i = |x: f64, a: f64, b: f64| ln_incomplete_beta(x, a, b).exp();
    for x in [1e-6, 0.01, 0.3, 0.5, 0.77, 0.999] {
        assert!(close(i(x, 1.0, 1.0), x, 1e-13), "{x}");
        assert!(close(i(x, 3.5, 1.0), x.powf(3.5), 1e-13), "{x}");
        assert!(close(i(x, 1.0, 4.0), 1.0 - (1.0 - x).powi(4), 1e-13), "{x}");
        // I_x(a, b) = 1 − I_{1−x}(b, a).
        assert!(
            close(i(x, 40.0, 7.0) + i(1.0 - x, 7.0, 40.0), 1.0, 1e-12),
            "{x}"
        );
    }
    for (a, tolerance) in [(0.5, 1e-12), (24.0, 1e-12), (3000.0, 1e-9)] {
        assert!(close(i(0.5, a, a), 0.5, tolerance), "{a}");
    }
    // Deep in a tail, the logarithm keeps its digits: I_x(2, 1) = x².
    assert!(close(
        ln_incomplete_beta(1e-100, 2.0, 1.0),
        -200.0 * 10f64.ln(),
        1e-9
    ));
    assert_eq!(ln_incomplete_beta(0.0, 2.0, 3.0), f64::NEG_INFINITY);
    assert_eq!(ln_incomplete_beta(1.0, 2.0, 3.0), 0.0);
}

/// The one-sided bound is tighter than the two-sided one at the same level, by at least a
/// third of what doubling the level would give (about all of it in the middle, less near the
/// edges, where the cut prior keeps more than half its mass), and its mixture grows away from
/// the estimate on its side, so the bound is where it first reaches the level.
#[test]
fn one_sided_bounds_sit_between_the_two_sided_ones() {
    for (s, n) in [
        (3u64, 30u64),
        (60, 200),
        (700, 1000),
        (1450, 5000),
        (4990, 5000),
    ] {
        let (lo, hi) = confidence_sequence(s, n, 0.05);
        let (lo2, hi2) = confidence_sequence(s, n, 0.10);
        let lower = one_sided_bound(s, n, 0.05, Side::Lower);
        let upper = one_sided_bound(s, n, 0.05, Side::Upper);
        assert!(
            lo < lower && lower < s as f64 / n as f64,
            "{s}/{n}: {lo} {lower}"
        );
        assert!(
            hi > upper && upper > s as f64 / n as f64,
            "{s}/{n}: {hi} {upper}"
        );
        assert!(
            3.0 * (lower - lo) >= lo2 - lo,
            "{s}/{n}: {lo} {lower} {lo2}"
        );
        assert!(
            3.0 * (hi - upper) >= hi - hi2,
            "{s}/{n}: {hi} {upper} {hi2}"
        );
        let level = 20f64.ln();
        assert!(close(
            ln_one_sided_mixture(s, n - s, lower, Side::Lower),
            level,
            1e-6
        ));
        let p_hat = s as f64 / n as f64;
        let below: Vec<f64> = (1..200)
            .map(|k| p_hat * f64::from(k) / 200.0)
            .map(|p| ln_one_sided_mixture(s, n - s, p, Side::Lower))
            .collect();
        for w in below.windows(2) {
            assert!(
                w[0] >= w[1] - 1e-9,
                "{s}/{n}: not falling toward the estimate"
            );
        }
    }
    assert_eq!(one_sided_bound(0, 0, 0.05, Side::Lower), 0.0);
    assert_eq!(one_sided_bound(0, 0, 0.05, Side::Upper), 1.0);
    assert_eq!(one_sided_bound(0, 50, 0.05, Side::Lower), 0.0);
    assert_eq!(one_sided_bound(50, 50, 0.05, Side::Upper), 1.0);
}

/// Exact by Ville's inequality: streams of outcomes at rate `p`, looked at after every
/// outcome up to 400, rarely ever put `p` below the one-sided lower bound (or above the upper
/// one).
#[test]
fn the_rate_rarely_ever_leaves_its_one_sided_sequence() {
    const RUNS: u64 = 400;
    const LOOKS: u64 = 400;
    let level = (1.0 / FAMILY_ALPHA).ln();
    for p in [0.03_f64, 0.3, 0.9] {
        for side in [Side::Lower, Side::Upper] {
            let mut rng = StdRng::seed_from_u64(p.to_bits() ^ side as u64);
            let left = (0..RUNS)
                .filter(|_| {
                    let mut s = 0;
                    (1..=LOOKS).any(|n| {
                        s += u64::from(rng.random_bool(p));
                        ln_one_sided_mixture(s, n - s, p, side) >= level
                    })
                })
                .count() as u64;
            // α = 5% of 400 is 20, plus 3 standard deviations of 400 runs: 33.
            assert!(left <= 33, "p {p} {side:?}: {left} of {RUNS}");
        }
    }
}

/// What the one-sided bounds buy: the sessions per arm at which a typical sample (the estimate
/// at the truth) is enough for the claim, with the two-sided sequence and the one-sided one,
/// at the first stretch's share of the level. "As good" for equal rates at 0.7; a rate of 0.4
/// shown above a level of 0.3 (Bonferroni over three levels); slow answers abandoned at 13%
/// against 7% (over five cuts).
#[test]
fn one_sided_claims_need_fewer_sessions() {
    let alpha = FAMILY_ALPHA * stretch_share(1);
    let first = |claim: &dyn Fn(u64) -> bool| (10..2_000).map(|k| 10 * k).find(|&n| claim(n));
    let at = |rate: f64, n: u64| Proportion::new((rate * n as f64).round() as u64, n);
    let as_good_two = first(&|n| {
        difference_interval(at(0.7, n), at(0.7, n), alpha).lower > -NON_INFERIORITY_MARGIN
    });
    let as_good_one = first(&|n| {
        difference_lower_bound(at(0.7, n), at(0.7, n), alpha).lower > -NON_INFERIORITY_MARGIN
    });
    let level_two = first(&|n| at(0.4, n).sequence(alpha / 3.0).lower > 0.3);
    let level_one =
        first(&|n| one_sided_bound(at(0.4, n).successes, n, alpha / 3.0, Side::Lower) > 0.3);
    let slow_two =
        first(&|n| difference_interval(at(0.07, n), at(0.13, n), alpha / 5.0).lower > 0.0);
    let slow_one =
        first(&|n| difference_lower_bound(at(0.07, n), at(0.13, n), alpha / 5.0).lower > 0.0);
    eprintln!(
        "as good: {as_good_two:?} -> {as_good_one:?}; level: {level_two:?} -> {level_one:?}; \
         latency: {slow_two:?} -> {slow_one:?} sessions per arm"
    );
    for (two, one) in [
        (as_good_two, as_good_one),
        (level_two, level_one),
        (slow_two, slow_one),
    ] {
        let (two, one) = (two.unwrap(), one.unwrap());
        assert!(one < two && one as f64 > 0.8 * two as f64, "{one} vs {two}");
    }
}

#[test]
fn difference_interval_and_p_value() {
    let (a, b) = (Proportion::new(100, 200), Proportion::new(150, 200));
    let i = difference_interval(a, b, 0.05);
    assert!(i.lower > 0.0 && i.upper < 0.5 && i.contains(0.25), "{i:?}");
    // Wider than the one-look interval.
    let f = fixed_difference_interval(a, b, 1.96);
    assert!(i.lower < f.lower && f.upper < i.upper);
    // Swapping the arms mirrors it.
    let j = difference_interval(b, a, 0.05);
    assert!(close(i.lower, -j.upper, 1e-9) && close(i.upper, -j.lower, 1e-9));
    // The p-value is the level at which the interval just excludes 0.
    let p = always_valid_p_value(a, b, 0.0);
    assert!(p < 0.05 && p > P_VALUE_FLOOR, "{p}");
    assert!(difference_interval(a, b, p * 1.01).lower > 0.0);
    assert!(difference_interval(a, b, p * 0.99).lower <= 0.0);
    assert_eq!(
        always_valid_p_value(a, b, 0.0),
        always_valid_p_value(b, a, 0.0)
    );
    assert_eq!(always_valid_p_value(a, a, 0.0), 1.0);
    assert_eq!(always_valid_p_value(Proportion::default(), a, 0.0), 1.0);
    assert_eq!(
        always_valid_p_value(Proportion::new(0, 5000), Proportion::new(5000, 5000), 0.0),
        P_VALUE_FLOOR
    );
    // A level's p-value: 1/M⁺ at the level, where the one-sided lower bound crosses it.
    let x = Proportion::new(90, 200);
    let p = level_p_value(x, 0.3);
    assert!(p < 0.001, "{p}");
    assert!(one_sided_bound(90, 200, p * 1.01, Side::Lower) > 0.3);
    assert!(one_sided_bound(90, 200, p * 0.99, Side::Lower) <= 0.3);
    assert_eq!(level_p_value(x, 0.0), 1.0);
    assert_eq!(level_p_value(x, 0.5), 1.0);
    // One-sided difference: the p-value is where the lower bound crosses the null.
    let (a, b) = (Proportion::new(100, 200), Proportion::new(130, 200));
    let p = always_valid_p_value_above(a, b, 0.0);
    assert!(p < always_valid_p_value(a, b, 0.0), "{p}");
    assert!(difference_lower_bound(a, b, p * 1.01).lower > 0.0);
    assert!(difference_lower_bound(a, b, p * 0.99).lower <= 0.0);
    assert_eq!(always_valid_p_value_above(b, a, 0.0), 1.0);
}

#[test]
fn intersections_narrow_and_restart() {
    let mut run = Intersections::fresh();
    let first = run.meet("k", Interval::from((-0.1, 0.3)));
    assert_eq!(first, Interval::from((-0.1, 0.3)));
    let mut run = Intersections::carried(run.into_met());
    assert_eq!(
        run.meet("k", Interval::from((0.02, 0.5))),
        Interval::from((0.02, 0.3))
    );
    // Not overlapping: restart from this look.
    let mut run = Intersections::carried(run.into_met());
    assert_eq!(
        run.meet("k", Interval::from((0.4, 0.6))),
        Interval::from((0.4, 0.6))
    );
    // Keys not met are not carried on, unless carried as they were.
    run.meet("other", Interval::from((0.0, 1.0)));
    run.carry("nothing earlier");
    let met = run.into_met();
    assert_eq!(met.len(), 2);
    let mut carried = Intersections::carried(met.clone());
    carried.carry("k");
    assert_eq!(carried.into_met().get("k"), met.get("k"));
    let run = Intersections::carried(met);
    assert!(run.into_met().is_empty());
}

#[test]
fn posterior_closed_forms_and_symmetry() {
    // θa ~ U(0,1), θb ~ Beta(2,1): P(θb > θa) = ∫ 2x·x dx = 2/3.
    let p = prob_greater(Proportion::new(0, 0), Proportion::new(1, 1));
    assert!(close(p, 2.0 / 3.0, 1e-6), "{p}");
    // θa ~ Beta(2,1), θb ~ Beta(1,2): ∫ 2x(1 − x)² dx = 1/6.
    let p = prob_greater(Proportion::new(1, 1), Proportion::new(0, 1));
    assert!(close(p, 1.0 / 6.0, 1e-6), "{p}");
    let arms = [
        Proportion::new(0, 0),
        Proportion::new(3, 40),
        Proportion::new(120, 200),
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
}

#[test]
fn decisions_need_samples_per_arm() {
    let big = Proportion::new(29, 29);
    let small = Proportion::new(0, 29);
    assert_eq!(better(small, big, 1, "k", &mut run()), None);
    assert!(
        better(
            Proportion::new(0, 30),
            Proportion::new(30, 30),
            1,
            "k",
            &mut run()
        )
        .is_some()
    );
    assert_eq!(performs_as_well(big, big, 1, "k", &mut run()), None);
    assert_eq!(trend(small, big, 1, "k", &mut run()), None);
    assert_eq!(exceeds(big, 0.5, 1, "k", &mut run()), None);
    assert_eq!(best_arm(&[("a", big), ("b", small)], "k", &mut run()), None);
    assert_eq!(
        best_arm(&[("a", Proportion::new(30, 30))], "k", &mut run()),
        None
    );
    assert_eq!(best_arm(&[], "k", &mut run()), None);
}

#[test]
fn better_is_directional_and_carries_evidence() {
    let (a, b) = (Proportion::new(100, 200), Proportion::new(150, 200));
    let e = better(a, b, 1, "k", &mut run()).unwrap();
    assert_eq!((e.a.n, e.b.n), (200, 200));
    assert!(close(e.difference, 0.25, 1e-12));
    assert!(e.difference_interval.lower > 0.0);
    assert!(e.p_value < 0.05 && e.prob_b_greater > 0.99);
    assert!(close(e.confidence, 0.95, 1e-12));
    assert!(e.b.interval.contains(0.75));
    assert_eq!(better(b, a, 1, "k", &mut run()), None);
    assert_eq!(
        differs(b, a, 1, "k", &mut run()).unwrap().direction,
        Direction::Lower
    );
    // A difference that holds alone can fail once many comparisons share the level.
    let (a, b) = (Proportion::new(100, 200), Proportion::new(137, 200));
    assert!(better(a, b, 1, "k", &mut run()).is_some());
    assert_eq!(better(a, b, 45, "k", &mut run()), None);
}

#[test]
fn a_claim_once_made_is_kept_while_the_data_grows() {
    // 150/200 vs 100/200 separates; a later look whose own interval would not (the estimate
    // moved toward 0) still does through the intersection, as long as the estimate agrees.
    let mut first = run();
    assert!(
        better(
            Proportion::new(100, 200),
            Proportion::new(150, 200),
            1,
            "k",
            &mut first
        )
        .is_some()
    );
    let later = (Proportion::new(150, 300), Proportion::new(180, 300));
    assert_eq!(better(later.0, later.1, 1, "k", &mut run()), None);
    let mut carried = Intersections::carried(first.into_met());
    let kept = better(later.0, later.1, 1, "k", &mut carried).unwrap();
    assert!(kept.difference_interval.lower > 0.0);
    // Once the estimate crosses over, no claim: the figures shown would contradict it.
    let mut carried = Intersections::carried(carried.into_met());
    assert_eq!(
        better(
            Proportion::new(130, 260),
            Proportion::new(128, 260),
            1,
            "k",
            &mut carried
        ),
        None
    );
}

#[test]
fn best_arm_picks_a_clear_leader_only() {
    let arms = [
        ("m-a", Proportion::new(100, 200)),
        ("m-b", Proportion::new(5, 10)), // too few: left out
        ("m-c", Proportion::new(160, 200)),
        ("m-d", Proportion::new(104, 200)),
    ];
    let mut r = run();
    let best = best_arm(&arms, "best", &mut r).unwrap();
    assert_eq!(best.arm, 2);
    assert_eq!(best.comparisons, 3);
    let beaten: Vec<usize> = best.against.iter().map(|b| b.arm).collect();
    assert_eq!(beaten, [0, 3]);
    // Every pair of eligible arms is kept, by label, at its level.
    let keys: Vec<String> = r.into_met().into_keys().collect();
    assert_eq!(
        keys,
        ["best|m-a|m-c|m3", "best|m-a|m-d|m3", "best|m-c|m-d|m3"]
    );
    // A leader that does not separate from the runner-up is no recommendation.
    let arms = [
        ("a", Proportion::new(100, 200)),
        ("b", Proportion::new(150, 200)),
        ("c", Proportion::new(146, 200)),
    ];
    assert_eq!(best_arm(&arms, "best", &mut run()), None);
}

#[test]
fn non_inferiority() {
    // Equal rates with plenty of data: as good within 5 points.
    let e = performs_as_well(
        Proportion::new(3000, 5000),
        Proportion::new(3000, 5000),
        1,
        "k",
        &mut run(),
    )
    .unwrap();
    assert!(e.difference_interval.lower > -NON_INFERIORITY_MARGIN);
    // Its p-value is that of "worse by the margin", not of equal rates.
    assert!(e.p_value < 0.05, "{}", e.p_value);
    // Equal rates, little data: the interval is too wide to tell.
    assert_eq!(
        performs_as_well(
            Proportion::new(300, 500),
            Proportion::new(300, 500),
            1,
            "k",
            &mut run()
        ),
        None
    );
    // Clearly worse.
    assert_eq!(
        performs_as_well(
            Proportion::new(3000, 5000),
            Proportion::new(2500, 5000),
            1,
            "k",
            &mut run()
        ),
        None
    );
    // Better is also as good.
    assert!(
        performs_as_well(
            Proportion::new(2500, 5000),
            Proportion::new(3000, 5000),
            1,
            "k",
            &mut run()
        )
        .is_some()
    );
}

#[test]
fn trend_and_level() {
    let up = trend(
        Proportion::new(20, 200),
        Proportion::new(60, 200),
        1,
        "k",
        &mut run(),
    )
    .unwrap();
    assert_eq!(up.direction, Direction::Higher);
    let down = trend(
        Proportion::new(60, 200),
        Proportion::new(20, 200),
        1,
        "k",
        &mut run(),
    )
    .unwrap();
    assert_eq!(down.direction, Direction::Lower);
    assert_eq!(
        trend(
            Proportion::new(50, 200),
            Proportion::new(52, 200),
            1,
            "k",
            &mut run()
        ),
        None
    );

    let high = exceeds(Proportion::new(80, 200), 0.2, 1, "k", &mut run()).unwrap();
    assert!(high.arm.interval.lower > 0.2);
    assert!(high.p_value < 0.05);
    assert_eq!(
        exceeds(Proportion::new(50, 200), 0.2, 1, "k", &mut run()),
        None
    );
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
    assert_eq!(split_halves(&buckets[..1]), None);
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

// === single-look simulation ===

const SEEDS: u64 = 200;

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

fn labelled(arms: &[Proportion]) -> Vec<(&'static str, Proportion)> {
    ["a", "b", "c", "d"]
        .into_iter()
        .zip(arms.iter().copied())
        .collect()
}

#[test]
fn equal_models_rarely_produce_a_recommendation() {
    // Three equal arms: at most 5% of seeds name a best model.
    let fp = fired(&[0.6, 0.6, 0.6], 200, |arms| {
        best_arm(&labelled(arms), "k", &mut run()).is_some()
    });
    assert!(fp * 20 <= SEEDS, "{fp} of {SEEDS} seeds");
    // Two equal windows: at most 5% by construction, plus the spread of 200 seeds.
    let fp = fired(&[0.3, 0.3], 200, |w| {
        trend(w[0], w[1], 1, "k", &mut run()).is_some()
    });
    assert!(fp <= 15, "{fp} of {SEEDS} seeds");
}

#[test]
fn a_real_difference_is_found() {
    let hits = fired(&[0.5, 0.7], 300, |arms| {
        better(arms[0], arms[1], 1, "k", &mut run()).is_some()
    });
    assert!(hits * 5 >= SEEDS * 4, "{hits} of {SEEDS} seeds");
    // Among three arms, and named as the best one.
    let hits = fired(&[0.5, 0.7, 0.5], 400, |arms| {
        best_arm(&labelled(arms), "k", &mut run()).is_some_and(|best| best.arm == 1)
    });
    assert!(hits * 5 >= SEEDS * 4, "{hits} of {SEEDS} seeds");
}

#[test]
fn a_worse_cheap_model_is_rarely_called_as_good() {
    // Exactly the margin worse is the boundary of the null.
    let fp = fired(&[0.65, 0.60], 2000, |arms| {
        performs_as_well(arms[0], arms[1], 1, "k", &mut run()).is_some()
    });
    assert!(fp * 20 <= SEEDS, "{fp} of {SEEDS} seeds");
}
