//! Reflink through `butter mount`: copy_file_range(2) of sector-aligned ranges clones them
//! (as kernel btrfs does), so copying a large file costs no data space: the kernel, mounting
//! the image afterwards, shows the copy's bytes as shared (`btrfs filesystem du`: nothing
//! exclusive), both files read the same in butter and in the kernel, and both checkers pass;
//! compressed and preallocated extents are shared as they are.
//! Needs root, FUSE, loop devices and btrfs-progs; without them the test prints a notice and
//! passes, unless CI is set.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

const MIB: usize = 1 << 20;

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 4099) as u8).collect()
}

/// copy_file_range of `len` bytes from the start of `src` to the start of `dst`, in as many
/// calls as it takes.
fn copy_range(src: &File, dst: &File, len: usize) {
    let mut done = 0;
    while done < len {
        let (mut off_in, mut off_out) = (done as i64, done as i64);
        // SAFETY: both descriptors are open for the call; the offsets are ours.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                len - done,
                0,
            )
        };
        assert!(
            n > 0,
            "copy_file_range: {}",
            std::io::Error::last_os_error()
        );
        done += n as usize;
    }
}

/// Copies file `name` of the mounted directory `dir` to `copy` with copy_file_range.
fn copy_file(dir: &Path, name: &str, copy: &str) {
    let src = File::open(dir.join(name)).unwrap();
    let dst = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(dir.join(copy))
        .unwrap();
    copy_range(&src, &dst, src.metadata().unwrap().len() as usize);
}

/// Both checkers on `img`, then a kernel mount of it: each (file, bytes) of `files` reads
/// those bytes, and each of `clones` owns nothing exclusive (`btrfs filesystem du`: Total,
/// Exclusive, Set shared, Filename).
fn verify_in_kernel(sc: &ScratchDir, img: &Path, files: &[(&str, &[u8])], clones: &[&str]) {
    let (rc, out) = fuse_mount::butter_check(img);
    assert_eq!(rc, 0, "butter check:\n{out}");
    kernel::assert_btrfs_check(img);
    let m = LoopMount::btrfs(img, &sc.dir("k"), "");
    for (name, want) in files {
        assert!(
            fs::read(m.path().join(name)).unwrap() == *want,
            "the kernel reads {name} differently"
        );
    }
    for name in clones {
        let path = m.path().join(name);
        let du = kernel::sh(
            "btrfs",
            &["filesystem", "du", "--raw", path.to_str().unwrap()],
        );
        let row: Vec<&str> = du
            .lines()
            .last()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(row.get(1), Some(&"0"), "{name} has exclusive bytes:\n{du}");
    }
    m.unmount();
}

#[test]
fn copy_file_range_clones_through_the_mount() {
    if !fuse_mount::require("copy_file_range_clones_through_the_mount", &[]) {
        return;
    }
    let sc = ScratchDir::new("reflink-mount");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, 512 << 20);
    let want = data(16 * MIB + 1234);
    {
        let dir = sc.dir("b");
        let m = ButterMount::start(&img, &dir, &[], &sc.join("b.log"));
        fs::write(dir.join("src"), &want).unwrap();
        File::open(dir.join("src")).unwrap().sync_all().unwrap();
        copy_file(&dir, "src", "copy");
        assert!(
            fs::read(dir.join("copy")).unwrap() == want,
            "the copy reads differently"
        );
        m.unmount();
    }
    verify_in_kernel(&sc, &img, &[("src", &want), ("copy", &want)], &["copy"]);
}

/// Compressed extents (written by the kernel with compress-force) and preallocated ones
/// (fallocate, part written) are shared as they are: the clones read the same in butter and
/// in the kernel, own nothing exclusive, and both checkers pass.
#[test]
fn compressed_and_preallocated_extents_are_shared() {
    if !fuse_mount::require(
        "compressed_and_preallocated_extents_are_shared",
        &["fallocate"],
    ) {
        return;
    }
    let sc = ScratchDir::new("reflink-kinds");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, 512 << 20);
    // Compressible: runs of one byte.
    let z: Vec<u8> = (0..4 * MIB).map(|i| (i / 1000) as u8).collect();
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k0"), "compress-force=zstd");
        let p = m.path();
        fs::write(p.join("z"), &z).unwrap();
        kernel::sh("fallocate", &["-l", "4M", p.join("p").to_str().unwrap()]);
        let f = OpenOptions::new().write(true).open(p.join("p")).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"in the middle", MIB as u64).unwrap();
        drop(f);
        kernel::sync_all();
        m.unmount();
    }
    let mut want_p = vec![0u8; 4 * MIB];
    want_p[MIB..MIB + 13].copy_from_slice(b"in the middle");
    {
        let dir = sc.dir("b");
        let m = ButterMount::start(&img, &dir, &[], &sc.join("b.log"));
        copy_file(&dir, "z", "z2");
        copy_file(&dir, "p", "p2");
        assert!(
            fs::read(dir.join("z2")).unwrap() == z,
            "butter reads z2 differently"
        );
        assert!(
            fs::read(dir.join("p2")).unwrap() == want_p,
            "butter reads p2 differently"
        );
        m.unmount();
    }
    verify_in_kernel(&sc, &img, &[("z2", &z), ("p2", &want_p)], &["z2", "p2"]);
}
