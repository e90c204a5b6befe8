//! Relocation of one block group: everything it holds is copied elsewhere and every reference
//! to it is changed, so that the group ends empty and can be removed (balance, shrink, device
//! remove).
//!
//! The kernel relocates through reloc trees: a COW copy of each subvolume tree whose blocks
//! point at the new places, merged into the subvolume at the end, so that snapshots keep
//! sharing. butter is offline and the only writer, so it can do what that achieves directly,
//! in one transaction: it renames blocks.
//!
//! 1. The group is marked read-only in the allocator: nothing new goes into it, while its free
//!    space stays free on disk.
//! 2. Each data extent in it is copied (raw bytes, compressed or not, read from a copy whose
//!    checksums match) to space outside it, with its checksums.
//! 3. Every tree is walked from its root (the root and chunk trees, and every tree the root
//!    tree has a ROOT_ITEM for, snapshots included), each block once however many trees reach
//!    it. A block changes when it lies in the group, when it is a leaf with a file extent
//!    pointing at a moved data extent, or when a block below it changes.
//! 4. Each block that changes gets one copy at a new address, children first: the same
//!    block (same generation, owner and flags) with its pointers to changed children and its
//!    file extents' addresses replaced. A block this transaction wrote already is changed in
//!    place. Every back reference of the original goes to the copy (a shared reference
//!    naming a changed parent names the parent's copy), a block with full back references
//!    hands its children's references to its copy, each moved data extent's references go to
//!    its copy, and a tree whose root was copied points at the copy with the root's
//!    generation.
//! 5. The transaction commits. The delayed references drop the originals (their checksums go
//!    with them) and the group is empty; the caller then removes it.
//!
//! The result is the filesystem before with some block and extent addresses renamed: every
//! block shared by snapshots stays shared, every generation the same (so the kernel's rules
//! for shared blocks, which compare generations with a tree's last snapshot, see what they saw
//! before). The copies are written only to space free in the committed state and the commit is
//! the ordinary atomic one, so a power cut at any write leaves the state before the relocation
//! or after it.

use super::Writer;
use crate::ctree::cow::Intent;
use crate::ctree::ops::LeafMut;
use crate::ctree::ops::{self as ctree_ops, NodeMut};
use crate::ctree::Root;
use crate::ctree::TreeIter;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::TreeBlock;
use crate::io::disk_io::{Expect, Readahead};
use crate::space::alloc::SpaceKind;
use crate::space::delayed_refs::RefKey;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// What one relocation moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelocStats {
    /// Data extents copied, and their bytes (on disk).
    pub data_extents: u64,
    pub data_bytes: u64,
    /// Tree blocks COWed out of the group (counting each tree that reached a shared one).
    pub tree_blocks: u64,
    /// File extent items changed to point at the copies.
    pub file_extents: u64,
}

/// Bytes copied at a time.
const COPY_CHUNK: u64 = 1 << 20;

impl Writer {
    /// Relocates everything in the block group at `start` (see the module doc) in the running
    /// transaction, which the caller commits. The group stays read-only; it is empty once the
    /// commit has run the delayed references.
    pub(crate) fn relocate_group(
        &mut self,
        start: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<RelocStats> {
        self.check_writable()?;
        let Some((len, flags, exact)) = self
            .allocator
            .with_group(start, |g| (g.len, g.flags, g.start == start))
        else {
            return Err(Error::Invalid(format!("no block group starts at {start}")));
        };
        if !exact {
            return Err(Error::Invalid(format!("no block group starts at {start}")));
        }
        if self.ordered_pending > 0 {
            return Err(Error::Internal(
                "relocation while file data is still being written".into(),
            ));
        }
        let trees = self.relocation_tree_ids()?;
        // A transaction that only relocates leaves qgroups as they were: every extent keeps
        // its size and its sharing, only addresses change.
        let neutral = !self.has_changes();
        self.qgroup_neutral = neutral;
        if self.ensure_tree_room(&[start])? {
            self.commit()?;
            self.qgroup_neutral = neutral;
        }
        // Read-only before anything else: the new chunks below change trees, and their blocks
        // must not land in the group.
        self.allocator.set_readonly(start, true);
        self.room_outside(start, flags)?;
        // The last writable group of its kind: its contents (or the kind's next allocation)
        // need a new chunk.
        let kind = SpaceKind::of_flags(flags);
        let mut others = 0;
        self.allocator.for_each(|g| {
            if g.start != start && !g.readonly && SpaceKind::of_flags(g.flags) == kind {
                others += 1;
            }
        });
        if others == 0 {
            if let Some(kind) = kind {
                self.alloc_chunk(kind, 0)?;
            }
        }
        // New chunks and moved blocks: an fsync until the commit must commit, not log.
        self.log.broken = true;
        let mut stats = RelocStats::default();
        let mut moved: BTreeMap<u64, u64> = BTreeMap::new();
        let mut data_len: HashMap<u64, u64> = HashMap::new();
        let inside = |b: u64| b >= start && b - start < len;
        if flags & BLOCK_GROUP_DATA != 0 {
            let extents = self.data_extents_in(start, len)?;
            let total: u64 = extents.iter().map(|e| e.1).sum();
            let mut done = 0u64;
            for (x, n) in extents {
                let y = self.copy_data_extent(x, n)?;
                moved.insert(x, y);
                data_len.insert(x, n);
                stats.data_extents += 1;
                stats.data_bytes += n;
                done += n;
                progress(&format!(
                    "block group {start}: copied {} of {} MiB of data",
                    done >> 20,
                    total.div_ceil(1 << 20)
                ));
            }
        }
        // Every block that must change: those in the group, leaves with file extents that
        // point at a moved data extent, and every block above one of those. A block reached
        // from several trees (shared by snapshots) is one entry, so it gets one copy.
        let mut memo: HashMap<u64, bool> = HashMap::new();
        let mut order: Vec<(u64, Expect)> = Vec::new();
        let mut roots: Vec<(u64, Root)> = Vec::new();
        for &tree in &trees {
            let root = self.current_root(tree)?;
            let leaves = !moved.is_empty()
                && (crate::ctree::cow_ctx::is_fs_tree(tree) || tree == ROOT_TREE_OBJECTID);
            let expect = Expect {
                owner: None,
                level: Some(root.level),
                generation: (root.generation != self.transid).then_some(root.generation),
                first_key: None,
            };
            let walk = Walk {
                tree,
                start,
                len,
                leaves,
            };
            self.relocation_visit(&walk, root.bytenr, expect, &moved, &mut memo, &mut order)?;
            roots.push((tree, root));
        }
        // New copies, children first (a parent's copy points at its children's copies).
        let mut renamed: HashMap<u64, u64> = HashMap::new();
        let mut copies: Vec<(u64, u64, Arc<TreeBlock>)> = Vec::new();
        for (b, expect) in &order {
            let blk = self.block(*b, expect).map_err(|e| e.in_block(None, *b))?;
            let mut data = blk.data.clone();
            if blk.level() > 0 {
                let mut node = NodeMut::trusted(&mut data)?;
                for slot in 0..blk.nritems() {
                    let p = blk.ptr(slot);
                    if let Some(&nc) = renamed.get(&p.blockptr) {
                        if nc != p.blockptr {
                            node.set_ptr(slot, nc, p.generation)?;
                        }
                    }
                }
            } else {
                let mut leaf = LeafMut::trusted(&mut data)?;
                for slot in 0..blk.nritems() {
                    if blk.key(slot).ty != EXTENT_DATA_KEY {
                        continue;
                    }
                    let fe = FileExtentItem::parse(blk.item_data(slot))
                        .map_err(|e| e.in_block(Some(blk.owner()), *b))?;
                    if let FileExtentBody::Extent { disk_bytenr, .. } = fe.body {
                        if let Some(&y) = moved.get(&disk_bytenr) {
                            leaf.item_data_mut(slot)?[21..29].copy_from_slice(&y.to_le_bytes());
                            stats.file_extents += 1;
                        }
                    }
                }
            }
            if blk.header.generation == self.transid && self.disk.overlay_get(*b).is_some() {
                // This transaction's own block: changed in place (its children's references
                // are its tree's, which name no parent).
                if inside(*b) {
                    return Err(Error::Internal(format!(
                        "block {b} in the block group being relocated was written in this \
                         transaction"
                    )));
                }
                self.modify(*b, |buf| {
                    buf.copy_from_slice(&data);
                    Ok(())
                })?;
                renamed.insert(*b, *b);
                continue;
            }
            let nb = self.alloc_tree_block(blk.owner())?;
            ctree_ops::set_bytenr(&mut data, nb)?;
            let copy = Arc::new(TreeBlock::from_parts(nb, data));
            self.disk.overlay_put(copy.clone());
            renamed.insert(*b, nb);
            copies.push((*b, nb, blk));
            stats.tree_blocks += 1;
        }
        // Back references: each copied block takes its original's (a shared one naming a
        // copied parent names the parent's copy), and a block with full back references
        // hands its children's to its copy.
        let ns = self.disk.nodesize() as u64;
        let rename_ref = |r: RefKey| match r {
            RefKey::SharedBlock(p) => RefKey::SharedBlock(*renamed.get(&p).unwrap_or(&p)),
            RefKey::SharedData(p) => RefKey::SharedData(*renamed.get(&p).unwrap_or(&p)),
            r => r,
        };
        for (b, nb, blk) in &copies {
            let (refs, flags, generation) = self.extent_refs_now(*b)?;
            let level = blk.level();
            let key0 = if blk.nritems() > 0 {
                blk.key(0)
            } else {
                Key::MIN
            };
            for (r, n) in refs {
                self.refs
                    .add_tree_ref(*nb, ns, level, key0, true, rename_ref(r), n as i64);
                self.refs
                    .add_tree_ref(*b, ns, level, key0, false, r, -(n as i64));
            }
            // The copy is the same block at another address: its extent item keeps the
            // generation (btrfs check compares a root's with its root item's).
            self.refs.set_generation(*nb, generation);
            if flags & BLOCK_FLAG_FULL_BACKREF == 0 {
                continue;
            }
            self.refs.set_flags(*nb, ns, level, BLOCK_FLAG_FULL_BACKREF);
            if level > 0 {
                for slot in 0..blk.nritems() {
                    let p = blk.ptr(slot);
                    if renamed.get(&p.blockptr).is_some_and(|&c| c != p.blockptr) {
                        continue; // its own references move with it
                    }
                    self.refs.add_tree_ref(
                        p.blockptr,
                        ns,
                        level - 1,
                        p.key,
                        false,
                        RefKey::SharedBlock(*b),
                        -1,
                    );
                    self.refs.add_tree_ref(
                        p.blockptr,
                        ns,
                        level - 1,
                        p.key,
                        false,
                        RefKey::SharedBlock(*nb),
                        1,
                    );
                }
            } else {
                for slot in 0..blk.nritems() {
                    if blk.key(slot).ty != EXTENT_DATA_KEY {
                        continue;
                    }
                    let fe = FileExtentItem::parse(blk.item_data(slot))
                        .map_err(|e| e.in_block(Some(blk.owner()), *b))?;
                    if let FileExtentBody::Extent {
                        disk_bytenr,
                        disk_num_bytes,
                        ..
                    } = fe.body
                    {
                        if disk_bytenr == 0 || moved.contains_key(&disk_bytenr) {
                            continue; // a moved extent's references move with it
                        }
                        self.refs.add_data_ref(
                            disk_bytenr,
                            disk_num_bytes,
                            false,
                            RefKey::SharedData(*b),
                            -1,
                        );
                        self.refs.add_data_ref(
                            disk_bytenr,
                            disk_num_bytes,
                            false,
                            RefKey::SharedData(*nb),
                            1,
                        );
                    }
                }
            }
        }
        // Each moved data extent's references go to its copy.
        for (&x, &y) in &moved {
            let (refs, _, generation) = self.extent_refs_now(x)?;
            let n = data_len[&x];
            for (r, c) in refs {
                self.refs.add_data_ref(y, n, true, rename_ref(r), c as i64);
                self.refs.add_data_ref(x, n, false, r, -(c as i64));
            }
            self.refs.set_generation(y, generation);
        }
        // Trees whose root was copied point at the copy; its generation stays the block's.
        for (tree, root) in roots {
            if let Some(&nr) = renamed.get(&root.bytenr) {
                if nr != root.bytenr {
                    self.replace_root(tree, nr, root.level, root.generation)?;
                }
            }
        }
        // The root tree's root is rewritten by every commit (a root tree whose root was only
        // copied would keep an older generation than the superblock's): make sure it is.
        self.search_mut(ROOT_TREE_OBJECTID, &Key::MIN, Intent::Modify)?;
        progress(&format!(
            "block group {start}: {} data extents, {} tree blocks moved",
            stats.data_extents, stats.tree_blocks
        ));
        Ok(stats)
    }

    /// Marks the running transaction as one qgroups do not see (see
    /// [`Writer::qgroup_neutral`]), if it has changed nothing yet: for the changes of
    /// relocation, chunks, devices and the balance item that follow.
    pub(crate) fn begin_qgroup_neutral(&mut self) {
        if !self.has_changes() {
            self.qgroup_neutral = true;
        }
    }

    /// Tree blocks (the chunk tree's too) need writable room while groups are read-only: a
    /// new system or metadata chunk when the writable groups of that kind are nearly full.
    /// Called before the groups at `excluding` become read-only (while their space still
    /// takes the new chunks' own tree changes); the caller commits when it returns true, so
    /// that the blocks it changed are not this transaction's when relocation COWs them.
    pub(crate) fn ensure_tree_room(&mut self, excluding: &[u64]) -> Result<bool> {
        self.begin_qgroup_neutral();
        let ns = self.disk.nodesize() as u64;
        let mut added = false;
        for kind in [SpaceKind::System, SpaceKind::Metadata] {
            let mut free = 0u64;
            self.allocator.for_each(|g| {
                if !g.readonly
                    && !excluding.contains(&g.start)
                    && SpaceKind::of_flags(g.flags) == Some(kind)
                {
                    free += g.free.total();
                }
            });
            if free < 64 * ns {
                self.alloc_chunk(kind, 0)?;
                added = true;
            }
        }
        Ok(added)
    }

    /// Makes sure blocks of the group's kind (metadata, system) have room outside it: a new
    /// chunk when the other groups' free space is short of what the group holds (with a
    /// margin for the trees the relocation and its commit change).
    fn room_outside(&mut self, start: u64, flags: u64) -> Result<()> {
        let Some(kind) = SpaceKind::of_flags(flags) else {
            return Ok(());
        };
        if kind == SpaceKind::Data {
            return Ok(());
        }
        let used = self.allocator.with_group(start, |g| g.used).unwrap_or(0);
        let mut other = 0u64;
        self.allocator.for_each(|g| {
            if !g.readonly && SpaceKind::of_flags(g.flags) == Some(kind) {
                other += g.free.total();
            }
        });
        let need = used + used / 4 + 64 * self.disk.nodesize() as u64;
        if other < need {
            self.alloc_chunk(kind, need - other)?;
        }
        Ok(())
    }

    /// Every tree to walk: the root and chunk trees and each tree with a ROOT_ITEM. Refused
    /// while the kernel's own relocation trees exist (an interrupted kernel balance) or a
    /// deleted subvolume is still being dropped.
    fn relocation_tree_ids(&mut self) -> Result<Vec<u64>> {
        let mut ids = vec![ROOT_TREE_OBJECTID, CHUNK_TREE_OBJECTID];
        let root = self.current_root(ROOT_TREE_OBJECTID)?;
        let mut it = TreeIter::new(self.disk.clone(), root, Key::MIN, Readahead::None)?;
        while let Some(item) = it.next_item()? {
            if item.key.ty != ROOT_ITEM_KEY {
                continue;
            }
            let id = item.key.objectid;
            if id == TREE_RELOC_OBJECTID {
                return Err(Error::Unsupported(
                    "an interrupted balance of the kernel left its relocation trees: mount the \
                     filesystem with the kernel once to let that balance finish (or cancel it \
                     with `btrfs balance cancel`), then try again"
                        .into(),
                ));
            }
            let ri = RootItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            if crate::ctree::cow_ctx::is_fs_tree(id) && ri.refs == 0 {
                return Err(Error::Unsupported(format!(
                    "subvolume {id} is deleted but not yet cleaned up: open the filesystem \
                     read-write once (or mount it) so its tree is dropped, then try again"
                )));
            }
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// The extent items (key, flags) that lie in `[start, start + len)`: data extents
    /// (EXTENT_ITEM with the DATA flag) and tree blocks (METADATA_ITEM or EXTENT_ITEM).
    pub(crate) fn extent_items_in(&mut self, start: u64, len: u64) -> Result<Vec<(Key, u64)>> {
        let root = self.current_root(EXTENT_TREE_OBJECTID)?;
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(start, 0, 0),
            Readahead::None,
        )?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            if item.key.objectid >= start + len {
                break;
            }
            if !matches!(item.key.ty, EXTENT_ITEM_KEY | METADATA_ITEM_KEY) {
                continue;
            }
            let d = item.data();
            if d.len() < 24 {
                return Err(item.annotate(Error::corrupt(
                    Location::what("extent item"),
                    "shorter than its 24-byte header",
                )));
            }
            out.push((item.key, le_u64(d, 16)));
        }
        Ok(out)
    }

    /// Data extents (address, bytes) whose extent items lie in `[start, start + len)`.
    fn data_extents_in(&mut self, start: u64, len: u64) -> Result<Vec<(u64, u64)>> {
        Ok(self
            .extent_items_in(start, len)?
            .into_iter()
            .filter(|(k, flags)| k.ty == EXTENT_ITEM_KEY && flags & EXTENT_FLAG_DATA != 0)
            .map(|(k, _)| (k.objectid, k.offset))
            .collect())
    }

    /// Copies the data extent `[x, x + n)` to newly allocated space outside the group, with its
    /// checksums; returns the copy's address. Each piece is read from a copy whose checksums
    /// match (a damaged extent is not spread: the relocation stops and says which).
    fn copy_data_extent(&mut self, x: u64, n: u64) -> Result<u64> {
        let y = self.alloc_data_for(n, None, false)?;
        // Queued as new with no reference: if the relocation stops before a file extent
        // points at the copy, the commit frees it with whatever checksums went in for it.
        self.refs.add_data_ref(
            y,
            n,
            true,
            RefKey::Data {
                root: 0,
                ino: 0,
                offset: 0,
            },
            0,
        );
        let ss = self.disk.sectorsize() as u64;
        let csum_type = self.disk.sb.csum_type;
        let cs = csum_type.size();
        let sums = self.csums_of(x, n)?;
        let mut off = 0u64;
        while off < n {
            let piece = COPY_CHUNK.min(n - off);
            let first = (off / ss) as usize;
            let verify = |at: usize, b: &[u8]| {
                b.chunks(ss as usize).enumerate().all(|(i, sec)| {
                    match sums.get(first + at / ss as usize + i) {
                        Some(Some(s)) => csum_type.verify(sec, &s[..cs]),
                        _ => true,
                    }
                })
            };
            let Some(buf) = self.disk.read_data(x + off, piece as usize, &verify)? else {
                return Err(Error::bad_csum(
                    Location::what(format!("data extent {x}, bytes {off}..{}", off + piece)),
                    "no copy matches its checksums, so it is not moved: run `butter scrub` \
                     to see what is damaged, restore the files that use it, then try again",
                ));
            };
            self.disk.write_logical(y + off, &buf)?;
            off += piece;
        }
        // The checksums, in runs of sectors that have them.
        let mut i = 0usize;
        while i < sums.len() {
            if sums[i].is_none() {
                i += 1;
                continue;
            }
            let mut run = Vec::new();
            let from = i;
            while let Some(Some(s)) = sums.get(i) {
                run.extend_from_slice(&s[..cs]);
                i += 1;
            }
            self.insert_csums(y + from as u64 * ss, &run)?;
        }
        Ok(y)
    }

    /// Per-sector checksums of `[logical, logical + len)` from the csum tree as this
    /// transaction sees it (`None` where there is none).
    fn csums_of(&mut self, logical: u64, len: u64) -> Result<Vec<Option<[u8; 32]>>> {
        let ss = self.disk.sectorsize() as u64;
        let cs = self.disk.sb.csum_type.size() as u64;
        let mut out = vec![None; len.div_ceil(ss) as usize];
        let root = match self.current_root(CSUM_TREE_OBJECTID) {
            Ok(r) => r,
            Err(Error::NotFound(_)) => return Ok(out),
            Err(e) => return Err(e),
        };
        let from = match crate::ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
        )? {
            Some(it) if it.key.objectid == EXTENT_CSUM_OBJECTID && it.key.ty == EXTENT_CSUM_KEY => {
                it.key
            }
            _ => Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
        };
        let mut it = TreeIter::new(self.disk.clone(), root, from, Readahead::None)?;
        while let Some(item) = it.next_item()? {
            if item.key.objectid != EXTENT_CSUM_OBJECTID
                || item.key.ty != EXTENT_CSUM_KEY
                || item.key.offset >= logical + len
            {
                break;
            }
            let d = item.data();
            for (k, c) in d.chunks_exact(cs as usize).enumerate() {
                let Some(sec) = item.key.offset.checked_add(k as u64 * ss) else {
                    break;
                };
                if sec < logical || sec >= logical + len {
                    continue;
                }
                let mut s = [0u8; 32];
                s[..c.len()].copy_from_slice(c);
                out[((sec - logical) / ss) as usize] = Some(s);
            }
        }
        Ok(out)
    }

    /// Visits the block at `bytenr` of `w.tree` and what is below it: whether it must change
    /// (it lies in the group, it is a leaf with a file extent pointing at a moved data extent,
    /// or something below it must change). Blocks that must change are added to `order`
    /// after those below them; each block is visited once, whichever tree reaches it.
    fn relocation_visit(
        &mut self,
        w: &Walk,
        bytenr: u64,
        expect: Expect,
        moved: &BTreeMap<u64, u64>,
        memo: &mut HashMap<u64, bool>,
        order: &mut Vec<(u64, Expect)>,
    ) -> Result<bool> {
        if let Some(&n) = memo.get(&bytenr) {
            return Ok(n);
        }
        let inside = |b: u64| b >= w.start && b - w.start < w.len;
        let blk = self
            .block(bytenr, &expect)
            .map_err(|e| e.in_block(Some(w.tree), bytenr))?;
        let mut needs = inside(bytenr);
        if blk.level() > 0 {
            for slot in 0..blk.nritems() {
                let p = blk.ptr(slot);
                let ce = Expect {
                    owner: None,
                    level: Some(blk.level() - 1),
                    generation: Some(p.generation),
                    first_key: Some(p.key),
                };
                let child = if blk.level() > 1 || w.leaves {
                    self.relocation_visit(w, p.blockptr, ce, moved, memo, order)?
                } else if let Some(&n) = memo.get(&p.blockptr) {
                    n
                } else {
                    // A leaf of a tree without file extents changes only if it is in the group.
                    let n = inside(p.blockptr);
                    memo.insert(p.blockptr, n);
                    if n {
                        order.push((p.blockptr, ce));
                    }
                    n
                };
                needs |= child;
            }
        } else if w.leaves {
            for slot in 0..blk.nritems() {
                if blk.key(slot).ty != EXTENT_DATA_KEY {
                    continue;
                }
                let fe = FileExtentItem::parse(blk.item_data(slot))
                    .map_err(|e| e.in_block(Some(w.tree), bytenr))?;
                if let FileExtentBody::Extent { disk_bytenr, .. } = fe.body {
                    if moved.contains_key(&disk_bytenr) {
                        needs = true;
                        break;
                    }
                }
            }
        }
        memo.insert(bytenr, needs);
        if needs {
            order.push((bytenr, expect));
        }
        Ok(needs)
    }

    /// The back references of an extent (in the extent tree, with what this transaction
    /// queued), its flags and its extent item's generation.
    fn extent_refs_now(&mut self, bytenr: u64) -> Result<ExtentNow> {
        let root = self.current_root(EXTENT_TREE_OBJECTID)?;
        let rec = crate::ctree::extent_record::read_extent_record(&self.disk, root, bytenr)?;
        let pending = self.refs.map.get(&bytenr);
        if rec.is_none() && pending.is_none() {
            return Err(Error::corrupt(
                Location::what(format!("extent {bytenr}")).with_tree(EXTENT_TREE_OBJECTID),
                "a tree reaches it, but it has no extent item",
            ));
        }
        let mut refs: BTreeMap<RefKey, i64> = rec
            .as_ref()
            .map(|r| r.refs.iter().map(|(k, v)| (*k, *v as i64)).collect())
            .unwrap_or_default();
        let mut flags = rec.as_ref().map_or(0, |r| r.flags);
        let generation = rec.as_ref().map_or(self.transid, |r| r.generation);
        if let Some(p) = pending {
            for (k, d) in &p.deltas {
                *refs.entry(*k).or_insert(0) += d;
            }
            flags |= p.flags_set;
        }
        Ok((
            refs.into_iter()
                .filter(|(_, v)| *v > 0)
                .map(|(k, v)| (k, v as u64))
                .collect(),
            flags,
            generation,
        ))
    }
}

/// An extent's back references with their counts, its flags and its generation.
type ExtentNow = (Vec<(RefKey, u64)>, u64, u64);

/// One tree's walk (see [`Writer::relocation_visit`]).
struct Walk {
    tree: u64,
    start: u64,
    len: u64,
    /// Its leaves may hold file extents pointing at moved data (subvolume and root trees).
    leaves: bool,
}
