//! `butter mount IMAGE DIR`: serve an image through FUSE, read-write (or read-only with `--ro`
//! / `-o ro`), in the foreground until it is unmounted (`fusermount3 -u DIR`, `umount DIR`) or
//! the process gets SIGINT/SIGTERM (then it unmounts and exits 0); the end of the mount
//! commits. `-d`/`--daemon` returns once the mount is usable and serves in the background.
//!
//! Read-write: one writer per image. The image is locked (see `Fs::open_rw`), so a second
//! read-write mount, or one of an image the kernel has mounted, is refused with a message.
//! Changes are durable at each commit: every `-o commit=SECONDS` (30 by default) and at
//! unmount (not at close, as on the kernel), and a file's changes at its fsync, which writes
//! the btrfs fsync log (`-o fsync=commit` makes every fsync a full commit instead). SIGKILL
//! loses what came after the last commit or fsync and nothing else; the next read-write open
//! (butter's or the kernel's) replays the log.

use super::{open_fs, CliError, CliResult};
use crate::fuse::{self, MountConfig};
use butter::format::FS_TREE_OBJECTID;
use butter::fs::{Fs, Inode};
use fuser::MountOption;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct MountArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Mount point: an existing directory.
    pub dir: PathBuf,
    /// Mount read-only.
    #[arg(long)]
    pub ro: bool,
    /// Mount options, comma separated, may repeat: ro, rw, nologreplay (also rescue=nologreplay
    /// or norecovery; with ro: ignore an fsync log, show the last commit), commit=SECONDS
    /// (read-write: commit this often, default 30, 0 = only at fsync/unmount),
    /// fsync=log|log-wait|commit (what an fsync writes: the fsync log, the default; the fsync
    /// log after waiting for the file's writes in progress, for comparison; or a full commit,
    /// also notreelog), allow_other,
    /// allow_root, fsname=NAME, subtype=NAME, subvol=PATH, subvolid=N, dev, nodev, suid,
    /// nosuid, exec, noexec, atime, noatime, compress[=ALG[:LEVEL]] (compress written data:
    /// zlib 1-9, lzo, zstd -15 to 15; zlib:3 when ALG is not given), compress-force[=ALG[:LEVEL]]
    /// (every file, even one whose start does not compress), compress=no, max_inline=BYTES
    /// (files up to this size are kept in the metadata, inline; default 2048),
    /// allocator=scalable|legacy (the block allocator: the scalable one, the default, or the
    /// older one, for benchmarks), delalloc|nodelalloc (appends gather in memory before
    /// they are allocated, the default; or each write is allocated when it comes),
    /// bulk|nobulk (large writes run on threads of their own, one per CPU, the default; or
    /// on the thread that took the request), entry_timeout=SECONDS, attr_timeout=SECONDS,
    /// negative_timeout=SECONDS (how long the kernel caches names, attributes and names
    /// found missing; default 60 each), keep_cache|nokeep_cache (file pages and directory
    /// listings kept across opens; default on), killpriv|nokillpriv (butter
    /// clears set-id bits on write, so the kernel stops asking for security.capability before
    /// each write; default on), cache=strict (all of these off, 1 s timeouts: read-write
    /// caching as before) or cache=default, uring=auto|on|off (requests through FUSE over
    /// io_uring when the kernel offers it, Linux 6.14 and later with the fuse module's
    /// enable_uring set; on: the same, with a warning when it does not; off: /dev/fuse
    /// only; default auto), cache_size=SIZE (memory for tree blocks: half for the block
    /// cache, half for the blocks changed since the last commit, past which a change
    /// commits; and one inode the kernel may hold per 4 KiB of it, past which butter asks
    /// the kernel to drop unused ones; default 512M, at least 1M), device=PATH (another device
    /// of a filesystem of several; repeat for each; read-only for now), degraded (mount one
    /// with devices missing, where its profiles keep every byte readable). Accepted and
    /// ignored, as options that change
    /// nothing for an image: defaults, relatime and the other atime variants, lazytime,
    /// space_cache[=v1|v2], ssd, nossd, ssd_spread, discard[=sync|async], nodiscard,
    /// autodefrag, user_subvol_rm_allowed, barrier, flushoncommit, thread_pool=N,
    /// mount(8)'s auto, noauto, nofail, user, _netdev, and every x-* option.
    #[arg(
        short = 'o',
        value_name = "OPTIONS",
        value_parser = super::docs::suggest(
            clap::builder::StringValueParser::new(),
            super::docs::MOUNT_OPTIONS
        ),
        hide_possible_values = true
    )]
    pub options: Vec<String>,
    /// Mount this subvolume (path from the top-level subvolume) instead of the default one.
    #[arg(long, value_name = "PATH", conflicts_with = "subvol_id")]
    pub subvol: Option<String>,
    /// Mount the subvolume with this id (5 is the top level).
    #[arg(long, value_name = "N")]
    pub subvol_id: Option<u64>,
    /// Let users other than the one mounting see the files (FUSE allow_other).
    #[arg(long)]
    pub allow_other: bool,
    /// Worker threads serving requests.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub threads: usize,
    /// Serve in the background: exit 0 once the mount is usable (1 if mounting failed).
    #[arg(short = 'd', long)]
    pub daemon: bool,
    /// Run as mount(8)'s helper (`mount.fuse.butter`): record the mount for umount(8).
    #[arg(long, hide = true)]
    pub as_mount_helper: bool,
}

/// Default interval of periodic commits (seconds), as the kernel's btrfs.
const DEFAULT_COMMIT: u64 = 30;

/// Which subvolume becomes the mount's root.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Subvol {
    Default,
    Path(String),
    Id(u64),
}

/// The command line, with the `-o` list folded in.
#[derive(Debug)]
struct Plan {
    ro: bool,
    /// `nologreplay`: show the last commit and leave an fsync log alone (read-only only).
    nologreplay: bool,
    /// fsync writes the log tree (else commits).
    fsync_log: bool,
    /// fsync logs pending ordered extents as they are (the fsync rule that skips writes in
    /// progress; off: `fsync=log-wait`).
    fsync_rule: bool,
    /// Appends gather in memory before allocation (`nodelalloc`: each write is allocated and
    /// written when it comes).
    delalloc: bool,
    /// `compress=` / `compress-force=`.
    compress: Option<butter::format::compress::Compression>,
    compress_force: bool,
    /// `max_inline=`.
    max_inline: u64,
    /// `allocator=legacy`: the block allocator from before seed 001 (for benchmarks).
    legacy_allocator: bool,
    subvol: Subvol,
    cfg: MountConfig,
}

fn plan(a: &MountArgs) -> Result<Plan, CliError> {
    let mut ro = a.ro;
    let mut rw = false;
    let mut nologreplay = false;
    let mut fsync_log = true;
    let mut fsync_rule = true;
    let mut delalloc = true;
    let mut compress = None;
    let mut compress_force = false;
    let mut max_inline = butter::inode::file::DEFAULT_MAX_INLINE;
    let mut legacy_allocator = false;
    let mut subvol = match (&a.subvol, a.subvol_id) {
        (Some(p), _) => Subvol::Path(p.clone()),
        (None, Some(id)) => Subvol::Id(id),
        (None, None) => Subvol::Default,
    };
    let mut cfg = MountConfig {
        fsname: "butter".into(),
        subtype: "butter".into(),
        allow_other: a.allow_other,
        allow_root: false,
        flags: Vec::new(),
        threads: a.threads.max(1),
        commit_interval: Some(Duration::from_secs(DEFAULT_COMMIT)),
        bulk: true,
        caching: crate::fuse::Caching::READ_WRITE,
        uring: crate::fuse::Uring::Auto,
        cache_size: crate::fuse::DEFAULT_CACHE_SIZE,
    };
    for opt in a.options.iter().flat_map(|o| o.split(',')) {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        let flag = match (key, value) {
            ("", None) => None,
            ("ro", None) => {
                ro = true;
                None
            }
            ("rw", None) => {
                rw = true;
                None
            }
            ("commit", Some(v)) => {
                let secs: u64 = v
                    .parse()
                    .map_err(|_| CliError(format!("commit={v}: not a number of seconds")))?;
                cfg.commit_interval = Some(Duration::from_secs(secs));
                None
            }
            ("nologreplay", None) => {
                nologreplay = true;
                None
            }
            ("delalloc", None) => {
                delalloc = true;
                None
            }
            ("nodelalloc", None) => {
                delalloc = false;
                None
            }
            ("bulk", None) => {
                cfg.bulk = true;
                None
            }
            ("nobulk", None) => {
                cfg.bulk = false;
                None
            }
            ("entry_timeout" | "attr_timeout" | "negative_timeout", Some(v)) => {
                let t = v
                    .parse::<f64>()
                    .ok()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .ok_or_else(|| CliError(format!("{key}={v}: not a number of seconds")))?;
                let c = &mut cfg.caching;
                *match key {
                    "entry_timeout" => &mut c.entry,
                    "attr_timeout" => &mut c.attr,
                    _ => &mut c.negative,
                } = t;
                None
            }
            ("keep_cache" | "nokeep_cache", None) => {
                cfg.caching.keep_cache = key == "keep_cache";
                None
            }
            ("killpriv" | "nokillpriv", None) => {
                cfg.caching.killpriv = key == "killpriv";
                None
            }
            ("cache", Some("strict")) => {
                cfg.caching = crate::fuse::Caching::STRICT;
                None
            }
            ("cache", Some("default")) => {
                cfg.caching = crate::fuse::Caching::READ_WRITE;
                None
            }
            ("cache_size", Some(v)) => {
                let n = crate::cmd::mkfs::parse_size(v)
                    .map_err(|e| CliError(format!("cache_size={v}: {e}")))?;
                if n < 1 << 20 {
                    return Err(CliError(format!(
                        "cache_size={v}: at least 1M (tree blocks for the cache and for \
                         the changes since the last commit)"
                    )));
                }
                cfg.cache_size = n;
                None
            }
            ("uring", Some(v)) => {
                cfg.uring = v.parse().map_err(CliError)?;
                None
            }
            ("cache", Some(v)) => {
                return Err(CliError(format!(
                    "cache={v}: expected cache=default or cache=strict"
                )))
            }
            ("compress" | "compress-force", v) => {
                compress = match v {
                    None => Some(butter::format::compress::Compression::ZLIB),
                    Some(v) => butter::format::compress::Compression::parse(v)
                        .map_err(|e| CliError(format!("{key}={v}: {}", CliError::from(e))))?,
                };
                compress_force = key == "compress-force" && compress.is_some();
                None
            }
            ("max_inline", Some(v)) => {
                max_inline = crate::cmd::mkfs::parse_size(v)
                    .map_err(|e| CliError(format!("max_inline={v}: {e}")))?;
                None
            }
            ("allocator", Some("scalable")) => {
                legacy_allocator = false;
                None
            }
            ("allocator", Some("legacy")) => {
                legacy_allocator = true;
                None
            }
            ("allocator", Some(v)) => {
                return Err(CliError(format!(
                    "allocator={v}: expected allocator=scalable (the default) or \
                     allocator=legacy"
                )))
            }
            ("fsync", Some("log")) => {
                (fsync_log, fsync_rule) = (true, true);
                None
            }
            ("fsync", Some("log-wait")) => {
                (fsync_log, fsync_rule) = (true, false);
                None
            }
            ("fsync", Some("commit")) => {
                fsync_log = false;
                None
            }
            ("fsync", Some(v)) => {
                return Err(CliError(format!(
                    "fsync={v}: expected fsync=log, fsync=log-wait or fsync=commit"
                )))
            }
            ("allow_other", None) => {
                cfg.allow_other = true;
                None
            }
            ("allow_root", None) => {
                cfg.allow_root = true;
                None
            }
            // Always on: the kernel checks permissions from the modes we report.
            ("default_permissions", None) => None,
            ("fsname", Some(v)) if !v.is_empty() => {
                cfg.fsname = v.to_string();
                None
            }
            ("subtype", Some(v)) if !v.is_empty() => {
                cfg.subtype = v.to_string();
                None
            }
            ("subvol", Some(v)) => {
                subvol = Subvol::Path(v.to_string());
                None
            }
            ("subvolid", Some(v)) => {
                let id = v
                    .parse()
                    .map_err(|_| CliError(format!("subvolid={v}: not a number")))?;
                subvol = Subvol::Id(id);
                None
            }
            // The kernel's spelling for the other devices of a filesystem of several.
            ("device", Some(v)) if !v.is_empty() => {
                super::other_devices().paths.push(v.into());
                None
            }
            ("degraded", None) => {
                super::other_devices().degraded = true;
                None
            }
            ("dev", None) => Some(MountOption::Dev),
            ("nodev", None) => Some(MountOption::NoDev),
            ("suid", None) => Some(MountOption::Suid),
            ("nosuid", None) => Some(MountOption::NoSuid),
            ("exec", None) => Some(MountOption::Exec),
            ("noexec", None) => Some(MountOption::NoExec),
            ("atime", None) => Some(MountOption::Atime),
            ("noatime", None) => Some(MountOption::NoAtime),
            // The kernel's btrfs without a log tree: every fsync commits.
            ("notreelog", None) => {
                fsync_log = false;
                None
            }
            ("treelog", None) => {
                fsync_log = true;
                None
            }
            ("rescue", Some("nologreplay")) | ("norecovery", None) => {
                nologreplay = true;
                None
            }
            // What users and fstab lines write that the kernel's btrfs accepts and that
            // changes nothing here: taken and ignored, as the kernel ignores what does not
            // apply (no discard on an image file, no SSD heuristics, space_cache is always
            // the free space tree butter keeps, mount(8)'s own and x- options).
            (
                "defaults"
                | "auto"
                | "noauto"
                | "nofail"
                | "_netdev"
                | "user"
                | "nouser"
                | "users"
                | "owner"
                | "group"
                | "async"
                | "relatime"
                | "norelatime"
                | "strictatime"
                | "nostrictatime"
                | "lazytime"
                | "nolazytime"
                | "diratime"
                | "nodiratime"
                | "iversion"
                | "noiversion"
                | "ssd"
                | "nossd"
                | "ssd_spread"
                | "nossd_spread"
                | "discard"
                | "nodiscard"
                | "autodefrag"
                | "noautodefrag"
                | "user_subvol_rm_allowed"
                | "barrier"
                | "nobarrier"
                | "flushoncommit"
                | "noflushoncommit"
                | "space_cache"
                | "nospace_cache"
                | "clear_cache"
                | "skip_balance"
                | "rescan_uuid_tree"
                | "enospc_debug"
                | "noenospc_debug"
                | "datacow"
                | "datasum"
                | "acl",
                None,
            ) => None,
            ("space_cache", Some("v1" | "v2"))
            | ("discard", Some("sync" | "async"))
            | ("thread_pool" | "metadata_ratio" | "uhelper", Some(_))
            | ("fatal_errors", Some("bug" | "panic")) => None,
            (k, _) if k.starts_with("x-") || k.starts_with("comment") => None,
            _ => return Err(CliError(format!("unknown mount option '{opt}'"))),
        };
        cfg.flags.extend(flag);
    }
    if rw {
        ro = false;
    }
    // As root, device nodes and set-id programs work unless refused, as on any mount that
    // mount(8) makes (the kernel's btrfs on a loop device included); FUSE's own default,
    // which fusermount3 enforces for other users, is nodev,nosuid.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        for (on, off) in [
            (MountOption::Dev, MountOption::NoDev),
            (MountOption::Suid, MountOption::NoSuid),
        ] {
            if !cfg.flags.iter().any(|f| *f == on || *f == off) {
                cfg.flags.push(on);
            }
        }
    }
    if nologreplay && !ro {
        return Err(CliError(
            "nologreplay needs a read-only mount (-o ro,nologreplay): a read-write mount must \
             replay the fsync log first"
                .into(),
        ));
    }
    Ok(Plan {
        ro,
        nologreplay,
        fsync_log,
        fsync_rule,
        delalloc,
        compress,
        compress_force,
        max_inline,
        legacy_allocator,
        subvol,
        cfg,
    })
}

/// The root directory of the subvolume to mount. `subvol=` paths start at the top-level
/// subvolume (id 5), as with the kernel, and must name a subvolume.
fn subvol_root(fs: &Fs, s: &Subvol) -> Result<Inode, CliError> {
    match s {
        Subvol::Default => Ok(fs.root_inode()),
        Subvol::Id(id) => fs.subvol_root_inode(*id).map_err(|e| match e {
            butter::Error::NotFound(_) => CliError(format!("no subvolume with id {id}")),
            e => e.into(),
        }),
        Subvol::Path(path) => {
            let mut cur = fs.subvol_root_inode(FS_TREE_OBJECTID)?;
            for comp in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
                if !fs.stat(cur)?.is_dir() {
                    return Err(CliError(format!("subvol {path}: not a directory")));
                }
                cur = fs
                    .lookup(cur, comp.as_bytes())?
                    .ok_or_else(|| CliError(format!("subvol {path}: no such file or directory")))?
                    .target;
            }
            if cur != fs.subvol_root_inode(cur.root)? {
                return Err(CliError(format!("subvol {path}: not a subvolume")));
            }
            Ok(cur)
        }
    }
}

pub fn mount(a: MountArgs) -> CliResult {
    let p = plan(&a)?;
    match std::fs::metadata(&a.dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(CliError(format!(
                "mount point {} is not a directory",
                a.dir.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CliError(format!(
                "mount point {} does not exist: create it first (mkdir -p {})",
                a.dir.display(),
                a.dir.display()
            )))
        }
        Err(e) => return Err(CliError(format!("mount point {}: {e}", a.dir.display()))),
    }
    // Before anything starts a thread: fork(2) copies only the calling one.
    let ready_pipe = if a.daemon { Some(daemonize()?) } else { None };
    let fs = if p.ro && p.nologreplay {
        super::open_fs_opts(&a.image, butter::fs::OpenOpts::nologreplay())?
    } else if p.ro {
        open_fs(&a.image)?
    } else {
        let opts = butter::fs::RwOptions {
            fsync_log: p.fsync_log,
            fsync_skips_writes_in_progress: p.fsync_rule,
            delayed_allocation: p.delalloc,
            compress: p.compress,
            compress_force: p.compress_force,
            max_inline: p.max_inline,
            legacy_allocator: p.legacy_allocator,
            ..Default::default()
        };
        super::open_fs_rw(&a.image, opts).map_err(|e| match e {
            butter::Error::NotPermitted(msg) => CliError(msg),
            e @ butter::Error::NotFound(_) => CliError(format!(
                "cannot open {}: {}",
                a.image.display(),
                CliError::from(e)
            )),
            e => CliError(format!(
                "cannot open {} read-write: {}; to mount it read-only use --ro",
                a.image.display(),
                CliError::from(e)
            )),
        })?
    };
    let fs = Arc::new(fs);
    let root = subvol_root(&fs, &p.subvol)?;
    if !fs.stat(root)?.is_dir() {
        return Err(CliError(format!(
            "the root of subvolume {} is not a directory",
            root.root
        )));
    }
    let (image, dir, ro) = (a.image.clone(), a.dir.clone(), p.ro);
    // As mount(8)'s helper: umount(8) runs `umount.fuse.butter` (and so waits for the final
    // commit) for mounts utab names with uhelper=butter.
    // SAFETY: geteuid has no preconditions.
    let utab_target = (a.as_mount_helper && unsafe { libc::geteuid() } == 0)
        .then(|| std::fs::canonicalize(&a.dir).ok())
        .flatten();
    let utab_source = std::fs::canonicalize(&a.image).unwrap_or(a.image.clone());
    let to_record = utab_target.clone();
    let ready = move || match ready_pipe {
        Some(fd) => {
            if let Some(target) = &to_record {
                super::helper::utab_add(&utab_source, target);
            }
            detach(fd)
        }
        // In the foreground: say where it is and how it ends.
        None => eprintln!(
            "butter: {} is mounted on {} ({}); unmount it with `umount {}` (or Ctrl-C here)",
            image.display(),
            dir.display(),
            if ro { "read-only" } else { "read-write" },
            dir.display()
        ),
    };
    let served = fuse::serve(fs.clone(), root, &a.dir, &p.cfg, ready);
    if let Some(target) = &utab_target {
        super::helper::utab_remove(target);
    }
    served.map_err(|e| {
        CliError(format!(
            "mounting {} on {}: {e}",
            a.image.display(),
            a.dir.display()
        ))
    })?;
    // The session's end (fuse `destroy`) made the final commit, or logged why it could not.
    Ok(())
}

/// `--daemon`: forks. The parent waits until the child reports the mount usable (exit 0) or
/// exits (then with the child's failure; the child printed why). The child returns the write
/// end of the pipe to report on, in a new session.
fn daemonize() -> Result<i32, CliError> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe writes two descriptors into the array.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(CliError(format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: no other thread exists yet (called before the filesystem or FUSE start any).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(CliError(format!(
            "fork: {}",
            std::io::Error::last_os_error()
        )));
    }
    if pid > 0 {
        // SAFETY: closing our copy of the write end; reading one byte into a local.
        unsafe { libc::close(fds[1]) };
        let mut b = 0u8;
        let n = loop {
            let n = unsafe { libc::read(fds[0], (&mut b as *mut u8).cast(), 1) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break n;
        };
        if n == 1 && b == b'1' {
            std::process::exit(0);
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        std::process::exit(1);
    }
    // SAFETY: the child: its own session, off the parent's terminal; the read end is unused.
    unsafe {
        libc::close(fds[0]);
        libc::setsid();
    }
    Ok(fds[1])
}

/// The daemon's mount is usable: tell the waiting parent, and let go of its terminal and
/// output (whoever reads the parent's output must not wait for the daemon to exit).
fn detach(fd: i32) {
    // SAFETY: plain descriptor operations on descriptors we own.
    unsafe {
        libc::write(fd, b"1".as_ptr().cast(), 1);
        libc::close(fd);
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for std_fd in 0..3 {
                libc::dup2(null, std_fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: MountArgs,
    }

    fn parse(args: &[&str]) -> Result<Plan, CliError> {
        let mut v = vec!["t"];
        v.extend_from_slice(args);
        plan(&T::try_parse_from(v).map_err(|e| CliError(e.to_string()))?.a)
    }

    #[test]
    fn ro_and_rw() {
        assert!(!parse(&["img", "dir"]).unwrap().ro);
        assert!(parse(&["--ro", "img", "dir"]).unwrap().ro);
        assert!(parse(&["-o", "ro", "img", "dir"]).unwrap().ro);
        assert!(!parse(&["--ro", "-o", "rw", "img", "dir"]).unwrap().ro);
    }

    #[test]
    fn options() {
        let p = parse(&[
            "-o",
            "ro,allow_other,fsname=x,subvolid=257",
            "-o",
            "noexec",
            "img",
            "dir",
        ])
        .unwrap();
        assert!(p.cfg.allow_other);
        assert_eq!(p.cfg.fsname, "x");
        assert_eq!(p.subvol, Subvol::Id(257));
        assert!(p.cfg.flags.contains(&MountOption::NoExec));
        // As root, dev and suid unless refused, as mount(8) mounts.
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(p.cfg.flags.contains(&MountOption::Dev), root);
        assert_eq!(p.cfg.flags.contains(&MountOption::Suid), root);
        let q = parse(&["-o", "nodev,nosuid", "img", "dir"]).unwrap();
        assert_eq!(q.cfg.flags, vec![MountOption::NoDev, MountOption::NoSuid]);
        let p = parse(&["--ro", "--subvol", "a/b", "img", "dir"]).unwrap();
        assert_eq!(p.subvol, Subvol::Path("a/b".into()));
        assert!(!p.cfg.allow_other);
        assert!(parse(&["-o", "ro,bogus", "img", "dir"]).is_err());
        let p = parse(&["-o", "commit=5", "img", "dir"]).unwrap();
        assert_eq!(p.cfg.commit_interval, Some(Duration::from_secs(5)));
        assert!(!p.ro);
        assert_eq!(
            parse(&["img", "dir"]).unwrap().cfg.commit_interval,
            Some(Duration::from_secs(DEFAULT_COMMIT))
        );
        assert!(parse(&["-o", "commit=x", "img", "dir"]).is_err());
        assert!(
            parse(&["-o", "ro,nologreplay", "img", "dir"])
                .unwrap()
                .nologreplay
        );
        assert!(!parse(&["-o", "ro", "img", "dir"]).unwrap().nologreplay);
        assert!(parse(&["img", "dir"]).unwrap().fsync_log);
        assert!(
            !parse(&["-o", "fsync=commit", "img", "dir"])
                .unwrap()
                .fsync_log
        );
        let wait = parse(&["-o", "fsync=log-wait", "img", "dir"]).unwrap();
        assert!(wait.fsync_log && !wait.fsync_rule);
        assert!(parse(&["img", "dir"]).unwrap().fsync_rule);
        assert!(parse(&["img", "dir"]).unwrap().delalloc);
        assert!(!parse(&["-o", "nodelalloc", "img", "dir"]).unwrap().delalloc);
        let c = parse(&["-o", "compress=zstd:7", "img", "dir"]).unwrap();
        assert_eq!(c.compress.map(|c| c.name()), Some("zstd"));
        assert!(!c.compress_force);
        assert_eq!(c.max_inline, 2048);
        let m = parse(&["-o", "max_inline=4k,max_inline=3000", "img", "dir"]).unwrap();
        assert_eq!(m.max_inline, 3000);
        assert!(parse(&["-o", "max_inline=lots", "img", "dir"]).is_err());
        assert!(!m.legacy_allocator);
        let l = parse(&["-o", "allocator=legacy", "img", "dir"]).unwrap();
        assert!(l.legacy_allocator);
        assert!(parse(&["-o", "allocator=buddy", "img", "dir"]).is_err());
        let f = parse(&["-o", "compress-force=lzo", "img", "dir"]).unwrap();
        assert!(f.compress_force);
        assert!(parse(&["-o", "compress=zstd:16", "img", "dir"]).is_err());
        assert!(parse(&["-o", "compress=brotli", "img", "dir"]).is_err());
        assert!(parse(&["-o", "fsync=sometimes", "img", "dir"]).is_err());
        assert!(parse(&["-o", "nologreplay", "img", "dir"]).is_err());
        assert!(parse(&["--subvol", "a", "--subvol-id", "5", "img", "dir"]).is_err());
    }
}
