//! Scrub, offline: every copy of every extent the extent tree lists, on every device, read
//! and verified (tree blocks by their checksum and header, data by the checksum tree), and,
//! for RAID5/6, every parity block recomputed; what is bad is rewritten from a good copy or
//! from parity unless the scrub is read-only. Each device's superblock copies are checked
//! too (the next commit rewrites a bad one, as the kernel's does). Also `devices`, what
//! `filesystem show` prints.

use super::core::Core;
use crate::ctree::{Root, TreeIter};
use crate::error::Result;
use crate::format::superblock::{DevItem, Superblock};
use crate::format::*;
use crate::io::disk_io::{check_tree_block, Expect, Readahead, ScrubCounts};
use std::collections::BTreeMap;

/// One device of a filesystem, as its chunk tree's item describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub devid: u64,
    /// The device's size as the filesystem uses it.
    pub size: u64,
    /// Bytes allocated to chunks on it.
    pub used: u64,
    /// How it was given (a path), or `None` when it is missing.
    pub path: Option<String>,
    pub uuid: [u8; 16],
}

/// What a scrub found, per device, and how much it read.
#[derive(Debug, Clone, Default)]
pub struct ScrubReport {
    pub devices: Vec<(DeviceInfo, ScrubCounts, u64)>,
    pub data_extents: u64,
    pub tree_extents: u64,
    /// The scrub rewrote what it could (false: read-only).
    pub repaired: bool,
}

impl ScrubReport {
    /// Every device's counts added up.
    pub fn total(&self) -> ScrubCounts {
        let mut t = ScrubCounts::default();
        for (_, c, _) in &self.devices {
            t.bytes += c.bytes;
            t.parity_bytes += c.parity_bytes;
            t.read_errors += c.read_errors;
            t.csum_errors += c.csum_errors;
            t.parity_errors += c.parity_errors;
            t.corrected += c.corrected;
            t.correctable += c.correctable;
            t.uncorrectable += c.uncorrectable;
        }
        t
    }
}

impl Core {
    /// The devices of the filesystem (the chunk tree's DEV_ITEMs), with the path each was
    /// opened from.
    pub(crate) fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let sb = &self.disk.sb;
        // As the running transaction has it: devices come and go while open.
        let root = self.live_root(CHUNK_TREE_OBJECTID).unwrap_or(Root {
            id: CHUNK_TREE_OBJECTID,
            bytenr: sb.chunk_root,
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation,
        });
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0),
            Readahead::None,
        )?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            if item.key.objectid != DEV_ITEMS_OBJECTID || item.key.ty != DEV_ITEM_KEY {
                break;
            }
            let d = DevItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            let m = self.disk.devices.member(d.devid);
            out.push(DeviceInfo {
                devid: d.devid,
                size: d.total_bytes,
                used: d.bytes_used,
                path: m.filter(|m| m.dev.is_some()).map(|m| m.name.clone()),
                uuid: d.uuid,
            });
        }
        Ok(out)
    }

    /// Scrubs the whole filesystem (see the module's description); `repair`: rewrite what
    /// is bad from good copies. `progress` hears about every 256 MiB read.
    pub(crate) fn scrub(
        &self,
        repair: bool,
        progress: &mut dyn FnMut(&str),
    ) -> Result<ScrubReport> {
        let sb = self.disk.sb.clone();
        let mut stats: BTreeMap<u64, ScrubCounts> = BTreeMap::new();
        let mut super_errors: BTreeMap<u64, u64> = BTreeMap::new();
        for m in self.disk.devices.members() {
            let Some(dev) = &m.dev else { continue };
            for i in 0..SUPER_MIRROR_MAX {
                let off = super_offset(i);
                if off + SUPER_INFO_SIZE as u64 > dev.len().min(sb.total_bytes.max(off + 1)) {
                    break;
                }
                let mut buf = vec![0u8; SUPER_INFO_SIZE];
                let ok = dev.read_at(&mut buf, off).is_ok()
                    && Superblock::parse(&buf, off).is_ok_and(|s| s.fsid == sb.fsid);
                if !ok {
                    *super_errors.entry(m.devid).or_default() += 1;
                }
            }
        }
        let Some(extent_root) = self.find_root_item(EXTENT_TREE_OBJECTID)? else {
            return Err(crate::error::Error::corrupt(
                crate::error::Location::what("root tree"),
                "no extent tree",
            ));
        };
        let root = Root {
            id: EXTENT_TREE_OBJECTID,
            bytenr: extent_root.bytenr,
            level: extent_root.level,
            generation: extent_root.generation,
        };
        let mut it = TreeIter::new(self.disk.clone(), root, Key::MIN, Readahead::Forward)?;
        let ns = sb.nodesize;
        let ss = sb.sectorsize as usize;
        let ct = sb.csum_type;
        let fsid = sb.metadata_fsid();
        let mut report = ScrubReport {
            repaired: repair,
            ..Default::default()
        };
        let mut rows = Vec::new();
        let mut read = 0u64;
        let mut next_note = 256u64 << 20;
        while let Some(item) = it.next_item()? {
            let k = item.key;
            let d = item.data();
            let gen = (d.len() >= 16).then(|| le_u64(d, 8)).filter(|&g| g != 0);
            let (len, tree) = match k.ty {
                METADATA_ITEM_KEY => (ns as u64, true),
                EXTENT_ITEM_KEY => {
                    let flags = if d.len() >= 24 { le_u64(d, 16) } else { 0 };
                    (k.offset, flags & EXTENT_FLAG_TREE_BLOCK != 0)
                }
                _ => continue,
            };
            if len == 0 {
                continue;
            }
            let r = if tree {
                report.tree_extents += 1;
                // The header's generation must be the extent item's: a stale copy (a device
                // that was away while the block was rewritten) fails here.
                let expect = Expect {
                    generation: gen,
                    ..Expect::default()
                };
                let bad = |_: usize, b: &[u8]| {
                    u64::from(check_tree_block(b, k.objectid, ns, ct, &fsid, &expect).is_err())
                };
                self.disk
                    .scrub_range(k.objectid, len, &bad, repair, &mut stats)
            } else {
                report.data_extents += 1;
                let csums = self.data_csums(k.objectid, len)?;
                let bad = |at: usize, b: &[u8]| {
                    b.chunks(ss)
                        .enumerate()
                        .filter(|(i, s)| {
                            csums
                                .get(at / ss + i)
                                .copied()
                                .flatten()
                                .is_some_and(|c| !ct.verify(s, &c[..ct.size()]))
                        })
                        .count() as u64
                };
                self.disk
                    .scrub_range(k.objectid, len, &bad, repair, &mut stats)
            };
            match r {
                Ok(mut r) => rows.append(&mut r),
                Err(e) => log::warn!("scrub: extent {} length {len}: {e}", k.objectid),
            }
            read += len;
            if read >= next_note {
                progress(&format!("scrubbed {} MiB", read >> 20));
                next_note += 256 << 20;
            }
        }
        self.disk.scrub_parity(&rows, repair, &mut stats)?;
        if repair {
            self.disk
                .flush_all()
                .map_err(|e| crate::error::Error::io("flushing what the scrub repaired", 0, e))?;
        }
        for d in self.devices()? {
            let c = stats.get(&d.devid).copied().unwrap_or_default();
            let se = super_errors.get(&d.devid).copied().unwrap_or(0);
            report.devices.push((d, c, se));
        }
        Ok(report)
    }
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}
