//! `butter::check` findings for the free space tree, dev extents, subvolume root refs and file
//! extent ranges: images damaged in one item give exactly the finding that names that item;
//! kernel-made images (fragmented free space in bitmaps, subvolumes, snapshots, holes) check
//! clean, agreeing with `btrfs check`.
//!
//! The `mkfs_*` tests need only mkfs.btrfs; the `kernel_*` ones need root and loop devices
//! (skipped with a notice without them, a failure when `CI` is set).

use super::oracle_support;

use butter::check::{FindingKind, Report, Severity};
use butter::ctree::{Root, TreeIter};
use butter::format::*;
use butter::fs::Fs;
use butter::io::disk_io::Readahead;
use oracle_support::*;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Images

/// mkfs.btrfs defaults on 256 MiB: metadata DUP, and the stale free space entries mkfs leaves.
fn mkfs_image() -> Option<Arc<Vec<u8>>> {
    static IMG: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
    if !have_progs() {
        return None;
    }
    Some(
        IMG.get_or_init(|| {
            let s = Scratch::new("check-more-mkfs");
            let img = s.join("m.img");
            mkfs(&img, 256 * MIB, &[]);
            Arc::new(std::fs::read(&img).unwrap())
        })
        .clone(),
    )
}

/// Kernel-populated (NO_HOLES): files, the first data group fragmented into bitmaps, a
/// subvolume with a file of two extents, a snapshot of it and a snapshot inside it.
fn kernel_image() -> Option<Arc<Vec<u8>>> {
    static IMG: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
    if !have_root_and_loop() {
        return None;
    }
    Some(
        IMG.get_or_init(|| {
            let s = Scratch::new("check-more-kernel");
            let img = s.join("k.img");
            mkfs(&img, 256 * MIB, &[]);
            let m = LoopMount::new(&img, &s.join("mnt"), "");
            sh_in(
                &m.mnt,
                "mkdir frag && for i in $(seq 0 59); do head -c 4096 /dev/urandom > frag/$i; done && sync \
                 && for i in $(seq 0 2 59); do rm frag/$i; sync; done",
            );
            sh_in(
                &m.mnt,
                "btrfs -q subvolume create sv && mkdir sv/d && echo hello > sv/d/a \
                 && dd if=/dev/urandom of=sv/two bs=4096 count=2 2>/dev/null && sync \
                 && dd if=/dev/urandom of=sv/two bs=4096 count=2 seek=4 conv=notrunc 2>/dev/null && sync \
                 && btrfs -q subvolume snapshot sv snap && btrfs -q subvolume snapshot sv sv/inner \
                 && echo changed > snap/d/a && sync",
            );
            m.unmount();
            Arc::new(std::fs::read(&img).unwrap())
        })
        .clone(),
    )
}

/// Kernel-populated without NO_HOLES: a sparse file and a file extended by truncate, so the
/// tree has explicit hole extent items.
fn kernel_holes_image() -> Option<Arc<Vec<u8>>> {
    static IMG: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
    if !have_root_and_loop() {
        return None;
    }
    Some(
        IMG.get_or_init(|| {
            let s = Scratch::new("check-more-holes");
            let img = s.join("h.img");
            mkfs(&img, 256 * MIB, &["-O", "^no-holes"]);
            let m = LoopMount::new(&img, &s.join("mnt"), "");
            sh_in(
                &m.mnt,
                "dd if=/dev/urandom of=sparse bs=4096 count=1 seek=10 2>/dev/null \
                 && head -c 5000 /dev/urandom > grown && truncate -s 100000 grown && sync",
            );
            m.unmount();
            Arc::new(std::fs::read(&img).unwrap())
        })
        .clone(),
    )
}

/// A private copy of an image to damage.
struct Copy {
    _s: Scratch,
    path: PathBuf,
}

fn copy_of(img: &[u8], name: &str) -> Copy {
    let s = Scratch::new(name);
    let path = s.join("img");
    std::fs::write(&path, img).unwrap();
    Copy { _s: s, path }
}

// ---------------------------------------------------------------------------------------------
// Finding items and damaging them

fn tree_root(fs: &Fs, id: u64) -> Root {
    match id {
        ROOT_TREE_OBJECTID => fs.core().tree_root(),
        CHUNK_TREE_OBJECTID => Root {
            id,
            bytenr: fs.disk().sb.chunk_root,
            level: fs.disk().sb.chunk_root_level,
            generation: fs.disk().sb.chunk_root_generation,
        },
        _ => {
            let ri = fs.find_root_item(id).unwrap().expect("tree exists");
            Root {
                id,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            }
        }
    }
}

/// Where an item is: its key, leaf and slot (and whether the leaf is its tree's root).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct At {
    key: Key,
    block: u64,
    slot: usize,
    root_leaf: bool,
}

/// Every item of tree `id` for which `pred` holds.
fn find_all(img: &Path, id: u64, pred: impl Fn(&Key, &[u8]) -> bool) -> Vec<At> {
    let fs = Fs::open(img).unwrap();
    let root = tree_root(&fs, id);
    let mut it = TreeIter::new(fs.disk().clone(), root, Key::MIN, Readahead::None).unwrap();
    let mut out = Vec::new();
    while let Some(item) = it.next_item().unwrap() {
        if pred(&item.key, item.data()) {
            out.push(At {
                key: item.key,
                block: item.block.bytenr,
                slot: item.slot,
                root_leaf: item.block.bytenr == root.bytenr,
            });
        }
    }
    out
}

/// The first item of tree `id` for which `pred` holds.
fn find(img: &Path, id: u64, pred: impl Fn(&Key, &[u8]) -> bool) -> At {
    *find_all(img, id, pred)
        .first()
        .unwrap_or_else(|| panic!("no matching item in tree {id}"))
}

/// Applies `edit(block, item_header_offset, item_data_offset)` to the leaf holding `at`,
/// recomputes its checksum and writes every copy.
fn patch(img: &Path, at: At, edit: impl FnOnce(&mut [u8], usize, usize)) {
    let dev = butter::io::device::FileDevice::open(img, true).unwrap();
    butter::internals::rewrite_block(Arc::new(dev), at.block, |block| {
        let hdr = HEADER_SIZE + at.slot * ITEM_SIZE;
        assert_eq!(Key::from_bytes(&block[hdr..hdr + DISK_KEY_SIZE]), at.key);
        let data = HEADER_SIZE + le_u32(block, hdr + 17) as usize;
        edit(block, hdr, data);
    })
    .unwrap();
}

/// Deletes the item at `at` (not the first of a leaf that has a parent, whose key would change).
fn delete(img: &Path, at: At) {
    assert!(
        at.slot > 0 || at.root_leaf,
        "{at:?} is the first item of a leaf with a parent"
    );
    patch(img, at, |blk, _, _| delete_leaf_item(blk, at.slot));
}

fn add_u64(b: &mut [u8], off: usize, delta: u64) {
    let v = le_u64(b, off).wrapping_add(delta);
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

fn set_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

fn check_img(img: &Path) -> Report {
    let fs = Fs::open(img).unwrap();
    fs.check(Default::default(), &mut |_| {}).unwrap()
}

fn show(r: &Report) -> String {
    r.findings
        .iter()
        .map(|f| f.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Asserts an Error finding of `kind` located at exactly `at` (key, block and slot).
fn assert_at(r: &Report, kind: FindingKind, at: At) {
    let ok = r.findings.iter().any(|f| {
        f.kind == kind
            && f.severity == Severity::Error
            && f.location.key == Some(at.key)
            && f.location.bytenr == Some(at.block)
            && f.location.slot == Some(at.slot)
    });
    assert!(ok, "expected {kind:?} at {at:?}, got:\n{}", show(r));
}

/// Asserts every Error/Fatal finding is of one of `kinds`.
fn only(r: &Report, kinds: &[FindingKind]) {
    for f in &r.findings {
        if f.severity != Severity::Warning {
            assert!(
                kinds.contains(&f.kind),
                "unexpected finding {f}\nall:\n{}",
                show(r)
            );
        }
    }
}

fn assert_clean(img: &Path) -> Report {
    let r = check_img(img);
    assert!(r.is_clean(), "{} not clean:\n{}", img.display(), show(&r));
    let (ok, out) = btrfs_check(img);
    assert!(ok, "btrfs check disagrees on {}:\n{out}", img.display());
    r
}

fn is_data_bg(k: &Key, d: &[u8]) -> bool {
    k.ty == BLOCK_GROUP_ITEM_KEY && le_u64(d, 16) & BLOCK_GROUP_DATA != 0
}

fn data_bg(img: &Path) -> Key {
    find(img, EXTENT_TREE_OBJECTID, is_data_bg).key
}

fn info_of(img: &Path, bg: Key) -> At {
    find(img, FREE_SPACE_TREE_OBJECTID, |k, _| {
        *k == Key::new(bg.objectid, FREE_SPACE_INFO_KEY, bg.offset)
    })
}

// ---------------------------------------------------------------------------------------------
// Clean images

#[test]
fn mkfs_image_checks_clean_with_stale_free_space_warnings() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-mkfs-clean");
    let r = assert_clean(&c.path);
    // mkfs.btrfs 6.2 leaves the free space info of the block groups it removed: warnings.
    let stale: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::FreeSpaceOutsideBlockGroup)
        .collect();
    assert!(!stale.is_empty(), "{}", show(&r));
    assert!(stale.iter().all(|f| f.severity == Severity::Warning));
}

/// A read-only subvolume whose root item lacks ROOT_ITEM_INIT (what butter's mkfs wrote
/// before, and its snapshots copied) is one the kernel turns writable: a warning that names
/// the item, and setting the flag again rewrites the item in the current format.
#[test]
fn mkfs_old_format_root_item_of_a_read_only_subvolume_is_a_warning() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-root-item-init");
    let is_fs_root = |k: &Key, _: &[u8]| k.objectid == FS_TREE_OBJECTID && k.ty == ROOT_ITEM_KEY;
    let at = find(&c.path, ROOT_TREE_OBJECTID, is_fs_root);
    // mkfs.btrfs marks the top level's item: the mark is what the check looks at.
    let before = check_img(&c.path);
    assert!(
        !show(&before).contains("ROOT_ITEM_INIT"),
        "{}",
        show(&before)
    );
    patch(&c.path, at, |b, _, d| {
        let iflags = le_u64(b, d + 64);
        assert_ne!(iflags & (1 << 31), 0, "mkfs.btrfs wrote no ROOT_ITEM_INIT");
        set_u64(b, d + 64, iflags & !(1 << 31));
        set_u64(b, d + 208, ROOT_SUBVOL_RDONLY);
    });
    let r = check_img(&c.path);
    let w: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::RootItemBad && f.message.contains("ROOT_ITEM_INIT"))
        .collect();
    assert_eq!(w.len(), 1, "{}", show(&r));
    assert_eq!(w[0].severity, Severity::Warning);
    assert_eq!(w[0].location.key, Some(at.key), "{}", w[0]);
    assert!(w[0].message.contains("read-only"), "{}", w[0]);
    // Setting the flag (already set as butter reads it) rewrites the item with the mark.
    {
        let fs = Fs::open_rw(&c.path).unwrap();
        fs.set_subvolume_readonly(FS_TREE_OBJECTID, true).unwrap();
        fs.close().unwrap();
    }
    let after = find(&c.path, ROOT_TREE_OBJECTID, is_fs_root);
    let fs = Fs::open(&c.path).unwrap();
    let ri = fs.find_root_item(FS_TREE_OBJECTID).unwrap().unwrap();
    assert_ne!(ri.inode.flags & (1 << 31), 0, "{after:?}");
    assert_eq!(ri.flags & ROOT_SUBVOL_RDONLY, ROOT_SUBVOL_RDONLY);
    let r = check_img(&c.path);
    assert!(!show(&r).contains("ROOT_ITEM_INIT"), "{}", show(&r));
}

#[test]
fn kernel_images_check_clean() {
    let (Some(k), Some(h)) = (kernel_image(), kernel_holes_image()) else {
        return;
    };
    let c = copy_of(&k, "cm-kernel-clean");
    assert_clean(&c.path);
    // The image exercises what the new checks read: a group in bitmaps, subvolume refs.
    let bm = find(&c.path, FREE_SPACE_TREE_OBJECTID, |k, _| {
        k.ty == FREE_SPACE_BITMAP_KEY
    });
    assert_eq!(bm.key.ty, FREE_SPACE_BITMAP_KEY);
    find(&c.path, ROOT_TREE_OBJECTID, |k, _| {
        k.ty == ROOT_REF_KEY && k.objectid >= FIRST_FREE_OBJECTID
    });
    let c = copy_of(&h, "cm-holes-clean");
    assert_clean(&c.path);
    find(&c.path, FS_TREE_OBJECTID, |k, d| {
        k.ty == EXTENT_DATA_KEY && d.len() == 53 && d[20] == FILE_EXTENT_REG && le_u64(d, 21) == 0
    });
}

// ---------------------------------------------------------------------------------------------
// Free space tree

#[test]
fn mkfs_free_space_info_missing() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-fsi-missing");
    let bg = data_bg(&c.path);
    let info = info_of(&c.path, bg);
    delete(&c.path, info);
    let r = check_img(&c.path);
    let bg_at = find(&c.path, EXTENT_TREE_OBJECTID, is_data_bg);
    assert_at(&r, FindingKind::FreeSpaceInfoMissing, bg_at);
    only(&r, &[FindingKind::FreeSpaceInfoMissing]);
}

#[test]
fn mkfs_free_space_count_and_flags() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-fsi-count");
    let info = info_of(&c.path, data_bg(&c.path));
    patch(&c.path, info, |b, _, d| b[d] = b[d].wrapping_add(1));
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FreeSpaceCountMismatch, info);
    only(&r, &[FindingKind::FreeSpaceCountMismatch]);

    let c = copy_of(&base, "cm-fsi-flags");
    let info = info_of(&c.path, data_bg(&c.path));
    patch(&c.path, info, |b, _, d| b[d + 4] |= 1);
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FreeSpaceFlagsMismatch, info);
    only(&r, &[FindingKind::FreeSpaceFlagsMismatch]);

    let c = copy_of(&base, "cm-fsi-flags2");
    let info = info_of(&c.path, data_bg(&c.path));
    patch(&c.path, info, |b, _, d| b[d + 5] |= 1);
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FreeSpaceFlagsMismatch, info);
    only(&r, &[FindingKind::FreeSpaceFlagsMismatch]);
}

#[test]
fn mkfs_free_space_extent_damage() {
    let Some(base) = mkfs_image() else { return };
    // An extent one sector short: the tree and the extent tree disagree.
    let c = copy_of(&base, "cm-fse-short");
    let bg = data_bg(&c.path);
    let ext = find(&c.path, FREE_SPACE_TREE_OBJECTID, |k, _| {
        k.ty == FREE_SPACE_EXTENT_KEY
            && k.objectid >= bg.objectid
            && k.objectid < bg.objectid + bg.offset
    });
    patch(&c.path, ext, |b, h, _| add_u64(b, h + 9, (-4096i64) as u64));
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FreeSpaceMismatch, info_of(&c.path, bg));
    only(&r, &[FindingKind::FreeSpaceMismatch]);

    // An extent reaching past its group: the item itself is bad.
    let c = copy_of(&base, "cm-fse-long");
    patch(&c.path, ext, |b, h, _| add_u64(b, h + 9, bg.offset));
    let mut at = ext;
    at.key.offset += bg.offset;
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FreeSpaceItemBad, at);
    only(&r, &[FindingKind::FreeSpaceItemBad]);
}

#[test]
fn mkfs_free_space_outside_block_group() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-fs-outside");
    // The first stale info (a group mkfs removed): without it its extent is an error.
    let first_bg = find(&c.path, EXTENT_TREE_OBJECTID, |k, _| {
        k.ty == BLOCK_GROUP_ITEM_KEY
    });
    let stale = find_all(&c.path, FREE_SPACE_TREE_OBJECTID, |k, _| {
        k.ty == FREE_SPACE_INFO_KEY && k.objectid < first_bg.key.objectid
    });
    // mkfs.btrfs 6.2 leaves two; the other one stays a warning.
    assert!(stale.len() >= 2, "{stale:?}");
    let stale = stale[stale.len() - 1];
    let orphan = find(&c.path, FREE_SPACE_TREE_OBJECTID, |k, _| {
        k.ty == FREE_SPACE_EXTENT_KEY && k.objectid == stale.key.objectid
    });
    delete(&c.path, stale);
    let r = check_img(&c.path);
    let orphan = At {
        slot: orphan.slot - 1,
        ..orphan
    };
    assert_at(&r, FindingKind::FreeSpaceOutsideBlockGroup, orphan);
    only(&r, &[FindingKind::FreeSpaceOutsideBlockGroup]);
    assert!(r
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::FreeSpaceOutsideBlockGroup
            && f.severity == Severity::Warning));
}

#[test]
fn kernel_free_space_bitmap_bit_flipped() {
    let Some(base) = kernel_image() else { return };
    let c = copy_of(&base, "cm-fsb-bit");
    let bm = find(&c.path, FREE_SPACE_TREE_OBJECTID, |k, _| {
        k.ty == FREE_SPACE_BITMAP_KEY
    });
    let bg = find(&c.path, EXTENT_TREE_OBJECTID, |k, _| {
        k.ty == BLOCK_GROUP_ITEM_KEY
            && k.objectid <= bm.key.objectid
            && bm.key.objectid < k.objectid + k.offset
    });
    // Byte 100 of the bitmap: sectors 800..808 of the group, free or not.
    patch(&c.path, bm, |b, _, d| b[d + 100] ^= 0x10);
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FreeSpaceMismatch, info_of(&c.path, bg.key));
    only(
        &r,
        &[
            FindingKind::FreeSpaceMismatch,
            FindingKind::FreeSpaceCountMismatch,
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// Dev extents

fn dev_extent_of_data(img: &Path) -> At {
    let bg = data_bg(img);
    find(img, DEV_TREE_OBJECTID, |k, d| {
        k.ty == DEV_EXTENT_KEY && le_u64(d, 16) == bg.objectid
    })
}

#[test]
fn mkfs_dev_extent_missing() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-dev-missing");
    let de = dev_extent_of_data(&c.path);
    let chunk = find(&c.path, CHUNK_TREE_OBJECTID, |k, _| {
        k.ty == CHUNK_ITEM_KEY && k.offset == data_bg(&c.path).objectid
    });
    let dev = find(&c.path, CHUNK_TREE_OBJECTID, |k, _| k.ty == DEV_ITEM_KEY);
    delete(&c.path, de);
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::DevExtentMissing, chunk);
    assert_at(&r, FindingKind::DevBytesUsedMismatch, dev);
    assert!(r
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::DevBytesUsedMismatch
            && f.location.what.as_deref() == Some("superblock dev_item")));
    only(
        &r,
        &[
            FindingKind::DevExtentMissing,
            FindingKind::DevBytesUsedMismatch,
        ],
    );
}

#[test]
fn mkfs_dev_extent_wrong_chunk_and_overlap() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-dev-chunk");
    let de = dev_extent_of_data(&c.path);
    patch(&c.path, de, |b, _, d| add_u64(b, d + 16, MIB));
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::DevExtentMismatch, de);
    only(&r, &[FindingKind::DevExtentMismatch]);

    // The data chunk's dev extent grows into the next one.
    let c = copy_of(&base, "cm-dev-overlap");
    let next = find(&c.path, DEV_TREE_OBJECTID, |k, _| {
        k.ty == DEV_EXTENT_KEY && k.offset > de.key.offset
    });
    patch(&c.path, de, |b, _, d| add_u64(b, d + 24, MIB));
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::DevExtentOverlap, next);
    assert_at(&r, FindingKind::DevExtentMismatch, de);
    only(
        &r,
        &[
            FindingKind::DevExtentOverlap,
            FindingKind::DevExtentMismatch,
            FindingKind::DevBytesUsedMismatch,
        ],
    );
}

#[test]
fn mkfs_dev_item_bytes_used() {
    let Some(base) = mkfs_image() else { return };
    let c = copy_of(&base, "cm-dev-used");
    let dev = find(&c.path, CHUNK_TREE_OBJECTID, |k, _| k.ty == DEV_ITEM_KEY);
    patch(&c.path, dev, |b, _, d| add_u64(b, d + 16, 4096));
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::DevBytesUsedMismatch, dev);
    only(&r, &[FindingKind::DevBytesUsedMismatch]);
}

// ---------------------------------------------------------------------------------------------
// Subvolume root refs

fn sv_ref(img: &Path) -> At {
    find(img, ROOT_TREE_OBJECTID, |k, d| {
        k.ty == ROOT_REF_KEY
            && k.objectid == FS_TREE_OBJECTID
            && d.len() == 20
            && &d[18..20] == b"sv"
    })
}

fn sv_backref(img: &Path, sv: u64) -> At {
    find(img, ROOT_TREE_OBJECTID, |k, _| {
        *k == Key::new(sv, ROOT_BACKREF_KEY, FS_TREE_OBJECTID)
    })
}

#[test]
fn kernel_root_backref_missing() {
    let Some(base) = kernel_image() else { return };
    let c = copy_of(&base, "cm-rr-noback");
    let r_at = sv_ref(&c.path);
    let b_at = sv_backref(&c.path, r_at.key.offset);
    let sv_item = find(&c.path, ROOT_TREE_OBJECTID, |k, _| {
        k.objectid == r_at.key.offset && k.ty == ROOT_ITEM_KEY
    });
    delete(&c.path, b_at);
    let r = check_img(&c.path);
    let r_at = sv_ref(&c.path);
    assert_at(&r, FindingKind::RootRefWithoutBackref, r_at);
    let sv_item = find(&c.path, ROOT_TREE_OBJECTID, |k, _| *k == sv_item.key);
    assert_at(&r, FindingKind::SubvolUnreferenced, sv_item);
    only(
        &r,
        &[
            FindingKind::RootRefWithoutBackref,
            FindingKind::SubvolUnreferenced,
        ],
    );
    let (ok, _) = btrfs_check(&c.path);
    assert!(!ok, "btrfs check should see the missing root backref too");
}

#[test]
fn kernel_root_ref_missing_and_renamed() {
    let Some(base) = kernel_image() else { return };
    let c = copy_of(&base, "cm-rr-noref");
    let r_at = sv_ref(&c.path);
    let sv = r_at.key.offset;
    let entry = find(&c.path, FS_TREE_OBJECTID, |k, d| {
        k.ty == DIR_INDEX_KEY && k.objectid == 256 && le_u64(d, 0) == sv && d[8] == ROOT_ITEM_KEY
    });
    delete(&c.path, r_at);
    let r = check_img(&c.path);
    assert_at(
        &r,
        FindingKind::RootBackrefWithoutRef,
        sv_backref(&c.path, sv),
    );
    assert_at(&r, FindingKind::SubvolEntryMismatch, entry);
    only(
        &r,
        &[
            FindingKind::RootBackrefWithoutRef,
            FindingKind::SubvolEntryMismatch,
        ],
    );

    // The backref's name differs from the ref's: neither has a partner.
    let c = copy_of(&base, "cm-rr-name");
    let b_at = sv_backref(&c.path, sv);
    patch(&c.path, b_at, |b, _, d| b[d + 18] ^= 0x20);
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::RootRefWithoutBackref, sv_ref(&c.path));
    assert_at(&r, FindingKind::RootBackrefWithoutRef, b_at);
    only(
        &r,
        &[
            FindingKind::RootRefWithoutBackref,
            FindingKind::RootBackrefWithoutRef,
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// File extents

#[test]
fn kernel_file_extents_overlap() {
    let Some(base) = kernel_image() else { return };
    let c = copy_of(&base, "cm-fe-overlap");
    let sv = sv_ref(&c.path).key.offset;
    // sv/two: extents at 0 and 16384 (NO_HOLES: no hole item between).
    let first = find(&c.path, sv, |k, d| {
        k.ty == EXTENT_DATA_KEY
            && k.offset == 0
            && d.len() == 53
            && d[20] == FILE_EXTENT_REG
            && le_u64(d, 45) == 8192
    });
    let second = find(&c.path, sv, |k, _| {
        k.ty == EXTENT_DATA_KEY && k.objectid == first.key.objectid && k.offset == 16384
    });
    // The first claims 20 KiB of file: past the second's start.
    patch(&c.path, first, |b, _, d| set_u64(b, d + 45, 20480));
    let r = check_img(&c.path);
    assert_at(&r, FindingKind::FileExtentOverlap, second);
    // Only there (the leaf may also be reached from the snapshot, with the same location).
    assert!(
        r.findings
            .iter()
            .filter(|f| f.kind == FindingKind::FileExtentOverlap)
            .all(|f| f.location.key == Some(second.key) && f.location.bytenr == Some(second.block)),
        "{}",
        show(&r)
    );
    let (ok, out) = btrfs_check(&c.path);
    assert!(!ok && out.contains("overlap"), "btrfs check:\n{out}");
}

#[test]
fn kernel_missing_hole_without_no_holes() {
    let Some(base) = kernel_holes_image() else {
        return;
    };
    let c = copy_of(&base, "cm-fe-hole");
    // The sparse file's leading hole item (disk_bytenr 0 at file offset 0).
    let hole = find(&c.path, FS_TREE_OBJECTID, |k, d| {
        k.ty == EXTENT_DATA_KEY
            && k.offset == 0
            && d.len() == 53
            && d[20] == FILE_EXTENT_REG
            && le_u64(d, 21) == 0
    });
    let inode = find(&c.path, FS_TREE_OBJECTID, |k, _| {
        *k == Key::new(hole.key.objectid, INODE_ITEM_KEY, 0)
    });
    delete(&c.path, hole);
    let r = check_img(&c.path);
    let inode = find(&c.path, FS_TREE_OBJECTID, |k, _| *k == inode.key);
    assert_at(&r, FindingKind::FileExtentGap, inode);
    only(&r, &[FindingKind::FileExtentGap]);
    let (ok, out) = btrfs_check(&c.path);
    assert!(!ok && out.contains("discount"), "btrfs check:\n{out}");
}
