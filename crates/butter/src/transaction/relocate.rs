//! Relocation of one block group: everything it holds is copied elsewhere and every reference
//! to it is changed, so that the group ends empty and can be removed (balance, shrink, device
//! remove).
//!
//! The kernel relocates through reloc trees: a COW copy of each subvolume tree whose blocks
//! point at the new places, swapped into the subvolume at the end, so that snapshots keep
//! sharing. butter is offline and the only writer, and commits whole transactions, so it can
//! use the ordinary COW path instead, which is what makes it simple to trust:
//!
//! 1. The group is marked read-only in the allocator: nothing new goes into it, while its free
//!    space stays free on disk.
//! 2. Each data extent in it is copied (raw bytes, compressed or not, read from a copy whose
//!    checksums match) to space outside it, with its checksums.
//! 3. Every tree is walked from its root (the root and chunk trees, and every tree the root
//!    tree has a ROOT_ITEM for, snapshots included). Each block in the group is COWed through
//!    the tree that reaches it (a search to its first key, as any change would), and each file
//!    extent item that points at a moved data extent is changed to point at its copy, its
//!    back reference moved with it.
//! 4. The transaction commits. The delayed references drop the old blocks and extents (their
//!    checksums go with them) and the group is empty; the caller then removes it.
//!
//! The copies are written only to space that is free in the committed state and the commit is
//! the ordinary atomic one, so a power cut at any write leaves the state before the relocation
//! or after it. What differs from the kernel's result: a tree block shared by snapshots is
//! COWed once per tree that reaches it, so after relocation each snapshot has its own copy of
//! the blocks that were in the group (the files are identical; metadata takes more room).
//! Data extents stay shared: each of their references moves to the one copy.

use super::Writer;
use crate::ctree::cow::Intent;
use crate::ctree::ops::LeafMut;
use crate::ctree::TreeIter;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::{Expect, Readahead};
use crate::space::alloc::SpaceKind;
use crate::space::delayed_refs::RefKey;
use std::collections::BTreeMap;

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
        if self.ensure_tree_room(&[start])? {
            self.commit()?;
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
        if flags & BLOCK_GROUP_DATA != 0 {
            let extents = self.data_extents_in(start, len)?;
            let total: u64 = extents.iter().map(|e| e.1).sum();
            let mut done = 0u64;
            for (x, n) in extents {
                let y = self.copy_data_extent(x, n)?;
                moved.insert(x, y);
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
        for tree in trees {
            let (cow, items) = self.relocation_walk(tree, start, len, &moved)?;
            for k in &cow {
                self.search_mut(tree, k, Intent::Modify)?;
            }
            stats.tree_blocks += cow.len() as u64;
            for k in &items {
                if self.repoint_file_extent(tree, k, &moved)? {
                    stats.file_extents += 1;
                }
            }
        }
        progress(&format!(
            "block group {start}: {} data extents, {} tree blocks moved",
            stats.data_extents, stats.tree_blocks
        ));
        Ok(stats)
    }

    /// Tree blocks (the chunk tree's too) need writable room while groups are read-only: a
    /// new system or metadata chunk when the writable groups of that kind are nearly full.
    /// Called before the groups at `excluding` become read-only (while their space still
    /// takes the new chunks' own tree changes); the caller commits when it returns true, so
    /// that the blocks it changed are not this transaction's when relocation COWs them.
    pub(crate) fn ensure_tree_room(&mut self, excluding: &[u64]) -> Result<bool> {
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

    /// Data extents (address, bytes) whose extent items lie in `[start, start + len)`.
    fn data_extents_in(&mut self, start: u64, len: u64) -> Result<Vec<(u64, u64)>> {
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
            if item.key.ty != EXTENT_ITEM_KEY {
                continue;
            }
            let d = item.data();
            if d.len() < 24 {
                return Err(item.annotate(Error::corrupt(
                    Location::what("extent item"),
                    "shorter than its 24-byte header",
                )));
            }
            let flags = u64::from_le_bytes(d[16..24].try_into().unwrap_or([0; 8]));
            if flags & EXTENT_FLAG_DATA != 0 {
                out.push((item.key.objectid, item.key.offset));
            }
        }
        Ok(out)
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

    /// Walks `tree` as this transaction sees it: the keys to search (COW) so that each of its
    /// blocks in `[start, start + len)` is copied out (a block's key in its parent leads the
    /// search through it), and the keys of its file extent items that point at a data extent
    /// in `moved`. Leaves are read only where file extents may be.
    fn relocation_walk(
        &mut self,
        tree: u64,
        start: u64,
        len: u64,
        moved: &BTreeMap<u64, u64>,
    ) -> Result<(Vec<Key>, Vec<Key>)> {
        let root = self.current_root(tree)?;
        let inside = |b: u64| b >= start && b - start < len;
        let leaves_matter = !moved.is_empty()
            && (crate::ctree::cow_ctx::is_fs_tree(tree) || tree == ROOT_TREE_OBJECTID);
        let mut cow = Vec::new();
        let mut items = Vec::new();
        if inside(root.bytenr) {
            cow.push(Key::MIN);
        }
        let mut stack = vec![(
            root.bytenr,
            Expect {
                owner: None,
                level: Some(root.level),
                generation: (root.generation != self.transid).then_some(root.generation),
                first_key: None,
            },
        )];
        while let Some((bytenr, expect)) = stack.pop() {
            let blk = self
                .block(bytenr, &expect)
                .map_err(|e| e.in_block(Some(tree), bytenr))?;
            if blk.level() > 0 {
                for slot in (0..blk.nritems()).rev() {
                    let p = blk.ptr(slot);
                    if inside(p.blockptr) {
                        cow.push(p.key);
                    }
                    if blk.level() > 1 || leaves_matter {
                        stack.push((
                            p.blockptr,
                            Expect {
                                owner: None,
                                level: Some(blk.level() - 1),
                                generation: Some(p.generation),
                                first_key: Some(p.key),
                            },
                        ));
                    }
                }
                continue;
            }
            if !leaves_matter {
                continue;
            }
            for slot in 0..blk.nritems() {
                let key = blk.key(slot);
                if key.ty != EXTENT_DATA_KEY {
                    continue;
                }
                let fe = FileExtentItem::parse(blk.item_data(slot))
                    .map_err(|e| e.in_block(Some(tree), bytenr))?;
                if let FileExtentBody::Extent { disk_bytenr, .. } = fe.body {
                    if moved.contains_key(&disk_bytenr) {
                        items.push(key);
                    }
                }
            }
        }
        Ok((cow, items))
    }

    /// Points the file extent item `key` of `tree` at the copy of its data extent, moving its
    /// back reference. Returns whether it changed.
    fn repoint_file_extent(
        &mut self,
        tree: u64,
        key: &Key,
        moved: &BTreeMap<u64, u64>,
    ) -> Result<bool> {
        let p = self.search_mut(tree, key, Intent::Modify)?;
        if !p.found {
            return Err(Error::Internal(format!(
                "file extent item {key} of tree {} vanished during relocation",
                tree_name(tree)
            )));
        }
        let (leaf, slot) = (p.leaf(), p.slot());
        let fe = FileExtentItem::parse(self.dirty_block(leaf)?.item_data(slot))
            .map_err(|e| e.in_block(Some(tree), leaf))?;
        let FileExtentBody::Extent {
            disk_bytenr,
            disk_num_bytes,
            offset,
            ..
        } = fe.body
        else {
            return Ok(false);
        };
        let Some(&y) = moved.get(&disk_bytenr) else {
            return Ok(false);
        };
        self.modify(leaf, |buf| {
            let mut l = LeafMut::trusted(buf)?;
            let d = l.item_data_mut(slot)?;
            d[21..29].copy_from_slice(&y.to_le_bytes());
            Ok(())
        })?;
        let r = RefKey::Data {
            root: tree,
            ino: key.objectid,
            offset: key.offset.wrapping_sub(offset),
        };
        self.refs
            .add_data_ref(disk_bytenr, disk_num_bytes, false, r, -1);
        self.refs.add_data_ref(y, disk_num_bytes, true, r, 1);
        Ok(true)
    }
}
