//! Reflink: a range of one file cloned into another file (or elsewhere in the same one),
//! sharing its data extents instead of copying the bytes, within one subvolume or across the
//! subvolumes of a filesystem, as the kernel's clone does:
//! - the destination gets file extent items that point into the same data extents, each with
//!   a data back reference of its own (the extents' reference counts go up);
//! - checksums stay where they are (they are keyed by disk address);
//! - compressed and preallocated extents are shared as they are; holes stay holes;
//! - inline extents have no extent to share: a range that holds one is copied instead.
//!
//! The clone is not logged for fsync: an fsync of the destination commits.

use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::transaction::extent_refs::RefKey;

impl Core {
    /// Clones `len` bytes of `src` from `src_off` into `dst` at `dst_off`, sharing the data
    /// extents; returns the bytes cloned (fewer when `src` ends first, 0 past its end).
    /// Offsets must be multiples of the sector size, and `len` too unless the range ends at
    /// `src`'s end. Overlapping ranges of one file are [`Error::Invalid`]; a filesystem
    /// without NO_HOLES is [`Error::Unsupported`] (callers copy instead).
    pub(crate) fn clone_range(
        &self,
        src: Inode,
        src_off: u64,
        dst: Inode,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        self.require_rw_subvol(dst.root)?;
        if !self.disk.sb.has_incompat(INCOMPAT_NO_HOLES) {
            return Err(Error::Unsupported(
                "reflink on a filesystem without the no-holes feature".into(),
            ));
        }
        let ss = self.disk.sectorsize() as u64;
        self.settle_prealloc(src)?;
        self.settle_prealloc(dst)?;
        let src_item = self.inode_item(src)?;
        let dst_item = self.inode_item(dst)?;
        for (ino, item) in [(src, &src_item), (dst, &dst_item)] {
            if item.mode & 0o170000 != 0o100000 {
                return Err(Error::Invalid(format!(
                    "clone of inode {} (subvolume {}), which is not a regular file",
                    ino.ino, ino.root
                )));
            }
        }
        crate::inode::flags::require_changeable(&dst_item, dst)?;
        if src_off >= src_item.size || len == 0 {
            return Ok(0);
        }
        let len = len.min(src_item.size - src_off);
        let to_eof = src_off + len == src_item.size;
        if !src_off.is_multiple_of(ss)
            || !dst_off.is_multiple_of(ss)
            || (!len.is_multiple_of(ss) && !to_eof)
        {
            return Err(Error::Invalid(format!(
                "clone of {len} bytes from {src_off} to {dst_off}: offsets and length must be \
                 multiples of {ss} bytes (the length may end at the end of the source)"
            )));
        }
        if !len.is_multiple_of(ss) && dst_off + len < dst_item.size {
            return Err(Error::Invalid(format!(
                "clone of the source's partial last sector into the middle of the destination \
                 (at {dst_off}, which holds {} bytes)",
                dst_item.size
            )));
        }
        // Whole sectors: a clone to the source's end takes its last sector whole.
        let span = len.div_ceil(ss) * ss;
        if dst_off
            .checked_add(span)
            .is_none_or(|e| e > i64::MAX as u64)
        {
            return Err(Error::Invalid("clone past the largest file size".into()));
        }
        if src == dst && src_off < dst_off + span && dst_off < src_off + span {
            return Err(Error::Invalid(
                "clone of a range onto itself (the ranges overlap)".into(),
            ));
        }
        let pieces = self.file_extents(src, src_off, src_off + span)?;
        if pieces
            .iter()
            .any(|x| matches!(x.item.body, FileExtentBody::Inline(_)))
        {
            return self.copy_range(src, src_off, dst, dst_off, len);
        }
        self.op(true, |w| {
            let mut item = self.inode_item_raw(dst)?;
            // Clear the destination range first, then lay the source's extents over it.
            let (mut removed, mut added) =
                self.replace_extents(w, dst, dst_off, dst_off + span, None)?;
            for x in &pieces {
                let FileExtentBody::Extent {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    ..
                } = x.item.body
                else {
                    continue;
                };
                let s = x.start.max(src_off);
                let e = x.end(ss).min(src_off + span);
                if e <= s || disk_bytenr == 0 {
                    continue; // a hole stays a hole (NO_HOLES: no item)
                }
                let at = dst_off + (s - src_off);
                let clone_offset = offset + (s - x.start);
                let fe = FileExtentItem {
                    generation: w.transid,
                    body: FileExtentBody::Extent {
                        disk_bytenr,
                        disk_num_bytes,
                        offset: clone_offset,
                        num_bytes: e - s,
                    },
                    ..x.item.clone()
                };
                let (r, a) = self.replace_extents(w, dst, at, at + (e - s), Some((at, fe)))?;
                removed += r;
                added += a;
                w.refs.add_data_ref(
                    disk_bytenr,
                    disk_num_bytes,
                    false,
                    RefKey::Data {
                        root: dst.root,
                        ino: dst.ino,
                        offset: at.wrapping_sub(clone_offset),
                    },
                    1,
                );
            }
            item.nbytes = item.nbytes - removed.min(item.nbytes) + added;
            let end = dst_off + len;
            if end > item.size {
                w.log.note_change(dst, item.size, end);
                item.size = end;
            }
            w.log.note_needs_commit(dst);
            Self::touch_at(w, &mut item, true, Timespec::now());
            self.write_inode(w, dst, &item)
        })?;
        Ok(len)
    }

    /// copy_file_range(2): `len` bytes of `src` from `src_off` into `dst` at `dst_off`,
    /// cloned where the clone takes them (sector-aligned offsets, see [`Core::clone_range`]),
    /// as kernel btrfs does, and copied otherwise. Returns the bytes done (fewer at the end
    /// of `src`).
    pub(crate) fn copy_file_range(
        &self,
        src: Inode,
        src_off: u64,
        dst: Inode,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        let ss = self.disk.sectorsize() as u64;
        if src_off.is_multiple_of(ss) && dst_off.is_multiple_of(ss) {
            match self.clone_range(src, src_off, dst, dst_off, len) {
                Err(Error::Unsupported(_) | Error::Invalid(_)) => {}
                r => return r,
            }
        }
        self.copy_range(src, src_off, dst, dst_off, len)
    }

    /// The bytes of `src`'s range written into `dst` (what a clone does where there is no
    /// extent to share).
    fn copy_range(
        &self,
        src: Inode,
        src_off: u64,
        dst: Inode,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        let mut done = 0;
        while done < len {
            let step = (len - done).min(1 << 20) as usize;
            let data = self.read(src, src_off + done, step)?;
            if data.is_empty() {
                break;
            }
            self.write(dst, dst_off + done, &data)?;
            done += data.len() as u64;
        }
        Ok(done)
    }
}
