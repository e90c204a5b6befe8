//! `butter::check` on `mkfs.btrfs --rootdir` images damaged in one place: an item edited in its
//! leaf (block group used bytes and flags, inode nlink and nbytes, dir indexes, extent and
//! back refs, the csum item, a root item), an item dropped from its leaf, a node pointing twice
//! at one child, and random bytes changed in tree blocks. Each must give the finding that names
//! the damaged item (and `btrfs check` must agree where it is asked); random damage must never
//! make the checker panic.
//!
//! The damage is done by editing raw tree blocks, which needs the on-disk format's internals
//! (item and key pointer layouts, header offsets, key types, the checksum slot): those are
//! crate-private, so these tests live inside the crate. The `butter check` command's exit code
//! and output on a damaged image stay tested in `crates/butter-cli/tests/check.rs`.
//!
//! They need only mkfs.btrfs and btrfs (no privileges): without them a test prints a notice
//! and passes, unless `CI` is set (then it fails).

use super::oracle_support::{btrfs_check, delete_leaf_item, have_progs, mkfs, Scratch};

use butter::check::{FindingKind, Report};
use butter::ctree::{Root, TreeIter};
use butter::format::csum::CSUM_SLOT;
use butter::format::*;
use butter::fs::Fs;
use butter::io::device::FileDevice;
use butter::io::disk_io::Readahead;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const IMAGE_SIZE: u64 = 256 << 20;

// ---------------------------------------------------------------------------------------------
// Images and damage

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

/// `mkfs.btrfs --rootdir` of the `make_rootdir` tree (made once per scratch dir), with `extra`
/// mkfs arguments.
fn rootdir_image(scratch: &Scratch, extra: &[&str]) -> PathBuf {
    let src = scratch.join("src");
    if !src.exists() {
        make_rootdir(&src);
    }
    let img = scratch.join(&format!("img{}.img", extra.join("")));
    let mut args = vec!["--rootdir", src.to_str().unwrap()];
    args.extend_from_slice(extra);
    mkfs(&img, IMAGE_SIZE, &args);
    img
}

/// The current root of tree `id` (from its root item).
fn tree_root(fs: &Fs, id: u64) -> Root {
    let ri = fs.find_root_item(id).unwrap().unwrap();
    Root {
        id,
        bytenr: ri.bytenr,
        level: ri.level,
        generation: ri.generation,
    }
}

/// Finds the first item of tree `id` matching `pred` (the last one if `last`), lets `edit`
/// change the block (`edit(block, item_header_offset, item_data_offset)`), recomputes the
/// block checksum and writes every copy (`butter::internals::rewrite_item`). Returns the item's
/// (key after edit, block, slot).
fn patch_item(
    img: &Path,
    id: u64,
    last: bool,
    pred: impl Fn(&Key, &[u8]) -> bool,
    edit: impl FnOnce(&mut [u8], usize, usize),
) -> (Key, u64, usize) {
    let dev = FileDevice::open(img, true).unwrap();
    butter::internals::rewrite_item(Arc::new(dev), id, last, pred, edit)
        .unwrap_or_else(|e| panic!("damaging an item of tree {id} in {}: {e}", img.display()))
}

/// Applies `edit` to tree block `bytenr`, recomputes its checksum and writes every copy.
/// Returns the original bytes of every copy (physical offset, bytes) to undo the damage.
fn patch_block(img: &Path, bytenr: u64, edit: impl FnOnce(&mut [u8])) -> Vec<(u64, Vec<u8>)> {
    let dev = FileDevice::open(img, true).unwrap();
    butter::internals::rewrite_block(Arc::new(dev), bytenr, edit).unwrap()
}

fn add_u64(b: &mut [u8], off: usize, delta: u64) {
    let v = le_u64(b, off).wrapping_add(delta);
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Checking

fn check_lib(img: &Path) -> Report {
    let fs = Fs::open(img).unwrap();
    fs.check(Default::default(), &mut |_| {}).unwrap()
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

// ---------------------------------------------------------------------------------------------
// Items edited in place

#[test]
fn damaged_block_group_used() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-bg");
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
}

#[test]
fn damaged_nlink_and_nbytes() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-nlink");
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
    let scratch = Scratch::new("check-dirindex");
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
    let scratch = Scratch::new("check-refs");
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
fn damaged_metadata_backref() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-mdref");
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
    let scratch = Scratch::new("check-dataref");
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
    let scratch = Scratch::new("check-csum");
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

#[test]
fn damaged_block_in_two_places() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-twice");
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

#[test]
fn damaged_block_group_flags() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-bgflags");
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

// ---------------------------------------------------------------------------------------------
// Blocks edited in place, items dropped

#[test]
fn damaged_node_points_twice() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-dupptr");
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

/// Random bytes changed inside tree blocks (checksums recomputed so the damage gets past the
/// checksum): the checker reports or errors, but never panics.
#[test]
fn random_block_damage_never_panics() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-fuzz");
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
            match fs.check(Default::default(), &mut |_| {}) {
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

#[test]
fn dropped_dir_index() {
    if !have_progs() {
        return;
    }
    let scratch = Scratch::new("check-dropindex");
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
    let (ok, _) = btrfs_check(&img);
    assert!(!ok, "btrfs check should also see the dropped index");
}
