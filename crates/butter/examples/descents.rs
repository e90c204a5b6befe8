//! Seed 002's benchmark: B-tree descents per file overwrite, with and without the combined
//! "drop old file extent items and insert the new one in one descent" path.
//!
//! A file is written as 2048 separate 4 KiB extents (so its extent items fill many leaves), then
//! overwritten at seeded random places: aligned 4 KiB writes (replace one item) and unaligned
//! 8 KiB writes (trim two items, drop the ones between). Descents are counted by the write
//! engine (`Fs::descents`: every root-to-leaf search, restarts included). Everything runs on
//! an in-memory device, so the times are the engine's CPU cost.
//!
//! `cargo run --release -p butter --example descents [OVERWRITES]`

use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::internals::RamDevice;
use std::sync::Arc;
use std::time::Instant;

fn run(combined: bool, overwrites: u64, unaligned: bool) -> butter::Result<(f64, f64, f64)> {
    // (replace descents per op, all descents per op, µs per op)
    let dev = Arc::new(RamDevice::new(vec![0u8; 512 << 20]));
    let opts = butter::mkfs::MkfsOptions {
        size: 512 << 20,
        fsid: Some([7; 16]),
        time: Some(1_700_000_000),
        ..Default::default()
    };
    butter::mkfs::mkfs(dev.as_ref(), &opts)?;
    let opts = butter::fs::RwOptions {
        combined_replace: combined,
        ..Default::default()
    };
    let fs = Fs::open_device_rw_with(dev.clone(), opts)?;
    let f = fs.create(fs.root_inode(), b"f", 0o644, Owner::default())?;
    let block = vec![0x5au8; 4096];
    for i in 0..2048u64 {
        fs.write(f, i * 4096, &block)?;
    }
    fs.commit()?;
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (d0, r0) = fs.stats()?.descents;
    let t = Instant::now();
    let data = vec![0xa5u8; 8192];
    for i in 0..overwrites {
        if unaligned {
            let off = (rnd() % 2046) * 4096 + 2048;
            fs.write(f, off, &data)?;
        } else {
            let off = (rnd() % 2048) * 4096;
            fs.write(f, off, &data[..4096])?;
        }
        if i % 256 == 255 {
            fs.commit()?;
        }
    }
    fs.commit()?;
    let secs = t.elapsed().as_secs_f64();
    let (d, rd) = {
        let (d, r) = fs.stats()?.descents;
        (d - d0, r - r0)
    };
    drop(fs);
    let fs = Fs::open_device(dev)?;
    let report = fs.check(Default::default(), &mut |_| {})?;
    assert!(
        report.is_clean(),
        "butter check after the benchmark: {:?}",
        report.findings
    );
    Ok((
        rd as f64 / overwrites as f64,
        d as f64 / overwrites as f64,
        secs * 1e6 / overwrites as f64,
    ))
}

fn main() -> butter::Result<()> {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4000);
    println!("{n} overwrites of a file of 2048 extents; descents per overwrite, combined path vs one search per changed item");
    println!();
    println!("| overwrite | extent-replace descents: combined | separate | ratio | all descents: combined | separate | µs/op combined | separate |");
    println!("|---|---|---|---|---|---|---|---|");
    for (name, unaligned) in [("4 KiB aligned", false), ("8 KiB unaligned", true)] {
        let (rc, dc, tc) = run(true, n, unaligned)?;
        let (rs, ds, ts) = run(false, n, unaligned)?;
        println!(
            "| {name} | {rc:.2} | {rs:.2} | {:.2}x | {dc:.2} | {ds:.2} | {tc:.1} | {ts:.1} |",
            rs / rc
        );
    }
    Ok(())
}
