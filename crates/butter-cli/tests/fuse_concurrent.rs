//! Many threads through one read-write `butter mount` at once, where the engine's gate lets
//! them overlap: four writers stream large and small writes, overwrites, truncates and
//! fsyncs into a file each (their data goes to the device out of the gate; writes of 128 KiB
//! and more run on the mount's bulk lanes, one per CPU, which files share), while two others
//! create, read back and unlink small files. Every byte each thread reads back matches its
//! own model of the file, on the mount and again after the unmount, in the kernel's view.
//!
//! Afterwards: `butter check` and `btrfs check --readonly` clean, and a kernel mount shows the
//! same tree as the butter mount did.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs and fusermount3. Without
//! them: a notice and a pass, or a failure under CI.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::ScratchDir;
use common::manifest::{self, TakeOpts};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

const IMAGE_SIZE: u64 = 1 << 30;

/// A small deterministic generator (each thread its own).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// One file written by one thread: returns what it must hold.
fn stream_writer(dir: &Path, t: u64) -> Vec<u8> {
    let path = dir.join(format!("stream{t}"));
    let f = OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let mut rng = Rng(t * 7919 + 17);
    let mut model: Vec<u8> = Vec::new();
    for i in 0..80u64 {
        let len = [4096u64, 100_000, 1 << 20, 3 << 20][rng.below(4) as usize] as usize;
        let off = if rng.below(2) == 0 {
            model.len()
        } else {
            rng.below(model.len() as u64 + 1) as usize
        };
        let byte = (i as u8).wrapping_mul(31).wrapping_add(t as u8);
        let data = vec![byte; len];
        f.write_all_at(&data, off as u64).unwrap();
        if model.len() < off + len {
            model.resize(off + len, 0);
        }
        model[off..off + len].copy_from_slice(&data);
        if i % 27 == 26 {
            let to = rng.below(model.len() as u64 + 1);
            f.set_len(to).unwrap();
            model.truncate(to as usize);
        }
        if i % 20 == 0 {
            f.sync_all().unwrap();
        }
        if i % 9 == 0 && !model.is_empty() {
            // Read back a window while the other threads keep writing.
            let at = rng.below(model.len() as u64) as usize;
            let n = (model.len() - at).min(200_000);
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, at as u64).unwrap();
            assert!(
                buf == model[at..at + n],
                "stream{t}: read back differs at {at}"
            );
        }
    }
    let got = std::fs::read(&path).unwrap();
    assert!(
        got == model,
        "stream{t} differs from its model on the mount"
    );
    model
}

/// Creates, reads back and unlinks small files; returns the names that stay, with content.
fn small_files(dir: &Path, t: u64) -> Vec<(String, Vec<u8>)> {
    let sub = dir.join(format!("small{t}"));
    std::fs::create_dir(&sub).unwrap();
    let mut kept = Vec::new();
    for i in 0..300u64 {
        let name = format!("f{i}");
        let data = vec![(i % 251) as u8; (i * 37 % 9000 + 1) as usize];
        std::fs::write(sub.join(&name), &data).unwrap();
        if i % 3 == 0 {
            assert_eq!(std::fs::read(sub.join(&name)).unwrap(), data, "{name}");
        }
        if i % 7 == 0 {
            std::fs::remove_file(sub.join(&name)).unwrap();
        } else {
            kept.push((format!("small{t}/{name}"), data));
        }
    }
    kept
}

#[test]
fn threads_overlap_through_the_mount_and_lose_nothing() {
    if !fuse_mount::require("fuse_concurrent", &[]) {
        return;
    }
    let scratch = ScratchDir::new("fuse-concurrent");
    let img = scratch.join("butter.img");
    File::create(&img).unwrap().set_len(IMAGE_SIZE).unwrap();
    let st = std::process::Command::new(fuse_mount::BUTTER)
        .args(["mkfs", "-q"])
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success(), "butter mkfs failed");
    let bm = ButterMount::start(
        &img,
        &scratch.join("bmnt"),
        &[],
        &scratch.join("butter.log"),
    );
    let dir = bm.path().to_path_buf();
    let streams: Vec<_> = (0..4u64)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || stream_writer(&dir, t))
        })
        .collect();
    let smalls: Vec<_> = (0..2u64)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || small_files(&dir, t))
        })
        .collect();
    let models: Vec<Vec<u8>> = streams.into_iter().map(|h| h.join().unwrap()).collect();
    let kept: Vec<(String, Vec<u8>)> = smalls.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let seen = manifest::take(bm.path(), &TakeOpts::default());
    bm.unmount();
    let kmnt = scratch.join("kmnt");
    fuse_mount::verify_image(&img, &kmnt, Some(&seen), "after concurrent threads");
    // The kernel's view has each thread's exact bytes.
    let m = common::kernel::LoopMount::btrfs_ro(&img, &kmnt);
    for (t, model) in models.iter().enumerate() {
        let got = std::fs::read(m.path().join(format!("stream{t}"))).unwrap();
        assert!(got == *model, "stream{t} differs in the kernel's view");
    }
    for (name, data) in &kept {
        assert_eq!(&std::fs::read(m.path().join(name)).unwrap(), data, "{name}");
    }
    m.unmount();
}
