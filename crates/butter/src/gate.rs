//! The engine's rules for concurrent callers (front ends that run many operations at once,
//! such as the FUSE mount): the reader/writer gate, the abort latch, and fsync and commit
//! under them.
//!
//! - Changes (and commits) pass the gate exclusively, reads shared: the engine changes trees
//!   block by block, so a read that ran during a change could see half of it.
//! - A change or commit first takes the `changes` lock, then the gate. A commit keeps
//!   `changes` to its end but lets go of the gate once the trees are final, so reads run
//!   during its writes and flushes while the next change waits on `changes` (not on the gate,
//!   where it would hold readers back).
//! - A read passes only once no write's ordered extent waits for its completion (a reader
//!   would complete it, changing trees under the other readers): pending ones are completed
//!   under the exclusive gate first. Writes register pending ones only while they hold the
//!   gate exclusively, so none appear while it is held.
//! - The latch: a change that failed in a way that may have left half of it in the running
//!   transaction (I/O, damage met on the way, a broken invariant, a panic) stops all further
//!   changes and commits; the image keeps its last commit, like the kernel's transaction
//!   abort. The write engine's own abort (a failed commit) counts as stopped too.
//!
//! Lock order: `changes` -> gate -> the writer (crate::transaction) -> `log_sync`. The
//! policies are methods of the facade (crate::fs); this module holds the locks and the latch.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The gate and the latch (one per filesystem; the policies that use them are
/// `Fs::read_gate`, `Fs::change_gate`, `Fs::stop`, `Fs::gated_fsync` and `Fs::gated_commit`).
#[derive(Default)]
pub struct Gate {
    lock: RwLock<()>,
    changes: Mutex<()>,
    stopped: Mutex<Option<String>>,
}

/// Held by a reader: no change runs meanwhile.
pub struct GateRead<'a> {
    _g: RwLockReadGuard<'a, ()>,
}

/// Held by a change: no reader and no other change runs meanwhile.
pub struct GateChange<'a> {
    _c: MutexGuard<'a, ()>,
    _g: RwLockWriteGuard<'a, ()>,
}

/// Held by a commit: `changes` to its end, and the gate until the trees are final.
pub struct GateCommit<'a> {
    pub changes: MutexGuard<'a, ()>,
    pub exclusive: RwLockWriteGuard<'a, ()>,
}

impl Gate {
    /// Shared passage.
    pub fn read(&self) -> GateRead<'_> {
        GateRead {
            _g: self.lock.read().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Exclusive passage, `changes` first.
    pub fn change(&self) -> GateChange<'_> {
        let GateCommit { changes, exclusive } = self.commit();
        GateChange {
            _c: changes,
            _g: exclusive,
        }
    }

    /// Exclusive passage whose parts a commit lets go of one after the other.
    pub fn commit(&self) -> GateCommit<'_> {
        let changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let exclusive = self.lock.write().unwrap_or_else(|e| e.into_inner());
        GateCommit { changes, exclusive }
    }

    /// Sets the latch; the first reason is kept. Returns whether this call set it.
    pub fn latch(&self, why: String) -> bool {
        let mut s = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            *s = Some(why);
            true
        } else {
            false
        }
    }

    /// Why the latch is set, if it is.
    pub fn latched(&self) -> Option<String> {
        self.stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Error;
    use crate::fs_write::Owner;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

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
        fs.stop("a change failed half way".into());
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
}
