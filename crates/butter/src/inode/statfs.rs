//! statfs(2) numbers: size and free space of the filesystem.
//!
//! Read-write: free space is what new file data can still get: the free bytes of the data
//! block groups (as the allocator sees them in the running transaction) plus the device space
//! no chunk uses yet (a new data chunk can take it; data is single-copy here). Read-only:
//! the superblock's `total_bytes - bytes_used`, as of the last commit.

use crate::error::Result;
use crate::format::items::DevExtent;
use crate::format::*;
use crate::inode::core::Core;
use crate::space::alloc::SpaceKind;
use crate::transaction::relocate::RelocStats;

/// What statfs reports, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFs {
    /// Block size (the sector size).
    pub bsize: u32,
    /// Size of the device.
    pub total: u64,
    /// Bytes file data can still use (statfs's `f_bavail`).
    pub free: u64,
    /// Bytes not used by anything (statfs's `f_bfree`), as the kernel's btrfs counts them:
    /// the size less the bytes every block group uses (each copy of DUP and RAID1 counted)
    /// and less the global block reserve. `df` shows the size less this as used.
    pub unused: u64,
    /// The global block reserve as the kernel sizes it at mount.
    pub reserve: u64,
    /// Data bytes freed (or whose last reference goes) in the running transaction: free once
    /// it commits.
    pub pinned: u64,
}

/// Copies of each byte a block group profile keeps.
pub(crate) fn profile_copies(flags: u64) -> u64 {
    if flags & (BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID10) != 0 {
        2
    } else if flags & BLOCK_GROUP_RAID1C3 != 0 {
        3
    } else if flags & BLOCK_GROUP_RAID1C4 != 0 {
        4
    } else {
        1
    }
}

/// The chunk length a block group needs when it moves in a shrink: data what it holds;
/// metadata half as much again and 16 MiB, room for the kernel's global reserve and the
/// reservations its writes make (with less, the kernel refuses a mkdir); system (the
/// chunk tree, a few blocks) twice what it holds. Never more than it has.
fn snug_size(g: &BlockGroupInfo) -> u64 {
    let mib = 1u64 << 20;
    if g.flags & BLOCK_GROUP_DATA != 0 {
        g.used.div_ceil(mib).max(1) * mib
    } else if g.flags & BLOCK_GROUP_SYSTEM != 0 {
        (2 * g.used).div_ceil(mib).max(1) * mib
    } else {
        (g.used + g.used / 2 + 16 * mib).div_ceil(mib) * mib
    }
    .min(g.len)
}

impl Core {
    pub(crate) fn statfs(&self) -> Result<StatFs> {
        let sb = &self.disk.sb;
        let bsize = sb.sectorsize.max(1);
        let reserve = self.global_reserve()?;
        if !self.is_writable() {
            let used: u64 = self
                .space_usage()?
                .iter()
                .map(|s| s.used.saturating_mul(profile_copies(s.flags)))
                .fold(0, u64::saturating_add);
            return Ok(StatFs {
                bsize,
                total: sb.total_bytes,
                free: sb.total_bytes.saturating_sub(sb.bytes_used),
                unused: sb.total_bytes.saturating_sub(used).saturating_sub(reserve),
                reserve,
                pinned: 0,
            });
        }
        // Reads only: pending writes stay pending (a statfs passes the gate as a reader).
        let mut w = self.writer_keeping_ordered()?;
        let free = self.data_space_left(&mut w)?;
        let mut used = 0u64;
        w.allocator.for_each(|g| {
            used = used.saturating_add(g.used.saturating_mul(profile_copies(g.flags)));
        });
        let pinned = w
            .allocator
            .pinned_bytes(SpaceKind::Data)
            .saturating_add(w.refs.data_bytes_dropped());
        let total = w.devices_total_bytes();
        drop(w);
        Ok(StatFs {
            bsize,
            total,
            free: free.min(total),
            unused: total.saturating_sub(used).saturating_sub(reserve),
            reserve,
            pinned,
        })
    }

    /// The global block reserve as the kernel sizes it at mount (btrfs_update_global_block_rsv,
    /// Linux 6.4 and later): the bytes the extent, checksum, free space and block group trees
    /// use, at least what an unlink and its delayed references need, at most 512 MiB.
    fn global_reserve(&self) -> Result<u64> {
        const UNLINK_UNITS: u64 = 6;
        let sb = &self.disk.sb;
        let mut bytes = 0u64;
        // The root tree counts one item (its bytes, the kernel's in-memory root item, are 0).
        let mut items = 1u64;
        for id in [
            EXTENT_TREE_OBJECTID,
            CSUM_TREE_OBJECTID,
            FREE_SPACE_TREE_OBJECTID,
            BLOCK_GROUP_TREE_OBJECTID,
        ] {
            if let Some(ri) = self.find_root_item(id)? {
                bytes = bytes.saturating_add(ri.bytes_used);
                items += 1;
            }
        }
        let per_item = u64::from(sb.nodesize) * 8 * 2;
        let mut refs = per_item * UNLINK_UNITS;
        if sb.compat_ro_flags & COMPAT_RO_FREE_SPACE_TREE != 0 {
            refs *= 2;
        }
        let min = per_item * (items + UNLINK_UNITS) + refs;
        Ok(bytes.max(min).min(512 << 20))
    }

    /// Bytes file data can still use: free space in data chunks plus the device space no
    /// chunk has yet.
    pub(crate) fn data_space_left(&self, w: &mut crate::transaction::Writer) -> Result<u64> {
        let data_free = w.allocator.free_bytes(SpaceKind::Data);
        let root = w.current_root(DEV_TREE_OBJECTID)?;
        let mut unallocated = 0u64;
        let mut with_room = 0u64;
        let ids: Vec<u64> = self
            .disk
            .devices
            .members()
            .iter()
            .map(|m| m.devid)
            .collect();
        for devid in &ids {
            let mut allocated = 1u64 << 20; // the first MiB is never allocated
            let mut it = crate::ctree::TreeIter::new(
                self.disk.clone(),
                root,
                Key::new(*devid, DEV_EXTENT_KEY, 0),
                crate::io::disk_io::Readahead::None,
            )?;
            while let Some(item) = it.next_item()? {
                if item.key.objectid != *devid || item.key.ty != DEV_EXTENT_KEY {
                    break;
                }
                let de = DevExtent::parse(item.data()).map_err(|e| item.annotate(e))?;
                allocated = allocated.saturating_add(de.length);
            }
            let free = w.device_total_bytes(*devid).saturating_sub(allocated);
            if free > 0 {
                with_room += 1;
            }
            unallocated = unallocated.saturating_add(free);
        }
        // What of it data chunks of the data profile can use: one copy of mirrors, the data
        // share of a parity profile's stripes.
        let mut profile = 0;
        w.allocator.for_each(|g| {
            if SpaceKind::of_flags(g.flags) == Some(SpaceKind::Data) {
                profile = g.flags & BLOCK_GROUP_PROFILE_MASK;
            }
        });
        let usable = if ids.len() < 2 {
            unallocated
        } else {
            let a = crate::io::volumes::raid_attr(profile);
            let n = with_room.max(1);
            unallocated / a.ncopies as u64 * n.saturating_sub(a.nparity as u64) / n
        };
        Ok(data_free.saturating_add(usable))
    }
}

/// One kind of block group and its profile, as `btrfs filesystem df` lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpaceUsage {
    /// Type and profile bits (`BLOCK_GROUP_DATA`, `..._METADATA`, `..._SYSTEM`, `..._DUP`, ...).
    pub flags: u64,
    /// Bytes of the block groups (one copy).
    pub total: u64,
    /// Bytes used in them.
    pub used: u64,
}

/// Space of one chunk type and profile on one device ([`Core::chunk_allocations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkAllocation {
    /// Type and profile bits, as in [`SpaceUsage::flags`].
    pub flags: u64,
    pub devid: u64,
    /// Stripes per chunk (DUP: 2).
    pub num_stripes: u16,
    /// Bytes on the device: the chunks' lengths once per stripe there.
    pub bytes: u64,
}

/// One block group of a filesystem open read-write, as the running transaction has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockGroupInfo {
    /// Logical start and length.
    pub start: u64,
    pub len: u64,
    /// Type and profile bits (`BLOCK_GROUP_*`).
    pub flags: u64,
    /// Bytes of extents in it.
    pub used: u64,
    /// Where its stripes lie: (devid, physical offset, bytes).
    pub stripes: Vec<(u64, u64, u64)>,
}

impl Core {
    /// Size and use of the block groups, per type and profile, as committed: what `btrfs
    /// filesystem df` shows (Data, System, Metadata).
    pub(crate) fn space_usage(&self) -> Result<Vec<SpaceUsage>> {
        let tree = if self.find_root_item(BLOCK_GROUP_TREE_OBJECTID)?.is_some() {
            BLOCK_GROUP_TREE_OBJECTID
        } else {
            EXTENT_TREE_OBJECTID
        };
        let root = self.subvol_root(tree)?;
        let mut it = crate::ctree::TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(0, BLOCK_GROUP_ITEM_KEY, 0),
            crate::io::disk_io::Readahead::Forward,
        )?;
        let mut out: Vec<SpaceUsage> = Vec::new();
        while let Some(item) = it.next_item()? {
            if item.key.ty != BLOCK_GROUP_ITEM_KEY {
                continue;
            }
            let bg = crate::format::items::BlockGroupItem::parse(item.data())
                .map_err(|e| item.annotate(e))?;
            match out.iter_mut().find(|u| u.flags == bg.flags) {
                Some(u) => {
                    u.total += item.key.offset;
                    u.used += bg.used;
                }
                None => out.push(SpaceUsage {
                    flags: bg.flags,
                    total: item.key.offset,
                    used: bg.used,
                }),
            }
        }
        // The order btrfs filesystem df prints: data, system, metadata.
        out.sort_by_key(|u| {
            (
                u.flags & BLOCK_GROUP_DATA == 0,
                u.flags & BLOCK_GROUP_SYSTEM == 0,
                u.flags,
            )
        });
        Ok(out)
    }

    /// The chunks' space per type and profile, device and stripe count, from the chunk tree
    /// as opened: each stripe of a chunk adds the chunk's length to its device's entry (a DUP
    /// chunk twice on one device), what `btrfs filesystem usage` lists under each type.
    pub(crate) fn chunk_allocations(&self) -> Vec<ChunkAllocation> {
        let mut out: Vec<ChunkAllocation> = Vec::new();
        for c in self.disk.chunk_map().chunks() {
            for s in &c.item.stripes {
                let found = out.iter_mut().find(|a| {
                    a.flags == c.item.ty
                        && a.devid == s.devid
                        && a.num_stripes == c.item.num_stripes
                });
                match found {
                    Some(a) => a.bytes = a.bytes.saturating_add(c.item.length),
                    None => out.push(ChunkAllocation {
                        flags: c.item.ty,
                        devid: s.devid,
                        num_stripes: c.item.num_stripes,
                        bytes: c.item.length,
                    }),
                }
            }
        }
        out
    }

    /// Shrinks the filesystem to end where its last chunk ends and commits; returns the new
    /// size (the image file may be cut there). What `mkfs --shrink` does after filling.
    pub(crate) fn shrink_to_fit(&self) -> Result<u64> {
        let end = self.op(false, |w| w.shrink_device_to_chunks())?;
        self.commit()?;
        Ok(end)
    }

    /// Resizes device `devid` and commits ([`crate::transaction::Writer::resize_device`]).
    /// Block groups with a stripe past the new end are relocated below it first. A device
    /// shorter than `size` is made longer first where it can be (an image file grows; back
    /// again if the resize fails); after a shrink, an image file is cut at the new end.
    pub(crate) fn resize_device(
        &self,
        devid: u64,
        size: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64> {
        let dev = self.disk.devices.get(devid);
        let old = self.op(false, |w| {
            Ok(w.dev_items.get(&devid).map(|d| d.total_bytes))
        })?;
        let mut grown_from = None;
        if let (Some(dev), Some(_)) = (&dev, old) {
            let len = dev.len();
            if size > len {
                dev.set_len(size).map_err(|e| {
                    crate::error::Error::NoSpace(format!(
                        "device {devid} is {len} bytes and cannot grow to {size}: {e}"
                    ))
                })?;
                grown_from = Some(len);
            }
        }
        match self.resize_device_within(devid, size, progress) {
            Ok(new) => {
                if let (Some(dev), Some(old)) = (&dev, old) {
                    self.cut_device(devid, dev.as_ref(), old, new)?;
                }
                Ok(new)
            }
            Err(e) => {
                if let (Some(dev), Some(len)) = (&dev, grown_from) {
                    // Nothing uses the added bytes: the file goes back to its length.
                    let _ = dev.set_len(len);
                }
                Err(e)
            }
        }
    }

    /// After a committed shrink of device `devid` from `old` to `new` bytes: an image file
    /// longer than `new` is cut there (nothing is written past the filesystem's end).
    fn cut_device(
        &self,
        devid: u64,
        dev: &dyn crate::io::device::BlockDevice,
        old: u64,
        new: u64,
    ) -> Result<()> {
        if new < old && dev.len() > new {
            dev.set_len(new).map_err(|e| {
                crate::error::Error::io(
                    format!("resized device {devid}, but cutting it to {new} bytes"),
                    new,
                    e,
                )
            })?;
        }
        Ok(())
    }

    /// [`Core::resize_device`] on a device as long as it is.
    fn resize_device_within(
        &self,
        devid: u64,
        size: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64> {
        let past: Vec<BlockGroupInfo> = self
            .block_groups()?
            .into_iter()
            .filter(|g| {
                g.stripes
                    .iter()
                    .any(|&(d, off, len)| d == devid && off + len > size)
            })
            .collect();
        if !past.is_empty() {
            // Refused before anything moves when what the device holds cannot fit.
            let mut need = 1u64 << 20;
            for g in self.block_groups()? {
                let on = g.stripes.iter().filter(|s| s.0 == devid).count() as u64;
                let per = crate::io::volumes::data_stripes(
                    g.flags & BLOCK_GROUP_PROFILE_MASK,
                    g.stripes.len(),
                )
                .max(1) as u64;
                need += on * g.used.div_ceil(per);
            }
            if size < need {
                return Err(crate::error::Error::NoSpace(format!(
                    "device {devid} holds {need} bytes of block group contents, more than \
                     {size}: the smallest size it can take is what `{devid}:min` gives"
                )));
            }
            self.empty_device_past(devid, size, progress)?;
        }
        let size = self.op(false, |w| w.resize_device(devid, size))?;
        self.commit()?;
        Ok(size)
    }

    /// Removes device `devid` (it holds no chunk) and commits; then wipes its superblocks,
    /// so that no tool takes it for a member any more.
    pub(crate) fn remove_device(&self, devid: u64) -> Result<()> {
        let dev = self.disk.devices.member(devid).and_then(|m| m.dev);
        self.op(false, |w| w.remove_device(devid))?;
        self.commit()?;
        self.disk.devices.forget(devid);
        if let Some(dev) = dev {
            crate::io::super_io::wipe(dev.as_ref())?;
        }
        Ok(())
    }

    /// Every block group with its stripes.
    pub(crate) fn block_groups(&self) -> Result<Vec<BlockGroupInfo>> {
        self.op(false, |w| {
            let mut out = Vec::new();
            w.allocator.for_each(|g| {
                out.push(BlockGroupInfo {
                    start: g.start,
                    len: g.len,
                    flags: g.flags,
                    used: g.used,
                    stripes: Vec::new(),
                })
            });
            let map = w.disk.chunk_map();
            for g in &mut out {
                if let Some(c) = map.lookup(g.start) {
                    let size = crate::io::volumes::stripe_size(&c.item);
                    g.stripes = c
                        .item
                        .stripes
                        .iter()
                        .map(|st| (st.devid, st.offset, size))
                        .collect();
                }
            }
            Ok(out)
        })
    }

    /// Removes empty block groups ([`crate::transaction::Writer::remove_empty_group`]) in one
    /// transaction of their own: a commit first, so that nothing freed before is still
    /// pinned in them, then the removals and a commit.
    pub(crate) fn remove_empty_block_groups(&self, starts: &[u64]) -> Result<()> {
        self.commit()?;
        self.op(false, |w| {
            for &s in starts {
                w.remove_empty_group(s)?;
            }
            Ok(())
        })?;
        self.commit()
    }

    /// Relocates the block groups at `starts` one after the other
    /// ([`crate::transaction::Writer::relocate_group`]), each in a transaction of its own,
    /// and removes each once it is empty (in the next). A power cut leaves each group where
    /// it was or wholly moved. `after_each` runs after each group is gone (a balance counts
    /// it).
    pub(crate) fn relocate_block_groups(
        &self,
        starts: &[u64],
        progress: &mut dyn FnMut(&str),
        after_each: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<RelocStats> {
        let mut total = RelocStats::default();
        for &s in starts {
            self.commit()?;
            let r = self.op(false, |w| w.relocate_group(s, progress));
            let st = match r {
                Ok(st) => st,
                Err(e) => {
                    // What was moved is consistent: keep it, give the group back.
                    let _ = self.op(false, |w| {
                        w.allocator.set_readonly(s, false);
                        Ok(())
                    });
                    let _ = self.commit();
                    return Err(e);
                }
            };
            self.commit()?;
            let left = self.op(false, |w| {
                Ok(w.allocator.with_group(s, |g| g.used).unwrap_or(0))
            })?;
            if left > 0 {
                let _ = self.op(false, |w| {
                    w.allocator.set_readonly(s, false);
                    Ok(())
                });
                return Err(crate::error::Error::Internal(format!(
                    "the block group at {s} still holds {left} bytes after its relocation:                      run `butter check` on the filesystem, something refers to them that no                      tree reaches"
                )));
            }
            self.op(false, |w| w.remove_empty_group(s))?;
            self.commit()?;
            total.data_extents += st.data_extents;
            total.data_bytes += st.data_bytes;
            total.tree_blocks += st.tree_blocks;
            total.file_extents += st.file_extents;
            after_each(s)?;
        }
        Ok(total)
    }

    /// Empties the part of device `devid` past `size` by relocating every block group with
    /// a stripe there, new chunks kept below `size` meanwhile.
    pub(crate) fn empty_device_past(
        &self,
        devid: u64,
        size: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let past: Vec<u64> = self
            .block_groups()?
            .into_iter()
            .filter(|g| {
                g.stripes
                    .iter()
                    .any(|&(d, off, len)| d == devid && off + len > size)
            })
            .map(|g| g.start)
            .collect();
        if past.is_empty() {
            return Ok(());
        }
        self.op(false, |w| {
            w.chunk_limit.insert(devid, size);
            Ok(())
        })?;
        let r = self.relocate_block_groups(&past, progress, &mut |_| Ok(()));
        self.op(false, |w| {
            w.chunk_limit.remove(&devid);
            Ok(())
        })?;
        r.map(|_| ())
    }

    /// Shrinks device `devid` as far as relocation can take it, packing its block groups
    /// toward its start, then cuts it where its last chunk ends. Returns the new size.
    ///
    /// Each step moves one block group, into a snug new chunk (what it holds, plus room for
    /// metadata to grow) or into the other groups of its kind. A group goes down when a hole
    /// below it takes it (the one ending last first), or wherever when that halves it; when
    /// none can, the group right above the lowest hole moves up past the others, so that the
    /// hole and its old place become one, which the next step fills. Every group ends packed
    /// from the device's start, at the price of moving some twice.
    pub(crate) fn shrink_device_to_min(
        &self,
        devid: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64> {
        let kind = |f: u64| f & (BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM);
        let mib = 1u64 << 20;
        let mut failed: Vec<u64> = Vec::new();
        let mut steps = 0usize;
        loop {
            let mut groups = self.block_groups()?;
            steps += 1;
            if steps > 4 * groups.len() + 32 {
                break;
            }
            let on_dev = |g: &BlockGroupInfo| -> Option<(u64, u64)> {
                let on: Vec<&(u64, u64, u64)> = g.stripes.iter().filter(|s| s.0 == devid).collect();
                Some((
                    on.iter().map(|s| s.1).min()?,
                    on.iter().map(|s| s.1 + s.2).max()?,
                ))
            };
            groups.retain(|g| on_dev(g).is_some());
            groups.sort_by_key(|g| std::cmp::Reverse(on_dev(g).map(|x| x.1)));
            let end = groups
                .iter()
                .filter_map(on_dev)
                .map(|x| x.1)
                .max()
                .unwrap_or(mib);
            // A move: (group, snug size, new chunks below this, new chunks above this).
            let mut pick: Option<(&BlockGroupInfo, u64, Option<u64>, Option<u64>)> = None;
            for g in &groups {
                if failed.contains(&g.start) {
                    continue;
                }
                let Some((from, _)) = on_dev(g) else { continue };
                let dev_stripes = g.stripes.iter().filter(|s| s.0 == devid).count().max(1) as u64;
                let others: Vec<&BlockGroupInfo> = groups
                    .iter()
                    .filter(|o| o.start != g.start && kind(o.flags) == kind(g.flags))
                    .collect();
                let free_other: u64 = others.iter().map(|o| o.len.saturating_sub(o.used)).sum();
                // What the other groups of a tree kind must keep free, or a new chunk would
                // come right back for the trees' growth.
                let keep = match kind(g.flags) {
                    BLOCK_GROUP_DATA => 0,
                    BLOCK_GROUP_SYSTEM => mib,
                    _ => 16 * mib,
                };
                if g.used == 0 && !others.is_empty() && free_other >= keep {
                    // Empty, and not needed for its kind's room: it just goes.
                    pick = Some((g, 0, None, None));
                    break;
                }
                let snug = snug_size(g);
                let fits_in_others = g.used + g.used / 8 + mib + keep <= free_other;
                let hole = self.op(false, |w| {
                    Ok(w.device_holes(devid)?
                        .into_iter()
                        .filter(|h| h.1 / dev_stripes >= snug)
                        .map(|h| h.0)
                        .min())
                })?;
                if hole.is_some() && snug * 2 <= g.len {
                    pick = Some((g, snug, None, None));
                    break;
                }
                if fits_in_others || hole.is_some_and(|h| h + snug * dev_stripes <= from) {
                    pick = Some((g, snug, Some(from), None));
                    break;
                }
            }
            if pick.is_none() {
                // Nothing goes down: the group right above the lowest hole moves up.
                let holes = self.op(false, |w| w.device_holes(devid))?;
                let lowest = holes
                    .iter()
                    .filter(|h| h.0 < end && h.1 >= mib)
                    .min_by_key(|h| h.0);
                if let Some(&(hs, _)) = lowest {
                    let above = groups
                        .iter()
                        .filter(|g| !failed.contains(&g.start))
                        .filter(|g| on_dev(g).is_some_and(|x| x.0 > hs))
                        .min_by_key(|g| on_dev(g).map(|x| x.0));
                    if let Some(g) = above {
                        pick = Some((g, snug_size(g), None, Some(end)));
                    }
                }
            }
            let Some((g, snug, below, above)) = pick else {
                break;
            };
            if snug == 0 {
                match self.remove_empty_block_groups(&[g.start]) {
                    Ok(()) => {}
                    // Something went into it meanwhile (a commit's tree blocks).
                    Err(crate::error::Error::Invalid(m)) => {
                        log::info!("the block group at {} stays: {m}", g.start);
                        failed.push(g.start);
                    }
                    Err(e) => return Err(e),
                }
                continue;
            }
            progress(&format!(
                "moving the {} block group at {} ({} MiB used)",
                crate::format::print::block_group_kind(g.flags),
                g.start,
                g.used.div_ceil(mib)
            ));
            self.op(false, |w| {
                w.chunk_fit = Some((kind(g.flags), snug));
                if let Some(l) = below {
                    w.chunk_limit.insert(devid, l);
                }
                if let Some(f) = above {
                    w.chunk_floor.insert(devid, f);
                }
                Ok(())
            })?;
            let r = self.relocate_block_groups(&[g.start], progress, &mut |_| Ok(()));
            self.op(false, |w| {
                w.chunk_fit = None;
                w.chunk_limit.remove(&devid);
                w.chunk_floor.remove(&devid);
                Ok(())
            })?;
            match r {
                Ok(_) => {}
                Err(crate::error::Error::NoSpace(m)) => {
                    log::info!("the block group at {} stays: {m}", g.start);
                    failed.push(g.start);
                }
                Err(e) => return Err(e),
            }
        }
        let end = self.op(false, |w| w.device_extents_end(devid))?;
        let old = self.op(false, |w| {
            Ok(w.dev_items.get(&devid).map_or(0, |d| d.total_bytes))
        })?;
        let size = self.op(false, |w| w.resize_device(devid, end))?;
        self.commit()?;
        if let Some(dev) = self.disk.devices.get(devid) {
            self.cut_device(devid, dev.as_ref(), old, size)?;
        }
        Ok(size)
    }

    /// Adds a device and commits ([`crate::transaction::Writer::add_device`]); new chunks
    /// may go on it from then on.
    pub(crate) fn add_device(
        &self,
        dev: std::sync::Arc<dyn crate::io::device::BlockDevice>,
        name: &str,
    ) -> Result<u64> {
        let uuid = crate::mkfs::random_uuid()?;
        let devid = self.op(false, |w| w.add_device(dev, uuid, name.to_string()))?;
        self.commit()?;
        Ok(devid)
    }

    /// The smallest size device `devid` can take without moving chunks: where its last
    /// chunk stripe ends.
    pub(crate) fn device_min_size(&self, devid: u64) -> Result<u64> {
        // Empty block groups can go (the resize removes those past its end), but one group
        // of each type stays: its first.
        let groups = self.block_groups()?;
        let kind = |f: u64| f & (BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM);
        let mut end = 1u64 << 20;
        for g in &groups {
            let first_of_unused_kind = !groups
                .iter()
                .any(|o| kind(o.flags) == kind(g.flags) && o.used > 0)
                && groups
                    .iter()
                    .filter(|o| kind(o.flags) == kind(g.flags))
                    .map(|o| o.start)
                    .min()
                    == Some(g.start);
            if g.used > 0 || first_of_unused_kind {
                for &(d, off, len) in &g.stripes {
                    if d == devid {
                        end = end.max(off + len);
                    }
                }
            }
        }
        Ok(end)
    }

    /// The filesystem's label.
    pub(crate) fn label(&self) -> String {
        match &self.writer {
            Some(w) => w.lock().map(|w| w.sb.label.clone()).unwrap_or_default(),
            None => self.disk.sb.label.clone(),
        }
    }

    /// Sets the label (at most 255 bytes, no NUL), written with the next commit, as the
    /// kernel's FS_IOC_SETFSLABEL does.
    pub(crate) fn set_label(&self, label: &str) -> Result<()> {
        if label.len() > 255 || label.contains('\0') {
            return Err(crate::error::Error::Invalid(format!(
                "label of {} bytes: at most 255, without NUL",
                label.len()
            )));
        }
        self.op(false, |w| {
            w.sb.label = label.to_string();
            // A transaction with a change to commit: the top-level subvolume's root item is
            // rewritten as it is (the kernel's label change commits a transaction too).
            let key = self.root_item_key(w, FS_TREE_OBJECTID)?;
            w.update_item(ROOT_TREE_OBJECTID, &key, |_| Ok(()))?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::inode::namespace::Owner;

    #[test]
    fn free_space_shrinks_as_data_is_written_and_comes_back() {
        let size = 128u64 << 20;
        let (_dev, fs) = crate::mkfs::test_fs(size);
        let s0 = fs.statfs().unwrap();
        assert_eq!(s0.total, size);
        assert!(s0.free > size / 4 && s0.free < size, "{s0:?}");
        let f = fs
            .create(fs.root_inode(), b"f", 0o644, Owner::default())
            .unwrap();
        fs.write(f, 0, &vec![5u8; 8 << 20]).unwrap();
        fs.commit().unwrap();
        let s1 = fs.statfs().unwrap();
        assert!(
            s0.free - s1.free >= 8 << 20 && s0.free - s1.free < 16 << 20,
            "{s0:?} {s1:?}"
        );
        fs.unlink(fs.root_inode(), b"f").unwrap();
        fs.commit().unwrap();
        fs.commit().unwrap();
        let s2 = fs.statfs().unwrap();
        assert!(s2.free > s1.free, "{s1:?} {s2:?}");
    }
}
