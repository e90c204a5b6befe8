//! The corruption suite: real images damaged in many precise ways, each opened and walked in
//! full (`walk_everything`'s tolerant form) in a worker thread with a time limit.
//!
//! Every case must end in one of two ways: the undamaged result (when a good copy exists:
//! the other DUP copy of a tree block, a superblock mirror) or typed errors whose text names
//! where the damage is ("superblock", "block N", "slot N", "inode N", ...). Never a panic, a
//! hang, or an allocation sized by a damaged value (the walk thread's largest single
//! allocation and peak live bytes are measured by a counting global allocator).
//!
//! Damage is placed by reading the image's own structures through the engine (see
//! `corrupt_support::locate`): node headers, leaf item records, key pointers, item bodies,
//! data blocks, the superblock and its sys_chunk_array. "Resealed" damage recomputes the block
//! checksum, so validation rather than the checksum must catch it; unresealed damage must be
//! caught by the checksum.
//!
//! Images: `kernel_*` tests use an image populated through a kernel loop mount (root and loop
//! devices needed; skipped with a notice when missing, a failure when `CI` is set);
//! `rootdir_*` tests use `mkfs.btrfs --rootdir` (no root needed; data DUP too).
//! `BUTTER_CORRUPT_RANDOM=N` raises the number of random cases per image (default 60);
//! `BUTTER_CORRUPT_TIMEOUT_SECS` sets the per-case hang limit (default 120).

use super::corrupt_support;
use super::crash_support::Rng;

use butter::format::*;
use corrupt_support::image::{kernel_image, rootdir_image};
use corrupt_support::locate::*;
use corrupt_support::run::*;
use corrupt_support::walk::{walk_everything, Walk};
use std::sync::{Arc, OnceLock};

struct Subject {
    name: &'static str,
    /// Blocks sampled per tree level (the no-root image repeats the kernel image's cases on a
    /// smaller sample).
    per_level: usize,
    img: Arc<Vec<u8>>,
    map: ImageMap,
    base: Walk,
}

fn make_subject(name: &'static str, per_level: usize, img: Arc<Vec<u8>>) -> Subject {
    let map = map_image(&img);
    let fs = butter::fs::Fs::open_device(Arc::new(butter::internals::RamDevice::new(img.to_vec())))
        .expect("undamaged image opens");
    let base = walk_everything(&fs).expect("undamaged image walks without error");
    Subject {
        name,
        per_level,
        img,
        map,
        base,
    }
}

static KERNEL: OnceLock<Subject> = OnceLock::new();
static ROOTDIR: OnceLock<Subject> = OnceLock::new();

fn kernel() -> Option<&'static Subject> {
    let img = kernel_image()?;
    Some(KERNEL.get_or_init(|| make_subject("kernel", 2, img)))
}

fn rootdir() -> Option<&'static Subject> {
    let img = rootdir_image()?;
    Some(ROOTDIR.get_or_init(|| make_subject("rootdir", 1, img)))
}

/// Trees a read-only walk reads: damage there must be caught. The others (extent, dev, uuid,
/// free space, data reloc) are never read by the read path.
fn walked(tree: u64) -> bool {
    matches!(
        tree,
        ROOT_TREE_OBJECTID | CHUNK_TREE_OBJECTID | FS_TREE_OBJECTID | CSUM_TREE_OBJECTID
    ) || (FIRST_FREE_OBJECTID..LAST_FREE_OBJECTID).contains(&tree)
}

struct Cases<'a> {
    s: &'a Subject,
    v: Vec<Case<'a>>,
}

impl<'a> Cases<'a> {
    fn new(s: &'a Subject) -> Self {
        Cases { s, v: Vec::new() }
    }
    fn add(&mut self, name: String, want: Want, f: impl FnOnce(&mut Vec<u8>) + 'a) {
        self.v
            .push(Case::new(format!("{}: {name}", self.s.name), f, want));
    }
    /// Damage to the chosen copies of one tree block.
    fn block(
        &mut self,
        name: String,
        b: &'a BlockInfo,
        which: Copies,
        reseal: bool,
        want: Want,
        f: impl Fn(&mut [u8]) + 'a,
    ) {
        let m: &'a ImageMap = &self.s.map;
        self.add(name, want, move |img| {
            patch_block(img, m, b, which, reseal, &f)
        });
    }
    fn sb(
        &mut self,
        name: &str,
        which: Copies,
        reseal: bool,
        want: Want,
        f: impl Fn(&mut [u8]) + 'a,
    ) {
        let m: &'a ImageMap = &self.s.map;
        self.add(name.to_string(), want, move |img| {
            patch_super(img, m, which, reseal, &f)
        });
    }
    fn run(self, test: &str) {
        let n = self.v.len();
        eprintln!("{test}: {n} cases");
        let failures = run_cases(self.v, &self.s.img, &self.s.base);
        assert!(
            failures.is_empty(),
            "{test}: {} of {n} cases failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

fn tag(b: &BlockInfo) -> String {
    format!(
        "tree {} level {} block {}",
        tree_name(b.tree),
        b.level,
        b.bytenr
    )
}

/// Up to `per_level` blocks (first, last, middle) of each level of each tree (walked trees
/// only when `walked_only`).
fn sample_blocks(m: &ImageMap, walked_only: bool, per_level: usize) -> Vec<&BlockInfo> {
    let mut out: Vec<&BlockInfo> = Vec::new();
    for &(tree, _, top) in &m.roots {
        if walked_only && !walked(tree) {
            continue;
        }
        for level in 0..=top {
            let bs = m.blocks_of(tree, level);
            let picks = [bs.first(), bs.last(), bs.get(bs.len() / 2)];
            for b in picks.into_iter().take(per_level).flatten() {
                if !out.iter().any(move |x| x.bytenr == b.bytenr) {
                    out.push(b);
                }
            }
        }
    }
    out
}

fn ino_of(s: &Subject, path: &str) -> u64 {
    s.base
        .entries
        .get(path)
        .unwrap_or_else(|| panic!("{path} in the image"))
        .inode
        .ino
}

/// The leaf and slot of the first item of `tree` matching `pred`.
fn item(m: &ImageMap, tree: u64, pred: impl Fn(&Key) -> bool) -> (&BlockInfo, usize) {
    *m.find_items(tree, pred)
        .first()
        .expect("item present in the image")
}

// ---------------------------------------------------------------------------------------------
// Superblock

fn superblock_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let has_mirror = m.sb_copies.len() > 1;
    assert!(
        has_mirror,
        "test images are big enough for a superblock mirror"
    );
    // One copy damaged: the mirror (or the primary) is used and nothing changes.
    c.sb(
        "primary: bit flip, not resealed",
        Copies::First,
        false,
        Want::Same,
        move |b| b[0x150] ^= 0x10,
    );
    c.sb(
        "primary: magic zeroed",
        Copies::First,
        false,
        Want::Same,
        move |b| put_u64(b, sbf::MAGIC, 0),
    );
    c.sb(
        "primary: zeroed",
        Copies::First,
        false,
        Want::Same,
        move |b| b.fill(0),
    );
    c.sb(
        "primary: nodesize 3000, resealed",
        Copies::First,
        true,
        Want::Same,
        move |b| put_u32(b, sbf::NODESIZE, 3000),
    );
    c.sb(
        "primary: root level 9, resealed",
        Copies::First,
        true,
        Want::Same,
        move |b| b[sbf::ROOT_LEVEL] = 9,
    );
    c.sb(
        "mirror: bit flip, not resealed",
        Copies::Second,
        false,
        Want::Same,
        move |b| b[0x200] ^= 1,
    );

    // Every copy damaged: a typed error naming the superblock.
    let all = Copies::All;
    c.sb(
        "all: bit flip, not resealed",
        all,
        false,
        want_err(&["superblock at byte 65536", "checksum mismatch"]),
        move |b| b[0x150] ^= 0x10,
    );
    c.sb(
        "all: zeroed",
        all,
        false,
        // No magic anywhere: not btrfs at all, as `btrfs check` says too.
        want_err(&["not a btrfs filesystem", "no btrfs magic"]),
        move |b| b.fill(0),
    );
    c.sb(
        "all: bad magic, resealed",
        all,
        true,
        want_err(&["not a btrfs filesystem", "no btrfs magic"]),
        move |b| b[sbf::MAGIC] ^= 0xff,
    );
    c.sb(
        "all: nodesize 3000",
        all,
        true,
        want_err(&["superblock", "bad nodesize 3000"]),
        move |b| put_u32(b, sbf::NODESIZE, 3000),
    );
    c.sb(
        "all: nodesize 1 MiB",
        all,
        true,
        want_err(&["superblock", "bad nodesize"]),
        move |b| put_u32(b, sbf::NODESIZE, 1 << 20),
    );
    c.sb(
        "all: sectorsize 0",
        all,
        true,
        want_err(&["superblock", "bad sectorsize 0"]),
        move |b| put_u32(b, sbf::SECTORSIZE, 0),
    );
    c.sb(
        "all: sectorsize 8192 > nodesize",
        all,
        true,
        want_err(&["superblock", "bad nodesize"]),
        move |b| put_u32(b, sbf::SECTORSIZE, 8192),
    );
    c.sb(
        "all: sys_chunk_array_size 4000",
        all,
        true,
        want_err(&["superblock", "sys_chunk_array_size 4000"]),
        move |b| put_u32(b, sbf::SYS_ARRAY_SIZE, 4000),
    );
    c.sb(
        "all: root level 8",
        all,
        true,
        want_err(&["superblock", "root level 8"]),
        move |b| b[sbf::ROOT_LEVEL] = 8,
    );
    c.sb(
        "all: chunk root level 200",
        all,
        true,
        want_err(&["superblock", "chunk root level 200"]),
        move |b| b[sbf::CHUNK_ROOT_LEVEL] = 200,
    );
    c.sb(
        "all: checksum type 7",
        all,
        true,
        want_err(&["superblock", "unknown checksum type 7"]),
        move |b| put_u16(b, sbf::CSUM_TYPE, 7),
    );
    c.sb(
        "all: bytenr field 0",
        all,
        true,
        want_err(&["superblock", "bytenr field says 0"]),
        move |b| put_u64(b, 48, 0),
    );
    c.sb(
        "all: two devices",
        all,
        true,
        want_err(&["superblock", "2 devices"]),
        move |b| put_u64(b, sbf::NUM_DEVICES, 2),
    );
    c.sb(
        "all: unknown incompat bit",
        all,
        true,
        want_err(&["superblock", "incompat"]),
        move |b| {
            let v = le_u64(b, sbf::INCOMPAT) | 1 << 40;
            put_u64(b, sbf::INCOMPAT, v)
        },
    );
    // Roots that point somewhere wrong.
    let root = le_u64(&s.img, 65536 + sbf::ROOT);
    let chunk_root = le_u64(&s.img, 65536 + sbf::CHUNK_ROOT);
    let fs_root = m.root_of(FS_TREE_OBJECTID).unwrap().bytenr;
    c.sb(
        "all: generation + 1",
        all,
        true,
        want_err(&[&format!("block {root}"), "generation"]),
        move |b| {
            let g = le_u64(b, sbf::GENERATION);
            put_u64(b, sbf::GENERATION, g + 1)
        },
    );
    c.sb(
        "all: root 0",
        all,
        true,
        want_err(&["block 0", "no chunk maps"]),
        move |b| put_u64(b, sbf::ROOT, 0),
    );
    c.sb(
        "all: root beyond every chunk",
        all,
        true,
        want_err(&["block 4611686018427387904", "no chunk maps"]),
        move |b| put_u64(b, sbf::ROOT, 1 << 62),
    );
    c.sb(
        "all: root u64::MAX aligned",
        all,
        true,
        want_err(&["block "]),
        move |b| put_u64(b, sbf::ROOT, !4095u64),
    );
    c.sb(
        "all: root unaligned",
        all,
        true,
        want_err(&["not sector aligned"]),
        move |b| put_u64(b, sbf::ROOT, root + 1),
    );
    c.sb(
        "all: root is the chunk root",
        all,
        true,
        want_err(&[&format!("block {chunk_root}")]),
        move |b| put_u64(b, sbf::ROOT, chunk_root),
    );
    c.sb(
        "all: root is the fs tree root",
        all,
        true,
        want_err(&[&format!("block {fs_root}")]),
        move |b| put_u64(b, sbf::ROOT, fs_root),
    );
    c.sb(
        "all: chunk root is the root tree",
        all,
        true,
        want_err(&[&format!("block {root}")]),
        move |b| put_u64(b, sbf::CHUNK_ROOT, root),
    );
    c.sb(
        "all: chunk root generation + 1",
        all,
        true,
        want_err(&[&format!("block {chunk_root}"), "generation"]),
        move |b| {
            let g = le_u64(b, sbf::CHUNK_ROOT_GEN);
            put_u64(b, sbf::CHUNK_ROOT_GEN, g + 1)
        },
    );
    c.sb(
        "all: root level + 1",
        all,
        true,
        want_err(&[&format!("block {root}"), "level"]),
        move |b| b[sbf::ROOT_LEVEL] += 1,
    );
    c.sb(
        "all: label rewritten (not checked by reads)",
        all,
        true,
        Want::Same,
        move |b| b[299..310].copy_from_slice(b"not-a-label"),
    );
    c.sb(
        "all: log root set (warned, ignored)",
        all,
        true,
        Want::Any,
        move |b| put_u64(b, sbf::LOG_ROOT, root),
    );
    // The sys_chunk_array: first entry is a key then a chunk item.
    let chunk = sbf::SYS_ARRAY + DISK_KEY_SIZE;
    c.sb(
        "sys_chunk_array: key type",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "not a CHUNK_ITEM"]),
        move |b| b[sbf::SYS_ARRAY + 8] = 1,
    );
    c.sb(
        "sys_chunk_array: zero stripes",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "zero stripes"]),
        move |b| put_u16(b, chunk + 44, 0),
    );
    c.sb(
        "sys_chunk_array: 300 stripes",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "need"]),
        move |b| put_u16(b, chunk + 44, 300),
    );
    c.sb(
        "sys_chunk_array: DUP with one stripe",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "stripes"]),
        move |b| put_u16(b, chunk + 44, 1),
    );
    c.sb(
        "sys_chunk_array: length 0",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "length 0"]),
        move |b| put_u64(b, chunk, 0),
    );
    c.sb(
        "sys_chunk_array: length overflows",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "overflows"]),
        move |b| put_u64(b, chunk, u64::MAX),
    );
    c.sb(
        "sys_chunk_array: size cuts the entry",
        all,
        true,
        want_err(&["sys_chunk_array byte 0"]),
        move |b| {
            let n = le_u32(b, sbf::SYS_ARRAY_SIZE);
            put_u32(b, sbf::SYS_ARRAY_SIZE, n - 1)
        },
    );
    c.sb(
        "sys_chunk_array: size 10",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "truncated key"]),
        move |b| put_u32(b, sbf::SYS_ARRAY_SIZE, 10),
    );
    c.sb(
        "sys_chunk_array: size 0",
        all,
        true,
        want_err(&["no chunk maps"]),
        move |b| put_u32(b, sbf::SYS_ARRAY_SIZE, 0),
    );
    c.sb(
        "sys_chunk_array: RAID5 profile",
        all,
        true,
        want_err(&["chunk"]),
        move |b| {
            let t = le_u64(b, chunk + 24);
            put_u64(
                b,
                chunk + 24,
                (t & !BLOCK_GROUP_PROFILE_MASK) | BLOCK_GROUP_RAID5,
            )
        },
    );
    c.sb(
        "sys_chunk_array: stripe 0 beyond the device",
        all,
        true,
        want_err(&["block "]),
        move |b| put_u64(b, chunk + 48 + 8, 1 << 40),
    );
    c.sb(
        "sys_chunk_array: stripe 0 offset near u64::MAX",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "stripe 0", "overflows"]),
        move |b| put_u64(b, chunk + 48 + 8, u64::MAX - 4096),
    );
    c.sb(
        "sys_chunk_array: both stripes near u64::MAX",
        all,
        true,
        want_err(&["sys_chunk_array byte 0", "overflows"]),
        move |b| {
            put_u64(b, chunk + 48 + 8, u64::MAX - 4096);
            put_u64(b, chunk + 48 + 32 + 8, u64::MAX - 4096)
        },
    );
    c.sb(
        "sys_chunk_array: chunk moved",
        all,
        true,
        want_err(&["no chunk maps"]),
        move |b| {
            let l = le_u64(b, sbf::SYS_ARRAY + 9);
            put_u64(b, sbf::SYS_ARRAY + 9, l + (64 << 20))
        },
    );
    c
}

// ---------------------------------------------------------------------------------------------
// Node headers (every field the validator checks) on sampled blocks of every walked tree.

fn header_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let all = Copies::All;
    for b in sample_blocks(m, true, s.per_level) {
        let t = tag(b);
        let blk = format!("block {}", b.bytenr);
        let n = b.nritems();
        let entry = if b.is_leaf() { ITEM_SIZE } else { KEY_PTR_SIZE };
        c.block(
            format!("{t}: nritems u32::MAX"),
            b,
            all,
            true,
            want_err(&[&blk, "claims"]),
            move |x| put_u32(x, hdr::NRITEMS, u32::MAX),
        );
        c.block(
            format!("{t}: nritems 200000"),
            b,
            all,
            true,
            want_err(&[&blk, "claims"]),
            move |x| put_u32(x, hdr::NRITEMS, 200_000),
        );
        let at = HEADER_SIZE + n * entry;
        let full = at + entry > m.nodesize;
        // In a nearly full leaf the longer item array runs over the
        // lowest item bodies; the first item whose body it covers is the
        // one reported (the kernel's leaves sometimes end up that full).
        let covered = if b.is_leaf() && !full {
            b.items.iter().position(|it| it.off < at + entry)
        } else {
            None
        };
        c.block(
            format!("{t}: nritems + 1 (zeroed entry)"),
            b,
            all,
            true,
            if full {
                want_err(&[&blk, "claims"])
            } else if let Some(slot) = covered {
                want_err(&[&blk, &format!("slot {slot}"), "overlaps the item array"])
            } else {
                want_err(&[&blk, &format!("slot {n}")])
            },
            move |x| {
                put_u32(x, hdr::NRITEMS, n as u32 + 1);
                if !full {
                    x[at..at + entry].fill(0);
                }
            },
        );
        let empty_ok = b.is_leaf() && b.parent.is_none();
        c.block(
            format!("{t}: nritems 0"),
            b,
            all,
            true,
            if empty_ok {
                Want::Any
            } else {
                want_err(&[&blk])
            },
            move |x| put_u32(x, hdr::NRITEMS, 0),
        );
        c.block(
            format!("{t}: level + 1"),
            b,
            all,
            true,
            want_err(&[&blk, "level"]),
            move |x| x[hdr::LEVEL] += 1,
        );
        c.block(
            format!("{t}: level 8"),
            b,
            all,
            true,
            want_err(&[&blk, "level 8"]),
            move |x| x[hdr::LEVEL] = 8,
        );
        c.block(
            format!("{t}: level 255"),
            b,
            all,
            true,
            want_err(&[&blk, "level 255"]),
            move |x| x[hdr::LEVEL] = 255,
        );
        c.block(
            format!("{t}: bytenr + 4096"),
            b,
            all,
            true,
            want_err(&[&blk, "header bytenr"]),
            move |x| {
                let v = le_u64(x, hdr::BYTENR);
                put_u64(x, hdr::BYTENR, v + 4096)
            },
        );
        c.block(
            format!("{t}: fsid"),
            b,
            all,
            true,
            want_err(&[&blk, "fsid"]),
            move |x| x[hdr::FSID + 3] ^= 0x40,
        );
        c.block(
            format!("{t}: generation + 1"),
            b,
            all,
            true,
            want_err(&[&blk, "generation"]),
            move |x| {
                let v = le_u64(x, hdr::GENERATION);
                put_u64(x, hdr::GENERATION, v + 1)
            },
        );
        c.block(
            format!("{t}: generation 0"),
            b,
            all,
            true,
            want_err(&[&blk, "generation"]),
            move |x| put_u64(x, hdr::GENERATION, 0),
        );
        let owner_checked = b.tree < FIRST_FREE_OBJECTID;
        c.block(
            format!("{t}: owner"),
            b,
            all,
            true,
            if owner_checked {
                want_err(&[&blk, "owner"])
            } else {
                Want::Any
            },
            move |x| put_u64(x, hdr::OWNER, 4242),
        );
        c.block(
            format!("{t}: chunk tree uuid (unchecked)"),
            b,
            all,
            true,
            Want::Any,
            move |x| x[hdr::CHUNK_UUID] ^= 1,
        );
        c.block(
            format!("{t}: header flip, not resealed"),
            b,
            all,
            false,
            want_err(&[&blk, "checksum mismatch"]),
            move |x| x[40] ^= 4,
        );
        c.block(
            format!("{t}: last byte flip, not resealed"),
            b,
            all,
            false,
            want_err(&[&blk, "checksum mismatch"]),
            move |x| {
                let l = x.len() - 1;
                x[l] ^= 0x80
            },
        );
        c.block(
            format!("{t}: zeroed"),
            b,
            all,
            false,
            want_err(&[&blk]),
            move |x| x.fill(0),
        );
    }
    // Trees the read path never reads: damage there changes nothing a reader sees.
    for tree in [
        EXTENT_TREE_OBJECTID,
        DEV_TREE_OBJECTID,
        FREE_SPACE_TREE_OBJECTID,
    ] {
        if let Some(b) = m.root_of(tree) {
            c.block(
                format!("{}: garbage (never read)", tag(b)),
                b,
                all,
                true,
                Want::Same,
                move |x| put_u32(x, hdr::NRITEMS, u32::MAX),
            );
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Leaf item records: offsets, sizes, keys.

fn item_header_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let all = Copies::All;
    for b in sample_blocks(m, true, s.per_level)
        .into_iter()
        .filter(move |b| b.is_leaf())
    {
        let n = b.nritems();
        if n == 0 {
            continue;
        }
        let mut slots = vec![0, n / 2, n - 1];
        slots.dedup();
        for k in slots {
            let t = format!("{} slot {k}", tag(b));
            let blk = format!("block {}", b.bytenr);
            let slot = format!("slot {k}");
            let at = item_at(k);
            c.block(
                format!("{t}: size + 1"),
                b,
                all,
                true,
                want_err(&[&blk, &slot]),
                move |x| {
                    let v = le_u32(x, at + 21);
                    put_u32(x, at + 21, v + 1)
                },
            );
            c.block(
                format!("{t}: size u32::MAX"),
                b,
                all,
                true,
                want_err(&[&blk, &slot]),
                move |x| put_u32(x, at + 21, u32::MAX),
            );
            c.block(
                format!("{t}: offset - 1"),
                b,
                all,
                true,
                want_err(&[&blk, &slot]),
                move |x| {
                    let v = le_u32(x, at + 17);
                    put_u32(x, at + 17, v.wrapping_sub(1))
                },
            );
            c.block(
                format!("{t}: offset u32::MAX"),
                b,
                all,
                true,
                want_err(&[&blk, &slot]),
                move |x| put_u32(x, at + 17, u32::MAX),
            );
            c.block(
                format!("{t}: offset 0 size 0"),
                b,
                all,
                true,
                want_err(&[&blk, &slot]),
                move |x| {
                    put_u32(x, at + 17, 0);
                    put_u32(x, at + 21, 0)
                },
            );
            if k > 0 {
                let prev = b.items[k - 1].key;
                c.block(
                    format!("{t}: key equals previous"),
                    b,
                    all,
                    true,
                    want_err(&[&blk, &slot, "not greater"]),
                    move |x| put_key(x, at, prev),
                );
            }
            if k + 1 < n {
                let next = format!("slot {}", k + 1);
                c.block(
                    format!("{t}: objectid u64::MAX"),
                    b,
                    all,
                    true,
                    want_err(&[&blk, &next, "not greater"]),
                    move |x| put_u64(x, at, u64::MAX),
                );
            } else {
                c.block(
                    format!("{t}: last key u64::MAX"),
                    b,
                    all,
                    true,
                    Want::Any,
                    move |x| put_u64(x, at, u64::MAX),
                );
            }
            c.block(
                format!("{t}: key type flipped"),
                b,
                all,
                true,
                Want::Any,
                move |x| x[at + 8] ^= 0x20,
            );
            c.block(
                format!("{t}: record flip, not resealed"),
                b,
                all,
                false,
                want_err(&[&blk, "checksum mismatch"]),
                move |x| x[at + 19] ^= 1,
            );
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Node key pointers: loops, out-of-range addresses, wrong generations and keys.

fn pointer_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let all = Copies::All;
    let data_addr = m.data.iter().find(|d| !d.prealloc).map(|d| d.disk_bytenr);
    for b in sample_blocks(m, true, s.per_level)
        .into_iter()
        .filter(move |b| !b.is_leaf())
    {
        let n = b.nritems();
        let mut slots = vec![0, n / 2, n - 1];
        slots.dedup();
        let blk = format!("block {}", b.bytenr);
        for k in slots {
            let t = format!("{} slot {k}", tag(b));
            let slot = format!("slot {k}");
            let at = ptr_at(k);
            let p = b.ptrs[k];
            let me = b.bytenr;
            c.block(
                format!("{t}: points to itself"),
                b,
                all,
                true,
                want_err(&[&blk, &slot, "points to itself"]),
                move |x| put_u64(x, at + 17, me),
            );
            if let Some((parent, _)) = b.parent {
                c.block(
                    format!("{t}: points to its parent (loop)"),
                    b,
                    all,
                    true,
                    want_err(&[&format!("block {parent}"), "level"]),
                    move |x| put_u64(x, at + 17, parent),
                );
            }
            if let Some(root) = m.root_of(b.tree).filter(|r| r.bytenr != b.bytenr) {
                let r = root.bytenr;
                c.block(
                    format!("{t}: points to the tree root (loop)"),
                    b,
                    all,
                    true,
                    want_err(&[&format!("block {r}"), "level"]),
                    move |x| put_u64(x, at + 17, r),
                );
            }
            c.block(
                format!("{t}: unaligned"),
                b,
                all,
                true,
                want_err(&[&blk, &slot, "not block aligned"]),
                move |x| put_u64(x, at + 17, p.blockptr + 1),
            );
            c.block(
                format!("{t}: zero"),
                b,
                all,
                true,
                want_err(&[&blk, &slot, "not block aligned"]),
                move |x| put_u64(x, at + 17, 0),
            );
            c.block(
                format!("{t}: beyond every chunk"),
                b,
                all,
                true,
                want_err(&["block 1125899906842624", "no chunk maps"]),
                move |x| put_u64(x, at + 17, 1 << 50),
            );
            c.block(
                format!("{t}: u64::MAX aligned"),
                b,
                all,
                true,
                want_err(&["block "]),
                move |x| put_u64(x, at + 17, !4095u64),
            );
            if let Some(d) = data_addr {
                c.block(
                    format!("{t}: into file data"),
                    b,
                    all,
                    true,
                    want_err(&[&format!("block {d}")]),
                    move |x| put_u64(x, at + 17, d),
                );
            }
            if k + 1 < n {
                let sib = b.ptrs[k + 1].blockptr;
                c.block(
                    format!("{t}: points to its sibling"),
                    b,
                    all,
                    true,
                    want_err(&[&format!("block {sib}")]),
                    move |x| put_u64(x, at + 17, sib),
                );
            }
            let g = b.generation;
            c.block(
                format!("{t}: generation newer than the node"),
                b,
                all,
                true,
                want_err(&[&blk, &slot, "newer than"]),
                move |x| put_u64(x, at + 25, g + 1),
            );
            let child = format!("block {}", p.blockptr);
            c.block(
                format!("{t}: generation older"),
                b,
                all,
                true,
                want_err(&[&child, "generation"]),
                move |x| put_u64(x, at + 25, p.generation - 1),
            );
            if k > 0 {
                let prev = b.ptrs[k - 1].key;
                c.block(
                    format!("{t}: key equals previous"),
                    b,
                    all,
                    true,
                    want_err(&[&blk, &slot, "not greater"]),
                    move |x| put_key(x, at, prev),
                );
            }
            if let Some(bumped) = p.key.successor() {
                let fits = k + 1 >= n || bumped < b.ptrs[k + 1].key;
                // Slot 0 of a non-root node must also match the parent's key: that fails first.
                let want = if k == 0 && b.parent.is_some() {
                    want_err(&["first key"])
                } else {
                    want_err(&[&child, "first key"])
                };
                if fits {
                    c.block(
                        format!("{t}: key no longer the child's first"),
                        b,
                        all,
                        true,
                        want,
                        move |x| put_key(x, at, bumped),
                    );
                }
            }
        }
        // A leaf linked twice: the last pointer takes the next node's first child, so iteration
        // meets that leaf twice and the lost leaf's inodes go missing.
        if b.level == 1 {
            if let Some((parent, ps)) = b.parent {
                let pb = m.block(parent);
                if ps + 1 < pb.ptrs.len() {
                    let right = m.block(pb.ptrs[ps + 1].blockptr);
                    let first = right.ptrs[0];
                    let at = ptr_at(n - 1);
                    c.block(
                        format!("{}: last pointer takes the right node's first leaf", tag(b)),
                        b,
                        all,
                        true,
                        Want::Err(vec![]),
                        move |x| {
                            put_key(x, at, first.key);
                            put_u64(x, at + 17, first.blockptr);
                            put_u64(x, at + 25, first.generation);
                        },
                    );
                }
            }
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Item bodies: sizes, lengths, offsets and references inside items.

fn patch_item(
    c: &mut Cases,
    name: &str,
    tree: u64,
    pred: impl Fn(&Key) -> bool,
    want: impl FnOnce(&BlockInfo, usize) -> Want,
    f: impl Fn(&mut [u8]) + 'static,
) {
    let m = &c.s.map;
    let (b, k) = item(m, tree, pred);
    let it = b.items[k];
    let w = want(b, k);
    let name = format!("{} slot {k} {}: {name}", tag(b), it.key);
    c.block(name, b, Copies::All, true, w, move |x| {
        f(&mut x[it.off..it.off + it.size])
    });
}

fn at_slot(parts: &'static [&'static str]) -> impl FnOnce(&BlockInfo, usize) -> Want {
    move |b, k| {
        let mut v = vec![format!("block {}", b.bytenr), format!("slot {k}")];
        v.extend(parts.iter().map(|s| s.to_string()));
        Want::Err(v)
    }
}

type WantFn = Box<dyn FnOnce(&BlockInfo, usize) -> Want>;

fn any(_: &BlockInfo, _: usize) -> Want {
    Want::Any
}

fn item_data_cases(s: &Subject) -> Cases<'_> {
    let mut c = Cases::new(s);
    let fs = FS_TREE_OBJECTID;
    let f1m = ino_of(s, "/x/1m");
    let dir = ino_of(s, "/many1");
    let tiny = ino_of(s, "/tiny");
    let d10k = ino_of(s, "/x/10k");
    let adir = ino_of(s, "/a");
    let is = move |o: u64, t: u8| move |k: &Key| k.objectid == o && k.ty == t;

    // INODE_ITEM
    for (name, v) in [
        ("size 2^62", 1u64 << 62),
        ("size u64::MAX", u64::MAX),
        ("size 0", 0),
    ] {
        patch_item(&mut c, name, fs, is(f1m, INODE_ITEM_KEY), any, move |b| {
            put_u64(b, 16, v)
        });
    }
    patch_item(
        &mut c,
        "nbytes u64::MAX",
        fs,
        is(f1m, INODE_ITEM_KEY),
        any,
        move |b| put_u64(b, 24, u64::MAX),
    );
    patch_item(
        &mut c,
        "file says directory",
        fs,
        is(f1m, INODE_ITEM_KEY),
        any,
        move |b| put_u32(b, 52, 0o040755),
    );
    patch_item(
        &mut c,
        "directory says file",
        fs,
        is(dir, INODE_ITEM_KEY),
        any,
        move |b| put_u32(b, 52, 0o100644),
    );
    patch_item(
        &mut c,
        "directory says symlink, size 2^40",
        fs,
        is(adir, INODE_ITEM_KEY),
        any,
        move |b| {
            put_u32(b, 52, 0o120777);
            put_u64(b, 16, 1 << 40)
        },
    );
    patch_item(
        &mut c,
        "file says symlink",
        fs,
        is(tiny, INODE_ITEM_KEY),
        any,
        move |b| put_u32(b, 52, 0o120777),
    );
    patch_item(
        &mut c,
        "nodatasum flag set",
        fs,
        is(f1m, INODE_ITEM_KEY),
        any,
        move |b| b[64] |= 1,
    );

    // DIR_INDEX / DIR_ITEM
    patch_item(
        &mut c,
        "name length 65535",
        fs,
        is(dir, DIR_INDEX_KEY),
        at_slot(&["dir item", "needs"]),
        move |b| put_u16(b, 27, 0xffff),
    );
    patch_item(
        &mut c,
        "name length 0",
        fs,
        is(dir, DIR_INDEX_KEY),
        at_slot(&["dir item", "empty name"]),
        move |b| put_u16(b, 27, 0),
    );
    patch_item(
        &mut c,
        "data length 65535",
        fs,
        is(dir, DIR_INDEX_KEY),
        at_slot(&["dir item", "needs"]),
        move |b| put_u16(b, 25, 0xffff),
    );
    patch_item(
        &mut c,
        "name length + 1",
        fs,
        is(dir, DIR_INDEX_KEY),
        at_slot(&["dir item"]),
        move |b| {
            let v = le_u16(b, 27);
            put_u16(b, 27, v + 1)
        },
    );
    patch_item(
        &mut c,
        "name length - 1 (two entries)",
        fs,
        is(dir, DIR_INDEX_KEY),
        at_slot(&["dir item"]),
        move |b| {
            let v = le_u16(b, 27);
            put_u16(b, 27, v - 1)
        },
    );
    patch_item(
        &mut c,
        "entry names a missing inode",
        fs,
        is(dir, DIR_INDEX_KEY),
        move |_, _| want_err(&["inode 999999"]),
        move |b| put_u64(b, 0, 999_999),
    );
    patch_item(
        &mut c,
        "entry points to its own directory (loop)",
        fs,
        is(dir, DIR_INDEX_KEY),
        any,
        move |b| put_u64(b, 0, dir),
    );
    patch_item(
        &mut c,
        "entry points to the top directory (loop)",
        fs,
        is(dir, DIR_INDEX_KEY),
        any,
        move |b| put_u64(b, 0, FIRST_FREE_OBJECTID),
    );
    patch_item(
        &mut c,
        "entry points to subvolume 5 (loop)",
        fs,
        is(dir, DIR_INDEX_KEY),
        any,
        move |b| put_key(b, 0, Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX)),
    );
    patch_item(
        &mut c,
        "entry points to a missing subvolume",
        fs,
        is(dir, DIR_INDEX_KEY),
        // An error naming the subvolume, or (like the kernel) an empty placeholder directory.
        any,
        move |b| put_key(b, 0, Key::new(77777, ROOT_ITEM_KEY, u64::MAX)),
    );
    patch_item(
        &mut c,
        "name changed (hash lookup misses)",
        fs,
        is(dir, DIR_ITEM_KEY),
        any,
        move |b| b[30] ^= 0x20,
    );
    patch_item(
        &mut c,
        "xattr value length 65535",
        fs,
        is(adir, XATTR_ITEM_KEY),
        at_slot(&["dir item"]),
        move |b| put_u16(b, 25, 0xffff),
    );

    // INODE_REF
    let f0 = ino_of(s, "/many1/f00000-");
    patch_item(
        &mut c,
        "name length 65535",
        fs,
        is(f0, INODE_REF_KEY),
        at_slot(&["inode ref"]),
        move |b| put_u16(b, 8, 0xffff),
    );
    patch_item(
        &mut c,
        "truncated name",
        fs,
        is(f0, INODE_REF_KEY),
        at_slot(&["inode ref"]),
        move |b| {
            let v = le_u16(b, 8);
            put_u16(b, 8, v + 3)
        },
    );
    // The parent of an inode is its INODE_REF key offset: make the file its own parent, and
    // make /a and /a/b each other's parent.
    {
        let m = &c.s.map;
        let (b, k) = item(m, fs, is(f0, INODE_REF_KEY));
        let at = item_at(k);
        c.block(
            format!("{}: inode {f0} is its own parent (loop)", tag(b)),
            b,
            Copies::All,
            true,
            want_err(&[&format!("inode {f0}"), "loop"]),
            move |x| put_u64(x, at + 9, f0),
        );
        let (a, ab) = (ino_of(s, "/a"), ino_of(s, "/a/b"));
        let (b, k) = item(m, fs, is(a, INODE_REF_KEY));
        let at = item_at(k);
        c.block(
            format!("{}: /a's parent is /a/b (cycle)", tag(b)),
            b,
            Copies::All,
            true,
            Want::Err(vec![]),
            move |x| put_u64(x, at + 9, ab),
        );
    }

    // EXTENT_DATA (regular)
    let reg = move |k: &Key| k.objectid == f1m && k.ty == EXTENT_DATA_KEY;
    for (name, off, v, want) in [
        (
            "disk_bytenr beyond every chunk",
            21,
            1u64 << 50,
            &["no chunk maps"][..],
        ),
        (
            "disk_bytenr u64::MAX aligned",
            21,
            !4095u64,
            &["not sector aligned or overflows"][..],
        ),
        ("disk_bytenr unaligned", 21, 0, &["not sector aligned"][..]),
        ("disk_num_bytes 0", 29, 0, &["disk_num_bytes"][..]),
        (
            "disk_num_bytes u64::MAX",
            29,
            u64::MAX,
            &["not sector aligned"][..],
        ),
        ("offset u64::MAX", 37, u64::MAX, &["file extent"][..]),
        ("offset 2^40", 37, 1 << 40, &["disk_num_bytes"][..]),
        ("num_bytes u64::MAX", 45, u64::MAX, &[][..]),
        ("ram_bytes u64::MAX", 8, u64::MAX, &[][..]),
    ] {
        let want: WantFn = if want.is_empty() {
            Box::new(any)
        } else {
            let parts: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            Box::new(move |b: &BlockInfo, k: usize| {
                let mut v = vec![format!("block {}", b.bytenr), format!("slot {k}")];
                v.extend(parts);
                Want::Err(v)
            })
        };
        let unaligned = name.contains("unaligned");
        patch_item(&mut c, name, fs, reg, want, move |b| {
            if unaligned {
                let d = le_u64(b, 21);
                put_u64(b, 21, d + 1)
            } else {
                put_u64(b, off, v)
            }
        });
    }
    patch_item(
        &mut c,
        "type 9",
        fs,
        reg,
        at_slot(&["unknown type 9"]),
        move |b| b[20] = 9,
    );
    patch_item(&mut c, "compression 1 (zlib)", fs, reg, any, move |b| {
        b[16] = 1
    });
    patch_item(
        &mut c,
        "compression 1, disk_num_bytes 1000",
        fs,
        reg,
        any,
        move |b| {
            b[16] = 1;
            put_u64(b, 29, 1000)
        },
    );
    patch_item(&mut c, "compression 200", fs, reg, any, move |b| {
        b[16] = 200
    });
    patch_item(
        &mut c,
        "encryption 1",
        fs,
        reg,
        move |_, _| want_err(&["inode "]),
        move |b| b[17] = 1,
    );
    patch_item(&mut c, "prealloc type", fs, reg, any, move |b| {
        b[20] = FILE_EXTENT_PREALLOC
    });
    patch_item(&mut c, "regular says inline", fs, reg, any, move |b| {
        b[20] = FILE_EXTENT_INLINE
    });
    let inl = move |k: &Key| k.objectid == tiny && k.ty == EXTENT_DATA_KEY;
    patch_item(
        &mut c,
        "inline says regular (short body)",
        fs,
        inl,
        at_slot(&["file extent", "need"]),
        move |b| b[20] = FILE_EXTENT_REG,
    );
    patch_item(
        &mut c,
        "inline compressed, ram_bytes 2^40",
        fs,
        inl,
        at_slot(&["ram_bytes"]),
        move |b| {
            b[16] = 2;
            put_u64(b, 8, 1 << 40)
        },
    );
    patch_item(&mut c, "inline compressed", fs, inl, any, move |b| {
        b[16] = 3
    });
    let ten = move |k: &Key| k.objectid == d10k && k.ty == EXTENT_DATA_KEY;
    patch_item(
        &mut c,
        "hardlinked file: disk_num_bytes 4096",
        fs,
        ten,
        any,
        move |b| put_u64(b, 29, 4096),
    );

    // EXTENT_CSUM: a wrong checksum is a data checksum error naming the inode.
    patch_item(
        &mut c,
        "first checksum flipped",
        CSUM_TREE_OBJECTID,
        move |k| k.ty == EXTENT_CSUM_KEY,
        move |_, _| want_err(&["data checksum mismatch", "inode "]),
        move |b| b[0] ^= 1,
    );

    // Root tree items.
    let root = ROOT_TREE_OBJECTID;
    let rootitem = move |id: u64| move |k: &Key| k.objectid == id && k.ty == ROOT_ITEM_KEY;
    let extent_root = c.s.map.root_of(EXTENT_TREE_OBJECTID).unwrap().bytenr;
    let fs_root = c.s.map.root_of(FS_TREE_OBJECTID).unwrap().bytenr;
    patch_item(
        &mut c,
        "fs tree root is the extent root",
        root,
        rootitem(FS_TREE_OBJECTID),
        move |_, _| want_err(&[&format!("block {extent_root}")]),
        move |b| put_u64(b, 176, extent_root),
    );
    patch_item(
        &mut c,
        "fs tree level 8",
        root,
        rootitem(FS_TREE_OBJECTID),
        at_slot(&["root item", "level 8"]),
        move |b| b[238] = 8,
    );
    patch_item(
        &mut c,
        "fs tree level + 1",
        root,
        rootitem(FS_TREE_OBJECTID),
        move |_, _| want_err(&[&format!("block {fs_root}"), "level"]),
        move |b| b[238] += 1,
    );
    patch_item(
        &mut c,
        "fs tree generation + 1",
        root,
        rootitem(FS_TREE_OBJECTID),
        move |_, _| want_err(&[&format!("block {fs_root}"), "generation"]),
        move |b| {
            let g = le_u64(b, 160);
            put_u64(b, 160, g + 1)
        },
    );
    patch_item(
        &mut c,
        "csum tree beyond every chunk",
        root,
        rootitem(CSUM_TREE_OBJECTID),
        move |_, _| want_err(&["no chunk maps"]),
        move |b| put_u64(b, 176, 1 << 50),
    );
    patch_item(
        &mut c,
        "csum tree root is the fs root",
        root,
        rootitem(CSUM_TREE_OBJECTID),
        move |_, _| want_err(&[&format!("block {fs_root}")]),
        move |b| put_u64(b, 176, fs_root),
    );
    if c.s.map.root_of(FIRST_FREE_OBJECTID).is_some() {
        let sv = FIRST_FREE_OBJECTID;
        patch_item(
            &mut c,
            "subvolume root_dirid 999",
            root,
            rootitem(sv),
            any,
            move |b| put_u64(b, 168, 999),
        );
        patch_item(
            &mut c,
            "subvolume root is the fs root",
            root,
            rootitem(sv),
            any,
            move |b| put_u64(b, 176, fs_root),
        );
        patch_item(
            &mut c,
            "subvolume generation - 1",
            root,
            rootitem(sv),
            move |_, _| want_err(&["generation"]),
            move |b| {
                let g = le_u64(b, 160);
                put_u64(b, 160, g - 1)
            },
        );
        patch_item(
            &mut c,
            "backref name length 65535",
            root,
            move |k| k.objectid == sv && k.ty == ROOT_BACKREF_KEY,
            at_slot(&["root ref"]),
            move |b| put_u16(b, 16, 0xffff),
        );
        let m = &c.s.map;
        let (b, k) = item(m, root, move |k| {
            k.objectid == sv && k.ty == ROOT_BACKREF_KEY
        });
        let at = item_at(k);
        c.block(
            format!("{}: subvolume {sv} is its own parent (loop)", tag(b)),
            b,
            Copies::All,
            true,
            Want::Any,
            move |x| put_u64(x, at + 9, sv),
        );
    }

    // Chunk tree: the chunk items that map every tree block after the system chunk.
    let ch = CHUNK_TREE_OBJECTID;
    let meta =
        c.s.map
            .chunks
            .iter()
            .find(move |x| x.2 & BLOCK_GROUP_METADATA != 0)
            .map(move |x| x.0)
            .unwrap();
    let chunk = move |k: &Key| k.ty == CHUNK_ITEM_KEY && k.offset == meta;
    patch_item(
        &mut c,
        "metadata chunk: zero stripes",
        ch,
        chunk,
        at_slot(&["zero stripes"]),
        move |b| put_u16(b, 44, 0),
    );
    patch_item(
        &mut c,
        "metadata chunk: 300 stripes",
        ch,
        chunk,
        at_slot(&["need"]),
        move |b| put_u16(b, 44, 300),
    );
    patch_item(
        &mut c,
        "metadata chunk: length 0",
        ch,
        chunk,
        at_slot(&["length 0"]),
        move |b| put_u64(b, 0, 0),
    );
    patch_item(
        &mut c,
        "metadata chunk: length u64::MAX",
        ch,
        chunk,
        at_slot(&["overflows"]),
        move |b| put_u64(b, 0, u64::MAX),
    );
    patch_item(
        &mut c,
        "metadata chunk: length 4096",
        ch,
        chunk,
        move |_, _| want_err(&["no chunk maps"]),
        move |b| put_u64(b, 0, 4096),
    );
    patch_item(
        &mut c,
        "metadata chunk: RAID6",
        ch,
        chunk,
        move |_, _| want_err(&["chunk"]),
        move |b| {
            let t = le_u64(b, 24);
            put_u64(b, 24, (t & !BLOCK_GROUP_PROFILE_MASK) | BLOCK_GROUP_RAID6)
        },
    );
    patch_item(
        &mut c,
        "metadata chunk: stripe 0 near u64::MAX",
        ch,
        chunk,
        at_slot(&["stripe 0", "overflows"]),
        move |b| put_u64(b, 48 + 8, u64::MAX - 8192),
    );
    patch_item(
        &mut c,
        "metadata chunk: both stripes near u64::MAX",
        ch,
        chunk,
        at_slot(&["overflows"]),
        move |b| {
            put_u64(b, 48 + 8, u64::MAX - 8192);
            if le_u16(b, 44) > 1 {
                put_u64(b, 48 + 32 + 8, u64::MAX - 8192)
            }
        },
    );
    patch_item(
        &mut c,
        "metadata chunk: both stripes beyond the device",
        ch,
        chunk,
        move |_, _| want_err(&["block "]),
        move |b| {
            put_u64(b, 48 + 8, 1 << 40);
            if le_u16(b, 44) > 1 {
                put_u64(b, 48 + 32 + 8, (1 << 40) + (1 << 30))
            }
        },
    );
    patch_item(
        &mut c,
        "metadata chunk: other devid",
        ch,
        chunk,
        move |_, _| want_err(&["missing device"]),
        move |b| {
            for i in 0..le_u16(b, 44) as usize {
                put_u64(b, 48 + 32 * i, 9)
            }
        },
    );
    c
}

// ---------------------------------------------------------------------------------------------
// One copy damaged: the other DUP copy must give exactly the undamaged result.

fn one_copy_cases(s: &Subject, seed: u64) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    // Physical offsets of both copies of every DUP block.
    let dup: std::rc::Rc<Vec<[usize; 2]>> = std::rc::Rc::new(
        m.blocks
            .values()
            .filter(|b| b.copies.len() > 1)
            .map(|b| [b.copies[0] as usize, b.copies[1] as usize])
            .collect(),
    );
    assert!(!dup.is_empty(), "metadata is DUP");
    let ns = m.nodesize;
    let ct = m.csum_type;
    // Every block at once.
    type Damage = fn(&mut [u8], usize, usize, butter::format::csum::CsumType);
    let kinds: [(&str, Damage); 4] = [
        ("bit-flipped", |img, p, _, _| img[p + 200] ^= 0x08),
        ("zeroed", |img, p, ns, _| img[p..p + ns].fill(0)),
        ("nritems u32::MAX, resealed", |img, p, ns, ct| {
            put_u32(&mut img[p..p + ns], hdr::NRITEMS, u32::MAX);
            reseal(ct, &mut img[p..p + ns]);
        }),
        ("generation + 1, resealed", |img, p, ns, ct| {
            let g = le_u64(&img[p..], hdr::GENERATION);
            put_u64(&mut img[p..p + ns], hdr::GENERATION, g + 1);
            reseal(ct, &mut img[p..p + ns]);
        }),
    ];
    for pick in [0, 1] {
        for (label, f) in kinds {
            let dup = dup.clone();
            c.add(
                format!("every block's copy {pick} {label}"),
                Want::Same,
                move |img| {
                    for b in dup.iter() {
                        f(img, b[pick], ns, ct);
                    }
                },
            );
        }
    }
    c.add(
        "primary superblock and every block's copy 0 damaged".into(),
        Want::Same,
        move |img| {
            img[65536 + 100] ^= 1;
            for b in dup.iter() {
                img[b[0] + 64] ^= 1;
            }
        },
    );
    // Sampled blocks, one copy, many kinds of damage.
    let mut rng = Rng(seed | 1);
    for b in sample_blocks(m, false, s.per_level)
        .into_iter()
        .filter(move |b| b.copies.len() > 1)
    {
        for which in [Copies::First, Copies::Second] {
            let t = format!("{} {which:?}", tag(b));
            let byte = 32 + rng.below(ns as u64 - 32) as usize;
            let bit = 1u8 << rng.below(8);
            c.block(
                format!("{t}: random bit {byte}.{bit}"),
                b,
                which,
                false,
                Want::Same,
                move |x| x[byte] ^= bit,
            );
            c.block(
                format!("{t}: level + 1, resealed"),
                b,
                which,
                true,
                Want::Same,
                move |x| x[hdr::LEVEL] += 1,
            );
            c.block(
                format!("{t}: bytenr wrong, resealed"),
                b,
                which,
                true,
                Want::Same,
                move |x| {
                    let v = le_u64(x, hdr::BYTENR);
                    put_u64(x, hdr::BYTENR, v ^ 0x10000)
                },
            );
            if b.is_leaf() && b.nritems() > 1 {
                let at = item_at(b.nritems() / 2);
                c.block(
                    format!("{t}: item size + 1, resealed"),
                    b,
                    which,
                    true,
                    Want::Same,
                    move |x| {
                        let v = le_u32(x, at + 21);
                        put_u32(x, at + 21, v + 1)
                    },
                );
            }
            if !b.is_leaf() {
                let at = ptr_at(0);
                let me = b.bytenr;
                c.block(
                    format!("{t}: pointer to itself, resealed"),
                    b,
                    which,
                    true,
                    Want::Same,
                    move |x| put_u64(x, at + 17, me),
                );
            }
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Data blocks.

fn data_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let ss = m.sectorsize;
    // Extents with checksums, in the top-level subvolume and elsewhere, picking a sector inside
    // the referenced range.
    let mut picked = 0;
    let mut seen_roots = Vec::new();
    for d in m.data.iter().filter(|d| !d.prealloc && d.compression == 0) {
        let sector = d.offset / ss * ss + ((d.num_bytes / ss) / 2) * ss;
        let logical = d.disk_bytenr + sector;
        if !m.csummed.contains(&logical) || sector < d.offset {
            continue;
        }
        if picked >= 6 && seen_roots.contains(&d.root) {
            continue;
        }
        seen_roots.push(d.root);
        picked += 1;
        let file_offset = d.file_offset + sector - d.offset;
        let (ino, root) = (d.ino, d.root);
        let copies = d.copies.clone();
        let name = format!(
            "data of inode {ino} in tree {root}, file offset {file_offset}, logical {logical}"
        );
        let exact = Want::Err(vec![format!(
            "data checksum mismatch: inode {ino} in tree {root}, file offset {file_offset}, logical {logical}"
        )]);
        if copies.len() > 1 {
            let p0 = copies[0] + sector;
            c.add(format!("{name}: copy 0 only"), Want::Same, move |img| {
                img[p0 as usize + 7] ^= 0x20
            });
            let p1 = copies[1] + sector;
            c.add(format!("{name}: copy 1 only"), Want::Same, move |img| {
                img[p1 as usize] ^= 1
            });
        }
        let cs = copies.clone();
        c.add(format!("{name}: every copy"), exact, move |img| {
            for p in &cs {
                img[(p + sector) as usize + 100] ^= 0x01;
            }
        });
    }
    assert!(picked > 0, "the image has checksummed data");
    // Data without checksums (nodatasum) reads back whatever is there.
    if let Some(e) = s.base.entries.get("/x/nocow") {
        let ino = e.inode.ino;
        if let Some(d) = m
            .data
            .iter()
            .find(|d| d.ino == ino && d.root == FS_TREE_OBJECTID)
        {
            let p = d.copies[0];
            c.add(
                format!("nodatasum inode {ino}: data changed"),
                Want::Any,
                move |img| img[p as usize] ^= 0xff,
            );
        }
    }
    // Preallocated, unwritten ranges read as zeros whatever the disk holds.
    if let Some(e) = s.base.entries.get("/x/prealloc") {
        let ino = e.inode.ino;
        if let Some(d) = m.data.iter().find(|d| d.ino == ino && d.prealloc) {
            let p = d.copies[0] + d.offset;
            c.add(
                format!("prealloc inode {ino}: garbage in the unwritten range"),
                Want::Same,
                move |img| img[p as usize..p as usize + 4096].fill(0xa5),
            );
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Truncated images.

fn truncation_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let sb_end = 65536 + 4096u64;
    let chunk_root = le_u64(&s.img, 65536 + sbf::CHUNK_ROOT);
    let chunk_phys = m.block(chunk_root).copies[0];
    let meta = m
        .chunks
        .iter()
        .find(move |x| x.2 & BLOCK_GROUP_METADATA != 0)
        .unwrap();
    let mut points: Vec<(u64, Want)> = vec![
        // No superblock magic within the file: not btrfs at all.
        (0, want_err(&["not a btrfs filesystem", "empty"])),
        (4096, want_err(&["not a btrfs filesystem", "all zeroes"])),
        (65536, want_err(&["not a btrfs filesystem", "all zeroes"])),
        (65536 + 2048, want_err(&["superblock", "too small"])),
        (sb_end - 1, want_err(&["superblock", "too small"])),
        (sb_end, want_err(&["block "])),
        (1 << 20, want_err(&["block "])),
        (chunk_phys, want_err(&["block "])),
        (chunk_phys + 100, want_err(&["block "])),
        (meta.3[0], want_err(&["block "])),
        (meta.3[0] + meta.1 / 2, Want::Any),
        (m.used_end - 1, Want::Any),
        (m.used_end, Want::Same),
        (s.img.len() as u64 - 1, Want::Same),
    ];
    if meta.3.len() > 1 {
        points.push((meta.3[1], Want::Any));
        points.push((meta.3[1] + 4096, Want::Any));
    }
    for (len, want) in points {
        c.add(format!("truncated to {len} bytes"), want, move |img| {
            img.truncate(len as usize)
        });
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Device read errors.

fn fault_cases(s: &Subject) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let ns = m.nodesize as u64;
    let copy0: Vec<std::ops::Range<u64>> = m
        .blocks
        .values()
        .filter(move |b| b.copies.len() > 1)
        .map(move |b| b.copies[0]..b.copies[0] + ns)
        .collect();
    let fs_root = m.root_of(FS_TREE_OBJECTID).unwrap();
    let both: Vec<std::ops::Range<u64>> = fs_root.copies.iter().map(|&p| p..p + ns).collect();
    let d = m
        .data
        .iter()
        .find(|d| !d.prealloc && d.root == FS_TREE_OBJECTID)
        .unwrap();
    let data: Vec<std::ops::Range<u64>> =
        d.copies.iter().map(|&p| p..p + d.disk_num_bytes).collect();
    let fsb = format!("block {}", fs_root.bytenr);
    for (name, ranges, want) in [
        ("read errors on every block's copy 0", copy0, Want::Same),
        (
            "read errors on both copies of the fs tree root",
            both,
            want_err(&[&fsb, "injected"]),
        ),
        (
            "read errors on a data extent",
            data,
            want_err(&["logical ", "injected"]),
        ),
    ] {
        let mut case = Case::new(format!("{}: {name}", s.name), |_| {}, want);
        case.faults = Some(butter::internals::Faults {
            bad_read_ranges: ranges,
            ..Default::default()
        });
        c.v.push(case);
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Random damage, resealed, every copy: the outcome may be anything but a panic, hang,
// oversized allocation or an error without a location.

fn random_cases(s: &Subject, seed: u64) -> Cases<'_> {
    let m = &s.map;
    let mut c = Cases::new(s);
    let n: usize = std::env::var("BUTTER_CORRUPT_RANDOM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let blocks: Vec<&BlockInfo> = m.blocks.values().filter(move |b| walked(b.tree)).collect();
    let mut rng = Rng(seed | 1);
    const INTERESTING: [u64; 10] = [
        0,
        1,
        4095,
        4096,
        0x7fff_ffff,
        0xffff_ffff,
        1 << 32,
        1 << 62,
        i64::MAX as u64,
        u64::MAX,
    ];
    for i in 0..n {
        let b = blocks[rng.below(blocks.len() as u64) as usize];
        // Mostly the header, item records and pointers; sometimes anywhere in the block.
        let hot = HEADER_SIZE + b.nritems() * if b.is_leaf() { ITEM_SIZE } else { KEY_PTR_SIZE };
        let span = if rng.below(3) == 0 {
            m.nodesize
        } else {
            hot.min(m.nodesize)
        };
        let at = 32 + rng.below((span - 32) as u64) as usize;
        let kind = rng.below(3);
        let v = INTERESTING[rng.below(INTERESTING.len() as u64) as usize];
        let bit = 1u8 << rng.below(8);
        let what = match kind {
            0 => format!("bit {bit:#x} of byte {at}"),
            1 => format!("u32 {:#x} at {at}", v as u32),
            _ => format!("u64 {v:#x} at {at}"),
        };
        c.block(
            format!("random #{i} {}: {what}", tag(b)),
            b,
            Copies::All,
            true,
            Want::Any,
            move |x| {
                let l = x.len();
                match kind {
                    0 => x[at] ^= bit,
                    1 => {
                        let at = at.min(l - 4);
                        put_u32(x, at, v as u32)
                    }
                    _ => {
                        let at = at.min(l - 8);
                        put_u64(x, at, v)
                    }
                }
            },
        );
    }
    // Random superblock fields (every copy, resealed).
    for i in 0..n / 4 {
        let at = 32 + rng.below(811 + 400 - 32) as usize;
        let bit = 1u8 << rng.below(8);
        c.sb(
            &format!("random superblock #{i}: bit {bit:#x} of byte {at}"),
            Copies::All,
            true,
            Want::Any,
            move |x| x[at] ^= bit,
        );
    }
    c
}

// ---------------------------------------------------------------------------------------------

macro_rules! image_tests {
    ($subject:ident, $($name:ident => $body:expr;)*) => {
        $(
            #[test]
            fn $name() {
                let Some(s) = $subject() else { return };
                let f: fn(&'static Subject) -> Cases<'static> = $body;
                f(s).run(stringify!($name));
            }
        )*
    };
}

image_tests! { kernel,
    kernel_superblock => |s| superblock_cases(s);
    kernel_node_headers => |s| header_cases(s);
    kernel_item_headers => |s| item_header_cases(s);
    kernel_node_pointers => |s| pointer_cases(s);
    kernel_item_data => |s| item_data_cases(s);
    kernel_one_copy => |s| one_copy_cases(s, 0x5eed_0001);
    kernel_data_blocks => |s| data_cases(s);
    kernel_truncated => |s| truncation_cases(s);
    kernel_read_faults => |s| fault_cases(s);
    kernel_random => |s| random_cases(s, 0xc0ff_ee00_0001);
}

image_tests! { rootdir,
    rootdir_superblock => |s| superblock_cases(s);
    rootdir_node_headers => |s| header_cases(s);
    rootdir_one_copy => |s| one_copy_cases(s, 0x5eed_0002);
    rootdir_data_blocks => |s| data_cases(s);
    rootdir_truncated => |s| truncation_cases(s);
    rootdir_random => |s| random_cases(s, 0xc0ff_ee00_0002);
}

/// The undamaged images walk identically through the strict and tolerant walkers and cover
/// the read surface (guards the suite itself).
#[test]
fn baseline_covers_the_read_surface() {
    for s in [kernel(), rootdir()].into_iter().flatten() {
        let st = s.base.stats;
        assert!(
            st.dirs >= 8 && st.files >= 300 && st.symlinks >= 2,
            "{}: {st:?}",
            s.name
        );
        assert!(
            st.xattrs >= 40 && st.bytes_read > 4 << 20,
            "{}: {st:?}",
            s.name
        );
        assert!(
            s.map.max_level(FS_TREE_OBJECTID) >= 1,
            "{}: the fs tree has nodes",
            s.name
        );
        for e in s.base.entries.values() {
            assert!(e.lookup_agrees, "{}: {e:?}", s.name);
        }
    }
}

/// The memory check itself: an allocation sized by a damaged value would be seen and judged a
/// failure.
#[test]
fn harness_flags_large_allocations() {
    use corrupt_support::alloc_track;
    alloc_track::arm();
    let v = std::hint::black_box(vec![7u8; 5 << 20]);
    drop(v);
    let r = alloc_track::disarm();
    assert!(r.max_single >= 5 << 20 && r.peak_live >= 5 << 20, "{r:?}");
    let o = Outcome {
        open: Ok(()),
        walk: Some(Walk::default()),
        errors: Vec::new(),
        alloc: r,
        elapsed: std::time::Duration::ZERO,
    };
    let verdict = judge(&Want::Any, &o, &Walk::default());
    assert!(
        verdict.as_ref().is_err_and(|e| e.starts_with("MEMORY")),
        "{verdict:?}"
    );
}

/// Errors without a location are failures even when any outcome is allowed.
#[test]
fn harness_requires_a_location() {
    let o = Outcome {
        open: Err(butter::Error::Unsupported("compression 3".into())),
        walk: None,
        errors: Vec::new(),
        alloc: Default::default(),
        elapsed: std::time::Duration::ZERO,
    };
    assert!(judge(&Want::Any, &o, &Walk::default()).is_err());
}
