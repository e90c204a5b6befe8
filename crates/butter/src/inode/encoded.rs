//! Encoded writes: a compressed extent stored as it comes, without decompressing and
//! compressing it again (what the kernel's ENCODED_WRITE ioctl does for `btrfs receive` of a
//! stream sent with `--compressed-data`).
//!
//! The kernel's rules: the compressed bytes must be fewer than the decoded ones; the write
//! starts on a sector, and ends on one unless it reaches the end of the file; the file's
//! part starts on a sector of the decoded extent. A whole small file at offset 0 becomes an
//! inline compressed extent (decoded length in `ram_bytes`). Otherwise the bytes go into a
//! new data extent of their own length (rounded up to a sector, the rest zero), whose
//! checksums cover the compressed bytes; its item says the decoded extent's length rounded
//! up to a sector (`ram_bytes`), which part of it the file uses (`offset`, `num_bytes`) and
//! how it is compressed. The bytes are not trusted: they are decoded once to check that they
//! decode, and nothing is written when they do not.

use crate::error::{Error, Result};
use crate::format::compress::{decompress, pack, pieces_of, Compression, Packed};
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;

/// Where a compressed extent goes: `span` bytes of the file from `offset`, taken from
/// `decoded_offset` of the decoded extent of `ram_bytes`, compressed with `code`.
pub(crate) struct Placed {
    pub(crate) offset: u64,
    pub(crate) span: u64,
    pub(crate) ram_bytes: u64,
    pub(crate) decoded_offset: u64,
    pub(crate) code: u8,
}

/// The most file data one compressed extent holds (the kernel's limit too).
const MAX_DECODED: u64 = crate::inode::read::MAX_COMPRESSED;

/// One compressed extent for [`Core::write_encoded`], as a send stream's ENCODED_WRITE
/// carries it.
pub(crate) struct EncodedExtent<'a> {
    /// The compressed bytes.
    pub data: &'a [u8],
    /// Bytes of the file the extent covers from the write's offset.
    pub file_len: u64,
    /// Length of the decoded extent.
    pub decoded_len: u64,
    /// Where in the decoded extent the file's bytes start.
    pub decoded_offset: u64,
    /// On-disk compression code: 1 zlib, 2 lzo, 3 zstd.
    pub compression: u8,
}

impl Core {
    /// Stores `e` at `offset` of `ino` as a compressed extent. [`Error::Unsupported`] when it
    /// cannot be stored as it is (where the kernel's encoded write refuses it too: no smaller
    /// than decoded, unaligned; and here also a file without checksums or with inline data, a
    /// filesystem without NO_HOLES): the caller writes the decoded bytes instead.
    /// [`Error::Invalid`] when the extent itself is wrong (lengths out of range, bytes that do
    /// not decode).
    pub(crate) fn write_encoded(
        &self,
        ino: Inode,
        offset: u64,
        e: &EncodedExtent<'_>,
    ) -> Result<()> {
        self.require_rw_subvol(ino.root)?;
        let ss = self.disk.sectorsize() as u64;
        if !(1..=3).contains(&e.compression) {
            return Err(Error::Invalid(format!(
                "encoded write with compression code {}",
                e.compression
            )));
        }
        if e.data.is_empty()
            || e.data.len() as u64 > MAX_DECODED
            || e.decoded_len == 0
            || e.decoded_len > MAX_DECODED
            || e.file_len == 0
            || e.decoded_offset
                .checked_add(e.file_len)
                .is_none_or(|end| end > e.decoded_len)
        {
            return Err(Error::Invalid(format!(
                "encoded write of {} bytes decoding to {} (file bytes {} from {}): lengths out \
                 of range",
                e.data.len(),
                e.decoded_len,
                e.file_len,
                e.decoded_offset
            )));
        }
        if !offset.is_multiple_of(ss) || !e.decoded_offset.is_multiple_of(ss) {
            return Err(Error::Unsupported(format!(
                "an encoded write at {offset} (from {} of the decoded extent), not on sectors",
                e.decoded_offset
            )));
        }
        if e.data.len() as u64 >= e.decoded_len {
            return Err(Error::Unsupported(
                "an encoded extent no smaller than its decoded bytes".into(),
            ));
        }
        let span = e.file_len.div_ceil(ss) * ss;
        if offset.checked_add(span).is_none_or(|x| x > i64::MAX as u64) {
            return Err(Error::Invalid(
                "encoded write past the largest file size".into(),
            ));
        }
        if !self.disk.sb.has_incompat(INCOMPAT_NO_HOLES) {
            return Err(Error::Unsupported(
                "encoded writes on a filesystem without the no-holes feature".into(),
            ));
        }
        let ram_bytes = e.decoded_len.div_ceil(ss) * ss;
        // The bytes must decode: a compressed extent that does not would fail every read.
        decompress(e.compression, e.data, ram_bytes as usize, ss as u32)
            .map_err(|err| Error::Invalid(format!("encoded write: {err}")))?;
        self.flush_delalloc_unlocked(ino)?;
        let item = self.inode_item(ino)?;
        if item.mode & 0o170000 != 0o100000 {
            return Err(Error::Invalid(format!(
                "encoded write to inode {} that is not a regular file",
                ino.ino
            )));
        }
        crate::inode::flags::require_changeable(&item, ino)?;
        if item.flags & (INODE_NODATASUM | INODE_NODATACOW) != 0 {
            return Err(Error::Unsupported(
                "a compressed extent in a file without checksums".into(),
            ));
        }
        if !e.file_len.is_multiple_of(ss) && offset + e.file_len < item.size {
            return Err(Error::Unsupported(
                "an encoded extent ending inside a sector short of the end of the file".into(),
            ));
        }
        if self
            .file_extents(ino, 0, 1)?
            .first()
            .is_some_and(|x| matches!(x.item.body, FileExtentBody::Inline(_)))
        {
            return Err(Error::Unsupported(
                "an encoded extent in a file with inline data".into(),
            ));
        }
        let _range = self.ordered.lock(ino, offset, offset + span);
        let inline = offset == 0
            && e.decoded_offset == 0
            && e.file_len == e.decoded_len
            && e.file_len < ss
            && item.size <= e.file_len
            && e.data.len() <= self.max_inline;
        if inline {
            return self.op(true, |w| {
                let mut item = self.inode_item_raw(ino)?;
                let fe = FileExtentItem {
                    generation: w.transid,
                    ram_bytes: e.file_len,
                    compression: e.compression,
                    encryption: 0,
                    other_encoding: 0,
                    ty: FILE_EXTENT_INLINE,
                    body: FileExtentBody::Inline(e.data.to_vec()),
                };
                let (removed, _) = self.replace_extents(w, ino, 0, span, None)?;
                w.insert_item(
                    ino.root,
                    Key::new(ino.ino, EXTENT_DATA_KEY, 0),
                    &fe.to_bytes(),
                )?;
                item.nbytes = item.nbytes - removed.min(item.nbytes) + e.file_len;
                self.finish_encoded(
                    w,
                    ino,
                    &mut item,
                    e.file_len,
                    e.compression,
                    Timespec::now(),
                )
            });
        }
        let disk_len = (e.data.len() as u64).div_ceil(ss) * ss;
        let mut buf = e.data.to_vec();
        buf.resize(disk_len as usize, 0);
        self.op(true, |w| {
            let mut item = self.inode_item_raw(ino)?;
            let placed = Placed {
                offset,
                span,
                ram_bytes,
                decoded_offset: e.decoded_offset,
                code: e.compression,
            };
            self.put_compressed(w, ino, &mut item, &placed, &buf)?;
            let end = offset + e.file_len;
            if end > item.size {
                w.log.note_change(ino, item.size, end);
                item.size = end;
            }
            self.finish_encoded(
                w,
                ino,
                &mut item,
                e.file_len,
                e.compression,
                Timespec::now(),
            )
        })
    }

    /// Puts the compressed bytes `disk` (padded to whole sectors) into a new data extent with
    /// its checksums, and a file extent item for `p` over whatever the range held; counts
    /// the change in `item.nbytes`.
    pub(crate) fn put_compressed(
        &self,
        w: &mut crate::transaction::Writer,
        ino: Inode,
        item: &mut InodeItem,
        p: &Placed,
        disk: &[u8],
    ) -> Result<()> {
        let disk_len = disk.len() as u64;
        let bytenr = w.alloc_data_or_commit(disk_len)?;
        if let Err(err) = self.disk.write_logical(bytenr, disk) {
            // Nothing references the space: it comes back after the commit.
            w.allocator.pin(bytenr, disk_len)?;
            return Err(err);
        }
        Self::put_sums(w, bytenr, disk_len, &self.sector_sums(disk))?;
        let fe = FileExtentItem {
            generation: w.transid,
            ram_bytes: p.ram_bytes,
            compression: p.code,
            encryption: 0,
            other_encoding: 0,
            ty: FILE_EXTENT_REG,
            body: FileExtentBody::Extent {
                disk_bytenr: bytenr,
                disk_num_bytes: disk_len,
                offset: p.decoded_offset,
                num_bytes: p.span,
            },
        };
        self.record_new_extent(w, ino, item, p.offset, fe)
    }

    /// The compression a write to `ino` (whose inode is `item`) uses, as the kernel decides:
    /// none for files without checksums; with `compress-force` always, else unless the file
    /// is marked NOCOMPRESS and when the mount compresses or the file has the compress flag
    /// (which the `btrfs.compression` property sets). The algorithm: the property's, else
    /// the mount's, else zlib.
    pub(crate) fn compression_for(
        &self,
        ino: Inode,
        item: &InodeItem,
    ) -> Result<Option<Compression>> {
        if item.flags & (INODE_NODATASUM | INODE_NODATACOW) != 0 {
            return Ok(None);
        }
        if !self.compress_force && item.flags & INODE_NOCOMPRESS != 0 {
            return Ok(None);
        }
        // Every write asks: without a mount option or the compress flag (which setting the
        // property sets, here and in the kernel) there is nothing to look up.
        if self.compress.is_none() && item.flags & INODE_COMPRESS == 0 {
            return Ok(None);
        }
        let prop = match self.getxattr(ino, crate::inode::flags::COMPRESSION_PROP)? {
            Some(v) => Compression::parse(&String::from_utf8_lossy(&v))
                .ok()
                .flatten(),
            None => None,
        };
        Ok(Some(prop.or(self.compress).unwrap_or(Compression::ZLIB)))
    }

    /// Writes sector-aligned `buf` at file offset `a` of `ino` compressed with `c`, in
    /// extents of at most 128 KiB of file data each: a piece whose compressed bytes take
    /// fewer sectors is stored compressed, the others plain (and an incompressible start of
    /// the file marks it NOCOMPRESS, unless compression is forced). The file grows to at
    /// least `size_to`. `ahead`: the pieces compressed already ([`crate::format::compress::Precompressed`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_compressed(
        &self,
        ino: Inode,
        a: u64,
        buf: &[u8],
        size_to: u64,
        c: Compression,
        guard: &crate::inode::ordered::RangeGuard<'_>,
        ahead: Option<&[Option<Vec<u8>>]>,
    ) -> Result<()> {
        let ss = self.disk.sectorsize() as u64;
        let total = buf.len() as u64;
        let pieces = pieces_of(total);
        if let Some(packed) = ahead.filter(|p| p.len() == pieces.len()) {
            let place = (a, total, size_to);
            return self.store_pieces(ino, buf, place, c, (&pieces, packed), guard);
        }
        // Compressed a batch at a time on as many threads as there are CPUs, the next batch
        // while this thread stores the last one (under the writer lock, piece by piece). A
        // data write through a front end waits for the compression out of the gate
        // (crate::gate), as for its data I/O: other files are read and changed meanwhile.
        let threads = cpus();
        let batches: Vec<&[(u64, u64)]> = pieces.chunks(threads * 4).collect();
        std::thread::scope(|s| -> Result<()> {
            // A lone batch (most writes) is compressed here, without a thread to start.
            let single = batches.len() == 1;
            let start = |batch: &[(u64, u64)]| {
                let batch = batch.to_vec();
                (
                    batch.len(),
                    s.spawn(move || compress_all(c, buf, &batch, ss, threads)),
                )
            };
            let mut next = batches.first().filter(|_| !single).map(|b| start(b));
            for (i, batch) in batches.iter().enumerate() {
                let packed = if single {
                    self.outside_gate(|| Ok(compress_all(c, buf, batch, ss, threads)))?
                } else {
                    // A compressing thread that failed leaves its pieces plain.
                    let Some((n, handle)) = next.take() else {
                        break;
                    };
                    self.outside_gate(|| Ok(handle.join().unwrap_or_else(|_| vec![None; n])))?
                };
                next = batches.get(i + 1).filter(|_| !single).map(|b| start(b));
                let place = (a, total, size_to);
                self.store_pieces(ino, buf, place, c, (batch, &packed), guard)?;
            }
            Ok(())
        })
    }

    /// Stores `pieces` of a compressed write of `buf` (`total` bytes at file offset `a`, the
    /// file growing to `size_to`) with their compressed bytes `packed`: a piece without them
    /// plain (marking an incompressible start NOCOMPRESS unless compression is forced).
    fn store_pieces(
        &self,
        ino: Inode,
        buf: &[u8],
        (a, total, size_to): (u64, u64, u64),
        c: Compression,
        (pieces, packed): (&[(u64, u64)], &[Packed]),
        guard: &crate::inode::ordered::RangeGuard<'_>,
    ) -> Result<()> {
        for ((done, len), packed) in runs(pieces, packed) {
            let chunk = &buf[done as usize..(done + len) as usize];
            let (file_off, reach) = piece_place(a, done, len, total, size_to);
            let Some(z) = packed else {
                if file_off == 0 && !self.compress_force {
                    self.mark_nocompress(ino)?;
                }
                self.write_extents_plain(ino, file_off, chunk, reach, guard)?;
                continue;
            };
            let piece = (file_off, len, reach);
            self.op(true, |w| {
                self.put_piece(w, ino, piece, z, c, Timespec::now())
            })?;
        }
        Ok(())
    }

    /// Writes back `ino`'s delayed-allocation buffer `d` compressed with `c`, as the kernel
    /// compresses at writeback: in pieces of at most 128 KiB, compressed on every CPU at
    /// once, a piece that saves a sector stored compressed and the others plain (an
    /// incompressible start of the file marks it NOCOMPRESS unless compression is forced),
    /// each extent with the time of the appends. Under the writer lock, in a completion of
    /// every pending extent (a commit for space may run).
    pub(crate) fn write_back_compressed(
        &self,
        w: &mut crate::transaction::Writer,
        ino: Inode,
        d: &crate::inode::ordered::Delalloc,
        c: Compression,
    ) -> Result<()> {
        let ss = self.disk.sectorsize() as u64;
        let mut buf = d.data.clone();
        buf.resize((buf.len() as u64).div_ceil(ss) as usize * ss as usize, 0);
        let total = buf.len() as u64;
        let size_to = d.start + d.data.len() as u64;
        let pieces = pieces_of(total);
        let packed = compress_all(c, &buf, &pieces, ss, cpus());
        for ((done, len), packed) in runs(&pieces, &packed) {
            let (file_off, reach) = piece_place(d.start, done, len, total, size_to);
            let Some(z) = packed else {
                if file_off == 0 && !self.compress_force {
                    self.set_nocompress(w, ino)?;
                }
                let chunk = &buf[done as usize..(done + len) as usize];
                let bytenr = w.alloc_data_or_commit(len)?;
                if let Err(e) = self.disk.write_logical(bytenr, chunk) {
                    // Nothing references the space: it comes back after the commit.
                    w.allocator.pin(bytenr, len)?;
                    return Err(e);
                }
                let sums = self.sector_sums(chunk);
                let range = (file_off, len, reach);
                self.finish_ordered(w, ino, range, bytenr, &sums, false, Some(d.stamp))?;
                continue;
            };
            self.put_piece(w, ino, (file_off, len, reach), z, c, d.stamp)?;
        }
        Ok(())
    }

    /// One compressed piece of a write: `z` (padded to whole sectors) as the extent of
    /// `(file offset, length, reach)`, the file growing to `reach`, stamped `stamp`.
    fn put_piece(
        &self,
        w: &mut crate::transaction::Writer,
        ino: Inode,
        (file_off, len, reach): (u64, u64, u64),
        z: &[u8],
        c: Compression,
        stamp: Timespec,
    ) -> Result<()> {
        let mut item = self.inode_item_raw(ino)?;
        let placed = Placed {
            offset: file_off,
            span: len,
            ram_bytes: len,
            decoded_offset: 0,
            code: c.code(),
        };
        self.put_compressed(w, ino, &mut item, &placed, z)?;
        if reach > item.size {
            w.log.note_change(ino, item.size, reach);
            item.size = reach;
        }
        self.finish_encoded(w, ino, &mut item, 0, c.code(), stamp)
    }

    /// The compression `ino`'s buffered appends get at their write-back, if any.
    pub(crate) fn buffer_compression(&self, ino: Inode) -> Result<Option<Compression>> {
        self.compression_for(ino, &self.inode_item_raw(ino)?)
    }

    /// Sets NOCOMPRESS on `ino`, as the kernel does when a file's start does not compress.
    fn mark_nocompress(&self, ino: Inode) -> Result<()> {
        self.op(false, |w| self.set_nocompress(w, ino))
    }

    /// [`Core::mark_nocompress`] in the running operation.
    fn set_nocompress(&self, w: &mut crate::transaction::Writer, ino: Inode) -> Result<()> {
        let mut item = self.inode_item_raw(ino)?;
        if item.flags & INODE_NOCOMPRESS == 0 {
            item.flags |= INODE_NOCOMPRESS;
            self.write_inode(w, ino, &item)?;
        }
        Ok(())
    }

    /// The inode and superblock side of a compressed extent put in: the size (at least
    /// `size_from_0`, for an extent at offset 0), the times, the compression feature bit,
    /// and a commit for the next fsync (the log does not carry compressed extents); `stamp`: the
    /// time of the write.
    fn finish_encoded(
        &self,
        w: &mut crate::transaction::Writer,
        ino: Inode,
        item: &mut InodeItem,
        size_from_0: u64,
        code: u8,
        stamp: Timespec,
    ) -> Result<()> {
        if size_from_0 > item.size {
            w.log.note_change(ino, item.size, size_from_0);
            item.size = size_from_0;
        }
        w.log.note_needs_commit(ino);
        w.sb.incompat_flags |= match code {
            COMPRESS_LZO => INCOMPAT_COMPRESS_LZO,
            COMPRESS_ZSTD => INCOMPAT_COMPRESS_ZSTD,
            _ => 0,
        };
        Self::touch_at(w, item, true, stamp);
        self.write_inode(w, ino, item)
    }
}

/// Where piece `(done, len)` of a write of `total` bytes at file offset `start` goes, and how
/// long the file is once it is in (the write's end `size_to` for the last piece).
fn piece_place(start: u64, done: u64, len: u64, total: u64, size_to: u64) -> (u64, u64) {
    let file_off = start + done;
    let reach = if done + len == total {
        size_to
    } else {
        (file_off + len).min(size_to)
    };
    (file_off, reach)
}

/// The pieces `(offset, len)` of `buf` compressed with `c`, padded to whole sectors; `None`
/// for a piece that does not take fewer sectors compressed. Spread over `threads` threads
/// when there is more than one piece.
fn compress_all(
    c: Compression,
    buf: &[u8],
    pieces: &[(u64, u64)],
    ss: u64,
    threads: usize,
) -> Vec<Option<Vec<u8>>> {
    let one = |&(d, len): &(u64, u64)| pack(c, &buf[d as usize..(d + len) as usize], ss);
    if threads <= 1 || pieces.len() <= 1 {
        return pieces.iter().map(one).collect();
    }
    let per = pieces.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = pieces
            .chunks(per)
            .map(|part| {
                (
                    part.len(),
                    s.spawn(move || part.iter().map(one).collect::<Vec<_>>()),
                )
            })
            .collect();
        // A thread that failed leaves its pieces plain: one answer per piece, always.
        handles
            .into_iter()
            .flat_map(|(n, h)| h.join().unwrap_or_else(|_| vec![None; n]))
            .collect()
    })
}

/// `(offset in the write, length)` of one extent of a compressed write, with its compressed
/// bytes (`None`: plain).
type Run<'a> = ((u64, u64), Option<&'a [u8]>);

/// The pieces of a compressed write as they go in: each compressed one alone (with its
/// bytes), consecutive ones that stay plain as one extent (as mkfs.btrfs stores them).
fn runs<'a>(pieces: &[(u64, u64)], packed: &'a [Packed]) -> Vec<Run<'a>> {
    let mut out: Vec<Run<'a>> = Vec::new();
    for (&(done, len), z) in pieces.iter().zip(packed) {
        match (z, out.last_mut()) {
            (None, Some(((d, l), None))) if *d + *l == done => *l += len,
            _ => out.push(((done, len), z.as_deref())),
        }
    }
    out
}

/// The CPUs this process may run on (asked once: the answer reads cgroup files).
pub(crate) fn cpus() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
