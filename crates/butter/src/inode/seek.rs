//! lseek(2) SEEK_DATA / SEEK_HOLE from a file's extent items.
//!
//! What counts as data is what the kernel's btrfs reports without delayed allocation: inline
//! extents and regular extents that point at a data extent. Holes are ranges without an
//! extent item (NO_HOLES), regular extents with `disk_bytenr == 0`, and preallocated extents
//! (their bytes read as zeros). The end of the file is a hole: SEEK_HOLE finds the size when
//! nothing before it is a hole. Offsets at or past the size have neither (ENXIO).

use crate::error::Result;
use crate::format::items::{FileExtentBody, FileExtentItem};
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;

/// Where a file's bytes are, from its extent items ([`Core::file_ranges`]): anything in
/// neither list is a hole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileRanges {
    /// Ranges `[lo, hi)` that hold data (inline or regular extents with a data extent),
    /// ascending, clipped to the size asked for.
    pub data: Vec<(u64, u64)>,
    /// Preallocated ranges `[lo, hi)` (they read as zeros).
    pub prealloc: Vec<(u64, u64)>,
}

/// Which lseek `whence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seek {
    Data,
    Hole,
}

impl Core {
    /// The data and preallocated ranges of file `ino` below `size`, for a reader that copies
    /// only what holds data (restore): data ranges closer than `merge_gap` bytes are merged,
    /// since reading a small hole costs less than another read call. Extents are read
    /// forward with readahead.
    pub(crate) fn file_ranges(&self, ino: Inode, size: u64, merge_gap: u64) -> Result<FileRanges> {
        let root = self.subvol_root(ino.root)?;
        let mut it = crate::ctree::TreeIter::range(
            self.disk.clone(),
            root,
            Key::new(ino.ino, EXTENT_DATA_KEY, 0),
            Key::new(ino.ino, EXTENT_DATA_KEY, u64::MAX),
            crate::io::disk_io::Readahead::Forward,
        )?;
        let mut r = FileRanges::default();
        while let Some(item) = it.next_item()? {
            let start = item.key.offset;
            let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            let len = match &fe.body {
                FileExtentBody::Inline(raw) => fe.ram_bytes.max(raw.len() as u64),
                FileExtentBody::Extent {
                    disk_bytenr,
                    num_bytes,
                    ..
                } => {
                    if *disk_bytenr == 0 {
                        continue;
                    }
                    if fe.ty == FILE_EXTENT_PREALLOC {
                        let end = start.saturating_add(*num_bytes);
                        if end > start {
                            r.prealloc.push((start, end));
                        }
                        continue;
                    }
                    *num_bytes
                }
            };
            let end = start.saturating_add(len).min(size);
            if end <= start {
                continue;
            }
            match r.data.last_mut() {
                Some(last) if start <= last.1.saturating_add(merge_gap) => {
                    last.1 = last.1.max(end);
                }
                _ => r.data.push((start, end)),
            }
        }
        Ok(r)
    }

    /// SEEK_DATA / SEEK_HOLE from `offset`. `None` when there is no such offset (the
    /// caller's ENXIO): `offset` is at or past the end of the file, or SEEK_DATA finds only
    /// holes up to the end.
    pub(crate) fn seek_data_hole(
        &self,
        ino: Inode,
        offset: u64,
        what: Seek,
    ) -> Result<Option<u64>> {
        let size = self.inode_item(ino)?.size;
        if offset >= size {
            return Ok(None);
        }
        let mut it = self.extent_items_from(ino, offset)?;
        // `pos`: the first byte not yet known to be data (for SEEK_HOLE).
        let mut pos = offset;
        while let Some(i) = it.next_item()? {
            if i.key.objectid != ino.ino || i.key.ty != EXTENT_DATA_KEY || i.key.offset >= size {
                break;
            }
            let fe = FileExtentItem::parse(i.data()).map_err(|e| i.annotate(e))?;
            let Some((start, end)) = data_range(i.key.offset, &fe) else {
                continue;
            };
            let end = end.min(size);
            if end <= offset {
                continue;
            }
            match what {
                Seek::Data => return Ok(Some(start.max(offset))),
                Seek::Hole => {
                    if start > pos {
                        return Ok(Some(pos));
                    }
                    pos = pos.max(end);
                    if pos >= size {
                        return Ok(Some(size));
                    }
                }
            }
        }
        Ok(match what {
            Seek::Data => None,
            Seek::Hole => Some(pos.min(size)),
        })
    }
}

/// The byte range `[start, end)` of the file an extent item holds data for, `None` for a hole
/// or a preallocated extent.
fn data_range(key_offset: u64, fe: &FileExtentItem) -> Option<(u64, u64)> {
    match &fe.body {
        FileExtentBody::Inline(_) => Some((key_offset, key_offset.saturating_add(fe.ram_bytes))),
        FileExtentBody::Extent {
            disk_bytenr,
            num_bytes,
            ..
        } => {
            if *disk_bytenr == 0 || fe.ty == FILE_EXTENT_PREALLOC || *num_bytes == 0 {
                None
            } else {
                Some((key_offset, key_offset.saturating_add(*num_bytes)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::Fs;
    use crate::inode::file::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
    use crate::inode::namespace::Owner;

    fn new_fs() -> Fs {
        crate::mkfs::test_fs(128 << 20).1
    }

    const K: u64 = 1024;
    const S: u64 = 4096;

    #[test]
    fn data_and_holes() {
        let fs = new_fs();
        let root = fs.root_inode();
        let f = fs.create(root, b"f", 0o644, Owner::default()).unwrap();
        // [0, 8K) data, [8K, 64K) hole (implicit or a hole extent), [64K, 72K) data,
        // then a hole to the size of 100K.
        fs.write(f, 0, &[1u8; 8192]).unwrap();
        fs.write(f, 64 * K, &[2u8; 8192]).unwrap();
        fs.truncate(f, 100 * K).unwrap();
        let d = |o| fs.seek_data_hole(f, o, Seek::Data).unwrap();
        let h = |o| fs.seek_data_hole(f, o, Seek::Hole).unwrap();
        assert_eq!(d(0), Some(0));
        assert_eq!(d(100), Some(100));
        assert_eq!(d(8 * K), Some(64 * K));
        assert_eq!(d(70 * K), Some(70 * K));
        assert_eq!(d(72 * K), None);
        assert_eq!(d(100 * K), None);
        assert_eq!(h(0), Some(8 * K));
        assert_eq!(h(9 * K), Some(9 * K));
        assert_eq!(h(64 * K), Some(72 * K));
        assert_eq!(h(99 * K), Some(99 * K));
        assert_eq!(h(100 * K), None);
        // Survives a commit (the same answers from the committed trees).
        fs.commit().unwrap();
        assert_eq!(d(8 * K), Some(64 * K));
        assert_eq!(h(0), Some(8 * K));
    }

    #[test]
    fn full_file_hole_is_at_the_end_and_prealloc_is_a_hole() {
        let fs = new_fs();
        let root = fs.root_inode();
        let f = fs.create(root, b"full", 0o644, Owner::default()).unwrap();
        fs.write(f, 0, &[3u8; 3 * 4096]).unwrap();
        assert_eq!(fs.seek_data_hole(f, 0, Seek::Hole).unwrap(), Some(3 * S));
        assert_eq!(fs.seek_data_hole(f, S, Seek::Data).unwrap(), Some(S));
        // Punch the middle sector.
        fs.fallocate(f, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, S, S)
            .unwrap();
        assert_eq!(fs.seek_data_hole(f, 0, Seek::Hole).unwrap(), Some(S));
        assert_eq!(fs.seek_data_hole(f, S, Seek::Data).unwrap(), Some(2 * S));
        // A preallocated file is all hole.
        let p = fs.create(root, b"pre", 0o644, Owner::default()).unwrap();
        fs.fallocate(p, 0, 0, 16 * S).unwrap();
        assert_eq!(fs.stat(p).unwrap().size, 16 * S);
        assert_eq!(fs.seek_data_hole(p, 0, Seek::Data).unwrap(), None);
        assert_eq!(fs.seek_data_hole(p, 0, Seek::Hole).unwrap(), Some(0));
        // Small (inline) file: data up to the size.
        let s = fs.create(root, b"small", 0o644, Owner::default()).unwrap();
        fs.write(s, 0, b"hello").unwrap();
        assert_eq!(fs.seek_data_hole(s, 0, Seek::Data).unwrap(), Some(0));
        assert_eq!(fs.seek_data_hole(s, 2, Seek::Hole).unwrap(), Some(5));
        // Empty file: nothing.
        let e = fs.create(root, b"empty", 0o644, Owner::default()).unwrap();
        assert_eq!(fs.seek_data_hole(e, 0, Seek::Data).unwrap(), None);
        assert_eq!(fs.seek_data_hole(e, 0, Seek::Hole).unwrap(), None);
    }
}

/// One file extent item of a file, as space accounting (compsize) sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtentUse {
    /// Compression code: 0 none, 1 zlib, 2 lzo, 3 zstd.
    pub compression: u8,
    /// Inline (its bytes in the item), preallocated, or a regular extent.
    pub inline: bool,
    pub prealloc: bool,
    /// The data extent's address (0 for inline), to count shared extents once.
    pub disk_bytenr: u64,
    /// Bytes on disk: the extent's (or the inline item's data).
    pub disk_bytes: u64,
    /// Bytes the extent holds decoded.
    pub ram_bytes: u64,
    /// Bytes of the file this item covers.
    pub referenced: u64,
}

impl Core {
    /// The file extent items of `ino` with their sizes (holes left out), for space
    /// accounting: what on disk, what decoded, what the file refers to.
    pub(crate) fn extent_usage(&self, ino: Inode) -> Result<Vec<ExtentUse>> {
        let mut it = self.extent_items_from(ino, 0)?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            if item.key.objectid != ino.ino || item.key.ty != EXTENT_DATA_KEY {
                break;
            }
            let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            match fe.body {
                FileExtentBody::Inline(raw) => out.push(ExtentUse {
                    compression: fe.compression,
                    inline: true,
                    prealloc: false,
                    disk_bytenr: 0,
                    disk_bytes: raw.len() as u64,
                    ram_bytes: fe.ram_bytes,
                    referenced: fe.ram_bytes,
                }),
                FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    num_bytes,
                    ..
                } => {
                    if disk_bytenr == 0 {
                        continue;
                    }
                    out.push(ExtentUse {
                        compression: fe.compression,
                        inline: false,
                        prealloc: fe.ty == FILE_EXTENT_PREALLOC,
                        disk_bytenr,
                        disk_bytes: disk_num_bytes,
                        ram_bytes: fe.ram_bytes,
                        referenced: num_bytes,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// One file extent item of a file with whether its data is shared, as the kernel's FIEMAP
/// reports it (FIEMAP_EXTENT_SHARED) and `btrfs filesystem du` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtentShare {
    /// Where in the file the item starts.
    pub file_offset: u64,
    /// Bytes of the file the item covers (for an inline item: its decoded length).
    pub length: u64,
    /// The data extent's address (0 for inline) and where in it the item starts.
    pub disk_bytenr: u64,
    pub extent_offset: u64,
    /// Compression code: 0 none, 1 zlib, 2 lzo, 3 zstd.
    pub compression: u8,
    pub inline: bool,
    pub prealloc: bool,
    /// Another file, another subvolume, or another place in this file refers to the data
    /// extent, or the leaf holding the item is shared with a snapshot (always false inline).
    pub shared: bool,
}

impl Core {
    /// The file extent items of `ino` (holes left out) with whether each one's data is
    /// shared, as of the last commit, by the kernel's rule (btrfs_is_data_extent_shared):
    ///
    /// - the data extent has a reference other than this file's own one (another inode,
    ///   another subvolume, or this file at another `file offset - extent offset`, as a
    ///   reflink inside the file makes): shared. One reference counted twice (a partly
    ///   overwritten extent whose two ends this file still uses) is not;
    /// - otherwise, if the item is older than the subvolume's last snapshot, a tree block on
    ///   the path from the subvolume's root to the item's leaf that has more than one
    ///   reference (a snapshot shares it) makes it shared.
    ///
    /// A data extent with no extent item is damage and an error.
    pub(crate) fn extent_sharing(&self, ino: Inode) -> Result<Vec<ExtentShare>> {
        use crate::space::delayed_refs::RefKey;
        use std::collections::HashMap;
        let extent_root = self.subvol_root(EXTENT_TREE_OBJECTID)?;
        let last_snapshot = self.subvol_item(ino.root)?.last_snapshot;
        // Per data extent: whether its references alone make it shared; per tree block:
        // whether it has more than one reference.
        let mut direct: HashMap<u64, bool> = HashMap::new();
        let mut blocks: HashMap<u64, bool> = HashMap::new();
        let mut it = self.extent_items_from(ino, 0)?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            if item.key.objectid != ino.ino || item.key.ty != EXTENT_DATA_KEY {
                break;
            }
            let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            let (disk_bytenr, extent_offset, length) = match fe.body {
                FileExtentBody::Inline(_) => {
                    out.push(ExtentShare {
                        file_offset: item.key.offset,
                        length: fe.ram_bytes,
                        disk_bytenr: 0,
                        extent_offset: 0,
                        compression: fe.compression,
                        inline: true,
                        prealloc: false,
                        shared: false,
                    });
                    continue;
                }
                FileExtentBody::Extent { disk_bytenr: 0, .. } => continue,
                FileExtentBody::Extent {
                    disk_bytenr,
                    offset,
                    num_bytes,
                    ..
                } => (disk_bytenr, offset, num_bytes),
            };
            let by_refs = match direct.get(&disk_bytenr) {
                Some(s) => *s,
                None => {
                    let rec = crate::ctree::extent_record::read_extent_record(
                        &self.disk,
                        extent_root,
                        disk_bytenr,
                    )?
                    .ok_or_else(|| {
                        crate::error::Error::corrupt(
                            item.loc(),
                            format!(
                                "file extent points at {disk_bytenr}, which has no extent item"
                            ),
                        )
                    })?;
                    let mine = |k: &RefKey| match *k {
                        RefKey::Data { root, ino: i, .. } => root == ino.root && i == ino.ino,
                        // A full back reference from a leaf: the kernel looks at the leaf's
                        // own references, as below for this item's path.
                        RefKey::SharedData(_) => true,
                        _ => false,
                    };
                    let s = rec.refs.len() > 1 || !rec.refs.keys().all(mine);
                    direct.insert(disk_bytenr, s);
                    s
                }
            };
            let shared = by_refs
                || (fe.generation <= last_snapshot
                    && self.path_shared(&it, extent_root, &mut blocks)?);
            out.push(ExtentShare {
                file_offset: item.key.offset,
                length,
                disk_bytenr,
                extent_offset,
                compression: fe.compression,
                inline: false,
                prealloc: fe.ty == FILE_EXTENT_PREALLOC,
                shared,
            });
        }
        Ok(out)
    }

    /// Whether a block on the path to the iterator's current leaf has more than one
    /// reference (`cache`: answers per block).
    fn path_shared(
        &self,
        it: &crate::ctree::TreeIter,
        extent_root: crate::ctree::Root,
        cache: &mut std::collections::HashMap<u64, bool>,
    ) -> Result<bool> {
        let Some(path) = it.path() else {
            return Ok(false);
        };
        for (block, _) in &path.nodes {
            let shared = match cache.get(&block.bytenr) {
                Some(s) => *s,
                None => {
                    let rec = crate::ctree::extent_record::read_extent_record(
                        &self.disk,
                        extent_root,
                        block.bytenr,
                    )?
                    .ok_or_else(|| {
                        crate::error::Error::corrupt(
                            block.loc(None),
                            "tree block has no extent item",
                        )
                    })?;
                    let s = rec.refs.values().fold(0u64, |a, b| a.saturating_add(*b)) > 1;
                    cache.insert(block.bytenr, s);
                    s
                }
            };
            if shared {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
