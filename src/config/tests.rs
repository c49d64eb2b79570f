use std::collections::HashMap;
use std::time::Duration;

use nm_dataplane::hot_path::HotPath;
use nm_dataplane::{AuthStyle, WireFormat};

use super::*;

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn defaults_need_nothing() {
    let s = resolve(
        Mode::Serve,
        &Flags::default(),
        &HashMap::new(),
        FileSettings::default(),
    );
    let s = s.ok();
    assert_eq!(
        s.as_ref().map(|s| s.http_addr.to_string()).as_deref(),
        Some("0.0.0.0:8080")
    );
    assert_eq!(
        s.as_ref().map(|s| s.grpc_addr.to_string()).as_deref(),
        Some("127.0.0.1:50051")
    );
    assert_eq!(
        s.as_ref().map(|s| s.database_url.as_str()),
        Some("sqlite://./nm-data/nm-gateway.db?mode=rwc")
    );
    // A controlplane listens beyond loopback by default, so it needs its link secret.
    let secret = env(&[("NM_LINK_SECRET", STRONG)]);
    let c = resolve(
        Mode::Controlplane,
        &Flags::default(),
        &secret,
        FileSettings::default(),
    )
    .ok();
    assert_eq!(
        c.map(|s| s.grpc_addr.to_string()).as_deref(),
        Some("0.0.0.0:50051")
    );
}

const STRONG: &str = "lnk_9f3e7a1c5b2d8e4f6a0c3b7d1e5f9a2c4b6d8e0f";

#[test]
fn the_link_secret_is_required_where_the_link_leaves_the_host() {
    let resolve_with = |mode, pairs: &[(&str, &str)]| {
        resolve(
            mode,
            &Flags::default(),
            &env(pairs),
            FileSettings::default(),
        )
    };
    let err = |r: Result<Settings, ConfigError>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(resolve_with(Mode::Controlplane, &[])).starts_with("NM_LINK_SECRET: required"));
    assert!(resolve_with(Mode::Controlplane, &[("NM_GRPC_ADDR", "127.0.0.1:50051")]).is_ok());
    assert!(err(resolve_with(Mode::Dataplane, &[])).starts_with("NM_LINK_SECRET: required"));
    assert!(resolve_with(Mode::Dataplane, &[("NM_LINK_SECRET", STRONG)]).is_ok());
    assert!(resolve_with(Mode::Serve, &[]).is_ok_and(|s| s.link_secret.is_none()));
    // A secret must be strong and fit in metadata.
    assert!(err(resolve_with(Mode::Serve, &[("NM_LINK_SECRET", "short")])).contains("too short"));
    let spaced = "lnk 9f3e7a1c5b2d8e4f6a0c3b7d1e5f9a2c4b6d8e0f";
    assert!(
        err(resolve_with(Mode::Serve, &[("NM_LINK_SECRET", spaced)])).contains("printable ASCII")
    );
    // Never printed by Debug.
    let s = resolve_with(Mode::Dataplane, &[("NM_LINK_SECRET", STRONG)]).ok();
    assert!(!format!("{s:?}").contains(STRONG));
}

#[test]
fn guessable_secrets_are_refused_and_random_ones_accepted() {
    for weak in [
        "correct-horse-battery-staple-2024",
        "nmk_correct-horse-battery-staple-2024",
        "correcthorsebatterystaplemorewords",
        "iloveyoumorethananythingintheworld",
        "Summer2024!Summer2024!Summer2024!x",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "abcdefghijklmnopqrstuvwxyz0123456789",
        "qwertyuiopasdfghjklzxcvbnm1234567890",
        "nmk_test_admin_key_0123456789abcdef",
    ] {
        assert!(
            strong_secret("NM_BOOTSTRAP_KEY", weak).is_err(),
            "{weak}: {}",
            guesses_log10(weak)
        );
    }
    for random in [
        "c9eb13071a530560a7836487eee33da9",
        "u5/NEoouTVe3cdNiplT2LhwbQv6HsmIn",
        "9d2b1a91d0f90c7ee30dfed20a30417e",
        "GUqJSHpwUewzQsO/2BNOe3XGtYq1pLRE",
        "169be921aebb95b6f7f3a92e9376440f",
        "BhTN4SeX2sW4GCqBWaSHHmKMdCZiyEVL",
        "nmk_3f9c2a71d4e85b60a1c7e93d2f4b8a06c5e1d7f92b3a4c68",
        STRONG,
    ] {
        assert!(
            strong_secret("NM_BOOTSTRAP_KEY", random).is_ok(),
            "{random}: {}",
            guesses_log10(random)
        );
    }
}

#[test]
fn tls_settings_come_whole_and_only_where_they_apply() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
        .unwrap_or_else(|e| panic!("{e}"));
    let cert_path = dir.path().join("c.pem");
    let key_path = dir.path().join("k.pem");
    std::fs::write(&cert_path, cert.cert.pem()).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap_or_else(|e| panic!("{e}"));
    let (c, k) = (
        cert_path.display().to_string(),
        key_path.display().to_string(),
    );
    let run = |mode, pairs: &[(&str, &str)]| {
        resolve(
            mode,
            &Flags::default(),
            &env(pairs),
            FileSettings::default(),
        )
        .map_err(|e| e.to_string())
    };
    let cp = |pairs: &[(&str, &str)]| {
        let mut all = vec![("NM_GRPC_ADDR", "127.0.0.1:1")];
        all.extend_from_slice(pairs);
        run(Mode::Controlplane, &all)
    };
    assert!(
        cp(&[("NM_GRPC_TLS_CERT", &c), ("NM_GRPC_TLS_KEY", &k)])
            .is_ok_and(|s| s.grpc_tls.is_some())
    );
    assert!(cp(&[("NM_GRPC_TLS_CERT", &c)]).is_err_and(|e| e.starts_with("NM_GRPC_TLS_KEY")));
    assert!(
        cp(&[("NM_GRPC_TLS_CLIENT_CA", &c)]).is_err_and(|e| e.starts_with("NM_GRPC_TLS_CLIENT_CA"))
    );
    assert!(
        cp(&[("NM_GRPC_TLS_CERT", &k), ("NM_GRPC_TLS_KEY", &k)])
            .is_err_and(|e| e.starts_with("NM_GRPC_TLS_CERT"))
    );
    assert!(
        cp(&[
            ("NM_GRPC_TLS_CERT", "/nonexistent.pem"),
            ("NM_GRPC_TLS_KEY", &k)
        ])
        .is_err_and(|e| e.contains("nonexistent"))
    );
    let dp = |pairs: &[(&str, &str)]| {
        let mut all = vec![("NM_LINK_SECRET", STRONG)];
        all.extend_from_slice(pairs);
        run(Mode::Dataplane, &all)
    };
    let https = ("NM_CONTROLPLANE_URL", "https://cp.internal:50051");
    assert!(
        dp(&[https, ("NM_CONTROLPLANE_CA", &c)]).is_ok_and(|s| s.controlplane_tls.ca_pem.is_some())
    );
    assert!(dp(&[https]).is_ok_and(|s| s.controlplane_tls.ca_pem.is_none()));
    assert!(
        dp(&[
            https,
            ("NM_CONTROLPLANE_CLIENT_CERT", &c),
            ("NM_CONTROLPLANE_CLIENT_KEY", &k)
        ])
        .is_ok_and(|s| s.controlplane_tls.identity.is_some())
    );
    assert!(
        dp(&[https, ("NM_CONTROLPLANE_CLIENT_CERT", &c)])
            .is_err_and(|e| e.starts_with("NM_CONTROLPLANE_CLIENT_KEY"))
    );
    assert!(dp(&[("NM_CONTROLPLANE_CA", &c)]).is_err_and(|e| e.contains("not https")));
}

#[test]
fn flag_beats_env_beats_file() {
    let file: FileSettings =
        toml::from_str("http_addr = \"127.0.0.1:1\"").unwrap_or_else(|e| panic!("{e}"));
    let e = env(&[("NM_HTTP_ADDR", "127.0.0.1:2")]);
    let flags = Flags {
        http_addr: Some("127.0.0.1:3".into()),
        ..Default::default()
    };
    let port = |f: &Flags, e: &HashMap<String, String>| {
        resolve(Mode::Serve, f, e, file.clone())
            .map(|s| s.http_addr.port())
            .unwrap_or(0)
    };
    assert_eq!(port(&flags, &e), 3);
    assert_eq!(port(&Flags::default(), &e), 2);
    assert_eq!(port(&Flags::default(), &HashMap::new()), 1);
}

#[test]
fn provider_overrides_from_env_and_file() {
    let mut file = FileSettings::default();
    file.providers.insert(
        "local".into(),
        FileProvider {
            base_url: Some("http://127.0.0.1:7000/v".into()),
            auth: Some(AuthStyle::Bearer),
            ..Default::default()
        },
    );
    let e = env(&[
        ("NM_UPSTREAM_OPENAI", "http://127.0.0.1:9100"),
        ("NM_PROVIDER_KEY_ANTHROPIC", "sk-ant"),
    ]);
    let s = resolve(Mode::Serve, &Flags::default(), &e, file).ok();
    let reg = s.map(|s| s.registry).unwrap_or_default();
    assert_eq!(
        reg.get("openai")
            .map(|p| p.authority.to_string())
            .as_deref(),
        Some("127.0.0.1:9100")
    );
    assert_eq!(
        reg.get("anthropic")
            .and_then(|p| p.api_key.clone())
            .as_deref(),
        Some("sk-ant")
    );
    assert_eq!(reg.get("local").map(|p| p.base_path.as_str()), Some("/v"));
}

#[test]
fn a_providers_wire_format_is_format_or_its_older_name_errors() {
    let resolve_file = |text: &str| {
        let file: FileSettings = toml::from_str(text).unwrap_or_else(|e| panic!("{e}"));
        resolve(Mode::Serve, &Flags::default(), &HashMap::new(), file)
    };
    let format_of = |text: &str| {
        resolve_file(text)
            .ok()
            .and_then(|s| s.registry.get("acme").map(|p| p.format))
    };
    let acme = "[providers.acme]\nbase_url = \"http://127.0.0.1:7000\"\nauth = \"bearer\"\n";
    assert_eq!(format_of(acme), Some(WireFormat::Openai));
    assert_eq!(
        format_of(&format!("{acme}format = \"anthropic\"\n")),
        Some(WireFormat::Anthropic)
    );
    assert_eq!(
        format_of(&format!("{acme}errors = \"gemini\"\n")),
        Some(WireFormat::Gemini)
    );
    assert_eq!(
        format_of(&format!("{acme}format = \"gemini\"\nerrors = \"gemini\"\n")),
        Some(WireFormat::Gemini)
    );
    let err = resolve_file(&format!("{acme}format = \"gemini\"\nerrors = \"openai\"\n"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("providers.acme") && err.contains("disagree"),
        "{err}"
    );
    // A built-in keeps its own format unless told otherwise.
    let s = resolve_file("[providers.anthropic]\nbase_url = \"http://127.0.0.1:7001\"\n").ok();
    assert_eq!(
        s.and_then(|s| s.registry.get("anthropic").map(|p| p.format)),
        Some(WireFormat::Anthropic)
    );
}

#[test]
fn hot_path_mechanisms_are_all_on_unless_a_benchmark_turns_them_off() {
    let with = |v: &str| {
        resolve(
            Mode::Serve,
            &Flags::default(),
            &env(&[("NM_HOT_PATH_OFF", v)]),
            FileSettings::default(),
        )
    };
    let default = resolve(
        Mode::Serve,
        &Flags::default(),
        &HashMap::new(),
        FileSettings::default(),
    );
    assert_eq!(default.ok().map(|s| s.hot_path), Some(HotPath::default()));
    assert_eq!(
        with("key_cache").ok().map(|s| s.hot_path.key_cache),
        Some(false)
    );
    let err = with("key_cache,warp").err().map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("NM_HOT_PATH_OFF")),
        "{err:?}"
    );
}

#[test]
fn bad_values_name_the_setting() {
    let cases = [
        ("NM_HTTP_ADDR", "nonsense"),
        ("NM_UPSTREAM_NOPE", "http://x"),
        ("NM_UPSTREAM_OPENAI", "ftp://x"),
        ("NM_DATABASE_URL", "mysql://x"),
        ("NM_MAX_BODY_BYTES", "lots"),
        ("NM_LOG_FORMAT", "xml"),
        ("NM_CONTROLPLANE_URL", "localhost"),
    ];
    for (k, v) in cases {
        let err = resolve(
            Mode::Serve,
            &Flags::default(),
            &env(&[(k, v)]),
            FileSettings::default(),
        )
        .err();
        let msg = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains(k) || msg.contains("providers"),
            "{k}={v}: {msg}"
        );
    }
}

#[test]
fn file_rejects_unknown_keys() {
    assert!(toml::from_str::<FileSettings>("htp_addr = \"x\"").is_err());
    let f: Result<FileSettings, _> =
        toml::from_str("[providers.openai]\nbase_url = \"http://127.0.0.1:1\"\n");
    assert!(f.is_ok());
}

// === connection and body limits, record durability (issue 21) ===

fn resolved(pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
    resolve(
        Mode::Dataplane,
        &Flags::default(),
        &env(&[
            &[
                ("NM_CONTROLPLANE_URL", "http://127.0.0.1:9090"),
                (
                    "NM_LINK_SECRET",
                    "lnk_8e2d4f6a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e",
                ),
            ],
            pairs,
        ]
        .concat()),
        FileSettings::default(),
    )
}

/// A refusal naming `key` (`main` exits 64 on every `ConfigError`).
fn refused(key: &str, value: &str) -> String {
    match resolved(&[(key, value)]) {
        Err(ConfigError::Invalid {
            key: named,
            problem,
        }) => {
            assert_eq!(named, key, "{key}={value}: {problem}");
            problem
        }
        other => panic!("{key}={value} was not refused: {other:?}"),
    }
}

#[test]
fn connection_limits_default() {
    let s = resolved(&[]).unwrap();
    let l = s.conn_limits;
    assert_eq!(l.header_timeout, Duration::from_secs(10));
    assert_eq!(l.body_idle_timeout, Duration::from_secs(30));
    assert_eq!(l.body_min_rate, 1024);
    assert_eq!(l.max_connections, 0, "0: from the open-file limit at start");
    assert_eq!(s.upstream_idle_timeout, Duration::from_secs(300));
    assert_eq!(
        s.record_durability,
        nm_dataplane::journal::Durability::Memory
    );
}

#[test]
fn connection_limits_take_valid_values() {
    let s = resolved(&[
        ("NM_CLIENT_HEADER_TIMEOUT_SECS", "3"),
        ("NM_CLIENT_BODY_IDLE_TIMEOUT_SECS", "7"),
        ("NM_CLIENT_BODY_MIN_RATE", "0"),
        ("NM_RESPONSE_IDLE_TIMEOUT_SECS", "45"),
        ("NM_MAX_CONNECTIONS", "5000"),
        ("NM_RECORD_DURABILITY", "spool"),
    ])
    .unwrap();
    let l = s.conn_limits;
    assert_eq!(l.header_timeout, Duration::from_secs(3));
    assert_eq!(l.body_idle_timeout, Duration::from_secs(7));
    assert_eq!(l.body_min_rate, 0);
    assert_eq!(l.max_connections, 5000);
    assert_eq!(s.upstream_idle_timeout, Duration::from_secs(45));
    assert_eq!(
        s.record_durability,
        nm_dataplane::journal::Durability::Spool
    );
}

#[test]
fn connection_limits_refuse_bad_values_naming_the_setting() {
    for key in [
        "NM_CLIENT_HEADER_TIMEOUT_SECS",
        "NM_CLIENT_BODY_IDLE_TIMEOUT_SECS",
        "NM_RESPONSE_IDLE_TIMEOUT_SECS",
    ] {
        assert!(refused(key, "0").contains("at least 1 second"), "{key}");
        refused(key, "soon");
        refused(key, "-1");
    }
    for key in ["NM_CLIENT_BODY_MIN_RATE", "NM_MAX_CONNECTIONS"] {
        refused(key, "fast");
        refused(key, "-5");
        refused(key, "1.5");
    }
    assert!(refused("NM_RECORD_DURABILITY", "disk").contains("`spool`"));
}
