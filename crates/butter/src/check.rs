//! Read-only consistency checker (`butter check`).
//!
//! Phases, each reporting typed [`Finding`]s with the [`Location`] of the item or block at fault:
//! 1. trees: every tree reachable from the superblock (chunk tree, root tree and every tree the
//!    root tree names) reads and validates; each block is visited once and every parent edge is
//!    recorded.
//! 2. metadata extents: every block found has an extent item whose back references explain each
//!    edge that reaches it and whose refs equal its references; every metadata extent item names
//!    a reachable block.
//! 3. data extents: every file extent points at an extent item that covers it; data back
//!    references (per root/inode/offset or per shared leaf) count the file extent items found.
//! 4. block groups: `used` equals the bytes of the extents inside the group; block groups match
//!    chunks; every chunk stripe has its DEV_EXTENT (right chunk and stripe length, no overlaps,
//!    device bytes_used = their sum); with the FREE_SPACE_TREE feature, each group's free space
//!    tree items decode (`free_space_tree`) to exactly the space its extent items leave free, with
//!    the right extent count and flags, and no item lies outside every group (whole stale groups
//!    left by mkfs.btrfs are warnings).
//! 5. fs trees: nlink, directory entry pairs, directory sizes, nbytes, dangling references;
//!    file extent items of an inode do not overlap and, without NO_HOLES, cover [0, isize) as
//!    `btrfs check` requires; ROOT_REF/ROOT_BACKREF pairs agree with each other and with the
//!    parent's directory entry, and every live subvolume has a ROOT_BACKREF.
//! 6. data checksums: every sector of a checksummed regular extent has a csum.
//!
//! Nothing here writes. A block or item that cannot be decoded becomes a finding, not a panic.

use crate::ctree::{ItemRef, Root, TreeIter};
use crate::error::{Error, Location, Result};
use crate::format::hash::name_hash;
use crate::format::items::*;
use crate::format::superblock::DevItem;
use crate::format::*;
use crate::inode::core::Core;
use crate::io::disk_io::{Expect, Readahead};
use crate::space::free_space_tree as fst;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    Warning,
    Error,
    Fatal,
}

/// Which check produced a finding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FindingKind {
    /// An extent item's inline references are not in the order the kernel requires (by type,
    /// then largest offset or hash first); the kernel refuses to mount such a leaf.
    InlineRefOrder,
    /// A tree block or root could not be read or failed validation.
    TreeBlockUnreadable,
    /// A node names the same child twice.
    TreeBlockDuplicatePointer,
    /// One tree reaches a block by two paths (two parents, or its root and a parent).
    TreeBlockReferencedTwice,
    /// A root item cannot be decoded or a tree is missing.
    RootItemBad,
    /// A tree block has no EXTENT_ITEM/METADATA_ITEM.
    MetadataExtentMissing,
    /// A tree block is reached through an edge no back reference explains.
    MetadataBackrefMissing,
    /// A metadata back reference names a root or parent that does not reach the block.
    MetadataBackrefExtra,
    /// An extent item's refs differ from its back references.
    ExtentRefsMismatch,
    /// A metadata extent item names a block no tree reaches.
    OrphanMetadataExtent,
    /// An extent tree item cannot be decoded.
    ExtentItemBad,
    /// A file extent points at no extent item, or past its end.
    DataExtentMissing,
    /// A data back reference count differs from the file extent items found (or is missing).
    DataBackrefMismatch,
    /// A data extent item no file extent references.
    OrphanDataExtent,
    /// BLOCK_GROUP_ITEM used differs from the extents in the group.
    BlockGroupUsedMismatch,
    /// An extent lies in no block group.
    ExtentOutsideBlockGroup,
    /// A block group has no chunk of the same range and type, or a chunk no block group.
    BlockGroupChunkMismatch,
    /// The superblock's bytes_used differs from the block groups' used total.
    SuperBytesUsedMismatch,
    /// Inode nlink differs from the number of INODE_REF/EXTREF names.
    NlinkMismatch,
    /// A DIR_ITEM has no DIR_INDEX with the same name and target.
    DirItemWithoutIndex,
    /// A DIR_INDEX has no DIR_ITEM with the same name and target.
    DirIndexWithoutItem,
    /// A directory entry's target inode has no matching INODE_REF/EXTREF.
    DirEntryWithoutInodeRef,
    /// An INODE_REF/EXTREF has no DIR_INDEX in its parent with that index and name.
    InodeRefWithoutDirIndex,
    /// A directory's isize is not twice the sum of its entry name lengths.
    DirSizeMismatch,
    /// A file's nbytes differs from its extents.
    NbytesMismatch,
    /// A directory entry, ref or item names an inode that does not exist.
    DanglingInode,
    /// An fs tree item cannot be decoded.
    FsItemBad,
    /// A checksummed data sector has no csum.
    CsumMissing,
    /// A block group has no FREE_SPACE_INFO in the free space tree.
    FreeSpaceInfoMissing,
    /// A free space tree item of a block group cannot be decoded (out of range, misaligned,
    /// overlapping, bitmap of the wrong size, ...).
    FreeSpaceItemBad,
    /// The free space tree's free space of a block group differs from the extent tree's.
    FreeSpaceMismatch,
    /// FREE_SPACE_INFO extent_count is not the number of free extents.
    FreeSpaceCountMismatch,
    /// FREE_SPACE_INFO flags have unknown bits or do not match the item type (extents/bitmaps).
    FreeSpaceFlagsMismatch,
    /// A free space tree item lies in no block group (a Warning for whole stale groups
    /// mkfs.btrfs leaves behind).
    FreeSpaceOutsideBlockGroup,
    /// A chunk, device item or dev extent cannot be decoded.
    DevItemBad,
    /// A chunk stripe has no DEV_EXTENT.
    DevExtentMissing,
    /// A DEV_EXTENT names no chunk stripe at its place, or a chunk offset or length other than
    /// the stripe's, or reaches past its device.
    DevExtentMismatch,
    /// Two DEV_EXTENTs of one device overlap.
    DevExtentOverlap,
    /// A device item's bytes_used differs from the sum of its dev extents.
    DevBytesUsedMismatch,
    /// A ROOT_REF has no ROOT_BACKREF with the same parent, child, directory, index and name.
    RootRefWithoutBackref,
    /// A ROOT_BACKREF has no matching ROOT_REF.
    RootBackrefWithoutRef,
    /// A ROOT_REF has no directory entry in its parent tree, or a directory entry naming a
    /// subvolume has no ROOT_REF.
    SubvolEntryMismatch,
    /// A subvolume with references in its root item has no ROOT_BACKREF.
    SubvolUnreferenced,
    /// A file extent item starts before the previous one of its inode ends.
    FileExtentOverlap,
    /// Without NO_HOLES, a file's extent items (holes included) do not cover [0, isize)
    /// (`btrfs check`: "file extent discount").
    FileExtentGap,
    /// A generation newer than the superblock's (+1): an inode, root item or extent item.
    GenerationInvalid,
    /// Inode flags that cannot be (IMMUTABLE/APPEND on a symlink).
    InodeFlagsBad,
    /// An extent lies in a block group of the wrong type (data in metadata or vice versa).
    ExtentTypeMismatch,
    /// A METADATA_ITEM/tree block backref level differs from the block's level.
    MetadataLevelMismatch,
    /// Two EXTENT_CSUM items cover the same bytes.
    CsumOverlap,
    /// An EXTENT_CSUM covers data used only by NODATASUM inodes ("odd csum item").
    CsumOnNodatasum,
    /// Data read back does not match its checksum (`--check-data-csum`).
    DataCsumMismatch,
    /// The device size in the superblock/dev item differs from the image, or a chunk or dev
    /// extent lies past the end of the image.
    DeviceSizeMismatch,
    /// Quota group numbers differ from the extents the subvolumes reference.
    QgroupMismatch,
    /// A file extent logged in the fsync log has no csum in the log.
    LogCsumMissing,
}

#[derive(Debug, Clone)]
pub struct Finding {
    pub severity: Severity,
    pub kind: FindingKind,
    pub location: Location,
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} {:?}: {} ({})",
            self.severity, self.kind, self.message, self.location
        )
    }
}

/// Counts gathered while checking.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    pub trees: u64,
    pub tree_blocks: u64,
    pub metadata_extents: u64,
    pub data_extents: u64,
    pub file_extents: u64,
    pub block_groups: u64,
    pub inodes: u64,
    pub csum_sectors: u64,
    /// Data bytes read and compared with their csums (`--check-data-csum`).
    pub data_bytes_verified: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub counts: Counts,
}

impl Report {
    /// True when no finding is an Error or Fatal.
    pub fn is_clean(&self) -> bool {
        self.findings
            .iter()
            .all(|f| f.severity == Severity::Warning)
    }
    #[cfg(test)]
    pub(crate) fn has(&self, kind: FindingKind) -> bool {
        self.findings.iter().any(|f| f.kind == kind)
    }
    fn add(&mut self, severity: Severity, kind: FindingKind, location: Location, msg: String) {
        self.findings.push(Finding {
            severity,
            kind,
            location,
            message: msg,
        });
    }
    fn err(&mut self, kind: FindingKind, location: Location, msg: String) {
        self.add(Severity::Error, kind, location, msg);
    }
}

/// A parent edge to a tree block: the node holding the pointer, or the root item of a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Edge {
    Root(u64),
    Node { parent: u64, slot: usize },
}

struct BlockRec {
    owner: u64,
    level: u8,
    edges: Vec<Edge>,
    /// Trees reaching this block (filled after the walk).
    reach: HashSet<u64>,
}

/// One file extent item seen in a leaf (each leaf once).
struct FileExtRef {
    leaf: u64,
    owner: u64,
    ino: u64,
    file_off: u64,
    disk_bytenr: u64,
    disk_num_bytes: u64,
    offset: u64,
    num_bytes: u64,
    compressed: bool,
    loc: Location,
}

struct ExtentRec {
    len: u64,
    refs: u64,
    flags: u64,
    /// Tree blocks: the level the extent item records.
    level: Option<u64>,
    refs_list: Vec<BackRef>,
    loc: Location,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum DataRefKey {
    Data { root: u64, ino: u64, offset: u64 },
    Shared { parent: u64 },
}

/// Reach-set tag of a relocation tree: this bit pattern in the top two bits, the relocated
/// subvolume's id below (no real tree id has the top bits 01).
const RELOC_TAG: u64 = 1 << 62;
const RELOC_TAG_MASK: u64 = 3 << 62;

fn is_reloc_tag(t: u64) -> bool {
    t & RELOC_TAG_MASK == RELOC_TAG
}

/// The tree id behind a reach-set tag.
fn tag_tree(t: u64) -> u64 {
    if is_reloc_tag(t) {
        TREE_RELOC_OBJECTID
    } else {
        t
    }
}

/// "tree N", or "relocation tree of N".
fn tag_name(t: u64) -> String {
    if is_reloc_tag(t) {
        format!("relocation tree of {}", t & !RELOC_TAG_MASK)
    } else {
        format!("tree {t}")
    }
}

/// Largest data extent btrfs creates (128 MiB).
const MAX_DATA_EXTENT: u64 = 128 << 20;

fn is_fs_tree(id: u64) -> bool {
    id == FS_TREE_OBJECTID
        || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id)
        || id == DATA_RELOC_TREE_OBJECTID
}

/// A block group item.
struct GroupRec {
    start: u64,
    len: u64,
    loc: Location,
}

/// A ROOT_REF or ROOT_BACKREF, keyed as (parent, child).
struct RootRefRec {
    parent: u64,
    child: u64,
    rr: RootRef,
    loc: Location,
}

/// A directory entry (DIR_INDEX) naming a subvolume.
struct SubvolEntry {
    tree: u64,
    dir: u64,
    index: u64,
    name: Vec<u8>,
    child: u64,
    loc: Location,
}

struct Checker<'a> {
    fs: &'a Core,
    report: Report,
    blocks: HashMap<u64, BlockRec>,
    file_exts: Vec<FileExtRef>,
    /// (tree id, root) for every tree found.
    trees: Vec<Root>,
    extents: BTreeMap<u64, ExtentRec>,
    /// Block groups by start (phase 4).
    groups: Vec<GroupRec>,
    /// ROOT_ITEMs of the root tree and where they are (phase 1).
    root_items: BTreeMap<u64, (RootItem, Location)>,
    root_refs: Vec<RootRefRec>,
    root_backrefs: Vec<RootRefRec>,
    /// Directory entries naming subvolumes (phase 5).
    subvol_entries: Vec<SubvolEntry>,
    /// Trees being deleted (drop_progress set): walked in part, their fs items not checked.
    dropping: HashSet<u64>,
    /// Data ranges of NODATASUM inodes that must not have csums (phase 5 -> 6).
    nodatasum: Vec<NodatasumRange>,
}

/// A regular, uncompressed extent of a NODATASUM inode.
struct NodatasumRange {
    logical: u64,
    len: u64,
    tree: u64,
    ino: u64,
    file_off: u64,
    loc: Location,
}

/// What to check beyond the default (metadata) checks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Read every data sector that has a checksum and compare (`--check-data-csum`).
    pub check_data_csum: bool,
}

/// Runs the checks `opts` asks for. `progress` receives one line per phase.
pub(crate) fn check_with(
    fs: &Core,
    opts: Options,
    progress: &mut dyn FnMut(&str),
) -> Result<Report> {
    let mut c = Checker {
        fs,
        report: Report::default(),
        blocks: HashMap::new(),
        file_exts: Vec::new(),
        trees: Vec::new(),
        extents: BTreeMap::new(),
        groups: Vec::new(),
        root_items: BTreeMap::new(),
        root_refs: Vec::new(),
        root_backrefs: Vec::new(),
        subvol_entries: Vec::new(),
        dropping: HashSet::new(),
        nodatasum: Vec::new(),
    };
    let n0 = c.report.findings.len();
    c.phase_trees()?;
    progress(&format!(
        "[1/6] trees: {} trees, {} blocks, {} findings",
        c.report.counts.trees,
        c.report.counts.tree_blocks,
        c.report.findings.len() - n0
    ));
    let n0 = c.report.findings.len();
    c.load_extents()?;
    c.phase_metadata_refs();
    progress(&format!(
        "[2/6] metadata extents: {} extent items, {} findings",
        c.report.counts.metadata_extents,
        c.report.findings.len() - n0
    ));
    let n0 = c.report.findings.len();
    c.phase_data_refs();
    progress(&format!(
        "[3/6] data extents: {} extents, {} file extent items, {} findings",
        c.report.counts.data_extents,
        c.report.counts.file_extents,
        c.report.findings.len() - n0
    ));
    let n0 = c.report.findings.len();
    c.phase_block_groups()?;
    progress(&format!(
        "[4/6] block groups: {} groups, {} findings",
        c.report.counts.block_groups,
        c.report.findings.len() - n0
    ));
    let n0 = c.report.findings.len();
    let csum_extents = c.phase_fs_trees()?;
    progress(&format!(
        "[5/6] fs trees: {} inodes, {} findings",
        c.report.counts.inodes,
        c.report.findings.len() - n0
    ));
    let n0 = c.report.findings.len();
    c.phase_csums(&csum_extents)?;
    progress(&format!(
        "[6/6] data csums: {} sectors, {} findings",
        c.report.counts.csum_sectors,
        c.report.findings.len() - n0
    ));
    if opts.check_data_csum {
        let n0 = c.report.findings.len();
        c.phase_data_read();
        progress(&format!(
            "[7/7] data read and compared with csums: {} bytes, {} findings",
            c.report.counts.data_bytes_verified,
            c.report.findings.len() - n0
        ));
    }
    Ok(c.report)
}

/// The parts of sorted, disjoint ranges `a` not covered by sorted, disjoint ranges `b`.
fn range_diff(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut j = 0;
    for &(s, l) in a {
        let e = s.saturating_add(l);
        let mut cur = s;
        while j < b.len() && b[j].0.saturating_add(b[j].1) <= cur {
            j += 1;
        }
        let mut k = j;
        while cur < e {
            match b.get(k) {
                Some(&(bs, bl)) if bs < e => {
                    if bs > cur {
                        out.push((cur, bs - cur));
                    }
                    cur = cur.max(bs.saturating_add(bl));
                    k += 1;
                }
                _ => {
                    out.push((cur, e - cur));
                    cur = e;
                }
            }
        }
    }
    out
}

/// Location naming an item.
fn item_loc(it: &ItemRef, tree: u64) -> Location {
    let mut l = it.loc();
    l.tree = Some(tree);
    l
}

/// What one fs tree holds for one inode, gathered in the collection pass of
/// `Checker::check_fs_tree` and cross-checked after it.
#[derive(Default)]
struct Ino {
    item: Option<(InodeItem, Location)>,
    names: u64,
    /// (parent, index, name, loc)
    refs: Vec<(u64, u64, Vec<u8>, Location)>,
    dir_items: Vec<(Vec<u8>, Key, Location)>,
    dir_index: Vec<(u64, Vec<u8>, Key, Location)>,
    nbytes: u64,
    first_loc: Option<Location>,
    /// (logical, length, regular, compressed, file offset, location)
    extents: Vec<(u64, u64, bool, bool, u64, Location)>,
    /// First file offset with an extent item and where the last item ends.
    file_start: Option<u64>,
    file_end: Option<u64>,
    /// Start of the first gap between extent items.
    first_gap: Option<u64>,
    overlaps: Vec<(Location, String)>,
}

impl Ino {
    /// Records one item of this inode (key `k`, body `data`, found at `loc`) by its kind;
    /// kinds not cross-checked are skipped. `Err` says why the item does not decode.
    fn add_item(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Location,
        ss: u64,
    ) -> std::result::Result<(), String> {
        match k.ty {
            INODE_ITEM_KEY => {
                self.item = Some((
                    InodeItem::parse(data).map_err(|e| e.to_string())?,
                    loc.clone(),
                ))
            }
            INODE_REF_KEY | INODE_EXTREF_KEY => self.add_names(k, data, loc)?,
            DIR_ITEM_KEY | DIR_INDEX_KEY => self.add_dir_entries(k, data, loc)?,
            EXTENT_DATA_KEY => self.add_file_extent(k, data, loc, ss)?,
            _ => {}
        }
        Ok(())
    }

    /// An INODE_REF (parent in the key offset) or INODE_EXTREF (parent in each entry): each
    /// name counts toward the link count and is kept for the directory cross-check.
    fn add_names(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Location,
    ) -> std::result::Result<(), String> {
        if k.ty == INODE_REF_KEY {
            for r in InodeRef::parse_all(data).map_err(|e| e.to_string())? {
                self.names += 1;
                self.refs.push((k.offset, r.index, r.name, loc.clone()));
            }
        } else {
            for r in InodeExtref::parse_all(data).map_err(|e| e.to_string())? {
                self.names += 1;
                self.refs.push((r.parent, r.index, r.name, loc.clone()));
            }
        }
        Ok(())
    }

    /// A DIR_ITEM (each name must hash to the key offset) or DIR_INDEX (the index in the key
    /// offset) of this directory, kept for the item/index and entry/ref cross-checks.
    fn add_dir_entries(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Location,
    ) -> std::result::Result<(), String> {
        if k.ty == DIR_ITEM_KEY {
            for d in DirItem::parse_all(data).map_err(|e| e.to_string())? {
                if name_hash(&d.name) != k.offset {
                    return Err(format!(
                        "dir item name {:?} does not hash to the key offset",
                        String::from_utf8_lossy(&d.name)
                    ));
                }
                self.dir_items.push((d.name, d.location, loc.clone()));
            }
        } else {
            for d in DirItem::parse_all(data).map_err(|e| e.to_string())? {
                self.dir_index
                    .push((k.offset, d.name, d.location, loc.clone()));
            }
        }
        Ok(())
    }

    /// A file extent item: tracks the file range covered so far (overlaps and the first gap,
    /// items coming in offset order), the bytes it accounts for in nbytes, and the disk range
    /// its csums must cover.
    fn add_file_extent(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Location,
        ss: u64,
    ) -> std::result::Result<(), String> {
        let fe = FileExtentItem::parse(data).map_err(|e| e.to_string())?;
        // The file range the item covers: inline data to the end of its sector.
        let len = match fe.body {
            FileExtentBody::Inline(_) => fe.ram_bytes.div_ceil(ss).saturating_mul(ss),
            FileExtentBody::Extent { num_bytes, .. } => num_bytes,
        };
        match self.file_end {
            None => self.file_start = Some(k.offset),
            Some(end) if k.offset < end => self.overlaps.push((
                loc.clone(),
                format!(
                    "inode {}: file extent at {} starts before the previous one ends at {end}",
                    k.objectid, k.offset
                ),
            )),
            Some(end) if k.offset > end => {
                self.first_gap.get_or_insert(end);
            }
            Some(_) => {}
        }
        self.file_end = Some(k.offset.saturating_add(len));
        match fe.body {
            FileExtentBody::Inline(_) => self.nbytes = self.nbytes.saturating_add(fe.ram_bytes),
            FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
            } => {
                if disk_bytenr != 0 {
                    self.nbytes = self.nbytes.saturating_add(num_bytes);
                    // Csums cover what the item uses: the whole extent when
                    // compressed, else [offset, offset + num_bytes) of it (the
                    // rest may be preallocated space never written).
                    let range = if fe.compression != COMPRESS_NONE {
                        (disk_bytenr, disk_num_bytes)
                    } else {
                        (disk_bytenr.saturating_add(offset), num_bytes)
                    };
                    self.extents.push((
                        range.0,
                        range.1,
                        fe.ty == FILE_EXTENT_REG,
                        fe.compression != COMPRESS_NONE,
                        k.offset,
                        loc.clone(),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Checker<'_> {
    // ---------------------------------------------------------------------------------------
    // Phase 1

    fn phase_trees(&mut self) -> Result<()> {
        let sb = &self.fs.disk.sb;
        let chunk = Root {
            id: CHUNK_TREE_OBJECTID,
            bytenr: sb.chunk_root,
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation,
        };
        let tree_root = self.fs.tree_root();
        if sb.log_root != 0 {
            // Log tree blocks have no extent items; they are not walked.
            self.report.add(
                Severity::Warning,
                FindingKind::RootItemBad,
                Location::what("superblock log_root"),
                format!(
                    "the image has an unreplayed fsync log at {}; only its file extents' csums are checked",
                    sb.log_root
                ),
            );
        }
        self.walk(chunk, CHUNK_TREE_OBJECTID, None);
        self.walk(tree_root, ROOT_TREE_OBJECTID, None);
        // Every ROOT_ITEM in the root tree.
        let mut roots = Vec::new();
        match TreeIter::new(self.fs.disk.clone(), tree_root, Key::MIN, Readahead::None) {
            Ok(mut it) => loop {
                match it.next_item() {
                    Ok(Some(item)) => {
                        let k = item.key;
                        if k.ty == ROOT_REF_KEY || k.ty == ROOT_BACKREF_KEY {
                            let loc = item_loc(&item, ROOT_TREE_OBJECTID);
                            match RootRef::parse(item.data()) {
                                Ok(rr) if k.ty == ROOT_REF_KEY => self.root_refs.push(RootRefRec {
                                    parent: k.objectid,
                                    child: k.offset,
                                    rr,
                                    loc,
                                }),
                                Ok(rr) => self.root_backrefs.push(RootRefRec {
                                    parent: k.offset,
                                    child: k.objectid,
                                    rr,
                                    loc,
                                }),
                                Err(e) => {
                                    self.report
                                        .err(FindingKind::RootItemBad, loc, e.to_string())
                                }
                            }
                            continue;
                        }
                        if item.key.ty != ROOT_ITEM_KEY {
                            continue;
                        }
                        match RootItem::parse(item.data()) {
                            Ok(ri) => {
                                self.root_items.insert(
                                    item.key.objectid,
                                    (ri.clone(), item_loc(&item, ROOT_TREE_OBJECTID)),
                                );
                                roots.push((item.key.objectid, item.key.offset, ri))
                            }
                            Err(e) => self.report.err(
                                FindingKind::RootItemBad,
                                item_loc(&item, ROOT_TREE_OBJECTID),
                                e.to_string(),
                            ),
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.unreadable(e, Some(ROOT_TREE_OBJECTID));
                        break;
                    }
                }
            },
            Err(e) => self.unreadable(e, Some(ROOT_TREE_OBJECTID)),
        }
        for (id, offset, ri) in roots {
            if id == TREE_LOG_OBJECTID || ri.bytenr == 0 {
                continue;
            }
            let gen_limit = self.fs.disk.sb.generation.saturating_add(1);
            if ri.generation > gen_limit {
                self.report.err(
                    FindingKind::GenerationInvalid,
                    self.root_items
                        .get(&id)
                        .map(|r| r.1.clone())
                        .unwrap_or_else(|| Location::what(format!("root item of tree {id}"))),
                    format!(
                        "root {id}: generation {}, but the superblock generation is {}",
                        ri.generation,
                        gen_limit - 1
                    ),
                );
            }
            let root = Root {
                id,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            };
            // Each relocation tree (one per subvolume being relocated, all with objectid
            // TREE_RELOC) is a tree of its own for the one-path rule.
            let tag = if id == TREE_RELOC_OBJECTID {
                RELOC_TAG | (offset & !RELOC_TAG_MASK)
            } else {
                id
            };
            let subvolume =
                id == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id);
            if subvolume
                && ri.inode.flags & INODE_ROOT_ITEM_INIT == 0
                && (ri.flags != 0 || ri.byte_limit != 0)
            {
                // The kernel takes such an item for one from a kernel that left flags and
                // limit uninitialised, and clears them: a read-only snapshot turns writable.
                self.report.add(
                    Severity::Warning,
                    FindingKind::RootItemBad,
                    self.root_items
                        .get(&id)
                        .map(|r| r.1.clone())
                        .unwrap_or_else(|| Location::what(format!("root item of tree {id}"))),
                    format!(
                        "subvolume {id}: root item without the current-format mark \
                         (ROOT_ITEM_INIT): the kernel clears its flags {:#x}{} and byte limit \
                         {}; `butter property set IMAGE PATH ro true` (or false) rewrites it",
                        ri.flags,
                        if ri.flags & ROOT_SUBVOL_RDONLY != 0 {
                            " (read-only)"
                        } else {
                            ""
                        },
                        ri.byte_limit
                    ),
                );
            }
            if ri.drop_progress.objectid != 0 || ri.drop_level != 0 {
                // A tree being deleted: the subtrees left of drop_progress (at drop_level and
                // above) are already freed; the rest is still accounted in the extent tree.
                self.report.add(
                    Severity::Warning,
                    FindingKind::RootItemBad,
                    Location::what(format!("root item of tree {id}")),
                    format!(
                        "tree {id} is being deleted (drop progress {} level {}); only its remaining blocks are checked",
                        ri.drop_progress, ri.drop_level
                    ),
                );
                self.dropping.insert(id);
                self.walk(root, tag, Some(ri.drop_progress));
                continue;
            }
            self.walk(root, tag, None);
        }
        // Propagate reaching trees down, highest level first.
        let mut order: Vec<(u8, u64)> = self.blocks.iter().map(|(b, r)| (r.level, *b)).collect();
        order.sort_by(|a, b| b.cmp(a));
        for (_, b) in order {
            let (edges, mut reach) = match self.blocks.get(&b) {
                Some(r) => (r.edges.clone(), HashSet::new()),
                None => continue,
            };
            for e in edges {
                match e {
                    Edge::Root(t) => {
                        reach.insert(t);
                    }
                    Edge::Node { parent, .. } => {
                        if let Some(p) = self.blocks.get(&parent) {
                            reach.extend(p.reach.iter().copied());
                        }
                    }
                }
            }
            if let Some(r) = self.blocks.get_mut(&b) {
                r.reach = reach;
            }
        }
        // A tree reaches each of its blocks by one path only.
        let mut bytenrs: Vec<u64> = self.blocks.keys().copied().collect();
        bytenrs.sort_unstable();
        for b in bytenrs {
            let Some(rec) = self.blocks.get(&b) else {
                continue;
            };
            let mut per_tree: BTreeMap<u64, Vec<Edge>> = BTreeMap::new();
            for e in &rec.edges {
                match e {
                    Edge::Root(t) => per_tree.entry(*t).or_default().push(*e),
                    Edge::Node { parent, .. } => {
                        if let Some(p) = self.blocks.get(parent) {
                            for t in &p.reach {
                                per_tree.entry(*t).or_default().push(*e);
                            }
                        }
                    }
                }
            }
            let dups: Vec<String> = per_tree
                .iter()
                .filter(|(_, v)| v.len() > 1)
                .map(|(t, v)| format!("{} via {v:?}", tag_name(*t)))
                .collect();
            if !dups.is_empty() {
                let loc = Location::block(Some(rec.owner), b);
                self.report.err(
                    FindingKind::TreeBlockReferencedTwice,
                    loc,
                    format!("block {b} is reached more than once: {}", dups.join("; ")),
                );
            }
        }
        self.report.counts.tree_blocks = self.blocks.len() as u64;
        Ok(())
    }

    fn unreadable(&mut self, e: Error, tree: Option<u64>) {
        let loc = match &e {
            Error::Corrupt { loc, .. } | Error::BadChecksum { loc, .. } => {
                let mut l = (**loc).clone();
                if l.tree.is_none() {
                    l.tree = tree;
                }
                l
            }
            _ => Location {
                tree,
                ..Default::default()
            },
        };
        self.report.add(
            Severity::Fatal,
            FindingKind::TreeBlockUnreadable,
            loc,
            e.to_string(),
        );
    }

    /// Depth-first walk of one tree; blocks already visited get the new edge only. `tag` names
    /// the tree in edges and reach sets (the tree id, or a [`RELOC_TAG`] for a relocation
    /// tree); with `drop`, subtrees entirely left of that key are skipped (already freed).
    fn walk(&mut self, root: Root, tag: u64, drop: Option<Key>) {
        self.report.counts.trees += 1;
        self.trees.push(root);
        let disk = self.fs.disk.clone();
        // (bytenr, edge, expect, end of the key range below the pointer)
        let mut stack = vec![(
            root.bytenr,
            Edge::Root(tag),
            None::<Key>,
            Expect {
                owner: None,
                level: Some(root.level),
                generation: Some(root.generation),
                first_key: None,
            },
        )];
        while let Some((bytenr, edge, end, expect)) = stack.pop() {
            if let Some(r) = self.blocks.get_mut(&bytenr) {
                if r.edges.contains(&edge) {
                    continue;
                }
                r.edges.push(edge);
                continue;
            }
            let b = match disk.read_tree_block(bytenr, &expect) {
                Ok(b) => b,
                Err(e) => {
                    let e = e.in_block(Some(root.id), bytenr);
                    self.unreadable(e, Some(root.id));
                    continue;
                }
            };
            self.blocks.insert(
                bytenr,
                BlockRec {
                    owner: b.owner(),
                    level: b.level(),
                    edges: vec![edge],
                    reach: HashSet::new(),
                },
            );
            if b.is_leaf() {
                // The root tree holds the v1 free space cache inodes and their extents.
                if is_fs_tree(root.id)
                    || is_fs_tree(b.owner())
                    || root.id == ROOT_TREE_OBJECTID
                    || root.id == TREE_RELOC_OBJECTID
                {
                    self.collect_file_extents(&b);
                }
                continue;
            }
            let mut seen = HashSet::new();
            for slot in 0..b.nritems() {
                let p = b.ptr(slot);
                if !seen.insert(p.blockptr) {
                    self.report.err(
                        FindingKind::TreeBlockDuplicatePointer,
                        b.loc(Some(slot)),
                        format!("node points at block {} twice", p.blockptr),
                    );
                    continue;
                }
                let child_end = if slot + 1 < b.nritems() {
                    Some(b.ptr(slot + 1).key)
                } else {
                    end
                };
                if let (Some(dp), Some(ce)) = (drop, child_end) {
                    if ce <= dp {
                        continue; // freed by the interrupted deletion
                    }
                }
                stack.push((
                    p.blockptr,
                    Edge::Node {
                        parent: bytenr,
                        slot,
                    },
                    child_end,
                    Expect {
                        // Owners are not checked here: shared blocks keep their first owner;
                        // the back references say which trees may hold a block (phase 2).
                        owner: None,
                        level: Some(b.level().saturating_sub(1)),
                        generation: Some(p.generation),
                        first_key: Some(p.key),
                    },
                ));
            }
        }
    }

    fn collect_file_extents(&mut self, b: &crate::io::disk_io::TreeBlock) {
        for slot in 0..b.nritems() {
            let key = b.key(slot);
            if key.ty != EXTENT_DATA_KEY {
                continue;
            }
            let Ok(fe) = FileExtentItem::parse(b.item_data(slot)) else {
                continue; // reported by phase 5
            };
            if let FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
            } = fe.body
            {
                if disk_bytenr == 0 {
                    continue;
                }
                self.file_exts.push(FileExtRef {
                    leaf: b.bytenr,
                    owner: b.owner(),
                    ino: key.objectid,
                    file_off: key.offset,
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                    compressed: fe.compression != COMPRESS_NONE,
                    loc: b.loc(Some(slot)),
                });
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Phase 2

    fn extent_root(&self) -> Option<Root> {
        self.trees
            .iter()
            .find(|r| r.id == EXTENT_TREE_OBJECTID)
            .copied()
    }

    fn load_extents(&mut self) -> Result<()> {
        let Some(root) = self.extent_root() else {
            self.report.add(
                Severity::Fatal,
                FindingKind::RootItemBad,
                Location::what("root tree"),
                "no extent tree root item".into(),
            );
            return Ok(());
        };
        let nodesize = self.fs.disk.nodesize() as u64;
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(EXTENT_TREE_OBJECTID));
                return Ok(());
            }
        };
        let mut cur: Option<u64> = None;
        loop {
            let item = match it.next_item() {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(EXTENT_TREE_OBJECTID));
                    break;
                }
            };
            let k = item.key;
            let loc = item_loc(&item, EXTENT_TREE_OBJECTID);
            match k.ty {
                EXTENT_ITEM_KEY | METADATA_ITEM_KEY => match ExtentItem::parse(item.data(), k.ty) {
                    Ok(ei) => {
                        let order: Vec<(u8, std::cmp::Reverse<u64>)> = ei
                            .inline_refs
                            .iter()
                            .map(|r| (r.type_key(), std::cmp::Reverse(r.key_offset())))
                            .collect();
                        if order.windows(2).any(|w| w[0] >= w[1]) {
                            self.report.err(
                                FindingKind::InlineRefOrder,
                                loc.clone(),
                                format!(
                                    "inline references out of order (type, offset): {:?}",
                                    order.iter().map(|(t, o)| (*t, o.0)).collect::<Vec<_>>()
                                ),
                            );
                        }
                        let len = if k.ty == METADATA_ITEM_KEY {
                            nodesize
                        } else {
                            k.offset
                        };
                        let gen_limit = self.fs.disk.sb.generation.saturating_add(1);
                        if ei.generation == 0 || ei.generation > gen_limit {
                            self.report.err(
                                FindingKind::GenerationInvalid,
                                loc.clone(),
                                format!(
                                    "extent {}: generation {}, valid is 1..={gen_limit} (superblock generation + 1)",
                                    k.objectid, ei.generation
                                ),
                            );
                        }
                        let level = if k.ty == METADATA_ITEM_KEY {
                            Some(k.offset)
                        } else {
                            ei.tree_block_info.map(|(_, l)| l as u64)
                        };
                        self.extents.insert(
                            k.objectid,
                            ExtentRec {
                                len,
                                refs: ei.refs,
                                flags: ei.flags,
                                level,
                                refs_list: ei.inline_refs,
                                loc,
                            },
                        );
                        cur = Some(k.objectid);
                    }
                    Err(e) => {
                        cur = None;
                        self.report
                            .err(FindingKind::ExtentItemBad, loc, e.to_string())
                    }
                },
                TREE_BLOCK_REF_KEY | SHARED_BLOCK_REF_KEY | EXTENT_DATA_REF_KEY
                | SHARED_DATA_REF_KEY => {
                    let r = match k.ty {
                        TREE_BLOCK_REF_KEY => Ok(BackRef::TreeBlock { root: k.offset }),
                        SHARED_BLOCK_REF_KEY => Ok(BackRef::SharedBlock { parent: k.offset }),
                        EXTENT_DATA_REF_KEY => parse_extent_data_ref(item.data()),
                        _ => {
                            let d = item.data();
                            if d.len() < 4 {
                                Err(Error::corrupt(loc.clone(), "shared data ref too short"))
                            } else {
                                Ok(BackRef::SharedData {
                                    parent: k.offset,
                                    count: le_u32(d, 0),
                                })
                            }
                        }
                    };
                    match (r, cur.and_then(|c| (c == k.objectid).then_some(c))) {
                        (Ok(r), Some(c)) => {
                            if let Some(e) = self.extents.get_mut(&c) {
                                e.refs_list.push(r);
                            }
                        }
                        (Ok(_), None) => self.report.err(
                            FindingKind::ExtentItemBad,
                            loc,
                            "back reference without an extent item before it".into(),
                        ),
                        (Err(e), _) => {
                            self.report
                                .err(FindingKind::ExtentItemBad, loc, e.to_string())
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn phase_metadata_refs(&mut self) {
        let mut bytenrs: Vec<u64> = self.blocks.keys().copied().collect();
        bytenrs.sort_unstable();
        for b in bytenrs {
            let Some(rec) = self.blocks.get(&b) else {
                continue;
            };
            let bloc = Location::block(Some(rec.owner), b);
            // The chunk tree's blocks are accounted like any other tree block.
            let Some(ext) = self.extents.get(&b) else {
                self.report.err(
                    FindingKind::MetadataExtentMissing,
                    bloc,
                    format!("tree block {b} (level {}) has no extent item", rec.level),
                );
                continue;
            };
            if ext.flags & EXTENT_FLAG_TREE_BLOCK == 0 {
                self.report.err(
                    FindingKind::MetadataExtentMissing,
                    ext.loc.clone(),
                    format!("extent item of tree block {b} lacks the TREE_BLOCK flag"),
                );
                continue;
            }
            if let Some(l) = ext.level.filter(|l| *l != rec.level as u64) {
                self.report.err(
                    FindingKind::MetadataLevelMismatch,
                    ext.loc.clone(),
                    format!(
                        "tree block {b}: its extent item says level {l}, the block is level {}",
                        rec.level
                    ),
                );
            }
            let mut tree_refs = HashSet::new();
            let mut shared_refs = HashSet::new();
            let mut n = 0u64;
            for r in &ext.refs_list {
                match r {
                    BackRef::TreeBlock { root } => {
                        n += 1;
                        tree_refs.insert(*root);
                        if !rec.reach.iter().any(|t| tag_tree(*t) == *root) {
                            self.report.err(
                                FindingKind::MetadataBackrefExtra,
                                ext.loc.clone(),
                                format!("tree block {b}: TREE_BLOCK_REF root {root}, but that tree does not reach the block"),
                            );
                        }
                    }
                    BackRef::SharedBlock { parent } => {
                        n += 1;
                        shared_refs.insert(*parent);
                        // The root block of a relocation tree is its own parent.
                        let ok = rec.edges.iter().any(|e| match e {
                            Edge::Node { parent: p, .. } => p == parent,
                            Edge::Root(t) => is_reloc_tag(*t) && *parent == b,
                        });
                        if !ok {
                            self.report.err(
                                FindingKind::MetadataBackrefExtra,
                                ext.loc.clone(),
                                format!("tree block {b}: SHARED_BLOCK_REF parent {parent}, but that block does not point here"),
                            );
                        }
                    }
                    _ => {}
                }
            }
            if n != ext.refs {
                self.report.err(
                    FindingKind::ExtentRefsMismatch,
                    ext.loc.clone(),
                    format!("tree block {b}: refs {} but {n} back references", ext.refs),
                );
            }
            for e in &rec.edges {
                let explained = match e {
                    Edge::Root(t) => {
                        tree_refs.contains(&tag_tree(*t))
                            || (is_reloc_tag(*t) && shared_refs.contains(&b))
                    }
                    Edge::Node { parent, .. } => {
                        shared_refs.contains(parent)
                            || self.blocks.get(parent).is_some_and(|p| {
                                p.reach.iter().any(|t| tree_refs.contains(&tag_tree(*t)))
                            })
                    }
                };
                if !explained {
                    let (what, loc) = match e {
                        Edge::Root(t) => (format!("root of {}", tag_name(*t)), bloc.clone()),
                        Edge::Node { parent, slot } => (
                            format!("pointer in block {parent} slot {slot}"),
                            Location::block(self.blocks.get(parent).map(|p| p.owner), *parent)
                                .with_slot(*slot),
                        ),
                    };
                    self.report.err(
                        FindingKind::MetadataBackrefMissing,
                        loc,
                        format!("tree block {b} is reached as {what}, but its extent item (block {:?} slot {:?}) has no back reference for it", ext.loc.bytenr, ext.loc.slot),
                    );
                }
            }
        }
        let mut metadata = 0;
        for (b, e) in &self.extents {
            if e.flags & EXTENT_FLAG_TREE_BLOCK == 0 {
                continue;
            }
            metadata += 1;
            if !self.blocks.contains_key(b) {
                self.report.err(
                    FindingKind::OrphanMetadataExtent,
                    e.loc.clone(),
                    format!("metadata extent {b} names a block no tree reaches"),
                );
            }
        }
        self.report.counts.metadata_extents = metadata;
    }

    // ---------------------------------------------------------------------------------------
    // Phase 3

    fn phase_data_refs(&mut self) {
        self.report.counts.file_extents = self.file_exts.len() as u64;
        let mut want: BTreeMap<u64, BTreeMap<DataRefKey, u64>> = BTreeMap::new();
        for fe in &self.file_exts {
            let Some(ext) = self.extents.get(&fe.disk_bytenr) else {
                self.report.err(
                    FindingKind::DataExtentMissing,
                    fe.loc.clone(),
                    format!(
                        "file extent of inode {} at {} points at {} ({} bytes), which has no extent item",
                        fe.ino, fe.file_off, fe.disk_bytenr, fe.disk_num_bytes
                    ),
                );
                continue;
            };
            if ext.flags & EXTENT_FLAG_DATA == 0 || fe.disk_num_bytes != ext.len {
                self.report.err(
                    FindingKind::DataExtentMissing,
                    fe.loc.clone(),
                    format!(
                        "file extent of inode {} at {} names {} length {}, but the extent item there has length {} flags {:#x}",
                        fe.ino, fe.file_off, fe.disk_bytenr, fe.disk_num_bytes, ext.len, ext.flags
                    ),
                );
                continue;
            }
            let full = self
                .extents
                .get(&fe.leaf)
                .is_some_and(|l| l.flags & BLOCK_FLAG_FULL_BACKREF != 0);
            let k = if full {
                DataRefKey::Shared { parent: fe.leaf }
            } else {
                DataRefKey::Data {
                    root: fe.owner,
                    ino: fe.ino,
                    offset: fe.file_off.wrapping_sub(fe.offset),
                }
            };
            *want
                .entry(fe.disk_bytenr)
                .or_default()
                .entry(k)
                .or_default() += 1;
        }
        let mut data = 0;
        for (b, ext) in &self.extents {
            if ext.flags & EXTENT_FLAG_DATA == 0 {
                continue;
            }
            data += 1;
            let mut have: BTreeMap<DataRefKey, u64> = BTreeMap::new();
            for r in &ext.refs_list {
                match r {
                    BackRef::ExtentData {
                        root,
                        objectid,
                        offset,
                        count,
                    } => {
                        *have
                            .entry(DataRefKey::Data {
                                root: *root,
                                ino: *objectid,
                                offset: *offset,
                            })
                            .or_default() += *count as u64
                    }
                    BackRef::SharedData { parent, count } => {
                        *have
                            .entry(DataRefKey::Shared { parent: *parent })
                            .or_default() += *count as u64
                    }
                    _ => {}
                }
            }
            let total = have.values().fold(0u64, |a, v| a.saturating_add(*v));
            if total != ext.refs {
                self.report.err(
                    FindingKind::ExtentRefsMismatch,
                    ext.loc.clone(),
                    format!(
                        "data extent {b}: refs {} but back references count {total}",
                        ext.refs
                    ),
                );
            }
            let empty = BTreeMap::new();
            let w = want.get(b).unwrap_or(&empty);
            if w.is_empty() {
                self.report.err(
                    FindingKind::OrphanDataExtent,
                    ext.loc.clone(),
                    format!(
                        "data extent {b} ({} bytes): no file extent item references it",
                        ext.len
                    ),
                );
                continue;
            }
            let keys: HashSet<&DataRefKey> = w.keys().chain(have.keys()).collect();
            let mut keys: Vec<&DataRefKey> = keys.into_iter().collect();
            keys.sort();
            for k in keys {
                let a = w.get(k).copied().unwrap_or(0);
                let h = have.get(k).copied().unwrap_or(0);
                if a != h {
                    self.report.err(
                        FindingKind::DataBackrefMismatch,
                        ext.loc.clone(),
                        format!("data extent {b}: back reference {k:?} counts {h}, file extent items found {a}"),
                    );
                }
            }
        }
        self.report.counts.data_extents = data;
    }

    // ---------------------------------------------------------------------------------------
    // Phase 4

    fn phase_block_groups(&mut self) -> Result<()> {
        let root = self
            .trees
            .iter()
            .find(|r| r.id == BLOCK_GROUP_TREE_OBJECTID)
            .copied()
            .or_else(|| self.extent_root());
        let Some(root) = root else { return Ok(()) };
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(root.id));
                return Ok(());
            }
        };
        let mut groups = Vec::new();
        loop {
            let item = match it.next_item() {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(root.id));
                    break;
                }
            };
            if item.key.ty != BLOCK_GROUP_ITEM_KEY {
                continue;
            }
            let loc = item_loc(&item, root.id);
            match BlockGroupItem::parse(item.data()) {
                Ok(bg) => groups.push((item.key.objectid, item.key.offset, bg, loc)),
                Err(e) => self
                    .report
                    .err(FindingKind::ExtentItemBad, loc, e.to_string()),
            }
        }
        self.report.counts.block_groups = groups.len() as u64;
        let mut covered = 0u64;
        for (start, len, bg, loc) in &groups {
            let end = start.saturating_add(*len);
            for (b, e) in self.extents.range(*start..end) {
                let tree = e.flags & EXTENT_FLAG_TREE_BLOCK != 0;
                let fits = if tree {
                    bg.flags & (BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM) != 0
                } else {
                    bg.flags & BLOCK_GROUP_DATA != 0
                };
                if !fits {
                    self.report.err(
                        FindingKind::ExtentTypeMismatch,
                        e.loc.clone(),
                        format!(
                            "{} extent {b} lies in block group {start} of type {:#x}",
                            if tree { "tree block" } else { "data" },
                            bg.flags
                        ),
                    );
                }
            }
            let sum = self
                .extents
                .range(*start..end)
                .fold(0u64, |a, (_, e)| a.saturating_add(e.len));
            covered += self.extents.range(*start..end).count() as u64;
            if sum != bg.used {
                self.report.err(
                    FindingKind::BlockGroupUsedMismatch,
                    loc.clone(),
                    format!(
                        "block group {start} length {len}: used {} but extents in it total {sum}",
                        bg.used
                    ),
                );
            }
        }
        // Block groups and chunks describe the same ranges with the same type.
        const TYPE_MASK: u64 =
            BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM | BLOCK_GROUP_PROFILE_MASK;
        let chunks: Vec<(u64, u64, u64)> = self
            .fs
            .disk
            .chunk_map()
            .chunks()
            .map(|c| (c.logical, c.item.length, c.item.ty))
            .collect();
        for (start, len, bg, loc) in &groups {
            match chunks.iter().find(|c| c.0 == *start) {
                Some(c) if c.1 == *len && c.2 & TYPE_MASK == bg.flags & TYPE_MASK => {}
                Some(c) => self.report.err(
                    FindingKind::BlockGroupChunkMismatch,
                    loc.clone(),
                    format!(
                        "block group {start} length {len} flags {:#x}, but its chunk has length {} type {:#x}",
                        bg.flags, c.1, c.2
                    ),
                ),
                None => self.report.err(
                    FindingKind::BlockGroupChunkMismatch,
                    loc.clone(),
                    format!("block group {start} length {len} has no chunk"),
                ),
            }
        }
        for (start, len, _) in &chunks {
            if !groups.iter().any(|g| g.0 == *start) {
                self.report.err(
                    FindingKind::BlockGroupChunkMismatch,
                    Location::what(format!("chunk {start}")),
                    format!("chunk {start} length {len} has no block group item"),
                );
            }
        }
        let used = groups.iter().fold(0u64, |a, g| a.saturating_add(g.2.used));
        let sb_used = self.fs.disk.sb.bytes_used;
        if used != sb_used {
            self.report.err(
                FindingKind::SuperBytesUsedMismatch,
                Location::what("superblock"),
                format!("superblock bytes_used {sb_used}, block groups use {used}"),
            );
        }
        if covered != self.extents.len() as u64 {
            for (b, e) in &self.extents {
                let inside = groups
                    .iter()
                    .any(|(s, l, _, _)| *b >= *s && *b - *s < *l && e.len <= *l - (*b - *s));
                if !inside {
                    self.report.err(
                        FindingKind::ExtentOutsideBlockGroup,
                        e.loc.clone(),
                        format!("extent {b} ({} bytes) lies in no block group", e.len),
                    );
                }
            }
        }
        let mut recs: Vec<GroupRec> = groups
            .into_iter()
            .map(|(start, len, _, loc)| GroupRec { start, len, loc })
            .collect();
        recs.sort_by_key(|g| g.start);
        self.groups = recs;
        self.check_dev_extents();
        self.check_free_space_tree();
        Ok(())
    }

    /// Every item of a tree matching `want` (an unreadable block is reported and ends the walk).
    fn collect_items(&mut self, root: Root, want: impl Fn(&Key) -> bool) -> Vec<ItemRef> {
        let mut out = Vec::new();
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(root.id));
                return out;
            }
        };
        loop {
            match it.next_item() {
                Ok(Some(item)) => {
                    if want(&item.key) {
                        out.push(item);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(root.id));
                    break;
                }
            }
        }
        out
    }

    fn tree(&self, id: u64) -> Option<Root> {
        self.trees.iter().find(|r| r.id == id).copied()
    }

    /// Chunks against dev extents: every stripe has a DEV_EXTENT naming its chunk with the
    /// stripe's length, dev extents of a device do not overlap and stay inside it, and each
    /// device item's bytes_used is the sum of its dev extents.
    fn check_dev_extents(&mut self) {
        let Some(chunk_root) = self.tree(CHUNK_TREE_OBJECTID) else {
            return;
        };
        let Some(dev_root) = self.tree(DEV_TREE_OBJECTID) else {
            self.report.err(
                FindingKind::RootItemBad,
                Location::what("root tree"),
                "no device tree root item".into(),
            );
            return;
        };
        let mut chunks: Vec<(u64, ChunkItem, Location)> = Vec::new();
        let mut devs: BTreeMap<u64, (DevItem, Location)> = BTreeMap::new();
        for item in self.collect_items(chunk_root, |k| {
            k.ty == CHUNK_ITEM_KEY || k.ty == DEV_ITEM_KEY
        }) {
            let loc = item_loc(&item, CHUNK_TREE_OBJECTID);
            let r = if item.key.ty == CHUNK_ITEM_KEY {
                ChunkItem::parse(item.data())
                    .map(|(c, _)| chunks.push((item.key.offset, c, loc.clone())))
            } else {
                DevItem::parse(item.data()).map(|d| {
                    devs.insert(d.devid, (d, loc.clone()));
                })
            };
            if let Err(e) = r {
                self.report.err(FindingKind::DevItemBad, loc, e.to_string());
            }
        }
        // (devid, physical) -> (dev extent, location, matched by a stripe)
        let mut dexts: BTreeMap<(u64, u64), (DevExtent, Location, bool)> = BTreeMap::new();
        for item in self.collect_items(dev_root, |k| k.ty == DEV_EXTENT_KEY) {
            let loc = item_loc(&item, DEV_TREE_OBJECTID);
            match DevExtent::parse(item.data()) {
                Ok(d) => {
                    dexts.insert((item.key.objectid, item.key.offset), (d, loc, false));
                }
                Err(e) => self.report.err(FindingKind::DevItemBad, loc, e.to_string()),
            }
        }
        // The device against the image's real size.
        let image_len = self.fs.disk.dev().len();
        let this_dev = self.fs.disk.devid();
        let sb = &self.fs.disk.sb;
        let sum: u64 = devs
            .values()
            .fold(0u64, |a, (d, _)| a.saturating_add(d.total_bytes));
        if !devs.is_empty() && sb.total_bytes < sum {
            self.report.err(
                FindingKind::DeviceSizeMismatch,
                Location::what("superblock total_bytes"),
                format!(
                    "superblock total_bytes {} is smaller than its devices' total_bytes {sum}",
                    sb.total_bytes
                ),
            );
        }
        let mut dev_size_reported = false;
        for (what, size, loc) in [
            (
                "superblock dev_item",
                sb.dev_item.total_bytes,
                Location::what("superblock dev_item"),
            ),
            (
                "dev item",
                devs.get(&this_dev).map_or(0, |d| d.0.total_bytes),
                devs.get(&this_dev).map(|d| d.1.clone()).unwrap_or_default(),
            ),
        ] {
            if size > image_len && !dev_size_reported {
                dev_size_reported = true;
                self.report.err(
                    FindingKind::DeviceSizeMismatch,
                    loc,
                    format!(
                        "the {what} says device {this_dev} is {size} bytes, but the image is only {image_len} bytes (truncated?)"
                    ),
                );
            }
        }
        for (logical, c, cloc) in &chunks {
            let n = c.num_stripes as u64;
            let data_stripes = match c.ty & BLOCK_GROUP_PROFILE_MASK {
                BLOCK_GROUP_RAID0 => n,
                BLOCK_GROUP_RAID10 => n / (c.sub_stripes.max(1) as u64),
                BLOCK_GROUP_RAID5 => n.saturating_sub(1),
                BLOCK_GROUP_RAID6 => n.saturating_sub(2),
                _ => 1,
            };
            let stripe_len = c.length / data_stripes.max(1);
            for (i, st) in c.stripes.iter().enumerate() {
                let st_end = st.offset.saturating_add(stripe_len);
                let dev_len = self.fs.disk.devices.get(st.devid).map(|d| d.len());
                if dev_len.is_some_and(|len| st_end > len) {
                    self.report.err(
                        FindingKind::DeviceSizeMismatch,
                        cloc.clone(),
                        format!(
                            "chunk {logical} stripe {i} lies at device bytes {}..{st_end}, past the end of the image ({} bytes)",
                            st.offset,
                            dev_len.unwrap_or(0)
                        ),
                    );
                }
                match dexts.get_mut(&(st.devid, st.offset)) {
                    None => self.report.err(
                        FindingKind::DevExtentMissing,
                        cloc.clone(),
                        format!(
                            "chunk {logical} stripe {i} (devid {} offset {}) has no DEV_EXTENT",
                            st.devid, st.offset
                        ),
                    ),
                    Some((d, dloc, matched)) => {
                        *matched = true;
                        if d.chunk_offset != *logical || d.length != stripe_len {
                            self.report.err(
                                FindingKind::DevExtentMismatch,
                                dloc.clone(),
                                format!(
                                    "dev extent at devid {} offset {} names chunk {} length {}, but it holds stripe {i} of chunk {logical} (stripe length {stripe_len})",
                                    st.devid, st.offset, d.chunk_offset, d.length
                                ),
                            );
                        }
                    }
                }
            }
        }
        let mut used: BTreeMap<u64, u64> = BTreeMap::new();
        let mut prev: Option<(u64, u64)> = None; // (devid, end)
        for ((devid, phys), (d, dloc, matched)) in &dexts {
            if !matched && *devid == this_dev && phys.saturating_add(d.length) > image_len {
                self.report.err(
                    FindingKind::DeviceSizeMismatch,
                    dloc.clone(),
                    format!(
                        "dev extent at devid {devid} offset {phys} length {} lies past the end of the image ({image_len} bytes)",
                        d.length
                    ),
                );
            }
            if !matched {
                // Space reserved on the device for nothing: wasted, not damage (the kernel and
                // `btrfs check` accept it); overlaps and bytes_used are still checked.
                self.report.add(
                    Severity::Warning,
                    FindingKind::DevExtentMismatch,
                    dloc.clone(),
                    format!(
                        "dev extent at devid {devid} offset {phys} (chunk {} length {}) is no stripe of any chunk",
                        d.chunk_offset, d.length
                    ),
                );
            }
            let end = phys.saturating_add(d.length);
            if let Some((pdev, pend)) = prev {
                if pdev == *devid && pend > *phys {
                    self.report.err(
                        FindingKind::DevExtentOverlap,
                        dloc.clone(),
                        format!("dev extent at devid {devid} offset {phys} starts before the previous one ends at {pend}"),
                    );
                }
            }
            prev = Some((
                *devid,
                end.max(prev.filter(|p| p.0 == *devid).map_or(0, |p| p.1)),
            ));
            match devs.get(devid) {
                Some((dev, _)) if end > dev.total_bytes => self.report.err(
                    FindingKind::DevExtentMismatch,
                    dloc.clone(),
                    format!(
                        "dev extent at devid {devid} offset {phys} length {} ends past the device size {}",
                        d.length, dev.total_bytes
                    ),
                ),
                Some(_) => {}
                None => self.report.err(
                    FindingKind::DevExtentMismatch,
                    dloc.clone(),
                    format!("dev extent at devid {devid} offset {phys}: no device item for devid {devid}"),
                ),
            }
            let u = used.entry(*devid).or_default();
            *u = u.saturating_add(d.length);
        }
        for (devid, (dev, loc)) in &devs {
            let sum = used.get(devid).copied().unwrap_or(0);
            if dev.bytes_used != sum {
                self.report.err(
                    FindingKind::DevBytesUsedMismatch,
                    loc.clone(),
                    format!(
                        "device {devid}: bytes_used {} but its dev extents total {sum}",
                        dev.bytes_used
                    ),
                );
            }
        }
        let sd = &self.fs.disk.sb.dev_item;
        let sum = used.get(&sd.devid).copied().unwrap_or(0);
        if sd.bytes_used != sum {
            self.report.err(
                FindingKind::DevBytesUsedMismatch,
                Location::what("superblock dev_item"),
                format!(
                    "superblock device {}: bytes_used {} but its dev extents total {sum}",
                    sd.devid, sd.bytes_used
                ),
            );
        }
    }

    /// The free space tree against the extent tree, block group by block group.
    fn check_free_space_tree(&mut self) {
        let sb = &self.fs.disk.sb;
        if !sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE) {
            return;
        }
        if !sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE_VALID) {
            self.report.add(
                Severity::Warning,
                FindingKind::FreeSpaceMismatch,
                Location::what("superblock compat_ro flags"),
                "FREE_SPACE_TREE is set but FREE_SPACE_TREE_VALID is not: the kernel rebuilds the tree; not checked".into(),
            );
            return;
        }
        let Some(root) = self.tree(FREE_SPACE_TREE_OBJECTID) else {
            self.report.err(
                FindingKind::RootItemBad,
                Location::what("root tree"),
                "the FREE_SPACE_TREE feature is set but there is no free space tree".into(),
            );
            return;
        };
        let ss = self.fs.disk.sectorsize();
        let items = self.collect_items(root, |_| true);
        let groups = std::mem::take(&mut self.groups);
        // Items by block group (index into `groups`), the rest in key order.
        let mut per: BTreeMap<usize, Vec<&ItemRef>> = BTreeMap::new();
        let mut outside: Vec<&ItemRef> = Vec::new();
        for it in &items {
            let o = it.key.objectid;
            let i = groups.partition_point(|g| g.start <= o);
            match i.checked_sub(1) {
                Some(gi) if o - groups[gi].start < groups[gi].len => {
                    per.entry(gi).or_default().push(it)
                }
                _ => outside.push(it),
            }
        }
        let mut i = 0;
        while i < outside.len() {
            let it = outside[i];
            let loc = item_loc(it, FREE_SPACE_TREE_OBJECTID);
            if it.key.ty == FREE_SPACE_INFO_KEY {
                let (s, end) = (
                    it.key.objectid,
                    it.key.objectid.saturating_add(it.key.offset),
                );
                let overlaps = groups
                    .iter()
                    .any(|g| g.start < end && s < g.start.saturating_add(g.len));
                let mut j = i + 1;
                while j < outside.len()
                    && outside[j].key.ty != FREE_SPACE_INFO_KEY
                    && (s..end).contains(&outside[j].key.objectid)
                {
                    j += 1;
                }
                // mkfs's leftovers lie below the last block group; an info past every group
                // is damage.
                let below_last = groups.iter().any(|g| end <= g.start.saturating_add(g.len));
                if !overlaps && below_last {
                    self.report.add(
                        Severity::Warning,
                        FindingKind::FreeSpaceOutsideBlockGroup,
                        loc,
                        format!(
                            "free space info and {} more items for {s}+{}, which is no block group (stale: mkfs.btrfs leaves these for the temporary block groups it removes)",
                            j - i - 1,
                            it.key.offset
                        ),
                    );
                    i = j;
                    continue;
                }
            }
            self.report.err(
                FindingKind::FreeSpaceOutsideBlockGroup,
                loc,
                format!("free space item {} lies in no block group", it.key),
            );
            i += 1;
        }
        for (gi, g) in groups.iter().enumerate() {
            let its = per.remove(&gi).unwrap_or_default();
            let info_key = Key::new(g.start, FREE_SPACE_INFO_KEY, g.len);
            let Some(info) = its.first().filter(|i| i.key == info_key) else {
                let first = its
                    .first()
                    .map(|i| format!(" (its first free space item is {})", i.key))
                    .unwrap_or_default();
                self.report.err(
                    FindingKind::FreeSpaceInfoMissing,
                    g.loc.clone(),
                    format!(
                        "block group {}+{} has no FREE_SPACE_INFO {info_key}{first}",
                        g.start, g.len
                    ),
                );
                continue;
            };
            let iloc = item_loc(info, FREE_SPACE_TREE_OBJECTID);
            let refs: Vec<(Key, &[u8])> = its.iter().map(|i| (i.key, i.data())).collect();
            let d = match fst::decode_items(&refs, g.start, g.len, ss) {
                Ok(d) => d,
                Err(e) => {
                    let (loc, msg) = match &e {
                        Error::Corrupt { loc, reason } => {
                            let at = its
                                .iter()
                                .find(|i| Some(i.key) == loc.key)
                                .map(|i| item_loc(i, FREE_SPACE_TREE_OBJECTID));
                            (at.unwrap_or_else(|| iloc.clone()), reason.clone())
                        }
                        e => (iloc.clone(), e.to_string()),
                    };
                    self.report.err(
                        FindingKind::FreeSpaceItemBad,
                        loc,
                        format!("block group {}: {msg}", g.start),
                    );
                    continue;
                }
            };
            let unknown = d.info.flags & !FREE_SPACE_USING_BITMAPS;
            if unknown != 0 {
                self.report.err(
                    FindingKind::FreeSpaceFlagsMismatch,
                    iloc.clone(),
                    format!(
                        "block group {}: free space info flags {:#x} has unknown bits {unknown:#x}",
                        g.start, d.info.flags
                    ),
                );
            }
            if let Some(p) = d.flags_problem() {
                self.report.err(
                    FindingKind::FreeSpaceFlagsMismatch,
                    iloc.clone(),
                    format!("block group {}: {p}", g.start),
                );
            }
            if let Some(p) = d.count_problem() {
                self.report.err(
                    FindingKind::FreeSpaceCountMismatch,
                    iloc.clone(),
                    format!("block group {}: {p}", g.start),
                );
            }
            let end = g.start.saturating_add(g.len);
            let used = self
                .extents
                .range(..end)
                .rev()
                .take_while(|(b, e)| b.saturating_add(e.len) > g.start || **b >= g.start)
                .map(|(b, e)| (*b, e.len));
            let implied = fst::BgFreeSpace::from_used(g.start, g.len, used);
            if d.space != implied {
                let only_tree = range_diff(&d.space.extents, &implied.extents);
                let only_ext = range_diff(&implied.extents, &d.space.extents);
                let show = |v: &[(u64, u64)]| {
                    let mut s: Vec<String> =
                        v.iter().take(4).map(|(a, l)| format!("{a}+{l}")).collect();
                    if v.len() > 4 {
                        s.push(format!("... ({} ranges)", v.len()));
                    }
                    s.join(", ")
                };
                self.report.err(
                    FindingKind::FreeSpaceMismatch,
                    iloc.clone(),
                    format!(
                        "block group {}+{}: free space tree says {} free bytes, the extent tree {}; free only in the free space tree (used by extents): [{}]; free only by the extent tree: [{}]",
                        g.start,
                        g.len,
                        d.space.free_bytes(),
                        implied.free_bytes(),
                        show(&only_tree),
                        show(&only_ext)
                    ),
                );
            }
        }
        self.groups = groups;
    }

    // ---------------------------------------------------------------------------------------
    // Phase 5

    /// Returns the (logical, length) ranges of regular extents that must have csums.
    fn phase_fs_trees(&mut self) -> Result<Vec<(u64, u64, Location)>> {
        let mut csum = BTreeMap::new();
        let trees: Vec<Root> = self
            .trees
            .iter()
            .filter(|r| is_fs_tree(r.id) && !self.dropping.contains(&r.id))
            .copied()
            .collect();
        for root in trees {
            self.check_fs_tree(root, &mut csum);
        }
        self.check_root_refs();
        self.check_qgroups();
        Ok(csum.into_iter().map(|((b, l), loc)| (b, l, loc)).collect())
    }

    /// ROOT_REF and ROOT_BACKREF come in pairs (same parent, child, directory, index, name);
    /// each ROOT_REF has its directory entry in the parent tree and each subvolume entry its
    /// ROOT_REF; a live subvolume has a ROOT_BACKREF.
    fn check_root_refs(&mut self) {
        // (parent, child, directory, index, name): what a ref, its backref and the directory
        // entry must agree on.
        type RefKey<'k> = (u64, u64, u64, u64, &'k [u8]);
        let key = |r: &RootRefRec| -> (u64, u64, u64, u64, Vec<u8>) {
            (
                r.parent,
                r.child,
                r.rr.dirid,
                r.rr.sequence,
                r.rr.name.clone(),
            )
        };
        let refs: HashSet<_> = self.root_refs.iter().map(key).collect();
        let backrefs: HashSet<_> = self.root_backrefs.iter().map(key).collect();
        let entries: HashSet<RefKey> = self
            .subvol_entries
            .iter()
            .map(|e| (e.tree, e.child, e.dir, e.index, e.name.as_slice()))
            .collect();
        let checked: HashSet<u64> = self.trees.iter().map(|t| t.id).collect();
        let desc = |r: &RootRefRec| {
            format!(
                "subvolume {} in tree {} directory {} index {} name {:?}",
                r.child,
                r.parent,
                r.rr.dirid,
                r.rr.sequence,
                String::from_utf8_lossy(&r.rr.name)
            )
        };
        for r in &self.root_refs {
            if !backrefs.contains(&key(r)) {
                self.report.err(
                    FindingKind::RootRefWithoutBackref,
                    r.loc.clone(),
                    format!("ROOT_REF for {} has no matching ROOT_BACKREF", desc(r)),
                );
            }
            // Its directory entry, when the parent tree was checked.
            let e: RefKey = (r.parent, r.child, r.rr.dirid, r.rr.sequence, &r.rr.name);
            if checked.contains(&r.parent) && !entries.contains(&e) {
                self.report.err(
                    FindingKind::SubvolEntryMismatch,
                    r.loc.clone(),
                    format!(
                        "ROOT_REF for {}: the parent tree has no such DIR_INDEX",
                        desc(r)
                    ),
                );
            }
        }
        for b in &self.root_backrefs {
            if !refs.contains(&key(b)) {
                self.report.err(
                    FindingKind::RootBackrefWithoutRef,
                    b.loc.clone(),
                    format!("ROOT_BACKREF for {} has no matching ROOT_REF", desc(b)),
                );
            }
        }
        for e in &self.subvol_entries {
            // A snapshot keeps the entries of subvolumes nested in its source, without a
            // ROOT_REF (they show as empty directories): fine when the subvolume predates the
            // snapshot.
            let copied_by_snapshot =
                match (self.root_items.get(&e.tree), self.root_items.get(&e.child)) {
                    (Some((snap, _)), Some((child, _))) => {
                        snap.parent_uuid != [0u8; 16] && child.otransid <= snap.otransid
                    }
                    _ => false,
                };
            if copied_by_snapshot
                || refs.contains(&(e.tree, e.child, e.dir, e.index, e.name.clone()))
            {
                continue;
            }
            // With a ROOT_BACKREF from this tree the ROOT_REF is missing for sure; without one
            // the entry may be a stale copy in a snapshot made by a kernel that recorded no
            // parent uuid (`btrfs check` does not look at such entries): a warning.
            let backref = self
                .root_backrefs
                .iter()
                .any(|b| b.parent == e.tree && b.child == e.child);
            self.report.add(
                if backref {
                    Severity::Error
                } else {
                    Severity::Warning
                },
                FindingKind::SubvolEntryMismatch,
                e.loc.clone(),
                format!(
                    "tree {} directory {} DIR_INDEX {} {:?} names subvolume {}, which has no matching ROOT_REF{}",
                    e.tree,
                    e.dir,
                    e.index,
                    String::from_utf8_lossy(&e.name),
                    e.child,
                    if backref { "" } else { " (a stale entry copied by a snapshot?)" }
                ),
            );
        }
        let with_backref: HashSet<u64> = self.root_backrefs.iter().map(|b| b.child).collect();
        for (id, (ri, rloc)) in &self.root_items {
            if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(id)
                || ri.refs == 0
                || ri.drop_progress.objectid != 0
                || ri.drop_level != 0
            {
                continue;
            }
            if !with_backref.contains(id) {
                self.report.err(
                    FindingKind::SubvolUnreferenced,
                    rloc.clone(),
                    format!("subvolume {id} has refs {} but no ROOT_BACKREF", ri.refs),
                );
            }
        }
    }

    /// One fs tree: gathers each inode's items in one pass, then cross-checks them: the root
    /// directory, then per inode its own fields, its file extents and counts, its data extents'
    /// csum needs, and its directory entries and names against each other.
    fn check_fs_tree(&mut self, root: Root, csum: &mut BTreeMap<(u64, u64), Location>) {
        let tid = root.id;
        let Some((inodes, orphans)) = self.collect_fs_inodes(root) else {
            return;
        };
        self.report.counts.inodes += inodes.len() as u64;
        self.check_root_dir(root, &inodes);
        // Directory entries by (dir, index) and (dir, name).
        for (&n, ino) in &inodes {
            let Some((ii, iloc)) = &ino.item else {
                self.report.err(
                    FindingKind::DanglingInode,
                    ino.first_loc.clone().unwrap_or_default(),
                    format!("tree {tid}: items for inode {n}, which has no INODE_ITEM"),
                );
                continue;
            };
            if !self.check_inode_fields(n, ii, iloc, &orphans) {
                // Unlinked, its deletion pending (perhaps half done): names, sizes and
                // entries are not checked; its extents still are, through the extent tree.
                continue;
            }
            self.check_file_extent_cover(n, ino, ii, iloc);
            self.check_inode_counts(n, ino, ii, iloc);
            if ii.mode & 0o170000 == 0o100000 {
                self.note_data_extents(tid, n, ino, ii, iloc, csum);
            }
            self.check_dir_items_indexed(n, ino);
            self.check_dir_index_targets(tid, n, ino, &inodes);
            self.check_inode_refs(n, ino, &inodes);
        }
    }

    /// Collection phase of [`Self::check_fs_tree`]: one pass over the tree gathering each
    /// inode's items into an [`Ino`] (items that do not decode are reported here) and the
    /// inodes with an ORPHAN_ITEM. `None` when the tree cannot be read at all.
    fn collect_fs_inodes(&mut self, root: Root) -> Option<(BTreeMap<u64, Ino>, HashSet<u64>)> {
        let tid = root.id;
        let ss = self.fs.disk.sectorsize() as u64;
        let mut inodes: BTreeMap<u64, Ino> = BTreeMap::new();
        // Inodes with an ORPHAN_ITEM: unlinked, their deletion pending.
        let mut orphans: HashSet<u64> = HashSet::new();
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(tid));
                return None;
            }
        };
        loop {
            let item = match it.next_item() {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(tid));
                    break;
                }
            };
            let k = item.key;
            if k.objectid == ORPHAN_OBJECTID && k.ty == ORPHAN_ITEM_KEY {
                orphans.insert(k.offset);
                continue;
            }
            if k.objectid == FREE_INO_OBJECTID && k.ty == INODE_ITEM_KEY {
                self.report.err(
                    FindingKind::FsItemBad,
                    item_loc(&item, tid),
                    format!("tree {tid}: the deprecated free inode cache (inode_cache mount option, removed in Linux 5.11) is still there"),
                );
                continue;
            }
            if k.objectid < FIRST_FREE_OBJECTID || k.objectid > LAST_FREE_OBJECTID {
                continue; // free space cache inodes of the root tree, ...
            }
            let loc = item_loc(&item, tid);
            let ino = inodes.entry(k.objectid).or_default();
            if ino.first_loc.is_none() {
                ino.first_loc = Some(loc.clone());
            }
            if let Err(msg) = ino.add_item(k, item.data(), &loc, ss) {
                self.report.err(FindingKind::FsItemBad, loc, msg);
            }
        }
        Some((inodes, orphans))
    }

    /// The tree's first inode must exist and be a directory.
    fn check_root_dir(&mut self, root: Root, inodes: &BTreeMap<u64, Ino>) {
        let tid = root.id;
        let root_dir_ok = inodes
            .get(&FIRST_FREE_OBJECTID)
            .and_then(|i| i.item.as_ref())
            .is_some_and(|(ii, _)| ii.mode & 0o170000 == 0o040000);
        if !root_dir_ok {
            self.report.err(
                FindingKind::DanglingInode,
                Location {
                    tree: Some(tid),
                    bytenr: Some(root.bytenr),
                    ..Default::default()
                },
                format!("tree {tid}: no root directory (inode {FIRST_FREE_OBJECTID} is missing or not a directory)"),
            );
        }
    }

    /// The inode item's own fields: generations not past the next transaction, no
    /// IMMUTABLE/APPEND on a symlink, a directory's single link, and an ORPHAN_ITEM for an
    /// unlinked inode. Returns false for an unlinked inode, whose other checks are skipped.
    fn check_inode_fields(
        &mut self,
        n: u64,
        ii: &InodeItem,
        iloc: &Location,
        orphans: &HashSet<u64>,
    ) -> bool {
        let gen_limit = self.fs.disk.sb.generation.saturating_add(1);
        let is_dir = ii.mode & 0o170000 == 0o040000;
        let is_lnk = ii.mode & 0o170000 == 0o120000;
        if ii.generation > gen_limit || ii.transid > gen_limit {
            self.report.err(
                FindingKind::GenerationInvalid,
                iloc.clone(),
                format!(
                    "inode {n}: generation {} transid {}, but the superblock generation is {} (at most one more is valid)",
                    ii.generation,
                    ii.transid,
                    gen_limit - 1
                ),
            );
        }
        if is_lnk && ii.flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
            self.report.err(
                FindingKind::InodeFlagsBad,
                iloc.clone(),
                format!(
                    "inode {n}: a symlink with flags {:#x} (IMMUTABLE/APPEND cannot be set on symlinks)",
                    ii.flags
                ),
            );
        }
        if is_dir && ii.nlink >= 2 {
            self.report.err(
                FindingKind::NlinkMismatch,
                iloc.clone(),
                format!(
                    "directory {n}: nlink {} (a directory has one link)",
                    ii.nlink
                ),
            );
        }
        if ii.nlink == 0 {
            if !orphans.contains(&n) {
                self.report.err(
                    FindingKind::NlinkMismatch,
                    iloc.clone(),
                    format!("inode {n}: nlink 0 but no ORPHAN_ITEM"),
                );
            }
            return false;
        }
        true
    }

    /// The file extent items of a linked inode: overlaps found while collecting, and (without
    /// NO_HOLES) a file or symlink range up to isize that no item covers.
    fn check_file_extent_cover(&mut self, n: u64, ino: &Ino, ii: &InodeItem, iloc: &Location) {
        let no_holes = self.fs.disk.sb.has_incompat(INCOMPAT_NO_HOLES);
        let is_reg = ii.mode & 0o170000 == 0o100000;
        let is_lnk = ii.mode & 0o170000 == 0o120000;
        for (loc, msg) in &ino.overlaps {
            self.report
                .err(FindingKind::FileExtentOverlap, loc.clone(), msg.clone());
        }
        // Without NO_HOLES every byte up to isize has an extent item (holes included).
        if !no_holes && (is_reg || is_lnk) && ii.nlink > 0 && ii.size > 0 {
            let end = ino.file_end.unwrap_or(0);
            let gap = if ino.file_start != Some(0) {
                Some(0)
            } else {
                ino.first_gap
                    .filter(|g| *g < ii.size)
                    .or((end < ii.size).then_some(end))
            };
            if let Some(g) = gap {
                self.report.err(
                    FindingKind::FileExtentGap,
                    iloc.clone(),
                    format!(
                        "inode {n}: size {} but no file extent item (not even a hole) covers offset {g}, and the filesystem has no NO_HOLES",
                        ii.size
                    ),
                );
            }
        }
    }

    /// The inode item's counts against its items: nlink against its INODE_REF/EXTREF names,
    /// a directory's isize against its entries' names, a file's or symlink's nbytes against
    /// its extents.
    fn check_inode_counts(&mut self, n: u64, ino: &Ino, ii: &InodeItem, iloc: &Location) {
        let is_dir = ii.mode & 0o170000 == 0o040000;
        let is_reg = ii.mode & 0o170000 == 0o100000;
        // nlink: the subvolume root directory has a ".." ref; directories have nlink 1.
        if ii.nlink as u64 != ino.names {
            self.report.err(
                FindingKind::NlinkMismatch,
                iloc.clone(),
                format!(
                    "inode {n}: nlink {} but {} INODE_REF/EXTREF names",
                    ii.nlink, ino.names
                ),
            );
        }
        if is_dir {
            let sum: u64 = ino.dir_items.iter().map(|d| d.0.len() as u64).sum::<u64>()
                + ino.dir_index.iter().map(|d| d.1.len() as u64).sum::<u64>();
            if ii.size != sum {
                self.report.err(
                    FindingKind::DirSizeMismatch,
                    iloc.clone(),
                    format!(
                        "directory {n}: isize {} but its DIR_ITEM and DIR_INDEX names total {sum} bytes",
                        ii.size
                    ),
                );
            }
        }
        if (is_reg || ii.mode & 0o170000 == 0o120000) && ii.nbytes != ino.nbytes {
            self.report.err(
                FindingKind::NbytesMismatch,
                iloc.clone(),
                format!(
                    "inode {n}: nbytes {} but its extents account for {}",
                    ii.nbytes, ino.nbytes
                ),
            );
        }
    }

    /// A regular file's data extents: the ranges that must have csums go to `csum`, NODATASUM
    /// ranges to the later check that they have none; a compressed extent in a NODATASUM inode
    /// is reported.
    fn note_data_extents(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        ii: &InodeItem,
        iloc: &Location,
        csum: &mut BTreeMap<(u64, u64), Location>,
    ) {
        let nodatasum = ii.flags & INODE_NODATASUM != 0;
        for (b, l, reg, compressed, foff, floc) in &ino.extents {
            // Compressed data always has csums, whatever the inode's flags say.
            if *reg && (!nodatasum || *compressed) {
                csum.entry((*b, *l)).or_insert_with(|| iloc.clone());
            }
            if *reg && nodatasum && !*compressed {
                self.nodatasum.push(NodatasumRange {
                    logical: *b,
                    len: *l,
                    tree: tid,
                    ino: n,
                    file_off: *foff,
                    loc: floc.clone(),
                });
            }
            if *compressed && nodatasum {
                self.report.err(
                    FindingKind::FsItemBad,
                    floc.clone(),
                    format!("inode {n}: compressed extent at {b} in a NODATASUM inode (compression needs csums)"),
                );
            }
        }
    }

    /// Each DIR_ITEM of directory `n` has a DIR_INDEX with the same name and target.
    fn check_dir_items_indexed(&mut self, n: u64, ino: &Ino) {
        for (name, loc_key, dloc) in &ino.dir_items {
            if !ino
                .dir_index
                .iter()
                .any(|(_, nm, lk, _)| nm == name && lk == loc_key)
            {
                self.report.err(
                    FindingKind::DirItemWithoutIndex,
                    dloc.clone(),
                    format!(
                        "directory {n}: DIR_ITEM {:?} -> {loc_key} has no DIR_INDEX",
                        String::from_utf8_lossy(name)
                    ),
                );
            }
        }
    }

    /// Each DIR_INDEX of directory `n` has its DIR_ITEM, and points either at a subvolume whose
    /// tree exists (recorded for the ROOT_REF check) or at an existing inode with a matching
    /// INODE_REF/EXTREF.
    fn check_dir_index_targets(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        inodes: &BTreeMap<u64, Ino>,
    ) {
        for (idx, name, loc_key, dloc) in &ino.dir_index {
            let nm = String::from_utf8_lossy(name);
            if !ino
                .dir_items
                .iter()
                .any(|(nm2, lk, _)| nm2 == name && lk == loc_key)
            {
                self.report.err(
                    FindingKind::DirIndexWithoutItem,
                    dloc.clone(),
                    format!("directory {n}: DIR_INDEX {idx} {nm:?} -> {loc_key} has no DIR_ITEM"),
                );
            }
            if loc_key.ty == ROOT_ITEM_KEY {
                self.subvol_entries.push(SubvolEntry {
                    tree: tid,
                    dir: n,
                    index: *idx,
                    name: name.clone(),
                    child: loc_key.objectid,
                    loc: dloc.clone(),
                });
                // A subvolume entry: the subvolume's tree must exist.
                if !self.trees.iter().any(|r| r.id == loc_key.objectid) {
                    self.report.err(
                        FindingKind::DanglingInode,
                        dloc.clone(),
                        format!(
                            "directory {n}: DIR_INDEX {idx} {nm:?} -> subvolume {}, which has no tree",
                            loc_key.objectid
                        ),
                    );
                }
                continue;
            }
            if loc_key.ty != INODE_ITEM_KEY {
                self.report.err(
                    FindingKind::FsItemBad,
                    dloc.clone(),
                    format!("directory {n}: DIR_INDEX {idx} {nm:?} -> {loc_key}, neither an inode nor a subvolume"),
                );
                continue;
            }
            match inodes.get(&loc_key.objectid) {
                Some(t) if t.item.is_some() => {
                    if !t
                        .refs
                        .iter()
                        .any(|(p, i, nm2, _)| *p == n && i == idx && nm2 == name)
                    {
                        self.report.err(
                            FindingKind::DirEntryWithoutInodeRef,
                            dloc.clone(),
                            format!("directory {n}: DIR_INDEX {idx} {nm:?} -> inode {}, which has no INODE_REF/EXTREF with that parent, index and name", loc_key.objectid),
                        );
                    }
                }
                _ => self.report.err(
                    FindingKind::DanglingInode,
                    dloc.clone(),
                    format!(
                        "directory {n}: DIR_INDEX {idx} {nm:?} -> inode {}, which does not exist",
                        loc_key.objectid
                    ),
                ),
            }
        }
    }

    /// Each INODE_REF/EXTREF name of inode `n` has the DIR_INDEX in its parent directory that
    /// points back at it (the ".." ref of a subvolume root directory excepted).
    fn check_inode_refs(&mut self, n: u64, ino: &Ino, inodes: &BTreeMap<u64, Ino>) {
        for (parent, idx, name, rloc) in &ino.refs {
            if *parent == n {
                continue; // the ".." ref of a subvolume root directory
            }
            let ok = inodes.get(parent).is_some_and(|p| {
                p.dir_index.iter().any(|(i, nm, lk, _)| {
                    i == idx && nm == name && lk.objectid == n && lk.ty == INODE_ITEM_KEY
                })
            });
            if !ok {
                let kind = if inodes.get(parent).is_some_and(|p| p.item.is_some()) {
                    FindingKind::InodeRefWithoutDirIndex
                } else {
                    FindingKind::DanglingInode
                };
                self.report.err(
                    kind,
                    rloc.clone(),
                    format!(
                        "inode {n}: ref {:?} in directory {parent} index {idx} has no DIR_INDEX ({parent} DIR_INDEX {idx})",
                        String::from_utf8_lossy(name)
                    ),
                );
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Phase 6

    fn phase_csums(&mut self, extents: &[(u64, u64, Location)]) -> Result<()> {
        let ss = self.fs.disk.sectorsize() as u64;
        self.check_csum_items();
        self.check_log_csums();
        let nodatasum = std::mem::take(&mut self.nodatasum);
        for r in &nodatasum {
            if r.len > MAX_DATA_EXTENT {
                continue;
            }
            match self.fs.data_csums(r.logical, r.len) {
                Ok(v) => {
                    if let Some(i) = v.iter().position(|c| c.is_some()) {
                        let n = v.iter().filter(|c| c.is_some()).count();
                        self.report.err(
                            FindingKind::CsumOnNodatasum,
                            r.loc.clone(),
                            format!(
                                "odd csum item: tree {} inode {} is NODATASUM, but {n} sectors of its data at file offset {} (logical {}..{}) have csums, first at logical {}",
                                r.tree,
                                r.ino,
                                r.file_off,
                                r.logical,
                                r.logical.saturating_add(r.len),
                                r.logical.saturating_add(i as u64 * ss)
                            ),
                        );
                    }
                }
                Err(e) => self.unreadable(e, Some(CSUM_TREE_OBJECTID)),
            }
        }
        for (b, l, loc) in extents {
            // Phase 3 matched the length with the extent item; still, a data extent is at most
            // 128 MiB, and a damaged length must not make us allocate for billions of sectors.
            if *l > MAX_DATA_EXTENT {
                self.report.add(
                    Severity::Warning,
                    FindingKind::CsumMissing,
                    loc.clone(),
                    format!("data extent {b}: length {l} is too large; csums not checked"),
                );
                continue;
            }
            match self.fs.data_csums(*b, *l) {
                Ok(v) => {
                    self.report.counts.csum_sectors += v.len() as u64;
                    let missing: Vec<usize> = v
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| c.is_none())
                        .map(|(i, _)| i)
                        .collect();
                    if let Some(first) = missing.first() {
                        self.report.err(
                            FindingKind::CsumMissing,
                            loc.clone(),
                            format!(
                                "data at {b} ({l} bytes, used by a file extent): {} of {} sectors have no csum, first at {}",
                                missing.len(),
                                v.len(),
                                b.saturating_add((*first as u64).saturating_mul(ss))
                            ),
                        );
                    }
                }
                Err(e) => self.unreadable(e, Some(CSUM_TREE_OBJECTID)),
            }
        }
        Ok(())
    }

    /// Csum tree items: whole csums, and no two items covering the same sector.
    fn check_csum_items(&mut self) {
        let Some(root) = self.tree(CSUM_TREE_OBJECTID) else {
            return;
        };
        let ss = self.fs.disk.sectorsize() as u64;
        let csize = self.fs.disk.sb.csum_type.size() as u64;
        let mut prev: Option<(u64, Location)> = None; // (end, where)
        for item in self.collect_items(root, |k| k.ty == EXTENT_CSUM_KEY) {
            let loc = item_loc(&item, CSUM_TREE_OBJECTID);
            let k = item.key;
            let size = item.data().len() as u64;
            if k.objectid != EXTENT_CSUM_OBJECTID || size == 0 || !size.is_multiple_of(csize) {
                self.report.err(
                    FindingKind::FsItemBad,
                    loc,
                    format!("csum item {k}: size {size} is not a positive multiple of the csum size {csize}"),
                );
                continue;
            }
            let start = k.offset;
            let end = start.saturating_add(size / csize * ss);
            if let Some((pend, ploc)) = &prev {
                if start < *pend {
                    self.report.err(
                        FindingKind::CsumOverlap,
                        loc.clone(),
                        format!(
                            "csum item for {start}..{end} overlaps the previous one, which ends at {pend} ({ploc})"
                        ),
                    );
                }
            }
            if prev.as_ref().is_none_or(|p| end > p.0) {
                prev = Some((end, loc));
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Phase 7 (--check-data-csum)

    /// Reads every data sector that has a csum and compares.
    fn phase_data_read(&mut self) {
        let Some(root) = self.tree(CSUM_TREE_OBJECTID) else {
            return;
        };
        let ss = self.fs.disk.sectorsize() as u64;
        let ct = self.fs.disk.sb.csum_type;
        let csize = ct.size() as u64;
        // File extents by the data extent they use, for naming files.
        let mut by_extent: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (i, fe) in self.file_exts.iter().enumerate() {
            by_extent.entry(fe.disk_bytenr).or_default().push(i);
        }
        let items = self.collect_items(root, |k| {
            k.objectid == EXTENT_CSUM_OBJECTID && k.ty == EXTENT_CSUM_KEY
        });
        // At most this many mismatches are named one by one.
        const MAX_REPORTED: usize = 100;
        let mut reported = 0usize;
        let mut suppressed = 0u64;
        const CHUNK_SECTORS: u64 = 256;
        for item in items {
            let d = item.data();
            let n = d.len() as u64 / csize;
            let mut i = 0u64;
            while i < n {
                let cnt = (n - i).min(CHUNK_SECTORS);
                let Some(logical) = item.key.offset.checked_add(i * ss) else {
                    break;
                };
                let len = (cnt * ss) as usize;
                let sums = &d[(i * csize) as usize..((i + cnt) * csize) as usize];
                let all_ok = |at: usize, buf: &[u8]| {
                    let skip = at / ss as usize;
                    buf.chunks(ss as usize)
                        .zip(sums.chunks(csize as usize).skip(skip))
                        .all(|(b, c)| ct.verify(b, c))
                };
                let res = self
                    .fs
                    .disk
                    .read_data(logical, len, &all_ok)
                    .and_then(|r| match r {
                        Some(_) => Ok(None),
                        // No copy matches everywhere: the first copy, to name the bad sectors.
                        None => self.fs.disk.read_data(logical, len, &|_, _| true),
                    });
                match res {
                    Ok(None) => {}
                    Ok(Some(buf)) => {
                        for (j, (b, c)) in buf
                            .chunks(ss as usize)
                            .zip(sums.chunks(csize as usize))
                            .enumerate()
                        {
                            if ct.verify(b, c) {
                                continue;
                            }
                            if reported >= MAX_REPORTED {
                                suppressed += 1;
                                continue;
                            }
                            reported += 1;
                            let at = logical + j as u64 * ss;
                            let who = self.name_data(at, &by_extent);
                            self.report.err(
                                FindingKind::DataCsumMismatch,
                                item_loc(&item, CSUM_TREE_OBJECTID),
                                format!(
                                    "data checksum mismatch at logical {at} ({ss} bytes): {who}"
                                ),
                            );
                        }
                    }
                    Err(e) => self.report.err(
                        FindingKind::DataCsumMismatch,
                        item_loc(&item, CSUM_TREE_OBJECTID),
                        format!(
                            "data at logical {logical}..{} cannot be read: {e}",
                            logical + len as u64
                        ),
                    ),
                }
                self.report.counts.data_bytes_verified += len as u64;
                i += cnt;
            }
        }
        if suppressed > 0 {
            self.report.err(
                FindingKind::DataCsumMismatch,
                Location::what("data"),
                format!("{suppressed} more data sectors do not match their checksums"),
            );
        }
    }

    /// Which files use the data sector at `logical`: "file PATH (tree T inode I) offset F",
    /// for each file extent item that covers it (or "no file uses it").
    fn name_data(&self, logical: u64, by_extent: &BTreeMap<u64, Vec<usize>>) -> String {
        let Some((&start, ext)) = self.extents.range(..=logical).next_back() else {
            return "no extent item covers it".into();
        };
        if logical >= start.saturating_add(ext.len) {
            return "no extent item covers it".into();
        }
        let mut names = Vec::new();
        for &i in by_extent.get(&start).map(|v| v.as_slice()).unwrap_or(&[]) {
            let fe = &self.file_exts[i];
            let within = logical - start;
            let off = if fe.compressed {
                // Compressed: the sector lies somewhere in the item's compressed data.
                Some(fe.file_off)
            } else if within >= fe.offset && within - fe.offset < fe.num_bytes {
                Some(fe.file_off + (within - fe.offset))
            } else {
                None
            };
            let Some(off) = off else { continue };
            let path = self
                .fs
                .inode_path(crate::ids::Inode {
                    root: fe.owner,
                    ino: fe.ino,
                })
                .map(|p| format!("file /{p} "))
                .unwrap_or_default();
            names.push(format!(
                "{path}(tree {} inode {}) {}offset {off}",
                fe.owner,
                fe.ino,
                if fe.compressed {
                    "compressed extent at file "
                } else {
                    "file "
                }
            ));
            if names.len() >= 4 {
                break;
            }
        }
        if names.is_empty() {
            format!("in data extent {start}, which no file extent uses there")
        } else {
            format!("data extent {start}, used by {}", names.join("; "))
        }
    }

    /// Quota groups: each QGROUP_INFO's referenced and exclusive bytes against the extents its
    /// subvolumes reach (tree blocks through the trees that reach them, data through the file
    /// extent items of those trees' leaves). Skipped while a rescan is pending or the numbers
    /// are flagged inconsistent (the kernel recomputes them), and for simple quotas.
    fn check_qgroups(&mut self) {
        const STATUS_RESCAN: u64 = 1 << 1;
        const STATUS_INCONSISTENT: u64 = 1 << 2;
        const STATUS_SIMPLE: u64 = 1 << 3;
        let Some(root) = self.tree(QUOTA_TREE_OBJECTID) else {
            return;
        };
        let items = self.collect_items(root, |k| {
            matches!(
                k.ty,
                QGROUP_STATUS_KEY | QGROUP_INFO_KEY | QGROUP_RELATION_KEY
            )
        });
        let mut status = None;
        let mut infos: Vec<(u64, [u64; 4], Location)> = Vec::new();
        // parent -> children
        let mut children: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for it in &items {
            let loc = item_loc(it, QUOTA_TREE_OBJECTID);
            let d = it.data();
            match it.key.ty {
                QGROUP_STATUS_KEY if d.len() >= 32 => status = Some(le_u64(d, 16)),
                QGROUP_INFO_KEY if d.len() >= 40 => infos.push((
                    it.key.offset,
                    [le_u64(d, 8), le_u64(d, 16), le_u64(d, 24), le_u64(d, 32)],
                    loc,
                )),
                QGROUP_RELATION_KEY if d.is_empty() => {
                    // Both directions are stored; (child, parent) has child < parent.
                    if it.key.objectid < it.key.offset {
                        children
                            .entry(it.key.offset)
                            .or_default()
                            .push(it.key.objectid);
                    }
                }
                _ => self.report.err(
                    FindingKind::QgroupMismatch,
                    loc,
                    format!("quota item {} has a bad size {}", it.key, d.len()),
                ),
            }
        }
        let Some(flags) = status else {
            if !infos.is_empty() {
                self.report.err(
                    FindingKind::QgroupMismatch,
                    Location::what("quota tree"),
                    "quota groups without a QGROUP_STATUS item".into(),
                );
            }
            return;
        };
        if flags & (STATUS_RESCAN | STATUS_INCONSISTENT | STATUS_SIMPLE) != 0
            || self.fs.disk.sb.has_incompat(INCOMPAT_SIMPLE_QUOTA)
            || !self.dropping.is_empty()
        {
            return;
        }
        // Subvolume trees (relocation trees' tags lie in the same number range: not them).
        let subvol = |t: u64| {
            !is_reloc_tag(t)
                && (t == FS_TREE_OBJECTID
                    || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&t))
        };
        // Subvolumes reaching each extent, and its size.
        let mut per_extent: Vec<(u64, Vec<u64>)> = Vec::new();
        for rec in self.blocks.values() {
            let mut roots: Vec<u64> = rec.reach.iter().copied().filter(|t| subvol(*t)).collect();
            roots.sort_unstable();
            roots.dedup();
            if !roots.is_empty() {
                per_extent.push((self.fs.disk.nodesize() as u64, roots));
            }
        }
        let mut data_roots: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for fe in &self.file_exts {
            if let Some(l) = self.blocks.get(&fe.leaf) {
                data_roots
                    .entry(fe.disk_bytenr)
                    .or_default()
                    .extend(l.reach.iter().copied().filter(|t| subvol(*t)));
            }
        }
        for (b, mut roots) in data_roots {
            let Some(e) = self.extents.get(&b) else {
                continue;
            };
            roots.sort_unstable();
            roots.dedup();
            if !roots.is_empty() {
                per_extent.push((e.len, roots));
            }
        }
        // Level-0 members of each qgroup (a level-0 group is its own member).
        fn members(q: u64, children: &BTreeMap<u64, Vec<u64>>, out: &mut HashSet<u64>, depth: u32) {
            if q >> 48 == 0 {
                out.insert(q);
                return;
            }
            if depth > 8 {
                return;
            }
            for c in children.get(&q).map(|v| v.as_slice()).unwrap_or(&[]) {
                members(*c, children, out, depth + 1);
            }
        }
        for (q, [rfer, rfer_c, excl, excl_c], loc) in infos {
            let mut m = HashSet::new();
            members(q, &children, &mut m, 0);
            let (mut want_rfer, mut want_excl) = (0u64, 0u64);
            for (len, roots) in &per_extent {
                if roots.iter().any(|r| m.contains(r)) {
                    want_rfer += len;
                    if roots.iter().all(|r| m.contains(r)) {
                        want_excl += len;
                    }
                }
            }
            if (rfer, rfer_c, excl, excl_c) != (want_rfer, want_rfer, want_excl, want_excl) {
                self.report.err(
                    FindingKind::QgroupMismatch,
                    loc,
                    format!(
                        "qgroup {}/{}: referenced {rfer} (compressed {rfer_c}), exclusive {excl} (compressed {excl_c}), but its subvolumes reach {want_rfer} referenced and {want_excl} exclusive bytes",
                        q >> 48,
                        q & ((1 << 48) - 1)
                    ),
                );
            }
        }
    }

    /// An unreplayed fsync log: every regular extent it logs for an inode with data csums has
    /// its csums in the log or, for data committed before, in the csum tree (replay takes them
    /// from there).
    fn check_log_csums(&mut self) {
        if self.fs.disk.sb.log_root == 0 {
            return;
        }
        let log = match crate::tree_log::replay::read_log(&self.fs.disk) {
            Ok(Some(l)) => l,
            Ok(None) => return,
            Err(e) => {
                self.unreadable(e, Some(TREE_LOG_OBJECTID));
                return;
            }
        };
        let ss = self.fs.disk.sectorsize() as u64;
        let csize = self.fs.disk.sb.csum_type.size() as u64;
        for t in &log.trees {
            let mut ranges: Vec<(u64, u64)> = t
                .items
                .iter()
                .filter(|(k, _)| k.objectid == EXTENT_CSUM_OBJECTID && k.ty == EXTENT_CSUM_KEY)
                .map(|(k, d)| {
                    (
                        k.offset,
                        k.offset.saturating_add(d.len() as u64 / csize * ss),
                    )
                })
                .collect();
            ranges.sort_unstable();
            let covered = |a: u64, len: u64| {
                let end = a.saturating_add(len);
                let mut cur = a;
                for &(s, e) in &ranges {
                    if s > cur {
                        break;
                    }
                    cur = cur.max(e);
                    if cur >= end {
                        return true;
                    }
                }
                cur >= end
            };
            let mut csum_inode = None;
            for (k, d) in &t.items {
                if k.ty == INODE_ITEM_KEY {
                    csum_inode = InodeItem::parse(d)
                        .ok()
                        .filter(|ii| ii.flags & INODE_NODATASUM == 0)
                        .map(|_| k.objectid);
                    continue;
                }
                if k.ty != EXTENT_DATA_KEY || csum_inode != Some(k.objectid) {
                    continue;
                }
                let Ok(fe) = FileExtentItem::parse(d) else {
                    continue;
                };
                let FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                } = fe.body
                else {
                    continue;
                };
                if fe.ty != FILE_EXTENT_REG || disk_bytenr == 0 {
                    continue;
                }
                let (a, len) = if fe.compression != COMPRESS_NONE {
                    (disk_bytenr, disk_num_bytes)
                } else {
                    (disk_bytenr.saturating_add(offset), num_bytes)
                };
                // Csums of data committed earlier are in the csum tree already.
                let in_csum_tree = || {
                    len <= MAX_DATA_EXTENT
                        && self
                            .fs
                            .data_csums(a, len)
                            .is_ok_and(|v| v.iter().all(|c| c.is_some()))
                };
                if !covered(a, len) && !in_csum_tree() {
                    self.report.err(
                        FindingKind::LogCsumMissing,
                        Location::what(format!("fsync log of tree {}", t.subvol))
                            .with_tree(TREE_LOG_OBJECTID)
                            .with_key(*k),
                        format!(
                            "csum missing in the log: tree {} inode {} file offset {} logs data at logical {a} ({len} bytes) without its csums",
                            t.subvol, k.objectid, k.offset
                        ),
                    );
                }
            }
        }
    }
}
