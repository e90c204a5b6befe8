//! Phase 6 (and 7 with `--check-data-csum`): checksum items cover every checksummed data
//! sector (and the data matches them); an unreplayed fsync log carries its csums.

use super::*;

impl Checker<'_> {
    pub(super) fn phase_csums(&mut self, extents: &[(u64, u64, Location)]) -> Result<()> {
        let ss = self.fs.disk.sectorsize() as u64;
        let cover = self.check_csum_items();
        self.check_log_csums();
        // Which sectors of a range have csums: from the items' ranges gathered above (one
        // walk of the tree), or where that walk could not be had, a lookup per range.
        let sums = |c: &Checker, logical: u64, len: u64| -> Result<Vec<bool>> {
            match &cover {
                Some(cover) if logical.is_multiple_of(ss) => {
                    Ok(covered_sectors(cover, logical, len, ss))
                }
                _ => Ok(c
                    .fs
                    .data_csums(logical, len)?
                    .iter()
                    .map(Option::is_some)
                    .collect()),
            }
        };
        let nodatasum = std::mem::take(&mut self.nodatasum);
        for r in &nodatasum {
            if r.len > MAX_DATA_EXTENT {
                continue;
            }
            match sums(self, r.logical, r.len) {
                Ok(v) => {
                    if let Some(i) = v.iter().position(|c| *c) {
                        let n = v.iter().filter(|c| **c).count();
                        self.report.err(
                            FindingKind::CsumOnNodatasum,
                            r.loc.clone(),
                            format!(
                                "odd csum item: tree {} inode {} is NODATASUM, but {n} sectors of its data at file offset {} (logical {}..{}) have csums, first at logical {}",
                                r.tree,
                                r.ino,
                                r.file_off,
                                r.logical,
                                r.logical.saturating_add(r.len),
                                r.logical.saturating_add(i as u64 * ss)
                            ),
                        );
                    }
                }
                Err(e) => self.unreadable(e, Some(CSUM_TREE_OBJECTID)),
            }
        }
        for (b, l, loc) in extents {
            // Phase 3 matched the length with the extent item; still, a data extent is at most
            // 128 MiB, and a damaged length must not make us allocate for billions of sectors.
            if *l > MAX_DATA_EXTENT {
                self.report.add(
                    Severity::Warning,
                    FindingKind::CsumMissing,
                    loc.clone(),
                    format!("data extent {b}: length {l} is too large; csums not checked"),
                );
                continue;
            }
            match sums(self, *b, *l) {
                Ok(v) => {
                    self.report.counts.csum_sectors += v.len() as u64;
                    let missing: Vec<usize> = v
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| !**c)
                        .map(|(i, _)| i)
                        .collect();
                    if let Some(first) = missing.first() {
                        self.report.err(
                            FindingKind::CsumMissing,
                            loc.clone(),
                            format!(
                                "data at {b} ({l} bytes, used by a file extent): {} of {} sectors have no csum, first at {}",
                                missing.len(),
                                v.len(),
                                b.saturating_add((*first as u64).saturating_mul(ss))
                            ),
                        );
                    }
                }
                Err(e) => self.unreadable(e, Some(CSUM_TREE_OBJECTID)),
            }
        }
        Ok(())
    }

    /// Csum tree items: whole csums, and no two items covering the same sector. Returns the
    /// data ranges the items cover (start, end), in order and merged, when the whole tree
    /// was read.
    fn check_csum_items(&mut self) -> Option<Vec<(u64, u64)>> {
        let root = self.tree(CSUM_TREE_OBJECTID)?;
        let ss = self.fs.disk.sectorsize() as u64;
        let csize = self.sb.csum_type.size() as u64;
        let mut prev: Option<(u64, Location)> = None; // (end, where)
        let mut cover: Vec<(u64, u64)> = Vec::new();
        let unreadable = |r: &Report| {
            r.findings
                .iter()
                .filter(|f| f.kind == FindingKind::TreeBlockUnreadable)
                .count()
        };
        let before = unreadable(&self.report);
        let items = self.collect_items(root, |k| k.ty == EXTENT_CSUM_KEY);
        let whole = unreadable(&self.report) == before;
        for item in items {
            let loc = item_loc(&item, CSUM_TREE_OBJECTID);
            let k = item.key;
            let size = item.data().len() as u64;
            if k.objectid != EXTENT_CSUM_OBJECTID || size == 0 || !size.is_multiple_of(csize) {
                self.report.err(
                    FindingKind::FsItemBad,
                    loc,
                    format!("csum item {k}: size {size} is not a positive multiple of the csum size {csize}"),
                );
                continue;
            }
            let start = k.offset;
            let end = start.saturating_add(size / csize * ss);
            if let Some((pend, ploc)) = &prev {
                if start < *pend {
                    self.report.err(
                        FindingKind::CsumOverlap,
                        loc.clone(),
                        format!(
                            "csum item for {start}..{end} overlaps the previous one, which ends at {pend} ({ploc})"
                        ),
                    );
                }
            }
            if prev.as_ref().is_none_or(|p| end > p.0) {
                prev = Some((end, loc));
            }
            if !start.is_multiple_of(ss) {
                // Sums off the sector grid: the lookup per range places them as it can.
                return None;
            }
            match cover.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => cover.push((start, end)),
            }
        }
        whole.then_some(cover)
    }

    /// Reads every data sector that has a csum and compares.
    pub(super) fn phase_data_read(&mut self) {
        let Some(root) = self.tree(CSUM_TREE_OBJECTID) else {
            return;
        };
        let ss = self.fs.disk.sectorsize() as u64;
        let ct = self.sb.csum_type;
        let csize = ct.size() as u64;
        // File extents by the data extent they use, for naming files.
        let mut by_extent: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (i, fe) in self.file_exts.iter().enumerate() {
            by_extent.entry(fe.disk_bytenr).or_default().push(i);
        }
        let items = self.collect_items(root, |k| {
            k.objectid == EXTENT_CSUM_OBJECTID && k.ty == EXTENT_CSUM_KEY
        });
        // At most this many mismatches are named one by one.
        const MAX_REPORTED: usize = 100;
        let mut reported = 0usize;
        let mut suppressed = 0u64;
        const CHUNK_SECTORS: u64 = 256;
        for item in items {
            let d = item.data();
            let n = d.len() as u64 / csize;
            let mut i = 0u64;
            while i < n {
                let cnt = (n - i).min(CHUNK_SECTORS);
                let Some(logical) = item.key.offset.checked_add(i * ss) else {
                    break;
                };
                let len = (cnt * ss) as usize;
                let sums = &d[(i * csize) as usize..((i + cnt) * csize) as usize];
                let all_ok = |at: usize, buf: &[u8]| {
                    let skip = at / ss as usize;
                    buf.chunks(ss as usize)
                        .zip(sums.chunks(csize as usize).skip(skip))
                        .all(|(b, c)| ct.verify(b, c))
                };
                let res = self
                    .fs
                    .disk
                    .read_data(logical, len, &all_ok)
                    .and_then(|r| match r {
                        Some(_) => Ok(None),
                        // No copy matches everywhere: the first copy, to name the bad sectors.
                        None => self.fs.disk.read_data(logical, len, &|_, _| true),
                    });
                match res {
                    Ok(None) => {}
                    Ok(Some(buf)) => {
                        for (j, (b, c)) in buf
                            .chunks(ss as usize)
                            .zip(sums.chunks(csize as usize))
                            .enumerate()
                        {
                            if ct.verify(b, c) {
                                continue;
                            }
                            if reported >= MAX_REPORTED {
                                suppressed += 1;
                                continue;
                            }
                            reported += 1;
                            let at = logical + j as u64 * ss;
                            let who = self.name_data(at, &by_extent);
                            self.report.err(
                                FindingKind::DataCsumMismatch,
                                item_loc(&item, CSUM_TREE_OBJECTID),
                                format!(
                                    "data checksum mismatch at logical {at} ({ss} bytes): {who}"
                                ),
                            );
                        }
                    }
                    Err(e) => self.report.err(
                        FindingKind::DataCsumMismatch,
                        item_loc(&item, CSUM_TREE_OBJECTID),
                        format!(
                            "data at logical {logical}..{} cannot be read: {e}",
                            logical + len as u64
                        ),
                    ),
                }
                self.report.counts.data_bytes_verified += len as u64;
                i += cnt;
            }
        }
        if suppressed > 0 {
            self.report.err(
                FindingKind::DataCsumMismatch,
                Location::what("data"),
                format!("{suppressed} more data sectors do not match their checksums"),
            );
        }
    }

    /// Which files use the data sector at `logical`: "file PATH (tree T inode I) offset F",
    /// for each file extent item that covers it (or "no file uses it").
    fn name_data(&self, logical: u64, by_extent: &BTreeMap<u64, Vec<usize>>) -> String {
        let Some((&start, ext)) = self.extents.range(..=logical).next_back() else {
            return "no extent item covers it".into();
        };
        if logical >= start.saturating_add(ext.len) {
            return "no extent item covers it".into();
        }
        let mut names = Vec::new();
        for &i in by_extent.get(&start).map(|v| v.as_slice()).unwrap_or(&[]) {
            let fe = &self.file_exts[i];
            let within = logical - start;
            let off = if fe.compressed {
                // Compressed: the sector lies somewhere in the item's compressed data.
                Some(fe.file_off)
            } else if within >= fe.offset && within - fe.offset < fe.num_bytes {
                Some(fe.file_off + (within - fe.offset))
            } else {
                None
            };
            let Some(off) = off else { continue };
            let path = self
                .fs
                .inode_path(crate::ids::Inode {
                    root: fe.owner,
                    ino: fe.ino,
                })
                .map(|p| format!("file /{p} "))
                .unwrap_or_default();
            names.push(format!(
                "{path}(tree {} inode {}) {}offset {off}",
                fe.owner,
                fe.ino,
                if fe.compressed {
                    "compressed extent at file "
                } else {
                    "file "
                }
            ));
            if names.len() >= 4 {
                break;
            }
        }
        if names.is_empty() {
            format!("in data extent {start}, which no file extent uses there")
        } else {
            format!("data extent {start}, used by {}", names.join("; "))
        }
    }

    /// An unreplayed fsync log: every regular extent it logs for an inode with data csums has
    /// its csums in the log or, for data committed before, in the csum tree (replay takes them
    /// from there).
    fn check_log_csums(&mut self) {
        if self.sb.log_root == 0 {
            return;
        }
        let log = match crate::tree_log::replay::read_log(&self.fs.disk) {
            Ok(Some(l)) => l,
            Ok(None) => return,
            Err(e) => {
                self.unreadable(e, Some(TREE_LOG_OBJECTID));
                return;
            }
        };
        let ss = self.fs.disk.sectorsize() as u64;
        let csize = self.sb.csum_type.size() as u64;
        for t in &log.trees {
            let mut ranges: Vec<(u64, u64)> = t
                .items
                .iter()
                .filter(|(k, _)| k.objectid == EXTENT_CSUM_OBJECTID && k.ty == EXTENT_CSUM_KEY)
                .map(|(k, d)| {
                    (
                        k.offset,
                        k.offset.saturating_add(d.len() as u64 / csize * ss),
                    )
                })
                .collect();
            ranges.sort_unstable();
            let covered = |a: u64, len: u64| {
                let end = a.saturating_add(len);
                let mut cur = a;
                for &(s, e) in &ranges {
                    if s > cur {
                        break;
                    }
                    cur = cur.max(e);
                    if cur >= end {
                        return true;
                    }
                }
                cur >= end
            };
            let mut csum_inode = None;
            for (k, d) in &t.items {
                if k.ty == INODE_ITEM_KEY {
                    csum_inode = InodeItem::parse(d)
                        .ok()
                        .filter(|ii| ii.flags & INODE_NODATASUM == 0)
                        .map(|_| k.objectid);
                    continue;
                }
                if k.ty != EXTENT_DATA_KEY || csum_inode != Some(k.objectid) {
                    continue;
                }
                let Ok(fe) = FileExtentItem::parse(d) else {
                    continue;
                };
                let FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                } = fe.body
                else {
                    continue;
                };
                if fe.ty != FILE_EXTENT_REG || disk_bytenr == 0 {
                    continue;
                }
                let (a, len) = if fe.compression != COMPRESS_NONE {
                    (disk_bytenr, disk_num_bytes)
                } else {
                    (disk_bytenr.saturating_add(offset), num_bytes)
                };
                // Csums of data committed earlier are in the csum tree already.
                let in_csum_tree = || {
                    len <= MAX_DATA_EXTENT
                        && self
                            .fs
                            .data_csums(a, len)
                            .is_ok_and(|v| v.iter().all(|c| c.is_some()))
                };
                if !covered(a, len) && !in_csum_tree() {
                    self.report.err(
                        FindingKind::LogCsumMissing,
                        Location::what(format!("fsync log of tree {}", t.subvol))
                            .with_tree(TREE_LOG_OBJECTID)
                            .with_key(*k),
                        format!(
                            "csum missing in the log: tree {} inode {} file offset {} logs data at logical {a} ({len} bytes) without its csums",
                            t.subvol, k.objectid, k.offset
                        ),
                    );
                }
            }
        }
    }
}

/// For each sector of `[logical, logical + len)` (`logical` on the sector grid), whether
/// `cover` (ranges in order, merged) covers it.
fn covered_sectors(cover: &[(u64, u64)], logical: u64, len: u64, ss: u64) -> Vec<bool> {
    let n = len.div_ceil(ss) as usize;
    let mut out = vec![false; n];
    let end = logical.saturating_add(len);
    // The first range that ends after the start.
    let first = cover.partition_point(|r| r.1 <= logical);
    for &(s, e) in &cover[first..] {
        if s >= end {
            break;
        }
        let from = s.max(logical);
        let to = e.min(end);
        let mut sec = (from - logical) / ss;
        while logical + sec * ss < to {
            if let Some(x) = out.get_mut(sec as usize) {
                *x = true;
            }
            sec += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::covered_sectors;

    /// Sectors a range's csums cover: runs inside, across and beside the range.
    #[test]
    fn covered_sectors_follow_the_ranges() {
        let cover = [(0, 8192), (16384, 20480), (28672, 40960)];
        assert_eq!(
            covered_sectors(&cover, 4096, 32768, 4096),
            vec![true, false, false, true, false, false, true, true]
        );
        assert_eq!(
            covered_sectors(&cover, 8192, 8192, 4096),
            vec![false, false]
        );
        assert_eq!(
            covered_sectors(&cover, 36864, 8192, 4096),
            vec![true, false]
        );
        assert_eq!(covered_sectors(&[], 0, 4096, 4096), vec![false]);
    }
}
