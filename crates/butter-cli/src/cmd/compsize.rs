//! `butter compsize IMAGE [PATH]...`: disk usage against decoded and referenced sizes, per
//! compression type, of the regular files at or below PATHs, printed as compsize prints it.
//! An extent shared by several files (or several times by one) counts once on disk and
//! decoded, and every time in Referenced; a file with several names counts once.

use super::{CliError, CliResult};
use butter::fs::{Fs, Inode};
use std::collections::HashSet;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct CompsizeArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Files and directories inside the image (default: the whole default subvolume).
    pub paths: Vec<std::ffi::OsString>,
    #[command(flatten)]
    pub start: super::paths::Start,
}

#[derive(Default, Clone, Copy)]
struct Sizes {
    disk: u64,
    ram: u64,
    refd: u64,
}

#[derive(Default)]
struct Totals {
    files: u64,
    extents: u64,
    refs: u64,
    inline: u64,
    /// none, zlib, lzo, zstd, prealloc.
    by_type: [Sizes; 5],
    seen_inodes: HashSet<Inode>,
    seen_extents: HashSet<u64>,
}

const TYPES: [&str; 5] = ["none", "zlib", "lzo", "zstd", "prealloc"];

pub fn compsize(a: CompsizeArgs) -> CliResult {
    let fs = super::open_fs(&a.image)?;
    let paths = if a.paths.is_empty() {
        vec!["/".into()]
    } else {
        a.paths.clone()
    };
    let mut t = Totals::default();
    for p in &paths {
        let ino = a.start.resolve(&fs, p)?;
        walk(&fs, ino, &mut t)?;
    }
    if t.files == 0 {
        return Err(CliError("no regular files there".into()));
    }
    println!(
        "Processed {} file{}, {} regular extents ({} refs), {} inline.",
        t.files,
        if t.files == 1 { "" } else { "s" },
        t.extents,
        t.refs,
        t.inline
    );
    println!("Type       Perc     Disk Usage   Uncompressed Referenced  ");
    let mut total = Sizes::default();
    for s in &t.by_type {
        total.disk += s.disk;
        total.ram += s.ram;
        total.refd += s.refd;
    }
    row("TOTAL", total);
    for (name, s) in TYPES.iter().zip(t.by_type) {
        if s.ram > 0 || s.disk > 0 {
            row(name, s);
        }
    }
    Ok(())
}

fn row(name: &str, s: Sizes) {
    let perc = (s.disk * 100).checked_div(s.ram).unwrap_or(0);
    println!(
        "{name:<10} {perc:>3}% {:>9} {:>12} {:>12}       ",
        human(s.disk),
        human(s.ram),
        human(s.refd)
    );
}

/// compsize's sizes: B below a KiB, one decimal below 10 of a unit, whole units above; cut,
/// not rounded.
fn human(n: u64) -> String {
    const UNITS: [&str; 7] = ["B", "K", "M", "G", "T", "P", "E"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else if v < 10.0 {
        format!("{:.1}{}", (v * 10.0).floor() / 10.0, UNITS[u])
    } else {
        format!("{}{}", v as u64, UNITS[u])
    }
}

fn walk(fs: &Fs, ino: Inode, t: &mut Totals) -> CliResult {
    let st = fs.stat(ino)?;
    if st.is_dir() {
        let mut after = 0;
        loop {
            let batch = fs.readdir(ino, after, 512)?;
            let Some(last) = batch.last() else {
                break;
            };
            after = last.index;
            for e in batch {
                // Subvolumes below are walked too, as compsize crosses them.
                walk(fs, e.target, t)?;
            }
        }
        return Ok(());
    }
    if !st.is_reg() || !t.seen_inodes.insert(ino) {
        return Ok(());
    }
    t.files += 1;
    for e in fs.extent_usage(ino)? {
        let ty = if e.prealloc {
            4
        } else {
            usize::from(e.compression.min(3))
        };
        let s = &mut t.by_type[ty];
        if e.inline {
            t.inline += 1;
            s.disk += e.disk_bytes;
            s.ram += e.ram_bytes;
            s.refd += e.referenced;
            continue;
        }
        t.refs += 1;
        s.refd += e.referenced;
        if t.seen_extents.insert(e.disk_bytenr) {
            t.extents += 1;
            s.disk += e.disk_bytes;
            s.ram += e.ram_bytes;
        }
    }
    Ok(())
}
