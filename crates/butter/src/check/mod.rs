//! Read-only consistency checker (`butter check`).
//!
//! A file per phase (`trees`, `extents` for 2 and 3, `block_groups`, `fs_trees`, `csums`, and
//! `qgroups`); this file has the findings, the report and the order the phases run in.
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
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::BTreeMap;
use std::fmt;

mod block_groups;
mod csums;
mod extents;
mod fs_trees;
mod qgroups;
pub(crate) mod repair;
mod trees;

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
    /// The superblock's num_devices differs from the number of devices the chunk tree lists
    /// (the kernel refuses to mount it; only a repair opens it).
    NumDevicesMismatch,
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
    /// An uncompressed inline extent's ram_bytes differs from the length of its data.
    InlineRamBytesMismatch,
    /// An inode's mode is not one its kind of inode can have.
    InodeModeBad,
}

#[derive(Debug, Clone)]
pub struct Finding {
    pub severity: Severity,
    pub kind: FindingKind,
    pub location: Location,
    pub message: String,
    /// What `butter check --repair` would change to mend it, where the checker knows.
    pub fix: Option<Fix>,
}

/// A change that mends one finding: the value the checker found right, for the item it
/// names. `butter check --repair` applies them in one verified transaction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fix {
    /// The BLOCK_GROUP_ITEM at `start`: `used` becomes the bytes of the extents in it.
    BlockGroupUsed { start: u64, used: u64 },
    /// The superblock's bytes_used becomes the block groups' total.
    SuperBytesUsed,
    /// The inode item's nlink becomes the number of names it has.
    InodeNlink { root: u64, ino: u64, nlink: u32 },
    /// A directory's isize becomes twice the length of its entries' names.
    InodeSize { root: u64, ino: u64, size: u64 },
    /// A file's nbytes becomes what its extents account for.
    InodeNbytes { root: u64, ino: u64, nbytes: u64 },
    /// An inode's generation and transid become values a filesystem of this generation can
    /// have (a damaged one is replaced by the other, or by the superblock's).
    InodeGenerations {
        root: u64,
        ino: u64,
        generation: u64,
        transid: u64,
    },
    /// Each device's size rounded down to whole sectors, the superblock's total their sum
    /// (what `btrfs rescue fix-device-size` does).
    DeviceSizes,
    /// A device's bytes_used (its item, and so the superblock's copy) becomes the total of
    /// its dev extents.
    DevBytesUsed { devid: u64, used: u64 },
    /// Tree `root`'s root item takes the generation of the root block it names.
    RootGeneration { root: u64, generation: u64 },
    /// The extent item with this key takes a generation the filesystem can have.
    ExtentGeneration { key: Key, generation: u64 },
    /// An uncompressed inline file extent's ram_bytes becomes its data's length.
    InlineRamBytes { root: u64, key: Key, ram_bytes: u64 },
    /// An inode's mode becomes the one its kind must have.
    InodeMode { root: u64, ino: u64, mode: u32 },
    /// The quota groups are marked inconsistent (butter does not recompute them yet): the
    /// kernel rescans them at its next mount, `btrfs quota rescan` at once.
    QgroupsInconsistent,
    /// A tree block's extent item (with key `key`) takes the block's real level.
    MetadataLevel { key: Key, level: u8 },
    /// An extent item's inline back references put in the order btrfs requires.
    SortInlineRefs { key: Key },
    /// The item is deleted (it describes nothing that exists).
    DeleteItem { tree: u64, key: Key },
    /// An inode whose other items exist but whose INODE_ITEM is gone gets a new one, its
    /// fields from those items: a directory where it has entries (or is the root
    /// directory), else a regular file; its names, size and bytes counted.
    RecreateInode {
        root: u64,
        ino: u64,
        mode: u32,
        size: u64,
        nbytes: u64,
        nlink: u32,
    },
    /// Inode `ino` of tree `root`, unlinked (nlink 0, no name) without its ORPHAN_ITEM,
    /// gets one: the next mount frees it.
    OrphanItem { root: u64, ino: u64 },
    /// The superblock's num_devices becomes the number of devices the chunk tree lists.
    NumDevices { count: u64 },
    /// Tree `root`'s deprecated free inode cache goes: the FREE_INO inode's items, its
    /// FREE_SPACE header and the references of its data.
    DropInodeCache { root: u64 },
    /// Tree `root`'s root block, whose generation (and its root item's) is past the
    /// filesystem's, is copied: the copy and the root item take the repair's generation.
    CopyRootBlock { root: u64 },
    /// Tree `root`'s root item names the root block at `bytenr` (of `level` and
    /// `generation`): the newer root the extent tree records for it, which a root item left
    /// behind when its tree was changed does not name.
    RootBlock {
        root: u64,
        bytenr: u64,
        level: u8,
        generation: u64,
    },
    /// The regular file extent item `key` of tree `root` names the data extent at `bytenr`
    /// (its own address was damaged; the extent there has its back reference and length).
    FileExtentBytenr { root: u64, key: Key, bytenr: u64 },
    /// Inode `ino` of tree `root` gets back its file extent item at `offset`: the whole data
    /// extent at `bytenr` (`len` bytes), whose back reference for that offset no item used.
    RestoreFileExtent {
        root: u64,
        ino: u64,
        offset: u64,
        bytenr: u64,
        len: u64,
    },
    /// A hole file extent item covers `[offset, offset + len)` of inode `ino` of tree `root`,
    /// where no item did (a filesystem without NO_HOLES has one for every hole).
    FileExtentHole {
        root: u64,
        ino: u64,
        offset: u64,
        len: u64,
    },
    /// Directory `dir` of tree `root` gets the DIR_ITEM and DIR_INDEX (at `index`) of the
    /// name that inode `ino`'s INODE_REF gives it, where either is missing or wrong.
    DirEntry {
        root: u64,
        dir: u64,
        index: u64,
        name: Vec<u8>,
        ino: u64,
        file_type: u8,
    },
    /// Inode `ino` of tree `root`, which has no name left, is linked into the tree's
    /// `lost+found` directory (made when there is none) under its number; its nlink becomes 1.
    LostAndFound { root: u64, ino: u64, file_type: u8 },
    /// The extent at `bytenr` (`len` bytes; a tree block of `level` when set) gets exactly
    /// these back references with these counts: its item is made when it has none (or only
    /// one that cannot be read), and deleted, its space freed, when `refs` is empty.
    ExtentRefs {
        bytenr: u64,
        len: u64,
        level: Option<u8>,
        refs: Vec<(ExtentRef, u64)>,
    },
    /// The ROOT_REF (or with `backref` the ROOT_BACKREF) of subvolume `child` in tree
    /// `parent`, at directory `dirid` index `sequence` under `name`, is made: its mate and the
    /// directory entry exist.
    RootRef {
        parent: u64,
        child: u64,
        dirid: u64,
        sequence: u64,
        name: Vec<u8>,
        backref: bool,
    },
    /// The tree block at `bytenr` (of `level`, first key `key`), which fails validation
    /// only in what its own layout says (its header's generation, taken as `generation`
    /// from its parent; a leaf's item offsets, packed from its end), is read mended and
    /// copied into tree `tree` (a new block; the damaged one is never written).
    MendBlock {
        tree: u64,
        bytenr: u64,
        level: u8,
        generation: Option<u64>,
        key: Key,
    },
    /// Device `devid`'s DEV_EXTENT at `offset` names the chunk stripe that lies there: chunk
    /// `chunk_offset`, `length` bytes.
    DevExtent {
        devid: u64,
        offset: u64,
        chunk_offset: u64,
        length: u64,
    },
}

/// One back reference of an extent, as the trees call for it (see [`Fix::ExtentRefs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExtentRef {
    /// Tree `root` points at the block from one of its own blocks (TREE_BLOCK_REF).
    Tree(u64),
    /// The block at this address points at it (SHARED_BLOCK_REF).
    SharedBlock(u64),
    /// File extent items of `ino` in `root` at file offset - extent offset (EXTENT_DATA_REF).
    Data { root: u64, ino: u64, offset: u64 },
    /// File extent items in the leaf at this address (SHARED_DATA_REF).
    SharedData(u64),
}

impl fmt::Display for Fix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fix::BlockGroupUsed { start, used } => {
                write!(f, "set block group {start}'s used bytes to {used}")
            }
            Fix::SuperBytesUsed => {
                write!(
                    f,
                    "set the superblock's bytes_used to the block groups' total"
                )
            }
            Fix::InodeNlink { root, ino, nlink } => {
                write!(f, "set inode {ino} of tree {root}'s nlink to {nlink}")
            }
            Fix::InodeSize { root, ino, size } => {
                write!(f, "set directory {ino} of tree {root}'s size to {size}")
            }
            Fix::InodeNbytes { root, ino, nbytes } => {
                write!(f, "set inode {ino} of tree {root}'s nbytes to {nbytes}")
            }
            Fix::InodeGenerations {
                root,
                ino,
                generation,
                transid,
            } => write!(
                f,
                "set inode {ino} of tree {root}'s generation to {generation} and transid to {transid}"
            ),
            Fix::DevBytesUsed { devid, used } => {
                write!(f, "set device {devid}'s bytes_used to {used}")
            }
            Fix::RootGeneration { root, generation } => {
                write!(f, "set tree {root}'s root item generation to {generation}")
            }
            Fix::ExtentGeneration { key, generation } => write!(
                f,
                "set extent {} ({} bytes)'s generation to {generation}",
                key.objectid, key.offset
            ),
            Fix::InlineRamBytes {
                root,
                key,
                ram_bytes,
            } => write!(
                f,
                "set the inline extent of inode {} at {} in tree {root}'s ram_bytes to {ram_bytes}",
                key.objectid, key.offset
            ),
            Fix::InodeMode { root, ino, mode } => {
                write!(f, "set inode {ino} of tree {root}'s mode to {mode:o}")
            }
            Fix::QgroupsInconsistent => write!(
                f,
                "mark the quota groups inconsistent (the kernel rescans them at the next mount)"
            ),
            Fix::MetadataLevel { key, level } => write!(
                f,
                "set tree block {}'s extent item level to {level}",
                key.objectid
            ),
            Fix::SortInlineRefs { key } => {
                write!(f, "sort extent {}'s inline back references", key.objectid)
            }
            Fix::DeleteItem { tree, key } => write!(f, "delete item {key} of tree {tree}"),
            Fix::RecreateInode {
                root,
                ino,
                mode,
                size,
                nlink,
                ..
            } => write!(
                f,
                "make inode {ino} of tree {root} again: mode {mode:o}, size {size}, nlink {nlink}"
            ),
            Fix::DeviceSizes => write!(
                f,
                "round the device sizes down to whole sectors and make the superblock's total their sum"
            ),
            Fix::FileExtentBytenr { root, key, bytenr } => write!(
                f,
                "point the file extent of inode {} at {} in tree {root} at data extent {bytenr}",
                key.objectid, key.offset
            ),
            Fix::RestoreFileExtent {
                root,
                ino,
                offset,
                bytenr,
                len,
            } => write!(
                f,
                "give inode {ino} of tree {root} back its file extent at {offset}: data extent {bytenr} ({len} bytes)"
            ),
            Fix::FileExtentHole {
                root,
                ino,
                offset,
                len,
            } => write!(
                f,
                "cover [{offset}, +{len}) of inode {ino} of tree {root} with a hole file extent"
            ),
            Fix::DirEntry {
                root,
                dir,
                index,
                name,
                ino,
                ..
            } => write!(
                f,
                "give directory {dir} of tree {root} the entry {:?} -> inode {ino} at index {index}",
                String::from_utf8_lossy(name)
            ),
            Fix::LostAndFound { root, ino, .. } => write!(
                f,
                "link inode {ino} of tree {root}, which has no name, into lost+found as \"{ino}\""
            ),
            Fix::OrphanItem { root, ino } => write!(
                f,
                "give unlinked inode {ino} of tree {root} an ORPHAN_ITEM (the next mount frees it)"
            ),
            Fix::NumDevices { count } => {
                write!(f, "set the superblock's num_devices to {count}")
            }
            Fix::RootRef {
                parent,
                child,
                name,
                backref,
                ..
            } => write!(
                f,
                "make the {} of subvolume {child} in tree {parent} ({:?}) again",
                if *backref { "ROOT_BACKREF" } else { "ROOT_REF" },
                String::from_utf8_lossy(name)
            ),
            Fix::MendBlock {
                tree, bytenr, level, ..
            } => write!(
                f,
                "copy tree {tree}'s block {bytenr} (level {level}) mended: its generation from its parent, its items' offsets packed"
            ),
            Fix::DevExtent {
                devid,
                offset,
                chunk_offset,
                length,
            } => write!(
                f,
                "make device {devid}'s dev extent at {offset} name chunk {chunk_offset} ({length} bytes)"
            ),
            Fix::DropInodeCache { root } => {
                write!(f, "delete tree {root}'s deprecated free inode cache")
            }
            Fix::CopyRootBlock { root } => write!(
                f,
                "copy tree {root}'s root block, so that it and its root item get a valid generation"
            ),
            Fix::RootBlock {
                root,
                bytenr,
                generation,
                ..
            } => write!(
                f,
                "point tree {root}'s root item at its newer root block {bytenr} (generation {generation})"
            ),
            Fix::ExtentRefs {
                bytenr, len, refs, ..
            } if refs.is_empty() => write!(
                f,
                "delete extent {bytenr} ({len} bytes), which nothing references, and free its space"
            ),
            Fix::ExtentRefs {
                bytenr,
                len,
                level,
                refs,
            } => write!(
                f,
                "give {} {bytenr} ({len} bytes) the back references {refs:?}",
                if level.is_some() {
                    "tree block"
                } else {
                    "data extent"
                }
            ),
        }
    }
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
    fn add(
        &mut self,
        severity: Severity,
        kind: FindingKind,
        location: impl Into<Location>,
        msg: String,
    ) {
        self.findings.push(Finding {
            severity,
            kind,
            location: location.into(),
            message: msg,
            fix: None,
        });
    }
    fn err(&mut self, kind: FindingKind, location: impl Into<Location>, msg: String) {
        self.add(Severity::Error, kind, location, msg);
    }
    /// An error the repair knows how to mend with `fix`.
    fn err_fix(&mut self, kind: FindingKind, location: impl Into<Location>, msg: String, fix: Fix) {
        self.err_maybe_fix(kind, location, msg, Some(fix));
    }

    /// An error, with its fix where there is one.
    fn err_maybe_fix(
        &mut self,
        kind: FindingKind,
        location: impl Into<Location>,
        msg: String,
        fix: Option<Fix>,
    ) {
        self.err(kind, location, msg);
        if let Some(f) = self.findings.last_mut() {
            f.fix = fix;
        }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
    /// Some tree's root item names an older root than the extent tree has for it: the walk
    /// saw that tree as it was, so back references are mended only once it is pointed at
    /// its newer root (the next round of a repair).
    stale_root_items: bool,
    /// File extent items a data extent's unused back reference can give back, by (tree,
    /// inode, file offset) (phase 3 -> the file extent cover of phase 5).
    restorable: HashMap<(u64, u64, u64), Fix>,
    /// The superblock as last committed (a filesystem open read-write has moved on from the
    /// one it was opened with).
    sb: crate::format::superblock::Superblock,
    /// For `--init-extent-tree` ([`expected_extents`]): the extent tree is neither walked
    /// nor read, so every extent the other trees use is found missing, with the back
    /// references they call for.
    rebuild: bool,
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

impl<'a> Checker<'a> {
    /// A checker with nothing found yet; `rebuild`: see [`Checker::rebuild`].
    fn new(fs: &'a Core, rebuild: bool) -> Checker<'a> {
        Checker {
            fs,
            report: Report::default(),
            blocks: HashMap::default(),
            file_exts: Vec::new(),
            trees: Vec::new(),
            extents: BTreeMap::new(),
            groups: Vec::new(),
            root_items: BTreeMap::new(),
            root_refs: Vec::new(),
            root_backrefs: Vec::new(),
            subvol_entries: Vec::new(),
            dropping: HashSet::default(),
            nodatasum: Vec::new(),
            stale_root_items: false,
            restorable: HashMap::default(),
            rebuild,
            sb: fs.committed_sb(),
        }
    }
}

/// Runs the checks `opts` asks for. `progress` receives one line per phase.
pub(crate) fn check_with(
    fs: &Core,
    opts: Options,
    progress: &mut dyn FnMut(&str),
) -> Result<Report> {
    let mut c = Checker::new(fs, false);
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

/// Every extent the trees other than the extent tree use, with the back references they
/// call for, as [`Fix::ExtentRefs`] (what `--init-extent-tree` makes the new extent tree
/// from): tree blocks reached from every tree but the extent tree, data extents named by file
/// extent items. An error names what keeps the set from being complete: a tree block that
/// cannot be read, file extents that disagree on an extent's length.
pub(crate) fn expected_extents(fs: &Core, progress: &mut dyn FnMut(&str)) -> Result<Vec<Fix>> {
    let mut c = Checker::new(fs, true);
    c.phase_trees()?;
    progress(&format!(
        "trees read: {} trees, {} blocks",
        c.report.counts.trees, c.report.counts.tree_blocks
    ));
    if let Some(f) = c.report.findings.iter().find(|f| {
        matches!(
            f.kind,
            FindingKind::TreeBlockUnreadable | FindingKind::RootItemBad
        ) && f.severity != Severity::Warning
    }) {
        return Err(Error::Invalid(format!(
            "the extent tree cannot be made again while another tree is damaged: {f}"
        )));
    }
    c.phase_metadata_refs();
    c.phase_data_refs();
    let mut out = Vec::new();
    let mut seen: HashSet<u64> = HashSet::default();
    for f in &c.report.findings {
        match (&f.kind, &f.fix) {
            (
                FindingKind::MetadataExtentMissing | FindingKind::DataExtentMissing,
                Some(fix @ Fix::ExtentRefs { bytenr, .. }),
            ) if seen.insert(*bytenr) => out.push(fix.clone()),
            (
                FindingKind::MetadataExtentMissing | FindingKind::DataExtentMissing,
                Some(Fix::ExtentRefs { .. }),
            ) => {}
            (FindingKind::DataExtentMissing, _) => {
                return Err(Error::Invalid(format!(
                    "the extent tree cannot be made again: {f}"
                )))
            }
            _ => {}
        }
    }
    if c.stale_root_items {
        return Err(Error::Invalid(
            "the extent tree cannot be made again: a root item names an older root block than its tree's newest (run `butter check --repair` first)".into(),
        ));
    }
    progress(&format!("{} extents to record", out.len()));
    Ok(out)
}

/// Location naming an item.
fn item_loc(it: &ItemRef, tree: u64) -> Location {
    let mut l = it.loc();
    l.tree = Some(tree);
    l
}

/// An item's place (tree, block, slot, key) in 48 bytes, for the records the checker keeps
/// per inode and extent (a [`Location`] is 120); made a `Location` when reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    tree: u64,
    bytenr: u64,
    key: Key,
    slot: u32,
}

impl Place {
    fn of(it: &ItemRef, tree: u64) -> Place {
        let l = it.loc();
        Place {
            tree,
            bytenr: l.bytenr.unwrap_or(0),
            key: l.key.unwrap_or(it.key),
            slot: l.slot.unwrap_or(0) as u32,
        }
    }
}

impl From<Place> for Location {
    fn from(p: Place) -> Location {
        Location {
            tree: Some(p.tree),
            bytenr: Some(p.bytenr),
            slot: Some(p.slot as usize),
            key: Some(p.key),
            ..Default::default()
        }
    }
}

impl From<&Place> for Location {
    fn from(p: &Place) -> Location {
        Location::from(*p)
    }
}
