//! `butter check`: clean images (mkfs.btrfs --rootdir, and one written by the kernel with
//! hardlinks, subvolumes, snapshots, compression, reflinks and preallocation) must check clean,
//! agreeing with `btrfs check --readonly`; a damaged image must make the command fail and name
//! the finding.
//!
//! The library checker's findings on images damaged in one item or block are tested inside the
//! engine crate (`crates/butter/src/tests/check_damage.rs`), where the on-disk format's
//! internals the damage needs are reachable.
//!
//! mkfs.btrfs --rootdir needs no privileges. The kernel-populated image needs root and loop
//! devices: without them the test prints a notice and passes, unless CI is set (then it fails).

mod common;

use butter::check::Report;
use butter::fs::Fs;
use common::damage::patch_item;
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const IMAGE_SIZE: u64 = 256 << 20;

/// True when mkfs.btrfs and btrfs are on PATH (CI: must be).
fn have_progs() -> bool {
    let ok = Command::new("mkfs.btrfs").arg("--version").output().is_ok()
        && Command::new("btrfs").arg("--version").output().is_ok();
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("mkfs.btrfs/btrfs missing (CI is set, so this is an error rather than a skip)");
        }
        eprintln!("SKIPPED: mkfs.btrfs/btrfs not installed");
    }
    ok
}

/// A small tree: files, a hardlink, a symlink, nested directories, one larger file.
fn make_rootdir(dir: &Path) {
    fs::create_dir_all(dir.join("d1/d2")).unwrap();
    fs::write(dir.join("a"), b"hello\n").unwrap();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    fs::write(dir.join("big"), &big).unwrap();
    fs::hard_link(dir.join("a"), dir.join("d1/hard")).unwrap();
    std::os::unix::fs::symlink("a", dir.join("link")).unwrap();
    for i in 0..60 {
        fs::write(dir.join(format!("d1/d2/file_{i}")), format!("{i}\n")).unwrap();
    }
}

fn rootdir_image(scratch: &ScratchDir, extra: &[&str]) -> PathBuf {
    let src = scratch.join("src");
    if !src.exists() {
        make_rootdir(&src);
    }
    let img = scratch.join(format!("img{}.img", extra.join("")));
    let mut args = vec!["--rootdir", src.to_str().unwrap()];
    args.extend_from_slice(extra);
    kernel::mkfs_btrfs(&img, IMAGE_SIZE, &args);
    img
}

fn run_butter_check(img: &Path) -> (i32, String) {
    let out = Command::new(BUTTER).arg("check").arg(img).output().unwrap();
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), s)
}

fn assert_clean(img: &Path) {
    let (rc, out) = run_butter_check(img);
    assert_eq!(rc, 0, "butter check {} not clean:\n{out}", img.display());
    assert!(out.contains("[6/6]"), "no phase summaries:\n{out}");
    kernel::assert_btrfs_check(img);
}

fn check_lib(img: &Path) -> Report {
    let fs = Fs::open(img).unwrap();
    fs.check(Default::default(), &mut |_| {}).unwrap()
}

#[test]
fn rootdir_images_check_clean() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-rootdir");
    assert_clean(&rootdir_image(&scratch, &[]));
    assert_clean(&rootdir_image(&scratch, &["--nodesize", "4096"]));
}

/// The command on a damaged image: exit code 1 and the finding named. (The finding's exact
/// location is asserted on the library's report in the engine's `tests::check_damage`.)
#[test]
fn damaged_block_group_used() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-bg");
    let img = rootdir_image(&scratch, &[]);
    // The first block group item claims 4096 more used bytes than its extents add up to.
    patch_item(
        &img,
        common::damage::ondisk::EXTENT_TREE,
        false,
        |k, _| k.ty == common::damage::ondisk::BLOCK_GROUP_ITEM,
        |blk, _, d| {
            let used = u64::from_le_bytes(blk[d..d + 8].try_into().unwrap());
            blk[d..d + 8].copy_from_slice(&used.wrapping_add(4096).to_le_bytes());
        },
    );
    let (rc, out) = run_butter_check(&img);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("BlockGroupUsedMismatch"), "{out}");
}

#[test]
fn kernel_image_checks_clean() {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("check-kernel");
    let img = scratch.join("k.img");
    // 4 KiB nodes so that snapshots share multi-level trees and COW makes full back refs.
    kernel::mkfs_btrfs(&img, IMAGE_SIZE, &["--nodesize", "4096"]);
    {
        let m = LoopMount::btrfs(&img, &scratch.join("mnt"), "compress=zstd,max_inline=2048");
        let p = m.path().to_path_buf();
        let sh = |cmd: &str| kernel::sh("sh", &["-c", &format!("cd {} && {cmd}", p.display())]);
        sh("mkdir -p d/e && echo hi > d/a && ln d/a d/b && ln -s d/a sym");
        sh("head -c 1000000 /dev/urandom > r && yes hello | head -c 2000000 > comp");
        sh("yes abc | head -c 1500 > inl");
        sh("cp --reflink=always r d/r2 && cp --reflink=always comp comp2");
        sh("dd if=/dev/urandom of=r bs=4096 seek=10 count=3 conv=notrunc 2>/dev/null");
        sh("fallocate -l 100000 pre && chattr +C d/e && echo n > d/e/nocow");
        sh("btrfs -q subvolume create sv && mkdir sv/d && for i in $(seq 1 1500); do echo $i > sv/d/file_with_a_long_name_$i; done");
        sh("for i in $(seq 1 12); do head -c $((i*10000)) /dev/urandom > sv/data$i; done");
        sh("cp --reflink=always r sv/r3 && sync");
        sh("btrfs -q subvolume snapshot sv snap && btrfs -q subvolume snapshot sv snap2 && sync");
        sh("for i in $(seq 1 1500 7); do echo x >> snap/d/file_with_a_long_name_$i; rm sv/d/file_with_a_long_name_$((i+1)); done");
        sh("for i in $(seq 1 12 3); do cp --reflink=always snap/data$i sv/ref$i; dd if=/dev/zero of=snap2/data$i bs=4096 count=1 seek=1 conv=notrunc 2>/dev/null; done");
        sh("sync && btrfs -q subvolume snapshot snap snap3 && echo q >> snap3/d/file_with_a_long_name_2");
        sh("ln snap3/r3 snap3/r3_hard && mv snap3/data2 snap3/d/moved");
        m.unmount();
    }
    // The image exercises shared (full) back references of both kinds.
    let extents = kernel::dump_tree(&img, &["-t", "extent"]);
    assert!(
        extents.contains("shared block backref"),
        "no shared block refs"
    );
    assert!(
        extents.contains("shared data backref"),
        "no shared data refs"
    );
    assert_clean(&img);
    let r = check_lib(&img);
    assert!(
        r.counts.data_extents > 10 && r.counts.trees >= 10,
        "{:?}",
        r.counts
    );
}

/// The oracle harness's variant images (populated by the kernel: big directories, many links,
/// xattrs, holes, compression per variant) check clean. `BUTTER_CHECK_VARIANTS` picks variants
/// (comma-separated or `all`; default `defaults,nodesize-4k,csum-xxhash,no-fst`).
#[test]
fn variant_images_check_clean() {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("check-variants");
    for v in common::variant::variants_from_env(
        "BUTTER_CHECK_VARIANTS",
        "defaults,nodesize-4k,csum-xxhash,no-fst",
    ) {
        let img = common::variant::build_variant_image(v, scratch.path(), 7);
        assert_clean(&img);
        let _ = fs::remove_file(&img);
    }
}
