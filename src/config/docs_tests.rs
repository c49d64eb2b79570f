//! The declaration against what others say about it: docs/settings.md's table, the Helm chart
//! (values.yaml, values.schema.json, the templates), and the rows' own defaults.
//!
//! `NM_BLESS=1 cargo nextest run -E 'test(settings_doc)'` rewrites the table in docs/settings.md
//! from the declaration.
//!
//! The chart's rule, row by row (`Meta::chart`):
//! - `Chart::No`: the chart never sets the variable (an operator may, through `extraEnv`).
//! - `Chart::Template`, `Chart::Otel`: the templates name the variable (for a family, its prefix).
//! - `Chart::Value(k)`: `config.k` exists in values.yaml with the declared default, in the schema
//!   with the declared TOML type, and `NM_<K in SNAKE_CASE>` is the row's variable (configmap.yaml
//!   derives the name so); `Chart::ValueOwnDefault(k, why)` the same with a chart default of its
//!   own, which the row's parse function must accept.
//! - Every `NM_*` and `OTEL_*` name the templates set is a declared row that says the chart sets
//!   it; every `config.*` value is a row's; every bound and enum value the schema admits for a
//!   `config.*` or `otel.*` value is accepted by the row's parse function.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::Mode;
use super::decl::{Chart, Default, Group, Kind, Lit, Meta, Raw};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// === docs/settings.md ===

const TABLE_START: &str = "<!-- settings table: generated from src/config; NM_BLESS=1 cargo nextest run -E 'test(settings_doc)' rewrites it -->";
const TABLE_END: &str = "<!-- end of settings table -->";

fn code(s: &str) -> String {
    format!("`{s}`")
}

fn lit(l: Lit) -> String {
    match l {
        Lit::Str(s) => code(s),
        Lit::Int(n) if n >= 1 << 20 && n % (1 << 20) == 0 => {
            format!("{} ({} MiB)", code(&n.to_string()), n >> 20)
        }
        Lit::Int(n) => code(&n.to_string()),
    }
}

fn default_cell(d: Default) -> String {
    match d {
        Default::Unset => "unset".to_owned(),
        Default::Is(l) => lit(l),
        Default::ByMode {
            other,
            controlplane,
        } => format!(
            "{} (controlplane), {} (others)",
            lit(controlplane),
            lit(other)
        ),
        Default::Described(text) => text.to_owned(),
    }
}

/// The settings table as docs/settings.md holds it, one section per group.
fn table() -> String {
    let mut out = String::new();
    for group in Group::ALL {
        let _ = writeln!(out, "\n### {}\n", group.title());
        out.push_str("| env | flag | file key | default | what it does |\n|---|---|---|---|---|\n");
        for m in super::all().filter(|m| m.group == group) {
            let flag = m
                .flag
                .map_or("-".to_owned(), |f| code(&format!("--{}", f.long)));
            let file = m.file.map_or("-".to_owned(), |(k, _)| code(k));
            let _ = writeln!(
                out,
                "| {} | {flag} | {file} | {} | {} |",
                code(m.env),
                default_cell(m.default),
                m.doc.trim()
            );
        }
    }
    out.push('\n');
    out
}

#[test]
fn settings_doc_table_is_the_declaration() {
    let path = repo().join("docs/settings.md");
    let doc = read(&path);
    let (Some(start), Some(end)) = (doc.find(TABLE_START), doc.find(TABLE_END)) else {
        panic!(
            "{}: no `{TABLE_START}` ... `{TABLE_END}` block",
            path.display()
        );
    };
    let body_start = start + TABLE_START.len();
    let want = table();
    if doc[body_start..end] == want {
        return;
    }
    if std::env::var_os("NM_BLESS").is_some() {
        let fresh = format!("{}{want}{}", &doc[..body_start], &doc[end..]);
        std::fs::write(&path, fresh).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let have: BTreeSet<&str> = doc[body_start..end].lines().collect();
    let missing: Vec<&str> = want.lines().filter(|l| !have.contains(l)).collect();
    let wanted: BTreeSet<&str> = want.lines().collect();
    let extra: Vec<&str> = doc[body_start..end]
        .lines()
        .filter(|l| !wanted.contains(l))
        .collect();
    panic!(
        "docs/settings.md disagrees with the declaration in src/config (rewrite it with \
         NM_BLESS=1 cargo nextest run -E 'test(settings_doc)').\nlines the declaration makes that \
         the doc lacks:\n{}\nlines of the doc the declaration does not make:\n{}",
        missing.join("\n"),
        extra.join("\n")
    );
}

// === the declaration itself ===

#[test]
fn settings_names_keys_and_flags_are_unique_and_defaults_parse() {
    let mut envs = BTreeSet::new();
    let mut keys = BTreeSet::new();
    let mut flags = BTreeSet::new();
    for m in super::all() {
        assert!(envs.insert(m.env), "{} declared twice", m.env);
        assert!(
            m.env.starts_with("NM_") || m.env.starts_with("OTEL_"),
            "{}",
            m.env
        );
        assert!(!m.doc.trim().is_empty(), "{} has no doc", m.env);
        if let Some((k, _)) = m.file {
            assert!(keys.insert(k), "file key {k} declared twice");
        }
        if let Some(f) = m.flag {
            assert!(flags.insert(f.long), "flag --{} declared twice", f.long);
        }
        for mode in [
            Mode::Serve,
            Mode::Dataplane,
            Mode::Controlplane,
            Mode::Client,
        ] {
            if let Some(raw) = m.default_raw(mode)
                && let Err(e) = (m.check)(raw)
            {
                panic!("{}: its default does not parse: {e}", m.env);
            }
        }
    }
}

#[test]
fn settings_file_keys_are_the_declared_ones_of_their_type() {
    for m in super::all() {
        let Some((key, kind)) = m.file else { continue };
        let good = match kind {
            Kind::Str => format!("{key} = \"x\""),
            Kind::Int => format!("{key} = 1"),
        };
        let bad = match kind {
            Kind::Str => format!("{key} = 1"),
            Kind::Int => format!("{key} = \"1\""),
        };
        assert!(
            toml::from_str::<super::FileSettings>(&good).is_ok(),
            "{good}"
        );
        let err = toml::from_str::<super::FileSettings>(&bad)
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains(key)),
            "{bad}: {err:?}"
        );
    }
    let err = toml::from_str::<super::FileSettings>("htp_addr = \"x\"")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("htp_addr") && err.contains("http_addr"),
        "{err}"
    );
}

// === the Helm chart ===

fn chart() -> PathBuf {
    repo().join("helm/nm-gateway")
}

/// The scalar values of a top-level section of values.yaml (`config:`, `otel:`), read line by
/// line: the chart keeps these sections flat (`  key: value`), which this reader asserts.
fn section(values: &str, name: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut inside = false;
    for line in values.lines() {
        if line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(' ') {
            inside = line == format!("{name}:");
            continue;
        }
        if !inside || line.starts_with("    ") {
            continue;
        }
        let (key, value) = line
            .trim()
            .split_once(':')
            .unwrap_or_else(|| panic!("values.yaml {name}: {line:?} is not `key: value`"));
        out.insert(key.to_owned(), value.trim().to_owned());
    }
    out
}

/// A YAML scalar as a raw value: a whole number, or text (quotes removed).
fn yaml_raw(value: &str) -> Raw<'_> {
    match value.parse::<i64>() {
        Ok(n) => Raw::Int(n),
        Err(_) => Raw::Text(value.trim_matches('"')),
    }
}

fn lit_raw(l: Lit) -> Raw<'static> {
    l.raw()
}

/// `maxBodyBytes` -> `MAX_BODY_BYTES`, as sprig's `snakecase | upper` in configmap.yaml.
fn screaming(camel: &str) -> String {
    let mut out = String::new();
    for c in camel.chars() {
        if c.is_ascii_uppercase() && !out.is_empty() {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Every `NM_*` and `OTEL_*` name in the chart's templates.
fn template_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut dirs = vec![chart().join("templates")];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            // NOTES.txt tells a reader what to export; it sets nothing.
            if path.extension().is_some_and(|e| e == "yaml" || e == "tpl") {
                let text = read(&path);
                for start in ["NM_", "OTEL_"] {
                    for (i, _) in text.match_indices(start) {
                        let before = text[..i].chars().next_back();
                        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                            continue;
                        }
                        let name: String = text[i..]
                            .chars()
                            .take_while(|c| {
                                c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_'
                            })
                            .collect();
                        // `NM_*`, `OTEL_*`, a bare `NM_` before a template expression: prose or
                        // a derived name, not one variable.
                        if !text[i + name.len()..].starts_with('*') && name != start {
                            names.insert(name);
                        }
                    }
                }
            }
        }
    }
    names
}

fn schema_section(name: &str) -> serde_json::Value {
    let path = chart().join("values.schema.json");
    let schema: serde_json::Value =
        serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    schema["properties"][name].clone()
}

/// Every bound and enum value the schema admits for `prop` is accepted by the row.
fn schema_admits_only_what_the_row_accepts(m: &Meta, prop: &serde_json::Value, what: &str) {
    if let Some(min) = prop["minimum"].as_i64()
        && let Err(e) = (m.check)(Raw::Int(min))
    {
        panic!(
            "{what}: the schema's minimum {min} is refused by {}: {e}",
            m.env
        );
    }
    if let Some(max) = prop["maximum"].as_i64()
        && let Err(e) = (m.check)(Raw::Int(max))
    {
        panic!(
            "{what}: the schema's maximum {max} is refused by {}: {e}",
            m.env
        );
    }
    for v in prop["enum"].as_array().into_iter().flatten() {
        let raw = match v {
            serde_json::Value::String(s) => Raw::Text(s),
            other => Raw::Int(other.as_i64().unwrap_or(-1)),
        };
        if let Err(e) = (m.check)(raw) {
            panic!(
                "{what}: the schema admits {v}, which {} refuses: {e}",
                m.env
            );
        }
    }
}

#[test]
fn settings_chart_config_values_are_declared_rows_with_their_defaults() {
    let values = read(&chart().join("values.yaml"));
    let config = section(&values, "config");
    let schema = schema_section("config");
    let props = schema["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("values.schema.json: no config.properties"));
    assert_eq!(schema["additionalProperties"], false);
    let required: BTreeSet<&str> = schema["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .collect();

    let rows: BTreeMap<&str, &Meta> = super::all()
        .filter_map(|m| match m.chart {
            Chart::Value(k) | Chart::ValueOwnDefault(k, _) => Some((k, m)),
            _ => None,
        })
        .collect();
    let config_keys: BTreeSet<&str> = config.keys().map(String::as_str).collect();
    let row_keys: BTreeSet<&str> = rows.keys().copied().collect();
    assert_eq!(
        config_keys, row_keys,
        "values.yaml `config:` and the rows with Chart::Value disagree"
    );
    let schema_keys: BTreeSet<&str> = props.keys().map(String::as_str).collect();
    assert_eq!(
        schema_keys, row_keys,
        "values.schema.json `config` and the rows disagree"
    );

    for (key, m) in rows {
        let what = format!("config.{key}");
        assert_eq!(
            format!("NM_{}", screaming(key)),
            m.env,
            "{what}: configmap.yaml names it NM_<KEY IN SNAKE CASE>"
        );
        let value = &config[key];
        let raw = yaml_raw(value);
        if let Err(e) = (m.check)(raw) {
            panic!(
                "{what}: its chart default {value} is refused by {}: {e}",
                m.env
            );
        }
        if let Chart::Value(_) = m.chart {
            let Default::Is(default) = m.default else {
                panic!("{what}: {} has no single default to hold", m.env);
            };
            assert_eq!(
                raw,
                lit_raw(default),
                "{what}: the chart's default is not the product's"
            );
        }
        let want_type = match m.file.map(|(_, kind)| kind) {
            Some(Kind::Int) => "integer",
            _ => "string",
        };
        assert_eq!(props[key]["type"], want_type, "{what}: schema type");
        assert!(required.contains(key), "{what}: not required by the schema");
        schema_admits_only_what_the_row_accepts(m, &props[key], &what);
    }
}

#[test]
fn settings_chart_sets_only_declared_variables_and_all_it_should() {
    let names = template_names();
    // configmap.yaml makes `NM_<KEY>` of every `config.*` value.
    let from_config: BTreeSet<String> = super::all()
        .filter(|m| matches!(m.chart, Chart::Value(_) | Chart::ValueOwnDefault(..)))
        .map(|m| m.env.to_owned())
        .collect();
    for name in &names {
        let row = super::all().find(|m| match m.prefix() {
            Some(prefix) => name == prefix,
            None => name == m.env,
        });
        match row {
            None => panic!("the chart sets {name}, which no setting declares"),
            Some(m) if m.chart == Chart::No => {
                panic!("the chart sets {name}, whose row says Chart::No")
            }
            Some(_) => {}
        }
    }
    for m in super::all() {
        let named = names.contains(m.prefix().unwrap_or(m.env));
        match m.chart {
            Chart::Template | Chart::Otel => {
                assert!(
                    named,
                    "{}: its row says the chart sets it, no template does",
                    m.env
                )
            }
            Chart::Value(_) | Chart::ValueOwnDefault(..) => {
                assert!(from_config.contains(m.env));
            }
            Chart::No => {}
        }
    }
}

#[test]
fn settings_chart_otel_values_are_the_declared_defaults() {
    let values = read(&chart().join("values.yaml"));
    let otel = section(&values, "otel");
    let schema = schema_section("otel");
    let row = |env: &str| {
        super::all()
            .find(|m| m.env == env)
            .unwrap_or_else(|| panic!("{env} is not declared"))
    };
    for (key, env) in [
        ("protocol", "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ("sampler", "OTEL_TRACES_SAMPLER"),
    ] {
        let m = row(env);
        let Default::Is(default) = m.default else {
            panic!("{env} has no default");
        };
        assert_eq!(
            yaml_raw(&otel[key]),
            lit_raw(default),
            "otel.{key}: the chart's default is not {env}'s"
        );
        schema_admits_only_what_the_row_accepts(
            m,
            &schema["properties"][key],
            &format!("otel.{key}"),
        );
    }
}

#[test]
fn settings_doc_config_file_example_is_accepted() {
    let doc = read(&repo().join("docs/settings.md"));
    let start = doc
        .find("```toml\n")
        .unwrap_or_else(|| panic!("docs/settings.md: no TOML example"));
    let body = &doc[start + 8..];
    let example = &body[..body.find("```").unwrap_or(body.len())];
    let file: super::FileSettings =
        toml::from_str(example).unwrap_or_else(|e| panic!("docs/settings.md example: {e}"));
    let settings = super::resolve(
        Mode::Serve,
        &super::Flags::default(),
        &std::collections::HashMap::new(),
        file,
    )
    .unwrap_or_else(|e| panic!("docs/settings.md example: {e}"));
    assert_eq!(settings.max_body_bytes, 1_048_576);
    assert!(settings.registry.get("acme").is_some());
}
