//! Writing the fsync log (seed 003): fsync and fdatasync without a transaction commit.
//!
//! An fsync copies what the inode needs to survive a power cut into its subvolume's log tree,
//! kept in memory for the running transaction ([`crate::transaction::log_state::LogState`]):
//!
//! - its INODE_ITEM, INODE_REFs and XATTR_ITEMs, as they are now (replay makes the inode's
//!   names in the logged directories and its xattrs exactly these);
//! - the EXTENT_DATA items of the file ranges changed since the inode was last logged (the
//!   range-state tree of seed 000 tracks them per inode, [`ExtentBits::DIRTY`]), widened to
//!   whole items of both the tree and the log, with explicit holes where a NO_HOLES file has
//!   none (replay then drops what the committed tree has there); a ranged fsync logs the
//!   whole file's changed ranges;
//! - the data checksums of the logged extents, as EXTENT_CSUM items;
//! - for a directory: its DIR_INDEX entries under one DIR_LOG_INDEX range covering every
//!   index (replay drops the committed entries the log lacks), and the files new in the
//!   transaction that its entries name (so replay finds their inodes); new subdirectories
//!   are logged the same way, with their names, recursively (as the kernel does).
//!
//! A log commit ([`Core::sync_log`]) writes the leaves that changed since the last one (the log
//! tree's other leaves stay where they are), new upper nodes and a new log root tree, all in
//! blocks held out of the allocator until the transaction commits; flushes; points the primary
//! superblock's `log_root` at the log root tree; flushes again. The data was written by
//! `write` before, so the first flush makes it durable too. A transaction commit clears the
//! pointer and drops the in-memory log.
//!
//! Group commit: logging an inode (under the writer lock) and writing the log (under the log
//! lock, mostly without the writer lock) are separate steps. Fsyncs that logged while another
//! log commit was writing find their items written by the next one, or already by one that
//! started after they logged (`synced_seq`).
//!
//! A file renamed, linked or unlinked in the running transaction is logged with all its
//! names (INODE_REFs); the directories where it lost a name are logged whole with it (replay
//! keeps the names in directories the log does not cover), as the kernel logs a renamed
//! inode's old parent. So is a directory where it took a name another inode lost in the
//! transaction (a rename over a file, an exchange, a create or link after an unlink): replay
//! drops the last commit's entry for the name (not in the log) before it adds the new one,
//! where the kernel logs the other inode too. A directory fsync that meets such a file (an entry, or a removed entry
//! that lives on) logs it the same way.
//!
//! Fsyncs fall back to a full commit where a log cannot be right or is not written yet:
//! fsyncs of new or renamed directories, directories with subvolume entries or more than
//! [`MAX_DIR_PLAN`] inodes to log, directories with an entry that is a directory renamed in
//! the running transaction, inodes with extended refs or without links, inodes with a name that the log gives another inode, or the last
//! commit does in a directory not logged whole with them (replay would take it from that
//! inode: the kernel logs the other inode too, butter commits), inodes whose directory (or a
//! directory they lost a name in) or subvolume is new in the transaction, and when log blocks
//! cannot be allocated.
//!
//! Ordered extents (crate::inode::ordered): a write returns once its data and checksums are written
//! (or, for an append, once it joined the file's delayed-allocation buffer, which the fsync
//! writes back first); its extent may still wait, pending, for its completion (the tree
//! updates). An fsync logs
//! the file's pending extents from memory, each laid over the tree's items of its range as its
//! completion will lay it, with its checksums and the inode's size, nbytes and times as the
//! completion will leave them, and, by seed 003's rule, neither completes them nor waits for
//! the file's writes still in progress: its first flush is its only wait for data. A
//! transaction commit completes every pending extent first, so what the log had is in the
//! commit. Without the rule ([`Core::set_fsync_skips_writes_in_progress`], `-o fsync=log-wait`)
//! an fsync waits for the writes in progress and completes the pending extents, then logs from
//! the trees; so it does on a file system without NO_HOLES, where the log would need the hole
//! items the completion inserts.

use crate::ctree;
use crate::ctree::ops::NewHeader;
use crate::ctree::TreeIter;
use crate::error::{Error, Result};
use crate::extent_io::ExtentBits;
use crate::format::csum::CsumType;
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::io::disk_io::Readahead;
use crate::space::alloc::SpaceKind;
pub(crate) use crate::transaction::log_state::LogTicket;
use crate::transaction::log_state::LogTree;
use crate::transaction::Writer;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::Ordering;

/// Items with their keys, in key order.
type KeyedItems = Vec<(Key, Vec<u8>)>;

/// What logging one inode takes (read from the trees before the log changes).
struct InodePlan {
    ino: Inode,
    size: u64,
    /// Inode item, names, xattrs.
    own: Vec<(Key, Vec<u8>)>,
    /// Widened changed ranges and the tree's extent items in them.
    #[allow(clippy::type_complexity)]
    extents: Vec<((u64, u64), Vec<(Key, Vec<u8>)>)>,
    /// A directory's DIR_INDEX items.
    dir: Option<Vec<(Key, Vec<u8>)>>,
    /// The checksums of the pending ordered extents logged: (bytenr, length, checksums).
    pending_sums: Vec<(u64, u64, Vec<u8>)>,
}

/// What one fsync logs: the plans, the directories among them, and the files whose names
/// changed in the transaction that are logged with all their names and the directories they
/// lost names in.
#[derive(Default)]
struct Batch {
    plans: Vec<InodePlan>,
    dirs: HashSet<Inode>,
    adopted: BTreeSet<Inode>,
}

enum Plan {
    Log(InodePlan),
    Durable,
    Commit,
}

/// A log commit prepared under the writer lock: blocks to write, then the superblock.
struct LogPlan {
    blocks: Vec<(u64, Vec<u8>)>,
    /// Log blocks this commit replaces.
    replaced: Vec<u64>,
    root: u64,
    level: u8,
    seq: u64,
    transid: u64,
}

/// End of a file extent item's range.
fn extent_end(start: u64, data: &[u8], ss: u64) -> Result<u64> {
    let fe = FileExtentItem::parse(data)?;
    Ok(match fe.body {
        FileExtentBody::Inline(_) => start.saturating_add(fe.ram_bytes.div_ceil(ss) * ss),
        FileExtentBody::Extent { num_bytes, .. } => start.saturating_add(num_bytes),
    })
}

impl Writer {
    /// Builds the blocks of a log commit: changed leaves, upper nodes, the log root tree.
    fn log_prepare(&mut self) -> Result<Option<LogPlan>> {
        if !self.log.pending() {
            return Ok(None);
        }
        let ns = self.disk.nodesize() as usize;
        let ct = self.disk.sb.csum_type;
        let transid = self.transid;
        let mut tmpl = self.header_for(TREE_LOG_OBJECTID, 0);
        tmpl.flags = HEADER_FLAG_WRITTEN;
        let mut trees = std::mem::take(&mut self.log.trees);
        let mut root_tree = std::mem::take(&mut self.log.root_tree);
        let mut out = Vec::new();
        let mut new_blocks = Vec::new();
        let allocator = &self.allocator;
        let mut new_block = || -> Result<(u64, NewHeader)> {
            let b = allocator
                .alloc_held(SpaceKind::Metadata, ns as u64, ns as u64)
                .ok_or_else(|| Error::NoSpace("no metadata space for fsync log blocks".into()))?;
            new_blocks.push(b);
            let mut h = tmpl.clone();
            h.bytenr = b;
            Ok((b, h))
        };
        let r = write_log_trees(
            &mut trees,
            &mut root_tree,
            ns,
            ct,
            transid,
            &mut out,
            &mut new_block,
        );
        let mut replaced: Vec<u64> = trees.values_mut().flat_map(|t| t.stale.drain(..)).collect();
        replaced.append(&mut root_tree.stale);
        self.log.trees = trees;
        self.log.root_tree = root_tree;
        self.log.blocks.extend(new_blocks);
        if let Err(e) = r {
            self.log.broken = true;
            return Err(e);
        }
        let (root, level) = r?;
        self.log.inflight += 1;
        Ok(Some(LogPlan {
            blocks: out,
            replaced,
            root,
            level,
            seq: self.log.seq,
            transid,
        }))
    }
}

/// Writes every changed log tree, then the log root tree. Returns the log root tree's root.
fn write_log_trees(
    trees: &mut BTreeMap<u64, LogTree>,
    root_tree: &mut LogTree,
    ns: usize,
    ct: CsumType,
    transid: u64,
    out: &mut Vec<(u64, Vec<u8>)>,
    new_block: &mut dyn FnMut() -> Result<(u64, NewHeader)>,
) -> Result<(u64, u8)> {
    for (id, t) in trees.iter_mut() {
        let was = t.root;
        let root = t.write(ns, out, new_block, ct)?;
        let key = Key::new(TREE_LOG_OBJECTID, ROOT_ITEM_KEY, *id);
        match root {
            Some((bytenr, level)) if was != root => {
                root_tree.insert(key, log_root_item(bytenr, level, transid, ns));
            }
            Some(_) => {}
            None => root_tree.remove_range(key, key),
        }
    }
    root_tree
        .write(ns, out, new_block, ct)?
        .ok_or_else(|| Error::Internal("empty fsync log".into()))
}

impl Writer {
    /// Root of tree `id` as of the last commit (its blocks stay untouched until the running
    /// transaction commits); `None` for a tree created since.
    fn committed_root(&self, id: u64) -> Result<Option<crate::ctree::Root>> {
        let tree_root = crate::ctree::Root::of_root_tree(&self.sb);
        let key = Key::new(id, ROOT_ITEM_KEY, u64::MAX);
        match ctree::lookup_le(&self.disk, &tree_root, &key)? {
            Some(it) if it.key.objectid == id && it.key.ty == ROOT_ITEM_KEY => {
                let ri = RootItem::parse(it.data()).map_err(|e| it.annotate(e))?;
                Ok(Some(crate::ctree::Root {
                    id,
                    bytenr: ri.bytenr,
                    level: ri.level,
                    generation: ri.generation,
                }))
            }
            _ => Ok(None),
        }
    }
}

/// The ROOT_ITEM of a log tree in the log root tree.
fn log_root_item(bytenr: u64, level: u8, transid: u64, nodesize: usize) -> Vec<u8> {
    RootItem {
        inode: InodeItem {
            generation: 1,
            size: 3,
            nlink: 1,
            nbytes: nodesize as u64,
            mode: 0o40755,
            ..Default::default()
        },
        generation: transid,
        bytenr,
        level,
        generation_v2: transid,
        refs: 0,
        ..Default::default()
    }
    .to_bytes()
    .to_vec()
}

/// Most inodes one directory fsync logs (new subdirectories included) before it commits
/// instead.
pub(crate) const MAX_DIR_PLAN: usize = 4096;

fn key_range_of(ino: u64, ty: u8) -> (Key, Key) {
    (Key::new(ino, ty, 0), Key::new(ino, ty, u64::MAX))
}

impl Core {
    /// Whether fsync writes the log tree (default) or commits the transaction (`false`, for
    /// comparison and as a fallback switch).
    pub(crate) fn set_fsync_log(&self, on: bool) {
        self.fsync_log.store(on, Ordering::Relaxed);
    }

    /// The fsync rule that skips writes in progress, on by default: an fsync does not wait for
    /// the inode's writes in progress (their ordered extents); it logs what the writes that
    /// returned before it recorded. Off, an fsync first waits until no write to the inode is in
    /// progress, as the kernel's fsync waited for every ordered extent in its range before the
    /// rule (for benchmarks; the result is the same, only later).
    pub(crate) fn set_fsync_skips_writes_in_progress(&self, on: bool) {
        self.fsync_waits_for_writes.store(!on, Ordering::Relaxed);
    }

    /// Whether [`Core::log_inode`] completes pending ordered extents (changing the trees)
    /// rather than logging them as they are: without the fsync rule that skips writes in
    /// progress, and on a file system without NO_HOLES.
    pub(crate) fn fsync_completes_ordered(&self) -> bool {
        self.fsync_waits_for_writes.load(Ordering::Relaxed)
            || !self.disk.sb.has_incompat(INCOMPAT_NO_HOLES)
    }

    /// fsync(2) / fdatasync(2) of one inode: when it returns, the inode's data and metadata
    /// (and the names that make it reachable) survive a power cut.
    pub(crate) fn fsync(&self, ino: Inode, _datasync: bool) -> Result<()> {
        // A delayed preallocation goes into the trees first (the log copies trees).
        if self.prealloc.has(Some(ino)) {
            let mut w = self.writer_keeping_ordered()?;
            self.complete_preallocs(&mut w, Some(ino))?;
        }
        match self.log_inode(ino)? {
            LogTicket::Logged(seq) => self.sync_log(seq),
            LogTicket::Durable => Ok(()),
            LogTicket::Commit => self.commit(),
        }
    }

    /// First half of an fsync: copies `ino` into its subvolume's log tree in memory (under the
    /// writer lock; fast). Says what is left to do.
    pub(crate) fn log_inode(&self, ino: Inode) -> Result<LogTicket> {
        let waits = self.fsync_waits_for_writes.load(Ordering::Relaxed);
        if waits {
            self.ordered.wait_for_writes(ino);
        }
        // Pending ordered extents are logged as they are (the fsync rule that skips writes in
        // progress), not completed first; without the rule, or where the log would need the
        // hole items their completion inserts (a file system without NO_HOLES), they are
        // completed first.
        // Its buffered appends go to the device first, without the writer lock (other
        // fsyncs and changes go on meanwhile).
        self.flush_delalloc_unlocked(ino)?;
        let mut w = if self.fsync_completes_ordered() {
            // Ordered extents only: a delayed preallocation that appeared since the fsync
            // began is not its business, and is completed under the exclusive gate only.
            let mut w = self.writer_keeping_ordered()?;
            self.complete_ordered(&mut w)?;
            w
        } else {
            let mut w = self.writer_keeping_ordered()?;
            // Its appends not yet allocated: written back now, logged as pending extents;
            // a compressed file's, or where space needs a commit, the fsync commits instead
            // (which writes them back).
            if self.write_back_for_fsync(&mut w, ino)? {
                return Ok(LogTicket::Commit);
            }
            w
        };
        // Appends lost to a failed write-back since the last fsync: this fsync fails (once,
        // as a writeback error does on Linux).
        self.release_lost(&mut w);
        if let Some(why) = self.ordered.take_write_error(ino) {
            return Err(Error::WriteLost(why));
        }
        let t = self.log_inode_locked(&mut w, ino)?;
        log::debug!(
            "fsync {}/{}: {t:?} (transid {}, synced {})",
            ino.root,
            ino.ino,
            w.transid,
            w.log.synced_seq
        );
        match t {
            LogTicket::Commit => w.log.stats.fallbacks += 1,
            LogTicket::Logged(_) => w.log.stats.logged += 1,
            LogTicket::Durable => w.log.stats.already_durable += 1,
        }
        Ok(t)
    }

    fn log_inode_locked(&self, w: &mut Writer, ino: Inode) -> Result<LogTicket> {
        if !self.fsync_log.load(Ordering::Relaxed) || w.log.broken {
            return Ok(LogTicket::Commit);
        }
        if w.log.new_trees.contains(&ino.root) {
            return Ok(LogTicket::Commit);
        }
        let item = self.inode_item_raw(ino)?;
        let mut b = Batch::default();
        if item.mode & 0o170000 == 0o040000 {
            if item.generation >= w.transid || !self.plan_dir_into(w, ino, &item, None, &mut b)? {
                return Ok(LogTicket::Commit);
            }
        } else {
            match self.plan_inode(w, ino, &item, None)? {
                Plan::Commit => return Ok(LogTicket::Commit),
                Plan::Durable => return Ok(LogTicket::Durable),
                Plan::Log(p) => {
                    b.adopted.insert(ino);
                    b.plans.push(p);
                    if !self.plan_lost_names(w, ino, &mut b)? {
                        return Ok(LogTicket::Commit);
                    }
                }
            }
        }
        for p in b.plans {
            self.apply_plan(w, p)?;
        }
        for t in b.adopted {
            // Its names in the log are current, with the directories it lost names in: those
            // removals no longer keep the directories from being logged.
            if let Some(dirs) = w.log.names_changed.remove(&t) {
                for d in dirs {
                    if let Some(r) = w.log.removed.get_mut(&d) {
                        r.retain(|x| *x != t);
                    }
                }
            }
        }
        w.log.seq += 1;
        Ok(LogTicket::Logged(w.log.seq))
    }

    /// A file that lost names in the transaction (renamed or unlinked while it keeps another
    /// name), planned in `b` with all its names: the directories it lost them in are logged
    /// whole too, so replay drops the old names there (it keeps names in directories the log
    /// does not cover), as the kernel logs a renamed inode's old parent. False: commit
    /// instead (such a directory is new, gone, or cannot be logged).
    fn plan_lost_names(&self, w: &Writer, ino: Inode, b: &mut Batch) -> Result<bool> {
        let Some(dirs) = w.log.names_changed.get(&ino) else {
            return Ok(true);
        };
        for dir in dirs {
            if b.dirs.contains(dir) {
                continue;
            }
            let item = match self.inode_item_raw(*dir) {
                Ok(i) => i,
                Err(Error::NotFound(_)) => return Ok(false),
                Err(e) => return Err(e),
            };
            if item.generation >= w.transid || !self.plan_dir_into(w, *dir, &item, None, b)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A file whose names changed in the transaction, met while logging a directory: it is
    /// logged with all its names and the directories it lost names in ([`Core::plan_lost_names`]).
    fn adopt(&self, w: &Writer, t: Inode, b: &mut Batch) -> Result<bool> {
        if !b.adopted.insert(t) {
            return Ok(true);
        }
        let item = match self.inode_item_raw(t) {
            Ok(i) => i,
            Err(Error::NotFound(_)) => return Ok(false),
            Err(e) => return Err(e),
        };
        match self.plan_inode(w, t, &item, None)? {
            Plan::Log(p) => b.plans.push(p),
            Plan::Durable => {}
            Plan::Commit => return Ok(false),
        }
        self.plan_lost_names(w, t, b)
    }

    /// What logging a file (or symlink) takes, read from the trees; nothing changes yet.
    /// `planned_parent`: a directory logged with it.
    fn plan_inode(
        &self,
        w: &Writer,
        ino: Inode,
        item: &InodeItem,
        planned_parent: Option<Inode>,
    ) -> Result<Plan> {
        let fmt = item.mode & 0o170000;
        if fmt == 0o040000 || item.nlink == 0 || w.log.needs_commit.contains(&ino) {
            return Ok(Plan::Commit);
        }
        if planned_parent.is_some() && w.log.names_changed.contains_key(&ino) {
            // Logged for its directory: its other directories are not in this log.
            return Ok(Plan::Commit);
        }
        if fmt == 0o100000 && self.ordered.has_delalloc(ino) {
            // Appends still in memory (a file logged with its directory, whose own fsync
            // would have written them back first): not in the trees, not pending, so the log
            // would lack them; the commit writes them back.
            return Ok(Plan::Commit);
        }
        let mut changed: Vec<(u64, u64)> = w
            .log
            .changed
            .get(&ino)
            .map(|t| {
                t.iter()
                    .filter(|r| r.bits.contains(ExtentBits::DIRTY))
                    .map(|r| (r.start, r.end.saturating_add(1).max(r.end)))
                    .collect()
            })
            .unwrap_or_default();
        if item.generation >= w.transid && !w.log.logged.contains(&ino) {
            // New in this transaction: everything it has (symlink targets are written
            // directly, not through the file write path).
            changed = vec![(0, u64::MAX)];
        }
        // Writes that returned but whose extents are not in the trees yet (crate::inode::ordered):
        // logged from memory, with the ranges their completion will mark changed.
        let pending = if fmt == 0o100000 {
            self.ordered.pending_of(ino)
        } else {
            Vec::new()
        };
        let mut size = item.size;
        for p in &pending {
            changed.push((p.file_off, p.file_off + p.len));
            if p.reach > size {
                changed.push((size, p.reach));
                size = p.reach;
            }
        }
        if item.transid < w.transid && changed.is_empty() {
            // Untouched since the last commit.
            return Ok(Plan::Durable);
        }
        let Some(mut own) = self.own_items(w, ino, true, planned_parent)? else {
            return Ok(Plan::Commit);
        };
        let ss = self.disk.sectorsize() as u64;
        let mut extents = Vec::new();
        let mut logged_item = item.clone();
        if fmt == 0o100000 || fmt == 0o120000 {
            let log = w.log.trees.get(&ino.root);
            let mut groups = Vec::new();
            for (s, e) in merge_ranges(changed) {
                match self.extents_to_log(log, ino, s, e, ss)? {
                    Some(g) => groups.push(g),
                    None => return Ok(Plan::Commit),
                }
            }
            // Widening can make two ranges meet: one group each time a range is logged.
            for _ in 0..8 {
                groups.sort_by_key(|g| g.0);
                if groups.windows(2).all(|p| p[0].1 <= p[1].0) {
                    break;
                }
                let mut merged = Vec::new();
                for (lo, hi) in merge_ranges(groups.iter().map(|g| (g.0, g.1)).collect()) {
                    match self.extents_to_log(log, ino, lo, hi, ss)? {
                        Some(g) => merged.push(g),
                        None => return Ok(Plan::Commit),
                    }
                }
                groups = merged;
            }
            if !groups.windows(2).all(|p| p[0].1 <= p[1].0) {
                return Ok(Plan::Commit);
            }
            let (mut removed, mut added) = (0u64, 0u64);
            for (lo, hi, mut items) in groups {
                for p in pending
                    .iter()
                    .filter(|p| p.file_off < hi && p.file_off + p.len > lo)
                {
                    let Some((r, a)) = overlay_pending(&mut items, ino.ino, p, w.transid, ss)?
                    else {
                        return Ok(Plan::Commit);
                    };
                    removed += r;
                    added += a;
                }
                extents.push(((lo, hi), items));
            }
            if let Some(last) = pending.last() {
                // The inode as the completion of its pending extents will leave it.
                logged_item.size = size;
                logged_item.nbytes = logged_item.nbytes.saturating_sub(removed) + added;
                Self::touch_at(w, &mut logged_item, true, last.stamp);
                for (k, v) in own.iter_mut() {
                    if k.ty == INODE_ITEM_KEY {
                        *v = logged_item.to_bytes().to_vec();
                    }
                }
            }
        }
        Ok(Plan::Log(InodePlan {
            ino,
            size: logged_item.size,
            own,
            extents,
            dir: None,
            pending_sums: pending
                .into_iter()
                .map(|p| (p.bytenr, p.len, p.sums))
                .collect(),
        }))
    }

    /// The inode item, names (with `names`) and xattrs of `ino`; `None` when one of its names
    /// cannot be logged (see the module documentation). `planned_parent`: a directory logged
    /// with `ino` (so it may be new in the transaction).
    fn own_items(
        &self,
        w: &Writer,
        ino: Inode,
        names: bool,
        planned_parent: Option<Inode>,
    ) -> Result<Option<KeyedItems>> {
        let root = self.subvol_root(ino.root)?;
        let mut own: Vec<(Key, Vec<u8>)> = Vec::new();
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(ino.ino, INODE_ITEM_KEY, 0),
            Readahead::None,
        )?;
        while let Some(i) = it.next_item()? {
            if i.key.objectid != ino.ino || i.key.ty > XATTR_ITEM_KEY {
                break;
            }
            match i.key.ty {
                INODE_ITEM_KEY | XATTR_ITEM_KEY => {}
                INODE_REF_KEY if names => {
                    let dir = Inode {
                        root: ino.root,
                        ino: i.key.offset,
                    };
                    if Some(dir) != planned_parent
                        && self.inode_item_raw(dir)?.generation >= w.transid
                    {
                        return Ok(None);
                    }
                    let refs = InodeRef::parse_all(i.data()).map_err(|e| i.annotate(e))?;
                    // A directory the file lost a name in, or took another's removed name in
                    // (LogState::note_new_name), is logged whole with it (Core::plan_lost_names): replay drops the entries the log
                    // lacks there first, so a name the last commit gives another inode is
                    // free by the time the file's is added.
                    let logged_whole = planned_parent.is_none()
                        && w.log
                            .names_changed
                            .get(&ino)
                            .is_some_and(|d| d.contains(&dir));
                    for r in refs {
                        if self.name_taken(w, dir, &r.name, ino, logged_whole)? {
                            return Ok(None);
                        }
                    }
                }
                INODE_EXTREF_KEY if names => return Ok(None),
                _ => continue,
            }
            own.push((i.key, i.data().to_vec()));
        }
        if names && !own.iter().any(|(k, _)| k.ty == INODE_REF_KEY) {
            return Ok(None);
        }
        Ok(Some(own))
    }

    /// Logging a directory: its inode and xattrs, all its DIR_INDEX entries with one
    /// DIR_LOG_INDEX range over every index (replay then drops the committed entries the
    /// log lacks), and every file that is new in the transaction; a subdirectory new in the
    /// transaction is logged the same way with its name, recursively, as the kernel does.
    /// False: commit instead (a renamed directory, or one new in the transaction that is not
    /// logged with its parent, an entry that is a subvolume or a directory whose names
    /// changed, a removed entry whose inode is gone but was logged before, more than
    /// [`MAX_DIR_PLAN`] inodes).
    ///
    /// `parent`: for a new subdirectory, its parent, logged with it. The plans go to `b`; a
    /// file met here whose names changed in the transaction (a removed entry that lives on, or
    /// an entry) is adopted ([`Core::adopt`]).
    fn plan_dir_into(
        &self,
        w: &Writer,
        dir: Inode,
        item: &InodeItem,
        parent: Option<Inode>,
        b: &mut Batch,
    ) -> Result<bool> {
        if w.log.needs_commit.contains(&dir) || b.plans.len() >= MAX_DIR_PLAN {
            return Ok(false);
        }
        if !b.dirs.insert(dir) {
            return Ok(true);
        }
        let mut adopt = Vec::new();
        if let Some(removed) = w.log.removed.get(&dir) {
            for t in removed.iter().filter(|t| !b.adopted.contains(*t)) {
                match self.inode_item_raw(*t) {
                    // Lives on under another name: logged with all its names.
                    Ok(it) if it.nlink > 0 => {
                        if !w.log.names_changed.contains_key(t) {
                            return Ok(false);
                        }
                        adopt.push(*t);
                    }
                    // Gone: its earlier log items would still give it the removed name
                    // (replay would bring the name back after dropping it).
                    Ok(_) | Err(Error::NotFound(_)) => {
                        if w.log.logged.contains(t) {
                            return Ok(false);
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        // A new subdirectory's name is logged with it (its parent's entries give it too).
        let Some(own) = self.own_items(w, dir, parent.is_some(), parent)? else {
            return Ok(false);
        };
        let root = self.subvol_root(dir.root)?;
        let mut entries = Vec::new();
        let mut it = TreeIter::range(
            self.disk.clone(),
            root,
            Key::new(dir.ino, DIR_INDEX_KEY, 0),
            Key::new(dir.ino, DIR_INDEX_KEY, u64::MAX),
            Readahead::None,
        )?;
        while let Some(i) = it.next_item()? {
            let di = DirItem::parse_all(i.data()).map_err(|e| i.annotate(e))?;
            for d in &di {
                if d.location.ty != INODE_ITEM_KEY {
                    return Ok(false);
                }
                let child = Inode {
                    root: dir.root,
                    ino: d.location.objectid,
                };
                if b.adopted.contains(&child) {
                    continue;
                }
                if w.log.needs_commit.contains(&child) {
                    return Ok(false);
                }
                if w.log.names_changed.contains_key(&child) {
                    adopt.push(child);
                    continue;
                }
                let ci = self.inode_item_raw(child)?;
                if ci.generation >= w.transid {
                    if ci.mode & 0o170000 == 0o040000 {
                        if !self.plan_dir_into(w, child, &ci, Some(dir), b)? {
                            return Ok(false);
                        }
                        continue;
                    }
                    match self.plan_inode(w, child, &ci, Some(dir))? {
                        Plan::Log(p) => b.plans.push(p),
                        Plan::Durable => {}
                        Plan::Commit => return Ok(false),
                    }
                }
            }
            entries.push((i.key, i.data().to_vec()));
        }
        b.plans.push(InodePlan {
            ino: dir,
            size: item.size,
            own,
            extents: Vec::new(),
            dir: Some(entries),
            pending_sums: Vec::new(),
        });
        for t in adopt {
            if !self.adopt(w, t, b)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Puts a planned inode into the in-memory log.
    fn apply_plan(&self, w: &mut Writer, p: InodePlan) -> Result<()> {
        let ino = p.ino;
        let ss = self.disk.sectorsize() as u64;
        let no_holes = self.disk.sb.has_incompat(INCOMPAT_NO_HOLES);
        let transid = w.transid;
        for (k, v) in &p.own {
            if k.ty == INODE_REF_KEY {
                for r in InodeRef::parse_all(v)? {
                    w.log
                        .logged_names
                        .insert((ino.root, k.offset, r.name), ino.ino);
                }
            }
        }
        let log = w.log.trees.entry(ino.root).or_default();
        log.remove_range(
            Key::new(ino.ino, 0, 0),
            Key::new(ino.ino, XATTR_ITEM_KEY, u64::MAX),
        );
        for (k, v) in p.own {
            log.insert(k, v);
        }
        if let Some(entries) = p.dir {
            log.remove_range(
                Key::new(ino.ino, DIR_LOG_INDEX_KEY, 0),
                Key::new(ino.ino, DIR_LOG_INDEX_KEY, u64::MAX),
            );
            log.remove_range(
                Key::new(ino.ino, DIR_INDEX_KEY, 0),
                Key::new(ino.ino, DIR_INDEX_KEY, u64::MAX),
            );
            log.insert(
                Key::new(ino.ino, DIR_LOG_INDEX_KEY, 0),
                u64::MAX.to_le_bytes().to_vec(),
            );
            for (k, v) in entries {
                log.insert(k, v);
            }
        }
        let mut csum_ranges: Vec<(u64, u64)> = Vec::new();
        let eof = p.size.div_ceil(ss) * ss;
        for ((lo, hi), items) in p.extents {
            if hi > lo {
                log.remove_range(
                    Key::new(ino.ino, EXTENT_DATA_KEY, lo),
                    Key::new(ino.ino, EXTENT_DATA_KEY, hi - 1),
                );
            }
            let mut cursor = lo;
            let hole_end = hi.min(eof);
            for (k, v) in items {
                let fe = FileExtentItem::parse(&v)?;
                if no_holes && k.offset > cursor && cursor < hole_end {
                    let to = k.offset.min(hole_end);
                    log.insert(
                        Key::new(ino.ino, EXTENT_DATA_KEY, cursor),
                        hole_item(transid, to - cursor),
                    );
                }
                cursor = cursor.max(extent_end(k.offset, &v, ss)?);
                if let FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                } = fe.body
                {
                    if disk_bytenr != 0 && fe.ty == FILE_EXTENT_REG {
                        if fe.compression != 0 {
                            csum_ranges.push((disk_bytenr, disk_num_bytes));
                        } else {
                            csum_ranges.push((disk_bytenr.saturating_add(offset), num_bytes));
                        }
                    }
                }
                log.insert(k, v);
            }
            if no_holes && cursor < hole_end {
                log.insert(
                    Key::new(ino.ino, EXTENT_DATA_KEY, cursor),
                    hole_item(transid, hole_end - cursor),
                );
            }
        }
        let csize = self.disk.sb.csum_type.size();
        for (start, len) in csum_ranges {
            if let Some((b, _, sums)) = p
                .pending_sums
                .iter()
                .find(|(b, l, _)| *b <= start && start + len <= b + l)
            {
                // A pending ordered extent: its checksums are not in the tree yet.
                let from = ((start - b) / ss) as usize * csize;
                let to = from + (len / ss) as usize * csize;
                if let Some(bytes) = sums.get(from..to) {
                    let log = w.log.trees.entry(ino.root).or_default();
                    log_csums(log, start, bytes, ss, csize, self.disk.nodesize() as usize);
                    continue;
                }
            }
            let sums = self.data_csums(start, len)?;
            let log = w.log.trees.entry(ino.root).or_default();
            let mut run_start = 0usize;
            while run_start < sums.len() {
                if sums[run_start].is_none() {
                    run_start += 1;
                    continue;
                }
                let mut run_end = run_start;
                let mut bytes = Vec::new();
                while run_end < sums.len() {
                    let Some(c) = &sums[run_end] else { break };
                    bytes.extend_from_slice(&c[..csize]);
                    run_end += 1;
                }
                log_csums(
                    log,
                    start + run_start as u64 * ss,
                    &bytes,
                    ss,
                    csize,
                    self.disk.nodesize() as usize,
                );
                run_start = run_end;
            }
        }
        if let Some(t) = w.log.changed.get_mut(&ino) {
            t.clear();
        }
        w.log.stats.ordered_logged += p.pending_sums.len() as u64;
        w.log.logged.insert(ino);
        Ok(())
    }

    /// Whether `dir/name` names another inode than `ino` in the log, or in the last commit
    /// unless `dir_logged_whole` (`dir` goes into the log with `ino`, all its entries under a
    /// DIR_LOG_INDEX range). A name the log already gives `ino` is its own: it went in with
    /// its directory logged whole, or the last commit gives it `ino` too.
    fn name_taken(
        &self,
        w: &Writer,
        dir: Inode,
        name: &[u8],
        ino: Inode,
        dir_logged_whole: bool,
    ) -> Result<bool> {
        match w.log.logged_names.get(&(dir.root, dir.ino, name.to_vec())) {
            Some(other) => return Ok(*other != ino.ino),
            None if dir_logged_whole => return Ok(false),
            None => {}
        }
        let Some(root) = w.committed_root(dir.root)? else {
            return Ok(false);
        };
        let key = Key::new(dir.ino, DIR_ITEM_KEY, crate::format::hash::name_hash(name));
        let Some(it) = ctree::lookup(&self.disk, &root, &key)? else {
            return Ok(false);
        };
        let entries = DirItem::parse_all(it.data()).map_err(|e| it.annotate(e))?;
        Ok(entries
            .iter()
            .any(|e| e.name == name && e.location.objectid != ino.ino))
    }

    /// The extent items of `ino` to log for the changed range `[s, e)`: the range widened to
    /// whole items (of the tree and of what the log already has), and the tree's items in it.
    #[allow(clippy::type_complexity)]
    fn extents_to_log(
        &self,
        log: Option<&LogTree>,
        ino: Inode,
        s: u64,
        e: u64,
        ss: u64,
    ) -> Result<Option<(u64, u64, Vec<(Key, Vec<u8>)>)>> {
        let root = self.subvol_root(ino.root)?;
        let tree_cover = |p: u64| -> Result<Option<(u64, u64)>> {
            match ctree::lookup_le(&self.disk, &root, &Key::new(ino.ino, EXTENT_DATA_KEY, p))? {
                Some(i) if i.key.objectid == ino.ino && i.key.ty == EXTENT_DATA_KEY => {
                    let end = extent_end(i.key.offset, i.data(), ss).map_err(|e| i.annotate(e))?;
                    Ok((end > p).then_some((i.key.offset, end)))
                }
                _ => Ok(None),
            }
        };
        let log_cover = |p: u64| -> Result<Option<(u64, u64)>> {
            let Some(log) = log else { return Ok(None) };
            let (from, _) = key_range_of(ino.ino, EXTENT_DATA_KEY);
            match log
                .items
                .range(from..=Key::new(ino.ino, EXTENT_DATA_KEY, p))
                .next_back()
            {
                Some((k, v)) => {
                    let end = extent_end(k.offset, v, ss)?;
                    Ok((end > p).then_some((k.offset, end)))
                }
                None => Ok(None),
            }
        };
        // Changed ranges are in bytes (a truncate to an odd size); items and holes are in
        // whole sectors.
        let s = s / ss * ss;
        let e = e.saturating_add(ss - 1) / ss * ss;
        let (mut lo, mut hi) = (s, e.max(s + ss));
        let mut converged = false;
        for _ in 0..64 {
            let mut nlo = lo;
            let mut nhi = hi;
            for c in [tree_cover(lo)?, log_cover(lo)?].into_iter().flatten() {
                nlo = nlo.min(c.0);
            }
            for c in [tree_cover(hi - 1)?, log_cover(hi - 1)?]
                .into_iter()
                .flatten()
            {
                nhi = nhi.max(c.1);
            }
            if (nlo, nhi) == (lo, hi) {
                converged = true;
                break;
            }
            (lo, hi) = (nlo, nhi);
        }
        if !converged {
            // Items that keep overlapping further out (a damaged tree): let a commit do it.
            return Ok(None);
        }
        let mut items = Vec::new();
        let mut it = self.extent_items_from(ino, lo)?;
        while let Some(i) = it.next_item()? {
            if i.key.objectid != ino.ino || i.key.ty != EXTENT_DATA_KEY || i.key.offset >= hi {
                break;
            }
            if i.key.offset < lo {
                continue;
            }
            items.push((i.key, i.data().to_vec()));
        }
        Ok(Some((lo, hi, items)))
    }

    /// Second half of an fsync: makes the log durable up to sequence `seq`, sharing the log
    /// commit with every fsync that logged before it started.
    pub(crate) fn sync_log(&self, seq: u64) -> Result<()> {
        let _l = self.log_sync.lock().unwrap_or_else(|e| e.into_inner());
        let plan = {
            let mut w = self.writer_keeping_ordered()?;
            if w.log.synced_seq >= seq {
                w.log.stats.already_durable += 1;
                return Ok(());
            }
            if w.log.broken {
                // A chunk was added since the inode was logged (or a log write failed): the
                // log cannot be written now; a commit makes it all durable.
                w.log.stats.fallbacks += 1;
                self.complete_ordered(&mut w)?;
                return w.commit();
            }
            match w.log_prepare() {
                Ok(Some(p)) => p,
                Ok(None) => return Ok(()),
                Err(Error::NoSpace(_)) => {
                    w.log.stats.fallbacks += 1;
                    self.complete_ordered(&mut w)?;
                    return w.commit();
                }
                Err(e) => return Err(e),
            }
        };
        let io = (|| -> Result<()> {
            for (b, data) in &plan.blocks {
                self.disk.write_logical(*b, data)?;
            }
            self.disk
                .flush_all()
                .map_err(|e| Error::io("flushing fsync log blocks", 0, e))
        })();
        let mut w = self.writer_keeping_ordered()?;
        w.log.inflight -= 1;
        if w.transid != plan.transid {
            // A commit ran meanwhile and made everything up to it durable.
            return Ok(());
        }
        if let Err(e) = io {
            w.log.broken = true;
            return Err(e);
        }
        if let Err(e) = w.write_log_super(plan.root, plan.level) {
            w.log.broken = true;
            return Err(e);
        }
        drop(w);
        let flushed = self
            .disk
            .flush_all()
            .map_err(|e| Error::io("flushing the superblock of an fsync log", 0, e));
        let mut w = self.writer_keeping_ordered()?;
        if w.transid != plan.transid {
            return flushed;
        }
        if let Err(e) = flushed {
            w.log.broken = true;
            return Err(e);
        }
        w.log.synced_seq = w.log.synced_seq.max(plan.seq);
        log::debug!(
            "log commit: seq {} durable (transid {}, root {} level {}, {} blocks)",
            plan.seq,
            plan.transid,
            plan.root,
            plan.level,
            plan.blocks.len()
        );
        // The superblock names the new log: the blocks it replaced are free.
        let ns = self.disk.nodesize() as u64;
        for b in plan.replaced {
            if w.log.blocks.remove(&b) {
                w.allocator.release_held(b, ns);
            }
        }
        w.log.stats.log_commits += 1;
        Ok(())
    }

    /// Log counters (fsyncs logged, fallbacks, log commits), for the unit tests.
    #[cfg(test)]
    pub(crate) fn log_stats(&self) -> Result<crate::transaction::log_state::LogStats> {
        Ok(self.writer_keeping_ordered()?.log.stats.clone())
    }
}

/// Lays pending ordered extent `p` of inode `ino` over the extent items of a logged range, as
/// its completion will lay it over the tree: the items under it are cut, and its own item goes
/// in. Returns the inode's nbytes (removed, added); `None` when an inline extent is under it
/// (the log then commits instead).
fn overlay_pending(
    items: &mut Vec<(Key, Vec<u8>)>,
    ino: u64,
    p: &crate::inode::ordered::Pending,
    transid: u64,
    ss: u64,
) -> Result<Option<(u64, u64)>> {
    use crate::inode::file::{cut, nbytes_of, Cut};
    let (start, end) = (p.file_off, p.file_off + p.len);
    let mut out = Vec::with_capacity(items.len() + 2);
    let mut removed = 0u64;
    for (k, v) in items.drain(..) {
        let ke = extent_end(k.offset, &v, ss)?;
        if ke <= start || k.offset >= end {
            out.push((k, v));
            continue;
        }
        let fe = FileExtentItem::parse(&v)?;
        if matches!(fe.body, FileExtentBody::Inline(_)) {
            return Ok(None);
        }
        let key_at = |off| Key::new(ino, EXTENT_DATA_KEY, off);
        let kept = match cut(k.offset, &fe, ke, start, end) {
            Cut::Delete => vec![],
            Cut::KeepHead(h) => vec![(k, h)],
            Cut::KeepTail(nk, t) => vec![(key_at(nk), t)],
            Cut::Split(h, nk, t) => vec![(k, h), (key_at(nk), t)],
        };
        removed += nbytes_of(&fe).saturating_sub(kept.iter().map(|(_, x)| nbytes_of(x)).sum());
        out.extend(kept.into_iter().map(|(k, x)| (k, x.to_bytes())));
    }
    out.push((
        Key::new(ino, EXTENT_DATA_KEY, start),
        FileExtentItem::regular(transid, p.bytenr, p.len).to_bytes(),
    ));
    out.sort_by_key(|a| a.0);
    *items = out;
    Ok(Some((removed, p.len)))
}

/// A hole of `len` bytes (an explicit one: replay drops the committed extents under it).
fn hole_item(transid: u64, len: u64) -> Vec<u8> {
    FileExtentItem::hole(transid, len).to_bytes()
}

/// Sorted, merged half-open ranges.
fn merge_ranges(mut r: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in r {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Adds the checksums of `[start, start + sums/csize sectors)` to a log tree's EXTENT_CSUM
/// items, merging with the items it overlaps (data checksums of an address do not change
/// within a transaction: freed space is not reused before the commit).
fn log_csums(log: &mut LogTree, start: u64, sums: &[u8], ss: u64, csize: usize, nodesize: usize) {
    let n = (sums.len() / csize) as u64;
    let end = start + n * ss;
    let lo_key = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 0);
    let mut overlapping: Vec<(Key, Vec<u8>)> = Vec::new();
    for (k, v) in log
        .items
        .range(lo_key..Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end))
        .rev()
    {
        let kend = k.offset + (v.len() / csize) as u64 * ss;
        if kend < start {
            break;
        }
        overlapping.push((*k, v.clone()));
    }
    let mstart = overlapping
        .iter()
        .map(|(k, _)| k.offset)
        .min()
        .unwrap_or(start)
        .min(start);
    let mend = overlapping
        .iter()
        .map(|(k, v)| k.offset + (v.len() / csize) as u64 * ss)
        .max()
        .unwrap_or(end)
        .max(end);
    let mut merged = vec![0u8; ((mend - mstart) / ss) as usize * csize];
    for (k, v) in &overlapping {
        let at = ((k.offset - mstart) / ss) as usize * csize;
        merged[at..at + v.len()].copy_from_slice(v);
        log.remove_range(*k, *k);
    }
    let at = ((start - mstart) / ss) as usize * csize;
    merged[at..at + sums.len()].copy_from_slice(sums);
    // Items of at most a quarter leaf, so leaves pack well.
    let per_item = ((nodesize - HEADER_SIZE) / 4 / csize).max(1);
    for (i, chunk) in merged.chunks(per_item * csize).enumerate() {
        log.insert(
            Key::new(
                EXTENT_CSUM_OBJECTID,
                EXTENT_CSUM_KEY,
                mstart + (i * per_item) as u64 * ss,
            ),
            chunk.to_vec(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::Fs;
    use crate::inode::namespace::Owner;
    use crate::internals::RamDevice;
    use std::sync::Arc;

    fn fresh() -> (Arc<RamDevice>, Fs) {
        crate::mkfs::test_fs(128 << 20)
    }

    /// The image a power cut now leaves (only flushed writes), opened (and replayed).
    fn after_cut(dev: &RamDevice) -> Fs {
        let copy = Arc::new(RamDevice::new(dev.durable_bytes()));
        // Replays and commits; checked as opened again.
        drop(Fs::open_device_rw(copy.clone()).unwrap());
        let fs = Fs::open_device_rw(copy).unwrap();
        assert_eq!(fs.disk().sb.log_root, 0);
        let r = fs.check(Default::default(), &mut |_| {}).unwrap();
        assert!(r.is_clean(), "{r:?}");
        fs
    }

    /// The inode of `dir/name`, which must exist.
    fn child(fs: &Fs, dir: Inode, name: &[u8]) -> Inode {
        fs.lookup(dir, name).unwrap().unwrap().target
    }

    /// A committed directory `d` with files `a`, `b` and `c` (each holding its name).
    fn dir_of_abc(fs: &Fs) -> Inode {
        let d = fs
            .mkdir(fs.root_inode(), b"d", 0o755, Owner::default())
            .unwrap();
        for n in [&b"a"[..], b"b", b"c"] {
            let f = fs.create(d, n, 0o644, Owner::default()).unwrap();
            fs.write(f, 0, n).unwrap();
        }
        fs.commit().unwrap();
        d
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn fsync_writes_a_log_not_a_commit() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        fs.write(a, 0, &pattern(100_000, 1)).unwrap();
        fs.commit().unwrap();
        let commits = fs.core().writer().unwrap().stats.commits;
        // New file, append, overwrite in the middle, xattr.
        let b = fs.create(root, b"b", 0o600, Owner::default()).unwrap();
        fs.write(b, 0, &pattern(50_000, 2)).unwrap();
        fs.fsync(b, false).unwrap();
        fs.write(a, 100_000, &pattern(30_000, 3)).unwrap();
        fs.write(a, 8192, &pattern(5000, 4)).unwrap();
        fs.setxattr(a, b"user.k", b"v", 0).unwrap();
        fs.fsync(a, false).unwrap();
        // Not fsynced: must not matter either way.
        let _c = fs.create(root, b"c", 0o644, Owner::default()).unwrap();
        assert_eq!(fs.core().writer().unwrap().stats.commits, commits);
        let st = fs.core().log_stats().unwrap();
        assert_eq!(
            (st.logged, st.fallbacks, st.log_commits),
            (2, 0, 2),
            "{st:?}"
        );
        let want_a = fs.read(a, 0, 200_000).unwrap();
        let want_b = fs.read(b, 0, 100_000).unwrap();
        let after = after_cut(&dev);
        let r = after.root_inode();
        let a2 = child(&after, r, b"a");
        let b2 = child(&after, r, b"b");
        assert_eq!(after.read(a2, 0, 200_000).unwrap(), want_a);
        assert_eq!(after.read(b2, 0, 100_000).unwrap(), want_b);
        assert_eq!(after.stat(b2).unwrap().mode & 0o7777, 0o600);
        assert_eq!(
            after.getxattr(a2, b"user.k").unwrap().as_deref(),
            Some(&b"v"[..])
        );
    }

    #[test]
    fn truncate_and_punch_are_logged() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        fs.write(a, 0, &pattern(1 << 20, 1)).unwrap();
        fs.commit().unwrap();
        fs.fallocate(a, FALLOC_PUNCH | FALLOC_KEEP, 100_000, 200_000)
            .unwrap();
        fs.truncate(a, 700_000).unwrap();
        fs.fsync(a, true).unwrap();
        let want = fs.read(a, 0, 1 << 20).unwrap();
        assert_eq!(want.len(), 700_000);
        let after = after_cut(&dev);
        let a2 = child(&after, after.root_inode(), b"a");
        assert_eq!(after.read(a2, 0, 1 << 20).unwrap(), want);
    }

    /// A file renamed out of a directory is logged with that directory, so replay drops its
    /// old name there; a renamed directory still commits.
    #[test]
    fn a_renamed_file_is_logged_with_the_directory_it_left() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let d = dir_of_abc(&fs);
        let a = child(&fs, d, b"a");
        let x = fs.mkdir(root, b"x", 0o755, Owner::default()).unwrap();
        fs.commit().unwrap();
        fs.rename(d, b"a", root, b"moved", 0).unwrap();
        fs.fsync(a, false).unwrap();
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (1, 0));
        let after = after_cut(&dev);
        let r = after.root_inode();
        let moved = child(&after, r, b"moved");
        assert_eq!(after.inode_item(moved).unwrap().nlink, 1);
        assert_eq!(after.read(moved, 0, 10).unwrap(), b"a");
        let d2 = child(&after, r, b"d");
        assert!(after.lookup(d2, b"a").unwrap().is_none());
        assert!(after.lookup(d2, b"b").unwrap().is_some());
        drop(after);
        fs.rename(root, b"x", root, b"y", 0).unwrap();
        fs.fsync(x, false).unwrap();
        assert_eq!(fs.core().log_stats().unwrap().fallbacks, 1);
    }

    /// A file renamed over another is logged with both directories whole: replay drops the
    /// replaced file's entry and the file with it. A replaced file the log already names
    /// still makes the fsync commit (its logged name would come back).
    #[test]
    fn a_file_renamed_over_another_is_logged() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let d = dir_of_abc(&fs);
        let (a, b) = (child(&fs, d, b"a"), child(&fs, d, b"b"));
        fs.write(a, 0, &pattern(20_000, 9)).unwrap();
        fs.rename(d, b"a", root, b"b", 0).unwrap();
        fs.rename(root, b"b", d, b"b", 0).unwrap();
        fs.fsync(a, false).unwrap();
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (1, 0), "{st:?}");
        let after = after_cut(&dev);
        let d2 = child(&after, after.root_inode(), b"d");
        let b2 = child(&after, d2, b"b");
        assert_eq!(b2.ino, a.ino);
        assert_eq!(after.read(b2, 0, 30_000).unwrap(), pattern(20_000, 9));
        assert_eq!(after.inode_item(b2).unwrap().nlink, 1);
        assert!(after.lookup(d2, b"a").unwrap().is_none());
        assert!(after.lookup(after.root_inode(), b"b").unwrap().is_none());
        assert!(matches!(after.inode_item(b), Err(Error::NotFound(_))));
        drop(after);
        // The log names c: a file renamed over it commits.
        let c = child(&fs, d, b"c");
        fs.setxattr(c, b"user.k", b"v", 0).unwrap();
        fs.fsync(c, false).unwrap();
        fs.rename(d, b"b", d, b"c", 0).unwrap();
        fs.fsync(a, false).unwrap();
        assert_eq!(fs.core().log_stats().unwrap().fallbacks, 1);
        let after = after_cut(&dev);
        let d2 = child(&after, after.root_inode(), b"d");
        assert_eq!(child(&after, d2, b"c").ino, a.ino);
        assert!(after.lookup(d2, b"b").unwrap().is_none());
    }

    #[test]
    fn fsyncs_that_logged_meanwhile_share_one_log_commit() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let mut inos = Vec::new();
        for i in 0..3u8 {
            let f = fs
                .create(root, &[b'f', b'0' + i], 0o644, Owner::default())
                .unwrap();
            inos.push(f);
        }
        fs.commit().unwrap();
        // Three fsyncs log before the first one's log commit starts (as concurrent callers
        // do while another log commit writes): one log commit carries them all.
        let mut seqs = Vec::new();
        for (i, f) in inos.iter().enumerate() {
            fs.write(*f, 0, &pattern(10_000, i as u8)).unwrap();
            match fs.core().log_inode(*f).unwrap() {
                LogTicket::Logged(s) => seqs.push(s),
                t => panic!("{t:?}"),
            }
        }
        for s in seqs.iter().rev() {
            fs.core().sync_log(*s).unwrap();
        }
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.log_commits), (3, 1), "{st:?}");
        let after = after_cut(&dev);
        for i in 0..3u8 {
            let f = child(&after, after.root_inode(), &[b'f', b'0' + i]);
            assert_eq!(after.read(f, 0, 20_000).unwrap(), pattern(10_000, i));
        }
    }

    #[test]
    fn a_big_log_spans_many_leaves_and_replays() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let d = fs.mkdir(root, b"d", 0o755, Owner::default()).unwrap();
        fs.commit().unwrap();
        let mut want = Vec::new();
        for i in 0..400u32 {
            let name = format!("file-{i:05}");
            let f = fs
                .create(d, name.as_bytes(), 0o644, Owner::default())
                .unwrap();
            let data = pattern(50 + (i as usize * 97) % 6000, i as u8);
            fs.write(f, 0, &data).unwrap();
            fs.setxattr(f, b"user.i", name.as_bytes(), 0).unwrap();
            fs.fsync(f, false).unwrap();
            want.push((name, data));
        }
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (400, 0), "{st:?}");
        let after = after_cut(&dev);
        let d2 = child(&after, after.root_inode(), b"d");
        for (name, data) in want {
            let f = child(&after, d2, name.as_bytes());
            assert_eq!(after.read(f, 0, 10_000).unwrap(), data, "{name}");
            assert_eq!(
                after.getxattr(f, b"user.i").unwrap().as_deref(),
                Some(name.as_bytes())
            );
        }
    }

    /// A directory fsync logs new subdirectories with their entries, recursively (the kernel
    /// does the same), instead of committing.
    #[test]
    fn directory_fsync_logs_new_subdirectories() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let d = fs.mkdir(root, b"d", 0o755, Owner::default()).unwrap();
        fs.commit().unwrap();
        let sub = fs.mkdir(d, b"sub", 0o750, Owner::default()).unwrap();
        let z = fs.create(sub, b"z", 0o644, Owner::default()).unwrap();
        fs.write(z, 0, &pattern(20_000, 9)).unwrap();
        let deeper = fs.mkdir(sub, b"deeper", 0o700, Owner::default()).unwrap();
        let w = fs.create(deeper, b"w", 0o600, Owner::default()).unwrap();
        fs.write(w, 0, b"inline").unwrap();
        fs.mkdir(deeper, b"empty", 0o755, Owner::default()).unwrap();
        fs.symlink(sub, b"ln", b"z", Owner::default()).unwrap();
        fs.fsync(d, false).unwrap();
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (1, 0), "{st:?}");
        let after = after_cut(&dev);
        let d2 = child(&after, after.root_inode(), b"d");
        let sub2 = child(&after, d2, b"sub");
        assert_eq!(after.inode_item(sub2).unwrap().mode & 0o7777, 0o750);
        let z2 = child(&after, sub2, b"z");
        assert_eq!(after.read(z2, 0, 30_000).unwrap(), pattern(20_000, 9));
        let deeper2 = child(&after, sub2, b"deeper");
        let w2 = child(&after, deeper2, b"w");
        assert_eq!(after.read(w2, 0, 100).unwrap(), b"inline");
        let e2 = child(&after, deeper2, b"empty");
        assert_eq!(after.inode_item(e2).unwrap().nlink, 1);
        let ln = child(&after, sub2, b"ln");
        assert_eq!(after.readlink(ln).unwrap(), b"z");
    }

    /// The directory's highest index and the highest inode are unlinked, then a file created
    /// and fsynced: the new file gets a fresh index and inode number (the crash image still
    /// gives the old ones to the unlinked file, whose unlink is not durable), and the log
    /// replays beside it.
    #[test]
    fn a_new_entry_never_takes_an_unlinked_entrys_index() {
        let (dev, fs) = fresh();
        let d = dir_of_abc(&fs);
        // A new mount: nothing cached about the directory's indexes or the inode numbers.
        let c_ino = fs.lookup(d, b"c").unwrap().unwrap().target;
        drop(fs);
        let fs = Fs::open_device_rw(dev.clone()).unwrap();
        let index_of = |name: &[u8]| {
            let all = fs.readdir(d, 0, 0).unwrap();
            all.iter().find(|e| e.name == name).unwrap().index
        };
        let c_index = index_of(b"c");
        fs.unlink(d, b"c").unwrap();
        let n = fs.create(d, b"n", 0o644, Owner::default()).unwrap();
        fs.write(n, 0, &pattern(5000, 3)).unwrap();
        assert!(index_of(b"n") > c_index);
        assert!(n.ino > c_ino.ino, "inode number {} handed out again", n.ino);
        fs.fsync(n, false).unwrap();
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (1, 0), "{st:?}");
        let after = after_cut(&dev);
        let d2 = child(&after, after.root_inode(), b"d");
        assert_eq!(after.read(child(&after, d2, b"c"), 0, 10).unwrap(), b"c");
        assert_eq!(
            after.read(child(&after, d2, b"n"), 0, 10_000).unwrap(),
            pattern(5000, 3)
        );
    }

    #[test]
    fn directory_fsync_logs_created_and_deleted_entries() {
        let (dev, fs) = fresh();
        let d = dir_of_abc(&fs);
        fs.unlink(d, b"b").unwrap();
        let e = fs.create(d, b"e", 0o640, Owner::default()).unwrap();
        fs.write(e, 0, &pattern(9000, 5)).unwrap();
        fs.symlink(d, b"s", b"target", Owner::default()).unwrap();
        fs.fsync(d, false).unwrap();
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (1, 0), "{st:?}");
        let after = after_cut(&dev);
        let d2 = child(&after, after.root_inode(), b"d");
        let names: Vec<Vec<u8>> = after
            .readdir(d2, 0, 100)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(
            names,
            vec![b"a".to_vec(), b"c".to_vec(), b"e".to_vec(), b"s".to_vec()]
        );
        let e2 = child(&after, d2, b"e");
        assert_eq!(after.read(e2, 0, 10_000).unwrap(), pattern(9000, 5));
        let s2 = child(&after, d2, b"s");
        assert_eq!(after.readlink(s2).unwrap(), b"target");
    }

    /// A directory fsync after a file moved out of it logs the file with its new name; one
    /// after a directory moved out commits.
    #[test]
    fn directory_fsync_after_a_rename_logs_the_moved_file() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let d = fs.mkdir(root, b"d", 0o755, Owner::default()).unwrap();
        fs.create(d, b"a", 0o644, Owner::default()).unwrap();
        fs.mkdir(d, b"sub", 0o755, Owner::default()).unwrap();
        fs.commit().unwrap();
        fs.rename(d, b"a", root, b"moved", 0).unwrap();
        fs.fsync(d, false).unwrap();
        let st = fs.core().log_stats().unwrap();
        assert_eq!((st.logged, st.fallbacks), (1, 0));
        let after = after_cut(&dev);
        let r = after.root_inode();
        assert!(after.lookup(r, b"moved").unwrap().is_some());
        let d2 = child(&after, r, b"d");
        assert!(after.lookup(d2, b"a").unwrap().is_none());
        drop(after);
        fs.rename(d, b"sub", root, b"sub2", 0).unwrap();
        fs.fsync(d, false).unwrap();
        assert_eq!(fs.core().log_stats().unwrap().fallbacks, 1);
    }

    #[test]
    fn a_file_shrunk_then_grown_reads_zeros_after_replay() {
        // The last commit has data past the later EOF; the log must say it is gone even
        // after the file grew again (found by fsync_crash).
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        fs.write(a, 0, &pattern(9000, 9)).unwrap();
        fs.commit().unwrap();
        fs.truncate(a, 4289).unwrap();
        fs.fsync(a, false).unwrap();
        fs.truncate(a, 183_336).unwrap();
        fs.fsync(a, false).unwrap();
        let want = fs.read(a, 0, 200_000).unwrap();
        assert_eq!(want.len(), 183_336);
        let after = after_cut(&dev);
        let a2 = child(&after, after.root_inode(), b"a");
        assert_eq!(after.read(a2, 0, 200_000).unwrap(), want);
    }

    const FALLOC_KEEP: u32 = 1;
    const FALLOC_PUNCH: u32 = 2;

    /// Overwrites under fsync never commit by themselves, so the extents they replace stay
    /// pinned: ten times the free space goes through one file here, and data allocation must
    /// commit to get the pinned space back rather than fail with ENOSPC.
    #[test]
    fn overwrites_under_fsync_get_pinned_space_back() {
        let (dev, fs) = fresh();
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        let free = fs.statfs().unwrap().free;
        let chunks_before = fs.disk().chunk_map().chunks().count() as u64;
        let chunk = 4 << 20;
        let size = (free / 3) & !(chunk as u64 - 1);
        let mut written = 0u64;
        let mut round = 0u8;
        while written < 10 * free {
            round = round.wrapping_add(1);
            let mut off = 0;
            while off < size {
                fs.write(a, off, &pattern(chunk, round))
                    .unwrap_or_else(|e| {
                        panic!("write at {off} after {written} bytes (free {free}): {e}")
                    });
                fs.fsync(a, true).unwrap();
                off += chunk as u64;
                written += chunk as u64;
            }
        }
        // Only an fsync right after a new chunk commits (the log could not name it).
        let added = fs.disk().chunk_map().chunks().count() as u64 - chunks_before;
        let fallbacks = fs.core().log_stats().unwrap().fallbacks;
        assert!(
            fallbacks <= added,
            "{fallbacks} fsyncs committed, {added} chunks were added"
        );
        let after = after_cut(&dev);
        let a2 = child(&after, after.root_inode(), b"a");
        assert_eq!(
            after.read(a2, size - 100, 100).unwrap(),
            pattern(chunk, round)[chunk - 100..]
        );
    }
}
