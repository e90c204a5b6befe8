//! The commit pipeline (see the folder's doc): delayed references, block groups, root items
//! until a pass changes nothing; then every changed block, a flush, the superblocks, a flush.
//! Also the superblock write of a log commit.

use super::Writer;
use super::{TransState, TreeState};
use crate::ctree::cow_ctx::is_fs_tree;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::superblock::DevItem;
use crate::format::*;
use crate::space::alloc::{self};
use std::collections::HashMap;

impl Writer {
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
    pub(crate) fn commit_with(&mut self, trees_final: impl FnOnce()) -> Result<()> {
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
    pub(super) fn check_no_ordered(&self) -> Result<()> {
        if self.ordered_pending > 0 {
            return Err(Error::Internal(format!(
                "a commit with {} ordered extents not yet in the trees",
                self.ordered_pending
            )));
        }
        Ok(())
    }

    pub(super) fn commit_inner(&mut self, trees_final: impl FnOnce()) -> Result<()> {
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
    pub(super) fn mark_qgroups_inconsistent(&mut self) -> Result<()> {
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

    /// Stores the new root of every changed tree in its ROOT_ITEM.
    pub(super) fn update_root_items(&mut self) -> Result<bool> {
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

    pub(super) fn write_dirty_blocks(&mut self) -> Result<()> {
        let ct = self.disk.sb.csum_type;
        for bytenr in self.disk.overlay_addresses() {
            let data = self.modify(bytenr, |buf| {
                let flags = crate::ctree::ops::read_header(buf)?.flags | HEADER_FLAG_WRITTEN;
                crate::ctree::ops::set_flags(buf, flags)?;
                crate::ctree::ops::finalize(buf, ct)?;
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

    pub(super) fn write_superblocks(&mut self) -> Result<()> {
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
