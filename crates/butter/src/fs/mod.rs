//! The filesystem facade, used by the CLI tools and the FUSE front end: opening (the
//! superblock, the chunk tree, log replay, the writer, orphan cleanup), the gate policies of
//! concurrent callers, fsync and commit under them, the commit scheduler and the close, and
//! every operation a front end calls, each taking its own passage (ops.rs) and, where a
//! caller is named, applying the POSIX rules a FUSE server owns (posix.rs, acl.rs). The
//! inode layer's [`Core`] does the work and is not reachable from outside the crate.

pub(crate) mod acl;
mod fix_csum;
mod init_csum;
mod init_extent;
mod ops;
pub mod posix;
mod repair;
mod rescue;
mod wrappers;

pub use fix_csum::BadSector;
pub use repair::RepairReport;

pub use ops::{At, DirEnd, NewKind, NewNode, Renamed, Side};

use crate::ctree::{self, Root};
use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::device::{BlockDevice, FileDevice};
use std::collections::HashMap;
use std::path::Path as FsPath;
use std::sync::{Arc, Mutex};

pub use crate::ids::Inode;
pub(crate) use crate::inode::core::Core;
pub use crate::inode::namespace::Owner;
pub use crate::inode::namespace::SetAttr;
pub use crate::inode::read::DirEntry;
pub use crate::inode::read::Stat;
pub use crate::inode::read::EMPTY_SUBVOL_DIR_OBJECTID;
pub use crate::inode::seek::Seek;

/// Options of a read-only open.
#[derive(Debug, Clone, Copy)]
pub struct OpenOpts {
    /// Replay an fsync log in memory (the default). Off: show the last committed state
    /// and ignore the log (the kernel's `nologreplay`).
    pub log_replay: bool,
    /// Open a filesystem of several devices with some missing (the kernel's `degraded`):
    /// reads use the other copies or rebuild from parity where the profiles allow.
    pub degraded: bool,
}

impl Default for OpenOpts {
    fn default() -> Self {
        OpenOpts {
            log_replay: true,
            degraded: false,
        }
    }
}

impl OpenOpts {
    /// Ignore any fsync log.
    pub fn nologreplay() -> Self {
        OpenOpts {
            log_replay: false,
            ..OpenOpts::default()
        }
    }
}

/// An open filesystem: the [`Core`] of parts the inode layer works on, and the periodic
/// committer.
pub struct Fs {
    core: Core,
    /// The periodic commit thread ([`Fs::start_committer`]): its stop signal and handle.
    committer: Mutex<Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>>,
    /// What the POSIX rules remember of inodes (set-id bits, capabilities).
    remembered: posix::Remembered,
    /// ACLs enforced ([`Fs::enforce_acls`]).
    acls: std::sync::atomic::AtomicBool,
    /// Changed tree blocks a transaction may hold before a change commits it
    /// ([`Fs::set_memory`]); `u64::MAX`: no limit but the periodic commit.
    dirty_limit: std::sync::atomic::AtomicU64,
    /// A commit for the dirty limit is running.
    dirty_commit: std::sync::atomic::AtomicBool,
}

/// How much memory an open filesystem may use for tree blocks ([`Fs::set_memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    /// Clean tree blocks kept to be read again (the block cache).
    pub cache: u64,
    /// Tree blocks changed since the last commit (held in memory until it): past this, the
    /// change that crossed it commits.
    pub dirty: u64,
}

/// Why an image could not be opened, in a user's words: a missing file or a permission is
/// no I/O error at some byte.
fn open_error(path: &FsPath, write: bool, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound(format!(
            "{}: no such file or device (give the path of an image file or block device)",
            path.display()
        )),
        std::io::ErrorKind::PermissionDenied => Error::NotPermitted(format!(
            "{}: permission denied (run as a user who may {} it, or as root)",
            path.display(),
            if write { "write" } else { "read" }
        )),
        _ => Error::io(
            format!(
                "opening {}{}",
                path.display(),
                if write { " read-write" } else { "" }
            ),
            0,
            e,
        ),
    }
}

/// Opens one device of a filesystem: an image file or block device (`rw`: as the only
/// writer, see [`FileDevice::open_exclusive`]), or an NBD export named by an `nbd://` or
/// `nbd+unix://` address (see [`crate::io::nbd`]).
fn open_one(path: &FsPath, rw: bool) -> Result<Arc<dyn BlockDevice>> {
    if let Some(addr) = path.to_str().and_then(crate::io::nbd::Address::parse) {
        let addr = addr.map_err(Error::Invalid)?;
        let dev = crate::io::nbd::NbdDevice::open(&addr)
            .map_err(|e| Error::io(format!("connecting to {}", path.display()), 0, e))?;
        if rw && !dev.writable() {
            return Err(Error::NotPermitted(format!(
                "{}: the NBD server exports it read-only; open it read-only",
                path.display()
            )));
        }
        return Ok(Arc::new(dev));
    }
    if !rw {
        let dev = FileDevice::open(path, false).map_err(|e| open_error(path, false, e))?;
        return Ok(Arc::new(dev));
    }
    let dev = FileDevice::open_exclusive(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::ResourceBusy {
            Error::NotPermitted(format!(
                "{} cannot be opened read-write: {e}",
                path.display()
            ))
        } else {
            open_error(path, true, e)
        }
    })?;
    Ok(Arc::new(dev))
}

impl Fs {
    /// Opens an image file or block device read-only.
    pub fn open(path: &FsPath) -> Result<Fs> {
        let dev = FileDevice::open(path, false).map_err(|e| open_error(path, false, e))?;
        Self::open_device(Arc::new(dev))
    }

    /// Opens an image file or block device read-only, with options.
    pub fn open_opts(path: &FsPath, opts: OpenOpts) -> Result<Fs> {
        let dev = FileDevice::open(path, false).map_err(|e| open_error(path, false, e))?;
        Self::open_device_opts(Arc::new(dev), opts)
    }

    /// Opens a filesystem of several devices read-only: the image (`paths[0]`) and the
    /// others, in any order. Each is matched by fsid and device UUID; a device missing,
    /// given twice or from another filesystem is an error naming it (a missing one is let
    /// through with [`OpenOpts::degraded`]).
    pub fn open_paths(paths: &[&FsPath], opts: OpenOpts) -> Result<Fs> {
        let mut given: Vec<(String, Arc<dyn BlockDevice>)> = Vec::with_capacity(paths.len());
        for path in paths {
            given.push((path.display().to_string(), open_one(path, false)?));
        }
        Self::open_device_set(given, opts)
    }

    /// [`Fs::open_paths`] over devices already open, each with a name for messages.
    pub fn open_device_set(
        given: Vec<(String, Arc<dyn BlockDevice>)>,
        opts: OpenOpts,
    ) -> Result<Fs> {
        let fs = Self::open_set_nolog(given, opts.degraded)?;
        Self::replay_if(fs, opts)
    }

    /// Opens a device read-only. An unreplayed fsync log is replayed in memory (nothing is
    /// written), so reads show what a kernel mount would.
    pub fn open_device(dev: Arc<dyn BlockDevice>) -> Result<Fs> {
        Self::open_device_opts(dev, OpenOpts::default())
    }

    /// Opens an image file or block device read-write, as its only writer: refused while
    /// another process has it open read-write or the kernel may have it mounted (see
    /// [`FileDevice::open_exclusive`]).
    pub fn open_rw(path: &FsPath) -> Result<Fs> {
        Self::open_rw_with(path, RwOptions::default())
    }

    /// [`Fs::open_rw`] with the write engine's options.
    pub fn open_rw_with(path: &FsPath, opts: RwOptions) -> Result<Fs> {
        Self::open_rw_paths(&[path], opts)
    }

    /// [`Fs::open_rw_with`] of a filesystem of several devices: the image (`paths[0]`) and
    /// the others, each locked as the only writer's (see [`Fs::open_paths`] for how they
    /// are matched). Every device must be there: a degraded filesystem opens read-only.
    pub fn open_rw_paths(paths: &[&FsPath], opts: RwOptions) -> Result<Fs> {
        let mut given: Vec<(String, Arc<dyn BlockDevice>)> = Vec::with_capacity(paths.len());
        for path in paths {
            given.push((path.display().to_string(), open_one(path, true)?));
        }
        Self::open_device_set_rw_with(given, opts)
    }

    /// Opens a device read-write: starts the write engine.
    pub fn open_device_rw(dev: Arc<dyn crate::io::device::BlockDevice>) -> Result<Fs> {
        Self::open_device_rw_with(dev, RwOptions::default())
    }

    /// [`Fs::open_device_rw`] with the write engine's options, in force before anything is
    /// written (the log replay and the orphan cleanup included).
    pub fn open_device_rw_with(
        dev: Arc<dyn crate::io::device::BlockDevice>,
        opts: RwOptions,
    ) -> Result<Fs> {
        Self::open_device_set_rw_with(vec![("the image".to_string(), dev)], opts)
    }

    /// [`Fs::open_device_rw_with`] over the devices of a filesystem of several (named for
    /// messages, the image first).
    pub fn open_device_set_rw_with(
        given: Vec<(String, Arc<dyn BlockDevice>)>,
        opts: RwOptions,
    ) -> Result<Fs> {
        let mut fs = if opts.untouched {
            Self::over_disk(crate::ctree::open_disk_set_with(
                given,
                opts.degraded,
                true,
            )?)?
        } else {
            Self::open_set_nolog(given, opts.degraded)?
        };
        fs.refuse_writes()?;
        if opts.untouched && fs.core.disk.sb.log_root != 0 {
            return Err(Error::Unsupported(
                "the image has an unreplayed fsync log: replay it first (open or mount it \
                 read-write once), or drop it with `butter rescue zero-log` (what was fsynced \
                 since the last commit is then lost)"
                    .into(),
            ));
        }
        fs.core.set_fsync_log(opts.fsync_log);
        fs.core
            .set_fsync_skips_writes_in_progress(opts.fsync_skips_writes_in_progress);
        fs.core.set_unlocked_writeback(opts.unlocked_writeback);
        fs.core.set_delayed_allocation(opts.delayed_allocation);
        fs.core.compress = opts.compress;
        fs.core.compress_force = opts.compress_force && opts.compress.is_some();
        fs.core.max_inline = crate::inode::file::max_inline_for(&fs.core.disk, opts.max_inline);
        let mut w = crate::tree_log::replay::start_writer(&fs.core)?;
        if let Some(why) = &w.extent_tree_unread {
            if !opts.untouched {
                return Err(Error::corrupt(
                    crate::error::Location::what("extent tree").with_tree(EXTENT_TREE_OBJECTID),
                    format!(
                        "{why}; `butter check --repair --init-extent-tree` makes it again from \
                         the other trees"
                    ),
                ));
            }
        }
        if opts.unfinished {
            // From the first commit on, no copy of the superblock says "filesystem" until
            // `close` (an interrupted build leaves an image no tool takes for a filesystem).
            w.set_magic(MAGIC_TEMPORARY)?;
            fs.core
                .unfinished
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        w.set_combined_replace(opts.combined_replace);
        w.small_chunks = opts.small_chunks;
        if opts.legacy_allocator {
            w.use_legacy_allocator()?;
        }
        fs.core.allocator = Some(w.allocator.clone());
        fs.core.writer_aborted = w.abort_flag.clone();
        fs.core.writer = Some(Mutex::new(w));
        fs.core.disk.set_writable();
        if opts.untouched {
            return Ok(fs);
        }
        // Files unlinked while open when the last writer stopped: their space comes back now,
        // as the kernel gives it back at mount.
        let n = fs.core.clean_orphans()?;
        if n > 0 {
            log::info!(
                "deleted {n} orphan inodes (unlinked while open when the last writer stopped)"
            );
            fs.core.commit()?;
        }
        // Subvolumes deleted while their drop was cut off (by butter or the kernel): the drop
        // goes on from its recorded progress, as the kernel's cleaner continues it at mount.
        let n = fs.core.drop_dead_trees()?;
        if n > 0 {
            log::info!("finished dropping {n} deleted subvolumes");
        }
        Ok(fs)
    }

    /// What stops butter writing to this filesystem, checked before anything is written: a
    /// chunk that lost more stripes to missing devices than its profile tolerates (the
    /// kernel's rule for a degraded read-write mount).
    fn refuse_writes(&self) -> Result<()> {
        let disk = &self.core.disk;
        let map = disk.chunk_map();
        if let Some(&at) = crate::io::volumes::chunks_beyond_repair(&map, &disk.devices).first() {
            let c = map.lookup(at).map(|c| c.item.ty).unwrap_or(0);
            return Err(Error::Unsupported(format!(
                "the {} chunk at logical {at} has more stripes on missing devices than it \
                 can lose: the filesystem cannot be written degraded; open it read-only to copy \
                 files off",
                crate::io::volumes::profile_name(c)
            )));
        }
        Ok(())
    }

    pub(crate) fn open_device_opts(dev: Arc<dyn BlockDevice>, opts: OpenOpts) -> Result<Fs> {
        let fs = Self::open_set_nolog(vec![("the image".to_string(), dev)], opts.degraded)?;
        Self::replay_if(fs, opts)
    }

    /// Replays the fsync log in memory where `opts` asks it and there is one.
    fn replay_if(fs: Fs, opts: OpenOpts) -> Result<Fs> {
        if opts.log_replay && fs.core.disk.sb.log_root != 0 {
            crate::tree_log::replay::replay_in_memory(&fs.core)?;
            fs.core
                .roots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
        }
        Ok(fs)
    }

    fn open_set_nolog(given: Vec<(String, Arc<dyn BlockDevice>)>, degraded: bool) -> Result<Fs> {
        let disk = crate::ctree::open_disk_set(given, degraded)?;
        Self::over_disk(disk)
    }

    /// The filesystem as superblock `sb` (not yet written) would have it, read-only, the
    /// blocks of `disk`'s running transaction read from memory: what a commit is about to
    /// make (a repair checks it before writing anything).
    pub(crate) fn candidate(
        disk: &crate::io::disk_io::Disk,
        sb: &crate::format::superblock::Superblock,
    ) -> Result<Fs> {
        Self::over_disk(crate::ctree::open_disk_as(disk, sb.clone())?)
    }

    /// A read-only filesystem over an opened disk.
    fn over_disk(disk: Arc<crate::io::disk_io::Disk>) -> Result<Fs> {
        let max_inline =
            crate::inode::file::max_inline_for(&disk, crate::inode::file::DEFAULT_MAX_INLINE);
        let sb = &disk.sb;
        let tree_root = Root::of_root_tree(sb);
        if sb.log_root != 0 {
            log::info!(
                "the image has an unreplayed fsync log (log_root {})",
                sb.log_root
            );
        }
        let mut fs = Core {
            disk,
            opened_tree_root: tree_root,
            csum_root: None,
            live: Default::default(),
            writer: None,
            allocator: None,
            writer_aborted: Default::default(),
            unfinished: Default::default(),
            open_files: Mutex::new(HashMap::new()),
            roots: Mutex::new(HashMap::new()),
            default_subvol: FS_TREE_OBJECTID.into(),
            log_sync: Mutex::new(()),
            fsync_log: std::sync::atomic::AtomicBool::new(true),
            ordered: Default::default(),
            prealloc: Default::default(),
            writeback: Default::default(),
            unlocked_writeback_above: std::sync::atomic::AtomicU64::new(
                crate::inode::ordered::SHORT_WRITEBACK,
            ),
            fsync_waits_for_writes: std::sync::atomic::AtomicBool::new(false),
            gate: Default::default(),
            compress: None,
            compress_force: false,
            max_inline,
        };
        fs.csum_root = match fs.find_root_item(CSUM_TREE_OBJECTID)? {
            Some(ri) => Some(Root {
                id: CSUM_TREE_OBJECTID,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            }),
            None => None,
        };
        // The default subvolume: dir item "default" in the root tree directory.
        let hash = hash::name_hash(b"default");
        if let Some(it) = ctree::lookup(
            &fs.disk,
            &fs.tree_root(),
            &Key::new(ROOT_TREE_DIR_OBJECTID, DIR_ITEM_KEY, hash),
        )? {
            for d in DirItem::parse_all(it.data()).map_err(|e| it.annotate(e))? {
                if d.name == b"default" && d.location.ty == ROOT_ITEM_KEY {
                    *fs.default_subvol.get_mut() = d.location.objectid;
                }
            }
        }
        fs.subvol_root(fs.default_subvolume())?;
        Ok(Fs {
            core: fs,
            committer: Mutex::new(None),
            remembered: Default::default(),
            acls: Default::default(),
            dirty_limit: std::sync::atomic::AtomicU64::new(u64::MAX),
            dirty_commit: Default::default(),
        })
    }
}

impl Fs {
    /// The inode layer, for the engine's own modules (receive, send, the log replay), which
    /// run alone or hold their passage themselves.
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

// ---------------------------------------------------------------------------------------------
// The gate policies for concurrent callers (see crate::gate for the rules)
// ---------------------------------------------------------------------------------------------

impl Fs {
    /// Passes the gate as a reader, after completing pending ordered extents (a reader would
    /// complete them, changing trees under the other readers).
    pub(crate) fn read_gate(&self) -> crate::gate::GateRead<'_> {
        self.read_gate_unless(None)
    }

    /// [`Fs::read_gate`] for a read of `ino` alone (its data, attributes, flags): completes
    /// pending ordered extents only when `ino` has some, so reading one file does not wait
    /// for the completion of another file's writes. (Pending extents and delayed appends
    /// appear only under the exclusive gate, so none appear for `ino` while this is held; a
    /// delayed preallocation may, from an fallocate that began after the read, and stays in
    /// memory: the read does not see it, and no reader completes one.)
    pub(crate) fn read_gate_on(&self, ino: Inode) -> crate::gate::GateRead<'_> {
        self.read_gate_unless(Some(ino))
    }

    /// The shared passage once no pending ordered extent or delayed preallocation (of
    /// `only`, or of any file) is left for the read to complete: while one is, it is completed
    /// under the exclusive gate first (only `only`'s: other files' writes stay pending).
    /// Delayed preallocations are completed once: those made after that come from
    /// fallocates that began after the read.
    fn read_gate_unless(&self, only: Option<Inode>) -> crate::gate::GateRead<'_> {
        let mut preallocs_done = false;
        let pending = |preallocs_done: bool| {
            (match only {
                Some(ino) => self.core.ordered.has_pending(ino),
                None => self.core.has_pending_ordered(),
            }) || (!preallocs_done && self.core.prealloc.has(only))
        };
        loop {
            let g = self.core.gate.read();
            if !pending(preallocs_done) || self.core.stopped().is_some() {
                return g;
            }
            drop(g);
            let _c = self.core.gate.change();
            let done = match only {
                Some(ino) => self.core.complete_ordered_extents_of(ino),
                None => self.core.complete_ordered_extents(),
            }
            .and_then(|()| self.complete_preallocs_gated(only));
            preallocs_done = true;
            if let Err(e) = done {
                self.core.stop(format!("completing writes: {e}"));
            }
        }
    }

    /// Delayed preallocations (of `only`, or every file's) into the trees; the caller holds
    /// the exclusive gate.
    fn complete_preallocs_gated(&self, only: Option<Inode>) -> Result<()> {
        if !self.core.prealloc.has(only) {
            return Ok(());
        }
        let mut w = self.core.writer_keeping_ordered()?;
        self.core.complete_preallocs(&mut w, only)
    }

    /// fallocate(2) under the gate: an fallocate of whole sectors at a file's sector-aligned
    /// end is served in memory (delayed preallocation, crate::inode::ordered::Preallocs) under
    /// the file's inode passage and a lane of the gate (`Gate::lane`: no change of the trees
    /// runs meanwhile, readers and other files' in-memory changes do), so fallocates of
    /// different files run side by side without sharing a lock; any other passes the
    /// exclusive gate.
    pub(crate) fn gated_fallocate(
        &self,
        ino: Inode,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        if self.fallocate_in_memory_gated(ino, mode, offset, len) {
            return Ok(());
        }
        let g = self.change_gate_on(ino)?;
        g.settle("fallocate", self.core.fallocate(ino, mode, offset, len))
    }

    /// truncate(2) under the gate: a truncate of a file with a delayed preallocation back to
    /// where that starts is served in memory (see [`Fs::gated_fallocate`]); any other passes
    /// the exclusive gate.
    pub(crate) fn gated_truncate(&self, ino: Inode, size: u64) -> Result<()> {
        if self.in_lane(ino, || self.core.truncate_in_memory(ino, size)) == Some(true) {
            return Ok(());
        }
        let g = self.change_gate_on(ino)?;
        g.settle("truncate", self.core.truncate(ino, size))
    }

    /// The in-memory half of [`Fs::gated_fallocate`]: whether it served the fallocate.
    pub(crate) fn fallocate_in_memory_gated(
        &self,
        ino: Inode,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> bool {
        for attempt in 0..2 {
            // Anything it cannot judge cheaply (or that fails) goes the ordinary way, which
            // reports it.
            match self.in_lane(ino, || {
                self.core.fallocate_in_memory(ino, mode, offset, len)
            }) {
                Some(Ok(Some(done))) => return done,
                // No data space: a commit gives back what the running transaction freed, or
                // a new chunk comes (under the exclusive gate, other files' delayed
                // preallocations left in memory), then once more. The ordinary way would
                // complete them all, and their files' next truncates would take the
                // ordinary way too.
                Some(Ok(None)) if attempt == 0 => {
                    let Ok(c) = self.change_gate() else {
                        return false;
                    };
                    if c.settle("making data space", self.core.make_data_space(len))
                        .is_err()
                    {
                        return false;
                    }
                }
                _ => return false,
            }
        }
        false
    }

    /// Runs `f`, an in-memory change of `ino`, under the file's inode passage and a lane of
    /// the gate (`Gate::lane`). While a change of the trees holds the gate (often short: a
    /// chunk added for another file), waits for it as a reader would and tries again, a few
    /// times: its own way would complete every file's delayed preallocation. `None`: not run.
    fn in_lane<R>(&self, ino: Inode, f: impl Fn() -> R) -> Option<R> {
        for _ in 0..4 {
            if !self.core.is_writable() || self.core.has_stopped() {
                return None;
            }
            let _p = self.core.gate.inode(ino);
            if let Some(_lane) = self.core.gate.lane(ino) {
                return Some(f());
            }
            drop(_p);
            drop(self.core.gate.read());
        }
        None
    }

    /// One handle on `ino` closed (a front end's release). The last handle of an unlinked
    /// file deletes it now, under the gate; most releases change nothing and pass as readers.
    /// Once changes stopped, the orphan item stays for the next read-write open.
    pub fn release(&self, ino: Inode) -> Result<()> {
        let last = {
            // The link count is all it reads: the file's writes in flight stay pending.
            let _r = self.core.gate.read();
            self.core.note_closed(ino)?
        };
        if !last {
            return Ok(());
        }
        let Ok(g) = self.change_gate_on(ino) else {
            return Ok(());
        };
        g.settle(
            &format!("deleting unlinked inode {} at its last close", ino.ino),
            self.core.delete_orphan(ino),
        )
    }

    /// Passes the gate as a reader without completing pending ordered extents: for reads
    /// they cannot change (xattrs), which must not write delayed appends back.
    pub(crate) fn read_gate_as_is(&self) -> crate::gate::GateRead<'_> {
        self.core.gate.read()
    }

    /// Passes the gate as a change: `ReadOnly` when opened read-only, `Aborted` once changes
    /// stopped (also while this one waited). The change's failure goes to the guard
    /// ([`crate::gate::GateChange::failed`]), which judges whether it stops changes; a panic
    /// unwinding through the guard stops them.
    pub(crate) fn change_gate(&self) -> Result<crate::gate::GateChange<'_>> {
        self.admit(|| self.core.gate.change())
    }

    /// [`Fs::change_gate`] for a change that may take `ino`'s range locks (a truncate,
    /// fallocate, a write through another call, the deletion of an orphan): `ino`'s inode
    /// passage first (crate::gate).
    pub(crate) fn change_gate_on(&self, ino: Inode) -> Result<crate::gate::GateChange<'_>> {
        self.admit(|| self.core.gate.change_inode(ino))
    }

    /// A change through the gate `take` passes, if changes may run: checked before it waits,
    /// and again after, since changes may have stopped meanwhile (the change before it failed
    /// half way).
    fn admit<'a>(
        &'a self,
        take: impl FnOnce() -> crate::gate::GateChange<'a>,
    ) -> Result<crate::gate::GateChange<'a>> {
        self.may_change()?;
        let g = take();
        if self.core.has_stopped() {
            self.may_change()?;
        }
        Ok(g)
    }

    /// [`Fs::change_gate_on`] for [`Fs::write`]s to `ino`: the write steps out of the gate
    /// while its data goes to the device, so other files are read and changed meanwhile.
    pub(crate) fn write_gate(&self, ino: Inode) -> Result<crate::gate::GateChange<'_>> {
        let g = self.change_gate_on(ino)?;
        g.let_data_out();
        Ok(g)
    }

    /// `ReadOnly` when opened read-only, `Aborted` once changes stopped.
    fn may_change(&self) -> Result<()> {
        if !self.core.is_writable() {
            return Err(Error::ReadOnly);
        }
        match self.core.stopped() {
            Some(why) => Err(Error::Aborted(why)),
            None => Ok(()),
        }
    }

    /// fsync of one inode under the gate: logs it (waiting for running changes, not for a
    /// commit in progress), then writes the log, in one log commit with the fsyncs that
    /// logged meanwhile; commits instead where the engine cannot log the inode.
    pub(crate) fn gated_fsync(&self, ino: Inode) -> Result<()> {
        // Waiting for the inode's writes in progress (without the fsync rule that skips them)
        // means waiting for their range locks: the inode passage does that before the gate
        // (crate::gate).
        let _inode = self
            .core
            .fsync_waits_for_writes
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| self.core.gate.inode(ino));
        // A delayed preallocation of the file goes into the trees first, under the exclusive
        // gate (the log copies trees; no reader may see them change).
        if self.core.prealloc.has(Some(ino)) {
            let c = self.change_gate()?;
            c.settle("fsync", self.complete_preallocs_gated(Some(ino)))?;
        }
        let ticket = {
            // Shared: the trees do not change under a reader; the writer lock keeps other
            // fsyncs out of the log meanwhile.
            let _g = if self.core.fsync_completes_ordered() {
                self.read_gate()
            } else {
                self.read_gate_as_is()
            };
            if let Some(why) = self.core.stopped() {
                return Err(Error::Aborted(why));
            }
            self.core.log_inode(ino)?
        };
        match ticket {
            crate::transaction::log_state::LogTicket::Logged(seq) => self.core.sync_log(seq),
            crate::transaction::log_state::LogTicket::Durable => Ok(()),
            crate::transaction::log_state::LogTicket::Commit => self.gated_commit(),
        }
    }

    /// Commits after the running changes, unless changes stopped. Reads run again once the
    /// trees are final, while the commit writes.
    /// Bounds the memory tree blocks take: the block cache to `m.cache` bytes, and the
    /// blocks changed since the last commit to `m.dirty` bytes (a change that leaves more
    /// commits, as the kernel's btrfs commits when dirty metadata passes its threshold). So
    /// a long run of changes between periodic commits (a 100k-file untar) does not grow
    /// memory with the number of files.
    pub fn set_memory(&self, m: MemoryLimits) {
        self.core.disk().set_cache_bytes(m.cache);
        self.dirty_limit
            .store(m.dirty, std::sync::atomic::Ordering::Relaxed);
    }

    /// After a change (its passage released): commits when the running transaction holds
    /// more changed tree blocks than the dirty limit. One thread commits; the others go on.
    pub(crate) fn commit_if_dirty(&self) {
        use std::sync::atomic::Ordering;
        let limit = self.dirty_limit.load(Ordering::Relaxed);
        if limit == u64::MAX {
            return;
        }
        let disk = self.core.disk();
        let dirty = disk.overlay_len() as u64 * u64::from(disk.nodesize());
        if dirty <= limit || self.dirty_commit.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Err(e) = self.gated_commit() {
            log::error!("commit for the dirty metadata limit: {e}");
        }
        self.dirty_commit.store(false, Ordering::Release);
    }

    pub(crate) fn gated_commit(&self) -> Result<()> {
        let g = self.core.gate.commit();
        if let Some(why) = self.core.stopped() {
            return Err(Error::Aborted(why));
        }
        let exclusive = g.exclusive;
        let _changes = g.changes;
        self.core.commit_with(move || drop(exclusive))
    }
}

/// The write engine's options, given at the read-write open ([`Fs::open_rw_with`]).
#[derive(Debug, Clone, Copy)]
pub struct RwOptions {
    /// fsync writes the log tree (else it commits the transaction). Default on.
    pub fsync_log: bool,
    /// The fsync rule that skips writes in progress: an fsync does not wait for the inode's
    /// writes in progress. Default on.
    pub fsync_skips_writes_in_progress: bool,
    /// Extents longer than 64 KiB are written without the writer lock. Default on.
    pub unlocked_writeback: bool,
    /// Appends gather in memory (delayed allocation). Default on.
    pub delayed_allocation: bool,
    /// File extents are replaced in the leaf of one descent when possible. Default on; off,
    /// each replacement deletes and inserts in descents of their own (for the benchmark's
    /// comparison).
    pub combined_replace: bool,
    /// Compress written data (the kernel's `compress=`): files whose start compresses, and
    /// files with the compress flag or property. Default off.
    pub compress: Option<crate::format::compress::Compression>,
    /// Compress every file (the kernel's `compress-force=`), with `compress`'s algorithm.
    pub compress_force: bool,
    /// New chunks stay small (data 8 MiB, metadata 32 MiB), as mkfs.btrfs --rootdir makes
    /// them: for images to be shrunk to their content ([`Core::shrink_to_fit`]).
    pub small_chunks: bool,
    /// Files up to this many bytes are stored inline, in the leaf with their inode (the
    /// kernel's `max_inline=`; default 2048), at most what one inline extent holds (less than
    /// a sector). mkfs.btrfs --rootdir inlines every file shorter than a sector.
    pub max_inline: u64,
    /// The block allocator as it was before seed 001 (one goal per space kind, one next-fit
    /// cursor per block group, data allocated under the writer lock), for the benchmarks'
    /// comparison. Default off.
    pub legacy_allocator: bool,
    /// The filesystem is being made (mkfs --rootdir): every superblock written from the open
    /// on carries the temporary magic, and only [`Fs::close`] writes the real one, so an
    /// interrupted build leaves no valid-looking filesystem. Default off.
    pub unfinished: bool,
    /// Open with devices missing (the kernel's `degraded`), where every chunk keeps enough
    /// stripes; new chunks go on the devices left (SINGLE where they cannot make the
    /// profile). Default off.
    pub degraded: bool,
    /// Leave the image exactly as it is until the caller changes it (a repair): no orphan
    /// cleanup, no drop of deleted subvolumes; an unreplayed fsync log is refused rather than
    /// replayed. Default off.
    pub untouched: bool,
}

impl Default for RwOptions {
    fn default() -> Self {
        RwOptions {
            fsync_log: true,
            fsync_skips_writes_in_progress: true,
            unlocked_writeback: true,
            delayed_allocation: true,
            combined_replace: true,
            compress: None,
            compress_force: false,
            small_chunks: false,
            max_inline: crate::inode::file::DEFAULT_MAX_INLINE,
            legacy_allocator: false,
            unfinished: false,
            degraded: false,
            untouched: false,
        }
    }
}

/// What a filesystem has done since it was opened: [`Fs::stats`] at any time, [`Fs::close`]
/// at the end.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// What fsync did (all zeros when read-only).
    pub log: crate::transaction::log_state::LogStats,
    pub ordered: crate::inode::ordered::OrderedStats,
    /// Times a write's data went to the device out of the gate (crate::gate).
    pub data_io_out_of_gate: u64,
    /// What the block allocator did (crate::space::alloc).
    pub alloc: crate::space::alloc::AllocStats,
    /// B-tree descents the write engine made (every root-to-leaf search, restarts included),
    /// and of those the descents that replaced file extents (zeros when read-only).
    pub descents: (u64, u64),
}

impl Fs {
    /// Commits every `every` (the kernel's `commit=` mount option) on a thread of its own,
    /// under the gate, until [`Fs::close`] or [`Fs::stop_committer`]. Nothing to do when
    /// read-only or `every` is zero.
    pub fn start_committer(self: &Arc<Self>, every: std::time::Duration) -> std::io::Result<()> {
        if !self.core.is_writable() || every.is_zero() {
            return Ok(());
        }
        self.stop_committer();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let weak = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("butter-commit".into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
                    let Some(fs) = weak.upgrade() else { return };
                    if let Err(e) = fs.gated_commit() {
                        log::error!("periodic commit: {e}");
                    }
                }
            })?;
        *self.committer.lock().unwrap_or_else(|e| e.into_inner()) = Some((tx, h));
        Ok(())
    }

    /// Stops the periodic commits (waiting for one in progress).
    pub fn stop_committer(&self) {
        let c = self
            .committer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((tx, h)) = c {
            drop(tx);
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// Ends the session: stops the periodic commits, makes the final commit (read-write) and
    /// reports what the filesystem did. An error says why the last changes are not on disk
    /// (the image keeps its last commit).
    pub fn close(&self) -> Result<Stats> {
        self.stop_committer();
        if self.core.is_writable() {
            if let Err(e) = self.gated_commit() {
                self.core.stop(format!("the final commit failed: {e}"));
                return Err(e);
            }
            if self
                .core
                .unfinished
                .swap(false, std::sync::atomic::Ordering::SeqCst)
            {
                // Complete: the superblocks say "filesystem" again.
                let _g = self.core.gate.commit();
                let mut w = self.core.writer()?;
                w.set_magic(MAGIC)?;
            }
        }
        self.stats()
    }

    /// What the filesystem has done since it was opened. Reading it changes nothing: pending
    /// writes stay pending.
    pub fn stats(&self) -> Result<Stats> {
        let (log, descents) = if self.core.is_writable() {
            let w = self.core.writer_keeping_ordered()?;
            (w.log.stats.clone(), w.descents())
        } else {
            Default::default()
        };
        Ok(Stats {
            log,
            ordered: self.core.ordered_stats(),
            data_io_out_of_gate: self.core.gate.steps_out(),
            alloc: self.core.alloc_stats(),
            descents,
        })
    }
}
