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
    /// Free bytes device `devid` has outside any chunk, largest hole first: (physical, len).
    pub(crate) fn device_holes(&mut self, devid: u64) -> Result<Vec<(u64, u64)>> {
        let Some(dev) = self.disk.devices.get(devid) else {
            return Ok(Vec::new());
        };
        let size = self.dev_items.get(&devid).map_or(0, |d| d.total_bytes);
        let limit = self.chunk_limit.get(&devid).copied().unwrap_or(u64::MAX);
        let total = size.min(dev.len()).min(limit);
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
        for &(d, off, len) in &self.freed_dev_extents {
            if d == devid {
                used.remove(off, len);
                let _ = used.add(off, len);
            }
        }
        let mut holes = Vec::new();
        let mut pos = 0u64;
        for (s, l) in used.iter() {
            // A hole ends at the device's size (or the limit of a shrink in progress).
            let e = s.min(total);
            if e > pos {
                holes.push((pos, e - pos));
            }
            pos = pos.max(s + l);
        }
        if total > pos {
            holes.push((pos, total - pos));
        }
        if let Some(&floor) = self.chunk_floor.get(&devid) {
            holes = holes
                .into_iter()
                .filter(|&(s, l)| s + l > floor)
                .map(|(s, l)| (s.max(floor), s + l - s.max(floor)))
                .collect();
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
        // The profile of the existing groups of this kind: on several devices the most
        // redundant one, as the kernel reduces the profiles it finds to one.
        let several = self.disk.devices.len() > 1;
        let rank = |p: u64| {
            [
                BLOCK_GROUP_RAID6,
                BLOCK_GROUP_RAID5,
                BLOCK_GROUP_RAID10,
                BLOCK_GROUP_RAID1C4,
                BLOCK_GROUP_RAID1C3,
                BLOCK_GROUP_RAID1,
                BLOCK_GROUP_RAID0,
                BLOCK_GROUP_DUP,
            ]
            .iter()
            .position(|&x| x == p)
            .unwrap_or(usize::MAX)
        };
        let mut profile: Option<u64> = None;
        self.allocator.for_each(|g| {
            if SpaceKind::of_flags(g.flags) == Some(kind) {
                let p = g.flags & BLOCK_GROUP_PROFILE_MASK;
                match profile {
                    None => profile = Some(p),
                    Some(q) if several && rank(p) < rank(q) => profile = Some(p),
                    Some(_) => {}
                }
            }
        });
        let profile = profile.unwrap_or(match kind {
            SpaceKind::Data => 0,
            _ => BLOCK_GROUP_DUP,
        });
        let mut profile = self
            .chunk_profile
            .get(&kind.flag())
            .copied()
            .unwrap_or(profile);
        let mut attr = crate::io::volumes::raid_attr(profile);
        if self.disk.devices.working() < attr.devs_min {
            // Degraded: the devices left cannot make this profile; as the kernel does, the
            // new chunk is SINGLE (a balance converts it back once the device returns).
            log::warn!(
                "degraded: {} devices cannot hold a {} chunk; adding a SINGLE {kind:?} chunk",
                self.disk.devices.working(),
                crate::io::volumes::profile_name(profile)
            );
            profile = 0;
            attr = crate::io::volumes::raid_attr(0);
        }
        let total = if self.disk.devices.len() == 1 {
            self.primary_dev_item().total_bytes
        } else {
            self.sb.total_bytes
        };
        let max = match kind {
            SpaceKind::Data if self.small_chunks => 8 << 20,
            SpaceKind::Data => 1 << 30,
            SpaceKind::Metadata if self.small_chunks => 32 << 20,
            SpaceKind::Metadata => 256 << 20,
            SpaceKind::System => 32 << 20,
        };
        let floor: u64 = if self.small_chunks { 1 << 20 } else { 16 << 20 };
        let tenth = (total / 10) / STRIPE * STRIPE;
        let fit = self
            .chunk_fit
            .filter(|&(ty, _)| ty == kind.flag())
            .map(|(_, len)| len);
        let want = match fit {
            Some(fit) => fit.div_ceil(1 << 20) * (1 << 20),
            None => (max as u64).min(tenth.max(floor)),
        }
        .max(min_len.div_ceil(STRIPE) * STRIPE);
        // Each device's largest hole, most room first, as the kernel picks devices (packing:
        // the lowest hole where the chunk fits).
        let mut devs: Vec<(u64, u64, u64)> = Vec::new(); // (devid, hole, room per stripe)
        let ids: Vec<u64> = self
            .disk
            .devices
            .members()
            .iter()
            .map(|m| m.devid)
            .collect();
        for devid in ids {
            let holes = self.device_holes(devid)?;
            let fits = |len: u64| len / attr.dev_stripes as u64 >= want.div_ceil(STRIPE) * STRIPE;
            let lowest = fit.and_then(|_| holes.iter().filter(|h| fits(h.1)).min_by_key(|h| h.0));
            if let Some(&(hole, len)) = lowest.or(holes.first()) {
                let room = (len / attr.dev_stripes as u64) / STRIPE * STRIPE;
                if room > 0 {
                    devs.push((devid, hole, room));
                }
            }
        }
        devs.sort_by_key(|&(devid, _, room)| (std::cmp::Reverse(room), devid));
        let mut ndevs = devs.len();
        if attr.devs_max > 0 {
            ndevs = ndevs.min(attr.devs_max);
        }
        ndevs -= ndevs % attr.devs_increment;
        if ndevs < attr.devs_min || ndevs == 0 {
            return Err(Error::NoSpace(format!(
                "a {} {kind:?} chunk needs room on {} devices, {} have unallocated space",
                crate::io::volumes::profile_name(profile),
                attr.devs_min,
                devs.len()
            )));
        }
        devs.truncate(ndevs);
        let num_stripes = ndevs * attr.dev_stripes;
        let data_stripes = crate::io::volumes::data_stripes(profile, num_stripes) as u64;
        let stripe_size =
            (want.div_ceil(data_stripes).div_ceil(STRIPE) * STRIPE).min(devs[ndevs - 1].2);
        let length = stripe_size * data_stripes;
        if length < (1 << 20) || length < min_len {
            return Err(Error::NoSpace(format!(
                "the devices have no unallocated hole big enough for a {kind:?} chunk"
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
        let mut stripes: Vec<Stripe> = Vec::with_capacity(num_stripes);
        for &(devid, hole, _) in &devs {
            let dev_uuid = self.dev_items.get(&devid).map_or([0; 16], |d| d.uuid);
            for i in 0..attr.dev_stripes as u64 {
                stripes.push(Stripe {
                    devid,
                    offset: hole + i * stripe_size,
                    dev_uuid,
                });
            }
        }
        let chunk = ChunkItem {
            length,
            owner: EXTENT_TREE_OBJECTID,
            stripe_len: STRIPE,
            ty: flags,
            io_align: STRIPE as u32,
            io_width: STRIPE as u32,
            sector_size: self.disk.sectorsize(),
            num_stripes: num_stripes as u16,
            sub_stripes: attr.sub_stripes as u16,
            stripes: stripes.clone(),
        };
        // A profile the filesystem did not use before may need its feature flag.
        if profile & (BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID1C4) != 0 {
            self.sb.incompat_flags |= INCOMPAT_RAID1C34;
        }
        if profile & (BLOCK_GROUP_RAID5 | BLOCK_GROUP_RAID6) != 0 {
            self.sb.incompat_flags |= INCOMPAT_RAID56;
        }
        // Register first, so the tree changes below can allocate from the new space.
        self.disk.add_chunk(logical, chunk.clone())?;
        let mut bg = BlockGroup::new(logical, length, flags);
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
                length: stripe_size,
                chunk_tree_uuid: self.chunk_tree_uuid,
            };
            self.insert_item(
                DEV_TREE_OBJECTID,
                Key::new(s.devid, DEV_EXTENT_KEY, s.offset),
                &de.to_bytes(),
            )?;
        }
        for &(devid, _, _) in &devs {
            let Some(item) = self.dev_items.get_mut(&devid) else {
                continue;
            };
            item.bytes_used += stripe_size * attr.dev_stripes as u64;
            let di = item.to_bytes();
            self.replace_item(
                CHUNK_TREE_OBJECTID,
                Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
                &di,
            )?;
        }
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
            "added a {} {kind:?} chunk of {} MiB at logical {logical}",
            crate::io::volumes::profile_name(profile),
            length >> 20
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
        for i in 0..chunk.stripes.len() {
            for (l, len) in crate::io::volumes::logical_ranges_of(chunk, bg.start, i, m, 4096) {
                bg.exclude(l, len);
            }
        }
    }
}

impl Writer {
    /// Where the last chunk stripe (dev extent) on device `devid` ends (1 MiB, the reserved
    /// start, when it has none): the smallest size it can take without moving a chunk.
    pub(crate) fn device_extents_end(&mut self, devid: u64) -> Result<u64> {
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
        Ok(end)
    }

    /// Sets the size of device `devid` to `size` bytes (rounded down to whole sectors), as the
    /// kernel's resize does: its DEV_ITEM, the filesystem's total_bytes and that device's
    /// superblock item, in this transaction. Growing needs the device to be that long;
    /// shrinking needs every chunk stripe on it to end by the new size (moving chunks is
    /// relocation, which this does not do). Returns the new size.
    pub(crate) fn resize_device(&mut self, devid: u64, size: u64) -> Result<u64> {
        self.check_writable()?;
        self.begin_qgroup_neutral();
        let Some(old) = self.dev_items.get(&devid).map(|d| d.total_bytes) else {
            let ids: Vec<String> = self.dev_items.keys().map(|d| d.to_string()).collect();
            return Err(Error::Invalid(format!(
                "the filesystem has no device {devid} (its devices: {})",
                ids.join(", ")
            )));
        };
        let Some(len) = self.disk.devices.get(devid).map(|d| d.len()) else {
            return Err(Error::Invalid(format!(
                "device {devid} is missing: give it with --device to resize it"
            )));
        };
        let sector = u64::from(self.disk.sectorsize());
        let size = size / sector * sector;
        if size > len {
            return Err(Error::NoSpace(format!(
                "device {devid} is {len} bytes, so it cannot hold {size}: make the device (the \
                 image file, the partition) larger first"
            )));
        }
        let end = self.device_extents_end(devid)?;
        if size < end {
            return Err(Error::NoSpace(format!(
                "device {devid} has chunks up to byte {end}, past {size}: they must be \
                 relocated below it first"
            )));
        }
        if size == old {
            return Ok(size);
        }
        if let Some(item) = self.dev_items.get_mut(&devid) {
            item.total_bytes = size;
        }
        // (A damaged superblock may say less than this device alone.)
        self.sb.total_bytes = self.sb.total_bytes.saturating_sub(old).saturating_add(size);
        let di = self.dev_items.get(&devid).map(|d| d.to_bytes());
        if let Some(di) = di {
            self.replace_item(
                CHUNK_TREE_OBJECTID,
                Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
                &di,
            )?;
        }
        log::info!("device {devid}: resized from {old} to {size} bytes");
        Ok(size)
    }

    /// Removes device `devid`, which must hold no chunk stripe, as the kernel's device
    /// remove ends: its DEV_ITEM goes, the device count and total size shrink, and from now on
    /// no superblock is written to it (the caller wipes its superblocks once this transaction
    /// has committed). Refused where the devices left could not make a new chunk of a profile
    /// the filesystem uses (RAID1 on two devices, say), and for the last device.
    pub(crate) fn remove_device(&mut self, devid: u64) -> Result<u64> {
        self.check_remove_device(devid)?;
        self.begin_qgroup_neutral();
        let Some(item) = self.dev_items.get(&devid).cloned() else {
            return Err(Error::Invalid(format!(
                "the filesystem has no device {devid}"
            )));
        };
        let end = self.device_extents_end(devid)?;
        if end > 1 << 20 {
            return Err(Error::Invalid(format!(
                "device {devid} still holds chunks: relocate them first"
            )));
        }
        self.log.broken = true;
        self.delete_item(
            CHUNK_TREE_OBJECTID,
            &Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
        )?;
        self.dev_items.remove(&devid);
        self.sb.num_devices -= 1;
        self.sb.total_bytes = self.sb.total_bytes.saturating_sub(item.total_bytes);
        self.added.retain(|(d, ..)| *d != devid);
        if devid == self.disk.devid() {
            // The filesystem is opened by another device from now on (check_remove_device
            // made sure one is present); its item is the superblock's from this commit.
            if let Some(&next) = self
                .dev_items
                .keys()
                .find(|&&d| self.disk.devices.get(d).is_some())
            {
                self.disk.devices.set_primary(next);
            }
        }
        // No more superblocks (nor anything else) go to it.
        self.disk.devices.mark_removed(devid);
        log::info!("removed device {devid}");
        Ok(devid)
    }

    /// Whether device `devid` may be removed: it exists, it is not the last one nor the one
    /// the filesystem was opened by, and the devices left can make a new chunk of every
    /// profile the filesystem uses (RAID1 on two devices cannot lose one, say).
    pub(crate) fn check_remove_device(&mut self, devid: u64) -> Result<()> {
        self.check_writable()?;
        if !self.dev_items.contains_key(&devid) {
            let ids: Vec<String> = self.dev_items.keys().map(|d| d.to_string()).collect();
            return Err(Error::Invalid(format!(
                "the filesystem has no device {devid} (its devices: {})",
                ids.join(", ")
            )));
        };
        if self.dev_items.len() < 2 {
            return Err(Error::Invalid(
                "the last device of a filesystem stays".into(),
            ));
        }
        if !self
            .dev_items
            .keys()
            .any(|&d| d != devid && self.disk.devices.get(d).is_some())
        {
            return Err(Error::Invalid(format!(
                "device {devid} is the only one present: the others are missing, so nothing \
                 could be moved off it; replace a missing device first"
            )));
        }
        let left = self.dev_items.len() - 1;
        let mut profiles: Vec<u64> = Vec::new();
        self.allocator.for_each(|g| {
            let p = g.flags & BLOCK_GROUP_PROFILE_MASK;
            if !profiles.contains(&p) {
                profiles.push(p);
            }
        });
        for p in profiles {
            let min = crate::io::volumes::raid_attr(p).devs_min;
            if left < min {
                return Err(Error::Invalid(format!(
                    "{} needs {min} devices and {left} would be left: convert the profile \
                     first (`butter balance start -dconvert=... -mconvert=...`) or add a \
                     device",
                    crate::io::volumes::profile_name(p)
                )));
            }
        }
        Ok(())
    }

    /// Removes the empty block group at `start`, as the kernel removes an unused one: its
    /// BLOCK_GROUP_ITEM and free space tree entries, its CHUNK_ITEM (and its entry in the
    /// superblock's system chunk array), its dev extents, and their bytes from the devices'
    /// `bytes_used`. Refused unless the group holds no extent and has nothing pinned, held or
    /// new in this transaction, and unless another group of its kind stays. Its device space
    /// is free for new chunks once this transaction has committed.
    pub(crate) fn remove_empty_group(&mut self, start: u64) -> Result<()> {
        self.check_writable()?;
        // Chunks are not what qgroups count.
        self.begin_qgroup_neutral();
        let Some((len, flags, used, busy)) = self.allocator.with_group(start, |g| {
            let busy = g.new
                || g.pinned.total() > 0
                || g.held.total() > 0
                || g.free.total() + g.excluded.total() != g.len;
            (g.len, g.flags, g.used, busy)
        }) else {
            return Err(Error::Invalid(format!("no block group starts at {start}")));
        };
        if used > 0 || busy {
            return Err(Error::Invalid(format!(
                "the block group at {start} is in use ({used} bytes of extents)"
            )));
        }
        let kind = SpaceKind::of_flags(flags);
        let mut others = 0;
        self.allocator.for_each(|g| {
            if g.start != start && SpaceKind::of_flags(g.flags) == kind {
                others += 1;
            }
        });
        if others == 0 {
            return Err(Error::Invalid(format!(
                "the block group at {start} is the last of its kind; it stays"
            )));
        }
        // The trees are the truth: no extent item may lie in it.
        if let Some((k, _)) = self.extent_items_in(start, len)?.first() {
            return Err(Error::Invalid(format!(
                "the block group at {start} holds the extent {}",
                k.objectid
            )));
        }
        let Some(chunk) = self.disk.chunk_map().lookup(start).map(|c| c.item.clone()) else {
            return Err(Error::Invalid(format!("no chunk at {start}")));
        };
        // Out of the allocator first: nothing this transaction writes goes there.
        self.allocator.remove_group(start);
        self.log.broken = true;
        let bg_tree = self.block_group_tree();
        self.delete_item(bg_tree, &Key::new(start, BLOCK_GROUP_ITEM_KEY, len))?;
        if self.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE) {
            self.sync_fst_items(start, len, Vec::new())?;
        }
        self.delete_item(
            CHUNK_TREE_OBJECTID,
            &Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, start),
        )?;
        let stripe_size = crate::io::volumes::stripe_size(&chunk);
        let mut devids: Vec<u64> = Vec::new();
        for st in &chunk.stripes {
            self.delete_item(
                DEV_TREE_OBJECTID,
                &Key::new(st.devid, DEV_EXTENT_KEY, st.offset),
            )?;
            self.freed_dev_extents
                .push((st.devid, st.offset, stripe_size));
            if let Some(item) = self.dev_items.get_mut(&st.devid) {
                item.bytes_used = item.bytes_used.saturating_sub(stripe_size);
            }
            devids.push(st.devid);
        }
        devids.dedup();
        for devid in devids {
            if let Some(di) = self.dev_items.get(&devid).map(|d| d.to_bytes()) {
                self.replace_item(
                    CHUNK_TREE_OBJECTID,
                    Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
                    &di,
                )?;
            }
        }
        if flags & BLOCK_GROUP_SYSTEM != 0 {
            self.drop_from_sys_chunk_array(start)?;
        }
        self.disk.remove_chunk(start);
        log::info!(
            "removed the empty {} block group at {start} ({} MiB)",
            crate::io::volumes::profile_name(flags & BLOCK_GROUP_PROFILE_MASK),
            len >> 20
        );
        Ok(())
    }

    /// Takes the chunk at `logical` out of the superblock's system chunk array.
    fn drop_from_sys_chunk_array(&mut self, logical: u64) -> Result<()> {
        let arr = self.sys_chunk_array.clone();
        let mut out = Vec::with_capacity(arr.len());
        let mut at = 0usize;
        while at + 17 + 48 <= arr.len() {
            let key = Key::from_bytes(&arr[at..at + 17]);
            let n = u16::from_le_bytes([arr[at + 17 + 44], arr[at + 17 + 45]]) as usize;
            let end = at + 17 + 48 + 32 * n;
            if end > arr.len() {
                break;
            }
            if !(key.ty == CHUNK_ITEM_KEY && key.offset == logical) {
                out.extend_from_slice(&arr[at..end]);
            }
            at = end;
        }
        self.sys_chunk_array = out;
        self.sys_array_dirty = true;
        Ok(())
    }

    /// Adds `dev` to the filesystem as a new device (the next devid), as the kernel's device
    /// add does: its DEV_ITEM in the chunk tree, the device count and total size in the
    /// superblock; its superblocks are written with every commit from now on (first). No
    /// chunk is moved onto it (that is balance); new chunks may use it once this transaction
    /// has committed. `name` (a path) names it in messages. Returns its devid.
    pub(crate) fn add_device(
        &mut self,
        dev: std::sync::Arc<dyn crate::io::device::BlockDevice>,
        uuid: [u8; 16],
        name: String,
    ) -> Result<u64> {
        self.check_writable()?;
        self.begin_qgroup_neutral();
        // Until the commit names it, a log could not replay onto the new device set.
        self.log.broken = true;
        let sector = u64::from(self.disk.sectorsize());
        let size = dev.len() / sector * sector;
        // The smallest filesystem mkfs makes (single profiles) is the smallest device.
        let min: u64 = 45 << 20;
        if size < min {
            return Err(Error::NoSpace(format!(
                "the new device is {size} bytes; a device needs at least {min}"
            )));
        }
        if self.dev_items.values().any(|d| d.uuid == uuid) {
            return Err(Error::Invalid("that device uuid is taken".into()));
        }
        let devid = self.dev_items.keys().max().copied().unwrap_or(0) + 1;
        let template = self.primary_dev_item().clone();
        let item = crate::format::superblock::DevItem {
            devid,
            total_bytes: size,
            bytes_used: 0,
            io_align: template.io_align,
            io_width: template.io_width,
            sector_size: template.sector_size,
            dev_type: 0,
            generation: 0,
            start_offset: 0,
            dev_group: 0,
            seek_speed: 0,
            bandwidth: 0,
            uuid,
            fsid: template.fsid,
        };
        self.insert_item(
            CHUNK_TREE_OBJECTID,
            Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
            &item.to_bytes(),
        )?;
        self.dev_items.insert(devid, item);
        self.sb.num_devices += 1;
        self.sb.total_bytes += size;
        self.added.push((devid, dev, name));
        log::info!("added device {devid} of {size} bytes");
        Ok(devid)
    }

    /// Makes the device end where its last chunk ends (what `mkfs --shrink` wants): the
    /// device item (in the chunk tree and the superblock) and the filesystem size become
    /// that end. Returns it; the caller commits, then may cut the image file there.
    pub(crate) fn shrink_device_to_chunks(&mut self) -> Result<u64> {
        let devid = self.disk.devid();
        let end = self.device_extents_end(devid)?;
        if self.disk.devices.len() > 1 {
            return Err(Error::Unsupported(
                "shrinking a filesystem of several devices".into(),
            ));
        }
        let total = self.primary_dev_item().total_bytes;
        if end >= total {
            return Ok(total);
        }
        self.resize_device(devid, end)
    }
}
