//! The engine's rules for concurrent callers (front ends that run many operations at once,
//! such as the FUSE mount): the reader/writer gate, the abort latch, and fsync and commit
//! under them.
//!
//! - Changes (and commits) pass the gate exclusively, reads shared: the engine changes trees
//!   block by block, so a read that ran during a change could see half of it.
//! - A change or commit first takes the `changes` passage, then the gate. A commit keeps
//!   `changes` to its end but lets go of the gate once the trees are final, so reads run
//!   during its writes and flushes while the next change waits on `changes` (not on the gate,
//!   where it would hold readers back).
//! - The gate covers tree edits, not data I/O: a write that passes it as a *data write*
//!   ([`GateChange::let_data_out`]) steps out of it ([`Gate::step_out`]) while its data goes
//!   to the device between two edits (crate::inode::file), so other files are read and
//!   written meanwhile. Its range lock stays held. So that nothing holding the gate ever
//!   waits for that range lock, every change that may take a file's range locks (writes,
//!   truncates, fallocate, the deletion of an orphan) first takes the file's *inode passage*
//!   ([`Gate::inode`]), before the gate: one data write or data change per file at a time.
//! - A read passes only once no write's ordered extent waits for its completion (a reader
//!   would complete it, changing trees under the other readers): pending ones are completed
//!   under the exclusive gate first; for a read of one file (`Fs::read_gate_on`), that
//!   file's alone. Writes register pending ones only while they hold the gate exclusively, so
//!   none appear while it is held.
//! - Lanes ([`Gate::lane`]): an in-memory change of one file (a delayed preallocation,
//!   crate::inode::ordered::Preallocs) takes the file's inode passage and a lane, not the
//!   gate: it runs beside readers and beside other files' in-memory changes, never beside a
//!   change of the trees (the exclusive holder closes the lanes and waits for them to
//!   empty). Lanes are counters on cache lines of their own, so such changes of different
//!   files share no lock. What they leave in memory is completed under the exclusive gate
//!   only.
//! - The latch: a change that failed in a way that may have left half of it in the running
//!   transaction (I/O, damage met on the way, a broken invariant, a panic) stops all further
//!   changes and commits; the image keeps its last commit, like the kernel's transaction
//!   abort. The write engine's own abort (a failed commit) counts as stopped too.
//!
//! Lock order: inode passage -> range lock (crate::inode::ordered) -> `changes` -> gate -> the
//! writer (crate::transaction) -> `log_sync`; inode passage -> lane. The policies are methods of the facade
//! (crate::fs); this module holds the locks and the latch.

use crate::error::Error;
use crate::ids::Inode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

/// Inode passages: files hash onto this many locks. A collision serializes two files: one
/// waits for each whole write of the other (its data I/O included). With 64, about one small
/// file in 64 written beside a stream of 1 MiB writes waited behind one (p99 of the small
/// writes' wait for the gate 0.7 ms, against 0.15 ms with 1024).
const INODE_PASSAGES: usize = 1024;
/// Lanes of in-memory file changes.
const LANES: usize = 16;

/// One per cache line: threads on different ones do not slow each other down.
#[repr(align(64))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// In a lane ([`Gate::lane`]).
pub(crate) struct InLane<'a> {
    lane: &'a AtomicUsize,
}

impl Drop for InLane<'_> {
    fn drop(&mut self) {
        self.lane.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The gate and the latch (one per filesystem; the policies that use them are
/// `Fs::read_gate`, `Fs::change_gate`, `Core::stop`, `Fs::gated_fsync` and `Fs::gated_commit`).
pub(crate) struct Gate {
    state: Mutex<State>,
    /// Signalled whenever a passage is let go of.
    freed: Condvar,
    inodes: Vec<Padded<Mutex<()>>>,
    /// The lanes of in-memory file changes ([`Gate::lane`]), and whether an exclusive holder
    /// keeps them out.
    lanes: Vec<Padded<AtomicUsize>>,
    lanes_closed: AtomicBool,
    stopped: Mutex<Option<String>>,
    /// `stopped` is set (checked without its lock).
    latched_flag: std::sync::atomic::AtomicBool,
    /// Times a data write stepped out for its I/O.
    steps_out: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct State {
    readers: usize,
    /// The gate is held exclusively (by a change, or a commit until its trees are final).
    exclusive: bool,
    /// Threads waiting for the exclusive gate: new readers wait behind them.
    waiting: usize,
    /// The `changes` passage is held (by a change, or a commit to its end).
    changes: bool,
    /// The data write holding both passages, which may step out of them for its data I/O.
    data_writer: Option<ThreadId>,
    /// Threads asleep on `freed`: a passage let go of wakes them only when there are any
    /// (a wake-up is a system call, and most passages are let go of with nobody waiting).
    sleepers: usize,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            state: Mutex::default(),
            freed: Condvar::new(),
            inodes: (0..INODE_PASSAGES)
                .map(|_| Padded(Mutex::new(())))
                .collect(),
            lanes: (0..LANES).map(|_| Padded(AtomicUsize::new(0))).collect(),
            lanes_closed: AtomicBool::new(false),
            stopped: Mutex::default(),
            latched_flag: Default::default(),
            steps_out: Default::default(),
        }
    }
}

/// What passage of a gate the calling thread holds ([`held_here`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    None,
    Shared,
    Exclusive,
}

thread_local! {
    /// Passages the thread holds: (shared, exclusive). Guards count themselves in when made
    /// and out when dropped, on the thread that holds them.
    static HELD: std::cell::Cell<(u32, u32)> = const { std::cell::Cell::new((0, 0)) };
}

/// What the calling thread holds: an operation that takes its own passage runs under this
/// one instead of waiting for itself (crate::fs::ops).
pub(crate) fn held_here() -> Held {
    match HELD.get() {
        (_, x) if x > 0 => Held::Exclusive,
        (r, _) if r > 0 => Held::Shared,
        _ => Held::None,
    }
}

fn count_held(shared: i32, exclusive: i32) {
    let (r, x) = HELD.get();
    HELD.set((
        r.saturating_add_signed(shared),
        x.saturating_add_signed(exclusive),
    ));
}

/// Held by a reader: no change runs meanwhile.
pub struct GateRead<'a> {
    gate: &'a Gate,
}

/// Held by a change: no reader and no other change runs meanwhile (except while a data write
/// has stepped out, see [`Gate::step_out`]). Fields drop in order: the gate, then the inode
/// passage.
pub struct GateChange<'a> {
    _changes: ChangesHeld<'a>,
    exclusive: ExclusiveHeld<'a>,
    inode: Option<MutexGuard<'a, ()>>,
}

/// Held by a commit: `changes` to its end, and the gate until the trees are final.
pub(crate) struct GateCommit<'a> {
    pub changes: ChangesHeld<'a>,
    pub exclusive: ExclusiveHeld<'a>,
}

/// The `changes` passage, let go of when dropped.
pub(crate) struct ChangesHeld<'a> {
    gate: &'a Gate,
}

/// The exclusive gate, let go of when dropped.
pub(crate) struct ExclusiveHeld<'a> {
    gate: &'a Gate,
}

/// A data write out of the gate ([`Gate::step_out`]); dropping it takes the gate back.
pub(crate) struct SteppedOut<'a> {
    gate: Option<&'a Gate>,
}

impl Gate {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, mut s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        s.sleepers += 1;
        let mut s = self.freed.wait(s).unwrap_or_else(|e| e.into_inner());
        s.sleepers -= 1;
        s
    }

    /// Lets go of the state lock, then wakes the sleepers, if any.
    fn release(&self, s: MutexGuard<'_, State>) {
        let wake = s.sleepers > 0;
        drop(s);
        if wake {
            self.freed.notify_all();
        }
    }

    /// Shared passage (after any change already waiting for the gate).
    pub(crate) fn read(&self) -> GateRead<'_> {
        let mut s = self.state();
        while s.exclusive || s.waiting > 0 {
            s = self.wait(s);
        }
        s.readers += 1;
        count_held(1, 0);
        GateRead { gate: self }
    }

    /// Takes `changes`, then the gate.
    fn take_both<'a>(&'a self, mut s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        while s.changes {
            s = self.wait(s);
        }
        s.changes = true;
        s.waiting += 1;
        while s.exclusive || s.readers > 0 {
            s = self.wait(s);
        }
        s.waiting -= 1;
        s.exclusive = true;
        self.close_lanes();
        s
    }

    /// A lane for an in-memory change of one file (a delayed preallocation, crate::inode::ordered),
    /// which must not run beside a change of the trees, but may beside readers and other
    /// files' in-memory changes: none while the gate is held exclusively (`None`: take the
    /// ordinary way). The caller holds the file's inode passage. Lanes are counters on cache
    /// lines of their own, so in-memory changes of different files share no lock.
    pub(crate) fn lane(&self, ino: Inode) -> Option<InLane<'_>> {
        if self.lanes_closed.load(Ordering::SeqCst) {
            return None;
        }
        let lane = &self.lanes[ino.shard(LANES)].0;
        lane.fetch_add(1, Ordering::SeqCst);
        let entered = InLane { lane };
        // Seen open after counting in: an exclusive holder closing them now waits for us.
        (!self.lanes_closed.load(Ordering::SeqCst)).then_some(entered)
    }

    /// Keeps in-memory changes out, for the exclusive holder (under the state lock): closed
    /// first, then every lane waited for (they are short and take no lock).
    fn close_lanes(&self) {
        self.lanes_closed.store(true, Ordering::SeqCst);
        for l in &self.lanes {
            while l.load(Ordering::SeqCst) > 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Exclusive passage, `changes` first.
    pub(crate) fn change(&self) -> GateChange<'_> {
        let GateCommit { changes, exclusive } = self.commit();
        GateChange {
            _changes: changes,
            exclusive,
            inode: None,
        }
    }

    /// The inode passage of `ino`, then the exclusive passage: for a change that may take
    /// `ino`'s range locks.
    pub(crate) fn change_inode(&self, ino: Inode) -> GateChange<'_> {
        let inode = self.inode(ino);
        let mut g = self.change();
        g.inode = Some(inode);
        g
    }

    /// The inode passage of `ino` alone (see the module doc).
    pub(crate) fn inode(&self, ino: Inode) -> MutexGuard<'_, ()> {
        self.inodes[passage_of(ino)]
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Exclusive passage whose parts a commit lets go of one after the other.
    pub(crate) fn commit(&self) -> GateCommit<'_> {
        drop(self.take_both(self.state()));
        count_held(0, 1);
        GateCommit {
            changes: ChangesHeld { gate: self },
            exclusive: ExclusiveHeld { gate: self },
        }
    }

    /// Steps the calling thread out of the gate for data I/O, if it holds the gate as a data
    /// write ([`GateChange::let_data_out`]); otherwise (no gate, a read, an ordinary change)
    /// does nothing. The gate is taken back (`changes`, then the gate) when the result drops.
    pub(crate) fn step_out(&self) -> SteppedOut<'_> {
        let me = std::thread::current().id();
        let mut s = self.state();
        if s.data_writer != Some(me) || !s.exclusive || !s.changes {
            return SteppedOut { gate: None };
        }
        s.exclusive = false;
        self.lanes_closed.store(false, Ordering::SeqCst);
        s.changes = false;
        s.data_writer = None;
        self.release(s);
        self.steps_out
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        SteppedOut { gate: Some(self) }
    }

    /// Times a data write stepped out of the gate for its I/O.
    pub(crate) fn steps_out(&self) -> u64 {
        self.steps_out.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the latch; the first reason is kept (and logged, with what the user can do).
    /// Returns whether this call set it.
    pub(crate) fn latch(&self, why: String) -> bool {
        let mut s = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_some() {
            return false;
        }
        log::error!(
            "{why}; the filesystem is read-only from now on and nothing more is committed: \
             the image keeps its last commit (unmount, then run `butter check`)"
        );
        *s = Some(why);
        self.latched_flag
            .store(true, std::sync::atomic::Ordering::SeqCst);
        true
    }

    /// Whether the latch is set (without its lock).
    pub(crate) fn is_latched(&self) -> bool {
        self.latched_flag.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Why the latch is set, if it is.
    pub(crate) fn latched(&self) -> Option<String> {
        self.stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl GateChange<'_> {
    /// Reports that the change this guard admits failed with `e`: a failure that may have
    /// left half of it in the running transaction ([`Error::stops_changes`]) sets the latch
    /// before the gate is let go of. (A panic that unwinds through the guard sets it too.)
    pub fn failed(&self, what: &str, e: &Error) {
        if e.stops_changes() {
            self.exclusive.gate.latch(format!("{what} failed: {e}"));
        }
    }

    /// The change's result, its failure reported first ([`GateChange::failed`]).
    pub(crate) fn settle<T>(
        &self,
        what: &str,
        r: crate::error::Result<T>,
    ) -> crate::error::Result<T> {
        if let Err(e) = &r {
            self.failed(what, e);
        }
        r
    }

    /// Marks this change as a data write of the calling thread: it may step out of the gate
    /// for its data I/O ([`Gate::step_out`]). Only for a change that holds its file's inode
    /// passage.
    pub(crate) fn let_data_out(&self) {
        if self.inode.is_some() {
            self.exclusive.gate.state().data_writer = Some(std::thread::current().id());
        }
    }
}

impl Drop for GateChange<'_> {
    /// A panic that unwinds through a change may have left half of it in the running
    /// transaction: the latch is set before the gate is let go of (the fields drop after
    /// this), so no other change or commit sees the half.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.exclusive
                .gate
                .latch("a change panicked half way".into());
        }
    }
}

impl Drop for GateRead<'_> {
    fn drop(&mut self) {
        count_held(-1, 0);
        let mut s = self.gate.state();
        s.readers -= 1;
        // Only a change waits for the readers to leave (and counts itself in `waiting`
        // first): no wake-up (a system call) when none does.
        let wake = s.readers == 0 && s.waiting > 0 && s.sleepers > 0;
        drop(s);
        if wake {
            self.gate.freed.notify_all();
        }
    }
}

impl Drop for ChangesHeld<'_> {
    fn drop(&mut self) {
        let mut s = self.gate.state();
        s.changes = false;
        s.data_writer = None;
        self.gate.release(s);
    }
}

impl Drop for ExclusiveHeld<'_> {
    fn drop(&mut self) {
        count_held(0, -1);
        let mut s = self.gate.state();
        s.exclusive = false;
        self.gate.lanes_closed.store(false, Ordering::SeqCst);
        self.gate.release(s);
    }
}

impl SteppedOut<'_> {
    /// Whether the caller had stepped out (and is now back in).
    pub(crate) fn was_out(&self) -> bool {
        self.gate.is_some()
    }
}

impl Drop for SteppedOut<'_> {
    fn drop(&mut self) {
        if let Some(gate) = self.gate {
            // Back in, as the data writer again.
            let me = std::thread::current().id();
            let mut s = gate.take_both(gate.state());
            s.data_writer = Some(me);
        }
    }
}

/// Which inode passage `ino` takes.
fn passage_of(ino: Inode) -> usize {
    ino.shard(INODE_PASSAGES)
}

#[cfg(test)]
mod tests {
    use crate::error::Error;
    use crate::inode::namespace::Owner;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn files_made_one_after_another_rarely_share_an_inode_passage() {
        use super::{passage_of, INODE_PASSAGES};
        use crate::ids::Inode;
        // A file being streamed to, and a thousand small files created after it (consecutive
        // inode numbers, as a create loop makes them), in two subvolumes.
        for root in [5u64, 257] {
            let stream = passage_of(Inode { root, ino: 257 });
            let mut used = vec![0usize; INODE_PASSAGES];
            let mut beside_stream = 0;
            for ino in 258..1258u64 {
                let p = passage_of(Inode { root, ino });
                used[p] += 1;
                beside_stream += usize::from(p == stream);
            }
            assert!(
                beside_stream <= 3,
                "root {root}: {beside_stream} files share the stream's passage"
            );
            let distinct = used.iter().filter(|&&n| n > 0).count();
            assert!(
                distinct >= 600,
                "root {root}: 1000 files on {distinct} passages"
            );
        }
    }

    #[test]
    fn readers_share_the_gate_and_a_change_waits_for_them() {
        let (_dev, fs) = crate::mkfs::test_fs(256 << 20);
        let fs = Arc::new(fs);
        let r1 = fs.read_gate();
        // A second reader passes while the first holds the gate.
        let fs2 = fs.clone();
        let t = std::thread::spawn(move || {
            let _r2 = fs2.read_gate();
        });
        t.join().unwrap();
        // A change waits for the reader.
        let changed = Arc::new(AtomicBool::new(false));
        let (fs3, c3) = (fs.clone(), changed.clone());
        let t = std::thread::spawn(move || {
            let _g = fs3.change_gate().unwrap();
            c3.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!changed.load(Ordering::SeqCst), "a change passed a reader");
        drop(r1);
        t.join().unwrap();
        assert!(changed.load(Ordering::SeqCst));
    }

    #[test]
    fn the_latch_stops_changes_and_commits_from_every_thread() {
        let (_dev, fs) = crate::mkfs::test_fs(256 << 20);
        let fs = Arc::new(fs);
        let me = Owner { uid: 0, gid: 0 };
        {
            let _g = fs.change_gate().unwrap();
            fs.create(fs.root_inode(), b"before", 0o644, me).unwrap();
        }
        fs.gated_commit().unwrap();
        assert!(Error::Internal("x".into()).stops_changes());
        assert!(!Error::NotFound("x".into()).stops_changes());
        fs.core().stop("a change failed half way".into());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let fs = fs.clone();
                std::thread::spawn(move || {
                    (
                        matches!(fs.change_gate(), Err(Error::Aborted(_))),
                        matches!(fs.gated_commit(), Err(Error::Aborted(_))),
                    )
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (true, true));
        }
        // Reads go on.
        let _r = fs.read_gate();
        assert!(fs.lookup(fs.root_inode(), b"before").unwrap().is_some());
        assert!(fs.stopped().unwrap().contains("half way"));
    }

    /// The latch belongs to the engine's change guard: a failure reported to it sets the
    /// latch only when it may have left half a change behind, and a panic that unwinds
    /// through it (on another thread, as a front end's worker would) sets it before the gate
    /// is let go of, so the change waiting next is refused.
    #[test]
    fn the_change_guard_sets_the_latch_on_a_lasting_failure_or_a_panic() {
        let (_dev, fs) = crate::mkfs::test_fs(256 << 20);
        let fs = Arc::new(fs);
        let me = Owner { uid: 0, gid: 0 };
        {
            let g = fs.change_gate().unwrap();
            fs.create(fs.root_inode(), b"a", 0o644, me).unwrap();
            g.failed("create", &Error::NotFound("a caller's mistake".into()));
        }
        assert!(fs.stopped().is_none(), "a caller's mistake stopped changes");
        fs.gated_commit().unwrap();
        // A failure that may have left half a change: the latch.
        let (_dev2, other) = crate::mkfs::test_fs(256 << 20);
        other
            .change_gate()
            .unwrap()
            .failed("write", &Error::Internal("half way".into()));
        assert!(other.stopped().unwrap().contains("write failed"));
        assert!(matches!(other.change_gate(), Err(Error::Aborted(_))));
        // A panic in one change while another waits for the gate.
        let held = Arc::new(std::sync::Barrier::new(2));
        let (fs1, h1) = (fs.clone(), held.clone());
        let panicker = std::thread::spawn(move || {
            let _g = fs1.change_gate().unwrap();
            h1.wait();
            std::thread::sleep(Duration::from_millis(50));
            panic!("half a change");
        });
        held.wait();
        let next = fs.change_gate();
        assert!(panicker.join().is_err());
        assert!(
            matches!(next, Err(Error::Aborted(_))),
            "the change waiting behind a panic passed"
        );
        assert!(fs.stopped().unwrap().contains("panicked"));
        assert!(matches!(fs.gated_commit(), Err(Error::Aborted(_))));
    }
}
