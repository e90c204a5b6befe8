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

use common::damage::{ondisk, patch_item, remove_item};
use common::fuse_mount;
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Manifest, TakeOpts};
use common::{output_text as text, run_butter as butter};
use std::fs;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;
const FS_TREE: u64 = 5;
const CHUNK_TREE: u64 = 3;
const ROOT_TREE: u64 = 1;
const ROOT_ITEM: u8 = 132;
const INODE_ITEM: u8 = 1;
const EXTENT_DATA: u8 = 108;
const EXTENT_ITEM: u8 = 168;
const DEV_ITEM: u8 = 216;
const DEV_TREE: u64 = 4;
const DEV_EXTENT: u8 = 204;
const ROOT_REF: u8 = 156;
const ROOT_BACKREF: u8 = 144;
const METADATA_ITEM: u8 = 169;
const EXTENT_DATA_REF: u8 = 178;
const INODE_REF: u8 = 12;
const DIR_ITEM: u8 = 84;
const DIR_INDEX: u8 = 96;
/// An inline EXTENT_DATA_REF: type, root, objectid, offset, count.
const DATA_REF_LEN: usize = 1 + 8 + 8 + 8 + 4;

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
/// inode 257 is directory `d`, 258 its file `a` (two links), 259 its file `b`, 260 the
/// inline file `small`; `r` shares `a`'s data (a reflink: two inline data refs).
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
    let o = std::process::Command::new("cp")
        .arg("--reflink=always")
        .arg(d.join("a"))
        .arg(m.path().join("r"))
        .output()
        .unwrap();
    assert!(o.status.success(), "cp --reflink: {}", text(&o));
    // A subvolume (tree 256) with a file, linked from the top directory.
    let o = std::process::Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(m.path().join("sv"))
        .output()
        .unwrap();
    assert!(o.status.success(), "btrfs subvolume create: {}", text(&o));
    fs::write(m.path().join("sv/in-sv"), vec![3u8; 9000]).unwrap();
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

/// Moves the extent item whose header is at `h` to the address right after the extent (its
/// length: the key's offset, or 16 KiB for a skinny tree block item), which must keep the
/// leaf in order: nothing after it in the leaf, or the next item past that new extent.
fn move_key(blk: &mut [u8], h: usize) {
    let get = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let (obj, ty, off) = (get(blk, h), blk[h + 8], get(blk, h + 9));
    let len = if ty == METADATA_ITEM { 16384 } else { off };
    let nritems = u32::from_le_bytes(blk[96..100].try_into().unwrap()) as usize;
    // Item headers start after the 101-byte block header, 25 bytes each.
    let next = h + 25;
    if next < 101 + nritems * 25 {
        assert!(
            get(blk, next) >= obj + 2 * len,
            "no room to move extent {obj} in its leaf"
        );
    }
    blk[h..h + 8].copy_from_slice(&(obj + len).to_le_bytes());
}

/// Picks directory `dir`'s DIR_ITEM or DIR_INDEX (`ty`) of `name` (a dir item's name follows
/// its 30-byte header).
fn entry_of(dir: u64, ty: u8, name: &'static [u8]) -> impl Fn(&butter::format::Key, &[u8]) -> bool {
    move |k, d| k.objectid == dir && k.ty == ty && d.get(30..30 + name.len()) == Some(name)
}

/// `btrfs check --check-data-csum` and `butter check --check-data-csum` of `img`: whether
/// each passed, and what it printed.
fn data_checks(img: &Path) -> ((bool, String), (bool, String)) {
    let o = std::process::Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(img)
        .output()
        .unwrap();
    let b = butter(&["check", "--check-data-csum", img.to_str().unwrap()]);
    (
        (o.status.success(), text(&o)),
        (b.status.success(), text(&b)),
    )
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
        (
            "nlink-zero",
            "NlinkMismatch",
            // nlink 0 on `b`, which has its name and no ORPHAN_ITEM.
            Box::new(|p: &Path| damage(p, FS_TREE, inode(259), 40, 4, |_| 0)),
        ),
        (
            "dir-nlink",
            "NlinkMismatch",
            // Directory `d` with nlink 2 (a btrfs directory has one).
            Box::new(|p: &Path| damage(p, FS_TREE, inode(257), 40, 4, |_| 2)),
        ),
        (
            "inode-generation",
            "GenerationInvalid",
            // generation: byte 0, far past the filesystem's.
            Box::new(|p: &Path| damage(p, FS_TREE, inode(259), 0, 8, |g| g + (1 << 40))),
        ),
        (
            "inline-ram-bytes",
            "InlineRamBytesMismatch",
            // ram_bytes: byte 8 of the file extent item.
            Box::new(|p: &Path| {
                damage(
                    p,
                    FS_TREE,
                    |k| k.objectid == 260 && k.ty == EXTENT_DATA,
                    8,
                    8,
                    |n| n + 1,
                )
            }),
        ),
        (
            "extent-generation",
            "GenerationInvalid",
            // A data extent item (flags bit 1, byte 16): generation, byte 8.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    ondisk::EXTENT_TREE,
                    false,
                    |k, d| k.ty == EXTENT_ITEM && d.len() >= 24 && d[16] & 1 == 1,
                    |blk, _, d| blk[d + 8..d + 16].copy_from_slice(&(1u64 << 40).to_le_bytes()),
                );
            }),
        ),
        (
            "metadata-level",
            "MetadataLevelMismatch",
            // A skinny metadata item's level is its key's offset (bytes 9..17 of the key,
            // which starts the item header): level 1 for a leaf, or 0 for a node.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    ondisk::EXTENT_TREE,
                    false,
                    |k, _| k.ty == METADATA_ITEM,
                    |blk, h, _| {
                        let l = u64::from_le_bytes(blk[h + 9..h + 17].try_into().unwrap());
                        let wrong: u64 = if l == 0 { 1 } else { 0 };
                        blk[h + 9..h + 17].copy_from_slice(&wrong.to_le_bytes());
                    },
                );
            }),
        ),
        (
            "inline-ref-order",
            "InlineRefOrder",
            // The shared data extent's two inline data refs (after refs, generation and
            // flags: 24 bytes) swapped.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    ondisk::EXTENT_TREE,
                    false,
                    |k, d| {
                        k.ty == EXTENT_ITEM
                            && d.len() == 24 + 2 * DATA_REF_LEN
                            && d[24] == EXTENT_DATA_REF
                            && d[24 + DATA_REF_LEN] == EXTENT_DATA_REF
                    },
                    |blk, _, d| {
                        let a = d + 24;
                        let first: Vec<u8> = blk[a..a + DATA_REF_LEN].to_vec();
                        blk.copy_within(a + DATA_REF_LEN..a + 2 * DATA_REF_LEN, a);
                        blk[a + DATA_REF_LEN..a + 2 * DATA_REF_LEN].copy_from_slice(&first);
                    },
                );
            }),
        ),
        (
            "data-backref-count",
            "DataBackrefMismatch",
            // File `b`'s data extent: one inline data ref (after refs, generation and flags:
            // 24 bytes), its count (the last 4 bytes of the ref) made 2.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    ondisk::EXTENT_TREE,
                    false,
                    |k, d| {
                        k.ty == EXTENT_ITEM
                            && k.offset == 8192
                            && d.len() == 24 + DATA_REF_LEN
                            && d[24] == EXTENT_DATA_REF
                    },
                    |blk, _, d| {
                        let c = d + 24 + DATA_REF_LEN - 4;
                        blk[c..c + 4].copy_from_slice(&2u32.to_le_bytes());
                    },
                );
            }),
        ),
        (
            "data-extent-moved",
            "DataExtentMissing",
            // The last data extent item's key moved past its end, into free space: the file
            // extent names an address without an item, and the item one no file uses.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    ondisk::EXTENT_TREE,
                    true,
                    |k, d| k.ty == EXTENT_ITEM && d.len() >= 24 && d[16] & 1 == 1,
                    |blk, h, _| move_key(blk, h),
                );
            }),
        ),
        (
            "metadata-extent-moved",
            "MetadataExtentMissing",
            // The same for the last tree block's skinny item: one block without an item, and
            // an item for a block no tree has.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    ondisk::EXTENT_TREE,
                    true,
                    |k, _| k.ty == METADATA_ITEM,
                    |blk, h, _| move_key(blk, h),
                );
            }),
        ),
        (
            "dir-index-missing",
            "InodeRefWithoutDirIndex",
            Box::new(|p: &Path| {
                remove_item(p, FS_TREE, entry_of(257, DIR_INDEX, b"b"));
            }),
        ),
        (
            "dir-item-missing",
            "DirIndexWithoutItem",
            Box::new(|p: &Path| {
                remove_item(p, FS_TREE, entry_of(257, DIR_ITEM, b"b"));
            }),
        ),
        (
            "dir-item-misfiled",
            "FsItemBad",
            // The DIR_ITEM of `b` renamed `c`: the name no longer hashes to its key.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    FS_TREE,
                    false,
                    entry_of(257, DIR_ITEM, b"b"),
                    |blk, _, d| blk[d + 30] = b'c',
                );
            }),
        ),
        (
            "dir-index-renamed",
            "DirEntryWithoutInodeRef",
            // The DIR_INDEX of `b` renamed `c`: no ref names it, and b's ref has no index.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    FS_TREE,
                    false,
                    entry_of(257, DIR_INDEX, b"b"),
                    |blk, _, d| blk[d + 30] = b'c',
                );
            }),
        ),
        (
            "inode-mode",
            "InodeModeBad",
            // The mode (byte 52, a u32) of `b` with a bit above the file type set.
            Box::new(|p: &Path| damage(p, FS_TREE, inode(259), 52, 4, |m| m | 1 << 20)),
        ),
        (
            "data-extent-item-missing",
            "DataExtentMissing",
            // File `b`'s data extent item removed (its file extent stays).
            Box::new(|p: &Path| {
                remove_item(p, ondisk::EXTENT_TREE, |k, d| {
                    k.ty == EXTENT_ITEM && k.offset == 8192 && d.len() >= 24 && d[16] & 1 == 1
                });
            }),
        ),
        (
            "file-extent-bytenr",
            "DataExtentMissing",
            // File `b`'s file extent item (disk_bytenr: byte 21) pointed far away: its data
            // extent is left with a reference no item makes, and the item names nothing.
            Box::new(|p: &Path| {
                damage(
                    p,
                    FS_TREE,
                    |k| k.objectid == 259 && k.ty == EXTENT_DATA,
                    21,
                    8,
                    |b| b + 64 * MIB,
                )
            }),
        ),
        (
            "file-extent-missing",
            "DataBackrefMismatch",
            // File `a`'s file extent item removed: its data extent (shared with `r`) keeps a
            // back reference for it, which gives the item back.
            Box::new(|p: &Path| {
                remove_item(p, FS_TREE, |k, _| k.objectid == 258 && k.ty == EXTENT_DATA);
            }),
        ),
        (
            "root-generation",
            "GenerationInvalid",
            // The top subvolume's root item generation (byte 160, after the inode item) and
            // its root block's (byte 80 of the header) both far past the filesystem's.
            Box::new(|p: &Path| {
                const FUTURE: u64 = 1 << 40;
                let mut root_block = 0;
                patch_item(
                    p,
                    ROOT_TREE,
                    false,
                    |k, _| k.objectid == FS_TREE && k.ty == ROOT_ITEM,
                    |blk, _, d| {
                        blk[d + 160..d + 168].copy_from_slice(&FUTURE.to_le_bytes());
                        root_block = u64::from_le_bytes(blk[d + 176..d + 184].try_into().unwrap());
                    },
                );
                let dev = butter::io::device::FileDevice::open(p, true).unwrap();
                butter::internals::rewrite_block(std::sync::Arc::new(dev), root_block, |b| {
                    b[80..88].copy_from_slice(&FUTURE.to_le_bytes())
                })
                .unwrap();
            }),
        ),
        (
            "num-devices",
            // butter check cannot open it (the kernel refuses it too); the repair can.
            "num_devices says the filesystem has 8 devices",
            // The superblock's num_devices (byte 136) made 8 in every copy, resealed.
            Box::new(|p: &Path| {
                use std::os::unix::fs::FileExt;
                let f = fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .unwrap();
                let len = f.metadata().unwrap().len();
                for at in [65536u64, 64 * MIB] {
                    if at + 4096 > len {
                        continue;
                    }
                    let mut sb = vec![0u8; 4096];
                    f.read_exact_at(&mut sb, at).unwrap();
                    sb[136..144].copy_from_slice(&8u64.to_le_bytes());
                    let c = crc32c::crc32c(&sb[32..]);
                    sb[..32].fill(0);
                    sb[..4].copy_from_slice(&c.to_le_bytes());
                    f.write_all_at(&sb, at).unwrap();
                }
            }),
        ),
        (
            "leaf-item-offset",
            "TreeBlockUnreadable",
            // The data offset of file `b`'s inode item (bytes 17..21 of its item header)
            // made garbage, the leaf resealed: the leaf cannot be read; the items are packed,
            // so the offset follows from the sizes.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    FS_TREE,
                    false,
                    |k, _| inode(259)(k),
                    |blk, h, _| blk[h + 17..h + 21].copy_from_slice(&0x2d0f_4b57u32.to_le_bytes()),
                );
            }),
        ),
        (
            "leaf-generation",
            "TreeBlockUnreadable",
            // The generation in the header (byte 80) of the leaf holding file `b`'s inode
            // far from what its parent pointer says.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    FS_TREE,
                    false,
                    |k, _| inode(259)(k),
                    |blk, _, _| blk[80..88].copy_from_slice(&0x2d0f_4b57u64.to_le_bytes()),
                );
            }),
        ),
        (
            "root-backref-missing",
            "RootRefWithoutBackref",
            // Subvolume sv's ROOT_BACKREF removed: its ROOT_REF and entry remain.
            Box::new(|p: &Path| {
                remove_item(p, ROOT_TREE, |k, _| {
                    k.ty == ROOT_BACKREF && k.objectid == 256
                });
            }),
        ),
        (
            "root-ref-missing",
            "RootBackrefWithoutRef",
            Box::new(|p: &Path| {
                remove_item(p, ROOT_TREE, |k, _| k.ty == ROOT_REF && k.offset == 256);
            }),
        ),
        (
            "dev-extent-missing",
            "DevExtentMissing",
            // The first chunk's dev extent removed.
            Box::new(|p: &Path| {
                remove_item(p, DEV_TREE, |k, _| k.ty == DEV_EXTENT);
            }),
        ),
        (
            "dev-extent-length",
            "DevExtentMismatch",
            // The last dev extent's length (byte 24) one MiB short.
            Box::new(|p: &Path| {
                patch_item(
                    p,
                    DEV_TREE,
                    true,
                    |k, _| k.ty == DEV_EXTENT,
                    |blk, _, d| {
                        let n = u64::from_le_bytes(blk[d + 24..d + 32].try_into().unwrap());
                        blk[d + 24..d + 32].copy_from_slice(&(n - MIB).to_le_bytes());
                    },
                );
            }),
        ),
        (
            "dev-bytes-used",
            "DevBytesUsedMismatch",
            // The device item's bytes_used: byte 16.
            Box::new(|p: &Path| damage(p, CHUNK_TREE, |k| k.ty == DEV_ITEM, 16, 8, |n| n + MIB)),
        ),
        (
            "device-size",
            "DeviceSizeMismatch",
            // The device item's total_bytes (byte 8) past the superblock's, unaligned.
            Box::new(|p: &Path| damage(p, CHUNK_TREE, |k| k.ty == DEV_ITEM, 8, 8, |n| n + 2048)),
        ),
    ];
    for (name, finding, hurt) in &cases {
        let img = s.join(format!("{name}.img"));
        fs::copy(&base, &img).unwrap();
        hurt(&img);
        let (ok, t) = kernel::btrfs_check(&img);
        // btrfs-progs 6.14 checks only that inline refs of one type do not go up and then
        // down; the kernel's tree-checker (and butter) want them in descending order, so
        // the swapped pair is damage only they see (the kernel refuses to read that leaf).
        if *name != "inline-ref-order" {
            assert!(!ok, "{name}: btrfs check found nothing:\n{t}");
        }
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

/// A file whose every name is gone (its INODE_REF, and its directory's DIR_ITEM and
/// DIR_INDEX) is linked into a new lost+found under its inode number: both checkers clean
/// after, and the kernel reads its data there and every other file as before.
#[test]
fn a_file_without_a_name_goes_to_lost_and_found() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-lost");
    let img = healthy(&s);
    let m = LoopMount::btrfs_ro(&img, &s.dir("before"));
    let a = fs::read(m.path().join("d/a")).unwrap();
    let b = fs::read(m.path().join("d/b")).unwrap();
    m.unmount();
    remove_item(&img, FS_TREE, |k, _| k.objectid == 259 && k.ty == INODE_REF);
    remove_item(&img, FS_TREE, entry_of(257, DIR_ITEM, b"b"));
    remove_item(&img, FS_TREE, entry_of(257, DIR_INDEX, b"b"));
    let o = butter(&["check", img.to_str().unwrap()]);
    assert!(
        text(&o).contains("NlinkMismatch"),
        "no NlinkMismatch:\n{}",
        text(&o)
    );
    let o = butter(&["check", "--repair", img.to_str().unwrap()]);
    assert!(o.status.success(), "repair:\n{}", text(&o));
    assert!(text(&o).contains("lost+found"), "repair:\n{}", text(&o));
    let (rc, t) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check after the repair:\n{t}");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after the repair:\n{t}");
    let m = LoopMount::btrfs_ro(&img, &s.dir("after"));
    assert_eq!(fs::read(m.path().join("lost+found/259")).unwrap(), b);
    assert_eq!(fs::read(m.path().join("d/a")).unwrap(), a);
    assert!(!m.path().join("d/b").exists());
    m.unmount();
}

/// A file unlinked (every name gone, nlink 0) whose ORPHAN_ITEM was lost gets one: both
/// checkers clean after, and a kernel mount frees the inode (its data extent goes).
#[test]
fn an_unlinked_file_without_its_orphan_item_gets_one() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-orphan");
    let img = healthy(&s);
    remove_item(&img, FS_TREE, |k, _| k.objectid == 259 && k.ty == INODE_REF);
    remove_item(&img, FS_TREE, entry_of(257, DIR_ITEM, b"b"));
    remove_item(&img, FS_TREE, entry_of(257, DIR_INDEX, b"b"));
    damage(&img, FS_TREE, inode(259), 40, 4, |_| 0);
    let o = butter(&["check", "--repair", img.to_str().unwrap()]);
    assert!(o.status.success(), "repair:\n{}", text(&o));
    assert!(text(&o).contains("ORPHAN_ITEM"), "repair:\n{}", text(&o));
    let (rc, t) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check after the repair:\n{t}");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after the repair:\n{t}");
    LoopMount::btrfs(&img, &s.dir("rw"), "").unmount();
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after a kernel mount:\n{t}");
    let o = std::process::Command::new("btrfs")
        .args(["inspect-internal", "dump-tree", "-t", "5"])
        .arg(&img)
        .output()
        .unwrap();
    let tree = String::from_utf8_lossy(&o.stdout);
    assert!(
        !tree.contains("(259 INODE_ITEM"),
        "the kernel kept the inode:\n{tree}"
    );
    assert!(!tree.contains("ORPHAN"), "the orphan item stayed:\n{tree}");
}

/// Without NO_HOLES every hole has a file extent item: one removed is made again, both
/// checkers clean after, and the kernel reads the file as before.
#[test]
fn a_missing_hole_item_is_made_again() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-hole");
    let img = s.join("holes.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &["-O", "^no-holes"]);
    let m = LoopMount::btrfs(&img, &s.dir("fill"), "");
    // 8 KiB of data, a 64 KiB hole, 8 KiB of data.
    let mut want = vec![1u8; 8192];
    want.extend(vec![0u8; 65536]);
    want.extend(vec![2u8; 8192]);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = fs::File::create(m.path().join("sparse")).unwrap();
        f.write_all(&want[..8192]).unwrap();
        f.seek(SeekFrom::Start(8192 + 65536)).unwrap();
        f.write_all(&want[8192 + 65536..]).unwrap();
    }
    m.unmount();
    // The hole's item: a regular extent item at 8192 with disk_bytenr (byte 21) 0.
    remove_item(&img, FS_TREE, |k, d| {
        k.objectid == 257
            && k.ty == EXTENT_DATA
            && k.offset == 8192
            && d.len() >= 29
            && d[21..29] == [0; 8]
    });
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(!ok, "btrfs check found nothing:\n{t}");
    let o = butter(&["check", img.to_str().unwrap()]);
    assert!(text(&o).contains("FileExtentGap"), "{}", text(&o));
    let o = butter(&["check", "--repair", img.to_str().unwrap()]);
    assert!(o.status.success(), "repair:\n{}", text(&o));
    let (rc, t) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check after the repair:\n{t}");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after the repair:\n{t}");
    let m = LoopMount::btrfs_ro(&img, &s.dir("after"));
    assert!(
        fs::read(m.path().join("sparse")).unwrap() == want,
        "the file changed"
    );
    m.unmount();
}

/// A leaf that can be neither read nor mended (a byte of every copy changed, the checksum
/// left wrong): whatever the repair does, it frees none of the extents the leaf may use.
/// Putting the leaf's bytes back afterwards gives an image both checkers find clean, which
/// it would not be had the repair freed the files' data or the leaf itself.
#[test]
fn a_leaf_that_cannot_be_read_keeps_what_it_uses() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-unread");
    // Files enough for the fs tree to have many leaves; each file's data its own extent.
    let img = s.join("unread.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &[] as &[&str]);
    let m = LoopMount::btrfs(&img, &s.dir("fill"), "");
    for i in 0..400u32 {
        fs::write(m.path().join(format!("f{i}")), vec![i as u8; 5000]).unwrap();
    }
    m.unmount();
    // The leaf holding inode 500's item (not the first leaf); each copy's place and bytes.
    let (_, leaf, _) = patch_item(&img, FS_TREE, false, |k, _| inode(500)(k), |_, _, _| {});
    let dev = butter::io::device::FileDevice::open(&img, true).unwrap();
    let copies = butter::internals::rewrite_block(std::sync::Arc::new(dev), leaf, |_| {}).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
        for (phys, bytes) in &copies {
            // A byte in the middle of the item data, not resealed.
            f.write_all_at(&[bytes[9000] ^ 0x5a], phys + 9000).unwrap();
        }
    }
    let (ok, _) = kernel::btrfs_check(&img);
    assert!(!ok, "btrfs check finds nothing wrong");
    let o = butter(&["check", "--repair", img.to_str().unwrap()]);
    let t = text(&o);
    assert!(!o.status.success(), "the repair claims success:\n{t}");
    assert!(
        t.contains("can be neither read nor mended") && !t.contains("changes:"),
        "the repair planned changes around the unreadable leaf:\n{t}"
    );
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
        for (phys, bytes) in &copies {
            f.write_all_at(bytes, *phys).unwrap();
        }
    }
    let (rc, t) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check with the leaf put back:\n{t}");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check with the leaf put back:\n{t}");
}

/// `rescue fix-data-checksum`: one sector's checksum made wrong is listed with its file and
/// nothing written; `-m 2` on data with one copy is refused, nothing written; `-m 1` makes
/// the sum that of the data, and both checkers (data checksums read) are clean after, the
/// kernel reading every file as before.
#[test]
fn fix_data_checksum_lists_a_wrong_sum_and_updates_it() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-fixcsum");
    let img = s.join("fixcsum.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &[] as &[&str]);
    let m = LoopMount::btrfs(&img, &s.dir("fill"), "");
    let noise: Vec<u8> = (0..65536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    // Inode 257.
    fs::write(m.path().join("f"), &noise).unwrap();
    fs::write(m.path().join("g"), &noise[..20_000]).unwrap();
    m.unmount();
    let want = kernel_files(&img, &s, "before");
    // f's data address (disk_bytenr: byte 21 of its file extent item).
    let mut bytenr = 0u64;
    patch_item(
        &img,
        FS_TREE,
        false,
        |k, _| k.objectid == 257 && k.ty == EXTENT_DATA,
        |blk, _, d| bytenr = u64::from_le_bytes(blk[d + 21..d + 29].try_into().unwrap()),
    );
    assert!(bytenr > 0, "f has no data extent");
    // The crc32c of f's second sector flipped.
    let bad = bytenr + 4096;
    patch_item(
        &img,
        ondisk::CSUM_TREE,
        false,
        |k, d| {
            k.ty == ondisk::EXTENT_CSUM
                && k.offset <= bad
                && bad < k.offset + d.len() as u64 / 4 * 4096
        },
        |blk, h, d| {
            // The key's offset: byte 9 of the item header.
            let start = u64::from_le_bytes(blk[h + 9..h + 17].try_into().unwrap());
            let at = d + ((bad - start) / 4096 * 4) as usize;
            for b in &mut blk[at..at + 4] {
                *b ^= 0xff;
            }
        },
    );
    let path = img.to_str().unwrap();
    let bytes = fs::read(&img).unwrap();
    let o = butter(&["rescue", "fix-data-checksum", path]);
    assert!(o.status.success(), "fix-data-checksum: {}", text(&o));
    let t = text(&o);
    assert!(
        t.contains(&format!(
            "logical={bad} corrupted mirrors=1 affected files:"
        )) && t.contains("(subvolume 5)/f"),
        "the report:\n{t}"
    );
    assert_eq!(t.matches("logical=").count(), 1, "one bad sector:\n{t}");
    let o = butter(&["rescue", "fix-data-checksum", "-m", "2", path]);
    assert!(!o.status.success(), "-m 2 on one copy: {}", text(&o));
    assert!(text(&o).contains("no mirror 2"), "{}", text(&o));
    assert!(
        fs::read(&img).unwrap() == bytes,
        "a refused or read-only run wrote"
    );
    let o = butter(&["rescue", "fix-data-checksum", "-m", "1", path]);
    assert!(o.status.success(), "fix-data-checksum -m 1: {}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "Csum item for logical {bad} updated using data from mirror 1"
        )),
        "{}",
        text(&o)
    );
    let o = butter(&["rescue", "fix-data-checksum", path]);
    assert!(
        text(&o).contains("no data checksum mismatch found"),
        "after: {}",
        text(&o)
    );
    let ((ok, t), (bok, bt)) = data_checks(&img);
    assert!(ok, "btrfs check --check-data-csum after:\n{t}");
    assert!(bok, "butter check --check-data-csum after:\n{bt}");
    let got = kernel_files(&img, &s, "after");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::all(),
        "the files after fix-data-checksum",
    );
}

/// `--init-extent-tree`: on a kernel-made image with a snapshot, a subvolume and a reflink
/// (blocks and data shared between trees), the extent tree made again from the other trees
/// leaves both checkers clean and the kernel's files as they were, and the kernel writes to
/// it after; on a block group tree image whose extent tree has a leaf that cannot be read
/// (the damage `--init-extent-tree` is for), the same.
#[test]
fn init_extent_tree_makes_it_again_from_the_other_trees() {
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-extent");
    for (name, mkfs_args) in [("plain", &[][..]), ("bgt", &["-O", "block-group-tree"][..])] {
        let img = s.join(format!("{name}.img"));
        kernel::mkfs_btrfs(&img, 300 * MIB, mkfs_args);
        let m = LoopMount::btrfs(&img, &s.dir(format!("{name}-fill")), "");
        let d = m.path().join("d");
        fs::create_dir(&d).unwrap();
        for i in 0..300u32 {
            let body: Vec<u8> = (0..i * 300).map(|x| (x ^ i) as u8).collect();
            fs::write(d.join(format!("f{i}")), body).unwrap();
        }
        let run = |args: &[&str]| {
            let o = std::process::Command::new(args[0])
                .args(&args[1..])
                .output()
                .unwrap();
            assert!(o.status.success(), "{args:?}: {}", text(&o));
        };
        let at = |p: &str| m.path().join(p).to_str().unwrap().to_string();
        run(&["cp", "--reflink=always", &at("d/f100"), &at("r")]);
        // The snapshot first: a subvolume nested in it would show as an empty directory
        // whose times the kernel makes up at each mount.
        run(&["btrfs", "subvolume", "snapshot", &at(""), &at("snap")]);
        fs::write(m.path().join("snap/only-in-snap"), b"snap\n").unwrap();
        run(&["btrfs", "subvolume", "create", &at("sv")]);
        fs::write(m.path().join("sv/in-sv"), vec![5u8; 20_000]).unwrap();
        m.unmount();
        let want = kernel_files(&img, &s, &format!("{name}-before"));
        if name == "bgt" {
            // The last extent tree leaf holding a data extent item made unreadable: its
            // header's bytenr no longer its address (resealed, so only that check fails).
            let (_, leaf, _) = patch_item(
                &img,
                ondisk::EXTENT_TREE,
                true,
                |k, _| k.ty == EXTENT_ITEM,
                |_, _, _| {},
            );
            let dev = butter::io::device::FileDevice::open(&img, true).unwrap();
            butter::internals::rewrite_block(std::sync::Arc::new(dev), leaf, |b| b[48] ^= 0x10)
                .unwrap();
            let (ok, _) = kernel::btrfs_check(&img);
            assert!(!ok, "{name}: btrfs check finds nothing wrong");
        }
        let o = butter(&[
            "check",
            "--repair",
            "--init-extent-tree",
            img.to_str().unwrap(),
        ]);
        assert!(
            o.status.success(),
            "{name}: --init-extent-tree:\n{}",
            text(&o)
        );
        assert!(
            text(&o).contains("made the extent tree again"),
            "{name}: {}",
            text(&o)
        );
        let (rc, t) = fuse_mount::butter_check(&img);
        assert_eq!(rc, 0, "{name}: butter check after:\n{t}");
        let (ok, t) = kernel::btrfs_check(&img);
        assert!(ok, "{name}: btrfs check after:\n{t}");
        let got = kernel_files(&img, &s, &format!("{name}-after"));
        manifest::assert_same(
            &want,
            &got,
            &CompareOpts::all(),
            &format!("{name}: the files after --init-extent-tree"),
        );
        // The kernel changes shared and unshared files on it, and it stays clean.
        let m = LoopMount::btrfs(&img, &s.dir(format!("{name}-write")), "");
        fs::write(m.path().join("d/f7"), b"rewritten\n").unwrap();
        fs::remove_file(m.path().join("snap/d/f8")).unwrap();
        fs::remove_file(m.path().join("r")).unwrap();
        fs::write(m.path().join("new"), vec![9u8; 70_000]).unwrap();
        m.unmount();
        let (ok, t) = kernel::btrfs_check(&img);
        assert!(ok, "{name}: btrfs check after the kernel wrote:\n{t}");
        let (rc, t) = fuse_mount::butter_check(&img);
        assert_eq!(rc, 0, "{name}: butter check after the kernel wrote:\n{t}");
    }
}

/// `--init-csum-tree`: a checksum item's sums damaged (the data reads as corrupt) are made
/// again from the data, compressed and NODATASUM files included: both checkers clean with
/// their data checksums read, and the kernel reads every file as before.
#[test]
fn init_csum_tree_sums_the_data_again() {
    if !fuse_mount::require("repair", &["chattr"]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("repair-csum");
    let img = s.join("csum.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &[] as &[&str]);
    let m = LoopMount::btrfs(&img, &s.dir("fill"), "compress=zstd");
    let noise: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    fs::write(m.path().join("plain"), &noise).unwrap();
    fs::write(m.path().join("squeezed"), b"hello\n".repeat(300_000)).unwrap();
    let nocsum = m.path().join("nocsum");
    fs::write(&nocsum, b"").unwrap();
    let o = std::process::Command::new("chattr")
        .arg("+C")
        .arg(&nocsum)
        .output()
        .unwrap();
    assert!(o.status.success(), "chattr +C: {}", text(&o));
    fs::write(&nocsum, &noise[..100_000]).unwrap();
    m.unmount();
    let want = kernel_files(&img, &s, "before");
    // The first checksum item's first sums flipped.
    patch_item(
        &img,
        ondisk::CSUM_TREE,
        false,
        |k, _| k.ty == ondisk::EXTENT_CSUM,
        |blk, _, d| {
            for b in &mut blk[d..d + 8] {
                *b ^= 0xff;
            }
        },
    );
    let ((ok, _), (bok, _)) = data_checks(&img);
    assert!(!ok, "btrfs check --check-data-csum found nothing");
    assert!(!bok, "butter check --check-data-csum found nothing");
    let o = butter(&[
        "check",
        "--repair",
        "--init-csum-tree",
        img.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "--init-csum-tree:\n{}", text(&o));
    assert!(
        text(&o).contains("made the checksum tree again"),
        "{}",
        text(&o)
    );
    let ((ok, t), (bok, bt)) = data_checks(&img);
    assert!(ok, "btrfs check --check-data-csum after:\n{t}");
    assert!(bok, "butter check --check-data-csum after:\n{bt}");
    let got = kernel_files(&img, &s, "after");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::all(),
        "the files after --init-csum-tree",
    );
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

/// `butter rescue zero-log`, `super-recover` and `fix-device-size` as btrfs-progs spells
/// them: each mends its one kind of damage on a kernel-made image, both checkers are clean
/// after, the kernel mounts the result; and each says there was nothing to do on a healthy
/// image.
#[test]
fn rescue_commands_mend_their_damage() {
    use common::fsync::{copy_sparse, fsync_path, log_root_of};
    if !fuse_mount::require("repair", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("rescue");
    let clean_after = |img: &Path, what: &str| {
        let (rc, t) = fuse_mount::butter_check(img);
        assert_eq!(rc, 0, "{what}: butter check:\n{t}");
        let (ok, t) = kernel::btrfs_check(img);
        assert!(ok, "{what}: btrfs check:\n{t}");
    };

    // zero-log: an fsync log the kernel left (the image copied while mounted).
    let img = s.join("log.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &[] as &[&str]);
    let opts = "commit=600,noatime";
    let m = LoopMount::btrfs(&img, &s.dir("m"), opts);
    fs::write(m.path().join("committed"), b"before\n").unwrap();
    m.unmount();
    let crash = s.join("crash.img");
    let m = LoopMount::btrfs(&img, &s.dir("m"), opts);
    fs::write(m.path().join("logged"), vec![3u8; 10_000]).unwrap();
    fsync_path(&m.path().join("logged"));
    copy_sparse(&img, &crash);
    m.unmount();
    assert_ne!(log_root_of(&crash), 0, "the kernel left no log");
    let c = crash.to_str().unwrap();
    let o = butter(&["rescue", "zero-log", c]);
    assert!(o.status.success(), "zero-log: {}", text(&o));
    assert_eq!(log_root_of(&crash), 0, "zero-log left the log");
    clean_after(&crash, "zero-log");
    let files = kernel_files(&crash, &s, "zl");
    assert!(
        files.get("committed").is_some(),
        "the committed file is gone"
    );
    assert!(
        files.get("logged").is_none(),
        "the logged file was replayed after all"
    );
    let o = butter(&["rescue", "zero-log", c]);
    assert!(text(&o).contains("no fsync log"), "{}", text(&o));

    // super-recover: the primary superblock copy damaged (its checksum fails).
    let base = healthy(&s);
    let want = kernel_files(&base, &s, "before");
    let img = s.join("super.img");
    fs::copy(&base, &img).unwrap();
    let p = img.to_str().unwrap();
    let o = butter(&["rescue", "super-recover", "-y", p]);
    assert!(text(&o).contains("All supers are valid"), "{}", text(&o));
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&[0x5a; 64], 65536 + 0x200).unwrap();
    }
    let o = butter(&["rescue", "super-recover", "-y", "-v", p]);
    assert!(o.status.success(), "super-recover: {}", text(&o));
    assert!(text(&o).contains("Recovered"), "{}", text(&o));
    let sb = kernel::dump_super(&img);
    assert!(
        sb.contains("[match]"),
        "the primary copy is still bad:\n{sb}"
    );
    assert!(
        !sb.contains("DON'T MATCH"),
        "the primary copy is still bad:\n{sb}"
    );
    clean_after(&img, "super-recover");
    let got = kernel_files(&img, &s, "sr");
    manifest::assert_same(&want, &got, &CompareOpts::all(), "super-recover: the files");

    // fix-device-size: the device item says 2 KiB more than the superblock (unaligned).
    let img = s.join("size.img");
    fs::copy(&base, &img).unwrap();
    let p = img.to_str().unwrap();
    damage(&img, CHUNK_TREE, |k| k.ty == DEV_ITEM, 8, 8, |n| n + 2048);
    let (ok, _) = kernel::btrfs_check(&img);
    assert!(!ok, "btrfs check did not see the device size");
    let o = butter(&["rescue", "fix-device-size", p]);
    assert!(o.status.success(), "fix-device-size: {}", text(&o));
    assert!(text(&o).contains("Fixed device size"), "{}", text(&o));
    clean_after(&img, "fix-device-size");
    let got = kernel_files(&img, &s, "fds");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::all(),
        "fix-device-size: the files",
    );
    let o = butter(&["rescue", "fix-device-size", p]);
    assert!(text(&o).contains("No device size"), "{}", text(&o));

    // clear-uuid-tree: the tree goes, the files stay, and the kernel builds it again.
    let img = s.join("uuid.img");
    fs::copy(&base, &img).unwrap();
    let p = img.to_str().unwrap();
    let has_uuid_tree = |img: &Path| {
        let o = std::process::Command::new("btrfs")
            .args(["inspect-internal", "dump-tree", "-t", "root"])
            .arg(img)
            .output()
            .unwrap();
        assert!(o.status.success(), "dump-tree: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).contains("(UUID_TREE ROOT_ITEM")
    };
    assert!(has_uuid_tree(&img), "mkfs.btrfs made no uuid tree");
    let o = butter(&["rescue", "clear-uuid-tree", p]);
    assert!(o.status.success(), "clear-uuid-tree: {}", text(&o));
    assert!(!has_uuid_tree(&img), "clear-uuid-tree left the tree");
    clean_after(&img, "clear-uuid-tree");
    let got = kernel_files(&img, &s, "cut");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::all(),
        "clear-uuid-tree: the files",
    );
    let o = butter(&["rescue", "clear-uuid-tree", p]);
    assert!(text(&o).contains("no uuid tree"), "{}", text(&o));
    LoopMount::btrfs(&img, &s.dir("uuid-rw"), "").unmount();
    assert!(
        has_uuid_tree(&img),
        "the kernel did not build the uuid tree again"
    );
    clean_after(&img, "clear-uuid-tree, then a kernel mount");

    // clear-space-cache v2: the free space tree and its flags go; the files stay; a mount
    // with space_cache=v2 builds it again. Refused where the block group tree needs it.
    let img = s.join("fst.img");
    fs::copy(&base, &img).unwrap();
    let p = img.to_str().unwrap();
    let compat_ro = |img: &Path| {
        let sb = kernel::dump_super(img);
        sb.lines()
            .find(|l| l.starts_with("compat_ro_flags"))
            .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    assert_ne!(compat_ro(&img), "0x0", "mkfs.btrfs made no free space tree");
    let o = butter(&["rescue", "clear-space-cache", "v2", p]);
    assert!(o.status.success(), "clear-space-cache v2: {}", text(&o));
    assert_eq!(compat_ro(&img), "0x0", "the free space tree's flags stayed");
    clean_after(&img, "clear-space-cache v2");
    let got = kernel_files(&img, &s, "csc");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::all(),
        "clear-space-cache v2: the files",
    );
    LoopMount::btrfs(&img, &s.dir("fst-rw"), "space_cache=v2").unmount();
    assert_ne!(
        compat_ro(&img),
        "0x0",
        "the kernel did not build the free space tree again"
    );
    clean_after(&img, "clear-space-cache v2, then a kernel mount");
    let bgt = s.join("bgt.img");
    kernel::mkfs_btrfs(&bgt, 300 * MIB, &["-O", "block-group-tree"]);
    let before = fs::read(&bgt).unwrap();
    let o = butter(&["rescue", "clear-space-cache", "v2", bgt.to_str().unwrap()]);
    assert!(!o.status.success(), "v2 cleared beside a block group tree");
    assert!(text(&o).contains("block group tree"), "{}", text(&o));
    assert!(fs::read(&bgt).unwrap() == before, "the refused clear wrote");

    // clear-space-cache v1: a corpus image with v1 cache files loses them.
    let v1 = common::corpus::images()
        .into_iter()
        .find(|i| i.name.starts_with("019-non-skinny-false-alert"))
        .expect("corpus image 019");
    let img = s.join("v1.img");
    common::corpus::copy_to(&v1, &img);
    let p = img.to_str().unwrap();
    let v1_items = |img: &Path| {
        let o = std::process::Command::new("btrfs")
            .args(["inspect-internal", "dump-tree", "-t", "root"])
            .arg(img)
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout)
            .matches("FREE_SPACE UNTYPED")
            .count()
    };
    assert!(v1_items(&img) > 0, "the corpus image has no v1 cache");
    let o = butter(&["rescue", "clear-space-cache", "v1", p]);
    assert!(o.status.success(), "clear-space-cache v1: {}", text(&o));
    assert_eq!(v1_items(&img), 0, "v1 cache headers left");
    clean_after(&img, "clear-space-cache v1");
    let o = butter(&["rescue", "clear-space-cache", "v1", p]);
    assert!(text(&o).contains("nothing to do"), "{}", text(&o));
}
