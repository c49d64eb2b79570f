//! Every relative link in the project's Markdown resolves: README.md, ARCHITECTURE.md,
//! `docs/**/*.md`, `bench/*.md`, the client libraries' and the chart's READMEs. A link's file
//! (or directory) must exist, and a `#fragment` on a Markdown target must name one of its
//! headings, slugged the way GitHub does (lowercase; letters, digits, `-` and `_` kept; a space
//! becomes `-`; everything else dropped; a repeated heading gets `-1`, `-2`, ...).
//!
//! Links to `http(s):` and `mailto:` are not followed, and nothing inside fenced code blocks or
//! inline code counts as a link or a heading. A fragment on a non-Markdown target (a source
//! file's `#L10`) is not checked. No process is started: this reads files only.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One link found in a Markdown file: its line (1-based) and target as written.
#[derive(Debug, PartialEq, Eq)]
struct Link {
    line: usize,
    target: String,
}

/// The root of the repository (the root package's manifest directory).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files whose links are checked, relative to `root`, sorted.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = BTreeSet::new();
    for top in ["README.md", "ARCHITECTURE.md"] {
        let p = root.join(top);
        if p.is_file() {
            files.insert(p);
        }
    }
    walk(&root.join("docs"), &mut |p| {
        if p.extension().is_some_and(|e| e == "md") {
            files.insert(p.to_path_buf());
        }
    });
    if let Ok(entries) = std::fs::read_dir(root.join("bench")) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_file() && p.extension().is_some_and(|e| e == "md") {
                files.insert(p);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(root.join("clients")) {
        for e in entries.flatten() {
            let p = e.path().join("README.md");
            if p.is_file() {
                files.insert(p);
            }
        }
    }
    walk(&root.join("helm"), &mut |p| {
        if p.file_name().is_some_and(|n| n == "README.md") {
            files.insert(p.to_path_buf());
        }
    });
    files.into_iter().collect()
}

/// Calls `f` on every file under `dir` (none when it does not exist), skipping dependency
/// and build directories.
fn walk(dir: &Path, f: &mut dyn FnMut(&Path)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            let skip = p
                .file_name()
                .is_some_and(|n| n == "node_modules" || n == "target" || n == ".git");
            if !skip {
                walk(&p, f);
            }
        } else {
            f(&p);
        }
    }
}

/// The lines of `text` outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    // The open fence: its character and length.
    let mut fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let t = line.trim_start_matches(' ');
        let run = |c: char| t.chars().take_while(|&x| x == c).count();
        match fence {
            Some((c, n)) => {
                if indent <= 3 && run(c) >= n && t.trim_start_matches(c).trim().is_empty() {
                    fence = None;
                }
            }
            None => {
                let opens = ['`', '~'].into_iter().find(|&c| indent <= 3 && run(c) >= 3);
                match opens {
                    Some(c) => fence = Some((c, run(c))),
                    None => out.push((i + 1, line)),
                }
            }
        }
    }
    out
}

/// `line` without its inline code spans (a run of n backticks up to the next run of exactly
/// n; an unmatched run stays as text).
fn strip_inline_code(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = chars[i..].iter().take_while(|&&c| c == '`').count();
        // Look for a closing run of exactly n backticks.
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let m = chars[j..].iter().take_while(|&&c| c == '`').count();
                if m == n {
                    close = Some(j + m);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => i = end,
            None => {
                out.extend(std::iter::repeat_n('`', n));
                i += n;
            }
        }
    }
    out
}

/// The links of a Markdown text: inline `[text](target)` (images too) and reference
/// definitions `[label]: target`, outside code.
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    for (line_no, raw) in prose_lines(text) {
        let line = strip_inline_code(raw);
        // A reference definition.
        let t = line.trim_start();
        if line.len() - t.len() <= 3
            && t.starts_with('[')
            && let Some(close) = t.find("]:")
            && !t[1..close].contains(']')
        {
            if let Some(target) = t[close + 2..].split_whitespace().next() {
                out.push(Link {
                    line: line_no,
                    target: target.trim_matches(|c| c == '<' || c == '>').to_owned(),
                });
            }
            continue;
        }
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let (target, consumed) = if let Some(inner) = after.strip_prefix('<') {
                match inner.find('>') {
                    Some(end) => (inner[..end].to_owned(), end + 2),
                    None => (String::new(), 0),
                }
            } else {
                // Up to the closing parenthesis (balanced) or a title after whitespace.
                let mut depth = 0usize;
                let mut end = after.len();
                for (k, c) in after.char_indices() {
                    match c {
                        '(' => depth += 1,
                        ')' if depth == 0 => {
                            end = k;
                            break;
                        }
                        ')' => depth -= 1,
                        c if c.is_whitespace() => {
                            end = k;
                            break;
                        }
                        _ => {}
                    }
                }
                (after[..end].to_owned(), end)
            };
            if !target.is_empty() {
                out.push(Link {
                    line: line_no,
                    target,
                });
            }
            rest = &after[consumed..];
        }
    }
    out
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    // A link in a heading contributes its text only.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](") else {
            break;
        };
        let Some(close) = rest[open + mid..].find(')') else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..open + mid]);
        rest = &rest[open + mid + close + 1..];
    }
    text.push_str(rest);
    text.trim()
        .chars()
        .flat_map(char::to_lowercase)
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text's ATX headings, outside code, numbered like GitHub's when
/// repeated.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let t = line.trim_start_matches(' ');
        if line.len() - t.len() > 3 {
            continue;
        }
        let level = t.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&level) {
            continue;
        }
        let body = &t[level..];
        if !(body.is_empty() || body.starts_with(' ') || body.starts_with('\t')) {
            continue;
        }
        // An optional closing sequence of #s.
        let body = body.trim();
        let body = match body.trim_end_matches('#') {
            b if b.is_empty() || b.ends_with(' ') => b.trim_end(),
            _ => body,
        };
        let base = slug(body);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// What is wrong with one link of `file` (whose text is `text`), if anything.
fn check_link(file: &Path, text: &str, target: &str) -> Option<String> {
    let lower = target.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") || lower.starts_with("mailto:")
    {
        return None;
    }
    if target.contains("://") {
        return Some(format!("{target}: not a relative link"));
    }
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let path = path.split('?').next().unwrap_or(path);
    let resolved = if path.is_empty() {
        file.to_path_buf()
    } else if path.starts_with('/') {
        return Some(format!("{target}: absolute path (use a relative one)"));
    } else {
        file.parent().unwrap_or(Path::new(".")).join(path)
    };
    if !resolved.exists() {
        return Some(format!("{target}: {} does not exist", resolved.display()));
    }
    let fragment = fragment?;
    if resolved.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let target_text;
    let text = if path.is_empty() {
        text
    } else {
        target_text = match std::fs::read_to_string(&resolved) {
            Ok(t) => t,
            Err(e) => return Some(format!("{target}: {e}")),
        };
        &target_text
    };
    if anchors(text).contains(fragment) {
        None
    } else {
        Some(format!(
            "{target}: no heading #{fragment} in {}",
            resolved.display()
        ))
    }
}

/// The broken links of every checked file, as `file:line: problem`.
fn broken_links(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for file in markdown_files(root) {
        let text = match std::fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) => {
                problems.push(format!("{}: {e}", file.display()));
                continue;
            }
        };
        let shown = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for link in links(&text) {
            if let Some(p) = check_link(&file, &text, &link.target) {
                problems.push(format!("{shown}:{}: {p}", link.line));
            }
        }
    }
    problems
}

#[test]
fn every_relative_markdown_link_resolves() {
    let root = root();
    let files = markdown_files(&root);
    assert!(
        files.iter().any(|f| f.ends_with("README.md")) && files.len() >= 3,
        "found too few Markdown files under {}: {files:?}",
        root.display()
    );
    let problems = broken_links(&root);
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_front_door_stays_short() {
    for (file, max) in [("README.md", 200), ("ARCHITECTURE.md", 300)] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        let n = text.lines().count();
        assert!(n <= max, "{file} has {n} lines, at most {max}");
    }
}

// === the checker's own parts ===

#[test]
fn docs_slugs_follow_github() {
    assert_eq!(
        slug("Securing a split deployment"),
        "securing-a-split-deployment"
    );
    assert_eq!(slug("Limits and failures"), "limits-and-failures");
    assert_eq!(
        slug("`nm-bench --tracing`: what it costs!"),
        "nm-bench---tracing-what-it-costs"
    );
    assert_eq!(
        slug("Session 11 (2026-11-25): an Intel machine"),
        "session-11-2026-11-25-an-intel-machine"
    );
    assert_eq!(slug("Tracing (OpenTelemetry)"), "tracing-opentelemetry");
    assert_eq!(
        slug("keep_under_scores and — dashes"),
        "keep_under_scores-and--dashes"
    );
    assert_eq!(
        slug("See [the chart](helm/README.md) now"),
        "see-the-chart-now"
    );
    assert_eq!(slug("Übersicht"), "übersicht");
}

#[test]
fn docs_anchors_number_repeated_headings_and_skip_code() {
    let text = "# Top\n\n## Usage\n\n```sh\n# not a heading\n```\n\n## Usage\n\n####### seven\n#nospace\n    # indented code\n## Closed ##\n";
    let a: Vec<String> = anchors(text).into_iter().collect();
    assert_eq!(a, ["closed", "top", "usage", "usage-1"]);
}

#[test]
fn docs_links_are_found_outside_code_only() {
    let text = "See [a](a.md) and ![img](img/x.png \"title\") and `[no](code.md)`.\n\
                ```\n[no](fenced.md)\n```\n\
                ~~~~\n```\n[no](tilde.md)\n~~~~\n\
                [ref]: docs/ref.md#part\n\
                Nested [x](f(1).md) and <[y](<with space.md>)>, then [z](#here).\n";
    let found: Vec<(usize, String)> = links(text)
        .into_iter()
        .map(|l| (l.line, l.target))
        .collect();
    let want: Vec<(usize, String)> = [
        (1, "a.md"),
        (1, "img/x.png"),
        (9, "docs/ref.md#part"),
        (10, "f(1).md"),
        (10, "with space.md"),
        (10, "#here"),
    ]
    .into_iter()
    .map(|(n, t)| (n, t.to_owned()))
    .collect();
    assert_eq!(found, want);
}

#[test]
fn docs_checker_reports_missing_files_and_headings() {
    let dir = tempfile::tempdir().unwrap();
    let docs = dir.path().join("docs");
    std::fs::create_dir(&docs).unwrap();
    std::fs::write(docs.join("a.md"), "# A\n\n## Two words\n").unwrap();
    let readme = dir.path().join("README.md");
    let text = "[ok](docs/a.md#two-words) [dir](docs) [self](#top)\n\
                [gone](docs/b.md) [bad](docs/a.md#three) [web](https://example.com/x#y)\n\
                [mail](mailto:a@b.c) [src](docs/a.md) `[code](nowhere.md)`\n# Top\n";
    std::fs::write(&readme, text).unwrap();
    let problems = broken_links(dir.path());
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(
        problems[0].starts_with("README.md:2: docs/b.md:"),
        "{problems:#?}"
    );
    assert!(
        problems[1].starts_with("README.md:2: docs/a.md#three: no heading #three"),
        "{problems:#?}"
    );
}
