//! Ordered extents' benchmark: file writes with the data written without the writer lock
//! (ordered extents, the default) against the data written under it (`RwOptions::unlocked_writeback`
//! off, as before ordered extents), on an image file.
//!
//! Workloads, each on a fresh image:
//! - `T threads, 1 MiB writes`: T threads each write their own file in 1 MiB writes;
//! - `... + fsync`: the same with an fsync after every write (the log tree);
//! - `creates beside a writer`: one thread streams 8 MiB writes while another creates 2000
//!   files, 200 µs apart; the creates' latency shows how long other operations wait for the
//!   writer lock;
//! - delayed allocation on and off: 4 KiB and 64 KiB appends from 1 and 4 threads, with and
//!   without an fsync every 16 appends;
//! - `fsync beside a writer`: one thread writes a file 8 MiB at a time while another writes
//!   4 KiB past that range and fsyncs the file every 2 ms, with seed 003's rule (the fsync
//!   does not wait for the writes in progress, the default) and without it (it waits for
//!   them first, as the kernel did before the rule).
//!
//! The image lives in DIR (default: /dev/shm, else the temp dir), so device time is the page
//! cache's; the numbers are the engine's and the lock's.
//!
//! `cargo run --release -p butter --example ordered_writes [DIR] [MIB_PER_RUN]`

mod common;

use butter::fs::{Fs, RwOptions};
use butter::inode::namespace::Owner;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RUNS: usize = 3;

fn fresh(dir: &Path, opts: RwOptions) -> butter::Result<(PathBuf, Arc<Fs>)> {
    let (path, fs) = common::fresh_image(dir, "ordered-bench", 2 << 30, opts)?;
    Ok((path, Arc::new(fs)))
}

/// One stream workload: `threads` writers, each appending to its own file in `bs`-byte
/// writes, `mib` MiB in all, with an fsync every `fsync_every` writes (0: none).
struct Streams {
    threads: u64,
    mib: u64,
    bs: usize,
    fsync_every: u64,
}

/// MiB/s of a [`Streams`] workload, and the delayed-allocation buffers written back.
fn streams(dir: &Path, unlocked: bool, delalloc: bool, s: &Streams) -> butter::Result<(f64, u64)> {
    let opts = RwOptions {
        unlocked_writeback: unlocked,
        delayed_allocation: delalloc,
        ..Default::default()
    };
    let (path, fs) = fresh(dir, opts)?;
    let root = fs.root_inode();
    let Streams {
        threads,
        mib,
        bs,
        fsync_every,
    } = *s;
    let per = (mib << 20) / bs as u64 / threads;
    let t = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let fs = fs.clone();
            std::thread::spawn(move || -> butter::Result<()> {
                let f = fs.create(root, format!("f{i}").as_bytes(), 0o644, Owner::default())?;
                let buf = vec![i as u8 + 1; bs];
                for k in 0..per {
                    fs.write(f, k * bs as u64, &buf)?;
                    if fsync_every > 0 && (k + 1) % fsync_every == 0 {
                        fs.fsync(f, false)?;
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer thread")?;
    }
    let secs = t.elapsed().as_secs_f64();
    fs.commit()?;
    let flushed = fs.stats()?.ordered.delalloc_flushed;
    drop(fs);
    let _ = std::fs::remove_file(path);
    Ok((
        (per * threads * bs as u64) as f64 / (1 << 20) as f64 / secs,
        flushed,
    ))
}

/// Runs `measure` (which returns latencies in µs) while another thread writes the file
/// `stream` 8 MiB at a time over its first `mib` MiB; (p50, p99) of the latencies. `unlocked`
/// and `rule` set the filesystem up (`RwOptions::unlocked_writeback` and `fsync_skips_writes_in_progress`).
fn beside_stream(
    dir: &Path,
    unlocked: bool,
    rule: bool,
    mib: u64,
    measure: impl FnOnce(&Fs, butter::fs::Inode) -> butter::Result<Vec<f64>>,
) -> butter::Result<(f64, f64)> {
    let opts = RwOptions {
        unlocked_writeback: unlocked,
        fsync_skips_writes_in_progress: rule,
        ..Default::default()
    };
    let (path, fs) = fresh(dir, opts)?;
    let f = fs.create(fs.root_inode(), b"stream", 0o644, Owner::default())?;
    fs.commit()?;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (fs, stop) = (fs.clone(), stop.clone());
        std::thread::spawn(move || -> butter::Result<()> {
            let buf = vec![9u8; 8 << 20];
            let mut off = 0u64;
            while !stop.load(Ordering::Relaxed) {
                fs.write(f, off % (mib << 20), &buf)?;
                off += 8 << 20;
            }
            Ok(())
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let lat = measure(&fs, f);
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer thread")?;
    let mut lat = lat?;
    fs.commit()?;
    drop(fs);
    let _ = std::fs::remove_file(path);
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok((lat[lat.len() / 2], lat[lat.len() * 99 / 100]))
}

/// (p50, p99) of file creates in µs, 200 µs apart, beside an 8 MiB-write stream.
fn creates_beside_writer(dir: &Path, unlocked: bool, mib: u64) -> butter::Result<(f64, f64)> {
    beside_stream(dir, unlocked, true, mib, |fs, _| {
        let d = fs.mkdir(fs.root_inode(), b"d", 0o755, Owner::default())?;
        let mut lat = Vec::new();
        for i in 0..2000u32 {
            let t = Instant::now();
            fs.create(d, format!("n{i}").as_bytes(), 0o644, Owner::default())?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            // Spread over the stream's writes rather than between two of them.
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(lat)
    })
}

/// (p50, p99) in µs of fsyncs of the stream's file: every 2 ms a 4 KiB write past the
/// stream's range, then an fsync. `rule`: the fsync rule that skips writes in progress (the
/// fsync does not wait for them).
fn fsync_beside_writer(dir: &Path, rule: bool, mib: u64) -> butter::Result<(f64, f64)> {
    beside_stream(dir, true, rule, mib, |fs, f| {
        let mut lat = Vec::new();
        for i in 0..300u64 {
            fs.write(f, (mib << 20) + (i % 64) * 4096, &[i as u8; 4096])?;
            let t = Instant::now();
            fs.fsync(f, false)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(lat)
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> butter::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().map(PathBuf::from).unwrap_or_else(|| {
        let shm = PathBuf::from("/dev/shm");
        if shm.is_dir() {
            shm
        } else {
            std::env::temp_dir()
        }
    });
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    println!(
        "Ordered extents: data written without the writer lock (unlocked) vs under it (locked). \
         Image in {}, {mib} MiB per run, median of {RUNS} runs.\n",
        dir.display()
    );
    println!("| workload | unlocked | locked | unlocked/locked |");
    println!("|---|---:|---:|---:|");
    for fsync in [false, true] {
        for threads in [1u64, 2, 4] {
            let mib = if fsync { mib / 4 } else { mib };
            let mut u = Vec::new();
            let mut l = Vec::new();
            let s = Streams {
                threads,
                mib,
                bs: 1 << 20,
                fsync_every: u64::from(fsync),
            };
            for _ in 0..RUNS {
                u.push(streams(&dir, true, true, &s)?.0);
                l.push(streams(&dir, false, true, &s)?.0);
            }
            let (u, l) = (median(u), median(l));
            println!(
                "| {threads} thread{}, 1 MiB writes{} | {u:.0} MiB/s | {l:.0} MiB/s | {:.2}x |",
                if threads == 1 { "" } else { "s" },
                if fsync { " + fsync" } else { "" },
                u / l
            );
        }
    }
    let mut u = Vec::new();
    let mut l = Vec::new();
    for _ in 0..RUNS {
        u.push(creates_beside_writer(&dir, true, mib)?);
        l.push(creates_beside_writer(&dir, false, mib)?);
    }
    let p = |v: &[(f64, f64)], i: usize| {
        median(v.iter().map(|x| if i == 0 { x.0 } else { x.1 }).collect())
    };
    for (i, name) in ["p50", "p99"].iter().enumerate() {
        let (a, b) = (p(&u, i), p(&l, i));
        println!(
            "| file create {name} beside an 8 MiB-write stream (lower is better) | {a:.1} µs | {b:.1} µs | {:.2}x |",
            a / b
        );
    }
    println!(
        "\nThe fsync rule that skips writes in progress: an fsync does not wait for the file's \
         writes in progress (with) or waits for them first (without).\n"
    );
    println!("| workload | with the rule | without | with/without |");
    println!("|---|---:|---:|---:|");
    let mut u = Vec::new();
    let mut l = Vec::new();
    for _ in 0..RUNS {
        u.push(fsync_beside_writer(&dir, true, mib)?);
        l.push(fsync_beside_writer(&dir, false, mib)?);
    }
    for (i, name) in ["p50", "p99"].iter().enumerate() {
        let (a, b) = (p(&u, i), p(&l, i));
        println!(
            "| fsync {name} of a file another thread writes 8 MiB at a time (lower is better) | {a:.1} µs | {b:.1} µs | {:.2}x |",
            a / b
        );
    }
    println!(
        "\nDelayed allocation: appends gather in memory and go to the device as one extent per \
         buffer (on) or are allocated and written one by one (off).\n"
    );
    println!("| workload | on | off | on/off | buffers written back (on) |");
    println!("|---|---:|---:|---:|---:|");
    for (threads, bs, fsync_every, part) in [
        (1u64, 4096usize, 0u64, 8u64),
        (1, 64 << 10, 0, 2),
        (4, 64 << 10, 0, 2),
        (1, 64 << 10, 16, 8),
        (4, 64 << 10, 16, 8),
    ] {
        let s = Streams {
            threads,
            mib: mib / part,
            bs,
            fsync_every,
        };
        let mut on = Vec::new();
        let mut off = Vec::new();
        let mut flushed = 0;
        for _ in 0..RUNS {
            let (t, f) = streams(&dir, true, true, &s)?;
            on.push(t);
            flushed = f;
            off.push(streams(&dir, true, false, &s)?.0);
        }
        let (a, b) = (median(on), median(off));
        println!(
            "| {threads} thread{}, {} KiB appends{}, {} MiB | {a:.0} MiB/s | {b:.0} MiB/s | {:.2}x | {flushed} |",
            if threads == 1 { "" } else { "s" },
            bs >> 10,
            if fsync_every > 0 {
                format!(" + fsync every {fsync_every}")
            } else {
                String::new()
            },
            s.mib,
            a / b
        );
    }
    Ok(())
}
