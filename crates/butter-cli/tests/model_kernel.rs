//! The model-based test harness (tests/common/model.rs) proven against the kernel: seeded
//! random sequences of POSIX operations go to the in-memory model and to a real filesystem,
//! which must return the errno the model predicts for every op and show the tree the model
//! predicts at every checkpoint.
//!
//! - `kernel_btrfs_matches_model`: a kernel btrfs loop mount (4 KiB nodes, so trees grow
//!   levels quickly): 3 rounds of 2000 mixed ops, a phase that grows one directory to 3000
//!   entries, 1000 more mixed ops, then unmount, `btrfs check`, remount and compare again.
//! - `tmpfs_matches_model`: the same harness on a tmpfs (no btrfs directory sizes, no
//!   ZERO_RANGE), to show it does not depend on btrfs.
//! - `model_is_deterministic`: no privileges needed; the same seed gives the same ops and the
//!   same tree, and the model's own invariants hold throughout.
//!
//! The kernel tests need root, loop devices and kernel btrfs: without them they print a notice
//! and pass, except when `CI` is set, where they fail.
//!
//! Environment: `BUTTER_MODEL_SEED` (decimal or 0x-hex) replaces the fixed seed;
//! `BUTTER_MODEL_ROUNDS` the number of 2000-op rounds on btrfs (default 3);
//! `BUTTER_MODEL_TRACE` prints every op.

mod common;

use common::gen::Rng;
use common::kernel::{
    assert_btrfs_check, dump_tree, mkfs_btrfs, remount, require_privileges, LoopMount, ScratchDir,
    TmpfsMount,
};
use common::model::{
    compare, errno_name, generate, DirTarget, Flavor, Model, Op, OpKind, Profile, Runner,
};
use std::path::Path;
use std::time::Instant;

const SEED: u64 = 0x6d6f_6465_6c5f_0001;

fn seed() -> u64 {
    match std::env::var("BUTTER_MODEL_SEED") {
        Err(_) => SEED,
        Ok(s) => {
            let s = s.trim();
            let v = match s.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16),
                None => s.parse(),
            };
            v.unwrap_or_else(|e| panic!("BUTTER_MODEL_SEED={s:?}: {e}"))
        }
    }
}

fn rounds() -> u64 {
    std::env::var("BUTTER_MODEL_ROUNDS")
        .ok()
        .map(|s| s.parse().expect("BUTTER_MODEL_ROUNDS is a number"))
        .unwrap_or(3)
}

/// The level of the fs tree's root node, from `btrfs inspect-internal dump-tree -t fs`.
fn fs_tree_level(dump: &str) -> u32 {
    dump.lines()
        .find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["node" | "leaf", _, "level", n, ..] => n.parse().ok(),
                _ => None,
            }
        })
        .unwrap_or_else(|| panic!("no root node in dump-tree -t fs:\n{dump}"))
}

/// Panics unless every (op kind, result) in `want` was seen: the generator must keep covering
/// the error paths it promises.
fn assert_covers(r: &Runner, want: &[(OpKind, &str)]) {
    let seen = r.outcomes();
    let missing: Vec<String> = want
        .iter()
        .filter(|(k, e)| !seen.contains(&(*k, e.to_string())))
        .map(|(k, e)| format!("{k:?} {e}"))
        .collect();
    assert!(
        missing.is_empty(),
        "seed {:#x}: outcomes never produced: {missing:?}\nstats:\n{}",
        r.seed(),
        r.stats()
    );
}

#[test]
fn kernel_btrfs_matches_model() {
    if !require_privileges() {
        return;
    }
    let t0 = Instant::now();
    let scratch = ScratchDir::new("model-btrfs");
    let img = scratch.join("btrfs.img");
    mkfs_btrfs(&img, 2 << 30, &["-n", "4096"]);
    let mnt = scratch.dir("mnt");
    let mount = LoopMount::btrfs(&img, &mnt, "noatime");
    let target = DirTarget::new(&mnt, "kernel btrfs");
    let mut r = Runner::new(seed(), Flavor::BTRFS, vec![Box::new(target)]);

    let mixed = Profile::mixed();
    for round in 1..=rounds() {
        for _ in 0..4 {
            r.run(&mixed, 500);
            let label = format!("round {round}, {} ops", r.ops());
            r.checkpoint(&label);
        }
        eprintln!(
            "round {round}: {} ops, {:.1} s; model: {}",
            r.ops(),
            t0.elapsed().as_secs_f64(),
            r.model.summary()
        );
    }

    // One directory with thousands of entries: its DIR_ITEMs, DIR_INDEXes and INODE_REFs fill
    // many leaves, so the fs tree grows levels.
    let big = Path::new("big");
    r.apply(&Op::Mkdir {
        path: big.into(),
        mode: 0o755,
    })
    .expect("mkdir big");
    let grow = Profile::big_dir(big);
    let start = r.ops();
    while r.model.dir_len(big).unwrap_or(0) < 3000 {
        assert!(
            r.ops() - start < 20_000,
            "seed {:#x}: `big` does not grow: {:?} entries",
            r.seed(),
            r.model.dir_len(big)
        );
        r.step(&grow).ok();
    }
    r.checkpoint("big directory");
    eprintln!(
        "big directory: {} entries, {} ops, {:.1} s",
        r.model.dir_len(big).unwrap_or(0),
        r.ops(),
        t0.elapsed().as_secs_f64()
    );
    r.run(&mixed, 1000);
    r.checkpoint("mixed ops after the big directory");

    // One inode with hundreds of long names in one directory: more than an INODE_REF item
    // holds, so btrfs adds INODE_EXTREF items.
    let links = Path::new("links");
    r.apply(&Op::Mkdir {
        path: links.into(),
        mode: 0o755,
    })
    .expect("mkdir links");
    r.apply(&Op::Create {
        path: links.join("hub"),
        mode: 0o644,
    })
    .expect("create links/hub");
    r.run(&Profile::hardlinks(links), 1000);
    r.checkpoint("hard links");
    r.run(&mixed, 500);
    r.checkpoint("mixed ops after the hard links");

    mount.unmount();
    assert_btrfs_check(&img);
    let dump = dump_tree(&img, &["-t", "fs"]);
    let level = fs_tree_level(&dump);
    assert!(level >= 2, "fs tree root is level {level}, expected >= 2");
    let extrefs = dump.matches("INODE_EXTREF").count();
    assert!(extrefs > 0, "no INODE_EXTREF items in the fs tree");
    let mount = LoopMount::btrfs(&img, &mnt, "noatime");
    r.checkpoint("after unmount, btrfs check and mount");
    mount.unmount();

    eprintln!(
        "kernel btrfs: {} ops, fs tree level {level}, {extrefs} INODE_EXTREF items, {:.1} s in all\n{}",
        r.ops(),
        t0.elapsed().as_secs_f64(),
        r.stats()
    );
    use OpKind::*;
    assert_covers(
        &r,
        &[
            (Create, "Ok"),
            (Create, "EEXIST"),
            (Create, "ENOENT"),
            (Create, "ENOTDIR"),
            (Create, "ENAMETOOLONG"),
            (Mkdir, "EEXIST"),
            (Mknod, "Ok"),
            (Symlink, "Ok"),
            (Symlink, "ENOENT"),
            (Link, "Ok"),
            (Link, "EPERM"),
            (Link, "EEXIST"),
            (Unlink, "Ok"),
            (Unlink, "EISDIR"),
            (Rmdir, "Ok"),
            (Rmdir, "ENOTEMPTY"),
            (Rmdir, "ENOTDIR"),
            (Rename, "Ok"),
            (Rename, "EEXIST"),
            (Rename, "ENOENT"),
            (Rename, "EINVAL"),
            (Rename, "EISDIR"),
            (Rename, "ENOTDIR"),
            (Write, "Ok"),
            (Write, "EISDIR"),
            (Write, "ELOOP"),
            (Truncate, "Ok"),
            (Fallocate, "Ok"),
            (Fallocate, "EINVAL"),
            (Fallocate, "EOPNOTSUPP"),
            (Chmod, "Ok"),
            (Chmod, "EOPNOTSUPP"),
            (Chown, "Ok"),
            (Utimens, "Ok"),
            (SetXattr, "Ok"),
            (SetXattr, "EPERM"),
            (SetXattr, "EEXIST"),
            (SetXattr, "ENODATA"),
            (RemoveXattr, "Ok"),
            (RemoveXattr, "ENODATA"),
        ],
    );
}

#[test]
fn tmpfs_matches_model() {
    if !require_privileges() {
        return;
    }
    let t0 = Instant::now();
    let scratch = ScratchDir::new("model-tmpfs");
    let mnt = scratch.dir("mnt");
    let fs = TmpfsMount::new(&mnt, 512 << 20);
    remount(&mnt, "noatime");
    let target = DirTarget::new(&mnt, "tmpfs");
    let mut r = Runner::new(seed() ^ 0x7e57, Flavor::TMPFS, vec![Box::new(target)]);
    let mixed = Profile::mixed();
    for i in 0..2 {
        r.run(&mixed, 1000);
        r.checkpoint(&format!("tmpfs part {i}"));
    }
    fs.unmount();
    eprintln!(
        "tmpfs: {} ops, {:.1} s\n{}",
        r.ops(),
        t0.elapsed().as_secs_f64(),
        r.stats()
    );
    assert!(r.outcomes().contains(&(OpKind::Fallocate, errno_name(95))));
}

#[test]
fn model_is_deterministic() {
    let p = Profile::mixed();
    let (mut ra, mut rb) = (Rng::new(seed()), Rng::new(seed()));
    let (mut a, mut b) = (Model::new(Flavor::BTRFS), Model::new(Flavor::BTRFS));
    for i in 0..4000 {
        let (x, y) = (generate(&mut ra, &a, &p), generate(&mut rb, &b, &p));
        assert_eq!(x, y, "op #{i}");
        assert_eq!(a.apply(&x), b.apply(&y), "op #{i}: {x}");
        if i % 250 == 0 {
            a.check()
                .unwrap_or_else(|e| panic!("after op #{i} ({x}): {e}"));
        }
    }
    a.check().unwrap();
    let d = compare(&a, &b.manifest());
    assert!(d.is_empty(), "{}", d.join("\n"));
}
