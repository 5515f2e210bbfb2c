//! The layering inside the two biggest crates (docs/architecture.md, "Inside the router and the
//! worker"): no module uses an item of a module above it in the tree, and no import circles, as
//! `scripts/import_graph.py` reads the sources. The script is checked first on a small crate with
//! one of each fault, so a script that reads nothing cannot pass the real crates.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn import_graph(args: &[&Path]) -> Output {
    Command::new("python3")
        .arg(root().join("scripts/import_graph.py"))
        .arg("--check")
        .args(args)
        .output()
        .expect("python3 runs scripts/import_graph.py")
}

#[test]
fn the_check_finds_a_use_back_up_and_a_circle() {
    let dir = std::env::temp_dir().join(format!("ferry-layering-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("front")).unwrap();
    let files = [
        ("lib.rs", "pub mod a;\npub mod b;\npub mod front;\npub use a::Thing;\n"),
        ("a.rs", "use crate::b::Other;\npub struct Thing(pub Other);\n"),
        ("b.rs", "pub struct Other;\npub fn make() -> crate::a::Thing { crate::a::Thing(Other) }\n"),
        ("front/mod.rs", "pub mod child;\npub struct Held;\n"),
        ("front/child.rs", "use super::Held;\npub fn held() -> Held { Held }\n"),
    ];
    for (name, text) in files {
        std::fs::write(src.join(name), text).unwrap();
    }
    let out = import_graph(&[&dir]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!out.status.success(), "{report}");
    assert!(report.contains("1 back up the tree, 1 circles"), "{report}");
    assert!(report.contains("up:     front::child -> front"), "{report}");
    assert!(report.contains("circle: a <-> b"), "{report}");
}

#[test]
fn the_router_and_the_worker_have_no_use_back_up_and_no_circles() {
    let crates = [root().join("crates/ferry-router"), root().join("crates/ferry-worker")];
    let out = import_graph(&[&crates[0], &crates[1]]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(report.matches("0 back up the tree, 0 circles").count(), 2, "{report}");
}
