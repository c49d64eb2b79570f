//! The rules (validation, transitions) and one store round trip on SQLite.

use super::*;

fn catalogue() -> Catalogue {
    let p = |format: &str, credential: bool| ProviderInfo {
        wire_format: format.to_owned(),
        operator_credential: credential,
    };
    Catalogue::new([
        ("openai".to_owned(), p("openai", false)),
        ("groq".to_owned(), p("openai", true)),
        ("mistral".to_owned(), p("openai", false)),
        ("anthropic".to_owned(), p("anthropic", true)),
    ])
}

fn arm(name: &str, provider: &str, model: &str, weight: u32) -> ArmSpec {
    ArmSpec {
        name: name.to_owned(),
        provider: provider.to_owned(),
        model: model.to_owned(),
        weight,
    }
}

fn new(arms: Vec<ArmSpec>) -> NewExperiment {
    NewExperiment {
        agent: "support-bot".to_owned(),
        arms,
        ..NewExperiment::default()
    }
}

fn good() -> NewExperiment {
    new(vec![
        arm("control", "openai", "gpt-4o-mini", 50),
        arm("candidate", "groq", "llama-3.3-70b-versatile", 50),
    ])
}

fn refused(n: NewExperiment) -> String {
    match check(n, &catalogue()) {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_good_experiment_passes_with_its_defaults() {
    let mut n = good();
    n.env = Some(" production ".to_owned());
    n.guardrails = vec![
        "p95_latency".into(),
        "abandonment".into(),
        "abandonment".into(),
    ];
    n.arms[1].provider = "GROQ".to_owned();
    let c = check(n, &catalogue()).unwrap();
    assert_eq!(c.env, Some(Env::Production));
    assert_eq!(c.unit, Unit::Session);
    assert_eq!(
        c.guardrails,
        [Guardrail::Abandonment, Guardrail::P95Latency],
        "sorted, each once"
    );
    assert_eq!(c.arms[1].provider, "groq", "provider names are lower-cased");
    assert_eq!((c.max_sessions, c.max_days), (None, None), "0: no limit");
}

#[test]
fn every_bad_input_is_refused_with_its_rule() {
    let cases: Vec<(NewExperiment, &str)> = vec![
        (
            NewExperiment {
                agent: " ".into(),
                ..good()
            },
            "agent must be",
        ),
        (
            NewExperiment {
                env: Some("prod".into()),
                ..good()
            },
            "env:",
        ),
        (
            new(vec![arm("a", "openai", "gpt-4o", 1)]),
            "an experiment needs 2 to 16 arms",
        ),
        (
            new((0..17)
                .map(|i| arm(&format!("a{i}"), "openai", "gpt-4o", 1))
                .collect()),
            "an experiment needs 2 to 16 arms",
        ),
        (
            new(vec![
                arm("a", "openai", "gpt-4o", 0),
                arm("b", "openai", "gpt-4o-mini", 1),
            ]),
            "weights must be whole numbers from 1 to 1000000",
        ),
        (
            new(vec![
                arm("a", "openai", "gpt-4o", 1_000_001),
                arm("b", "openai", "gpt-4o-mini", 1),
            ]),
            "weights must be whole numbers",
        ),
        (
            new(vec![
                arm("a b", "openai", "gpt-4o", 1),
                arm("b", "openai", "gpt-4o-mini", 1),
            ]),
            "arm names must be",
        ),
        (
            new(vec![
                arm("a", "openai", "gpt-4o", 1),
                arm("a", "openai", "gpt-4o-mini", 1),
            ]),
            "arm names must be unique",
        ),
        (
            new(vec![
                arm("a", "openai", "gpt-4o", 1),
                arm("b", "nowhere", "x", 1),
            ]),
            "arm b: unknown provider \"nowhere\"; known: anthropic, groq, mistral, openai",
        ),
        (
            new(vec![
                arm("a", "openai", "gpt-4o", 1),
                arm("b", "anthropic", "claude-sonnet-4", 1),
            ]),
            "arm b: provider anthropic speaks the anthropic wire format, but the first arm's \
             provider openai speaks openai",
        ),
        (
            new(vec![
                arm("a", "openai", "gpt-4o", 1),
                arm("b", "mistral", "mistral-large", 1),
            ]),
            "arm b: provider mistral has no operator credential (NM_PROVIDER_KEY_MISTRAL)",
        ),
        (
            new(vec![
                arm("a", "openai", "", 1),
                arm("b", "openai", "gpt-4o-mini", 1),
            ]),
            "arm a: the model must be",
        ),
        (
            NewExperiment {
                unit: "user".into(),
                ..good()
            },
            "unit: \"user\" is not session or request",
        ),
        (
            NewExperiment {
                guardrails: vec!["latency".into()],
                ..good()
            },
            "guardrails: \"latency\" is not one of",
        ),
        (
            NewExperiment {
                max_sessions: u64::MAX,
                ..good()
            },
            "max_sessions",
        ),
        (
            NewExperiment {
                description: "x".repeat(1001),
                ..good()
            },
            "description: at most 1000 characters",
        ),
    ];
    for (n, rule) in cases {
        let m = refused(n);
        assert!(m.contains(rule), "{m:?} should say {rule:?}");
    }
}

/// The first arm's provider needs no operator credential (clients call it with theirs); two
/// arms on it are fine without one.
#[test]
fn arms_on_the_first_arms_provider_need_no_credential() {
    let n = new(vec![
        arm("a", "mistral", "mistral-small", 1),
        arm("b", "mistral", "mistral-large", 1),
        arm("c", "groq", "llama", 1),
    ]);
    assert!(check(n, &catalogue()).is_ok());
}

fn experiment(arms: &[&str]) -> Experiment {
    Experiment {
        id: "exp_0123456789ab".into(),
        agent: "a".into(),
        env: None,
        state: State::Running,
        salt: Salt::new([7; 16]),
        unit: Unit::Session,
        guardrails: Vec::new(),
        max_sessions: None,
        max_days: None,
        auto_promote: false,
        auto_rollback: false,
        description: String::new(),
        winner: None,
        promoted: false,
        reason: "created".into(),
        created_at_ms: 0,
        updated_at_ms: 0,
        arms: arms
            .iter()
            .map(|n| ExperimentArm {
                name: (*n).to_owned(),
                provider: "openai".into(),
                model: format!("m-{n}"),
                weight: 1,
                rolled_back: false,
            })
            .collect(),
    }
}

fn step(e: &mut Experiment, action: Action, arm: Option<&str>) -> Result<Option<String>> {
    transition(e, action, arm, "")
}

fn precondition(r: Result<Option<String>>) -> String {
    match r {
        Err(Error::FailedPrecondition(m)) => m,
        other => panic!("expected FailedPrecondition, got {other:?}"),
    }
}

#[test]
fn only_legal_transitions_happen() {
    let mut e = experiment(&["a", "b"]);
    assert!(precondition(step(&mut e, Action::Resume, None)).contains("only a paused"));
    step(&mut e, Action::Pause, None).unwrap();
    assert_eq!(e.state, State::Paused);
    assert!(e.live().is_none(), "paused: not live");
    assert!(precondition(step(&mut e, Action::Pause, None)).contains("only a running"));
    step(&mut e, Action::Resume, None).unwrap();
    assert_eq!(e.state, State::Running);
    assert_eq!(e.live().map(|l| l.arms.len()), Some(2));

    // Promotion without a winner needs an arm.
    assert!(precondition(step(&mut e, Action::Promote, None)).contains("no decided winner"));
    step(&mut e, Action::Decide, Some("b")).unwrap();
    assert_eq!((e.state, e.winner.as_deref()), (State::Decided, Some("b")));
    assert!(e.live().is_none(), "decided, not promoted: not live");
    assert!(precondition(step(&mut e, Action::Pause, None)).contains("it is decided"));
    assert_eq!(
        step(&mut e, Action::Promote, None).unwrap().as_deref(),
        Some("b")
    );
    assert!(e.promoted);
    let live = e.live().unwrap();
    assert_eq!(live.arms.len(), 1, "promoted: the winner alone");
    assert_eq!(&*live.arms[0].model, "m-b");
    assert!(precondition(step(&mut e, Action::Promote, Some("a"))).contains("promoted already"));

    step(&mut e, Action::Stop, None).unwrap();
    assert_eq!(e.state, State::Stopped);
    assert!(e.live().is_none());
    for action in [
        Action::Pause,
        Action::Resume,
        Action::Stop,
        Action::Promote,
        Action::Rollback,
        Action::Decide,
        Action::Harm,
        Action::Inconclusive,
    ] {
        assert!(
            precondition(step(&mut e, action, Some("a"))).contains("stopped"),
            "{action:?}"
        );
    }
}

#[test]
fn rollback_keeps_one_arm_and_lifts_harm() {
    let mut e = experiment(&["a", "b", "c"]);
    step(&mut e, Action::Harm, Some("c")).unwrap();
    assert_eq!(e.state, State::Harm);
    assert!(e.live().is_none(), "harm: not live");
    step(&mut e, Action::Rollback, Some("c")).unwrap();
    assert_eq!(e.state, State::Running, "the others run on");
    let live = e.live().unwrap();
    assert_eq!(
        live.arms.iter().map(|a| &*a.name).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert!(precondition(step(&mut e, Action::Rollback, Some("c"))).contains("was rolled back"));
    assert!(matches!(
        step(&mut e, Action::Rollback, Some("z")),
        Err(Error::InvalidArgument(m)) if m.contains("no arm named \"z\"")
    ));
    step(&mut e, Action::Rollback, Some("b")).unwrap();
    assert!(precondition(step(&mut e, Action::Rollback, Some("a"))).contains("last active arm"));
    assert!(
        precondition(step(&mut e, Action::Promote, Some("b"))).contains("rolled back"),
        "a rolled-back arm cannot be promoted"
    );
    step(&mut e, Action::Inconclusive, None).unwrap();
    assert!(precondition(step(&mut e, Action::Rollback, Some("a"))).contains("inconclusive"));
}

#[tokio::test]
async fn stored_changes_keep_history_audit_and_the_live_set() {
    use crate::store::entity::audit_event;

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/e.db?mode=rwc", dir.path().display());
    let store = Store::connect(&url).await.unwrap();
    let x = Experiments::load(store.clone()).await.unwrap();
    let mut live = x.subscribe();
    assert!(x.live().experiments.is_empty());

    let e = x.create("key_admin", good(), &catalogue()).await.unwrap();
    assert!(e.id.starts_with("exp_") && e.id.len() == 16, "{}", e.id);
    assert!(live.has_changed().unwrap());
    let set = live.borrow_and_update().clone();
    assert_eq!(set.experiments.len(), 1);
    assert_eq!(set.experiments[0].salt, e.salt);

    // The same agent on one env conflicts with an experiment on every env.
    let mut other = good();
    other.env = Some("staging".into());
    let conflict = x.create("key_admin", other, &catalogue()).await;
    assert!(
        matches!(&conflict, Err(Error::FailedPrecondition(m)) if m.contains(&e.id)),
        "{conflict:?}"
    );

    x.pause("key_admin", &e.id, "looking").await.unwrap();
    assert!(x.live().experiments.is_empty());
    x.resume("key_admin", &e.id, "").await.unwrap();
    x.rollback("key_admin", &e.id, "candidate", "")
        .await
        .unwrap();
    let one = x.live();
    assert_eq!(one.experiments[0].arms.len(), 1);
    x.stop("key_admin", &e.id, "done").await.unwrap();
    assert!(x.live().experiments.is_empty());

    let kinds: Vec<String> = x
        .history(&e.id)
        .await
        .unwrap()
        .into_iter()
        .map(|ev| ev.kind)
        .collect();
    assert_eq!(
        kinds,
        ["created", "paused", "resumed", "rolled_back", "stopped"]
    );
    let actions: Vec<String> = audit_event::Entity::find()
        .filter(audit_event::Column::Target.eq(e.id.as_str()))
        .order_by_asc(audit_event::Column::AtMs)
        .order_by_asc(audit_event::Column::Id)
        .all(store.conn())
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.action)
        .collect();
    assert_eq!(
        actions,
        [
            "experiment.create",
            "experiment.pause",
            "experiment.resume",
            "experiment.rollback",
            "experiment.stop"
        ]
    );
    let audit_text = format!("{:?}", audit_event::Entity::find().all(store.conn()).await);
    assert!(
        !audit_text.contains(&e.salt.to_string()),
        "the salt never reaches the audit trail"
    );

    // Stopped: the agent is free again.
    let again = x.create("key_admin", good(), &catalogue()).await.unwrap();
    assert_eq!(x.get(&again.id).await.unwrap(), again);
    assert_ne!(again.salt, e.salt, "a salt per experiment");
    assert!(matches!(x.get("exp_none").await, Err(Error::NotFound(_))));

    // An experiment that leaves harm or is promoted takes its agent back: not while another
    // holds it.
    x.harm(&again.id, "candidate", "abandonment worse")
        .await
        .unwrap();
    let third = x.create("key_admin", good(), &catalogue()).await.unwrap();
    for r in [
        x.rollback("key_admin", &again.id, "candidate", "").await,
        x.promote("key_admin", &again.id, "control", "").await,
    ] {
        assert!(
            matches!(&r, Err(Error::FailedPrecondition(m)) if m.contains(&third.id)),
            "{r:?}"
        );
    }
    x.stop("key_admin", &third.id, "").await.unwrap();
    let back = x
        .rollback("system", &again.id, "candidate", "")
        .await
        .unwrap();
    assert_eq!(back.state, State::Running);
    let decided = x
        .decide(&again.id, "control", "control wins")
        .await
        .unwrap();
    assert_eq!(
        (decided.state, decided.winner.as_deref()),
        (State::Decided, Some("control"))
    );
    let promoted = x.promote("system", &again.id, "", "").await.unwrap();
    assert!(promoted.promoted);
    assert_eq!(x.live().experiments[0].arms.len(), 1);
}
