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
//! 4. block groups: `used` equals the bytes of the extents inside the group.
//! 5. fs trees: nlink, directory entry pairs, directory sizes, nbytes, dangling references.
//! 6. data checksums: every sector of a checksummed regular extent has a csum.
//!
//! Nothing here writes. A block or item that cannot be decoded becomes a finding, not a panic.

use crate::ctree::{ItemRef, Root, TreeIter};
use crate::disk_io::{Expect, Readahead};
use crate::error::{Error, Location, Result};
use crate::format::hash::name_hash;
use crate::format::items::*;
use crate::format::*;
use crate::fs::Fs;
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
    pub fn has(&self, kind: FindingKind) -> bool {
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
    loc: Location,
}

struct ExtentRec {
    len: u64,
    refs: u64,
    flags: u64,
    refs_list: Vec<BackRef>,
    loc: Location,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum DataRefKey {
    Data { root: u64, ino: u64, offset: u64 },
    Shared { parent: u64 },
}

/// Largest data extent btrfs creates (128 MiB).
const MAX_DATA_EXTENT: u64 = 128 << 20;

fn is_fs_tree(id: u64) -> bool {
    id == FS_TREE_OBJECTID
        || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id)
        || id == DATA_RELOC_TREE_OBJECTID
}

struct Checker<'a> {
    fs: &'a Fs,
    report: Report,
    blocks: HashMap<u64, BlockRec>,
    file_exts: Vec<FileExtRef>,
    /// (tree id, root) for every tree found.
    trees: Vec<Root>,
    extents: BTreeMap<u64, ExtentRec>,
}

/// Runs every check. `progress` receives one line per phase.
pub fn check(fs: &Fs, progress: &mut dyn FnMut(&str)) -> Result<Report> {
    let mut c = Checker {
        fs,
        report: Report::default(),
        blocks: HashMap::new(),
        file_exts: Vec::new(),
        trees: Vec::new(),
        extents: BTreeMap::new(),
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
    Ok(c.report)
}

/// Location naming an item.
fn item_loc(it: &ItemRef, tree: u64) -> Location {
    let mut l = it.loc();
    l.tree = Some(tree);
    l
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
                    "the image has an unreplayed fsync log at {}; it is not checked",
                    sb.log_root
                ),
            );
        }
        self.walk(chunk);
        self.walk(tree_root);
        // Every ROOT_ITEM in the root tree.
        let mut roots = Vec::new();
        match TreeIter::new(self.fs.disk.clone(), tree_root, Key::MIN, Readahead::None) {
            Ok(mut it) => loop {
                match it.next_item() {
                    Ok(Some(item)) => {
                        if item.key.ty != ROOT_ITEM_KEY {
                            continue;
                        }
                        match RootItem::parse(item.data()) {
                            Ok(ri) => roots.push((item.key.objectid, ri)),
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
        for (id, ri) in roots {
            if id == TREE_LOG_OBJECTID || ri.bytenr == 0 {
                continue;
            }
            if ri.drop_progress.objectid != 0 || ri.drop_level != 0 {
                self.report.add(
                    Severity::Warning,
                    FindingKind::RootItemBad,
                    Location::what(format!("root item of tree {id}")),
                    format!(
                        "tree {id} is being deleted (drop progress {}); its blocks are not checked",
                        ri.drop_progress
                    ),
                );
                continue;
            }
            let root = Root {
                id,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            };
            self.walk(root);
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
                .map(|(t, v)| format!("tree {t} via {v:?}"))
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

    /// Depth-first walk of one tree; blocks already visited get the new edge only.
    fn walk(&mut self, root: Root) {
        self.report.counts.trees += 1;
        self.trees.push(root);
        let disk = self.fs.disk.clone();
        // (bytenr, edge, expect)
        let mut stack = vec![(
            root.bytenr,
            Edge::Root(root.id),
            Expect {
                owner: None,
                level: Some(root.level),
                generation: Some(root.generation),
                first_key: None,
            },
        )];
        while let Some((bytenr, edge, expect)) = stack.pop() {
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
                if is_fs_tree(root.id) || is_fs_tree(b.owner()) || root.id == ROOT_TREE_OBJECTID {
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
                stack.push((
                    p.blockptr,
                    Edge::Node {
                        parent: bytenr,
                        slot,
                    },
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

    fn collect_file_extents(&mut self, b: &crate::disk_io::TreeBlock) {
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
                ..
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
                        let len = if k.ty == METADATA_ITEM_KEY {
                            nodesize
                        } else {
                            k.offset
                        };
                        self.extents.insert(
                            k.objectid,
                            ExtentRec {
                                len,
                                refs: ei.refs,
                                flags: ei.flags,
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
            let mut tree_refs = HashSet::new();
            let mut shared_refs = HashSet::new();
            let mut n = 0u64;
            for r in &ext.refs_list {
                match r {
                    BackRef::TreeBlock { root } => {
                        n += 1;
                        tree_refs.insert(*root);
                        if !rec.reach.contains(root) {
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
                        let ok = rec
                            .edges
                            .iter()
                            .any(|e| matches!(e, Edge::Node { parent: p, .. } if p == parent));
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
                    Edge::Root(t) => tree_refs.contains(t),
                    Edge::Node { parent, .. } => {
                        shared_refs.contains(parent)
                            || self
                                .blocks
                                .get(parent)
                                .is_some_and(|p| p.reach.iter().any(|t| tree_refs.contains(t)))
                    }
                };
                if !explained {
                    let (what, loc) = match e {
                        Edge::Root(t) => (format!("root of tree {t}"), bloc.clone()),
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
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Phase 5

    /// Returns the (logical, length) ranges of regular extents that must have csums.
    fn phase_fs_trees(&mut self) -> Result<Vec<(u64, u64, Location)>> {
        let mut csum = BTreeMap::new();
        let trees: Vec<Root> = self
            .trees
            .iter()
            .filter(|r| is_fs_tree(r.id))
            .copied()
            .collect();
        for root in trees {
            self.check_fs_tree(root, &mut csum);
        }
        Ok(csum.into_iter().map(|((b, l), loc)| (b, l, loc)).collect())
    }

    fn check_fs_tree(&mut self, root: Root, csum: &mut BTreeMap<(u64, u64), Location>) {
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
            extents: Vec<(u64, u64, bool)>,
        }
        let tid = root.id;
        let mut inodes: BTreeMap<u64, Ino> = BTreeMap::new();
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(tid));
                return;
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
            if k.objectid < FIRST_FREE_OBJECTID || k.objectid > LAST_FREE_OBJECTID {
                continue; // orphan items, free-ino cache, ...
            }
            let loc = item_loc(&item, tid);
            let ino = inodes.entry(k.objectid).or_default();
            if ino.first_loc.is_none() {
                ino.first_loc = Some(loc.clone());
            }
            let bad = |e: Error| e.to_string();
            let r: std::result::Result<(), String> = (|| {
                match k.ty {
                    INODE_ITEM_KEY => {
                        ino.item = Some((InodeItem::parse(item.data()).map_err(bad)?, loc.clone()))
                    }
                    INODE_REF_KEY => {
                        for r in InodeRef::parse_all(item.data()).map_err(bad)? {
                            ino.names += 1;
                            ino.refs.push((k.offset, r.index, r.name, loc.clone()));
                        }
                    }
                    INODE_EXTREF_KEY => {
                        for r in InodeExtref::parse_all(item.data()).map_err(bad)? {
                            ino.names += 1;
                            ino.refs.push((r.parent, r.index, r.name, loc.clone()));
                        }
                    }
                    DIR_ITEM_KEY => {
                        for d in DirItem::parse_all(item.data()).map_err(bad)? {
                            if name_hash(&d.name) != k.offset {
                                return Err(format!(
                                    "dir item name {:?} does not hash to the key offset",
                                    String::from_utf8_lossy(&d.name)
                                ));
                            }
                            ino.dir_items.push((d.name, d.location, loc.clone()));
                        }
                    }
                    DIR_INDEX_KEY => {
                        for d in DirItem::parse_all(item.data()).map_err(bad)? {
                            ino.dir_index
                                .push((k.offset, d.name, d.location, loc.clone()));
                        }
                    }
                    EXTENT_DATA_KEY => {
                        let fe = FileExtentItem::parse(item.data()).map_err(bad)?;
                        match fe.body {
                            FileExtentBody::Inline(_) => {
                                ino.nbytes = ino.nbytes.saturating_add(fe.ram_bytes)
                            }
                            FileExtentBody::Extent {
                                disk_bytenr,
                                disk_num_bytes,
                                offset,
                                num_bytes,
                            } => {
                                if disk_bytenr != 0 {
                                    ino.nbytes = ino.nbytes.saturating_add(num_bytes);
                                    // Csums cover what the item uses: the whole extent when
                                    // compressed, else [offset, offset + num_bytes) of it (the
                                    // rest may be preallocated space never written).
                                    let range = if fe.compression != COMPRESS_NONE {
                                        (disk_bytenr, disk_num_bytes)
                                    } else {
                                        (disk_bytenr.saturating_add(offset), num_bytes)
                                    };
                                    ino.extents
                                        .push((range.0, range.1, fe.ty == FILE_EXTENT_REG));
                                }
                            }
                        }
                    }
                    _ => {}
                }
                Ok(())
            })();
            if let Err(msg) = r {
                self.report.err(FindingKind::FsItemBad, loc, msg);
            }
        }
        self.report.counts.inodes += inodes.len() as u64;
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
            if is_reg && ii.flags & INODE_NODATASUM == 0 {
                for &(b, l, reg) in &ino.extents {
                    if reg {
                        csum.entry((b, l)).or_insert_with(|| iloc.clone());
                    }
                }
            }
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
                        format!(
                            "directory {n}: DIR_INDEX {idx} {nm:?} -> {loc_key} has no DIR_ITEM"
                        ),
                    );
                }
                if loc_key.ty == ROOT_ITEM_KEY {
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
    }

    // ---------------------------------------------------------------------------------------
    // Phase 6

    fn phase_csums(&mut self, extents: &[(u64, u64, Location)]) -> Result<()> {
        let ss = self.fs.disk.sectorsize() as u64;
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
}
