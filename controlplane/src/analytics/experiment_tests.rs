use super::*;
use crate::analytics::experiment_simulate;

fn arm(name: &str, judged: u64, successes: u64) -> ArmCounts {
    ArmCounts {
        name: name.to_owned(),
        sessions: judged,
        requests: judged * 2,
        signals: judged,
        judged,
        successes,
        ..ArmCounts::default()
    }
}

fn plan() -> Plan {
    Plan::default()
}

#[test]
fn arms_are_not_compared_before_each_has_enough_units() {
    let e = evaluate(&plan(), &[arm("a", 29, 29), arm("b", 400, 0)], 0);
    assert_eq!(e.verdict, Verdict::Running);
    assert!(e.summary.starts_with("Collecting"), "{}", e.summary);
}

#[test]
fn a_clear_difference_decides_for_the_better_arm_in_either_position() {
    for (arms, winner) in [
        (vec![arm("a", 400, 220), arm("b", 400, 290)], 1),
        (vec![arm("b", 400, 290), arm("a", 400, 220)], 0),
        (
            vec![arm("a", 400, 220), arm("c", 400, 225), arm("b", 400, 320)],
            2,
        ),
    ] {
        let e = evaluate(&plan(), &arms, 0);
        assert_eq!(e.verdict, Verdict::Decided { winner }, "{}", e.summary);
        assert_eq!(decide(&arms), Some(winner));
        assert!(
            e.summary
                .starts_with(&format!("{} wins", arms[winner].name))
        );
    }
}

#[test]
fn no_winner_unless_it_beats_every_other_arm() {
    // b beats a clearly, but not c.
    let arms = [arm("a", 400, 200), arm("b", 400, 300), arm("c", 400, 295)];
    let e = evaluate(&plan(), &arms, 0);
    assert_eq!(e.verdict, Verdict::Running, "{}", e.summary);
    assert!(e.units_to_decision.is_some());
}

#[test]
fn the_estimate_shrinks_as_evidence_grows() {
    let early = evaluate(&plan(), &[arm("a", 60, 33), arm("b", 60, 42)], 0);
    let later = evaluate(&plan(), &[arm("a", 150, 82), arm("b", 150, 105)], 0);
    let (e, l) = (
        early.units_to_decision.unwrap(),
        later.units_to_decision.unwrap(),
    );
    assert!(l < e, "{e} then {l}");
    // Equal rates: no estimate.
    let same = evaluate(&plan(), &[arm("a", 100, 50), arm("b", 100, 50)], 0);
    assert_eq!(same.units_to_decision, None);
}

#[test]
fn limits_end_an_undecided_experiment_with_what_was_ruled_out() {
    let arms = [arm("a", 500, 275), arm("b", 500, 280)];
    let p = Plan {
        max_sessions: 1000,
        ..plan()
    };
    let e = evaluate(&p, &arms, 0);
    let Verdict::Inconclusive { ruled_out } = e.verdict else {
        panic!("{:?}", e.verdict)
    };
    assert!(ruled_out > 0.05 && ruled_out < 0.2, "{ruled_out}");
    assert!(e.summary.contains("ruled out"), "{}", e.summary);

    let p = Plan {
        max_days: 14,
        started_at_ms: 0,
        ..plan()
    };
    assert_eq!(
        evaluate(&p, &arms, 13 * MS_PER_DAY).verdict,
        Verdict::Running
    );
    assert!(matches!(
        evaluate(&p, &arms, 14 * MS_PER_DAY).verdict,
        Verdict::Inconclusive { .. }
    ));
}

#[test]
fn a_guardrail_stops_the_worse_arm_before_any_winner() {
    let p = Plan {
        guardrails: vec![Guardrail::ErrorRate, Guardrail::Abandonment],
        ..plan()
    };
    let mut a = arm("a", 400, 220);
    let mut b = arm("b", 400, 300);
    a.errors = 8; // of 800 requests
    b.errors = 80;
    let e = evaluate(&p, &[a.clone(), b.clone()], 0);
    assert_eq!(
        e.verdict,
        Verdict::Harm {
            arm: 1,
            guardrail: Guardrail::ErrorRate
        }
    );
    assert_eq!(e.arms[1].guardrails[0].2, GuardStatus::Harm);
    assert_eq!(e.arms[0].guardrails[0].2, GuardStatus::Ok);
    assert!((e.arms[1].guardrails[0].1 - 0.1).abs() < 1e-9);
    // Equal error rates: no harm, and the primary metric decides.
    b.errors = 8;
    let e = evaluate(&p, &[a, b], 0);
    assert_eq!(e.verdict, Verdict::Decided { winner: 1 });
}

#[test]
fn names_read_back() {
    for g in Guardrail::ALL {
        assert_eq!(g.as_str().parse::<Guardrail>().ok(), Some(g));
    }
    assert!("latency".parse::<Guardrail>().is_err());
    assert_eq!("".parse::<Unit>().ok(), Some(Unit::Session));
    assert_eq!("request".parse::<Unit>().ok(), Some(Unit::Request));
    assert!("user".parse::<Unit>().is_err());
}

/// Equal arms, looked at after every unit up to 1,000: a wrong decision in at most 5% of
/// experiments (a smaller run than `nm-analytics-bench --experiments`; its 200 runs allow
/// 10 + 3 standard deviations).
#[test]
fn equal_arms_rarely_decide_with_a_look_after_every_unit() {
    let o = experiment_simulate::run(&[0.55, 0.55], 200, 1_000, 7);
    assert!(o.wrong <= 19, "{o:?}");
}

/// 0.55 against 0.70: the better arm, nearly always.
#[test]
fn a_real_difference_is_found_for_the_right_arm() {
    let o = experiment_simulate::run(&[0.55, 0.70], 100, 3_000, 11);
    assert!(o.right >= 93, "{o:?}");
    assert_eq!(o.wrong, 0, "{o:?}");
}
