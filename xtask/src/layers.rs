//! The import graph of a crate's source files, read from their text, and
//! the two rules docs/architecture.md states for it: an import never runs
//! from a layer to a higher one, and no files import each other in a
//! cycle.
//!
//! What counts as an import of file A by file B: a `use` of a path into
//! A, or a path into A written in B's code (`crate::x::y`, `super::y`,
//! `child::y`), after following re-exports to the file that defines the
//! item. A folder's facade re-exporting its own files (`pub use
//! child::Item` in `mod.rs`) and declaring them (`mod child;`) is not an
//! import. Test code (`#[cfg(test)]` items, and the files they declare)
//! is left out: a test may reach anything it tests. Comments and string
//! literals are left out. Macros are not expanded: a path a macro builds
//! is not seen.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module path inside the crate: `["ebpf", "maps"]`.
type ModPath = Vec<String>;

/// Where `main.rs` sits when a library is beside it.
const BINARY: &str = "<main.rs>";

/// One source file, as far as the rules need it.
struct File {
    /// Its path under the crate's `src/`.
    rel: String,
    /// Its code, without comments, literals and test items, as tokens.
    tokens: Vec<Tok>,
    /// The modules it declares (`mod x;` or `mod x { .. }`), test ones
    /// left out.
    children: BTreeSet<String>,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

/// One import: who, of what, through which path.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Import {
    pub from: String,
    pub to: String,
    pub path: String,
}

/// The crate under `src`: its files by module path. `crate_name` is how a
/// binary beside the library (`main.rs`) names the library.
pub struct CrateGraph {
    files: BTreeMap<ModPath, File>,
    crate_name: String,
}

impl CrateGraph {
    pub fn read(src: &Path, crate_name: &str) -> std::io::Result<CrateGraph> {
        let mut found = Vec::new();
        walk(src, src, &mut found)?;
        let mut files = BTreeMap::new();
        let mut test_files = BTreeSet::new();
        let has_lib = found.iter().any(|(rel, _)| rel == "lib.rs");
        for (rel, text) in found {
            let (tokens, tests) = tokens_without_tests(&strip(&text));
            // A binary beside a library is a crate of its own.
            let module = if has_lib && rel == "main.rs" {
                vec![BINARY.to_string()]
            } else {
                module_of(&rel)
            };
            for t in &tests {
                let mut m = module.clone();
                m.push(t.clone());
                test_files.insert(m);
            }
            let children = declared(&tokens);
            files.insert(
                module,
                File {
                    rel,
                    tokens,
                    children,
                },
            );
        }
        // Files only test code declares, and the files below them.
        files.retain(|m, _| !test_files.iter().any(|t| m.starts_with(t)));
        Ok(CrateGraph {
            files,
            crate_name: crate_name.replace('-', "_"),
        })
    }

    /// Every import between two files of the crate.
    pub fn imports(&self) -> Vec<Import> {
        let mut out = BTreeSet::new();
        for (module, file) in &self.files {
            for (path, facade) in self.paths_of(module, file) {
                let Some(to) = self.resolve(&path, 0) else {
                    continue;
                };
                let to_file = &self.files[&to];
                // A facade re-export of the file's own subtree is not an
                // import; every other `pub use` is. What resolves to the
                // crate root is an exported macro (the root only declares
                // modules).
                if to_file.rel == file.rel || (facade && to.starts_with(module)) || to.is_empty() {
                    continue;
                }
                out.insert(Import {
                    from: file.rel.clone(),
                    to: to_file.rel.clone(),
                    path: path.join("::"),
                });
            }
        }
        out.into_iter().collect()
    }

    /// The absolute paths a file names, each with whether it is in a
    /// `pub use` (a possible facade).
    fn paths_of(&self, module: &ModPath, file: &File) -> Vec<(ModPath, bool)> {
        let mut out = Vec::new();
        let toks = &file.tokens;
        let mut i = 0;
        while i < toks.len() {
            if toks[i] == Tok::Ident("use".into()) {
                let public = i > 0 && is_pub_before(toks, i);
                let end = toks[i..]
                    .iter()
                    .position(|t| *t == Tok::Punct(';'))
                    .map_or(toks.len(), |p| i + p);
                let mut leaves = Vec::new();
                use_tree(&toks[i + 1..end], Vec::new(), &mut leaves);
                for leaf in leaves {
                    if let Some(abs) = self.absolute(module, file, &leaf) {
                        out.push((abs, public));
                    }
                }
                i = end + 1;
                continue;
            }
            if let Tok::Ident(_) = &toks[i] {
                let after_sep = i > 0 && toks[i - 1] == Tok::PathSep;
                if !after_sep && toks.get(i + 1) == Some(&Tok::PathSep) {
                    let mut path = Vec::new();
                    let mut j = i;
                    while let Some(Tok::Ident(s)) = toks.get(j) {
                        path.push(s.clone());
                        if toks.get(j + 1) != Some(&Tok::PathSep) {
                            break;
                        }
                        j += 2;
                    }
                    if let Some(abs) = self.absolute(module, file, &path) {
                        out.push((abs, false));
                    }
                    i = j + 1;
                    continue;
                }
            }
            i += 1;
        }
        out
    }

    /// A path as written in `file` made absolute, or `None` where it names
    /// something outside the crate (another crate, a local item).
    fn absolute(&self, module: &ModPath, file: &File, path: &[String]) -> Option<ModPath> {
        let (first, rest) = path.split_first()?;
        let mut base: ModPath = match first.as_str() {
            "crate" => Vec::new(),
            s if s == self.crate_name && file.rel == "main.rs" => Vec::new(),
            "self" if module.first().map(String::as_str) == Some(BINARY) => Vec::new(),
            "self" => module.clone(),
            "super" => {
                let mut b = module.clone();
                b.pop();
                let mut rest = rest;
                while rest.first().map(String::as_str) == Some("super") {
                    b.pop();
                    rest = &rest[1..];
                }
                return Some(b.into_iter().chain(rest.iter().cloned()).collect());
            }
            child if file.children.contains(child) => {
                let mut b = module.clone();
                b.push(child.to_string());
                b
            }
            _ => return None,
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The file that defines what `path` names: the longest module prefix,
    /// through the re-exports of that module's file.
    fn resolve(&self, path: &[String], depth: usize) -> Option<ModPath> {
        let len = (0..=path.len())
            .rev()
            .find(|n| self.files.contains_key(&path[..*n]))?;
        let module = path[..len].to_vec();
        if let (Some(name), true) = (path.get(len), depth < 8) {
            if let Some(target) = self.reexport(&module, name) {
                let mut next = target;
                next.extend(path[len + 1..].iter().cloned());
                if let Some(found) = self.resolve(&next, depth + 1) {
                    return Some(found);
                }
            }
        }
        Some(module)
    }

    /// Where `module`'s `pub use` of `name` points, if it has one.
    fn reexport(&self, module: &ModPath, name: &str) -> Option<ModPath> {
        let file = self.files.get(module)?;
        let toks = &file.tokens;
        for (i, t) in toks.iter().enumerate() {
            if *t != Tok::Ident("use".into()) || !is_pub_before(toks, i) {
                continue;
            }
            let end = toks[i..]
                .iter()
                .position(|t| *t == Tok::Punct(';'))
                .map_or(toks.len(), |p| i + p);
            let mut leaves = Vec::new();
            use_tree_named(&toks[i + 1..end], Vec::new(), &mut leaves);
            for (leaf, visible) in leaves {
                if visible == name {
                    return self.absolute(module, file, &leaf);
                }
            }
        }
        None
    }
}

/// Is the `use` at `i` public (`pub use`, `pub(crate) use`)?
fn is_pub_before(toks: &[Tok], i: usize) -> bool {
    match toks.get(i.wrapping_sub(1)) {
        Some(Tok::Ident(s)) if s == "pub" => true,
        Some(Tok::Punct(')')) => {
            let open = toks[..i].iter().rposition(|t| *t == Tok::Punct('('));
            open.is_some_and(|o| o > 0 && toks[o - 1] == Tok::Ident("pub".into()))
        }
        _ => false,
    }
}

/// The leaf paths of a use tree (`a::{b, c::d as e, f::*}`).
fn use_tree(toks: &[Tok], prefix: ModPath, out: &mut Vec<ModPath>) {
    let mut named = Vec::new();
    use_tree_named(toks, prefix, &mut named);
    out.extend(named.into_iter().map(|(p, _)| p));
}

/// The leaf paths of a use tree with the name each makes visible.
fn use_tree_named(toks: &[Tok], prefix: ModPath, out: &mut Vec<(ModPath, String)>) {
    let mut path = prefix;
    let mut i = 0;
    // A leading `::` names another crate.
    if toks.first() == Some(&Tok::PathSep) {
        return;
    }
    while i < toks.len() {
        match &toks[i] {
            Tok::Ident(s) if s == "as" => {
                if let Some(Tok::Ident(alias)) = toks.get(i + 1) {
                    if !path.is_empty() {
                        out.push((path.clone(), alias.clone()));
                    }
                }
                return;
            }
            Tok::Ident(s) => {
                path.push(s.clone());
                i += 1;
            }
            Tok::PathSep => i += 1,
            Tok::Punct('*') => {
                out.push((path.clone(), "*".into()));
                return;
            }
            Tok::Punct('{') => {
                let close = matching(toks, i);
                for part in split_top(&toks[i + 1..close]) {
                    if part == [Tok::Ident("self".into())] {
                        if let Some(last) = path.last() {
                            out.push((path.clone(), last.clone()));
                        }
                    } else {
                        use_tree_named(part, path.clone(), out);
                    }
                }
                return;
            }
            _ => return,
        }
    }
    if let Some(last) = path.last() {
        out.push((path.clone(), last.clone()));
    }
}

/// The index of the brace that closes the one at `open`.
fn matching(toks: &[Tok], open: usize) -> usize {
    let mut depth = 0;
    for (j, t) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    toks.len()
}

/// The comma-separated parts of a brace group's inside.
fn split_top(toks: &[Tok]) -> Vec<&[Tok]> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (j, t) in toks.iter().enumerate() {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth -= 1,
            Tok::Punct(',') if depth == 0 => {
                parts.push(&toks[start..j]);
                start = j + 1;
            }
            _ => {}
        }
    }
    parts.push(&toks[start..]);
    parts.retain(|p| !p.is_empty());
    parts
}

/// The modules a file declares.
fn declared(toks: &[Tok]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for w in toks.windows(3) {
        if let [Tok::Ident(m), Tok::Ident(name), Tok::Punct(';' | '{')] = w {
            if m == "mod" {
                out.insert(name.clone());
            }
        }
    }
    out
}

/// The module path of a file under `src/`.
fn module_of(rel: &str) -> ModPath {
    let stem = rel.trim_end_matches(".rs");
    let mut parts: ModPath = stem.split('/').map(str::to_string).collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            walk(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(root)
                .map_err(std::io::Error::other)?
                .to_string_lossy()
                .replace('\\', "/");
            out.push((rel, std::fs::read_to_string(&path)?));
        }
    }
    Ok(())
}

/// The code without comments and without the insides of string and char
/// literals (a literal's text is never a path).
fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !b[..i]
                .last()
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"..", r#".."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn tokenize(text: &str) -> Vec<Tok> {
    let b: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(b[start..i].iter().collect()));
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(Tok::Punct(c));
            }
            i += 1;
        }
    }
    out
}

/// The tokens without `#[cfg(test)]` items, and the names of the modules
/// those items declare as files (`#[cfg(test)] mod tests;`).
fn tokens_without_tests(text: &str) -> (Vec<Tok>, Vec<String>) {
    let toks = tokenize(text);
    let attr: Vec<Tok> = tokenize("#[cfg(test)]");
    let mut out = Vec::with_capacity(toks.len());
    let mut tests = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if !toks[i..].starts_with(&attr) {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        i += attr.len();
        // Further attributes of the same item.
        while toks.get(i) == Some(&Tok::Punct('#')) && toks.get(i + 1) == Some(&Tok::Punct('[')) {
            let mut depth = 0;
            while i < toks.len() {
                match toks[i] {
                    Tok::Punct('[') => depth += 1,
                    Tok::Punct(']') => {
                        depth -= 1;
                        if depth == 0 {
                            i += 1;
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        // The item: up to its `;`, or through its braces.
        let start = i;
        while i < toks.len() && toks[i] != Tok::Punct(';') && toks[i] != Tok::Punct('{') {
            i += 1;
        }
        if toks.get(i) == Some(&Tok::Punct(';')) {
            let item = &toks[start..i];
            if let [.., Tok::Ident(m), Tok::Ident(name)] = item {
                if m == "mod" {
                    tests.push(name.clone());
                }
            }
            i += 1;
        } else {
            i = matching(&toks, i) + 1;
        }
    }
    (out, tests)
}

/// The layer of a file: the index of the first entry of `layers` (bottom
/// first) that names it or a folder above it.
pub fn layer_of(layers: &[&[&str]], rel: &str) -> Option<usize> {
    layers.iter().position(|names| {
        names.iter().any(|n| {
            if let Some(dir) = n.strip_suffix('/') {
                rel.starts_with(&format!("{dir}/"))
            } else {
                rel == *n
            }
        })
    })
}

/// The imports that run from a layer to a higher one.
pub fn upward<'a>(layers: &[&[&str]], imports: &'a [Import]) -> Vec<&'a Import> {
    imports
        .iter()
        .filter(
            |i| match (layer_of(layers, &i.from), layer_of(layers, &i.to)) {
                (Some(a), Some(b)) => b > a,
                _ => false,
            },
        )
        .collect()
}

/// The groups of files that import each other in a cycle (Tarjan's
/// strongly connected components of more than one file).
pub fn cycles(imports: &[Import]) -> Vec<Vec<String>> {
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for i in imports {
        graph.entry(&i.from).or_default().insert(&i.to);
        graph.entry(&i.to).or_default();
    }
    struct Walk<'a> {
        graph: &'a BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for &w in &self.graph[v] {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.found.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        graph: &graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for &v in graph.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    walk.found
}

mod tests;
