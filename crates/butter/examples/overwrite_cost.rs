//! Time per random 4 KiB overwrite through the library (no FUSE), with a commit every 1000
//! writes: the engine's share of a FUSE random-write workload.
//!
//! `cargo run --release --example overwrite_cost -- IMAGE [WRITES]` on a scratch image made by
//! `butter mkfs` or mkfs.btrfs (its content is changed).
use butter::fs::Fs;
use butter::inode::namespace::Owner;
use std::time::Instant;

fn main() -> butter::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: overwrite_cost IMAGE [WRITES]");
    let n: u64 = args
        .next()
        .map(|s| s.parse().expect("WRITES"))
        .unwrap_or(20_000);
    let fs = Fs::open_rw(std::path::Path::new(&path))?;
    let root = fs.root_inode();
    let f = fs.create(root, b"overwrite_cost", 0o644, Owner::default())?;
    let size: u64 = 64 << 20;
    let chunk = vec![0x5au8; 1 << 20];
    for i in 0..size >> 20 {
        fs.write(f, i << 20, &chunk)?;
    }
    fs.commit()?;
    let buf = vec![0xa5u8; 4096];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let t = Instant::now();
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = (x % (size / 4096)) * 4096;
        fs.write(f, off, &buf)?;
        if i % 1000 == 999 {
            fs.commit()?;
        }
    }
    fs.commit()?;
    let el = t.elapsed();
    println!(
        "{n} random 4 KiB overwrites: {:.2} s, {:.1} us each, {:.0} per second",
        el.as_secs_f64(),
        el.as_secs_f64() * 1e6 / n as f64,
        n as f64 / el.as_secs_f64()
    );
    Ok(())
}
