//! No import circles in product code.
//!
//! Reads the Rust sources of the product crates (every workspace member but `bench`, and the
//! root package), builds the graph of their file modules and fails listing every circle.
//!
//! - A node is a module that has a file of its own (`lib.rs`, `foo.rs`, `foo/mod.rs`). Inline
//!   modules (`mod pb { .. }`) belong to their file's node.
//! - An edge A → B when A's code names B: a `crate::..`, `super::..` or `self::..` path, a `use`
//!   (also `use child::..`, and a name bound by an earlier `use` or glob import), resolved to the
//!   deepest module that has a file. References between a module and its own ancestors or
//!   descendants are declarations, not imports, and make no edge.
//! - Test code is not product code: `*_tests.rs` files, and items (modules, functions, `use`s)
//!   under a `#[cfg(..)]` that needs `test` (`cfg(test)`, `cfg(all(test, ..))`, and
//!   `cfg(any(test, feature = "test-support"))`, the test helpers other crates' tests enable).
//! - Edges between crates are not followed: cargo already refuses a cycle of crates.
//!
//! A circle is reported as a strongly connected component ("crate: a, b::c, d"), with every
//! edge inside it (file, line and the path that made it) and its elementary cycles.
//!
//! The reader is a small lexer, not a Rust parser: it knows comments, string and character
//! literals, lifetimes and attributes, which is all it needs to find paths. Macro bodies are
//! read as plain tokens, so a path inside a macro call counts like any other.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// Workspace members that are not product code.
const NOT_PRODUCT: &[&str] = &["bench"];

#[test]
fn product_code_has_no_import_circles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let crates = product_crates(root);
    assert!(
        crates.len() >= 4,
        "expected the root package and types, dataplane, controlplane: {crates:?}"
    );
    let disk = Disk(root);
    let graph = Graph::build(&crates, &disk).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        graph.modules.len() > 50,
        "the reader found only {} modules: {:?}",
        graph.modules.len(),
        graph.modules
    );
    let circles = graph.circles();
    if let Err(e) = judge(&circles) {
        panic!("{e}");
    }
}

/// The product crates' roots: (crate name, root file relative to the workspace root).
fn product_crates(root: &Path) -> Vec<CrateRoot> {
    let read = |p: &Path| {
        let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        text.parse::<toml::Table>()
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let manifest = read(&root.join("Cargo.toml"));
    let members = manifest
        .get("workspace")
        .and_then(|w| w.get("members"))
        .and_then(|m| m.as_array())
        .unwrap_or_else(|| panic!("Cargo.toml: no [workspace] members"));
    let mut dirs = vec![String::new()];
    for m in members {
        let m = m.as_str().unwrap_or_else(|| panic!("member {m:?}"));
        if !NOT_PRODUCT.contains(&m) {
            dirs.push(format!("{m}/"));
        }
    }
    let mut crates = Vec::new();
    for dir in dirs {
        let name = read(&root.join(format!("{dir}Cargo.toml")))
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .unwrap_or_else(|| panic!("{dir}Cargo.toml: no package name"))
            .replace('-', "_");
        for (file, label) in [
            ("lib.rs", name.clone()),
            ("main.rs", format!("{name} (bin)")),
        ] {
            let file = format!("{dir}src/{file}");
            if root.join(&file).is_file() {
                crates.push(CrateRoot { name: label, file });
            }
        }
    }
    crates
}

/// Fails listing every circle.
fn judge(circles: &[Circle]) -> Result<(), String> {
    let mut msg = String::new();
    for c in circles {
        let _ = writeln!(msg, "import circle {}\n{}", c.name, c.detail);
    }
    if msg.is_empty() { Ok(()) } else { Err(msg) }
}

// === sources ===

#[derive(Debug, Clone)]
struct CrateRoot {
    name: String,
    /// Relative to the workspace root, `/`-separated.
    file: String,
}

trait Sources {
    fn read(&self, path: &str) -> Option<String>;
}

struct Disk<'a>(&'a Path);

impl Sources for Disk<'_> {
    fn read(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(self.0.join(path)).ok()
    }
}

impl Sources for BTreeMap<&str, &str> {
    fn read(&self, path: &str) -> Option<String> {
        self.get(path).map(|s| (*s).to_owned())
    }
}

// === lexer ===

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Str(String),
    /// `::`
    PathSep,
    Punct(char),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

fn lex(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let count_lines =
        |from: usize, to: usize, c: &[char]| c[from..to].iter().filter(|&&x| x == '\n').count();
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let start = i;
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += count_lines(start, i, &c);
        } else if let Some((end, text)) = string_at(&c, i) {
            out.push(Token {
                tok: Tok::Str(text),
                line,
            });
            line += count_lines(i, end, &c);
            i = end;
        } else if ch == '\'' {
            // A character literal ('a', '\n', '\u{1F600}') or a lifetime ('a, 'static).
            if next == Some('\\') {
                // Past the quote, the backslash and the escaped character ('\'' included).
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let mut word: String = c[start..i].iter().collect();
            // A raw identifier: r#type.
            if word == "r"
                && c.get(i) == Some(&'#')
                && c.get(i + 1).is_some_and(|x| x.is_alphabetic() || *x == '_')
            {
                let s = i + 1;
                i = s;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                word = c[s..i].iter().collect();
            }
            out.push(Token {
                tok: Tok::Ident(word),
                line,
            });
        } else if ch == ':' && next == Some(':') {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
    }
    out
}

/// A string literal starting at `i` ("..", r"..", r#".."#, b"..", br"..", c"..", b'x'): its end
/// and contents.
fn string_at(c: &[char], i: usize) -> Option<(usize, String)> {
    let mut j = i;
    // An identifier character before the prefix means this is the end of a word, not a prefix.
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    if matches!(c.get(j), Some('b' | 'c')) {
        j += 1;
    }
    if c.get(j) == Some(&'\'') && j > i {
        // A byte literal b'x' or b'\n'.
        let mut k = j + 1;
        if c.get(k) == Some(&'\\') {
            k += 1;
        }
        k += 1;
        while k < c.len() && c[k] != '\'' {
            k += 1;
        }
        return Some((k + 1, String::new()));
    }
    if c.get(j) == Some(&'r') && matches!(c.get(j + 1), Some('"' | '#')) {
        j += 1;
        let mut hashes = 0;
        while c.get(j) == Some(&'#') {
            hashes += 1;
            j += 1;
        }
        if c.get(j) != Some(&'"') {
            return None;
        }
        let start = j + 1;
        let mut k = start;
        while k < c.len() {
            if c[k] == '"' && (0..hashes).all(|h| c.get(k + 1 + h) == Some(&'#')) {
                return Some((k + 1 + hashes, c[start..k].iter().collect()));
            }
            k += 1;
        }
        return Some((c.len(), String::new()));
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    let start = j + 1;
    let mut k = start;
    while k < c.len() && c[k] != '"' {
        if c[k] == '\\' {
            k += 1;
        }
        k += 1;
    }
    Some((
        (k + 1).min(c.len()),
        c[start..k.min(c.len())].iter().collect(),
    ))
}

fn is_ident(t: Option<&Token>, word: &str) -> bool {
    matches!(t, Some(Token { tok: Tok::Ident(w), .. }) if w == word)
}

fn is_punct(t: Option<&Token>, p: char) -> bool {
    matches!(t, Some(Token { tok: Tok::Punct(x), .. }) if *x == p)
}

fn ident_of(t: Option<&Token>) -> Option<&str> {
    match t {
        Some(Token {
            tok: Tok::Ident(w), ..
        }) => Some(w),
        _ => None,
    }
}

/// The index just past the bracket group opening at `open` (`(`, `[` or `{`).
fn group_end(toks: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    toks.len()
}

/// Whether a `cfg` predicate holds only in tests: it names `test` and negates nothing.
fn test_only(pred: &[Token]) -> bool {
    let words: Vec<&str> = pred.iter().filter_map(|t| ident_of(Some(t))).collect();
    words.contains(&"test") && !words.contains(&"not")
}

/// The tokens without test-only items (see the module doc). `None` when the whole file is
/// test-only (`#![cfg(test)]`).
fn strip_test_code(toks: Vec<Token>) -> Option<Vec<Token>> {
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        let inner = is_punct(toks.get(i + 1), '!');
        let bracket = if inner { i + 2 } else { i + 1 };
        if is_punct(toks.get(i), '#')
            && is_punct(toks.get(bracket), '[')
            && is_ident(toks.get(bracket + 1), "cfg")
        {
            let end = group_end(&toks, bracket);
            if test_only(&toks[bracket + 2..end]) {
                if inner {
                    return None;
                }
                i = item_end(&toks, end);
                continue;
            }
        }
        out.push(toks[i].clone());
        i += 1;
    }
    Some(out)
}

/// The end of the item starting at `i` (after its first attribute): further attributes, then up
/// to a `;` or the end of a `{..}` block outside any bracket; never past the closing bracket of
/// the enclosing group.
fn item_end(toks: &[Token], mut i: usize) -> usize {
    while is_punct(toks.get(i), '#') && is_punct(toks.get(i + 1), '[') {
        i = group_end(toks, i + 1);
    }
    let mut depth = 0usize;
    while i < toks.len() {
        match toks[i].tok {
            Tok::Punct(';') if depth == 0 => return i + 1,
            Tok::Punct('(' | '[') => depth += 1,
            Tok::Punct('{') if depth == 0 => return group_end(toks, i),
            Tok::Punct('{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                if depth == 0 {
                    return i;
                }
                depth -= 1;
            }
            _ => {}
        }
        i += 1;
    }
    i
}

// === modules ===

type ModPath = Vec<String>;

#[derive(Debug, Clone)]
struct Module {
    krate: String,
    path: ModPath,
    file: String,
}

impl Module {
    fn name(&self) -> String {
        if self.path.is_empty() {
            "crate".to_owned()
        } else {
            self.path.join("::")
        }
    }
}

#[derive(Debug, Clone)]
struct Edge {
    from: usize,
    to: usize,
    line: usize,
    text: String,
}

#[derive(Debug, Default)]
struct Graph {
    modules: Vec<Module>,
    /// (crate, module path) -> index into `modules`.
    index: BTreeMap<(String, ModPath), usize>,
    /// Child modules (file or inline) of each (crate, module path).
    children: BTreeMap<(String, ModPath), BTreeSet<String>>,
    /// The test-free tokens of each module's file.
    tokens: Vec<Vec<Token>>,
    edges: Vec<Edge>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Circle {
    /// "crate: a, b::c": the modules of one strongly connected component, sorted.
    name: String,
    /// Its edges and elementary cycles, for the failure message.
    detail: String,
}

impl Graph {
    fn build(crates: &[CrateRoot], src: &dyn Sources) -> Result<Graph, String> {
        let mut g = Graph::default();
        for c in crates {
            g.discover(&c.name, Vec::new(), &c.file, true, src)?;
        }
        for m in 0..g.modules.len() {
            g.references(m);
        }
        Ok(g)
    }

    /// Adds the module in `file` and, recursively, the modules it declares.
    fn discover(
        &mut self,
        krate: &str,
        path: ModPath,
        file: &str,
        root: bool,
        src: &dyn Sources,
    ) -> Result<(), String> {
        let text = src.read(file).ok_or_else(|| {
            format!(
                "{file}: cannot read (declared as {krate}::{})",
                path.join("::")
            )
        })?;
        let toks = strip_test_code(lex(&text)).unwrap_or_default();
        let id = self.modules.len();
        self.modules.push(Module {
            krate: krate.to_owned(),
            path: path.clone(),
            file: file.to_owned(),
        });
        self.index.insert((krate.to_owned(), path.clone()), id);

        let (dir, stem) = match file.rsplit_once('/') {
            Some((d, f)) => (d.to_owned(), f.trim_end_matches(".rs").to_owned()),
            None => (String::new(), file.trim_end_matches(".rs").to_owned()),
        };
        let children_dir = if root || stem == "mod" {
            dir.clone()
        } else {
            format!("{dir}/{stem}")
        };
        let mut outline = Vec::new();
        let mut inline: Vec<(String, usize)> = Vec::new();
        let mut depth = 0usize;
        let mut path_attr: Option<String> = None;
        let mut i = 0;
        while i < toks.len() {
            match &toks[i].tok {
                Tok::Punct('#') if is_punct(toks.get(i + 1), '[') => {
                    let end = group_end(&toks, i + 1);
                    if is_ident(toks.get(i + 2), "path")
                        && is_punct(toks.get(i + 3), '=')
                        && let Some(Token {
                            tok: Tok::Str(p), ..
                        }) = toks.get(i + 4)
                    {
                        path_attr = Some(p.clone());
                    }
                    i = end;
                    continue;
                }
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth = depth.saturating_sub(1);
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                    path_attr = None;
                }
                Tok::Punct(';') => path_attr = None,
                Tok::Ident(w) if w == "mod" => {
                    if let Some(name) = ident_of(toks.get(i + 1)) {
                        let mut ctx = path.clone();
                        ctx.extend(inline.iter().map(|(n, _)| n.clone()));
                        self.children
                            .entry((krate.to_owned(), ctx.clone()))
                            .or_default()
                            .insert(name.to_owned());
                        if is_punct(toks.get(i + 2), ';') {
                            let mut sub = children_dir.clone();
                            for (n, _) in &inline {
                                sub = format!("{sub}/{n}");
                            }
                            let file = match path_attr.take() {
                                Some(p) if inline.is_empty() => format!("{dir}/{p}"),
                                Some(p) => format!("{sub}/{p}"),
                                None => {
                                    let flat = format!("{sub}/{name}.rs");
                                    if src.read(&flat).is_some() {
                                        flat
                                    } else {
                                        format!("{sub}/{name}/mod.rs")
                                    }
                                }
                            };
                            let mut child = ctx;
                            child.push(name.to_owned());
                            outline.push((child, file));
                        } else if is_punct(toks.get(i + 2), '{') {
                            inline.push((name.to_owned(), depth));
                            depth += 1;
                            i += 3;
                            continue;
                        }
                    }
                }
                _ => {}
            }
            i += 1;
        }
        self.tokens.push(toks);
        for (child, file) in outline {
            if !file.ends_with("_tests.rs") {
                self.discover(krate, child, &file, false, src)?;
            }
        }
        Ok(())
    }

    /// Adds the edges out of module `m`.
    fn references(&mut self, m: usize) {
        let toks = std::mem::take(&mut self.tokens[m]);
        let here = self.modules[m].path.clone();
        let krate = self.modules[m].krate.clone();
        // Names bound by `use` in this file, to the paths they stand for.
        let mut aliases: BTreeMap<String, ModPath> = BTreeMap::new();
        let mut inline: Vec<(String, usize)> = Vec::new();
        let mut depth = 0usize;
        let mut i = 0;
        while i < toks.len() {
            let mut ctx = here.clone();
            ctx.extend(inline.iter().map(|(n, _)| n.clone()));
            match &toks[i].tok {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth = depth.saturating_sub(1);
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                }
                Tok::Ident(w) if w == "mod" && is_punct(toks.get(i + 2), '{') => {
                    if let Some(name) = ident_of(toks.get(i + 1)) {
                        inline.push((name.to_owned(), depth));
                        depth += 1;
                        i += 3;
                        continue;
                    }
                }
                Tok::Ident(w) if w == "use" => {
                    let line = toks[i].line;
                    let mut leaves = Vec::new();
                    let end = use_tree(&toks, i + 1, Vec::new(), &mut leaves);
                    for leaf in leaves {
                        let text = leaf.segments.join("::");
                        let Some(full) = self.absolute(&krate, &ctx, &leaf.segments, &aliases)
                        else {
                            continue;
                        };
                        if leaf.glob {
                            for child in self
                                .children
                                .get(&(krate.clone(), full.clone()))
                                .into_iter()
                                .flatten()
                            {
                                let mut p = full.clone();
                                p.push(child.clone());
                                aliases.insert(child.clone(), p);
                            }
                        } else if let Some(name) = leaf.binding() {
                            aliases.insert(name, full.clone());
                        }
                        self.edge(m, &krate, &full, line, text);
                    }
                    i = end;
                    continue;
                }
                Tok::Ident(w) => {
                    let starts_path = matches!(
                        toks.get(i + 1),
                        Some(Token {
                            tok: Tok::PathSep,
                            ..
                        })
                    ) && !matches!(
                        toks.get(i.wrapping_sub(1)),
                        Some(Token {
                            tok: Tok::PathSep | Tok::Punct('.'),
                            ..
                        })
                    );
                    if starts_path {
                        let mut segments = vec![w.clone()];
                        let mut k = i + 1;
                        while matches!(
                            toks.get(k),
                            Some(Token {
                                tok: Tok::PathSep,
                                ..
                            })
                        ) {
                            match ident_of(toks.get(k + 1)) {
                                Some(s) => segments.push(s.to_owned()),
                                None => break,
                            }
                            k += 2;
                        }
                        if let Some(full) = self.absolute(&krate, &ctx, &segments, &aliases) {
                            self.edge(m, &krate, &full, toks[i].line, segments.join("::"));
                        }
                        i = k;
                        continue;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        self.tokens[m] = toks;
    }

    /// The absolute module path a path written in module `ctx` names, or `None` when it starts
    /// outside this crate (another crate, a local item, a generic).
    fn absolute(
        &self,
        krate: &str,
        ctx: &ModPath,
        segments: &[String],
        aliases: &BTreeMap<String, ModPath>,
    ) -> Option<ModPath> {
        let first = segments.first()?;
        let (mut base, mut rest) = match first.as_str() {
            "crate" => (Vec::new(), &segments[1..]),
            "self" => (ctx.clone(), &segments[1..]),
            "super" => (ctx.clone(), segments),
            name => {
                let child = self
                    .children
                    .get(&(krate.to_owned(), ctx.clone()))
                    .is_some_and(|c| c.contains(name));
                if child {
                    (ctx.clone(), segments)
                } else {
                    (aliases.get(name)?.clone(), &segments[1..])
                }
            }
        };
        while rest.first().is_some_and(|s| s == "super") {
            base.pop()?;
            rest = &rest[1..];
        }
        base.extend(rest.iter().filter(|s| *s != "self").cloned());
        Some(base)
    }

    /// Records an edge from `m` to the deepest file module on `full`, unless it is `m` itself,
    /// an ancestor or a descendant.
    fn edge(&mut self, m: usize, krate: &str, full: &ModPath, line: usize, text: String) {
        let Some(to) = (0..=full.len()).rev().find_map(|k| {
            self.index
                .get(&(krate.to_owned(), full[..k].to_vec()))
                .copied()
        }) else {
            return;
        };
        let (a, b) = (&self.modules[m].path, &self.modules[to].path);
        if a.starts_with(b) || b.starts_with(a) {
            return;
        }
        self.edges.push(Edge {
            from: m,
            to,
            line,
            text,
        });
    }

    /// Every strongly connected component of more than one module, sorted by name.
    fn circles(&self) -> Vec<Circle> {
        let n = self.modules.len();
        let mut out: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); n];
        for e in &self.edges {
            out[e.from].insert(e.to);
        }
        let mut circles: Vec<Circle> = tarjan(&out)
            .into_iter()
            .filter(|scc| scc.len() > 1)
            .map(|scc| self.describe(&scc, &out))
            .collect();
        circles.sort_by(|a, b| a.name.cmp(&b.name));
        circles
    }

    fn describe(&self, scc: &BTreeSet<usize>, out: &[BTreeSet<usize>]) -> Circle {
        let krate = &self.modules[*scc.iter().next().unwrap_or(&0)].krate;
        let mut names: Vec<String> = scc.iter().map(|&m| self.modules[m].name()).collect();
        names.sort();
        let name = format!("{krate}: {}", names.join(", "));
        let mut detail = String::from("  edges:\n");
        for e in self
            .edges
            .iter()
            .filter(|e| scc.contains(&e.from) && scc.contains(&e.to))
        {
            let (from, to) = (&self.modules[e.from], &self.modules[e.to]);
            let _ = writeln!(
                detail,
                "    {} -> {}  ({}:{}: {})",
                from.name(),
                to.name(),
                from.file,
                e.line,
                e.text
            );
        }
        detail.push_str("  cycles:\n");
        let cycles = elementary_cycles(scc, out, 100);
        for c in &cycles {
            let path: Vec<String> = c
                .iter()
                .chain(c.first())
                .map(|&m| self.modules[m].name())
                .collect();
            let _ = writeln!(detail, "    {}", path.join(" -> "));
        }
        if cycles.len() >= 100 {
            detail.push_str("    (and more)\n");
        }
        Circle { name, detail }
    }
}

#[derive(Debug)]
struct UseLeaf {
    segments: Vec<String>,
    alias: Option<String>,
    glob: bool,
}

impl UseLeaf {
    /// The name this `use` binds (`use a::b` binds `b`, `use a::{self}` binds `a`).
    fn binding(&self) -> Option<String> {
        if self.alias.as_deref() == Some("_") {
            return None;
        }
        if let Some(a) = &self.alias {
            return Some(a.clone());
        }
        let mut it = self.segments.iter().rev();
        match it.next()?.as_str() {
            "self" => it.next().cloned(),
            s => Some(s.to_owned()),
        }
    }
}

/// Reads a use tree from `i` (after `use`, or inside braces) with the path `prefix` above it;
/// returns the index after it (after the `;` at the top level).
fn use_tree(toks: &[Token], mut i: usize, prefix: Vec<String>, leaves: &mut Vec<UseLeaf>) -> usize {
    let mut segments = prefix;
    if matches!(
        toks.get(i),
        Some(Token {
            tok: Tok::PathSep,
            ..
        })
    ) {
        i += 1;
    }
    loop {
        match toks.get(i).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => {
                segments.push(s.clone());
                i += 1;
                if matches!(
                    toks.get(i),
                    Some(Token {
                        tok: Tok::PathSep,
                        ..
                    })
                ) {
                    i += 1;
                    continue;
                }
                let mut alias = None;
                if is_ident(toks.get(i), "as") {
                    alias = ident_of(toks.get(i + 1)).map(str::to_owned);
                    i += 2;
                }
                leaves.push(UseLeaf {
                    segments,
                    alias,
                    glob: false,
                });
                break;
            }
            Some(Tok::Punct('*')) => {
                leaves.push(UseLeaf {
                    segments,
                    alias: None,
                    glob: true,
                });
                i += 1;
                break;
            }
            Some(Tok::Punct('{')) => {
                i += 1;
                while !is_punct(toks.get(i), '}') && i < toks.len() {
                    i = use_tree(toks, i, segments.clone(), leaves);
                    if is_punct(toks.get(i), ',') {
                        i += 1;
                    }
                }
                i += 1;
                break;
            }
            _ => break,
        }
    }
    if is_punct(toks.get(i), ';') {
        i += 1;
    }
    i
}

fn tarjan(out: &[BTreeSet<usize>]) -> Vec<BTreeSet<usize>> {
    struct State<'a> {
        out: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        sccs: Vec<BTreeSet<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.out[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut scc = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                scc.insert(w);
                if w == v {
                    break;
                }
            }
            s.sccs.push(scc);
        }
    }
    let n = out.len();
    let mut s = State {
        out,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        sccs: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.sccs
}

/// The elementary cycles inside `scc` (at most `cap`), each starting at its smallest module.
fn elementary_cycles(
    scc: &BTreeSet<usize>,
    out: &[BTreeSet<usize>],
    cap: usize,
) -> Vec<Vec<usize>> {
    fn walk(
        start: usize,
        v: usize,
        scc: &BTreeSet<usize>,
        out: &[BTreeSet<usize>],
        path: &mut Vec<usize>,
        found: &mut Vec<Vec<usize>>,
        cap: usize,
    ) {
        for &w in &out[v] {
            if found.len() >= cap || !scc.contains(&w) || w < start {
                continue;
            }
            if w == start {
                found.push(path.clone());
            } else if !path.contains(&w) {
                path.push(w);
                walk(start, w, scc, out, path, found, cap);
                path.pop();
            }
        }
    }
    let mut found = Vec::new();
    for &s in scc {
        walk(s, s, scc, out, &mut vec![s], &mut found, cap);
    }
    found
}

// === tests of the checker itself ===

fn graph_of(files: &[(&'static str, &'static str)]) -> Graph {
    let src: BTreeMap<&str, &str> = files.iter().copied().collect();
    let crates = [CrateRoot {
        name: "demo".to_owned(),
        file: "src/lib.rs".to_owned(),
    }];
    Graph::build(&crates, &src).unwrap_or_else(|e| panic!("{e}"))
}

fn circle_names(files: &[(&'static str, &'static str)]) -> Vec<String> {
    graph_of(files)
        .circles()
        .into_iter()
        .map(|c| c.name)
        .collect()
}

#[test]
fn imports_two_siblings_naming_each_other_are_a_circle() {
    let files = [
        ("src/lib.rs", "mod a; pub mod b;"),
        ("src/a.rs", "use crate::b::Thing;"),
        ("src/b.rs", "pub struct Thing; fn f() { super::a::g() }"),
    ];
    assert_eq!(circle_names(&files), ["demo: a, b"]);
    let c = &graph_of(&files).circles()[0];
    assert!(
        c.detail.contains("a -> b  (src/a.rs:1: crate::b::Thing)"),
        "{}",
        c.detail
    );
    assert!(
        c.detail.contains("b -> a  (src/b.rs:1: super::a::g)"),
        "{}",
        c.detail
    );
}

#[test]
fn imports_a_one_way_chain_is_no_circle() {
    let files = [
        ("src/lib.rs", "mod a; mod b; mod c;"),
        ("src/a.rs", "use crate::b::X;"),
        ("src/b.rs", "use crate::c::Y;"),
        ("src/c.rs", "pub struct Y;"),
    ];
    assert_eq!(circle_names(&files), Vec::<String>::new());
    assert_eq!(graph_of(&files).edges.len(), 2);
}

#[test]
fn imports_parents_and_children_are_declarations_not_imports() {
    let files = [
        (
            "src/lib.rs",
            "mod a; use a::inner::X; fn f() { crate::a::g() }",
        ),
        (
            "src/a/mod.rs",
            "pub mod inner; use self::inner::X; use crate::run;",
        ),
        (
            "src/a/inner.rs",
            "use super::*; use crate::a::g; use super::super::run;",
        ),
    ];
    assert_eq!(circle_names(&files), Vec::<String>::new());
    assert!(graph_of(&files).edges.is_empty());
}

#[test]
fn imports_three_modules_in_a_ring_name_every_edge_and_the_cycle() {
    let files = [
        ("src/lib.rs", "mod x; mod y; mod z; mod w;"),
        ("src/x.rs", "use crate::y;"),
        ("src/y.rs", "fn f(t: crate::z::T) -> usize { t.len() }"),
        ("src/z.rs", "use super::{w, x::Thing as Other};"),
        ("src/w.rs", ""),
    ];
    let circles = graph_of(&files).circles();
    assert_eq!(circles.len(), 1);
    assert_eq!(circles[0].name, "demo: x, y, z");
    assert!(
        circles[0].detail.contains("x -> y -> z -> x"),
        "{}",
        circles[0].detail
    );
}

#[test]
fn imports_resolve_to_the_deepest_module_file() {
    // `crate::net::http::Client` lands on net/http.rs, not on net/mod.rs: the circle is between
    // http and client, and net takes no part.
    let files = [
        ("src/lib.rs", "mod net; mod client;"),
        ("src/net/mod.rs", "pub mod http; pub use http::Client;"),
        (
            "src/net/http.rs",
            "use crate::client::Pool; pub struct Client;",
        ),
        (
            "src/client.rs",
            "use crate::net::http::Client; pub struct Pool;",
        ),
    ];
    assert_eq!(circle_names(&files), ["demo: client, net::http"]);
}

#[test]
fn imports_through_a_name_bound_by_use() {
    // `use crate::store;` then `store::sql::run()` reaches store/sql.rs.
    let files = [
        ("src/lib.rs", "mod store; mod api;"),
        ("src/store/mod.rs", "pub mod sql;"),
        ("src/store/sql.rs", "fn f() { crate::api::serve(); }"),
        (
            "src/api.rs",
            "use crate::store; fn serve() { store::sql::run(); }",
        ),
    ];
    assert_eq!(circle_names(&files), ["demo: api, store::sql"]);
}

#[test]
fn imports_through_a_glob_that_brings_sibling_modules() {
    // In a/inner.rs, `use super::*` brings a's child `other` into scope.
    let files = [
        ("src/lib.rs", "mod a;"),
        ("src/a/mod.rs", "mod inner; mod other;"),
        ("src/a/inner.rs", "use super::*; fn f() { other::g() }"),
        ("src/a/other.rs", "use super::inner::h;"),
    ];
    assert_eq!(circle_names(&files), ["demo: a::inner, a::other"]);
}

#[test]
fn imports_test_code_is_not_product_code() {
    let files = [
        (
            "src/lib.rs",
            "mod a; mod b; #[cfg(test)] mod t; mod c_tests; #[cfg(any(test, feature = \"x\"))] pub mod helpers;",
        ),
        ("src/a.rs", "use crate::b::X;"),
        (
            "src/b.rs",
            "pub struct X;\n#[cfg(test)]\nmod tests { use crate::a::Y; }\n#[cfg(all(test, unix))] fn g() { crate::a::f() }\n#[cfg(test)] use crate::a::Z;\n#[cfg(not(test))] fn live() {}",
        ),
        // Neither is read: a declaration under cfg(test), and a *_tests.rs file.
        ("src/t.rs", "use crate::a;"),
        ("src/c_tests.rs", "use crate::a;"),
        ("src/helpers.rs", "use crate::a;"),
    ];
    assert_eq!(circle_names(&files), Vec::<String>::new());
    // The same b without the cfg makes the circle: the test above can fail.
    let files = [
        ("src/lib.rs", "mod a; mod b;"),
        ("src/a.rs", "use crate::b::X;"),
        ("src/b.rs", "pub struct X;\nmod tests { use crate::a::Y; }"),
    ];
    assert_eq!(circle_names(&files), ["demo: a, b"]);
}

#[test]
fn imports_comments_strings_and_lifetimes_are_not_paths() {
    let files = [
        ("src/lib.rs", "mod a; mod b;"),
        ("src/a.rs", "use crate::b::X;"),
        (
            "src/b.rs",
            r##"
            // use crate::a::X;
            /* crate::a::Y /* nested */ crate::a::Z */
            /// See [`crate::a`].
            const S: &str = "crate::a::X";
            const R: &str = r#"super::a::X "quoted""#;
            fn f<'a>(x: &'a str) -> char { let _ = b'"'; let _ = '\''; let _ = '\\'; '"' }
            const T: &str = "\"crate::a::W\"";
            "##,
        ),
    ];
    assert_eq!(circle_names(&files), Vec::<String>::new());
    // After all that, a real path is still seen.
    let files = [
        ("src/lib.rs", "mod a; mod b;"),
        ("src/a.rs", "use crate::b::X;"),
        (
            "src/b.rs",
            "fn f<'a>(x: &'a str) -> char { let _ = '{'; let _ = \"}\"; crate::a::g(); 'x' }",
        ),
    ];
    assert_eq!(circle_names(&files), ["demo: a, b"]);
}

#[test]
fn imports_inline_modules_belong_to_their_file() {
    // `super` inside an inline module is the file's own module; `super::super` its parent.
    let files = [
        ("src/lib.rs", "mod a; mod b;"),
        (
            "src/a.rs",
            "pub mod inner { use super::helper; fn f() { super::super::b::g() } } fn helper() {}",
        ),
        ("src/b.rs", "use crate::a::inner;"),
    ];
    assert_eq!(circle_names(&files), ["demo: a, b"]);
}

#[test]
fn imports_modules_declared_in_non_mod_files_and_by_path() {
    let files = [
        ("src/lib.rs", "mod a; mod b;"),
        (
            "src/a.rs",
            "pub mod deep; #[path = \"elsewhere.rs\"] mod moved;",
        ),
        ("src/a/deep.rs", "use crate::b::X;"),
        ("src/elsewhere.rs", ""),
        ("src/b.rs", "use crate::a::deep::Y;"),
    ];
    let g = graph_of(&files);
    let files_read: Vec<&str> = g.modules.iter().map(|m| m.file.as_str()).collect();
    assert!(files_read.contains(&"src/elsewhere.rs"), "{files_read:?}");
    assert_eq!(circle_names(&files), ["demo: a::deep, b"]);
}

#[test]
fn imports_a_declared_module_without_a_file_is_an_error() {
    let src: BTreeMap<&str, &str> = [("src/lib.rs", "mod gone;")].into_iter().collect();
    let crates = [CrateRoot {
        name: "demo".to_owned(),
        file: "src/lib.rs".to_owned(),
    }];
    let err = Graph::build(&crates, &src).err();
    assert!(err.is_some_and(|e| e.contains("src/gone/mod.rs")));
}

#[test]
fn imports_every_circle_fails_by_name() {
    let circle = |name: &str| Circle {
        name: name.to_owned(),
        detail: String::new(),
    };
    let e = judge(&[circle("k: a, b"), circle("k: c, d")])
        .err()
        .unwrap_or_default();
    assert!(e.contains("import circle k: a, b"), "{e}");
    assert!(e.contains("import circle k: c, d"), "{e}");
    assert!(judge(&[]).is_ok());
}
