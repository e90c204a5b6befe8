//! `butter rescue fix-data-checksum`: every data sector the checksum tree covers, read from
//! each of its copies and compared with its checksum; the sectors that do not match are
//! reported with the files that use them, and on request their checksums are made those of
//! the data one copy holds (for data that is right and sums that are not, as a program that
//! changed a direct I/O buffer in flight leaves them). The change is one transaction,
//! written only when the checker finds no new problem.

use super::Fs;
use crate::error::{Error, Location, Result};
use crate::format::items::{FileExtentBody, FileExtentItem};
use crate::format::*;
use crate::io::disk_io::Readahead;
use std::collections::BTreeMap;

/// Sectors read at once from one copy.
const RUN_SECTORS: u64 = 256;

/// One data sector whose checksum some copy does not match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSector {
    /// Its logical address.
    pub logical: u64,
    /// How many copies it has (mirrors 1..=copies).
    pub copies: u32,
    /// The mirrors (1-based) that do not match or cannot be read.
    pub bad_mirrors: Vec<u32>,
    /// The files that use it: (subvolume, path in it), or the inode number where it has no
    /// name.
    pub files: Vec<(u64, String)>,
}

impl Fs {
    /// Reads every copy of every sector the checksum tree covers (see the module's
    /// description) and returns those that do not match, in address order. `progress`
    /// hears about every 64 MiB read.
    pub fn data_checksum_mismatches(
        &self,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Vec<BadSector>> {
        self.reading(None, |c| {
            let disk = c.disk.clone();
            let ss = disk.sectorsize() as u64;
            let ct = disk.sb.csum_type;
            let cs = ct.size() as u64;
            let Some(root) = c.csum_root() else {
                return Ok(Vec::new());
            };
            let mut it = crate::ctree::TreeIter::new(
                disk.clone(),
                root,
                Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 0),
                Readahead::ForwardAlways,
            )?;
            // logical -> (copies, bad mirrors)
            let mut bad: BTreeMap<u64, (u32, Vec<u32>)> = BTreeMap::new();
            let mut read = 0u64;
            let mut told = 0u64;
            while let Some(item) = it.next_item()? {
                let k = item.key;
                if k.objectid != EXTENT_CSUM_OBJECTID || k.ty != EXTENT_CSUM_KEY {
                    continue;
                }
                let sums = item.data();
                let n = sums.len() as u64 / cs;
                let mut i = 0u64;
                while i < n {
                    let at = k.offset.checked_add(i * ss).ok_or_else(|| {
                        item.annotate(Error::Invalid("checksums past the address space".into()))
                    })?;
                    // One run: inside one chunk and one place on each copy.
                    let map = disk.chunk_map();
                    let chunk = map.lookup(at).ok_or_else(|| {
                        Error::corrupt(
                            Location::what(format!("data at logical {at}")),
                            "no chunk maps the data a checksum item covers",
                        )
                    })?;
                    let chunk_left = (chunk.logical + chunk.item.length - at) / ss;
                    let want = (n - i).min(RUN_SECTORS).min(chunk_left.max(1));
                    let segs = map.segments(at, want * ss)?;
                    drop(map);
                    let seg = segs.first().ok_or_else(|| {
                        Error::corrupt(
                            Location::what(format!("data at logical {at}")),
                            "the chunk maps no piece of it",
                        )
                    })?;
                    let cnt = seg.len / ss;
                    let copies = seg.copies.len() as u32;
                    for (m, copy) in seg.copies.iter().enumerate() {
                        let mut buf = vec![0u8; seg.len as usize];
                        let ok = disk.read_copy(*copy, &mut buf);
                        for j in 0..cnt {
                            let s = &sums[((i + j) * cs) as usize..((i + j + 1) * cs) as usize];
                            let data = &buf[(j * ss) as usize..((j + 1) * ss) as usize];
                            if !ok || !ct.verify(data, s) {
                                let e = bad.entry(at + j * ss).or_insert((copies, Vec::new()));
                                e.1.push(m as u32 + 1);
                            }
                        }
                    }
                    i += cnt.max(1);
                    read += cnt * ss;
                    if read - told >= 64 << 20 {
                        told = read;
                        progress(&format!("data: {} MiB read", read >> 20));
                    }
                }
            }
            let mut users = users_of(c, &bad.keys().copied().collect::<Vec<_>>())?;
            Ok(bad
                .into_iter()
                .map(|(logical, (copies, bad_mirrors))| BadSector {
                    logical,
                    copies,
                    bad_mirrors,
                    files: users.remove(&logical).unwrap_or_default(),
                })
                .collect())
        })
    }

    /// Makes the checksum of each sector in `sectors` (logical address, mirror 1-based) that
    /// of the data that copy holds, in one transaction written only when the checker finds
    /// no new problem. Returns whether anything changed.
    pub fn update_data_checksums(&self, sectors: &[(u64, u32)]) -> Result<bool> {
        if sectors.is_empty() {
            return Ok(false);
        }
        let disk = self.core.disk.clone();
        let ss = disk.sectorsize() as u64;
        let mut sums = Vec::new();
        for &(logical, mirror) in sectors {
            let segs = disk.chunk_map().segments(logical, ss)?;
            let copy = segs
                .first()
                .and_then(|s| s.copies.get((mirror as usize).wrapping_sub(1)))
                .copied()
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "the data at logical {logical} has no mirror {mirror}"
                    ))
                })?;
            let mut buf = vec![0u8; ss as usize];
            if !disk.read_copy(copy, &mut buf) {
                return Err(Error::Invalid(format!(
                    "mirror {mirror} of the data at logical {logical} cannot be read"
                )));
            }
            sums.push((logical, crate::inode::ordered::sector_sums(&disk, &buf)));
        }
        self.rescue_change("update_data_checksums", |c| {
            c.op(false, |w| {
                for (logical, sum) in &sums {
                    w.delete_csums(*logical, ss)?;
                    w.insert_csums(*logical, sum)?;
                }
                Ok(true)
            })
        })
    }
}

/// The files whose extents cover each address of `at` (sorted): (subvolume, path).
fn users_of(c: &crate::inode::core::Core, at: &[u64]) -> Result<BTreeMap<u64, Vec<(u64, String)>>> {
    let mut out: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
    if at.is_empty() {
        return Ok(out);
    }
    for (k, _) in crate::inspect::root_items(&c.disk, c.tree_root())? {
        let holds_files = k.objectid == FS_TREE_OBJECTID
            || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&k.objectid);
        if !holds_files {
            continue;
        }
        let Ok(root) = c.subvol_root(k.objectid) else {
            continue;
        };
        let mut it =
            crate::ctree::TreeIter::new(c.disk.clone(), root, Key::MIN, Readahead::ForwardAlways)?;
        while let Some(item) = it.next_item()? {
            if item.key.ty != EXTENT_DATA_KEY {
                continue;
            }
            let Ok(fe) = FileExtentItem::parse(item.data()) else {
                continue;
            };
            let FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                ..
            } = fe.body
            else {
                continue;
            };
            if disk_bytenr == 0 {
                continue;
            }
            let end = disk_bytenr.saturating_add(disk_num_bytes);
            let first = at.partition_point(|&a| a < disk_bytenr);
            for &a in at[first..].iter().take_while(|&&a| a < end) {
                let ino = crate::ids::Inode {
                    root: k.objectid,
                    ino: item.key.objectid,
                };
                let name = c
                    .inode_path(ino)
                    .unwrap_or_else(|_| format!("<inode {}>", item.key.objectid));
                let v = out.entry(a).or_default();
                if !v.iter().any(|(r, n)| *r == k.objectid && *n == name) {
                    v.push((k.objectid, name));
                }
            }
        }
    }
    Ok(out)
}
