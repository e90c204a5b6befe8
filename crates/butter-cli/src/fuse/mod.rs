//! FUSE adapter: serves a [`butter::fs::Fs`] to the kernel through `fuser`, read-write when
//! the `Fs` was opened read-write, else read-only.
//!
//! Design limits and invariants:
//!
//! - **Read-only mounts** carry `ro`; opens for writing, `access(W_OK)` and every changing
//!   operation get EROFS.
//! - **Read-write mounts.** Each operation is one engine call (`butter::fs::Fs`'s operations,
//!   crate `butter::fs::ops`), which takes its own passage through the engine's gate: the
//!   adapter picks no lock and holds none. Changes are durable at a commit (every `commit_interval`, and
//!   in `destroy` at the end of the session) and, for one inode, at its `fsync`, which writes
//!   the fsync log (crate `butter::tree_log::write`; directories and the cases the log cannot
//!   express commit instead, as does every fsync with `fsync=commit`). Close (`flush`) is
//!   not durable, as on the kernel's btrfs. SIGKILL leaves the image at its last commit plus
//!   the log; the next read-write open replays it.
//! - **Ordering** is the engine's gate (crate `butter::gate`), which each operation passes
//!   itself: changes and commits exclusively, reads (lookup, getattr, read, readdir, xattr
//!   reads, lseek, statfs) shared and in parallel with each other; a write's data goes to the
//!   device out of it, and a read of one file waits only for that file's writes to complete.
//! - **Permissions** are the kernel's (`default_permissions`); what the kernel's VFS leaves
//!   to a FUSE server (set-id bits a write, truncate or chown clears, capabilities, the mode
//!   and ACL of a new inode) the engine's `*_as` operations apply for the request's caller
//!   (crate `butter::fs::posix`). With `FUSE_POSIX_ACL` (asked
//!   for in `init`) the kernel also enforces ACLs from the `system.posix_acl_*` xattrs we
//!   store as given (the xattr format btrfs stores), and leaves umask to us (`FUSE_DONT_MASK`):
//!   new inodes get the parent's default ACL (then no umask) as the kernel's `posix_acl_create`
//!   does; setting an access ACL sets the mode bits (an ACL the mode says all of is not
//!   stored); chmod updates the ACL's mask. New inodes belong to the caller, with the group
//!   (and for directories the set-group-id bit) of a set-group-id parent.
//! - **Open files.** A handle per open; an unlinked file stays (an orphan in the engine)
//!   until its last handle's `release` and the kernel's `forget` of it (a lookup reference
//!   holds a non-directory open in the engine: an O_PATH descriptor can reopen it). O_APPEND handles write at the end whatever offset the
//!   kernel sends; O_DIRECT opens get FOPEN_DIRECT_IO; O_TRUNC truncates. File locks are not
//!   implemented: the kernel keeps POSIX and flock locks locally (single mount, so correct).
//! - **No writeback cache.** With FUSE_WRITEBACK_CACHE the kernel owns size, mtime and
//!   ctime of regular files (it ignores the server's), sends dirty pages whenever it likes
//!   and asks SEEK_DATA/SEEK_HOLE without writing them back first. Measured (issue 31): a
//!   16 KiB streaming write 2.6x faster, a small-file create 35% slower (a SETATTR of the
//!   times and a WRITE at every close), and the differential test (tests/deferred_diff.rs)
//!   found holes reported over data the kernel still held and times the server stamped that
//!   the kernel never saw. Writes are write-through instead, up to [`MAX_WRITE`] each.
//! - **errno only here.** Engine errors are typed; this module turns them into errno with
//!   [`butter::Error::errno`] and logs each one (`log::error!`). Expected outcomes (a name not
//!   found or taken, an absent xattr, ENOSPC, ...) are not logged. A panic inside an operation
//!   is caught, logged and answered with EIO: one bad inode never ends the mount.
//! - **Inode numbers** (FUSE node ids, which are also the reported `st_ino`) are stable for
//!   the life of the mount (the engine never reuses an inode number within a mount). The
//!   mounted subvolume's root directory is node 1 (reported with its btrfs number, 256, as
//!   `st_ino`, like the kernel). Every other inode of the mounted subvolume keeps its btrfs
//!   number. Inodes of other subvolumes (and, on a damaged image, numbers of the mounted one
//!   outside `[2, TABLE_BASE)`) get `TABLE_BASE + n` from a table keyed by (subvolume, inode)
//!   that only grows, so hardlinks share one `st_ino`. Lookup counts are kept per node;
//!   `forget` to zero drops what we remember about the node (its parent). Past a bound
//!   (`-o cache_size`), butter asks the kernel to drop nodes nothing uses (crate::fuse::prune).
//! - **readdir cookies.** "." has offset 1, ".." offset 2, an entry with DIR_INDEX sequence
//!   number `i` (always >= 2 on btrfs) offset `i + 1`: a request at offset `o >= 2` resumes at
//!   index `o`. These are the positions the kernel's btrfs uses, so telldir/seekdir values
//!   mean the same on both.
//! - **Transports.** Requests come through /dev/fuse, where fuser runs `threads` event loops,
//!   each on its own cloned descriptor, and through FUSE over io_uring when the kernel offers
//!   it (crate::fuse::ring: a queue per CPU, its thread pinned to it; fsync and large reads and
//!   writes go to helper threads). The operations themselves (crate::fuse::ops) do not know
//!   which: fuser's `Filesystem` impl below and the ring's decoder (crate::fuse::wire) both
//!   call them. Replies go out from the thread that served the request; writes of
//!   [`BULK_WRITE`] bytes or more do their engine work on a bulk lane of the file
//!   (crate::bulk) while that thread waits.
//! - **Ending.** [`serve`] returns when the mount goes away: an external unmount, or a signal
//!   (SIGINT/SIGTERM/SIGHUP) on which it unmounts itself, lazily if the mount is busy.
//! - **Caching** ([`Caching`]): entries, attributes and missing names are valid for [`TTL`],
//!   file pages are kept across opens and directory listings are cached, read-only and
//!   read-write alike: every change comes through the kernel (one writer per image).
//!   `-o cache=strict` gives read-write mounts 1 s timeouts and nothing kept across opens.

mod ops;
mod prune;
mod ring;
mod wire;

pub use ring::Uring;

use crate::bulk::Bulk;
use crate::setid::Caller;
use butter::format::items::{InodeItem, Timespec};
use butter::fs::{DirEnd, Fs, Inode, NewKind, NewNode, Side};
use butter::inode::namespace::SetAttr;
use butter::{Error, Location};
use fuser::{
    AccessFlags, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyXattr, Request, Session, SessionACL, TimeOrNow,
};
use ops::{EntryOut, XattrOut};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the kernel may cache entries and attributes on a read-only mount (nothing
/// changes).
pub const TTL: Duration = Duration::from_secs(60);

/// What the kernel may cache of a mount, and for how long (mount options `entry_timeout=`,
/// `attr_timeout=`, `negative_timeout=`, `keep_cache`, `killpriv`; the
/// README's mount section says which are on and why).
///
/// Long timeouts are safe because butter is the only writer of a mounted image (the
/// one-writer rule of `Fs::open_rw`): every change of a name or an attribute comes through
/// the kernel, which updates or drops what it cached for what it changed, and the few the
/// server makes on its own (set-id bits a write clears, the ctime of chattr) are sent to the
/// kernel as invalidations (`forget_attrs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caching {
    /// How long a name found stays valid in the kernel's dentry cache.
    pub entry: Duration,
    /// How long attributes stay valid.
    pub attr: Duration,
    /// How long a name found missing stays known missing (zero: asked again every time).
    pub negative: Duration,
    /// File pages and directory listings are kept across opens (FOPEN_KEEP_CACHE,
    /// FOPEN_CACHE_DIR).
    pub keep_cache: bool,
    /// FUSE_HANDLE_KILLPRIV_V2: the server clears set-id bits on write, truncate and chown
    /// (it does already), so the kernel stops asking for `security.capability` before every
    /// write.
    pub killpriv: bool,
}

impl Caching {
    /// Read-only mounts: nothing changes.
    pub const READ_ONLY: Caching = Caching {
        entry: TTL,
        attr: TTL,
        negative: TTL,
        keep_cache: true,
        killpriv: false,
    };

    /// Read-write mounts by default.
    pub const READ_WRITE: Caching = Caching {
        entry: TTL,
        attr: TTL,
        negative: TTL,
        keep_cache: true,
        killpriv: true,
    };

    /// Read-write mounts as before these caches: 1 s timeouts, no negative entries, each
    /// open from a clean page cache (`-o cache=strict`).
    pub const STRICT: Caching = Caching {
        entry: Duration::from_secs(1),
        attr: Duration::from_secs(1),
        negative: Duration::ZERO,
        keep_cache: false,
        killpriv: false,
    };
}

/// Largest write the kernel may send in one request (it may cap it lower: its max_pages).
pub const MAX_WRITE: u32 = 1 << 20;

/// Writes of at least this many bytes are served on a bulk lane (crate::bulk).
const BULK_WRITE: usize = 128 << 10;

/// First node id handed out from the (subvolume, inode) table. Inode numbers of the mounted
/// subvolume below it are used as they are; btrfs allocates inode numbers upwards from 256, so
/// a real filesystem never gets near 2^48.
pub const TABLE_BASE: u64 = 1 << 48;

/// Longest name btrfs stores.
const NAME_MAX: usize = 255;

/// The mapping between FUSE node ids and engine inodes. See the module doc.
pub struct InodeMap {
    root: Inode,
    table: RwLock<Table>,
}

#[derive(Default)]
struct Table {
    ids: HashMap<Inode, u64>,
    inodes: Vec<Inode>,
}

impl InodeMap {
    pub fn new(root: Inode) -> Self {
        InodeMap {
            root,
            table: RwLock::new(Table::default()),
        }
    }

    fn direct(&self, ino: Inode) -> bool {
        ino.root == self.root.root && (2..TABLE_BASE).contains(&ino.ino)
    }

    /// The node id of an inode, allocating a table entry the first time one is needed.
    pub fn node_id(&self, ino: Inode) -> u64 {
        if ino == self.root {
            return INodeNo::ROOT.0;
        }
        if self.direct(ino) {
            return ino.ino;
        }
        if let Some(id) = self
            .table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .ids
            .get(&ino)
        {
            return *id;
        }
        let mut t = self.table.write().unwrap_or_else(|e| e.into_inner());
        if let Some(id) = t.ids.get(&ino) {
            return *id;
        }
        let id = TABLE_BASE + t.inodes.len() as u64;
        t.inodes.push(ino);
        t.ids.insert(ino, id);
        id
    }

    /// The inode behind a node id, `None` for an id never handed out.
    pub fn inode(&self, id: u64) -> Option<Inode> {
        if id == INodeNo::ROOT.0 {
            return Some(self.root);
        }
        if (2..TABLE_BASE).contains(&id) {
            // Includes the root's own btrfs number, an alias of node 1.
            return Some(Inode {
                root: self.root.root,
                ino: id,
            });
        }
        let t = self.table.read().unwrap_or_else(|e| e.into_inner());
        usize::try_from(id - TABLE_BASE)
            .ok()
            .and_then(|i| t.inodes.get(i).copied())
    }

    /// The `st_ino` reported for a node: the node id, except for the root, which shows its
    /// btrfs number as the kernel does. Node ids in readdirplus and lookup replies are taken
    /// from this too; for the root that gives its alias, which [`InodeMap::inode`] accepts.
    pub fn st_ino(&self, id: u64) -> u64 {
        if id == INodeNo::ROOT.0 && (2..TABLE_BASE).contains(&self.root.ino) {
            self.root.ino
        } else {
            id
        }
    }
}

/// Why an operation failed.
enum OpError {
    /// An engine error: mapped with [`Error::errno`] and logged.
    Fs(Error),
    /// A failure found at this edge worth a log line (bad node id, odd name on disk).
    Edge(i32, String),
    /// An ordinary answer (ENOENT, ENODATA, ERANGE, EROFS): not logged.
    Quiet(i32),
}

impl From<Error> for OpError {
    fn from(e: Error) -> Self {
        OpError::Fs(e)
    }
}

type OpResult<T> = Result<T, OpError>;

/// An open file.
struct Handle {
    ino: Inode,
    /// Opened with O_APPEND: every write goes to the end.
    append: bool,
}

/// The filesystem as fuser sees it: the adapter, shared with the threads of the io_uring
/// queues (crate::fuse::ring) when the kernel serves the mount through them.
pub struct ButterFuse(Arc<Adapter>);

impl std::ops::Deref for ButterFuse {
    type Target = Adapter;
    fn deref(&self) -> &Adapter {
        &self.0
    }
}

/// What the adapter keeps of the kernel's view around the engine (node ids, lookup counts,
/// handles); its operations are in crate::fuse::ops.
pub struct Adapter {
    fs: Arc<Fs>,
    map: InodeMap,
    /// Parent node of each directory node seen through lookup/readdirplus (for "..").
    parents: Mutex<HashMap<u64, u64>>,
    /// Lookup count of each node the kernel holds (lookup, create, ... minus forget), and
    /// for a non-directory the engine inode that reference holds open: the kernel can open
    /// an unlinked file it still knows (an O_PATH descriptor reopened through /proc), so the
    /// engine keeps the file (an orphan) until the kernel forgets it, as the kernel's btrfs
    /// keeps it until the last reference to the inode goes.
    lookups: Mutex<HashMap<u64, (u64, Option<Inode>)>>,
    /// Open files by handle.
    handles: Mutex<HashMap<u64, Handle>>,
    /// Open directories by handle: the inode, and the index of its last entry at the open
    /// (a listing ends there, see `Core::last_dir_index`).
    dirs: Mutex<HashMap<u64, (Inode, u64)>>,
    next_fh: AtomicU64,
    writable: bool,
    /// What the kernel may cache, and for how long.
    caching: Caching,
    /// Threads for the engine's part of large writes (read-write mounts).
    bulk: Option<Bulk>,
    /// Tells the kernel to forget attributes it caches (set once the session exists).
    notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
    /// The io_uring transport.
    ring: ring::Ring,
    /// The bound on the nodes the kernel holds.
    prune: prune::Pruner,
}

/// A time from a fuser request. fuser 0.18 decodes a time before the epoch, (sec < 0,
/// nsec), as `EPOCH - (|sec| s + nsec ns)` instead of `EPOCH - |sec| s + nsec ns`; this
/// undoes that, so the stored time is the one the caller gave (checked by tests/fuse_rw.rs).
fn timespec(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(e) => {
            let d = e.duration();
            Timespec {
                sec: -(d.as_secs().min(i64::MAX as u64) as i64),
                nsec: d.subsec_nanos(),
            }
        }
    }
}

fn time_or_now(t: TimeOrNow) -> Timespec {
    match t {
        TimeOrNow::SpecificTime(t) => timespec(t),
        TimeOrNow::Now => timespec(SystemTime::now()),
    }
}

/// The caller of a request, for the engine's POSIX rules (crate::setid).
fn caller_of(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
    }
}

/// Errors that are an answer, not a failure (logged quietly), by variant; the rest are logged.
fn fs_err(e: Error) -> OpError {
    match &e {
        Error::CrossSubvolume(_)
        | Error::NotFound(_)
        | Error::Exists(_)
        | Error::NotEmpty(_)
        | Error::NoXattr(_)
        | Error::IsDir(_)
        | Error::NotDir(_)
        | Error::NameTooLong(_)
        | Error::NoSpace(_)
        | Error::ReadOnlySubvol(_)
        | Error::NotPermitted(_)
        | Error::AccessDenied(_)
        // Read-only, or changes stopped (the latch logged why, once).
        | Error::ReadOnly
        | Error::Aborted(_) => OpError::Quiet(e.errno()),
        _ => OpError::Fs(e),
    }
}

impl Adapter {
    /// Serves `fs` with `root` (a subvolume's root directory) as the mount's root.
    pub fn new(fs: Arc<Fs>, root: Inode) -> Self {
        let mut parents = HashMap::new();
        parents.insert(INodeNo::ROOT.0, INodeNo::ROOT.0);
        let writable = fs.is_writable();
        Adapter {
            fs,
            map: InodeMap::new(root),
            parents: Mutex::new(parents),
            lookups: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            writable,
            caching: if writable {
                Caching::READ_WRITE
            } else {
                Caching::READ_ONLY
            },
            bulk: if writable {
                Bulk::per_cpu()
                    .map_err(|e| {
                        log::warn!("no bulk lanes ({e}): large writes are served by the workers")
                    })
                    .ok()
            } else {
                None
            },
            notifier: Arc::default(),
            ring: ring::Ring::default(),
            prune: prune::Pruner::default(),
        }
    }

    /// At most this many nodes held by the kernel (0: no bound); see crate::fuse::prune.
    pub fn with_node_bound(mut self, nodes: usize) -> Self {
        self.prune = prune::Pruner::with_bound(nodes);
        self
    }

    /// Nodes the kernel holds (not the root) past the first `keep`, for a prune round: the
    /// lookup table's order from `cursor`, which moves past them.
    fn prune_candidates(&self, keep: usize, cursor: &AtomicUsize) -> Vec<u64> {
        let l = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let want = l.len().saturating_sub(keep);
        if want == 0 {
            return Vec::new();
        }
        let from = cursor.load(Ordering::Relaxed) % l.len();
        let picked: Vec<u64> = l
            .keys()
            .skip(from)
            .chain(l.keys().take(from))
            .filter(|&&n| n != INodeNo::ROOT.0)
            .take(want)
            .copied()
            .collect();
        cursor.store(from + picked.len(), Ordering::Relaxed);
        picked
    }

    /// Whether to serve through FUSE over io_uring.
    pub fn with_uring(mut self, mode: Uring) -> Self {
        self.ring = ring::Ring::new(mode);
        self
    }

    /// What the kernel may cache (read-write mounts; a read-only one keeps everything).
    pub fn with_caching(mut self, caching: Caching) -> Self {
        if self.writable {
            self.caching = caching;
        }
        self
    }

    /// Large writes served on the worker that took them, not on bulk lanes (`-o nobulk`).
    pub fn without_bulk_lanes(mut self) -> Self {
        self.bulk = None;
        self
    }

    /// Tells the kernel to drop the attributes it caches for `node`: for a change it did not
    /// ask for as a setattr (a mode a write by another user cleared, the ctime of chattr).
    /// Attributes only (offset -1): no page is touched, so this cannot wait on the request
    /// being served.
    fn forget_attrs(&self, node: u64) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(INodeNo(node), -1, 0) {
                log::warn!("telling the kernel the attributes of node {node} changed: {e}");
            }
        }
    }

    /// [`ButterFuse::forget_attrs`] when the engine's POSIX rules changed the mode.
    fn after(&self, node: u64, side: Side) {
        if side.mode_changed {
            self.forget_attrs(node);
        }
    }

    /// Runs `f` (one engine operation, which takes its own passage through the engine's
    /// gate), turning its failure or panic into an errno and a log line naming `op`.
    fn guard<T>(&self, op: &str, node: u64, f: impl FnOnce() -> OpResult<T>) -> Result<T, Errno> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(OpError::Quiet(n))) => Err(Errno::from_i32(n)),
            Ok(Err(OpError::Fs(e))) => {
                log::error!("{op} (node {node}): {e}");
                Err(Errno::from_i32(e.errno()))
            }
            Ok(Err(OpError::Edge(n, why))) => {
                log::error!("{op} (node {node}): {why}");
                Err(Errno::from_i32(n))
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                log::error!("{op} (node {node}): internal error (panic) {msg}");
                Err(Errno::EIO)
            }
        }
    }

    /// [`ButterFuse::guard`] for a change: EROFS at once on a read-only mount.
    fn change<T>(&self, op: &str, node: u64, f: impl FnOnce() -> OpResult<T>) -> Result<T, Errno> {
        if !self.writable {
            return Err(Errno::from_i32(libc::EROFS));
        }
        self.guard(op, node, f)
    }

    fn inode(&self, node: u64) -> OpResult<Inode> {
        self.map.inode(node).ok_or_else(|| {
            OpError::Edge(libc::ESTALE, format!("node id {node} was never handed out"))
        })
    }

    /// The directory holding directory node `node` (engine inode `dir`), for a lookup of
    /// "..": the parent it was found under while the kernel knows it, else the engine's
    /// back reference (a handle decoded after the kernel forgot the directory). Never above
    /// the mounted subvolume's root.
    fn parent_dir(&self, node: u64, dir: Inode) -> OpResult<Inode> {
        if dir == self.map.root {
            return Ok(dir);
        }
        let known = self
            .parents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .copied();
        if let Some(p) = known {
            return self.inode(p);
        }
        Ok(self
            .fs
            .lookup(dir, b"..")?
            .map_or(self.map.root, |e| e.target))
    }

    fn remember_parent(&self, child: u64, parent: u64) {
        self.parents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(child, parent);
    }

    /// The kernel got one more reference to `node` (an entry reply with `attr`). The first
    /// one of a non-directory holds the engine inode open until `forget`.
    fn looked_up(&self, attr: &FileAttr) {
        let node = attr.ino.0;
        let mut l = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let e = l.entry(node).or_insert((0, None));
        e.0 += 1;
        if e.0 == 1 {
            if attr.kind != FileType::Directory {
                if let Ok(ino) = self.inode(node) {
                    self.fs.hold(ino);
                    e.1 = Some(ino);
                }
            }
            self.prune.held(l.len());
        }
    }

    /// Lets go of the engine inode a lookup reference held: an unlinked file no handle
    /// holds is deleted now.
    fn unhold(&self, node: u64, ino: Inode) {
        if let Err(e) = self.guard("forget", node, || Ok(self.fs.release(ino)?)) {
            log::warn!("forgetting node {node}: {e:?}");
        }
    }

    /// The FUSE attributes of node `node` (engine inode `ino`) from its item.
    fn attr_of(&self, node: u64, ino: Inode, item: &InodeItem) -> OpResult<FileAttr> {
        let ss = u64::from(self.fs.sectorsize().max(1));
        file_attr(self.map.st_ino(node), ino, item, ss).map_err(OpError::Fs)
    }

    /// Attributes of node `node` (engine inode `ino`).
    fn attr(&self, node: u64, ino: Inode) -> OpResult<FileAttr> {
        let item = self.fs.inode_item(ino).map_err(fs_err)?;
        self.attr_of(node, ino, &item)
    }

    /// Node id and attributes of inode `ino` (item `item`) found or made under `parent`.
    fn entry(&self, parent: u64, ino: Inode, item: &InodeItem) -> OpResult<FileAttr> {
        let node = self.map.node_id(ino);
        let attr = self.attr_of(node, ino, item)?;
        if attr.kind == FileType::Directory && node != INodeNo::ROOT.0 {
            self.remember_parent(node, parent);
        }
        Ok(attr)
    }

    /// "." and ".." (offsets 1 and 2), then entries with index >= `offset` up to the end the
    /// handle `fh` saw at its open (or now, listing from the start, as the kernel's btrfs
    /// refreshes its end on rewinddir): one engine call. `add` gets the name, the entry's
    /// next offset, the entry (`None` for the dots) and its item when `items`; it returns
    /// true when the reply is full.
    fn fill_dir(
        &self,
        node: u64,
        fh: u64,
        offset: u64,
        items: bool,
        mut add: impl FnMut(
            &[u8],
            u64,
            Option<(&butter::fs::DirEntry, Option<&InodeItem>)>,
        ) -> OpResult<bool>,
    ) -> OpResult<()> {
        let dir = self.inode(node)?;
        let end = {
            let dirs = self.dirs.lock().unwrap_or_else(|e| e.into_inner());
            match dirs.get(&fh) {
                Some(_) if offset == 0 => DirEnd::Now,
                Some(d) => DirEnd::At(d.1),
                None => DirEnd::At(u64::MAX - 1),
            }
        };
        if offset == 0 && add(b".", 1, None)? {
            return Ok(());
        }
        if offset <= 1 && add(b"..", 2, None)? {
            return Ok(());
        }
        let mut edge: Option<OpError> = None;
        let used = self
            .fs
            .readdir_with(dir, offset.max(2) - 1, end, items, &mut |e, item| {
                if e.index == u64::MAX {
                    log::error!(
                        "readdir (node {node}): entry {:?} has index {}, beyond what a cookie can resume",
                        String::from_utf8_lossy(&e.name),
                        e.index
                    );
                    return Ok(true);
                }
                if let Err(why) = check_name(&e.name) {
                    log::error!(
                        "readdir (node {node}): skipping entry {:?} (index {}): {why}",
                        String::from_utf8_lossy(&e.name),
                        e.index
                    );
                    return Ok(false);
                }
                match add(&e.name, e.index + 1, Some((e, item))) {
                    Ok(full) => Ok(full),
                    Err(x) => {
                        edge = Some(x);
                        Ok(true)
                    }
                }
            })
            .map_err(fs_err)?;
        if end == DirEnd::Now {
            if let Some(d) = self
                .dirs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(&fh)
            {
                d.1 = used;
            }
        }
        match edge {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// File type of a directory entry, from its FT_* code or else from the inode itself.
    fn entry_kind(&self, e: &butter::fs::DirEntry, item: Option<&InodeItem>) -> OpResult<FileType> {
        let mode = match (e.mode_type(), item) {
            (0, Some(i)) => i.mode,
            (0, None) => self.fs.inode_item(e.target)?.mode,
            (m, _) => m,
        };
        kind_from_mode(mode, e.target).map_err(OpError::Fs)
    }

    /// Creates a node of any kind in `parent` (the engine applies the POSIX rules: owner,
    /// set-group-id directories, default ACLs or umask).
    fn create_node(
        &self,
        parent: u64,
        name: &[u8],
        new: &NewNode<'_>,
    ) -> OpResult<(Inode, FileAttr)> {
        let dir = self.inode(parent)?;
        if name.len() > NAME_MAX {
            return Err(OpError::Quiet(libc::ENAMETOOLONG));
        }
        let (ino, item) = self.fs.create_node(dir, name, new).map_err(fs_err)?;
        Ok((ino, self.entry(parent, ino, &item)?))
    }

    /// A new file handle for `ino` (which the engine holds open already).
    fn new_handle(&self, ino: Inode, flags: i32) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                fh,
                Handle {
                    ino,
                    append: flags & libc::O_APPEND != 0,
                },
            );
        fh
    }

    /// FOPEN flags for a file opened with `flags`. Close asks nothing of the server
    /// (`flush` does nothing), so the kernel need not send it (FOPEN_NOFLUSH).
    fn fopen_flags(&self, flags: i32) -> FopenFlags {
        let mut f = FopenFlags::FOPEN_NOFLUSH;
        if flags & libc::O_DIRECT != 0 {
            f |= FopenFlags::FOPEN_DIRECT_IO;
        } else if self.caching.keep_cache {
            // Every change of a file's data comes through the kernel, which drops the pages
            // it changes (truncate, punch, copy_file_range, O_DIRECT writes): what it
            // cached is what the file holds.
            f |= FopenFlags::FOPEN_KEEP_CACHE;
        }
        f
    }
}

impl Filesystem for ButterFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Each is optional: ask for those the kernel offers.
        for cap in [
            InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_CACHE_SYMLINKS,
            InitFlags::FUSE_PARALLEL_DIROPS,
            // mmap of a file opened with O_DIRECT (FOPEN_DIRECT_IO), as local filesystems
            // allow it.
            InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
            // File handles (name_to_handle_at, open_by_handle_at, NFS): the kernel finds a
            // node it forgot with a lookup of "." in it.
            InitFlags::FUSE_EXPORT_SUPPORT,
        ] {
            if let Err(missing) = config.add_capabilities(cap) {
                log::debug!("kernel lacks FUSE capability {missing:?}");
            }
        }
        // ACLs: the kernel enforces them (with default_permissions) from the xattrs we
        // store, and leaves umask to us (DONT_MASK) so a default ACL can replace it.
        let acl = config
            .add_capabilities(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK)
            .is_ok();
        if !acl {
            log::info!("the kernel does not offer FUSE_POSIX_ACL: ACLs are not enforced");
        }
        self.fs.enforce_acls(acl);
        if self.caching.killpriv
            && config
                .add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2)
                .is_err()
        {
            log::info!("the kernel does not offer FUSE_HANDLE_KILLPRIV_V2");
        }
        if let Err(nearest) = config.set_max_write(MAX_WRITE) {
            let _ = config.set_max_write(nearest);
        }
        // Read ahead as far as the kernel allows, up to what one write may carry.
        if let Err(nearest) = config.set_max_readahead(MAX_WRITE) {
            let _ = config.set_max_readahead(nearest);
        }
        ring::negotiate(self, config);
        Ok(())
    }

    fn destroy(&mut self) {
        // The io_uring queues' threads end first: nothing runs beside the final commit.
        self.ring.stop();
        let p = self.prune.stats();
        self.prune.stop();
        if p.bound > 0 || p.refused {
            log::info!(
                "nodes the kernel held: at most {} (bound {}); {} asked to be dropped in {} \
                 rounds{}",
                p.peak,
                p.bound,
                p.asked,
                p.rounds,
                if p.refused {
                    " (then the kernel refused)"
                } else {
                    ""
                }
            );
        }
        if !self.writable {
            return;
        }
        // The kernel forgets what it still knows without telling: unlinked files that only
        // its references held go now, as they do at the kernel's unmount.
        let held: Vec<(u64, Inode)> =
            std::mem::take(&mut *self.lookups.lock().unwrap_or_else(|e| e.into_inner()))
                .into_iter()
                .filter_map(|(node, (_, held))| Some((node, held?)))
                .collect();
        for (node, ino) in held {
            self.unhold(node, ino);
        }
        // The final commit. A failure (or changes stopped before) makes `serve` fail; the
        // engine has stopped changes (its latch) and logged why.
        if let Ok(r) = self.fs.close() {
            let (st, o) = (r.log, r.ordered);
            log::info!(
                "fsync: {} logged ({} ordered extents before their completion), {} \
                 committed instead, {} already durable; {} log commits",
                st.logged,
                st.ordered_logged,
                st.fallbacks,
                st.already_durable,
                st.log_commits
            );
            log::info!(
                "writes: {} ordered extents ({} completed after the write returned), {} \
                 delayed allocations written back ({} on the write-back thread, {} started \
                 behind one on its way), {} writes waited for an overlapping one, {} data \
                 writes out of the gate",
                o.started,
                o.deferred,
                o.delalloc_flushed,
                o.delalloc_background,
                o.delalloc_behind,
                o.locked_waits,
                r.data_io_out_of_gate
            );
            let a = r.alloc;
            log::info!(
                "allocator: {} allocations, {} try-lock misses, {} blocking waits, {} \
                 groups visited, {} goal hits",
                a.allocations,
                a.trylock_misses,
                a.blocking_waits,
                a.groups_visited,
                a.goal_hits
            );
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        reply_entry(reply, Adapter::lookup(self, parent.0, name.as_bytes()))
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        Adapter::forget(self, ino.0, nlookup)
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match Adapter::getattr(self, ino.0) {
            Ok(attr) => reply.attr(&self.caching.attr, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let a = SetAttr {
            mode,
            uid,
            gid,
            size,
            touch: [atime, mtime]
                .iter()
                .all(|t| !matches!(t, Some(TimeOrNow::SpecificTime(_)))),
            atime: atime.map(time_or_now),
            mtime: mtime.map(time_or_now),
            ctime: ctime.map(timespec),
        };
        match Adapter::setattr(self, &caller_of(req), ino.0, &a) {
            Ok(attr) => reply.attr(&self.caching.attr, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match Adapter::readlink(self, ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let rdev = butter::format::items::rdev_from_user(rdev);
        let kind = NewKind::Node { rdev };
        let (c, name) = (caller_of(req), name.as_bytes());
        reply_entry(
            reply,
            self.make("mknod", &c, parent.0, name, kind, mode, umask),
        )
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let (c, name) = (caller_of(req), name.as_bytes());
        reply_entry(
            reply,
            self.make("mkdir", &c, parent.0, name, NewKind::Dir, mode, umask),
        )
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(reply, Adapter::unlink(self, parent.0, name.as_bytes()))
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(reply, Adapter::rmdir(self, parent.0, name.as_bytes()))
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let target = target.as_os_str().as_bytes();
        let (c, name) = (caller_of(req), link_name.as_bytes());
        let kind = NewKind::Symlink { target };
        reply_entry(
            reply,
            self.make("symlink", &c, parent.0, name, kind, 0o777, 0),
        )
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = Adapter::rename(
            self,
            parent.0,
            name.as_bytes(),
            newparent.0,
            newname.as_bytes(),
            flags.bits(),
        );
        reply_empty(reply, r)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply_entry(
            reply,
            Adapter::link(self, ino.0, newparent.0, newname.as_bytes()),
        )
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match Adapter::open(self, &caller_of(req), ino.0, flags.0) {
            Ok(o) => reply.opened(FileHandle(o.fh), o.flags),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let c = caller_of(req);
        match Adapter::create(self, &c, parent.0, name.as_bytes(), mode, umask, flags) {
            Ok((e, o)) => reply.created(
                &e.entry_ttl,
                &e.attr,
                Generation(0),
                FileHandle(o.fh),
                o.flags,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        match Adapter::read(self, ino.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: fuser::WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        let from_page = write_flags.contains(fuser::WriteFlags::FUSE_WRITE_CACHE);
        let c = caller_of(req);
        match Adapter::write(self, &c, ino.0, fh.0, offset, data, from_page, flags.0) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) is not a durability point (as on the kernel's btrfs): writes reached the
        // engine already, and the next commit (fsync, the periodic one, unmount) keeps them.
        // Committing here cost a full commit per closed file. Nothing to do, so ENOSYS: the
        // kernel stops sending FLUSH (FOPEN_NOFLUSH already spares it on most closes).
        reply.error(Errno::ENOSYS)
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, Adapter::release(self, ino.0, fh.0))
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, Adapter::fsync(self, "fsync", ino.0, datasync))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match Adapter::opendir(self, ino.0) {
            Ok(o) => reply.opened(FileHandle(o.fh), o.flags),
            Err(e) => reply.error(e),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, Adapter::releasedir(self, ino.0, fh.0))
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = Adapter::readdir(
            self,
            ino.0,
            fh.0,
            offset,
            &mut |st_ino, next, kind, name| {
                reply.add(INodeNo(st_ino), next, kind, OsStr::from_bytes(name))
            },
        );
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let r = Adapter::readdirplus(self, ino.0, fh.0, offset, &mut |name, next, e| {
            reply.add(
                e.attr.ino,
                next,
                OsStr::from_bytes(name),
                &e.entry_ttl,
                &e.attr,
                Generation(0),
            )
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, Adapter::fsync(self, "fsyncdir", ino.0, datasync))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match Adapter::statfs(self) {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, 0, 0, s.bsize, s.namelen, s.bsize,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let c = caller_of(req);
        let r = Adapter::setxattr(self, &c, ino.0, name.as_bytes(), value, flags);
        reply_empty(reply, r)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        reply_xattr(reply, Adapter::getxattr(self, ino.0, name.as_bytes(), size))
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        reply_xattr(reply, Adapter::listxattr(self, ino.0, size))
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(reply, Adapter::removexattr(self, ino.0, name.as_bytes()))
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        match Adapter::ioctl(self, ino.0, req.uid(), cmd, in_data, out_size) {
            Ok(data) => reply.ioctl(0, &data),
            Err(e) => reply.error(e),
        }
    }

    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: fuser::PollNotifier,
        _events: fuser::PollEvents,
        _flags: fuser::PollFlags,
        reply: fuser::ReplyPoll,
    ) {
        // ENOSYS: the kernel stops asking and treats files as always ready.
        reply.error(Errno::ENOSYS);
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let c = caller_of(req);
        reply_empty(
            reply,
            Adapter::fallocate(self, &c, ino.0, offset, length, mode),
        )
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: fuser::ReplyLseek,
    ) {
        match Adapter::lseek(self, ino.0, offset, whence) {
            Ok(at) => reply.offset(at),
            Err(e) => reply.error(e),
        }
    }

    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: fuser::ReplyWrite,
    ) {
        let c = caller_of(req);
        let r = Adapter::copy_file_range(
            self,
            &c,
            (ino_in.0, offset_in),
            (ino_out.0, offset_out),
            len,
        );
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        reply_empty(reply, Adapter::access(self, mask.bits()))
    }
}

/// Replies to an operation that made or found an entry.
fn reply_entry(reply: ReplyEntry, r: Result<EntryOut, Errno>) {
    match r {
        Ok(e) => reply.entry_with_ttls(&e.attr_ttl, &e.entry_ttl, &e.attr, Generation(0)),
        Err(e) => reply.error(e),
    }
}

fn reply_empty(reply: ReplyEmpty, r: Result<(), Errno>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn reply_xattr(reply: ReplyXattr, r: Result<XattrOut, Errno>) {
    match r {
        Ok(XattrOut::Size(n)) => reply.size(n),
        Ok(XattrOut::Data(d)) => reply.data(&d),
        Err(e) => reply.error(e),
    }
}

/// Names the kernel would refuse in a FUSE directory reply (the whole reply fails with EIO).
fn check_name(name: &[u8]) -> Result<(), &'static str> {
    if name.is_empty() {
        Err("empty name")
    } else if name.len() > NAME_MAX {
        Err("name longer than 255 bytes")
    } else if name.contains(&b'/') || name.contains(&0) {
        Err("name contains '/' or NUL")
    } else if name == b"." || name == b".." {
        Err("name is a dot entry")
    } else {
        Ok(())
    }
}

fn kind_from_mode(mode: u32, ino: Inode) -> butter::Result<FileType> {
    Ok(match mode & libc::S_IFMT {
        libc::S_IFREG => FileType::RegularFile,
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        _ => {
            return Err(Error::corrupt(
                Location::what(format!("inode {} in subvolume {}", ino.ino, ino.root)),
                format!("mode {mode:o} has no file type"),
            ))
        }
    })
}

fn system_time(t: Timespec) -> SystemTime {
    let nsec = Duration::from_nanos(u64::from(t.nsec.min(999_999_999)));
    let base = if t.sec >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(t.sec as u64))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(t.sec.unsigned_abs()))
    };
    base.and_then(|b| b.checked_add(nsec)).unwrap_or(UNIX_EPOCH)
}

/// The attributes of a negative entry reply: node id 0, the rest unread by the kernel.
fn negative_entry() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

/// The FUSE attributes of an inode item. `st_blocks` follows the kernel: the byte count
/// rounded up to whole sectors (an inline extent of 10 bytes still occupies a sector).
pub fn file_attr(
    st_ino: u64,
    ino: Inode,
    i: &InodeItem,
    sectorsize: u64,
) -> butter::Result<FileAttr> {
    let kind = kind_from_mode(i.mode, ino)?;
    let bytes = i.nbytes.div_ceil(sectorsize).saturating_mul(sectorsize);
    Ok(FileAttr {
        ino: INodeNo(st_ino),
        size: i.size,
        blocks: bytes / 512,
        atime: system_time(i.atime),
        mtime: system_time(i.mtime),
        ctime: system_time(i.ctime),
        crtime: system_time(i.otime),
        kind,
        perm: (i.mode & 0o7777) as u16,
        nlink: i.nlink,
        uid: i.uid,
        gid: i.gid,
        rdev: butter::format::items::rdev_to_user(i.rdev),
        blksize: sectorsize as u32,
        flags: 0,
    })
}

/// How to mount.
#[derive(Debug, Clone)]
pub struct MountConfig {
    /// Source name shown in /proc/mounts.
    pub fsname: String,
    /// Shown as the type `fuse.<subtype>`.
    pub subtype: String,
    pub allow_other: bool,
    pub allow_root: bool,
    /// Extra kernel flags (dev, nosuid, noexec, noatime, ...).
    pub flags: Vec<MountOption>,
    /// Worker threads reading requests (each with its own cloned /dev/fuse descriptor).
    pub threads: usize,
    /// Read-write mounts: commit this often (besides flush, fsync and unmount).
    pub commit_interval: Option<Duration>,
    /// Large writes run on bulk lanes (crate::bulk); off (`-o nobulk`), on the worker that
    /// took them.
    pub bulk: bool,
    /// What the kernel may cache (read-write mounts).
    pub caching: Caching,
    /// FUSE over io_uring when the kernel offers it.
    pub uring: Uring,
    /// Bytes of tree blocks the mount may hold: half clean (the block cache), half changed
    /// since the last commit (more, and the change that crossed it commits).
    pub cache_size: u64,
}

/// `-o cache_size=` by default: 256 MiB of block cache (the engine's own default) and as
/// much of changes before a commit.
pub const DEFAULT_CACHE_SIZE: u64 = 512 << 20;

/// Mounts `fs` (root directory `root`) on `dir`, read-write when `fs` was opened so, and
/// serves it until the mount goes away: `fusermount3 -u`/`umount`, or SIGINT/SIGTERM/SIGHUP,
/// on which it unmounts (lazily if the mount is busy). Either way the session's end commits
/// (the `destroy` callback). A second signal commits what it can and exits at once.
/// `ready` runs once the kernel has the mount (its INIT answered): the mount is usable.
pub fn serve(
    fs: Arc<Fs>,
    root: Inode,
    dir: &Path,
    cfg: &MountConfig,
    ready: impl FnOnce(),
) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // Registered before mounting, so that a signal arriving during the mount waits for us.
    let signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])?;
    let writable = fs.is_writable();
    fs.set_memory(butter::fs::MemoryLimits {
        cache: cfg.cache_size / 2,
        dirty: cfg.cache_size / 2,
    });
    let config = session_config(cfg, writable);
    let session = mount_session(fs.clone(), root, dir, &config, cfg)?;
    let mountpoint: PathBuf = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    log::info!(
        "mounted on {} ({})",
        mountpoint.display(),
        if writable { "read-write" } else { "read-only" }
    );
    // Periodic commits (the engine's scheduler; `close` at the session's end stops it).
    if writable {
        if let Some(every) = cfg.commit_interval {
            fs.start_committer(every)?;
        }
    }
    // fuser 0.18 unmounts the mount point again when its session ends, even after someone
    // else unmounted it (its is-still-mounted probe takes POLLERR for "mounted"): a spurious
    // warning, and with stacked mounts it would unmount the one below ours. So the session
    // runs in the background and its handle, which owns that unmount-on-drop, is leaked:
    // we unmount ourselves, on a signal.
    let bg: &'static mut fuser::BackgroundSession = Box::leak(Box::new(session.spawn()?));
    let worker = std::mem::replace(&mut bg.guard, std::thread::spawn(|| Ok(())));
    let handle = signals.handle();
    let watcher = spawn_signal_watcher(signals, fs.clone(), mountpoint, writable)?;
    ready();
    let r = worker
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the FUSE session thread panicked")));
    handle.close();
    let _ = watcher.join();
    fs.stop_committer();
    session_outcome(&fs, r)
}

/// Option phase of [`serve`]: the kernel mount options (read-write or read-only, permission
/// checks by the kernel, source name and type, the extra flags), who may use the mount, and
/// the worker threads, each on its own cloned /dev/fuse descriptor.
fn session_config(cfg: &MountConfig, writable: bool) -> Config {
    let mut options = vec![
        if writable {
            MountOption::RW
        } else {
            MountOption::RO
        },
        MountOption::DefaultPermissions,
        MountOption::FSName(cfg.fsname.clone()),
        // As a kernel option rather than MountOption::Subtype, which fuser passes only to
        // fusermount3; the kernel takes it either way and shows the type as fuse.<subtype>.
        MountOption::CUSTOM(format!("subtype={}", cfg.subtype)),
    ];
    options.extend(cfg.flags.iter().cloned());
    let mut config = Config::default();
    config.mount_options = options;
    config.acl = if cfg.allow_other {
        SessionACL::All
    } else if cfg.allow_root {
        SessionACL::RootAndOwner
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(cfg.threads.max(1));
    config.clone_fd = true;
    config
}

/// Mount phase of [`serve`]: checks /dev/fuse is open to this process, then mounts, saying
/// what to do when the kernel refuses the mount.
fn mount_session(
    fs: Arc<Fs>,
    root: Inode,
    dir: &Path,
    config: &Config,
    cfg: &MountConfig,
) -> std::io::Result<Session<ButterFuse>> {
    let nodes = usize::try_from(cfg.cache_size / prune::BYTES_PER_NODE).unwrap_or(usize::MAX);
    let bf = Adapter::new(fs, root)
        .with_caching(cfg.caching)
        .with_uring(cfg.uring)
        .with_node_bound(nodes);
    let bf = Arc::new(if cfg.bulk {
        bf
    } else {
        bf.without_bulk_lanes()
    });
    // Open to this user or not, as its own error (fuser would say a bare "Permission denied").
    fuse_device_access()?;
    let session = Session::new(ButterFuse(bf.clone()), dir, config);
    if let Ok(s) = &session {
        let _ = bf.notifier.set(s.notifier());
        prune::start(&bf, std::os::fd::AsFd::as_fd(s));
        // INIT is answered: the io_uring queues, when the kernel agreed to them.
        if let Err(e) = ring::start(&bf, std::os::fd::AsFd::as_fd(s)) {
            let _ = unmount(dir, true);
            return Err(e);
        }
    }
    session.map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            std::io::Error::new(
                e.kind(),
                format!(
                    "{e}: the kernel refused the FUSE mount (as a regular user, the mount \
                     point must be a directory you own and fusermount3 must be installed \
                     setuid root; or run butter mount as root)"
                ),
            )
        } else {
            e
        }
    })
}

/// Signal phase of [`serve`]: a thread that unmounts `mountpoint` on the first signal (lazily
/// if that fails), and on a second commits what it can and exits the process.
fn spawn_signal_watcher(
    mut signals: signal_hook::iterator::Signals,
    watcher_fs: Arc<Fs>,
    mountpoint: PathBuf,
    writable: bool,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("butter-signals".into())
        .spawn(move || {
            let mut asked = false;
            for sig in signals.forever() {
                if asked {
                    eprintln!(
                        "butter: second signal {sig}: exiting without waiting for the unmount"
                    );
                    if writable {
                        // Whatever the running operations leave: after them, commit.
                        match watcher_fs.commit() {
                            Ok(()) => eprintln!("butter: committed"),
                            Err(e) => eprintln!(
                                "butter: the last commit failed ({e}); the image keeps the one before"
                            ),
                        }
                    }
                    std::process::exit(1);
                }
                asked = true;
                log::info!("signal {sig}: unmounting {}", mountpoint.display());
                if let Err(e) = unmount(&mountpoint, false) {
                    eprintln!(
                        "butter: unmounting {} failed ({e}); detaching it now, serving until its last user lets go",
                        mountpoint.display()
                    );
                    if let Err(e) = unmount(&mountpoint, true) {
                        eprintln!("butter: detaching {} failed: {e}", mountpoint.display());
                    }
                }
            }
        })
}

/// Final phase of [`serve`]: how the session ended (`r`, from its worker thread) and whether
/// the engine dropped changes after the last commit.
fn session_outcome(fs: &Fs, r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        // The kernel aborted the connection (`/sys/fs/fuse/connections/N/abort`, or the end
        // of a detached mount racing the last reads; fuser asks for FUSE_ABORT_ERROR, so the
        // readers see ECONNABORTED instead of ENODEV). Nothing more can come: the session's
        // `destroy` has run, as after an unmount.
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {
            log::warn!("the kernel aborted the FUSE connection; the session ends");
        }
        r => r?,
    }
    match fs.stopped() {
        Some(why) => Err(std::io::Error::other(format!(
            "changes after the last commit were dropped: {why}"
        ))),
        None => Ok(()),
    }
}

/// Checks that this process can open /dev/fuse, and says exactly what to do when it cannot.
/// (When it can, a regular user's mount goes through the setuid fusermount3, which fuser
/// runs when mount(2) is not permitted; fusermount3 too opens /dev/fuse as the user.)
fn fuse_device_access() -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    const DEV: &str = "/dev/fuse";
    match std::fs::OpenOptions::new().read(true).write(true).open(DEV) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(std::io::Error::new(
            e.kind(),
            "/dev/fuse does not exist: load the fuse module (modprobe fuse), or in a container \
             pass the device in (docker run --device /dev/fuse)",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let mode = std::fs::metadata(DEV)
                .map(|m| format!("mode {:04o}, owner uid {}", m.mode() & 0o7777, m.uid()))
                .unwrap_or_else(|_| "unknown mode".into());
            Err(std::io::Error::new(
                e.kind(),
                format!(
                    "cannot open /dev/fuse ({mode}): regular users can mount FUSE filesystems \
                     only where /dev/fuse is open to them, as distributions set it up (mode \
                     0666). Ask an administrator to run `chmod 0666 /dev/fuse` (or add the udev \
                     rule KERNEL==\"fuse\", MODE=\"0666\"), or run butter mount as root; to \
                     read the image without mounting, use butter ls, cat or restore"
                ),
            ))
        }
        Err(e) => Err(std::io::Error::new(e.kind(), format!("opening {DEV}: {e}"))),
    }
}

/// Unmounts `dir` (detaches it if `lazy`): umount2 as root, else the setuid fusermount3.
pub(crate) fn unmount(dir: &Path, lazy: bool) -> Result<(), String> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: a valid NUL-terminated path; umount2 does not keep the pointer.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EPERM) {
        return Err(err.to_string());
    }
    let mut cmd = std::process::Command::new("fusermount3");
    cmd.arg("-u").arg("-q");
    if lazy {
        cmd.arg("-z");
    }
    match cmd.arg("--").arg(dir).status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("fusermount3 -u: {s}")),
        Err(e) => Err(format!("running fusermount3: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_round_trip_and_are_stable() {
        let root = Inode { root: 5, ino: 256 };
        let m = InodeMap::new(root);
        assert_eq!(m.node_id(root), 1);
        assert_eq!(m.inode(1), Some(root));
        assert_eq!(m.st_ino(1), 256);
        let f = Inode { root: 5, ino: 257 };
        assert_eq!(m.node_id(f), 257);
        assert_eq!(m.inode(257), Some(f));
        let a = Inode {
            root: 256,
            ino: 256,
        };
        let b = Inode {
            root: 256,
            ino: 300,
        };
        let na = m.node_id(a);
        let nb = m.node_id(b);
        assert_eq!(na, TABLE_BASE);
        assert_eq!(nb, TABLE_BASE + 1);
        assert_eq!(m.node_id(a), na);
        assert_eq!(m.inode(nb), Some(b));
        assert_eq!(m.inode(TABLE_BASE + 2), None);
        // A number of the mounted subvolume that would collide goes through the table.
        let odd = Inode {
            root: 5,
            ino: TABLE_BASE + 7,
        };
        assert_eq!(m.node_id(odd), TABLE_BASE + 2);
        assert_eq!(m.inode(TABLE_BASE + 2), Some(odd));
        let one = Inode { root: 5, ino: 1 };
        assert_eq!(m.node_id(one), TABLE_BASE + 3);
    }

    #[test]
    fn times_before_and_after_the_epoch() {
        let t = system_time(Timespec { sec: 5, nsec: 7 });
        assert_eq!(t.duration_since(UNIX_EPOCH).unwrap(), Duration::new(5, 7));
        let t = system_time(Timespec {
            sec: -2,
            nsec: 500_000_000,
        });
        assert_eq!(
            UNIX_EPOCH.duration_since(t).unwrap(),
            Duration::from_millis(1500)
        );
        let _ = system_time(Timespec {
            sec: i64::MIN,
            nsec: u32::MAX,
        });
        let _ = system_time(Timespec {
            sec: i64::MAX,
            nsec: u32::MAX,
        });
    }

    #[test]
    fn names_the_kernel_refuses() {
        assert!(check_name(b"a").is_ok());
        assert!(check_name(b"").is_err());
        assert!(check_name(b"a/b").is_err());
        assert!(check_name(b"..").is_err());
        assert!(check_name(&[b'x'; 256]).is_err());
    }
}
