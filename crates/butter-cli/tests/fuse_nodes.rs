//! The bound on the nodes the kernel holds (crate::fuse::prune): past `cache_size / 4 KiB`
//! nodes (at least 1,024), butter asks the kernel to drop the ones nothing uses, so its
//! memory for them does not grow with the files touched.
//!
//! - 8,000 files made and looked up with `-o cache_size=1M` (a bound of 1,024): the kernel
//!   held far fewer of them at once than it does without the bound (the log's count), and
//!   butter asked it to drop some.
//! - What the kernel cannot drop stays right: a file unlinked while open is still read
//!   whole through its descriptor after all that, and a working directory's names still
//!   resolve; every file reads back what was written.
//! - The image then passes `butter check` and `btrfs check`, and the kernel shows the same
//!   tree as the mount did.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs and fusermount3. Without
//! them it prints a notice and passes, unless CI is set: then it fails.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::ScratchDir;
use common::manifest::{self, TakeOpts};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

const IMAGE_SIZE: u64 = 512 << 20;
const FILES: usize = 8000;
const DIRS: usize = 8;

fn content(i: usize) -> Vec<u8> {
    format!("file {i} {}\n", "x".repeat(i % 300)).into_bytes()
}

/// Makes FILES files over DIRS directories, then looks every one up again (a stat and a
/// read), checking what it reads.
fn churn(root: &Path) {
    for d in 0..DIRS {
        fs::create_dir_all(root.join(format!("d{d}"))).unwrap();
    }
    let path = |i: usize| root.join(format!("d{}/f{i:05}", i % DIRS));
    for i in 0..FILES {
        fs::write(path(i), content(i)).unwrap();
    }
    for i in 0..FILES {
        let got = fs::read(path(i)).unwrap();
        assert_eq!(got, content(i), "{}", path(i).display());
    }
}

/// "nodes the kernel held: at most N (bound B); A asked ..." from butter's log.
fn held_counts(log: &str) -> (usize, usize, u64) {
    let line = log
        .lines()
        .find(|l| l.contains("nodes the kernel held: at most"))
        .unwrap_or_else(|| panic!("no count of held nodes in butter's log:\n{log}"));
    let num_after = |key: &str| {
        fuse_mount::number_after(line, key)
            .unwrap_or_else(|| panic!("a number after {key:?} in {line}"))
    };
    (
        num_after("at most") as usize,
        num_after("(bound") as usize,
        num_after(");"),
    )
}

#[test]
fn the_kernel_holds_about_as_many_nodes_as_the_bound() {
    if !fuse_mount::require("fuse_nodes", &[]) {
        return;
    }
    let sc = ScratchDir::new("fuse-nodes");
    let mut peaks = Vec::new();
    for (run, opts) in [(0, "cache_size=1M"), (1, "cache_size=512M")] {
        let img = sc.join(format!("b{run}.img"));
        fuse_mount::fresh_image(&img, IMAGE_SIZE);
        let mnt = sc.dir(format!("m{run}"));
        let log = sc.join(format!("b{run}.log"));
        let bm = ButterMount::start_env(&img, &mnt, &["-o", opts], &log, &[("RUST_LOG", "info")]);
        // An unlinked file held open, and a working directory: the kernel cannot drop them.
        let held_path = mnt.join("held");
        let mut held = fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&held_path)
            .unwrap();
        let want: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        held.write_all(&want).unwrap();
        fs::remove_file(&held_path).unwrap();
        fs::create_dir(mnt.join("cwd")).unwrap();
        fs::write(mnt.join("cwd/kept"), b"kept").unwrap();
        let cwd = fs::File::open(mnt.join("cwd")).unwrap();

        churn(bm.path());

        let mut got = Vec::new();
        held.seek(SeekFrom::Start(0)).unwrap();
        held.read_to_end(&mut got).unwrap();
        assert!(got == want, "{opts}: the unlinked open file changed");
        drop(held);
        assert_eq!(fs::read(mnt.join("cwd/kept")).unwrap(), b"kept");
        drop(cwd);
        let before = manifest::take(bm.path(), &TakeOpts::default());
        bm.unmount();
        let text = fs::read_to_string(&log).unwrap();
        let (peak, bound, asked) = held_counts(&text);
        peaks.push((peak, bound, asked));
        fuse_mount::verify_image(&img, &sc.dir(format!("k{run}")), Some(&before), opts);
    }
    let (small, large) = (peaks[0], peaks[1]);
    eprintln!("(peak, bound, asked): with cache_size=1M {small:?}, with 512M {large:?}");
    assert_eq!(small.1, 1024, "the bound of cache_size=1M: {small:?}");
    assert!(
        small.2 > 0,
        "nothing asked to be dropped under the bound: {small:?}"
    );
    // Without the bound's rounds the kernel keeps every file it looked up (the 512M run:
    // a bound of 131,072 that 8,000 files never reach).
    assert_eq!(
        large.2, 0,
        "asked to drop nodes under a bound never reached: {large:?}"
    );
    assert!(
        large.0 >= FILES,
        "the kernel kept fewer than the {FILES} files it looked up without a bound: {large:?}"
    );
    assert!(
        small.0 <= FILES / 2,
        "with a bound of 1,024 the kernel held {} nodes at once (without: {})",
        small.0,
        large.0
    );
}
