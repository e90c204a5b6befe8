//! Ordered extents: file data written to its new place on the device but not yet recorded in
//! the trees.
//!
//! A write of a regular extent goes in three steps (crate::inode::file):
//! 1. under the writer lock: allocate the extent, held (crate::space::alloc::BlockGroup::held), so a
//!    commit in the meantime leaves it free on disk;
//! 2. the writeback: write the data and compute its checksums (without the writer lock for
//!    extents longer than [`SHORT_WRITEBACK`]);
//! 3. under the writer lock: the extent becomes a *pending* ordered extent (its data and
//!    checksums written, its file extent item, checksum items, size and mtime in memory
//!    here), and the write returns.
//!
//! The completion (inserting the checksums and the file extent item, taking the extent out of
//! the held set, updating the inode) comes later: for every pending extent in one batch when
//! anything takes the writer lock to change the trees ([`crate::inode::core::Core::writer`])
//! or commits; for one file's alone when that file is read or its inode looked at
//! ([`crate::inode::core::Core::inode_item`], the gate's `read_gate_on`), and not at all for
//! a create, which touches no file with writes (so a stream of writes to one file is not
//! completed by every create beside it). Everything that looks at a file therefore sees its
//! returned writes; only the fsync log looks at pending extents directly. That is seed 003's split: an fsync waits for the writeback of its data (done
//! before the write returned) and logs pending extents from here, with their checksums,
//! without waiting for their completion (crate::tree_log::write); a transaction commit completes
//! every pending extent first, so the extents an fsync logged are in the commit, and a power
//! cut at any point loses only what was neither committed nor logged.
//!
//! Each inode being written has a range-state tree (seed 000's crate::extent_io): a write holds
//! a range lock on the sectors it covers from its read-modify-write of partial sectors until
//! it returns, so overlapping writes to one file happen one after the other, as the kernel's
//! extent range lock makes them; `ORDERED` marks ranges from allocation to completion and
//! `WRITEBACK` ranges whose data is being written.
//!
//! Delayed allocation ([`Delalloc`]): an append (of at most [`DELALLOC_APPEND_MAX`]) at the
//! sector-aligned end of a file, too big to be inline, starts a buffer in memory, `DELALLOC`
//! in the range-state tree, and the appends that follow it join the buffer without the
//! writer lock; nothing is allocated. When the buffer is full, and at the file's fsync, it
//! is written back with the writer lock held only to allocate its extent and register it as
//! a pending ordered extent still `writing`; its data goes to the device without the lock,
//! and whoever takes pending extents meanwhile waits for it. The fsync then logs it as a
//! pending extent (not completed); everything else that completes pending extents writes
//! the remaining buffers back (under the lock) and completes them too. A compressed file's
//! buffer goes back only there, under the lock, compressed in 128 KiB pieces on every CPU
//! (`Core::write_back_compressed`); its fsync commits. A buffer starts only
//! while the free data space holds all buffers plus [`DELALLOC_MARGIN`], so its allocation
//! later does not fail. A buffer whose data write fails is dropped (nothing in the trees
//! changed) and the file's next fsync fails ([`crate::Error::WriteLost`]), once.
//!
//! Pending extents are added and completed only under the writer lock, and every holder of the
//! writer lock but the fsync log completes them first: so a commit inside an operation (to
//! get space back) never finds one (the writer checks: [`crate::transaction::Writer`]'s
//! `ordered_pending`).

use crate::extent_io::{ExtentBits, SharedExtentIoTree};
use crate::format::items::Timespec;
use crate::ids::Inode;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Extents up to this size are written under the writer lock (see `Core::write_extents`;
/// `Core::set_unlocked_writeback` changes it).
pub(crate) const SHORT_WRITEBACK: u64 = 64 << 10;

/// The range-state trees of the inodes being written.
#[derive(Default)]
pub(crate) struct OrderedTrees {
    inodes: Mutex<HashMap<Inode, InodeWrites>>,
    /// Signalled when a write ends while someone waits in [`OrderedTrees::wait_for_writes`].
    write_done: Condvar,
    waiters: AtomicU64,
    next_ticket: AtomicU64,
    started: AtomicU64,
    locked_waits: AtomicU64,
    /// Pending ordered extents of all inodes, those being completed included (a quick test
    /// before the map).
    pending_total: AtomicUsize,
    deferred: AtomicU64,
    completed: AtomicU64,
    /// Delayed allocation: on (default), bytes buffered now, free data space seen when the
    /// last buffer started, buffers written back.
    delalloc_off: std::sync::atomic::AtomicBool,
    delalloc_bytes: AtomicU64,
    data_free: AtomicU64,
    delalloc_flushed: AtomicU64,
    /// Buffers handed to the write-back thread, and buffers started behind one still being
    /// written.
    delalloc_background: AtomicU64,
    delalloc_behind: AtomicU64,
    /// Inodes whose buffered appends were lost to a failed data write since their last
    /// fsync, with what failed: their next fsync reports it (EIO), as the kernel reports a
    /// writeback error.
    write_errors: Mutex<HashMap<Inode, String>>,
    /// Signalled when a buffer's write-back without the writer lock ends.
    flush_done: Condvar,
}

/// Most bytes one file gathers before its appends take the ordinary write path.
pub(crate) const DELALLOC_MAX: u64 = 4 << 20;
/// Appends longer than this take the ordinary write path (an ordered extent of their own,
/// data written without the writer lock): they make long extents anyway, and copying them
/// into a buffer costs more than it saves (1 MiB appends from 2 threads ran 1.6x slower).
pub(crate) const DELALLOC_APPEND_MAX: u64 = 256 << 10;
/// Most bytes all files gather.
pub(crate) const DELALLOC_TOTAL_MAX: u64 = 64 << 20;
/// Free data space that must remain beyond the gathered bytes (their allocation comes later
/// and must not fail).
pub(crate) const DELALLOC_MARGIN: u64 = 32 << 20;

/// A pending ordered extent: written, checksummed, not yet in the trees.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    /// File offset and length (sector aligned).
    pub file_off: u64,
    pub len: u64,
    /// The file is at least this long once the extent is in (the write's end).
    pub reach: u64,
    /// Where the data is (held in the allocator until the completion).
    pub bytenr: u64,
    /// The data checksums, one per sector.
    pub sums: Vec<u8>,
    /// When the write returned: the inode's mtime and ctime after the completion.
    pub stamp: Timespec,
    /// A buffer's write-back whose data is on its way to the device without the writer lock
    /// ([`OrderedTrees::flush_registered`]; `sums` empty until it is written): whoever takes
    /// pending extents waits until it is.
    pub writing: bool,
}

/// One inode being written: its range-state tree and the tickets of the writes holding a
/// range lock in it (for [`OrderedTrees::wait_for_writes`]).
struct InodeWrites {
    tree: Arc<SharedExtentIoTree>,
    tickets: BTreeSet<u64>,
    /// Its pending ordered extents, oldest first (completed in this order).
    pending: Vec<Pending>,
    /// Of them (and of its delayed allocation), taken out for their completion, not
    /// completed yet.
    completing: usize,
    /// Appended data not yet allocated (delayed allocation).
    delalloc: Option<Delalloc>,
    /// Buffers whose write-back failed (extent start, length, what failed): their held space
    /// goes back, and their error to the file's next fsync, under the writer lock
    /// ([`OrderedTrees::take_lost`]).
    lost: Vec<(u64, u64, String)>,
}

/// Data appended to a file and not yet allocated (delayed allocation): consecutive appends
/// gather here and go to the device as one extent when the buffer is written back (by the
/// file's fsync, as a pending ordered extent), or are completed with the pending extents.
#[derive(Debug, Clone)]
pub(crate) struct Delalloc {
    /// File offset (sector aligned: the file's size when the first append came).
    pub start: u64,
    pub data: Vec<u8>,
    /// When the last append returned.
    pub stamp: Timespec,
}

impl InodeWrites {
    fn new(tree: Arc<SharedExtentIoTree>) -> Self {
        InodeWrites {
            tree,
            tickets: BTreeSet::new(),
            pending: Vec::new(),
            completing: 0,
            delalloc: None,
            lost: Vec::new(),
        }
    }
}

/// Counters for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrderedStats {
    /// Ordered extents started.
    pub started: u64,
    /// Writes that waited for an overlapping write's range lock.
    pub locked_waits: u64,
    /// Inodes with a write in progress or a pending ordered extent now.
    pub inodes: u64,
    /// Ordered extents that became pending (their completion deferred).
    pub deferred: u64,
    /// Pending ordered extents completed.
    pub completed: u64,
    /// Pending ordered extents now.
    pub pending: u64,
    /// Delayed-allocation buffers written back.
    pub delalloc_flushed: u64,
    /// Of them, written on the write-back thread; and buffers that started behind one still
    /// on its way to the device.
    pub delalloc_background: u64,
    pub delalloc_behind: u64,
    /// Fallocates and truncates served in memory (delayed preallocation), and the
    /// completions of delayed preallocations.
    pub preallocs_in_memory: u64,
    pub preallocs_completed: u64,
}

impl OrderedTrees {
    /// Locks the bytes `[start, end)` of `ino` for a write (waiting for overlapping writes).
    pub(crate) fn lock(&self, ino: Inode, start: u64, end: u64) -> RangeGuard<'_> {
        let tree = self
            .inodes()
            .entry(ino)
            .or_insert_with(|| InodeWrites::new(Arc::new(SharedExtentIoTree::new())))
            .tree
            .clone();
        let last = end.max(start + 1) - 1;
        if !tree.try_lock_range(start, last) {
            self.locked_waits.fetch_add(1, Ordering::Relaxed);
            tree.lock_range(start, last);
        }
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        // The entry stays while we hold its tree (see the guard's drop).
        self.inodes()
            .entry(ino)
            .or_insert_with(|| InodeWrites::new(tree.clone()))
            .tickets
            .insert(ticket);
        RangeGuard {
            owner: self,
            ino,
            tree,
            start,
            last,
            ticket,
        }
    }

    fn inodes(&self) -> std::sync::MutexGuard<'_, HashMap<Inode, InodeWrites>> {
        self.inodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stats(&self) -> OrderedStats {
        OrderedStats {
            started: self.started.load(Ordering::Relaxed),
            locked_waits: self.locked_waits.load(Ordering::Relaxed),
            inodes: self.inodes().len() as u64,
            deferred: self.deferred.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            pending: self.pending_total.load(Ordering::SeqCst) as u64,
            delalloc_flushed: self.delalloc_flushed.load(Ordering::Relaxed),
            delalloc_background: self.delalloc_background.load(Ordering::Relaxed),
            delalloc_behind: self.delalloc_behind.load(Ordering::Relaxed),
            preallocs_in_memory: 0,
            preallocs_completed: 0,
        }
    }

    /// Whether appends may gather in memory (delayed allocation; on by default).
    pub(crate) fn set_delalloc(&self, on: bool) {
        self.delalloc_off.store(!on, Ordering::Relaxed);
    }

    /// Whether delayed allocation is on.
    pub(crate) fn delalloc_enabled(&self) -> bool {
        !self.delalloc_off.load(Ordering::Relaxed)
    }

    /// Appends `data` at `offset` to `ino`'s delayed-allocation buffer if it ends there (and
    /// no write to the file is in progress, and the limits allow): true when done.
    pub(crate) fn try_append(&self, ino: Inode, offset: u64, data: &[u8]) -> bool {
        let len = data.len() as u64;
        if self.delalloc_off.load(Ordering::Relaxed)
            || !self.any_pending()
            || len > DELALLOC_APPEND_MAX
        {
            return false;
        }
        let mut inodes = self.inodes();
        let Some(w) = inodes.get_mut(&ino) else {
            return false;
        };
        let Some(d) = w.delalloc.as_mut() else {
            return false;
        };
        if !w.tickets.is_empty()
            || d.start + d.data.len() as u64 != offset
            || d.data.len() as u64 + len > DELALLOC_MAX
            || !self.room_for(len)
        {
            return false;
        }
        d.data.extend_from_slice(data);
        d.stamp = crate::format::items::Timespec::now();
        w.tree
            .set_bits(offset, offset + len - 1, ExtentBits::DELALLOC);
        self.delalloc_bytes.fetch_add(len, Ordering::SeqCst);
        true
    }

    fn room_for(&self, len: u64) -> bool {
        let gathered = self.delalloc_bytes.load(Ordering::SeqCst) + len;
        gathered <= DELALLOC_TOTAL_MAX
            && gathered + DELALLOC_MARGIN <= self.data_free.load(Ordering::Relaxed)
    }

    /// Where `ino` ends once its pending extents are in, when one of them is still on its way
    /// to the device (a buffer's write-back) and they are all it has unfinished (no write in
    /// progress, no buffer, nothing being completed or lost): a new buffer may start there,
    /// behind them ([`OrderedTrees::start_buffer`]), instead of waiting for that write to
    /// complete them. Written ones alone are completed first as before: left pending, every
    /// fsync of the file would log them all again.
    pub(crate) fn appends_behind(&self, ino: Inode) -> Option<u64> {
        if !self.any_pending() {
            return None;
        }
        let inodes = self.inodes();
        let w = inodes.get(&ino)?;
        if !w.tickets.is_empty()
            || w.completing > 0
            || w.delalloc.is_some()
            || !w.lost.is_empty()
            || !w.pending.iter().any(|p| p.writing)
        {
            return None;
        }
        w.pending.iter().map(|p| p.reach).max()
    }

    /// Starts `ino`'s delayed-allocation buffer with `data` at `offset`, the file's size (the
    /// caller holds the writer lock and checked the file: `data_free` is the free data space
    /// now). False when the file has writes in progress or pending extents, or no room;
    /// `behind`: pending extents may be there, when they are all the file has unfinished and
    /// the file ends at `offset` with them ([`OrderedTrees::appends_behind`]).
    pub(crate) fn start_buffer(
        &self,
        ino: Inode,
        offset: u64,
        data: &[u8],
        data_free: u64,
        behind: bool,
    ) -> bool {
        let len = data.len() as u64;
        if self.delalloc_off.load(Ordering::Relaxed) || len > DELALLOC_MAX {
            return false;
        }
        self.data_free.store(data_free, Ordering::Relaxed);
        if !self.room_for(len) {
            return false;
        }
        let mut inodes = self.inodes();
        let w = inodes
            .entry(ino)
            .or_insert_with(|| InodeWrites::new(Arc::new(SharedExtentIoTree::new())));
        let pending_ok = w.pending.is_empty()
            || (behind
                && w.lost.is_empty()
                && w.pending.iter().map(|p| p.reach).max() == Some(offset));
        if !w.tickets.is_empty() || !pending_ok || w.completing > 0 || w.delalloc.is_some() {
            return false;
        }
        if !w.pending.is_empty() {
            self.delalloc_behind.fetch_add(1, Ordering::Relaxed);
        }
        w.delalloc = Some(Delalloc {
            start: offset,
            data: data.to_vec(),
            stamp: crate::format::items::Timespec::now(),
        });
        w.tree
            .set_bits(offset, offset + len - 1, ExtentBits::DELALLOC);
        self.delalloc_bytes.fetch_add(len, Ordering::SeqCst);
        self.pending_total.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Takes the delayed-allocation buffers out (of `ino` only, or of every file) for their
    /// write-back; each counts as being completed until [`OrderedTrees::delalloc_done`].
    pub(crate) fn take_delalloc(&self, ino: Option<Inode>) -> Vec<(Inode, Delalloc)> {
        if !self.any_pending() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut inodes = self.inodes();
        for (i, w) in inodes.iter_mut() {
            if ino.is_some_and(|x| x != *i) {
                continue;
            }
            if let Some(d) = w.delalloc.take() {
                w.completing += 1;
                out.push((*i, d));
            }
        }
        // In inode order, not the map's: what is written must not depend on hashing.
        out.sort_unstable_by_key(|(ino, _)| *ino);
        out
    }

    /// `ino`'s buffer `d` (taken by [`OrderedTrees::take_delalloc`]) is written back.
    pub(crate) fn delalloc_done(&self, ino: Inode, d: &Delalloc) {
        let len = d.data.len() as u64;
        self.delalloc_flushed.fetch_add(1, Ordering::Relaxed);
        self.delalloc_bytes.fetch_sub(len, Ordering::SeqCst);
        let mut inodes = self.inodes();
        self.pending_total.fetch_sub(1, Ordering::SeqCst);
        let Some(w) = inodes.get_mut(&ino) else {
            return;
        };
        w.completing = w.completing.saturating_sub(1);
        if len > 0 {
            w.tree
                .clear_bits(d.start, d.start + len - 1, ExtentBits::DELALLOC);
        }
        Self::forget_if_idle(&mut inodes, ino, 1);
    }

    /// `ino`'s buffered appends were lost: the data write failed (`why`).
    pub(crate) fn note_write_error(&self, ino: Inode, why: String) {
        self.write_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ino, why);
    }

    /// The write error of `ino` noted since its last fsync, if any (taken: reported once).
    pub(crate) fn take_write_error(&self, ino: Inode) -> Option<String> {
        self.write_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ino)
    }

    /// Puts a buffer taken by [`OrderedTrees::take_delalloc`] back (its write-back could not
    /// get space).
    pub(crate) fn untake_delalloc(&self, ino: Inode, d: Delalloc) {
        let mut inodes = self.inodes();
        let w = inodes
            .entry(ino)
            .or_insert_with(|| InodeWrites::new(Arc::new(SharedExtentIoTree::new())));
        w.completing = w.completing.saturating_sub(1);
        w.delalloc = Some(d);
    }

    /// Adds a pending ordered extent to `ino` outside a write (an fsync writing back its
    /// buffer); under the writer lock, whose holder counts it.
    pub(crate) fn add_pending(&self, ino: Inode, p: Pending) {
        let mut inodes = self.inodes();
        let w = inodes
            .entry(ino)
            .or_insert_with(|| InodeWrites::new(Arc::new(SharedExtentIoTree::new())));
        w.tree
            .set_bits(p.file_off, p.file_off + p.len - 1, ExtentBits::ORDERED);
        w.pending.push(p);
        self.deferred.fetch_add(1, Ordering::Relaxed);
        self.pending_total.fetch_add(1, Ordering::SeqCst);
    }

    /// Takes `ino`'s delayed-allocation buffer out for a write-back without the writer lock
    /// (under it; [`OrderedTrees::flush_registered`] or [`OrderedTrees::untake_delalloc`]
    /// follows). None if it has none, or an empty one.
    pub(crate) fn begin_flush(&self, ino: Inode) -> Option<Delalloc> {
        if !self.any_pending() {
            return None;
        }
        let mut inodes = self.inodes();
        let w = inodes.get_mut(&ino)?;
        if w.delalloc.as_ref().is_none_or(|d| d.data.is_empty()) {
            return None;
        }
        w.completing += 1;
        w.delalloc.take()
    }

    /// The buffer `d` taken by [`OrderedTrees::begin_flush`] has its extent at `bytenr`
    /// (`len` bytes, held): it becomes a pending ordered extent whose data is still to be
    /// written (`writing`), under the writer lock, whose holder counts it. The caller writes
    /// the data, then calls [`OrderedTrees::flush_written`].
    pub(crate) fn flush_registered(&self, ino: Inode, d: &Delalloc, bytenr: u64, len: u64) {
        let dlen = d.data.len() as u64;
        self.delalloc_flushed.fetch_add(1, Ordering::Relaxed);
        self.delalloc_bytes.fetch_sub(dlen, Ordering::SeqCst);
        self.deferred.fetch_add(1, Ordering::Relaxed);
        let mut inodes = self.inodes();
        let w = inodes
            .entry(ino)
            .or_insert_with(|| InodeWrites::new(Arc::new(SharedExtentIoTree::new())));
        w.completing = w.completing.saturating_sub(1);
        w.tree
            .clear_bits(d.start, d.start + dlen - 1, ExtentBits::DELALLOC);
        w.tree.set_bits(
            d.start,
            d.start + len - 1,
            ExtentBits::ORDERED | ExtentBits::WRITEBACK,
        );
        // (pending_total counted the buffer; it counts the pending extent now.)
        w.pending.push(Pending {
            file_off: d.start,
            len,
            reach: d.start + dlen,
            bytenr,
            sums: Vec::new(),
            stamp: d.stamp,
            writing: true,
        });
    }

    /// The data of the pending extent at `bytenr` of `ino` is written (`Ok(checksums)`) or
    /// failed (`Err(what)`: the extent is dropped, its appends lost; see
    /// [`OrderedTrees::take_lost`]).
    pub(crate) fn flush_written(
        &self,
        ino: Inode,
        bytenr: u64,
        r: std::result::Result<Vec<u8>, String>,
    ) {
        let mut inodes = self.inodes();
        if let Some(w) = inodes.get_mut(&ino) {
            if let Some(i) = w
                .pending
                .iter()
                .position(|p| p.bytenr == bytenr && p.writing)
            {
                let (start, len) = (w.pending[i].file_off, w.pending[i].len);
                w.tree
                    .clear_bits(start, start + len - 1, ExtentBits::WRITEBACK);
                match r {
                    Ok(sums) => {
                        w.pending[i].sums = sums;
                        w.pending[i].writing = false;
                    }
                    Err(why) => {
                        w.pending.remove(i);
                        w.tree
                            .clear_bits(start, start + len - 1, ExtentBits::ORDERED);
                        w.lost.push((bytenr, len, why));
                    }
                }
            }
        }
        drop(inodes);
        self.flush_done.notify_all();
    }

    /// Buffers whose write-back failed (inode, extent start, length, what failed), taken (under
    /// the writer lock, whose holder gives their held space back).
    pub(crate) fn take_lost(&self) -> Vec<(Inode, u64, u64, String)> {
        if !self.any_pending() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut inodes = self.inodes();
        let inos: Vec<Inode> = inodes
            .iter()
            .filter(|(_, w)| !w.lost.is_empty())
            .map(|(i, _)| *i)
            .collect();
        for ino in inos {
            if let Some(w) = inodes.get_mut(&ino) {
                for (b, l, why) in std::mem::take(&mut w.lost) {
                    self.pending_total.fetch_sub(1, Ordering::SeqCst);
                    out.push((ino, b, l, why));
                }
            }
            Self::forget_if_idle(&mut inodes, ino, 1);
        }
        out
    }

    /// Whether `ino` has a delayed-allocation buffer.
    pub(crate) fn has_delalloc(&self, ino: Inode) -> bool {
        self.any_pending()
            && self
                .inodes()
                .get(&ino)
                .is_some_and(|w| w.delalloc.is_some())
    }

    /// Forgets `ino`'s tree when nothing is left in it and `refs` references to it remain
    /// (the map's, and the caller's if it holds one).
    fn forget_if_idle(inodes: &mut HashMap<Inode, InodeWrites>, ino: Inode, refs: usize) {
        if let Some(w) = inodes.get(&ino) {
            if w.tickets.is_empty()
                && w.pending.is_empty()
                && w.completing == 0
                && w.delalloc.is_none()
                && w.lost.is_empty()
                && Arc::strong_count(&w.tree) == refs
                && w.tree.with(|t| t.is_empty())
            {
                inodes.remove(&ino);
            }
        }
    }

    /// Whether any inode has a pending ordered extent.
    pub(crate) fn any_pending(&self) -> bool {
        self.pending_total.load(Ordering::SeqCst) > 0
    }

    /// Whether `ino` has a pending ordered extent or delayed-allocation buffer (or one being
    /// completed: its reader must wait for the writer lock too).
    pub(crate) fn has_pending(&self, ino: Inode) -> bool {
        self.any_pending()
            && self.inodes().get(&ino).is_some_and(|w| {
                !w.pending.is_empty()
                    || w.completing > 0
                    || w.delalloc.is_some()
                    || !w.lost.is_empty()
            })
    }

    /// The pending ordered extents of `ino`, oldest first (for the fsync log).
    /// (A write-back on its way to the device is waited for.)
    pub(crate) fn pending_of(&self, ino: Inode) -> Vec<Pending> {
        if !self.any_pending() {
            return Vec::new();
        }
        let inodes = self.wait_flushes(self.inodes(), Some(ino));
        inodes
            .get(&ino)
            .map(|w| w.pending.clone())
            .unwrap_or_default()
    }

    /// Waits (the map's lock given up meanwhile) until no pending extent of `ino`, or of any
    /// inode, is still being written by [`OrderedTrees::flush_registered`]'s caller. Called
    /// under the writer lock, which those writers do not need to finish.
    fn wait_flushes<'a>(
        &'a self,
        mut inodes: std::sync::MutexGuard<'a, HashMap<Inode, InodeWrites>>,
        ino: Option<Inode>,
    ) -> std::sync::MutexGuard<'a, HashMap<Inode, InodeWrites>> {
        let busy = |m: &HashMap<Inode, InodeWrites>| {
            m.iter()
                .any(|(i, w)| ino.is_none_or(|x| x == *i) && w.pending.iter().any(|p| p.writing))
        };
        while busy(&inodes) {
            inodes = self
                .flush_done
                .wait(inodes)
                .unwrap_or_else(|e| e.into_inner());
        }
        inodes
    }

    /// Takes every pending ordered extent out, for their completion (under the writer lock).
    /// Their ranges keep `ORDERED` until [`OrderedTrees::completed`].
    /// With `only`, those of that inode alone.
    pub(crate) fn take_pending(&self, only: Option<Inode>) -> Vec<(Inode, Vec<Pending>)> {
        if !self.any_pending() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut inodes = self.wait_flushes(self.inodes(), only);
        for (ino, w) in inodes.iter_mut() {
            if only.is_none_or(|x| x == *ino) && !w.pending.is_empty() {
                let list = std::mem::take(&mut w.pending);
                w.completing += list.len();
                out.push((*ino, list));
            }
        }
        // In inode order, not the map's: what is written must not depend on hashing.
        out.sort_unstable_by_key(|(ino, _)| *ino);
        out
    }

    /// The ordered extents `done` of `ino` (taken by [`OrderedTrees::take_pending`]) are in the
    /// trees, or abandoned: their ranges lose `ORDERED`, and the inode's tree is forgotten when
    /// nothing is left in it.
    pub(crate) fn completed(&self, ino: Inode, done: &[Pending]) {
        self.completed
            .fetch_add(done.len() as u64, Ordering::Relaxed);
        let mut inodes = self.inodes();
        self.pending_total.fetch_sub(done.len(), Ordering::SeqCst);
        let Some(w) = inodes.get_mut(&ino) else {
            return;
        };
        w.completing = w.completing.saturating_sub(done.len());
        for p in done {
            w.tree
                .clear_bits(p.file_off, p.file_off + p.len - 1, ExtentBits::ORDERED);
        }
        Self::forget_if_idle(&mut inodes, ino, 1);
    }

    /// Waits until the writes to `ino` that hold their range lock now have finished (writes
    /// that start meanwhile are not waited for).
    pub(crate) fn wait_for_writes(&self, ino: Inode) {
        let upto = self.next_ticket.load(Ordering::Relaxed);
        let mut inodes = self.inodes();
        self.waiters.fetch_add(1, Ordering::SeqCst);
        while inodes
            .get(&ino)
            .and_then(|w| w.tickets.first())
            .is_some_and(|t| *t < upto)
        {
            inodes = self
                .write_done
                .wait(inodes)
                .unwrap_or_else(|e| e.into_inner());
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    #[cfg(test)]
    /// Whether any byte of `[start, end)` of `ino` has `bits` now.
    pub(crate) fn test(&self, ino: Inode, start: u64, end: u64, bits: ExtentBits) -> bool {
        let tree = self.inodes().get(&ino).map(|w| w.tree.clone());
        tree.is_some_and(|t| t.test_bits(start, end.max(start + 1) - 1, bits, false))
    }
}

/// A write's range lock; unlocks (and forgets the inode's tree once nothing is left in it) on
/// drop.
pub(crate) struct RangeGuard<'a> {
    owner: &'a OrderedTrees,
    ino: Inode,
    tree: Arc<SharedExtentIoTree>,
    start: u64,
    last: u64,
    ticket: u64,
}

impl RangeGuard<'_> {
    /// An ordered extent over `[start, end)` (inside the locked range) begins: allocated, its
    /// data about to be written.
    pub(crate) fn start_ordered(&self, start: u64, end: u64) {
        self.owner.started.fetch_add(1, Ordering::Relaxed);
        self.tree
            .set_bits(start, end - 1, ExtentBits::ORDERED | ExtentBits::WRITEBACK);
    }

    /// Its data is written (or failed to be).
    pub(crate) fn writeback_done(&self, start: u64, end: u64) {
        self.tree.clear_bits(start, end - 1, ExtentBits::WRITEBACK);
    }

    /// Completed: in the trees, or abandoned after an error.
    pub(crate) fn finish_ordered(&self, start: u64, end: u64) {
        self.tree
            .clear_bits(start, end - 1, ExtentBits::ORDERED | ExtentBits::WRITEBACK);
    }

    /// Written: the extent waits for its completion as `p` (the range keeps `ORDERED`). Only
    /// under the writer lock, whose holder counts it (`Writer::ordered_pending`).
    pub(crate) fn defer(&self, p: Pending) {
        self.writeback_done(p.file_off, p.file_off + p.len);
        self.owner.deferred.fetch_add(1, Ordering::Relaxed);
        let mut inodes = self.owner.inodes();
        // The entry exists while this guard holds its tree.
        let w = inodes
            .entry(self.ino)
            .or_insert_with(|| InodeWrites::new(self.tree.clone()));
        w.pending.push(p);
        self.owner.pending_total.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        // (`ORDERED` stays on the extents that wait for their completion.)
        self.tree
            .clear_bits(self.start, self.last, ExtentBits::WRITEBACK);
        self.tree.unlock_range(self.start, self.last);
        let mut inodes = self.owner.inodes();
        if let Some(w) = inodes.get_mut(&self.ino) {
            w.tickets.remove(&self.ticket);
            // Forgotten once no other write holds or waits for its tree: two references
            // then, the map's and ours.
            OrderedTrees::forget_if_idle(&mut inodes, self.ino, 2);
        }
        if self.owner.waiters.load(Ordering::SeqCst) > 0 {
            self.owner.write_done.notify_all();
        }
    }
}

/// The data checksums of `data` on `disk`, one per sector.
pub(crate) fn sector_sums(disk: &crate::io::disk_io::Disk, data: &[u8]) -> Vec<u8> {
    let ss = disk.sectorsize() as usize;
    let ct = disk.sb.csum_type;
    let mut sums = Vec::with_capacity(data.len() / ss * ct.size());
    for s in data.chunks(ss) {
        sums.extend_from_slice(&ct.compute(s)[..ct.size()]);
    }
    sums
}

/// A delayed-allocation buffer's data write, once its extent is registered as pending and
/// `writing` ([`crate::inode::ordered::OrderedTrees::flush_registered`]).
pub(crate) struct BufferWrite {
    pub(crate) ino: Inode,
    pub(crate) start: u64,
    pub(crate) bytenr: u64,
    /// The extent's length (the data padded to whole sectors).
    pub(crate) len: u64,
    pub(crate) data: Vec<u8>,
}

impl BufferWrite {
    /// Writes the data and its checksums; the pending extent is then complete-able, or (the
    /// write failed: true) dropped, its appends lost and the file's next fsync failing.
    pub(crate) fn run(self, disk: &crate::io::disk_io::Disk, ordered: &OrderedTrees) -> bool {
        // Should this thread unwind before the data is written, the waiters still get an end.
        struct Unfinished<'a>(&'a OrderedTrees, Inode, u64);
        impl Drop for Unfinished<'_> {
            fn drop(&mut self) {
                self.0
                    .flush_written(self.1, self.2, Err("the write-back was interrupted".into()));
            }
        }
        let BufferWrite {
            ino,
            start,
            bytenr,
            len,
            mut data,
        } = self;
        let unfinished = Unfinished(ordered, ino, bytenr);
        data.resize(len as usize, 0);
        let r = disk
            .write_logical(bytenr, &data)
            .map(|()| sector_sums(disk, &data));
        let r = r.map_err(|e| {
            let why = format!(
                "writing back {} bytes appended at {start} to inode {} (subvolume {}): {e}",
                data.len(),
                ino.ino,
                ino.root
            );
            log::error!("{why}; the appends are lost, the file's next fsync fails");
            why
        });
        let failed = r.is_err();
        std::mem::forget(unfinished);
        ordered.flush_written(ino, bytenr, r);
        failed
    }
}

/// Full buffers that may wait for the write-back thread (besides the one it writes).
const WRITEBACK_QUEUE: usize = 2;

/// The write-back thread (`butter-writeback`, started at the first use): writes full
/// delayed-allocation buffers while the writer that filled one goes on with the next.
/// [`WRITEBACK_QUEUE`] buffers wait for it at most: past that, the writer writes its own (no
/// unbounded memory).
/// A failed write is settled by the next completion (`Core::release_lost`) and the file's
/// next fsync.
#[derive(Default)]
pub(crate) struct Writeback {
    tx: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<BufferWrite>>>,
}

impl Writeback {
    /// Hands `job` to the thread (started now if it is not yet), or gives it back when as
    /// many as may wait already do.
    pub(crate) fn send(
        &self,
        disk: &Arc<crate::io::disk_io::Disk>,
        ordered: &Arc<OrderedTrees>,
        job: BufferWrite,
    ) -> std::result::Result<(), BufferWrite> {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (t, rx) = std::sync::mpsc::sync_channel::<BufferWrite>(WRITEBACK_QUEUE);
            let (disk, ordered) = (disk.clone(), ordered.clone());
            let spawned = std::thread::Builder::new()
                .name("butter-writeback".into())
                .spawn(move || {
                    for job in rx {
                        // A panic ends the job (its waiters get an error), not the thread.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            job.run(&disk, &ordered)
                        }));
                    }
                });
            if spawned.is_err() {
                return Err(job);
            }
            *tx = Some(t);
        }
        let Some(t) = tx.as_ref() else {
            return Err(job);
        };
        t.try_send(job)
            .map(|()| {
                ordered.delalloc_background.fetch_add(1, Ordering::Relaxed);
            })
            .map_err(|e| match e {
                std::sync::mpsc::TrySendError::Full(j)
                | std::sync::mpsc::TrySendError::Disconnected(j) => j,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::Fs;
    use crate::inode::namespace::Owner;
    use crate::internals::RamDevice;
    use crate::io::device::BlockDevice;
    use std::sync::mpsc;
    use std::time::Duration;

    const MARK: &[u8; 16] = b"ORDERED-EXTENT!!";

    /// A RAM device that stops a write starting with [`MARK`] until the test lets it go.
    struct GateDevice {
        ram: Arc<RamDevice>,
        arrived: Mutex<Option<mpsc::Sender<()>>>,
        release: Mutex<Option<mpsc::Receiver<()>>>,
    }

    impl BlockDevice for GateDevice {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.ram.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            if buf.starts_with(MARK) {
                if let Some(tx) = self.arrived.lock().unwrap().take() {
                    tx.send(()).unwrap();
                    let rx = self.release.lock().unwrap().take().unwrap();
                    rx.recv_timeout(Duration::from_secs(60)).unwrap();
                }
            }
            self.ram.write_at(buf, offset)
        }
        fn flush(&self) -> std::io::Result<()> {
            self.ram.flush()
        }
        fn len(&self) -> u64 {
            self.ram.len()
        }
    }

    fn in_root(fs: &Fs, name: &[u8]) -> crate::fs::Inode {
        fs.lookup(fs.root_inode(), name).unwrap().unwrap().target
    }

    /// The image a power cut now leaves, opened (and replayed if it has a log), checked.
    fn checked_copy(bytes: Vec<u8>) -> Fs {
        let copy = Arc::new(RamDevice::new(bytes));
        // The first open replays a log and commits.
        drop(Fs::open_device_rw(copy.clone()).unwrap());
        let fs = Fs::open_device_rw(copy).unwrap();
        let r = fs.check(Default::default(), &mut |_| {}).unwrap();
        assert!(r.is_clean(), "{r:?}");
        fs
    }

    /// While one write's data is on its way to the device, other files are written and a
    /// commit runs: the writer lock is free during the writeback, and the commit leaves the
    /// extent in flight free on disk (the committed image checks clean and has no trace of
    /// the write). Once the data is written, the write completes and survives the next commit.
    #[test]
    fn writeback_runs_without_the_writer_lock_and_commits_skip_it() {
        let (ram, fs, arrived, release) = gated();
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        fs.commit().unwrap();
        let mut data = vec![0x5a; 300_000];
        data[..MARK.len()].copy_from_slice(MARK);
        let writer = {
            let (fs, data) = (fs.clone(), data.clone());
            std::thread::spawn(move || fs.write(a, 0, &data).unwrap())
        };
        arrived.recv_timeout(Duration::from_secs(60)).unwrap();
        // The write is in its writeback.
        assert!(fs.core().ordered.test(a, 0, 300_000, ExtentBits::WRITEBACK));
        assert!(fs.core().ordered.test(a, 0, 300_000, ExtentBits::ORDERED));
        let b = fs.create(root, b"b", 0o644, Owner::default()).unwrap();
        fs.write(b, 0, &[7u8; 100_000]).unwrap();
        fs.commit().unwrap();
        let mid = checked_copy(ram.durable_bytes());
        let a_mid = in_root(&mid, b"a");
        assert_eq!(mid.inode_item(a_mid).unwrap().size, 0);
        let b_mid = in_root(&mid, b"b");
        assert_eq!(mid.read(b_mid, 0, 200_000).unwrap(), vec![7u8; 100_000]);
        drop(mid);

        release.send(()).unwrap();
        assert_eq!(writer.join().unwrap(), 300_000);
        // Returned: written, pending, not in the trees yet; the first read completes it.
        assert!(fs.core().ordered.test(a, 0, 300_000, ExtentBits::ORDERED));
        assert!(!fs.core().ordered.test(a, 0, 300_000, ExtentBits::WRITEBACK));
        assert_eq!(fs.core().ordered.stats().pending, 1);
        assert_eq!(fs.core().inode_item_raw(a).unwrap().size, 0);
        assert_eq!(fs.read(a, 0, 400_000).unwrap(), data);
        assert!(!fs.core().ordered.test(a, 0, 300_000, ExtentBits::ORDERED));
        assert_eq!(fs.core().ordered.stats().inodes, 0);
        assert_eq!(
            fs.core().ordered.stats().completed,
            fs.core().ordered.stats().deferred
        );
        fs.commit().unwrap();
        let after = checked_copy(ram.durable_bytes());
        let a2 = in_root(&after, b"a");
        assert_eq!(after.read(a2, 0, 400_000).unwrap(), data);
    }

    fn gated() -> (
        Arc<RamDevice>,
        Arc<Fs>,
        mpsc::Receiver<()>,
        mpsc::Sender<()>,
    ) {
        let (ram, fs) = crate::mkfs::test_fs(128 << 20);
        drop(fs);
        let (arrived_tx, arrived) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let dev = Arc::new(GateDevice {
            ram: ram.clone(),
            arrived: Mutex::new(Some(arrived_tx)),
            release: Mutex::new(Some(release_rx)),
        });
        let fs = Arc::new(Fs::open_device_rw(dev).unwrap());
        // The gate stops a write in its own writeback: no write may wait in a buffer.
        fs.core().ordered.set_delalloc(false);
        (ram, fs, arrived, release)
    }

    /// Passes `f` on a thread of its own; whether it finished within `ms` milliseconds.
    fn passes_within(
        ms: u64,
        f: impl FnOnce() + Send + 'static,
    ) -> (bool, std::thread::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel();
        let h = std::thread::spawn(move || {
            f();
            let _ = tx.send(());
        });
        (rx.recv_timeout(Duration::from_millis(ms)).is_ok(), h)
    }

    /// The gate covers tree edits, not data I/O (crate::gate): while a write that passed the
    /// write gate has its data on the way to the device, other files are read and created,
    /// and a change of the same file's data waits for the write. A write under the ordinary
    /// change gate keeps everyone out, as every change did before.
    #[test]
    fn a_write_through_the_write_gate_lets_others_pass_during_its_data_io() {
        for write_gate in [true, false] {
            let (ram, fs, arrived, release) = gated();
            let root = fs.root_inode();
            let me = Owner::default();
            let (a, b) = {
                let _g = fs.change_gate().unwrap();
                let a = fs.create(root, b"a", 0o644, me).unwrap();
                let b = fs.create(root, b"b", 0o644, me).unwrap();
                fs.write(b, 0, &[3u8; 8192]).unwrap();
                (a, b)
            };
            fs.gated_commit().unwrap();
            let mut data = vec![0x5a; 300_000];
            data[..MARK.len()].copy_from_slice(MARK);
            let writer = {
                let (fs, data) = (fs.clone(), data.clone());
                std::thread::spawn(move || {
                    let _g = if write_gate {
                        fs.write_gate(a).unwrap()
                    } else {
                        fs.change_gate_on(a).unwrap()
                    };
                    fs.write(a, 0, &data).unwrap()
                })
            };
            arrived.recv_timeout(Duration::from_secs(60)).unwrap();
            let fs2 = fs.clone();
            let (read, r) = passes_within(300, move || {
                let _r = fs2.read_gate();
                assert_eq!(fs2.read(b, 0, 10_000).unwrap(), vec![3u8; 8192]);
            });
            let fs2 = fs.clone();
            let (created, c) = passes_within(300, move || {
                let _g = fs2.change_gate().unwrap();
                fs2.create(fs2.root_inode(), b"c", 0o644, Owner::default())
                    .unwrap();
            });
            let fs2 = fs.clone();
            let (truncated, t) = passes_within(300, move || {
                let _g = fs2.change_gate_on(a).unwrap();
                fs2.truncate(a, 4096).unwrap();
            });
            assert_eq!(
                (read, created),
                (write_gate, write_gate),
                "write gate: {write_gate}"
            );
            assert!(!truncated, "a change of the file's data passed its write");
            release.send(()).unwrap();
            assert_eq!(writer.join().unwrap(), 300_000);
            for h in [r, c, t] {
                h.join().unwrap();
            }
            {
                let _r = fs.read_gate();
                assert_eq!(fs.read(a, 0, 400_000).unwrap(), data[..4096]);
                assert!(fs.lookup(root, b"c").unwrap().is_some());
            }
            fs.gated_commit().unwrap();
            drop(checked_copy(ram.durable_bytes()));
        }
    }

    /// Changes stop (the latch) while a write is out of the gate for its data: when it comes
    /// back it records nothing, fails with `Aborted`, and its extent goes back; the image
    /// keeps its last commit, clean and without the write.
    #[test]
    fn a_write_out_of_the_gate_stops_when_changes_stopped_meanwhile() {
        let (ram, fs, arrived, release) = gated();
        let root = fs.root_inode();
        let a = {
            let _g = fs.change_gate().unwrap();
            let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
            fs.write(a, 0, &[1u8; 8192]).unwrap();
            a
        };
        fs.gated_commit().unwrap();
        let mut data = vec![0x5a; 300_000];
        data[..MARK.len()].copy_from_slice(MARK);
        let writer = {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let _g = fs.write_gate(a).unwrap();
                fs.write(a, 0, &data)
            })
        };
        arrived.recv_timeout(Duration::from_secs(60)).unwrap();
        fs.core().stop("a change elsewhere failed half way".into());
        release.send(()).unwrap();
        let r = writer.join().unwrap();
        assert!(matches!(r, Err(crate::error::Error::Aborted(_))), "{r:?}");
        assert_eq!(fs.core().ordered.stats().pending, 0);
        assert!(matches!(
            fs.gated_commit(),
            Err(crate::error::Error::Aborted(_))
        ));
        let after = checked_copy(ram.durable_bytes());
        let a2 = in_root(&after, b"a");
        assert_eq!(after.read(a2, 0, 400_000).unwrap(), vec![1u8; 8192]);
    }

    /// The fsync rule that skips writes in progress: an fsync does not wait for a write to the
    /// same file that is still in progress; without the rule it waits for that write to finish.
    #[test]
    fn fsync_waits_for_writes_in_progress_only_without_the_rule() {
        for rule in [true, false] {
            let (ram, fs, arrived, release) = gated();
            fs.core().set_fsync_skips_writes_in_progress(rule);
            let root = fs.root_inode();
            let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
            fs.write(a, 1 << 20, b"before").unwrap();
            let mut data = vec![1u8; 200_000];
            data[..MARK.len()].copy_from_slice(MARK);
            let writer = {
                let fs = fs.clone();
                std::thread::spawn(move || fs.write(a, 0, &data).unwrap())
            };
            arrived.recv_timeout(Duration::from_secs(60)).unwrap();
            let (done_tx, done) = mpsc::channel();
            let syncer = {
                let fs = fs.clone();
                std::thread::spawn(move || {
                    fs.fsync(a, false).unwrap();
                    done_tx.send(()).unwrap();
                })
            };
            let early = done.recv_timeout(Duration::from_millis(300)).is_ok();
            assert_eq!(early, rule, "fsync returned during the write: {early}");
            release.send(()).unwrap();
            writer.join().unwrap();
            syncer.join().unwrap();
            // What the fsync covered survives a power cut now.
            let after = checked_copy(ram.durable_bytes());
            let a2 = in_root(&after, b"a");
            assert_eq!(after.read(a2, 1 << 20, 10).unwrap(), b"before");
            if !rule {
                assert_eq!(after.read(a2, 0, 16).unwrap(), MARK.to_vec());
            }
        }
    }

    /// Fast fsync: an fsync logs the file's pending ordered extents as they are, with their
    /// checksums and the size and times their completion will give the inode, without
    /// completing them; a power cut then leaves an image whose replay has every write. A
    /// commit completes them first. Writes: a new extent over the middle of a committed one
    /// (which the log must cut in two) and one past EOF (the file grows, a hole between).
    #[test]
    fn fsync_logs_pending_extents_and_commit_completes_them() {
        let (ram, fs) = crate::mkfs::test_fs(128 << 20);
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        let base: Vec<u8> = (0..400_000u32).map(|i| (i % 251) as u8).collect();
        fs.write(a, 0, &base).unwrap();
        fs.commit().unwrap();
        let mut want = base.clone();
        // Each step leaves one pending extent (the next write's writer lock completes it).
        let tail = vec![0x77u8; 70_000];
        let mid = vec![0xabu8; 100_000];
        for (off, data) in [(600_000usize, &tail), (150_000, &mid)] {
            fs.write(a, off as u64, data).unwrap();
            if want.len() < off + data.len() {
                want.resize(off + data.len(), 0);
            }
            want[off..off + data.len()].copy_from_slice(data);
            let st = fs.core().ordered.stats();
            assert_eq!(st.pending, 1, "{st:?}");
            let logged = fs.core().log_stats().unwrap().logged;
            fs.fsync(a, false).unwrap();
            // Logged from memory: still pending.
            assert_eq!(fs.core().ordered.stats().pending, 1);
            let ls = fs.core().log_stats().unwrap();
            assert_eq!((ls.logged, ls.ordered_logged), (logged + 1, logged + 1));
            // The growth of the pending extent past EOF is not in the tree yet.
            let in_tree = fs.core().inode_item_raw(a).unwrap().size;
            assert_eq!(in_tree == 670_000, off != 600_000, "{in_tree}");
            let cut = ram.durable_bytes();
            let live = fs.inode_item(a).unwrap();
            assert_eq!(fs.core().ordered.stats().pending, 0);
            assert_eq!(live.size, 670_000);
            assert_eq!(fs.read(a, 0, 1 << 20).unwrap(), want);
            // The power cut: replay gives every write, the inode as the live one.
            let after = checked_copy(cut);
            let a2 = in_root(&after, b"a");
            assert_eq!(after.read(a2, 0, 1 << 20).unwrap(), want);
            let got = after.inode_item(a2).unwrap();
            assert_eq!((got.size, got.nbytes), (live.size, live.nbytes));
            assert_eq!(got.mtime, live.mtime);
        }
        // A commit with pending extents completes them; the committed image has no log.
        fs.write(a, 0, &[1u8; 80_000]).unwrap();
        want[..80_000].copy_from_slice(&[1u8; 80_000]);
        assert_eq!(fs.core().ordered.stats().pending, 1);
        fs.commit().unwrap();
        assert_eq!(fs.core().ordered.stats().pending, 0);
        let bytes = ram.durable_bytes();
        let sb =
            crate::format::superblock::Superblock::parse(&bytes[0x10000..0x10000 + 4096], 0x10000)
                .unwrap();
        assert_eq!(sb.log_root, 0);
        let after = checked_copy(bytes);
        let a3 = in_root(&after, b"a");
        assert_eq!(after.read(a3, 0, 1 << 20).unwrap(), want);
    }

    /// The file's EXTENT_DATA items as the trees have them now.
    fn extent_items(fs: &Fs, ino: crate::fs::Inode) -> usize {
        let mut it = fs.core().extent_items_from(ino, 0).unwrap();
        let mut n = 0;
        while let Some(i) = it.next_item().unwrap() {
            if i.key.objectid != ino.ino || i.key.ty != crate::format::EXTENT_DATA_KEY {
                break;
            }
            n += 1;
        }
        n
    }

    /// Delayed allocation: appends gather in memory; the file's fsync writes them back as one
    /// extent, logged as a pending ordered extent (not completed); a read or a commit writes
    /// a buffer back and completes it. Replay after a power cut right after the fsync has
    /// every append; the committed image has every append too.
    #[test]
    fn appends_gather_until_fsync_writes_them_back_as_one_extent() {
        let (ram, fs) = crate::mkfs::test_fs(256 << 20);
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        let mut want: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
        fs.write(a, 0, &want).unwrap();
        fs.commit().unwrap();
        // (The first write was a buffer too, written back by the commit.)
        let flushed = fs.core().ordered.stats().delalloc_flushed;
        for i in 0..16u8 {
            let chunk = vec![i + 1; 65536];
            fs.write(a, want.len() as u64, &chunk).unwrap();
            want.extend_from_slice(&chunk);
        }
        // Nothing allocated yet: the tree still has the first 8 KiB only.
        assert_eq!(extent_items(&fs, a), 1);
        assert_eq!(fs.core().inode_item_raw(a).unwrap().size, 8192);
        assert!(fs
            .core()
            .ordered
            .test(a, 8192, 8192 + 65536, ExtentBits::DELALLOC));
        fs.fsync(a, false).unwrap();
        let ls = fs.core().log_stats().unwrap();
        assert_eq!((ls.logged, ls.ordered_logged), (1, 1));
        let st = fs.core().ordered.stats();
        assert_eq!(
            (st.delalloc_flushed - flushed, st.pending),
            (1, 1),
            "{st:?}"
        );
        assert!(!fs
            .core()
            .ordered
            .test(a, 8192, 8192 + 65536, ExtentBits::DELALLOC));
        let cut = ram.durable_bytes();
        let after = checked_copy(cut);
        let a2 = in_root(&after, b"a");
        assert_eq!(after.read(a2, 0, 2 << 20).unwrap(), want);
        assert_eq!(extent_items(&after, a2), 2);
        drop(after);
        // A read writes back and completes; appends after it start a new buffer.
        assert_eq!(fs.read(a, 0, 2 << 20).unwrap(), want);
        assert_eq!(extent_items(&fs, a), 2);
        for i in 0..4u8 {
            let chunk = vec![0xf0 | i; 100_000];
            fs.write(a, want.len() as u64, &chunk).unwrap();
            want.extend_from_slice(&chunk);
        }
        // Unaligned end: the second buffer starts only at a sector boundary, so these went
        // through the ordinary path but for the first.
        assert_eq!(fs.inode_item(a).unwrap().size, want.len() as u64);
        fs.commit().unwrap();
        assert_eq!(fs.core().ordered.stats().pending, 0);
        let after = checked_copy(ram.durable_bytes());
        let a3 = in_root(&after, b"a");
        assert_eq!(after.read(a3, 0, 4 << 20).unwrap(), want);
    }

    /// A buffer's write-back (here the fsync's) holds the writer lock only to allocate: while
    /// its data is on its way to the device, another file is appended to and fsynced (the
    /// fsync log takes the writer lock). Then both fsyncs' data survives a power cut.
    #[test]
    fn a_buffer_is_written_back_without_the_writer_lock() {
        let (ram, fs, arrived, release) = gated();
        fs.core().ordered.set_delalloc(true);
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        let b = fs.create(root, b"b", 0o644, Owner::default()).unwrap();
        fs.commit().unwrap();
        let mut first = vec![0x11; 65536];
        first[..MARK.len()].copy_from_slice(MARK);
        fs.write(a, 0, &first).unwrap();
        fs.write(a, 65536, &[0x22; 65536]).unwrap();
        assert!(fs.core().ordered.test(a, 0, 131072, ExtentBits::DELALLOC));
        let fsync_a = {
            let fs = fs.clone();
            std::thread::spawn(move || fs.core().fsync(a, false).unwrap())
        };
        arrived.recv_timeout(Duration::from_secs(60)).unwrap();
        // a's buffer is a pending extent whose data is being written.
        assert!(fs.core().ordered.test(a, 0, 131072, ExtentBits::WRITEBACK));
        assert!(!fs.core().ordered.test(a, 0, 131072, ExtentBits::DELALLOC));
        let (done_tx, done) = mpsc::channel();
        let fsync_b = {
            let fs = fs.clone();
            // The inode layer's calls, outside the gate: this is about the writer lock
            // (under the gate, a's fsync holds a read's passage while its buffer is written).
            std::thread::spawn(move || {
                fs.core().write(b, 0, &[0x33; 65536]).unwrap();
                fs.core().fsync(b, false).unwrap();
                done_tx.send(()).unwrap();
            })
        };
        let b_finished = done.recv_timeout(Duration::from_secs(20)).is_ok();
        release.send(()).unwrap();
        assert!(b_finished, "b's append and fsync waited for a's write-back");
        fsync_a.join().unwrap();
        fsync_b.join().unwrap();
        let after = checked_copy(ram.durable_bytes());
        let mut want = first.clone();
        want.extend_from_slice(&[0x22; 65536]);
        assert_eq!(after.read(in_root(&after, b"a"), 0, 1 << 20).unwrap(), want);
        assert_eq!(
            after.read(in_root(&after, b"b"), 0, 1 << 20).unwrap(),
            vec![0x33; 65536]
        );
    }

    /// A file written from its start in 128 KiB appends (as `cp` through FUSE writes it)
    /// goes to the device in buffers of the largest size: 10 MiB make three extents.
    #[test]
    fn a_full_buffer_is_written_back_and_the_next_append_starts_another() {
        let (ram, fs) = crate::mkfs::test_fs(256 << 20);
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        let want: Vec<u8> = (0..10u32 << 20).map(|i| (i % 251) as u8).collect();
        for (i, c) in want.chunks(128 << 10).enumerate() {
            fs.write(a, (i as u64) << 17, c).unwrap();
        }
        fs.commit().unwrap();
        assert_eq!(fs.core().ordered.stats().delalloc_flushed, 3);
        assert_eq!(extent_items(&fs, a), 3);
        let after = checked_copy(ram.durable_bytes());
        let a2 = in_root(&after, b"a");
        assert_eq!(after.read(a2, 0, 11 << 20).unwrap(), want);
    }

    /// A full buffer goes to the device on the write-back thread, and the append that found
    /// it full starts the next buffer behind it without waiting: a stream of 16 KiB appends
    /// completes nothing until something needs the trees (a read, a commit), then reads and
    /// commits every byte, one extent per buffer.
    #[test]
    fn the_next_buffer_starts_behind_one_being_written() {
        let (ram, fs) = crate::mkfs::test_fs(256 << 20);
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        fs.commit().unwrap();
        // Each buffer's write takes long enough that the next appends come while it is on
        // its way.
        ram.set_faults(crate::io::ram::Faults {
            slow_writes: Some((1 << 20, std::time::Duration::from_millis(300))),
            ..Default::default()
        });
        let want: Vec<u8> = (0..(10u32 << 20) + 12288)
            .map(|i| (i % 253) as u8)
            .collect();
        for (i, c) in want.chunks(16 << 10).enumerate() {
            fs.write(a, (i as u64) << 14, c).unwrap();
        }
        let st = fs.core().ordered.stats();
        assert_eq!(st.delalloc_flushed, 2, "{st:?}");
        assert_eq!(st.completed, 0, "an append waited for a completion: {st:?}");
        // Two buffers written back and pending, the third still gathering.
        assert_eq!(st.pending, 3, "{st:?}");
        assert_eq!(fs.read(a, 0, 11 << 20).unwrap(), want);
        assert_eq!(fs.stat(a).unwrap().size, want.len() as u64);
        ram.set_faults(Default::default());
        fs.commit().unwrap();
        assert_eq!(fs.core().ordered.stats().pending, 0);
        assert_eq!(extent_items(&fs, a), 3);
        let after = checked_copy(ram.durable_bytes());
        let a2 = in_root(&after, b"a");
        assert_eq!(after.read(a2, 0, 11 << 20).unwrap(), want);
    }

    /// Without the fsync rule that skips writes in progress, an fsync completes the pending
    /// extents before it logs.
    #[test]
    fn without_the_rule_fsync_completes_pending_extents() {
        let (ram, fs) = crate::mkfs::test_fs(128 << 20);
        fs.core().set_fsync_skips_writes_in_progress(false);
        let root = fs.root_inode();
        let a = fs.create(root, b"a", 0o644, Owner::default()).unwrap();
        fs.commit().unwrap();
        fs.write(a, 0, &[9u8; 200_000]).unwrap();
        assert_eq!(fs.core().ordered.stats().pending, 1);
        fs.fsync(a, false).unwrap();
        assert_eq!(fs.core().ordered.stats().pending, 0);
        assert_eq!(fs.core().inode_item_raw(a).unwrap().size, 200_000);
        let after = checked_copy(ram.durable_bytes());
        let a2 = in_root(&after, b"a");
        assert_eq!(after.read(a2, 0, 300_000).unwrap(), vec![9u8; 200_000]);
    }

    /// Four threads write interleaved 100-byte stripes of one file, so most writes share a
    /// sector with another thread's and rewrite it (read-modify-write). Without the range lock
    /// one write's read of a shared sector could miss a neighbour's and write the old bytes
    /// back: every stripe must end with its owner's last value.
    #[test]
    fn writes_sharing_sectors_lose_nothing() {
        const STRIPE: u64 = 100;
        const STRIPES: u64 = 640;
        let (ram, fs) = crate::mkfs::test_fs(128 << 20);
        let fs = Arc::new(fs);
        let root = fs.root_inode();
        let f = fs.create(root, b"f", 0o644, Owner::default()).unwrap();
        fs.write(f, 0, &vec![0xff; (STRIPE * STRIPES) as usize])
            .unwrap();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let fs = fs.clone();
                std::thread::spawn(move || {
                    for round in 1..=3u8 {
                        for s in (t..STRIPES).step_by(4) {
                            let v = round * 16 + t as u8;
                            fs.write(f, s * STRIPE, &[v; STRIPE as usize]).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let check_content = |content: &[u8]| {
            for s in 0..STRIPES {
                let want = 3 * 16 + (s % 4) as u8;
                let got = &content[(s * STRIPE) as usize..((s + 1) * STRIPE) as usize];
                assert!(got.iter().all(|b| *b == want), "stripe {s}: {got:?}");
            }
        };
        check_content(&fs.read(f, 0, 100_000).unwrap());
        assert!(fs.core().ordered.stats().started >= 3 * STRIPES);
        fs.commit().unwrap();
        let after = checked_copy(ram.durable_bytes());
        let f2 = in_root(&after, b"f");
        check_content(&after.read(f2, 0, 100_000).unwrap());
    }
}

/// Delayed preallocation: fallocates at a file's sector-aligned end, and truncates back to
/// where they started, kept in memory per file and put in the trees later (for all files
/// when anything takes the writer lock to change the trees or commits, for one file when it
/// is read through the gate or fsynced). Their space is allocated at once and held
/// (crate::space::alloc), so an fallocate that returned cannot fail later for space, and a
/// truncate that drops them gives the space straight back: it was never in a tree. They are
/// made and dropped under the file's inode passage and a lane of the gate (crate::gate) and
/// completed only under the exclusive gate: a completion never runs beside one, nor beside a
/// reader.
pub(crate) struct Preallocs {
    /// By inode hash: files fallocated side by side rarely meet on one lock.
    shards: Box<[crate::gate::Padded<Mutex<PreallocShard>>]>,
    /// Files with one (a quick test before the map).
    count: AtomicUsize,
    /// Completions.
    completed: AtomicU64,
}

/// Some files' delayed preallocations, and the fallocates and truncates served in memory.
#[derive(Default)]
struct PreallocShard {
    files: rustc_hash::FxHashMap<Inode, Prealloc>,
    in_memory: u64,
}

/// One file's delayed preallocation.
#[derive(Debug, Clone, Default)]
pub(crate) struct Prealloc {
    /// The file's size in the trees (where the preallocated extents start).
    pub start: u64,
    /// The file's size with them.
    pub size: u64,
    /// (file offset, disk start, length), held in the allocator, in file order and
    /// contiguous in the file from `start` on: `earlier`, then `last`, the one that grows
    /// (kept here, in the map's own memory, not on the heap where another file's could
    /// share its cache line).
    earlier: Vec<(u64, u64, u64)>,
    last: Option<(u64, u64, u64)>,
    /// When the last change happened: the inode's ctime, and its mtime if `mtime`. Taken
    /// at most every [`STAMP_EVERY`] changes (reading the clock cost a fifth of an
    /// in-memory fallocate on a VM), as the kernel stamps from a coarse clock.
    pub stamp: Option<std::time::Instant>,
    /// Changes since `stamp` was taken.
    pub unstamped: u32,
    /// A truncate came (it changes the mtime too; an fallocate the ctime only).
    pub mtime: bool,
}

const PREALLOC_SHARDS: usize = 64;

/// See [`Prealloc::stamp`].
pub(crate) const STAMP_EVERY: u32 = 16;

impl Prealloc {
    /// A new one for a file whose trees end at `start`.
    pub(crate) fn new(start: u64) -> Prealloc {
        Prealloc {
            start,
            size: start,
            ..Default::default()
        }
    }

    /// The extents, in file order.
    pub(crate) fn extents(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.earlier.iter().copied().chain(self.last)
    }

    /// Appends `[offset, +len)` at `at` on disk: one extent with the last when it continues
    /// it on disk, stays within `max` and in the last one's block group (two chunks may be
    /// adjacent in the logical address space, but an extent never crosses from one into the
    /// next: its bytes would be freed into the first group, past that group's end).
    pub(crate) fn append(
        &mut self,
        offset: u64,
        at: u64,
        len: u64,
        max: u64,
        a: &crate::space::alloc::Allocator,
    ) {
        match &mut self.last {
            Some((fo, b, l))
                if *fo + *l == offset
                    && *b + *l == at
                    && *l + len <= max
                    && a.group_containing(*b) == a.group_containing(at) =>
            {
                *l += len;
            }
            last => {
                if let Some(x) = last.replace((offset, at, len)) {
                    self.earlier.push(x);
                }
            }
        }
    }

    /// Gives the held space of its extents back to `a` (they never went into a tree).
    pub(crate) fn release_held(&self, a: &crate::space::alloc::Allocator) {
        for (_, b, l) in self.extents() {
            a.release_held(b, l);
        }
    }

    /// Takes every extent out.
    pub(crate) fn take_extents(&mut self) -> Vec<(u64, u64, u64)> {
        let mut v = std::mem::take(&mut self.earlier);
        v.extend(self.last.take());
        v
    }

    /// Notes a change now.
    pub(crate) fn stamp(&mut self) {
        if self.stamp.is_none() || self.unstamped + 1 >= STAMP_EVERY {
            self.stamp = Some(std::time::Instant::now());
            self.unstamped = 0;
        } else {
            self.unstamped += 1;
        }
    }
}

impl Default for Preallocs {
    fn default() -> Self {
        Preallocs {
            shards: (0..PREALLOC_SHARDS)
                .map(|_| {
                    // Sized up front: tables grown later could sit beside each other.
                    crate::gate::Padded(Mutex::new(PreallocShard {
                        files: rustc_hash::FxHashMap::with_capacity_and_hasher(
                            16,
                            Default::default(),
                        ),
                        in_memory: 0,
                    }))
                })
                .collect(),
            count: AtomicUsize::new(0),
            completed: AtomicU64::new(0),
        }
    }
}

impl Preallocs {
    fn files(&self, ino: Inode) -> std::sync::MutexGuard<'_, PreallocShard> {
        self.shards[ino.shard(PREALLOC_SHARDS)]
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Whether any file, or `ino`, has one.
    pub(crate) fn has(&self, ino: Option<Inode>) -> bool {
        self.count.load(Ordering::SeqCst) > 0
            && ino.is_none_or(|i| self.files(i).files.contains_key(&i))
    }

    /// Runs `f` on `ino`'s delayed preallocation (None when it has none), under its shard's
    /// lock; a new one is kept when `f` leaves `Some`. `f` says whether it served a change
    /// in memory (counted).
    pub(crate) fn with<R>(
        &self,
        ino: Inode,
        f: impl FnOnce(&mut Option<Prealloc>) -> (bool, R),
    ) -> R {
        let mut shard = self.files(ino);
        let shard = &mut *shard;
        if let Some(p) = shard.files.get_mut(&ino) {
            // The common case: one lookup, the entry changed in place.
            let mut cur = Some(std::mem::take(p));
            let (served, r) = f(&mut cur);
            shard.in_memory += served as u64;
            match cur {
                Some(c) => *p = c,
                None => {
                    shard.files.remove(&ino);
                    self.count.fetch_sub(1, Ordering::SeqCst);
                }
            }
            return r;
        }
        let mut cur = None;
        let (served, r) = f(&mut cur);
        shard.in_memory += served as u64;
        if let Some(p) = cur {
            shard.files.insert(ino, p);
            self.count.fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    /// What `ino`'s delayed preallocation will make of its inode item when it is completed:
    /// (size, bytes it adds, the stamp of its last change, whether that changed the mtime).
    pub(crate) fn view(&self, ino: Inode) -> Option<(u64, u64, Option<std::time::Instant>, bool)> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let shard = self.files(ino);
        let p = shard.files.get(&ino)?;
        let added = p.extents().map(|(_, _, l)| l).sum();
        Some((p.size, added, p.stamp, p.mtime))
    }

    /// Takes every file's (or `only`'s) out for their completion, in inode order.
    pub(crate) fn take(&self, only: Option<Inode>) -> Vec<(Inode, Prealloc)> {
        if !self.has(None) {
            return Vec::new();
        }
        let mut out: Vec<(Inode, Prealloc)> = match only {
            Some(i) => self
                .files(i)
                .files
                .remove(&i)
                .map(|p| (i, p))
                .into_iter()
                .collect(),
            None => self
                .shards
                .iter()
                .flat_map(|m| {
                    let mut m = m.0.lock().unwrap_or_else(|e| e.into_inner());
                    m.files.drain().collect::<Vec<_>>()
                })
                .collect(),
        };
        self.count.fetch_sub(out.len(), Ordering::SeqCst);
        self.completed
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out.sort_unstable_by_key(|(i, _)| *i);
        out
    }

    /// (fallocates and truncates served in memory, completions).
    pub(crate) fn stats(&self) -> (u64, u64) {
        let in_memory = self
            .shards
            .iter()
            .map(|m| m.0.lock().unwrap_or_else(|e| e.into_inner()).in_memory)
            .sum();
        (in_memory, self.completed.load(Ordering::Relaxed))
    }
}
