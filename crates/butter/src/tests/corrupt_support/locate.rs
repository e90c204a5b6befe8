//! Finds the structures of an image through the engine itself (so damage lands exactly on a
//! node header, an item header, an item body, a key pointer or a data block) and damages them.
//!
//! [`map_image`] opens the undamaged image, walks every tree from the superblock (chunk tree,
//! root tree) and from every ROOT_ITEM, and records each tree block once with its tree, level,
//! parent slot, items and pointers, and the physical offset of each copy (through
//! `Disk::chunk_map`). File data extents and the sectors that have data checksums are recorded
//! too.

#![allow(dead_code)]

use butter::ctree::{Root, TreeIter};
use butter::format::csum::CsumType;
use butter::format::header::KeyPtr;
use butter::format::items::{FileExtentBody, FileExtentItem, RootItem};
use butter::format::*;
use butter::internals::RamDevice;
use butter::io::disk_io::{Disk, Expect, Readahead};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// A leaf item: key, absolute byte offset of its body in the block, body size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ItemInfo {
    pub key: Key,
    pub off: usize,
    pub size: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct BlockInfo {
    /// The tree the walk reached it through first.
    pub tree: u64,
    pub bytenr: u64,
    pub level: u8,
    pub generation: u64,
    pub owner: u64,
    /// (parent bytenr, slot in the parent); None for a tree root.
    pub parent: Option<(u64, usize)>,
    /// Physical offset of every copy.
    pub copies: Vec<u64>,
    pub items: Vec<ItemInfo>,
    pub ptrs: Vec<KeyPtr>,
}

impl BlockInfo {
    pub(crate) fn is_leaf(&self) -> bool {
        self.level == 0
    }
    pub(crate) fn nritems(&self) -> usize {
        if self.is_leaf() {
            self.items.len()
        } else {
            self.ptrs.len()
        }
    }
}

/// A regular file extent with data on disk.
#[derive(Debug, Clone)]
pub(crate) struct DataExtent {
    pub root: u64,
    pub ino: u64,
    pub file_offset: u64,
    pub disk_bytenr: u64,
    pub disk_num_bytes: u64,
    pub offset: u64,
    pub num_bytes: u64,
    pub compression: u8,
    pub prealloc: bool,
    /// Physical offset of `disk_bytenr` in each copy.
    pub copies: Vec<u64>,
}

#[derive(Debug, Clone)]
pub(crate) struct ImageMap {
    pub nodesize: usize,
    pub sectorsize: u64,
    pub csum_type: CsumType,
    pub generation: u64,
    /// Byte offsets of the superblock copies that fit on the device.
    pub sb_copies: Vec<u64>,
    /// (tree id, root bytenr, root level)
    pub roots: Vec<(u64, u64, u8)>,
    /// Every tree block, once, keyed by logical address.
    pub blocks: BTreeMap<u64, BlockInfo>,
    pub data: Vec<DataExtent>,
    /// Logical addresses of data sectors that have a checksum.
    pub csummed: HashSet<u64>,
    /// (logical, length, type flags, physical offset of each stripe)
    pub chunks: Vec<(u64, u64, u64, Vec<u64>)>,
    /// One past the highest physical byte any tree block, data extent or superblock uses.
    pub used_end: u64,
}

impl ImageMap {
    pub(crate) fn block(&self, bytenr: u64) -> &BlockInfo {
        &self.blocks[&bytenr]
    }
    /// Blocks of one tree at one level, in logical order.
    pub(crate) fn blocks_of(&self, tree: u64, level: u8) -> Vec<&BlockInfo> {
        self.blocks
            .values()
            .filter(|b| b.tree == tree && b.level == level)
            .collect()
    }
    pub(crate) fn root_of(&self, tree: u64) -> Option<&BlockInfo> {
        self.roots
            .iter()
            .find(|r| r.0 == tree)
            .map(|r| self.block(r.1))
    }
    pub(crate) fn max_level(&self, tree: u64) -> u8 {
        self.root_of(tree).map(|b| b.level).unwrap_or(0)
    }
    /// Leaves holding items of `tree` that match `pred`, as (block, slot).
    pub(crate) fn find_items(
        &self,
        tree: u64,
        pred: impl Fn(&Key) -> bool,
    ) -> Vec<(&BlockInfo, usize)> {
        let mut out = Vec::new();
        for b in self.blocks.values() {
            if b.tree != tree || !b.is_leaf() {
                continue;
            }
            for (i, it) in b.items.iter().enumerate() {
                if pred(&it.key) {
                    out.push((b, i));
                }
            }
        }
        out
    }
}

fn ram(bytes: &[u8]) -> Arc<RamDevice> {
    Arc::new(RamDevice::new(bytes.to_vec()))
}

/// Maps an undamaged image. Panics if the image does not open (it is the test's own input).
pub(crate) fn map_image(bytes: &[u8]) -> ImageMap {
    let disk = butter::ctree::open_disk(ram(bytes)).expect("undamaged image opens");
    let sb = disk.sb.clone();
    let mut m = ImageMap {
        nodesize: sb.nodesize as usize,
        sectorsize: sb.sectorsize as u64,
        csum_type: sb.csum_type,
        generation: sb.generation,
        sb_copies: (0..SUPER_MIRROR_MAX)
            .map(super_offset)
            .filter(|&o| o + SUPER_INFO_SIZE as u64 <= bytes.len() as u64)
            .collect(),
        roots: Vec::new(),
        blocks: BTreeMap::new(),
        data: Vec::new(),
        csummed: HashSet::new(),
        chunks: Vec::new(),
        used_end: 0,
    };
    for c in disk.chunk_map().chunks() {
        m.chunks.push((
            c.logical,
            c.item.length,
            c.item.ty,
            c.item.stripes.iter().map(|s| s.offset).collect(),
        ));
    }
    let mut roots = vec![
        Root {
            id: CHUNK_TREE_OBJECTID,
            bytenr: sb.chunk_root,
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation,
        },
        Root {
            id: ROOT_TREE_OBJECTID,
            bytenr: sb.root,
            level: sb.root_level,
            generation: sb.generation,
        },
    ];
    let mut it = TreeIter::new(disk.clone(), roots[1], Key::MIN, Readahead::None).unwrap();
    while let Some(item) = it.next_item().unwrap() {
        if item.key.ty == ROOT_ITEM_KEY {
            let ri = RootItem::parse(item.data()).unwrap();
            roots.push(Root {
                id: item.key.objectid,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            });
        }
    }
    for r in &roots {
        m.roots.push((r.id, r.bytenr, r.level));
        let expect = Expect {
            owner: Some(r.id),
            level: Some(r.level),
            generation: Some(r.generation),
            first_key: None,
        };
        visit(&disk, &mut m, r.id, r.bytenr, expect, None);
    }
    // Data extents and checksummed sectors.
    let csize = m.csum_type.size() as u64;
    let mut data = Vec::new();
    let mut csummed = HashSet::new();
    for b in m.blocks.values() {
        if !b.is_leaf() {
            continue;
        }
        let raw = read_copy(bytes, b.copies[0], m.nodesize);
        for it in &b.items {
            let body = &raw[it.off..it.off + it.size];
            if it.key.ty == EXTENT_DATA_KEY
                && (b.tree == FS_TREE_OBJECTID || b.tree >= FIRST_FREE_OBJECTID)
            {
                let fe = FileExtentItem::parse(body).unwrap();
                if let FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                } = fe.body
                {
                    if disk_bytenr != 0 {
                        let copies = disk
                            .chunk_map()
                            .map(disk_bytenr, disk_num_bytes)
                            .unwrap()
                            .iter()
                            .map(|c| c.physical)
                            .collect();
                        data.push(DataExtent {
                            root: b.tree,
                            ino: it.key.objectid,
                            file_offset: it.key.offset,
                            disk_bytenr,
                            disk_num_bytes,
                            offset,
                            num_bytes,
                            compression: fe.compression,
                            prealloc: fe.ty == FILE_EXTENT_PREALLOC,
                            copies,
                        });
                    }
                }
            }
            if it.key.ty == EXTENT_CSUM_KEY && b.tree == CSUM_TREE_OBJECTID {
                for k in 0..it.size as u64 / csize {
                    csummed.insert(it.key.offset + k * m.sectorsize);
                }
            }
        }
    }
    m.data = data;
    m.csummed = csummed;
    let mut end = m
        .sb_copies
        .iter()
        .map(|o| o + SUPER_INFO_SIZE as u64)
        .max()
        .unwrap_or(0);
    for b in m.blocks.values() {
        for c in &b.copies {
            end = end.max(c + m.nodesize as u64);
        }
    }
    for d in &m.data {
        for c in &d.copies {
            end = end.max(c + d.disk_num_bytes);
        }
    }
    m.used_end = end;
    m
}

fn read_copy(bytes: &[u8], phys: u64, n: usize) -> &[u8] {
    &bytes[phys as usize..phys as usize + n]
}

fn visit(
    disk: &Arc<Disk>,
    m: &mut ImageMap,
    tree: u64,
    bytenr: u64,
    expect: Expect,
    parent: Option<(u64, usize)>,
) {
    if m.blocks.contains_key(&bytenr) {
        return; // shared with a tree walked earlier (snapshots)
    }
    let b = disk
        .read_tree_block(bytenr, &expect)
        .unwrap_or_else(|e| panic!("undamaged image: {e}"));
    let copies = disk
        .chunk_map()
        .map(bytenr, m.nodesize as u64)
        .unwrap()
        .iter()
        .map(|c| c.physical)
        .collect();
    let mut info = BlockInfo {
        tree,
        bytenr,
        level: b.level(),
        generation: b.header.generation,
        owner: b.owner(),
        parent,
        copies,
        items: Vec::new(),
        ptrs: Vec::new(),
    };
    if b.is_leaf() {
        for s in 0..b.nritems() {
            let it = b.item(s);
            info.items.push(ItemInfo {
                key: it.key,
                off: HEADER_SIZE + it.offset as usize,
                size: it.size as usize,
            });
        }
    } else {
        for s in 0..b.nritems() {
            info.ptrs.push(b.ptr(s));
        }
    }
    let ptrs = info.ptrs.clone();
    let level = info.level;
    m.blocks.insert(bytenr, info);
    for (s, p) in ptrs.iter().enumerate() {
        let e = Expect {
            owner: Some(tree),
            level: Some(level - 1),
            generation: Some(p.generation),
            first_key: Some(p.key),
        };
        visit(disk, m, tree, p.blockptr, e, Some((bytenr, s)));
    }
}

// ---- damage ----

/// Which copies of a tree block (or superblock) to damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Copies {
    First,
    Second,
    All,
}

impl Copies {
    fn picks(self, n: usize) -> Vec<usize> {
        match self {
            Copies::First => vec![0],
            Copies::Second => vec![1.min(n - 1)],
            Copies::All => (0..n).collect(),
        }
    }
}

/// Writes a fresh checksum over `[32, len)` of a block or superblock.
pub(crate) fn reseal(ct: CsumType, buf: &mut [u8]) {
    let c = ct.compute(&buf[CSUM_SIZE..]);
    buf[..ct.size()].copy_from_slice(&c[..ct.size()]);
}

/// Applies `f` to the chosen copies of a tree block, then recomputes their checksum when
/// `reseal` is set (so only validation, not the checksum, can catch the damage).
pub(crate) fn patch_block(
    img: &mut [u8],
    m: &ImageMap,
    b: &BlockInfo,
    which: Copies,
    reseal_csum: bool,
    f: &dyn Fn(&mut [u8]),
) {
    for i in which.picks(b.copies.len()) {
        let p = b.copies[i] as usize;
        let blk = &mut img[p..p + m.nodesize];
        f(blk);
        if reseal_csum {
            reseal(m.csum_type, blk);
        }
    }
}

/// Applies `f` to the chosen superblock copies (`First` = primary, `Second` = first mirror).
pub(crate) fn patch_super(
    img: &mut [u8],
    m: &ImageMap,
    which: Copies,
    reseal_csum: bool,
    f: &dyn Fn(&mut [u8]),
) {
    for i in which.picks(m.sb_copies.len()) {
        let p = m.sb_copies[i] as usize;
        let sb = &mut img[p..p + SUPER_INFO_SIZE];
        f(sb);
        if reseal_csum {
            reseal(m.csum_type, sb);
        }
    }
}

pub(crate) fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_key(b: &mut [u8], off: usize, k: Key) {
    b[off..off + DISK_KEY_SIZE].copy_from_slice(&k.to_bytes());
}

/// Header field offsets in a tree block.
pub mod hdr {
    pub(crate) const FSID: usize = 32;
    pub(crate) const BYTENR: usize = 48;
    pub(crate) const FLAGS: usize = 56;
    pub(crate) const CHUNK_UUID: usize = 64;
    pub(crate) const GENERATION: usize = 80;
    pub(crate) const OWNER: usize = 88;
    pub(crate) const NRITEMS: usize = 96;
    pub(crate) const LEVEL: usize = 100;
}

/// Offset of leaf item record `slot` (key at +0, data offset at +17, size at +21).
pub(crate) fn item_at(slot: usize) -> usize {
    HEADER_SIZE + slot * ITEM_SIZE
}
/// Offset of node key pointer `slot` (key at +0, blockptr at +17, generation at +25).
pub(crate) fn ptr_at(slot: usize) -> usize {
    HEADER_SIZE + slot * KEY_PTR_SIZE
}

/// Superblock field offsets.
pub mod sbf {
    pub(crate) const MAGIC: usize = 64;
    pub(crate) const GENERATION: usize = 72;
    pub(crate) const ROOT: usize = 80;
    pub(crate) const CHUNK_ROOT: usize = 88;
    pub(crate) const LOG_ROOT: usize = 96;
    pub(crate) const NUM_DEVICES: usize = 136;
    pub(crate) const SECTORSIZE: usize = 144;
    pub(crate) const NODESIZE: usize = 148;
    pub(crate) const SYS_ARRAY_SIZE: usize = 160;
    pub(crate) const CHUNK_ROOT_GEN: usize = 164;
    pub(crate) const INCOMPAT: usize = 188;
    pub(crate) const CSUM_TYPE: usize = 196;
    pub(crate) const ROOT_LEVEL: usize = 198;
    pub(crate) const CHUNK_ROOT_LEVEL: usize = 199;
    pub(crate) const DEVID: usize = 201;
    pub(crate) const SYS_ARRAY: usize = 811;
}
