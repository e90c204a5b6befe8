//! `butter check`: clean images (mkfs.btrfs --rootdir, and one written by the kernel with
//! hardlinks, subvolumes, snapshots, compression, reflinks and preallocation) must check clean,
//! agreeing with `btrfs check --readonly`; images damaged in one item must give the finding
//! that names that item.
//!
//! mkfs.btrfs --rootdir needs no privileges. The kernel-populated image needs root and loop
//! devices: without them the test prints a notice and passes, unless CI is set (then it fails).

mod common;

use butter::check::{check, FindingKind, Report};
use butter::ctree::TreeIter;
use butter::format::csum::CSUM_SLOT;
use butter::format::*;
use butter::fs::Fs;
use butter::io::disk_io::Readahead;
use common::damage::{patch_item, tree_root};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::os::unix::fs::FileExt;
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
    check(&fs, &mut |_| {}).unwrap()
}

fn add_u64(b: &mut [u8], off: usize, delta: u64) {
    let v = le_u64(b, off).wrapping_add(delta);
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Asserts a finding of `kind` located at exactly (block, slot, key).
fn assert_finding(r: &Report, kind: FindingKind, key: Key, block: u64, slot: usize) {
    let ok = r.findings.iter().any(|f| {
        f.kind == kind
            && f.location.key == Some(key)
            && f.location.bytenr == Some(block)
            && f.location.slot == Some(slot)
    });
    assert!(
        ok,
        "expected {kind:?} at block {block} slot {slot} key {key}, got:\n{}",
        r.findings
            .iter()
            .map(|f| f.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
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

#[test]
fn damaged_block_group_used() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-bg");
    let img = rootdir_image(&scratch, &[]);
    let (key, b, s) = patch_item(
        &img,
        EXTENT_TREE_OBJECTID,
        false,
        |k, _| k.ty == BLOCK_GROUP_ITEM_KEY,
        |blk, _, d| add_u64(blk, d, 4096),
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::BlockGroupUsedMismatch, key, b, s);
    let (rc, out) = run_butter_check(&img);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("BlockGroupUsedMismatch"), "{out}");
}

#[test]
fn damaged_nlink_and_nbytes() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-nlink");
    let img = rootdir_image(&scratch, &["--nodesize", "4096"]);
    // The inode of "a", the one regular file with two links.
    let (key, b, s) = patch_item(
        &img,
        FS_TREE_OBJECTID,
        false,
        |k, d| k.ty == INODE_ITEM_KEY && le_u32(d, 40) == 2 && le_u32(d, 52) & 0o170000 == 0o100000,
        |blk, _, d| {
            let off = d + 40;
            let v = le_u32(blk, off) + 1;
            blk[off..off + 4].copy_from_slice(&v.to_le_bytes());
            add_u64(blk, d + 24, 4096);
        },
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::NlinkMismatch, key, b, s);
    assert_finding(&r, FindingKind::NbytesMismatch, key, b, s);
}

#[test]
fn damaged_dir_index() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-dirindex");
    let img = rootdir_image(&scratch, &[]);
    // Move the last DIR_INDEX of the root directory to another index (key order is kept: the
    // next key belongs to inode 257). Its inode's ref then names an index that does not exist.
    let (key, b, s) = patch_item(
        &img,
        FS_TREE_OBJECTID,
        true,
        |k, _| k.ty == DIR_INDEX_KEY && k.objectid == 256,
        |blk, h, _| add_u64(blk, h + 9, 1000),
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::DirEntryWithoutInodeRef, key, b, s);
    assert!(
        r.has(FindingKind::InodeRefWithoutDirIndex),
        "{:?}",
        r.findings
    );
}

#[test]
fn damaged_data_extent_refs() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-refs");
    let img = rootdir_image(&scratch, &[]);
    let (key, b, s) = patch_item(
        &img,
        EXTENT_TREE_OBJECTID,
        false,
        |k, _| k.ty == EXTENT_ITEM_KEY && k.offset > 16384,
        |blk, _, d| add_u64(blk, d, 1),
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::ExtentRefsMismatch, key, b, s);
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

#[test]
fn damaged_metadata_backref() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-mdref");
    let img = rootdir_image(&scratch, &[]);
    // The inline TREE_BLOCK_REF of the fs tree's root block names another root.
    let fs_root = {
        let fs = Fs::open(&img).unwrap();
        fs.find_root_item(FS_TREE_OBJECTID).unwrap().unwrap().bytenr
    };
    let (key, b, s) = patch_item(
        &img,
        EXTENT_TREE_OBJECTID,
        false,
        |k, d| {
            k.objectid == fs_root
                && k.ty == METADATA_ITEM_KEY
                && d.len() == 33
                && d[24] == TREE_BLOCK_REF_KEY
        },
        |blk, _, d| add_u64(blk, d + 25, 1000),
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::MetadataBackrefExtra, key, b, s);
    assert!(
        r.has(FindingKind::MetadataBackrefMissing),
        "{:?}",
        r.findings
    );
}

#[test]
fn damaged_data_backref() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-dataref");
    let img = rootdir_image(&scratch, &[]);
    // The inline EXTENT_DATA_REF of "big"'s extent names another file offset.
    let (key, b, s) = patch_item(
        &img,
        EXTENT_TREE_OBJECTID,
        false,
        |k, d| k.ty == EXTENT_ITEM_KEY && d.len() >= 53 && d[24] == EXTENT_DATA_REF_KEY,
        |blk, _, d| add_u64(blk, d + 25 + 16, 4096),
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::DataBackrefMismatch, key, b, s);
}

#[test]
fn damaged_csum_coverage() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-csum");
    let img = rootdir_image(&scratch, &[]);
    // Move the (only, last) csum item far away: the data extent loses its csums.
    let (_, _, _) = patch_item(
        &img,
        CSUM_TREE_OBJECTID,
        true,
        |k, _| k.ty == EXTENT_CSUM_KEY,
        |blk, h, _| add_u64(blk, h + 9, 1 << 40),
    );
    let r = check_lib(&img);
    let f = r
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::CsumMissing)
        .unwrap_or_else(|| panic!("no CsumMissing in {:?}", r.findings));
    assert_eq!(f.location.key.map(|k| k.ty), Some(INODE_ITEM_KEY), "{f}");
}

/// Applies `edit` to tree block `bytenr`, recomputes its checksum and writes every copy.
/// Returns the original bytes of every copy (physical offset, bytes) to undo the damage.
fn patch_block(img: &Path, bytenr: u64, edit: impl FnOnce(&mut [u8])) -> Vec<(u64, Vec<u8>)> {
    let dev = butter::io::device::FileDevice::open(img, true).unwrap();
    butter::inspect::rewrite_block(std::sync::Arc::new(dev), bytenr, edit).unwrap()
}

#[test]
fn damaged_node_points_twice() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-dupptr");
    let img = rootdir_image(&scratch, &["--nodesize", "4096"]);
    let (root, level) = {
        let fs = Fs::open(&img).unwrap();
        let ri = fs.find_root_item(FS_TREE_OBJECTID).unwrap().unwrap();
        (ri.bytenr, ri.level)
    };
    assert!(
        level >= 1,
        "the fs tree should have a node with 60 files and 4k nodes"
    );
    // Slot 1 of the root node points at slot 0's child (keys and generations left alone).
    let p0 = HEADER_SIZE + DISK_KEY_SIZE;
    let p1 = HEADER_SIZE + KEY_PTR_SIZE + DISK_KEY_SIZE;
    patch_block(&img, root, |b| {
        let v = le_u64(b, p0);
        b[p1..p1 + 8].copy_from_slice(&v.to_le_bytes());
    });
    let r = check_lib(&img);
    let ok = r.findings.iter().any(|f| {
        f.kind == FindingKind::TreeBlockDuplicatePointer
            && f.location.bytenr == Some(root)
            && f.location.slot == Some(1)
    });
    assert!(ok, "{:?}", r.findings);
}

#[test]
fn damaged_block_in_two_places() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-twice");
    let img = rootdir_image(&scratch, &["--nodesize", "4096"]);
    // The fs tree's root item is made to point at the csum tree's root block (whose extent
    // item only names the csum tree).
    let csum_root = {
        let fs = Fs::open(&img).unwrap();
        let ri = fs.find_root_item(CSUM_TREE_OBJECTID).unwrap().unwrap();
        assert_eq!(ri.level, 0, "csum tree of a small image is one leaf");
        ri.bytenr
    };
    let (key, b, s) = patch_item(
        &img,
        ROOT_TREE_OBJECTID,
        false,
        |k, _| k.objectid == FS_TREE_OBJECTID && k.ty == ROOT_ITEM_KEY,
        |blk, _, d| {
            // RootItem: inode item (160), generation (8), root_dirid (8), bytenr (8); level at
            // 238. Generation must match the csum block's, so copy the whole pointer identity.
            blk[d + 176..d + 184].copy_from_slice(&csum_root.to_le_bytes());
            blk[d + 238] = 0;
        },
    );
    let r = check_lib(&img);
    // The block is the root of two trees; its extent item only explains the csum tree.
    assert!(
        r.findings
            .iter()
            .any(|f| f.kind == FindingKind::MetadataBackrefMissing
                && f.location.bytenr == Some(csum_root)
                && f.message.contains("root of tree 5")),
        "{:?}",
        r.findings
    );
    // The fs tree's old blocks are now reached by no tree.
    assert!(r.has(FindingKind::OrphanMetadataExtent), "{:?}", r.findings);
    // The root item named: the finding above is about the pointer the damaged item holds.
    let _ = (key, b, s);
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

#[test]
fn damaged_block_group_flags() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-bgflags");
    let img = rootdir_image(&scratch, &[]);
    // The data block group claims the DUP profile; its chunk is SINGLE.
    let (key, b, s) = patch_item(
        &img,
        EXTENT_TREE_OBJECTID,
        false,
        |k, d| k.ty == BLOCK_GROUP_ITEM_KEY && le_u64(d, 16) & BLOCK_GROUP_DATA != 0,
        |blk, _, d| blk[d + 16] ^= BLOCK_GROUP_DUP as u8,
    );
    let r = check_lib(&img);
    assert_finding(&r, FindingKind::BlockGroupChunkMismatch, key, b, s);
}

/// Random bytes changed inside tree blocks (checksums recomputed so the damage gets past the
/// checksum): the checker reports or errors, but never panics.
#[test]
fn random_block_damage_never_panics() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-fuzz");
    let img = rootdir_image(&scratch, &["--nodesize", "4096"]);
    let blocks: Vec<u64> = {
        let fs = Fs::open(&img).unwrap();
        let mut v = Vec::new();
        let mut it = TreeIter::new(
            fs.disk().clone(),
            tree_root(&fs, EXTENT_TREE_OBJECTID),
            Key::MIN,
            Readahead::None,
        )
        .unwrap();
        while let Some(item) = it.next_item().unwrap() {
            if item.key.ty == METADATA_ITEM_KEY {
                v.push(item.key.objectid);
            }
        }
        v
    };
    assert!(!blocks.is_empty());
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut found = 0;
    for _ in 0..1500 {
        let b = blocks[(next() % blocks.len() as u64) as usize];
        let off = CSUM_SLOT + (next() % (4096 - CSUM_SLOT as u64)) as usize;
        let val = next() as u8;
        let undo = patch_block(&img, b, |blk| blk[off] = val);
        if let Ok(fs) = Fs::open(&img) {
            match check(&fs, &mut |_| {}) {
                Ok(r) if !r.is_clean() => found += 1,
                _ => {}
            }
        }
        let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
        for (phys, orig) in undo {
            f.write_all_at(&orig, phys).unwrap();
        }
    }
    eprintln!("{found} of 1500 damaged images gave findings");
    assert!(found > 100, "only {found} damaged images gave findings");
}

/// Removes leaf item `slot` from `blk` (item data packed again, later headers moved down).
fn delete_leaf_item(blk: &mut [u8], slot: usize) {
    let n = le_u32(blk, 96) as usize;
    let hdr = |i: usize| HEADER_SIZE + i * ITEM_SIZE;
    let off = |b: &[u8], i: usize| le_u32(b, hdr(i) + 17) as usize;
    let size_i = le_u32(blk, hdr(slot) + 21) as usize;
    let off_i = off(blk, slot);
    if slot + 1 < n {
        let off_last = off(blk, n - 1);
        blk.copy_within(
            HEADER_SIZE + off_last..HEADER_SIZE + off_i,
            HEADER_SIZE + off_last + size_i,
        );
        for j in slot + 1..n {
            let v = (off(blk, j) + size_i) as u32;
            blk[hdr(j) + 17..hdr(j) + 21].copy_from_slice(&v.to_le_bytes());
        }
        blk.copy_within(hdr(slot + 1)..hdr(n), hdr(slot));
    }
    blk[96..100].copy_from_slice(&((n - 1) as u32).to_le_bytes());
}

#[test]
fn dropped_dir_index() {
    if !have_progs() {
        return;
    }
    let scratch = ScratchDir::new("check-dropindex");
    let img = rootdir_image(&scratch, &[]);
    let child = std::cell::Cell::new(0u64);
    let (_, b, _) = patch_item(
        &img,
        FS_TREE_OBJECTID,
        true,
        |k, _| k.ty == DIR_INDEX_KEY && k.objectid == 256,
        |blk, h, d| {
            child.set(le_u64(blk, d));
            let slot = (h - HEADER_SIZE) / ITEM_SIZE;
            assert!(slot > 0);
            delete_leaf_item(blk, slot);
        },
    );
    let child = child.get();
    let r = check_lib(&img);
    let at = |kind: FindingKind, objectid: u64, ty: u8| {
        r.findings.iter().any(|f| {
            f.kind == kind
                && f.location.bytenr.is_some()
                && f.location
                    .key
                    .is_some_and(|k| k.objectid == objectid && k.ty == ty)
        })
    };
    assert!(
        at(FindingKind::DirItemWithoutIndex, 256, DIR_ITEM_KEY),
        "{:?}",
        r.findings
    );
    assert!(
        at(FindingKind::InodeRefWithoutDirIndex, child, INODE_REF_KEY),
        "{:?}",
        r.findings
    );
    assert!(
        at(FindingKind::DirSizeMismatch, 256, INODE_ITEM_KEY),
        "{:?}",
        r.findings
    );
    let _ = b;
    let (ok, _) = kernel::btrfs_check(&img);
    assert!(!ok, "btrfs check should also see the dropped index");
}
