//! Large writes on threads of their own (the mount's *bulk lanes*).
//!
//! The kernel hands each FUSE request to the worker thread that has waited longest, so under
//! a stream of large writes every worker takes its turn at the stream's work (checksums, the
//! copy to the device, the tree edits), on whichever CPU it last ran, and the small requests
//! of other jobs keep landing on a CPU that a long write holds (measured with bench/run
//! mixed_io: 4 KiB reads beside a 1 MiB write stream had a p99 of about 560 µs with the work
//! on the workers, 350 µs with it on a lane, where a FUSE filesystem that does nothing,
//! nullfs, has about 370 µs).
//!
//! A worker that receives a large write passes the engine's part of it to a lane chosen by
//! the file, and waits; one file's large writes always go to the same lane, and writes to
//! different files run on different lanes at once, one lane per CPU the mount may run on,
//! each kept to its CPU. The scheduler then brings the stream's worker and writer near its
//! lane, and leaves the other CPUs to the small requests (interleaved mixed_io runs: 4 KiB
//! reads beside the stream at a p99 of about 320 µs with the lanes kept to their CPUs, 520 µs
//! with them free to move, and the stream faster too). The data is not copied: the worker
//! lends it and waits until the lane is done with it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, SyncSender};

/// A job handed to a lane: runs once, then is dropped.
type Job = Box<dyn FnOnce() + Send + 'static>;

/// The lanes; dropping them ends their threads once their queued jobs ran.
pub(crate) struct Bulk {
    lanes: Vec<SyncSender<Job>>,
}

impl Bulk {
    /// `n` lanes (at least one), each a thread named `butter-bulk-N`, free to run anywhere.
    #[cfg(test)]
    pub(crate) fn new(n: usize) -> std::io::Result<Bulk> {
        Bulk::spawn(&vec![None; n.max(1)])
    }

    /// A lane per entry of `cpus`, each kept to its CPU where one is given (a lane that
    /// cannot be kept there runs anywhere).
    fn spawn(cpus: &[Option<usize>]) -> std::io::Result<Bulk> {
        let mut lanes = Vec::new();
        for (i, &cpu) in cpus.iter().enumerate() {
            let (tx, rx) = sync_channel::<Job>(0);
            std::thread::Builder::new()
                .name(format!("butter-bulk-{i}"))
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        if let Err(e) = keep_to_cpu(cpu) {
                            log::debug!("bulk lane {i} stays free to move (CPU {cpu}: {e})");
                        }
                    }
                    for job in rx {
                        // A job catches its own panics (the FUSE adapter answers EIO); this
                        // keeps the lane alive whatever a job does.
                        let _ = catch_unwind(AssertUnwindSafe(job));
                    }
                })?;
            lanes.push(tx);
        }
        Ok(Bulk { lanes })
    }

    /// A lane for each CPU this process may run on, kept to it.
    pub(crate) fn per_cpu() -> std::io::Result<Bulk> {
        match allowed_cpus() {
            Ok(cpus) if !cpus.is_empty() => {
                Bulk::spawn(&cpus.into_iter().map(Some).collect::<Vec<_>>())
            }
            _ => Bulk::spawn(&vec![
                None;
                std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
            ]),
        }
    }

    /// Runs `f` on the lane of `key` (a file) and returns once it ran. `f` may borrow from
    /// the caller. Should the lane be gone, `f` runs on the calling thread.
    pub(crate) fn run<'a>(&self, key: u64, f: impl FnOnce() + Send + 'a) {
        let lane = &self.lanes
            [(key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % self.lanes.len()];
        // `done` goes into the job and is dropped with it: when the job ran (or unwound), or
        // when it is dropped unrun. Its receiver learns that as a disconnection.
        let (done, finished) = sync_channel::<()>(0);
        let job: Box<dyn FnOnce() + Send + 'a> = Box::new(move || {
            let _done = done;
            f()
        });
        // SAFETY: only the lifetime changes ('a to 'static). The job may hold borrows of 'a,
        // and it is gone before this function returns: `finished.recv()` below returns only
        // once `done`, which the job owns, has been dropped, i.e. once the job itself has
        // been run or dropped. A job the lane refuses comes back in the error and runs here.
        let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Job>(job) };
        let sent = lane.send(job);
        if let Err(refused) = sent {
            (refused.0)();
        }
        // Never an Ok: nobody sends on `done`.
        let _ = finished.recv();
    }
}

/// The CPUs the calling thread may run on (its affinity mask, which cgroups and taskset
/// narrow), in order.
fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid cpu_set_t of `size` bytes; pid 0 is the calling thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads the set within its size (CPU_SETSIZE bits).
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Keeps the calling thread to `cpu`.
fn keep_to_cpu(cpu: usize) -> std::io::Result<()> {
    // SAFETY: as in allowed_cpus; CPU_SET writes within the set (cpu < CPU_SETSIZE, checked).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    unsafe { libc::CPU_SET(cpu, &mut set) };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid cpu_set_t of `size` bytes; pid 0 is the calling thread.
    if unsafe { libc::sched_setaffinity(0, size, &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Bulk;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_job_borrows_from_the_caller_and_has_run_when_run_returns() {
        let bulk = Bulk::new(2).unwrap();
        let data = vec![7u8; 1 << 20];
        let mut sum = 0u64;
        bulk.run(42, || sum = data.iter().map(|&b| b as u64).sum());
        assert_eq!(sum, 7 << 20);
    }

    #[test]
    fn jobs_run_on_the_lane_threads_and_one_key_keeps_its_lane() {
        let bulk = Bulk::new(3).unwrap();
        let mut names = Vec::new();
        for _ in 0..4 {
            let mut name = String::new();
            bulk.run(9, || {
                name = std::thread::current().name().unwrap_or("").to_string();
            });
            names.push(name);
        }
        assert!(names[0].starts_with("butter-bulk-"), "{names:?}");
        assert!(names.iter().all(|n| *n == names[0]), "{names:?}");
    }

    #[test]
    fn per_cpu_lanes_each_keep_to_one_allowed_cpu() {
        let allowed = super::allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        let bulk = Bulk::per_cpu().unwrap();
        assert_eq!(bulk.lanes.len(), allowed.len());
        let mut seen = std::collections::BTreeSet::new();
        for key in 0..256u64 {
            let mut mask = Vec::new();
            bulk.run(key, || mask = super::allowed_cpus().unwrap());
            assert_eq!(mask.len(), 1, "a lane free to move: {mask:?}");
            assert!(allowed.contains(&mask[0]), "{mask:?} not in {allowed:?}");
            seen.insert(mask[0]);
        }
        // Files spread over the lanes, so over the CPUs.
        assert_eq!(seen.len(), allowed.len(), "{seen:?}");
    }

    #[test]
    fn a_panicking_job_leaves_its_lane_working() {
        let bulk = Bulk::new(1).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bulk.run(1, || panic!("a job's own bug"));
        }));
        // The panic stays on the lane (caught there); the caller just returns.
        assert!(r.is_ok());
        let mut ran = false;
        bulk.run(1, || ran = true);
        assert!(ran, "the lane stopped after a panic");
    }

    #[test]
    fn callers_on_many_threads_all_get_their_jobs_run_once() {
        let bulk = Arc::new(Bulk::new(2).unwrap());
        let count = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (bulk, count) = (bulk.clone(), count.clone());
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        let local = t * 1000 + i;
                        let mut seen = 0;
                        bulk.run(t, || {
                            seen = local;
                            count.fetch_add(1, Ordering::SeqCst);
                        });
                        assert_eq!(seen, local);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(count.load(Ordering::SeqCst), 8 * 200);
    }
}
