//! The COW B-tree: searching with intent to change, COW of the blocks on the path (with the
//! reference updates shared blocks need), item insert / delete / extend / truncate, leaf and node
//! split, merge, and tree growth and shrink.
//!
//! Blocks changed by the running transaction live in the [`Disk`](crate::io::disk_io::Disk)
//! overlay, so readers see them. A block is COWed at most once per transaction: a block whose
//! generation is the running transaction's id and that sits in the overlay is changed in place.
//!
//! Structure changes restart the descent: a search that has to split a node or a leaf, or merge
//! an underfull node, does so and descends again from the root. `CowCtx::descents` counts the
//! descents so benchmarks can show what one operation cost.
//!
//! Everything here works on the [`CowCtx`] the transaction lends (crate::ctree::cow_ctx), never on the
//! transaction itself.

use crate::ctree::cow_ctx::CowCtx;
use crate::ctree::ops::{self as ctree_ops, Growth, LeafMut, LeafSplit, NewHeader, NodeMut};
use crate::ctree::{leaf_slot, node_slot};
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::{Expect, TreeBlock};
use crate::space::delayed_refs::RefKey;
use std::sync::Arc;

/// What a search intends to do at the leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Intent {
    /// Only read, but COW the path (to change an item in place).
    Modify,
    /// Insert `items` items with `data_len` bytes of data in total at the key's slot.
    Insert { items: usize, data_len: usize },
    /// Grow the item at the key by `extra` bytes.
    Extend { extra: usize },
    /// Delete items: nodes on the way are kept from getting too empty.
    Delete,
}

/// A path from the root to a leaf: per level (0 = leaf) the block address and slot.
#[derive(Debug, Clone, Default)]
pub(crate) struct WPath {
    pub nodes: Vec<(u64, usize)>,
    /// The key was found at the leaf slot.
    pub found: bool,
}

impl WPath {
    pub(crate) fn leaf(&self) -> u64 {
        self.nodes[0].0
    }
    pub(crate) fn slot(&self) -> usize {
        self.nodes[0].1
    }
}

fn leaf_used(b: &TreeBlock) -> usize {
    b.data.len() - HEADER_SIZE - b.leaf_free_space()
}

impl CowCtx {
    /// A block by address: the overlay's copy, or read and validated from disk.
    pub(crate) fn block(&self, bytenr: u64, expect: &Expect) -> Result<Arc<TreeBlock>> {
        // A block of this transaction may be briefly empty (the middle leaf of a double split
        // before its item goes in); it is ours, so no parent expectations apply.
        if let Some(b) = self.disk.overlay_get(bytenr) {
            return Ok(b);
        }
        self.disk.read_tree_block(bytenr, expect)
    }

    /// A block of the running transaction (must be in the overlay).
    pub(crate) fn dirty_block(&self, bytenr: u64) -> Result<Arc<TreeBlock>> {
        self.disk.overlay_get(bytenr).ok_or_else(|| {
            Error::Internal(format!(
                "block {bytenr} was expected to be COWed in this transaction"
            ))
        })
    }

    /// Changes a block of the running transaction.
    pub(crate) fn modify<R>(
        &self,
        bytenr: u64,
        f: impl FnOnce(&mut [u8]) -> Result<R>,
    ) -> Result<R> {
        self.disk.overlay_modify(bytenr, f).ok_or_else(|| {
            Error::Internal(format!(
                "changing block {bytenr}, which is not COWed in this transaction"
            ))
        })?
    }

    fn child_expect(parent: &TreeBlock, slot: usize) -> Expect {
        let p = parent.ptr(slot);
        Expect {
            owner: None,
            level: Some(parent.level() - 1),
            generation: Some(p.generation),
            first_key: Some(p.key),
        }
    }

    pub(crate) fn header_for(&self, tree: u64, bytenr: u64) -> NewHeader {
        NewHeader {
            bytenr,
            owner: tree,
            generation: self.transid,
            fsid: self.disk.sb.metadata_fsid(),
            chunk_tree_uuid: self.chunk_tree_uuid,
            flags: 0,
            backref_rev: MIXED_BACKREF_REV as u8,
        }
    }

    /// Allocates and initializes an empty block for `tree` at `level`, with its extent
    /// reference queued. `first_key` is recorded in a non-skinny extent item.
    pub(crate) fn new_block(&mut self, tree: u64, level: u8, first_key: Key) -> Result<u64> {
        let bytenr = self.alloc_tree_block(tree)?;
        let ns = self.disk.nodesize() as usize;
        let mut data = vec![0u8; ns].into_boxed_slice();
        ctree_ops::init_empty(&mut data, level, &self.header_for(tree, bytenr))?;
        self.disk
            .overlay_put(Arc::new(TreeBlock::from_parts(bytenr, data)));
        self.refs
            .add_tree_ref(bytenr, ns as u64, level, first_key, true, tree_ref(tree), 1);
        Ok(bytenr)
    }

    /// Frees a block this transaction created (it is unreferenced now).
    fn free_dirty_block(&mut self, tree: u64, bytenr: u64) -> Result<()> {
        let b = self.dirty_block(bytenr)?;
        let key = if b.nritems() > 0 { b.key(0) } else { Key::MIN };
        self.disk.overlay_remove(bytenr);
        self.refs.add_tree_ref(
            bytenr,
            self.disk.nodesize() as u64,
            b.level(),
            key,
            false,
            tree_ref(tree),
            -1,
        );
        Ok(())
    }

    /// COWs `blk` (a block of `tree` reached from `parent` slot, or the root) unless this
    /// transaction did already. Returns the block's address afterwards.
    fn cow(&mut self, tree: u64, blk: Arc<TreeBlock>, parent: Option<(u64, usize)>) -> Result<u64> {
        if blk.header.generation == self.transid && self.disk.overlay_get(blk.bytenr).is_some() {
            return Ok(blk.bytenr);
        }
        if blk.header.generation > self.transid && !self.copy_future_blocks {
            return Err(Error::corrupt(
                blk.loc(None),
                format!(
                    "generation {} is newer than the running transaction {}",
                    blk.header.generation, self.transid
                ),
            ));
        }
        let new = self.alloc_tree_block(tree)?;
        let mut data = blk.data.clone();
        ctree_ops::set_bytenr(&mut data, new)?;
        ctree_ops::set_generation(&mut data, self.transid)?;
        ctree_ops::set_owner(&mut data, tree)?;
        let flags = blk.header.flags & !(HEADER_FLAG_WRITTEN | HEADER_FLAG_RELOC);
        ctree_ops::set_flags(&mut data, flags)?;
        ctree_ops::set_backref_rev(&mut data, MIXED_BACKREF_REV as u8)?;
        let first = if blk.nritems() > 0 {
            blk.key(0)
        } else {
            Key::MIN
        };
        let cow_blk = TreeBlock::from_parts(new, data);
        self.update_refs_for_cow(tree, &blk, &cow_blk)?;
        self.disk.overlay_put(Arc::new(cow_blk));
        let ns = self.disk.nodesize() as u64;
        self.refs
            .add_tree_ref(new, ns, blk.level(), first, true, tree_ref(tree), 1);
        // The old block loses this tree's reference.
        self.refs.add_tree_ref(
            blk.bytenr,
            ns,
            blk.level(),
            first,
            false,
            tree_ref(tree),
            -1,
        );
        match parent {
            Some((p, slot)) => {
                self.modify(p, |buf| {
                    NodeMut::trusted(buf)?.set_ptr(slot, new, self.transid)
                })?;
            }
            None => self.set_root(tree, new, blk.level())?,
        }
        Ok(new)
    }

    /// Reference bookkeeping for COWing `buf` of `tree` into `cow` (the snapshot-aware rules:
    /// a shared block hands its children full back references or gives the new copy its own).
    fn update_refs_for_cow(&mut self, tree: u64, buf: &TreeBlock, cow: &TreeBlock) -> Result<()> {
        let ts = self.tree_state(tree)?;
        let shareable = ts.shareable;
        let last_snapshot = ts.last_snapshot;
        let is_root = ts.bytenr == buf.bytenr;
        let (refs, flags) = if shareable && !is_root && buf.header.generation <= last_snapshot {
            self.extent_refs_and_flags(buf.bytenr, buf.level())?
        } else {
            (1, 0)
        };
        let owner = buf.header.owner;
        if refs > 1 {
            if owner == tree && flags & BLOCK_FLAG_FULL_BACKREF == 0 {
                // The other sharers reach the children through `buf`: give them full refs.
                self.change_child_refs(tree, buf, true, 1)?;
                self.refs.set_flags(
                    buf.bytenr,
                    self.disk.nodesize() as u64,
                    buf.level(),
                    BLOCK_FLAG_FULL_BACKREF,
                );
            } else {
                // The copy is this tree's own path to the children.
                self.change_child_refs(tree, cow, false, 1)?;
            }
        } else if flags & BLOCK_FLAG_FULL_BACKREF != 0 {
            self.change_child_refs(tree, cow, false, 1)?;
            self.change_child_refs(tree, buf, true, -1)?;
        }
        Ok(())
    }

    /// Adds (`delta` 1) or drops (-1) one reference from `blk` to each thing it points at:
    /// child blocks (nodes) or data extents (leaves). `full` uses the block's address (shared
    /// refs); otherwise the tree's id.
    pub(crate) fn change_child_refs(
        &mut self,
        tree: u64,
        blk: &TreeBlock,
        full: bool,
        delta: i64,
    ) -> Result<()> {
        let ns = self.disk.nodesize() as u64;
        if blk.level() > 0 {
            for slot in 0..blk.nritems() {
                let p = blk.ptr(slot);
                let r = if full {
                    RefKey::SharedBlock(blk.bytenr)
                } else {
                    tree_ref(tree)
                };
                self.refs
                    .add_tree_ref(p.blockptr, ns, blk.level() - 1, p.key, false, r, delta);
            }
            return Ok(());
        }
        for slot in 0..blk.nritems() {
            let key = blk.key(slot);
            if key.ty != EXTENT_DATA_KEY {
                continue;
            }
            let fe = FileExtentItem::parse(blk.item_data(slot))
                .map_err(|e| e.in_block(Some(tree), blk.bytenr))?;
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
                let r = if full {
                    RefKey::SharedData(blk.bytenr)
                } else {
                    RefKey::Data {
                        root: tree,
                        ino: key.objectid,
                        offset: key.offset.wrapping_sub(offset),
                    }
                };
                self.refs
                    .add_data_ref(disk_bytenr, disk_num_bytes, false, r, delta);
            }
        }
        Ok(())
    }

    /// COWs the root block of `tree` and returns its address.
    fn cow_root(&mut self, tree: u64) -> Result<(u64, u8)> {
        let ts = self.tree_state(tree)?;
        let (bytenr, level, gen) = (ts.bytenr, ts.level, ts.generation);
        let expect = Expect {
            owner: None,
            level: Some(level),
            generation: if gen == self.transid { None } else { Some(gen) },
            first_key: None,
        };
        let blk = self.block(bytenr, &expect)?;
        let new = self.cow(tree, blk, None)?;
        Ok((new, level))
    }

    /// Descends from the root of `tree` to the leaf where `key` is or would be, COWing every
    /// block on the way and making room for `intent`.
    pub(crate) fn search_mut(&mut self, tree: u64, key: &Key, intent: Intent) -> Result<WPath> {
        let ns = self.disk.nodesize() as usize;
        let max_ptrs = ctree_ops::max_node_ptrs(ns);
        let mut restarts = 0;
        'restart: loop {
            self.descents += 1;
            restarts += 1;
            if restarts > 64 {
                return Err(Error::Internal(format!(
                    "search in tree {tree} for {key} keeps restarting"
                )));
            }
            let (root, root_level) = self.cow_root(tree)?;
            let mut path = WPath {
                nodes: vec![(0, 0); root_level as usize + 1],
                found: false,
            };
            let mut bytenr = root;
            let mut level = root_level;
            loop {
                let blk = self.dirty_block(bytenr)?;
                if level > 0 {
                    let n = blk.nritems();
                    if n == 0 {
                        return Err(Error::corrupt(blk.loc(None), "node without pointers"));
                    }
                    let grows = matches!(intent, Intent::Insert { .. } | Intent::Extend { .. });
                    if grows && n + 3 >= max_ptrs {
                        self.split_node(tree, &path, level, bytenr)?;
                        continue 'restart;
                    }
                    if intent == Intent::Delete && level == root_level && n == 1 {
                        self.shrink_root(tree, bytenr)?;
                        continue 'restart;
                    }
                    if intent == Intent::Delete
                        && level < root_level
                        && n < max_ptrs / 4
                        && self.balance_node(tree, &path, level, bytenr)?
                    {
                        continue 'restart;
                    }
                    let slot = node_slot(&blk, key);
                    path.nodes[level as usize] = (bytenr, slot);
                    let child =
                        self.block(blk.ptr(slot).blockptr, &Self::child_expect(&blk, slot))?;
                    bytenr = self.cow(tree, child, Some((bytenr, slot)))?;
                    level -= 1;
                    continue;
                }
                let (found, slot) = leaf_slot(&blk, key);
                path.nodes[0] = (bytenr, slot);
                path.found = found;
                let growth = match intent {
                    Intent::Insert { items, data_len } => Some(Growth::Insert { items, data_len }),
                    Intent::Extend { extra } if found => Some(Growth::Extend { extra }),
                    _ => None,
                };
                // Room in the leaf already: no split to plan (and no copy of the leaf for it).
                let fits = match growth {
                    Some(Growth::Insert { items, data_len }) => items
                        .checked_mul(ITEM_SIZE)
                        .and_then(|r| r.checked_add(data_len))
                        .is_some_and(|need| need <= blk.leaf_free_space()),
                    Some(Growth::Extend { extra }) => extra <= blk.leaf_free_space(),
                    None => true,
                };
                if let (Some(g), false) = (growth, fits) {
                    if let Growth::Insert { items, data_len } = g {
                        let need = items * ITEM_SIZE + data_len;
                        if self.push_for_room(tree, &path, bytenr, slot, need)? {
                            continue 'restart;
                        }
                    }
                    let plan = {
                        let mut buf = blk.data.to_vec();
                        LeafMut::trusted(&mut buf)?.plan_split(slot, g)?
                    };
                    if plan != LeafSplit::NotNeeded {
                        self.split_leaf(tree, &path, bytenr, plan, *key)?;
                        continue 'restart;
                    }
                }
                return Ok(path);
            }
        }
    }

    /// Makes room for an insert of `need` bytes at `slot` of the full leaf `leaf` by moving
    /// items into a sibling under the same parent that has room, before any split (as btrfs
    /// pushes leaves left and right): where inserts land in the middle of a tree (a
    /// directory's entries, by name hash) leaves stay full instead of being split in halves.
    /// As many items move as the sibling takes while the leaf the new item lands in keeps
    /// room for it. True when items moved (the caller searches again).
    fn push_for_room(
        &mut self,
        tree: u64,
        path: &WPath,
        leaf: u64,
        slot: usize,
        need: usize,
    ) -> Result<bool> {
        if path.nodes.len() < 2 {
            return Ok(false);
        }
        let (parent, pslot) = path.nodes[1];
        let pblk = self.dirty_block(parent)?;
        let lblk = self.dirty_block(leaf)?;
        let n = lblk.nritems();
        if n < 2 {
            return Ok(false);
        }
        let sizes: Vec<usize> = (0..n)
            .map(|i| lblk.item(i).size as usize + ITEM_SIZE)
            .collect();
        let lfree = lblk.leaf_free_space();
        // Left first, then right: the sibling's slot in the parent, and whether it is the left.
        let sides = [(pslot.checked_sub(1), true), (Some(pslot + 1), false)];
        for (sib_slot, left) in sides {
            let Some(sib_slot) = sib_slot.filter(|&s| s < pblk.nritems()) else {
                continue;
            };
            let sib = self.block(
                pblk.ptr(sib_slot).blockptr,
                &Self::child_expect(&pblk, sib_slot),
            )?;
            let Some(k) = push_point(&sizes, slot, need, lfree, sib.leaf_free_space(), left) else {
                continue;
            };
            let sib = self.cow(tree, sib, Some((parent, sib_slot)))?;
            let mut lbuf = self.dirty_block(leaf)?.data.to_vec();
            let mut sbuf = self.dirty_block(sib)?.data.to_vec();
            let first = {
                let mut l = LeafMut::trusted(&mut lbuf)?;
                let mut s = LeafMut::trusted(&mut sbuf)?;
                if left {
                    ctree_ops::push_leaf_left(&mut s, &mut l, k)?
                } else {
                    ctree_ops::push_leaf_right(&mut l, &mut s, n - k)?
                }
            };
            // The right one of the two leaves starts at another key now.
            let (right, right_slot) = if left { (leaf, pslot) } else { (sib, sib_slot) };
            let first = first.ok_or_else(|| {
                Error::Internal(format!("a push emptied leaf {right} of tree {tree}"))
            })?;
            self.put(leaf, lbuf)?;
            self.put(sib, sbuf)?;
            self.modify(parent, |buf| {
                NodeMut::trusted(buf)?.set_key(right_slot, first)
            })?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Makes `tree` one level taller: a new root node pointing at the old root.
    fn grow_root(&mut self, tree: u64, old_root: u64) -> Result<u64> {
        let old = self.dirty_block(old_root)?;
        let first = if old.nritems() > 0 {
            old.key(0)
        } else {
            Key::MIN
        };
        let level = old.level() + 1;
        if level >= MAX_LEVEL {
            return Err(Error::Internal(format!(
                "tree {tree} would exceed {MAX_LEVEL} levels"
            )));
        }
        let new = self.new_block(tree, level, first)?;
        let transid = self.transid;
        self.modify(new, |buf| {
            NodeMut::trusted(buf)?.insert_ptr(0, first, old_root, transid)
        })?;
        self.set_root(tree, new, level)?;
        Ok(new)
    }

    /// The root node has one pointer: its child becomes the root.
    fn shrink_root(&mut self, tree: u64, root: u64) -> Result<()> {
        let blk = self.dirty_block(root)?;
        let child = self.block(blk.ptr(0).blockptr, &Self::child_expect(&blk, 0))?;
        let child = self.cow(tree, child, Some((root, 0)))?;
        let level = blk.level() - 1;
        self.set_root(tree, child, level)?;
        self.free_dirty_block(tree, root)
    }

    /// Splits the node at `level` of `path` (already COWed) in two.
    fn split_node(&mut self, tree: u64, path: &WPath, level: u8, bytenr: u64) -> Result<()> {
        let is_root = level as usize == path.nodes.len() - 1;
        let (parent, pslot) = if is_root {
            (self.grow_root(tree, bytenr)?, 0)
        } else {
            path.nodes[level as usize + 1]
        };
        let blk = self.dirty_block(bytenr)?;
        let at = blk.nritems() / 2;
        let right = self.new_block(tree, level, blk.key(at))?;
        let mut lbuf = blk.data.to_vec();
        let rblk = self.dirty_block(right)?;
        let mut rbuf = rblk.data.to_vec();
        let rkey = {
            let mut l = NodeMut::trusted(&mut lbuf)?;
            let mut r = NodeMut::trusted(&mut rbuf)?;
            ctree_ops::split_node(&mut l, &mut r, at)?
        };
        self.put(bytenr, lbuf)?;
        self.put(right, rbuf)?;
        let rkey = rkey.ok_or_else(|| Error::Internal("split node gave an empty right".into()))?;
        let transid = self.transid;
        self.modify(parent, |buf| {
            NodeMut::trusted(buf)?.insert_ptr(pslot + 1, rkey, right, transid)
        })
    }

    /// Replaces a dirty block's bytes wholesale.
    fn put(&self, bytenr: u64, data: Vec<u8>) -> Result<()> {
        self.modify(bytenr, |buf| {
            buf.copy_from_slice(&data);
            Ok(())
        })
    }

    /// Splits the leaf of `path` as `plan` says.
    fn split_leaf(
        &mut self,
        tree: u64,
        path: &WPath,
        leaf: u64,
        plan: LeafSplit,
        key: Key,
    ) -> Result<()> {
        let (parent, pslot) = if path.nodes.len() == 1 {
            (self.grow_root(tree, leaf)?, 0)
        } else {
            path.nodes[1]
        };
        let blk = self.dirty_block(leaf)?;
        let mut lbuf = blk.data.to_vec();
        let transid = self.transid;
        // A double split whose first cut is at slot 0 leaves the left leaf empty: one split at
        // the second cut does the same job (the left leaf takes the new item).
        let plan = match plan {
            LeafSplit::Two { first: 0, second } => LeafSplit::One {
                at: second,
                into_right: false,
            },
            // The key is there already (a caller that replaces the item: extent replace): moving
            // everything right would leave the emptied left leaf and the right one both keyed
            // by it. Keep the item on the left; the left leaf then has the room.
            LeafSplit::One { at: 0, .. } if blk.nritems() > 1 && blk.key(0) == key => {
                LeafSplit::One {
                    at: 1,
                    into_right: false,
                }
            }
            p => p,
        };
        match plan {
            LeafSplit::NotNeeded => Ok(()),
            LeafSplit::One { at, .. } => {
                let rfirst = if at < blk.nritems() { blk.key(at) } else { key };
                let right = self.new_block(tree, 0, rfirst)?;
                let mut rbuf = self.dirty_block(right)?.data.to_vec();
                let rkey = {
                    let mut l = LeafMut::trusted(&mut lbuf)?;
                    let mut r = LeafMut::trusted(&mut rbuf)?;
                    ctree_ops::split_leaf(&mut l, &mut r, at)?
                };
                self.put(leaf, lbuf)?;
                self.put(right, rbuf)?;
                // An empty right leaf (insert at the end) is keyed by the new item.
                let rkey = rkey.unwrap_or(key);
                if at == 0 {
                    // Everything moved right; the emptied left leaf takes the new item, which is
                    // below all of them: its pointer (and the ones above it) must say so before
                    // the right leaf's pointer, with the old first key, goes in after it.
                    if path.nodes.len() == 1 {
                        self.modify(parent, |buf| NodeMut::trusted(buf)?.set_key(pslot, key))?;
                    } else {
                        self.fixup_low_keys(path, 0, key)?;
                    }
                }
                self.modify(parent, |buf| {
                    NodeMut::trusted(buf)?.insert_ptr(pslot + 1, rkey, right, transid)
                })
            }
            LeafSplit::Two { first, second } => {
                let n = blk.nritems();
                let rfirst = if second < n { blk.key(second) } else { key };
                let right = self.new_block(tree, 0, rfirst)?;
                let mfirst = if first < n { blk.key(first) } else { key };
                let middle = self.new_block(tree, 0, mfirst)?;
                let mut rbuf = self.dirty_block(right)?.data.to_vec();
                let mut mbuf = self.dirty_block(middle)?.data.to_vec();
                let (rkey, mkey) = {
                    let mut l = LeafMut::trusted(&mut lbuf)?;
                    let mut r = LeafMut::trusted(&mut rbuf)?;
                    let mut m = LeafMut::trusted(&mut mbuf)?;
                    let rk = ctree_ops::split_leaf(&mut l, &mut r, second)?;
                    let mk = ctree_ops::split_leaf(&mut l, &mut m, first)?;
                    (rk, mk)
                };
                self.put(leaf, lbuf)?;
                self.put(right, rbuf)?;
                self.put(middle, mbuf)?;
                let mkey = mkey.unwrap_or(key);
                match rkey {
                    Some(rk) => self.modify(parent, |buf| {
                        let mut p = NodeMut::trusted(buf)?;
                        p.insert_ptr(pslot + 1, mkey, middle, transid)?;
                        p.insert_ptr(pslot + 2, rk, right, transid)
                    }),
                    None => {
                        self.free_dirty_block(tree, right)?;
                        self.modify(parent, |buf| {
                            NodeMut::trusted(buf)?.insert_ptr(pslot + 1, mkey, middle, transid)
                        })
                    }
                }
            }
        }
    }

    /// Merges the underfull node at `level` with a sibling when both fit in one, or evens
    /// them out. Returns whether anything changed.
    fn balance_node(&mut self, tree: u64, path: &WPath, level: u8, bytenr: u64) -> Result<bool> {
        let (parent, pslot) = path.nodes[level as usize + 1];
        let pblk = self.dirty_block(parent)?;
        let max_ptrs = ctree_ops::max_node_ptrs(self.disk.nodesize() as usize);
        let (left_slot, right_slot) = if pslot + 1 < pblk.nritems() {
            (pslot, pslot + 1)
        } else if pslot > 0 {
            (pslot - 1, pslot)
        } else {
            return Ok(false);
        };
        let sib_slot = if left_slot == pslot {
            right_slot
        } else {
            left_slot
        };
        let sib = self.block(
            pblk.ptr(sib_slot).blockptr,
            &Self::child_expect(&pblk, sib_slot),
        )?;
        let sib = self.cow(tree, sib, Some((parent, sib_slot)))?;
        let (lb, rb) = if left_slot == pslot {
            (bytenr, sib)
        } else {
            (sib, bytenr)
        };
        let mut lbuf = self.dirty_block(lb)?.data.to_vec();
        let mut rbuf = self.dirty_block(rb)?.data.to_vec();
        let (nl, nr) = {
            let l = NodeMut::trusted(&mut lbuf)?;
            let r = NodeMut::trusted(&mut rbuf)?;
            (l.nritems(), r.nritems())
        };
        if nl + nr + 4 <= max_ptrs {
            {
                let mut l = NodeMut::trusted(&mut lbuf)?;
                let mut r = NodeMut::trusted(&mut rbuf)?;
                ctree_ops::merge_nodes(&mut l, &mut r)?;
            }
            self.put(lb, lbuf)?;
            self.put(rb, rbuf)?;
            self.modify(parent, |buf| {
                NodeMut::trusted(buf)?.delete_ptrs(right_slot, 1)
            })?;
            self.free_dirty_block(tree, rb)?;
            return Ok(true);
        }
        // Even them out.
        let target = (nl + nr) / 2;
        let rkey = {
            let mut l = NodeMut::trusted(&mut lbuf)?;
            let mut r = NodeMut::trusted(&mut rbuf)?;
            if nl < target {
                ctree_ops::push_node_left(&mut l, &mut r, target - nl)?
            } else if nl > target {
                ctree_ops::push_node_right(&mut l, &mut r, nl - target)?
            } else {
                return Ok(false);
            }
        };
        self.put(lb, lbuf)?;
        self.put(rb, rbuf)?;
        if let Some(k) = rkey {
            self.modify(parent, |buf| NodeMut::trusted(buf)?.set_key(right_slot, k))?;
        }
        Ok(true)
    }

    /// After slot 0 of the block at `level` changed its key: carry the new first key up.
    fn fixup_low_keys(&mut self, path: &WPath, from_level: usize, key: Key) -> Result<()> {
        for lvl in from_level + 1..path.nodes.len() {
            let (b, slot) = path.nodes[lvl];
            self.modify(b, |buf| NodeMut::trusted(buf)?.set_key(slot, key))?;
            if slot != 0 {
                break;
            }
        }
        Ok(())
    }

    /// After changing a leaf's items in place: if its first key changed, carry it up.
    pub(crate) fn fix_first_key(&mut self, path: &WPath) -> Result<()> {
        if path.nodes.len() < 2 {
            return Ok(());
        }
        let blk = self.dirty_block(path.leaf())?;
        if blk.nritems() == 0 {
            return Ok(());
        }
        let (p, slot) = path.nodes[1];
        if self.dirty_block(p)?.key(slot) != blk.key(0) {
            self.fixup_low_keys(path, 0, blk.key(0))?;
        }
        Ok(())
    }

    /// Inserts items (sorted, new) at the leaf `path` found with [`Intent::Insert`].
    fn insert_at(&mut self, path: &WPath, items: &[(Key, &[u8])]) -> Result<()> {
        let (leaf, slot) = (path.leaf(), path.slot());
        let spec: Vec<(Key, usize)> = items.iter().map(|(k, d)| (*k, d.len())).collect();
        self.modify(leaf, |buf| {
            let mut l = LeafMut::trusted(buf)?;
            l.insert_items(slot, &spec)?;
            for (i, (_, d)) in items.iter().enumerate() {
                l.item_data_mut(slot + i)?.copy_from_slice(d);
            }
            Ok(())
        })?;
        if slot == 0 {
            self.fixup_low_keys(path, 0, items[0].0)?;
        }
        Ok(())
    }

    /// Inserts one item; `Error::Exists`-like `Invalid` if the key is present.
    pub(crate) fn insert_item(&mut self, tree: u64, key: Key, data: &[u8]) -> Result<()> {
        self.insert_items(tree, &[(key, data)])
    }

    /// Inserts a run of items with increasing keys that land next to each other (no existing
    /// key between them).
    pub(crate) fn insert_items(&mut self, tree: u64, items: &[(Key, &[u8])]) -> Result<()> {
        let Some(first) = items.first() else {
            return Ok(());
        };
        let data_len = items.iter().map(|(_, d)| d.len()).sum();
        let path = self.search_mut(
            tree,
            &first.0,
            Intent::Insert {
                items: items.len(),
                data_len,
            },
        )?;
        if path.found {
            return Err(Error::Exists(format!(
                "item {} already exists in tree {}",
                first.0,
                tree_name(tree)
            )));
        }
        self.insert_at(&path, items)
    }

    /// Looks an item up with the path COWed so it can be changed in place.
    pub(crate) fn lookup_mut(&mut self, tree: u64, key: &Key) -> Result<Option<WPath>> {
        let p = self.search_mut(tree, key, Intent::Modify)?;
        Ok(p.found.then_some(p))
    }

    /// Changes an item's body in place.
    pub(crate) fn update_item(
        &mut self,
        tree: u64,
        key: &Key,
        f: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<bool> {
        let Some(p) = self.lookup_mut(tree, key)? else {
            return Ok(false);
        };
        let slot = p.slot();
        self.modify(p.leaf(), |buf| {
            f(LeafMut::trusted(buf)?.item_data_mut(slot)?)
        })?;
        Ok(true)
    }

    /// Replaces an item's body (any size), inserting it if missing.
    pub(crate) fn replace_item(&mut self, tree: u64, key: Key, data: &[u8]) -> Result<()> {
        let p = self.search_mut(tree, &key, Intent::Modify)?;
        if p.found {
            let cur = self.dirty_block(p.leaf())?.item(p.slot()).size as usize;
            if cur == data.len() {
                let slot = p.slot();
                return self.modify(p.leaf(), |buf| {
                    LeafMut::trusted(buf)?
                        .item_data_mut(slot)?
                        .copy_from_slice(data);
                    Ok(())
                });
            }
            self.delete_item(tree, &key)?;
        }
        self.insert_item(tree, key, data)
    }

    /// Resizes an item (growing adds zeros at the end, shrinking cuts the end) and returns a
    /// path to it.
    pub(crate) fn resize_item(&mut self, tree: u64, key: &Key, new_size: usize) -> Result<WPath> {
        let p = self.search_mut(tree, key, Intent::Modify)?;
        if !p.found {
            return Err(Error::NotFound(format!(
                "item {key} in tree {}",
                tree_name(tree)
            )));
        }
        let cur = self.dirty_block(p.leaf())?.item(p.slot()).size as usize;
        if new_size == cur {
            return Ok(p);
        }
        if new_size < cur {
            let slot = p.slot();
            self.modify(p.leaf(), |buf| {
                LeafMut::trusted(buf)?.truncate_item(slot, new_size, true)
            })?;
            return Ok(p);
        }
        let p = self.search_mut(
            tree,
            key,
            Intent::Extend {
                extra: new_size - cur,
            },
        )?;
        let slot = p.slot();
        self.modify(p.leaf(), |buf| {
            LeafMut::trusted(buf)?.extend_item(slot, new_size - cur)
        })?;
        Ok(p)
    }

    /// Reads an item's body through the write path (sees the running transaction).
    pub(crate) fn read_item(&mut self, tree: u64, key: &Key) -> Result<Option<Vec<u8>>> {
        let root = self.current_root(tree)?;
        Ok(crate::ctree::lookup(&self.disk, &root, key)?.map(|it| it.data().to_vec()))
    }

    /// Deletes one item. Returns whether it was there.
    pub(crate) fn delete_item(&mut self, tree: u64, key: &Key) -> Result<bool> {
        let p = self.search_mut(tree, key, Intent::Delete)?;
        if !p.found {
            return Ok(false);
        }
        self.delete_at(tree, &p, p.slot(), 1)?;
        Ok(true)
    }

    /// Deletes `count` items from `slot` of the leaf of `path` (found with [`Intent::Delete`]),
    /// then removes the leaf if it is empty or merges it with a neighbour if it is light.
    pub(crate) fn delete_at(
        &mut self,
        tree: u64,
        path: &WPath,
        slot: usize,
        count: usize,
    ) -> Result<()> {
        let leaf = path.leaf();
        self.modify(leaf, |buf| LeafMut::trusted(buf)?.delete_items(slot, count))?;
        let blk = self.dirty_block(leaf)?;
        if path.nodes.len() == 1 {
            return Ok(()); // a root leaf may be empty
        }
        if blk.nritems() == 0 {
            self.remove_from_parent(tree, path, 1)?;
            self.free_dirty_block(tree, leaf)?;
            return Ok(());
        }
        if slot == 0 {
            self.fixup_low_keys(path, 0, blk.key(0))?;
        }
        let ns = self.disk.nodesize() as usize;
        if leaf_used(&blk) < (ns - HEADER_SIZE) / 4 {
            self.merge_leaf(tree, path)?;
        }
        Ok(())
    }

    /// Removes the pointer at `path.nodes[level]` (its child is gone); empties propagate up.
    fn remove_from_parent(&mut self, tree: u64, path: &WPath, level: usize) -> Result<()> {
        let (node, slot) = path.nodes[level];
        self.modify(node, |buf| NodeMut::trusted(buf)?.delete_ptrs(slot, 1))?;
        let blk = self.dirty_block(node)?;
        if blk.nritems() == 0 {
            if level + 1 == path.nodes.len() {
                // The root lost its last child: the tree becomes one empty leaf.
                let leaf = self.new_block(tree, 0, Key::MIN)?;
                self.set_root(tree, leaf, 0)?;
            } else {
                self.remove_from_parent(tree, path, level + 1)?;
            }
            return self.free_dirty_block(tree, node);
        }
        if slot == 0 {
            self.fixup_low_keys(path, level, blk.key(0))?;
        }
        Ok(())
    }

    /// Merges a light leaf into its left or right neighbour under the same parent if the two
    /// fit in one block.
    fn merge_leaf(&mut self, tree: u64, path: &WPath) -> Result<()> {
        let (parent, pslot) = path.nodes[1];
        let pblk = self.dirty_block(parent)?;
        let leaf = path.leaf();
        let space = self.disk.nodesize() as usize - HEADER_SIZE;
        let used = leaf_used(&*self.dirty_block(leaf)?);
        for sib_slot in [pslot + 1, pslot.wrapping_sub(1)] {
            if sib_slot >= pblk.nritems() {
                continue;
            }
            let sib = self.block(
                pblk.ptr(sib_slot).blockptr,
                &Self::child_expect(&pblk, sib_slot),
            )?;
            if leaf_used(&sib) + used > space {
                continue;
            }
            let sib = self.cow(tree, sib, Some((parent, sib_slot)))?;
            let (lb, rb, rslot) = if sib_slot > pslot {
                (leaf, sib, sib_slot)
            } else {
                (sib, leaf, pslot)
            };
            let mut lbuf = self.dirty_block(lb)?.data.to_vec();
            let mut rbuf = self.dirty_block(rb)?.data.to_vec();
            {
                let mut l = LeafMut::trusted(&mut lbuf)?;
                let mut r = LeafMut::trusted(&mut rbuf)?;
                ctree_ops::merge_leaves(&mut l, &mut r)?;
            }
            self.put(lb, lbuf)?;
            self.put(rb, rbuf)?;
            let mut p2 = path.clone();
            p2.nodes[1] = (parent, rslot);
            self.remove_from_parent(tree, &p2, 1)?;
            self.free_dirty_block(tree, rb)?;
            return Ok(());
        }
        Ok(())
    }

    /// Deletes every item with a key in `[from, to]`. Returns how many were deleted.
    pub(crate) fn delete_range(&mut self, tree: u64, from: Key, to: Key) -> Result<usize> {
        let mut total = 0;
        loop {
            let p = self.search_mut(tree, &from, Intent::Delete)?;
            let blk = self.dirty_block(p.leaf())?;
            let start = p.slot();
            let mut end = start;
            while end < blk.nritems() && blk.key(end) <= to {
                end += 1;
            }
            if end > start {
                self.delete_at(tree, &p, start, end - start)?;
                total += end - start;
                continue;
            }
            // Nothing here; the next leaf may begin with keys in range.
            let root = self.current_root(tree)?;
            let next = next_key_after(&self.disk, &root, &from)?;
            match next {
                Some(k) if k <= to && k > from => {
                    // The search lands at the end of a leaf; continue from the next key.
                    let p = self.search_mut(tree, &k, Intent::Delete)?;
                    self.delete_at(tree, &p, p.slot(), 1)?;
                    total += 1;
                }
                _ => return Ok(total),
            }
        }
    }
}

/// The first key >= `key` in a tree (read path).
pub(crate) fn next_key_after(
    disk: &Arc<crate::io::disk_io::Disk>,
    root: &crate::ctree::Root,
    key: &Key,
) -> Result<Option<Key>> {
    let mut it = crate::ctree::TreeIter::new(
        disk.clone(),
        *root,
        *key,
        crate::io::disk_io::Readahead::None,
    )?;
    Ok(it.next_item()?.map(|i| i.key))
}

/// The reference a tree holds on its blocks.
pub(crate) fn tree_ref(tree: u64) -> RefKey {
    RefKey::TreeBlock(tree)
}

#[allow(dead_code)]
fn _loc(_: Location) {}

/// Where to cut a full leaf (item sizes with headers `sizes`, `lfree` bytes free) for a push
/// into its left (`left`) or right sibling (`sfree` bytes free) that makes room for `need`
/// bytes at `slot`: items `[0, k)` go left, or `[k, n)` go right, as many as the sibling
/// takes while the leaf the new item lands in keeps room for it (left when `slot <= k`, right
/// when `slot > k`). `None` when no cut does; the leaf keeps at least one item.
fn push_point(
    sizes: &[usize],
    slot: usize,
    need: usize,
    lfree: usize,
    sfree: usize,
    left: bool,
) -> Option<usize> {
    let n = sizes.len();
    let (mut moved, mut best) = (0, None);
    // One more item moves at each step: from the leaf's start (left) or its end (right).
    for j in 1..n {
        let k = if left { j } else { n - j };
        moved += if left { sizes[k - 1] } else { sizes[k] };
        if moved > sfree {
            break;
        }
        let into_sibling = if left { slot <= k } else { slot > k };
        let room = if into_sibling {
            sfree - moved
        } else {
            lfree + moved
        };
        if room >= need {
            best = Some(k);
        }
    }
    best
}
