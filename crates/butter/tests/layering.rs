//! The engine's layer order, held by a test: every `crate::MODULE` path in crates/butter/src is
//! an import edge from the file's module to MODULE, and an edge must run down the order below
//! (to a module listed earlier). Edges that run up today are listed in `EXCEPTIONS`; the list
//! may only shrink: an edge that breaks the order and is not listed fails the test, and so does
//! a listed edge that no longer exists (remove it from the list). With no exceptions there can
//! be no import cycle.
//!
//! `LAYERING_PRINT=1 cargo test --test layering -- --nocapture` prints every edge and the
//! exceptions as they stand.
//!
//! The same walk holds the size of the public API: `pub` items outside unit tests and outside
//! what only the `internals` feature builds stay within `PUB_ITEMS_MAX`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Modules of crates/butter/src from the ground up. A module may import only modules before
/// it. (A folder is one module, `format/` is `format`, except those in `SPLIT`, whose files
/// are listed one by one: `inode/core`; their `mod.rs` is the folder's name.)
const ORDER: &[&str] = &[
    "ids",
    "error",
    "gate",
    "extent_io",
    "format",
    "io/device",
    "io/nbd",
    "io/ram",
    "io/raid56",
    "io/volumes",
    "io/super_io",
    "io/disk_io",
    "io",
    "space/free_space_tree",
    "space/alloc",
    "space/delayed_refs",
    "space",
    "ctree",
    "ctree/ops",
    "ctree/build",
    "ctree/extent_record",
    "ctree/cow_ctx",
    "ctree/cow",
    "transaction/log_state",
    "transaction/extent_refs",
    "transaction/block_groups",
    "transaction/chunk_alloc",
    "transaction/commit",
    "transaction/relocate",
    "transaction",
    "mkfs",
    "inode/ordered",
    "inode/core",
    "inode/read",
    "inode/flags",
    "inode/file",
    "inode/namespace",
    "inode/reflink",
    "inode/encoded",
    "inode/orphan",
    "inode/seek",
    "inode/statfs",
    "inode/balance",
    "inode/scrub",
    "inode/subvol",
    "inode/received",
    "inode/subvol_delete",
    "inode",
    "tree_log/write",
    "tree_log/replay",
    "tree_log",
    "check",
    "inspect",
    "fs",
    "receive",
    "send",
    "internals",
];

/// Edges that run against `ORDER` today (from, to). Only ever remove entries.
const EXCEPTIONS: &[(&str, &str)] = &[];

/// The module a source file belongs to (None for lib.rs).
fn module_of(rel: &Path) -> Option<String> {
    let mut parts = rel
        .components()
        .map(|c| c.as_os_str().to_str().unwrap_or(""));
    let first = parts.next()?;
    if first == "lib.rs" {
        return None;
    }
    let first = first.trim_end_matches(".rs");
    match parts.next() {
        Some(file) if SPLIT.contains(&first) && file != "mod.rs" => {
            Some(format!("{first}/{}", file.trim_end_matches(".rs")))
        }
        _ => Some(first.to_string()),
    }
}

/// Folders whose files are modules of their own in `ORDER` (`inode/core`), so that the layers
/// inside them are held too; any other folder is one module (`format`).
const SPLIT: &[&str] = &["io", "space", "ctree", "transaction", "inode", "tree_log"];

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
        for m in use_tree(&code[i..]) {
            out.insert(m);
        }
    }
    out
}

/// Whether `folder/name` is a file of crates/butter/src (a module of a folder in `SPLIT`).
fn is_submodule(path: &str) -> bool {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(format!("{path}.rs"))
        .is_file()
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The members of a `{a, b::c, d::{e, f}}` group (its text from the `{`), split at its own
/// commas.
fn group_members(s: &str) -> Vec<&str> {
    let mut depth = 0;
    let mut out = Vec::new();
    let mut from = 1;
    for (k, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    out.push(&s[from..k]);
                    break;
                }
            }
            ',' if depth == 1 => {
                out.push(&s[from..k]);
                from = k + 1;
            }
            _ => {}
        }
    }
    out.into_iter()
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .collect()
}

/// The modules a path after `crate::` names: its first segment, or for a folder in `SPLIT`
/// its first two (`inode/core`).
fn use_tree(s: &str) -> Vec<String> {
    let s = s.trim_start();
    if s.starts_with('{') {
        return group_members(s).into_iter().flat_map(use_tree).collect();
    }
    let first = ident(s);
    if first.is_empty() {
        return Vec::new();
    }
    let rest = &s[first.len()..];
    if !SPLIT.contains(&first.as_str()) || !rest.starts_with("::") {
        return vec![first];
    }
    let rest = rest[2..].trim_start();
    let subs: Vec<String> = if rest.starts_with('{') {
        group_members(rest).into_iter().map(ident).collect()
    } else {
        vec![ident(rest)]
    };
    subs.into_iter()
        .map(|m| {
            let sub = format!("{first}/{m}");
            // An item of the folder's mod.rs (`crate::ctree::lookup`) is the folder itself.
            if is_submodule(&sub) {
                sub
            } else {
                first.clone()
            }
        })
        .collect()
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
        // A `*_tests.rs` file is a unit-test module (declared under `#[cfg(test)]`): not part
        // of a layer, like the `#[cfg(test)]` items inside other files.
        if rel.to_str().is_some_and(|r| r.ends_with("_tests.rs")) {
            continue;
        }
        // `src/tests/` holds the white-box suites (declared in lib.rs under `cfg(test)`, and
        // the fuzz bodies under the `fuzzing` feature): they may use every layer, so they are
        // not part of one either.
        if rel.starts_with("tests") {
            continue;
        }
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

/// At most this many `pub` items (fn, struct, enum, const, type, trait, static) in
/// crates/butter/src: a quarter of the 810 the crate had before it was put in layers (issue 15).
/// What a caller needs goes public deliberately; the rest is `pub(crate)`, and what only tests,
/// benchmarks and the fuzz crate need goes under the `internals` feature. (Issue 31 moved the
/// gate into the operations: the inode layer's `Core` went crate-private with its methods,
/// the gate's functions too, and the operations that take their own passage and apply the
/// POSIX rules a FUSE server owns came in: 202 to 206; then `Fs::set_memory` and its
/// `MemoryLimits`, the mount's `cache_size=`: 208; then the fuzz crate's three entry points
/// in `butter::fuzz`, built only under the `fuzzing` feature, which had gone `pub(crate)` and
/// left the fuzz crate unbuildable: 211. Issue 32's filesystems of several devices:
/// `Fs::open_paths`, `Fs::open_device_set` and `inspect::dump_tree_set` open a set of devices,
/// and `Disk::dev` became a method where a `pub dev` field had been: 215. Then writing them,
/// `Fs::open_rw_paths` and `Fs::open_device_set_rw_with`, and `filesystem show` and
/// `scrub`: `Fs::devices` with its `DeviceInfo`, `Fs::scrub` with its `ScrubReport` (and
/// `total`) and `ScrubCounts`: 223. Then devices on other machines: `io::nbd`'s `Address`
/// (with `parse`) and `NbdDevice` (with `open` and `trim`): 228. Then `mkfs::mkfs_devices`
/// for a filesystem of several, with its `ChunkStripe`, `DeviceReport` and
/// `Profile::min_devices` and `Profile::name`, and `NbdDevice::writable` for mkfs on an
/// export: 234. Then offline resize, `Fs::resize_device` and `Fs::device_min_size`: 236. `Fs::add_device`: 237. Removing empty block groups,
/// `Fs::block_groups` with its `BlockGroupInfo` and `Fs::remove_empty_block_groups`: 240. `Fs::remove_device`: 241.
/// Relocation (issue 33): `Fs::relocate_block_groups` with its `RelocStats`,
/// `Fs::shrink_device_to_min`, and balance, `Fs::balance` with its `BalanceRequest`,
/// `BalanceFilters` and `BalanceReport`, `Fs::paused_balance` and `Fs::cancel_balance`: 250.
/// The mount serving the kernel's balance ioctl: `BalanceRequest::from_ioctl_args` and
/// `to_ioctl_args`: 252. `Fs::replace_device`, for the mount's device replace: 253.
/// Repair (issue 34): `Fs::repair`, its `RepairReport` and the findings' `Fix`: 256. The
/// rescue commands, `Fs::zero_log`, `Fs::super_recover` and `Fs::fix_device_size`: 259.
/// `ExtentRef`, the back references a `Fix::ExtentRefs` gives an extent: 260.
/// `Fs::clear_uuid_tree` (`butter rescue clear-uuid-tree`): 261. `Fs::init_csum_tree`
/// (`butter check --repair --init-csum-tree`): 262. `Fs::clear_space_cache` (`butter rescue
/// clear-space-cache v1|v2`): 263. `butter rescue fix-data-checksum`:
/// `Fs::data_checksum_mismatches` with its `BadSector`, `Fs::update_data_checksums`: 266.
/// `Fs::init_extent_tree` (`butter check --repair --init-extent-tree`): 267.)
const PUB_ITEMS_MAX: usize = 267;

/// Files (or folders) built only under `cfg(any(test, feature = "internals"))`, as the `mod`
/// lines of lib.rs and the folders' mod.rs declare them: not part of the public API.
fn internals_only(src: &Path) -> BTreeSet<std::path::PathBuf> {
    let mut out = BTreeSet::new();
    let mut files = Vec::new();
    walk(src, &mut files);
    for f in files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name != "lib.rs" && name != "mod.rs" {
            continue;
        }
        let dir = f.parent().unwrap();
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for w in lines.windows(2) {
            if w[0] != r#"#[cfg(any(test, feature = "internals"))]"# {
                continue;
            }
            let decl = w[1]
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub ");
            if let Some(m) = decl.strip_prefix("mod ").and_then(|m| m.strip_suffix(';')) {
                out.insert(dir.join(format!("{m}.rs")));
                out.insert(dir.join(m));
            }
        }
    }
    out
}

/// The `pub` items of one source file's text, as `name` strings, unit tests left out.
fn pub_items(text: &str) -> Vec<String> {
    const KINDS: &[&str] = &[
        "fn ",
        "const fn ",
        "unsafe fn ",
        "struct ",
        "enum ",
        "const ",
        "type ",
        "trait ",
        "static ",
    ];
    without_test_items(text)
        .lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix("pub ")?;
            let kind = KINDS.iter().find(|k| rest.starts_with(**k))?;
            Some(ident(&rest[kind.len()..]))
        })
        .collect()
}

#[test]
fn the_public_api_stays_within_its_bound() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let hidden = internals_only(&src);
    assert!(
        hidden.iter().any(|p| p.ends_with("io/ram.rs")),
        "the RAM device is expected under the internals feature: {hidden:?}"
    );
    let mut files = Vec::new();
    walk(&src, &mut files);
    let mut items = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let test_only =
            rel.starts_with("tests") || rel.to_str().is_some_and(|r| r.ends_with("_tests.rs"));
        if test_only || hidden.iter().any(|h| f.starts_with(h)) {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        for name in pub_items(&text) {
            items.push(format!("{}: {name}", rel.display()));
        }
    }
    if std::env::var_os("LAYERING_PRINT").is_some() {
        for i in &items {
            println!("pub {i}");
        }
    }
    println!("{} pub items (at most {PUB_ITEMS_MAX})", items.len());
    assert!(
        items.len() <= PUB_ITEMS_MAX,
        "{} pub items in crates/butter/src, at most {PUB_ITEMS_MAX}: make what only the crate uses \
         pub(crate), and what only tests need part of `internals` \
         (LAYERING_PRINT=1 cargo test --test layering -- --nocapture lists them)",
        items.len()
    );
}

#[test]
fn pub_items_are_counted_outside_unit_tests() {
    let src = "pub fn a() {}\npub(crate) fn b() {}\n    pub const C: u8 = 1;\npub use x::Y;\npub mod m;\n#[cfg(test)]\nmod tests {\n    pub fn helper() {}\n}\npub struct S;\n";
    assert_eq!(pub_items(src), ["a", "C", "S"]);
}

#[test]
fn unit_tests_are_not_imports() {
    let src = "use crate::a::B;\n#[cfg(test)]\nfn helper() -> crate::x::Y {\n    crate::y::z()\n}\n#[cfg(test)]\nuse crate::w;\nuse crate::c;\n#[cfg(test)]\nmod tests {\n    use crate::d;\n    fn f() { let s = format!(\"{x}\"); }\n}\n";
    let got: Vec<String> = imports(src).into_iter().collect();
    assert_eq!(got, ["a", "c"]);
}

#[test]
fn the_parser_splits_the_folders_in_split() {
    let src = "use crate::inode::core::Core;\nuse crate::{inode::{read::Stat, file}, tree_log::write};\nuse crate::inode::{self, seek::Seek};\nlet x = crate::format::items::X;\nlet y = crate::ctree::lookup(d, r, k);";
    let got: Vec<String> = imports(src).into_iter().collect();
    assert_eq!(
        got,
        [
            "ctree",
            "format",
            "inode",
            "inode/core",
            "inode/file",
            "inode/read",
            "inode/seek",
            "tree_log/write"
        ]
    );
    assert_eq!(module_of(Path::new("inode/core.rs")).unwrap(), "inode/core");
    assert_eq!(module_of(Path::new("inode/mod.rs")).unwrap(), "inode");
    assert_eq!(module_of(Path::new("format/items.rs")).unwrap(), "format");
}

#[test]
fn the_parser_finds_imports() {
    let src = "use crate::a::B;\nuse crate::{b, c::D, e::{f, g}};\nlet x = crate::h::i();\n// crate::j\nsome_crate::k;";
    let got: Vec<String> = imports(src).into_iter().collect();
    assert_eq!(got, ["a", "b", "c", "e", "h"]);
}

/// lib.rs's layer list (its `//! - `name`: ...` lines) names the top-level modules in the
/// order of `ORDER`, every one of them.
#[test]
fn the_layer_comment_in_lib_rs_is_the_order() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let listed: Vec<String> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//! - `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect();
    let mut order: Vec<String> = Vec::new();
    for m in ORDER {
        let top = m.split('/').next().unwrap().to_string();
        if !order.contains(&top) {
            order.push(top);
        }
    }
    assert_eq!(
        listed, order,
        "lib.rs's layer comment and ORDER in tests/layering.rs disagree"
    );
}
