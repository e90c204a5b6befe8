//! The oracle suite: for every mkfs.btrfs variant, an image filled through a kernel mount by
//! the seeded generator must look exactly the same through `butter restore` and through
//! `butter mount --ro` as through the kernel's own read-only mount: names, types, modes,
//! owners, sizes, times, xattrs, link targets, hardlinks and content hashes.
//!
//! Needs root, loop devices and FUSE; fails (does not skip) without them when CI is set.

mod common;

use common::gen::{Scale, BIG_DIR};
use common::kernel::{is_mountpoint, require_privileges, LoopMount, ScratchDir, TmpfsMount};
use common::manifest::{assert_same, take, CompareOpts, TakeOpts};
use common::variant::{build_variant_image_with, kernel_manifest, variant};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");

/// A `butter mount --ro` child process, unmounted and reaped on drop.
struct ButterMount<'a> {
    child: Option<Child>,
    dir: &'a Path,
}

impl<'a> ButterMount<'a> {
    fn start(img: &Path, dir: &'a Path) -> ButterMount<'a> {
        std::fs::create_dir_all(dir).unwrap();
        let child = Command::new(BUTTER)
            .arg("mount")
            .arg("--ro")
            .arg(img)
            .arg(dir)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn butter mount");
        let mut m = ButterMount {
            child: Some(child),
            dir,
        };
        let t0 = Instant::now();
        while !is_mountpoint(dir) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                m.child = None;
                panic!("butter mount exited before mounting: {st}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "butter mount did not mount within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    /// Unmounts with fusermount3 and checks the process exits cleanly.
    fn stop(mut self) {
        let st = Command::new("fusermount3")
            .arg("-u")
            .arg(self.dir)
            .status()
            .unwrap();
        assert!(st.success(), "fusermount3 -u failed");
        let mut child = self.child.take().unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                assert!(st.success(), "butter mount exited with {st}");
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "butter mount did not exit after unmount"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ButterMount<'_> {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(self.dir)
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Levels of the fs tree and the extent tree root, read with butter's engine.
fn tree_levels(img: &Path) -> (u8, u8) {
    let fs = butter::fs::Fs::open(img).unwrap();
    let lvl = |id| fs.find_root_item(id).unwrap().unwrap().level;
    (
        lvl(butter::format::FS_TREE_OBJECTID),
        lvl(common::damage::ondisk::EXTENT_TREE),
    )
}

fn oracle(name: &str, scale: Scale) {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new(&format!("oracle-{name}"));
    let v = variant(name);
    let full = matches!(scale, Scale::Full);
    let img = build_variant_image_with(v, scratch.path(), 0xB077E5, scale);
    if name == "nodesize-4k" && full {
        // Ten thousand small non-inline files: one data extent each, so the extent tree grows
        // past one level of nodes at 4 KiB.
        let m = LoopMount::btrfs(&img, &scratch.join("grow"), "noatime");
        let d = m.path().join("extents");
        std::fs::create_dir(&d).unwrap();
        for i in 0..10_000u32 {
            let body: Vec<u8> = (0..4100u32)
                .map(|j| (i.wrapping_mul(31) ^ j) as u8)
                .collect();
            std::fs::write(d.join(format!("e{i}")), body).unwrap();
        }
        m.unmount();
    }
    let opts = TakeOpts::default();
    let want = kernel_manifest(&img, &scratch.join("kmnt"), &opts);
    assert!(
        want.len() > 1000,
        "the generator made only {} entries",
        want.len()
    );
    if full {
        let big = want
            .entries
            .keys()
            .filter(|p| p.starts_with(BIG_DIR))
            .count();
        assert!(big > 19_000, "the big directory has only {big} entries");
    }
    if name == "nodesize-4k" && full {
        let (fs_level, extent_level) = tree_levels(&img);
        assert!(
            fs_level >= 2 && extent_level >= 2,
            "fs tree level {fs_level}, extent tree level {extent_level}"
        );
    }

    // butter's checker finds the kernel-written image clean.
    let o = Command::new(BUTTER)
        .arg("check")
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "butter check on the kernel image: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );

    // butter restore into a tmpfs (it holds every inode kind and large xattrs).
    let tmp = TmpfsMount::new(&scratch.join("restore"), 4 << 30);
    let out = tmp.path().join("out");
    let o = Command::new(BUTTER)
        .arg("restore")
        .arg(&img)
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "butter restore failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let got = take(&out, &opts);
    assert_same(
        &want,
        &got,
        &CompareOpts::restore(),
        &format!("{name}: kernel mount vs butter restore"),
    );
    drop(tmp);

    // butter mount --ro.
    let mdir = scratch.join("bmnt");
    let m = ButterMount::start(&img, &mdir);
    let got = take(&mdir, &opts);
    m.stop();
    assert_same(
        &want,
        &got,
        &CompareOpts::fuse(),
        &format!("{name}: kernel mount vs butter mount --ro"),
    );
}

macro_rules! variants {
    ($($f:ident => $n:literal),* $(,)?) => {
        $( #[test] fn $f() { oracle($n, Scale::from_env()); } )*
    };
}

// Two variants always run at full scale: a directory of 20000 entries, and (at 4 KiB nodes)
// fs and extent trees of level two or more.
#[test]
fn defaults_full() {
    oracle("defaults", Scale::Full);
}

#[test]
fn nodesize_4k_full() {
    oracle("nodesize-4k", Scale::Full);
}

variants! {
    nodesize_16k => "nodesize-16k",
    nodesize_64k => "nodesize-64k",
    csum_xxhash => "csum-xxhash",
    csum_sha256 => "csum-sha256",
    csum_blake2 => "csum-blake2",
    no_holes_off => "holes",
    skinny_off => "fat-metadata",
    free_space_tree_off => "no-fst",
    block_group_tree => "block-group-tree",
}
