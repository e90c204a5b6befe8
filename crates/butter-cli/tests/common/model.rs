//! Model-based filesystem testing: seeded random sequences of POSIX operations, applied both to
//! an in-memory [`Model`] of a filesystem and to one or more real [`Target`]s, which must return
//! exactly the errno the model predicts for every operation and must show the tree the model
//! predicts at every checkpoint.
//!
//! - [`Op`]: one operation on paths relative to the target root (create, mkdir, mknod, symlink,
//!   link, unlink, rmdir, rename with NOREPLACE / EXCHANGE, write, truncate, fallocate, chmod,
//!   chown, utimens, setxattr, removexattr).
//! - [`Target`]: what a filesystem under test implements (apply an op, checkpoint and show its
//!   tree as a [`Manifest`]). [`DirTarget`] applies ops through the syscalls on a directory
//!   (a kernel btrfs loop mount, a tmpfs); a butter adapter can implement the same three methods
//!   over the library API.
//! - [`Model`]: an in-memory filesystem with POSIX semantics as Linux implements them; it
//!   predicts `Ok(())` or the errno of each op and, through [`Model::manifest`], the tree.
//! - [`generate`] with a [`Profile`]: the seeded generator. It draws paths from the model, so
//!   most ops are valid; a share of them are deliberately invalid (missing paths, paths under a
//!   file, existing names, renames into their own subtree, wrong file types, 256-byte names,
//!   empty symlink targets, bad fallocate modes, missing xattrs).
//! - [`compare`]: the model's manifest against a target's, field by field (see below).
//! - [`Runner`]: drives model and targets together and panics with a readable report (seed,
//!   op index, the op, the last ops, the manifest diff) on the first disagreement.
//!
//! # Semantics the model predicts (Linux 6.x, caller is root with every capability)
//!
//! Path resolution: a missing intermediate component gives ENOENT, a non-directory one ENOTDIR;
//! a last component longer than 255 bytes gives ENAMETOOLONG (after the parent resolved). The
//! generator never makes paths through a symlink (the model would have to follow it) and never
//! opens a fifo, socket or device for data (that would block or reach a driver).
//!
//! - create (`open(O_CREAT|O_EXCL|O_NOFOLLOW)` then `fchmod` to the exact mode, so the umask does
//!   not matter), mkdir, mknod (then chmod), symlink: EEXIST if the name exists (whatever it is);
//!   symlink with an empty target: ENOENT before anything else. New inodes are owned by 0 and
//!   take the group of a setgid parent directory, else 0.
//! - link: source resolved first (ENOENT), then the new name (EEXIST), then a directory source
//!   gives EPERM.
//! - unlink: ENOENT, EISDIR on a directory. rmdir: ENOENT, ENOTDIR, ENOTEMPTY.
//! - rename (renameat2): ENOENT for a missing source; NOREPLACE with an existing target: EEXIST;
//!   EXCHANGE with a missing target: ENOENT; a source that is an ancestor of the target: EINVAL;
//!   a target that is an ancestor of the source: ENOTEMPTY (EXCHANGE: EINVAL); two names of one
//!   inode: success, nothing changes (both names stay); directory over non-directory: ENOTDIR;
//!   non-directory over directory: EISDIR; over a non-empty directory: ENOTEMPTY.
//! - write / truncate / fallocate open the path with `O_WRONLY|O_NOFOLLOW`: ENOENT, EISDIR on a
//!   directory, ELOOP on a symlink. fallocate: length 0 gives EINVAL; PUNCH_HOLE without
//!   KEEP_SIZE, or PUNCH_HOLE with ZERO_RANGE, EOPNOTSUPP; ZERO_RANGE where the filesystem lacks
//!   it ([`Flavor::zero_range`], tmpfs) EOPNOTSUPP.
//! - chmod (`fchmodat(AT_SYMLINK_NOFOLLOW)`): EOPNOTSUPP on a symlink. chown (`lchown`, `None` =
//!   -1, unchanged): on a non-directory it clears setuid, and setgid when group-execute is set
//!   (even for root). utimens (`utimensat(AT_SYMLINK_NOFOLLOW)`, `None` = UTIME_OMIT): with both
//!   times omitted it succeeds without looking the path up, even a missing one.
//! - setxattr / removexattr (`lsetxattr`, `lremovexattr`): `user.*` names on anything but a
//!   regular file or directory: EPERM; XATTR_CREATE on an existing name: EEXIST; XATTR_REPLACE
//!   or remove of a missing name: ENODATA.
//!
//! Not predicted, so never generated: ENOSPC (the data kept is bounded by
//! [`Profile::max_data_bytes`], the inodes by [`Profile::max_inodes`]), EMLINK, paths near
//! PATH_MAX (relative paths stay below [`MAX_PATH`] bytes, directory depth below
//! [`Profile::max_depth`]), permission errors (we are root), data ops on special files.
//!
//! # What [`compare`] compares
//!
//! Per path: kind, permission bits (with setuid/setgid/sticky), owner, size of non-directories,
//! link count of non-directories, hard-link groups, SHA-256 of file contents, symlink targets,
//! device numbers, xattrs, sorted directory entry names, directory link counts (btrfs: always 1;
//! otherwise 2 + subdirectories), and with [`Flavor::btrfs_dirs`] the directory size (btrfs:
//! 2 × the sum of the entry name lengths). atime and mtime only where the model knows them: set
//! explicitly by utimens and not changed since by anything that moves mtime (a write, truncate or
//! fallocate of a file; an entry added, removed or renamed in a directory; a directory moved).
//! The target must not change atime by itself: mount with `noatime`. Not compared: ctime,
//! birth time, inode numbers, st_blocks.
//!
//! # Writing a target (e.g. butter through its library API)
//!
//! - `apply`: map each [`Op`] to the library call on the path (the empty path is the root; a
//!   [`Op::Write`] writes [`write_data`]`(seed, len)`), and return the errno of a failure. A
//!   failed op must change nothing; the runner stops at the first result that differs.
//! - `checkpoint`: commit, then show the tree as a [`Manifest`]: either release the image and
//!   [`take`] a read-only kernel mount of it (`kernel::LoopMount::btrfs_ro`), or build the
//!   entries through the library (kind, mode, uid, gid, size, nlink, rdev, xattrs, symlink
//!   target, SHA-256 of the content, sorted entry names, atime, mtime; `dev`/`ino` to identify
//!   inodes) and call [`link_groups`]. Fields [`compare`] ignores may stay zero.

use super::gen::Rng;
use super::manifest::{diff, show, take, CompareOpts, Entry, Kind, Manifest, TakeOpts, Ts};
use sha2::{Digest, Sha256};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ffi::{CString, OsStr};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// fallocate mode bits (the Linux values).
pub const FALLOC_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_PUNCH_HOLE: u32 = 0x02;
pub const FALLOC_ZERO_RANGE: u32 = 0x10;

/// Longest name a directory entry may have.
pub const NAME_MAX: usize = 255;

// errno values (Linux), so adapters need not depend on libc.
pub const EPERM: i32 = 1;
pub const ENOENT: i32 = 2;
pub const EEXIST: i32 = 17;
pub const ENOTDIR: i32 = 20;
pub const EISDIR: i32 = 21;
pub const EINVAL: i32 = 22;
pub const ENAMETOOLONG: i32 = 36;
pub const ENOTEMPTY: i32 = 39;
pub const ELOOP: i32 = 40;
pub const ENODATA: i32 = 61;
pub const EOPNOTSUPP: i32 = 95;

/// A readable name for an errno value ("ENOENT"), or "errno N".
pub fn errno_name(e: i32) -> String {
    let name = match e {
        1 => "EPERM",
        2 => "ENOENT",
        5 => "EIO",
        9 => "EBADF",
        12 => "ENOMEM",
        13 => "EACCES",
        16 => "EBUSY",
        17 => "EEXIST",
        18 => "EXDEV",
        19 => "ENODEV",
        20 => "ENOTDIR",
        21 => "EISDIR",
        22 => "EINVAL",
        27 => "EFBIG",
        28 => "ENOSPC",
        30 => "EROFS",
        31 => "EMLINK",
        34 => "ERANGE",
        36 => "ENAMETOOLONG",
        39 => "ENOTEMPTY",
        40 => "ELOOP",
        61 => "ENODATA",
        95 => "EOPNOTSUPP",
        _ => return format!("errno {e}"),
    };
    name.to_string()
}

fn show_result(r: &Result<(), i32>) -> String {
    match r {
        Ok(()) => "Ok".into(),
        Err(e) => errno_name(*e),
    }
}

// ---------------------------------------------------------------------------------------------
// Operations

/// The kind of node [`Op::Mknod`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

/// renameat2 flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenameHow {
    Plain,
    /// RENAME_NOREPLACE
    NoReplace,
    /// RENAME_EXCHANGE
    Exchange,
}

/// setxattr flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrHow {
    /// 0: create or replace.
    Either,
    /// XATTR_CREATE
    Create,
    /// XATTR_REPLACE
    Replace,
}

/// One filesystem operation. Paths are relative to the target root (the empty path is the
/// root); they never contain `.`, `..` or empty components. Semantics in the module comment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A regular file with exactly `mode` (0o7777 bits), empty.
    Create {
        path: PathBuf,
        mode: u32,
    },
    Mkdir {
        path: PathBuf,
        mode: u32,
    },
    /// A fifo, socket or device node with exactly `mode`; `rdev` = (major, minor) for devices.
    Mknod {
        path: PathBuf,
        kind: NodeKind,
        mode: u32,
        rdev: (u32, u32),
    },
    Symlink {
        path: PathBuf,
        target: Vec<u8>,
    },
    /// A hard link `to` naming the inode at `from` (not following a symlink at `from`).
    Link {
        from: PathBuf,
        to: PathBuf,
    },
    Unlink {
        path: PathBuf,
    },
    Rmdir {
        path: PathBuf,
    },
    Rename {
        from: PathBuf,
        to: PathBuf,
        how: RenameHow,
    },
    /// Writes `write_data(seed, len)` at byte `offset`.
    Write {
        path: PathBuf,
        offset: u64,
        len: u64,
        seed: u64,
    },
    /// Sets the size to `size` bytes (ftruncate).
    Truncate {
        path: PathBuf,
        size: u64,
    },
    /// fallocate with `mode` (FALLOC_* bits) over bytes `offset..offset + len`.
    Fallocate {
        path: PathBuf,
        mode: u32,
        offset: u64,
        len: u64,
    },
    /// Sets the permission bits (0o7777) without following a symlink.
    Chmod {
        path: PathBuf,
        mode: u32,
    },
    /// lchown; `None` leaves that id unchanged.
    Chown {
        path: PathBuf,
        uid: Option<u32>,
        gid: Option<u32>,
    },
    /// utimensat without following a symlink; `None` = UTIME_OMIT.
    Utimens {
        path: PathBuf,
        atime: Option<Ts>,
        mtime: Option<Ts>,
    },
    SetXattr {
        path: PathBuf,
        name: Vec<u8>,
        value: Vec<u8>,
        how: XattrHow,
    },
    RemoveXattr {
        path: PathBuf,
        name: Vec<u8>,
    },
}

/// [`Op`] without its arguments, for weights and statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    Create,
    Mkdir,
    Mknod,
    Symlink,
    Link,
    Unlink,
    Rmdir,
    Rename,
    Write,
    Truncate,
    Fallocate,
    Chmod,
    Chown,
    Utimens,
    SetXattr,
    RemoveXattr,
}

impl Op {
    /// The paths the op names (one, or two for link and rename).
    pub fn paths(&self) -> Vec<&Path> {
        match self {
            Op::Link { from, to } | Op::Rename { from, to, .. } => vec![from, to],
            Op::Create { path, .. }
            | Op::Mkdir { path, .. }
            | Op::Mknod { path, .. }
            | Op::Symlink { path, .. }
            | Op::Unlink { path }
            | Op::Rmdir { path }
            | Op::Write { path, .. }
            | Op::Truncate { path, .. }
            | Op::Fallocate { path, .. }
            | Op::Chmod { path, .. }
            | Op::Chown { path, .. }
            | Op::Utimens { path, .. }
            | Op::SetXattr { path, .. }
            | Op::RemoveXattr { path, .. } => vec![path],
        }
    }

    pub fn kind(&self) -> OpKind {
        match self {
            Op::Create { .. } => OpKind::Create,
            Op::Mkdir { .. } => OpKind::Mkdir,
            Op::Mknod { .. } => OpKind::Mknod,
            Op::Symlink { .. } => OpKind::Symlink,
            Op::Link { .. } => OpKind::Link,
            Op::Unlink { .. } => OpKind::Unlink,
            Op::Rmdir { .. } => OpKind::Rmdir,
            Op::Rename { .. } => OpKind::Rename,
            Op::Write { .. } => OpKind::Write,
            Op::Truncate { .. } => OpKind::Truncate,
            Op::Fallocate { .. } => OpKind::Fallocate,
            Op::Chmod { .. } => OpKind::Chmod,
            Op::Chown { .. } => OpKind::Chown,
            Op::Utimens { .. } => OpKind::Utimens,
            Op::SetXattr { .. } => OpKind::SetXattr,
            Op::RemoveXattr { .. } => OpKind::RemoveXattr,
        }
    }
}

fn show_b(b: &[u8]) -> String {
    if b.len() > 80 {
        format!(
            "{:?}… ({} bytes)",
            String::from_utf8_lossy(&b[..60]),
            b.len()
        )
    } else {
        format!("{:?}", String::from_utf8_lossy(b))
    }
}

fn show_p(p: &Path) -> String {
    show_b(p.as_os_str().as_bytes())
}

fn show_ts(t: &Option<Ts>) -> String {
    t.map_or("omit".into(), |t| t.to_string())
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Create { path, mode } => write!(f, "create {} mode {mode:04o}", show_p(path)),
            Op::Mkdir { path, mode } => write!(f, "mkdir {} mode {mode:04o}", show_p(path)),
            Op::Mknod {
                path,
                kind,
                mode,
                rdev,
            } => write!(
                f,
                "mknod {} {kind:?} mode {mode:04o} rdev {}:{}",
                show_p(path),
                rdev.0,
                rdev.1
            ),
            Op::Symlink { path, target } => {
                write!(f, "symlink {} -> {}", show_p(path), show_b(target))
            }
            Op::Link { from, to } => write!(f, "link {} as {}", show_p(from), show_p(to)),
            Op::Unlink { path } => write!(f, "unlink {}", show_p(path)),
            Op::Rmdir { path } => write!(f, "rmdir {}", show_p(path)),
            Op::Rename { from, to, how } => {
                write!(f, "rename {} to {} ({how:?})", show_p(from), show_p(to))
            }
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => write!(
                f,
                "write {} offset {offset} len {len} seed {seed:#x}",
                show_p(path)
            ),
            Op::Truncate { path, size } => write!(f, "truncate {} to {size}", show_p(path)),
            Op::Fallocate {
                path,
                mode,
                offset,
                len,
            } => {
                let mut m = Vec::new();
                if mode & FALLOC_KEEP_SIZE != 0 {
                    m.push("KEEP_SIZE");
                }
                if mode & FALLOC_PUNCH_HOLE != 0 {
                    m.push("PUNCH_HOLE");
                }
                if mode & FALLOC_ZERO_RANGE != 0 {
                    m.push("ZERO_RANGE");
                }
                if m.is_empty() {
                    m.push("0");
                }
                write!(
                    f,
                    "fallocate {} {} offset {offset} len {len}",
                    show_p(path),
                    m.join("|")
                )
            }
            Op::Chmod { path, mode } => write!(f, "chmod {} {mode:04o}", show_p(path)),
            Op::Chown { path, uid, gid } => write!(
                f,
                "chown {} {}:{}",
                show_p(path),
                uid.map_or("-1".into(), |u| u.to_string()),
                gid.map_or("-1".into(), |g| g.to_string())
            ),
            Op::Utimens { path, atime, mtime } => write!(
                f,
                "utimens {} atime {} mtime {}",
                show_p(path),
                show_ts(atime),
                show_ts(mtime)
            ),
            Op::SetXattr {
                path,
                name,
                value,
                how,
            } => write!(
                f,
                "setxattr {} {} ({} bytes, {how:?})",
                show_p(path),
                show_b(name),
                value.len()
            ),
            Op::RemoveXattr { path, name } => {
                write!(f, "removexattr {} {}", show_p(path), show_b(name))
            }
        }
    }
}

/// The bytes an [`Op::Write`] writes: a function of the seed only. One seed in 8 gives zeros,
/// two in 8 compressible text, the rest random bytes.
pub fn write_data(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    match seed % 8 {
        0 => {}
        1 | 2 => {
            const TEXT: &[u8] = b"the model and the filesystem must agree on every byte. ";
            let start = (seed >> 8) as usize % TEXT.len();
            for (i, b) in v.iter_mut().enumerate() {
                *b = TEXT[(start + i) % TEXT.len()];
            }
        }
        _ => Rng::new(seed).fill(&mut v),
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Targets

/// A filesystem under test. Object safe: runners hold `Box<dyn Target>`.
pub trait Target {
    /// For reports, e.g. "kernel btrfs at /tmp/x/mnt".
    fn name(&self) -> String;
    /// Applies one op; `Err(errno)` when it failed. A failed op must change nothing.
    fn apply(&mut self, op: &Op) -> Result<(), i32>;
    /// Makes everything applied so far durable (sync, commit) and returns the tree the target
    /// now shows (e.g. [`manifest::take`](super::manifest::take) of its mount point).
    fn checkpoint(&mut self) -> Result<Manifest, String>;
    /// A regular file's content, for diagnosing a content difference (optional).
    fn read_file(&mut self, _path: &Path) -> Option<Vec<u8>> {
        None
    }
    /// Lets the target catch up on freeing space (a kernel mount: `syncfs`, which commits, so
    /// extents freed in the running transaction become free). Default: nothing.
    fn settle(&mut self) {}
}

/// A [`Target`] that is a directory (e.g. a kernel mount), changed through the syscalls named
/// in the module comment. Checkpoint is `syncfs` and [`take`] of the directory.
pub struct DirTarget {
    root: PathBuf,
    label: String,
}

impl DirTarget {
    /// `label` says what the directory is ("kernel btrfs", "tmpfs").
    pub fn new(root: &Path, label: &str) -> DirTarget {
        DirTarget {
            root: root.to_path_buf(),
            label: label.to_string(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn abs(&self, rel: &Path) -> CString {
        let p = if rel.as_os_str().is_empty() {
            self.root.clone()
        } else {
            self.root.join(rel)
        };
        CString::new(p.as_os_str().as_bytes()).expect("path contains NUL")
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn cvt(r: libc::c_int) -> Result<libc::c_int, i32> {
    if r < 0 {
        Err(errno())
    } else {
        Ok(r)
    }
}

/// An fd closed on drop.
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.0) };
    }
}

fn open_wr(p: &CString) -> Result<Fd, i32> {
    // O_NONBLOCK: should a fifo ever be opened here, fail with ENXIO instead of blocking.
    let flags = libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    // SAFETY: valid NUL-terminated path.
    cvt(unsafe { libc::open(p.as_ptr(), flags) }).map(Fd)
}

fn timespec(t: &Option<Ts>) -> libc::timespec {
    match t {
        Some(t) => libc::timespec {
            tv_sec: t.sec,
            tv_nsec: t.nsec as _,
        },
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    }
}

impl Target for DirTarget {
    fn name(&self) -> String {
        format!("{} at {}", self.label, self.root.display())
    }

    fn apply(&mut self, op: &Op) -> Result<(), i32> {
        match op {
            Op::Create { path, mode } => {
                let p = self.abs(path);
                let flags = libc::O_CREAT
                    | libc::O_EXCL
                    | libc::O_WRONLY
                    | libc::O_NOFOLLOW
                    | libc::O_CLOEXEC;
                // SAFETY: valid NUL-terminated path.
                let fd = Fd(cvt(unsafe {
                    libc::open(p.as_ptr(), flags, 0o600 as libc::c_uint)
                })?);
                // SAFETY: fd is open.
                cvt(unsafe { libc::fchmod(fd.0, *mode) })?;
            }
            Op::Mkdir { path, mode } => {
                let p = self.abs(path);
                // SAFETY: valid NUL-terminated path.
                cvt(unsafe { libc::mkdir(p.as_ptr(), 0o700) })?;
                // SAFETY: as above.
                cvt(unsafe { libc::chmod(p.as_ptr(), *mode) })?;
            }
            Op::Mknod {
                path,
                kind,
                mode,
                rdev,
            } => {
                let p = self.abs(path);
                let fmt = match kind {
                    NodeKind::Fifo => libc::S_IFIFO,
                    NodeKind::Socket => libc::S_IFSOCK,
                    NodeKind::CharDev => libc::S_IFCHR,
                    NodeKind::BlockDev => libc::S_IFBLK,
                };
                let dev = match kind {
                    NodeKind::CharDev | NodeKind::BlockDev => libc::makedev(rdev.0, rdev.1),
                    _ => 0,
                };
                // SAFETY: valid NUL-terminated path.
                cvt(unsafe { libc::mknod(p.as_ptr(), fmt | 0o600, dev) })?;
                // SAFETY: as above (chmod does not open the node).
                cvt(unsafe { libc::chmod(p.as_ptr(), *mode) })?;
            }
            Op::Symlink { path, target } => {
                let p = self.abs(path);
                let t = CString::new(target.clone()).expect("symlink target contains NUL");
                // SAFETY: valid NUL-terminated strings.
                cvt(unsafe { libc::symlink(t.as_ptr(), p.as_ptr()) })?;
            }
            Op::Link { from, to } => {
                let (a, b) = (self.abs(from), self.abs(to));
                // SAFETY: valid NUL-terminated paths.
                cvt(unsafe {
                    libc::linkat(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), 0)
                })?;
            }
            Op::Unlink { path } => {
                let p = self.abs(path);
                // SAFETY: valid NUL-terminated path.
                cvt(unsafe { libc::unlink(p.as_ptr()) })?;
            }
            Op::Rmdir { path } => {
                let p = self.abs(path);
                // SAFETY: valid NUL-terminated path.
                cvt(unsafe { libc::rmdir(p.as_ptr()) })?;
            }
            Op::Rename { from, to, how } => {
                let (a, b) = (self.abs(from), self.abs(to));
                let flags: libc::c_uint = match how {
                    RenameHow::Plain => 0,
                    RenameHow::NoReplace => 1,
                    RenameHow::Exchange => 2,
                };
                // SAFETY: valid NUL-terminated paths; renameat2 takes (int, char*, int, char*,
                // unsigned int).
                let r = unsafe {
                    libc::syscall(
                        libc::SYS_renameat2,
                        libc::AT_FDCWD,
                        a.as_ptr(),
                        libc::AT_FDCWD,
                        b.as_ptr(),
                        flags,
                    )
                };
                if r < 0 {
                    return Err(errno());
                }
            }
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => {
                let fd = open_wr(&self.abs(path))?;
                let data = write_data(*seed, *len as usize);
                let mut done = 0usize;
                while done < data.len() || data.is_empty() {
                    let rest = &data[done..];
                    // SAFETY: fd is open; pointer and length from a slice.
                    let n = unsafe {
                        libc::pwrite(
                            fd.0,
                            rest.as_ptr().cast(),
                            rest.len(),
                            (*offset + done as u64) as libc::off_t,
                        )
                    };
                    if n < 0 {
                        let e = errno();
                        if e == libc::EINTR {
                            continue;
                        }
                        return Err(e);
                    }
                    if data.is_empty() {
                        break;
                    }
                    done += n as usize;
                }
            }
            Op::Truncate { path, size } => {
                let fd = open_wr(&self.abs(path))?;
                // SAFETY: fd is open.
                cvt(unsafe { libc::ftruncate(fd.0, *size as libc::off_t) })?;
            }
            Op::Fallocate {
                path,
                mode,
                offset,
                len,
            } => {
                let fd = open_wr(&self.abs(path))?;
                // SAFETY: fd is open.
                cvt(unsafe {
                    libc::fallocate(
                        fd.0,
                        *mode as libc::c_int,
                        *offset as libc::off_t,
                        *len as libc::off_t,
                    )
                })?;
            }
            Op::Chmod { path, mode } => {
                let p = self.abs(path);
                // SAFETY: valid NUL-terminated path.
                cvt(unsafe {
                    libc::fchmodat(libc::AT_FDCWD, p.as_ptr(), *mode, libc::AT_SYMLINK_NOFOLLOW)
                })?;
            }
            Op::Chown { path, uid, gid } => {
                let p = self.abs(path);
                // SAFETY: valid NUL-terminated path.
                cvt(unsafe {
                    libc::lchown(p.as_ptr(), uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX))
                })?;
            }
            Op::Utimens { path, atime, mtime } => {
                let p = self.abs(path);
                let ts = [timespec(atime), timespec(mtime)];
                // SAFETY: valid path, two timespecs.
                cvt(unsafe {
                    libc::utimensat(
                        libc::AT_FDCWD,
                        p.as_ptr(),
                        ts.as_ptr(),
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                })?;
            }
            Op::SetXattr {
                path,
                name,
                value,
                how,
            } => {
                let p = self.abs(path);
                let n = CString::new(name.clone()).expect("xattr name contains NUL");
                let flags = match how {
                    XattrHow::Either => 0,
                    XattrHow::Create => libc::XATTR_CREATE,
                    XattrHow::Replace => libc::XATTR_REPLACE,
                };
                // SAFETY: valid NUL-terminated path and name; value from a slice.
                cvt(unsafe {
                    libc::lsetxattr(
                        p.as_ptr(),
                        n.as_ptr(),
                        value.as_ptr().cast(),
                        value.len(),
                        flags,
                    )
                })?;
            }
            Op::RemoveXattr { path, name } => {
                let p = self.abs(path);
                let n = CString::new(name.clone()).expect("xattr name contains NUL");
                // SAFETY: valid NUL-terminated path and name.
                cvt(unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) })?;
            }
        }
        Ok(())
    }

    fn checkpoint(&mut self) -> Result<Manifest, String> {
        let p = self.abs(Path::new(""));
        // SAFETY: valid NUL-terminated path.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
        if fd < 0 {
            return Err(format!(
                "open {}: {}",
                self.root.display(),
                errno_name(errno())
            ));
        }
        let fd = Fd(fd);
        // SAFETY: fd is open.
        if unsafe { libc::syncfs(fd.0) } < 0 {
            return Err(format!(
                "syncfs {}: {}",
                self.root.display(),
                errno_name(errno())
            ));
        }
        Ok(take(&self.root, &TakeOpts::default()))
    }

    fn settle(&mut self) {
        let p = self.abs(Path::new(""));
        // SAFETY: valid NUL-terminated path; the fd is closed on drop.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
        if fd >= 0 {
            let fd = Fd(fd);
            // SAFETY: fd is open.
            unsafe { libc::syncfs(fd.0) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model

/// What the model needs to know about the filesystem it predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flavor {
    /// btrfs directories: st_size = 2 × the sum of entry name lengths, st_nlink = 1. Otherwise
    /// st_nlink = 2 + subdirectories and st_size is not compared.
    pub btrfs_dirs: bool,
    /// FALLOC_FL_ZERO_RANGE is supported (btrfs); else it fails with EOPNOTSUPP (tmpfs).
    pub zero_range: bool,
}

impl Flavor {
    pub const BTRFS: Flavor = Flavor {
        btrfs_dirs: true,
        zero_range: true,
    };
    pub const TMPFS: Flavor = Flavor {
        btrfs_dirs: false,
        zero_range: false,
    };
}

const ROOT: u64 = 1;
const S_ISUID: u32 = 0o4000;
const S_ISGID: u32 = 0o2000;
const S_IXGRP: u32 = 0o0010;

#[derive(Clone, Debug)]
struct Inode {
    kind: Kind,
    /// 0o7777 bits.
    mode: u32,
    uid: u32,
    gid: u32,
    /// File content (its length is the size).
    data: Vec<u8>,
    /// Cached SHA-256 of `data`.
    sha: Cell<Option<[u8; 32]>>,
    /// Symlink target.
    target: Vec<u8>,
    rdev: (u32, u32),
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Directory entries: name → inode.
    entries: BTreeMap<Vec<u8>, u64>,
    /// Names of this inode: (parent directory, name). Directories have one (the root none).
    links: Vec<(u64, Vec<u8>)>,
    /// Set by utimens and still valid (see the module comment).
    atime: Option<Ts>,
    mtime: Option<Ts>,
}

impl Inode {
    fn new(kind: Kind, mode: u32, gid: u32) -> Inode {
        Inode {
            kind,
            mode,
            uid: 0,
            gid,
            data: Vec::new(),
            sha: Cell::new(None),
            target: Vec::new(),
            rdev: (0, 0),
            xattrs: BTreeMap::new(),
            entries: BTreeMap::new(),
            links: Vec::new(),
            atime: None,
            mtime: None,
        }
    }

    fn is_dir(&self) -> bool {
        self.kind == Kind::Dir
    }
}

/// A set of inode numbers with O(1) insert, remove and random pick.
#[derive(Clone, Debug, Default)]
struct IdSet {
    v: Vec<u64>,
    pos: HashMap<u64, usize>,
}

impl IdSet {
    fn insert(&mut self, id: u64) {
        if !self.pos.contains_key(&id) {
            self.pos.insert(id, self.v.len());
            self.v.push(id);
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(i) = self.pos.remove(&id) {
            self.v.swap_remove(i);
            if let Some(&moved) = self.v.get(i) {
                self.pos.insert(moved, i);
            }
        }
    }

    fn pick(&self, rng: &mut Rng) -> Option<u64> {
        if self.v.is_empty() {
            None
        } else {
            Some(self.v[rng.below(self.v.len() as u64) as usize])
        }
    }
}

/// The in-memory filesystem. Starts as an empty root directory with mode 0755 owned by 0:0
/// (what mkfs.btrfs and a tmpfs with `mode=0755` give).
#[derive(Clone, Debug)]
pub struct Model {
    flavor: Flavor,
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
    dirs: IdSet,
    others: IdSet,
    data_bytes: u64,
}

fn components(path: &Path) -> Vec<&[u8]> {
    path.as_os_str()
        .as_bytes()
        .split(|&b| b == b'/')
        .filter(|c| !c.is_empty())
        .collect()
}

impl Model {
    pub fn new(flavor: Flavor) -> Model {
        let mut m = Model {
            flavor,
            inodes: HashMap::new(),
            next_ino: ROOT + 1,
            dirs: IdSet::default(),
            others: IdSet::default(),
            data_bytes: 0,
        };
        m.inodes.insert(ROOT, Inode::new(Kind::Dir, 0o755, 0));
        m.dirs.insert(ROOT);
        m
    }

    /// A regular file's content as the model has it.
    pub fn file_data(&self, path: &Path) -> Option<Vec<u8>> {
        let i = self.resolve(path).ok()?;
        let n = self.inodes.get(&i)?;
        (n.kind == Kind::File).then(|| n.data.clone())
    }

    pub fn flavor(&self) -> Flavor {
        self.flavor
    }

    /// Number of inodes, the root included.
    pub fn inode_count(&self) -> usize {
        self.inodes.len()
    }

    /// Total bytes of file content (sizes of all regular files, each inode once).
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// The kind of what `path` names, if it exists (not following a symlink at the end).
    pub fn kind_at(&self, path: &Path) -> Option<Kind> {
        self.resolve(path).ok().map(|i| self.inodes[&i].kind)
    }

    /// Number of entries of the directory at `path`.
    pub fn dir_len(&self, path: &Path) -> Option<usize> {
        let i = self.resolve(path).ok()?;
        let n = &self.inodes[&i];
        n.is_dir().then_some(n.entries.len())
    }

    /// "N inodes (F files, D dirs, ...), B bytes of data, T with known times".
    pub fn summary(&self) -> String {
        let count = |k: Kind| self.inodes.values().filter(|i| i.kind == k).count();
        let timed = self
            .inodes
            .values()
            .filter(|i| i.atime.is_some() || i.mtime.is_some())
            .count();
        format!(
            "{} inodes ({} files, {} dirs, {} symlinks, {} special), {} bytes of data, {timed} with known times",
            self.inodes.len(),
            count(Kind::File),
            count(Kind::Dir),
            count(Kind::Symlink),
            self.inodes.len() - count(Kind::File) - count(Kind::Dir) - count(Kind::Symlink),
            self.data_bytes
        )
    }

    /// Checks the model's own invariants (entries and link lists agree, directories have one
    /// name, the pick sets and the data total are right); Err says what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let mut bytes = 0u64;
        for (&ino, n) in &self.inodes {
            bytes += n.data.len() as u64;
            if n.kind != Kind::File && !n.data.is_empty() {
                return Err(format!("inode {ino}: {:?} with data", n.kind));
            }
            for (name, &child) in &n.entries {
                let c = self.inodes.get(&child).ok_or_else(|| {
                    format!("inode {ino}: entry {} to a freed inode", show_b(name))
                })?;
                if !c.links.iter().any(|(d, x)| *d == ino && x == name) {
                    return Err(format!("inode {child}: no link for entry {}", show_b(name)));
                }
            }
            for (d, x) in &n.links {
                if self.inodes.get(d).and_then(|p| p.entries.get(x)) != Some(&ino) {
                    return Err(format!("inode {ino}: link {} has no entry", show_b(x)));
                }
            }
            let want_links = if ino == ROOT {
                0..=0
            } else if n.is_dir() {
                1..=1
            } else {
                1..=usize::MAX
            };
            if !want_links.contains(&n.links.len()) {
                return Err(format!("inode {ino}: {} links", n.links.len()));
            }
            let in_set = if n.is_dir() { &self.dirs } else { &self.others };
            if !in_set.pos.contains_key(&ino) {
                return Err(format!("inode {ino}: not in its pick set"));
            }
        }
        if bytes != self.data_bytes {
            return Err(format!(
                "data bytes {} but files hold {bytes}",
                self.data_bytes
            ));
        }
        if self.dirs.v.len() + self.others.v.len() != self.inodes.len() {
            return Err("pick sets and inodes differ in size".into());
        }
        Ok(())
    }

    fn node(&self, i: u64) -> &Inode {
        &self.inodes[&i]
    }

    fn node_mut(&mut self, i: u64) -> &mut Inode {
        self.inodes.get_mut(&i).expect("model inode")
    }

    /// Resolves all but the last component: (parent directory, last name). The empty path
    /// has no parent: the generator never asks for it in a namespace op.
    fn walk_parent(&self, path: &Path) -> Result<(u64, Vec<u8>), i32> {
        let comps = components(path);
        let (last, dirs) = comps
            .split_last()
            .unwrap_or_else(|| panic!("model: namespace op on the root"));
        let mut cur = ROOT;
        for c in dirs {
            if c.len() > NAME_MAX {
                return Err(ENAMETOOLONG);
            }
            let Some(&next) = self.node(cur).entries.get(*c) else {
                return Err(ENOENT);
            };
            match self.node(next).kind {
                Kind::Dir => cur = next,
                Kind::Symlink => panic!(
                    "model: path {} goes through a symlink (the generator must not do that)",
                    show_p(path)
                ),
                _ => return Err(ENOTDIR),
            }
        }
        Ok((cur, last.to_vec()))
    }

    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Option<u64>, i32> {
        if name.len() > NAME_MAX {
            return Err(ENAMETOOLONG);
        }
        Ok(self.node(dir).entries.get(name).copied())
    }

    /// The inode `path` names (the root for the empty path).
    fn resolve(&self, path: &Path) -> Result<u64, i32> {
        if components(path).is_empty() {
            return Ok(ROOT);
        }
        let (dir, name) = self.walk_parent(path)?;
        self.lookup(dir, &name)?.ok_or(ENOENT)
    }

    /// A directory's entries changed: its mtime is no longer known.
    fn dir_changed(&mut self, dir: u64) {
        self.node_mut(dir).mtime = None;
    }

    fn data_changed(&mut self, ino: u64, old_len: usize) {
        let n = self.node_mut(ino);
        n.mtime = None;
        n.sha.set(None);
        let new_len = n.data.len();
        self.data_bytes = self.data_bytes + new_len as u64 - old_len as u64;
    }

    fn create_node(&mut self, path: &Path, kind: Kind, mode: u32) -> Result<u64, i32> {
        let (dir, name) = self.walk_parent(path)?;
        if self.lookup(dir, &name)?.is_some() {
            return Err(EEXIST);
        }
        let parent = self.node(dir);
        let gid = if parent.mode & S_ISGID != 0 {
            parent.gid
        } else {
            0
        };
        let ino = self.next_ino;
        self.next_ino += 1;
        self.inodes
            .insert(ino, Inode::new(kind, mode & 0o7777, gid));
        if kind == Kind::Dir {
            self.dirs.insert(ino);
        } else {
            self.others.insert(ino);
        }
        self.add_link(dir, name, ino);
        Ok(ino)
    }

    fn add_link(&mut self, dir: u64, name: Vec<u8>, ino: u64) {
        self.node_mut(dir).entries.insert(name.clone(), ino);
        self.node_mut(ino).links.push((dir, name));
        self.dir_changed(dir);
    }

    /// Removes the entry `dir/name`; frees the inode when that was its last name.
    fn remove_link(&mut self, dir: u64, name: &[u8]) {
        let ino = self
            .node_mut(dir)
            .entries
            .remove(name)
            .expect("model: removing a missing entry");
        self.dir_changed(dir);
        let n = self.node_mut(ino);
        let at = n
            .links
            .iter()
            .position(|(d, x)| *d == dir && x == name)
            .expect("model: link list out of step");
        n.links.swap_remove(at);
        if n.links.is_empty() {
            let n = self.inodes.remove(&ino).expect("model inode");
            self.data_bytes -= n.data.len() as u64;
            self.dirs.remove(ino);
            self.others.remove(ino);
        }
    }

    /// Moves the entry `od/on` to `nd/nn` (which must be free).
    fn move_link(&mut self, od: u64, on: &[u8], nd: u64, nn: &[u8]) {
        let ino = self
            .node_mut(od)
            .entries
            .remove(on)
            .expect("model: moving a missing entry");
        self.node_mut(nd).entries.insert(nn.to_vec(), ino);
        let n = self.node_mut(ino);
        for l in n.links.iter_mut() {
            if l.0 == od && l.1 == on {
                *l = (nd, nn.to_vec());
                break;
            }
        }
        if n.is_dir() {
            n.mtime = None;
        }
        self.dir_changed(od);
        self.dir_changed(nd);
    }

    /// The parent of a directory (None for the root).
    fn parent(&self, dir: u64) -> Option<u64> {
        self.node(dir).links.first().map(|l| l.0)
    }

    /// True when `anc` is `dir` or one of its ancestors (`dir` is a directory).
    fn is_ancestor_or_self(&self, anc: u64, dir: u64) -> bool {
        let mut cur = Some(dir);
        while let Some(c) = cur {
            if c == anc {
                return true;
            }
            cur = self.parent(c);
        }
        false
    }

    fn depth(&self, dir: u64) -> usize {
        let mut d = 0;
        let mut cur = self.parent(dir);
        while let Some(c) = cur {
            d += 1;
            cur = self.parent(c);
        }
        d
    }

    /// Levels of directories below `dir` (0 when it has no subdirectory).
    fn height(&self, dir: u64) -> usize {
        self.node(dir)
            .entries
            .values()
            .filter(|c| self.node(**c).is_dir())
            .map(|c| 1 + self.height(*c))
            .max()
            .unwrap_or(0)
    }

    /// The path of name number `link` of `ino` (the empty path for the root).
    fn path_of(&self, ino: u64, link: usize) -> PathBuf {
        let mut parts: Vec<&[u8]> = Vec::new();
        let n = self.node(ino);
        let Some((mut dir, name)) = n.links.get(link).map(|(d, x)| (*d, x)) else {
            return PathBuf::new();
        };
        parts.push(name);
        while let Some((d, x)) = self.node(dir).links.first() {
            parts.push(x);
            dir = *d;
        }
        let mut p = PathBuf::new();
        for x in parts.iter().rev() {
            p.push(OsStr::from_bytes(x));
        }
        p
    }

    /// For data ops: the regular file `path` names, opened `O_WRONLY|O_NOFOLLOW`.
    fn open_file(&self, path: &Path) -> Result<u64, i32> {
        let ino = self.resolve(path)?;
        match self.node(ino).kind {
            Kind::File => Ok(ino),
            Kind::Dir => Err(EISDIR),
            Kind::Symlink => Err(ELOOP),
            k => panic!(
                "model: data op on a {k:?} at {} (the generator must not do that)",
                show_p(path)
            ),
        }
    }

    /// Predicts the result of `op` and, when it succeeds, applies it.
    pub fn apply(&mut self, op: &Op) -> Result<(), i32> {
        match op {
            Op::Create { path, mode } => {
                self.create_node(path, Kind::File, *mode)?;
            }
            Op::Mkdir { path, mode } => {
                self.create_node(path, Kind::Dir, *mode)?;
            }
            Op::Mknod {
                path,
                kind,
                mode,
                rdev,
            } => {
                let k = match kind {
                    NodeKind::Fifo => Kind::Fifo,
                    NodeKind::Socket => Kind::Socket,
                    NodeKind::CharDev => Kind::CharDev,
                    NodeKind::BlockDev => Kind::BlockDev,
                };
                let ino = self.create_node(path, k, *mode)?;
                if matches!(kind, NodeKind::CharDev | NodeKind::BlockDev) {
                    self.node_mut(ino).rdev = *rdev;
                }
            }
            Op::Symlink { path, target } => {
                if target.is_empty() {
                    return Err(ENOENT);
                }
                let ino = self.create_node(path, Kind::Symlink, 0o777)?;
                self.node_mut(ino).target = target.clone();
            }
            Op::Link { from, to } => {
                let src = self.resolve(from)?;
                let (dir, name) = self.walk_parent(to)?;
                if self.lookup(dir, &name)?.is_some() {
                    return Err(EEXIST);
                }
                if self.node(src).is_dir() {
                    return Err(EPERM);
                }
                self.add_link(dir, name, src);
            }
            Op::Unlink { path } => {
                let (dir, name) = self.walk_parent(path)?;
                let ino = self.lookup(dir, &name)?.ok_or(ENOENT)?;
                if self.node(ino).is_dir() {
                    return Err(EISDIR);
                }
                self.remove_link(dir, &name);
            }
            Op::Rmdir { path } => {
                let (dir, name) = self.walk_parent(path)?;
                let ino = self.lookup(dir, &name)?.ok_or(ENOENT)?;
                let n = self.node(ino);
                if !n.is_dir() {
                    return Err(ENOTDIR);
                }
                if !n.entries.is_empty() {
                    return Err(ENOTEMPTY);
                }
                self.remove_link(dir, &name);
            }
            Op::Rename { from, to, how } => self.rename(from, to, *how)?,
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => {
                let ino = self.open_file(path)?;
                if *len > 0 {
                    let data = write_data(*seed, *len as usize);
                    let n = self.node_mut(ino);
                    let old = n.data.len();
                    let (off, end) = (*offset as usize, (*offset + *len) as usize);
                    if n.data.len() < end {
                        n.data.resize(end, 0);
                    }
                    n.data[off..end].copy_from_slice(&data);
                    self.data_changed(ino, old);
                } else {
                    self.node_mut(ino).mtime = None;
                }
            }
            Op::Truncate { path, size } => {
                let ino = self.open_file(path)?;
                let n = self.node_mut(ino);
                let old = n.data.len();
                n.data.resize(*size as usize, 0);
                self.data_changed(ino, old);
            }
            Op::Fallocate {
                path,
                mode,
                offset,
                len,
            } => {
                let ino = self.open_file(path)?;
                let mode = *mode;
                if *len == 0 {
                    return Err(EINVAL);
                }
                let known = FALLOC_KEEP_SIZE | FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE;
                if mode & !known != 0
                    || (mode & FALLOC_PUNCH_HOLE != 0 && mode & FALLOC_ZERO_RANGE != 0)
                    || (mode & FALLOC_PUNCH_HOLE != 0 && mode & FALLOC_KEEP_SIZE == 0)
                {
                    return Err(EOPNOTSUPP);
                }
                if mode & FALLOC_ZERO_RANGE != 0 && !self.flavor.zero_range {
                    return Err(EOPNOTSUPP);
                }
                let n = self.node_mut(ino);
                let old = n.data.len();
                let (off, end) = (*offset as usize, (*offset + *len) as usize);
                let keep = mode & FALLOC_KEEP_SIZE != 0;
                if !keep && n.data.len() < end {
                    n.data.resize(end, 0);
                }
                if mode & (FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE) != 0 {
                    let stop = end.min(n.data.len());
                    if off < stop {
                        n.data[off..stop].fill(0);
                    }
                }
                self.data_changed(ino, old);
            }
            Op::Chmod { path, mode } => {
                let ino = self.resolve(path)?;
                let n = self.node_mut(ino);
                if n.kind == Kind::Symlink {
                    return Err(EOPNOTSUPP);
                }
                n.mode = mode & 0o7777;
            }
            Op::Chown { path, uid, gid } => {
                let ino = self.resolve(path)?;
                let n = self.node_mut(ino);
                if let Some(u) = uid {
                    n.uid = *u;
                }
                if let Some(g) = gid {
                    n.gid = *g;
                }
                if !n.is_dir() {
                    if n.mode & S_IXGRP != 0 {
                        n.mode &= !S_ISGID;
                    }
                    n.mode &= !S_ISUID;
                }
            }
            Op::Utimens { path, atime, mtime } => {
                if atime.is_none() && mtime.is_none() {
                    // utimensat returns before it even looks the path up.
                    return Ok(());
                }
                let ino = self.resolve(path)?;
                let n = self.node_mut(ino);
                if atime.is_some() {
                    n.atime = *atime;
                }
                if mtime.is_some() {
                    n.mtime = *mtime;
                }
            }
            Op::SetXattr {
                path,
                name,
                value,
                how,
            } => {
                let ino = self.resolve(path)?;
                let n = self.node_mut(ino);
                if name.starts_with(b"user.") && !matches!(n.kind, Kind::File | Kind::Dir) {
                    return Err(EPERM);
                }
                let exists = n.xattrs.contains_key(name);
                match how {
                    XattrHow::Create if exists => return Err(EEXIST),
                    XattrHow::Replace if !exists => return Err(ENODATA),
                    _ => {}
                }
                n.xattrs.insert(name.clone(), value.clone());
            }
            Op::RemoveXattr { path, name } => {
                let ino = self.resolve(path)?;
                let n = self.node_mut(ino);
                if name.starts_with(b"user.") && !matches!(n.kind, Kind::File | Kind::Dir) {
                    return Err(EPERM);
                }
                n.xattrs.remove(name).ok_or(ENODATA)?;
            }
        }
        Ok(())
    }

    fn rename(&mut self, from: &Path, to: &Path, how: RenameHow) -> Result<(), i32> {
        let (od, on) = self.walk_parent(from)?;
        let (nd, nn) = self.walk_parent(to)?;
        let old = self.lookup(od, &on)?.ok_or(ENOENT)?;
        let new = self.lookup(nd, &nn)?;
        if how == RenameHow::NoReplace && new.is_some() {
            return Err(EEXIST);
        }
        if how == RenameHow::Exchange && new.is_none() {
            return Err(ENOENT);
        }
        // The source must not be an ancestor of the target, nor the target of the source.
        if od != nd {
            if nd != od && self.is_ancestor_or_self(od, nd) {
                if self.is_ancestor_or_self(old, nd) {
                    return Err(EINVAL);
                }
            } else if self.is_ancestor_or_self(nd, od) {
                if let Some(n) = new {
                    if self.is_ancestor_or_self(n, od) {
                        return Err(if how == RenameHow::Exchange {
                            EINVAL
                        } else {
                            ENOTEMPTY
                        });
                    }
                }
            }
        }
        let Some(new) = new else {
            self.move_link(od, &on, nd, &nn);
            return Ok(());
        };
        if new == old {
            // Two names of one inode (or the same name): nothing happens.
            return Ok(());
        }
        if how == RenameHow::Exchange {
            self.node_mut(od).entries.insert(on.clone(), new);
            self.node_mut(nd).entries.insert(nn.clone(), old);
            for (ino, was, now) in [(old, (od, &on), (nd, &nn)), (new, (nd, &nn), (od, &on))] {
                let n = self.node_mut(ino);
                for l in n.links.iter_mut() {
                    if l.0 == was.0 && &l.1 == was.1 {
                        *l = (now.0, now.1.clone());
                        break;
                    }
                }
                if n.is_dir() {
                    n.mtime = None;
                }
            }
            self.dir_changed(od);
            self.dir_changed(nd);
            return Ok(());
        }
        let (old_dir, new_dir) = (self.node(old).is_dir(), self.node(new).is_dir());
        if old_dir && !new_dir {
            return Err(ENOTDIR);
        }
        if !old_dir && new_dir {
            return Err(EISDIR);
        }
        if new_dir && !self.node(new).entries.is_empty() {
            return Err(ENOTEMPTY);
        }
        self.remove_link(nd, &nn);
        self.move_link(od, &on, nd, &nn);
        Ok(())
    }

    fn entry(&self, ino: u64, n: &Inode) -> Entry {
        let is_dir = n.is_dir();
        let size = match n.kind {
            Kind::File => n.data.len() as u64,
            Kind::Symlink => n.target.len() as u64,
            Kind::Dir if self.flavor.btrfs_dirs => {
                2 * n.entries.keys().map(|k| k.len() as u64).sum::<u64>()
            }
            _ => 0,
        };
        let nlink = if !is_dir {
            n.links.len() as u32
        } else if self.flavor.btrfs_dirs {
            1
        } else {
            2 + n
                .entries
                .values()
                .filter(|c| self.node(**c).is_dir())
                .count() as u32
        };
        let sha256 = (n.kind == Kind::File).then(|| match n.sha.get() {
            Some(h) => h,
            None => {
                let h: [u8; 32] = Sha256::digest(&n.data).into();
                n.sha.set(Some(h));
                h
            }
        });
        Entry {
            kind: n.kind,
            mode: n.mode,
            uid: n.uid,
            gid: n.gid,
            size,
            nlink,
            blocks: 0,
            atime: n.atime.unwrap_or_default(),
            mtime: n.mtime.unwrap_or_default(),
            ctime: Ts::default(),
            btime: None,
            rdev: matches!(n.kind, Kind::CharDev | Kind::BlockDev).then_some(n.rdev),
            xattrs: n
                .xattrs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            target: (n.kind == Kind::Symlink).then(|| n.target.clone()),
            sha256,
            dev: 0,
            ino,
            subvol_root: false,
            names: is_dir.then(|| n.entries.keys().cloned().collect()),
            link_group: None,
            errors: Vec::new(),
        }
    }

    /// The tree the model predicts, as a [`Manifest`] rooted at "<model>". Times that are not
    /// known are zero; [`compare`] only looks at the known ones.
    pub fn manifest(&self) -> Manifest {
        let mut m = Manifest {
            root: PathBuf::from("<model>"),
            ..Manifest::default()
        };
        let mut stack = vec![(ROOT, PathBuf::new())];
        while let Some((ino, path)) = stack.pop() {
            let n = self.node(ino);
            for (name, &child) in &n.entries {
                let cp = path.join(OsStr::from_bytes(name));
                let c = self.node(child);
                if c.is_dir() {
                    stack.push((child, cp));
                } else {
                    m.entries.insert(cp, self.entry(child, c));
                }
            }
            m.entries.insert(path, self.entry(ino, n));
        }
        link_groups(&mut m);
        m
    }

    /// Paths whose atime / mtime the model knows: (path, atime, mtime).
    fn known_times(&self) -> Vec<(PathBuf, Option<Ts>, Option<Ts>)> {
        let mut out = Vec::new();
        for (&ino, n) in &self.inodes {
            if n.atime.is_none() && n.mtime.is_none() {
                continue;
            }
            for l in 0..n.links.len().max(1) {
                out.push((self.path_of(ino, l), n.atime, n.mtime));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Comparison

/// Sets `link_group` of every non-directory entry whose (`dev`, `ino`) appears under more than
/// one path to the smallest of those paths, and clears it elsewhere, as
/// [`take`] does. For a target that builds its [`Manifest`] itself (e.g. through a library's
/// readdir and stat): fill in `dev` and `ino`, then call this.
pub fn link_groups(m: &mut Manifest) {
    let mut groups: HashMap<(u64, u64), Vec<PathBuf>> = HashMap::new();
    for (p, e) in m.entries.iter_mut() {
        e.link_group = None;
        if e.kind != Kind::Dir {
            groups.entry((e.dev, e.ino)).or_default().push(p.clone());
        }
    }
    for paths in groups.into_values().filter(|g| g.len() > 1) {
        let leader = paths.iter().min().cloned();
        for p in paths {
            if let Some(e) = m.entries.get_mut(&p) {
                e.link_group = leader.clone();
            }
        }
    }
}

/// What [`compare`] hands to [`diff`] for a target of `flavor` (times are compared separately).
pub fn compare_opts(flavor: Flavor) -> CompareOpts {
    CompareOpts {
        atime: false,
        mtime: false,
        ctime: false,
        btime: false,
        inode_numbers: false,
        subvolumes: false,
        dir_size: flavor.btrfs_dirs,
        ..CompareOpts::all()
    }
}

/// Every difference between what `model` predicts and the manifest `got` of a target ("A" is
/// the model, "B" the target), one line each; empty when they agree. See the module comment for
/// the fields compared.
pub fn compare(model: &Model, got: &Manifest) -> Vec<String> {
    let want = model.manifest();
    let opts = compare_opts(model.flavor);
    let mut out = diff(&want, got, &opts);
    let mut more = 0usize;
    let mut report = |line: String, out: &mut Vec<String>| {
        if out.len() < opts.max_report {
            out.push(line);
        } else {
            more += 1;
        }
    };
    for (path, atime, mtime) in model.known_times() {
        let Some(e) = got.get(&path) else {
            continue; // already reported as missing
        };
        if let Some(a) = atime {
            if e.atime != a {
                report(
                    format!("{}: atime: A={a} B={}", show(&path), e.atime),
                    &mut out,
                );
            }
        }
        if let Some(m) = mtime {
            if e.mtime != m {
                report(
                    format!("{}: mtime: A={m} B={}", show(&path), e.mtime),
                    &mut out,
                );
            }
        }
    }
    if more > 0 {
        out.push(format!("... and {more} more time differences"));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The generator

/// Knobs of [`generate`].
#[derive(Clone, Debug)]
pub struct Profile {
    /// Relative weight of each op kind (kinds not listed are never generated).
    pub weights: Vec<(OpKind, u32)>,
    /// New names come from a pool of this many short names 70% of the time (so that creates
    /// hit existing names and renames replace things); 0 = always fresh random names.
    pub name_pool: u32,
    /// Length range (inclusive) of fresh random names.
    pub fresh_name_len: (usize, usize),
    /// Largest file size writes, truncates and fallocates aim at, in bytes.
    pub max_file_size: u64,
    /// When the model holds more file data than this, writes become truncates that shrink.
    pub max_data_bytes: u64,
    /// Percent of ops made deliberately invalid (besides the ones that fail by chance).
    pub invalid_percent: u64,
    /// Percent of new names put in `focus_dir` (if it exists), e.g. to grow one big directory.
    pub focus_dir: Option<PathBuf>,
    pub focus_percent: u64,
    /// Deepest directory level ops create or move things to (keeps paths below PATH_MAX).
    pub max_depth: usize,
    /// Percent of links made to the non-directory that already has the most names (so one
    /// inode collects hundreds of names, and btrfs needs INODE_EXTREF items).
    pub link_hub_percent: u64,
    /// While the model has more inodes than this, ops that add a name remove one instead
    /// (create, mknod, symlink and link become unlink; mkdir becomes rmdir).
    pub max_inodes: usize,
}

impl Profile {
    /// Every op kind, a few dozen names per directory, files up to 1.5 MiB.
    pub fn mixed() -> Profile {
        use OpKind::*;
        Profile {
            weights: vec![
                (Create, 12),
                (Mkdir, 5),
                (Mknod, 2),
                (Symlink, 3),
                (Link, 4),
                (Unlink, 6),
                (Rmdir, 3),
                (Rename, 10),
                (Write, 18),
                (Truncate, 5),
                (Fallocate, 6),
                (Chmod, 3),
                (Chown, 3),
                (Utimens, 4),
                (SetXattr, 5),
                (RemoveXattr, 3),
            ],
            name_pool: 40,
            fresh_name_len: (1, 40),
            max_file_size: 1536 * 1024,
            max_data_bytes: 96 << 20,
            invalid_percent: 8,
            focus_dir: None,
            focus_percent: 0,
            max_depth: 8,
            link_hub_percent: 0,
            max_inodes: 5000,
        }
    }

    /// Grows the directory `dir` (which the caller creates): mostly creates of fresh names of
    /// 8–100 bytes there, with some links, renames, unlinks and symlinks.
    pub fn big_dir(dir: &Path) -> Profile {
        use OpKind::*;
        Profile {
            weights: vec![
                (Create, 70),
                (Mkdir, 2),
                (Mknod, 2),
                (Symlink, 5),
                (Link, 6),
                (Unlink, 5),
                (Rename, 8),
                (Write, 3),
                (SetXattr, 2),
                (Utimens, 1),
            ],
            name_pool: 0,
            fresh_name_len: (8, 100),
            focus_dir: Some(dir.to_path_buf()),
            focus_percent: 95,
            invalid_percent: 3,
            ..Profile::mixed()
        }
    }

    /// Hard links with long names (150–255 bytes), 90% of them in `dir` and most of them to one
    /// hub inode, with unlinks and renames among them.
    pub fn hardlinks(dir: &Path) -> Profile {
        use OpKind::*;
        Profile {
            weights: vec![
                (Create, 5),
                (Link, 60),
                (Unlink, 10),
                (Rename, 10),
                (Write, 4),
                (Chown, 2),
                (Utimens, 3),
                (SetXattr, 3),
            ],
            name_pool: 0,
            fresh_name_len: (150, NAME_MAX),
            focus_dir: Some(dir.to_path_buf()),
            focus_percent: 90,
            invalid_percent: 3,
            link_hub_percent: 80,
            ..Profile::mixed()
        }
    }
}

const XATTR_NAMES: &[&[u8]] = &[
    b"user.a",
    b"user.b",
    b"user.comment",
    b"user.a_rather_long_attribute_name_so_that_items_differ_in_size_0123456789",
    b"trusted.t",
    b"trusted.overlay.opaque",
];

const MODES: &[u32] = &[
    0o644, 0o600, 0o755, 0o777, 0o000, 0o4755, 0o2755, 0o1777, 0o6711, 0o2644, 0o440, 0o7777,
];

const IDS: &[u32] = &[0, 1, 100, 1000, 65534, 65536, 2_147_483_653, 3_000_000_000];

/// Longest relative path [`generate`] produces, in bytes.
pub const MAX_PATH: usize = 3000;

/// One op for the current state of `model`.
pub fn generate(rng: &mut Rng, model: &Model, p: &Profile) -> Op {
    let total: u64 = p.weights.iter().map(|w| w.1 as u64).sum();
    assert!(total > 0, "profile has no weights");
    loop {
        let mut x = rng.below(total);
        let mut kind = p.weights[0].0;
        for (k, w) in &p.weights {
            if x < *w as u64 {
                kind = *k;
                break;
            }
            x -= *w as u64;
        }
        if model.inode_count() > p.max_inodes {
            kind = match kind {
                OpKind::Create | OpKind::Mknod | OpKind::Symlink | OpKind::Link => OpKind::Unlink,
                OpKind::Mkdir => OpKind::Rmdir,
                k => k,
            };
        }
        if let Some(op) = (Gen { rng, m: model, p }).op(kind) {
            // Far below PATH_MAX, whatever directory the target prefixes.
            if op.paths().iter().all(|x| x.as_os_str().len() < MAX_PATH) {
                return op;
            }
        }
    }
}

struct Gen<'a> {
    rng: &'a mut Rng,
    m: &'a Model,
    p: &'a Profile,
}

impl Gen<'_> {
    fn bad(&mut self) -> bool {
        self.rng.chance(self.p.invalid_percent, 100)
    }

    fn new_name(&mut self) -> Vec<u8> {
        let r = &mut *self.rng;
        if self.p.name_pool > 0 && r.chance(7, 10) {
            let k = r.below(self.p.name_pool as u64);
            return match k % 4 {
                0 => format!("f{k}"),
                1 => format!("file-{k}.txt"),
                2 => format!("d{k}"),
                _ => format!("n\u{e4}me-{k}"),
            }
            .into_bytes();
        }
        if r.chance(1, 100) {
            return r.name_between(200, NAME_MAX).into_bytes();
        }
        let (lo, hi) = self.p.fresh_name_len;
        r.name_between(lo, hi).into_bytes()
    }

    /// The focus directory's inode, if it exists. Renames leave it alone, so it stays put.
    fn focus(&self) -> Option<u64> {
        let i = self.m.resolve(self.p.focus_dir.as_deref()?).ok()?;
        self.m.node(i).is_dir().then_some(i)
    }

    /// A directory to put a new name in.
    fn dir(&mut self) -> u64 {
        if let Some(f) = self.focus() {
            if self.rng.chance(self.p.focus_percent, 100) {
                return f;
            }
        }
        let d = self.m.dirs.pick(self.rng).unwrap_or(ROOT);
        if self.m.depth(d) >= self.p.max_depth {
            ROOT
        } else {
            d
        }
    }

    fn join(&self, dir: u64, name: &[u8]) -> PathBuf {
        self.m.path_of(dir, 0).join(OsStr::from_bytes(name))
    }

    /// A random name of `ino`.
    fn path(&mut self, ino: u64) -> PathBuf {
        let n = self.m.node(ino).links.len();
        let l = self.rng.below(n as u64) as usize;
        self.m.path_of(ino, l)
    }

    /// An inode satisfying `pred`, from directories or from the others.
    fn pick(&mut self, dirs: bool, pred: impl Fn(u64, &Inode) -> bool) -> Option<u64> {
        let set = if dirs { &self.m.dirs } else { &self.m.others };
        for _ in 0..24 {
            let i = set.pick(self.rng)?;
            if pred(i, self.m.node(i)) {
                return Some(i);
            }
        }
        let all: Vec<u64> = set
            .v
            .iter()
            .copied()
            .filter(|i| pred(*i, self.m.node(*i)))
            .collect();
        if all.is_empty() {
            None
        } else {
            Some(*self.rng.pick(&all))
        }
    }

    fn existing_nondir(&mut self, kind: Option<Kind>) -> Option<PathBuf> {
        let i = self.pick(false, |_, n| kind.is_none_or(|k| n.kind == k))?;
        Some(self.path(i))
    }

    /// Any existing path except the root.
    fn existing_any(&mut self) -> Option<PathBuf> {
        let dirs = self.rng.chance(1, 4);
        let i = self
            .pick(dirs, |i, _| i != ROOT)
            .or_else(|| self.pick(!dirs, |i, _| i != ROOT))?;
        Some(self.path(i))
    }

    /// A path that does not exist, for one of three reasons.
    fn missing(&mut self) -> PathBuf {
        match self.rng.below(3) {
            0 => {
                let d = self.dir();
                let name = format!("missing-{}", self.rng.below(1000));
                self.join(d, name.as_bytes())
            }
            1 => PathBuf::from(format!("no-such-dir-{}/x", self.rng.below(10))),
            _ => match self.pick(false, |_, n| n.kind != Kind::Symlink) {
                // under a non-directory (ENOTDIR)
                Some(i) => self.path(i).join("x"),
                None => PathBuf::from("no-such-dir/x"),
            },
        }
    }

    /// A path for something new: usually a free name, sometimes (`bad`) an invalid one.
    fn new_path(&mut self, allow_bad: bool) -> PathBuf {
        if allow_bad && self.bad() {
            match self.rng.below(3) {
                0 => {
                    if let Some(p) = self.existing_any() {
                        return p;
                    }
                }
                1 => {
                    let d = self.dir();
                    let long = self.rng.name(NAME_MAX + 1);
                    return self.join(d, long.as_bytes());
                }
                _ => return self.missing(),
            }
        }
        let d = self.dir();
        let name = self.new_name();
        self.join(d, &name)
    }

    fn mode(&mut self) -> u32 {
        if self.rng.chance(1, 5) {
            self.rng.below(0o10000) as u32
        } else {
            *self.rng.pick(MODES)
        }
    }

    fn time(&mut self) -> Ts {
        let r = &mut *self.rng;
        match r.below(6) {
            0 => Ts { sec: 0, nsec: 0 },
            1 => Ts {
                sec: -(r.range(1, 1 << 31) as i64),
                nsec: r.below(1_000_000_000) as u32,
            },
            2 => Ts {
                sec: 4_102_444_800,
                nsec: 999_999_999,
            },
            _ => Ts {
                sec: r.range(1_000_000_000, 1_900_000_000) as i64,
                nsec: r.below(1_000_000_000) as u32,
            },
        }
    }

    /// A path for a data op: usually a regular file; `bad`: a directory, a symlink or nothing.
    fn data_path(&mut self) -> Option<PathBuf> {
        if self.bad() {
            return Some(match self.rng.below(3) {
                0 => {
                    let i = self.pick(true, |_, _| true).unwrap_or(ROOT);
                    self.path(i)
                }
                1 => self
                    .existing_nondir(Some(Kind::Symlink))
                    .unwrap_or_else(|| self.missing()),
                _ => self.missing(),
            });
        }
        self.existing_nondir(Some(Kind::File))
    }

    fn file_size(&self, path: &Path) -> u64 {
        match self.m.resolve(path) {
            Ok(i) if self.m.node(i).kind == Kind::File => self.m.node(i).data.len() as u64,
            _ => 0,
        }
    }

    fn small_len(&mut self) -> u64 {
        match self.rng.below(3) {
            0 => self.rng.range(1, 100),
            1 => self.rng.range(100, 4096),
            _ => self.rng.range(4096, 32 * 1024),
        }
    }

    fn op(&mut self, kind: OpKind) -> Option<Op> {
        let max = self.p.max_file_size;
        Some(match kind {
            OpKind::Create => Op::Create {
                path: self.new_path(true),
                mode: self.mode(),
            },
            OpKind::Mkdir => Op::Mkdir {
                path: self.new_path(true),
                mode: self.mode(),
            },
            OpKind::Mknod => {
                let kind = *self.rng.pick(&[
                    NodeKind::Fifo,
                    NodeKind::Socket,
                    NodeKind::CharDev,
                    NodeKind::BlockDev,
                ]);
                let rdev = match self.rng.below(3) {
                    0 => (1, 3),
                    1 => (8, 17),
                    _ => (self.rng.below(4096) as u32, self.rng.below(1 << 20) as u32),
                };
                Op::Mknod {
                    path: self.new_path(true),
                    kind,
                    mode: self.mode(),
                    rdev,
                }
            }
            OpKind::Symlink => {
                let target = match self.rng.below(6) {
                    0 => self.new_name(),
                    1 => [b"../".as_slice(), &self.new_name()].concat(),
                    2 => b"/nonexistent/absolute/target".to_vec(),
                    3 => {
                        let n = self.rng.range(200, 1000) as usize;
                        let mut t = self.rng.name(n).into_bytes();
                        for i in (10..t.len()).step_by(37) {
                            t[i] = b'/';
                        }
                        t
                    }
                    4 if self.bad() => Vec::new(),
                    _ => self.rng.name_between(1, 30).into_bytes(),
                };
                Op::Symlink {
                    path: self.new_path(true),
                    target,
                }
            }
            OpKind::Link => {
                let from =
                    if self.bad() {
                        if self.rng.chance(1, 2) {
                            let i = self.pick(true, |_, _| true).unwrap_or(ROOT);
                            if i == ROOT {
                                self.missing()
                            } else {
                                self.path(i)
                            }
                        } else {
                            self.missing()
                        }
                    } else if self.rng.chance(self.p.link_hub_percent, 100) {
                        let hub =
                            self.m.others.v.iter().copied().max_by_key(|i| {
                                (self.m.node(*i).links.len(), std::cmp::Reverse(*i))
                            })?;
                        self.path(hub)
                    } else {
                        self.existing_nondir(None)?
                    };
                Op::Link {
                    from,
                    to: self.new_path(true),
                }
            }
            OpKind::Unlink => {
                let path = if self.bad() {
                    match self.rng.below(2) {
                        0 => {
                            let i = self.pick(true, |i, _| i != ROOT)?;
                            self.path(i)
                        }
                        _ => self.missing(),
                    }
                } else {
                    self.existing_nondir(None)?
                };
                Op::Unlink { path }
            }
            OpKind::Rmdir => {
                let path = if self.bad() {
                    match self.rng.below(2) {
                        0 => self.existing_nondir(None)?,
                        _ => self.missing(),
                    }
                } else {
                    // Prefer empty directories, so that rmdir mostly succeeds.
                    let empty = self.rng.chance(3, 4);
                    let i =
                        self.pick(true, |i, n| i != ROOT && (!empty || n.entries.is_empty()))?;
                    self.path(i)
                };
                Op::Rmdir { path }
            }
            OpKind::Rename => self.rename()?,
            OpKind::Write => {
                if self.m.data_bytes > self.p.max_data_bytes {
                    let path = self.existing_nondir(Some(Kind::File))?;
                    let size = self.file_size(&path) / 4;
                    return Some(Op::Truncate { path, size });
                }
                let path = self.data_path()?;
                let size = self.file_size(&path);
                let r = &mut *self.rng;
                let (mut off, mut len) = match r.below(10) {
                    0 | 1 => (size, 0),
                    2 => (0, r.range(1, 2048)),
                    3 => (r.range(0, 2100), r.range(1, 4200)),
                    4 | 5 if size > 0 => {
                        let o = r.below(size);
                        (o, r.range(1, (size - o).clamp(1, 64 * 1024)))
                    }
                    6 => (r.below(max / 2), r.range(64 * 1024, 300 * 1024)),
                    7 => (size + r.range(1, 256 * 1024), 0),
                    8 => (r.below(size + 1) & !4095, 4096 * r.range(1, 16)),
                    _ => (r.below(size + 1), if r.chance(1, 4) { 0 } else { 1 }),
                };
                if len == 0 && !self.rng.chance(1, 10) {
                    len = self.small_len();
                }
                off = off.min(max);
                len = len.min(max - off);
                Op::Write {
                    path,
                    offset: off,
                    len,
                    seed: self.rng.next_u64(),
                }
            }
            OpKind::Truncate => {
                let path = self.data_path()?;
                let size = self.file_size(&path);
                let r = &mut *self.rng;
                let new = match r.below(10) {
                    0 => 0,
                    1..=3 => r.below(size + 1),
                    4..=6 => r.range(size, max),
                    7 | 8 => *r.pick(&[1, 2047, 2048, 2049, 4095, 4096, 4097, 65536]),
                    _ => size,
                };
                Op::Truncate { path, size: new }
            }
            OpKind::Fallocate => {
                let path = self.data_path()?;
                let size = self.file_size(&path);
                let mode = if self.bad() {
                    *self.rng.pick(&[
                        FALLOC_PUNCH_HOLE,
                        FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE | FALLOC_KEEP_SIZE,
                    ])
                } else {
                    *self.rng.pick(&[
                        0,
                        0,
                        0,
                        FALLOC_KEEP_SIZE,
                        FALLOC_KEEP_SIZE,
                        FALLOC_PUNCH_HOLE | FALLOC_KEEP_SIZE,
                        FALLOC_PUNCH_HOLE | FALLOC_KEEP_SIZE,
                        FALLOC_PUNCH_HOLE | FALLOC_KEEP_SIZE,
                        FALLOC_ZERO_RANGE,
                        FALLOC_ZERO_RANGE | FALLOC_KEEP_SIZE,
                    ])
                };
                let r = &mut *self.rng;
                let off = match r.below(5) {
                    0 => 0,
                    1 | 2 => r.below(size + 1),
                    3 => r.below(size + 1) & !4095,
                    _ => size + r.below(128 * 1024),
                }
                .min(max - 1);
                let len = if r.chance(1, 30) {
                    0
                } else {
                    r.range(1, 256 * 1024).min(max - off)
                };
                Op::Fallocate {
                    path,
                    mode,
                    offset: off,
                    len,
                }
            }
            OpKind::Chmod => {
                let path = if self.rng.chance(1, 30) {
                    self.existing_nondir(Some(Kind::Symlink))?
                } else {
                    self.meta_path()?
                };
                Op::Chmod {
                    path,
                    mode: self.mode(),
                }
            }
            OpKind::Chown => {
                let path = self.meta_path()?;
                let r = &mut *self.rng;
                let uid = (!r.chance(1, 6)).then(|| *r.pick(IDS));
                let gid = (!r.chance(1, 6)).then(|| *r.pick(IDS));
                Op::Chown { path, uid, gid }
            }
            OpKind::Utimens => {
                let path = self.meta_path()?;
                let atime = (!self.rng.chance(1, 7)).then(|| self.time());
                let mtime = (!self.rng.chance(1, 7)).then(|| self.time());
                Op::Utimens { path, atime, mtime }
            }
            OpKind::SetXattr => {
                // A third of the time a name the inode has (replace, or EEXIST with CREATE).
                let dirs = self.rng.chance(1, 4);
                let with = self.pick(dirs, |_, n| !n.xattrs.is_empty());
                let (path, name) = match with {
                    Some(i) if self.rng.chance(1, 3) => {
                        let names: Vec<&Vec<u8>> = self.m.node(i).xattrs.keys().collect();
                        let name = (*self.rng.pick(&names)).clone();
                        (self.path(i), name)
                    }
                    _ => (self.meta_path()?, self.rng.pick(XATTR_NAMES).to_vec()),
                };
                let r = &mut *self.rng;
                let value = match r.below(20) {
                    0 => Vec::new(),
                    1..=12 => r.random_bytes_between(1, 64),
                    _ => r.random_bytes_between(64, 1024),
                };
                let how = match r.below(10) {
                    0 | 1 => XattrHow::Create,
                    2 | 3 => XattrHow::Replace,
                    _ => XattrHow::Either,
                };
                Op::SetXattr {
                    path,
                    name,
                    value,
                    how,
                }
            }
            OpKind::RemoveXattr => {
                // Prefer an inode that has xattrs, and one of its names.
                let dirs = self.rng.chance(1, 4);
                let with = self.pick(dirs, |_, n| !n.xattrs.is_empty());
                let (path, name) = match with {
                    Some(i) if !self.rng.chance(1, 5) => {
                        let names: Vec<&Vec<u8>> = self.m.node(i).xattrs.keys().collect();
                        let name = (*self.rng.pick(&names)).clone();
                        (self.path(i), name)
                    }
                    _ => (self.meta_path()?, self.rng.pick(XATTR_NAMES).to_vec()),
                };
                Op::RemoveXattr { path, name }
            }
        })
    }

    /// A path for a metadata op: anything, the root now and then, rarely a missing path.
    fn meta_path(&mut self) -> Option<PathBuf> {
        if self.rng.chance(1, 40) {
            return Some(PathBuf::new());
        }
        if self.bad() && self.rng.chance(1, 2) {
            return Some(self.missing());
        }
        self.existing_any()
    }

    fn rename(&mut self) -> Option<Op> {
        let how = match self.rng.below(10) {
            0 | 1 => RenameHow::NoReplace,
            2 | 3 => RenameHow::Exchange,
            _ => RenameHow::Plain,
        };
        if self.bad() && self.rng.chance(1, 2) {
            let to = self.new_path(false);
            return Some(Op::Rename {
                from: self.missing(),
                to,
                how,
            });
        }
        let from_dir = self.rng.chance(1, 4);
        let focus = self.focus();
        let movable = |i: u64, _: &Inode| i != ROOT && Some(i) != focus;
        let src = self
            .pick(from_dir, movable)
            .or_else(|| self.pick(!from_dir, movable))?;
        let from = self.path(src);
        let src_is_dir = self.m.node(src).is_dir();
        // Where it goes: (directory, name).
        let (dir, name) = match self.rng.below(10) {
            0..=3 => (self.dir(), self.new_name()),
            4..=6 => match self
                .existing_any()
                .filter(|p| focus.is_none() || self.m.resolve(p).ok() != focus)
            {
                Some(p) => {
                    let i = self.m.resolve(&p).ok()?;
                    let l = &self.m.node(i).links;
                    let (d, n) = l
                        .iter()
                        .find(|(d, n)| self.join(*d, n) == p)
                        .cloned()
                        .unwrap_or_else(|| l[0].clone());
                    (d, n)
                }
                None => (self.dir(), self.new_name()),
            },
            7 | 8 => {
                let l = &self.m.node(src).links;
                let d = l[self.rng.below(l.len() as u64) as usize].0;
                (d, self.new_name())
            }
            _ => {
                // Into its own subtree when it is a directory (EINVAL), or next to it.
                let d = if src_is_dir {
                    self.pick(true, |i, _| self.m.is_ancestor_or_self(src, i))
                        .unwrap_or(src)
                } else {
                    self.m.node(src).links[0].0
                };
                (d, self.new_name())
            }
        };
        let mut dir = dir;
        if src_is_dir && self.m.depth(dir) + 1 + self.m.height(src) > self.p.max_depth + 2 {
            dir = ROOT;
        }
        Some(Op::Rename {
            from,
            to: self.join(dir, &name),
            how,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The runner

/// Applies generated ops to a [`Model`] and to every target, checks that each target returns
/// what the model predicts, and compares the trees at checkpoints. Any disagreement panics
/// with the seed, the op index, the op, the recent ops and the differences.
///
/// Environment: `BUTTER_MODEL_TRACE` set prints every op and its result to stderr.
pub struct Runner {
    seed: u64,
    pub model: Model,
    targets: Vec<Box<dyn Target>>,
    rng: Rng,
    ops: u64,
    recent: VecDeque<String>,
    stats: BTreeMap<(OpKind, String), u64>,
    trace: bool,
    started: Instant,
}

const RECENT: usize = 25;

impl Runner {
    pub fn new(seed: u64, flavor: Flavor, targets: Vec<Box<dyn Target>>) -> Runner {
        Runner {
            seed,
            model: Model::new(flavor),
            targets,
            rng: Rng::new(seed),
            ops: 0,
            recent: VecDeque::new(),
            stats: BTreeMap::new(),
            trace: std::env::var_os("BUTTER_MODEL_TRACE").is_some(),
            started: Instant::now(),
        }
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A runner that carries on from `model` (e.g. a clone taken when a snapshot was made).
    pub fn with_model(seed: u64, model: Model, targets: Vec<Box<dyn Target>>) -> Runner {
        let mut r = Runner::new(seed, model.flavor(), targets);
        r.model = model;
        r
    }

    /// Replaces the targets (dropping the old ones), e.g. to hand an image from butter to a
    /// kernel mount between rounds; the model carries on.
    pub fn set_targets(&mut self, targets: Vec<Box<dyn Target>>) {
        self.targets = targets;
    }

    /// Ops applied so far.
    pub fn ops(&self) -> u64 {
        self.ops
    }

    /// Generates one op with `profile` and applies it everywhere.
    pub fn step(&mut self, profile: &Profile) -> Result<(), i32> {
        let op = generate(&mut self.rng, &self.model, profile);
        self.apply(&op)
    }

    /// `n` generated ops.
    pub fn run(&mut self, profile: &Profile, n: u64) {
        for _ in 0..n {
            self.step(profile).ok();
        }
    }

    /// Applies `op` to the model and every target; panics unless all results agree.
    pub fn apply(&mut self, op: &Op) -> Result<(), i32> {
        let index = self.ops;
        self.ops += 1;
        let want = self.model.apply(op);
        let line = format!("#{index} {op} => {}", show_result(&want));
        if self.trace {
            eprintln!("{line}");
        }
        for i in 0..self.targets.len() {
            let mut got = self.targets[i].apply(op);
            if got == Err(libc::ENOSPC)
                && want.is_ok()
                && matches!(
                    op,
                    Op::Write { .. } | Op::Truncate { .. } | Op::Fallocate { .. }
                )
            {
                // Kernel btrfs refuses space that only its next commit frees (extents freed in
                // the running transaction stay pinned till then), more often on a loaded
                // machine: after a commit, once more (these ops are idempotent).
                self.targets[i].settle();
                got = self.targets[i].apply(op);
            }
            if got != want {
                panic!(
                    "{}model test failed: {} returned {} but the model predicts {}\n  op #{index}: {op}",
                    self.header(),
                    self.targets[i].name(),
                    show_result(&got),
                    show_result(&want),
                );
            }
        }
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(line);
        *self
            .stats
            .entry((op.kind(), show_result(&want)))
            .or_default() += 1;
        want
    }

    fn header(&self) -> String {
        format!(
            "seed {:#x}, after {} ops ({:.1} s); model: {}\nlast ops:\n  {}\n",
            self.seed,
            self.ops,
            self.started.elapsed().as_secs_f64(),
            self.model.summary(),
            self.recent.iter().cloned().collect::<Vec<_>>().join("\n  ")
        )
    }

    /// Checkpoints every target and compares its tree with the model's; panics with the
    /// differences otherwise. `label` names the point in the test ("round 2").
    pub fn checkpoint(&mut self, label: &str) {
        for i in 0..self.targets.len() {
            let got = match self.targets[i].checkpoint() {
                Ok(m) => m,
                Err(e) => panic!(
                    "{}checkpoint {label}: {} failed: {e}",
                    self.header(),
                    self.targets[i].name()
                ),
            };
            let mut d = compare(&self.model, &got);
            for line in d.clone() {
                // Where contents differ, say which byte ranges.
                let Some(p) = line
                    .split_once(": content differs")
                    .map(|(p, _)| p.trim_matches('"').to_string())
                else {
                    continue;
                };
                let path = std::path::PathBuf::from(&p);
                if let (Some(want), Some(have)) = (
                    self.model.file_data(&path),
                    self.targets[i].read_file(&path),
                ) {
                    let mut ranges = Vec::new();
                    let mut k = 0;
                    let n = want.len().max(have.len());
                    while k < n && ranges.len() < 8 {
                        if want.get(k) != have.get(k) {
                            let s0 = k;
                            while k < n && want.get(k) != have.get(k) {
                                k += 1;
                            }
                            ranges.push(format!("{s0}..{k}"));
                        }
                        k += 1;
                    }
                    d.push(format!("  {p}: bytes differ at {}", ranges.join(", ")));
                }
            }
            if !d.is_empty() {
                panic!(
                    "{}checkpoint {label}: {} differs from the model (A = model, B = target: {}):\n{}",
                    self.header(),
                    self.targets[i].name(),
                    got.summary(),
                    d.join("\n")
                );
            }
        }
    }

    /// How many ops of each kind gave each result, one line per kind.
    pub fn stats(&self) -> String {
        let mut lines: BTreeMap<OpKind, Vec<String>> = BTreeMap::new();
        for ((k, r), n) in &self.stats {
            lines.entry(*k).or_default().push(format!("{r} {n}"));
        }
        lines
            .into_iter()
            .map(|(k, v)| format!("{k:?}: {}", v.join(", ")))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every (op kind, result) seen, results as [`errno_name`] or "Ok".
    pub fn outcomes(&self) -> BTreeSet<(OpKind, String)> {
        self.stats.keys().cloned().collect()
    }
}
