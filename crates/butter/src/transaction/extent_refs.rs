//! Extent items and their back references, changed through delayed references.
//!
//! Tree changes do not touch the extent tree directly: they queue reference deltas per extent
//! ([`DelayedRefs`](crate::space::delayed_refs::DelayedRefs)), and the commit applies them
//! ([`CowCtx::run_delayed_refs`], on the context the transaction lends), which changes
//! the extent tree and so queues more (for the extent tree's own COWed blocks) until nothing is
//! left. An extent whose references drop to zero is deleted, its checksums too (data), and its
//! space is pinned until the commit is on disk.
//!
//! References are kept inline in the extent item while it stays under the kernel's size limit
//! for extent items; the rest become keyed items (TREE_BLOCK_REF, SHARED_BLOCK_REF,
//! EXTENT_DATA_REF keyed by hash, SHARED_DATA_REF). Inline references are ordered by type and
//! then by the keyed offset, largest first (root, parent or data ref hash), as the kernel
//! orders them and its tree checker demands.

use crate::ctree::cow::Intent;
use crate::ctree::cow_ctx::CowCtx;
use crate::ctree::extent_record::{read_extent_record, ExtentRecord};
use crate::ctree::TreeIter;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::Readahead;
use crate::space::delayed_refs::PendingExtent;
use std::collections::BTreeMap;

pub(crate) use crate::space::delayed_refs::RefKey;

impl CowCtx {
    /// Applies every queued reference change; repeats while applying queues more. Returns
    /// whether anything was applied.
    pub(crate) fn run_delayed_refs(&mut self) -> Result<bool> {
        let mut any = false;
        for _ in 0..1000 {
            if self.refs.is_empty() {
                return Ok(any);
            }
            any = true;
            let batch = std::mem::take(&mut self.refs.map);
            for (bytenr, pe) in batch {
                self.apply_extent(bytenr, pe)?;
            }
        }
        Err(Error::Internal("delayed references do not converge".into()))
    }

    fn apply_extent(&mut self, bytenr: u64, mut pe: PendingExtent) -> Result<()> {
        pe.deltas.retain(|_, d| *d != 0);
        let skinny = self.disk.sb.has_incompat(INCOMPAT_SKINNY_METADATA);
        let loc = || Location::what(format!("extent {bytenr}")).with_tree(EXTENT_TREE_OBJECTID);
        // A new extent may still meet an item when its address was reused after a free in an
        // earlier pass of this commit; read to be sure.
        let extent_root = self.current_root(EXTENT_TREE_OBJECTID)?;
        let existing = read_extent_record(&self.disk, extent_root, bytenr)?;
        if pe.deltas.is_empty() && pe.flags_set == 0 {
            if pe.is_new && existing.is_none() {
                // Allocated and freed in this transaction: nothing on disk, space pinned, and
                // the checksums written for it go too.
                if pe.meta.is_none() {
                    self.delete_csums(bytenr, pe.num_bytes)?;
                }
                self.allocator.pin(bytenr, pe.num_bytes)?;
            }
            return Ok(());
        }
        let created = existing.is_none();
        let mut rec = match existing {
            Some(r) => r,
            None => {
                if !pe.is_new {
                    return Err(Error::corrupt(
                        loc(),
                        "references change for an extent that has no extent item",
                    ));
                }
                let (key, flags, tbi) = match pe.meta {
                    Some((level, _)) if skinny => (
                        Key::new(bytenr, METADATA_ITEM_KEY, level as u64),
                        EXTENT_FLAG_TREE_BLOCK,
                        None,
                    ),
                    Some((level, k)) => (
                        Key::new(bytenr, EXTENT_ITEM_KEY, pe.num_bytes),
                        EXTENT_FLAG_TREE_BLOCK,
                        Some((k, level)),
                    ),
                    None => (
                        Key::new(bytenr, EXTENT_ITEM_KEY, pe.num_bytes),
                        EXTENT_FLAG_DATA,
                        None,
                    ),
                };
                ExtentRecord {
                    key,
                    generation: pe.generation.unwrap_or(self.transid),
                    flags,
                    tree_block_info: tbi,
                    refs: BTreeMap::new(),
                    keyed: Vec::new(),
                }
            }
        };
        rec.flags |= pe.flags_set;
        for (k, d) in &pe.deltas {
            let cur = rec.refs.get(k).copied().unwrap_or(0) as i64;
            let n = cur + d;
            if n < 0 {
                return Err(Error::corrupt(
                    loc(),
                    format!("dropping back reference {k:?} that the extent does not have"),
                ));
            }
            if n == 0 {
                rec.refs.remove(k);
            } else {
                rec.refs.insert(*k, n as u64);
            }
        }
        let len = if rec.key.ty == METADATA_ITEM_KEY {
            self.disk.nodesize() as u64
        } else {
            rec.key.offset
        };
        if rec.refs.is_empty() {
            // Last reference gone: delete the extent.
            if !created {
                self.delete_item(EXTENT_TREE_OBJECTID, &rec.key)?;
                for k in rec.keyed.clone() {
                    self.delete_item(EXTENT_TREE_OBJECTID, &k)?;
                }
                self.allocator.account_used(bytenr, len, false)?;
                self.sb_bytes_used = self.sb_bytes_used.saturating_sub(len);
            }
            if rec.flags & EXTENT_FLAG_DATA != 0 {
                self.delete_csums(bytenr, len)?;
            } else {
                self.disk.cache_forget(bytenr);
            }
            self.allocator.pin(bytenr, len)?;
            return Ok(());
        }
        if created {
            self.allocator.account_used(bytenr, len, true)?;
            self.sb_bytes_used += len;
        }
        self.write_extent_record(&rec)
    }

    /// Writes an extent item and its keyed references: inline while the item stays under the
    /// size limit, keyed after that.
    fn write_extent_record(&mut self, rec: &ExtentRecord) -> Result<()> {
        let ns = self.disk.nodesize() as usize;
        let max_item = ((ns - HEADER_SIZE) >> 4).saturating_sub(ITEM_SIZE);
        let mut all: Vec<BackRef> = rec.refs.iter().map(|(k, c)| k.to_backref(*c)).collect();
        all.sort_by_key(|b| (b.type_key(), std::cmp::Reverse(b.key_offset())));
        let mut ei = ExtentItem {
            refs: rec.refs.values().sum(),
            generation: rec.generation,
            flags: rec.flags,
            tree_block_info: rec.tree_block_info,
            inline_refs: Vec::new(),
        };
        let mut size = ei.to_bytes().len();
        let mut keyed: Vec<(Key, Vec<u8>)> = Vec::new();
        for b in all {
            if keyed.is_empty() && size + b.inline_len() <= max_item {
                size += b.inline_len();
                ei.inline_refs.push(b);
            } else {
                let mut k = Key::new(rec.key.objectid, b.type_key(), b.key_offset());
                while keyed.iter().any(|(x, _)| *x == k) {
                    k.offset = k.offset.wrapping_add(1);
                }
                keyed.push((k, b.keyed_body()));
            }
        }
        self.replace_item(EXTENT_TREE_OBJECTID, rec.key, &ei.to_bytes())?;
        for k in &rec.keyed {
            if !keyed.iter().any(|(x, _)| x == k) {
                self.delete_item(EXTENT_TREE_OBJECTID, k)?;
            }
        }
        for (k, body) in keyed {
            self.replace_item(EXTENT_TREE_OBJECTID, k, &body)?;
        }
        Ok(())
    }

    /// Checksum items covering `[logical, logical + len)`: cut out (data extent freed or
    /// rewritten).
    pub(crate) fn delete_csums(&mut self, logical: u64, len: u64) -> Result<()> {
        let ss = self.disk.sectorsize() as u64;
        let cs = self.disk.sb.csum_type.size() as u64;
        let end = logical + len;
        let root = self.current_root(CSUM_TREE_OBJECTID)?;
        // Items overlapping the range: one that starts before it, and those inside.
        let mut hits: Vec<(Key, Vec<u8>)> = Vec::new();
        if let Some(it) = crate::ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
        )? {
            if it.key.objectid == EXTENT_CSUM_OBJECTID && it.key.ty == EXTENT_CSUM_KEY {
                let iend = it.key.offset + it.data().len() as u64 / cs * ss;
                if iend > logical {
                    hits.push((it.key, it.data().to_vec()));
                }
            }
        }
        let mut iter = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
            Readahead::None,
        )?;
        while let Some(it) = iter.next_item()? {
            if it.key.objectid != EXTENT_CSUM_OBJECTID
                || it.key.ty != EXTENT_CSUM_KEY
                || it.key.offset >= end
            {
                break;
            }
            if !hits.iter().any(|(k, _)| *k == it.key) {
                hits.push((it.key, it.data().to_vec()));
            }
        }
        // Trim items in place (an item may fill most of a leaf: deleting and re-inserting its
        // pieces made new leaves for every small range freed from a big item).
        for (k, data) in hits {
            let start = k.offset;
            let n = data.len() as u64 / cs;
            let iend = start + n * ss;
            let head = if start < logical {
                ((logical - start) / ss * cs) as usize
            } else {
                0
            };
            let tail_from = if iend > end {
                Some(((end - start) / ss * cs) as usize)
            } else {
                None
            };
            match (head, tail_from) {
                (0, None) => {
                    self.delete_item(CSUM_TREE_OBJECTID, &k)?;
                }
                (0, Some(skip)) => {
                    // Keep the tail: cut the front and move the key up to `end` (still below
                    // the next item, which starts at or after this one's end).
                    let p = self.search_mut(CSUM_TREE_OBJECTID, &k, Intent::Modify)?;
                    if !p.found {
                        return Err(Error::Internal(format!("csum item {k} vanished")));
                    }
                    let slot = p.slot();
                    let new_key = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end);
                    self.modify(p.leaf(), |buf| {
                        let mut l = crate::ctree::ops::LeafMut::trusted(buf)?;
                        l.truncate_item(slot, data.len() - skip, false)?;
                        l.set_key(slot, new_key)
                    })?;
                    if slot == 0 {
                        self.fix_first_key(&p)?;
                    }
                }
                (keep, tail) => {
                    self.resize_item(CSUM_TREE_OBJECTID, &k, keep)?;
                    if let Some(skip) = tail {
                        self.insert_item(
                            CSUM_TREE_OBJECTID,
                            Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end),
                            &data[skip..],
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Stores checksums (`sums`, one per sector) for data at `logical`, extending the item that
    /// ends right before it when there is room.
    pub(crate) fn insert_csums(&mut self, logical: u64, sums: &[u8]) -> Result<()> {
        let ss = self.disk.sectorsize() as u64;
        let cs = self.disk.sb.csum_type.size();
        let ns = self.disk.nodesize() as usize;
        let max_bytes = ((ns - HEADER_SIZE - 2 * ITEM_SIZE) / cs - 1) * cs;
        let mut logical = logical;
        let mut sums = sums;
        // Extend the previous item when it ends exactly here.
        let root = self.current_root(CSUM_TREE_OBJECTID)?;
        if let Some(it) = crate::ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
        )? {
            let cur = it.data().len();
            if it.key.objectid == EXTENT_CSUM_OBJECTID
                && it.key.ty == EXTENT_CSUM_KEY
                && it.key.offset + (cur / cs) as u64 * ss == logical
                && cur < max_bytes
            {
                let take = (max_bytes - cur).min(sums.len());
                let key = it.key;
                drop(it);
                let p = self.resize_item(CSUM_TREE_OBJECTID, &key, cur + take)?;
                let slot = p.slot();
                self.modify(p.leaf(), |buf| {
                    let mut l = crate::ctree::ops::LeafMut::trusted(buf)?;
                    l.item_data_mut(slot)?[cur..].copy_from_slice(&sums[..take]);
                    Ok(())
                })?;
                logical += (take / cs) as u64 * ss;
                sums = &sums[take..];
            }
        }
        while !sums.is_empty() {
            let take = max_bytes.min(sums.len());
            self.insert_item(
                CSUM_TREE_OBJECTID,
                Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
                &sums[..take],
            )?;
            logical += (take / cs) as u64 * ss;
            sums = &sums[take..];
        }
        Ok(())
    }
}
