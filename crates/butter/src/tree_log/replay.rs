//! Fsync log trees: reading them and replaying them into the subvolume trees.
//!
//! An fsync writes the changed items of an inode (and what it needs: its names, the entries of
//! a logged directory) into a per-subvolume log tree, without committing a transaction. The
//! superblock's `log_root` points at the log root tree, which holds one ROOT_ITEM
//! (TREE_LOG_OBJECTID, ROOT_ITEM, subvolume id) per subvolume log tree. Log blocks and the data
//! extents only the log references are in neither the extent tree nor the free space tree.
//!
//! Replay, in the order the format needs:
//! 1. Inodes: each logged INODE_ITEM replaces the subvolume's (its size and nbytes are
//!    recomputed later; one with generation 0 only says the inode exists); a logged directory first loses the entries in its DIR_LOG_INDEX ranges
//!    that the log does not have; a logged inode loses xattrs the log does not have; a logged
//!    regular file loses extents past its logged size.
//! 2. Directory indexes: each logged DIR_INDEX becomes a name in its directory.
//! 3. Everything else: in each directory where the log has names of an inode, its names
//!    become exactly the logged ones (names in other directories stay); logged EXTENT_DATA items replace the file range they cover (data
//!    extents get references, logged checksums go into the checksum tree); xattrs are copied.
//! 4. Fix-ups: link counts recomputed from names (an inode left with none is deleted, as the
//!    orphan cleanup after a kernel replay does), nbytes from extents, directory sizes from
//!    entries.
//!
//! The log's blocks are freed (they were never in the extent tree) and the superblock's log
//! pointer is cleared at the commit that ends the replay.

use crate::ctree::TreeIter;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::io::disk_io::{Disk, Expect, Readahead};
use crate::transaction::extent_refs::RefKey;
use crate::transaction::Writer;
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// One subvolume's log tree, read into memory.
#[derive(Debug, Clone)]
pub(crate) struct LogTree {
    /// The subvolume it replays into.
    pub subvol: u64,
    pub items: BTreeMap<Key, Vec<u8>>,
}

/// The whole fsync log of an image.
#[derive(Debug, Clone)]
pub(crate) struct FsyncLog {
    pub trees: Vec<LogTree>,
    /// Every block of the log root tree and the log trees.
    pub blocks: Vec<u64>,
}

const MAX_LEVEL: u8 = 7;

fn log_loc(tree: u64, bytenr: u64) -> Location {
    Location::block(Some(TREE_LOG_OBJECTID), bytenr).with_tree(if tree == 0 {
        TREE_LOG_OBJECTID
    } else {
        tree
    })
}

fn corrupt_log(subvol: u64, bytenr: u64, reason: impl Into<String>) -> Error {
    let what = if subvol == 0 {
        "log root tree".to_string()
    } else {
        format!("fsync log tree of subvolume {subvol}")
    };
    Error::corrupt(
        Location::what(what).with_tree(TREE_LOG_OBJECTID),
        format!("block {bytenr}: {}", reason.into()),
    )
}

/// Walks one log tree, collecting its blocks and items.
#[allow(clippy::too_many_arguments)]
fn walk(
    disk: &Disk,
    subvol: u64,
    bytenr: u64,
    level: u8,
    generation: u64,
    first_key: Option<Key>,
    seen: &mut HashSet<u64>,
    blocks: &mut Vec<u64>,
    items: &mut BTreeMap<Key, Vec<u8>>,
) -> Result<()> {
    if level > MAX_LEVEL {
        return Err(corrupt_log(
            subvol,
            bytenr,
            format!("level {level} is too high"),
        ));
    }
    if !seen.insert(bytenr) {
        return Err(corrupt_log(
            subvol,
            bytenr,
            "block is referenced twice (loop or shared block in a log)",
        ));
    }
    let b = disk
        .read_tree_block(
            bytenr,
            &Expect {
                owner: Some(TREE_LOG_OBJECTID),
                level: Some(level),
                generation: Some(generation),
                first_key,
            },
        )
        .map_err(|e| {
            Error::corrupt(
                log_loc(subvol, bytenr),
                format!(
                    "reading fsync log block (subvolume {subvol}, level {level}, generation {generation}): {e}"
                ),
            )
        })?;
    blocks.push(bytenr);
    let n = b.nritems();
    if b.is_leaf() {
        let mut prev: Option<Key> = None;
        for slot in 0..n {
            let k = b.key(slot);
            if let Some(p) = prev {
                if p >= k {
                    return Err(corrupt_log(
                        subvol,
                        bytenr,
                        format!("keys out of order at slot {slot}: {p:?} then {k:?}"),
                    ));
                }
            }
            prev = Some(k);
            if items.insert(k, b.item_data(slot).to_vec()).is_some() {
                return Err(corrupt_log(
                    subvol,
                    bytenr,
                    format!("key {k:?} appears in two leaves"),
                ));
            }
        }
    } else {
        if n == 0 {
            return Err(corrupt_log(subvol, bytenr, "empty node"));
        }
        for slot in 0..n {
            let p = b.ptr(slot);
            if p.generation > generation {
                return Err(corrupt_log(
                    subvol,
                    bytenr,
                    format!(
                        "child {} has generation {} newer than its parent's {generation}",
                        p.blockptr, p.generation
                    ),
                ));
            }
            walk(
                disk,
                subvol,
                p.blockptr,
                level - 1,
                p.generation,
                Some(p.key),
                seen,
                blocks,
                items,
            )?;
        }
    }
    Ok(())
}

/// Reads the fsync log, if the superblock has one.
pub(crate) fn read_log(disk: &Disk) -> Result<Option<FsyncLog>> {
    let sb = &disk.sb;
    if sb.log_root == 0 {
        return Ok(None);
    }
    let gen = sb.generation + 1;
    let mut seen = HashSet::new();
    let mut blocks = Vec::new();
    let mut root_items = BTreeMap::new();
    walk(
        disk,
        0,
        sb.log_root,
        sb.log_root_level,
        gen,
        None,
        &mut seen,
        &mut blocks,
        &mut root_items,
    )?;
    let mut trees = Vec::new();
    for (k, body) in &root_items {
        if k.objectid != TREE_LOG_OBJECTID || k.ty != ROOT_ITEM_KEY {
            // The kernel only stores log ROOT_ITEMs here.
            return Err(Error::corrupt(
                Location::what("log root tree")
                    .with_tree(TREE_LOG_OBJECTID)
                    .with_key(*k),
                "unexpected item in the log root tree",
            ));
        }
        let subvol = k.offset;
        if !(subvol == FS_TREE_OBJECTID
            || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&subvol))
        {
            return Err(Error::corrupt(
                Location::what("log root tree")
                    .with_tree(TREE_LOG_OBJECTID)
                    .with_key(*k),
                format!("log for tree {subvol}, which is not a subvolume"),
            ));
        }
        let ri = RootItem::parse(body).map_err(|e| {
            Error::corrupt(
                Location::what("log root tree")
                    .with_tree(TREE_LOG_OBJECTID)
                    .with_key(*k),
                format!("log root item: {e}"),
            )
        })?;
        if ri.generation > gen || ri.bytenr == 0 {
            return Err(Error::corrupt(
                Location::what("log root tree")
                    .with_tree(TREE_LOG_OBJECTID)
                    .with_key(*k),
                format!(
                    "log root item points at block {} generation {} (log generation {gen})",
                    ri.bytenr, ri.generation
                ),
            ));
        }
        let mut items = BTreeMap::new();
        walk(
            disk,
            subvol,
            ri.bytenr,
            ri.level,
            ri.generation,
            None,
            &mut seen,
            &mut blocks,
            &mut items,
        )?;
        trees.push(LogTree { subvol, items });
    }
    Ok(Some(FsyncLog { trees, blocks }))
}

/// Starts the write engine of a read-write open: replays and commits the fsync log first
/// when the image has one.
pub(crate) fn start_writer(fs: &Core) -> Result<Writer> {
    let disk = fs.disk.clone();
    let log = read_log(&disk).map_err(|e| {
        with_hint(
            e,
            "the fsync log is damaged; nothing was written (`btrfs rescue zero-log` drops it)",
        )
    })?;
    let Some(log) = log else {
        return Writer::open(disk, fs.live.clone());
    };
    let mut w = Writer::open_with_log(disk, fs.live.clone())?;
    replay(fs, &mut w, &log).map_err(|e| {
        with_hint(
            e,
            "the fsync log could not be replayed; nothing was written (read-only opens with \
             OpenOpts::nologreplay show the last committed state; `btrfs rescue zero-log` \
             drops the log)",
        )
    })?;
    // The commit clears the superblock's log pointer, even when replay changed nothing.
    w.force_commit()?;
    log::info!(
        "replayed the fsync log ({} subvolume log(s), {} blocks)",
        log.trees.len(),
        log.blocks.len()
    );
    Ok(w)
}

/// Read-only open of an image with a log: replays into memory only (the write engine's
/// overlay), so reads show what a mount would, and nothing is written.
pub(crate) fn replay_in_memory(fs: &Core) -> Result<()> {
    let disk = fs.disk.clone();
    let log = read_log(&disk).map_err(|e| {
        with_hint(
            e,
            "the fsync log is damaged (open with OpenOpts::nologreplay to read the last \
             committed state without it)",
        )
    })?;
    let Some(log) = log else {
        return Ok(());
    };
    let mut w = Writer::open_with_log(disk, fs.live.clone())?;
    replay(fs, &mut w, &log).map_err(|e| {
        with_hint(
            e,
            "the fsync log could not be replayed in memory (open with OpenOpts::nologreplay \
             to read the last committed state without it)",
        )
    })
}

/// Adds what to do to an error, keeping its kind.
fn with_hint(e: Error, hint: &str) -> Error {
    match e {
        Error::Corrupt { loc, reason } => Error::Corrupt {
            loc,
            reason: format!("{reason}; {hint}"),
        },
        Error::BadChecksum { loc, reason } => Error::BadChecksum {
            loc,
            reason: format!("{reason}; {hint}"),
        },
        e => e,
    }
}

/// Replays `log` into the running transaction of `w`.
pub(crate) fn replay(fs: &Core, w: &mut Writer, log: &FsyncLog) -> Result<()> {
    let ns = fs.disk.nodesize() as u64;
    // Nothing may be allocated over the log's blocks or its data before the commit is on
    // disk: they are in use, though the extent tree does not say so. The blocks become free
    // after the commit (pinned), the data extents get extent items below.
    for &b in &log.blocks {
        w.allocator.reserve(b, ns);
        w.allocator.pin(b, ns)?;
    }
    for t in &log.trees {
        for (k, body) in &t.items {
            if k.ty != EXTENT_DATA_KEY {
                continue;
            }
            let fe = FileExtentItem::parse(body).map_err(|e| item_err(t, k, e))?;
            if fe.compression > 3 || fe.encryption != 0 || fe.other_encoding != 0 {
                return Err(Error::corrupt(
                    item_loc(t, k),
                    format!(
                        "file extent with compression {}, encryption {}, other encoding {}",
                        fe.compression, fe.encryption, fe.other_encoding
                    ),
                ));
            }
            if let FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                ..
            } = fe.body
            {
                if disk_bytenr != 0 {
                    let ss = fs.disk.sectorsize() as u64;
                    let offset = match fe.body {
                        FileExtentBody::Extent { offset, .. } => offset,
                        _ => 0,
                    };
                    if disk_bytenr % ss != 0
                        || disk_num_bytes % ss != 0
                        || offset % ss != 0
                        || disk_num_bytes == 0
                    {
                        return Err(Error::corrupt(
                            item_loc(t, k),
                            format!(
                                "data extent [{disk_bytenr}, +{disk_num_bytes}) offset {offset} \
                                 is not sector aligned"
                            ),
                        ));
                    }
                    let end = disk_bytenr.checked_add(disk_num_bytes);
                    let group = w.allocator.group_containing(disk_bytenr);
                    let fits = group.and_then(|g| {
                        w.allocator.with_group(g, |bg| {
                            end.is_some_and(|e| e <= bg.end())
                                && crate::space::alloc::SpaceKind::of_flags(bg.flags)
                                    == Some(crate::space::alloc::SpaceKind::Data)
                        })
                    });
                    if fits != Some(true) {
                        return Err(Error::corrupt(
                            item_loc(t, k),
                            format!(
                                "data extent [{disk_bytenr}, +{disk_num_bytes}) is not inside a \
                                 data block group"
                            ),
                        ));
                    }
                    w.allocator.reserve(disk_bytenr, disk_num_bytes);
                }
            }
        }
    }
    for t in &log.trees {
        w.reserve_metadata(false)?;
        let mut r = Replayer {
            fs,
            root: t.subvol,
            log: t,
            touched: BTreeSet::new(),
            dirs: BTreeSet::new(),
            unlinked: BTreeSet::new(),
        };
        w.current_root(t.subvol).map_err(|e| {
            Error::corrupt(
                item_loc(t, &Key::new(TREE_LOG_OBJECTID, ROOT_ITEM_KEY, t.subvol)),
                format!(
                    "the log is for subvolume {} which does not exist: {e}",
                    t.subvol
                ),
            )
        })?;
        r.run(w)?;
        fs.forget_subvol(t.subvol);
    }
    w.next_ino.clear();
    w.next_index.clear();
    Ok(())
}

fn item_loc(t: &LogTree, k: &Key) -> Location {
    Location::what(format!("fsync log of subvolume {}", t.subvol))
        .with_tree(TREE_LOG_OBJECTID)
        .with_key(*k)
}

fn item_err(t: &LogTree, k: &Key, e: Error) -> Error {
    Error::corrupt(item_loc(t, k), e.to_string())
}

/// One name of an inode: (parent directory, name, index).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Name {
    parent: u64,
    name: Vec<u8>,
    index: u64,
}

struct Replayer<'a> {
    fs: &'a Core,
    root: u64,
    log: &'a LogTree,
    /// Inodes whose link count must be recomputed.
    touched: BTreeSet<u64>,
    /// Directories whose size must be recomputed.
    dirs: BTreeSet<u64>,
    /// Inodes that lost a name in the replay.
    unlinked: BTreeSet<u64>,
}

impl Replayer<'_> {
    fn ino(&self, ino: u64) -> Inode {
        Inode {
            root: self.root,
            ino,
        }
    }

    fn log_items(&self, objectid: u64, ty: u8) -> impl Iterator<Item = (&Key, &Vec<u8>)> {
        self.log
            .items
            .range(Key::new(objectid, ty, 0)..=Key::new(objectid, ty, u64::MAX))
    }

    fn inode_exists(&self, w: &mut Writer, ino: u64) -> Result<Option<InodeItem>> {
        match w.read_item(self.root, &Key::new(ino, INODE_ITEM_KEY, 0))? {
            Some(b) => Ok(Some(InodeItem::parse(&b).map_err(|e| {
                Error::corrupt(
                    Location::what(format!("inode {ino}"))
                        .with_tree(self.root)
                        .with_key(Key::new(ino, INODE_ITEM_KEY, 0)),
                    e.to_string(),
                )
            })?)),
            None => Ok(None),
        }
    }

    /// Items of the subvolume tree with keys in `[from, to]`.
    fn subvol_items(&self, w: &mut Writer, from: Key, to: Key) -> Result<Vec<(Key, Vec<u8>)>> {
        let root = w.current_root(self.root)?;
        let mut it = TreeIter::new(self.fs.disk.clone(), root, from, Readahead::None)?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            if item.key > to {
                break;
            }
            if item.key >= from {
                out.push((item.key, item.data().to_vec()));
            }
        }
        Ok(out)
    }

    /// The names an inode has in the subvolume.
    fn names_in_subvol(&self, w: &mut Writer, ino: u64) -> Result<Vec<Name>> {
        let mut out = Vec::new();
        for (k, body) in self.subvol_items(
            w,
            Key::new(ino, INODE_REF_KEY, 0),
            Key::new(ino, INODE_EXTREF_KEY, u64::MAX),
        )? {
            self.parse_names(&k, &body, &mut out).map_err(|e| {
                Error::corrupt(
                    Location::what("inode ref").with_tree(self.root).with_key(k),
                    e.to_string(),
                )
            })?;
        }
        Ok(out)
    }

    fn parse_names(&self, k: &Key, body: &[u8], out: &mut Vec<Name>) -> Result<()> {
        match k.ty {
            INODE_REF_KEY => {
                for r in InodeRef::parse_all(body)? {
                    out.push(Name {
                        parent: k.offset,
                        name: r.name,
                        index: r.index,
                    });
                }
            }
            INODE_EXTREF_KEY => {
                for r in InodeExtref::parse_all(body)? {
                    out.push(Name {
                        parent: r.parent,
                        name: r.name,
                        index: r.index,
                    });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The entry `name` of directory `dir` in the subvolume.
    fn lookup(&self, w: &mut Writer, dir: u64, name: &[u8]) -> Result<Option<DirItem>> {
        let k = Key::new(dir, DIR_ITEM_KEY, hash::name_hash(name));
        let Some(body) = w.read_item(self.root, &k)? else {
            return Ok(None);
        };
        let all = DirItem::parse_all(&body).map_err(|e| {
            Error::corrupt(
                Location::what("dir item").with_tree(self.root).with_key(k),
                e.to_string(),
            )
        })?;
        Ok(all.into_iter().find(|d| d.name == name))
    }

    fn run(&mut self, w: &mut Writer) -> Result<()> {
        let inode_keys: Vec<Key> = self
            .log
            .items
            .keys()
            .filter(|k| k.ty == INODE_ITEM_KEY)
            .copied()
            .collect();
        // 1. Inodes.
        for k in &inode_keys {
            self.replay_inode(w, k)?;
        }
        // 2. Directory indexes.
        let idx: Vec<(Key, Vec<u8>)> = self
            .log
            .items
            .iter()
            .filter(|(k, _)| k.ty == DIR_INDEX_KEY)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        for (k, body) in &idx {
            self.replay_dir_index(w, k, body)?;
        }
        // 3. Names, extents, xattrs, checksums.
        let objectids: BTreeSet<u64> = self
            .log
            .items
            .keys()
            .filter(|k| k.objectid != EXTENT_CSUM_OBJECTID)
            .map(|k| k.objectid)
            .collect();
        for &ino in &objectids {
            self.replay_names(w, ino)?;
            self.replay_extents(w, ino)?;
            self.replay_xattrs(w, ino)?;
        }
        // 4. Fix-ups.
        self.fixup(w)
    }

    fn replay_inode(&mut self, w: &mut Writer, k: &Key) -> Result<()> {
        let ino = k.objectid;
        let body = &self.log.items[k];
        let logged = InodeItem::parse(body).map_err(|e| item_err(self.log, k, e))?;
        let is_dir = logged.mode & 0o170000 == 0o040000;
        let is_reg = logged.mode & 0o170000 == 0o100000;
        let existing = self.inode_exists(w, ino)?;
        if is_dir {
            if let Some(e) = &existing {
                if e.mode & 0o170000 != 0o040000 {
                    return Err(Error::corrupt(
                        item_loc(self.log, k),
                        "logged directory is a non-directory in the subvolume",
                    ));
                }
            }
            self.dir_deletes(w, ino)?;
            self.dirs.insert(ino);
        }
        if logged.generation == 0 {
            // Logged only to say the inode exists (a new name of it was logged with its
            // directory): an existing inode keeps its item; a regular file takes the logged
            // size when it is not 0.
            if let Some(mut e) = existing {
                if is_reg && logged.size != 0 && e.size != logged.size {
                    e.size = logged.size;
                    w.replace_item(self.root, *k, &e.to_bytes())?;
                }
                self.touched.insert(ino);
                return Ok(());
            }
        }
        self.xattr_deletes(w, ino)?;
        let mut item = logged.clone();
        if let Some(e) = &existing {
            item.nbytes = e.nbytes;
            if is_dir {
                item.size = e.size;
            }
        } else {
            item.nbytes = 0;
            if is_dir {
                item.size = 0;
            }
        }
        w.replace_item(self.root, *k, &item.to_bytes())?;
        self.touched.insert(ino);
        if is_reg && existing.is_some() {
            self.fs.truncate_extents(w, self.ino(ino), logged.size)?;
        }
        Ok(())
    }

    /// Entries of logged directory `dir` in its DIR_LOG_INDEX ranges that the log does not
    /// have are gone.
    fn dir_deletes(&mut self, w: &mut Writer, dir: u64) -> Result<()> {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (k, body) in self.log_items(dir, DIR_LOG_INDEX_KEY) {
            if body.len() < 8 {
                return Err(Error::corrupt(
                    item_loc(self.log, k),
                    format!("dir log item of {} bytes, needs 8", body.len()),
                ));
            }
            let end = le_u64(body, 0);
            if end < k.offset {
                return Err(Error::corrupt(
                    item_loc(self.log, k),
                    format!("dir log range ends at {end}, before its start"),
                ));
            }
            ranges.push((k.offset, end));
        }
        for (start, end) in ranges {
            let entries = self.subvol_items(
                w,
                Key::new(dir, DIR_INDEX_KEY, start),
                Key::new(dir, DIR_INDEX_KEY, end),
            )?;
            for (k, body) in entries {
                let di = DirItem::parse_all(&body)
                    .map_err(|e| {
                        Error::corrupt(
                            Location::what("dir index").with_tree(self.root).with_key(k),
                            e.to_string(),
                        )
                    })?
                    .into_iter()
                    .next();
                let Some(di) = di else { continue };
                let in_log = match self.log.items.get(&k) {
                    Some(lb) => DirItem::parse_all(lb)
                        .map(|v| v.iter().any(|d| d.name == di.name))
                        .unwrap_or(false),
                    None => false,
                };
                if in_log || di.location.ty != INODE_ITEM_KEY {
                    continue;
                }
                self.unlink(w, dir, &di.name, di.location.objectid)?;
            }
        }
        Ok(())
    }

    fn xattr_deletes(&mut self, w: &mut Writer, ino: u64) -> Result<()> {
        let items = self.subvol_items(
            w,
            Key::new(ino, XATTR_ITEM_KEY, 0),
            Key::new(ino, XATTR_ITEM_KEY, u64::MAX),
        )?;
        for (k, body) in items {
            if self.log.items.get(&k) == Some(&body) {
                continue;
            }
            // Replaced wholesale by the logged item (if any) in step 3.
            w.delete_item(self.root, &k)?;
        }
        Ok(())
    }

    fn replay_dir_index(&mut self, w: &mut Writer, k: &Key, body: &[u8]) -> Result<()> {
        let dir = k.objectid;
        let entries = DirItem::parse_all(body).map_err(|e| item_err(self.log, k, e))?;
        let Some(di) = entries.into_iter().next() else {
            return Ok(());
        };
        if di.location.ty != INODE_ITEM_KEY {
            return Ok(());
        }
        let target = di.location.objectid;
        if self.inode_exists(w, dir)?.is_none() || self.inode_exists(w, target)?.is_none() {
            return Ok(());
        }
        self.link(w, dir, &di.name, target, k.offset, di.file_type)
    }

    /// Makes `name` in `dir` point at `target` with `index`.
    fn link(
        &mut self,
        w: &mut Writer,
        dir: u64,
        name: &[u8],
        target: u64,
        index: u64,
        ft: u8,
    ) -> Result<()> {
        if let Some(e) = self.lookup(w, dir, name)? {
            if e.location.ty != INODE_ITEM_KEY {
                return Ok(());
            }
            if e.location.objectid == target {
                let cur = self
                    .names_in_subvol(w, target)?
                    .into_iter()
                    .find(|n| n.parent == dir && n.name == name);
                if cur.map(|n| n.index) == Some(index) {
                    return Ok(());
                }
            }
            self.unlink(w, dir, name, e.location.objectid)?;
        }
        // Another entry at the same index goes.
        let ik = Key::new(dir, DIR_INDEX_KEY, index);
        if let Some(b) = w.read_item(self.root, &ik)? {
            if let Some(d) = DirItem::parse_all(&b)
                .ok()
                .and_then(|v| v.into_iter().next())
            {
                if d.location.ty == INODE_ITEM_KEY {
                    self.unlink(w, dir, &d.name, d.location.objectid)?;
                }
            }
            w.delete_item(self.root, &ik)?;
        }
        let di = DirItem {
            location: Key::new(target, INODE_ITEM_KEY, 0),
            transid: w.transid,
            file_type: ft,
            name: name.to_vec(),
            data: Vec::new(),
        };
        let dk = Key::new(dir, DIR_ITEM_KEY, hash::name_hash(name));
        let mut body = w.read_item(self.root, &dk)?.unwrap_or_default();
        di.write(&mut body);
        w.replace_item(self.root, dk, &body)?;
        w.insert_item(self.root, ik, &di.to_bytes())?;
        // The target's back reference.
        let rk = Key::new(target, INODE_REF_KEY, dir);
        let max = crate::ctree::ops::max_item_size(self.fs.disk.nodesize() as usize);
        let r = InodeRef {
            index,
            name: name.to_vec(),
        };
        let existing = w.read_item(self.root, &rk)?;
        match existing {
            Some(b) if b.len() + r.encoded_len() > max => {
                let x = InodeExtref {
                    parent: dir,
                    index,
                    name: name.to_vec(),
                };
                let xk = Key::new(target, INODE_EXTREF_KEY, hash::extref_hash(dir, name));
                let mut body = w.read_item(self.root, &xk)?.unwrap_or_default();
                x.write(&mut body);
                w.replace_item(self.root, xk, &body)?;
            }
            b => {
                let mut body = b.unwrap_or_default();
                r.write(&mut body);
                w.replace_item(self.root, rk, &body)?;
            }
        }
        self.touched.insert(target);
        self.dirs.insert(dir);
        Ok(())
    }

    /// Removes `name` (pointing at `target`) from `dir`: dir item, dir index, back reference.
    fn unlink(&mut self, w: &mut Writer, dir: u64, name: &[u8], target: u64) -> Result<()> {
        let dk = Key::new(dir, DIR_ITEM_KEY, hash::name_hash(name));
        if let Some(body) = w.read_item(self.root, &dk)? {
            let all = DirItem::parse_all(&body).map_err(|e| {
                Error::corrupt(
                    Location::what("dir item").with_tree(self.root).with_key(dk),
                    e.to_string(),
                )
            })?;
            let rest: Vec<&DirItem> = all.iter().filter(|d| d.name != name).collect();
            if rest.is_empty() {
                w.delete_item(self.root, &dk)?;
            } else if rest.len() != all.len() {
                let mut nb = Vec::new();
                for d in rest {
                    d.write(&mut nb);
                }
                w.replace_item(self.root, dk, &nb)?;
            }
        }
        let mut index = None;
        let rk = Key::new(target, INODE_REF_KEY, dir);
        if let Some(body) = w.read_item(self.root, &rk)? {
            let refs = InodeRef::parse_all(&body).map_err(|e| {
                Error::corrupt(
                    Location::what("inode ref")
                        .with_tree(self.root)
                        .with_key(rk),
                    e.to_string(),
                )
            })?;
            if let Some(r) = refs.iter().find(|r| r.name == name) {
                index = Some(r.index);
                let mut nb = Vec::new();
                for r in refs.iter().filter(|r| r.name != name) {
                    r.write(&mut nb);
                }
                if nb.is_empty() {
                    w.delete_item(self.root, &rk)?;
                } else {
                    w.replace_item(self.root, rk, &nb)?;
                }
            }
        }
        if index.is_none() {
            let xk = Key::new(target, INODE_EXTREF_KEY, hash::extref_hash(dir, name));
            if let Some(body) = w.read_item(self.root, &xk)? {
                let refs = InodeExtref::parse_all(&body).map_err(|e| {
                    Error::corrupt(
                        Location::what("inode extref")
                            .with_tree(self.root)
                            .with_key(xk),
                        e.to_string(),
                    )
                })?;
                if let Some(r) = refs.iter().find(|r| r.name == name && r.parent == dir) {
                    index = Some(r.index);
                    let mut nb = Vec::new();
                    for r in refs.iter().filter(|r| !(r.name == name && r.parent == dir)) {
                        r.write(&mut nb);
                    }
                    if nb.is_empty() {
                        w.delete_item(self.root, &xk)?;
                    } else {
                        w.replace_item(self.root, xk, &nb)?;
                    }
                }
            }
        }
        match index {
            Some(i) => {
                w.delete_item(self.root, &Key::new(dir, DIR_INDEX_KEY, i))?;
            }
            None => {
                // No back reference: find the index entry by name.
                for (k, body) in self.subvol_items(
                    w,
                    Key::new(dir, DIR_INDEX_KEY, 0),
                    Key::new(dir, DIR_INDEX_KEY, u64::MAX),
                )? {
                    if let Ok(v) = DirItem::parse_all(&body) {
                        if v.iter()
                            .any(|d| d.name == name && d.location.objectid == target)
                        {
                            w.delete_item(self.root, &k)?;
                        }
                    }
                }
            }
        }
        self.touched.insert(target);
        self.unlinked.insert(target);
        self.dirs.insert(dir);
        Ok(())
    }

    /// Whether the log has the inode's full item (not just "it exists").
    fn fully_logged(&self, ino: u64) -> bool {
        self.log
            .items
            .get(&Key::new(ino, INODE_ITEM_KEY, 0))
            .is_some_and(|b| b.len() >= 8 && le_u64(b, 0) != 0)
    }

    /// A logged inode's names become exactly its logged names.
    fn replay_names(&mut self, w: &mut Writer, ino: u64) -> Result<()> {
        let mut logged = Vec::new();
        for (k, body) in self
            .log
            .items
            .range(Key::new(ino, INODE_REF_KEY, 0)..=Key::new(ino, INODE_EXTREF_KEY, u64::MAX))
        {
            self.parse_names(k, body, &mut logged)
                .map_err(|e| item_err(self.log, k, e))?;
        }
        if logged.is_empty() || ino == FIRST_FREE_OBJECTID {
            return Ok(());
        }
        let Some(item) = self.inode_exists(w, ino)? else {
            return Ok(());
        };
        // Names in the directories the log has names in, that the log does not have, are
        // gone; names in other directories stay (as after the kernel's replay).
        let parents: BTreeSet<u64> = logged.iter().map(|l| l.parent).collect();
        for n in self.names_in_subvol(w, ino)? {
            if parents.contains(&n.parent)
                && !logged
                    .iter()
                    .any(|l| l.parent == n.parent && l.name == n.name)
            {
                self.unlink(w, n.parent, &n.name, ino)?;
            }
        }
        let ft = mode_to_ft(item.mode);
        for n in logged {
            if self.inode_exists(w, n.parent)?.is_none() {
                continue;
            }
            self.link(w, n.parent, &n.name, ino, n.index, ft)?;
        }
        Ok(())
    }

    fn replay_extents(&mut self, w: &mut Writer, ino: u64) -> Result<()> {
        let items: Vec<(Key, Vec<u8>)> = self
            .log_items(ino, EXTENT_DATA_KEY)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        if items.is_empty() {
            return Ok(());
        }
        if self.inode_exists(w, ino)?.is_none() {
            return Ok(());
        }
        let ss = self.fs.disk.sectorsize() as u64;
        let no_holes = self.fs.disk.sb.has_incompat(INCOMPAT_NO_HOLES);
        let inode = self.ino(ino);
        for (k, body) in items {
            let fe = FileExtentItem::parse(&body).map_err(|e| item_err(self.log, &k, e))?;
            let off = k.offset;
            if off % ss != 0 {
                return Err(Error::corrupt(
                    item_loc(self.log, &k),
                    "file extent at an unaligned offset",
                ));
            }
            match fe.body {
                FileExtentBody::Inline(_) if off != 0 => {
                    return Err(Error::corrupt(
                        item_loc(self.log, &k),
                        "inline file extent not at offset 0",
                    ));
                }
                FileExtentBody::Inline(_) => {
                    let end = off
                        .checked_add(fe.ram_bytes.max(1))
                        .ok_or_else(|| Error::corrupt(item_loc(self.log, &k), "size overflow"))?
                        .div_ceil(ss)
                        * ss;
                    self.fs
                        .replace_extents(w, inode, off, end, Some((off, fe)))?;
                }
                FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                } => {
                    if num_bytes == 0 || num_bytes % ss != 0 {
                        return Err(Error::corrupt(
                            item_loc(self.log, &k),
                            format!("file extent of {num_bytes} bytes"),
                        ));
                    }
                    let end = off.checked_add(num_bytes).ok_or_else(|| {
                        Error::corrupt(item_loc(self.log, &k), "extent end overflows")
                    })?;
                    if disk_bytenr == 0 {
                        let new = if no_holes { None } else { Some((off, fe)) };
                        self.fs.replace_extents(w, inode, off, end, new)?;
                        continue;
                    }
                    if fe.compression == 0
                        && (offset
                            .checked_add(num_bytes)
                            .is_none_or(|e| e > disk_num_bytes))
                    {
                        return Err(Error::corrupt(
                            item_loc(self.log, &k),
                            "file extent reaches past its data extent",
                        ));
                    }
                    let prealloc = fe.ty == FILE_EXTENT_PREALLOC;
                    let compressed = fe.compression != 0;
                    self.fs
                        .replace_extents(w, inode, off, end, Some((off, fe)))?;
                    w.refs.add_data_ref(
                        disk_bytenr,
                        disk_num_bytes,
                        true,
                        RefKey::Data {
                            root: self.root,
                            ino,
                            offset: off.wrapping_sub(offset),
                        },
                        1,
                    );
                    if !prealloc {
                        let (cs, ce) = if compressed {
                            (disk_bytenr, disk_bytenr + disk_num_bytes)
                        } else {
                            (disk_bytenr + offset, disk_bytenr + offset + num_bytes)
                        };
                        self.replay_csums(w, cs, ce)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Checksums in `[start, end)` that the log has replace the checksum tree's.
    fn replay_csums(&mut self, w: &mut Writer, start: u64, end: u64) -> Result<()> {
        let ss = self.fs.disk.sectorsize() as u64;
        let cs = self.fs.disk.sb.csum_type.size() as u64;
        // Log checksum items overlapping the range replace what the checksum tree has there
        // (an extent committed before keeps its checksums: the log need not repeat them).
        let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
        let lo = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 0);
        let hi = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end);
        for (k, body) in self.log.items.range(lo..hi) {
            if !(body.len() as u64).is_multiple_of(cs) || k.offset % ss != 0 {
                return Err(Error::corrupt(
                    item_loc(self.log, k),
                    "checksum item of a bad size or offset",
                ));
            }
            let n = body.len() as u64 / cs;
            let iend = k.offset + n * ss;
            if iend <= start {
                continue;
            }
            let s = k.offset.max(start);
            let e = iend.min(end);
            let a = ((s - k.offset) / ss * cs) as usize;
            let b = ((e - k.offset) / ss * cs) as usize;
            if let Some(slice) = body.get(a..b) {
                runs.push((s, slice.to_vec()));
            }
        }
        for (s, sums) in runs {
            w.delete_csums(s, sums.len() as u64 / cs * ss)?;
            w.insert_csums(s, &sums)?;
        }
        Ok(())
    }

    fn replay_xattrs(&mut self, w: &mut Writer, ino: u64) -> Result<()> {
        let items: Vec<(Key, Vec<u8>)> = self
            .log_items(ino, XATTR_ITEM_KEY)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        if items.is_empty() || self.inode_exists(w, ino)?.is_none() {
            return Ok(());
        }
        for (k, body) in items {
            DirItem::parse_all(&body).map_err(|e| item_err(self.log, &k, e))?;
            w.replace_item(self.root, k, &body)?;
        }
        Ok(())
    }

    fn fixup(&mut self, w: &mut Writer) -> Result<()> {
        let mut rounds = 0;
        while let Some(ino) = self.touched.pop_first() {
            rounds += 1;
            if rounds > 1_000_000 {
                return Err(Error::Internal("log replay fix-ups do not converge".into()));
            }
            let Some(mut item) = self.inode_exists(w, ino)? else {
                continue;
            };
            if ino == FIRST_FREE_OBJECTID {
                // The subvolume's root directory: its only reference is "..".
                continue;
            }
            let is_dir = item.mode & 0o170000 == 0o040000;
            let names = self.names_in_subvol(w, ino)?;
            if names.is_empty() {
                if is_dir {
                    let entries = self.subvol_items(
                        w,
                        Key::new(ino, DIR_INDEX_KEY, 0),
                        Key::new(ino, DIR_INDEX_KEY, u64::MAX),
                    )?;
                    for (_, body) in entries {
                        if let Some(d) = DirItem::parse_all(&body)
                            .ok()
                            .and_then(|v| v.into_iter().next())
                        {
                            if d.location.ty == INODE_ITEM_KEY {
                                self.unlink(w, ino, &d.name, d.location.objectid)?;
                            }
                        }
                    }
                }
                self.dirs.remove(&ino);
                self.fs.delete_inode(w, self.ino(ino))?;
                continue;
            }
            let nlink = names.len() as u32;
            let mut nbytes = item.nbytes;
            if !is_dir {
                nbytes = 0;
                for (k, body) in self.subvol_items(
                    w,
                    Key::new(ino, EXTENT_DATA_KEY, 0),
                    Key::new(ino, EXTENT_DATA_KEY, u64::MAX),
                )? {
                    let fe = FileExtentItem::parse(&body).map_err(|e| {
                        Error::corrupt(
                            Location::what("file extent")
                                .with_tree(self.root)
                                .with_key(k),
                            e.to_string(),
                        )
                    })?;
                    nbytes += match fe.body {
                        FileExtentBody::Inline(_) => fe.ram_bytes,
                        FileExtentBody::Extent {
                            disk_bytenr,
                            num_bytes,
                            ..
                        } => {
                            if disk_bytenr == 0 {
                                0
                            } else {
                                num_bytes
                            }
                        }
                    };
                }
            }
            // An inode that lost a name and whose item the log does not carry changed now
            // (the kernel's replay stamps it so too).
            let restamp = self.unlinked.contains(&ino) && !self.fully_logged(ino);
            if item.nlink != nlink || item.nbytes != nbytes || restamp {
                item.nlink = nlink;
                item.nbytes = nbytes;
                if restamp {
                    item.ctime = crate::format::items::Timespec::now();
                    item.transid = w.transid;
                }
                w.replace_item(
                    self.root,
                    Key::new(ino, INODE_ITEM_KEY, 0),
                    &item.to_bytes(),
                )?;
            }
        }
        for dir in std::mem::take(&mut self.dirs) {
            let Some(mut item) = self.inode_exists(w, dir)? else {
                continue;
            };
            if item.mode & 0o170000 != 0o040000 {
                continue;
            }
            let mut size = 0u64;
            for (_, body) in self.subvol_items(
                w,
                Key::new(dir, DIR_INDEX_KEY, 0),
                Key::new(dir, DIR_INDEX_KEY, u64::MAX),
            )? {
                if let Ok(v) = DirItem::parse_all(&body) {
                    size += v.iter().map(|d| 2 * d.name.len() as u64).sum::<u64>();
                }
            }
            if item.size != size {
                item.size = size;
                w.replace_item(
                    self.root,
                    Key::new(dir, INODE_ITEM_KEY, 0),
                    &item.to_bytes(),
                )?;
            }
        }
        Ok(())
    }
}

fn mode_to_ft(mode: u32) -> u8 {
    match mode & 0o170000 {
        0o040000 => FT_DIR,
        0o120000 => FT_SYMLINK,
        0o020000 => FT_CHRDEV,
        0o060000 => FT_BLKDEV,
        0o010000 => FT_FIFO,
        0o140000 => FT_SOCK,
        _ => FT_REG_FILE,
    }
}
