//! Transactions: the write engine's state and the commit.
//!
//! One [`Writer`] per read-write filesystem. It holds the running transaction: the blocks it
//! changed (in the [`Disk`] overlay), queued reference changes, the allocator and the roots of
//! the trees it touched. Operations change trees in memory; [`Writer::commit`] makes them
//! durable:
//!
//! 1. RUNNING -> COMMIT_START: no new work joins.
//! 2. COMMIT_DOING: apply delayed references, rewrite dirty block group items and their free
//!    space tree entries, update the root items; repeat until a pass changes nothing (each pass
//!    can COW more extent / free space / root tree blocks).
//! 3. Write every changed block (checksummed) to every copy, flush the device, then write the
//!    superblock (with the next backup root slot) to every mirror that fits, and flush again.
//! 4. UNBLOCKED -> COMPLETED: space freed in the transaction becomes allocatable; the next
//!    transaction id starts.
//!
//! A failed write or flush aborts: the writer refuses further changes ([`Error::Aborted`]) and
//! the image keeps its last committed state, which nothing in the transaction overwrote
//! (allocation never hands out space the committed trees use, nor space freed since).

use crate::cow_ctx::{is_fs_tree, CowCtx};
use crate::ctree::TreeIter;
use crate::delayed_refs::DelayedRefs;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::superblock::DevItem;
use crate::format::*;
use crate::io::disk_io::{Disk, Readahead};
use crate::space::alloc::{self, Allocator, BlockGroup, RangeSet, SpaceKind};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub use crate::cow_ctx::{LiveRoots, TreeState};

/// Transaction states, as the kernel names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransState {
    Running,
    CommitStart,
    CommitDoing,
    Unblocked,
    Completed,
}

/// Counters for tests and benchmarks.
#[derive(Debug, Default, Clone)]
pub struct WriteStats {
    pub commits: u64,
    pub blocks_written: u64,
}

/// The running transaction and the commit. What copy-on-write edits need (disk, transid,
/// tree states, delayed references, allocator, live roots) is its [`CowCtx`], which it lends
/// to the B-tree code (crate::cow) and the reference runner (crate::extent_tree); `Writer`
/// dereferences to it, so `w.insert_item(..)` and `w.transid` read as before.
pub struct Writer {
    ctx: CowCtx,
    pub state: TransState,
    /// The superblock as last written (raw), patched at each commit.
    pub(crate) sb_raw: Vec<u8>,
    dev_item: DevItem,
    sys_chunk_array: Vec<u8>,
    sys_array_dirty: bool,
    /// Of the descents (`CowCtx::descents`), those of file extent replacement (for the
    /// benchmark of one-descent extent replace).
    pub replace_descents: u64,
    pub stats: WriteStats,
    /// Next free inode number per subvolume.
    pub(crate) next_ino: HashMap<u64, u64>,
    /// Next DIR_INDEX sequence per (subvolume, directory).
    pub(crate) next_index: HashMap<(u64, u64), u64>,
    /// One-descent extent replace: file extents are replaced in the leaf of one descent when
    /// possible.
    pub combined_replace: bool,
    /// The fsync log of the running transaction (crate::tree_log::write).
    pub(crate) log: crate::log_state::LogState,
    /// Ordered extents written but not yet in the trees (crate::inode::ordered). A commit must not
    /// run while there are any: their data would be in no tree and, if an fsync logged them,
    /// the commit would drop the log that has them.
    pub(crate) ordered_pending: usize,
    /// The qgroup status is INCONSISTENT on disk, or there are no quotas (checked once).
    qgroups_marked: bool,
}

impl std::ops::Deref for Writer {
    type Target = CowCtx;
    fn deref(&self) -> &CowCtx {
        &self.ctx
    }
}

impl std::ops::DerefMut for Writer {
    fn deref_mut(&mut self) -> &mut CowCtx {
        &mut self.ctx
    }
}

impl Writer {
    /// Starts the write engine on an opened filesystem: loads block groups and their free
    /// space from the extent tree.
    pub fn open(disk: Arc<Disk>, live: LiveRoots) -> Result<Writer> {
        if disk.sb.log_root != 0 {
            return Err(Error::Unsupported(
                "the image has an unreplayed fsync log: open it with Fs::open_rw (or mount it \
                 read-write once), which replays the log first"
                    .into(),
            ));
        }
        Self::open_with_log(disk, live)
    }

    /// [`Writer::open`] for log replay (crate::tree_log::replay): accepts an image whose superblock
    /// names an fsync log; the caller replays it before anything else allocates.
    pub(crate) fn open_with_log(disk: Arc<Disk>, live: LiveRoots) -> Result<Writer> {
        let sb = disk.sb.clone();
        // Every feature bit is either kept correct by this engine or refused here, by name,
        // before anything (a log replay included) is written.
        if let Some(why) = crate::format::features::refuse_write(&sb) {
            return Err(Error::Unsupported(why));
        }
        let mut raw = vec![0u8; SUPER_INFO_SIZE];
        disk.dev
            .read_at(&mut raw, sb.bytenr)
            .map_err(|e| Error::io("reading superblock", sb.bytenr, e))?;
        let root_block = disk.read_tree_block(
            sb.root,
            &crate::io::disk_io::Expect {
                level: Some(sb.root_level),
                generation: Some(sb.generation),
                ..Default::default()
            },
        )?;
        let mut w = Writer {
            ctx: CowCtx {
                transid: sb.generation + 1,
                trees: BTreeMap::new(),
                refs: DelayedRefs::default(),
                allocator: Allocator::new(),
                chunk_tree_uuid: root_block.header.chunk_tree_uuid,
                sb_bytes_used: sb.bytes_used,
                live,
                descents: 0,
                aborted: None,
                disk,
            },
            state: TransState::Running,
            sb_raw: raw,
            dev_item: sb.dev_item.clone(),
            sys_chunk_array: sb.sys_chunk_array.clone(),
            sys_array_dirty: false,
            replace_descents: 0,
            stats: WriteStats::default(),
            next_ino: HashMap::new(),
            next_index: HashMap::new(),
            combined_replace: true,
            log: Default::default(),
            ordered_pending: 0,
            qgroups_marked: false,
        };
        w.trees.insert(
            ROOT_TREE_OBJECTID,
            TreeState {
                id: ROOT_TREE_OBJECTID,
                bytenr: sb.root,
                level: sb.root_level,
                generation: sb.generation,
                shareable: false,
                last_snapshot: 0,
                item_key: None,
                dirty: false,
            },
        );
        w.trees.insert(
            CHUNK_TREE_OBJECTID,
            TreeState {
                id: CHUNK_TREE_OBJECTID,
                bytenr: sb.chunk_root,
                level: sb.chunk_root_level,
                generation: sb.chunk_root_generation,
                shareable: false,
                last_snapshot: 0,
                item_key: None,
                dirty: false,
            },
        );
        w.load_block_groups()?;
        Ok(w)
    }

    /// Registers a tree created in the running transaction; the caller inserts its ROOT_ITEM
    /// under `item_key` (commit keeps the item's root pointer current).
    pub(crate) fn add_new_tree(
        &mut self,
        id: u64,
        bytenr: u64,
        level: u8,
        item_key: Key,
        last_snapshot: u64,
    ) {
        let transid = self.transid;
        self.log.note_new_tree(id);
        self.trees.insert(
            id,
            TreeState {
                id,
                bytenr,
                level,
                generation: transid,
                shareable: is_fs_tree(id),
                last_snapshot,
                item_key: Some(item_key),
                dirty: true,
            },
        );
        self.publish_root(id, bytenr, level);
    }

    /// Records that a snapshot of tree `id` was taken in the running transaction: blocks it
    /// has now may be shared.
    pub(crate) fn note_snapshot(&mut self, id: u64) -> Result<()> {
        let transid = self.transid;
        self.tree_state(id)?;
        if let Some(t) = self.trees.get_mut(&id) {
            t.last_snapshot = transid;
        }
        Ok(())
    }

    /// Whether the running transaction changed anything.
    pub fn has_changes(&self) -> bool {
        !self.refs.is_empty() || !self.disk.overlay_addresses().is_empty()
    }

    // -----------------------------------------------------------------------------------------
    // Block groups and allocation
    // -----------------------------------------------------------------------------------------

    fn load_block_groups(&mut self) -> Result<()> {
        let ns = self.disk.nodesize() as u64;
        let extent_root = self.current_root(EXTENT_TREE_OBJECTID)?;
        let mut groups: Vec<BlockGroup> = Vec::new();
        let mut it = TreeIter::new(self.disk.clone(), extent_root, Key::MIN, Readahead::Forward)?;
        let mut used_ranges: Vec<(u64, u64)> = Vec::new();
        let mut group_item = |item: &crate::ctree::ItemRef| -> Result<()> {
            let bgi = BlockGroupItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            let mut bg = BlockGroup::new(item.key.objectid, item.key.offset, bgi.flags);
            bg.used = bgi.used;
            groups.push(bg);
            Ok(())
        };
        let bg_tree = self.block_group_tree();
        while let Some(item) = it.next_item()? {
            match item.key.ty {
                BLOCK_GROUP_ITEM_KEY if bg_tree == EXTENT_TREE_OBJECTID => group_item(&item)?,
                EXTENT_ITEM_KEY => used_ranges.push((item.key.objectid, item.key.offset)),
                METADATA_ITEM_KEY => used_ranges.push((item.key.objectid, ns)),
                _ => {}
            }
        }
        if bg_tree != EXTENT_TREE_OBJECTID {
            // block-group-tree: the items live in a tree of their own (tree 11).
            let root = self.current_root(bg_tree)?;
            let mut it = TreeIter::new(self.disk.clone(), root, Key::MIN, Readahead::Forward)?;
            while let Some(item) = it.next_item()? {
                if item.key.ty == BLOCK_GROUP_ITEM_KEY {
                    group_item(&item)?;
                }
            }
        }
        let chunks: Vec<(u64, ChunkItem)> = self
            .disk
            .chunk_map()
            .chunks()
            .map(|c| (c.logical, c.item.clone()))
            .collect();
        for mut bg in groups {
            for (s, l) in &used_ranges {
                if *s + *l > bg.start && *s < bg.end() {
                    bg.free.remove(*s, *l);
                }
            }
            if let Some((_, ci)) = chunks.iter().find(|(l, _)| *l == bg.start) {
                exclude_supers(&mut bg, ci);
            }
            self.allocator.add_group(bg)?;
        }
        // Which groups the free space tree describes with bitmaps.
        if self.disk.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE) {
            let root = self.current_root(FREE_SPACE_TREE_OBJECTID)?;
            let mut it = TreeIter::new(self.disk.clone(), root, Key::MIN, Readahead::Forward)?;
            while let Some(item) = it.next_item()? {
                if item.key.ty == FREE_SPACE_INFO_KEY {
                    let fsi = FreeSpaceInfo::parse(item.data()).map_err(|e| item.annotate(e))?;
                    let start = item.key.objectid;
                    self.allocator.with_group(start, |g| {
                        g.fst_bitmaps = fsi.flags & 1 != 0;
                    });
                }
            }
        }
        Ok(())
    }

    /// The tree that holds the block group items: the extent tree, or with the
    /// block-group-tree feature (compat_ro bit 3) a tree of their own.
    pub(crate) fn block_group_tree(&self) -> u64 {
        if self.disk.sb.has_compat_ro(COMPAT_RO_BLOCK_GROUP_TREE) {
            BLOCK_GROUP_TREE_OBJECTID
        } else {
            EXTENT_TREE_OBJECTID
        }
    }

    /// Allocates `len` bytes of data space (sector aligned), adding a data chunk if needed.
    pub fn alloc_data(&mut self, len: u64) -> Result<u64> {
        self.check_writable()?;
        let ss = self.disk.sectorsize() as u64;
        if let Some(b) = self.allocator.alloc(SpaceKind::Data, len, ss) {
            return Ok(b);
        }
        if self.alloc_chunk(SpaceKind::Data, len).is_ok() {
            if let Some(b) = self.allocator.alloc(SpaceKind::Data, len, ss) {
                return Ok(b);
            }
        }
        Err(Error::NoSpace(format!(
            "no free data space for {len} bytes"
        )))
    }

    /// [`Writer::alloc_data`] at the start of an operation (before it changed a tree): when
    /// the device is full, commits first, since extents this transaction dropped are freed
    /// (and become allocatable) only by a commit.
    pub(crate) fn alloc_data_or_commit(&mut self, len: u64) -> Result<u64> {
        match self.alloc_data(len) {
            Err(Error::NoSpace(_)) if self.has_changes() => {
                self.commit()?;
                self.alloc_data(len)
            }
            r => r,
        }
    }

    /// [`Writer::alloc_data_or_commit`], the range held (see [`crate::space::alloc::BlockGroup::held`])
    /// for an ordered extent: its data is written without the writer lock, and until its file
    /// extent item goes in, a commit leaves the range free on disk.
    pub(crate) fn alloc_data_held_or_commit(&mut self, len: u64) -> Result<u64> {
        let at = self.alloc_data_or_commit(len)?;
        self.allocator.hold(at, len)?;
        Ok(at)
    }

    /// Before an operation: make sure metadata and system space will not run out in the middle
    /// of it (adding chunks here, where no tree is being changed). Errors with ENOSPC when the
    /// device is full and `for_growth`.
    pub fn reserve_metadata(&mut self, for_growth: bool) -> Result<()> {
        self.check_writable()?;
        let ns = self.disk.nodesize() as u64;
        let want = (ns * 256).max(4 << 20);
        for (kind, want) in [(SpaceKind::System, ns * 16), (SpaceKind::Metadata, want)] {
            if self.allocator.free_bytes(kind) >= want {
                continue;
            }
            if self.alloc_chunk(kind, 0).is_ok() {
                continue;
            }
            let floor = if for_growth { want / 2 } else { ns * 32 };
            if self.allocator.free_bytes(kind) < floor && self.has_changes() {
                // The blocks this transaction COWed away are freed only when it commits (and
                // then pinned until the commit ends): commit to get them back before refusing.
                // Safe here: the operation has not changed any tree yet.
                self.commit()?;
            }
            if self.allocator.free_bytes(kind) < floor {
                return Err(Error::NoSpace(format!(
                    "{:?} space is nearly full ({} bytes free) and the device has no room for \
                     another chunk",
                    kind,
                    self.allocator.free_bytes(kind)
                )));
            }
        }
        Ok(())
    }

    /// Free bytes the device has outside any chunk, largest hole first: (physical, len).
    fn device_holes(&mut self) -> Result<Vec<(u64, u64)>> {
        let devid = self.disk.devid;
        let total = self.dev_item.total_bytes.min(self.disk.dev.len());
        let mut used = RangeSet::new();
        let _ = used.add(0, 1 << 20); // the first MiB is never allocated
        let root = self.current_root(DEV_TREE_OBJECTID)?;
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(devid, DEV_EXTENT_KEY, 0),
            Readahead::None,
        )?;
        while let Some(item) = it.next_item()? {
            if item.key.objectid != devid || item.key.ty != DEV_EXTENT_KEY {
                break;
            }
            let de = DevExtent::parse(item.data()).map_err(|e| item.annotate(e))?;
            used.remove(item.key.offset, de.length);
            let _ = used.add(item.key.offset, de.length);
        }
        let mut holes = Vec::new();
        let mut pos = 0u64;
        for (s, l) in used.iter() {
            if s > pos {
                holes.push((pos, s - pos));
            }
            pos = pos.max(s + l);
        }
        if total > pos {
            holes.push((pos, total - pos));
        }
        holes.sort_by_key(|(s, l)| (std::cmp::Reverse(*l), *s));
        Ok(holes)
    }

    /// Adds a chunk (and its block group) of `kind`, at least `min_len` bytes when possible.
    pub fn alloc_chunk(&mut self, kind: SpaceKind, min_len: u64) -> Result<u64> {
        self.check_writable()?;
        // The new chunk is in the chunk tree only once this transaction commits: a log that
        // named an extent or a log block in it would not replay (its address maps nowhere
        // before the commit). Until the commit, fsyncs commit instead of logging, as the
        // kernel's do after a full-commit mark.
        self.log.broken = true;
        // The profile of the existing groups of this kind.
        let mut profile = None;
        self.allocator.for_each(|g| {
            if SpaceKind::of_flags(g.flags) == Some(kind) && profile.is_none() {
                profile = Some(g.flags & BLOCK_GROUP_PROFILE_MASK);
            }
        });
        let profile = profile.unwrap_or(match kind {
            SpaceKind::Data => 0,
            _ => BLOCK_GROUP_DUP,
        });
        let copies = if profile & BLOCK_GROUP_DUP != 0 { 2 } else { 1 };
        if profile & !BLOCK_GROUP_DUP != 0 {
            return Err(Error::Unsupported(format!(
                "adding a chunk with profile {profile:#x}"
            )));
        }
        let total = self.dev_item.total_bytes;
        let max = match kind {
            SpaceKind::Data => 1 << 30,
            SpaceKind::Metadata => 256 << 20,
            SpaceKind::System => 32 << 20,
        };
        let tenth = (total / 10) / STRIPE * STRIPE;
        let mut want = (max as u64)
            .min(tenth.max(16 << 20))
            .max(min_len.div_ceil(STRIPE) * STRIPE);
        let holes = self.device_holes()?;
        let Some(&(hole, hole_len)) = holes.first() else {
            return Err(Error::NoSpace("the device has no unallocated space".into()));
        };
        let per_stripe_max = (hole_len / copies) / STRIPE * STRIPE;
        want = want.min(per_stripe_max);
        if want < (1 << 20) || want < min_len {
            return Err(Error::NoSpace(format!(
                "the device has no unallocated hole big enough for a {kind:?} chunk"
            )));
        }
        let logical = self
            .allocator
            .logical_end()
            .max(
                self.disk
                    .chunk_map()
                    .chunks()
                    .map(|c| c.logical + c.item.length)
                    .max()
                    .unwrap_or(0),
            )
            .div_ceil(1 << 20)
            * (1 << 20);
        let flags = kind.flag() | profile;
        let devid = self.disk.devid;
        let stripes: Vec<Stripe> = (0..copies)
            .map(|i| Stripe {
                devid,
                offset: hole + i * want,
                dev_uuid: self.dev_item.uuid,
            })
            .collect();
        let chunk = ChunkItem {
            length: want,
            owner: EXTENT_TREE_OBJECTID,
            stripe_len: STRIPE,
            ty: flags,
            io_align: STRIPE as u32,
            io_width: STRIPE as u32,
            sector_size: self.disk.sectorsize(),
            num_stripes: copies as u16,
            sub_stripes: 1,
            stripes: stripes.clone(),
        };
        // Register first, so the tree changes below can allocate from the new space.
        self.disk.add_chunk(logical, chunk.clone())?;
        let mut bg = BlockGroup::new(logical, want, flags);
        exclude_supers(&mut bg, &chunk);
        bg.new = true;
        bg.dirty = true;
        self.allocator.add_group(bg)?;
        let key = Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, logical);
        self.insert_item(CHUNK_TREE_OBJECTID, key, &chunk.to_bytes())?;
        for s in &stripes {
            let de = DevExtent {
                chunk_tree: CHUNK_TREE_OBJECTID,
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
                chunk_offset: logical,
                length: want,
                chunk_tree_uuid: self.chunk_tree_uuid,
            };
            self.insert_item(
                DEV_TREE_OBJECTID,
                Key::new(devid, DEV_EXTENT_KEY, s.offset),
                &de.to_bytes(),
            )?;
        }
        self.dev_item.bytes_used += want * copies;
        let di = self.dev_item.to_bytes();
        self.replace_item(
            CHUNK_TREE_OBJECTID,
            Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
            &di,
        )?;
        if kind == SpaceKind::System {
            let mut entry = key.to_bytes().to_vec();
            entry.extend_from_slice(&chunk.to_bytes());
            if self.sys_chunk_array.len() + entry.len() > SYSTEM_CHUNK_ARRAY_SIZE {
                return Err(Error::NoSpace(
                    "the superblock's system chunk array is full".into(),
                ));
            }
            self.sys_chunk_array.extend_from_slice(&entry);
            self.sys_array_dirty = true;
        }
        log::info!(
            "added a {kind:?} chunk of {} MiB at logical {logical}",
            want >> 20
        );
        Ok(logical)
    }

    // -----------------------------------------------------------------------------------------
    // Commit
    // -----------------------------------------------------------------------------------------

    /// Commits the running transaction even when no tree changed (log replay: the
    /// superblock's log pointer must be cleared).
    pub(crate) fn force_commit(&mut self) -> Result<()> {
        self.check_writable()?;
        self.check_no_ordered()?;
        self.state = TransState::CommitStart;
        match self.commit_inner(|| {}) {
            Ok(()) => {
                self.state = TransState::Running;
                Ok(())
            }
            Err(e) => {
                self.aborted = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// Commits the running transaction. A no-op when nothing changed.
    pub fn commit(&mut self) -> Result<()> {
        self.commit_with(|| {})
    }

    /// [`Writer::commit`], calling `trees_final` once the trees have their final state in
    /// memory, before the slow part (writing blocks, flushes, superblocks). From then on the
    /// commit reads the trees but does not change them: a caller that keeps readers out while
    /// trees change can let them in again there (the FUSE mount does, so a slow fsync does
    /// not stall reads).
    pub fn commit_with(&mut self, trees_final: impl FnOnce()) -> Result<()> {
        self.check_writable()?;
        self.check_no_ordered()?;
        if !self.has_changes() {
            return Ok(());
        }
        self.state = TransState::CommitStart;
        match self.commit_inner(trees_final) {
            Ok(()) => {
                self.state = TransState::Running;
                Ok(())
            }
            Err(e) => {
                let reason = e.to_string();
                log::error!("transaction {} aborted: {reason}", self.transid);
                self.aborted = Some(reason);
                Err(e)
            }
        }
    }

    /// Stops the write engine: no more changes, no more commits; the image keeps its last
    /// commit (and any fsync log written). For a failure that left the trees half changed.
    pub(crate) fn abort(&mut self, reason: String) {
        log::error!("transaction {} aborted: {reason}", self.transid);
        if self.aborted.is_none() {
            self.aborted = Some(reason);
        }
    }

    /// A commit with pending ordered extents would lose them (see `ordered_pending`): the
    /// filesystem completes them before it commits ([`crate::inode::core::Core::writer`]).
    fn check_no_ordered(&self) -> Result<()> {
        if self.ordered_pending > 0 {
            return Err(Error::Internal(format!(
                "a commit with {} ordered extents not yet in the trees",
                self.ordered_pending
            )));
        }
        Ok(())
    }

    fn commit_inner(&mut self, trees_final: impl FnOnce()) -> Result<()> {
        self.state = TransState::CommitDoing;
        let mut passes = 0;
        loop {
            passes += 1;
            if passes > 200 {
                return Err(Error::Internal("commit does not converge".into()));
            }
            if passes == 1 {
                self.mark_qgroups_inconsistent()?;
            }
            let mut changed = self.run_delayed_refs()?;
            changed |= self.update_block_groups()?;
            changed |= self.update_root_items()?;
            if !changed && self.refs.is_empty() {
                break;
            }
        }
        trees_final();
        self.write_dirty_blocks()?;
        self.disk
            .dev
            .flush()
            .map_err(|e| Error::io("flushing tree blocks", 0, e))?;
        self.write_superblocks()?;
        self.state = TransState::Unblocked;
        // The superblock no longer names a log: its blocks go back once no log write is in
        // flight.
        let ns = self.disk.nodesize() as u64;
        self.log.committed(&mut self.ctx.allocator, ns);
        // The transaction is on disk.
        self.allocator.unpin_all();
        self.allocator.for_each(|g| {
            g.dirty = false;
            g.new = false;
        });
        self.disk.overlay_retire();
        for t in self.trees.values_mut() {
            t.dirty = false;
        }
        self.sys_array_dirty = false;
        self.stats.commits += 1;
        self.state = TransState::Completed;
        self.transid += 1;
        Ok(())
    }

    /// butter does not account qgroups. A filesystem with quotas on that this transaction
    /// changes gets its qgroup status marked INCONSISTENT (with this generation), as the
    /// kernel marks it when it cannot account a change: `btrfs check` then expects differences
    /// in the counts, and `btrfs quota rescan` recomputes them. Simple quotas are refused at
    /// open (crate::format::features).
    fn mark_qgroups_inconsistent(&mut self) -> Result<()> {
        if self.qgroups_marked || !self.has_changes() {
            return Ok(());
        }
        match self.tree_state(QUOTA_TREE_OBJECTID) {
            Ok(_) => {}
            Err(Error::NotFound(_)) => {
                self.qgroups_marked = true;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        let key = Key::new(0, QGROUP_STATUS_KEY, 0);
        let Some(body) = self.read_item(QUOTA_TREE_OBJECTID, &key)? else {
            self.qgroups_marked = true;
            return Ok(());
        };
        // version, generation, flags, rescan progress (u64 each; newer kernels append one).
        if body.len() < 32 {
            return Err(Error::corrupt(
                Location::what("qgroup status item")
                    .with_tree(QUOTA_TREE_OBJECTID)
                    .with_key(key),
                format!("item is {} bytes, expected at least 32", body.len()),
            ));
        }
        let flags = le_u64(&body, 16);
        if flags & QGROUP_STATUS_FLAG_ON != 0 && flags & QGROUP_STATUS_FLAG_INCONSISTENT == 0 {
            let transid = self.transid;
            self.update_item(QUOTA_TREE_OBJECTID, &key, |b| {
                b[8..16].copy_from_slice(&transid.to_le_bytes());
                b[16..24].copy_from_slice(&(flags | QGROUP_STATUS_FLAG_INCONSISTENT).to_le_bytes());
                Ok(())
            })?;
            log::info!(
                "quotas are on: qgroup numbers marked inconsistent (butter does not account \
                 them; `btrfs quota rescan` recomputes them)"
            );
        }
        self.qgroups_marked = true;
        Ok(())
    }

    /// Rewrites block group items and free space tree entries of dirty groups. Returns whether
    /// any tree changed.
    fn update_block_groups(&mut self) -> Result<bool> {
        let mut changed = false;
        let fst = self.disk.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE);
        for start in self.allocator.starts() {
            let snap = self.allocator.with_group(start, |g| {
                let r = g.dirty.then(|| {
                    (
                        g.len,
                        g.flags,
                        g.used,
                        g.new,
                        g.on_disk_free(),
                        g.fst_bitmaps,
                    )
                });
                g.dirty = false;
                r
            });
            let Some(Some((len, flags, used, _new, free, bitmaps))) = snap else {
                continue;
            };
            let key = Key::new(start, BLOCK_GROUP_ITEM_KEY, len);
            let body = BlockGroupItem {
                used,
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
                flags,
            }
            .to_bytes();
            let tree = self.block_group_tree();
            if self.read_item(tree, &key)?.as_deref() != Some(&body[..]) {
                self.replace_item(tree, key, &body)?;
                changed = true;
            }
            if fst {
                let ss = self.disk.sectorsize();
                let fsp = crate::space::free_space_tree::BgFreeSpace {
                    start,
                    len,
                    extents: free.iter().collect(),
                };
                let (use_bitmaps, want) = crate::space::free_space_tree::encode(&fsp, ss, bitmaps);
                self.allocator
                    .with_group(start, |g| g.fst_bitmaps = use_bitmaps);
                changed |= self.sync_fst_items(start, len, want)?;
            }
        }
        Ok(changed)
    }

    /// Makes the free space tree items of one block group exactly `want`.
    fn sync_fst_items(&mut self, start: u64, len: u64, want: Vec<(Key, Vec<u8>)>) -> Result<bool> {
        let root = self.current_root(FREE_SPACE_TREE_OBJECTID)?;
        let mut have: Vec<(Key, Vec<u8>)> = Vec::new();
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(start, 0, 0),
            Readahead::None,
        )?;
        while let Some(item) = it.next_item()? {
            if item.key.objectid >= start + len {
                break;
            }
            if matches!(
                item.key.ty,
                FREE_SPACE_INFO_KEY | FREE_SPACE_EXTENT_KEY | FREE_SPACE_BITMAP_KEY
            ) {
                have.push((item.key, item.data().to_vec()));
            }
        }
        if have == want {
            return Ok(false);
        }
        let want_map: BTreeMap<Key, Vec<u8>> = want.into_iter().collect();
        for (k, v) in &have {
            if want_map.get(k) != Some(v) {
                self.delete_item(FREE_SPACE_TREE_OBJECTID, k)?;
            }
        }
        let have_map: BTreeMap<Key, Vec<u8>> = have.into_iter().collect();
        for (k, v) in &want_map {
            if have_map.get(k) != Some(v) {
                self.insert_item(FREE_SPACE_TREE_OBJECTID, *k, v)?;
            }
        }
        Ok(true)
    }

    /// Stores the new root of every changed tree in its ROOT_ITEM.
    fn update_root_items(&mut self) -> Result<bool> {
        let mut changed = false;
        let dirty: Vec<TreeState> = self
            .trees
            .values()
            .filter(|t| t.dirty && t.item_key.is_some())
            .cloned()
            .collect();
        for t in dirty {
            let Some(key) = t.item_key else { continue };
            let Some(mut body) = self.read_item(ROOT_TREE_OBJECTID, &key)? else {
                return Err(Error::corrupt(
                    Location::what("root item")
                        .with_tree(ROOT_TREE_OBJECTID)
                        .with_key(key),
                    "root item vanished",
                ));
            };
            let before = body.clone();
            crate::format::encode::patch_root_item(&mut body, t.bytenr, t.level, self.transid);
            if is_fs_tree(t.id) && body.len() >= RootItem::SIZE {
                body[295..303].copy_from_slice(&self.transid.to_le_bytes());
            }
            if body != before {
                self.update_item(ROOT_TREE_OBJECTID, &key, |b| {
                    b.copy_from_slice(&body);
                    Ok(())
                })?;
                changed = true;
            }
            if let Some(ts) = self.trees.get_mut(&t.id) {
                // Stays dirty only if its root moves again in a later pass.
                if ts.bytenr == t.bytenr && ts.level == t.level {
                    ts.dirty = false;
                }
            }
        }
        Ok(changed)
    }

    fn write_dirty_blocks(&mut self) -> Result<()> {
        let ct = self.disk.sb.csum_type;
        for bytenr in self.disk.overlay_addresses() {
            let data = self.modify(bytenr, |buf| {
                let flags = crate::ctree_ops::read_header(buf)?.flags | HEADER_FLAG_WRITTEN;
                crate::ctree_ops::set_flags(buf, flags)?;
                crate::ctree_ops::finalize(buf, ct)?;
                Ok(buf.to_vec())
            })?;
            self.disk.write_logical(bytenr, &data)?;
            self.stats.blocks_written += 1;
        }
        Ok(())
    }

    /// Points the primary superblock at a log root tree (an fsync log commit; the caller
    /// flushes). The mirrors keep the committed state, as the kernel leaves them.
    pub(crate) fn write_log_super(&mut self, log_root: u64, level: u8) -> Result<()> {
        let mut copy = self.sb_raw.clone();
        copy[96..104].copy_from_slice(&log_root.to_le_bytes());
        copy[104..112].fill(0);
        copy[200] = level;
        let off = alloc::super_mirror_offsets()[0];
        copy[48..56].copy_from_slice(&off.to_le_bytes());
        let ct = self.disk.sb.csum_type;
        let c = ct.compute(&copy[32..SUPER_INFO_SIZE]);
        copy[0..32].fill(0);
        copy[..ct.size()].copy_from_slice(&c[..ct.size()]);
        if let Err(e) = self.disk.dev.write_at(&copy, off) {
            let e = Error::io("writing the superblock of an fsync log", off, e);
            // The primary copy may be torn: nothing more may be written.
            self.aborted = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    fn write_superblocks(&mut self) -> Result<()> {
        let transid = self.transid;
        let root = self.trees[&ROOT_TREE_OBJECTID].clone();
        let chunk = self.trees[&CHUNK_TREE_OBJECTID].clone();
        let mut roots = HashMap::new();
        for id in [
            EXTENT_TREE_OBJECTID,
            FS_TREE_OBJECTID,
            DEV_TREE_OBJECTID,
            CSUM_TREE_OBJECTID,
        ] {
            let r = self.current_root(id)?;
            roots.insert(id, r);
        }
        let b = &mut self.sb_raw;
        let put =
            |b: &mut Vec<u8>, off: usize, v: u64| b[off..off + 8].copy_from_slice(&v.to_le_bytes());
        put(b, 72, transid);
        put(b, 80, root.bytenr);
        put(b, 88, chunk.bytenr);
        put(b, 120, self.ctx.sb_bytes_used);
        // Any fsync log was replayed before this commit (tree_log).
        put(b, 96, 0);
        put(b, 104, 0);
        b[200] = 0;
        put(b, 164, chunk.generation);
        b[198] = root.level;
        b[199] = chunk.level;
        b[201..201 + DevItem::SIZE].copy_from_slice(&self.dev_item.to_bytes());
        b[160..164].copy_from_slice(&(self.sys_chunk_array.len() as u32).to_le_bytes());
        b[811..811 + SYSTEM_CHUNK_ARRAY_SIZE].fill(0);
        b[811..811 + self.sys_chunk_array.len()].copy_from_slice(&self.sys_chunk_array);
        // Backup roots: the slot after the newest one.
        let slot_off = |i: usize| 2859 + i * 168;
        let mut newest = 0usize;
        let mut newest_gen = 0u64;
        for i in 0..4 {
            let g = le_u64(b, slot_off(i) + 8);
            if g > newest_gen {
                newest_gen = g;
                newest = i;
            }
        }
        let slot = if newest_gen == 0 { 0 } else { (newest + 1) % 4 };
        let o = slot_off(slot);
        let mut br = vec![0u8; 168];
        let w = |br: &mut Vec<u8>, off: usize, v: u64| {
            br[off..off + 8].copy_from_slice(&v.to_le_bytes())
        };
        w(&mut br, 0, root.bytenr);
        w(&mut br, 8, transid);
        w(&mut br, 16, chunk.bytenr);
        w(&mut br, 24, chunk.generation);
        w(&mut br, 32, roots[&EXTENT_TREE_OBJECTID].bytenr);
        w(&mut br, 40, roots[&EXTENT_TREE_OBJECTID].generation);
        w(&mut br, 48, roots[&FS_TREE_OBJECTID].bytenr);
        w(&mut br, 56, roots[&FS_TREE_OBJECTID].generation);
        w(&mut br, 64, roots[&DEV_TREE_OBJECTID].bytenr);
        w(&mut br, 72, roots[&DEV_TREE_OBJECTID].generation);
        w(&mut br, 80, roots[&CSUM_TREE_OBJECTID].bytenr);
        w(&mut br, 88, roots[&CSUM_TREE_OBJECTID].generation);
        w(&mut br, 96, le_u64(b, 112));
        w(&mut br, 104, self.ctx.sb_bytes_used);
        w(&mut br, 112, le_u64(b, 136));
        br[152] = root.level;
        br[153] = chunk.level;
        br[154] = roots[&EXTENT_TREE_OBJECTID].level;
        br[155] = roots[&FS_TREE_OBJECTID].level;
        br[156] = roots[&DEV_TREE_OBJECTID].level;
        br[157] = roots[&CSUM_TREE_OBJECTID].level;
        b[o..o + 168].copy_from_slice(&br);
        let ct = self.disk.sb.csum_type;
        let dev_len = self.disk.dev.len();
        for (i, off) in alloc::super_mirror_offsets().into_iter().enumerate() {
            if off + SUPER_INFO_SIZE as u64 > dev_len
                || off + SUPER_INFO_SIZE as u64 > self.dev_item.total_bytes
            {
                break;
            }
            let mut copy = self.sb_raw.clone();
            copy[48..56].copy_from_slice(&off.to_le_bytes());
            let c = ct.compute(&copy[32..SUPER_INFO_SIZE]);
            copy[0..32].fill(0);
            copy[..ct.size()].copy_from_slice(&c[..ct.size()]);
            self.disk
                .dev
                .write_at(&copy, off)
                .map_err(|e| Error::io(format!("writing superblock copy {i}"), off, e))?;
        }
        self.disk
            .dev
            .flush()
            .map_err(|e| Error::io("flushing superblocks", 0, e))?;
        Ok(())
    }
}

const STRIPE: u64 = alloc::STRIPE_LEN;

/// Carves the superblock copies out of a group's free space.
fn exclude_supers(bg: &mut BlockGroup, chunk: &ChunkItem) {
    // Logical space below the first superblock is never handed out (as the kernel excludes
    // it): old mkfs put the system chunk at logical 0, and no tree block may live at 0.
    let below = crate::format::SUPER_INFO_OFFSET;
    if bg.start < below {
        bg.exclude(bg.start, (below - bg.start).min(bg.len));
    }
    for m in alloc::super_mirror_offsets() {
        for s in &chunk.stripes {
            if m >= s.offset && m < s.offset + chunk.length {
                let off = (m - s.offset) / STRIPE * STRIPE;
                bg.exclude(bg.start + off, STRIPE);
            }
        }
    }
}
