//! The commit pipeline (see the folder's doc): delayed references, block groups, root items
//! until a pass changes nothing; then every changed block, a flush, the superblocks, a flush.
//! Also the superblock write of a log commit.

use super::Writer;
use super::{TransState, TreeState};
use crate::ctree::cow_ctx::is_fs_tree;
use crate::error::{Error, Location, Result};
use crate::format::superblock::BackupRoot;
use crate::format::*;
use std::collections::HashMap;

impl Writer {
    /// Commits the running transaction even when no tree changed (log replay: the
    /// superblock's log pointer must be cleared).
    pub(crate) fn force_commit(&mut self) -> Result<()> {
        self.commit_checked(true, || {}, |_| Ok(()))
    }

    /// Commits the running transaction. A no-op when nothing changed.
    pub(crate) fn commit(&mut self) -> Result<()> {
        self.commit_with(|| {})
    }

    /// [`Writer::commit`], calling `trees_final` once the trees have their final state in
    /// memory, before the slow part (writing blocks, flushes, superblocks). From then on the
    /// commit reads the trees but does not change them: a caller that keeps readers out while
    /// trees change can let them in again there (the FUSE mount does, so a slow fsync does
    /// not stall reads).
    pub(crate) fn commit_with(&mut self, trees_final: impl FnOnce()) -> Result<()> {
        self.commit_checked(false, trees_final, |_| Ok(()))
    }

    /// [`Writer::commit`] (even of no change) that asks `verify` about the new superblock once
    /// the trees are final, before anything is written: the blocks it names are in the
    /// overlay (see `crate::ctree::open_disk_as`). An error from it writes nothing and stops
    /// the write engine. A repair's commit.
    pub(crate) fn commit_verified(
        &mut self,
        verify: impl FnOnce(&crate::format::superblock::Superblock) -> Result<()>,
    ) -> Result<()> {
        self.commit_checked(true, || {}, verify)
    }

    /// The commit; `force`: even when nothing changed.
    fn commit_checked(
        &mut self,
        force: bool,
        trees_final: impl FnOnce(),
        verify: impl FnOnce(&crate::format::superblock::Superblock) -> Result<()>,
    ) -> Result<()> {
        self.check_writable()?;
        self.check_no_ordered()?;
        if !force && !self.has_changes() {
            return Ok(());
        }
        self.state = TransState::CommitStart;
        match self.commit_inner(trees_final, verify) {
            Ok(()) => {
                self.state = TransState::Running;
                Ok(())
            }
            Err(e) => {
                let reason = e.to_string();
                log::error!("transaction {} aborted: {reason}", self.transid);
                self.set_aborted(reason);
                Err(e)
            }
        }
    }

    /// Stops the write engine: no more changes, no more commits; the image keeps its last
    /// commit (and any fsync log written). For a failure that left the trees half changed.
    pub(crate) fn abort(&mut self, reason: String) {
        log::error!("transaction {} aborted: {reason}", self.transid);
        if self.aborted.is_none() {
            self.set_aborted(reason);
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

    pub(super) fn commit_inner(
        &mut self,
        trees_final: impl FnOnce(),
        verify: impl FnOnce(&crate::format::superblock::Superblock) -> Result<()>,
    ) -> Result<()> {
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
        self.next_superblock()?;
        verify(&self.sb)?;
        self.write_dirty_blocks()?;
        self.disk
            .flush_all()
            .map_err(|e| Error::io("flushing tree blocks", 0, e))?;
        self.write_superblock_copies()?;
        // Devices added by this transaction are named by every superblock now: they join.
        for (devid, dev, name) in std::mem::take(&mut self.added) {
            let uuid = self
                .dev_items
                .get(&devid)
                .map(|d| d.uuid)
                .unwrap_or_default();
            self.disk.devices.insert(crate::io::volumes::Member {
                devid,
                uuid,
                name,
                dev: Some(dev),
                failed: Default::default(),
            });
        }
        self.state = TransState::Unblocked;
        // The superblock no longer names a log: its blocks go back once no log write is in
        // flight.
        let ns = self.disk.nodesize() as u64;
        self.log.committed(&self.ctx.allocator, ns);
        // The transaction is on disk.
        self.allocator.unpin_all();
        self.freed_dev_extents.clear();
        self.allocator.for_each(|g| {
            g.dirty = false;
            g.new = false;
        });
        self.disk.overlay_retire();
        for t in self.trees.values_mut() {
            t.dirty = false;
        }
        self.sys_array_dirty = false;
        self.qgroup_neutral = false;
        self.stats.commits += 1;
        self.state = TransState::Completed;
        self.transid += 1;
        Ok(())
    }

    /// butter does not account qgroups. A filesystem with quotas on that this transaction
    /// changes gets its qgroup status marked INCONSISTENT (with this generation), as the
    /// kernel marks it when it cannot account a change: `btrfs check` then expects differences
    /// in the counts, and `btrfs quota rescan` recomputes them. Simple quotas are refused at
    /// open (crate::format::features). A transaction that changes nothing qgroups count
    /// ([`Writer::qgroup_neutral`]: relocation, chunks, devices) keeps consistent numbers
    /// consistent: only the status item's generation follows the commit.
    pub(super) fn mark_qgroups_inconsistent(&mut self) -> Result<()> {
        if self.qgroups_marked || !self.has_changes() {
            return Ok(());
        }
        let neutral = self.qgroup_neutral;
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
        let Some(flags) = crate::format::encode::qgroup_status_flags(&body) else {
            return Err(Error::corrupt(
                Location::what("qgroup status item")
                    .with_tree(QUOTA_TREE_OBJECTID)
                    .with_key(key),
                format!("item is {} bytes, expected at least 32", body.len()),
            ));
        };
        if neutral && flags & QGROUP_STATUS_FLAG_ON != 0 {
            // Nothing qgroups count changed: the numbers stay right. The kernel trusts them
            // only when the status item has the generation of the last commit, as each of its
            // own commits writes it.
            if flags & QGROUP_STATUS_FLAG_INCONSISTENT == 0 {
                let transid = self.transid;
                self.update_item(QUOTA_TREE_OBJECTID, &key, |b| {
                    crate::format::encode::patch_qgroup_status(b, transid, flags);
                    Ok(())
                })?;
            }
            return Ok(());
        }
        if flags & QGROUP_STATUS_FLAG_ON != 0 && flags & QGROUP_STATUS_FLAG_INCONSISTENT == 0 {
            let transid = self.transid;
            self.update_item(QUOTA_TREE_OBJECTID, &key, |b| {
                crate::format::encode::patch_qgroup_status(
                    b,
                    transid,
                    flags | QGROUP_STATUS_FLAG_INCONSISTENT,
                );
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
            crate::format::encode::patch_root_item(&mut body, t.bytenr, t.level, t.generation);
            // A subvolume whose contents changed gets this transid as its ctransid; one whose
            // root block was only moved (relocation keeps its generation) did not change.
            if is_fs_tree(t.id) && t.generation == self.transid {
                crate::format::encode::patch_root_ctransid(&mut body, self.transid);
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
        let mut sb = self.sb.clone();
        sb.log_root = log_root;
        sb.log_root_level = level;
        if let Err(e) = crate::io::super_io::write_primary_devices(
            &self.disk.devices,
            &self.dev_items,
            &sb,
            &self.sb_base,
        ) {
            // The primary copy may be torn: nothing more may be written.
            self.set_aborted(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// Makes `self.sb` the superblock of this commit (roots, sizes, backup roots), not yet
    /// written.
    fn next_superblock(&mut self) -> Result<()> {
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
        let bytes_used = self.ctx.sb_bytes_used;
        let primary_item = self.primary_dev_item().clone();
        let sb = &mut self.sb;
        sb.generation = transid;
        sb.root = root.bytenr;
        sb.root_level = root.level;
        sb.chunk_root = chunk.bytenr;
        sb.chunk_root_level = chunk.level;
        sb.chunk_root_generation = chunk.generation;
        sb.bytes_used = bytes_used;
        // Any fsync log was replayed before this commit (tree_log).
        sb.log_root = 0;
        sb.log_root_level = 0;
        sb.dev_item = primary_item;
        sb.sys_chunk_array = self.sys_chunk_array.clone();
        sb.sys_chunk_array_size = self.sys_chunk_array.len() as u32;
        // Backup roots: the slot after the newest one.
        let (newest, newest_gen) =
            sb.backup_roots
                .iter()
                .enumerate()
                .fold((0, 0), |(i0, g0), (i, r)| {
                    if r.tree_root_gen > g0 {
                        (i, r.tree_root_gen)
                    } else {
                        (i0, g0)
                    }
                });
        let slot = if newest_gen == 0 { 0 } else { (newest + 1) % 4 };
        let (extent, fs, dev, csum) = (
            &roots[&EXTENT_TREE_OBJECTID],
            &roots[&FS_TREE_OBJECTID],
            &roots[&DEV_TREE_OBJECTID],
            &roots[&CSUM_TREE_OBJECTID],
        );
        sb.backup_roots[slot] = BackupRoot {
            tree_root: root.bytenr,
            tree_root_gen: transid,
            chunk_root: chunk.bytenr,
            chunk_root_gen: chunk.generation,
            extent_root: extent.bytenr,
            extent_root_gen: extent.generation,
            fs_root: fs.bytenr,
            fs_root_gen: fs.generation,
            dev_root: dev.bytenr,
            dev_root_gen: dev.generation,
            csum_root: csum.bytenr,
            csum_root_gen: csum.generation,
            total_bytes: sb.total_bytes,
            bytes_used,
            num_devices: sb.num_devices,
            tree_root_level: root.level,
            chunk_root_level: chunk.level,
            extent_root_level: extent.level,
            fs_root_level: fs.level,
            dev_root_level: dev.level,
            csum_root_level: csum.level,
        };
        Ok(())
    }

    /// Writes `self.sb` to every device.
    fn write_superblock_copies(&mut self) -> Result<()> {
        // A device added in this session first: until the others name it, a cut leaves it
        // a newer copy nobody opens with them; once they do, it is there.
        for (devid, dev, _) in &self.added {
            crate::io::super_io::write_all_device(
                dev.as_ref(),
                *devid,
                &self.dev_items,
                &self.sb,
                &self.sb_base,
                crate::io::super_io::Order::PrimaryFirst,
            )?;
        }
        crate::io::super_io::write_all_devices(
            &self.disk.devices,
            &self.dev_items,
            &self.sb,
            &self.sb_base,
            crate::io::super_io::Order::PrimaryFirst,
        )?;
        Ok(())
    }
}
