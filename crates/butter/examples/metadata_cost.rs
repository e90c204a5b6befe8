//! Time per create, stat and unlink of small files through the library (no FUSE), with a
//! commit every 5000 operations: the engine's share of a metadata-heavy FUSE workload.
//!
//! `cargo run --release --example metadata_cost -- IMAGE [FILES]` on a scratch image.
use butter::fs::Fs;
use butter::inode::namespace::Owner;
use std::time::Instant;

fn main() -> butter::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: metadata_cost IMAGE [FILES]");
    let n: u64 = args
        .next()
        .map(|s| s.parse().expect("FILES"))
        .unwrap_or(100_000);
    let fs = Fs::open_rw(std::path::Path::new(&path))?;
    let root = fs.root_inode();
    let d = fs.mkdir(root, b"m", 0o755, Owner::default())?;
    let data = vec![7u8; 1000];
    let name = |i: u64| format!("file-{i:08}").into_bytes();
    let t = Instant::now();
    for i in 0..n {
        let f = fs.create(d, &name(i), 0o644, Owner::default())?;
        fs.write(f, 0, &data)?;
        if i % 5000 == 4999 {
            fs.commit()?;
        }
    }
    fs.commit()?;
    let create = t.elapsed();
    let t = Instant::now();
    for i in 0..n {
        let e = fs.lookup(d, &name(i))?.expect("created file");
        fs.stat(e.target)?;
    }
    let stat = t.elapsed();
    let t = Instant::now();
    for i in 0..n {
        fs.unlink(d, &name(i))?;
        if i % 5000 == 4999 {
            fs.commit()?;
        }
    }
    fs.commit()?;
    let unlink = t.elapsed();
    for (what, el) in [
        ("create+write 1000 B", create),
        ("lookup+stat", stat),
        ("unlink", unlink),
    ] {
        println!(
            "{what}: {n} in {:.2} s, {:.1} us each",
            el.as_secs_f64(),
            el.as_secs_f64() * 1e6 / n as f64
        );
    }
    Ok(())
}
