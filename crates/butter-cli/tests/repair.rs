//! `butter check --repair`: a healthy kernel-made image damaged in one way per repair kind
//! (one item rewritten in place, its block resealed), then repaired. Each time both checkers
//! find the damage first and nothing after, and the kernel mounts the repaired image and
//! shows every file as it was. `--dry-run` prints the plan and leaves the image's bytes as
//! they were. A repair that would leave new problems writing nothing is the engine's test
//! (`crates/butter/src/tests/repair.rs`), where a wrong fix can be planted.
//!
//! Needs root, loop devices and btrfs-progs: without them the test prints a notice and
//! passes, unless CI is set (then it fails).

mod common;

use common::damage::{ondisk, patch_item};
use common::fuse_mount;
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Manifest, TakeOpts};
use common::{output_text as text, run_butter as butter};
use std::fs;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;
const FS_TREE: u64 = 5;
const INODE_ITEM: u8 = 1;

fn take(dir: &Path) -> Manifest {
    manifest::take(dir, &TakeOpts::default())
}

/// The kernel's view of the image's files (a read-only loop mount).
fn kernel_files(img: &Path, s: &ScratchDir, name: &str) -> Manifest {
    let m = LoopMount::btrfs_ro(img, &s.dir(name));
    let man = take(m.path());
    m.unmount();
    man
}

/// A kernel-made image with a directory of files, a hard link, an inline file and a symlink:
/// inode 257 is directory `d`, 258 its file `a` (two links), 259 its file `b`.
fn healthy(s: &ScratchDir) -> PathBuf {
    let img = s.join("healthy.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &[] as &[&str]);
    let m = LoopMount::btrfs(&img, &s.dir("fill"), "");
    let d = m.path().join("d");
    fs::create_dir(&d).unwrap();
    fs::write(
        d.join("a"),
        (0..100_000u32).map(|x| x as u8).collect::<Vec<u8>>(),
    )
    .unwrap();
    fs::write(d.join("b"), vec![7u8; 5000]).unwrap();
    fs::write(m.path().join("small"), b"inline\n").unwrap();
    fs::hard_link(d.join("a"), m.path().join("hl")).unwrap();
    std::os::unix::fs::symlink("d/b", m.path().join("link")).unwrap();
    m.unmount();
    img
}

/// Rewrites a u64 (`width` 8) or u32 (4) field at `at` of the first item `pick` chooses.
fn damage(
    img: &Path,
    tree: u64,
    pick: impl Fn(&butter::format::Key) -> bool,
    at: usize,
    width: usize,
    f: impl FnOnce(u64) -> u64,
) {
    patch_item(
        img,
        tree,
        false,
        |k, _| pick(k),
        |blk, _, d| {
            let p = d + at;
            let old = if width == 8 {
                u64::from_le_bytes(blk[p..p + 8].try_into().unwrap())
            } else {
                u64::from(u32::from_le_bytes(blk[p..p + 4].try_into().unwrap()))
            };
            let new = f(old);
            if width == 8 {
                blk[p..p + 8].copy_from_slice(&new.to_le_bytes());
            } else {
                blk[p..p + 4].copy_from_slice(&(new as u32).to_le_bytes());
            }
        },
    );
}

fn inode(ino: u64) -> impl Fn(&butter::format::Key) -> bool {
    move |k| k.objectid == ino && k.ty == INODE_ITEM
}

#[test]
fn each_repair_kind_mends_one_damage_and_the_kernel_sees_the_files_as_before() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair");
    let base = healthy(&s);
    let want = kernel_files(&base, &s, "before");
    type Damage = Box<dyn Fn(&Path)>;
    // (name, the finding both checkers must report, the damage)
    let cases: Vec<(&str, &str, Damage)> = vec![
        (
            "block-group-used",
            "BlockGroupUsedMismatch",
            Box::new(|p: &Path| {
                damage(
                    p,
                    ondisk::EXTENT_TREE,
                    |k| k.ty == ondisk::BLOCK_GROUP_ITEM,
                    0,
                    8,
                    |u| u + 4096,
                )
            }),
        ),
        (
            "nbytes",
            "NbytesMismatch",
            // nbytes: byte 24 of the inode item.
            Box::new(|p: &Path| damage(p, FS_TREE, inode(258), 24, 8, |n| n + 4096)),
        ),
        (
            "dir-isize",
            "DirSizeMismatch",
            // size: byte 16.
            Box::new(|p: &Path| damage(p, FS_TREE, inode(257), 16, 8, |n| n + 6)),
        ),
        (
            "nlink",
            "NlinkMismatch",
            // nlink: byte 40, a u32; file `a` has two names.
            Box::new(|p: &Path| damage(p, FS_TREE, inode(258), 40, 4, |_| 1)),
        ),
    ];
    for (name, finding, hurt) in &cases {
        let img = s.join(format!("{name}.img"));
        fs::copy(&base, &img).unwrap();
        hurt(&img);
        let (ok, t) = kernel::btrfs_check(&img);
        assert!(!ok, "{name}: btrfs check found nothing:\n{t}");
        let o = butter(&["check", img.to_str().unwrap()]);
        assert!(!o.status.success(), "{name}: butter check found nothing");
        assert!(
            text(&o).contains(finding),
            "{name}: no {finding}:\n{}",
            text(&o)
        );

        if *name == "nbytes" {
            // The plan, and not a byte changed.
            let bytes = fs::read(&img).unwrap();
            let o = butter(&["check", "--repair", "--dry-run", img.to_str().unwrap()]);
            assert!(o.status.success(), "{name} dry run: {}", text(&o));
            assert!(
                text(&o).contains("nbytes to"),
                "{name} dry run:\n{}",
                text(&o)
            );
            assert!(
                fs::read(&img).unwrap() == bytes,
                "the dry run wrote to the image"
            );
        }

        let o = butter(&["check", "--repair", img.to_str().unwrap()]);
        assert!(o.status.success(), "{name}: repair:\n{}", text(&o));
        assert!(
            text(&o).contains("0 after"),
            "{name}: repair:\n{}",
            text(&o)
        );
        let (rc, t) = fuse_mount::butter_check(&img);
        assert_eq!(rc, 0, "{name}: butter check after the repair:\n{t}");
        let (ok, t) = kernel::btrfs_check(&img);
        assert!(ok, "{name}: btrfs check after the repair:\n{t}");
        let got = kernel_files(&img, &s, &format!("{name}-after"));
        manifest::assert_same(
            &want,
            &got,
            &CompareOpts::all(),
            &format!("{name}: the kernel's files after the repair"),
        );
    }
}

#[test]
fn a_clean_image_is_left_as_it_is() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-clean");
    let img = healthy(&s);
    let bytes = fs::read(&img).unwrap();
    let o = butter(&["check", "--repair", img.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("0 problems"), "{}", text(&o));
    assert!(
        fs::read(&img).unwrap() == bytes,
        "a repair of a clean image wrote to it"
    );
}
