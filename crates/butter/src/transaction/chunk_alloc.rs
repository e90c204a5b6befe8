//! Chunk allocation: a new chunk (and its block group) when a space kind fills up, placed in
//! the device's holes, with the superblock copies carved out of its free space.

use super::Writer;
use crate::ctree::TreeIter;
use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::Readahead;
use crate::space::alloc::{self, BlockGroup, RangeSet, SpaceKind};

impl Writer {
    /// Free bytes the device has outside any chunk, largest hole first: (physical, len).
    pub(super) fn device_holes(&mut self) -> Result<Vec<(u64, u64)>> {
        let devid = self.disk.devid();
        let total = self.dev_item.total_bytes.min(self.disk.dev().len());
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
    pub(crate) fn alloc_chunk(&mut self, kind: SpaceKind, min_len: u64) -> Result<u64> {
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
            SpaceKind::Data if self.small_chunks => 8 << 20,
            SpaceKind::Data => 1 << 30,
            SpaceKind::Metadata if self.small_chunks => 32 << 20,
            SpaceKind::Metadata => 256 << 20,
            SpaceKind::System => 32 << 20,
        };
        let floor: u64 = if self.small_chunks { 1 << 20 } else { 16 << 20 };
        let tenth = (total / 10) / STRIPE * STRIPE;
        let mut want = (max as u64)
            .min(tenth.max(floor))
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
        let devid = self.disk.devid();
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
}

const STRIPE: u64 = alloc::STRIPE_LEN;

/// Carves the superblock copies out of a group's free space.
pub(super) fn exclude_supers(bg: &mut BlockGroup, chunk: &ChunkItem) {
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

impl Writer {
    /// Makes the device end where its last chunk ends (what `mkfs --shrink` wants): the
    /// device item (in the chunk tree and the superblock) and the filesystem size become
    /// that end. Returns it; the caller commits, then may cut the image file there.
    pub(crate) fn shrink_device_to_chunks(&mut self) -> Result<u64> {
        let devid = self.disk.devid();
        let root = self.current_root(DEV_TREE_OBJECTID)?;
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(devid, DEV_EXTENT_KEY, 0),
            Readahead::None,
        )?;
        let mut end = 1u64 << 20;
        while let Some(item) = it.next_item()? {
            if item.key.objectid != devid || item.key.ty != DEV_EXTENT_KEY {
                break;
            }
            let de = DevExtent::parse(item.data()).map_err(|e| item.annotate(e))?;
            end = end.max(item.key.offset.saturating_add(de.length));
        }
        if end >= self.dev_item.total_bytes {
            return Ok(self.dev_item.total_bytes);
        }
        self.dev_item.total_bytes = end;
        self.sb.total_bytes = end;
        let di = self.dev_item.to_bytes();
        self.replace_item(
            CHUNK_TREE_OBJECTID,
            Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
            &di,
        )?;
        Ok(end)
    }
}
