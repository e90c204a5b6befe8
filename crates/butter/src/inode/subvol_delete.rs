//! Deleting a subvolume or snapshot, and dropping its tree, as the kernel does.
//!
//! The delete ([`Core::delete_subvolume`]) unlinks the subvolume in one transaction: the
//! directory entry (DIR_ITEM and DIR_INDEX; the parent directory shrinks by twice the name
//! length), ROOT_REF and ROOT_BACKREF, the uuid tree entries of its uuid and received uuid; its
//! ROOT_ITEM gets refs 0 and the SUBVOL_DEAD flag, and an ORPHAN item (ORPHAN_OBJECTID,
//! ORPHAN_ITEM, id) in the root tree marks the tree for dropping. Refused: the top level, the
//! default subvolume, and a subvolume that has subvolumes of its own (a ROOT_REF from it).
//!
//! The drop then frees the dead tree over several transactions, each committed, without ever
//! changing the dead tree's blocks (so a drop cut off anywhere continues from the last commit):
//!
//! - a block only the dead tree references (extent refs 1) is walked into; once its children
//!   are done it is freed (a leaf first gives up its data extent references: keyed by root,
//!   inode and offset, or by the leaf when it has FULL_BACKREF);
//! - a block other trees reference too only loses the dead tree's reference (keyed by the
//!   parent block when the parent has FULL_BACKREF, else by the dead tree's id). When the
//!   block was made by the dead tree (its generation is newer than the tree's origin, the
//!   ROOT_ITEM key offset) its children are referenced through the dead tree's id: before
//!   the reference goes, every block of that subtree made by the dead tree gets full back
//!   references (children referenced by the parent block's address, FULL_BACKREF set), so
//!   the other trees keep valid references when the dead one is gone.
//!
//! Between transactions the ROOT_ITEM records where the walk goes on: `drop_progress`, the
//! key of the next pointer to handle in a node on the walk's path, and `drop_level`, that
//! node's level. Everything left of it at that level is freed; the nodes on the path to it
//! are still whole. The kernel records its progress the same way, so either continues the
//! other's drop. When the whole tree is gone, its ROOT_ITEM and ORPHAN item go.
//!
//! Every read-write open continues the drops left unfinished (butter's or the kernel's):
//! ORPHAN items in the root tree whose ROOT_ITEM has refs 0 ([`Core::drop_dead_trees`]).

use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::io::disk_io::{Expect, TreeBlock};
use crate::space::delayed_refs::RefKey;
use crate::transaction::Writer;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// ROOT_ITEM flag of a subvolume being deleted (the kernel sets it at the delete).
const ROOT_SUBVOL_DEAD: u64 = 1 << 48;
/// Byte offsets in a ROOT_ITEM body.
const RI_FLAGS: usize = 208;
const RI_REFS: usize = 216;
const RI_DROP_PROGRESS: usize = 220;
const RI_DROP_LEVEL: usize = 237;

/// Blocks one transaction of a drop handles (freed, or a reference dropped) before the drop
/// records its progress and commits.
static DROP_BATCH: AtomicUsize = AtomicUsize::new(512);

/// Sets how many blocks one transaction of a drop handles (tests use small batches to make a
/// drop span many commits). At least 1.
#[cfg(test)]
pub(crate) fn set_drop_batch(blocks: usize) {
    DROP_BATCH.store(blocks.max(1), Ordering::Relaxed);
}

fn drop_batch() -> usize {
    DROP_BATCH.load(Ordering::Relaxed).max(1)
}

fn root_item_loc(key: Key) -> Location {
    Location::what("root item")
        .with_tree(ROOT_TREE_OBJECTID)
        .with_key(key)
}

/// One node on the drop's path: the block, the slot of the next pointer to handle, and the
/// block's extent flags.
struct Step {
    blk: Arc<TreeBlock>,
    slot: usize,
    flags: u64,
}

/// What one transaction of a drop did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Batch {
    /// Progress recorded; more to do.
    More,
    /// The whole tree is freed, its ROOT_ITEM and ORPHAN item deleted.
    Done,
}

impl Core {
    /// Deletes the subvolume or snapshot linked as `dir/name` (see the module doc) and drops
    /// its tree, committing as it goes. Returns its id.
    pub(crate) fn delete_subvolume(&self, dir: Inode, name: &[u8]) -> Result<u64> {
        let id = self.unlink_subvolume(dir, name)?;
        self.drop_tree(id)?;
        Ok(id)
    }

    /// The delete's own transaction (committed): checks, unlinks, marks the tree dead.
    fn unlink_subvolume(&self, dir: Inode, name: &[u8]) -> Result<u64> {
        let shown = || String::from_utf8_lossy(name).into_owned();
        let dkey = Key::new(dir.ino, DIR_ITEM_KEY, hash::name_hash(name));
        let root = self.subvol_root(dir.root)?;
        let entry = crate::ctree::lookup(&self.disk, &root, &dkey)?
            .map(|it| DirItem::parse_all(it.data()).map_err(|e| it.annotate(e)))
            .transpose()?
            .and_then(|v| v.into_iter().find(|d| d.name == name))
            .ok_or_else(|| Error::NotFound(shown()))?;
        if entry.location.ty != ROOT_ITEM_KEY {
            return Err(Error::Invalid(format!(
                "{:?} in directory {} of subvolume {} is not a subvolume",
                shown(),
                dir.ino,
                dir.root
            )));
        }
        let id = entry.location.objectid;
        if id == FS_TREE_OBJECTID {
            return Err(Error::NotPermitted(
                "the top-level subvolume (5) cannot be deleted".into(),
            ));
        }
        if id == self.default_subvolume() {
            return Err(Error::NotPermitted(format!(
                "subvolume {id} ({:?}) is the default subvolume; make another one the default \
                 first (set-default)",
                shown()
            )));
        }
        // The entry must be the subvolume's link (a snapshot keeps stale entries of the
        // subvolumes nested in its source; those are no subvolume of their own here).
        let rr_key = Key::new(dir.root, ROOT_REF_KEY, id);
        let linked = crate::ctree::lookup(&self.disk, &self.tree_root(), &rr_key)?
            .map(|it| RootRef::parse(it.data()).map_err(|e| it.annotate(e)))
            .transpose()?;
        let rr = match linked {
            Some(rr) if rr.dirid == dir.ino && rr.name == name => rr,
            _ => {
                return Err(Error::Invalid(format!(
                    "{:?} in directory {} of subvolume {} names subvolume {id}, which is not \
                     linked there (no ROOT_REF): a stale entry copied by a snapshot",
                    shown(),
                    dir.ino,
                    dir.root
                )))
            }
        };
        if let Some(child) = self.first_child_subvolume(id)? {
            return Err(Error::NotEmpty(format!(
                "subvolume {id} ({:?}) holds subvolume {child}; delete that first",
                shown()
            )));
        }
        self.require_dir_changeable(dir, false)?;
        // Everything the running transaction did to the subvolume is committed first: the
        // drop reads the tree as its ROOT_ITEM names it.
        self.commit()?;
        let item = self.subvol_item(id)?;
        self.op(false, |w| {
            self.unlink_subvol(w, dir, name, rr.sequence)?;
            w.delete_item(ROOT_TREE_OBJECTID, &rr_key)?;
            w.delete_item(
                ROOT_TREE_OBJECTID,
                &Key::new(id, ROOT_BACKREF_KEY, dir.root),
            )?;
            self.uuid_tree_remove(w, &item.uuid, UUID_KEY_SUBVOL, id)?;
            if item.received_uuid != [0; 16] {
                self.uuid_tree_remove(w, &item.received_uuid, UUID_KEY_RECEIVED_SUBVOL, id)?;
            }
            let key = self.root_item_key(w, id)?;
            w.update_item(ROOT_TREE_OBJECTID, &key, |b| {
                if b.len() < RootItem::LEGACY_SIZE {
                    return Err(Error::corrupt(
                        root_item_loc(key),
                        format!("{} bytes, too short for a root item", b.len()),
                    ));
                }
                b[RI_REFS..RI_REFS + 4].copy_from_slice(&0u32.to_le_bytes());
                let mut f = [0u8; 8];
                f.copy_from_slice(&b[RI_FLAGS..RI_FLAGS + 8]);
                let flags = u64::from_le_bytes(f) | ROOT_SUBVOL_DEAD;
                b[RI_FLAGS..RI_FLAGS + 8].copy_from_slice(&flags.to_le_bytes());
                Ok(())
            })?;
            w.insert_item(
                ROOT_TREE_OBJECTID,
                Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, id),
                &[],
            )?;
            Ok(())
        })?;
        self.forget_subvol(id);
        self.commit()?;
        Ok(id)
    }

    /// [`Core::delete_subvolume`] of subvolume `id`, wherever it is linked (its ROOT_BACKREF
    /// names the directory and the name).
    pub(crate) fn delete_subvolume_by_id(&self, id: u64) -> Result<()> {
        if id == FS_TREE_OBJECTID {
            return Err(Error::NotPermitted(
                "the top-level subvolume (5) cannot be deleted".into(),
            ));
        }
        if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
            return Err(Error::Invalid(format!("{id} is not a subvolume id")));
        }
        let it = crate::ctree::lookup_le(
            &self.disk,
            &self.tree_root(),
            &Key::new(id, ROOT_BACKREF_KEY, u64::MAX),
        )?;
        let (parent, rr) = match it {
            Some(it) if it.key.objectid == id && it.key.ty == ROOT_BACKREF_KEY => (
                it.key.offset,
                RootRef::parse(it.data()).map_err(|e| it.annotate(e))?,
            ),
            _ => {
                return Err(Error::NotFound(format!(
                    "subvolume {id} (it is linked nowhere: no ROOT_BACKREF)"
                )))
            }
        };
        self.delete_subvolume(
            Inode {
                root: parent,
                ino: rr.dirid,
            },
            &rr.name,
        )?;
        Ok(())
    }

    /// A subvolume linked inside subvolume `id` (a ROOT_REF from it), if any.
    fn first_child_subvolume(&self, id: u64) -> Result<Option<u64>> {
        let it = crate::ctree::lookup_le(
            &self.disk,
            &self.tree_root(),
            &Key::new(id, ROOT_REF_KEY, u64::MAX),
        )?;
        Ok(match it {
            Some(it) if it.key.objectid == id && it.key.ty == ROOT_REF_KEY => Some(it.key.offset),
            _ => None,
        })
    }

    /// Removes the entry `name` (a subvolume, DIR_INDEX `index`) from `dir` and shrinks the
    /// directory, as the kernel's unlink of a subvolume does.
    fn unlink_subvol(&self, w: &mut Writer, dir: Inode, name: &[u8], index: u64) -> Result<()> {
        let shown = || String::from_utf8_lossy(name).into_owned();
        let dkey = Key::new(dir.ino, DIR_ITEM_KEY, hash::name_hash(name));
        let body = w
            .read_item(dir.root, &dkey)?
            .ok_or_else(|| Error::NotFound(shown()))?;
        let entries = DirItem::parse_all(&body)?;
        let pos = entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| Error::NotFound(shown()))?;
        crate::inode::namespace::rewrite_without(w, dir.root, dkey, &entries, pos, DirItem::write)?;
        let ikey = Key::new(dir.ino, DIR_INDEX_KEY, index);
        if !w.delete_item(dir.root, &ikey)? {
            return Err(Error::corrupt(
                Location::what(format!("directory {} entry {:?}", dir.ino, shown()))
                    .with_tree(dir.root)
                    .with_key(ikey),
                "the ROOT_REF names a DIR_INDEX the directory does not have",
            ));
        }
        let mut d = self.inode_item(dir)?;
        d.size = d.size.saturating_sub(2 * name.len() as u64);
        Self::touch(w, &mut d, true);
        self.write_inode(w, dir, &d)
    }

    /// Continues every drop left unfinished (ORPHAN items in the root tree naming a ROOT_ITEM
    /// with refs 0), butter's or the kernel's. Returns how many trees were dropped.
    pub(crate) fn drop_dead_trees(&self) -> Result<usize> {
        let mut it = crate::ctree::TreeIter::new(
            self.disk.clone(),
            self.tree_root(),
            Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, 0),
            crate::io::disk_io::Readahead::None,
        )?;
        let mut ids = Vec::new();
        while let Some(i) = it.next_item()? {
            if i.key.objectid != ORPHAN_OBJECTID || i.key.ty != ORPHAN_ITEM_KEY {
                break;
            }
            ids.push(i.key.offset);
        }
        let mut dropped = 0;
        for id in ids {
            if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
                continue;
            }
            match self.find_root_item(id)? {
                Some(ri) if ri.refs == 0 => {
                    self.drop_tree(id)?;
                    dropped += 1;
                }
                _ => {}
            }
        }
        Ok(dropped)
    }

    /// Drops dead tree `id` (refs 0) to the end, one committed transaction per batch.
    fn drop_tree(&self, id: u64) -> Result<()> {
        let batch = drop_batch();
        loop {
            let r = self.op(false, |w| self.drop_some(w, id, batch))?;
            self.commit()?;
            if r == Batch::Done {
                break;
            }
        }
        self.forget_subvol(id);
        Ok(())
    }

    /// One transaction's part of the drop of tree `id`: continues from the ROOT_ITEM's drop
    /// progress, handles about `budget` blocks, and records where it stopped (or deletes the
    /// ROOT_ITEM and the ORPHAN item when the tree is gone).
    fn drop_some(&self, w: &mut Writer, id: u64, budget: usize) -> Result<Batch> {
        let tree_root = w.current_root(ROOT_TREE_OBJECTID)?;
        let found = crate::ctree::lookup_le(
            &self.disk,
            &tree_root,
            &Key::new(id, ROOT_ITEM_KEY, u64::MAX),
        )?;
        let (item_key, ri) = match found {
            Some(it) if it.key.objectid == id && it.key.ty == ROOT_ITEM_KEY => (
                it.key,
                RootItem::parse(it.data()).map_err(|e| it.annotate(e))?,
            ),
            _ => return Err(Error::NotFound(format!("root item of dead tree {id}"))),
        };
        if ri.refs != 0 {
            return Err(Error::Internal(format!(
                "dropping tree {id}, whose root item still has {} references",
                ri.refs
            )));
        }
        // Blocks newer than this were made by the dead tree (older ones come from the tree it
        // is a snapshot of).
        let origin = item_key.offset;
        let ns = self.disk.nodesize() as u64;
        let root = self.disk.read_tree_block(
            ri.bytenr,
            &Expect {
                level: Some(ri.level),
                generation: Some(ri.generation),
                ..Default::default()
            },
        )?;
        let (_, root_flags) = w.extent_refs_and_flags(root.bytenr, root.level())?;
        let root_ref = if root_flags & BLOCK_FLAG_FULL_BACKREF != 0 {
            RefKey::SharedBlock(root.bytenr)
        } else {
            RefKey::TreeBlock(id)
        };
        if root.is_leaf() {
            // A one-leaf tree goes in one step.
            w.change_child_refs(id, &root, root_flags & BLOCK_FLAG_FULL_BACKREF != 0, -1)?;
            free_block(w, &root, root_ref);
            return self.finish_drop(w, id, item_key);
        }
        let resumed = ri.drop_progress.objectid != 0 || ri.drop_level != 0;
        let mut path = self.drop_path(w, id, &root, root_flags, &ri, item_key)?;
        let mut done = 0usize;
        // Continuing a recorded drop, the first block's reference from the dead tree may be
        // gone already (a kernel that stopped while it gave full back references below a
        // shared block records its progress from before that block): the block is left alone
        // when the reference is not there.
        let mut check_first = resumed;
        loop {
            let Some(top) = path.last() else {
                return self.finish_drop(w, id, item_key);
            };
            let node = top.blk.clone();
            let slot = top.slot;
            let node_full = top.flags & BLOCK_FLAG_FULL_BACKREF != 0;
            let via_node = if node_full {
                RefKey::SharedBlock(node.bytenr)
            } else {
                RefKey::TreeBlock(id)
            };
            if slot >= node.nritems() {
                // Every child handled: the node goes.
                path.pop();
                let r = match path.last() {
                    Some(p) if p.flags & BLOCK_FLAG_FULL_BACKREF != 0 => {
                        RefKey::SharedBlock(p.blk.bytenr)
                    }
                    Some(_) => RefKey::TreeBlock(id),
                    None => root_ref,
                };
                free_block(w, &node, r);
                done += 1;
                if let Some(p) = path.last_mut() {
                    p.slot += 1;
                }
                continue;
            }
            if done >= budget {
                let at = node.key(slot);
                let level = node.level();
                w.update_item(ROOT_TREE_OBJECTID, &item_key, |b| {
                    if b.len() < RootItem::LEGACY_SIZE {
                        return Err(Error::corrupt(
                            root_item_loc(item_key),
                            format!("{} bytes, too short for a root item", b.len()),
                        ));
                    }
                    b[RI_DROP_PROGRESS..RI_DROP_PROGRESS + 17].copy_from_slice(&at.to_bytes());
                    b[RI_DROP_LEVEL] = level;
                    Ok(())
                })?;
                return Ok(Batch::More);
            }
            let p = node.ptr(slot);
            let child_level = node.level() - 1;
            let (refs, flags) = w.extent_refs_and_flags(p.blockptr, child_level)?;
            if refs == 0 {
                return Err(Error::corrupt(
                    node.loc(Some(slot)).with_tree(id),
                    format!("child block {} has no references left", p.blockptr),
                ));
            }
            if check_first {
                check_first = false;
                if !has_ref(w, p.blockptr, via_node)? {
                    log::info!(
                        "dropping tree {id}: block {} no longer has its reference {via_node:?} \
                         (dropped before the drop was cut off); skipped",
                        p.blockptr
                    );
                    done += 1;
                    if let Some(t) = path.last_mut() {
                        t.slot += 1;
                    }
                    continue;
                }
            }
            let expect = Expect {
                level: Some(child_level),
                generation: Some(p.generation),
                first_key: Some(p.key),
                ..Default::default()
            };
            if refs > 1 {
                // Shared: only this tree's reference goes, after the blocks this tree made
                // below it get full back references.
                let leaf_full = child_level == 0 && flags & BLOCK_FLAG_FULL_BACKREF != 0;
                if p.generation > origin && !leaf_full {
                    done += self.share_subtree(w, id, origin, p.blockptr, &expect)?;
                }
                w.refs
                    .add_tree_ref(p.blockptr, ns, child_level, p.key, false, via_node, -1);
                done += 1;
                if let Some(t) = path.last_mut() {
                    t.slot += 1;
                }
                continue;
            }
            let child = self.disk.read_tree_block(p.blockptr, &expect)?;
            if child.is_leaf() {
                w.change_child_refs(id, &child, flags & BLOCK_FLAG_FULL_BACKREF != 0, -1)?;
                free_block(w, &child, via_node);
                done += 1;
                if let Some(t) = path.last_mut() {
                    t.slot += 1;
                }
                continue;
            }
            path.push(Step {
                blk: child,
                slot: 0,
                flags,
            });
        }
    }

    /// The drop's path from the root to where it goes on: the root at slot 0 when it has not
    /// started, else down to the node at `drop_level` whose pointer has key `drop_progress`.
    fn drop_path(
        &self,
        w: &mut Writer,
        id: u64,
        root: &Arc<TreeBlock>,
        root_flags: u64,
        ri: &RootItem,
        item_key: Key,
    ) -> Result<Vec<Step>> {
        if ri.drop_progress.objectid == 0 && ri.drop_level == 0 {
            return Ok(vec![Step {
                blk: root.clone(),
                slot: 0,
                flags: root_flags,
            }]);
        }
        let target = ri.drop_level;
        if target == 0 || target > root.level() {
            return Err(Error::corrupt(
                root_item_loc(item_key),
                format!(
                    "drop level {target} is not a node level of tree {id} (root level {})",
                    root.level()
                ),
            ));
        }
        let at = ri.drop_progress;
        let mut path = Vec::new();
        let mut blk = root.clone();
        let mut flags = root_flags;
        loop {
            let slot = crate::ctree::node_slot(&blk, &at);
            if blk.level() == target {
                if slot >= blk.nritems() || blk.key(slot) != at {
                    return Err(Error::corrupt(
                        root_item_loc(item_key),
                        format!(
                            "drop progress {at} at level {target} is no pointer of block {}",
                            blk.bytenr
                        ),
                    ));
                }
                path.push(Step { blk, slot, flags });
                return Ok(path);
            }
            let p = blk.ptr(slot);
            let level = blk.level() - 1;
            let child = self.disk.read_tree_block(
                p.blockptr,
                &Expect {
                    level: Some(level),
                    generation: Some(p.generation),
                    first_key: Some(p.key),
                    ..Default::default()
                },
            )?;
            path.push(Step { blk, slot, flags });
            let (refs, f) = w.extent_refs_and_flags(child.bytenr, level)?;
            if refs != 1 {
                return Err(Error::corrupt(
                    Location::block(Some(id), child.bytenr),
                    format!(
                        "block on the path of an unfinished drop has {refs} references, \
                         expected 1"
                    ),
                ));
            }
            blk = child;
            flags = f;
        }
    }

    /// Gives every block that dead tree `id` made (generation newer than `origin`) in the
    /// subtree at `bytenr` full back references: its children referenced by its address
    /// instead of the tree's id, FULL_BACKREF set (blocks that have it are left as they are).
    /// Returns how many blocks it looked at.
    fn share_subtree(
        &self,
        w: &mut Writer,
        id: u64,
        origin: u64,
        bytenr: u64,
        expect: &Expect,
    ) -> Result<usize> {
        let blk = self.disk.read_tree_block(bytenr, expect)?;
        if blk.owner() != id {
            return Ok(1);
        }
        let (_, flags) = w.extent_refs_and_flags(bytenr, blk.level())?;
        if flags & BLOCK_FLAG_FULL_BACKREF == 0 {
            w.change_child_refs(id, &blk, true, 1)?;
            w.change_child_refs(id, &blk, false, -1)?;
            w.refs.set_flags(
                bytenr,
                self.disk.nodesize() as u64,
                blk.level(),
                BLOCK_FLAG_FULL_BACKREF,
            );
        }
        let mut seen = 1;
        if blk.is_leaf() {
            return Ok(seen);
        }
        let level = blk.level() - 1;
        for slot in 0..blk.nritems() {
            let p = blk.ptr(slot);
            if p.generation <= origin {
                continue;
            }
            if level == 0 {
                let (_, f) = w.extent_refs_and_flags(p.blockptr, 0)?;
                if f & BLOCK_FLAG_FULL_BACKREF != 0 {
                    continue;
                }
            }
            seen += self.share_subtree(
                w,
                id,
                origin,
                p.blockptr,
                &Expect {
                    level: Some(level),
                    generation: Some(p.generation),
                    first_key: Some(p.key),
                    ..Default::default()
                },
            )?;
        }
        Ok(seen)
    }

    /// The dead tree is freed: its ROOT_ITEM and ORPHAN item go, and the write engine
    /// forgets it.
    fn finish_drop(&self, w: &mut Writer, id: u64, item_key: Key) -> Result<Batch> {
        w.delete_item(ROOT_TREE_OBJECTID, &item_key)?;
        w.delete_item(
            ROOT_TREE_OBJECTID,
            &Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, id),
        )?;
        w.trees.remove(&id);
        w.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        self.forget_subvol(id);
        Ok(Batch::Done)
    }
}

/// Whether tree block `bytenr` has back reference `r` (on disk, with what is queued).
fn has_ref(w: &mut Writer, bytenr: u64, r: RefKey) -> Result<bool> {
    let queued = w
        .refs
        .map
        .get(&bytenr)
        .and_then(|p| p.deltas.get(&r).copied())
        .unwrap_or(0);
    let root = w.current_root(EXTENT_TREE_OBJECTID)?;
    let on_disk = crate::ctree::extent_record::read_extent_record(&w.disk, root, bytenr)?
        .and_then(|rec| rec.refs.get(&r).copied())
        .unwrap_or(0);
    Ok(on_disk as i64 + queued > 0)
}

/// Drops reference `r` (its parent's, or the root item's) to tree block `blk`.
fn free_block(w: &mut Writer, blk: &TreeBlock, r: RefKey) {
    let first = if blk.nritems() > 0 {
        blk.key(0)
    } else {
        Key::MIN
    };
    let ns = w.disk.nodesize() as u64;
    w.refs
        .add_tree_ref(blk.bytenr, ns, blk.level(), first, false, r, -1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::Fs;
    use crate::inode::namespace::Owner;
    use crate::internals::RamDevice;

    /// A drop continued from recorded progress whose next shared block already lost the dead
    /// tree's reference (as a kernel cut off while giving full back references leaves it):
    /// the reference is not dropped twice, and the result checks clean.
    #[test]
    fn resume_skips_a_reference_already_dropped() {
        let size = 128u64 << 20;
        let dev = Arc::new(RamDevice::new(vec![0u8; size as usize]));
        let opts = crate::mkfs::MkfsOptions {
            size,
            nodesize: 4096,
            fsid: Some(*b"butter-droptest2"),
            time: Some(1_700_000_000),
            ..Default::default()
        };
        crate::mkfs::mkfs(&*dev, &opts).unwrap();
        let fs = Fs::open_device_rw(dev.clone()).unwrap();
        let root = fs.root_inode();
        let sv = fs
            .create_subvolume(root, b"sv", 0o755, Owner::default(), None)
            .unwrap();
        for i in 0..600u64 {
            let f = fs
                .create(sv, format!("f{i}").as_bytes(), 0o644, Owner::default())
                .unwrap();
            fs.write(f, 0, &[i as u8; 300]).unwrap();
        }
        fs.commit().unwrap();
        fs.create_snapshot(sv.root, root, b"snap", false, None)
            .unwrap();
        fs.commit().unwrap();
        let id = fs.core().unlink_subvolume(root, b"snap").unwrap();
        let mut dropped_early = None;
        for _ in 0..200 {
            let r = fs
                .core()
                .op(false, |w| fs.core().drop_some(w, id, 1))
                .unwrap();
            fs.commit().unwrap();
            assert_eq!(r, Batch::More, "the drop ended before a shared block came");
            // The next pointer the drop handles: a shared block? Drop its reference now.
            let found = fs
                .core()
                .op(false, |w| {
                    let ri = fs.find_root_item(id)?.unwrap();
                    let mut blk = fs.disk().read_tree_block(ri.bytenr, &Expect::default())?;
                    let mut flags = w.extent_refs_and_flags(blk.bytenr, blk.level())?.1;
                    loop {
                        let slot = crate::ctree::node_slot(&blk, &ri.drop_progress);
                        let p = blk.ptr(slot);
                        if blk.level() == ri.drop_level {
                            let (refs, _) = w.extent_refs_and_flags(p.blockptr, blk.level() - 1)?;
                            if refs < 2 {
                                return Ok(None);
                            }
                            let r = if flags & BLOCK_FLAG_FULL_BACKREF != 0 {
                                RefKey::SharedBlock(blk.bytenr)
                            } else {
                                RefKey::TreeBlock(id)
                            };
                            let ns = fs.disk().nodesize() as u64;
                            w.refs.add_tree_ref(
                                p.blockptr,
                                ns,
                                blk.level() - 1,
                                p.key,
                                false,
                                r,
                                -1,
                            );
                            return Ok(Some(p.blockptr));
                        }
                        blk = fs.disk().read_tree_block(p.blockptr, &Expect::default())?;
                        flags = w.extent_refs_and_flags(blk.bytenr, blk.level())?.1;
                    }
                })
                .unwrap();
            if found.is_some() {
                fs.commit().unwrap();
                dropped_early = found;
                break;
            }
        }
        assert!(dropped_early.is_some(), "no shared block met");
        fs.core().drop_tree(id).unwrap();
        drop(fs);
        let fs = Fs::open_device(Arc::new(RamDevice::new(dev.live_bytes()))).unwrap();
        assert!(fs.find_root_item(id).unwrap().is_none());
        let r = fs.check(Default::default(), &mut |_| {}).unwrap();
        assert!(r.is_clean(), "{:?}", r.findings);
    }
}
