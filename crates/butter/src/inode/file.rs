//! File data writes: write, truncate, fallocate, and the file extent replace of seed 002.
//!
//! Data goes to newly allocated extents (copy on write), written to the device as ordered
//! extents (crate::inode::ordered: the data and its checksums without the writer lock) before the
//! write returns; the file extent items, data references and checksums that make it reachable
//! are tree changes of the running transaction. Small files whose whole content fits under the inline
//! limit live inline in their EXTENT_DATA item, as the kernel keeps them.
//!
//! Replacing a range ([`Core::replace_extents`]) drops or trims the file extent items that
//! overlap it and inserts the new item. When every item concerned sits in the leaf where the
//! new item goes, all of it happens in that leaf after one descent (seed 002's combined path);
//! otherwise it falls back to one search per changed item. `Writer::descents` counts.

use crate::ctree::cow::Intent;
use crate::ctree::ops::LeafMut;
use crate::error::{Error, Result};
pub use crate::format::compress::Precompressed;
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::io::disk_io::{Disk, TreeBlock};
use crate::transaction::extent_refs::RefKey;
use crate::transaction::Writer;

/// Writes a chunk of file data at a logical address and returns its checksums.
type WritebackFn<'a> = dyn Fn(u64, &[u8]) -> Result<Vec<u8>> + 'a;

/// Largest data extent butter writes (the kernel's limit for one extent).
pub(crate) const MAX_EXTENT: u64 = 128 << 20;

/// The kernel's default `max_inline` (bytes): files up to this size are stored inline.
pub const DEFAULT_MAX_INLINE: u64 = 2048;

/// The allocator's view of a file extent's place: `ino` at file offset `offset`.
pub(crate) fn for_file(ino: Inode, offset: u64) -> Option<crate::space::alloc::ForFile> {
    Some(crate::space::alloc::ForFile {
        root: ino.root,
        ino: ino.ino,
        offset,
    })
}

/// Most bytes of one inline extent: what fits in a leaf, below one sector.
pub(crate) fn inline_limit(disk: &Disk) -> usize {
    let ns = disk.nodesize() as usize;
    let leaf_max = crate::ctree::ops::max_item_size(ns) - FileExtentItem::INLINE_HEADER;
    leaf_max.min(disk.sectorsize() as usize - 1)
}

/// Largest inline file for a `max_inline` of `wanted` bytes (the mount option's value),
/// bounded by [`inline_limit`].
pub(crate) fn max_inline_for(disk: &Disk, wanted: u64) -> usize {
    (wanted.min(usize::MAX as u64) as usize).min(inline_limit(disk))
}

/// fallocate(2) modes.
pub const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
pub(crate) const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

/// One file extent item of an inode: its key offset, length in the file, and body.
#[derive(Debug, Clone)]
pub(crate) struct FileExtent {
    pub(crate) start: u64,
    pub(crate) item: FileExtentItem,
}

impl FileExtent {
    pub(crate) fn len(&self, ss: u64) -> u64 {
        match &self.item.body {
            FileExtentBody::Inline(_) => self.item.ram_bytes.div_ceil(ss) * ss,
            FileExtentBody::Extent { num_bytes, .. } => *num_bytes,
        }
    }
    pub(crate) fn end(&self, ss: u64) -> u64 {
        self.start + self.len(ss)
    }
}

/// What one file extent item contributes to the inode's nbytes.
pub(crate) fn nbytes_of(fe: &FileExtentItem) -> u64 {
    match &fe.body {
        FileExtentBody::Inline(_) => fe.ram_bytes,
        FileExtentBody::Extent {
            disk_bytenr,
            num_bytes,
            ..
        } => {
            if *disk_bytenr == 0 {
                0
            } else {
                *num_bytes
            }
        }
    }
}

/// How a dropped range changes one overlapping item.
pub(crate) enum Cut {
    /// The item is entirely inside: delete it.
    Delete,
    /// Keep the head: new length.
    KeepHead(FileExtentItem),
    /// Keep the tail: new key offset and body.
    KeepTail(u64, FileExtentItem),
    /// Keep both ends: head body, and a new tail item (key offset, body).
    Split(FileExtentItem, u64, FileExtentItem),
}

fn with_extent(fe: &FileExtentItem, off_add: u64, num: u64) -> FileExtentItem {
    let mut n = fe.clone();
    if let FileExtentBody::Extent {
        disk_bytenr,
        disk_num_bytes,
        offset,
        ..
    } = fe.body
    {
        n.body = FileExtentBody::Extent {
            disk_bytenr,
            disk_num_bytes,
            offset: if disk_bytenr == 0 {
                0
            } else {
                offset + off_add
            },
            num_bytes: num,
        };
    }
    n
}

/// How dropping `[start, end)` affects an item at `ks` (non-inline).
pub(crate) fn cut(ks: u64, fe: &FileExtentItem, ke: u64, start: u64, end: u64) -> Cut {
    if ks >= start && ke <= end {
        Cut::Delete
    } else if ks < start && ke > end {
        Cut::Split(
            with_extent(fe, 0, start - ks),
            end,
            with_extent(fe, end - ks, ke - end),
        )
    } else if ks < start {
        Cut::KeepHead(with_extent(fe, 0, start - ks))
    } else {
        Cut::KeepTail(end, with_extent(fe, end - ks, ke - end))
    }
}

impl Core {
    pub(crate) fn file_extents(&self, ino: Inode, from: u64, to: u64) -> Result<Vec<FileExtent>> {
        let ss = self.disk.sectorsize() as u64;
        let mut out = Vec::new();
        let mut it = self.extent_items_from(ino, from)?;
        while let Some(i) = it.next_item()? {
            if i.key.objectid != ino.ino || i.key.ty != EXTENT_DATA_KEY || i.key.offset >= to {
                break;
            }
            let fe = FileExtentItem::parse(i.data()).map_err(|e| i.annotate(e))?;
            let x = FileExtent {
                start: i.key.offset,
                item: fe,
            };
            if x.end(ss) > from {
                out.push(x);
            }
        }
        Ok(out)
    }

    /// Drops `[start, end)` from the file's extent items (sector aligned, non-inline items),
    /// then inserts `new` (key offset, body) if given. Returns the change of nbytes (removed,
    /// added). When everything is in one leaf, this takes a single descent (one-descent
    /// extent replace).
    pub(crate) fn replace_extents(
        &self,
        w: &mut Writer,
        ino: Inode,
        start: u64,
        end: u64,
        new: Option<(u64, FileExtentItem)>,
    ) -> Result<(u64, u64)> {
        w.log.note_change(ino, start, end);
        let d0 = w.descents;
        let r = self.replace_extents_inner(w, ino, start, end, new);
        w.replace_descents += w.descents - d0;
        r
    }

    fn replace_extents_inner(
        &self,
        w: &mut Writer,
        ino: Inode,
        start: u64,
        end: u64,
        new: Option<(u64, FileExtentItem)>,
    ) -> Result<(u64, u64)> {
        let ss = self.disk.sectorsize() as u64;
        let added = new.as_ref().map(|(_, f)| nbytes_of(f)).unwrap_or(0);
        if w.combined_replace {
            if let Some(removed) = self.replace_in_one_leaf(w, ino, start, end, new.as_ref())? {
                return Ok((removed, added));
            }
        }
        let mut removed = 0;
        for x in self.file_extents(ino, start, end)? {
            let ke = x.end(ss);
            let key = Key::new(ino.ino, EXTENT_DATA_KEY, x.start);
            if let FileExtentBody::Inline(_) = x.item.body {
                // Inline data is only ever at offset 0; a range write over it replaces it.
                w.delete_item(ino.root, &key)?;
                removed += nbytes_of(&x.item);
                continue;
            }
            let c = cut(x.start, &x.item, ke, start, end);
            removed += self.apply_cut(w, ino, key, &x.item, c)?;
        }
        if let Some((off, fe)) = new {
            w.insert_item(
                ino.root,
                Key::new(ino.ino, EXTENT_DATA_KEY, off),
                &fe.to_bytes(),
            )?;
        }
        Ok((removed, added))
    }

    /// Applies one cut with its own searches. Returns nbytes removed.
    fn apply_cut(
        &self,
        w: &mut Writer,
        ino: Inode,
        key: Key,
        fe: &FileExtentItem,
        c: Cut,
    ) -> Result<u64> {
        let before = nbytes_of(fe);
        match c {
            Cut::Delete => {
                w.delete_item(ino.root, &key)?;
                self.drop_data_ref(w, ino, key.offset, fe);
                Ok(before)
            }
            Cut::KeepHead(h) => {
                let b = h.to_bytes();
                w.update_item(ino.root, &key, |x| {
                    x.copy_from_slice(&b);
                    Ok(())
                })?;
                Ok(before - nbytes_of(&h))
            }
            Cut::KeepTail(nk, t) => {
                w.delete_item(ino.root, &key)?;
                w.insert_item(
                    ino.root,
                    Key::new(ino.ino, EXTENT_DATA_KEY, nk),
                    &t.to_bytes(),
                )?;
                Ok(before - nbytes_of(&t))
            }
            Cut::Split(h, nk, t) => {
                let b = h.to_bytes();
                w.update_item(ino.root, &key, |x| {
                    x.copy_from_slice(&b);
                    Ok(())
                })?;
                w.insert_item(
                    ino.root,
                    Key::new(ino.ino, EXTENT_DATA_KEY, nk),
                    &t.to_bytes(),
                )?;
                self.add_data_ref(w, ino, nk, &t, false);
                Ok(before - nbytes_of(&h) - nbytes_of(&t))
            }
        }
    }

    fn data_ref_of(ino: Inode, key_off: u64, fe: &FileExtentItem) -> Option<(u64, u64, RefKey)> {
        match fe.body {
            FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                ..
            } if disk_bytenr != 0 => Some((
                disk_bytenr,
                disk_num_bytes,
                RefKey::Data {
                    root: ino.root,
                    ino: ino.ino,
                    offset: key_off.wrapping_sub(offset),
                },
            )),
            _ => None,
        }
    }

    fn drop_data_ref(&self, w: &mut Writer, ino: Inode, key_off: u64, fe: &FileExtentItem) {
        if let Some((b, l, r)) = Self::data_ref_of(ino, key_off, fe) {
            w.refs.add_data_ref(b, l, false, r, -1);
        }
    }

    fn add_data_ref(
        &self,
        w: &mut Writer,
        ino: Inode,
        key_off: u64,
        fe: &FileExtentItem,
        new: bool,
    ) {
        if let Some((b, l, r)) = Self::data_ref_of(ino, key_off, fe) {
            w.refs.add_data_ref(b, l, new, r, 1);
        }
    }

    /// The path of one-descent extent replace: one descent to the leaf where the new item
    /// goes; if every overlapping item is in that leaf and the results fit, change them there.
    /// `None` when it does not apply (the caller falls back).
    fn replace_in_one_leaf(
        &self,
        w: &mut Writer,
        ino: Inode,
        start: u64,
        end: u64,
        new: Option<&(u64, FileExtentItem)>,
    ) -> Result<Option<u64>> {
        let ss = self.disk.sectorsize() as u64;
        let new_bytes = new.map(|(_, f)| f.to_bytes());
        let extra = new_bytes.as_ref().map(|b| b.len() + ITEM_SIZE).unwrap_or(0)
            + FileExtentItem::SIZE
            + ITEM_SIZE;
        let key = Key::new(ino.ino, EXTENT_DATA_KEY, start);
        let path = w.search_mut(
            ino.root,
            &key,
            Intent::Insert {
                items: 2,
                data_len: extra - 2 * ITEM_SIZE,
            },
        )?;
        let leaf = path.leaf();
        let blk = w.dirty_block(leaf)?;
        let n = blk.nritems();
        // First candidate: the item before the slot may overlap the start.
        let mut first = path.slot();
        if first > 0 {
            let k = blk.key(first - 1);
            if k.objectid == ino.ino && k.ty == EXTENT_DATA_KEY {
                first -= 1;
            }
        } else if start > 0 && self.extent_before_leaf_overlaps(w, ino, start, ss)? {
            // The slot is the leaf's first (the search may have split the leaf there): the
            // extent before `start` is in the previous leaf, and overlaps. Fall back.
            return give_up(w, ino.root, &path);
        }
        let Some((cuts, slot)) = scan_cuts(&blk, leaf, first, ino, start, end, ss)? else {
            return Ok(None);
        };
        // If the scan reached the end of the leaf, the next leaf may hold more: fall back.
        // The path's nodes give a lower bound of the next leaf's first key without a search
        // (a search could meet this leaf while it is a new, still empty one).
        if slot == n {
            if let Some(nk) = next_key_on_path(w, &path)? {
                if nk < Key::new(ino.ino, EXTENT_DATA_KEY, end) {
                    return give_up(w, ino.root, &path);
                }
            }
        }
        // A leaf emptied with nothing to insert must leave its parent: the general path does it.
        let deletes = cuts.iter().filter(|c| matches!(c.3, Cut::Delete)).count();
        let adds = cuts
            .iter()
            .filter(|c| matches!(c.3, Cut::Split(..)))
            .count()
            + usize::from(new.is_some());
        if deletes == n && adds == 0 {
            return give_up(w, ino.root, &path);
        }
        // Apply in the leaf. (Let go of the snapshot of the leaf first: a block a reader still
        // holds is copied on change.)
        drop(blk);
        let mut inserts: Vec<(Key, Vec<u8>)> = Vec::new();
        let removed = self.apply_cuts(w, ino, leaf, cuts, &mut inserts)?;
        if let (Some((off, _)), Some(b)) = (new, new_bytes) {
            inserts.push((Key::new(ino.ino, EXTENT_DATA_KEY, *off), b));
        }
        insert_sorted(w, leaf, inserts)?;
        // The leaf's first key may have changed; carry it up.
        w.fix_first_key(&path)?;
        Ok(Some(removed))
    }

    /// For [`Self::replace_in_one_leaf`] when the insert slot is its leaf's first: whether the
    /// file's extent before `start`, in the previous leaf, is inline or reaches past `start`.
    /// (The lookup does not enter the descended leaf, which may be a new empty one.)
    fn extent_before_leaf_overlaps(
        &self,
        w: &mut Writer,
        ino: Inode,
        start: u64,
        ss: u64,
    ) -> Result<bool> {
        let root = w.current_root(ino.root)?;
        let before = Key::new(ino.ino, EXTENT_DATA_KEY, start - 1);
        if let Some(it) = crate::ctree::lookup_le(&self.disk, &root, &before)? {
            if it.key.objectid == ino.ino && it.key.ty == EXTENT_DATA_KEY {
                let fe = FileExtentItem::parse(it.data()).map_err(|e| it.annotate(e))?;
                let prev = FileExtent {
                    start: it.key.offset,
                    item: fe,
                };
                if matches!(prev.item.body, FileExtentBody::Inline(_)) || prev.end(ss) > start {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Apply phase of [`Self::replace_in_one_leaf`]: each cut done in `leaf`, from the last
    /// slot backwards so earlier slots stay valid, with its data ref changes; the tails of
    /// split items go to `inserts`. Returns the bytes the cuts removed from the file's nbytes.
    fn apply_cuts(
        &self,
        w: &mut Writer,
        ino: Inode,
        leaf: u64,
        cuts: Vec<SlotCut>,
        inserts: &mut Vec<(Key, Vec<u8>)>,
    ) -> Result<u64> {
        let mut removed = 0;
        for (slot, k, fe, c) in cuts.into_iter().rev() {
            let before = nbytes_of(&fe);
            match c {
                Cut::Delete => {
                    w.modify(leaf, |buf| LeafMut::trusted(buf)?.delete_items(slot, 1))?;
                    self.drop_data_ref(w, ino, k.offset, &fe);
                    removed += before;
                }
                Cut::KeepHead(h) => {
                    let b = h.to_bytes();
                    w.modify(leaf, |buf| {
                        LeafMut::trusted(buf)?
                            .item_data_mut(slot)?
                            .copy_from_slice(&b);
                        Ok(())
                    })?;
                    removed += before - nbytes_of(&h);
                }
                Cut::KeepTail(nk, t) => {
                    let b = t.to_bytes();
                    let nkey = Key::new(ino.ino, EXTENT_DATA_KEY, nk);
                    w.modify(leaf, |buf| {
                        let mut l = LeafMut::trusted(buf)?;
                        l.set_key(slot, nkey)?;
                        l.item_data_mut(slot)?.copy_from_slice(&b);
                        Ok(())
                    })?;
                    removed += before - nbytes_of(&t);
                }
                Cut::Split(h, nk, t) => {
                    let b = h.to_bytes();
                    w.modify(leaf, |buf| {
                        LeafMut::trusted(buf)?
                            .item_data_mut(slot)?
                            .copy_from_slice(&b);
                        Ok(())
                    })?;
                    self.add_data_ref(w, ino, nk, &t, false);
                    removed += before - nbytes_of(&h) - nbytes_of(&t);
                    inserts.push((Key::new(ino.ino, EXTENT_DATA_KEY, nk), t.to_bytes()));
                }
            }
        }
        Ok(removed)
    }

    /// Reads the file's current content in `[from, to)` (zeros past EOF or in holes).
    fn read_range(&self, ino: Inode, from: u64, to: u64) -> Result<Vec<u8>> {
        let mut v = self.read(ino, from, (to - from) as usize)?;
        v.resize((to - from) as usize, 0);
        Ok(v)
    }

    /// Before the file grows past `new_start`: the bytes between the old EOF and the end of its
    /// sector may hold stale data on disk (the kernel, like butter, zeroes them when a file grows,
    /// not when it shrinks). Zero them.
    fn zero_eof_tail(&self, ino: Inode, new_start: u64) -> Result<()> {
        let item = self.inode_item(ino)?;
        let ss = self.disk.sectorsize() as u64;
        let size = item.size;
        if size % ss == 0 || new_start <= size {
            return Ok(());
        }
        let z_end = (size.div_ceil(ss) * ss).min(new_start);
        let stale = self
            .file_extents(ino, size, size + 1)?
            .iter()
            .any(|x| match x.item.body {
                FileExtentBody::Extent { disk_bytenr, .. } => {
                    disk_bytenr != 0
                        && x.item.ty == FILE_EXTENT_REG
                        && x.start <= size
                        && x.end(ss) > size
                }
                FileExtentBody::Inline(_) => false,
            });
        if stale {
            self.write(ino, size, &vec![0u8; (z_end - size) as usize])?;
        }
        Ok(())
    }

    /// Writes data at `offset`. Returns the bytes written.
    ///
    /// The sectors written are range-locked for the whole write (crate::inode::ordered), so
    /// overlapping writes to a file happen one after the other; regular extents are written
    /// as ordered extents, their data without the writer lock.
    pub(crate) fn write(&self, ino: Inode, offset: u64, data: &[u8]) -> Result<usize> {
        self.write_with(ino, offset, data, None)
    }

    /// [`Core::write`] of `data` compressed already by [`Precompressed::new`] (on another
    /// thread, say): where the file is compressed with the same algorithm and level, those
    /// bytes are stored (an inline extent, or the extents' pieces) and nothing is compressed
    /// here; elsewhere `data` is written as by [`Core::write`]. Not gathered for delayed
    /// allocation: the data goes to the device now.
    pub(crate) fn write_precompressed(
        &self,
        ino: Inode,
        offset: u64,
        data: &[u8],
        ahead: &Precompressed,
    ) -> Result<usize> {
        self.write_with(ino, offset, data, Some(ahead))
    }

    fn write_with(
        &self,
        ino: Inode,
        offset: u64,
        data: &[u8],
        ahead: Option<&Precompressed>,
    ) -> Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        self.require_rw_subvol(ino.root)?;
        self.settle_prealloc(ino)?;
        if ahead.is_none()
            && (self.ordered.try_append(ino, offset, data)
                || self.try_start_delalloc(ino, offset, data)?)
        {
            return Ok(data.len());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|e| *e <= i64::MAX as u64)
            .ok_or_else(|| Error::Invalid("write past the largest file size".into()))?;
        let ss = self.disk.sectorsize() as u64;
        let mi = self.max_inline as u64;
        let b = end.div_ceil(ss) * ss;
        // An inline extent is rewritten whole: a write that meets one locks from 0.
        let mut lock_from = if offset <= mi { 0 } else { offset / ss * ss };
        let mut tail_zeroed = false;
        let (guard, item, has_inline) = loop {
            let guard = self.ordered.lock(ino, lock_from, b);
            let item = self.inode_item(ino)?;
            if item.mode & 0o170000 != 0o100000 {
                return Err(Error::Invalid(format!(
                    "write to inode {} that is not a regular file",
                    ino.ino
                )));
            }
            if item.flags & INODE_IMMUTABLE != 0
                || (item.flags & INODE_APPEND != 0 && offset != item.size)
            {
                crate::inode::flags::require_changeable(&item, ino)?;
            }
            if offset > item.size && item.size % ss != 0 && !tail_zeroed {
                // Zeroing the stale tail of the last sector is a write of its own, and its
                // sector may be one this write locks.
                drop(guard);
                self.zero_eof_tail(ino, offset)?;
                tail_zeroed = true;
                continue;
            }
            let has_inline = self
                .file_extents(ino, 0, 1)?
                .first()
                .is_some_and(|x| matches!(x.item.body, FileExtentBody::Inline(_)));
            if has_inline && lock_from > 0 {
                lock_from = 0;
                continue;
            }
            break (guard, item, has_inline);
        };
        // (The growth is noted for the fsync log where the new size is recorded: write_inline
        // notes the whole file, finish_ordered the range past the size it finds.)
        let new_size = item.size.max(end);
        // Only a small file can stay inline; only then is it worth looking at all its extents
        // (an extent past EOF, e.g. preallocated, keeps it out of line). Holes do not count.
        // Compressed, a file short of a sector may stay inline too (as the kernel's does)
        // when its compressed bytes fit; a small one is compressed when that makes it smaller.
        let compression = self.compression_for(ino, &item)?;
        let compressing = compression.filter(|_| new_size < ss);
        let stays_inline = (new_size <= mi || compressing.is_some())
            && (item.size == 0 || has_inline)
            && !self.file_extents(ino, 0, u64::MAX)?.iter().any(|x| {
                matches!(x.item.body, FileExtentBody::Extent { disk_bytenr, .. } if disk_bytenr != 0)
            });
        if stays_inline {
            // The whole file stays inline.
            let mut content = self.read_range(ino, 0, item.size)?;
            content.resize(new_size as usize, 0);
            content[offset as usize..end as usize].copy_from_slice(data);
            let packed = match compressing {
                Some(c) => match ahead.and_then(|p| p.pieces_for(c, content.len())) {
                    // Compressed ahead: the whole file is this write's data.
                    Some([z]) if offset == 0 => z.clone(),
                    _ => crate::format::compress::compress(c, &content, ss as u32),
                }
                .filter(|z| z.len() < content.len() && z.len() as u64 <= mi)
                .map(|z| (c.code(), z)),
                None => None,
            };
            if new_size <= mi || packed.is_some() {
                self.op(true, |w| self.write_inline(w, ino, &content, packed))?;
                return Ok(data.len());
            }
        }
        // A write that starts past the first sector turns an inline extent into that sector
        // alone (what lies between stays a hole, as on the kernel's btrfs).
        let has_inline = if has_inline && offset >= ss {
            self.uninline(ino, Some(&guard))?;
            false
        } else {
            has_inline
        };
        // Regular extents over the sector-aligned range; an inline extent is folded in.
        let a = if has_inline { 0 } else { offset / ss * ss };
        // A write of whole sectors is written from the caller's bytes as they are: no copy
        // (of up to a megabyte) while the write holds the gate.
        let buf: std::borrow::Cow<'_, [u8]> = if a == offset && b == end {
            std::borrow::Cow::Borrowed(data)
        } else {
            let mut buf = vec![0u8; (b - a) as usize];
            if a < offset || has_inline {
                let head_end = offset.min(item.size);
                if head_end > a {
                    let h = self.read_range(ino, a, head_end)?;
                    buf[..h.len()].copy_from_slice(&h);
                }
            }
            if b > end && end < item.size {
                let t = self.read_range(ino, end, b.min(item.size))?;
                let o = (end - a) as usize;
                buf[o..o + t.len()].copy_from_slice(&t);
            }
            let o = (offset - a) as usize;
            buf[o..o + data.len()].copy_from_slice(data);
            std::borrow::Cow::Owned(buf)
        };
        let nosum = item.flags & INODE_NODATASUM != 0;
        let nocow = item.flags & INODE_NODATACOW != 0 && nosum;
        // A file with checksums is written in place too where it meets a preallocated extent
        // (as the kernel does for a file it marked PREALLOC): the write fills the space the
        // fallocate reserved, and gets checksums. Compressed writes are copied, as ever.
        let into_prealloc = !nosum
            && ahead.is_none()
            && compression.is_none()
            && item.flags & INODE_PREALLOC != 0
            && self
                .file_extents(ino, a, b)?
                .iter()
                .any(|x| x.item.ty == FILE_EXTENT_PREALLOC);
        if (nocow || into_prealloc) && !has_inline {
            // In place where the file alone owns the extent; the rest copied on write.
            for (s, e) in self.write_nocow(ino, a, &buf, end, !nosum)? {
                let sub = &buf[(s - a) as usize..(e - a) as usize];
                self.write_extents(ino, s, sub, end.min(e), false, Some(&guard), nosum)?;
            }
            return Ok(data.len());
        }
        if !has_inline && !nosum {
            if let Some(c) = compression {
                // Compressed ahead: the pieces of this write's data, from a sector, padded with
                // zeros as `buf` is (no old bytes after its end).
                let ahead = ahead
                    .filter(|_| a == offset && (b == end || end >= item.size))
                    .and_then(|p| p.pieces_for(c, data.len()));
                self.write_compressed(ino, a, &buf, end, c, &guard, ahead)?;
                return Ok(data.len());
            }
        }
        self.write_extents(ino, a, &buf, end, has_inline, Some(&guard), nosum)?;
        Ok(data.len())
    }

    /// The inline extent of `ino` becomes a regular extent of the file's first sector, the
    /// rest of the file staying holes (as the kernel turns it when a write or an fallocate
    /// reaches past it), under the caller's range lock `guard` when it holds one.
    fn uninline(
        &self,
        ino: Inode,
        guard: Option<&crate::inode::ordered::RangeGuard<'_>>,
    ) -> Result<()> {
        let ss = self.disk.sectorsize() as u64;
        let item = self.inode_item(ino)?;
        let n = item.size.min(ss);
        let mut buf = self.read_range(ino, 0, n)?;
        buf.resize(ss as usize, 0);
        self.write_extents(
            ino,
            0,
            &buf,
            n,
            true,
            guard,
            item.flags & INODE_NODATASUM != 0,
        )
    }

    /// Plain extents for sector-aligned `buf` at `a` (a piece a compressed write keeps
    /// uncompressed), under the write's range lock `guard`.
    pub(crate) fn write_extents_plain(
        &self,
        ino: Inode,
        a: u64,
        buf: &[u8],
        size_to: u64,
        guard: &crate::inode::ordered::RangeGuard<'_>,
    ) -> Result<()> {
        self.write_extents(ino, a, buf, size_to, false, Some(guard), false)
    }

    /// A write in place, as the kernel's run_delalloc_nocow does it: sector-aligned `buf` at
    /// file offset `a` goes into the extents the file alone owns ([`Core::can_nocow`]); a
    /// preallocated part written becomes a regular extent (the item split as needed). With
    /// `sums` (a file with checksums) only preallocated extents are written in place, and
    /// what goes there gets its checksums. Returns the file ranges left for copy on write
    /// (holes, shared extents, ...). The file grows to at most `size_to` with what went in
    /// place.
    fn write_nocow(
        &self,
        ino: Inode,
        a: u64,
        buf: &[u8],
        size_to: u64,
        sums: bool,
    ) -> Result<Vec<(u64, u64)>> {
        let ss = self.disk.sectorsize() as u64;
        let b = a + buf.len() as u64;
        self.op(true, |w| {
            let last_snapshot = w.tree_state(ino.root)?.last_snapshot;
            let mut item = self.inode_item_raw(ino)?;
            let mut cow: Vec<(u64, u64)> = Vec::new();
            let mut push_cow = |s: u64, e: u64| match cow.last_mut() {
                Some(l) if l.1 == s => l.1 = e,
                _ => cow.push((s, e)),
            };
            let mut pos = a;
            let mut grown_to = 0;
            let mut in_place = false;
            for x in self.file_extents(ino, a, b)? {
                let xs = x.start.max(pos);
                let xe = x.end(ss).min(b);
                if xs >= xe {
                    continue;
                }
                if xs > pos {
                    push_cow(pos, xs);
                }
                pos = xe;
                let FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    ..
                } = x.item.body
                else {
                    push_cow(xs, xe);
                    continue;
                };
                if (sums && x.item.ty != FILE_EXTENT_PREALLOC)
                    || !self.can_nocow(w, ino, &x, last_snapshot)?
                {
                    push_cow(xs, xe);
                    continue;
                }
                let phys = disk_bytenr + offset + (xs - x.start);
                let part = &buf[(xs - a) as usize..(xe - a) as usize];
                self.disk.write_logical(phys, part)?;
                if sums {
                    Self::put_sums(w, phys, xe - xs, &self.sector_sums(part))?;
                }
                in_place = true;
                grown_to = grown_to.max(xe.min(size_to));
                if x.item.ty == FILE_EXTENT_PREALLOC {
                    let mut fe = x.item.clone();
                    fe.ty = FILE_EXTENT_REG;
                    fe.generation = w.transid;
                    fe.body = FileExtentBody::Extent {
                        disk_bytenr,
                        disk_num_bytes,
                        offset: offset + (xs - x.start),
                        num_bytes: xe - xs,
                    };
                    let (removed, added) =
                        self.replace_extents(w, ino, xs, xe, Some((xs, fe.clone())))?;
                    self.add_data_ref(w, ino, xs, &fe, false);
                    item.nbytes = item.nbytes - removed.min(item.nbytes) + added;
                } else {
                    w.log.note_change(ino, xs, xe);
                }
            }
            if pos < b {
                push_cow(pos, b);
            }
            if in_place {
                if grown_to > item.size {
                    w.log.note_change(ino, item.size, grown_to);
                    item.size = grown_to;
                }
                Self::touch(w, &mut item, true);
                self.write_inode(w, ino, &item)?;
            }
            Ok(cow)
        })
    }

    /// Whether file extent `x` of `ino` (NODATACOW) can be written in place, the kernel's
    /// can_nocow_file_extent: a regular or preallocated extent, not a hole, not compressed
    /// or encoded, whose file extent item and extent are newer than the subvolume's last
    /// snapshot, referenced by this file alone, without checksums.
    fn can_nocow(
        &self,
        w: &mut Writer,
        ino: Inode,
        x: &FileExtent,
        last_snapshot: u64,
    ) -> Result<bool> {
        let FileExtentBody::Extent {
            disk_bytenr,
            offset,
            num_bytes,
            ..
        } = x.item.body
        else {
            return Ok(false);
        };
        if !(x.item.ty == FILE_EXTENT_REG || x.item.ty == FILE_EXTENT_PREALLOC)
            || disk_bytenr == 0
            || x.item.compression != 0
            || x.item.encryption != 0
            || x.item.other_encoding != 0
            || x.item.generation <= last_snapshot
        {
            return Ok(false);
        }
        let owner = RefKey::Data {
            root: ino.root,
            ino: ino.ino,
            offset: x.start.wrapping_sub(offset),
        };
        if !w.data_extent_exclusive(disk_bytenr, owner, last_snapshot)? {
            return Ok(false);
        }
        let sums = self.data_csums(disk_bytenr + offset, num_bytes)?;
        Ok(sums.iter().all(|c| c.is_none()))
    }

    /// Replaces the whole (small) content with one inline extent: `packed` (compression code
    /// and bytes) when it is stored compressed, else plain.
    fn write_inline(
        &self,
        w: &mut Writer,
        ino: Inode,
        content: &[u8],
        packed: Option<(u8, Vec<u8>)>,
    ) -> Result<()> {
        let mut item = self.inode_item(ino)?;
        let key = Key::new(ino.ino, EXTENT_DATA_KEY, 0);
        let old = w.read_item(ino.root, &key)?;
        w.log.note_change(ino, 0, u64::MAX);
        if packed.is_some() {
            w.log.note_needs_commit(ino);
        }
        let (compression, body) = packed.unwrap_or((0, content.to_vec()));
        if compression == COMPRESS_LZO {
            w.sb.incompat_flags |= INCOMPAT_COMPRESS_LZO;
        } else if compression == COMPRESS_ZSTD {
            w.sb.incompat_flags |= INCOMPAT_COMPRESS_ZSTD;
        }
        let fe = FileExtentItem {
            generation: w.transid,
            ram_bytes: content.len() as u64,
            compression,
            encryption: 0,
            other_encoding: 0,
            ty: FILE_EXTENT_INLINE,
            body: FileExtentBody::Inline(body),
        };
        if let Some(old) = old {
            let ofe = FileExtentItem::parse(&old)?;
            item.nbytes -= nbytes_of(&ofe).min(item.nbytes);
            self.drop_data_ref(w, ino, 0, &ofe);
        }
        w.replace_item(ino.root, key, &fe.to_bytes())?;
        item.nbytes += content.len() as u64;
        item.size = content.len() as u64;
        Self::touch(w, &mut item, true);
        self.write_inode(w, ino, &item)
    }

    /// Writes sector-aligned `buf` at file offset `a` into new extents, each an ordered extent
    /// (crate::inode::ordered): allocated and held under the writer lock, its data written and
    /// checksummed without it, then recorded under it. Extents up to [`crate::inode::ordered::SHORT_WRITEBACK`] take
    /// all three steps under one writer lock: their writeback is shorter than taking the lock
    /// twice. The file grows to at least `size_to` (its size when the last extent goes in, so
    /// a truncate that ran meanwhile counts as having come first). `guard`: the write's range
    /// lock, which gets the ordered-extent range bits.
    #[allow(clippy::too_many_arguments)]
    fn write_extents(
        &self,
        ino: Inode,
        a: u64,
        buf: &[u8],
        size_to: u64,
        had_inline: bool,
        guard: Option<&crate::inode::ordered::RangeGuard<'_>>,
        nosum: bool,
    ) -> Result<()> {
        let writeback = |bytenr: u64, chunk: &[u8]| -> Result<Vec<u8>> {
            self.disk.write_logical(bytenr, chunk)?;
            if nosum {
                // NODATASUM: no checksums, none logged or stored.
                return Ok(Vec::new());
            }
            Ok(self.sector_sums(chunk))
        };
        let mut done = 0u64;
        let total = buf.len() as u64;
        while done < total {
            let len = (total - done).min(MAX_EXTENT);
            let chunk = &buf[done as usize..(done + len) as usize];
            let file_off = a + done;
            let reach = if done + len == total {
                size_to
            } else {
                (file_off + len).min(size_to)
            };
            let range = (file_off, len, reach);
            let drop_inline = had_inline && done == 0;
            // The completion waits (crate::inode::ordered) unless an inline extent is folded in.
            let defer = guard.filter(|_| !drop_inline);
            if let Some(g) = guard {
                g.start_ordered(file_off, file_off + len);
            }
            let r = if len
                <= self
                    .unlocked_writeback_above
                    .load(std::sync::atomic::Ordering::Relaxed)
            {
                self.op(true, |w| {
                    let bytenr =
                        w.alloc_data_or_commit_for(len, for_file(ino, file_off), defer.is_some())?;
                    match (writeback(bytenr, chunk), defer) {
                        (Ok(sums), Some(g)) => {
                            Self::defer_ordered(w, g, range, bytenr, sums);
                            Ok(true)
                        }
                        (Ok(sums), None) => self
                            .finish_ordered(w, ino, range, bytenr, &sums, drop_inline, None)
                            .map(|()| false),
                        (Err(e), Some(_)) => {
                            w.allocator.release_held(bytenr, len);
                            Err(e)
                        }
                        (Err(e), None) => {
                            // Nothing references the space: give it back after the commit,
                            // as freed space always comes back.
                            w.allocator.pin(bytenr, len)?;
                            Err(e)
                        }
                    }
                })
            } else {
                self.write_ordered_unlocked(ino, range, chunk, drop_inline, defer, &writeback)
            };
            if let Some(g) = guard {
                if !matches!(r, Ok(true)) {
                    g.finish_ordered(file_off, file_off + len);
                }
            }
            r?;
            done += len;
        }
        Ok(())
    }

    /// Held data space (see [`crate::space::alloc::BlockGroup::held`]) for `len` bytes of
    /// `ino` at file offset `offset`, whose data is written before its extent goes in the
    /// trees: taken from the shared allocator without the writer lock (crate::space::alloc);
    /// under the writer lock only when no group has room (a chunk or a commit is needed), or
    /// with the legacy allocator.
    pub(crate) fn alloc_data_held(&self, ino: Inode, offset: u64, len: u64) -> Result<u64> {
        if let Some(a) = self.allocator.as_ref().filter(|a| !a.is_legacy()) {
            let want = crate::space::alloc::Want {
                kind: crate::space::alloc::SpaceKind::Data,
                len,
                align: self.disk.sectorsize() as u64,
                file: for_file(ino, offset),
                held: true,
            };
            if let Some(at) = a.alloc_for(&want) {
                return Ok(at);
            }
        }
        self.op(true, |w| {
            w.alloc_data_held_or_commit(len, for_file(ino, offset))
        })
    }

    /// The extent of `range` written at `bytenr` (held) becomes a pending ordered extent of
    /// the write holding `g`: its completion comes later ([`Core::complete_ordered`]).
    fn defer_ordered(
        w: &mut Writer,
        g: &crate::inode::ordered::RangeGuard<'_>,
        (file_off, len, reach): (u64, u64, u64),
        bytenr: u64,
        sums: Vec<u8>,
    ) {
        g.defer(crate::inode::ordered::Pending {
            file_off,
            len,
            reach,
            bytenr,
            sums,
            stamp: crate::format::items::Timespec::now(),
            writing: false,
        });
        w.ordered_pending += 1;
    }

    /// One ordered extent whose data is written without the writer lock; `defer`: the range
    /// lock of a write whose completion waits. Ok(true): deferred.
    fn write_ordered_unlocked(
        &self,
        ino: Inode,
        range: (u64, u64, u64),
        chunk: &[u8],
        drop_inline: bool,
        defer: Option<&crate::inode::ordered::RangeGuard<'_>>,
        writeback: &WritebackFn<'_>,
    ) -> Result<bool> {
        let len = range.1;
        let bytenr = self.alloc_data_held(ino, range.0, len)?;
        // The data goes out of the gate (crate::gate): nothing in the trees changes until
        // the extent is recorded below.
        let written = self.outside_gate(|| writeback(bytenr, chunk));
        let r = written.and_then(|sums| {
            self.op(true, |w| match defer {
                Some(g) => {
                    Self::defer_ordered(w, g, range, bytenr, sums);
                    Ok(true)
                }
                None => {
                    self.finish_ordered(w, ino, range, bytenr, &sums, drop_inline, None)?;
                    // Recorded: an ordinary allocation from now on.
                    w.allocator.claim_held(bytenr, len);
                    Ok(false)
                }
            })
        });
        if r.is_err() {
            // Nothing references the space: it goes back to the free space (on disk it never
            // left it).
            if let Some(a) = &self.allocator {
                a.release_held(bytenr, len);
            }
        }
        r
    }

    /// Delayed allocation (crate::inode::ordered::Delalloc): an append at a sector-aligned end of a
    /// regular file, too big to be inline, starts the file's buffer. The file's pending
    /// extents (a full buffer, an earlier write) are completed first, as any other write
    /// would: the buffer starts at the size the trees hold. The file is checked under the
    /// writer lock, so it cannot change before the buffer exists; later appends join it
    /// without the lock.
    fn try_start_delalloc(&self, ino: Inode, offset: u64, data: &[u8]) -> Result<bool> {
        let ss = self.disk.sectorsize() as u64;
        let mi = self.max_inline as u64;
        if !offset.is_multiple_of(ss)
            || (offset <= mi && data.len() as u64 <= mi)
            || data.len() as u64 > crate::inode::ordered::DELALLOC_APPEND_MAX
            || !self.ordered.delalloc_enabled()
        {
            return Ok(false);
        }
        // A full buffer (this append did not fit) goes to the device without the writer lock
        // first, on the write-back thread when it has room.
        self.flush_delalloc(ino, true)?;
        // The new buffer starts where the file will end once its pending extents are in (a
        // buffer being written back, say): they stay pending. Anything else pending of the
        // file (a write in progress, a lost write-back) and a delayed preallocation are
        // completed first: the buffer must start where the file really ends.
        let behind = self.ordered.appends_behind(ino);
        let mut w = if self.prealloc.has(Some(ino))
            || (behind.is_none() && self.ordered.has_pending(ino))
        {
            self.writer()?
        } else {
            self.writer_keeping_ordered()?
        };
        let item = self.inode_item_raw(ino)?;
        let end = behind.map_or(item.size, |b| b.max(item.size));
        let special = INODE_NODATASUM | INODE_NODATACOW | INODE_IMMUTABLE | INODE_APPEND;
        if item.mode & 0o170000 != 0o100000 || end != offset || item.flags & special != 0 {
            return Ok(false);
        }
        // Space preallocated past the end (KEEP_SIZE) is filled in place by an ordinary
        // write, not replaced by a new extent at write-back.
        if item.flags & INODE_PREALLOC != 0 && !self.file_extents(ino, offset, u64::MAX)?.is_empty()
        {
            return Ok(false);
        }
        // A compressed file's appends gather too, and are compressed at their write-back;
        // one still shorter than a sector is written as it comes (it may stay inline,
        // compressed).
        if offset == 0 && (data.len() as u64) < ss && self.compression_for(ino, &item)?.is_some() {
            return Ok(false);
        }
        let free = self.data_space_left(&mut w)?;
        Ok(self
            .ordered
            .start_buffer(ino, offset, data, free, behind.is_some()))
    }

    /// Writes back the delayed-allocation buffer `d` of `ino` (under the writer lock): a new
    /// extent, its data and checksums. Returns the pending ordered extent it makes, or (the
    /// inner error) the failure of the data write, whose space went back: the buffer is
    /// lost, nothing else changed.
    fn write_back_delalloc(
        &self,
        w: &mut Writer,
        ino: Inode,
        d: &crate::inode::ordered::Delalloc,
        commit_ok: bool,
    ) -> Result<Result<crate::inode::ordered::Pending>> {
        let ss = self.disk.sectorsize() as u64;
        let mut buf = d.data.clone();
        buf.resize((buf.len() as u64).div_ceil(ss) as usize * ss as usize, 0);
        let len = buf.len() as u64;
        let file = for_file(ino, d.start);
        let bytenr = if commit_ok {
            w.alloc_data_held_or_commit(len, file)?
        } else {
            w.alloc_data_for(len, file, true)?
        };
        let written = self.disk.write_logical(bytenr, &buf);
        if let Err(e) = written {
            w.allocator.release_held(bytenr, len);
            return Ok(Err(e));
        }
        let sums = self.sector_sums(&buf);
        Ok(Ok(crate::inode::ordered::Pending {
            file_off: d.start,
            len,
            reach: d.start + d.data.len() as u64,
            bytenr,
            sums,
            stamp: d.stamp,
            writing: false,
        }))
    }

    /// Writes `ino`'s delayed-allocation buffer back with the writer lock held only to
    /// allocate its extent and register it as a pending ordered extent (writeback split from
    /// ordered extent completion: writeback does not stop other operations): the data goes to
    /// the device without it, as an ordinary write's does. Whoever needs the extent meanwhile
    /// (a completion, the fsync log) waits for its data. When the space cannot be had without
    /// a commit, the buffer stays for a write-back under the lock.
    pub(crate) fn flush_delalloc_unlocked(&self, ino: Inode) -> Result<()> {
        self.flush_delalloc(ino, false)
    }

    /// [`Core::flush_delalloc_unlocked`]; with `background`, the data goes to the device on
    /// the write-back thread ([`crate::inode::ordered::Writeback`]) when it has room, and this returns once the
    /// extent is registered: the append that found the buffer full starts the next one while
    /// the last one is written (as the kernel's writeback runs beside the writer).
    fn flush_delalloc(&self, ino: Inode, background: bool) -> Result<()> {
        if !self.ordered.has_delalloc(ino) {
            return Ok(());
        }
        // A compressed file's buffer goes back in compressed pieces under the writer lock
        // (Core::write_back_compressed), at the next completion.
        if self.buffer_compression(ino)?.is_some() {
            return Ok(());
        }
        let ss = self.disk.sectorsize() as u64;
        let (d, bytenr, len) = {
            let mut w = self.writer_keeping_ordered()?;
            let Some(d) = self.ordered.begin_flush(ino) else {
                return Ok(());
            };
            let len = (d.data.len() as u64).div_ceil(ss) * ss;
            let at = w.alloc_data_for(len, for_file(ino, d.start), true);
            let at = match at {
                Ok(at) => at,
                Err(e) => {
                    self.ordered.untake_delalloc(ino, d);
                    return match e {
                        Error::NoSpace(_) => Ok(()),
                        e => Err(e),
                    };
                }
            };
            self.ordered.flush_registered(ino, &d, at, len);
            w.ordered_pending += 1;
            (d, at, len)
        };
        let job = crate::inode::ordered::BufferWrite {
            ino,
            start: d.start,
            bytenr,
            len,
            data: d.data,
        };
        let job = if background {
            match self.writeback.send(&self.disk, &self.ordered, job) {
                Ok(()) => return Ok(()),
                Err(job) => job,
            }
        } else {
            job
        };
        // Out of the gate for the data I/O (crate::gate): the extent is pending and `writing`,
        // and whoever completes it meanwhile waits for `flush_written`, which needs no lock.
        let failed = self.outside_gate(|| Ok(job.run(&self.disk, &self.ordered)))?;
        if failed {
            // Its space goes back, and the error to the next fsync, under the writer lock.
            let mut w = self.writer_keeping_ordered()?;
            self.release_lost(&mut w);
        }
        Ok(())
    }

    /// The data checksums of `data`, one per sector, as the checksum tree stores them.
    pub(crate) fn sector_sums(&self, data: &[u8]) -> Vec<u8> {
        crate::inode::ordered::sector_sums(&self.disk, data)
    }

    /// Gives back the held space of buffers whose write-back failed without the writer lock,
    /// and keeps their errors for their files' next fsync.
    pub(crate) fn release_lost(&self, w: &mut Writer) {
        for (ino, bytenr, len, why) in self.ordered.take_lost() {
            w.allocator.release_held(bytenr, len);
            w.ordered_pending = w.ordered_pending.saturating_sub(1);
            self.ordered.note_write_error(ino, why);
        }
    }

    /// A buffer whose data write failed: its appends are lost (the file keeps the size the
    /// trees give it), and the file's next fsync reports the error. (The caller is done with
    /// the buffer.)
    fn lose_delalloc(&self, ino: Inode, d: &crate::inode::ordered::Delalloc, e: &Error) {
        let why = format!(
            "writing back {} bytes appended at {} to inode {} (subvolume {}): {e}",
            d.data.len(),
            d.start,
            ino.ino,
            ino.root
        );
        log::error!("{why}; the appends are lost, the file's next fsync fails");
        self.ordered.note_write_error(ino, why);
    }

    /// An fsync of `ino` writes back its delayed-allocation buffer as a pending ordered
    /// extent (which the log then takes from memory), without completing it. True: the fsync
    /// must commit instead, the buffer left for the commit to write back: a compressed file's
    /// (the log does not carry compressed extents) or one whose space cannot be had without a
    /// commit. (An fsync holds the gate shared: it must not complete other files' writes.)
    pub(crate) fn write_back_for_fsync(&self, w: &mut Writer, ino: Inode) -> Result<bool> {
        for (i, d) in self.ordered.take_delalloc(Some(ino)) {
            match self.buffer_compression(i) {
                Ok(None) => {}
                Ok(Some(_)) => {
                    self.ordered.untake_delalloc(i, d);
                    return Ok(true);
                }
                Err(e) => {
                    // Nothing changed: the buffer stays for a later write-back.
                    self.ordered.untake_delalloc(i, d);
                    return Err(e);
                }
            }
            match self.write_back_delalloc(w, i, &d, false) {
                Ok(Ok(p)) => {
                    self.ordered.add_pending(i, p);
                    w.ordered_pending += 1;
                    self.ordered.delalloc_done(i, &d);
                }
                Ok(Err(e)) => {
                    self.lose_delalloc(i, &d, &e);
                    self.ordered.delalloc_done(i, &d);
                }
                Err(Error::NoSpace(_)) => {
                    self.ordered.untake_delalloc(i, d);
                    return Ok(true);
                }
                Err(e) => {
                    self.ordered.delalloc_done(i, &d);
                    w.abort(format!(
                        "writing back {} bytes appended to inode {} (subvolume {}): {e}",
                        d.data.len(),
                        i.ino,
                        i.root
                    ));
                    return Err(e);
                }
            }
        }
        Ok(false)
    }

    /// Completes every pending ordered extent (crate::inode::ordered), oldest first per inode: each
    /// goes into the trees as [`Core::finish_ordered`] puts it, with the time its write
    /// returned. A failure may leave the trees half changed and writes that returned
    /// unrecorded: the transaction is aborted (the image keeps its last commit and the fsync
    /// log, which has what was fsynced), the rest are abandoned and the error returned.
    pub(crate) fn complete_ordered(&self, w: &mut Writer) -> Result<()> {
        self.complete_ordered_for(w, None)
    }

    /// [`Core::complete_ordered`] for `ino` alone: its pending ordered extents and its
    /// delayed-allocation buffer, what a read or a change of that inode needs; other files'
    /// writes complete later (a commit, a change that needs them all, their own readers).
    pub(crate) fn complete_ordered_of(&self, w: &mut Writer, ino: Inode) -> Result<()> {
        self.complete_ordered_for(w, Some(ino))
    }

    fn complete_ordered_for(&self, w: &mut Writer, only: Option<Inode>) -> Result<()> {
        self.release_lost(w);
        let mut failed = None;
        for (ino, list) in self.ordered.take_pending(only) {
            w.ordered_pending = w.ordered_pending.saturating_sub(list.len());
            for p in &list {
                if failed.is_none() {
                    match self.complete_pending(w, ino, p) {
                        Ok(()) => continue,
                        Err(e) => {
                            w.abort(format!(
                                "completing the write of {} bytes at {} of inode {} (subvolume \
                                 {}): {e}",
                                p.len, p.file_off, ino.ino, ino.root
                            ));
                            failed = Some(e);
                            // Its item may be in a tree: its space stays held.
                            continue;
                        }
                    }
                }
                w.allocator.release_held(p.bytenr, p.len);
            }
            self.ordered.completed(ino, &list);
        }
        // Then the delayed allocations (no pending extent is left, so a commit for space may
        // run; for one inode's, other files' may be left: no commit then, and everything is
        // completed instead when the space cannot be had without one).
        for (ino, d) in self.ordered.take_delalloc(only) {
            if failed.is_none() {
                // A compressed file's buffer goes back compressed, in a completion of every
                // pending extent only (it may commit for space); a buffer that needs a commit
                // for its space, the same.
                let r = match self.buffer_compression(ino) {
                    Ok(Some(_)) if only.is_some() => {
                        self.ordered.untake_delalloc(ino, d);
                        return self.complete_ordered_for(w, None);
                    }
                    Ok(Some(c)) => self.write_back_compressed(w, ino, &d, c),
                    Ok(None) => match self.write_back_delalloc(w, ino, &d, only.is_none()) {
                        Err(Error::NoSpace(_)) if only.is_some() => {
                            self.ordered.untake_delalloc(ino, d);
                            return self.complete_ordered_for(w, None);
                        }
                        back => back.and_then(|p| match p {
                            Ok(p) => self.complete_pending(w, ino, &p),
                            // Only the buffer is lost: nothing changed, the transaction goes
                            // on.
                            Err(e) => {
                                self.lose_delalloc(ino, &d, &e);
                                Ok(())
                            }
                        }),
                    },
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    w.abort(format!(
                        "writing back {} bytes appended to inode {} (subvolume {}): {e}",
                        d.data.len(),
                        ino.ino,
                        ino.root
                    ));
                    failed = Some(e);
                }
            }
            self.ordered.delalloc_done(ino, &d);
        }
        failed.map_or(Ok(()), Err)
    }

    /// A pending extent's completion ([`Self::finish_ordered`]), after which its space is an
    /// ordinary allocation.
    fn complete_pending(
        &self,
        w: &mut Writer,
        ino: Inode,
        p: &crate::inode::ordered::Pending,
    ) -> Result<()> {
        let range = (p.file_off, p.len, p.reach);
        self.finish_ordered(w, ino, range, p.bytenr, &p.sums, false, Some(p.stamp))?;
        w.allocator.claim_held(p.bytenr, p.len);
        Ok(())
    }

    /// An ordered extent's completion: its checksums and its file extent item go into the
    /// trees (replacing what the range held), with the data reference and the inode's nbytes;
    /// the file grows to `reach` if it is smaller. `range`: (file offset, length, reach);
    /// `stamp`: the time of the write (now if `None`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish_ordered(
        &self,
        w: &mut Writer,
        ino: Inode,
        (file_off, len, reach): (u64, u64, u64),
        bytenr: u64,
        sums: &[u8],
        drop_inline: bool,
        stamp: Option<Timespec>,
    ) -> Result<()> {
        let ss = self.disk.sectorsize() as u64;
        Self::put_sums(w, bytenr, len, sums)?;
        let fe = FileExtentItem::regular(w.transid, bytenr, len);
        let mut item = self.inode_item_raw(ino)?;
        if drop_inline {
            w.log.note_change(ino, 0, ss);
            let key = Key::new(ino.ino, EXTENT_DATA_KEY, 0);
            if let Some(old) = w.read_item(ino.root, &key)? {
                let ofe = FileExtentItem::parse(&old)?;
                if matches!(ofe.body, FileExtentBody::Inline(_)) {
                    w.delete_item(ino.root, &key)?;
                    item.nbytes -= nbytes_of(&ofe).min(item.nbytes);
                }
            }
        }
        self.fill_holes(w, ino, &mut item, file_off)?;
        self.record_new_extent(w, ino, &mut item, file_off, fe)?;
        if reach > item.size {
            // See `note_growth`: the part between the old size and this extent changed too.
            w.log.note_change(ino, item.size, reach);
            item.size = reach;
        }
        Self::touch_at(
            w,
            &mut item,
            true,
            stamp.unwrap_or_else(crate::format::items::Timespec::now),
        );
        self.write_inode(w, ino, &item)
    }

    /// The checksums `sums` of a data extent just written at `bytenr` (none for a file
    /// without them), replacing any the range had.
    pub(crate) fn put_sums(w: &mut Writer, bytenr: u64, len: u64, sums: &[u8]) -> Result<()> {
        w.delete_csums(bytenr, len)?;
        if !sums.is_empty() {
            w.insert_csums(bytenr, sums)?;
        }
        Ok(())
    }

    /// A data extent just written at the address `fe` names: its file extent item at
    /// `file_off` over whatever that range held, and its first back reference;
    /// `item.nbytes` follows. Shared by plain and compressed writes.
    pub(crate) fn record_new_extent(
        &self,
        w: &mut Writer,
        ino: Inode,
        item: &mut InodeItem,
        file_off: u64,
        fe: FileExtentItem,
    ) -> Result<()> {
        let FileExtentBody::Extent {
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
        } = fe.body
        else {
            return Err(Error::Internal("a new extent recorded as inline".into()));
        };
        let (removed, added) =
            self.replace_extents(w, ino, file_off, file_off + num_bytes, Some((file_off, fe)))?;
        w.refs.add_data_ref(
            disk_bytenr,
            disk_num_bytes,
            true,
            RefKey::Data {
                root: ino.root,
                ino: ino.ino,
                offset: file_off.wrapping_sub(offset),
            },
            1,
        );
        item.nbytes = item.nbytes - removed.min(item.nbytes) + added;
        Ok(())
    }

    /// Without NO_HOLES: explicit hole items from the current end of the file's extents up to
    /// `to` (a write or truncate past EOF).
    fn fill_holes(&self, w: &mut Writer, ino: Inode, item: &mut InodeItem, to: u64) -> Result<()> {
        if self.disk.sb.has_incompat(INCOMPAT_NO_HOLES) {
            return Ok(());
        }
        let ss = self.disk.sectorsize() as u64;
        let from = item.size.div_ceil(ss) * ss;
        if to <= from {
            return Ok(());
        }
        // Only where no item covers it.
        let covered_to = self
            .file_extents(ino, 0, u64::MAX)?
            .iter()
            .map(|x| x.end(ss))
            .max()
            .unwrap_or(0);
        let from = from.max(covered_to);
        if to <= from {
            return Ok(());
        }
        let hole = FileExtentItem::hole(w.transid, to - from);
        w.log.note_change(ino, from, to);
        w.insert_item(
            ino.root,
            Key::new(ino.ino, EXTENT_DATA_KEY, from),
            &hole.to_bytes(),
        )
    }

    /// Drops every extent at or past `size` (sector rounded up), trimming the one across it.
    pub(crate) fn truncate_extents(&self, w: &mut Writer, ino: Inode, size: u64) -> Result<u64> {
        let ss = self.disk.sectorsize() as u64;
        let cut_at = size.div_ceil(ss) * ss;
        w.log.note_change(ino, size, u64::MAX);
        let mut removed = 0;
        // From `size`, not `cut_at`: an inline extent ends inside the first sector and must be
        // cut to the new size (else a later truncate up shows its stale bytes).
        for x in self.file_extents(ino, size, u64::MAX)? {
            let key = Key::new(ino.ino, EXTENT_DATA_KEY, x.start);
            if let FileExtentBody::Inline(d) = &x.item.body {
                if x.start >= cut_at || size == 0 {
                    w.delete_item(ino.root, &key)?;
                    removed += nbytes_of(&x.item);
                } else if x.item.compression == 0 && (size as usize) < d.len() {
                    let mut fe = x.item.clone();
                    fe.ram_bytes = size;
                    fe.body = FileExtentBody::Inline(d[..size as usize].to_vec());
                    w.replace_item(ino.root, key, &fe.to_bytes())?;
                    removed += d.len() as u64 - size;
                } else if x.item.compression != 0 && size < x.item.ram_bytes {
                    // A compressed inline extent is cut as decoded bytes, stored plain.
                    let plain = crate::format::compress::decompress(
                        x.item.compression,
                        d,
                        x.item.ram_bytes as usize,
                        ss as u32,
                    )?;
                    let mut fe = x.item.clone();
                    fe.ram_bytes = size;
                    fe.compression = 0;
                    fe.body = FileExtentBody::Inline(plain[..size as usize].to_vec());
                    w.replace_item(ino.root, key, &fe.to_bytes())?;
                    removed += x.item.ram_bytes - size;
                }
                continue;
            }
            let ke = x.end(ss);
            if ke <= cut_at {
                continue; // a regular extent ending in the kept last sector
            }
            let c = cut(x.start, &x.item, ke, cut_at, u64::MAX);
            let c = match c {
                Cut::Split(h, _, _) => Cut::KeepHead(h),
                Cut::KeepTail(..) => Cut::Delete,
                c => c,
            };
            removed += self.apply_cut(w, ino, key, &x.item, c)?;
        }
        Ok(removed)
    }

    /// A file grows from `old` to `new` bytes: for the fsync log, the range between is changed
    /// even where no extent item changes (with NO_HOLES the new part is an implicit hole, while
    /// the last commit may have extents there: a truncate down in this transaction dropped
    /// them from the tree, and replay must drop them too).
    fn note_growth(&self, ino: Inode, old: u64, new: u64) -> Result<()> {
        if new > old {
            self.writer()?.log.note_change(ino, old, new);
        }
        Ok(())
    }

    /// truncate(2).
    pub(crate) fn truncate(&self, ino: Inode, size: u64) -> Result<()> {
        self.settle_prealloc(ino)?;
        let item = self.require_inode_changeable(ino)?;
        if item.mode & 0o170000 != 0o100000 {
            return Err(Error::Invalid(format!(
                "truncate of inode {} that is not a regular file",
                ino.ino
            )));
        }
        let ss = self.disk.sectorsize() as u64;
        self.note_growth(ino, item.size, size)?;
        if size > item.size {
            self.zero_eof_tail(ino, size)?;
        }
        if size < item.size && !size.is_multiple_of(ss) {
            // Zero the tail of the last sector so a later extension reads zeros there.
            let sector_end = (size.div_ceil(ss) * ss).min(item.size);
            if sector_end > size {
                let zeros = vec![0u8; (sector_end - size) as usize];
                let inline = self
                    .file_extents(ino, 0, 1)?
                    .first()
                    .is_some_and(|x| matches!(x.item.body, FileExtentBody::Inline(_)));
                if !inline {
                    self.write(ino, size, &zeros)?;
                }
            }
        }
        self.op(size > item.size, |w| {
            let mut item = self.inode_item(ino)?;
            if size < item.size {
                let removed = self.truncate_extents(w, ino, size)?;
                item.nbytes -= removed.min(item.nbytes);
            } else if size > item.size {
                self.fill_holes(w, ino, &mut item, size.div_ceil(ss) * ss)?;
            }
            item.size = size;
            Self::touch(w, &mut item, true);
            self.write_inode(w, ino, &item)
        })
    }

    /// fallocate(2): default (preallocate, grows the size unless KEEP_SIZE), PUNCH_HOLE
    /// (with KEEP_SIZE) and ZERO_RANGE.
    pub(crate) fn fallocate(&self, ino: Inode, mode: u32, offset: u64, len: u64) -> Result<()> {
        self.require_rw_subvol(ino.root)?;
        self.settle_prealloc(ino)?;
        let item = self.inode_item(ino)?;
        if item.flags & INODE_IMMUTABLE != 0
            || (item.flags & INODE_APPEND != 0 && mode & !FALLOC_FL_KEEP_SIZE != 0)
        {
            crate::inode::flags::require_changeable(&item, ino)?;
        }
        if item.mode & 0o170000 != 0o100000 {
            return Err(Error::Invalid("fallocate of a non-regular file".into()));
        }
        if len == 0 {
            return Err(Error::Invalid("fallocate of zero bytes".into()));
        }
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::Invalid("range overflows".into()))?;
        let ss = self.disk.sectorsize() as u64;
        if mode & FALLOC_FL_PUNCH_HOLE != 0 {
            if mode & FALLOC_FL_KEEP_SIZE == 0 {
                return Err(Error::Invalid("PUNCH_HOLE needs KEEP_SIZE".into()));
            }
            // A punch that reaches the end takes the last sector whole (its bytes past the
            // end read as zeros anyway), as the kernel's does: no zeros are written there.
            let to = if end >= item.size && offset <= item.size / ss * ss {
                item.size.div_ceil(ss) * ss
            } else {
                end.min(item.size)
            };
            return self.zero_range(ino, offset, to, false);
        }
        if mode & FALLOC_FL_ZERO_RANGE != 0 {
            self.zero_range(ino, offset, end.min(item.size.max(offset)), true)?;
        } else if mode & !FALLOC_FL_KEEP_SIZE != 0 {
            return Err(Error::Unsupported(format!("fallocate mode {mode:#x}")));
        }
        if mode & FALLOC_FL_KEEP_SIZE == 0 && end > item.size {
            self.note_growth(ino, item.size, end)?;
            self.zero_eof_tail(ino, end)?;
        }
        // Preallocate the holes of the aligned range.
        let a = offset / ss * ss;
        let b = end.div_ceil(ss) * ss;
        let inline = self
            .file_extents(ino, 0, 1)?
            .first()
            .is_some_and(|x| matches!(x.item.body, FileExtentBody::Inline(_)));
        if inline {
            self.uninline(ino, None)?;
        }
        let mut holes: Vec<(u64, u64)> = Vec::new();
        let mut pos = a;
        for x in self.file_extents(ino, a, b)? {
            let real = !matches!(x.item.body, FileExtentBody::Extent { disk_bytenr: 0, .. });
            if !real {
                continue;
            }
            if x.start > pos {
                holes.push((pos, x.start.min(b)));
            }
            pos = pos.max(x.end(ss));
        }
        if pos < b {
            holes.push((pos, b));
        }
        for (hs, he) in holes {
            let mut s = hs;
            while s < he {
                // The largest extent the free space allows, up to the largest a file extent
                // may be.
                let want = (he - s).min(MAX_EXTENT);
                let l = self.op(true, |w| {
                    let (bytenr, l) = w.alloc_data_upto(want, for_file(ino, s))?;
                    let mut item = self.inode_item(ino)?;
                    self.insert_prealloc(w, ino, &mut item, (s, bytenr, l))?;
                    Self::touch(w, &mut item, false);
                    self.write_inode(w, ino, &item)?;
                    Ok(l)
                })?;
                s += l;
            }
        }
        if mode & FALLOC_FL_KEEP_SIZE == 0 && end > item.size {
            self.op(false, |w| {
                let mut item = self.inode_item(ino)?;
                item.size = item.size.max(end);
                Self::touch(w, &mut item, false);
                self.write_inode(w, ino, &item)
            })?;
        }
        Ok(())
    }

    /// A preallocated extent `(file offset, disk start, length)` goes into `ino`'s trees
    /// (holes before it filled where the filesystem keeps hole items), with its data
    /// reference; `item` (written by the caller) gets its nbytes and the PREALLOC flag.
    fn insert_prealloc(
        &self,
        w: &mut Writer,
        ino: Inode,
        item: &mut InodeItem,
        (s, bytenr, l): (u64, u64, u64),
    ) -> Result<()> {
        let fe = FileExtentItem {
            generation: w.transid,
            ram_bytes: l,
            compression: 0,
            encryption: 0,
            other_encoding: 0,
            ty: FILE_EXTENT_PREALLOC,
            body: FileExtentBody::Extent {
                disk_bytenr: bytenr,
                disk_num_bytes: l,
                offset: 0,
                num_bytes: l,
            },
        };
        self.fill_holes(w, ino, item, s)?;
        let (removed, added) = self.replace_extents(w, ino, s, s + l, Some((s, fe)))?;
        w.refs.add_data_ref(
            bytenr,
            l,
            true,
            RefKey::Data {
                root: ino.root,
                ino: ino.ino,
                offset: s,
            },
            1,
        );
        item.nbytes = item.nbytes - removed.min(item.nbytes) + added;
        // The kernel only looks for preallocated extents (to write into them in place) in
        // inodes flagged PREALLOC, and sets it on fallocate too.
        item.flags |= INODE_PREALLOC;
        Ok(())
    }

    /// Delayed preallocation (crate::inode::ordered::Preallocs): an fallocate of whole sectors
    /// at a regular file's sector-aligned end (mode 0), its space allocated now and held, the
    /// rest in memory until the completion. `Ok(Some(false))`: it takes the ordinary path;
    /// `Ok(None)`: no data space without a new chunk (the caller adds one and tries again).
    /// The caller holds the file's inode passage and a lane of the gate (crate::gate), so
    /// nothing changes the file's trees meanwhile.
    pub(crate) fn fallocate_in_memory(
        &self,
        ino: Inode,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Result<Option<bool>> {
        let ss = self.disk.sectorsize() as u64;
        let Some(a) = self.allocator.as_ref().filter(|a| !a.is_legacy()) else {
            return Ok(Some(false));
        };
        if mode != 0
            || len == 0
            || len > MAX_EXTENT
            || !offset.is_multiple_of(ss)
            || !len.is_multiple_of(ss)
            || offset.checked_add(len).is_none_or(|e| e > i64::MAX as u64)
        {
            return Ok(Some(false));
        }
        self.prealloc
            .with(ino, |cur| -> (bool, Result<Option<bool>>) {
                let r = (|| -> Result<Option<bool>> {
                    // Where the file ends: with its delayed preallocation, or in the trees (a regular
                    // file without writes in flight and nothing at or past its end).
                    let end = match cur {
                        Some(p) => p.size,
                        None => {
                            if self.ordered.has_pending(ino) {
                                return Ok(Some(false));
                            }
                            self.require_rw_subvol(ino.root)?;
                            let item = self.inode_item_raw(ino)?;
                            let special = INODE_IMMUTABLE | INODE_APPEND;
                            if item.mode & 0o170000 != 0o100000
                                || item.flags & special != 0
                                || item.size != offset
                                || !self.file_extents(ino, offset, u64::MAX)?.is_empty()
                            {
                                return Ok(Some(false));
                            }
                            item.size
                        }
                    };
                    if end != offset {
                        return Ok(Some(false));
                    }
                    let want = crate::space::alloc::Want {
                        kind: crate::space::alloc::SpaceKind::Data,
                        len,
                        align: ss,
                        file: for_file(ino, offset),
                        held: true,
                    };
                    // No room without a new chunk.
                    let Some(at) = a.alloc_for(&want) else {
                        return Ok(None);
                    };
                    let p = cur.get_or_insert_with(|| crate::inode::ordered::Prealloc::new(offset));
                    p.append(offset, at, len, MAX_EXTENT, a);
                    p.size = offset + len;
                    p.stamp();
                    Ok(Some(true))
                })();
                (matches!(r, Ok(Some(true))), r)
            })
    }

    /// Data space for at least `len` bytes for [`Core::fallocate_in_memory`]'s caller (which
    /// holds the exclusive gate), delayed preallocations left in memory: the files' windows
    /// given back; then, unless that freed `len` (where the free space is in pieces shorter
    /// than `len`, the caller's ordinary path takes the largest there are), a commit when the
    /// running transaction freed enough (freed space comes back only with a commit), else a
    /// new chunk.
    pub(crate) fn make_data_space(&self, len: u64) -> Result<()> {
        use crate::space::alloc::SpaceKind;
        let mut w = self.writer_keeping_ordered()?;
        let Some(a) = self.allocator.clone() else {
            return Ok(());
        };
        a.release_windows();
        if a.free_bytes(SpaceKind::Data) >= len {
            return Ok(());
        }
        if a.pinned_bytes(SpaceKind::Data) >= len.saturating_mul(64) {
            // A commit needs the ordered extents in the trees (not the delayed
            // preallocations: their space is held, free on disk, and they go in later).
            self.complete_ordered(&mut w)?;
            return w.commit();
        }
        w.alloc_chunk(SpaceKind::Data, len).map(|_| ())
    }

    /// A truncate of a file with a delayed preallocation back to where it starts (the size
    /// its trees have), in memory: the preallocated space goes straight back (it was never in
    /// a tree). `false`: it takes the ordinary path. The caller holds what
    /// [`Core::fallocate_in_memory`]'s holds.
    pub(crate) fn truncate_in_memory(&self, ino: Inode, size: u64) -> bool {
        let Some(a) = self.allocator.as_ref() else {
            return false;
        };
        self.prealloc.with(ino, |cur| {
            let Some(p) = cur.as_mut() else {
                return (false, false);
            };
            if size != p.start {
                return (false, false);
            }
            // Last first: each joins the file's window, which starts where it ends.
            for (_, b, l) in p.take_extents().into_iter().rev() {
                a.release_to_file(ino.root, ino.ino, b, l);
            }
            if p.size != size {
                p.size = size;
                p.stamp();
                p.mtime = true;
            }
            (true, true)
        })
    }

    /// `ino`'s delayed preallocation, if it has one, into the trees now: for a change of the
    /// file that reads its size or extents from the trees before it takes the writer lock (a
    /// write, truncate, fallocate or clone decides from them what to do). Without this, a
    /// small write at offset 0 after an fallocate at the end made the file inline at the
    /// write's size, and the completion that came with the writer lock was overwritten.
    /// The caller is a change of `ino` (the exclusive gate, in the mount).
    pub(crate) fn settle_prealloc(&self, ino: Inode) -> Result<()> {
        if self.prealloc.has(Some(ino)) {
            let mut w = self.writer_keeping_ordered()?;
            self.complete_preallocs(&mut w, Some(ino))?;
        }
        Ok(())
    }

    /// Puts delayed preallocations (every file's, or `only`'s) into the trees: under the
    /// writer lock and the exclusive gate. A failure aborts the transaction (the image keeps
    /// its last commit) and gives up the rest.
    pub(crate) fn complete_preallocs(&self, w: &mut Writer, only: Option<Inode>) -> Result<()> {
        let mut failed = None;
        for (ino, p) in self.prealloc.take(only) {
            if failed.is_none() {
                match self.complete_prealloc(w, ino, &p) {
                    Ok(()) => continue,
                    Err(e) => {
                        w.abort(format!(
                            "recording the preallocation of {} bytes at {} of inode {} \
                             (subvolume {}): {e}",
                            p.size - p.start,
                            p.start,
                            ino.ino,
                            ino.root
                        ));
                        failed = Some(e);
                        continue;
                    }
                }
            }
            p.release_held(&w.allocator);
        }
        failed.map_or(Ok(()), Err)
    }

    fn complete_prealloc(
        &self,
        w: &mut Writer,
        ino: Inode,
        p: &crate::inode::ordered::Prealloc,
    ) -> Result<()> {
        let mut item = match self.inode_item_raw(ino) {
            Ok(item) => item,
            // Gone (its subvolume deleted meanwhile): the space was never in a tree.
            Err(Error::NotFound(_)) => {
                p.release_held(&w.allocator);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if p.size > item.size {
            w.log.note_change(ino, item.size, p.size);
        }
        for x in p.extents() {
            self.insert_prealloc(w, ino, &mut item, x)?;
            w.allocator.claim_held(x.1, x.2);
        }
        item.size = p.size;
        let stamp = p.stamp.map_or_else(
            crate::format::items::Timespec::now,
            crate::format::items::Timespec::of_instant,
        );
        Self::touch_at(w, &mut item, p.mtime, stamp);
        self.write_inode(w, ino, &item)
    }

    /// Makes `[from, to)` read as zeros: partial sectors are rewritten, whole sectors lose
    /// their extents (a hole item without NO_HOLES).
    fn zero_range(&self, ino: Inode, from: u64, to: u64, _keep_alloc: bool) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        let ss = self.disk.sectorsize() as u64;
        let item = self.inode_item(ino)?;
        let inline = self
            .file_extents(ino, 0, 1)?
            .first()
            .is_some_and(|x| matches!(x.item.body, FileExtentBody::Inline(_)));
        if inline {
            // Zeros written here never reach past the end: the file keeps its size.
            let to = to.min(item.size);
            if to <= from {
                return Ok(());
            }
            let zeros = vec![0u8; (to - from) as usize];
            self.write(ino, from, &zeros)?;
            return Ok(());
        }
        let a = from.div_ceil(ss) * ss;
        let b = to / ss * ss;
        if a >= b {
            let zeros = vec![0u8; (to - from) as usize];
            self.write(ino, from, &zeros)?;
            return Ok(());
        }
        if from < a {
            self.write(ino, from, &vec![0u8; (a - from) as usize])?;
        }
        if to > b && b < item.size {
            self.write(ino, b, &vec![0u8; (to - b) as usize])?;
        }
        self.op(false, |w| {
            let mut item = self.inode_item(ino)?;
            let hole = (!self.disk.sb.has_incompat(INCOMPAT_NO_HOLES))
                .then(|| (a, FileExtentItem::hole(w.transid, b - a)));
            let (removed, _) = self.replace_extents(w, ino, a, b, hole)?;
            item.nbytes -= removed.min(item.nbytes);
            Self::touch(w, &mut item, true);
            self.write_inode(w, ino, &item)
        })
    }
}

/// One overlapping item in one-descent extent replace: its slot, key, item and cut.
type SlotCut = (usize, Key, FileExtentItem, Cut);

/// Scan phase of one-descent extent replace: from slot `first` of `blk` (block `leaf`), the
/// file's extent items that start before `end`, with what dropping `[start, end)` does to each
/// that reaches past `start`. Returns the cuts and the slot where the scan stopped (the item
/// count when it ran off the leaf), or `None` at an inline extent (not handled in place).
fn scan_cuts(
    blk: &TreeBlock,
    leaf: u64,
    first: usize,
    ino: Inode,
    start: u64,
    end: u64,
    ss: u64,
) -> Result<Option<(Vec<SlotCut>, usize)>> {
    let n = blk.nritems();
    let mut cuts: Vec<SlotCut> = Vec::new();
    let mut slot = first;
    while slot < n {
        let k = blk.key(slot);
        if k.objectid != ino.ino || k.ty != EXTENT_DATA_KEY || k.offset >= end {
            break;
        }
        let fe = FileExtentItem::parse(blk.item_data(slot))
            .map_err(|e| e.in_block(Some(ino.root), leaf))?;
        if matches!(fe.body, FileExtentBody::Inline(_)) {
            return Ok(None);
        }
        let x = FileExtent {
            start: k.offset,
            item: fe,
        };
        let ke = x.end(ss);
        if ke > start {
            let c = cut(k.offset, &x.item, ke, start, end);
            cuts.push((slot, k, x.item, c));
        }
        slot += 1;
    }
    Ok(Some((cuts, slot)))
}

/// Last step of one-descent extent replace: inserts the new items into `leaf` in key order,
/// each at its slot in the leaf as it is by then.
fn insert_sorted(w: &mut Writer, leaf: u64, mut inserts: Vec<(Key, Vec<u8>)>) -> Result<()> {
    inserts.sort_by_key(|(k, _)| *k);
    for (k, b) in inserts {
        w.modify(leaf, |buf| {
            let mut l = LeafMut::trusted(buf)?;
            // Slot for k in the leaf as it is now.
            let n = l.nritems();
            let mut s = 0;
            while s < n && l.key(s)? < k {
                s += 1;
            }
            l.insert_item(s, k, b.len())?.copy_from_slice(&b);
            Ok(())
        })?;
    }
    Ok(())
}

/// The fast path of extent replacement does not apply: leave the tree as a search would find
/// it. The search for room may have split the leaf at its end, leaving a new empty leaf that
/// the fast path would have filled; remove it (an empty leaf other than the root is invalid).
fn give_up(w: &mut Writer, tree: u64, path: &crate::ctree::cow::WPath) -> Result<Option<u64>> {
    if path.nodes.len() > 1 && w.dirty_block(path.leaf())?.nritems() == 0 {
        w.delete_at(tree, path, 0, 0)?;
    }
    Ok(None)
}

/// A lower bound of the first key after the leaf of `path`: the key of the next pointer in the
/// lowest node on the path that has one (node keys are their children's first keys, or lower).
/// `None` when the leaf is the tree's last.
fn next_key_on_path(w: &mut Writer, path: &crate::ctree::cow::WPath) -> Result<Option<Key>> {
    for &(node, slot) in path.nodes.iter().skip(1) {
        let blk = w.dirty_block(node)?;
        if slot + 1 < blk.nritems() {
            return Ok(Some(blk.key(slot + 1)));
        }
    }
    Ok(None)
}

impl Core {
    /// Counters of the ordered extents since the filesystem was opened.
    pub(crate) fn ordered_stats(&self) -> crate::inode::ordered::OrderedStats {
        let (in_memory, completed) = self.prealloc.stats();
        crate::inode::ordered::OrderedStats {
            preallocs_in_memory: in_memory,
            preallocs_completed: completed,
            ..self.ordered.stats()
        }
    }

    /// Whether long extents are written without the writer lock (the default). Off, every
    /// write's data goes to the device under the lock, as before ordered extents: for
    /// benchmarks that compare the two.
    pub(crate) fn set_unlocked_writeback(&self, on: bool) {
        let above = if on {
            crate::inode::ordered::SHORT_WRITEBACK
        } else {
            u64::MAX
        };
        self.unlocked_writeback_above
            .store(above, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether appends gather in memory (delayed allocation, the default). Off, every write
    /// is allocated and written when it comes: for benchmarks that compare the two.
    pub(crate) fn set_delayed_allocation(&self, on: bool) {
        self.ordered.set_delalloc(on);
    }
}
