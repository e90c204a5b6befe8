//! Reads: inodes, directory entries, xattrs, symlinks and file data (inline, regular,
//! compressed, prealloc, holes), verified against the checksum tree; subvolume listing and
//! path resolution.
//!
//! Subvolumes and snapshots appear as directories: a directory entry whose location key is a
//! ROOT_ITEM leads to the root directory (inode 256) of that subvolume's tree. File reads walk
//! the EXTENT_DATA items: inline (maybe compressed), regular (maybe compressed, maybe referenced
//! at an offset into a larger extent), prealloc (reads as zeros) and holes, with and without
//! NO_HOLES (a range no item covers reads as zeros). Data is verified against the checksum
//! tree; a mismatch on every copy is an `Error::DataChecksum` naming inode, offset and address.

use crate::ctree::{self, ItemRef, TreeIter};
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::Readahead;
use std::collections::HashMap;

use crate::ids::Inode;
use crate::inode::core::Core;

/// The subset of `struct stat` btrfs defines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    pub inode: Inode,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    /// 512-byte units, from the inode's nbytes.
    pub blocks: u64,
    pub blksize: u32,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub otime: Timespec,
    pub flags: u64,
    pub generation: u64,
}

impl Stat {
    pub fn is_dir(&self) -> bool {
        self.mode & 0o170000 == 0o040000
    }
    pub fn is_reg(&self) -> bool {
        self.mode & 0o170000 == 0o100000
    }
    pub fn is_symlink(&self) -> bool {
        self.mode & 0o170000 == 0o120000
    }
}

/// A directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    /// DIR_INDEX sequence number (readdir cookie).
    pub index: u64,
    /// FT_* type.
    pub file_type: u8,
    pub target: Inode,
}

impl DirEntry {
    /// The entry's file type as mode bits (`S_IFREG`, `S_IFDIR`, ... of `st_mode`), from its
    /// FT_* code; 0 for a code the format does not define (the inode itself then says).
    pub fn mode_type(&self) -> u32 {
        crate::format::items::ft_to_mode(self.file_type)
    }
}

/// A subvolume or snapshot.
#[derive(Debug, Clone)]
pub struct SubvolInfo {
    pub id: u64,
    pub parent: u64,
    /// Path from the top-level subvolume (id 5), e.g. "dir/sub": the names as they are.
    pub path: Vec<u8>,
    pub item: RootItem,
}

/// Inode number of the empty directory shown for a nested subvolume that a snapshot's
/// directory names but that is not linked there.
pub const EMPTY_SUBVOL_DIR_OBJECTID: u64 = 2;

/// Maximum bytes of a compressed extent, before and after decompression (btrfs limit).
pub(crate) const MAX_COMPRESSED: u64 = 128 * 1024;

impl Core {
    /// The inode item of `ino`, after the completion of its pending ordered extents
    /// (crate::inode::ordered): its size and times count every write that returned.
    pub(crate) fn inode_item(&self, ino: Inode) -> Result<InodeItem> {
        if self.ordered.has_pending(ino) {
            match self.complete_ordered_extents_of(ino) {
                // Changes stopped: what the trees have is all there is.
                Ok(()) | Err(Error::Aborted(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let mut item = self.inode_item_raw(ino)?;
        // A delayed preallocation (crate::inode::ordered::Preallocs) counts as done: its
        // file is seen as it will be once it is in the trees (size, bytes, times), by every
        // caller, whether or not the completion has run. It cannot run here: this may be a
        // reader beside the lane that made it.
        if let Some((size, added, stamp, mtime)) = self.prealloc.view(ino) {
            let t = stamp.map_or_else(
                crate::format::items::Timespec::now,
                crate::format::items::Timespec::of_instant,
            );
            item.size = size;
            item.nbytes += added;
            item.ctime = t;
            if mtime {
                item.mtime = t;
            }
        }
        Ok(item)
    }

    /// The inode item as the trees have it now (pending ordered extents not counted): for
    /// the holders of the writer lock.
    pub(crate) fn inode_item_raw(&self, ino: Inode) -> Result<InodeItem> {
        if ino.ino == EMPTY_SUBVOL_DIR_OBJECTID {
            return self.placeholder_dir(ino);
        }
        let root = self.subvol_root(ino.root)?;
        let it = ctree::lookup(&self.disk, &root, &Key::new(ino.ino, INODE_ITEM_KEY, 0))?
            .ok_or_else(|| {
                Error::NotFound(format!("inode {} in subvolume {}", ino.ino, ino.root))
            })?;
        InodeItem::parse(it.data()).map_err(|e| it.annotate(e))
    }

    pub(crate) fn stat(&self, ino: Inode) -> Result<Stat> {
        let i = self.inode_item(ino)?;
        Ok(Stat {
            inode: ino,
            mode: i.mode,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            rdev: i.rdev,
            size: i.size,
            // Like the kernel: bytes rounded up to whole sectors, in 512-byte units.
            blocks: i.nbytes.div_ceil(self.disk.sectorsize() as u64)
                * (self.disk.sectorsize() as u64 / 512),
            blksize: self.disk.sectorsize(),
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
            otime: i.otime,
            flags: i.flags,
            generation: i.generation,
        })
    }

    fn entry_from(&self, dir: Inode, d: DirItem, index: u64) -> Result<DirEntry> {
        let target = if d.location.ty == ROOT_ITEM_KEY {
            let id = d.location.objectid;
            if self.subvol_linked_here(dir, id, &d.name)? {
                self.subvol_root_inode(id)?
            } else {
                // A snapshot keeps the entry of a subvolume nested in its source, but the
                // subvolume is not linked there: it shows as an empty directory.
                Inode {
                    root: dir.root,
                    ino: EMPTY_SUBVOL_DIR_OBJECTID,
                }
            }
        } else {
            Inode {
                root: dir.root,
                ino: d.location.objectid,
            }
        };
        Ok(DirEntry {
            name: d.name,
            index,
            file_type: d.file_type,
            target,
        })
    }

    /// Whether subvolume `id` is linked into directory `dir` under `name` (a ROOT_REF from
    /// `dir.root` naming it).
    fn subvol_linked_here(&self, dir: Inode, id: u64, name: &[u8]) -> Result<bool> {
        let key = Key::new(dir.root, ROOT_REF_KEY, id);
        let Some(it) = ctree::lookup(&self.disk, &self.tree_root(), &key)? else {
            return Ok(false);
        };
        let r = RootRef::parse(it.data()).map_err(|e| it.annotate(e))?;
        Ok(r.dirid == dir.ino && r.name == name)
    }

    /// The inode of the empty directory standing in for an unlinked nested subvolume.
    fn placeholder_dir(&self, ino: Inode) -> Result<InodeItem> {
        let parent = self.inode_item(Inode {
            root: ino.root,
            ino: FIRST_FREE_OBJECTID,
        })?;
        Ok(InodeItem {
            mode: 0o040755,
            nlink: 1,
            size: 0,
            nbytes: 0,
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            ..parent
        })
    }

    /// Looks up `name` in directory `dir` through its DIR_ITEM hash. ".." is the directory's
    /// parent, from its back reference (a subvolume's root: the directory it is linked in);
    /// none for the top level's root.
    pub(crate) fn lookup(&self, dir: Inode, name: &[u8]) -> Result<Option<DirEntry>> {
        if name == b".." {
            return Ok(self.parent_dir(dir)?.map(|target| DirEntry {
                name: name.to_vec(),
                index: 0,
                file_type: FT_DIR,
                target,
            }));
        }
        let root = self.subvol_root(dir.root)?;
        let key = Key::new(dir.ino, DIR_ITEM_KEY, hash::name_hash(name));
        let Some(it) = ctree::lookup(&self.disk, &root, &key)? else {
            return Ok(None);
        };
        for d in DirItem::parse_all(it.data()).map_err(|e| it.annotate(e))? {
            if d.name == name {
                return self.entry_from(dir, d, 0).map(Some);
            }
        }
        Ok(None)
    }

    /// Directory entries with DIR_INDEX sequence number > `after`, in index order, at most
    /// `max` of them (0 = no limit).
    /// The index of directory `dir`'s last entry now (0 when it has none): entries added
    /// later get higher ones. A listing that stops there ends, however many entries are
    /// renamed meanwhile (each rename gives its entry a new index), as the kernel's readdir
    /// does since Linux 6.5.
    pub(crate) fn last_dir_index(&self, dir: Inode) -> Result<u64> {
        if dir.ino == EMPTY_SUBVOL_DIR_OBJECTID {
            return Ok(0);
        }
        let root = self.subvol_root(dir.root)?;
        let last = crate::ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(dir.ino, DIR_INDEX_KEY, u64::MAX),
        )?;
        Ok(match last {
            Some(i) if i.key.objectid == dir.ino && i.key.ty == DIR_INDEX_KEY => i.key.offset,
            _ => 0,
        })
    }

    pub(crate) fn readdir(&self, dir: Inode, after: u64, max: usize) -> Result<Vec<DirEntry>> {
        if dir.ino == EMPTY_SUBVOL_DIR_OBJECTID {
            return Ok(Vec::new());
        }
        let root = self.subvol_root(dir.root)?;
        let start = Key::new(dir.ino, DIR_INDEX_KEY, after.saturating_add(1));
        let end = Key::new(dir.ino, DIR_INDEX_KEY, u64::MAX);
        if after == u64::MAX {
            return Ok(Vec::new());
        }
        let mut it = TreeIter::range(self.disk.clone(), root, start, end, Readahead::Forward)?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            let ds = DirItem::parse_all(item.data()).map_err(|e| item.annotate(e))?;
            if ds.len() != 1 {
                return Err(Error::corrupt(
                    item.loc(),
                    format!("DIR_INDEX holds {} entries, expected 1", ds.len()),
                ));
            }
            for d in ds {
                out.push(self.entry_from(dir, d, item.key.offset)?);
            }
            if max != 0 && out.len() >= max {
                break;
            }
        }
        Ok(out)
    }

    /// Every xattr name of an inode.
    pub(crate) fn listxattr(&self, ino: Inode) -> Result<Vec<Vec<u8>>> {
        Ok(self.xattrs(ino)?.into_iter().map(|(n, _)| n).collect())
    }

    /// Every xattr (name, value) of an inode, in key order.
    pub(crate) fn xattrs(&self, ino: Inode) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if ino.ino == EMPTY_SUBVOL_DIR_OBJECTID {
            return Ok(Vec::new());
        }
        let root = self.subvol_root(ino.root)?;
        let mut it = TreeIter::range(
            self.disk.clone(),
            root,
            Key::new(ino.ino, XATTR_ITEM_KEY, 0),
            Key::new(ino.ino, XATTR_ITEM_KEY, u64::MAX),
            Readahead::None,
        )?;
        let mut out = Vec::new();
        while let Some(item) = it.next_item()? {
            for d in DirItem::parse_all(item.data()).map_err(|e| item.annotate(e))? {
                out.push((d.name, d.data));
            }
        }
        Ok(out)
    }

    pub(crate) fn getxattr(&self, ino: Inode, name: &[u8]) -> Result<Option<Vec<u8>>> {
        if ino.ino == EMPTY_SUBVOL_DIR_OBJECTID {
            return Ok(None);
        }
        let root = self.subvol_root(ino.root)?;
        let key = Key::new(ino.ino, XATTR_ITEM_KEY, hash::name_hash(name));
        let Some(it) = ctree::lookup(&self.disk, &root, &key)? else {
            return Ok(None);
        };
        for d in DirItem::parse_all(it.data()).map_err(|e| it.annotate(e))? {
            if d.name == name {
                return Ok(Some(d.data));
            }
        }
        Ok(None)
    }

    pub(crate) fn readlink(&self, ino: Inode) -> Result<Vec<u8>> {
        let st = self.stat(ino)?;
        if !st.is_symlink() {
            return Err(Error::Invalid(format!(
                "inode {} is not a symlink",
                ino.ino
            )));
        }
        if st.size > 4096 {
            return Err(Error::corrupt(
                Location::what(format!(
                    "symlink inode {} in subvolume {}",
                    ino.ino, ino.root
                )),
                format!("target length {} exceeds 4096", st.size),
            ));
        }
        self.read(ino, 0, st.size as usize)
    }

    /// Reads up to `len` bytes at `offset` (short at end of file).
    pub(crate) fn read(&self, ino: Inode, offset: u64, len: usize) -> Result<Vec<u8>> {
        let inode = self.inode_item(ino)?;
        if offset >= inode.size || len == 0 {
            return Ok(Vec::new());
        }
        let end = inode.size.min(offset.saturating_add(len as u64));
        // The size comes from disk: a damaged one must give an error, not abort on allocation.
        let want = usize::try_from(end - offset).unwrap_or(usize::MAX);
        let mut out = Vec::new();
        if out.try_reserve_exact(want).is_err() {
            return Err(Error::corrupt(
                Location::what(format!("inode {}", ino.ino)).with_tree(ino.root),
                format!(
                    "reading {want} bytes at {offset} of a file of size {} cannot be done in \
                     memory: read it in smaller pieces (the size may be damaged; `butter check` \
                     tells)",
                    inode.size
                ),
            ));
        }
        out.resize(want, 0);
        let root = self.subvol_root(ino.root)?;
        // Start from the extent item at or before `offset`.
        let first = ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(ino.ino, EXTENT_DATA_KEY, offset),
        )?;
        let start_key = match first {
            Some(it) if it.key.objectid == ino.ino && it.key.ty == EXTENT_DATA_KEY => it.key,
            _ => Key::new(ino.ino, EXTENT_DATA_KEY, offset),
        };
        let mut it = TreeIter::range(
            self.disk.clone(),
            root,
            start_key,
            Key::new(ino.ino, EXTENT_DATA_KEY, u64::MAX),
            Readahead::Forward,
        )?;
        let nodatasum = inode.flags & INODE_NODATASUM != 0;
        while let Some(item) = it.next_item()? {
            let foff = item.key.offset;
            if foff >= end {
                break;
            }
            self.read_extent(ino, &item, foff, offset, end, &mut out, nodatasum)
                .map_err(|e| item.annotate(e))?;
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn read_extent(
        &self,
        ino: Inode,
        item: &ItemRef,
        foff: u64,
        offset: u64,
        end: u64,
        out: &mut [u8],
        nodatasum: bool,
    ) -> Result<()> {
        let fe = FileExtentItem::parse(item.data())?;
        if fe.encryption != 0 || fe.other_encoding != 0 {
            return Err(Error::Unsupported(format!(
                "encrypted/encoded extent in inode {}",
                ino.ino
            )));
        }
        let ss = self.disk.sectorsize() as u64;
        match &fe.body {
            FileExtentBody::Inline(raw) => {
                let data = if fe.compression == COMPRESS_NONE {
                    raw.clone()
                } else {
                    if fe.ram_bytes > MAX_COMPRESSED {
                        return Err(Error::corrupt(
                            Location::what("inline extent"),
                            format!("ram_bytes {}", fe.ram_bytes),
                        ));
                    }
                    compress::decompress(fe.compression, raw, fe.ram_bytes as usize, ss as u32)?
                };
                copy_overlap(out, offset, end, foff, &data);
            }
            FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset: eoff,
                num_bytes,
            } => {
                let ext_end = foff.saturating_add(*num_bytes);
                if ext_end <= offset || *disk_bytenr == 0 || fe.ty == FILE_EXTENT_PREALLOC {
                    return Ok(()); // before the range, a hole, or prealloc: zeros
                }
                let lo = offset.max(foff);
                let hi = end.min(ext_end);
                // Data extents are whole sectors; this also keeps every sum below in range.
                if disk_bytenr % ss != 0
                    || disk_num_bytes % ss != 0
                    || disk_bytenr.checked_add(*disk_num_bytes).is_none()
                {
                    return Err(Error::corrupt(
                        Location::what("file extent"),
                        format!("data extent [{disk_bytenr}, +{disk_num_bytes}) is not sector aligned or overflows"),
                    ));
                }
                if fe.compression == COMPRESS_NONE {
                    // Read the sectors covering [lo, hi) of the extent, verify, copy.
                    let rel_lo = eoff.checked_add(lo - foff).ok_or_else(|| {
                        Error::corrupt(Location::what("file extent"), "extent offset overflows")
                    })?;
                    let rel_hi = rel_lo
                        .checked_add(hi - lo)
                        .filter(|&h| h <= *disk_num_bytes)
                        .ok_or_else(|| {
                            Error::corrupt(
                                Location::what("file extent"),
                                format!("offset {eoff} + length {num_bytes} beyond disk_num_bytes {disk_num_bytes}"),
                            )
                        })?;
                    let a_lo = rel_lo / ss * ss;
                    let a_hi = rel_hi.div_ceil(ss) * ss;
                    let logical = disk_bytenr + a_lo;
                    // File offset of the first sector read (for a checksum error message).
                    let sector_foff = lo.saturating_sub(rel_lo - a_lo);
                    let buf = self.read_verified(
                        ino,
                        sector_foff,
                        ss,
                        logical,
                        (a_hi - a_lo) as usize,
                        nodatasum,
                    )?;
                    let from = (rel_lo - a_lo) as usize;
                    let dst = (lo - offset) as usize;
                    let n = (hi - lo) as usize;
                    out[dst..dst + n].copy_from_slice(&buf[from..from + n]);
                } else {
                    if *disk_num_bytes > MAX_COMPRESSED || fe.ram_bytes > MAX_COMPRESSED {
                        return Err(Error::corrupt(
                            Location::what("compressed extent"),
                            format!(
                                "disk_num_bytes {disk_num_bytes} ram_bytes {} exceed 128 KiB",
                                fe.ram_bytes
                            ),
                        ));
                    }
                    let raw = self.read_verified(
                        ino,
                        foff,
                        0,
                        *disk_bytenr,
                        *disk_num_bytes as usize,
                        nodatasum,
                    )?;
                    let data = compress::decompress(
                        fe.compression,
                        &raw,
                        fe.ram_bytes as usize,
                        ss as u32,
                    )?;
                    // The file range maps to [eoff, eoff + num_bytes) of the decompressed data.
                    let base = foff as i128 - *eoff as i128;
                    let lo_d = lo as i128 - base;
                    let hi_d = hi as i128 - base;
                    if lo_d < 0 || hi_d > data.len() as i128 {
                        return Err(Error::corrupt(
                            Location::what("compressed extent"),
                            format!(
                                "reference [{lo_d}, {hi_d}) beyond decompressed length {}",
                                data.len()
                            ),
                        ));
                    }
                    let (lo_d, hi_d) = (lo_d as usize, hi_d as usize);
                    let dst = (lo - offset) as usize;
                    out[dst..dst + (hi_d - lo_d)].copy_from_slice(&data[lo_d..hi_d]);
                }
            }
        }
        Ok(())
    }

    /// Reads `len` bytes at `logical` (sector aligned), verifying each sector's checksum when
    /// the csum tree has one; tries every copy. For the error message, sector `i` is at file
    /// offset `file_off + i * file_step` (step 0 for compressed extents: the extent's offset).
    pub(crate) fn read_verified(
        &self,
        ino: Inode,
        file_off: u64,
        file_step: u64,
        logical: u64,
        len: usize,
        nodatasum: bool,
    ) -> Result<Vec<u8>> {
        let ss = self.disk.sectorsize() as usize;
        let csums = if nodatasum {
            Vec::new()
        } else {
            self.data_csums(logical, len as u64)?
        };
        let ct = self.disk.sb.csum_type;
        let csize = ct.size();
        let bad_sector = std::cell::Cell::new(None);
        let verify = |at: usize, buf: &[u8]| -> bool {
            let first = at / ss;
            for (i, c) in csums
                .iter()
                .enumerate()
                .skip(first)
                .take(buf.len().div_ceil(ss))
            {
                if let Some(c) = c {
                    let s = &buf[(i - first) * ss..((i - first + 1) * ss).min(buf.len())];
                    if ct.compute(s)[..csize] != c[..csize] {
                        bad_sector.set(Some(i));
                        return false;
                    }
                }
            }
            true
        };
        match self.disk.read_data(logical, len, &verify)? {
            Some(b) => Ok(b),
            None => {
                let i = bad_sector.get().unwrap_or(0) as u64;
                let e = Error::DataChecksum {
                    root: ino.root,
                    ino: ino.ino,
                    file_offset: file_off.saturating_add(i * file_step),
                    logical: logical + i * ss as u64,
                };
                // Said once, by whoever gets the error (the mount logs what it turns into
                // EIO; a command prints it).
                Err(e)
            }
        }
    }

    /// Per-sector data checksums for `[logical, logical + len)`; `None` where the csum tree has
    /// none.
    pub(crate) fn data_csums(&self, logical: u64, len: u64) -> Result<Vec<Option<[u8; 32]>>> {
        let ss = self.disk.sectorsize() as u64;
        let n = len.div_ceil(ss) as usize;
        let mut out = vec![None; n];
        let Some(root) = self.csum_root() else {
            return Ok(out);
        };
        let csize = self.disk.sb.csum_type.size() as u64;
        let start = ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
        )?;
        let start_key = match start {
            Some(it) if it.key.objectid == EXTENT_CSUM_OBJECTID && it.key.ty == EXTENT_CSUM_KEY => {
                it.key
            }
            _ => Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical),
        };
        let mut it = TreeIter::range(
            self.disk.clone(),
            root,
            start_key,
            Key::new(
                EXTENT_CSUM_OBJECTID,
                EXTENT_CSUM_KEY,
                logical.saturating_add(len.saturating_sub(1)),
            ),
            Readahead::None,
        )?;
        while let Some(item) = it.next_item()? {
            let d = item.data();
            let cstart = item.key.offset;
            let count = d.len() as u64 / csize;
            for k in 0..count {
                // Both from disk: a csum item's key near u64::MAX must not overflow.
                let Some(sec) = cstart.checked_add(k * ss) else {
                    break;
                };
                if sec < logical || sec - logical >= len {
                    continue;
                }
                let idx = ((sec - logical) / ss) as usize;
                let mut c = [0u8; 32];
                c[..csize as usize]
                    .copy_from_slice(&d[(k * csize) as usize..((k + 1) * csize) as usize]);
                out[idx] = Some(c);
            }
        }
        Ok(out)
    }

    /// All subvolumes and snapshots (not the top level), with their paths.
    pub(crate) fn list_subvolumes(&self) -> Result<Vec<SubvolInfo>> {
        let mut it = TreeIter::new(
            self.disk.clone(),
            self.tree_root(),
            Key::new(FIRST_FREE_OBJECTID, 0, 0),
            Readahead::None,
        )?;
        let mut items = Vec::new();
        let mut backrefs: HashMap<u64, (u64, RootRef)> = HashMap::new();
        while let Some(item) = it.next_item()? {
            if item.key.objectid > LAST_FREE_OBJECTID {
                break;
            }
            match item.key.ty {
                ROOT_ITEM_KEY => items.push((
                    item.key.objectid,
                    RootItem::parse(item.data()).map_err(|e| item.annotate(e))?,
                )),
                ROOT_BACKREF_KEY => {
                    let r = RootRef::parse(item.data()).map_err(|e| item.annotate(e))?;
                    backrefs.insert(item.key.objectid, (item.key.offset, r));
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        for (id, ri) in items {
            let Some((parent, rr)) = backrefs.get(&id) else {
                continue;
            }; // deleted, not yet cleaned
            let mut path = Vec::new();
            // Walk up through parents, bounded by the number of subvolumes.
            let mut chain = vec![(*parent, rr.clone())];
            let mut cur = *parent;
            for _ in 0..backrefs.len() {
                if cur == FS_TREE_OBJECTID {
                    break;
                }
                match backrefs.get(&cur) {
                    Some((p, r)) => {
                        chain.push((*p, r.clone()));
                        cur = *p;
                    }
                    None => break,
                }
            }
            for (p, r) in chain.iter().rev() {
                let dir = self
                    .inode_path_bytes(Inode {
                        root: *p,
                        ino: r.dirid,
                    })
                    .unwrap_or_default();
                if !dir.is_empty() {
                    path.extend_from_slice(&dir);
                    path.push(b'/');
                }
                path.extend_from_slice(&r.name);
                path.push(b'/');
            }
            path.pop();
            out.push(SubvolInfo {
                id,
                parent: *parent,
                path,
                item: ri,
            });
        }
        Ok(out)
    }

    /// The directory holding directory `dir`: the INODE_REF's parent, or for a subvolume's
    /// root the directory its ROOT_BACKREF names. `None` where there is none (the top
    /// level's root, the stand-in for an unlinked nested subvolume, a damaged directory).
    fn parent_dir(&self, dir: Inode) -> Result<Option<Inode>> {
        if dir.ino == FIRST_FREE_OBJECTID {
            let mut it = TreeIter::range(
                self.disk.clone(),
                self.tree_root(),
                Key::new(dir.root, ROOT_BACKREF_KEY, 0),
                Key::new(dir.root, ROOT_BACKREF_KEY, u64::MAX),
                Readahead::None,
            )?;
            let Some(item) = it.next_item()? else {
                return Ok(None);
            };
            let r = RootRef::parse(item.data()).map_err(|e| item.annotate(e))?;
            return Ok(Some(Inode {
                root: item.key.offset,
                ino: r.dirid,
            }));
        }
        let root = self.subvol_root(dir.root)?;
        let mut it = TreeIter::range(
            self.disk.clone(),
            root,
            Key::new(dir.ino, INODE_REF_KEY, 0),
            Key::new(dir.ino, INODE_REF_KEY, u64::MAX),
            Readahead::None,
        )?;
        Ok(it.next_item()?.map(|item| Inode {
            root: dir.root,
            ino: item.key.offset,
        }))
    }

    /// Path of an inode relative to its subvolume's root (first name found), e.g. "a/b".
    pub(crate) fn inode_path(&self, ino: Inode) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.inode_path_bytes(ino)?).into_owned())
    }

    /// [`Core::inode_path`] with the names as they are (bytes).
    pub(crate) fn inode_path_bytes(&self, ino: Inode) -> Result<Vec<u8>> {
        let root = self.subvol_root(ino.root)?;
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut cur = ino.ino;
        for _ in 0..4096 {
            if cur == FIRST_FREE_OBJECTID {
                parts.reverse();
                return Ok(parts.join(&b'/'));
            }
            let mut it = TreeIter::range(
                self.disk.clone(),
                root,
                Key::new(cur, INODE_REF_KEY, 0),
                Key::new(cur, INODE_EXTREF_KEY, u64::MAX),
                Readahead::None,
            )?;
            let Some(item) = it.next_item()? else {
                return Err(Error::NotFound(format!(
                    "no name for inode {cur} in subvolume {}",
                    ino.root
                )));
            };
            if item.key.ty == INODE_REF_KEY {
                let r = InodeRef::parse_all(item.data()).map_err(|e| item.annotate(e))?;
                let first = r
                    .first()
                    .ok_or_else(|| Error::corrupt(item.loc(), "empty inode ref"))?;
                parts.push(first.name.clone());
                cur = item.key.offset;
            } else {
                let r = InodeExtref::parse_all(item.data()).map_err(|e| item.annotate(e))?;
                let first = r
                    .first()
                    .ok_or_else(|| Error::corrupt(item.loc(), "empty inode extref"))?;
                parts.push(first.name.clone());
                cur = first.parent;
            }
        }
        Err(Error::corrupt(
            Location::what(format!("inode {} in subvolume {}", ino.ino, ino.root)),
            "directory parent chain too deep (loop?)",
        ))
    }

    /// Resolves a slash-separated path from the default subvolume's root, following
    /// subvolume boundaries but not symlinks (the crate's tests; others use `resolve_in`).
    #[cfg(test)]
    pub(crate) fn resolve(&self, path: &str) -> Result<Inode> {
        self.resolve_in(self.root_inode(), path.as_bytes())
    }

    /// Resolves a slash-separated path (names as bytes) from directory `start`, following
    /// subvolume boundaries but not symlinks. `NotFound` and `NotDir` carry the whole path.
    pub(crate) fn resolve_in(&self, start: Inode, path: &[u8]) -> Result<Inode> {
        let shown = || String::from_utf8_lossy(path).into_owned();
        let mut cur = start;
        for comp in path
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty() && *c != b".")
        {
            if !self.stat(cur)?.is_dir() {
                return Err(Error::NotDir(shown()));
            }
            cur = self
                .lookup(cur, comp)?
                .ok_or_else(|| Error::NotFound(shown()))?
                .target;
        }
        Ok(cur)
    }
}

/// Copies the part of `data` (file bytes starting at `data_off`) that overlaps `[lo, hi)` into
/// `out` (file bytes starting at `lo`).
fn copy_overlap(out: &mut [u8], lo: u64, hi: u64, data_off: u64, data: &[u8]) {
    let d_end = data_off.saturating_add(data.len() as u64);
    let s = lo.max(data_off);
    let e = hi.min(d_end);
    if s >= e {
        return;
    }
    let n = (e - s) as usize;
    let dst = (s - lo) as usize;
    let src = (s - data_off) as usize;
    out[dst..dst + n].copy_from_slice(&data[src..src + n]);
}
