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

pub mod block_groups;
pub mod chunk_alloc;
pub mod commit;
pub mod extent_refs;
pub mod log_state;
pub mod relocate;

use crate::ctree::cow_ctx::{is_fs_tree, CowCtx};
use crate::error::{Error, Result};
use crate::format::superblock::{DevItem, Superblock};
use crate::format::*;
use crate::io::disk_io::Disk;
use crate::space::alloc::{Allocator, ForFile, SpaceKind, Want};
use crate::space::delayed_refs::DelayedRefs;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub(crate) use crate::ctree::cow_ctx::{LiveRoots, TreeState};

/// Transaction states, as the kernel names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransState {
    Running,
    CommitStart,
    CommitDoing,
    Unblocked,
    Completed,
}

/// Counters for tests and benchmarks.
#[derive(Debug, Default, Clone)]
pub(crate) struct WriteStats {
    pub commits: u64,
    pub blocks_written: u64,
}

/// The running transaction and the commit. What copy-on-write edits need (disk, transid,
/// tree states, delayed references, allocator, live roots) is its [`CowCtx`], which it lends
/// to the B-tree code (crate::ctree::cow) and the reference runner (crate::transaction::extent_refs); `Writer`
/// dereferences to it, so `w.insert_item(..)` and `w.transid` read as before.
pub(crate) struct Writer {
    ctx: CowCtx,
    pub(crate) state: TransState,
    /// The superblock as last written (raw), patched at each commit.
    /// The superblock as last committed (or as opened), and the bytes it was read from: the
    /// base the one superblock writer (crate::io::super_io) encodes over.
    pub(crate) sb: Superblock,
    sb_base: Vec<u8>,
    /// Every device's item, by devid (the primary's as its superblock carries it).
    pub(crate) dev_items: BTreeMap<u64, DevItem>,
    /// Devices added in the running transaction ([`Writer::add_device`]), with their names:
    /// the commit writes their superblocks first, then they join the open device set (new
    /// chunks may go on them from then on).
    added: Vec<(
        u64,
        std::sync::Arc<dyn crate::io::device::BlockDevice>,
        String,
    )>,
    /// Dev extents of block groups removed in the running transaction, (devid, offset,
    /// length): the last commit's chunks still live there, so no new chunk may take them
    /// before this transaction commits.
    freed_dev_extents: Vec<(u64, u64, u64)>,
    /// Per device, where new chunks must end (a shrink or device remove in progress: the
    /// space past it is being emptied). In memory only, as the kernel's shrink keeps it.
    pub(crate) chunk_limit: BTreeMap<u64, u64>,
    /// Per block group type bit, the profile new chunks of it take (a balance converting
    /// it); otherwise they take the profile of the type's existing groups.
    pub(crate) chunk_profile: BTreeMap<u64, u64>,
    /// New chunks of one block group type bit get this length (at least what is asked),
    /// each in the lowest hole of its device where it fits: a shrink packing the device
    /// from its start.
    pub(crate) chunk_fit: Option<(u64, u64)>,
    /// Per device, where new chunks must start at the earliest (a shrink moving a block
    /// group out of the way, above the others).
    pub(crate) chunk_floor: BTreeMap<u64, u64>,
    sys_chunk_array: Vec<u8>,
    sys_array_dirty: bool,
    /// Of the descents (`CowCtx::descents`), those of file extent replacement (for the
    /// benchmark of one-descent extent replace).
    pub(crate) replace_descents: u64,
    pub(crate) stats: WriteStats,
    /// Next free inode number per subvolume.
    pub(crate) next_ino: HashMap<u64, u64>,
    /// Next DIR_INDEX sequence per (subvolume, directory).
    pub(crate) next_index: HashMap<(u64, u64), u64>,
    /// One-descent extent replace: file extents are replaced in the leaf of one descent when
    /// possible.
    pub(crate) combined_replace: bool,
    /// New chunks stay small (data 8 MiB, metadata 32 MiB), as mkfs.btrfs --rootdir makes
    /// them, so a shrunk image wastes little past its data.
    pub(crate) small_chunks: bool,
    /// The fsync log of the running transaction (crate::tree_log::write).
    pub(crate) log: crate::transaction::log_state::LogState,
    /// Ordered extents written but not yet in the trees (crate::inode::ordered). A commit must not
    /// run while there are any: their data would be in no tree and, if an fsync logged them,
    /// the commit would drop the log that has them.
    pub(crate) ordered_pending: usize,
    /// The qgroup status is INCONSISTENT on disk, or there are no quotas (checked once).
    qgroups_marked: bool,
    /// The running transaction changes nothing qgroups count: it only relocates (block and
    /// extent addresses renamed, sizes and sharing kept) or adds and removes chunks. Its
    /// commit leaves the qgroup status as it is. Cleared by every other operation's start
    /// ([`Writer::reserve_metadata`]) and by the commit.
    pub(crate) qgroup_neutral: bool,
    /// The extent tree could not be read at the open: the free space came from the free
    /// space tree instead (a block group tree holding the groups). Only a repair that makes
    /// the extent tree again may go on (see [`Writer::load_block_groups`]).
    pub(crate) extent_tree_unread: Option<String>,
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
    #[cfg(test)]
    /// What the engine wrote so far (blocks, flushes, ...).
    pub(crate) fn stats(&self) -> &WriteStats {
        &self.stats
    }

    /// B-tree descents made so far (search_mut calls and their restarts), and of those the
    /// descents of file extent replacement.
    pub(crate) fn descents(&self) -> (u64, u64) {
        (self.descents, self.replace_descents)
    }

    /// Whether file extents are replaced in the leaf of one descent when possible (the
    /// default); off, each replacement deletes and inserts in descents of their own, for the
    /// benchmark's comparison.
    pub(crate) fn set_combined_replace(&mut self, on: bool) {
        self.combined_replace = on;
    }
}

impl Writer {
    /// The item of the device the superblock came from.
    pub(crate) fn primary_dev_item(&self) -> &DevItem {
        let devid = self.disk.devid();
        match self.dev_items.get(&devid) {
            Some(d) => d,
            None => unreachable!("the writer always holds the primary device's item"),
        }
    }

    /// The size of device `devid` as its item says, at most its length.
    pub(crate) fn device_total_bytes(&self, devid: u64) -> u64 {
        let Some(dev) = self.disk.devices.get(devid) else {
            return 0;
        };
        self.dev_items
            .get(&devid)
            .map_or(0, |d| d.total_bytes)
            .min(dev.len())
    }

    /// The size of every present device together (see [`Writer::device_total_bytes`]).
    pub(crate) fn devices_total_bytes(&self) -> u64 {
        self.disk
            .devices
            .members()
            .iter()
            .map(|m| self.device_total_bytes(m.devid))
            .sum()
    }

    /// The other devices' items, from the chunk tree (a filesystem of several devices).
    fn load_other_dev_items(&mut self) -> Result<()> {
        if self.disk.devices.len() < 2 {
            return Ok(());
        }
        let root = self.current_root(CHUNK_TREE_OBJECTID)?;
        let mut it = crate::ctree::TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0),
            crate::io::disk_io::Readahead::None,
        )?;
        let primary = self.disk.devid();
        while let Some(item) = it.next_item()? {
            if item.key.objectid != DEV_ITEMS_OBJECTID || item.key.ty != DEV_ITEM_KEY {
                break;
            }
            let d = DevItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            if d.devid != primary {
                self.dev_items.insert(d.devid, d);
            }
        }
        Ok(())
    }
}

impl Writer {
    /// Starts the write engine on an opened filesystem: loads block groups and their free
    /// space from the extent tree.
    pub(crate) fn open(disk: Arc<Disk>, live: LiveRoots) -> Result<Writer> {
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
        disk.dev()
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
                allocator: Arc::new(Allocator::new()),
                chunk_tree_uuid: root_block.header.chunk_tree_uuid,
                sb_bytes_used: sb.bytes_used,
                live,
                descents: 0,
                aborted: None,
                abort_flag: Default::default(),
                copy_future_blocks: false,
                disk,
            },
            state: TransState::Running,
            sb: sb.clone(),
            sb_base: raw,
            dev_items: [(sb.dev_item.devid, sb.dev_item.clone())]
                .into_iter()
                .collect(),
            added: Vec::new(),
            freed_dev_extents: Vec::new(),
            chunk_limit: BTreeMap::new(),
            chunk_profile: BTreeMap::new(),
            chunk_fit: None,
            chunk_floor: BTreeMap::new(),
            sys_chunk_array: sb.sys_chunk_array.clone(),
            sys_array_dirty: false,
            replace_descents: 0,
            stats: WriteStats::default(),
            next_ino: HashMap::new(),
            next_index: HashMap::new(),
            combined_replace: true,
            small_chunks: false,
            log: Default::default(),
            ordered_pending: 0,
            qgroups_marked: false,
            qgroup_neutral: false,
            extent_tree_unread: None,
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
        w.load_other_dev_items()?;
        w.load_block_groups()?;
        Ok(w)
    }

    /// Replaces the allocator by the one from before seed 001 (for the benchmarks), right
    /// after the open: the block groups are loaded again from the trees.
    pub(crate) fn use_legacy_allocator(&mut self) -> Result<()> {
        if self.has_changes() || self.log.pending() {
            return Err(Error::Internal(
                "the allocator can only be chosen before anything is changed".into(),
            ));
        }
        self.ctx.allocator = Arc::new(Allocator::new_legacy());
        self.load_block_groups()
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
    pub(crate) fn has_changes(&self) -> bool {
        !self.refs.is_empty() || !self.disk.overlay_addresses().is_empty()
    }

    /// Rewrites every superblock copy of the last commit with `magic` (MAGIC_TEMPORARY while
    /// a filesystem is being made, then MAGIC), which later commits keep. The temporary one
    /// goes to the primary copy first, the real one last: at every moment either the primary
    /// says "unfinished" or the whole filesystem is there.
    pub(crate) fn set_magic(&mut self, magic: u64) -> Result<()> {
        self.check_writable()?;
        self.sb.magic = magic;
        let order = if magic == MAGIC {
            crate::io::super_io::Order::PrimaryLast
        } else {
            crate::io::super_io::Order::PrimaryFirst
        };
        crate::io::super_io::write_all_devices(
            &self.disk.devices,
            &self.dev_items,
            &self.sb,
            &self.sb_base,
            order,
        )?;
        Ok(())
    }

    /// Allocates `len` bytes of data space (sector aligned) for `file` (its next extent goes after its previous one when
    /// that space is free), `held` (see [`crate::space::alloc::BlockGroup::held`]): for an
    /// extent whose data is written before its file extent item goes in. A new chunk is
    /// added only when the allocation fails under the writer lock, so writers that found
    /// the groups full at the same moment add one chunk between them.
    pub(crate) fn alloc_data_for(
        &mut self,
        len: u64,
        file: Option<ForFile>,
        held: bool,
    ) -> Result<u64> {
        self.check_writable()?;
        let want = Want {
            kind: SpaceKind::Data,
            len,
            align: self.disk.sectorsize() as u64,
            file,
            held,
        };
        if let Some(b) = self.allocator.alloc_for(&want) {
            return Ok(b);
        }
        if self.alloc_chunk(SpaceKind::Data, len).is_ok() {
            if let Some(b) = self.allocator.alloc_for(&want) {
                return Ok(b);
            }
        }
        Err(Error::NoSpace(format!(
            "no free data space for {len} bytes"
        )))
    }

    /// [`Writer::alloc_data_for`] at the start of an operation (before it changed a tree): when
    /// the device is full, commits first, since extents this transaction dropped are freed
    /// (and become allocatable) only by a commit.
    pub(crate) fn alloc_data_or_commit(&mut self, len: u64) -> Result<u64> {
        self.alloc_data_or_commit_for(len, None, false)
    }

    /// [`Writer::alloc_data_or_commit`] with [`Writer::alloc_data_for`]'s `file` and `held`.
    pub(crate) fn alloc_data_or_commit_for(
        &mut self,
        len: u64,
        file: Option<ForFile>,
        held: bool,
    ) -> Result<u64> {
        match self.alloc_data_for(len, file, held) {
            Err(Error::NoSpace(_)) if self.has_changes() => {
                self.commit()?;
                self.alloc_data_for(len, file, held)
            }
            r => r,
        }
    }

    /// [`Writer::alloc_data_or_commit`], the range held (see [`crate::space::alloc::BlockGroup::held`])
    /// for an ordered extent: its data is written without the writer lock, and until its file
    /// extent item goes in, a commit leaves the range free on disk.
    pub(crate) fn alloc_data_held_or_commit(
        &mut self,
        len: u64,
        file: Option<ForFile>,
    ) -> Result<u64> {
        self.alloc_data_or_commit_for(len, file, true)
    }

    /// Up to `len` bytes of data space for `file` (fallocate): all of it where a free extent
    /// that long exists, else the largest one there is (a sector at least); when there is
    /// none, after adding a chunk, or else after a commit (freed space comes back with it).
    /// Returns (start, length).
    pub(crate) fn alloc_data_upto(
        &mut self,
        len: u64,
        file: Option<ForFile>,
    ) -> Result<(u64, u64)> {
        self.check_writable()?;
        let ss = self.disk.sectorsize() as u64;
        let want = Want {
            kind: SpaceKind::Data,
            len,
            align: ss,
            file,
            held: false,
        };
        if let Some(r) = self.allocator.alloc_upto(&want, ss) {
            return Ok(r);
        }
        if self.alloc_chunk(SpaceKind::Data, len).is_err() && self.has_changes() {
            self.commit()?;
        }
        self.allocator
            .alloc_upto(&want, ss)
            .ok_or_else(|| Error::NoSpace(format!("no free data space for {len} bytes")))
    }

    /// Before an operation: make sure metadata and system space will not run out in the middle
    /// of it (adding chunks here, where no tree is being changed). Errors with ENOSPC when the
    /// device is full and `for_growth`.
    pub(crate) fn reserve_metadata(&mut self, for_growth: bool) -> Result<()> {
        self.check_writable()?;
        self.qgroup_neutral = false;
        for (kind, want) in self.metadata_wanted() {
            if self.allocator.free_bytes(kind) >= want {
                continue;
            }
            if self.alloc_chunk(kind, 0).is_ok() {
                continue;
            }
            let floor = if for_growth {
                want / 2
            } else {
                self.disk.nodesize() as u64 * 32
            };
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

    /// What [`Writer::reserve_metadata`] keeps free, per space kind.
    fn metadata_wanted(&self) -> [(SpaceKind, u64); 2] {
        let ns = self.disk.nodesize() as u64;
        [
            (SpaceKind::System, ns * 16),
            (SpaceKind::Metadata, (ns * 256).max(4 << 20)),
        ]
    }

    /// Whether [`Writer::reserve_metadata`] has nothing to do: the space it keeps free is
    /// free (no chunk to allocate, no commit for space).
    pub(crate) fn metadata_reserved(&self) -> bool {
        self.metadata_wanted()
            .iter()
            .all(|&(kind, want)| self.allocator.free_bytes(kind) >= want)
    }
}
