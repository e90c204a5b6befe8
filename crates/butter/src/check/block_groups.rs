//! Phase 4: block groups against their extents and chunks, dev extents against chunk stripes
//! and device items, and the free space tree against the extent tree.

use super::*;

impl Checker<'_> {
    pub(super) fn phase_block_groups(&mut self) -> Result<()> {
        let root = self
            .trees
            .iter()
            .find(|r| r.id == BLOCK_GROUP_TREE_OBJECTID)
            .copied()
            .or_else(|| self.extent_root());
        let Some(root) = root else { return Ok(()) };
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(root.id));
                return Ok(());
            }
        };
        let mut groups = Vec::new();
        loop {
            let item = match it.next_item() {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(root.id));
                    break;
                }
            };
            if item.key.ty != BLOCK_GROUP_ITEM_KEY {
                continue;
            }
            let loc = item_loc(&item, root.id);
            match BlockGroupItem::parse(item.data()) {
                Ok(bg) => groups.push((item.key.objectid, item.key.offset, bg, loc)),
                Err(e) => self
                    .report
                    .err(FindingKind::ExtentItemBad, loc, e.to_string()),
            }
        }
        self.report.counts.block_groups = groups.len() as u64;
        let mut covered = 0u64;
        for (start, len, bg, loc) in &groups {
            let end = start.saturating_add(*len);
            for (b, e) in self.extents.range(*start..end) {
                let tree = e.flags & EXTENT_FLAG_TREE_BLOCK != 0;
                let fits = if tree {
                    bg.flags & (BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM) != 0
                } else {
                    bg.flags & BLOCK_GROUP_DATA != 0
                };
                if !fits {
                    self.report.err(
                        FindingKind::ExtentTypeMismatch,
                        e.loc.clone(),
                        format!(
                            "{} extent {b} lies in block group {start} of type {:#x}",
                            if tree { "tree block" } else { "data" },
                            bg.flags
                        ),
                    );
                }
            }
            let sum = self
                .extents
                .range(*start..end)
                .fold(0u64, |a, (_, e)| a.saturating_add(e.len));
            covered += self.extents.range(*start..end).count() as u64;
            if sum != bg.used {
                self.report.err_fix(
                    FindingKind::BlockGroupUsedMismatch,
                    loc.clone(),
                    format!(
                        "block group {start} length {len}: used {} but extents in it total {sum}",
                        bg.used
                    ),
                    Fix::BlockGroupUsed {
                        start: *start,
                        used: sum,
                    },
                );
            }
        }
        // Block groups and chunks describe the same ranges with the same type.
        const TYPE_MASK: u64 =
            BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM | BLOCK_GROUP_PROFILE_MASK;
        let chunks: Vec<(u64, u64, u64)> = self
            .fs
            .disk
            .chunk_map()
            .chunks()
            .map(|c| (c.logical, c.item.length, c.item.ty))
            .collect();
        for (start, len, bg, loc) in &groups {
            match chunks.iter().find(|c| c.0 == *start) {
                Some(c) if c.1 == *len && c.2 & TYPE_MASK == bg.flags & TYPE_MASK => {}
                Some(c) => self.report.err(
                    FindingKind::BlockGroupChunkMismatch,
                    loc.clone(),
                    format!(
                        "block group {start} length {len} flags {:#x}, but its chunk has length {} type {:#x}",
                        bg.flags, c.1, c.2
                    ),
                ),
                None => self.report.err(
                    FindingKind::BlockGroupChunkMismatch,
                    loc.clone(),
                    format!("block group {start} length {len} has no chunk"),
                ),
            }
        }
        for (start, len, _) in &chunks {
            if !groups.iter().any(|g| g.0 == *start) {
                self.report.err(
                    FindingKind::BlockGroupChunkMismatch,
                    Location::what(format!("chunk {start}")),
                    format!("chunk {start} length {len} has no block group item"),
                );
            }
        }
        let used = groups.iter().fold(0u64, |a, g| a.saturating_add(g.2.used));
        let sb_used = self.sb.bytes_used;
        if used != sb_used {
            self.report.err_fix(
                FindingKind::SuperBytesUsedMismatch,
                Location::what("superblock"),
                format!("superblock bytes_used {sb_used}, block groups use {used}"),
                Fix::SuperBytesUsed,
            );
        }
        if covered != self.extents.len() as u64 {
            for (b, e) in &self.extents {
                let inside = groups
                    .iter()
                    .any(|(s, l, _, _)| *b >= *s && *b - *s < *l && e.len <= *l - (*b - *s));
                if !inside {
                    self.report.err(
                        FindingKind::ExtentOutsideBlockGroup,
                        e.loc.clone(),
                        format!("extent {b} ({} bytes) lies in no block group", e.len),
                    );
                }
            }
        }
        let mut recs: Vec<GroupRec> = groups
            .into_iter()
            .map(|(start, len, _, loc)| GroupRec { start, len, loc })
            .collect();
        recs.sort_by_key(|g| g.start);
        self.groups = recs;
        self.check_dev_extents();
        self.check_free_space_tree();
        Ok(())
    }

    /// Chunks against dev extents: every stripe has a DEV_EXTENT naming its chunk with the
    /// stripe's length, dev extents of a device do not overlap and stay inside it, and each
    /// device item's bytes_used is the sum of its dev extents.
    fn check_dev_extents(&mut self) {
        let Some(chunk_root) = self.tree(CHUNK_TREE_OBJECTID) else {
            return;
        };
        let Some(dev_root) = self.tree(DEV_TREE_OBJECTID) else {
            self.report.err(
                FindingKind::RootItemBad,
                Location::what("root tree"),
                "no device tree root item".into(),
            );
            return;
        };
        let mut chunks: Vec<(u64, ChunkItem, Location)> = Vec::new();
        let mut devs: BTreeMap<u64, (DevItem, Location)> = BTreeMap::new();
        for item in self.collect_items(chunk_root, |k| {
            k.ty == CHUNK_ITEM_KEY || k.ty == DEV_ITEM_KEY
        }) {
            let loc = item_loc(&item, CHUNK_TREE_OBJECTID);
            let r = if item.key.ty == CHUNK_ITEM_KEY {
                ChunkItem::parse(item.data())
                    .map(|(c, _)| chunks.push((item.key.offset, c, loc.clone())))
            } else {
                DevItem::parse(item.data()).map(|d| {
                    devs.insert(d.devid, (d, loc.clone()));
                })
            };
            if let Err(e) = r {
                self.report.err(FindingKind::DevItemBad, loc, e.to_string());
            }
        }
        // (devid, physical) -> (dev extent, location, matched by a stripe)
        let mut dexts: BTreeMap<(u64, u64), (DevExtent, Location, bool)> = BTreeMap::new();
        for item in self.collect_items(dev_root, |k| k.ty == DEV_EXTENT_KEY) {
            let loc = item_loc(&item, DEV_TREE_OBJECTID);
            match DevExtent::parse(item.data()) {
                Ok(d) => {
                    dexts.insert((item.key.objectid, item.key.offset), (d, loc, false));
                }
                Err(e) => self.report.err(FindingKind::DevItemBad, loc, e.to_string()),
            }
        }
        // The device against the image's real size.
        let image_len = self.fs.disk.dev().len();
        let this_dev = self.fs.disk.devid();
        let sb = self.sb.clone();
        let sum: u64 = devs
            .values()
            .fold(0u64, |a, (d, _)| a.saturating_add(d.total_bytes));
        if !devs.is_empty() && sb.total_bytes < sum {
            self.report.err_fix(
                FindingKind::DeviceSizeMismatch,
                Location::what("superblock total_bytes"),
                format!(
                    "superblock total_bytes {} is smaller than its devices' total_bytes {sum}",
                    sb.total_bytes
                ),
                Fix::DeviceSizes,
            );
        }
        let mut dev_size_reported = false;
        for (what, size, loc) in [
            (
                "superblock dev_item",
                sb.dev_item.total_bytes,
                Location::what("superblock dev_item"),
            ),
            (
                "dev item",
                devs.get(&this_dev).map_or(0, |d| d.0.total_bytes),
                devs.get(&this_dev).map(|d| d.1.clone()).unwrap_or_default(),
            ),
        ] {
            if size > image_len && !dev_size_reported {
                dev_size_reported = true;
                self.report.err(
                    FindingKind::DeviceSizeMismatch,
                    loc,
                    format!(
                        "the {what} says device {this_dev} is {size} bytes, but the image is only {image_len} bytes (truncated?)"
                    ),
                );
            }
        }
        // Each dev extent's length once the stripes' are mended: bytes_used follows these.
        let mut repaired: BTreeMap<(u64, u64), u64> =
            dexts.iter().map(|(k, (d, _, _))| (*k, d.length)).collect();
        for (logical, c, cloc) in &chunks {
            let n = c.num_stripes as u64;
            let data_stripes = match c.ty & BLOCK_GROUP_PROFILE_MASK {
                BLOCK_GROUP_RAID0 => n,
                BLOCK_GROUP_RAID10 => n / (c.sub_stripes.max(1) as u64),
                BLOCK_GROUP_RAID5 => n.saturating_sub(1),
                BLOCK_GROUP_RAID6 => n.saturating_sub(2),
                _ => 1,
            };
            let stripe_len = c.length / data_stripes.max(1);
            for (i, st) in c.stripes.iter().enumerate() {
                let st_end = st.offset.saturating_add(stripe_len);
                let dev_len = self.fs.disk.devices.get(st.devid).map(|d| d.len());
                if dev_len.is_some_and(|len| st_end > len) {
                    self.report.err(
                        FindingKind::DeviceSizeMismatch,
                        cloc.clone(),
                        format!(
                            "chunk {logical} stripe {i} lies at device bytes {}..{st_end}, past the end of the image ({} bytes)",
                            st.offset,
                            dev_len.unwrap_or(0)
                        ),
                    );
                }
                // The chunk tree maps the data, so its stripes say what the dev extents are.
                let fix = Fix::DevExtent {
                    devid: st.devid,
                    offset: st.offset,
                    chunk_offset: *logical,
                    length: stripe_len,
                };
                repaired.insert((st.devid, st.offset), stripe_len);
                match dexts.get_mut(&(st.devid, st.offset)) {
                    None => self.report.err_fix(
                        FindingKind::DevExtentMissing,
                        cloc.clone(),
                        format!(
                            "chunk {logical} stripe {i} (devid {} offset {}) has no DEV_EXTENT",
                            st.devid, st.offset
                        ),
                        fix,
                    ),
                    Some((d, dloc, matched)) => {
                        *matched = true;
                        if d.chunk_offset != *logical || d.length != stripe_len {
                            self.report.err_fix(
                                FindingKind::DevExtentMismatch,
                                dloc.clone(),
                                format!(
                                    "dev extent at devid {} offset {} names chunk {} length {}, but it holds stripe {i} of chunk {logical} (stripe length {stripe_len})",
                                    st.devid, st.offset, d.chunk_offset, d.length
                                ),
                                fix,
                            );
                        }
                    }
                }
            }
        }
        let mut used: BTreeMap<u64, u64> = BTreeMap::new();
        let mut prev: Option<(u64, u64)> = None; // (devid, end)
        for ((devid, phys), (d, dloc, matched)) in &dexts {
            if !matched && *devid == this_dev && phys.saturating_add(d.length) > image_len {
                self.report.err(
                    FindingKind::DeviceSizeMismatch,
                    dloc.clone(),
                    format!(
                        "dev extent at devid {devid} offset {phys} length {} lies past the end of the image ({image_len} bytes)",
                        d.length
                    ),
                );
            }
            if !matched {
                // Space reserved on the device for nothing: wasted, not damage (the kernel and
                // `btrfs check` accept it); overlaps and bytes_used are still checked.
                self.report.add(
                    Severity::Warning,
                    FindingKind::DevExtentMismatch,
                    dloc.clone(),
                    format!(
                        "dev extent at devid {devid} offset {phys} (chunk {} length {}) is no stripe of any chunk",
                        d.chunk_offset, d.length
                    ),
                );
            }
            let end = phys.saturating_add(d.length);
            if let Some((pdev, pend)) = prev {
                if pdev == *devid && pend > *phys {
                    self.report.err(
                        FindingKind::DevExtentOverlap,
                        dloc.clone(),
                        format!("dev extent at devid {devid} offset {phys} starts before the previous one ends at {pend}"),
                    );
                }
            }
            prev = Some((
                *devid,
                end.max(prev.filter(|p| p.0 == *devid).map_or(0, |p| p.1)),
            ));
            match devs.get(devid) {
                Some((dev, _)) if end > dev.total_bytes => self.report.err(
                    FindingKind::DevExtentMismatch,
                    dloc.clone(),
                    format!(
                        "dev extent at devid {devid} offset {phys} length {} ends past the device size {}",
                        d.length, dev.total_bytes
                    ),
                ),
                Some(_) => {}
                None => self.report.err(
                    FindingKind::DevExtentMismatch,
                    dloc.clone(),
                    format!("dev extent at devid {devid} offset {phys}: no device item for devid {devid}"),
                ),
            }
            let u = used.entry(*devid).or_default();
            *u = u.saturating_add(d.length);
        }
        let mut will_use: BTreeMap<u64, u64> = BTreeMap::new();
        for ((devid, _), len) in &repaired {
            let u = will_use.entry(*devid).or_default();
            *u = u.saturating_add(*len);
        }
        for (devid, (dev, loc)) in &devs {
            let sum = used.get(devid).copied().unwrap_or(0);
            let after = will_use.get(devid).copied().unwrap_or(0);
            if dev.bytes_used != sum {
                self.report.err_maybe_fix(
                    FindingKind::DevBytesUsedMismatch,
                    loc.clone(),
                    format!(
                        "device {devid}: bytes_used {} but its dev extents total {sum}",
                        dev.bytes_used
                    ),
                    (dev.bytes_used != after).then_some(Fix::DevBytesUsed {
                        devid: *devid,
                        used: after,
                    }),
                );
            }
        }
        let listed = devs.len() as u64;
        if listed != self.sb.num_devices {
            self.report.err_fix(
                FindingKind::NumDevicesMismatch,
                Location::what("superblock"),
                format!(
                    "num_devices says the filesystem has {} devices, but the chunk tree lists {listed}",
                    self.sb.num_devices
                ),
                Fix::NumDevices { count: listed },
            );
        }
        let sd = &self.sb.dev_item;
        let sum = used.get(&sd.devid).copied().unwrap_or(0);
        let after = will_use.get(&sd.devid).copied().unwrap_or(0);
        if sd.bytes_used != sum {
            self.report.err_maybe_fix(
                FindingKind::DevBytesUsedMismatch,
                Location::what("superblock dev_item"),
                format!(
                    "superblock device {}: bytes_used {} but its dev extents total {sum}",
                    sd.devid, sd.bytes_used
                ),
                (sd.bytes_used != after).then_some(Fix::DevBytesUsed {
                    devid: sd.devid,
                    used: after,
                }),
            );
        }
    }

    /// The free space tree against the extent tree, block group by block group.
    fn check_free_space_tree(&mut self) {
        let sb = self.sb.clone();
        if !sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE) {
            return;
        }
        if !sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE_VALID) {
            self.report.add(
                Severity::Warning,
                FindingKind::FreeSpaceMismatch,
                Location::what("superblock compat_ro flags"),
                "FREE_SPACE_TREE is set but FREE_SPACE_TREE_VALID is not: the kernel rebuilds the tree; not checked".into(),
            );
            return;
        }
        let Some(root) = self.tree(FREE_SPACE_TREE_OBJECTID) else {
            self.report.err(
                FindingKind::RootItemBad,
                Location::what("root tree"),
                "the FREE_SPACE_TREE feature is set but there is no free space tree".into(),
            );
            return;
        };
        let ss = self.fs.disk.sectorsize();
        let items = self.collect_items(root, |_| true);
        let groups = std::mem::take(&mut self.groups);
        // Items by block group (index into `groups`), the rest in key order.
        let mut per: BTreeMap<usize, Vec<&ItemRef>> = BTreeMap::new();
        let mut outside: Vec<&ItemRef> = Vec::new();
        for it in &items {
            let o = it.key.objectid;
            let i = groups.partition_point(|g| g.start <= o);
            match i.checked_sub(1) {
                Some(gi) if o - groups[gi].start < groups[gi].len => {
                    per.entry(gi).or_default().push(it)
                }
                _ => outside.push(it),
            }
        }
        let mut i = 0;
        while i < outside.len() {
            let it = outside[i];
            let loc = item_loc(it, FREE_SPACE_TREE_OBJECTID);
            if it.key.ty == FREE_SPACE_INFO_KEY {
                let (s, end) = (
                    it.key.objectid,
                    it.key.objectid.saturating_add(it.key.offset),
                );
                let overlaps = groups
                    .iter()
                    .any(|g| g.start < end && s < g.start.saturating_add(g.len));
                let mut j = i + 1;
                while j < outside.len()
                    && outside[j].key.ty != FREE_SPACE_INFO_KEY
                    && (s..end).contains(&outside[j].key.objectid)
                {
                    j += 1;
                }
                // mkfs's leftovers lie below the last block group; an info past every group
                // is damage.
                let below_last = groups.iter().any(|g| end <= g.start.saturating_add(g.len));
                if !overlaps && below_last {
                    self.report.add(
                        Severity::Warning,
                        FindingKind::FreeSpaceOutsideBlockGroup,
                        loc,
                        format!(
                            "free space info and {} more items for {s}+{}, which is no block group (stale: mkfs.btrfs leaves these for the temporary block groups it removes)",
                            j - i - 1,
                            it.key.offset
                        ),
                    );
                    i = j;
                    continue;
                }
            }
            self.report.err_fix(
                FindingKind::FreeSpaceOutsideBlockGroup,
                loc,
                format!("free space item {} lies in no block group", it.key),
                Fix::DeleteItem {
                    tree: FREE_SPACE_TREE_OBJECTID,
                    key: it.key,
                },
            );
            i += 1;
        }
        for (gi, g) in groups.iter().enumerate() {
            let its = per.remove(&gi).unwrap_or_default();
            let info_key = Key::new(g.start, FREE_SPACE_INFO_KEY, g.len);
            let Some(info) = its.first().filter(|i| i.key == info_key) else {
                let first = its
                    .first()
                    .map(|i| format!(" (its first free space item is {})", i.key))
                    .unwrap_or_default();
                self.report.err(
                    FindingKind::FreeSpaceInfoMissing,
                    g.loc.clone(),
                    format!(
                        "block group {}+{} has no FREE_SPACE_INFO {info_key}{first}",
                        g.start, g.len
                    ),
                );
                continue;
            };
            let iloc = item_loc(info, FREE_SPACE_TREE_OBJECTID);
            let refs: Vec<(Key, &[u8])> = its.iter().map(|i| (i.key, i.data())).collect();
            let d = match fst::decode_items(&refs, g.start, g.len, ss) {
                Ok(d) => d,
                Err(e) => {
                    let (loc, msg) = match &e {
                        Error::Corrupt { loc, reason } => {
                            let at = its
                                .iter()
                                .find(|i| Some(i.key) == loc.key)
                                .map(|i| item_loc(i, FREE_SPACE_TREE_OBJECTID));
                            (at.unwrap_or_else(|| iloc.clone()), reason.clone())
                        }
                        e => (iloc.clone(), e.to_string()),
                    };
                    self.report.err(
                        FindingKind::FreeSpaceItemBad,
                        loc,
                        format!("block group {}: {msg}", g.start),
                    );
                    continue;
                }
            };
            let unknown = d.info.flags & !FREE_SPACE_USING_BITMAPS;
            if unknown != 0 {
                self.report.err(
                    FindingKind::FreeSpaceFlagsMismatch,
                    iloc.clone(),
                    format!(
                        "block group {}: free space info flags {:#x} has unknown bits {unknown:#x}",
                        g.start, d.info.flags
                    ),
                );
            }
            if let Some(p) = d.flags_problem() {
                self.report.err(
                    FindingKind::FreeSpaceFlagsMismatch,
                    iloc.clone(),
                    format!("block group {}: {p}", g.start),
                );
            }
            if let Some(p) = d.count_problem() {
                self.report.err(
                    FindingKind::FreeSpaceCountMismatch,
                    iloc.clone(),
                    format!("block group {}: {p}", g.start),
                );
            }
            let end = g.start.saturating_add(g.len);
            let used = self
                .extents
                .range(..end)
                .rev()
                .take_while(|(b, e)| b.saturating_add(e.len) > g.start || **b >= g.start)
                .map(|(b, e)| (*b, e.len));
            let implied = fst::BgFreeSpace::from_used(g.start, g.len, used);
            if d.space != implied {
                let only_tree = range_diff(&d.space.extents, &implied.extents);
                let only_ext = range_diff(&implied.extents, &d.space.extents);
                let show = |v: &[(u64, u64)]| {
                    let mut s: Vec<String> =
                        v.iter().take(4).map(|(a, l)| format!("{a}+{l}")).collect();
                    if v.len() > 4 {
                        s.push(format!("... ({} ranges)", v.len()));
                    }
                    s.join(", ")
                };
                self.report.err(
                    FindingKind::FreeSpaceMismatch,
                    iloc.clone(),
                    format!(
                        "block group {}+{}: free space tree says {} free bytes, the extent tree {}; free only in the free space tree (used by extents): [{}]; free only by the extent tree: [{}]",
                        g.start,
                        g.len,
                        d.space.free_bytes(),
                        implied.free_bytes(),
                        show(&only_tree),
                        show(&only_ext)
                    ),
                );
            }
        }
        self.groups = groups;
    }
}
