//! `butter restore IMAGE DIR`: extract a subvolume into a directory, as the kernel shows it.
//!
//! The tree is walked depth first with an explicit stack (no recursion, so a deep image cannot
//! overflow the stack), reading each directory in batches in DIR_INDEX order. Every kind of
//! inode is recreated: directories, regular files (sparse: all-zero sectors and holes are not
//! written, the length is set at the end, prealloc ranges are fallocated), symlinks,
//! hardlinks (an inode with nlink > 1 seen again is linked to its first path, keyed by
//! [`Inode`], so snapshots of the same file are separate copies), fifos, sockets and device
//! nodes. Subvolumes and snapshots below the restored one become directories with their
//! contents unless `--no-subvols`; where a snapshot names a subvolume nested in its source (the
//! engine's placeholder inode), restore makes the empty directory the kernel shows there.
//!
//! Metadata is applied per inode in an order that keeps every bit: content first (a write
//! clears setuid and file capabilities), then owner (lchown clears setuid/setgid and
//! `security.capability`), then xattrs, then mode, then atime/mtime (every step before it
//! changes ctime only, which cannot be set). Directories get theirs after their children, so
//! creating entries does not disturb the times and a default ACL is not inherited by the
//! restored children; the target directory DIR receives the restored root's metadata.
//!
//! Damage is reported per path and the walk goes on: a file whose data cannot be read keeps
//! what could be read (failed 1 MiB chunks are retried sector by sector, unreadable sectors
//! stay zero). At the end a non-zero exit says "restored N files, M errors". Names from the
//! image are checked (no '/', NUL, "." or ".."), and a directory reached twice (a loop in a
//! damaged image) is not entered again, so nothing is written outside DIR.

use super::{open_fs, CliError, CliResult};
use butter::format::items::Timespec;
use butter::format::FS_TREE_OBJECTID;
use butter::fs::{DirEntry, Fs, Inode, Stat, EMPTY_SUBVOL_DIR_OBJECTID};
use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fmt::Display;
use std::io::{IsTerminal, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Target directory; created if missing, must be empty unless --force.
    pub dir: PathBuf,
    /// Restore this subvolume (or any directory) instead of the default subvolume: a path from
    /// the top-level subvolume, as `butter subvolumes` prints it.
    #[arg(long, value_name = "PATH", conflicts_with = "subvol_id")]
    pub subvol: Option<String>,
    /// Restore the subvolume with this id instead of the default subvolume.
    #[arg(long, value_name = "N")]
    pub subvol_id: Option<u64>,
    /// Skip subvolumes and snapshots below the restored one (default: restore them as
    /// directories with their contents).
    #[arg(long)]
    pub no_subvols: bool,
    /// List what would be restored; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print each path as it is restored.
    #[arg(short, long)]
    pub verbose: bool,
    /// Restore into a non-empty DIR, replacing non-directories that are in the way.
    #[arg(long)]
    pub force: bool,
    /// Print progress on stderr every second (default: only when stderr is a terminal).
    #[arg(long)]
    pub progress: bool,
}

/// Like `eprint!`, but a closed or full stderr is ignored instead of panicking: the restore
/// goes on and its exit status still tells.
macro_rules! ewrite {
    ($($t:tt)*) => {{
        let _ = std::io::stderr().write_fmt(format_args!($($t)*));
    }};
}
macro_rules! ewriteln {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// Bytes read from the image per call.
const CHUNK: u64 = 1 << 20;
/// Directory entries fetched per readdir call.
const BATCH: usize = 4096;
const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const S_IFBLK: u32 = 0o060000;
const S_IFIFO: u32 = 0o010000;
const S_IFSOCK: u32 = 0o140000;
const ACL_ACCESS: &[u8] = b"system.posix_acl_access";
const ACL_DEFAULT: &[u8] = b"system.posix_acl_default";

pub fn restore(a: RestoreArgs) -> CliResult {
    let fs = open_fs(&a.image)?;
    let start = if let Some(id) = a.subvol_id {
        fs.subvol_root_inode(id)
            .map_err(|e| CliError(format!("subvolume {id}: {}", CliError::from(e))))?
    } else if let Some(p) = &a.subvol {
        super::paths::Start {
            subvol_id: Some(FS_TREE_OBJECTID),
        }
        .resolve(&fs, p.as_ref())?
    } else {
        fs.root_inode()
    };
    let st = fs.stat(start)?;
    if !st.is_dir() {
        return Err(CliError(format!(
            "{} is not a directory",
            a.subvol.as_deref().unwrap_or("the restore root")
        )));
    }
    prepare_target(&a)?;
    let mut r = Restorer::new(&fs, &a);
    if !a.dry_run && !r.root_user {
        ewriteln!(
            "butter: not running as root: owners, device nodes and trusted.*/security.* xattrs are not restored"
        );
    }
    r.run(start, st)?;
    r.progress.clear();
    let c = &r.c;
    let verb = if a.dry_run {
        "would restore"
    } else {
        "restored"
    };
    let mut summary = format!("{verb} {} files, {} errors", c.files, c.errors);
    if c.warnings > 0 {
        summary.push_str(&format!(", {} warnings", c.warnings));
    }
    let detail = format!(
        "{} directories, {} regular, {} symlinks, {} hardlinks, {} special, {} of data{}",
        c.dirs,
        c.regular,
        c.symlinks,
        c.hardlinks,
        c.special,
        human(c.bytes),
        if c.skipped_subvols > 0 {
            format!(", {} subvolumes skipped", c.skipped_subvols)
        } else {
            String::new()
        }
    );
    if c.errors > 0 {
        return Err(CliError(format!("{summary} ({detail})")));
    }
    if a.verbose || r.progress.on {
        ewriteln!("butter: {summary} ({detail})");
    }
    Ok(())
}

/// Checks DIR (a directory, empty unless --force) and creates it if missing (not in dry-run).
fn prepare_target(a: &RestoreArgs) -> CliResult {
    let d = a.dir.display();
    match std::fs::metadata(&a.dir) {
        Ok(m) if m.is_dir() => {
            let mut it =
                std::fs::read_dir(&a.dir).map_err(|e| CliError(format!("cannot read {d}: {e}")))?;
            if it.next().is_some() && !a.force {
                return Err(CliError(format!(
                    "{d} is not empty\n  restore into an empty directory, or pass --force to merge into it"
                )));
            }
            Ok(())
        }
        Ok(_) => Err(CliError(format!("{d} exists and is not a directory"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !a.dry_run {
                std::fs::create_dir_all(&a.dir)
                    .map_err(|e| CliError(format!("cannot create {d}: {e}")))?;
            }
            Ok(())
        }
        Err(e) => Err(CliError(format!("cannot access {d}: {e}"))),
    }
}

#[derive(Default)]
struct Counts {
    /// Every entry created (all kinds, hardlinks included; not DIR itself).
    files: u64,
    dirs: u64,
    regular: u64,
    symlinks: u64,
    hardlinks: u64,
    special: u64,
    /// Bytes of file data written (zeros skipped).
    bytes: u64,
    errors: u64,
    warnings: u64,
    skipped_subvols: u64,
}

/// A line on stderr at most once a second.
struct Progress {
    on: bool,
    tty: bool,
    last: Instant,
    shown: bool,
}

impl Progress {
    fn tick(&mut self, c: &Counts) {
        if !self.on || self.last.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last = Instant::now();
        let line = format!(
            "restoring: {} files, {} written, {} errors",
            c.files,
            human(c.bytes),
            c.errors
        );
        if self.tty {
            ewrite!("\r\x1b[K{line}");
            self.shown = true;
        } else {
            ewriteln!("{line}");
        }
    }

    /// Erases the progress line (before another message, and at the end).
    fn clear(&mut self) {
        if self.shown {
            ewrite!("\r\x1b[K");
            self.shown = false;
        }
    }
}

use super::progress::human;

/// A directory being restored: its entries are read in batches; its metadata is applied when
/// it is popped.
struct Frame {
    dir: Inode,
    stat: Stat,
    /// Where it is restored.
    path: PathBuf,
    /// Path relative to DIR, for messages ("" for DIR itself).
    rel: PathBuf,
    /// Last DIR_INDEX sequence number fetched.
    after: u64,
    batch: std::vec::IntoIter<DirEntry>,
    done: bool,
}

impl Frame {
    fn new(dir: Inode, stat: Stat, path: PathBuf, rel: PathBuf) -> Frame {
        Frame {
            dir,
            stat,
            path,
            rel,
            after: 0,
            batch: Vec::new().into_iter(),
            done: false,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dir,
    Symlink,
    Other,
}

struct Restorer<'a> {
    fs: &'a Fs,
    a: &'a RestoreArgs,
    /// DIR, symlinks resolved.
    target: PathBuf,
    root_user: bool,
    /// DIR has a default ACL, so created entries inherit ACLs the image may not have.
    strip_acls: bool,
    sectorsize: u64,
    /// First restored path of each inode with nlink > 1: (target path, relative path, links
    /// still to come).
    links: HashMap<Inode, (PathBuf, PathBuf, u64)>,
    dirs_seen: HashSet<Inode>,
    c: Counts,
    progress: Progress,
}

fn show(rel: &Path) -> std::path::Display<'_> {
    if rel.as_os_str().is_empty() {
        Path::new(".").display()
    } else {
        rel.display()
    }
}

fn cpath(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

fn check_ret(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets atime and mtime of `path` itself (not a symlink's target).
fn set_times_nofollow(path: &std::ffi::CStr, times: &[libc::timespec; 2]) -> std::io::Result<()> {
    // SAFETY: path is NUL-terminated and `times` holds two timespecs.
    check_ret(unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            path.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
}

/// A directory entry name that is safe to create under its parent.
fn valid_name(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.contains(&b'/') && !name.contains(&0)
}

/// Errors on the target that make going on pointless.
fn fatal_target_error(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EROFS)
    )
}

/// The target's `dev_t` for a btrfs rdev (the kernel's internal encoding: major << 20 | minor).
fn dev_from_btrfs(rdev: u64) -> libc::dev_t {
    let r = rdev as u32;
    libc::makedev(r >> 20, r & 0xfffff)
}

fn is_zero(b: &[u8]) -> bool {
    b.iter().fold(0u8, |acc, &x| acc | x) == 0
}

impl<'a> Restorer<'a> {
    fn new(fs: &'a Fs, a: &'a RestoreArgs) -> Self {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root_user = unsafe { libc::geteuid() } == 0;
        // DIR itself may be a symlink to a directory: its metadata goes to the directory.
        let target = std::fs::canonicalize(&a.dir).unwrap_or_else(|_| a.dir.clone());
        let strip_acls = !a.dry_run && has_xattr(&target, ACL_DEFAULT);
        let stderr_tty = std::io::stderr().is_terminal();
        Restorer {
            fs,
            a,
            target,
            root_user,
            strip_acls,
            sectorsize: u64::from(fs.sectorsize()).max(512),
            links: HashMap::new(),
            dirs_seen: HashSet::new(),
            c: Counts::default(),
            progress: Progress {
                on: a.progress || stderr_tty,
                tty: stderr_tty,
                last: Instant::now(),
                shown: false,
            },
        }
    }

    fn error(&mut self, rel: &Path, msg: impl Display) {
        self.progress.clear();
        ewriteln!("butter: {}: {msg}", show(rel));
        self.c.errors += 1;
    }

    fn warn(&mut self, rel: &Path, msg: impl Display) {
        self.progress.clear();
        ewriteln!("butter: warning: {}: {msg}", show(rel));
        self.c.warnings += 1;
    }

    /// Reports an error of the target filesystem; stops the restore when it is full or
    /// read-only.
    fn target_error(&mut self, rel: &Path, what: &str, e: std::io::Error) -> CliResult {
        if fatal_target_error(&e) {
            self.progress.clear();
            return Err(CliError(format!(
                "{}: {what}: {e}\n  stopping: the target cannot take more (restored {} files so far)",
                show(rel),
                self.c.files
            )));
        }
        self.error(rel, format!("{what}: {e}"));
        Ok(())
    }

    /// A line on stdout (dry-run listing, -v). Failing to write stdout stops the restore.
    fn say(&mut self, line: std::fmt::Arguments) -> CliResult {
        self.progress.clear();
        let out = std::io::stdout();
        let mut out = out.lock();
        writeln!(out, "{line}").map_err(|e| CliError(format!("writing to stdout: {e}")))
    }

    fn run(&mut self, start: Inode, st: Stat) -> CliResult {
        self.dirs_seen.insert(start);
        let mut stack = vec![Frame::new(start, st, self.target.clone(), PathBuf::new())];
        while let Some(top) = stack.last_mut() {
            if let Some(e) = top.batch.next() {
                if !valid_name(&e.name) {
                    let rel = top.rel.clone();
                    self.error(
                        &rel,
                        format!(
                            "skipping entry with invalid name {:?} (damaged directory)",
                            String::from_utf8_lossy(&e.name)
                        ),
                    );
                    continue;
                }
                let name = OsStr::from_bytes(&e.name);
                let path = top.path.join(name);
                let rel = top.rel.join(name);
                let parent = (top.dir, top.stat.atime);
                if let Some(f) = self.entry(parent, e, path, rel)? {
                    stack.push(f);
                }
                continue;
            }
            if !top.done {
                match self.fs.readdir(top.dir, top.after, BATCH) {
                    Ok(v) => {
                        top.done = v.len() < BATCH;
                        if let Some(l) = v.last() {
                            top.after = l.index;
                        }
                        top.batch = v.into_iter();
                    }
                    Err(e) => {
                        top.done = true;
                        let rel = top.rel.clone();
                        self.error(&rel, format!("reading directory: {e}"));
                    }
                }
                continue;
            }
            if let Some(f) = stack.pop() {
                if !self.a.dry_run {
                    self.set_meta(&f.path, &f.rel, f.dir, &f.stat, Kind::Dir)?;
                }
            }
        }
        Ok(())
    }

    /// Restores one directory entry; returns the frame to descend into for a directory.
    /// `parent` is the directory holding the entry and its atime.
    fn entry(
        &mut self,
        parent: (Inode, Timespec),
        e: DirEntry,
        path: PathBuf,
        rel: PathBuf,
    ) -> Result<Option<Frame>, CliError> {
        self.progress.tick(&self.c);
        let dry = self.a.dry_run;
        let ino = e.target;
        // A subvolume below, or the empty directory the kernel shows where a snapshot names a
        // subvolume nested in its source.
        let placeholder = ino.ino == EMPTY_SUBVOL_DIR_OBJECTID;
        if (ino.root != parent.0.root || placeholder) && self.a.no_subvols {
            self.c.skipped_subvols += 1;
            if dry || self.a.verbose {
                self.say(format_args!("skip     {} (subvolume)", rel.display()))?;
            }
            return Ok(None);
        }
        if placeholder {
            self.stub_dir(&path, &rel, parent.1)?;
            return Ok(None);
        }
        let st = match self.fs.stat(ino) {
            Ok(s) => s,
            Err(err) => {
                self.error(&rel, err);
                return Ok(None);
            }
        };
        let fmt = st.mode & S_IFMT;
        if fmt == S_IFDIR {
            if !self.dirs_seen.insert(ino) {
                self.error(
                    &rel,
                    format!(
                        "directory inode {} of subvolume {} was already restored elsewhere (loop in a damaged image); not entered again",
                        ino.ino, ino.root
                    ),
                );
                return Ok(None);
            }
            if dry {
                self.say(format_args!("mkdir    {}", rel.display()))?;
            } else {
                if let Err(err) = self.make_dir(&path) {
                    self.target_error(&rel, "mkdir", err)?;
                    return Ok(None);
                }
                if self.a.verbose {
                    self.say(format_args!("{}", rel.display()))?;
                }
            }
            self.c.dirs += 1;
            self.c.files += 1;
            return Ok(Some(Frame::new(ino, st, path, rel)));
        }

        if st.nlink > 1 {
            if let Some((first, first_rel, left)) = self.links.get_mut(&ino) {
                // Forget the inode once all its links are restored.
                *left = left.saturating_sub(1);
                let (first, first_rel) = if *left == 0 {
                    self.links
                        .remove(&ino)
                        .map(|(f, r, _)| (f, r))
                        .unwrap_or_default()
                } else {
                    (first.clone(), first_rel.clone())
                };
                if dry {
                    self.say(format_args!(
                        "link     {} => {}",
                        rel.display(),
                        first_rel.display()
                    ))?;
                } else {
                    let r = self
                        .clear_way(&path)
                        .and_then(|_| std::fs::hard_link(&first, &path));
                    if let Err(err) = r {
                        self.target_error(&rel, "link", err)?;
                        return Ok(None);
                    }
                    if self.a.verbose {
                        self.say(format_args!("{}", rel.display()))?;
                    }
                }
                self.c.hardlinks += 1;
                self.c.files += 1;
                return Ok(None);
            }
        }

        let kind = if fmt == S_IFLNK {
            Kind::Symlink
        } else {
            Kind::Other
        };
        let created = match fmt {
            S_IFREG => self.regular(ino, &st, &path, &rel)?,
            S_IFLNK => self.symlink(ino, &path, &rel)?,
            S_IFCHR | S_IFBLK | S_IFIFO | S_IFSOCK => self.special(&st, &path, &rel)?,
            _ => {
                self.error(
                    &rel,
                    format!(
                        "inode {} has unknown file type (mode {:o})",
                        ino.ino, st.mode
                    ),
                );
                false
            }
        };
        if !created {
            return Ok(None);
        }
        self.c.files += 1;
        if !dry {
            if self.a.verbose {
                self.say(format_args!("{}", rel.display()))?;
            }
            self.set_meta(&path, &rel, ino, &st, kind)?;
        }
        if st.nlink > 1 {
            let left = u64::from(st.nlink) - 1;
            self.links.insert(ino, (path, rel, left));
        }
        Ok(None)
    }

    /// The empty directory the kernel shows in place of a nested subvolume a snapshot does not
    /// contain: mode 0755, owned by root, atime of its parent, mtime the time of lookup.
    fn stub_dir(&mut self, path: &Path, rel: &Path, parent_atime: Timespec) -> CliResult {
        if self.a.dry_run {
            self.c.dirs += 1;
            self.c.files += 1;
            return self.say(format_args!(
                "mkdir    {} (empty: a subvolume the snapshot does not contain)",
                rel.display()
            ));
        }
        if let Err(e) = self.make_dir(path) {
            return self.target_error(rel, "mkdir", e);
        }
        if self.a.verbose {
            self.say(format_args!("{}", rel.display()))?;
        }
        self.c.dirs += 1;
        self.c.files += 1;
        let r = cpath(path).and_then(|c| {
            if self.root_user {
                // SAFETY: c is a valid NUL-terminated path.
                check_ret(unsafe { libc::lchown(c.as_ptr(), 0, 0) })?;
            }
            // SAFETY: as above.
            check_ret(unsafe { libc::chmod(c.as_ptr(), 0o755) })?;
            let mut mtime = timespec(Timespec { sec: 0, nsec: 0 });
            mtime.tv_nsec = libc::UTIME_OMIT;
            let times = [timespec(parent_atime), mtime];
            set_times_nofollow(&c, &times)
        });
        if let Err(e) = r {
            self.target_error(rel, "set metadata", e)?;
        }
        Ok(())
    }

    /// Creates a directory (mode 0700 until its own mode is applied after its children). With
    /// --force an existing directory is reused and a non-directory replaced.
    fn make_dir(&self, path: &Path) -> std::io::Result<()> {
        let mut b = std::fs::DirBuilder::new();
        b.mode(0o700);
        match b.create(path) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && self.a.force => {
                let m = std::fs::symlink_metadata(path)?;
                if m.is_dir() {
                    return Ok(());
                }
                std::fs::remove_file(path)?;
                b.create(path)
            }
            r => r,
        }
    }

    /// With --force, removes a non-directory standing where an entry is to be created.
    fn clear_way(&self, path: &Path) -> std::io::Result<()> {
        if !self.a.force {
            return Ok(());
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a directory is in the way",
            )),
            Ok(_) => std::fs::remove_file(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn symlink(&mut self, ino: Inode, path: &Path, rel: &Path) -> Result<bool, CliError> {
        let target = match self.fs.readlink(ino) {
            Ok(t) => t,
            Err(e) => {
                self.error(rel, e);
                return Ok(false);
            }
        };
        if target.contains(&0) {
            self.error(rel, "symlink target contains a NUL byte (damaged inode)");
            return Ok(false);
        }
        let t = OsStr::from_bytes(&target);
        if self.a.dry_run {
            self.say(format_args!(
                "symlink  {} -> {}",
                rel.display(),
                Path::new(t).display()
            ))?;
        } else {
            let r = self
                .clear_way(path)
                .and_then(|_| std::os::unix::fs::symlink(t, path));
            if let Err(e) = r {
                self.target_error(rel, "symlink", e)?;
                return Ok(false);
            }
        }
        self.c.symlinks += 1;
        Ok(true)
    }

    fn special(&mut self, st: &Stat, path: &Path, rel: &Path) -> Result<bool, CliError> {
        let fmt = st.mode & S_IFMT;
        let dev = if fmt == S_IFCHR || fmt == S_IFBLK {
            dev_from_btrfs(st.rdev)
        } else {
            0
        };
        if self.a.dry_run {
            let what = match fmt {
                S_IFCHR => format!(
                    "mknod    {} (char {}:{})",
                    rel.display(),
                    libc::major(dev),
                    libc::minor(dev)
                ),
                S_IFBLK => format!(
                    "mknod    {} (block {}:{})",
                    rel.display(),
                    libc::major(dev),
                    libc::minor(dev)
                ),
                S_IFIFO => format!("mkfifo   {}", rel.display()),
                _ => format!("socket   {}", rel.display()),
            };
            self.say(format_args!("{what}"))?;
        } else {
            let r = self.clear_way(path).and_then(|_| {
                let c = cpath(path)?;
                // SAFETY: c is a valid NUL-terminated path.
                check_ret(unsafe { libc::mknod(c.as_ptr(), fmt | 0o600, dev) })
            });
            if let Err(e) = r {
                self.target_error(rel, "mknod", e)?;
                return Ok(false);
            }
        }
        self.c.special += 1;
        Ok(true)
    }

    /// Creates a regular file and copies its content, sparse. Returns whether the file exists
    /// now (even with unreadable parts, which are reported).
    fn regular(
        &mut self,
        ino: Inode,
        st: &Stat,
        path: &Path,
        rel: &Path,
    ) -> Result<bool, CliError> {
        if self.a.dry_run {
            self.say(format_args!(
                "file     {} ({} bytes)",
                rel.display(),
                st.size
            ))?;
            self.c.regular += 1;
            return Ok(true);
        }
        let f = self.clear_way(path).and_then(|_| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(path)
        });
        let f = match f {
            Ok(f) => f,
            Err(e) => {
                self.target_error(rel, "create", e)?;
                return Ok(false);
            }
        };
        self.c.regular += 1;
        let (data, prealloc) = match self.fs.file_ranges(ino, st.size, CHUNK) {
            Ok(m) => (m.data, m.prealloc),
            // Read everything: the reads report the damage and save what they can.
            Err(_) => (vec![(0, st.size)], Vec::new()),
        };
        let mut bad_bytes = 0u64;
        let mut first_err: Option<butter::Error> = None;
        for (lo, hi) in data {
            let mut off = lo;
            while off < hi {
                let n = (hi - off).min(CHUNK - off % CHUNK);
                self.progress.tick(&self.c);
                match self.fs.read(ino, off, n as usize) {
                    Ok(buf) => {
                        if let Err(e) = self.write_sparse(&f, off, &buf) {
                            self.target_error(rel, "write", e)?;
                            return Ok(true);
                        }
                    }
                    Err(e) => {
                        let salvage = !matches!(e, butter::Error::Unsupported(_));
                        if first_err.is_none() {
                            first_err = Some(e);
                        }
                        if !salvage {
                            bad_bytes += n;
                        } else if let Err(e) = self.salvage(ino, &f, off, n, &mut bad_bytes) {
                            self.target_error(rel, "write", e)?;
                            return Ok(true);
                        }
                    }
                }
                off += n;
            }
        }
        if let Err(e) = f.set_len(st.size) {
            self.target_error(rel, "truncate", e)?;
            return Ok(true);
        }
        for (lo, hi) in prealloc {
            // Keep preallocated ranges allocated, as `du` shows them on the image; a target
            // that cannot fallocate just leaves holes.
            let mode = if hi > st.size {
                libc::FALLOC_FL_KEEP_SIZE
            } else {
                0
            };
            // SAFETY: plain syscall on an open file descriptor.
            unsafe {
                libc::fallocate(
                    std::os::unix::io::AsRawFd::as_raw_fd(&f),
                    mode,
                    lo as libc::off_t,
                    (hi - lo) as libc::off_t,
                );
            }
        }
        if let Some(e) = first_err {
            self.error(
                rel,
                format!("{bad_bytes} bytes unreadable, left as zeros (first error: {e})"),
            );
        }
        Ok(true)
    }

    /// Retries a failed chunk sector by sector; unreadable sectors stay holes.
    fn salvage(
        &mut self,
        ino: Inode,
        f: &std::fs::File,
        off: u64,
        n: u64,
        bad: &mut u64,
    ) -> std::io::Result<()> {
        let ss = self.sectorsize;
        let end = off.saturating_add(n);
        let mut s = off;
        while s < end {
            let len = (end - s).min(ss - s % ss);
            match self.fs.read(ino, s, len as usize) {
                Ok(buf) => self.write_sparse(f, s, &buf)?,
                Err(_) => *bad += len,
            }
            s += len;
        }
        Ok(())
    }

    /// Writes `buf` (file bytes at `off`), skipping sector-aligned all-zero sectors.
    fn write_sparse(&mut self, f: &std::fs::File, off: u64, buf: &[u8]) -> std::io::Result<()> {
        let ss = self.sectorsize;
        let mut i = 0usize;
        let mut run: Option<usize> = None; // start index of pending non-zero run
        while i < buf.len() {
            let pos = off + i as u64;
            let blk = ((ss - pos % ss) as usize).min(buf.len() - i);
            let zero = is_zero(&buf[i..i + blk]);
            match (zero, run) {
                (false, None) => run = Some(i),
                (true, Some(r)) => {
                    f.write_all_at(&buf[r..i], off + r as u64)?;
                    self.c.bytes += (i - r) as u64;
                    run = None;
                }
                _ => {}
            }
            i += blk;
        }
        if let Some(r) = run {
            f.write_all_at(&buf[r..], off + r as u64)?;
            self.c.bytes += (buf.len() - r) as u64;
        }
        Ok(())
    }

    /// Owner, xattrs, mode, times, in that order (see the module comment).
    fn set_meta(
        &mut self,
        path: &Path,
        rel: &Path,
        ino: Inode,
        st: &Stat,
        kind: Kind,
    ) -> CliResult {
        let c = match cpath(path) {
            Ok(c) => c,
            Err(e) => {
                self.error(rel, e);
                return Ok(());
            }
        };
        if self.root_user {
            // SAFETY: c is a valid NUL-terminated path.
            if let Err(e) = check_ret(unsafe { libc::lchown(c.as_ptr(), st.uid, st.gid) }) {
                self.target_error(rel, "chown", e)?;
            }
        }
        let xattrs = match self.fs.xattrs(ino) {
            Ok(x) => x,
            Err(e) => {
                self.error(rel, format!("reading xattrs: {e}"));
                Vec::new()
            }
        };
        if self.strip_acls {
            for n in [ACL_ACCESS, ACL_DEFAULT] {
                if !xattrs.iter().any(|(x, _)| x == n) {
                    if let Ok(cn) = CString::new(n) {
                        // Inherited from DIR's default ACL; absent in the image. Failure
                        // (nothing to remove) is fine.
                        // SAFETY: both are valid NUL-terminated strings.
                        unsafe { libc::lremovexattr(c.as_ptr(), cn.as_ptr()) };
                    }
                }
            }
        }
        for (name, value) in &xattrs {
            let shown = String::from_utf8_lossy(name);
            // Without root, only user.* and ACLs can be set.
            let settable =
                self.root_user || name.starts_with(b"user.") || name.starts_with(b"system.");
            if !settable {
                continue;
            }
            let Ok(cn) = CString::new(name.as_slice()) else {
                self.error(rel, format!("xattr name {shown:?} contains a NUL byte"));
                continue;
            };
            // SAFETY: valid strings; value pointer and length describe a live slice.
            let r = check_ret(unsafe {
                libc::lsetxattr(
                    c.as_ptr(),
                    cn.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    0,
                )
            });
            if let Err(e) = r {
                if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                    self.warn(
                        rel,
                        format!("xattr {shown}: not supported by the target: {e}"),
                    );
                } else {
                    self.target_error(rel, &format!("xattr {shown}"), e)?;
                }
            }
        }
        if kind != Kind::Symlink {
            // SAFETY: c is a valid NUL-terminated path.
            let r = check_ret(unsafe {
                libc::fchmodat(libc::AT_FDCWD, c.as_ptr(), st.mode & 0o7777, 0)
            });
            if let Err(e) = r {
                self.target_error(rel, "chmod", e)?;
            }
        }
        let mut times = [timespec(st.atime), timespec(st.mtime)];
        for (t, what) in times.iter_mut().zip(["atime", "mtime"]) {
            if t.tv_nsec >= 1_000_000_000 || t.tv_nsec < 0 {
                self.error(
                    rel,
                    format!("{what} nanoseconds {} out of range; using 0", t.tv_nsec),
                );
                t.tv_nsec = 0;
            }
        }
        let r = set_times_nofollow(&c, &times);
        if let Err(e) = r {
            self.target_error(rel, "set times", e)?;
        }
        Ok(())
    }
}

fn timespec(t: Timespec) -> libc::timespec {
    // SAFETY: timespec is plain data; all-zero is a valid value (and fills any padding).
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    ts.tv_sec = t.sec as libc::time_t;
    ts.tv_nsec = t.nsec as _;
    ts
}

fn has_xattr(p: &Path, name: &[u8]) -> bool {
    let (Ok(c), Ok(n)) = (cpath(p), CString::new(name)) else {
        return false;
    };
    // SAFETY: valid strings; a NULL buffer with size 0 asks for the value's size only.
    unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), std::ptr::null_mut(), 0) >= 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name(b"a"));
        assert!(valid_name(b"..."));
        for bad in [&b""[..], b".", b"..", b"a/b", b"/", b"a\0"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn rdev() {
        let d = dev_from_btrfs((300 << 20) | 70000);
        assert_eq!((libc::major(d), libc::minor(d)), (300, 70000));
        let d = dev_from_btrfs((1 << 20) | 3);
        assert_eq!((libc::major(d), libc::minor(d)), (1, 3));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(10), "10 B");
        assert_eq!(human(3 << 20), "3.0 MiB");
    }
}
