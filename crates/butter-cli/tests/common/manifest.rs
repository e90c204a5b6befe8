//! Manifests: everything observable about a directory tree through the POSIX interface, and a
//! readable diff of two of them.
//!
//! [`take`] walks a tree without following symlinks and without entering other mounts, but
//! entering btrfs subvolumes (directories with another `st_dev` that are not mount roots). It
//! reads files with `O_NOATIME` and never changes the tree. Per path it records the file type,
//! permission bits (with setuid/setgid/sticky), owner, size, link count, atime/mtime/ctime/btime
//! with nanoseconds, device numbers, xattrs (names and values, sorted), symlink target, SHA-256
//! of the content, the hard-link group (all paths sharing one (st_dev, st_ino)), and for
//! directories the sorted list of entry names. Errors reading any of it are recorded in the
//! entry (and show up in a diff) instead of aborting, so a broken FUSE mount yields a report.
//!
//! [`diff`] compares two manifests field by field; [`CompareOpts`] says which fields count,
//! with presets for the usual pairs (same image twice, kernel vs FUSE, kernel vs restore).

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr};
use std::fmt;
use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A timestamp: seconds since the epoch (may be negative) and nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Ts {
    pub sec: i64,
    pub nsec: u32,
}

impl fmt::Display for Ts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:09}", self.sec, self.nsec)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
    /// An `S_IFMT` value that is none of the above, or `stat` failed (then `errors` says why).
    Unknown(u32),
}

/// What was observed at one path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    /// Permission bits including setuid, setgid and sticky (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// `st_size` in bytes (for symlinks the target length; for btrfs directories twice the
    /// sum of the entry name lengths).
    pub size: u64,
    pub nlink: u32,
    /// `st_blocks` (512-byte units). Recorded, never compared.
    pub blocks: u64,
    pub atime: Ts,
    pub mtime: Ts,
    pub ctime: Ts,
    /// Birth time, when the filesystem reports one.
    pub btime: Option<Ts>,
    /// (major, minor) for character and block devices.
    pub rdev: Option<(u32, u32)>,
    /// Extended attributes (name, value), sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Symlink target bytes.
    pub target: Option<Vec<u8>>,
    /// SHA-256 of a regular file's content (None if not hashed or unreadable).
    pub sha256: Option<[u8; 32]>,
    pub dev: u64,
    pub ino: u64,
    /// A directory whose `st_dev` differs from its parent's without being a mount root
    /// (a btrfs subvolume or snapshot root, on a kernel mount). The walk root is not marked.
    pub subvol_root: bool,
    /// For directories: entry names from readdir, sorted, without `.` and `..`.
    pub names: Option<Vec<Vec<u8>>>,
    /// For non-directories whose inode appears under more than one path in this manifest:
    /// the smallest of those paths (the same for every member of the group).
    pub link_group: Option<PathBuf>,
    /// Anything that could not be read (stat, readlink, xattrs, content, readdir).
    pub errors: Vec<String>,
}

/// A snapshot of a tree: relative path (the root is the empty path) → entry.
#[derive(Clone, Debug, Default)]
pub struct Manifest {
    pub root: PathBuf,
    pub entries: BTreeMap<PathBuf, Entry>,
    /// Mount points below the root that were not entered (relative paths).
    pub skipped_mounts: Vec<PathBuf>,
}

impl Manifest {
    pub fn get<P: AsRef<Path>>(&self, rel: P) -> Option<&Entry> {
        self.entries.get(rel.as_ref())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Number of entries of each kind.
    pub fn count(&self, kind: Kind) -> usize {
        self.entries.values().filter(|e| e.kind == kind).count()
    }

    /// Paths of subvolume roots (kernel mounts only).
    pub fn subvolumes(&self) -> Vec<&Path> {
        self.entries
            .iter()
            .filter(|(_, e)| e.subvol_root)
            .map(|(p, _)| p.as_path())
            .collect()
    }

    /// Every entry that recorded an error, as "path: error" lines.
    pub fn errors(&self) -> Vec<String> {
        self.entries
            .iter()
            .flat_map(|(p, e)| e.errors.iter().map(move |x| format!("{}: {x}", show(p))))
            .collect()
    }

    /// A one-line summary: entries by kind, total file bytes.
    pub fn summary(&self) -> String {
        let bytes: u64 = self
            .entries
            .values()
            .filter(|e| e.kind == Kind::File)
            .map(|e| e.size)
            .sum();
        format!(
            "{} entries: {} files ({} bytes), {} dirs, {} symlinks, {} other; {} subvolumes",
            self.len(),
            self.count(Kind::File),
            bytes,
            self.count(Kind::Dir),
            self.count(Kind::Symlink),
            self.len() - self.count(Kind::File) - self.count(Kind::Dir) - self.count(Kind::Symlink),
            self.subvolumes().len()
        )
    }
}

/// What [`take`] reads.
#[derive(Clone, Debug)]
pub struct TakeOpts {
    /// Hash regular file contents (the slow part).
    pub content: bool,
    /// Read xattrs.
    pub xattrs: bool,
    /// Enter directories on another st_dev that are not mount roots (btrfs subvolumes).
    pub cross_subvolumes: bool,
    /// Relative paths to leave out entirely (with everything below them), e.g. `lost+found`.
    pub exclude: Vec<PathBuf>,
}

impl Default for TakeOpts {
    fn default() -> Self {
        TakeOpts {
            content: true,
            xattrs: true,
            cross_subvolumes: true,
            exclude: Vec::new(),
        }
    }
}

/// Walks `root` (see the module comment). Panics only if `root` itself cannot be examined.
pub fn take(root: &Path, opts: &TakeOpts) -> Manifest {
    let mut m = Manifest {
        root: root.to_path_buf(),
        ..Manifest::default()
    };
    let st = match statx_path(root) {
        Ok(st) => st,
        Err(e) => panic!("manifest: cannot stat {}: {e}", root.display()),
    };
    let mut work: Vec<(PathBuf, u64)> = Vec::new();
    let mut root_entry = entry_from_statx(&st);
    if root_entry.kind == Kind::Dir {
        work.push((PathBuf::new(), root_entry.dev));
    } else {
        fill_details(root, &mut root_entry, opts);
    }
    m.entries.insert(PathBuf::new(), root_entry);

    // Depth-first over directories; each directory's children are stat'ed, then directories
    // among them are queued.
    while let Some((rel, dir_dev)) = work.pop() {
        let dir_abs = root.join(&rel);
        let names = match read_dir_names(&dir_abs) {
            Ok(n) => n,
            Err(e) => {
                if let Some(d) = m.entries.get_mut(&rel) {
                    d.errors.push(format!("readdir: {e}"));
                }
                Vec::new()
            }
        };
        let mut subdirs = Vec::new();
        for name in &names {
            let crel = rel.join(OsStr::from_bytes(name));
            if opts.exclude.contains(&crel) {
                continue;
            }
            let cabs = root.join(&crel);
            let mut e = match statx_path(&cabs) {
                Ok(st) => {
                    if st.stx_mode as u32 & libc::S_IFMT == libc::S_IFDIR
                        && libc::makedev(st.stx_dev_major, st.stx_dev_minor) != dir_dev
                    {
                        let mount_root =
                            st.stx_attributes_mask & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0
                                && st.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0;
                        if mount_root || !opts.cross_subvolumes {
                            m.skipped_mounts.push(crel);
                            continue;
                        }
                        let mut e = entry_from_statx(&st);
                        e.subvol_root = true;
                        e
                    } else {
                        entry_from_statx(&st)
                    }
                }
                Err(err) => {
                    let mut e = empty_entry();
                    e.errors.push(format!("stat: {err}"));
                    e
                }
            };
            if e.kind == Kind::Dir {
                subdirs.push((crel.clone(), e.dev));
            } else {
                fill_details(&cabs, &mut e, opts);
            }
            m.entries.insert(crel, e);
        }
        if let Some(d) = m.entries.get_mut(&rel) {
            d.names = Some(names);
            if opts.xattrs {
                read_xattrs(&dir_abs, d);
            }
        }
        // Reverse so the pop order is the sorted order (only matters for readability).
        work.extend(subdirs.into_iter().rev());
    }

    // Hard-link groups.
    let mut groups: HashMap<(u64, u64), Vec<PathBuf>> = HashMap::new();
    for (p, e) in &m.entries {
        if e.kind != Kind::Dir && e.errors.iter().all(|x| !x.starts_with("stat:")) {
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
    m
}

fn empty_entry() -> Entry {
    Entry {
        kind: Kind::Unknown(0),
        mode: 0,
        uid: 0,
        gid: 0,
        size: 0,
        nlink: 0,
        blocks: 0,
        atime: Ts::default(),
        mtime: Ts::default(),
        ctime: Ts::default(),
        btime: None,
        rdev: None,
        xattrs: Vec::new(),
        target: None,
        sha256: None,
        dev: 0,
        ino: 0,
        subvol_root: false,
        names: None,
        link_group: None,
        errors: Vec::new(),
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path contains NUL")
}

fn statx_path(p: &Path) -> io::Result<libc::statx> {
    let c = cpath(p);
    // SAFETY: statx is plain old data; zeroes are a valid value.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            &mut st,
        )
    };
    if r == 0 {
        Ok(st)
    } else {
        Err(io::Error::last_os_error())
    }
}

fn ts(t: &libc::statx_timestamp) -> Ts {
    Ts {
        sec: t.tv_sec,
        nsec: t.tv_nsec,
    }
}

fn entry_from_statx(st: &libc::statx) -> Entry {
    let fmt = st.stx_mode as u32 & libc::S_IFMT;
    let kind = match fmt {
        libc::S_IFREG => Kind::File,
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFLNK => Kind::Symlink,
        libc::S_IFIFO => Kind::Fifo,
        libc::S_IFSOCK => Kind::Socket,
        libc::S_IFCHR => Kind::CharDev,
        libc::S_IFBLK => Kind::BlockDev,
        other => Kind::Unknown(other),
    };
    Entry {
        kind,
        mode: st.stx_mode as u32 & 0o7777,
        uid: st.stx_uid,
        gid: st.stx_gid,
        size: st.stx_size,
        nlink: st.stx_nlink,
        blocks: st.stx_blocks,
        atime: ts(&st.stx_atime),
        mtime: ts(&st.stx_mtime),
        ctime: ts(&st.stx_ctime),
        btime: (st.stx_mask & libc::STATX_BTIME != 0).then(|| ts(&st.stx_btime)),
        rdev: matches!(kind, Kind::CharDev | Kind::BlockDev)
            .then_some((st.stx_rdev_major, st.stx_rdev_minor)),
        dev: libc::makedev(st.stx_dev_major, st.stx_dev_minor),
        ino: st.stx_ino,
        ..empty_entry()
    }
}

/// Symlink target, xattrs and content hash of a non-directory.
fn fill_details(abs: &Path, e: &mut Entry, opts: &TakeOpts) {
    match e.kind {
        Kind::Symlink => match std::fs::read_link(abs) {
            Ok(t) => e.target = Some(t.into_os_string().as_bytes().to_vec()),
            Err(err) => e.errors.push(format!("readlink: {err}")),
        },
        Kind::File if opts.content => match hash_file(abs) {
            Ok(h) => e.sha256 = Some(h),
            Err(err) => e.errors.push(format!("read: {err}")),
        },
        _ => {}
    }
    if opts.xattrs {
        read_xattrs(abs, e);
    }
}

fn open_noatime(abs: &Path, extra: i32) -> io::Result<std::fs::File> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .custom_flags(flags | extra | libc::O_NOFOLLOW)
            .open(abs)
    };
    match open(libc::O_NOATIME) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => open(0),
        r => r,
    }
}

fn hash_file(abs: &Path) -> io::Result<[u8; 32]> {
    let mut f = open_noatime(abs, 0)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// Entry names of a directory, sorted, without `.` and `..`. Opens it with O_NOATIME.
fn read_dir_names(abs: &Path) -> io::Result<Vec<Vec<u8>>> {
    use std::os::unix::io::IntoRawFd;
    let fd = open_noatime(abs, libc::O_DIRECTORY)?.into_raw_fd();
    // SAFETY: fd is an open directory we own; fdopendir takes ownership on success.
    let dir = unsafe { libc::fdopendir(fd) };
    if dir.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so we still own fd.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    let mut names = Vec::new();
    let result = loop {
        // SAFETY: errno location is thread-local; resetting it distinguishes end from error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: dir is a valid DIR*.
        let ent = unsafe { libc::readdir64(dir) };
        if ent.is_null() {
            let errno = io::Error::last_os_error();
            break if errno.raw_os_error() == Some(0) {
                Ok(())
            } else {
                Err(errno)
            };
        }
        // SAFETY: d_name is NUL-terminated within the dirent.
        let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    };
    // SAFETY: dir is valid and closed exactly once.
    unsafe { libc::closedir(dir) };
    result?;
    names.sort();
    Ok(names)
}

/// Calls `f(buf)` with a growing buffer until the value fits; `f` returns the syscall result.
fn sized_call(mut f: impl FnMut(&mut [u8]) -> isize) -> io::Result<Vec<u8>> {
    let mut cap = 256usize;
    loop {
        let mut buf = vec![0u8; cap];
        let n = f(&mut buf);
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && cap < (1 << 24) {
            cap *= 4;
            continue;
        }
        return Err(e);
    }
}

fn read_xattrs(abs: &Path, e: &mut Entry) {
    let c = cpath(abs);
    let list = sized_call(|buf| {
        // SAFETY: valid path; buffer pointer and length from a slice.
        unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }
    });
    let list = match list {
        Ok(l) => l,
        Err(err) if err.raw_os_error() == Some(libc::ENOTSUP) => return,
        Err(err) => {
            e.errors.push(format!("listxattr: {err}"));
            return;
        }
    };
    let mut out = Vec::new();
    for name in list.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cn = CString::new(name).expect("xattr name from the kernel has no NUL");
        let value = sized_call(|buf| {
            // SAFETY: valid path and name; buffer pointer and length from a slice.
            unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }
        });
        match value {
            Ok(v) => out.push((name.to_vec(), v)),
            Err(err) => e
                .errors
                .push(format!("getxattr {}: {err}", String::from_utf8_lossy(name))),
        }
    }
    out.sort();
    e.xattrs = out;
}

// ---------------------------------------------------------------------------------------------
// Comparing

/// Which fields [`diff`] compares. Kind, content, symlink target, device numbers and errors
/// are compared whenever their flag is on; use the presets and adjust with struct update
/// syntax: `CompareOpts { atime: false, ..CompareOpts::restore() }`.
#[derive(Clone, Debug)]
pub struct CompareOpts {
    pub mode: bool,
    pub owner: bool,
    /// Size of non-directories.
    pub size: bool,
    /// Size of directories (btrfs: 2 × the name lengths; other filesystems differ).
    pub dir_size: bool,
    /// Link count of non-directories.
    pub nlink: bool,
    /// Link count of directories (always 1 on btrfs).
    pub dir_nlink: bool,
    pub atime: bool,
    pub mtime: bool,
    pub ctime: bool,
    pub btime: bool,
    pub rdev: bool,
    pub xattrs: bool,
    /// Leave out xattrs whose name starts with one of these (e.g. "security.").
    pub ignore_xattr_prefixes: Vec<String>,
    pub symlink_target: bool,
    pub content: bool,
    /// Same hard-link groups (paths sharing an inode).
    pub hardlinks: bool,
    /// Same sorted readdir name lists.
    pub dir_entries: bool,
    /// Same st_ino (only meaningful for two views of one filesystem by the same driver).
    pub inode_numbers: bool,
    /// Same subvolume roots (needs st_dev per subvolume, as the kernel shows).
    pub subvolumes: bool,
    /// Compare the attributes of the root directory itself (a restore target or a mount
    /// point may have its own).
    pub root_attrs: bool,
    /// Report recorded read errors.
    pub errors: bool,
    /// Paths (relative) left out of the comparison with everything below them.
    pub ignore_paths: Vec<PathBuf>,
    /// How many differences to spell out before summarising the rest.
    pub max_report: usize,
}

impl CompareOpts {
    /// Everything, including ctime, btime and inode numbers: the same image seen twice by the
    /// kernel (e.g. read-write, then remounted read-only).
    pub fn all() -> CompareOpts {
        CompareOpts {
            mode: true,
            owner: true,
            size: true,
            dir_size: true,
            nlink: true,
            dir_nlink: true,
            atime: true,
            mtime: true,
            ctime: true,
            btime: true,
            rdev: true,
            xattrs: true,
            ignore_xattr_prefixes: Vec::new(),
            symlink_target: true,
            content: true,
            hardlinks: true,
            dir_entries: true,
            inode_numbers: true,
            subvolumes: true,
            root_attrs: true,
            errors: true,
            ignore_paths: Vec::new(),
            max_report: 50,
        }
    }

    /// Kernel mount vs a FUSE mount of the same image (`butter mount --ro`): everything a
    /// FUSE filesystem can reproduce, including ctime; not inode numbers, birth time, or
    /// per-subvolume st_dev.
    pub fn fuse() -> CompareOpts {
        CompareOpts {
            btime: false,
            inode_numbers: false,
            subvolumes: false,
            ..CompareOpts::all()
        }
    }

    /// Kernel mount vs a restored copy (`butter restore IMAGE DIR`) on any filesystem: no
    /// ctime, birth time, inode numbers, subvolume boundaries, directory sizes or directory
    /// link counts, and not the attributes of the target directory itself.
    pub fn restore() -> CompareOpts {
        CompareOpts {
            ctime: false,
            btime: false,
            inode_numbers: false,
            subvolumes: false,
            dir_size: false,
            dir_nlink: false,
            root_attrs: false,
            ..CompareOpts::all()
        }
    }

    /// Like [`CompareOpts::restore`] without atime and mtime.
    pub fn restore_no_times() -> CompareOpts {
        CompareOpts {
            atime: false,
            mtime: false,
            ..CompareOpts::restore()
        }
    }
}

impl Default for CompareOpts {
    fn default() -> Self {
        CompareOpts::all()
    }
}

/// How a path is shown in reports: Rust-escaped, the root as `<root>`.
pub fn show(p: &Path) -> String {
    if p.as_os_str().is_empty() {
        "<root>".into()
    } else {
        format!("{:?}", p)
    }
}

fn show_bytes(b: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(b))
}

fn hex_prefix(v: &[u8]) -> String {
    let mut s: String = v.iter().take(16).map(|b| format!("{b:02x}")).collect();
    if v.len() > 16 {
        s.push('…');
    }
    format!("{} bytes {s}", v.len())
}

/// Every difference between `a` and `b` under `opts`, one readable line each ("A" is `a`,
/// "B" is `b`). The first `opts.max_report` are spelled out; a last line counts the rest.
/// Empty when they match. A directory present on one side only counts as one difference.
pub fn diff(a: &Manifest, b: &Manifest, opts: &CompareOpts) -> Vec<String> {
    let mut out = Vec::new();
    let mut total = 0usize;
    let mut report = |line: String| {
        total += 1;
        if out.len() < opts.max_report {
            out.push(line);
        }
    };
    let ignored = |p: &Path| opts.ignore_paths.iter().any(|x| p.starts_with(x));

    let mut ia = a.entries.iter().peekable();
    let mut ib = b.entries.iter().peekable();
    loop {
        let (pa, pb) = (ia.peek().map(|x| x.0), ib.peek().map(|x| x.0));
        match (pa, pb) {
            (None, None) => break,
            (Some(p), Some(q)) if p == q => {
                let (p, ea) = ia.next().unwrap();
                let (_, eb) = ib.next().unwrap();
                if !ignored(p) {
                    compare_entry(p, ea, eb, opts, &mut report);
                }
            }
            (Some(p), q) if q.is_none() || p < q.unwrap() => {
                let p = p.clone();
                let e = ia.next().unwrap().1;
                let below = skip_below(&mut ia, &p);
                if !ignored(&p) {
                    report(only_in("A", &p, e, below));
                }
            }
            _ => {
                let q = pb.unwrap().clone();
                let e = ib.next().unwrap().1;
                let below = skip_below(&mut ib, &q);
                if !ignored(&q) {
                    report(only_in("B", &q, e, below));
                }
            }
        }
    }
    if total > out.len() {
        out.push(format!(
            "... and {} more differences ({total} in all)",
            total - out.len()
        ));
    }
    out
}

/// Panics with a readable report when `a` and `b` differ under `opts`.
pub fn assert_same(a: &Manifest, b: &Manifest, opts: &CompareOpts, what: &str) {
    let d = diff(a, b, opts);
    if !d.is_empty() {
        panic!(
            "{what}: manifests differ\n  A = {} ({})\n  B = {} ({})\n{}",
            a.root.display(),
            a.summary(),
            b.root.display(),
            b.summary(),
            d.join("\n")
        );
    }
}

fn skip_below<'a, I>(it: &mut std::iter::Peekable<I>, dir: &Path) -> usize
where
    I: Iterator<Item = (&'a PathBuf, &'a Entry)>,
{
    let mut n = 0;
    while it.peek().is_some_and(|(p, _)| p.starts_with(dir)) {
        it.next();
        n += 1;
    }
    n
}

fn only_in(side: &str, p: &Path, e: &Entry, below: usize) -> String {
    let mut s = format!("{}: only in {side} ({:?}", show(p), e.kind);
    if below > 0 {
        s.push_str(&format!(", with {below} entries below"));
    }
    s.push(')');
    s
}

fn field(lines: &mut Vec<String>, path: &str, name: &str, va: String, vb: String) {
    if va != vb {
        lines.push(format!("{path}: {name}: A={va} B={vb}"));
    }
}

fn compare_entry(p: &Path, a: &Entry, b: &Entry, o: &CompareOpts, report: &mut impl FnMut(String)) {
    let path = show(p);
    let mut l = Vec::new();
    compare_fields(&path, p.as_os_str().is_empty(), a, b, o, &mut l);
    for line in l {
        report(line);
    }
}

fn compare_fields(
    path: &str,
    is_root: bool,
    a: &Entry,
    b: &Entry,
    o: &CompareOpts,
    l: &mut Vec<String>,
) {
    if o.errors {
        field(
            l,
            path,
            "errors",
            format!("{:?}", a.errors),
            format!("{:?}", b.errors),
        );
    }
    if a.kind != b.kind {
        field(
            l,
            path,
            "kind",
            format!("{:?}", a.kind),
            format!("{:?}", b.kind),
        );
        return;
    }
    let is_dir = a.kind == Kind::Dir;
    if o.root_attrs || !is_root {
        if o.mode {
            field(
                l,
                path,
                "mode",
                format!("{:04o}", a.mode),
                format!("{:04o}", b.mode),
            );
        }
        if o.owner {
            field(
                l,
                path,
                "owner",
                format!("{}:{}", a.uid, a.gid),
                format!("{}:{}", b.uid, b.gid),
            );
        }
        if (o.size && !is_dir) || (o.dir_size && is_dir) {
            field(l, path, "size", a.size.to_string(), b.size.to_string());
        }
        if (o.nlink && !is_dir) || (o.dir_nlink && is_dir) {
            field(l, path, "nlink", a.nlink.to_string(), b.nlink.to_string());
        }
        if o.atime {
            field(l, path, "atime", a.atime.to_string(), b.atime.to_string());
        }
        if o.mtime {
            field(l, path, "mtime", a.mtime.to_string(), b.mtime.to_string());
        }
        if o.ctime {
            field(l, path, "ctime", a.ctime.to_string(), b.ctime.to_string());
        }
        if o.btime {
            field(
                l,
                path,
                "btime",
                format!("{:?}", a.btime),
                format!("{:?}", b.btime),
            );
        }
        if o.inode_numbers {
            field(l, path, "ino", a.ino.to_string(), b.ino.to_string());
        }
        if o.subvolumes {
            field(
                l,
                path,
                "subvolume root",
                a.subvol_root.to_string(),
                b.subvol_root.to_string(),
            );
        }
        if o.xattrs {
            compare_xattrs(path, a, b, o, l);
        }
    }
    if o.rdev {
        field(
            l,
            path,
            "rdev",
            format!("{:?}", a.rdev),
            format!("{:?}", b.rdev),
        );
    }
    if o.symlink_target {
        field(
            l,
            path,
            "symlink target",
            a.target.as_deref().map(show_bytes).unwrap_or_default(),
            b.target.as_deref().map(show_bytes).unwrap_or_default(),
        );
    }
    if o.content && a.sha256 != b.sha256 {
        let h = |x: &Option<[u8; 32]>| {
            x.map(|h| {
                h[..8]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            })
            .unwrap_or_else(|| "unread".into())
        };
        l.push(format!(
            "{path}: content differs (sha256 A={}… B={}…, size A={} B={})",
            h(&a.sha256),
            h(&b.sha256),
            a.size,
            b.size
        ));
    }
    if o.hardlinks {
        let g = |x: &Option<PathBuf>| x.as_deref().map(show).unwrap_or_else(|| "-".into());
        field(
            l,
            path,
            "hard-link group",
            g(&a.link_group),
            g(&b.link_group),
        );
    }
    if o.dir_entries && a.names != b.names {
        let na = a.names.clone().unwrap_or_default();
        let nb = b.names.clone().unwrap_or_default();
        let only = |x: &[Vec<u8>], y: &[Vec<u8>]| -> Vec<String> {
            x.iter()
                .filter(|n| y.binary_search(n).is_err())
                .take(5)
                .map(|n| show_bytes(n))
                .collect()
        };
        l.push(format!(
            "{path}: directory entries differ: {} vs {} names; only in A: {:?}; only in B: {:?}",
            na.len(),
            nb.len(),
            only(&na, &nb),
            only(&nb, &na)
        ));
    }
}

fn compare_xattrs(path: &str, a: &Entry, b: &Entry, o: &CompareOpts, l: &mut Vec<String>) {
    let keep = |n: &Vec<u8>| {
        !o.ignore_xattr_prefixes
            .iter()
            .any(|pre| n.starts_with(pre.as_bytes()))
    };
    let ma: BTreeMap<&Vec<u8>, &Vec<u8>> = a
        .xattrs
        .iter()
        .filter(|x| keep(&x.0))
        .map(|(n, v)| (n, v))
        .collect();
    let mb: BTreeMap<&Vec<u8>, &Vec<u8>> = b
        .xattrs
        .iter()
        .filter(|x| keep(&x.0))
        .map(|(n, v)| (n, v))
        .collect();
    for (n, va) in &ma {
        match mb.get(n) {
            None => l.push(format!("{path}: xattr {} only in A", show_bytes(n))),
            Some(vb) if vb != va => l.push(format!(
                "{path}: xattr {}: A={} B={}",
                show_bytes(n),
                hex_prefix(va),
                hex_prefix(vb)
            )),
            _ => {}
        }
    }
    for n in mb.keys().filter(|n| !ma.contains_key(*n)) {
        l.push(format!("{path}: xattr {} only in B", show_bytes(n)));
    }
}
