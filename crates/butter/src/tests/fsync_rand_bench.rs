//! Where an fsync's time goes for the random workload of seed 003 (fast fsync through the log
//! tree), through the library: 4 KiB writes at random offsets of a file, an fsync after every
//! 16, with the fsync log (the default) and with a full commit per fsync
//! (`RwOptions::fsync_log` off), on an image file in DIR (default /dev/shm, so device time is
//! the page cache's and flushes are nearly free: the numbers are the engine's CPU). Prints the
//! fsync latency p50/p99 and, for the log, how it splits into logging the inode (under the
//! writer lock) and the log commit.
//!
//! A benchmark, not a test: ignored by the suite, run by `bench/fsync_rand`, or with
//! `cargo test --release -p butter --lib fsync_rand_bench -- --ignored --nocapture`
//! (`BUTTER_BENCH_DIR`, default /dev/shm; `BUTTER_BENCH_FILE_MIB`, default 96; the report
//! goes to the file `BUTTER_BENCH_OUT` names, else to stdout). It lives inside the crate
//! because it times the log's two phases, which are crate-private.

use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::io::device::FileDevice;
use butter::tree_log::write::LogTicket;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A fresh 1 GiB image file in `dir` (fixed fsid and time), opened read-write.
fn fresh(dir: &Path, fsync_log: bool) -> butter::Result<(PathBuf, Fs)> {
    let path = dir.join(format!("butter-fsync-rand-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let io = |e: std::io::Error| butter::Error::Invalid(format!("{}: {e}", path.display()));
    let size = 1u64 << 30;
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(size))
        .map_err(io)?;
    let dev = Arc::new(FileDevice::open(&path, true).map_err(io)?);
    let opts = butter::mkfs::MkfsOptions {
        size,
        fsid: Some([7; 16]),
        time: Some(1_700_000_000),
        ..Default::default()
    };
    butter::mkfs::mkfs(dev.as_ref(), &opts)?;
    let rw = butter::fs::RwOptions {
        fsync_log,
        ..Default::default()
    };
    Ok((path, Fs::open_device_rw_with(dev, rw)?))
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    v[((v.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6
}

/// (fsync, log_inode, sync_log) latencies of one run.
type Times = (Vec<Duration>, Vec<Duration>, Vec<Duration>);

fn run(dir: &Path, log: bool, file_mib: u64) -> butter::Result<Times> {
    let (path, fs) = fresh(dir, log)?;
    let f = fs.create(fs.root_inode(), b"f", 0o644, Owner::default())?;
    let blocks = file_mib * 256;
    fs.truncate(f, blocks * 4096)?;
    fs.commit()?;
    let mut seed = 42u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let data = vec![0x5au8; 4096];
    let (mut all, mut logging, mut syncing) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..blocks / 16 {
        for _ in 0..16 {
            fs.write(f, (next() % blocks) * 4096, &data)?;
        }
        let t = Instant::now();
        if log {
            let t1 = Instant::now();
            let ticket = fs.core().log_inode(f)?;
            logging.push(t1.elapsed());
            let t2 = Instant::now();
            match ticket {
                LogTicket::Logged(seq) => fs.core().sync_log(seq)?,
                LogTicket::Commit => fs.commit()?,
                LogTicket::Durable => {}
            }
            syncing.push(t2.elapsed());
        } else {
            fs.fsync(f, false)?;
        }
        all.push(t.elapsed());
    }
    drop(fs);
    let _ = std::fs::remove_file(path);
    Ok((all, logging, syncing))
}

#[test]
#[ignore = "a benchmark: run on demand (see the module documentation)"]
fn fsync_rand_bench() {
    use std::fmt::Write;
    let dir = PathBuf::from(std::env::var("BUTTER_BENCH_DIR").unwrap_or("/dev/shm".into()));
    let mib: u64 = std::env::var("BUTTER_BENCH_FILE_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(96);
    let mut out = format!(
        "4 KiB random writes, an fsync every 16, {mib} MiB file, image in {}\n",
        dir.display()
    );
    for log in [true, false] {
        let (mut all, mut l, mut s) = run(&dir, log, mib).unwrap();
        let _ = write!(
            out,
            "{}: fsync p50 {:.1} µs, p99 {:.1} µs",
            if log { "log   " } else { "commit" },
            pct(&mut all, 0.5),
            pct(&mut all, 0.99)
        );
        if log {
            let _ = write!(
                out,
                " (logging the inode p50 {:.1} µs, log commit p50 {:.1} µs)",
                pct(&mut l, 0.5),
                pct(&mut s, 0.5)
            );
        }
        out.push('\n');
    }
    match std::env::var_os("BUTTER_BENCH_OUT") {
        Some(path) => std::fs::write(path, out).unwrap(),
        None => print!("{out}"),
    }
}
