//! `butter check --repair --init-csum-tree`: the checksum tree made again from the data
//! itself. Every range a file extent uses (of files that keep checksums) is read and
//! summed by as many threads as the machine has, the old tree emptied, the new sums
//! inserted, and the result written only when the checker finds no problem the filesystem
//! did not have.

use super::Fs;
use crate::error::{Error, Result};
use crate::format::items::{FileExtentBody, FileExtentItem, InodeItem};
use crate::format::*;
use crate::io::disk_io::{Disk, Readahead};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Data summed per piece (one read, one thread's unit of work).
const PIECE: u64 = 4 << 20;

/// The data ranges that must have checksums, merged and in order: what each regular file
/// extent uses (the whole extent when compressed), for inodes without NODATASUM, in every
/// tree that holds files.
fn summed_ranges(disk: &Arc<Disk>) -> Result<Vec<(u64, u64)>> {
    let tree_root = crate::ctree::Root::of_root_tree(&disk.sb);
    let mut trees = Vec::new();
    for (k, ri) in crate::inspect::root_items(disk, tree_root)? {
        let holds_files = k.objectid == FS_TREE_OBJECTID
            || k.objectid == DATA_RELOC_TREE_OBJECTID
            || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&k.objectid);
        if holds_files {
            let ri = ri?;
            trees.push(crate::ctree::Root {
                id: k.objectid,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            });
        }
    }
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for root in trees {
        let mut it =
            crate::ctree::TreeIter::new(disk.clone(), root, Key::MIN, Readahead::ForwardAlways)?;
        let mut nodatasum = false;
        while let Some(item) = it.next_item()? {
            let k = item.key;
            match k.ty {
                INODE_ITEM_KEY => {
                    let ii = InodeItem::parse(item.data()).map_err(|e| item.annotate(e))?;
                    nodatasum = ii.flags & INODE_NODATASUM != 0;
                }
                EXTENT_DATA_KEY => {
                    let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
                    let FileExtentBody::Extent {
                        disk_bytenr,
                        disk_num_bytes,
                        offset,
                        num_bytes,
                    } = fe.body
                    else {
                        continue;
                    };
                    if disk_bytenr == 0 || fe.ty != FILE_EXTENT_REG {
                        continue;
                    }
                    // Compressed data always has sums, whatever the inode says.
                    if fe.compression != COMPRESS_NONE {
                        ranges.push((disk_bytenr, disk_bytenr + disk_num_bytes));
                    } else if !nodatasum {
                        ranges.push((disk_bytenr + offset, disk_bytenr + offset + num_bytes));
                    }
                }
                _ => {}
            }
        }
    }
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    Ok(merged.into_iter().map(|(s, e)| (s, e - s)).collect())
}

/// Reads and sums `pieces` (start, length) on every CPU; the sums in the pieces' order.
/// `progress` hears the bytes done every so often.
fn sum_pieces(
    disk: &Arc<Disk>,
    pieces: &[(u64, u64)],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Vec<u8>>> {
    let total: u64 = pieces.iter().map(|p| p.1).sum();
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let results: Mutex<Vec<Option<Result<Vec<u8>>>>> =
        Mutex::new((0..pieces.len()).map(|_| None).collect());
    let threads = crate::inode::encoded::cpus().clamp(1, 16);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(at, len)) = pieces.get(i) else {
                    break;
                };
                let r = disk
                    .read_data(at, len as usize, &|_, _| true)
                    .and_then(|d| {
                        d.ok_or_else(|| {
                            Error::Invalid(format!("data at {at} ({len} bytes) cannot be read"))
                        })
                    })
                    .map(|d| crate::inode::ordered::sector_sums(disk, &d));
                done.fetch_add(len, Ordering::Relaxed);
                results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
        let mut last = 0;
        loop {
            let d = done.load(Ordering::Relaxed);
            if d != last || d == total {
                progress(&format!(
                    "checksums: {} of {} MiB read and summed",
                    d >> 20,
                    total >> 20
                ));
                last = d;
            }
            if d >= total {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Internal("a piece was not summed".into()))))
        .collect()
}

impl Fs {
    /// Makes the checksum tree again from the data (`btrfs check --init-csum-tree`) on a
    /// filesystem open read-write with [`super::RwOptions::untouched`]: the sums of every
    /// range a file extent uses (of inodes without NODATASUM; compressed extents whole),
    /// read and summed on every CPU, replace the tree's contents in one transaction, written
    /// only when the checker finds no problem the filesystem did not have. Returns the bytes
    /// summed. A range that cannot be read stops it before anything is written.
    pub fn init_csum_tree(&self, progress: &mut dyn FnMut(&str)) -> Result<u64> {
        let disk = self.core.disk.clone();
        let ss = disk.sectorsize() as u64;
        let ranges = summed_ranges(&disk)?;
        let mut pieces = Vec::new();
        for (s, l) in &ranges {
            if s % ss != 0 || l % ss != 0 {
                return Err(Error::corrupt(
                    crate::error::Location::what(format!("data range {s}+{l}")),
                    "a file extent uses data off the sector grid",
                ));
            }
            let mut at = *s;
            while at < s + l {
                let n = PIECE.min(s + l - at);
                pieces.push((at, n));
                at += n;
            }
        }
        let sums = sum_pieces(&disk, &pieces, progress)?;
        let total: u64 = pieces.iter().map(|p| p.1).sum();
        self.rescue_change("init_csum_tree", |c| {
            c.op(false, |w| {
                crate::check::repair::reset_private_tree(w, CSUM_TREE_OBJECTID)?;
                for ((at, _), sum) in pieces.iter().zip(&sums) {
                    w.insert_csums(*at, sum)?;
                }
                Ok(true)
            })
        })?;
        Ok(total)
    }
}
