//! The signal actions: the generated [`Action`] keeps the contract, and the proto files agree
//! with `types/signal-actions.json` (the clients are checked by their own test suites).

use std::collections::BTreeSet;
use std::path::Path;

use super::*;

fn names() -> Vec<&'static str> {
    Action::ALL.iter().map(|a| a.as_str()).collect()
}

/// Fails, naming both differences, unless `found` (what `what` declares) is exactly the
/// declared set.
fn same_set(what: &str, declared: &[&str], found: &[String]) {
    let declared: BTreeSet<&str> = declared.iter().copied().collect();
    let found: BTreeSet<&str> = found.iter().map(String::as_str).collect();
    let missing: Vec<_> = declared.difference(&found).collect();
    let extra: Vec<_> = found.difference(&declared).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what} disagrees with types/signal-actions.json: missing {missing:?}, not declared {extra:?}"
    );
}

/// The body of `message NAME { .. }` in any .proto file under proto/, with its file name.
fn proto_message(name: &str) -> (String, String) {
    let mut found = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto")];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "proto") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let head = format!("message {name} {{");
                if let Some(start) = text.find(&head) {
                    let body = &text[start + head.len()..];
                    let end = body.find("\n}").unwrap_or(body.len());
                    found.push((path.display().to_string(), body[..end].to_owned()));
                }
            }
        }
    }
    assert_eq!(found.len(), 1, "message {name} in proto/: {found:?}");
    found.remove(0)
}

#[test]
fn action_names_round_trip_and_are_snake_case() {
    for a in Action::ALL {
        assert_eq!(a.as_str().parse::<Action>(), Ok(a));
        assert_eq!(a.to_string(), a.as_str());
    }
    assert_eq!(Action::NAMES, names().join(", "));
    assert_eq!(
        ParseError::Action.to_string(),
        format!("action must be one of {}", names().join(", "))
    );
    assert!("thumbsup".parse::<Action>().is_err());
    assert!("Accepted".parse::<Action>().is_err());
}

#[test]
fn action_serde_names_are_the_wire_names() {
    for a in Action::ALL {
        let json = serde_json::to_string(&a).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(json, format!("\"{}\"", a.as_str()));
        assert_eq!(serde_json::from_str::<Action>(&json).ok(), Some(a));
    }
}

#[test]
fn action_edited_alone_requires_an_edit_distance() {
    // The contract: `edit_distance` is required when the action is `edited`.
    let required: Vec<Action> = Action::ALL
        .into_iter()
        .filter(|a| a.requires_edit_distance())
        .collect();
    assert_eq!(required, [Action::Edited]);
}

#[test]
fn action_counts_in_the_proto_follow_the_declaration() {
    // message ActionCounts { uint64 accepted = 1; ... }: one field per action, numbered in the
    // declared order.
    let (file, body) = proto_message("ActionCounts");
    let mut fields = Vec::new();
    for line in body.lines().map(str::trim) {
        if let Some(decl) = line.strip_prefix("uint64 ") {
            let (name, number) = decl
                .trim_end_matches(';')
                .split_once(" = ")
                .unwrap_or_else(|| panic!("{file}: cannot read {line:?}"));
            fields.push((name.to_owned(), number.to_owned()));
        } else if !line.is_empty() && !line.starts_with("//") {
            panic!("{file}: ActionCounts holds more than uint64 counts: {line:?}");
        }
    }
    let found: Vec<String> = fields.iter().map(|(n, _)| n.clone()).collect();
    same_set(&format!("{file}: ActionCounts"), &names(), &found);
    let expected: Vec<(String, String)> = names()
        .iter()
        .enumerate()
        .map(|(i, n)| ((*n).to_owned(), (i + 1).to_string()))
        .collect();
    assert_eq!(
        fields, expected,
        "{file}: ActionCounts out of the declared order"
    );
}

#[test]
fn action_comments_of_the_link_signal_follow_the_declaration() {
    // In message Signal: the comment above `action` lists every action; the one above
    // `edit_distance` names (in backticks) the actions that require it.
    let (file, body) = proto_message("Signal");
    let comment_above = |field: &str| {
        let lines: Vec<&str> = body.lines().map(str::trim).collect();
        let at = lines
            .iter()
            .position(|l| l.contains(&format!(" {field} = ")))
            .unwrap_or_else(|| panic!("{file}: Signal has no field {field}"));
        lines[..at]
            .iter()
            .rev()
            .take_while(|l| l.starts_with("//"))
            .map(|l| l.trim_start_matches('/'))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let listed: Vec<String> = comment_above("action")
        .split(|c: char| !(c.is_ascii_lowercase() || c == '_'))
        .filter(|w| !w.is_empty() && *w != "or" && *w != "and")
        .map(str::to_owned)
        .collect();
    same_set(
        &format!("{file}: Signal.action's comment"),
        &names(),
        &listed,
    );

    let requiring: Vec<String> = comment_above("edit_distance")
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    let declared: Vec<&str> = Action::ALL
        .into_iter()
        .filter(|a| a.requires_edit_distance())
        .map(Action::as_str)
        .collect();
    same_set(
        &format!("{file}: Signal.edit_distance's comment (actions in backticks)"),
        &declared,
        &requiring,
    );
}

#[test]
fn action_set_comparison_fails_both_ways() {
    // The checks above must fail for an action added to or removed from a copy.
    let declared = ["a", "b"];
    let own = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    same_set("copy", &declared, &own(&["b", "a"]));
    for copy in [&["a"][..], &["a", "b", "c"][..], &[][..]] {
        let copy = own(copy);
        let failed = std::panic::catch_unwind(|| same_set("copy", &declared, &copy)).is_err();
        assert!(failed, "{copy:?}");
    }
}
