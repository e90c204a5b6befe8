//! Where an fsync's time goes for the random workload of seed 003 (fast fsync through the log
//! tree), through the library: 4 KiB writes at random offsets of a file, an fsync after every
//! 16, with the fsync log (the default) and with a full commit per fsync
//! (`RwOptions::fsync_log` off), on an image file in DIR (default /dev/shm, so device time is
//! the page cache's and flushes are nearly free: the numbers are the engine's CPU). Prints the
//! fsync latency p50/p99 and, for the log, how it splits into logging the inode (under the
//! writer lock) and the log commit.
//!
//! `cargo run --release -p butter --example fsync_rand [DIR] [FILE_MIB]`

mod common;

use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::tree_log::write::LogTicket;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn fresh(dir: &Path, fsync_log: bool) -> butter::Result<(PathBuf, Fs)> {
    let opts = butter::fs::RwOptions {
        fsync_log,
        ..Default::default()
    };
    common::fresh_image(dir, "fsync-rand", 1 << 30, opts)
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
            let ticket = fs.log_inode(f)?;
            logging.push(t1.elapsed());
            let t2 = Instant::now();
            match ticket {
                LogTicket::Logged(seq) => fs.sync_log(seq)?,
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

fn main() -> butter::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).map(String::as_str).unwrap_or("/dev/shm"));
    let mib: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(96);
    println!(
        "4 KiB random writes, an fsync every 16, {mib} MiB file, image in {}",
        dir.display()
    );
    for log in [true, false] {
        let (mut all, mut l, mut s) = run(&dir, log, mib)?;
        print!(
            "{}: fsync p50 {:.1} µs, p99 {:.1} µs",
            if log { "log   " } else { "commit" },
            pct(&mut all, 0.5),
            pct(&mut all, 0.99)
        );
        if log {
            print!(
                " (logging the inode p50 {:.1} µs, log commit p50 {:.1} µs)",
                pct(&mut l, 0.5),
                pct(&mut s, 0.5)
            );
        }
        println!();
    }
    Ok(())
}
