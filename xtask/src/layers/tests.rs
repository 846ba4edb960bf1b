use super::*;
use std::path::PathBuf;

/// cozy-proxy's layers, bottom first (docs/architecture.md, "Layers"): a
/// file imports only from its own layer or those below it.
const COZY_PROXY: &[&[&str]] = &[
    // Small helpers every layer may use.
    &["fingerprint.rs", "memory.rs", "repeats.rs", "seccomp.rs"],
    // The pure model.
    &["model/"],
    // The Services and slices tests and benchmarks write (feature `fixtures`).
    &["fixtures.rs"],
    // The tables a plan becomes, the sync layer, the `Kernel` trait.
    &["datapath/"],
    // The netlink codec (its errors say which are transient: datapath's
    // `ErrorKind`).
    &["netlink/"],
    // Kernel state both backends read and write.
    &["bridge_ports.rs"],
    &["steer.rs"],
    // The backends (eBPF's hairpin masquerade is one nft rule).
    &["nft/"],
    &["ebpf/"],
    // Choosing and owning the node's backend.
    &["backend.rs"],
    // Metrics (they read the chosen backend and its counters).
    &["telemetry/"],
    // Watching the cluster, and what is said back to it.
    &["events.rs"],
    &["source/"],
    // The planned state for the kernel, and the loop that keeps it.
    &["shares.rs"],
    &["reconcile.rs"],
    &["controller.rs", "controller/"],
    // The application: the node, RBAC, flags, the binary.
    &["node.rs", "rbac.rs"],
    &["app.rs"],
    &["cli.rs"],
    &["lib.rs", "main.rs"],
];

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

fn report(imports: &[&Import]) -> String {
    imports
        .iter()
        .map(|i| format!("  {} -> {} ({})", i.from, i.to, i.path))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn cozy_proxy_imports_run_only_down_its_layers() {
    let graph = CrateGraph::read(&src("cozy-proxy"), "cozy-proxy").expect("read cozy-proxy/src");
    let imports = graph.imports();
    assert!(imports.len() > 100, "only {} imports read", imports.len());
    let unplaced: BTreeSet<&str> = imports
        .iter()
        .flat_map(|i| [i.from.as_str(), i.to.as_str()])
        .filter(|f| layer_of(COZY_PROXY, f).is_none())
        .collect();
    assert!(
        unplaced.is_empty(),
        "files in no layer (add them to COZY_PROXY and docs/architecture.md): {unplaced:?}"
    );
    let up = upward(COZY_PROXY, &imports);
    assert!(
        up.is_empty(),
        "imports from a layer to a higher one:\n{}",
        report(&up)
    );
}

#[test]
fn no_files_import_each_other_in_a_cycle() {
    for (krate, name) in [
        ("cozy-proxy", "cozy-proxy"),
        ("cozy-proxy-testkit", "cozy-proxy-testkit"),
        ("cozy-proxy-common", "cozy-proxy-common"),
        ("cozy-proxy-ebpf", "cozy-proxy-ebpf"),
        ("cozy-proxy-bench", "cozy-proxy-bench"),
        ("xtask", "xtask"),
    ] {
        let graph = CrateGraph::read(&src(krate), name).expect("read the sources");
        let imports = graph.imports();
        let found = cycles(&imports);
        let detail: Vec<String> = found
            .iter()
            .map(|group| {
                let inside: Vec<&Import> = imports
                    .iter()
                    .filter(|i| group.contains(&i.from) && group.contains(&i.to))
                    .collect();
                format!("{group:?}:\n{}", report(&inside))
            })
            .collect();
        assert!(
            found.is_empty(),
            "{krate}: files in a cycle:\n{}",
            detail.join("\n")
        );
    }
}

/// A crate written to a scratch directory, read back.
fn scratch_crate(files: &[(&str, &str)]) -> Vec<Import> {
    let dir = std::env::temp_dir().join(format!(
        "layers-{}-{}",
        std::process::id(),
        files.len() * 1000 + files.iter().map(|f| f.1.len()).sum::<usize>()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for (rel, text) in files {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }
    let imports = CrateGraph::read(&dir, "demo").expect("read").imports();
    let _ = std::fs::remove_dir_all(&dir);
    imports
}

/// Who imports whom, each pair once.
fn pairs(imports: &[Import]) -> Vec<(&str, &str)> {
    let set: BTreeSet<(&str, &str)> = imports
        .iter()
        .map(|i| (i.from.as_str(), i.to.as_str()))
        .collect();
    set.into_iter().collect()
}

#[test]
fn use_lines_inline_paths_and_child_paths_are_imports() {
    let imports = scratch_crate(&[
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        ("a.rs", "use crate::b::{Thing, other::{X as Y}};\n"),
        (
            "b/mod.rs",
            "pub mod other;\npub struct Thing;\nfn f() { other::g() }\n",
        ),
        ("b/other.rs", "pub fn g() {}\npub struct X;\n"),
        ("c.rs", "fn h() -> u8 { crate::a::K }\n"),
    ]);
    assert_eq!(
        pairs(&imports),
        vec![
            ("a.rs", "b/mod.rs"),
            ("a.rs", "b/other.rs"),
            ("b/mod.rs", "b/other.rs"),
            ("c.rs", "a.rs")
        ]
    );
}

#[test]
fn a_facade_reexport_is_followed_and_is_no_import() {
    let imports = scratch_crate(&[
        ("lib.rs", "pub mod m;\npub mod user;\n"),
        (
            "m/mod.rs",
            "mod inner;\npub use inner::{Item, Other as Renamed};\n",
        ),
        ("m/inner.rs", "pub struct Item;\npub struct Other;\n"),
        (
            "user.rs",
            "use crate::m::Renamed;\nfn f(_: crate::m::Item) {}\n",
        ),
    ]);
    assert_eq!(pairs(&imports), vec![("user.rs", "m/inner.rs")]);
}

#[test]
fn test_code_comments_and_strings_are_not_imports() {
    let imports = scratch_crate(&[
        ("lib.rs", "pub mod a;\npub mod b;\n"),
        (
            "a.rs",
            "// crate::b::X in a comment\n/* crate::b::Y */\nconst S: &str = \"crate::b::Z\";\n\
             const R: &str = r#\"crate::b::W\"#;\nfn f<'a>(c: char) -> bool { c == '\\'' }\n\
             #[cfg(test)]\nmod tests { use crate::b::X; }\n#[cfg(test)]\nmod more;\n",
        ),
        ("a/more.rs", "use crate::b::X;\n"),
        ("b.rs", "pub struct X;\n"),
    ]);
    assert_eq!(pairs(&imports), vec![]);
}

#[test]
fn an_upward_import_and_a_cycle_are_found() {
    let imports = scratch_crate(&[
        ("lib.rs", "pub mod low;\npub mod high;\n"),
        ("low.rs", "use crate::high::H;\npub struct L;\n"),
        ("high.rs", "use crate::low::L;\npub struct H;\n"),
    ]);
    let layers: &[&[&str]] = &[&["low.rs"], &["high.rs"]];
    let up = upward(layers, &imports);
    assert_eq!(up.len(), 1);
    assert_eq!(
        (up[0].from.as_str(), up[0].to.as_str()),
        ("low.rs", "high.rs")
    );
    assert_eq!(
        cycles(&imports),
        vec![vec!["high.rs".to_string(), "low.rs".to_string()]]
    );
}
