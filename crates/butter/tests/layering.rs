//! The engine's layer order, held by a test: every `crate::MODULE` path in crates/butter/src is
//! an import edge from the file's module to MODULE, and an edge must run down the order below
//! (to a module listed earlier). Edges that run up today are listed in `EXCEPTIONS`; the list
//! may only shrink: an edge that breaks the order and is not listed fails the test, and so does
//! a listed edge that no longer exists (remove it from the list). With no exceptions there can
//! be no import cycle.
//!
//! `LAYERING_PRINT=1 cargo test --test layering -- --nocapture` prints every edge and the
//! exceptions as they stand.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Modules of crates/butter/src from the ground up. A module may import only modules before
/// it. (A folder is one module: `format/` is `format`.)
const ORDER: &[&str] = &[
    "error",
    "ids",
    "gate",
    "extent_io",
    "format",
    "device",
    "volumes",
    "disk_io",
    "ctree",
    "ctree_ops",
    "free_space_tree",
    "alloc",
    "log_state",
    "delayed_refs",
    "extent_record",
    "cow_ctx",
    "cow",
    "extent_tree",
    "transaction",
    "mkfs",
    "ordered",
    "inode_flags",
    "file_write",
    "fs_write",
    "fs_seek",
    "fs_stat",
    "subvol",
    "log_write",
    "tree_log",
    "check",
    "fs",
];

/// Edges that run against `ORDER` today (from, to). Only ever remove entries.
const EXCEPTIONS: &[(&str, &str)] = &[
    ("check", "fs"),
    ("error", "format"),
    ("file_write", "fs"),
    ("fs_seek", "fs"),
    ("fs_stat", "fs"),
    ("fs_write", "fs"),
    ("inode_flags", "fs"),
    ("log_write", "fs"),
    ("ordered", "fs"),
    ("subvol", "fs"),
    ("tree_log", "fs"),
];

/// The module a source file belongs to (None for lib.rs).
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    if first == "lib.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_string())
}

/// The modules a file names through `crate::` paths, also inside `use crate::{a, b::c}`.
/// A file's unit tests (from `#[cfg(test)]` on) are not part of its layer: they may use the
/// checker or the facade to judge what the module did.
fn imports(src: &str) -> BTreeSet<String> {
    let src = &without_test_items(src);
    let mut out = BTreeSet::new();
    // Comments do not import.
    let code: String = src
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let b = code.as_bytes();
    let mut i = 0;
    while let Some(at) = code[i..].find("crate::") {
        let start = i + at;
        i = start + "crate::".len();
        // `crate::` must start a path (not `some_crate::`).
        if start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_') {
            continue;
        }
        if code[i..].starts_with('{') {
            // A group: take the first segment of each member, at depth one.
            let mut depth = 0;
            let mut seg = String::new();
            let mut at_start = true;
            for c in code[i..].chars() {
                match c {
                    '{' => {
                        depth += 1;
                        if depth == 1 {
                            at_start = true;
                            seg.clear();
                        }
                    }
                    '}' => {
                        if depth == 1 && !seg.is_empty() {
                            out.insert(std::mem::take(&mut seg));
                        }
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => {
                        if !seg.is_empty() {
                            out.insert(std::mem::take(&mut seg));
                        }
                        at_start = true;
                    }
                    c if depth == 1 && at_start && (c.is_alphanumeric() || c == '_') => seg.push(c),
                    c if depth == 1 && !seg.is_empty() && !(c.is_alphanumeric() || c == '_') => {
                        out.insert(std::mem::take(&mut seg));
                        at_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name: String = code[i..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// The source without the items marked `#[cfg(test)]` (a module or function: up to its
/// closing brace; otherwise one line).
fn without_test_items(src: &str) -> String {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != "#[cfg(test)]" {
            out.push(lines[i]);
            i += 1;
            continue;
        }
        i += 1;
        while i < lines.len() && lines[i].trim_start().starts_with("#[") {
            i += 1;
        }
        let mut depth = 0i64;
        let mut opened = false;
        while i < lines.len() {
            for c in lines[i].chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            let end = (opened && depth <= 0) || (!opened && lines[i].trim_end().ends_with(';'));
            i += 1;
            if end {
                break;
            }
        }
    }
    out.join("\n")
}

fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every (from, to) module edge of crates/butter/src.
fn edges() -> BTreeSet<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let mut out = BTreeSet::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let Some(from) = module_of(rel) else { continue };
        let text = std::fs::read_to_string(&f).unwrap();
        for to in imports(&text) {
            // Items lib.rs re-exports stand for their module.
            let to = match to.as_str() {
                "Error" | "Location" | "Result" => "error".to_string(),
                _ => to,
            };
            if to != from && to != "self" && to != "super" {
                out.insert((from.clone(), to));
            }
        }
    }
    out
}

#[test]
fn imports_follow_the_layer_order() {
    let rank: BTreeMap<&str, usize> = ORDER.iter().enumerate().map(|(i, m)| (*m, i)).collect();
    let edges = edges();
    let mut unknown = BTreeSet::new();
    let mut against = BTreeSet::new();
    for (from, to) in &edges {
        match (rank.get(from.as_str()), rank.get(to.as_str())) {
            (Some(a), Some(b)) => {
                if b > a {
                    against.insert((from.clone(), to.clone()));
                }
            }
            (None, _) => {
                unknown.insert(from.clone());
            }
            (_, None) => {
                unknown.insert(to.clone());
            }
        }
    }
    if std::env::var_os("LAYERING_PRINT").is_some() {
        for (f, t) in &edges {
            println!("{f} -> {t}");
        }
        println!("against the order ({}):", against.len());
        for (f, t) in &against {
            println!("    (\"{f}\", \"{t}\"),");
        }
    }
    assert!(
        unknown.is_empty(),
        "modules missing from ORDER in tests/layering.rs (place each in its layer): {unknown:?}"
    );
    let listed: BTreeSet<(String, String)> = EXCEPTIONS
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let new: Vec<_> = against.difference(&listed).collect();
    assert!(
        new.is_empty(),
        "imports against the layer order (a lower layer must not use a higher one): {new:?}"
    );
    let gone: Vec<_> = listed.difference(&against).collect();
    assert!(
        gone.is_empty(),
        "these exceptions no longer exist: remove them from EXCEPTIONS in tests/layering.rs: {gone:?}"
    );
}

#[test]
fn unit_tests_are_not_imports() {
    let src = "use crate::a::B;\n#[cfg(test)]\nfn helper() -> crate::x::Y {\n    crate::y::z()\n}\n#[cfg(test)]\nuse crate::w;\nuse crate::c;\n#[cfg(test)]\nmod tests {\n    use crate::d;\n    fn f() { let s = format!(\"{x}\"); }\n}\n";
    let got: Vec<String> = imports(src).into_iter().collect();
    assert_eq!(got, ["a", "c"]);
}

#[test]
fn the_parser_finds_imports() {
    let src = "use crate::a::B;\nuse crate::{b, c::D, e::{f, g}};\nlet x = crate::h::i();\n// crate::j\nsome_crate::k;";
    let got: Vec<String> = imports(src).into_iter().collect();
    assert_eq!(got, ["a", "b", "c", "e", "h"]);
}
