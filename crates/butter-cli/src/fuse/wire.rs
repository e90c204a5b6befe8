//! The FUSE protocol as the io_uring transport (crate::fuse::ring) carries it: requests
//! decoded from their three parts (the 40-byte `fuse_in_header`, the first argument, which
//! the kernel puts in the entry's `op_in` area, and the remaining arguments, back to back in
//! the payload buffer) and served by the adapter's operations (crate::fuse::ops), the
//! replies encoded as their out arguments back to back. fuser does the same for the
//! `/dev/fuse` loops; it offers no way to parse bytes that did not come from its own reads,
//! so the ring has this decoder of its own.
//!
//! Layouts are the kernel's uapi (`include/uapi/linux/fuse.h`, protocol 7.45 on Linux
//! 6.18), little-endian, all fields naturally aligned. Nothing in a request is trusted: a
//! short or malformed one is answered with EINVAL (EIO for a reply that would not fit),
//! never a panic.

use super::ops::{EntryOut, XattrOut};
use super::Adapter;
use crate::setid::Caller;
use butter::format::items::Timespec;
use butter::fs::NewKind;
use butter::inode::namespace::SetAttr;
use fuser::{Errno, FileAttr, FileType};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Size of `struct fuse_in_header`.
pub(crate) const IN_HEADER: usize = 40;

// Opcodes (enum fuse_opcode).
const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const SETATTR: u32 = 4;
const READLINK: u32 = 5;
const SYMLINK: u32 = 6;
const MKNOD: u32 = 8;
const MKDIR: u32 = 9;
const UNLINK: u32 = 10;
const RMDIR: u32 = 11;
const RENAME: u32 = 12;
const LINK: u32 = 13;
const OPEN: u32 = 14;
const READ: u32 = 15;
const WRITE: u32 = 16;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FSYNC: u32 = 20;
const SETXATTR: u32 = 21;
const GETXATTR: u32 = 22;
const LISTXATTR: u32 = 23;
const REMOVEXATTR: u32 = 24;
const FLUSH: u32 = 25;
const OPENDIR: u32 = 27;
const READDIR: u32 = 28;
const RELEASEDIR: u32 = 29;
const FSYNCDIR: u32 = 30;
const ACCESS: u32 = 34;
const CREATE: u32 = 35;
const IOCTL: u32 = 39;
const BATCH_FORGET: u32 = 42;
const FALLOCATE: u32 = 43;
const READDIRPLUS: u32 = 44;
const RENAME2: u32 = 45;
const LSEEK: u32 = 46;
const COPY_FILE_RANGE: u32 = 47;

// fuse_setattr_in.valid bits.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;
const FATTR_CTIME: u32 = 1 << 10;

/// fuse_write_in.write_flags: a page written back from a shared mapping.
const FUSE_WRITE_CACHE: u32 = 1 << 0;
/// fuse_fsync_in.fsync_flags: fdatasync.
const FUSE_FSYNC_FDATASYNC: u32 = 1 << 0;

/// `struct fuse_in_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

impl InHeader {
    pub(crate) fn parse(b: &[u8]) -> Option<InHeader> {
        Some(InHeader {
            len: u32_at(b, 0)?,
            opcode: u32_at(b, 4)?,
            unique: u64_at(b, 8)?,
            nodeid: u64_at(b, 16)?,
            uid: u32_at(b, 24)?,
            gid: u32_at(b, 28)?,
            pid: u32_at(b, 32)?,
        })
    }
}

/// A request's arguments after the header: the first (`first`, from `op_in`) and the rest
/// (`rest`, from the payload). Fixed-size parts are read from `first` while it lasts, names
/// and data from `rest`; when `first` is empty (a request whose first argument is a name, as
/// before Linux 6.14), everything comes from `rest`.
pub(crate) struct Args<'a> {
    first: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Args<'a> {
    pub(crate) fn new(first: &'a [u8], rest: &'a [u8]) -> Self {
        Args { first, rest }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let src = if self.first.is_empty() {
            &mut self.rest
        } else {
            &mut self.first
        };
        if src.len() < n {
            return None;
        }
        let (a, b) = src.split_at(n);
        *src = b;
        Some(a)
    }

    /// The fixed-size first argument, `n` bytes (at least).
    fn fixed(&mut self, n: usize) -> Option<&'a [u8]> {
        let whole = if self.first.is_empty() {
            self.take(n)?
        } else {
            let f = std::mem::take(&mut self.first);
            if f.len() < n {
                return None;
            }
            f
        };
        Some(whole)
    }

    /// A NUL-terminated name.
    fn name(&mut self) -> Option<&'a [u8]> {
        let src = if self.first.is_empty() {
            &mut self.rest
        } else {
            &mut self.first
        };
        let end = src.iter().position(|&c| c == 0)?;
        let name = &src[..end];
        *src = &src[end + 1..];
        Some(name)
    }

    /// Everything left.
    fn data(&mut self) -> &'a [u8] {
        if self.first.is_empty() {
            std::mem::take(&mut self.rest)
        } else {
            std::mem::take(&mut self.first)
        }
    }
}

/// Seconds and nanoseconds of `t`, nanoseconds always forward (a time before the epoch has
/// negative seconds), as `struct fuse_attr` carries them.
fn secs_nsecs(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_nanos(),
        ),
        Err(e) => {
            let d = e.duration();
            let s = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            match d.subsec_nanos() {
                0 => (-s, 0),
                n => (-s - 1, 1_000_000_000 - n),
            }
        }
    }
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// `FUSE_NOTIFY_PRUNE` (protocol 7.45): the kernel drops those of `nodes` nothing uses.
const NOTIFY_PRUNE: i32 = 9;

/// A prune notification for `nodes`: fuse_out_header (length, error = the notification's
/// code, unique 0), fuse_notify_prune_out (count, padding, spare), then the node ids.
pub(crate) fn notify_prune(nodes: &[u64]) -> Vec<u8> {
    let len = 16 + 16 + 8 * nodes.len();
    let mut m = Vec::with_capacity(len);
    put32(&mut m, len as u32);
    put32(&mut m, NOTIFY_PRUNE as u32);
    put64(&mut m, 0);
    put32(&mut m, nodes.len() as u32);
    put32(&mut m, 0);
    put64(&mut m, 0);
    for &n in nodes {
        put64(&mut m, n);
    }
    m
}

fn file_type_bits(kind: FileType) -> u32 {
    match kind {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    }
}

/// `struct fuse_attr` (88 bytes).
fn put_attr(out: &mut Vec<u8>, a: &FileAttr) {
    let times = [a.atime, a.mtime, a.ctime].map(secs_nsecs);
    put64(out, a.ino.0);
    put64(out, a.size);
    put64(out, a.blocks);
    for (s, _) in times {
        put64(out, s as u64);
    }
    for (_, n) in times {
        put32(out, n);
    }
    put32(out, file_type_bits(a.kind) | u32::from(a.perm));
    put32(out, a.nlink);
    put32(out, a.uid);
    put32(out, a.gid);
    put32(out, a.rdev);
    put32(out, a.blksize);
    put32(out, a.flags);
}

fn put_valid(out: &mut Vec<u8>, d: Duration) {
    put64(out, d.as_secs());
}

/// `struct fuse_entry_out` (128 bytes).
fn put_entry(out: &mut Vec<u8>, e: &EntryOut) {
    put64(out, e.attr.ino.0);
    put64(out, 0); // generation
    put_valid(out, e.entry_ttl);
    put_valid(out, e.attr_ttl);
    put32(out, e.entry_ttl.subsec_nanos());
    put32(out, e.attr_ttl.subsec_nanos());
    put_attr(out, &e.attr);
}

/// `struct fuse_attr_out` (104 bytes).
fn put_attr_out(out: &mut Vec<u8>, ttl: Duration, a: &FileAttr) {
    put_valid(out, ttl);
    put32(out, ttl.subsec_nanos());
    put32(out, 0);
    put_attr(out, a);
}

/// `struct fuse_open_out` (16 bytes).
fn put_open(out: &mut Vec<u8>, fh: u64, flags: u32) {
    put64(out, fh);
    put32(out, flags);
    put32(out, 0);
}

/// A `struct fuse_dirent` and its name, padded to 8 bytes, if it fits in `cap`.
fn put_dirent(out: &mut Vec<u8>, cap: usize, ino: u64, off: u64, kind: FileType, name: &[u8]) {
    put64(out, ino);
    put64(out, off);
    put32(out, name.len() as u32);
    put32(out, file_type_bits(kind) >> 12);
    out.extend_from_slice(name);
    let pad = (8 - out.len() % 8) % 8;
    out.resize(out.len() + pad, 0);
    debug_assert!(out.len() <= cap);
}

fn dirent_len(name: &[u8]) -> usize {
    (24 + name.len()).div_ceil(8) * 8
}

fn caller(h: &InHeader) -> Caller {
    Caller {
        uid: h.uid,
        gid: h.gid,
        pid: h.pid,
    }
}

fn einval() -> Errno {
    Errno::from_i32(libc::EINVAL)
}

/// A time of `fuse_setattr_in`: seconds (signed) and nanoseconds.
fn ts(sec: u64, nsec: u32) -> Timespec {
    Timespec {
        sec: sec as i64,
        nsec,
    }
}

/// Whether request `h` (first argument `first`, `payload_sz` bytes of payload) may wait
/// long (fsync, fallocate, copy_file_range) or moves much data (reads and writes of
/// [`super::BULK_WRITE`] bytes or more): the io_uring queues hand those to helper threads
/// rather than hold up every other request from their CPU.
pub(crate) fn may_wait(h: &InHeader, first: &[u8], payload_sz: usize) -> bool {
    match h.opcode {
        FSYNC | FSYNCDIR | FALLOCATE | COPY_FILE_RANGE => true,
        WRITE => payload_sz >= super::BULK_WRITE,
        READ => u32_at(first, 16).is_some_and(|n| n as usize >= super::BULK_WRITE),
        _ => false,
    }
}

/// Serves request `h` with arguments `args`: the out arguments go to `body` (cleared
/// first), and the result is 0 or a negative errno. `None`: a request that gets no reply
/// (forget).
pub(crate) fn serve(
    a: &Adapter,
    h: &InHeader,
    mut args: Args<'_>,
    body: &mut Vec<u8>,
) -> Option<i32> {
    body.clear();
    match answer(a, h, &mut args, body) {
        Ok(()) => Some(0),
        Err(Some(e)) => {
            body.clear();
            Some(-e.code())
        }
        Err(None) => None,
    }
}

type Answer = Result<(), Option<Errno>>;

fn fail(e: Errno) -> Option<Errno> {
    Some(e)
}

fn answer(a: &Adapter, h: &InHeader, args: &mut Args<'_>, body: &mut Vec<u8>) -> Answer {
    let node = h.nodeid;
    let c = caller(h);
    let bad = || Some(einval());
    let entry = |r: Result<EntryOut, Errno>, body: &mut Vec<u8>| -> Answer {
        put_entry(body, &r.map_err(fail)?);
        Ok(())
    };
    let empty = |r: Result<(), Errno>| -> Answer { r.map_err(fail) };
    match h.opcode {
        LOOKUP => {
            let name = args.name().ok_or_else(bad)?;
            entry(a.lookup(node, name), body)
        }
        FORGET => {
            let f = args.fixed(8).ok_or(None)?;
            a.forget(node, u64_at(f, 0).ok_or(None)?);
            Err(None)
        }
        BATCH_FORGET => {
            let f = args.fixed(8).ok_or(None)?;
            let count = u32_at(f, 0).ok_or(None)? as usize;
            let list = args.data();
            for i in 0..count {
                let (Some(n), Some(k)) = (u64_at(list, i * 16), u64_at(list, i * 16 + 8)) else {
                    break;
                };
                a.forget(n, k);
            }
            Err(None)
        }
        GETATTR => {
            let attr = a.getattr(node).map_err(fail)?;
            put_attr_out(body, a.caching.attr, &attr);
            Ok(())
        }
        SETATTR => {
            let f = args.fixed(88).ok_or_else(bad)?;
            let r = |at| u64_at(f, at).ok_or_else(bad);
            let r32 = |at| u32_at(f, at).ok_or_else(bad);
            let valid = r32(0)?;
            let has = |bit: u32| valid & bit != 0;
            let atime = if has(FATTR_ATIME_NOW) {
                Some(super::timespec(SystemTime::now()))
            } else if has(FATTR_ATIME) {
                Some(ts(r(32)?, r32(56)?))
            } else {
                None
            };
            let mtime = if has(FATTR_MTIME_NOW) {
                Some(super::timespec(SystemTime::now()))
            } else if has(FATTR_MTIME) {
                Some(ts(r(40)?, r32(60)?))
            } else {
                None
            };
            let set = SetAttr {
                mode: has(FATTR_MODE).then_some(r32(68)?),
                uid: has(FATTR_UID).then_some(r32(76)?),
                gid: has(FATTR_GID).then_some(r32(80)?),
                size: has(FATTR_SIZE).then_some(r(16)?),
                // Both times now or left alone: a touch (the caller needs write access, not
                // ownership), as the fuser front decides it.
                touch: (has(FATTR_ATIME_NOW) || !has(FATTR_ATIME))
                    && (has(FATTR_MTIME_NOW) || !has(FATTR_MTIME)),
                atime,
                mtime,
                ctime: has(FATTR_CTIME).then_some(ts(r(48)?, r32(64)?)),
            };
            let attr = a.setattr(&c, node, &set).map_err(fail)?;
            put_attr_out(body, a.caching.attr, &attr);
            Ok(())
        }
        READLINK => {
            *body = a.readlink(node).map_err(fail)?;
            Ok(())
        }
        SYMLINK => {
            let name = args.name().ok_or_else(bad)?;
            let target = args.name().ok_or_else(bad)?;
            let kind = NewKind::Symlink { target };
            entry(a.make("symlink", &c, node, name, kind, 0o777, 0), body)
        }
        MKNOD => {
            let f = args.fixed(16).ok_or_else(bad)?;
            let (mode, rdev, umask) = (
                u32_at(f, 0).ok_or_else(bad)?,
                u32_at(f, 4).ok_or_else(bad)?,
                u32_at(f, 8).ok_or_else(bad)?,
            );
            let name = args.name().ok_or_else(bad)?;
            let rdev = butter::format::items::rdev_from_user(rdev);
            let kind = NewKind::Node { rdev };
            entry(a.make("mknod", &c, node, name, kind, mode, umask), body)
        }
        MKDIR => {
            let f = args.fixed(8).ok_or_else(bad)?;
            let (mode, umask) = (u32_at(f, 0).ok_or_else(bad)?, u32_at(f, 4).ok_or_else(bad)?);
            let name = args.name().ok_or_else(bad)?;
            entry(
                a.make("mkdir", &c, node, name, NewKind::Dir, mode, umask),
                body,
            )
        }
        UNLINK => empty(a.unlink(node, args.name().ok_or_else(bad)?)),
        RMDIR => empty(a.rmdir(node, args.name().ok_or_else(bad)?)),
        RENAME | RENAME2 => {
            let size = if h.opcode == RENAME { 8 } else { 16 };
            let f = args.fixed(size).ok_or_else(bad)?;
            let newdir = u64_at(f, 0).ok_or_else(bad)?;
            let flags = if h.opcode == RENAME2 {
                u32_at(f, 8).ok_or_else(bad)?
            } else {
                0
            };
            let name = args.name().ok_or_else(bad)?;
            let newname = args.name().ok_or_else(bad)?;
            empty(a.rename(node, name, newdir, newname, flags))
        }
        LINK => {
            let f = args.fixed(8).ok_or_else(bad)?;
            let old = u64_at(f, 0).ok_or_else(bad)?;
            let name = args.name().ok_or_else(bad)?;
            entry(a.link(old, node, name), body)
        }
        OPEN => {
            let f = args.fixed(8).ok_or_else(bad)?;
            let o = a
                .open(&c, node, u32_at(f, 0).ok_or_else(bad)? as i32)
                .map_err(fail)?;
            put_open(body, o.fh, o.flags.bits());
            Ok(())
        }
        OPENDIR => {
            let o = a.opendir(node).map_err(fail)?;
            put_open(body, o.fh, o.flags.bits());
            Ok(())
        }
        CREATE => {
            let f = args.fixed(16).ok_or_else(bad)?;
            let (flags, mode, umask) = (
                u32_at(f, 0).ok_or_else(bad)?,
                u32_at(f, 4).ok_or_else(bad)?,
                u32_at(f, 8).ok_or_else(bad)?,
            );
            let name = args.name().ok_or_else(bad)?;
            let (e, o) = a
                .create(&c, node, name, mode, umask, flags as i32)
                .map_err(fail)?;
            put_entry(body, &e);
            put_open(body, o.fh, o.flags.bits());
            Ok(())
        }
        READ => {
            let f = args.fixed(40).ok_or_else(bad)?;
            let (offset, size) = (
                u64_at(f, 8).ok_or_else(bad)?,
                u32_at(f, 16).ok_or_else(bad)?,
            );
            *body = a.read(node, offset, size).map_err(fail)?;
            Ok(())
        }
        WRITE => {
            let f = args.fixed(40).ok_or_else(bad)?;
            let fh = u64_at(f, 0).ok_or_else(bad)?;
            let offset = u64_at(f, 8).ok_or_else(bad)?;
            let size = u32_at(f, 16).ok_or_else(bad)? as usize;
            let write_flags = u32_at(f, 20).ok_or_else(bad)?;
            let flags = u32_at(f, 32).ok_or_else(bad)? as i32;
            let data = args.data().get(..size).ok_or_else(bad)?;
            let from_page = write_flags & FUSE_WRITE_CACHE != 0;
            let n = a
                .write(&c, node, fh, offset, data, from_page, flags)
                .map_err(fail)?;
            put32(body, n);
            put32(body, 0);
            Ok(())
        }
        STATFS => {
            let s = a.statfs().map_err(fail)?;
            for v in [s.blocks, s.bfree, s.bavail, 0, 0] {
                put64(body, v);
            }
            for v in [s.bsize, s.namelen, s.bsize, 0, 0, 0, 0, 0, 0, 0] {
                put32(body, v);
            }
            Ok(())
        }
        RELEASE | RELEASEDIR => {
            let f = args.fixed(24).ok_or_else(bad)?;
            let fh = u64_at(f, 0).ok_or_else(bad)?;
            if h.opcode == RELEASE {
                empty(a.release(node, fh))
            } else {
                empty(a.releasedir(node, fh))
            }
        }
        FSYNC | FSYNCDIR => {
            let f = args.fixed(16).ok_or_else(bad)?;
            let datasync = u32_at(f, 8).ok_or_else(bad)? & FUSE_FSYNC_FDATASYNC != 0;
            let op = if h.opcode == FSYNC {
                "fsync"
            } else {
                "fsyncdir"
            };
            empty(a.fsync(op, node, datasync))
        }
        SETXATTR => {
            // 8 bytes, or 16 with FUSE_SETXATTR_EXT: the size and flags lead either way.
            let f = args.fixed(8).ok_or_else(bad)?;
            let (size, flags) = (
                u32_at(f, 0).ok_or_else(bad)? as usize,
                u32_at(f, 4).ok_or_else(bad)?,
            );
            let name = args.name().ok_or_else(bad)?;
            let value = args.data().get(..size).ok_or_else(bad)?;
            empty(a.setxattr(&c, node, name, value, flags as i32))
        }
        GETXATTR | LISTXATTR => {
            let f = args.fixed(8).ok_or_else(bad)?;
            let size = u32_at(f, 0).ok_or_else(bad)?;
            let r = if h.opcode == GETXATTR {
                a.getxattr(node, args.name().ok_or_else(bad)?, size)
            } else {
                a.listxattr(node, size)
            };
            match r.map_err(fail)? {
                XattrOut::Size(n) => {
                    put32(body, n);
                    put32(body, 0);
                }
                XattrOut::Data(d) => *body = d,
            }
            Ok(())
        }
        REMOVEXATTR => empty(a.removexattr(node, args.name().ok_or_else(bad)?)),
        // close(2) is not a durability point; see the fuser front's flush.
        FLUSH => Err(fail(Errno::ENOSYS)),
        READDIR | READDIRPLUS => {
            let f = args.fixed(40).ok_or_else(bad)?;
            let fh = u64_at(f, 0).ok_or_else(bad)?;
            let offset = u64_at(f, 8).ok_or_else(bad)?;
            let cap = u32_at(f, 16).ok_or_else(bad)? as usize;
            body.reserve(cap);
            let r = if h.opcode == READDIR {
                a.readdir(node, fh, offset, &mut |ino, next, kind, name| {
                    if body.len() + dirent_len(name) > cap {
                        return true;
                    }
                    put_dirent(body, cap, ino, next, kind, name);
                    false
                })
            } else {
                a.readdirplus(node, fh, offset, &mut |name, next, e| {
                    if body.len() + 128 + dirent_len(name) > cap {
                        return true;
                    }
                    put_entry(body, e);
                    put_dirent(body, cap, e.attr.ino.0, next, e.attr.kind, name);
                    false
                })
            };
            r.map_err(fail)
        }
        ACCESS => {
            let f = args.fixed(8).ok_or_else(bad)?;
            empty(a.access(u32_at(f, 0).ok_or_else(bad)? as i32))
        }
        IOCTL => {
            let f = args.fixed(32).ok_or_else(bad)?;
            let cmd = u32_at(f, 12).ok_or_else(bad)?;
            let in_size = u32_at(f, 24).ok_or_else(bad)? as usize;
            let out_size = u32_at(f, 28).ok_or_else(bad)?;
            let in_data = args.data().get(..in_size).ok_or_else(bad)?;
            let data = a.ioctl(node, h.uid, cmd, in_data, out_size).map_err(fail)?;
            // struct fuse_ioctl_out: result, flags, in_iovs, out_iovs.
            for v in [0, 0, 0, 0] {
                put32(body, v);
            }
            body.extend_from_slice(&data);
            Ok(())
        }
        FALLOCATE => {
            let f = args.fixed(32).ok_or_else(bad)?;
            let (offset, length) = (
                u64_at(f, 8).ok_or_else(bad)?,
                u64_at(f, 16).ok_or_else(bad)?,
            );
            let mode = u32_at(f, 24).ok_or_else(bad)? as i32;
            empty(a.fallocate(&c, node, offset, length, mode))
        }
        LSEEK => {
            let f = args.fixed(24).ok_or_else(bad)?;
            let (offset, whence) = (
                u64_at(f, 8).ok_or_else(bad)?,
                u32_at(f, 16).ok_or_else(bad)?,
            );
            let at = a.lseek(node, offset as i64, whence as i32).map_err(fail)?;
            put64(body, at as u64);
            Ok(())
        }
        COPY_FILE_RANGE => {
            let f = args.fixed(56).ok_or_else(bad)?;
            let r = |at| u64_at(f, at).ok_or_else(bad);
            let n = a
                .copy_file_range(&c, (node, r(8)?), (r(16)?, r(32)?), r(40)?)
                .map_err(fail)?;
            put32(body, n);
            put32(body, 0);
            Ok(())
        }
        // Everything else (poll, locks, bmap, tmpfile, statx, ...): not implemented, as on
        // the fuser front, which answers ENOSYS for what butter does not implement.
        _ => Err(fail(Errno::ENOSYS)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prune_notification_carries_its_code_count_and_node_ids() {
        let m = notify_prune(&[7, 1 << 40]);
        assert_eq!(m.len(), 48);
        assert_eq!(u32_at(&m, 0), Some(48));
        assert_eq!(u32_at(&m, 4), Some(9));
        assert_eq!(u64_at(&m, 8), Some(0));
        assert_eq!(u32_at(&m, 16), Some(2));
        assert_eq!(u64_at(&m, 32), Some(7));
        assert_eq!(u64_at(&m, 40), Some(1 << 40));
    }

    #[test]
    fn args_read_fixed_parts_then_names_from_either_area() {
        // 6.14 and later: the first argument (a header) in op_in, names in the payload.
        let mut a = Args::new(&[1, 0, 0, 0, 2, 0, 0, 0], b"old\0new\0");
        let f = a.fixed(8).unwrap();
        assert_eq!((u32_at(f, 0), u32_at(f, 4)), (Some(1), Some(2)));
        assert_eq!(a.name(), Some(&b"old"[..]));
        assert_eq!(a.name(), Some(&b"new"[..]));
        assert_eq!(a.name(), None);
        // An empty first argument: everything from the payload.
        let mut a = Args::new(&[], b"name\0");
        assert_eq!(a.name(), Some(&b"name"[..]));
        // Short or unterminated: refused, not read past.
        assert!(Args::new(&[1, 2, 3], b"").fixed(8).is_none());
        assert!(Args::new(&[], b"abc").name().is_none());
    }

    #[test]
    fn attrs_and_entries_have_the_kernels_sizes_and_times() {
        let attr = FileAttr {
            ino: fuser::INodeNo(300),
            size: 5,
            blocks: 8,
            atime: UNIX_EPOCH - Duration::from_millis(1500),
            mtime: UNIX_EPOCH + Duration::new(7, 9),
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind: FileType::Directory,
            perm: 0o755,
            nlink: 2,
            uid: 1,
            gid: 2,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        };
        let mut out = Vec::new();
        put_attr(&mut out, &attr);
        assert_eq!(out.len(), 88);
        assert_eq!(u64_at(&out, 24).map(|s| s as i64), Some(-2));
        assert_eq!(u32_at(&out, 48), Some(500_000_000));
        assert_eq!(u64_at(&out, 32), Some(7));
        assert_eq!(u32_at(&out, 52), Some(9));
        assert_eq!(u32_at(&out, 60), Some(libc::S_IFDIR | 0o755));
        out.clear();
        let e = EntryOut {
            attr,
            entry_ttl: Duration::from_millis(1500),
            attr_ttl: Duration::from_secs(60),
        };
        put_entry(&mut out, &e);
        assert_eq!(out.len(), 128);
        assert_eq!(
            (u64_at(&out, 16), u64_at(&out, 24), u32_at(&out, 32)),
            (Some(1), Some(60), Some(500_000_000))
        );
        out.clear();
        put_dirent(&mut out, 64, 300, 3, FileType::Symlink, b"abc");
        assert_eq!(out.len(), dirent_len(b"abc"));
        assert_eq!(out.len(), 32);
        assert_eq!(u32_at(&out, 20), Some(libc::DT_LNK as u32));
    }
}
