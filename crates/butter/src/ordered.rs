//! Ordered extents: file data written to its new place on the device but not yet recorded in
//! the trees.
//!
//! A write of a regular extent goes in three steps (crate::file_write):
//! 1. under the writer lock: allocate the extent, held (crate::alloc::BlockGroup::held), so a
//!    commit in the meantime leaves it free on disk;
//! 2. without the writer lock: write the data and compute its checksums (the writeback);
//! 3. under the writer lock: insert the checksums and the file extent item, take the extent
//!    out of the held set, update the inode (the ordered extent's completion).
//!
//! Other operations, on other files or on other ranges of the same file, go on during step 2.
//! Each inode being written has a range-state tree (seed 000's crate::extent_io): a write holds
//! a range lock on the sectors it covers from its read-modify-write of partial sectors to its
//! completion, so overlapping writes to one file happen one after the other, as the kernel's
//! extent range lock makes them; `ORDERED` marks ranges from allocation to completion and
//! `WRITEBACK` ranges whose data is being written.
//!
//! A write returns only after its completion, so an fsync, which covers the writes that
//! returned before it was called, finds their items in the trees and need not wait here (seed
//! 003's rule; [`OrderedTrees::wait_for_writes`] is the wait without it). A commit never
//! waits either: an unfinished ordered extent is not in the trees and its space is free on
//! disk, and a power cut at any point loses only writes that had not returned.

use crate::extent_io::{ExtentBits, SharedExtentIoTree};
use crate::fs::Inode;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// The range-state trees of the inodes being written.
#[derive(Default)]
pub struct OrderedTrees {
    inodes: Mutex<HashMap<Inode, InodeWrites>>,
    /// Signalled when a write ends while someone waits in [`OrderedTrees::wait_for_writes`].
    write_done: Condvar,
    waiters: AtomicU64,
    next_ticket: AtomicU64,
    started: AtomicU64,
    locked_waits: AtomicU64,
}

/// One inode being written: its range-state tree and the tickets of the writes holding a
/// range lock in it (for [`OrderedTrees::wait_for_writes`]).
struct InodeWrites {
    tree: Arc<SharedExtentIoTree>,
    tickets: BTreeSet<u64>,
}

/// Counters for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrderedStats {
    /// Ordered extents started.
    pub started: u64,
    /// Writes that waited for an overlapping write's range lock.
    pub locked_waits: u64,
    /// Inodes with a write in progress now.
    pub inodes: u64,
}

impl OrderedTrees {
    /// Locks the bytes `[start, end)` of `ino` for a write (waiting for overlapping writes).
    pub fn lock(&self, ino: Inode, start: u64, end: u64) -> RangeGuard<'_> {
        let tree = self
            .inodes()
            .entry(ino)
            .or_insert_with(|| InodeWrites {
                tree: Arc::new(SharedExtentIoTree::new()),
                tickets: BTreeSet::new(),
            })
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
            .or_insert_with(|| InodeWrites {
                tree: tree.clone(),
                tickets: BTreeSet::new(),
            })
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

    pub fn stats(&self) -> OrderedStats {
        OrderedStats {
            started: self.started.load(Ordering::Relaxed),
            locked_waits: self.locked_waits.load(Ordering::Relaxed),
            inodes: self.inodes().len() as u64,
        }
    }

    /// Waits until the writes to `ino` that hold their range lock now have finished (writes
    /// that start meanwhile are not waited for).
    pub fn wait_for_writes(&self, ino: Inode) {
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

    /// Whether any byte of `[start, end)` of `ino` has `bits` now.
    pub fn test(&self, ino: Inode, start: u64, end: u64, bits: ExtentBits) -> bool {
        let tree = self.inodes().get(&ino).map(|w| w.tree.clone());
        tree.is_some_and(|t| t.test_bits(start, end.max(start + 1) - 1, bits, false))
    }
}

impl crate::fs::Fs {
    /// Counters of the ordered extents since the filesystem was opened.
    pub fn ordered_stats(&self) -> OrderedStats {
        self.ordered.stats()
    }

    /// Whether long extents are written without the writer lock (the default). Off, every
    /// write's data goes to the device under the lock, as before ordered extents: for
    /// benchmarks that compare the two.
    pub fn set_unlocked_writeback(&self, on: bool) {
        let above = if on {
            crate::file_write::SHORT_WRITEBACK
        } else {
            u64::MAX
        };
        self.unlocked_writeback_above
            .store(above, Ordering::Relaxed);
    }
}

/// A write's range lock; unlocks (and forgets the inode's tree once nothing is left in it) on
/// drop.
pub struct RangeGuard<'a> {
    owner: &'a OrderedTrees,
    ino: Inode,
    tree: Arc<SharedExtentIoTree>,
    start: u64,
    last: u64,
    ticket: u64,
}

impl RangeGuard<'_> {
    /// The locked range as `[start, end)`.
    pub fn range(&self) -> (u64, u64) {
        (self.start, self.last + 1)
    }

    /// An ordered extent over `[start, end)` (inside the locked range) begins: allocated, its
    /// data about to be written.
    pub fn start_ordered(&self, start: u64, end: u64) {
        self.owner.started.fetch_add(1, Ordering::Relaxed);
        self.tree
            .set_bits(start, end - 1, ExtentBits::ORDERED | ExtentBits::WRITEBACK);
    }

    /// Its data is written (or failed to be).
    pub fn writeback_done(&self, start: u64, end: u64) {
        self.tree.clear_bits(start, end - 1, ExtentBits::WRITEBACK);
    }

    /// Completed: in the trees, or abandoned after an error.
    pub fn finish_ordered(&self, start: u64, end: u64) {
        self.tree
            .clear_bits(start, end - 1, ExtentBits::ORDERED | ExtentBits::WRITEBACK);
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.tree.clear_bits(
            self.start,
            self.last,
            ExtentBits::ORDERED | ExtentBits::WRITEBACK,
        );
        self.tree.unlock_range(self.start, self.last);
        let mut inodes = self.owner.inodes();
        if let Some(w) = inodes.get_mut(&self.ino) {
            w.tickets.remove(&self.ticket);
            // Forgotten once no other write holds or waits for its tree: two references
            // then, the map's and ours.
            if w.tickets.is_empty()
                && Arc::strong_count(&self.tree) == 2
                && self.tree.with(|t| t.is_empty())
            {
                inodes.remove(&self.ino);
            }
        }
        if self.owner.waiters.load(Ordering::SeqCst) > 0 {
            self.owner.write_done.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{BlockDevice, RamDevice};
    use crate::fs::Fs;
    use crate::fs_write::Owner;
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
        let r = crate::check::check(&fs, &mut |_| {}).unwrap();
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
        assert!(fs.ordered.test(a, 0, 300_000, ExtentBits::WRITEBACK));
        assert!(fs.ordered.test(a, 0, 300_000, ExtentBits::ORDERED));
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
        assert!(!fs.ordered.test(a, 0, 300_000, ExtentBits::ORDERED));
        assert_eq!(fs.ordered.stats().inodes, 0);
        assert_eq!(fs.read(a, 0, 400_000).unwrap(), data);
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
        (
            ram,
            Arc::new(Fs::open_device_rw(dev).unwrap()),
            arrived,
            release,
        )
    }

    /// Seed 003's rule: an fsync does not wait for a write to the same file that is still in
    /// progress; without the rule it waits for that write to finish.
    #[test]
    fn fsync_waits_for_writes_in_progress_only_without_the_rule() {
        for rule in [true, false] {
            let (ram, fs, arrived, release) = gated();
            fs.set_fsync_skips_writes_in_progress(rule);
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
        assert!(fs.ordered.stats().started >= 3 * STRIPES);
        fs.commit().unwrap();
        let after = checked_copy(ram.durable_bytes());
        let f2 = in_root(&after, b"f");
        check_content(&after.read(f2, 0, 100_000).unwrap());
    }
}
