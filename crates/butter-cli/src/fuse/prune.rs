//! A bound on the nodes the kernel holds (FUSE_NOTIFY_PRUNE, Linux 6.18 and later).
//!
//! The kernel keeps an inode, and with it a lookup reference to its node, for every name it
//! caches, as long as it has memory to spare: after 100,000 stats a mount knows 100,000
//! nodes, and butter keeps a lookup count for each (and, for a non-directory, an open
//! reference in the engine, which keeps an unlinked file alive until the kernel forgets it).
//! That state grows with the files touched, not with anything the user sized.
//!
//! So the mount bounds it: past `bound` nodes the kernel knows, a thread of its own asks the
//! kernel to drop some (a prune notification carrying their node ids) until a quarter of the
//! bound is free again. The kernel drops only what nothing uses (no open file, no working
//! directory, no cached child), and sends a FORGET for each inode it drops, which frees
//! butter's state for it. A dropped name costs one LOOKUP the next time it is used.
//!
//! Which nodes: the ones the lookup table's order yields from a cursor that moves on after
//! each round, an arbitrary choice that costs no memory per node (an LRU list would cost as
//! much as the state it bounds). Rounds are at least [`ROUND_GAP`] apart, so nodes the kernel
//! cannot drop do not make every new lookup start one.
//!
//! A kernel without the notification refuses it (EINVAL): the first refusal turns the bound
//! off with a warning, and the mount goes on as before.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use std::time::Duration;

use super::Adapter;

/// Node ids per notification (the kernel copies them in batches of 512).
const PER_MESSAGE: usize = 512;
/// Least time between two rounds.
const ROUND_GAP: Duration = Duration::from_millis(20);

/// Nodes the kernel may hold per byte of `-o cache_size`: one per 4 KiB (131,072 at the
/// default 512 MiB; butter's state for one is about 150 bytes).
pub(crate) const BYTES_PER_NODE: u64 = 4096;
/// The bound is never below this.
pub(crate) const MIN_BOUND: usize = 1024;

/// The bound and its thread.
#[derive(Default)]
pub(crate) struct Pruner {
    /// Most nodes the kernel may hold (0: no bound).
    bound: AtomicUsize,
    /// Wakes the thread (set once the session exists).
    wake: OnceLock<SyncSender<()>>,
    /// Most nodes the kernel held at once.
    peak: AtomicUsize,
    /// Node ids sent in prune notifications.
    asked: AtomicU64,
    /// Rounds run.
    rounds: AtomicU64,
    /// The kernel refused the notification: no bound from then on.
    refused: AtomicBool,
    /// Where the next round starts in the lookup table's order.
    cursor: AtomicUsize,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What the bound did (for the log at unmount, and tests).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PruneStats {
    pub bound: usize,
    pub peak: usize,
    pub asked: u64,
    pub rounds: u64,
    /// The kernel refused the notification.
    pub refused: bool,
}

impl Pruner {
    /// A bound of `nodes` nodes (0: none; otherwise at least [`MIN_BOUND`]).
    pub(crate) fn with_bound(nodes: usize) -> Pruner {
        let p = Pruner::default();
        p.bound.store(
            if nodes == 0 { 0 } else { nodes.max(MIN_BOUND) },
            Ordering::Relaxed,
        );
        p
    }

    /// The kernel now holds `held` nodes (one more than before): past the bound, a round
    /// starts unless one is under way.
    pub(crate) fn held(&self, held: usize) {
        self.peak.fetch_max(held, Ordering::Relaxed);
        let bound = self.bound.load(Ordering::Relaxed);
        if bound == 0 || held <= bound {
            return;
        }
        if let Some(tx) = self.wake.get() {
            // Full: a round is already asked for; disconnected: the thread ended.
            let _: Result<(), TrySendError<()>> = tx.try_send(());
        }
    }

    pub(crate) fn stats(&self) -> PruneStats {
        PruneStats {
            bound: self.bound.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            asked: self.asked.load(Ordering::Relaxed),
            rounds: self.rounds.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    /// Ends the thread (at the session's end, before the final commit).
    pub(crate) fn stop(&self) {
        // The thread ends when it wakes up and finds no bound.
        self.bound.store(0, Ordering::Relaxed);
        if let Some(tx) = self.wake.get() {
            let _ = tx.try_send(());
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// Starts the bound's thread once the session exists (`fuse`: its /dev/fuse descriptor).
pub(crate) fn start(a: &Arc<Adapter>, fuse: std::os::fd::BorrowedFd<'_>) {
    let p = &a.prune;
    if p.bound.load(Ordering::Relaxed) == 0 {
        return;
    }
    let fd = match fuse.try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            log::warn!("no bound on the nodes the kernel holds ({e})");
            return;
        }
    };
    let (tx, rx) = sync_channel::<()>(1);
    let weak = Arc::downgrade(a);
    let spawned = std::thread::Builder::new()
        .name("butter-prune".into())
        .spawn(move || run(weak, rx, fd));
    match spawned {
        Ok(t) => {
            let _ = p.wake.set(tx);
            *p.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        }
        Err(e) => log::warn!("no bound on the nodes the kernel holds ({e})"),
    }
}

fn run(a: Weak<Adapter>, rx: Receiver<()>, fd: OwnedFd) {
    while rx.recv().is_ok() {
        let Some(a) = a.upgrade() else { return };
        let p = &a.prune;
        let bound = p.bound.load(Ordering::Relaxed);
        if bound == 0 {
            return;
        }
        let nodes = a.prune_candidates(bound - bound / 4, &p.cursor);
        if !nodes.is_empty() {
            p.rounds.fetch_add(1, Ordering::Relaxed);
            for part in nodes.chunks(PER_MESSAGE) {
                if let Err(e) = notify_prune(&fd, part) {
                    if e.raw_os_error() == Some(libc::ENODEV) {
                        // The mount is going away.
                        return;
                    }
                    p.refused.store(true, Ordering::Relaxed);
                    p.bound.store(0, Ordering::Relaxed);
                    log::warn!(
                        "the kernel refused to be asked to drop inodes ({e}; FUSE_NOTIFY_PRUNE \
                         needs Linux 6.18 or later): butter's memory for the files the kernel \
                         keeps now grows with them"
                    );
                    return;
                }
                p.asked.fetch_add(part.len() as u64, Ordering::Relaxed);
            }
        }
        drop(a);
        std::thread::sleep(ROUND_GAP);
    }
}

/// One prune notification: the kernel drops those of `nodes` nothing uses.
fn notify_prune(fd: &OwnedFd, nodes: &[u64]) -> std::io::Result<()> {
    let m = super::wire::notify_prune(nodes);
    // SAFETY: `m` is a live buffer of `m.len()` bytes.
    let n = unsafe { libc::write(fd.as_raw_fd(), m.as_ptr().cast(), m.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_is_never_below_the_minimum_and_zero_means_none() {
        assert_eq!(Pruner::with_bound(0).stats().bound, 0);
        assert_eq!(Pruner::with_bound(10).stats().bound, MIN_BOUND);
        assert_eq!(Pruner::with_bound(50_000).stats().bound, 50_000);
    }

    #[test]
    fn the_peak_is_kept_without_a_thread() {
        let p = Pruner::with_bound(MIN_BOUND);
        for n in 1..=3000 {
            p.held(n);
        }
        p.held(10);
        assert_eq!(p.stats().peak, 3000);
        assert_eq!(p.stats().rounds, 0);
    }
}
