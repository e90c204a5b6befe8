//! `butter subvolume delete` against the kernel's btrfs.
//!
//! - A subvolume of a few thousand files and several MiB made by `butter mkfs --rootdir`,
//!   snapshotted by butter and changed through a kernel mount: butter deletes the snapshot
//!   (and, on a copy, the source while the snapshot lives). Each result passes `butter check`
//!   and `btrfs check`; the kernel mounts it, the other subvolume's files hash the same, the
//!   deleted one is gone from `btrfs subvolume list` and from the uuid tree, and the data
//!   space came back (deleting the snapshot gives back exactly what it added).
//! - The same on a subvolume, a snapshot, a read-only snapshot and a received copy made by the
//!   kernel (the copy's RECEIVED_SUBVOL uuid entry goes too).
//! - A drop the kernel left half done (a large subvolume deleted, unmounted while the cleaner
//!   works: the ROOT_ITEM has refs 0 and a drop progress): `butter subvolume sync` (any
//!   read-write open) finishes it; ROOT_ITEM and ORPHAN item are gone, both checkers are
//!   clean, the kernel mounts it.
//! - Refusals with clear messages: the top level, the default subvolume, a path that is no
//!   subvolume root, a subvolume holding another.
//! - With quotas on: the qgroup items stay, `btrfs check` accepts the result, a rescan works.
//!
//! Needs root, loop devices, kernel btrfs and btrfs-progs: without them the tests fail.

mod common;

use common::fuse_mount::{self, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::collections::BTreeMap;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::process::Command;

fn need_oracle() {
    assert!(
        kernel::require_privileges(),
        "this test needs root, loop devices, kernel btrfs and btrfs-progs"
    );
}

/// `butter ARGS...`: (success, stdout, stderr).
fn butter(args: &[&str]) -> (bool, String, String) {
    let out = kernel::run_output(Command::new(BUTTER).args(args));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn butter_ok(args: &[&str]) -> String {
    let (ok, out, err) = butter(args);
    assert!(ok, "butter {args:?} failed:\n{out}{err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Deterministic bytes.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Every path below `dir` with a hash of what it holds (file bytes, link target; directories
/// hash to 0).
fn hash_tree(dir: &Path) -> BTreeMap<String, u64> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, u64>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap().to_string_lossy().into_owned();
            let t = e.file_type().unwrap();
            let h = if t.is_dir() {
                walk(base, &p, out);
                0
            } else {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                if t.is_symlink() {
                    fs::read_link(&p).unwrap().hash(&mut h);
                } else {
                    fs::read(&p).unwrap().hash(&mut h);
                }
                h.finish()
            };
            out.insert(rel, h);
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Fills `dir` with `dirs` x `files` files (most small, every 4th 8 to 28 KiB) and a few
/// 1 MiB ones.
fn fill(dir: &Path, dirs: u64, files: u64) {
    for d in 0..dirs {
        let sub = dir.join(format!("d{d}"));
        fs::create_dir_all(&sub).unwrap();
        for i in 0..files {
            let len = if i % 4 == 0 {
                8192 + (i as usize * 331) % 20_000
            } else {
                100 + (i as usize * 37) % 1500
            };
            fs::write(sub.join(format!("f{i}")), bytes(d * 100_000 + i, len)).unwrap();
        }
    }
    for i in 0..4 {
        fs::write(dir.join(format!("big{i}")), bytes(1000 + i, 1 << 20)).unwrap();
    }
    std::os::unix::fs::symlink("d0/f0", dir.join("link")).unwrap();
}

/// Changes a snapshot: rewrites, removals, new files.
fn change(dir: &Path) {
    for d in (0..8).step_by(3) {
        let sub = dir.join(format!("d{d}"));
        for i in (0..200).step_by(13) {
            let f = sub.join(format!("f{i}"));
            if f.exists() {
                fs::write(&f, bytes(7 + i, 5000)).unwrap();
            }
        }
        let _ = fs::remove_file(sub.join("f1"));
        fs::write(sub.join("new"), bytes(d, 300_000)).unwrap();
    }
    fs::write(dir.join("big1"), bytes(99, 1 << 20)).unwrap();
}

/// Data bytes in use as the kernel counts them (`btrfs filesystem df -b`), of a mount.
fn data_used(mnt: &Path) -> u64 {
    let out = kernel::sh("btrfs", &["filesystem", "df", "-b", s(mnt)]);
    let line = out
        .lines()
        .find(|l| l.starts_with("Data,"))
        .unwrap_or_else(|| panic!("no Data line in:\n{out}"));
    let used = line
        .split("used=")
        .nth(1)
        .unwrap_or_else(|| panic!("no used= in {line}"));
    used.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{line}: {e}"))
}

/// The subvolume id `butter subvolume show` gives for `path`.
fn subvol_id(img: &Path, path: &str) -> u64 {
    let out = butter_ok(&["subvolume", "show", s(img), path]);
    out.lines()
        .find_map(|l| l.trim().strip_prefix("Subvolume ID:"))
        .unwrap_or_else(|| panic!("no id in:\n{out}"))
        .trim()
        .parse()
        .unwrap()
}

/// After butter deleted subvolume `id` (once at `gone`) from `img`: both checkers clean, the
/// root tree without its ROOT_ITEM and ORPHAN item, the uuid tree without it; the kernel
/// mounts the image, does not list it, and shows `keep` (a subvolume path) hashing to
/// `want`. Returns the data bytes in use.
fn verify_deleted(
    sc: &ScratchDir,
    img: &Path,
    id: u64,
    gone: &str,
    keep: &str,
    want: &BTreeMap<String, u64>,
) -> u64 {
    let (rc, out) = fuse_mount::butter_check(img);
    assert_eq!(rc, 0, "butter check after deleting {gone}:\n{out}");
    kernel::assert_btrfs_check(img);
    let roots = kernel::dump_tree(img, &["-t", "root"]);
    assert!(
        !roots.contains(&format!("key ({id} ROOT_ITEM")),
        "ROOT_ITEM of {id} left:\n{roots}"
    );
    assert!(
        !roots.contains(&format!("ORPHAN_ITEM {id})")),
        "ORPHAN item of {id} left"
    );
    let uuids = kernel::dump_tree(img, &["-t", "uuid"]);
    assert!(
        !uuids.contains(&format!("subvol_id {id}\n")),
        "uuid tree entry of {id} left:\n{uuids}"
    );
    let list = butter_ok(&["subvolume", "list", s(img)]);
    assert!(
        !list.contains(&format!("ID {id} ")),
        "butter lists {id}:\n{list}"
    );
    let m = LoopMount::btrfs(img, &sc.dir("k"), "");
    let klist = kernel::sh("btrfs", &["subvolume", "list", s(m.path())]);
    assert!(
        !klist.contains(&format!("ID {id} ")),
        "the kernel lists {id}:\n{klist}"
    );
    assert!(!m.path().join(gone).exists(), "{gone} still there");
    let got = hash_tree(&m.path().join(keep));
    assert!(got == *want, "{keep} differs after deleting {gone}");
    let used = data_used(m.path());
    m.unmount();
    kernel::assert_btrfs_check(img);
    used
}

#[test]
fn delete_butter_made_snapshot_and_subvolume() {
    need_oracle();
    let sc = ScratchDir::new("subvol-delete-butter");
    let src = sc.dir("src");
    fill(&src.join("sv"), 10, 300);
    let img = sc.join("a.img");
    butter_ok(&[
        "mkfs",
        "-b",
        "512M",
        "--rootdir",
        s(&src),
        "--subvol",
        "sv",
        s(&img),
    ]);
    let tree = kernel::dump_tree(&img, &["-t", "256"]);
    let top = tree
        .lines()
        .find(|l| l.starts_with("node ") || l.starts_with("leaf "))
        .unwrap_or("");
    assert!(
        top.starts_with("node "),
        "the subvolume's tree should have several levels: {top}"
    );
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    let before = data_used(m.path());
    m.unmount();
    butter_ok(&["subvolume", "snapshot", s(&img), "sv", "snap"]);
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    change(&m.path().join("snap"));
    kernel::sync_all();
    let with_snap = data_used(m.path());
    let sv_hash = hash_tree(&m.path().join("sv"));
    let snap_hash = hash_tree(&m.path().join("snap"));
    m.unmount();
    assert!(with_snap > before);
    let sv = subvol_id(&img, "sv");
    let snap = subvol_id(&img, "snap");
    let img2 = sc.join("b.img");
    fs::copy(&img, &img2).unwrap();

    let out = butter_ok(&["subvolume", "delete", s(&img), "snap"]);
    assert!(out.contains(&format!("Delete subvolume {snap}")), "{out}");
    let after = verify_deleted(&sc, &img, snap, "snap", "sv", &sv_hash);
    assert_eq!(
        after, before,
        "data in use: {before} before the snapshot, {with_snap} with it, {after} after its delete"
    );

    butter_ok(&["subvolume", "delete", s(&img2), "sv"]);
    let after2 = verify_deleted(&sc, &img2, sv, "sv", "snap", &snap_hash);
    assert!(
        after2 < with_snap,
        "data in use: {with_snap} with both, {after2} after the source's delete"
    );
}

#[test]
fn delete_kernel_made_subvolume_and_snapshots() {
    need_oracle();
    let sc = ScratchDir::new("subvol-delete-kernel");
    let img = sc.join("a.img");
    kernel::mkfs_btrfs::<&str>(&img, 1 << 30, &[]);
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    let p = m.path().to_path_buf();
    kernel::sh("btrfs", &["subvolume", "create", s(&p.join("sv"))]);
    fill(&p.join("sv"), 8, 400);
    kernel::sync_all();
    let before = data_used(&p);
    kernel::sh(
        "btrfs",
        &[
            "subvolume",
            "snapshot",
            s(&p.join("sv")),
            s(&p.join("snap")),
        ],
    );
    kernel::sh(
        "btrfs",
        &[
            "subvolume",
            "snapshot",
            "-r",
            s(&p.join("sv")),
            s(&p.join("ro")),
        ],
    );
    change(&p.join("snap"));
    // A received copy of the read-only snapshot (received uuid, RECEIVED_SUBVOL uuid entry).
    fs::create_dir(p.join("recv")).unwrap();
    let stream = sc.join("ro.stream");
    kernel::sh("btrfs", &["send", "-q", "-f", s(&stream), s(&p.join("ro"))]);
    kernel::sh(
        "btrfs",
        &["receive", "-q", "-f", s(&stream), s(&p.join("recv"))],
    );
    kernel::sync_all();
    let sv_hash = hash_tree(&p.join("sv"));
    let snap_hash = hash_tree(&p.join("snap"));
    m.unmount();
    let (sv, snap, ro, recv) = (
        subvol_id(&img, "sv"),
        subvol_id(&img, "snap"),
        subvol_id(&img, "ro"),
        subvol_id(&img, "recv/ro"),
    );
    let uuids = kernel::dump_tree(&img, &["-t", "uuid"]);
    assert!(
        uuids.contains("UUID_KEY_RECEIVED_SUBVOL")
            && uuids.contains(&format!("subvol_id {recv}\n")),
        "{uuids}"
    );
    let img2 = sc.join("b.img");
    fs::copy(&img, &img2).unwrap();

    // The snapshot, then the read-only one: back to the data of the subvolume alone.
    butter_ok(&["subvolume", "delete", s(&img), "snap"]);
    verify_deleted(&sc, &img, snap, "snap", "sv", &sv_hash);
    butter_ok(&["subvolume", "delete", s(&img), "ro"]);
    verify_deleted(&sc, &img, ro, "ro", "sv", &sv_hash);
    butter_ok(&["subvolume", "delete", s(&img), "recv/ro"]);
    let after = verify_deleted(&sc, &img, recv, "recv/ro", "sv", &sv_hash);
    assert!(
        !kernel::dump_tree(&img, &["-t", "uuid"]).contains("UUID_KEY_RECEIVED_SUBVOL"),
        "the received uuid's entry is left"
    );
    assert_eq!(
        after, before,
        "data in use after deleting the snapshots and the copy"
    );

    // The source, while its snapshots live; then the read-only snapshot.
    butter_ok(&["subvolume", "delete", s(&img2), "sv"]);
    verify_deleted(&sc, &img2, sv, "sv", "snap", &snap_hash);
    butter_ok(&["subvolume", "delete", s(&img2), "ro"]);
    verify_deleted(&sc, &img2, ro, "ro", "snap", &snap_hash);
}

/// The ROOT_ITEM of tree 256 as dump-tree prints it (its refs and drop progress lines).
fn root_item_256(img: &Path) -> Option<String> {
    let roots = kernel::dump_tree(img, &["-t", "root"]);
    let mut lines = roots.lines();
    lines.find(|l| l.contains("key (256 ROOT_ITEM"))?;
    Some(lines.take(4).collect::<Vec<_>>().join("\n"))
}

#[test]
fn continue_a_drop_the_kernel_left_half_done() {
    need_oracle();
    let sc = ScratchDir::new("subvol-delete-half");
    let base = sc.join("base.img");
    kernel::mkfs_btrfs::<&str>(&base, 2 << 30, &[]);
    {
        let m = LoopMount::btrfs(&base, &sc.dir("k"), "");
        let p = m.path();
        kernel::sh("btrfs", &["subvolume", "create", s(&p.join("big"))]);
        kernel::sh("mkdir", &[s(&p.join("keep"))]);
        fs::write(p.join("keep/f"), b"kept\n").unwrap();
        for d in 0..60 {
            let sub = p.join(format!("big/d{d}"));
            fs::create_dir(&sub).unwrap();
            for i in 0..500u64 {
                let len = 200 + (i as usize * 7) % 1500;
                fs::write(sub.join(format!("f{i}")), bytes(i, len)).unwrap();
            }
            fs::write(sub.join("data"), bytes(d, 64 << 10)).unwrap();
        }
        m.unmount();
    }
    // Delete and unmount while the cleaner drops the tree: try growing delays until the
    // root item is left with a drop progress.
    let img = sc.join("a.img");
    let mut half = None;
    for delay_ms in [0u64, 20, 50, 100, 150, 200, 300, 500, 50, 100, 150] {
        fs::copy(&base, &img).unwrap();
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        kernel::sh(
            "btrfs",
            &["subvolume", "delete", "-c", s(&m.path().join("big"))],
        );
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        m.unmount();
        if let Some(ri) = root_item_256(&img) {
            eprintln!("delay {delay_ms} ms:\n{ri}");
            if ri.contains("refs 0") && !ri.contains("drop_progress key (0 UNKNOWN.0 0)") {
                half = Some(ri);
                break;
            }
        } else {
            eprintln!("delay {delay_ms} ms: the kernel finished the drop");
        }
    }
    let half = half.expect("no attempt left the kernel's drop half done");
    assert!(half.contains("drop_level"), "{half}");
    // Reading tolerates it: the dead tree is not listed, both checkers accept it.
    let list = butter_ok(&["subvolume", "list", s(&img)]);
    assert!(!list.contains("big"), "{list}");
    let (rc, out) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check of the half-dropped tree:\n{out}");
    kernel::assert_btrfs_check(&img);
    // A read-write open finishes it.
    let out = butter_ok(&["subvolume", "sync", s(&img)]);
    assert!(out.contains("No deleted subvolume"), "{out}");
    assert!(root_item_256(&img).is_none(), "the ROOT_ITEM is left");
    let roots = kernel::dump_tree(&img, &["-t", "root"]);
    assert!(
        !roots.contains("ORPHAN_ITEM 256)"),
        "the ORPHAN item is left"
    );
    let (rc, out) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check:\n{out}");
    kernel::assert_btrfs_check(&img);
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    assert_eq!(fs::read(m.path().join("keep/f")).unwrap(), b"kept\n");
    assert!(!m.path().join("big").exists());
    assert_eq!(
        data_used(m.path()),
        0,
        "the dropped subvolume's data is freed"
    );
    m.unmount();
    kernel::assert_btrfs_check(&img);
}

#[test]
fn refusals_say_why() {
    need_oracle();
    let sc = ScratchDir::new("subvol-delete-refuse");
    let img = sc.join("a.img");
    kernel::mkfs_btrfs::<&str>(&img, 256 << 20, &[]);
    butter_ok(&["subvolume", "create", s(&img), "outer"]);
    butter_ok(&["subvolume", "create", s(&img), "outer/inner"]);
    butter_ok(&["subvolume", "create", s(&img), "def"]);
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    fs::create_dir(m.path().join("dir")).unwrap();
    fs::write(m.path().join("outer/file"), b"x").unwrap();
    m.unmount();
    let refused = |args: &[&str], why: &str| {
        let mut a = vec!["subvolume", "delete"];
        a.extend_from_slice(args);
        let (ok, out, err) = butter(&a);
        assert!(!ok, "delete {args:?} succeeded: {out}");
        assert!(err.contains(why), "delete {args:?}: {err}");
    };
    let i = s(&img);
    refused(&[i, "/"], "top level");
    refused(
        &["--subvolid", "5", i],
        "top-level subvolume (5) cannot be deleted",
    );
    refused(&[i, "dir"], "not the root of a subvolume");
    refused(&[i, "outer/file"], "not the root of a subvolume");
    refused(&[i, "outer"], "holds subvolume");
    refused(&[i, "nothing"], "not found");
    refused(&["--subvolid", "4242", i], "linked nowhere");
    let def = subvol_id(&img, "def").to_string();
    butter_ok(&["subvolume", "set-default", i, "def"]);
    refused(&["--subvolid", &def, i], "is the default subvolume");
    refused(&[i, "/"], "top level");
    butter_ok(&["subvolume", "set-default", "--id", "5", i]);
    // Nothing was changed by the refusals; the deletes go through once allowed.
    let (rc, out) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check:\n{out}");
    kernel::assert_btrfs_check(&img);
    butter_ok(&["subvolume", "delete", i, "outer/inner"]);
    butter_ok(&["subvolume", "delete", i, "outer"]);
    butter_ok(&["subvolume", "delete", "--subvolid", &def, i]);
    let list = butter_ok(&["subvolume", "list", i]);
    assert!(list.trim().is_empty(), "{list}");
    let (rc, out) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check:\n{out}");
    kernel::assert_btrfs_check(&img);
}

/// With quotas on, the delete leaves the qgroup items (numbers marked inconsistent, as for
/// every change butter makes): `btrfs check` accepts it, and a rescan in the kernel gives
/// the deleted snapshot's qgroup nothing.
#[test]
fn delete_with_quotas_on() {
    need_oracle();
    let sc = ScratchDir::new("subvol-delete-quota");
    let img = sc.join("a.img");
    kernel::mkfs_btrfs::<&str>(&img, 512 << 20, &[]);
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        kernel::sh("btrfs", &["quota", "enable", s(p)]);
        kernel::sh("btrfs", &["subvolume", "create", s(&p.join("sv"))]);
        fill(&p.join("sv"), 8, 60);
        kernel::sh(
            "btrfs",
            &[
                "subvolume",
                "snapshot",
                s(&p.join("sv")),
                s(&p.join("snap")),
            ],
        );
        change(&p.join("snap"));
        m.unmount();
    }
    let snap = subvol_id(&img, "snap");
    butter_ok(&["subvolume", "delete", s(&img), "snap"]);
    let (rc, out) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check:\n{out}");
    kernel::assert_btrfs_check(&img);
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    kernel::sh("btrfs", &["quota", "rescan", "-w", s(m.path())]);
    let q = kernel::sh("btrfs", &["qgroup", "show", "--raw", s(m.path())]);
    let line = q
        .lines()
        .find(|l| l.starts_with(&format!("0/{snap} ")))
        .unwrap_or_else(|| panic!("no qgroup 0/{snap}:\n{q}"));
    let nums: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&nums[1..3], &["0", "0"], "after the rescan: {line}");
    assert!(!m.path().join("snap").exists());
    m.unmount();
    kernel::assert_btrfs_check(&img);
}
