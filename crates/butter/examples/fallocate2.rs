//! will-it-scale's fallocate2, for seed 001's allocator: each worker has a file of its own; it
//! appends 8 KiB with fallocate until the file is 1 MiB, truncates it to 0, and repeats. One
//! fallocate is one operation.
//!
//! Through the library (an image file, each operation through the gate: `Fs::gated_fallocate`
//! and `Fs::gated_truncate`, which serve fallocates at a file's end in memory), or on a mounted filesystem (butter's mount, the kernel's btrfs, ext4):
//!
//! ```text
//! cargo run --release -p butter --example fallocate2 -- lib IMAGE_DIR WORKERS SECONDS [scalable|legacy]
//! cargo run --release -p butter --example fallocate2 -- dir MOUNTED_DIR WORKERS SECONDS
//! ```
//!
//! Prints one line of `key=value` pairs: ops, seconds, ops_per_s, and in library mode the
//! allocator's counters (allocations, try-lock misses, blocking waits, groups visited, goal
//! hits) over the run.

#[path = "common/mod.rs"]
mod common;

use butter::fs::{Fs, RwOptions};
use butter::inode::namespace::Owner;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FILESIZE: u64 = 1 << 20;

#[derive(Default)]
#[repr(align(64))]
struct Padded(AtomicU64);
const BUFLEN: u64 = FILESIZE / 128;

fn usage() -> ! {
    eprintln!(
        "usage: fallocate2 lib IMAGE_DIR WORKERS SECONDS [scalable|legacy]\n       \
         fallocate2 dir MOUNTED_DIR WORKERS SECONDS"
    );
    std::process::exit(2)
}

/// Runs `workers` threads of `op(worker, offset_or_truncate)` for `secs`, after one warm-up
/// round each; returns (operations, seconds).
fn drive(
    workers: usize,
    secs: f64,
    op: impl Fn(usize, Option<u64>) -> std::io::Result<()> + Send + Sync + 'static,
) -> (u64, f64) {
    let op = Arc::new(op);
    let stop = Arc::new(AtomicBool::new(false));
    // A counter per worker, each on a cache line of its own (as will-it-scale keeps one per
    // task): a shared one would be the most contended line of the benchmark.
    let counts: Arc<Vec<Padded>> = Arc::new((0..workers).map(|_| Padded::default()).collect());
    let start = Arc::new(std::sync::Barrier::new(workers + 1));
    let hs: Vec<_> = (0..workers)
        .map(|w| {
            let (op, stop, counts, start) =
                (op.clone(), stop.clone(), counts.clone(), start.clone());
            std::thread::spawn(move || {
                let round = |counted: bool| {
                    let mut off = 0;
                    while off < FILESIZE {
                        op(w, Some(off)).unwrap_or_else(|e| panic!("fallocate at {off}: {e}"));
                        if counted {
                            let c = &counts[w].0;
                            c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                        }
                        off += BUFLEN;
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                    }
                    op(w, None).unwrap_or_else(|e| panic!("truncate: {e}"));
                };
                round(false);
                start.wait();
                while !stop.load(Ordering::Relaxed) {
                    round(true);
                }
            })
        })
        .collect();
    start.wait();
    let t = Instant::now();
    let total = || {
        counts
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let c0 = total();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let c1 = total();
    let el = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().expect("worker");
    }
    (c1 - c0, el)
}

fn on_dir(dir: &Path, workers: usize, secs: f64) {
    use std::os::fd::AsRawFd;
    let files: Vec<std::fs::File> = (0..workers)
        .map(|w| {
            let p = dir.join(format!("fallocate2-{w}"));
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        })
        .collect();
    let files = Arc::new(files);
    let (ops, el) = drive(workers, secs, move |w, what| {
        let fd = files[w].as_raw_fd();
        let r = match what {
            // SAFETY: plain syscalls on a file descriptor this process owns.
            Some(off) => unsafe { libc::fallocate(fd, 0, off as i64, BUFLEN as i64) },
            None => unsafe { libc::ftruncate(fd, 0) },
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    });
    for w in 0..workers {
        let _ = std::fs::remove_file(dir.join(format!("fallocate2-{w}")));
    }
    println!(
        "workers={workers} ops={ops} seconds={el:.2} ops_per_s={:.0}",
        ops as f64 / el
    );
}

fn on_library(dir: &Path, workers: usize, secs: f64, legacy: bool) -> butter::Result<()> {
    let rw = RwOptions {
        legacy_allocator: legacy,
        ..Default::default()
    };
    let (path, fs) = common::fresh_image(dir, "fallocate2", 4 << 30, rw)?;
    let fs = Arc::new(fs);
    fs.start_committer(Duration::from_secs(30))
        .map_err(|e| butter::Error::Invalid(format!("committer: {e}")))?;
    let root = fs.root_inode();
    let mut files = Vec::new();
    for w in 0..workers {
        files.push(fs.create(
            root,
            format!("fallocate2-{w}").as_bytes(),
            0o644,
            Owner::default(),
        )?);
    }
    fs.commit()?;
    let s0 = fs.stats()?.alloc;
    let f2 = fs.clone();
    let (ops, el) = drive(workers, secs, move |w, what| {
        let ino = files[w];
        match what {
            Some(off) => f2.fallocate(ino, 0, off, BUFLEN),
            None => f2.truncate(ino, 0),
        }
        .map_err(std::io::Error::other)
    });
    let end = fs.stats()?;
    let s = end.alloc.since(&s0);
    let o = end.ordered;
    fs.close()?;
    drop(fs);
    let dev = Arc::new(
        butter::io::device::FileDevice::open(&path, false)
            .map_err(|e| butter::Error::Invalid(format!("{}: {e}", path.display())))?,
    );
    let ro = Fs::open_device(dev)?;
    let report = ro.check(Default::default(), &mut |_| {})?;
    let _ = std::fs::remove_file(&path);
    if !report.is_clean() {
        return Err(butter::Error::Invalid(format!(
            "butter check after the benchmark: {:?}",
            report.findings
        )));
    }
    let per = |x: u64| x as f64 / s.allocations.max(1) as f64;
    println!(
        "workers={workers} allocator={} ops={ops} seconds={el:.2} ops_per_s={:.0} \
         allocations={} trylock_misses={} blocking_waits={} waits_per_alloc={:.4} \
         groups_visited_per_alloc={:.2} goal_hits={} goal_hit_rate={:.3} \
         in_memory={} completions={}",
        if legacy { "legacy" } else { "scalable" },
        ops as f64 / el,
        s.allocations,
        s.trylock_misses,
        s.blocking_waits,
        per(s.blocking_waits),
        per(s.groups_visited),
        s.goal_hits,
        per(s.goal_hits),
        o.preallocs_in_memory,
        o.preallocs_completed,
    );
    Ok(())
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 4 {
        usage();
    }
    let dir = Path::new(&a[1]);
    let workers: usize = a[2].parse().unwrap_or_else(|_| usage());
    let secs: f64 = a[3].parse().unwrap_or_else(|_| usage());
    match a[0].as_str() {
        "dir" => on_dir(dir, workers, secs),
        "lib" => {
            let legacy = match a.get(4).map(String::as_str) {
                None | Some("scalable") => false,
                Some("legacy") => true,
                Some(_) => usage(),
            };
            if let Err(e) = on_library(dir, workers, secs, legacy) {
                eprintln!("fallocate2: {e}");
                std::process::exit(1);
            }
        }
        _ => usage(),
    }
}
