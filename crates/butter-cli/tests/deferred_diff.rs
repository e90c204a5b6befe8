//! The mount's differential operations test (issue 29, items 2 and 5): butter keeps some
//! changes in memory and applies them later (delayed allocation of appends, delayed
//! preallocation, compressed write-back, ordered extents, large writes on the bulk lanes). Any
//! sequence of operations must leave what applying each change at once leaves, whether or not
//! anything looks at the file in between.
//!
//! Seeded random sequences of file operations run at the same time on a `butter mount`
//! directory and on a reference directory (ext4 on a loop device: tmpfs has no
//! FALLOC_FL_ZERO_RANGE), the same fd-level sequence on both, through raw libc calls: open
//! (O_CREAT, sometimes O_TRUNC or O_APPEND) into a small table of fd slots, close, pwrite
//! (small ones at offset 0 for inline files, sector-aligned and unaligned appends, overwrites,
//! 4 KiB..1 MiB large writes), write through the fd's position (after an lseek(SEEK_SET)),
//! O_DIRECT writes (an aligned buffer, 4 KiB multiples, through their own fd), truncate and
//! ftruncate up and down, fallocate (0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE,
//! ZERO_RANGE|KEEP_SIZE), copy_file_range, FICLONERANGE (both sides answer EOPNOTSUPP through
//! FUSE and on ext4; then the same range goes through copy_file_range, counted as a clone
//! fallback), writes through a shared mapping with msync(MS_SYNC) (in a child that shares the
//! fd table, so a SIGBUS is a reported difference, not a dead test), rename (also over an
//! existing, maybe open, file), link, unlink (of open files too, written on through the fd),
//! fsync, fdatasync, fsync of a directory, setxattr/fsetxattr/removexattr, chmod (set-id
//! bits too) and pwrites by another user (uid 1000, which clear those bits).
//!
//! Now and then a stream of appends runs past the 4 MiB a file gathers in memory (so full
//! buffers go to the write-back thread while the next ones start behind them), then one
//! change meets it: an overwrite or punch inside it, a truncate into it, a copy out of it, or
//! an fsync. Every option set that writes buffers back that way must show it did (the mount's
//! log at unmount); the `cache_size=1M` set also looks up 3,000 files of its own all along,
//! so the mount keeps asking the kernel to drop inodes (crate::fuse::prune), the sequences'
//! files among them, and must show that it asked.
//!
//! Mode "blind": nothing looks at butter's files between the operations (the generator reads
//! sizes from the reference side only). Mode "looking": a quarter of the operations are looks
//! (pread compared byte for byte, fstat/stat, SEEK_DATA/SEEK_HOLE, getxattr).
//!
//! Each operation's return value and errno must be the same on both sides. At the end of a
//! sequence: the open fds' sizes and contents (also of unlinked files) are compared, every fd
//! is closed, then the whole directory: names, types, sizes, contents, link counts and hard
//! link groups, modes, xattrs; and the layout SEEK_DATA/SEEK_HOLE reports: no byte that is not
//! zero may be in a reported hole, and every 4 KiB block the model says must be a hole (never
//! written, fully punched, or cut off by a truncate, and not written or allocated since) must
//! be reported as a hole by butter (the reference's own disagreements with the model are
//! counted as model warnings, never failures). After all sequences of an option set: a
//! manifest of the butter mount, unmount, `butter check`, `btrfs check --readonly` and a
//! kernel mount that must show the same tree (`verify_image`).
//!
//! Option sets, one #[test] each: defaults (the kernel caches names, attributes, missing
//! names and pages long, crate::fuse::Caching), `-o nodelalloc`, `-o compress-force=zstd`,
//! `-o compress=zstd`, `-o commit=0`, `-o allocator=legacy`, `-o cache=strict`,
//! `-o nokillpriv`,
//! `-o fsync=commit` and `-o nobulk` (large writes served on the FUSE worker that took them;
//! when this butter does not know the option yet, that test prints a notice and passes).
//! Each runs [`SUITE_SEEDS`] seeds x both modes x [`SUITE_OPS`] operations.
//!
//! Environment: `BUTTER_DIFF_OPS` (operations per sequence), `BUTTER_DIFF_SEEDS` (seeds per
//! option set), `BUTTER_DIFF_SEED` (first seed), `BUTTER_DIFF_MODES` (`blind`, `looking` or
//! both, the default), `BUTTER_DIFF_MINIMIZE` (`0`: do not shrink a failing sequence;
//! otherwise a failure is shrunk for up to this many seconds, default 120). A failure names the
//! option set, seed, mode, the first difference and prints the sequence's op log and, shrunk,
//! a short sequence that still shows a difference. `BUTTER_DIFF_LOG` prints every sequence's
//! op log. `bench/deferred_diff.sh` runs it long.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs, mkfs.ext4, fusermount3.
//! Without them: a notice and a pass, or a failure under CI.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::gen::Rng;
use common::kernel::{FsType, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Kind, Manifest, TakeOpts};
use std::collections::{BTreeSet, HashMap};
use std::ffi::CString;
use std::fmt::Write as _;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SUITE_OPS: u64 = 500;
const SUITE_SEEDS: u64 = 4;
const FIRST_SEED: u64 = 29_000;
const IMAGE_SIZE: u64 = 3 << 30;
const BLK: u64 = 4096;
/// Files stay about this size or smaller (writes start below it).
const MAX_FILE: u64 = 8 << 20;
const MIB: u64 = 1 << 20;
/// fd slots per side.
const SLOTS: usize = 5;
/// Names the operations use (relative to the sequence's directory); "d" is a directory.
const NAMES: &[&str] = &["f0", "f1", "f2", "f3", "f4", "d/g0", "d/g1", "d"];
const DIR_NAME: usize = 7;
/// FICLONERANGE = _IOW(0x94, 13, struct file_clone_range).
const FICLONERANGE: u64 = 0x4020_940d;

// ---------------------------------------------------------------------------------------------
// Operations

/// How a write's bytes are made: from a seed, so a logged op replays exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fill {
    Random,
    Text,
    Zeros,
}

#[derive(Clone, Debug)]
enum Op {
    Open {
        slot: usize,
        name: usize,
        trunc: bool,
        append: bool,
    },
    Close {
        slot: usize,
    },
    Pwrite {
        slot: usize,
        off: u64,
        len: u64,
        fill: Fill,
        seed: u64,
    },
    /// A pwrite through the fd by another user (uid and gid 1000, no capabilities): the
    /// set-id bits of the file go as the kernel's VFS clears them.
    UserPwrite {
        slot: usize,
        off: u64,
        len: u64,
        seed: u64,
    },
    /// lseek(SEEK_SET) when `seek`, then write(2) at the fd's position.
    Write {
        slot: usize,
        seek: Option<u64>,
        len: u64,
        fill: Fill,
        seed: u64,
    },
    /// open(name, O_RDWR|O_CREAT|O_DIRECT), pwrite, close.
    DioWrite {
        name: usize,
        off: u64,
        len: u64,
        seed: u64,
    },
    Truncate {
        name: usize,
        size: u64,
    },
    Ftruncate {
        slot: usize,
        size: u64,
    },
    Fallocate {
        slot: usize,
        mode: i32,
        off: u64,
        len: u64,
    },
    Copy {
        src: usize,
        dst: usize,
        soff: u64,
        doff: u64,
        len: u64,
    },
    Clone {
        src: usize,
        dst: usize,
        soff: u64,
        doff: u64,
        len: u64,
    },
    /// A write through a MAP_SHARED mapping, msync(MS_SYNC), munmap.
    MmapWrite {
        slot: usize,
        off: u64,
        len: u64,
        seed: u64,
    },
    Rename {
        from: usize,
        to: usize,
    },
    Link {
        from: usize,
        to: usize,
    },
    Unlink {
        name: usize,
    },
    Fsync {
        slot: usize,
    },
    Fdatasync {
        slot: usize,
    },
    /// fsync of the sequence's directory (false) or of "d" (true).
    FsyncDir {
        sub: bool,
    },
    SetXattr {
        name: usize,
        key: u8,
        vlen: u64,
        seed: u64,
        flags: i32,
    },
    FSetXattr {
        slot: usize,
        key: u8,
        vlen: u64,
        seed: u64,
    },
    RemoveXattr {
        name: usize,
        key: u8,
    },
    Chmod {
        name: usize,
        mode: u32,
    },
    // Looks (mode "looking" only).
    Pread {
        slot: usize,
        off: u64,
        len: u64,
    },
    Fstat {
        slot: usize,
    },
    Stat {
        name: usize,
    },
    Seek {
        slot: usize,
        data: bool,
        off: u64,
    },
    GetXattr {
        name: usize,
        key: u8,
    },
}

fn fmode(mode: i32) -> String {
    let mut s = Vec::new();
    if mode == 0 {
        s.push("0");
    }
    if mode & libc::FALLOC_FL_KEEP_SIZE != 0 {
        s.push("KEEP_SIZE");
    }
    if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 {
        s.push("PUNCH_HOLE");
    }
    if mode & libc::FALLOC_FL_ZERO_RANGE != 0 {
        s.push("ZERO_RANGE");
    }
    s.join("|")
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |i: &usize| NAMES[*i];
        match self {
            Op::Open {
                slot,
                name,
                trunc,
                append,
            } => write!(
                f,
                "fd{slot} = open({}, O_RDWR|O_CREAT{}{})",
                n(name),
                if *trunc { "|O_TRUNC" } else { "" },
                if *append { "|O_APPEND" } else { "" }
            ),
            Op::Close { slot } => write!(f, "close(fd{slot})"),
            Op::Pwrite {
                slot,
                off,
                len,
                fill,
                seed,
            } => write!(f, "pwrite(fd{slot}, {len} {fill:?} bytes #{seed}, {off})"),
            Op::Write {
                slot,
                seek,
                len,
                fill,
                seed,
            } => match seek {
                Some(s) => write!(
                    f,
                    "lseek(fd{slot}, {s}, SEEK_SET); write(fd{slot}, {len} {fill:?} bytes #{seed})"
                ),
                None => write!(f, "write(fd{slot}, {len} {fill:?} bytes #{seed})"),
            },
            Op::UserPwrite {
                slot,
                off,
                len,
                seed,
            } => write!(
                f,
                "as uid 1000: pwrite(fd{slot}, {len} Random bytes #{seed}, {off})"
            ),
            Op::DioWrite {
                name,
                off,
                len,
                seed,
            } => write!(
                f,
                "O_DIRECT: open({}, O_RDWR|O_CREAT|O_DIRECT); pwrite({len} Random bytes #{seed}, {off}); close",
                n(name)
            ),
            Op::Truncate { name, size } => write!(f, "truncate({}, {size})", n(name)),
            Op::Ftruncate { slot, size } => write!(f, "ftruncate(fd{slot}, {size})"),
            Op::Fallocate {
                slot,
                mode,
                off,
                len,
            } => write!(f, "fallocate(fd{slot}, {}, {off}, {len})", fmode(*mode)),
            Op::Copy {
                src,
                dst,
                soff,
                doff,
                len,
            } => write!(
                f,
                "copy_file_range(fd{src}@{soff} -> fd{dst}@{doff}, {len}) (looped)"
            ),
            Op::Clone {
                src,
                dst,
                soff,
                doff,
                len,
            } => write!(f, "FICLONERANGE(fd{src}@{soff} -> fd{dst}@{doff}, {len})"),
            Op::MmapWrite {
                slot,
                off,
                len,
                seed,
            } => write!(
                f,
                "mmap(fd{slot}) write {len} Random bytes #{seed} at {off}; msync(MS_SYNC)"
            ),
            Op::Rename { from, to } => write!(f, "rename({}, {})", n(from), n(to)),
            Op::Link { from, to } => write!(f, "link({}, {})", n(from), n(to)),
            Op::Unlink { name } => write!(f, "unlink({})", n(name)),
            Op::Fsync { slot } => write!(f, "fsync(fd{slot})"),
            Op::Fdatasync { slot } => write!(f, "fdatasync(fd{slot})"),
            Op::FsyncDir { sub } => write!(f, "fsync(dir {})", if *sub { "d" } else { "." }),
            Op::SetXattr {
                name,
                key,
                vlen,
                seed,
                flags,
            } => write!(
                f,
                "setxattr({}, user.x{key}, {vlen} bytes #{seed}, {})",
                n(name),
                match *flags {
                    libc::XATTR_CREATE => "XATTR_CREATE",
                    libc::XATTR_REPLACE => "XATTR_REPLACE",
                    _ => "0",
                }
            ),
            Op::FSetXattr {
                slot,
                key,
                vlen,
                seed,
            } => write!(f, "fsetxattr(fd{slot}, user.x{key}, {vlen} bytes #{seed})"),
            Op::RemoveXattr { name, key } => write!(f, "removexattr({}, user.x{key})", n(name)),
            Op::Chmod { name, mode } => write!(f, "chmod({}, {mode:o})", n(name)),
            Op::Pread { slot, off, len } => write!(f, "LOOK pread(fd{slot}, {len}, {off})"),
            Op::Fstat { slot } => write!(f, "LOOK fstat(fd{slot})"),
            Op::Stat { name } => write!(f, "LOOK stat({})", n(name)),
            Op::Seek { slot, data, off } => write!(
                f,
                "LOOK lseek(fd{slot}, {off}, {})",
                if *data { "SEEK_DATA" } else { "SEEK_HOLE" }
            ),
            Op::GetXattr { name, key } => write!(f, "LOOK getxattr({}, user.x{key})", n(name)),
        }
    }
}

fn make_data(fill: Fill, seed: u64, len: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    match fill {
        Fill::Random => rng.random_bytes(len as usize),
        Fill::Text => rng.text_bytes(len as usize),
        Fill::Zeros => vec![0u8; len as usize],
    }
}

// ---------------------------------------------------------------------------------------------
// One side: a directory and its fd table

/// What one operation gave: return value (or -1), errno (0 on success) and data (read bytes,
/// stat fields, xattr values).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Res {
    ret: i64,
    err: i32,
    data: Vec<u8>,
}

impl Res {
    fn ok(ret: i64) -> Res {
        Res {
            ret,
            err: 0,
            data: Vec::new(),
        }
    }
    fn errno(err: i32) -> Res {
        Res {
            ret: -1,
            err,
            data: Vec::new(),
        }
    }
    /// From a syscall's return value (errno read right away).
    fn of(r: i64) -> Res {
        if r < 0 {
            Res::errno(last_errno())
        } else {
            Res::ok(r)
        }
    }
}

impl std::fmt::Display for Res {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.err != 0 {
            write!(f, "{}", errno_name(self.err))?;
        } else {
            write!(f, "{}", self.ret)?;
        }
        if !self.data.is_empty() {
            write!(f, " [{} data bytes]", self.data.len())?;
        }
        Ok(())
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn errno_name(e: i32) -> String {
    let known = [
        (libc::ENOENT, "ENOENT"),
        (libc::EBADF, "EBADF"),
        (libc::EEXIST, "EEXIST"),
        (libc::EINVAL, "EINVAL"),
        (libc::EISDIR, "EISDIR"),
        (libc::ENOTDIR, "ENOTDIR"),
        (libc::ENODATA, "ENODATA"),
        (libc::EOPNOTSUPP, "EOPNOTSUPP"),
        (libc::EXDEV, "EXDEV"),
        (libc::ENXIO, "ENXIO"),
        (libc::EPERM, "EPERM"),
        (libc::EACCES, "EACCES"),
        (libc::EIO, "EIO"),
        (libc::ENOSPC, "ENOSPC"),
        (libc::EFBIG, "EFBIG"),
        (libc::ENOTEMPTY, "ENOTEMPTY"),
        (libc::ENOTTY, "ENOTTY"),
        (libc::EROFS, "EROFS"),
    ];
    match known.iter().find(|(n, _)| *n == e) {
        Some((_, s)) => s.to_string(),
        None if e >= 1000 => format!("signal {}", e - 1000),
        None => format!("errno {e}"),
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path has no NUL")
}

struct StatInfo {
    ino: u64,
    size: u64,
    nlink: u64,
    mode: u32,
}

fn stat_of(st: &libc::stat) -> StatInfo {
    StatInfo {
        ino: st.st_ino,
        size: st.st_size as u64,
        nlink: st.st_nlink,
        mode: st.st_mode,
    }
}

fn fstat(fd: i32) -> Option<StatInfo> {
    if fd < 0 {
        return None;
    }
    // SAFETY: plain old data, zeroes are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then(|| stat_of(&st))
}

fn lstat(p: &Path) -> Option<StatInfo> {
    let c = cpath(p);
    // SAFETY: plain old data, zeroes are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    (unsafe { libc::lstat(c.as_ptr(), &mut st) } == 0).then(|| stat_of(&st))
}

fn stat_bytes(s: &StatInfo) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&s.size.to_le_bytes());
    v.extend_from_slice(&s.nlink.to_le_bytes());
    v.extend_from_slice(&s.mode.to_le_bytes());
    v
}

fn show_stat_bytes(d: &[u8]) -> String {
    if d.len() != 20 {
        return format!("{d:?}");
    }
    let size = u64::from_le_bytes(d[0..8].try_into().unwrap());
    let nlink = u64::from_le_bytes(d[8..16].try_into().unwrap());
    let mode = u32::from_le_bytes(d[16..20].try_into().unwrap());
    format!("size {size} nlink {nlink} mode {mode:o}")
}

/// pread of up to `len` bytes at `off` (looping over short reads, stopping at EOF).
fn pread_all(fd: i32, off: u64, len: u64) -> Result<Vec<u8>, i32> {
    let mut out = vec![0u8; len as usize];
    let mut got = 0usize;
    while got < out.len() {
        // SAFETY: the buffer is valid for the remaining length.
        let r = unsafe {
            libc::pread(
                fd,
                out[got..].as_mut_ptr().cast(),
                out.len() - got,
                (off + got as u64) as i64,
            )
        };
        if r < 0 {
            return Err(last_errno());
        }
        if r == 0 {
            break;
        }
        got += r as usize;
    }
    out.truncate(got);
    Ok(out)
}

/// Runs `f` in a child that shares this process's fd table (so its exit closes nothing and
/// sends no FUSE flush) but not its memory; `f` returns the exit code (an errno or 0). A
/// child killed by a signal gives 1000 + the signal. `f` must not allocate or take locks.
fn in_child(f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: a raw clone without CLONE_VM is a fork that shares the fd table; the child
    // only makes raw syscalls on memory prepared before and then _exits.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid == 0 {
        let code = f();
        // SAFETY: ends the child without running any of the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    assert!(pid > 0, "clone: {}", std::io::Error::last_os_error());
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        if r == pid as i32 {
            break;
        }
        assert!(
            r >= 0 && last_errno() == libc::EINTR,
            "waitpid: {}",
            std::io::Error::last_os_error()
        );
    }
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        1000 + libc::WTERMSIG(status)
    } else {
        999
    }
}

struct Side {
    root: PathBuf,
    fds: [i32; SLOTS],
}

impl Side {
    fn new(root: PathBuf) -> Side {
        std::fs::create_dir_all(root.join("d"))
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", root.display()));
        Side {
            root,
            fds: [-1; SLOTS],
        }
    }

    fn path(&self, name: usize) -> PathBuf {
        self.root.join(NAMES[name])
    }

    fn close_slot(&mut self, slot: usize) -> Res {
        let fd = std::mem::replace(&mut self.fds[slot], -1);
        if fd < 0 {
            return Res::errno(libc::EBADF);
        }
        // SAFETY: our own descriptor, closed once.
        Res::of(unsafe { libc::close(fd) } as i64)
    }

    fn close_all(&mut self) -> Vec<Res> {
        let open: Vec<usize> = (0..SLOTS).filter(|s| self.fds[*s] >= 0).collect();
        open.into_iter().map(|s| self.close_slot(s)).collect()
    }

    fn exec(&mut self, op: &Op) -> Res {
        // SAFETY (whole match): raw syscalls on our own descriptors (or -1, which gives
        // EBADF), valid NUL-terminated paths and buffers that outlive each call.
        unsafe {
            match *op {
                Op::Open {
                    slot,
                    name,
                    trunc,
                    append,
                } => {
                    if self.fds[slot] >= 0 {
                        self.close_slot(slot);
                    }
                    let mut fl = libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC;
                    if trunc {
                        fl |= libc::O_TRUNC;
                    }
                    if append {
                        fl |= libc::O_APPEND;
                    }
                    let c = cpath(&self.path(name));
                    let fd = libc::open(c.as_ptr(), fl, 0o644);
                    if fd < 0 {
                        return Res::errno(last_errno());
                    }
                    self.fds[slot] = fd;
                    Res::ok(0)
                }
                Op::Close { slot } => self.close_slot(slot),
                Op::UserPwrite {
                    slot,
                    off,
                    len,
                    seed,
                } => {
                    let buf = make_data(Fill::Random, seed, len);
                    let fd = self.fds[slot];
                    // In the child: raw syscalls on memory prepared before.
                    let code = in_child(|| {
                        if libc::setgroups(0, std::ptr::null()) != 0
                            || libc::setresgid(1000, 1000, 1000) != 0
                            || libc::setresuid(1000, 1000, 1000) != 0
                        {
                            return 200;
                        }
                        let n = libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), off as i64);
                        if n < 0 {
                            *libc::__errno_location()
                        } else if n as usize != buf.len() {
                            201
                        } else {
                            0
                        }
                    });
                    match code {
                        0 => Res::ok(len as i64),
                        e if e < 200 => Res::errno(e),
                        e => Res {
                            ret: -1,
                            err: e,
                            data: b"child failed".to_vec(),
                        },
                    }
                }
                Op::Pwrite {
                    slot,
                    off,
                    len,
                    fill,
                    seed,
                } => {
                    let buf = make_data(fill, seed, len);
                    Res::of(
                        libc::pwrite(self.fds[slot], buf.as_ptr().cast(), buf.len(), off as i64)
                            as i64,
                    )
                }
                Op::Write {
                    slot,
                    seek,
                    len,
                    fill,
                    seed,
                } => {
                    let fd = self.fds[slot];
                    if let Some(s) = seek {
                        if libc::lseek(fd, s as i64, libc::SEEK_SET) < 0 {
                            let mut r = Res::errno(last_errno());
                            r.data = b"lseek".to_vec();
                            return r;
                        }
                    }
                    let buf = make_data(fill, seed, len);
                    Res::of(libc::write(fd, buf.as_ptr().cast(), buf.len()) as i64)
                }
                Op::DioWrite {
                    name,
                    off,
                    len,
                    seed,
                } => {
                    let c = cpath(&self.path(name));
                    let fd = libc::open(
                        c.as_ptr(),
                        libc::O_RDWR | libc::O_CREAT | libc::O_DIRECT | libc::O_CLOEXEC,
                        0o644,
                    );
                    if fd < 0 {
                        let mut r = Res::errno(last_errno());
                        r.data = b"open".to_vec();
                        return r;
                    }
                    let data = make_data(Fill::Random, seed, len);
                    let mut raw = vec![0u8; data.len() + BLK as usize];
                    let shift = raw.as_ptr().align_offset(BLK as usize);
                    raw[shift..shift + data.len()].copy_from_slice(&data);
                    let r = Res::of(libc::pwrite(
                        fd,
                        raw[shift..].as_ptr().cast(),
                        data.len(),
                        off as i64,
                    ) as i64);
                    let c = libc::close(fd);
                    if r.err == 0 && c < 0 {
                        let mut r = Res::errno(last_errno());
                        r.data = b"close".to_vec();
                        return r;
                    }
                    r
                }
                Op::Truncate { name, size } => {
                    let c = cpath(&self.path(name));
                    Res::of(libc::truncate(c.as_ptr(), size as i64) as i64)
                }
                Op::Ftruncate { slot, size } => {
                    Res::of(libc::ftruncate(self.fds[slot], size as i64) as i64)
                }
                Op::Fallocate {
                    slot,
                    mode,
                    off,
                    len,
                } => Res::of(libc::fallocate(self.fds[slot], mode, off as i64, len as i64) as i64),
                Op::Copy {
                    src,
                    dst,
                    soff,
                    doff,
                    len,
                } => {
                    let (mut so, mut dof) = (soff as i64, doff as i64);
                    let mut total: u64 = 0;
                    while total < len {
                        let r = libc::copy_file_range(
                            self.fds[src],
                            &mut so,
                            self.fds[dst],
                            &mut dof,
                            (len - total) as usize,
                            0,
                        );
                        if r < 0 {
                            let e = last_errno();
                            if total == 0 {
                                return Res::errno(e);
                            }
                            let mut r = Res::errno(e);
                            r.data = format!("after {total} bytes").into_bytes();
                            return r;
                        }
                        if r == 0 {
                            break;
                        }
                        total += r as u64;
                    }
                    Res::ok(total as i64)
                }
                Op::Clone {
                    src,
                    dst,
                    soff,
                    doff,
                    len,
                } => {
                    #[repr(C)]
                    struct FileCloneRange {
                        src_fd: i64,
                        src_offset: u64,
                        src_length: u64,
                        dest_offset: u64,
                    }
                    let arg = FileCloneRange {
                        src_fd: self.fds[src] as i64,
                        src_offset: soff,
                        src_length: len,
                        dest_offset: doff,
                    };
                    Res::of(libc::ioctl(
                        self.fds[dst],
                        FICLONERANGE as _,
                        &arg as *const FileCloneRange,
                    ) as i64)
                }
                Op::MmapWrite {
                    slot,
                    off,
                    len,
                    seed,
                } => {
                    let fd = self.fds[slot];
                    let data = make_data(Fill::Random, seed, len);
                    let page = 4096u64;
                    let map_off = off / page * page;
                    let map_len = (off + len - map_off) as usize;
                    let code = in_child(|| {
                        let p = libc::mmap(
                            std::ptr::null_mut(),
                            map_len,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_SHARED,
                            fd,
                            map_off as i64,
                        );
                        if p == libc::MAP_FAILED {
                            return *libc::__errno_location();
                        }
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            (p as *mut u8).add((off - map_off) as usize),
                            data.len(),
                        );
                        if libc::msync(p, map_len, libc::MS_SYNC) != 0 {
                            return *libc::__errno_location();
                        }
                        libc::munmap(p, map_len);
                        0
                    });
                    if code == 0 {
                        Res::ok(0)
                    } else {
                        Res::errno(code)
                    }
                }
                Op::Rename { from, to } => {
                    let (a, b) = (cpath(&self.path(from)), cpath(&self.path(to)));
                    Res::of(libc::rename(a.as_ptr(), b.as_ptr()) as i64)
                }
                Op::Link { from, to } => {
                    let (a, b) = (cpath(&self.path(from)), cpath(&self.path(to)));
                    Res::of(libc::link(a.as_ptr(), b.as_ptr()) as i64)
                }
                Op::Unlink { name } => {
                    let c = cpath(&self.path(name));
                    Res::of(libc::unlink(c.as_ptr()) as i64)
                }
                Op::Fsync { slot } => Res::of(libc::fsync(self.fds[slot]) as i64),
                Op::Fdatasync { slot } => Res::of(libc::fdatasync(self.fds[slot]) as i64),
                Op::FsyncDir { sub } => {
                    let p = if sub {
                        self.root.join("d")
                    } else {
                        self.root.clone()
                    };
                    let c = cpath(&p);
                    let fd = libc::open(
                        c.as_ptr(),
                        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        let mut r = Res::errno(last_errno());
                        r.data = b"open".to_vec();
                        return r;
                    }
                    let r = Res::of(libc::fsync(fd) as i64);
                    libc::close(fd);
                    r
                }
                Op::SetXattr {
                    name,
                    key,
                    vlen,
                    seed,
                    flags,
                } => {
                    let c = cpath(&self.path(name));
                    let k = CString::new(format!("user.x{key}")).unwrap();
                    let v = make_data(Fill::Text, seed, vlen);
                    Res::of(libc::setxattr(
                        c.as_ptr(),
                        k.as_ptr(),
                        v.as_ptr().cast(),
                        v.len(),
                        flags,
                    ) as i64)
                }
                Op::FSetXattr {
                    slot,
                    key,
                    vlen,
                    seed,
                } => {
                    let k = CString::new(format!("user.x{key}")).unwrap();
                    let v = make_data(Fill::Text, seed, vlen);
                    Res::of(libc::fsetxattr(
                        self.fds[slot],
                        k.as_ptr(),
                        v.as_ptr().cast(),
                        v.len(),
                        0,
                    ) as i64)
                }
                Op::RemoveXattr { name, key } => {
                    let c = cpath(&self.path(name));
                    let k = CString::new(format!("user.x{key}")).unwrap();
                    Res::of(libc::removexattr(c.as_ptr(), k.as_ptr()) as i64)
                }
                Op::Chmod { name, mode } => {
                    let c = cpath(&self.path(name));
                    Res::of(libc::chmod(c.as_ptr(), mode) as i64)
                }
                Op::Pread { slot, off, len } => match pread_all(self.fds[slot], off, len) {
                    Ok(d) => Res {
                        ret: d.len() as i64,
                        err: 0,
                        data: d,
                    },
                    Err(e) => Res::errno(e),
                },
                Op::Fstat { slot } => match fstat(self.fds[slot]) {
                    Some(s) => Res {
                        ret: 0,
                        err: 0,
                        data: stat_bytes(&s),
                    },
                    None => Res::errno(last_errno()),
                },
                Op::Stat { name } => match lstat(&self.path(name)) {
                    Some(s) if s.mode & libc::S_IFMT == libc::S_IFDIR => Res::ok(1),
                    Some(s) => Res {
                        ret: 0,
                        err: 0,
                        data: stat_bytes(&s),
                    },
                    None => Res::errno(last_errno()),
                },
                Op::Seek { slot, data, off } => {
                    let fd = self.fds[slot];
                    // SEEK_DATA/SEEK_HOLE move the position: put it back, the sides may
                    // answer differently and later writes go through the position.
                    let pos = libc::lseek(fd, 0, libc::SEEK_CUR);
                    let whence = if data {
                        libc::SEEK_DATA
                    } else {
                        libc::SEEK_HOLE
                    };
                    let r = Res::of(libc::lseek(fd, off as i64, whence));
                    if pos >= 0 {
                        libc::lseek(fd, pos, libc::SEEK_SET);
                    }
                    r
                }
                Op::GetXattr { name, key } => {
                    let c = cpath(&self.path(name));
                    let k = CString::new(format!("user.x{key}")).unwrap();
                    let mut buf = vec![0u8; 4096];
                    let r =
                        libc::getxattr(c.as_ptr(), k.as_ptr(), buf.as_mut_ptr().cast(), buf.len());
                    if r < 0 {
                        Res::errno(last_errno())
                    } else {
                        buf.truncate(r as usize);
                        Res {
                            ret: r as i64,
                            err: 0,
                            data: buf,
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The hole model: which 4 KiB blocks of each inode (keyed by the reference's st_ino) must be
// holes. A block is "touched" once anything may have put data or an allocation there; an
// untouched block was never written, or was punched whole or cut off by a truncate since.

#[derive(Default)]
struct HoleModel {
    touched: HashMap<u64, BTreeSet<u64>>,
}

impl HoleModel {
    fn reset(&mut self, ino: u64) {
        self.touched.insert(ino, BTreeSet::new());
    }

    fn touch(&mut self, ino: u64, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        let set = self.touched.entry(ino).or_default();
        for b in off / BLK..(off + len).div_ceil(BLK) {
            set.insert(b);
        }
    }

    /// Blocks entirely inside [off, off+len) become holes.
    fn punch(&mut self, ino: u64, off: u64, len: u64) {
        let first = off.div_ceil(BLK);
        let end = (off + len) / BLK;
        let set = self.touched.entry(ino).or_default();
        for b in first..end {
            set.remove(&b);
        }
        // A partly covered block may be zeroed by a write: no claim either way.
        if !off.is_multiple_of(BLK) {
            set.insert(off / BLK);
        }
        if !(off + len).is_multiple_of(BLK) {
            set.insert((off + len) / BLK);
        }
    }

    /// A size change from `pre` to `post`: blocks past a lowered size go; the block holding
    /// an unaligned old or new end may get zeroes written (no claim).
    fn resize(&mut self, ino: u64, pre: u64, post: u64) {
        let set = self.touched.entry(ino).or_default();
        if post < pre {
            let keep = post.div_ceil(BLK);
            set.split_off(&keep);
        }
        if post != pre {
            for s in [pre, post] {
                if !s.is_multiple_of(BLK) {
                    set.insert(s / BLK);
                }
            }
        }
    }

    fn must_hole(&self, ino: u64, block: u64) -> bool {
        !self.touched.get(&ino).is_some_and(|s| s.contains(&block))
    }
}

// ---------------------------------------------------------------------------------------------
// The generator

struct Gen {
    rng: Rng,
    looking: bool,
    last_slot: usize,
    seed_counter: u64,
    /// Ops of a burst still to come.
    queue: std::collections::VecDeque<Op>,
}

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl Gen {
    fn new(seed: u64, looking: bool) -> Gen {
        Gen {
            rng: Rng::new(seed),
            looking,
            last_slot: 0,
            seed_counter: seed.wrapping_mul(1_000_003),
            queue: std::collections::VecDeque::new(),
        }
    }

    fn data_seed(&mut self) -> u64 {
        self.seed_counter += 1;
        self.seed_counter
    }

    fn fill(&mut self) -> Fill {
        match self.rng.below(20) {
            0 => Fill::Zeros,
            1..=8 => Fill::Text,
            _ => Fill::Random,
        }
    }

    /// A slot, most often the last one used, preferring open ones (on the reference).
    fn slot(&mut self, r: &Side) -> usize {
        let mut s = if self.rng.chance(3, 5) {
            self.last_slot
        } else {
            self.rng.below(SLOTS as u64) as usize
        };
        if r.fds[s] < 0 && self.rng.chance(9, 10) {
            let open: Vec<usize> = (0..SLOTS).filter(|i| r.fds[*i] >= 0).collect();
            if !open.is_empty() {
                s = *self.rng.pick(&open);
            }
        }
        self.last_slot = s;
        s
    }

    /// A file name: mostly one that exists on the reference; rarely the directory.
    fn name(&mut self, r: &Side) -> usize {
        if self.rng.chance(1, 40) {
            return DIR_NAME;
        }
        let files: Vec<usize> = (0..DIR_NAME).collect();
        let existing: Vec<usize> = files
            .iter()
            .copied()
            .filter(|n| lstat(&r.path(*n)).is_some())
            .collect();
        if !existing.is_empty() && self.rng.chance(4, 5) {
            *self.rng.pick(&existing)
        } else {
            *self.rng.pick(&files)
        }
    }

    /// A target name: half the time any file name, else as [`Gen::name`].
    fn any_name(&mut self, r: &Side) -> usize {
        if self.rng.chance(1, 2) {
            self.rng.below(DIR_NAME as u64) as usize
        } else {
            self.name(r)
        }
    }

    fn capped(off: u64) -> u64 {
        if off > MAX_FILE {
            off % MAX_FILE
        } else {
            off
        }
    }

    /// (offset, length) of a write to a file of `size` bytes.
    fn write_range(&mut self, size: u64) -> (u64, u64) {
        let rng = &mut self.rng;
        let (off, len) = match rng.below(100) {
            0..=14 => (0, rng.range(1, 2047)),
            15..=29 => (round_up(size, BLK), BLK * rng.range(1, 64)),
            30..=39 => (size, rng.range(1, 65536)),
            40..=54 => (rng.below(size + 1), rng.range(1, 65536)),
            55..=69 => (rng.below(size + MIB), rng.range(4096, MIB)),
            70..=79 => (rng.below(size + MIB) / BLK * BLK, BLK * rng.range(1, 256)),
            _ => (rng.below(size + 256 * 1024), rng.range(1, 8192)),
        };
        (Self::capped(off), len)
    }

    fn new_size(&mut self, size: u64) -> u64 {
        let rng = &mut self.rng;
        Self::capped(match rng.below(100) {
            0..=9 => 0,
            10..=24 => rng.range(1, 2048),
            25..=59 => rng.below(size + 1),
            60..=84 => size + rng.below(2 * MIB),
            _ => rng.below(size + MIB) / BLK * BLK,
        })
    }

    fn next(&mut self, r: &Side) -> Op {
        loop {
            if let Some(op) = self.try_next(r) {
                return op;
            }
        }
    }

    /// A burst around the deferred work on one fd: maybe an empty start, a fallocate at 0 or
    /// at the end, then one or two changes of another kind right after (the shapes of
    /// [`known_shapes`] with random numbers).
    fn burst(&mut self, r: &Side) {
        let slot = self.slot(r);
        let mut size = fstat(r.fds[slot]).map(|x| x.size).unwrap_or(0);
        let rng = &mut self.rng;
        let mut q = Vec::new();
        if r.fds[slot] < 0 || rng.chance(1, 3) {
            q.push(Op::Open {
                slot,
                name: rng.below(DIR_NAME as u64) as usize,
                trunc: true,
                append: rng.chance(1, 6),
            });
            size = 0;
        } else if rng.chance(1, 3) {
            q.push(Op::Ftruncate { slot, size: 0 });
            size = 0;
        }
        let keep = rng.chance(1, 3);
        let off = *rng.pick(&[0, size, round_up(size, BLK)]);
        let len = match rng.below(3) {
            0 => 2 * MIB,
            1 => rng.range(BLK, MIB),
            _ => rng.range(1, 3 * BLK),
        };
        q.push(Op::Fallocate {
            slot,
            mode: if keep { libc::FALLOC_FL_KEEP_SIZE } else { 0 },
            off,
            len,
        });
        let end = if keep { size } else { size.max(off + len) };
        for _ in 0..rng.range(1, 2) {
            let seed = {
                self.seed_counter += 1;
                self.seed_counter
            };
            let rng = &mut self.rng;
            let other = rng.below(SLOTS as u64) as usize;
            q.push(match rng.below(11) {
                0..=2 => Op::Pwrite {
                    slot,
                    off: 0,
                    len: rng.range(1, 2047),
                    fill: Fill::Text,
                    seed,
                },
                3 => Op::Pwrite {
                    slot,
                    off: rng.below(end + 1),
                    len: rng.range(1, 300_000),
                    fill: Fill::Random,
                    seed,
                },
                4 => Op::Write {
                    slot,
                    seek: None,
                    len: rng.range(1, 10_000),
                    fill: Fill::Text,
                    seed,
                },
                5 => Op::Pwrite {
                    slot,
                    off: round_up(end, BLK),
                    len: BLK * rng.range(1, 8),
                    fill: Fill::Random,
                    seed,
                },
                6 => Op::MmapWrite {
                    slot,
                    off: rng.below(end.max(1)),
                    len: rng.range(1, 5000).min(end.max(1)),
                    seed,
                },
                7 => Op::Copy {
                    src: slot,
                    dst: other,
                    soff: 0,
                    doff: rng.below(8192),
                    len: rng.range(1, 3 * MIB),
                },
                8 => Op::Ftruncate {
                    slot,
                    size: rng.below(end + MIB),
                },
                9 => Op::DioWrite {
                    name: rng.below(DIR_NAME as u64) as usize,
                    off: rng.below(end / BLK + 1) * BLK,
                    len: BLK * rng.range(1, 4),
                    seed,
                },
                _ => Op::Fallocate {
                    slot,
                    mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off: rng.below(end + 1),
                    len: rng.range(1, MIB),
                },
            });
        }
        self.queue.extend(q);
    }

    /// A stream of appends on one fd past the 4 MiB a file's delayed-allocation buffer holds
    /// (4.5 to 9 MiB in 16-256 KiB pieces, from the end of the file or an emptied one), so
    /// full buffers go to the write-back thread while the next ones gather behind them; then
    /// one change that meets the buffers maybe still on their way: an overwrite inside the
    /// stream, a truncate into it, a punched hole, a copy out of it, or an fsync.
    fn stream(&mut self, r: &Side) {
        let slot = self.slot(r);
        let mut size = fstat(r.fds[slot]).map(|x| x.size).unwrap_or(0);
        let mut q = Vec::new();
        if r.fds[slot] < 0 || size > MAX_FILE || self.rng.chance(1, 3) {
            q.push(Op::Open {
                slot,
                name: self.rng.below(DIR_NAME as u64) as usize,
                trunc: true,
                append: self.rng.chance(1, 4),
            });
            size = 0;
        }
        let start = round_up(size, BLK);
        let mut end = start;
        let stop = end + self.rng.range(9 * MIB / 2, 9 * MIB);
        while end < stop {
            let len = BLK * self.rng.range(4, 64);
            self.seed_counter += 1;
            q.push(Op::Pwrite {
                slot,
                off: end,
                len,
                fill: Fill::Random,
                seed: self.seed_counter,
            });
            end += len;
        }
        self.seed_counter += 1;
        let seed = self.seed_counter;
        let rng = &mut self.rng;
        let inside = start + rng.below(end - start);
        q.push(match rng.below(5) {
            0 => Op::Pwrite {
                slot,
                off: inside,
                len: rng.range(1, 300_000),
                fill: Fill::Random,
                seed,
            },
            1 => Op::Ftruncate { slot, size: inside },
            2 => Op::Fallocate {
                slot,
                mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off: inside,
                len: rng.range(1, 2 * MIB),
            },
            3 => Op::Copy {
                src: slot,
                dst: rng.below(SLOTS as u64) as usize,
                soff: inside,
                doff: rng.below(8192),
                len: rng.range(1, 3 * MIB),
            },
            _ => Op::Fsync { slot },
        });
        self.queue.extend(q);
    }

    fn try_next(&mut self, r: &Side) -> Option<Op> {
        if let Some(op) = self.queue.pop_front() {
            return Some(op);
        }
        if self.looking && self.rng.chance(1, 4) {
            return Some(self.look(r));
        }
        if self.rng.chance(1, 12) {
            self.burst(r);
            return None;
        }
        if self.rng.chance(1, 60) {
            self.stream(r);
            return None;
        }
        let open_slots = (0..SLOTS).filter(|i| r.fds[*i] >= 0).count();
        let w = self.rng.below(100);
        // Open first when nothing is open.
        let w = if open_slots == 0 && self.rng.chance(4, 5) {
            0
        } else {
            w
        };
        let fsize = |s: usize| fstat(r.fds[s]).map(|x| x.size).unwrap_or(0);
        let append = |s: usize| {
            // SAFETY: F_GETFL on a descriptor of ours (or -1).
            let fl = unsafe { libc::fcntl(r.fds[s], libc::F_GETFL) };
            fl >= 0 && fl & libc::O_APPEND != 0
        };
        Some(match w {
            0..=7 => {
                let slot = self.rng.below(SLOTS as u64) as usize;
                self.last_slot = slot;
                Op::Open {
                    slot,
                    name: self.name(r),
                    trunc: self.rng.chance(1, 4),
                    append: self.rng.chance(1, 5),
                }
            }
            8..=10 => Op::Close { slot: self.slot(r) },
            11..=12 => {
                let slot = self.slot(r);
                let (off, len) = self.write_range(fsize(slot));
                Op::UserPwrite {
                    slot,
                    off,
                    len,
                    seed: self.data_seed(),
                }
            }
            13..=32 => {
                let slot = self.slot(r);
                let (off, len) = self.write_range(fsize(slot));
                Op::Pwrite {
                    slot,
                    off,
                    len,
                    fill: self.fill(),
                    seed: self.data_seed(),
                }
            }
            33..=40 => {
                let slot = self.slot(r);
                let size = fsize(slot);
                let seek = if self.rng.chance(1, 2) {
                    Some(self.write_range(size).0)
                } else {
                    None
                };
                let len = self.write_range(size).1;
                Op::Write {
                    slot,
                    seek,
                    len,
                    fill: self.fill(),
                    seed: self.data_seed(),
                }
            }
            41..=44 => {
                let name = self.name(r);
                let size = lstat(&r.path(name)).map(|s| s.size).unwrap_or(0);
                let off = Self::capped(self.rng.below(round_up(size, BLK) + MIB) / BLK * BLK);
                Op::DioWrite {
                    name,
                    off,
                    len: BLK * self.rng.range(1, 64),
                    seed: self.data_seed(),
                }
            }
            45..=49 => {
                let slot = self.slot(r);
                let size = self.new_size(fsize(slot));
                Op::Ftruncate { slot, size }
            }
            50..=52 => {
                let name = self.name(r);
                let size = lstat(&r.path(name)).map(|s| s.size).unwrap_or(0);
                let size = self.new_size(size);
                Op::Truncate { name, size }
            }
            53..=64 => {
                let slot = self.slot(r);
                let size = fsize(slot);
                let mode = *self.rng.pick(&[
                    0,
                    0,
                    0,
                    libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_ZERO_RANGE,
                    libc::FALLOC_FL_ZERO_RANGE,
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                ]);
                let rng = &mut self.rng;
                // At 0, at the end (delayed preallocation), aligned, anywhere.
                let off = match rng.below(6) {
                    0 => 0,
                    1 => size,
                    2 => round_up(size, BLK),
                    3 => rng.below(size + MIB) / BLK * BLK,
                    _ => rng.below(size + MIB),
                };
                let len = match rng.below(50) {
                    0 => 0,
                    1..=10 => 2 * MIB,
                    11..=30 => rng.range(1, 256 * 1024),
                    31..=44 => BLK * rng.range(1, 512),
                    _ => rng.range(1, 4096),
                };
                Op::Fallocate {
                    slot,
                    mode,
                    off: Self::capped(off),
                    len,
                }
            }
            65..=71 => {
                let clone = w >= 69;
                let src = self.slot(r);
                let dst = if self.rng.chance(1, 4) {
                    src
                } else {
                    self.rng.below(SLOTS as u64) as usize
                };
                let (ss, ds) = (fsize(src), fsize(dst));
                let rng = &mut self.rng;
                if clone {
                    let soff = rng.below(ss + 1) / BLK * BLK;
                    let doff = rng.below(ds + MIB / 4) / BLK * BLK;
                    let len = BLK * rng.range(1, 256);
                    Op::Clone {
                        src,
                        dst,
                        soff,
                        doff: Self::capped(doff),
                        len,
                    }
                } else {
                    let soff = rng.below(ss + 1);
                    let doff = if rng.chance(1, 3) {
                        rng.below(ds + MIB / 4) / BLK * BLK
                    } else {
                        rng.below(ds + MIB / 4)
                    };
                    let len = if rng.chance(1, 2) {
                        rng.range(1, MIB)
                    } else {
                        rng.range(1, 16384)
                    };
                    Op::Copy {
                        src,
                        dst,
                        soff,
                        doff: Self::capped(doff),
                        len,
                    }
                }
            }
            72..=75 => {
                let slot = self.slot(r);
                let size = fsize(slot);
                if size == 0 || append(slot) || r.fds[slot] < 0 {
                    return None;
                }
                let off = self.rng.below(size);
                let len = self.rng.range(1, (size - off).min(256 * 1024));
                Op::MmapWrite {
                    slot,
                    off,
                    len,
                    seed: self.data_seed(),
                }
            }
            76..=78 => Op::Rename {
                from: self.name(r),
                to: self.any_name(r),
            },
            79..=80 => Op::Link {
                from: self.name(r),
                to: self.any_name(r),
            },
            81..=83 => Op::Unlink { name: self.name(r) },
            84..=86 => Op::Fsync { slot: self.slot(r) },
            87..=88 => Op::Fdatasync { slot: self.slot(r) },
            89 => Op::FsyncDir {
                sub: self.rng.chance(1, 2),
            },
            90..=93 => Op::SetXattr {
                name: self.name(r),
                key: self.rng.below(4) as u8,
                vlen: self.rng.below(200),
                seed: self.data_seed(),
                flags: *self
                    .rng
                    .pick(&[0, 0, libc::XATTR_CREATE, libc::XATTR_REPLACE]),
            },
            94..=95 => Op::FSetXattr {
                slot: self.slot(r),
                key: self.rng.below(4) as u8,
                vlen: self.rng.below(200),
                seed: self.data_seed(),
            },
            96..=97 => Op::RemoveXattr {
                name: self.name(r),
                key: self.rng.below(4) as u8,
            },
            _ => Op::Chmod {
                name: self.name(r),
                mode: *self.rng.pick(&[
                    0o644, 0o600, 0o640, 0o755, 0o666, 0o4755, 0o6775, 0o2765, 0o6666,
                ]),
            },
        })
    }

    fn look(&mut self, r: &Side) -> Op {
        let slot = self.slot(r);
        let size = fstat(r.fds[slot]).map(|s| s.size).unwrap_or(0);
        match self.rng.below(100) {
            0..=39 => {
                let (off, len) = if self.rng.chance(1, 4) {
                    (0, size.max(1))
                } else {
                    let off = self.rng.below(size + 8192);
                    (off, self.rng.range(1, 256 * 1024))
                };
                Op::Pread { slot, off, len }
            }
            40..=59 => Op::Fstat { slot },
            60..=84 => Op::Seek {
                slot,
                data: self.rng.chance(1, 2),
                off: self.rng.below(size + 8192),
            },
            85..=94 => Op::Stat { name: self.name(r) },
            _ => Op::GetXattr {
                name: self.name(r),
                key: self.rng.below(4) as u8,
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running a sequence

/// Counters over a run.
#[derive(Default)]
struct Stats {
    sequences: u64,
    ops: u64,
    clone_fallbacks: u64,
    model_warnings: u64,
    differences: u64,
}

/// A sequence that showed a difference.
struct Failure {
    what: String,
    log: Vec<String>,
}

fn is_unsupported(e: i32) -> bool {
    [
        libc::EOPNOTSUPP,
        libc::EXDEV,
        libc::EINVAL,
        libc::ENOTTY,
        libc::ENOSYS,
    ]
    .contains(&e)
}

/// The reference inode an op changes and its size before: (ino, size).
fn target_of(r: &Side, op: &Op) -> Option<(u64, u64)> {
    let slot_of = |s: usize| fstat(r.fds[s]).map(|x| (x.ino, x.size));
    match *op {
        Op::Pwrite { slot, .. }
        | Op::UserPwrite { slot, .. }
        | Op::Write { slot, .. }
        | Op::Ftruncate { slot, .. }
        | Op::Fallocate { slot, .. }
        | Op::MmapWrite { slot, .. } => slot_of(slot),
        Op::Copy { dst, .. } | Op::Clone { dst, .. } => slot_of(dst),
        Op::Truncate { name, .. } | Op::DioWrite { name, .. } | Op::Open { name, .. } => {
            lstat(&r.path(name)).map(|x| (x.ino, x.size))
        }
        _ => None,
    }
}

/// Updates the hole model after `op` succeeded on the reference (`res`), with the target's
/// inode and size before (`pre`).
fn update_model(model: &mut HoleModel, r: &Side, op: &Op, res: &Res, pre: Option<(u64, u64)>) {
    if res.err != 0 {
        return;
    }
    let post_of_slot = |s: usize| fstat(r.fds[s]).map(|x| (x.ino, x.size));
    match *op {
        Op::Open { slot, trunc, .. } => {
            if let Some((ino, _)) = post_of_slot(slot) {
                if pre.is_none() || trunc {
                    model.reset(ino);
                }
            }
            return;
        }
        Op::DioWrite { name, off, .. } => {
            if let Some(st) = lstat(&r.path(name)) {
                if pre.is_none() {
                    model.reset(st.ino);
                }
                model.touch(st.ino, off, res.ret as u64);
                let pre_size = pre.map(|p| p.1).unwrap_or(0);
                model.resize(st.ino, pre_size, st.size);
            }
            return;
        }
        _ => {}
    }
    let Some((ino, pre_size)) = pre else {
        return;
    };
    let post = match *op {
        Op::Truncate { name, .. } => lstat(&r.path(name)).map(|x| x.size),
        Op::Pwrite { slot, .. }
        | Op::UserPwrite { slot, .. }
        | Op::Write { slot, .. }
        | Op::Ftruncate { slot, .. }
        | Op::Fallocate { slot, .. }
        | Op::MmapWrite { slot, .. } => post_of_slot(slot).map(|x| x.1),
        Op::Copy { dst, .. } | Op::Clone { dst, .. } => post_of_slot(dst).map(|x| x.1),
        _ => None,
    };
    let Some(post_size) = post else {
        return;
    };
    match *op {
        Op::Pwrite { slot, off, .. } | Op::UserPwrite { slot, off, .. } => {
            // SAFETY: F_GETFL on our descriptor.
            let fl = unsafe { libc::fcntl(r.fds[slot], libc::F_GETFL) };
            let start = if fl >= 0 && fl & libc::O_APPEND != 0 {
                pre_size
            } else {
                off
            };
            model.touch(ino, start, res.ret as u64);
        }
        Op::Write { slot, .. } => {
            // SAFETY: lseek(SEEK_CUR) only reads the position.
            let pos = unsafe { libc::lseek(r.fds[slot], 0, libc::SEEK_CUR) };
            if pos >= 0 {
                let n = res.ret as u64;
                model.touch(ino, pos as u64 - n, n);
            }
        }
        Op::MmapWrite { off, len, .. } => model.touch(ino, off, len),
        Op::Fallocate { mode, off, len, .. } => {
            if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 {
                model.punch(ino, off, len);
            } else {
                model.touch(ino, off, len);
            }
        }
        Op::Copy { doff, .. } | Op::Clone { doff, .. } => {
            // A clone answers 0; its fallback copy_file_range the byte count.
            let n = match *op {
                Op::Clone { len, .. } => len,
                _ => res.ret as u64,
            };
            model.touch(ino, doff, n);
        }
        _ => {}
    }
    model.resize(ino, pre_size, post_size);
}

/// Runs one op on both sides; Err(description) on a difference.
fn step(
    b: &mut Side,
    r: &mut Side,
    op: &Op,
    model: &mut HoleModel,
    stats: &mut Stats,
) -> Result<String, String> {
    let pre = target_of(r, op);
    let rb = b.exec(op);
    let rr = r.exec(op);
    let mut line = format!("{op} = butter {rb} | ref {rr}");
    match op {
        Op::Clone {
            src,
            dst,
            soff,
            doff,
            len,
        } if rb.err != 0 || rr.err != 0 => {
            let (bu, ru) = (is_unsupported(rb.err), is_unsupported(rr.err));
            if !bu && !ru {
                if rb != rr {
                    return Err(line);
                }
            } else {
                // Where a side cannot clone, the same range is copied instead.
                stats.clone_fallbacks += 1;
                let copy = Op::Copy {
                    src: *src,
                    dst: *dst,
                    soff: *soff,
                    doff: *doff,
                    len: *len,
                };
                let cb = if bu { b.exec(&copy) } else { rb.clone() };
                let cr = if ru { r.exec(&copy) } else { rr.clone() };
                let _ = write!(line, "; fallback copy_file_range = butter {cb} | ref {cr}");
                if bu == ru && cb != cr {
                    return Err(line);
                }
                let res_for_model = if ru { cr } else { rr };
                update_model(model, r, &copy, &res_for_model, pre);
                return Ok(line);
            }
        }
        Op::Seek { slot, data, off } => {
            let size = fstat(r.fds[*slot]).map(|s| s.size);
            check_seek(&rb, &rr, *data, *off, size, r.fds[*slot], &mut line)?;
        }
        Op::Fstat { .. } | Op::Stat { .. } => {
            if rb != rr {
                let _ = write!(
                    line,
                    " (butter {} | ref {})",
                    show_stat_bytes(&rb.data),
                    show_stat_bytes(&rr.data)
                );
                return Err(line);
            }
        }
        Op::Pread { off, .. } => {
            if rb != rr {
                if let Some(i) =
                    (0..rb.data.len().min(rr.data.len())).find(|i| rb.data[*i] != rr.data[*i])
                {
                    let _ = write!(line, " (first differing byte at offset {})", off + i as u64);
                }
                return Err(line);
            }
        }
        _ => {
            if rb != rr {
                return Err(line);
            }
        }
    }
    update_model(model, r, op, &rr, pre);
    Ok(line)
}

/// A SEEK_DATA/SEEK_HOLE answer is right when it is consistent with the reference's bytes:
/// SEEK_DATA may skip only zeroes, SEEK_HOLE must stay within the file; past the end both
/// answer ENXIO.
fn check_seek(
    rb: &Res,
    rr: &Res,
    data: bool,
    off: u64,
    size: Option<u64>,
    ref_fd: i32,
    line: &mut String,
) -> Result<(), String> {
    let Some(size) = size else {
        // The slot is closed: both must say EBADF.
        return if rb == rr { Ok(()) } else { Err(line.clone()) };
    };
    if off >= size {
        if rb.err != libc::ENXIO || rr.err != libc::ENXIO {
            line.push_str(" (at or past EOF both must answer ENXIO)");
            return Err(line.clone());
        }
        return Ok(());
    }
    for (who, res) in [("butter", rb), ("ref", rr)] {
        let skipped_to = if data {
            match (res.err, res.ret) {
                (libc::ENXIO, _) => size,
                (0, r) if (r as u64) >= off && (r as u64) < size => r as u64,
                _ => {
                    let _ = write!(line, " ({who}: SEEK_DATA answer outside [{off}, {size}))");
                    return Err(line.clone());
                }
            }
        } else {
            match (res.err, res.ret) {
                (0, r) if (r as u64) >= off && (r as u64) <= size => continue,
                _ => {
                    let _ = write!(line, " ({who}: SEEK_HOLE answer outside [{off}, {size}])");
                    return Err(line.clone());
                }
            }
        };
        let bytes = pread_all(ref_fd, off, skipped_to - off).unwrap_or_default();
        if let Some(i) = bytes.iter().position(|x| *x != 0) {
            let _ = write!(
                line,
                " ({who}: SEEK_DATA from {off} skipped to {skipped_to} over data: the reference \
                 has a non-zero byte at {})",
                off + i as u64
            );
            return Err(line.clone());
        }
    }
    Ok(())
}

/// Data ranges SEEK_DATA/SEEK_HOLE report for a file of `size` bytes.
fn data_ranges(path: &Path, size: u64) -> Result<Vec<(u64, u64)>, String> {
    let c = cpath(path);
    // SAFETY: valid path.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("open: {}", std::io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut off = 0u64;
    let result = loop {
        if off >= size {
            break Ok(());
        }
        // SAFETY: our descriptor.
        let d = unsafe { libc::lseek(fd, off as i64, libc::SEEK_DATA) };
        if d < 0 {
            let e = last_errno();
            if e == libc::ENXIO {
                break Ok(());
            }
            break Err(format!("SEEK_DATA {off}: {}", errno_name(e)));
        }
        // SAFETY: our descriptor.
        let h = unsafe { libc::lseek(fd, d, libc::SEEK_HOLE) };
        if h < 0 {
            break Err(format!("SEEK_HOLE {d}: {}", errno_name(last_errno())));
        }
        if (h as u64) <= (d as u64) {
            break Err(format!("SEEK_HOLE {d} answered {h}"));
        }
        out.push((d as u64, h as u64));
        off = h as u64;
    };
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(fd) };
    result.map(|_| out)
}

/// The layout checks of one file on one side: no non-zero byte in a reported hole, and every
/// block the model says must be a hole reported as one. Ok(Some(..)) is a model disagreement.
fn check_layout(
    who: &str,
    path: &Path,
    content: &[u8],
    ino: u64,
    model: &HoleModel,
) -> Result<Option<String>, String> {
    let size = content.len() as u64;
    let ranges = data_ranges(path, size)?;
    let mut pos = 0u64;
    for &(d, h) in ranges.iter().chain(std::iter::once(&(size, size))) {
        let d = d.min(size);
        if d > pos {
            if let Some(i) = content[pos as usize..d as usize]
                .iter()
                .position(|x| *x != 0)
            {
                return Err(format!(
                    "{who}: offset {} holds a non-zero byte but SEEK_DATA/SEEK_HOLE report a \
                     hole over [{pos}, {d}) (data ranges {ranges:?})",
                    pos + i as u64
                ));
            }
        }
        pos = pos.max(h.min(size));
    }
    for b in 0..size.div_ceil(BLK) {
        if !model.must_hole(ino, b) {
            continue;
        }
        let (s, e) = (b * BLK, ((b + 1) * BLK).min(size));
        if let Some(&(d, h)) = ranges.iter().find(|(d, h)| *d < e && *h > s) {
            return Ok(Some(format!(
                "{who}: block {b} ([{s}, {e})) must be a hole (never written, punched or \
                 truncated away) but SEEK_DATA/SEEK_HOLE report data over [{d}, {h})"
            )));
        }
    }
    Ok(None)
}

fn read_whole(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("read: {e}"))
}

fn compare_opts() -> CompareOpts {
    CompareOpts {
        atime: false,
        mtime: false,
        ctime: false,
        btime: false,
        dir_size: false,
        dir_nlink: false,
        inode_numbers: false,
        subvolumes: false,
        root_attrs: false,
        ignore_xattr_prefixes: vec!["security.".into(), "system.".into()],
        ..CompareOpts::all()
    }
}

/// The end of a sequence: open fds, then (all closed) the whole directory.
fn compare_end(
    b: &mut Side,
    r: &mut Side,
    model: &HoleModel,
    stats: &mut Stats,
    log: &mut Vec<String>,
) -> Result<(), String> {
    for slot in 0..SLOTS {
        if r.fds[slot] < 0 && b.fds[slot] < 0 {
            continue;
        }
        let (sb, sr) = (fstat(b.fds[slot]), fstat(r.fds[slot]));
        let (zb, zr) = (sb.map(|s| s.size), sr.map(|s| s.size));
        if zb != zr {
            return Err(format!(
                "end: open fd{slot}: size butter {zb:?} vs ref {zr:?}"
            ));
        }
        let size = zr.unwrap_or(0);
        let (cb, cr) = (
            pread_all(b.fds[slot], 0, size),
            pread_all(r.fds[slot], 0, size),
        );
        if cb != cr {
            let at = match (&cb, &cr) {
                (Ok(x), Ok(y)) => (0..x.len().min(y.len()))
                    .find(|i| x[*i] != y[*i])
                    .map(|i| format!("first differing byte at {i}"))
                    .unwrap_or_else(|| format!("lengths {} vs {}", x.len(), y.len())),
                _ => format!("{:?} vs {:?}", cb.as_ref().err(), cr.as_ref().err()),
            };
            return Err(format!(
                "end: open fd{slot} (size {size}): content differs: {at}"
            ));
        }
    }
    let (cb, cr) = (b.close_all(), r.close_all());
    log.push(format!("close all = butter {cb:?} | ref {cr:?}"));
    if cb != cr {
        return Err(format!("end: closing the fds: butter {cb:?} vs ref {cr:?}"));
    }
    let mb = manifest::take(&b.root, &TakeOpts::default());
    let mr = manifest::take(&r.root, &TakeOpts::default());
    let d = manifest::diff(&mb, &mr, &compare_opts());
    if !d.is_empty() {
        return Err(format!(
            "end: the directory differs (A = butter, B = reference):\n  {}",
            d.join("\n  ")
        ));
    }
    check_all_layouts(&mb, &mr, model, stats)
}

fn check_all_layouts(
    mb: &Manifest,
    mr: &Manifest,
    model: &HoleModel,
    stats: &mut Stats,
) -> Result<(), String> {
    for (rel, e) in &mr.entries {
        if e.kind != Kind::File {
            continue;
        }
        let (pb, pr) = (mb.root.join(rel), mr.root.join(rel));
        let content = read_whole(&pr)?;
        let bcontent = read_whole(&pb)?;
        if bcontent != content {
            return Err(format!(
                "end: {}: content differs on a second read",
                rel.display()
            ));
        }
        if let Some(w) = check_layout("ref", &pr, &content, e.ino, model)
            .map_err(|x| format!("end: {}: {x}", rel.display()))?
        {
            stats.model_warnings += 1;
            eprintln!(
                "deferred_diff: model warning (not a failure): {}: {w}",
                rel.display()
            );
        }
        if let Some(w) = check_layout("butter", &pb, &content, e.ino, model)
            .map_err(|x| format!("end: {}: {x}", rel.display()))?
        {
            return Err(format!("end: {}: {w}", rel.display()));
        }
    }
    Ok(())
}

/// Runs `ops` (or, with `gen`, generated ones up to `count`) in fresh directories `name`
/// under both roots. Returns the ops run and the first difference.
fn run_sequence(
    broot: &Path,
    rroot: &Path,
    name: &str,
    mut gen: Option<Gen>,
    fixed: &[Op],
    count: u64,
    stats: &mut Stats,
) -> (Vec<Op>, Result<(), Failure>) {
    let mut b = Side::new(broot.join(name));
    let mut r = Side::new(rroot.join(name));
    let mut model = HoleModel::default();
    let mut ops = Vec::new();
    let mut log = Vec::new();
    let total = if gen.is_some() {
        count as usize
    } else {
        fixed.len()
    };
    #[allow(clippy::needless_range_loop)]
    for i in 0..total {
        let op = match gen.as_mut() {
            Some(g) => g.next(&r),
            None => fixed.get(i).cloned().expect("fixed op"),
        };
        stats.ops += 1;
        let res = step(&mut b, &mut r, &op, &mut model, stats);
        ops.push(op);
        match res {
            Ok(line) => log.push(format!("#{i} {line}")),
            Err(line) => {
                log.push(format!("#{i} {line}   <== DIFFERENCE"));
                b.close_all();
                r.close_all();
                let what = format!("op #{i}: {line}");
                return (ops, Err(Failure { what, log }));
            }
        }
    }
    stats.sequences += 1;
    let end = compare_end(&mut b, &mut r, &model, stats, &mut log);
    if std::env::var_os("BUTTER_DIFF_LOG").is_some() {
        eprintln!("deferred_diff: op log of {name}:\n{}", log.join("\n"));
    }
    b.close_all();
    r.close_all();
    (ops, end.map_err(|what| Failure { what, log }))
}

/// Shrinks a failing op list (delta debugging: drop chunks while a difference remains) for
/// up to `budget`. Each try runs in new directories on the same mounts.
fn minimize(broot: &Path, rroot: &Path, ops: Vec<Op>, budget: Duration) -> (Vec<Op>, String) {
    let t0 = Instant::now();
    let mut tries = 0u64;
    let mut stats = Stats::default();
    let mut fails = |cand: &[Op], tries: &mut u64| -> Option<String> {
        *tries += 1;
        let name = format!("min-{tries}");
        let (_, res) = run_sequence(broot, rroot, &name, None, cand, 0, &mut stats);
        let _ = std::fs::remove_dir_all(broot.join(&name));
        let _ = std::fs::remove_dir_all(rroot.join(&name));
        res.err().map(|f| f.what)
    };
    let Some(mut why) = fails(&ops, &mut tries) else {
        return (
            ops,
            "the full sequence no longer shows a difference when replayed".into(),
        );
    };
    let mut cur = ops;
    let mut chunk = cur.len().div_ceil(2).max(1);
    'outer: loop {
        let mut i = 0;
        let mut progress = false;
        while i < cur.len() {
            if t0.elapsed() > budget {
                break 'outer;
            }
            let mut cand = cur.clone();
            let end = (i + chunk).min(cand.len());
            cand.drain(i..end);
            if !cand.is_empty() {
                if let Some(w) = fails(&cand, &mut tries) {
                    cur = cand;
                    why = w;
                    progress = true;
                    continue;
                }
            }
            i += chunk;
        }
        if chunk == 1 && !progress {
            break;
        }
        if !progress {
            chunk = (chunk / 2).max(1);
        }
    }
    (
        cur,
        format!(
            "{why}\n(shrunk in {tries} tries, {:.0} s)",
            t0.elapsed().as_secs_f64()
        ),
    )
}

// ---------------------------------------------------------------------------------------------
// Known shapes: short sequences around the deferred work, run before the random ones

fn pw(slot: usize, off: u64, len: u64, seed: u64) -> Op {
    Op::Pwrite {
        slot,
        off,
        len,
        fill: Fill::Random,
        seed,
    }
}

fn fa(slot: usize, mode: i32, off: u64, len: u64) -> Op {
    Op::Fallocate {
        slot,
        mode,
        off,
        len,
    }
}

fn open(slot: usize, name: usize, append: bool) -> Op {
    Op::Open {
        slot,
        name,
        trunc: true,
        append,
    }
}

/// (name, ops): each starts from an empty directory.
fn known_shapes() -> Vec<(&'static str, Vec<Op>)> {
    let keep = libc::FALLOC_FL_KEEP_SIZE;
    let punch = libc::FALLOC_FL_PUNCH_HOLE | keep;
    let mb2 = 2 * MIB;
    vec![
        // posix_fallocate(0, 2 MiB), then a small write at 0: the size must stay 2 MiB.
        (
            "prealloc-then-inline-write",
            vec![open(0, 0, false), fa(0, 0, 0, mb2), pw(0, 0, 1000, 1)],
        ),
        (
            "prealloc-then-small-write-mid",
            vec![open(0, 0, false), fa(0, 0, 0, mb2), pw(0, 5000, 1000, 2)],
        ),
        (
            "inline-then-prealloc-then-write",
            vec![
                open(0, 0, false),
                pw(0, 0, 1000, 3),
                fa(0, 0, 0, mb2),
                pw(0, 500, 100, 4),
            ],
        ),
        (
            "append-into-prealloc-at-end",
            vec![
                open(0, 0, false),
                pw(0, 0, 8192, 5),
                fa(0, 0, 8192, MIB),
                pw(0, 8192, 4096, 6),
            ],
        ),
        (
            "prealloc-at-end-then-truncate",
            vec![
                open(0, 0, false),
                pw(0, 0, 4096, 7),
                fa(0, 0, 4096, MIB),
                Op::Ftruncate {
                    slot: 0,
                    size: 8192,
                },
            ],
        ),
        (
            "prealloc-then-truncate-down-then-write",
            vec![
                open(0, 0, false),
                fa(0, 0, 0, mb2),
                Op::Ftruncate {
                    slot: 0,
                    size: 1000,
                },
                pw(0, 0, 10, 8),
            ],
        ),
        (
            "prealloc-then-o-append-write",
            vec![
                open(0, 0, true),
                fa(0, 0, 0, mb2),
                Op::Write {
                    slot: 0,
                    seek: None,
                    len: 1000,
                    fill: Fill::Text,
                    seed: 9,
                },
            ],
        ),
        (
            "keep-size-prealloc-then-append",
            vec![
                open(0, 0, false),
                pw(0, 0, 4096, 10),
                fa(0, keep, 4096, MIB),
                pw(0, 4096, 4096, 11),
                Op::Ftruncate {
                    slot: 0,
                    size: 3 * MIB,
                },
            ],
        ),
        (
            "delalloc-appends-then-punch",
            vec![
                open(0, 0, false),
                pw(0, 0, 4096, 12),
                pw(0, 4096, 4096, 13),
                pw(0, 8192, 100, 14),
                fa(0, punch, 0, 8192),
            ],
        ),
        (
            "delalloc-appends-then-zero-range",
            vec![
                open(0, 0, false),
                pw(0, 0, 65536, 15),
                pw(0, 65536, 65536, 16),
                fa(0, libc::FALLOC_FL_ZERO_RANGE, 4096, 200_000),
            ],
        ),
        (
            "prealloc-then-copy-out",
            vec![
                open(0, 0, false),
                open(1, 1, false),
                fa(0, 0, 0, mb2),
                pw(0, 0, 1000, 17),
                Op::Copy {
                    src: 0,
                    dst: 1,
                    soff: 0,
                    doff: 0,
                    len: 3 * MIB,
                },
            ],
        ),
        (
            "prealloc-then-copy-in",
            vec![
                open(0, 0, false),
                open(1, 1, false),
                pw(1, 0, 300_000, 18),
                fa(0, 0, 0, mb2),
                Op::Copy {
                    src: 1,
                    dst: 0,
                    soff: 0,
                    doff: 4096,
                    len: 300_000,
                },
            ],
        ),
        (
            "prealloc-then-mmap-write",
            vec![
                open(0, 0, false),
                fa(0, 0, 0, mb2),
                Op::MmapWrite {
                    slot: 0,
                    off: 1000,
                    len: 5000,
                    seed: 19,
                },
            ],
        ),
        (
            "prealloc-then-rename-and-link",
            vec![
                open(0, 0, false),
                fa(0, 0, 0, mb2),
                pw(0, 0, 100, 20),
                Op::Rename { from: 0, to: 1 },
                Op::Link { from: 1, to: 2 },
            ],
        ),
        (
            "prealloc-then-unlink-then-write",
            vec![
                open(0, 0, false),
                open(1, 0, false),
                fa(0, 0, 0, mb2),
                Op::Unlink { name: 0 },
                pw(0, 0, 100, 21),
                pw(1, 3 * MIB, 100, 22),
            ],
        ),
        (
            "prealloc-then-fsync-then-write",
            vec![
                open(0, 0, false),
                fa(0, 0, 0, mb2),
                Op::Fsync { slot: 0 },
                pw(0, 0, 1000, 23),
                Op::Fdatasync { slot: 0 },
            ],
        ),
        (
            "large-write-then-small-write-past-it",
            vec![
                open(0, 0, false),
                pw(0, 0, MIB, 24),
                pw(0, MIB + 100, 10, 25),
                pw(0, 200, 1_000_000, 26),
            ],
        ),
        (
            "large-writes-overlapping",
            vec![
                open(0, 0, false),
                open(1, 0, false),
                pw(0, 0, MIB, 27),
                pw(1, 4096, MIB, 28),
                Op::Ftruncate {
                    slot: 0,
                    size: 700_000,
                },
                pw(1, 600_000, 600_000, 29),
            ],
        ),
        (
            "inline-grows-by-appends",
            vec![
                open(0, 0, false),
                pw(0, 0, 100, 30),
                pw(0, 100, 2000, 31),
                pw(0, 2100, 4000, 32),
                Op::Ftruncate { slot: 0, size: 50 },
                pw(0, 8192, 10, 33),
            ],
        ),
        (
            "o-direct-over-delalloc",
            vec![
                open(0, 0, false),
                pw(0, 0, 8192, 34),
                pw(0, 8192, 8192, 35),
                Op::DioWrite {
                    name: 0,
                    off: 4096,
                    len: 8192,
                    seed: 36,
                },
                pw(0, 16384, 100, 37),
            ],
        ),
        // A punch past the end takes the last, partial sector whole: a hole, not zeros
        // written (found by bench/deferred_diff.sh, seed 50030).
        (
            "punch-past-the-end-of-a-partial-last-sector",
            vec![
                open(0, 0, false),
                pw(0, 929, 59502, 43),
                fa(
                    0,
                    libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE,
                    0,
                    1421312,
                ),
            ],
        ),
        // Pages written back through a mapping go to their own offset, also when the
        // mapping's fd (or another one of the file) has O_APPEND.
        (
            "mmap-write-through-o-append-fd",
            vec![
                open(0, 0, true),
                pw(0, 0, 121, 39),
                Op::MmapWrite {
                    slot: 0,
                    off: 10,
                    len: 50,
                    seed: 40,
                },
            ],
        ),
        (
            "mmap-write-with-an-o-append-fd-open",
            vec![
                open(0, 0, false),
                Op::Open {
                    slot: 1,
                    name: 0,
                    trunc: false,
                    append: true,
                },
                pw(0, 0, 5000, 41),
                Op::MmapWrite {
                    slot: 0,
                    off: 10,
                    len: 50,
                    seed: 42,
                },
            ],
        ),
        (
            "o-direct-into-prealloc",
            vec![
                open(0, 0, false),
                fa(0, 0, 0, mb2),
                Op::DioWrite {
                    name: 0,
                    off: 0,
                    len: 4096,
                    seed: 38,
                },
            ],
        ),
    ]
}

/// `ops` with a look (fstat of every open slot, then SEEK_DATA at 0) after each op.
fn with_looks(ops: &[Op]) -> Vec<Op> {
    let mut out = Vec::new();
    for op in ops {
        out.push(op.clone());
        for slot in 0..2 {
            out.push(Op::Fstat { slot });
        }
        out.push(Op::Seek {
            slot: 0,
            data: true,
            off: 0,
        });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Option sets

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn modes() -> Vec<(&'static str, bool)> {
    match std::env::var("BUTTER_DIFF_MODES").as_deref() {
        Ok("blind") => vec![("blind", false)],
        Ok("looking") => vec![("looking", true)],
        _ => vec![("blind", false), ("looking", true)],
    }
}

fn run_variant(variant: &str, mount_args: &[&str]) {
    if !fuse_mount::require("deferred_diff", &["mkfs.ext4"]) {
        return;
    }
    let ops = env_u64("BUTTER_DIFF_OPS", SUITE_OPS);
    let seeds = env_u64("BUTTER_DIFF_SEEDS", SUITE_SEEDS);
    let first = env_u64("BUTTER_DIFF_SEED", FIRST_SEED);
    let min_budget = env_u64("BUTTER_DIFF_MINIMIZE", 120);
    // The suite keeps every sequence for the final image check; a long run keeps the last few.
    let keep_last = if seeds * 2 <= 16 { u64::MAX } else { 8 };

    let scratch = ScratchDir::new(&format!("deferred-diff-{variant}"));
    let img = scratch.join("butter.img");
    common::kernel::mkfs_btrfs::<&str>(&img, IMAGE_SIZE, &[]);
    let rimg = scratch.join("ref.img");
    common::kernel::mkfs_ext4(&rimg, IMAGE_SIZE);
    let rmount = LoopMount::new(&rimg, &scratch.join("ref"), FsType::Ext4, "");
    // allow_other: the pwrites by uid 1000 (Op::UserPwrite) are requests of another user.
    let mount_args: Vec<&str> = [mount_args, &["-o", "allow_other"]].concat();
    // At info level the mount's log ends with what its deferred work did (checked below).
    let bm = match ButterMount::try_start_env(
        &img,
        &scratch.join("bmnt"),
        &mount_args,
        &scratch.join("butter.log"),
        &[("RUST_LOG", "info")],
    ) {
        Ok(m) => m,
        Err((st, log)) if log.contains("unknown mount option") => {
            eprintln!(
                "NOTICE: deferred_diff {variant}: this butter does not know {mount_args:?} yet \
                 ({st}: {}); the option set is left out of this run",
                log.trim()
            );
            return;
        }
        Err((st, log)) => panic!("butter mount {mount_args:?} exited ({st}):\n{log}"),
    };

    // With a small cache the mount bounds the inodes the kernel holds (crate::fuse::prune):
    // lookups of other files all along keep it asking the kernel to drop unused ones, the
    // sequences' files among them, while the sequences run.
    let churn = variant_prunes(variant).then(|| Churn::start(bm.path()));
    let t0 = Instant::now();
    let mut stats = Stats::default();
    let mut failures: Vec<String> = Vec::new();
    let mut done: Vec<String> = Vec::new();
    for (shape, ops) in known_shapes() {
        for (mode, list) in [("blind", ops.clone()), ("looking", with_looks(&ops))] {
            let name = format!("k-{shape}-{mode}");
            let (_, res) =
                run_sequence(bm.path(), rmount.path(), &name, None, &list, 0, &mut stats);
            if let Err(f) = res {
                stats.differences += 1;
                let msg = format!(
                    "DIFFERENCE: option set {variant} {mount_args:?}, known shape {shape}, mode \
                     {mode}: {}\nop log:\n{}",
                    f.what,
                    f.log.join("\n")
                );
                eprintln!("deferred_diff: {msg}");
                failures.push(msg);
            }
        }
    }
    'seeds: for seed in first..first + seeds {
        for (mode, looking) in modes() {
            let name = format!("s{seed}-{mode}");
            let gen = Gen::new(seed, looking);
            let (seq_ops, res) = run_sequence(
                bm.path(),
                rmount.path(),
                &name,
                Some(gen),
                &[],
                ops,
                &mut stats,
            );
            match res {
                Ok(()) => {
                    done.push(name);
                    if done.len() as u64 > keep_last {
                        let old = done.remove(0);
                        let _ = std::fs::remove_dir_all(bm.path().join(&old));
                        let _ = std::fs::remove_dir_all(rmount.path().join(&old));
                    }
                }
                Err(f) => {
                    stats.differences += 1;
                    let mut msg = format!(
                        "DIFFERENCE: option set {variant} {mount_args:?}, seed {seed}, mode \
                         {mode}, {ops} ops: {}\nreproduce: BUTTER_DIFF_SEED={seed} \
                         BUTTER_DIFF_SEEDS=1 BUTTER_DIFF_OPS={ops} BUTTER_DIFF_MODES={mode} \
                         cargo test --release -p butter-cli --test deferred_diff {} -- \
                         --nocapture\nop log of this sequence ({}, `butter | ref` results):\n{}",
                        f.what,
                        test_name(variant),
                        name,
                        f.log.join("\n")
                    );
                    if min_budget > 0 {
                        let (short, why) = minimize(
                            bm.path(),
                            rmount.path(),
                            seq_ops,
                            Duration::from_secs(min_budget),
                        );
                        let _ = write!(
                            msg,
                            "\nshrunk to {} ops that still differ: {why}\n{}",
                            short.len(),
                            short
                                .iter()
                                .enumerate()
                                .map(|(i, o)| format!("  #{i} {o}"))
                                .collect::<Vec<_>>()
                                .join("\n")
                        );
                    }
                    eprintln!("deferred_diff: {msg}");
                    failures.push(msg);
                    if failures.len() >= 6 {
                        break 'seeds;
                    }
                }
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    eprintln!(
        "DIFF_SUMMARY variant={variant} sequences={} ops={} differences={} clone_fallbacks={} \
         model_warnings={} seconds={seconds:.1}",
        stats.sequences + stats.differences,
        stats.ops,
        stats.differences,
        stats.clone_fallbacks,
        stats.model_warnings
    );
    assert!(
        failures.is_empty(),
        "deferred_diff {variant}: {} sequence(s) differ:\n\n{}\n\nbutter log:\n{}",
        failures.len(),
        failures.join("\n\n"),
        bm.log_text()
    );
    drop(churn);
    let seen = manifest::take(bm.path(), &TakeOpts::default());
    bm.unmount();
    rmount.unmount();
    check_deferred_work_ran(variant, &scratch.join("butter.log"));
    fuse_mount::verify_image(
        &img,
        &scratch.join("kmnt"),
        Some(&seen),
        &format!("deferred_diff {variant}"),
    );
}

/// Option sets whose appends gather in memory and go back through the write-back thread
/// (compressed buffers go back under the writer lock, and `nodelalloc` has none).
fn variant_writes_back(variant: &str) -> bool {
    !matches!(
        variant,
        "nodelalloc" | "compress-zstd" | "compress-force-zstd"
    )
}

/// Option sets that run with a bound on the kernel's inodes small enough to be reached.
fn variant_prunes(variant: &str) -> bool {
    variant == "cache-size-1m"
}

/// The deferral the option set is there for did happen: the streams' full buffers went to the
/// write-back thread with the next ones gathering behind them, and (small cache) butter asked
/// the kernel to drop inodes during the run. Read from the mount's log at unmount.
fn check_deferred_work_ran(variant: &str, log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = |what: &str| {
        text.lines().find(|l| l.contains(what)).unwrap_or_else(|| {
            panic!("deferred_diff {variant}: no \"{what}\" in butter's log:\n{text}")
        })
    };
    let writes = line("delayed allocations written back");
    let background = fuse_mount::number_after(writes, "written back (").unwrap_or(0);
    let behind = fuse_mount::number_after(writes, "write-back thread, ").unwrap_or(0);
    eprintln!(
        "DIFF_DEFERRED variant={variant} write_back_thread={background} started_behind={behind}"
    );
    if variant_writes_back(variant) {
        assert!(
            background > 0 && behind > 0,
            "deferred_diff {variant}: the streams never reached the write-back thread: {writes}"
        );
    }
    if variant_prunes(variant) {
        let nodes = line("nodes the kernel held");
        let asked = fuse_mount::number_after(nodes, "); ").unwrap_or(0);
        eprintln!("DIFF_DEFERRED variant={variant} {nodes}");
        assert!(
            asked > 0,
            "deferred_diff {variant}: no inode was asked to be dropped: {nodes}"
        );
    }
}

/// Lookups of [`Churn::FILES`] files of their own, round and round on a thread, until dropped.
struct Churn {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Churn {
    const FILES: usize = 3000;

    fn start(mnt: &Path) -> Churn {
        let dir = mnt.join("churn");
        std::fs::create_dir(&dir).unwrap();
        for i in 0..Self::FILES {
            std::fs::write(dir.join(format!("c{i}")), b"").unwrap();
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut i = 0;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::metadata(dir.join(format!("c{}", i % Self::FILES)));
                i += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        Churn {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn test_name(variant: &str) -> String {
    format!("diff_{}", variant.replace('-', "_"))
}

#[test]
fn diff_default() {
    run_variant("default", &[]);
}

#[test]
fn diff_nodelalloc() {
    run_variant("nodelalloc", &["-o", "nodelalloc"]);
}

#[test]
fn diff_compress_force_zstd() {
    run_variant("compress-force-zstd", &["-o", "compress-force=zstd"]);
}

#[test]
fn diff_fsync_commit() {
    run_variant("fsync-commit", &["-o", "fsync=commit"]);
}

/// Large writes served on the FUSE worker that took them (no bulk lanes).
#[test]
fn diff_nobulk() {
    run_variant("nobulk", &["-o", "nobulk"]);
}

/// Commits only at fsync and unmount: every change stays deferred the longest.
#[test]
fn diff_commit_0() {
    run_variant("commit-0", &["-o", "commit=0"]);
}

/// Compression where it pays (`compress=`, not forced): files whose start does not compress
/// are written plain.
#[test]
fn diff_compress_zstd() {
    run_variant("compress-zstd", &["-o", "compress=zstd"]);
}

/// The block allocator from before the scalable one.
#[test]
fn diff_allocator_legacy() {
    run_variant("allocator-legacy", &["-o", "allocator=legacy"]);
}

/// The caches on, but the kernel clears set-id bits and capabilities itself (a setattr and a
/// removexattr before the write) instead of leaving it to butter (FUSE_HANDLE_KILLPRIV_V2).
#[test]
fn diff_nokillpriv() {
    run_variant("nokillpriv", &["-o", "nokillpriv"]);
}

/// The kernel caches as before the long timeouts: 1 s, no negative entries, no page cache
/// kept across opens.
#[test]
fn diff_cache_strict() {
    run_variant("cache-strict", &["-o", "cache=strict"]);
}

/// Served through FUSE over io_uring (the kernel's fuse module offering it while it mounts):
/// the ring transport's own request decoder and reply encoder (crate::fuse::wire), with the
/// caches on.
#[test]
fn diff_uring() {
    run_variant("uring", &["-o", "uring=on"]);
}

/// The smallest `cache_size` (1 MiB: 512 KiB of block cache, 512 KiB of changed tree blocks,
/// 32 blocks of 16 KiB): a change that leaves more changed blocks than that commits, between
/// operations the sequence never looks at. (Measured through a mount: 4000 creates of 200
/// bytes and a SIGKILL keep 3932 files with this size, none without it.)
#[test]
fn diff_cache_size_small() {
    run_variant("cache-size-1m", &["-o", "cache_size=1M"]);
}
